//! Typed values out of `toml`'s spanned tree, and every problem with its
//! file:line:col.
//!
//! A [`Keys`] hands out the keys of one table one [`Keys::take`] at a time;
//! whatever is left when it is dropped is reported as an unknown key, listing
//! the table's keys in [`super::keys`]. A read of a key that is not there is
//! a bug, which a debug build stops at (every test that reads the section);
//! a key there that is not read (a misspelt `take("intervl")`) is left, and
//! reported as unknown (a test gives every key of the table). Every typed read
//! records its problem and returns the default, so a section is always
//! complete and `parse` fails exactly when a problem was recorded.
//!
//! This knows TOML and the shapes of values (strings, durations, numbers,
//! regular expressions, URLs); it must not know what any key means.

use std::borrow::Cow;
use std::ops::RangeInclusive;
use std::path::{Path, PathBuf};
use std::time::Duration;

use humantime::format_duration;

use regex::{Regex, RegexSet};
use toml::Spanned;
use toml::de::{DeTable, DeValue};

use super::problem::Problem;

pub(super) type Span = std::ops::Range<usize>;
pub(super) type Table<'t> = DeTable<'t>;
pub(super) type Value<'t> = Spanned<DeValue<'t>>;
type Key<'t> = Spanned<Cow<'t, str>>;

/// Records the problems of one file.
pub(super) struct Reader<'a> {
    text: &'a str,
    file: &'a Path,
    problems: Vec<Problem>,
}

