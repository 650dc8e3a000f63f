//! Table tests of the pure state machine: events in, effects and states out.

use super::*;
use crate::Signal;
use crate::classify::Classifier;
use crate::control::Control;
use crate::profile::Profile;

fn policy() -> Policy {
    Policy {
        fit: None,
        rollback: false,
        ready_log: true,
        ready_http: true,
        ready_timeout: Duration::from_secs(90 * 60),
        stall: Duration::from_secs(15 * 60),
        grace: Duration::from_secs(30),
        stop_signal: Signal::SIGTERM,
        stop_timeout: Duration::from_secs(90),
        prepare_timeout: Duration::from_secs(300),
        hints: crate::hints::Hints::none(),
        report: None,
        phases: false,
        slow_factor: 1.5,
        deadline_factor: 3.0,
        golden: None,
        golden_timeout: Duration::from_secs(60),
        golden_interval: None,
        restart: crate::policy::Restart {
            initial_delay: Duration::from_secs(10),
            max_delay: Duration::from_secs(300),
            factor: 2.0,
            jitter: 0.0,
            reset_after: Duration::from_secs(600),
            max_attempts: 10,
            permanent_attempts: 2,
        },
        drain_delay: Duration::from_secs(5),
        drain_timeout: Duration::from_secs(60),
        drain_on_stop: false,
        idle: None,
    }
}

/// The test policy with other restart settings.
fn restart(change: impl FnOnce(&mut crate::policy::Restart)) -> Policy {
    let mut p = policy();
    change(&mut p.restart);
    p
}

/// A machine, a clock and a classifier, for writing scenarios as tables.
struct Sim {
    m: Machine,
    t0: Instant,
    now: Instant,
    c: Classifier,
    fx: Vec<Effect>,
}

impl Sim {
    fn new(p: Policy) -> Sim {
        let now = Instant::now();
        Sim { m: Machine::new(p, 7), t0: now, now, c: Classifier::new(&Profile::Vllm.patterns()).unwrap(), fx: vec![] }
    }
    fn at(&mut self, secs: f64) -> &mut Self {
        self.now = self.t0 + Duration::from_secs_f64(secs);
        self
    }
    fn ev(&mut self, e: Event) -> Vec<Effect> {
        let fx = self.m.step(e, self.now);
        self.fx.extend(fx.clone());
        fx
    }
    fn line(&mut self, text: &str) -> Vec<Effect> {
        let start = self.m.starts;
        let line = self.c.classify(text.to_string());
        self.ev(Event::Line { start, line })
    }
    fn tick(&mut self) -> Vec<Effect> {
        self.ev(Event::Tick)
    }
    /// Begin and spawn as pid.
    fn spawned(&mut self, pid: u32) {
        if self.m.state == State::Idle {
            assert!(self.ev(Event::Begin).contains(&Effect::Prepare { start: 1 }));
        }
        let start = self.m.starts;
        assert!(self.ev(Event::Prepared { start, result: Prepared::Done }).contains(&Effect::Spawn { start }));
        self.ev(Event::Spawned { start, pid });
        assert!(matches!(self.m.state, State::Starting(_)));
    }
    fn ready(&mut self, pid: u32) {
        if !matches!(self.m.state, State::Starting(_)) {
            self.spawned(pid);
        }
        let fx = self.line("INFO:     Application startup complete.");
        assert!(fx.contains(&Effect::Probe { start: self.m.starts }));
        let fx = self.ev(Event::HttpReady { start: self.m.starts });
        assert!(notes(&fx).contains(&Note::Ready), "{fx:?}");
    }
    fn state(&self) -> &'static str {
        self.m.phase().as_str()
    }
}

fn notes(fx: &[Effect]) -> Vec<Note> {
    fx.iter().filter_map(|e| if let Effect::Notify(n) = e { Some(n.clone()) } else { None }).flatten().collect()
}

fn statuses(fx: &[Effect]) -> Vec<String> {
    notes(fx).into_iter().filter_map(|n| if let Note::Status(s) = n { Some(s) } else { None }).collect()
}

fn backoff_until(m: &Machine) -> Option<Instant> {
    if let State::Backoff { until, .. } = m.state { Some(until) } else { None }
}

#[test]
fn ready_needs_the_line_and_then_http() {
    let mut s = Sim::new(policy());
    s.spawned(100);
    let fx = s.ev(Event::HttpReady { start: 1 });
    assert!(!notes(&fx).contains(&Note::Ready), "HTTP alone before the line is not ready");
    s.ready(100);
    assert_eq!(s.state(), "ready");
    assert!(statuses(&s.fx).iter().any(|t| t.starts_with("ready: pid 100, loaded in")));
}

#[test]
fn without_http_the_line_alone_is_ready() {
    let mut s = Sim::new(Policy { ready_http: false, ..policy() });
    s.spawned(100);
    let fx = s.line("INFO:     Application startup complete.");
    assert!(notes(&fx).contains(&Note::Ready));
    assert!(!fx.iter().any(|e| matches!(e, Effect::Probe { .. })));
}

#[test]
fn without_a_ready_line_http_alone_is_ready() {
    let mut s = Sim::new(Policy { ready_log: false, ..policy() });
    s.ev(Event::Begin);
    let fx = s.ev(Event::Spawned { start: 1, pid: 5 });
    assert!(fx.contains(&Effect::Probe { start: 1 }));
    let fx = s.ev(Event::HttpReady { start: 1 });
    assert!(notes(&fx).contains(&Note::Ready));
}

#[test]
fn progress_updates_status_and_extends_the_start_timeout() {
    let mut s = Sim::new(policy());
    s.spawned(100);
    s.at(60.0);
    let fx = s.line("Loading safetensors checkpoint shards:  45% Completed | 29/64 [01:02<01:10,  2.1s/it]");
    assert_eq!(
        notes(&fx),
        vec![
            Note::Status("loading, pid 100: Loading safetensors checkpoint shards: 29/64 (45%)".into()),
            Note::ExtendTimeout(Duration::from_secs(900)),
        ]
    );
    // The stall deadline moved with the progress.
    assert_eq!(s.m.next_deadline(), Some(s.t0 + Duration::from_secs(60 + 900)));
}

#[test]
fn a_stalled_load_fails_and_names_the_last_progress() {
    let mut s = Sim::new(policy());
    s.spawned(100);
    s.at(10.0).line("(Worker pid=9) INFO 11-29 18:11:02 [cpu_model_runner.py:68] Starting to load model /m...");
    s.at(909.0).tick();
    assert_eq!(s.state(), "starting", "not yet: 899 s without progress");
    let fx = s.at(910.0).tick();
    assert!(fx.contains(&Effect::Terminate(Signal::SIGTERM)));
    assert_eq!(
        s.m.cause.as_ref().unwrap().text,
        "no progress for 15m (ready.stall); last: Starting to load model /m..."
    );
    assert_eq!(s.m.cause.as_ref().unwrap().kind, FailureKind::Stall);
}

#[test]
fn the_hard_timeout_fails_a_load_that_keeps_moving() {
    let mut s = Sim::new(Policy { ready_timeout: Duration::from_secs(100), ..policy() });
    s.spawned(100);
    s.at(99.0).line("Loading safetensors checkpoint shards:   1% Completed | 1/64 [..]");
    let fx = s.at(100.0).tick();
    assert!(fx.contains(&Effect::Terminate(Signal::SIGTERM)));
    assert_eq!(s.m.cause.as_ref().unwrap().kind, FailureKind::Timeout);
}

#[test]
fn a_ready_child_that_exits_0_after_a_fatal_error_is_a_failure() {
    let mut s = Sim::new(policy());
    s.ready(100);
    s.at(50.0).line("(EngineCore pid=7) ERROR 11-29 18:22:57 [core.py:1063] EngineCore encountered a fatal error.");
    assert_eq!(s.state(), "ready", "the child gets its grace");
    s.at(51.0);
    s.ev(Event::ChildExited { pid: 100, exit: Exit::Code(0) });
    assert_eq!(s.state(), "failed");
    assert_eq!(s.m.cause.as_ref().unwrap().text, "EngineCore encountered a fatal error.");
    s.ev(Event::TreeGone);
    assert_eq!(s.state(), "backoff");
    assert_eq!(backoff_until(&s.m), Some(s.now + Duration::from_secs(10)));
    assert!(
        statuses(&s.fx).iter().any(|t| t == "restarting in 10s (attempt 2/10): EngineCore encountered a fatal error.")
    );
}

#[test]
fn a_ready_child_exiting_0_without_a_line_is_a_failure_too() {
    let mut s = Sim::new(policy());
    s.ready(100);
    s.ev(Event::ChildExited { pid: 100, exit: Exit::Code(0) });
    assert_eq!(s.m.cause.as_ref().unwrap().text, "exited while serving (exit code 0)");
    assert_eq!(s.m.cause.as_ref().unwrap().kind, FailureKind::Exit);
}

#[test]
fn a_transient_failure_succeeds_on_retry() {
    let mut s = Sim::new(policy());
    s.spawned(100);
    s.line("(Worker pid=9) ERROR 11-29 18:16:26 [pynccl.py:120] NCCL error: unhandled system error");
    s.ev(Event::ChildExited { pid: 100, exit: Exit::Code(1) });
    s.ev(Event::TreeGone);
    assert_eq!(s.m.cause.as_ref().unwrap().text, "NCCL error: unhandled system error");
    assert_eq!(s.m.cause.as_ref().unwrap().permanence, Permanence::Transient);
    let until = backoff_until(&s.m).unwrap();
    s.now = until - Duration::from_millis(1);
    assert!(s.tick().is_empty());
    s.now = until;
    assert!(s.tick().contains(&Effect::Prepare { start: 2 }));
    s.ready(101);
    assert_eq!(s.m.restarts, 1);
    assert_eq!(s.m.cause, None, "a ready run clears the cause");
}

#[test]
fn the_traceback_exception_line_is_the_cause() {
    let mut s = Sim::new(policy());
    s.spawned(100);
    let w = "(Worker pid=9) ERROR 11-29 18:16:26 [multiproc_executor.py:953]";
    s.line(&format!("{w} WorkerProc failed to start."));
    s.line(&format!("{w} Traceback (most recent call last):"));
    s.line(&format!("{w}   File \"x.py\", line 1, in f"));
    s.line(&format!("{w} ValueError: Failed to find a kernel that can implement the NVFP4 linear layer."));
    s.ev(Event::ChildExited { pid: 100, exit: Exit::Code(1) });
    let cause = s.m.cause.clone().unwrap();
    assert_eq!(cause.text, "ValueError: Failed to find a kernel that can implement the NVFP4 linear layer.");
    assert!(cause.permanence.is_permanent());
}

#[test]
fn a_permanent_cause_is_tried_permanent_attempts_times_then_exits_78() {
    let mut s = Sim::new(policy());
    let fail = |s: &mut Sim, pid| {
        s.spawned(pid);
        s.line("(EngineCore pid=7) ERROR 11-29 18:21:33 [core.py:1510] Traceback (most recent call last):");
        s.line("(EngineCore pid=7) ERROR 11-29 18:21:33 [core.py:1510] ValueError: No available memory for the cache blocks. Try increasing `gpu_memory_utilization`");
        s.ev(Event::ChildExited { pid, exit: Exit::Code(1) });
        s.ev(Event::TreeGone)
    };
    fail(&mut s, 100);
    assert_eq!(s.state(), "backoff");
    let until = backoff_until(&s.m).unwrap();
    s.now = until;
    s.tick();
    let fx = fail(&mut s, 101);
    assert_eq!(s.m.state, State::Done(Code::Config), "{fx:?}");
    assert!(statuses(&fx)[0].starts_with("failed permanently (2 of 2 tries): ValueError: No available memory"));
}

#[test]
fn a_fatal_line_with_a_hanging_child_is_stopped_after_the_grace() {
    let mut s = Sim::new(policy());
    s.spawned(100);
    s.at(5.0).line("(EngineCore pid=7) ERROR 11-29 18:16:28 [core.py:1510] EngineCore failed to start.");
    s.at(34.9).tick();
    assert_eq!(s.state(), "starting");
    let fx = s.at(35.0).tick();
    assert!(fx.contains(&Effect::Terminate(Signal::SIGTERM)));
    // Not ready: the signal is repeated, and SIGKILL follows after 10 s.
    assert!(s.at(36.0).tick().contains(&Effect::Terminate(Signal::SIGTERM)));
    assert!(s.at(45.0).tick().contains(&Effect::KillTree));
    s.ev(Event::ChildExited { pid: 100, exit: Exit::Signal(Signal::SIGKILL) });
    s.ev(Event::TreeGone);
    assert_eq!(s.state(), "backoff");
    assert_eq!(s.m.cause.as_ref().unwrap().text, "EngineCore failed to start.");
}

/// A ready engine that logged its death is not sent anything more (the
/// front door holds), though it is "ready" until it exits or its grace ends.
#[test]
fn a_ready_run_with_a_fatal_line_is_failing() {
    let mut s = Sim::new(policy());
    s.ready(100);
    assert!(!s.m.failing());
    s.at(50.0).line("(APIServer pid=7) ERROR 11-29 18:16:28 [core_client.py:564] Engine core proc EngineCore_DP0 died unexpectedly, shutting down client.");
    assert_eq!(s.state(), "ready");
    assert!(s.m.failing());
}

#[test]
fn a_stop_during_a_load_is_prompt() {
    let mut s = Sim::new(policy());
    s.spawned(100);
    let fx = s.at(1.0).ev(Event::StopRequested);
    assert!(notes(&fx).contains(&Note::Stopping));
    assert!(fx.contains(&Effect::Terminate(Signal::SIGTERM)));
    assert_eq!(s.m.next_deadline(), Some(s.t0 + Duration::from_secs(2)));
    assert!(s.at(2.0).tick().contains(&Effect::Terminate(Signal::SIGTERM)));
    assert!(s.at(11.0).tick().contains(&Effect::KillTree));
    // Lines after the stop request never count as fatal.
    s.line("(APIServer pid=1) ERROR 11-29 18:22:57 [async_llm.py:906] vllm.v1.engine.exceptions.EngineDeadError: x");
    s.ev(Event::ChildExited { pid: 100, exit: Exit::Signal(Signal::SIGKILL) });
    s.ev(Event::TreeGone);
    assert_eq!(s.m.done(), Some(Code::Ok));
}

