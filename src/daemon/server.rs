//! The warden's own HTTP endpoint, for load balancers, Kubernetes and the
//! local commands: always on the unix socket `server.socket` (mode 0660),
//! and on TCP at `server.listen` when set. It reads what the loop publishes
//! (a [`View`], the metrics registry, the loop's heartbeat, the last health
//! check) and hands requests (drain, undrain, restart, reload) to the loop as
//! [`Request`]s; it never waits on the loop for more than an answer's
//! bounded wait, and the loop never waits on it. How the state changes is
//! not known here.
//!
//! | endpoint | answer |
//! |---|---|
//! | `GET /livez` | 200 while the loop turns, 503 when it has not for [`LIVE_STALE`]; the phase |
//! | `GET /readyz` | 200 when ready, not draining, not re-checking its answers and the last health check passed; else 503, phase and cause |
//! | `GET /startupz` | 200 once the model has loaded (ready, or drained since); else 503 with the load's phase, as JSON |
//! | `GET /status` | the status document |
//! | `GET /metrics` | the metrics, Prometheus text format |
//! | `POST /drain`, `/undrain`, `/restart` | 202 once the loop took it; 409 in a phase it does not apply to; 403 over TCP without the bearer token |
//! | `POST /reload` | the config read again: 200 applied (in place, restarting the child, or unchanged), 422 refused with every problem, as JSON; 403 as above |
//!
//! Each listener is served here, not by `axum::serve`: at most
//! [`MAX_CONNECTIONS`] at once (fewer under a low descriptor limit), each
//! closed after [`HEADER_READ_TIMEOUT`] without a request head or
//! [`IDLE_TIMEOUT`] without a byte moving, with a [`MAX_BUF`] read buffer;
//! a client cannot take the warden's descriptors or memory. Nor can
//! clients hold every connection: when the listener is full, a new
//! connection takes the place of one that has had a request (closed
//! between two requests, or after its answer), and one peer (an address,
//! a user on the unix socket) holds at most a [`PEER_SHARE`]th of them
//! (see `server/conns.rs`), so that a probe is answered at once.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use axum::Router;
use axum::extract::State;
use axum::http::{HeaderMap, StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use tokio::sync::{mpsc, watch};

use crate::daemon::driver::{Heartbeat, Request};
use crate::supervisor::control::Control;
use crate::supervisor::outcome::Phase;
use crate::tell::metrics::Metrics;

/// The loop has not turned for this long: `/livez` fails.
pub(crate) const LIVE_STALE: Duration = Duration::from_secs(5);
/// How long a mutating request waits for the loop to show that it took it.
pub(crate) const ANSWER_WAIT: Duration = Duration::from_secs(2);
/// The largest token file read.
const MAX_TOKEN: u64 = 4096;

/// What the loop publishes after every change.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct View {
    pub(crate) phase: Phase,
    /// Why the warden is not ready (the cause of the last failure, one
    /// escaped line), when it has one.
    pub(crate) cause: Option<String>,
    /// The status document as last made.
    pub(crate) document: Option<Arc<str>>,
    /// The load under way, as of the loop's last step: `/startupz` takes
    /// its elapsed time again when it answers, since a phase that logs
    /// nothing makes no step.
    pub(crate) load: Option<crate::supervisor::load::LoadNow>,
    /// The reloads that ended, and the last one: `POST /reload` answers
    /// once the count passes what it was when asked.
    pub(crate) reloads: u64,
    pub(crate) last_reload: Option<Arc<crate::tell::status::LastReload>>,
}

impl Default for View {
    fn default() -> Self {
        View { phase: Phase::Starting, cause: None, document: None, load: None, reloads: 0, last_reload: None }
    }
}

/// What every connection shares.
#[derive(Debug, Clone)]
pub(crate) struct Shared {
    pub(crate) view: watch::Receiver<View>,
    pub(crate) heartbeat: Heartbeat,
    pub(crate) metrics: Arc<Metrics>,
    pub(crate) last_check: crate::observe::health::LastCheck,
    pub(crate) requests: mpsc::UnboundedSender<Request>,
}

/// Who may change things through a listener.
#[derive(Debug, Clone)]
enum Access {
    /// The unix socket: whoever can open it (mode 0660).
    Local,
    /// TCP: the bearer token, when a token file was given; else nobody.
    Token(Option<Arc<str>>),
}

#[derive(Clone)]
struct Api {
    shared: Shared,
    access: Access,
}

/// Why the token file gives no token.
#[derive(Debug, thiserror::Error)]
pub(crate) enum TokenError {
    #[error("{path}: {source}")]
    Read { path: PathBuf, source: std::io::Error },
    #[error("{path}: empty")]
    Empty { path: PathBuf },
    #[error("{path}: larger than {MAX_TOKEN} bytes")]
    TooLarge { path: PathBuf },
    #[error("{path}: readable by every user (chmod o-r)")]
    WorldReadable { path: PathBuf },
}

