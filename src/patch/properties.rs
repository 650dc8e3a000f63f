//! Properties of the patcher over generated JSON documents (varied spacing,
//! line ends, number spellings and escapes, keys with dots and digits) and
//! generated `remove`/`set` paths, existing and missing:
//!
//! - an edit changes no byte outside its span (the value it replaces, the
//!   object or array it removes from or inserts into), keeps every other
//!   member of that container verbatim, reads back as the same edit made
//!   on a `serde_json` value, and done again changes nothing;
//! - on files, apply then revert gives every file back byte for byte (a
//!   Hugging Face symlink as the same symlink), and an apply that fails
//!   leaves every file as it was.

use std::ops::Range;
use std::path::{Path, PathBuf};

use jsonc_parser::ast::Value as Ast;
use jsonc_parser::common::Ranged;
use proptest::prelude::*;
use proptest::sample::{Index, select};
use serde_json::Value;

use super::edit::{self, EditError, Op, Step, steps};
use super::{Applied, Patch, Wait, apply, revert};

/// Whitespace between tokens, as files have it.
fn ws() -> impl Strategy<Value = &'static str> {
    select(vec!["", "", " ", "  ", "\n", "\n  ", "\n    ", "\t", "\n\t", "\r\n  "])
}

fn number() -> impl Strategy<Value = String> {
    prop_oneof![
        select(vec![
            "0",
            "-0",
            "1",
            "-12",
            "1.0",
            "1.50",
            "1e400",
            "1E5",
            "1e+5",
            "-1.5E-07",
            "1e-06",
            "123456789012345678901234567890",
            "0.000001",
        ])
        .prop_map(String::from),
        any::<i64>().prop_map(|n| n.to_string()),
        any::<f64>().prop_filter("finite", |x| x.is_finite()).prop_map(|x| format!("{x:e}")),
    ]
}

/// String literals, spelled as in the file.
fn string() -> impl Strategy<Value = String> {
    select(vec![
        r#""""#,
        r#""x""#,
        r#""caf\u00e9 \/""#,
        r#""a\"b\\c""#,
        r#""\n\t\r\b\f""#,
        r#""\ud83d\ude00""#,
        r#""é ü 漢""#,
        r#""kv_cache_scheme""#,
        r#""\u0000""#,
    ])
    .prop_map(String::from)
}

/// Keys, spelled; the decoded key follows.
fn key() -> impl Strategy<Value = (&'static str, &'static str)> {
    select(vec![
        ("\"a\"", "a"),
        ("\"\\u0061\"", "a"),
        ("\"b\"", "b"),
        ("\"c\"", "c"),
        ("\"a.b\"", "a.b"),
        ("\"0\"", "0"),
        ("\"1\"", "1"),
        ("\"kv\"", "kv"),
        ("\"k\\\"q\"", "k\"q"),
    ])
}

/// A JSON document as text; keys unique within each object.
fn document() -> impl Strategy<Value = String> {
    let leaf = prop_oneof![
        Just("null".to_string()),
        Just("true".to_string()),
        Just("false".to_string()),
        number(),
        string(),
        Just("{}".to_string()),
        Just("[]".to_string()),
    ];
    let value = leaf.prop_recursive(4, 40, 5, |inner| {
        prop_oneof![
            prop::collection::vec((ws(), inner.clone(), ws()), 1..5).prop_map(|items| {
                let parts: Vec<String> = items.into_iter().map(|(a, v, b)| format!("{a}{v}{b}")).collect();
                format!("[{}]", parts.join(","))
            }),
            prop::collection::vec((ws(), key(), ws(), ws(), inner, ws()), 1..5).prop_map(|members| {
                let mut seen = Vec::new();
                let mut parts = Vec::new();
                for (a, (spelled, decoded), b, c, v, d) in members {
                    if !seen.contains(&decoded) {
                        seen.push(decoded);
                        parts.push(format!("{a}{spelled}{b}:{c}{v}{d}"));
                    }
                }
                format!("{{{}}}", parts.join(","))
            }),
        ]
    });
    (ws(), value, ws(), select(vec!["", "\n", "\r\n"])).prop_map(|(a, v, b, end)| format!("{a}{v}{b}{end}"))
}

