//! The weight-cache daemon (`[preload]`) at run time: started by the
//! pre-start steps before the engine, ready when its `/health` answers
//! 200 (its lines shown as progress meanwhile), kept across the engine's
//! restarts, watched while it runs (its end or `health.failures` failed
//! checks in a row fail the engine's run, and the next start begins with a
//! new daemon), and stopped after the engine. What each of these means is
//! `supervisor::preload`'s; its processes are `process::preload`'s.

use std::io::{Read, Write};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use nix::sys::signal::Signal;
use tokio::sync::{mpsc, watch};
use tokio::time::Instant;

use crate::config::Settings;
use crate::daemon::driver::Input;
use crate::daemon::prepare::Status;
use crate::process::child::Exit;
use crate::process::preload as proc;
use crate::supervisor::outcome::StartFailure;
use crate::supervisor::policy::KILL_GRACE;
use crate::supervisor::preload::{self as decide, DaemonLine, Found, Plan, PreloadStart, StartKind};

/// How long the end of a daemon's output is waited for after its exit,
/// for its last lines (the traceback that says why).
const LAST_LINES: Duration = Duration::from_secs(2);
/// The longest pause between two looks at a starting daemon's `/health`.
const MAX_PROBE_DELAY: Duration = Duration::from_secs(1);
/// One look at `/health`.
const PROBE_TIMEOUT: Duration = Duration::from_secs(5);

/// The daemon's state the watchers share.
#[derive(Debug, Default)]
struct Seen {
    last_error: Option<DaemonLine>,
    progress: Option<String>,
    gpu_memory_mib: Option<u64>,
}

/// One daemon that was spawned.
struct Daemon {
    pid: u32,
    start_time: u64,
    /// Where it is recorded.
    state_dir: std::path::PathBuf,
    command: Vec<String>,
    ready: Arc<AtomicBool>,
    /// Set when the warden stops it: its end is then no failure.
    stopping: Arc<AtomicBool>,
    exit: watch::Receiver<Option<Exit>>,
    /// Set once no process holds its output any more.
    gone: watch::Receiver<bool>,
    seen: Arc<Mutex<Seen>>,
    /// Its watcher (exit and health while it serves).
    watcher: Option<tokio::task::AbortHandle>,
}

impl Daemon {
    fn found(&self) -> Found {
        if self.exit.borrow().is_some() {
            return Found::None;
        }
        Found::Running { command: self.command.clone(), ready: self.ready.load(Ordering::SeqCst) }
    }
}

/// The daemon of this warden, if one runs.
#[derive(Clone)]
pub struct Preloader {
    slot: Arc<Mutex<Option<Daemon>>>,
    inputs: mpsc::UnboundedSender<Input>,
    /// Put in the daemon's environment, as in the engine's.
    token: String,
    /// Sent each progress line of a starting daemon.
    progress: Arc<Mutex<Option<mpsc::UnboundedSender<String>>>>,
    /// The daemon's lines go to the journal too, with the engine's.
    journal: Option<crate::tell::journal::Gatherer>,
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

impl Preloader {
    pub(crate) fn new(
        inputs: mpsc::UnboundedSender<Input>,
        token: String,
        journal: Option<crate::tell::journal::Gatherer>,
    ) -> Preloader {
        Preloader { slot: Arc::default(), inputs, token, progress: Arc::default(), journal }
    }

    /// What the status document shows: none when no daemon runs.
    pub(crate) fn view(&self) -> Option<decide::DaemonView> {
        let slot = lock(&self.slot);
        let d = slot.as_ref().filter(|d| d.exit.borrow().is_none())?;
        let state = if d.stopping.load(Ordering::SeqCst) {
            "stopping"
        } else if d.ready.load(Ordering::SeqCst) {
            "ready"
        } else {
            "starting"
        };
        let seen = lock(&d.seen);
        Some(decide::DaemonView {
            pid: d.pid,
            state: state.into(),
            progress: seen.progress.clone(),
            gpu_memory_mib: seen.gpu_memory_mib,
        })
    }

