//! A killed warden's leftovers: the tree recorded with its run token, and
//! finding and stopping what is left of it.

use std::collections::BTreeSet;
use std::io;
use std::os::fd::{FromRawFd, OwnedFd};
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::time::Duration;

use nix::sys::signal::Signal;
use serde::{Deserialize, Serialize};

use crate::process::child::{ProcStat, descendants, read_stat};
use crate::util::fsutil::replace;

/// One process of the child's tree, as recorded in the state directory.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub(crate) struct Recorded {
    pub(crate) pid: i32,
    /// Clock ticks after boot: a recycled pid has another.
    pub(crate) start_time: u64,
}

/// The record: whose tree it is, on which boot, and the processes.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub(crate) struct RecordedTree {
    /// `/proc/sys/kernel/random/boot_id`: start times mean nothing across boots.
    pub(crate) boot_id: String,
    /// The instance name: a record is never taken for another instance's.
    pub(crate) instance: String,
    /// The run token the warden put in its children's environment
    /// ([`RUN_TOKEN`]): a process is taken for a leftover only if its own
    /// environment holds it, which no record can forge.
    pub(crate) token: String,
    pub(crate) tree: Vec<Recorded>,
}

/// The environment variable that marks the warden's children as its own.
pub(crate) const RUN_TOKEN: &str = "VLLM_WARDEN_RUN_TOKEN";

/// A new run token: 128 random bits from the kernel, in hex.
pub(crate) fn new_run_token() -> io::Result<String> {
    use std::io::Read;
    let mut b = [0u8; 16];
    std::fs::File::open("/dev/urandom")?.read_exact(&mut b)?;
    Ok(b.iter().map(|x| format!("{x:02x}")).collect())
}

/// True when `pid`'s environment holds `RUN_TOKEN=token`, in any of its
/// entries (the procfs crate's map would keep one value per name).
pub(crate) fn carries_token(pid: i32, token: &str) -> bool {
    let want = format!("{RUN_TOKEN}={token}");
    std::fs::read(format!("/proc/{pid}/environ"))
        .is_ok_and(|env| env.split(|b| *b == 0).any(|kv| kv == want.as_bytes()))
}

/// The state directory belongs to the service user (the child's uid): a
/// record larger than this is not ours.
pub(super) const MAX_RECORD: u64 = 1 << 20;

pub(super) fn record_path(state_dir: &Path) -> PathBuf {
    state_dir.join("tree.json")
}

pub(crate) fn boot_id() -> String {
    procfs::sys::kernel::random::boot_id().unwrap_or_default()
}

/// Write the warden's live descendants (the child's tree) to the state
/// directory, so that a warden started after this one was killed can find
/// them.
pub(crate) fn record_tree(state_dir: &Path, instance: &str, token: &str) -> io::Result<()> {
    let tree: Vec<Recorded> = descendants(std::process::id() as i32)
        .into_iter()
        .map(|p| Recorded { pid: p.pid, start_time: p.start_time })
        .collect();
    std::fs::create_dir_all(state_dir)?;
    let record = RecordedTree { boot_id: boot_id(), instance: instance.to_string(), token: token.to_string(), tree };
    let text = serde_json::to_string(&record).map_err(io::Error::other)?;
    replace(&record_path(state_dir), text.as_bytes(), 0o600)
}

/// The tree is gone: forget it.
pub(crate) fn clear_record(state_dir: &Path) {
    let _ = std::fs::remove_file(record_path(state_dir));
}

/// Read a small regular file of the state directory, never following a
/// symlink and never blocking on a FIFO or a device
/// ([`crate::util::fsutil::read_small`]).
pub(crate) fn read_state_file(path: &Path, max: u64) -> io::Result<Vec<u8>> {
    crate::util::fsutil::read_small(path, max, crate::util::fsutil::Links::Refuse)
}

/// Processes that may never be signalled as leftovers, whatever a record
/// says: pid 1, the warden itself and each of its ancestors.
pub(super) fn protected() -> BTreeSet<i32> {
    let mut out = BTreeSet::from([1, std::process::id() as i32]);
    let mut pid = std::process::id() as i32;
    while let Some(st) = read_stat(pid) {
        if st.ppid <= 0 || !out.insert(st.ppid) {
            break;
        }
        pid = st.ppid;
    }
    out
}

