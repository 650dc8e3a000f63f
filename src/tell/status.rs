//! The status document (`status.file`): what it contains, and how it and
//! the Prometheus textfile (`status.metrics-file`, made by
//! [`crate::tell::metrics`]) are written (whole and atomically, only when
//! something changed, a change of the progress line alone at most every
//! [`PROGRESS_EVERY`]). How `status` reads them back is
//! [`crate::tell::summary`]'s. How the state changes is not known here: the
//! supervisor hands over a [`Snapshot`].

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, SystemTime};

use serde::{Deserialize, Serialize};

use std::collections::BTreeMap;

use crate::supervisor::outcome::Exit;
use crate::supervisor::outcome::Phase;
pub(crate) use crate::supervisor::snapshot::{LastFailure, Snapshot};
use crate::tell::metrics::Metrics;
use crate::tell::outbox::Outbox;

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub(crate) struct LastExit {
    pub(crate) code: Option<i32>,
    pub(crate) signal: Option<String>,
    pub(crate) at: String,
}

/// The status document, as written to `status.file`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub(crate) struct Doc {
    pub(crate) name: String,
    pub(crate) version: String,
    pub(crate) warden_pid: u32,
    pub(crate) state: Phase,
    pub(crate) child_pid: Option<u32>,
    pub(crate) attempt: u32,
    pub(crate) restarts: u32,
    /// When the current state began.
    pub(crate) since: String,
    pub(crate) ready_since: Option<String>,
    pub(crate) progress: Option<String>,
    pub(crate) last_exit: Option<LastExit>,
    pub(crate) cause: Option<String>,
    /// What to do about the cause, when it is a known one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub(crate) hint: Option<String>,
    /// Set when the warden has exited.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub(crate) exit_code: Option<i32>,
    /// The last failed run and its failure report.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub(crate) last_failure: Option<LastFailure>,
    /// Where the child's caches go, and their size.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub(crate) cache: Option<Cache>,
    /// The load under way: its phase and the estimate.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub(crate) load: Option<LoadDoc>,
    /// The last load that ended, as the ledger has it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub(crate) last_load: Option<LastLoad>,
    /// The last golden check: `same`, `recorded`, `changed`, `failed` or
    /// `unrecorded`, and what it found.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub(crate) golden: Option<GoldenDoc>,
    /// Why the answers are being checked again (the model out of rotation
    /// meanwhile), while they are.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub(crate) rechecking: Option<String>,
    /// Re-checks of the serving model's answers, and the seconds out of
    /// rotation they took in all.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub(crate) rechecks: u32,
    #[serde(default, skip_serializing_if = "is_zero_f64")]
    pub(crate) recheck_paused_seconds: f64,
    /// The weight-cache daemon (`[preload]`), while one runs.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub(crate) preload: Option<crate::supervisor::preload::DaemonView>,
    /// Memory fit: each fit argument the current (or last) start used,
    /// its value and where it came from (`config`, `default`, `pinned`,
    /// `fitted`), and the adjustments since the last ready.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub(crate) fit: BTreeMap<String, FitValue>,
    #[serde(default, skip_serializing_if = "is_zero")]
    pub(crate) fit_adjustments: u32,
    /// `configured`, or `last-known-good` while a rollback is in force.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub(crate) setup: Option<String>,
    /// The fingerprint of the setup in use.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub(crate) fingerprint: Option<String>,
    /// While a rollback is in force: both setups, and why the new one
    /// failed.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub(crate) rollback: Option<crate::supervisor::snapshot::RolledBack>,
    /// The last reload asked of this warden (`systemctl reload`,
    /// `vllm-warden reload`, SIGHUP): when, what became of it, and every
    /// problem of a refused config.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub(crate) last_reload: Option<LastReload>,
    /// The front door (`[front]`): where clients connect, where the engine
    /// listens, and the requests held and in flight.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub(crate) front: Option<FrontDoc>,
}

/// The front door, in the status document.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub(crate) struct FrontDoc {
    /// The addresses clients connect to (`0.0.0.0:8000`, `unix:/run/…`).
    pub(crate) listen: Vec<String>,
    /// Where the engine serves, reached only by the warden.
    pub(crate) engine: String,
    /// Requests waiting for the engine to serve.
    pub(crate) held: usize,
    /// Requests forwarded and not yet answered.
    pub(crate) in_flight: usize,
}

