//! The reports folder: listing and showing reports, their sizes, and
//! retention.

use std::fmt::Write as _;
use std::fs;
use std::io;
use std::path::{Path, PathBuf};

use super::*;

/// One report on disk, as `reports` lists it.
#[derive(Debug, Clone)]
pub struct Listed {
    pub(crate) name: String,
    pub path: PathBuf,
    pub(crate) attempt: u32,
    /// Bytes of its files.
    pub size: u64,
    /// Its summary, when it can be read.
    pub summary: Option<Summary>,
}

/// The reports of `instance` in `state_dir`, oldest first: only folders
/// whose names are ours, not symlinks.
pub fn list(state_dir: &Path, instance: &str) -> io::Result<Vec<Listed>> {
    list_with(state_dir, instance, true)
}

/// [`list`], the summaries read or not.
pub(super) fn list_with(state_dir: &Path, instance: &str, summaries: bool) -> io::Result<Vec<Listed>> {
    let root = state_dir.join(FOLDER);
    let entries = match fs::read_dir(&root) {
        Ok(e) => e,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(Vec::new()),
        Err(e) => return Err(e),
    };
    let mut out = Vec::new();
    for entry in entries.flatten() {
        let Some(name) = entry.file_name().to_str().map(String::from) else { continue };
        let Some((_, attempt)) = parse_name(&name, instance) else { continue };
        // `file_type` does not follow a symlink.
        if !entry.file_type().is_ok_and(|t| t.is_dir()) {
            continue;
        }
        let path = entry.path();
        let size = size_of(&path);
        let summary = if summaries { read_summary(&path) } else { None };
        out.push(Listed { name, path, attempt, size, summary });
    }
    out.sort_by(|a, b| a.name.cmp(&b.name));
    Ok(out)
}

/// `1.5 KiB`, `12.0 MiB`.
pub(super) fn size_text(n: u64) -> String {
    match n {
        n if n >= 1 << 20 => format!("{:.1} MiB", n as f64 / f64::from(1u32 << 20)),
        n if n >= 1 << 10 => format!("{:.1} KiB", n as f64 / 1024.0),
        n => format!("{n} B"),
    }
}

/// What is read from a report, made one visible line.
pub(super) fn shown(text: &str) -> String {
    crate::util::escape::one_line(&masked(text), crate::util::escape::MAX_LINE)
}

/// `reports list`: one report a line, oldest first; the time is the start
/// of the folder's name, which `show` and `path` take.
pub(crate) fn table(all: &[Listed]) -> String {
    let mut out = format!("{:<20}  {:>7}  {:<10}  {:>10}  {}\n", "TIME", "ATTEMPT", "CLASS", "SIZE", "CAUSE");
    for r in all {
        let time = r.name.split('-').next().unwrap_or_default();
        let (class, cause) = match &r.summary {
            Some(s) => (s.class_name(), shown(&s.cause)),
            None => ("?".to_string(), "(no readable summary.json)".to_string()),
        };
        let _ = writeln!(out, "{time:<20}  {:>7}  {class:<10}  {:>10}  {cause}", r.attempt, size_text(r.size));
    }
    out
}

/// `reports show`: one report, readable.
pub(crate) fn show(r: &Listed) -> String {
    let mut out = format!("report {} ({})\n", r.name, r.path.display());
    let Some(s) = &r.summary else {
        out.push_str("no readable summary.json\n");
        return out;
    };
    let t = &s.timings;
    let pid = s.pid.map(|p| format!(", pid {p}")).unwrap_or_default();
    let _ = writeln!(out, "instance {}, start {}, attempt {}{pid}", shown(&s.instance), s.start, s.attempt);
    let _ = writeln!(out, "cause: {}", shown(&s.cause));
    let _ = writeln!(out, "class: {}", s.class_name());
    if let Some(h) = &s.hint {
        let _ = writeln!(out, "hint: {}", shown(h));
    }
    let _ = writeln!(out, "spawned:        {}", shown(&t.spawn));
    let _ = writeln!(out, "first progress: {}", t.first_progress.as_deref().map_or("-".into(), shown));
    let _ = writeln!(out, "ready:          {}", t.ready.as_deref().map_or("-".into(), shown));
    let _ = writeln!(out, "failed:         {}", shown(&t.failure));
    let _ = writeln!(
        out,
        "report:         {} to {}",
        shown(&t.report_begun),
        t.report_done.as_deref().map_or("(not finished: cut short)".into(), shown)
    );
    let _ = writeln!(out, "exit: {}", s.exit.as_deref().map_or("- (still running when it failed)".into(), shown));
    let vllm = s.vllm_version.as_deref().map_or("unknown".into(), shown);
    let _ = writeln!(out, "vllm-warden {}, vLLM {vllm}", shown(&s.warden_version));
    let _ = writeln!(out, "config sha256: {}", shown(&s.config_sha256));
    for p in &s.patched_files {
        let _ = writeln!(
            out,
            "patched: {} (sha256 {} → {})",
            shown(&p.file),
            shown(&p.original_sha256),
            shown(&p.patched_sha256)
        );
    }
    out.push_str("parts:\n");
    for (k, v) in &s.parts {
        let _ = writeln!(out, "  {}: {}", shown(k), shown(v));
    }
    let _ = writeln!(out, "size: {}{}", size_text(r.size), if s.complete { "" } else { " (incomplete: cut short)" });
    out
}