#[test]
fn a_stop_while_ready_waits_the_full_stop_timeout() {
    let mut s = Sim::new(policy());
    s.ready(100);
    s.at(100.0).ev(Event::StopRequested);
    assert_eq!(s.m.next_deadline(), Some(s.t0 + Duration::from_secs(190)));
    // The leader's orphans get the stop signal as soon as it is gone.
    let fx = s.ev(Event::ChildExited { pid: 100, exit: Exit::Code(0) });
    assert!(fx.contains(&Effect::Terminate(Signal::SIGTERM)));
    s.ev(Event::TreeGone);
    assert_eq!(s.m.done(), Some(Code::Ok));
}

#[test]
fn a_second_stop_request_kills_at_once() {
    let mut s = Sim::new(policy());
    s.ready(100);
    s.ev(Event::StopRequested);
    assert_eq!(s.ev(Event::StopRequested), vec![Effect::KillTree]);
}

/// The grace after SIGKILL ended with the tree's end not reported, but no
/// live process is left (their exits are still being reaped): the tree is
/// gone, not a survivor; a restart goes on, a stop exits 0.
#[test]
fn no_live_process_after_sigkill_is_a_tree_gone_not_a_survivor() {
    for shutdown in [false, true] {
        let mut s = Sim::new(policy());
        s.ready(100);
        let fx = if shutdown {
            s.ev(Event::StopRequested)
        } else {
            s.ev(Event::Reload {
                policy: Box::new(policy()),
                summary: "restarting the child: child.env changed".into(),
            })
        };
        assert!(fx.contains(&Effect::Terminate(Signal::SIGTERM)));
        assert!(s.at(100.0).tick().contains(&Effect::KillTree));
        assert!(s.at(110.0).tick().contains(&Effect::DescribeSurvivors));
        let description = "no live process of the tree is left after SIGKILL".into();
        let fx = s.ev(Event::Survivors { left: 0, description });
        let kill = fx.iter().find_map(|e| match e {
            Effect::Log(Record { topic: Topic::Kill, message, .. }) => Some(message.clone()),
            _ => None,
        });
        assert!(kill.is_some_and(|t| t.contains("taken as gone")), "{fx:?}");
        if shutdown {
            assert_eq!(s.m.done(), Some(Code::Ok));
        } else {
            assert!(fx.contains(&Effect::Prepare { start: 2 }), "{fx:?}");
        }
    }
}

#[test]
fn a_stop_during_backoff_exits_at_once() {
    let mut s = Sim::new(policy());
    s.spawned(100);
    s.ev(Event::ChildExited { pid: 100, exit: Exit::Code(1) });
    s.ev(Event::TreeGone);
    let fx = s.ev(Event::StopRequested);
    assert_eq!(s.m.done(), Some(Code::Ok));
    assert!(notes(&fx).contains(&Note::Stopping));
}

#[test]
fn max_attempts_failed_starts_exit_75() {
    let mut s = Sim::new(restart(|r| {
        r.max_attempts = 3;
        r.initial_delay = Duration::ZERO;
    }));
    s.ev(Event::Begin);
    let mut last = vec![];
    for pid in 0..3 {
        let start = s.m.starts;
        s.ev(Event::Prepared { start, result: Prepared::Done });
        s.ev(Event::Spawned { start, pid });
        s.ev(Event::ChildExited { pid, exit: Exit::Code(1) });
        last = s.ev(Event::TreeGone);
    }
    assert_eq!(s.m.done(), Some(Code::GaveUp), "{last:?}");
    assert!(statuses(&last)[0].starts_with("gave up after 3 failed starts: exited before ready (exit code 1)"));
}

#[test]
fn zero_backoff_spawns_at_once() {
    let mut s = Sim::new(restart(|r| r.initial_delay = Duration::ZERO));
    s.spawned(100);
    s.ev(Event::ChildExited { pid: 100, exit: Exit::Code(1) });
    let fx = s.ev(Event::TreeGone);
    assert!(fx.contains(&Effect::Prepare { start: 2 }));
}

#[test]
fn backoff_grows_by_factor_and_is_capped() {
    let p = policy();
    let got: Vec<u64> = (1..=7).map(|n| p.backoff(n).as_secs()).collect();
    assert_eq!(got, vec![10, 20, 40, 80, 160, 300, 300]);
}

#[test]
fn jitter_stays_within_its_fraction_and_ready_runs_reset_the_count() {
    let mut s = Sim::new(restart(|r| r.jitter = 0.1));
    let mut seen = std::collections::BTreeSet::new();
    for pid in 0..20 {
        s.ready(pid);
        // Ready for reset-after: the failure that follows counts as the first.
        s.now += Duration::from_secs(601);
        s.ev(Event::ChildExited { pid, exit: Exit::Code(1) });
        s.ev(Event::TreeGone);
        assert_eq!(s.m.failures, 1);
        let until = backoff_until(&s.m).unwrap();
        let d = until - s.now;
        assert!(d >= Duration::from_secs(9) && d <= Duration::from_secs(11), "{d:?}");
        seen.insert(d.as_millis());
        s.now = until;
        s.tick();
    }
    assert!(seen.len() > 1, "jitter varies the delay");
}

#[test]
fn events_of_an_old_run_are_ignored() {
    let mut s = Sim::new(policy());
    s.spawned(100);
    let line = s.c.classify("INFO:     Application startup complete.".into());
    assert!(s.ev(Event::Line { start: 99, line }).is_empty());
    assert!(s.ev(Event::HttpReady { start: 99 }).is_empty());
    assert!(s.ev(Event::ChildExited { pid: 42, exit: Exit::Code(1) }).is_empty());
    assert_eq!(s.state(), "starting");
}

#[test]
fn a_command_that_cannot_be_spawned_is_permanent() {
    let mut s = Sim::new(policy());
    s.ev(Event::Begin);
    s.ev(Event::Prepared { start: 1, result: Prepared::Done });
    s.ev(Event::SpawnFailed { start: 1, failure: StartFailure::permanent("cannot start /x: No such file") });
    assert_eq!(s.state(), "backoff");
    let until = backoff_until(&s.m).unwrap();
    s.now = until;
    s.tick();
    s.ev(Event::Prepared { start: 2, result: Prepared::Done });
    let fx = s.ev(Event::SpawnFailed { start: 2, failure: StartFailure::permanent("cannot start /x: No such file") });
    assert_eq!(s.m.done(), Some(Code::Config), "{fx:?}");
}

#[test]
fn a_stop_while_launching_stops_the_child_once_spawned() {
    let mut s = Sim::new(policy());
    s.ev(Event::Begin);
    s.ev(Event::Prepared { start: 1, result: Prepared::Done });
    s.ev(Event::StopRequested);
    let fx = s.ev(Event::Spawned { start: 1, pid: 3 });
    assert!(fx.contains(&Effect::Terminate(Signal::SIGTERM)));
    s.ev(Event::TreeGone);
    assert_eq!(s.m.done(), Some(Code::Ok));
}

#[test]
fn a_stop_during_the_pre_start_steps_cancels_them_and_exits() {
    let mut s = Sim::new(policy());
    s.ev(Event::Begin);
    let fx = s.ev(Event::StopRequested);
    assert!(fx.contains(&Effect::CancelPrepare));
    let fx = s.ev(Event::Prepared { start: 1, result: Prepared::Cancelled });
    assert_eq!(s.m.done(), Some(Code::Ok), "{fx:?}");
}

#[test]
fn a_failed_pre_start_step_is_a_failed_start_with_its_cause() {
    let mut s = Sim::new(policy());
    s.ev(Event::Begin);
    let held = "port 8000 is held by pid 42 (python3 -m http.server 8000)";
    s.ev(Event::Prepared { start: 1, result: Prepared::Failed(StartFailure::transient(held)) });
    assert_eq!(s.state(), "backoff");
    assert_eq!(s.m.cause.as_ref().unwrap().text, held);
    assert!(statuses(&s.fx).iter().any(|t| t.ends_with(&format!("(attempt 2/10): {held}"))));
}

#[test]
fn a_reload_stops_the_ready_child_and_starts_again_with_the_new_policy() {
    let mut s = Sim::new(policy());
    s.spawned(100);
    s.ev(Event::ChildExited { pid: 100, exit: Exit::Code(1) });
    s.ev(Event::TreeGone);
    s.now = backoff_until(&s.m).unwrap();
    s.tick();
    s.ready(101);
    assert_eq!(s.m.failures, 1);
    let new = Policy { stall: Duration::from_secs(5), ..policy() };
    let fx = s
        .ev(Event::Reload { policy: Box::new(new.clone()), summary: "restarting the child: child.env changed".into() });
    assert!(fx.contains(&Effect::Terminate(Signal::SIGTERM)));
    assert_eq!(s.state(), "stopping");
    // A ready child drains: the full stop-timeout before SIGKILL.
    assert_eq!(s.m.next_deadline(), Some(s.now + Duration::from_secs(90)));
    s.ev(Event::ChildExited { pid: 101, exit: Exit::Code(0) });
    let fx = s.ev(Event::TreeGone);
    assert!(fx.contains(&Effect::Prepare { start: 3 }), "{fx:?}");
    assert_eq!(s.m.policy, new);
    assert_eq!(s.m.failures, 0, "a new config starts the count again");
}

/// Each start after the first is counted by why: a crash, an operator's
/// restart (ready, in backoff, while preparing), a reload, an idle wake;
/// the first start is none of them.
#[test]
fn restarts_are_counted_by_why() {
    use crate::outcome::RestartReason as R;
    let by = |s: &Sim| s.m.snapshot().restarts_by.into_iter().collect::<Vec<_>>();
    let mut s = Sim::new(idle(crate::policy::IdleAction::Stop));
    s.ready(100);
    assert_eq!((s.m.snapshot().restarts, by(&s)), (0, vec![]));
    // A crash: backoff, then a start for the failure.
    s.ev(Event::ChildExited { pid: 100, exit: Exit::Code(1) });
    s.ev(Event::TreeGone);
    s.now = backoff_until(&s.m).unwrap();
    s.tick();
    s.ready(101);
    // An operator's restart of a ready engine.
    s.ev(Event::RestartRequested);
    assert_eq!(s.state(), "draining");
    let start = s.m.starts;
    s.now += Duration::from_secs(5);
    s.tick();
    s.ev(Event::Quiet { start });
    assert_eq!(s.state(), "stopping");
    s.ev(Event::ChildExited { pid: 101, exit: Exit::Code(0) });
    s.ev(Event::TreeGone);
    assert_eq!(s.state(), "starting");
    // A restart asked while its start prepares, then one in backoff.
    s.ev(Event::RestartRequested);
    let start = s.m.starts;
    s.ev(Event::Prepared { start, result: Prepared::Done });
    s.spawned(102);
    s.ev(Event::ChildExited { pid: 102, exit: Exit::Code(1) });
    s.ev(Event::TreeGone);
    assert_eq!(s.state(), "backoff");
    s.ev(Event::RestartRequested);
    // A reload that restarts the child.
    s.ready(103);
    s.ev(Event::Reload {
        policy: Box::new(idle(crate::policy::IdleAction::Stop)),
        summary: "restarting the child: child.env changed".into(),
    });
    s.ev(Event::ChildExited { pid: 103, exit: Exit::Code(0) });
    s.ev(Event::TreeGone);
    // Idle, then woken by a request.
    s.ready(104);
    s.at(5000.0).ev(Event::IdleFor { quiet: Duration::from_secs(1800) });
    s.ev(Event::ChildExited { pid: 104, exit: Exit::Code(0) });
    s.ev(Event::TreeGone);
    assert_eq!(s.state(), "idle");
    s.ev(Event::Wanted);
    let snap = s.m.snapshot();
    assert_eq!(by(&s), vec![(R::Failure, 1), (R::Restart, 3), (R::Reload, 1), (R::Wake, 1)]);
    assert_eq!(snap.restarts, 6, "the total is their sum");
    assert_eq!(snap.starts, 7);
}

/// The counts by why, since when the run is ready and its last load go to
/// an upgrade's successor with the run; a predecessor that did not know
/// them hands over none.
#[test]
fn restarts_by_why_and_the_runs_history_survive_an_upgrade() {
    let mut s = Sim::new(policy());
    s.spawned(100);
    s.ev(Event::ChildExited { pid: 100, exit: Exit::Code(1) });
    s.ev(Event::TreeGone);
    s.now = backoff_until(&s.m).unwrap();
    s.tick();
    s.ready(101);
    s.at(500.0);
    let saved = s.m.save(s.now).unwrap();
    let next = Machine::adopt(policy(), 1, &saved, "0.1.0", s.now);
    assert_eq!(next.snapshot().restarts_by, s.m.snapshot().restarts_by);
    // What the status document shows of the run goes on: since when it is
    // ready, and the load that made it so.
    let (before, after) = (s.m.snapshot(), next.snapshot());
    assert!(before.ready_at.is_some());
    assert_eq!(after.ready_at, before.ready_at);
    assert!(before.last_load_record.is_some());
    assert_eq!(after.last_load_record, before.last_load_record);
    assert_eq!(after.golden, before.golden);
    assert_eq!(next.snapshot().restarts_by.get(&crate::outcome::RestartReason::Failure), Some(&1));
    let mut old = serde_json::to_value(&saved).unwrap();
    for field in ["restarts_by", "last_load_record", "golden"] {
        old.as_object_mut().unwrap().remove(field);
    }
    let saved: Saved = serde_json::from_value(old).unwrap();
    assert!(saved.restarts_by.is_empty() && saved.last_load_record.is_none() && saved.golden.is_none());
}

#[test]
fn a_reload_during_backoff_starts_at_once() {
    let mut s = Sim::new(policy());
    s.spawned(100);
    s.ev(Event::ChildExited { pid: 100, exit: Exit::Code(1) });
    s.ev(Event::TreeGone);
    assert_eq!(s.state(), "backoff");
    let fx =
        s.ev(Event::Reload { policy: Box::new(policy()), summary: "restarting the child: child.env changed".into() });
    assert!(fx.contains(&Effect::Prepare { start: 2 }));
}

#[test]
fn failed_health_checks_fail_a_ready_run() {
    let mut s = Sim::new(policy());
    s.ready(100);
    assert!(s.fx.contains(&Effect::Health { start: 1 }), "checks start when ready");
    let fx =
        s.ev(Event::HealthFailed { start: 1, cause: "health check failed 3 times: 503 Service Unavailable".into() });
    assert!(fx.contains(&Effect::Terminate(Signal::SIGTERM)));
    let cause = s.m.cause.clone().unwrap();
    assert_eq!(cause.kind, FailureKind::Health);
    assert_eq!(cause.text, "health check failed 3 times: 503 Service Unavailable");
    assert!(s.ev(Event::HealthFailed { start: 1, cause: "again".into() }).is_empty(), "only once");
}

