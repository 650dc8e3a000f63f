//! The machine's words: the [`Event`]s it is fed, the [`Effect`]s it asks
//! for, the [`Note`]s for systemd, the [`Record`]s for the journal, a
//! run's [`Cause`] of failure and the [`ReportOrder`] of its report.

use std::time::Duration;

use crate::Signal;

use crate::classify::Line;
use crate::outcome::{Exit, FailureClass, Permanence, Prepared, StartFailure};
use crate::policy::Policy;

/// One message to the service manager.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Note {
    Ready,
    Status(String),
    Stopping,
    ExtendTimeout(Duration),
    Watchdog,
}

/// What kind of thing ended a run, before permanence is considered.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FailureKind {
    FatalLine,
    Exit,
    Stall,
    Timeout,
    Health,
    Spawn,
    /// The golden check's answers differ from the reference.
    WrongAnswers,
    /// The golden check got no answer (a timeout, no connection, a 5xx).
    NoAnswer,
    /// The kernel's OOM killer ended a process of the run (host memory).
    OomKilled,
}

/// The one line that says why a run failed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Cause {
    pub text: String,
    pub kind: FailureKind,
    pub permanence: Permanence,
    /// What to do about it, when the cause is a known one.
    pub hint: Option<String>,
}

impl Cause {
    pub(super) fn new(text: String, kind: FailureKind) -> Cause {
        Cause { text, kind, permanence: Permanence::Transient, hint: None }
    }

    /// The cause, and its hint when it has one.
    pub(super) fn shown(&self) -> String {
        match &self.hint {
            Some(h) => format!("{} (hint: {h})", self.text),
            None => self.text.clone(),
        }
    }

    /// The class counted in the metrics: a permanent cause is counted as
    /// permanent whatever ended the run.
    pub(crate) fn class(&self) -> FailureClass {
        if self.kind == FailureKind::WrongAnswers {
            return FailureClass::WrongAnswers;
        }
        if self.permanence.is_permanent() {
            return FailureClass::Permanent;
        }
        match self.kind {
            FailureKind::FatalLine => FailureClass::FatalLine,
            FailureKind::Exit => FailureClass::Exit,
            FailureKind::Stall => FailureClass::Stall,
            FailureKind::Timeout => FailureClass::Timeout,
            FailureKind::Health => FailureClass::Health,
            FailureKind::Spawn => FailureClass::Spawn,
            FailureKind::WrongAnswers => FailureClass::WrongAnswers,
            FailureKind::NoAnswer => FailureClass::NoAnswer,
            // Counted as what ended the run: its leader's exit.
            FailureKind::OomKilled => FailureClass::Exit,
        }
    }
}

