//! JSON edits by dotted path that keep every byte outside the edited span.
//!
//! Each edit is worked out twice. On a `serde_json` value (the model: what
//! the document means, and every error a path can meet, with its message),
//! and on the text, as one splice: the byte range of the value replaced,
//! of the member removed (with the comma that joins it to a neighbour), or
//! the point a new member is inserted at. The spans come from the
//! `jsonc-parser` syntax tree of the text, parsed as strict JSON; the text
//! between them is never rewritten, so number spellings (`1e400`, `1E5`),
//! escapes (`"caf\u00e9 \/"`), spacing, line ends and one-line arrays stay
//! as they were. New values are written in the file's style: its
//! indentation unit and line end, its spacing after `:` and `,`, objects
//! over several lines in a file of several lines, everything on one line in
//! a one-line file or inside a one-line object or array. The edited text
//! must read back as the model says, or nothing is written.
//!
//! Nothing here touches a file.

use std::ops::Range;

use jsonc_parser::ast::{Object, Value as Ast};
use jsonc_parser::common::Ranged;
use jsonc_parser::{CollectOptions, CommentCollectionStrategy, ParseOptions};
use serde_json::Value;

/// One edit of a document.
#[derive(Debug, Clone, Copy)]
pub(crate) enum Op<'a> {
    /// Delete the member at this dotted path; a missing one is fine.
    Remove(&'a str),
    /// Write this value at the dotted path, creating missing objects.
    Set(&'a str, &'a Value),
}

impl Op<'_> {
    fn name(&self) -> &'static str {
        match self {
            Op::Remove(_) => "remove",
            Op::Set(..) => "set",
        }
    }

    fn path(&self) -> &str {
        match self {
            Op::Remove(p) | Op::Set(p, _) => p,
        }
    }
}

/// Why a document could not be edited.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum EditError {
    /// Not JSON: where `serde_json` stopped, and why.
    Json { line: usize, column: usize, message: String },
    /// A path that cannot be followed in this document.
    Path { op: &'static str, path: String, reason: String },
    /// JSON that cannot be edited in place (never expected: the property
    /// tests look for it).
    InPlace(String),
}

/// Apply `ops` in order to `text`. The result is `text` itself when the
/// edits, taken together, change nothing it means (`remove a` then `set a`
/// to the value it had).
pub(crate) fn edit(text: &str, ops: &[Op<'_>]) -> Result<String, EditError> {
    let json = |e: serde_json::Error| EditError::Json {
        line: e.line(),
        column: e.column(),
        message: e.to_string().split(" at line").next().unwrap_or_default().to_string(),
    };
    let mut model: Value = serde_json::from_str(text).map_err(json)?;
    // The model first: every path error, and which edits change anything.
    let mut changes = Vec::with_capacity(ops.len());
    for op in ops {
        let changed = match op {
            Op::Remove(p) => remove(&mut model, p),
            Op::Set(p, v) => set(&mut model, p, v),
        }
        .map_err(|e| EditError::Path { op: op.name(), path: op.path().to_string(), reason: e.to_string() })?;
        changes.push(changed);
    }
    if !changes.contains(&true) || serde_json::from_str::<Value>(text).map_err(json)? == model {
        return Ok(text.to_string());
    }
    let mut out = text.to_string();
    let mut style: Option<Style> = None;
    for op in ops.iter().zip(changes).filter(|(_, changed)| *changed).map(|(op, _)| op) {
        let splice = {
            let ast = parse(&out)?;
            let style = style.get_or_insert_with(|| Style::of(text, &ast));
            let steps = steps(op.path());
            match op {
                Op::Remove(_) => remove_span(&ast, &steps),
                Op::Set(_, v) => set_span(&out, &ast, &steps, v, style),
            }
            .map_err(|e| match e {
                Located::Duplicate(reason) => EditError::Path { op: op.name(), path: op.path().to_string(), reason },
                Located::Lost(why) => EditError::InPlace(why),
            })?
        };
        out.replace_range(splice.range, &splice.text);
    }
    let back: Value =
        serde_json::from_str(&out).map_err(|e| EditError::InPlace(format!("the edited text is not JSON: {e}")))?;
    if back != model {
        return Err(EditError::InPlace("the edited text does not read back as the edit".into()));
    }
    Ok(out)
}

/// The options that make `jsonc-parser` read strict JSON only.
fn strict() -> ParseOptions {
    ParseOptions {
        allow_comments: false,
        allow_loose_object_property_names: false,
        allow_trailing_commas: false,
        allow_missing_commas: false,
        allow_single_quoted_strings: false,
        allow_hexadecimal_numbers: false,
        allow_unary_plus_numbers: false,
        allow_bare_decimal_point_numbers: false,
        allow_non_finite_numbers: false,
        allow_extended_string_escapes: false,
    }
}

fn parse(text: &str) -> Result<Ast<'_>, EditError> {
    let collect = CollectOptions { comments: CommentCollectionStrategy::Off, tokens: false };
    let parsed = jsonc_parser::parse_to_ast(text, &collect, &strict())
        .map_err(|e| EditError::InPlace(format!("the JSON parser of the editor stopped: {e}")))?;
    parsed.value.ok_or_else(|| EditError::InPlace("no value in the document".into()))
}

