//! What the machine acts on: the parts of the settings it needs, as a
//! [`Policy`], and the fixed graces and margins of its deadlines.

use std::time::Duration;

use nix::sys::signal::Signal;

use crate::config::Settings;

/// Before ready there is nothing to drain, and vLLM can lose a SIGTERM sent
/// during its load: the stop signal is repeated this often …
pub(crate) const LOAD_STOP_RESEND: Duration = Duration::from_secs(1);
/// … and SIGKILL follows after at most this long (or `stop-timeout`, if
/// shorter). The same short grace applies to what is left of a failed run.
pub(crate) const LOAD_STOP_GRACE: Duration = Duration::from_secs(10);
/// After SIGKILL, how long the tree gets to be gone. A process still there
/// is stuck in the kernel (state `D`; for a GPU server, usually the driver):
/// it is reported and the warden gives up on it.
pub const KILL_GRACE: Duration = Duration::from_secs(10);
/// How long the report of such survivors may take (reading `/proc` of a
/// process stuck in the kernel can hang too).
pub(crate) const DESCRIBE_GRACE: Duration = Duration::from_secs(5);
/// What the pre-start steps may take beyond their own waits (leftovers,
/// port, GPUs): patches, `/proc` scans, the GPU query's own time limit.
pub(crate) const PREPARE_MARGIN: Duration = Duration::from_secs(60);
/// How long one run of an external command (the GPU query) may take.
pub(crate) const COMMAND_TIMEOUT: Duration = Duration::from_secs(20);
/// What a failure report may take beyond `reports.timeout` (which bounds
/// its commands) before the machine stops waiting for it: its file writes.
pub(crate) const REPORT_MARGIN: Duration = Duration::from_secs(5);

/// The parts of the settings the machine acts on.
#[derive(Debug, Clone, PartialEq)]
pub struct Policy {
    /// Readiness waits for a `ready.log` line (else the HTTP check alone).
    pub(crate) ready_log: bool,
    /// Readiness waits for a 200 from `ready.http` after the line.
    pub(crate) ready_http: bool,
    pub(crate) ready_timeout: Duration,
    pub(crate) stall: Duration,
    /// After a fatal line, how long the child gets to exit on its own.
    pub(crate) grace: Duration,
    pub(crate) stop_signal: Signal,
    pub(crate) stop_timeout: Duration,
    /// How long the pre-start steps may take in all.
    pub(crate) prepare_timeout: Duration,
    pub(crate) restart: crate::config::Restart,
    /// A remedy line for known causes.
    pub(crate) hints: crate::supervisor::hints::Hints,
    /// A drain is unready at once, then waits this long before it looks
    /// at the requests in flight …
    pub(crate) drain_delay: Duration,
    /// … and at most this long for none to be running or waiting.
    pub(crate) drain_timeout: Duration,
    /// A stop, and a reload that restarts the child, drain a serving child
    /// first.
    pub(crate) drain_on_stop: bool,
    /// How long a failed run waits for its failure report before it is
    /// stopped; `None`: no reports.
    pub(crate) report: Option<Duration>,
    /// The profile tells a load's phases: `STATUS=` shows the phase and
    /// the estimate.
    pub(crate) phases: bool,
    /// `ledger.slow-factor` and `ledger.deadline-factor`.
    pub(crate) slow_factor: f64,
    pub(crate) deadline_factor: f64,
    /// The golden check before `READY=1`, and what a mismatch does; none:
    /// no check.
    pub(crate) golden: Option<crate::config::GoldenPolicy>,
    /// What the golden check may take (`golden.timeout`).
    pub(crate) golden_timeout: Duration,
    /// While serving, re-check the answers this often (`golden.interval`).
    pub(crate) golden_interval: Option<Duration>,
    /// Memory-fit recovery (`[fit]`), when on.
    pub(crate) fit: Option<crate::config::Fit>,
    /// Last-known-good rollback (`[rollback]`) is on.
    pub(crate) rollback: bool,
    /// What an engine without requests comes to (`front.idle-stop`); none:
    /// it serves for ever.
    pub(crate) idle: Option<IdlePolicy>,
}

/// `front.idle-stop`, `idle-action`, `idle-sleep-level`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct IdlePolicy {
    /// No request for this long, and none in flight: the engine is idle.
    pub(crate) after: Duration,
    /// Stopped, or put to sleep at `level`.
    pub(crate) action: crate::config::IdleAction,
    pub(crate) level: u8,
}

/// The pre-start steps' whole budget: stopping leftovers (stop timeout and
/// the kill grace), the port wait, the GPU wait and one more query, the
/// Ray cluster's wait and one more look, plus a margin for the rest.
pub(crate) fn prepare_timeout(s: &Settings) -> Duration {
    // The Ray gate's last look may start just before its wait ends.
    let ray = s
        .prestart
        .ray
        .as_ref()
        .filter(|c| c.gate)
        .map_or(Duration::ZERO, |c| c.wait.saturating_add(crate::config::defaults::RAY_STATUS_TIMEOUT));
    [
        s.child.stop_timeout,
        KILL_GRACE,
        s.prestart.port_wait,
        s.prestart.gpu_idle_wait,
        COMMAND_TIMEOUT,
        ray,
        // The weight-cache daemon's stop and load, each under its own limits.
        if s.preload.enabled { s.child.stop_timeout.saturating_add(s.ready.timeout) } else { Duration::ZERO },
        PREPARE_MARGIN,
    ]
    .into_iter()
    .fold(Duration::ZERO, Duration::saturating_add)
}

impl Policy {
    pub fn from_settings(s: &Settings) -> Policy {
        Policy {
            ready_log: !s.patterns.ready.is_empty(),
            ready_http: s.ready.http.is_some() || s.ready_by_ray().is_some(),
            ready_timeout: s.ready.timeout,
            stall: s.ready.stall,
            grace: s.fatal.grace,
            stop_signal: s.child.stop_signal,
            stop_timeout: s.child.stop_timeout,
            prepare_timeout: prepare_timeout(s),
            restart: s.restart.clone(),
            hints: crate::supervisor::hints::Hints::new(s.profile, &s.hints, &s.patches, &s.child.command),
            drain_delay: s.drain.delay,
            drain_timeout: s.drain.timeout,
            drain_on_stop: s.drain.on_stop,
            report: (s.reports.keep > 0).then(|| s.reports.timeout.saturating_add(REPORT_MARGIN)),
            phases: !s.patterns.load.is_empty(),
            slow_factor: s.ledger.slow_factor,
            deadline_factor: s.ledger.deadline_factor,
            golden: s.golden.enabled.then_some(s.golden.on_mismatch),
            golden_timeout: s.golden.timeout,
            golden_interval: (!s.golden.interval.is_zero()).then_some(s.golden.interval),
            fit: s.fit.enabled.then(|| s.fit.clone()),
            rollback: s.rollback.enabled,
            idle: s.front.as_ref().and_then(|f| {
                f.idle_stop.map(|after| IdlePolicy { after, action: f.idle_action, level: f.idle_sleep_level })
            }),
        }
    }

    /// The delay before attempt `n + 1`, after `n` consecutive failures,
    /// before jitter: `initial × factor^(n-1)`, capped.
    pub(crate) fn backoff(&self, n: u32) -> Duration {
        let exp = self.restart.factor.powi(n.saturating_sub(1).min(1000) as i32);
        let secs = (self.restart.initial_delay.as_secs_f64() * exp).min(self.restart.max_delay.as_secs_f64());
        Duration::from_secs_f64(secs.max(0.0))
    }
}
