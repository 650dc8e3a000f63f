//! The reaper: a thread of its own reads every exit (`waitid(P_ALL)`)
//! without reaping it, reports it and reaps it; a reap that lasts too long
//! is left to its thread and a new reaper takes over.

use std::io;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex, MutexGuard};

use nix::errno::Errno;
use nix::sys::wait::{Id, WaitPidFlag, WaitStatus, waitid, waitpid};
use nix::unistd::Pid;

use super::*;

/// The leader's exit, read without reaping it.
pub(super) fn exit_of(pid: i32) -> Option<Exit> {
    let flags = WaitPidFlag::WEXITED | WaitPidFlag::WNOHANG | WaitPidFlag::WNOWAIT;
    match waitid(Id::Pid(Pid::from_raw(pid)), flags) {
        Ok(WaitStatus::Exited(_, code)) => Some(Exit::Code(code)),
        Ok(WaitStatus::Signaled(_, sig, _)) => Some(Exit::Signal(crate::process::signal::core(sig))),
        _ => None,
    }
}

/// Children may exist again: a reaper that found none waits for this.
pub(super) static BORN: (Mutex<u64>, std::sync::Condvar) = (Mutex::new(0), std::sync::Condvar::new());

/// Wake a reaper waiting for children (a spawn, a helper started).
pub(super) fn children_born() {
    *BORN.0.lock().unwrap_or_else(|p| p.into_inner()) += 1;
    BORN.1.notify_all();
}

