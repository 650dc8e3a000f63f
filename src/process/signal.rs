//! The core's signals and the operating system's: a stop's signal is sent
//! as nix's, and a process ended by one is told to the core by its number.

use nix::sys::signal::Signal as Os;

use crate::supervisor::Signal;

/// The core's name for an operating system's signal.
pub fn core(s: Os) -> Signal {
    Signal::from_number(s as i32).expect("every signal nix names is one of Linux's standard signals")
}

/// The operating system's signal the core names.
pub fn os(s: Signal) -> Os {
    Os::try_from(s.number()).expect("the core names only Linux's standard signals")
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The core's table of signals is the operating system's: every signal
    /// has the same number and name on both sides.
    #[test]
    fn the_cores_signals_are_the_systems() {
        for s in Os::iterator() {
            assert_eq!(core(s).as_str(), s.as_str(), "{s:?}");
            assert_eq!(os(core(s)), s);
        }
        for n in 1..=31 {
            assert_eq!(Signal::from_number(n).map(os).map(|s| s as i32), Some(n));
        }
        assert_eq!(Signal::from_number(0), None);
        assert_eq!(Signal::from_number(34), None);
    }
}
