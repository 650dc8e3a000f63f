//! Failure reports: for every failed run, a folder of plain files written
//! while its tree is still there, before it is stopped, into
//! `$STATE_DIRECTORY/reports/<UTC time>-<instance>-<attempt>/`:
//! `summary.json`, `log-tail.txt`, `tree.txt`, `py-spy/<pid>.txt`,
//! `gpu.txt`, `kernel.txt`; and their retention (`reports.keep`,
//! `reports.max-size`). Secrets are masked in every file. When a run fails
//! and what follows is not known here (see `supervisor`); nor is when a
//! report is begun or given up (see `daemon`).
//!
//! What is read is someone else's: the log, `/proc`, the commands' output
//! and the reports folder itself. Reads are bounded; only folders whose
//! names the warden makes are listed or removed, only the files the warden
//! writes are removed from them, and no symlink is followed.

use std::collections::{BTreeMap, HashMap, VecDeque};
use std::fmt::Write as _;
use std::fs;
use std::io::{self, Read, Seek};
use std::os::fd::AsRawFd;
use std::os::unix::fs::{DirBuilderExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Condvar, LazyLock, Mutex};
use std::time::{Duration, Instant, SystemTime};

use regex::Regex;
use serde::{Deserialize, Serialize};

use crate::process::child::ProcStat;
use crate::process::prestart::QueryError;
use crate::supervisor::ReportOrder;
use crate::supervisor::classify::Classifier;
use crate::supervisor::outcome::FailureClass;

/// The folder of every report, in the state directory.
pub const FOLDER: &str = "reports";
/// The files of a report, and its one sub-folder.
pub const SUMMARY: &str = "summary.json";
pub const LOG_TAIL: &str = "log-tail.txt";
pub const TREE: &str = "tree.txt";
pub const GPU: &str = "gpu.txt";
pub const KERNEL: &str = "kernel.txt";
pub const PY_SPY: &str = "py-spy";
const FILES: [&str; 5] = [SUMMARY, LOG_TAIL, TREE, GPU, KERNEL];

/// How much of a run's log is read at most: its last part, when longer.
const LOG_SCAN: u64 = 256 << 20;
/// Where the version line is looked for: the start of the run's log.
const VERSION_SCAN: u64 = 4 << 20;
/// A line of the log as kept in a report, at most.
const LINE_MAX: usize = 4096;
/// Traceback groups kept (the latest), and lines of each.
const GROUPS_MAX: usize = 16;
const GROUP_LINES: usize = 1000;
/// The most a command's output may add to a report.
const OUTPUT_MAX: u64 = 4 << 20;
/// The most a `/proc` file read for `tree.txt` may be.
const PROC_MAX: u64 = 64 << 10;

/// The report of a run, as `summary.json` holds it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Summary {
    pub instance: String,
    /// The start number (`start N` in the log marker).
    pub start: u32,
    pub attempt: u32,
    pub cause: String,
    pub class: FailureClass,
    pub hint: Option<String>,
    pub timings: Timings,
    /// How the leader ended, when it had before the report.
    pub exit: Option<String>,
    pub warden_version: String,
    /// From the run's log (`… version 0.32.0`).
    pub vllm_version: Option<String>,
    /// sha256 of the config text the run was started with.
    pub config_sha256: String,
    /// The files `[[patch]]` changed, from the patches' manifest.
    pub patched_files: Vec<PatchedFile>,
    /// What each part of the report holds, or why it is missing.
    pub parts: BTreeMap<String, String>,
    /// False while the report is being written, and for one cut short.
    pub complete: bool,
}

/// RFC 3339 UTC instants of the run.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Timings {
    pub spawn: String,
    pub first_progress: Option<String>,
    pub ready: Option<String>,
    pub failure: String,
    /// The report was begun, and finished.
    pub report_begun: String,
    pub report_done: Option<String>,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct PatchedFile {
    pub file: String,
    pub original_sha256: String,
    pub patched_sha256: String,
}

/// Everything one report needs, gathered on the loop (no I/O there).
#[derive(Debug, Clone)]
pub struct Job {
    /// The state directory: `reports/` is made in it.
    pub state_dir: PathBuf,
    /// The report's folder name (see [`folder_name`]).
    pub name: String,
    pub instance: String,
    pub order: ReportOrder,
    /// When the run was spawned, and when the report was asked for.
    pub spawned: SystemTime,
    pub begun: SystemTime,
    pub log_file: PathBuf,
    /// Where the run's lines begin in the log.
    pub log_offset: u64,
    pub settings: crate::config::Reports,
    pub config_sha256: String,
    /// Classifies the log's lines, for the traceback groups.
    pub classifier: Classifier,
    /// The warden's pid: the tree is its descendants.
    pub warden: i32,
    /// Set once nothing is left of the run (see
    /// [`crate::process::child::Tree::run_ended`]): from then on there is no tree
    /// to look for, and nothing waits for the report's file work, which
    /// yields to the next start.
    pub run_ended: Arc<std::sync::atomic::AtomicBool>,
    /// The run's log (the child's own descriptor) and where it ended, when
    /// already known: the log was read to its end after the exit. With the
    /// run ended too, nothing of it is left to take before a new one starts
    /// but its GPU snapshot.
    pub log_taken: Option<(Arc<fs::File>, u64)>,
    /// Where the run began among the kernel messages the warden follows,
    /// if it followed them from before its spawn: with the default
    /// `reports.kernel-messages`, `kernel.txt` is what the follower read
    /// since (no command runs), as long as it read on all along.
    pub kernel: Option<crate::observe::kernel::Mark>,
    /// Held from the report's start until its log is read: no rotation
    /// moves the run's lines meanwhile.
    pub log_hold: Option<crate::observe::rotate::Hold>,
}

