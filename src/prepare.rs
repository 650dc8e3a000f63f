//! The steps before every start, in the order the specification gives:
//! leftovers of an earlier warden, patches, shared memory (and vLLM's files
//! in the temporary folders), the port, the GPUs. Each step is shown through
//! `status` (`STATUS=`); a step that cannot be satisfied fails the start with
//! a cause naming what is in the way.

use std::time::Duration;

use tokio::time::Instant;

use crate::config::Settings;
use crate::outcome::StartFailure;
use crate::prestart;

/// First wait between two looks at the port or the GPUs; doubled up to
/// [`MAX_RETRY`].
const FIRST_RETRY: Duration = Duration::from_millis(50);
const MAX_RETRY: Duration = Duration::from_secs(2);

/// Run the steps; an `Err` fails the start.
pub async fn run(s: &Settings, status: &(dyn Fn(String) + Sync)) -> Result<(), StartFailure> {
    let name = s.name.as_str();

    // 1. Leftovers of an earlier warden of this instance.
    let left = prestart::leftovers(&s.state_dir);
    if !left.is_empty() {
        let pids: Vec<String> = left.iter().map(|p| format!("{} {}", p.pid, prestart::cmdline(p.pid))).collect();
        let text = format!("stopping {} leftover process(es) of an earlier run: {}", left.len(), pids.join(", "));
        tracing::warn!(INSTANCE = name, EVENT = "leftovers", "{text}");
        status(text);
        prestart::stop_leftovers(&left, s.child.stop_signal, s.child.stop_timeout).await;
    }
    prestart::clear_record(&s.state_dir);

    // 2. Patches. A patch that fails will fail the same way next time.
    if !s.patches.is_empty() {
        status(format!("applying {} patch(es)", s.patches.len()));
        let applied = crate::patch::apply(&s.patches, &s.state_dir)
            .map_err(|e| StartFailure::permanent(format!("patch failed: {e}")))?;
        for a in applied {
            tracing::info!(INSTANCE = name, EVENT = "patch", "{a}");
        }
    }

    // 3. Shared memory, and vLLM's files in the temporary folders.
    status("cleaning /dev/shm".into());
    clean_leftover_files(s);

    // 4. The port.
    let port = s.prestart.port;
    if !prestart::port_free(port) {
        let holders = prestart::describe_holders(port);
        status(format!("waiting up to {}: {holders}", humantime::format_duration(s.prestart.port_wait)));
        if !wait_until(s.prestart.port_wait, || async move { prestart::port_free(port) }).await {
            return Err(StartFailure::transient(prestart::describe_holders(port)));
        }
    }

    // 5. The GPUs.
    if !s.prestart.gpu_idle_wait.is_zero() && !s.prestart.gpu_query.is_empty() {
        let query = &s.prestart.gpu_query;
        match prestart::query_gpus(query).await {
            Ok(None) => {
                tracing::info!(INSTANCE = name, EVENT = "gpus", "{} not found: GPU check skipped", query[0]);
            }
            Err(e) => tracing::warn!(INSTANCE = name, EVENT = "gpus", "GPU check skipped: {e}"),
            Ok(Some(apps)) if apps.is_empty() => {}
            Ok(Some(apps)) => {
                let wait = s.prestart.gpu_idle_wait;
                status(format!(
                    "waiting up to {} for GPU compute processes to exit: {}",
                    humantime::format_duration(wait),
                    prestart::describe_gpu_apps(&apps)
                ));
                let idle = wait_until(wait, || async {
                    matches!(prestart::query_gpus(query).await, Ok(Some(a)) if a.is_empty())
                })
                .await;
                if !idle {
                    let now = match prestart::query_gpus(query).await {
                        Ok(Some(a)) if !a.is_empty() => a,
                        _ => apps,
                    };
                    let busy = prestart::describe_gpu_apps(&now);
                    let wait = humantime::format_duration(wait);
                    return Err(StartFailure::transient(format!("GPUs still busy after {wait}: {busy}")));
                }
            }
        }
    }
    Ok(())
}

/// Remove what crashed runs leave behind and nobody uses any more: the
/// `clean-shm` entries of `/dev/shm`, and the profile's files in the
/// temporary folders (see `prestart::clean` for the rule). Logs what was
/// removed and what was kept, and why.
pub fn clean_leftover_files(s: &Settings) {
    let uid = nix::unistd::geteuid().as_raw();
    let mut folders: Vec<(std::path::PathBuf, Vec<String>)> = Vec::new();
    if !s.prestart.clean_shm.is_empty() {
        folders.push(("/dev/shm".into(), s.prestart.clean_shm.clone()));
    }
    let temp = s.profile.temp_globs();
    if !temp.is_empty() {
        folders.extend(prestart::temp_dirs().into_iter().map(|d| (d, temp.clone())));
    }
    for (dir, globs) in folders.iter().filter(|(d, _)| d.is_dir()) {
        let report = prestart::clean(dir, globs, uid, &prestart::in_use_under(dir));
        if report != prestart::Cleaned::default() {
            tracing::info!(INSTANCE = s.name.as_str(), EVENT = "clean", "{}: {}", dir.display(), report.describe());
        }
    }
}

/// Look again with a growing delay until `ready` or `limit` passes.
async fn wait_until<F, Fut>(limit: Duration, mut ready: F) -> bool
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = bool>,
{
    let deadline = Instant::now() + limit;
    let mut delay = FIRST_RETRY;
    loop {
        if ready().await {
            return true;
        }
        let now = Instant::now();
        if now >= deadline {
            return false;
        }
        tokio::time::sleep(delay.min(deadline - now)).await;
        delay = (delay * 2).min(MAX_RETRY);
    }
}
