//! External commands under a deadline: the GPU query and the commands of
//! a failure report, their processes known as the warden's helpers.

use std::io;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use nix::sys::signal::Signal;

/// GPU compute processes as `gpu-query` lists them: `pid, used_memory`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct GpuApp {
    pub(crate) pid: i32,
    pub(crate) mem_mib: u64,
}

/// Parse nvidia-smi's `--query-compute-apps=pid,used_memory --format=csv,noheader,nounits`.
pub(crate) fn parse_gpu_apps(text: &str) -> Vec<GpuApp> {
    text.lines()
        .filter_map(|l| {
            let mut f = l.split(',').map(str::trim);
            let pid = f.next()?.parse().ok()?;
            let mem_mib = f.next().and_then(|m| m.parse().ok()).unwrap_or(0);
            Some(GpuApp { pid, mem_mib })
        })
        .collect()
}

pub(crate) fn describe_gpu_apps(apps: &[GpuApp]) -> String {
    apps.iter().map(|a| format!("pid {} ({} MiB)", a.pid, a.mem_mib)).collect::<Vec<_>>().join(", ")
}

/// Why the GPU query gave no answer.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum QueryError {
    /// It could not be run (other than not installed).
    Failed(String),
    /// It did not finish within its time limit and was killed.
    TimedOut(String),
}

/// Run `gpu-query` under `timeout`. `Ok(None)`: the command is not
/// installed. It runs in its own process group, which is SIGKILLed when the
/// time is up (a query that hangs on a failing driver must not hold the
/// start).
pub(crate) async fn query_gpus(cmd: &[String], timeout: Duration) -> Result<Option<Vec<GpuApp>>, QueryError> {
    let shown = crate::util::redact::command(cmd);
    match run_command(cmd, timeout, 1 << 20, false).await {
        Ok(out) => Ok(out.map(|o| parse_gpu_apps(&o))),
        Err(QueryError::TimedOut(_)) => {
            let t = humantime::format_duration(timeout);
            Err(QueryError::TimedOut(format!("GPU query {shown} did not answer within {t} (killed)")))
        }
        Err(e) => Err(e),
    }
}

/// A helper command of the warden (not part of the child's tree), as its
/// thread and its caller see it: its group, once started; whether its
/// caller gave up on it (then it is SIGKILLed as soon as it is known), and
/// whether it finished (then its group may be gone and its id reused).
#[derive(Debug, Default)]
pub(super) struct Helper {
    pub(super) group: Option<nix::unistd::Pid>,
    pub(super) given_up: bool,
    pub(super) finished: bool,
}

/// The caller's hold on a [`Helper`]: dropped before the command finished
/// (a timeout, a cancelled start or report), its group is SIGKILLed.
pub(super) struct Hold(Arc<Mutex<Helper>>);

impl Drop for Hold {
    fn drop(&mut self) {
        let mut h = self.0.lock().unwrap_or_else(|p| p.into_inner());
        h.given_up = true;
        if let Some(group) = h.group.filter(|_| !h.finished) {
            let _ = nix::sys::signal::killpg(group, Signal::SIGKILL);
        }
    }
}

/// Run `cmd` under `timeout` and return its output (stdout, and stderr
/// with it when `stderr`), at most `max` bytes of it, without the
/// warden's systemd variables and log level in its environment. `Ok(None)`: the
/// command is not installed. It runs in its own process group, which is
/// SIGKILLed when the time is up or when the future is dropped; it is not
/// counted as part of the child's tree. It is started and read in a
/// blocking thread (starting a process holds the thread that does it until
/// the process has exec'd); the warden's reaper collects its exit, which is
/// not needed.
pub(crate) async fn run_command(
    cmd: &[String],
    timeout: Duration,
    max: u64,
    stderr: bool,
) -> Result<Option<String>, QueryError> {
    let shown = crate::util::redact::command(cmd);
    let Some(first) = cmd.first() else { return Ok(None) };
    let helper = Arc::new(Mutex::new(Helper::default()));
    // Killed however this ends: in time, late, or dropped by a cancel.
    let hold = Hold(helper.clone());
    let (first, args, what) = (first.clone(), cmd[1..].to_vec(), shown.clone());
    let run = tokio::task::spawn_blocking(move || {
        // Looked up before starting anything (on a machine without GPUs
        // the query is missing, and a start attempt that fails costs a
        // process), off the loop: a lookup stats a file in every folder
        // of PATH, any of which may hang.
        let Ok(program) = which::which(&first) else { return Ok(None) };
        run_helper(program, &args, &what, max, stderr, &helper)
    });
    match tokio::time::timeout(timeout, run).await {
        Ok(run) => {
            drop(hold);
            run.unwrap_or_else(|e| Err(QueryError::Failed(format!("{shown}: {e}"))))
        }
        Err(_) => {
            drop(hold);
            let t = humantime::format_duration(timeout);
            Err(QueryError::TimedOut(format!("{shown} did not answer within {t} (killed)")))
        }
    }
}

/// [`run_command`]'s blocking part.
pub(super) fn run_helper(
    program: PathBuf,
    args: &[String],
    shown: &str,
    max: u64,
    stderr: bool,
    helper: &Mutex<Helper>,
) -> Result<Option<String>, QueryError> {
    use std::io::Read;
    use std::os::unix::process::CommandExt;
    let mut command = std::process::Command::new(program);
    command.args(args).stdin(std::process::Stdio::null()).process_group(0);
    // Neither systemd's variables nor the warden's log level are the
    // command's (py-spy reads RUST_LOG too, and writes its debug log into
    // its output).
    for var in crate::process::child::SCRUBBED_ENV.iter().chain(&["RUST_LOG"]) {
        command.env_remove(var);
    }
    let (reader, writer) = std::io::pipe().map_err(|e| QueryError::Failed(format!("cannot run {shown}: {e}")))?;
    let err_out = if stderr {
        let w = writer.try_clone().map_err(|e| QueryError::Failed(format!("cannot run {shown}: {e}")))?;
        std::process::Stdio::from(w)
    } else {
        std::process::Stdio::null()
    };
    command.stdout(writer).stderr(err_out);
    let spawned = command.spawn();
    // The write ends go with the command: the read sees the end of the
    // output when the command (and what it started) closes its own.
    drop(command);
    let mut child = match spawned {
        Ok(c) => c,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(None),
        Err(e) => return Err(QueryError::Failed(format!("cannot run {shown}: {e}"))),
    };
    let group = nix::unistd::Pid::from_raw(child.id() as i32);
    crate::process::child::register_helper(group.as_raw());
    {
        let mut h = helper.lock().unwrap_or_else(|p| p.into_inner());
        if h.given_up {
            let _ = nix::sys::signal::killpg(group, Signal::SIGKILL);
        }
        h.group = Some(group);
    }
    // A bounded read: a runaway command cannot fill the warden's memory.
    let mut out = Vec::new();
    let _ = (&reader).take(max).read_to_end(&mut out);
    drop(reader);
    // It closed its output: once waited for, its group may be gone and its
    // id reused, so it is not signalled any more (given up, it was killed).
    helper.lock().unwrap_or_else(|p| p.into_inner()).finished = true;
    let _ = child.wait();
    crate::process::child::unregister_helper(group.as_raw());
    Ok(Some(String::from_utf8_lossy(&out).into_owned()))
}