    /// Before the engine's spawn: a ready daemon of the wanted command is
    /// kept (an engine-only start); otherwise one is started and waited for
    /// (a full start). Without `[preload]`, a daemon left from before a
    /// reload is stopped.
    pub(crate) async fn ensure(&self, s: &Settings, status: Status) -> Result<Option<PreloadStart>, StartFailure> {
        if !s.preload.enabled {
            self.stop(s.child.stop_timeout).await;
            return Ok(None);
        }
        let found = lock(&self.slot).as_ref().map_or(Found::None, Daemon::found);
        match decide::plan(&found, &s.preload.command) {
            Plan::Keep => {
                let pid = lock(&self.slot).as_ref().map(|d| d.pid).unwrap_or_default();
                let start = PreloadStart { kind: StartKind::EngineOnly, daemon_ms: None, daemon_pid: pid };
                status(start.to_string());
                return Ok(Some(start));
            }
            Plan::Replace => {
                status("stopping the weight-cache daemon: its command changed, or it stopped answering".into());
                self.stop(s.child.stop_timeout).await;
            }
            Plan::Start => {
                // One that ended is only a record now.
                self.stop(Duration::ZERO).await;
                self.stop_leftover(s, &status).await?;
            }
        }
        self.start(s, status).await.map(Some)
    }

    /// A daemon an earlier warden of this instance recorded and left (it
    /// was killed): stopped before a new one starts, as the engine's tree
    /// is by the pre-start steps.
    async fn stop_leftover(&self, s: &Settings, status: &Status) -> Result<(), StartFailure> {
        let (state, name) = (s.state_dir.clone(), s.name.clone());
        let left = tokio::task::spawn_blocking(move || crate::process::prestart::daemon_leftovers(&state, &name))
            .await
            .unwrap_or_default();
        if left.is_empty() {
            return Ok(());
        }
        let shown: Vec<String> =
            left.iter().map(|p| format!("{} {}", p.pid, crate::process::prestart::cmdline(p.pid))).collect();
        let text = format!(
            "stopping {} leftover process(es) of an earlier weight-cache daemon: {}",
            left.len(),
            shown.join(", ")
        );
        tracing::warn!(INSTANCE = s.name.as_str(), EVENT = "leftovers", "{text}");
        status(text);
        crate::process::prestart::stop_leftovers(&left, Signal::SIGTERM, s.child.stop_timeout, KILL_GRACE)
            .await
            .map_err(|e| StartFailure::transient(e.to_string()))
    }

