//! The fault catalogue (docs/operator-guide.md, "The fault catalogue", and
//! vllm-warden(8), FAULTS) held to the tests: every row names at least one
//! proof, each proof names a test function that exists in the file it
//! names (or a script that exists, with the check or the step it names),
//! the kind of what it ran against is one of the known ones, and the two
//! tables are the same. Read from the source text, as `layers.rs` reads
//! the code.

use std::collections::BTreeMap;
use std::path::Path;

const KINDS: &[&str] =
    &["real vLLM", "real vLLM log", "real kernel", "simulator", "scripted child", "unit test", "not run: needs a GPU"];

fn read(rel: &str) -> String {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join(rel);
    std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

/// The rows of the catalogue's table in `doc`, under the heading `heading`:
/// each row's cells.
fn rows(doc: &str, heading: &str) -> Vec<Vec<String>> {
    let at = doc.find(heading).unwrap_or_else(|| panic!("no {heading:?}"));
    let table = doc[at..].lines().skip_while(|l| !l.starts_with("| fault |")).take_while(|l| l.starts_with('|'));
    let cells = |l: &str| -> Vec<String> {
        // A `|` inside backticks is no cell border.
        let (mut out, mut cell, mut code) = (Vec::new(), String::new(), false);
        for ch in l.trim().trim_matches('|').chars() {
            match ch {
                '`' => {
                    code = !code;
                    cell.push(ch);
                }
                '|' if !code => out.push(std::mem::take(&mut cell).trim().to_string()),
                _ => cell.push(ch),
            }
        }
        out.push(cell.trim().to_string());
        out
    };
    table.skip(2).map(cells).collect()
}

/// One proof of a row: `` `tests/x.rs::name` (kind) ``, or a script with
/// what of it proves the row: `` `tests/gpu/x.sh` step (kind) ``,
/// `` `tests/systemd/inside.sh` "check" (kind) ``.
#[derive(Debug, PartialEq)]
struct Proof {
    file: String,
    what: Option<String>,
    kind: String,
}

fn proofs(cell: &str) -> Result<Vec<Proof>, String> {
    let mut out = Vec::new();
    for entry in cell.split("; ") {
        let entry = entry.trim();
        let (named, rest) = entry
            .strip_prefix('`')
            .and_then(|e| e.split_once('`'))
            .ok_or_else(|| format!("{entry:?}: no `file` or `file::test`"))?;
        let (what_text, kind) = rest
            .trim()
            .rsplit_once(" (")
            .map(|(a, k)| (a.trim(), k))
            .or_else(|| rest.trim().strip_prefix('(').map(|k| ("", k)))
            .ok_or_else(|| format!("{entry:?}: no (kind)"))?;
        let kind = kind.strip_suffix(')').ok_or_else(|| format!("{entry:?}: no (kind)"))?.to_string();
        if !KINDS.contains(&kind.as_str()) {
            return Err(format!("{entry:?}: kind {kind:?} is not one of {KINDS:?}"));
        }
        let (file, what) = match named.split_once("::") {
            Some((f, t)) => (f.to_string(), Some(t.to_string())),
            None => (named.to_string(), (!what_text.is_empty()).then(|| what_text.trim_matches('"').to_string())),
        };
        out.push(Proof { file, what, kind });
    }
    Ok(out)
}

/// Why `p` proves nothing: its file, its test, its script's step or check
/// not there.
fn missing(p: &Proof) -> Option<String> {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join(&p.file);
    let Ok(text) = std::fs::read_to_string(&path) else { return Some(format!("{}: no such file", p.file)) };
    if p.file.ends_with(".rs") {
        let Some(name) = &p.what else { return Some(format!("{}: no test named", p.file)) };
        let defined = [format!("fn {name}("), format!("fn {name}<")].iter().any(|d| text.contains(d.as_str()));
        return (!defined).then(|| format!("{}: no test `{name}`", p.file));
    }
    match &p.what {
        Some(what) if !text.contains(what.as_str()) => Some(format!("{}: says nothing of {what:?}", p.file)),
        _ => None,
    }
}

fn check(rows: &[Vec<String>]) -> Vec<String> {
    let mut problems = Vec::new();
    for row in rows {
        let [fault, _, _, _, proven] = &row[..] else {
            problems.push(format!("{row:?}: not five cells"));
            continue;
        };
        match proofs(proven) {
            Err(e) => problems.push(format!("{fault}: {e}")),
            Ok(list) => problems.extend(list.iter().filter_map(missing).map(|m| format!("{fault}: {m}"))),
        }
    }
    problems
}

#[test]
fn every_row_of_the_catalogue_names_a_test_that_exists() {
    let guide = rows(&read("docs/operator-guide.md"), "## The fault catalogue");
    let man = rows(&read("docs/vllm-warden.8.md"), "# FAULTS");
    assert!(guide.len() >= 20, "{} rows", guide.len());
    assert_eq!(guide, man, "the operator's guide and vllm-warden(8) list the same faults");
    let problems = check(&guide);
    assert!(problems.is_empty(), "{}", problems.join("\n"));
    let mut kinds: BTreeMap<String, usize> = BTreeMap::new();
    for row in &guide {
        for p in proofs(&row[4]).unwrap() {
            *kinds.entry(p.kind).or_default() += 1;
        }
    }
    eprintln!("the catalogue: {} faults; proofs by kind: {kinds:?}", guide.len());
}

/// A row that names a test that is not there, or a kind that is not one,
/// fails the check.
#[test]
fn a_row_naming_a_test_that_does_not_exist_fails() {
    let row = |proof: &str| vec![vec!["x".into(), "d".into(), "f".into(), "a".into(), proof.to_string()]];
    let gone = check(&row("`tests/recheck.rs::no_such_test` (simulator)"));
    assert_eq!(gone, ["x: tests/recheck.rs: no test `no_such_test`"]);
    assert_eq!(check(&row("`tests/nowhere.rs::t` (simulator)")), ["x: tests/nowhere.rs: no such file"]);
    assert!(check(&row("`tests/recheck.rs::golden_interval_rechecks_on_a_timer` (on paper)"))[0].contains("kind"));
    assert!(check(&row("`tests/systemd/inside.sh` \"no such check\" (real kernel)"))[0].contains("says nothing of"));
    assert!(check(&row("`tests/recheck.rs::golden_interval_rechecks_on_a_timer` (simulator)")).is_empty());
}