/// What happened.
#[derive(Debug, Clone, PartialEq)]
pub enum Event {
    Begin,
    /// The pre-start steps of `start` are over.
    Prepared {
        start: u32,
        result: Prepared,
    },
    /// A pre-start step of `start` begins (shown in `STATUS=`).
    PrepareStep {
        start: u32,
        text: String,
    },
    /// What the ledger knows of the setup start `start` runs, given just
    /// before its `Spawned`.
    LoadKnown {
        start: u32,
        load: Box<crate::load::LoadStart>,
    },
    /// The read-ahead of start `start`'s weights (`[prefetch]`), as it
    /// goes: shown in `STATUS=`, kept in the load's record.
    Prefetched {
        start: u32,
        now: crate::load::PrefetchNow,
    },
    Spawned {
        start: u32,
        pid: u32,
    },
    SpawnFailed {
        start: u32,
        failure: StartFailure,
    },
    Line {
        start: u32,
        line: Line,
    },
    HttpReady {
        start: u32,
    },
    /// The golden check of start `start` is over.
    GoldenChecked {
        start: u32,
        verdict: crate::golden::Verdict,
    },
    /// `health.failures` consecutive health or canary checks failed.
    HealthFailed {
        start: u32,
        cause: String,
    },
    /// The last-known-good setup's settings are in use (the backend was
    /// asked by [`Effect::Rollback`]); an error: they could not be, and why.
    RolledBack {
        policy: Result<Box<Policy>, String>,
    },
    /// The weight-cache daemon (`[preload]`) ended or stopped answering:
    /// the engine's run, starting or serving, fails; the next start
    /// begins with a new daemon.
    DaemonLost {
        cause: String,
    },
    /// A valid new config the child sees (SIGHUP): stop the child and start
    /// again with it; `summary` says which keys forced it.
    Reload {
        policy: Box<Policy>,
        summary: String,
    },
    /// A valid new config with only the warden's own settings changed:
    /// applied to the running child; `summary` says what changed.
    ReloadInPlace {
        policy: Box<Policy>,
        summary: String,
    },
    ChildExited {
        pid: u32,
        exit: Exit,
    },
    TreeGone,
    StopRequested,
    /// Take the serving child out of rotation and hold it there.
    DrainRequested,
    /// Put a drained (or draining) child back into rotation.
    UndrainRequested,
    /// Start the child again, draining it first if it serves.
    RestartRequested,
    /// The server of run `start` has no request running or waiting.
    Quiet {
        start: u32,
    },
    /// A part of the warden itself ended unexpectedly (`task` says which,
    /// and how): the tree is stopped and the warden exits 70, so that its
    /// service manager restarts it.
    TaskFailed {
        task: String,
    },
    /// The kernel reported a fatal GPU fault during run `start`.
    GpuFault {
        start: u32,
        cause: String,
    },
    /// Prove the serving model's answers again: out of rotation, the
    /// golden check, back in rotation if they are the same (else the run
    /// fails). Any trigger sends it: a GPU fault that did not end the run,
    /// an upgrade of the warden, `golden.interval`, a wake from sleep.
    /// `reason` says why, in the journal and `STATUS=`. Ignored unless
    /// ready with the golden check on.
    Recheck {
        reason: String,
    },
    /// The kernel's OOM killer ended a process of run `start` (its leader
    /// or a descendant); `cause` names it, with the memory figures. The
    /// run's cause when it ends, whatever else its log says.
    OomKilled {
        start: u32,
        cause: String,
    },
    /// The failure report of run `start` is being written into `path`.
    ReportStarted {
        start: u32,
        path: String,
    },
    /// The failure report of run `start` is written (or gave up).
    Reported {
        start: u32,
    },
    /// What is left of the tree after SIGKILL and its grace: how many live
    /// processes (zombies not counted), described.
    Survivors {
        left: usize,
        description: String,
    },
    Tick,
    /// The front door has had no request for `quiet` (`front.idle-stop`
    /// or more), and none is in flight.
    IdleFor {
        quiet: Duration,
    },
    /// A request waits at the front door for an idle engine (stopped or
    /// asleep): start or wake it.
    Wanted,
    /// The engine of run `start` was asked to sleep: confirmed asleep, or
    /// why not.
    Slept {
        start: u32,
        result: Result<(), String>,
    },
    /// The engine of run `start` was asked to wake: confirmed awake, or why
    /// not.
    Woke {
        start: u32,
        result: Result<(), String>,
    },
    /// An upgrade in place, as it goes (see `machine/upgrade.rs`).
    Upgrade(Upgrade),
}

/// What happens to an upgrade in place: asked for, its binary checked, the
/// run's lines paused, the exec failed.
#[derive(Debug, Clone, PartialEq)]
pub enum Upgrade {
    /// Replace the warden by the binary at its path, keeping the ready run.
    Requested,
    /// The binary answered `--version` (its version), or why it will not do.
    Checked(Result<String, String>),
    /// The run's lines stopped at a line's end, every line before it
    /// delivered first: the offset of the first not handed on; or why they
    /// could not be stopped.
    LinesPaused(Result<u64, String>),
    /// The exec returned: why it failed.
    ExecFailed(String),
}

