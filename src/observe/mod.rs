//! Watching the child: moving its output from the warden's pipe to its log
//! file, following that file (and rotating it), HTTP readiness and health
//! checks, the golden answers asked, GPU faults in the kernel's messages,
//! host OOM kills, and what only the tasks off the loop know of the checks
//! (`facts`). What goes out (the status files, sd_notify, the journal, the
//! ledger, failure reports) is `tell`'s.
//!
//! May use `process`, `supervisor`, `config`, `patch` and `util`. Decides
//! nothing: what a line or an answer means for the run is the
//! supervisor's; when to look is the daemon's.

pub(crate) mod facts;
pub mod golden;
pub mod health;
pub(crate) mod kernel;
pub mod logpipe;
pub mod logwatch;
pub mod oom;
pub(crate) mod rotate;