/// The bearer token: the file's text, surrounding whitespace removed.
pub(crate) fn read_token(path: &Path) -> Result<String, TokenError> {
    use std::io::Read;
    use std::os::unix::fs::PermissionsExt;
    let read = |source| TokenError::Read { path: path.to_path_buf(), source };
    use std::os::unix::fs::OpenOptionsExt;
    // Without blocking, a regular file only: a FIFO cannot hold `check`.
    let file = std::fs::OpenOptions::new().read(true).custom_flags(libc::O_NONBLOCK).open(path).map_err(read)?;
    let meta = file.metadata().map_err(read)?;
    if !meta.is_file() {
        return Err(read(std::io::Error::new(std::io::ErrorKind::InvalidInput, "not a regular file")));
    }
    if meta.permissions().mode() & 0o004 != 0 {
        return Err(TokenError::WorldReadable { path: path.to_path_buf() });
    }
    let mut text = String::new();
    file.take(MAX_TOKEN + 1).read_to_string(&mut text).map_err(read)?;
    if text.len() as u64 > MAX_TOKEN {
        return Err(TokenError::TooLarge { path: path.to_path_buf() });
    }
    let token = text.trim();
    if token.is_empty() {
        return Err(TokenError::Empty { path: path.to_path_buf() });
    }
    Ok(token.to_string())
}

/// Why a listener could not be set up.
#[derive(Debug, thiserror::Error)]
pub(crate) enum ListenError {
    #[error("cannot listen on {path}: {source}")]
    Socket { path: PathBuf, source: std::io::Error },
    #[error("cannot listen on {addr}: {source}")]
    Tcp { addr: std::net::SocketAddr, source: std::io::Error },
    #[error("server.token-file {0}")]
    Token(#[from] TokenError),
}

/// The unix socket at `path`, mode 0660: bound under a temporary name,
/// given its mode, then renamed into place, so that it is never open to
/// more than that. A socket left by an earlier warden of this instance
/// (whose lock this one holds) is replaced.
pub(crate) fn bind_socket(path: &Path) -> Result<tokio::net::UnixListener, ListenError> {
    use std::os::unix::fs::PermissionsExt;
    let err = |source| ListenError::Socket { path: path.to_path_buf(), source };
    if let Some(dir) = path.parent() {
        std::fs::create_dir_all(dir).map_err(err)?;
    }
    let mut tmp = path.as_os_str().to_owned();
    tmp.push(format!(".{}.tmp", std::process::id()));
    let tmp = PathBuf::from(tmp);
    let _ = std::fs::remove_file(&tmp);
    let listener = tokio::net::UnixListener::bind(&tmp).map_err(err)?;
    let placed = std::fs::set_permissions(&tmp, std::fs::Permissions::from_mode(0o660))
        .and_then(|()| std::fs::rename(&tmp, path));
    if let Err(e) = placed {
        let _ = std::fs::remove_file(&tmp);
        return Err(err(e));
    }
    Ok(listener)
}

/// The TCP listener, and the token that allows changes through it.
pub(crate) fn bind_tcp(
    addr: std::net::SocketAddr,
    token_file: Option<&Path>,
) -> Result<(tokio::net::TcpListener, Option<String>), ListenError> {
    let token = token_file.map(read_token).transpose()?;
    let std = std::net::TcpListener::bind(addr).map_err(|source| ListenError::Tcp { addr, source })?;
    std.set_nonblocking(true).map_err(|source| ListenError::Tcp { addr, source })?;
    let listener = tokio::net::TcpListener::from_std(std).map_err(|source| ListenError::Tcp { addr, source })?;
    Ok((listener, token))
}

mod conns;

/// Serve the unix socket until the task is aborted.
pub(crate) async fn serve_socket(listener: tokio::net::UnixListener, shared: Shared) {
    let app = router(Api { shared, access: Access::Local });
    serve(listener, app, Limits::for_this_process(), "control socket").await;
}

/// Serve TCP until the task is aborted; changes need `token`.
pub(crate) async fn serve_tcp(listener: tokio::net::TcpListener, token: Option<String>, shared: Shared) {
    let app = router(Api { shared, access: Access::Token(token.map(Arc::from)) });
    serve(listener, app, Limits::for_this_process(), "TCP endpoint").await;
}

/// How long a client has to send a request's head (its first line and
/// headers), on a new connection and between two requests on a kept-alive
/// one: a probe or a balancer sends its request at once; a connection that
/// says nothing (or a header a byte at a time) is closed after this.
pub const HEADER_READ_TIMEOUT: Duration = Duration::from_secs(5);

/// A connection on which no byte moved either way for this long is closed:
/// a body that is never sent, an answer that is never read. Longer than
/// the longest answer ([`ANSWER_WAIT`]) with room to spare.
pub(crate) const IDLE_TIMEOUT: Duration = Duration::from_secs(10);

/// The most connections one listener serves at once. The endpoint answers
/// probes, a balancer's health checks, a metrics scraper and the local
/// commands: a few at a time. Past this, a new connection takes the place
/// of one that has had a request (kept alive for more): that one is
/// closed between two requests, or after its answer. While none can make
/// room (all are new, their requests still to come), new connections wait
/// in the kernel's accept queue (they hold none of the warden's
/// descriptors or memory) until one of the served ends.
pub const MAX_CONNECTIONS: usize = 64;

/// One peer (a TCP client's address; on the unix socket, a user) holds at
/// most this share of a listener's connections (16 of 64): past it, a new
/// connection of its takes the place of one of its own (one that has had a
/// request, after its answer; else the one quiet the longest, at once). A
/// balancer, a scraper and the kubelet are each a few connections; a peer
/// that opens many and sends nothing cannot keep the others out.
pub(crate) const PEER_SHARE: usize = 4;

/// Each listener serves at most this share of the warden's descriptor
/// limit (`RLIMIT_NOFILE`, soft) when that is lower than
/// [`MAX_CONNECTIONS`] allows: both listeners together never take more than
/// a quarter of it, and the rest stays for the child's log, the health
/// checks, `/proc` and the pre-start steps.
pub(crate) const NOFILE_SHARE: u64 = 8;

/// The read buffer of one connection, which holds a request's head: hyper's
/// smallest (8 KiB is its floor), ample for a request to this endpoint
/// (a path and a bearer token). A head larger than this is answered 431.
pub(crate) const MAX_BUF: usize = 16 << 10;

/// The most headers a request may have; more is answered 431.
pub(crate) const MAX_HEADERS: usize = 32;

/// What one listener allows.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Limits {
    pub connections: usize,
    /// The most one peer holds.
    pub per_peer: usize,
    pub(crate) header_read: Duration,
    pub(crate) idle: Duration,
}

