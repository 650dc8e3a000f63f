//! Upgrading the warden while the model keeps serving: on SIGUSR2 (or
//! `vllm-warden upgrade`), a ready warden saves what its successor needs to
//! a file in the runtime directory and `execve`s the binary at its own path.
//! The pid stays, so the child stays its child (nothing is re-parented),
//! systemd's `MAINPID` stays, and these descriptors are kept across the
//! exec: the instance lock, the read end of the pipe the child writes its
//! output to, the log file, and the front door's listening sockets (never
//! closed, never bound again: clients wait in their backlog meanwhile). The log writer is held before the exec, so
//! everything it took out of the pipe is in the file; what the child writes
//! meanwhile waits in the pipe. The successor reads the file, checks every
//! part of it against the live system (the child is its child with the same
//! start time and carries the run token in its own environment; the
//! pipe descriptor is a pipe's read end whose write end is
//! the child's stdout and stderr; the log descriptor is the configured log
//! file, open for appending; the lock descriptor is the instance's lock),
//! goes on moving the pipe to the file, follows the log from the saved
//! offset and supervises the ready run as before: no line is lost.
//!
//! What can go wrong before the exec leaves the old warden running and says
//! why: a new binary that does not answer `--version`, a state file that
//! cannot be written, an `execve` that fails. A successor that cannot use
//! the file says why, keeps the lock it inherited (found by its file, not
//! by the number the state gives: `lock::InstanceLock::inherited`), stops
//! the child it cannot vouch for as a leftover, then starts over: the model
//! is loaded again, nothing is left behind.

use std::ffi::{CString, OsString};
use std::io;
use std::os::fd::{AsFd, OwnedFd, RawFd};
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::time::Duration;

use serde::{Deserialize, Serialize};

/// The environment variable that names the state file for the successor.
pub(crate) use crate::process::child::UPGRADE_STATE_ENV as STATE_ENV;

/// The state file's name in the runtime directory.
pub(crate) const STATE_FILE: &str = "upgrade.json";

/// The format of the state file; a successor refuses another (format 1,
/// before the child's output went through the warden's pipe, is refused:
/// the model is loaded again).
pub(crate) const FORMAT: u32 = 2;

/// A state file larger than this is not read.
const MAX_STATE: u64 = 64 << 10;

/// How long the new binary has to answer `--version`.
pub(crate) const VERSION_TIMEOUT: Duration = Duration::from_secs(10);

/// What the successor needs: the upgrade handed over.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Handoff {
    pub(crate) format: u32,
    /// The version of the warden that wrote it.
    pub(crate) from: String,
    pub(crate) instance: String,
    /// The instance lock's descriptor, kept open across the exec.
    pub(crate) lock_fd: RawFd,
    /// The run token the child carries in its environment.
    pub(crate) token: String,
    /// The child, with its start time (clock ticks after boot).
    pub(crate) child_start_time: u64,
    /// The read end of the pipe the child's stdout and stderr write to,
    /// kept open across the exec.
    pub(crate) pipe_fd: RawFd,
    /// The log file the pipe is moved to, kept open across the exec: its
    /// descriptor, its inode, and the offset of the first line not yet read.
    pub(crate) log_fd: RawFd,
    pub(crate) log_dev: u64,
    pub(crate) log_ino: u64,
    pub(crate) log_offset: u64,
    pub(crate) machine: crate::supervisor::Saved,
    /// The front door's listening sockets, kept open across the exec; none
    /// from a predecessor without them.
    #[serde(default)]
    pub(crate) listeners: Vec<HandedListener>,
}

/// A listening socket of the front door, as the hand-off names it: its
/// descriptor and its address as the config writes it (`0.0.0.0:8000`,
/// `unix:/run/…`). The successor takes it only once checked to be a
/// listening socket with that local address
/// (`front::listen::Inherited::handed_over`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub(crate) struct HandedListener {
    pub(crate) fd: RawFd,
    pub(crate) address: String,
}

