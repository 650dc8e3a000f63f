//! The words the state machine and the parts that report to it share: the
//! phase shown to operators, the class of a failure, whether a retry can
//! fix it, and how the pre-start steps ended. Plain data; nothing here
//! knows how the state changes or how a step is carried out.

use std::fmt;

use crate::Signal;
use serde::{Deserialize, Serialize};

/// What the warden is doing, as the status document, the metrics and
/// `status` name it.
#[derive(
    Debug,
    Clone,
    Copy,
    PartialEq,
    Eq,
    PartialOrd,
    Ord,
    Hash,
    Serialize,
    Deserialize,
    strum::VariantArray,
    strum::IntoStaticStr,
)]
#[serde(rename_all = "lowercase")]
#[strum(serialize_all = "lowercase")]
pub enum Phase {
    /// Preparing, spawning or loading.
    Starting,
    Ready,
    /// Ready, and being taken out of rotation: unready to balancers, the
    /// requests in flight let finish.
    Draining,
    /// Ready, out of rotation, and held so until undrained or stopped.
    Drained,
    /// Ready, and out of rotation while its golden answers are asked again
    /// (after a GPU fault that did not end it, an upgrade of the warden,
    /// `golden.interval`): back in rotation if they are the same.
    Rechecking,
    /// Waiting before the next start.
    Backoff,
    /// A stop (or a reload) was asked for; the tree is being stopped.
    Stopping,
    /// A failed run is being stopped before its restart.
    Failed,
    /// The warden has exited (the document is left saying why).
    Stopped,
    /// The engine was stopped, or put to sleep, for want of requests
    /// (`front.idle-stop`); the next request starts or wakes it.
    Idle,
}

impl Phase {
    pub const ALL: &[Phase] = <Phase as strum::VariantArray>::VARIANTS;

    pub fn as_str(self) -> &'static str {
        self.into()
    }

    /// Whether requests may be sent to the model now: ready, and neither
    /// taken out of rotation (a drain) nor waiting for its answers to be
    /// proven again (a re-check). `/readyz` answers 200 only then; a front
    /// door holds requests in every other phase.
    #[cfg(test)]
    pub(crate) fn serving(self) -> bool {
        self == Phase::Ready
    }
}

impl std::fmt::Display for Phase {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// The class of a failed run's cause, as counted in the metrics.
#[derive(
    Debug,
    Clone,
    Copy,
    PartialEq,
    Eq,
    PartialOrd,
    Ord,
    Hash,
    Serialize,
    Deserialize,
    strum::VariantArray,
    strum::IntoStaticStr,
)]
#[serde(rename_all = "snake_case")]
#[strum(serialize_all = "snake_case")]
pub enum FailureClass {
    /// The child exited (any code) with no fatal line to explain it.
    Exit,
    /// A fatal line or a traceback.
    FatalLine,
    /// Health or canary checks failed after ready.
    Health,
    /// A cause that retries cannot fix.
    Permanent,
    /// A pre-start step failed, or the command could not be started.
    Spawn,
    /// No progress for `ready.stall`.
    Stall,
    /// Not ready within `ready.timeout`.
    Timeout,
    /// The golden check's answers differ from the reference
    /// (`golden.on-mismatch = "fail"`, or a re-check while serving).
    WrongAnswers,
    /// The golden check got no answer: none within `golden.timeout`, a
    /// connection refused or cut, or a 5xx (before ready whatever
    /// `golden.on-mismatch` says, and at a re-check while serving).
    NoAnswer,
}

impl FailureClass {
    pub const ALL: &[FailureClass] = <FailureClass as strum::VariantArray>::VARIANTS;

    pub fn as_str(self) -> &'static str {
        self.into()
    }
}

