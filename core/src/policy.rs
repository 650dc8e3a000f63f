//! What the machine acts on: the parts of the settings it needs, as a
//! [`Policy`] (the daemon builds it from the settings), the vocabulary of
//! those parts (restart, memory fit, golden and idle policies), and the
//! fixed graces and margins of its deadlines.

use std::time::Duration;

use crate::Signal;

/// The longest duration any key accepts, and the longest any deadline
/// may be: nothing the core computes from a setting, or from a figure
/// read back from the ledger, can overflow an instant.
pub const LONGEST: Duration = Duration::from_secs(24 * 60 * 60 * 30);

/// Before ready there is nothing to drain, and vLLM can lose a SIGTERM sent
/// during its load: the stop signal is repeated this often …
pub(crate) const LOAD_STOP_RESEND: Duration = Duration::from_secs(1);
/// … and SIGKILL follows after at most this long (or `stop-timeout`, if
/// shorter). The same short grace applies to what is left of a failed run.
pub(crate) const LOAD_STOP_GRACE: Duration = Duration::from_secs(10);
/// After SIGKILL, how long the tree gets to be gone. A process still there
/// is stuck in the kernel (state `D`; for a GPU server, usually the driver):
/// it is reported and the warden gives up on it.
pub const KILL_GRACE: Duration = Duration::from_secs(10);
/// How long the report of such survivors may take (reading `/proc` of a
/// process stuck in the kernel can hang too).
pub(crate) const DESCRIBE_GRACE: Duration = Duration::from_secs(5);
/// What the pre-start steps may take beyond their own waits (leftovers,
/// port, GPUs): patches, `/proc` scans, the GPU query's own time limit.
pub const PREPARE_MARGIN: Duration = Duration::from_secs(60);
/// How long one run of an external command (the GPU query) may take.
pub const COMMAND_TIMEOUT: Duration = Duration::from_secs(20);
/// What a failure report may take beyond `reports.timeout` (which bounds
/// its commands) before the machine stops waiting for it: its file writes.
pub const REPORT_MARGIN: Duration = Duration::from_secs(5);

/// The parts of the settings the machine acts on.
#[derive(Debug, Clone, PartialEq)]
pub struct Policy {
    /// Readiness waits for a `ready.log` line (else the HTTP check alone).
    pub ready_log: bool,
    /// Readiness waits for a 200 from `ready.http` after the line.
    pub ready_http: bool,
    pub ready_timeout: Duration,
    pub stall: Duration,
    /// After a fatal line, how long the child gets to exit on its own.
    pub grace: Duration,
    pub stop_signal: Signal,
    pub stop_timeout: Duration,
    /// How long the pre-start steps may take in all.
    pub prepare_timeout: Duration,
    pub restart: Restart,
    /// A remedy line for known causes.
    pub hints: crate::hints::Hints,
    /// A drain is unready at once, then waits this long before it looks
    /// at the requests in flight …
    pub drain_delay: Duration,
    /// … and at most this long for none to be running or waiting.
    pub drain_timeout: Duration,
    /// A stop, and a reload that restarts the child, drain a serving child
    /// first.
    pub drain_on_stop: bool,
    /// How long a failed run waits for its failure report before it is
    /// stopped; `None`: no reports.
    pub report: Option<Duration>,
    /// The profile tells a load's phases: `STATUS=` shows the phase and
    /// the estimate.
    pub phases: bool,
    /// `ledger.slow-factor` and `ledger.deadline-factor`.
    pub slow_factor: f64,
    pub deadline_factor: f64,
    /// The golden check before `READY=1`, and what a mismatch does; none:
    /// no check.
    pub golden: Option<GoldenPolicy>,
    /// What the golden check may take (`golden.timeout`).
    pub golden_timeout: Duration,
    /// While serving, re-check the answers this often (`golden.interval`).
    pub golden_interval: Option<Duration>,
    /// Memory-fit recovery (`[fit]`), when on.
    pub fit: Option<Fit>,
    /// Last-known-good rollback (`[rollback]`) is on.
    pub rollback: bool,
    /// What an engine without requests comes to (`front.idle-stop`); none:
    /// it serves for ever.
    pub idle: Option<IdlePolicy>,
}

/// `front.idle-stop`, `idle-action`, `idle-sleep-level`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct IdlePolicy {
    /// No request for this long, and none in flight: the engine is idle.
    pub after: Duration,
    /// Stopped, or put to sleep at `level`.
    pub action: IdleAction,
    pub level: u8,
}

