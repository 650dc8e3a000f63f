//! Runs the supervisor: one `select!` loop feeds the [`Machine`] what
//! happened (child events, log lines, HTTP readiness, requests from
//! outside, its own deadlines, a background task that died) and carries out
//! the effects it returns through a [`Backend`] and a [`Notifier`]. The
//! backend is a trait so that the loop can be driven under paused time with
//! a fake child; processes, files and HTTP are not known here (see
//! `daemon` for the real backend).

use std::collections::VecDeque;
use std::future::Future;
use std::time::Duration;

use nix::sys::signal::Signal;
use tokio::sync::mpsc;
use tokio::time::Instant;
use tokio_stream::{Stream, StreamExt};

use crate::child::TreeEvent;
use crate::config::Settings;
use crate::exit::Code;
use crate::logwatch::Classifier;
use crate::outcome::{Prepared, StartFailure};
use crate::reload::Plan;
use crate::supervisor::{Effect, Event, Machine, Policy, Record, Severity};
use crate::systemd::{Note, Notifier};

/// What the warden is asked to do from outside (signals, the demo, tests).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Request {
    /// SIGTERM, SIGINT: stop the tree and exit.
    Stop,
    /// SIGHUP: read the config again and apply it.
    Reload,
}

/// What the backend's tasks report to the loop.
#[derive(Debug)]
pub enum Input {
    Tree(TreeEvent),
    /// The pre-start steps of `start` are over.
    Prepared {
        start: u32,
        result: Prepared,
    },
    /// A pre-start step of `start` begins.
    Step {
        start: u32,
        text: String,
    },
    /// What survived SIGKILL, described.
    Survivors(String),
    /// The kernel reported a fatal GPU fault during run `start`.
    GpuFault {
        start: u32,
        cause: String,
    },
    /// `health.failures` checks in a row failed for `start`.
    HealthFailed {
        start: u32,
        cause: String,
    },
    /// The config read again after a `Request::Reload`, or every problem
    /// found in it.
    Reload(Box<Result<Settings, crate::config::Problems>>),
    Line {
        start: u32,
        text: String,
    },
    HttpReady {
        start: u32,
    },
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
    /// Read the config file again, off the loop; `Input::Reload` follows.
    fn read_config(&mut self);
    /// Use these settings: the warden's own at once (the health checks of a
    /// ready run start again with them), the child's from the next start.
    /// Returns what changed against the settings in use.
    fn reconfigure(&mut self, settings: Settings) -> Plan;
    /// Spawn start `start`.
    fn spawn(&mut self, start: u32) -> Result<u32, StartFailure>;
    fn probe(&mut self, start: u32);
    fn terminate(&mut self, sig: Signal);
    fn kill_tree(&mut self);
    /// Describe what is left of the tree, off the loop: `Input::Survivors`.
    fn describe_survivors(&mut self);
    /// Lines of the current run that are in the file but not delivered yet.
    /// Every line read before this call is already in the input queue.
    fn flush_lines(&mut self) -> Vec<String>;
    /// Wait until a background task of the backend ends unexpectedly, and
    /// name it; pending while none does. Cancel-safe. The backend has
    /// already done what it can so that the tree can still be stopped (the
    /// reaper is started again).
    fn task_failed(&mut self) -> impl Future<Output = String>;
}

/// Told of every state change and every line of the child.
pub trait Observer {
    /// After every batch of events: the machine as it is now.
    fn changed(&mut self, machine: &Machine);
    /// Every line of the child, classified.
    fn line(&mut self, _line: &crate::logwatch::Line) {}
    /// A reloaded config (the status files may have moved).
    fn reconfigure(&mut self, _settings: &Settings) {}
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

/// The loop's parts that outlive one event.
pub struct Loop<'a, B: Backend, N: Notifier> {
    pub machine: Machine,
    pub backend: &'a mut B,
    pub notifier: &'a mut N,
    pub classifier: Classifier,
    pub inputs: &'a mut mpsc::UnboundedReceiver<Input>,
    pub ctx: &'a Context,
    pub observer: &'a mut dyn Observer,
}

