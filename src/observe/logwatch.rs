//! Following the child's log file.
//!
//! [`LogFollower`] reads the file from a thread of its own, woken by inotify
//! (no polling loop), and survives truncation, rename and re-creation. The
//! file is written by the warden's log writer from the child's pipe
//! (`observe::logpipe`): a drain has it empty the pipe first, and what the
//! file refused (a full disk) is read from the writer instead. On
//! that thread the supervisor's [`Splitter`] cuts the bytes into lines and
//! its [`Classifier`] tells what each means (`supervisor::classify`); a
//! [`Tap`] sees every line.
//! Only the lines that matter to the state machine are handed on, in
//! batches, through a bounded channel: when the loop is behind, the
//! follower waits, and the file is the buffer. Restart policy is not known
//! here.

use std::fs::File;
use std::io;
use std::os::fd::{AsFd, AsRawFd};
use std::os::unix::fs::FileExt;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use nix::poll::{PollFd, PollFlags, PollTimeout};
use nix::sys::eventfd::{EfdFlags, EventFd};
use nix::sys::inotify::{AddWatchFlags, InitFlags, Inotify};
use tokio::sync::mpsc;

use crate::config::Rotation;
use crate::observe::logpipe::Sink;
use crate::observe::rotate::Rotator;
use crate::supervisor::classify::{Classifier, Level, Line, Splitter};
use crate::util::tasks::{Lifetime, Tasks};

/// How much of the file one read takes.
const READ: usize = 64 * 1024;

/// A batch is handed on once it holds this many lines or this many bytes of
/// text, and at the end of every read.
pub(crate) const BATCH_LINES: usize = 256;
pub(crate) const BATCH_BYTES: usize = 64 * 1024;

/// While a drain is asked for, an empty batch every this many reads
/// (1 MiB) tells the loop that a long tail is still being read.
const DRAIN_BEAT: usize = 16;

/// Batches that may wait for the loop; then the follower waits too.
pub const QUEUE: usize = 4;

/// Sees every non-blank line the follower reads, on the follower's thread
/// (the journal, the traffic seen by the canary).
pub trait Tap: Send {
    fn line(&mut self, text: &str, level: Option<Level>);
    /// One read is done: a moment to pass on what was gathered.
    fn end_of_read(&mut self) {}
}

/// What a follower hands to the loop, in the order of the file.
#[derive(Debug)]
pub enum Delivery {
    /// Lines of start `start` that [matter](Line::matters) to the machine.
    Lines { start: u32, lines: Vec<Line>, held: Held },
    /// Everything that was in the file when [`LogFollower::drain`] was called
    /// has been delivered.
    Drained { start: u32 },
}

/// Bytes of line text handed on and not yet dropped by the loop, and the
/// most there ever were: the follower's memory, measured.
#[derive(Debug, Clone, Default)]
pub(crate) struct Gauge(Arc<(AtomicUsize, AtomicUsize)>);

impl Gauge {
    pub(crate) fn hold(&self, bytes: usize) -> Held {
        let now = self.0.0.fetch_add(bytes, Ordering::Relaxed) + bytes;
        self.0.1.fetch_max(now, Ordering::Relaxed);
        Held { gauge: self.clone(), bytes }
    }

    /// Bytes held now.
    #[cfg(test)]
    pub(crate) fn held(&self) -> usize {
        self.0.0.load(Ordering::Relaxed)
    }

    /// The most bytes ever held at once.
    #[cfg(test)]
    pub(crate) fn high_water(&self) -> usize {
        self.0.1.load(Ordering::Relaxed)
    }
}

/// A batch's bytes, counted in the [`Gauge`] until it is dropped.
#[derive(Debug)]
pub struct Held {
    gauge: Gauge,
    bytes: usize,
}

impl Drop for Held {
    fn drop(&mut self) {
        self.gauge.0.0.fetch_sub(self.bytes, Ordering::Relaxed);
    }
}

/// What the loop asks of the follower's thread.
#[derive(Debug, Default)]
struct Asked {
    drain: bool,
    stop: bool,
    /// Patterns reloaded: classify with these from the next read on.
    classifier: Option<Classifier>,
    /// Read at most this often (a drain is answered at once all the same).
    pace: Option<std::time::Duration>,
    /// New rotation settings (a reload).
    rotation: Option<Rotation>,
}