/// Why an upgrade does not go on: the state file the successor cannot
/// use, or a new binary that does not answer as a warden.
#[derive(Debug, thiserror::Error)]
pub enum UpgradeError {
    #[error("{}: {source}", path.display())]
    Unreadable { path: PathBuf, source: io::Error },
    #[error("{}: {source}", path.display())]
    NotJson { path: PathBuf, source: serde_json::Error },
    #[error("state format {0} (this warden reads {FORMAT})")]
    Format(u32),
    #[error("the state is instance {0:?}'s")]
    OtherInstance(String),
    #[error("the run token is not one a warden makes")]
    Token,
    #[error("the predecessor's version is not a version")]
    PredecessorVersion,
    #[error("a pid out of range")]
    PidRange,
    #[error("pid {0} is not the child that was recorded")]
    NotTheChild(i32),
    #[error("the child, pid {0}, is gone")]
    ChildGone(i32),
    /// The child's own environment does not hold the state's run token: a
    /// warden that took it over would record the tree with a token the
    /// child does not carry, and its successor after a crash would not
    /// know the child as a leftover (which would keep the port).
    #[error("the child, pid {0}, does not carry the state's run token in its environment")]
    TokenNotCarried(i32),
    /// The descriptor the state names is not the inherited instance lock.
    #[error("descriptor {0} is not the instance's lock")]
    NotTheLock(RawFd),
    /// The descriptor the state names is not the read end of the child's
    /// output pipe.
    #[error("descriptor {0} is not the read end of the child's output pipe: {1}")]
    NotThePipe(RawFd, String),
    /// The descriptor the state names is not the log file, open for appending.
    #[error("descriptor {fd} is not the log file {}: {why}", path.display())]
    NotTheLog { fd: RawFd, path: PathBuf, why: String },
    #[error("cannot run {} --version: {source}", exe.display())]
    Spawn { exe: PathBuf, source: io::Error },
    #[error("{} --version did not answer within {}s", .0.display(), VERSION_TIMEOUT.as_secs())]
    NoAnswer(PathBuf),
    #[error("{} --version: {source}", exe.display())]
    Wait { exe: PathBuf, source: io::Error },
    #[error("{} --version did not name a vllm-warden version", .0.display())]
    NotAWarden(PathBuf),
    #[error("the warden's own path is not known")]
    NoOwnPath,
    /// The weight-cache daemon is not handed over: the successor would not
    /// know it (and its output pipe does not survive the exec).
    #[error("not with [preload]: the weight-cache daemon is not handed over; restart the unit instead")]
    Preload,
    /// The task that asked the new binary ended without an answer.
    #[error("the check failed: {0}")]
    CheckFailed(tokio::task::JoinError),
}

/// Where the state file goes: beside the status document (the runtime
/// directory under systemd).
pub(crate) fn state_path(status_file: &Path) -> PathBuf {
    status_file.parent().unwrap_or(Path::new(".")).join(STATE_FILE)
}

/// Write `state` to `path`, mode 0600, whole or not at all.
pub(crate) fn write(path: &Path, state: &Handoff) -> io::Result<()> {
    let text = serde_json::to_vec_pretty(state).map_err(io::Error::other)?;
    crate::util::fsutil::replace(path, &text, 0o600)
}

/// The state file named by [`STATE_ENV`], taken out of the environment so
/// that no child inherits it. Call first thing in `main`, before any
/// thread exists.
pub(crate) fn take_from_env() -> Option<PathBuf> {
    let path = std::env::var_os(STATE_ENV)?;
    // SAFETY: called from `main` before any other thread is started, so no
    // other thread reads the environment meanwhile.
    unsafe { std::env::remove_var(STATE_ENV) };
    Some(PathBuf::from(path))
}

