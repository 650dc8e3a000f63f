//! The status document (`status.file`) and the Prometheus textfile
//! (`status.metrics-file`): what they contain, how they are written (whole
//! and atomically, only when something changed, a change of the progress
//! line alone at most every [`PROGRESS_EVERY`]), and how `status` reads
//! them back. How the state changes is not known here: the supervisor hands
//! over a [`Snapshot`].

use std::fmt::Write as _;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::AtomicU64;
use std::time::{Duration, SystemTime};

use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{Histogram, exponential_buckets};
use prometheus_client::registry::{Registry, Unit};
use serde::{Deserialize, Serialize};

use std::collections::BTreeMap;

use crate::supervisor::outcome::Exit;
use crate::supervisor::outcome::{FailureClass, Phase};
pub use crate::supervisor::snapshot::{LastFailure, Snapshot};
use crate::tell::outbox::Outbox;

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct LastExit {
    pub code: Option<i32>,
    pub signal: Option<String>,
    pub at: String,
}

/// The status document, as written to `status.file`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Doc {
    pub name: String,
    pub version: String,
    pub warden_pid: u32,
    pub state: Phase,
    pub child_pid: Option<u32>,
    pub attempt: u32,
    pub restarts: u32,
    /// When the current state began.
    pub since: String,
    pub ready_since: Option<String>,
    pub progress: Option<String>,
    pub last_exit: Option<LastExit>,
    pub cause: Option<String>,
    /// What to do about the cause, when it is a known one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub hint: Option<String>,
    /// Set when the warden has exited.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub exit_code: Option<i32>,
    /// The last failed run and its failure report.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub last_failure: Option<LastFailure>,
    /// Where the child's caches go, and their size.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cache: Option<Cache>,
    /// The load under way: its phase and the estimate.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub load: Option<LoadDoc>,
    /// The last load that ended, as the ledger has it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub last_load: Option<LastLoad>,
    /// The last golden check: `same`, `recorded`, `changed`, `failed` or
    /// `unrecorded`, and what it found.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub golden: Option<GoldenDoc>,
    /// Why the answers are being checked again (the model out of rotation
    /// meanwhile), while they are.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rechecking: Option<String>,
    /// Re-checks of the serving model's answers, and the seconds out of
    /// rotation they took in all.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub rechecks: u32,
    #[serde(default, skip_serializing_if = "is_zero_f64")]
    pub recheck_paused_seconds: f64,
    /// The weight-cache daemon (`[preload]`), while one runs.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub preload: Option<crate::supervisor::preload::DaemonView>,
    /// Memory fit: each fit argument the current (or last) start used,
    /// its value and where it came from (`config`, `default`, `pinned`,
    /// `fitted`), and the adjustments since the last ready.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub fit: BTreeMap<String, FitValue>,
    #[serde(default, skip_serializing_if = "is_zero")]
    pub fit_adjustments: u32,
    /// `configured`, or `last-known-good` while a rollback is in force.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub setup: Option<String>,
    /// The fingerprint of the setup in use.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub fingerprint: Option<String>,
    /// While a rollback is in force: both setups, and why the new one
    /// failed.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rollback: Option<crate::supervisor::snapshot::RolledBack>,
    /// The last reload asked of this warden (`systemctl reload`,
    /// `vllm-warden reload`, SIGHUP): when, what became of it, and every
    /// problem of a refused config.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub last_reload: Option<LastReload>,
    /// The front door (`[front]`): where clients connect, where the engine
    /// listens, and the requests held and in flight.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub front: Option<FrontDoc>,
}

/// The front door, in the status document.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct FrontDoc {
    /// The addresses clients connect to (`0.0.0.0:8000`, `unix:/run/…`).
    pub listen: Vec<String>,
    /// Where the engine serves, reached only by the warden.
    pub engine: String,
    /// Requests waiting for the engine to serve.
    pub held: usize,
    /// Requests forwarded and not yet answered.
    pub in_flight: usize,
}

/// What became of a reload.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, strum::IntoStaticStr)]
#[serde(rename_all = "kebab-case")]
#[strum(serialize_all = "kebab-case")]
pub enum ReloadOutcome {
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
    pub fn as_str(self) -> &'static str {
        self.into()
    }
}

/// The last reload, as the status document and `POST /reload` show it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct LastReload {
    pub at: String,
    pub outcome: ReloadOutcome,
    /// What changed (or "nothing changed"), or why the config was refused.
    pub summary: String,
    /// Every problem of a refused config, each with its file:line:col.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub problems: Vec<String>,
}

