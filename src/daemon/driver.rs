//! Runs the supervisor: one `select!` loop feeds the [`Machine`] what
//! happened (child events, classified log lines, HTTP readiness, requests
//! from outside, its own deadlines, a background task that died) and carries out
//! the effects it returns through a [`Backend`] and a [`Notifier`]. The
//! backend is a set of traits, one per job ([`ports`]), so that the loop can
//! be driven under paused time with a fake child; processes, files and HTTP
//! are not known here (see `daemon` for the real backend).

use std::collections::VecDeque;
use std::future::Future;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use tokio::sync::mpsc;
use tokio::time::Instant;
use tokio_stream::{Stream, StreamExt};

use crate::config::Settings;
use crate::daemon::reload::ReloadPlan;
use crate::observe::logwatch::Delivery;
use crate::process::child::TreeEvent;
use crate::supervisor::Note;
use crate::supervisor::classify::Classifier;
use crate::supervisor::control::Control;
use crate::supervisor::exit::Code;
use crate::supervisor::{Effect, Event, Machine, Record, Severity, Topic, Upgrade};
use crate::tell::notify::Notifier;
use crate::tell::status::{LastReload, ReloadOutcome};
use crate::util::clock::{self, to_tokio};

pub(crate) mod ports;

/// What the warden is asked to do from outside (signals, the control
/// endpoint, the demo, tests).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Request {
    /// SIGTERM, SIGINT: stop the tree and exit.
    Stop,
    /// SIGHUP: read the config again and apply it.
    Reload,
    /// SIGUSR2: replace the warden by the binary at its path, keeping the
    /// ready child (see [`crate::daemon::upgrade`]).
    Upgrade,
    /// `POST /drain`, `/undrain`, `/restart` (which phases take them:
    /// [`Control`]).
    Control(Control),
}

/// When the loop last turned, for `/livez`: the loop beats at every turn
/// and at least every [`HEARTBEAT_EVERY`]; readers see how long ago.
#[derive(Debug, Clone)]
pub(crate) struct Heartbeat {
    base: std::time::Instant,
    /// Milliseconds from `base` to the last beat.
    last: Arc<AtomicU64>,
}

/// How often an idle loop beats.
pub(crate) const HEARTBEAT_EVERY: Duration = Duration::from_secs(1);

impl Default for Heartbeat {
    fn default() -> Self {
        Heartbeat { base: std::time::Instant::now(), last: Arc::default() }
    }
}

impl Heartbeat {
    pub(crate) fn beat(&self) {
        self.last.store(self.base.elapsed().as_millis() as u64, Ordering::Relaxed);
    }

    /// How long ago the loop last turned.
    pub(crate) fn age(&self) -> Duration {
        let last = Duration::from_millis(self.last.load(Ordering::Relaxed));
        self.base.elapsed().saturating_sub(last)
    }
}

/// What the backend's tasks report to the loop: the machine's events as
/// they are, and what the loop acts on itself first.
#[derive(Debug)]
pub enum Input {
    /// What happened, for the machine as it is.
    Event(Event),
    /// The child's tree: a leader's exit waits for the lines it wrote, and
    /// is asked first whether the kernel's OOM killer ended the run.
    Tree(TreeEvent),
    /// The config read again after a `Request::Reload`, or every problem
    /// found in it.
    Reload(Box<Result<Settings, crate::config::Problems>>),
    /// The binary an upgrade would run answered `--version` (its version),
    /// or why not.
    UpgradeChecked(Result<String, crate::daemon::upgrade::UpgradeError>),
}

impl From<Event> for Input {
    fn from(ev: Event) -> Input {
        Input::Event(ev)
    }
}

/// Where effects are carried out: one type that has every port (see
/// [`ports`]), the real backend or the tests' fake.
pub(crate) trait Backend:
    ports::Launch
    + ports::Checks
    + ports::Idle
    + ports::Reports
    + ports::Loads
    + ports::Upgrade
    + ports::Config
    + ports::Tasks
{
}

impl<B> Backend for B where
    B: ports::Launch
        + ports::Checks
        + ports::Idle
        + ports::Reports
        + ports::Loads
        + ports::Upgrade
        + ports::Config
        + ports::Tasks
{
}

