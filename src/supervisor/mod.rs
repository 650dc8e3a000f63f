//! The pure supervisor: the state machine `step(event, now) -> effects` and
//! its vocabulary — the policy it acts on, run outcomes and failure
//! classes, the warden's exit codes, how a child ended, the notes it gives
//! systemd, the status snapshot, what a log line says, remedy hints and
//! forward progress from vLLM's metrics.
//!
//! No I/O: no processes, files, sockets, clocks or tokio. May use `config`
//! (the settings' types), `patch` (a patch's description) and `util`;
//! never `process`, `observe`, `daemon` or `cli`.

pub mod classify;
pub mod events;
pub mod exit;
pub mod fit;
pub mod golden;
pub mod hints;
pub mod load;
pub mod machine;
pub mod outcome;
pub mod policy;
pub mod preload;
pub mod progress;
pub mod snapshot;

pub use self::events::{Effect, Event, Note, Record, ReportOrder, Saved, Severity, Topic, Upgrade};
pub use self::machine::{Machine, State};
pub use self::policy::Policy;
#[cfg(test)]
pub use self::policy::prepare_timeout;
