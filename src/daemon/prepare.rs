//! The steps before every start, in the order the specification gives:
//! leftovers of an earlier warden (and, after an upgrade whose state was
//! refused, the predecessor's run found in the warden's own tree), patches,
//! shared memory (and vLLM's files in the temporary folders), the engine's
//! private socket folder (`[front]`: 0700, the last socket gone), the port, the
//! GPUs. Each step is shown through `status` (`STATUS=`); a step that cannot
//! be satisfied fails the start with a cause naming what is in the way.

use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use tokio::time::Instant;

use crate::config::Settings;
use crate::process::prestart::{self, QueryError};
use crate::supervisor::outcome::StartFailure;
use crate::supervisor::policy::{COMMAND_TIMEOUT, KILL_GRACE};

/// First wait between two looks at the port or the GPUs; doubled up to
/// [`MAX_RETRY`].
const FIRST_RETRY: Duration = Duration::from_millis(50);
const MAX_RETRY: Duration = Duration::from_secs(2);

/// Run `f` on tokio's blocking pool: `/proc` scans and file work never run
/// on the loop's thread. A panic in `f` is this task's panic.
async fn off_loop<T: Send + 'static>(f: impl FnOnce() -> T + Send + 'static) -> T {
    match tokio::task::spawn_blocking(f).await {
        Ok(v) => v,
        Err(e) => std::panic::resume_unwind(e.into_panic()),
    }
}

/// Shows a step in `STATUS=`; callable from any thread.
pub(crate) type Status = std::sync::Arc<dyn Fn(String) + Send + Sync>;

/// Steps 1 to 4 up to their waits, in one visit to the blocking pool (each
/// visit is a thread hand-off, which a loaded machine makes slow): the
/// leftovers found (to be stopped, then this is called again), or the
/// record cleared, the patches applied, the folders cleaned and whether the
/// port is free.
fn blocking_steps(
    s: &Settings,
    status: &Status,
    look_for_leftovers: bool,
    inherited: bool,
) -> Result<Blocking, StartFailure> {
    let name = s.name.as_str();
    // 1. Leftovers of an earlier warden of this instance.
    if look_for_leftovers {
        let mut left = prestart::leftovers(&s.state_dir, &s.name);
        if inherited {
            for p in prestart::inherited_tree() {
                if !left.iter().any(|l| l.pid == p.pid) {
                    left.push(p);
                }
            }
        }
        if !left.is_empty() {
            let shown: Vec<String> = left.iter().map(|p| format!("{} {}", p.pid, prestart::cmdline(p.pid))).collect();
            return Ok(Blocking::Leftovers(left, shown));
        }
    }
    prestart::clear_record(&s.state_dir);

    // 2. Patches. A patch that fails will fail the same way next time,
    // unless another run held the lock or a file changed meanwhile.
    if !s.patches.is_empty() {
        let n = s.patches.len();
        status(format!("applying {n} patch{}", if n == 1 { "" } else { "es" }));
        let applied = crate::patch::apply(&s.patches, &s.state_dir, crate::patch::Wait::No).map_err(|e| {
            let cause = format!("patch failed: {e}");
            if e.is_transient() { StartFailure::transient(cause) } else { StartFailure::permanent(cause) }
        })?;
        for a in applied {
            tracing::info!(INSTANCE = name, EVENT = "patch", "{a}");
        }
    }

    // 3. Shared memory, and vLLM's files in the temporary folders.
    status("cleaning /dev/shm".into());
    clean_leftover_files(s);

    // The child's program, model and the folders it writes, made, and the
    // last run's sockets gone: what would kill the start after a load is
    // a failure now, naming the path, the uid and the fix.
    let writes = crate::process::caches::of(s);
    crate::process::caches::prepare(&writes, &s.server.socket).map_err(|e| StartFailure::permanent(e.to_string()))?;
    let fixed_by_config = crate::daemon::environment::program_problems(s)
        .into_iter()
        .chain(crate::process::caches::problems(&writes).0)
        .next();
    if let Some(problem) = fixed_by_config {
        return Err(StartFailure::permanent(problem));
    }
    // A model that is not there yet (a mount) may come: worth a retry.
    if let Some(problem) = crate::daemon::environment::model_problems(s).into_iter().next() {
        return Err(StartFailure::transient(problem));
    }

    // The engine's private socket (`[front]`): its folder the warden's
    // own, 0700, the last run's socket gone. A folder that is a symlink or
    // someone else's is not fixed by waiting.
    if let Some(crate::config::Engine::Unix(socket)) = &s.engine {
        prestart::engine_folder(socket).map_err(|e| StartFailure::permanent(e.to_string()))?;
    }

    // 4. The port, at first sight. An engine on a unix socket holds none
    // (the front door may listen on the command's port itself).
    let port = s.prestart.port.filter(|_| !matches!(s.engine, Some(crate::config::Engine::Unix(_))));
    Ok(match port.map(|port| (port, prestart::look_at_port(port))) {
        None | Some((_, prestart::Port::Free)) => Blocking::PortFree,
        Some((port, prestart::Port::Held)) => Blocking::PortHeld(port, prestart::describe_holders(port)),
        // The warden's own shortage may pass: waited for as a held port.
        Some((port, prestart::Port::Unknown(e))) if crate::util::errno::own_shortage(&e).is_some() => {
            Blocking::PortHeld(port, prestart::describe_port_error(port, &e))
        }
        // Permission denied and the like: waiting changes nothing.
        Some((port, prestart::Port::Unknown(e))) => {
            return Err(StartFailure::transient(prestart::describe_port_error(port, &e)));
        }
    })
}

