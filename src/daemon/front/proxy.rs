//! The front door's serving: it accepts clients on the listeners, and for
//! each request either forwards it to the engine (hyper's pooled client,
//! over the engine's unix socket or loopback port), holds it while the
//! engine does not serve (see `hold.rs`), or answers it itself: 503 with
//! `Retry-After` when it cannot be held, 502 when the engine died under
//! it, 413 for a body over `front.max-body`, 404 for vLLM's development
//! routes, which are never forwarded.
//!
//! Forwarding streams both bodies, frame by frame (an SSE token stream
//! passes event by event), drops the hop-by-hop headers of RFC 9110
//! §7.6.1 both ways, and appends the client to `X-Forwarded-For` and
//! `Forwarded`. A client that goes away drops its request here, and with
//! it the upstream connection under way: vLLM sees the disconnect and
//! aborts the request. vLLM's own 500 while its engine is dead
//! ([`ENGINE_DEAD_MESSAGE`]) is no answer of the model: it is taken as the
//! engine's death under the request.
//!
//! A request whose body is known and small ([`RESEND_MAX`]) is read
//! before it is sent, so that it can be sent again: when the engine could
//! not be reached at all (it died a moment before the machine saw it), it
//! is held like any request that arrives while the engine restarts; with
//! `front.retry-unanswered`, also when the engine died after it was sent
//! and before a byte of the answer came. A larger body is streamed and
//! never sent twice.
//!
//! The same protections as the warden's endpoint: a request head must come
//! within [`HEADER_READ_TIMEOUT`] (also between two requests of a
//! kept-alive connection), a body at the pace of `pace.rs` (no pause of
//! 5 s, `front.min-body-rate` on average: else 408, the engine's request
//! aborted if it was under way), one `Host`, no `CONNECT`, at most
//! `front.max-connections` connections at once (never more than an eighth
//! of the descriptor limit), and the warden's own lack of a resource is
//! said as the warden's (503), never blamed on the engine. At the cap, a
//! new connection is taken and a kept-alive or slow one makes room for it
//! (`share.rs`), else it waits; one client past its share of the door
//! makes room from its own.

use std::future::Future;
use std::net::IpAddr;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::task::{Context, Poll};
use std::time::Duration;

use http_body_util::combinators::BoxBody;
use http_body_util::{BodyExt, Full, Limited};
use hyper::body::{Body, Bytes, Frame, Incoming};
use hyper::header::{self, HeaderMap, HeaderName, HeaderValue};
use hyper::{Request, Response, StatusCode, Uri};
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::{Connected, Connection};
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use tokio::sync::watch;

use super::hold::{self, Place, Refused, Release};
use super::pace::{self, Cut, Paced};
use super::share::{self, Peer};
use super::{Activity, Gate, Listener};
use crate::config::{Engine, Front, Listen};
use crate::tell::metrics::Metrics;

/// How long a client has to send a request's head, on a new connection
/// and between two requests on a kept-alive one (as uvicorn's keep-alive,
/// vLLM's own: clients' pools expect a few seconds at least).
pub(crate) const HEADER_READ_TIMEOUT: Duration = Duration::from_secs(5);

/// The largest request body kept to be sent again (a completion's body is
/// a few KiB): larger bodies are streamed to the engine, never resent.
pub(crate) const RESEND_MAX: u64 = 1 << 20;

/// The front door's connections take at most this share of the warden's
/// descriptor limit (`RLIMIT_NOFILE`), whatever `front.max-connections`
/// says: each also takes an upstream connection while it is forwarded.
pub(crate) const NOFILE_SHARE: u64 = 8;

/// The read buffer of one client connection: a request head larger than
/// this is answered 431 (the body is streamed, not buffered).
pub(crate) const MAX_BUF: usize = 64 << 10;

/// The most headers a request may have; more is answered 431.
pub(crate) const MAX_HEADERS: usize = 100;

/// How long a request keeps trying to connect to an engine that the gate
/// says serves but that takes no connection now (its accept queue full:
/// uvicorn's is capped by `net.core.somaxconn`, 128 on kernels before
/// 5.4, and a release of every held request at ready comes at once).
/// Past it, or when the gate stops serving, the request waits for the
/// gate as any other.
pub(crate) const CONNECT_PATIENCE: Duration = Duration::from_secs(10);

/// The first pause before a connect is tried again; doubled up to
/// [`CONNECT_PAUSE_MAX`], each drawn between half and all of it, so that a
/// burst refused together does not come back together.
const CONNECT_PAUSE: Duration = Duration::from_millis(10);
const CONNECT_PAUSE_MAX: Duration = Duration::from_millis(500);

/// Idle upstream connections kept for reuse.
const POOL_IDLE: usize = 64;
const POOL_IDLE_TIMEOUT: Duration = Duration::from_secs(30);

/// vLLM's development routes (`VLLM_SERVER_DEV_MODE=1`, which the warden
/// sets for sleep mode): RPC into the workers, cache resets, server
/// internals, sleep and wake. vLLM itself warns they must never be
/// exposed; the front door answers 404 for them and everything under them.
pub(crate) const DEV_ROUTES: &[&str] = &[
    "/sleep",
    "/wake_up",
    "/is_sleeping",
    "/collective_rpc",
    "/reset_prefix_cache",
    "/reset_mm_cache",
    "/reset_encoder_cache",
    "/server_info",
    "/release_kv_cache_memory",
    "/pause",
    "/resume",
    "/is_paused",
    "/update_weights",
    "/init_weight_transfer_engine",
    "/get_world_size",
    "/scale_elastic_ep",
    "/is_scaling_elastic_ep",
];

type BoxError = Box<dyn std::error::Error + Send + Sync>;
type UpBody = BoxBody<Bytes, BoxError>;

/// What the front door has now, for the status document.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub(crate) struct Now {
    pub(crate) held: usize,
    pub(crate) in_flight: usize,
}

/// Everything the connections share.
pub(crate) struct Door {
    front: Front,
    /// `ready.timeout`: how long a request that starts an idle engine with
    /// no estimate may wait (see [`super::idle_hold`]).
    ready_timeout: Duration,
    base: String,
    gate: watch::Receiver<Gate>,
    queue: hold::Queue,
    activity: Arc<Activity>,
    metrics: Arc<Metrics>,
    client: Client<Connector, UpBody>,
    in_flight: AtomicUsize,
    /// The connections by client.
    table: Arc<share::Table>,
    /// When the log last said that the door is full, that a client holds
    /// its share, that a body was cut for its pace.
    said_full: Throttle,
    said_share: Throttle,
    said_slow: Throttle,
    /// The engine refuses connections now (see [`Door::refused`]).
    refusing: std::sync::atomic::AtomicBool,
    refusals: std::sync::Mutex<Refusals>,
}

/// Connects the engine refused, as the log says them: once when a burst
/// begins (at most once a [`WARN_EVERY`]), and once when it ends.
#[derive(Debug, Default)]
struct Refusals {
    said: Option<tokio::time::Instant>,
    /// Tries refused since the burst began.
    tries: u64,
}

/// How often the log says at most that the engine refuses connections,
/// and each of the door's warnings of a flood of slow clients.
const WARN_EVERY: Duration = Duration::from_secs(60);

