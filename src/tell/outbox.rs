//! The status files and the notifications to systemd, written and sent in
//! order by a worker of their own ([`crate::util::worker`]), so that neither
//! a slow or stuck filesystem nor a full notify socket holds the loop. A
//! notification goes out only once every file posted before it is written:
//! whoever hears `READY=1` finds the files saying ready. Of each file only
//! the newest content waits, beside the worker's queue; the notes wait in
//! the queue, coalesced by the notifier when it cannot send them (see
//! [`crate::tell::notify`]). `WATCHDOG=1` does not wait behind them: it
//! says that the loop turns, and is sent from the loop. Housekeeping that
//! would take a CPU from the news (the tree record, the ledger, a report's
//! file work) is handed on by the same thread once the news is out
//! ([`Outbox::after_sent`]).
//!
//! A handle, made by the daemon ([`Outbox::start`]) and passed down; the
//! commands and the tests of the status files use [`Outbox::direct`], which
//! writes at once.

use std::io;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use crate::tell::notify::{Note, Notifier};
use crate::util::worker::{Handler, Worker};

/// Where the status files and notes go: the writer's thread, or at once.
#[derive(Clone)]
pub struct Outbox {
    /// `None`: written and run at once, by the caller.
    thread: Option<Thread>,
}

#[derive(Clone)]
struct Thread {
    worker: Worker<Item>,
    files: Arc<Mutex<Files>>,
}

/// What the writer's thread is handed, in order. Before each, it writes the
/// files posted so far.
enum Item {
    /// The files posted (a change that notifies nothing).
    Files,
    /// One datagram of notes.
    Notes(Vec<Note>),
    /// Work to do once the news before it is out.
    After(Job),
}

/// The files waiting, beside the queue: the newest content of each.
#[derive(Default)]
struct Files {
    /// In the order first posted.
    waiting: Vec<(PathBuf, Vec<u8>, u32)>,
    /// An [`Item::Files`] is queued and not yet taken.
    kicked: bool,
}

/// Work handed on after the news: quick, and never waiting for the outbox.
type Job = Box<dyn FnOnce() + Send>;

/// How many notes and jobs may wait for the writer's thread; more are
/// dropped and counted (a filesystem that does not answer).
const QUEUE: usize = 1024;

fn lock(files: &Mutex<Files>) -> MutexGuard<'_, Files> {
    files.lock().unwrap_or_else(|p| p.into_inner())
}

impl Outbox {
    /// Start the writer's thread, which sends notes through `notifier`;
    /// `notifier` back if the thread cannot be started.
    pub(crate) fn start<N: Notifier + 'static>(notifier: N) -> Result<Outbox, N> {
        let files = Arc::new(Mutex::new(Files::default()));
        // Handed to the thread, or back if it cannot start.
        let handed = Arc::new(Mutex::new(Some(notifier)));
        let handler = Writer { files: files.clone(), notifier: handed.clone(), failing: Vec::new() };
        match Worker::named("status writer", QUEUE).start_with(handler) {
            Ok(worker) => Ok(Outbox { thread: Some(Thread { worker, files }) }),
            Err(e) => {
                tracing::warn!(error = %e, "cannot start the status writer: the loop writes the status files itself");
                Err(handed.lock().unwrap_or_else(|p| p.into_inner()).take().expect("the thread never started"))
            }
        }
    }

    /// Files written, and jobs run, at once by their caller.
    pub(crate) fn direct() -> Outbox {
        Outbox { thread: None }
    }

    /// Write `bytes` to `path` whole, by rename
    /// ([`crate::util::fsutil::replace`]), its folder made if missing: by
    /// the writer's thread (then `Ok` at once; a failure is logged there),
    /// else at once. The thread is woken by the notes that follow, or by
    /// [`Outbox::kick`] (one wake-up for a change and its notes).
    pub(crate) fn replace(&self, path: &Path, bytes: &[u8], mode: u32) -> io::Result<()> {
        let Some(t) = &self.thread else { return write_file(path, bytes, mode) };
        let mut f = lock(&t.files);
        match f.waiting.iter_mut().find(|(p, ..)| p == path) {
            Some(waiting) => *waiting = (path.to_path_buf(), bytes.to_vec(), mode),
            None => f.waiting.push((path.to_path_buf(), bytes.to_vec(), mode)),
        }
        Ok(())
    }

    /// Have the files posted written, with no note after them (a change
    /// that notifies nothing): the observer of the state calls it once
    /// each change is carried out.
    pub(crate) fn kick(&self) {
        let Some(t) = &self.thread else { return };
        let mut f = lock(&t.files);
        if f.waiting.is_empty() || f.kicked {
            return;
        }
        f.kicked = t.worker.send(Item::Files);
    }

    fn post_notes(&self, notes: &[Note]) {
        if let Some(t) = &self.thread {
            t.worker.send(Item::Notes(notes.to_vec()));
        }
    }

    /// Run `job` once the files and notes posted so far are written and
    /// sent (at once without the thread): the housekeeping that goes with a
    /// change wakes its thread only after the change's news is out, so that
    /// on a busy machine that thread does not take the CPU the news waits
    /// for. `job` runs on the writer's thread: it must be quick and must not
    /// wait for the outbox (it hands work on to a thread of its own).
    pub(crate) fn after_sent(&self, job: impl FnOnce() + Send + 'static) {
        match &self.thread {
            Some(t) => {
                t.worker.send(Item::After(Box::new(job)));
            }
            None => job(),
        }
    }

    /// Wait until all that was posted is written and sent (a note that
    /// could not be delivered is not waited for), at most `limit`; false if
    /// that did not come. Before the warden exits or execs, nothing posted
    /// is lost.
    pub(crate) fn settle(&self, limit: Duration) -> bool {
        let Some(t) = &self.thread else { return true };
        self.kick();
        t.worker.flush(limit)
    }
}

