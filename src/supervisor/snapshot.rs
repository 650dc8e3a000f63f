//! What the supervisor is doing, handed to the status document, the metrics
//! and `status` as plain data.

use std::collections::BTreeMap;
use std::time::Duration;

use serde::{Deserialize, Serialize};

use crate::supervisor::outcome::{Exit, FailureClass, Phase};

/// What the supervisor is doing, as plain data.
#[derive(Debug, Clone, PartialEq)]
pub struct Snapshot {
    pub(crate) phase: Phase,
    pub(crate) child_pid: Option<u32>,
    pub(crate) attempt: u32,
    pub(crate) restarts: u32,
    /// Spawns so far.
    pub(crate) starts: u32,
    pub(crate) progress: Option<String>,
    pub(crate) cause: Option<String>,
    /// What to do about the cause, when it is a known one.
    pub(crate) hint: Option<String>,
    /// Children exited so far, and the last exit.
    pub(crate) exits: u32,
    pub(crate) last_exit: Option<Exit>,
    /// How long the last successful load took.
    pub(crate) last_load: Option<Duration>,
    /// Failed runs by class.
    pub(crate) failures: BTreeMap<FailureClass, u64>,
    /// The exit code, once the warden is done.
    pub(crate) exit_code: Option<crate::supervisor::exit::Code>,
    /// The last failed run, kept after a later ready.
    pub(crate) last_failure: Option<LastFailure>,
    /// Where the load under way is.
    pub(crate) load: Option<crate::supervisor::load::LoadNow>,
    /// The last load that ended, and how many have.
    pub(crate) last_load_record: Option<std::sync::Arc<crate::supervisor::load::LoadRecord>>,
    pub(crate) loads_ended: u32,
    /// The last golden check's verdict.
    pub(crate) golden: Option<crate::supervisor::golden::Verdict>,
    pub(crate) golden_checks: u32,
    /// Re-checks of the serving model's answers, and the time out of
    /// rotation they took in all.
    pub(crate) rechecks: u32,
    pub(crate) recheck_paused: std::time::Duration,
    /// Why the answers are being checked again, while they are.
    pub(crate) rechecking: Option<String>,
    /// The memory-fit arguments the current (or last) start used, and
    /// memory fit's adjustments since the last ready.
    pub(crate) fit: crate::supervisor::fit::Used,
    pub(crate) fit_moves: u32,
    /// The setup the current (or last) start used; the rollback in force.
    pub(crate) setup: Option<String>,
    pub(crate) rolled_back: Option<RolledBack>,
    /// Engines stopped, and put to sleep, for want of requests.
    pub(crate) idle_stops: u32,
    pub(crate) sleeps: u32,
    /// While idle: how long the engine should take to serve again.
    pub(crate) idle_eta: Option<Duration>,
}

/// The last-known-good setup serves in place of a changed one that failed.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct RolledBack {
    /// The failed setup's fingerprint, and why it failed.
    pub(crate) failed: String,
    pub(crate) cause: String,
    /// The last-known-good setup's fingerprint, and when it was recorded.
    pub(crate) good: String,
    pub(crate) good_at: String,
}

/// The last failed run: why, and where its failure report is.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct LastFailure {
    pub(crate) cause: String,
    pub(crate) class: FailureClass,
    /// The report's folder; none for a start that never spawned, or with
    /// reports off.
    pub(crate) report: Option<String>,
}
