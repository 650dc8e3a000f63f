//! The daemon's composition: [`run`] wires the real parts around the
//! driver's loop and returns the exit code — the backend (`backend`: the
//! process tree, the log follower, the pre-start steps, HTTP readiness and
//! health, failure reports), the observer of state (`observer`: status
//! files, metrics, the tree record, the endpoint's view), the endpoint
//! (`server`), and the exit under its deadline (`deadline`). Reload and
//! upgrade in place are `reload` and `upgrade`; what `check` verifies
//! outside the config file is `environment`.
//!
//! May use every layer below. Where requests come from (signals, the demo,
//! a test) and how arguments are parsed are not known here.

mod backend;
mod deadline;
pub mod driver;
pub mod environment;
pub mod front;
pub mod idle;
mod observer;
pub mod policy;
pub mod prefetch;
pub mod preload;
pub mod prepare;
pub mod recover;
pub mod reload;
pub mod server;
pub mod upgrade;

use std::time::Duration;

use tokio::sync::mpsc;
use tokio_stream::Stream;

pub use self::backend::{Handover, RealBackend};
pub use self::deadline::EXIT_DEADLINE;
use self::deadline::ExitDeadline;
use self::driver::{Context, Request};
use self::observer::StateObserver;
use crate::config::Settings;
use crate::supervisor::classify::Classifier;
use crate::supervisor::exit::Code;
use crate::supervisor::{Machine, Policy};
use crate::tell::notify::Notifier;
use crate::tell::outbox::Outbox;
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
    notifier: impl Notifier + 'static,
    watchdog: Option<Duration>,
    requests: impl Stream<Item = Request>,
    mut handover: Handover,
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
    let endpoint = match Endpoint::bind(&settings) {
        Ok(e) => e,
        Err(code) => return code,
    };
    // The front door's sockets, open before anything starts and for the
    // warden's whole life (a second descriptor of each is kept for an
    // upgrade's successor).
    let front_door = match open_front(&settings, &mut handover).and_then(|l| FrontDoor::new(&settings, l)) {
        Ok(f) => f,
        Err(code) => return code,
    };
    let heartbeat = driver::Heartbeat::default();
    let ctx = Context { instance: settings.name.clone(), watchdog, heartbeat: Some(heartbeat.clone()) };
    let (view_tx, view_rx) = tokio::sync::watch::channel(server::View::default());
    let (control_tx, control_rx) = mpsc::unbounded_channel();
    let requests =
        tokio_stream::StreamExt::merge(requests, tokio_stream::wrappers::UnboundedReceiverStream::new(control_rx));
    let last_check = crate::observe::health::LastCheck::default();
    let (tx, mut rx) = mpsc::unbounded_channel();
    let (lines_tx, mut lines_rx) = mpsc::channel(crate::observe::logwatch::QUEUE);
    let journal = crate::tell::journal::Forwarder::from_env(&settings.name);
    let gatherer = journal.as_ref().map(|j| j.gatherer());
    // The status files and the notes behind them, off the loop.
    let dog = notifier.watchdog();
    let (outbox, mut notifier): (Outbox, Box<dyn Notifier>) = match Outbox::start(notifier) {
        Ok(outbox) => (outbox.clone(), Box::new(crate::tell::outbox::Behind::new(outbox, dog))),
        Err(notifier) => (Outbox::direct(), Box::new(notifier)),
    };
    let mut observer = StateObserver::new(&settings, journal, &token, view_tx, outbox.clone());
    // What the front door tells the loop of its requests (`[front]`).
    let activity = front_door.as_ref().map(|_| std::sync::Arc::new(front::Activity::default()));
    let front_door = front_door.zip(activity.clone()).map(|(f, a)| f.open(&mut observer, a));
    let shared = server::Shared {
        view: view_rx,
        heartbeat,
        metrics: observer.status.metrics(),
        last_check: last_check.clone(),
        requests: control_tx,
    };
    reload::save_running(&settings);
    let policy = crate::daemon::policy::policy(&settings);
    let cleanup = settings.clone();
    let adopted = handover.adopted.clone();
    let backend = RealBackend::new(settings, classifier, tx, lines_tx, gatherer, token, handover, last_check, outbox);
    let mut backend = match backend {
        Ok(b) => b,
        Err(e) => {
            tracing::error!(error = %e, "cannot become a subreaper");
            return Code::Internal;
        }
    };
    observer.preload = Some(backend.preload.clone());
    let machine = machine(&mut backend, policy, adopted);
    endpoint.serve(&mut backend.tasks, shared);
    if let Some(serve) = front_door {
        match front::apart(serve) {
            Ok(serving) => {
                backend.tasks.spawn("front door", Lifetime::Owned, serving);
            }
            Err(e) => {
                tracing::error!(EVENT = "front", error = %e, "cannot start the front door's thread");
                return Code::Internal;
            }
        }
    }
    let code = driver::Loop {
        machine,
        backend: &mut backend,
        notifier: &mut notifier,
        inputs: &mut rx,
        lines: &mut lines_rx,
        ctx: &ctx,
        observer: &mut observer,
        activity: activity.clone(),
    }
    .run(requests)
    .await;
    if let (Some(a), Some(f)) = (activity, &observer.front) {
        // Whatever the machine ended in: the warden will not serve again.
        f.gate.send_replace(front::Gate::Closed);
        front_closed(&a).await;
    }
    finish(code, backend, observer, &cleanup).await
}

