//! The supervisor as a pure state machine: `step(event, now) -> effects`.
//! It decides when the child is ready, when a start or a ready child has
//! failed and why, how long to back off, when to give up, and what to tell
//! systemd. It performs no I/O: the driver (`driver.rs`) carries out the
//! effects and feeds back what happened. sd_notify's wire format, regexes
//! and processes are not known here.
//!
//! States and their transitions (every other pair is logged and ignored):
//!
//! ```text
//!            Begin                Spawned            log line + HTTP 200
//!   Idle ──────────▶ Launching ─────────────▶ Starting ─────────────────▶ Ready
//!                      ▲   │ SpawnFailed         │ exit / fatal+grace /      │ exit (even 0) /
//!                      │   ▼                     │ stall / timeout           │ fatal+grace
//!                      │  (failure)              ▼                           ▼
//!                      │                      Stopping ◀─────────────────────┘
//!               Tick   │                         │ TreeGone
//!                      │       delay             ▼
//!                   Backoff ◀────────────── (failure) ──▶ Done(75 | 78)
//!   StopRequested: Starting/Ready → Stopping(shutdown) → Done(0); Backoff → Done(0)
//! ```

use std::time::Duration;

use nix::sys::signal::Signal;
use tokio::time::Instant;

use crate::child::Exit;
use crate::config::Settings;
use crate::logwatch::{Class, Exception, Line};
use crate::systemd::Note;

/// Before ready there is nothing to drain, and vLLM can lose a SIGTERM sent
/// during its load: the stop signal is repeated this often …
pub const LOAD_STOP_RESEND: Duration = Duration::from_secs(1);
/// … and SIGKILL follows after at most this long (or `stop-timeout`, if
/// shorter). The same short grace applies to what is left of a failed run.
pub const LOAD_STOP_GRACE: Duration = Duration::from_secs(10);

/// Exit codes of `run`, decided here and in `cli` only.
pub mod exit {
    pub const STOPPED: i32 = 0;
    pub const INTERNAL: i32 = 70;
    pub const GAVE_UP: i32 = 75;
    /// EX_CONFIG: invalid config, or a failure retries cannot fix.
    pub const CONFIG: i32 = 78;
}

/// The parts of the settings the machine acts on.
#[derive(Debug, Clone, PartialEq)]
pub struct Policy {
    pub ready_log: bool,
    pub ready_http: bool,
    pub ready_timeout: Duration,
    pub stall: Duration,
    pub grace: Duration,
    pub stop_signal: Signal,
    pub stop_timeout: Duration,
    pub restart: crate::config::Restart,
}