/// The test policy with failure reports of a 25 s budget.
fn reporting() -> Policy {
    Policy { report: Some(Duration::from_secs(25)), ..policy() }
}

fn reports(fx: &[Effect]) -> Vec<ReportOrder> {
    fx.iter().filter_map(|e| if let Effect::Report(o) = e { Some(o.clone()) } else { None }).collect()
}

#[test]
fn a_failed_run_is_reported_before_its_stop_with_its_timings() {
    let mut s = Sim::new(reporting());
    s.spawned(100);
    s.at(2.0).line("Loading safetensors checkpoint shards:  50% Completed | 1/2");
    s.at(3.0).line("INFO:     Application startup complete.");
    s.at(3.5).ev(Event::HttpReady { start: 1 });
    assert_eq!(s.state(), "ready");
    let fx = s
        .at(10.0)
        .ev(Event::HealthFailed { start: 1, cause: "engine stalled: 1 running, 0 waiting, no token for 2m".into() });
    let order = reports(&fx).pop().expect("a report is asked for");
    assert_eq!(
        order,
        ReportOrder {
            start: 1,
            attempt: 1,
            pid: 100,
            cause: "engine stalled: 1 running, 0 waiting, no token for 2m".into(),
            class: FailureClass::Health,
            hint: None,
            first_progress: Some(Duration::from_secs(2)),
            ready: Some(Duration::from_millis(3500)),
            failed: Duration::from_secs(10),
            exit: None,
        }
    );
    assert!(!fx.iter().any(|e| matches!(e, Effect::Terminate(_))), "nothing is stopped while it is written");
    assert_eq!(s.state(), "failed");
    assert_eq!(s.m.child_pid(), Some(100));
    assert_eq!(s.m.next_deadline(), Some(s.now + Duration::from_secs(25)));
    s.ev(Event::ReportStarted { start: 1, path: "/s/reports/r".into() });
    assert_eq!(s.m.snapshot().last_failure.and_then(|f| f.report).as_deref(), Some("/s/reports/r"));
    let fx = s.at(14.0).ev(Event::Reported { start: 1 });
    assert!(fx.contains(&Effect::Terminate(Signal::SIGTERM)), "{fx:?}");
    assert_eq!(s.state(), "failed");
    s.ev(Event::ChildExited { pid: 100, exit: Exit::Code(0) });
    s.ev(Event::TreeGone);
    assert_eq!(s.state(), "backoff");
    // The last failure outlives the next ready.
    s.at(30.0).tick();
    s.ready(101);
    assert_eq!(s.m.snapshot().last_failure.map(|f| f.class), Some(FailureClass::Health));
}

/// The stop after the report names the cause with its hint, as the
/// failure's first word did.
#[test]
fn the_stop_after_a_report_keeps_the_hint() {
    let hints = crate::hints::Hints::new(Profile::Vllm, &[], Vec::new(), &[]);
    let mut s = Sim::new(Policy { hints, ..reporting() });
    s.ready(100);
    let fx = s.ev(Event::HealthFailed { start: 1, cause: "RuntimeError: Executor failed.".into() });
    assert!(statuses(&fx).iter().any(|t| t.contains("(hint: a worker process of the engine died")), "{fx:?}");
    let fx = s.ev(Event::Reported { start: 1 });
    let stopping = statuses(&fx);
    assert!(
        stopping.iter().any(|t| t.starts_with(
            "failed (attempt 1/10, stopping pid 100): RuntimeError: Executor failed. (hint: a worker process"
        )),
        "{stopping:?}"
    );
}

/// A Ray node: a fatal line, then `ray start` exits at once, during the
/// report. Every status that names the failure has its hint.
#[test]
fn every_status_of_a_failure_has_its_hint() {
    let hints = crate::hints::Hints::new(Profile::RayHead, &[], Vec::new(), &[]);
    let mut patterns = Profile::RayHead.patterns();
    patterns.ready.push("Application startup complete".into());
    let mut s = Sim::new(Policy { hints, ..reporting() });
    s.c = Classifier::new(&patterns).unwrap();
    s.ready(100);
    let mut said =
        statuses(&s.line("2026-11-30 17:46:01,465 ERR scripts.py:1304 -- Some Ray subprocesses exited unexpectedly:"));
    said.extend(statuses(&s.at(1.0).ev(Event::ChildExited { pid: 100, exit: Exit::Code(1) })));
    said.extend(statuses(&s.at(1.5).ev(Event::Reported { start: 1 })));
    said.extend(statuses(&s.at(1.6).ev(Event::TreeGone)));
    let failed: Vec<&String> =
        said.iter().filter(|t| t.starts_with("failed (") || t.starts_with("restarting")).collect();
    assert!(!failed.is_empty(), "{said:?}");
    for t in failed.iter().filter(|t| t.starts_with("failed (")) {
        assert!(t.contains("(hint: one of Ray's processes on this node died"), "{t}");
    }
}

#[test]
fn a_report_that_does_not_end_is_cut_short_at_its_budget() {
    let mut s = Sim::new(reporting());
    s.ready(100);
    s.ev(Event::HealthFailed { start: 1, cause: "x".into() });
    assert!(s.at(24.9).tick().is_empty());
    let fx = s.at(25.0).tick();
    assert!(fx.contains(&Effect::CancelReport) && fx.contains(&Effect::Terminate(Signal::SIGTERM)), "{fx:?}");
    assert!(s.ev(Event::Reported { start: 1 }).is_empty(), "a late answer changes nothing");
}

#[test]
fn a_stop_request_during_the_report_cuts_it_and_stops_at_once() {
    let mut s = Sim::new(reporting());
    s.ready(100);
    s.ev(Event::HealthFailed { start: 1, cause: "x".into() });
    let fx = s.at(1.0).ev(Event::StopRequested);
    assert!(fx.contains(&Effect::CancelReport) && fx.contains(&Effect::Terminate(Signal::SIGTERM)), "{fx:?}");
    assert!(notes(&fx).contains(&Note::Stopping));
    assert_eq!(s.state(), "stopping");
    s.ev(Event::ChildExited { pid: 100, exit: Exit::Code(0) });
    s.ev(Event::TreeGone);
    assert_eq!(s.m.done(), Some(Code::Ok));
}

#[test]
fn an_exit_while_reporting_is_kept_and_its_crash_is_not_dumped() {
    let mut s = Sim::new(reporting());
    s.spawned(100);
    let fx = s.at(5.0).ev(Event::ChildExited { pid: 100, exit: Exit::Code(1) });
    assert_eq!(reports(&fx).pop().map(|o| o.exit), Some(Some(Exit::Code(1))));
    // The leader is gone: nothing more of it is awaited.
    assert_eq!(s.m.child_pid(), None);
    let fx = s.ev(Event::Reported { start: 1 });
    assert!(fx.contains(&Effect::Terminate(Signal::SIGTERM)), "{fx:?}");
    s.ev(Event::TreeGone);
    assert_eq!(s.state(), "backoff");
}

/// A server that exited and left nothing behind has nothing to stop: the
/// next start begins beside its report, whose late answer changes nothing.
#[test]
fn a_run_with_nothing_left_starts_again_beside_its_report() {
    let mut s =
        Sim::new(Policy { report: Some(Duration::from_secs(25)), ..restart(|r| r.initial_delay = Duration::ZERO) });
    s.spawned(100);
    let fx = s.at(5.0).ev(Event::ChildExited { pid: 100, exit: Exit::Code(1) });
    assert_eq!(reports(&fx).len(), 1);
    assert_eq!(s.state(), "failed");
    let fx = s.ev(Event::TreeGone);
    assert!(!fx.iter().any(|e| matches!(e, Effect::Terminate(_) | Effect::CancelReport)), "{fx:?}");
    assert!(fx.contains(&Effect::Prepare { start: 2 }), "{fx:?}");
    assert!(s.ev(Event::Reported { start: 1 }).is_empty(), "the report of an earlier run");
    s.ev(Event::Prepared { start: 2, result: Prepared::Done });
    s.ev(Event::Spawned { start: 2, pid: 101 });
    assert_eq!(s.m.child_pid(), Some(101));
    // While the leader lives, its tree is not gone whatever comes.
    let mut s = Sim::new(reporting());
    s.ready(100);
    s.ev(Event::HealthFailed { start: 1, cause: "x".into() });
    assert!(s.ev(Event::TreeGone).is_empty());
    assert_eq!(s.state(), "failed");
}

/// A failure while draining for a stop ends in the stop, even when nothing
/// of the run is left to stop.
#[test]
fn a_failure_while_draining_to_stop_stops_even_with_nothing_left() {
    let p = Policy { drain_on_stop: true, report: Some(Duration::from_secs(25)), ..policy() };
    let mut s = Sim::new(p);
    s.ready(100);
    s.ev(Event::StopRequested);
    assert_eq!(s.state(), "draining");
    s.ev(Event::ChildExited { pid: 100, exit: Exit::Code(0) });
    assert_eq!(s.state(), "failed");
    s.ev(Event::TreeGone);
    assert_eq!(s.m.done(), Some(Code::Ok));
}

#[test]
fn without_reports_a_failure_stops_at_once() {
    let mut s = Sim::new(policy());
    s.ready(100);
    let fx = s.ev(Event::HealthFailed { start: 1, cause: "x".into() });
    assert!(reports(&fx).is_empty());
    assert!(fx.contains(&Effect::Terminate(Signal::SIGTERM)));
}

/// One machine in each state the loop can wait in, reached by real events.
fn every_waiting_state() -> Vec<(&'static str, Sim)> {
    let mut out = Vec::new();
    let fresh = || Sim::new(policy());
    out.push(("idle", fresh()));
    let mut s = fresh();
    s.ev(Event::Begin);
    out.push(("launching", s));
    let mut s = fresh();
    s.ev(Event::Begin);
    s.ev(Event::StopRequested);
    out.push(("launching, stop pending", s));
    let mut s = fresh();
    s.ev(Event::Begin);
    s.ev(Event::Reload { policy: Box::new(policy()), summary: "restarting the child: child.env changed".into() });
    out.push(("launching, relaunch pending", s));
    let mut s = fresh();
    s.spawned(100);
    out.push(("starting", s));
    let mut s = fresh();
    s.ready(100);
    out.push(("ready", s));
    let mut s = fresh();
    s.ready(100);
    s.ev(Event::StopRequested);
    out.push(("stopping, signalled", s));
    let mut s = fresh();
    s.ready(100);
    s.ev(Event::StopRequested);
    s.ev(Event::StopRequested);
    out.push(("stopping, killed", s));
    let mut s = fresh();
    s.ready(100);
    s.ev(Event::StopRequested);
    s.ev(Event::StopRequested);
    s.at(20.0).tick();
    assert!(matches!(s.m.state(), State::Stopping(Stop { escalation: Escalation::Abandoning { .. }, .. })));
    out.push(("stopping, abandoning", s));
    let mut s = fresh();
    s.spawned(100);
    s.ev(Event::ChildExited { pid: 100, exit: Exit::Code(1) });
    s.ev(Event::TreeGone);
    out.push(("backoff", s));
    let mut s = Sim::new(reporting());
    s.ready(100);
    s.ev(Event::HealthFailed { start: 1, cause: "engine stalled: 1 running, 0 waiting, no token for 2m".into() });
    assert!(matches!(s.m.state(), State::Reporting(_)));
    out.push(("reporting", s));
    out
}

/// Where the loop may wait without a deadline, and the event that cannot be
/// lost that it waits for.
fn waits_on_a_sure_event(m: &Machine) -> Option<&'static str> {
    match m.state() {
        State::Idle => Some("Begin: queued by the driver before it first waits"),
        State::Launching { then: AfterPrepare::Stop(_) | AfterPrepare::Relaunch(_), .. } => {
            Some("Prepared: sent by the backend as it cancels the steps")
        }
        State::Ready(_) => Some("ChildExited, HealthFailed: from watched tasks"),
        _ => None,
    }
}

#[test]
fn every_state_has_a_way_out() {
    for (name, s) in every_waiting_state() {
        assert!(s.m.next_deadline().is_some() || waits_on_a_sure_event(&s.m).is_some(), "{name}: no way out");
    }
}

/// With `drain.on-stop`, a reload that restarts the child drains it first,
/// then stops it for the new config.
#[test]
fn a_restarting_reload_drains_first_with_drain_on_stop() {
    let p = Policy { drain_on_stop: true, ..policy() };
    let mut s = Sim::new(p.clone());
    s.ready(100);
    let fx = s.ev(Event::Reload { policy: Box::new(p), summary: "restarting the child: child.env changed".into() });
    assert!(!fx.iter().any(|e| matches!(e, Effect::Terminate(_))), "{fx:?}");
    assert_eq!(s.state(), "draining");
    assert_eq!(s.m.next_deadline(), Some(s.now + Duration::from_secs(5)));
    s.at(5.0);
    assert!(s.tick().contains(&Effect::WatchLoad { start: 1 }));
    assert_eq!(s.m.next_deadline(), Some(s.now + Duration::from_secs(60)));
    let fx = s.ev(Event::Quiet { start: 1 });
    assert!(fx.contains(&Effect::Terminate(Signal::SIGTERM)), "{fx:?}");
    s.ev(Event::ChildExited { pid: 100, exit: Exit::Code(0) });
    assert!(s.ev(Event::TreeGone).contains(&Effect::Prepare { start: 2 }));
}

/// A stop while held drained stops at once; a quiet report of an earlier
/// drain, or outside the wait, changes nothing.
#[test]
fn a_stop_while_drained_signals_at_once_and_stray_quiet_reports_are_ignored() {
    let mut s = Sim::new(policy());
    s.ready(100);
    assert!(s.ev(Event::Quiet { start: 1 }).is_empty(), "not draining");
    s.ev(Event::DrainRequested);
    assert_eq!(s.state(), "draining");
    assert!(s.ev(Event::Quiet { start: 1 }).is_empty(), "still in the delay");
    s.at(5.0);
    s.tick();
    s.ev(Event::Quiet { start: 1 });
    assert_eq!(s.state(), "drained");
    assert_eq!(s.m.next_deadline(), None, "held until undrained or stopped");
    let fx = s.ev(Event::StopRequested);
    assert!(notes(&fx).contains(&Note::Stopping));
    assert!(fx.contains(&Effect::Terminate(Signal::SIGTERM)), "{fx:?}");
}