impl Limits {
    /// [`MAX_CONNECTIONS`], or a share of the descriptor limit `nofile`
    /// when that is lower; never less than one; a [`PEER_SHARE`]th of that
    /// per peer, never less than one.
    pub fn for_nofile(nofile: u64) -> Limits {
        let share = usize::try_from(nofile / NOFILE_SHARE).unwrap_or(usize::MAX);
        let connections = MAX_CONNECTIONS.min(share).max(1);
        Limits {
            connections,
            per_peer: (connections / PEER_SHARE).max(1),
            header_read: HEADER_READ_TIMEOUT,
            idle: IDLE_TIMEOUT,
        }
    }

    /// For this process's descriptor limit as it is now.
    pub(crate) fn for_this_process() -> Limits {
        Limits::for_nofile(nofile_limit())
    }
}

/// The soft `RLIMIT_NOFILE` of this process (unlimited when unknown).
pub(crate) fn nofile_limit() -> u64 {
    let mut lim = libc::rlimit { rlim_cur: 0, rlim_max: 0 };
    // SAFETY: getrlimit writes the limit into the struct we own.
    if unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut lim) } != 0 || lim.rlim_cur == libc::RLIM_INFINITY {
        return u64::MAX;
    }
    lim.rlim_cur
}

/// A listener of the endpoint: TCP or the unix socket.
trait Accept: Send + 'static {
    type Io: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin + Send + 'static;
    /// A connection, and who opened it.
    fn accept(&self) -> impl std::future::Future<Output = std::io::Result<(Self::Io, conns::Peer)>> + Send;
}

impl Accept for tokio::net::TcpListener {
    type Io = tokio::net::TcpStream;
    async fn accept(&self) -> std::io::Result<(Self::Io, conns::Peer)> {
        let (s, addr) = tokio::net::TcpListener::accept(self).await?;
        let _ = s.set_nodelay(true);
        Ok((s, conns::Peer::Ip(addr.ip().to_canonical())))
    }
}

impl Accept for tokio::net::UnixListener {
    type Io = tokio::net::UnixStream;
    async fn accept(&self) -> std::io::Result<(Self::Io, conns::Peer)> {
        let s = tokio::net::UnixListener::accept(self).await?.0;
        // The socket is the owner's and its group's (mode 0660): a peer is
        // a user of those.
        let peer = s.peer_cred().map_or(conns::Peer::Unknown, |c| conns::Peer::Uid(c.uid()));
        Ok((s, peer))
    }
}

/// Accept and serve connections until aborted: at most
/// `limits.connections` at once and `limits.per_peer` of one peer, each
/// closed after [`HEADER_READ_TIMEOUT`] without a request head or
/// [`IDLE_TIMEOUT`] without a byte moving, or to make room for a new one
/// (see `server/conns.rs`). Dropping this future ends every connection.
async fn serve<L: Accept>(listener: L, app: Router, limits: Limits, what: &'static str) {
    let permits = Arc::new(tokio::sync::Semaphore::new(limits.connections));
    let table = Arc::new(conns::Table::default());
    let mut conns = tokio::task::JoinSet::new();
    let mut pause = ACCEPT_PAUSE;
    let (mut full, mut short, mut crowded) = (Throttle::default(), Throttle::default(), Throttle::default());
    tracing::debug!(listener = what, connections = limits.connections, per_peer = limits.per_peer, "serving");
    loop {
        while conns.try_join_next().is_some() {}
        // Full or not, the next connection is taken from the kernel's
        // queue: when full, it is one descriptor past the cap until a
        // served connection has made room for it.
        let (io, peer) = match listener.accept().await {
            Ok(accepted) => {
                pause = ACCEPT_PAUSE;
                accepted
            }
            Err(e) => {
                match crate::util::errno::own_shortage(&e) {
                    // The connection waits in the kernel's queue: looked
                    // at again after a pause, not in a busy loop.
                    Some(why) => {
                        if short.due() {
                            tracing::warn!(EVENT = "endpoint", error = %e, "the {what} cannot accept a connection: {why}");
                        }
                        tokio::time::sleep(pause).await;
                        pause = (pause * 2).min(MAX_ACCEPT_PAUSE);
                    }
                    // One connection's trouble (reset before it was taken).
                    None => tracing::debug!(error = %e, "the {what} could not accept a connection"),
                }
                continue;
            }
        };
        let (io, moved) = Watched::new(io);
        let conns::Admitted { slot, made_room } = table.admit(peer, limits.per_peer, moved);
        if made_room && crowded.due() {
            tracing::warn!(
                EVENT = "endpoint",
                "the {what} serves {} connections from {peer}, the most one peer may: \
                 one of them is closed for each new one",
                limits.per_peer
            );
        }
        let permit = match permits.clone().try_acquire_owned() {
            Ok(p) => p,
            Err(_) => {
                // A peer at its cap made room of its own; else the
                // connection quiet the longest makes it. With none that
                // can (all new, their requests to come), the first to end.
                let told = made_room || table.make_room();
                if full.due() {
                    let how = if told {
                        "a kept-alive one is closed to make room for a new one"
                    } else {
                        "none has had a request yet: new ones wait for the first to end"
                    };
                    tracing::warn!(
                        EVENT = "endpoint",
                        "the {what} serves {} connections, its most: {how}",
                        limits.connections
                    );
                }
                let Ok(p) = permits.clone().acquire_owned().await else { return };
                p
            }
        };
        let app = app.clone();
        conns.spawn(async move {
            serve_connection(io, app, limits, slot).await;
            drop(permit);
        });
    }
}

