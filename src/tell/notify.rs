//! Talking to systemd: `READY=1`, `STATUS=`, `STOPPING=1`,
//! `EXTEND_TIMEOUT_USEC=`, `WATCHDOG=1`; descriptors kept in the service's
//! store (`FDSTORE=1`, `FDSTOREREMOVE=1`). A failed notification is logged and
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
    /// A notifier of its own for `WATCHDOG=1` alone, to send it apart from
    /// the other notes (see [`crate::tell::outbox`]); `None`: it goes
    /// with them.
    fn watchdog(&self) -> Option<Box<dyn Notifier>> {
        None
    }
}

impl<T: Notifier + ?Sized> Notifier for Box<T> {
    fn notify(&mut self, notes: &[Note]) {
        (**self).notify(notes)
    }
    fn retry_at(&self) -> Option<tokio::time::Instant> {
        (**self).retry_at()
    }
    fn retry(&mut self) {
        (**self).retry()
    }
    fn watchdog(&self) -> Option<Box<dyn Notifier>> {
        (**self).watchdog()
    }
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

/// An undelivered notification is tried again after 1 ms, then twice as
/// long each time up to [`RETRY_MOST`]: a receiver's full queue is drained
/// in a moment when it is alive, and a dead one costs a few wake-ups a
/// second. Given up after [`RETRY_FOR`].
const RETRY_FIRST: std::time::Duration = std::time::Duration::from_millis(1);
const RETRY_MOST: std::time::Duration = std::time::Duration::from_millis(250);
const RETRY_FOR: std::time::Duration = std::time::Duration::from_secs(60);

/// The wait before retry number `n` (from 0).
fn retry_after(n: u32) -> std::time::Duration {
    RETRY_FIRST.saturating_mul(1u32 << n.min(16)).min(RETRY_MOST)
}

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
pub(crate) struct SdNotifier {
    /// `$NOTIFY_SOCKET`, read once at start; `None`: notifications are off.
    target: Option<std::ffi::OsString>,
    sock: Option<UnixDatagram>,
    /// Notes not delivered yet, coalesced; since when, and when to try again.
    pending: Vec<Note>,
    pending_since: Option<tokio::time::Instant>,
    next_try: Option<tokio::time::Instant>,
    /// Retries since the last delivery.
    retries: u32,
}

/// Add `note` to undelivered `pending`: one of each kind, the latest wins;
/// `READY=1`, `STOPPING=1` and the like ahead of a status or a timeout
/// extension, which never hold them back.
fn coalesce(pending: &mut Vec<Note>, note: &Note) {
    let same = |a: &Note| std::mem::discriminant(a) == std::mem::discriminant(note);
    let news = |n: &Note| matches!(n, Note::Status(_) | Note::ExtendTimeout(_));
    match note {
        Note::Watchdog => {}
        n if news(n) => {
            pending.retain(|p| !same(p));
            pending.push(note.clone());
        }
        _ => {
            pending.retain(|p| !same(p));
            let at = pending.iter().position(news).unwrap_or(pending.len());
            pending.insert(at, note.clone());
        }
    }
}

impl SdNotifier {
    pub(crate) fn from_env() -> SdNotifier {
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
                self.retries = 0;
            }
            Err(e) => {
                self.pending.retain(|n| *n != Note::Watchdog);
                let now = tokio::time::Instant::now();
                let since = *self.pending_since.get_or_insert(now);
                self.next_try = Some(now + retry_after(self.retries));
                self.retries = self.retries.saturating_add(1);
                if since == now {
                    tracing::warn!(error = %e, "cannot notify systemd; trying again");
                } else if now - since >= RETRY_FOR {
                    tracing::error!(error = %e, dropped = %msg.trim_end().replace('\n', " "), "cannot notify systemd; giving up");
                    self.pending.clear();
                    self.pending_since = None;
                    self.next_try = None;
                    self.retries = 0;
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

    fn watchdog(&self) -> Option<Box<dyn Notifier>> {
        let target = self.target.clone()?;
        Some(Box::new(SdNotifier { target: Some(target), ..SdNotifier::default() }))
    }
}

/// How often a status of the same kind is printed again in the foreground.
pub(crate) const FOREGROUND_EVERY: Duration = Duration::from_secs(10);

/// The warden run in the foreground (a terminal, a container's log): every
/// status also goes to the warden's own log, where the operator is looking,
/// since nobody reads `STATUS=` there. Throttled: a status of another kind
/// (a new phase, a wait for the port or the GPUs, ready) at once, the same
/// kind with new figures at most every [`FOREGROUND_EVERY`]; the same text
/// never twice. Everything else goes to `inner` unchanged.
#[derive(Debug)]
pub(crate) struct Foreground<N> {
    inner: N,
    /// The text last printed, and when.
    shown: Option<(String, std::time::Instant)>,
}

impl<N: Notifier> Foreground<N> {
    pub(crate) fn new(inner: N) -> Foreground<N> {
        Foreground { inner, shown: None }
    }
}

/// A status's kind: its words without the figures (`loading 3/7 compile ·
/// 2m10s of ~4m50s` → `loading compile · of`).
fn kind(text: &str) -> impl Iterator<Item = &str> {
    text.split_whitespace().filter(|w| !w.bytes().any(|b| b.is_ascii_digit()))
}

/// Whether two statuses are of one kind: the same words but for figures.
pub(crate) fn same_kind(a: &str, b: &str) -> bool {
    kind(a).eq(kind(b))
}

/// Whether `text` is printed at `now`, after `shown`.
pub(crate) fn foreground_due(
    shown: Option<&(String, std::time::Instant)>,
    text: &str,
    now: std::time::Instant,
) -> bool {
    match shown {
        None => true,
        Some((last, _)) if last == text => false,
        Some((last, at)) => !same_kind(last, text) || now.saturating_duration_since(*at) >= FOREGROUND_EVERY,
    }
}

impl<N: Notifier> Notifier for Foreground<N> {
    fn notify(&mut self, notes: &[Note]) {
        for n in notes {
            if let Note::Status(s) = n {
                let shown = crate::util::escape::one_line(&crate::util::redact::text(s), crate::util::escape::MAX_LINE);
                let now = std::time::Instant::now();
                if foreground_due(self.shown.as_ref(), &shown, now) {
                    tracing::info!(EVENT = "progress", "{shown}");
                    self.shown = Some((shown, now));
                }
            }
        }
        self.inner.notify(notes);
    }
    fn retry_at(&self) -> Option<tokio::time::Instant> {
        self.inner.retry_at()
    }
    fn retry(&mut self) {
        self.inner.retry()
    }
    fn watchdog(&self) -> Option<Box<dyn Notifier>> {
        self.inner.watchdog()
    }
}

/// The watchdog period asked for by systemd (`WATCHDOG_USEC`, for this pid
/// when `WATCHDOG_PID` is set), halved as systemd recommends.
pub(crate) fn watchdog_interval() -> Option<Duration> {
    std::env::var_os("NOTIFY_SOCKET")?;
    if let Ok(pid) = std::env::var("WATCHDOG_PID")
        && pid.parse::<u32>().ok() != Some(std::process::id())
    {
        return None;
    }
    let usec: u64 = std::env::var("WATCHDOG_USEC").ok()?.parse().ok()?;
    (usec > 0).then(|| Duration::from_micros(usec / 2))
}

/// How long a message with descriptors may wait for room in the service
/// manager's queue: it is sent at start, before anything else, and a
/// manager that takes no message in that time is not waited for.
const FD_SEND_TIMEOUT: Duration = Duration::from_secs(1);

/// Keep `fd` in the service's file-descriptor store under `name`
/// (`FDSTORE=1`, `FDNAME=`): systemd hands it back (in `LISTEN_FDS`, named
/// in `LISTEN_FDNAMES`) when it starts the service again, and holds it
/// meanwhile. Nothing is sent, and `Ok(false)` returned, without
/// `$NOTIFY_SOCKET`. One message a descriptor: the name is the message's.
pub(crate) fn store_fd(name: &str, fd: std::os::fd::BorrowedFd<'_>) -> std::io::Result<bool> {
    use std::os::fd::AsRawFd;
    let msg = format!("FDSTORE=1\nFDNAME={name}\n");
    send_with_fds(&msg, &[fd.as_raw_fd()])
}

/// Take every descriptor named `name` out of the store
/// (`FDSTOREREMOVE=1`, `FDNAME=`); systemd closes its copies.
pub(crate) fn remove_stored(name: &str) -> std::io::Result<bool> {
    let msg = format!("FDSTOREREMOVE=1\nFDNAME={name}\n");
    send_with_fds(&msg, &[])
}

/// One datagram to `$NOTIFY_SOCKET` (a path or an abstract `@name`) with
/// `fds` attached (`SCM_RIGHTS`), waiting at most [`FD_SEND_TIMEOUT`].
fn send_with_fds(msg: &str, fds: &[std::os::fd::RawFd]) -> std::io::Result<bool> {
    use nix::sys::socket::{ControlMessage, MsgFlags, UnixAddr, sendmsg};
    use std::os::fd::AsRawFd;
    let Some(target) = std::env::var_os("NOTIFY_SOCKET").filter(|s| !s.is_empty()) else {
        return Ok(false);
    };
    let sock = UnixDatagram::unbound()?;
    if let Some(name) = target.as_bytes().strip_prefix(b"@") {
        sock.connect_addr(&std::os::unix::net::SocketAddr::from_abstract_name(name)?)?;
    } else {
        sock.connect(Path::new(&target))?;
    }
    sock.set_write_timeout(Some(FD_SEND_TIMEOUT))?;
    let iov = [std::io::IoSlice::new(msg.as_bytes())];
    let rights = [ControlMessage::ScmRights(fds)];
    let cmsgs: &[ControlMessage<'_>] = if fds.is_empty() { &[] } else { &rights };
    let sent = sendmsg::<UnixAddr>(sock.as_raw_fd(), &iov, cmsgs, MsgFlags::MSG_NOSIGNAL, None)?;
    if sent != msg.len() {
        return Err(std::io::Error::new(std::io::ErrorKind::WriteZero, "incomplete notification"));
    }
    Ok(true)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Fill the queue of the datagram socket at `path` to the receiver's
    /// limit, whatever the host's `net.unix.max_dgram_qlen` (10 by the
    /// kernel, 512 by systemd's sysctl defaults): a sender is refused when
    /// its own send buffer is full as well as when the receiver's queue is,
    /// and a long queue outlasts one sender's buffer. Fresh senders are
    /// added until one cannot send its first datagram: only the receiver's
    /// full queue refuses that. Returns how many were queued, and the
    /// senders (whose queued datagrams stay charged to them until read).
    fn fill_queue(path: &Path) -> (usize, Vec<UnixDatagram>) {
        let mut queued = 0;
        let mut fillers = Vec::new();
        loop {
            let filler = UnixDatagram::unbound().unwrap();
            filler.connect(path).unwrap();
            filler.set_nonblocking(true).unwrap();
            let before = queued;
            while filler.send(b"X=1\n").is_ok() {
                queued += 1;
                assert!(queued < 1_000_000, "the queue never filled");
            }
            fillers.push(filler);
            if queued == before {
                return (queued, fillers);
            }
        }
    }

    /// A receiver whose queue is full: the notes wait, coalesced (`READY=1`
    /// ahead, only the newest status), the first retry comes within a few
    /// milliseconds, and once the receiver reads, one datagram delivers
    /// them.
    #[test]
    fn a_full_receiver_gets_ready_first_and_the_newest_status_only_soon() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("notify");
        let receiver = UnixDatagram::bind(&path).unwrap();
        receiver.set_nonblocking(true).unwrap();
        let (queued, _fillers) = fill_queue(&path);
        let mut n = SdNotifier { target: Some(path.clone().into_os_string()), ..SdNotifier::default() };
        n.notify(&[Note::Status("loading 0".into())]);
        let wait = n.retry_at().expect("a retry is due") - tokio::time::Instant::now();
        assert!(wait <= RETRY_FIRST, "the first retry waits {wait:?}");
        for i in 1..12 {
            n.notify(&[Note::Status(format!("loading {i}"))]);
        }
        n.notify(&[Note::Ready]);
        assert_eq!(n.pending, vec![Note::Ready, Note::Status("loading 11".into())]);
        // The receiver reads what was queued; the retry delivers.
        let mut buf = [0u8; 4096];
        for _ in 0..queued {
            receiver.recv(&mut buf).unwrap();
        }
        n.retry();
        let got = receiver.recv(&mut buf).unwrap();
        assert_eq!(std::str::from_utf8(&buf[..got]).unwrap(), "READY=1\nSTATUS=loading 11\n");
        assert!(receiver.recv(&mut buf).is_err(), "one datagram, no backlog");
        assert_eq!(n.retry_at(), None);
    }

    /// A phase change or a wait is printed at once; new figures of the same
    /// kind at most every ten seconds; the same text never twice.
    #[test]
    fn the_foreground_sees_each_kind_of_status_at_once_and_figures_every_ten_seconds() {
        let t0 = std::time::Instant::now();
        let at = |s: u64| t0 + Duration::from_secs(s);
        let shown = |text: &str, s: u64| Some((text.to_string(), at(s)));
        assert!(foreground_due(None, "starting: pid 7", at(0)));
        let load = "loading 2/7 weights · 40s of ~4m50s";
        assert!(!foreground_due(shown(load, 0).as_ref(), load, at(60)), "the same text again");
        let later = "loading 2/7 weights · 45s of ~4m50s";
        assert!(!foreground_due(shown(load, 0).as_ref(), later, at(5)), "new figures within ten seconds");
        assert!(foreground_due(shown(load, 0).as_ref(), later, at(10)), "new figures after ten seconds");
        let next = "loading 3/7 compile · 46s of ~4m50s";
        assert!(foreground_due(shown(load, 0).as_ref(), next, at(1)), "a new phase at once");
        let port = "waiting for port 8000, held by pid 4242 (python3)";
        assert!(foreground_due(shown(load, 0).as_ref(), port, at(1)), "a wait at once");
    }

    #[test]
    fn retries_start_at_a_millisecond_and_double_to_a_bound() {
        let waits: Vec<u64> = (0..12).map(|k| retry_after(k).as_millis() as u64).collect();
        assert_eq!(waits, [1, 2, 4, 8, 16, 32, 64, 128, 250, 250, 250, 250]);
    }

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
        // The warden's sender may have run out of its own buffer before the
        // listener's queue was full (a long `net.unix.max_dgram_qlen`):
        // fill the rest, so that a fresh sender is refused too.
        let (_, _fillers) = fill_queue(&path);
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
