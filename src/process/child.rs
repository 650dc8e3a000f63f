//! The child's process tree: spawn in its own group, signal, reap, and find
//! every descendant through `/proc`, including those that left the group or
//! the session. Processes are only ever found by ancestry, never by name.
//! Backoff and patterns are not known here.
//!
//! The warden is a child subreaper, so an orphaned descendant is re-parented
//! to it: "our tree" is every process whose chain of parents reaches our pid.
//! One reaper, a thread of its own, reads every exit (`waitid(P_ALL)`)
//! without reaping it, reports it and reaps it; a spawn and that report
//! never interleave, so a child that dies at once is never mistaken for a
//! stranger. A reap can spin in the kernel: one that lasts too long is left
//! to its thread and a new reaper takes over (see [`reap_loop`]).

use std::collections::BTreeMap;
use std::fs::{File, OpenOptions};
use std::io::{self, Write};
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::atomic::AtomicBool;
use std::sync::{Arc, Mutex, MutexGuard};

use nix::sys::signal::{Signal, kill, killpg};
use nix::unistd::Pid;
use tokio::task::AbortHandle;

pub use crate::supervisor::outcome::Exit;
use crate::util::tasks::{Lifetime, Tasks};

mod procfs;
mod reaper;
mod watched;

pub use self::procfs::*;
use self::reaper::*;
pub(crate) use self::watched::spawn_watched;

/// The environment variable that names an upgrade's state file for the
/// successor (`daemon::upgrade`).
pub(crate) const UPGRADE_STATE_ENV: &str = "VLLM_WARDEN_UPGRADE_STATE";

/// The environment variables a child must never inherit: they would let it
/// talk to systemd in the warden's name.
pub(crate) const SCRUBBED_ENV: [&str; 4] = ["NOTIFY_SOCKET", "WATCHDOG_USEC", "WATCHDOG_PID", UPGRADE_STATE_ENV];

/// What the tree reports to the driver.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum TreeEvent {
    /// The process we spawned has exited (its zombie may not be reaped yet).
    LeaderExited { pid: u32, exit: Exit },
    /// After the leader's exit, `terminate` or `kill_all`: no process of the
    /// tree is left.
    Empty,
}

/// Make this process a child subreaper (`PR_SET_CHILD_SUBREAPER`).
pub(crate) fn become_subreaper() -> io::Result<()> {
    // SAFETY: prctl with PR_SET_CHILD_SUBREAPER takes one integer argument.
    let rc = unsafe { libc::prctl(libc::PR_SET_CHILD_SUBREAPER, 1 as libc::c_ulong, 0, 0, 0) };
    if rc == 0 { Ok(()) } else { Err(io::Error::last_os_error()) }
}

/// Empty this thread's signal mask. The warden calls it at start, before
/// any other thread exists: a SIGTERM blocked by whoever started it would
/// never reach its handler.
pub(crate) fn unblock_all_signals() -> io::Result<()> {
    let mut set = std::mem::MaybeUninit::<libc::sigset_t>::uninit();
    // SAFETY: sigemptyset initialises the set; sigprocmask reads it.
    let rc = unsafe {
        libc::sigemptyset(set.as_mut_ptr());
        libc::sigprocmask(libc::SIG_SETMASK, set.as_ptr(), std::ptr::null_mut())
    };
    if rc == 0 { Ok(()) } else { Err(io::Error::last_os_error()) }
}

/// Create the log file (and its folder) and append the start marker.
/// Returns the file, for the warden's log writer to append the child's
/// output to, and the offset after the marker, where following starts.
pub(crate) fn open_log(path: &Path, start: u32, now: std::time::SystemTime) -> io::Result<(File, u64)> {
    if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
        std::fs::create_dir_all(dir)?;
    }
    let mut f = OpenOptions::new().create(true).append(true).open(path)?;
    let stamp = humantime::format_rfc3339_seconds(now);
    writeln!(f, "--- vllm-warden: start {start} at {stamp} ---")?;
    let offset = f.metadata()?.len();
    Ok((f, offset))
}

/// What to run.
#[derive(Debug, Clone)]
pub(crate) struct ChildSpec {
    pub(crate) argv: Vec<String>,
    pub(crate) env: BTreeMap<String, String>,
    pub(crate) cwd: Option<PathBuf>,
}

