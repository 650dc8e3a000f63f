//! The weight-cache daemon's processes: spawned in a group of their own,
//! beside the engine's tree and never part of it (a helper of the warden:
//! the engine's stop, its leftovers and its GPU check leave it alone), its
//! output through a pipe (so its lines are read as they come and its end
//! is seen when the last process holding the pipe is gone), its exit read
//! by the tree's reaper and handed on (`child::spawn_watched`), and the
//! stop of its group.
//!
//! What a line means and when the daemon starts or stops are not known
//! here.

use std::collections::BTreeMap;
use std::io;
use std::os::fd::OwnedFd;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::Mutex;

use nix::sys::signal::{Signal, kill, killpg};
use nix::unistd::Pid;

use crate::process::child::{Exit, SCRUBBED_ENV, descendants, read_stat, register_helper, unregister_helper};

/// The daemon that runs, if one does: for the GPU check, which must not
/// wait for the processes that hold the weights on purpose.
static RUNNING: Mutex<Option<i32>> = Mutex::new(None);

/// A spawned daemon.
pub(crate) struct Spawned {
    pub(crate) pid: u32,
    /// Its start time (`/proc/PID/stat`): with the pid, its identity.
    pub(crate) start_time: u64,
    /// Its stdout and stderr: end of file once every process holding them
    /// is gone.
    pub(crate) output: OwnedFd,
}

/// Spawn `argv` in its own process group, stdin from /dev/null, stdout
/// and stderr into a pipe, with a scrubbed environment; `on_exit` is
/// called with its exit.
pub(crate) fn spawn(
    argv: &[String],
    env: &BTreeMap<String, String>,
    cwd: Option<&Path>,
    on_exit: impl FnOnce(Exit) + Send + 'static,
) -> io::Result<Spawned> {
    let (read, write) = nix::unistd::pipe2(nix::fcntl::OFlag::O_CLOEXEC).map_err(io::Error::from)?;
    let mut cmd = Command::new(&argv[0]);
    cmd.args(&argv[1..])
        .stdin(Stdio::null())
        .stdout(Stdio::from(write.try_clone()?))
        .stderr(Stdio::from(write))
        .process_group(0)
        .envs(env);
    for var in SCRUBBED_ENV {
        cmd.env_remove(var);
    }
    if let Some(cwd) = cwd {
        cmd.current_dir(cwd);
    }
    let mut start_time = 0;
    // Under the registry's lock, before the reaper can hand its exit on:
    // even a daemon that died at once is still there to be read.
    let registered = |pid: i32| {
        register_helper(pid);
        start_time = read_stat(pid).map_or(0, |s| s.start_time);
        *RUNNING.lock().unwrap_or_else(|p| p.into_inner()) = Some(pid);
    };
    let pid = crate::process::child::spawn_watched(&mut cmd, registered, |ours| {
        Box::new(move |exit| {
            unregister_helper(ours);
            let mut running = RUNNING.lock().unwrap_or_else(|p| p.into_inner());
            if *running == Some(ours) {
                *running = None;
            }
            drop(running);
            on_exit(exit)
        })
    })?;
    // Dropping `cmd` closes the warden's copies of the write end.
    drop(cmd);
    Ok(Spawned { pid, start_time, output: read })
}

/// Send `sig` to the daemon's group.
pub(crate) fn signal_group(pid: u32, sig: Signal) {
    let _ = killpg(Pid::from_raw(pid as i32), sig);
}

/// SIGKILL the daemon's group, and its leader and the leader's
/// descendants while the leader is still the process spawned at
/// `start_time` (a pid, once reaped, may be another's). Once the leader is
/// gone its orphans are the warden's, and its group id cannot be taken by
/// another process while any of them lives.
pub(crate) fn kill_all(pid: u32, start_time: u64) {
    let still_ours = read_stat(pid as i32).is_some_and(|s| s.start_time == start_time && s.state != 'Z');
    if still_ours {
        for d in descendants(pid as i32) {
            let _ = kill(Pid::from_raw(d.pid), Signal::SIGKILL);
        }
        let _ = kill(Pid::from_raw(pid as i32), Signal::SIGKILL);
    }
    let _ = killpg(Pid::from_raw(pid as i32), Signal::SIGKILL);
}

/// The processes of the running daemon: its leader and descendants.
pub(crate) fn daemon_pids() -> Vec<i32> {
    let Some(pid) = *RUNNING.lock().unwrap_or_else(|p| p.into_inner()) else { return Vec::new() };
    if read_stat(pid).is_none() {
        return Vec::new();
    }
    std::iter::once(pid).chain(descendants(pid).into_iter().map(|p| p.pid)).collect()
}

