//! What `vllm-warden status` concludes from the status document, and the
//! text it prints: ready, not ready, or not running (no file, a stopped
//! warden, a warden pid that is gone).

use std::fmt::Write as _;
use std::path::Path;
use std::time::{Duration, SystemTime};

use crate::supervisor::outcome::Phase;
use crate::tell::status::{Doc, safe};

/// What `status` concludes from the document.
#[derive(Debug, Clone, PartialEq)]
pub(crate) enum StatusVerdict {
    Ready(Doc),
    NotReady(Doc),
    /// No file, a stopped warden, or a warden pid that is gone.
    NotRunning(Option<Doc>),
}

/// The largest status document read: some hundred times a real one.
pub(crate) const MAX_DOC: u64 = 1 << 20;

/// Read the document and tell whether its warden is still there; no file
/// is no warden. A file that cannot be read (this user may not, it is a
/// FIFO or a device, it is larger than [`MAX_DOC`]) is an error, said by
/// the caller: never a read that blocks or fills memory.
pub(crate) fn read(path: &Path) -> std::io::Result<StatusVerdict> {
    match crate::util::fsutil::read_small(path, MAX_DOC, crate::util::fsutil::Links::Follow) {
        Ok(bytes) => Ok(verdict(&String::from_utf8_lossy(&bytes))),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(StatusVerdict::NotRunning(None)),
        Err(e) => Err(e),
    }
}

/// What a document says (from the file, or from the warden's socket).
pub(crate) fn verdict(text: &str) -> StatusVerdict {
    let Ok(doc) = serde_json::from_str::<Doc>(text) else { return StatusVerdict::NotRunning(None) };
    if doc.state == Phase::Stopped || doc.exit_code.is_some() || !warden_alive(doc.warden_pid) {
        return StatusVerdict::NotRunning(Some(doc));
    }
    if doc.state == Phase::Ready { StatusVerdict::Ready(doc) } else { StatusVerdict::NotReady(doc) }
}

/// The pid is alive and is a vllm-warden (not a recycled pid).
fn warden_alive(pid: u32) -> bool {
    std::fs::read(format!("/proc/{pid}/cmdline"))
        .map(|c| {
            c.split(|b| *b == 0).next().is_some_and(|argv0| String::from_utf8_lossy(argv0).contains("vllm-warden"))
        })
        .unwrap_or(false)
}

