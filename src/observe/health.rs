//! Liveness after ready: `GET health.http` every `interval`, and, when
//! `canary-interval` is set, a one-token completion, because vLLM's
//! `/health` answers 200 while a wedged engine serves nothing. The state
//! machine is not known here: after `failures` failed checks in a row the
//! watcher reports one cause line and ends. A check the warden itself could
//! not make (out of descriptors or memory) is said as such and counts
//! neither way: the child is never blamed for the warden's shortage.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use regex::Regex;

use crate::config::Settings;

/// Where the engine's HTTP API is, as the warden's clients reach it: its
/// base URL, and for an engine on a unix socket (vLLM's `--uds`, under
/// `[front]`) the socket its URLs are connected through. The one rule: a
/// URL of the base (`http://localhost/...` for a unix engine) goes through
/// the socket; any other URL (an operator's own `ready.http` elsewhere) is
/// connected as it is written.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Api {
    /// `http://127.0.0.1:<port>`, or `http://localhost` for a unix engine.
    pub(crate) base: String,
    pub(crate) socket: Option<std::path::PathBuf>,
}

impl Api {
    /// The engine's API as the settings place it; an engine that serves no
    /// HTTP (a Ray node) is given the default port, which nothing asks.
    pub(crate) fn of(s: &Settings) -> Api {
        match &s.engine {
            Some(e) => Api::engine(e),
            None => Api::tcp(format!("http://127.0.0.1:{}", s.prestart.port.unwrap_or(crate::config::defaults::PORT))),
        }
    }

    pub(crate) fn engine(e: &crate::config::Engine) -> Api {
        let socket = match e {
            crate::config::Engine::Unix(path) => Some(path.clone()),
            crate::config::Engine::Loopback(_) => None,
        };
        Api { base: crate::config::engine_base(e), socket }
    }

    /// A server on TCP at `base` (`http://HOST:PORT`).
    pub(crate) fn tcp(base: impl Into<String>) -> Api {
        Api { base: base.into(), socket: None }
    }

    /// `path` (beginning with `/`) on the engine.
    pub(crate) fn url(&self, path: &str) -> String {
        format!("{}{path}", self.base)
    }

    /// `GET url`, through the engine's socket when `url` is the engine's.
    pub(crate) fn get(&self, url: &str) -> client::Request {
        client::Request::get(url).via(self.route(url))
    }

    /// `POST url` of a JSON document, routed as [`Api::get`].
    pub(crate) fn post_json(&self, url: &str, body: &serde_json::Value) -> client::Request {
        client::Request::post_json(url, body).via(self.route(url))
    }

    /// The socket `url` goes through: the engine's, for a URL of its base.
    pub(crate) fn route(&self, url: &str) -> Option<&std::path::Path> {
        let socket = self.socket.as_deref()?;
        let rest = url.strip_prefix(&self.base)?;
        (rest.is_empty() || rest.starts_with('/') || rest.starts_with('?')).then_some(socket)
    }
}

/// What to check: `[health]`, and where the server's API is.
#[derive(Debug, Clone)]
pub(crate) struct Spec {
    pub(crate) health: crate::config::Health,
    /// The engine's API, for `/v1/models`, `/v1/completions`, `/metrics`.
    pub(crate) api: Api,
}

impl Spec {
    pub(crate) fn from_settings(s: &Settings) -> Spec {
        Spec { health: s.health.clone(), api: Api::of(s) }
    }

    pub(crate) fn enabled(&self) -> bool {
        self.health.http.is_some() || !self.health.canary_interval.is_zero() || !self.health.progress_stall.is_zero()
    }
}

/// When the child last showed that its engine generates tokens (vLLM's
/// periodic `Avg generation throughput: N tokens/s` line with N > 0), in
/// milliseconds since the epoch; 0 = never. Set from the log, read by the
/// canary, which does not add a request while real traffic visibly flows.
#[derive(Debug, Clone, Default)]
pub(crate) struct Traffic(Arc<AtomicU64>);

impl Traffic {
    pub(crate) fn saw_generation(&self) {
        let ms = SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_millis() as u64);
        self.0.store(ms, Ordering::Relaxed);
    }

    fn seen_within(&self, d: Duration) -> bool {
        let last = self.0.load(Ordering::Relaxed);
        let now = SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_millis() as u64);
        last != 0 && now.saturating_sub(last) <= d.as_millis() as u64
    }
}