enum Blocking {
    Leftovers(Vec<crate::process::child::ProcStat>, Vec<String>),
    PortFree,
    /// Held, by whom.
    PortHeld(u16, String),
}

/// Run the steps; an `Err` fails the start. The leftovers of an earlier
/// warden are looked for until `leftovers_done` is set, which is done here
/// once none is left: later starts of this warden follow the end of its own
/// tree, of which nothing survives (the warden is its subreaper and saw it
/// gone), and no other warden of the instance can have run meanwhile (the
/// lock). `inherited`: this warden was exec'd by an upgrading predecessor
/// whose run it did not take over; the processes of its own tree are that
/// run's, and leftovers too.
pub(crate) async fn run(
    s: &Settings,
    status: Status,
    leftovers_done: Arc<AtomicBool>,
    inherited: bool,
) -> Result<(), StartFailure> {
    let name = s.name.as_str();
    let (settings, st) = (s.clone(), status.clone());
    let look = !leftovers_done.load(Ordering::SeqCst);
    let mut seen = off_loop(move || blocking_steps(&settings, &st, look, inherited)).await?;
    if let Blocking::Leftovers(left, shown) = &seen {
        waits();
        let text = format!("stopping {} leftover process(es) of an earlier run: {}", left.len(), shown.join(", "));
        tracing::warn!(INSTANCE = name, EVENT = "leftovers", "{text}");
        status(text);
        prestart::stop_leftovers(left, s.child.stop_signal, s.child.stop_timeout, KILL_GRACE)
            .await
            .map_err(|e| StartFailure::transient(e.to_string()))?;
        let (settings, st) = (s.clone(), status.clone());
        seen = off_loop(move || blocking_steps(&settings, &st, false, false)).await?;
    }
    leftovers_done.store(true, Ordering::SeqCst);

    // 4. The port: wait while it is held.
    if let Blocking::PortHeld(port, holders) = seen {
        waits();
        status(format!("waiting up to {}: {holders}", humantime::format_duration(s.prestart.port_wait)));
        if !wait_until(s.prestart.port_wait, || off_loop(move || prestart::port_free(port))).await {
            let why = off_loop(move || prestart::port_blocker(port)).await;
            return Err(StartFailure::transient(why.unwrap_or_else(|| prestart::describe_holders(port))));
        }
    }

    // 5. The GPUs.
    if !s.prestart.gpu_idle_wait.is_zero() && !s.prestart.gpu_query.is_empty() {
        let query = &s.prestart.gpu_query;
        // The weight-cache daemon holds the GPUs on purpose.
        let ask = || async {
            Ok(prestart::query_gpus(query, COMMAND_TIMEOUT).await?.map(crate::process::preload::without_daemon))
        };
        status(format!("checking the GPUs ({})", crate::util::redact::command(query)));
        match ask().await {
            Ok(None) => {
                tracing::info!(INSTANCE = name, EVENT = "gpus", "{} not found: GPU check skipped", query[0]);
            }
            Err(QueryError::TimedOut(why)) => return Err(StartFailure::transient(why)),
            Err(QueryError::Failed(e)) => tracing::warn!(INSTANCE = name, EVENT = "gpus", "GPU check skipped: {e}"),
            Ok(Some(apps)) if apps.is_empty() => {}
            Ok(Some(apps)) => {
                waits();
                let wait = s.prestart.gpu_idle_wait;
                status(format!(
                    "waiting up to {} for GPU compute processes to exit: {}",
                    humantime::format_duration(wait),
                    prestart::describe_gpu_apps(&apps)
                ));
                let waiting = crate::observe::facts::GpuWaiting::begin();
                let (idle, last) = look_until(wait, ask, |r| matches!(r, Ok(Some(a)) if a.is_empty())).await;
                drop(waiting);
                if !idle {
                    let busy = match last {
                        Ok(Some(a)) => prestart::describe_gpu_apps(&a),
                        Ok(None) => "the query is gone".into(),
                        Err(QueryError::TimedOut(why) | QueryError::Failed(why)) => why,
                    };
                    let wait = humantime::format_duration(wait);
                    return Err(StartFailure::transient(format!("GPUs still busy after {wait}: {busy}")));
                }
            }
        }
    }

    // 6. The Ray cluster.
    if let Some(cluster) = s.prestart.ray.as_ref().filter(|c| c.gate) {
        waits();
        ray_gate(cluster, &s.child.command, &status).await?;
    }
    Ok(())
}

/// The start waits (for leftovers to stop, the port, the GPUs, the Ray
/// cluster): the reports of earlier runs need not wait for it any more.
fn waits() {
    crate::tell::reports::start_under_way(false);
}