/// A warning said at most once per [`WARN_EVERY`].
#[derive(Default)]
struct Throttle(Option<tokio::time::Instant>);

/// How often a flood's warnings repeat at most.
const WARN_EVERY: Duration = Duration::from_secs(60);

impl Throttle {
    fn due(&mut self) -> bool {
        let now = tokio::time::Instant::now();
        let due = self.0.is_none_or(|at| now >= at + WARN_EVERY);
        if due {
            self.0 = Some(now);
        }
        due
    }
}

/// The first pause after a failed accept for want of a resource; doubled
/// up to [`MAX_ACCEPT_PAUSE`].
const ACCEPT_PAUSE: Duration = Duration::from_millis(50);
const MAX_ACCEPT_PAUSE: Duration = Duration::from_secs(1);

/// Serve one connection in its `slot` until it ends, is idle for too
/// long, or is told to close (then after the answer under way, if any,
/// which says `Connection: close`).
async fn serve_connection<I>(io: Watched<I>, app: Router, limits: Limits, mut slot: conns::Slot)
where
    I: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin + Send + 'static,
{
    let moved = io.moved.clone();
    let service = hyper_util::service::TowerToHyperService::new(app);
    let counted = slot.conn.clone();
    let service = hyper::service::service_fn(move |req| {
        let asking = counted.begin();
        let answer = hyper::service::Service::call(&service, req);
        async move {
            let answer = answer.await;
            drop(asking);
            answer
        }
    });
    let conn = hyper::server::conn::http1::Builder::new()
        .timer(hyper_util::rt::TokioTimer::new())
        .header_read_timeout(limits.header_read)
        .max_buf_size(MAX_BUF)
        .max_headers(MAX_HEADERS)
        .serve_connection(hyper_util::rt::TokioIo::new(io), service);
    tokio::pin!(conn);
    let mut told = false;
    loop {
        let idle_at = moved.last() + limits.idle;
        tokio::select! {
            ended = &mut conn => {
                if let Err(e) = ended {
                    tracing::debug!(error = %e, "endpoint connection ended");
                }
                return;
            }
            Ok(how) = &mut slot.close, if !told => {
                told = true;
                match how {
                    // Between two requests it closes at once; with one
                    // under way, after its answer.
                    conns::Close::AfterAnswer => conn.as_mut().graceful_shutdown(),
                    // Owed no answer: whatever it was sending.
                    conns::Close::Now => return,
                }
            }
            () = tokio::time::sleep_until(idle_at) => {
                if moved.last() + limits.idle <= tokio::time::Instant::now() {
                    tracing::debug!("endpoint connection closed: idle for {}s", limits.idle.as_secs());
                    return;
                }
            }
        }
    }
}

/// When a connection last moved a byte, either way.
#[derive(Clone)]
struct Moved {
    since: tokio::time::Instant,
    /// Milliseconds after `since`.
    at: Arc<std::sync::atomic::AtomicU64>,
}

impl Moved {
    fn new() -> Moved {
        Moved { since: tokio::time::Instant::now(), at: Arc::default() }
    }

    /// One whose clock began at `since`, for a test to set.
    #[cfg(test)]
    fn since(since: tokio::time::Instant) -> Moved {
        Moved { since, at: Arc::default() }
    }

    #[cfg(test)]
    fn set(&self, at: tokio::time::Instant) {
        let ms = at.saturating_duration_since(self.since).as_millis() as u64;
        self.at.store(ms, std::sync::atomic::Ordering::Relaxed);
    }

    fn touch(&self) {
        let ms = self.since.elapsed().as_millis() as u64;
        self.at.store(ms, std::sync::atomic::Ordering::Relaxed);
    }

    fn last(&self) -> tokio::time::Instant {
        self.since + Duration::from_millis(self.at.load(std::sync::atomic::Ordering::Relaxed))
    }
}

/// A connection's stream that notes every read or write that moved bytes.
struct Watched<I> {
    io: I,
    moved: Moved,
}

impl<I> Watched<I> {
    fn new(io: I) -> (Watched<I>, Moved) {
        let moved = Moved::new();
        (Watched { io, moved: moved.clone() }, moved)
    }
}

