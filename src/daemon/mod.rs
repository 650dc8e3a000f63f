//! The daemon's composition: `run(settings, notifier, watchdog, requests)`
//! wires the real parts (the process tree, the log follower, the pre-start
//! steps, HTTP readiness and health, the status files, the journal) around
//! the driver's loop and returns the exit code. Where requests come from
//! (signals, the demo, a test) and how arguments are parsed are not known
//! here.

pub mod driver;
pub mod environment;
pub mod prepare;
pub mod reload;
pub mod server;
pub mod upgrade;

use std::sync::{Arc, Condvar, Mutex};
use std::time::Duration;

use nix::sys::signal::Signal;
use tokio::sync::{mpsc, oneshot, watch};
use tokio::task::AbortHandle;
use tokio_stream::Stream;

use self::driver::{Backend, Context, Input, Request};
use crate::config::{self, Dirs, Settings};
use crate::observe::logwatch::{Delivery, Follower, Tap};
use crate::observe::notify::Notifier;
use crate::process::child::{self, Spec, Tree};
use crate::supervisor::classify::{Classifier, Level};
use crate::supervisor::exit::Code;
use crate::supervisor::outcome::{Prepared, StartFailure};
use crate::supervisor::{Machine, Policy, State};
use crate::util::redact;
use crate::util::tasks::{Lifetime, Tasks};

/// A current-thread runtime: the loop is one thread, and blocking work
/// goes to tokio's blocking pool.
pub fn runtime() -> Result<tokio::runtime::Runtime, Code> {
    tokio::runtime::Builder::new_current_thread().enable_all().build().map_err(|e| {
        eprintln!("vllm-warden: cannot start the runtime: {e}");
        Code::Internal
    })
}

/// Supervise `settings` until the machine is done, taking requests (stop,
/// reload) from `requests`; returns the exit code.
pub async fn run(
    settings: Settings,
    mut notifier: impl Notifier,
    watchdog: Option<Duration>,
    requests: impl Stream<Item = Request>,
    handover: Handover,
) -> Code {
    let classifier = match Classifier::new(&settings.patterns) {
        Ok(c) => c,
        Err(e) => {
            tracing::error!(error = %e, "invalid pattern");
            return Code::Config;
        }
    };
    let token = match (&handover.adopted, crate::process::prestart::new_run_token()) {
        (Some(state), _) => state.token.clone(),
        (None, Ok(t)) => t,
        (None, Err(e)) => {
            tracing::error!(error = %e, "cannot read /dev/urandom for the run token");
            return Code::Internal;
        }
    };
    let heartbeat = crate::daemon::driver::Heartbeat::default();
    let ctx = Context { instance: settings.name.clone(), watchdog, heartbeat: Some(heartbeat.clone()) };
    // The endpoint's listeners, before anything starts: a TCP listener
    // that cannot be had is a config problem; the socket is worth a warning.
    let socket = match crate::daemon::server::bind_socket(&settings.server.socket) {
        Ok(l) => Some(l),
        Err(e) => {
            tracing::warn!(error = %e, "the control socket is off: `vllm-warden drain|undrain|restart` cannot reach this warden");
            None
        }
    };
    let tcp =
        match settings.server.listen.map(|a| crate::daemon::server::bind_tcp(a, settings.server.token_file.as_deref()))
        {
            Some(Ok(l)) => Some(l),
            Some(Err(e)) => {
                tracing::error!(error = %e, "cannot serve [server] listen");
                return Code::Config;
            }
            None => None,
        };
    let (view_tx, view_rx) = tokio::sync::watch::channel(crate::daemon::server::View::default());
    let (control_tx, control_rx) = mpsc::unbounded_channel();
    let requests =
        tokio_stream::StreamExt::merge(requests, tokio_stream::wrappers::UnboundedReceiverStream::new(control_rx));
    let last_check = crate::observe::health::LastCheck::default();
    let (tx, mut rx) = mpsc::unbounded_channel();
    let (lines_tx, mut lines_rx) = mpsc::channel(crate::observe::logwatch::QUEUE);
    let journal = crate::observe::journal::Forwarder::from_env(&settings.name);
    let gatherer = journal.as_ref().map(|j| j.gatherer());
    let mut observer = Reports {
        status: crate::observe::status::Reporter::new(
            &settings.name,
            &settings.status.file,
            settings.status.metrics_file.as_deref(),
        ),
        journal,
        next_journal_count: std::time::Instant::now(),
        tree: TreeRecord::new(settings.state_dir.clone(), settings.name.clone(), token.clone()),
        view: view_tx,
    };
    observer.status.set_cache_dir(settings.child.cache_dir.as_deref());
    for w in crate::daemon::environment::describe_child(&settings).1 {
        tracing::warn!(INSTANCE = settings.name.as_str(), EVENT = "caches", "{w}");
    }
    let shared = crate::daemon::server::Shared {
        view: view_rx,
        heartbeat,
        metrics: observer.status.metrics(),
        last_check: last_check.clone(),
        requests: control_tx,
    };
    let socket_path = settings.server.socket.clone();
    crate::daemon::reload::save_running(&settings);
    let policy = Policy::from_settings(&settings);
    let cleanup = settings.clone();
    let mut backend = match Real::new(settings, classifier, tx, lines_tx, gatherer, token) {
        Ok(b) => b,
        Err(e) => {
            tracing::error!(error = %e, "cannot become a subreaper");
            return Code::Internal;
        }
    };
    let adopted = handover.adopted.clone();
    backend.handover = handover;
    let machine = match adopted.map(|state| backend.adopt(&state).map(|()| state)) {
        Some(Ok(state)) => {
            Machine::adopt(policy, fastrand::u64(..), &state.machine, &state.from, tokio::time::Instant::now())
        }
        Some(Err(e)) => {
            // The child is ours and recorded with its token: the pre-start
            // steps stop it as a leftover, then the model is loaded again.
            tracing::error!(EVENT = "upgrade", error = %e, "cannot take the ready run over: starting again");
            Machine::new(policy, fastrand::u64(..))
        }
        None => Machine::new(policy, fastrand::u64(..)),
    };
    backend.last_check = last_check;
    // Watched as every other task: an endpoint that stops serving is a
    // part of the warden that died.
    if let Some(l) = socket {
        backend.tasks.spawn("control socket", Lifetime::Owned, crate::daemon::server::serve_socket(l, shared.clone()));
    }
    if let Some((l, token)) = tcp {
        backend.tasks.spawn("TCP endpoint", Lifetime::Owned, crate::daemon::server::serve_tcp(l, token, shared));
    }
    let code = driver::Loop {
        machine,
        backend: &mut backend,
        notifier: &mut notifier,
        inputs: &mut rx,
        lines: &mut lines_rx,
        ctx: &ctx,
        observer: &mut observer,
        upgrade: None,
    }
    .run(requests)
    .await;
    let exit = ExitDeadline::start(&cleanup.name, code, EXIT_DEADLINE);
    // Reports of runs that ended beside a new one may still be written.
    exit.at("waiting for the failure reports being written");
    backend.finish_reports(crate::supervisor::policy::REPORT_MARGIN).await;
    // The tree is gone: no record of it, and what it left in /dev/shm goes
    // now, not at the next start. (The loop is over: blocking is fine.)
    exit.at("clearing the tree record");
    observer.tree.finish();
    exit.at("removing the files the tree left");
    if crate::util::tasks::injected_panic("exit") {
        // A read that never returns, for the test of the exit's deadline.
        std::thread::sleep(Duration::MAX);
    }
    crate::daemon::prepare::clean_leftover_files(&cleanup);
    exit.at("closing");
    drop(backend);
    let _ = std::fs::remove_file(&socket_path);
    exit.at("ending the process");
    code
}