/// A warning said at most once per [`WARN_EVERY`].
#[derive(Debug, Default)]
struct Throttle(std::sync::Mutex<Option<tokio::time::Instant>>);

impl Throttle {
    fn due(&self) -> bool {
        let mut at = self.0.lock().unwrap_or_else(|p| p.into_inner());
        let now = tokio::time::Instant::now();
        let due = at.is_none_or(|a| now >= a + WARN_EVERY);
        if due {
            *at = Some(now);
        }
        due
    }
}

impl std::fmt::Debug for Door {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Door").field("base", &self.base).finish_non_exhaustive()
    }
}

impl Door {
    pub(crate) fn new(
        front: &Front,
        ready_timeout: Duration,
        engine: &Engine,
        gate: watch::Receiver<Gate>,
        activity: Arc<Activity>,
        metrics: Arc<Metrics>,
    ) -> Arc<Door> {
        let gauge = metrics.clone();
        let client = Client::builder(TokioExecutor::new())
            .pool_max_idle_per_host(POOL_IDLE)
            .pool_idle_timeout(POOL_IDLE_TIMEOUT)
            .pool_timer(TokioTimer::new())
            .build(Connector(Arc::new(engine.clone())));
        Arc::new(Door {
            queue: hold::Queue::new(front.max_held as usize, move |n| gauge.front.set_held(n)),
            front: front.clone(),
            ready_timeout,
            base: crate::config::engine_base(engine),
            gate,
            activity,
            metrics,
            client,
            in_flight: AtomicUsize::new(0),
            table: Arc::default(),
            said_full: Throttle::default(),
            said_share: Throttle::default(),
            said_slow: Throttle::default(),
            refusing: std::sync::atomic::AtomicBool::new(false),
            refusals: std::sync::Mutex::default(),
        })
    }

    /// Requests held and forwarded now.
    pub(crate) fn now(&self) -> Now {
        Now { held: self.queue.len(), in_flight: self.in_flight.load(Ordering::Relaxed) }
    }

    /// The engine refused a connect (`why`) that is tried again: said when
    /// a burst of them begins, not for each request.
    fn refused(&self, why: &dyn std::fmt::Display) {
        let mut r = self.refusals.lock().unwrap_or_else(|p| p.into_inner());
        r.tries += 1;
        if self.refusing.swap(true, Ordering::Relaxed) {
            return;
        }
        let now = tokio::time::Instant::now();
        if r.said.is_none_or(|s| now >= s + WARN_EVERY) {
            r.said = Some(now);
            tracing::warn!(
                EVENT = "front",
                error = %why,
                "the engine takes no connection now (its accept queue may be full): \
                 each request tries again for up to {}",
                shown(CONNECT_PATIENCE)
            );
        }
    }

    /// A body was cut for its pace (said at most once a minute).
    fn said_too_slow(&self, peer: Peer, cut: Cut, what: &str) {
        if self.said_slow.due() {
            tracing::warn!(EVENT = "front", "a request body from {peer} came too slowly ({cut}): answered 408, {what}");
        }
    }

    /// A connection to the engine was made: a burst of refusals is over.
    fn connected(&self) {
        if !self.refusing.load(Ordering::Relaxed) || !self.refusing.swap(false, Ordering::Relaxed) {
            return;
        }
        let mut r = self.refusals.lock().unwrap_or_else(|p| p.into_inner());
        let tries = std::mem::take(&mut r.tries);
        tracing::info!(EVENT = "front", "the engine takes connections again ({tries} connects were tried again)");
    }
}

/// Serve `listeners` until aborted; every listener's connections count
/// against one cap.
pub(crate) async fn serve(door: Arc<Door>, listeners: Vec<(Listen, Listener)>) {
    let cap = connection_cap(door.front.max_connections, crate::daemon::server::nofile_limit());
    let permits = Arc::new(tokio::sync::Semaphore::new(cap));
    let mut tasks = tokio::task::JoinSet::new();
    tasks.spawn(release(door.clone()));
    let per_peer = (cap / share::PEER_SHARE).max(1);
    for (listen, l) in listeners {
        let (door, permits) = (door.clone(), permits.clone());
        match l {
            Listener::Tcp(l) => match tokio::net::TcpListener::from_std(l) {
                Ok(l) => {
                    tasks.spawn(accept(l, listen, door, permits, Share { cap, per_peer }));
                }
                Err(e) => tracing::error!(EVENT = "front", error = %e, "cannot serve {}", listen.shown()),
            },
            Listener::Unix(l) => match tokio::net::UnixListener::from_std(l) {
                Ok(l) => {
                    tasks.spawn(accept(l, listen, door, permits, Share { cap, per_peer }));
                }
                Err(e) => tracing::error!(EVENT = "front", error = %e, "cannot serve {}", listen.shown()),
            },
        }
    }
    tracing::debug!(connections = cap, per_peer, "the front door serves");
    while tasks.join_next().await.is_some() {}
}

/// `max-connections`, or an eighth of the descriptor limit `nofile` when
/// that is lower; at least one.
pub(crate) fn connection_cap(max: u32, nofile: u64) -> usize {
    let share = usize::try_from(nofile / NOFILE_SHARE).unwrap_or(usize::MAX);
    (max as usize).min(share).max(1)
}

/// Release the held requests whenever the gate opens (or closes), and
/// answer them when an upgrade's exec is near.
async fn release(door: Arc<Door>) {
    let mut gate = door.gate.clone();
    let mut handover = door.activity.handover();
    loop {
        let n = door.queue.gate_changed(&gate);
        if n > 0 {
            tracing::info!(EVENT = "front", "{n} held requests released");
        }
        tokio::select! {
            changed = gate.changed() => if changed.is_err() {
                // The observer is gone: the warden is ending.
                std::future::pending::<()>().await;
            },
            Ok(()) = handover.changed() => {
                let on = *handover.borrow_and_update();
                // A gate that closed at the same time (the warden's exit)
                // answers its own way first.
                door.queue.gate_changed(&gate);
                let n = door.queue.hand_over(on);
                if n > 0 {
                    tracing::info!(EVENT = "front", "{n} held requests answered 503: the warden is being upgraded");
                }
            }
        }
    }
}

/// How many connections the door serves, and one client holds while
/// others may need them.
#[derive(Debug, Clone, Copy)]
struct Share {
    cap: usize,
    per_peer: usize,
}

/// A listener of the front door: TCP or a unix socket.
trait Accept: Send + 'static {
    type Io: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin + Send + 'static;
    /// A connection, and who opened it.
    fn accept(&self) -> impl Future<Output = std::io::Result<(Self::Io, Peer)>> + Send;
}

impl Accept for tokio::net::TcpListener {
    type Io = tokio::net::TcpStream;
    async fn accept(&self) -> std::io::Result<(Self::Io, Peer)> {
        let (s, addr) = tokio::net::TcpListener::accept(self).await?;
        let _ = s.set_nodelay(true);
        Ok((s, Peer::Ip(addr.ip().to_canonical())))
    }
}

impl Accept for tokio::net::UnixListener {
    type Io = tokio::net::UnixStream;
    async fn accept(&self) -> std::io::Result<(Self::Io, Peer)> {
        let s = tokio::net::UnixListener::accept(self).await?.0;
        let peer = s.peer_cred().map_or(Peer::Unknown, |c| Peer::Uid(c.uid()));
        Ok((s, peer))
    }
}

