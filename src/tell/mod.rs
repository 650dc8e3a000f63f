//! Telling the world: the status document (`status`), the metrics
//! (`metrics`) and what `status` concludes from the document (`summary`), the
//! notes to systemd (`notify`) and the outbox that writes the files and
//! sends the notes in order off the loop (`outbox`), the child's lines in
//! the journal (`journal`), the load ledger (`ledger`) and the setups that
//! reached ready (`setups`), and the failure report of a failed run
//! (`reports`). Each writer is a [`crate::util::worker`] with its own
//! handler.
//!
//! May use `observe` (what was watched: the kernel's marks, the log's
//! rotation, the checks' facts), `process`, `supervisor`, `config`,
//! `patch` and `util`. Decides nothing: what to say is the supervisor's,
//! when to say it the daemon's.

pub mod journal;
pub mod ledger;
pub mod metrics;
pub mod notify;
pub(crate) mod outbox;
pub mod reports;
pub mod setups;
pub(crate) mod status;
pub(crate) mod summary;