impl Policy {
    pub fn from_settings(s: &Settings) -> Policy {
        Policy {
            ready_log: !s.patterns.ready.is_empty(),
            ready_http: s.ready.http.is_some(),
            ready_timeout: s.ready.timeout,
            stall: s.ready.stall,
            grace: s.fatal.grace,
            stop_signal: s.child.stop_signal,
            stop_timeout: s.child.stop_timeout,
            restart: s.restart.clone(),
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

/// Why a run failed.
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
    /// The permanent pattern it matched (index into the effective list),
    /// or `SPAWN` when the program cannot be started at all.
    pub permanent: Option<usize>,
}

/// `Cause::permanent` for a command that cannot be executed.
pub const SPAWN: usize = usize::MAX;

/// What happened.
#[derive(Debug, Clone, PartialEq)]
pub enum Event {
    Begin,
    /// The pre-start steps are done: `Err((cause, permanent))` if one failed.
    Prepared {
        start: u32,
        result: Result<(), (String, bool)>,
    },
    Spawned {
        start: u32,
        pid: u32,
    },
    SpawnFailed {
        start: u32,
        error: String,
        permanent: bool,
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
    /// A valid new config (SIGHUP): stop the child and start again with it.
    Reload(Box<Policy>),
    ChildExited {
        pid: u32,
        exit: Exit,
    },
    TreeGone,
    StopRequested,
    Tick,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Severity {
    Info,
    Warn,
    Error,
}

/// A warden event for the journal; `event` becomes the `EVENT=` field.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Record {
    pub severity: Severity,
    pub event: &'static str,
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
    Notify(Vec<Note>),
    Log(Record),
    Exit(i32),
}

/// One run of the child, from spawn to exit.
#[derive(Debug, Clone, PartialEq)]
pub struct Run {
    pub start: u32,
    pub pid: u32,
    pub spawned_at: Instant,
    pub progress_at: Instant,
    pub progress: Option<String>,
    /// The ready line was seen; waiting for HTTP 200.
    pub awaiting_http: bool,
    pub ready_at: Option<Instant>,
    /// A fatal line was seen at this instant: the child has `grace` to exit.
    pub fatal_at: Option<Instant>,
    pub first_fatal: Option<(String, Option<usize>)>,
    /// The first traceback's final exception line, and its permanent match.
    pub exception: Option<(Exception, Option<usize>)>,
}

impl Run {
    /// The cause to report if this run fails now, when its log tells one.
    fn logged_cause(&self) -> Option<Cause> {
        let exc = self.exception.as_ref().map(|(e, p)| (e.text.clone(), *p));
        let fatal = self.first_fatal.clone();
        // A permanent match wins, then the exception line, then the fatal line.
        let (text, permanent) =
            [exc.clone(), fatal.clone()].into_iter().flatten().find(|(_, p)| p.is_some()).or(exc).or(fatal)?;
        Some(Cause { text, kind: FailureKind::FatalLine, permanent })
    }
}

#[derive(Debug, Clone, PartialEq)]
pub enum Purpose {
    Shutdown,
    Failure(Cause),
    /// A new config: start again with it once the tree is gone.
    Reload,
}

#[derive(Debug, Clone, PartialEq)]
pub struct Stop {
    pub purpose: Purpose,
    pub pid: u32,
    pub leader_alive: bool,
    /// How long the run had been ready, if it was.
    pub ready_for: Option<Duration>,
    pub kill_at: Instant,
    pub resend_at: Option<Instant>,
    pub killed: bool,
}

#[derive(Debug, Clone, PartialEq)]
pub enum State {
    Idle,
    /// Pre-start steps and spawn of `start`. `relaunch`: a reload came
    /// meanwhile, start again once these steps are over.
    Launching {
        start: u32,
        stop_pending: bool,
        relaunch: bool,
    },
    Starting(Run),
    Ready(Run),
    Stopping(Stop),
    Backoff {
        until: Instant,
        cause: Cause,
    },
    Done(i32),
}

/// The supervisor: its state and its counters.
#[derive(Debug)]
pub struct Machine {
    pub policy: Policy,
    pub state: State,
    rng: fastrand::Rng,
    /// Spawns so far (`start N` in the log marker).
    pub starts: u32,
    /// Consecutive failed starts.
    pub failures: u32,
    /// Spawns after the first.
    pub restarts: u32,
    /// The permanent pattern of the last failures, and how many in a row.
    permanent_streak: Option<(usize, u32)>,
    pub last_exit: Option<Exit>,
    /// Children exited so far.
    pub exits: u32,
    pub cause: Option<Cause>,
    /// Spawn to ready of the last ready run.
    pub last_load: Option<Duration>,
    /// Failed runs by class (see `status::FAILURE_CLASSES`).
    pub failure_counts: std::collections::BTreeMap<&'static str, u64>,
}

fn secs(d: Duration) -> String {
    humantime::format_duration(Duration::from_secs(d.as_secs_f64().round() as u64)).to_string()
}

fn record(severity: Severity, event: &'static str, message: String) -> Effect {
    Effect::Log(Record { severity, event, message })
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
            failure_counts: Default::default(),
        }
    }

    /// The current run's latest progress line, while starting.
    pub fn progress(&self) -> Option<&str> {
        match &self.state {
            State::Starting(r) => r.progress.as_deref(),
            _ => None,
        }
    }

    /// What the status document and the metrics show.
    pub fn snapshot(&self) -> crate::status::Snapshot {
        crate::status::Snapshot {
            state: state_name(&self.state),
            child_pid: self.child_pid(),
            attempt: self.attempt(),
            restarts: self.restarts,
            starts: self.starts,
            progress: self.progress().map(String::from),
            cause: self.cause.as_ref().map(|c| c.text.clone()),
            exits: self.exits,
            last_exit: self.last_exit,
            last_load: self.last_load,
            failures: self.failure_counts.clone(),
            exit_code: if let State::Done(c) = self.state { Some(c) } else { None },
        }
    }

    /// The attempt number of the current or next start.
    pub fn attempt(&self) -> u32 {
        self.failures + 1
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
            State::Starting(r) | State::Ready(r) => Some(r.pid),
            State::Stopping(s) if s.leader_alive => Some(s.pid),
            _ => None,
        }
    }

