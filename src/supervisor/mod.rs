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
pub(crate) mod exit;
pub(crate) mod fit;
pub mod golden;
pub mod hints;
pub mod load;
pub(crate) mod machine;
pub mod outcome;
pub mod policy;
pub(crate) mod preload;
pub(crate) mod progress;
pub(crate) mod snapshot;

pub(crate) use self::events::{Effect, Record, ReportOrder, Saved, Severity, Topic, Upgrade};
pub use self::events::{Event, Note};
pub use self::machine::{Machine, State};
pub use self::policy::Policy;
#[cfg(test)]
pub(crate) use self::policy::prepare_timeout;
