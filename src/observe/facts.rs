//! What the metrics show that only tasks off the loop know, with no way to
//! the status reporter of their own: the health checks that failed, by
//! kind, and how long the start has been waiting for the GPUs' memory to be
//! released. Process-wide, as there is one warden a process; read by
//! [`crate::tell::metrics::Metrics`] each time it encodes.

use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

/// The kinds of health check after ready.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Check {
    /// The HTTP check (`health.http`).
    Health,
    /// The one-token completion (`health.canary-interval`).
    Canary,
    /// Forward progress from vLLM's own metrics: an engine stalled under
    /// load (`health.progress-stall`).
    Progress,
}

/// Their names, for the metric's `check` label, in the order of [`Check`].
pub(crate) const CHECKS: [&str; 3] = ["health", "canary", "progress"];

static FAILED: [AtomicU64; 3] = [AtomicU64::new(0), AtomicU64::new(0), AtomicU64::new(0)];

/// A check of this kind failed.
pub(crate) fn check_failed(check: Check) {
    FAILED[check as usize].fetch_add(1, Ordering::Relaxed);
}

/// Failed checks so far, by kind, in the order of [`CHECKS`].
pub(crate) fn checks_failed() -> [u64; 3] {
    [0, 1, 2].map(|i| FAILED[i].load(Ordering::Relaxed))
}

static GPU_WAIT: Mutex<Option<Instant>> = Mutex::new(None);

/// The start waits for GPU compute processes to exit (their memory to be
/// released) while the guard lives: dropped when the wait ends, and when
/// the start is cancelled in the middle of it.
pub(crate) struct GpuWaiting(());

impl GpuWaiting {
    pub(crate) fn begin() -> GpuWaiting {
        *GPU_WAIT.lock().unwrap_or_else(|e| e.into_inner()) = Some(Instant::now());
        GpuWaiting(())
    }
}

impl Drop for GpuWaiting {
    fn drop(&mut self) {
        *GPU_WAIT.lock().unwrap_or_else(|e| e.into_inner()) = None;
    }
}

/// How long the start has been waiting for the GPUs; zero when it is not.
pub(crate) fn gpu_waited() -> Duration {
    GPU_WAIT.lock().unwrap_or_else(|e| e.into_inner()).map_or(Duration::ZERO, |t| t.elapsed())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn failed_checks_are_counted_by_kind_and_the_gpu_wait_lasts_as_long_as_its_guard() {
        let before = checks_failed();
        check_failed(Check::Progress);
        check_failed(Check::Canary);
        check_failed(Check::Progress);
        let after = checks_failed();
        assert_eq!([0, 1, 2].map(|i| after[i] - before[i]), [0, 1, 2]);
        assert_eq!(gpu_waited(), Duration::ZERO);
        let waiting = GpuWaiting::begin();
        // Looked at until the clock moves.
        while gpu_waited().is_zero() {}
        drop(waiting);
        assert_eq!(gpu_waited(), Duration::ZERO, "over with its guard");
    }
}