/// Read and check the state file for instance `instance`, whose log file
/// is `log_path`, then remove it. Every part is checked against the live
/// system; `Err` says which failed.
pub(crate) fn read(path: &Path, instance: &str, log_path: &Path) -> Result<Handoff, UpgradeError> {
    let text = crate::process::prestart::read_state_file(path, MAX_STATE)
        .map_err(|source| UpgradeError::Unreadable { path: path.to_path_buf(), source });
    let _ = std::fs::remove_file(path);
    let state: Handoff =
        serde_json::from_slice(&text?).map_err(|source| UpgradeError::NotJson { path: path.to_path_buf(), source })?;
    if state.format != FORMAT {
        return Err(UpgradeError::Format(state.format));
    }
    if state.instance != instance {
        return Err(UpgradeError::OtherInstance(state.instance));
    }
    // Both go on into the child's environment and a status line: only the
    // shapes this warden writes.
    if state.token.len() != 32 || !state.token.bytes().all(|b| b.is_ascii_hexdigit()) {
        return Err(UpgradeError::Token);
    }
    if state.from.is_empty() || state.from.len() > 64 || !state.from.bytes().all(|b| b.is_ascii_graphic()) {
        return Err(UpgradeError::PredecessorVersion);
    }
    let me = std::process::id() as i32;
    let pid = i32::try_from(state.machine.pid).map_err(|_| UpgradeError::PidRange)?;
    match crate::process::child::read_stat(pid) {
        Some(st) if st.ppid == me && st.start_time == state.child_start_time && st.state != 'Z' => {}
        Some(_) => return Err(UpgradeError::NotTheChild(pid)),
        None => return Err(UpgradeError::ChildGone(pid)),
    }
    // The token is what finds the child again after a crash (the tree's
    // record names it, and a leftover must carry it): only the token the
    // child was started with is taken over.
    if !crate::process::prestart::carries_token(pid, &state.token) {
        return Err(UpgradeError::TokenNotCarried(pid));
    }
    check_output(&state, log_path)?;
    // The lock's descriptor is checked where it is taken over
    // (`InstanceLock::adopt`).
    Ok(state)
}

/// The child's output pipe and the log file, taken over from the
/// descriptors `state` names, once checked against the live system: the
/// pipe descriptor is a pipe open for reading whose write end is the
/// child's stdout; the log descriptor is the regular file at
/// `log_path` with the recorded inode, open for appending. Both close on
/// exec again.
pub(crate) fn take_output(state: &Handoff, log_path: &Path) -> Result<(OwnedFd, std::fs::File), UpgradeError> {
    use std::os::fd::FromRawFd;
    check_output(state, log_path)?;
    // SAFETY: both are open descriptors of this process, checked above to
    // be what the predecessor left for its successor, which nothing else
    // of this process uses: from now on these own them.
    let (pipe_fd, log_file) =
        unsafe { (OwnedFd::from_raw_fd(state.pipe_fd), std::fs::File::from_raw_fd(state.log_fd)) };
    for fd in [pipe_fd.as_fd(), log_file.as_fd()] {
        let _ = rustix::io::fcntl_setfd(fd, rustix::io::FdFlags::CLOEXEC);
    }
    Ok((pipe_fd, log_file))
}

