//! What the supervisor is doing, handed to the status document, the metrics
//! and `status` as plain data.

use std::collections::BTreeMap;
use std::time::Duration;

use serde::{Deserialize, Serialize};

use crate::outcome::{Exit, FailureClass, Phase};

/// What the supervisor is doing, as plain data.
#[derive(Debug, Clone, PartialEq)]
pub struct Snapshot {
    pub phase: Phase,
    /// When the run now serving (or held: drained, rechecking) became
    /// ready; kept through drains, re-checks and an upgrade's hand-over.
    pub ready_at: Option<crate::Instant>,
    pub child_pid: Option<u32>,
    pub attempt: u32,
    /// Spawns after the first, in all and by why.
    pub restarts: u32,
    pub restarts_by: BTreeMap<crate::outcome::RestartReason, u32>,
    /// Spawns so far.
    pub starts: u32,
    pub progress: Option<String>,
    pub cause: Option<String>,
    /// What to do about the cause, when it is a known one.
    pub hint: Option<String>,
    /// Children exited so far, and the last exit.
    pub exits: u32,
    pub last_exit: Option<Exit>,
    /// How long the last successful load took.
    pub last_load: Option<Duration>,
    /// Failed runs by class.
    pub failures: BTreeMap<FailureClass, u64>,
    /// The exit code, once the warden is done.
    pub exit_code: Option<crate::exit::Code>,
    /// The last failed run, kept after a later ready.
    pub last_failure: Option<LastFailure>,
    /// Where the load under way is.
    pub load: Option<crate::load::LoadNow>,
    /// The last load that ended, and how many have.
    pub last_load_record: Option<std::sync::Arc<crate::load::LoadRecord>>,
    pub loads_ended: u32,
    /// The last golden check's verdict.
    pub golden: Option<crate::golden::Verdict>,
    pub golden_checks: u32,
    /// Re-checks of the serving model's answers, and the time out of
    /// rotation they took in all.
    pub rechecks: u32,
    pub recheck_paused: std::time::Duration,
    /// Why the answers are being checked again, while they are.
    pub rechecking: Option<String>,
    /// The memory-fit arguments the current (or last) start used, and
    /// memory fit's adjustments since the last ready.
    pub fit: crate::fit::Used,
    pub fit_moves: u32,
    /// The setup the current (or last) start used; the rollback in force.
    pub setup: Option<String>,
    pub rolled_back: Option<RolledBack>,
    /// Engines stopped, and put to sleep, for want of requests.
    pub idle_stops: u32,
    pub sleeps: u32,
    /// While idle: how long the engine should take to serve again.
    pub idle_eta: Option<Duration>,
}

/// The last-known-good setup serves in place of a changed one that failed.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct RolledBack {
    /// The failed setup's fingerprint, and why it failed.
    pub failed: String,
    pub cause: String,
    /// The last-known-good setup's fingerprint, and when it was recorded.
    pub good: String,
    pub good_at: String,
}

/// The last failed run: why, and where its failure report is.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct LastFailure {
    pub cause: String,
    pub class: FailureClass,
    /// The report's folder; none for a start that never spawned, or with
    /// reports off.
    pub report: Option<String>,
}
