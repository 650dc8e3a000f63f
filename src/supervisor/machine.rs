//! The supervisor as a pure state machine: `step(event, now) -> effects`.
//! It decides when the child is ready, when a start or a ready child has
//! failed and why, how long to back off, when to give up, and what to tell
//! systemd. It performs no I/O: the driver (`daemon::driver`) carries out the
//! effects and feeds back what happened. sd_notify's wire format, regexes
//! and processes are not known here.
//!
//! Each state carries exactly the data that is valid in it. Events that
//! belong to an earlier start (a line, a probe answer, a reaped pid of a run
//! that is over) are dropped once, before the transition table.
//!
//! States and their transitions (every other pair is logged and ignored):
//!
//! ```text
//!            Begin                Spawned            log line + HTTP 200
//!   Idle ──────────▶ Launching ─────────────▶ Starting ─────────────────▶ Ready
//!                      ▲   │ Prepared(failed)    │ exit / fatal+grace /      │ exit (even 0) /
//!                      │   │ SpawnFailed         │ stall / timeout           │ fatal+grace / health
//!                      │   ▼                     ▼                           ▼
//!                      │  (failure)           Stopping ◀─────────────────────┘
//!               Tick   │                         │ TreeGone
//!                      │       delay             ▼
//!                   Backoff ◀────────────── (failure) ──▶ Done(75 | 78)
//!   StopRequested: Starting/Ready → Stopping(shutdown) → Done(0); Launching → Done(0)
//!                  once its steps are cancelled; Backoff → Done(0)
//!   TaskFailed (a part of the warden died): the tree is stopped, then Done(70)
//!
//!   A failed run (Starting/Ready → failure) first goes through Reporting:
//!            Report              Reported / deadline
//!   (failure) ──────▶ Reporting ─────────────────────▶ Stopping
//!   the failure report is written while the tree is still there; its
//!   deadline is the report budget (`reports.timeout` + a margin), so a
//!   wedged report never holds the stop. StopRequested cuts the report short
//!   and stops at once. A run whose leader has exited and whose tree is
//!   gone (TreeGone) has nothing left to stop: its report goes on beside
//!   what follows (the backend holds the next spawn until the report has
//!   what describes the run as it was). Without reports (`reports.keep = 0`)
//!   a failure goes straight to Stopping.
//! ```

use std::collections::BTreeMap;
use std::time::Duration;

use nix::sys::signal::Signal;
use tokio::time::Instant;

use crate::config::Settings;
use crate::supervisor::classify::{Class, Exception, Line};
use crate::supervisor::exit::Code;
use crate::supervisor::outcome::Exit;
use crate::supervisor::outcome::{FailureClass, Permanence, Phase, Prepared, StartFailure};

/// Before ready there is nothing to drain, and vLLM can lose a SIGTERM sent
/// during its load: the stop signal is repeated this often …
pub const LOAD_STOP_RESEND: Duration = Duration::from_secs(1);
/// … and SIGKILL follows after at most this long (or `stop-timeout`, if
/// shorter). The same short grace applies to what is left of a failed run.
pub const LOAD_STOP_GRACE: Duration = Duration::from_secs(10);
/// After SIGKILL, how long the tree gets to be gone. A process still there
/// is stuck in the kernel (state `D`; for a GPU server, usually the driver):
/// it is reported and the warden gives up on it.
pub const KILL_GRACE: Duration = Duration::from_secs(10);
/// How long the report of such survivors may take (reading `/proc` of a
/// process stuck in the kernel can hang too).
pub const DESCRIBE_GRACE: Duration = Duration::from_secs(5);
/// What the pre-start steps may take beyond their own waits (leftovers,
/// port, GPUs): patches, `/proc` scans, the GPU query's own time limit.
pub const PREPARE_MARGIN: Duration = Duration::from_secs(60);
/// How long one run of an external command (the GPU query) may take.
pub const COMMAND_TIMEOUT: Duration = Duration::from_secs(20);
/// What a failure report may take beyond `reports.timeout` (which bounds
/// its commands) before the machine stops waiting for it: its file writes.
pub const REPORT_MARGIN: Duration = Duration::from_secs(5);

/// One message to the service manager.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Note {
    Ready,
    Status(String),
    Stopping,
    ExtendTimeout(Duration),
    Watchdog,
}

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
    pub restart: crate::config::Restart,
    /// A remedy line for known causes.
    pub hints: crate::supervisor::hints::Hints,
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
}

/// The pre-start steps' whole budget: stopping leftovers (stop timeout and
/// the kill grace), the port wait, the GPU wait and one more query, the
/// Ray cluster's wait and one more look, plus a margin for the rest.
pub fn prepare_timeout(s: &Settings) -> Duration {
    // The Ray gate's last look may start just before its wait ends.
    let ray = s
        .prestart
        .ray
        .as_ref()
        .filter(|c| c.gate)
        .map_or(Duration::ZERO, |c| c.wait.saturating_add(crate::config::defaults::RAY_STATUS_TIMEOUT));
    [
        s.child.stop_timeout,
        KILL_GRACE,
        s.prestart.port_wait,
        s.prestart.gpu_idle_wait,
        COMMAND_TIMEOUT,
        ray,
        PREPARE_MARGIN,
    ]
    .into_iter()
    .fold(Duration::ZERO, Duration::saturating_add)
}

impl Policy {
    pub fn from_settings(s: &Settings) -> Policy {
        Policy {
            ready_log: !s.patterns.ready.is_empty(),
            ready_http: s.ready.http.is_some() || s.ready_by_ray().is_some(),
            ready_timeout: s.ready.timeout,
            stall: s.ready.stall,
            grace: s.fatal.grace,
            stop_signal: s.child.stop_signal,
            stop_timeout: s.child.stop_timeout,
            prepare_timeout: prepare_timeout(s),
            restart: s.restart.clone(),
            hints: crate::supervisor::hints::Hints::new(s.profile, &s.hints, &s.patches, &s.child.command),
            drain_delay: s.drain.delay,
            drain_timeout: s.drain.timeout,
            drain_on_stop: s.drain.on_stop,
            report: (s.reports.keep > 0).then(|| s.reports.timeout.saturating_add(REPORT_MARGIN)),
        }
    }

    /// The delay before attempt `n + 1`, after `n` consecutive failures,
    /// before jitter: `initial × factor^(n-1)`, capped.
    pub fn backoff(&self, n: u32) -> Duration {
        let exp = self.restart.factor.powi(n.saturating_sub(1).min(1000) as i32);
        let secs = (self.restart.initial_delay.as_secs_f64() * exp).min(self.restart.max_delay.as_secs_f64());
        Duration::from_secs_f64(secs.max(0.0))
    }
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
    fn new(text: String, kind: FailureKind) -> Cause {
        Cause { text, kind, permanence: Permanence::Transient, hint: None }
    }

    /// The cause, and its hint when it has one.
    fn shown(&self) -> String {
        match &self.hint {
            Some(h) => format!("{} (hint: {h})", self.text),
            None => self.text.clone(),
        }
    }