/// The GPU compute processes less the daemon's, which hold the weights on
/// purpose.
pub(crate) fn without_daemon(apps: Vec<crate::process::prestart::GpuApp>) -> Vec<crate::process::prestart::GpuApp> {
    let ours = daemon_pids();
    if ours.is_empty() {
        return apps;
    }
    apps.into_iter().filter(|a| !ours.contains(&a.pid)).collect()
}

/// Whether this host can run the daemon, as far as its device nodes tell:
/// `Err` says why not (vLLM shares weights over CUDA IPC, on CUDA and ROCm
/// only); `Ok` names what was found (vLLM checks the rest as it starts).
pub(crate) fn host_qualifies(dev: &Path) -> Result<String, String> {
    let found: Vec<String> = ["nvidiactl", "kfd"]
        .iter()
        .filter(|n| dev.join(n).exists())
        .map(|n| dev.join(n).display().to_string())
        .collect();
    if found.is_empty() {
        return Err(format!(
            "this host has no CUDA or ROCm GPU ({}/nvidiactl and {}/kfd are missing): vllm preload refuses a platform \
             without CUDA IPC, and the warden would end with exit 78; set [preload] enabled = false",
            dev.display(),
            dev.display()
        ));
    }
    Ok(format!("GPU devices found ({}); vLLM checks the platform as the daemon starts", found.join(", ")))
}

/// Make the socket folder: mode 0700, the warden's user (vLLM refuses a
/// folder others can read, or that is not its user's).
pub(crate) fn socket_dir(dir: &Path) -> io::Result<()> {
    use std::os::unix::fs::{DirBuilderExt, MetadataExt, PermissionsExt};
    match std::fs::symlink_metadata(dir) {
        Ok(m) if m.file_type().is_symlink() || !m.is_dir() => {
            return Err(io::Error::other(format!("{} is not a folder", dir.display())));
        }
        Ok(m) if m.uid() != nix::unistd::geteuid().as_raw() => {
            return Err(io::Error::other(format!(
                "{} belongs to uid {}, not to the warden's user (uid {}): vLLM refuses it",
                dir.display(),
                m.uid(),
                nix::unistd::geteuid()
            )));
        }
        Ok(_) => {}
        Err(e) if e.kind() == io::ErrorKind::NotFound => {
            std::fs::DirBuilder::new().recursive(true).mode(0o700).create(dir)?;
        }
        Err(e) => return Err(e),
    }
    std::fs::set_permissions(dir, std::fs::Permissions::from_mode(0o700))
}

/// Open the daemon's log file for appending (its folder made), after a
/// marker line `--- vllm-warden: weight-cache daemon at <RFC 3339> ---`.
pub(crate) fn open_log(path: &Path, now: std::time::SystemTime) -> io::Result<std::fs::File> {
    use std::io::Write;
    if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
        std::fs::create_dir_all(dir)?;
    }
    let mut f = std::fs::OpenOptions::new().create(true).append(true).open(path)?;
    writeln!(f, "--- vllm-warden: weight-cache daemon at {} ---", humantime::format_rfc3339_seconds(now))?;
    Ok(f)
}

/// The daemon's own log file, beside the engine's: `NAME.log` →
/// `NAME.preload.log`.
pub(crate) fn log_file(engine_log: &Path) -> PathBuf {
    let stem = engine_log.file_stem().map(|s| s.to_string_lossy().into_owned()).unwrap_or_else(|| "vllm".into());
    engine_log.with_file_name(format!("{stem}.preload.log"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_daemon_log_sits_beside_the_engine_log() {
        assert_eq!(
            log_file(Path::new("/var/log/vllm-warden/kimi.log")),
            Path::new("/var/log/vllm-warden/kimi.preload.log")
        );
    }

    #[test]
    fn a_host_without_gpu_devices_does_not_qualify() {
        let d = tempfile::tempdir().unwrap();
        let no = host_qualifies(d.path()).unwrap_err();
        assert!(no.contains("no CUDA or ROCm GPU") && no.contains("[preload] enabled = false"), "{no}");
        std::fs::write(d.path().join("nvidiactl"), "").unwrap();
        assert!(host_qualifies(d.path()).unwrap().contains("nvidiactl"));
    }

    #[test]
    fn the_socket_folder_is_made_private_and_kept_so() {
        use std::os::unix::fs::PermissionsExt;
        let d = tempfile::tempdir().unwrap();
        let dir = d.path().join("run/weight-cache");
        socket_dir(&dir).unwrap();
        assert_eq!(std::fs::metadata(&dir).unwrap().permissions().mode() & 0o777, 0o700);
        std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o755)).unwrap();
        socket_dir(&dir).unwrap();
        assert_eq!(std::fs::metadata(&dir).unwrap().permissions().mode() & 0o777, 0o700);
        let file = d.path().join("f");
        std::fs::write(&file, "").unwrap();
        assert!(socket_dir(&file).is_err());
    }
}