impl Event {
    /// The start an event belongs to, for those that belong to one.
    pub(super) fn start(&self) -> Option<u32> {
        match self {
            Event::Prepared { start, .. }
            | Event::PrepareStep { start, .. }
            | Event::Spawned { start, .. }
            | Event::LoadKnown { start, .. }
            | Event::Prefetched { start, .. }
            | Event::SpawnFailed { start, .. }
            | Event::Line { start, .. }
            | Event::HttpReady { start }
            | Event::GoldenChecked { start, .. }
            | Event::HealthFailed { start, .. }
            | Event::Quiet { start }
            | Event::GpuFault { start, .. }
            | Event::OomKilled { start, .. }
            | Event::ReportStarted { start, .. }
            | Event::Slept { start, .. }
            | Event::Woke { start, .. }
            | Event::Reported { start } => Some(*start),
            _ => None,
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Severity {
    Info,
    Warn,
    Error,
}

/// The `EVENT=` field of a warden event in the journal.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Topic {
    Spawned,
    ReadyLine,
    Ready,
    Fatal,
    Failed,
    Backoff,
    Stop,
    Kill,
    Exited,
    Stopped,
    GaveUp,
    Reload,
    Drain,
    Internal,
    Unkillable,
    Upgrade,
    /// A load slower than its setup's history, or one whose compile cache
    /// did less than before.
    LoadAlarm,
    /// The golden check: its answers as before, or recorded.
    Golden,
    /// The golden check's answers differ, or it could not be made.
    GoldenMismatch,
    /// A load ended (ready, failed or stopped) and went into the ledger.
    Load,
    /// Memory fit moved an argument, pinned one, or could not help.
    Fit,
    /// The last-known-good setup replaces a changed setup that failed.
    Rollback,
    /// The engine stopped or put to sleep for want of requests, and
    /// started or woken for one.
    Idle,
}

impl Topic {
    pub fn as_str(self) -> &'static str {
        match self {
            Topic::Spawned => "spawned",
            Topic::ReadyLine => "ready-line",
            Topic::Ready => "ready",
            Topic::Fatal => "fatal",
            Topic::Failed => "failed",
            Topic::Backoff => "backoff",
            Topic::Stop => "stop",
            Topic::Kill => "kill",
            Topic::Exited => "exited",
            Topic::Stopped => "stopped",
            Topic::GaveUp => "gave-up",
            Topic::Upgrade => "upgrade",
            Topic::Reload => "reload",
            Topic::Drain => "drain",
            Topic::Internal => "internal",
            Topic::Unkillable => "unkillable",
            Topic::LoadAlarm => "load-alarm",
            Topic::Golden => "golden",
            Topic::GoldenMismatch => "golden-mismatch",
            Topic::Load => "load",
            Topic::Fit => "fit",
            Topic::Rollback => "rollback",
            Topic::Idle => "idle",
        }
    }

    /// The journal's `MESSAGE_ID` of the events worth a query of their own.
    pub fn message_id(self) -> Option<&'static str> {
        match self {
            Topic::LoadAlarm => Some(LOAD_ALARM_MESSAGE_ID),
            Topic::GoldenMismatch => Some(GOLDEN_MISMATCH_MESSAGE_ID),
            Topic::Fit => Some(FIT_MESSAGE_ID),
            Topic::Rollback => Some(ROLLBACK_MESSAGE_ID),
            _ => None,
        }
    }
}

/// `MESSAGE_ID` of a load alarm: `journalctl MESSAGE_ID=…` lists them.
pub(crate) const LOAD_ALARM_MESSAGE_ID: &str = "5d8f0c3ae6a44d1f9c4b7a21e0d3b6c8";

/// `MESSAGE_ID` of a golden check whose answers changed, or that failed.
pub(crate) const GOLDEN_MISMATCH_MESSAGE_ID: &str = "a3b7e2c95f0d4e6b8c1a9d7f3e5b2c40";

/// `MESSAGE_ID` of memory fit's events: an argument moved, pinned, or
/// no move within the bounds.
pub const FIT_MESSAGE_ID: &str = "7c2e9a4f1b6d4c3e8a5f0d2b9e7c1a64";

/// `MESSAGE_ID` of a rollback to the last-known-good setup.
pub(crate) const ROLLBACK_MESSAGE_ID: &str = "e41f6b8d2c9a4e7f9b3d5a1c8e6f2d07";

/// A warden event for the journal.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Record {
    pub severity: Severity,
    pub topic: Topic,
    pub message: String,
    /// The run the event is about, when that is not simply the machine's
    /// run of the moment: a failure names the attempt that failed and the
    /// pid that ran it, though by the time it is logged the leader may be
    /// gone (a run that exited) or the failure already counted (a start
    /// that failed). `None`: the machine's current child and attempt.
    pub about: Option<RunOf>,
}

/// A run as the journal names it (`CHILD_PID`, `ATTEMPT`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RunOf {
    /// The run's child; none for a start that never spawned.
    pub pid: Option<u32>,
    pub attempt: u32,
}