    /// When the machine wants a `Tick`.
    pub fn next_deadline(&self) -> Option<Instant> {
        let p = &self.policy;
        let mut d: Vec<Instant> = Vec::new();
        match &self.state {
            State::Starting(r) => {
                d.push(r.spawned_at + p.ready_timeout);
                d.push(r.progress_at + p.stall);
                d.extend(r.fatal_at.map(|t| t + p.grace));
            }
            State::Ready(r) => d.extend(r.fatal_at.map(|t| t + p.grace)),
            State::Stopping(s) => {
                if !s.killed {
                    d.push(s.kill_at);
                }
                d.extend(s.resend_at);
            }
            State::Backoff { until, .. } => d.push(*until),
            State::Idle | State::Launching { .. } | State::Done(_) => {}
        }
        d.into_iter().min()
    }

    pub fn step(&mut self, event: Event, now: Instant) -> Vec<Effect> {
        let state = std::mem::replace(&mut self.state, State::Idle);
        let (next, effects) = self.transition(state, event, now);
        self.state = next;
        effects
    }

    fn transition(&mut self, state: State, event: Event, now: Instant) -> (State, Vec<Effect>) {
        use Event as E;
        use State as S;
        match (state, event) {
            (S::Idle, E::Begin) => self.launch(),

            (S::Launching { start, stop_pending: false, relaunch: true }, E::Prepared { start: s, .. })
                if s == start =>
            {
                self.launch()
            }
            (S::Launching { start, stop_pending, relaunch }, E::Prepared { start: s, result }) if s == start => {
                match (stop_pending, result) {
                    (true, _) => {
                        self.finish(exit::STOPPED, "stopped on request".into(), Severity::Info, "stopped", vec![])
                    }
                    (false, Ok(())) => (S::Launching { start, stop_pending, relaunch }, vec![Effect::Spawn { start }]),
                    (false, Err((error, permanent))) => {
                        let cause =
                            Cause { text: error, kind: FailureKind::Spawn, permanent: permanent.then_some(SPAWN) };
                        let fx = vec![record(Severity::Error, "failed", format!("start failed: {}", cause.text))];
                        self.after_failure(cause, None, now, fx)
                    }
                }
            }
            (S::Launching { start, stop_pending, .. }, E::Spawned { start: s, pid }) if s == start => {
                let mut run = Run {
                    start,
                    pid,
                    spawned_at: now,
                    progress_at: now,
                    progress: None,
                    awaiting_http: false,
                    ready_at: None,
                    fatal_at: None,
                    first_fatal: None,
                    exception: None,
                };
                let mut fx = vec![
                    record(Severity::Info, "spawned", format!("child spawned, pid {pid}, start {start}")),
                    Effect::Notify(vec![
                        status(format!("loading, pid {pid} ({})", self.attempts_text())),
                        Note::ExtendTimeout(self.policy.stall),
                    ]),
                ];
                if !self.policy.ready_log {
                    run.awaiting_http = true;
                    fx.push(Effect::Probe { start });
                }
                if stop_pending {
                    return self.begin_stop(S::Starting(run), Purpose::Shutdown, now, fx);
                }
                (S::Starting(run), fx)
            }
            (S::Launching { start, stop_pending, .. }, E::SpawnFailed { start: s, error, permanent }) if s == start => {
                if stop_pending {
                    return self.finish(exit::STOPPED, "stopped on request".into(), Severity::Info, "stopped", vec![]);
                }
                let cause = Cause { text: error, kind: FailureKind::Spawn, permanent: permanent.then_some(SPAWN) };
                let fx = vec![record(Severity::Error, "failed", format!("start failed: {}", cause.text))];
                self.after_failure(cause, None, now, fx)
            }
            (S::Launching { start, .. }, E::StopRequested) => (
                S::Launching { start, stop_pending: true, relaunch: false },
                vec![Effect::Notify(vec![Note::Stopping, status("stopping".into())]), Effect::CancelPrepare],
            ),

            (S::Starting(run) | S::Ready(run), E::Line { start, .. }) if start != run.start => {
                (self.restore(run), vec![])
            }
            (S::Starting(run), E::Line { line, .. }) => self.starting_line(run, line, now),
            (S::Ready(mut run), E::Line { line, .. }) => {
                let fx = self.note_fatal(&mut run, &line, now);
                (S::Ready(run), fx)
            }
            (S::Starting(run), E::HttpReady { start }) if start == run.start && run.awaiting_http => {
                if run.fatal_at.is_some() {
                    return (S::Starting(run), vec![]);
                }
                self.become_ready(run, now)
            }
            (S::Starting(run) | S::Ready(run), E::ChildExited { pid, exit }) if pid == run.pid => {
                self.last_exit = Some(exit);
                self.exits += 1;
                let was_ready = run.ready_at.is_some();
                let cause = run.logged_cause().unwrap_or_else(|| Cause {
                    text: if was_ready {
                        format!("exited while serving ({exit})")
                    } else {
                        format!("exited before ready ({exit})")
                    },
                    kind: FailureKind::Exit,
                    permanent: None,
                });
                let state = if was_ready { S::Ready(run) } else { S::Starting(run) };
                let (next, fx) = self.begin_stop(state, Purpose::Failure(cause), now, vec![]);
                (self.leader_gone(next), fx)
            }
            (S::Starting(run), E::Tick) => {
                let p = &self.policy;
                let cause = if run.fatal_at.is_some_and(|t| now >= t + p.grace) {
                    run.logged_cause()
                } else if now >= run.spawned_at + p.ready_timeout {
                    Some(Cause {
                        text: format!("not ready after {} (ready.timeout)", secs(p.ready_timeout)),
                        kind: FailureKind::Timeout,
                        permanent: None,
                    })
                } else if now >= run.progress_at + p.stall {
                    let last = run.progress.as_deref().map(|l| format!("; last: {l}")).unwrap_or_default();
                    Some(Cause {
                        text: format!("no progress for {} (ready.stall){last}", secs(p.stall)),
                        kind: FailureKind::Stall,
                        permanent: None,
                    })
                } else {
                    None
                };
                match cause {
                    Some(c) => self.begin_stop(S::Starting(run), Purpose::Failure(c), now, vec![]),
                    None => (S::Starting(run), vec![]),
                }
            }
            (S::Ready(run), E::Tick) => match run.logged_cause() {
                Some(c) if run.fatal_at.is_some_and(|t| now >= t + self.policy.grace) => {
                    self.begin_stop(S::Ready(run), Purpose::Failure(c), now, vec![])
                }
                _ => (S::Ready(run), vec![]),
            },
            (state @ (S::Starting(_) | S::Ready(_)), E::StopRequested) => {
                let fx = vec![record(Severity::Info, "stop", "stop requested".into())];
                self.begin_stop(state, Purpose::Shutdown, now, fx)
            }

            (S::Stopping(mut stop), E::ChildExited { pid, exit }) if pid == stop.pid => {
                self.last_exit = Some(exit);
                self.exits += 1;
                stop.leader_alive = false;
                stop.resend_at = None;
                // Whatever the leader left behind is orphaned now: pass the stop
                // on to it at once rather than waiting for the SIGKILL.
                let mut fx = vec![record(Severity::Info, "exited", format!("child {pid} {exit}"))];
                if !stop.killed {
                    fx.push(Effect::Terminate(self.policy.stop_signal));
                }
                (S::Stopping(stop), fx)
            }
            (S::Stopping(mut stop), E::Tick) => {
                let mut fx = Vec::new();
                if !stop.killed && now >= stop.kill_at {
                    stop.killed = true;
                    stop.resend_at = None;
                    fx.push(record(Severity::Warn, "kill", "stop timeout passed: SIGKILL to the whole tree".into()));
                    fx.push(Effect::KillTree);
                } else if let Some(t) = stop.resend_at.filter(|t| now >= *t) {
                    stop.resend_at = Some(t + LOAD_STOP_RESEND);
                    fx.push(Effect::Terminate(self.policy.stop_signal));
                }
                (S::Stopping(stop), fx)
            }
            (S::Stopping(mut stop), E::StopRequested) => {
                if stop.purpose != Purpose::Shutdown {
                    stop.purpose = Purpose::Shutdown;
                    (S::Stopping(stop), vec![Effect::Notify(vec![Note::Stopping, status("stopping".into())])])
                } else if !stop.killed {
                    // Asked twice: no more patience.
                    stop.killed = true;
                    stop.resend_at = None;
                    (S::Stopping(stop), vec![Effect::KillTree])
                } else {
                    (S::Stopping(stop), vec![])
                }
            }
            (S::Stopping(stop), E::TreeGone) => match stop.purpose {
                Purpose::Shutdown => {
                    self.finish(exit::STOPPED, "stopped on request".into(), Severity::Info, "stopped", vec![])
                }
                Purpose::Failure(cause) => self.after_failure(cause, stop.ready_for, now, vec![]),
                Purpose::Reload => self.launch(),
            },
            // Lines after a stop was asked for never count (vLLM logs
            // EngineDeadError on every ordinary shutdown).
            (S::Stopping(stop), E::Line { .. }) => (S::Stopping(stop), vec![]),

            (S::Backoff { until, cause }, E::Tick) => {
                if now >= until {
                    self.launch()
                } else {
                    (S::Backoff { until, cause }, vec![])
                }
            }
            (S::Backoff { .. }, E::StopRequested) => self.finish(
                exit::STOPPED,
                "stopped on request".into(),
                Severity::Info,
                "stopped",
                vec![Effect::Notify(vec![Note::Stopping])],
            ),
            (S::Idle, E::StopRequested) => {
                self.finish(exit::STOPPED, "stopped on request".into(), Severity::Info, "stopped", vec![])
            }

            (state, E::Reload(policy)) => self.reload(state, *policy, now),
            (S::Ready(run), E::HealthFailed { start, cause }) if start == run.start => {
                let cause = Cause { text: cause, kind: FailureKind::Health, permanent: None };
                self.begin_stop(S::Ready(run), Purpose::Failure(cause), now, vec![])
            }

            (state, Event::Tick) => (state, vec![]),
            (state, event) => {
                tracing::debug!(?event, state = state_name(&state), "event ignored");
                (state, vec![])
            }
        }
    }