/// A replacement of one byte range.
struct Splice {
    range: Range<usize>,
    text: String,
}

/// Why the text could not be located.
enum Located {
    /// A key the path names appears more than once in its object: which one
    /// a reader takes is not certain, so neither is edited.
    Duplicate(String),
    /// The tree and the model disagree (never expected).
    Lost(String),
}

fn lost(path: &[Step]) -> Located {
    Located::Lost(format!("`{}` is not where the model says", path_prefix(path)))
}

/// The member `key` of `o`, if it has it once.
fn member<'a, 'b>(o: &'b Object<'a>, key: &str, at: &[Step]) -> Result<Option<usize>, Located> {
    let mut found = o.properties.iter().enumerate().filter(|(_, p)| p.name.as_str() == key).map(|(i, _)| i);
    let first = found.next();
    if found.next().is_some() {
        return Err(Located::Duplicate(format!("`{}` has the key {key:?} more than once", path_prefix(at))));
    }
    Ok(first)
}

/// The value at `steps`, in the tree.
fn node<'a, 'b>(root: &'b Ast<'a>, steps: &[Step]) -> Result<&'b Ast<'a>, Located> {
    let mut node = root;
    for (i, step) in steps.iter().enumerate() {
        node = match (node, step) {
            (Ast::Object(o), Step::Key(k) | Step::Index(_, k)) => {
                let at = member(o, k, &steps[..i])?.ok_or_else(|| lost(&steps[..=i]))?;
                &o.properties[at].value
            }
            (Ast::Array(a), Step::Index(n, _)) => a.elements.get(*n).ok_or_else(|| lost(&steps[..=i]))?,
            _ => return Err(lost(&steps[..=i])),
        };
    }
    Ok(node)
}

/// The member removed with one of the commas beside it: the one after it,
/// or, for the last, the one before it; the only member leaves `{}`.
fn remove_span(root: &Ast<'_>, steps: &[Step]) -> Result<Splice, Located> {
    let (last, parents) = steps.split_last().ok_or_else(|| lost(steps))?;
    let (items, container): (Vec<Range<usize>>, Range<usize>) = match (node(root, parents)?, last) {
        (Ast::Object(o), Step::Key(k) | Step::Index(_, k)) => {
            let at = member(o, k, parents)?.ok_or_else(|| lost(steps))?;
            let items = o.properties.iter().map(|p| p.range.start..p.range.end).collect::<Vec<_>>();
            (rotate(items, at), o.range.start..o.range.end)
        }
        _ => return Err(lost(steps)),
    };
    // `items`: the member removed first, then the one after it (if any),
    // then the one before it (if any).
    let range = match (items.first(), items.get(1), items.get(2)) {
        (Some(only), None, None) if only.start > container.start => container.start + 1..container.end - 1,
        (Some(this), Some(next), _) if next.start > this.start => this.start..next.start,
        (Some(this), Some(prev), _) => prev.end..this.end,
        _ => return Err(lost(steps)),
    };
    Ok(Splice { range, text: String::new() })
}