impl LastReload {
    /// A reload that ended now, its texts made safe to show.
    pub fn now(outcome: ReloadOutcome, summary: &str, problems: &[String]) -> LastReload {
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
pub struct FitValue {
    pub value: String,
    pub source: String,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct GoldenDoc {
    pub verdict: String,
    pub text: String,
}

/// The load under way.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct LoadDoc {
    pub phase: String,
    /// The phase's place among those expected (1-based), and how many.
    pub index: usize,
    pub of: usize,
    pub elapsed_secs: f64,
    /// The estimate of the load's total from its setup's history (see
    /// `supervisor::load`), and the setup's last load; absent without
    /// history.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub expected_secs: Option<f64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub last_secs: Option<f64>,
    /// How far off the estimate is expected to be, from the setup's
    /// history: the median of the recent loads' worst absolute error from
    /// 25 % of the load on (a fraction); absent until loads kept what
    /// their estimate said.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub expected_error: Option<f64>,
    pub fingerprint: String,
    /// As in `STATUS=`.
    pub text: String,
}

impl LoadDoc {
    /// `load` of the status document (and of the endpoint's `/startupz`).
    pub fn of(l: &crate::supervisor::load::LoadNow) -> LoadDoc {
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
pub struct LastLoad {
    pub outcome: String,
    pub total_secs: f64,
    /// Each phase that ended, in order, and its seconds.
    pub phases: Vec<(String, f64)>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cache: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub gbps: Option<f64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cold: Option<bool>,
    /// The fraction of the weights in the page cache at the spawn.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub residency: Option<f64>,
    /// The disk's speed as the read-ahead measured it (GB/s).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub disk_gbps: Option<f64>,
    /// The weights phase against the disk's speed (or the page cache's).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub efficiency: Option<f64>,
    /// Its warnings: slower than its setup's median, or the compile cache
    /// did less than before.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub alarms: Vec<String>,
    pub fingerprint: String,
}

/// The cache directory (`child.cache-dir`) and its size, measured at each
/// start and each ready.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Cache {
    pub dir: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub bytes: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub files: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub measured_at: Option<String>,
}

/// A human field from data (a log line, a process's command line): one
/// visible line, in the document and on the terminal alike.
fn safe(text: &str) -> String {
    crate::util::escape::one_line(&crate::util::redact::text(text), crate::util::escape::MAX_LINE)
}

/// Seconds to the millisecond, for the document.
fn round(x: f64) -> f64 {
    (x * 1000.0).round() / 1000.0
}

fn rfc3339(t: SystemTime) -> String {
    humantime::format_rfc3339_seconds(t).to_string()
}

/// How often a change of the progress line alone, or of the journal's
/// dropped lines, is written; every other change is written at once.
pub const PROGRESS_EVERY: Duration = Duration::from_millis(250);

/// Keeps both files up to date.
pub struct Reporter {
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
    ready_since: Option<SystemTime>,
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
    pub fn new(name: &str, doc_path: &Path, metrics_path: Option<&Path>, outbox: Outbox) -> Reporter {
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

    /// The cache directory to show and measure (a reloaded config may
    /// change it).
    pub fn set_cache_dir(&mut self, dir: Option<&Path>) {
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
    pub fn set_paths(&mut self, doc_path: &Path, metrics_path: Option<&Path>) {
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
    pub fn update(&mut self, snap: &Snapshot) {
        if self.last.as_ref() == Some(snap) && !self.moved {
            return;
        }
        let progress_only = self.last.as_ref().is_some_and(|last| {
            *last == Snapshot { progress: last.progress.clone(), load: last.load.clone(), ..snap.clone() }
        });
        let now = SystemTime::now();
        if self.phase != Some(snap.phase) {
            // Before a load and after it: what the load added.
            if let Some(dir) = &self.cache_dir
                && matches!(snap.phase, Phase::Starting | Phase::Ready)
            {
                self.meter.measure(dir);
            }
            self.phase = Some(snap.phase);
            self.since = now;
            self.ready_since = (snap.phase == Phase::Ready).then_some(now);
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
    pub fn set_preload(&mut self, view: Option<crate::supervisor::preload::DaemonView>) {
        if self.preload != view {
            self.preload = view;
            self.pending = true;
        }
    }

    /// The front door as it is now (`[front]`): written with the next
    /// change, or at [`Reporter::due`].
    pub fn set_front(&mut self, front: Option<FrontDoc>) {
        if self.front != front {
            self.front = front;
            self.pending = true;
        }
    }

    /// A reload ended: in the document and the metrics with the next write,
    /// which is due at once.
    pub fn set_last_reload(&mut self, r: LastReload) {
        self.metrics.reloaded(r.outcome != ReloadOutcome::Refused, SystemTime::now());
        self.last_reload = Some(r);
        self.pending = true;
        self.written_at = None;
    }

    pub fn set_journal_dropped(&mut self, n: u64) {
        if n != self.journal_dropped {
            self.journal_dropped = n;
            self.pending = true;
        }
    }

    /// A write waits (notifications of the same change wait with it); a
    /// size being measured holds nothing.
    pub fn write_waits(&self) -> bool {
        self.pending
    }

    /// When [`Reporter::flush`] should write what waits (or look whether
    /// the cache's size has come).
    pub fn due(&self) -> Option<std::time::Instant> {
        if self.pending {
            return Some(self.written_at.map_or_else(std::time::Instant::now, |t| t + PROGRESS_EVERY));
        }
        // A size being measured: looked for four times a second, never in
        // a loop that spins (the last write may be long past).
        self.meter.waiting().then(|| std::time::Instant::now() + PROGRESS_EVERY)
    }

    /// Write what waits, if anything does.
    pub fn flush(&mut self) {
        if self.meter.take().1 {
            self.pending = true;
        }
        if self.pending {
            self.write();
        }
    }

    /// The registry behind the metrics file, for the HTTP endpoint.
    pub fn metrics(&self) -> Arc<Metrics> {
        self.metrics.clone()
    }

    /// One turn of the loop, into its histogram (served by `/metrics`; the
    /// metrics file has it as of its last write).
    pub fn loop_turn(&self, took: Duration) {
        self.metrics.loop_turn.observe(took.as_secs_f64());
    }

    /// The status document as last made: what the file says (or would, if
    /// it could not be written).
    pub fn document(&self) -> Option<Arc<str>> {
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
            ready_since: self.ready_since.map(rfc3339),
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
            last_failure: snap.last_failure.as_ref().map(|f| LastFailure {
                cause: safe(&f.cause),
                class: f.class,
                report: f.report.as_deref().map(safe),
            }),
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
            last_load: snap.last_load_record.as_ref().map(|r| LastLoad {
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
            }),
        }
    }
}

/// The warden's metrics: one registry (`prometheus-client`), served by
/// `GET /metrics` and written to the textfile-collector file, in the
/// Prometheus text format (0.0.4), names prefixed `vllm_warden_`, each with
/// `# HELP` and `# TYPE`, every sample labelled with the instance's `name`.
pub struct Metrics {
    registry: Registry,
    state: Family<Vec<(String, String)>, Gauge>,
    ready: Gauge,
    child_starts: Counter,
    restarts: Counter,
    failures: Family<Vec<(String, String)>, Counter>,
    /// One sample once a run was ready; none before.
    last_load: Family<Vec<(String, String)>, Gauge<f64, AtomicU64>>,
    journal_dropped: Counter,
    start_time: Gauge<f64, AtomicU64>,
    /// How long each turn of the warden's loop took.
    loop_turn: Histogram,
    /// Each phase of each load that ended.
    load_phase: Family<Vec<(String, String)>, Histogram>,
    load_cache: Family<Vec<(String, String)>, Counter>,
    load_alarms: Family<Vec<(String, String)>, Counter>,
    /// One sample once a load read its weights at a known rate.
    last_gbps: Family<Vec<(String, String)>, Gauge<f64, AtomicU64>>,
    /// Loads already counted.
    loads_seen: std::sync::atomic::AtomicU32,
    golden: Family<Vec<(String, String)>, Counter>,
    golden_seen: std::sync::atomic::AtomicU32,
    /// Re-checks while serving, and the time out of rotation they took.
    rechecks: Counter,
    recheck_paused: Counter<f64, AtomicU64>,
    /// 0 after a refused reload; 1 at start and after one that applied.
    reload_ok: Gauge,
    /// When the config in force was last read successfully.
    reload_ok_at: Gauge<f64, AtomicU64>,
    /// Engines stopped, and put to sleep, for want of requests.
    idle_stops: Counter,
    sleeps: Counter,
    /// 1, labelled with the warden's version.
    build_info: Family<Vec<(String, String)>, Gauge>,
    /// During a load only: its elapsed time (brought up to date at each
    /// encoding, from when it began) and the setup's expected time.
    load_elapsed: Family<Vec<(String, String)>, Gauge<f64, AtomicU64>>,
    load_expected: Family<Vec<(String, String)>, Gauge<f64, AtomicU64>>,
    load_began: std::sync::Mutex<Option<std::time::Instant>>,
    /// 1 for the phase of the load under way, 0 for the others.
    load_phase_now: Family<Vec<(String, String)>, Gauge>,
    /// When the last failed run was counted; none before the first.
    last_failure_at: Family<Vec<(String, String)>, Gauge<f64, AtomicU64>>,
    failures_seen: AtomicU64,
    health_failures: Family<Vec<(String, String)>, Counter>,
    draining: Gauge,
    last_bps: Family<Vec<(String, String)>, Gauge<f64, AtomicU64>>,
    /// 1 for the verdict of the last golden check, 0 for the others.
    golden_last: Family<Vec<(String, String)>, Gauge>,
    gpu_wait: Gauge<f64, AtomicU64>,
    gave_up: Gauge,
    /// The front door's (`[front]`): its requests, held and in flight.
    pub front: FrontMetrics,
}

/// What the front door counts: requests by outcome (one request may count
/// under several: held, then forwarded), how long requests were held, and
/// the requests held and forwarded now.
pub struct FrontMetrics {
    requests: Family<Vec<(String, String)>, Counter>,
    held_seconds: Histogram,
    in_flight: Gauge,
    held: Gauge,
}

/// The outcomes of `front_requests_total`.
pub const FRONT_OUTCOMES: [&str; 5] = ["forwarded", "held", "rejected", "upstream_error", "retried"];

impl FrontMetrics {
    fn new() -> FrontMetrics {
        let m = FrontMetrics {
            requests: Family::default(),
            // 10 ms to about 45 min.
            held_seconds: Histogram::new(exponential_buckets(0.01, 3.0, 12)),
            in_flight: Gauge::default(),
            held: Gauge::default(),
        };
        for o in FRONT_OUTCOMES {
            let _ = m.requests.get_or_create(&vec![("outcome".into(), o.into())]);
        }
        m
    }

    fn register(&self, registry: &mut Registry) {
        registry.register(
            "front_requests",
            "Requests of the front door by outcome: forwarded (answered by the engine), held (waited for it), \
             rejected (answered by the warden: 503, 413, 404), upstream_error (502), retried (sent once more)",
            self.requests.clone(),
        );
        registry.register_with_unit(
            "front_held",
            "How long each held request of the front door waited",
            Unit::Seconds,
            self.held_seconds.clone(),
        );
        registry.register(
            "front_in_flight",
            "Requests of the front door forwarded and not yet answered",
            self.in_flight.clone(),
        );
        registry.register(
            "front_held",
            "Requests of the front door waiting for the engine to serve",
            self.held.clone(),
        );
    }

    /// One request had `outcome` (one of [`FRONT_OUTCOMES`]).
    pub fn count(&self, outcome: &str) {
        self.requests.get_or_create(&vec![("outcome".into(), outcome.into())]).inc();
    }

    pub fn held_for(&self, d: Duration) {
        self.held_seconds.observe(d.as_secs_f64());
    }

    pub fn set_in_flight(&self, n: usize) {
        self.in_flight.set(i64::try_from(n).unwrap_or(i64::MAX));
    }

    pub fn set_held(&self, n: usize) {
        self.held.set(i64::try_from(n).unwrap_or(i64::MAX));
    }

    /// Requests held and in flight now, as the gauges say (live: set by
    /// the front door at each change).
    pub fn now(&self) -> (usize, usize) {
        let n = |g: &Gauge| usize::try_from(g.get()).unwrap_or(0);
        (n(&self.held), n(&self.in_flight))
    }
}

impl std::fmt::Debug for Metrics {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Metrics").finish_non_exhaustive()
    }
}

impl Metrics {
    pub fn new(name: &str, started: SystemTime) -> Metrics {
        let labels = [(std::borrow::Cow::Borrowed("name"), std::borrow::Cow::Owned(name.to_string()))];
        let mut registry = Registry::with_prefix_and_labels("vllm_warden", labels.into_iter());
        let m = Metrics {
            registry: Registry::default(),
            state: Family::default(),
            ready: Gauge::default(),
            child_starts: Counter::default(),
            restarts: Counter::default(),
            failures: Family::default(),
            last_load: Family::default(),
            journal_dropped: Counter::default(),
            start_time: Gauge::default(),
            // 50 µs to about 26 s.
            loop_turn: Histogram::new(exponential_buckets(0.00005, 4.0, 10)),
            // 0.1 s to about 7 hours.
            load_phase: Family::new_with_constructor(|| Histogram::new(exponential_buckets(0.1, 3.0, 11))),
            load_cache: Family::default(),
            load_alarms: Family::default(),
            last_gbps: Family::default(),
            loads_seen: Default::default(),
            golden: Family::default(),
            golden_seen: Default::default(),
            rechecks: Counter::default(),
            recheck_paused: Counter::default(),
            reload_ok: Gauge::default(),
            reload_ok_at: Gauge::default(),
            idle_stops: Counter::default(),
            sleeps: Counter::default(),
            build_info: Family::default(),
            load_elapsed: Family::default(),
            load_expected: Family::default(),
            load_began: Default::default(),
            load_phase_now: Family::default(),
            last_failure_at: Family::default(),
            failures_seen: Default::default(),
            health_failures: Family::default(),
            draining: Gauge::default(),
            last_bps: Family::default(),
            golden_last: Family::default(),
            gpu_wait: Gauge::default(),
            gave_up: Gauge::default(),
            front: FrontMetrics::new(),
        };
        m.build_info.get_or_create(&vec![("version".into(), env!("CARGO_PKG_VERSION").into())]).set(1);
        for v in crate::supervisor::golden::Verdict::NAMES {
            let _ = m.golden_last.get_or_create(&vec![("verdict".into(), v.into())]);
        }
        for p in crate::config::profile::LoadPhase::ALL {
            let _ = m.load_phase_now.get_or_create(&vec![("phase".into(), p.name().into())]);
        }
        for c in crate::observe::facts::CHECKS {
            let _ = m.health_failures.get_or_create(&vec![("check".into(), c.into())]);
        }
        for v in crate::supervisor::golden::Verdict::NAMES {
            let _ = m.golden.get_or_create(&vec![("verdict".into(), v.into())]);
        }
        for c in crate::supervisor::load::CacheOutcome::NAMES {
            let _ = m.load_cache.get_or_create(&vec![("outcome".into(), c.into())]);
        }
        for k in ALARM_KINDS {
            let _ = m.load_alarms.get_or_create(&vec![("kind".into(), k.into())]);
        }
        for &p in Phase::ALL {
            let _ = m.state.get_or_create(&vec![("state".into(), p.as_str().into())]);
        }
        for &c in FailureClass::ALL {
            let _ = m.failures.get_or_create(&vec![("class".into(), c.as_str().into())]);
        }
        registry.register("state", "1 for the state the warden is in, 0 for the others", m.state.clone());
        registry.register("ready", "1 when the model is serving", m.ready.clone());
        registry.register("child_starts", "Children spawned", m.child_starts.clone());
        registry.register("restarts", "Spawns after the first", m.restarts.clone());
        registry.register("failures", "Failed runs by the class of their cause", m.failures.clone());
        registry.register_with_unit(
            "last_load_duration",
            "Time from spawn to ready of the last ready run",
            Unit::Seconds,
            m.last_load.clone(),
        );
        registry.register(
            "journal_dropped_lines",
            "Lines of the child dropped from the journal forwarding (journald too slow); the log file has them all",
            m.journal_dropped.clone(),
        );
        registry.register(
            "start_time_seconds",
            "When the warden started, in seconds since the epoch",
            m.start_time.clone(),
        );
        registry.register_with_unit(
            "loop_turn_duration",
            "Time of each turn of the warden's event loop, from its wake to its next wait",
            Unit::Seconds,
            m.loop_turn.clone(),
        );
        registry.register_with_unit(
            "load_phase_duration",
            "Time of each phase of each load that ended (see `vllm-warden loads`)",
            Unit::Seconds,
            m.load_phase.clone(),
        );
        registry.register("load_cache_outcomes", "Loads by what their compile cache did", m.load_cache.clone());
        registry.register(
            "load_alarms",
            "Loads slower than their setup's median, or whose compile cache did less than before",
            m.load_alarms.clone(),
        );
        registry.register(
            "last_load_weights_gigabytes_per_second",
            "Deprecated, to be removed in the next release: vllm_warden_last_load_weights_bytes_per_second / 1e9",
            m.last_gbps.clone(),
        );
        registry.register(
            "golden_checks",
            "Golden checks by verdict: same, recorded, changed (an alarm), failed (no answer), unrecorded (the store unusable)",
            m.golden.clone(),
        );
        registry.register(
            "golden_rechecks",
            "Re-checks of the serving model's answers (after a GPU fault that did not end it, an upgrade of the warden, golden.interval)",
            m.rechecks.clone(),
        );
        registry.register_with_unit(
            "golden_recheck_pause",
            "Time the model was out of rotation for re-checks of its answers",
            Unit::Seconds,
            m.recheck_paused.clone(),
        );
        registry.register(
            "config_last_reload_successful",
            "0 when the last reload was refused (the previous config still runs); 1 at start and after a reload that applied",
            m.reload_ok.clone(),
        );
        registry.register(
            "config_last_reload_success_timestamp_seconds",
            "When the config in force was read successfully (the start, or the last reload that applied), in seconds since the epoch",
            m.reload_ok_at.clone(),
        );
        registry.register(
            "idle_stops",
            "Engines stopped for want of requests (`front.idle-stop`, `idle-action = \"stop\"`)",
            m.idle_stops.clone(),
        );
        registry.register(
            "idle_sleeps",
            "Engines put to sleep for want of requests (`idle-action = \"sleep\"`)",
            m.sleeps.clone(),
        );
        registry.register("build_info", "1, labelled with the warden's version", m.build_info.clone());
        registry.register_with_unit(
            "load_elapsed",
            "During a load only: the time since its spawn",
            Unit::Seconds,
            m.load_elapsed.clone(),
        );
        registry.register_with_unit(
            "load_expected",
            "During a load only: the median of the setup's good loads in the ledger; absent without history",
            Unit::Seconds,
            m.load_expected.clone(),
        );
        registry.register(
            "load_phase",
            "1 for the phase of the load under way, 0 for the others (all 0 outside a load)",
            m.load_phase_now.clone(),
        );
        registry.register(
            "last_failure_timestamp_seconds",
            "When the last failed run was counted, in seconds since the epoch; absent before the first",
            m.last_failure_at.clone(),
        );
        registry.register(
            "health_check_failures",
            "Failed checks after ready: health (the HTTP check), canary (the one-token completion), progress (an engine stalled under load)",
            m.health_failures.clone(),
        );
        registry.register("draining", "1 while out of rotation: draining or drained; 0 otherwise", m.draining.clone());
        registry.register(
            "last_load_weights_bytes_per_second",
            "Weight bytes over the weights phase of the last load that read them at a known rate",
            m.last_bps.clone(),
        );
        registry.register(
            "golden_last_verdict",
            "1 for the verdict of the last golden check, 0 for the others (all 0 before the first)",
            m.golden_last.clone(),
        );
        registry.register_with_unit(
            "gpu_release_wait",
            "How long the start has been waiting for GPU compute processes to exit (their memory released); 0 when it is not",
            Unit::Seconds,
            m.gpu_wait.clone(),
        );
        registry.register(
            "gave_up",
            "1 once the warden has given up (exit 75: max-attempts failed starts; 78: a permanent cause; 71: processes that survived SIGKILL): its last write before it exits",
            m.gave_up.clone(),
        );
        m.front.register(&mut registry);
        m.start_time.set(started.duration_since(SystemTime::UNIX_EPOCH).unwrap_or_default().as_secs_f64());
        m.reloaded(true, started);
        Metrics { registry, ..m }
    }

    /// Bring every metric to what `snap` says.
    pub fn set(&self, snap: &Snapshot, journal_dropped: u64) {
        for &p in Phase::ALL {
            let v = i64::from(p == snap.phase);
            self.state.get_or_create(&vec![("state".into(), p.as_str().into())]).set(v);
        }
        self.ready.set(i64::from(snap.phase == Phase::Ready));
        raise(&self.child_starts, snap.starts.into());
        raise(&self.restarts, snap.restarts.into());
        for &c in FailureClass::ALL {
            let n = snap.failures.get(&c).copied().unwrap_or(0);
            raise(&self.failures.get_or_create(&vec![("class".into(), c.as_str().into())]), n);
        }
        if let Some(d) = snap.last_load {
            self.last_load.get_or_create(&vec![]).set(d.as_secs_f64());
        }
        raise(&self.journal_dropped, journal_dropped);
        raise(&self.rechecks, snap.rechecks.into());
        let paused = snap.recheck_paused.as_secs_f64();
        if paused > self.recheck_paused.get() {
            self.recheck_paused.inc_by(paused - self.recheck_paused.get());
        }
        raise(&self.idle_stops, snap.idle_stops.into());
        raise(&self.sleeps, snap.sleeps.into());
        let seen = self.golden_seen.swap(snap.golden_checks, std::sync::atomic::Ordering::Relaxed);
        if snap.golden_checks > seen
            && let Some(v) = &snap.golden
        {
            self.golden.get_or_create(&vec![("verdict".into(), v.name().into())]).inc();
        }
        let seen = self.loads_seen.swap(snap.loads_ended, std::sync::atomic::Ordering::Relaxed);
        if snap.loads_ended > seen
            && let Some(r) = &snap.last_load_record
        {
            for t in &r.phases {
                self.load_phase.get_or_create(&vec![("phase".into(), t.phase.name().into())]).observe(t.secs);
            }
            if let Some(c) = &r.cache {
                self.load_cache.get_or_create(&vec![("outcome".into(), c.name().into())]).inc();
            }
            for a in &r.alarms {
                self.load_alarms.get_or_create(&vec![("kind".into(), alarm_kind(a).into())]).inc();
            }
            if let Some(g) = r.gbps {
                self.last_gbps.get_or_create(&vec![]).set(g);
                self.last_bps.get_or_create(&vec![]).set(g * 1e9);
            }
        }
        self.set_more(snap);
    }

    /// The metrics an alert needs (issue 47), from `snap`.
    fn set_more(&self, snap: &Snapshot) {
        let mut began = self.load_began.lock().unwrap_or_else(|e| e.into_inner());
        match &snap.load {
            Some(l) => {
                *began = Some(l.began.into_std());
                self.load_elapsed.get_or_create(&vec![]).set(l.elapsed.as_secs_f64());
                // The median, a fixed yardstick: the live estimate is never
                // behind the elapsed time, so no alert could compare them.
                match l.median {
                    Some(e) => {
                        self.load_expected.get_or_create(&vec![]).set(e.as_secs_f64());
                    }
                    None => self.load_expected.clear(),
                }
            }
            None => {
                *began = None;
                self.load_elapsed.clear();
                self.load_expected.clear();
            }
        }
        for p in crate::config::profile::LoadPhase::ALL {
            let now = snap.load.as_ref().is_some_and(|l| l.phase == p);
            self.load_phase_now.get_or_create(&vec![("phase".into(), p.name().into())]).set(i64::from(now));
        }
        let failed: u64 = snap.failures.values().sum();
        if failed > self.failures_seen.swap(failed, std::sync::atomic::Ordering::Relaxed) {
            let at = SystemTime::now().duration_since(SystemTime::UNIX_EPOCH).unwrap_or_default();
            self.last_failure_at.get_or_create(&vec![]).set(at.as_secs_f64());
        }
        self.draining.set(i64::from(matches!(snap.phase, Phase::Draining | Phase::Drained)));
        if let Some(v) = &snap.golden {
            for name in crate::supervisor::golden::Verdict::NAMES {
                self.golden_last.get_or_create(&vec![("verdict".into(), name.into())]).set(i64::from(name == v.name()));
            }
        }
        use crate::supervisor::exit::Code;
        self.gave_up.set(i64::from(matches!(snap.exit_code, Some(Code::GaveUp | Code::Config | Code::Unkillable))));
    }

    /// What only tasks off the loop know, and the times that move between
    /// two snapshots, as of now.
    fn refresh(&self) {
        for (check, n) in crate::observe::facts::CHECKS.iter().zip(crate::observe::facts::checks_failed()) {
            raise(&self.health_failures.get_or_create(&vec![("check".into(), (*check).into())]), n);
        }
        self.gpu_wait.set(crate::observe::facts::gpu_waited().as_secs_f64());
        if let Some(began) = *self.load_began.lock().unwrap_or_else(|e| e.into_inner()) {
            self.load_elapsed.get_or_create(&vec![]).set(began.elapsed().as_secs_f64());
        }
    }

    /// A reload ended at `at`: applied (`ok`) or refused.
    pub fn reloaded(&self, ok: bool, at: SystemTime) {
        self.reload_ok.set(i64::from(ok));
        if ok {
            self.reload_ok_at.set(at.duration_since(SystemTime::UNIX_EPOCH).unwrap_or_default().as_secs_f64());
        }
    }

    /// The exposition text.
    pub fn encode(&self) -> String {
        self.refresh();
        let mut out = String::new();
        // Writing into a String cannot fail.
        let _ = prometheus_client::encoding::prometheus_text::encode(&mut out, &self.registry);
        out
    }
}

/// The kinds of load alarm, for the metric's label.
const ALARM_KINDS: [&str; 3] = ["cache", "slow-load", "slow-phase"];

fn alarm_kind(text: &str) -> &'static str {
    if text.starts_with("compile cache") {
        "cache"
    } else if text.starts_with("slow phase") {
        "slow-phase"
    } else {
        "slow-load"
    }
}

/// A counter brought up to `total` (the machine keeps the counts; a
/// counter only goes up).
fn is_zero_f64(n: &f64) -> bool {
    *n == 0.0
}

fn raise(c: &Counter, total: u64) {
    let now = c.get();
    if total > now {
        c.inc_by(total - now);
    }
}

/// The metrics of `snap` as text, from a registry of their own.
pub fn metrics(name: &str, snap: &Snapshot, started: SystemTime, journal_dropped: u64) -> String {
    let m = Metrics::new(name, started);
    m.set(snap, journal_dropped);
    m.encode()
}

/// What `status` concludes from the document.
#[derive(Debug, Clone, PartialEq)]
pub enum StatusVerdict {
    Ready(Doc),
    NotReady(Doc),
    /// No file, a stopped warden, or a warden pid that is gone.
    NotRunning(Option<Doc>),
}

/// Read the document and tell whether its warden is still there.
pub fn read(path: &Path) -> StatusVerdict {
    let Ok(text) = std::fs::read_to_string(path) else { return StatusVerdict::NotRunning(None) };
    verdict(&text)
}

/// What a document says (from the file, or from the warden's socket).
pub fn verdict(text: &str) -> StatusVerdict {
    let Ok(doc) = serde_json::from_str::<Doc>(text) else { return StatusVerdict::NotRunning(None) };
    if doc.state == Phase::Stopped || doc.exit_code.is_some() || !warden_alive(doc.warden_pid) {
        return StatusVerdict::NotRunning(Some(doc));
    }
    if doc.state == Phase::Ready { StatusVerdict::Ready(doc) } else { StatusVerdict::NotReady(doc) }
}

/// The pid is alive and is a vllm-warden (not a recycled pid).
fn warden_alive(pid: u32) -> bool {
    std::fs::read(format!("/proc/{pid}/cmdline"))
        .map(|c| {
            c.split(|b| *b == 0).next().is_some_and(|argv0| String::from_utf8_lossy(argv0).contains("vllm-warden"))
        })
        .unwrap_or(false)
}

/// The short human summary of `status`.
pub fn summary(v: &StatusVerdict) -> String {
    let doc = match v {
        StatusVerdict::Ready(d) | StatusVerdict::NotReady(d) => d,
        StatusVerdict::NotRunning(None) => return "not running (no status file)".to_string(),
        StatusVerdict::NotRunning(Some(d)) => {
            let why = d.cause.as_deref().map(|c| format!(": {}", safe(c))).unwrap_or_default();
            return match d.exit_code {
                Some(code) => format!("{}: not running (exited with {code} at {}){why}", d.name, d.since),
                None => format!("{}: not running (warden {} is gone){why}", d.name, d.warden_pid),
            };
        }
    };
    let mut out = format!("{}: {}", safe(&doc.name), doc.state);
    if let Some(pid) = doc.child_pid {
        let _ = write!(out, ", pid {pid}");
    }
    let since = humantime::parse_rfc3339(&doc.since).ok().and_then(|t| SystemTime::now().duration_since(t).ok());
    if let Some(d) = since {
        let d = humantime::format_duration(Duration::from_secs(d.as_secs()));
        let _ = write!(out, ", for {d}");
    }
    let _ = write!(out, ", attempt {}, {} restart(s)", doc.attempt, doc.restarts);
    if let Some(l) = &doc.load {
        let _ = write!(out, "\nload: {}", safe(&l.text));
    }
    if let Some(f) = &doc.front {
        let listen: Vec<String> = f.listen.iter().map(|l| safe(l)).collect();
        let _ = write!(
            out,
            "\nfront door: clients connect to {}; the engine listens on {}; {} held, {} in flight",
            listen.join(", "),
            safe(&f.engine),
            f.held,
            f.in_flight
        );
    }
    if let Some(p) = &doc.progress {
        let _ = write!(out, "\nprogress: {}", safe(p));
    }
    if let Some(l) = &doc.last_load {
        let phases: Vec<String> = l.phases.iter().map(|(p, s)| format!("{} {s:.1}s", safe(p))).collect();
        let _ = write!(out, "\nlast load: {} after {:.1}s", safe(&l.outcome), l.total_secs);
        if !phases.is_empty() {
            let _ = write!(out, " ({})", phases.join(", "));
        }
        if let Some(c) = &l.cache {
            let _ = write!(out, "; compile cache: {}", safe(c));
        }
        if let Some(g) = l.gbps {
            let _ = write!(out, "; weights {g:.2} GB/s");
        }
        if let Some(r) = l.residency {
            let _ = write!(out, "; {:.0}% in the page cache", r.clamp(0.0, 1.0) * 100.0);
        }
        if let Some(g) = l.disk_gbps {
            let _ = write!(out, "; disk {g:.2} GB/s");
        }
        if let Some(e) = l.efficiency {
            let _ = write!(out, "; efficiency {e:.2}");
        }
        for a in &l.alarms {
            let _ = write!(out, "\nload alarm: {}", safe(a));
        }
    }
    let fitted: Vec<String> = doc
        .fit
        .iter()
        .filter(|(_, v)| v.source == "pinned" || v.source == "fitted")
        .map(|(a, v)| format!("--{} {} ({})", safe(a), safe(&v.value), safe(&v.source)))
        .collect();
    if !fitted.is_empty() {
        let _ = write!(out, "\nmemory fit: {}", fitted.join(", "));
    }
    if let Some(r) = &doc.last_reload {
        let _ = write!(out, "\nlast reload: {} at {}: {}", r.outcome.as_str(), safe(&r.at), safe(&r.summary));
        for p in &r.problems {
            let _ = write!(out, "\n  {}", safe(p));
        }
    }
    if let Some(r) = &doc.rollback {
        let _ = write!(
            out,
            "\nsetup: last-known-good {} from {}; the new setup {} failed: {}",
            safe(&r.good),
            safe(&r.good_at),
            safe(&r.failed),
            safe(&r.cause)
        );
    }
    if let Some(e) = &doc.last_exit {
        let how = match (&e.code, &e.signal) {
            (Some(c), _) => format!("exit code {c}"),
            (None, Some(s)) => format!("killed by {s}"),
            _ => "exited".into(),
        };
        let _ = write!(out, "\nlast exit: {how} at {}", e.at);
    }
    if let Some(c) = &doc.cause {
        let _ = write!(out, "\ncause: {}", safe(c));
    }
    if let Some(h) = &doc.hint {
        let _ = write!(out, "\nhint: {}", safe(h));
    }
    if let Some(f) = &doc.last_failure {
        let _ = write!(out, "\nlast failure ({}): {}", f.class.as_str(), safe(&f.cause));
        if let Some(r) = &f.report {
            let _ = write!(out, "\nreport: {}", safe(r));
        }
    }
    if let Some(g) = &doc.golden {
        let _ = write!(out, "\ngolden: {}", safe(&g.text));
    }
    if let Some(c) = &doc.cache {
        let _ = write!(out, "\ncache: {}", safe(&c.dir));
        if let (Some(bytes), Some(files), Some(at)) = (c.bytes, c.files, &c.measured_at) {
            let _ = write!(out, ", {} in {files} file(s) (measured {})", human_bytes(bytes), safe(at));
        }
    }
    out
}

/// `1.5 GiB`, `12.0 MiB`, `512 B`.
fn human_bytes(n: u64) -> String {
    const UNITS: [&str; 5] = ["KiB", "MiB", "GiB", "TiB", "PiB"];
    if n < 1024 {
        return format!("{n} B");
    }
    let (mut v, mut unit) = (n as f64 / 1024.0, UNITS[0]);
    for u in &UNITS[1..] {
        if v < 1024.0 {
            break;
        }
        v /= 1024.0;
        unit = u;
    }
    format!("{v:.1} {unit}")
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::BTreeMap;

    fn snap() -> Snapshot {
        Snapshot {
            fit: Default::default(),
            fit_moves: 0,
            setup: None,
            rolled_back: None,
            phase: Phase::Ready,
            child_pid: Some(42),
            attempt: 2,
            restarts: 1,
            starts: 2,
            progress: None,
            cause: None,
            hint: None,
            exits: 1,
            last_exit: Some(Exit::Code(1)),
            last_load: Some(Duration::from_millis(61_500)),
            failures: BTreeMap::from([(FailureClass::Exit, 1)]),
            exit_code: None,
            last_failure: None,
            load: None,
            last_load_record: None,
            loads_ended: 0,
            golden: None,
            golden_checks: 0,
            rechecks: 0,
            recheck_paused: Duration::ZERO,
            rechecking: None,
            idle_stops: 0,
            sleeps: 0,
            idle_eta: None,
        }
    }

    #[test]
    fn metrics_follow_the_textfile_format() {
        let text = metrics("kimi", &snap(), SystemTime::UNIX_EPOCH + Duration::from_secs(1_700_000_000), 7);
        for want in [
            "# TYPE vllm_warden_state gauge\n",
            "vllm_warden_state{name=\"kimi\",state=\"ready\"} 1\n",
            "vllm_warden_state{name=\"kimi\",state=\"starting\"} 0\n",
            "vllm_warden_ready{name=\"kimi\"} 1\n",
            "# TYPE vllm_warden_child_starts_total counter\nvllm_warden_child_starts_total{name=\"kimi\"} 2\n",
            "vllm_warden_failures_total{name=\"kimi\",class=\"exit\"} 1\n",
            "vllm_warden_failures_total{name=\"kimi\",class=\"permanent\"} 0\n",
            "vllm_warden_last_load_duration_seconds{name=\"kimi\"} 61.5\n",
            "vllm_warden_start_time_seconds{name=\"kimi\"} 1700000000.0\n",
            "vllm_warden_state{name=\"kimi\",state=\"draining\"} 0\n",
            "# TYPE vllm_warden_journal_dropped_lines_total counter\nvllm_warden_journal_dropped_lines_total{name=\"kimi\"} 7\n",
            "# TYPE vllm_warden_loop_turn_duration_seconds histogram\n",
        ] {
            assert!(text.contains(want), "{want} not in\n{text}");
        }
        // Every sample line belongs to a metric announced with HELP and TYPE
        // (a histogram's samples by its name and a suffix).
        for line in text.lines().filter(|l| !l.starts_with('#')) {
            let sample = line.split('{').next().unwrap();
            let histogram = ["_bucket", "_sum", "_count"]
                .iter()
                .filter_map(|s| sample.strip_suffix(s))
                .find(|base| text.contains(&format!("# TYPE {base} histogram\n")));
            let name = histogram.unwrap_or(sample);
            assert!(text.contains(&format!("# HELP {name} ")) && text.contains(&format!("# TYPE {name} ")), "{line}");
        }
    }

    #[test]
    fn the_document_is_rewritten_only_on_change_and_is_not_world_writable() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("status.json");
        let mut r = Reporter::new("kimi", &path, None, Outbox::direct());
        r.update(&snap());
        let doc: Doc = serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
        assert_eq!(doc.state, Phase::Ready);
        assert_eq!(doc.child_pid, Some(42));
        assert_eq!(doc.last_exit.as_ref().unwrap().code, Some(1));
        assert!(doc.ready_since.is_some());
        use std::os::unix::fs::{MetadataExt, PermissionsExt};
        assert_eq!(std::fs::metadata(&path).unwrap().permissions().mode() & 0o002, 0);
        let ino = std::fs::metadata(&path).unwrap().ino();
        r.update(&snap());
        assert_eq!(std::fs::metadata(&path).unwrap().ino(), ino, "unchanged: not rewritten");
    }

    /// A flood of progress lines is one write per [`PROGRESS_EVERY`]; a
    /// change of state is written at once, progress included.
    #[test]
    fn progress_alone_is_coalesced_and_a_change_of_state_is_written_at_once() {
        use std::os::unix::fs::MetadataExt;
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("status.json");
        let metrics_path = dir.path().join("metrics.prom");
        let mut r = Reporter::new("kimi", &path, Some(&metrics_path), Outbox::direct());
        let mut s = snap();
        s.phase = Phase::Starting;
        r.update(&s);
        assert_eq!(r.due(), None);
        let ino = std::fs::metadata(&path).unwrap().ino();
        for i in 0..1000 {
            s.progress = Some(format!("shard {i}"));
            r.update(&s);
        }
        assert_eq!(std::fs::metadata(&path).unwrap().ino(), ino, "not rewritten for each progress line");
        let due = r.due().expect("the latest progress waits");
        assert!(due <= std::time::Instant::now() + PROGRESS_EVERY);
        r.flush();
        assert_eq!(r.due(), None);
        let doc: Doc = serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
        assert_eq!(doc.progress.as_deref(), Some("shard 999"));
        // Right after a write, a progress line waits again; readiness does not.
        s.progress = Some("shard 1000".into());
        r.update(&s);
        assert!(r.due().is_some());
        s.phase = Phase::Ready;
        r.update(&s);
        assert_eq!(r.due(), None, "written at once");
        let doc: Doc = serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
        assert_eq!((doc.state, doc.progress.as_deref()), (Phase::Ready, Some("shard 1000")));
        // The journal's dropped lines reach the metrics at the next flush.
        r.set_journal_dropped(12);
        assert!(r.due().is_some());
        r.flush();
        let text = std::fs::read_to_string(&metrics_path).unwrap();
        assert!(text.contains("vllm_warden_journal_dropped_lines_total{name=\"kimi\"} 12\n"), "{text}");
    }

    /// The cache directory and its size, measured off the caller's thread
    /// when the server starts and when it is ready, reach the document
    /// and `status`.
    #[test]
    fn the_document_names_the_cache_directory_and_its_size() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("status.json");
        let cache = dir.path().join("cache");
        std::fs::create_dir_all(cache.join("vllm/torch_compile_cache")).unwrap();
        std::fs::write(cache.join("vllm/torch_compile_cache/a"), vec![7u8; 10_000]).unwrap();
        let mut r = Reporter::new("kimi", &path, None, Outbox::direct());
        r.set_cache_dir(Some(&cache));
        let read = || serde_json::from_str::<Doc>(&std::fs::read_to_string(&path).unwrap()).unwrap();
        let mut s = snap();
        s.phase = Phase::Starting;
        r.update(&s);
        r.meter.wait(Duration::from_secs(60));
        // A size that came after the write waits for the next one (one
        // that came before it is in it already).
        if read().cache.is_none_or(|c| c.bytes.is_none()) {
            assert!(r.due().is_some(), "a new size waits to be written");
        }
        r.flush();
        let c = read().cache.unwrap();
        assert_eq!((c.dir.as_str(), c.files), (cache.to_str().unwrap(), Some(1)));
        assert!(c.bytes.unwrap() >= 10_000 && c.measured_at.is_some(), "{c:?}");
        // The load wrote more: measured again at ready.
        std::fs::write(cache.join("vllm/torch_compile_cache/b"), vec![7u8; 10_000]).unwrap();
        r.update(&snap());
        r.meter.wait(Duration::from_secs(60));
        r.flush();
        let doc = read();
        assert_eq!(doc.cache.as_ref().unwrap().files, Some(2));
        let shown = summary(&StatusVerdict::Ready(doc));
        assert!(
            shown.contains(&format!("\ncache: {}, ", cache.display())) && shown.contains(" in 2 file(s) (measured "),
            "{shown}"
        );
        assert_eq!(human_bytes(1536), "1.5 KiB");
        assert_eq!(human_bytes(3 << 30), "3.0 GiB");
    }

    /// Issue "untrickable", case 1: escape sequences from a port holder's
    /// argv never reach the terminal through `status`.
    #[test]
    fn notify_injection_no_control_character_reaches_the_document_or_the_terminal() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("status.json");
        let mut r = Reporter::new("kimi", &path, None, Outbox::direct());
        let mut s = snap();
        s.phase = Phase::Starting;
        s.cause = Some("port 8000 is held by pid 9 (x\nREADY=1\n\x1b]0;pwned\x07)".into());
        r.update(&s);
        let doc: Doc = serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
        assert!(!doc.cause.as_deref().unwrap().chars().any(crate::util::escape::is_unsafe));
        let mut forged = doc.clone();
        forged.cause = Some("\x1b[2J\nfake line".into());
        let text = summary(&StatusVerdict::NotReady(forged));
        assert!(!text.lines().any(|l| l.chars().any(crate::util::escape::is_unsafe)), "{text:?}");
        assert!(text.contains("\\x1b[2J\\nfake line"), "{text}");
    }

    /// The load under way and the last load, in the document and in
    /// `status`; the cache's reason (from the child's log) made one line.
    #[test]
    fn the_document_and_status_show_the_load_and_the_last_load() {
        use crate::supervisor::load::{CacheOutcome, LoadNow, LoadOutcome, LoadPhase, LoadRecord, PhaseTime};
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("status.json");
        let mut r = Reporter::new("kimi", &path, None, Outbox::direct());
        let mut s = snap();
        s.phase = Phase::Starting;
        s.load = Some(LoadNow {
            phase: LoadPhase::Compile,
            index: 3,
            of: 7,
            elapsed: Duration::from_secs(130),
            began: tokio::time::Instant::now(),
            expected: Some(Duration::from_secs(290)),
            last: Some(Duration::from_secs(282)),
            fingerprint: "abc".into(),
            preload: None,
            median: Some(Duration::from_secs(290)),
            estimate: None,
            error: Some(0.04125),
            prefetch: None,
        });
        s.loads_ended = 1;
        s.last_load_record = Some(Arc::new(LoadRecord {
            fit: Default::default(),
            rollback: false,
            id: 4,
            at: String::new(),
            start: 1,
            outcome: LoadOutcome::Ready,
            total_secs: 61.25,
            phases: vec![PhaseTime { phase: LoadPhase::Start, secs: 20.5 }],
            cache: Some(CacheOutcome::LoadFailure { reason: "bad\nREADY=1".into() }),
            weights_bytes: None,
            weights_secs: None,
            gbps: Some(1.5),
            cold: Some(true),
            alarms: vec!["slow load: 1m01s against a median of 30s over 2 load(s) (2.0×)".into()],
            fingerprint: "abc".into(),
            setup: serde_json::Value::Null,
            boot: None,
            weights_id: None,
            estimates: vec![],
            residency: None,
            prefetch: None,
            efficiency: None,
        }));
        r.update(&s);
        let doc: Doc = serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
        let load = doc.load.as_ref().unwrap();
        assert_eq!((load.phase.as_str(), load.index, load.of, load.expected_secs), ("compile", 3, 7, Some(290.0)));
        assert_eq!(load.text, "loading 3/7 compile · 2m10s of ~4m50s ±4% (last 4m42s)");
        assert_eq!(load.expected_error, Some(0.041));
        let last = doc.last_load.as_ref().unwrap();
        assert_eq!(last.phases, [("start".to_string(), 20.5)]);
        let text = summary(&StatusVerdict::NotReady(doc.clone()));
        assert!(text.contains("\nload: loading 3/7 compile · 2m10s of ~4m50s ±4% (last 4m42s)"), "{text}");
        assert!(text.contains("\nlast load: ready after 61.2s (start 20.5s); compile cache: load-failure (bad\\nREADY=1); weights 1.50 GB/s"), "{text}");
        assert!(text.contains("\nload alarm: slow load: 1m01s"), "{text}");
        // The metrics count the load once.
        let m = Metrics::new("kimi", SystemTime::UNIX_EPOCH);
        m.set(&s, 0);
        m.set(&s, 0);
        let text = m.encode();
        assert!(text.contains("vllm_warden_load_alarms_total{name=\"kimi\",kind=\"slow-load\"} 1"), "{text}");
        assert!(
            text.contains("vllm_warden_load_cache_outcomes_total{name=\"kimi\",outcome=\"load-failure\"} 1"),
            "{text}"
        );
        assert!(text.contains("vllm_warden_last_load_weights_gigabytes_per_second{name=\"kimi\"} 1.5"), "{text}");
        assert!(text.contains("vllm_warden_last_load_weights_bytes_per_second{name=\"kimi\"} 1500000000.0"), "{text}");
        assert!(
            text.contains("vllm_warden_load_phase_duration_seconds_count{name=\"kimi\",phase=\"start\"} 1"),
            "{text}"
        );
    }

    /// Issue 47: the metrics an alert needs, in base units, from the
    /// snapshot; the load's gauges only during a load.
    #[test]
    fn the_metrics_an_alert_needs_follow_the_snapshot() {
        use crate::supervisor::load::{LoadNow, LoadPhase};
        let m = Metrics::new("kimi", SystemTime::UNIX_EPOCH);
        let mut s = snap();
        s.phase = Phase::Starting;
        s.load = Some(LoadNow {
            phase: LoadPhase::Weights,
            index: 2,
            of: 7,
            elapsed: Duration::from_secs(130),
            began: tokio::time::Instant::now() - Duration::from_secs(130),
            expected: Some(Duration::from_secs(300)), // the live estimate: not the metric
            last: None,
            fingerprint: "abc".into(),
            preload: None,
            median: Some(Duration::from_secs(290)),
            estimate: None,
            error: None,
            prefetch: None,
        });
        m.set(&s, 0);
        let text = m.encode();
        let value = |text: &str, sample: &str| -> f64 {
            let line = text.lines().find(|l| l.starts_with(sample)).unwrap_or_else(|| panic!("no {sample} in\n{text}"));
            line.rsplit(' ').next().unwrap().parse().unwrap()
        };
        assert!(
            text.contains(&format!(
                "vllm_warden_build_info{{name=\"kimi\",version=\"{}\"}} 1\n",
                env!("CARGO_PKG_VERSION")
            )),
            "{text}"
        );
        assert!((130.0..200.0).contains(&value(&text, "vllm_warden_load_elapsed_seconds{")), "{text}");
        assert_eq!(value(&text, "vllm_warden_load_expected_seconds{"), 290.0);
        assert_eq!(value(&text, "vllm_warden_load_phase{name=\"kimi\",phase=\"weights\"}"), 1.0);
        assert_eq!(value(&text, "vllm_warden_load_phase{name=\"kimi\",phase=\"start\"}"), 0.0);
        assert!(value(&text, "vllm_warden_last_failure_timestamp_seconds{") > 1.7e9, "the failure of the snapshot");
        assert_eq!(value(&text, "vllm_warden_health_check_failures_total{name=\"kimi\",check=\"progress\"}"), 0.0);
        assert_eq!(value(&text, "vllm_warden_gpu_release_wait_seconds{"), 0.0);
        assert_eq!(value(&text, "vllm_warden_draining{"), 0.0);
        assert_eq!(value(&text, "vllm_warden_gave_up{"), 0.0);
        // Out of the load, drained, after a changed golden answer, given up.
        s.load = None;
        s.phase = Phase::Drained;
        s.golden = Some(crate::supervisor::golden::Verdict::Failed { text: "no answer".into() });
        s.golden_checks = 1;
        s.exit_code = Some(crate::supervisor::exit::Code::GaveUp);
        m.set(&s, 0);
        let text = m.encode();
        assert!(!text.contains("vllm_warden_load_elapsed_seconds{"), "{text}");
        assert!(!text.contains("vllm_warden_load_expected_seconds{"), "{text}");
        assert_eq!(value(&text, "vllm_warden_load_phase{name=\"kimi\",phase=\"weights\"}"), 0.0);
        assert_eq!(value(&text, "vllm_warden_draining{"), 1.0);
        assert_eq!(value(&text, "vllm_warden_golden_last_verdict{name=\"kimi\",verdict=\"failed\"}"), 1.0);
        assert_eq!(value(&text, "vllm_warden_golden_last_verdict{name=\"kimi\",verdict=\"same\"}"), 0.0);
        assert_eq!(value(&text, "vllm_warden_gave_up{"), 1.0);
    }

    /// A reload that moves the files: the next update writes them at the
    /// new place, even when nothing else changed.
    #[test]
    fn moved_files_are_written_at_the_next_update_whatever_changed() {
        let dir = tempfile::tempdir().unwrap();
        let (old, new) = (dir.path().join("old.json"), dir.path().join("new.json"));
        let mut r = Reporter::new("kimi", &old, None, Outbox::direct());
        r.update(&snap());
        r.set_paths(&new, Some(&dir.path().join("new.prom")));
        r.update(&snap());
        let doc: Doc = serde_json::from_str(&std::fs::read_to_string(&new).unwrap()).unwrap();
        assert_eq!(doc.state, Phase::Ready);
        assert!(dir.path().join("new.prom").exists());
    }

    #[test]
    fn a_gone_warden_is_not_running() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("status.json");
        assert_eq!(read(&path), StatusVerdict::NotRunning(None));
        let mut doc = Reporter::new("kimi", &path, None, Outbox::direct()).doc(&snap());
        doc.warden_pid = u32::MAX - 1;
        std::fs::write(&path, serde_json::to_string(&doc).unwrap()).unwrap();
        assert!(matches!(read(&path), StatusVerdict::NotRunning(Some(_))));
        assert!(summary(&read(&path)).contains("not running (warden"));
    }
}