/// [`crate::util::fsutil::replace`], making the folder when it is missing.
fn write_file(path: &Path, bytes: &[u8], mode: u32) -> io::Result<()> {
    if crate::util::tasks::injected_panic("status-write") {
        // A test's stand-in for a write to a filesystem that never answers.
        loop {
            std::thread::park();
        }
    }
    match crate::util::fsutil::replace(path, bytes, mode) {
        Err(e) if e.kind() == io::ErrorKind::NotFound => {
            if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
                std::fs::create_dir_all(dir)?;
            }
            crate::util::fsutil::replace(path, bytes, mode)
        }
        done => done,
    }
}

/// The writer's thread: before each item, the files posted, in the order
/// first posted; then the item: notes sent as they were posted, an
/// undelivered note tried again when the notifier says.
struct Writer<N> {
    files: Arc<Mutex<Files>>,
    /// Taken once the thread runs (it is handed back if it cannot start).
    notifier: Arc<Mutex<Option<N>>>,
    /// The files whose last write failed: said once until one succeeds.
    failing: Vec<PathBuf>,
}

impl<N: Notifier + 'static> Writer<N> {
    fn write_files(&mut self) {
        let waiting = {
            let mut f = lock(&self.files);
            f.kicked = false;
            std::mem::take(&mut f.waiting)
        };
        for (path, bytes, mode) in waiting {
            match write_file(&path, &bytes, mode) {
                Ok(()) => self.failing.retain(|p| *p != path),
                Err(e) if !self.failing.contains(&path) => {
                    tracing::warn!(error = %e, file = %path.display(), "cannot write the status file");
                    self.failing.push(path);
                }
                Err(_) => {}
            }
        }
    }

    fn notifier(&self) -> MutexGuard<'_, Option<N>> {
        self.notifier.lock().unwrap_or_else(|p| p.into_inner())
    }
}

impl<N: Notifier + 'static> Handler<Item> for Writer<N> {
    fn handle(&mut self, item: Item) {
        self.write_files();
        match item {
            Item::Files => {
                if let Some(n) = self.notifier().as_mut() {
                    n.retry();
                }
            }
            Item::Notes(notes) => {
                if let Some(n) = self.notifier().as_mut() {
                    n.notify(&notes);
                }
            }
            Item::After(job) => job(),
        }
    }

    fn wake_at(&self) -> Option<Instant> {
        self.notifier().as_ref()?.retry_at().map(tokio::time::Instant::into_std)
    }

    fn wake(&mut self) {
        if let Some(n) = self.notifier().as_mut() {
            n.retry();
        }
    }
}

/// The loop's notifier with the outbox: every note goes behind the files
/// posted before it, but `WATCHDOG=1`, sent at once through a notifier of
/// its own when there is one.
pub(crate) struct Behind {
    outbox: Outbox,
    watchdog: Option<Box<dyn Notifier>>,
}

impl Behind {
    /// The notes through `outbox`; `WATCHDOG=1` through `watchdog`.
    pub(crate) fn new(outbox: Outbox, watchdog: Option<Box<dyn Notifier>>) -> Behind {
        Behind { outbox, watchdog }
    }
}