/// How long the warden may take to end once its loop is done: the wait
/// for failure reports still being written, plus a margin for the rest.
pub const EXIT_DEADLINE: Duration = crate::supervisor::policy::REPORT_MARGIN.saturating_add(Duration::from_secs(10));

/// The warden's exit has a deadline too. What follows the loop (reports
/// still being written, the tree record, the files the tree left, the
/// runtime's end) reads files and `/proc`, and a read can block, for
/// example on a process stuck in the kernel; a stopped warden must end all
/// the same. Past the deadline, the step it was held at is logged and the
/// process ends with the loop's code.
struct ExitDeadline {
    step: Arc<Mutex<&'static str>>,
}

impl ExitDeadline {
    fn start(instance: &str, code: Code, within: Duration) -> ExitDeadline {
        let step = Arc::new(Mutex::new("ending"));
        let (s, instance) = (step.clone(), instance.to_string());
        let spawned = std::thread::Builder::new().name("exit deadline".into()).spawn(move || {
            // Not a wait for a condition: the process ends before this
            // returns, or this ends it.
            std::thread::sleep(within);
            let at = *s.lock().unwrap_or_else(|p| p.into_inner());
            tracing::error!(
                INSTANCE = instance.as_str(),
                EVENT = "exit",
                "the exit was held up for {} at: {at}; ending now with code {code}",
                humantime::format_duration(within)
            );
            // SAFETY: _exit ends the process at once; nothing of ours runs
            // after it (the held-up step may hold locks: no destructor may
            // wait for them).
            unsafe { libc::_exit(i32::from(code.as_u8())) }
        });
        if let Err(e) = spawned {
            tracing::warn!(error = %e, "cannot start the exit's deadline");
        }
        ExitDeadline { step }
    }

    fn at(&self, step: &'static str) {
        tracing::debug!(EVENT = "exit", "exit: {step}");
        *self.step.lock().unwrap_or_else(|p| p.into_inner()) = step;
    }
}

/// The status files and the tree record, kept up to date by the loop.
struct Reports {
    status: crate::observe::status::Reporter,
    /// Its count of dropped lines goes into the metrics.
    journal: Option<crate::observe::journal::Forwarder>,
    /// When that count is read next.
    next_journal_count: std::time::Instant,
    tree: TreeRecord,
    /// What the HTTP endpoint shows.
    view: tokio::sync::watch::Sender<crate::daemon::server::View>,
}

impl Reports {
    fn publish(&self, m: Option<&Machine>) {
        let document = self.status.document();
        self.view.send_if_modified(|v| {
            let mut next = v.clone();
            if let Some(m) = m {
                next.phase = m.phase();
                next.cause = m
                    .cause()
                    .map(|c| crate::util::escape::one_line(&redact::text(&c.text), crate::util::escape::MAX_LINE));
            }
            next.document = document;
            let changed = next != *v;
            *v = next;
            changed
        });
    }
}