/// What became of a reload.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, strum::IntoStaticStr)]
#[serde(rename_all = "kebab-case")]
#[strum(serialize_all = "kebab-case")]
pub(crate) enum ReloadOutcome {
    /// Only the warden's own settings changed: applied to the running child.
    Applied,
    /// The child sees a change: it is started again.
    Restarting,
    /// Nothing the warden runs with changed.
    Unchanged,
    /// The new config is invalid: the warden keeps running the previous one.
    Refused,
}

impl ReloadOutcome {
    pub(crate) fn as_str(self) -> &'static str {
        self.into()
    }
}

/// The last reload, as the status document and `POST /reload` show it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub(crate) struct LastReload {
    pub(crate) at: String,
    pub(crate) outcome: ReloadOutcome,
    /// What changed (or "nothing changed"), or why the config was refused.
    pub(crate) summary: String,
    /// Every problem of a refused config, each with its file:line:col.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub(crate) problems: Vec<String>,
}

impl LastReload {
    /// A reload that ended now, its texts made safe to show.
    pub(crate) fn now(outcome: ReloadOutcome, summary: &str, problems: &[String]) -> LastReload {
        LastReload {
            at: rfc3339(SystemTime::now()),
            outcome,
            summary: safe(summary),
            problems: problems.iter().map(|p| safe(p)).collect(),
        }
    }
}

fn is_zero(n: &u32) -> bool {
    *n == 0
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub(crate) struct FitValue {
    pub(crate) value: String,
    pub(crate) source: String,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub(crate) struct GoldenDoc {
    pub(crate) verdict: String,
    pub(crate) text: String,
}

/// The load under way.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub(crate) struct LoadDoc {
    pub(crate) phase: String,
    /// The phase's place among those expected (1-based), and how many.
    pub(crate) index: usize,
    pub(crate) of: usize,
    pub(crate) elapsed_secs: f64,
    /// The estimate of the load's total from its setup's history (see
    /// `supervisor::load`), and the setup's last load; absent without
    /// history.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub(crate) expected_secs: Option<f64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub(crate) last_secs: Option<f64>,
    /// How far off the estimate is expected to be, from the setup's
    /// history: the median of the recent loads' worst absolute error from
    /// 25 % of the load on (a fraction); absent until loads kept what
    /// their estimate said.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub(crate) expected_error: Option<f64>,
    pub(crate) fingerprint: String,
    /// As in `STATUS=`.
    pub(crate) text: String,
}

impl LoadDoc {
    /// `load` of the status document (and of the endpoint's `/startupz`).
    pub(crate) fn of(l: &crate::supervisor::load::LoadNow) -> LoadDoc {
        LoadDoc {
            phase: l.phase.name().into(),
            index: l.index,
            of: l.of,
            elapsed_secs: round(l.elapsed.as_secs_f64()),
            expected_secs: l.expected.map(|d| round(d.as_secs_f64())),
            last_secs: l.last.map(|d| round(d.as_secs_f64())),
            expected_error: l.error.filter(|e| e.is_finite()).map(|e| (e * 1000.0).round() / 1000.0),
            fingerprint: safe(&l.fingerprint),
            text: safe(&l.text()),
        }
    }
}

/// The last load that ended.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub(crate) struct LastLoad {
    pub(crate) outcome: String,
    pub(crate) total_secs: f64,
    /// Each phase that ended, in order, and its seconds.
    pub(crate) phases: Vec<(String, f64)>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub(crate) cache: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub(crate) gbps: Option<f64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub(crate) cold: Option<bool>,
    /// The fraction of the weights in the page cache at the spawn.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub(crate) residency: Option<f64>,
    /// The disk's speed as the read-ahead measured it (GB/s).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub(crate) disk_gbps: Option<f64>,
    /// The weights phase against the disk's speed, for what it read from
    /// the disk.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub(crate) efficiency: Option<f64>,
    /// Its warnings: slower than its setup's median, or the compile cache
    /// did less than before.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub(crate) alarms: Vec<String>,
    pub(crate) fingerprint: String,
}