    /// The class counted in the metrics: a permanent cause is counted as
    /// permanent whatever ended the run.
    pub fn class(&self) -> FailureClass {
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
    /// `health.failures` consecutive health or canary checks failed.
    HealthFailed {
        start: u32,
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
}

impl Event {
    /// The start an event belongs to, for those that belong to one.
    fn start(&self) -> Option<u32> {
        match self {
            Event::Prepared { start, .. }
            | Event::PrepareStep { start, .. }
            | Event::Spawned { start, .. }
            | Event::SpawnFailed { start, .. }
            | Event::Line { start, .. }
            | Event::HttpReady { start }
            | Event::HealthFailed { start, .. }
            | Event::Quiet { start }
            | Event::GpuFault { start, .. }
            | Event::ReportStarted { start, .. }
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
        }
    }
}

/// A warden event for the journal.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Record {
    pub severity: Severity,
    pub topic: Topic,
    pub message: String,
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
}

/// What the failure report of a run is to say, as the machine knows it.
#[derive(Debug, Clone, PartialEq)]
pub struct ReportOrder {
    pub start: u32,
    pub attempt: u32,
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

/// What is known of one run of the child, from its spawn on.
#[derive(Debug, Clone, PartialEq)]
pub struct Run {
    start: u32,
    pid: u32,
    spawned_at: Instant,
    /// The first progress line came at this instant.
    first_progress: Option<Instant>,
    /// A fatal line was seen at this instant: the child has `grace` to exit.
    fatal_at: Option<Instant>,
    /// The first fatal line (or a later permanent one), with its permanence.
    first_fatal: Option<(String, Permanence)>,
    /// The first traceback's final exception line, and its permanence.
    exception: Option<(Exception, Permanence)>,
}

impl Run {
    /// The cause to report if this run fails now, when its log tells one.
    fn logged_cause(&self) -> Option<Cause> {
        let exc = self.exception.as_ref().map(|(e, p)| (e.text.clone(), *p));
        let fatal = self.first_fatal.clone();
        // A permanent match wins, then the exception line, then the fatal line.
        let (text, permanence) =
            [exc.clone(), fatal.clone()].into_iter().flatten().find(|(_, p)| p.is_permanent()).or(exc).or(fatal)?;
        Some(Cause { text, kind: FailureKind::FatalLine, permanence, hint: None })
    }

    /// The cause of this run's end when its fatal line's grace has passed.
    fn fatal_grace_over(&self, grace: Duration, now: Instant) -> Option<Cause> {
        self.fatal_at.filter(|t| now >= *t + grace).and_then(|_| self.logged_cause())
    }
}

/// A run that is loading.
#[derive(Debug, Clone, PartialEq)]
pub struct Loading {
    run: Run,
    /// The last progress line, and when it came (the stall deadline counts
    /// from it).
    progress_at: Instant,
    progress: Option<String>,
    /// The ready line was seen (or none is expected); waiting for HTTP 200.
    awaiting_http: bool,
}

/// A run that is serving.
#[derive(Debug, Clone, PartialEq)]
pub struct Serving {
    run: Run,
    ready_at: Instant,
    /// Being taken out of rotation, or held out of it.
    drain: Option<Drain>,
}

/// What a drain ends in.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DrainFor {
    /// The child keeps running, out of rotation, until undrained.
    Hold,
    /// The child is started again (`restart`).
    Restart,
    /// The child is started again with a new config.
    Reload,
    /// The warden stops.
    Stop,
}

/// How far a drain has gone.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DrainStage {
    /// Unready; the balancer is given until then to notice.
    Delay { until: Instant },
    /// Waiting for no request running or waiting, at most until then.
    Quiesce { deadline: Instant },
    /// Out of rotation and quiet (a hold).
    Drained,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Drain {
    pub for_: DrainFor,
    pub stage: DrainStage,
    pub began: Instant,
}

/// Why the tree is being stopped.
#[derive(Debug, Clone, PartialEq)]
pub enum Purpose {
    Shutdown,
    Failure(Cause),
    /// A new config: start again with it once the tree is gone.
    Reload,
    /// Asked for (`restart`): start again once the tree is gone.
    Restart,
    /// A part of the warden failed: exit 70 once the tree is gone.
    Internal(String),
}

/// How far a stop has escalated.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Escalation {
    /// The stop signal was sent; it is sent again at `resend_at` (before
    /// ready, while the leader lives), and SIGKILL follows at `kill_at`.
    Signalled { kill_at: Instant, resend_at: Option<Instant> },
    /// SIGKILL was sent to the whole tree at this instant.
    Killed { at: Instant },
    /// Processes survived SIGKILL; waiting for their description until then.
    Abandoning { until: Instant },
}

#[derive(Debug, Clone, PartialEq)]
pub struct Stop {
    purpose: Purpose,
    /// The leader's pid, until it is reaped.
    leader: Option<u32>,
    /// How long the run had been ready, if it was.
    ready_for: Option<Duration>,
    escalation: Escalation,
}

/// A failed run whose report is being written before its tree is stopped.
#[derive(Debug, Clone, PartialEq)]
pub struct Reporting {
    /// The run as it was when it failed: `Starting` or `Ready`.
    run: Box<State>,
    /// What the stop that follows is for: the failure, or what came since
    /// (a reload, a failure of the warden).
    purpose: Purpose,
    /// The report's budget: the stop begins then, written or not.
    until: Instant,
    /// The leader has not exited.
    leader: bool,
}

/// What to do once the pre-start steps are over.
#[derive(Debug, Clone, PartialEq)]
pub enum AfterPrepare {
    /// Spawn, if the steps are over by `deadline`; `step` is the one now
    /// under way.
    Spawn { deadline: Instant, step: Option<String> },
    /// A reload came meanwhile: start again with the new config.
    Relaunch,
    /// A stop (or a failure of the warden) came meanwhile.
    Stop(Purpose),
}

#[derive(Debug, Clone, PartialEq)]
pub enum State {
    Idle,
    /// Pre-start steps and spawn of `start`.
    Launching {
        start: u32,
        then: AfterPrepare,
    },
    Starting(Loading),
    Ready(Serving),
    Reporting(Reporting),
    Stopping(Stop),
    Backoff {
        until: Instant,
        cause: Cause,
    },
    Done(Code),
}

/// The supervisor: its state and its counters.
#[derive(Debug)]
pub struct Machine {
    policy: Policy,
    state: State,
    /// Drives the jitter: seeded in tests.
    rng: fastrand::Rng,
    /// Spawns so far (`start N` in the log marker); the current start.
    starts: u32,
    /// Consecutive failed starts.
    failures: u32,
    /// Spawns after the first.
    restarts: u32,
    /// The permanent cause of the last failures, and how many in a row.
    permanent_streak: Option<(Permanence, u32)>,
    last_exit: Option<Exit>,
    /// Children exited so far (the status document dates the last exit
    /// when this changes).
    exits: u32,
    /// Why the last run failed, or why the warden ended; cleared by ready.
    cause: Option<Cause>,
    /// Spawn to ready of the last ready run.
    last_load: Option<Duration>,
    /// Failed runs by class.
    failure_counts: BTreeMap<FailureClass, u64>,
    /// The last failed run: its cause and report; kept after ready.
    last_failure: Option<crate::supervisor::snapshot::LastFailure>,
    /// The version of the warden this one took the ready run over from.
    upgraded_from: Option<String>,
}

/// A ready run handed to a successor warden (see [`Machine::save`]): the
/// instants as time elapsed, since the successor's clock is its own.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct Saved {
    pub start: u32,
    pub pid: u32,
    pub ready_for: Duration,
    pub running_for: Duration,
    pub starts: u32,
    pub failures: u32,
    pub restarts: u32,
    pub exits: u32,
    pub last_load: Option<Duration>,
    pub failure_counts: BTreeMap<FailureClass, u64>,
    /// Absent from a predecessor that did not know it.
    #[serde(default)]
    pub last_failure: Option<crate::supervisor::snapshot::LastFailure>,
    /// The run was drained and held out of rotation: the successor holds
    /// it so (`/readyz` 503) until `undrain`. Absent from a predecessor
    /// that did not know it.
    #[serde(default)]
    pub drained: bool,
}

fn secs(d: Duration) -> String {
    humantime::format_duration(Duration::from_secs(d.as_secs_f64().round() as u64)).to_string()
}

fn record(severity: Severity, topic: Topic, message: String) -> Effect {
    Effect::Log(Record { severity, topic, message })
}

fn status(text: String) -> Note {
    Note::Status(text)
}

impl Machine {
    /// `seed` drives the jitter: fixed in tests, random in the daemon.
    pub fn new(policy: Policy, seed: u64) -> Machine {
        Machine {
            policy,
            state: State::Idle,
            rng: fastrand::Rng::with_seed(seed),
            starts: 0,
            failures: 0,
            restarts: 0,
            permanent_streak: None,
            last_exit: None,
            exits: 0,
            cause: None,
            last_load: None,
            failure_counts: BTreeMap::new(),
            upgraded_from: None,
            last_failure: None,
        }
    }