    async fn start(&self, s: &Settings, status: Status) -> Result<PreloadStart, StartFailure> {
        let p = &s.preload;
        let dir = p.socket_dir.clone();
        let log_path = proc::log_file(&s.child.log_file);
        let (log_at, now) = (log_path.clone(), std::time::SystemTime::now());
        let opened = tokio::task::spawn_blocking(move || {
            proc::socket_dir(&dir).map_err(|e| {
                StartFailure::permanent(format!("cannot make the weight-cache socket folder {}: {e}", dir.display()))
            })?;
            proc::open_log(&log_at, now)
                .map_err(|e| StartFailure::transient(format!("cannot open log file {}: {e}", log_at.display())))
        })
        .await
        .unwrap_or_else(|e| std::panic::resume_unwind(e.into_panic()))?;

        let mut env: std::collections::BTreeMap<String, String> =
            crate::process::caches::child_env(&crate::process::caches::of(s)).collect();
        env.extend(s.child.env.clone());
        env.insert(crate::process::prestart::RUN_TOKEN.into(), self.token.clone());
        let (exit_tx, exit) = watch::channel(None);
        let spawned = proc::spawn(&p.command, &env, s.child.cwd.as_deref(), move |e| {
            let _ = exit_tx.send(Some(e));
        })
        .map_err(|e| {
            let cause = format!("cannot start the weight-cache daemon {}: {e}", p.command[0]);
            match e.kind() {
                std::io::ErrorKind::NotFound | std::io::ErrorKind::PermissionDenied => StartFailure::permanent(cause),
                _ => StartFailure::transient(cause),
            }
        })?;
        let (pid, start_time) = (spawned.pid, spawned.start_time);
        tracing::info!(
            INSTANCE = s.name.as_str(),
            EVENT = "spawn",
            "running the weight-cache daemon (pid {pid}): {}; its lines go to {}",
            crate::util::redact::command(&p.command),
            log_path.display()
        );
        let seen = Arc::new(Mutex::new(Seen::default()));
        let (gone_tx, gone) = watch::channel(false);
        let (progress_tx, mut progress) = mpsc::unbounded_channel();
        *lock(&self.progress) = Some(progress_tx);
        read_output(spawned.output, opened, seen.clone(), self.progress.clone(), self.journal.clone(), gone_tx);
        let daemon = Daemon {
            pid,
            start_time,
            state_dir: s.state_dir.clone(),
            command: p.command.clone(),
            ready: Arc::default(),
            stopping: Arc::default(),
            exit: exit.clone(),
            gone: gone.clone(),
            seen: seen.clone(),
            watcher: None,
        };
        let (ready, stopping) = (daemon.ready.clone(), daemon.stopping.clone());
        *lock(&self.slot) = Some(daemon);
        let (state, name, token) = (s.state_dir.clone(), s.name.clone(), self.token.clone());
        let recorded = tokio::task::spawn_blocking(move || {
            crate::process::prestart::record_daemon(&state, &name, &token, pid as i32, start_time)
        })
        .await;
        if let Ok(Err(e)) = recorded {
            tracing::warn!(error = %e, "cannot record the weight-cache daemon: a warden killed now would leave it");
        }
        status(format!("starting the weight-cache daemon (pid {pid}): loading the weights"));

        let url = p.health_url().unwrap_or_default();
        let begun = Instant::now();
        let hard = begun + s.ready.timeout;
        let mut stall = begun + s.ready.stall;
        let mut exit_seen = exit.clone();
        let mut delay = Duration::from_millis(20);
        let mut next_look = begun;
        let outcome = loop {
            tokio::select! {
                () = ended(&mut exit_seen) => {
                    let e = *exit.borrow();
                    // Its last lines say why: read to the end first.
                    let mut g = gone.clone();
                    let closed = async move {
                        let _ = g.wait_for(|g| *g).await;
                    };
                    let _ = tokio::time::timeout(LAST_LINES, closed).await;
                    proc::kill_all(pid, start_time);
                    let last = lock(&seen).last_error.clone();
                    break Err(decide::failed_before_ready(e, last.as_ref()));
                }
                Some(text) = progress.recv() => {
                    stall = Instant::now() + s.ready.stall;
                    status(format!("weight-cache daemon (pid {pid}): {text}"));
                }
                _ = tokio::time::sleep_until(next_look) => {
                    if crate::observe::health::http_ok_async(&url, PROBE_TIMEOUT).await {
                        break Ok(());
                    }
                    next_look = Instant::now() + delay;
                    delay = (delay * 2).min(MAX_PROBE_DELAY);
                }
                _ = tokio::time::sleep_until(hard.min(stall)) => {
                    let what = if Instant::now() >= hard {
                        format!("not ready within ready.timeout ({})", humantime::format_duration(s.ready.timeout))
                    } else {
                        format!("no progress for ready.stall ({})", humantime::format_duration(s.ready.stall))
                    };
                    break Err(StartFailure::transient(format!("the weight-cache daemon (pid {pid}): {what}")));
                }
            }
        };
        *lock(&self.progress) = None;
        if let Err(failure) = outcome {
            self.stop(s.child.stop_timeout).await;
            return Err(failure);
        }
        ready.store(true, Ordering::SeqCst);
        let loaded = begun.elapsed();
        let started = PreloadStart {
            kind: StartKind::Full,
            daemon_ms: Some(u64::try_from(loaded.as_millis()).unwrap_or(u64::MAX)),
            daemon_pid: pid,
        };
        tracing::info!(
            INSTANCE = s.name.as_str(),
            EVENT = "ready",
            "the weight-cache daemon holds the weights: {started}"
        );
        status(started.to_string());
        // What it holds of the GPUs, when they can be asked.
        if !s.prestart.gpu_query.is_empty()
            && let Ok(Some(apps)) =
                crate::process::prestart::query_gpus(&s.prestart.gpu_query, crate::supervisor::policy::COMMAND_TIMEOUT)
                    .await
        {
            let ours = tokio::task::spawn_blocking(proc::daemon_pids).await.unwrap_or_default();
            let mib = apps.iter().filter(|a| ours.contains(&a.pid)).map(|a| a.mem_mib).sum::<u64>();
            lock(&seen).gpu_memory_mib = Some(mib);
        }
        let watcher = self.watch(s, pid, exit, ready, stopping, seen);
        if let Some(d) = lock(&self.slot).as_mut() {
            d.watcher = Some(watcher);
        }
        Ok(started)
    }