/// `20261130T134105.123Z-kimi-3`: sorts by time.
pub fn folder_name(at: SystemTime, instance: &str, attempt: u32) -> String {
    let t = humantime::format_rfc3339_millis(at).to_string();
    let t: String = t.chars().filter(|c| *c != '-' && *c != ':').collect();
    format!("{t}-{instance}-{attempt}")
}

static NAME: LazyLock<Regex> =
    LazyLock::new(|| Regex::new(r"^(\d{8}T\d{6}\.\d{3}Z)-(.+)-(\d{1,10})$").expect("static regex"));

/// A folder name of ours for `instance`: its time and attempt.
pub fn parse_name<'a>(name: &'a str, instance: &str) -> Option<(&'a str, u32)> {
    let c = NAME.captures(name)?;
    if c.get(2)?.as_str() != instance {
        return None;
    }
    Some((c.get(1)?.as_str(), c.get(3)?.as_str().parse().ok()?))
}

fn rfc3339(t: SystemTime) -> String {
    humantime::format_rfc3339_millis(t).to_string()
}

fn masked(text: &str) -> String {
    crate::util::redact::text(text).into_owned()
}

/// sha256 of a text, in hex.
pub fn sha256_hex(bytes: &[u8]) -> String {
    use sha2::Digest;
    sha2::Sha256::digest(bytes).iter().map(|b| format!("{b:02x}")).collect()
}

/// Write a new file of the report (never over an existing one, never
/// through a symlink).
fn create(dir: &Path, name: &str, bytes: &[u8]) -> io::Result<()> {
    use std::io::Write;
    let mut f = fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o640)
        .custom_flags(libc::O_NOFOLLOW)
        .open(dir.join(name))?;
    f.write_all(bytes)
}

impl Job {
    /// Nothing of the run is left: no tree to look for, and its file work
    /// goes to [`LATER`].
    fn gone(&self) -> bool {
        self.run_ended.load(std::sync::atomic::Ordering::SeqCst)
    }
}

/// `summary.json`, replaced whole (written beside, then renamed).
fn write_summary(dir: &Path, s: &Summary) -> io::Result<()> {
    let mut text = serde_json::to_string_pretty(s).map_err(io::Error::other)?;
    text.push('\n');
    crate::util::fsutil::replace(&dir.join(SUMMARY), text.as_bytes(), 0o640)
}

/// Write the report of `job`. Each part is written as soon as it is known
/// (the tree first, while it is as it was), `summary.json` first with
/// `complete: false` and again at the end. The commands run in parallel,
/// bounded by `reports.timeout` in all; dropping the future kills them.
///
/// `taken` is called once what describes the run as it was has been taken:
/// its tree, where its log ends, its GPU snapshot and its Python stacks.
/// What follows (the log read up to that end, the kernel's messages, the
/// summary, retention) needs nothing of the run any more and may go on
/// beside a new one.
pub async fn write(job: Job, taken: impl FnOnce() + Send) -> io::Result<PathBuf> {
    let t0 = Instant::now();
    let budget = job.settings.timeout;
    let dir = job.state_dir.join(FOLDER).join(&job.name);
    let held = match &job.log_hold {
        Some(h) => Some(h.clone().lock_owned().await),
        None => None,
    };
    // What describes the run as it was, unless known already.
    let later = job.gone();
    let looked = if later && job.log_taken.is_some() {
        None
    } else {
        let first = job.clone();
        Some(blocking(move || look(&first)).await?)
    };
    let pythons = looked.as_ref().map(|l| l.pythons.clone()).unwrap_or_default();

    // The folder and the tree, then the log up to where it ended, beside
    // the commands; the first summary once it is read.
    let (made_tx, made) = tokio::sync::watch::channel(false);
    let (second, d) = (job.clone(), dir.clone());
    let logged = work(job.gone(), move || {
        let look = looked.unwrap_or_else(|| look(&second));
        let parts = make_folder(&second, &d, &look.tree)?;
        let _ = made_tx.send(true);
        let summary = log_parts(&second, &d, parts, look.log);
        drop(held);
        summary
    });

    // The commands, in parallel, within what is left of the budget.
    let left = budget.saturating_sub(t0.elapsed());
    let mut set = tokio::task::JoinSet::new();
    let mut notes = BTreeMap::new();
    let r = &job.settings;
    let alive = job.order.exit.is_none();
    if r.py_spy.is_empty() {
        notes.insert(PY_SPY.to_string(), "off (reports.py-spy = [])".to_string());
    } else if !alive {
        notes.insert(PY_SPY.into(), format!("skipped: the server had already exited ({})", exit_text(&job)));
    } else if pythons.is_empty() {
        notes.insert(PY_SPY.into(), "no Python process in the tree".into());
    } else {
        for &pid in &pythons {
            let argv: Vec<String> = r.py_spy.iter().map(|a| a.replace("{pid}", &pid.to_string())).collect();
            set.spawn(async move {
                (Part::PySpy(pid), crate::process::prestart::run_command(&argv, left, OUTPUT_MAX, true).await)
            });
        }
    }
    if r.gpu_snapshot.is_empty() {
        notes.insert(GPU.into(), "off (reports.gpu-snapshot = [])".into());
    } else {
        let argv = r.gpu_snapshot.clone();
        set.spawn(
            async move { (Part::Gpu, crate::process::prestart::run_command(&argv, left, OUTPUT_MAX, true).await) },
        );
    }
    // The default command asks the journal for what the follower has read.
    let followed = job
        .kernel
        .as_ref()
        .filter(|m| r.kernel_messages == crate::config::defaults::REPORTS_KERNEL_MESSAGES && m.since().is_some());
    if r.kernel_messages.is_empty() {
        notes.insert(KERNEL.into(), "off (reports.kernel-messages = [])".into());
    } else if followed.is_none() {
        set.spawn(kernel_command(&job, left));
    }
    // Only the kernel's messages are waited for: the run is taken.
    let mut taken = Some(taken);
    let mut waiting = set.len() - usize::from(!r.kernel_messages.is_empty() && followed.is_none());
    if waiting == 0
        && let Some(t) = taken.take()
    {
        t();
    }
    // Each output is written as soon as it is known, once the folder is
    // made, by a task of its own: taking the run (which the next start may
    // wait for) never waits for the report's file work, and what was
    // written stays written if the report is cut short.
    let mut writing = Vec::new();
    loop {
        let joined = set.join_next().await;
        let last = joined.is_none();
        if let Some(Ok((part, result))) = joined {
            if part != Part::Kernel {
                waiting -= 1;
            }
            let (job, dir, mut made) = (job.clone(), dir.clone(), made.clone());
            writing.push(tokio::spawn(async move {
                // No folder: the report fails below.
                made.wait_for(|m| *m).await.ok()?;
                Some((part, output(&job, &dir, part, result).await))
            }));
        }
        if (waiting == 0 || last)
            && let Some(t) = taken.take()
        {
            t();
        }
        if last {
            break;
        }
    }
    let mut dumps = 0;
    for written in writing {
        let Ok(Some((part, note))) = written.await else { continue };
        let note = note?;
        if matches!(part, Part::PySpy(_)) && note.1.starts_with("written") {
            dumps += 1;
        }
        notes.insert(note.0, note.1);
    }
    if !pythons.is_empty() && alive && !r.py_spy.is_empty() && !notes.contains_key(PY_SPY) {
        notes.insert(PY_SPY.into(), format!("{dumps} of {} Python process(es) dumped", pythons.len()));
    }
    if let Some(mark) = followed
        && made.clone().wait_for(|m| *m).await.is_ok()
    {
        // Taken last, so that messages on their way are in.
        let note = match mark.since() {
            Some(since) => {
                let d = dir.clone();
                work(job.gone(), move || write_kernel(&d, &since)).await?
            }
            // The follower stopped reading meanwhile: the command after all.
            None => {
                let (part, result) = kernel_command(&job, budget.saturating_sub(t0.elapsed())).await;
                output(&job, &dir, part, result).await?.1
            }
        };
        notes.insert(KERNEL.into(), note);
    }

    let mut summary = logged.await??;
    summary.parts.extend(notes);
    summary.complete = true;
    summary.timings.report_done = Some(rfc3339(SystemTime::now()));
    let (d, s) = (dir.clone(), summary);
    work(job.gone(), move || write_summary(&d, &s)).await??;
    let (root, instance, keep, max) =
        (job.state_dir.join(FOLDER), job.instance.clone(), job.settings.keep, job.settings.max_size);
    let name = job.name.clone();
    work(job.gone(), move || retain(&root, &instance, keep, max, &name)).await?;
    Ok(dir)
}