    fn restore(&self, run: Run) -> State {
        if run.ready_at.is_some() { State::Ready(run) } else { State::Starting(run) }
    }

    fn launch(&mut self) -> (State, Vec<Effect>) {
        self.starts += 1;
        if self.starts > 1 {
            self.restarts += 1;
        }
        let start = self.starts;
        let fx = vec![
            Effect::Notify(vec![status(format!("starting ({})", self.attempts_text()))]),
            Effect::Prepare { start },
        ];
        (State::Launching { start, stop_pending: false, relaunch: false }, fx)
    }

    /// Record a fatal line or exception line of this run.
    fn note_fatal(&mut self, run: &mut Run, line: &Line, now: Instant) -> Vec<Effect> {
        let mut fx = Vec::new();
        if let Some(exc) = &line.exception {
            match &mut run.exception {
                None => run.exception = Some((exc.clone(), line.permanent)),
                Some((first, p)) if first.group == exc.group => {
                    *first = exc.clone();
                    *p = line.permanent;
                }
                Some(_) => {}
            }
        }
        if line.class == Class::Fatal {
            if run.first_fatal.is_none() {
                run.first_fatal = Some((line.message.trim().to_string(), line.permanent));
            } else if line.permanent.is_some() && run.first_fatal.as_ref().is_some_and(|(_, p)| p.is_none()) {
                // Keep the first line, but remember a permanent one that follows.
                run.first_fatal = Some((line.message.trim().to_string(), line.permanent));
            }
            if run.fatal_at.is_none() {
                run.fatal_at = Some(now);
                fx.push(record(Severity::Error, "fatal", format!("fatal line: {}", line.message.trim())));
                fx.push(Effect::Notify(vec![status(format!(
                    "failing: {}; waiting up to {} for the child to exit",
                    line.message.trim(),
                    secs(self.policy.grace)
                ))]));
            }
        }
        fx
    }

