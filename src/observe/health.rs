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

/// What to check: `[health]`, and where the server's API is.
#[derive(Debug, Clone)]
pub struct Spec {
    pub health: crate::config::Health,
    /// `http://127.0.0.1:<port>`, for `/v1/models` and `/v1/completions`.
    pub base: String,
}

impl Spec {
    pub fn from_settings(s: &Settings) -> Spec {
        let port = s.prestart.port.unwrap_or(crate::config::defaults::PORT);
        Spec { health: s.health.clone(), base: format!("http://127.0.0.1:{port}") }
    }

    pub fn enabled(&self) -> bool {
        self.health.http.is_some() || !self.health.canary_interval.is_zero() || !self.health.progress_stall.is_zero()
    }
}

/// When the child last showed that its engine generates tokens (vLLM's
/// periodic `Avg generation throughput: N tokens/s` line with N > 0), in
/// milliseconds since the epoch; 0 = never. Set from the log, read by the
/// canary, which does not add a request while real traffic visibly flows.
#[derive(Debug, Clone, Default)]
pub struct Traffic(Arc<AtomicU64>);

impl Traffic {
    pub fn saw_generation(&self) {
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
pub struct GenerationLine(Regex);

impl Default for GenerationLine {
    fn default() -> Self {
        GenerationLine(Regex::new(r"Avg generation throughput: ([0-9.]+) tokens/s").expect("static regex"))
    }
}

impl GenerationLine {
    pub fn matches(&self, line: &str) -> bool {
        self.0.captures(line).and_then(|c| c[1].parse::<f64>().ok()).is_some_and(|x| x > 0.0)
    }
}

fn agent(timeout: Duration) -> ureq::Agent {
    ureq::Agent::config_builder().timeout_global(Some(timeout)).http_status_as_error(false).build().into()
}

fn describe(e: &ureq::Error, timeout: Duration) -> String {
    match e {
        ureq::Error::Timeout(_) => format!("no answer within {}", humantime::format_duration(timeout)),
        ureq::Error::Io(io) if io.kind() == std::io::ErrorKind::ConnectionRefused => "connection refused".into(),
        other => other.to_string(),
    }
}

fn status_text(code: ureq::http::StatusCode) -> String {
    format!("{} {}", code.as_u16(), code.canonical_reason().unwrap_or(""))
}

/// Why a check did not pass.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Miss {
    /// The server failed it: counted against the child.
    Server(String),
    /// The warden could not make it (out of descriptors or memory): said,
    /// never counted against the child.
    Warden(String),
}

impl Miss {
    /// A failed request: the warden's own shortage when the error is one
    /// (see [`crate::util::errno::own_shortage`]), else the server's failure.
    fn of(e: &ureq::Error, timeout: Duration, what: &str) -> Miss {
        if let Some(why) = shortage(e) {
            return Miss::Warden(format!("{why} ({})", e));
        }
        Miss::Server(format!("{what}{}", describe(e, timeout)))
    }

    pub fn text(&self) -> &str {
        match self {
            Miss::Server(t) | Miss::Warden(t) => t,
        }
    }
}

/// The warden's own shortage behind a request's error, if that is what it is.
fn shortage(e: &ureq::Error) -> Option<&'static str> {
    if let ureq::Error::Io(io) = e {
        return crate::util::errno::own_shortage(io);
    }
    let mut source = std::error::Error::source(e);
    while let Some(s) = source {
        if let Some(why) = s.downcast_ref::<std::io::Error>().and_then(crate::util::errno::own_shortage) {
            return Some(why);
        }
        source = s.source();
    }
    None
}

/// One `GET`; `Err` names why it failed.
pub fn check(url: &str, timeout: Duration) -> Result<(), Miss> {
    match agent(timeout).get(url).call() {
        Ok(r) if r.status().is_success() => Ok(()),
        Ok(r) => Err(Miss::Server(status_text(r.status()))),
        Err(e) => Err(Miss::of(&e, timeout, "")),
    }
}