/// `reports.kernel-messages`, `{since}` the run's spawn.
fn kernel_command(
    job: &Job,
    left: Duration,
) -> impl Future<Output = (Part, Result<Option<String>, QueryError>)> + use<> {
    let since = job.spawned.duration_since(SystemTime::UNIX_EPOCH).map(|d| d.as_secs()).unwrap_or(0);
    let argv: Vec<String> =
        job.settings.kernel_messages.iter().map(|a| a.replace("{since}", &since.to_string())).collect();
    async move { (Part::Kernel, crate::process::prestart::run_command(&argv, left, OUTPUT_MAX, false).await) }
}

/// A command's output into its file: the summary's key and note.
async fn output(
    job: &Job,
    dir: &Path,
    part: Part,
    result: Result<Option<String>, QueryError>,
) -> io::Result<(String, String)> {
    let r = &job.settings;
    let argv = match part {
        Part::PySpy(_) => &r.py_spy,
        Part::Gpu => &r.gpu_snapshot,
        Part::Kernel => &r.kernel_messages,
    };
    let program = argv.first().cloned().unwrap_or_default();
    let (dir, py_spy_dir) = (dir.to_path_buf(), dir.join(PY_SPY));
    work(job.gone(), move || write_output(&dir, &py_spy_dir, part, &program, result)).await
}

fn exit_text(job: &Job) -> String {
    job.order.exit.map(|e| e.to_string()).unwrap_or_default()
}

async fn blocking<T: Send + 'static>(f: impl FnOnce() -> T + Send + 'static) -> io::Result<T> {
    tokio::task::spawn_blocking(f).await.map_err(io::Error::other)
}

/// File work of a report, handed over now: to [`LATER`] when `later`, else
/// to the blocking pool. Its result when it is done.
fn work<T: Send + 'static>(later: bool, f: impl FnOnce() -> T + Send + 'static) -> impl Future<Output = io::Result<T>> {
    let (tx, rx) = tokio::sync::oneshot::channel();
    let job: Work = Box::new(move || {
        let _ = tx.send(f());
    });
    let job = match LATER.as_ref().filter(|_| later) {
        Some(worker) => worker.send(job).err().map(|e| e.0),
        None => Some(job),
    };
    if let Some(job) = job {
        drop(tokio::task::spawn_blocking(job));
    }
    async move { rx.await.map_err(|_| io::Error::other("the report's file work panicked")) }
}

type Work = Box<dyn FnOnce() + Send>;