/// Recognises vLLM's throughput line with tokens generated.
pub(crate) struct GenerationLine(Regex);

impl Default for GenerationLine {
    fn default() -> Self {
        GenerationLine(Regex::new(r"Avg generation throughput: ([0-9.]+) tokens/s").expect("static regex"))
    }
}

impl GenerationLine {
    pub(crate) fn matches(&self, line: &str) -> bool {
        self.0.captures(line).and_then(|c| c[1].parse::<f64>().ok()).is_some_and(|x| x > 0.0)
    }
}

/// The HTTP client of the checks: reqwest, on the server's own stack
/// (hyper, hyper-util). One request under one overall timeout that covers
/// the connection, every redirect and the body read, on a connection of its
/// own: none is kept for the next request, as the runtimes the requests run
/// on come and go. Redirects are reqwest's: up to 10 followed. Every status
/// is an answer, never an error.
///
/// Proxies are reqwest's reading of the environment, made once, when the
/// client is first built: for these `http://` URLs, `HTTP_PROXY` (or
/// `http_proxy`), else `ALL_PROXY` (or `all_proxy`), to which the request
/// is forwarded; none for a host that `NO_PROXY` (or `no_proxy`) lists (a
/// name and its subdomains, an address, a network, or `*`); none at all
/// when `REQUEST_METHOD` is set, as under CGI. `HTTPS_PROXY` is only for
/// `https://`, which this client, built without TLS, does not speak.
pub mod client {
    use std::sync::OnceLock;
    use std::time::Duration;

    use hyper::body::Bytes;
    use hyper::{Method, StatusCode, header};