/// How often the journal's count of dropped lines is brought into the
/// metrics while nothing else changes.
const JOURNAL_COUNT_EVERY: Duration = Duration::from_secs(5);

impl driver::Observer for Reports {
    fn changed(&mut self, m: &Machine) {
        if let Some(j) = &self.journal {
            self.status.set_journal_dropped(j.dropped());
        }
        self.status.update(&m.snapshot());
        self.tree.update(m);
        self.publish(Some(m));
    }
    fn reconfigure(&mut self, s: &Settings) {
        self.status.set_paths(&s.status.file, s.status.metrics_file.as_deref());
        self.status.set_cache_dir(s.child.cache_dir.as_deref());
    }

    fn settled(&mut self) {
        self.tree.settle();
    }

    fn put_off(&self) -> bool {
        self.status.write_waits()
    }

    fn due(&self) -> Option<std::time::Instant> {
        let journal = self.journal.as_ref().map(|_| self.next_journal_count);
        [self.status.due(), journal].into_iter().flatten().min()
    }

    fn flush(&mut self) {
        let now = std::time::Instant::now();
        if let Some(j) = &self.journal
            && now >= self.next_journal_count
        {
            self.status.set_journal_dropped(j.dropped());
            self.next_journal_count = now + JOURNAL_COUNT_EVERY;
        }
        if self.status.due().is_some_and(|d| d <= now) {
            self.status.flush();
            self.publish(None);
        }
    }
}

/// What each follower gives every line it reads besides its class.
#[derive(Clone)]
struct Taps {
    journal: Option<crate::observe::journal::Gatherer>,
    /// Set when the log shows tokens being generated; read by the canary.
    traffic: crate::observe::health::Traffic,
}

struct LineTap {
    journal: Option<crate::observe::journal::Gatherer>,
    /// The throughput line's literal, searched before its regex.
    literal: memchr::memmem::Finder<'static>,
    generation: crate::observe::health::GenerationLine,
    traffic: crate::observe::health::Traffic,
}

impl Tap for LineTap {
    fn line(&mut self, text: &str, level: Option<Level>) {
        if let Some(j) = &mut self.journal {
            j.line(text, level);
        }
        // The literal first: nearly every line lacks it, and the regex
        // allocates its captures.
        if self.literal.find(text.as_bytes()).is_some() && self.generation.matches(text) {
            self.traffic.saw_generation();
        }
    }

    fn end_of_read(&mut self) {
        if let Some(j) = &mut self.journal {
            j.flush();
        }
    }
}

/// Keeps the child's tree recorded in the state directory while it runs,
/// for a warden started after this one was killed (see `prestart`). The
/// `/proc` walk and the file write are done by a thread of their own; the
/// loop only leaves the latest job in its mailbox.
struct TreeRecord {
    state_dir: std::path::PathBuf,
    mailbox: Arc<(Mutex<Option<RecordJob>>, Condvar)>,
    worker: Option<std::thread::JoinHandle<()>>,
    /// The phase, progress and instant of the last record, while there is one.
    last: Option<(crate::supervisor::outcome::Phase, Option<String>, std::time::Instant)>,
    /// A job due, posted once the change's notifications are sent (the
    /// recorder's thread must not hold them back).
    due: Option<RecordJob>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum RecordJob {
    Record,
    Clear,
    /// The warden is exiting: stop after the job under way.
    Stop,
}

impl TreeRecord {
    fn new(state_dir: std::path::PathBuf, instance: String, token: String) -> TreeRecord {
        let mailbox: Arc<(Mutex<Option<RecordJob>>, Condvar)> = Arc::default();
        let (m, dir) = (mailbox.clone(), state_dir.clone());
        let spawned = std::thread::Builder::new().name("tree record".into()).spawn(move || {
            loop {
                let job = {
                    let (slot, ready) = &*m;
                    let mut slot = slot.lock().unwrap_or_else(|p| p.into_inner());
                    loop {
                        if let Some(job) = slot.take() {
                            break job;
                        }
                        slot = ready.wait(slot).unwrap_or_else(|p| p.into_inner());
                    }
                };
                match job {
                    RecordJob::Record => {
                        if let Err(e) = crate::process::prestart::record_tree(&dir, &instance, &token) {
                            tracing::warn!(error = %e, "cannot record the child's tree in the state directory");
                        }
                    }
                    RecordJob::Clear => crate::process::prestart::clear_record(&dir),
                    RecordJob::Stop => return,
                }
            }
        });
        let worker = spawned
            .inspect_err(|e| {
                tracing::warn!(error = %e, "cannot start the tree recorder: a killed warden's leftovers will not be found")
            })
            .ok();
        TreeRecord { state_dir, mailbox, worker, last: None, due: None }
    }

    /// The warden is done and its tree gone: wait for the recorder, then
    /// leave no record behind.
    fn finish(&mut self) {
        self.settle();
        self.post(RecordJob::Stop);
        if let Some(w) = self.worker.take() {
            let _ = w.join();
        }
        crate::process::prestart::clear_record(&self.state_dir);
    }