/// Resolves once the hand-over before an upgrade is `on` (`true`), or
/// off; `false` when it can never be (the warden is ending).
async fn handing_over(handover: &mut watch::Receiver<bool>, on: bool) -> bool {
    // The watch's guard is let go at once: never held across a wait.
    handover.wait_for(|h| *h == on).await.is_ok()
}

/// The first pause after a failed accept for want of a resource; doubled
/// up to a second.
const ACCEPT_PAUSE: Duration = Duration::from_millis(50);

async fn accept<L: Accept>(
    listener: L,
    listen: Listen,
    door: Arc<Door>,
    permits: Arc<tokio::sync::Semaphore>,
    share: Share,
) {
    let Share { cap, per_peer } = share;
    let mut pause = ACCEPT_PAUSE;
    let mut warned: Option<tokio::time::Instant> = None;
    let mut handover = door.activity.handover();
    let mut accepting = Some(door.activity.accepting());
    loop {
        // An upgrade's exec is near: new connections wait in the kernel's
        // queue for the successor (the socket is handed over, never
        // closed); accepted again if the upgrade does not happen. Every
        // connection this loop took is counted open by now: the exec
        // waits for this loop to park here, then for them.
        if *handover.borrow() {
            accepting = None;
            handing_over(&mut handover, false).await;
            continue;
        }
        if accepting.is_none() {
            accepting = Some(door.activity.accepting());
        }
        let accepted = tokio::select! {
            biased;
            true = handing_over(&mut handover, true) => continue,
            a = listener.accept() => a,
        };
        let (io, peer) = match accepted {
            Ok(a) => {
                pause = ACCEPT_PAUSE;
                a
            }
            Err(e) => {
                if let Some(why) = crate::util::errno::own_shortage(&e) {
                    let now = tokio::time::Instant::now();
                    if warned.is_none_or(|w| now >= w + Duration::from_secs(60)) {
                        warned = Some(now);
                        tracing::warn!(EVENT = "front", error = %e, "the front door at {} cannot accept a connection: {why}", listen.shown());
                    }
                    tokio::time::sleep(pause).await;
                    pause = (pause * 2).min(Duration::from_secs(1));
                } else {
                    tracing::debug!(error = %e, "the front door could not accept a connection");
                }
                continue;
            }
        };
        // Counted open here, not in its task: an upgrade that finds the
        // front door empty between this accept and the task's first turn
        // would exec with the connection in its hands, and the kernel
        // would answer its client's request with a reset.
        let open = door.activity.opened();
        // At the cap, the connection is taken all the same (one
        // descriptor past the cap) and a kept-alive or slow one makes room
        // for it; with none that may, it waits for the first to end, and
        // the others wait in the kernel's queue.
        let Some(permit) = door.permit(&permits, cap).await else { return };
        let (slot, made) = door.table.admit(peer, per_peer, door.front.min_body_rate);
        if made.is_some() && door.said_share.due() {
            tracing::warn!(
                EVENT = "front",
                "the front door serves {per_peer} connections from {peer}, the most one client holds while \
                 others may need them: its kept-alive or slow ones make room for its new ones"
            );
        }
        let door = door.clone();
        tokio::spawn(async move {
            connection(io, peer, slot, door).await;
            drop(open);
            drop(permit);
        });
    }
}

impl Door {
    /// A place for a connection just accepted: a free one, or one made
    /// for it (see `share.rs`), or the first to end. `None` when the door
    /// no longer serves.
    async fn permit(
        &self,
        permits: &Arc<tokio::sync::Semaphore>,
        cap: usize,
    ) -> Option<tokio::sync::OwnedSemaphorePermit> {
        use tokio::sync::TryAcquireError;
        match permits.clone().try_acquire_owned() {
            Ok(p) => return Some(p),
            Err(TryAcquireError::Closed) => return None,
            Err(TryAcquireError::NoPermits) => {}
        }
        loop {
            let made = self.table.make_room(self.front.min_body_rate);
            if self.said_full.due() {
                let how = match made {
                    Ok((peer, share::Made::Idle)) => format!("a kept-alive connection of {peer} is closed"),
                    Ok((peer, share::Made::Slow(rate))) => {
                        format!("a body of {peer} coming at {rate} bytes a second is cut (408)")
                    }
                    Err(_) => "none is idle or slow: it waits for the first to end".to_string(),
                };
                tracing::warn!(
                    EVENT = "front",
                    "the front door serves {cap} connections, its most (front.max-connections), and another came: {how}",
                );
            }
            // A body is judged slow after its first second, and a body
            // judged may fall under the floor later: looked at again then,
            // or a second on, while the door stays full.
            let now = tokio::time::Instant::now();
            let again = match made {
                Err(Some(judged)) => judged.min(now + share::JUDGED_AFTER),
                _ => now + share::JUDGED_AFTER,
            };
            tokio::select! {
                p = permits.clone().acquire_owned() => return p.ok(),
                _ = tokio::time::sleep_until(again) => {}
            }
        }
    }
}

/// Serve one client connection in its `slot` until it ends, or until it
/// is asked to make room (at once between two requests; a slow body is
/// cut, see `pace.rs`).
async fn connection<I>(io: I, peer: Peer, slot: share::Slot, door: Arc<Door>)
where
    I: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin + Send + 'static,
{
    let mut handover = door.activity.handover();
    let mut cut = std::pin::pin!(slot.conn.cut());
    // Whether a request has begun on the connection: one just accepted
    // may have its request on the way (or in the socket unread).
    let (begun_tx, mut begun) = watch::channel(false);
    let begun_tx = Arc::new(begun_tx);
    let conn = slot.conn.clone();
    let service = hyper::service::service_fn(move |req| {
        let door = door.clone();
        let conn = conn.clone();
        begun_tx.send_replace(true);
        conn.asked();
        async move { Ok::<_, std::convert::Infallible>(handle(door, peer, conn, req).await) }
    });
    let conn = hyper::server::conn::http1::Builder::new()
        .timer(TokioTimer::new())
        .header_read_timeout(HEADER_READ_TIMEOUT)
        .max_buf_size(MAX_BUF)
        .max_headers(MAX_HEADERS)
        .serve_connection(TokioIo::new(io), service);
    let mut conn = std::pin::pin!(conn);
    let ended = tokio::select! {
        ended = conn.as_mut() => ended,
        () = &mut cut => {
            // Asked to make room: closed now between two requests, else
            // after the answer under way (a slow body's 408).
            conn.as_mut().graceful_shutdown();
            conn.await
        }
        true = handing_over(&mut handover, true) => {
            // An upgrade's exec is near: the request under way (if any)
            // is answered whole, then the connection is closed (a client
            // that kept it alive opens its next one on the successor); an
            // idle one is closed now. A connection accepted that has not
            // begun its first request is not idle: its client sent, or is
            // sending, a request that closing would answer with a reset.
            // It is served its first request (or ended by the header-read
            // timeout), then closed.
            let early = if *begun.borrow() {
                None
            } else {
                tokio::select! {
                    ended = conn.as_mut() => Some(ended),
                    _ = begun.wait_for(|b| *b) => None,
                }
            };
            match early {
                Some(ended) => ended,
                None => {
                    conn.as_mut().graceful_shutdown();
                    conn.await
                }
            }
        }
    };
    if let Err(e) = ended {
        tracing::debug!(error = %e, "front door connection ended");
    }
}