/// The checks of [`take_output`], taking nothing.
pub(crate) fn check_output(state: &Handoff, log_path: &Path) -> Result<(), UpgradeError> {
    let (p, l, pid) = (state.pipe_fd, state.log_fd, state.machine.pid);
    let pipe = |why: String| UpgradeError::NotThePipe(p, why);
    let log = |why: String| UpgradeError::NotTheLog { fd: l, path: log_path.to_path_buf(), why };
    // Never the standard ones, the lock, or one descriptor for both.
    if p <= 2 || p == state.lock_fd || p == l {
        return Err(pipe("not a descriptor a warden hands over".into()));
    }
    if l <= 2 || l == state.lock_fd {
        return Err(log("not a descriptor a warden hands over".into()));
    }
    let ours = std::fs::metadata(format!("/proc/self/fd/{p}")).map_err(|e| pipe(e.to_string()))?;
    if !std::os::unix::fs::FileTypeExt::is_fifo(&ours.file_type()) {
        return Err(pipe("not a pipe".into()));
    }
    if fd_flags(&format!("/proc/self/fdinfo/{p}")).map(|f| f & libc::O_ACCMODE) != Some(libc::O_RDONLY) {
        return Err(pipe("not open for reading only".into()));
    }
    // The child's stdout (the warden gave it stderr too, but a child may
    // move its own stderr).
    let theirs = std::fs::metadata(format!("/proc/{pid}/fd/1"))
        .map_err(|e| pipe(format!("cannot see the child's stdout: {e}")))?;
    if (theirs.dev(), theirs.ino()) != (ours.dev(), ours.ino()) {
        return Err(pipe("the child's stdout is another file".into()));
    }
    if fd_flags(&format!("/proc/{pid}/fdinfo/1")).map(|f| f & libc::O_ACCMODE) != Some(libc::O_WRONLY) {
        return Err(pipe("the child's stdout is not the pipe's write end".into()));
    }
    let file = std::fs::metadata(format!("/proc/self/fd/{l}")).map_err(|e| log(e.to_string()))?;
    if !file.is_file() || (file.dev(), file.ino()) != (state.log_dev, state.log_ino) {
        return Err(log("not the recorded file".into()));
    }
    let at_path = std::fs::symlink_metadata(log_path).map_err(|e| log(e.to_string()))?;
    if (at_path.dev(), at_path.ino()) != (file.dev(), file.ino()) {
        return Err(log("another file is at that path".into()));
    }
    match fd_flags(&format!("/proc/self/fdinfo/{l}")) {
        Some(f) if f & libc::O_ACCMODE != libc::O_RDONLY && f & libc::O_APPEND != 0 => {}
        _ => return Err(log("not open for appending".into())),
    }
    Ok(())
}

/// The `flags:` of a `/proc/PID/fdinfo/FD` file (octal).
fn fd_flags(path: &str) -> Option<i32> {
    let text = std::fs::read_to_string(path).ok()?;
    let flags = text.lines().find_map(|l| l.strip_prefix("flags:"))?;
    i32::from_str_radix(flags.trim(), 8).ok()
}

/// Make every descriptor but the standard ones close on exec: run by a
/// successor first thing, so that what its predecessor kept open for it
/// (and a hand-off that names others) never reaches a process it starts.
/// What it takes over it has found by then, by what the descriptors are.
pub(crate) fn close_inherited_on_exec() {
    let Ok(dir) = std::fs::read_dir("/proc/self/fd") else { return };
    let fds: Vec<i32> =
        dir.flatten().filter_map(|e| e.file_name().to_str()?.parse().ok()).filter(|fd| *fd > 2).collect();
    for fd in fds {
        // SAFETY: fcntl on a number: at worst EBADF (the directory's own
        // descriptor, closed by now).
        unsafe {
            let flags = libc::fcntl(fd, libc::F_GETFD);
            if flags >= 0 {
                libc::fcntl(fd, libc::F_SETFD, flags | libc::FD_CLOEXEC);
            }
        }
    }
}

/// Ask `exe --version` and return the version it names, or why not.
/// Blocking (run it off the loop); the command is killed after
/// [`VERSION_TIMEOUT`].
pub(crate) fn probe_version(exe: &Path) -> Result<String, UpgradeError> {
    use std::io::Read;
    let mut child = std::process::Command::new(exe)
        .arg("--version")
        .stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::null())
        .spawn()
        .map_err(|source| UpgradeError::Spawn { exe: exe.to_path_buf(), source })?;
    let pid = child.id();
    let stdout = child.stdout.take();
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let mut out = String::new();
        if let Some(s) = stdout {
            let _ = s.take(4096).read_to_string(&mut out);
        }
        let _ = tx.send(out);
    });
    let out = match rx.recv_timeout(VERSION_TIMEOUT) {
        Ok(out) => out,
        Err(_) => {
            let _ = nix::sys::signal::kill(nix::unistd::Pid::from_raw(pid as i32), nix::sys::signal::Signal::SIGKILL);
            let _ = child.wait();
            return Err(UpgradeError::NoAnswer(exe.to_path_buf()));
        }
    };
    // The warden reaps every child of its own (it is a subreaper, and its
    // reaper waits for any pid): the status may be gone already; the
    // answer is what counts.
    let success = match child.wait() {
        Ok(status) => status.success(),
        Err(e) if e.raw_os_error() == Some(libc::ECHILD) => true,
        Err(source) => return Err(UpgradeError::Wait { exe: exe.to_path_buf(), source }),
    };
    // `vllm-warden 0.1.0`
    match out.trim().strip_prefix("vllm-warden ") {
        Some(v) if success && !v.is_empty() && v.len() <= 64 && !v.contains(char::is_whitespace) => Ok(v.to_string()),
        _ => Err(UpgradeError::NotAWarden(exe.to_path_buf())),
    }
}

