//! The machine's [`Policy`], built from the settings: the core takes the
//! parts it acts on in its own vocabulary, never the settings themselves.

use std::time::Duration;

use crate::config::{Settings, defaults};
use crate::supervisor::hints::Hints;
use crate::supervisor::policy::{COMMAND_TIMEOUT, IdlePolicy, KILL_GRACE, PREPARE_MARGIN, Policy, REPORT_MARGIN};

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
        .map_or(Duration::ZERO, |c| c.wait.saturating_add(defaults::RAY_STATUS_TIMEOUT));
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

/// The policy of these settings.
pub fn policy(s: &Settings) -> Policy {
    let patched = s.patches.iter().map(|p| (p.file.clone(), p.what())).collect();
    Policy {
        ready_log: !s.patterns.ready.is_empty(),
        ready_http: s.ready.http.is_some() || s.ready_by_ray().is_some(),
        ready_timeout: s.ready.timeout,
        stall: s.ready.stall,
        grace: s.fatal.grace,
        stop_signal: crate::process::signal::core(s.child.stop_signal),
        stop_timeout: s.child.stop_timeout,
        prepare_timeout: prepare_timeout(s),
        restart: s.restart.clone(),
        hints: Hints::new(s.profile, &s.hints, patched, &s.child.command),
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