    pub fn policy(&self) -> &Policy {
        &self.policy
    }

    /// The ready run and the counts, for a successor that takes over (an
    /// upgrade in place); `None` unless ready with no fatal line waiting
    /// for its grace and no drain under way (a drain held is handed over;
    /// one that ends in a restart, a reload or a stop is waited for).
    pub fn save(&self, now: Instant) -> Option<Saved> {
        let State::Ready(serving) = &self.state else { return None };
        if serving.run.fatal_at.is_some() || self.drain_under_way() {
            return None;
        }
        Some(Saved {
            start: serving.run.start,
            pid: serving.run.pid,
            ready_for: now - serving.ready_at,
            running_for: now - serving.run.spawned_at,
            starts: self.starts,
            failures: self.failures,
            restarts: self.restarts,
            exits: self.exits,
            last_load: self.last_load,
            failure_counts: self.failure_counts.clone(),
            last_failure: self.last_failure.clone(),
            drained: serving.drain.is_some(),
        })
    }

    /// A drain that has not yet ended in what it is for (held drained, a
    /// restart, a reload, a stop): an upgrade waits for it.
    pub fn drain_under_way(&self) -> bool {
        let State::Ready(serving) = &self.state else { return false };
        serving.drain.is_some_and(|d| !(d.for_ == DrainFor::Hold && d.stage == DrainStage::Drained))
    }

    /// A machine that takes over the ready run `saved` of a predecessor
    /// (version `from`): its first event, [`Event::Begin`], starts the
    /// health checks and says so, with no new `READY=1`.
    pub fn adopt(policy: Policy, seed: u64, saved: &Saved, from: &str, now: Instant) -> Machine {
        let mut m = Machine::new(policy, seed);
        let back = |d: Duration| now.checked_sub(d).unwrap_or(now);
        let run = Run {
            start: saved.start,
            pid: saved.pid,
            spawned_at: back(saved.running_for),
            first_progress: None,
            fatal_at: None,
            first_fatal: None,
            exception: None,
        };
        let drain = saved.drained.then_some(Drain { for_: DrainFor::Hold, stage: DrainStage::Drained, began: now });
        m.state = State::Ready(Serving { run, ready_at: back(saved.ready_for), drain });
        m.starts = saved.starts;
        m.failures = saved.failures;
        m.restarts = saved.restarts;
        m.exits = saved.exits;
        m.last_load = saved.last_load;
        m.failure_counts = saved.failure_counts.clone();
        m.last_failure = saved.last_failure.clone();
        m.upgraded_from = Some(from.to_string());
        m
    }

    pub fn state(&self) -> &State {
        &self.state
    }

    /// The current (or last) start number.
    pub fn starts(&self) -> u32 {
        self.starts
    }

    /// Consecutive failed starts.
    pub fn failures(&self) -> u32 {
        self.failures
    }

    pub fn restarts(&self) -> u32 {
        self.restarts
    }

    pub fn cause(&self) -> Option<&Cause> {
        self.cause.as_ref()
    }

    /// The exit code, once the machine is done.
    pub fn done(&self) -> Option<Code> {
        match self.state {
            State::Done(code) => Some(code),
            _ => None,
        }
    }

    pub fn phase(&self) -> Phase {
        phase_of(&self.state)
    }

    /// The current run's latest progress line, while starting.
    pub fn progress(&self) -> Option<&str> {
        match &self.state {
            State::Starting(l) => l.progress.as_deref(),
            _ => None,
        }
    }

    /// What the status document and the metrics show.
    pub fn snapshot(&self) -> crate::supervisor::snapshot::Snapshot {
        crate::supervisor::snapshot::Snapshot {
            phase: self.phase(),
            child_pid: self.child_pid(),
            attempt: self.attempt(),
            restarts: self.restarts,
            starts: self.starts,
            progress: self.progress().map(String::from),
            cause: self.cause.as_ref().map(|c| c.text.clone()),
            hint: self.cause.as_ref().and_then(|c| c.hint.clone()),
            exits: self.exits,
            last_exit: self.last_exit,
            last_load: self.last_load,
            failures: self.failure_counts.clone(),
            exit_code: self.done(),
            last_failure: self.last_failure.clone(),
        }
    }

    /// The attempt number of the current or next start.
    pub fn attempt(&self) -> u32 {
        self.failures.saturating_add(1)
    }

    fn attempts_text(&self) -> String {
        match self.policy.restart.max_attempts {
            0 => format!("attempt {}", self.attempt()),
            max => format!("attempt {}/{max}", self.attempt()),
        }
    }

    /// The pid of the child, while there is one.
    pub fn child_pid(&self) -> Option<u32> {
        match &self.state {
            State::Starting(l) => Some(l.run.pid),
            State::Ready(s) => Some(s.run.pid),
            State::Stopping(s) => s.leader,
            State::Reporting(r) => into_run(&r.run).filter(|_| r.leader).map(|(run, _)| run.pid),
            _ => None,
        }
    }

    /// When the machine wants a `Tick`.
    pub fn next_deadline(&self) -> Option<Instant> {
        let p = &self.policy;
        match &self.state {
            State::Starting(l) => [
                Some(l.run.spawned_at + p.ready_timeout),
                Some(l.progress_at + p.stall),
                l.run.fatal_at.map(|t| t + p.grace),
            ]
            .into_iter()
            .flatten()
            .min(),
            State::Ready(s) => {
                let drain = s.drain.and_then(|d| match d.stage {
                    DrainStage::Delay { until } => Some(until),
                    DrainStage::Quiesce { deadline } => Some(deadline),
                    DrainStage::Drained => None,
                });
                [s.run.fatal_at.map(|t| t + p.grace), drain].into_iter().flatten().min()
            }
            State::Stopping(s) => Some(match s.escalation {
                Escalation::Signalled { kill_at, resend_at } => resend_at.map_or(kill_at, |r| r.min(kill_at)),
                Escalation::Killed { at } => at + KILL_GRACE,
                Escalation::Abandoning { until } => until,
            }),
            State::Backoff { until, .. } => Some(*until),
            State::Reporting(r) => Some(r.until),
            State::Launching { then: AfterPrepare::Spawn { deadline, .. }, .. } => Some(*deadline),
            State::Idle | State::Launching { .. } | State::Done(_) => None,
        }
    }

    /// An event of an earlier start, or of a process that is not (or no
    /// longer) our child.
    fn is_stale(&self, event: &Event) -> bool {
        match event {
            Event::ChildExited { pid, .. } => self.child_pid() != Some(*pid),
            e => e.start().is_some_and(|s| s != self.starts),
        }
    }

    pub fn step(&mut self, event: Event, now: Instant) -> Vec<Effect> {
        if self.is_stale(&event) {
            tracing::debug!(?event, "stale event dropped");
            return Vec::new();
        }
        let state = std::mem::replace(&mut self.state, State::Idle);
        let (next, effects) = self.transition(state, event, now);
        self.state = next;
        effects
    }