/// Why the engine was started again (a spawn after the warden's first):
/// what alerts tell apart, so that what the warden does on purpose never
/// reads as a crash.
#[derive(
    Debug,
    Clone,
    Copy,
    PartialEq,
    Eq,
    PartialOrd,
    Ord,
    Hash,
    Serialize,
    Deserialize,
    strum::VariantArray,
    strum::IntoStaticStr,
)]
#[serde(rename_all = "snake_case")]
#[strum(serialize_all = "snake_case")]
pub enum RestartReason {
    /// A failed run, after its backoff (or at once with no backoff).
    Failure,
    /// Asked for: `vllm-warden restart` (the control endpoint).
    Restart,
    /// A reload whose changes the child must see.
    Reload,
    /// A request came for an engine stopped for want of requests
    /// (`front.idle-stop`).
    Wake,
    /// Memory fit moved an argument after a fit error.
    Fit,
    /// The warden turned to the last-known-good setup after giving up on
    /// the new one (`[rollback]`).
    Rollback,
}

impl RestartReason {
    pub const ALL: &[RestartReason] = <RestartReason as strum::VariantArray>::VARIANTS;

    pub fn as_str(self) -> &'static str {
        self.into()
    }
}

/// Whether a retry can fix a failure.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Permanence {
    Transient,
    /// It matched the permanent pattern with this index in the effective
    /// list: the same pattern `permanent-attempts` times in a row gives up.
    Pattern(usize),
    /// The command cannot be executed at all, or a patch cannot be applied.
    Unrunnable,
    /// The hardware failed (a fatal GPU fault): no retry at all.
    Hardware,
    /// The served model answered otherwise than its reference: the same
    /// answers come again, `permanent-attempts` times in a row gives up.
    Answers,
}

impl Permanence {
    pub fn is_permanent(self) -> bool {
        self != Permanence::Transient
    }

    /// From the classifier's match of the permanent patterns.
    pub(crate) fn of_match(index: Option<usize>) -> Permanence {
        index.map_or(Permanence::Transient, Permanence::Pattern)
    }
}

/// Why a start could not happen (a pre-start step, or the spawn itself).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StartFailure {
    pub cause: String,
    /// A retry would fail the same way (a missing program, a bad patch).
    pub permanent: bool,
    /// This machine cannot run it at all (vLLM refuses the platform): no
    /// retry, whatever `restart.permanent-attempts` says.
    pub(crate) unsupported: bool,
}

impl StartFailure {
    pub fn transient(cause: impl Into<String>) -> StartFailure {
        StartFailure { cause: cause.into(), permanent: false, unsupported: false }
    }

    pub fn permanent(cause: impl Into<String>) -> StartFailure {
        StartFailure { cause: cause.into(), permanent: true, unsupported: false }
    }

    pub(crate) fn unsupported(cause: impl Into<String>) -> StartFailure {
        StartFailure { cause: cause.into(), permanent: true, unsupported: true }
    }
}

/// How the pre-start steps of one start ended.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Prepared {
    Done,
    Failed(StartFailure),
    /// Given up on request (a stop or a reload came meanwhile).
    Cancelled,
}

/// How a process ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Exit {
    Code(i32),
    Signal(Signal),
}

impl fmt::Display for Exit {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Exit::Code(c) => write!(f, "exit code {c}"),
            Exit::Signal(s) => match crash_words(*s) {
                Some(words) => write!(f, "killed by {}: {words}", s.as_str()),
                None => write!(f, "killed by {}", s.as_str()),
            },
        }
    }
}

/// What a signal a process gets from its own fault says about it: these
/// are raised by the CPU or the C library, not sent by a supervisor.
/// SIGILL is an instruction this CPU or kernel refuses (a build for
/// another CPU, or AMX tiles used without the kernel's permission).
pub(crate) fn crash_words(s: Signal) -> Option<&'static str> {
    match s {
        Signal::SIGILL => Some("illegal instruction"),
        Signal::SIGSEGV => Some("segmentation fault"),
        Signal::SIGBUS => Some("bus error"),
        Signal::SIGFPE => Some("arithmetic exception"),
        Signal::SIGABRT => Some("aborted"),
        _ => None,
    }
}