/// A restart asked for while not serving starts again without a drain.
#[test]
fn a_restart_in_backoff_starts_at_once_and_during_a_load_stops_it() {
    let mut s = Sim::new(policy());
    s.spawned(100);
    let fx = s.ev(Event::RestartRequested);
    assert!(fx.contains(&Effect::Terminate(Signal::SIGTERM)), "{fx:?}");
    s.ev(Event::ChildExited { pid: 100, exit: Exit::Code(0) });
    assert!(s.ev(Event::TreeGone).contains(&Effect::Prepare { start: 2 }));
    s.ev(Event::Prepared { start: 2, result: Prepared::Done });
    s.ev(Event::Spawned { start: 2, pid: 101 });
    s.ev(Event::ChildExited { pid: 101, exit: Exit::Code(1) });
    s.ev(Event::TreeGone);
    assert_eq!(s.state(), "backoff");
    assert!(s.ev(Event::RestartRequested).contains(&Effect::Prepare { start: 3 }));
    assert_eq!(s.m.failures, 0, "asked for: the failure count starts again");
}

/// A run held drained is handed to an upgrade's successor drained, which
/// holds it so; a drain that ends in a restart (or a hold still under way)
/// is not handed over: the upgrade waits for it.
#[test]
fn an_upgrade_hands_a_held_drain_over_and_waits_for_one_under_way() {
    let mut s = Sim::new(policy());
    s.ready(100);
    assert!(!s.m.save(s.now).unwrap().drained, "ready, not drained");
    s.ev(Event::DrainRequested);
    assert!(s.m.drain_under_way() && s.m.save(s.now).is_none(), "a hold still draining");
    s.at(5.0);
    s.tick();
    s.ev(Event::Quiet { start: 1 });
    assert_eq!(s.state(), "drained");
    assert!(!s.m.drain_under_way());
    let saved = s.m.save(s.now).expect("held drained: handed over");
    assert!(saved.drained);
    let mut next = Machine::adopt(policy(), 1, &saved, "0.1.0", s.now);
    assert_eq!(next.phase(), crate::outcome::Phase::Drained);
    let fx = next.step(Event::Begin, s.now);
    assert!(statuses(&fx).iter().any(|t| t.ends_with("; drained: pid 100, out of rotation")), "{fx:?}");
    // A restart asked while drained stops the child: nothing to hand over.
    s.ev(Event::RestartRequested);
    assert!(s.m.save(s.now).is_none(), "{}", s.state());

    let mut s = Sim::new(policy());
    s.ready(100);
    s.ev(Event::RestartRequested);
    assert_eq!(s.state(), "draining");
    assert!(s.m.drain_under_way() && s.m.save(s.now).is_none(), "a restart's drain is waited for");
}

/// A load's record, its phases timed by the machine's clock, and an alarm
/// from the setup's history.
mod loads {
    use super::*;
    use crate::load::{CacheOutcome, History, LoadOutcome, LoadPhase, LoadRecord, LoadStart, PhaseTime};

    fn phased() -> Policy {
        Policy { phases: true, ..policy() }
    }

    fn past(total: f64, compile: f64) -> LoadRecord {
        LoadRecord {
            fit: BTreeMap::new(),
            rollback: false,
            id: 1,
            at: String::new(),
            start: 1,
            outcome: LoadOutcome::Ready,
            total_secs: total,
            phases: vec![
                PhaseTime { phase: LoadPhase::Start, secs: 10.0 },
                PhaseTime { phase: LoadPhase::Weights, secs: 10.0 },
                PhaseTime { phase: LoadPhase::Compile, secs: compile },
                PhaseTime { phase: LoadPhase::Engine, secs: total - 20.0 - compile },
            ],
            cache: Some(CacheOutcome::Hit),
            weights_bytes: None,
            weights_secs: None,
            gbps: None,
            cold: None,
            alarms: vec![],
            fingerprint: "f".into(),
            setup: serde_json::Value::Null,
            boot: None,
            weights_id: None,
            estimates: vec![],
            residency: None,
            prefetch: None,
            efficiency: None,
        }
    }

    fn ended(fx: &[Effect]) -> Option<LoadRecord> {
        fx.iter().find_map(|e| if let Effect::LoadEnded(r) = e { Some((**r).clone()) } else { None })
    }

    fn start_with(s: &mut Sim, history: Option<History>) {
        s.ev(Event::Begin);
        s.ev(Event::Prepared { start: 1, result: Prepared::Done });
        let load =
            LoadStart { fingerprint: "f".into(), history, weights_bytes: None, cold: None, ..Default::default() };
        s.ev(Event::LoadKnown { start: 1, load: Box::new(load) });
        s.ev(Event::Spawned { start: 1, pid: 100 });
    }

    #[test]
    fn a_ready_load_is_recorded_with_its_phases_and_a_lost_cache_is_an_alarm() {
        let mut s = Sim::new(phased());
        start_with(&mut s, History::of(&[past(100.0, 40.0), past(120.0, 60.0)], "f", Duration::from_secs(3600)));
        assert_eq!(
            statuses(&s.fx).last().unwrap(),
            "loading 1/4 start · 0s of ~1m50s (last 2m00s), pid 100 (attempt 1/10)"
        );
        s.at(10.0).line("(Worker pid=1) INFO 11-29 18:09:34 [cpu_model_runner.py:68] Starting to load model /m...");
        s.at(25.0)
            .line("(Worker pid=1) INFO 11-29 18:09:34 [default_loader.py:501] Loading weights took 14.90 seconds");
        let fx = s.at(30.0).line("Loading safetensors checkpoint shards: 100% Completed | 1/1 [00:00<00:00]");
        // The weights ended at 25 s, 5 s after their median: the compile's
        // and the engine's medians after that, 1m55s.
        assert_eq!(
            statuses(&fx),
            [
                "loading 3/4 compile · 30s of ~1m55s (last 2m00s), pid 100: Loading safetensors checkpoint shards: 1/1 (100%)"
            ]
        );
        s.at(200.0).line(
            "(Worker pid=1) INFO 11-29 18:09:41 [decorators.py:743] [backbone] saved AOT compiled function to /c/model",
        );
        s.at(210.0).line("(EngineCore pid=1) INFO 11-29 18:09:44 [core.py:402] init engine (profile, create kv cache, warmup model) took 8.52 s");
        s.at(212.0).line("INFO:     Application startup complete.");
        let fx = s.at(212.5).ev(Event::HttpReady { start: 1 });
        let r = ended(&fx).expect("the load's record");
        assert_eq!(r.outcome, LoadOutcome::Ready);
        let phases: Vec<(LoadPhase, f64)> = r.phases.iter().map(|t| (t.phase, t.secs)).collect();
        assert_eq!(
            phases,
            [
                (LoadPhase::Start, 10.0),
                (LoadPhase::Weights, 15.0),
                (LoadPhase::Compile, 175.0),
                (LoadPhase::Engine, 10.0),
                (LoadPhase::Api, 2.0),
                (LoadPhase::Http, 0.5)
            ]
        );
        assert_eq!(r.cache, Some(CacheOutcome::Miss));
        let alarms: Vec<&Record> = fx
            .iter()
            .filter_map(|e| if let Effect::Log(r) = e { Some(r) } else { None })
            .filter(|r| r.topic == Topic::LoadAlarm)
            .collect();
        let texts: Vec<&str> = alarms.iter().map(|a| a.message.as_str()).collect();
        assert_eq!(texts.len(), 3, "{texts:?}");
        assert!(texts[0].starts_with("compile cache: miss where earlier loads of this setup had hit"), "{texts:?}");
        assert!(texts[1].starts_with("slow load: 3m32s against a median of 1m50s"), "{texts:?}");
        assert!(texts[2].starts_with("slow phase compile: 2m55s against a median of 50s"), "{texts:?}");
        assert!(alarms.iter().all(|a| a.severity == Severity::Warn));
        assert_eq!(Topic::LoadAlarm.message_id(), Some(LOAD_ALARM_MESSAGE_ID));
        assert_eq!(s.m.snapshot().loads_ended, 1);
        assert!(s.m.snapshot().load.is_none(), "no load under way once ready");
    }

    #[test]
    fn a_line_that_ends_a_phase_extends_the_start_timeout_as_a_progress_line_does() {
        let mut s = Sim::new(phased());
        start_with(&mut s, None);
        let fx = s.at(600.0).line(
            "(Worker pid=1) INFO 11-29 18:09:41 [decorators.py:743] [backbone] saved AOT compiled function to /c/model",
        );
        assert_eq!(notes(&fx), [Note::ExtendTimeout(Duration::from_secs(900))]);
        assert_eq!(s.m.next_deadline(), Some(s.t0 + Duration::from_secs(600 + 900)));
    }

    #[test]
    fn a_failed_or_stopped_load_is_recorded_too() {
        let mut s = Sim::new(phased());
        start_with(&mut s, None);
        s.at(5.0).line("(Worker pid=1) INFO 11-29 18:09:34 [cpu_model_runner.py:68] Starting to load model /m...");
        let fx = s.at(6.0).ev(Event::ChildExited { pid: 100, exit: Exit::Code(1) });
        let r = ended(&fx).expect("the load's record");
        assert_eq!(
            r.outcome,
            LoadOutcome::Failed { class: "exit".into(), cause: "exited before ready (exit code 1)".into() }
        );
        assert_eq!(r.total_secs, 6.0);

        let mut s = Sim::new(phased());
        start_with(&mut s, None);
        let fx = s.at(3.0).ev(Event::StopRequested);
        assert_eq!(ended(&fx).unwrap().outcome, LoadOutcome::Stopped { why: "stop".into() });
    }

    #[test]
    fn history_lengthens_the_stall_window_of_a_long_phase_and_never_shortens_it() {
        // ready.stall is 15 min; this setup's compile took 60 min, three
        // times (within ready.timeout, 90 min).
        let mut s = Sim::new(phased());
        let timeout = s.m.policy().ready_timeout;
        start_with(
            &mut s,
            History::of(&[past(4000.0, 3600.0), past(4000.0, 3600.0), past(4000.0, 3600.0)], "f", timeout),
        );
        s.at(10.0).line("(Worker pid=1) INFO 11-29 18:09:34 [cpu_model_runner.py:68] Starting to load model /m...");
        s.at(20.0).line("(Worker pid=1) INFO 11-29 18:09:34 [default_loader.py:501] Loading weights took 9.90 seconds");
        // Compile under way: 3 × 60 min of silence asked, bounded to 4 ×
        // 15 min; not 15 min.
        s.at(20.0 + 16.0 * 60.0);
        assert!(ended(&s.tick()).is_none(), "not a stall at 16 min: the ledger's compile took 60");
        s.at(20.0 + 59.0 * 60.0);
        assert!(ended(&s.tick()).is_none(), "not a stall at 59 min");
        let fx = s.at(20.0 + 3600.0).tick();
        let r = ended(&fx).expect("a stall at 4 × 15 min");
        let LoadOutcome::Failed { cause, .. } = r.outcome else { panic!("{r:?}") };
        assert!(cause.starts_with("no progress for 1h (compile phase, from the ledger)"), "{cause}");

        // One such load is not history enough: ready.stall.
        let mut s = Sim::new(phased());
        start_with(&mut s, History::of(&[past(4000.0, 3600.0)], "f", timeout));
        s.at(10.0).line("(Worker pid=1) INFO 11-29 18:09:34 [cpu_model_runner.py:68] Starting to load model /m...");
        s.at(20.0).line("(Worker pid=1) INFO 11-29 18:09:34 [default_loader.py:501] Loading weights took 9.90 seconds");
        let fx = s.at(20.0 + 15.0 * 60.0).tick();
        let LoadOutcome::Failed { cause, .. } = ended(&fx).unwrap().outcome else { panic!() };
        assert!(cause.starts_with("no progress for 15m (ready.stall)"), "{cause}");

        // Without history, ready.stall as configured.
        let mut s = Sim::new(phased());
        start_with(&mut s, None);
        let fx = s.at(15.0 * 60.0).tick();
        let LoadOutcome::Failed { cause, .. } = ended(&fx).unwrap().outcome else { panic!() };
        assert!(cause.starts_with("no progress for 15m (ready.stall)"), "{cause}");
    }
}

/// The golden check between the HTTP check and `READY=1`.
mod golden {
    use super::*;
    use crate::golden::Verdict;
    use crate::policy::GoldenPolicy;

    fn checked(on: GoldenPolicy, verdict: Verdict) -> (Sim, Vec<Effect>) {
        let mut s = Sim::new(Policy { golden: Some(on), ..policy() });
        s.spawned(100);
        s.line("INFO:     Application startup complete.");
        let fx = s.ev(Event::HttpReady { start: 1 });
        assert!(fx.contains(&Effect::Golden { start: 1 }), "{fx:?}");
        assert!(!notes(&fx).contains(&Note::Ready), "no READY=1 before the answers");
        assert_eq!(s.state(), "starting");
        let fx = s.ev(Event::GoldenChecked { start: 1, verdict });
        (s, fx)
    }

    #[test]
    fn the_check_extends_the_start_timeout_and_a_second_ready_line_does_not_start_it_again() {
        let mut s = Sim::new(Policy { golden: Some(GoldenPolicy::Warn), ready_http: false, ..policy() });
        s.spawned(100);
        let fx = s.line("INFO:     Application startup complete.");
        assert!(fx.contains(&Effect::Golden { start: 1 }), "{fx:?}");
        // ready.stall (15 min) is longer than golden.timeout (60 s) + 5 s.
        assert!(notes(&fx).contains(&Note::ExtendTimeout(Duration::from_secs(900))), "{fx:?}");
        let fx = s.line("INFO:     Application startup complete.");
        assert!(!fx.contains(&Effect::Golden { start: 1 }), "{fx:?}");
        // A golden timeout longer than the stall window sets the deadline.
        let mut s = Sim::new(Policy {
            golden: Some(GoldenPolicy::Warn),
            golden_timeout: Duration::from_secs(3600),
            ..policy()
        });
        s.spawned(100);
        s.line("INFO:     Application startup complete.");
        let fx = s.ev(Event::HttpReady { start: 1 });
        assert!(notes(&fx).contains(&Note::ExtendTimeout(Duration::from_secs(3605))), "{fx:?}");
        assert_eq!(s.m.next_deadline(), Some(s.now + Duration::from_secs(3605)));
    }

    #[test]
    fn the_same_answers_are_ready() {
        let (s, fx) = checked(GoldenPolicy::Fail, Verdict::Same { prompts: 1, ms: 40 });
        assert!(notes(&fx).contains(&Note::Ready));
        assert_eq!(s.m.snapshot().golden, Some(Verdict::Same { prompts: 1, ms: 40 }));
    }