    fn starting_line(&mut self, mut run: Run, line: Line, now: Instant) -> (State, Vec<Effect>) {
        let mut fx = self.note_fatal(&mut run, &line, now);
        if run.fatal_at.is_some() {
            return (State::Starting(run), fx);
        }
        match &line.class {
            Class::Ready if !run.awaiting_http => {
                if self.policy.ready_http {
                    run.awaiting_http = true;
                    fx.push(record(Severity::Info, "ready-line", "ready line seen; checking HTTP".into()));
                    fx.push(Effect::Probe { start: run.start });
                } else {
                    return self.become_ready(run, now);
                }
            }
            Class::Progress(text) => {
                run.progress_at = now;
                run.progress = Some(text.clone());
                fx.push(Effect::Notify(vec![
                    status(format!("loading, pid {}: {text}", run.pid)),
                    Note::ExtendTimeout(self.policy.stall),
                ]));
            }
            _ => {}
        }
        (State::Starting(run), fx)
    }

    fn become_ready(&mut self, mut run: Run, now: Instant) -> (State, Vec<Effect>) {
        run.ready_at = Some(now);
        run.awaiting_http = false;
        let took = now - run.spawned_at;
        self.last_load = Some(took);
        let text = format!("ready: pid {}, loaded in {}", run.pid, secs(took));
        let fx = vec![
            record(Severity::Info, "ready", text.clone()),
            Effect::Notify(vec![Note::Ready, status(text)]),
            Effect::Health { start: run.start },
        ];
        self.cause = None;
        (State::Ready(run), fx)
    }