#[derive(Debug)]
struct Control {
    asked: Mutex<Asked>,
    /// Wakes the thread from its wait for inotify.
    wake: EventFd,
    /// Once the thread has ended: the offset of the first line it did not
    /// hand on whole.
    ended: Mutex<Option<u64>>,
    ended_now: std::sync::Condvar,
    /// Where the last read asked for by [`LogFollower::drain`] ended (the end
    /// of the file then), before its [`Delivery::Drained`] was sent;
    /// `u64::MAX` before one.
    drained: std::sync::atomic::AtomicU64,
}

impl Control {
    fn ask(&self, f: impl FnOnce(&mut Asked)) {
        f(&mut self.asked.lock().unwrap_or_else(|p| p.into_inner()));
        let _ = self.wake.write(1);
    }

    fn take(&self) -> (bool, bool, Option<std::time::Duration>) {
        let mut a = self.asked.lock().unwrap_or_else(|p| p.into_inner());
        (std::mem::take(&mut a.drain), a.stop, a.pace)
    }

    fn take_classifier(&self) -> Option<Classifier> {
        self.asked.lock().unwrap_or_else(|p| p.into_inner()).classifier.take()
    }

    fn take_rotation(&self) -> Option<Rotation> {
        self.asked.lock().unwrap_or_else(|p| p.into_inner()).rotation.take()
    }

    fn stopped(&self) -> bool {
        self.asked.lock().unwrap_or_else(|p| p.into_inner()).stop
    }
}

/// Lines that matter, gathered until they are handed on.
#[derive(Debug, Default)]
struct Batch {
    lines: Vec<Line>,
    bytes: usize,
}

impl Batch {
    fn push(&mut self, line: Line) {
        self.bytes += line.text.len() + line.message.len();
        self.lines.push(line);
    }

    fn full(&self) -> bool {
        self.lines.len() >= BATCH_LINES || self.bytes >= BATCH_BYTES
    }

    /// Hand the batch on, waiting while the loop is behind; false when the
    /// loop is gone.
    fn hand_on(&mut self, out: &mpsc::Sender<Delivery>, gauge: &Gauge, start: u32) -> bool {
        if self.lines.is_empty() {
            return true;
        }
        let held = gauge.hold(std::mem::take(&mut self.bytes));
        let lines = std::mem::take(&mut self.lines);
        out.blocking_send(Delivery::Lines { start, lines, held }).is_ok()
    }
}

/// The follower's thread: the inode the child writes to, read from where
/// the last read ended, and where its lines go.
struct Reader {
    file: File,
    pos: u64,
    splitter: Splitter,
    classifier: Classifier,
    tap: Option<Box<dyn Tap>>,
    start: u32,
    out: mpsc::Sender<Delivery>,
    gauge: Gauge,
    batch: Batch,
    /// The writer of the file, if the warden writes it.
    sink: Option<Arc<Sink>>,
    rotator: Option<Rotator>,
    /// Every line before this offset has been handed on whole (or did not
    /// matter): where another follower goes on.
    resume_at: u64,
}

impl Reader {
    /// Read to the end of the file (and the bytes the file refused, which
    /// come after it); false when the loop is gone or the follower was
    /// stopped. While `draining`, a read without a line that matters still
    /// says, every [`DRAIN_BEAT`] reads, that reading goes on.
    fn read_to_end(&mut self, buf: &mut [u8], control: &Control, draining: bool) -> bool {
        let mut quiet = 0;
        if let Ok(meta) = self.file.metadata()
            && meta.len() < self.pos
        {
            // Truncated in place (copytruncate): start over.
            self.pos = 0;
            self.splitter = Splitter::default();
        }
        loop {
            let n = match self.file.read_at(buf, self.pos) {
                Ok(0) => match self.sink.as_ref().and_then(|s| s.take_spilled(self.pos)) {
                    Some(bytes) => {
                        if !self.take(&bytes) {
                            return false;
                        }
                        0
                    }
                    None => return true,
                },
                Ok(n) => n,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                Err(_) => return true,
            };
            self.pos += n as u64;
            if !self.take(&buf[..n]) || control.stopped() {
                return false;
            }
            let Reader { start, out, gauge, batch, .. } = self;
            if batch.lines.is_empty() && draining {
                quiet += 1;
                if quiet == DRAIN_BEAT {
                    quiet = 0;
                    let beat = Delivery::Lines { start: *start, lines: Vec::new(), held: gauge.hold(0) };
                    if out.blocking_send(beat).is_err() {
                        return false;
                    }
                }
            } else if !batch.hand_on(out, gauge, *start) {
                return false;
            } else {
                quiet = 0;
            }
            if batch.lines.is_empty() {
                self.resume_at = self.line_end();
            }
            if !draining && self.rotation_due() {
                return true;
            }
        }
    }