    /// Post the job due, if any.
    fn settle(&mut self) {
        if let Some(job) = self.due.take() {
            self.post(job);
        }
    }

    fn post(&self, job: RecordJob) {
        let (slot, ready) = &*self.mailbox;
        *slot.lock().unwrap_or_else(|p| p.into_inner()) = Some(job);
        ready.notify_one();
    }

    /// Recorded again at every change of phase and, while loading, of the
    /// progress line (vLLM starts its engine and workers after the spawn;
    /// at most once a second); cleared when the tree is gone.
    fn update(&mut self, m: &Machine) {
        let phase = m.phase();
        let progress = m.progress().map(String::from);
        match m.state() {
            State::Starting(_) | State::Ready(_) => {
                let due = match &self.last {
                    Some((p, text, t)) => *p != phase || (*text != progress && t.elapsed() >= Duration::from_secs(1)),
                    None => true,
                };
                if due {
                    self.due = Some(RecordJob::Record);
                    self.last = Some((phase, progress, std::time::Instant::now()));
                }
            }
            // The tree is gone (a start without a backoff clears it here,
            // beside its pre-start steps).
            State::Backoff { .. } | State::Launching { .. } | State::Done(_) if self.last.is_some() => {
                self.due = Some(RecordJob::Clear);
                self.last = None;
            }
            _ => {}
        }
    }
}

/// How often a drain counts the requests in flight.
const LOAD_EVERY: Duration = Duration::from_millis(100);
/// What the backend keeps of the latest run for its failure report.
struct RunRecord {
    start: u32,
    spawned: std::time::SystemTime,
    log_file: std::path::PathBuf,
    /// Where the run's lines begin in the log.
    offset: u64,
    /// Where the run began among the kernel messages followed.
    kernel: Option<crate::observe::kernel::Mark>,
    /// The child's log file, as it was given it.
    log: Option<Arc<std::fs::File>>,
}

/// How often a ready child's log is read at most.
const SERVING_PACE: Duration = Duration::from_millis(10);

/// The backend with real processes, a real log file and real HTTP.
pub struct Real {
    settings: Settings,
    /// Every background task, watched by the loop through `task_failed`.
    tasks: Tasks,
    tree: Tree,
    /// The effective patterns, compiled; each follower gets a copy.
    classifier: Classifier,
    follower: Option<Follower>,
    /// The kernel messages, for GPU faults: one follower for the warden's
    /// life (started at the first spawn, again if its source changes), not
    /// one per start, which would put a process spawn on the restart path.
    kernel: Option<(Vec<String>, crate::observe::kernel::Follower)>,
    /// The start a GPU fault belongs to: the latest spawn.
    kernel_start: Arc<std::sync::atomic::AtomicU32>,
    /// Where followers hand on the lines that matter.
    lines: mpsc::Sender<Delivery>,
    taps: Taps,
    probe: Option<AbortHandle>,
    /// The pre-start steps running for a start.
    preparing: Option<(u32, AbortHandle)>,
    /// The health checks of the ready run `start`.
    health: Option<(u32, AbortHandle)>,
    /// The last health check's verdict, for `/readyz`.
    last_check: crate::observe::health::LastCheck,
    /// A drain's watch of the requests in flight.
    load: Option<AbortHandle>,
    /// Seen in the log: the canary waits while real traffic flows.
    traffic: crate::observe::health::Traffic,
    /// The latest run: what its failure report needs.
    run: Option<RunRecord>,
    /// The failure report being written.
    reporting: Option<AbortHandle>,
    /// Open once the last report has taken what describes its run (its
    /// tree, its log, the GPUs): the next spawn waits for it.
    /// Kept (each start looks at a copy): a start given up while it waited
    /// leaves it for the next.
    report_gate: Option<watch::Receiver<bool>>,
    /// Answered as each report ends (or is dropped).
    reports: Vec<oneshot::Receiver<()>>,
    /// Between the failure reports and the log's rotations.
    log_hold: crate::observe::rotate::Hold,
    /// Put in every child's environment (`prestart::RUN_TOKEN`).
    token: String,
    inputs: mpsc::UnboundedSender<Input>,
    /// Set once the pre-start steps found no leftover of an earlier warden.
    leftovers_done: Arc<std::sync::atomic::AtomicBool>,
    handover: Handover,
}

/// What an upgrade in place needs of the process around the daemon.
#[derive(Debug, Clone, Default)]
pub struct Handover {
    /// The binary at the warden's own path (as it was started).
    pub exe: Option<std::path::PathBuf>,
    /// The instance lock's descriptor, kept open across the exec.
    pub lock_fd: Option<std::os::fd::RawFd>,
    /// The ready run of a predecessor to take over.
    pub adopted: Option<crate::daemon::upgrade::State>,
    /// This process was exec'd by an upgrading predecessor (whether or not
    /// its state could be used): until its first start, the processes it
    /// finds in its own tree are the predecessor's.
    pub from_upgrade: bool,
}

impl Real {
    /// Needs a tokio runtime; makes this process a subreaper.
    pub fn new(
        settings: Settings,
        classifier: Classifier,
        inputs: mpsc::UnboundedSender<Input>,
        lines: mpsc::Sender<Delivery>,
        journal: Option<crate::observe::journal::Gatherer>,
        token: String,
    ) -> std::io::Result<Real> {
        let taps = Taps { journal, traffic: crate::observe::health::Traffic::default() };
        let tx = inputs.clone();
        let mut tasks = Tasks::default();
        let tree = Tree::new(
            move |ev| {
                let _ = tx.send(Input::Tree(ev));
            },
            &mut tasks,
        )?;
        Ok(Real {
            settings,
            tasks,
            tree,
            classifier,
            follower: None,
            kernel: None,
            kernel_start: Arc::default(),
            lines,
            probe: None,
            preparing: None,
            leftovers_done: Arc::default(),
            handover: Handover::default(),
            health: None,
            last_check: Default::default(),
            load: None,
            traffic: taps.traffic.clone(),
            run: None,
            reporting: None,
            report_gate: None,
            reports: Vec::new(),
            log_hold: Default::default(),
            taps,
            token,
            inputs,
        })
    }

