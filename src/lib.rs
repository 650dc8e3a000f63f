//! vllm-warden: one daemon per model that owns the vLLM process tree, follows
//! its log, restarts it with backoff and tells systemd what is going on.
//!
//! | module | owns |
//! |---|---|
//! | [`cli`] | parsing, the short commands, the wiring of `run` |
//! | [`daemon`] | the composition: the real backend and reports around the loop |
//! | [`driver`] | the loop that feeds the machine and carries out its effects |
//! | [`supervisor`] | the pure state machine `step(event, now) -> effects` |
//! | [`outcome`] | phases, failure classes, permanence, start failures |
//! | [`exit`] | every exit code |
//! | [`tasks`] | the watched background tasks |
//! | [`lock`] | one warden per instance |
//! | [`config`] | TOML → validated [`config::Settings`], every problem with file:line:col |
//! | [`environment`] | what `check` verifies outside the config file |
//! | [`caches`] | where the child writes: its caches and IPC sockets, and what stands in the way |
//! | [`profile`] | the built-in patterns: vLLM, a Ray head, a Ray node |
//! | [`logwatch`] | following the log file; classifying lines |
//! | [`patch`] | JSON edits of model files, atomic writes, backups, revert |
//! | [`prepare`] | the pre-start steps in order, with their waits |
//! | [`prestart`] | leftovers, shared memory, the port, the GPUs |
//! | [`ray`] | the Ray cluster a start waits for; a Ray node's readiness |
//! | [`child`] | spawning, signalling, reaping, finding descendants in `/proc` |
//! | [`systemd`] | sd_notify, never fatal |
//! | [`status`] | the status document and the metrics (one registry, the file and `/metrics`) |
//! | [`server`] | the warden's HTTP endpoint (unix socket, TCP) and its client |
//! | [`health`] | readiness, health checks and the canary |
//! | [`hints`] | remedy hints for known causes |
//! | [`progress`] | forward progress from vLLM's metrics |
//! | [`kernel`] | GPU faults (NVIDIA Xid) in the kernel's messages |
//! | [`journal`] | forwarding the child's lines to journald |
//! | [`logging`] | journald or stderr |
//! | [`fsutil`] | atomic whole-file writes |
//! | [`reload`] | what a reload changes, and whether the child must restart |
//! | [`reports`] | the failure report of every failed run, and their retention |
//! | [`rotate`] | the child's log file copied and truncated in place when it passes its size |
//! | [`redact`] | masking secrets in printed commands |
//! | [`demo`] | `vllm-warden demo` |
//! | [`assets`] | man pages and completions |

pub mod assets;
pub mod caches;
pub mod child;
pub mod cli;
pub mod config;
pub mod daemon;
pub mod demo;
pub mod driver;
pub mod environment;
pub mod escape;
pub mod exit;
pub mod fsutil;
pub mod health;
pub mod hints;
pub mod journal;
pub mod kernel;
pub mod lock;
pub mod logging;
pub mod logwatch;
pub mod outcome;
pub mod patch;
pub mod prepare;
pub mod prestart;
pub mod profile;
pub mod progress;
pub mod ray;
pub mod redact;
pub mod reload;
pub mod reports;
pub mod rotate;
pub mod server;
pub mod status;
pub mod supervisor;
pub mod systemd;
pub mod tasks;
pub mod upgrade;
