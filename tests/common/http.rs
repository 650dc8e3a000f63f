//! The tests' HTTP client: the warden's own ([`vllm_warden::observe::health::client`],
//! reqwest), called from a test's thread, and a reader of streamed answers
//! (reqwest, its body chunk by chunk).

use std::time::Duration;

use hyper::body::Bytes;
use vllm_warden::observe::health::client::{self, Request};

/// The most a test reads of an answer.
const MAX_BODY: usize = 64 << 20;

/// A wait with no timeout of its own (a request left hanging on purpose).
pub const FOREVER: Duration = Duration::from_secs(365 * 86400);

/// A status and the body, lossily UTF-8.
#[derive(Debug)]
pub struct Answer {
    pub status: u16,
    pub body: String,
}

impl Answer {
    pub fn json(&self) -> serde_json::Value {
        serde_json::from_str(&self.body).unwrap_or_else(|e| panic!("{e}: {}", self.body))
    }
}

fn send(req: Request, timeout: Duration) -> Result<Answer, String> {
    let a = client::send_blocking(req.read(MAX_BODY), timeout).map_err(|e| e.to_string())?;
    Ok(Answer { status: a.status.as_u16(), body: String::from_utf8_lossy(&a.body).into_owned() })
}

/// `GET url`, the whole answer within `timeout`.
pub fn get(url: &str, timeout: Duration) -> Result<Answer, String> {
    send(Request::get(url), timeout)
}

/// `POST url` of a JSON document, the whole answer within `timeout`.
pub fn post_json(url: &str, body: &serde_json::Value, timeout: Duration) -> Result<Answer, String> {
    send(Request::post_json(url, body), timeout)
}

/// `POST url` with an empty body and, if given, a bearer token.
pub fn post(url: &str, token: Option<&str>, timeout: Duration) -> Result<Answer, String> {
    let mut req = Request::post_json(url, &serde_json::Value::Null);
    req.json = Some(Bytes::new());
    req.bearer = token.map(String::from);
    send(req, timeout)
}

/// `POST url` of a JSON document, its answer read line by line as it
/// streams (`on_line` for each), all within `timeout`; the status.
pub fn post_json_lines(
    url: &str,
    body: &serde_json::Value,
    timeout: Duration,
    mut on_line: impl FnMut(&str),
) -> Result<u16, String> {
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().map_err(|e| e.to_string())?;
    let streamed = async {
        let mut res = reqwest::Client::new()
            .post(url)
            .timeout(timeout)
            .header(reqwest::header::CONTENT_TYPE, "application/json")
            .body(body.to_string())
            .send()
            .await
            .map_err(|e| e.to_string())?;
        let (status, mut pending) = (res.status().as_u16(), Vec::new());
        while let Some(data) = res.chunk().await.map_err(|e| format!("the stream broke: {e}"))? {
            pending.extend_from_slice(&data);
            while let Some(n) = pending.iter().position(|b| *b == b'\n') {
                let line: Vec<u8> = pending.drain(..=n).collect();
                on_line(String::from_utf8_lossy(&line).trim_end_matches(['\r', '\n']));
            }
        }
        if !pending.is_empty() {
            on_line(&String::from_utf8_lossy(&pending));
        }
        Ok::<u16, String>(status)
    };
    let out = rt.block_on(streamed);
    rt.shutdown_background();
    out
}