    #[test]
    fn changed_answers_warn_or_fail_as_the_config_says() {
        let changed = || Verdict::Changed { text: "answers changed after x: y".into(), ms: 40 };
        let (_, fx) = checked(GoldenPolicy::Warn, changed());
        assert!(notes(&fx).contains(&Note::Ready));
        assert!(statuses(&fx).iter().any(|t| t.ends_with("; WARNING: answers changed after x: y")), "{fx:?}");
        assert!(
            fx.iter().any(
                |e| matches!(e, Effect::Log(r) if r.topic == Topic::GoldenMismatch && r.severity == Severity::Warn)
            )
        );

        let (s, fx) = checked(GoldenPolicy::Fail, changed());
        assert!(!notes(&fx).contains(&Note::Ready));
        let snap = s.m.snapshot();
        assert_eq!(snap.last_failure.as_ref().map(|f| f.class), Some(FailureClass::WrongAnswers));
        assert_eq!(snap.cause.as_deref(), Some("answers changed after x: y"));
    }

    #[test]
    fn a_check_that_cannot_be_made_is_one_clear_failure() {
        let failed = || Verdict::Failed { text: "/v1/completions: no choice in the answer".into() };
        let (_, fx) = checked(GoldenPolicy::Warn, failed());
        let warned = "; WARNING: golden check failed: /v1/completions: no choice in the answer";
        assert!(statuses(&fx).iter().any(|t| t.ends_with(warned)), "{fx:?}");
        let (s, fx) = checked(GoldenPolicy::Fail, failed());
        assert!(!notes(&fx).contains(&Note::Ready));
        assert_eq!(
            s.m.snapshot().cause.as_deref(),
            Some("golden check failed: /v1/completions: no choice in the answer")
        );
    }

    /// A golden store that cannot be read or written is the warden's
    /// trouble, not the model's: ready with a warning, even with "fail".
    #[test]
    fn a_store_problem_is_ready_with_a_warning_even_with_fail() {
        let text = "answers not compared: the golden references are unreadable (x: EOF while parsing)";
        let (s, fx) = checked(GoldenPolicy::Fail, Verdict::Unrecorded { text: text.into(), ms: 40 });
        assert!(notes(&fx).contains(&Note::Ready), "{fx:?}");
        assert!(statuses(&fx).iter().any(|t| t.ends_with(&format!("; WARNING: {text}"))), "{fx:?}");
        assert!(
            fx.iter().any(|e| matches!(e, Effect::Log(r) if r.topic == Topic::Golden && r.severity == Severity::Warn))
        );
        assert_eq!(s.m.snapshot().last_failure, None);
        assert_eq!(s.state(), "ready");
    }
}

/// No answer is not ready; a model without a completions API is not
/// checked; a serving model's answers are proven again out of rotation.
mod recheck {
    use super::*;
    use crate::golden::Verdict;
    use crate::policy::GoldenPolicy;

    fn same() -> Verdict {
        Verdict::Same { prompts: 1, ms: 40 }
    }

    fn no_answer() -> Verdict {
        Verdict::NoAnswer { text: "nothing within 1m (/v1/completions)".into() }
    }

    /// Ready with the golden check on (`on`), its answers the same.
    fn serving(p: Policy) -> Sim {
        let mut s = Sim::new(p);
        s.spawned(100);
        s.line("INFO:     Application startup complete.");
        s.ev(Event::HttpReady { start: 1 });
        let fx = s.ev(Event::GoldenChecked { start: 1, verdict: same() });
        assert!(notes(&fx).contains(&Note::Ready));
        assert!(s.m.serving());
        s
    }

    fn golden(on: GoldenPolicy) -> Policy {
        Policy { golden: Some(on), ..policy() }
    }

    fn logged(fx: &[Effect], topic: Topic) -> Vec<String> {
        fx.iter()
            .filter_map(|e| match e {
                Effect::Log(r) if r.topic == topic => Some(r.message.clone()),
                _ => None,
            })
            .collect()
    }

    #[test]
    fn no_answer_before_ready_is_a_failed_run_of_its_own_class_whatever_on_mismatch_says() {
        for on in [GoldenPolicy::Warn, GoldenPolicy::Fail] {
            let mut s = Sim::new(golden(on));
            s.spawned(100);
            s.line("INFO:     Application startup complete.");
            s.ev(Event::HttpReady { start: 1 });
            let fx = s.ev(Event::GoldenChecked { start: 1, verdict: no_answer() });
            assert!(!notes(&fx).contains(&Note::Ready), "{on:?}: {fx:?}");
            let snap = s.m.snapshot();
            assert_eq!(snap.last_failure.as_ref().map(|f| f.class), Some(FailureClass::NoAnswer), "{on:?}");
            assert_eq!(snap.cause.as_deref(), Some("golden check: no answer: nothing within 1m (/v1/completions)"));
            assert_eq!(s.m.cause().unwrap().permanence, Permanence::Transient, "a retry may answer");
            s.ev(Event::TreeGone);
            assert_eq!(s.state(), "backoff", "{on:?}");
            assert_eq!(s.m.snapshot().failures.get(&FailureClass::NoAnswer), Some(&1));
        }
    }

    #[test]
    fn a_model_without_completions_is_ready_the_check_skipped_and_said() {
        let mut s = Sim::new(golden(GoldenPolicy::Fail));
        s.spawned(100);
        s.line("INFO:     Application startup complete.");
        s.ev(Event::HttpReady { start: 1 });
        let text = "/v1/completions: HTTP 404: {\"detail\":\"Not Found\"}";
        let fx = s.ev(Event::GoldenChecked { start: 1, verdict: Verdict::Skipped { text: text.into() } });
        assert!(notes(&fx).contains(&Note::Ready), "{fx:?}");
        let said = statuses(&fx);
        assert!(
            said.iter().any(|t| t.contains("; golden check skipped: the model has no completions API")),
            "{said:?}"
        );
        assert!(!said.iter().any(|t| t.contains("WARNING")), "{said:?}");
        assert!(fx.contains(&Effect::SetupGood), "not a warning: the setup is good");
        assert_eq!(s.m.snapshot().golden.map(|v| v.name()), Some("skipped"));
        // Nothing to ask again: it stays in rotation.
        let fx = s.ev(Event::Recheck { reason: "Xid 31".into() });
        assert!(!fx.contains(&Effect::Golden { start: 1 }), "{fx:?}");
        assert!(s.m.serving());
    }

    #[test]
    fn a_recheck_takes_the_model_out_of_rotation_and_the_same_answers_put_it_back() {
        let mut s = serving(golden(GoldenPolicy::Warn));
        s.at(100.0);
        let reason = "GPU fault: Xid 31 (GPU memory page fault) on 0000:41:00.0";
        let fx = s.ev(Event::Recheck { reason: reason.into() });
        assert!(fx.contains(&Effect::Golden { start: 1 }), "{fx:?}");
        assert_eq!(s.m.phase(), Phase::Rechecking);
        assert!(!s.m.serving() && !s.m.phase().serving());
        assert_eq!(s.m.recheck_reason(), Some(reason));
        assert_eq!(s.m.snapshot().rechecking.as_deref(), Some(reason));
        assert!(statuses(&fx).iter().any(|t| t.starts_with("rechecking pid 100: out of rotation")), "{fx:?}");
        // Its own deadline: the check's timeout and a margin.
        assert_eq!(s.m.next_deadline(), Some(s.now + Duration::from_secs(65)));
        // Another reason meanwhile: asked again once this one is over.
        assert!(s.ev(Event::Recheck { reason: "golden.interval".into() }).is_empty());

        s.at(101.5);
        let fx = s.ev(Event::GoldenChecked { start: 1, verdict: same() });
        let said = logged(&fx, Topic::Golden);
        assert!(said[0].starts_with(&format!("re-checked after {reason}: answers as recorded")), "{said:?}");
        assert!(said[0].ends_with("; back in rotation after 1.5 s out of it"), "{said:?}");
        assert!(fx.contains(&Effect::Golden { start: 1 }), "the second reason: {fx:?}");
        assert_eq!(s.m.phase(), Phase::Rechecking);
        s.at(102.0);
        s.ev(Event::GoldenChecked { start: 1, verdict: same() });
        assert!(s.m.serving());
        let snap = s.m.snapshot();
        assert_eq!((snap.rechecks, snap.recheck_paused), (2, Duration::from_secs(2)));
        assert_eq!(snap.golden_checks, 3);
        assert_eq!(s.m.next_deadline(), None, "no golden.interval");
    }

    #[test]
    fn different_answers_or_none_at_a_recheck_fail_the_run() {
        let changed =
            Verdict::Changed { text: "answers changed with the same setup: prompt \"p\", token 1".into(), ms: 1 };
        for (verdict, class) in [(changed, FailureClass::WrongAnswers), (no_answer(), FailureClass::NoAnswer)] {
            // Even with "warn": the setup is the one that was proven ready.
            let mut s = serving(golden(GoldenPolicy::Warn));
            s.ev(Event::Recheck { reason: "Xid 31".into() });
            let fx = s.ev(Event::GoldenChecked { start: 1, verdict });
            assert!(fx.contains(&Effect::Terminate(Signal::SIGTERM)), "{fx:?}");
            let snap = s.m.snapshot();
            assert_eq!(snap.last_failure.as_ref().map(|f| f.class), Some(class));
            assert!(snap.cause.as_deref().unwrap().starts_with("re-checked after Xid 31: "), "{snap:?}");
            s.ev(Event::ChildExited { pid: 100, exit: Exit::Signal(Signal::SIGTERM) });
            s.ev(Event::TreeGone);
            assert_eq!(s.state(), "backoff");
        }
        // No answer at all by the check's own deadline.
        let mut s = serving(golden(GoldenPolicy::Warn));
        s.ev(Event::Recheck { reason: "Xid 13".into() });
        s.at(64.0);
        assert!(s.tick().is_empty());
        s.at(65.0);
        s.tick();
        assert_eq!(s.m.snapshot().last_failure.map(|f| f.class), Some(FailureClass::NoAnswer));
    }

    #[test]
    fn a_run_ready_with_changed_answers_and_a_warning_is_not_failed_by_the_same_difference() {
        let mut s = Sim::new(golden(GoldenPolicy::Warn));
        s.spawned(100);
        s.line("INFO:     Application startup complete.");
        s.ev(Event::HttpReady { start: 1 });
        let changed = || Verdict::Changed { text: "answers changed after x: y".into(), ms: 1 };
        s.ev(Event::GoldenChecked { start: 1, verdict: changed() });
        s.ev(Event::Recheck { reason: "golden.interval".into() });
        let fx = s.ev(Event::GoldenChecked { start: 1, verdict: changed() });
        assert!(s.m.serving(), "{fx:?}");
        assert!(statuses(&fx).iter().any(|t| t.contains("; WARNING: re-checked after golden.interval")), "{fx:?}");
    }

    #[test]
    fn golden_interval_rechecks_on_time_and_not_while_drained() {
        let mut s = serving(Policy { golden_interval: Some(Duration::from_secs(600)), ..golden(GoldenPolicy::Warn) });
        assert_eq!(s.m.next_deadline(), Some(s.t0 + Duration::from_secs(600)));
        s.at(599.0);
        assert!(s.tick().is_empty());
        s.at(600.0);
        let fx = s.tick();
        assert!(fx.contains(&Effect::Golden { start: 1 }), "{fx:?}");
        assert_eq!(s.m.recheck_reason(), Some("golden.interval"));
        s.at(601.0);
        s.ev(Event::GoldenChecked { start: 1, verdict: same() });
        assert_eq!(s.m.next_deadline(), Some(s.now + Duration::from_secs(600)), "counted from the last");
        s.ev(Event::DrainRequested);
        s.at(1300.0);
        s.tick();
        s.tick();
        assert!(!s.fx[s.fx.len() - 3..].contains(&Effect::Golden { start: 1 }));
        assert_eq!(s.m.recheck_reason(), None, "not while held out of rotation");
    }

    #[test]
    fn a_warden_that_took_over_a_ready_run_proves_its_answers_first() {
        let s = serving(golden(GoldenPolicy::Warn));
        let saved = s.m.save(s.now).unwrap();
        let mut next = Machine::adopt(golden(GoldenPolicy::Warn), 1, &saved, "0.1.0", s.now);
        let fx = next.step(Event::Begin, s.now);
        assert!(fx.contains(&Effect::Health { start: 1 }) && fx.contains(&Effect::Golden { start: 1 }), "{fx:?}");
        let reason = format!("the warden upgraded from 0.1.0 to {}", env!("CARGO_PKG_VERSION"));
        assert_eq!(next.recheck_reason(), Some(reason.as_str()));
        assert!(!next.serving());
        // Without the golden check, nothing to prove.
        let mut next = Machine::adopt(policy(), 1, &saved, "0.1.0", s.now);
        let fx = next.step(Event::Begin, s.now);
        assert!(!fx.contains(&Effect::Golden { start: 1 }) && next.serving(), "{fx:?}");
    }

    #[test]
    fn without_the_golden_check_a_recheck_is_a_warning_and_the_model_stays_in_rotation() {
        let mut s = Sim::new(policy());
        s.ready(100);
        let fx = s.ev(Event::Recheck { reason: "GPU fault: Xid 31".into() });
        assert_eq!(
            logged(&fx, Topic::Golden),
            ["GPU fault: Xid 31: the answers are not checked again (golden.enabled is off)"]
        );
        assert!(s.m.serving());
    }

    /// The OOM killer's note is the run's cause, whatever the log says
    /// after it.
    #[test]
    fn an_oom_kill_names_the_cause_of_the_run() {
        let mut s = Sim::new(policy());
        s.ready(100);
        let oom = "killed by the kernel's OOM killer (host memory): process 101 (python3)";
        let fx = s.ev(Event::OomKilled { start: 1, cause: oom.into() });
        assert_eq!(logged(&fx, Topic::Fatal), [oom]);
        s.line("ERROR 11-29 18:11:02 [core.py:1] EngineCore encountered a fatal error.");
        s.ev(Event::ChildExited { pid: 100, exit: Exit::Code(1) });
        assert_eq!(s.m.snapshot().cause.as_deref(), Some(oom));
        s.ev(Event::TreeGone);
        assert_eq!(s.state(), "backoff", "transient: restarted");
    }
}