/// The nice value of [`LATER`]'s thread.
const LATER_NICE: i32 = 10;

/// The file work of the reports of runs with nothing left (the log read,
/// the files, retention): one thread, at a lower CPU priority, one job at a
/// time, in order. It yields to the start that goes on beside it; a report
/// the machine waits for (a run still there) uses the blocking pool.
static LATER: LazyLock<Option<std::sync::mpsc::Sender<Work>>> = LazyLock::new(|| {
    let (tx, rx) = std::sync::mpsc::channel::<Work>();
    let spawned = std::thread::Builder::new().name("failure reports".into()).spawn(move || {
        // SAFETY: setpriority on this thread (who = its tid) takes no pointer.
        unsafe {
            libc::setpriority(libc::PRIO_PROCESS, nix::unistd::gettid().as_raw() as libc::id_t, LATER_NICE);
        }
        for job in rx {
            wait_for_start();
            // A panic is the job's: its result is never sent; the thread goes on.
            let _ = std::panic::catch_unwind(std::panic::AssertUnwindSafe(job));
        }
    });
    spawned.ok().map(|_| tx)
});

/// How long at the most [`LATER`] waits for a start under way.
const START_YIELD: Duration = Duration::from_secs(1);

/// Since when a start is under way: see [`start_under_way`].
static STARTING: (Mutex<Option<Instant>>, Condvar) = (Mutex::new(None), Condvar::new());

/// A start is under way (`true`: its quick pre-start steps and its spawn),
/// or no longer (`false`: spawned, failed, cancelled, or waiting for the
/// port, the GPUs, leftovers or the Ray cluster). Meanwhile, and for
/// [`START_YIELD`] at the most, the file work of the reports of runs that
/// are gone waits: it would take the CPU from the start, which nothing of
/// the report is needed for any more.
pub fn start_under_way(on: bool) {
    let (since, changed) = &STARTING;
    let mut since = since.lock().unwrap_or_else(|p| p.into_inner());
    *since = on.then(Instant::now);
    changed.notify_all();
}

/// Says, when dropped, that the start is no longer under way.
pub struct StartOver;

impl Drop for StartOver {
    fn drop(&mut self) {
        start_under_way(false);
    }
}

/// Wait while a start is under way, up to [`START_YIELD`] after it began.
fn wait_for_start() {
    let (since, changed) = &STARTING;
    let mut guard = since.lock().unwrap_or_else(|p| p.into_inner());
    while let Some(left) = guard.and_then(|t| START_YIELD.checked_sub(t.elapsed())) {
        guard = changed.wait_timeout(guard, left).unwrap_or_else(|p| p.into_inner()).0;
    }
}