/// `[item i, the one after it, the one before it]`, those that exist.
fn rotate(items: Vec<Range<usize>>, i: usize) -> Vec<Range<usize>> {
    let mut out = Vec::with_capacity(3);
    out.extend(items.get(i).cloned());
    out.extend(items.get(i + 1).cloned());
    if i > 0 {
        out.extend(items.get(i - 1).cloned());
    }
    out
}

/// The value at `steps` replaced, or the first missing member inserted
/// (with the objects the rest of the path needs around the value).
fn set_span(text: &str, root: &Ast<'_>, steps: &[Step], value: &Value, style: &Style) -> Result<Splice, Located> {
    let mut node = root;
    for (i, step) in steps.iter().enumerate() {
        let last = i + 1 == steps.len();
        // The container the next value sits in.
        let container = node.start()..node.end();
        let next = match (node, step) {
            (Ast::Object(o), Step::Key(k) | Step::Index(_, k)) => match member(o, k, &steps[..i])? {
                Some(at) => &o.properties[at].value,
                None => return Ok(insert(text, o, k, &nest(&steps[i + 1..], value), style)),
            },
            (Ast::Array(a), Step::Index(n, _)) => a.elements.get(*n).ok_or_else(|| lost(&steps[..=i]))?,
            _ => return Err(lost(&steps[..=i])),
        };
        if last {
            let layout = style.layout(text, container, next.start());
            return Ok(Splice { range: next.start()..next.end(), text: style.render(value, &layout) });
        }
        node = next;
    }
    Err(lost(steps))
}

/// `value` inside the objects the keys of `rest` name.
fn nest(rest: &[Step], value: &Value) -> Value {
    rest.iter().rev().fold(value.clone(), |inner, step| {
        let (Step::Key(k) | Step::Index(_, k)) = step;
        let mut m = serde_json::Map::new();
        m.insert(k.clone(), inner);
        Value::Object(m)
    })
}

/// A new last member `key: value` of `o`.
fn insert(text: &str, o: &Object<'_>, key: &str, value: &Value, style: &Style) -> Splice {
    let range = o.range.start..o.range.end;
    let Some(last) = o.properties.last() else {
        // `{}` becomes the object written whole, in the file's style.
        let mut m = serde_json::Map::new();
        m.insert(key.to_string(), value.clone());
        let layout = if style.multiline { Layout::Lines(line_indent(text, range.start)) } else { Layout::Inline };
        return Splice { range, text: style.render(&Value::Object(m), &layout) };
    };
    let key = string(key);
    let at = last.range.end;
    let member = match style.layout(text, range, last.range.start) {
        Layout::Lines(indent) => {
            let value = style.render(value, &Layout::Lines(indent.clone()));
            format!(",{}{indent}{key}{}{value}", style.newline, style.colon)
        }
        Layout::Inline => format!("{}{key}{}{}", style.comma, style.colon, style.render(value, &Layout::Inline)),
    };
    Splice { range: at..at, text: member }
}

/// How a new value is laid out.
#[derive(Debug, Clone)]
enum Layout {
    /// On one line.
    Inline,
    /// Over several lines; the value starts on a line indented this much.
    Lines(String),
}

/// How the file writes JSON, as far as new values need it.
#[derive(Debug, Clone)]
struct Style {
    /// More than one line (a final line end aside).
    multiline: bool,
    /// One level of indentation: the first indented line's.
    unit: String,
    newline: &'static str,
    /// Between a key and its value, as the first member has it.
    colon: String,
    /// Between two members on one line, as the first such pair has it.
    comma: String,
}