/// The cache directory (`child.cache-dir`) and its size, measured at each
/// start and each ready.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub(crate) struct Cache {
    pub(crate) dir: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub(crate) bytes: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub(crate) files: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub(crate) measured_at: Option<String>,
}

/// A human field from data (a log line, a process's command line): one
/// visible line, in the document and on the terminal alike.
pub(crate) fn safe(text: &str) -> String {
    crate::util::escape::one_line(&crate::util::redact::text(text), crate::util::escape::MAX_LINE)
}

/// Seconds to the millisecond, for the document.
fn round(x: f64) -> f64 {
    (x * 1000.0).round() / 1000.0
}

fn is_zero_f64(n: &f64) -> bool {
    *n == 0.0
}

fn rfc3339(t: SystemTime) -> String {
    humantime::format_rfc3339_seconds(t).to_string()
}

/// How often a change of the progress line alone, or of the journal's
/// dropped lines, is written; every other change is written at once.
pub(crate) const PROGRESS_EVERY: Duration = Duration::from_millis(250);

/// Keeps both files up to date.
pub(crate) struct Reporter {
    name: String,
    doc_path: PathBuf,
    metrics_path: Option<PathBuf>,
    /// Shared with the HTTP endpoint.
    metrics: Arc<Metrics>,
    /// The document as last made (written or not), for the HTTP endpoint.
    document: Option<Arc<str>>,
    /// The phase the document shows, and since when.
    phase: Option<Phase>,
    since: SystemTime,
    /// Since when the run is ready: the machine's instant and the time it
    /// was on this clock.
    ready_since: Option<(crate::supervisor::Instant, SystemTime)>,
    /// The past the document shows until this warden has its own
    /// (`history.json` in the state directory), and where it is kept.
    history: history::History,
    history_path: Option<PathBuf>,
    /// The file holds `history`.
    history_kept: bool,
    exits: u32,
    last_exit: Option<LastExit>,
    written_doc: Option<String>,
    written_metrics: Option<String>,
    /// The last snapshot given, written or not.
    last: Option<Snapshot>,
    /// When the files were last written.
    written_at: Option<std::time::Instant>,
    /// A change waits for `written_at + PROGRESS_EVERY`.
    pending: bool,
    /// The paths changed: the next update writes, whatever changed.
    moved: bool,
    /// Lines of the child dropped from the journal so far.
    journal_dropped: u64,
    /// The cache directory, and its size as last measured.
    cache_dir: Option<PathBuf>,
    meter: crate::process::caches::Meter,
    /// The weight-cache daemon, as last told.
    preload: Option<crate::supervisor::preload::DaemonView>,
    /// The last reload, as last told.
    last_reload: Option<LastReload>,
    /// The front door, as last told.
    front: Option<FrontDoc>,
    /// Writes the files, off the loop when it has a thread.
    outbox: Outbox,
}

impl Reporter {
    pub(crate) fn new(name: &str, doc_path: &Path, metrics_path: Option<&Path>, outbox: Outbox) -> Reporter {
        let now = SystemTime::now();
        Reporter {
            outbox,
            name: name.to_string(),
            doc_path: doc_path.to_path_buf(),
            metrics_path: metrics_path.map(Path::to_path_buf),
            metrics: Arc::new(Metrics::new(name, now)),
            document: None,
            phase: None,
            since: now,
            ready_since: None,
            history: history::History::default(),
            history_path: None,
            history_kept: false,
            exits: 0,
            last_exit: None,
            written_doc: None,
            written_metrics: None,
            last: None,
            written_at: None,
            pending: false,
            moved: false,
            journal_dropped: 0,
            cache_dir: None,
            preload: None,
            last_reload: None,
            front: None,
            meter: crate::process::caches::Meter::default(),
        }
    }

    /// Go on from the past kept in `state_dir` (see [`history`]), and keep
    /// it there from now on. Before the first update.
    pub(crate) fn resume(&mut self, state_dir: &Path) {
        let past = history::History::read(state_dir);
        self.last_exit = past.last_exit.clone();
        self.last_reload = past.last_reload.clone();
        // What the file holds (or nothing, which needs no writing).
        self.history_kept = true;
        self.history = past;
        self.history_path = Some(state_dir.join(history::FILE));
    }

