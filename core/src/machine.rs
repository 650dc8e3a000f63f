//! The supervisor as a pure state machine: `step(event, now) -> effects`.
//! It decides when the child is ready, when a start or a ready child has
//! failed and why, how long to back off, when to give up, and what to tell
//! systemd. It performs no I/O: the driver (`daemon::driver`) carries out the
//! effects and feeds back what happened. sd_notify's wire format, regexes
//! and processes are not known here.
//!
//! Each state carries exactly the data that is valid in it, and has a
//! function of its own that names every event (`in_idle`, `in_launching`,
//! `in_starting` here; `machine/ready.rs`, `machine/stop.rs`,
//! `machine/idle.rs` for the others). Events that belong to an earlier
//! start (a line, a probe answer, a reaped pid of a run that is over) are
//! dropped once, before them. An upgrade in place goes on beside the
//! states (`machine/upgrade.rs`).
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
//!   A give-up with `[rollback]` on and a changed setup that failed:
//!   RollingBack ─RolledBack(ok)─▶ Launching (the last-known-good setup),
//!   ─RolledBack(err)─▶ Done(75 | 78)
//!   A ready run taken over from a predecessor: Adopted ─Begin─▶ Ready
//!   StopRequested: Starting/Ready → Stopping(shutdown) → Done(0); Launching → Done(0)
//!                  once its steps are cancelled; Backoff, RollingBack → Done(0)
//!   TaskFailed (a part of the warden died): the tree is stopped, then Done(70)
//!   Recheck (any trigger: a GPU fault that left the engine running, an
//!   upgrade, `golden.interval`, a wake): Ready out of rotation (phase
//!   `rechecking`; `serving()` false), the golden answers asked again; the
//!   same → back in rotation, else a failed run (see `machine/recheck.rs`)
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
//!
//!   An idle engine (`front.idle-stop`, `machine/idle.rs`): Ready → Stopping
//!   → Parked → (a request) Launching; or Ready → Asleep → (a request) wake,
//!   golden check → Ready.
//! ```

mod idle;
mod ready;
mod recheck;
mod state;
mod stop;
mod upgrade;

use std::collections::BTreeMap;
use std::time::Duration;

use crate::Instant;

use crate::classify::{Class, Line};
use crate::exit::Code;
use crate::load::{LoadOutcome, LoadPhase, LoadRecord, LoadTrack};
use crate::outcome::Exit;
use crate::outcome::{FailureClass, Permanence, Phase, Prepared, RestartReason, StartFailure};

pub use self::state::*;
use self::stop::{into_run, leader_gone, phase_of};
use crate::events::*;
use crate::policy::*;

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
    restarts_by: BTreeMap<RestartReason, u32>,
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
    last_failure: Option<crate::snapshot::LastFailure>,
    /// The last load that ended, and how many have.
    last_load_record: Option<std::sync::Arc<LoadRecord>>,
    loads_ended: u32,
    /// The last golden check's verdict, and how many checks there were.
    last_golden: Option<crate::golden::Verdict>,
    golden_checks: u32,
    /// Re-checks of a serving model's answers (see `machine/recheck.rs`).
    rechecks: recheck::Rechecks,
    /// Memory fit.
    fit: crate::fit::FitState,
    /// Last-known-good rollback.
    rollback: Rollback,
    /// Engines stopped, and put to sleep, for want of requests.
    idle_stops: u32,
    sleeps: u32,
    /// The ledger's estimate of a load of the current setup (its median).
    estimate: Option<Duration>,
    /// How long the last wake from sleep took, to the golden answers.
    last_wake: Option<Duration>,
    /// An upgrade in place asked for and checked, until it is handed over
    /// or given up (see `machine/upgrade.rs`).
    upgrade: Option<upgrade::Handover>,
}

/// What the machine knows of setups: the current one and the last that
/// was good, the rollback serving.
#[derive(Debug, Default)]
struct Rollback {
    /// The current setup's fingerprint (from the last `LoadKnown`).
    setup: Option<String>,
    /// The last-known-good setup when the current one is another: its
    /// fingerprint and when it was recorded.
    last_good: Option<(String, String)>,
    /// The rollback in force: the failed setup's fingerprint and cause,
    /// and the good one's fingerprint and time.
    active: Option<crate::snapshot::RolledBack>,
}

/// Beyond `golden.timeout`, before the stall deadline of a golden check
/// (the check ends by its own timeout first).
const GOLDEN_MARGIN: Duration = Duration::from_secs(5);

fn secs(d: Duration) -> String {
    humantime::format_duration(Duration::from_secs(d.as_secs_f64().round() as u64)).to_string()
}

fn record(severity: Severity, topic: Topic, message: String) -> Effect {
    Effect::Log(Record { severity, topic, message, about: None })
}

/// A record about the run `about` (see [`Record::about`]).
fn record_of(severity: Severity, topic: Topic, message: String, about: RunOf) -> Effect {
    Effect::Log(Record { severity, topic, message, about: Some(about) })
}

fn status(text: String) -> Note {
    Note::Status(text)
}

/// An event `state` has nothing to do with: said in the debug log (a
/// tick, the most common, is not), and nothing changes.
fn ignored(state: State, event: Event) -> (State, Vec<Effect>) {
    if event != Event::Tick {
        tracing::debug!(?event, phase = %phase_of(&state), "event ignored");
    }
    (state, vec![])
}