/// Memory fit: each of vLLM's memory-fit errors moves its argument, within
/// the bounds and the number of adjustments; a fitted value that reaches
/// ready is pinned; a reload drops what was fitted.
mod fit {
    use super::*;
    use crate::fit::Source;
    use crate::load::LoadStart;
    use crate::policy::{Fit, FitArg};

    const KV: &str = "(EngineCore pid=7) ERROR 12-02 12:26:28 [core.py:1510] ValueError: To serve at least one request with the model's max seq len (1500000), (1.43 GiB KV cache is needed, which is larger than the available KV cache memory (1.0 GiB). Based on the available memory, the estimated maximum model length is 1048448. Try increasing `gpu_memory_utilization`";
    const NO_CACHE: &str = "(EngineCore pid=7) ERROR 11-29 18:21:33 [core.py:1510] ValueError: No available memory for the cache blocks. Try increasing `gpu_memory_utilization`";

    fn fitting() -> Policy {
        Policy { fit: Some(Fit { enabled: true, attempts: 2, ..Fit::default() }), ..policy() }
    }

    /// Spawn with the values the backend found (`used`), then fail with `line`.
    fn fail_with(s: &mut Sim, pid: u32, used: &[(FitArg, &str, Source)], line: &str) -> Vec<Effect> {
        if s.m.state == State::Idle {
            s.ev(Event::Begin);
        }
        let start = s.m.starts;
        s.ev(Event::Prepared { start, result: Prepared::Done });
        let used = used.iter().map(|(a, v, src)| (*a, (v.to_string(), *src))).collect();
        let load = LoadStart { fingerprint: "00000000000000aa".into(), used, ..Default::default() };
        s.ev(Event::LoadKnown { start, load: Box::new(load) });
        s.ev(Event::Spawned { start, pid });
        s.line(line);
        s.ev(Event::ChildExited { pid, exit: Exit::Code(1) });
        s.ev(Event::TreeGone)
    }

    fn fit_set(fx: &[Effect]) -> Option<BTreeMap<FitArg, String>> {
        fx.iter().find_map(|e| if let Effect::Fit(m) = e { Some(m.clone()) } else { None })
    }

    #[test]
    fn a_kv_cache_too_small_restarts_at_once_with_the_estimate_and_pins_it_at_ready() {
        let mut s = Sim::new(fitting());
        let fx = fail_with(&mut s, 100, &[(FitArg::MaxModelLen, "1500000", Source::Config)], KV);
        assert_eq!(fit_set(&fx), Some(BTreeMap::from([(FitArg::MaxModelLen, "1047552".to_string())])));
        assert!(fx.contains(&Effect::Prepare { start: 2 }), "no backoff: {fx:?}");
        let by = s.m.snapshot().restarts_by;
        assert_eq!(by, BTreeMap::from([(crate::outcome::RestartReason::Fit, 1)]), "a move, not a retry");
        let said: Vec<&Record> =
            fx.iter().filter_map(|e| if let Effect::Log(r) = e { Some(r) } else { None }).collect();
        let fit = said.iter().find(|r| r.topic == Topic::Fit).unwrap();
        assert_eq!(
            fit.message,
            "memory fit 1/2: the KV cache cannot hold one request of 1500000 tokens (vLLM estimates 1048448 fit); restarting with --max-model-len 1047552 (was 1500000: vLLM estimates 1048448 tokens fit, rounded down to a multiple of 1024)"
        );
        assert_eq!(Topic::Fit.message_id(), Some(crate::events::FIT_MESSAGE_ID));
        // The backend sets it; the start reports it as fitted.
        let used = BTreeMap::from([(FitArg::MaxModelLen, ("1047552".to_string(), Source::Fitted))]);
        let load = LoadStart { fingerprint: "00000000000000aa".into(), used, ..Default::default() };
        s.ev(Event::Prepared { start: 2, result: Prepared::Done });
        s.ev(Event::LoadKnown { start: 2, load: Box::new(load) });
        s.ev(Event::Spawned { start: 2, pid: 101 });
        assert_eq!(s.m.snapshot().fit_moves, 1);
        s.line("INFO:     Application startup complete.");
        let fx = s.ev(Event::HttpReady { start: 2 });
        assert!(fx.contains(&Effect::Pin(BTreeMap::from([(FitArg::MaxModelLen, "1047552".to_string())]))), "{fx:?}");
        assert!(statuses(&fx).iter().any(|t| t.ends_with("; --max-model-len 1047552 (fitted)")), "{fx:?}");
        assert_eq!(s.m.snapshot().fit_moves, 0);
    }

    #[test]
    fn no_cache_memory_raises_the_utilization_and_the_attempts_are_bounded() {
        let mut s = Sim::new(fitting());
        let fx = fail_with(&mut s, 100, &[(FitArg::GpuMemoryUtilization, "0.9", Source::Config)], NO_CACHE);
        assert_eq!(fit_set(&fx).unwrap()[&FitArg::GpuMemoryUtilization], "0.92");
        let fx = fail_with(&mut s, 101, &[(FitArg::GpuMemoryUtilization, "0.92", Source::Fitted)], NO_CACHE);
        assert_eq!(fit_set(&fx).unwrap()[&FitArg::GpuMemoryUtilization], "0.94");
        // fit.attempts = 2: the third failure ends the warden, saying so.
        let fx = fail_with(&mut s, 102, &[(FitArg::GpuMemoryUtilization, "0.94", Source::Fitted)], NO_CACHE);
        assert_eq!(s.m.state, State::Done(Code::Config), "{fx:?}");
        assert!(statuses(&fx)[0].contains("memory fit cannot help: 2 adjustments in a row did not fit"), "{fx:?}");
    }

    #[test]
    fn a_move_past_a_bound_ends_at_once_and_without_fit_nothing_moves() {
        let mut s = Sim::new(fitting());
        let fx = fail_with(&mut s, 100, &[(FitArg::GpuMemoryUtilization, "0.95", Source::Config)], NO_CACHE);
        assert_eq!(s.m.state, State::Done(Code::Config));
        assert!(statuses(&fx)[0].contains("is at `fit.max-utilization` 0.95"), "{fx:?}");
        assert_eq!(fit_set(&fx), None);
        // Off: the permanent cause is retried as before.
        let mut s = Sim::new(policy());
        let fx = fail_with(&mut s, 100, &[(FitArg::MaxModelLen, "1500000", Source::Config)], KV);
        assert_eq!(s.state(), "backoff");
        assert_eq!(fit_set(&fx), None);
    }

    #[test]
    fn a_start_with_pinned_values_that_fails_drops_its_pins_and_says_so() {
        let mut s = Sim::new(fitting());
        s.ev(Event::Begin);
        s.ev(Event::Prepared { start: 1, result: Prepared::Done });
        let used = BTreeMap::from([
            (FitArg::MaxModelLen, ("69632".to_string(), Source::Pinned)),
            (FitArg::GpuMemoryUtilization, ("0.9".to_string(), Source::Default)),
        ]);
        let load = LoadStart { fingerprint: "00000000000000aa".into(), used, ..Default::default() };
        s.ev(Event::LoadKnown { start: 1, load: Box::new(load) });
        s.ev(Event::Spawned { start: 1, pid: 100 });
        let fx = s.ev(Event::ChildExited { pid: 100, exit: Exit::Code(1) });
        let pinned = BTreeMap::from([(FitArg::MaxModelLen, "69632".to_string())]);
        assert!(fx.contains(&Effect::Unpin(pinned)), "{fx:?}");
        let said = fx
            .iter()
            .find_map(|e| match e {
                Effect::Log(r) if r.topic == Topic::Fit => Some(r.clone()),
                _ => None,
            })
            .unwrap();
        assert_eq!(said.severity, Severity::Warn);
        assert_eq!(
            said.message,
            "memory fit: the start with the pinned --max-model-len 69632 failed; the pin is dropped for setup 00000000000000aa"
        );
        // A start stopped before ready proves nothing either way: kept.
        let mut s = Sim::new(fitting());
        s.ev(Event::Begin);
        s.ev(Event::Prepared { start: 1, result: Prepared::Done });
        let used = BTreeMap::from([(FitArg::MaxModelLen, ("69632".to_string(), Source::Pinned))]);
        let load = LoadStart { fingerprint: "00000000000000aa".into(), used, ..Default::default() };
        s.ev(Event::LoadKnown { start: 1, load: Box::new(load) });
        s.ev(Event::Spawned { start: 1, pid: 100 });
        let fx = s.ev(Event::StopRequested);
        assert!(!fx.iter().any(|e| matches!(e, Effect::Unpin(_))), "{fx:?}");
    }

    #[test]
    fn a_reload_drops_what_was_fitted() {
        let mut s = Sim::new(fitting());
        fail_with(&mut s, 100, &[(FitArg::MaxModelLen, "1500000", Source::Config)], KV);
        let fx = s.ev(Event::Reload { policy: Box::new(fitting()), summary: "child.command".into() });
        assert_eq!(fit_set(&fx), Some(BTreeMap::new()), "{fx:?}");
    }
}

/// Last-known-good rollback: a changed setup that fails permanently is
/// replaced by the last good one, once, and said everywhere.
mod rollback {
    use super::*;
    use crate::load::LoadStart;

    const BAD: &str = "(APIServer pid=7) ERROR 12-02 12:00:00 [x.py:1] ValueError: Failed to find a kernel that can implement the NVFP4 linear layer.";

    fn fail_as(s: &mut Sim, pid: u32, fp: &str, last_good: Option<(&str, &str)>) -> Vec<Effect> {
        if s.m.state == State::Idle {
            s.ev(Event::Begin);
        }
        let start = s.m.starts;
        s.ev(Event::Prepared { start, result: Prepared::Done });
        let last_good = last_good.map(|(a, b)| (a.to_string(), b.to_string()));
        let load = LoadStart { fingerprint: fp.into(), last_good, ..Default::default() };
        s.ev(Event::LoadKnown { start, load: Box::new(load) });
        s.ev(Event::Spawned { start, pid });
        s.line(BAD);
        s.ev(Event::ChildExited { pid, exit: Exit::Code(1) });
        s.ev(Event::TreeGone)
    }

    fn one_try(rollback: bool) -> Policy {
        Policy { rollback, ..restart(|r| r.permanent_attempts = 1) }
    }

    #[test]
    fn a_changed_setup_that_fails_permanently_starts_the_last_known_good_and_says_so() {
        let mut s = Sim::new(one_try(true));
        let good = ("00000000000000bb", "2026-12-02T10:00:00Z");
        let fx = fail_as(&mut s, 100, "00000000000000aa", Some(good));
        assert!(fx.contains(&Effect::Rollback), "{fx:?}");
        assert!(statuses(&fx).iter().any(|t| t.starts_with(
            "the new setup 00000000000000aa failed: ValueError: Failed to find a kernel that can implement the NVFP4 linear layer; starting the last-known-good setup 00000000000000bb from 2026-12-02T10:00:00Z"
        )), "{fx:?}");
        assert_eq!(s.m.done(), None);
        let fx = s.ev(Event::RolledBack { policy: Ok(Box::new(one_try(true))) });
        assert!(fx.contains(&Effect::Prepare { start: 2 }), "{fx:?}");
        let by = s.m.snapshot().restarts_by;
        assert_eq!(by, BTreeMap::from([(crate::outcome::RestartReason::Rollback, 1)]), "not a retry of the failure");
        // The good setup's own start.
        s.ev(Event::Prepared { start: 2, result: Prepared::Done });
        let load = LoadStart { fingerprint: good.0.into(), ..Default::default() };
        s.ev(Event::LoadKnown { start: 2, load: Box::new(load) });
        s.ev(Event::Spawned { start: 2, pid: 101 });
        s.line("INFO:     Application startup complete.");
        let fx = s.ev(Event::HttpReady { start: 2 });
        assert!(notes(&fx).contains(&Note::Ready));
        assert!(
            statuses(&fx).iter().any(|t| t
                .starts_with("serving last-known-good from 2026-12-02T10:00:00Z; the new setup failed: ValueError")),
            "{fx:?}"
        );
        let snap = s.m.snapshot();
        let r = snap.rolled_back.unwrap();
        assert_eq!((r.failed.as_str(), r.good.as_str()), ("00000000000000aa", good.0));
        // The operator's config again: the rollback is over.
        s.ev(Event::Reload { policy: Box::new(one_try(true)), summary: "child.command".into() });
        assert_eq!(s.m.snapshot().rolled_back, None);
    }

    /// The give-up held for the rollback is a state of its own: it waits
    /// for `RolledBack` (no deadline: the driver sends it as it carries out
    /// the rollback), a stop ends it at once, and a `RolledBack` with no
    /// give-up held starts nothing.
    #[test]
    fn a_give_up_held_for_its_rollback_is_a_state_that_a_stop_ends() {
        let mut s = Sim::new(one_try(true));
        let good = ("00000000000000bb", "2026-12-02T10:00:00Z");
        fail_as(&mut s, 100, "00000000000000aa", Some(good));
        assert!(matches!(s.m.state(), State::RollingBack { code: Code::Config, .. }), "{:?}", s.m.state());
        assert_eq!((s.m.next_deadline(), s.state()), (None, "starting"));
        s.ev(Event::StopRequested);
        assert_eq!(s.m.done(), Some(Code::Ok));
        let mut s = Sim::new(one_try(true));
        assert!(s.ev(Event::RolledBack { policy: Ok(Box::new(one_try(true))) }).is_empty());
        assert_eq!(s.m.state(), &State::Idle);
    }

    #[test]
    fn the_last_known_good_failing_too_ends_the_warden_and_off_nothing_rolls_back() {
        let mut s = Sim::new(one_try(true));
        let good = ("00000000000000bb", "2026-12-02T10:00:00Z");
        fail_as(&mut s, 100, "00000000000000aa", Some(good));
        s.ev(Event::RolledBack { policy: Ok(Box::new(one_try(true))) });
        let fx = fail_as(&mut s, 101, good.0, None);
        assert_eq!(s.m.done(), Some(Code::Config), "{fx:?}");
        assert!(!fx.contains(&Effect::Rollback));
        // A rollback that cannot be made ends the warden as without it.
        let mut s = Sim::new(one_try(true));
        fail_as(&mut s, 100, "00000000000000aa", Some(good));
        let fx = s.ev(Event::RolledBack { policy: Err("its record is gone".into()) });
        assert_eq!(s.m.done(), Some(Code::Config));
        assert!(
            statuses(&fx)[0].ends_with("the last-known-good setup cannot be started: its record is gone"),
            "{fx:?}"
        );
        // Off: exit 78 as before.
        let mut s = Sim::new(one_try(false));
        let fx = fail_as(&mut s, 100, "00000000000000aa", Some(good));
        assert_eq!(s.m.done(), Some(Code::Config));
        assert!(!fx.contains(&Effect::Rollback));
        // The good setup itself failing has nothing to roll back to.
        let mut s = Sim::new(one_try(true));
        fail_as(&mut s, 100, good.0, None);
        assert_eq!(s.m.done(), Some(Code::Config));
    }