    fn begin_stop(
        &mut self,
        state: State,
        purpose: Purpose,
        now: Instant,
        mut fx: Vec<Effect>,
    ) -> (State, Vec<Effect>) {
        let run = match state {
            State::Starting(r) | State::Ready(r) => r,
            other => return (other, fx),
        };
        let ready_for = run.ready_at.map(|t| now - t);
        let drain = ready_for.is_some() && matches!(purpose, Purpose::Shutdown | Purpose::Reload);
        let grace = if drain { self.policy.stop_timeout } else { self.policy.stop_timeout.min(LOAD_STOP_GRACE) };
        match &purpose {
            Purpose::Shutdown => fx.push(Effect::Notify(vec![
                Note::Stopping,
                status(format!("stopping pid {}", run.pid)),
                Note::ExtendTimeout(grace + Duration::from_secs(5)),
            ])),
            Purpose::Failure(c) => {
                self.cause = Some(c.clone());
                fx.push(record(Severity::Error, "failed", format!("run failed: {}", c.text)));
                fx.push(Effect::Notify(vec![status(format!("failed ({}): {}", self.attempts_text(), c.text))]));
            }
            Purpose::Reload => fx.push(Effect::Notify(vec![
                status(format!("reloading: stopping pid {} to start it with the new config", run.pid)),
                Note::ExtendTimeout(grace + Duration::from_secs(5)),
            ])),
        }
        fx.push(Effect::Terminate(self.policy.stop_signal));
        let stop = Stop {
            purpose,
            pid: run.pid,
            leader_alive: true,
            ready_for,
            kill_at: now + grace,
            resend_at: (!drain).then_some(now + LOAD_STOP_RESEND),
            killed: grace.is_zero(),
        };
        if stop.killed {
            fx.push(Effect::KillTree);
        }
        (State::Stopping(stop), fx)
    }

