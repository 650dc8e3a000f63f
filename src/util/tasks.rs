//! The warden's background tasks, watched. Every task (the reaper, the log
//! follower, the pre-start steps, the readiness probe, the health checks,
//! the config re-read) is spawned here, into one `JoinSet` that the main
//! loop also waits on: a task that must live as long as its owner and ends,
//! or any task that panics, is reported instead of going silent. What the
//! tasks do is not known here.

use std::collections::HashMap;
use std::future::Future;

use tokio::task::{AbortHandle, Id, JoinSet};

/// How long a task is meant to live.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Lifetime {
    /// Until its owner aborts it: ending on its own is a failure.
    Owned,
    /// It finishes when its work is done; only a panic is a failure.
    Finite,
}

/// The warden's background tasks.
#[derive(Debug, Default)]
pub struct Tasks {
    set: JoinSet<()>,
    names: HashMap<Id, (&'static str, Lifetime)>,
}

/// A task that ended when it should not have.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Failed {
    pub(crate) name: &'static str,
    /// What happened: "ended", or "panicked: <message>".
    pub(crate) how: String,
}

impl std::fmt::Display for Failed {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "the {} task {}", self.name, self.how)
    }
}

impl Tasks {
    /// Spawn `task` on the current runtime; the handle aborts it (an
    /// aborted task is never a failure).
    pub(crate) fn spawn<F>(&mut self, name: &'static str, lifetime: Lifetime, task: F) -> AbortHandle
    where
        F: Future<Output = ()> + Send + 'static,
    {
        let handle = self.set.spawn(task);
        self.names.insert(handle.id(), (name, lifetime));
        handle
    }

    /// Wait for the next task to end unexpectedly; pending for ever while
    /// none does. Cancel-safe: no end is lost if the wait is dropped.
    pub(crate) async fn failed(&mut self) -> Failed {
        loop {
            let Some(result) = self.set.join_next_with_id().await else {
                return std::future::pending().await;
            };
            let (id, panic) = match result {
                Ok((id, ())) => (id, None),
                Err(e) if e.is_cancelled() => {
                    self.names.remove(&e.id());
                    continue;
                }
                Err(e) => {
                    let id = e.id();
                    (id, Some(panic_message(e.into_panic())))
                }
            };
            let Some((name, lifetime)) = self.names.remove(&id) else { continue };
            match (panic, lifetime) {
                (Some(msg), _) => return Failed { name, how: format!("panicked: {msg}") },
                (None, Lifetime::Owned) => return Failed { name, how: "ended".into() },
                (None, Lifetime::Finite) => {}
            }
        }
    }
}

fn panic_message(payload: Box<dyn std::any::Any + Send>) -> String {
    if let Some(s) = payload.downcast_ref::<&str>() {
        (*s).to_string()
    } else if let Some(s) = payload.downcast_ref::<String>() {
        s.clone()
    } else {
        "(no message)".into()
    }
}

/// A panic injected into the named task, for the tests that prove a dead
/// task is noticed: `VLLM_WARDEN_TEST_PANIC=reaper` makes the reaper panic
/// at an exit other than the child's while the child runs (`reap`, `exit`
/// and `status-write` are hooks that block, not panics: see their callers). Read once;
/// unset in normal use. Only with the `fault-injection` feature, which the
/// tests turn on and a release build does not.
#[cfg(feature = "fault-injection")]
pub(crate) fn injected_panic(name: &str) -> bool {
    static WHICH: std::sync::OnceLock<Option<String>> = std::sync::OnceLock::new();
    WHICH.get_or_init(|| std::env::var("VLLM_WARDEN_TEST_PANIC").ok()).as_deref() == Some(name)
}

/// Without the `fault-injection` feature nothing is injected: the hooks
/// are compiled out.
#[cfg(not(feature = "fault-injection"))]
pub(crate) const fn injected_panic(_: &str) -> bool {
    false
}

/// How long the reap of the server's leader is held, for the tests that
/// prove a slow reap freezes nothing: `VLLM_WARDEN_TEST_SLOW_REAP=MS` makes
/// the reaper wait that many milliseconds between reading the leader's exit
/// and reaping it, its zombie still there, as a reap that the kernel holds
/// does. Read once; unset in normal use. Only with the `fault-injection`
/// feature.
#[cfg(feature = "fault-injection")]
pub(crate) fn injected_slow_reap() -> Option<std::time::Duration> {
    static HOLD: std::sync::OnceLock<Option<std::time::Duration>> = std::sync::OnceLock::new();
    *HOLD.get_or_init(|| {
        let ms = std::env::var("VLLM_WARDEN_TEST_SLOW_REAP").ok()?.parse().ok()?;
        Some(std::time::Duration::from_millis(ms))
    })
}

/// Without the `fault-injection` feature no reap is held.
#[cfg(not(feature = "fault-injection"))]
pub(crate) const fn injected_slow_reap() -> Option<std::time::Duration> {
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn finished_and_aborted_tasks_are_not_failures_but_an_ended_owned_one_is() {
        let mut t = Tasks::default();
        t.spawn("finite", Lifetime::Finite, async {});
        let forever = t.spawn("aborted", Lifetime::Owned, std::future::pending());
        forever.abort();
        t.spawn("owned", Lifetime::Owned, async {});
        let f = t.failed().await;
        assert_eq!(f, Failed { name: "owned", how: "ended".into() });
    }

    #[tokio::test]
    async fn a_panic_is_a_failure_with_its_message() {
        let mut t = Tasks::default();
        t.spawn("probe", Lifetime::Finite, async { panic!("boom") });
        assert_eq!(t.failed().await.to_string(), "the probe task panicked: boom");
    }

    #[tokio::test(start_paused = true)]
    async fn no_task_means_waiting_for_ever() {
        let mut t = Tasks::default();
        let r = tokio::time::timeout(std::time::Duration::from_secs(3600), t.failed()).await;
        assert!(r.is_err());
    }
}
