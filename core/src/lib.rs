//! The pure supervisor of vllm-warden: the state machine
//! `step(event, now) -> effects` and its vocabulary: the policy it acts on
//! and the profiles' patterns it classifies with, run outcomes and failure
//! classes, the warden's exit codes, how a child ended, the notes it gives
//! systemd, the status snapshot, what a log line says, remedy hints and
//! forward progress from vLLM's metrics.
//!
//! No I/O, and the compiler holds it to that: this crate depends on no
//! tokio, no nix, nothing that reads a file, a socket, a process or the
//! clock. Its time is its own [`Instant`], which has no `now()`: the daemon
//! passes the time in. Its signals are its own [`Signal`]. The daemon (the
//! `vllm-warden` package) builds the [`Policy`] from its settings and
//! carries the effects out.

pub mod classify;
pub mod control;
pub mod events;
pub mod exit;
pub mod fit;
pub mod golden;
pub mod hints;
mod instant;
pub mod load;
pub mod machine;
pub mod outcome;
pub mod policy;
pub mod preload;
pub mod profile;
pub mod progress;
mod signal;
pub mod snapshot;

pub use self::events::{Effect, Event, Note, Record, ReportOrder, Saved, Severity, Topic, Upgrade};
pub use self::instant::Instant;
pub use self::machine::{Machine, State};
pub use self::policy::Policy;
pub use self::signal::Signal;
