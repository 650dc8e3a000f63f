//! The backend with real processes, a real log file and real HTTP: what
//! the driver's effects become. The child's output goes through a pipe
//! the warden owns to the log file (`observe::logpipe`), which the follower
//! reads.

use std::sync::Arc;
use std::time::Duration;

use nix::sys::signal::Signal;
use tokio::sync::{mpsc, oneshot, watch};
use tokio::task::AbortHandle;

use crate::config::{self, Dirs, Settings};
use crate::daemon::driver::Input;
use crate::daemon::driver::ports::{self, Checks as _};
use crate::observe::logwatch::{Delivery, LogFollower, Tap};
use crate::process::child::{self, ChildSpec, Tree};
use crate::supervisor::Event;
use crate::supervisor::classify::{Classifier, Level};
use crate::supervisor::outcome::{Prepared, StartFailure};
use crate::util::redact;
use crate::util::tasks::{Lifetime, Tasks};

/// What each follower gives every line it reads besides its class.
#[derive(Clone)]
struct Taps {
    journal: Option<crate::tell::journal::Gatherer>,
    /// Set when the log shows tokens being generated; read by the canary.
    traffic: crate::observe::health::Traffic,
}

struct LineTap {
    journal: Option<crate::tell::journal::Gatherer>,
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

/// The backend with real processes, a real log file and real HTTP; its
/// parts grouped by job.
pub struct RealBackend {
    settings: Settings,
    /// Every background task, watched by the loop through `task_failed`.
    pub tasks: Tasks,
    tree: Tree,
    inputs: mpsc::UnboundedSender<Input>,
    /// Before a spawn: the pre-start steps, the run token, the handover.
    launch: Launch,
    /// The child's log: its follower and what each line goes to.
    log: LogWatch,
    /// The kernel's messages, for GPU faults.
    kernel: KernelWatch,
    /// HTTP: readiness, health checks, the drain's count of requests.
    checks: Checks,
    /// The failure reports of failed runs.
    reports: Reports,
    /// The load ledger.
    loads: Loads,
    /// The weight-cache daemon (`[preload]`), started before the engine.
    pub preload: crate::daemon::preload::Preloader,
    /// Which kind of start the pre-start steps of a start made ready.
    start_kind: Arc<std::sync::Mutex<Option<(u32, crate::supervisor::preload::PreloadStart)>>>,
    /// Hands on the work that waits for a change's news (the ledger's
    /// write, the end of a start), and is settled before an upgrade's exec.
    outbox: crate::tell::outbox::Outbox,
}

/// The load ledger: its records, its writer, and what the pre-start steps
/// found of the setup about to start.
struct Loads {
    ledger: crate::tell::ledger::Ledger,
    /// Handed each record once the change that ended the load is out.
    writer: Option<crate::tell::ledger::Writer>,
    /// Found by the pre-start steps of a start: its setup, weights,
    /// memory fit's values and command line.
    found: Arc<std::sync::Mutex<Option<(u32, crate::daemon::recover::Found)>>>,
    /// What memory fit and a rollback ask of the next starts.
    recovery: crate::daemon::recover::Recovery,
    /// The setup of the run spawned last.
    running: Option<crate::tell::ledger::Facts>,
    /// The read-ahead of the weights (`[prefetch]`) of the latest start,
    /// from its pre-start steps to the end of its load.
    prefetch: Option<crate::daemon::prefetch::Prefetch>,
}

/// What a start needs before its spawn.
struct Launch {
    /// The pre-start steps running for a start.
    preparing: Option<(u32, AbortHandle)>,
    /// Set once the pre-start steps found no leftover of an earlier warden.
    leftovers_done: Arc<std::sync::atomic::AtomicBool>,
    /// Put in every child's environment (`prestart::RUN_TOKEN`).
    token: String,
    /// What an upgrade in place needs of the process around the daemon.
    handover: Handover,
}

/// Following the child's log.
struct LogWatch {
    /// The effective patterns, compiled; each follower gets a copy.
    classifier: Classifier,
    /// Moves the latest child's output from its pipe to the log file.
    writer: Option<crate::observe::logpipe::Writer>,
    follower: Option<LogFollower>,
    /// Where followers hand on the lines that matter.
    lines: mpsc::Sender<Delivery>,
    taps: Taps,
    /// Between the failure reports and the log's rotations.
    hold: crate::observe::rotate::Hold,
}

/// The kernel messages, for GPU faults: one follower for the warden's life
/// (started at the first spawn, again if its source changes), not one per
/// start, which would put a process spawn on the restart path.
#[derive(Default)]
struct KernelWatch {
    follower: Option<(Vec<String>, crate::observe::kernel::KernelFollower)>,
    /// The start a GPU fault belongs to: the latest spawn.
    start: Arc<std::sync::atomic::AtomicU32>,
    /// The warden's memory cgroup and its OOM kills at the latest spawn.
    oom: Option<(crate::observe::oom::Cgroup, u64)>,
    /// The instance's GPUs asked of `nvidia-smi`, for the follower.
    gpus: Option<AbortHandle>,
}

/// Asks for the instance's GPUs' PCI addresses (their index, UUID and bus).
const GPU_PCI_QUERY: [&str; 3] = ["nvidia-smi", "--query-gpu=index,uuid,pci.bus_id", "--format=csv,noheader"];

/// The HTTP checks of a run.
struct Checks {
    /// The readiness probe of a start.
    probe: Option<AbortHandle>,
    /// The health checks of the ready run `start`.
    health: Option<(u32, AbortHandle)>,
    /// The last health check's verdict, for `/readyz`.
    last_check: crate::observe::health::LastCheck,
    /// A drain's watch of the requests in flight.
    load: Option<AbortHandle>,
    /// The golden check of a start.
    golden: Option<AbortHandle>,
    /// Seen in the log: the canary waits while real traffic flows.
    traffic: crate::observe::health::Traffic,
}

/// The failure reports.
#[derive(Default)]
struct Reports {
    /// The latest run: what its failure report needs.
    run: Option<RunRecord>,
    /// The failure report being written.
    writing: Option<AbortHandle>,
    /// Open once the last report has taken what describes its run (its
    /// tree, its log, the GPUs): the next spawn waits for it.
    /// Kept (each start looks at a copy): a start given up while it waited
    /// leaves it for the next.
    gate: Option<watch::Receiver<bool>>,
    /// Answered as each report ends (or is dropped).
    pending: Vec<oneshot::Receiver<()>>,
}

/// What an upgrade in place needs of the process around the daemon.
#[derive(Debug, Default)]
pub struct Handover {
    /// The binary at the warden's own path (as it was started).
    pub exe: Option<std::path::PathBuf>,
    /// The instance lock's descriptor, kept open across the exec.
    pub lock_fd: Option<std::os::fd::RawFd>,
    /// The ready run of a predecessor to take over.
    pub adopted: Option<crate::daemon::upgrade::Handoff>,
    /// This process was exec'd by an upgrading predecessor (whether or not
    /// its state could be used): until its first start, the processes it
    /// finds in its own tree are the predecessor's.
    pub from_upgrade: bool,
    /// The listening sockets handed to this warden (by systemd, or by an
    /// upgrading predecessor), taken by the front door as it opens.
    pub listeners: crate::daemon::front::listen::Inherited,
    /// The front door's sockets, kept open for a successor.
    pub kept: Vec<crate::daemon::front::listen::Kept>,
}

impl RealBackend {
    /// Needs a tokio runtime; makes this process a subreaper.
    #[allow(clippy::too_many_arguments)]
    pub fn new(
        settings: Settings,
        classifier: Classifier,
        inputs: mpsc::UnboundedSender<Input>,
        lines: mpsc::Sender<Delivery>,
        journal: Option<crate::tell::journal::Gatherer>,
        token: String,
        handover: Handover,
        last_check: crate::observe::health::LastCheck,
        outbox: crate::tell::outbox::Outbox,
    ) -> std::io::Result<RealBackend> {
        let traffic = crate::observe::health::Traffic::default();
        let preload = crate::daemon::preload::Preloader::new(inputs.clone(), token.clone(), journal.clone());
        let taps = Taps { journal, traffic: traffic.clone() };
        let (settings_state_dir, settings_keep) = (settings.state_dir.clone(), settings.ledger.keep);
        let tx = inputs.clone();
        let mut tasks = Tasks::default();
        let tree = Tree::new(
            move |ev| {
                let _ = tx.send(Input::Tree(ev));
            },
            &mut tasks,
        )?;
        Ok(RealBackend {
            settings,
            tasks,
            tree,
            inputs,
            launch: Launch { preparing: None, leftovers_done: Arc::default(), token, handover },
            log: LogWatch { classifier, writer: None, follower: None, lines, taps, hold: Default::default() },
            kernel: KernelWatch::default(),
            checks: Checks { probe: None, health: None, last_check, load: None, golden: None, traffic },
            loads: Loads {
                ledger: crate::tell::ledger::Ledger::open(&settings_state_dir, settings_keep),
                writer: crate::tell::ledger::Writer::start()
                    .map_err(|e| tracing::warn!(error = %e, "no thread for the load ledger: loads are not recorded"))
                    .ok(),
                found: Arc::default(),
                recovery: Default::default(),
                running: None,
                prefetch: None,
            },
            reports: Reports::default(),
            preload,
            start_kind: Arc::default(),
            outbox,
        })
    }