    /// Follow the log file `file` of start `start` from `offset`.
    fn follow_log(&mut self, file: &std::fs::File, offset: u64, start: u32) -> std::io::Result<Follower> {
        let tap = LineTap {
            journal: self.taps.journal.clone(),
            literal: memchr::memmem::Finder::new(b"generation throughput"),
            generation: Default::default(),
            traffic: self.taps.traffic.clone(),
        };
        let c = &self.settings.child;
        let rotator = crate::observe::rotate::Rotator::new(&c.log_file, file, c.log_rotation)
            .map_err(|e| tracing::warn!(error = %e, "the log file will not be rotated"))
            .ok()
            .map(|r| r.with_hold(self.log_hold.clone()));
        Follower::start(
            file,
            offset,
            start,
            self.classifier.clone(),
            Some(Box::new(tap)),
            rotator,
            self.lines.clone(),
            &mut self.tasks,
        )
    }

    /// Take over the ready run of the predecessor that handed `state`
    /// over: the child as the tree's leader, its log from the saved offset,
    /// the kernel's messages.
    fn adopt(&mut self, state: &crate::daemon::upgrade::State) -> std::io::Result<()> {
        let pid = state.machine.pid;
        let file = crate::daemon::upgrade::open_child_log(pid, state.log_dev, state.log_ino)?;
        let follower = self.follow_log(&file, state.log_offset, state.machine.start)?;
        self.tree.adopt(pid);
        self.follower = Some(follower);
        self.leftovers_done.store(true, std::sync::atomic::Ordering::SeqCst);
        self.kernel_start.store(state.machine.start, std::sync::atomic::Ordering::SeqCst);
        self.follow_kernel();
        Ok(())
    }

    /// Follow the kernel's messages unless already following this source.
    fn follow_kernel(&mut self) {
        let source = &self.settings.health.kernel_messages;
        if source.is_empty() {
            self.kernel = None;
            return;
        }
        if self.kernel.as_ref().is_some_and(|(s, _)| s == source) {
            return;
        }
        self.kernel = None;
        let (tx, current) = (self.inputs.clone(), self.kernel_start.clone());
        match crate::observe::kernel::follow(source, move |fault| {
            let start = current.load(std::sync::atomic::Ordering::SeqCst);
            let _ = tx.send(Input::GpuFault { start, cause: fault.cause() });
        }) {
            Ok(Some(f)) => self.kernel = Some((source.clone(), f)),
            Ok(None) => tracing::info!(EVENT = "gpus", "{} not found: GPU faults are not watched", source[0]),
            Err(e) => tracing::warn!(error = %e, "cannot follow kernel messages: GPU faults are not watched"),
        }
    }

    /// Wait, up to `within`, for the failure reports still being written,
    /// and for the file work of those given up.
    async fn finish_reports(&mut self, within: Duration) {
        // No start is under way any more (one stopped before its spawn
        // never said so).
        crate::observe::reports::start_under_way(false);
        let deadline = tokio::time::Instant::now() + within;
        for r in self.reports.drain(..) {
            let _ = tokio::time::timeout_at(deadline, r).await;
        }
        crate::observe::reports::settle(deadline.saturating_duration_since(tokio::time::Instant::now())).await;
    }

    fn stop_checks(&mut self) {
        for task in [self.probe.take(), self.health.take().map(|(_, t)| t), self.load.take()].into_iter().flatten() {
            task.abort();
        }
    }
}

impl Backend for Real {
    fn prepare(&mut self, start: u32) {
        crate::observe::reports::start_under_way(true);
        self.stop_checks();
        self.follower = None;
        let (settings, tx, done) = (self.settings.clone(), self.inputs.clone(), self.leftovers_done.clone());
        let inherited = self.handover.from_upgrade;
        let gate = self.report_gate.clone();
        let task = self.tasks.spawn("pre-start", Lifetime::Finite, async move {
            let steps = tx.clone();
            let status: crate::daemon::prepare::Status = Arc::new(move |text| {
                let _ = steps.send(Input::Step { start, text });
            });
            let result = crate::daemon::prepare::run(&settings, status.clone(), done, inherited).await;
            // The report of the last run goes on beside this start, but
            // what describes that run must be taken before a new child
            // starts: wait while it is not, unless the report has ended.
            if let Some(mut gate) = gate
                && result.is_ok()
                && !*gate.borrow()
                && gate.has_changed().is_ok()
            {
                // What the report waits for is never the start's: it
                // need not yield to it.
                crate::observe::reports::start_under_way(false);
                status("waiting for the failure report of the last run".into());
                let _ = gate.wait_for(|taken| *taken).await;
            }
            let result = match result {
                Ok(()) => Prepared::Done,
                Err(failure) => {
                    crate::observe::reports::start_under_way(false);
                    Prepared::Failed(failure)
                }
            };
            let _ = tx.send(Input::Prepared { start, result });
        });
        self.preparing = Some((start, task));
    }