impl Policy {
    /// The delay before attempt `n + 1`, after `n` consecutive failures,
    /// before jitter: `initial × factor^(n-1)`, capped.
    pub(crate) fn backoff(&self, n: u32) -> Duration {
        let exp = self.restart.factor.powi(n.saturating_sub(1).min(1000) as i32);
        let secs = (self.restart.initial_delay.as_secs_f64() * exp).min(self.restart.max_delay.as_secs_f64());
        Duration::from_secs_f64(secs.max(0.0))
    }
}

/// `[fit]`'s defaults: how far `--gpu-memory-utilization` moves at a time
/// and its bounds, the shortest `--max-model-len` set and the multiple it
/// is rounded down to, and how many adjustments in a row.
pub const FIT_STEP: f64 = 0.02;
pub const FIT_MIN_UTILIZATION: f64 = 0.5;
pub const FIT_MAX_UTILIZATION: f64 = 0.95;
pub const FIT_MIN_MODEL_LEN: u32 = 4096;
pub const FIT_MODEL_LEN_MULTIPLE: u32 = 1024;
pub const FIT_ATTEMPTS: u32 = 3;

#[derive(Debug, Clone, PartialEq)]
pub struct Restart {
    pub initial_delay: Duration,
    pub max_delay: Duration,
    pub factor: f64,
    pub jitter: f64,
    pub reset_after: Duration,
    /// 0 = never give up.
    pub max_attempts: u32,
    pub permanent_attempts: u32,
}

/// `[fit]`: memory-fit recovery. A start that fails with one of vLLM's
/// memory-fit errors is started again with the argument moved the way
/// the error asks, within bounds; a value that reaches ready is pinned
/// for the setup.
#[derive(Debug, Clone, PartialEq)]
pub struct Fit {
    pub enabled: bool,
    /// The arguments it may set.
    pub adjust: Vec<FitArg>,
    /// How far `--gpu-memory-utilization` moves at a time.
    pub step: f64,
    pub min_utilization: f64,
    pub max_utilization: f64,
    /// The shortest `--max-model-len` it sets.
    pub min_model_len: u64,
    /// `--max-model-len` is rounded down to a multiple of this.
    pub model_len_multiple: u64,
    /// Adjustments in a row, at most.
    pub attempts: u32,
}

impl Default for Fit {
    /// Off, with the documented bounds.
    fn default() -> Fit {
        Fit {
            enabled: false,
            adjust: FitArg::ALL.to_vec(),
            step: FIT_STEP,
            min_utilization: FIT_MIN_UTILIZATION,
            max_utilization: FIT_MAX_UTILIZATION,
            min_model_len: u64::from(FIT_MIN_MODEL_LEN),
            model_len_multiple: u64::from(FIT_MODEL_LEN_MULTIPLE),
            attempts: FIT_ATTEMPTS,
        }
    }
}

/// An argument of vLLM's that memory fit may set.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum FitArg {
    MaxModelLen,
    GpuMemoryUtilization,
}

impl FitArg {
    pub const ALL: [FitArg; 2] = [FitArg::MaxModelLen, FitArg::GpuMemoryUtilization];

    /// As `fit.adjust` and the status document name it.
    pub fn name(self) -> &'static str {
        match self {
            FitArg::MaxModelLen => "max-model-len",
            FitArg::GpuMemoryUtilization => "gpu-memory-utilization",
        }
    }

    /// As vLLM's command line spells it.
    pub fn flag(self) -> &'static str {
        match self {
            FitArg::MaxModelLen => "--max-model-len",
            FitArg::GpuMemoryUtilization => "--gpu-memory-utilization",
        }
    }

    pub fn of_name(name: &str) -> Option<FitArg> {
        FitArg::ALL.into_iter().find(|a| a.name() == name)
    }
}

/// What a mismatch does.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum GoldenPolicy {
    /// `READY=1` with a warning.
    Warn,
    /// A failed run, class `wrong_answers`; no `READY=1`.
    Fail,
}

/// What `front.idle-stop` does to an idle engine.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum IdleAction {
    /// The engine is stopped (GPUs and `/dev/shm` free, as after any stop).
    Stop,
    /// vLLM's own sleep mode (`/sleep?level=N`), woken by `/wake_up`.
    Sleep,
}