    /// Follow the log file that `sink` writes, of start `start`, from
    /// `offset`.
    fn follow_log(
        &mut self,
        sink: &Arc<crate::observe::logpipe::Sink>,
        offset: u64,
        start: u32,
    ) -> std::io::Result<LogFollower> {
        let tap = LineTap {
            journal: self.log.taps.journal.clone(),
            literal: memchr::memmem::Finder::new(b"generation throughput"),
            generation: Default::default(),
            traffic: self.log.taps.traffic.clone(),
        };
        let c = &self.settings.child;
        let rotator = crate::observe::rotate::Rotator::new(sink.clone(), c.log_rotation)
            .map_err(|e| tracing::warn!(error = %e, "the log file will not be rotated"))
            .ok()
            .map(|r| r.with_hold(self.log.hold.clone()));
        LogFollower::start(
            &sink.file()?,
            offset,
            start,
            self.log.classifier.clone(),
            Some(Box::new(tap)),
            Some(sink.clone()),
            rotator,
            self.log.lines.clone(),
            &mut self.tasks,
        )
    }

    /// Take over the ready run of the predecessor that handed `state`
    /// over: the child as the tree's leader, its output pipe and log file
    /// (the log followed from the saved offset), the kernel's messages.
    pub(super) fn adopt(&mut self, state: &crate::daemon::upgrade::Handoff) -> std::io::Result<()> {
        let pid = state.machine.pid;
        let (pipe, file) = crate::daemon::upgrade::take_output(state, &self.settings.child.log_file)
            .map_err(|e| std::io::Error::new(std::io::ErrorKind::InvalidData, e.to_string()))?;
        let sink = crate::observe::logpipe::Sink::new(pipe, file, &self.settings.child.log_file)?;
        let writer = crate::observe::logpipe::Writer::start(sink.clone(), &mut self.tasks);
        let follower = self.follow_log(&sink, state.log_offset, state.machine.start)?;
        self.tree.adopt(pid);
        self.log.writer = Some(writer);
        self.log.follower = Some(follower);
        self.launch.leftovers_done.store(true, std::sync::atomic::Ordering::SeqCst);
        self.kernel.start.store(state.machine.start, std::sync::atomic::Ordering::SeqCst);
        self.follow_kernel();
        Ok(())
    }

