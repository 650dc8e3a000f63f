//! Re-checks of a serving model's answers: out of rotation (the phase
//! `rechecking`, `/readyz` 503), the golden check asked again, back in
//! rotation when the answers are the same, a failed run when they differ
//! or do not come. Whatever calls for one sends [`Event::Recheck`]: a GPU
//! fault that did not end the run, an upgrade of the warden,
//! `golden.interval`, a wake from sleep. Also here: the OOM killer's note
//! on a run, which becomes its cause.

use super::*;
use crate::golden::Verdict;

/// What the machine keeps of re-checks.
#[derive(Debug, Default)]
pub(super) struct Rechecks {
    /// Re-checks over, and the time out of rotation they took in all.
    pub(super) count: u32,
    pub(super) paused: Duration,
    /// When the next `golden.interval` re-check is due.
    pub(super) due: Option<Instant>,
    /// This run's check was skipped (the model has no completions API):
    /// there is nothing to ask again.
    pub(super) skipped: bool,
    /// This run became ready with changed answers and a warning
    /// (`golden.on-mismatch = "warn"`): no reference is its own, so a
    /// re-check can only tell that it still answers.
    pub(super) unproven: bool,
}

impl Rechecks {
    /// The run is (back) in rotation: the next interval counts from now.
    pub(super) fn ready(&mut self, policy: &Policy, now: Instant) {
        self.due = policy.golden_interval.filter(|_| policy.golden.is_some()).map(|i| now + i);
    }
}

/// `d` as the journal gives a pause: seconds with a tenth.
fn pause(d: Duration) -> String {
    format!("{:.1} s", d.as_secs_f64())
}

/// The kernel's OOM killer ended a process of `run`: the run's cause from
/// now on (the first such kill).
pub(super) fn oom_noted(run: &mut Run, cause: String) -> Vec<Effect> {
    if run.oom.is_some() {
        return vec![];
    }
    run.oom = Some(cause.clone());
    vec![record(Severity::Error, Topic::Fatal, cause)]
}

impl Machine {
    /// When a serving run wants a `Tick` for its answers: the end of the
    /// re-check under way (its own timeout comes first), or the next
    /// `golden.interval` (not while a drain holds it out of rotation).
    pub(super) fn recheck_deadline(&self, s: &Serving) -> Option<Instant> {
        match &s.recheck {
            Some(r) => Some(r.began + self.policy.golden_timeout.saturating_add(GOLDEN_MARGIN)),
            None => self.rechecks.due.filter(|_| s.drain.is_none()),
        }
    }

    /// Take the serving run out of rotation and ask its golden answers
    /// again, for `reason`.
    pub(super) fn recheck(&mut self, mut serving: Serving, reason: String, now: Instant) -> (State, Vec<Effect>) {
        if self.policy.golden.is_none() || self.rechecks.skipped {
            let why = if self.rechecks.skipped { "the model has no completions API" } else { "golden.enabled is off" };
            let text = format!("{reason}: the answers are not checked again ({why})");
            return (State::Ready(serving), vec![record(Severity::Warn, Topic::Golden, text)]);
        }
        match (&mut serving.recheck, serving.drain) {
            // Asked again once the check under way is over.
            (Some(r), _) => {
                r.again.get_or_insert(reason);
                return (State::Ready(serving), vec![]);
            }
            // The run is being stopped already (a fatal line waits for its
            // grace, or a drain ends in a restart, a reload or a stop).
            (None, Some(d)) if d.for_ != DrainFor::Hold => return (State::Ready(serving), vec![]),
            _ if serving.run.fatal_at.is_some() => return (State::Ready(serving), vec![]),
            _ => {}
        }
        self.rechecks.due = None;
        let text = format!(
            "rechecking pid {}: out of rotation while the golden answers are asked again ({reason})",
            serving.run.pid
        );
        serving.recheck = Some(Recheck { reason, began: now, again: None });
        let fx = vec![
            record(Severity::Info, Topic::Golden, text.clone()),
            Effect::Notify(vec![status(text)]),
            Effect::Golden { start: serving.run.start },
        ];
        (State::Ready(serving), fx)
    }

