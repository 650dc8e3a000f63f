//! Runs the supervisor: one `select!` loop feeds the [`Machine`] what
//! happened (child events, log lines, HTTP readiness, stop requests, its own
//! deadlines) and carries out the effects it returns through a [`Backend`]
//! and a [`Notifier`]. The backend is a trait so that the loop can be driven
//! under paused time with a fake child; [`Real`] is the one with processes.

use std::collections::VecDeque;
use std::time::Duration;

use nix::sys::signal::Signal;
use tokio::sync::mpsc;
use tokio::time::Instant;

use crate::child::{self, Spec, Tree, TreeEvent};
use crate::config::Settings;
use crate::logwatch::{Classifier, Follower};
use crate::redact;
use crate::supervisor::{Effect, Event, Machine, Record, Severity, State};
use crate::systemd::{Note, Notifier};

/// What reaches the loop from outside.
#[derive(Debug)]
pub enum Input {
    Tree(TreeEvent),
    /// The pre-start steps of `start` are done.
    Prepared {
        start: u32,
        result: Result<(), (String, bool)>,
    },
    /// A pre-start step to show in `STATUS=`.
    Status(String),
    /// `health.failures` checks in a row failed for `start`.
    HealthFailed {
        start: u32,
        cause: String,
    },
    /// SIGHUP: the config read again, or every problem found in it.
    Reload(Box<Result<Settings, crate::config::Problems>>),
    Line {
        start: u32,
        text: String,
    },
    HttpReady {
        start: u32,
    },
    Stop,
}

/// Where effects on the child are carried out.
pub trait Backend {
    /// Start the pre-start steps of `start`; `Input::Prepared` when done,
    /// `Input::Status` for each step.
    fn prepare(&mut self, start: u32);
    /// Give up the pre-start steps; `Input::Prepared` still follows.
    fn cancel_prepare(&mut self);
    /// Check the health of ready start `start` until the run ends;
    /// `Input::HealthFailed` when it fails.
    fn health(&mut self, start: u32);
    /// Use these settings from the next start on.
    fn reconfigure(&mut self, settings: Settings);
    /// Spawn start `start`. `Err((message, permanent))` when it cannot be.
    fn spawn(&mut self, start: u32) -> Result<u32, (String, bool)>;
    fn probe(&mut self, start: u32);
    fn terminate(&mut self, sig: Signal);
    fn kill_tree(&mut self);
    /// Lines of the current run that are in the file but not delivered yet.
    /// Every line read before this call is already in the input queue.
    fn flush_lines(&mut self) -> Vec<String>;
}

/// Told of every state change and every line of the child.
pub trait Observer {
    /// After every batch of events: the machine as it is now.
    fn changed(&mut self, machine: &Machine);
    /// Every line of the child, classified.
    fn line(&mut self, _line: &crate::logwatch::Line) {}
}

/// An observer that does nothing, for tests.
pub struct Quiet;

impl Observer for Quiet {
    fn changed(&mut self, _: &Machine) {}
}

/// What the loop needs to know besides its inputs.
#[derive(Debug, Clone)]
pub struct Context {
    /// The `INSTANCE=` of every warden event.
    pub instance: String,
    /// How often to send `WATCHDOG=1`, if systemd asks for it.
    pub watchdog: Option<Duration>,
}