/// The cause of a run ended by a fatal GPU fault: the hardware's, not a
/// retry's to fix.
fn gpu_fault(text: String) -> Cause {
    Cause { text, kind: FailureKind::FatalLine, permanence: Permanence::Hardware, hint: None }
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
            restarts_by: BTreeMap::new(),
            permanent_streak: None,
            last_exit: None,
            exits: 0,
            cause: None,
            last_load: None,
            failure_counts: BTreeMap::new(),
            last_failure: None,
            last_load_record: None,
            loads_ended: 0,
            last_golden: None,
            golden_checks: 0,
            rechecks: Default::default(),
            fit: Default::default(),
            rollback: Rollback::default(),
            idle_stops: 0,
            sleeps: 0,
            estimate: None,
            last_wake: None,
            upgrade: None,
        }
    }

    #[cfg(test)]
    pub(crate) fn policy(&self) -> &Policy {
        &self.policy
    }

    /// The ready run and the counts, for a successor that takes over (an
    /// upgrade in place); `None` unless ready with no fatal line waiting
    /// for its grace and no drain under way (a drain held is handed over;
    /// one that ends in a restart, a reload or a stop is waited for).
    #[cfg(test)]
    pub(crate) fn save(&self, now: Instant) -> Option<Saved> {
        self.save_of(&self.state, now)
    }

    /// A drain that has not yet ended in what it is for (held drained, a
    /// restart, a reload, a stop): an upgrade waits for it.
    #[cfg(test)]
    pub(crate) fn drain_under_way(&self) -> bool {
        upgrade::drain_under_way(&self.state)
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
            oom: None,
        };
        let drain =
            saved.drained.then_some(ActiveDrain { for_: DrainFor::Hold, stage: DrainStage::Drained, began: now });
        let serving = Serving { run, ready_at: back(saved.ready_for), drain, recheck: None };
        m.state = State::Adopted { serving, from: from.to_string() };
        m.starts = saved.starts;
        m.failures = saved.failures;
        m.restarts = saved.restarts;
        m.restarts_by = saved.restarts_by.clone();
        m.exits = saved.exits;
        m.last_load = saved.last_load;
        m.failure_counts = saved.failure_counts.clone();
        m.last_failure = saved.last_failure.clone();
        m.last_load_record = saved.last_load_record.clone().map(std::sync::Arc::new);
        m.last_golden = saved.golden.clone();
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
    #[cfg(test)]
    pub(crate) fn failures(&self) -> u32 {
        self.failures
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

    /// Why the serving model's answers are being checked again, while they
    /// are (it is out of rotation meanwhile).
    pub fn recheck_reason(&self) -> Option<&str> {
        match &self.state {
            State::Ready(Serving { recheck: Some(r), .. }) => Some(&r.reason),
            _ => None,
        }
    }

    /// Whether requests may go to the model now: ready, in rotation, its
    /// answers not being proven again (see [`Phase::serving`]). A front
    /// door holds requests while this is false.
    #[cfg(test)]
    pub(crate) fn serving(&self) -> bool {
        self.phase().serving()
    }

    /// A ready run has logged a fatal line and is waiting out its grace to
    /// exit: still "ready", but what is sent to it now fails (vLLM answers
    /// 500 once its engine died), so the front door holds instead.
    pub fn failing(&self) -> bool {
        matches!(&self.state, State::Ready(s) if s.run.fatal_at.is_some())
    }

    /// The current run's latest progress line, while starting.
    pub fn progress(&self) -> Option<&str> {
        match &self.state {
            State::Starting(l) => l.progress.as_deref(),
            _ => None,
        }
    }

    /// What the status document and the metrics show.
    pub fn snapshot(&self) -> crate::snapshot::Snapshot {
        crate::snapshot::Snapshot {
            phase: self.phase(),
            ready_at: match &self.state {
                State::Ready(s) | State::Adopted { serving: s, .. } => Some(s.ready_at),
                _ => None,
            },
            child_pid: self.child_pid(),
            attempt: self.attempt(),
            restarts: self.restarts,
            restarts_by: self.restarts_by.clone(),
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
            load: self.load_now(),
            last_load_record: self.last_load_record.clone(),
            loads_ended: self.loads_ended,
            golden: self.last_golden.clone(),
            golden_checks: self.golden_checks,
            rechecks: self.rechecks.count,
            recheck_paused: self.rechecks.paused,
            rechecking: self.recheck_reason().map(String::from),
            fit: self.fit.used.clone(),
            fit_moves: self.fit.moves,
            setup: self.rollback.setup.clone(),
            rolled_back: self.rollback.active.clone(),
            idle_stops: self.idle_stops,
            sleeps: self.sleeps,
            idle_eta: self.idle_eta(),
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
            State::Ready(s) | State::Adopted { serving: s, .. } => Some(s.run.pid),
            State::Stopping(s) => s.leader,
            State::Reporting(r) => Some(r.run.run().pid).filter(|_| r.leader),
            State::Asleep(d) => Some(d.serving.run.pid),
            _ => None,
        }
    }

    /// When the machine wants a `Tick`.
    pub fn next_deadline(&self) -> Option<Instant> {
        let p = &self.policy;
        match &self.state {
            State::Starting(l) => [
                Some(l.run.spawned_at + self.timeout_now(l)),
                Some(l.progress_at + self.stall_of(l)),
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
                [s.run.fatal_at.map(|t| t + p.grace), drain, self.recheck_deadline(s)].into_iter().flatten().min()
            }
            State::Stopping(s) => Some(match s.escalation {
                Escalation::Signalled { kill_at, resend_at } => resend_at.map_or(kill_at, |r| r.min(kill_at)),
                Escalation::Killed { at } => at + KILL_GRACE,
                Escalation::Abandoning { until } => until,
            }),
            State::Backoff { until, .. } => Some(*until),
            State::Reporting(r) => Some(r.until),
            State::Launching { then: AfterPrepare::Spawn { deadline, .. }, .. } => Some(*deadline),
            State::Asleep(d) => d.serving.run.fatal_at.map(|t| t + p.grace),
            // `RolledBack` follows `Effect::Rollback` at once; `Begin` is
            // the first event of all.
            State::Idle
            | State::RollingBack { .. }
            | State::Adopted { .. }
            | State::Launching { .. }
            | State::Done(_)
            | State::Parked(_) => None,
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
        if let Event::LoadKnown { load, .. } = &event {
            // The setup of the start about to spawn: what follows its
            // load (a pin, a rollback, an idle engine's estimate) is of it.
            self.fit.used = load.used.clone();
            self.rollback.setup = Some(load.fingerprint.clone());
            self.rollback.last_good = load.last_good.clone();
            self.estimate = load.history.as_ref().map(|h| h.median);
        }
        let state = std::mem::replace(&mut self.state, State::Idle);
        let (next, mut effects) = self.transition(state, event, now);
        self.state = next;
        if self.upgrade.is_some() {
            self.upgrade_due(now, &mut effects);
        }
        effects
    }

    /// The load `track` left `Starting` for `next`: its record into the
    /// ledger, its alarms into the journal.
    fn load_ended(&mut self, track: LoadTrack, next: &State, now: Instant, fx: &mut Vec<Effect>) {
        let from_purpose = |p: &Purpose| match p {
            Purpose::Failure(c) => LoadOutcome::Failed { class: c.class().as_str().into(), cause: c.text.clone() },
            Purpose::Shutdown => LoadOutcome::Stopped { why: "stop".into() },
            Purpose::Reload => LoadOutcome::Stopped { why: "reload".into() },
            Purpose::Restart => LoadOutcome::Stopped { why: "restart".into() },
            Purpose::Internal(t) => LoadOutcome::Stopped { why: format!("the warden failed: {t}") },
            Purpose::Idle(_) => LoadOutcome::Stopped { why: "idle".into() },
        };
        let outcome = match next {
            State::Ready(_) => LoadOutcome::Ready,
            State::Reporting(r) => from_purpose(&r.purpose),
            State::Stopping(s) => from_purpose(&s.purpose),
            _ => match &self.cause {
                Some(c) => LoadOutcome::Failed { class: c.class().as_str().into(), cause: c.text.clone() },
                None => LoadOutcome::Stopped { why: "stop".into() },
            },
        };
        let mut ended = track.finish(outcome, self.starts, now, self.policy.slow_factor);
        ended.rollback = self.rollback.active.is_some();
        if matches!(ended.outcome, LoadOutcome::Failed { .. }) {
            self.unpin(fx);
        }
        for alarm in &ended.alarms {
            fx.push(record(Severity::Warn, Topic::LoadAlarm, alarm.clone()));
        }
        self.loads_ended += 1;
        self.last_load_record = Some(std::sync::Arc::new(ended.clone()));
        fx.push(Effect::LoadEnded(Box::new(ended)));
    }

    /// The start that failed used pinned values: they are dropped (a pin
    /// is what fitted once; a start it fails is no longer proof of it).
    fn unpin(&mut self, fx: &mut Vec<Effect>) {
        use crate::fit::Source;
        let pinned: BTreeMap<_, _> = self
            .fit
            .used
            .iter()
            .filter(|(_, (_, s))| *s == Source::Pinned)
            .map(|(a, (v, _))| (*a, v.clone()))
            .collect();
        if pinned.is_empty() {
            return;
        }
        let words: Vec<String> = pinned.iter().map(|(a, v)| format!("{} {v}", a.flag())).collect();
        let setup = self.rollback.setup.as_deref().unwrap_or("unknown");
        let said = format!(
            "memory fit: the start with the pinned {} failed; the pin is dropped for setup {setup}",
            words.join(", ")
        );
        fx.push(record(Severity::Warn, Topic::Fit, said));
        fx.push(Effect::Unpin(pinned));
    }

    /// How long the load may go without progress now: `ready.stall`, or
    /// longer where the ledger says the phase under way takes longer.
    fn stall_now(&self, track: &LoadTrack) -> Duration {
        track.stall(self.policy.stall, self.policy.deadline_factor)
    }

    /// How long `l` may go without progress: [`Machine::stall_now`], and
    /// during the golden check at least its timeout and a margin (the
    /// check's own deadline comes first).
    fn stall_of(&self, l: &Loading) -> Duration {
        let stall = self.stall_now(&l.track);
        if l.golden { stall.max(self.policy.golden_timeout.saturating_add(GOLDEN_MARGIN)) } else { stall }
    }

    /// How long the whole load may take: `ready.timeout`, or longer where
    /// the ledger says the setup's loads take longer.
    fn timeout_now(&self, l: &Loading) -> Duration {
        let p = &self.policy;
        l.track.timeout(p.ready_timeout, p.deadline_factor)
    }

    /// `STATUS=` of a load: its phase and estimate first, where the
    /// profile tells phases.
    fn loading_text(&self, l: &Loading, now: Instant, rest: &str) -> String {
        let pid = l.run.pid;
        if self.policy.phases {
            format!("{}, pid {pid}{rest}", l.track.now(now).text())
        } else {
            format!("loading, pid {pid}{rest}")
        }
    }

    /// Where the load under way is, for the status document: as of the
    /// last event it saw.
    pub fn load_now(&self) -> Option<crate::load::LoadNow> {
        match &self.state {
            State::Starting(l) => Some(l.track.now(l.seen)),
            _ => None,
        }
    }

    /// One event in one state: each state has a function of its own that
    /// names every event, so a new event is a compile error until each
    /// state says what it does with it (the start here, a serving run in
    /// `machine/ready.rs`, the way out in `machine/stop.rs`, an idle engine
    /// in `machine/idle.rs`).
    fn transition(&mut self, state: State, event: Event, now: Instant) -> (State, Vec<Effect>) {
        match state {
            State::Idle => self.in_idle(event, now),
            State::RollingBack { code, text } => self.in_rolling_back(code, text, event, now),
            State::Launching { start, then, known } => self.in_launching(start, then, known, event, now),
            State::Starting(loading) => self.in_starting(loading, event, now),
            State::Ready(serving) => self.in_ready(serving, event, now),
            State::Adopted { serving, from } => self.in_adopted(serving, from, event, now),
            State::Reporting(r) => self.in_reporting(r, event, now),
            State::Stopping(stop) => self.in_stopping(stop, event, now),
            State::Backoff { until, cause } => self.in_backoff(until, cause, event, now),
            State::Done(code) => self.in_done(code, event),
            State::Parked(p) => self.in_parked(p, event, now),
            State::Asleep(d) => self.in_asleep(d, event, now),
        }
    }

    /// Before the first start, and between a give-up and its rollback.
    fn in_idle(&mut self, event: Event, now: Instant) -> (State, Vec<Effect>) {
        use Event as E;
        match event {
            E::Begin => self.launch(None, now),
            E::StopRequested => self.finish(Code::Ok, "stopped on request".into(), vec![]),
            E::TaskFailed { task } => self.task_failed(State::Idle, task, now),
            E::Reload { policy, summary } => self.reload(State::Idle, *policy, summary, now),
            E::ReloadInPlace { policy, summary } => self.reload_in_place(State::Idle, *policy, summary),
            E::Upgrade(u) => self.upgrade_event(State::Idle, u, now),
            E::ReportStarted { path, .. } => self.report_started(State::Idle, path),
            event @ (E::Prepared { .. }
            | E::PrepareStep { .. }
            | E::LoadKnown { .. }
            | E::Prefetched { .. }
            | E::Spawned { .. }
            | E::SpawnFailed { .. }
            | E::Line { .. }
            | E::HttpReady { .. }
            | E::GoldenChecked { .. }
            | E::HealthFailed { .. }
            | E::RolledBack { .. }
            | E::DaemonLost { .. }
            | E::ChildExited { .. }
            | E::TreeGone
            | E::DrainRequested
            | E::UndrainRequested
            | E::RestartRequested
            | E::Quiet { .. }
            | E::GpuFault { .. }
            | E::Recheck { .. }
            | E::OomKilled { .. }
            | E::Reported { .. }
            | E::Survivors { .. }
            | E::Tick
            | E::IdleFor { .. }
            | E::Wanted
            | E::Slept { .. }
            | E::Woke { .. }) => ignored(State::Idle, event),
        }
    }

    /// The give-up `code`, `text` held while the backend turns to the
    /// last-known-good setup.
    fn in_rolling_back(&mut self, code: Code, text: String, event: Event, now: Instant) -> (State, Vec<Effect>) {
        use Event as E;
        let state = |code, text| State::RollingBack { code, text };
        match event {
            E::RolledBack { policy } => self.rolled_back(code, text, policy, now),
            E::StopRequested => self.finish(Code::Ok, "stopped on request".into(), vec![]),
            E::TaskFailed { task } => self.task_failed(state(code, text), task, now),
            E::Reload { policy, summary } => self.reload(state(code, text), *policy, summary, now),
            E::ReloadInPlace { policy, summary } => self.reload_in_place(state(code, text), *policy, summary),
            E::Upgrade(u) => self.upgrade_event(state(code, text), u, now),
            E::ReportStarted { path, .. } => self.report_started(state(code, text), path),
            event @ (E::Begin
            | E::Prepared { .. }
            | E::PrepareStep { .. }
            | E::LoadKnown { .. }
            | E::Prefetched { .. }
            | E::Spawned { .. }
            | E::SpawnFailed { .. }
            | E::Line { .. }
            | E::HttpReady { .. }
            | E::GoldenChecked { .. }
            | E::HealthFailed { .. }
            | E::DaemonLost { .. }
            | E::ChildExited { .. }
            | E::TreeGone
            | E::DrainRequested
            | E::UndrainRequested
            | E::RestartRequested
            | E::Quiet { .. }
            | E::GpuFault { .. }
            | E::Recheck { .. }
            | E::OomKilled { .. }
            | E::Reported { .. }
            | E::Survivors { .. }
            | E::Tick
            | E::IdleFor { .. }
            | E::Wanted
            | E::Slept { .. }
            | E::Woke { .. }) => ignored(state(code, text), event),
        }
    }

    /// The pre-start steps of `start`, and its spawn.
    fn in_launching(
        &mut self,
        start: u32,
        then: AfterPrepare,
        mut known: Known,
        event: Event,
        now: Instant,
    ) -> (State, Vec<Effect>) {
        use Event as E;
        use State as S;
        match (then, event) {
            (then, E::Prepared { result, .. }) => match (then, result) {
                (AfterPrepare::Stop(purpose), _) => self.stopped(purpose, None, now, vec![]),
                (AfterPrepare::Relaunch(why), _) => self.launch(Some(why), now),
                (then @ AfterPrepare::Spawn { .. }, Prepared::Done) => {
                    (S::Launching { start, then, known }, vec![Effect::Spawn { start }])
                }
                (AfterPrepare::Spawn { .. }, Prepared::Failed(failure)) => self.start_failed(failure, now),
                // Nothing asked for it; fail the start rather than wait for ever.
                (AfterPrepare::Spawn { .. }, Prepared::Cancelled) => {
                    self.start_failed(StartFailure::transient("pre-start steps cancelled"), now)
                }
            },
            (then, E::LoadKnown { load, .. }) => {
                known.setup = Some(load);
                (S::Launching { start, then, known }, vec![])
            }
            (then, E::Prefetched { now: p, .. }) => {
                known.prefetch = Some(p);
                (S::Launching { start, then, known }, vec![])
            }
            (then, E::Spawned { pid, .. }) => self.spawned(start, then, known, pid, now),
            (then, E::SpawnFailed { failure, .. }) => match then {
                AfterPrepare::Stop(purpose) => self.stopped(purpose, None, now, vec![]),
                AfterPrepare::Relaunch(why) => self.launch(Some(why), now),
                AfterPrepare::Spawn { .. } => self.start_failed(failure, now),
            },
            (AfterPrepare::Spawn { deadline, .. }, E::PrepareStep { text, .. }) => {
                // A step is a sign of life, as a progress line is: the
                // weight-cache daemon's load (`[preload]`) happens here and
                // may outlast the unit's start timeout.
                let fx = vec![Effect::Notify(vec![status(text.clone()), Note::ExtendTimeout(self.policy.stall)])];
                (S::Launching { start, then: AfterPrepare::Spawn { deadline, step: Some(text) }, known }, fx)
            }
            (AfterPrepare::Spawn { deadline, step }, E::Tick) if now >= deadline => {
                let budget = secs(self.policy.prepare_timeout);
                let at = step.map(|s| format!("; stuck at: {s}")).unwrap_or_default();
                let failure = StartFailure::transient(format!("pre-start steps did not finish within {budget}{at}"));
                let (next, mut fx) = self.start_failed(failure, now);
                fx.insert(0, Effect::CancelPrepare);
                (next, fx)
            }
            (then, E::StopRequested) => {
                let fx = vec![Effect::Notify(vec![Note::Stopping, status("stopping".into())])];
                match then {
                    // Asked twice: the cancel is already under way.
                    AfterPrepare::Stop(Purpose::Shutdown) => (S::Launching { start, then, known }, vec![]),
                    _ => self.cancel_launch(start, Purpose::Shutdown, fx),
                }
            }
            (AfterPrepare::Spawn { .. }, E::RestartRequested) => {
                self.failures = 0;
                self.permanent_streak = None;
                let fx = vec![record(Severity::Info, Topic::Stop, "restart requested".into()), Effect::CancelPrepare];
                (S::Launching { start, then: AfterPrepare::Relaunch(RestartReason::Restart), known }, fx)
            }
            (then, E::TaskFailed { task }) => self.task_failed(S::Launching { start, then, known }, task, now),
            (then, E::Reload { policy, summary }) => {
                self.reload(S::Launching { start, then, known }, *policy, summary, now)
            }
            (then, E::ReloadInPlace { policy, summary }) => {
                self.reload_in_place(S::Launching { start, then, known }, *policy, summary)
            }
            (then, E::Upgrade(u)) => self.upgrade_event(S::Launching { start, then, known }, u, now),
            (then, E::ReportStarted { path, .. }) => self.report_started(S::Launching { start, then, known }, path),
            (
                then,
                event @ (E::Begin
                | E::PrepareStep { .. }
                | E::Line { .. }
                | E::HttpReady { .. }
                | E::GoldenChecked { .. }
                | E::HealthFailed { .. }
                | E::RolledBack { .. }
                | E::DaemonLost { .. }
                | E::ChildExited { .. }
                | E::TreeGone
                | E::DrainRequested
                | E::UndrainRequested
                | E::RestartRequested
                | E::Quiet { .. }
                | E::GpuFault { .. }
                | E::Recheck { .. }
                | E::OomKilled { .. }
                | E::Reported { .. }
                | E::Survivors { .. }
                | E::Tick
                | E::IdleFor { .. }
                | E::Wanted
                | E::Slept { .. }
                | E::Woke { .. }),
            ) => ignored(S::Launching { start, then, known }, event),
        }
    }

    /// Start `start` spawned as `pid`: its load begins, or the stop that
    /// came meanwhile.
    fn spawned(
        &mut self,
        start: u32,
        then: AfterPrepare,
        known: Known,
        pid: u32,
        now: Instant,
    ) -> (State, Vec<Effect>) {
        let mut track = LoadTrack::new(known.setup.map(|s| *s).unwrap_or_default(), now);
        if let Some(p) = known.prefetch {
            track.prefetched(p, now);
        }
        let mut loading = Loading {
            run: Run {
                start,
                pid,
                spawned_at: now,
                first_progress: None,
                fatal_at: None,
                first_fatal: None,
                exception: None,
                oom: None,
            },
            progress_at: now,
            progress: None,
            awaiting_http: false,
            golden: false,
            track: Box::new(track),
            seen: now,
        };
        let mut fx = vec![
            record(Severity::Info, Topic::Spawned, format!("child spawned, pid {pid}, start {start}")),
            Effect::Notify(vec![
                status(self.loading_text(&loading, now, &format!(" ({})", self.attempts_text()))),
                Note::ExtendTimeout(self.stall_now(&loading.track)),
            ]),
        ];
        if !self.policy.ready_log {
            loading.awaiting_http = true;
            fx.push(Effect::Probe { start });
        }
        // A stop that came while it spawned: nothing was loaded yet, so no
        // load is recorded.
        let purpose = match then {
            AfterPrepare::Stop(purpose) => purpose,
            AfterPrepare::Relaunch(RestartReason::Restart) => Purpose::Restart,
            AfterPrepare::Relaunch(_) => Purpose::Reload,
            AfterPrepare::Spawn { .. } => return (State::Starting(loading), fx),
        };
        self.stop_leaving(Leaving::Loading(loading.run), purpose, now, fx, true)
    }

    /// A run that loads, until it serves or ends.
    fn in_starting(&mut self, mut loading: Loading, event: Event, now: Instant) -> (State, Vec<Effect>) {
        use Event as E;
        use State as S;
        loading.seen = now;
        match event {
            E::Line { line, .. } => self.starting_line(loading, line, now),
            E::HttpReady { .. } if loading.awaiting_http && !loading.golden && loading.run.fatal_at.is_none() => {
                self.http_passed(loading, now)
            }
            E::GoldenChecked { verdict, .. } if loading.golden => self.golden_checked(loading, verdict, now),
            E::OomKilled { cause, .. } => {
                let fx = recheck::oom_noted(&mut loading.run, cause);
                (S::Starting(loading), fx)
            }
            E::ChildExited { exit, .. } => self.exited(S::Starting(loading), exit, now),
            E::Tick => self.starting_tick(loading, now),
            E::Prefetched { now: p, .. } => {
                // Kept for the load's record; `STATUS=` again when what it
                // shows of the read-ahead changed.
                let mut fx = vec![];
                if loading.track.prefetched(p, now) && self.policy.phases {
                    let rest = loading.progress.as_deref().map(|t| format!(": {t}")).unwrap_or_default();
                    fx.push(Effect::Notify(vec![status(self.loading_text(&loading, now, &rest))]));
                }
                (S::Starting(loading), fx)
            }
            E::RestartRequested => {
                self.failures = 0;
                self.permanent_streak = None;
                let fx = vec![record(Severity::Info, Topic::Stop, "restart requested".into())];
                self.begin_stop(S::Starting(loading), Purpose::Restart, now, fx)
            }
            E::GpuFault { cause, .. } => self.fail(S::Starting(loading), gpu_fault(cause), None, now),
            E::DaemonLost { cause } => {
                self.fail(S::Starting(loading), Cause::new(cause, FailureKind::Health), None, now)
            }
            E::StopRequested => {
                let fx = vec![record(Severity::Info, Topic::Stop, "stop requested".into())];
                self.begin_stop(S::Starting(loading), Purpose::Shutdown, now, fx)
            }
            E::TaskFailed { task } => self.task_failed(S::Starting(loading), task, now),
            E::Reload { policy, summary } => self.reload(S::Starting(loading), *policy, summary, now),
            E::ReloadInPlace { policy, summary } => self.reload_in_place(S::Starting(loading), *policy, summary),
            E::Upgrade(u) => self.upgrade_event(S::Starting(loading), u, now),
            E::ReportStarted { path, .. } => self.report_started(S::Starting(loading), path),
            event @ (E::Begin
            | E::Prepared { .. }
            | E::PrepareStep { .. }
            | E::LoadKnown { .. }
            | E::Spawned { .. }
            | E::SpawnFailed { .. }
            | E::HttpReady { .. }
            | E::GoldenChecked { .. }
            | E::HealthFailed { .. }
            | E::RolledBack { .. }
            | E::TreeGone
            | E::DrainRequested
            | E::UndrainRequested
            | E::Quiet { .. }
            | E::Recheck { .. }
            | E::Reported { .. }
            | E::Survivors { .. }
            | E::IdleFor { .. }
            | E::Wanted
            | E::Slept { .. }
            | E::Woke { .. }) => ignored(S::Starting(loading), event),
        }
    }

    /// A loading run's deadlines: a fatal line's grace, the whole load's
    /// timeout, the stall.
    fn starting_tick(&mut self, loading: Loading, now: Instant) -> (State, Vec<Effect>) {
        let p = &self.policy;
        let run = &loading.run;
        let (timeout, stall) = (self.timeout_now(&loading), self.stall_of(&loading));
        let cause = if let Some(c) = run.fatal_grace_over(p.grace, now) {
            Some(c)
        } else if now >= run.spawned_at + timeout {
            let why = if timeout > p.ready_timeout { "from the ledger" } else { "ready.timeout" };
            Some(Cause::new(format!("not ready after {} ({why})", secs(timeout)), FailureKind::Timeout))
        } else if now >= loading.progress_at + stall {
            let last = loading.progress.as_deref().map(|l| format!("; last: {l}")).unwrap_or_default();
            let why = if stall > p.stall {
                format!("{} phase, from the ledger", loading.track.current())
            } else {
                "ready.stall".into()
            };
            Some(Cause::new(format!("no progress for {} ({why}){last}", secs(stall)), FailureKind::Stall))
        } else {
            None
        };
        match cause {
            Some(c) => self.fail(State::Starting(loading), c, None, now),
            None => (State::Starting(loading), vec![]),
        }
    }

    /// The leader of a loading or serving run exited: the run failed, its
    /// log's cause first.
    fn exited(&mut self, state: State, exit: Exit, now: Instant) -> (State, Vec<Effect>) {
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

    /// A config whose changes the child does not see: the policy from now
    /// on, the run as it is.
    fn reload_in_place(&mut self, state: State, policy: Policy, summary: String) -> (State, Vec<Effect>) {
        if matches!(state, State::Done(_)) {
            return (state, vec![]);
        }
        self.policy = policy;
        let fx = vec![record(Severity::Info, Topic::Reload, summary.clone()), Effect::Notify(vec![status(summary)])];
        (state, fx)
    }

    /// The failure report under way is being written into `path`.
    fn report_started(&mut self, state: State, path: String) -> (State, Vec<Effect>) {
        if let Some(f) = &mut self.last_failure {
            f.report = Some(path);
        }
        (state, vec![])
    }

    /// Start the engine: the warden's first start (`why` is `None`), or
    /// again for `why`.
    fn launch(&mut self, why: Option<RestartReason>, now: Instant) -> (State, Vec<Effect>) {
        self.fit.problem = None;
        self.starts += 1;
        if let Some(why) = why {
            self.restarts += 1;
            *self.restarts_by.entry(why).or_default() += 1;
        }
        let start = self.starts;
        let fx = vec![
            Effect::Notify(vec![status(format!("starting ({})", self.attempts_text()))]),
            Effect::Prepare { start },
        ];
        let deadline = now + self.policy.prepare_timeout;
        (State::Launching { start, then: AfterPrepare::Spawn { deadline, step: None }, known: Known::default() }, fx)
    }

    /// Give up the pre-start steps of `start`; `then` happens when they
    /// report back.
    fn cancel_launch(&mut self, start: u32, then: Purpose, mut fx: Vec<Effect>) -> (State, Vec<Effect>) {
        fx.push(Effect::CancelPrepare);
        (State::Launching { start, then: AfterPrepare::Stop(then), known: Known::default() }, fx)
    }

    fn start_failed(&mut self, failure: StartFailure, now: Instant) -> (State, Vec<Effect>) {
        let permanence = match (failure.unsupported, failure.permanent) {
            // Refused by what the machine is (the weight-cache daemon's platform check).
            (true, _) => Permanence::Hardware,
            (false, true) => Permanence::Unrunnable,
            (false, false) => Permanence::Transient,
        };
        let mut cause = Cause { text: failure.cause, kind: FailureKind::Spawn, permanence, hint: None };
        cause.hint = self.policy.hints.find(&cause.text);
        self.last_failure =
            Some(crate::snapshot::LastFailure { cause: cause.text.clone(), class: cause.class(), report: None });
        // Said before the failure counts: the attempt that failed, not the next.
        let about = RunOf { pid: None, attempt: self.attempt() };
        let fx = vec![record_of(Severity::Error, Topic::Failed, format!("start failed: {}", cause.shown()), about)];
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
        if let Some(p) = &line.fit
            && self.fit.problem.is_none()
        {
            // Out of memory counts while the weights load, not after.
            let weights = matches!(loading.track.current(), LoadPhase::Start | LoadPhase::Weights);
            if *p != crate::fit::Problem::OutOfMemory || weights {
                self.fit.problem = Some(p.clone());
            }
        }
        for mark in &line.load {
            loading.track.mark(mark, now);
        }
        if line.class == Class::Ready {
            loading.track.end(LoadPhase::Api, now);
        }
        if loading.run.fatal_at.is_some() {
            return (State::Starting(loading), fx);
        }
        if !line.load.is_empty() && !loading.golden {
            // The load moved: the stall deadline counts from here, and
            // systemd's start timeout with it (a progress line says so too).
            loading.progress_at = now;
            if !matches!(line.class, Class::Progress(_)) {
                fx.push(Effect::Notify(vec![Note::ExtendTimeout(self.stall_now(&loading.track))]));
            }
        }
        match &line.class {
            Class::Ready if !loading.awaiting_http && !loading.golden => {
                if !self.policy.ready_http {
                    return self.http_passed(loading, now);
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
                    status(self.loading_text(&loading, now, &format!(": {text}"))),
                    Note::ExtendTimeout(self.stall_now(&loading.track)),
                ]));
            }
            _ => {}
        }
        (State::Starting(loading), fx)
    }

    /// The server answered (or none is asked): the golden check, if on,
    /// else ready.
    fn http_passed(&mut self, mut loading: Loading, now: Instant) -> (State, Vec<Effect>) {
        if loading.awaiting_http {
            loading.track.end(LoadPhase::Http, now);
        }
        if self.policy.golden.is_none() {
            return self.become_ready(loading, now, None);
        }
        self.rechecks.skipped = false;
        self.rechecks.unproven = false;
        loading.golden = true;
        loading.progress_at = now;
        let text = self.loading_text(&loading, now, ": checking the golden answers");
        let extend = Note::ExtendTimeout(self.stall_of(&loading));
        let fx = vec![Effect::Golden { start: loading.run.start }, Effect::Notify(vec![status(text), extend])];
        (State::Starting(loading), fx)
    }

    /// The golden check is over: ready, ready with a warning, or a failed
    /// run (`golden.on-mismatch = "fail"`).
    fn golden_checked(
        &mut self,
        mut loading: Loading,
        verdict: crate::golden::Verdict,
        now: Instant,
    ) -> (State, Vec<Effect>) {
        use crate::golden::Verdict;
        loading.track.end(LoadPhase::Golden, now);
        let text = verdict.text();
        self.last_golden = Some(verdict.clone());
        self.golden_checks += 1;
        let fail = self.policy.golden == Some(crate::policy::GoldenPolicy::Fail);
        match verdict {
            Verdict::Same { .. } | Verdict::Recorded { .. } => {
                let mut fx = vec![record(Severity::Info, Topic::Golden, text)];
                let (next, more) = self.become_ready(loading, now, None);
                fx.extend(more);
                (next, fx)
            }
            // The golden store's trouble, not the model's: never a failed run.
            Verdict::Unrecorded { .. } => {
                let mut fx = vec![record(Severity::Warn, Topic::Golden, text.clone())];
                let (next, more) = self.become_ready(loading, now, Some(format!("WARNING: {text}")));
                fx.extend(more);
                (next, fx)
            }
            Verdict::Skipped { .. } => {
                self.rechecks.skipped = true;
                let mut fx = vec![record(Severity::Info, Topic::Golden, text.clone())];
                let (next, more) = self.become_ready(loading, now, Some(text));
                fx.extend(more);
                (next, fx)
            }
            // No answer is not ready, whatever `golden.on-mismatch` says.
            Verdict::NoAnswer { .. } => {
                let mut fx = vec![record(Severity::Error, Topic::GoldenMismatch, text.clone())];
                let (next, more) =
                    self.fail(State::Starting(loading), Cause::new(text, FailureKind::NoAnswer), None, now);
                fx.extend(more);
                (next, fx)
            }
            Verdict::Changed { .. } | Verdict::Failed { .. } if !fail => {
                self.rechecks.unproven = matches!(verdict, Verdict::Changed { .. });
                let mut fx = vec![record(Severity::Warn, Topic::GoldenMismatch, text.clone())];
                let (next, more) = self.become_ready(loading, now, Some(format!("WARNING: {text}")));
                fx.extend(more);
                (next, fx)
            }
            Verdict::Changed { .. } => {
                let cause =
                    Cause { text, kind: FailureKind::WrongAnswers, permanence: Permanence::Answers, hint: None };
                let mut fx = vec![record(Severity::Error, Topic::GoldenMismatch, cause.text.clone())];
                let (next, more) = self.fail(State::Starting(loading), cause, None, now);
                fx.extend(more);
                (next, fx)
            }
            Verdict::Failed { .. } => {
                let mut fx = vec![record(Severity::Error, Topic::GoldenMismatch, text.clone())];
                let (next, more) =
                    self.fail(State::Starting(loading), Cause::new(text, FailureKind::Health), None, now);
                fx.extend(more);
                (next, fx)
            }
        }
    }

    fn become_ready(&mut self, loading: Loading, now: Instant, warning: Option<String>) -> (State, Vec<Effect>) {
        use crate::fit::{Source, shown as fit_shown};
        let Loading { run, track, .. } = loading;
        let took = now - run.spawned_at;
        self.last_load = Some(took);
        self.cause = None;
        let mut fx = Vec::new();
        let mut text = format!("ready: pid {}, loaded in {}", run.pid, secs(took));
        if let Some(args) = fit_shown(&self.fit.used) {
            text.push_str(&format!("; {args}"));
            let fitted: BTreeMap<_, _> = self
                .fit
                .used
                .iter()
                .filter(|(_, (_, s))| *s == Source::Fitted)
                .map(|(a, (v, _))| (*a, v.clone()))
                .collect();
            if !fitted.is_empty() {
                let words: Vec<String> = fitted.iter().map(|(a, v)| format!("{} {v}", a.flag())).collect();
                let setup = self.rollback.setup.as_deref().unwrap_or("unknown");
                let pinned = format!("memory fit: {} reached ready; pinned for setup {setup}", words.join(", "));
                fx.push(record(Severity::Info, Topic::Fit, pinned));
                fx.push(Effect::Pin(fitted));
            }
        }
        self.fit.moves = 0;
        // Ready, and the golden answers (when asked) as before.
        // A skipped check (no completions API) is said, but is no warning.
        let good = warning.as_deref().is_none_or(|w| !w.starts_with("WARNING: "));
        let shown = match (&self.rollback.active, warning) {
            (_, Some(w)) => format!("{text}; {w}"),
            (Some(r), None) => {
                format!("serving last-known-good from {}; the new setup failed: {}; {text}", r.good_at, r.cause)
            }
            (None, None) => text.clone(),
        };
        if good {
            fx.push(Effect::SetupGood);
        }
        fx.splice(
            0..0,
            [
                record(Severity::Info, Topic::Ready, text),
                Effect::Notify(vec![Note::Ready, status(shown)]),
                Effect::Health { start: run.start },
            ],
        );
        self.rechecks.ready(&self.policy, now);
        let next = State::Ready(Serving { run, ready_at: now, drain: None, recheck: None });
        self.load_ended(*track, &next, now, &mut fx);
        (next, fx)
    }

    /// The backend has turned to the last-known-good setup (or could not:
    /// the give-up `code`, `text` held meanwhile is the end).
    fn rolled_back(
        &mut self,
        code: Code,
        text: String,
        policy: Result<Box<Policy>, String>,
        now: Instant,
    ) -> (State, Vec<Effect>) {
        let policy = match policy {
            Ok(p) => p,
            Err(why) => {
                let text = format!("{text}; the last-known-good setup cannot be started: {why}");
                return self.finish(code, text, vec![]);
            }
        };
        self.policy = *policy;
        self.failures = 0;
        self.permanent_streak = None;
        self.fit = Default::default();
        let mut fx = vec![Effect::Fit(BTreeMap::new())];
        let (next, more) = self.launch(Some(RestartReason::Rollback), now);
        fx.extend(more);
        (next, fx)
    }
}

#[cfg(test)]
mod tests;