/// The outcomes counted in `vllm_warden_front_requests_total`.
pub(crate) mod outcome {
    pub(crate) const FORWARDED: &str = "forwarded";
    pub(crate) const HELD: &str = "held";
    pub(crate) const REJECTED: &str = "rejected";
    pub(crate) const UPSTREAM_ERROR: &str = "upstream_error";
    pub(crate) const RETRIED: &str = "retried";
}

/// A request in the front door's hands: told to the activity (for idle
/// stop) while it lives, which is until its answer's body is done; then
/// its connection is between two requests.
struct InHand {
    door: Arc<Door>,
    conn: Arc<share::Conn>,
}

impl Drop for InHand {
    fn drop(&mut self) {
        self.door.activity.end();
        self.conn.answered();
    }
}

/// A request being forwarded (the in-flight gauge), until its answer is
/// done or dropped.
struct Forwarding {
    door: Arc<Door>,
}

impl Forwarding {
    fn new(door: &Arc<Door>) -> Forwarding {
        let n = door.in_flight.fetch_add(1, Ordering::Relaxed) + 1;
        door.metrics.front.set_in_flight(n);
        Forwarding { door: door.clone() }
    }
}

impl Drop for Forwarding {
    fn drop(&mut self) {
        let n = self.door.in_flight.fetch_sub(1, Ordering::Relaxed) - 1;
        self.door.metrics.front.set_in_flight(n);
    }
}

/// A body that keeps what it carries alive until it is done or dropped.
struct Kept<B, T> {
    body: B,
    _kept: T,
}

impl<B: Body + Unpin, T: Unpin> Body for Kept<B, T> {
    type Data = B::Data;
    type Error = B::Error;
    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Self::Data>, Self::Error>>> {
        Pin::new(&mut self.body).poll_frame(cx)
    }
    fn is_end_stream(&self) -> bool {
        self.body.is_end_stream()
    }
    fn size_hint(&self) -> hyper::body::SizeHint {
        self.body.size_hint()
    }
}

/// What a stream whose engine went away in its middle ends with, as vLLM
/// ends one whose generation failed (an error event, then `[DONE]`): the
/// client reads why, in the shape it reads tokens in, where a torn
/// connection says nothing.
pub(crate) const STREAM_CUT_EVENT: &str = concat!(
    r#"data: {"error": {"message": "the model's engine stopped in the middle of this answer", "#,
    r#""type": "upstream_error", "param": null, "code": 502}}"#,
    "\n\ndata: [DONE]\n\n"
);

fn is_event_stream(h: &HeaderMap) -> bool {
    h.get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|v| v.trim_start().to_ascii_lowercase().starts_with("text/event-stream"))
}

/// A server-sent event stream from the engine: when the engine goes away
/// between two events, the stream ends with [`STREAM_CUT_EVENT`] instead
/// of a torn transfer. Torn inside an event, it stays torn: an error glued
/// to half an event would be read as that event.
struct EventsEnd {
    body: UpBody,
    /// The last bytes passed on end an event (or nothing was passed).
    at_boundary: bool,
    ended: bool,
}

impl EventsEnd {
    fn new(body: UpBody) -> EventsEnd {
        EventsEnd { body, at_boundary: true, ended: false }
    }
}

impl Body for EventsEnd {
    type Data = Bytes;
    type Error = BoxError;
    fn poll_frame(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        if self.ended {
            return Poll::Ready(None);
        }
        match std::task::ready!(Pin::new(&mut self.body).poll_frame(cx)) {
            Some(Ok(frame)) => {
                if let Some(d) = frame.data_ref()
                    && !d.is_empty()
                {
                    self.at_boundary = d.ends_with(b"\n\n") || d.ends_with(b"\r\n\r\n");
                }
                Poll::Ready(Some(Ok(frame)))
            }
            Some(Err(e)) if self.at_boundary => {
                tracing::debug!(error = %e, "the engine went away in the middle of a stream: ended with an error event");
                self.ended = true;
                Poll::Ready(Some(Ok(Frame::data(Bytes::from_static(STREAM_CUT_EVENT.as_bytes())))))
            }
            other => Poll::Ready(other),
        }
    }
    fn is_end_stream(&self) -> bool {
        self.ended || self.body.is_end_stream()
    }
}

/// The request's body, as it is sent.
enum Payload {
    /// Read whole: it may be sent again.
    Kept(Bytes),
    /// Streamed: it is sent once.
    Streamed(Option<UpBody>),
}

impl Payload {
    fn take(&mut self) -> Option<UpBody> {
        match self {
            Payload::Kept(b) => Some(Full::new(b.clone()).map_err(|e| match e {}).boxed()),
            Payload::Streamed(s) => s.take(),
        }
    }
}

fn limit(n: u64) -> usize {
    usize::try_from(n).unwrap_or(usize::MAX)
}

/// Read a body up to [`RESEND_MAX`] at its pace (`pace.rs`): whole
/// (kept, to be sent again if need be), or, past the bound, what was read
/// followed by the rest as it comes. Or the answer: 413 past `max`, 400
/// for a body that breaks off (a chunked body that is not one), 408 for
/// one that does not come, or too slowly (and why).
async fn read_body(mut body: Paced, max: u64) -> Result<Payload, (Response<UpBody>, Option<Cut>)> {
    let mut read = Vec::new();
    loop {
        let frame = match body.frame().await {
            None => return Ok(Payload::Kept(Bytes::from(read))),
            Some(Err(e)) => {
                if let Some(cut) = pace::cut_of(&*e) {
                    return Err((too_slow(cut), Some(cut)));
                }
                tracing::debug!(error = %e, "the front door could not read a request's body");
                let whole = "the body is not whole".into();
                return Err((error(StatusCode::BAD_REQUEST, "invalid_request_error", whole, None), None));
            }
            Some(Ok(frame)) => frame,
        };
        // Trailers are dropped (vLLM reads none).
        let Ok(data) = frame.into_data() else { continue };
        read.extend_from_slice(&data);
        if read.len() as u64 > max {
            return Err((too_large(max), None));
        }
        if read.len() as u64 > RESEND_MAX {
            let rest = Limited::new(body, limit(max - read.len() as u64));
            return Ok(Payload::Streamed(Some(Prefixed { read: Some(Bytes::from(read)), rest }.boxed())));
        }
    }
}

/// The answer to a body cut for its pace: 408, and the connection closed
/// (the rest of the body is never read).
fn too_slow(cut: Cut) -> Response<UpBody> {
    let mut res = error(StatusCode::REQUEST_TIMEOUT, "invalid_request_error", cut.to_string(), None);
    res.headers_mut().insert(header::CONNECTION, HeaderValue::from_static("close"));
    res
}

/// A body begun: what was read of it, then the rest.
struct Prefixed {
    read: Option<Bytes>,
    rest: Limited<Paced>,
}