/// Run the machine until it exits; returns the exit code.
pub async fn drive(
    mut machine: Machine,
    backend: &mut impl Backend,
    notifier: &mut impl Notifier,
    mut classifier: Classifier,
    inputs: &mut mpsc::UnboundedReceiver<Input>,
    ctx: &Context,
    observer: &mut dyn Observer,
) -> i32 {
    let mut events: VecDeque<Event> = VecDeque::from([Event::Begin]);
    let mut deferred: VecDeque<Input> = VecDeque::new();
    let mut dog = ctx.watchdog.map(tokio::time::interval);
    loop {
        while let Some(ev) = events.pop_front() {
            let effects = machine.step(ev, Instant::now());
            // The status files first: whoever hears READY=1 finds them saying ready.
            observer.changed(&machine);
            for fx in effects {
                match fx {
                    Effect::Spawn { start } => {
                        classifier.reset();
                        events.push_back(match backend.spawn(start) {
                            Ok(pid) => Event::Spawned { start, pid },
                            Err((error, permanent)) => Event::SpawnFailed { start, error, permanent },
                        });
                    }
                    Effect::Prepare { start } => backend.prepare(start),
                    Effect::CancelPrepare => backend.cancel_prepare(),
                    Effect::Probe { start } => backend.probe(start),
                    Effect::Health { start } => backend.health(start),
                    Effect::Terminate(sig) => backend.terminate(sig),
                    Effect::KillTree => backend.kill_tree(),
                    Effect::Notify(notes) => notifier.notify(&notes),
                    Effect::Log(r) => log(ctx, &machine, &r),
                    Effect::Exit(_) => {}
                }
            }
        }
        if let State::Done(code) = machine.state {
            return code;
        }
        let input = match deferred.pop_front() {
            Some(i) => Some(i),
            None => {
                let deadline = machine.next_deadline();
                tokio::select! {
                    biased;
                    i = inputs.recv() => match i {
                        Some(i) => Some(i),
                        // Every sender gone: nothing can stop us any more
                        // but the machine itself; stop cleanly.
                        None => Some(Input::Stop),
                    },
                    _ = sleep_until(deadline) => None,
                    _ = tick(&mut dog) => {
                        notifier.notify(&[Note::Watchdog]);
                        continue;
                    }
                }
            }
        };
        match input {
            None => events.push_back(Event::Tick),
            Some(Input::Stop) => events.push_back(Event::StopRequested),
            Some(Input::HttpReady { start }) => events.push_back(Event::HttpReady { start }),
            Some(Input::Prepared { start, result }) => events.push_back(Event::Prepared { start, result }),
            Some(Input::Status(text)) => notifier.notify(&[Note::Status(text)]),
            Some(Input::HealthFailed { start, cause }) => events.push_back(Event::HealthFailed { start, cause }),
            Some(Input::Reload(result)) => match *result {
                Ok(settings) => match Classifier::new(&settings.patterns) {
                    Ok(c) => {
                        classifier = c;
                        events.push_back(Event::Reload(Box::new(crate::supervisor::Policy::from_settings(&settings))));
                        backend.reconfigure(settings);
                    }
                    Err(e) => reload_refused(ctx, notifier, &[e.to_string()]),
                },
                Err(problems) => {
                    let lines: Vec<String> = problems.0.iter().map(|p| p.to_string()).collect();
                    reload_refused(ctx, notifier, &lines);
                }
            },
            Some(Input::Line { start, text }) => {
                let line = classifier.classify(text);
                observer.line(&line);
                events.push_back(Event::Line { start, line });
            }
            Some(Input::Tree(TreeEvent::Empty)) => events.push_back(Event::TreeGone),
            Some(Input::Tree(TreeEvent::LeaderExited { pid, exit })) => {
                // The child's last lines (its traceback) are written before it
                // exits; make sure they are classified before its exit is.
                let start = machine.starts;
                let flushed = backend.flush_lines();
                while let Ok(i) = inputs.try_recv() {
                    match i {
                        Input::Line { start, text } => {
                            let line = classifier.classify(text);
                            observer.line(&line);
                            events.push_back(Event::Line { start, line })
                        }
                        other => deferred.push_back(other),
                    }
                }
                for text in flushed {
                    let line = classifier.classify(text);
                    observer.line(&line);
                    events.push_back(Event::Line { start, line });
                }
                events.push_back(Event::ChildExited { pid, exit });
            }
        }
    }
}

/// An invalid config on SIGHUP: the child keeps running, every problem is
/// logged, and `STATUS=` says so.
fn reload_refused(ctx: &Context, notifier: &mut impl Notifier, problems: &[String]) {
    for p in problems {
        tracing::error!(INSTANCE = ctx.instance.as_str(), EVENT = "reload", "{p}");
    }
    let first = problems.first().map(String::as_str).unwrap_or_default();
    notifier.notify(&[Note::Status(format!(
        "reload refused, still running the previous config: {} problem(s) in the new one; first: {first}",
        problems.len()
    ))]);
}

async fn sleep_until(deadline: Option<Instant>) {
    match deadline {
        Some(d) => tokio::time::sleep_until(d).await,
        None => std::future::pending().await,
    }
}

async fn tick(dog: &mut Option<tokio::time::Interval>) {
    match dog {
        Some(i) => {
            i.tick().await;
        }
        None => std::future::pending().await,
    }
}

fn log(ctx: &Context, m: &Machine, r: &Record) {
    let pid = m.child_pid().unwrap_or(0);
    let attempt = m.attempt();
    let (instance, event, msg) = (ctx.instance.as_str(), r.event, r.message.as_str());
    match r.severity {
        Severity::Info => {
            tracing::info!(INSTANCE = instance, CHILD_PID = pid, ATTEMPT = attempt, EVENT = event, "{msg}")
        }
        Severity::Warn => {
            tracing::warn!(INSTANCE = instance, CHILD_PID = pid, ATTEMPT = attempt, EVENT = event, "{msg}")
        }
        Severity::Error => {
            tracing::error!(INSTANCE = instance, CHILD_PID = pid, ATTEMPT = attempt, EVENT = event, "{msg}")
        }
    }
}

/// The backend with real processes, a real log file and real HTTP.
pub struct Real {
    settings: Settings,
    tree: Tree,
    follower: Option<Follower>,
    probe: Option<tokio::task::JoinHandle<()>>,
    /// The pre-start steps running for a start.
    preparing: Option<(u32, tokio::task::JoinHandle<()>)>,
    /// The health checks of the ready run.
    health: Option<tokio::task::JoinHandle<()>>,
    /// Seen in the log: the canary waits while real traffic flows.
    traffic: crate::health::Traffic,
    inputs: mpsc::UnboundedSender<Input>,
}