/// Wait, up to `within`, for the file work handed over so far to be done.
pub async fn settle(within: Duration) {
    let _ = tokio::time::timeout(within, work(true, || ())).await;
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Part {
    PySpy(i32),
    Gpu,
    Kernel,
}

/// One command's output into its file; the summary's note on it.
fn write_output(
    dir: &Path,
    py_spy_dir: &Path,
    part: Part,
    program: &str,
    result: Result<Option<String>, QueryError>,
) -> (String, String) {
    let (key, folder, file) = match part {
        Part::PySpy(pid) => (format!("{PY_SPY}/{pid}.txt"), py_spy_dir, format!("{pid}.txt")),
        Part::Gpu => (GPU.to_string(), dir, GPU.to_string()),
        Part::Kernel => (KERNEL.to_string(), dir, KERNEL.to_string()),
    };
    let (text, note) = match result {
        Ok(None) => {
            // A missing program: one line saying so (and no py-spy folder).
            if matches!(part, Part::PySpy(_)) {
                return (PY_SPY.to_string(), format!("{program} not found on PATH"));
            }
            (format!("{program} not found on PATH\n"), format!("{program} not found"))
        }
        Ok(Some(out)) => match part {
            Part::Kernel => {
                let faults: Vec<String> =
                    out.lines().filter(|l| crate::observe::kernel::gpu_related(l)).map(String::from).collect();
                let since = crate::observe::kernel::Since { gpu: faults, all: out.lines().count() as u64, cut: false };
                kernel_text(&since)
            }
            _ => (masked(&out), format!("written ({} bytes)", out.len())),
        },
        Err(QueryError::TimedOut(why)) | Err(QueryError::Failed(why)) => (format!("{why}\n"), why),
    };
    if folder != dir
        && let Err(e) = fs::DirBuilder::new().mode(0o750).create(folder)
        && e.kind() != io::ErrorKind::AlreadyExists
    {
        return (key, format!("cannot create {}: {e}", folder.display()));
    }
    match create(folder, &file, text.as_bytes()) {
        Ok(()) => (key, note),
        Err(e) => (key, format!("cannot write: {e}")),
    }
}

/// `kernel.txt` and its note.
fn kernel_text(since: &crate::observe::kernel::Since) -> (String, String) {
    let (n, all) = (since.gpu.len(), since.all);
    let mut text = format!("# kernel messages since the run's spawn that concern the GPUs: {n} of {all}\n");
    if since.cut {
        text.push_str("# (the oldest of them were not kept)\n");
    }
    for l in &since.gpu {
        text.push_str(&masked(l));
        text.push('\n');
    }
    (text, format!("written: {n} of {all} kernel message(s) concern the GPUs"))
}

/// `kernel.txt` from what the warden's follower read; the note.
fn write_kernel(dir: &Path, since: &crate::observe::kernel::Since) -> String {
    let (text, note) = kernel_text(since);
    match create(dir, KERNEL, text.as_bytes()) {
        Ok(()) => note,
        Err(e) => format!("cannot write: {e}"),
    }
}

/// The run's log, opened when it was taken, and where it ended then.
type Log = io::Result<(fs::File, u64)>;

/// What describes the run as it was, taken before anything is written.
struct Look {
    /// `tree.txt`, and how many processes it names, how many Python.
    tree: (String, usize, usize),
    /// The tree's Python processes.
    pythons: Vec<i32>,
    log: Log,
}

/// The tree, described; the log opened, and where it ends.
fn look(job: &Job) -> Look {
    let tree = if job.gone() { Vec::new() } else { crate::process::child::descendants(job.warden) };
    let pythons: Vec<i32> = tree.iter().filter(|p| is_python(p.pid)).map(|p| p.pid).collect();
    let text = describe_tree(&tree);
    let log = match &job.log_taken {
        // A file of its own on the same inode: the child's descriptor
        // shares its offset.
        Some((f, end)) => fs::File::open(format!("/proc/self/fd/{}", f.as_raw_fd())).map(|f| (f, *end)),
        None => fs::File::open(&job.log_file).and_then(|f| {
            let end = f.metadata()?.len();
            Ok((f, end))
        }),
    };
    Look { tree: (text, tree.len(), pythons.len()), pythons, log }
}

/// The report's folder and `tree.txt`: the parts so far, and their notes.
fn make_folder(job: &Job, dir: &Path, tree: &(String, usize, usize)) -> io::Result<BTreeMap<String, String>> {
    let root = job.state_dir.join(FOLDER);
    fs::DirBuilder::new().recursive(true).mode(0o750).create(&root)?;
    // The folder of every report is made here, never found: a name taken
    // (a report of the same millisecond) is an error, not a reuse.
    fs::DirBuilder::new().mode(0o750).create(dir)?;
    let (text, n, pythons) = tree;
    let note = match create(dir, TREE, text.as_bytes()) {
        Ok(()) => format!("written: {n} process(es), {pythons} of them Python"),
        Err(e) => format!("cannot write: {e}"),
    };
    Ok(BTreeMap::from([(TREE.to_string(), note)]))
}

/// `log-tail.txt`, from the log as it was taken, and the first
/// `summary.json`: the summary.
fn log_parts(job: &Job, dir: &Path, mut parts: BTreeMap<String, String>, log: Log) -> io::Result<Summary> {
    let tail = log.and_then(|(f, end)| {
        let version = vllm_version(&f, job.log_offset, end);
        let tail =
            log_tail(&f, &job.log_file, job.log_offset, end, job.settings.lines as usize, job.classifier.clone());
        tail.map(|t| (t, version))
    });
    let (note, version) = match tail {
        Ok((tail, version)) => {
            let n = format!("written: {} line(s), {} traceback group(s)", tail.lines, tail.groups);
            let note = match create(dir, LOG_TAIL, tail.text.as_bytes()) {
                Ok(()) => n,
                Err(e) => format!("cannot write: {e}"),
            };
            (note, version)
        }
        Err(e) => {
            let why = format!("cannot read {}: {e}", job.log_file.display());
            let _ = create(dir, LOG_TAIL, format!("{why}\n").as_bytes());
            (why, None)
        }
    };
    parts.insert(LOG_TAIL.to_string(), note);

    let o = &job.order;
    let at = |d: Duration| rfc3339(job.spawned + d);
    let summary = Summary {
        instance: job.instance.clone(),
        start: o.start,
        attempt: o.attempt,
        cause: masked(&o.cause),
        class: o.class,
        hint: o.hint.as_deref().map(masked),
        timings: Timings {
            spawn: rfc3339(job.spawned),
            first_progress: o.first_progress.map(at),
            ready: o.ready.map(at),
            failure: at(o.failed),
            report_begun: rfc3339(job.begun),
            report_done: None,
        },
        exit: o.exit.map(|e| e.to_string()),
        warden_version: env!("CARGO_PKG_VERSION").to_string(),
        vllm_version: version,
        config_sha256: job.config_sha256.clone(),
        patched_files: patched_files(&job.state_dir),
        parts,
        complete: false,
    };
    write_summary(dir, &summary)?;
    Ok(summary)
}

/// The files the patches changed, as their manifest records them.
fn patched_files(state_dir: &Path) -> Vec<PatchedFile> {
    let Ok(Some(manifest)) = crate::patch::manifest(state_dir) else { return Vec::new() };
    manifest
        .files
        .into_iter()
        .map(|(file, e)| PatchedFile {
            file: masked(&file.display().to_string()),
            original_sha256: e.original_sha256,
            patched_sha256: e.patched_sha256,
        })
        .collect()
}

/// Whether a process runs a Python interpreter (its executable's name;
/// vLLM renames its processes' titles, not their executables).
fn is_python(pid: i32) -> bool {
    fs::read_link(format!("/proc/{pid}/exe"))
        .ok()
        .and_then(|p| p.file_name().map(|n| n.to_string_lossy().starts_with("python")))
        .unwrap_or(false)
}

fn read_proc(pid: i32, what: &str) -> String {
    fs::File::open(format!("/proc/{pid}/{what}"))
        .and_then(|f| {
            let mut out = Vec::new();
            f.take(PROC_MAX).read_to_end(&mut out)?;
            Ok(out)
        })
        .map(|b| String::from_utf8_lossy(&b).into_owned())
        .unwrap_or_default()
}

fn field<'a>(status: &'a str, name: &str) -> Option<&'a str> {
    status.lines().find_map(|l| l.strip_prefix(name).and_then(|r| r.strip_prefix(':'))).map(str::trim)
}