struct Inner {
    leader: Option<i32>,
    /// The leader's exit has been seen (and reported).
    leader_exited: bool,
    /// Report `Empty` once the tree is gone.
    watching: bool,
    /// Set when `Empty` is reported for the run begun by the last spawn;
    /// see [`Tree::run_ended`].
    ended: Arc<AtomicBool>,
    /// SIGKILL every descendant found after each reap.
    killing: bool,
    events: Box<dyn Fn(TreeEvent) + Send>,
}

/// The child's process tree. Dropping it kills whatever is left.
pub(crate) struct Tree {
    inner: Arc<Mutex<Inner>>,
    me: i32,
    /// The task that watches the reaper's thread.
    reaper: Option<AbortHandle>,
}

/// A lock that a panicked holder cannot make unusable: the tree's state is
/// a few flags, valid whatever instant a panic struck.
fn lock(inner: &Mutex<Inner>) -> MutexGuard<'_, Inner> {
    inner.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
}

impl Tree {
    /// Become a subreaper and start reaping, on a thread watched by a task
    /// of `tasks`. Needs a tokio runtime.
    pub(crate) fn new(events: impl Fn(TreeEvent) + Send + 'static, tasks: &mut Tasks) -> io::Result<Tree> {
        become_subreaper()?;
        tree_thread(std::process::id() as i32);
        let inner = Arc::new(Mutex::new(Inner {
            leader: None,
            leader_exited: true,
            watching: false,
            ended: Arc::default(),
            killing: false,
            events: Box::new(events),
        }));
        let mut tree = Tree { inner, me: std::process::id() as i32, reaper: None };
        tree.start_reaper(tasks)?;
        Ok(tree)
    }

    /// Start (or start again, after it died) the reaper: a thread, watched
    /// as the task "reaper" (a panic there is that task's).
    pub(crate) fn start_reaper(&mut self, tasks: &mut Tasks) -> io::Result<()> {
        if let Some(old) = self.reaper.take() {
            old.abort();
        }
        // Every reaper and the watcher of reaps say here if they panic;
        // they are not joined (at the warden's exit they still wait).
        let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel();
        start_generation(self.inner.clone(), self.me, tx)?;
        self.reaper = Some(tasks.spawn("reaper", Lifetime::Owned, async move {
            match rx.recv().await {
                Some(panic) => std::panic::resume_unwind(panic),
                None => std::future::pending().await,
            }
        }));
        Ok(())
    }

    /// Spawn `spec` in its own process group, stdin from /dev/null, stdout and
    /// stderr to `output` (the write end of the warden's pipe: the caller
    /// closes its own copy after the spawn, so that the pipe ends when the
    /// last process of the tree holding it is gone), with a scrubbed
    /// environment.
    pub(crate) fn spawn(&self, spec: &ChildSpec, output: &std::os::fd::OwnedFd) -> io::Result<u32> {
        let mut cmd = Command::new(&spec.argv[0]);
        cmd.args(&spec.argv[1..])
            .stdin(Stdio::null())
            .stdout(Stdio::from(output.try_clone()?))
            .stderr(Stdio::from(output.try_clone()?))
            .process_group(0)
            .envs(&spec.env);
        for var in SCRUBBED_ENV {
            cmd.env_remove(var);
        }
        if let Some(cwd) = &spec.cwd {
            cmd.current_dir(cwd);
        }
        // The child must start able to receive its stop signal whatever mask
        // the warden was started with: std empties the signal mask (and
        // restores SIGPIPE) in every child it starts. With no code of ours to
        // run between fork and exec, it starts the child with posix_spawn,
        // without copying the warden's page tables.
        let mut inner = lock(&self.inner);
        tree_thread(nix::unistd::gettid().as_raw());
        let child = cmd.spawn()?;
        let pid = child.id();
        // The reaper collects it; std's handle must not.
        drop(child);
        children_born();
        inner.leader = Some(pid as i32);
        inner.leader_exited = false;
        inner.watching = false;
        inner.ended = Arc::default();
        inner.killing = false;
        Ok(pid)
    }