/// Keep descriptor `fd` open across the exec.
pub(crate) fn keep_across_exec(fd: std::os::fd::BorrowedFd<'_>) -> io::Result<()> {
    let flags = rustix::io::fcntl_getfd(fd)?;
    rustix::io::fcntl_setfd(fd, flags - rustix::io::FdFlags::CLOEXEC)?;
    Ok(())
}

/// Replace this process with `exe`, same arguments, with [`STATE_ENV`]
/// naming `state`. The stop, reload and upgrade signals are blocked across
/// the exec (the mask is kept), so that one arriving before the successor
/// has its handlers is held for them, not taken by the default action
/// (which would end the warden); what `outbox` holds is written and sent
/// first. Returns only on failure, with the mask as it was.
pub(crate) fn exec(exe: &Path, state: &Path, outbox: &crate::tell::outbox::Outbox) -> io::Error {
    use nix::sys::signal::{SigSet, SigmaskHow, Signal, pthread_sigmask};
    // What the status writer and the log's writer hold would be lost with
    // this process.
    outbox.settle(Duration::from_secs(1));
    crate::util::logging::flush(Duration::from_secs(1));
    let mut held = SigSet::empty();
    for s in [Signal::SIGTERM, Signal::SIGINT, Signal::SIGHUP, Signal::SIGUSR2] {
        held.add(s);
    }
    let mut before = SigSet::empty();
    let _ = pthread_sigmask(SigmaskHow::SIG_BLOCK, Some(&held), Some(&mut before));
    let e = exec_now(exe, state);
    let _ = pthread_sigmask(SigmaskHow::SIG_SETMASK, Some(&before), None);
    e
}