/// Told of every state change (the child's lines are seen by the
/// follower's `logwatch::Tap`, on its own thread).
pub(crate) trait Observer {
    /// After every event: the machine as it is now.
    fn changed(&mut self, machine: &Machine);
    /// A reloaded config (the status files may have moved).
    fn reconfigure(&mut self, _settings: &Settings) {}
    /// A reload ended: applied, restarting the child, unchanged or refused.
    fn reloaded(&mut self, _reload: crate::tell::status::LastReload) {}
    /// When [`Observer::flush`] is due: what `changed` put off (writes
    /// coalesced to a few a second).
    fn due(&self) -> Option<std::time::Instant> {
        None
    }
    fn flush(&mut self) {}
    /// After the effects of an event, its notifications sent: work that
    /// must not delay them.
    fn settled(&mut self) {}
    /// A write that notifications depend on (the status files) was put
    /// off: the notes of the same change wait for it. Housekeeping that
    /// [`Observer::due`] also wakes up for (a journal count) holds nothing.
    fn put_off(&self) -> bool {
        false
    }
    /// How long one turn of the loop took, from its wake to its next wait.
    fn loop_turn(&mut self, _took: Duration) {}
    /// The notes of a change as they are sent: `STATUS=` may say more
    /// than the machine knows (the front door's held requests).
    fn amend(&self, notes: Vec<Note>) -> Vec<Note> {
        notes
    }
}

/// A turn of the loop longer than this is logged as a warning: the loop
/// carries the watchdog, the stop and `STATUS=`.
pub const SLOW_TURN: Duration = Duration::from_millis(100);

/// What the loop needs to know besides its inputs.
#[derive(Debug, Clone)]
pub(crate) struct Context {
    /// The `INSTANCE=` of every warden event.
    pub(crate) instance: String,
    /// How often to send `WATCHDOG=1`, if systemd asks for it.
    pub(crate) watchdog: Option<Duration>,
    /// Beaten at every turn of the loop, for `/livez`.
    pub(crate) heartbeat: Option<Heartbeat>,
}

/// How long the loop waits for the lines of an exited child, counted from
/// the last batch: a follower that neither reads nor fails cannot hold the
/// exit back for ever.
pub(crate) const DRAIN_PATIENCE: Duration = Duration::from_secs(10);

/// How long an upgrade waits for the log follower to stop.
const PAUSE_PATIENCE: Duration = Duration::from_secs(5);

/// The loop's parts that outlive one event.
pub(crate) struct Loop<'a, B: Backend, N: Notifier> {
    pub(crate) machine: Machine,
    pub(crate) backend: &'a mut B,
    pub(crate) notifier: &'a mut N,
    pub(crate) inputs: &'a mut mpsc::UnboundedReceiver<Input>,
    /// The lines that matter, classified by the follower, in the file's
    /// order; bounded, so that the follower waits when the loop is behind.
    pub(crate) lines: &'a mut mpsc::Receiver<Delivery>,
    pub(crate) ctx: &'a Context,
    pub(crate) observer: &'a mut dyn Observer,
    /// The front door's requests (`[front]`): an engine without any for
    /// `front.idle-stop` is stopped or put to sleep, and one that comes
    /// for it starts or wakes it.
    pub(crate) activity: Option<Arc<crate::daemon::front::Activity>>,
}

/// How far the loop has carried out the machine's `Effect::PauseLines`
/// (an upgrade's hand-over).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Handover {
    Off,
    /// Asked for: the lines are paused once no exit waits for its lines
    /// and the front door, if any, has emptied.
    Wanted,
    /// The front door takes no new connection; its open ones are waited
    /// for until then.
    FrontDoor(Instant),
}

impl Handover {
    fn until(self) -> Option<Instant> {
        match self {
            Handover::FrontDoor(until) => Some(until),
            Handover::Off | Handover::Wanted => None,
        }
    }
}

/// A leader's exit, held back until the lines it wrote are classified.
struct Exiting {
    pid: u32,
    exit: crate::process::child::Exit,
    start: u32,
    /// Given up on the follower after this.
    patience: Instant,
}

