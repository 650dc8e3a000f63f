//! An engine without requests (`front.idle-stop`): stopped through the
//! normal stop and started again by the next request (`Parked`), or put to
//! sleep with vLLM's own sleep mode and woken by the next request, its
//! golden answers checked before it serves again (`Asleep`).
//!
//! ```text
//!            IdleFor (stop)          TreeGone             Wanted
//!   Ready ─────────────────▶ Stopping ────────▶ Parked ─────────▶ Launching …
//!            IdleFor (sleep)   Slept(ok)           Wanted             Woke(ok)               GoldenChecked(same)
//!   Ready ────────▶ Asleep(Falling) ──▶ Asleep ────────▶ Asleep(Waking) ───▶ Asleep(Checking) ─────────▶ Ready
//!                        │ Slept(err): stopped instead        │ Woke(err)            │ changed / failed
//!                        ▼                                    ▼                      ▼
//!                     Stopping(idle)                    (failure: report, stop, restart)
//! ```
//!
//! While asleep, the child is still the run's: its exit, a fatal line, a
//! stop, a restart or a reload are what they are for a ready run.

use std::time::Duration;

use crate::Instant;

use super::*;
use crate::policy::IdleAction;

impl Machine {
    /// A ready run with no drain and no fatal line waiting for its grace:
    /// the front door's quiet counts from when it became ready (a load
    /// longer than `idle-stop` does not stop the engine at once). `None`
    /// in any other state, or without `idle-stop`.
    pub fn idle_watch(&self) -> Option<(Duration, Instant)> {
        let idle = self.policy.idle?;
        match &self.state {
            State::Ready(s) if s.drain.is_none() && s.run.fatal_at.is_none() => Some((idle.after, s.ready_at)),
            _ => None,
        }
    }

    /// The engine is idle (stopped or asleep): a request that comes
    /// starts or wakes it ([`Event::Wanted`]).
    pub fn idle_now(&self) -> bool {
        matches!(self.state, State::Parked(_) | State::Asleep(Dormant { stage: SleepStage::Asleep { .. }, .. }))
    }

    /// How long the engine takes to serve from idle, as far as is known:
    /// a start's estimate from the ledger (the setup's median load, else
    /// this warden's last load), a wake's from the last wake.
    pub fn idle_eta(&self) -> Option<Duration> {
        match &self.state {
            State::Asleep(_) => self.last_wake,
            _ => self.estimate.or(self.last_load),
        }
    }

    /// `front.idle-stop` has passed without a request.
    pub(super) fn idle_for(&mut self, serving: Serving, quiet: Duration, now: Instant) -> (State, Vec<Effect>) {
        let Some(idle) = self.policy.idle else { return (State::Ready(serving), vec![]) };
        if serving.drain.is_some() || serving.run.fatal_at.is_some() {
            return (State::Ready(serving), vec![]);
        }
        let pid = serving.run.pid;
        match idle.action {
            IdleAction::Stop => {
                let text = format!("no request for {}: stopping the engine, pid {pid}", secs(quiet));
                let fx = vec![record(Severity::Info, Topic::Idle, text)];
                self.begin_stop(State::Ready(serving), Purpose::Idle(quiet), now, fx)
            }
            IdleAction::Sleep => {
                let text = format!(
                    "no request for {}: putting the engine to sleep (level {}), pid {pid}",
                    secs(quiet),
                    idle.level
                );
                let fx = vec![
                    record(Severity::Info, Topic::Idle, text.clone()),
                    Effect::Sleep { start: serving.run.start, level: idle.level },
                    Effect::Notify(vec![status(format!("idle: {text}"))]),
                ];
                (State::Asleep(Dormant { serving, quiet, stage: SleepStage::Falling }), fx)
            }
        }
    }

    /// The engine stopped for want of requests is gone: parked until a
    /// request comes.
    pub(super) fn parked(&mut self, quiet: Duration, now: Instant, mut fx: Vec<Effect>) -> (State, Vec<Effect>) {
        self.idle_stops += 1;
        let about = self.estimate.or(self.last_load).map(|d| format!(" (about {})", secs(d))).unwrap_or_default();
        let text = format!("idle: stopped after {} without requests; starts on the next request{about}", secs(quiet));
        fx.push(record(Severity::Info, Topic::Idle, text.clone()));
        fx.push(Effect::Notify(vec![status(text)]));
        fx.push(Effect::Parked);
        (State::Parked(Parked { since: now, quiet }), fx)
    }

    /// A reload of the warden's own settings while the engine is idle: taken
    /// at once, said in the journal; `STATUS=` keeps saying the engine is
    /// idle.
    fn reload_idle(&mut self, state: State, policy: Policy, summary: String) -> (State, Vec<Effect>) {
        self.policy = policy;
        let text = format!("{summary}; the engine is idle");
        (state, vec![record(Severity::Info, Topic::Reload, text)])
    }

