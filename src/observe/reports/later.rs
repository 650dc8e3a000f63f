//! When a report's file work runs: the blocking pool for a run still there,
//! else one low-priority thread that yields to a start under way.

use std::io;
use std::sync::{Condvar, LazyLock, Mutex};
use std::time::{Duration, Instant};

pub(super) async fn blocking<T: Send + 'static>(f: impl FnOnce() -> T + Send + 'static) -> io::Result<T> {
    tokio::task::spawn_blocking(f).await.map_err(io::Error::other)
}

/// File work of a report, handed over now: to [`LATER`] when `later`, else
/// to the blocking pool. Its result when it is done.
pub(super) fn work<T: Send + 'static>(
    later: bool,
    f: impl FnOnce() -> T + Send + 'static,
) -> impl Future<Output = io::Result<T>> {
    let (tx, rx) = tokio::sync::oneshot::channel();
    let job: Work = Box::new(move || {
        let _ = tx.send(f());
    });
    let job = match LATER.as_ref().filter(|_| later) {
        Some(worker) => worker.send(job).err().map(|e| e.0),
        None => Some(job),
    };
    if let Some(job) = job {
        drop(tokio::task::spawn_blocking(job));
    }
    async move { rx.await.map_err(|_| io::Error::other("the report's file work panicked")) }
}

pub(super) type Work = Box<dyn FnOnce() + Send>;

/// The nice value of [`LATER`]'s thread where it cannot be `SCHED_IDLE`.
pub(super) const LATER_NICE: i32 = 10;

/// The file work of the reports of runs with nothing left (the log read,
/// the files, retention): one thread, at the lowest CPU priority
/// (`SCHED_IDLE`: any other thread of the machine that wakes takes its CPU
/// at once; at nice 10 a woken thread of the warden was seen waiting 3 ms
/// behind it, on a kernel that lets the running thread finish its slice),
/// one job at a time, in order. It yields to the start that goes on beside
/// it; a report the machine waits for (a run still there) uses the
/// blocking pool.
pub(super) static LATER: LazyLock<Option<std::sync::mpsc::Sender<Work>>> = LazyLock::new(|| {
    let (tx, rx) = std::sync::mpsc::channel::<Work>();
    let spawned = std::thread::Builder::new().name("failure reports".into()).spawn(move || {
        let idle = libc::sched_param { sched_priority: 0 };
        // SAFETY: sched_setscheduler on this thread (pid 0) reads `idle`;
        // setpriority on this thread (who = its tid) takes no pointer.
        unsafe {
            if libc::sched_setscheduler(0, libc::SCHED_IDLE, &idle) != 0 {
                libc::setpriority(libc::PRIO_PROCESS, nix::unistd::gettid().as_raw() as libc::id_t, LATER_NICE);
            }
        }
        for job in rx {
            wait_for_start();
            // A panic is the job's: its result is never sent; the thread goes on.
            let _ = std::panic::catch_unwind(std::panic::AssertUnwindSafe(job));
        }
    });
    spawned.ok().map(|_| tx)
});

/// How long at the most [`LATER`] waits for a start under way.
pub(super) const START_YIELD: Duration = Duration::from_secs(1);

/// Since when a start is under way: see [`start_under_way`].
pub(super) static STARTING: (Mutex<Option<Instant>>, Condvar) = (Mutex::new(None), Condvar::new());

/// A start is under way (`true`: its quick pre-start steps, its spawn and
/// its run until ready), or no longer (`false`: ready, failed, cancelled,
/// or waiting for the port, the GPUs, leftovers or the Ray cluster).
/// Meanwhile, and for [`START_YIELD`] at the most, the file work of the
/// reports of runs that are gone waits: it would take the CPU from the
/// start, which nothing of the report is needed for any more (even at
/// `SCHED_IDLE`, a thread in the kernel's file code keeps its CPU until
/// the call returns, on a kernel built without preemption).
pub fn start_under_way(on: bool) {
    let (since, changed) = &STARTING;
    let mut since = since.lock().unwrap_or_else(|p| p.into_inner());
    *since = on.then(Instant::now);
    changed.notify_all();
}

/// Says, when dropped, that the start is no longer under way.
pub struct StartOver;

impl Drop for StartOver {
    fn drop(&mut self) {
        start_under_way(false);
    }
}

/// Wait while a start is under way, up to [`START_YIELD`] after it began.
pub(super) fn wait_for_start() {
    let (since, changed) = &STARTING;
    let mut guard = since.lock().unwrap_or_else(|p| p.into_inner());
    while let Some(left) = guard.and_then(|t| START_YIELD.checked_sub(t.elapsed())) {
        guard = changed.wait_timeout(guard, left).unwrap_or_else(|p| p.into_inner()).0;
    }
}

/// Wait, up to `within`, for the file work handed over so far to be done.
pub async fn settle(within: Duration) {
    let _ = tokio::time::timeout(within, work(true, || ())).await;
}