/// How long a reaper without children waits before it looks again, in case
/// a child was started without [`children_born`].
pub(super) const CHILDLESS_LOOK: std::time::Duration = std::time::Duration::from_millis(200);

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
pub(super) fn reap_loop(inner: &Mutex<Inner>, me: i32, generation: u64) {
    loop {
        if WATCH.state().generation != generation {
            return;
        }
        let born = *BORN.0.lock().unwrap_or_else(|p| p.into_inner());
        let seen = waitid(Id::All, WaitPidFlag::WEXITED | WaitPidFlag::WNOWAIT);
        let (pid, exit) = match seen {
            Ok(WaitStatus::Exited(pid, code)) => (pid, Exit::Code(code)),
            Ok(WaitStatus::Signaled(pid, sig, _)) => (pid, Exit::Signal(crate::process::signal::core(sig))),
            Ok(_) | Err(Errno::EINTR) => continue,
            Err(Errno::ECHILD) => {
                let count = BORN.0.lock().unwrap_or_else(|p| p.into_inner());
                let _ = BORN.1.wait_timeout_while(count, CHILDLESS_LOOK, |n| *n == born);
                continue;
            }
            Err(e) => panic!("waitid: {e}"),
        };
        let pid = pid.as_raw();
        // The weight-cache daemon's exit, to whoever waits for it.
        super::watched::exited(pid, exit);
        // A zombie whose reaper was handed over before it took it (a thread
        // held off the CPU that long) is taken here: while it is there, the
        // kernel shows it first to every wait and the exits behind it would
        // never be seen. Its exit was reported; its old reaper's wait finds
        // nothing.
        let taken_over = being_reaped(pid);
        let _unreaped = (!taken_over).then(|| Unreaped::new(pid));
        let leader = {
            let mut i = lock(inner);
            if !taken_over {
                let running = i.leader.is_some_and(|l| l != pid) && !i.leader_exited;
                if running && crate::util::tasks::injected_panic("reaper") {
                    panic!("injected for a test (VLLM_WARDEN_TEST_PANIC)");
                }
                i.leader_exit(pid, exit);
            }
            i.leader == Some(pid)
        };
        let reap = WATCH.begin(generation, pid);
        let began = std::time::Instant::now();
        if leader
            && !taken_over
            && let Some(hold) = crate::util::tasks::injected_slow_reap()
        {
            // A test's stand-in for a reaper held between reading the exit
            // and the reap: the zombie stays until the next reaper takes it.
            std::thread::sleep(hold);
        }
        // Another waiter may have taken it first (a helper's own wait).
        let _ = waitpid(Pid::from_raw(pid), Some(WaitPidFlag::WNOHANG));
        let took = began.elapsed();
        if took >= SLOW_REAP {
            tracing::debug!(EVENT = "reap", "the reap of pid {pid} took {} ms", took.as_millis());
        }
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
pub(super) static UNREAPED: Mutex<Vec<i32>> = Mutex::new(Vec::new());

/// A pid in [`UNREAPED`] until its reap has returned, or its reaper has
/// panicked before the reap (then the next reaper reaps it).
pub(super) struct Unreaped(i32);

impl Unreaped {
    pub(super) fn new(pid: i32) -> Unreaped {
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
pub(super) fn being_reaped(pid: i32) -> bool {
    UNREAPED.lock().unwrap_or_else(|p| p.into_inner()).contains(&pid)
}

/// A reap that lasts this long is logged (at debug level) with how long it
/// took: far beyond the kernel's usual wait, short of [`REAP_PATIENCE`].
pub(super) const SLOW_REAP: std::time::Duration = std::time::Duration::from_millis(10);

/// How long a reap may last before a new reaper takes over the waiting
/// for exits: far beyond the kernel's usual wait (up to 1.4 ms seen).
pub(super) const REAP_PATIENCE: std::time::Duration = std::time::Duration::from_millis(200);

/// The reaps under way, watched by [`watch_reaps`].
pub(super) struct Watch {
    pub(super) state: Mutex<WatchState>,
    pub(super) changed: std::sync::Condvar,
}

pub(super) struct WatchState {
    /// The generation of the reaper that waits for exits.
    pub(super) generation: u64,
    /// Reaps begun so far, and the one under way: its number, reaper's
    /// generation and pid.
    pub(super) begun: u64,
    pub(super) reaping: Option<(u64, u64, i32)>,
    /// What a new reaper needs: the tree, the warden's pid, where a panic
    /// is told.
    pub(super) tree: Option<(Arc<Mutex<Inner>>, i32, Panics)>,
}

pub(super) type Panics = tokio::sync::mpsc::UnboundedSender<Box<dyn std::any::Any + Send>>;

pub(super) static WATCH: Watch = Watch {
    state: Mutex::new(WatchState { generation: 0, begun: 0, reaping: None, tree: None }),
    changed: std::sync::Condvar::new(),
};

impl Watch {
    pub(super) fn state(&self) -> MutexGuard<'_, WatchState> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// A reap by the reaper of `generation` begins: its number.
    pub(super) fn begin(&self, generation: u64, pid: i32) -> u64 {
        let mut s = self.state();
        s.begun += 1;
        let n = s.begun;
        s.reaping = Some((n, generation, pid));
        self.changed.notify_all();
        n
    }

    /// Reap `n` has returned: false if it was handed over meanwhile.
    pub(super) fn end(&self, n: u64) -> bool {
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
pub(super) fn start_generation(inner: Arc<Mutex<Inner>>, me: i32, panics: Panics) -> io::Result<()> {
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
pub(super) fn spawn_watched(name: &str, panics: Panics, f: impl FnOnce() + Send + 'static) -> io::Result<()> {
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
pub(super) fn watch_reaps() {
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
    pub(super) fn leader_exit(&mut self, pid: i32, exit: Exit) {
        if self.leader == Some(pid) && !self.leader_exited {
            self.leader_exited = true;
            self.watching = true;
            (self.events)(TreeEvent::LeaderExited { pid: pid as u32, exit });
        }
    }

    /// After an exit: what is left of a tree being killed is killed;
    /// `Empty` is reported once nothing is left.
    pub(super) fn after_exit(&mut self, me: i32) {
        if self.killing {
            kill_descendants(me);
        }
        self.check_empty(me);
    }

    pub(super) fn check_empty(&mut self, me: i32) {
        if self.watching && (self.leader.is_none() || self.leader_exited) && !any_left(me, self.leader) {
            self.gone();
        }
    }

    pub(super) fn gone(&mut self) {
        self.ended.store(true, Ordering::SeqCst);
        self.watching = false;
        self.killing = false;
        (self.events)(TreeEvent::Empty);
    }
}