    /// The cache directory to show and measure (a reloaded config may
    /// change it).
    pub(crate) fn set_cache_dir(&mut self, dir: Option<&Path>) {
        if self.cache_dir.as_deref() != dir {
            self.cache_dir = dir.map(Path::to_path_buf);
            self.meter = crate::process::caches::Meter::default();
            if let Some(d) = dir {
                self.meter.measure(d);
            }
            self.pending = true;
        }
    }

    /// Write to these paths from now on (a reloaded config); the next
    /// update writes them whole, whatever changed.
    pub(crate) fn set_paths(&mut self, doc_path: &Path, metrics_path: Option<&Path>) {
        if self.doc_path != doc_path || self.metrics_path.as_deref() != metrics_path {
            self.doc_path = doc_path.to_path_buf();
            self.metrics_path = metrics_path.map(Path::to_path_buf);
            self.written_doc = None;
            self.written_metrics = None;
            self.moved = true;
        }
    }

    /// Bring both files up to date with `snap`: at once, unless only the
    /// progress line changed and the files were written less than
    /// [`PROGRESS_EVERY`] ago (then [`Reporter::due`] says when). Whoever
    /// hears of a change of state finds the files saying it. A failure to
    /// write is logged, never fatal.
    pub(crate) fn update(&mut self, snap: &Snapshot) {
        if self.last.as_ref() == Some(snap) && !self.moved {
            return;
        }
        let progress_only = self.last.as_ref().is_some_and(|last| {
            *last == Snapshot { progress: last.progress.clone(), load: last.load.clone(), ..snap.clone() }
        });
        let now = SystemTime::now();
        if self.last.is_none() && self.history_path.is_some() {
            // The first of a warden that went on from the past: what the
            // machine brought from before (an upgrade's hand-over) is not
            // news of this warden's.
            self.exits = snap.exits;
            self.metrics.resume_failures(snap.failures.values().sum(), self.history.last_failure_at);
        }
        self.ready_since = snap.ready_at.map(|t| match self.ready_since {
            Some((known, at)) if known == t => (known, at),
            // The run a predecessor kept, taken over by an upgrade.
            _ if self.last.is_none()
                && let Some(r) = self.history.ready.filter(|r| Some(r.pid) == snap.child_pid) =>
            {
                (t, SystemTime::UNIX_EPOCH + Duration::from_secs_f64(r.since))
            }
            _ => (t, now - (crate::util::clock::now() - t)),
        });
        if self.phase != Some(snap.phase) {
            // Before a load and after it: what the load added.
            if let Some(dir) = &self.cache_dir
                && matches!(snap.phase, Phase::Starting | Phase::Ready)
            {
                self.meter.measure(dir);
            }
            self.phase = Some(snap.phase);
            self.since = now;
        }
        if snap.exits != self.exits {
            self.exits = snap.exits;
            self.last_exit = snap.last_exit.map(|e| LastExit {
                code: match e {
                    Exit::Code(c) => Some(c),
                    Exit::Signal(_) => None,
                },
                signal: match e {
                    Exit::Signal(s) => Some(s.as_str().to_string()),
                    Exit::Code(_) => None,
                },
                at: rfc3339(now),
            });
        }
        self.last = Some(snap.clone());
        if progress_only && !self.moved && self.recently_written() {
            self.pending = true;
        } else {
            self.write();
        }
    }

    /// The count of the metric `vllm_warden_journal_dropped_lines_total`;
    /// written with the next change, or at [`Reporter::due`].
    /// The weight-cache daemon as it is now (`[preload]`).
    pub(crate) fn set_preload(&mut self, view: Option<crate::supervisor::preload::DaemonView>) {
        if self.preload != view {
            self.preload = view;
            self.pending = true;
        }
    }

    /// The front door as it is now (`[front]`): written with the next
    /// change, or at [`Reporter::due`].
    pub(crate) fn set_front(&mut self, front: Option<FrontDoc>) {
        if self.front != front {
            self.front = front;
            self.pending = true;
        }
    }

