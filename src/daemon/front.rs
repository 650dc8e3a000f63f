//! The front door (`[front]`): the model's address, owned by the warden.
//! Clients connect here; requests are forwarded to the engine's private
//! address while it serves, and wait in a bounded queue while it does not
//! (a load, a restart, the golden check, a drain, an upgrade of the
//! warden, an idle engine being started again).
//!
//! What the rest of the daemon sees of it: the [`Gate`] it is told (the
//! observer derives it from the machine after every change) and the
//! [`Activity`] it reports (requests arriving and in flight, which the
//! loop reads to stop or wake an idle engine).
//!
//! Its parts: `front/proxy.rs` serves the listeners and forwards, holds
//! or answers each request; `front/hold.rs` is the queue of held
//! requests; `front/bind.rs` binds the listeners.

mod bind;
pub mod hold;
pub mod proxy;

pub use bind::{ListenError, Listener, open};
pub use proxy::Door;

use std::sync::Mutex;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use tokio::time::Instant;

/// What the front door does with a request now.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub enum Gate {
    /// The engine serves: forward.
    Serving,
    /// The engine will serve, later: hold the request (up to `front.hold`),
    /// or answer 503 with `Retry-After` at once when `eta` says it will
    /// not serve in time. `why` is said in that answer ("model loading").
    Holding { why: String, eta: Option<Duration> },
    /// The engine was stopped (or put to sleep) for want of requests: a
    /// request wakes it ([`Activity::wanted`]) and is held up to
    /// `front.idle-hold`.
    Idle { eta: Option<Duration> },
    /// The warden is ending and will not serve again: answer 503.
    #[default]
    Closed,
}

/// The requests the front door has seen, as the loop reads them.
#[derive(Debug)]
pub struct Activity {
    in_flight: AtomicUsize,
    last: Mutex<Instant>,
    woken: tokio::sync::Notify,
}

impl Default for Activity {
    fn default() -> Self {
        Activity { in_flight: AtomicUsize::new(0), last: Mutex::new(Instant::now()), woken: tokio::sync::Notify::new() }
    }
}

impl Activity {
    /// A request arrived (held or forwarded); `idle`: the gate was
    /// [`Gate::Idle`], so the loop is told to start the engine.
    pub fn begin(&self, idle: bool) {
        self.in_flight.fetch_add(1, Ordering::SeqCst);
        *self.last.lock().unwrap_or_else(|e| e.into_inner()) = Instant::now();
        if idle {
            self.woken.notify_one();
        }
    }

    /// A request ended (answered, refused, or its client went away).
    pub fn end(&self) {
        self.in_flight.fetch_sub(1, Ordering::SeqCst);
        *self.last.lock().unwrap_or_else(|e| e.into_inner()) = Instant::now();
    }

    /// How long no request has been in flight, as of `now`; `None` while
    /// one is.
    pub fn quiet_for(&self, now: Instant) -> Option<Duration> {
        if self.in_flight.load(Ordering::SeqCst) > 0 {
            return None;
        }
        Some(now.saturating_duration_since(*self.last.lock().unwrap_or_else(|e| e.into_inner())))
    }

    /// Resolves when a request arrives at an idle engine.
    pub async fn wanted(&self) {
        self.woken.notified().await;
    }
}