    fn transition(&mut self, state: State, event: Event, now: Instant) -> (State, Vec<Effect>) {
        use Event as E;
        use State as S;
        match (state, event) {
            (S::Idle, E::Begin) => self.launch(now),
            (S::Ready(serving), E::Begin) => {
                let from = self.upgraded_from.take().unwrap_or_default();
                let now_is = match &serving.drain {
                    Some(d) => self.drain_text(&serving, d),
                    None => format!("ready: pid {}", serving.run.pid),
                };
                let text = format!("upgraded from {from} to {}; {now_is}", env!("CARGO_PKG_VERSION"));
                let fx = vec![
                    record(Severity::Info, Topic::Upgrade, text.clone()),
                    Effect::Notify(vec![status(text)]),
                    Effect::Health { start: serving.run.start },
                ];
                (S::Ready(serving), fx)
            }

            (S::Launching { start, then }, E::Prepared { result, .. }) => match (then, result) {
                (AfterPrepare::Stop(purpose), _) => self.stopped(purpose, None, now, vec![]),
                (AfterPrepare::Relaunch, _) => self.launch(now),
                (then @ AfterPrepare::Spawn { .. }, Prepared::Done) => {
                    (S::Launching { start, then }, vec![Effect::Spawn { start }])
                }
                (AfterPrepare::Spawn { .. }, Prepared::Failed(failure)) => self.start_failed(failure, now),
                // Nothing asked for it; fail the start rather than wait for ever.
                (AfterPrepare::Spawn { .. }, Prepared::Cancelled) => {
                    self.start_failed(StartFailure::transient("pre-start steps cancelled"), now)
                }
            },
            (S::Launching { start, then }, E::Spawned { pid, .. }) => {
                let mut loading = Loading {
                    run: Run {
                        start,
                        pid,
                        spawned_at: now,
                        first_progress: None,
                        fatal_at: None,
                        first_fatal: None,
                        exception: None,
                    },
                    progress_at: now,
                    progress: None,
                    awaiting_http: false,
                };
                let mut fx = vec![
                    record(Severity::Info, Topic::Spawned, format!("child spawned, pid {pid}, start {start}")),
                    Effect::Notify(vec![
                        status(format!("loading, pid {pid} ({})", self.attempts_text())),
                        Note::ExtendTimeout(self.policy.stall),
                    ]),
                ];
                if !self.policy.ready_log {
                    loading.awaiting_http = true;
                    fx.push(Effect::Probe { start });
                }
                match then {
                    AfterPrepare::Stop(purpose) => self.begin_stop(S::Starting(loading), purpose, now, fx),
                    AfterPrepare::Relaunch => self.begin_stop(S::Starting(loading), Purpose::Reload, now, fx),
                    AfterPrepare::Spawn { .. } => (S::Starting(loading), fx),
                }
            }
            (S::Launching { then, .. }, E::SpawnFailed { failure, .. }) => match then {
                AfterPrepare::Stop(purpose) => self.stopped(purpose, None, now, vec![]),
                AfterPrepare::Relaunch => self.launch(now),
                AfterPrepare::Spawn { .. } => self.start_failed(failure, now),
            },
            (S::Launching { start, then: AfterPrepare::Spawn { deadline, .. } }, E::PrepareStep { text, .. }) => {
                let fx = vec![Effect::Notify(vec![status(text.clone())])];
                (S::Launching { start, then: AfterPrepare::Spawn { deadline, step: Some(text) } }, fx)
            }
            (S::Launching { then: AfterPrepare::Spawn { deadline, step }, .. }, E::Tick) if now >= deadline => {
                let budget = secs(self.policy.prepare_timeout);
                let at = step.map(|s| format!("; stuck at: {s}")).unwrap_or_default();
                let failure = StartFailure::transient(format!("pre-start steps did not finish within {budget}{at}"));
                let (next, mut fx) = self.start_failed(failure, now);
                fx.insert(0, Effect::CancelPrepare);
                (next, fx)
            }
            (S::Launching { start, then }, E::StopRequested) => {
                let fx = vec![Effect::Notify(vec![Note::Stopping, status("stopping".into())])];
                match then {
                    // Asked twice: the cancel is already under way.
                    AfterPrepare::Stop(Purpose::Shutdown) => (S::Launching { start, then }, vec![]),
                    _ => self.cancel_launch(start, Purpose::Shutdown, fx),
                }
            }

            (S::Starting(loading), E::Line { line, .. }) => self.starting_line(loading, line, now),
            (S::Ready(mut serving), E::Line { line, .. }) => {
                let fx = self.note_fatal(&mut serving.run, &line, now);
                (S::Ready(serving), fx)
            }
            (S::Starting(loading), E::HttpReady { .. }) if loading.awaiting_http && loading.run.fatal_at.is_none() => {
                self.become_ready(loading, now)
            }
            (state @ (S::Starting(_) | S::Ready(_)), E::ChildExited { exit, .. }) => {
                self.last_exit = Some(exit);
                self.exits += 1;
                let Some((run, ready_at)) = into_run(&state) else { return (state, vec![]) };
                let cause = run.logged_cause().unwrap_or_else(|| {
                    let text = match ready_at {
                        Some(_) => format!("exited while serving ({exit})"),
                        None => format!("exited before ready ({exit})"),
                    };
                    Cause::new(text, FailureKind::Exit)
                });
                let (next, fx) = self.fail(state, cause, Some(exit), now);
                (leader_gone(next), fx)
            }
            (S::Starting(loading), E::Tick) => {
                let p = &self.policy;
                let run = &loading.run;
                let cause = if let Some(c) = run.fatal_grace_over(p.grace, now) {
                    Some(c)
                } else if now >= run.spawned_at + p.ready_timeout {
                    Some(Cause::new(
                        format!("not ready after {} (ready.timeout)", secs(p.ready_timeout)),
                        FailureKind::Timeout,
                    ))
                } else if now >= loading.progress_at + p.stall {
                    let last = loading.progress.as_deref().map(|l| format!("; last: {l}")).unwrap_or_default();
                    Some(Cause::new(
                        format!("no progress for {} (ready.stall){last}", secs(p.stall)),
                        FailureKind::Stall,
                    ))
                } else {
                    None
                };
                match cause {
                    Some(c) => self.fail(S::Starting(loading), c, None, now),
                    None => (S::Starting(loading), vec![]),
                }
            }
            (S::Ready(serving), E::Tick) => match serving.run.fatal_grace_over(self.policy.grace, now) {
                Some(c) => self.fail(S::Ready(serving), c, None, now),
                None => self.drain_tick(serving, now),
            },
            (S::Ready(serving), E::Quiet { .. }) => match serving.drain {
                Some(d @ Drain { stage: DrainStage::Quiesce { .. }, .. }) => {
                    let fx = vec![record(
                        Severity::Info,
                        Topic::Drain,
                        format!("no request in flight after {}", secs(now - d.began)),
                    )];
                    self.drained(serving, d, now, fx)
                }
                _ => (S::Ready(serving), vec![]),
            },
            (S::Ready(serving), E::DrainRequested) => match serving.drain {
                None => self.begin_drain(serving, DrainFor::Hold, now, vec![]),
                Some(_) => (S::Ready(serving), vec![]),
            },
            (S::Ready(mut serving), E::UndrainRequested) => match serving.drain {
                Some(d) if matches!(d.for_, DrainFor::Hold | DrainFor::Restart) => {
                    serving.drain = None;
                    let text = format!("ready again: pid {}, undrained", serving.run.pid);
                    let fx = vec![
                        Effect::UnwatchLoad,
                        record(Severity::Info, Topic::Drain, text.clone()),
                        Effect::Notify(vec![status(text)]),
                    ];
                    (S::Ready(serving), fx)
                }
                _ => (S::Ready(serving), vec![]),
            },
            (S::Ready(mut serving), E::RestartRequested) => {
                self.failures = 0;
                self.permanent_streak = None;
                match serving.drain {
                    None => self.begin_drain(serving, DrainFor::Restart, now, vec![]),
                    Some(mut d) if d.for_ == DrainFor::Hold => {
                        d.for_ = DrainFor::Restart;
                        if d.stage == DrainStage::Drained {
                            return self.drained(serving, d, now, vec![]);
                        }
                        serving.drain = Some(d);
                        (S::Ready(serving), vec![])
                    }
                    Some(_) => (S::Ready(serving), vec![]),
                }
            }
            (S::Starting(loading), E::RestartRequested) => {
                self.failures = 0;
                self.permanent_streak = None;
                let fx = vec![record(Severity::Info, Topic::Stop, "restart requested".into())];
                self.begin_stop(S::Starting(loading), Purpose::Restart, now, fx)
            }
            (S::Backoff { .. }, E::RestartRequested) => {
                self.failures = 0;
                self.permanent_streak = None;
                let (next, mut fx) = self.launch(now);
                fx.insert(0, record(Severity::Info, Topic::Stop, "restart requested".into()));
                (next, fx)
            }
            (S::Launching { start, then: AfterPrepare::Spawn { .. } }, E::RestartRequested) => {
                self.failures = 0;
                self.permanent_streak = None;
                let fx = vec![record(Severity::Info, Topic::Stop, "restart requested".into()), Effect::CancelPrepare];
                (S::Launching { start, then: AfterPrepare::Relaunch }, fx)
            }
            (S::Ready(mut serving), E::StopRequested) if serving.drain.is_some() || self.policy.drain_on_stop => {
                // The stop is answered at once; the drain delays only the
                // signal. Asked again, the child is stopped now.
                let mut fx = vec![
                    record(Severity::Info, Topic::Stop, "stop requested".into()),
                    Effect::Notify(vec![Note::Stopping, Note::ExtendTimeout(self.drain_budget())]),
                ];
                match serving.drain {
                    None => self.begin_drain(serving, DrainFor::Stop, now, fx),
                    Some(d) if d.for_ == DrainFor::Stop => {
                        fx.push(record(Severity::Info, Topic::Drain, "asked again: the drain is cut short".into()));
                        serving.drain = None;
                        self.begin_stop(S::Ready(serving), Purpose::Shutdown, now, fx)
                    }
                    Some(mut d) => {
                        d.for_ = DrainFor::Stop;
                        if d.stage == DrainStage::Drained {
                            return self.drained(serving, d, now, fx);
                        }
                        serving.drain = Some(d);
                        fx.push(Effect::Notify(vec![status(self.drain_text(&serving, &d))]));
                        (S::Ready(serving), fx)
                    }
                }
            }
            (state @ (S::Starting(_) | S::Ready(_)), E::GpuFault { cause, .. }) => {
                let cause =
                    Cause { text: cause, kind: FailureKind::FatalLine, permanence: Permanence::Hardware, hint: None };
                self.fail(state, cause, None, now)
            }
            (S::Ready(serving), E::HealthFailed { cause, .. }) => {
                let cause = Cause::new(cause, FailureKind::Health);
                self.fail(S::Ready(serving), cause, None, now)
            }
            (state @ (S::Starting(_) | S::Ready(_)), E::StopRequested) => {
                let fx = vec![record(Severity::Info, Topic::Stop, "stop requested".into())];
                self.begin_stop(state, Purpose::Shutdown, now, fx)
            }

            (state, E::ReportStarted { path, .. }) => {
                if let Some(f) = &mut self.last_failure {
                    f.report = Some(path);
                }
                (state, vec![])
            }
            (S::Reporting(r), E::Reported { .. }) => self.report_done(r, now, vec![]),
            // Nothing of the run is left to stop: what follows begins now,
            // beside the report.
            (S::Reporting(r), E::TreeGone) if !r.leader => {
                let mut fx = vec![];
                let purpose = self.purpose_of_stop(&r.run, r.purpose, &mut fx);
                let ready_for = into_run(&r.run).and_then(|(_, ready_at)| ready_at).map(|t| now - t);
                self.stopped(purpose, ready_for, now, fx)
            }
            (S::Reporting(r), E::Tick) if now >= r.until => {
                let text = format!(
                    "the failure report did not finish within {}; cut short",
                    secs(self.policy.report.unwrap_or_default())
                );
                let fx = vec![Effect::CancelReport, record(Severity::Warn, Topic::Failed, text)];
                self.report_done(r, now, fx)
            }
            (S::Reporting(mut r), E::StopRequested) => {
                r.purpose = Purpose::Shutdown;
                let text = "stop requested; the failure report is cut short".to_string();
                let fx = vec![Effect::CancelReport, record(Severity::Info, Topic::Stop, text)];
                self.report_done(r, now, fx)
            }
            (S::Reporting(mut r), E::ChildExited { exit, .. }) => {
                self.last_exit = Some(exit);
                self.exits += 1;
                r.leader = false;
                (S::Reporting(r), vec![])
            }
            // The run has failed already: what else it does waits for the stop.
            (S::Reporting(r), E::Line { .. } | E::HealthFailed { .. } | E::GpuFault { .. }) => {
                (S::Reporting(r), vec![])
            }

            (S::Stopping(mut stop), E::ChildExited { pid, exit }) => {
                self.last_exit = Some(exit);
                self.exits += 1;
                stop.leader = None;
                let mut fx = vec![record(Severity::Info, Topic::Exited, format!("child {pid} {exit}"))];
                if let Escalation::Signalled { kill_at, .. } = stop.escalation {
                    // Whatever the leader left behind is orphaned now: pass the
                    // stop on to it at once rather than waiting for the SIGKILL.
                    stop.escalation = Escalation::Signalled { kill_at, resend_at: None };
                    fx.push(Effect::Terminate(self.policy.stop_signal));
                }
                (S::Stopping(stop), fx)
            }
            (S::Stopping(mut stop), E::Tick) => {
                let mut fx = Vec::new();
                match stop.escalation {
                    Escalation::Signalled { kill_at, .. } if now >= kill_at => {
                        stop.escalation = Escalation::Killed { at: now };
                        let text = "stop timeout passed: SIGKILL to the whole tree".to_string();
                        fx.push(record(Severity::Warn, Topic::Kill, text));
                        fx.push(Effect::KillTree);
                    }
                    Escalation::Signalled { kill_at, resend_at: Some(t) } if now >= t => {
                        stop.escalation = Escalation::Signalled { kill_at, resend_at: Some(t + LOAD_STOP_RESEND) };
                        fx.push(Effect::Terminate(self.policy.stop_signal));
                    }
                    Escalation::Killed { at } if now >= at + KILL_GRACE => {
                        stop.escalation = Escalation::Abandoning { until: now + DESCRIBE_GRACE };
                        fx.push(Effect::DescribeSurvivors);
                    }
                    Escalation::Abandoning { until } if now >= until => {
                        let text = "processes of the tree survived SIGKILL and their /proc entries do not answer; \
                                    they are stuck in the kernel: needs a GPU reset or a reboot";
                        return self.finish(Code::Unkillable, text.into(), fx);
                    }
                    _ => {}
                }
                (S::Stopping(stop), fx)
            }
            (
                S::Stopping(stop @ Stop { escalation: Escalation::Abandoning { .. }, .. }),
                E::Survivors { left: 0, .. },
            ) => {
                // Every process is dead, but the end of the tree was not
                // reported: its last exits are still being reaped.
                let text = "no live process of the tree is left after SIGKILL, though not every exit was seen yet: \
                            the tree is taken as gone";
                let (state, mut fx) = self.stopped(stop.purpose, stop.ready_for, now, vec![]);
                fx.insert(0, record(Severity::Warn, Topic::Kill, text.into()));
                (state, fx)
            }
            (S::Stopping(Stop { escalation: Escalation::Abandoning { .. }, .. }), E::Survivors { description, .. }) => {
                self.finish(Code::Unkillable, description, vec![])
            }
            (S::Stopping(mut stop), E::StopRequested) => match (&stop.purpose, stop.escalation) {
                (Purpose::Shutdown | Purpose::Internal(_), Escalation::Signalled { .. }) => {
                    // Asked twice: no more patience.
                    stop.escalation = Escalation::Killed { at: now };
                    (S::Stopping(stop), vec![Effect::KillTree])
                }
                (Purpose::Shutdown | Purpose::Internal(_), _) => (S::Stopping(stop), vec![]),
                (Purpose::Failure(_) | Purpose::Reload | Purpose::Restart, _) => {
                    stop.purpose = Purpose::Shutdown;
                    (S::Stopping(stop), vec![Effect::Notify(vec![Note::Stopping, status("stopping".into())])])
                }
            },
            (S::Stopping(stop), E::TreeGone) => self.stopped(stop.purpose, stop.ready_for, now, vec![]),
            // Lines after a stop was asked for never count (vLLM logs
            // EngineDeadError on every ordinary shutdown).
            (S::Stopping(stop), E::Line { .. }) => (S::Stopping(stop), vec![]),

            (S::Backoff { until, .. }, E::Tick) if now >= until => self.launch(now),
            (S::Backoff { .. }, E::StopRequested) => {
                self.finish(Code::Ok, "stopped on request".into(), vec![Effect::Notify(vec![Note::Stopping])])
            }
            (S::Idle, E::StopRequested) => self.finish(Code::Ok, "stopped on request".into(), vec![]),

            (state, E::TaskFailed { task }) => self.task_failed(state, task, now),
            (state, E::Reload { policy, summary }) => self.reload(state, *policy, summary, now),
            (state @ S::Done(_), E::ReloadInPlace { .. }) => (state, vec![]),
            (state, E::ReloadInPlace { policy, summary }) => {
                self.policy = *policy;
                let fx =
                    vec![record(Severity::Info, Topic::Reload, summary.clone()), Effect::Notify(vec![status(summary)])];
                (state, fx)
            }

            (state, E::Tick) => (state, vec![]),
            (state, event) => {
                tracing::debug!(?event, phase = %phase_of(&state), "event ignored");
                (state, vec![])
            }
        }
    }