impl Body for Prefixed {
    type Data = Bytes;
    type Error = BoxError;
    fn poll_frame(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        if let Some(read) = self.read.take() {
            return Poll::Ready(Some(Ok(Frame::data(read))));
        }
        Pin::new(&mut self.rest).poll_frame(cx)
    }
}

async fn handle(door: Arc<Door>, peer: Peer, conn: Arc<share::Conn>, req: Request<Incoming>) -> Response<UpBody> {
    let idle = matches!(*door.gate.borrow(), Gate::Idle { .. });
    door.activity.begin(idle);
    let in_hand = InHand { door: door.clone(), conn: conn.clone() };
    let answer = forward(&door, peer, conn, req).await;
    answer.map(|body| Kept { body, _kept: in_hand }.boxed())
}

async fn forward(door: &Arc<Door>, peer: Peer, conn: Arc<share::Conn>, req: Request<Incoming>) -> Response<UpBody> {
    let (mut parts, body) = req.into_parts();
    let body = Paced::new(body, door.front.min_body_rate, conn);
    if parts.method == hyper::Method::CONNECT {
        // A tunnel is no request of the API (and vLLM has no use for one).
        door.metrics.front.count(outcome::REJECTED);
        let mut res =
            error(StatusCode::METHOD_NOT_ALLOWED, "invalid_request_error", "CONNECT is not served here".into(), None);
        res.headers_mut()
            .insert(header::ALLOW, HeaderValue::from_static("GET, HEAD, POST, PUT, PATCH, DELETE, OPTIONS"));
        res.headers_mut().insert(header::CONNECTION, HeaderValue::from_static("close"));
        return res;
    }
    if parts.headers.get_all(header::HOST).iter().count() > 1 {
        // RFC 9112 §3.2: a request with more than one Host is answered 400
        // (the engine and the front door could each read another).
        door.metrics.front.count(outcome::REJECTED);
        return error(StatusCode::BAD_REQUEST, "invalid_request_error", "more than one Host header".into(), None);
    }
    if is_dev_route(parts.uri.path()) {
        door.metrics.front.count(outcome::REJECTED);
        return error(StatusCode::NOT_FOUND, "not_found", format!("{} is not served here", parts.uri.path()), None);
    }
    if parts.headers.contains_key(header::TRANSFER_ENCODING) && parts.headers.contains_key(header::CONTENT_LENGTH) {
        // RFC 9112 §6.3: a sign of request smuggling. Refused, and the
        // connection closed (its next bytes cannot be trusted).
        door.metrics.front.count(outcome::REJECTED);
        let mut res = error(
            StatusCode::BAD_REQUEST,
            "invalid_request_error",
            "both Content-Length and Transfer-Encoding".into(),
            None,
        );
        res.headers_mut().insert(header::CONNECTION, HeaderValue::from_static("close"));
        return res;
    }
    let max = door.front.max_body;
    let length = content_length(&parts.headers);
    if let Some(Err(())) = length {
        door.metrics.front.count(outcome::REJECTED);
        return error(StatusCode::BAD_REQUEST, "invalid_request_error", "invalid Content-Length".into(), None);
    }
    let length = length.and_then(Result::ok);
    if length.is_some_and(|n| n > max) {
        door.metrics.front.count(outcome::REJECTED);
        return too_large(max);
    }
    let mut payload = match length {
        // Too long to keep: streamed as it comes, never sent twice.
        Some(n) if n > RESEND_MAX => Payload::Streamed(Some(Limited::new(body, limit(max)).boxed())),
        // A length under the bound, or none (chunked): read first, up to
        // the bound, so that it can be sent again and that a body that
        // breaks off never reaches the engine.
        _ => match read_body(body, max).await {
            Ok(p) => p,
            Err((answer, cut)) => {
                door.metrics.front.count(outcome::REJECTED);
                if let Some(cut) = cut {
                    door.said_too_slow(peer, cut, "nothing was sent to the engine");
                }
                return answer;
            }
        },
    };
    strip_hop_by_hop(&mut parts.headers);
    let addr = match peer {
        Peer::Ip(ip) => Some(ip),
        Peer::Uid(_) | Peer::Unknown => None,
    };
    add_forwarded(&mut parts.headers, addr);
    let path = parts.uri.path_and_query().map_or("/", |p| p.as_str());
    let uri: Uri = match format!("{}{path}", door.base).parse() {
        Ok(u) => u,
        Err(_) => {
            door.metrics.front.count(outcome::REJECTED);
            return error(StatusCode::BAD_REQUEST, "invalid_request_error", "invalid request target".into(), None);
        }
    };
    parts.uri = uri;
    // Whether it was held already (counted once), and sent once more.
    let (mut held, mut retried) = (false, false);
    // While an engine that serves refuses its connect: until when it is
    // tried again, and the next pause.
    let (mut connect_until, mut pause) = (None, CONNECT_PAUSE);
    let mut gate = door.gate.clone();
    loop {
        if let Some(answer) = wait_turn(door, &gate, door.front.hold, &mut held).await {
            return answer;
        }
        let Some(body) = payload.take() else {
            // A streamed body cannot be sent twice.
            door.metrics.front.count(outcome::UPSTREAM_ERROR);
            return error(
                StatusCode::BAD_GATEWAY,
                "upstream_error",
                "the model's engine stopped answering".into(),
                None,
            );
        };
        gate.borrow_and_update();
        let mut up = Request::new(body);
        *up.method_mut() = parts.method.clone();
        *up.uri_mut() = parts.uri.clone();
        *up.headers_mut() = parts.headers.clone();
        let forwarding = Forwarding::new(door);
        match door.client.request(up).await {
            Ok(res) => {
                door.connected();
                let res = match engine_dead(res).await {
                    Ok(res) => res,
                    Err(()) => {
                        // vLLM's own answer in the moment its engine died,
                        // before the warden saw the death: no answer of the
                        // model, so the engine's death for this request.
                        drop(forwarding);
                        tracing::debug!("the engine answered that it is dead");
                        if door.front.retry_unanswered && matches!(payload, Payload::Kept(_)) && !retried {
                            retried = true;
                            door.metrics.front.count(outcome::RETRIED);
                            if let Some(answer) = wait_change(door, &mut gate, &mut held).await {
                                return answer;
                            }
                            continue;
                        }
                        door.metrics.front.count(outcome::UPSTREAM_ERROR);
                        return error(
                            StatusCode::BAD_GATEWAY,
                            "upstream_error",
                            "the model's engine stopped before it answered".into(),
                            None,
                        );
                    }
                };
                door.metrics.front.count(outcome::FORWARDED);
                let (mut rparts, rbody) = res.into_parts();
                strip_hop_by_hop(&mut rparts.headers);
                let rbody = if is_event_stream(&rparts.headers) { EventsEnd::new(rbody).boxed() } else { rbody };
                let body = Kept { body: rbody, _kept: forwarding };
                return Response::from_parts(rparts, body.boxed());
            }
            Err(e) => {
                drop(forwarding);
                if let Some(why) = own_shortage(&e) {
                    tracing::warn!(EVENT = "front", error = %e, "the front door cannot reach the engine: {why}");
                    door.metrics.front.count(outcome::REJECTED);
                    return unavailable(why.to_string(), Some(Duration::from_secs(1)));
                }
                if is_too_large(&e) {
                    door.metrics.front.count(outcome::REJECTED);
                    return too_large(max);
                }
                if let Some(cut) = pace::cut_of(&e) {
                    // Cut while it was streamed: the engine's request is
                    // aborted with its connection (vLLM sees the
                    // disconnect), and no answer of it came.
                    door.metrics.front.count(outcome::REJECTED);
                    door.said_too_slow(peer, cut, "its request to the engine was aborted");
                    return too_slow(cut);
                }
                if is_clients_body(&e) {
                    // The client's body broke off while it was streamed:
                    // the client's fault, not the engine's.
                    door.metrics.front.count(outcome::REJECTED);
                    return error(
                        StatusCode::BAD_REQUEST,
                        "invalid_request_error",
                        "the body is not whole".into(),
                        None,
                    );
                }
                let resendable = matches!(payload, Payload::Kept(_));
                let now = tokio::time::Instant::now();
                if e.is_connect()
                    && resendable
                    && matches!(*gate.borrow(), Gate::Serving)
                    && now < *connect_until.get_or_insert(now + CONNECT_PATIENCE)
                {
                    // An engine that serves, whose accept queue is full (a
                    // release of every held request at once): tried again
                    // after a pause, under a deadline of its own. A gate that
                    // stops serving meanwhile holds it in the queue.
                    door.refused(&io_error(&e).map_or_else(|| e.to_string(), |io| io.to_string()));
                    let drawn = pause.mul_f64(0.5 + fastrand::f64() / 2.0);
                    pause = (pause * 2).min(CONNECT_PAUSE_MAX);
                    tokio::time::sleep(drawn).await;
                    continue;
                }
                if e.is_connect() && resendable {
                    // Never reached the engine: it is not serving, whatever
                    // the gate said a moment ago. Held until the machine
                    // has seen it and it serves again.
                    tracing::debug!(error = %e, "the engine could not be reached: the request is held");
                    if let Some(answer) = wait_change(door, &mut gate, &mut held).await {
                        return answer;
                    }
                    continue;
                }
                if e.is_connect() {
                    door.metrics.front.count(outcome::REJECTED);
                    return unavailable("the model's engine is not reachable".into(), Some(Duration::from_secs(1)));
                }
                if door.front.retry_unanswered && resendable && !retried {
                    tracing::debug!(error = %e, "the engine went away unanswered: the request is held to be sent again");
                    retried = true;
                    door.metrics.front.count(outcome::RETRIED);
                    if let Some(answer) = wait_change(door, &mut gate, &mut held).await {
                        return answer;
                    }
                    continue;
                }
                tracing::debug!(error = %e, "the engine went away under a request");
                door.metrics.front.count(outcome::UPSTREAM_ERROR);
                return error(
                    StatusCode::BAD_GATEWAY,
                    "upstream_error",
                    "the model's engine stopped before it answered".into(),
                    None,
                );
            }
        }
    }
}

