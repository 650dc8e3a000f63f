//! The front door (`[front]`): the model's address, owned by the warden.
//! Clients connect here; requests are forwarded to the engine's private
//! address while it serves, and wait in a bounded queue while it does not
//! (a load, a restart, the golden check, a drain, an upgrade of the
//! warden, an idle engine being started again).
//!
//! What the rest of the daemon sees of it: the [`Gate`] it is told (the
//! observer derives it from the machine after every change) and the
//! [`Activity`] it reports (requests arriving and in flight, which the
//! loop reads to stop or wake an idle engine).
//!
//! Before an upgrade's exec the loop asks it to empty
//! ([`Activity::hand_over`]): it stops accepting, closes its connections
//! after their request (one accepted without a request yet after its
//! first: its request may be in the socket) and answers what it holds, and
//! the loop waits for its last connection, at most [`HANDOVER_PATIENCE`].
//!
//! It runs on a thread and runtime of its own ([`apart`]).
//!
//! Its parts: `front/proxy.rs` serves the listeners and forwards, holds
//! or answers each request; `front/hold.rs` is the queue of held
//! requests; `front/pace.rs` the pace a request body must keep;
//! `front/share.rs` the connections by client, and which makes room when
//! the door is full; `front/listen.rs` opens the listeners (bound, passed
//! by systemd, or kept across an upgrade).

pub(crate) mod hold;
pub(crate) mod pace;
pub(crate) mod proxy;
pub(crate) mod share;

pub(crate) use listen::Listener;
pub(crate) use proxy::Door;

pub(crate) mod listen;

use std::sync::Mutex;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use tokio::sync::watch;
use tokio::time::Instant;

/// Run the front door (`serve`, from [`proxy::serve`]) on a runtime of its
/// own, on a thread of its own: its forwarding never waits for a turn of
/// the supervising loop, nor the loop for it. What it shares with the loop
/// needs no runtime: the gate (a watch channel), the [`Activity`]
/// (atomics, a watch channel, a notify) and the metrics. A current-thread
/// runtime: the front door's work is a few socket hops and a parse per
/// request, and on the small machines measured a second worker only
/// contends with the clients and the engine for the same cores (see
/// `docs/benchmarks.md`). The returned future ends when that thread ends,
/// which it does only if the front door stopped: watched as every other
/// task of the warden. An upgrade's exec and the warden's exit end the
/// thread with the process.
pub(crate) fn apart(
    serve: impl std::future::Future<Output = ()> + Send + 'static,
) -> std::io::Result<impl std::future::Future<Output = ()> + Send + 'static> {
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build()?;
    let (ended, on_end) = tokio::sync::oneshot::channel::<()>();
    std::thread::Builder::new().name("front door".into()).spawn(move || {
        // Dropped when `serve` returns or panics: the loop hears of it.
        let _ended = ended;
        rt.block_on(serve);
    })?;
    Ok(async move {
        let _ = on_end.await;
    })
}

/// What the front door does with a request now.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub(crate) enum Gate {
    /// The engine serves: forward.
    Serving,
    /// The engine will serve, later: hold the request (up to `front.hold`),
    /// or answer 503 with `Retry-After` at once when `eta` says it will
    /// not serve in time. `why` is said in that answer ("model loading").
    Holding { why: String, eta: Option<Duration> },
    /// The engine was stopped (or put to sleep) for want of requests: a
    /// request wakes it ([`Activity::wanted`]) and is held up to
    /// `front.idle-hold`.
    Idle { eta: Option<Duration> },
    /// The warden is ending and will not serve again: answer 503.
    #[default]
    Closed,
}

/// The requests the front door has seen, as the loop reads them; and the
/// hand-over before an upgrade's exec, which the loop asks for and the
/// front door carries out.
#[derive(Debug)]
pub(crate) struct Activity {
    in_flight: AtomicUsize,
    last: Mutex<Instant>,
    woken: tokio::sync::Notify,
    /// `true` while an upgrade waits for the front door to empty: no
    /// connection is accepted (they wait in the kernel's backlog, for the
    /// successor), kept-alive ones are closed after their request.
    handover: watch::Sender<bool>,
    /// The client connections open now, and the listeners accepting.
    open: watch::Sender<Counts>,
}

