//! The architecture, held to the code: the folders of `src/` are layers,
//! and a file may use its own layer and the ones below, never one above;
//! no files use each other in a circle, in `src/` or in the core
//! (`core/src/`); the core does no I/O. That the core uses nothing of the
//! daemon's, and no tokio or nix, the compiler holds: it is a package of
//! its own, without them.
//! Read from the source text (`crate::` paths outside comments), so it
//! runs without building anything else: `cargo nextest run -E
//! 'binary(layers)'`. `docs/architecture.md` draws the same layers, and
//! its table names every file.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

/// From the top down. `lib.rs` and `main.rs` stand above them all.
const LAYERS: [&str; 8] = ["cli", "daemon", "tell", "observe", "process", "config", "patch", "util"];

/// What the core must not name, though the standard library has it:
/// files, processes, sockets, threads, the environment, the clock.
const NOT_IN_THE_CORE: [&str; 10] = [
    "std::fs",
    "std::net",
    "std::thread",
    "std::os",
    "std::env",
    "std::process::Command",
    "std::process::Child",
    "std::time::Instant::now",
    "SystemTime",
    "std::io::std",
];

struct File {
    path: PathBuf,
    /// `tell::reports::parts` for `src/tell/reports/parts.rs`.
    module: String,
    /// The code without comments, tests cut off.
    code: String,
}

/// The files of `src/`.
fn files() -> Vec<File> {
    files_of("src")
}

/// The files of a package's source folder (`src`, `core/src`).
fn files_of(root: &str) -> Vec<File> {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join(root);
    let mut out = Vec::new();
    let mut todo = vec![src.clone()];
    while let Some(dir) = todo.pop() {
        for e in std::fs::read_dir(&dir).unwrap() {
            let path = e.unwrap().path();
            if path.is_dir() {
                todo.push(path);
                continue;
            }
            let rel = path.strip_prefix(&src).unwrap().with_extension("");
            let parts: Vec<String> = rel.iter().map(|p| p.to_string_lossy().into_owned()).collect();
            // Test modules may reach anywhere; they are not the architecture.
            if path.extension().is_none_or(|x| x != "rs") || parts.last().is_some_and(|p| p == "tests") {
                continue;
            }
            let module = parts.iter().filter(|p| *p != "mod").cloned().collect::<Vec<_>>().join("::");
            let text = std::fs::read_to_string(&path).unwrap();
            out.push(File { path, module, code: code_of(&text) });
        }
    }
    out.sort_by(|a, b| a.module.cmp(&b.module));
    out
}

/// The text without `//` comments and without the items under a
/// top-level `#[cfg(test)]` (an inline test module ends at its `}`).
fn code_of(text: &str) -> String {
    let mut out = String::new();
    let mut lines = text.lines();
    while let Some(line) = lines.next() {
        if line == "#[cfg(test)]" {
            for item in lines.by_ref() {
                if item == "}" || (!item.starts_with(' ') && item.ends_with(';')) {
                    break;
                }
            }
            continue;
        }
        out.push_str(line.split("//").next().unwrap_or(""));
        out.push('\n');
    }
    out
}

fn layer_of(module: &str) -> Option<usize> {
    let top = module.split("::").next()?;
    LAYERS.iter().position(|l| *l == top)
}

/// The files whose modules a file names, through `crate::` paths: each
/// path taken to the longest module that is a file.
fn uses(f: &File, modules: &BTreeSet<String>) -> BTreeSet<String> {
    let mut out = BTreeSet::new();
    for (i, _) in f.code.match_indices("crate::") {
        let path: String =
            f.code[i + 7..].chars().take_while(|c| c.is_alphanumeric() || *c == '_' || *c == ':').collect();
        let words: Vec<&str> = path.split("::").filter(|w| !w.is_empty()).collect();
        let target = (1..=words.len()).rev().map(|n| words[..n].join("::")).find(|m| modules.contains(m));
        if let Some(t) = target.filter(|t| *t != f.module) {
            out.insert(t);
        }
    }
    out
}

#[test]
fn every_file_is_in_a_layer() {
    let strays: Vec<String> = files()
        .iter()
        .filter(|f| !["lib", "main"].contains(&f.module.as_str()) && layer_of(&f.module).is_none())
        .map(|f| f.path.display().to_string())
        .collect();
    assert!(strays.is_empty(), "files outside the layers {LAYERS:?}: {strays:?}");
}

#[test]
fn no_file_uses_a_layer_above_its_own() {
    let all = files();
    let modules: BTreeSet<String> = all.iter().map(|f| f.module.clone()).collect();
    let mut upward = Vec::new();
    for f in &all {
        let Some(mine) = layer_of(&f.module) else { continue };
        for used in uses(f, &modules) {
            if layer_of(&used).is_some_and(|theirs| theirs < mine) {
                upward.push(format!("{} uses {used}", f.module));
            }
        }
    }
    assert!(upward.is_empty(), "uses of a higher layer:\n{}", upward.join("\n"));
}

#[test]
fn no_files_use_each_other_in_a_circle() {
    no_circle(files());
    no_circle(files_of("core/src"));
}

