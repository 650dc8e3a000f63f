//! The core's own point in time. It has no `now()`: the machine never
//! reads a clock, the daemon passes the time in (from tokio's clock, which
//! its tests pause), so every deadline the core computes is a function of
//! the events and the times it was given.

use std::ops::{Add, AddAssign, Sub};
use std::time::Duration;

/// A point on the monotonic clock, as the daemon read it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Instant(std::time::Instant);

impl Instant {
    /// The point the daemon's clock gave.
    pub fn from_std(t: std::time::Instant) -> Instant {
        Instant(t)
    }

    /// Back to the clock's own type, for a timer.
    pub fn into_std(self) -> std::time::Instant {
        self.0
    }

    /// How long after `earlier` this is; zero when it is not after it.
    pub(crate) fn saturating_duration_since(self, earlier: Instant) -> Duration {
        self.0.saturating_duration_since(earlier.0)
    }

    pub(crate) fn checked_sub(self, d: Duration) -> Option<Instant> {
        self.0.checked_sub(d).map(Instant)
    }
}

/// The clock's present, for the core's own tests only: what they give the
/// machine is then offsets from one such point.
#[cfg(test)]
impl Instant {
    pub(crate) fn now() -> Instant {
        Instant(std::time::Instant::now())
    }
}

impl Add<Duration> for Instant {
    type Output = Instant;
    fn add(self, d: Duration) -> Instant {
        Instant(self.0 + d)
    }
}

impl AddAssign<Duration> for Instant {
    fn add_assign(&mut self, d: Duration) {
        self.0 += d;
    }
}

impl Sub<Duration> for Instant {
    type Output = Instant;
    fn sub(self, d: Duration) -> Instant {
        Instant(self.0 - d)
    }
}

/// As tokio's: how long after `other` this is, zero when not after it.
impl Sub<Instant> for Instant {
    type Output = Duration;
    fn sub(self, other: Instant) -> Duration {
        self.saturating_duration_since(other)
    }
}