    /// Follow the kernel's messages unless already following this source.
    fn follow_kernel(&mut self) {
        let source = &self.settings.health.kernel_messages;
        if source.is_empty() {
            self.kernel.follower = None;
            return;
        }
        if self.kernel.follower.as_ref().is_some_and(|(s, _)| s == source) {
            return;
        }
        self.kernel.follower = None;
        let (tx, current) = (self.inputs.clone(), self.kernel.start.clone());
        match crate::observe::kernel::follow(source, move |said| {
            use crate::observe::kernel::Kernel;
            let start = current.load(std::sync::atomic::Ordering::SeqCst);
            let _ = match said {
                Kernel::Fatal(fault) => tx.send(Event::GpuFault { start, cause: fault.cause() }.into()),
                Kernel::Recheck(fault) => {
                    tracing::warn!(EVENT = "gpus", "kernel: {}", fault.recheck_reason());
                    tx.send(Event::Recheck { reason: fault.recheck_reason() }.into())
                }
                Kernel::OomKill(line) => {
                    let said = crate::util::escape::one_line(&line, crate::util::escape::MAX_LINE);
                    tracing::warn!(EVENT = "oom", "kernel: {said}");
                    Ok(())
                }
            };
        }) {
            Ok(Some(f)) => self.kernel.follower = Some((source.clone(), f)),
            Ok(None) => tracing::info!(EVENT = "gpus", "{} not found: GPU faults are not watched", source[0]),
            Err(e) => tracing::warn!(error = %e, "cannot follow kernel messages: GPU faults are not watched"),
        }
    }

    /// Tell the kernel-message follower which GPUs are the instance's, off
    /// the loop (`nvidia-smi` and the child's `CUDA_VISIBLE_DEVICES`);
    /// until it knows, or when it cannot be told, every GPU's faults count.
    fn kernel_gpus(&mut self) {
        if let Some(t) = self.kernel.gpus.take() {
            t.abort();
        }
        let Some((_, f)) = &self.kernel.follower else { return };
        f.set_gpus(None);
        let visible = (self.settings.child.env.get("CUDA_VISIBLE_DEVICES").cloned())
            .or_else(|| std::env::var("CUDA_VISIBLE_DEVICES").ok());
        let gpus = f.gpus();
        self.kernel.gpus = Some(self.tasks.spawn("GPU addresses", Lifetime::Finite, async move {
            let query: Vec<String> = GPU_PCI_QUERY.iter().map(|s| s.to_string()).collect();
            let out = crate::process::prestart::run_command(&query, Duration::from_secs(10), 1 << 16, false).await;
            if let Ok(Some(out)) = out {
                let told = crate::observe::kernel::instance_gpus(&out, visible.as_deref());
                tracing::debug!(?told, "the instance's GPUs, for the kernel's messages");
                *gpus.lock().unwrap_or_else(|p| p.into_inner()) = told;
            }
        }));
    }

    /// Wait, up to `within`, for the failure reports still being written,
    /// and for the file work of those given up.
    pub(super) async fn finish_reports(&mut self, within: Duration) {
        // No start is under way any more (one stopped before its spawn
        // never said so).
        crate::tell::reports::start_under_way(false);
        let deadline = tokio::time::Instant::now() + within;
        for r in self.reports.pending.drain(..) {
            let _ = tokio::time::timeout_at(deadline, r).await;
        }
        crate::tell::reports::settle(deadline.saturating_duration_since(tokio::time::Instant::now())).await;
    }

    /// Wait, at most `within`, for the ledger's and the setups' writes
    /// handed on so far (blocking: the loop is over).
    pub(super) fn finish_records(&self, within: Duration) {
        if let Some(w) = &self.loads.writer {
            w.flush(within);
        }
    }

    fn stop_checks(&mut self) {
        for task in [
            self.checks.probe.take(),
            self.checks.health.take().map(|(_, t)| t),
            self.checks.load.take(),
            self.checks.golden.take(),
        ]
        .into_iter()
        .flatten()
        {
            task.abort();
        }
    }

