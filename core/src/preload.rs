//! The weight-cache daemon beside the engine, as decisions: what one of
//! its lines says, what a start does with the daemon it finds, what a
//! daemon that ended before it was ready means, and what a start is called
//! (engine only, the weights mapped from the daemon; or full).
//!
//! The two children's lifecycle: the daemon starts first and is ready when
//! its `/health` answers 200 (its lines are progress); then the engine. The
//! engine's failure restarts the engine alone, under the usual backoff.
//! The daemon's end, while the engine starts or serves, fails that run
//! (the engine is stopped) and the next start begins with a new daemon. A
//! stop ends the engine first, then the daemon. A reload that changes the
//! daemon's command starts both again; one that does not, the engine.
//!
//! Pure: processes, HTTP and the log are `daemon::preload`'s.

use std::fmt;

use crate::outcome::{Exit, StartFailure};

/// The exception vLLM raises where CUDA IPC is not to be had.
pub(crate) const UNSUPPORTED_PLATFORM: &str = "UnsupportedPlatformForIPCError";
/// The exception vLLM raises for a quantization whose weights cannot be
/// shared as they are.
pub(crate) const UNSUPPORTED_QUANT: &str = "UnsupportedQuantForIPCError";

/// What one of the daemon's lines says.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum DaemonLine {
    /// Every rank holds its weights and serves them.
    Ready,
    /// Loading goes on: shown in `STATUS=`.
    Progress(String),
    /// The final line of a traceback, or an error of the daemon itself:
    /// the cause, should it end. `refused`: this machine cannot run it.
    Error {
        text: String,
        refused: bool,
    },
    Other,
}

/// The text of a vLLM line after its prefix (`(MainProcess pid=1) INFO
/// 12-02 12:32:32 [file.py:1] `), or the line.
fn message(line: &str) -> &str {
    match line.find("] ") {
        Some(i) if line[..i].contains(" [") => &line[i + 2..],
        _ => line,
    }
}

/// An exception's last line: `module.Name: text`, the name ending in
/// `Error` or `Exception`.
fn exception(line: &str) -> Option<String> {
    let (name, text) = line.split_once(": ")?;
    let short = name.rsplit('.').next()?;
    let well_formed = !name.contains(' ') && (short.ends_with("Error") || short.ends_with("Exception"));
    well_formed.then(|| format!("{short}: {}", text.trim()))
}

pub fn classify(line: &str) -> DaemonLine {
    let line = line.trim_end();
    if line.contains("Weight cache daemon READY") {
        return DaemonLine::Ready;
    }
    if let Some(text) = exception(line) {
        let refused = text.starts_with(UNSUPPORTED_PLATFORM) || text.starts_with(UNSUPPORTED_QUANT);
        return DaemonLine::Error { text, refused };
    }
    let m = message(line);
    if line.contains(" ERROR ") && m.contains("Weight cache daemon rank") {
        return DaemonLine::Error { text: m.trim().to_string(), refused: false };
    }
    let progress =
        ["Weight cache ", "Loading safetensors checkpoint shards", "Loading weights took", "Model loading took"];
    if progress.iter().any(|p| m.contains(p)) {
        return DaemonLine::Progress(m.trim().to_string());
    }
    DaemonLine::Other
}

/// What a start finds of the daemon.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Found {
    /// None runs (the first start, or it ended).
    None,
    /// One runs, with this command, ready or not.
    Running { command: Vec<String>, ready: bool },
}

/// What a start does with it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Plan {
    /// Keep it: the engine maps its weights.
    Keep,
    /// Start one.
    Start,
    /// Stop it (another command, or never ready), then start one.
    Replace,
}

pub fn plan(found: &Found, wanted: &[String]) -> Plan {
    match found {
        Found::None => Plan::Start,
        Found::Running { command, ready: true } if command == wanted => Plan::Keep,
        Found::Running { .. } => Plan::Replace,
    }
}

/// How the daemon ended before it was ready: a failed start. vLLM's own
/// refusal of this machine is final (no retry can change the platform);
/// anything else may pass.
pub fn failed_before_ready(exit: Option<Exit>, last_error: Option<&DaemonLine>) -> StartFailure {
    let ended = match exit {
        Some(e) => format!("the weight-cache daemon ended before it was ready ({e})"),
        None => "the weight-cache daemon ended before it was ready".to_string(),
    };
    match last_error {
        Some(DaemonLine::Error { text, refused: true }) => StartFailure::unsupported(format!("{ended}: {text}")),
        Some(DaemonLine::Error { text, .. }) => StartFailure::transient(format!("{ended}: {text}")),
        _ => StartFailure::transient(ended),
    }
}

/// The daemon ended while the engine started or served: that run fails.
pub fn lost(pid: u32, exit: Option<Exit>, last_error: Option<&str>) -> String {
    let how = exit.map(|e| format!(" ({e})")).unwrap_or_default();
    match last_error {
        Some(e) => format!("the weight-cache daemon (pid {pid}) ended{how}: {e}"),
        None => format!("the weight-cache daemon (pid {pid}) ended{how}"),
    }
}

/// Which kind of start: shown in `STATUS=` and kept in the load ledger.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum StartKind {
    /// The engine loads the weights itself (no daemon, or one just
    /// started: its load is this start's).
    Full,
    /// The engine alone: the weights mapped from the daemon that held them.
    EngineOnly,
}