impl Style {
    fn of(text: &str, root: &Ast<'_>) -> Style {
        let mut colon = None;
        let mut comma = None;
        let mut todo = vec![root];
        while let Some(n) = todo.pop() {
            if colon.is_some() && comma.is_some() {
                break;
            }
            let items: Vec<Range<usize>> = match n {
                Ast::Object(o) => {
                    if let Some(p) = o.properties.first() {
                        let between = &text[p.name.end()..p.value.start()];
                        if colon.is_none() && !between.contains('\n') {
                            colon = Some(between.to_string());
                        }
                    }
                    todo.extend(o.properties.iter().rev().map(|p| &p.value));
                    o.properties.iter().map(|p| p.range.start..p.range.end).collect()
                }
                Ast::Array(a) => {
                    todo.extend(a.elements.iter().rev());
                    a.elements.iter().map(|e| e.start()..e.end()).collect()
                }
                _ => continue,
            };
            if comma.is_none()
                && let [a, b, ..] = items.as_slice()
            {
                let between = &text[a.end..b.start];
                if !between.contains('\n') {
                    comma = Some(between.to_string());
                }
            }
        }
        let colon = colon.unwrap_or_else(|| ": ".into());
        // No two members on one line: spaced as the colon is.
        let comma = comma.unwrap_or_else(|| if colon.ends_with(' ') { ", ".into() } else { ",".into() });
        Style {
            multiline: text.trim_end().contains('\n'),
            unit: indentation(text).unwrap_or_else(|| "  ".into()),
            newline: if text.contains("\r\n") { "\r\n" } else { "\n" },
            colon,
            comma,
        }
    }

    /// The layout of a value at `at` inside the container spanning
    /// `container`: one line when the file or the container is.
    fn layout(&self, text: &str, container: Range<usize>, at: usize) -> Layout {
        if self.multiline && text[container].contains('\n') {
            Layout::Lines(line_indent(text, at))
        } else {
            Layout::Inline
        }
    }

    fn render(&self, v: &Value, layout: &Layout) -> String {
        match (v, layout) {
            (Value::Array(a), _) if a.is_empty() => "[]".into(),
            (Value::Object(m), _) if m.is_empty() => "{}".into(),
            (Value::Array(a), Layout::Inline) => {
                let items: Vec<String> = a.iter().map(|e| self.render(e, layout)).collect();
                format!("[{}]", items.join(&self.comma))
            }
            (Value::Object(m), Layout::Inline) => {
                let items: Vec<String> =
                    m.iter().map(|(k, e)| format!("{}{}{}", string(k), self.colon, self.render(e, layout))).collect();
                format!("{{{}}}", items.join(&self.comma))
            }
            // Plain values in an array stay on one line.
            (Value::Array(a), Layout::Lines(_))
                if !a.iter().any(|e| {
                    matches!(e, Value::Array(x) if !x.is_empty()) || matches!(e, Value::Object(x) if !x.is_empty())
                }) =>
            {
                self.render(v, &Layout::Inline)
            }
            (Value::Array(a), Layout::Lines(indent)) => {
                let inner = format!("{indent}{}", self.unit);
                let items: Vec<String> = a
                    .iter()
                    .map(|e| format!("{}{inner}{}", self.newline, self.render(e, &Layout::Lines(inner.clone()))))
                    .collect();
                format!("[{}{}{indent}]", items.join(","), self.newline)
            }
            (Value::Object(m), Layout::Lines(indent)) => {
                let inner = format!("{indent}{}", self.unit);
                let items: Vec<String> = m
                    .iter()
                    .map(|(k, e)| {
                        let e = self.render(e, &Layout::Lines(inner.clone()));
                        format!("{}{inner}{}{}{e}", self.newline, string(k), self.colon)
                    })
                    .collect();
                format!("{{{}{}{indent}}}", items.join(","), self.newline)
            }
            (scalar, _) => serde_json::to_string(scalar).unwrap_or_default(),
        }
    }
}

