//! An upgrade in place, as the machine decides it: asked for, the new
//! binary checked, then held until there is a run to hand over (ready, no
//! fatal line waiting for its grace, no drain under way that ends in a
//! restart, a reload or a stop), the run's lines paused at a line's end,
//! the exec with their offset; the lines followed again when the exec
//! fails or the run stopped being one to hand over. The driver carries
//! the effects out through its `Upgrade` port.
//!
//! ```text
//!   Requested ─▶ CheckUpgrade ─Checked(err)─▶ said (journal, STATUS=)
//!                     │ Checked(ok)
//!                     ▼       a run to hand over
//!                  Waiting ────────────────────▶ Pausing ─LinesPaused(err)─▶ given up
//!                     ▲ ◀── not one any more ─────┘  │        (ResumeLines)
//!                     │     (ResumeLines)            │ LinesPaused(offset):
//!                     └──── a drain under way ───────┤ not one (ResumeLines)
//!                                                    │ the run failing: given up
//!                                                    │ still one: ExecUpgrade
//!                                                    ▼
//!                                                  Exec ─ExecFailed─▶ over (ResumeLines)
//! ```

use super::*;
use crate::events::Upgrade;

/// An upgrade asked for and its binary checked (to `version`): how far its
/// hand-over has gone.
#[derive(Debug, Clone, PartialEq)]
pub(super) enum Handover {
    /// Waiting for a run to hand over.
    Waiting { version: String },
    /// The lines asked to stop (`Effect::PauseLines`); `LinesPaused` follows.
    Pausing { version: String },
    /// The exec asked for, with the lines from `offset`; it returns only
    /// when it fails.
    Exec { version: String, offset: u64 },
}

impl Handover {
    fn version(self) -> String {
        match self {
            Handover::Waiting { version } | Handover::Pausing { version } | Handover::Exec { version, .. } => version,
        }
    }
}

/// A drain in `state` that has not yet ended in what it is for (held
/// drained, a restart, a reload, a stop).
pub(super) fn drain_under_way(state: &State) -> bool {
    let State::Ready(serving) = state else { return false };
    serving.drain.is_some_and(|d| !(d.for_ == DrainFor::Hold && d.stage == DrainStage::Drained))
}

impl Machine {
    /// The ready run of `state` as a successor takes it over; `None` when
    /// there is none to hand over (see [`Machine::save`]).
    pub(super) fn save_of(&self, state: &State, now: Instant) -> Option<Saved> {
        let State::Ready(serving) = state else { return None };
        if serving.run.fatal_at.is_some() || drain_under_way(state) {
            return None;
        }
        Some(Saved {
            start: serving.run.start,
            pid: serving.run.pid,
            ready_for: now - serving.ready_at,
            running_for: now - serving.run.spawned_at,
            starts: self.starts,
            failures: self.failures,
            restarts: self.restarts,
            restarts_by: self.restarts_by.clone(),
            exits: self.exits,
            last_load: self.last_load,
            failure_counts: self.failure_counts.clone(),
            last_failure: self.last_failure.clone(),
            drained: serving.drain.is_some(),
            last_load_record: self.last_load_record.as_deref().cloned(),
            golden: self.last_golden.clone(),
        })
    }

    /// What an upgrade's news does in `state` (any state but the end).
    pub(super) fn upgrade_event(&mut self, state: State, u: Upgrade, now: Instant) -> (State, Vec<Effect>) {
        let fx = match u {
            Upgrade::Requested => {
                vec![say(Severity::Info, "upgrade asked for: checking the binary".into()), Effect::CheckUpgrade]
            }
            Upgrade::Checked(Err(why)) => {
                let text = format!("upgrade refused: {why}");
                // Shown by `systemctl status` until the next change of state.
                vec![say(Severity::Error, text.clone()), Effect::Notify(vec![status(text)])]
            }
            Upgrade::Checked(Ok(version)) => {
                let mut fx = vec![];
                if self.save_of(&state, now).is_none() {
                    let until = if drain_under_way(&state) { "the drain ends" } else { "the model is ready" };
                    fx.push(say(Severity::Info, format!("upgrade to {version} waits until {until}")));
                }
                self.upgrade = Some(match self.upgrade.take() {
                    // The hand-over under way goes on, to the binary as it is now.
                    Some(Handover::Pausing { .. }) => Handover::Pausing { version },
                    Some(Handover::Exec { offset, .. }) => Handover::Exec { version, offset },
                    Some(Handover::Waiting { .. }) | None => Handover::Waiting { version },
                });
                fx
            }
            Upgrade::LinesPaused(Err(why)) => {
                // Nothing to hand over: this warden keeps the run.
                self.upgrade = None;
                vec![say(Severity::Error, format!("upgrade given up: {why}")), Effect::ResumeLines { offset: None }]
            }
            Upgrade::LinesPaused(Ok(offset)) => self.lines_paused(&state, offset, now),
            Upgrade::ExecFailed(why) => {
                let offset = match self.upgrade.take() {
                    Some(Handover::Exec { offset, .. }) => Some(offset),
                    other => {
                        self.upgrade = other;
                        None
                    }
                };
                let text = format!("upgrade failed, this warden goes on: {why}");
                vec![say(Severity::Error, text), Effect::ResumeLines { offset }]
            }
        };
        (state, fx)
    }

    /// The run's lines are paused at `offset`, those before it taken in:
    /// the exec, if the run is still one to hand over; else they are
    /// followed again, and the upgrade waits for a drain under way or is
    /// given up.
    fn lines_paused(&mut self, state: &State, offset: u64, now: Instant) -> Vec<Effect> {
        let Some(version) = self.upgrade.take().map(Handover::version) else {
            return vec![Effect::ResumeLines { offset: Some(offset) }];
        };
        if let Some(saved) = self.save_of(state, now) {
            let text = format!("upgrading to {version}: handing pid {} over", saved.pid);
            self.upgrade = Some(Handover::Exec { version, offset });
            return vec![say(Severity::Info, text), Effect::ExecUpgrade { saved: Box::new(saved), offset }];
        }
        let said = if drain_under_way(state) {
            // A drain began with the lines just read: waited for.
            let text = format!("upgrade to {version} waits until the drain ends");
            self.upgrade = Some(Handover::Waiting { version });
            say(Severity::Info, text)
        } else {
            say(Severity::Warn, "upgrade given up: the run is failing".into())
        };
        vec![said, Effect::ResumeLines { offset: Some(offset) }]
    }

    /// After each event: an upgrade waiting whose run can now be handed
    /// over has its lines paused; one pausing whose run stopped being one
    /// to hand over waits again.
    pub(super) fn upgrade_due(&mut self, now: Instant, fx: &mut Vec<Effect>) {
        let handable = self.save_of(&self.state, now).is_some();
        self.upgrade = match self.upgrade.take() {
            Some(Handover::Waiting { version }) if handable => {
                fx.push(Effect::PauseLines);
                Some(Handover::Pausing { version })
            }
            Some(Handover::Pausing { version }) if !handable => {
                fx.push(Effect::ResumeLines { offset: None });
                Some(Handover::Waiting { version })
            }
            other => other,
        };
    }
}

fn say(severity: Severity, text: String) -> Effect {
    record(severity, Topic::Upgrade, text)
}