fn no_circle(all: Vec<File>) {
    let modules: BTreeSet<String> = all.iter().map(|f| f.module.clone()).collect();
    let graph: BTreeMap<String, BTreeSet<String>> = all.iter().map(|f| (f.module.clone(), uses(f, &modules))).collect();
    // Depth-first, the path so far kept: a file met again on it closes a circle.
    fn visit(
        m: &str,
        graph: &BTreeMap<String, BTreeSet<String>>,
        path: &mut Vec<String>,
        done: &mut BTreeSet<String>,
    ) -> Option<Vec<String>> {
        if let Some(at) = path.iter().position(|p| p == m) {
            let mut circle = path[at..].to_vec();
            circle.push(m.to_string());
            return Some(circle);
        }
        if !done.insert(m.to_string()) {
            return None;
        }
        path.push(m.to_string());
        for next in graph.get(m).into_iter().flatten() {
            if let Some(c) = visit(next, graph, path, done) {
                return Some(c);
            }
        }
        path.pop();
        None
    }
    let mut done = BTreeSet::new();
    for m in graph.keys() {
        if let Some(circle) = visit(m, &graph, &mut Vec::new(), &mut done) {
            panic!("a circle: {}", circle.join(" -> "));
        }
    }
}

#[test]
fn the_core_does_no_io() {
    let mut found = Vec::new();
    let core = files_of("core/src");
    assert!(core.len() > 10, "no core read: {}", core.len());
    for f in &core {
        for bad in NOT_IN_THE_CORE {
            if f.code.contains(bad) {
                found.push(format!("{} names {bad}", f.path.display()));
            }
        }
    }
    assert!(found.is_empty(), "I/O in the core:\n{}", found.join("\n"));
}

/// The check can fail: a use of a higher layer, and a circle, are found.
#[test]
fn the_checks_see_what_they_forbid() {
    let modules: BTreeSet<String> =
        ["util::escape", "daemon::server", "supervisor::machine"].iter().map(|s| s.to_string()).collect();
    let f = File {
        path: PathBuf::from("src/util/escape.rs"),
        module: "util::escape".into(),
        code: code_of("use crate::daemon::server::View; // crate::supervisor::machine in a comment\n"),
    };
    let used = uses(&f, &modules);
    assert_eq!(used, BTreeSet::from(["daemon::server".to_string()]));
    assert!(layer_of("daemon::server") < layer_of("util::escape"));
}

/// `docs/architecture.md`'s table of folders names every file of `src/`
/// (but `mod.rs`, `lib.rs`, `main.rs` and test modules), and no file that
/// is not there: `| \`folder/\` | \`a.rs\`, \`b.rs\` (+ \`b/c.rs\`, \`b/d/\`) | … |`,
/// a name ending in `/` standing for a folder's every file.
#[test]
fn the_architecture_documents_table_names_every_file() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let doc = std::fs::read_to_string(root.join("docs/architecture.md")).unwrap();
    let mut named: BTreeSet<String> = BTreeSet::new();
    for line in doc.lines() {
        let cells: Vec<&str> = line.split('|').map(str::trim).collect();
        let Some(folder) = cells.get(1).and_then(|c| c.strip_prefix('`')?.strip_suffix("/`")) else { continue };
        let Some(files) = cells.get(2) else { continue };
        for name in files.split('`').skip(1).step_by(2) {
            named.insert(format!("{folder}/{name}"));
        }
    }
    assert!(named.len() > 20, "no table of folders read from docs/architecture.md: {named:?}");
    let mut unnamed = Vec::new();
    let mut seen = BTreeSet::new();
    // `src/daemon/x.rs` is `daemon/x.rs` in the table, `core/src/load.rs`
    // is `core/load.rs`.
    for (dir, prefix) in [("src", ""), ("core/src", "core/")] {
        let src = root.join(dir);
        for f in files_of(dir) {
            let inner = f.path.strip_prefix(&src).unwrap().to_string_lossy().into_owned();
            let rel = format!("{prefix}{inner}");
            let name = inner.rsplit('/').next().unwrap_or_default();
            if ["lib.rs", "main.rs"].contains(&inner.as_str()) || name == "mod.rs" || f.code.trim().is_empty() {
                seen.insert(rel);
                continue;
            }
            // A test-only module (`#[cfg(test)] mod properties;`) is no part.
            let parent = Path::new(&inner).parent().unwrap();
            let stem = name.trim_end_matches(".rs");
            let declared_in = [src.join(parent).with_extension("rs"), src.join(parent).join("mod.rs")];
            let test_only = declared_in.iter().filter_map(|p| std::fs::read_to_string(p).ok()).any(|t| {
                let decl = format!("mod {stem};");
                t.lines().collect::<Vec<_>>().windows(2).any(|w| w[0].trim() == "#[cfg(test)]" && w[1].trim() == decl)
            });
            if test_only {
                continue;
            }
            let by_folder = named.iter().any(|n| n.ends_with('/') && rel.starts_with(n.as_str()) && n != "core/");
            if by_folder {
                continue;
            }
            seen.insert(rel.clone());
            if !named.contains(&rel) {
                unnamed.push(rel);
            }
        }
    }
    assert!(unnamed.is_empty(), "files missing from docs/architecture.md's table: {unnamed:?}");
    let stale: Vec<&String> = named.iter().filter(|n| !n.ends_with('/') && !seen.contains(*n)).collect();
    assert!(stale.is_empty(), "docs/architecture.md's table names files that are not in src/ or core/src/: {stale:?}");
}