    /// Why a request got no answer.
    #[derive(Debug, thiserror::Error)]
    pub enum Error {
        #[error("timeout: global")]
        Timeout,
        #[error("io: {0}")]
        Io(#[source] std::io::Error),
        #[error("{}", causes(.0))]
        Http(#[source] reqwest::Error),
        #[error("the response body is larger than request limit: {0}")]
        BodyExceedsLimit(usize),
        #[error("json: {0}")]
        Json(#[from] serde_json::Error),
    }

    impl From<reqwest::Error> for Error {
        fn from(e: reqwest::Error) -> Error {
            if e.is_timeout() { Error::Timeout } else { Error::Http(e) }
        }
    }

    /// `e` and what it came of, as one line: reqwest names the request, the
    /// errors below it say what went wrong.
    fn causes(e: &reqwest::Error) -> String {
        let mut line = e.to_string();
        let mut source = std::error::Error::source(e);
        while let Some(s) = source {
            let text = s.to_string();
            if !line.contains(&text) {
                line = format!("{line}: {text}");
            }
            source = s.source();
        }
        line
    }

    /// A request: `GET` without a body, or `POST` of a JSON document.
    #[derive(Debug, Clone)]
    pub struct Request {
        pub(crate) method: Method,
        pub(crate) url: String,
        /// A JSON body (sent as `application/json; charset=utf-8`).
        pub json: Option<Bytes>,
        /// `Authorization: Bearer …`.
        pub bearer: Option<String>,
        /// How much of the body is read: `None`, none of it (the status is
        /// the answer); else at most this much, more is an error.
        pub(crate) read: Option<usize>,
        /// The unix socket the request is connected through (the URL's host
        /// is then only its `Host:`); `None`: TCP to the URL's host.
        pub(crate) socket: Option<std::path::PathBuf>,
    }

    impl Request {
        pub fn get(url: &str) -> Request {
            Request { method: Method::GET, url: url.to_string(), json: None, bearer: None, read: None, socket: None }
        }

        pub fn post_json(url: &str, body: &serde_json::Value) -> Request {
            let json = Bytes::from(serde_json::to_vec(body).unwrap_or_default());
            Request {
                method: Method::POST,
                url: url.to_string(),
                json: Some(json),
                bearer: None,
                read: None,
                socket: None,
            }
        }

        /// Read the body, at most `limit` bytes of it.
        pub fn read(mut self, limit: usize) -> Request {
            self.read = Some(limit);
            self
        }

        /// Connected through the unix socket `socket`, when one is given.
        pub(crate) fn via(mut self, socket: Option<&std::path::Path>) -> Request {
            self.socket = socket.map(std::path::Path::to_path_buf);
            self
        }
    }

    /// A status and the body read (empty when none was asked for).
    #[derive(Debug)]
    pub struct Answer {
        pub status: StatusCode,
        pub body: Bytes,
    }

    impl Answer {
        pub(crate) fn json(&self) -> Result<serde_json::Value, Error> {
            Ok(serde_json::from_slice(&self.body)?)
        }
    }

    /// The one client, built on first use; a failed build is tried again
    /// by the next request.
    fn shared() -> Result<&'static reqwest::Client, Error> {
        static CLIENT: OnceLock<reqwest::Client> = OnceLock::new();
        if let Some(c) = CLIENT.get() {
            return Ok(c);
        }
        let built = reqwest::Client::builder().pool_max_idle_per_host(0).build()?;
        Ok(CLIENT.get_or_init(|| built))
    }

    /// The client of one unix socket, built on first use and kept: a
    /// warden reaches one engine's socket, whose path does not change
    /// while it runs. No proxy is asked: the socket is the destination.
    fn through(socket: &std::path::Path) -> Result<reqwest::Client, Error> {
        use std::collections::HashMap;
        use std::sync::Mutex;
        static CLIENTS: OnceLock<Mutex<HashMap<std::path::PathBuf, reqwest::Client>>> = OnceLock::new();
        let mut clients = CLIENTS.get_or_init(Mutex::default).lock().unwrap_or_else(|e| e.into_inner());
        if let Some(c) = clients.get(socket) {
            return Ok(c.clone());
        }
        let built = reqwest::Client::builder().pool_max_idle_per_host(0).no_proxy().unix_socket(socket).build()?;
        clients.insert(socket.to_path_buf(), built.clone());
        Ok(built)
    }

    /// `req` within `timeout`, on the runtime of the caller.
    pub(crate) async fn send(req: Request, timeout: Duration) -> Result<Answer, Error> {
        let client = match &req.socket {
            Some(socket) => through(socket)?,
            None => shared()?.clone(),
        };
        let mut r = client.request(req.method, &req.url).timeout(timeout);
        if let Some(token) = &req.bearer {
            r = r.bearer_auth(token);
        }
        if let Some(json) = req.json {
            r = r.header(header::CONTENT_TYPE, "application/json; charset=utf-8").body(json);
        }
        let mut res = r.send().await?;
        let status = res.status();
        let Some(limit) = req.read else { return Ok(Answer { status, body: Bytes::new() }) };
        if res.content_length().is_some_and(|n| n > limit as u64) {
            return Err(Error::BodyExceedsLimit(limit));
        }
        // Chunk by chunk, under the same timeout, stopping past the limit.
        let mut body = Vec::new();
        while let Some(chunk) = res.chunk().await? {
            if body.len() + chunk.len() > limit {
                return Err(Error::BodyExceedsLimit(limit));
            }
            body.extend_from_slice(&chunk);
        }
        Ok(Answer { status, body: Bytes::from(body) })
    }

    /// [`send`] from a thread outside any runtime: on a runtime of its own,
    /// one thread, gone with the answer.
    pub fn send_blocking(req: Request, timeout: Duration) -> Result<Answer, Error> {
        let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().map_err(Error::Io)?;
        let answer = rt.block_on(send(req, timeout));
        // A name lookup still running on the blocking pool is not waited for.
        rt.shutdown_background();
        answer
    }
}

/// The operating system's errors behind `e`: in it and the errors it came of.
fn io_errors(e: &client::Error) -> impl Iterator<Item = &std::io::Error> {
    std::iter::successors(Some(e as &(dyn std::error::Error + 'static)), |s| s.source())
        .filter_map(|s| s.downcast_ref::<std::io::Error>())
}

fn describe(e: &client::Error, timeout: Duration) -> String {
    match e {
        client::Error::Timeout => format!("no answer within {}", humantime::format_duration(timeout)),
        e if io_errors(e).any(|io| io.kind() == std::io::ErrorKind::ConnectionRefused) => "connection refused".into(),
        other => other.to_string(),
    }
}

fn status_text(code: hyper::StatusCode) -> String {
    format!("{} {}", code.as_u16(), code.canonical_reason().unwrap_or(""))
}

/// Why a check did not pass.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Miss {
    /// The server failed it: counted against the child.
    Server(String),
    /// The warden could not make it (out of descriptors or memory): said,
    /// never counted against the child.
    Warden(String),
}

impl Miss {
    /// A failed request: the warden's own shortage when the error is one
    /// (see [`crate::util::errno::own_shortage`]), else the server's failure.
    fn of(e: &client::Error, timeout: Duration, what: &str) -> Miss {
        if let Some(why) = shortage(e) {
            return Miss::Warden(format!("{why} ({})", e));
        }
        Miss::Server(format!("{what}{}", describe(e, timeout)))
    }

    pub(crate) fn text(&self) -> &str {
        match self {
            Miss::Server(t) | Miss::Warden(t) => t,
        }
    }
}

/// The warden's own shortage behind a request's error, if that is what it is.
fn shortage(e: &client::Error) -> Option<&'static str> {
    io_errors(e).find_map(crate::util::errno::own_shortage)
}

/// One `GET`; `Err` names why it failed.
#[cfg(test)]
pub(crate) async fn check(url: &str, timeout: Duration) -> Result<(), Miss> {
    check_request(client::Request::get(url), timeout).await
}

/// One request made already (a `GET`, routed through the engine's socket
/// or not); `Err` names why it failed.
pub(crate) async fn check_request(req: client::Request, timeout: Duration) -> Result<(), Miss> {
    match client::send(req, timeout).await {
        Ok(r) if r.status.is_success() => Ok(()),
        Ok(r) => Err(Miss::Server(status_text(r.status))),
        Err(e) => Err(Miss::of(&e, timeout, "")),
    }
}

/// The most `/v1/models` may hold.
const MAX_MODELS: usize = 10 << 20;

/// The first model the server lists.
async fn model(api: &Api, timeout: Duration) -> Result<String, Miss> {
    let url = api.url("/v1/models");
    let r = client::send(api.get(&url).read(MAX_MODELS), timeout).await;
    let r = r.map_err(|e| match e {
        client::Error::BodyExceedsLimit(_) => Miss::Server(format!("/v1/models: {e}")),
        e => Miss::of(&e, timeout, ""),
    })?;
    if !r.status.is_success() {
        return Err(Miss::Server(format!("/v1/models: {}", status_text(r.status))));
    }
    let v = r.json().map_err(|e| Miss::Server(format!("/v1/models: {e}")))?;
    v["data"][0]["id"].as_str().map(String::from).ok_or_else(|| Miss::Server("/v1/models lists no model".into()))
}

/// True when `GET url` answers 200 within `timeout` (readiness), from a
/// thread outside the runtime.
pub fn http_ok(url: &str, timeout: Duration) -> bool {
    matches!(client::send_blocking(client::Request::get(url), timeout), Ok(r) if r.status == 200)
}

/// [`http_ok`] on the runtime's own thread, for the readiness check the
/// loop waits on.
pub async fn http_ok_async(url: &str, timeout: Duration) -> bool {
    request_ok(client::Request::get(url), timeout).await
}

/// [`http_ok_async`] of a request made already (routed through the
/// engine's socket).
pub(crate) async fn request_ok(req: client::Request, timeout: Duration) -> bool {
    matches!(client::send(req, timeout).await, Ok(r) if r.status == 200)
}

/// Why the canary or the count of requests in flight has no answer.
#[derive(Debug, thiserror::Error)]
pub enum CheckError {
    /// The check's own runtime could not be made.
    #[error("{0}")]
    Runtime(#[from] std::io::Error),
    /// The canary failed; the text says why, the server's failure or the
    /// warden's own.
    #[error("{0}")]
    Canary(String),
    /// The server has no metrics endpoint.
    #[error("{0}")]
    NoMetrics(String),
    #[error("{base}/metrics did not answer")]
    Silent { base: String },
    #[error("{0}")]
    Unreadable(#[from] crate::supervisor::progress::Unreadable),
}

/// A one-token completion, from a thread outside the runtime; `Err` names
/// why it failed.
pub fn canary(base: &str, timeout: Duration) -> Result<(), CheckError> {
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build()?;
    let done =
        rt.block_on(canary_checked(&Api::tcp(base), timeout)).map_err(|m| CheckError::Canary(m.text().to_string()));
    rt.shutdown_background();
    done
}

/// [`canary`], telling the server's failures from the warden's own.
async fn canary_checked(api: &Api, timeout: Duration) -> Result<(), Miss> {
    let model = model(api, timeout).await.map_err(|m| match m {
        Miss::Server(t) => Miss::Server(format!("canary: {t}")),
        warden => warden,
    })?;
    let body = serde_json::json!({"model": model, "prompt": "Hello", "max_tokens": 1, "temperature": 0});
    match client::send(api.post_json(&api.url("/v1/completions"), &body), timeout).await {
        Ok(r) if r.status.is_success() => Ok(()),
        Ok(r) => Err(Miss::Server(format!("canary: {}", status_text(r.status)))),
        Err(client::Error::Timeout) => {
            Err(Miss::Server(format!("canary: no completion within {}", humantime::format_duration(timeout))))
        }
        Err(e) => Err(Miss::of(&e, timeout, "canary: ")),
    }
}

/// What a scrape of the server's `/metrics` gave.
enum Scrape {
    Text(String),
    /// The server has no metrics endpoint: the check is off.
    NoEndpoint(String),
    /// No answer this time (a timeout, a refused connection): no verdict.
    Nothing,
}

/// The most a scrape may hold; vLLM's is tens of kilobytes.
const MAX_SCRAPE: usize = 8 << 20;

async fn scrape(api: &Api, timeout: Duration) -> Scrape {
    let url = api.url("/metrics");
    match client::send(api.get(&url).read(MAX_SCRAPE), timeout).await {
        Ok(r) if r.status.is_success() => match String::from_utf8(r.body.to_vec()) {
            Ok(text) => Scrape::Text(text),
            Err(_) => Scrape::Nothing,
        },
        Ok(r) if r.status == 404 => Scrape::NoEndpoint(format!("{url}: {}", status_text(r.status))),
        _ => Scrape::Nothing,
    }
}

/// The requests running or waiting on the server at `api`, from its
/// `/metrics`; `Err` says why there is no count.
pub(crate) async fn in_flight(api: &Api, timeout: Duration) -> Result<f64, CheckError> {
    let base = &api.base;
    match scrape(api, timeout).await {
        Scrape::Text(text) => Ok(crate::supervisor::progress::in_flight(&text)?),
        Scrape::NoEndpoint(why) => Err(CheckError::NoMetrics(why)),
        Scrape::Nothing => Err(CheckError::Silent { base: base.to_string() }),
    }
}

/// Whether the last health check of the ready run passed, for `/readyz`.
#[derive(Debug, Clone)]
pub struct LastCheck(Arc<std::sync::atomic::AtomicBool>);

impl Default for LastCheck {
    fn default() -> Self {
        LastCheck(Arc::new(std::sync::atomic::AtomicBool::new(true)))
    }
}

impl LastCheck {
    pub(crate) fn set(&self, passed: bool) {
        self.0.store(passed, Ordering::Relaxed);
    }

    pub(crate) fn passed(&self) -> bool {
        self.0.load(Ordering::Relaxed)
    }
}

/// Check until `h.failures` checks in a row have failed, or the server's
/// metrics show a stalled engine; returns the cause line.
pub(crate) async fn watch(spec: Spec, traffic: Traffic, last: LastCheck) -> String {
    let h = &spec.health;
    let mut failed = 0;
    let mut next_canary = tokio::time::Instant::now() + h.canary_interval;
    let mut progress = (!h.progress_stall.is_zero()).then(|| crate::supervisor::progress::Watch::new(h.progress_stall));
    loop {
        tokio::time::sleep(h.interval).await;
        let mut result = Ok(());
        // Which check a failure is counted against in the metrics.
        let mut kind = crate::observe::facts::Check::Health;
        if let Some(url) = h.http.clone() {
            result = check_request(spec.api.get(&url), h.timeout).await;
        }
        let now = tokio::time::Instant::now();
        if result.is_ok()
            && let Some(w) = progress.as_mut()
        {
            let off = match scrape(&spec.api, h.timeout).await {
                Scrape::Text(text) => match crate::supervisor::progress::read(&text) {
                    Ok(reading) => {
                        if let Some(cause) = w.observe(reading, crate::util::clock::ToCore::to_core(now)).cause() {
                            crate::observe::facts::check_failed(crate::observe::facts::Check::Progress);
                            return cause;
                        }
                        None
                    }
                    Err(e) => Some(e.to_string()),
                },
                Scrape::NoEndpoint(why) => Some(why),
                Scrape::Nothing => None,
            };
            if let Some(why) = off {
                tracing::info!(EVENT = "health", "progress check off: {why}");
                progress = None;
            }
        }
        if result.is_ok() && !h.canary_interval.is_zero() && now >= next_canary {
            next_canary = now + h.canary_interval;
            // Requests in flight: the progress check judges the engine.
            let busy = progress.as_ref().is_some_and(crate::supervisor::progress::Watch::busy);
            if !traffic.seen_within(h.canary_interval) && !busy {
                result = canary_checked(&spec.api, h.canary_timeout).await;
                kind = crate::observe::facts::Check::Canary;
            }
        }
        match result {
            Ok(()) => {
                failed = 0;
                last.set(true);
            }
            // Neither a pass nor a failure: the server was not asked. The
            // count and `/readyz` stay as they were.
            Err(Miss::Warden(why)) => {
                tracing::warn!(
                    EVENT = "warden-resources",
                    "health check not made: {why}; not counted against the child"
                );
            }
            Err(Miss::Server(why)) => {
                last.set(false);
                failed += 1;
                crate::observe::facts::check_failed(kind);
                tracing::warn!(EVENT = "health", "check failed ({failed} of {}): {why}", h.failures);
                if failed >= h.failures {
                    return format!("health check failed {failed} times: {why}");
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn generation_lines_are_recognised() {
        let g = GenerationLine::default();
        let line = "(APIServer pid=1) INFO 11-29 18:11:16 [loggers.py:248] Engine 000: Avg prompt throughput: 12.0 tokens/s, Avg generation throughput: 48.3 tokens/s, Running: 2 reqs";
        assert!(g.matches(line));
        assert!(!g.matches(&line.replace("48.3", "0.0")));
        assert!(!g.matches("INFO:     Application startup complete."));
    }

    /// A server that answers every connection with `answer`; its address.
    fn answering(answer: String) -> std::net::SocketAddr {
        use std::io::{Read, Write};
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = l.local_addr().unwrap();
        std::thread::spawn(move || {
            for mut c in l.incoming().flatten() {
                let mut buf = [0u8; 4096];
                let _ = c.read(&mut buf);
                let _ = c.write_all(answer.as_bytes());
            }
        });
        addr
    }

    /// The readiness check asked on the runtime's thread agrees with the
    /// blocking one: 200 is ready, another status or no server is not, a
    /// redirect is followed.
    #[tokio::test]
    async fn the_async_readiness_check_answers_as_the_blocking_one() {
        let ok = answering("HTTP/1.1 200 OK\r\ncontent-length: 0\r\n\r\n".into());
        let down = answering("HTTP/1.1 503 Service Unavailable\r\ncontent-length: 0\r\n\r\n".into());
        let moved =
            answering(format!("HTTP/1.1 302 Found\r\nlocation: http://{ok}/health\r\ncontent-length: 0\r\n\r\n"));
        let gone = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap();
        let t = Duration::from_secs(5);
        for (addr, want) in [(ok, true), (down, false), (moved, true), (gone, false)] {
            let url = format!("http://{addr}/health");
            assert_eq!(http_ok_async(&url, t).await, want, "{url}");
            assert_eq!(tokio::task::spawn_blocking(move || http_ok(&url, t)).await.unwrap(), want);
        }
    }

    /// A server that sends `head` on every connection and then holds it,
    /// saying no more; its address.
    fn stalling(head: String) -> std::net::SocketAddr {
        use std::io::{Read, Write};
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = l.local_addr().unwrap();
        std::thread::spawn(move || {
            let mut held = Vec::new();
            for mut c in l.incoming().flatten() {
                let mut buf = [0u8; 4096];
                let _ = c.read(&mut buf);
                let _ = c.write_all(head.as_bytes());
                held.push(c);
            }
        });
        addr
    }

    /// A check the warden could not make for want of descriptors or
    /// memory is the warden's miss, never the server's failure; a server
    /// that is not there is the server's. The descriptors run out in a
    /// process of its own: this test's binary, running this test alone.
    #[test]
    fn the_wardens_own_shortage_is_not_the_servers_failure() {
        use std::os::fd::AsRawFd;
        const OUT_OF_DESCRIPTORS: &str = "VLLM_WARDEN_TEST_OUT_OF_DESCRIPTORS";
        let t = Duration::from_secs(1);
        let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
        // Nothing listens: the server's failure.
        let gone = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap();
        let url = format!("http://{gone}/health");
        assert_eq!(rt.block_on(check(&url, t)), Err(Miss::Server("connection refused".into())));
        let canary = rt.block_on(canary_checked(&Api::tcp(format!("http://{gone}")), t));
        assert_eq!(canary, Err(Miss::Server("canary: connection refused".into())));
        if std::env::var_os(OUT_OF_DESCRIPTORS).is_some() {
            // The soft limit at the lowest free number: no new one fits.
            let lowest_free = std::fs::File::open("/dev/null").unwrap().as_raw_fd() as libc::rlim_t;
            let mut lim = libc::rlimit { rlim_cur: 0, rlim_max: 0 };
            // SAFETY: this process's own limit, with a struct we own.
            unsafe {
                assert_eq!(libc::getrlimit(libc::RLIMIT_NOFILE, &mut lim), 0);
                lim.rlim_cur = lowest_free;
                assert_eq!(libc::setrlimit(libc::RLIMIT_NOFILE, &lim), 0);
            }
            let miss = rt.block_on(check(&url, t));
            println!("{OUT_OF_DESCRIPTORS} {miss:?}");
            return;
        }
        let module = module_path!().split_once("::").map_or(module_path!(), |(_, m)| m);
        let this = format!("{module}::the_wardens_own_shortage_is_not_the_servers_failure");
        let out = std::process::Command::new(std::env::current_exe().unwrap())
            .args([this.as_str(), "--exact", "--nocapture", "--test-threads=1"])
            .env(OUT_OF_DESCRIPTORS, "1")
            .output()
            .unwrap();
        let said = String::from_utf8_lossy(&out.stdout);
        let miss = said.lines().find_map(|l| l.split_once(OUT_OF_DESCRIPTORS).map(|(_, m)| m));
        assert!(
            miss.is_some_and(|m| m.starts_with(" Err(Warden(\"the warden is out of file descriptors (")),
            "{said}{}",
            String::from_utf8_lossy(&out.stderr)
        );
        // The runtime of a blocking check could not be made.
        let io = |n| client::Error::Io(std::io::Error::from_raw_os_error(n));
        assert!(
            matches!(Miss::of(&io(libc::ENOMEM), t, ""), Miss::Warden(w) if w.starts_with("the warden is out of memory ("))
        );
    }

    /// The timeout holds for a server that takes the connection and never
    /// answers, and for one that stops halfway through the body; the body
    /// limits hold for an answer too long, its length said or not.
    #[tokio::test]
    async fn the_timeouts_and_limits_hold() {
        let silent = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = silent.local_addr().unwrap();
        let t = Duration::from_millis(200);
        assert_eq!(
            check(&format!("http://{addr}/health"), t).await,
            Err(Miss::Server("no answer within 200ms".into()))
        );
        let halfway = stalling("HTTP/1.1 200 OK\r\ncontent-length: 100\r\n\r\n{\"data\": [".into());
        assert_eq!(
            model(&Api::tcp(format!("http://{halfway}")), t).await,
            Err(Miss::Server("no answer within 200ms".into()))
        );
        let body = " ".repeat(MAX_MODELS + 1);
        let said = answering(format!("HTTP/1.1 200 OK\r\ncontent-length: {}\r\n\r\n{body}", body.len()));
        let unsaid = answering(format!("HTTP/1.1 200 OK\r\nconnection: close\r\n\r\n{body}"));
        for big in [said, unsaid] {
            assert_eq!(
                model(&Api::tcp(format!("http://{big}")), Duration::from_secs(10)).await,
                Err(Miss::Server("/v1/models: the response body is larger than request limit: 10485760".into()))
            );
            assert!(matches!(
                scrape(&Api::tcp(format!("http://{big}")), Duration::from_secs(10)).await,
                Scrape::Nothing
            ));
        }
    }

    #[test]
    fn traffic_is_remembered_for_a_while() {
        let t = Traffic::default();
        assert!(!t.seen_within(Duration::from_secs(60)));
        t.saw_generation();
        assert!(t.seen_within(Duration::from_secs(60)));
    }
}