    /// The child of start `start`, spawned, and its log followed.
    fn spawn_child(&mut self, start: u32) -> Result<u32, StartFailure> {
        self.launch.preparing = None;
        let c = &self.settings.child;
        let log_path = c.log_file.clone();
        let spawned = std::time::SystemTime::now();
        let (file, offset) = child::open_log(&log_path, start, spawned)
            .map_err(|e| StartFailure::transient(format!("cannot open log file {}: {e}", log_path.display())))?;
        // The child's output goes through a pipe of the warden's to the file.
        let (sink, output) = crate::observe::logpipe::pipe()
            .and_then(|(read, write)| Ok((crate::observe::logpipe::Sink::new(read, file, &log_path)?, write)))
            .map_err(|e| StartFailure::transient(format!("cannot make a pipe for the child's output: {e}")))?;
        // The warden's cache and socket folders, where neither child.env
        // nor the warden's environment names one.
        let mut env: std::collections::BTreeMap<String, String> =
            crate::process::caches::child_env(&crate::process::caches::of(&self.settings)).collect();
        env.extend(c.env.clone());
        env.insert(crate::process::prestart::RUN_TOKEN.into(), self.launch.token.clone());
        // vLLM serves its sleep routes only in development mode, which also
        // opens its other development routes: set only when the warden puts
        // an idle engine to sleep, whose socket only the warden reaches.
        if crate::daemon::idle::sleeps(&self.settings) {
            env.insert(crate::daemon::idle::DEV_MODE.into(), "1".into());
        }
        // The command line with memory fit's values, as the pre-start
        // steps found it.
        let argv = match &*self.loads.found.lock().unwrap_or_else(|p| p.into_inner()) {
            Some((s, f)) if *s == start => f.argv.clone(),
            _ => c.command.clone(),
        };
        let spec = ChildSpec { argv, env, cwd: c.cwd.clone() };
        let kernel = self.kernel.follower.as_ref().and_then(|(_, f)| f.mark());
        // The cgroup's OOM kills before the child exists: one that comes
        // at once (a child that allocates past the limit as it starts) is
        // counted as the run's, not taken into the baseline.
        let oom = crate::observe::oom::cgroup().and_then(|c| c.kills().map(|n| (c, n)));
        let spawned_pid = self.tree.spawn(&spec, &output);
        // Only the tree holds the write end now: the pipe ends with it.
        drop(output);
        let pid = spawned_pid.map_err(|e| {
            let cause = format!("cannot start {}: {e}", spec.argv[0]);
            match e.kind() {
                std::io::ErrorKind::NotFound | std::io::ErrorKind::PermissionDenied => StartFailure::permanent(cause),
                _ => StartFailure::transient(cause),
            }
        })?;
        self.log.writer = Some(crate::observe::logpipe::Writer::start(sink.clone(), &mut self.tasks));
        // Followed from `offset`, where the child's first line goes: begun
        // after the spawn, the follower still reads every line.
        match self.follow_log(&sink, offset, start) {
            Ok(f) => self.log.follower = Some(f),
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
        let log = sink.file().ok().map(Arc::new);
        self.reports.run = Some(RunRecord { start, spawned, log_file: log_path.clone(), offset, kernel, log });
        self.kernel.start.store(start, std::sync::atomic::Ordering::SeqCst);
        self.kernel.oom = oom;
        self.follow_kernel();
        self.kernel_gpus();
        Ok(pid)
    }
}

impl ports::Launch for RealBackend {
    fn prepare(&mut self, start: u32) {
        crate::tell::reports::start_under_way(true);
        self.stop_checks();
        self.log.follower = None;
        // What is left of the last run (a straggler's output) does not go
        // into the next start's lines.
        self.log.writer = None;
        let (settings, tx, done) = (self.settings.clone(), self.inputs.clone(), self.launch.leftovers_done.clone());
        let inherited = self.launch.handover.from_upgrade;
        let gate = self.reports.gate.clone();
        let found = self.loads.found.clone();
        let fit = self.loads.recovery.fit.clone();
        let expect = self.loads.recovery.expect.clone();
        let dropped = self.loads.recovery.dropped.clone();
        let revert = self.loads.recovery.revert.take();
        let (preload, kind) = (self.preload.clone(), self.start_kind.clone());
        // The read-ahead of the weights begins with the start, beside its
        // pre-start steps (their waits are the disk's idle time).
        let (s, tx_prefetch) = (settings.clone(), self.inputs.clone());
        self.loads.prefetch = crate::daemon::prefetch::Prefetch::planned(
            move || crate::daemon::prefetch::order_for(&s),
            move |now| {
                let _ = tx_prefetch.send(Event::Prefetched { start, now }.into());
            },
        )
        .map_err(|e| tracing::warn!(EVENT = "prefetch", "no thread for the read-ahead of the weights: {e}"))
        .ok();
        let task = self.tasks.spawn("pre-start", Lifetime::Finite, async move {
            let steps = tx.clone();
            let status: crate::daemon::prepare::Status = Arc::new(move |text| {
                let _ = steps.send(Event::PrepareStep { start, text }.into());
            });
            let mut result = Ok(());
            if let Some(patches) = revert {
                // A rollback: the failed setup's patches are undone first,
                // so that the good one's apply to the originals.
                status("undoing the failed setup's patches".into());
                let state = settings.state_dir.clone();
                let undone = tokio::task::spawn_blocking(move || {
                    crate::patch::revert(&patches, &state, false, crate::patch::Wait::No)
                })
                .await
                .unwrap_or_else(|e| std::panic::resume_unwind(e.into_panic()));
                if let Err(e) = undone {
                    result = Err(StartFailure::permanent(format!("cannot undo the failed setup's patches: {e}")));
                }
            }
            if result.is_ok() {
                result = crate::daemon::prepare::run(&settings, status.clone(), done, inherited).await;
            }
            if result.is_ok() {
                result = crate::daemon::recover::gpus_free(&settings, &fit).await;
            }
            if result.is_ok() {
                // The weight-cache daemon, last: it holds the GPUs the
                // steps above wait for.
                result = preload.ensure(&settings, status.clone()).await.map(|k| {
                    *kind.lock().unwrap_or_else(|p| p.into_inner()) = k.map(|k| (start, k));
                });
            }
            if result.is_ok() {
                // The setup as it starts (after the patches): its ledger,
                // memory fit's values, and which kind of start it is (not
                // part of the fingerprint).
                let s = settings.clone();
                let found_now = tokio::task::spawn_blocking(move || {
                    crate::daemon::recover::find(&s, &fit, expect.as_ref(), &dropped)
                })
                .await
                .unwrap_or_else(|e| std::panic::resume_unwind(e.into_panic()));
                match found_now {
                    Ok(mut f) => {
                        f.facts.setup.preload =
                            kind.lock().unwrap_or_else(|p| p.into_inner()).filter(|(s, _)| *s == start).map(|(_, k)| k);
                        *found.lock().unwrap_or_else(|p| p.into_inner()) = Some((start, f));
                    }
                    Err(failure) => result = Err(failure),
                }
            }
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
                crate::tell::reports::start_under_way(false);
                status("waiting for the failure report of the last run".into());
                let _ = gate.wait_for(|taken| *taken).await;
            }
            let result = match result {
                Ok(()) => Prepared::Done,
                Err(failure) => {
                    crate::tell::reports::start_under_way(false);
                    Prepared::Failed(failure)
                }
            };
            let _ = tx.send(Event::Prepared { start, result }.into());
        });
        self.launch.preparing = Some((start, task));
    }