    /// Take `pid`, already our child (a predecessor's, before an upgrade's
    /// exec), as the leader.
    pub(crate) fn adopt(&self, pid: u32) {
        let mut inner = lock(&self.inner);
        inner.leader = Some(pid as i32);
        inner.leader_exited = false;
        inner.watching = false;
        inner.ended = Arc::default();
        inner.killing = false;
        // It may have exited during the exec: its exit waits for the
        // reaper, which may have read it before the leader was known.
        let me = self.me;
        if let Some(exit) = exit_of(pid as i32) {
            inner.leader_exit(pid as i32, exit);
            inner.after_exit(me);
        }
    }

    /// Set once nothing is left of the run begun by the last spawn (or
    /// adoption), `Empty` reported, and for good (after the leader's exit,
    /// no process can join the tree before the next spawn): what works on
    /// that run after it (its failure report) sees when there is nothing
    /// left to look at and it no longer holds up anything.
    pub(crate) fn run_ended(&self) -> Arc<AtomicBool> {
        lock(&self.inner).ended.clone()
    }

    /// The leader while it lives.
    pub(crate) fn leader(&self) -> Option<u32> {
        let inner = lock(&self.inner);
        inner.leader.filter(|_| !inner.leader_exited).map(|p| p as u32)
    }

    /// Send `sig` to the leader if it is alive, else to every descendant
    /// left; then report `Empty` when the tree is gone.
    pub(crate) fn terminate(&self, sig: Signal) {
        let mut inner = lock(&self.inner);
        inner.watching = true;
        match inner.leader {
            Some(pid) if !inner.leader_exited => {
                let _ = kill(Pid::from_raw(pid), sig);
            }
            _ => {
                let left = descendants(self.me);
                for d in &left {
                    let _ = kill(Pid::from_raw(d.pid), sig);
                }
                // Those signalled are seen gone as they are reaped.
                if left.is_empty() {
                    inner.gone();
                }
            }
        }
    }

    /// SIGKILL the leader's group and every descendant, until none is left;
    /// then report `Empty`.
    pub(crate) fn kill_all(&self) {
        let mut inner = lock(&self.inner);
        inner.watching = true;
        inner.killing = true;
        if let Some(pid) = inner.leader {
            let _ = killpg(Pid::from_raw(pid), Signal::SIGKILL);
        }
        kill_descendants(self.me);
        inner.check_empty(self.me);
    }
}

impl Drop for Tree {
    fn drop(&mut self) {
        if let Some(r) = self.reaper.take() {
            r.abort();
        }
        // A panic must not orphan the child: whatever is left is killed.
        let inner = lock(&self.inner);
        if let Some(pid) = inner.leader
            && !inner.leader_exited
        {
            let _ = killpg(Pid::from_raw(pid), Signal::SIGKILL);
        }
        kill_descendants(self.me);
    }
}

