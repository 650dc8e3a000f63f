//! How the machine stops a tree, drains a serving child, fails a run,
//! reloads and finishes: the transitions out of a run.

use std::time::Duration;

use crate::Instant;

use super::*;

impl Machine {
    /// A failed run whose report is being written, its tree still there.
    pub(super) fn in_reporting(&mut self, r: Reporting, event: Event, now: Instant) -> (State, Vec<Effect>) {
        use Event as E;
        use State as S;
        match event {
            E::ReportStarted { path, .. } => self.report_started(S::Reporting(r), path),
            E::Reported { .. } => self.report_done(r, now, vec![]),
            // Nothing of the run is left to stop: what follows begins now,
            // beside the report.
            E::TreeGone if !r.leader => {
                let mut fx = vec![];
                let purpose = self.purpose_of_stop(&r.run, r.purpose, &mut fx);
                let ready_for = r.run.ready_at().map(|t| now - t);
                self.stopped(purpose, ready_for, now, fx)
            }
            E::Tick if now >= r.until => {
                let text = format!(
                    "the failure report did not finish within {}; cut short",
                    secs(self.policy.report.unwrap_or_default())
                );
                let about = Some(RunOf { pid: Some(r.run.run().pid), attempt: self.attempt() });
                let cut = Record { severity: Severity::Warn, topic: Topic::Failed, message: text, about };
                let fx = vec![Effect::CancelReport, Effect::Log(cut)];
                self.report_done(r, now, fx)
            }
            E::StopRequested => {
                let mut r = r;
                r.purpose = Purpose::Shutdown;
                let text = "stop requested; the failure report is cut short".to_string();
                let fx = vec![Effect::CancelReport, record(Severity::Info, Topic::Stop, text)];
                self.report_done(r, now, fx)
            }
            E::ChildExited { exit, .. } => {
                let mut r = r;
                self.last_exit = Some(exit);
                self.exits += 1;
                r.leader = false;
                (S::Reporting(r), vec![])
            }
            // The run has failed already: what else it does waits for the stop.
            E::Line { .. } | E::HealthFailed { .. } | E::GpuFault { .. } | E::DaemonLost { .. } | E::Recheck { .. } => {
                (S::Reporting(r), vec![])
            }
            E::TaskFailed { task } => self.task_failed(S::Reporting(r), task, now),
            E::Reload { policy, summary } => self.reload(S::Reporting(r), *policy, summary, now),
            E::ReloadInPlace { policy, summary } => self.reload_in_place(S::Reporting(r), *policy, summary),
            E::Upgrade(u) => self.upgrade_event(S::Reporting(r), u, now),
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
            | E::DrainRequested
            | E::UndrainRequested
            | E::RestartRequested
            | E::Quiet { .. }
            | E::OomKilled { .. }
            | E::Survivors { .. }
            | E::Tick
            | E::IdleFor { .. }
            | E::Wanted
            | E::Slept { .. }
            | E::Woke { .. }) => ignored(S::Reporting(r), event),
        }
    }

    /// The tree being stopped: signalled, killed, abandoned.
    pub(super) fn in_stopping(&mut self, stop: Stop, event: Event, now: Instant) -> (State, Vec<Effect>) {
        use Event as E;
        use State as S;
        let mut stop = stop;
        match event {
            E::ReportStarted { path, .. } => self.report_started(S::Stopping(stop), path),
            E::ChildExited { pid, exit } => {
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
            E::Tick => self.stopping_tick(stop, now),
            E::Survivors { left: 0, .. } if matches!(stop.escalation, Escalation::Abandoning { .. }) => {
                // Every process is dead, but the end of the tree was not
                // reported: its last exits are still being reaped.
                let text = "no live process of the tree is left after SIGKILL, though not every exit was seen yet: \
                            the tree is taken as gone";
                let (state, mut fx) = self.stopped(stop.purpose, stop.ready_for, now, vec![]);
                fx.insert(0, record(Severity::Warn, Topic::Kill, text.into()));
                (state, fx)
            }
            E::Survivors { description, .. } if matches!(stop.escalation, Escalation::Abandoning { .. }) => {
                self.finish(Code::Unkillable, description, vec![])
            }
            E::StopRequested => match (&stop.purpose, stop.escalation) {
                (Purpose::Shutdown | Purpose::Internal(_), Escalation::Signalled { .. }) => {
                    // Asked twice: no more patience.
                    stop.escalation = Escalation::Killed { at: now };
                    (S::Stopping(stop), vec![Effect::KillTree])
                }
                (Purpose::Shutdown | Purpose::Internal(_), _) => (S::Stopping(stop), vec![]),
                (Purpose::Failure(_) | Purpose::Reload | Purpose::Restart | Purpose::Idle(_), _) => {
                    stop.purpose = Purpose::Shutdown;
                    (S::Stopping(stop), vec![Effect::Notify(vec![Note::Stopping, status("stopping".into())])])
                }
            },
            E::TreeGone => self.stopped(stop.purpose, stop.ready_for, now, vec![]),
            // Lines after a stop was asked for never count (vLLM logs
            // EngineDeadError on every ordinary shutdown).
            E::Line { .. } => (S::Stopping(stop), vec![]),
            E::TaskFailed { task } => self.task_failed(S::Stopping(stop), task, now),
            E::Reload { policy, summary } => self.reload(S::Stopping(stop), *policy, summary, now),
            E::ReloadInPlace { policy, summary } => self.reload_in_place(S::Stopping(stop), *policy, summary),
            E::Upgrade(u) => self.upgrade_event(S::Stopping(stop), u, now),
            event @ (E::Begin
            | E::Prepared { .. }
            | E::PrepareStep { .. }
            | E::LoadKnown { .. }
            | E::Prefetched { .. }
            | E::Spawned { .. }
            | E::SpawnFailed { .. }
            | E::HttpReady { .. }
            | E::GoldenChecked { .. }
            | E::HealthFailed { .. }
            | E::RolledBack { .. }
            | E::DaemonLost { .. }
            | E::DrainRequested
            | E::UndrainRequested
            | E::RestartRequested
            | E::Quiet { .. }
            | E::GpuFault { .. }
            | E::Recheck { .. }
            | E::OomKilled { .. }
            | E::Reported { .. }
            | E::Survivors { .. }
            | E::IdleFor { .. }
            | E::Wanted
            | E::Slept { .. }
            | E::Woke { .. }) => ignored(S::Stopping(stop), event),
        }
    }

    /// A stop's deadlines: the signal again, SIGKILL, survivors described,
    /// the tree abandoned.
    fn stopping_tick(&mut self, mut stop: Stop, now: Instant) -> (State, Vec<Effect>) {
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
        (State::Stopping(stop), fx)
    }

    /// Waiting `until` to start again after a failure (`cause`).
    pub(super) fn in_backoff(
        &mut self,
        until: Instant,
        cause: Cause,
        event: Event,
        now: Instant,
    ) -> (State, Vec<Effect>) {
        use Event as E;
        let state = |cause| State::Backoff { until, cause };
        match event {
            E::Tick if now >= until => self.launch(Some(RestartReason::Failure), now),
            E::RestartRequested => {
                self.failures = 0;
                self.permanent_streak = None;
                let (next, mut fx) = self.launch(Some(RestartReason::Restart), now);
                fx.insert(0, record(Severity::Info, Topic::Stop, "restart requested".into()));
                (next, fx)
            }
            E::StopRequested => {
                self.finish(Code::Ok, "stopped on request".into(), vec![Effect::Notify(vec![Note::Stopping])])
            }
            E::ReportStarted { path, .. } => self.report_started(state(cause), path),
            E::TaskFailed { task } => self.task_failed(state(cause), task, now),
            E::Reload { policy, summary } => self.reload(state(cause), *policy, summary, now),
            E::ReloadInPlace { policy, summary } => self.reload_in_place(state(cause), *policy, summary),
            E::Upgrade(u) => self.upgrade_event(state(cause), u, now),
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
            | E::RolledBack { .. }
            | E::DaemonLost { .. }
            | E::ChildExited { .. }
            | E::TreeGone
            | E::DrainRequested
            | E::UndrainRequested
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
            | E::Woke { .. }) => ignored(state(cause), event),
        }
    }

    /// The end: only a report's folder is still taken in.
    pub(super) fn in_done(&mut self, code: Code, event: Event) -> (State, Vec<Effect>) {
        use Event as E;
        match event {
            E::ReportStarted { path, .. } => self.report_started(State::Done(code), path),
            E::TaskFailed { .. } | E::Reload { .. } | E::ReloadInPlace { .. } | E::Upgrade(_) => {
                (State::Done(code), vec![])
            }
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
            | E::RolledBack { .. }
            | E::DaemonLost { .. }
            | E::ChildExited { .. }
            | E::TreeGone
            | E::StopRequested
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
            | E::Woke { .. }) => ignored(State::Done(code), event),
        }
    }

    /// Stop a running child (`Starting` or `Ready`) for `purpose`; any other
    /// state is returned as it is.
    pub(super) fn begin_stop(
        &mut self,
        state: State,
        purpose: Purpose,
        now: Instant,
        fx: Vec<Effect>,
    ) -> (State, Vec<Effect>) {
        let (leaving, track) = match leave(state) {
            Ok(left) => left,
            Err(other) => return (*other, fx),
        };
        let (next, mut fx) = self.stop_leaving(leaving, purpose, now, fx, true);
        if let Some(track) = track {
            self.load_ended(*track, &next, now, &mut fx);
        }
        (next, fx)
    }

    /// A run has failed: write its report first, when reports are on, then
    /// stop it. `exit`: the leader has exited so.
    pub(super) fn fail(
        &mut self,
        state: State,
        mut cause: Cause,
        exit: Option<Exit>,
        now: Instant,
    ) -> (State, Vec<Effect>) {
        let Some(budget) = self.policy.report else {
            return self.begin_stop(state, Purpose::Failure(cause), now, vec![]);
        };
        let (leaving, track) = match leave(state) {
            Ok(left) => left,
            Err(other) => return (*other, vec![]),
        };
        let (run, ready_at) = (leaving.run(), leaving.ready_at());
        let since = |t: Instant| t.saturating_duration_since(run.spawned_at);
        cause.hint = self.policy.hints.find(&cause.text);
        let order = ReportOrder {
            start: run.start,
            attempt: self.attempt(),
            pid: run.pid,
            cause: cause.text.clone(),
            class: cause.class(),
            hint: cause.hint.clone(),
            first_progress: run.first_progress.map(since),
            ready: ready_at.map(since),
            failed: since(now),
            exit,
        };
        let mut fx = vec![Effect::Report(order)];
        let pid = run.pid;
        self.announce(&cause, pid, ", writing the failure report", &mut fx);
        let reporting = Reporting {
            run: Box::new(leaving),
            purpose: Purpose::Failure(cause),
            until: now + budget,
            leader: exit.is_none(),
        };
        let next = State::Reporting(reporting);
        if let Some(track) = track {
            self.load_ended(*track, &next, now, &mut fx);
        }
        (next, fx)
    }

    /// The failure of the run of child `pid`: its journal event and status
    /// line; it is the last failure. The event names the run itself: once
    /// logged, the leader may be gone (a run that exited).
    pub(super) fn announce(&mut self, c: &Cause, pid: u32, then: &str, fx: &mut Vec<Effect>) {
        self.cause = Some(c.clone());
        self.last_failure =
            Some(crate::snapshot::LastFailure { cause: c.text.clone(), class: c.class(), report: None });
        let about = RunOf { pid: Some(pid), attempt: self.attempt() };
        fx.push(record_of(Severity::Error, Topic::Failed, format!("run failed: {}", c.shown()), about));
        fx.push(Effect::Notify(vec![status(format!("failed ({}{then}): {}", self.attempts_text(), c.shown()))]));
    }

    /// The report is over (written, cut short, or out of time): stop the
    /// run for what is now the purpose.
    pub(super) fn report_done(&mut self, r: Reporting, now: Instant, fx: Vec<Effect>) -> (State, Vec<Effect>) {
        let (next, fx) = self.stop_leaving(*r.run, r.purpose, now, fx, false);
        if r.leader { (next, fx) } else { (leader_gone(next), fx) }
    }

    /// Stop the run `leaving` for `purpose`. `announce`: a failure is said
    /// here (not when its report said it).
    pub(super) fn stop_leaving(
        &mut self,
        leaving: Leaving,
        purpose: Purpose,
        now: Instant,
        mut fx: Vec<Effect>,
        announce: bool,
    ) -> (State, Vec<Effect>) {
        let pid = leaving.run().pid;
        let ready_for = leaving.ready_at().map(|t| now - t);
        let mut purpose = self.purpose_of_stop(&leaving, purpose, &mut fx);
        // Only a serving child being stopped on purpose has something to
        // drain; everything else gets the short grace, the signal repeated.
        let drain = ready_for.is_some()
            && matches!(purpose, Purpose::Shutdown | Purpose::Reload | Purpose::Restart | Purpose::Idle(_));
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
                self.announce(&c, pid, "", &mut fx);
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
            Purpose::Idle(quiet) => fx.push(Effect::Notify(vec![status(format!(
                "idle: stopping pid {pid} after {} without requests",
                secs(*quiet)
            ))])),
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
    pub(super) fn purpose_of_stop(&mut self, run: &Leaving, purpose: Purpose, fx: &mut Vec<Effect>) -> Purpose {
        match (run, purpose) {
            (
                Leaving::Serving(Serving { drain: Some(ActiveDrain { for_: DrainFor::Stop, .. }), .. }),
                Purpose::Failure(c),
            ) => {
                fx.push(record(Severity::Warn, Topic::Drain, format!("failed while draining to stop: {}", c.text)));
                self.cause = Some(c);
                Purpose::Shutdown
            }
            (_, purpose) => purpose,
        }
    }

    /// How long a stop that drains first may take, for systemd's stop
    /// timeout: the drain, the stop, and a margin.
    pub(super) fn drain_budget(&self) -> Duration {
        let p = &self.policy;
        [p.drain_delay, p.drain_timeout, p.stop_timeout, Duration::from_secs(5)]
            .into_iter()
            .fold(Duration::ZERO, Duration::saturating_add)
    }

    /// `STATUS=` while draining.
    pub(super) fn drain_text(&self, serving: &Serving, d: &ActiveDrain) -> String {
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
    pub(super) fn begin_drain(
        &mut self,
        mut serving: Serving,
        for_: DrainFor,
        now: Instant,
        mut fx: Vec<Effect>,
    ) -> (State, Vec<Effect>) {
        let d = ActiveDrain { for_, stage: DrainStage::Delay { until: now + self.policy.drain_delay }, began: now };
        let text = self.drain_text(&serving, &d);
        fx.push(record(Severity::Info, Topic::Drain, text.clone()));
        fx.push(Effect::Notify(vec![status(text)]));
        serving.drain = Some(d);
        (State::Ready(serving), fx)
    }

    /// A drain's deadlines: the delay over (look at the requests in flight),
    /// the timeout over (go on with requests still running).
    pub(super) fn drain_tick(&mut self, mut serving: Serving, now: Instant) -> (State, Vec<Effect>) {
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
    pub(super) fn drained(
        &mut self,
        mut serving: Serving,
        d: ActiveDrain,
        now: Instant,
        mut fx: Vec<Effect>,
    ) -> (State, Vec<Effect>) {
        match d.for_ {
            DrainFor::Hold => {
                let d = ActiveDrain { stage: DrainStage::Drained, ..d };
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
    pub(super) fn reload(
        &mut self,
        state: State,
        policy: Policy,
        summary: String,
        now: Instant,
    ) -> (State, Vec<Effect>) {
        if matches!(state, State::Done(_)) {
            return (state, vec![]);
        }
        self.policy = policy;
        self.failures = 0;
        self.permanent_streak = None;
        // The operator's config again: what memory fit set and the
        // rollback end here.
        self.fit = Default::default();
        self.rollback.active = None;
        let fx = vec![
            record(Severity::Info, Topic::Reload, format!("config reloaded: {summary}")),
            Effect::Fit(std::collections::BTreeMap::new()),
        ];
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
                let (next, more) = self.launch(Some(RestartReason::Reload), now);
                (next, fx.into_iter().chain(more).collect())
            }
            State::Launching { start, then: AfterPrepare::Spawn { .. }, known } => {
                let mut fx = fx;
                fx.push(Effect::CancelPrepare);
                (State::Launching { start, then: AfterPrepare::Relaunch(RestartReason::Reload), known }, fx)
            }
            // A stop is under way, or the start is already being redone.
            other => (other, vec![]),
        }
    }

    /// A part of the warden died: stop the tree the short way and exit 70.
    pub(super) fn task_failed(&mut self, state: State, why: String, now: Instant) -> (State, Vec<Effect>) {
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
            State::Idle | State::RollingBack { .. } | State::Backoff { .. } | State::Parked(_) => {
                self.finish(Code::Internal, format!("internal failure: {why}"), fx)
            }
            State::Asleep(Dormant { serving, .. }) | State::Adopted { serving, .. } => {
                self.begin_stop(State::Ready(serving), Purpose::Internal(why), now, fx)
            }
            done @ State::Done(_) => (done, vec![]),
        }
    }

    /// The tree is gone (or was never spawned): carry out what the stop was for.
    pub(super) fn stopped(
        &mut self,
        purpose: Purpose,
        ready_for: Option<Duration>,
        now: Instant,
        fx: Vec<Effect>,
    ) -> (State, Vec<Effect>) {
        match purpose {
            Purpose::Shutdown => self.finish(Code::Ok, "stopped on request".into(), fx),
            Purpose::Failure(cause) => self.after_failure(cause, ready_for, now, fx),
            Purpose::Reload => self.launch(Some(RestartReason::Reload), now),
            Purpose::Restart => self.launch(Some(RestartReason::Restart), now),
            Purpose::Internal(why) => self.finish(Code::Internal, format!("internal failure: {why}"), fx),
            Purpose::Idle(quiet) => self.parked(quiet, now, fx),
        }
    }

    pub(super) fn after_failure(
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
        if let Some(fit) = self.policy.fit.clone()
            && let Some(problem) = self.fit.problem.take()
        {
            return self.fit_after(&fit, &problem, &cause, now, fx);
        }
        if cause.permanence.is_permanent() {
            let n = match self.permanent_streak {
                Some((p, n)) if p == cause.permanence => n + 1,
                _ => 1,
            };
            self.permanent_streak = Some((cause.permanence, n));
            if n >= self.policy.restart.permanent_attempts {
                let text = format!("failed permanently ({n} of {n} tries): {}", cause.text);
                return self.give_up(Code::Config, text, &cause, fx);
            }
        } else {
            self.permanent_streak = None;
        }
        let max = self.policy.restart.max_attempts;
        if max > 0 && self.failures >= max {
            let text = format!("gave up after {max} failed starts: {}", cause.text);
            return self.give_up(Code::GaveUp, text, &cause, fx);
        }
        let base = self.policy.backoff(self.failures);
        let j = self.policy.restart.jitter * (self.rng.f64() * 2.0 - 1.0);
        let delay = Duration::from_secs_f64((base.as_secs_f64() * (1.0 + j)).max(0.0));
        let text = format!("restarting in {} ({}): {}", secs(delay), self.attempts_text(), cause.text);
        fx.push(record(Severity::Warn, Topic::Backoff, text.clone()));
        fx.push(Effect::Notify(vec![status(text), Note::ExtendTimeout(delay + self.policy.stall)]));
        if delay.is_zero() {
            let (state, more) = self.launch(Some(RestartReason::Failure), now);
            fx.extend(more);
            return (state, fx);
        }
        (State::Backoff { until: now + delay, cause }, fx)
    }

    /// A memory-fit error ended the run: start again with the argument
    /// moved, or give up saying why no move fits.
    fn fit_after(
        &mut self,
        fit: &crate::policy::Fit,
        problem: &crate::fit::Problem,
        cause: &Cause,
        now: Instant,
        mut fx: Vec<Effect>,
    ) -> (State, Vec<Effect>) {
        use crate::fit::{Move, decide};
        let refuse = |why: String| format!("failed permanently: {}; memory fit cannot help: {why}", cause.text);
        if self.fit.moves >= fit.attempts {
            let why = format!("{} adjustments in a row did not fit (`fit.attempts`)", self.fit.moves);
            fx.push(record(Severity::Error, Topic::Fit, format!("memory fit: {}; {why}", problem.text())));
            return self.give_up(Code::Config, refuse(why), cause, fx);
        }
        match decide(problem, &self.fit.used, fit) {
            Move::Refuse(why) => {
                fx.push(record(Severity::Error, Topic::Fit, format!("memory fit: {}; {why}", problem.text())));
                self.give_up(Code::Config, refuse(why), cause, fx)
            }
            Move::Set { arg, from, to, why } => {
                self.fit.moves += 1;
                self.permanent_streak = None;
                self.fit.set.insert(arg, to.clone());
                let text = format!(
                    "memory fit {}/{}: {}; restarting with {} {to} (was {from}: {why})",
                    self.fit.moves,
                    fit.attempts,
                    problem.text(),
                    arg.flag()
                );
                fx.push(record(Severity::Warn, Topic::Fit, text.clone()));
                fx.push(Effect::Notify(vec![status(text)]));
                fx.push(Effect::Fit(self.fit.set.clone()));
                let (state, more) = self.launch(Some(RestartReason::Fit), now);
                fx.extend(more);
                (state, fx)
            }
        }
    }

    /// The end of retries (`code`, `text`): the last-known-good setup
    /// instead, when `[rollback]` is on and the setup that failed is a
    /// changed one; else the end.
    pub(super) fn give_up(
        &mut self,
        code: Code,
        text: String,
        cause: &Cause,
        mut fx: Vec<Effect>,
    ) -> (State, Vec<Effect>) {
        let good = self.rollback.last_good.clone();
        let (Some((good, good_at)), true, None) = (good, self.policy.rollback, &self.rollback.active) else {
            return self.finish(code, text, fx);
        };
        let failed = self.rollback.setup.clone().unwrap_or_else(|| "unknown".into());
        let said = format!(
            "the new setup {failed} failed: {}; starting the last-known-good setup {good} from {good_at}",
            // A cause that ends a sentence, before the `;` that goes on.
            cause.text.trim_end_matches('.')
        );
        fx.push(record(Severity::Warn, Topic::Rollback, said.clone()));
        fx.push(Effect::Notify(vec![status(said)]));
        fx.push(Effect::Rollback);
        self.rollback.active = Some(crate::snapshot::RolledBack { failed, cause: cause.text.clone(), good, good_at });
        (State::RollingBack { code, text }, fx)
    }

    /// The one way the machine ends: `code`, and why in `text`.
    pub(super) fn finish(&mut self, code: Code, text: String, mut fx: Vec<Effect>) -> (State, Vec<Effect>) {
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
pub(super) fn into_run(state: &State) -> Option<(&Run, Option<Instant>)> {
    match state {
        State::Starting(l) => Some((&l.run, None)),
        State::Ready(s) => Some((&s.run, Some(s.ready_at))),
        _ => None,
    }
}

/// A loading or serving run taken out of its state to be stopped or
/// reported, and a loading run's load, which ends with it; any other state
/// as it is.
pub(super) fn leave(state: State) -> Result<(Leaving, Option<Box<LoadTrack>>), Box<State>> {
    match state {
        State::Starting(l) => Ok((Leaving::Loading(l.run), Some(l.track))),
        State::Ready(s) => Ok((Leaving::Serving(s), None)),
        other => Err(Box::new(other)),
    }
}

/// The leader has already exited: no signal to repeat.
pub(super) fn leader_gone(state: State) -> State {
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

pub(super) fn phase_of(state: &State) -> Phase {
    match state {
        State::Idle | State::RollingBack { .. } | State::Launching { .. } | State::Starting(_) => Phase::Starting,
        State::Ready(s) | State::Adopted { serving: s, .. } => match s {
            Serving { drain: None, recheck: Some(_), .. } => Phase::Rechecking,
            Serving { drain: None, .. } => Phase::Ready,
            Serving { drain: Some(ActiveDrain { stage: DrainStage::Drained, .. }), .. } => Phase::Drained,
            Serving { drain: Some(_), .. } => Phase::Draining,
        },
        State::Stopping(st) => match st.purpose {
            Purpose::Failure(_) => Phase::Failed,
            Purpose::Shutdown | Purpose::Reload | Purpose::Restart | Purpose::Internal(_) | Purpose::Idle(_) => {
                Phase::Stopping
            }
        },
        State::Parked(_) => Phase::Idle,
        State::Asleep(Dormant { stage: SleepStage::Falling | SleepStage::Asleep { .. }, .. }) => Phase::Idle,
        // A request came: the engine is becoming ready again.
        State::Asleep(_) => Phase::Starting,
        State::Reporting(_) => Phase::Failed,
        State::Backoff { .. } => Phase::Backoff,
        // Left saying why in `cause`: a stop request, or the give-up.
        State::Done(_) => Phase::Stopped,
    }
}