impl<'a> Reader<'a> {
    pub(crate) fn new(text: &'a str, file: &'a Path) -> Reader<'a> {
        Reader { text, file, problems: Vec::new() }
    }

    pub(crate) fn problem(&mut self, span: Option<Span>, message: impl Into<String>) {
        let p = self.at(span, message.into());
        self.problems.push(p);
    }

    fn at(&self, span: Option<Span>, message: String) -> Problem {
        let at = span.map(|s| line_col(self.text, s.start));
        Problem { file: self.file.to_path_buf(), at, message }
    }

    pub(crate) fn into_problems(self) -> Vec<Problem> {
        self.problems
    }

    /// The keys of a top-level section: `v` is `[name]`'s value, if given.
    /// A section that is not a table is a problem, and reads as empty.
    pub(crate) fn section<'r, 't>(&'r mut self, v: Option<&'t Value<'t>>, name: &'static str) -> Keys<'r, 'a, 't> {
        let table = v.and_then(|v| self.table(v, name));
        Keys::new(self, table, v.map(|v| v.span()), name, format!(" in [{name}]"))
    }

    pub(crate) fn string(&mut self, v: &Value<'_>, key: &str) -> Option<String> {
        match v.get_ref() {
            DeValue::String(s) => Some(s.to_string()),
            other => {
                self.problem(Some(v.span()), format!("`{key}` must be a string, not {}", other.type_str()));
                None
            }
        }
    }

    pub(crate) fn boolean(&mut self, v: &Value<'_>, key: &str) -> Option<bool> {
        match v.get_ref() {
            DeValue::Boolean(b) => Some(*b),
            other => {
                self.problem(Some(v.span()), format!("`{key}` must be true or false, not {}", other.type_str()));
                None
            }
        }
    }

    pub(crate) fn strings(&mut self, v: &Value<'_>, key: &str) -> Option<Vec<String>> {
        let DeValue::Array(items) = v.get_ref() else {
            self.problem(Some(v.span()), format!("`{key}` must be an array of strings"));
            return None;
        };
        let mut out = Vec::new();
        let mut ok = true;
        for item in items.iter() {
            match self.string(item, key) {
                Some(s) => out.push(s),
                None => ok = false,
            }
        }
        ok.then_some(out)
    }

    /// The valid regular expressions of an array; each invalid one is a
    /// problem at its place.
    pub(crate) fn patterns(&mut self, v: &Value<'_>, key: &str) -> Vec<String> {
        let DeValue::Array(items) = v.get_ref() else {
            self.problem(Some(v.span()), format!("`{key}` must be an array of regular expressions"));
            return Vec::new();
        };
        items.iter().filter_map(|item| self.regex(item, key)).collect()
    }

    /// One regular expression.
    pub(crate) fn regex(&mut self, v: &Value<'_>, key: &str) -> Option<String> {
        let s = self.string(v, key)?;
        match Regex::new(&s) {
            Ok(_) => Some(s),
            Err(e) => {
                self.problem(Some(v.span()), format!("`{key}`: invalid regular expression {s:?}: {}", last_line(&e)));
                None
            }
        }
    }

    /// A duration within `range`; `name` is the dotted name a value out of
    /// range is reported under.
    pub(crate) fn duration(
        &mut self,
        v: &Value<'_>,
        key: &str,
        name: &str,
        range: &RangeInclusive<Duration>,
    ) -> Option<Duration> {
        let s = self.string(v, key)?;
        let d = match humantime::parse_duration(&s) {
            Ok(d) => d,
            Err(e) => {
                self.problem(
                    Some(v.span()),
                    format!("`{key}`: invalid duration {s:?}: {e} (write e.g. \"90s\", \"15m\")"),
                );
                return None;
            }
        };
        if range.contains(&d) {
            return Some(d);
        }
        if d.is_zero() {
            self.problem(Some(v.span()), format!("`{key}` must be longer than 0s"));
        } else {
            let (min, max) = (format_duration(*range.start()), format_duration(*range.end()));
            self.problem(Some(v.span()), format!("`{name}` must be from {min} to {max}, not {s:?}"));
        }
        None
    }

    pub(crate) fn integer(&mut self, v: &Value<'_>, key: &str, max: i64) -> Option<i64> {
        let parsed = match v.get_ref() {
            DeValue::Integer(i) => parse_int(i.as_str(), i.radix()),
            _ => None,
        };
        match parsed {
            Some(n) if (0..=max).contains(&n) => Some(n),
            _ => {
                self.problem(Some(v.span()), format!("`{key}` must be an integer from 0 to {max}"));
                None
            }
        }
    }

    pub(crate) fn float(&mut self, v: &Value<'_>, key: &str, min: f64, max: f64) -> Option<f64> {
        let parsed = match v.get_ref() {
            DeValue::Float(f) => f.as_str().replace('_', "").parse::<f64>().ok(),
            DeValue::Integer(i) => parse_int(i.as_str(), i.radix()).map(|n| n as f64),
            _ => None,
        };
        match parsed {
            Some(x) if x >= min && x <= max => Some(x),
            _ => {
                self.problem(Some(v.span()), format!("`{key}` must be a number from {min} to {max}"));
                None
            }
        }
    }

    pub(crate) fn table<'t>(&mut self, v: &'t Value<'t>, key: &str) -> Option<&'t Table<'t>> {
        match v.get_ref() {
            DeValue::Table(t) => Some(t),
            _ => {
                self.problem(Some(v.span()), format!("`{key}` must be a table"));
                None
            }
        }
    }

    /// `""` is `None` (off).
    pub(crate) fn url(&mut self, v: &Value<'_>, key: &str) -> Option<Option<String>> {
        let s = self.string(v, key)?;
        if s.is_empty() {
            return Some(None);
        }
        if !(s.starts_with("http://") || s.starts_with("https://")) {
            self.problem(Some(v.span()), format!("`{key}` must be an http:// URL or \"\" (off), not {s:?}"));
            return None;
        }
        Some(Some(s))
    }
}

/// A key that was asked for.
struct Taken {
    key: &'static str,
    /// Where its value is, when the file gives it.
    span: Option<Span>,
    /// False when reading its value recorded a problem.
    ok: bool,
}

/// The keys of one table, taken one by one. Dropping it reports what is
/// left as unknown keys, placed before the problems of this table's values.
pub(super) struct Keys<'r, 'a, 't> {
    r: &'r mut Reader<'a>,
    /// The section's name, as dotted names in messages start
    /// (`ready` → `ready.log`) and as [`super::keys`] places its keys
    /// (`""`: the top level).
    section: &'static str,
    /// Where unknown keys are said to be: `" in [child]"`.
    place: String,
    /// The table's place, for problems about a missing key.
    span: Option<Span>,
    left: Vec<(&'t Key<'t>, &'t Value<'t>)>,
    taken: Vec<Taken>,
    /// Where this table's problems start in the reader's list.
    start: usize,
}