/// A value to `set`, as a config's TOML gives it.
fn new_value() -> impl Strategy<Value = Value> {
    let leaf = prop_oneof![
        any::<i64>().prop_map(Value::from),
        any::<f64>().prop_filter_map("finite", |x| serde_json::Number::from_f64(x).map(Value::Number)),
        any::<bool>().prop_map(Value::Bool),
        select(vec!["x", "caf\u{e9}", "a\"b", "tab\there", "\u{7f}", "line\nend"]).prop_map(Value::from),
    ];
    leaf.prop_recursive(3, 12, 3, |inner| {
        prop_oneof![
            prop::collection::vec(inner.clone(), 0..3).prop_map(Value::Array),
            prop::collection::vec((select(vec!["x", "y", "a.b"]), inner), 0..3)
                .prop_map(|kv| Value::Object(kv.into_iter().map(|(k, v)| (k.to_string(), v)).collect())),
        ]
    })
}

/// Every dotted path in `v`, with dots inside keys escaped.
fn paths(v: &Value, prefix: &str, out: &mut Vec<String>) {
    let join = |k: &str| {
        let k = k.replace('.', "\\.");
        if prefix.is_empty() { k } else { format!("{prefix}.{k}") }
    };
    match v {
        Value::Object(m) => {
            for (k, x) in m {
                let p = join(k);
                out.push(p.clone());
                paths(x, &p, out);
            }
        }
        Value::Array(a) => {
            for (i, x) in a.iter().enumerate() {
                let p = join(&i.to_string());
                out.push(p.clone());
                paths(x, &p, out);
            }
        }
        _ => {}
    }
}

/// An edit to make: remove or set, at an existing path (picked by index)
/// or at one with a missing key below it.
#[derive(Debug, Clone)]
struct Spec {
    remove: bool,
    at: Index,
    missing: Option<&'static str>,
    value: Value,
}

fn spec() -> impl Strategy<Value = Spec> {
    (
        any::<bool>(),
        any::<Index>(),
        prop::option::weighted(0.3, select(vec!["new", "kv", "0", "z.z", "n\\.d"])),
        new_value(),
    )
        .prop_map(|(remove, at, missing, value)| Spec { remove, at, missing, value })
}

fn path_of(doc: &Value, s: &Spec) -> Option<String> {
    let mut all = Vec::new();
    paths(doc, "", &mut all);
    let base = if all.is_empty() { None } else { Some(s.at.get(&all).clone()) };
    match (base, s.missing) {
        (Some(b), Some(m)) => Some(format!("{b}.{m}")),
        (None, Some(m)) => Some(m.to_string()),
        (Some(b), None) => Some(b),
        (None, None) => None,
    }
}

fn op<'a>(s: &'a Spec, path: &'a str) -> Op<'a> {
    if s.remove { Op::Remove(path) } else { Op::Set(path, &s.value) }
}