    /// A re-check is over: back in rotation, or the run fails.
    pub(super) fn rechecked(&mut self, mut serving: Serving, verdict: Verdict, now: Instant) -> (State, Vec<Effect>) {
        let Some(r) = serving.recheck.take() else { return (State::Ready(serving), vec![]) };
        let text = verdict.text();
        self.last_golden = Some(verdict.clone());
        self.golden_checks += 1;
        let out = now.saturating_duration_since(r.began);
        self.rechecks.count += 1;
        self.rechecks.paused += out;
        let after = format!("re-checked after {}", r.reason);
        let fail = self.policy.golden == Some(crate::policy::GoldenPolicy::Fail);
        let (cause, warn) = match &verdict {
            Verdict::Same { .. } | Verdict::Recorded { .. } | Verdict::Skipped { .. } => (None, false),
            Verdict::Unrecorded { .. } => (None, true),
            // Its answers were never its reference's: it still answers.
            Verdict::Changed { .. } if self.rechecks.unproven => (None, true),
            // The setup is the one that was ready; its answers are not.
            Verdict::Changed { .. } => (
                Some(Cause {
                    text: format!("{after}: {text}"),
                    kind: FailureKind::WrongAnswers,
                    permanence: Permanence::Answers,
                    hint: None,
                }),
                false,
            ),
            Verdict::NoAnswer { .. } => (Some(Cause::new(format!("{after}: {text}"), FailureKind::NoAnswer)), false),
            Verdict::Failed { .. } if fail => {
                (Some(Cause::new(format!("{after}: {text}"), FailureKind::Health)), false)
            }
            Verdict::Failed { .. } => (None, true),
        };
        if let Some(cause) = cause {
            let mut fx = vec![record(Severity::Error, Topic::GoldenMismatch, cause.text.clone())];
            let (next, more) = self.fail(State::Ready(serving), cause, None, now);
            fx.extend(more);
            return (next, fx);
        }
        // A drain held meanwhile keeps it out of rotation.
        let (said, now_is) = match &serving.drain {
            Some(d) => (format!("{after}: {text} (checked in {})", pause(out)), self.drain_text(&serving, d)),
            None => (
                format!("{after}: {text}; back in rotation after {} out of it", pause(out)),
                format!("ready: pid {}", serving.run.pid),
            ),
        };
        let (severity, shown) = if warn {
            (Severity::Warn, format!("{now_is}; WARNING: {said}"))
        } else {
            (Severity::Info, format!("{now_is}; {said}"))
        };
        let mut fx = vec![record(severity, Topic::Golden, said), Effect::Notify(vec![status(shown)])];
        self.rechecks.ready(&self.policy, now);
        if let Some(again) = r.again {
            let (next, more) = self.recheck(serving, again, now);
            fx.extend(more);
            return (next, fx);
        }
        (State::Ready(serving), fx)
    }

    /// A serving run's deadlines: a re-check that got no answer in time,
    /// the next `golden.interval`, then the drain's.
    pub(super) fn recheck_tick(&mut self, serving: Serving, now: Instant) -> (State, Vec<Effect>) {
        match &serving.recheck {
            Some(r) if now >= r.began + self.policy.golden_timeout.saturating_add(GOLDEN_MARGIN) => {
                let text = format!(
                    "re-checked after {}: golden check: no answer: nothing within {}",
                    r.reason,
                    secs(self.policy.golden_timeout)
                );
                let mut fx = vec![record(Severity::Error, Topic::GoldenMismatch, text.clone())];
                let (next, more) = self.fail(State::Ready(serving), Cause::new(text, FailureKind::NoAnswer), None, now);
                fx.extend(more);
                (next, fx)
            }
            None if serving.drain.is_none() && self.rechecks.due.is_some_and(|t| now >= t) => {
                self.recheck(serving, "golden.interval".into(), now)
            }
            _ => self.drain_tick(serving, now),
        }
    }
}