/// What an upgrade's exec waits on: connections open (each in this
/// warden's hands), and accept loops that may take one (one that took a
/// connection counts it before it looks at the hand-over again).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
struct Counts {
    connections: usize,
    accepting: usize,
}

impl Default for Activity {
    fn default() -> Self {
        Activity {
            in_flight: AtomicUsize::new(0),
            last: Mutex::new(Instant::now()),
            woken: tokio::sync::Notify::new(),
            handover: watch::Sender::new(false),
            open: watch::Sender::new(Counts::default()),
        }
    }
}

/// How long an upgrade waits for the front door's connections to end
/// before its exec: the requests being forwarded are answered whole by
/// this warden (a streamed answer included), meanwhile new connections
/// wait in the kernel's backlog for the successor. A request still in
/// flight after this is cut by the exec (said in the log, counted). As
/// long as `front.hold`'s default: a client waits no longer in the
/// backlog than it would be held.
pub(crate) const HANDOVER_PATIENCE: Duration = Duration::from_secs(30);

/// How long the warden's exit waits for the front door's connections to
/// get their last answers (see `daemon::run`): they are answered at once
/// (the warden will not serve again); only a client still sending its
/// request takes longer.
pub(crate) const EXIT_PATIENCE: Duration = Duration::from_secs(5);

/// A client connection, counted while it is open.
#[derive(Debug)]
pub(crate) struct Open(std::sync::Arc<Activity>);

impl Drop for Open {
    fn drop(&mut self) {
        self.0.open.send_modify(|o| o.connections -= 1);
    }
}

/// A listener's accept loop, counted while it may accept a connection:
/// from its start, and again after each hand-over that did not happen.
#[derive(Debug)]
pub(crate) struct Accepting(std::sync::Arc<Activity>);

impl Drop for Accepting {
    fn drop(&mut self) {
        self.0.open.send_modify(|o| o.accepting -= 1);
    }
}

impl Activity {
    /// A request arrived (held or forwarded); `idle`: the gate was
    /// [`Gate::Idle`], so the loop is told to start the engine.
    pub(crate) fn begin(&self, idle: bool) {
        self.in_flight.fetch_add(1, Ordering::SeqCst);
        *self.last.lock().unwrap_or_else(|e| e.into_inner()) = Instant::now();
        if idle {
            self.woken.notify_one();
        }
    }

    /// A request ended (answered, refused, or its client went away).
    pub(crate) fn end(&self) {
        self.in_flight.fetch_sub(1, Ordering::SeqCst);
        *self.last.lock().unwrap_or_else(|e| e.into_inner()) = Instant::now();
    }

    /// How long no request has been in flight, as of `now`; `None` while
    /// one is.
    pub(crate) fn quiet_for(&self, now: Instant) -> Option<Duration> {
        if self.in_flight.load(Ordering::SeqCst) > 0 {
            return None;
        }
        Some(now.saturating_duration_since(*self.last.lock().unwrap_or_else(|e| e.into_inner())))
    }

    /// Resolves when a request arrives at an idle engine.
    pub(crate) async fn wanted(&self) {
        self.woken.notified().await;
    }

    /// Requests in the front door's hands now: held, or forwarded and
    /// their answer not yet all sent.
    pub(crate) fn in_hand(&self) -> usize {
        self.in_flight.load(Ordering::SeqCst)
    }

    /// A client connection opened; counted until the guard is dropped.
    pub(crate) fn opened(self: &std::sync::Arc<Self>) -> Open {
        self.open.send_modify(|o| o.connections += 1);
        Open(self.clone())
    }

    /// An accept loop may accept a connection until the guard is dropped
    /// (it parks for a hand-over, or ends).
    pub(crate) fn accepting(self: &std::sync::Arc<Self>) -> Accepting {
        self.open.send_modify(|o| o.accepting += 1);
        Accepting(self.clone())
    }

    /// Client connections open now.
    pub(crate) fn connections(&self) -> usize {
        self.open.borrow().connections
    }