    fn launch(&mut self, now: Instant) -> (State, Vec<Effect>) {
        self.starts += 1;
        if self.starts > 1 {
            self.restarts += 1;
        }
        let start = self.starts;
        let fx = vec![
            Effect::Notify(vec![status(format!("starting ({})", self.attempts_text()))]),
            Effect::Prepare { start },
        ];
        let deadline = now + self.policy.prepare_timeout;
        (State::Launching { start, then: AfterPrepare::Spawn { deadline, step: None } }, fx)
    }

    /// Give up the pre-start steps of `start`; `then` happens when they
    /// report back.
    fn cancel_launch(&mut self, start: u32, then: Purpose, mut fx: Vec<Effect>) -> (State, Vec<Effect>) {
        fx.push(Effect::CancelPrepare);
        (State::Launching { start, then: AfterPrepare::Stop(then) }, fx)
    }

    fn start_failed(&mut self, failure: StartFailure, now: Instant) -> (State, Vec<Effect>) {
        let permanence = if failure.permanent { Permanence::Unrunnable } else { Permanence::Transient };
        let mut cause = Cause { text: failure.cause, kind: FailureKind::Spawn, permanence, hint: None };
        cause.hint = self.policy.hints.find(&cause.text);
        self.last_failure = Some(crate::supervisor::snapshot::LastFailure {
            cause: cause.text.clone(),
            class: cause.class(),
            report: None,
        });
        let fx = vec![record(Severity::Error, Topic::Failed, format!("start failed: {}", cause.shown()))];
        self.after_failure(cause, None, now, fx)
    }

