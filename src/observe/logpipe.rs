//! The child's output, through a pipe the warden owns: the child's stdout
//! and stderr are the write end of one pipe, and a thread of the warden
//! (the log writer) moves what comes out of it to the end of the log file,
//! which only the warden writes. The follower (`observe::logwatch`) reads
//! the file as before; the rotation (`observe::rotate`) holds the writer
//! for its last step, so that the file stands still while it is cut: no
//! line is lost to a rotation and none is torn, at any speed and on any
//! filesystem.
//!
//! Why a pipe and not the file itself: when the child appends to the file,
//! nothing the warden does can both cut the file and be sure that no write
//! of the child falls between its look at the size and the cut (one line
//! per rotation or so was lost at full speed); when the warden is the only
//! writer, the cut is made between two of its own writes.
//!
//! Every read of the pipe and its write to the file happen under one lock
//! ([`Sink::lock`]): who holds it (the writer's thread, a drain that empties
//! the pipe, the rotation's last step, an upgrade about to `exec`) sees the
//! pipe and the file agree, and the order of the bytes is the child's.
//!
//! The writer never blocks the loop, and never stalls the child for ever:
//! - a child that writes faster than the disk takes fills the pipe (1 MiB,
//!   enlarged with `F_SETPIPE_SZ` where allowed); its writes then wait
//!   (backpressure, as a slow terminal would make them);
//! - a file that has reached its rotation size (`child.log-max-size`): the
//!   writer waits for the rotation before it writes more (the child's
//!   output waits in the pipe meanwhile, then the child), so that a copy
//!   holds the size and at most one read of the pipe more, and the part
//!   moved back to the file's start at the cut stays small, however fast
//!   the child writes and however slow the follower reads. A rotation that
//!   does not come within [`ROTATION_PATIENCE`] (the follower held up, or
//!   gone) does not hold the child longer: the file grows past its size
//!   until the next rotation, which moves all of it; nothing is dropped;
//! - a file that cannot be written (a full disk, an I/O error): the writer
//!   goes on draining the pipe; what the file refused is set aside in
//!   memory ([`SPILL`] at most), where the follower reads it in its place
//!   (so its lines are still classified and forwarded to the journal), and
//!   the warden's own log says so, once when it begins and once when the
//!   file is written again, with the bytes missing from it. While the
//!   follower is behind by more than [`SPILL`], the writer waits for it.

use std::collections::VecDeque;
use std::fs::File;
use std::io::{self, Write};
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, OwnedFd, RawFd};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::Duration;

use nix::poll::{PollFd, PollFlags, PollTimeout};
use nix::sys::eventfd::{EfdFlags, EventFd};

use crate::util::tasks::{Lifetime, Tasks};

/// The size asked for the pipe (`F_SETPIPE_SZ`); the kernel's default is
/// 64 KiB, and an unprivileged process may have up to
/// `/proc/sys/fs/pipe-max-size` (1 MiB by default).
pub(crate) const PIPE_SIZE: usize = 1 << 20;

/// How much one read of the pipe takes.
const READ: usize = 256 << 10;

/// The most bytes set aside for the follower while the file cannot be
/// written.
pub(crate) const SPILL: usize = 4 << 20;

/// How long the writer waits for the rotation of a file that has reached
/// its size before it writes on.
pub(crate) const ROTATION_PATIENCE: Duration = Duration::from_secs(2);

/// The pipe and the log file the child's output goes through.
pub struct Sink {
    /// The read end, non-blocking; read only under `log`'s lock.
    pipe: OwnedFd,
    log: Mutex<Log>,
    /// The set-aside bytes have room again, or the file was cut.
    room: Condvar,
    /// The file's rotation size: once it holds this many bytes, the writer
    /// waits for the rotation (`u64::MAX`: not rotated).
    rotate_at: std::sync::atomic::AtomicU64,
    /// Written when bytes are set aside: wakes the follower.
    spilled: EventFd,
    /// Wakes the writer's thread to stop.
    wake: EventFd,
    stop: AtomicBool,
    /// Once the child is ready: wait this long (ms) after a read that
    /// emptied the pipe, so that a chatty server costs a few wake-ups a
    /// second, not one a line (a drain empties the pipe at once all the same).
    pace_ms: std::sync::atomic::AtomicU64,
    /// The log file's descriptor (it lives as long as `log`).
    log_fd: RawFd,
    /// The log file's path, for messages.
    path: PathBuf,
}

impl std::fmt::Debug for Sink {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Sink").field("pipe", &self.pipe).field("path", &self.path).finish_non_exhaustive()
    }
}