    /// A reload ended: in the document and the metrics with the next write,
    /// which is due at once.
    pub(crate) fn set_last_reload(&mut self, r: LastReload) {
        self.metrics.reloaded(r.outcome != ReloadOutcome::Refused, SystemTime::now());
        self.last_reload = Some(r);
        self.pending = true;
        self.written_at = None;
    }

    pub(crate) fn set_journal_dropped(&mut self, n: u64) {
        if n != self.journal_dropped {
            self.journal_dropped = n;
            self.pending = true;
        }
    }

    /// A write waits (notifications of the same change wait with it); a
    /// size being measured holds nothing.
    pub(crate) fn write_waits(&self) -> bool {
        self.pending
    }

    /// When [`Reporter::flush`] should write what waits (or look whether
    /// the cache's size has come).
    pub(crate) fn due(&self) -> Option<std::time::Instant> {
        if self.pending {
            return Some(self.written_at.map_or_else(std::time::Instant::now, |t| t + PROGRESS_EVERY));
        }
        // A size being measured: looked for four times a second, never in
        // a loop that spins (the last write may be long past).
        self.meter.waiting().then(|| std::time::Instant::now() + PROGRESS_EVERY)
    }

    /// Write what waits, if anything does.
    pub(crate) fn flush(&mut self) {
        if self.meter.take().1 {
            self.pending = true;
        }
        if self.pending {
            self.write();
        }
    }

    /// The registry behind the metrics file, for the HTTP endpoint.
    pub(crate) fn metrics(&self) -> Arc<Metrics> {
        self.metrics.clone()
    }

    /// One turn of the loop, into its histogram (served by `/metrics`; the
    /// metrics file has it as of its last write).
    pub(crate) fn loop_turn(&self, took: Duration) {
        self.metrics.loop_turn(took);
    }

    /// The status document as last made: what the file says (or would, if
    /// it could not be written).
    pub(crate) fn document(&self) -> Option<Arc<str>> {
        self.document.clone()
    }

    fn recently_written(&self) -> bool {
        self.written_at.is_some_and(|t| t.elapsed() < PROGRESS_EVERY)
    }

    fn write(&mut self) {
        self.pending = false;
        self.moved = false;
        let Some(snap) = self.last.take() else { return };
        self.written_at = Some(std::time::Instant::now());
        let doc = self.doc(&snap);
        let text = serde_json::to_string_pretty(&doc).expect("the status document serialises") + "\n";
        self.document = Some(Arc::from(text.as_str()));
        self.metrics.set(&snap, self.journal_dropped);
        if self.written_doc.as_deref() != Some(&text) {
            match self.outbox.replace(&self.doc_path, text.as_bytes(), 0o644) {
                Ok(()) => self.written_doc = Some(text),
                Err(e) => tracing::warn!(error = %e, file = %self.doc_path.display(), "cannot write the status file"),
            }
        }
        self.keep_history(&doc);
        if let Some(path) = &self.metrics_path {
            let text = self.metrics.encode();
            if self.written_metrics.as_deref() != Some(&text) {
                match self.outbox.replace(path, text.as_bytes(), 0o644) {
                    Ok(()) => self.written_metrics = Some(text),
                    Err(e) => tracing::warn!(error = %e, file = %path.display(), "cannot write the metrics file"),
                }
            }
        }
        self.last = Some(snap);
    }

    /// Keep what `doc` says of the past in the state directory, when it
    /// changed.
    fn keep_history(&mut self, doc: &Doc) {
        let Some(path) = &self.history_path else { return };
        let next = history::History {
            last_exit: doc.last_exit.clone(),
            last_failure: doc.last_failure.clone(),
            last_failure_at: self.metrics.last_failure_at(),
            last_load: doc.last_load.clone(),
            last_reload: doc.last_reload.clone(),
            ready: self.ready_since.zip(doc.child_pid).map(|((_, at), pid)| history::ReadyRun {
                pid,
                since: at.duration_since(SystemTime::UNIX_EPOCH).unwrap_or_default().as_secs_f64(),
            }),
        };
        // Most writes change nothing of the past: nothing to write.
        if next == self.history && self.history_kept {
            return;
        }
        self.history = next;
        self.history_kept = match self.outbox.replace(path, self.history.to_json().as_bytes(), 0o644) {
            Ok(()) => true,
            Err(e) => {
                tracing::warn!(error = %e, file = %path.display(), "cannot write the status history");
                false
            }
        };
    }