/// What vLLM 0.32 answers a request while its engine is dead (the
/// EngineCore died; its API server has not yet shut down): 500 and this
/// message, as `create_error_response(EngineDeadError)` makes it.
pub(crate) const ENGINE_DEAD_MESSAGE: &str =
    "EngineCore encountered an issue. See stack trace (above) for the root cause.";

/// The longest body [`engine_dead`] reads: vLLM's is 150 bytes.
const ENGINE_DEAD_MAX: u64 = 1024;

/// The engine's answer, unless it is vLLM's own answer that its engine is
/// dead (`Err`): status 500, a JSON body of at most [`ENGINE_DEAD_MAX`]
/// bytes whose error is [`ENGINE_DEAD_MESSAGE`] of type
/// `InternalServerError`. Only such a 500 is read before it is passed on.
async fn engine_dead(res: Response<Incoming>) -> Result<Response<UpBody>, ()> {
    let small = content_length(res.headers()).and_then(Result::ok).is_some_and(|n| n <= ENGINE_DEAD_MAX);
    if res.status() != StatusCode::INTERNAL_SERVER_ERROR || !small {
        return Ok(res.map(|b| b.map_err(BoxError::from).boxed()));
    }
    let (parts, body) = res.into_parts();
    // A body that does not come whole (within the time a local answer of
    // a few bytes takes, generously) is the engine dying too.
    let read = tokio::time::timeout(HEADER_READ_TIMEOUT, Limited::new(body, limit(ENGINE_DEAD_MAX)).collect());
    let bytes = match read.await {
        Ok(Ok(c)) => c.to_bytes(),
        _ => return Err(()),
    };
    let said: Option<serde_json::Value> = serde_json::from_slice(&bytes).ok();
    let error = said.as_ref().map(|v| &v["error"]);
    if error.is_some_and(|e| e["message"] == ENGINE_DEAD_MESSAGE && e["type"] == "InternalServerError") {
        return Err(());
    }
    Ok(Response::from_parts(parts, Full::new(bytes).map_err(|e| match e {}).boxed()))
}

/// After a request failed at the engine: wait (up to `hold`) for the gate
/// to change from what it was when the request was sent, then take its
/// turn as any request.
async fn wait_change(door: &Arc<Door>, gate: &mut watch::Receiver<Gate>, held: &mut bool) -> Option<Response<UpBody>> {
    let started = tokio::time::Instant::now();
    if !*held {
        *held = true;
        door.metrics.front.count(outcome::HELD);
    }
    match tokio::time::timeout(door.front.hold, gate.changed()).await {
        Ok(Ok(())) => {}
        Ok(Err(_)) => return Some(unavailable("the warden is stopping".into(), Some(Duration::from_secs(1)))),
        Err(_) => {
            door.metrics.front.held_for(started.elapsed());
            door.metrics.front.count(outcome::REJECTED);
            return Some(unavailable(
                format!(
                    "the model's engine is not reachable: held {}, the longest a request waits",
                    shown(door.front.hold)
                ),
                Some(Duration::from_secs(1)),
            ));
        }
    }
    let left = door.front.hold.saturating_sub(started.elapsed());
    wait_turn(door, gate, left, held).await
}

/// Wait until the gate lets the request through (`None`), held at most
/// `budget`; or the answer it gets instead.
async fn wait_turn(
    door: &Arc<Door>,
    gate: &watch::Receiver<Gate>,
    budget: Duration,
    held: &mut bool,
) -> Option<Response<UpBody>> {
    let budget = match &*gate.borrow() {
        Gate::Idle { eta } => super::idle_hold(&door.front, *eta, door.ready_timeout),
        _ => budget,
    };
    let place = door.queue.admit(gate, budget);
    let mut ticket = match place {
        Ok(Place::Go) => return None,
        Ok(Place::Held(t)) => t,
        Err(refused) => {
            door.metrics.front.count(outcome::REJECTED);
            return Some(refusal(refused, budget));
        }
    };
    if !*held {
        *held = true;
        door.metrics.front.count(outcome::HELD);
    }
    let started = tokio::time::Instant::now();
    let released = tokio::time::timeout(budget, &mut ticket.release).await;
    let waited = started.elapsed();
    drop(ticket);
    door.metrics.front.held_for(waited);
    match released {
        Ok(Ok(Release::Go)) => None,
        Ok(Ok(Release::Closed)) | Ok(Err(_)) => {
            door.metrics.front.count(outcome::REJECTED);
            Some(unavailable("the warden is stopping".into(), Some(Duration::from_secs(1))))
        }
        Ok(Ok(Release::Upgrading)) => {
            door.metrics.front.count(outcome::REJECTED);
            Some(upgrading())
        }
        Err(_) => {
            door.metrics.front.count(outcome::REJECTED);
            let (why, eta) = match &*gate.borrow() {
                Gate::Holding { why, eta } => (why.clone(), *eta),
                Gate::Idle { eta } => (hold::IDLE_WHY.to_string(), *eta),
                _ => ("model not serving".to_string(), None),
            };
            let left = eta.map(|e| format!(", about {} left", shown(e))).unwrap_or_default();
            Some(unavailable(
                format!("{why}{left}; held {}, the longest a request waits", shown(budget)),
                Some(eta.unwrap_or(Duration::from_secs(1))),
            ))
        }
    }
}