impl<'r, 'a, 't> Keys<'r, 'a, 't> {
    pub(crate) fn new(
        r: &'r mut Reader<'a>,
        table: Option<&'t Table<'t>>,
        span: Option<Span>,
        section: &'static str,
        place: String,
    ) -> Keys<'r, 'a, 't> {
        let start = r.problems.len();
        let left = table.map(|t| t.iter().collect()).unwrap_or_default();
        Keys { r, section, place, span, left, taken: Vec::new(), start }
    }

    /// The value of `key`, if the table has it; either way `key` is known.
    pub(crate) fn take(&mut self, key: &'static str) -> Option<&'t Value<'t>> {
        debug_assert!(
            super::keys::known(self.section).contains(&key),
            "`{key}` is read{} but is not in config::keys::KEYS",
            self.place
        );
        let found = self.left.iter().position(|(k, _)| k.get_ref() == key).map(|i| self.left.remove(i).1);
        self.taken.push(Taken { key, span: found.map(|v| v.span()), ok: true });
        found
    }

    /// The value of `key` as `read` makes it; `default` when it is missing,
    /// or when `read` returns `None` (having recorded why).
    pub(crate) fn read<T>(
        &mut self,
        key: &'static str,
        default: T,
        read: impl FnOnce(&mut Reader<'a>, &'t Value<'t>) -> Option<T>,
    ) -> T {
        let Some(v) = self.take(key) else { return default };
        match read(self.r, v) {
            Some(x) => x,
            None => {
                if let Some(t) = self.taken.last_mut() {
                    t.ok = false;
                }
                default
            }
        }
    }

    /// Whether `key` was missing or read without a problem.
    pub(crate) fn ok(&self, key: &str) -> bool {
        self.taken.iter().any(|t| t.key == key && t.ok)
    }

    /// Where the value of `key` is, if the file gives it.
    pub(crate) fn span_of(&self, key: &str) -> Option<Span> {
        self.taken.iter().find(|t| t.key == key).and_then(|t| t.span.clone())
    }

    /// The table's own place.
    pub(crate) fn span(&self) -> Option<Span> {
        self.span.clone()
    }

    pub(crate) fn problem(&mut self, span: Option<Span>, message: impl Into<String>) {
        self.r.problem(span, message);
    }

    pub(crate) fn reader(&mut self) -> &mut Reader<'a> {
        self.r
    }

    /// `section.key`, as messages about patterns and URLs name a key.
    pub(crate) fn dotted(&self, key: &str) -> String {
        format!("{}.{key}", self.section)
    }

    pub(crate) fn path(&mut self, key: &'static str, default: PathBuf) -> PathBuf {
        self.read(key, default, |r, v| r.string(v, key).map(PathBuf::from))
    }

    /// A duration within `range`.
    pub(crate) fn duration(
        &mut self,
        key: &'static str,
        default: Duration,
        range: RangeInclusive<Duration>,
    ) -> Duration {
        let name = self.dotted(key);
        self.read(key, default, |r, v| r.duration(v, key, &name, &range))
    }

    /// An integer of at least `min`.
    pub(crate) fn count(&mut self, key: &'static str, default: u32, min: u32) -> u32 {
        self.read(key, default, |r, v| {
            let n = r.integer(v, key, u32::MAX.into())?;
            if n < min.into() {
                r.problem(Some(v.span()), format!("`{key}` must be at least {min}"));
                return None;
            }
            u32::try_from(n).ok()
        })
    }

    pub(crate) fn number(&mut self, key: &'static str, default: f64, min: f64, max: f64) -> f64 {
        self.read(key, default, |r, v| r.float(v, key, min, max))
    }

    /// An http(s) URL, or `None` for `""`.
    pub(crate) fn url(&mut self, key: &'static str, default: Option<String>) -> Option<String> {
        let name = self.dotted(key);
        self.read(key, default, |r, v| r.url(v, &name))
    }

    /// Adds the valid patterns of `key` to `list` (the effective `what`
    /// list). The list must then still compile as one `RegexSet`, as the
    /// classifier compiles it: patterns that each fit the regex size limit
    /// can exceed it together.
    pub(crate) fn patterns(&mut self, key: &'static str, list: &mut Vec<String>, what: &str) {
        let name = self.dotted(key);
        let Some(v) = self.take(key) else { return };
        let extra = self.r.patterns(v, &name);
        if extra.is_empty() {
            return;
        }
        list.extend(extra);
        if let Err(e) = RegexSet::new(&*list) {
            let message = format!("`{name}`: the effective {what} list cannot be compiled: {}", last_line(&e));
            self.r.problem(Some(v.span()), message);
        }
    }

    /// The table under `key`, if there is one.
    pub(crate) fn table(&mut self, key: &'static str) -> Option<&'t Table<'t>> {
        let v = self.take(key)?;
        let t = self.r.table(v, key);
        if t.is_none()
            && let Some(last) = self.taken.last_mut()
        {
            last.ok = false;
        }
        t
    }
}