impl Real {
    /// Needs a tokio runtime; makes this process a subreaper.
    pub fn new(
        settings: Settings,
        inputs: mpsc::UnboundedSender<Input>,
        traffic: crate::health::Traffic,
    ) -> std::io::Result<Real> {
        let tx = inputs.clone();
        let tree = Tree::new(move |ev| {
            let _ = tx.send(Input::Tree(ev));
        })?;
        Ok(Real { settings, tree, follower: None, probe: None, preparing: None, health: None, traffic, inputs })
    }

    fn stop_checks(&mut self) {
        for task in [self.probe.take(), self.health.take()].into_iter().flatten() {
            task.abort();
        }
    }
}

impl Backend for Real {
    fn prepare(&mut self, start: u32) {
        self.stop_checks();
        self.follower = None;
        let (settings, tx) = (self.settings.clone(), self.inputs.clone());
        self.preparing = Some((
            start,
            tokio::spawn(async move {
                let result = crate::prepare::run(&settings, &|text| {
                    let _ = tx.send(Input::Status(text));
                })
                .await;
                let _ = tx.send(Input::Prepared { start, result });
            }),
        ));
    }

    fn cancel_prepare(&mut self) {
        if let Some((start, task)) = self.preparing.take() {
            task.abort();
            let _ = self.inputs.send(Input::Prepared { start, result: Err(("cancelled".into(), false)) });
        }
    }

    fn spawn(&mut self, start: u32) -> Result<u32, (String, bool)> {
        self.preparing = None;
        let c = &self.settings.child;
        let log_path = &c.log_file;
        let (file, offset) = child::open_log(log_path, start, std::time::SystemTime::now())
            .map_err(|e| (format!("cannot open log file {}: {e}", log_path.display()), false))?;
        let spec = Spec { argv: c.command.clone(), env: c.env.clone(), cwd: c.cwd.clone() };
        tracing::info!(
            INSTANCE = self.settings.name.as_str(),
            EVENT = "spawn",
            "running {} (env: {})",
            redact::command(&spec.argv),
            redact::env(&spec.env)
        );
        let tx = self.inputs.clone();
        // Follow before spawning, so that no line can be missed.
        let follower = Follower::start(log_path, offset, move |text| tx.send(Input::Line { start, text }).is_ok())
            .map_err(|e| (format!("cannot follow log file {}: {e}", log_path.display()), false))?;
        let pid = self.tree.spawn(&spec, &file).map_err(|e| {
            let permanent = matches!(e.kind(), std::io::ErrorKind::NotFound | std::io::ErrorKind::PermissionDenied);
            (format!("cannot start {}: {e}", spec.argv[0]), permanent)
        })?;
        self.follower = Some(follower);
        Ok(pid)
    }

    fn probe(&mut self, start: u32) {
        let Some(url) = self.settings.ready.http.clone() else {
            return;
        };
        let tx = self.inputs.clone();
        if let Some(p) = self.probe.take() {
            p.abort();
        }
        self.probe = Some(tokio::spawn(async move {
            let mut delay = Duration::from_millis(20);
            loop {
                let u = url.clone();
                let ok = tokio::task::spawn_blocking(move || http_ok(&u, Duration::from_secs(5))).await;
                if matches!(ok, Ok(true)) {
                    let _ = tx.send(Input::HttpReady { start });
                    return;
                }
                tokio::time::sleep(delay).await;
                delay = (delay * 2).min(Duration::from_secs(1));
            }
        }));
    }

    fn health(&mut self, start: u32) {
        let spec = crate::health::Spec::from_settings(&self.settings);
        if !spec.enabled() {
            return;
        }
        let (tx, traffic) = (self.inputs.clone(), self.traffic.clone());
        self.health = Some(tokio::spawn(async move {
            let cause = crate::health::watch(spec, traffic).await;
            let _ = tx.send(Input::HealthFailed { start, cause });
        }));
    }

    fn reconfigure(&mut self, settings: Settings) {
        self.settings = settings;
    }

    fn terminate(&mut self, sig: Signal) {
        self.stop_checks();
        self.tree.terminate(sig);
    }

    fn kill_tree(&mut self) {
        self.stop_checks();
        self.tree.kill_all();
    }

    fn flush_lines(&mut self) -> Vec<String> {
        self.follower.as_ref().map(Follower::drain_now).unwrap_or_default()
    }
}

impl Drop for Real {
    fn drop(&mut self) {
        self.stop_checks();
    }
}

/// True when `GET url` answers 200 within `timeout`.
pub fn http_ok(url: &str, timeout: Duration) -> bool {
    let agent: ureq::Agent =
        ureq::Agent::config_builder().timeout_global(Some(timeout)).http_status_as_error(false).build().into();
    matches!(agent.get(url).call(), Ok(r) if r.status() == 200)
}

#[cfg(test)]
mod tests;