/// The answer to a request the queue would not hold: 503, with when to
/// ask again.
fn refusal(refused: Refused, budget: Duration) -> Response<UpBody> {
    match refused {
        Refused::Full { why, eta } => {
            let left = eta.map(|e| format!(", about {} left", shown(e))).unwrap_or_default();
            unavailable(format!("{why}{left}; too many requests waiting"), Some(eta.unwrap_or(budget)))
        }
        Refused::TooLong { why, eta } => unavailable(format!("{why}, about {} left", shown(eta)), Some(eta)),
        Refused::Closed => unavailable("the warden is stopping".into(), Some(Duration::from_secs(1))),
        Refused::Upgrading => upgrading(),
    }
}

/// A held request when an upgrade's exec is near: its wait cannot cross
/// the exec; asked again in a second, it is held by the successor.
fn upgrading() -> Response<UpBody> {
    unavailable("the warden is being upgraded; the model is not serving now".into(), Some(Duration::from_secs(1)))
}

/// A duration as a person reads it in an answer: `3m`, `2m10s`, `12s`.
pub(crate) fn shown(d: Duration) -> String {
    let s = d.as_secs() + u64::from(d.subsec_nanos() > 0);
    match (s / 3600, s / 60 % 60, s % 60) {
        (0, 0, s) => format!("{s}s"),
        (0, m, 0) => format!("{m}m"),
        (0, m, s) => format!("{m}m{s}s"),
        (h, 0, _) => format!("{h}h"),
        (h, m, _) => format!("{h}h{m}m"),
    }
}

/// 503 with `Retry-After` (whole seconds, at least 1).
fn unavailable(message: String, retry: Option<Duration>) -> Response<UpBody> {
    error(StatusCode::SERVICE_UNAVAILABLE, "unavailable", message, retry)
}

fn too_large(max: u64) -> Response<UpBody> {
    error(
        StatusCode::PAYLOAD_TOO_LARGE,
        "invalid_request_error",
        format!("the request body is larger than {max} bytes (front.max-body)"),
        None,
    )
}

/// An answer of the front door's own, shaped as OpenAI's errors.
pub(crate) fn error(code: StatusCode, kind: &str, message: String, retry: Option<Duration>) -> Response<UpBody> {
    let body = serde_json::json!({
        "error": {"message": message, "type": kind, "param": null, "code": code.as_u16()}
    });
    let mut res = Response::new(Full::new(Bytes::from(format!("{body}\n"))).map_err(|e| match e {}).boxed());
    *res.status_mut() = code;
    let h = res.headers_mut();
    h.insert(header::CONTENT_TYPE, HeaderValue::from_static("application/json"));
    if let Some(r) = retry {
        let secs = (r.as_secs() + u64::from(r.subsec_nanos() > 0)).max(1);
        h.insert(header::RETRY_AFTER, HeaderValue::from(secs));
    }
    res
}

/// `Content-Length`: none, a length, or `Err` when it is not one number
/// (hyper refuses conflicting ones before this).
fn content_length(h: &HeaderMap) -> Option<Result<u64, ()>> {
    let v = h.get(header::CONTENT_LENGTH)?;
    Some(v.to_str().ok().and_then(|s| s.trim().parse().ok()).ok_or(()))
}

/// Is `path` one of vLLM's development routes (or under one)? Read as
/// vLLM's router reads it: percent-decoded, repeated and trailing
/// slashes ignored. A path that decodes to a control character is one
/// too, whatever it names: Python's router matches a route's `$` before a
/// final newline (`/sleep%0a` is `/sleep` there), and no route of the API
/// has one.
pub(crate) fn is_dev_route(path: &str) -> bool {
    let decoded = percent_encoding::percent_decode_str(path).decode_utf8_lossy();
    if decoded.chars().any(char::is_control) {
        return true;
    }
    let mut norm = String::with_capacity(decoded.len());
    for seg in decoded.split('/').filter(|s| !s.is_empty() && *s != ".") {
        norm.push('/');
        norm.push_str(seg);
    }
    DEV_ROUTES.iter().any(|r| norm == *r || norm.strip_prefix(r).is_some_and(|rest| rest.starts_with('/')))
}

/// Remove the hop-by-hop headers (RFC 9110 §7.6.1): `Connection` and
/// those it names, `Keep-Alive`, `TE`, `Trailer`, `Transfer-Encoding`,
/// `Upgrade`, and `Proxy-*`.
pub(crate) fn strip_hop_by_hop(h: &mut HeaderMap) {
    let named: Vec<HeaderName> = h
        .get_all(header::CONNECTION)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(','))
        .filter_map(|n| HeaderName::from_bytes(n.trim().as_bytes()).ok())
        .collect();
    for n in named {
        h.remove(n);
    }
    for n in [header::CONNECTION, header::TE, header::TRAILER, header::TRANSFER_ENCODING, header::UPGRADE] {
        h.remove(n);
    }
    h.remove("keep-alive");
    let proxy: Vec<HeaderName> = h.keys().filter(|k| k.as_str().starts_with("proxy-")).cloned().collect();
    for n in proxy {
        h.remove(n);
    }
}

/// Append the client to `X-Forwarded-For` and `Forwarded` (RFC 7239:
/// `for`, `proto=http`, and the `host` it asked for).
pub(crate) fn add_forwarded(h: &mut HeaderMap, peer: Option<IpAddr>) {
    static XFF: HeaderName = HeaderName::from_static("x-forwarded-for");
    static FORWARDED: HeaderName = HeaderName::from_static("forwarded");
    let append = |h: &mut HeaderMap, name: &HeaderName, value: String| {
        let joined = match h.get_all(name).iter().filter_map(|v| v.to_str().ok()).collect::<Vec<_>>() {
            earlier if earlier.is_empty() => value,
            earlier => format!("{}, {value}", earlier.join(", ")),
        };
        if let Ok(v) = HeaderValue::from_str(&joined) {
            h.insert(name, v);
        }
    };
    if let Some(ip) = peer {
        append(h, &XFF, ip.to_string());
    }
    let node = match peer {
        Some(IpAddr::V4(ip)) => ip.to_string(),
        Some(IpAddr::V6(ip)) => format!("\"[{ip}]\""),
        None => "unknown".to_string(),
    };
    let mut element = format!("for={node};proto=http");
    if let Some(host) = h.get(header::HOST).and_then(|v| v.to_str().ok()) {
        let quoted = host.replace('\\', "\\\\").replace('"', "\\\"");
        element.push_str(&format!(";host=\"{quoted}\""));
    }
    append(h, &FORWARDED, element);
}

