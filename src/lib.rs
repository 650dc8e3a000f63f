//! vllm-warden: one daemon per model that owns the vLLM process tree, follows
//! its log, restarts it with backoff and tells systemd what is going on.
//!
//! | module | owns |
//! |---|---|
//! | [`config`] | TOML → validated [`config::Settings`], every problem with file:line:col |
//! | [`profile`] | the built-in vLLM patterns |
//! | [`logwatch`] | following the log file; classifying lines |
//! | [`patch`] | JSON edits of model files, atomic writes, backups, revert |
//! | [`prepare`] | the pre-start steps in order, with their waits |
//! | [`prestart`] | leftovers, shared memory, the port, the GPUs |
//! | [`child`] | spawning, signalling, reaping, finding descendants in `/proc` |
//! | [`supervisor`] | the pure state machine `step(event, now) -> effects` |
//! | [`driver`] | the loop that carries out the effects |
//! | [`systemd`] | sd_notify, never fatal |
//! | [`fsutil`] | atomic whole-file writes |
//! | [`status`] | the status document and the metrics file |
//! | [`redact`] | masking secrets in printed commands |
//! | [`health`] | health checks and the canary after ready |
//! | [`journal`] | forwarding the child's lines to journald |
//! | [`logging`] | journald or stderr |
//! | [`fake`] | a simulated vLLM for the demo and the tests |
//! | [`cli`] | the commands and the exit code |

pub mod child;
pub mod cli;
pub mod config;
pub mod driver;
pub mod fake;
pub mod fsutil;
pub mod health;
pub mod journal;
pub mod logging;
pub mod logwatch;
pub mod patch;
pub mod prepare;
pub mod prestart;
pub mod profile;
pub mod redact;
pub mod status;
pub mod supervisor;
pub mod systemd;