/// A JSON string literal.
fn string(s: &str) -> String {
    serde_json::to_string(s).unwrap_or_default()
}

/// The spaces and tabs that start the line `at` is on.
fn line_indent(text: &str, at: usize) -> String {
    let start = text[..at].rfind('\n').map_or(0, |i| i + 1);
    text[start..].chars().take_while(|c| *c == ' ' || *c == '\t').collect()
}

/// The indentation the file uses: the leading whitespace of its first
/// indented line; `None` for a one-line document.
fn indentation(text: &str) -> Option<String> {
    text.lines()
        .skip(1)
        .map(|l| l.chars().take_while(|c| *c == ' ' || *c == '\t').collect::<String>())
        .find(|w| !w.is_empty())
}

/// One step of a dotted path.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Step {
    Key(String),
    /// Digits: an index into an array, or a key of an object.
    Index(usize, String),
}

/// Split `a.b\.c.0` into `a`, `b.c`, `0`.
pub(crate) fn steps(path: &str) -> Vec<Step> {
    let mut out = Vec::new();
    let mut cur = String::new();
    let mut chars = path.chars().peekable();
    let mut push = |cur: &mut String| {
        let s = std::mem::take(cur);
        match s.parse::<usize>() {
            Ok(i) if !s.is_empty() && s.chars().all(|c| c.is_ascii_digit()) => out.push(Step::Index(i, s)),
            _ => out.push(Step::Key(s)),
        }
    };
    while let Some(c) = chars.next() {
        match c {
            '\\' if chars.peek() == Some(&'.') => {
                cur.push('.');
                chars.next();
            }
            '.' => push(&mut cur),
            c => cur.push(c),
        }
    }
    push(&mut cur);
    out
}

fn kind(v: &Value) -> &'static str {
    match v {
        Value::Null => "null",
        Value::Bool(_) => "a boolean",
        Value::Number(_) => "a number",
        Value::String(_) => "a string",
        Value::Array(_) => "an array",
        Value::Object(_) => "an object",
    }
}

/// Why a path cannot be followed in a document; `at` is the path up to
/// the step that fails.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub(crate) enum PathError {
    #[error("empty path")]
    Empty,
    #[error("`{at}` goes through {kind}")]
    Through { at: String, kind: &'static str },
    #[error("`{at}` is {kind}, not an object")]
    NotAnObject { at: String, kind: &'static str },
    /// The next element would take its place, and go at the next start.
    #[error(
        "`{at}` is an array: removing its element {index} would remove another one at every start (remove a key \
         inside the element, or `set` the array)"
    )]
    ArrayElement { at: String, index: usize },
    #[error("`{at}`: index {index} is past the end ({len} elements)")]
    PastTheEnd { at: String, index: usize, len: usize },
}

/// The model of `Op::Remove`: remove `path`; a missing key is not an
/// error. Returns whether it changed.
pub(crate) fn remove(doc: &mut Value, path: &str) -> Result<bool, PathError> {
    let steps = steps(path);
    let (last, parents) = steps.split_last().ok_or(PathError::Empty)?;
    let mut node = doc;
    for (i, step) in parents.iter().enumerate() {
        node = match (node, step) {
            (Value::Object(m), Step::Key(k) | Step::Index(_, k)) => match m.get_mut(k) {
                Some(v) => v,
                None => return Ok(false),
            },
            (Value::Array(a), Step::Index(n, _)) => match a.get_mut(*n) {
                Some(v) => v,
                None => return Ok(false),
            },
            (other, _) => return Err(PathError::Through { at: path_prefix(&steps[..i]), kind: kind(other) }),
        };
    }
    match (node, last) {
        (Value::Object(m), Step::Key(k) | Step::Index(_, k)) => Ok(m.shift_remove(k).is_some()),
        (Value::Array(_), Step::Index(n, _)) => Err(PathError::ArrayElement { at: path_prefix(parents), index: *n }),
        (other, _) => Err(PathError::NotAnObject { at: path_prefix(parents), kind: kind(other) }),
    }
}

