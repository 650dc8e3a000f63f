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
///
/// sd-notify formats the messages; the datagram is sent here, without
/// blocking, because sd-notify's own send blocks when the receiver's queue
/// is full, and a daemon must not hang on its service manager.
#[derive(Debug, Default)]
pub struct SdNotifier {
    /// `$NOTIFY_SOCKET`, read once at start; `None`: notifications are off.
    target: Option<std::ffi::OsString>,
    sock: Option<UnixDatagram>,
}

impl SdNotifier {
    pub fn from_env() -> SdNotifier {
        SdNotifier { target: std::env::var_os("NOTIFY_SOCKET").filter(|s| !s.is_empty()), sock: None }
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
        let sock = self.sock.as_ref().expect("connected above");
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
}

impl Notifier for SdNotifier {
    fn notify(&mut self, notes: &[Note]) {
        if self.target.is_none() {
            return;
        }
        let mut msg = String::new();
        for n in notes {
            let state = match n {
                Note::Ready => NotifyState::Ready,
                Note::Status(s) => NotifyState::Status(s),
                Note::Stopping => NotifyState::Stopping,
                Note::ExtendTimeout(d) => {
                    NotifyState::ExtendTimeoutUsec(u32::try_from(d.as_micros()).unwrap_or(u32::MAX))
                }
                Note::Watchdog => NotifyState::Watchdog,
            };
            msg.push_str(&state.to_string());
            msg.push('\n');
        }
        if let Err(e) = self.send(&msg) {
            tracing::warn!(error = %e, "cannot notify systemd");
        }
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