    pub(super) fn in_parked(&mut self, p: Parked, event: Event, now: Instant) -> (State, Vec<Effect>) {
        match event {
            Event::Wanted => {
                let text = format!("a request came after {} idle: starting the engine", secs(now - p.since));
                let (next, mut fx) = self.launch(Some(RestartReason::Wake), now);
                fx.insert(0, record(Severity::Info, Topic::Idle, text));
                (next, fx)
            }
            Event::RestartRequested => {
                let (next, mut fx) = self.launch(Some(RestartReason::Restart), now);
                fx.insert(0, record(Severity::Info, Topic::Stop, "restart requested".into()));
                (next, fx)
            }
            Event::StopRequested => self.finish(Code::Ok, "stopped on request".into(), vec![]),
            Event::TaskFailed { task } => self.task_failed(State::Parked(p), task, now),
            Event::Upgrade(u) => self.upgrade_event(State::Parked(p), u, now),
            // The warden's own settings: the next start and the next idle
            // stop go by them.
            Event::ReloadInPlace { policy, summary } => self.reload_idle(State::Parked(p), *policy, summary),
            Event::Reload { policy, summary } => {
                // Taken at the next start, which a request makes.
                self.policy = *policy;
                self.failures = 0;
                self.permanent_streak = None;
                self.fit = Default::default();
                self.rollback.active = None;
                let fx = vec![
                    record(Severity::Info, Topic::Reload, format!("config reloaded: {summary}; the engine is idle")),
                    Effect::Fit(BTreeMap::new()),
                ];
                (State::Parked(p), fx)
            }
            other @ (Event::Begin
            | Event::Prepared { .. }
            | Event::PrepareStep { .. }
            | Event::LoadKnown { .. }
            | Event::Prefetched { .. }
            | Event::Spawned { .. }
            | Event::SpawnFailed { .. }
            | Event::Line { .. }
            | Event::HttpReady { .. }
            | Event::GoldenChecked { .. }
            | Event::HealthFailed { .. }
            | Event::RolledBack { .. }
            | Event::DaemonLost { .. }
            | Event::ChildExited { .. }
            | Event::TreeGone
            | Event::DrainRequested
            | Event::UndrainRequested
            | Event::Quiet { .. }
            | Event::GpuFault { .. }
            | Event::Recheck { .. }
            | Event::OomKilled { .. }
            | Event::ReportStarted { .. }
            | Event::Reported { .. }
            | Event::Survivors { .. }
            | Event::Tick
            | Event::IdleFor { .. }
            | Event::Slept { .. }
            | Event::Woke { .. }) => {
                tracing::debug!(event = ?other, "event ignored while idle");
                (State::Parked(p), vec![])
            }
        }
    }

