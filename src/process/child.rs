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

use std::collections::{BTreeMap, HashMap, HashSet, VecDeque};
use std::fs::{File, OpenOptions};
use std::io::{self, Write};
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};

use nix::errno::Errno;
use nix::sys::signal::{Signal, kill, killpg};
use nix::sys::wait::{Id, WaitPidFlag, WaitStatus, waitid, waitpid};
use nix::unistd::Pid;
use tokio::task::AbortHandle;

pub use crate::supervisor::outcome::Exit;
use crate::util::tasks::{Lifetime, Tasks};

/// The environment variable that names an upgrade's state file for the
/// successor (`daemon::upgrade`).
pub const UPGRADE_STATE_ENV: &str = "VLLM_WARDEN_UPGRADE_STATE";

/// The environment variables a child must never inherit: they would let it
/// talk to systemd in the warden's name.
pub const SCRUBBED_ENV: [&str; 4] = ["NOTIFY_SOCKET", "WATCHDOG_USEC", "WATCHDOG_PID", UPGRADE_STATE_ENV];

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
pub fn become_subreaper() -> io::Result<()> {
    // SAFETY: prctl with PR_SET_CHILD_SUBREAPER takes one integer argument.
    let rc = unsafe { libc::prctl(libc::PR_SET_CHILD_SUBREAPER, 1 as libc::c_ulong, 0, 0, 0) };
    if rc == 0 { Ok(()) } else { Err(io::Error::last_os_error()) }
}

/// Empty this thread's signal mask. The warden calls it at start, before
/// any other thread exists: a SIGTERM blocked by whoever started it would
/// never reach its handler.
pub fn unblock_all_signals() -> io::Result<()> {
    let mut set = std::mem::MaybeUninit::<libc::sigset_t>::uninit();
    // SAFETY: sigemptyset initialises the set; sigprocmask reads it.
    let rc = unsafe {
        libc::sigemptyset(set.as_mut_ptr());
        libc::sigprocmask(libc::SIG_SETMASK, set.as_ptr(), std::ptr::null_mut())
    };
    if rc == 0 { Ok(()) } else { Err(io::Error::last_os_error()) }
}

/// One line of `/proc/PID/stat` that we need.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ProcStat {
    pub pid: i32,
    pub ppid: i32,
    pub state: char,
    /// Start time in clock ticks after boot: with the pid, names a process
    /// uniquely.
    pub start_time: u64,
}

/// Parse `/proc/PID/stat`; the command name may hold spaces and ')'.
pub fn parse_stat(text: &str) -> Option<ProcStat> {
    let open = text.find('(')?;
    let close = text.rfind(')')?;
    let pid = text[..open].trim().parse().ok()?;
    let rest: Vec<&str> = text[close + 1..].split_whitespace().collect();
    // Fields after the name: state(3) ppid(4) … starttime(22).
    Some(ProcStat {
        pid,
        state: rest.first()?.chars().next()?,
        ppid: rest.get(1)?.parse().ok()?,
        start_time: rest.get(19)?.parse().ok()?,
    })
}

pub fn read_stat(pid: i32) -> Option<ProcStat> {
    parse_stat(&std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?)
}

/// The warden's own helper processes that live beside the child's tree
/// (the kernel-message follower): pid and start time. They and their
/// descendants are never taken for part of the tree.
static HELPERS: Mutex<Vec<(i32, u64)>> = Mutex::new(Vec::new());

/// `pid`, a child of the warden, is a helper, not part of the tree.
pub fn register_helper(pid: i32) {
    if let Some(st) = read_stat(pid) {
        HELPERS.lock().unwrap_or_else(|p| p.into_inner()).push((pid, st.start_time));
    }
    children_born();
}

pub fn unregister_helper(pid: i32) {
    HELPERS.lock().unwrap_or_else(|p| p.into_inner()).retain(|(p, _)| *p != pid);
}

fn is_helper(st: &ProcStat) -> bool {
    HELPERS.lock().unwrap_or_else(|p| p.into_inner()).contains(&(st.pid, st.start_time))
}