/// Boot time (seconds since the epoch) and clock ticks a second, for the
/// start times in `/proc/PID/stat`.
fn clock() -> Option<(u64, u64)> {
    let stat = fs::read_to_string("/proc/stat").ok()?;
    let btime = stat.lines().find_map(|l| l.strip_prefix("btime "))?.trim().parse().ok()?;
    let tck = nix::unistd::sysconf(nix::unistd::SysconfVar::CLK_TCK).ok()??;
    Some((btime, u64::try_from(tck).ok().filter(|t| *t > 0)?))
}

/// `tree.txt`: one process a line, parents first.
pub fn describe_tree(tree: &[ProcStat]) -> String {
    let clock = clock();
    let mut out = format!(
        "# the server's process tree when the run failed: {} process(es)\n{:<8} {:<8} {:<16} {:<24} {:<24} {:>10}  {}\n",
        tree.len(),
        "PID",
        "PPID",
        "STATE",
        "WCHAN",
        "STARTED",
        "RSS",
        "COMMAND"
    );
    for p in tree {
        let status = read_proc(p.pid, "status");
        let state = field(&status, "State").map(String::from).unwrap_or_else(|| p.state.to_string());
        let rss = field(&status, "VmRSS").unwrap_or("-").to_string();
        let wchan = match read_proc(p.pid, "wchan").trim() {
            "" | "0" => "-".to_string(),
            w => w.to_string(),
        };
        let started = clock
            .map(|(btime, tck)| {
                let t = SystemTime::UNIX_EPOCH
                    + Duration::from_secs(btime)
                    + Duration::from_millis(p.start_time * 1000 / tck);
                humantime::format_rfc3339_seconds(t).to_string()
            })
            .unwrap_or_else(|| format!("{} ticks", p.start_time));
        let raw = read_proc(p.pid, "cmdline");
        let argv: Vec<String> = raw.split('\0').filter(|a| !a.is_empty()).map(String::from).collect();
        let command = if argv.is_empty() {
            format!("[{}]", read_proc(p.pid, "comm").trim())
        } else {
            crate::util::redact::command(&argv)
        };
        let one = |s: &str, n| crate::util::escape::one_line(s, n);
        let _ = writeln!(
            out,
            "{:<8} {:<8} {:<16} {:<24} {:<24} {:>10}  {}",
            p.pid,
            p.ppid,
            one(&state, 16),
            one(&wchan, 64),
            started,
            one(&rss, 16),
            one(&command, 4096)
        );
    }
    out
}

/// vLLM's version, from its banner near the start of the run's log
/// (`… api_utils.py:347]  ▄▄ ▄█ █ … version 0.32.0`, or, from older
/// versions, `vLLM API server version 0.6.3`).
fn vllm_version(mut f: &fs::File, offset: u64, end: u64) -> Option<String> {
    static VERSION: LazyLock<Regex> = LazyLock::new(|| {
        Regex::new(r"(?:vLLM API server version|█\s+version|vLLM version)\s+v?(\d+\.\d+[0-9A-Za-z.+_-]*)")
            .expect("static regex")
    });
    f.seek(io::SeekFrom::Start(offset)).ok()?;
    let mut buf = Vec::new();
    f.take(VERSION_SCAN.min(end.saturating_sub(offset))).read_to_end(&mut buf).ok()?;
    let text = String::from_utf8_lossy(&buf);
    let v = VERSION.captures(&text)?.get(1)?.as_str();
    Some(crate::util::escape::one_line(v, 64))
}

/// What `log-tail.txt` holds.
struct Tail {
    text: String,
    lines: usize,
    groups: usize,
}

/// The last `keep` lines of the run's log `f` (at `log`) from `offset` to
/// `len`, and the traceback groups seen in it in full, masked. At most the
/// last [`LOG_SCAN`] bytes are read, in pieces: never the whole file at once.
fn log_tail(
    mut f: &fs::File,
    log: &Path,
    offset: u64,
    len: u64,
    keep: usize,
    mut classifier: Classifier,
) -> io::Result<Tail> {
    let mut notes = Vec::new();
    let from = if len < offset {
        notes.push(format!("the log is shorter than where the run began (offset {offset}): read from its start"));
        0
    } else if len - offset > LOG_SCAN {
        notes.push(format!("the run's log holds {} MiB: its last {} MiB read", (len - offset) >> 20, LOG_SCAN >> 20));
        len - LOG_SCAN
    } else {
        offset
    };
    f.seek(io::SeekFrom::Start(from))?;
    let mut reader = io::BufReader::new((&mut f).take(len - from));
    if from != offset && from != 0 {
        // A cut read begins inside a line: skip to the next one.
        let mut piece = Vec::new();
        io::BufRead::read_until(
            &mut (&mut reader).take(crate::supervisor::classify::MAX_LINE as u64),
            b'\n',
            &mut piece,
        )?;
    }
    classifier.reset();
    let mut splitter = crate::supervisor::classify::Splitter::default();
    let mut tail: VecDeque<String> = VecDeque::with_capacity(keep.min(1 << 16));
    let mut tb = Tracebacks::default();
    let mut total = 0usize;
    let mut buf = vec![0u8; 64 * 1024];
    loop {
        let n = reader.read(&mut buf)?;
        if n == 0 {
            break;
        }
        splitter.feed(&buf[..n], |line| {
            total += 1;
            let line = cut(line);
            tb.line(&line, &mut classifier);
            if keep > 0 {
                if tail.len() == keep {
                    tail.pop_front();
                }
                tail.push_back(line);
            }
        });
    }
    let groups = tb.groups.len();
    let mut text = format!(
        "# the last {} of {total} line(s) of the run's log {}, then its {groups} traceback group(s) in full\n",
        tail.len(),
        log.display()
    );
    for n in notes {
        let _ = writeln!(text, "# {n}");
    }
    for l in &tail {
        text.push_str(&masked(l));
        text.push('\n');
    }
    for (i, (_, lines)) in tb.groups.iter().enumerate() {
        let _ = writeln!(text, "\n# traceback group {} of {groups}", i + 1);
        for l in lines {
            text.push_str(&masked(l));
            text.push('\n');
        }
    }
    Ok(Tail { text, lines: tail.len(), groups })
}