impl Drop for Keys<'_, '_, '_> {
    fn drop(&mut self) {
        let names = super::keys::known(self.section);
        let known = names.join(", ");
        let unknown: Vec<Problem> = self
            .left
            .iter()
            .map(|(k, _)| {
                let key = k.get_ref();
                let message = match near_miss(key, names.iter().copied()) {
                    Some(near) => format!("unknown key `{key}`{}: did you mean `{near}`? (known: {known})", self.place),
                    None => format!("unknown key `{key}`{} (known: {known})", self.place),
                };
                self.r.at(Some(k.span()), message)
            })
            .collect();
        let start = self.start.min(self.r.problems.len());
        self.r.problems.splice(start..start, unknown);
    }
}

/// The known key an unknown one most likely misspells: the closest by
/// Jaro-Winkler similarity (kind to the transposed and dropped letters of
/// typing), when it is close enough to be worth saying.
fn near_miss<'k>(unknown: &str, known: impl Iterator<Item = &'k str>) -> Option<&'k str> {
    /// Below this, a suggestion is more often wrong than right.
    const CLOSE: f64 = 0.85;
    known
        .map(|k| (strsim::jaro_winkler(unknown, k), k))
        .filter(|(score, _)| *score >= CLOSE)
        .max_by(|a, b| a.0.total_cmp(&b.0))
        .map(|(_, k)| k)
}

/// 1-based line and column (in characters) of a byte offset.
fn line_col(text: &str, offset: usize) -> (usize, usize) {
    let mut offset = offset.min(text.len());
    while !text.is_char_boundary(offset) {
        offset -= 1;
    }
    let before = &text[..offset];
    let line = before.matches('\n').count() + 1;
    let col = before.rsplit('\n').next().map_or(0, |l| l.chars().count()) + 1;
    (line, col)
}

/// The last line of a regex error: the one that says what is wrong.
pub(super) fn last_line(e: &regex::Error) -> String {
    e.to_string().lines().last().unwrap_or_default().to_string()
}

pub(super) fn parse_int(s: &str, radix: u32) -> Option<i64> {
    let s = s.replace('_', "");
    let digits = if radix == 10 { s.as_str() } else { s.get(2..)? };
    i64::from_str_radix(digits, radix).ok()
}

/// Why a TOML value has no JSON value.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub(super) enum NotJson {
    #[error("integer out of range")]
    IntegerRange,
    #[error("invalid float")]
    Float,
    #[error("JSON has no inf or nan")]
    NotFinite,
}

/// TOML value → JSON value, for `set`.
pub(super) fn to_json(v: &DeValue<'_>) -> Result<serde_json::Value, NotJson> {
    use serde_json::Value as J;
    Ok(match v {
        DeValue::String(s) => J::String(s.to_string()),
        DeValue::Integer(i) => J::from(parse_int(i.as_str(), i.radix()).ok_or(NotJson::IntegerRange)?),
        DeValue::Float(f) => {
            let x: f64 = f.as_str().replace('_', "").parse().map_err(|_| NotJson::Float)?;
            J::from(serde_json::Number::from_f64(x).ok_or(NotJson::NotFinite)?)
        }
        DeValue::Boolean(b) => J::Bool(*b),
        DeValue::Datetime(d) => J::String(d.to_string()),
        DeValue::Array(a) => J::Array(a.iter().map(|x| to_json(x.get_ref())).collect::<Result<_, _>>()?),
        DeValue::Table(t) => {
            let mut m = serde_json::Map::new();
            for (k, x) in t.iter() {
                m.insert(k.get_ref().to_string(), to_json(x.get_ref())?);
            }
            J::Object(m)
        }
    })
}
