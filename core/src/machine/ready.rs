//! A serving run: its lines, its answers proven again, its drains and the
//! requests that move it (stop, restart, drain, undrain), and what ends it
//! (an exit, a fatal line's grace, a failed health check, a GPU fault).

use crate::Instant;

use super::*;

impl Machine {
    /// A run that serves (or is drained, or is having its answers proven
    /// again), until it ends.
    pub(super) fn in_ready(&mut self, serving: Serving, event: Event, now: Instant) -> (State, Vec<Effect>) {
        use Event as E;
        use State as S;
        match event {
            // An idle engine (front.idle-stop): see `machine/idle.rs`.
            E::IdleFor { quiet } => self.idle_for(serving, quiet, now),
            E::Line { line, .. } => {
                let mut serving = serving;
                let fx = self.note_fatal(&mut serving.run, &line, now);
                (S::Ready(serving), fx)
            }
            E::GoldenChecked { verdict, .. } if serving.recheck.is_some() => self.rechecked(serving, verdict, now),
            E::Recheck { reason } => self.recheck(serving, reason, now),
            E::OomKilled { cause, .. } => {
                let mut serving = serving;
                let fx = recheck::oom_noted(&mut serving.run, cause);
                (S::Ready(serving), fx)
            }
            E::ChildExited { exit, .. } => self.exited(S::Ready(serving), exit, now),
            E::Tick => match serving.run.fatal_grace_over(self.policy.grace, now) {
                Some(c) => self.fail(S::Ready(serving), c, None, now),
                None => self.recheck_tick(serving, now),
            },
            E::Quiet { .. } => match serving.drain {
                Some(d @ ActiveDrain { stage: DrainStage::Quiesce { .. }, .. }) => {
                    let fx = vec![record(
                        Severity::Info,
                        Topic::Drain,
                        format!("no request in flight after {}", secs(now - d.began)),
                    )];
                    self.drained(serving, d, now, fx)
                }
                _ => (S::Ready(serving), vec![]),
            },
            E::DrainRequested => match serving.drain {
                None => self.begin_drain(serving, DrainFor::Hold, now, vec![]),
                Some(_) => (S::Ready(serving), vec![]),
            },
            E::UndrainRequested => self.undrain(serving),
            E::RestartRequested => self.restart_serving(serving, now),
            E::StopRequested if serving.drain.is_some() || self.policy.drain_on_stop => {
                self.stop_draining(serving, now)
            }
            E::StopRequested => {
                let fx = vec![record(Severity::Info, Topic::Stop, "stop requested".into())];
                self.begin_stop(S::Ready(serving), Purpose::Shutdown, now, fx)
            }
            E::GpuFault { cause, .. } => self.fail(S::Ready(serving), gpu_fault(cause), None, now),
            E::DaemonLost { cause } => self.fail(S::Ready(serving), Cause::new(cause, FailureKind::Health), None, now),
            E::HealthFailed { cause, .. } => {
                self.fail(S::Ready(serving), Cause::new(cause, FailureKind::Health), None, now)
            }
            E::TaskFailed { task } => self.task_failed(S::Ready(serving), task, now),
            E::Reload { policy, summary } => self.reload(S::Ready(serving), *policy, summary, now),
            E::ReloadInPlace { policy, summary } => self.reload_in_place(S::Ready(serving), *policy, summary),
            E::Upgrade(u) => self.upgrade_event(S::Ready(serving), u, now),
            E::ReportStarted { path, .. } => self.report_started(S::Ready(serving), path),
            event @ (E::Begin
            | E::Prepared { .. }
            | E::PrepareStep { .. }
            | E::LoadKnown { .. }
            | E::Prefetched { .. }
            | E::Spawned { .. }
            | E::SpawnFailed { .. }
            | E::HttpReady { .. }
            | E::GoldenChecked { .. }
            | E::RolledBack { .. }
            | E::TreeGone
            | E::Reported { .. }
            | E::Survivors { .. }
            | E::Wanted
            | E::Slept { .. }
            | E::Woke { .. }) => ignored(S::Ready(serving), event),
        }
    }