/// The warden's own lack of a resource, in an error of the client.
fn own_shortage(e: &hyper_util::client::legacy::Error) -> Option<&'static str> {
    io_error(e).and_then(crate::util::errno::own_shortage)
}

/// The system's error under an error of the client.
fn io_error(e: &hyper_util::client::legacy::Error) -> Option<&std::io::Error> {
    let mut source: Option<&(dyn std::error::Error + 'static)> = std::error::Error::source(e);
    while let Some(s) = source {
        if let Some(io) = s.downcast_ref::<std::io::Error>() {
            return Some(io);
        }
        source = s.source();
    }
    None
}

/// Did the request's body go over `front.max-body` while it was sent?
fn is_too_large(e: &hyper_util::client::legacy::Error) -> bool {
    let mut source: Option<&(dyn std::error::Error + 'static)> = std::error::Error::source(e);
    while let Some(s) = source {
        if s.downcast_ref::<http_body_util::LengthLimitError>().is_some() {
            return true;
        }
        source = s.source();
    }
    false
}

/// Did the client's own body fail while it was streamed to the engine?
fn is_clients_body(e: &hyper_util::client::legacy::Error) -> bool {
    let mut source: Option<&(dyn std::error::Error + 'static)> = std::error::Error::source(e);
    while let Some(s) = source {
        if s.downcast_ref::<hyper::Error>().is_some_and(|h| h.is_user()) {
            return true;
        }
        source = s.source();
    }
    false
}

/// Connects the pooled client to the engine, whatever the URI says.
#[derive(Clone)]
struct Connector(Arc<Engine>);

impl tower_service::Service<Uri> for Connector {
    type Response = TokioIo<EngineStream>;
    type Error = std::io::Error;
    type Future = Pin<Box<dyn Future<Output = std::io::Result<Self::Response>> + Send>>;

    fn poll_ready(&mut self, _: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, _: Uri) -> Self::Future {
        let engine = self.0.clone();
        Box::pin(async move {
            let s = match &*engine {
                Engine::Loopback(port) => {
                    let s = tokio::net::TcpStream::connect((std::net::Ipv4Addr::LOCALHOST, *port)).await?;
                    let _ = s.set_nodelay(true);
                    EngineStream::Tcp(s)
                }
                Engine::Unix(path) => EngineStream::Unix(tokio::net::UnixStream::connect(path).await?),
            };
            Ok(TokioIo::new(s))
        })
    }
}

/// A connection to the engine.
enum EngineStream {
    Tcp(tokio::net::TcpStream),
    Unix(tokio::net::UnixStream),
}

impl Connection for EngineStream {
    fn connected(&self) -> Connected {
        Connected::new()
    }
}

impl tokio::io::AsyncRead for EngineStream {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut tokio::io::ReadBuf<'_>,
    ) -> Poll<std::io::Result<()>> {
        match self.get_mut() {
            EngineStream::Tcp(s) => Pin::new(s).poll_read(cx, buf),
            EngineStream::Unix(s) => Pin::new(s).poll_read(cx, buf),
        }
    }
}

impl tokio::io::AsyncWrite for EngineStream {
    fn poll_write(self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &[u8]) -> Poll<std::io::Result<usize>> {
        match self.get_mut() {
            EngineStream::Tcp(s) => Pin::new(s).poll_write(cx, buf),
            EngineStream::Unix(s) => Pin::new(s).poll_write(cx, buf),
        }
    }
    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        match self.get_mut() {
            EngineStream::Tcp(s) => Pin::new(s).poll_flush(cx),
            EngineStream::Unix(s) => Pin::new(s).poll_flush(cx),
        }
    }
    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        match self.get_mut() {
            EngineStream::Tcp(s) => Pin::new(s).poll_shutdown(cx),
            EngineStream::Unix(s) => Pin::new(s).poll_shutdown(cx),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hop_by_hop_headers_go_and_the_client_is_added() {
        let mut h = HeaderMap::new();
        h.insert(header::CONNECTION, HeaderValue::from_static("keep-alive, X-Secret"));
        h.insert("x-secret", HeaderValue::from_static("1"));
        h.insert("keep-alive", HeaderValue::from_static("timeout=5"));
        h.insert(header::TE, HeaderValue::from_static("trailers"));
        h.insert(header::TRANSFER_ENCODING, HeaderValue::from_static("chunked"));
        h.insert(header::UPGRADE, HeaderValue::from_static("websocket"));
        h.insert("proxy-authorization", HeaderValue::from_static("Basic x"));
        h.insert(header::AUTHORIZATION, HeaderValue::from_static("Bearer kept"));
        h.insert(header::HOST, HeaderValue::from_static("model.example:8000"));
        h.insert("x-forwarded-for", HeaderValue::from_static("203.0.113.7"));
        strip_hop_by_hop(&mut h);
        add_forwarded(&mut h, Some("2001:db8::1".parse().unwrap()));
        let names: Vec<&str> = h.keys().map(|k| k.as_str()).collect();
        assert_eq!(names, ["authorization", "host", "x-forwarded-for", "forwarded"]);
        assert_eq!(h["x-forwarded-for"], "203.0.113.7, 2001:db8::1");
        assert_eq!(h["forwarded"], "for=\"[2001:db8::1]\";proto=http;host=\"model.example:8000\"");
        let mut h = HeaderMap::new();
        add_forwarded(&mut h, Some("10.0.0.1".parse().unwrap()));
        assert_eq!(h["forwarded"], "for=10.0.0.1;proto=http");
        let mut h = HeaderMap::new();
        add_forwarded(&mut h, None);
        assert!(h.get("x-forwarded-for").is_none());
        assert_eq!(h["forwarded"], "for=unknown;proto=http");
    }

    #[test]
    fn vllms_development_routes_are_known_however_written() {
        for p in [
            "/sleep",
            "/sleep/",
            "//wake_up",
            "/%73leep",
            "/collective_rpc/x",
            "/./server_info",
            "/is_sleeping",
            "/sleep%0a",
            "/collective_rpc%0A",
            "/v1/completions%00",
        ] {
            assert!(is_dev_route(p), "{p}");
        }
        for p in ["/v1/completions", "/health", "/sleeper", "/v1/sleep", "/metrics", "/drain"] {
            assert!(!is_dev_route(p), "{p}");
        }
    }

    #[test]
    fn the_cap_is_under_the_descriptor_limit() {
        assert_eq!(connection_cap(1024, 1 << 20), 1024);
        assert_eq!(connection_cap(1024, 4096), 512);
        assert_eq!(connection_cap(1024, 3), 1);
    }

    #[test]
    fn waits_are_said_as_people_say_them() {
        assert_eq!(shown(Duration::from_secs(180)), "3m");
        assert_eq!(shown(Duration::from_secs(130)), "2m10s");
        assert_eq!(shown(Duration::from_millis(11_200)), "12s");
        assert_eq!(shown(Duration::from_secs(3600 + 120)), "1h2m");
    }
}