    fn cancel_prepare(&mut self) {
        if let Some((start, task)) = self.preparing.take() {
            task.abort();
            crate::observe::reports::start_under_way(false);
            let _ = self.inputs.send(Input::Prepared { start, result: Prepared::Cancelled });
        }
    }

    fn read_config(&mut self) {
        let (path, tx) = (self.settings.source.clone(), self.inputs.clone());
        tracing::info!(EVENT = "reload", "reading {} again", path.display());
        self.tasks.spawn("config reader", Lifetime::Finite, async move {
            let loaded = tokio::task::spawn_blocking(move || {
                config::load(&path, &Dirs::from_env()).and_then(|s| {
                    let env = crate::daemon::environment::check_environment(&s);
                    if env.is_empty() { Ok(s) } else { Err(config::Problems(env)) }
                })
            })
            .await;
            // A panic while reading is this task's panic.
            let loaded = loaded.unwrap_or_else(|e| std::panic::resume_unwind(e.into_panic()));
            let _ = tx.send(Input::Reload(Box::new(loaded)));
        });
    }

    fn spawn(&mut self, start: u32) -> Result<u32, StartFailure> {
        // Spawned or failed, the start is no longer under way.
        let _over = crate::observe::reports::StartOver;
        self.preparing = None;
        let c = &self.settings.child;
        let log_path = c.log_file.clone();
        let spawned = std::time::SystemTime::now();
        let (file, offset) = child::open_log(&log_path, start, spawned)
            .map_err(|e| StartFailure::transient(format!("cannot open log file {}: {e}", log_path.display())))?;
        // The warden's cache and socket folders, where neither child.env
        // nor the warden's environment names one.
        let mut env: std::collections::BTreeMap<String, String> =
            crate::process::caches::child_env(&crate::process::caches::of(&self.settings)).collect();
        env.extend(c.env.clone());
        env.insert(crate::process::prestart::RUN_TOKEN.into(), self.token.clone());
        let spec = Spec { argv: c.command.clone(), env, cwd: c.cwd.clone() };
        let kernel = self.kernel.as_ref().and_then(|(_, f)| f.mark());
        let pid = self.tree.spawn(&spec, &file).map_err(|e| {
            let cause = format!("cannot start {}: {e}", spec.argv[0]);
            match e.kind() {
                std::io::ErrorKind::NotFound | std::io::ErrorKind::PermissionDenied => StartFailure::permanent(cause),
                _ => StartFailure::transient(cause),
            }
        })?;
        // Followed from `offset`, where the child's first line goes: begun
        // after the spawn, the follower still reads every line.
        match self.follow_log(&file, offset, start) {
            Ok(f) => self.follower = Some(f),
            Err(e) => {
                // A child whose lines cannot be read cannot be supervised.
                self.tree.kill_all();
                return Err(StartFailure::transient(format!("cannot follow log file {}: {e}", log_path.display())));
            }
        }
        tracing::info!(
            INSTANCE = self.settings.name.as_str(),
            EVENT = "spawn",
            "running {} (env: {})",
            redact::command(&spec.argv),
            redact::env(&spec.env)
        );
        let log = file.try_clone().ok().map(Arc::new);
        self.run = Some(RunRecord { start, spawned, log_file: log_path.clone(), offset, kernel, log });
        self.kernel_start.store(start, std::sync::atomic::Ordering::SeqCst);
        self.follow_kernel();
        Ok(pid)
    }

    fn probe(&mut self, start: u32) {
        let tx = self.inputs.clone();
        if let Some(p) = self.probe.take() {
            p.abort();
        }
        if let Some(cluster) = self.settings.ready_by_ray() {
            let (argv, address) = (cluster.command(&self.settings.child.command), cluster.address.clone());
            let head = self.settings.profile == crate::config::profile::Profile::RayHead;
            let member = crate::process::ray::Member::of(&self.settings.child.command, head);
            self.probe = Some(self.tasks.spawn("readiness probe", Lifetime::Finite, async move {
                crate::process::ray::confirm(&argv, &address, &member).await;
                let _ = tx.send(Input::HttpReady { start });
            }));
            return;
        }
        let Some(url) = self.settings.ready.http.clone() else {
            return;
        };
        self.probe = Some(self.tasks.spawn("readiness probe", Lifetime::Finite, async move {
            let mut delay = Duration::from_millis(20);
            loop {
                if crate::observe::health::http_ok_async(&url, Duration::from_secs(5)).await {
                    let _ = tx.send(Input::HttpReady { start });
                    return;
                }
                tokio::time::sleep(delay).await;
                delay = (delay * 2).min(Duration::from_secs(1));
            }
        }));
    }