/// The log file and what goes with it; held through [`Sink::lock`].
#[derive(Debug)]
pub(crate) struct Log {
    /// The log file, appended to (`O_APPEND`).
    file: File,
    /// Its length as the writer knows it: where the next write lands.
    len: u64,
    buf: Vec<u8>,
    /// The pipe said end of file: no process holds its write end.
    ended: bool,
    /// Bytes the file refused, each with the length of the file then: the
    /// follower reads them once it has read the file up to there. While
    /// there are any, nothing is written to the file.
    spill: VecDeque<(u64, Vec<u8>)>,
    spill_bytes: usize,
    /// Since the file refused a write: why, and the bytes missing from it.
    failing: Option<(String, u64)>,
    /// The rotations' cuts so far.
    cuts: u64,
}

/// What one move from the pipe to the file did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Moved {
    Bytes(usize),
    /// Nothing in the pipe now.
    Empty,
    /// No process holds the write end any more.
    Ended,
}

/// Make a pipe for the child's output: the write end for its stdout and
/// stderr, the read end for the warden. Both ends close on exec (std gives
/// the child its copies as 1 and 2); the pipe is enlarged to [`PIPE_SIZE`]
/// where the kernel allows.
pub(crate) fn pipe() -> io::Result<(OwnedFd, OwnedFd)> {
    let (read, write) = rustix::pipe::pipe_with(rustix::pipe::PipeFlags::CLOEXEC)?;
    // Best effort: a user over its pipe quota (`pipe-user-pages-soft`)
    // keeps the default size, which only makes the child wait sooner.
    let _ = rustix::pipe::fcntl_setpipe_size(&read, PIPE_SIZE);
    Ok((read, write))
}

impl Sink {
    /// The read end `pipe` of the child's output, moved to the end of the
    /// log file `file` (opened for appending) at `path`.
    pub(crate) fn new(pipe: OwnedFd, file: File, path: &Path) -> io::Result<Arc<Sink>> {
        let flags = rustix::fs::fcntl_getfl(&pipe)?;
        rustix::fs::fcntl_setfl(&pipe, flags | rustix::fs::OFlags::NONBLOCK)?;
        let len = file.metadata()?.len();
        let log_fd = file.as_raw_fd();
        Ok(Arc::new(Sink {
            pipe,
            log: Mutex::new(Log {
                file,
                len,
                buf: vec![0; READ],
                ended: false,
                spill: VecDeque::new(),
                spill_bytes: 0,
                failing: None,
                cuts: 0,
            }),
            room: Condvar::new(),
            rotate_at: u64::MAX.into(),
            spilled: EventFd::from_flags(EfdFlags::EFD_CLOEXEC | EfdFlags::EFD_NONBLOCK)?,
            wake: EventFd::from_flags(EfdFlags::EFD_CLOEXEC | EfdFlags::EFD_NONBLOCK)?,
            stop: AtomicBool::new(false),
            pace_ms: Default::default(),
            log_fd,
            path: path.to_path_buf(),
        }))
    }