/// The first model the server lists.
fn model(base: &str, timeout: Duration) -> Result<String, Miss> {
    let mut r = agent(timeout).get(&format!("{base}/v1/models")).call().map_err(|e| Miss::of(&e, timeout, ""))?;
    if !r.status().is_success() {
        return Err(Miss::Server(format!("/v1/models: {}", status_text(r.status()))));
    }
    let v: serde_json::Value = r.body_mut().read_json().map_err(|e| Miss::Server(format!("/v1/models: {e}")))?;
    v["data"][0]["id"].as_str().map(String::from).ok_or_else(|| Miss::Server("/v1/models lists no model".into()))
}

/// True when `GET url` answers 200 within `timeout` (readiness).
pub fn http_ok(url: &str, timeout: Duration) -> bool {
    matches!(agent(timeout).get(url).call(), Ok(r) if r.status() == 200)
}

/// [`http_ok`] without a thread of its own, for the readiness check the
/// loop waits on: a plain `http://` URL is asked on the runtime's own
/// thread; a redirect, another scheme or a proxy in the environment goes
/// to [`http_ok`] on the blocking pool, which follows them as before.
pub async fn http_ok_async(url: &str, timeout: Duration) -> bool {
    const PROXIES: [&str; 6] = ["ALL_PROXY", "all_proxy", "HTTPS_PROXY", "https_proxy", "HTTP_PROXY", "http_proxy"];
    let direct = url.starts_with("http://") && !PROXIES.iter().any(|v| std::env::var_os(v).is_some());
    let status = match direct {
        true => tokio::time::timeout(timeout, status_of(url)).await.ok().flatten(),
        false => None,
    };
    match status {
        Some(code) => code == 200 || ((300..400).contains(&code) && blocking_ok(url, timeout).await),
        None if direct => false,
        None => blocking_ok(url, timeout).await,
    }
}

async fn blocking_ok(url: &str, timeout: Duration) -> bool {
    let u = url.to_string();
    tokio::task::spawn_blocking(move || http_ok(&u, timeout)).await.unwrap_or(false)
}

/// The status of `GET url` (`http://`), one request on a new connection.
async fn status_of(url: &str) -> Option<u16> {
    use http_body_util::Empty;
    use hyper::body::Bytes;
    let uri: hyper::Uri = url.parse().ok()?;
    let host = uri.host()?.trim_start_matches('[').trim_end_matches(']');
    let stream = tokio::net::TcpStream::connect((host, uri.port_u16().unwrap_or(80))).await.ok()?;
    let _ = stream.set_nodelay(true);
    let (mut sender, mut conn) =
        hyper::client::conn::http1::handshake(hyper_util::rt::TokioIo::new(stream)).await.ok()?;
    let path = uri.path_and_query().map_or("/", |p| p.as_str());
    let authority = uri.authority()?.as_str();
    let req = hyper::Request::get(path).header(hyper::header::HOST, authority).body(Empty::<Bytes>::new()).ok()?;
    // The connection is driven here, beside the request: no task of its
    // own. Once it ends (the server closed it), the answer is in, or never.
    let res = sender.send_request(req);
    tokio::pin!(res);
    let res = tokio::select! {
        biased;
        res = &mut res => res,
        _ = &mut conn => res.await,
    };
    res.ok().map(|r| r.status().as_u16())
}

/// A one-token completion; `Err` names why it failed.
pub fn canary(base: &str, timeout: Duration) -> Result<(), String> {
    canary_checked(base, timeout).map_err(|m| m.text().to_string())
}

