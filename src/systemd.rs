//! Talking to systemd: `READY=1`, `STATUS=`, `STOPPING=1`,
//! `EXTEND_TIMEOUT_USEC=`, `WATCHDOG=1`. A failed notification is logged and
//! never stops the daemon; without `NOTIFY_SOCKET` nothing is sent. Knows
//! nothing of what the messages mean.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use sd_notify::NotifyState;

/// One message to the service manager.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Note {
    Ready,
    Status(String),
    Stopping,
    ExtendTimeout(Duration),
    Watchdog,
}

/// Where notifications go.
pub trait Notifier: Send {
    /// Send, logging (never returning) a failure.
    fn notify(&mut self, notes: &[Note]);
}

/// The real one, through `$NOTIFY_SOCKET` (a path or an abstract `@name`).
#[derive(Debug, Default)]
pub struct SdNotifier;

impl Notifier for SdNotifier {
    fn notify(&mut self, notes: &[Note]) {
        let states: Vec<NotifyState<'_>> = notes
            .iter()
            .map(|n| match n {
                Note::Ready => NotifyState::Ready,
                Note::Status(s) => NotifyState::Status(s),
                Note::Stopping => NotifyState::Stopping,
                Note::ExtendTimeout(d) => {
                    NotifyState::ExtendTimeoutUsec(u32::try_from(d.as_micros()).unwrap_or(u32::MAX))
                }
                Note::Watchdog => NotifyState::Watchdog,
            })
            .collect();
        if let Err(e) = sd_notify::notify(&states) {
            tracing::warn!(error = %e, "cannot notify systemd");
        }
    }
}

/// The watchdog period asked for by systemd (`WATCHDOG_USEC`, for this pid
/// when `WATCHDOG_PID` is set), halved as systemd recommends.
pub fn watchdog_interval() -> Option<Duration> {
    if std::env::var_os("NOTIFY_SOCKET").is_none() {
        return None;
    }
    if let Ok(pid) = std::env::var("WATCHDOG_PID")
        && pid.parse::<u32>().ok() != Some(std::process::id())
    {
        return None;
    }
    let usec: u64 = std::env::var("WATCHDOG_USEC").ok()?.parse().ok()?;
    (usec > 0).then(|| Duration::from_micros(usec / 2))
}

/// Keeps every note, for tests and for `demo`'s narration.
#[derive(Debug, Clone, Default)]
pub struct Recording(pub Arc<Mutex<Vec<Note>>>);

impl Recording {
    pub fn notes(&self) -> Vec<Note> {
        self.0.lock().expect("recording lock").clone()
    }
}

impl Notifier for Recording {
    fn notify(&mut self, notes: &[Note]) {
        self.0
            .lock()
            .expect("recording lock")
            .extend_from_slice(notes);
    }
}