    /// Split, classify and tap `bytes`; hand on full batches. False when
    /// the loop is gone.
    fn take(&mut self, bytes: &[u8]) -> bool {
        let Reader { splitter, classifier, tap, start, out, gauge, batch, .. } = self;
        let mut open = true;
        splitter.feed(bytes, |text| {
            let v = classifier.classify_ref(text);
            if let Some(t) = tap.as_mut() {
                t.line(text, v.level);
            }
            if let Some(line) = v.line {
                batch.push(line);
                if open && batch.full() {
                    open = batch.hand_on(out, gauge, *start);
                }
            }
        });
        if let Some(t) = tap.as_mut() {
            t.end_of_read();
        }
        open
    }

    /// The offset after the last whole line read.
    fn line_end(&self) -> u64 {
        self.pos.saturating_sub(self.splitter.pending())
    }

    fn rotation_due(&self) -> bool {
        self.rotator.as_ref().is_some_and(|r| self.pos >= r.settings.max_size)
    }

    /// Copy the file to `NAME.1` up to the end of the last whole line read
    /// and cut that much out of it (the rest, not read yet or a line not
    /// yet ended, moved to its start while the writer is held): nothing is
    /// lost or torn. A follower far behind reads on first (the writer
    /// waits for the rotation meanwhile: see `observe::logpipe`).
    fn rotate(&mut self) {
        /// A rotation waits while the follower is further behind than this:
        /// what it has not read is moved back to the file's start while the
        /// writer waits, and must stay small.
        const BEHIND: u64 = 1 << 20;
        let Some(mut rot) = self.rotator.take() else { return };
        if rot.sink().lock().len().saturating_sub(self.line_end()) > BEHIND {
            // Read on first: the copy holds more than the size.
            self.rotator = Some(rot);
            return;
        }
        // A reader of the bytes by offset goes first.
        let hold = rot.hold();
        let _held = hold.as_ref().map(|h| h.blocking_lock());
        let mut copy = match rot.begin() {
            Ok(c) => c,
            Err(e) => {
                tracing::warn!(error = %e, "cannot rotate the log file: no copy made; it grows on");
                rot.settings.max_size = rot.settings.max_size.saturating_mul(2);
                rot.sink().rotate_at(Some(rot.settings.max_size));
                self.rotator = Some(rot);
                return;
            }
        };
        match self.copy_and_cut(&rot, copy.as_mut().map(|(f, _)| f)) {
            Ok(copied) => {
                let keep = rot.settings.keep;
                match rot.finish(copy) {
                    Ok(()) => tracing::info!(
                        EVENT = "log-rotated",
                        "log file rotated: its first {copied} bytes moved out ({keep} kept)"
                    ),
                    Err(e) => tracing::warn!(error = %e, "log file cut, but its copy could not be put in place"),
                }
            }
            Err(e) => {
                tracing::warn!(error = %e, "cannot rotate the log file");
                if let Some((_, tmp)) = copy {
                    rot.discard(&tmp);
                }
            }
        }
        self.rotator = Some(rot);
    }

    /// Copy the file to `copy` up to the end of the last whole line read,
    /// then, holding the writer (the file stands still), cut that much out
    /// of it: the file emptied and the rest (a line not yet ended, and what
    /// the follower has not read yet) written back at its start. The bytes
    /// cut out, or why not (the file is then as it was).
    fn copy_and_cut(&mut self, rot: &Rotator, copy: Option<&mut File>) -> io::Result<u64> {
        let cut = self.line_end();
        if let Some(file) = copy {
            rot.copy(&self.file, file, 0, cut)?;
        }
        let sink = rot.sink().clone();
        let mut log = sink.lock();
        rot.cut(&mut log, &self.file, cut)?;
        drop(log);
        sink.room_again();
        self.pos -= cut;
        self.resume_at = self.resume_at.saturating_sub(cut);
        Ok(cut)
    }
}

/// Follows the log file the child writes to, from an offset, classifying
/// every line on a thread of its own and handing on those that matter.
///
/// It follows the *inode* the warden opened for the child, not the path:
/// whatever happens to the path (renamed any number of times, deleted,
/// re-created by someone else), the lines read are the child's, and a file
/// that others create at the path is not read.
pub struct LogFollower {
    control: Arc<Control>,
    task: tokio::task::AbortHandle,
    /// What the tests read of the batches held.
    #[cfg(test)]
    gauge: Gauge,
}