    /// While the daemon serves: its end, or `health.failures` failed
    /// checks of its `/health` in a row, fail the engine's run.
    fn watch(
        &self,
        s: &Settings,
        pid: u32,
        mut exit: watch::Receiver<Option<Exit>>,
        ready: Arc<AtomicBool>,
        stopping: Arc<AtomicBool>,
        seen: Arc<Mutex<Seen>>,
    ) -> tokio::task::AbortHandle {
        let (tx, url) = (self.inputs.clone(), s.preload.health_url().unwrap_or_default());
        let (interval, timeout, failures) = (s.health.interval, s.health.timeout, s.health.failures.max(1));
        let handle = tokio::spawn(async move {
            let mut failed = 0u32;
            let cause = loop {
                tokio::select! {
                    () = ended(&mut exit) => {
                        let e = *exit.borrow();
                        let last = match &lock(&seen).last_error {
                            Some(DaemonLine::Error { text, .. }) => Some(text.clone()),
                            _ => None,
                        };
                        break decide::lost(pid, e, last.as_deref());
                    }
                    _ = tokio::time::sleep(interval) => {
                        if crate::observe::health::http_ok_async(&url, timeout).await {
                            failed = 0;
                        } else {
                            failed += 1;
                            if failed >= failures {
                                break format!("the weight-cache daemon (pid {pid}) failed {failed} health checks in a row");
                            }
                        }
                    }
                }
            };
            ready.store(false, Ordering::SeqCst);
            if !stopping.load(Ordering::SeqCst) {
                tracing::error!(EVENT = "preload", "{cause}");
                let _ = tx.send(crate::supervisor::Event::DaemonLost { cause }.into());
            }
        });
        handle.abort_handle()
    }

    /// Stop the daemon, if one runs: its stop signal to its group, SIGKILL
    /// to what is left after `timeout`, then until its output is closed
    /// (every process of it gone) or [`KILL_GRACE`] has passed.
    pub(crate) async fn stop(&self, timeout: Duration) {
        let Some(d) = lock(&self.slot).take() else { return };
        if let Some(w) = &d.watcher {
            w.abort();
        }
        d.stopping.store(true, Ordering::SeqCst);
        let (mut exit, mut gone) = (d.exit.clone(), d.gone.clone());
        if exit.borrow().is_none() {
            tracing::info!(EVENT = "stop", "stopping the weight-cache daemon (pid {})", d.pid);
            proc::signal_group(d.pid, Signal::SIGTERM);
            let _ = tokio::time::timeout(timeout, ended(&mut exit)).await;
        }
        proc::kill_all(d.pid, d.start_time);
        let closed = async move {
            let _ = gone.wait_for(|g| *g).await;
        };
        if tokio::time::timeout(KILL_GRACE, closed).await.is_err() {
            tracing::warn!(
                EVENT = "stop",
                "the weight-cache daemon (pid {}) left processes that hold its output",
                d.pid
            );
        }
        let state = d.state_dir.clone();
        let _ = tokio::task::spawn_blocking(move || crate::process::prestart::clear_daemon_record(&state)).await;
    }

