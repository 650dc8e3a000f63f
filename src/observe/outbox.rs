//! The status files and the notifications to systemd, written and sent in
//! order by a thread of their own, so that neither a slow or stuck
//! filesystem nor a full notify socket holds the loop. A notification goes
//! out only once every file posted before it is written: whoever hears
//! `READY=1` finds the files saying ready. Of each file only the newest
//! content waits; the notes wait coalesced (see [`crate::observe::notify`]).
//! `WATCHDOG=1` does not wait behind them: it says that the loop turns, and
//! is sent from the loop. Housekeeping that would take a CPU from the
//! news (the tree record, the ledger, a report's file work) is handed on
//! by the same thread once the news is out ([`after_sent`]).
//!
//! Started once by the daemon ([`start`]); until then (the commands, the
//! tests of the status files) [`replace`] writes at once.

use std::io;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, OnceLock};
use std::time::{Duration, Instant};

use crate::observe::notify::{Note, Notifier};

/// The writer's thread and what waits for it.
pub struct Outbox {
    shared: Arc<Shared>,
}

#[derive(Default)]
struct Shared {
    state: Mutex<Waiting>,
    /// Something was posted.
    posted: Condvar,
    /// All that was posted is written and sent.
    done: Condvar,
}

#[derive(Default)]
struct Waiting {
    /// The newest content of each file, in the order first posted.
    files: Vec<(PathBuf, Vec<u8>, u32)>,
    /// The notes posted after them, one datagram each, in order.
    notes: Vec<Vec<Note>>,
    /// What to do once the files and notes posted before it are out.
    after: Vec<Job>,
    /// The thread is writing or sending what it took.
    busy: bool,
}

/// Work handed on after the news: quick, and never waiting for the outbox.
type Job = Box<dyn FnOnce() + Send>;

impl Waiting {
    fn is_empty(&self) -> bool {
        self.files.is_empty() && self.notes.is_empty() && self.after.is_empty()
    }
}

impl Shared {
    fn lock(&self) -> MutexGuard<'_, Waiting> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }
}

static OUTBOX: OnceLock<Outbox> = OnceLock::new();

/// Start the writer's thread, which sends notes through `notifier`; once
/// per process (a second call returns the first outbox, and `notifier` is
/// not used). `notifier` back if the thread cannot be started: files are
/// then written, and notes sent, at once by their caller.
pub fn start<N: Notifier + 'static>(notifier: N) -> Result<&'static Outbox, N> {
    if let Some(o) = OUTBOX.get() {
        return Ok(o);
    }
    let shared = Arc::new(Shared::default());
    // Handed to the thread, or back if it cannot start.
    let handed = Arc::new(Mutex::new(Some(notifier)));
    let (s, h) = (shared.clone(), handed.clone());
    let spawned = std::thread::Builder::new().name("status writer".into()).spawn(move || {
        if let Some(n) = h.lock().unwrap_or_else(|p| p.into_inner()).take() {
            write_and_send(&s, n);
        }
    });
    match spawned {
        Ok(_) => Ok(OUTBOX.get_or_init(|| Outbox { shared })),
        Err(e) => {
            tracing::warn!(error = %e, "cannot start the status writer: the loop writes the status files itself");
            Err(handed.lock().unwrap_or_else(|p| p.into_inner()).take().expect("the thread never started"))
        }
    }
}

