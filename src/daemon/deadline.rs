//! The warden's exit, under a deadline of its own.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use crate::supervisor::exit::Code;

/// How long the warden may take to end once its loop is done: the wait
/// for failure reports still being written, plus a margin for the rest.
pub const EXIT_DEADLINE: Duration = crate::supervisor::policy::REPORT_MARGIN.saturating_add(Duration::from_secs(10));

/// How long the deadline's end waits for the log to be written (a stuck
/// reader of the log is not waited for beyond it).
const LOG_PATIENCE: Duration = Duration::from_secs(1);

/// The warden's exit has a deadline too. What follows the loop (reports
/// still being written, the tree record, the files the tree left, the
/// runtime's end) reads files and `/proc`, and a read can block, for
/// example on a process stuck in the kernel; a stopped warden must end all
/// the same. Past the deadline, the step it was held at is logged and the
/// process ends with the loop's code.
pub(crate) struct ExitDeadline {
    step: Arc<Mutex<&'static str>>,
}

impl ExitDeadline {
    pub(crate) fn start(instance: &str, code: Code, within: Duration) -> ExitDeadline {
        let step = Arc::new(Mutex::new("ending"));
        let (s, instance) = (step.clone(), instance.to_string());
        let spawned = std::thread::Builder::new().name("exit deadline".into()).spawn(move || {
            // Not a wait for a condition: the process ends before this
            // returns, or this ends it.
            std::thread::sleep(within);
            let at = *s.lock().unwrap_or_else(|p| p.into_inner());
            tracing::error!(
                INSTANCE = instance.as_str(),
                EVENT = "exit",
                "the exit was held up for {} at: {at}; ending now with code {code}",
                humantime::format_duration(within)
            );
            crate::util::logging::flush(LOG_PATIENCE);
            // SAFETY: _exit ends the process at once; nothing of ours runs
            // after it (the held-up step may hold locks: no destructor may
            // wait for them).
            unsafe { libc::_exit(i32::from(code.as_u8())) }
        });
        if let Err(e) = spawned {
            tracing::warn!(error = %e, "cannot start the exit's deadline");
        }
        ExitDeadline { step }
    }

    pub(crate) fn at(&self, step: &'static str) {
        tracing::debug!(EVENT = "exit", "exit: {step}");
        *self.step.lock().unwrap_or_else(|p| p.into_inner()) = step;
    }
}
