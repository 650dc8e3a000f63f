//! The child's process tree and the machine it runs on: spawning,
//! signalling and reaping the tree, finding its descendants in `/proc`,
//! pre-start hygiene (leftovers, shared memory, the port, the GPUs), one
//! warden per instance, the Ray cluster a start waits for, and the child's
//! caches.
//!
//! May use `supervisor` (its vocabulary), `config`, `patch` and `util`.
//! Knows nothing of the log, the status document, systemd or the loop.

pub(crate) mod caches;
pub mod child;
pub(crate) mod lock;
pub(crate) mod preload;
pub mod prestart;
pub(crate) mod ray;
pub mod signal;
