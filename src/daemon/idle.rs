//! An idle engine at run time (`front.idle-stop`): vLLM's sleep mode asked
//! and confirmed on the engine's private socket, and what follows an idle
//! stop (the files the tree left, the GPUs looked at). The machine decides
//! when (`supervisor/machine/idle.rs`); the loop reads the front door's
//! requests (`daemon::front::Activity`).

use std::time::Duration;

use crate::config::Settings;
use crate::observe::health::{Api, client};

/// vLLM serves `/sleep`, `/wake_up` and `/is_sleeping` only with this set
/// to `1` in its environment.
pub(crate) const DEV_MODE: &str = "VLLM_SERVER_DEV_MODE";

/// The warden puts this instance's idle engine to sleep.
pub(crate) fn sleeps(s: &Settings) -> bool {
    s.front.as_ref().is_some_and(crate::config::Front::sleeps)
}

/// How long a sleep or a wake may take: moving the weights to host memory
/// and back is a load without reading the files, so a load's stall bound.
pub(crate) fn request_timeout(s: &Settings) -> Duration {
    s.ready.stall.max(Duration::from_secs(30))
}

/// The most `/is_sleeping` may hold.
const MAX_ANSWER: usize = 64 << 10;

/// `POST path` on the engine: a 2xx, or why not.
async fn post(api: &Api, path: &str, timeout: Duration) -> Result<(), String> {
    let url = api.url(path);
    let mut req = api.get(&url).read(MAX_ANSWER);
    req.method = hyper::Method::POST;
    match client::send(req, timeout).await {
        Ok(r) if r.status.is_success() => Ok(()),
        Ok(r) => {
            let said = crate::util::escape::one_line(&String::from_utf8_lossy(&r.body), 200);
            Err(format!(
                "{path}: HTTP {}{}",
                r.status.as_u16(),
                if said.is_empty() { String::new() } else { format!(": {said}") }
            ))
        }
        Err(e) => Err(format!("{path}: {e}")),
    }
}

/// What `GET /is_sleeping` says.
async fn is_sleeping(api: &Api, timeout: Duration) -> Result<bool, String> {
    let url = api.url("/is_sleeping");
    let r = client::send(api.get(&url).read(MAX_ANSWER), timeout).await.map_err(|e| format!("/is_sleeping: {e}"))?;
    if !r.status.is_success() {
        return Err(format!("/is_sleeping: HTTP {}", r.status.as_u16()));
    }
    let v = r.json().map_err(|e| format!("/is_sleeping: {e}"))?;
    v["is_sleeping"].as_bool().ok_or_else(|| "/is_sleeping: no `is_sleeping` in the answer".to_string())
}

/// Put the engine to sleep at `level`, and see that it says it sleeps.
pub(crate) async fn sleep(api: &Api, level: u8, timeout: Duration) -> Result<(), String> {
    post(api, &format!("/sleep?level={level}"), timeout).await?;
    match is_sleeping(api, timeout).await? {
        true => Ok(()),
        false => Err("/is_sleeping says it is awake after /sleep".into()),
    }
}

/// Wake the engine, and see that it says it is awake.
pub(crate) async fn wake(api: &Api, timeout: Duration) -> Result<(), String> {
    post(api, "/wake_up", timeout).await?;
    match is_sleeping(api, timeout).await? {
        false => Ok(()),
        true => Err("/is_sleeping says it still sleeps after /wake_up".into()),
    }
}

/// After an idle stop, as after any stop: what the tree left in `/dev/shm`
/// and the temporary folders goes, and the GPUs are looked at (a process
/// that still holds them is said, since the next start will wait for it).
pub(crate) async fn parked(s: Settings) {
    let name = s.name.clone();
    let cleaned = s.clone();
    let _ = tokio::task::spawn_blocking(move || crate::daemon::prepare::clean_leftover_files(&cleaned)).await;
    let query = &s.prestart.gpu_query;
    if query.is_empty() {
        return;
    }
    let found = crate::process::prestart::query_gpus(query, crate::supervisor::policy::COMMAND_TIMEOUT).await;
    match found.map(|apps| apps.map(crate::process::preload::without_daemon)) {
        Ok(Some(apps)) if apps.is_empty() => {
            tracing::info!(INSTANCE = name.as_str(), EVENT = "idle", "the GPUs are free");
        }
        Ok(Some(apps)) => tracing::warn!(
            INSTANCE = name.as_str(),
            EVENT = "idle",
            "GPU compute processes are still there after the idle stop: {}",
            crate::process::prestart::describe_gpu_apps(&apps)
        ),
        Ok(None) => {}
        Err(crate::process::prestart::QueryError::Failed(e) | crate::process::prestart::QueryError::TimedOut(e)) => {
            tracing::warn!(INSTANCE = name.as_str(), EVENT = "idle", "the GPUs could not be looked at: {e}")
        }
    }
}
