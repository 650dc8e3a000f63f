//! Talking to systemd: `READY=1`, `STATUS=`, `STOPPING=1`,
//! `EXTEND_TIMEOUT_USEC=`, `WATCHDOG=1`. A failed notification is logged and
//! never stops the daemon; without `NOTIFY_SOCKET` nothing is sent. Knows
//! nothing of what the messages mean.

use std::time::Duration;

use std::os::linux::net::SocketAddrExt;
use std::os::unix::ffi::OsStrExt;
use std::os::unix::net::UnixDatagram;
use std::path::Path;

use sd_notify::NotifyState;

pub use crate::supervisor::Note;

/// Where notifications go.
pub trait Notifier: Send {
    /// Send, logging (never returning) a failure.
    fn notify(&mut self, notes: &[Note]);
    /// When notes that could not be delivered should be tried again.
    fn retry_at(&self) -> Option<tokio::time::Instant> {
        None
    }
    /// Try the undelivered notes again.
    fn retry(&mut self) {}
}

/// The datagram for `notes`, one `FIELD=value` line each. The only place a
/// notification is formatted: a status text has its secrets masked and is
/// escaped (see [`crate::util::escape::one_line`]), so no text from data can add
/// a line.
pub fn datagram(notes: &[Note]) -> String {
    let mut msg = String::new();
    for n in notes {
        let line = match n {
            Note::Ready => NotifyState::Ready.to_string(),
            Note::Status(s) => {
                let shown = crate::util::escape::one_line(&crate::util::redact::text(s), crate::util::escape::MAX_LINE);
                NotifyState::Status(&shown).to_string()
            }
            Note::Stopping => NotifyState::Stopping.to_string(),
            // sd-notify caps this at u32 microseconds (71 minutes); a stall
            // window can be longer.
            Note::ExtendTimeout(d) => {
                format!("EXTEND_TIMEOUT_USEC={}", u64::try_from(d.as_micros()).unwrap_or(u64::MAX))
            }
            Note::Watchdog => NotifyState::Watchdog.to_string(),
        };
        msg.push_str(&line);
        msg.push('\n');
    }
    msg
}

/// How often an undelivered notification is tried again, and for how long.
const RETRY_EVERY: std::time::Duration = std::time::Duration::from_millis(50);
const RETRY_FOR: std::time::Duration = std::time::Duration::from_secs(60);

/// The real one, through `$NOTIFY_SOCKET` (a path or an abstract `@name`).
///
/// sd-notify formats the messages; the datagram is sent here, without
/// blocking, because sd-notify's own send blocks when the receiver's queue
/// is full, and a daemon must not hang on its service manager. What cannot
/// be sent is kept and tried again from the loop: `READY=1` and
/// `STOPPING=1` until delivered (for at most a minute), the latest
/// `STATUS=` and `EXTEND_TIMEOUT_USEC=` only; a missed `WATCHDOG=1` is
/// not kept (the next one follows while the loop turns).
#[derive(Debug, Default)]
pub struct SdNotifier {
    /// `$NOTIFY_SOCKET`, read once at start; `None`: notifications are off.
    target: Option<std::ffi::OsString>,
    sock: Option<UnixDatagram>,
    /// Notes not delivered yet, coalesced; since when, and when to try again.
    pending: Vec<Note>,
    pending_since: Option<tokio::time::Instant>,
    next_try: Option<tokio::time::Instant>,
}

/// Add `note` to undelivered `pending`: one of each kind, the latest wins.
fn coalesce(pending: &mut Vec<Note>, note: &Note) {
    let same = |a: &Note| std::mem::discriminant(a) == std::mem::discriminant(note);
    match note {
        Note::Watchdog => {}
        _ => {
            pending.retain(|p| !same(p));
            pending.push(note.clone());
        }
    }
}

impl SdNotifier {
    pub fn from_env() -> SdNotifier {
        SdNotifier { target: std::env::var_os("NOTIFY_SOCKET").filter(|s| !s.is_empty()), ..SdNotifier::default() }
    }

    fn send(&mut self, msg: &str) -> std::io::Result<()> {
        let Some(target) = &self.target else {
            return Ok(());
        };
        if self.sock.is_none() {
            let sock = UnixDatagram::unbound()?;
            let bytes = target.as_bytes();
            if let Some(name) = bytes.strip_prefix(b"@") {
                let addr = std::os::unix::net::SocketAddr::from_abstract_name(name)?;
                sock.connect_addr(&addr)?;
            } else {
                sock.connect(Path::new(target))?;
            }
            sock.set_nonblocking(true)?;
            self.sock = Some(sock);
        }
        let Some(sock) = self.sock.as_ref() else { return Ok(()) };
        match sock.send(msg.as_bytes()) {
            Ok(n) if n == msg.len() => Ok(()),
            Ok(_) => Err(std::io::Error::new(std::io::ErrorKind::WriteZero, "incomplete notification")),
            Err(e) => {
                // Connect again next time (the manager may have re-created it).
                self.sock = None;
                Err(e)
            }
        }
    }

