//! What an operator asks of a running warden through its endpoint
//! (`POST /drain`, `/undrain`, `/restart`), as the machine takes it: which
//! phases it applies to, when there is nothing to do, and which phase
//! shows it taken. The endpoint answers by this rule (409, 200 or 202) and
//! the machine's tests hold the machine to it, so it is written once.

use crate::events::Event;
use crate::outcome::Phase;

/// A change asked through the endpoint.
#[derive(Debug, Clone, Copy, PartialEq, Eq, strum::VariantArray, strum::IntoStaticStr)]
#[strum(serialize_all = "lowercase")]
pub enum Control {
    /// Out of rotation, and held there.
    Drain,
    /// Back into rotation.
    Undrain,
    /// Drain, then start the child again.
    Restart,
}

impl Control {
    pub const ALL: &[Control] = <Control as strum::VariantArray>::VARIANTS;

    /// `drain`, as the route and the answers name it.
    pub fn as_str(self) -> &'static str {
        self.into()
    }

    /// The machine's event for it.
    pub fn event(self) -> Event {
        match self {
            Control::Drain => Event::DrainRequested,
            Control::Undrain => Event::UndrainRequested,
            Control::Restart => Event::RestartRequested,
        }
    }

    /// Whether a warden in `phase` takes it; else it is refused: a drain
    /// or an undrain when nothing serves, anything while a stop (or a
    /// failed run's) is under way or the warden has stopped. A restart of
    /// an idle engine starts it.
    pub fn applies(self, phase: Phase) -> bool {
        use Phase::*;
        match self {
            Control::Drain | Control::Undrain => matches!(phase, Ready | Rechecking | Draining | Drained),
            Control::Restart => matches!(phase, Starting | Ready | Rechecking | Draining | Drained | Backoff | Idle),
        }
    }

    /// Whether it is so already in `phase`: answered at once, and the
    /// machine not asked.
    pub fn already(self, phase: Phase) -> bool {
        matches!(
            (self, phase),
            (Control::Drain, Phase::Draining | Phase::Drained) | (Control::Undrain, Phase::Ready | Phase::Rechecking)
        )
    }

    /// Whether the phase `now`, after `before`, shows it taken.
    pub fn taken(self, before: Phase, now: Phase) -> bool {
        use Phase::*;
        match self {
            Control::Drain => matches!(now, Draining | Drained),
            Control::Undrain => !matches!(now, Draining | Drained),
            // A restart from a serving child drains it first; one asked
            // while draining changes only what the drain ends in, and one
            // during a load stops it (the phase stays `starting`).
            Control::Restart => now != before || matches!(before, Starting | Draining),
        }
    }
}