fn exec_now(exe: &Path, state: &Path) -> io::Error {
    let cstr = |b: &[u8]| CString::new(b).map_err(|_| io::Error::new(io::ErrorKind::InvalidInput, "a NUL byte"));
    let built = (|| -> io::Result<(CString, Vec<CString>, Vec<CString>)> {
        let path = cstr(exe.as_os_str().as_bytes())?;
        let args = std::env::args_os().map(|a| cstr(a.as_bytes())).collect::<io::Result<Vec<_>>>()?;
        let mut env = Vec::new();
        for (k, v) in std::env::vars_os() {
            if k.as_bytes() == STATE_ENV.as_bytes() {
                continue;
            }
            let mut kv = k;
            kv.push("=");
            kv.push(v);
            env.push(cstr(kv.as_bytes())?);
        }
        let mut kv = OsString::from(format!("{STATE_ENV}="));
        kv.push(state.as_os_str());
        env.push(cstr(kv.as_bytes())?);
        Ok((path, args, env))
    })();
    match built {
        Ok((path, args, env)) => match nix::unistd::execve(&path, &args, &env) {
            Err(e) => e.into(),
        },
        Err(e) => e,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn state(pid: u32, start_time: u64) -> Handoff {
        Handoff {
            format: FORMAT,
            from: "0.1.0".into(),
            instance: "t".into(),
            lock_fd: 3,
            token: "0123456789abcdef0123456789abcdef".into(),
            child_start_time: start_time,
            pipe_fd: 4,
            log_fd: 5,
            log_dev: 0,
            log_ino: 0,
            log_offset: 0,
            machine: crate::supervisor::Saved {
                start: 1,
                pid,
                ready_for: Duration::from_secs(1),
                running_for: Duration::from_secs(2),
                starts: 1,
                failures: 0,
                restarts: 0,
                restarts_by: Default::default(),
                exits: 0,
                last_load: None,
                failure_counts: Default::default(),
                last_failure: None,
                drained: false,
                last_load_record: None,
                golden: None,
            },
            listeners: Vec::new(),
        }
    }

    /// A state file is believed only for this process's own child with the
    /// recorded start time, and with fields of the shapes a warden writes;
    /// it is gone once read.
    #[test]
    fn a_state_is_checked_against_the_live_system() {
        use std::os::fd::AsRawFd;
        let (pipe, output) = crate::observe::logpipe::pipe().unwrap();
        let token = "0123456789abcdef0123456789abcdef";
        let mut child = std::process::Command::new("sleep")
            .arg("30")
            .env(crate::process::prestart::RUN_TOKEN, token)
            .stdout(std::process::Stdio::from(output))
            .spawn()
            .unwrap();
        // A spawn returns once the exec has begun, and the kernel fills
        // the new program's environment a moment later: wait for it.
        let environ = format!("/proc/{}/environ", child.id());
        let until = std::time::Instant::now() + std::time::Duration::from_secs(30);
        while std::fs::read(&environ).unwrap().is_empty() {
            assert!(std::time::Instant::now() < until, "the child's environment never appeared");
            std::thread::yield_now();
        }
        let st = crate::process::child::read_stat(child.id() as i32).unwrap();
        let d = tempfile::tempdir().unwrap();
        let path = d.path().join(STATE_FILE);
        let log_path = d.path().join("t.log");
        let log = std::fs::OpenOptions::new().create(true).append(true).open(&log_path).unwrap();
        let try_read = |s: &Handoff| {
            write(&path, s).unwrap();
            let got = read(&path, "t", &log_path);
            assert!(!path.exists(), "the state file is removed once read");
            got
        };
        let meta = log.metadata().unwrap();
        let good = Handoff {
            pipe_fd: pipe.as_raw_fd(),
            log_fd: log.as_raw_fd(),
            log_dev: meta.dev(),
            log_ino: meta.ino(),
            // Checked where the lock is taken over: out of the way here.
            lock_fd: 1000,
            ..state(child.id(), st.start_time)
        };
        // The pipe named as the log, the log as the pipe, another inode.
        let e = try_read(&Handoff { log_fd: good.pipe_fd, ..good.clone() }).unwrap_err().to_string();
        assert!(e.contains("is not the read end of the child's output pipe"), "{e}");
        let other = std::fs::File::open(&log_path).unwrap();
        let e = try_read(&Handoff { pipe_fd: other.as_raw_fd(), ..good.clone() }).unwrap_err().to_string();
        assert!(e.contains("not a pipe"), "{e}");
        let e = try_read(&Handoff { log_ino: meta.ino() + 1, ..good.clone() }).unwrap_err().to_string();
        assert!(e.contains("not the recorded file"), "{e}");
        assert_eq!(try_read(&good).unwrap(), good);
        let e = try_read(&Handoff { instance: "u".into(), ..good.clone() }).unwrap_err().to_string();
        assert!(e.contains("instance \"u\""), "{e}");
        let e = try_read(&Handoff { token: "x\nREADY=1".into(), ..good.clone() }).unwrap_err().to_string();
        assert!(e.contains("run token"), "{e}");
        // A token of the right shape that the child does not carry: forged.
        let forged = Handoff { token: "fedcba9876543210fedcba9876543210".into(), ..good.clone() };
        let e = try_read(&forged).unwrap_err().to_string();
        assert_eq!(
            e,
            format!("the child, pid {}, does not carry the state's run token in its environment", child.id())
        );
        let e = try_read(&Handoff { from: "1.0\nREADY=1".into(), ..good.clone() }).unwrap_err().to_string();
        assert!(e.contains("version"), "{e}");
        let e = try_read(&Handoff { child_start_time: st.start_time + 1, ..good.clone() }).unwrap_err().to_string();
        assert!(e.contains("not the child that was recorded"), "{e}");
        let mut other = good.clone();
        other.machine.pid = 1;
        let e = try_read(&other).unwrap_err().to_string();
        assert!(e.contains("pid 1 is not the child"), "{e}");
        let _ = child.kill();
        let _ = child.wait();
    }
}