impl<I: tokio::io::AsyncRead + Unpin> tokio::io::AsyncRead for Watched<I> {
    fn poll_read(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
        buf: &mut tokio::io::ReadBuf<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        let before = buf.filled().len();
        let polled = std::pin::Pin::new(&mut self.io).poll_read(cx, buf);
        if buf.filled().len() > before {
            self.moved.touch();
        }
        polled
    }
}

impl<I: tokio::io::AsyncWrite + Unpin> tokio::io::AsyncWrite for Watched<I> {
    fn poll_write(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
        buf: &[u8],
    ) -> std::task::Poll<std::io::Result<usize>> {
        let polled = std::pin::Pin::new(&mut self.io).poll_write(cx, buf);
        if matches!(polled, std::task::Poll::Ready(Ok(n)) if n > 0) {
            self.moved.touch();
        }
        polled
    }

    fn poll_flush(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        std::pin::Pin::new(&mut self.io).poll_flush(cx)
    }

    fn poll_shutdown(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        std::pin::Pin::new(&mut self.io).poll_shutdown(cx)
    }
}

fn router(api: Api) -> Router {
    Router::new()
        .route("/livez", get(livez))
        .route("/readyz", get(readyz))
        .route("/startupz", get(startupz))
        .route("/status", get(status))
        .route("/metrics", get(metrics))
        .route("/drain", post(|s, h| change(s, h, Control::Drain)))
        .route("/undrain", post(|s, h| change(s, h, Control::Undrain)))
        .route("/restart", post(|s, h| change(s, h, Control::Restart)))
        .route("/reload", post(reload))
        .with_state(api)
}

fn text(code: StatusCode, body: String) -> Response {
    (code, [(header::CONTENT_TYPE, "text/plain; charset=utf-8")], body).into_response()
}

async fn livez(State(api): State<Api>) -> Response {
    let (code, body) = live(api.shared.heartbeat.age(), api.shared.view.borrow().phase);
    text(code, body)
}

/// `/livez` for a loop that last turned `age` ago.
fn live(age: Duration, phase: Phase) -> (StatusCode, String) {
    if age <= LIVE_STALE {
        (StatusCode::OK, format!("{phase}\n"))
    } else {
        (StatusCode::SERVICE_UNAVAILABLE, format!("{phase}: the loop has not turned for {}s\n", age.as_secs()))
    }
}

async fn readyz(State(api): State<Api>) -> Response {
    let view = api.shared.view.borrow().clone();
    let checked = api.shared.last_check.passed();
    match (view.phase, checked) {
        (Phase::Ready, true) => text(StatusCode::OK, "ready\n".into()),
        // An idle engine (`front.idle-stop`): the front door serves it,
        // later, holding the request while it starts or wakes; a balancer
        // that took the instance out would never send the request that
        // brings it back.
        (Phase::Idle, _) => text(StatusCode::OK, "idle: the engine starts on the next request\n".into()),
        (Phase::Ready, false) => text(StatusCode::SERVICE_UNAVAILABLE, "ready: the last health check failed\n".into()),
        (phase, _) => {
            let cause = view.cause.map(|c| format!(": {c}")).unwrap_or_default();
            text(StatusCode::SERVICE_UNAVAILABLE, format!("{phase}{cause}\n"))
        }
    }
}

/// For a Kubernetes startup probe: has the model loaded? 503 with the
/// state and the load (as the status document's `load`: its phase, elapsed
/// and estimate) while it has not; its elapsed time is taken now, not at the
/// loop's last step.
async fn startupz(State(api): State<Api>) -> Response {
    let (phase, load) = {
        let view = api.shared.view.borrow();
        (view.phase, view.load.clone())
    };
    match phase {
        Phase::Ready | Phase::Rechecking | Phase::Draining | Phase::Drained => {
            text(StatusCode::OK, format!("{phase}\n"))
        }
        // It has loaded once; it is given back until a request comes.
        Phase::Idle => text(StatusCode::OK, format!("{phase}\n")),
        phase => {
            let load = load.map(|l| crate::tell::status::LoadDoc::of(&l.as_of(crate::util::clock::now())));
            let body = serde_json::json!({ "state": phase.as_str(), "load": load });
            (StatusCode::SERVICE_UNAVAILABLE, [(header::CONTENT_TYPE, "application/json")], format!("{body}\n"))
                .into_response()
        }
    }
}

async fn status(State(api): State<Api>) -> Response {
    let doc = api.shared.view.borrow().document.clone();
    match doc {
        Some(d) => ([(header::CONTENT_TYPE, "application/json")], live_front(&d, &api.shared.metrics)).into_response(),
        None => text(StatusCode::SERVICE_UNAVAILABLE, "no status yet\n".into()),
    }
}

/// The document with the front door's `held` and `in_flight` as they are
/// now: the document is made at each change of the machine, and requests
/// come and go between two (the gauges follow each one).
fn live_front(doc: &str, metrics: &crate::tell::metrics::Metrics) -> String {
    let Ok(mut v) = serde_json::from_str::<serde_json::Value>(doc) else { return doc.to_string() };
    let Some(front) = v.get_mut("front").and_then(|f| f.as_object_mut()) else { return doc.to_string() };
    let (held, in_flight) = metrics.front.now();
    front.insert("held".into(), held.into());
    front.insert("in_flight".into(), in_flight.into());
    let mut text = v.to_string();
    if doc.ends_with('\n') {
        text.push('\n');
    }
    text
}