impl<B: Backend, N: Notifier> Loop<'_, B, N> {
    /// Run the machine until it is done; `requests` ending counts as a stop
    /// request (nothing could ask for one any more).
    pub(crate) async fn run(mut self, requests: impl Stream<Item = Request>) -> Code {
        let mut requests = std::pin::pin!(requests.fuse());
        let mut events: VecDeque<Event> = VecDeque::from([Event::Begin]);
        let mut exiting: Option<Exiting> = None;
        // Progress notes held while the observer puts off its write.
        let mut held = Held::default();
        let mut dog = self.ctx.watchdog.map(tokio::time::interval);
        let mut beat = self.ctx.heartbeat.as_ref().map(|_| tokio::time::interval(HEARTBEAT_EVERY));
        let mut requests_open = true;
        // When the loop last woke, and for what: each turn is measured,
        // from the instant its wait ended (before its branch's work).
        let mut turn: Option<(std::time::Instant, &'static str)> = None;
        // The longest turn, and what woke it: said when the loop ends.
        let mut longest: (Duration, &'static str) = (Duration::ZERO, "nothing");
        let woke_at = std::cell::Cell::new(std::time::Instant::now());
        let mut handover = Handover::Off;
        loop {
            if let Some(h) = &self.ctx.heartbeat {
                h.beat();
            }
            while let Some(ev) = events.pop_front() {
                self.step(ev, &mut events, &mut held, &mut handover);
                // Requests held at the front door while the engine went
                // idle (stopped or asleep) start it again at once.
                if events.is_empty() && self.machine.idle_now() && self.requests_waiting() {
                    events.push_back(Event::Wanted);
                }
            }
            if let Some((woke, what)) = turn.take() {
                let took = woke.elapsed();
                self.turn_took(took, what);
                if took > longest.0 {
                    longest = (took, what);
                }
            }
            // The machine asked for the run's lines paused, for an upgrade.
            match (handover, exiting.is_none(), self.activity.clone()) {
                // The front door is emptied first (see `hand_over`).
                (Handover::Wanted, true, Some(a)) => handover = Handover::FrontDoor(self.hand_over(&a)),
                (Handover::Wanted, true, None) => {
                    handover = Handover::Off;
                    self.pause_lines(&mut events);
                    continue;
                }
                // A leader's exit waits for its lines: the front door serves
                // meanwhile (the run will not be handed over).
                (Handover::FrontDoor(_), false, Some(a)) => {
                    handover = Handover::Wanted;
                    a.resume();
                }
                _ => {}
            }
            if let Some(code) = self.machine.done() {
                self.observer.flush();
                self.send_held(&mut held);
                tracing::info!(
                    INSTANCE = self.ctx.instance.as_str(),
                    EVENT = "loop",
                    "the loop's longest turn: {:.2} ms, handling {}",
                    longest.0.as_secs_f64() * 1e3,
                    longest.1
                );
                return code;
            }
            // While an exit waits for its lines, nothing else may come
            // between them: requests, inputs and deadlines wait too.
            let open = exiting.is_none();
            let deadline = self.machine.next_deadline().map(to_tokio);
            let patience = exiting.as_ref().map(|x| x.patience);
            let retry = self.notifier.retry_at();
            let due = self.observer.due().map(Instant::from_std);
            let idle_at = self.idle_at();
            let activity = self.activity.clone().filter(|_| self.machine.idle_now());
            let woke: &'static str = tokio::select! {
                biased;
                request = stamped(&woke_at, requests.next()), if requests_open && open => { match request {
                    Some(Request::Stop) => events.push_back(Event::StopRequested),
                    Some(Request::Reload) => self.backend.read_config(),
                    Some(Request::Control(c)) => events.push_back(c.event()),
                    Some(Request::Upgrade) => events.push_back(Event::Upgrade(Upgrade::Requested)),
                    None => {
                        requests_open = false;
                        events.push_back(Event::StopRequested);
                    }
                }; "a request" },
                task = stamped(&woke_at, self.backend.task_failed()) => {
                    // A dead follower delivers no more lines: the exit first.
                    if let Some(x) = exiting.take() {
                        events.push_back(Event::ChildExited { pid: x.pid, exit: x.exit });
                    }
                    events.push_back(Event::TaskFailed { task });
                    "a failed task"
                }
                input = stamped(&woke_at, self.inputs.recv()), if open => { match input {
                    Some(i) => self.input(i, &mut events, &mut exiting),
                    // The backend holds a sender as long as it lives.
                    None => events.push_back(Event::TaskFailed { task: "the input queue".into() }),
                }; "an input from the backend" },
                _ = stamped(&woke_at, sleep_until(deadline)), if open => { events.push_back(Event::Tick); "a deadline" }
                _ = stamped(&woke_at, sleep_until(idle_at)), if open => {
                    if let Some(quiet) = self.idle_quiet() {
                        events.push_back(Event::IdleFor { quiet });
                    }
                    "the idle timer"
                }
                _ = stamped(&woke_at, wanted(activity.as_deref())), if open => {
                    // A wake-up left from an earlier idle spell starts nothing:
                    // a request must be waiting.
                    if self.requests_waiting() {
                        events.push_back(Event::Wanted);
                    }
                    "a request for the idle engine"
                }
                _ = stamped(&woke_at, sleep_until(patience)), if !open => {
                    if let Some(x) = exiting.take() {
                        tracing::warn!(
                            INSTANCE = self.ctx.instance.as_str(),
                            "the log was not read to its end within {}s of the exit; acting on the exit",
                            DRAIN_PATIENCE.as_secs()
                        );
                        events.push_back(Event::ChildExited { pid: x.pid, exit: x.exit });
                    }
                    "an exit whose log was not read to its end"
                }
                cut = stamped(&woke_at, emptied(self.activity.as_deref(), handover.until())), if open && handover.until().is_some() => {
                    handover = Handover::Off;
                    if cut > 0 {
                        // Counted where it outlives the exec: the journal.
                        tracing::warn!(
                            INSTANCE = self.ctx.instance.as_str(),
                            EVENT = "upgrade",
                            CUT = cut,
                            "the front door did not empty within {}s: the upgrade cuts {cut} connections and the requests on them",
                            crate::daemon::front::HANDOVER_PATIENCE.as_secs()
                        );
                    }
                    self.pause_lines(&mut events);
                    "the front door emptied for an upgrade"
                }
                _ = stamped(&woke_at, tick(&mut dog)) => { self.notifier.notify(&[Note::Watchdog]); "the watchdog" }
                // The beat itself is at the top of the loop.
                _ = stamped(&woke_at, tick(&mut beat)) => "the heartbeat",
                _ = stamped(&woke_at, sleep_until(retry)) => { self.notifier.retry(); "a notification's retry" }
                _ = stamped(&woke_at, sleep_until(due)) => {
                    self.observer.flush();
                    self.send_held(&mut held);
                    "the status files' write"
                }
                delivery = stamped(&woke_at, self.lines.recv()) => { match delivery {
                    Some(Delivery::Lines { start, lines, .. }) => {
                        if let Some(x) = &mut exiting {
                            x.patience = Instant::now() + DRAIN_PATIENCE;
                        }
                        events.extend(lines.into_iter().map(|line| Event::Line { start, line }));
                    }
                    Some(Delivery::Drained { start }) => {
                        if let Some(x) = exiting.take_if(|x| x.start == start) {
                            events.push_back(Event::ChildExited { pid: x.pid, exit: x.exit });
                        }
                    }
                    // The backend holds a sender as long as it lives.
                    None => events.push_back(Event::TaskFailed { task: "the line queue".into() }),
                }; "the log's lines" },
            };
            turn = Some((woke_at.get(), woke));
        }
    }

    /// When the engine will have been without requests for `idle-stop`:
    /// counted from the last request's end, or from ready when none came
    /// since (a long load does not make an idle engine of a new one).
    /// While one is in flight, looked at again `idle-stop` from now.
    fn idle_at(&self) -> Option<Instant> {
        let (after, ready_at) = self.machine.idle_watch()?;
        let ready_at = to_tokio(ready_at);
        let activity = self.activity.as_ref()?;
        let now = Instant::now();
        let since = match activity.quiet_for(now) {
            Some(quiet) => now.checked_sub(quiet).unwrap_or(now).max(ready_at),
            None => now,
        };
        Some(since + after)
    }

    /// How long the engine has been without requests, once that is
    /// `idle-stop` or more.
    fn idle_quiet(&self) -> Option<Duration> {
        let (after, ready_at) = self.machine.idle_watch()?;
        let ready_at = to_tokio(ready_at);
        let now = Instant::now();
        let quiet = self.activity.as_ref()?.quiet_for(now)?.min(now - ready_at);
        (quiet >= after).then_some(quiet)
    }

    /// A request is at the front door (held, since the engine is idle).
    fn requests_waiting(&self) -> bool {
        self.activity.as_ref().is_some_and(|a| a.quiet_for(Instant::now()).is_none())
    }

    /// One turn of the loop, from its wake to its next wait: into the
    /// observer's histogram, and a warning past [`SLOW_TURN`], naming what
    /// woke it and the state it left.
    fn turn_took(&mut self, took: Duration, what: &str) {
        self.observer.loop_turn(took);
        if took > SLOW_TURN {
            tracing::warn!(
                INSTANCE = self.ctx.instance.as_str(),
                EVENT = "slow-turn",
                "the loop was held for {} ms handling {what} (now {})",
                took.as_millis(),
                self.machine.phase().as_str()
            );
        }
    }

    /// One event through the machine, and its effects carried out.
    fn step(&mut self, ev: Event, events: &mut VecDeque<Event>, held: &mut Held, handover: &mut Handover) {
        let mut effects = self.machine.step(ev, clock::now());
        // The report begun by this event, for its `failed` journal event;
        // the machine has its folder at once, so that one write of the
        // status files says the failure and its report.
        let mut report: Option<std::path::PathBuf> = None;
        if let Some(i) = effects.iter().position(|fx| matches!(fx, Effect::Report(_)))
            && let Effect::Report(order) = effects.remove(i)
        {
            let start = order.start;
            report = self.backend.report(order);
            match &report {
                Some(path) => {
                    let started = Event::ReportStarted { start, path: path.display().to_string() };
                    effects.extend(self.machine.step(started, clock::now()));
                }
                // None can be written: nothing to wait for.
                None => events.push_back(Event::Reported { start }),
            }
        }
        // The status files first: whoever hears READY=1 finds them saying ready.
        self.observer.changed(&self.machine);
        // A change of the progress line alone may be written later (a flood
        // of progress lines is a few writes a second); its notes wait with
        // it, so that no notification runs ahead of the files. Once written,
        // what was held goes with this change's own notes, in one datagram.
        let deferring = self.observer.put_off();
        if !deferring && !effects.iter().any(|fx| matches!(fx, Effect::Notify(_))) {
            self.send_held(held);
        }
        for fx in effects {
            match fx {
                // Carried out above; a machine asks for one report at a time.
                Effect::Report(_) => {}
                Effect::CancelReport => self.backend.cancel_report(),
                Effect::Spawn { start } => match self.backend.spawn(start) {
                    Ok(pid) => {
                        if let Some(load) = self.backend.load_start() {
                            events.push_back(Event::LoadKnown { start, load: Box::new(load) });
                        }
                        events.push_back(Event::Spawned { start, pid });
                    }
                    Err(failure) => events.push_back(Event::SpawnFailed { start, failure }),
                },
                Effect::LoadEnded(record) => {
                    log(self.ctx, &self.machine, &load_record(&record), None);
                    self.backend.load_ended(*record);
                }
                Effect::Prepare { start } => self.backend.prepare(start),
                Effect::Fit(set) => self.backend.fit(set),
                Effect::Pin(values) => self.backend.pin(values),
                Effect::Unpin(values) => self.backend.unpin(values),
                Effect::SetupGood => self.backend.setup_good(),
                Effect::Rollback => {
                    let policy = self.backend.rollback().and_then(|settings| {
                        let c = Classifier::new(&settings.patterns).map_err(|e| e.to_string())?;
                        let policy = Box::new(crate::daemon::policy::policy(&settings));
                        self.observer.reconfigure(&settings);
                        self.backend.reconfigure(settings, c);
                        Ok(policy)
                    });
                    events.push_back(Event::RolledBack { policy });
                }
                Effect::CancelPrepare => self.backend.cancel_prepare(),
                Effect::Probe { start } => self.backend.probe(start),
                Effect::Golden { start } => self.backend.golden(start),
                Effect::Sleep { start, level } => self.backend.sleep(start, level),
                Effect::Wake { start } => self.backend.wake(start),
                Effect::Parked => self.backend.parked(),
                Effect::Health { start } => self.backend.health(start),
                Effect::Terminate(sig) => self.backend.terminate(crate::process::signal::os(sig)),
                Effect::KillTree => self.backend.kill_tree(),
                Effect::DescribeSurvivors => self.backend.describe_survivors(),
                Effect::WatchLoad { start } => self.backend.watch_load(start),
                Effect::UnwatchLoad => self.backend.unwatch_load(),
                Effect::CheckUpgrade => self.backend.check_upgrade(),
                Effect::PauseLines => *handover = Handover::Wanted,
                Effect::ExecUpgrade { saved, offset } => {
                    // What was put off goes first: the successor starts from
                    // the status files and notes as they are.
                    self.observer.flush();
                    self.send_held(held);
                    let why = self.backend.exec_upgrade(*saved, offset);
                    events.push_back(Event::Upgrade(Upgrade::ExecFailed(why)));
                }
                Effect::ResumeLines { offset } => {
                    if let Some(offset) = offset {
                        self.backend.resume_lines(offset);
                    }
                    *handover = Handover::Off;
                    if let Some(a) = &self.activity {
                        a.resume();
                    }
                }
                Effect::Notify(notes) if deferring && notes.iter().all(may_wait) => {
                    held.hold(self.observer.amend(notes))
                }
                Effect::Notify(notes) => {
                    let notes = self.observer.amend(notes);
                    // What was held goes in the same datagram, after these
                    // notes, and only where they do not say newer.
                    if !held.is_empty() {
                        self.observer.flush();
                    }
                    self.notifier.notify(&held.behind(notes));
                }
                Effect::Log(r) => {
                    let path = report.as_ref().filter(|_| r.topic == Topic::Failed);
                    log(self.ctx, &self.machine, &r, path.map(|p| p.as_path()))
                }
            }
        }
        self.observer.settled();
    }

    /// Carry out the machine's `Effect::PauseLines`: stop following the
    /// run's lines, take in those already read, and say where they stopped
    /// (`Upgrade::LinesPaused`, after them), or why they did not.
    fn pause_lines(&mut self, events: &mut VecDeque<Event>) {
        let paused = if self.backend.pause_lines() {
            // The follower may wait for room in the line queue: emptied
            // while it ends.
            let give_up = Instant::now() + PAUSE_PATIENCE;
            loop {
                self.take_delivered(events);
                if let Some(offset) = self.backend.lines_paused(Duration::from_millis(10)) {
                    self.take_delivered(events);
                    break Ok(offset);
                }
                if Instant::now() >= give_up {
                    // A read that does not return (a dead network
                    // filesystem): its lines cannot be handed over.
                    break Err(format!("the log follower did not stop within {}s", PAUSE_PATIENCE.as_secs()));
                }
            }
        } else {
            Err("no log is followed".to_string())
        };
        events.push_back(Event::Upgrade(Upgrade::LinesPaused(paused)));
    }

    /// An upgrade is due and the front door serves: before the exec ends
    /// this process, the front door stops accepting (new clients wait in
    /// the kernel's backlog of the sockets the successor inherits), closes
    /// its kept-alive connections after their request, and answers what
    /// it holds; the exec waits until its connections are all closed, at
    /// most [`HANDOVER_PATIENCE`](crate::daemon::front::HANDOVER_PATIENCE).
    /// Returns that deadline.
    fn hand_over(&mut self, activity: &crate::daemon::front::Activity) -> Instant {
        activity.hand_over();
        tracing::info!(
            INSTANCE = self.ctx.instance.as_str(),
            EVENT = "upgrade",
            "upgrade: the front door takes no new connection and waits for {} open ({} requests in hand)",
            activity.connections(),
            activity.in_hand()
        );
        Instant::now() + crate::daemon::front::HANDOVER_PATIENCE
    }

    /// The lines already in the line queue, as events.
    fn take_delivered(&mut self, events: &mut VecDeque<Event>) {
        while let Ok(delivery) = self.lines.try_recv() {
            if let Delivery::Lines { start, lines, .. } = delivery {
                events.extend(lines.into_iter().map(|line| Event::Line { start, line }));
            }
        }
    }

    fn send_held(&mut self, held: &mut Held) {
        if !held.is_empty() {
            self.notifier.notify(&held.behind(Vec::new()));
        }
    }

    fn input(&mut self, input: Input, events: &mut VecDeque<Event>, exiting: &mut Option<Exiting>) {
        match input {
            Input::Event(ev) => events.push_back(ev),
            Input::UpgradeChecked(checked) => {
                events.push_back(Event::Upgrade(Upgrade::Checked(checked.map_err(|e| e.to_string()))))
            }
            Input::Reload(result) => match *result {
                Ok(settings) => match Classifier::new(&settings.patterns) {
                    Ok(c) => {
                        let policy = Box::new(crate::daemon::policy::policy(&settings));
                        self.observer.reconfigure(&settings);
                        let plan = self.backend.reconfigure(settings, c);
                        let outcome = match plan {
                            ReloadPlan::Restart { .. } => ReloadOutcome::Restarting,
                            ReloadPlan::InPlace(_) => ReloadOutcome::Applied,
                            ReloadPlan::Nothing => ReloadOutcome::Unchanged,
                        };
                        self.observer.reloaded(LastReload::now(outcome, &plan.to_string(), &[]));
                        events.push_back(match plan {
                            ReloadPlan::Restart { .. } => Event::Reload { policy, summary: plan.to_string() },
                            ReloadPlan::InPlace(_) | ReloadPlan::Nothing => {
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
            Input::Tree(TreeEvent::Empty) => events.push_back(Event::TreeGone),
            Input::Tree(TreeEvent::LeaderExited { pid, exit }) => {
                // Said before the exit, so that it is the run's cause.
                if let Some(cause) = self.backend.oom_killed(pid, exit) {
                    events.push_back(Event::OomKilled { start: self.machine.starts(), cause });
                }
                // The child's last lines (its traceback) are written before it
                // exits; make sure they are classified before its exit is:
                // the follower reads to the end of the file and says so
                // after the lines, in their queue.
                if self.backend.drain_lines() {
                    let start = self.machine.starts();
                    *exiting = Some(Exiting { pid, exit, start, patience: Instant::now() + DRAIN_PATIENCE });
                } else {
                    events.push_back(Event::ChildExited { pid, exit });
                }
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
        let n = problems.len();
        let summary = format!(
            "still running the previous config: {n} problem{} in the new one; first: {first}",
            if n == 1 { "" } else { "s" }
        );
        self.observer.reloaded(LastReload::now(ReloadOutcome::Refused, &summary, problems));
        self.notifier.notify(&[Note::Status(format!("reload refused, {summary}"))]);
    }
}

/// Notifications held while a write is put off: the newest of each kind
/// only (systemd shows the latest status; a timeout extension counts from
/// when it arrives), never a backlog of stale ones.
#[derive(Debug, Default)]
pub(crate) struct Held {
    status: Option<Note>,
    extend: Option<Note>,
}

impl Held {
    fn hold(&mut self, notes: Vec<Note>) {
        for n in notes {
            match n {
                Note::Status(_) => self.status = Some(n),
                Note::ExtendTimeout(_) => self.extend = Some(n),
                _ => {}
            }
        }
    }

    fn is_empty(&self) -> bool {
        self.status.is_none() && self.extend.is_none()
    }

    /// `notes`, then what was held of a kind they do not carry: one
    /// datagram, the notes that must not wait (`READY=1`, `STOPPING=1` …)
    /// first, no stale status after a newer one. Empties the hold.
    fn behind(&mut self, mut notes: Vec<Note>) -> Vec<Note> {
        let has = |notes: &[Note], kind: &Note| {
            notes.iter().any(|n| std::mem::discriminant(n) == std::mem::discriminant(kind))
        };
        for held in [self.status.take(), self.extend.take()].into_iter().flatten() {
            if !has(&notes, &held) {
                notes.push(held);
            }
        }
        notes
    }
}

/// A note that may wait with a put-off write: a status line or a timeout
/// extension, whose latest value is all that counts.
fn may_wait(n: &Note) -> bool {
    matches!(n, Note::Status(_) | Note::ExtendTimeout(_))
}

/// `f`, the instant it is ready put in `woke`: where the turn it wakes
/// begins.
async fn stamped<F: Future>(woke: &std::cell::Cell<std::time::Instant>, f: F) -> F::Output {
    let out = f.await;
    woke.set(std::time::Instant::now());
    out
}

async fn sleep_until(deadline: Option<Instant>) {
    match deadline {
        Some(d) => tokio::time::sleep_until(d).await,
        None => std::future::pending().await,
    }
}

/// Resolves when a request comes for the idle engine; never without a
/// front door.
/// Resolves once the front door's connections are all closed, or at
/// `until`; the number still open.
async fn emptied(activity: Option<&crate::daemon::front::Activity>, until: Option<Instant>) -> usize {
    match (activity, until) {
        (Some(a), Some(until)) => a.emptied(until).await,
        _ => std::future::pending().await,
    }
}

async fn wanted(activity: Option<&crate::daemon::front::Activity>) {
    match activity {
        Some(a) => a.wanted().await,
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

/// A warden event into the log; `report`: the failure report's folder,
/// as the `REPORT=` field of a `failed` event.
/// The journal's line for a load that ended: its total, phases and cache.
fn load_record(r: &crate::supervisor::load::LoadRecord) -> Record {
    let phases: Vec<String> = r.phases.iter().map(|t| format!("{} {:.1}s", t.phase, t.secs)).collect();
    let cache = r.cache.as_ref().map(|c| format!("; compile cache: {}", c.describe())).unwrap_or_default();
    let gbps = r.gbps.map(|g| format!("; weights {g:.2} GB/s")).unwrap_or_default();
    let message = format!(
        "load {} after {:.1}s: {}{cache}{gbps}",
        r.outcome.word(),
        r.total_secs,
        if phases.is_empty() { "no phase seen".to_string() } else { phases.join(", ") }
    );
    Record { severity: Severity::Info, topic: Topic::Load, message, about: None }
}

fn log(ctx: &Context, m: &Machine, r: &Record, report: Option<&std::path::Path>) {
    // The run the record names, else the machine's of the moment.
    let (pid, attempt) = match r.about {
        Some(run) => (run.pid, run.attempt),
        None => (m.child_pid(), m.attempt()),
    };
    let pid = pid.unwrap_or(0);
    let msg = crate::util::redact::text(&r.message);
    let (instance, event, msg) = (ctx.instance.as_str(), r.topic.as_str(), msg.as_ref());
    let report = report.map(|p| crate::util::escape::one_line(&p.display().to_string(), crate::util::escape::MAX_LINE));
    let report = report.as_deref();
    let id = r.topic.message_id();
    match r.severity {
        Severity::Info => {
            tracing::info!(
                INSTANCE = instance,
                CHILD_PID = pid,
                ATTEMPT = attempt,
                EVENT = event,
                REPORT = report,
                MESSAGE_ID = id,
                "{msg}"
            )
        }
        Severity::Warn => {
            tracing::warn!(
                INSTANCE = instance,
                CHILD_PID = pid,
                ATTEMPT = attempt,
                EVENT = event,
                REPORT = report,
                MESSAGE_ID = id,
                "{msg}"
            )
        }
        Severity::Error => {
            tracing::error!(
                INSTANCE = instance,
                CHILD_PID = pid,
                ATTEMPT = attempt,
                EVENT = event,
                REPORT = report,
                MESSAGE_ID = id,
                "{msg}"
            )
        }
    }
}

#[cfg(test)]
mod tests;
