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

use std::collections::BTreeMap;
use std::fs;
use std::io;
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};
use std::sync::{Arc, LazyLock};
use std::time::{Duration, Instant, SystemTime};

use regex::Regex;
use serde::{Deserialize, Serialize};

use crate::process::prestart::QueryError;
use crate::supervisor::ReportOrder;
use crate::supervisor::classify::Classifier;
use crate::supervisor::outcome::FailureClass;

mod later;
mod parts;
mod store;

pub(crate) use self::later::*;
pub(crate) use self::parts::*;
pub use self::store::*;

/// The folder of every report, in the state directory.
pub(crate) const FOLDER: &str = "reports";
/// The files of a report, and its one sub-folder.
pub(crate) const SUMMARY: &str = "summary.json";
pub(crate) const LOG_TAIL: &str = "log-tail.txt";
pub(crate) const TREE: &str = "tree.txt";
pub(crate) const GPU: &str = "gpu.txt";
pub(crate) const KERNEL: &str = "kernel.txt";
pub(crate) const PY_SPY: &str = "py-spy";
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
    pub(crate) instance: String,
    /// The start number (`start N` in the log marker).
    pub(crate) start: u32,
    pub(crate) attempt: u32,
    /// The run's child (its leader); none in a report of an older warden.
    #[serde(default)]
    pub(crate) pid: Option<u32>,
    pub cause: String,
    pub class: FailureClass,
    pub hint: Option<String>,
    pub(crate) timings: Timings,
    /// How the leader ended, when it had before the report.
    pub exit: Option<String>,
    pub(crate) warden_version: String,
    /// From the run's log (`… version 0.32.0`).
    pub vllm_version: Option<String>,
    /// sha256 of the config text the run was started with.
    pub(crate) config_sha256: String,
    /// The files `[[patch]]` changed, from the patches' manifest.
    pub(crate) patched_files: Vec<PatchedFile>,
    /// What each part of the report holds, or why it is missing.
    pub parts: BTreeMap<String, String>,
    /// False while the report is being written, and for one cut short.
    pub complete: bool,
}

/// RFC 3339 UTC instants of the run.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub(crate) struct Timings {
    pub(crate) spawn: String,
    pub(crate) first_progress: Option<String>,
    pub(crate) ready: Option<String>,
    pub(crate) failure: String,
    /// The report was begun, and finished.
    pub(crate) report_begun: String,
    pub(crate) report_done: Option<String>,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub(crate) struct PatchedFile {
    pub(crate) file: String,
    pub(crate) original_sha256: String,
    pub(crate) patched_sha256: String,
}

/// Everything one report needs, gathered on the loop (no I/O there).
#[derive(Debug, Clone)]
pub(crate) struct Job {
    /// The state directory: `reports/` is made in it.
    pub(crate) state_dir: PathBuf,
    /// The report's folder name (see [`folder_name`]).
    pub(crate) name: String,
    pub(crate) instance: String,
    pub(crate) order: ReportOrder,
    /// When the run was spawned, and when the report was asked for.
    pub(crate) spawned: SystemTime,
    pub(crate) begun: SystemTime,
    pub(crate) log_file: PathBuf,
    /// Where the run's lines begin in the log.
    pub(crate) log_offset: u64,
    pub(crate) settings: crate::config::Reports,
    pub(crate) config_sha256: String,
    /// Classifies the log's lines, for the traceback groups.
    pub(crate) classifier: Classifier,
    /// The warden's pid: the tree is its descendants.
    pub(crate) warden: i32,
    /// Set once nothing is left of the run (see
    /// [`crate::process::child::Tree::run_ended`]): from then on there is no tree
    /// to look for, and nothing waits for the report's file work, which
    /// yields to the next start.
    pub(crate) run_ended: Arc<std::sync::atomic::AtomicBool>,
    /// The run's log (the child's own descriptor) and where it ended, when
    /// already known: the log was read to its end after the exit. With the
    /// run ended too, nothing of it is left to take before a new one starts
    /// but its GPU snapshot.
    pub(crate) log_taken: Option<(Arc<fs::File>, u64)>,
    /// Where the run began among the kernel messages the warden follows,
    /// if it followed them from before its spawn: with the default
    /// `reports.kernel-messages`, `kernel.txt` is what the follower read
    /// since (no command runs), as long as it read on all along.
    pub(crate) kernel: Option<crate::observe::kernel::Mark>,
    /// Held from the report's start until its log is read: no rotation
    /// moves the run's lines meanwhile.
    pub(crate) log_hold: Option<crate::observe::rotate::Hold>,
}

/// `20261130T134105.123Z-kimi-3`: sorts by time.
pub(crate) fn folder_name(at: SystemTime, instance: &str, attempt: u32) -> String {
    let t = humantime::format_rfc3339_millis(at).to_string();
    let t: String = t.chars().filter(|c| *c != '-' && *c != ':').collect();
    format!("{t}-{instance}-{attempt}")
}

static NAME: LazyLock<Regex> =
    LazyLock::new(|| Regex::new(r"^(\d{8}T\d{6}\.\d{3}Z)-(.+)-(\d{1,10})$").expect("static regex"));

/// A folder name of ours for `instance`: its time and attempt.
pub(crate) fn parse_name<'a>(name: &'a str, instance: &str) -> Option<(&'a str, u32)> {
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
pub(crate) async fn write(job: Job, taken: impl FnOnce() + Send) -> io::Result<PathBuf> {
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

#[cfg(test)]
mod tests;