async fn metrics(State(api): State<Api>) -> Response {
    let body = api.shared.metrics.encode();
    ([(header::CONTENT_TYPE, prometheus_client::encoding::prometheus_text::CONTENT_TYPE)], body).into_response()
}

/// The phases in which a request applies, and the phases that show the
/// loop took it.
fn allowed(access: &Access, headers: &HeaderMap) -> bool {
    match access {
        Access::Local => true,
        Access::Token(None) => false,
        Access::Token(Some(token)) => headers
            .get(header::AUTHORIZATION)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.strip_prefix("Bearer "))
            .is_some_and(|given| same(given.trim().as_bytes(), token.as_bytes())),
    }
}

/// Compares without stopping at the first difference, so that the time
/// taken does not tell how much of a guess was right.
fn same(a: &[u8], b: &[u8]) -> bool {
    a.len() == b.len() && a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

/// The answer to a change this listener does not allow, if it does not.
fn forbidden(access: &Access, headers: &HeaderMap) -> Option<Response> {
    if allowed(access, headers) {
        return None;
    }
    let why = match access {
        Access::Token(None) => "changes are refused over TCP: no server.token-file is set\n",
        _ => "a valid Authorization: Bearer token is needed\n",
    };
    Some(text(StatusCode::FORBIDDEN, why.into()))
}

/// A change, answered by the core's rule for it ([`Control`]): 409 in a
/// phase it does not apply to, 200 when it is so already, else 202 once
/// the loop shows it taken.
async fn change(State(api): State<Api>, headers: HeaderMap, c: Control) -> Response {
    if let Some(refused) = forbidden(&api.access, &headers) {
        return refused;
    }
    let mut view = api.shared.view.clone();
    let before = view.borrow_and_update().phase;
    if !c.applies(before) {
        return text(StatusCode::CONFLICT, format!("{before}: nothing to {}\n", c.as_str()));
    }
    if c.already(before) {
        return text(StatusCode::OK, format!("{before}\n"));
    }
    if api.shared.requests.send(Request::Control(c)).is_err() {
        return text(StatusCode::SERVICE_UNAVAILABLE, "the warden is exiting\n".into());
    }
    // Answered once the loop shows it took the request, so that a
    // `/readyz` asked right after a drain already says 503.
    let shown = tokio::time::timeout(ANSWER_WAIT, view.wait_for(|v| c.taken(before, v.phase)))
        .await
        .ok()
        .and_then(Result::ok)
        .map(|v| v.phase);
    match shown {
        Some(now) => text(StatusCode::ACCEPTED, format!("{now}\n")),
        None => text(StatusCode::ACCEPTED, format!("{}: asked; not yet shown\n", api.shared.view.borrow().phase)),
    }
}

/// How long `POST /reload` waits for the verdict: the config is read and
/// checked off the loop (paths, the program, the model folder).
pub(crate) const RELOAD_WAIT: Duration = Duration::from_secs(30);

/// `POST /reload`: read the config again and answer what became of it, as
/// JSON (the status document's `last_reload`): 200 when it applied (in
/// place, restarting the child, or nothing changed), 422 when it was
/// refused, with every problem.
async fn reload(State(api): State<Api>, headers: HeaderMap) -> Response {
    if let Some(refused) = forbidden(&api.access, &headers) {
        return refused;
    }
    let mut view = api.shared.view.clone();
    let before = view.borrow_and_update().reloads;
    if api.shared.requests.send(Request::Reload).is_err() {
        return text(StatusCode::SERVICE_UNAVAILABLE, "the warden is exiting\n".into());
    }
    let done = tokio::time::timeout(RELOAD_WAIT, view.wait_for(|v| v.reloads > before))
        .await
        .ok()
        .and_then(Result::ok)
        .and_then(|v| v.last_reload.clone());
    match done {
        Some(r) => {
            let code = if r.outcome == crate::tell::status::ReloadOutcome::Refused {
                StatusCode::UNPROCESSABLE_ENTITY
            } else {
                StatusCode::OK
            };
            let body = serde_json::to_string(&*r).unwrap_or_default();
            (code, [(header::CONTENT_TYPE, "application/json")], format!("{body}\n")).into_response()
        }
        None => text(
            StatusCode::GATEWAY_TIMEOUT,
            format!("asked; no verdict within {}s (see the journal)\n", RELOAD_WAIT.as_secs()),
        ),
    }
}

pub mod client;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn livez_fails_once_the_loop_has_not_turned_for_a_few_seconds() {
        assert_eq!(live(Duration::from_millis(900), Phase::Ready), (StatusCode::OK, "ready\n".into()));
        assert_eq!(live(LIVE_STALE, Phase::Starting).0, StatusCode::OK);
        let (code, body) = live(Duration::from_secs(7), Phase::Ready);
        assert_eq!(code, StatusCode::SERVICE_UNAVAILABLE);
        assert_eq!(body, "ready: the loop has not turned for 7s\n");
        let beat = Heartbeat::default();
        beat.beat();
        assert!(beat.age() < LIVE_STALE);
    }

    #[test]
    fn the_token_is_compared_whole() {
        assert!(same(b"abc", b"abc"));
        assert!(!same(b"abc", b"abd"));
        assert!(!same(b"abc", b"abcd"));
        assert!(!same(b"", b"a"));
    }

    #[test]
    fn mutations_need_the_socket_or_the_token() {
        let mut h = HeaderMap::new();
        assert!(allowed(&Access::Local, &h));
        assert!(!allowed(&Access::Token(None), &h));
        let tcp = Access::Token(Some(Arc::from("s3cret")));
        assert!(!allowed(&tcp, &h));
        h.insert(header::AUTHORIZATION, "Bearer wrong".parse().unwrap());
        assert!(!allowed(&tcp, &h));
        h.insert(header::AUTHORIZATION, "Basic s3cret".parse().unwrap());
        assert!(!allowed(&tcp, &h));
        h.insert(header::AUTHORIZATION, "Bearer s3cret".parse().unwrap());
        assert!(allowed(&tcp, &h));
        assert!(!allowed(&Access::Token(None), &h));
    }

    #[test]
    fn the_connection_cap_is_a_share_of_a_low_descriptor_limit() {
        assert_eq!(Limits::for_nofile(u64::MAX).connections, MAX_CONNECTIONS);
        assert_eq!(Limits::for_nofile(65536).connections, MAX_CONNECTIONS);
        assert_eq!(Limits::for_nofile(256).connections, 32);
        assert_eq!(Limits::for_nofile(4).connections, 1, "never none");
        let per_peer = |nofile| Limits::for_nofile(nofile).per_peer;
        assert_eq!((per_peer(u64::MAX), per_peer(256), per_peer(4)), (16, 8, 1), "a quarter per peer, never none");
        let l = Limits::for_nofile(1024);
        assert_eq!((l.header_read, l.idle), (HEADER_READ_TIMEOUT, IDLE_TIMEOUT));
    }

    /// A router with one route that reads its body, for the idle timeout.
    fn sink() -> Router {
        Router::new().route("/sink", post(|body: String| async move { body.len().to_string() }))
    }

    /// Serve one connection of `app` over an in-memory pipe; the client's
    /// end, and the server's task.
    fn connect(app: Router) -> (tokio::io::DuplexStream, tokio::task::JoinHandle<()>) {
        connect_in(&Arc::new(conns::Table::default()), app)
    }

    /// [`connect`], its place in `table`.
    fn connect_in(table: &Arc<conns::Table>, app: Router) -> (tokio::io::DuplexStream, tokio::task::JoinHandle<()>) {
        let (client, server) = tokio::io::duplex(64 << 10);
        let (server, moved) = Watched::new(server);
        let limits = Limits::for_nofile(u64::MAX);
        let slot = table.admit(conns::Peer::Unknown, limits.per_peer, moved).slot;
        let task = tokio::spawn(serve_connection(server, app, limits, slot));
        (client, task)
    }

    /// Everything the server sends until it closes the connection (within
    /// a minute of the paused clock, which only moves when all waits).
    async fn read_to_close(c: &mut tokio::io::DuplexStream) -> String {
        use tokio::io::AsyncReadExt;
        let mut out = Vec::new();
        let read = tokio::time::timeout(Duration::from_secs(60), c.read_to_end(&mut out)).await;
        assert!(read.is_ok(), "the connection was never closed");
        String::from_utf8_lossy(&out).into_owned()
    }

    #[tokio::test(start_paused = true)]
    async fn a_connection_that_sends_no_request_or_half_a_head_is_closed_after_the_header_timeout() {
        use tokio::io::AsyncWriteExt;
        for sent in ["", "GET /livez HTTP/1.1\r\nHost: x\r\n"] {
            let began = tokio::time::Instant::now();
            let (mut c, task) = connect(sink());
            c.write_all(sent.as_bytes()).await.unwrap();
            read_to_close(&mut c).await;
            task.await.unwrap();
            let took = began.elapsed();
            assert!(
                took >= HEADER_READ_TIMEOUT && took < HEADER_READ_TIMEOUT + Duration::from_secs(1),
                "{sent:?}: {took:?}"
            );
        }
    }

    #[tokio::test(start_paused = true)]
    async fn a_kept_alive_connection_is_closed_once_no_next_request_comes() {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let (mut c, task) = connect(sink());
        c.write_all(b"POST /sink HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\n\r\nab").await.unwrap();
        let mut buf = vec![0u8; 4096];
        let n = c.read(&mut buf).await.unwrap();
        assert!(String::from_utf8_lossy(&buf[..n]).starts_with("HTTP/1.1 200"), "answered");
        let answered = tokio::time::Instant::now();
        read_to_close(&mut c).await;
        task.await.unwrap();
        let took = answered.elapsed();
        assert!(took >= HEADER_READ_TIMEOUT && took < HEADER_READ_TIMEOUT + Duration::from_secs(1), "{took:?}");
    }

    /// A body that stops coming is past the header timeout: the idle
    /// timeout closes the connection, counted from its last byte.
    #[tokio::test(start_paused = true)]
    async fn a_connection_whose_body_stops_coming_is_closed_when_idle() {
        use tokio::io::AsyncWriteExt;
        let (mut c, task) = connect(sink());
        c.write_all(b"POST /sink HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\nab").await.unwrap();
        tokio::time::sleep(IDLE_TIMEOUT / 2).await;
        c.write_all(b"cd").await.unwrap();
        let last_byte = tokio::time::Instant::now();
        let answer = read_to_close(&mut c).await;
        task.await.unwrap();
        let took = last_byte.elapsed();
        assert!(took >= IDLE_TIMEOUT && took < IDLE_TIMEOUT + Duration::from_secs(1), "{took:?}");
        assert!(!answer.contains("200"), "{answer}");
    }

    #[tokio::test(start_paused = true)]
    async fn a_head_beyond_the_budget_is_refused() {
        use tokio::io::AsyncWriteExt;
        let many: String = (0..MAX_HEADERS + 1).map(|i| format!("X-{i}: y\r\n")).collect();
        let large = format!("X-Large: {}\r\n", "y".repeat(MAX_BUF));
        for extra in [many, large] {
            let (mut c, task) = connect(sink());
            c.write_all(format!("GET /livez HTTP/1.1\r\nHost: x\r\n{extra}\r\n").as_bytes()).await.unwrap();
            let answer = read_to_close(&mut c).await;
            task.await.unwrap();
            assert!(answer.starts_with("HTTP/1.1 431"), "{answer}");
        }
    }

    /// One answer on a kept-alive connection: its head and body.
    async fn answer(c: &mut tokio::io::DuplexStream) -> String {
        use tokio::io::AsyncReadExt;
        let mut buf = vec![0u8; 4096];
        let n = c.read(&mut buf).await.unwrap();
        String::from_utf8_lossy(&buf[..n]).into_owned()
    }

    /// Told to make room between two requests, a kept-alive connection is
    /// closed at once, long before its header timeout.
    #[tokio::test(start_paused = true)]
    async fn a_kept_alive_connection_between_two_requests_makes_room_at_once() {
        use tokio::io::AsyncWriteExt;
        let table = Arc::new(conns::Table::default());
        let (mut c, task) = connect_in(&table, sink());
        assert!(!table.make_room(), "no request yet: it keeps its place");
        c.write_all(b"POST /sink HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\n\r\nab").await.unwrap();
        let first = answer(&mut c).await;
        assert!(first.starts_with("HTTP/1.1 200") && !first.contains("connection: close"), "{first}");
        let told = tokio::time::Instant::now();
        assert!(table.make_room());
        assert_eq!(read_to_close(&mut c).await, "", "closed with nothing more said");
        task.await.unwrap();
        assert_eq!(told.elapsed(), Duration::ZERO, "at once");
    }

    /// Told while a request is under way, the connection answers it, saying
    /// `Connection: close`, then closes.
    #[tokio::test(start_paused = true)]
    async fn a_connection_told_during_its_request_answers_it_then_closes() {
        use tokio::io::AsyncWriteExt;
        let table = Arc::new(conns::Table::default());
        let (mut c, task) = connect_in(&table, sink());
        // The head, and half the body: the request is under way once the
        // paused clock moves (the connection's task has read all it can).
        c.write_all(b"POST /sink HTTP/1.1\r\nHost: x\r\nContent-Length: 4\r\n\r\nab").await.unwrap();
        tokio::time::sleep(Duration::from_millis(10)).await;
        assert!(table.make_room(), "a request under way: it may make room");
        // The connection's task takes it before the rest of the body comes
        // (the paused clock moves only once every task waits).
        tokio::time::sleep(Duration::from_millis(10)).await;
        c.write_all(b"cd").await.unwrap();
        let answer = read_to_close(&mut c).await;
        task.await.unwrap();
        assert!(answer.starts_with("HTTP/1.1 200"), "{answer}");
        assert!(answer.contains("connection: close\r\n"), "{answer}");
        assert!(answer.ends_with("\r\n\r\n4"), "{answer}");
    }

    /// A peer at its cap whose connections have had no request: the one
    /// quiet the longest is closed at once for its new one, half a head
    /// sent or not.
    #[tokio::test(start_paused = true)]
    async fn a_connection_owed_no_answer_makes_room_at_once() {
        use tokio::io::AsyncWriteExt;
        let table = Arc::new(conns::Table::default());
        let (mut c, task) = connect_in(&table, sink());
        c.write_all(b"GET /livez HTTP/1.1\r\nHost: x\r\n").await.unwrap();
        tokio::time::sleep(Duration::from_millis(10)).await;
        let told = tokio::time::Instant::now();
        assert!(table.admit(conns::Peer::Unknown, 1, Moved::new()).made_room);
        assert_eq!(read_to_close(&mut c).await, "");
        task.await.unwrap();
        assert_eq!(told.elapsed(), Duration::ZERO, "at once");
    }

    #[test]
    fn a_token_file_must_hold_a_token_and_be_private() {
        use std::os::unix::fs::PermissionsExt;
        let dir = tempfile::tempdir().unwrap();
        let f = dir.path().join("token");
        std::fs::write(&f, "  s3cret\n").unwrap();
        std::fs::set_permissions(&f, std::fs::Permissions::from_mode(0o600)).unwrap();
        assert_eq!(read_token(&f).unwrap(), "s3cret");
        std::fs::set_permissions(&f, std::fs::Permissions::from_mode(0o644)).unwrap();
        assert!(matches!(read_token(&f), Err(TokenError::WorldReadable { .. })));
        std::fs::write(&f, "\n").unwrap();
        std::fs::set_permissions(&f, std::fs::Permissions::from_mode(0o600)).unwrap();
        assert!(matches!(read_token(&f), Err(TokenError::Empty { .. })));
        assert!(matches!(read_token(&dir.path().join("none")), Err(TokenError::Read { .. })));
    }
}