    fn health(&mut self, start: u32) {
        // Ready: the follower may gather a serving child's lines a while
        // (a fatal line is seen within that, the exit at once).
        if let Some(f) = &self.follower {
            f.pace(SERVING_PACE);
        }
        let spec = crate::observe::health::Spec::from_settings(&self.settings);
        self.last_check.set(true);
        if !spec.enabled() {
            return;
        }
        let (tx, traffic, last) = (self.inputs.clone(), self.traffic.clone(), self.last_check.clone());
        let task = self.tasks.spawn("health checks", Lifetime::Finite, async move {
            let cause = crate::observe::health::watch(spec, traffic, last).await;
            let _ = tx.send(Input::HealthFailed { start, cause });
        });
        self.health = Some((start, task));
    }

    fn reconfigure(&mut self, settings: Settings, classifier: Classifier) -> crate::daemon::reload::Plan {
        let plan = crate::daemon::reload::plan(&self.settings, &settings);
        for c in crate::daemon::reload::identity_left(&self.settings, &settings) {
            tracing::warn!(EVENT = "reload", "{c}: takes effect when the warden itself restarts");
        }
        let running = settings.clone();
        tokio::task::spawn_blocking(move || crate::daemon::reload::save_running(&running));
        self.settings = settings;
        // The running child's lines are classified with the new patterns
        // from its follower's next read on.
        if let Some(f) = &self.follower {
            f.reclassify(classifier.clone());
            f.rotation(self.settings.child.log_rotation);
        }
        self.classifier = classifier;
        // The health checks of a ready run go on with the new settings.
        if let Some((start, task)) = self.health.take() {
            task.abort();
            self.health(start);
        }
        plan
    }

    fn check_upgrade(&mut self) {
        let tx = self.inputs.clone();
        let Some(exe) = self.handover.exe.clone() else {
            let _ = tx.send(Input::UpgradeChecked(Err("the warden's own path is not known".into())));
            return;
        };
        self.tasks.spawn("upgrade check", Lifetime::Finite, async move {
            let checked = tokio::task::spawn_blocking(move || crate::daemon::upgrade::probe_version(&exe))
                .await
                .unwrap_or_else(|e| Err(format!("the check failed: {e}")));
            let _ = tx.send(Input::UpgradeChecked(checked));
        });
    }

    fn pause_lines(&mut self) -> bool {
        self.follower.as_ref().map(Follower::stop_reading).is_some()
    }

    fn lines_paused(&mut self, wait: Duration) -> Option<u64> {
        let offset = self.follower.as_ref()?.ended(wait)?;
        self.follower = None;
        Some(offset)
    }

    fn resume_lines(&mut self, offset: u64) {
        let (pid, start) = match self.tree.leader() {
            Some(pid) => (pid, self.kernel_start.load(std::sync::atomic::Ordering::SeqCst)),
            None => return,
        };
        let followed =
            std::fs::File::open(format!("/proc/{pid}/fd/1")).and_then(|f| self.follow_log(&f, offset, start));
        match followed {
            Ok(f) => self.follower = Some(f),
            Err(e) => tracing::error!(error = %e, "cannot follow the child's log again"),
        }
    }

    fn exec_upgrade(&mut self, saved: crate::supervisor::Saved, offset: u64) -> String {
        use std::os::unix::fs::MetadataExt;
        let (Some(exe), Some(lock_fd)) = (self.handover.exe.clone(), self.handover.lock_fd) else {
            return "the warden's own path or lock is not known".into();
        };
        let pid = saved.pid;
        let Some(stat) = child::read_stat(pid as i32) else { return format!("the child, pid {pid}, is gone") };
        let log = match std::fs::metadata(format!("/proc/{pid}/fd/1")) {
            Ok(m) => m,
            Err(e) => return format!("cannot see the child's log: {e}"),
        };
        // SAFETY: the lock's descriptor lives as long as the warden.
        let lock_fd_b = unsafe { std::os::fd::BorrowedFd::borrow_raw(lock_fd) };
        let state = crate::daemon::upgrade::State {
            format: crate::daemon::upgrade::FORMAT,
            from: env!("CARGO_PKG_VERSION").into(),
            instance: self.settings.name.clone(),
            lock_fd,
            token: self.token.clone(),
            child_start_time: stat.start_time,
            log_dev: log.dev(),
            log_ino: log.ino(),
            log_offset: offset,
            machine: saved,
        };
        let path = crate::daemon::upgrade::state_path(&self.settings.status.file);
        if let Err(e) = crate::daemon::upgrade::write(&path, &state) {
            return format!("cannot write {}: {e}", path.display());
        }
        if let Err(e) = crate::daemon::upgrade::keep_across_exec(lock_fd_b) {
            let _ = std::fs::remove_file(&path);
            return format!("cannot keep the lock across the exec: {e}");
        }
        // The kernel-message follower is a process of ours the successor
        // would not know: stopped (it starts its own).
        self.kernel = None;
        let e = crate::daemon::upgrade::exec(&exe, &path);
        let _ = std::fs::remove_file(&path);
        let _ = rustix::io::fcntl_setfd(lock_fd_b, rustix::io::FdFlags::CLOEXEC);
        self.follow_kernel();
        format!("cannot run {}: {e}", exe.display())
    }