    /// A reload: the daemon of another command is stopped at the next
    /// start (see [`decide::plan`]); nothing to do now.
    pub(crate) fn restarts_on(&self, old: &Settings, new: &Settings) -> bool {
        decide::daemon_restarts(&old.preload.command, &new.preload.command, old.preload.enabled, new.preload.enabled)
    }
}

impl Drop for Preloader {
    fn drop(&mut self) {
        // The last handle: a panic must not orphan the daemon either.
        if Arc::strong_count(&self.slot) == 1
            && let Some(d) = lock(&self.slot).take()
        {
            proc::kill_all(d.pid, d.start_time);
        }
    }
}

/// vLLM's level word in a line (`(Proc pid=N) LEVEL MM-DD …`, or
/// uvicorn's `LEVEL:`), for the journal's priority.
pub(crate) fn level(line: &str) -> Option<crate::supervisor::classify::Level> {
    use crate::supervisor::classify::Level;
    let rest = match line.strip_prefix('(') {
        Some(r) => r.split_once(") ")?.1,
        None => line,
    };
    let word = rest.split([' ', ':']).next()?;
    Some(match word {
        "DEBUG" => Level::Debug,
        "INFO" => Level::Info,
        "WARNING" => Level::Warning,
        "ERROR" => Level::Error,
        "CRITICAL" => Level::Critical,
        _ => return None,
    })
}

/// Until the daemon's exit is known (the guard `wait_for` returns is not
/// held across the await of a `select!`).
async fn ended(exit: &mut watch::Receiver<Option<Exit>>) {
    let _ = exit.wait_for(Option::is_some).await;
}

/// A thread reads the daemon's output: each line appended to its log
/// file, read for what it says; `gone` set at the end of the output.
fn read_output(
    output: std::os::fd::OwnedFd,
    mut log: std::fs::File,
    seen: Arc<Mutex<Seen>>,
    progress: Arc<Mutex<Option<mpsc::UnboundedSender<String>>>>,
    mut journal: Option<crate::tell::journal::Gatherer>,
    gone: watch::Sender<bool>,
) {
    let run = move || {
        let mut pipe = std::fs::File::from(output);
        let mut buf = vec![0u8; 64 << 10];
        let mut pending: Vec<u8> = Vec::new();
        loop {
            let n = match pipe.read(&mut buf) {
                Ok(0) => break,
                Ok(n) => n,
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
                Err(_) => break,
            };
            let _ = log.write_all(&buf[..n]);
            pending.extend_from_slice(&buf[..n]);
            while let Some(i) = pending.iter().position(|b| *b == b'\n' || *b == b'\r') {
                let line: Vec<u8> = pending.drain(..=i).collect();
                let mut text = String::new();
                crate::supervisor::classify::strip(&line[..line.len() - 1], &mut text);
                if let Some(j) = journal.as_mut().filter(|_| !text.trim().is_empty()) {
                    j.line(&text, level(&text));
                }
                match decide::classify(&text) {
                    DaemonLine::Progress(p) => {
                        lock(&seen).progress = Some(p.clone());
                        if let Some(tx) = lock(&progress).as_ref() {
                            let _ = tx.send(p);
                        }
                    }
                    e @ DaemonLine::Error { .. } => lock(&seen).last_error = Some(e),
                    DaemonLine::Ready | DaemonLine::Other => {}
                }
            }
            if let Some(j) = journal.as_mut() {
                j.flush();
            }
            // A line without an end is cut, as the log follower cuts one.
            if pending.len() > 64 << 10 {
                pending.clear();
            }
        }
        let _ = gone.send(true);
    };
    if let Err(e) = std::thread::Builder::new().name("preload output".into()).spawn(run) {
        tracing::error!(error = %e, "no thread for the weight-cache daemon's output");
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_level_word_gives_the_journal_priority() {
        use crate::supervisor::classify::Level;
        assert_eq!(level("(MainProcess pid=7) WARNING 12-02 12:32:32 [cpu.py:224] Triton"), Some(Level::Warning));
        assert_eq!(level("(vllm-weight-cache-target-0 pid=9) ERROR 12-02 [daemon.py:1] x"), Some(Level::Error));
        assert_eq!(level("INFO:     Started server process"), Some(Level::Info));
        assert_eq!(level("Traceback (most recent call last):"), None);
    }
}