/// The model of `Op::Set`: set `path` to `value`, creating missing objects
/// on the way. Returns whether it changed.
pub(crate) fn set(doc: &mut Value, path: &str, value: &Value) -> Result<bool, PathError> {
    let steps = steps(path);
    let (last, parents) = steps.split_last().ok_or(PathError::Empty)?;
    let mut node = doc;
    for (i, step) in parents.iter().enumerate() {
        let shown = path_prefix(&steps[..=i]);
        node = match (node, step) {
            (Value::Object(m), Step::Key(k) | Step::Index(_, k)) => {
                m.entry(k.clone()).or_insert_with(|| Value::Object(Default::default()))
            }
            (Value::Array(a), Step::Index(n, _)) => {
                let len = a.len();
                a.get_mut(*n).ok_or(PathError::PastTheEnd { at: shown, index: *n, len })?
            }
            (other, _) => return Err(PathError::Through { at: path_prefix(&steps[..i]), kind: kind(other) }),
        };
    }
    let slot = match (node, last) {
        (Value::Object(m), Step::Key(k) | Step::Index(_, k)) => m.entry(k.clone()).or_insert(Value::Null),
        (Value::Array(a), Step::Index(n, _)) => {
            let len = a.len();
            a.get_mut(*n).ok_or_else(|| PathError::PastTheEnd { at: path.to_string(), index: *n, len })?
        }
        (other, _) => return Err(PathError::NotAnObject { at: path_prefix(parents), kind: kind(other) }),
    };
    if slot == value {
        return Ok(false);
    }
    *slot = value.clone();
    Ok(true)
}