    pub(super) fn in_asleep(&mut self, mut d: Dormant, event: Event, now: Instant) -> (State, Vec<Effect>) {
        let pid = d.serving.run.pid;
        let start = d.serving.run.start;
        match (d.stage, event) {
            (SleepStage::Falling, Event::Slept { result: Ok(()), .. }) => {
                self.sleeps += 1;
                d.stage = SleepStage::Asleep { since: now };
                let level = self.policy.idle.map_or(1, |i| i.level);
                let text = format!(
                    "idle: asleep (level {level}) after {} without requests, pid {pid}; wakes on the next request",
                    secs(d.quiet)
                );
                let fx = vec![record(Severity::Info, Topic::Idle, text.clone()), Effect::Notify(vec![status(text)])];
                (State::Asleep(d), fx)
            }
            // The engine did not say it sleeps: its state is not known, so
            // it is stopped, as `idle-action = "stop"` would.
            (SleepStage::Falling, Event::Slept { result: Err(why), .. }) => {
                let text = format!("the engine did not go to sleep: {why}; stopping it instead");
                let fx = vec![record(Severity::Warn, Topic::Idle, text)];
                self.begin_stop(State::Ready(d.serving), Purpose::Idle(d.quiet), now, fx)
            }
            (SleepStage::Asleep { since }, Event::Wanted) => {
                d.stage = SleepStage::Waking { at: now };
                let text = format!("a request came after {} asleep: waking the engine, pid {pid}", secs(now - since));
                let fx = vec![
                    record(Severity::Info, Topic::Idle, text),
                    Effect::Wake { start },
                    Effect::Notify(vec![status(format!("waking: pid {pid}"))]),
                ];
                (State::Asleep(d), fx)
            }
            (SleepStage::Waking { at }, Event::Woke { result: Ok(()), .. }) => {
                if self.policy.golden.is_none() {
                    return self.awake(d, at, now, vec![]);
                }
                d.stage = SleepStage::Checking { at };
                let fx = vec![
                    Effect::Golden { start },
                    Effect::Notify(vec![status(format!("woken: pid {pid}; checking the golden answers"))]),
                ];
                (State::Asleep(d), fx)
            }
            (SleepStage::Waking { .. }, Event::Woke { result: Err(why), .. }) => {
                let cause = Cause::new(format!("the wake from sleep failed: {why}"), FailureKind::Health);
                self.fail(State::Ready(d.serving), cause, None, now)
            }
            (SleepStage::Checking { at }, Event::GoldenChecked { verdict, .. }) => {
                use crate::golden::Verdict;
                let text = verdict.text();
                self.last_golden = Some(verdict.clone());
                self.golden_checks += 1;
                match verdict {
                    Verdict::Same { .. }
                    | Verdict::Recorded { .. }
                    | Verdict::Unrecorded { .. }
                    | Verdict::Skipped { .. } => {
                        let severity =
                            if matches!(verdict, Verdict::Unrecorded { .. }) { Severity::Warn } else { Severity::Info };
                        self.awake(d, at, now, vec![record(severity, Topic::Golden, text)])
                    }
                    // The same engine answers otherwise than before its
                    // sleep: whatever the golden policy, it is started again.
                    Verdict::Changed { .. } | Verdict::Failed { .. } | Verdict::NoAnswer { .. } => {
                        let kind = match verdict {
                            Verdict::NoAnswer { .. } => FailureKind::NoAnswer,
                            _ => FailureKind::WrongAnswers,
                        };
                        let cause = Cause {
                            text: format!("after a wake from sleep: {text}"),
                            kind,
                            permanence: Permanence::Transient,
                            hint: None,
                        };
                        let fx = vec![record(Severity::Error, Topic::GoldenMismatch, cause.text.clone())];
                        let (next, more) = self.fail(State::Ready(d.serving), cause, None, now);
                        (next, fx.into_iter().chain(more).collect())
                    }
                }
            }
            (_, Event::Line { line, .. }) => {
                let fx = self.note_fatal(&mut d.serving.run, &line, now);
                (State::Asleep(d), fx)
            }
            (_, Event::Tick) => match d.serving.run.fatal_grace_over(self.policy.grace, now) {
                Some(c) => self.fail(State::Ready(d.serving), c, None, now),
                None => (State::Asleep(d), vec![]),
            },
            // What the run is for a ready one: its exit, a stop, a restart,
            // a reload, a failure of the warden or of the GPUs.
            (
                _,
                event @ (Event::ChildExited { .. }
                | Event::StopRequested
                | Event::RestartRequested
                | Event::Reload { .. }
                | Event::TaskFailed { .. }
                | Event::GpuFault { .. }
                | Event::DaemonLost { .. }),
            ) => self.in_ready(d.serving, event, now),
            (_, Event::Upgrade(u)) => self.upgrade_event(State::Asleep(d), u, now),
            (_, Event::ReloadInPlace { policy, summary }) => self.reload_idle(State::Asleep(d), *policy, summary),
            (
                _,
                other @ (Event::Begin
                | Event::Prepared { .. }
                | Event::PrepareStep { .. }
                | Event::LoadKnown { .. }
                | Event::Prefetched { .. }
                | Event::Spawned { .. }
                | Event::SpawnFailed { .. }
                | Event::HttpReady { .. }
                | Event::GoldenChecked { .. }
                | Event::HealthFailed { .. }
                | Event::RolledBack { .. }
                | Event::TreeGone
                | Event::DrainRequested
                | Event::UndrainRequested
                | Event::Quiet { .. }
                | Event::Recheck { .. }
                | Event::OomKilled { .. }
                | Event::ReportStarted { .. }
                | Event::Reported { .. }
                | Event::Survivors { .. }
                | Event::IdleFor { .. }
                | Event::Wanted
                | Event::Slept { .. }
                | Event::Woke { .. }),
            ) => {
                tracing::debug!(event = ?other, "event ignored while asleep");
                (State::Asleep(d), vec![])
            }
        }
    }

    /// Awake and answering as before: serving again, its health checked.
    fn awake(&mut self, d: Dormant, at: Instant, now: Instant, mut fx: Vec<Effect>) -> (State, Vec<Effect>) {
        let took = now - at;
        self.last_wake = Some(took);
        let pid = d.serving.run.pid;
        let text = format!("ready: pid {pid}, woken in {}", secs(took));
        fx.push(record(Severity::Info, Topic::Idle, text.clone()));
        fx.push(Effect::Notify(vec![status(text)]));
        fx.push(Effect::Health { start: d.serving.run.start });
        (State::Ready(d.serving), fx)
    }
}