    /// The ready run taken over from a predecessor warden (version
    /// `from`, see [`Machine::adopt`]) until the first event, `Begin`,
    /// which the driver queues before any other: said, its health checked,
    /// and with the golden check on, its answers proven again. Anything
    /// else is what it is to a ready run.
    pub(super) fn in_adopted(
        &mut self,
        serving: Serving,
        from: String,
        event: Event,
        now: Instant,
    ) -> (State, Vec<Effect>) {
        match event {
            Event::Begin => self.taken_over(serving, from, now),
            event => self.in_ready(serving, event, now),
        }
    }

    fn taken_over(&mut self, serving: Serving, from: String, now: Instant) -> (State, Vec<Effect>) {
        let now_is = match &serving.drain {
            Some(d) => self.drain_text(&serving, d),
            None => format!("ready: pid {}", serving.run.pid),
        };
        let text = format!("upgraded from {from} to {}; {now_is}", env!("CARGO_PKG_VERSION"));
        let mut fx = vec![
            record(Severity::Info, Topic::Upgrade, text.clone()),
            Effect::Notify(vec![status(text)]),
            Effect::Health { start: serving.run.start },
        ];
        // A new warden proves what it took over before it vouches
        // for it (the golden check on).
        if self.policy.golden.is_none() {
            return (State::Ready(serving), fx);
        }
        let reason = format!("the warden upgraded from {from} to {}", env!("CARGO_PKG_VERSION"));
        let (next, more) = self.recheck(serving, reason, now);
        fx.extend(more);
        (next, fx)
    }

    /// Back into rotation: a drain held, or one for a restart, is undone.
    fn undrain(&mut self, mut serving: Serving) -> (State, Vec<Effect>) {
        match serving.drain {
            Some(d) if matches!(d.for_, DrainFor::Hold | DrainFor::Restart) => {
                serving.drain = None;
                let text = format!("ready again: pid {}, undrained", serving.run.pid);
                let fx = vec![
                    Effect::UnwatchLoad,
                    record(Severity::Info, Topic::Drain, text.clone()),
                    Effect::Notify(vec![status(text)]),
                ];
                (State::Ready(serving), fx)
            }
            _ => (State::Ready(serving), vec![]),
        }
    }

    /// `restart`: drained first, then started again.
    fn restart_serving(&mut self, mut serving: Serving, now: Instant) -> (State, Vec<Effect>) {
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
                (State::Ready(serving), vec![])
            }
            Some(_) => (State::Ready(serving), vec![]),
        }
    }

    /// A stop of a run that drains first (`drain.on-stop`, or a drain
    /// under way): the stop is answered at once; the drain delays only
    /// the signal. Asked again, the child is stopped now.
    fn stop_draining(&mut self, mut serving: Serving, now: Instant) -> (State, Vec<Effect>) {
        let mut fx = vec![
            record(Severity::Info, Topic::Stop, "stop requested".into()),
            Effect::Notify(vec![Note::Stopping, Note::ExtendTimeout(self.drain_budget())]),
        ];
        match serving.drain {
            None => self.begin_drain(serving, DrainFor::Stop, now, fx),
            Some(d) if d.for_ == DrainFor::Stop => {
                fx.push(record(Severity::Info, Topic::Drain, "asked again: the drain is cut short".into()));
                serving.drain = None;
                self.begin_stop(State::Ready(serving), Purpose::Shutdown, now, fx)
            }
            Some(mut d) => {
                d.for_ = DrainFor::Stop;
                if d.stage == DrainStage::Drained {
                    return self.drained(serving, d, now, fx);
                }
                serving.drain = Some(d);
                fx.push(Effect::Notify(vec![status(self.drain_text(&serving, &d))]));
                (State::Ready(serving), fx)
            }
        }
    }
}
