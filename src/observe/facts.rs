//! What the metrics show that only tasks off the loop know, with no way to
//! the status reporter of their own: the health checks that failed, by
//! kind, and how long the start has been waiting for the GPUs' memory to be
//! released. Process-wide, as there is one warden a process; read by
//! [`crate::observe::status::Metrics`] each time it encodes.

use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

/// The kinds of health check, for the metric's `check` label: the HTTP
/// check, the canary completion, forward progress from vLLM's metrics.
pub const CHECKS: [&str; 3] = ["health", "canary", "progress"];

static FAILED: [AtomicU64; 3] = [AtomicU64::new(0), AtomicU64::new(0), AtomicU64::new(0)];

/// A check of this kind (one of [`CHECKS`]) failed; an unknown kind is a
/// mistake of the caller and is not counted.
pub fn check_failed(check: &str) {
    if let Some(i) = CHECKS.iter().position(|c| *c == check) {
        FAILED[i].fetch_add(1, Ordering::Relaxed);
    }
}

/// Failed checks so far, by kind, in the order of [`CHECKS`].
pub fn checks_failed() -> [u64; 3] {
    [0, 1, 2].map(|i| FAILED[i].load(Ordering::Relaxed))
}

static GPU_WAIT: Mutex<Option<Instant>> = Mutex::new(None);

/// The start waits for GPU compute processes to exit (their memory to be
/// released) while the guard lives: dropped when the wait ends, and when
/// the start is cancelled in the middle of it.
pub struct GpuWaiting(());

impl GpuWaiting {
    pub fn begin() -> GpuWaiting {
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
pub fn gpu_waited() -> Duration {
    GPU_WAIT.lock().unwrap_or_else(|e| e.into_inner()).map_or(Duration::ZERO, |t| t.elapsed())
}