/// The loop is done: the front door takes no new connection (they wait
/// in the kernel's backlog, for the next warden when systemd keeps the
/// socket in its store) and its open connections get their answers (a
/// 503 now that the warden will not serve again; one accepted whose
/// request is still on its way gets it too) before the process ends: an
/// exit under an open connection is a reset for its client. At most
/// [`front::EXIT_PATIENCE`].
async fn front_closed(a: &front::Activity) {
    a.hand_over();
    let open = a.connections();
    if open > 0 {
        tracing::info!(EVENT = "front", "the front door answers its last requests: {open} connections open");
    }
    let left = a.emptied(tokio::time::Instant::now() + front::EXIT_PATIENCE).await;
    if left > 0 {
        tracing::warn!(
            EVENT = "front",
            "the front door did not empty within {}s: {left} connections end with the warden",
            front::EXIT_PATIENCE.as_secs()
        );
    }
}

/// The front door's listening sockets (none without `[front]`), with a
/// second descriptor of each kept in `handover` for an upgrade's
/// successor. A socket that cannot be had is a config problem.
fn open_front(
    settings: &Settings,
    handover: &mut Handover,
) -> Result<Vec<(crate::config::Listen, front::listen::Listener)>, Code> {
    let inherited = std::mem::take(&mut handover.listeners);
    let opened = match settings.front.as_ref() {
        Some(f) => front::listen::open(f, inherited),
        None => front::listen::without_front(inherited).map(|()| Vec::new()),
    };
    let listeners = opened.map_err(|e| {
        // An address in use: by whom, as the port check before a start says it.
        let held = match &e {
            front::listen::ListenError::Bind { address, source } if source.kind() == std::io::ErrorKind::AddrInUse => {
                address
                    .parse::<std::net::SocketAddr>()
                    .ok()
                    .map(|a| crate::process::prestart::describe_holders(a.port()))
            }
            _ => None,
        };
        match held {
            Some(who) => tracing::error!(EVENT = "front", error = %e, "cannot open the front door: {who}"),
            None => tracing::error!(EVENT = "front", error = %e, "cannot open the front door"),
        }
        Code::Config
    })?;
    handover.kept = front::listen::kept(&listeners).map_err(|e| {
        tracing::error!(EVENT = "front", error = %e, "cannot keep the front door's sockets for an upgrade");
        Code::Internal
    })?;
    Ok(listeners)
}

/// A new machine, or one that takes over the ready run of an upgrading
/// predecessor.
fn machine(backend: &mut RealBackend, policy: Policy, adopted: Option<upgrade::Handoff>) -> Machine {
    match adopted.map(|state| backend.adopt(&state).map(|()| state)) {
        Some(Ok(state)) => {
            Machine::adopt(policy, fastrand::u64(..), &state.machine, &state.from, crate::util::clock::now())
        }
        Some(Err(e)) => {
            // The child is ours and recorded with its token: the pre-start
            // steps stop it as a leftover, then the model is loaded again.
            tracing::error!(EVENT = "upgrade", error = %e, "cannot take the ready run over: starting again");
            Machine::new(policy, fastrand::u64(..))
        }
        None => Machine::new(policy, fastrand::u64(..)),
    }
}

/// The endpoint's listeners, bound before anything starts: a TCP listener
/// that cannot be had is a config problem; the socket is worth a warning.
/// A warden that ends before it serves them (a front door's address in
/// use) removes its control socket: a socket nobody listens on would be
/// taken for a running instance.
struct Endpoint {
    socket: Option<tokio::net::UnixListener>,
    tcp: Option<(tokio::net::TcpListener, Option<String>)>,
    path: std::path::PathBuf,
}

impl Drop for Endpoint {
    fn drop(&mut self) {
        if self.socket.take().is_some() {
            let _ = std::fs::remove_file(&self.path);
        }
    }
}