    /// Hold the writer: while the guard lives, nothing is read from the
    /// pipe and nothing reaches the file.
    pub(crate) fn lock(&self) -> MutexGuard<'_, Log> {
        self.log.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Move everything the pipe holds now to the file (a drain: the child
    /// has exited, and all it wrote is in the pipe). Never waits for the
    /// follower: with the file refusing writes and the bytes set aside
    /// full, the rest stays in the pipe for the writer's thread.
    pub(crate) fn flush(&self) {
        let mut log = self.lock();
        // What is there now, not what a child writing on adds meanwhile.
        let mut left = rustix::io::ioctl_fionread(&self.pipe).unwrap_or(u64::MAX);
        while left > 0 && log.spill_bytes + READ <= SPILL {
            match self.move_once(&mut log) {
                Moved::Bytes(n) => left = left.saturating_sub(n as u64),
                Moved::Empty | Moved::Ended => break,
            }
        }
    }

    /// One read of the pipe, written to the file (or set aside).
    fn move_once(&self, log: &mut Log) -> Moved {
        let Log { file, len, buf, ended, spill, spill_bytes, failing, .. } = log;
        if *ended {
            return Moved::Ended;
        }
        let n = loop {
            match rustix::io::read(&self.pipe, &mut buf[..]) {
                Ok(0) => {
                    *ended = true;
                    return Moved::Ended;
                }
                Ok(n) => break n,
                Err(rustix::io::Errno::INTR) => {}
                Err(rustix::io::Errno::AGAIN) => return Moved::Empty,
                Err(e) => {
                    // A read end that fails is not one the warden made:
                    // nothing more can come out of it.
                    tracing::error!(error = %e, "cannot read the child's output");
                    *ended = true;
                    return Moved::Ended;
                }
            }
        };
        let data = &buf[..n];
        let mut done = 0;
        let mut refused = None;
        // While bytes are set aside, the file waits: the follower reads
        // them at its end, so nothing may be written after it meanwhile.
        if spill.is_empty() {
            while done < n {
                match file.write(&data[done..]) {
                    Ok(0) => {
                        refused = Some(io::Error::from(io::ErrorKind::WriteZero));
                        break;
                    }
                    Ok(k) => done += k,
                    Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                    Err(e) => {
                        refused = Some(e);
                        break;
                    }
                }
            }
        }
        *len += done as u64;
        if done < n {
            let rest = data[done..].to_vec();
            if let Some(e) = refused
                && failing.is_none()
            {
                tracing::error!(
                    EVENT = "log-file",
                    "cannot write the log file {}: {e}; the child's output is still read, its lines classified \
                     and forwarded, but missing from the file until it can be written again",
                    self.path.display()
                );
                *failing = Some((e.to_string(), 0));
            }
            if let Some((_, missing)) = failing {
                *missing += rest.len() as u64;
            }
            *spill_bytes += rest.len();
            spill.push_back((*len, rest));
            let _ = self.spilled.write(1);
        } else if let Some((why, missing)) = failing.take() {
            tracing::warn!(
                EVENT = "log-file",
                "the log file {} is written again; {missing} bytes of the child's output are missing from it ({why})",
                self.path.display()
            );
        }
        Moved::Bytes(n)
    }

    /// Take the oldest bytes set aside, if they come after `read_to` (the
    /// follower has read the file up to there: they are next).
    pub(crate) fn take_spilled(&self, read_to: u64) -> Option<Vec<u8>> {
        let bytes = self.lock().take_spilled(read_to);
        if bytes.is_some() {
            self.room.notify_all();
        }
        bytes
    }

    /// Let the writer know that bytes set aside were taken by whoever held
    /// it ([`Log::take_spilled`]), or that the file was cut.
    pub(crate) fn room_again(&self) {
        self.room.notify_all();
    }

    /// The file is rotated once it holds `size` bytes (`None`: it is not
    /// rotated, or no longer followed): from there on the writer waits for
    /// the rotation before it writes more (see [`ROTATION_PATIENCE`]).
    pub(crate) fn rotate_at(&self, size: Option<u64>) {
        self.rotate_at.store(size.unwrap_or(u64::MAX), Ordering::SeqCst);
        self.room.notify_all();
    }

    /// Readable when bytes were set aside; [`Sink::spill_seen`] empties it.
    pub(crate) fn spilled_fd(&self) -> BorrowedFd<'_> {
        self.spilled.as_fd()
    }

    pub(crate) fn spill_seen(&self) {
        let _ = self.spilled.read();
    }

    /// The descriptors an upgrade keeps across its exec: the pipe's read
    /// end and the log file (what [`Sink::lock`] guards is not taken).
    pub(crate) fn fds(&self) -> (RawFd, RawFd) {
        (self.pipe.as_raw_fd(), self.log_fd)
    }

    /// A descriptor of the log file (the same open file).
    pub(crate) fn file(&self) -> io::Result<File> {
        self.lock().file.try_clone()
    }

    /// The log file's path.
    pub(crate) fn path(&self) -> &Path {
        &self.path
    }
}

impl Log {
    /// The log file, to read and copy (the rotation's last step).
    pub(crate) fn file(&self) -> &File {
        &self.file
    }

    /// The log file's length, as written.
    pub(crate) fn len(&self) -> u64 {
        self.len
    }

    /// [`Sink::take_spilled`], by whoever holds the writer (who lets it
    /// know that there is room again when it lets go: the writer looks
    /// again at least every second).
    pub(crate) fn take_spilled(&mut self, read_to: u64) -> Option<Vec<u8>> {
        if self.spill.front().is_none_or(|(at, _)| *at > read_to) {
            return None;
        }
        let (_, bytes) = self.spill.pop_front()?;
        self.spill_bytes -= bytes.len();
        Some(bytes)
    }