/// Our own unit's cgroup, when the warden runs as a systemd service: the
/// only place its leftovers can be.
pub(super) fn own_service_cgroup() -> Option<String> {
    std::env::var_os("INVOCATION_ID")?;
    let cg = cgroup_of(std::process::id() as i32)?;
    cg.ends_with(".service").then_some(cg)
}

/// `pid`'s cgroup v2 path (`0::/system.slice/x.service`); `None` for a
/// process that is gone, or a table that does not parse (a cgroup's name,
/// which the kernel does not escape, holding a newline).
pub(super) fn cgroup_of(pid: i32) -> Option<String> {
    use procfs::FromRead;
    let groups = procfs::ProcessCGroups::from_file(format!("/proc/{pid}/cgroup")).ok()?;
    groups.into_iter().find(|g| g.hierarchy == 0 && g.controllers.is_empty()).map(|g| g.pathname)
}

/// Recorded processes still alive with the same start time, and their live
/// descendants (whatever their group or session). The record is trusted
/// for nothing: it must be this boot's and this instance's, and each
/// process must carry the recorded run token in its own environment; a pid
/// now used by another process, a process of another user, one outside the
/// unit's cgroup (under systemd), pid 1, the warden and its ancestors are
/// left out.
pub(crate) fn leftovers(state_dir: &Path, instance: &str) -> Vec<ProcStat> {
    leftovers_at(&record_path(state_dir), instance)
}

/// Where the weight-cache daemon (`[preload]`) is recorded: beside the
/// engine's tree, which never holds it.
fn daemon_record_path(state_dir: &Path) -> PathBuf {
    state_dir.join("weight-cache.json")
}

/// Record the weight-cache daemon `pid` (started at `start_time`, carrying
/// `token`), so that a warden started after this one was killed stops it.
pub(crate) fn record_daemon(
    state_dir: &Path,
    instance: &str,
    token: &str,
    pid: i32,
    start_time: u64,
) -> io::Result<()> {
    std::fs::create_dir_all(state_dir)?;
    let record = RecordedTree {
        boot_id: boot_id(),
        instance: instance.to_string(),
        token: token.to_string(),
        tree: vec![Recorded { pid, start_time }],
    };
    let text = serde_json::to_string(&record).map_err(io::Error::other)?;
    replace(&daemon_record_path(state_dir), text.as_bytes(), 0o600)
}

/// The weight-cache daemon is gone: forget it.
pub(crate) fn clear_daemon_record(state_dir: &Path) {
    let _ = std::fs::remove_file(daemon_record_path(state_dir));
}

/// What is left of a weight-cache daemon an earlier warden recorded, by
/// the same rules as [`leftovers`].
pub(crate) fn daemon_leftovers(state_dir: &Path, instance: &str) -> Vec<ProcStat> {
    leftovers_at(&daemon_record_path(state_dir), instance)
}

fn leftovers_at(path: &Path, instance: &str) -> Vec<ProcStat> {
    let path = path.to_path_buf();
    let text = match read_state_file(&path, MAX_RECORD) {
        Ok(t) => t,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Vec::new(),
        Err(e) => {
            tracing::warn!(file = %path.display(), error = %e, "tree record ignored");
            return Vec::new();
        }
    };
    let record: RecordedTree = match serde_json::from_slice(&text) {
        Ok(r) => r,
        Err(e) => {
            tracing::warn!(file = %path.display(), error = %e, "tree record ignored: not a record");
            return Vec::new();
        }
    };
    if record.boot_id != boot_id() || record.instance != instance {
        tracing::info!(file = %path.display(), "tree record of another boot or instance ignored");
        return Vec::new();
    }
    let protected = protected();
    let uid = nix::unistd::geteuid().as_raw();
    let cgroup = own_service_cgroup();
    let token = record.token.as_str();
    let ours = |p: &ProcStat| {
        !protected.contains(&p.pid)
            && !token.is_empty()
            && carries_token(p.pid, token)
            && std::fs::metadata(format!("/proc/{}", p.pid)).is_ok_and(|m| m.uid() == uid)
            && cgroup.as_ref().is_none_or(|cg| cgroup_of(p.pid).as_ref() == Some(cg))
    };
    let mut seen = BTreeSet::new();
    let mut out = Vec::new();
    for r in record.tree {
        let Some(st) = read_stat(r.pid) else { continue };
        if st.start_time != r.start_time || st.state == 'Z' || !ours(&st) {
            continue;
        }
        for p in std::iter::once(st).chain(descendants(r.pid)) {
            if ours(&p) && seen.insert(p.pid) {
                out.push(p);
            }
        }
    }
    out
}