/// A line as kept: at most [`LINE_MAX`] bytes.
fn cut(line: &str) -> String {
    if line.len() <= LINE_MAX {
        return line.to_string();
    }
    let mut end = LINE_MAX;
    while !line.is_char_boundary(end) {
        end -= 1;
    }
    format!("{}…", &line[..end])
}

/// The traceback groups of a log, as the classifier tells them: the lines
/// of each process from `Traceback (most recent call last):` to the
/// exception line, chained tracebacks in one group. Bounded: the latest
/// [`GROUPS_MAX`] groups, [`GROUP_LINES`] lines each.
#[derive(Default)]
struct Tracebacks {
    /// Per process: the lines of a traceback not yet ended.
    open: HashMap<String, Vec<String>>,
    /// Per process: the group of its last exception (a chain marker joins it).
    last: HashMap<String, u64>,
    groups: BTreeMap<u64, Vec<String>>,
}

impl Tracebacks {
    fn line(&mut self, line: &str, c: &mut Classifier) {
        let (process, message) = crate::supervisor::classify::process_and_message(line);
        let exception = c.classify_ref(line).line.and_then(|l| l.exception);
        if message.starts_with("Traceback (most recent call last)") {
            if self.open.len() >= crate::supervisor::classify::TRACEBACK_PROCESSES {
                self.open.clear();
            }
            self.open.insert(process.to_string(), Vec::new());
        }
        if let Some(lines) = self.open.get_mut(process) {
            if lines.len() < GROUP_LINES {
                lines.push(line.to_string());
            }
        } else if (message.starts_with("During handling of the above exception")
            || message.starts_with("The above exception was the direct cause"))
            && let Some(g) = self.last.get(process)
            && let Some(lines) = self.groups.get_mut(g)
            && lines.len() < GROUP_LINES
        {
            lines.push(line.to_string());
        }
        if let Some(exc) = exception {
            let lines = self.open.remove(process).unwrap_or_else(|| vec![line.to_string()]);
            let group = self.groups.entry(exc.group).or_default();
            let room = GROUP_LINES.saturating_sub(group.len());
            group.extend(lines.into_iter().take(room));
            if self.last.len() >= crate::supervisor::classify::TRACEBACK_PROCESSES {
                self.last.clear();
            }
            self.last.insert(process.to_string(), exc.group);
            while self.groups.len() > GROUPS_MAX {
                self.groups.pop_first();
            }
        }
    }
}

/// One report on disk, as `reports` lists it.
#[derive(Debug, Clone)]
pub struct Listed {
    pub name: String,
    pub path: PathBuf,
    pub attempt: u32,
    /// Bytes of its files.
    pub size: u64,
    /// Its summary, when it can be read.
    pub summary: Option<Summary>,
}

/// The reports of `instance` in `state_dir`, oldest first: only folders
/// whose names are ours, not symlinks.
pub fn list(state_dir: &Path, instance: &str) -> io::Result<Vec<Listed>> {
    list_with(state_dir, instance, true)
}

/// [`list`], the summaries read or not.
fn list_with(state_dir: &Path, instance: &str, summaries: bool) -> io::Result<Vec<Listed>> {
    let root = state_dir.join(FOLDER);
    let entries = match fs::read_dir(&root) {
        Ok(e) => e,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(Vec::new()),
        Err(e) => return Err(e),
    };
    let mut out = Vec::new();
    for entry in entries.flatten() {
        let Some(name) = entry.file_name().to_str().map(String::from) else { continue };
        let Some((_, attempt)) = parse_name(&name, instance) else { continue };
        // `file_type` does not follow a symlink.
        if !entry.file_type().is_ok_and(|t| t.is_dir()) {
            continue;
        }
        let path = entry.path();
        let size = size_of(&path);
        let summary = if summaries { read_summary(&path) } else { None };
        out.push(Listed { name, path, attempt, size, summary });
    }
    out.sort_by(|a, b| a.name.cmp(&b.name));
    Ok(out)
}

/// `1.5 KiB`, `12.0 MiB`.
fn size_text(n: u64) -> String {
    match n {
        n if n >= 1 << 20 => format!("{:.1} MiB", n as f64 / f64::from(1u32 << 20)),
        n if n >= 1 << 10 => format!("{:.1} KiB", n as f64 / 1024.0),
        n => format!("{n} B"),
    }
}

/// What is read from a report, made one visible line.
fn shown(text: &str) -> String {
    crate::util::escape::one_line(&masked(text), crate::util::escape::MAX_LINE)
}

/// `reports list`: one report a line, oldest first; the time is the start
/// of the folder's name, which `show` and `path` take.
pub fn table(all: &[Listed]) -> String {
    let mut out = format!("{:<20}  {:>7}  {:<10}  {:>10}  {}\n", "TIME", "ATTEMPT", "CLASS", "SIZE", "CAUSE");
    for r in all {
        let time = r.name.split('-').next().unwrap_or_default();
        let (class, cause) = match &r.summary {
            Some(s) => (s.class_name(), shown(&s.cause)),
            None => ("?".to_string(), "(no readable summary.json)".to_string()),
        };
        let _ = writeln!(out, "{time:<20}  {:>7}  {class:<10}  {:>10}  {cause}", r.attempt, size_text(r.size));
    }
    out
}