fn path_prefix(steps: &[Step]) -> String {
    let parts: Vec<String> = steps
        .iter()
        .map(|s| match s {
            Step::Key(k) | Step::Index(_, k) => k.replace('.', "\\."),
        })
        .collect();
    if parts.is_empty() { "(the document)".into() } else { parts.join(".") }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn paths_split_on_unescaped_dots() {
        assert_eq!(
            steps(r"a.b\.c.0"),
            vec![Step::Key("a".into()), Step::Key("b.c".into()), Step::Index(0, "0".into())]
        );
    }

    #[test]
    fn remove_by_path_and_a_missing_key_is_fine() {
        let mut d = json!({"q": {"kv_cache_quant_algo": "FP8", "x": 1}, "l": [{"n": 1}, {"n": 2}], "a.b": 3});
        assert_eq!(remove(&mut d, "q.kv_cache_quant_algo"), Ok(true));
        assert_eq!(remove(&mut d, "q.kv_cache_quant_algo"), Ok(false));
        assert_eq!(remove(&mut d, "missing.deeper.key"), Ok(false));
        assert_eq!(remove(&mut d, "l.1.n"), Ok(true));
        assert_eq!(remove(&mut d, r"a\.b"), Ok(true));
        assert_eq!(d, json!({"q": {"x": 1}, "l": [{"n": 1}, {}]}));
    }

    #[test]
    fn a_path_through_a_non_object_is_an_error() {
        let mut d = json!({"a": "text", "n": 5});
        assert_eq!(remove(&mut d, "a.b.c").unwrap_err().to_string(), "`a` goes through a string");
        assert!(set(&mut d, "n.m", &json!(1)).unwrap_err().to_string().contains("is a number, not an object"));
    }

    #[test]
    fn set_creates_objects_and_is_idempotent() {
        let mut d = json!({"a": 1});
        assert_eq!(set(&mut d, "b.c", &json!([1, 2])), Ok(true));
        assert_eq!(set(&mut d, "b.c", &json!([1, 2])), Ok(false));
        assert_eq!(d, json!({"a": 1, "b": {"c": [1, 2]}}));
    }

    fn ed(text: &str, ops: &[Op<'_>]) -> String {
        edit(text, ops).unwrap()
    }

    #[test]
    fn a_removed_member_takes_one_comma_with_it() {
        let text = "{\n    \"zeta\": 1,\n    \"eps\": 1e-05,\n    \"kv\": \"x\"\n}\n";
        assert_eq!(ed(text, &[Op::Remove("kv")]), "{\n    \"zeta\": 1,\n    \"eps\": 1e-05\n}\n");
        assert_eq!(ed(text, &[Op::Remove("zeta")]), "{\n    \"eps\": 1e-05,\n    \"kv\": \"x\"\n}\n");
        assert_eq!(ed(text, &[Op::Remove("eps")]), "{\n    \"zeta\": 1,\n    \"kv\": \"x\"\n}\n");
        assert_eq!(ed("{\"b\":1,\"a\":2}", &[Op::Remove("a")]), "{\"b\":1}");
        assert_eq!(ed("{\"a\": {\"only\": 1}}", &[Op::Remove("a.only")]), "{\"a\": {}}");
    }

    #[test]
    fn an_array_element_is_not_removed_by_index() {
        let e = edit("{\"l\": [1, 2, 3]}", &[Op::Remove("l.1")]).unwrap_err();
        assert!(
            matches!(&e, EditError::Path { reason, .. } if reason.starts_with("`l` is an array: removing its element 1")),
            "{e:?}"
        );
    }

    #[test]
    fn spellings_outside_the_edit_are_kept() {
        let text = "{\"big\": 1e400, \"e\": 1E5, \"s\": \"caf\\u00e9 \\/\", \"arr\": [1,2,  3], \"kv\": 1}";
        let want = "{\"big\": 1e400, \"e\": 1E5, \"s\": \"caf\\u00e9 \\/\", \"arr\": [1,2,  3]}";
        assert_eq!(ed(text, &[Op::Remove("kv")]), want);
    }

    #[test]
    fn new_values_follow_the_files_style() {
        let v = json!({"x": [1, 2], "y": {"z": true}});
        let text = "{\r\n\t\"a\": 1\r\n}\r\n";
        assert_eq!(
            ed(text, &[Op::Set("b", &v)]),
            "{\r\n\t\"a\": 1,\r\n\t\"b\": {\r\n\t\t\"x\": [1, 2],\r\n\t\t\"y\": {\r\n\t\t\t\"z\": true\r\n\t\t}\r\n\t}\r\n}\r\n"
        );
        assert_eq!(ed("{\"a\":1}", &[Op::Set("b.c", &v)]), "{\"a\":1,\"b\":{\"c\":{\"x\":[1,2],\"y\":{\"z\":true}}}}");
        assert_eq!(ed("{}\n", &[Op::Set("a", &json!(1))]), "{\"a\": 1}\n");
        assert_eq!(ed("{\n  \"q\": {}\n}", &[Op::Set("q.k", &json!("v"))]), "{\n  \"q\": {\n    \"k\": \"v\"\n  }\n}");
        assert_eq!(ed("{\n  \"n\": 262144\n}", &[Op::Set("n", &json!(131072))]), "{\n  \"n\": 131072\n}");
    }

    #[test]
    fn a_duplicate_key_on_the_path_is_refused() {
        let e = edit("{\"a\": 1, \"a\": 2}", &[Op::Set("a", &json!(3))]).unwrap_err();
        assert_eq!(
            e,
            EditError::Path {
                op: "set",
                path: "a".into(),
                reason: "`(the document)` has the key \"a\" more than once".into()
            }
        );
    }

    #[test]
    fn nothing_to_change_gives_the_text_back() {
        let text = "{\"a\": 1.0}";
        assert_eq!(ed(text, &[Op::Remove("b"), Op::Set("a", &json!(1.0))]), text);
    }
}