impl fmt::Display for StartKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            StartKind::Full => "full start, weights loaded by a new weight-cache daemon",
            StartKind::EngineOnly => "engine-only start, weights from the weight-cache daemon",
        })
    }
}

impl StartKind {
    /// As the load's progress in `STATUS=` ends.
    pub(crate) fn short(self) -> &'static str {
        match self {
            StartKind::Full => "full start (a new weight-cache daemon loaded the weights)",
            StartKind::EngineOnly => "engine only (weights mapped from the weight-cache daemon)",
        }
    }
}

/// What the load ledger keeps of a start with `[preload]`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct PreloadStart {
    pub kind: StartKind,
    /// A full start: the daemon's own load of the weights, before the
    /// engine's spawn (the engine's load is the record's `total_secs`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub daemon_ms: Option<u64>,
    pub daemon_pid: u32,
}

impl fmt::Display for PreloadStart {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.daemon_ms {
            Some(ms) => {
                let secs = ms as f64 / 1000.0;
                write!(f, "{} (the daemon, pid {}, loaded the weights in {secs:.1} s)", self.kind, self.daemon_pid)
            }
            None => write!(f, "{} (pid {})", self.kind, self.daemon_pid),
        }
    }
}

/// What the status document shows of the daemon.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct DaemonView {
    pub pid: u32,
    /// `starting`, `ready` or `stopping`.
    pub state: String,
    /// What its last progress line said (ranks loaded, GiB allocated).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub progress: Option<String>,
    /// GPU memory its processes hold, as `prestart.gpu-query` lists it,
    /// when that could be asked (measured once it is ready).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub gpu_memory_mib: Option<u64>,
}

/// A reload: whether the daemon starts again.
pub fn daemon_restarts(old: &[String], new: &[String], enabled_before: bool, enabled_now: bool) -> bool {
    enabled_before != enabled_now || (enabled_now && old != new)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn vllm_lines_read_as_they_mean() {
        let refusal = "vllm.model_executor.model_loader.weight_cache.protocol.UnsupportedPlatformForIPCError: platform \
                       'cpu' does not support CUDA IPC weight sharing; only CUDA and ROCm are supported.";
        assert_eq!(
            classify(refusal),
            DaemonLine::Error {
                text: "UnsupportedPlatformForIPCError: platform 'cpu' does not support CUDA IPC weight sharing; only \
                       CUDA and ROCm are supported."
                    .into(),
                refused: true
            }
        );
        let ready = "(MainProcess pid=7) INFO 12-02 12:32:32 [preload.py:323] ===== Weight cache daemon READY: node \
                     0/1 serving 1 local rank(s) x 1 role(s) in /run/w =====";
        assert_eq!(classify(ready), DaemonLine::Ready);
        let loaded = "(vllm-weight-cache-target-0 pid=9) INFO 12-02 12:33:00 [daemon.py:296] Weight cache target \
                      daemon rank 0 loaded model (3.5 GiB allocated, 3.6 GiB reserved)";
        assert_eq!(
            classify(loaded),
            DaemonLine::Progress(
                "Weight cache target daemon rank 0 loaded model (3.5 GiB allocated, 3.6 GiB reserved)".into()
            )
        );
        let value = "ValueError: The weight cache daemon itself must load from disk; use the default --load-format";
        assert!(matches!(classify(value), DaemonLine::Error { refused: false, .. }));
        assert_eq!(classify("INFO 12-02 [model.py:733] Resolved architecture: LlamaForCausalLM"), DaemonLine::Other);
        assert_eq!(classify("  File \"x.py\", line 8, in <module>"), DaemonLine::Other);
    }

    #[test]
    fn a_start_keeps_only_a_ready_daemon_of_the_same_command() {
        let c = vec!["vllm".to_string(), "preload".into()];
        assert_eq!(plan(&Found::None, &c), Plan::Start);
        assert_eq!(plan(&Found::Running { command: c.clone(), ready: true }, &c), Plan::Keep);
        assert_eq!(plan(&Found::Running { command: c.clone(), ready: false }, &c), Plan::Replace);
        assert_eq!(plan(&Found::Running { command: vec!["other".into()], ready: true }, &c), Plan::Replace);
    }

    #[test]
    fn a_refusal_is_final_and_anything_else_may_pass() {
        let refused = DaemonLine::Error { text: "UnsupportedPlatformForIPCError: no".into(), refused: true };
        let f = failed_before_ready(Some(Exit::Code(1)), Some(&refused));
        assert!(f.unsupported && f.permanent, "{f:?}");
        assert!(f.cause.contains("(exit code 1): UnsupportedPlatformForIPCError: no"), "{}", f.cause);
        let other = DaemonLine::Error { text: "OSError: disk".into(), refused: false };
        assert!(!failed_before_ready(Some(Exit::Code(1)), Some(&other)).permanent);
        assert!(!failed_before_ready(None, None).permanent);
    }

    #[test]
    fn a_reload_restarts_the_daemon_only_when_its_command_changes() {
        let a = vec!["vllm".to_string(), "preload".into(), "--model".into(), "/a".into()];
        let b = vec!["vllm".to_string(), "preload".into(), "--model".into(), "/b".into()];
        assert!(!daemon_restarts(&a, &a, true, true));
        assert!(daemon_restarts(&a, &b, true, true));
        assert!(daemon_restarts(&a, &[], true, false));
        assert!(!daemon_restarts(&[], &[], false, false));
    }
}