    /// Cut the file's first `at` bytes out (a rotation, which copied them):
    /// the file emptied and `write_rest` called to write back what it held
    /// after them; the bytes set aside, which come after the file's end,
    /// shift with it. `Err` when the file could not be emptied (it is as it
    /// was).
    pub(crate) fn cut(&mut self, at: u64, write_rest: impl FnOnce(&mut File) -> io::Result<()>) -> io::Result<()> {
        let before = self.len;
        self.file.set_len(0)?;
        if let Err(e) = write_rest(&mut self.file) {
            tracing::error!(
                error = %e,
                "cannot write the log file's rest back after a rotation: up to {} bytes lost from it",
                before.saturating_sub(at)
            );
        }
        self.len = self.file.metadata().map_or(before.saturating_sub(at), |m| m.len());
        for (spilled_at, _) in &mut self.spill {
            *spilled_at = spilled_at.saturating_sub(at);
        }
        self.cuts += 1;
        Ok(())
    }
}

/// The log writer's thread: started per child, ended when no process holds
/// the pipe's write end any more, or when dropped.
pub(crate) struct Writer {
    sink: Arc<Sink>,
    task: tokio::task::AbortHandle,
}

impl Writer {
    /// Start moving the child's output from `sink`'s pipe to its file, on
    /// a thread watched as the task "log writer" (its panic is the task's).
    pub(crate) fn start(sink: Arc<Sink>, tasks: &mut Tasks) -> Writer {
        let s = sink.clone();
        let thread = tokio::task::spawn_blocking(move || write_until_ended(&s));
        let task = tasks.spawn("log writer", Lifetime::Finite, async move {
            if let Err(e) = thread.await
                && e.is_panic()
            {
                std::panic::resume_unwind(e.into_panic());
            }
        });
        Writer { sink, task }
    }

    pub(crate) fn sink(&self) -> &Arc<Sink> {
        &self.sink
    }

    /// Move the pipe at most every `every` while it is not full (the child
    /// is ready: see [`Sink`]'s `pace_ms`).
    pub(crate) fn pace(&self, every: Duration) {
        let ms = u64::try_from(every.as_millis()).unwrap_or(u64::MAX);
        self.sink.pace_ms.store(ms, Ordering::SeqCst);
    }
}

impl Drop for Writer {
    fn drop(&mut self) {
        self.task.abort();
        self.sink.stop.store(true, Ordering::SeqCst);
        let _ = self.sink.wake.write(1);
        self.sink.room.notify_all();
    }
}