/// `reports show`: one report, readable.
pub fn show(r: &Listed) -> String {
    let mut out = format!("report {} ({})\n", r.name, r.path.display());
    let Some(s) = &r.summary else {
        out.push_str("no readable summary.json\n");
        return out;
    };
    let t = &s.timings;
    let _ = writeln!(out, "instance {}, start {}, attempt {}", shown(&s.instance), s.start, s.attempt);
    let _ = writeln!(out, "cause: {}", shown(&s.cause));
    let _ = writeln!(out, "class: {}", s.class_name());
    if let Some(h) = &s.hint {
        let _ = writeln!(out, "hint: {}", shown(h));
    }
    let _ = writeln!(out, "spawned:        {}", shown(&t.spawn));
    let _ = writeln!(out, "first progress: {}", t.first_progress.as_deref().map_or("-".into(), shown));
    let _ = writeln!(out, "ready:          {}", t.ready.as_deref().map_or("-".into(), shown));
    let _ = writeln!(out, "failed:         {}", shown(&t.failure));
    let _ = writeln!(
        out,
        "report:         {} to {}",
        shown(&t.report_begun),
        t.report_done.as_deref().map_or("(not finished: cut short)".into(), shown)
    );
    let _ = writeln!(out, "exit: {}", s.exit.as_deref().map_or("- (still running when it failed)".into(), shown));
    let vllm = s.vllm_version.as_deref().map_or("unknown".into(), shown);
    let _ = writeln!(out, "vllm-warden {}, vLLM {vllm}", shown(&s.warden_version));
    let _ = writeln!(out, "config sha256: {}", shown(&s.config_sha256));
    for p in &s.patched_files {
        let _ = writeln!(
            out,
            "patched: {} (sha256 {} → {})",
            shown(&p.file),
            shown(&p.original_sha256),
            shown(&p.patched_sha256)
        );
    }
    out.push_str("parts:\n");
    for (k, v) in &s.parts {
        let _ = writeln!(out, "  {}: {}", shown(k), shown(v));
    }
    let _ = writeln!(out, "size: {}{}", size_text(r.size), if s.complete { "" } else { " (incomplete: cut short)" });
    out
}

impl Summary {
    fn class_name(&self) -> String {
        self.class.as_str().to_string()
    }
}

/// Bytes of a report's regular files (its own and `py-spy/`'s), no link followed.
pub fn size_of(dir: &Path) -> u64 {
    let mut total = 0;
    for sub in [dir.to_path_buf(), dir.join(PY_SPY)] {
        if !fs::symlink_metadata(&sub).is_ok_and(|m| m.is_dir()) {
            continue;
        }
        let Ok(entries) = fs::read_dir(&sub) else { continue };
        for e in entries.flatten() {
            if let Ok(m) = fs::symlink_metadata(e.path())
                && m.is_file()
            {
                total += m.len();
            }
        }
    }
    total
}

/// A report's `summary.json`, bounded, not through a symlink.
pub fn read_summary(dir: &Path) -> Option<Summary> {
    let f = fs::OpenOptions::new().read(true).custom_flags(libc::O_NOFOLLOW).open(dir.join(SUMMARY)).ok()?;
    let mut text = Vec::new();
    f.take(1 << 20).read_to_end(&mut text).ok()?;
    serde_json::from_slice(&text).ok()
}

/// Remove one report: the files the warden writes, then the folders, if
/// they are then empty. Anything else put there is left, and so is the
/// folder holding it.
fn remove(dir: &Path) -> io::Result<()> {
    let gone = |r: io::Result<()>| match r {
        Err(e) if e.kind() != io::ErrorKind::NotFound => Err(e),
        _ => Ok(()),
    };
    let py = dir.join(PY_SPY);
    if fs::symlink_metadata(&py).is_ok_and(|m| m.is_dir()) {
        for e in fs::read_dir(&py)?.flatten() {
            let name = e.file_name();
            let ours = name
                .to_str()
                .and_then(|n| n.strip_suffix(".txt"))
                .is_some_and(|n| !n.is_empty() && n.bytes().all(|b| b.is_ascii_digit()));
            if ours && e.file_type().is_ok_and(|t| t.is_file()) {
                gone(fs::remove_file(e.path()))?;
            }
        }
        // Left, with what is not ours in it.
        let _ = fs::remove_dir(&py);
    }
    for f in FILES {
        let p = dir.join(f);
        if fs::symlink_metadata(&p).is_ok_and(|m| m.is_file()) {
            gone(fs::remove_file(&p))?;
        }
    }
    gone(fs::remove_dir(dir))
}

/// Keep the newest `keep` reports of `instance`, and within `max` bytes in
/// all, removing the oldest first; the report just written (`current`) is
/// always kept, and so is any newer one (a later run's, being written
/// beside it: its own retention follows).
pub fn retain(root: &Path, instance: &str, keep: u32, max: u64, current: &str) {
    let Some(state) = root.parent() else { return };
    let Ok(all) = list_with(state, instance, false) else { return };
    let mut total: u64 = all.iter().map(|r| r.size).sum();
    let mut count = all.len();
    for r in &all {
        if r.name.as_str() >= current || (count <= keep as usize && total <= max) {
            continue;
        }
        match remove(&r.path) {
            Ok(()) => tracing::info!(EVENT = "report", "removed the old failure report {}", r.path.display()),
            Err(e) => tracing::warn!(error = %e, "cannot remove the old failure report {}", r.path.display()),
        }
        count -= 1;
        total = total.saturating_sub(r.size);
    }
}

#[cfg(test)]
mod tests;