fn strict() -> jsonc_parser::ParseOptions {
    jsonc_parser::ParseOptions {
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

/// The span an edit at `steps` may touch, worked out from the tree on its
/// own: the value replaced; else the container removed from or inserted
/// into, with the other members it keeps.
fn span(text: &str, steps: &[Step], remove: bool) -> Option<(Range<usize>, Vec<Range<usize>>)> {
    let collect =
        jsonc_parser::CollectOptions { comments: jsonc_parser::CommentCollectionStrategy::Off, tokens: false };
    let parsed = jsonc_parser::parse_to_ast(text, &collect, &strict()).ok()?;
    let mut node = parsed.value?;
    for (i, step) in steps.iter().enumerate() {
        let last = i + 1 == steps.len();
        let (Step::Key(k) | Step::Index(_, k)) = step;
        let container = node.start()..node.end();
        let members: Vec<(Range<usize>, Ast<'_>, bool)> = match node {
            Ast::Object(o) => {
                o.properties.into_iter().map(|p| (p.range.start..p.range.end, p.value, p.name.as_str() == k)).collect()
            }
            Ast::Array(a) => {
                let n = match step {
                    Step::Index(n, _) => Some(*n),
                    Step::Key(_) => None,
                };
                a.elements.into_iter().enumerate().map(|(i, e)| (e.start()..e.end(), e, Some(i) == n)).collect()
            }
            _ => return None,
        };
        let hit = members.iter().position(|(_, _, hit)| *hit);
        let others = |skip: Option<usize>| {
            members.iter().enumerate().filter(|(i, _)| Some(*i) != skip).map(|(_, (r, _, _))| r.clone()).collect()
        };
        match hit {
            None => return Some((container, others(None))),
            Some(h) if last && remove => return Some((container, others(Some(h)))),
            Some(h) if last => return Some((members[h].1.start()..members[h].1.end(), Vec::new())),
            Some(h) => node = members.into_iter().nth(h)?.1,
        }
    }
    None
}

fn edit_holds(text: &str, specs: &[Spec]) -> Result<(), TestCaseError> {
    let mut model: Value = serde_json::from_str(text).map_err(|e| TestCaseError::fail(format!("generator: {e}")))?;
    let doc = model.clone();
    let owned: Vec<(Spec, String)> = specs.iter().filter_map(|s| path_of(&doc, s).map(|p| (s.clone(), p))).collect();
    let ops: Vec<Op<'_>> = owned.iter().map(|(s, p)| op(s, p)).collect();
    let mut model_ok = true;
    for o in &ops {
        let r = match o {
            Op::Remove(p) => edit::remove(&mut model, p),
            Op::Set(p, v) => edit::set(&mut model, p, v),
        };
        if r.is_err() {
            model_ok = false;
            break;
        }
    }
    match edit::edit(text, &ops) {
        Ok(new) => {
            prop_assert!(model_ok, "the model refused what the editor did");
            let back: Value = serde_json::from_str(&new).map_err(|e| TestCaseError::fail(e.to_string()))?;
            prop_assert_eq!(&back, &model);
            // Done again, it changes nothing, or fails: entries that undo
            // each other, which `plan` refuses.
            match edit::edit(&new, &ops) {
                Ok(again) => prop_assert_eq!(again, new, "done again, it changes something"),
                Err(e) => prop_assert!(matches!(e, EditError::Path { .. }), "{e:?}"),
            }
        }
        Err(EditError::Path { .. }) => prop_assert!(!model_ok, "the editor refused what the model did"),
        Err(e) => return Err(TestCaseError::fail(format!("{e:?}"))),
    }
    // One edit alone: nothing outside its span changes.
    if let Some(first) = ops.first() {
        let path = match first {
            Op::Remove(p) | Op::Set(p, _) => *p,
        };
        if let (Ok(new), Some((span, kept))) =
            (edit::edit(text, &[*first]), span(text, &steps(path), matches!(first, Op::Remove(_))))
            && new != text
        {
            prop_assert!(new.starts_with(&text[..span.start]), "a byte before the span changed");
            prop_assert!(new.ends_with(&text[span.end..]), "a byte after the span changed");
            let mut from = span.start;
            for k in kept {
                let piece = &text[k];
                match new[from..].find(piece) {
                    Some(at) => from += at + piece.len(),
                    None => return Err(TestCaseError::fail(format!("member {piece:?} not kept verbatim"))),
                }
            }
        }
    }
    Ok(())
}

/// A folder for the file property: on tmpfs when there is one, where a
/// sync costs nothing.
fn scratch() -> tempfile::TempDir {
    let shm = Path::new("/dev/shm");
    if shm.is_dir()
        && let Ok(d) = tempfile::tempdir_in(shm)
    {
        return d;
    }
    tempfile::tempdir().expect("a temporary folder")
}

/// Every entry under `dir`: bytes, or `-> target` for a link.
fn tree(dir: &Path) -> Vec<(PathBuf, Vec<u8>)> {
    let mut out = Vec::new();
    let mut todo = vec![dir.to_path_buf()];
    while let Some(d) = todo.pop() {
        let Ok(entries) = std::fs::read_dir(&d) else { continue };
        for e in entries.flatten() {
            let p = e.path();
            let Ok(m) = std::fs::symlink_metadata(&p) else { continue };
            if m.is_dir() {
                todo.push(p);
            } else if m.file_type().is_symlink() {
                let t = std::fs::read_link(&p).unwrap_or_default();
                out.push((p, format!("-> {}", t.display()).into_bytes()));
            } else {
                out.push((p.clone(), std::fs::read(&p).unwrap_or_default()));
            }
        }
    }
    out.sort();
    out
}

fn files_hold(text: &str, specs: &[Spec], cache: bool) -> Result<(), TestCaseError> {
    let doc: Value = serde_json::from_str(text).map_err(|e| TestCaseError::fail(format!("generator: {e}")))?;
    let d = scratch();
    let models = d.path().join("models");
    let (file, second) = if cache {
        let repo = models.join("models--o--m");
        let snap = repo.join("snapshots/r1");
        std::fs::create_dir_all(repo.join("blobs")).map_err(|e| TestCaseError::fail(e.to_string()))?;
        std::fs::create_dir_all(&snap).map_err(|e| TestCaseError::fail(e.to_string()))?;
        std::fs::write(repo.join("blobs/b1"), text).map_err(|e| TestCaseError::fail(e.to_string()))?;
        std::os::unix::fs::symlink("../../blobs/b1", snap.join("config.json"))
            .map_err(|e| TestCaseError::fail(e.to_string()))?;
        (snap.join("config.json"), snap.join("other.json"))
    } else {
        std::fs::create_dir_all(&models).map_err(|e| TestCaseError::fail(e.to_string()))?;
        std::fs::write(models.join("config.json"), text).map_err(|e| TestCaseError::fail(e.to_string()))?;
        (models.join("config.json"), models.join("other.json"))
    };
    std::fs::write(&second, "{\"kv\": 1, \"keep\": [1,2]}\n").map_err(|e| TestCaseError::fail(e.to_string()))?;
    let before = tree(&models);
    let mut patches = Vec::new();
    for s in specs {
        let Some(path) = path_of(&doc, s) else { continue };
        let (remove, set) = if s.remove { (vec![path], vec![]) } else { (vec![], vec![(path, s.value.clone())]) };
        patches.push(Patch { file: file.clone(), remove, set, max_size: None });
    }
    patches.push(Patch { file: second.clone(), remove: vec!["kv".into()], set: vec![], max_size: None });
    let state = d.path().join("state");
    match apply(&patches, &state, Wait::No) {
        Err(_) => {
            prop_assert_eq!(tree(&models), before, "a failed apply changed a file");
        }
        Ok(applied) => {
            prop_assert!(applied.contains(&Applied::Patched(second.clone())));
            let again = apply(&patches, &state, Wait::No).map_err(|e| TestCaseError::fail(e.to_string()))?;
            prop_assert!(again.iter().all(|a| matches!(a, Applied::Unchanged(_))), "{again:?}");
            let done = revert(&patches, &state, false, Wait::No).map_err(|e| TestCaseError::fail(e.to_string()))?;
            prop_assert!(done.restored.contains(&second));
            prop_assert_eq!(tree(&models), before, "apply then revert is not the identity");
            let left: Vec<_> = tree(&state).into_iter().map(|(p, _)| p).collect();
            prop_assert_eq!(left, vec![state.join("patches/lock"), state.join("patches/manifest.json")]);
        }
    }
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(10_000))]

    #[test]
    fn edits_change_nothing_outside_their_span(text in document(), specs in prop::collection::vec(spec(), 1..4)) {
        edit_holds(&text, &specs)?;
    }

    #[test]
    fn apply_then_revert_is_the_identity(
        text in document(),
        specs in prop::collection::vec(spec(), 0..3),
        cache in any::<bool>(),
    ) {
        files_hold(&text, &specs, cache)?;
    }
}

#[test]
fn the_generated_edits_reach_every_outcome() {
    // Without this, generators that only ever made failing edits would
    // leave the spans and the round trip untested.
    use proptest::strategy::ValueTree;
    use proptest::test_runner::TestRunner;
    let mut runner = TestRunner::deterministic();
    let (mut changed, mut same, mut refused, mut spans) = (0, 0, 0, 0);
    for _ in 0..1000 {
        let (Ok(text), Ok(spec)) = (document().new_tree(&mut runner), spec().new_tree(&mut runner)) else { continue };
        let (text, spec) = (text.current(), spec.current());
        let Ok(doc) = serde_json::from_str::<Value>(&text) else { continue };
        let Some(path) = path_of(&doc, &spec) else { continue };
        match edit::edit(&text, &[op(&spec, &path)]) {
            Ok(new) if new != text => {
                changed += 1;
                spans += usize::from(span(&text, &steps(&path), spec.remove).is_some());
            }
            Ok(_) => same += 1,
            Err(_) => refused += 1,
        }
    }
    assert!(changed > 300 && same > 50 && refused > 50, "{changed} changed, {same} unchanged, {refused} refused");
    assert_eq!(spans, changed, "every change has a span to hold it to");
}