/// Every live descendant of `root` (zombies left out), parents first; the
/// warden's helpers and their descendants left out.
///
/// Found by following `/proc/PID/task/TID/children` down from `root`,
/// which costs a few reads per process of the tree, whatever else runs on
/// the machine; where the kernel has no such files, by one pass over every
/// process in `/proc`. A process that exits during the walk hands its
/// children to the nearest subreaper (the warden, for its own tree): the
/// walk is made again until `root`'s children stay the same.
pub fn descendants(root: i32) -> Vec<ProcStat> {
    if !children_files() {
        return descendants_by_scan(root);
    }
    let mut last = None;
    for _ in 0..WALKS {
        let before = children(root);
        let out = walk(root, before.clone());
        if children(root) == before {
            return out;
        }
        last = Some(out);
    }
    last.unwrap_or_default()
}

/// Walks of the tree until the root's children stay the same; beyond it
/// the last walk stands (the tree is changing as fast as it is read).
const WALKS: usize = 8;

fn walk(root: i32, first: Vec<i32>) -> Vec<ProcStat> {
    let mut out = Vec::new();
    let mut seen = HashSet::from([root]);
    let mut queue: VecDeque<i32> = first.into();
    while let Some(pid) = queue.pop_front() {
        if !seen.insert(pid) || being_reaped(pid) {
            continue;
        }
        let Some(st) = read_stat(pid) else { continue };
        if is_helper(&st) || st.state == 'Z' || st.state == 'X' {
            // A zombie has no children: they were handed on at its exit.
            continue;
        }
        queue.extend(children(pid));
        out.push(st);
    }
    out
}

/// The children of every thread of `pid`, in the kernel's order; none for
/// a process that is gone. For the warden itself, once it holds a [`Tree`],
/// only the threads its tree's processes can be children of.
fn children(pid: i32) -> Vec<i32> {
    let read = |path: &Path, out: &mut Vec<i32>| {
        if let Ok(text) = std::fs::read_to_string(path) {
            out.extend(text.split_ascii_whitespace().filter_map(|p| p.parse::<i32>().ok()));
        }
    };
    let mut out = Vec::new();
    if pid == std::process::id() as i32
        && let Some(tids) = TREE_THREADS.get()
    {
        let tids = tids.lock().unwrap_or_else(|p| p.into_inner()).clone();
        for tid in tids {
            read(Path::new(&format!("/proc/{pid}/task/{tid}/children")), &mut out);
        }
        return out;
    }
    let Ok(tasks) = std::fs::read_dir(format!("/proc/{pid}/task")) else { return Vec::new() };
    for task in tasks.flatten() {
        read(&task.path().join("children"), &mut out);
    }
    out
}

/// The warden's threads whose children can be part of its tree: the main
/// thread, to which the kernel hands every orphan of a subreaper (the first
/// of its threads alive), and each thread that has spawned a leader (the
/// loop's, which is the main one). The others start only the warden's own
/// helpers, never part of the tree; reading only these few children files
/// spares a look at the tree a read per thread of the warden. Set once a
/// [`Tree`] exists; before, every thread is read.
static TREE_THREADS: std::sync::OnceLock<Mutex<Vec<i32>>> = std::sync::OnceLock::new();

fn tree_thread(tid: i32) {
    let me = std::process::id() as i32;
    let mut tids = TREE_THREADS.get_or_init(|| Mutex::new(vec![me])).lock().unwrap_or_else(|p| p.into_inner());
    if !tids.contains(&tid) {
        tids.push(tid);
    }
}

/// Whether this kernel lists each task's children (`CONFIG_PROC_CHILDREN`).
fn children_files() -> bool {
    static HAS: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *HAS.get_or_init(|| {
        let tid = nix::unistd::gettid().as_raw();
        Path::new(&format!("/proc/self/task/{tid}/children")).exists()
    })
}

/// Every process listed in `/proc`, the warden's children being reaped
/// left out ([`being_reaped`]).
pub fn processes() -> impl Iterator<Item = i32> {
    std::fs::read_dir("/proc")
        .into_iter()
        .flatten()
        .flatten()
        .filter_map(|e| e.file_name().to_str().and_then(|s| s.parse::<i32>().ok()))
        .filter(|pid| !being_reaped(*pid))
}

