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

/// The HTTP client of the checks, on the server's stack (hyper): one
/// request on a new connection, under one overall timeout that covers the
/// connection, every redirect and the body read. As curl does, it follows
/// up to 10 redirects and an `http://` proxy named in the environment
/// (`ALL_PROXY`, `HTTPS_PROXY`, `HTTP_PROXY`, lower case too, `NO_PROXY`
/// honoured), through which it tunnels with `CONNECT`. Every status is an
/// answer, never an error.
pub mod client {
    use std::time::Duration;

    use http_body_util::{BodyExt, Full, Limited};
    use hyper::body::Bytes;
    use hyper::{Method, StatusCode, Uri, header};
    use hyper_util::rt::TokioIo;

    /// The most redirects followed.
    const MAX_REDIRECTS: u32 = 10;

    /// Why a request got no answer.
    #[derive(Debug, thiserror::Error)]
    pub enum Error {
        #[error("timeout: global")]
        Timeout,
        #[error("io: {0}")]
        Io(#[source] std::io::Error),
        #[error("protocol: {0}")]
        Http(#[source] hyper::Error),
        #[error("http: {0}")]
        Request(#[from] hyper::http::Error),
        #[error("bad uri: {0}")]
        BadUri(String),
        #[error("too many redirects")]
        TooManyRedirects,
        #[error("redirect failed")]
        RedirectFailed,
        #[error("the response body is larger than request limit: {0}")]
        BodyExceedsLimit(usize),
        #[error("CONNECT proxy failed: {0}")]
        ConnectProxyFailed(String),
        #[error("{0}")]
        Unsupported(String),
        #[error("json: {0}")]
        Json(#[from] serde_json::Error),
    }

    impl From<hyper::Error> for Error {
        fn from(e: hyper::Error) -> Error {
            Error::Http(e)
        }
    }

    /// A request: `GET` without a body, or `POST` of a JSON document.
    #[derive(Debug, Clone)]
    pub struct Request {
        pub method: Method,
        pub url: String,
        /// A JSON body (sent as `application/json; charset=utf-8`).
        pub json: Option<Bytes>,
        /// `Authorization: Bearer …`.
        pub bearer: Option<String>,
        /// How much of the body is read: `None`, none of it (the status is
        /// the answer); else at most this much, more is an error.
        pub read: Option<usize>,
    }

    impl Request {
        pub fn get(url: &str) -> Request {
            Request { method: Method::GET, url: url.to_string(), json: None, bearer: None, read: None }
        }

        pub fn post_json(url: &str, body: &serde_json::Value) -> Request {
            let json = Bytes::from(serde_json::to_vec(body).unwrap_or_default());
            Request { method: Method::POST, url: url.to_string(), json: Some(json), bearer: None, read: None }
        }

        /// Read the body, at most `limit` bytes of it.
        pub fn read(mut self, limit: usize) -> Request {
            self.read = Some(limit);
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
        pub fn json(&self) -> Result<serde_json::Value, Error> {
            Ok(serde_json::from_slice(&self.body)?)
        }
    }

    /// `req` within `timeout`, on the runtime of the caller.
    pub async fn send(req: Request, timeout: Duration) -> Result<Answer, Error> {
        tokio::time::timeout(timeout, follow(req)).await.map_err(|_| Error::Timeout)?
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

    /// `req`, and the redirects it meets.
    async fn follow(mut req: Request) -> Result<Answer, Error> {
        let mut uri: Uri = req.url.parse().map_err(|_| Error::BadUri(req.url.clone()))?;
        for _ in 0..=MAX_REDIRECTS {
            let answer = once(&req, &uri).await?;
            let location = answer.location.filter(|_| answer.answer.status.is_redirection());
            let Some(location) = location else { return Ok(answer.answer) };
            match answer.answer.status {
                StatusCode::TEMPORARY_REDIRECT | StatusCode::PERMANENT_REDIRECT if req.json.is_some() => {
                    return Err(Error::RedirectFailed);
                }
                StatusCode::TEMPORARY_REDIRECT | StatusCode::PERMANENT_REDIRECT => {}
                _ if req.method != Method::GET => {
                    req.method = Method::GET;
                    req.json = None;
                }
                _ => {}
            }
            uri = resolve(&uri, &location)?;
        }
        Err(Error::TooManyRedirects)
    }

    /// `location` read against the URI that answered with it.
    fn resolve(base: &Uri, location: &str) -> Result<Uri, Error> {
        let bad = || Error::BadUri(location.to_string());
        if location.contains("://") {
            return location.parse().map_err(|_| bad());
        }
        let (scheme, authority) = (base.scheme_str().unwrap_or("http"), base.authority().ok_or_else(bad)?);
        let path = match location {
            l if l.starts_with("//") => return format!("{scheme}:{l}").parse().map_err(|_| bad()),
            l if l.starts_with('/') => l.to_string(),
            l => {
                let dir = base.path().rsplit_once('/').map_or("", |(d, _)| d);
                format!("{dir}/{l}")
            }
        };
        format!("{scheme}://{authority}{path}").parse().map_err(|_| bad())
    }

    struct Once {
        answer: Answer,
        location: Option<String>,
    }

    /// One exchange on a new connection, direct or through the proxy.
    async fn once(req: &Request, uri: &Uri) -> Result<Once, Error> {
        if uri.scheme_str() != Some("http") {
            return Err(Error::Unsupported(format!("TLS required, but transport is unsecured: {uri}")));
        }
        let host = uri.host().ok_or_else(|| Error::BadUri(uri.to_string()))?;
        let port = uri.port_u16().unwrap_or(80);
        let authority = uri.authority().map_or_else(|| host.to_string(), |a| a.as_str().to_string());
        let path = uri.path_and_query().map_or("/", |p| p.as_str());
        let mut r = hyper::Request::builder()
            .method(req.method.clone())
            .uri(path)
            .header(header::HOST, &authority)
            .header(header::ACCEPT, "*/*");
        if let Some(token) = &req.bearer {
            r = r.header(header::AUTHORIZATION, format!("Bearer {token}"));
        }
        if req.json.is_some() {
            r = r.header(header::CONTENT_TYPE, "application/json; charset=utf-8");
        }
        let r = r.body(Full::new(req.json.clone().unwrap_or_default()))?;
        match proxy_for(host) {
            Some(proxy) => {
                let tunnel = proxy.tunnel(host, port).await?;
                exchange(tunnel, r, req.read).await
            }
            None => {
                let stream = connect(host.trim_start_matches('[').trim_end_matches(']'), port).await?;
                exchange(TokioIo::new(stream), r, req.read).await
            }
        }
    }

    async fn connect(host: &str, port: u16) -> Result<tokio::net::TcpStream, Error> {
        let stream = tokio::net::TcpStream::connect((host, port)).await.map_err(Error::Io)?;
        let _ = stream.set_nodelay(true);
        Ok(stream)
    }

    /// `req` on `io`; the connection is driven here, beside the request: no
    /// task of its own. Once it ends (the server closed it), the answer is
    /// in, or never.
    async fn exchange<I>(io: I, req: hyper::Request<Full<Bytes>>, read: Option<usize>) -> Result<Once, Error>
    where
        I: hyper::rt::Read + hyper::rt::Write + Unpin + Send + 'static,
    {
        let (mut sender, mut conn) = hyper::client::conn::http1::handshake(io).await?;
        let work = async move {
            let res = sender.send_request(req).await?;
            let (parts, body) = res.into_parts();
            let location = parts.headers.get(header::LOCATION).and_then(|l| l.to_str().ok()).map(String::from);
            let body = match read {
                None => Bytes::new(),
                Some(limit) => match Limited::new(body, limit).collect().await {
                    Ok(b) => b.to_bytes(),
                    Err(e) => match e.downcast::<hyper::Error>() {
                        Ok(e) => return Err(Error::Http(*e)),
                        Err(_) => return Err(Error::BodyExceedsLimit(limit)),
                    },
                },
            };
            Ok(Once { answer: Answer { status: parts.status, body }, location })
        };
        tokio::pin!(work);
        tokio::select! {
            biased;
            r = &mut work => r,
            _ = &mut conn => work.await,
        }
    }

    /// A proxy named in the environment, as curl and most clients read it.
    struct Proxy {
        host: String,
        port: u16,
        /// `user:password`, for `Proxy-Authorization: Basic`.
        user: Option<String>,
        scheme: String,
    }

    /// The proxy for `host`: the first of the variables that names one,
    /// unless `NO_PROXY` lists the host.
    fn proxy_for(host: &str) -> Option<Proxy> {
        const VARS: [&str; 6] = ["ALL_PROXY", "all_proxy", "HTTPS_PROXY", "https_proxy", "HTTP_PROXY", "http_proxy"];
        let proxy = VARS.iter().filter_map(|v| std::env::var(v).ok()).find_map(|v| Proxy::parse(&v))?;
        let no_proxy = ["NO_PROXY", "no_proxy"].iter().find_map(|v| std::env::var(v).ok());
        match no_proxy {
            Some(list) if list.split(',').any(|e| bypasses(e, host)) => None,
            _ => Some(proxy),
        }
    }

    /// Whether one `NO_PROXY` entry covers `host`: `*`, `*suffix`, `.suffix`,
    /// `prefix*`, `prefix.` or the host itself, case aside.
    fn bypasses(entry: &str, host: &str) -> bool {
        let host = host.to_ascii_lowercase();
        match entry {
            "*" => true,
            e if e.starts_with('*') => host.ends_with(&e[1..].to_ascii_lowercase()),
            e if e.starts_with('.') => host.ends_with(&e.to_ascii_lowercase()),
            e if e.ends_with('*') => host.starts_with(&e[..e.len() - 1].to_ascii_lowercase()),
            e if e.ends_with('.') => host.starts_with(&e.to_ascii_lowercase()),
            e => host == e.to_ascii_lowercase(),
        }
    }

    impl Proxy {
        fn parse(text: &str) -> Option<Proxy> {
            let with_scheme = if text.contains("://") { text.to_string() } else { format!("http://{text}") };
            let uri: Uri = with_scheme.parse().ok()?;
            let scheme = uri.scheme_str()?.to_ascii_lowercase();
            let port = match scheme.as_str() {
                "http" => 80,
                "https" => 443,
                "socks4" | "socks4a" | "socks5" | "socks5h" => 1080,
                _ => return None,
            };
            let authority = uri.authority()?.as_str();
            let user = authority.rsplit_once('@').map(|(u, _)| percent_decoded(u));
            Some(Proxy { host: uri.host()?.to_string(), port: uri.port_u16().unwrap_or(port), user, scheme })
        }

        /// A connection to `host:port` through the proxy (`CONNECT`).
        async fn tunnel(&self, host: &str, port: u16) -> Result<hyper::upgrade::Upgraded, Error> {
            if self.scheme != "http" {
                return Err(Error::Unsupported(format!("{} proxy not supported", self.scheme)));
            }
            let stream = connect(self.host.trim_start_matches('[').trim_end_matches(']'), self.port).await?;
            let (mut sender, conn) = hyper::client::conn::http1::handshake(TokioIo::new(stream)).await?;
            let target = format!("{host}:{port}");
            let mut r = hyper::Request::builder().method(Method::CONNECT).uri(&target).header(header::HOST, &target);
            if let Some(user) = &self.user {
                r = r.header(header::PROXY_AUTHORIZATION, format!("Basic {}", base64(user.as_bytes())));
            }
            let req = r.body(Full::new(Bytes::new()))?;
            let mut conn = conn.with_upgrades();
            let res = tokio::select! {
                biased;
                r = sender.send_request(req) => r?,
                r = &mut conn => return Err(Error::ConnectProxyFailed(match r {
                    Ok(()) => "the proxy closed the connection".into(),
                    Err(e) => e.to_string(),
                })),
            };
            if res.status() != StatusCode::OK {
                return Err(Error::ConnectProxyFailed(res.status().to_string()));
            }
            let (done, upgraded) = tokio::join!(conn, hyper::upgrade::on(res));
            done?;
            Ok(upgraded?)
        }
    }

    fn percent_decoded(s: &str) -> String {
        let b = s.as_bytes();
        let (mut out, mut i) = (Vec::with_capacity(b.len()), 0);
        while i < b.len() {
            let hex = b
                .get(i + 1..i + 3)
                .and_then(|h| std::str::from_utf8(h).ok())
                .and_then(|h| u8::from_str_radix(h, 16).ok());
            match (b[i], hex) {
                (b'%', Some(v)) => {
                    out.push(v);
                    i += 3;
                }
                (c, _) => {
                    out.push(c);
                    i += 1;
                }
            }
        }
        String::from_utf8_lossy(&out).into_owned()
    }

    fn base64(input: &[u8]) -> String {
        const A: &[u8; 64] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
        let mut out = String::with_capacity(input.len().div_ceil(3) * 4);
        for c in input.chunks(3) {
            let n = (c[0] as u32) << 16 | (*c.get(1).unwrap_or(&0) as u32) << 8 | *c.get(2).unwrap_or(&0) as u32;
            for i in 0..4 {
                out.push(if i <= c.len() { A[(n >> (18 - 6 * i)) as usize & 63] as char } else { '=' });
            }
        }
        out
    }

    #[cfg(test)]
    mod tests {
        use super::*;

        #[test]
        fn no_proxy_entries_read_as_curl_reads_them() {
            assert!(bypasses("*", "127.0.0.1"));
            assert!(bypasses("127.0.0.1", "127.0.0.1"));
            assert!(bypasses(".example.com", "api.EXAMPLE.com"));
            assert!(bypasses("*example.com", "example.com"));
            assert!(bypasses("127.", "127.0.0.1"));
            assert!(bypasses("10.*", "10.1.2.3"));
            assert!(!bypasses("localhost", "127.0.0.1"));
        }

        #[test]
        fn redirects_are_read_against_the_uri_that_answered() {
            let base: Uri = "http://127.0.0.1:8000/v1/health?x=1".parse().unwrap();
            assert_eq!(resolve(&base, "/ready").unwrap(), "http://127.0.0.1:8000/ready");
            assert_eq!(resolve(&base, "ready").unwrap(), "http://127.0.0.1:8000/v1/ready");
            assert_eq!(resolve(&base, "http://h:1/a").unwrap(), "http://h:1/a");
            assert_eq!(resolve(&base, "//h:2/b").unwrap(), "http://h:2/b");
        }

        #[test]
        fn proxy_credentials_are_sent_as_basic() {
            assert_eq!(base64(b"user:pa%ss"), "dXNlcjpwYSVzcw==");
            assert_eq!(base64(b"ab"), "YWI=");
            let p = Proxy::parse("http://us%40er:pw@proxy:3128").unwrap();
            assert_eq!((p.host.as_str(), p.port, p.user.as_deref()), ("proxy", 3128, Some("us@er:pw")));
            assert_eq!(Proxy::parse("proxy.local").unwrap().port, 80);
            assert!(Proxy::parse("ftp://x").is_none());
        }
    }
}

fn describe(e: &client::Error, timeout: Duration) -> String {
    match e {
        client::Error::Timeout => format!("no answer within {}", humantime::format_duration(timeout)),
        client::Error::Io(io) if io.kind() == std::io::ErrorKind::ConnectionRefused => "connection refused".into(),
        other => other.to_string(),
    }
}

fn status_text(code: hyper::StatusCode) -> String {
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
    fn of(e: &client::Error, timeout: Duration, what: &str) -> Miss {
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
fn shortage(e: &client::Error) -> Option<&'static str> {
    if let client::Error::Io(io) = e {
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
pub async fn check(url: &str, timeout: Duration) -> Result<(), Miss> {
    match client::send(client::Request::get(url), timeout).await {
        Ok(r) if r.status.is_success() => Ok(()),
        Ok(r) => Err(Miss::Server(status_text(r.status))),
        Err(e) => Err(Miss::of(&e, timeout, "")),
    }
}

/// The most `/v1/models` may hold.
const MAX_MODELS: usize = 10 << 20;

/// The first model the server lists.
async fn model(base: &str, timeout: Duration) -> Result<String, Miss> {
    let url = format!("{base}/v1/models");
    let r = client::send(client::Request::get(&url).read(MAX_MODELS), timeout).await;
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
    matches!(client::send(client::Request::get(url), timeout).await, Ok(r) if r.status == 200)
}

/// A one-token completion, from a thread outside the runtime; `Err` names
/// why it failed.
pub fn canary(base: &str, timeout: Duration) -> Result<(), String> {
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().map_err(|e| e.to_string())?;
    let done = rt.block_on(canary_checked(base, timeout)).map_err(|m| m.text().to_string());
    rt.shutdown_background();
    done
}

/// [`canary`], telling the server's failures from the warden's own.
async fn canary_checked(base: &str, timeout: Duration) -> Result<(), Miss> {
    let model = model(base, timeout).await.map_err(|m| match m {
        Miss::Server(t) => Miss::Server(format!("canary: {t}")),
        warden => warden,
    })?;
    let body = serde_json::json!({"model": model, "prompt": "Hello", "max_tokens": 1, "temperature": 0});
    match client::send(client::Request::post_json(&format!("{base}/v1/completions"), &body), timeout).await {
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

async fn scrape(base: &str, timeout: Duration) -> Scrape {
    let url = format!("{base}/metrics");
    match client::send(client::Request::get(&url).read(MAX_SCRAPE), timeout).await {
        Ok(r) if r.status.is_success() => match String::from_utf8(r.body.to_vec()) {
            Ok(text) => Scrape::Text(text),
            Err(_) => Scrape::Nothing,
        },
        Ok(r) if r.status == 404 => Scrape::NoEndpoint(format!("{base}/metrics: {}", status_text(r.status))),
        _ => Scrape::Nothing,
    }
}

/// The requests running or waiting on the server at `base`, from its
/// `/metrics`; `Err` says why there is no count.
pub fn in_flight(base: &str, timeout: Duration) -> Result<f64, String> {
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().map_err(|e| e.to_string())?;
    let scraped = rt.block_on(scrape(base, timeout));
    rt.shutdown_background();
    match scraped {
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
            result = check(&url, h.timeout).await;
        }
        let now = tokio::time::Instant::now();
        if result.is_ok()
            && let Some(w) = progress.as_mut()
        {
            let off = match scrape(&spec.base, h.timeout).await {
                Scrape::Text(text) => match crate::supervisor::progress::read(&text) {
                    Ok(reading) => {
                        if let Some(cause) = w.observe(reading, now).cause() {
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
                result = canary_checked(&spec.base, h.canary_timeout).await;
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
    #[tokio::test]
    async fn the_wardens_own_shortage_is_not_the_servers_failure() {
        let t = Duration::from_secs(1);
        let io = |n| client::Error::Io(std::io::Error::from_raw_os_error(n));
        assert!(
            matches!(Miss::of(&io(libc::EMFILE), t, ""), Miss::Warden(w) if w.starts_with("the warden is out of file descriptors ("))
        );
        assert!(
            matches!(Miss::of(&io(libc::ENOMEM), t, ""), Miss::Warden(w) if w.starts_with("the warden is out of memory"))
        );
        assert_eq!(Miss::of(&io(libc::ECONNREFUSED), t, "canary: "), Miss::Server("canary: connection refused".into()));
        // Nothing listens: the server's failure.
        let gone = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap();
        assert_eq!(check(&format!("http://{gone}/health"), t).await, Err(Miss::Server("connection refused".into())));
    }

    /// The timeout holds for a server that takes the connection and never
    /// answers; the body limits hold for an answer too long.
    #[tokio::test]
    async fn the_timeouts_and_limits_hold() {
        let silent = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = silent.local_addr().unwrap();
        let t = Duration::from_millis(200);
        assert_eq!(
            check(&format!("http://{addr}/health"), t).await,
            Err(Miss::Server("no answer within 200ms".into()))
        );
        let body = " ".repeat(MAX_MODELS + 1);
        let big = answering(format!("HTTP/1.1 200 OK\r\ncontent-length: {}\r\n\r\n{body}", body.len()));
        let said = model(&format!("http://{big}"), Duration::from_secs(10)).await;
        assert_eq!(
            said,
            Err(Miss::Server("/v1/models: the response body is larger than request limit: 10485760".into()))
        );
        assert!(matches!(scrape(&format!("http://{big}"), Duration::from_secs(10)).await, Scrape::Nothing));
    }

    #[test]
    fn traffic_is_remembered_for_a_while() {
        let t = Traffic::default();
        assert!(!t.seen_within(Duration::from_secs(60)));
        t.saw_generation();
        assert!(t.seen_within(Duration::from_secs(60)));
    }
}