    fn cancel_prepare(&mut self) {
        // Dropped: stopped at its next chunk.
        self.loads.prefetch = None;
        if let Some((start, task)) = self.launch.preparing.take() {
            task.abort();
            crate::tell::reports::start_under_way(false);
            let _ = self.inputs.send(Event::Prepared { start, result: Prepared::Cancelled }.into());
        }
    }

    fn spawn(&mut self, start: u32) -> Result<u32, StartFailure> {
        let spawned = self.spawn_child(start);
        // A failed start is no longer under way; a spawned one is until
        // its run is ready (see `health`).
        if spawned.is_err() {
            crate::tell::reports::start_under_way(false);
        }
        spawned
    }

    fn oom_killed(&mut self, pid: u32, exit: crate::supervisor::outcome::Exit) -> Option<String> {
        use crate::observe::oom;
        // Counted by the cgroup that holds the tree: a process of the run,
        // whichever (a descendant whose death the leader then reported).
        let (cgroup, kills) = match &self.kernel.oom {
            Some((c, at_spawn)) => (Some(c), c.kills().map_or(0, |n| n.saturating_sub(*at_spawn))),
            None => (None, 0),
        };
        // The kernel's message names a pid of the whole host: only the
        // leader's, killed by SIGKILL, is the run's for sure.
        let killed = matches!(exit, crate::supervisor::outcome::Exit::Signal(crate::supervisor::Signal::SIGKILL));
        let mark = self.reports.run.as_ref().and_then(|r| r.kernel.as_ref());
        let lines = self.kernel.follower.as_ref().map(|(_, f)| f.oom_kills(mark)).unwrap_or_default();
        let leader = lines.iter().rev().filter_map(|l| oom::kill(l)).find(|k| killed && k.pid == pid);
        if leader.is_none() && kills == 0 {
            return None;
        }
        let figures = cgroup.and_then(oom::Cgroup::figures);
        Some(oom::cause(leader.as_ref(), kills, figures.as_deref()))
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
                let _ = tx.send(Event::Survivors { left, description }.into());
            }
        });
    }

    fn drain_lines(&mut self) -> bool {
        self.log.follower.as_ref().inspect(|f| f.drain()).is_some()
    }
}