/// [`descendants`] by one pass over every process in `/proc`.
fn descendants_by_scan(root: i32) -> Vec<ProcStat> {
    let mut children: HashMap<i32, Vec<ProcStat>> = HashMap::new();
    for st in processes().filter_map(read_stat) {
        children.entry(st.ppid).or_default().push(st);
    }
    let mut out = Vec::new();
    let mut queue = VecDeque::from([root]);
    while let Some(p) = queue.pop_front() {
        for st in children.remove(&p).unwrap_or_default() {
            if is_helper(&st) {
                continue;
            }
            queue.push_back(st.pid);
            if st.state != 'Z' && st.state != 'X' {
                out.push(st);
            }
        }
    }
    out
}

/// Whether a live process of `root`'s tree is left, `leader`'s zombie aside.
///
/// One look at `root`'s children answers when it finds a live one, or none
/// but helpers, that zombie and those whose exit the reaper has read: any
/// other process of the tree has a live ancestor among them, or was handed
/// to `root` when its parent exited, which they did before their exit was
/// seen. Another zombie (or a child gone meanwhile) may have handed its
/// children over during the look: the whole tree is walked then.
fn any_left(root: i32, leader: Option<i32>) -> bool {
    if children_files() {
        let mut sure = true;
        for pid in children(root) {
            if being_reaped(pid) {
                // Its exit was read after it had handed its children on.
                continue;
            }
            match read_stat(pid) {
                Some(st) if is_helper(&st) => {}
                Some(st) if st.state == 'Z' || st.state == 'X' => sure &= Some(pid) == leader,
                Some(_) => return true,
                None => sure = false,
            }
        }
        if sure {
            return false;
        }
    }
    !descendants(root).is_empty()
}

/// What is left of the warden's tree after SIGKILL: how many live
/// processes, and one description each: pid, state, `wchan` (where in the
/// kernel it waits) and name. Reads only `/proc/PID/{stat,wchan,comm}`,
/// which answer even for a process stuck in the kernel (its `cmdline` may
/// not). Zombies are not counted: they are gone but for their reap.
pub fn describe_survivors() -> (usize, String) {
    let me = std::process::id() as i32;
    let left = descendants(me);
    if left.is_empty() {
        return (0, "no live process of the tree is left after SIGKILL".into());
    }
    let read = |pid: i32, what: &str| {
        std::fs::read_to_string(format!("/proc/{pid}/{what}")).map(|s| s.trim().to_string()).unwrap_or_default()
    };
    let each: Vec<String> = left
        .iter()
        .map(|p| {
            let wchan = read(p.pid, "wchan");
            let wchan = if wchan.is_empty() || wchan == "0" { String::new() } else { format!(", wchan {wchan}") };
            let name = crate::util::escape::one_line(&read(p.pid, "comm"), 64);
            format!("pid {} ({name}, state {}{wchan})", p.pid, p.state)
        })
        .collect();
    let stuck = left.iter().any(|p| p.state == 'D');
    let why = if stuck {
        "stuck in the kernel (state D; for a GPU server, usually the driver): needs a GPU reset or a reboot"
    } else {
        "still there after SIGKILL"
    };
    (left.len(), format!("{} process(es) survived SIGKILL, {why}: {}", left.len(), each.join(", ")))
}