impl LogFollower {
    /// Start following the file `log` (the child's stdout and stderr) of
    /// start `start` from byte `offset`: every line goes to `tap`, the lines
    /// that matter to `out`, in batches; the file is rotated by `rotator`. The thread is watched as the task
    /// "log follower".
    #[allow(clippy::too_many_arguments)]
    pub fn start(
        log: &File,
        offset: u64,
        start: u32,
        classifier: Classifier,
        tap: Option<Box<dyn Tap>>,
        sink: Option<Arc<Sink>>,
        rotator: Option<Rotator>,
        out: mpsc::Sender<Delivery>,
        tasks: &mut Tasks,
    ) -> io::Result<LogFollower> {
        // A read-only open file of the same inode, whatever its name becomes.
        let file = File::open(format!("/proc/self/fd/{}", log.as_raw_fd()))?;
        let inotify = Inotify::init(InitFlags::IN_CLOEXEC | InitFlags::IN_NONBLOCK)?;
        // Watched through our own descriptor's magic link: inotify watches
        // the inode it resolves to, and the link stays valid while `file`
        // is open, whatever happens to the path.
        inotify.add_watch(
            format!("/proc/self/fd/{}", file.as_raw_fd()).as_str(),
            AddWatchFlags::IN_MODIFY | AddWatchFlags::IN_CLOSE_WRITE,
        )?;
        let wake = EventFd::from_flags(EfdFlags::EFD_CLOEXEC | EfdFlags::EFD_NONBLOCK)?;
        let control = Arc::new(Control {
            asked: Mutex::default(),
            wake,
            ended: Mutex::default(),
            ended_now: Default::default(),
            drained: u64::MAX.into(),
        });
        let gauge = Gauge::default();
        let reader = Reader {
            file,
            pos: offset,
            splitter: Splitter::default(),
            classifier,
            tap,
            start,
            out,
            gauge: gauge.clone(),
            batch: Batch::default(),
            sink,
            rotator,
            resume_at: offset,
        };
        let c = control.clone();
        // Started now, not when the loop next polls a task: the child's
        // first lines follow its spawn within a millisecond.
        let thread = tokio::task::spawn_blocking(move || follow(reader, &inotify, &c));
        let task = tasks.spawn("log follower", Lifetime::Owned, async move {
            // A panic on the thread is this task's panic.
            if let Err(e) = thread.await
                && e.is_panic()
            {
                std::panic::resume_unwind(e.into_panic());
            }
        });
        Ok(LogFollower {
            control,
            task,
            #[cfg(test)]
            gauge,
        })
    }

    /// Read the file to its end now, without waiting for inotify, then
    /// deliver [`Delivery::Drained`]: used when the child has exited, so
    /// that its last lines are seen before its exit.
    pub fn drain(&self) {
        self.control.ask(|a| a.drain = true);
    }

    /// Classify with `classifier` (reloaded patterns) from the next read on.
    pub(crate) fn reclassify(&self, classifier: Classifier) {
        self.control.ask(|a| a.classifier = Some(classifier));
    }

    /// Where the file ended when the follower last read it to its end for
    /// [`LogFollower::drain`]: known once its [`Delivery::Drained`] is received.
    pub(crate) fn drained_to(&self) -> Option<u64> {
        Some(self.control.drained.load(Ordering::SeqCst)).filter(|at| *at != u64::MAX)
    }

    /// Read at most every `every` from now on: a serving child's lines are
    /// gathered for a few milliseconds, so that a chatty child costs a few
    /// wake-ups a second, not one a line. A drain is still answered at once.
    pub(crate) fn pace(&self, every: std::time::Duration) {
        self.control.ask(|a| a.pace = Some(every));
    }

    /// Rotate with these settings from now on (a reload).
    pub(crate) fn rotation(&self, settings: Rotation) {
        self.control.ask(|a| a.rotation = Some(settings));
    }

    /// The bytes of the batches handed on and not yet dropped.
    #[cfg(test)]
    pub(crate) fn gauge(&self) -> &Gauge {
        &self.gauge
    }
}

impl LogFollower {
    /// Stop reading: the thread ends after the read under way; see
    /// [`LogFollower::ended`].
    pub(crate) fn stop_reading(&self) {
        self.control.ask(|a| a.stop = true);
    }