    /// Send what is pending; keep it if that fails.
    fn flush(&mut self) {
        if self.pending.is_empty() {
            return;
        }
        let msg = datagram(&self.pending);
        match self.send(&msg) {
            Ok(()) => {
                if self.pending_since.is_some() {
                    tracing::info!("notification delivered after a retry");
                }
                self.pending.clear();
                self.pending_since = None;
                self.next_try = None;
            }
            Err(e) => {
                self.pending.retain(|n| *n != Note::Watchdog);
                let now = tokio::time::Instant::now();
                let since = *self.pending_since.get_or_insert(now);
                self.next_try = Some(now + RETRY_EVERY);
                if since == now {
                    tracing::warn!(error = %e, "cannot notify systemd; trying again");
                } else if now - since >= RETRY_FOR {
                    tracing::error!(error = %e, dropped = %msg.trim_end().replace('\n', " "), "cannot notify systemd; giving up");
                    self.pending.clear();
                    self.pending_since = None;
                    self.next_try = None;
                }
            }
        }
    }
}

impl Notifier for SdNotifier {
    fn notify(&mut self, notes: &[Note]) {
        if self.target.is_none() {
            return;
        }
        for n in notes {
            if self.pending_since.is_none() || *n != Note::Watchdog {
                coalesce(&mut self.pending, n);
            }
        }
        // A watchdog ping goes out on its own when nothing else waits.
        if notes.contains(&Note::Watchdog) && self.pending.is_empty() {
            if let Err(e) = self.send(&datagram(&[Note::Watchdog])) {
                tracing::warn!(error = %e, "cannot notify systemd");
            }
            return;
        }
        self.flush();
    }

    fn retry_at(&self) -> Option<tokio::time::Instant> {
        self.next_try
    }

    fn retry(&mut self) {
        self.flush();
    }
}

/// The watchdog period asked for by systemd (`WATCHDOG_USEC`, for this pid
/// when `WATCHDOG_PID` is set), halved as systemd recommends.
pub fn watchdog_interval() -> Option<Duration> {
    std::env::var_os("NOTIFY_SOCKET")?;
    if let Ok(pid) = std::env::var("WATCHDOG_PID")
        && pid.parse::<u32>().ok() != Some(std::process::id())
    {
        return None;
    }
    let usec: u64 = std::env::var("WATCHDOG_USEC").ok()?.parse().ok()?;
    (usec > 0).then(|| Duration::from_micros(usec / 2))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn no_text_from_data_adds_a_line_and_long_timeouts_are_whole() {
        let msg = datagram(&[
            Note::Status("pid 1 (x\nREADY=1\nSTATUS=pwned)".into()),
            Note::ExtendTimeout(Duration::from_secs(4 * 3600)),
        ]);
        assert_eq!(msg, "STATUS=pid 1 (x\\nREADY=1\\nSTATUS=pwned)\nEXTEND_TIMEOUT_USEC=14400000000\n");
    }

    #[test]
    fn ready_reaches_a_listener_that_stopped_reading_for_a_while() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("notify.sock");
        let listener = UnixDatagram::bind(&path).unwrap();
        let mut n = SdNotifier { target: Some(path.clone().into_os_string()), ..SdNotifier::default() };
        // The listener does not read: its queue fills and sends fail.
        let mut statuses = 0;
        while n.pending.is_empty() {
            statuses += 1;
            n.notify(&[Note::Status(format!("loading {statuses}"))]);
            assert!(statuses < 10_000, "the queue never filled");
        }
        n.notify(&[Note::Ready]);
        n.notify(&[Note::Status("ready: pid 1".into())]);
        assert!(n.retry_at().is_some(), "kept for a retry");
        // Still not read: the retry fails and keeps them.
        n.retry();
        assert!(n.pending.contains(&Note::Ready));
        // The listener reads again.
        listener.set_nonblocking(true).unwrap();
        let mut buf = vec![0u8; 65536];
        let mut got = Vec::new();
        while let Ok(len) = listener.recv(&mut buf) {
            got.push(String::from_utf8_lossy(&buf[..len]).into_owned());
        }
        n.retry();
        assert_eq!(n.retry_at(), None);
        let len = listener.recv(&mut buf).unwrap();
        let last = String::from_utf8_lossy(&buf[..len]).into_owned();
        assert!(last.contains("READY=1\n"), "{last}");
        assert!(last.contains("STATUS=ready: pid 1\n"), "coalesced to the latest status: {last}");
        assert!(!last.contains("loading"), "{last}");
    }
}
