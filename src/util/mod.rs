//! Small tools every layer may use: atomic whole-file writes and folder
//! checks, escaping untrusted text into one line, masking secrets, the
//! watched background tasks, where the warden's own log goes, the one
//! worker thread behind every writer, and who a server's client is.
//!
//! Uses nothing of the crate; knows nothing of vLLM, the child or systemd.

pub mod clock;
pub mod errno;
pub(crate) mod escape;
pub(crate) mod fsutil;
pub mod logging;
pub(crate) mod peer;
pub(crate) mod redact;
pub mod tasks;
pub(crate) mod worker;