impl Summary {
    pub(super) fn class_name(&self) -> String {
        self.class.as_str().to_string()
    }
}

/// Bytes of a report's regular files (its own and `py-spy/`'s), no link followed.
pub(crate) fn size_of(dir: &Path) -> u64 {
    let mut total = 0;
    for sub in [dir.to_path_buf(), dir.join(PY_SPY)] {
        if !fs::symlink_metadata(&sub).is_ok_and(|m| m.is_dir()) {
            continue;
        }
        let Ok(entries) = fs::read_dir(&sub) else { continue };
        for e in entries.flatten() {
            if let Ok(m) = fs::symlink_metadata(e.path())
                && m.is_file()
            {
                total += m.len();
            }
        }
    }
    total
}

/// A report's `summary.json`, bounded, not through a symlink.
pub(crate) fn read_summary(dir: &Path) -> Option<Summary> {
    let text = crate::util::fsutil::read_small(&dir.join(SUMMARY), 1 << 20, crate::util::fsutil::Links::Refuse).ok()?;
    serde_json::from_slice(&text).ok()
}

/// Remove one report: the files the warden writes, then the folders, if
/// they are then empty. Anything else put there is left, and so is the
/// folder holding it.
pub(super) fn remove(dir: &Path) -> io::Result<()> {
    let gone = |r: io::Result<()>| match r {
        Err(e) if e.kind() != io::ErrorKind::NotFound => Err(e),
        _ => Ok(()),
    };
    let py = dir.join(PY_SPY);
    if fs::symlink_metadata(&py).is_ok_and(|m| m.is_dir()) {
        for e in fs::read_dir(&py)?.flatten() {
            let name = e.file_name();
            let ours = name
                .to_str()
                .and_then(|n| n.strip_suffix(".txt"))
                .is_some_and(|n| !n.is_empty() && n.bytes().all(|b| b.is_ascii_digit()));
            if ours && e.file_type().is_ok_and(|t| t.is_file()) {
                gone(fs::remove_file(e.path()))?;
            }
        }
        // Left, with what is not ours in it.
        let _ = fs::remove_dir(&py);
    }
    for f in FILES {
        let p = dir.join(f);
        if fs::symlink_metadata(&p).is_ok_and(|m| m.is_file()) {
            gone(fs::remove_file(&p))?;
        }
    }
    gone(fs::remove_dir(dir))
}

/// Keep the newest `keep` reports of `instance`, and within `max` bytes in
/// all, removing the oldest first; the report just written (`current`) is
/// always kept, and so is any newer one (a later run's, being written
/// beside it: its own retention follows).
pub(crate) fn retain(root: &Path, instance: &str, keep: u32, max: u64, current: &str) {
    let Some(state) = root.parent() else { return };
    let Ok(all) = list_with(state, instance, false) else { return };
    let mut total: u64 = all.iter().map(|r| r.size).sum();
    let mut count = all.len();
    for r in &all {
        if r.name.as_str() >= current || (count <= keep as usize && total <= max) {
            continue;
        }
        match remove(&r.path) {
            Ok(()) => tracing::info!(EVENT = "report", "removed the old failure report {}", r.path.display()),
            Err(e) => tracing::warn!(error = %e, "cannot remove the old failure report {}", r.path.display()),
        }
        count -= 1;
        total = total.saturating_sub(r.size);
    }
}