    fn terminate(&mut self, sig: Signal) {
        self.stop_checks();
        self.tree.terminate(sig);
    }

    fn kill_tree(&mut self) {
        self.stop_checks();
        self.tree.kill_all();
    }

    fn describe_survivors(&mut self) {
        let tx = self.inputs.clone();
        self.tasks.spawn("survivor report", Lifetime::Finite, async move {
            // Off the loop: /proc of a process stuck in the kernel can hang.
            if let Ok((left, description)) = tokio::task::spawn_blocking(child::describe_survivors).await {
                let _ = tx.send(Input::Survivors { left, description });
            }
        });
    }

    fn watch_load(&mut self, start: u32) {
        self.unwatch_load();
        let (base, tx) = (crate::observe::health::Spec::from_settings(&self.settings).base, self.inputs.clone());
        let timeout = self.settings.health.timeout;
        self.load = Some(self.tasks.spawn("drain watch", Lifetime::Finite, async move {
            let mut said = None;
            loop {
                let b = base.clone();
                let n = tokio::task::spawn_blocking(move || crate::observe::health::in_flight(&b, timeout)).await;
                match n.unwrap_or_else(|e| Err(e.to_string())) {
                    Ok(n) if n <= 0.0 => {
                        let _ = tx.send(Input::Quiet { start });
                        return;
                    }
                    Ok(n) => {
                        if said != Some(n) {
                            tracing::info!(EVENT = "drain", "{n} request(s) running or waiting");
                            said = Some(n);
                        }
                    }
                    Err(why) if said.is_none() => {
                        // Waited for until drain.timeout: without a count,
                        // nothing says the server is quiet.
                        tracing::warn!(EVENT = "drain", "cannot count the requests in flight: {why}");
                        said = Some(f64::NAN);
                    }
                    Err(_) => {}
                }
                tokio::time::sleep(LOAD_EVERY).await;
            }
        }));
    }

    fn unwatch_load(&mut self) {
        if let Some(t) = self.load.take() {
            t.abort();
        }
    }

    fn report(&mut self, order: crate::supervisor::ReportOrder) -> Option<std::path::PathBuf> {
        self.run.as_ref().filter(|r| r.start == order.start)?;
        // The run has failed: its checks have nothing more to say.
        self.stop_checks();
        let run = self.run.as_ref()?;
        let now = std::time::SystemTime::now();
        let s = &self.settings;
        let job = crate::observe::reports::Job {
            state_dir: s.state_dir.clone(),
            name: crate::observe::reports::folder_name(now, &s.name, order.attempt),
            instance: s.name.clone(),
            spawned: run.spawned,
            begun: now,
            log_file: run.log_file.clone(),
            log_offset: run.offset,
            settings: s.reports.clone(),
            config_sha256: crate::observe::reports::sha256_hex(s.text.as_bytes()),
            classifier: self.classifier.clone(),
            warden: std::process::id() as i32,
            run_ended: self.tree.run_ended(),
            // The follower read the log to its end after the exit (the
            // driver waited for it): where the run's lines end.
            log_taken: run.log.clone().zip(self.follower.as_ref().and_then(Follower::drained_to)),
            kernel: run.kernel.clone(),
            log_hold: Some(self.log_hold.clone()),
            order,
        };
        let path = job.state_dir.join(crate::observe::reports::FOLDER).join(&job.name);
        let (tx, start, instance) = (self.inputs.clone(), job.order.start, s.name.clone());
        let (taken, gate) = watch::channel(false);
        let (done, ended) = oneshot::channel();
        let task = self.tasks.spawn("failure report", Lifetime::Finite, async move {
            match crate::observe::reports::write(job, move || {
                let _ = taken.send(true);
            })
            .await
            {
                Ok(p) => tracing::info!(INSTANCE = instance.as_str(), EVENT = "report", "failure report written: {}", p.display()),
                Err(e) => tracing::warn!(INSTANCE = instance.as_str(), EVENT = "report", error = %e, "cannot write the failure report"),
            }
            let _ = tx.send(Input::Reported { start });
            let _ = done.send(());
        });
        // An earlier report still being written goes on.
        self.reports.retain_mut(|r| r.try_recv() == Err(oneshot::error::TryRecvError::Empty));
        self.reports.push(ended);
        self.report_gate = Some(gate);
        self.reporting = Some(task);
        Some(path)
    }

    fn cancel_report(&mut self) {
        if let Some(task) = self.reporting.take() {
            task.abort();
        }
    }

    fn drain_lines(&mut self) -> bool {
        self.follower.as_ref().inspect(|f| f.drain()).is_some()
    }

    async fn task_failed(&mut self) -> String {
        let failed = self.tasks.failed().await;
        tracing::error!(INSTANCE = self.settings.name.as_str(), EVENT = "internal", "{failed}");
        if failed.name == "reaper" {
            // Without a reaper the tree could never be seen gone: start one
            // again so that the stop that follows can finish.
            if let Err(e) = self.tree.start_reaper(&mut self.tasks) {
                tracing::error!(error = %e, "cannot start the reaper again");
            }
        }
        failed.to_string()
    }
}

impl Drop for Real {
    fn drop(&mut self) {
        self.stop_checks();
    }
}