/// First and longest wait between two looks at the Ray cluster: each look
/// starts a Python interpreter, about a second of CPU.
const RAY_FIRST_RETRY: Duration = Duration::from_secs(1);
const RAY_MAX_RETRY: Duration = Duration::from_secs(10);

/// Wait until the cluster has what `cluster` asks for, looking with a
/// growing delay and showing what is missing; fail the start naming it
/// once `cluster.wait` has passed.
async fn ray_gate(cluster: &crate::config::Cluster, child: &[String], status: &Status) -> Result<(), StartFailure> {
    let argv = cluster.command(child);
    let address = &cluster.address;
    let wait = humantime::format_duration(cluster.wait);
    let deadline = Instant::now() + cluster.wait;
    let mut delay = RAY_FIRST_RETRY;
    loop {
        let missing = match crate::process::ray::ask(&argv, address).await {
            Ok(view) => match cluster.missing(&view) {
                None => return Ok(()),
                Some(m) => m,
            },
            Err(e) => e.to_string(),
        };
        let now = Instant::now();
        if now >= deadline {
            return Err(StartFailure::transient(format!("Ray cluster at {address} not ready after {wait}: {missing}")));
        }
        let next = delay.min(deadline - now);
        status(format!(
            "waiting up to {wait} for the Ray cluster at {address}: {missing} (next look in {})",
            humantime::format_duration(Duration::from_secs(next.as_secs().max(1)))
        ));
        tokio::time::sleep(next).await;
        delay = (delay * 2).min(RAY_MAX_RETRY);
    }
}

/// Remove what crashed runs leave behind and nobody uses any more: the
/// `clean-shm` entries of `/dev/shm`, the profile's files in the
/// temporary folders (see `prestart::clean` for the rule), and a Ray
/// node's session folders (see `ray::clean_sessions`). Logs what was
/// removed and what was kept, and why.
pub(crate) fn clean_leftover_files(s: &Settings) {
    let uid = nix::unistd::geteuid().as_raw();
    clean_ray_sessions(s, uid);
    let mut folders: Vec<(PathBuf, Vec<String>)> = Vec::new();
    if !s.prestart.clean_shm.is_empty() {
        folders.push(("/dev/shm".into(), s.prestart.clean_shm.clone()));
    }
    let temp = s.profile.temp_globs();
    if !temp.is_empty() {
        folders.extend(prestart::temp_dirs().into_iter().map(|d| (d, temp.clone())));
    }
    // One pass over /proc answers for every folder (see `prestart::in_use`),
    // and none is made when no file could be removed.
    let found: Vec<(PathBuf, Vec<PathBuf>)> = folders
        .iter()
        .filter(|(d, _)| d.is_dir())
        .map(|(d, globs)| (d.clone(), prestart::candidates(d, globs)))
        .filter(|(_, c)| !c.is_empty())
        .collect();
    if found.is_empty() {
        return;
    }
    // Only files that could be removed (ours) are worth a /proc pass.
    let removable: Vec<PathBuf> = found
        .iter()
        .flat_map(|(_, c)| c)
        .filter(|p| {
            use std::os::unix::fs::MetadataExt;
            std::fs::symlink_metadata(p).is_ok_and(|m| m.is_file() && m.uid() == uid)
        })
        .cloned()
        .collect();
    let in_use = prestart::in_use(&removable);
    for (dir, paths) in found {
        let report = prestart::clean_candidates(paths, uid, &in_use);
        if report != prestart::Cleaned::default() {
            tracing::info!(INSTANCE = s.name.as_str(), EVENT = "clean", "{}: {}", dir.display(), report.describe());
        }
    }
}

/// A Ray node's session folders that nothing uses any more.
fn clean_ray_sessions(s: &Settings, uid: u32) {
    if !s.profile.is_ray() {
        return;
    }
    let dir = crate::process::ray::temp_dir(&s.child.command, &s.child.env);
    let report = crate::process::ray::clean_sessions(&dir, uid);
    if report != prestart::Cleaned::default() {
        tracing::info!(INSTANCE = s.name.as_str(), EVENT = "clean", "{}: {}", dir.display(), report.describe());
    }
}

/// Look with `look` again, with a growing delay, until `done` says so or
/// `limit` passes; returns whether it did, and the last look.
async fn look_until<T, F, Fut>(limit: Duration, mut look: F, done: impl Fn(&T) -> bool) -> (bool, T)
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = T>,
{
    let deadline = Instant::now() + limit;
    let mut delay = FIRST_RETRY;
    loop {
        let seen = look().await;
        if done(&seen) {
            return (true, seen);
        }
        let now = Instant::now();
        if now >= deadline {
            return (false, seen);
        }
        tokio::time::sleep(delay.min(deadline - now)).await;
        delay = (delay * 2).min(MAX_RETRY);
    }
}

/// Look again with a growing delay until `ready` or `limit` passes.
async fn wait_until<F, Fut>(limit: Duration, ready: F) -> bool
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = bool>,
{
    look_until(limit, ready, |ok| *ok).await.0
}