    /// An upgrade is about to exec: take no new connection, close the
    /// kept-alive ones, refuse to hold (see [`HANDOVER_PATIENCE`]).
    pub(crate) fn hand_over(&self) {
        self.handover.send_replace(true);
    }

    /// The upgrade did not happen (it failed, or waits for the run): serve
    /// as before.
    pub(crate) fn resume(&self) {
        self.handover.send_replace(false);
    }

    /// The hand-over, as the front door watches it.
    pub(crate) fn handover(&self) -> watch::Receiver<bool> {
        self.handover.subscribe()
    }

    /// Resolves once no client connection is open (every request answered
    /// whole) and no listener accepts one any more, or at `deadline`; the
    /// connections still open then.
    pub(crate) async fn emptied(&self, deadline: Instant) -> usize {
        let mut open = self.open.subscribe();
        let _ = tokio::time::timeout_at(deadline, open.wait_for(|o| *o == Counts::default())).await;
        self.connections()
    }
}

/// The least margin [`idle_hold`] gives beyond the estimate.
pub(crate) const IDLE_HOLD_MARGIN: Duration = Duration::from_secs(30);

/// How long a request that wakes an idle engine may wait
/// (`front.idle-hold`): as set; else the estimate of the start or the wake
/// ([`Gate::Idle`]'s `eta`: the ledger's median load of the setup, the
/// last wake) and half of it again, at least [`IDLE_HOLD_MARGIN`] more (a
/// load is rarely exactly its median; past this it is not going well);
/// with no estimate (the setup never loaded on this host), the start's
/// own deadline, `ready.timeout`.
pub(crate) fn idle_hold(front: &crate::config::Front, eta: Option<Duration>, ready_timeout: Duration) -> Duration {
    match (front.idle_hold, eta) {
        (Some(set), _) => set,
        (None, Some(eta)) => eta.saturating_add((eta / 2).max(IDLE_HOLD_MARGIN)),
        (None, None) => ready_timeout,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_idle_request_is_held_for_the_estimate_and_a_margin_unless_told() {
        let text = "[child]\ncommand = [\"vllm\", \"serve\", \"/m\"]\n[front]\nlisten = \"127.0.0.1:8000\"\n";
        let s = crate::config::parse(text, std::path::Path::new("/k.toml"), &Default::default()).unwrap();
        let mut f = s.front.unwrap();
        let (m, h) = (Duration::from_secs(60), Duration::from_secs(3600));
        assert_eq!(idle_hold(&f, Some(Duration::from_secs(20)), h), Duration::from_secs(50));
        assert_eq!(idle_hold(&f, Some(Duration::from_secs(80)), h), Duration::from_secs(120));
        assert_eq!(idle_hold(&f, None, h), h);
        f.idle_hold = Some(m);
        assert_eq!(idle_hold(&f, Some(Duration::from_secs(600)), h), m);
    }

    /// An upgrade's exec waits for the accept loops to park as well as for
    /// the connections to end: a loop that took a connection counts it
    /// before it parks, so none is in the warden's hands uncounted.
    #[tokio::test(start_paused = true)]
    async fn the_front_door_is_empty_once_no_loop_accepts_and_no_connection_is_open() {
        let a = std::sync::Arc::new(Activity::default());
        let deadline = Instant::now() + Duration::from_secs(30);
        let accepting = a.accepting();
        let emptied = tokio::spawn({
            let a = a.clone();
            async move { (a.emptied(deadline).await, Instant::now()) }
        });
        tokio::time::sleep(Duration::from_secs(1)).await;
        assert!(!emptied.is_finished(), "a loop still accepts");
        // It took a connection, then parked.
        let open = a.opened();
        drop(accepting);
        tokio::time::sleep(Duration::from_secs(1)).await;
        assert!(!emptied.is_finished(), "a connection is open");
        drop(open);
        let (left, at) = emptied.await.unwrap();
        assert_eq!((left, at.duration_since(deadline - Duration::from_secs(30))), (0, Duration::from_secs(2)));
        // At the deadline, what is still open is counted.
        let _open = a.opened();
        assert_eq!(a.emptied(Instant::now() + Duration::from_secs(30)).await, 1);
    }
}