/// Write `bytes` to `path` whole, by rename ([`crate::util::fsutil::replace`]),
/// its folder made if missing: by the writer's thread once [`start`]ed
/// (then `Ok` at once; a failure is logged there), else at once.
pub fn replace(path: &Path, bytes: &[u8], mode: u32) -> io::Result<()> {
    match OUTBOX.get() {
        Some(o) => {
            o.post_file(path, bytes, mode);
            Ok(())
        }
        None => write_file(path, bytes, mode),
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

impl Outbox {
    /// Post the newest content of a file; the thread is woken by the notes
    /// that follow, or by [`kick`] (one wake-up for a change and its notes).
    fn post_file(&self, path: &Path, bytes: &[u8], mode: u32) {
        let mut w = self.shared.lock();
        match w.files.iter_mut().find(|(p, ..)| p == path) {
            Some(waiting) => *waiting = (path.to_path_buf(), bytes.to_vec(), mode),
            None => w.files.push((path.to_path_buf(), bytes.to_vec(), mode)),
        }
    }

    fn post_notes(&self, notes: &[Note]) {
        self.shared.lock().notes.push(notes.to_vec());
        // Woken with the lock let go: it does not wake only to wait for it.
        self.shared.posted.notify_one();
    }

    fn post_after(&self, job: Job) {
        self.shared.lock().after.push(job);
        self.shared.posted.notify_one();
    }

    /// Wake the thread for the files posted.
    fn kick(&self) {
        let waiting = !self.shared.lock().files.is_empty();
        if waiting {
            self.shared.posted.notify_one();
        }
    }

    /// Wait until all that was posted is written and sent (a note that
    /// could not be delivered is not waited for), at most `limit`; false if
    /// that did not come.
    pub fn settle(&self, limit: Duration) -> bool {
        self.kick();
        let w = self.shared.lock();
        let (_w, waited) = self
            .shared
            .done
            .wait_timeout_while(w, limit, |w| w.busy || !w.is_empty())
            .unwrap_or_else(|p| p.into_inner());
        !waited.timed_out()
    }
}

/// Have the files posted written, with no note after them (a change that
/// notifies nothing): the observer of the state calls it once each change
/// is carried out.
pub fn kick() {
    if let Some(o) = OUTBOX.get() {
        o.kick();
    }
}

/// Run `job` once the files and notes posted so far are written and sent
/// (at once without the outbox): the housekeeping that goes with a change
/// wakes its thread only after the change's news is out, so that on a
/// busy machine that thread does not take the CPU the news waits for.
/// `job` runs on the writer's thread: it must be quick and must not wait
/// for the outbox (it hands work on to a thread of its own).
pub fn after_sent(job: impl FnOnce() + Send + 'static) {
    match OUTBOX.get() {
        Some(o) => o.post_after(Box::new(job)),
        None => job(),
    }
}

/// [`Outbox::settle`] on the outbox, if started: before the warden exits or
/// execs, nothing posted is lost.
pub fn settle(limit: Duration) -> bool {
    OUTBOX.get().is_none_or(|o| o.settle(limit))
}

/// The writer's thread: what was posted, the files first, then the notes
/// posted with or after them, as they were posted; an undelivered note
/// tried again when `notifier` says.
fn write_and_send(shared: &Shared, mut notifier: impl Notifier) {
    // The files whose last write failed: said once until one succeeds.
    let mut failing: Vec<PathBuf> = Vec::new();
    loop {
        let retry = notifier.retry_at().map(tokio::time::Instant::into_std);
        let (files, notes, after) = {
            let mut w = shared.lock();
            w.busy = false;
            loop {
                if !w.is_empty() {
                    break;
                }
                shared.done.notify_all();
                match retry {
                    Some(at) => {
                        let left = at.saturating_duration_since(Instant::now());
                        if left.is_zero() {
                            break;
                        }
                        w = shared.posted.wait_timeout(w, left).unwrap_or_else(|p| p.into_inner()).0;
                    }
                    None => w = shared.posted.wait(w).unwrap_or_else(|p| p.into_inner()),
                }
            }
            w.busy = true;
            (std::mem::take(&mut w.files), std::mem::take(&mut w.notes), std::mem::take(&mut w.after))
        };
        for (path, bytes, mode) in files {
            match write_file(&path, &bytes, mode) {
                Ok(()) => failing.retain(|p| *p != path),
                Err(e) if !failing.contains(&path) => {
                    tracing::warn!(error = %e, file = %path.display(), "cannot write the status file");
                    failing.push(path);
                }
                Err(_) => {}
            }
        }
        if notes.is_empty() {
            notifier.retry();
        }
        for n in notes {
            notifier.notify(&n);
        }
        for job in after {
            // A job's panic is its own: the files and notes go on.
            let _ = std::panic::catch_unwind(std::panic::AssertUnwindSafe(job));
        }
    }
}

/// The loop's notifier once the outbox is started: every note goes behind
/// the files posted before it, but `WATCHDOG=1`, sent at once through a
/// notifier of its own when there is one.
pub struct Behind {
    outbox: &'static Outbox,
    watchdog: Option<Box<dyn Notifier>>,
}

impl Behind {
    /// The notes through `outbox`; `WATCHDOG=1` through `watchdog`.
    pub fn new(outbox: &'static Outbox, watchdog: Option<Box<dyn Notifier>>) -> Behind {
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
        let shared = Arc::new(Shared::default());
        let outbox: &'static Outbox = Box::leak(Box::new(Outbox { shared: shared.clone() }));
        let recorder = Recorder { file: file.clone(), sent: tx };
        std::thread::spawn(move || write_and_send(&shared, recorder));
        for state in ["launching", "starting", "ready"] {
            outbox.post_file(&file, state.as_bytes(), 0o644);
        }
        outbox.kick();
        let mut loop_side = Behind::new(outbox, None);
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
        let shared = Arc::new(Shared::default());
        let outbox: &'static Outbox = Box::leak(Box::new(Outbox { shared: shared.clone() }));
        let recorder = Recorder { file: file.clone(), sent: tx.clone() };
        std::thread::spawn(move || write_and_send(&shared, recorder));
        outbox.post_file(&file, b"ready", 0o644);
        Behind::new(outbox, None).notify(&[Note::Ready]);
        outbox.post_after(Box::new(move || tx.send((Vec::new(), "after".into())).unwrap()));
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
        let outbox: &'static Outbox = Box::leak(Box::new(Outbox { shared: Arc::default() }));
        let mut loop_side = Behind::new(outbox, Some(Box::new(watchdog)));
        loop_side.notify(&[Note::Watchdog]);
        assert_eq!(rx.try_recv().unwrap().0, vec![Note::Watchdog]);
        loop_side.notify(&[Note::Ready]);
        assert!(rx.try_recv().is_err());
        assert_eq!(outbox.shared.lock().notes, vec![vec![Note::Ready]]);
    }

    #[test]
    fn without_the_outbox_a_file_is_written_at_once_its_folder_made() {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("a").join("b.json");
        write_file(&file, b"x", 0o600).unwrap();
        assert_eq!(std::fs::read(&file).unwrap(), b"x");
    }
}
