//! Driver tests under paused tokio time, with a scripted fake child and a
//! recording notifier: the loop's timing (backoff, watchdog, stall, the stop
//! escalation) is checked to the virtual millisecond, with no real process.

use std::collections::{BTreeMap, HashSet};
use std::sync::{Arc, Mutex};

use nix::sys::signal::Signal;

use super::*;
use crate::config::profile::Profile;
use crate::process::child::Exit;
use crate::supervisor::Policy;
use crate::supervisor::outcome::{Prepared, StartFailure};

/// What a fake run does after its spawn, in virtual time.
#[derive(Clone)]
enum Plan {
    /// Write these lines (each after `gap`), then exit.
    Exit { lines: Vec<&'static str>, gap: Duration, exit: Exit },
    /// Write these lines, then keep running.
    Run { lines: Vec<&'static str>, gap: Duration },
}

#[derive(Debug, Clone, PartialEq)]
enum Call {
    Prepare(u32),
    CancelPrepare,
    Spawn(u32),
    Probe(u32),
    Terminate(Signal),
    Kill,
    WatchLoad(u32),
    UnwatchLoad,
    Report(u32),
    CancelReport,
    Sleep(u32, u8),
    Wake(u32),
    Parked,
    Golden(u32),
    /// A load ended so (its outcome's word).
    LoadEnded(String),
    Fit(BTreeMap<crate::config::FitArg, String>),
    Pin(BTreeMap<crate::config::FitArg, String>),
    Unpin(BTreeMap<crate::config::FitArg, String>),
    SetupGood,
    Rollback,
    Reconfigure,
    CheckUpgrade,
    PauseLines,
    ResumeLines(u64),
    ExecUpgrade {
        start: u32,
        pid: u32,
        offset: u64,
    },
}

/// Where the fake's follower stops when an upgrade pauses it.
const PAUSED_AT: u64 = 4096;

#[derive(Clone, Default)]
struct Log {
    calls: Arc<Mutex<Vec<(Duration, Call)>>>,
    notes: Arc<Mutex<Vec<(Duration, Note)>>>,
}

struct Fake {
    t0: Instant,
    tx: mpsc::UnboundedSender<Input>,
    /// Lines, classified as the real follower does.
    lines: mpsc::Sender<Delivery>,
    /// The latest start spawned.
    current: u32,
    plans: Vec<Plan>,
    log: Log,
    alive: Arc<Mutex<HashSet<u32>>>,
    /// The child ignores the stop signal.
    stubborn: bool,
    /// Lines "in the file" that only a drain finds.
    unflushed: Vec<String>,
    /// A background task dies at this time.
    task_dies_at: Option<Duration>,
    /// SIGKILL does not end the tree (a process stuck in the kernel).
    unkillable: bool,
    /// The pre-start steps never end (a hung GPU query).
    prepare_hangs: bool,
    /// A drain is never answered (a follower stuck in a read).
    deaf: bool,
    /// A drain reads a long tail: an empty batch every this long, this
    /// many times, then the answer.
    long_tail: Option<(Duration, u32)>,
    /// The server has requests in flight until this time.
    busy_until: Option<Duration>,
    /// The watch of the requests in flight.
    load: Option<tokio::task::AbortHandle>,
    /// A failure report takes this long; `None`: it never ends (wedged).
    report_takes: Option<Duration>,
    /// The kernel's OOM killer ends a leader killed by SIGKILL, so said.
    oom: Option<String>,
    /// The golden check's verdicts, one a check (then the same answers).
    verdicts: Vec<crate::supervisor::golden::Verdict>,
    /// How long a golden check takes.
    golden_takes: Duration,
    /// What the ledger knows of the setup each start runs (the last one
    /// for the starts after); none: nothing.
    setups: Vec<crate::supervisor::load::LoadStart>,
    /// Memory fit's values, laid over the setup's own from the next start.
    fitted: BTreeMap<crate::config::FitArg, String>,
    /// The last-known-good setup's settings, for one rollback.
    good: Option<crate::config::Settings>,
    /// What the check of an upgrade's binary answers.
    upgrade: Option<Result<String, crate::daemon::upgrade::UpgradeError>>,
}

/// What goes wrong besides the plans.
#[derive(Default)]
struct Quirks {
    stubborn: bool,
    unflushed: Vec<String>,
    task_dies_at: Option<Duration>,
    unkillable: bool,
    prepare_hangs: bool,
    deaf: bool,
    long_tail: Option<(Duration, u32)>,
    busy_until: Option<Duration>,
    /// Requests sent to the loop at these times.
    requests: Vec<(Duration, Request)>,
    report_takes: Option<Duration>,
    /// The observer's change to ready takes this long, in real time (a
    /// slow status write).
    slow_observer: Option<std::time::Duration>,
    /// The front door's requests, as it tells them to the loop.
    activity: Option<Arc<crate::daemon::front::Activity>>,
    oom: Option<String>,
    verdicts: Vec<crate::supervisor::golden::Verdict>,
    golden_takes: Duration,
    setups: Vec<crate::supervisor::load::LoadStart>,
    good: Option<crate::config::Settings>,
    upgrade: Option<Result<String, crate::daemon::upgrade::UpgradeError>>,
}

/// One line as the follower hands it on, when it matters.
fn deliver(start: u32, c: &mut Classifier, text: &str) -> Option<Delivery> {
    let line = c.classify_ref(text).line?;
    Some(Delivery::Lines { start, lines: vec![line], held: crate::observe::logwatch::Gauge::default().hold(0) })
}

impl Fake {
    fn call(&self, c: Call) {
        self.log.calls.lock().unwrap().push((self.t0.elapsed(), c));
    }
    fn end(&self, pid: u32, exit: Exit) {
        if self.alive.lock().unwrap().remove(&pid) {
            let _ = self.tx.send(Input::Tree(TreeEvent::LeaderExited { pid, exit }));
        }
    }
}

impl ports::Launch for Fake {
    fn prepare(&mut self, start: u32) {
        self.call(Call::Prepare(start));
        if self.prepare_hangs {
            let _ = self.tx.send(Event::PrepareStep { start, text: "waiting for the GPU query".into() }.into());
        } else {
            let _ = self.tx.send(Event::Prepared { start, result: Prepared::Done }.into());
        }
    }
    fn cancel_prepare(&mut self) {
        self.call(Call::CancelPrepare);
    }
    fn describe_survivors(&mut self) {
        let description = "1 process(es) survived SIGKILL: pid 101 (state D)".into();
        let _ = self.tx.send(Event::Survivors { left: 1, description }.into());
    }
    fn spawn(&mut self, start: u32) -> Result<u32, StartFailure> {
        self.call(Call::Spawn(start));
        self.current = start;
        let pid = 100 + start;
        self.alive.lock().unwrap().insert(pid);
        let plan =
            self.plans.get(start as usize - 1).cloned().unwrap_or(Plan::Run { lines: vec![], gap: Duration::ZERO });
        let (tx, alive, out) = (self.tx.clone(), self.alive.clone(), self.lines.clone());
        tokio::spawn(async move {
            let mut c = Classifier::new(&Profile::Vllm.patterns()).unwrap();
            let (lines, gap, exit) = match plan {
                Plan::Exit { lines, gap, exit } => (lines, gap, Some(exit)),
                Plan::Run { lines, gap } => (lines, gap, None),
            };
            for l in lines {
                tokio::time::sleep(gap).await;
                if let Some(d) = deliver(start, &mut c, l) {
                    let _ = out.send(d).await;
                }
            }
            if let Some(exit) = exit
                && alive.lock().unwrap().remove(&pid)
            {
                let _ = tx.send(Input::Tree(TreeEvent::LeaderExited { pid, exit }));
            }
        });
        Ok(pid)
    }
    fn terminate(&mut self, sig: Signal) {
        self.call(Call::Terminate(sig));
        let alive: Vec<u32> = self.alive.lock().unwrap().iter().copied().collect();
        if !self.stubborn {
            for pid in &alive {
                self.end(*pid, Exit::Code(0));
            }
        }
        if self.stubborn && !alive.is_empty() {
            return;
        }
        let _ = self.tx.send(Input::Tree(TreeEvent::Empty));
    }
    fn kill_tree(&mut self) {
        self.call(Call::Kill);
        if self.unkillable {
            return;
        }
        let alive: Vec<u32> = self.alive.lock().unwrap().iter().copied().collect();
        for pid in alive {
            self.end(pid, Exit::Signal(crate::supervisor::Signal::SIGKILL));
        }
        let _ = self.tx.send(Input::Tree(TreeEvent::Empty));
    }
    fn drain_lines(&mut self) -> bool {
        let (start, tail, out) = (self.current, std::mem::take(&mut self.unflushed), self.lines.clone());
        if self.deaf {
            return true;
        }
        let long_tail = self.long_tail;
        tokio::spawn(async move {
            if let Some((every, beats)) = long_tail {
                for _ in 0..beats {
                    tokio::time::sleep(every).await;
                    let beat = Delivery::Lines {
                        start,
                        lines: vec![],
                        held: crate::observe::logwatch::Gauge::default().hold(0),
                    };
                    let _ = out.send(beat).await;
                }
            }
            let mut c = Classifier::new(&Profile::Vllm.patterns()).unwrap();
            for text in tail {
                if let Some(d) = deliver(start, &mut c, &text) {
                    let _ = out.send(d).await;
                }
            }
            let _ = out.send(Delivery::Drained { start }).await;
        });
        true
    }
    fn oom_killed(&mut self, _pid: u32, exit: Exit) -> Option<String> {
        // The kernel's OOM killer ends the leader with SIGKILL.
        let killed = exit == Exit::Signal(crate::supervisor::Signal::SIGKILL);
        self.oom.clone().filter(|_| killed)
    }
}

impl ports::Checks for Fake {
    fn health(&mut self, _start: u32) {}
    fn watch_load(&mut self, start: u32) {
        self.call(Call::WatchLoad(start));
        let (tx, quiet_at) = (self.tx.clone(), self.t0 + self.busy_until.unwrap_or_default());
        self.load = Some(
            tokio::spawn(async move {
                tokio::time::sleep_until(quiet_at).await;
                let _ = tx.send(Event::Quiet { start }.into());
            })
            .abort_handle(),
        );
    }
    fn unwatch_load(&mut self) {
        self.call(Call::UnwatchLoad);
        if let Some(t) = self.load.take() {
            t.abort();
        }
    }
    fn probe(&mut self, start: u32) {
        self.call(Call::Probe(start));
        let _ = self.tx.send(Event::HttpReady { start }.into());
    }
    fn golden(&mut self, start: u32) {
        self.call(Call::Golden(start));
        let verdict = if self.verdicts.is_empty() {
            crate::supervisor::golden::Verdict::Same { prompts: 1, ms: 40 }
        } else {
            self.verdicts.remove(0)
        };
        let (tx, takes) = (self.tx.clone(), self.golden_takes);
        tokio::spawn(async move {
            tokio::time::sleep(takes).await;
            let _ = tx.send(Event::GoldenChecked { start, verdict }.into());
        });
    }
}

impl ports::Idle for Fake {
    fn sleep(&mut self, start: u32, level: u8) {
        self.call(Call::Sleep(start, level));
        let _ = self.tx.send(Event::Slept { start, result: Ok(()) }.into());
    }
    fn wake(&mut self, start: u32) {
        self.call(Call::Wake(start));
        let _ = self.tx.send(Event::Woke { start, result: Ok(()) }.into());
    }
    fn parked(&mut self) {
        self.call(Call::Parked);
    }
}

impl ports::Reports for Fake {
    fn report(&mut self, order: crate::supervisor::ReportOrder) -> Option<std::path::PathBuf> {
        self.call(Call::Report(order.start));
        if let Some(takes) = self.report_takes {
            let (tx, start) = (self.tx.clone(), order.start);
            tokio::spawn(async move {
                tokio::time::sleep(takes).await;
                let _ = tx.send(Event::Reported { start }.into());
            });
        }
        Some(format!("/state/reports/x-t-{}", order.attempt).into())
    }
    fn cancel_report(&mut self) {
        self.call(Call::CancelReport);
    }
}

impl ports::Loads for Fake {
    fn load_start(&mut self) -> Option<crate::supervisor::load::LoadStart> {
        let i = (self.current as usize).checked_sub(1)?;
        let mut load = self.setups.get(i).or(self.setups.last()).cloned()?;
        for (arg, value) in &self.fitted {
            load.used.insert(*arg, (value.clone(), crate::supervisor::fit::Source::Fitted));
        }
        Some(load)
    }
    fn load_ended(&mut self, record: crate::supervisor::load::LoadRecord) {
        self.call(Call::LoadEnded(record.outcome.word().to_string()));
    }
    fn fit(&mut self, set: BTreeMap<crate::config::FitArg, String>) {
        self.call(Call::Fit(set.clone()));
        self.fitted = set;
    }
    fn pin(&mut self, values: BTreeMap<crate::config::FitArg, String>) {
        self.call(Call::Pin(values));
    }
    fn unpin(&mut self, values: BTreeMap<crate::config::FitArg, String>) {
        self.call(Call::Unpin(values));
    }
    fn setup_good(&mut self) {
        self.call(Call::SetupGood);
    }
    fn rollback(&mut self) -> Result<crate::config::Settings, String> {
        self.call(Call::Rollback);
        self.good.take().ok_or_else(|| "no setup has reached ready in this warden's life".into())
    }
}

impl ports::Upgrade for Fake {
    fn check_upgrade(&mut self) {
        self.call(Call::CheckUpgrade);
        if let Some(checked) = self.upgrade.take() {
            let _ = self.tx.send(Input::UpgradeChecked(checked));
        }
    }
    fn pause_lines(&mut self) -> bool {
        self.call(Call::PauseLines);
        !self.alive.lock().unwrap().is_empty()
    }
    fn lines_paused(&mut self, _wait: Duration) -> Option<u64> {
        Some(PAUSED_AT)
    }
    fn resume_lines(&mut self, offset: u64) {
        self.call(Call::ResumeLines(offset));
    }
    fn exec_upgrade(&mut self, saved: crate::supervisor::Saved, offset: u64) -> String {
        self.call(Call::ExecUpgrade { start: saved.start, pid: saved.pid, offset });
        // An exec that succeeds does not return: only its failure is seen here.
        "cannot run /usr/bin/vllm-warden: test".into()
    }
}

impl ports::Config for Fake {
    fn read_config(&mut self) {}
    fn reconfigure(
        &mut self,
        _settings: crate::config::Settings,
        _classifier: Classifier,
    ) -> crate::daemon::reload::ReloadPlan {
        self.call(Call::Reconfigure);
        crate::daemon::reload::ReloadPlan::Nothing
    }
}

impl ports::Tasks for Fake {
    async fn task_failed(&mut self) -> String {
        // Cancel-safe, as the real one: the wait is dropped whenever another
        // input comes first.
        match self.task_dies_at {
            Some(at) => {
                tokio::time::sleep_until(self.t0 + at).await;
                self.task_dies_at = None;
                "the reaper task panicked: test".into()
            }
            None => std::future::pending().await,
        }
    }
}

struct Rec {
    t0: Instant,
    log: Log,
}

impl Notifier for Rec {
    fn notify(&mut self, notes: &[Note]) {
        let t = self.t0.elapsed();
        self.log.notes.lock().unwrap().extend(notes.iter().map(|n| (t, n.clone())));
    }
}

fn policy() -> Policy {
    Policy {
        fit: None,
        rollback: false,
        ready_log: true,
        ready_http: true,
        ready_timeout: Duration::from_secs(3600),
        stall: Duration::from_secs(60),
        grace: Duration::from_secs(5),
        stop_signal: crate::supervisor::Signal::SIGTERM,
        stop_timeout: Duration::from_secs(30),
        prepare_timeout: Duration::from_secs(300),
        hints: crate::supervisor::hints::Hints::new(Profile::None, &[], Vec::new(), &[]),
        report: None,
        phases: false,
        slow_factor: 1.5,
        deadline_factor: 3.0,
        golden: None,
        golden_timeout: Duration::from_secs(60),
        golden_interval: None,
        restart: crate::config::Restart {
            initial_delay: Duration::from_secs(10),
            max_delay: Duration::from_secs(300),
            factor: 2.0,
            jitter: 0.0,
            reset_after: Duration::from_secs(600),
            max_attempts: 5,
            permanent_attempts: 2,
        },
        drain_delay: Duration::from_secs(5),
        drain_timeout: Duration::from_secs(60),
        drain_on_stop: false,
        idle: None,
    }
}

struct Outcome {
    code: Code,
    calls: Vec<(Duration, Call)>,
    notes: Vec<(Duration, Note)>,
    phases: Vec<(Duration, crate::supervisor::outcome::Phase)>,
    /// Each turn of the loop, as the observer was told.
    turns: Vec<std::time::Duration>,
}

/// Drive a fake with `plans`; `stop_at` sends a stop request at that time.
async fn run(
    p: Policy,
    plans: Vec<Plan>,
    stubborn: bool,
    unflushed: Vec<String>,
    stop_at: Option<Duration>,
    dog: Option<Duration>,
) -> Outcome {
    run_with(p, plans, Quirks { stubborn, unflushed, ..Quirks::default() }, stop_at, dog).await
}

async fn run_with(p: Policy, plans: Vec<Plan>, q: Quirks, stop_at: Option<Duration>, dog: Option<Duration>) -> Outcome {
    let t0 = Instant::now();
    let (tx, mut rx) = mpsc::unbounded_channel();
    let (lines_tx, mut lines) = mpsc::channel(crate::observe::logwatch::QUEUE);
    let log = Log::default();
    let mut fake = Fake {
        t0,
        tx: tx.clone(),
        lines: lines_tx,
        current: 0,
        deaf: q.deaf,
        long_tail: q.long_tail,
        report_takes: q.report_takes,
        plans,
        log: log.clone(),
        alive: Arc::default(),
        stubborn: q.stubborn,
        unflushed: q.unflushed,
        task_dies_at: q.task_dies_at,
        unkillable: q.unkillable,
        prepare_hangs: q.prepare_hangs,
        busy_until: q.busy_until,
        load: None,
        oom: q.oom,
        verdicts: q.verdicts,
        golden_takes: q.golden_takes,
        setups: q.setups,
        fitted: BTreeMap::new(),
        good: q.good,
        upgrade: q.upgrade,
    };
    let mut rec = Rec { t0, log: log.clone() };
    let mut phases = Phases { t0, seen: Vec::new(), turns: Vec::new(), slow: q.slow_observer };
    // Held until the loop ends: the end of the requests would be a stop.
    let (requests, rq) = mpsc::unbounded_channel();
    if let Some(at) = stop_at {
        let requests = requests.clone();
        tokio::spawn(async move {
            tokio::time::sleep(at).await;
            let _ = requests.send(Request::Stop);
        });
    }
    for (at, r) in q.requests {
        let requests = requests.clone();
        tokio::spawn(async move {
            tokio::time::sleep(at).await;
            let _ = requests.send(r);
        });
    }
    let ctx = Context { instance: "t".into(), watchdog: dog, heartbeat: None };
    let code = Loop {
        machine: Machine::new(p, 1),
        backend: &mut fake,
        notifier: &mut rec,
        inputs: &mut rx,
        lines: &mut lines,
        ctx: &ctx,
        observer: &mut phases,
        activity: q.activity,
    }
    .run(tokio_stream::wrappers::UnboundedReceiverStream::new(rq))
    .await;
    drop(requests);
    let calls = log.calls.lock().unwrap().clone();
    let notes = log.notes.lock().unwrap().clone();
    Outcome { code, calls, notes, phases: phases.seen, turns: phases.turns }
}

/// Records each change of phase.
struct Phases {
    t0: Instant,
    seen: Vec<(Duration, crate::supervisor::outcome::Phase)>,
    turns: Vec<std::time::Duration>,
    slow: Option<std::time::Duration>,
}

impl Observer for Phases {
    fn changed(&mut self, m: &Machine) {
        if self.seen.last().map(|(_, p)| *p) != Some(m.phase()) {
            self.seen.push((self.t0.elapsed(), m.phase()));
        }
        if m.phase() == crate::supervisor::outcome::Phase::Ready
            && let Some(d) = self.slow.take()
        {
            // Real time, not the paused clock: a write that holds the loop.
            std::thread::sleep(d);
        }
    }

    fn loop_turn(&mut self, took: std::time::Duration) {
        self.turns.push(took);
    }
}

const READY: &str = "INFO:     Application startup complete.";
const S: fn(u64) -> Duration = Duration::from_secs;

fn spawn_times(o: &Outcome) -> Vec<Duration> {
    o.calls.iter().filter(|(_, c)| matches!(c, Call::Spawn(_))).map(|(t, _)| *t).collect()
}

#[tokio::test(start_paused = true)]
async fn backoff_delays_are_kept_to_the_millisecond() {
    let crash = Plan::Exit { lines: vec![], gap: Duration::ZERO, exit: Exit::Code(1) };
    let ok = Plan::Run { lines: vec![READY], gap: S(2) };
    let o = run(policy(), vec![crash.clone(), crash, ok], false, vec![], Some(S(100)), None).await;
    assert_eq!(o.code, Code::Ok);
    assert_eq!(spawn_times(&o), vec![S(0), S(10), S(30)]);
    let ready: Vec<Duration> = o.notes.iter().filter(|(_, n)| *n == Note::Ready).map(|(t, _)| *t).collect();
    assert_eq!(ready, vec![S(32)]);
}

#[tokio::test(start_paused = true)]
async fn the_watchdog_is_fed_at_its_interval() {
    let o =
        run(policy(), vec![Plan::Run { lines: vec![READY], gap: S(1) }], false, vec![], Some(S(12)), Some(S(5))).await;
    let pings: Vec<Duration> = o.notes.iter().filter(|(_, n)| *n == Note::Watchdog).map(|(t, _)| *t).collect();
    assert_eq!(pings, vec![S(0), S(5), S(10)]);
}

#[tokio::test(start_paused = true)]
async fn a_stall_fails_the_start_exactly_at_the_deadline() {
    let stalls =
        Plan::Run { lines: vec!["(Worker pid=1) INFO 11-29 18:11:02 [x.py:1] Starting to load model /m"], gap: S(7) };
    let mut p = policy();
    p.restart.max_attempts = 1;
    let o = run(p, vec![stalls], false, vec![], None, None).await;
    assert_eq!(o.code, Code::GaveUp);
    assert!(o.calls.contains(&(S(67), Call::Terminate(Signal::SIGTERM))), "{:?}", o.calls);
    assert!(o.notes.contains(&(S(7), Note::ExtendTimeout(S(60)))));
}

#[tokio::test(start_paused = true)]
async fn a_stubborn_tree_is_signalled_every_second_then_killed() {
    let o = run(policy(), vec![Plan::Run { lines: vec![], gap: S(0) }], true, vec![], Some(S(3)), None).await;
    assert_eq!(o.code, Code::Ok);
    let terms: Vec<u64> =
        o.calls.iter().filter(|(_, c)| *c == Call::Terminate(Signal::SIGTERM)).map(|(t, _)| t.as_secs()).collect();
    assert_eq!(terms, (3..13).collect::<Vec<_>>());
    assert!(o.calls.contains(&(S(13), Call::Kill)));
}

#[tokio::test(start_paused = true)]
async fn the_last_lines_in_the_file_are_read_before_the_exit() {
    let exits = Plan::Exit { lines: vec![], gap: Duration::ZERO, exit: Exit::Code(1) };
    let tail = vec![
        "Traceback (most recent call last):".to_string(),
        "  File \"x.py\", line 1".to_string(),
        "ValueError: No valid attention backend found".to_string(),
    ];
    let mut p = policy();
    p.restart.max_attempts = 1;
    let o = run(p, vec![exits], false, tail, None, None).await;
    assert_eq!(o.code, Code::GaveUp);
    assert!(
        o.notes.iter().any(|(_, n)| *n
            == Note::Status("gave up after 1 failed starts: ValueError: No valid attention backend found".into())),
        "{:?}",
        o.notes
    );
}

/// A follower that never answers the drain cannot hold the exit back for
/// ever: the exit is acted on after `DRAIN_PATIENCE`.
#[tokio::test(start_paused = true)]
async fn an_unanswered_drain_delays_the_exit_by_its_patience_only() {
    let exits = Plan::Exit { lines: vec![], gap: S(1), exit: Exit::Code(1) };
    let mut p = policy();
    p.restart.max_attempts = 1;
    let o = run_with(p, vec![exits], Quirks { deaf: true, ..Quirks::default() }, None, None).await;
    assert_eq!(o.code, Code::GaveUp);
    let failed = o.notes.iter().find(|(_, n)| matches!(n, Note::Status(s) if s.starts_with("failed")));
    assert_eq!(failed.map(|(t, _)| *t), Some(DRAIN_PATIENCE), "{:?}", o.notes);
}

/// A drain that keeps reading a long tail holds the exit as long as it
/// says so, and its last lines still come first.
#[tokio::test(start_paused = true)]
async fn a_long_tail_holds_the_exit_while_it_is_read() {
    let exits = Plan::Exit { lines: vec![], gap: S(1), exit: Exit::Code(1) };
    let tail = vec!["ValueError: No valid attention backend found".to_string()];
    let mut p = policy();
    p.restart.max_attempts = 1;
    let q = Quirks { unflushed: tail, long_tail: Some((S(6), 5)), ..Quirks::default() };
    let o = run_with(p, vec![exits], q, None, None).await;
    assert_eq!(o.code, Code::GaveUp);
    let failed = o.notes.iter().find(|(_, n)| matches!(n, Note::Status(s) if s.starts_with("failed")));
    // Five beats six seconds apart: beyond DRAIN_PATIENCE, but never silent for it.
    assert_eq!(failed.map(|(t, _)| *t), Some(S(30)), "{:?}", o.notes);
    assert!(
        o.notes.iter().any(|(_, n)| matches!(n, Note::Status(s) if s.contains("No valid attention backend found"))),
        "{:?}",
        o.notes
    );
}

#[tokio::test(start_paused = true)]
async fn a_dead_task_stops_the_tree_and_exits_70() {
    let serving = Plan::Run { lines: vec![READY], gap: S(1) };
    let o =
        run_with(policy(), vec![serving], Quirks { task_dies_at: Some(S(5)), ..Quirks::default() }, None, None).await;
    assert_eq!(o.code, Code::Internal);
    assert!(o.calls.contains(&(S(5), Call::Terminate(Signal::SIGTERM))), "{:?}", o.calls);
    assert!(
        o.notes.iter().any(|(_, n)| matches!(n, Note::Status(s) if s.starts_with("internal failure"))),
        "{:?}",
        o.notes
    );
}

#[tokio::test(start_paused = true)]
async fn hung_pre_start_steps_fail_the_start_at_their_deadline_naming_the_step() {
    let mut p = policy();
    p.restart.max_attempts = 1;
    let o = run_with(p, vec![], Quirks { prepare_hangs: true, ..Quirks::default() }, None, None).await;
    assert_eq!(o.code, Code::GaveUp);
    assert!(o.calls.contains(&(S(300), Call::CancelPrepare)), "{:?}", o.calls);
    let last = o.notes.iter().rev().find_map(|(_, n)| if let Note::Status(s) = n { Some(s.clone()) } else { None });
    assert_eq!(
        last.as_deref(),
        Some(
            "gave up after 1 failed starts: pre-start steps did not finish within 5m; stuck at: waiting for the GPU query"
        )
    );
}

#[tokio::test(start_paused = true)]
async fn a_tree_that_survives_sigkill_is_reported_and_exits_71() {
    let serving = Plan::Run { lines: vec![READY], gap: S(1) };
    let q = Quirks { stubborn: true, unkillable: true, ..Quirks::default() };
    let o = run_with(policy(), vec![serving], q, Some(S(10)), None).await;
    assert_eq!(o.code, Code::Unkillable);
    // Stop at 10 s, SIGKILL after the 30 s stop timeout, then the kill grace.
    assert!(o.calls.contains(&(S(40), Call::Kill)), "{:?}", o.calls);
    let last = o.notes.iter().rev().find_map(|(_, n)| if let Note::Status(s) = n { Some(s.clone()) } else { None });
    assert_eq!(last.as_deref(), Some("1 process(es) survived SIGKILL: pid 101 (state D)"));
}

fn draining() -> Policy {
    Policy { drain_on_stop: true, ..policy() }
}

fn times(o: &Outcome, want: impl Fn(&Call) -> bool) -> Vec<Duration> {
    o.calls.iter().filter(|(_, c)| want(c)).map(|(t, _)| *t).collect()
}

fn terminations(o: &Outcome) -> Vec<Duration> {
    times(o, |c| matches!(c, Call::Terminate(_)))
}

fn stopping_notes(o: &Outcome) -> Vec<Duration> {
    o.notes.iter().filter(|(_, n)| *n == Note::Stopping).map(|(t, _)| *t).collect()
}

/// `systemctl stop` of a serving child with `drain.on-stop`: STOPPING=1 at
/// once, unready at once, the stop signal only after the delay and the
/// requests in flight.
#[tokio::test(start_paused = true)]
async fn a_stop_while_serving_is_answered_at_once_and_drains_before_the_signal() {
    use crate::supervisor::outcome::Phase;
    let serving = Plan::Run { lines: vec![READY], gap: S(2) };
    let q = Quirks { busy_until: Some(S(20)), ..Quirks::default() };
    let o = run_with(draining(), vec![serving], q, Some(S(10)), None).await;
    assert_eq!(o.code, Code::Ok);
    assert_eq!(stopping_notes(&o).first(), Some(&S(10)), "answered at once: {:?}", o.notes);
    assert!(o.phases.contains(&(S(10), Phase::Draining)), "{:?}", o.phases);
    assert_eq!(times(&o, |c| matches!(c, Call::WatchLoad(1))), vec![S(15)], "after drain.delay");
    assert_eq!(terminations(&o).first(), Some(&S(20)), "once no request is in flight");
    // systemd's stop timeout is pushed out over the drain and the stop.
    assert!(o.notes.iter().any(|(t, n)| *t == S(10) && *n == Note::ExtendTimeout(S(5 + 60 + 30 + 5))), "{:?}", o.notes);
}

#[tokio::test(start_paused = true)]
async fn a_drain_waits_for_the_requests_in_flight_no_longer_than_its_timeout() {
    let serving = Plan::Run { lines: vec![READY], gap: S(2) };
    let q = Quirks { busy_until: Some(S(10_000)), ..Quirks::default() };
    let o = run_with(draining(), vec![serving], q, Some(S(10)), None).await;
    assert_eq!(o.code, Code::Ok);
    assert_eq!(terminations(&o).first(), Some(&S(10 + 5 + 60)));
}

/// A second stop request (systemctl stop again, or Ctrl-C twice) does not
/// wait for the drain.
#[tokio::test(start_paused = true)]
async fn a_second_stop_cuts_the_drain_short() {
    let serving = Plan::Run { lines: vec![READY], gap: S(2) };
    let q = Quirks { busy_until: Some(S(10_000)), requests: vec![(S(12), Request::Stop)], ..Quirks::default() };
    let o = run_with(draining(), vec![serving], q, Some(S(10)), None).await;
    assert_eq!(o.code, Code::Ok);
    assert_eq!(terminations(&o).first(), Some(&S(12)));
}

/// Without `drain.on-stop` a stop signals at once, as before.
#[tokio::test(start_paused = true)]
async fn without_drain_on_stop_a_stop_signals_at_once() {
    let serving = Plan::Run { lines: vec![READY], gap: S(2) };
    let q = Quirks { busy_until: Some(S(10_000)), ..Quirks::default() };
    let o = run_with(policy(), vec![serving], q, Some(S(10)), None).await;
    assert_eq!(terminations(&o).first(), Some(&S(10)));
    assert!(times(&o, |c| matches!(c, Call::WatchLoad(_))).is_empty());
}

/// `POST /restart`: drain, signal, start again; the new run is ready.
#[tokio::test(start_paused = true)]
async fn restart_drains_then_starts_the_child_again() {
    use crate::supervisor::outcome::Phase;
    let serving = Plan::Run { lines: vec![READY], gap: S(2) };
    let q = Quirks {
        busy_until: Some(S(18)),
        requests: vec![(S(10), Request::Control(Control::Restart))],
        ..Quirks::default()
    };
    let o = run_with(policy(), vec![serving.clone(), serving], q, Some(S(100)), None).await;
    assert_eq!(o.code, Code::Ok);
    assert_eq!(terminations(&o)[0], S(18));
    assert_eq!(spawn_times(&o), vec![S(0), S(18)]);
    let ready: Vec<Duration> = o.phases.iter().filter(|(_, p)| *p == Phase::Ready).map(|(t, _)| *t).collect();
    assert_eq!(ready, vec![S(2), S(20)]);
    assert!(o.phases.contains(&(S(10), Phase::Draining)), "{:?}", o.phases);
}

/// `POST /drain` holds the child out of rotation (it keeps running);
/// `POST /undrain` puts it back; nothing is signalled.
#[tokio::test(start_paused = true)]
async fn a_plain_drain_holds_the_child_drained_until_undrained() {
    use crate::supervisor::outcome::Phase;
    let serving = Plan::Run { lines: vec![READY], gap: S(2) };
    let q = Quirks {
        busy_until: Some(S(12)),
        requests: vec![(S(10), Request::Control(Control::Drain)), (S(30), Request::Control(Control::Undrain))],
        ..Quirks::default()
    };
    let o = run_with(policy(), vec![serving], q, Some(S(50)), None).await;
    assert_eq!(
        o.phases.iter().filter(|(t, _)| *t < S(50)).cloned().collect::<Vec<_>>(),
        vec![
            (S(0), Phase::Starting),
            (S(2), Phase::Ready),
            (S(10), Phase::Draining),
            (S(15), Phase::Drained),
            (S(30), Phase::Ready)
        ]
    );
    assert_eq!(terminations(&o).first(), Some(&S(50)), "nothing signalled before the stop");
    assert!(o.notes.iter().any(|(t, n)| *t == S(15) && *n == Note::Status("drained: pid 101, out of rotation".into())));
}

/// The child dies while draining for a stop: the stop that was answered
/// is carried out; it is not restarted.
#[tokio::test(start_paused = true)]
async fn a_child_that_dies_during_a_stop_drain_is_not_restarted() {
    let dies = Plan::Exit { lines: vec![READY], gap: S(6), exit: Exit::Code(1) };
    let q = Quirks { busy_until: Some(S(10_000)), ..Quirks::default() };
    let o = run_with(draining(), vec![dies], q, Some(S(8)), None).await;
    assert_eq!(o.code, Code::Ok);
    assert_eq!(spawn_times(&o), vec![S(0)]);
}

/// A failed run is reported before it is stopped: the stop signal follows
/// the report's end, to the virtual millisecond.
#[tokio::test(start_paused = true)]
async fn a_failed_run_is_stopped_when_its_report_is_written() {
    let plain = "(APIServer pid=1) INFO 11-29 18:00:00 [x.py:1] starting";
    let exits = Plan::Exit { lines: vec![plain], gap: S(1), exit: Exit::Code(1) };
    let mut p = policy();
    p.restart.max_attempts = 1;
    p.report = Some(S(25));
    let q = Quirks { report_takes: Some(Duration::from_millis(3500)), ..Quirks::default() };
    let o = run_with(p, vec![exits], q, None, None).await;
    assert_eq!(o.code, Code::GaveUp);
    assert!(o.calls.contains(&(S(1), Call::Report(1))), "{:?}", o.calls);
    let term = o.calls.iter().find(|(_, c)| *c == Call::Terminate(Signal::SIGTERM)).map(|(t, _)| *t);
    assert_eq!(term, Some(Duration::from_millis(4500)), "{:?}", o.calls);
    assert!(!o.calls.iter().any(|(_, c)| *c == Call::CancelReport));
    let failed = o.notes.iter().find_map(|(_, n)| match n {
        Note::Status(s) if s.starts_with("failed") => Some(s.clone()),
        _ => None,
    });
    assert_eq!(
        failed.as_deref(),
        Some("failed (attempt 1/1, writing the failure report): exited before ready (exit code 1)")
    );
}

/// A report that never ends holds the stop only for its budget.
#[tokio::test(start_paused = true)]
async fn a_wedged_report_is_cut_short_at_its_deadline() {
    let mut p = policy();
    p.restart.max_attempts = 1;
    p.report = Some(S(25));
    let q = Quirks { report_takes: None, ..Quirks::default() };
    // The run fails by a fatal line and its grace (5 s) after ready.
    let fatal = "(EngineCore pid=1) ERROR 11-29 18:11:02 [core.py:1] EngineCore failed to start.";
    let fatal = Plan::Run { lines: vec![READY, fatal], gap: S(1) };
    let o = run_with(p, vec![fatal], q, None, None).await;
    assert_eq!(o.code, Code::GaveUp);
    // The fatal line at 2 s, its grace over at 7 s: the report; 25 s later, cut.
    assert!(o.calls.contains(&(S(7), Call::Report(1))), "{:?}", o.calls);
    assert!(o.calls.contains(&(S(32), Call::CancelReport)), "{:?}", o.calls);
    assert!(o.calls.contains(&(S(32), Call::Terminate(Signal::SIGTERM))), "{:?}", o.calls);
}

/// A stop request while the report is written is answered at once: the
/// report is cut short and the tree stopped in the same instant.
#[tokio::test(start_paused = true)]
async fn a_stop_during_the_report_is_answered_at_once() {
    let exits = Plan::Exit {
        lines: vec!["(APIServer pid=1) INFO 11-29 18:00:00 [x.py:1] starting"],
        gap: S(1),
        exit: Exit::Code(1),
    };
    let mut p = policy();
    p.report = Some(S(25));
    let q = Quirks { report_takes: None, ..Quirks::default() };
    let o = run_with(p, vec![exits], q, Some(S(3)), None).await;
    assert_eq!(o.code, Code::Ok);
    assert!(o.calls.contains(&(S(1), Call::Report(1))), "{:?}", o.calls);
    assert!(o.calls.contains(&(S(3), Call::CancelReport)), "{:?}", o.calls);
    assert!(o.calls.contains(&(S(3), Call::Terminate(Signal::SIGTERM))), "{:?}", o.calls);
    assert!(o.notes.contains(&(S(3), Note::Stopping)), "{:?}", o.notes);
    assert_eq!(spawn_times(&o), vec![S(0)], "no restart after a stop");
}

/// Notes held while a write is put off never become a backlog: the newest
/// status and timeout extension only, behind the notes that must not wait,
/// and a held status older than one those notes carry is dropped.
#[test]
fn held_notes_keep_the_newest_of_each_kind_behind_ready() {
    let mut held = Held::default();
    for i in 0..20 {
        held.hold(vec![Note::Status(format!("loading {i}")), Note::ExtendTimeout(Duration::from_secs(i))]);
    }
    assert_eq!(
        held.behind(vec![Note::Ready]),
        vec![Note::Ready, Note::Status("loading 19".into()), Note::ExtendTimeout(Duration::from_secs(19))]
    );
    assert!(held.is_empty());
    held.hold(vec![Note::Status("stale".into())]);
    assert_eq!(
        held.behind(vec![Note::Ready, Note::Status("ready".into())]),
        vec![Note::Ready, Note::Status("ready".into())]
    );
}

/// Every turn of the loop is measured, from its wake to its next wait: a
/// turn held by a slow write is seen at its length (and logged past
/// `SLOW_TURN`), the others are short.
#[tokio::test(start_paused = true)]
async fn each_turn_of_the_loop_is_measured() {
    let held = std::time::Duration::from_millis(150);
    let q = Quirks { slow_observer: Some(held), ..Quirks::default() };
    let ok = Plan::Run { lines: vec![READY], gap: S(2) };
    let o = run_with(policy(), vec![ok], q, Some(S(10)), None).await;
    assert_eq!(o.code, Code::Ok);
    assert!(o.turns.len() > 3, "{:?}", o.turns);
    // The held turn is seen at its length; the others are short, as the
    // median says: on a machine starved of CPU any turn may also be slow
    // (two of seven were once over 130 ms).
    assert!(o.turns.iter().any(|t| *t >= held), "{:?}", o.turns);
    let mut sorted = o.turns.clone();
    sorted.sort();
    assert!(sorted[sorted.len() / 2] < SLOW_TURN, "{:?}", o.turns);
}

/// The test policy with an engine idle after a minute without requests.
fn idle_after_a_minute(action: crate::config::IdleAction) -> Policy {
    let idle = crate::supervisor::policy::IdlePolicy { after: S(60), action, level: 1 };
    Policy { idle: Some(idle), ..policy() }
}

/// A request at the front door from `from` to `to` (of the test's clock);
/// `idle`: the gate said idle when it came.
fn request(a: &Arc<crate::daemon::front::Activity>, from: Duration, to: Duration, idle: bool) {
    let a = a.clone();
    tokio::spawn(async move {
        tokio::time::sleep(from).await;
        a.begin(idle);
        tokio::time::sleep(to - from).await;
        a.end();
    });
}

#[tokio::test(start_paused = true)]
async fn an_idle_engine_is_stopped_on_time_and_started_by_the_next_request() {
    let activity = Arc::new(crate::daemon::front::Activity::default());
    // In flight from 30 s to 90 s: the minute counts from its end. Then a
    // request at 300 s, while the engine is stopped, starts it.
    request(&activity, S(30), S(90), false);
    request(&activity, S(300), S(310), true);
    let plans = vec![Plan::Run { lines: vec![READY], gap: S(1) }, Plan::Run { lines: vec![READY], gap: S(2) }];
    let q = Quirks { activity: Some(activity), ..Quirks::default() };
    let o = run_with(idle_after_a_minute(crate::config::IdleAction::Stop), plans, q, Some(S(500)), None).await;
    assert_eq!(o.code, Code::Ok);
    let mut terminations: Vec<Duration> =
        o.calls.iter().filter(|(_, c)| *c == Call::Terminate(Signal::SIGTERM)).map(|(t, _)| *t).collect();
    // The signal again once the leader is gone, for what it left: one stop each.
    terminations.dedup();
    // After the request's end; then a minute after the second start's
    // request ended (310 s); then the stop request finds nothing to stop.
    assert_eq!(terminations, vec![S(150), S(370)], "{:?}", o.calls);
    assert_eq!(spawn_times(&o), vec![S(0), S(300)]);
    assert!(o.calls.contains(&(S(150), Call::Parked)), "{:?}", o.calls);
    use crate::supervisor::outcome::Phase;
    assert!(o.phases.contains(&(S(150), Phase::Idle)) && o.phases.contains(&(S(302), Phase::Ready)), "{:?}", o.phases);
    let idle_status = |t: Duration| {
        o.notes.iter().any(|(at, n)| {
            *at == t
                && matches!(n, Note::Status(s) if s.starts_with("idle: stopped after 1m without requests; starts on the next request"))
        })
    };
    assert!(idle_status(S(150)) && idle_status(S(370)), "{:?}", o.notes);
}

#[tokio::test(start_paused = true)]
async fn a_long_load_does_not_make_an_idle_engine_of_a_new_one() {
    let activity = Arc::new(crate::daemon::front::Activity::default());
    let plans = vec![Plan::Run { lines: vec![READY], gap: S(200) }];
    let q = Quirks { activity: Some(activity), ..Quirks::default() };
    let p = Policy { stall: S(600), ..idle_after_a_minute(crate::config::IdleAction::Stop) };
    let o = run_with(p, plans, q, Some(S(400)), None).await;
    let first = o.calls.iter().find(|(_, c)| *c == Call::Terminate(Signal::SIGTERM)).map(|(t, _)| *t);
    assert_eq!(first, Some(S(260)), "a minute after ready, not at it: {:?}", o.calls);
}

#[tokio::test(start_paused = true)]
async fn a_sleeping_engine_is_woken_by_the_next_request() {
    let activity = Arc::new(crate::daemon::front::Activity::default());
    request(&activity, S(300), S(301), true);
    let plans = vec![Plan::Run { lines: vec![READY], gap: S(1) }];
    let q = Quirks { activity: Some(activity), ..Quirks::default() };
    let o = run_with(idle_after_a_minute(crate::config::IdleAction::Sleep), plans, q, Some(S(330)), None).await;
    assert_eq!(o.code, Code::Ok);
    assert!(o.calls.contains(&(S(61), Call::Sleep(1, 1))), "{:?}", o.calls);
    assert!(o.calls.contains(&(S(300), Call::Wake(1))), "{:?}", o.calls);
    assert_eq!(spawn_times(&o), vec![S(0)], "the engine stayed");
    use crate::supervisor::outcome::Phase;
    assert!(o.phases.contains(&(S(61), Phase::Idle)) && o.phases.contains(&(S(300), Phase::Ready)), "{:?}", o.phases);
    // Asleep from 61 s: the wake at 300 s, and no second sleep before 361 s.
    assert_eq!(o.calls.iter().filter(|(_, c)| matches!(c, Call::Sleep(..))).count(), 1);
}

#[tokio::test(start_paused = true)]
async fn a_wake_up_left_from_an_earlier_idle_spell_starts_nothing() {
    let activity = Arc::new(crate::daemon::front::Activity::default());
    // Told "idle" while the engine loads (a gate that had not caught up):
    // the request is answered before the engine is ever idle.
    request(&activity, S(0), S(1), true);
    let plans = vec![Plan::Run { lines: vec![READY], gap: S(2) }];
    let q = Quirks { activity: Some(activity), ..Quirks::default() };
    let o = run_with(idle_after_a_minute(crate::config::IdleAction::Stop), plans, q, Some(S(200)), None).await;
    assert_eq!(spawn_times(&o), vec![S(0)], "parked at 62 s and left so: {:?}", o.calls);
}

/// The statuses said, with their times.
fn statuses(o: &Outcome) -> Vec<(Duration, String)> {
    o.notes.iter().filter_map(|(t, n)| if let Note::Status(s) = n { Some((*t, s.clone())) } else { None }).collect()
}

fn ready_notes(o: &Outcome) -> Vec<Duration> {
    o.notes.iter().filter(|(_, n)| *n == Note::Ready).map(|(t, _)| *t).collect()
}

fn with_golden(on: crate::config::GoldenPolicy) -> Policy {
    Policy { golden: Some(on), ..policy() }
}

/// With the golden check on, READY=1 waits for its answers: the check is
/// asked once the server answers, and the run is ready when they come.
#[tokio::test(start_paused = true)]
async fn the_golden_answers_come_before_ready() {
    use crate::supervisor::outcome::Phase;
    let q = Quirks { golden_takes: S(3), ..Quirks::default() };
    let serving = Plan::Run { lines: vec![READY], gap: S(2) };
    let o = run_with(with_golden(crate::config::GoldenPolicy::Warn), vec![serving], q, Some(S(20)), None).await;
    assert_eq!(o.code, Code::Ok);
    assert_eq!(times(&o, |c| *c == Call::Golden(1)), vec![S(2)], "{:?}", o.calls);
    assert_eq!(ready_notes(&o), vec![S(5)], "{:?}", o.notes);
    assert!(o.phases.contains(&(S(5), Phase::Ready)), "{:?}", o.phases);
    assert!(
        statuses(&o).iter().any(|(t, s)| *t == S(2) && s.ends_with(": checking the golden answers")),
        "{:?}",
        o.notes
    );
    // Ready with the answers as recorded: the setup is kept as good.
    assert_eq!(times(&o, |c| *c == Call::SetupGood), vec![S(5)]);
}

/// `golden.on-mismatch = "fail"`: changed answers fail the run, which is
/// stopped and started again; the next start's answers make it ready. The
/// failed setup is never kept as good.
#[tokio::test(start_paused = true)]
async fn changed_golden_answers_fail_the_run_and_the_next_start_is_checked_again() {
    use crate::supervisor::golden::Verdict;
    let changed = Verdict::Changed { text: "answers changed: prompt 1 differs at token 3".into(), ms: 40 };
    let q = Quirks { golden_takes: S(1), verdicts: vec![changed], ..Quirks::default() };
    let serving = Plan::Run { lines: vec![READY], gap: S(2) };
    let p = with_golden(crate::config::GoldenPolicy::Fail);
    let o = run_with(p, vec![serving.clone(), serving], q, Some(S(30)), None).await;
    assert_eq!(o.code, Code::Ok);
    assert_eq!(times(&o, |c| matches!(c, Call::Golden(_))), vec![S(2), S(15)], "{:?}", o.calls);
    assert!(o.calls.contains(&(S(15), Call::Golden(2))), "{:?}", o.calls);
    assert_eq!(terminations(&o).first(), Some(&S(3)), "{:?}", o.calls);
    // Restarted after the backoff's 10 s; ready only after the second answers.
    assert_eq!(spawn_times(&o), vec![S(0), S(13)]);
    assert_eq!(ready_notes(&o), vec![S(16)], "{:?}", o.notes);
    assert_eq!(times(&o, |c| *c == Call::SetupGood), vec![S(16)]);
    assert!(
        statuses(&o)
            .iter()
            .any(|(t, s)| *t == S(3) && s.starts_with("failed") && s.contains("prompt 1 differs at token 3")),
        "{:?}",
        o.notes
    );
}

/// `golden.interval`: the serving run is taken out of rotation, its
/// answers asked again, and put back once they are the same.
#[tokio::test(start_paused = true)]
async fn golden_interval_rechecks_the_serving_run_out_of_rotation() {
    use crate::supervisor::outcome::Phase;
    let q = Quirks { golden_takes: S(1), ..Quirks::default() };
    let p = Policy { golden_interval: Some(S(60)), ..with_golden(crate::config::GoldenPolicy::Fail) };
    let serving = Plan::Run { lines: vec![READY], gap: S(2) };
    let o = run_with(p, vec![serving], q, Some(S(100)), None).await;
    assert_eq!(o.code, Code::Ok);
    // Ready at 3 s; the interval counts from there.
    assert_eq!(times(&o, |c| *c == Call::Golden(1)), vec![S(2), S(63)], "{:?}", o.calls);
    let after_ready: Vec<_> = o.phases.iter().filter(|(t, _)| *t >= S(3) && *t < S(100)).cloned().collect();
    assert_eq!(after_ready, vec![(S(3), Phase::Ready), (S(63), Phase::Rechecking), (S(64), Phase::Ready)]);
    assert_eq!(spawn_times(&o), vec![S(0)], "the run stayed");
}

/// vLLM's words for a KV cache too small for one request of the model's
/// length.
const KV_TOO_SMALL: &str = "(EngineCore pid=7) ERROR 12-02 12:26:28 [core.py:1510] ValueError: To serve at least one request with the model's max seq len (1500000), (1.43 GiB KV cache is needed, which is larger than the available KV cache memory (1.0 GiB). Based on the available memory, the estimated maximum model length is 1048448. Try increasing `gpu_memory_utilization`";

/// What the ledger knows of a setup: its fingerprint, memory fit's values
/// as the start uses them, and the last one that reached ready.
fn setup(
    fingerprint: &str,
    used: &[(crate::config::FitArg, &str, crate::supervisor::fit::Source)],
    last_good: Option<(&str, &str)>,
) -> crate::supervisor::load::LoadStart {
    crate::supervisor::load::LoadStart {
        fingerprint: fingerprint.into(),
        used: used.iter().map(|(a, v, s)| (*a, (v.to_string(), *s))).collect(),
        last_good: last_good.map(|(f, at)| (f.into(), at.into())),
        ..Default::default()
    }
}

/// `[fit]`: a memory error restarts at once with the argument moved (the
/// backend told the values for the next starts), and the values that
/// reach ready are pinned for the setup.
#[tokio::test(start_paused = true)]
async fn a_memory_error_restarts_at_once_with_the_fitted_value_and_pins_it_at_ready() {
    use crate::config::FitArg;
    use crate::supervisor::fit::Source;
    let p = Policy { fit: Some(crate::config::Fit { enabled: true, attempts: 2, ..Default::default() }), ..policy() };
    let q = Quirks {
        setups: vec![setup("00000000000000aa", &[(FitArg::MaxModelLen, "1500000", Source::Config)], None)],
        ..Quirks::default()
    };
    let too_small = Plan::Exit { lines: vec![KV_TOO_SMALL], gap: S(1), exit: Exit::Code(1) };
    let serving = Plan::Run { lines: vec![READY], gap: S(2) };
    let o = run_with(p, vec![too_small, serving], q, Some(S(20)), None).await;
    assert_eq!(o.code, Code::Ok);
    let fitted = BTreeMap::from([(FitArg::MaxModelLen, "1047552".to_string())]);
    assert!(o.calls.contains(&(S(1), Call::Fit(fitted.clone()))), "{:?}", o.calls);
    // No backoff: the fitted start follows at once.
    assert_eq!(spawn_times(&o), vec![S(0), S(1)]);
    assert_eq!(times(&o, |c| *c == Call::Pin(fitted.clone())), vec![S(3)], "{:?}", o.calls);
    assert_eq!(times(&o, |c| matches!(c, Call::Unpin(_))), vec![], "{:?}", o.calls);
    assert_eq!(ready_notes(&o), vec![S(3)]);
    assert!(
        statuses(&o).iter().any(|(t, s)| *t == S(3) && s.ends_with("; --max-model-len 1047552 (fitted)")),
        "{:?}",
        o.notes
    );
    let loads: Vec<_> = o.calls.iter().filter(|(_, c)| matches!(c, Call::LoadEnded(_))).cloned().collect();
    assert_eq!(loads, vec![(S(1), Call::LoadEnded("failed".into())), (S(3), Call::LoadEnded("ready".into()))]);
}

/// A start with pinned values that fails drops its pins: they no longer
/// prove what fits.
#[tokio::test(start_paused = true)]
async fn a_start_with_pinned_values_that_fails_drops_its_pins() {
    use crate::config::FitArg;
    use crate::supervisor::fit::Source;
    let mut p = Policy { fit: Some(crate::config::Fit { enabled: true, ..Default::default() }), ..policy() };
    p.restart.max_attempts = 1;
    let used = [(FitArg::MaxModelLen, "69632", Source::Pinned), (FitArg::GpuMemoryUtilization, "0.9", Source::Default)];
    let q = Quirks { setups: vec![setup("00000000000000aa", &used, None)], ..Quirks::default() };
    let crash = Plan::Exit { lines: vec![STARTING], gap: S(1), exit: Exit::Code(1) };
    let o = run_with(p, vec![crash], q, None, None).await;
    assert_eq!(o.code, Code::GaveUp);
    let pinned = BTreeMap::from([(FitArg::MaxModelLen, "69632".to_string())]);
    assert_eq!(times(&o, |c| *c == Call::Unpin(pinned.clone())), vec![S(1)], "{:?}", o.calls);
    assert!(!o.calls.iter().any(|(_, c)| matches!(c, Call::Pin(_) | Call::SetupGood)), "{:?}", o.calls);
}

/// A line that says nothing to the machine.
const STARTING: &str = "(APIServer pid=1) INFO 11-29 18:00:00 [x.py:1] starting";

/// The settings of the last-known-good setup, as the backend gives them
/// for a rollback (the golden check on, as for any served model).
fn good_settings() -> crate::config::Settings {
    let dirs = crate::config::Dirs { state: Some("/state".into()), ..Default::default() };
    let text = "name = \"t\"\n[child]\ncommand = [\"vllm\", \"serve\", \"/models/good\"]\n";
    crate::config::parse(text, std::path::Path::new("/etc/vllm-warden/t.toml"), &dirs).unwrap()
}

const GOOD: (&str, &str) = ("00000000000000bb", "2026-12-02T10:00:00Z");

/// `[rollback]`: a changed setup that fails for the last time is replaced
/// by the last-known-good one: its settings taken from the backend and
/// put to use, a start of it, and its ready said as a rollback's.
#[tokio::test(start_paused = true)]
async fn a_failing_new_setup_rolls_back_to_the_last_known_good() {
    let mut p = Policy { rollback: true, ..policy() };
    p.restart.max_attempts = 1;
    let q = Quirks {
        setups: vec![setup("00000000000000aa", &[], Some(GOOD)), setup(GOOD.0, &[], None)],
        good: Some(good_settings()),
        ..Quirks::default()
    };
    let crash = Plan::Exit { lines: vec![STARTING], gap: S(1), exit: Exit::Code(1) };
    let serving = Plan::Run { lines: vec![READY], gap: S(2) };
    let o = run_with(p, vec![crash, serving], q, Some(S(20)), None).await;
    assert_eq!(o.code, Code::Ok);
    // Asked once, its settings put to use before the good setup's start.
    let at_one: Vec<Call> = o.calls.iter().filter(|(t, _)| *t == S(1)).map(|(_, c)| c.clone()).collect();
    let order: Vec<&Call> =
        at_one.iter().filter(|c| matches!(c, Call::Rollback | Call::Reconfigure | Call::Spawn(_))).collect();
    assert_eq!(order, vec![&Call::Rollback, &Call::Reconfigure, &Call::Spawn(2)], "{:?}", o.calls);
    assert_eq!(times(&o, |c| *c == Call::Rollback).len(), 1);
    assert!(
        statuses(&o).iter().any(|(t, s)| *t == S(1)
            && s.starts_with("the new setup 00000000000000aa failed: exited before ready (exit code 1); starting the last-known-good setup 00000000000000bb from 2026-12-02T10:00:00Z")),
        "{:?}",
        o.notes
    );
    assert_eq!(ready_notes(&o), vec![S(3)]);
    assert!(
        statuses(&o).iter().any(|(t, s)| *t == S(3)
            && s.starts_with("serving last-known-good from 2026-12-02T10:00:00Z; the new setup failed: exited before ready (exit code 1); ready: pid 102")),
        "{:?}",
        o.notes
    );
}

/// A rollback the backend cannot make ends the warden as without one,
/// saying why.
#[tokio::test(start_paused = true)]
async fn a_rollback_that_cannot_be_made_ends_the_warden_saying_why() {
    let mut p = Policy { rollback: true, ..policy() };
    p.restart.max_attempts = 1;
    let q = Quirks { setups: vec![setup("00000000000000aa", &[], Some(GOOD))], good: None, ..Quirks::default() };
    let crash = Plan::Exit { lines: vec![STARTING], gap: S(1), exit: Exit::Code(1) };
    let o = run_with(p, vec![crash], q, None, None).await;
    assert_eq!(o.code, Code::GaveUp);
    assert_eq!(times(&o, |c| *c == Call::Rollback), vec![S(1)]);
    assert!(!o.calls.iter().any(|(_, c)| *c == Call::Reconfigure), "{:?}", o.calls);
    assert_eq!(spawn_times(&o), vec![S(0)]);
    let last = statuses(&o).last().map(|(_, s)| s.clone()).unwrap_or_default();
    assert!(
        last.starts_with("gave up after 1 failed starts: exited before ready (exit code 1)")
            && last.ends_with(
                "the last-known-good setup cannot be started: no setup has reached ready in this warden's life"
            ),
        "{last}"
    );
}

/// A leader the kernel's OOM killer ended: the backend's word on it is
/// the run's cause, before its exit.
#[tokio::test(start_paused = true)]
async fn a_leader_killed_by_the_oom_killer_fails_with_that_cause() {
    let mut p = policy();
    p.restart.max_attempts = 1;
    let oom = "killed by the kernel's OOM killer: pid 101 (python3), anon-rss 60.0 GiB".to_string();
    let q = Quirks { oom: Some(oom.clone()), ..Quirks::default() };
    let killed = Plan::Exit { lines: vec![READY], gap: S(2), exit: Exit::Signal(crate::supervisor::Signal::SIGKILL) };
    let o = run_with(p, vec![killed], q, None, None).await;
    assert_eq!(o.code, Code::GaveUp);
    let last = statuses(&o).last().map(|(_, s)| s.clone()).unwrap_or_default();
    assert!(last.starts_with(&format!("gave up after 1 failed starts: {oom}")), "{last}");
}

fn upgrade_calls(o: &Outcome) -> Vec<(Duration, Call)> {
    let of_upgrade =
        |c: &Call| matches!(c, Call::CheckUpgrade | Call::PauseLines | Call::ExecUpgrade { .. } | Call::ResumeLines(_));
    o.calls.iter().filter(|(_, c)| of_upgrade(c)).cloned().collect()
}

/// An upgrade asked for while the model loads is checked at once and
/// carried out once the run is ready: the lines paused at a line's end,
/// the ready run handed over with that offset. The exec fails here, so
/// this warden goes on following from the same offset, the run ready.
#[tokio::test(start_paused = true)]
async fn an_upgrade_asked_while_loading_is_handed_over_once_ready() {
    use crate::supervisor::outcome::Phase;
    let q = Quirks { upgrade: Some(Ok("9.9.9".into())), requests: vec![(S(1), Request::Upgrade)], ..Quirks::default() };
    let serving = Plan::Run { lines: vec![READY], gap: S(3) };
    let o = run_with(policy(), vec![serving], q, Some(S(10)), None).await;
    assert_eq!(o.code, Code::Ok);
    assert_eq!(
        upgrade_calls(&o),
        vec![
            (S(1), Call::CheckUpgrade),
            (S(3), Call::PauseLines),
            (S(3), Call::ExecUpgrade { start: 1, pid: 101, offset: PAUSED_AT }),
            (S(3), Call::ResumeLines(PAUSED_AT)),
        ]
    );
    assert_eq!(
        o.phases.iter().filter(|(t, _)| *t < S(10)).cloned().collect::<Vec<_>>(),
        vec![(S(0), Phase::Starting), (S(3), Phase::Ready)]
    );
    assert_eq!(spawn_times(&o), vec![S(0)]);
}

/// A binary that does not answer as a warden: the upgrade is refused,
/// said in `STATUS=`, and nothing is paused or handed over.
#[tokio::test(start_paused = true)]
async fn a_refused_upgrade_is_said_and_the_run_goes_on() {
    use crate::supervisor::outcome::Phase;
    let q = Quirks {
        upgrade: Some(Err(crate::daemon::upgrade::UpgradeError::NoOwnPath)),
        requests: vec![(S(5), Request::Upgrade)],
        ..Quirks::default()
    };
    let serving = Plan::Run { lines: vec![READY], gap: S(2) };
    let o = run_with(policy(), vec![serving], q, Some(S(10)), None).await;
    assert_eq!(o.code, Code::Ok);
    assert_eq!(upgrade_calls(&o), vec![(S(5), Call::CheckUpgrade)]);
    assert!(
        o.notes.contains(&(S(5), Note::Status("upgrade refused: the warden's own path is not known".into()))),
        "{:?}",
        o.notes
    );
    assert_eq!(
        o.phases.iter().filter(|(t, _)| *t < S(10)).cloned().collect::<Vec<_>>(),
        vec![(S(0), Phase::Starting), (S(2), Phase::Ready)]
    );
}

/// An upgrade asked for during a drain waits until the drain is held,
/// then hands the drained run over.
#[tokio::test(start_paused = true)]
async fn an_upgrade_waits_for_a_drain_under_way() {
    let q = Quirks {
        upgrade: Some(Ok("9.9.9".into())),
        busy_until: Some(S(12)),
        requests: vec![(S(10), Request::Control(Control::Drain)), (S(11), Request::Upgrade)],
        ..Quirks::default()
    };
    let serving = Plan::Run { lines: vec![READY], gap: S(2) };
    let o = run_with(policy(), vec![serving], q, Some(S(30)), None).await;
    assert_eq!(o.code, Code::Ok);
    // Drain delay 5 s, then the requests in flight counted: held at 15 s.
    assert_eq!(
        upgrade_calls(&o),
        vec![
            (S(11), Call::CheckUpgrade),
            (S(15), Call::PauseLines),
            (S(15), Call::ExecUpgrade { start: 1, pid: 101, offset: PAUSED_AT }),
            (S(15), Call::ResumeLines(PAUSED_AT)),
        ]
    );
}
