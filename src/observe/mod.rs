//! Watching the child and telling the world about it: moving its output
//! from the warden's pipe to its log file, following that file (and
//! rotating it), HTTP readiness and health checks, GPU faults in
//! the kernel's messages, host OOM kills, forwarding its lines to the journal, the status
//! document and the metrics, the load ledger, the golden answers, the
//! failure report of a failed run, and sd_notify (the status files and the
//! notes behind them written and sent off the loop, by the outbox).
//!
//! May use `process`, `supervisor`, `config`, `patch` and `util`. Decides
//! nothing: what a line or an answer means for the run is the
//! supervisor's; when to look is the daemon's.

pub mod facts;
pub mod golden;
pub mod health;
pub mod journal;
pub mod kernel;
pub mod ledger;
pub mod logpipe;
pub mod logwatch;
pub mod notify;
pub mod oom;
pub mod outbox;
pub mod reports;
pub mod rotate;
pub mod setups;
pub mod status;