    #[test]
    fn a_good_ready_records_the_setup() {
        let mut s = Sim::new(policy());
        s.ready(100);
        assert!(s.fx.contains(&Effect::SetupGood));
    }
}

/// `[preload]`: the weight-cache daemon's end fails the engine's run,
/// starting or serving, as a failed check does; between runs it changes
/// nothing (the next start begins with a new daemon).
#[test]
fn the_weight_cache_daemons_end_fails_the_engines_run() {
    let mut s = Sim::new(policy());
    s.ready(100);
    let lost = "the weight-cache daemon (pid 90) ended (killed by SIGKILL)";
    let fx = s.ev(Event::DaemonLost { cause: lost.into() });
    assert!(fx.contains(&Effect::Terminate(Signal::SIGTERM)), "{fx:?}");
    assert_eq!(s.m.cause.clone().unwrap().text, lost);

    let mut s = Sim::new(policy());
    s.spawned(100);
    let fx = s.ev(Event::DaemonLost { cause: lost.into() });
    assert!(fx.contains(&Effect::Terminate(Signal::SIGTERM)), "while starting too: {fx:?}");
    s.ev(Event::ChildExited { pid: 100, exit: Exit::Signal(Signal::SIGTERM) });
    s.ev(Event::TreeGone);
    assert_eq!(s.state(), "backoff");
    assert!(s.ev(Event::DaemonLost { cause: lost.into() }).is_empty(), "nothing to fail in backoff");
}

/// A platform vLLM refuses (the weight-cache daemon's CUDA IPC check)
/// ends the warden at once, whatever `permanent-attempts` says.
#[test]
fn an_unsupported_platform_ends_at_once() {
    let mut s = Sim::new(policy());
    s.ev(Event::Begin);
    let failure = StartFailure::unsupported("UnsupportedPlatformForIPCError: platform 'cpu'");
    let fx = s.ev(Event::Prepared { start: 1, result: Prepared::Failed(failure) });
    assert_eq!(s.m.done(), Some(Code::Config), "{fx:?}");
    assert!(!fx.iter().any(|e| matches!(e, Effect::Spawn { .. })));
    assert!(
        statuses(&fx).iter().any(|t| t.starts_with("failed permanently: UnsupportedPlatformForIPCError")),
        "{fx:?}"
    );
}

/// A pre-start step (the weight-cache daemon's progress among them)
/// extends the start timeout by the stall window, as a progress line does.
#[test]
fn a_pre_start_step_extends_the_start_timeout() {
    let mut s = Sim::new(policy());
    s.ev(Event::Begin);
    let text = "weight-cache daemon (pid 90): Weight cache target daemon rank 0 loaded model".to_string();
    let fx = s.ev(Event::PrepareStep { start: 1, text: text.clone() });
    assert_eq!(notes(&fx), vec![Note::Status(text), Note::ExtendTimeout(Duration::from_secs(15 * 60))]);
}

/// The `failed` journal events: each names the run that failed, its pid
/// and its attempt, though the leader is gone by the time it is logged
/// (a run that exited while serving) or the failure already counted (a
/// start that failed); with and without a report.
#[test]
fn a_failure_event_names_the_pid_and_attempt_that_failed() {
    fn failed(fx: &[Effect]) -> Vec<Option<RunOf>> {
        fx.iter()
            .filter_map(|e| if let Effect::Log(r) = e { Some(r) } else { None })
            .filter(|r| r.topic == Topic::Failed)
            .map(|r| r.about)
            .collect()
    }
    let run = |pid, attempt| Some(RunOf { pid: Some(pid), attempt });
    for p in [policy(), reporting()] {
        let reports = p.report.is_some();
        let mut s = Sim::new(p);
        s.ready(100);
        let fx = s.at(1.0).ev(Event::ChildExited { pid: 100, exit: Exit::Signal(Signal::SIGKILL) });
        assert_eq!(failed(&fx), [run(100, 1)], "reports {reports}");
        assert_eq!(s.m.child_pid(), None, "the machine's own view has no child left");
        if reports {
            s.ev(Event::Reported { start: 1 });
        }
        s.ev(Event::TreeGone);
        assert_eq!(s.state(), "backoff");
        assert_eq!(s.m.attempt(), 2);
        s.at(100.0).tick();
        s.ready(101);
        let fx = s.at(101.0).ev(Event::ChildExited { pid: 101, exit: Exit::Code(1) });
        assert_eq!(failed(&fx), [run(101, 2)], "reports {reports}");
    }
    // A start that never spawned: no pid, and the attempt that failed,
    // though the failure has counted by the time the event is logged.
    let mut s = Sim::new(policy());
    s.ev(Event::Begin);
    s.ev(Event::Prepared { start: 1, result: Prepared::Done });
    let fx = s.ev(Event::SpawnFailed { start: 1, failure: StartFailure::transient("cannot start /x: busy") });
    assert_eq!(failed(&fx), [Some(RunOf { pid: None, attempt: 1 })]);
    assert_eq!(s.m.attempt(), 2);
}

/// The test policy with an idle engine stopped (or put to sleep) after 30 minutes.
fn idle(action: crate::policy::IdleAction) -> Policy {
    let idle = crate::policy::IdlePolicy { after: Duration::from_secs(1800), action, level: 1 };
    Policy { idle: Some(idle), ..policy() }
}

#[test]
fn an_idle_engine_is_stopped_through_the_normal_stop_and_started_by_the_next_request() {
    let mut s = Sim::new(idle(crate::policy::IdleAction::Stop));
    s.at(0.0).ready(100);
    let fx = s.at(1900.0).ev(Event::IdleFor { quiet: Duration::from_secs(1800) });
    assert_eq!(s.state(), "stopping");
    assert!(fx.contains(&Effect::Terminate(Signal::SIGTERM)), "{fx:?}");
    assert!(statuses(&fx).contains(&"idle: stopping pid 100 after 30m without requests".to_string()), "{fx:?}");
    s.ev(Event::ChildExited { pid: 100, exit: Exit::Code(0) });
    let fx = s.ev(Event::TreeGone);
    assert_eq!(s.state(), "idle");
    assert!(fx.contains(&Effect::Parked), "what the tree left goes, the GPUs are looked at: {fx:?}");
    // The estimate: the last load, until the ledger knows the setup.
    assert!(
        statuses(&fx)
            .iter()
            .any(|t| t.starts_with("idle: stopped after 30m without requests; starts on the next request (about")),
        "{fx:?}"
    );
    let snap = s.m.snapshot();
    assert_eq!((snap.idle_stops, snap.failures.values().sum::<u64>(), s.m.failures()), (1, 0, 0));
    assert!(s.m.idle_now());
    assert_eq!(s.m.next_deadline(), None, "nothing happens until a request comes");
    // Ticks and a stray readiness answer change nothing.
    s.at(5000.0).tick();
    s.ev(Event::HttpReady { start: 1 });
    assert_eq!(s.state(), "idle");
    let fx = s.at(6000.0).ev(Event::Wanted);
    assert!(fx.contains(&Effect::Prepare { start: 2 }), "a normal start: patches, pre-start, load: {fx:?}");
    assert!(!s.m.idle_now());
    s.spawned(101);
    s.ready(101);
    assert_eq!(s.state(), "ready");
}

#[test]
fn idle_asks_nothing_of_a_draining_or_unconfigured_engine_and_a_parked_one_stops_at_once() {
    let mut s = Sim::new(policy());
    s.ready(100);
    assert_eq!(s.m.idle_watch(), None);
    s.ev(Event::IdleFor { quiet: Duration::from_secs(1800) });
    assert_eq!(s.state(), "ready", "without idle-stop nothing happens");

    let mut s = Sim::new(idle(crate::policy::IdleAction::Stop));
    s.ready(100);
    assert!(s.m.idle_watch().is_some());
    s.ev(Event::DrainRequested);
    assert_eq!(s.m.idle_watch(), None);
    s.ev(Event::IdleFor { quiet: Duration::from_secs(1800) });
    assert_eq!(s.state(), "draining", "a drain is the operator's: idle waits for it");

    let mut s = Sim::new(idle(crate::policy::IdleAction::Stop));
    s.ready(100);
    s.ev(Event::IdleFor { quiet: Duration::from_secs(1800) });
    s.ev(Event::TreeGone);
    assert_eq!(s.state(), "idle");
    s.ev(Event::StopRequested);
    assert_eq!(s.m.done(), Some(Code::Ok));
}

#[test]
fn a_sleeping_engine_is_woken_by_a_request_and_serves_after_its_golden_answers() {
    use crate::golden::Verdict;
    let p = Policy { golden: Some(crate::policy::GoldenPolicy::Warn), ..idle(crate::policy::IdleAction::Sleep) };
    let mut s = Sim::new(p);
    s.spawned(100);
    s.line("INFO:     Application startup complete.");
    s.ev(Event::HttpReady { start: 1 });
    s.ev(Event::GoldenChecked { start: 1, verdict: Verdict::Recorded { prompts: 1, ms: 5 } });
    assert_eq!(s.state(), "ready");
    let fx = s.at(1900.0).ev(Event::IdleFor { quiet: Duration::from_secs(1800) });
    assert!(fx.contains(&Effect::Sleep { start: 1, level: 1 }), "{fx:?}");
    assert!(!fx.iter().any(|e| matches!(e, Effect::Terminate(_))), "the engine stays");
    assert_eq!((s.state(), s.m.idle_now()), ("idle", false), "not idle for requests until it sleeps");
    let fx = s.ev(Event::Slept { start: 1, result: Ok(()) });
    assert!(statuses(&fx).iter().any(|t| t.starts_with("idle: asleep (level 1) after 30m without requests")), "{fx:?}");
    assert!(s.m.idle_now());
    assert_eq!((s.m.child_pid(), s.m.snapshot().sleeps), (Some(100), 1));
    let fx = s.at(5000.0).ev(Event::Wanted);
    assert!(fx.contains(&Effect::Wake { start: 1 }), "{fx:?}");
    assert_eq!(s.state(), "starting", "waking: the engine is becoming ready again");
    let fx = s.at(5002.0).ev(Event::Woke { start: 1, result: Ok(()) });
    assert!(fx.contains(&Effect::Golden { start: 1 }), "the golden check before it serves: {fx:?}");
    assert_eq!(s.state(), "starting");
    let fx = s.at(5003.0).ev(Event::GoldenChecked { start: 1, verdict: Verdict::Same { prompts: 1, ms: 5 } });
    assert_eq!(s.state(), "ready");
    assert!(fx.contains(&Effect::Health { start: 1 }), "its health checked again: {fx:?}");
    assert!(statuses(&fx).contains(&"ready: pid 100, woken in 3s".to_string()), "{fx:?}");
    assert!(!notes(&fx).contains(&Note::Ready), "READY=1 was said once, at the load");
    assert_eq!(s.m.starts(), 1, "no new start");
    // Asleep again, the next wake is expected to take as long as this one.
    s.at(7000.0).ev(Event::IdleFor { quiet: Duration::from_secs(1800) });
    s.ev(Event::Slept { start: 1, result: Ok(()) });
    assert_eq!(s.m.idle_eta(), Some(Duration::from_secs(3)));
}

#[test]
fn a_wake_that_fails_or_answers_wrongly_restarts_the_engine() {
    use crate::golden::Verdict;
    let asleep = |golden| {
        let mut s = Sim::new(Policy { golden, ..idle(crate::policy::IdleAction::Sleep) });
        s.spawned(100);
        s.line("INFO:     Application startup complete.");
        s.ev(Event::HttpReady { start: 1 });
        if golden.is_some() {
            s.ev(Event::GoldenChecked { start: 1, verdict: Verdict::Recorded { prompts: 1, ms: 5 } });
        }
        s.ev(Event::IdleFor { quiet: Duration::from_secs(1800) });
        s.ev(Event::Slept { start: 1, result: Ok(()) });
        s.ev(Event::Wanted);
        s
    };
    let mut s = asleep(None);
    let fx = s.ev(Event::Woke { start: 1, result: Err("/wake_up: HTTP 500".into()) });
    assert_eq!(s.state(), "failed");
    assert!(fx.contains(&Effect::Terminate(Signal::SIGTERM)), "{fx:?}");
    assert_eq!(s.m.cause().unwrap().text, "the wake from sleep failed: /wake_up: HTTP 500");
    s.ev(Event::TreeGone);
    assert_eq!(s.state(), "backoff", "started again as after any failure");

    // Other answers than before the sleep: a restart, even where a load's
    // mismatch would only warn.
    let mut s = asleep(Some(crate::policy::GoldenPolicy::Warn));
    s.ev(Event::Woke { start: 1, result: Ok(()) });
    let changed = Verdict::Changed { text: "prompt 1: token 3 differs".into(), ms: 5 };
    s.ev(Event::GoldenChecked { start: 1, verdict: changed });
    assert_eq!(s.state(), "failed");
    assert_eq!(s.m.cause().unwrap().text, "after a wake from sleep: prompt 1: token 3 differs");
}

#[test]
fn a_sleep_that_is_not_confirmed_stops_the_engine_and_a_sleeper_that_exits_has_failed() {
    let mut s = Sim::new(idle(crate::policy::IdleAction::Sleep));
    s.ready(100);
    s.ev(Event::IdleFor { quiet: Duration::from_secs(1800) });
    let fx = s.ev(Event::Slept { start: 1, result: Err("/sleep: HTTP 404".into()) });
    assert!(fx.contains(&Effect::Terminate(Signal::SIGTERM)), "{fx:?}");
    s.ev(Event::TreeGone);
    assert_eq!((s.state(), s.m.snapshot().idle_stops), ("idle", 1), "stopped instead, GPUs given back");

    let mut s = Sim::new(idle(crate::policy::IdleAction::Sleep));
    s.ready(100);
    s.ev(Event::IdleFor { quiet: Duration::from_secs(1800) });
    s.ev(Event::Slept { start: 1, result: Ok(()) });
    s.ev(Event::ChildExited { pid: 100, exit: Exit::Code(1) });
    assert_eq!(s.state(), "failed");
    assert_eq!(s.m.cause().unwrap().text, "exited while serving (exit code 1)");
}