fn kill_descendants(me: i32) {
    for d in descendants(me) {
        let _ = kill(Pid::from_raw(d.pid), Signal::SIGKILL);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use nix::sys::wait::{WaitPidFlag, WaitStatus};

    /// A whole line as the kernel writes it (every field, to `exit_code`).
    #[test]
    fn stat_with_spaces_and_parens_in_the_name() {
        let text = "4242 (VLLM::Worker (0) x) S 4200 4242 4242 0 -1 4194560 100 0 0 0 5 3 0 0 20 0 12 0 987654 1000 50 18446744073709551615 94168284598272 94168284618153 140734773974640 0 0 0 0 0 0 0 0 0 17 0 0 0 0 0 0 94168284634160 94168284635776 94169179602944 140734773975582 140734773975602 140734773975602 140734773977067 0\n";
        let st = parse_stat(text).unwrap();
        assert_eq!(st, ProcStat { pid: 4242, ppid: 4200, state: 'S', start_time: 987654 });
    }

    /// `sleep` run under a name of its own choosing (the name the kernel
    /// shows is the basename of the path it was exec'd by).
    fn sleep_named(dir: &Path, name: &std::ffi::OsStr) -> std::process::Child {
        let path = dir.join(name);
        std::os::unix::fs::symlink(which::which("sleep").unwrap(), &path).unwrap();
        Command::new(&path).arg0("sleep").arg("30").spawn().unwrap()
    }

    /// A process that names itself like the fields after its name, or
    /// with bytes that are not UTF-8, is read right, and found in the tree.
    #[test]
    fn a_hostile_name_is_read_right() {
        use std::os::unix::ffi::OsStrExt;
        let dir = tempfile::tempdir().unwrap();
        let me = std::process::id() as i32;
        for name in [&b"a) R 1 2 ("[..], &b"\xff) Z 1 (\xfe"[..]] {
            let mut child = sleep_named(dir.path(), std::ffi::OsStr::from_bytes(name));
            let pid = child.id() as i32;
            let st = read_stat(pid);
            let in_tree = descendants(me).iter().any(|p| p.pid == pid);
            let _ = child.kill();
            let _ = child.wait();
            let st = st.unwrap_or_else(|| panic!("{:?} read", String::from_utf8_lossy(name)));
            assert_eq!((st.pid, st.ppid), (pid, me));
            assert_ne!(st.state, 'Z');
            assert!(st.start_time > 0);
            assert!(in_tree, "{:?} in the tree", String::from_utf8_lossy(name));
        }
        // A pid above any pid_max: no such process, gone, not an error.
        assert_eq!(read_stat(i32::MAX), None);
    }

    #[test]
    fn our_own_stat_parses() {
        let me = std::process::id() as i32;
        let st = read_stat(me).unwrap();
        assert_eq!(st.pid, me);
        assert!(st.start_time > 0);
    }

    /// The walk down the children files finds what a pass over all of
    /// `/proc` finds: the shell and both of its sleeps, parents first.
    #[test]
    fn the_walk_finds_what_the_scan_finds() {
        use std::io::BufRead;
        assert!(children_files(), "this kernel lists children (CONFIG_PROC_CHILDREN)");
        let mut sh = Command::new("sh")
            .args(["-c", "sleep 30 & sleep 30 & echo forked; wait"])
            .stdout(Stdio::piped())
            .spawn()
            .unwrap();
        let mut line = String::new();
        std::io::BufReader::new(sh.stdout.take().unwrap()).read_line(&mut line).unwrap();
        assert_eq!(line, "forked\n");
        let me = std::process::id() as i32;
        let pids = |v: Vec<ProcStat>| v.into_iter().map(|p| p.pid).collect::<Vec<_>>();
        let walked = pids(descendants(me));
        let scanned = pids(descendants_by_scan(me));
        let _ = killpg(Pid::from_raw(sh.id() as i32), Signal::SIGKILL);
        let _ = kill(Pid::from_raw(sh.id() as i32), Signal::SIGKILL);
        for d in &walked {
            let _ = kill(Pid::from_raw(*d), Signal::SIGKILL);
        }
        let _ = sh.wait();
        assert_eq!(walked.len(), 3, "{walked:?}");
        assert_eq!(walked[0], sh.id() as i32);
        let (mut a, mut b) = (walked.clone(), scanned);
        a.sort_unstable();
        b.sort_unstable();
        assert_eq!(a, b);
    }

    /// The one look at our children agrees with the walk: a live child is
    /// left; an exited leader's zombie, its exit seen (WNOWAIT), is not.
    #[test]
    fn the_quick_look_agrees_with_the_walk() {
        let me = std::process::id() as i32;
        let mut live = Command::new("sleep").arg("30").spawn().unwrap();
        assert!(any_left(me, None));
        let _ = live.kill();
        let _ = live.wait();
        let mut done = Command::new("true").spawn().unwrap();
        let pid = done.id() as i32;
        let flags = WaitPidFlag::WEXITED | WaitPidFlag::WNOWAIT;
        assert!(matches!(
            nix::sys::wait::waitid(nix::sys::wait::Id::Pid(Pid::from_raw(pid)), flags),
            Ok(WaitStatus::Exited(..))
        ));
        assert_eq!(read_stat(pid).map(|s| s.state), Some('Z'));
        assert_eq!(any_left(me, Some(pid)), !descendants(me).is_empty());
        let _ = done.wait();
    }

    #[test]
    fn exit_reads_well() {
        assert_eq!(Exit::Code(1).to_string(), "exit code 1");
        assert_eq!(Exit::Signal(crate::supervisor::Signal::SIGKILL).to_string(), "killed by SIGKILL");
        assert_eq!(
            Exit::Signal(crate::supervisor::Signal::SIGILL).to_string(),
            "killed by SIGILL: illegal instruction"
        );
    }
}