impl ports::Checks for RealBackend {
    fn probe(&mut self, start: u32) {
        let tx = self.inputs.clone();
        if let Some(p) = self.checks.probe.take() {
            p.abort();
        }
        if let Some(cluster) = self.settings.ready_by_ray() {
            let (argv, address) = (cluster.command(&self.settings.child.command), cluster.address.clone());
            let head = self.settings.profile == crate::config::profile::Profile::RayHead;
            let member = crate::process::ray::Member::of(&self.settings.child.command, head);
            self.checks.probe = Some(self.tasks.spawn("readiness probe", Lifetime::Finite, async move {
                crate::process::ray::confirm(&argv, &address, &member).await;
                let _ = tx.send(Event::HttpReady { start }.into());
            }));
            return;
        }
        let Some(url) = self.settings.ready.http.clone() else {
            return;
        };
        let api = crate::observe::health::Api::of(&self.settings);
        self.checks.probe = Some(self.tasks.spawn("readiness probe", Lifetime::Finite, async move {
            let mut delay = Duration::from_millis(20);
            loop {
                if crate::observe::health::request_ok(api.get(&url), Duration::from_secs(5)).await {
                    let _ = tx.send(Event::HttpReady { start }.into());
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
        if let Some(f) = &self.log.follower {
            f.pace(SERVING_PACE);
        }
        if let Some(w) = &self.log.writer {
            w.pace(SERVING_PACE);
        }
        // The start is over once READY=1 is out: the reports' file work
        // waited for it.
        self.outbox.after_sent(|| crate::tell::reports::start_under_way(false));
        let spec = crate::observe::health::Spec::from_settings(&self.settings);
        self.checks.last_check.set(true);
        if !spec.enabled() {
            return;
        }
        let (tx, traffic, last) = (self.inputs.clone(), self.checks.traffic.clone(), self.checks.last_check.clone());
        let task = self.tasks.spawn("health checks", Lifetime::Finite, async move {
            let cause = crate::observe::health::watch(spec, traffic, last).await;
            let _ = tx.send(Event::HealthFailed { start, cause }.into());
        });
        self.checks.health = Some((start, task));
    }

    fn golden(&mut self, start: u32) {
        use crate::observe::golden;
        let tx = self.inputs.clone();
        let g = self.settings.golden.clone();
        let api = crate::observe::health::Api::of(&self.settings);
        let state = self.settings.state_dir.clone();
        let running = self
            .loads
            .running
            .as_ref()
            .map(|f| (f.fingerprint.clone(), serde_json::to_value(&f.setup).unwrap_or_default()));
        // A run taken over from a predecessor (an upgrade) has no facts of
        // its start here: gathered now, as that start gathered them, so that
        // its answers are compared with its own setup's reference.
        let settings = running.is_none().then(|| self.settings.clone());
        if let Some(t) = self.checks.golden.take() {
            t.abort();
        }
        self.checks.golden = Some(self.tasks.spawn("golden check", Lifetime::Finite, async move {
            let (fingerprint, setup) = match (running, settings) {
                (Some(r), _) => r,
                (None, Some(s)) => tokio::task::spawn_blocking(move || {
                    let f = crate::daemon::environment::load_facts(&s);
                    (f.fingerprint.clone(), serde_json::to_value(&f.setup).unwrap_or_default())
                })
                .await
                .unwrap_or_else(|e| std::panic::resume_unwind(e.into_panic())),
                (None, None) => ("unknown".to_string(), serde_json::Value::Null),
            };
            let gp = g.clone();
            let prompts = tokio::task::spawn_blocking(move || golden::prompts(&gp))
                .await
                .unwrap_or_else(|e| std::panic::resume_unwind(e.into_panic()));
            let (asked, questions) = match prompts {
                Ok(p) => (golden::ask(&api, &p, g.max_tokens, g.timeout).await, golden::questions(&p, g.max_tokens)),
                Err(e) => (Err(golden::Unanswered::Other(e)), String::new()),
            };
            let subject = golden::Subject { fingerprint, setup, questions };
            let verdict = tokio::task::spawn_blocking(move || match asked {
                Ok(answers) => golden::judge(&state, &subject, answers, g.tolerance, g.accept_changes),
                Err(e) => golden::failed(&state, &subject, e, g.tolerance),
            })
            .await
            .unwrap_or_else(|e| std::panic::resume_unwind(e.into_panic()));
            let _ = tx.send(Event::GoldenChecked { start, verdict }.into());
        }));
    }

    fn watch_load(&mut self, start: u32) {
        self.unwatch_load();
        let (api, tx) = (crate::observe::health::Api::of(&self.settings), self.inputs.clone());
        let timeout = self.settings.health.timeout;
        self.checks.load = Some(self.tasks.spawn("drain watch", Lifetime::Finite, async move {
            let mut said = None;
            loop {
                match crate::observe::health::in_flight(&api, timeout).await {
                    Ok(n) if n <= 0.0 => {
                        let _ = tx.send(Event::Quiet { start }.into());
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
        if let Some(t) = self.checks.load.take() {
            t.abort();
        }
    }
}

impl ports::Idle for RealBackend {
    fn sleep(&mut self, start: u32, level: u8) {
        // An engine asleep answers no completion: its checks end here and
        // begin again once it is awake.
        if let Some((_, task)) = self.checks.health.take() {
            task.abort();
        }
        let (api, tx) = (crate::observe::health::Api::of(&self.settings), self.inputs.clone());
        let timeout = crate::daemon::idle::request_timeout(&self.settings);
        self.tasks.spawn("sleep", Lifetime::Finite, async move {
            let result = crate::daemon::idle::sleep(&api, level, timeout).await;
            let _ = tx.send(Event::Slept { start, result }.into());
        });
    }

    fn wake(&mut self, start: u32) {
        let (api, tx) = (crate::observe::health::Api::of(&self.settings), self.inputs.clone());
        let timeout = crate::daemon::idle::request_timeout(&self.settings);
        self.tasks.spawn("wake", Lifetime::Finite, async move {
            let result = crate::daemon::idle::wake(&api, timeout).await;
            let _ = tx.send(Event::Woke { start, result }.into());
        });
    }

    fn parked(&mut self) {
        let settings = self.settings.clone();
        self.tasks.spawn("idle stop's cleanup", Lifetime::Finite, crate::daemon::idle::parked(settings));
    }
}

impl ports::Reports for RealBackend {
    fn report(&mut self, order: crate::supervisor::ReportOrder) -> Option<std::path::PathBuf> {
        self.reports.run.as_ref().filter(|r| r.start == order.start)?;
        // The run has failed: its checks have nothing more to say.
        self.stop_checks();
        let run = self.reports.run.as_ref()?;
        let now = std::time::SystemTime::now();
        let s = &self.settings;
        let job = crate::tell::reports::Job {
            state_dir: s.state_dir.clone(),
            name: crate::tell::reports::folder_name(now, &s.name, order.attempt),
            instance: s.name.clone(),
            spawned: run.spawned,
            begun: now,
            log_file: run.log_file.clone(),
            log_offset: run.offset,
            settings: s.reports.clone(),
            config_sha256: crate::tell::reports::sha256_hex(s.text.as_bytes()),
            classifier: self.log.classifier.clone(),
            warden: std::process::id() as i32,
            run_ended: self.tree.run_ended(),
            // The follower read the log to its end after the exit (the
            // driver waited for it): where the run's lines end.
            log_taken: run.log.clone().zip(self.log.follower.as_ref().and_then(LogFollower::drained_to)),
            kernel: run.kernel.clone(),
            log_hold: Some(self.log.hold.clone()),
            order,
        };
        let path = job.state_dir.join(crate::tell::reports::FOLDER).join(&job.name);
        let (tx, start, instance) = (self.inputs.clone(), job.order.start, s.name.clone());
        let wrong =
            (job.order.class == crate::supervisor::outcome::FailureClass::WrongAnswers).then(|| job.state_dir.clone());
        let (taken, gate) = watch::channel(false);
        let (done, ended) = oneshot::channel();
        let task = self.tasks.spawn("failure report", Lifetime::Finite, async move {
            match crate::tell::reports::write(job, move || {
                let _ = taken.send(true);
            })
            .await
            {
                Ok(p) => {
                    // The answers side by side, beside the rest.
                    if let Some(state) = wrong {
                        let to = p.clone();
                        let _ = tokio::task::spawn_blocking(move || {
                            if let Some(text) = crate::observe::golden::diff(&state) {
                                let _ = std::fs::write(to.join(crate::observe::golden::REPORT_FILE), text);
                            }
                        })
                        .await;
                    }
                    tracing::info!(INSTANCE = instance.as_str(), EVENT = "report", "failure report written: {}", p.display())
                }
                Err(e) => tracing::warn!(INSTANCE = instance.as_str(), EVENT = "report", error = %e, "cannot write the failure report"),
            }
            let _ = tx.send(Event::Reported { start }.into());
            let _ = done.send(());
        });
        // An earlier report still being written goes on.
        self.reports.pending.retain_mut(|r| r.try_recv() == Err(oneshot::error::TryRecvError::Empty));
        self.reports.pending.push(ended);
        self.reports.gate = Some(gate);
        self.reports.writing = Some(task);
        Some(path)
    }

    fn cancel_report(&mut self) {
        if let Some(task) = self.reports.writing.take() {
            task.abort();
        }
    }
}

impl Loads {
    /// Have `job` write the setups' records after the writes asked before
    /// it, one at a time, on the ledger's thread (on the blocking pool
    /// without it).
    fn records(&self, job: impl FnOnce() + Send + 'static) {
        match &self.writer {
            Some(w) => w.run(job),
            None => drop(tokio::task::spawn_blocking(job)),
        }
    }
}

impl ports::Loads for RealBackend {
    fn load_start(&mut self) -> Option<crate::supervisor::load::LoadStart> {
        let start = self.reports.run.as_ref()?.start;
        let found = self.loads.found.lock().unwrap_or_else(|p| p.into_inner()).take();
        let found = found.filter(|(s, _)| *s == start).map(|(_, f)| f)?;
        let mut load = self.loads.ledger.start(&found.facts, self.settings.ready.timeout);
        load.used = found.used;
        // The page cache as the child begins to read: what was cached and
        // what the read-ahead has added.
        if let Some(p) = &self.loads.prefetch {
            // The bytes of the files vLLM reads, where the read-ahead has
            // them (the ledger's own count takes every weight-like file).
            if p.now().total > 0 {
                load.weights_bytes = Some(p.now().total);
            }
            load.residency = p.now().residency();
            load.prefetch = p.reads() && !p.now().done;
            load.faster_loaders =
                crate::daemon::prefetch::faster_loaders(&self.settings.child.command, p.safetensors());
        }
        // The last-known-good of this warden's life, when it is another.
        load.last_good = self
            .loads
            .recovery
            .good
            .as_ref()
            .filter(|g| g.fingerprint != found.facts.fingerprint)
            .map(|g| (g.fingerprint.clone(), g.at.clone()));
        self.loads.running = Some(found.facts);
        Some(load)
    }

    fn load_ended(&mut self, record: crate::supervisor::load::LoadRecord) {
        // The load is over (ready, failed or stopped): so is its read-ahead.
        self.loads.prefetch = None;
        let at = self.reports.run.as_ref().map_or_else(std::time::SystemTime::now, |r| r.spawned);
        let write = self.loads.ledger.push(record, self.loads.running.as_ref(), at);
        if let Some(w) = self.loads.writer.clone() {
            // A load ends as the run becomes ready: READY=1 first.
            self.outbox.after_sent(move || w.send(write));
        }
    }

    fn fit(&mut self, set: std::collections::BTreeMap<crate::config::FitArg, String>) {
        self.loads.recovery.fit = set;
    }

    fn pin(&mut self, values: std::collections::BTreeMap<crate::config::FitArg, String>) {
        let Some(facts) = &self.loads.running else { return };
        let (state, fp) = (self.settings.state_dir.clone(), facts.fingerprint.clone());
        if let Some(d) = self.loads.recovery.dropped.get_mut(&fp) {
            d.retain(|a, _| !values.contains_key(a));
        }
        self.loads.records(move || {
            if let Err(e) = crate::tell::setups::pin(&state, &fp, &values) {
                tracing::warn!(EVENT = "fit", "cannot pin memory fit's values for setup {fp}: {e}");
            }
        });
    }

    fn unpin(&mut self, values: std::collections::BTreeMap<crate::config::FitArg, String>) {
        let Some(facts) = &self.loads.running else { return };
        let (state, fp) = (self.settings.state_dir.clone(), facts.fingerprint.clone());
        // Not used again by this warden, whenever the file is written.
        self.loads.recovery.dropped.entry(fp.clone()).or_default().extend(values.clone());
        self.loads.records(move || {
            if let Err(e) = crate::tell::setups::unpin(&state, &fp, &values) {
                tracing::warn!(EVENT = "fit", "cannot drop memory fit's pins of setup {fp}: {e}");
            }
        });
    }

    fn setup_good(&mut self) {
        let Some(facts) = &self.loads.running else { return };
        let record = crate::tell::setups::good_now(&self.settings, facts);
        let (state, keep) = (self.settings.state_dir.clone(), self.settings.rollback.keep);
        // The last-known-good is what this warden read and saw ready, kept
        // here; the record on disk is to show and compare.
        self.loads.recovery.good = Some(crate::daemon::recover::Good {
            fingerprint: record.fingerprint.clone(),
            at: record.at.clone(),
            settings: self.settings.clone(),
            setup: facts.setup.clone(),
        });
        self.loads.records(move || {
            if let Err(e) = crate::tell::setups::record_good(&state, &record, keep) {
                tracing::warn!(EVENT = "rollback", "cannot record the good setup {}: {e}", record.fingerprint);
            }
        });
    }

    fn rollback(&mut self) -> Result<Settings, String> {
        let good = self.loads.recovery.good.as_ref().ok_or("no setup has reached ready in this warden's life")?;
        let settings = crate::daemon::recover::rollback_settings(&self.settings, good)?;
        let expect =
            crate::daemon::recover::Expect { fingerprint: good.fingerprint.clone(), setup: good.setup.clone() };
        self.loads.recovery.revert = Some(self.settings.patches.clone());
        self.loads.recovery.expect = Some(expect);
        Ok(settings)
    }
}

impl ports::Upgrade for RealBackend {
    fn check_upgrade(&mut self) {
        let tx = self.inputs.clone();
        if self.settings.preload.enabled {
            let _ = tx.send(Input::UpgradeChecked(Err(crate::daemon::upgrade::UpgradeError::Preload)));
            return;
        }
        let Some(exe) = self.launch.handover.exe.clone() else {
            let _ = tx.send(Input::UpgradeChecked(Err(crate::daemon::upgrade::UpgradeError::NoOwnPath)));
            return;
        };
        self.tasks.spawn("upgrade check", Lifetime::Finite, async move {
            let checked = tokio::task::spawn_blocking(move || crate::daemon::upgrade::probe_version(&exe))
                .await
                .unwrap_or_else(|e| Err(crate::daemon::upgrade::UpgradeError::CheckFailed(e)));
            let _ = tx.send(Input::UpgradeChecked(checked));
        });
    }

    fn pause_lines(&mut self) -> bool {
        self.log.follower.as_ref().map(LogFollower::stop_reading).is_some()
    }

    fn lines_paused(&mut self, wait: Duration) -> Option<u64> {
        let offset = self.log.follower.as_ref()?.ended(wait)?;
        self.log.follower = None;
        Some(offset)
    }

    fn resume_lines(&mut self, offset: u64) {
        let start = self.kernel.start.load(std::sync::atomic::Ordering::SeqCst);
        let (Some(_), Some(sink)) = (self.tree.leader(), self.log.writer.as_ref().map(|w| w.sink().clone())) else {
            return;
        };
        match self.follow_log(&sink, offset, start) {
            Ok(f) => self.log.follower = Some(f),
            Err(e) => tracing::error!(error = %e, "cannot follow the child's log again"),
        }
    }

    fn exec_upgrade(&mut self, saved: crate::supervisor::Saved, offset: u64) -> String {
        use std::os::unix::fs::MetadataExt;
        let (Some(exe), Some(lock_fd)) = (self.launch.handover.exe.clone(), self.launch.handover.lock_fd) else {
            return "the warden's own path or lock is not known".into();
        };
        let pid = saved.pid;
        let Some(stat) = child::read_stat(pid as i32) else { return format!("the child, pid {pid}, is gone") };
        let Some(sink) = self.log.writer.as_ref().map(|w| w.sink().clone()) else {
            return "the child's output has no writer".into();
        };
        // Held until the exec: everything taken out of the pipe is in the
        // file, and the rest waits in the pipe for the successor.
        let held = sink.lock();
        let log = match held.file().metadata() {
            Ok(m) => m,
            Err(e) => return format!("cannot see the log file: {e}"),
        };
        let (pipe_fd, log_fd) = sink.fds();
        let state = crate::daemon::upgrade::Handoff {
            format: crate::daemon::upgrade::FORMAT,
            from: env!("CARGO_PKG_VERSION").into(),
            instance: self.settings.name.clone(),
            lock_fd,
            token: self.launch.token.clone(),
            child_start_time: stat.start_time,
            pipe_fd,
            log_fd,
            log_dev: log.dev(),
            log_ino: log.ino(),
            log_offset: offset,
            machine: saved,
            listeners: self
                .launch
                .handover
                .kept
                .iter()
                .map(|k| {
                    let (fd, address) = k.handed();
                    crate::daemon::upgrade::HandedListener { fd, address }
                })
                .collect(),
        };
        let path = crate::daemon::upgrade::state_path(&self.settings.status.file);
        if let Err(e) = crate::daemon::upgrade::write(&path, &state) {
            return format!("cannot write {}: {e}", path.display());
        }
        // The front door's sockets too: never closed, never bound again.
        let fds = [lock_fd, pipe_fd, log_fd]
            .into_iter()
            .chain(self.launch.handover.kept.iter().map(|k| std::os::fd::AsRawFd::as_raw_fd(&k.fd)));
        // SAFETY: the lock's descriptor and the front door's kept sockets
        // live as long as the warden; the pipe's and the log's as long as
        // `sink`, held here.
        let kept: Vec<_> = fds.map(|fd| unsafe { std::os::fd::BorrowedFd::borrow_raw(fd) }).collect();
        let restore = || {
            for &fd in &kept {
                let _ = rustix::io::fcntl_setfd(fd, rustix::io::FdFlags::CLOEXEC);
            }
        };
        if let Err(e) = kept.iter().try_for_each(|fd| crate::daemon::upgrade::keep_across_exec(*fd)) {
            restore();
            let _ = std::fs::remove_file(&path);
            return format!(
                "cannot keep the lock, the child's output, the log and the front door's sockets open across the exec: {e}"
            );
        }
        // The kernel-message follower is a process of ours the successor
        // would not know: stopped (it starts its own).
        self.kernel.follower = None;
        let e = crate::daemon::upgrade::exec(&exe, &path, &self.outbox);
        let _ = std::fs::remove_file(&path);
        restore();
        drop(held);
        self.follow_kernel();
        format!("cannot run {}: {e}", exe.display())
    }
}

impl ports::Config for RealBackend {
    fn read_config(&mut self) {
        // The operator's config again: a rollback is over.
        self.loads.recovery.expect = None;
        self.loads.recovery.revert = None;
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

    fn reconfigure(&mut self, settings: Settings, classifier: Classifier) -> crate::daemon::reload::ReloadPlan {
        let plan = crate::daemon::reload::plan(&self.settings, &settings);
        if self.preload.restarts_on(&self.settings, &settings) {
            tracing::info!(
                EVENT = "reload",
                "the weight-cache daemon starts again with the engine: its command changed"
            );
        }
        for c in crate::daemon::reload::identity_left(&self.settings, &settings) {
            tracing::warn!(EVENT = "reload", "{c}: takes effect when the warden itself restarts");
        }
        let running = settings.clone();
        tokio::task::spawn_blocking(move || crate::daemon::reload::save_running(&running));
        self.loads.ledger.keep(settings.ledger.keep);
        self.settings = settings;
        // The running child's lines are classified with the new patterns
        // from its follower's next read on.
        if let Some(f) = &self.log.follower {
            f.reclassify(classifier.clone());
            f.rotation(self.settings.child.log_rotation);
        }
        self.log.classifier = classifier;
        // The health checks of a ready run go on with the new settings.
        if let Some((start, task)) = self.checks.health.take() {
            task.abort();
            self.health(start);
        }
        plan
    }
}

impl ports::Tasks for RealBackend {
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

impl Drop for RealBackend {
    fn drop(&mut self) {
        self.stop_checks();
    }
}