/// The short human summary of `status`.
pub(crate) fn summary(v: &StatusVerdict) -> String {
    let doc = match v {
        StatusVerdict::Ready(d) | StatusVerdict::NotReady(d) => d,
        StatusVerdict::NotRunning(None) => return "not running (no status file)".to_string(),
        StatusVerdict::NotRunning(Some(d)) => {
            let why = d.cause.as_deref().map(|c| format!(": {}", safe(c))).unwrap_or_default();
            return match d.exit_code {
                Some(code) => format!("{}: not running (exited with {code} at {}){why}", d.name, d.since),
                None => format!("{}: not running (warden {} is gone){why}", d.name, d.warden_pid),
            };
        }
    };
    let mut out = format!("{}: {}", safe(&doc.name), doc.state);
    if let Some(pid) = doc.child_pid {
        let _ = write!(out, ", pid {pid}");
    }
    let since = humantime::parse_rfc3339(&doc.since).ok().and_then(|t| SystemTime::now().duration_since(t).ok());
    if let Some(d) = since {
        let d = humantime::format_duration(Duration::from_secs(d.as_secs()));
        let _ = write!(out, ", for {d}");
    }
    let _ = write!(out, ", attempt {}, {} restart(s)", doc.attempt, doc.restarts);
    if let Some(l) = &doc.load {
        let _ = write!(out, "\nload: {}", safe(&l.text));
    }
    if let Some(f) = &doc.front {
        let listen: Vec<String> = f.listen.iter().map(|l| safe(l)).collect();
        let _ = write!(
            out,
            "\nfront door: clients connect to {}; the engine listens on {}; {} held, {} in flight",
            listen.join(", "),
            safe(&f.engine),
            f.held,
            f.in_flight
        );
    }
    if let Some(p) = &doc.progress {
        let _ = write!(out, "\nprogress: {}", safe(p));
    }
    if let Some(l) = &doc.last_load {
        let phases: Vec<String> = l.phases.iter().map(|(p, s)| format!("{} {s:.1}s", safe(p))).collect();
        let _ = write!(out, "\nlast load: {} after {:.1}s", safe(&l.outcome), l.total_secs);
        if !phases.is_empty() {
            let _ = write!(out, " ({})", phases.join(", "));
        }
        if let Some(c) = &l.cache {
            let _ = write!(out, "; compile cache: {}", safe(c));
        }
        if let Some(g) = l.gbps {
            let _ = write!(out, "; weights {g:.2} GB/s");
        }
        if let Some(r) = l.residency {
            let _ = write!(out, "; {:.0}% in the page cache", r.clamp(0.0, 1.0) * 100.0);
        }
        if let Some(g) = l.disk_gbps {
            let _ = write!(out, "; disk {g:.2} GB/s");
        }
        if let Some(e) = l.efficiency {
            let _ = write!(out, "; efficiency {e:.2}");
        }
        for a in &l.alarms {
            let _ = write!(out, "\nload alarm: {}", safe(a));
        }
    }
    let fitted: Vec<String> = doc
        .fit
        .iter()
        .filter(|(_, v)| v.source == "pinned" || v.source == "fitted")
        .map(|(a, v)| format!("--{} {} ({})", safe(a), safe(&v.value), safe(&v.source)))
        .collect();
    if !fitted.is_empty() {
        let _ = write!(out, "\nmemory fit: {}", fitted.join(", "));
    }
    if let Some(r) = &doc.last_reload {
        let _ = write!(out, "\nlast reload: {} at {}: {}", r.outcome.as_str(), safe(&r.at), safe(&r.summary));
        for p in &r.problems {
            let _ = write!(out, "\n  {}", safe(p));
        }
    }
    if let Some(r) = &doc.rollback {
        let _ = write!(
            out,
            "\nsetup: last-known-good {} from {}; the new setup {} failed: {}",
            safe(&r.good),
            safe(&r.good_at),
            safe(&r.failed),
            safe(&r.cause)
        );
    }
    if let Some(e) = &doc.last_exit {
        let how = match (&e.code, &e.signal) {
            (Some(c), _) => format!("exit code {c}"),
            (None, Some(s)) => format!("killed by {s}"),
            _ => "exited".into(),
        };
        let _ = write!(out, "\nlast exit: {how} at {}", e.at);
    }
    if let Some(c) = &doc.cause {
        let _ = write!(out, "\ncause: {}", safe(c));
    }
    if let Some(h) = &doc.hint {
        let _ = write!(out, "\nhint: {}", safe(h));
    }
    if let Some(f) = &doc.last_failure {
        let _ = write!(out, "\nlast failure ({}): {}", f.class.as_str(), safe(&f.cause));
        if let Some(r) = &f.report {
            let _ = write!(out, "\nreport: {}", safe(r));
        }
    }
    if let Some(g) = &doc.golden {
        let _ = write!(out, "\ngolden: {}", safe(&g.text));
    }
    if let Some(c) = &doc.cache {
        let _ = write!(out, "\ncache: {}", safe(&c.dir));
        if let (Some(bytes), Some(files), Some(at)) = (c.bytes, c.files, &c.measured_at) {
            let _ = write!(out, ", {} in {files} file(s) (measured {})", human_bytes(bytes), safe(at));
        }
    }
    out
}

/// `1.5 GiB`, `12.0 MiB`, `512 B`.
pub(crate) fn human_bytes(n: u64) -> String {
    const UNITS: [&str; 5] = ["KiB", "MiB", "GiB", "TiB", "PiB"];
    if n < 1024 {
        return format!("{n} B");
    }
    let (mut v, mut unit) = (n as f64 / 1024.0, UNITS[0]);
    for u in &UNITS[1..] {
        if v < 1024.0 {
            break;
        }
        v /= 1024.0;
        unit = u;
    }
    format!("{v:.1} {unit}")
}