/// [`canary`], telling the server's failures from the warden's own.
fn canary_checked(base: &str, timeout: Duration) -> Result<(), Miss> {
    let model = model(base, timeout).map_err(|m| match m {
        Miss::Server(t) => Miss::Server(format!("canary: {t}")),
        warden => warden,
    })?;
    let body = serde_json::json!({"model": model, "prompt": "Hello", "max_tokens": 1, "temperature": 0});
    match agent(timeout).post(&format!("{base}/v1/completions")).send_json(&body) {
        Ok(r) if r.status().is_success() => Ok(()),
        Ok(r) => Err(Miss::Server(format!("canary: {}", status_text(r.status())))),
        Err(ureq::Error::Timeout(_)) => {
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
const MAX_SCRAPE: u64 = 8 << 20;

fn scrape(base: &str, timeout: Duration) -> Scrape {
    match agent(timeout).get(&format!("{base}/metrics")).call() {
        Ok(mut r) if r.status().is_success() => match r.body_mut().with_config().limit(MAX_SCRAPE).read_to_string() {
            Ok(text) => Scrape::Text(text),
            Err(_) => Scrape::Nothing,
        },
        Ok(r) if r.status() == 404 => Scrape::NoEndpoint(format!("{base}/metrics: {}", status_text(r.status()))),
        _ => Scrape::Nothing,
    }
}

/// The requests running or waiting on the server at `base`, from its
/// `/metrics`; `Err` says why there is no count.
pub fn in_flight(base: &str, timeout: Duration) -> Result<f64, String> {
    match scrape(base, timeout) {
        Scrape::Text(text) => crate::supervisor::progress::in_flight(&text).map_err(|e| e.to_string()),
        Scrape::NoEndpoint(why) => Err(why),
        Scrape::Nothing => Err(format!("{base}/metrics did not answer")),
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
    pub fn set(&self, passed: bool) {
        self.0.store(passed, Ordering::Relaxed);
    }

    pub fn passed(&self) -> bool {
        self.0.load(Ordering::Relaxed)
    }
}

/// Check until `h.failures` checks in a row have failed, or the server's
/// metrics show a stalled engine; returns the cause line.
pub async fn watch(spec: Spec, traffic: Traffic, last: LastCheck) -> String {
    let h = &spec.health;
    let mut failed = 0;
    let mut next_canary = tokio::time::Instant::now() + h.canary_interval;
    let mut progress = (!h.progress_stall.is_zero()).then(|| crate::supervisor::progress::Watch::new(h.progress_stall));
    loop {
        tokio::time::sleep(h.interval).await;
        let mut result = Ok(());
        if let Some(url) = h.http.clone() {
            let t = h.timeout;
            result = tokio::task::spawn_blocking(move || check(&url, t))
                .await
                .unwrap_or_else(|e| Err(Miss::Server(e.to_string())));
        }
        let now = tokio::time::Instant::now();
        if result.is_ok()
            && let Some(w) = progress.as_mut()
        {
            let (base, t) = (spec.base.clone(), h.timeout);
            let off = match tokio::task::spawn_blocking(move || scrape(&base, t)).await {
                Ok(Scrape::Text(text)) => match crate::supervisor::progress::read(&text) {
                    Ok(reading) => {
                        if let Some(cause) = w.observe(reading, now).cause() {
                            return cause;
                        }
                        None
                    }
                    Err(e) => Some(e.to_string()),
                },
                Ok(Scrape::NoEndpoint(why)) => Some(why),
                Ok(Scrape::Nothing) | Err(_) => None,
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
                let (base, t) = (spec.base.clone(), h.canary_timeout);
                result = tokio::task::spawn_blocking(move || canary_checked(&base, t))
                    .await
                    .unwrap_or_else(|e| Err(Miss::Server(e.to_string())));
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

    /// A check the warden could not make for want of descriptors or
    /// memory is the warden's miss, never the server's failure.
    #[test]
    fn the_wardens_own_shortage_is_not_the_servers_failure() {
        let t = Duration::from_secs(1);
        let io = |n| ureq::Error::Io(std::io::Error::from_raw_os_error(n));
        assert!(
            matches!(Miss::of(&io(libc::EMFILE), t, ""), Miss::Warden(w) if w.starts_with("the warden is out of file descriptors ("))
        );
        assert!(
            matches!(Miss::of(&io(libc::ENOMEM), t, ""), Miss::Warden(w) if w.starts_with("the warden is out of memory"))
        );
        assert_eq!(Miss::of(&io(libc::ECONNREFUSED), t, "canary: "), Miss::Server("canary: connection refused".into()));
        // Nothing listens: the server's failure.
        let gone = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap();
        assert!(matches!(check(&format!("http://{gone}/health"), t), Err(Miss::Server(_))));
    }

    #[test]
    fn traffic_is_remembered_for_a_while() {
        let t = Traffic::default();
        assert!(!t.seen_within(Duration::from_secs(60)));
        t.saw_generation();
        assert!(t.seen_within(Duration::from_secs(60)));
    }
}