impl<B: Backend, N: Notifier> Loop<'_, B, N> {
    /// Run the machine until it is done; `requests` ending counts as a stop
    /// request (nothing could ask for one any more).
    pub async fn run(mut self, requests: impl Stream<Item = Request>) -> Code {
        let mut requests = std::pin::pin!(requests.fuse());
        let mut events: VecDeque<Event> = VecDeque::from([Event::Begin]);
        let mut deferred: VecDeque<Input> = VecDeque::new();
        let mut dog = self.ctx.watchdog.map(tokio::time::interval);
        let mut requests_open = true;
        loop {
            while let Some(ev) = events.pop_front() {
                self.step(ev, &mut events);
            }
            if let Some(code) = self.machine.done() {
                return code;
            }
            if let Some(input) = deferred.pop_front() {
                self.input(input, &mut events, &mut deferred);
                continue;
            }
            let deadline = self.machine.next_deadline();
            let retry = self.notifier.retry_at();
            tokio::select! {
                biased;
                request = requests.next(), if requests_open => match request {
                    Some(Request::Stop) => events.push_back(Event::StopRequested),
                    Some(Request::Reload) => self.backend.read_config(),
                    None => {
                        requests_open = false;
                        events.push_back(Event::StopRequested);
                    }
                },
                task = self.backend.task_failed() => events.push_back(Event::TaskFailed { task }),
                input = self.inputs.recv() => match input {
                    Some(i) => self.input(i, &mut events, &mut deferred),
                    // The backend holds a sender as long as it lives.
                    None => events.push_back(Event::TaskFailed { task: "the input queue".into() }),
                },
                _ = sleep_until(deadline) => events.push_back(Event::Tick),
                _ = tick(&mut dog) => self.notifier.notify(&[Note::Watchdog]),
                _ = sleep_until(retry) => self.notifier.retry(),
            }
        }
    }

    /// One event through the machine, and its effects carried out.
    fn step(&mut self, ev: Event, events: &mut VecDeque<Event>) {
        let effects = self.machine.step(ev, Instant::now());
        // The status files first: whoever hears READY=1 finds them saying ready.
        self.observer.changed(&self.machine);
        for fx in effects {
            match fx {
                Effect::Spawn { start } => {
                    self.classifier.reset();
                    events.push_back(match self.backend.spawn(start) {
                        Ok(pid) => Event::Spawned { start, pid },
                        Err(failure) => Event::SpawnFailed { start, failure },
                    });
                }
                Effect::Prepare { start } => self.backend.prepare(start),
                Effect::CancelPrepare => self.backend.cancel_prepare(),
                Effect::Probe { start } => self.backend.probe(start),
                Effect::Health { start } => self.backend.health(start),
                Effect::Terminate(sig) => self.backend.terminate(sig),
                Effect::KillTree => self.backend.kill_tree(),
                Effect::DescribeSurvivors => self.backend.describe_survivors(),
                Effect::Notify(notes) => self.notifier.notify(&notes),
                Effect::Log(r) => log(self.ctx, &self.machine, &r),
            }
        }
    }

    fn classify(&mut self, start: u32, text: String, events: &mut VecDeque<Event>) {
        let line = self.classifier.classify(text);
        self.observer.line(&line);
        events.push_back(Event::Line { start, line });
    }

    fn input(&mut self, input: Input, events: &mut VecDeque<Event>, deferred: &mut VecDeque<Input>) {
        match input {
            Input::HttpReady { start } => events.push_back(Event::HttpReady { start }),
            Input::Prepared { start, result } => events.push_back(Event::Prepared { start, result }),
            Input::Step { start, text } => events.push_back(Event::PrepareStep { start, text }),
            Input::Survivors(description) => events.push_back(Event::Survivors { description }),
            Input::GpuFault { start, cause } => events.push_back(Event::GpuFault { start, cause }),
            Input::HealthFailed { start, cause } => events.push_back(Event::HealthFailed { start, cause }),
            Input::Reload(result) => match *result {
                Ok(settings) => match Classifier::new(&settings.patterns) {
                    Ok(c) => {
                        self.classifier = c;
                        let policy = Box::new(Policy::from_settings(&settings));
                        self.observer.reconfigure(&settings);
                        let plan = self.backend.reconfigure(settings);
                        events.push_back(match plan {
                            Plan::Restart { .. } => Event::Reload { policy, summary: plan.to_string() },
                            Plan::InPlace(_) | Plan::Nothing => {
                                Event::ReloadInPlace { policy, summary: plan.to_string() }
                            }
                        });
                    }
                    Err(e) => self.reload_refused(&[e.to_string()]),
                },
                Err(problems) => {
                    let lines: Vec<String> = problems.0.iter().map(|p| p.to_string()).collect();
                    self.reload_refused(&lines);
                }
            },
            Input::Line { start, text } => self.classify(start, text, events),
            Input::Tree(TreeEvent::Empty) => events.push_back(Event::TreeGone),
            Input::Tree(TreeEvent::LeaderExited { pid, exit }) => {
                // The child's last lines (its traceback) are written before it
                // exits; make sure they are classified before its exit is.
                let start = self.machine.starts();
                let flushed = self.backend.flush_lines();
                while let Ok(i) = self.inputs.try_recv() {
                    match i {
                        Input::Line { start, text } => self.classify(start, text, events),
                        other => deferred.push_back(other),
                    }
                }
                for text in flushed {
                    self.classify(start, text, events);
                }
                events.push_back(Event::ChildExited { pid, exit });
            }
        }
    }

    /// An invalid config on SIGHUP: the child keeps running, every problem is
    /// logged, and `STATUS=` says so.
    fn reload_refused(&mut self, problems: &[String]) {
        for p in problems {
            tracing::error!(INSTANCE = self.ctx.instance.as_str(), EVENT = "reload", "{p}");
        }
        let first = problems.first().map(String::as_str).unwrap_or_default();
        self.notifier.notify(&[Note::Status(format!(
            "reload refused, still running the previous config: {} problem(s) in the new one; first: {first}",
            problems.len()
        ))]);
    }
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
    let msg = crate::redact::text(&r.message);
    let (instance, event, msg) = (ctx.instance.as_str(), r.topic.as_str(), msg.as_ref());
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

#[cfg(test)]
mod tests;