impl Notifier for Behind {
    fn notify(&mut self, notes: &[Note]) {
        match &mut self.watchdog {
            Some(w) if notes.iter().all(|n| *n == Note::Watchdog) => w.notify(notes),
            _ => self.outbox.post_notes(notes),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Sends what it is given to a channel, with what the status file said
    /// at that instant.
    struct Recorder {
        file: PathBuf,
        sent: std::sync::mpsc::Sender<(Vec<Note>, String)>,
    }

    impl Notifier for Recorder {
        fn notify(&mut self, notes: &[Note]) {
            let file = std::fs::read_to_string(&self.file).unwrap_or_default();
            let _ = self.sent.send((notes.to_vec(), file));
        }
    }

    /// Notes go out after the files posted before them, the newest content
    /// of each file only; `settle` waits for both.
    #[test]
    fn a_note_goes_out_after_the_files_posted_before_it() {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("run").join("status.json");
        let (tx, rx) = std::sync::mpsc::channel();
        let recorder = Recorder { file: file.clone(), sent: tx };
        let outbox = Outbox::start(recorder).ok().unwrap();
        for state in ["launching", "starting", "ready"] {
            outbox.replace(&file, state.as_bytes(), 0o644).unwrap();
        }
        outbox.kick();
        let mut loop_side = Behind::new(outbox.clone(), None);
        loop_side.notify(&[Note::Ready]);
        assert!(outbox.settle(Duration::from_secs(60)));
        let (notes, said) = rx.recv().unwrap();
        assert_eq!((notes, said.as_str()), (vec![Note::Ready], "ready"));
        assert!(rx.try_recv().is_err());
        use std::os::unix::fs::PermissionsExt;
        assert_eq!(std::fs::metadata(&file).unwrap().permissions().mode() & 0o777, 0o644);
    }

    /// Work handed on after the news runs once the notes posted before it
    /// are sent, and `settle` waits for it too.
    #[test]
    fn work_after_the_news_runs_once_it_is_sent() {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("status.json");
        let (tx, rx) = std::sync::mpsc::channel();
        let recorder = Recorder { file: file.clone(), sent: tx.clone() };
        let outbox = Outbox::start(recorder).ok().unwrap();
        outbox.replace(&file, b"ready", 0o644).unwrap();
        Behind::new(outbox.clone(), None).notify(&[Note::Ready]);
        outbox.after_sent(move || tx.send((Vec::new(), "after".into())).unwrap());
        assert!(outbox.settle(Duration::from_secs(60)));
        assert_eq!(rx.try_recv().unwrap(), (vec![Note::Ready], "ready".to_string()));
        assert_eq!(rx.try_recv().unwrap(), (Vec::new(), "after".to_string()));
    }

    /// `WATCHDOG=1` goes at once through its own notifier, whatever waits.
    #[test]
    fn the_watchdog_does_not_wait() {
        let (tx, rx) = std::sync::mpsc::channel();
        let dir = tempfile::tempdir().unwrap();
        let watchdog = Recorder { file: dir.path().join("none"), sent: tx };
        // An outbox whose thread does not run: what is posted waits.
        let worker = Worker::named("status writer", QUEUE).unstarted();
        let outbox = Outbox { thread: Some(Thread { worker: worker.clone(), files: Arc::default() }) };
        let mut loop_side = Behind::new(outbox, Some(Box::new(watchdog)));
        loop_side.notify(&[Note::Watchdog]);
        assert_eq!(rx.try_recv().unwrap().0, vec![Note::Watchdog]);
        loop_side.notify(&[Note::Ready]);
        assert!(rx.try_recv().is_err());
        assert_eq!(worker.high_water().0, 1, "the note waits for the thread");
    }

    #[test]
    fn without_the_outbox_a_file_is_written_at_once_its_folder_made() {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("a").join("b.json");
        write_file(&file, b"x", 0o600).unwrap();
        assert_eq!(std::fs::read(&file).unwrap(), b"x");
    }

    /// Without its thread, the outbox writes at once and runs what comes
    /// after at once.
    #[test]
    fn a_direct_outbox_writes_and_runs_at_once() {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("a").join("status.json");
        let outbox = Outbox::direct();
        outbox.replace(&file, b"ready", 0o644).unwrap();
        assert_eq!(std::fs::read(&file).unwrap(), b"ready");
        let (tx, rx) = std::sync::mpsc::channel();
        outbox.after_sent(move || tx.send(()).unwrap());
        rx.try_recv().unwrap();
        assert!(outbox.settle(Duration::ZERO));
    }
}