    /// Once the thread has ended (waiting up to `patience`): the offset of
    /// the first line not handed on whole, from which another follower can
    /// go on. Every batch handed on before it is in the channel; the
    /// thread may wait for room there, so the caller empties it meanwhile.
    pub(crate) fn ended(&self, patience: std::time::Duration) -> Option<u64> {
        let ended = self.control.ended.lock().unwrap_or_else(|p| p.into_inner());
        let (ended, _) = self
            .control
            .ended_now
            .wait_timeout_while(ended, patience, |e| e.is_none())
            .unwrap_or_else(|p| p.into_inner());
        *ended
    }
}

impl Drop for LogFollower {
    fn drop(&mut self) {
        self.task.abort();
        self.control.ask(|a| a.stop = true);
    }
}

/// The follower's thread; at its end, where the next reader should start.
fn follow(mut reader: Reader, inotify: &Inotify, control: &Control) {
    // The writer waits for the rotations of a file at its size while this
    // thread makes them, and no longer.
    if let Some(r) = &reader.rotator {
        r.sink().rotate_at(Some(r.settings.max_size));
    }
    follow_until_stopped(&mut reader, inotify, control);
    if let Some(r) = &reader.rotator {
        r.sink().rotate_at(None);
    }
    *control.ended.lock().unwrap_or_else(|p| p.into_inner()) = Some(reader.resume_at);
    control.ended_now.notify_all();
}

/// Read, then wait for inotify or a request, until stopped.
fn follow_until_stopped(reader: &mut Reader, inotify: &Inotify, control: &Control) {
    let mut buf = vec![0u8; READ];
    let mut events = [0u8; 4096];
    loop {
        let (drain, stop, pace) = control.take();
        if let Some(c) = control.take_classifier() {
            reader.classifier = c;
        }
        if let Some(settings) = control.take_rotation()
            && let Some(r) = reader.rotator.as_mut()
        {
            r.settings = settings;
            r.sink().rotate_at(Some(settings.max_size));
        }
        if drain && let Some(s) = &reader.sink {
            // What the child wrote before its exit is in the pipe.
            s.flush();
        }
        if stop || !reader.read_to_end(&mut buf, control, drain) {
            return;
        }
        if reader.rotation_due() {
            reader.rotate();
            // Read on at once: the rotation cut at what was read, and the
            // follower may be behind.
            if !drain {
                continue;
            }
            if !reader.read_to_end(&mut buf, control, true) {
                return;
            }
        }
        if drain {
            control.drained.store(reader.pos, Ordering::SeqCst);
            if reader.out.blocking_send(Delivery::Drained { start: reader.start }).is_err() {
                return;
            }
        }
        if let Some(pace) = pace {
            // Let lines gather; only a request ends the pause early.
            let ms = PollTimeout::try_from(pace).unwrap_or(PollTimeout::MAX);
            if wait(&mut [PollFd::new(control.wake.as_fd(), PollFlags::POLLIN)], ms).is_err() {
                return;
            }
        }
        // Bytes the file refused wake the follower as a write would.
        let spilled = reader.sink.clone();
        let mut fds = [
            PollFd::new(inotify.as_fd(), PollFlags::POLLIN),
            PollFd::new(control.wake.as_fd(), PollFlags::POLLIN),
            PollFd::new(spilled.as_ref().map_or(control.wake.as_fd(), |s| s.spilled_fd()), PollFlags::POLLIN),
        ];
        if wait(&mut fds, PollTimeout::NONE).is_err() {
            return;
        }
        // Empty what woke us: it said "look again", and that is next.
        if fds[0].any().unwrap_or(true) {
            while nix::unistd::read(inotify, &mut events).is_ok_and(|n| n > 0) {}
        }
        if fds[1].any().unwrap_or(true) {
            let _ = control.wake.read();
        }
        if fds[2].any().unwrap_or(true)
            && let Some(s) = &spilled
        {
            s.spill_seen();
        }
    }
}

fn wait(fds: &mut [PollFd], timeout: PollTimeout) -> Result<(), ()> {
    match nix::poll::poll(fds, timeout) {
        Ok(_) | Err(nix::errno::Errno::EINTR) => Ok(()),
        Err(e) => {
            tracing::error!(error = %e, "cannot wait for the log file to grow");
            Err(())
        }
    }
}

#[cfg(test)]
mod tests;