/// What to do.
#[derive(Debug, Clone, PartialEq)]
pub enum Effect {
    /// Run the pre-start steps (leftovers, patches, shared memory, port,
    /// GPUs) in the background; `Prepared` when done.
    Prepare {
        start: u32,
    },
    /// Give up the pre-start steps at their next wait; `Prepared` follows.
    CancelPrepare,
    /// Create the log, spawn, follow.
    Spawn {
        start: u32,
    },
    /// GET `ready.http` until it answers 200, then `HttpReady`.
    Probe {
        start: u32,
    },
    /// Check the ready child's health (and the canary) until the run ends;
    /// `HealthFailed` after `health.failures` failed checks in a row.
    Health {
        start: u32,
    },
    /// The signal to the leader, or to every descendant left without it;
    /// `TreeGone` once none is left.
    Terminate(Signal),
    /// SIGKILL to the group and every descendant; `TreeGone` once none is left.
    KillTree,
    /// Describe what is left of the tree after SIGKILL (pid, state, wchan);
    /// `Survivors` follows.
    DescribeSurvivors,
    /// Watch the server's requests in flight; `Quiet` once none is running
    /// or waiting.
    WatchLoad {
        start: u32,
    },
    /// Stop watching them (the drain was undone).
    UnwatchLoad,
    /// Write the failure report of a failed run, off the loop, while its
    /// tree is still there; `ReportStarted` at once, `Reported` when done.
    Report(ReportOrder),
    /// Give up the report under way (what is written stays).
    CancelReport,
    Notify(Vec<Note>),
    Log(Record),
    /// A load ended: into the ledger.
    LoadEnded(Box<crate::load::LoadRecord>),
    /// Ask the golden prompts of start `start`; `GoldenChecked` follows.
    Golden {
        start: u32,
    },
    /// Memory fit: the next starts set these arguments over the command
    /// line's and over the setup's pinned values (empty: none).
    Fit(std::collections::BTreeMap<crate::policy::FitArg, String>),
    /// A start with fitted values reached ready: pin them for its setup.
    Pin(std::collections::BTreeMap<crate::policy::FitArg, String>),
    /// A start with pinned values failed: drop those pins of its setup.
    Unpin(std::collections::BTreeMap<crate::policy::FitArg, String>),
    /// The setup of the run just ready is good: keep it as the
    /// last-known-good.
    SetupGood,
    /// Use the last-known-good setup's settings from the next start;
    /// `RolledBack` follows.
    Rollback,
    /// Put the engine of run `start` to sleep (vLLM's `POST /sleep?level=N`,
    /// confirmed by `GET /is_sleeping`); its health checks end. `Slept`
    /// follows.
    Sleep {
        start: u32,
        level: u8,
    },
    /// Wake the engine of run `start` (`POST /wake_up`, confirmed by `GET
    /// /is_sleeping`); `Woke` follows.
    Wake {
        start: u32,
    },
    /// The engine was stopped for want of requests: what it left goes, and
    /// the GPUs are looked at, as after any stop.
    Parked,
    /// Ask the binary at the warden's path for its version, off the loop;
    /// `Upgrade::Checked` follows.
    CheckUpgrade,
    /// Stop following the run's lines at a line's end, the front door
    /// emptied first when there is one; `Upgrade::LinesPaused` follows,
    /// after the lines read before it.
    PauseLines,
    /// Replace the warden by the binary at its path, handing over `saved`
    /// and the lines from `offset`; `Upgrade::ExecFailed` if it returns.
    ExecUpgrade {
        saved: Box<Saved>,
        offset: u64,
    },
    /// The hand-over is off: the lines followed again from `offset` when
    /// they were paused, the front door serving again.
    ResumeLines {
        offset: Option<u64>,
    },
}

/// What the failure report of a run is to say, as the machine knows it.
#[derive(Debug, Clone, PartialEq)]
pub struct ReportOrder {
    pub start: u32,
    pub attempt: u32,
    /// The run's child (its leader), which may have exited already.
    pub pid: u32,
    pub cause: String,
    pub class: FailureClass,
    pub hint: Option<String>,
    /// When the first progress line came, the run became ready, and it
    /// failed, each counted from the spawn.
    pub first_progress: Option<Duration>,
    pub ready: Option<Duration>,
    pub failed: Duration,
    /// How the leader ended, when it has.
    pub exit: Option<Exit>,
}

/// A ready run handed to a successor warden (see
/// [`Machine::save`](crate::Machine::save)): the instants as
/// time elapsed, since the successor's clock is its own.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct Saved {
    pub start: u32,
    pub pid: u32,
    pub ready_for: Duration,
    pub running_for: Duration,
    pub starts: u32,
    pub failures: u32,
    pub restarts: u32,
    /// Absent from a predecessor that did not know it.
    #[serde(default)]
    pub restarts_by: std::collections::BTreeMap<crate::outcome::RestartReason, u32>,
    pub exits: u32,
    pub last_load: Option<Duration>,
    pub failure_counts: std::collections::BTreeMap<FailureClass, u64>,
    /// Absent from a predecessor that did not know it.
    #[serde(default)]
    pub last_failure: Option<crate::snapshot::LastFailure>,
    /// The run was drained and held out of rotation: the successor holds
    /// it so (`/readyz` 503) until `undrain`. Absent from a predecessor
    /// that did not know it.
    #[serde(default)]
    pub drained: bool,
    /// The last load that ended, and the last golden verdict: what the
    /// status document shows of them goes on showing. Absent from a
    /// predecessor that did not know them.
    #[serde(default)]
    pub last_load_record: Option<crate::load::LoadRecord>,
    #[serde(default)]
    pub golden: Option<crate::golden::Verdict>,
}