/// Wait for the pipe, move what it holds, until it ends or the writer is
/// stopped.
fn write_until_ended(sink: &Sink) {
    // The cut count when a rotation last kept the writer waiting past
    // its patience: it waits again only after the next cut.
    let mut gave_up: Option<u64> = None;
    loop {
        if sink.stop.load(Ordering::SeqCst) {
            return;
        }
        let mut fds =
            [PollFd::new(sink.pipe.as_fd(), PollFlags::POLLIN), PollFd::new(sink.wake.as_fd(), PollFlags::POLLIN)];
        match nix::poll::poll(&mut fds, PollTimeout::NONE) {
            Ok(_) | Err(nix::errno::Errno::EINTR) => {}
            Err(e) => {
                tracing::error!(error = %e, "cannot wait for the child's output");
                return;
            }
        }
        if fds[1].any().unwrap_or(true) {
            let _ = sink.wake.read();
        }
        let mut log = sink.lock();
        // The follower is far behind the bytes set aside: wait for it
        // (the child's writes wait in turn once the pipe is full).
        while log.spill_bytes + READ > SPILL && !sink.stop.load(Ordering::SeqCst) {
            log = sink.room.wait_timeout(log, Duration::from_secs(1)).unwrap_or_else(|p| p.into_inner()).0;
        }
        // The file has reached its size: wait for the rotation (the
        // child's writes wait in the pipe, then in the child).
        let full = |log: &Log| log.len >= sink.rotate_at.load(Ordering::SeqCst);
        if full(&log) && gave_up != Some(log.cuts) {
            let (cuts, until) = (log.cuts, std::time::Instant::now() + ROTATION_PATIENCE);
            while log.cuts == cuts && full(&log) && !sink.stop.load(Ordering::SeqCst) {
                let Some(left) = until.checked_duration_since(std::time::Instant::now()).filter(|d| !d.is_zero())
                else {
                    gave_up = Some(cuts);
                    tracing::warn!(
                        EVENT = "log-file",
                        "the log file {} reached its size ({} bytes) and was not rotated within {}s: the child's \
                         output is written on past it until the next rotation (nothing is dropped)",
                        sink.path.display(),
                        log.len,
                        ROTATION_PATIENCE.as_secs()
                    );
                    break;
                };
                log = sink.room.wait_timeout(log, left).unwrap_or_else(|p| p.into_inner()).0;
            }
        }
        let moved = sink.move_once(&mut log);
        drop(log);
        match moved {
            Moved::Ended => return,
            // The pipe was emptied by a read of less than it holds: let the
            // next lines gather (only a stop ends the pause early).
            Moved::Bytes(n) if n < READ => {
                let ms = sink.pace_ms.load(Ordering::SeqCst);
                if ms > 0 {
                    let mut wake = [PollFd::new(sink.wake.as_fd(), PollFlags::POLLIN)];
                    let _ = nix::poll::poll(&mut wake, PollTimeout::try_from(ms).unwrap_or(PollTimeout::MAX));
                }
            }
            _ => {}
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Read;

    fn sink(dir: &Path, file: File) -> (Arc<Sink>, File) {
        let (read, write) = pipe().unwrap();
        (Sink::new(read, file, &dir.join("t.log")).unwrap(), File::from(write))
    }

    /// What the child writes is in the file, in order, after a flush; the
    /// pipe's end is seen.
    #[test]
    fn the_pipe_is_moved_to_the_file() {
        let d = tempfile::tempdir().unwrap();
        let path = d.path().join("t.log");
        std::fs::write(&path, "before\n").unwrap();
        let file = std::fs::OpenOptions::new().append(true).open(&path).unwrap();
        let (s, mut child) = sink(d.path(), file);
        for i in 0..1000 {
            writeln!(child, "line {i}").unwrap();
        }
        s.flush();
        let want: String =
            std::iter::once("before\n".to_string()).chain((0..1000).map(|i| format!("line {i}\n"))).collect();
        assert_eq!(std::fs::read_to_string(&path).unwrap(), want);
        assert_eq!(s.lock().len(), want.len() as u64);
        drop(child);
        assert_eq!(s.move_once(&mut s.lock()), Moved::Ended);
    }

    /// A file that refuses writes: the bytes are set aside for the
    /// follower, with the offset they belong at, and the file is written
    /// again when it can be.
    #[test]
    fn what_the_file_refuses_is_set_aside() {
        let d = tempfile::tempdir().unwrap();
        let path = d.path().join("t.log");
        std::fs::write(&path, "ok\n").unwrap();
        // Read-only: every write fails (as on a full disk).
        let (s, mut child) = sink(d.path(), File::open(&path).unwrap());
        child.write_all(b"lost 1\n").unwrap();
        s.flush();
        child.write_all(b"lost 2\n").unwrap();
        s.flush();
        // Not before the follower has read the file's 3 bytes.
        assert_eq!(s.take_spilled(2), None);
        assert_eq!(s.take_spilled(3).unwrap(), b"lost 1\n");
        assert_eq!(s.take_spilled(3).unwrap(), b"lost 2\n");
        assert_eq!(s.take_spilled(3), None);
        let mut text = String::new();
        File::open(&path).unwrap().read_to_string(&mut text).unwrap();
        assert_eq!(text, "ok\n");
    }

    /// A file at its rotation size whose rotation never comes (nothing
    /// follows it): the writer waits, then writes on; nothing is dropped.
    #[test]
    fn a_rotation_that_never_comes_holds_nothing_back() {
        let d = tempfile::tempdir().unwrap();
        let path = d.path().join("t.log");
        let file = std::fs::OpenOptions::new().create(true).append(true).open(&path).unwrap();
        let (s, mut child) = sink(d.path(), file);
        s.rotate_at(Some(1 << 20));
        let thread = {
            let s = s.clone();
            std::thread::spawn(move || write_until_ended(&s))
        };
        // Three times the size, more than the pipe holds.
        let text: String =
            (0..40_000).map(|i| format!("line {i:08} of a child whose log is never rotated\n")).collect();
        child.write_all(text.as_bytes()).unwrap();
        drop(child);
        thread.join().unwrap();
        assert!(std::fs::read_to_string(&path).unwrap() == text);
    }

    /// The writer's thread moves what comes, and ends at the pipe's end.
    #[test]
    fn the_writer_ends_with_the_pipe() {
        let d = tempfile::tempdir().unwrap();
        let path = d.path().join("t.log");
        let file = std::fs::OpenOptions::new().create(true).append(true).open(&path).unwrap();
        let (s, mut child) = sink(d.path(), file);
        let thread = {
            let s = s.clone();
            std::thread::spawn(move || write_until_ended(&s))
        };
        child.write_all(b"one\ntwo\n").unwrap();
        drop(child);
        thread.join().unwrap();
        assert_eq!(std::fs::read_to_string(&path).unwrap(), "one\ntwo\n");
    }
}
