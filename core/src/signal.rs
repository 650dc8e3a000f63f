//! A signal, as the core speaks of it: the one a stop sends, and the one
//! that ended a process. The daemon makes it from the operating system's
//! (its number and name) and turns it back into one to send.

use std::fmt;

/// A signal by its number and its name (`SIGTERM`).
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub struct Signal {
    number: i32,
    name: &'static str,
}

/// Linux's signals by number (`signal(7)`; the daemon's test holds this
/// table to the operating system's).
const SIGNALS: [Signal; 31] = [
    Signal::new(1, "SIGHUP"),
    Signal::new(2, "SIGINT"),
    Signal::new(3, "SIGQUIT"),
    Signal::new(4, "SIGILL"),
    Signal::new(5, "SIGTRAP"),
    Signal::new(6, "SIGABRT"),
    Signal::new(7, "SIGBUS"),
    Signal::new(8, "SIGFPE"),
    Signal::new(9, "SIGKILL"),
    Signal::new(10, "SIGUSR1"),
    Signal::new(11, "SIGSEGV"),
    Signal::new(12, "SIGUSR2"),
    Signal::new(13, "SIGPIPE"),
    Signal::new(14, "SIGALRM"),
    Signal::new(15, "SIGTERM"),
    Signal::new(16, "SIGSTKFLT"),
    Signal::new(17, "SIGCHLD"),
    Signal::new(18, "SIGCONT"),
    Signal::new(19, "SIGSTOP"),
    Signal::new(20, "SIGTSTP"),
    Signal::new(21, "SIGTTIN"),
    Signal::new(22, "SIGTTOU"),
    Signal::new(23, "SIGURG"),
    Signal::new(24, "SIGXCPU"),
    Signal::new(25, "SIGXFSZ"),
    Signal::new(26, "SIGVTALRM"),
    Signal::new(27, "SIGPROF"),
    Signal::new(28, "SIGWINCH"),
    Signal::new(29, "SIGIO"),
    Signal::new(30, "SIGPWR"),
    Signal::new(31, "SIGSYS"),
];

impl Signal {
    pub const SIGILL: Signal = SIGNALS[3];
    pub(crate) const SIGABRT: Signal = SIGNALS[5];
    pub(crate) const SIGBUS: Signal = SIGNALS[6];
    pub(crate) const SIGFPE: Signal = SIGNALS[7];
    pub const SIGKILL: Signal = SIGNALS[8];
    pub(crate) const SIGSEGV: Signal = SIGNALS[10];
    pub const SIGTERM: Signal = SIGNALS[14];

    const fn new(number: i32, name: &'static str) -> Signal {
        Signal { number, name }
    }

    /// The signal of this number; none for a number Linux gives no
    /// standard signal (a real-time one, or nonsense from a log line).
    pub fn from_number(number: i32) -> Option<Signal> {
        SIGNALS.iter().copied().find(|s| s.number == number)
    }

    pub fn number(self) -> i32 {
        self.number
    }

    /// `SIGTERM`.
    pub fn as_str(self) -> &'static str {
        self.name
    }
}

impl fmt::Debug for Signal {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name)
    }
}

impl fmt::Display for Signal {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name)
    }
}