    fn doc(&self, snap: &Snapshot) -> Doc {
        Doc {
            name: self.name.clone(),
            version: env!("CARGO_PKG_VERSION").to_string(),
            warden_pid: std::process::id(),
            state: snap.phase,
            child_pid: snap.child_pid,
            attempt: snap.attempt,
            restarts: snap.restarts,
            since: rfc3339(self.since),
            ready_since: self.ready_since.map(|(_, at)| rfc3339(at)),
            progress: snap.progress.as_deref().map(safe),
            last_exit: self.last_exit.clone(),
            cause: snap.cause.as_deref().map(safe),
            hint: snap.hint.as_deref().map(safe),
            exit_code: snap.exit_code.map(|c| i32::from(c.as_u8())),
            cache: self.cache_dir.as_ref().map(|dir| {
                let size = self.meter.take().0;
                Cache {
                    dir: safe(&dir.to_string_lossy()),
                    bytes: size.map(|s| s.bytes),
                    files: size.map(|s| s.files),
                    measured_at: size.map(|s| rfc3339(s.at)),
                }
            }),
            last_failure: snap
                .last_failure
                .as_ref()
                .map(|f| LastFailure { cause: safe(&f.cause), class: f.class, report: f.report.as_deref().map(safe) })
                .or_else(|| self.history.last_failure.clone()),
            load: snap.load.as_ref().map(LoadDoc::of),
            golden: snap.golden.as_ref().map(|v| GoldenDoc { verdict: v.name().into(), text: safe(&v.text()) }),
            rechecking: snap.rechecking.as_deref().map(safe),
            rechecks: snap.rechecks,
            recheck_paused_seconds: (snap.recheck_paused.as_secs_f64() * 1e3).round() / 1e3,
            fit: snap
                .fit
                .iter()
                .map(|(a, (v, src))| (a.name().to_string(), FitValue { value: safe(v), source: src.as_str().into() }))
                .collect(),
            fit_adjustments: snap.fit_moves,
            setup: snap
                .setup
                .as_ref()
                .map(|_| if snap.rolled_back.is_some() { "last-known-good" } else { "configured" }.to_string()),
            fingerprint: snap.setup.as_deref().map(safe),
            rollback: snap.rolled_back.as_ref().map(|r| crate::supervisor::snapshot::RolledBack {
                failed: safe(&r.failed),
                cause: safe(&r.cause),
                good: safe(&r.good),
                good_at: safe(&r.good_at),
            }),
            last_reload: self.last_reload.clone(),
            front: self.front.clone(),
            preload: self.preload.as_ref().map(|v| crate::supervisor::preload::DaemonView {
                state: v.state.clone(),
                progress: v.progress.as_deref().map(safe),
                ..v.clone()
            }),
            last_load: snap
                .last_load_record
                .as_ref()
                .map(|r| LastLoad {
                    outcome: match &r.outcome {
                        crate::supervisor::load::LoadOutcome::Failed { class, .. } => format!("failed ({class})"),
                        crate::supervisor::load::LoadOutcome::Stopped { why } => format!("stopped ({})", safe(why)),
                        o => o.word().into(),
                    },
                    total_secs: round(r.total_secs),
                    phases: r.phases.iter().map(|t| (t.phase.name().to_string(), round(t.secs))).collect(),
                    cache: r.cache.as_ref().map(|c| safe(&c.describe())),
                    gbps: r.gbps.map(round),
                    cold: r.cold,
                    residency: r.residency.map(round),
                    disk_gbps: r.prefetch.filter(|p| p.bytes > 0).map(|p| round(p.gbps)),
                    efficiency: r.efficiency.map(round),
                    alarms: r.alarms.iter().map(|a| safe(a)).collect(),
                    fingerprint: safe(&r.fingerprint),
                })
                .or_else(|| self.history.last_load.clone()),
        }
    }
}

mod history;
#[cfg(test)]
mod tests;