/// The live processes of this warden's own tree before its first spawn:
/// only a predecessor that exec'd this warden (an upgrade) can have left
/// them, and they are provably that run's (this process is their parent or
/// subreaper). The warden's own helpers (a GPU query, the kernel-message
/// follower) are not running before the first spawn.
pub(crate) fn inherited_tree() -> Vec<ProcStat> {
    descendants(std::process::id() as i32).into_iter().filter(|p| p.state != 'Z').collect()
}

/// A process held by a pidfd: signals reach it and only it, and its exit
/// can be awaited, even though it is not our child.
pub(super) struct PidFd {
    pub(super) fd: tokio::io::unix::AsyncFd<OwnedFd>,
}

impl PidFd {
    /// Open a pidfd, and check that the pid still names the process `p`.
    pub(super) fn open(p: &ProcStat) -> Option<PidFd> {
        // SAFETY: pidfd_open takes a pid and flags and returns a new fd.
        let fd = unsafe { libc::syscall(libc::SYS_pidfd_open, p.pid, 0) };
        if fd < 0 {
            return None;
        }
        // SAFETY: the syscall returned a new descriptor that we now own.
        let owned = unsafe { OwnedFd::from_raw_fd(fd as i32) };
        // Checked after opening: from now on the pidfd cannot be recycled.
        if read_stat(p.pid).map(|s| s.start_time) != Some(p.start_time) {
            return None;
        }
        // SAFETY: `owned` is an open pidfd, owned by the AsyncFd from here on.
        let fd = unsafe { tokio::io::unix::AsyncFd::register_with_interest(owned, tokio::io::Interest::READABLE) };
        Some(PidFd { fd: fd.ok()? })
    }

    pub(super) fn signal(&self, sig: Signal) {
        use std::os::fd::AsRawFd;
        // SAFETY: pidfd_send_signal(fd, sig, NULL, 0).
        unsafe {
            libc::syscall(libc::SYS_pidfd_send_signal, self.fd.as_raw_fd(), sig as i32, std::ptr::null::<u8>(), 0);
        }
    }

    /// Returns when the process has exited (the pidfd becomes readable).
    pub(super) async fn exited(&self) {
        let _ = self.fd.readable().await;
    }
}

/// Leftover processes still there after SIGKILL (stuck in the kernel):
/// each pid with its state (`?` when it could not be read again).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error(
    "leftover process(es) survived SIGKILL: {}",
    .0.iter().map(|(pid, state)| format!("pid {pid} (state {state})")).collect::<Vec<_>>().join(", ")
)]
pub(crate) struct SurvivedKill(pub(crate) Vec<(i32, char)>);

/// Stop leftover processes as a stop does: `sig`, then SIGKILL after
/// `timeout`, then at most `kill_grace` more. `Err` lists the processes
/// still there.
pub(crate) async fn stop_leftovers(
    procs: &[ProcStat],
    sig: Signal,
    timeout: Duration,
    kill_grace: Duration,
) -> Result<(), SurvivedKill> {
    let fds: Vec<PidFd> = procs.iter().filter_map(PidFd::open).collect();
    for f in &fds {
        f.signal(sig);
    }
    if tokio::time::timeout(timeout, all_exited(&fds)).await.is_ok() {
        return Ok(());
    }
    for f in &fds {
        f.signal(Signal::SIGKILL);
    }
    if tokio::time::timeout(kill_grace, all_exited(&fds)).await.is_ok() {
        return Ok(());
    }
    let left = procs
        .iter()
        .filter(|p| read_stat(p.pid).is_some_and(|s| s.start_time == p.start_time && s.state != 'Z'))
        .map(|p| (p.pid, read_stat(p.pid).map_or('?', |s| s.state)))
        .collect();
    Err(SurvivedKill(left))
}

pub(super) async fn all_exited(fds: &[PidFd]) {
    for f in fds {
        f.exited().await;
    }
}