    /// Record a fatal line or exception line of this run.
    fn note_fatal(&mut self, run: &mut Run, line: &Line, now: Instant) -> Vec<Effect> {
        let mut fx = Vec::new();
        let permanence = Permanence::of_match(line.permanent);
        if let Some(exc) = &line.exception {
            match &mut run.exception {
                None => run.exception = Some((exc.clone(), permanence)),
                Some((first, p)) if first.group == exc.group => {
                    *first = exc.clone();
                    *p = permanence;
                }
                Some(_) => {}
            }
        }
        if line.class == Class::Fatal {
            let message = line.cause.as_deref().unwrap_or(line.message.trim());
            // Keep the first line, but remember a permanent one that follows.
            let replace = match &run.first_fatal {
                None => true,
                Some((_, p)) => !p.is_permanent() && permanence.is_permanent(),
            };
            if replace {
                run.first_fatal = Some((message.to_string(), permanence));
            }
            if run.fatal_at.is_none() {
                run.fatal_at = Some(now);
                fx.push(record(Severity::Error, Topic::Fatal, format!("fatal line: {message}")));
                fx.push(Effect::Notify(vec![status(format!(
                    "failing: {message}; waiting up to {} for the child to exit",
                    secs(self.policy.grace)
                ))]));
            }
        }
        fx
    }

    fn starting_line(&mut self, mut loading: Loading, line: Line, now: Instant) -> (State, Vec<Effect>) {
        let mut fx = self.note_fatal(&mut loading.run, &line, now);
        if loading.run.fatal_at.is_some() {
            return (State::Starting(loading), fx);
        }
        match &line.class {
            Class::Ready if !loading.awaiting_http => {
                if !self.policy.ready_http {
                    return self.become_ready(loading, now);
                }
                loading.awaiting_http = true;
                fx.push(record(Severity::Info, Topic::ReadyLine, "ready line seen; checking HTTP".into()));
                fx.push(Effect::Probe { start: loading.run.start });
            }
            Class::Progress(text) => {
                loading.progress_at = now;
                loading.run.first_progress.get_or_insert(now);
                loading.progress = Some(text.clone());
                fx.push(Effect::Notify(vec![
                    status(format!("loading, pid {}: {text}", loading.run.pid)),
                    Note::ExtendTimeout(self.policy.stall),
                ]));
            }
            _ => {}
        }
        (State::Starting(loading), fx)
    }

    fn become_ready(&mut self, loading: Loading, now: Instant) -> (State, Vec<Effect>) {
        let run = loading.run;
        let took = now - run.spawned_at;
        self.last_load = Some(took);
        self.cause = None;
        let text = format!("ready: pid {}, loaded in {}", run.pid, secs(took));
        let fx = vec![
            record(Severity::Info, Topic::Ready, text.clone()),
            Effect::Notify(vec![Note::Ready, status(text)]),
            Effect::Health { start: run.start },
        ];
        (State::Ready(Serving { run, ready_at: now, drain: None }), fx)
    }

    /// Stop a running child (`Starting` or `Ready`) for `purpose`; any other
    /// state is returned as it is.
    fn begin_stop(&mut self, state: State, purpose: Purpose, now: Instant, fx: Vec<Effect>) -> (State, Vec<Effect>) {
        self.begin_stop_as(state, purpose, now, fx, true)
    }

    /// A run has failed: write its report first, when reports are on, then
    /// stop it. `exit`: the leader has exited so.
    fn fail(&mut self, state: State, mut cause: Cause, exit: Option<Exit>, now: Instant) -> (State, Vec<Effect>) {
        let Some(budget) = self.policy.report else {
            return self.begin_stop(state, Purpose::Failure(cause), now, vec![]);
        };
        let Some((run, ready_at)) = into_run(&state) else { return (state, vec![]) };
        let since = |t: Instant| t.saturating_duration_since(run.spawned_at);
        cause.hint = self.policy.hints.find(&cause.text);
        let order = ReportOrder {
            start: run.start,
            attempt: self.attempt(),
            cause: cause.text.clone(),
            class: cause.class(),
            hint: cause.hint.clone(),
            first_progress: run.first_progress.map(since),
            ready: ready_at.map(since),
            failed: since(now),
            exit,
        };
        let mut fx = vec![Effect::Report(order)];
        self.announce(&cause, ", writing the failure report", &mut fx);
        let reporting = Reporting {
            run: Box::new(state),
            purpose: Purpose::Failure(cause),
            until: now + budget,
            leader: exit.is_none(),
        };
        (State::Reporting(reporting), fx)
    }

    /// The failure's journal event and status line; it is the last failure.
    fn announce(&mut self, c: &Cause, then: &str, fx: &mut Vec<Effect>) {
        self.cause = Some(c.clone());
        self.last_failure =
            Some(crate::supervisor::snapshot::LastFailure { cause: c.text.clone(), class: c.class(), report: None });
        fx.push(record(Severity::Error, Topic::Failed, format!("run failed: {}", c.shown())));
        fx.push(Effect::Notify(vec![status(format!("failed ({}{then}): {}", self.attempts_text(), c.shown()))]));
    }