impl Endpoint {
    fn bind(settings: &Settings) -> Result<Endpoint, Code> {
        let socket = match server::bind_socket(&settings.server.socket) {
            Ok(l) => Some(l),
            Err(e) => {
                tracing::warn!(error = %e, "the control socket is off: `vllm-warden drain|undrain|restart` cannot reach this warden");
                None
            }
        };
        let mut endpoint = Endpoint { socket, tcp: None, path: settings.server.socket.clone() };
        endpoint.tcp = match settings.server.listen.map(|a| server::bind_tcp(a, settings.server.token_file.as_deref()))
        {
            Some(Ok(l)) => Some(l),
            Some(Err(e)) => {
                // An address in use: by whom, as the port check before a start says it.
                match &e {
                    server::ListenError::Tcp { addr, source } if source.kind() == std::io::ErrorKind::AddrInUse => {
                        let who = crate::process::prestart::describe_holders(addr.port());
                        tracing::error!(error = %e, "cannot serve [server] listen: {who}");
                    }
                    _ => tracing::error!(error = %e, "cannot serve [server] listen"),
                }
                return Err(Code::Config);
            }
            None => None,
        };
        Ok(endpoint)
    }

    /// Watched as every other task: an endpoint that stops serving is a
    /// part of the warden that died.
    fn serve(mut self, tasks: &mut Tasks, shared: server::Shared) {
        if let Some(l) = self.socket.take() {
            tasks.spawn("control socket", Lifetime::Owned, server::serve_socket(l, shared.clone()));
        }
        if let Some((l, token)) = self.tcp.take() {
            tasks.spawn("TCP endpoint", Lifetime::Owned, server::serve_tcp(l, token, shared));
        }
    }
}

/// The front door (`[front]`): its listeners, bound before anything
/// starts (an address that cannot be had is a config problem, as the
/// endpoint's), and where it forwards.
struct FrontDoor {
    front: crate::config::Front,
    ready_timeout: std::time::Duration,
    engine: crate::config::Engine,
    listeners: Vec<(crate::config::Listen, front::Listener)>,
}

impl FrontDoor {
    /// The door of `settings` on its `listeners`; none without `[front]`.
    fn new(
        settings: &Settings,
        listeners: Vec<(crate::config::Listen, front::Listener)>,
    ) -> Result<Option<FrontDoor>, Code> {
        let Some(f) = &settings.front else { return Ok(None) };
        let Some(engine) = settings.engine.clone() else {
            tracing::error!("[front] needs the engine's address, which this profile does not give");
            return Err(Code::Config);
        };
        Ok(Some(FrontDoor { front: f.clone(), ready_timeout: settings.ready.timeout, engine, listeners }))
    }

    /// The door, its gate given to the observer and its requests told to
    /// `activity`; what serves it.
    fn open(
        self,
        observer: &mut StateObserver,
        activity: std::sync::Arc<front::Activity>,
    ) -> impl std::future::Future<Output = ()> + Send + 'static {
        let starting = front::Gate::Holding { why: "model starting".into(), eta: None };
        let (gate_tx, gate_rx) = tokio::sync::watch::channel(starting);
        let door = front::Door::new(
            &self.front,
            self.ready_timeout,
            &self.engine,
            gate_rx,
            activity,
            observer.status.metrics(),
        );
        observer.front = Some(observer::FrontSide {
            gate: gate_tx,
            door: door.clone(),
            listen: self.listeners.iter().map(|(l, _)| l.shown()).collect(),
            engine: self.engine.shown(),
        });
        front::proxy::serve(door, self.listeners)
    }
}

/// How long the exit waits for the status files and the notifications
/// still to go (a stuck filesystem is not waited for beyond it).
const OUTBOX_PATIENCE: Duration = Duration::from_secs(5);

/// After the loop: what is left to do, under the exit's deadline.
async fn finish(code: Code, mut backend: RealBackend, mut observer: StateObserver, settings: &Settings) -> Code {
    // The engine is gone: now the weight-cache daemon, under its own stop
    // timeout (before the exit's deadline, which it would overrun).
    backend.preload.stop(settings.child.stop_timeout).await;
    let exit = ExitDeadline::start(&settings.name, code, EXIT_DEADLINE);
    exit.at("writing the status files and sending the last notifications");
    observer.outbox.settle(OUTBOX_PATIENCE);
    // The ledger's record of the last load, handed on behind the news.
    exit.at("writing the load ledger and the setups");
    backend.finish_records(OUTBOX_PATIENCE);
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
    prepare::clean_leftover_files(settings);
    exit.at("closing");
    drop(backend);
    let _ = std::fs::remove_file(&settings.server.socket);
    exit.at("ending the process");
    code
}