/// Create the log file (and its folder) and append the start marker.
/// Returns the file, for the child's stdout and stderr, and the offset after
/// the marker, where following starts.
pub fn open_log(path: &Path, start: u32, now: std::time::SystemTime) -> io::Result<(File, u64)> {
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
pub struct Spec {
    pub argv: Vec<String>,
    pub env: BTreeMap<String, String>,
    pub cwd: Option<PathBuf>,
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
pub struct Tree {
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
    pub fn new(events: impl Fn(TreeEvent) + Send + 'static, tasks: &mut Tasks) -> io::Result<Tree> {
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
    pub fn start_reaper(&mut self, tasks: &mut Tasks) -> io::Result<()> {
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
    /// stderr to `log`, with a scrubbed environment.
    pub fn spawn(&self, spec: &Spec, log: &File) -> io::Result<u32> {
        let mut cmd = Command::new(&spec.argv[0]);
        cmd.args(&spec.argv[1..])
            .stdin(Stdio::null())
            .stdout(log.try_clone()?)
            .stderr(log.try_clone()?)
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
    pub fn adopt(&self, pid: u32) {
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
    pub fn run_ended(&self) -> Arc<AtomicBool> {
        lock(&self.inner).ended.clone()
    }

    /// The leader while it lives.
    pub fn leader(&self) -> Option<u32> {
        let inner = lock(&self.inner);
        inner.leader.filter(|_| !inner.leader_exited).map(|p| p as u32)
    }

    /// Send `sig` to the leader if it is alive, else to every descendant
    /// left; then report `Empty` when the tree is gone.
    pub fn terminate(&self, sig: Signal) {
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
    pub fn kill_all(&self) {
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

/// The leader's exit, read without reaping it.
fn exit_of(pid: i32) -> Option<Exit> {
    let flags = WaitPidFlag::WEXITED | WaitPidFlag::WNOHANG | WaitPidFlag::WNOWAIT;
    match waitid(Id::Pid(Pid::from_raw(pid)), flags) {
        Ok(WaitStatus::Exited(_, code)) => Some(Exit::Code(code)),
        Ok(WaitStatus::Signaled(_, sig, _)) => Some(Exit::Signal(sig)),
        _ => None,
    }
}

/// Children may exist again: a reaper that found none waits for this.
static BORN: (Mutex<u64>, std::sync::Condvar) = (Mutex::new(0), std::sync::Condvar::new());

/// Wake a reaper waiting for children (a spawn, a helper started).
fn children_born() {
    *BORN.0.lock().unwrap_or_else(|p| p.into_inner()) += 1;
    BORN.1.notify_all();
}

/// How long a reaper without children waits before it looks again, in case
/// a child was started without [`children_born`].
const CHILDLESS_LOOK: std::time::Duration = std::time::Duration::from_millis(200);

/// The reaper's thread, of generation `generation`. Each exit is read
/// without reaping it (`WNOWAIT`); the leader's is reported at once; the
/// process is reaped at once, and then the tree looked at.
///
/// A reap removes the process's `/proc` entries and the kernel spins until
/// whoever is dropping one of them has done so: usually the child's own
/// last thread, for up to 1.4 ms; but on kernel 6.18 a vLLM process's reap
/// was also seen spinning for 15 s to minutes (`shrink_dcache_parent` under
/// `release_task`; on a machine whose memory was mostly page cache). So
/// [`watch_reaps`] hands over to a new reaper when a reap lasts beyond
/// [`REAP_PATIENCE`]: the old one ends when its reap returns, and no later
/// exit waits for it.
fn reap_loop(inner: &Mutex<Inner>, me: i32, generation: u64) {
    loop {
        if WATCH.state().generation != generation {
            return;
        }
        let born = *BORN.0.lock().unwrap_or_else(|p| p.into_inner());
        let seen = waitid(Id::All, WaitPidFlag::WEXITED | WaitPidFlag::WNOWAIT);
        let (pid, exit) = match seen {
            Ok(WaitStatus::Exited(pid, code)) => (pid, Exit::Code(code)),
            Ok(WaitStatus::Signaled(pid, sig, _)) => (pid, Exit::Signal(sig)),
            Ok(_) | Err(Errno::EINTR) => continue,
            Err(Errno::ECHILD) => {
                let count = BORN.0.lock().unwrap_or_else(|p| p.into_inner());
                let _ = BORN.1.wait_timeout_while(count, CHILDLESS_LOOK, |n| *n == born);
                continue;
            }
            Err(e) => panic!("waitid: {e}"),
        };
        let pid = pid.as_raw();
        if being_reaped(pid) {
            // Its reaper was handed over from before it took the zombie
            // (a thread held off the CPU that long): it takes it next.
            std::thread::sleep(TAKING);
            continue;
        }
        let _unreaped = Unreaped::new(pid);
        {
            let mut i = lock(inner);
            let running = i.leader.is_some_and(|l| l != pid) && !i.leader_exited;
            if running && crate::util::tasks::injected_panic("reaper") {
                panic!("injected for a test (VLLM_WARDEN_TEST_PANIC)");
            }
            i.leader_exit(pid, exit);
        }
        let reap = WATCH.begin(generation, pid);
        // Another waiter may have taken it first (a helper's own wait).
        let _ = waitpid(Pid::from_raw(pid), Some(WaitPidFlag::WNOHANG));
        if crate::util::tasks::injected_panic("reap") {
            // A test's stand-in for a reap that spins for ever in the
            // kernel after taking its zombie.
            loop {
                std::thread::park();
            }
        }
        if !WATCH.end(reap) {
            // Handed over: the new reaper looked at the tree for this exit.
            return;
        }
        lock(inner).after_exit(me);
    }
}

/// The exits read whose reap has not returned: see [`being_reaped`].
static UNREAPED: Mutex<Vec<i32>> = Mutex::new(Vec::new());

/// A pid in [`UNREAPED`] until its reap has returned, or its reaper has
/// panicked before the reap (then the next reaper reaps it).
struct Unreaped(i32);

impl Unreaped {
    fn new(pid: i32) -> Unreaped {
        UNREAPED.lock().unwrap_or_else(|p| p.into_inner()).push(pid);
        Unreaped(pid)
    }
}

impl Drop for Unreaped {
    fn drop(&mut self) {
        UNREAPED.lock().unwrap_or_else(|p| p.into_inner()).retain(|p| *p != self.0);
    }
}

/// Whether `pid` is one of the warden's children whose exit the reaper has
/// read and whose reap has not returned. Nothing of its `/proc` is read
/// then: it is a zombie with no children, and each of its `/proc` entries
/// looked up before the reap is one more that the reap must take down. A
/// number freed during a long reap and reused at once would be missed
/// meanwhile; pids are handed out in turn over `pid_max`, so that takes a
/// full cycle.
fn being_reaped(pid: i32) -> bool {
    UNREAPED.lock().unwrap_or_else(|p| p.into_inner()).contains(&pid)
}

/// How long a reaper that meets a zombie another reaper is about to take
/// waits before it looks again.
const TAKING: std::time::Duration = std::time::Duration::from_millis(1);

/// How long a reap may last before a new reaper takes over the waiting
/// for exits: far beyond the kernel's usual wait (up to 1.4 ms seen).
const REAP_PATIENCE: std::time::Duration = std::time::Duration::from_millis(200);

/// The reaps under way, watched by [`watch_reaps`].
struct Watch {
    state: Mutex<WatchState>,
    changed: std::sync::Condvar,
}

struct WatchState {
    /// The generation of the reaper that waits for exits.
    generation: u64,
    /// Reaps begun so far, and the one under way: its number, reaper's
    /// generation and pid.
    begun: u64,
    reaping: Option<(u64, u64, i32)>,
    /// What a new reaper needs: the tree, the warden's pid, where a panic
    /// is told.
    tree: Option<(Arc<Mutex<Inner>>, i32, Panics)>,
}

type Panics = tokio::sync::mpsc::UnboundedSender<Box<dyn std::any::Any + Send>>;

static WATCH: Watch = Watch {
    state: Mutex::new(WatchState { generation: 0, begun: 0, reaping: None, tree: None }),
    changed: std::sync::Condvar::new(),
};

impl Watch {
    fn state(&self) -> MutexGuard<'_, WatchState> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// A reap by the reaper of `generation` begins: its number.
    fn begin(&self, generation: u64, pid: i32) -> u64 {
        let mut s = self.state();
        s.begun += 1;
        let n = s.begun;
        s.reaping = Some((n, generation, pid));
        self.changed.notify_all();
        n
    }

    /// Reap `n` has returned: false if it was handed over meanwhile.
    fn end(&self, n: u64) -> bool {
        let mut s = self.state();
        match s.reaping {
            Some((m, ..)) if m == n => {
                s.reaping = None;
                self.changed.notify_all();
                true
            }
            _ => false,
        }
    }
}

/// Start a reaper of a new generation; the one before ends at its next
/// look. The watcher of reaps is started with the first.
fn start_generation(inner: Arc<Mutex<Inner>>, me: i32, panics: Panics) -> io::Result<()> {
    let generation = {
        let mut s = WATCH.state();
        s.generation += 1;
        s.tree = Some((inner.clone(), me, panics.clone()));
        s.generation
    };
    spawn_watched("reaper", panics.clone(), move || reap_loop(&inner, me, generation))?;
    static WATCHING: std::sync::Once = std::sync::Once::new();
    let mut started = Ok(());
    WATCHING.call_once(|| started = spawn_watched("reap watch", panics, watch_reaps));
    started
}

/// A thread whose panic is told through `panics`.
fn spawn_watched(name: &str, panics: Panics, f: impl FnOnce() + Send + 'static) -> io::Result<()> {
    std::thread::Builder::new().name(name.into()).spawn(move || {
        if let Err(panic) = std::panic::catch_unwind(std::panic::AssertUnwindSafe(f)) {
            let _ = panics.send(panic);
        }
    })?;
    Ok(())
}

/// The watcher of reaps: a reap that lasts beyond [`REAP_PATIENCE`] is left
/// to its thread; this one looks at the tree for that exit, as its reaper
/// would have after the reap, and starts a new reaper.
fn watch_reaps() {
    let mut s = WATCH.state();
    loop {
        let Some(reap) = s.reaping else {
            s = WATCH.changed.wait(s).unwrap_or_else(|p| p.into_inner());
            continue;
        };
        let (later, timeout) = WATCH
            .changed
            .wait_timeout_while(s, REAP_PATIENCE, |w| w.reaping == Some(reap))
            .unwrap_or_else(|p| p.into_inner());
        s = later;
        if !timeout.timed_out() || s.reaping != Some(reap) {
            continue;
        }
        s.reaping = None;
        let Some((inner, me, panics)) = s.tree.clone() else { continue };
        drop(s);
        tracing::warn!(
            EVENT = "reap",
            "the reap of pid {} has lasted over {} ms (the kernel is still taking down its /proc entries): \
             a new reaper waits for the other exits",
            reap.2,
            REAP_PATIENCE.as_millis()
        );
        lock(&inner).after_exit(me);
        if let Err(e) = start_generation(inner, me, panics) {
            tracing::error!(EVENT = "reap", "cannot start a new reaper: {e}");
        }
        s = WATCH.state();
    }
}

impl Inner {
    /// `pid` has exited (its zombie is not reaped yet): the leader's exit is
    /// reported.
    fn leader_exit(&mut self, pid: i32, exit: Exit) {
        if self.leader == Some(pid) && !self.leader_exited {
            self.leader_exited = true;
            self.watching = true;
            (self.events)(TreeEvent::LeaderExited { pid: pid as u32, exit });
        }
    }

    /// After an exit: what is left of a tree being killed is killed;
    /// `Empty` is reported once nothing is left.
    fn after_exit(&mut self, me: i32) {
        if self.killing {
            kill_descendants(me);
        }
        self.check_empty(me);
    }

    fn check_empty(&mut self, me: i32) {
        if self.watching && (self.leader.is_none() || self.leader_exited) && !any_left(me, self.leader) {
            self.gone();
        }
    }

    fn gone(&mut self) {
        self.ended.store(true, Ordering::SeqCst);
        self.watching = false;
        self.killing = false;
        (self.events)(TreeEvent::Empty);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stat_with_spaces_and_parens_in_the_name() {
        let text = "4242 (VLLM::Worker (0) x) S 4200 4242 4242 0 -1 4194560 100 0 0 0 5 3 0 0 20 0 12 0 987654 1000 50 18446744073709551615";
        let st = parse_stat(text).unwrap();
        assert_eq!(st, ProcStat { pid: 4242, ppid: 4200, state: 'S', start_time: 987654 });
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
        assert_eq!(Exit::Signal(Signal::SIGKILL).to_string(), "killed by SIGKILL");
        assert_eq!(Exit::Signal(Signal::SIGILL).to_string(), "killed by SIGILL: illegal instruction");
    }
}
