//! `vllm-warden setups`: the setups recorded as reaching ready (newest
//! first), one of them, and what differs between two (a setup that never
//! reached ready is found in the load ledger). Everything shown comes from
//! files of the state directory, which the warden never runs (a rollback
//! starts only what the running warden saw ready): each field is made one
//! visible line, and the environment is masked as it was recorded.

use std::fmt::Write as _;
use std::path::Path;

use crate::tell::setups::SetupRecord;
use crate::util::escape::one_line;

fn safe(s: &str) -> String {
    one_line(s, 300)
}

/// Every recorded setup, newest first.
pub(crate) fn table(all: &[SetupRecord]) -> String {
    let mut out = String::new();
    for (i, r) in all.iter().enumerate() {
        let mark = if i == 0 { "newest" } else { "" };
        let vllm = r.setup.vllm.as_deref().map_or_else(|| "-".into(), safe);
        let _ = writeln!(
            out,
            "{}  {}  vllm {}  {}  {mark}",
            safe(&r.fingerprint),
            safe(&r.at),
            vllm,
            safe(&r.setup.command)
        );
    }
    out
}

/// One setup: when, its config file, vLLM, command, environment, patches.
pub(crate) fn show(r: &SetupRecord) -> String {
    let mut out = String::new();
    let _ = writeln!(out, "setup {}, ready at {}", safe(&r.fingerprint), safe(&r.at));
    let _ = writeln!(
        out,
        "config file: {} ({} lines kept)",
        safe(&r.config_file.display().to_string()),
        r.config.lines().count()
    );
    let _ = writeln!(out, "vllm: {}", r.setup.vllm.as_deref().map_or_else(|| "(not found)".into(), safe));
    let _ = writeln!(out, "command: {}", safe(&r.setup.command));
    for (k, v) in &r.setup.env {
        let _ = writeln!(out, "env {}={}", safe(k), safe(v));
    }
    for (f, sum) in &r.setup.patched {
        let _ = writeln!(out, "patched {}: sha256 {}", safe(f), safe(sum));
    }
    out
}

/// A setup by its fingerprint (or a unique beginning of it): a recorded
/// one, else the newest load of it in the ledger. Its fingerprint and
/// setup, as JSON.
pub(crate) fn find(state_dir: &Path, instance: &str, id: &str) -> Result<(String, serde_json::Value), String> {
    match crate::tell::setups::find(state_dir, instance, id) {
        Ok(r) => Ok((r.fingerprint, serde_json::to_value(&r.setup).unwrap_or_default())),
        Err(not_kept) => {
            let ledger = state_dir.join(crate::tell::ledger::FILE);
            let loads = crate::tell::ledger::read(&ledger).map(|(l, _)| l).unwrap_or_default();
            let mut fps: Vec<&str> =
                loads.iter().map(|r| r.fingerprint.as_str()).filter(|f| !id.is_empty() && f.starts_with(id)).collect();
            fps.sort_unstable();
            fps.dedup();
            match fps.as_slice() {
                [fp] => {
                    let r = loads.iter().rev().find(|r| r.fingerprint == *fp).expect("found above");
                    Ok((fp.to_string(), r.setup.clone()))
                }
                [] => Err(format!("{not_kept}, and no load of it in {}", ledger.display())),
                _ => Err(format!("{id:?} names {} setups; give more of the fingerprint", fps.len())),
            }
        }
    }
}

/// What differs from setup `a` to setup `b`.
pub(crate) fn diff(a: &(String, serde_json::Value), b: &(String, serde_json::Value)) -> String {
    let mut out = format!("setup {} → setup {}\n", safe(&a.0), safe(&b.0));
    for line in crate::observe::golden::setup_changes(&a.1, &b.1) {
        let _ = writeln!(out, "  {line}");
    }
    out
}