/// An upgrade in place, as the machine leads its hand-over: the binary
/// checked, the run awaited, its lines paused, the exec with their offset,
/// the lines followed again when it does not happen.
mod upgrade {
    use super::*;
    use crate::events::Upgrade;

    const DIED: &str = "(APIServer pid=7) ERROR 11-29 18:16:28 [core_client.py:564] Engine core proc EngineCore_DP0 died unexpectedly, shutting down client.";

    fn said(fx: &[Effect]) -> Vec<(Severity, String)> {
        fx.iter()
            .filter_map(|e| match e {
                Effect::Log(r) if r.topic == Topic::Upgrade => Some((r.severity, r.message.clone())),
                _ => None,
            })
            .collect()
    }

    fn of_upgrade(fx: &[Effect]) -> Vec<Effect> {
        fx.iter()
            .filter(|e| {
                matches!(
                    e,
                    Effect::CheckUpgrade | Effect::PauseLines | Effect::ExecUpgrade { .. } | Effect::ResumeLines { .. }
                )
            })
            .cloned()
            .collect()
    }

    fn checked(s: &mut Sim) -> Vec<Effect> {
        s.ev(Event::Upgrade(Upgrade::Checked(Ok("9.9.9".into()))))
    }

    /// Asked while loading: checked at once, held until ready, then the
    /// lines paused, the exec given the ready run and their offset; an
    /// exec that returns has the lines followed again from it, and the
    /// upgrade is over.
    #[test]
    fn an_upgrade_asked_while_loading_is_handed_over_once_ready() {
        let mut s = Sim::new(policy());
        s.spawned(100);
        let fx = s.ev(Event::Upgrade(Upgrade::Requested));
        assert_eq!(of_upgrade(&fx), vec![Effect::CheckUpgrade]);
        let fx = checked(&mut s);
        assert_eq!(of_upgrade(&fx), vec![]);
        assert_eq!(said(&fx), vec![(Severity::Info, "upgrade to 9.9.9 waits until the model is ready".into())]);
        s.at(3.0).line("INFO:     Application startup complete.");
        let fx = s.ev(Event::HttpReady { start: 1 });
        assert_eq!(of_upgrade(&fx), vec![Effect::PauseLines]);
        s.at(4.0);
        let fx = s.ev(Event::Upgrade(Upgrade::LinesPaused(Ok(4096))));
        let saved = s.m.save(s.now).unwrap();
        assert_eq!((saved.start, saved.pid, saved.ready_for), (1, 100, Duration::from_secs(1)));
        assert_eq!(of_upgrade(&fx), vec![Effect::ExecUpgrade { saved: Box::new(saved), offset: 4096 }]);
        assert_eq!(said(&fx), vec![(Severity::Info, "upgrading to 9.9.9: handing pid 100 over".into())]);
        let fx = s.ev(Event::Upgrade(Upgrade::ExecFailed("cannot run /usr/bin/vllm-warden: test".into())));
        assert_eq!(of_upgrade(&fx), vec![Effect::ResumeLines { offset: Some(4096) }]);
        assert_eq!(
            said(&fx),
            vec![(
                Severity::Error,
                "upgrade failed, this warden goes on: cannot run /usr/bin/vllm-warden: test".into()
            )]
        );
        assert_eq!(s.state(), "ready");
        // Over: nothing more is paused.
        assert_eq!(of_upgrade(&s.at(5.0).tick()), vec![]);
    }

    /// A binary that does not answer as a warden: said in the journal and
    /// `STATUS=`, and nothing is paused.
    #[test]
    fn a_refused_upgrade_is_said_and_nothing_is_paused() {
        let mut s = Sim::new(policy());
        s.ready(100);
        let fx = s.ev(Event::Upgrade(Upgrade::Checked(Err("the warden's own path is not known".into()))));
        assert_eq!(statuses(&fx), vec!["upgrade refused: the warden's own path is not known".to_string()]);
        assert_eq!(said(&fx)[0].0, Severity::Error);
        assert_eq!(of_upgrade(&fx), vec![]);
        assert_eq!(of_upgrade(&s.at(1.0).tick()), vec![]);
        assert_eq!(s.state(), "ready");
    }

    /// Checked during a drain: waits until the drain is held, then hands
    /// the drained run over.
    #[test]
    fn an_upgrade_waits_for_a_drain_under_way_and_hands_over_the_held_drain() {
        let mut s = Sim::new(policy());
        s.ready(100);
        s.ev(Event::DrainRequested);
        let fx = checked(&mut s);
        assert_eq!(said(&fx), vec![(Severity::Info, "upgrade to 9.9.9 waits until the drain ends".into())]);
        assert_eq!(of_upgrade(&fx), vec![]);
        assert_eq!(of_upgrade(&s.at(5.0).tick()), vec![]);
        let fx = s.ev(Event::Quiet { start: 1 });
        assert_eq!(s.state(), "drained");
        assert_eq!(of_upgrade(&fx), vec![Effect::PauseLines]);
        let fx = s.ev(Event::Upgrade(Upgrade::LinesPaused(Ok(7))));
        match &of_upgrade(&fx)[..] {
            [Effect::ExecUpgrade { saved, offset: 7 }] => assert!(saved.drained),
            other => panic!("{other:?}"),
        }
    }

    /// A fatal line among the last lines read: the pause is called off,
    /// the lines are followed again from where they stopped, and a failing
    /// run is not handed over.
    #[test]
    fn a_run_that_fails_while_its_lines_pause_is_not_handed_over() {
        let mut s = Sim::new(policy());
        s.ready(100);
        assert_eq!(of_upgrade(&checked(&mut s)), vec![Effect::PauseLines]);
        let fx = s.at(1.0).line(DIED);
        assert_eq!(of_upgrade(&fx), vec![Effect::ResumeLines { offset: None }]);
        let fx = s.ev(Event::Upgrade(Upgrade::LinesPaused(Ok(9))));
        assert_eq!(of_upgrade(&fx), vec![Effect::ResumeLines { offset: Some(9) }]);
        assert_eq!(said(&fx), vec![(Severity::Warn, "upgrade given up: the run is failing".into())]);
        // Given up: the run's end and the next ready do not bring it back.
        s.ev(Event::ChildExited { pid: 100, exit: Exit::Code(1) });
        s.ev(Event::TreeGone);
        s.at(20.0).tick();
        s.ready(101);
        assert!(!s.fx.iter().skip_while(|e| **e != Effect::Prepare { start: 2 }).any(|e| *e == Effect::PauseLines));
    }

    /// A drain begun with the last lines read: the lines are followed
    /// again, the upgrade waits for the drain, and is handed over once it
    /// is held.
    #[test]
    fn a_drain_begun_while_the_lines_pause_makes_the_upgrade_wait_again() {
        let mut s = Sim::new(policy());
        s.ready(100);
        assert_eq!(of_upgrade(&checked(&mut s)), vec![Effect::PauseLines]);
        assert_eq!(of_upgrade(&s.ev(Event::DrainRequested)), vec![Effect::ResumeLines { offset: None }]);
        let fx = s.ev(Event::Upgrade(Upgrade::LinesPaused(Ok(5))));
        assert_eq!(of_upgrade(&fx), vec![Effect::ResumeLines { offset: Some(5) }]);
        assert_eq!(said(&fx), vec![(Severity::Info, "upgrade to 9.9.9 waits until the drain ends".into())]);
        s.at(5.0).tick();
        assert_eq!(of_upgrade(&s.ev(Event::Quiet { start: 1 })), vec![Effect::PauseLines]);
    }

    /// Lines that cannot be paused (none followed, a follower that does
    /// not stop): the upgrade is given up and this warden keeps the run.
    #[test]
    fn lines_that_cannot_be_paused_give_the_upgrade_up() {
        let mut s = Sim::new(policy());
        s.ready(100);
        assert_eq!(of_upgrade(&checked(&mut s)), vec![Effect::PauseLines]);
        let fx = s.ev(Event::Upgrade(Upgrade::LinesPaused(Err("no log is followed".into()))));
        assert_eq!(of_upgrade(&fx), vec![Effect::ResumeLines { offset: None }]);
        assert_eq!(said(&fx), vec![(Severity::Error, "upgrade given up: no log is followed".into())]);
        assert_eq!(of_upgrade(&s.at(1.0).tick()), vec![]);
        assert_eq!(s.state(), "ready");
    }

    /// The end takes no upgrade.
    #[test]
    fn a_machine_that_is_done_ignores_an_upgrade() {
        let mut s = Sim::new(policy());
        s.ev(Event::StopRequested);
        assert_eq!(s.m.done(), Some(Code::Ok));
        assert!(s.ev(Event::Upgrade(Upgrade::Requested)).is_empty());
    }
}

/// A reload of the warden's own settings while the engine is idle (stopped
/// or asleep) is taken at once: the next start, wake and idle stop go by
/// it, and `STATUS=` still says the engine is idle.
#[test]
fn a_reload_of_the_wardens_settings_while_idle_is_taken() {
    for action in [crate::policy::IdleAction::Stop, crate::policy::IdleAction::Sleep] {
        let mut s = Sim::new(idle(action));
        s.at(0.0).ready(100);
        s.at(1900.0).ev(Event::IdleFor { quiet: Duration::from_secs(1800) });
        if action == crate::policy::IdleAction::Stop {
            s.ev(Event::ChildExited { pid: 100, exit: Exit::Code(0) });
            s.ev(Event::TreeGone);
        } else {
            s.ev(Event::Slept { start: 1, result: Ok(()) });
        }
        let was = s.state();
        assert!(s.m.idle_now(), "{action:?}: {was}");
        let new = Policy { idle: None, ..idle(action) };
        let fx =
            s.ev(Event::ReloadInPlace { policy: Box::new(new.clone()), summary: "front.idle-stop changed".into() });
        assert_eq!(s.m.policy, new, "{action:?}");
        assert_eq!(s.state(), was, "{action:?}");
        assert!(statuses(&fx).is_empty(), "{action:?}: {fx:?}");
        assert!(
            fx.iter().any(|e| matches!(e, Effect::Log(r) if r.topic == Topic::Reload
                && r.message == "front.idle-stop changed; the engine is idle")),
            "{action:?}: {fx:?}"
        );
    }
}

/// Every phase the endpoint can see a change asked in, with a machine in
/// it (the states of each; a stop under way in two kinds).
fn every_phase_for_a_change() -> Vec<(&'static str, Sim)> {
    use crate::golden::Verdict;
    use crate::policy::{GoldenPolicy, IdleAction};
    // The machine before `Begin` is never seen: the driver sends it first.
    let mut out: Vec<_> = every_waiting_state().into_iter().filter(|(name, _)| *name != "idle").collect();
    let mut s = Sim::new(policy());
    s.ready(100);
    s.ev(Event::DrainRequested);
    out.push(("draining", s));
    let mut s = Sim::new(policy());
    s.ready(100);
    s.ev(Event::DrainRequested);
    s.at(5.0).tick();
    s.ev(Event::Quiet { start: 1 });
    assert_eq!(s.state(), "drained");
    out.push(("drained", s));
    let golden = Policy { golden: Some(GoldenPolicy::Warn), ..policy() };
    let mut s = Sim::new(golden);
    s.spawned(100);
    s.line("INFO:     Application startup complete.");
    s.ev(Event::HttpReady { start: 1 });
    s.ev(Event::GoldenChecked { start: 1, verdict: Verdict::Recorded { prompts: 1, ms: 5 } });
    s.ev(Event::Recheck { reason: "Xid 31".into() });
    assert_eq!(s.state(), "rechecking");
    out.push(("rechecking", s));
    let mut s = Sim::new(idle(IdleAction::Stop));
    s.ready(100);
    s.at(1900.0).ev(Event::IdleFor { quiet: Duration::from_secs(1800) });
    s.ev(Event::ChildExited { pid: 100, exit: Exit::Code(0) });
    s.ev(Event::TreeGone);
    assert_eq!(s.state(), "idle");
    out.push(("idle, stopped", s));
    let p = Policy { golden: Some(GoldenPolicy::Warn), ..idle(IdleAction::Sleep) };
    let mut s = Sim::new(p);
    s.spawned(100);
    s.line("INFO:     Application startup complete.");
    s.ev(Event::HttpReady { start: 1 });
    s.ev(Event::GoldenChecked { start: 1, verdict: Verdict::Recorded { prompts: 1, ms: 5 } });
    s.at(1900.0).ev(Event::IdleFor { quiet: Duration::from_secs(1800) });
    s.ev(Event::Slept { start: 1, result: Ok(()) });
    assert_eq!(s.state(), "idle");
    out.push(("idle, asleep", s));
    let mut s = Sim::new(policy());
    s.ready(100);
    s.ev(Event::StopRequested);
    s.ev(Event::ChildExited { pid: 100, exit: Exit::Code(0) });
    s.ev(Event::TreeGone);
    assert_eq!(s.state(), "stopped");
    out.push(("stopped", s));
    out
}

/// The endpoint answers a change (`POST /drain`, `/undrain`, `/restart`)
/// by the core's rule for it, `Control`, and the machine acts by the same:
/// in a phase it does not apply to, the machine does nothing with it
/// (409); when it is so already, the machine is not asked (200); else the
/// machine acts on it and the phase it comes to shows it taken (202).
/// A stop or a restart already under way while the pre-start steps are
/// cancelled is the one exception: it goes on, and the answer (202) says
/// the phase it shows.
#[test]
fn the_endpoints_rule_for_a_change_is_the_machines() {
    let mut seen = std::collections::BTreeSet::new();
    for &c in Control::ALL {
        for (name, mut s) in every_phase_for_a_change() {
            let before = s.m.phase();
            let was = format!("{:?}", s.m.state());
            seen.insert(before.as_str());
            if c.already(before) {
                continue;
            }
            let fx = s.ev(c.event());
            let acted = !fx.is_empty() || format!("{:?}", s.m.state()) != was;
            if !c.applies(before) || name == "launching, stop pending" || name == "launching, relaunch pending" {
                assert!(!acted, "{c:?} in {name} ({before}): {fx:?}\n{was}\n{:?}", s.m.state());
                continue;
            }
            assert!(acted, "{c:?} in {name} ({before}): the machine did nothing");
            let after = s.m.phase();
            assert!(c.taken(before, after), "{c:?} in {name}: {before} -> {after} does not show it taken");
        }
    }
    let all: std::collections::BTreeSet<&str> = crate::outcome::Phase::ALL.iter().map(|p| p.as_str()).collect();
    assert_eq!(seen, all, "every phase is tried");
}