    /// A valid new config: its policy applies from now on, the failure count
    /// starts again, and the child is started again with it.
    fn reload(&mut self, state: State, policy: Policy, now: Instant) -> (State, Vec<Effect>) {
        self.policy = policy;
        self.failures = 0;
        self.permanent_streak = None;
        let fx = vec![record(Severity::Info, "reload", "config reloaded: starting again with it".into())];
        match state {
            s @ (State::Starting(_) | State::Ready(_)) => self.begin_stop(s, Purpose::Reload, now, fx),
            State::Stopping(mut stop) if stop.purpose != Purpose::Shutdown => {
                stop.purpose = Purpose::Reload;
                (State::Stopping(stop), fx)
            }
            State::Backoff { .. } => {
                let (next, more) = self.launch();
                (next, fx.into_iter().chain(more).collect())
            }
            State::Launching { start, stop_pending: false, .. } => {
                let mut fx = fx;
                fx.push(Effect::CancelPrepare);
                (State::Launching { start, stop_pending: false, relaunch: true }, fx)
            }
            other => (other, vec![]),
        }
    }

    /// The leader has already exited: no signal to repeat.
    fn leader_gone(&self, state: State) -> State {
        match state {
            State::Stopping(mut s) => {
                s.leader_alive = false;
                s.resend_at = None;
                State::Stopping(s)
            }
            other => other,
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
        self.failures += 1;
        self.cause = Some(cause.clone());
        let class = match (cause.permanent, cause.kind) {
            (Some(_), _) => "permanent",
            (None, FailureKind::FatalLine) => "fatal_line",
            (None, FailureKind::Exit) => "exit",
            (None, FailureKind::Stall) => "stall",
            (None, FailureKind::Timeout) => "timeout",
            (None, FailureKind::Health) => "health",
            (None, FailureKind::Spawn) => "spawn",
        };
        *self.failure_counts.entry(class).or_default() += 1;
        if let Some(p) = cause.permanent {
            let n = match self.permanent_streak {
                Some((q, n)) if q == p => n + 1,
                _ => 1,
            };
            self.permanent_streak = Some((p, n));
            if n >= self.policy.restart.permanent_attempts {
                let text = format!("failed permanently ({n} of {n} tries): {}", cause.text);
                return self.finish(exit::CONFIG, text.clone(), Severity::Error, "gave-up", fx);
            }
        } else {
            self.permanent_streak = None;
        }
        let max = self.policy.restart.max_attempts;
        if max > 0 && self.failures >= max {
            let text = format!("gave up after {max} failed starts: {}", cause.text);
            return self.finish(exit::GAVE_UP, text, Severity::Error, "gave-up", fx);
        }
        let base = self.policy.backoff(self.failures);
        let j = self.policy.restart.jitter * (self.rng.f64() * 2.0 - 1.0);
        let delay = Duration::from_secs_f64((base.as_secs_f64() * (1.0 + j)).max(0.0));
        let text = format!("restarting in {} ({}): {}", secs(delay), self.attempts_text(), cause.text);
        fx.push(record(Severity::Warn, "backoff", text.clone()));
        fx.push(Effect::Notify(vec![status(text), Note::ExtendTimeout(delay + self.policy.stall)]));
        if delay.is_zero() {
            let (state, more) = self.launch();
            fx.extend(more);
            return (state, fx);
        }
        (State::Backoff { until: now + delay, cause }, fx)
    }

    fn finish(
        &mut self,
        code: i32,
        text: String,
        severity: Severity,
        event: &'static str,
        mut fx: Vec<Effect>,
    ) -> (State, Vec<Effect>) {
        fx.push(record(severity, event, text.clone()));
        fx.push(Effect::Notify(vec![status(text.clone())]));
        fx.push(Effect::Exit(code));
        let permanent = self.cause.as_ref().and_then(|c| c.permanent);
        self.cause = Some(Cause { text, kind: FailureKind::Exit, permanent });
        (State::Done(code), fx)
    }
}

pub fn state_name(s: &State) -> &'static str {
    match s {
        State::Idle | State::Launching { .. } | State::Starting(_) => "starting",
        State::Ready(_) => "ready",
        State::Stopping(st) => match st.purpose {
            Purpose::Shutdown | Purpose::Reload => "stopping",
            Purpose::Failure(_) => "failed",
        },
        State::Backoff { .. } => "backoff",
        // Left saying why in `cause`: a stop request, or the give-up.
        State::Done(_) => "stopped",
    }
}

#[cfg(test)]
mod tests;
