//! tokio's clock and the core's instants: the daemon reads the time from
//! tokio (whose clock its tests pause) and gives it to the core as the
//! core's own [`Instant`]; a deadline the core computes is slept on as
//! tokio's.

use vllm_warden_core::Instant;

/// A tokio instant as the core's.
pub(crate) trait ToCore {
    fn to_core(self) -> Instant;
}

impl ToCore for tokio::time::Instant {
    fn to_core(self) -> Instant {
        Instant::from_std(self.into_std())
    }
}

/// The core's instant as tokio's, to sleep until it.
pub(crate) fn to_tokio(t: Instant) -> tokio::time::Instant {
    tokio::time::Instant::from_std(t.into_std())
}

/// The present, as the core takes it.
pub fn now() -> Instant {
    tokio::time::Instant::now().to_core()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Paused, tokio's clock moves the core's with it, and back.
    #[tokio::test(start_paused = true)]
    async fn a_paused_clock_is_the_cores_clock() {
        let before = now();
        tokio::time::advance(std::time::Duration::from_secs(3600)).await;
        let after = now();
        assert_eq!(after - before, std::time::Duration::from_secs(3600));
        assert_eq!(to_tokio(after).to_core(), after);
        assert_eq!(to_tokio(after), tokio::time::Instant::now());
    }
}
