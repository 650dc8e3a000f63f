//! The command line's words: every command, argument and default, as clap
//! reads them. Parsed here, carried out in `cli`; the man page and the
//! completions are generated from the same definition (`assets`).

use std::path::PathBuf;

use clap::{Parser, Subcommand};

use crate::config::DEFAULT_CONFIG;

#[derive(Debug, Parser)]
#[command(name = "vllm-warden", version, about = "Supervise one vLLM server under systemd")]
pub struct Cli {
    #[command(subcommand)]
    pub command: Cmd,
}

#[derive(Debug, clap::Args)]
pub struct ConfigArg {
    /// Config file.
    #[arg(short, long, env = "VLLM_WARDEN_CONFIG", default_value = DEFAULT_CONFIG)]
    pub config: PathBuf,
}

#[derive(Debug, clap::Args)]
pub struct RunArgs {
    #[command(flatten)]
    pub config: ConfigArg,
    /// The warden's own events on stderr as `text` lines (the journal under
    /// systemd), or as `json` lines for a container's log collector.
    #[arg(long, value_enum, default_value_t = crate::util::logging::Format::Text)]
    pub log_format: crate::util::logging::Format,
}

#[derive(Debug, clap::Args)]
pub struct PatchArgs {
    #[command(flatten)]
    pub config: ConfigArg,
    /// Print a unified diff per file of what would change; write nothing.
    #[arg(long, conflicts_with = "revert")]
    pub dry_run: bool,
    /// Restore the original files (symlinks back to symlinks).
    #[arg(long)]
    pub revert: bool,
    /// With --revert: restore even files changed by someone else since.
    #[arg(long, requires = "revert")]
    pub force: bool,
}

#[derive(Debug, clap::Args)]
pub struct CheckArgs {
    #[command(flatten)]
    pub config: ConfigArg,
    /// Also print what `systemctl reload` would do with this file against
    /// the running instance: nothing, reload in place, or restart the child.
    #[arg(long)]
    pub diff: bool,
}

#[derive(Debug, clap::Args)]
pub struct StatusArgs {
    #[command(flatten)]
    pub config: ConfigArg,
    /// Print the status document instead of a summary.
    #[arg(long)]
    pub json: bool,
}

#[derive(Debug, clap::Args)]
pub struct ReportsArgs {
    #[command(flatten)]
    pub config: ConfigArg,
    #[command(subcommand)]
    pub what: Option<ReportsCmd>,
}

#[derive(Debug, Subcommand)]
pub enum ReportsCmd {
    /// Every report, oldest first: time, attempt, class, size, cause (the default).
    List,
    /// One report as a readable summary (the latest by default).
    Show {
        /// A report's folder name, or the start of it (its time).
        id: Option<String>,
    },
    /// The folder of one report (the latest by default).
    Path {
        /// A report's folder name, or the start of it (its time).
        id: Option<String>,
    },
}

#[derive(Debug, clap::Args)]
pub struct LoadsArgs {
    #[command(flatten)]
    pub config: ConfigArg,
    #[command(subcommand)]
    pub what: Option<LoadsCmd>,
}

#[derive(Debug, Subcommand)]
pub enum LoadsCmd {
    /// Every load in the ledger, oldest first: time, outcome, total, each
    /// phase, compile cache, GB/s (the default).
    List,
    /// One load: its setup, cache and weights, its phases as bars (the
    /// latest by default).
    Show {
        /// A load's number (the ID column of `list`).
        id: Option<u64>,
    },
    /// Two loads side by side, and what differed in their setups.
    Compare { a: u64, b: u64 },
}

#[derive(Debug, clap::Args)]
pub struct SetupsArgs {
    #[command(flatten)]
    pub config: ConfigArg,
    #[command(subcommand)]
    pub what: Option<SetupsCmd>,
}

#[derive(Debug, Subcommand)]
pub enum SetupsCmd {
    /// The setups recorded as reaching ready, newest first (the default).
    List,
    /// One setup: its config file, vLLM, command, environment (masked),
    /// patched files (the newest by default).
    Show {
        /// A setup's fingerprint, or the start of it.
        id: Option<String>,
    },
    /// What differs between two setups: arguments, environment, patches.
    /// Without arguments: the newest recorded against the setup of the
    /// latest load of another (after a rollback, the one that failed).
    Diff { a: Option<String>, b: Option<String> },
}

#[derive(Debug, clap::Args)]
pub struct GoldenArgs {
    #[command(flatten)]
    pub config: ConfigArg,
    #[command(subcommand)]
    pub what: Option<GoldenCmd>,
}

#[derive(Debug, Subcommand)]
pub enum GoldenCmd {
    /// The last check and the reference answers of every setup (the default).
    Show,
    /// The last answers beside the reference they were compared with, token by token.
    Diff,
    /// The last answers become the reference of their setup: the next
    /// start compares against them.
    Accept,
}

#[derive(Debug, Subcommand)]
pub enum Cmd {
    /// Run the daemon in the foreground (systemd's ExecStart=, or a
    /// container's PID 1).
    Run(RunArgs),
    /// Validate the config and the environment; list every problem.
    Check(CheckArgs),
    /// Apply the config's [[patch]] entries to the model files now.
    Patch(PatchArgs),
    /// What a running instance is doing: exit 0 ready, 3 not ready, 4 not running.
    Status(StatusArgs),
    /// Take the serving model out of rotation and hold it there (the
    /// server keeps running): exit 0 asked, 3 not serving, 4 not running,
    /// 77 permission denied on the control socket.
    Drain(ConfigArg),
    /// Put a drained model back into rotation.
    Undrain(ConfigArg),
    /// Drain, then start the model server again.
    Restart(ConfigArg),
    /// Replace the running warden by the binary now at its path, keeping
    /// the model serving (sends SIGUSR2): exit 0 asked, 4 not running, 77
    /// not allowed to signal it.
    Upgrade(ConfigArg),
    /// The failure reports of failed runs: list, show one, or its folder.
    Reports(ReportsArgs),
    /// The load ledger: every load's phases, compile cache and speed;
    /// one load's phases; two loads compared.
    Loads(LoadsArgs),
    /// The setups recorded as reaching ready, one of them, and what
    /// differs between two (records to read: never run).
    Setups(SetupsArgs),
    /// The golden answers: the reference of each setup and the last
    /// check; their difference; accept the last answers.
    Golden(GoldenArgs),
    /// Run the whole lifecycle against the simulated vLLM (vllm-warden-sim).
    Demo,
    /// Write the man pages and shell completions into a folder (packaging).
    #[command(hide = true)]
    Assets { dir: PathBuf },
}
