//! vllm-warden: one daemon per model that owns the vLLM process tree, follows
//! its log, restarts it with backoff and tells systemd what is going on.
//!
//! The folders are the layers, from the top down; a layer uses the ones
//! below it and never one above (`docs/architecture.md` draws them):
//!
//! | layer | owns |
//! |---|---|
//! | [`cli`] | the command line, the short commands, the demo, man pages and completions |
//! | [`daemon`] | the composition: the loop, the real backend, the pre-start steps, reload, upgrade, the endpoint |
//! | [`tell`] | telling the world: the status document and metrics, sd_notify and the outbox, the journal, the load ledger and setups, failure reports |
//! | [`observe`] | watching the child: its output pipe, the log follower and rotation, health and golden checks, the kernel's messages, OOM kills |
//! | [`process`] | the child's process tree: spawning, signalling, reaping, leftovers, the lock, Ray, the caches |
//! | [`config`] | TOML → validated settings, and the machine's policy built from them |
//! | [`patch`] | JSON edits of model files, atomic writes, backups, revert |
//! | [`util`] | small shared tools: atomic files, escaping, redaction, watched tasks, logging, the writers' worker |
//!
//! Below them all, in its own package, is [`supervisor`] (`vllm-warden-core`):
//! the pure supervisor, its state machine and vocabulary (outcomes, exit
//! codes, log classification, the built-in profiles, hints), which depends
//! on nothing of this package's and does no I/O.

pub mod cli;
pub mod config;
pub mod daemon;
pub mod observe;
pub mod patch;
pub mod process;
pub mod tell;
pub mod util;

pub use vllm_warden_core as supervisor;
