//! When a report's file work runs: the blocking pool for a run still there,
//! else one low-priority thread that yields to a start under way.

use std::io;
use std::sync::{Condvar, LazyLock, Mutex};
use std::time::{Duration, Instant};

use crate::util::worker::Worker;

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
    // A full queue hands the job to the blocking pool: it is not dropped.
    let job = match LATER.as_ref().filter(|_| later) {
        Some(worker) => worker.try_send(job).err(),
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
pub(super) static LATER: LazyLock<Option<Worker<Work>>> = LazyLock::new(|| {
    let mut idle = false;
    let worker = Worker::named("failure reports", LATER_QUEUE).stack(LATER_STACK).start(move |job: Work| {
        if !std::mem::replace(&mut idle, true) {
            lowest_priority();
        }
        wait_for_start();
        job();
    });
    worker.ok()
});

/// How many jobs may wait for [`LATER`]; more go to the blocking pool.
const LATER_QUEUE: usize = 64;

/// [`LATER`]'s stack: a report's parts read logs and compress them.
const LATER_STACK: usize = 1 << 20;

/// This thread at `SCHED_IDLE`, else at nice [`LATER_NICE`].
fn lowest_priority() {
    let idle = libc::sched_param { sched_priority: 0 };
    // SAFETY: sched_setscheduler on this thread (pid 0) reads `idle`;
    // setpriority on this thread (who = its tid) takes no pointer.
    unsafe {
        if libc::sched_setscheduler(0, libc::SCHED_IDLE, &idle) != 0 {
            libc::setpriority(libc::PRIO_PROCESS, nix::unistd::gettid().as_raw() as libc::id_t, LATER_NICE);
        }
    }
}

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
pub(crate) fn start_under_way(on: bool) {
    let (since, changed) = &STARTING;
    let mut since = since.lock().unwrap_or_else(|p| p.into_inner());
    *since = on.then(Instant::now);
    changed.notify_all();
}

/// Says, when dropped, that the start is no longer under way.
#[cfg(test)]
pub(crate) struct StartOver;

#[cfg(test)]
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
pub(crate) async fn settle(within: Duration) {
    let _ = tokio::time::timeout(within, work(true, || ())).await;
}