    /// The report is over (written, cut short, or out of time): stop the
    /// run for what is now the purpose.
    fn report_done(&mut self, r: Reporting, now: Instant, fx: Vec<Effect>) -> (State, Vec<Effect>) {
        let (next, fx) = self.begin_stop_as(*r.run, r.purpose, now, fx, false);
        if r.leader { (next, fx) } else { (leader_gone(next), fx) }
    }

    /// `announce`: a failure is said here (not when its report said it).
    fn begin_stop_as(
        &mut self,
        state: State,
        purpose: Purpose,
        now: Instant,
        mut fx: Vec<Effect>,
        announce: bool,
    ) -> (State, Vec<Effect>) {
        let Some((run, ready_at)) = into_run(&state) else { return (state, fx) };
        let pid = run.pid;
        let ready_for = ready_at.map(|t| now - t);
        let mut purpose = self.purpose_of_stop(&state, purpose, &mut fx);
        // Only a serving child being stopped on purpose has something to
        // drain; everything else gets the short grace, the signal repeated.
        let drain = ready_for.is_some() && matches!(purpose, Purpose::Shutdown | Purpose::Reload | Purpose::Restart);
        let grace = if drain { self.policy.stop_timeout } else { self.policy.stop_timeout.min(LOAD_STOP_GRACE) };
        match &mut purpose {
            Purpose::Shutdown => fx.push(Effect::Notify(vec![
                Note::Stopping,
                status(format!("stopping pid {pid}")),
                Note::ExtendTimeout(grace + Duration::from_secs(5)),
            ])),
            Purpose::Failure(c) if announce => {
                c.hint = self.policy.hints.find(&c.text);
                let c = c.clone();
                self.announce(&c, "", &mut fx);
            }
            Purpose::Failure(c) => {
                c.hint = self.policy.hints.find(&c.text);
                fx.push(Effect::Notify(vec![status(format!(
                    "failed ({}, stopping pid {pid}): {}",
                    self.attempts_text(),
                    c.shown()
                ))]))
            }
            Purpose::Reload => fx.push(Effect::Notify(vec![
                status(format!("reloading: stopping pid {pid} to start it with the new config")),
                Note::ExtendTimeout(grace + Duration::from_secs(5)),
            ])),
            Purpose::Restart => fx.push(Effect::Notify(vec![
                status(format!("restarting: stopping pid {pid}")),
                Note::ExtendTimeout(grace + Duration::from_secs(5)),
            ])),
            Purpose::Internal(why) => fx.push(Effect::Notify(vec![
                Note::Stopping,
                status(format!("internal failure, stopping pid {pid}: {why}")),
            ])),
        }
        fx.push(Effect::Terminate(self.policy.stop_signal));
        let escalation = if grace.is_zero() {
            fx.push(Effect::KillTree);
            Escalation::Killed { at: now }
        } else {
            Escalation::Signalled { kill_at: now + grace, resend_at: (!drain).then_some(now + LOAD_STOP_RESEND) }
        };
        (State::Stopping(Stop { purpose, leader: Some(pid), ready_for, escalation }), fx)
    }

    /// What stopping the run in `state` for `purpose` is for: a stop was
    /// asked for and answered, so a failure during its drain ends in the
    /// stop, not in a restart.
    fn purpose_of_stop(&mut self, state: &State, purpose: Purpose, fx: &mut Vec<Effect>) -> Purpose {
        match (state, purpose) {
            (State::Ready(Serving { drain: Some(Drain { for_: DrainFor::Stop, .. }), .. }), Purpose::Failure(c)) => {
                fx.push(record(Severity::Warn, Topic::Drain, format!("failed while draining to stop: {}", c.text)));
                self.cause = Some(c);
                Purpose::Shutdown
            }
            (_, purpose) => purpose,
        }
    }

    /// How long a stop that drains first may take, for systemd's stop
    /// timeout: the drain, the stop, and a margin.
    fn drain_budget(&self) -> Duration {
        let p = &self.policy;
        [p.drain_delay, p.drain_timeout, p.stop_timeout, Duration::from_secs(5)]
            .into_iter()
            .fold(Duration::ZERO, Duration::saturating_add)
    }

    /// `STATUS=` while draining.
    fn drain_text(&self, serving: &Serving, d: &Drain) -> String {
        let then = match d.for_ {
            DrainFor::Hold => "",
            DrainFor::Restart => ", then restarting",
            DrainFor::Reload => ", then restarting with the new config",
            DrainFor::Stop => ", then stopping",
        };
        let pid = serving.run.pid;
        match d.stage {
            DrainStage::Delay { .. } => {
                format!("draining pid {pid}: unready, {} for the balancer{then}", secs(self.policy.drain_delay))
            }
            DrainStage::Quiesce { .. } => format!(
                "draining pid {pid}: waiting up to {} for the requests in flight{then}",
                secs(self.policy.drain_timeout)
            ),
            DrainStage::Drained => format!("drained: pid {pid}, out of rotation"),
        }
    }

    /// Take a serving child out of rotation: unready now, the requests in
    /// flight waited for after the delay, then `for_`.
    fn begin_drain(
        &mut self,
        mut serving: Serving,
        for_: DrainFor,
        now: Instant,
        mut fx: Vec<Effect>,
    ) -> (State, Vec<Effect>) {
        let d = Drain { for_, stage: DrainStage::Delay { until: now + self.policy.drain_delay }, began: now };
        let text = self.drain_text(&serving, &d);
        fx.push(record(Severity::Info, Topic::Drain, text.clone()));
        fx.push(Effect::Notify(vec![status(text)]));
        serving.drain = Some(d);
        (State::Ready(serving), fx)
    }

    /// A drain's deadlines: the delay over (look at the requests in flight),
    /// the timeout over (go on with requests still running).
    fn drain_tick(&mut self, mut serving: Serving, now: Instant) -> (State, Vec<Effect>) {
        let Some(mut d) = serving.drain else { return (State::Ready(serving), vec![]) };
        match d.stage {
            DrainStage::Delay { until } if now >= until => {
                d.stage = DrainStage::Quiesce { deadline: now + self.policy.drain_timeout };
                serving.drain = Some(d);
                let fx = vec![
                    Effect::WatchLoad { start: serving.run.start },
                    Effect::Notify(vec![status(self.drain_text(&serving, &d))]),
                ];
                (State::Ready(serving), fx)
            }
            DrainStage::Quiesce { deadline } if now >= deadline => {
                let text = format!(
                    "requests still in flight after {} (drain.timeout): going on",
                    secs(self.policy.drain_timeout)
                );
                let fx = vec![record(Severity::Warn, Topic::Drain, text)];
                self.drained(serving, d, now, fx)
            }
            _ => (State::Ready(serving), vec![]),
        }
    }

    /// The drain is over: what it was for.
    fn drained(&mut self, mut serving: Serving, d: Drain, now: Instant, mut fx: Vec<Effect>) -> (State, Vec<Effect>) {
        match d.for_ {
            DrainFor::Hold => {
                let d = Drain { stage: DrainStage::Drained, ..d };
                serving.drain = Some(d);
                let text = self.drain_text(&serving, &d);
                fx.push(Effect::UnwatchLoad);
                fx.push(record(Severity::Info, Topic::Drain, text.clone()));
                fx.push(Effect::Notify(vec![status(text)]));
                (State::Ready(serving), fx)
            }
            DrainFor::Restart => {
                fx.push(record(Severity::Info, Topic::Stop, "drained: restarting".into()));
                self.begin_stop(State::Ready(serving), Purpose::Restart, now, fx)
            }
            DrainFor::Reload => self.begin_stop(State::Ready(serving), Purpose::Reload, now, fx),
            DrainFor::Stop => self.begin_stop(State::Ready(serving), Purpose::Shutdown, now, fx),
        }
    }

