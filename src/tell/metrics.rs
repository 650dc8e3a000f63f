//! The Prometheus metrics: one registry, served by `GET /metrics` and
//! written to the textfile-collector file (`status.metrics-file`) by the
//! status reporter ([`crate::tell::status::Reporter`]); set from the
//! supervisor's [`Snapshot`] and from what only the tasks off the loop know
//! ([`crate::observe::facts`]).

use std::sync::atomic::AtomicU64;
use std::time::{Duration, SystemTime};

use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{Histogram, exponential_buckets};
use prometheus_client::registry::{Registry, Unit};

use crate::supervisor::outcome::{FailureClass, Phase, RestartReason};
use crate::supervisor::snapshot::Snapshot;

/// The warden's metrics: one registry (`prometheus-client`), served by
/// `GET /metrics` and written to the textfile-collector file, in the
/// Prometheus text format (0.0.4), names prefixed `vllm_warden_`, each with
/// `# HELP` and `# TYPE`, every sample labelled with the instance's `name`.
pub(crate) struct Metrics {
    registry: Registry,
    state: Family<Vec<(String, String)>, Gauge>,
    ready: Gauge,
    child_starts: Counter,
    /// Spawns after the first, by why (`reason`).
    restarts: Family<Vec<(String, String)>, Counter>,
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
    pub(crate) front: FrontMetrics,
}

/// What the front door counts: requests by outcome (one request may count
/// under several: held, then forwarded), how long requests were held, and
/// the requests held and forwarded now.
pub(crate) struct FrontMetrics {
    requests: Family<Vec<(String, String)>, Counter>,
    held_seconds: Histogram,
    in_flight: Gauge,
    held: Gauge,
}

/// The outcomes of `front_requests_total`.
pub(crate) const FRONT_OUTCOMES: [&str; 5] = ["forwarded", "held", "rejected", "upstream_error", "retried"];

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
    pub(crate) fn count(&self, outcome: &str) {
        self.requests.get_or_create(&vec![("outcome".into(), outcome.into())]).inc();
    }

    pub(crate) fn held_for(&self, d: Duration) {
        self.held_seconds.observe(d.as_secs_f64());
    }

    pub(crate) fn set_in_flight(&self, n: usize) {
        self.in_flight.set(i64::try_from(n).unwrap_or(i64::MAX));
    }

    pub(crate) fn set_held(&self, n: usize) {
        self.held.set(i64::try_from(n).unwrap_or(i64::MAX));
    }

    /// Requests held and in flight now, as the gauges say (live: set by
    /// the front door at each change).
    pub(crate) fn now(&self) -> (usize, usize) {
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
    pub(crate) fn new(name: &str, started: SystemTime) -> Metrics {
        let labels = [(std::borrow::Cow::Borrowed("name"), std::borrow::Cow::Owned(name.to_string()))];
        let mut registry = Registry::with_prefix_and_labels("vllm_warden", labels.into_iter());
        let m = Metrics {
            registry: Registry::default(),
            state: Family::default(),
            ready: Gauge::default(),
            child_starts: Counter::default(),
            restarts: Family::default(),
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
        // Every reason from 0, so that the first of each is an increase.
        for &r in RestartReason::ALL {
            let _ = m.restarts.get_or_create(&vec![("reason".into(), r.as_str().into())]);
        }
        registry.register("state", "1 for the state the warden is in, 0 for the others", m.state.clone());
        registry.register("ready", "1 when the model is serving", m.ready.clone());
        registry.register("child_starts", "Children spawned", m.child_starts.clone());
        registry.register(
            "restarts",
            "Spawns after the first, by why: failure, restart (asked for), reload, wake (idle), fit, rollback",
            m.restarts.clone(),
        );
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

    /// Failed runs counted before this warden (handed over by an upgrade:
    /// `seen` of them), and when the last was counted, if known: the
    /// timestamp stays what it was.
    pub(crate) fn resume_failures(&self, seen: u64, at: Option<f64>) {
        self.failures_seen.store(seen, std::sync::atomic::Ordering::Relaxed);
        if let Some(at) = at {
            self.last_failure_at.get_or_create(&vec![]).set(at);
        }
    }

    /// When the last failed run was counted, in seconds since the epoch.
    pub(crate) fn last_failure_at(&self) -> Option<f64> {
        // The family holds one unlabelled sample once a failure was counted.
        self.last_failure_at.get(&vec![]).map(|g| g.get())
    }

    /// Bring every metric to what `snap` says.
    pub(crate) fn set(&self, snap: &Snapshot, journal_dropped: u64) {
        for &p in Phase::ALL {
            let v = i64::from(p == snap.phase);
            self.state.get_or_create(&vec![("state".into(), p.as_str().into())]).set(v);
        }
        self.ready.set(i64::from(snap.phase == Phase::Ready));
        raise(&self.child_starts, snap.starts.into());
        for &r in RestartReason::ALL {
            let n = snap.restarts_by.get(&r).copied().unwrap_or(0);
            raise(&self.restarts.get_or_create(&vec![("reason".into(), r.as_str().into())]), n.into());
        }
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
    pub(crate) fn reloaded(&self, ok: bool, at: SystemTime) {
        self.reload_ok.set(i64::from(ok));
        if ok {
            self.reload_ok_at.set(at.duration_since(SystemTime::UNIX_EPOCH).unwrap_or_default().as_secs_f64());
        }
    }

    /// The exposition text.
    /// One turn of the driver's loop took `took`.
    pub(crate) fn loop_turn(&self, took: Duration) {
        self.loop_turn.observe(took.as_secs_f64());
    }

    pub(crate) fn encode(&self) -> String {
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
fn raise(c: &Counter, total: u64) {
    let now = c.get();
    if total > now {
        c.inc_by(total - now);
    }
}

/// The metrics of `snap` as text, from a registry of their own.
#[cfg(test)]
pub(crate) fn metrics(name: &str, snap: &Snapshot, started: SystemTime, journal_dropped: u64) -> String {
    let m = Metrics::new(name, started);
    m.set(snap, journal_dropped);
    m.encode()
}
