//! An HTTP client over the unix socket, for the local commands.

use std::path::Path;

use http_body_util::{BodyExt, Empty};
use hyper::body::Bytes;
use hyper_util::rt::TokioIo;

/// Why a request got no answer.
#[derive(Debug, thiserror::Error)]
pub enum ClientError {
    /// No socket, or nothing listening on it: no warden runs.
    #[error("cannot connect to {path}: {source}")]
    Connect { path: String, source: std::io::Error },
    #[error("{0}")]
    Http(#[from] hyper::Error),
    #[error("{0}")]
    Request(#[from] hyper::http::Error),
    #[error("no answer within {0:?}")]
    Timeout(std::time::Duration),
}

/// The most an answer may hold.
const MAX_BODY: usize = 4 << 20;

/// `method path` over the socket; the status and the body (at most
/// 4 MiB, lossily UTF-8).
pub(crate) async fn call(socket: &Path, method: &str, path: &str) -> Result<(u16, String), ClientError> {
    let stream = tokio::net::UnixStream::connect(socket)
        .await
        .map_err(|source| ClientError::Connect { path: socket.display().to_string(), source })?;
    let (mut sender, conn) = hyper::client::conn::http1::handshake(TokioIo::new(stream)).await?;
    let conn = tokio::spawn(conn);
    let req = hyper::Request::builder()
        .method(method)
        .uri(path)
        .header(hyper::header::HOST, "localhost")
        .body(Empty::<Bytes>::new())?;
    let res = sender.send_request(req).await?;
    let code = res.status().as_u16();
    let body = http_body_util::Limited::new(res.into_body(), MAX_BODY).collect().await;
    conn.abort();
    let bytes = body.map(|b| b.to_bytes()).unwrap_or_default();
    Ok((code, String::from_utf8_lossy(&bytes).into_owned()))
}

/// [`call`] within `timeout`.
pub async fn call_within(
    socket: &Path,
    method: &str,
    path: &str,
    timeout: std::time::Duration,
) -> Result<(u16, String), ClientError> {
    tokio::time::timeout(timeout, call(socket, method, path)).await.map_err(|_| ClientError::Timeout(timeout))?
}