    /// A valid new config: its policy applies from now on, the failure count
    /// starts again, and the child is started again with it.
    fn reload(&mut self, state: State, policy: Policy, summary: String, now: Instant) -> (State, Vec<Effect>) {
        if matches!(state, State::Done(_)) {
            return (state, vec![]);
        }
        self.policy = policy;
        self.failures = 0;
        self.permanent_streak = None;
        let fx = vec![record(Severity::Info, Topic::Reload, format!("config reloaded: {summary}"))];
        match state {
            State::Ready(mut serving) if serving.drain.is_some() || self.policy.drain_on_stop => match serving.drain {
                None => self.begin_drain(serving, DrainFor::Reload, now, fx),
                Some(mut d) if d.for_ != DrainFor::Stop => {
                    d.for_ = DrainFor::Reload;
                    if d.stage == DrainStage::Drained {
                        return self.drained(serving, d, now, fx);
                    }
                    serving.drain = Some(d);
                    (State::Ready(serving), fx)
                }
                // A stop is under way: the new config is not started.
                Some(_) => (State::Ready(serving), fx),
            },
            s @ (State::Starting(_) | State::Ready(_)) => self.begin_stop(s, Purpose::Reload, now, fx),
            State::Stopping(mut stop) if matches!(stop.purpose, Purpose::Failure(_)) => {
                stop.purpose = Purpose::Reload;
                (State::Stopping(stop), fx)
            }
            State::Reporting(mut r) if matches!(r.purpose, Purpose::Failure(_)) => {
                r.purpose = Purpose::Reload;
                (State::Reporting(r), fx)
            }
            State::Backoff { .. } => {
                let (next, more) = self.launch(now);
                (next, fx.into_iter().chain(more).collect())
            }
            State::Launching { start, then: AfterPrepare::Spawn { .. } } => {
                let mut fx = fx;
                fx.push(Effect::CancelPrepare);
                (State::Launching { start, then: AfterPrepare::Relaunch }, fx)
            }
            // A stop is under way, or the start is already being redone.
            other => (other, vec![]),
        }
    }

    /// A part of the warden died: stop the tree the short way and exit 70.
    fn task_failed(&mut self, state: State, why: String, now: Instant) -> (State, Vec<Effect>) {
        let fx = vec![record(Severity::Error, Topic::Internal, why.clone())];
        match state {
            s @ (State::Starting(_) | State::Ready(_)) => self.begin_stop(s, Purpose::Internal(why), now, fx),
            State::Stopping(mut stop) => {
                stop.purpose = Purpose::Internal(why);
                (State::Stopping(stop), fx)
            }
            State::Reporting(mut r) => {
                r.purpose = Purpose::Internal(why);
                let mut fx = fx;
                fx.push(Effect::CancelReport);
                self.report_done(r, now, fx)
            }
            State::Launching { start, .. } => self.cancel_launch(start, Purpose::Internal(why), fx),
            State::Idle | State::Backoff { .. } => self.finish(Code::Internal, format!("internal failure: {why}"), fx),
            done @ State::Done(_) => (done, vec![]),
        }
    }

    /// The tree is gone (or was never spawned): carry out what the stop was for.
    fn stopped(
        &mut self,
        purpose: Purpose,
        ready_for: Option<Duration>,
        now: Instant,
        fx: Vec<Effect>,
    ) -> (State, Vec<Effect>) {
        match purpose {
            Purpose::Shutdown => self.finish(Code::Ok, "stopped on request".into(), fx),
            Purpose::Failure(cause) => self.after_failure(cause, ready_for, now, fx),
            Purpose::Reload | Purpose::Restart => self.launch(now),
            Purpose::Internal(why) => self.finish(Code::Internal, format!("internal failure: {why}"), fx),
        }
    }

    fn after_failure(
        &mut self,
        cause: Cause,
        ready_for: Option<Duration>,
        now: Instant,
        mut fx: Vec<Effect>,
    ) -> (State, Vec<Effect>) {
        if ready_for.is_some_and(|d| d >= self.policy.restart.reset_after) {
            self.failures = 0;
            self.permanent_streak = None;
        }
        self.failures = self.failures.saturating_add(1);
        self.cause = Some(cause.clone());
        *self.failure_counts.entry(cause.class()).or_default() += 1;
        if cause.permanence == Permanence::Hardware {
            return self.finish(Code::Config, format!("failed permanently: {}", cause.text), fx);
        }
        if cause.permanence.is_permanent() {
            let n = match self.permanent_streak {
                Some((p, n)) if p == cause.permanence => n + 1,
                _ => 1,
            };
            self.permanent_streak = Some((cause.permanence, n));
            if n >= self.policy.restart.permanent_attempts {
                let text = format!("failed permanently ({n} of {n} tries): {}", cause.text);
                return self.finish(Code::Config, text, fx);
            }
        } else {
            self.permanent_streak = None;
        }
        let max = self.policy.restart.max_attempts;
        if max > 0 && self.failures >= max {
            let text = format!("gave up after {max} failed starts: {}", cause.text);
            return self.finish(Code::GaveUp, text, fx);
        }
        let base = self.policy.backoff(self.failures);
        let j = self.policy.restart.jitter * (self.rng.f64() * 2.0 - 1.0);
        let delay = Duration::from_secs_f64((base.as_secs_f64() * (1.0 + j)).max(0.0));
        let text = format!("restarting in {} ({}): {}", secs(delay), self.attempts_text(), cause.text);
        fx.push(record(Severity::Warn, Topic::Backoff, text.clone()));
        fx.push(Effect::Notify(vec![status(text), Note::ExtendTimeout(delay + self.policy.stall)]));
        if delay.is_zero() {
            let (state, more) = self.launch(now);
            fx.extend(more);
            return (state, fx);
        }
        (State::Backoff { until: now + delay, cause }, fx)
    }

    /// The one way the machine ends: `code`, and why in `text`.
    fn finish(&mut self, code: Code, text: String, mut fx: Vec<Effect>) -> (State, Vec<Effect>) {
        let (severity, topic) = match code {
            Code::Ok => (Severity::Info, Topic::Stopped),
            Code::Internal => (Severity::Error, Topic::Internal),
            Code::Unkillable => (Severity::Error, Topic::Unkillable),
            _ => (Severity::Error, Topic::GaveUp),
        };
        fx.push(record(severity, topic, text.clone()));
        fx.push(Effect::Notify(vec![status(text.clone())]));
        let permanence = self.cause.as_ref().map_or(Permanence::Transient, |c| c.permanence);
        let hint = self.cause.as_ref().and_then(|c| c.hint.clone());
        self.cause = Some(Cause { text, kind: FailureKind::Exit, permanence, hint });
        (State::Done(code), fx)
    }
}

/// The run of a `Starting` or `Ready` state, and when it became ready.
fn into_run(state: &State) -> Option<(&Run, Option<Instant>)> {
    match state {
        State::Starting(l) => Some((&l.run, None)),
        State::Ready(s) => Some((&s.run, Some(s.ready_at))),
        _ => None,
    }
}

/// The leader has already exited: no signal to repeat.
fn leader_gone(state: State) -> State {
    match state {
        State::Stopping(mut s) => {
            s.leader = None;
            if let Escalation::Signalled { kill_at, .. } = s.escalation {
                s.escalation = Escalation::Signalled { kill_at, resend_at: None };
            }
            State::Stopping(s)
        }
        other => other,
    }
}

fn phase_of(state: &State) -> Phase {
    match state {
        State::Idle | State::Launching { .. } | State::Starting(_) => Phase::Starting,
        State::Ready(Serving { drain: None, .. }) => Phase::Ready,
        State::Ready(Serving { drain: Some(Drain { stage: DrainStage::Drained, .. }), .. }) => Phase::Drained,
        State::Ready(Serving { drain: Some(_), .. }) => Phase::Draining,
        State::Stopping(st) => match st.purpose {
            Purpose::Failure(_) => Phase::Failed,
            Purpose::Shutdown | Purpose::Reload | Purpose::Restart | Purpose::Internal(_) => Phase::Stopping,
        },
        State::Reporting(_) => Phase::Failed,
        State::Backoff { .. } => Phase::Backoff,
        // Left saying why in `cause`: a stop request, or the give-up.
        State::Done(_) => Phase::Stopped,
    }
}

#[cfg(test)]
mod tests;
