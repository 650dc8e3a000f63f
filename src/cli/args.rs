//! The command line's words: every command, argument and default, as clap
//! reads them. Parsed here, carried out in `cli`; the man page and the
//! completions are generated from the same definition (`assets`).

use std::path::PathBuf;

use clap::{Parser, Subcommand};

#[derive(Debug, Parser)]
#[command(name = "vllm-warden", version, about = "Supervise one vLLM server under systemd")]
pub(crate) struct Cli {
    /// The instance's config file, anywhere on the command line. Without
    /// it: NAME's (`$VLLM_WARDEN_CONFIG_DIR/NAME.toml`, else
    /// `/etc/vllm-warden/NAME.toml`), else `$VLLM_WARDEN_CONFIG`, else the
    /// host's only instance.
    #[arg(short, long, global = true, value_name = "FILE", value_hint = clap::ValueHint::FilePath)]
    pub(crate) config: Option<PathBuf>,
    /// Colours in help, errors and the warden's own log on a terminal:
    /// `auto` (not when NO_COLOR is set), `always`, `never`.
    #[arg(long, global = true, value_enum, default_value_t = crate::util::logging::Colour::Auto, value_name = "WHEN")]
    pub(crate) color: crate::util::logging::Colour,
    #[command(subcommand)]
    pub(crate) command: Cmd,
}

/// The instance a command is about: a name (`-c FILE` is global).
#[derive(Debug, Clone, clap::Args)]
pub(crate) struct InstanceArg {
    /// The instance: its config is `NAME.toml` in the config folder
    /// (`$VLLM_WARDEN_CONFIG_DIR`, else `/etc/vllm-warden`), as the unit
    /// `vllm-warden@NAME` reads it.
    #[arg(value_name = "NAME")]
    pub(crate) name: Option<String>,
}

#[derive(Debug, clap::Args)]
pub(crate) struct RunArgs {
    #[command(flatten)]
    pub(crate) instance: InstanceArg,
    /// The warden's own events on stderr as `text` lines (the journal under
    /// systemd), or as `json` lines for a container's log collector.
    #[arg(long, value_enum, default_value_t = crate::util::logging::Format::Text)]
    pub(crate) log_format: crate::util::logging::Format,
}

#[derive(Debug, clap::Args)]
pub(crate) struct PatchArgs {
    #[command(flatten)]
    pub(crate) instance: InstanceArg,
    /// Print a unified diff per file of what would change; write nothing.
    #[arg(long, conflicts_with = "revert")]
    pub(crate) dry_run: bool,
    /// Restore the original files (symlinks back to symlinks).
    #[arg(long)]
    pub(crate) revert: bool,
    /// With --revert: restore even files changed by someone else since.
    #[arg(long, requires = "revert")]
    pub(crate) force: bool,
}

#[derive(Debug, clap::Args)]
pub(crate) struct CheckArgs {
    #[command(flatten)]
    pub(crate) instance: InstanceArg,
    /// Also print what `systemctl reload` would do with this file against
    /// the running instance: nothing, reload in place, or restart the child.
    #[arg(long)]
    pub(crate) diff: bool,
    /// Also print the effective pattern lists: the profile's and the
    /// config's, for readiness, fatal and permanent errors, and the rest.
    #[arg(long)]
    pub(crate) print_patterns: bool,
}

#[derive(Debug, clap::Args)]
pub(crate) struct StatusArgs {
    #[command(flatten)]
    pub(crate) instance: InstanceArg,
    /// Print the status document instead of a summary (with --all: the
    /// list as JSON).
    #[arg(long)]
    pub(crate) json: bool,
    /// Every instance of the host, one line each, as `list` shows them.
    #[arg(long, conflicts_with = "name")]
    pub(crate) all: bool,
}

#[derive(Debug, clap::Args)]
pub(crate) struct ListArgs {
    /// One JSON object per instance, in an array.
    #[arg(long)]
    pub(crate) json: bool,
}

#[derive(Debug, clap::Args)]
pub(crate) struct ReportsArgs {
    #[command(flatten)]
    pub(crate) instance: InstanceArg,
    #[command(subcommand)]
    pub(crate) what: Option<ReportsCmd>,
}

#[derive(Debug, Subcommand)]
pub(crate) enum ReportsCmd {
    /// Every report, oldest first: time, attempt, class, size, cause (the default).
    List {
        #[arg(value_name = "NAME")]
        name: Option<String>,
    },
    /// One report as a readable summary (the latest by default).
    Show {
        /// A report's folder name, or the start of it (its time).
        id: Option<String>,
        /// The instance, here or before `show`.
        #[arg(value_name = "NAME")]
        name: Option<String>,
    },
    /// The folder of one report (the latest by default).
    Path {
        /// A report's folder name, or the start of it (its time).
        id: Option<String>,
        /// The instance, here or before `path`.
        #[arg(value_name = "NAME")]
        name: Option<String>,
    },
}

#[derive(Debug, clap::Args)]
pub(crate) struct LoadsArgs {
    #[command(flatten)]
    pub(crate) instance: InstanceArg,
    #[command(subcommand)]
    pub(crate) what: Option<LoadsCmd>,
}

#[derive(Debug, Subcommand)]
pub(crate) enum LoadsCmd {
    /// Every load in the ledger, oldest first: time, outcome, total, each
    /// phase, compile cache, GB/s (the default).
    List {
        #[arg(value_name = "NAME")]
        name: Option<String>,
    },
    /// One load: its setup, cache and weights, its phases as bars (the
    /// latest by default).
    Show {
        /// A load's number (the ID column of `list`).
        id: Option<String>,
        /// The instance, here or before `show`.
        #[arg(value_name = "NAME")]
        name: Option<String>,
    },
    /// Two loads side by side, and what differed in their setups.
    Compare {
        a: u64,
        b: u64,
        /// The instance, here or before `compare`.
        #[arg(value_name = "NAME")]
        name: Option<String>,
    },
}

#[derive(Debug, clap::Args)]
pub(crate) struct SetupsArgs {
    #[command(flatten)]
    pub(crate) instance: InstanceArg,
    #[command(subcommand)]
    pub(crate) what: Option<SetupsCmd>,
}

#[derive(Debug, Subcommand)]
pub(crate) enum SetupsCmd {
    /// The setups recorded as reaching ready, newest first (the default).
    List {
        #[arg(value_name = "NAME")]
        name: Option<String>,
    },
    /// One setup: its config file, vLLM, command, environment (masked),
    /// patched files (the newest by default).
    Show {
        /// A setup's fingerprint, or the start of it.
        id: Option<String>,
        /// The instance, here or before `show`.
        #[arg(value_name = "NAME")]
        name: Option<String>,
    },
    /// What differs between two setups: arguments, environment, patches.
    /// Without arguments: the newest recorded against the setup of the
    /// latest load of another (after a rollback, the one that failed).
    Diff {
        a: Option<String>,
        b: Option<String>,
        /// The instance, here or before `diff`.
        #[arg(value_name = "NAME")]
        name: Option<String>,
    },
}

#[derive(Debug, clap::Args)]
pub(crate) struct GoldenArgs {
    #[command(flatten)]
    pub(crate) instance: InstanceArg,
    #[command(subcommand)]
    pub(crate) what: Option<GoldenCmd>,
}

#[derive(Debug, Subcommand)]
pub(crate) enum GoldenCmd {
    /// The last check and the reference answers of every setup (the default).
    Show {
        #[arg(value_name = "NAME")]
        name: Option<String>,
    },
    /// The last answers beside the reference they were compared with, token by token.
    Diff {
        #[arg(value_name = "NAME")]
        name: Option<String>,
    },
    /// The last answers become the reference of their setup: the next
    /// start compares against them.
    Accept {
        #[arg(value_name = "NAME")]
        name: Option<String>,
    },
}

/// The instance's NAME may come after a subcommand's own subcommand and its
/// IDs (`loads show 3 kimi`, `golden diff kimi`) as well as before it; a
/// lone word that cannot be an ID is the NAME (`loads show kimi`: a load's
/// ID is a number, a report's begins with its time's digits, a setup's is
/// hexadecimal). Given in both places, it is a usage error.
pub(crate) fn settle(instance: &mut InstanceArg, inner: Option<&mut Option<String>>) -> Result<(), String> {
    let Some(inner) = inner else { return Ok(()) };
    match (&instance.name, inner.take()) {
        (_, None) => Ok(()),
        (None, Some(n)) => {
            instance.name = Some(n);
            Ok(())
        }
        (Some(a), Some(b)) => Err(format!("the instance is named twice ({a:?} and {b:?}): give NAME once")),
    }
}

/// A lone ID that cannot be one is the NAME: `id` moved into `name`
/// when `name` is not given.
fn id_or_name(id: &mut Option<String>, name: &mut Option<String>, is_id: impl Fn(&str) -> bool) {
    if name.is_none() && id.as_deref().is_some_and(|i| !is_id(i)) {
        *name = id.take();
    }
}

impl ReportsArgs {
    /// The NAME wherever it was given, in `instance` ([`settle`]).
    pub(crate) fn settle(&mut self) -> Result<(), String> {
        let inner = match &mut self.what {
            None => None,
            Some(ReportsCmd::List { name }) => Some(name),
            Some(ReportsCmd::Show { id, name } | ReportsCmd::Path { id, name }) => {
                id_or_name(id, name, |i| i.starts_with(|c: char| c.is_ascii_digit()));
                Some(name)
            }
        };
        settle(&mut self.instance, inner)
    }
}

impl LoadsArgs {
    /// The NAME wherever it was given, in `instance` ([`settle`]).
    pub(crate) fn settle(&mut self) -> Result<(), String> {
        let inner = match &mut self.what {
            None => None,
            Some(LoadsCmd::List { name } | LoadsCmd::Compare { name, .. }) => Some(name),
            Some(LoadsCmd::Show { id, name }) => {
                id_or_name(id, name, |i| i.parse::<u64>().is_ok());
                if let Some(i) = id.as_deref().filter(|i| i.parse::<u64>().is_err()) {
                    return Err(format!("{:?} is not a load's ID (a number: the ID column of `loads list`)", i));
                }
                Some(name)
            }
        };
        settle(&mut self.instance, inner)
    }

    /// The load `show` asks for (a number, once [`LoadsArgs::settle`]d).
    pub(crate) fn shown(id: &Option<String>) -> Option<u64> {
        id.as_deref().and_then(|i| i.parse().ok())
    }
}

impl SetupsArgs {
    /// The NAME wherever it was given, in `instance` ([`settle`]).
    pub(crate) fn settle(&mut self) -> Result<(), String> {
        let hex = |i: &str| i.chars().all(|c| c.is_ascii_hexdigit());
        let inner = match &mut self.what {
            None => None,
            Some(SetupsCmd::List { name }) => Some(name),
            Some(SetupsCmd::Show { id, name }) => {
                id_or_name(id, name, hex);
                Some(name)
            }
            Some(SetupsCmd::Diff { a, b, name }) => {
                if b.is_some() {
                    id_or_name(b, name, hex);
                } else {
                    id_or_name(a, name, hex);
                }
                Some(name)
            }
        };
        settle(&mut self.instance, inner)
    }
}

impl GoldenArgs {
    /// The NAME wherever it was given, in `instance` ([`settle`]).
    pub(crate) fn settle(&mut self) -> Result<(), String> {
        let inner = match &mut self.what {
            None => None,
            Some(GoldenCmd::Show { name } | GoldenCmd::Diff { name } | GoldenCmd::Accept { name }) => Some(name),
        };
        settle(&mut self.instance, inner)
    }
}

#[derive(Debug, Subcommand)]
pub(crate) enum Cmd {
    /// Run the daemon in the foreground (systemd's ExecStart=, or a
    /// container's PID 1).
    Run(RunArgs),
    /// Validate the config and the environment; list every problem.
    Check(CheckArgs),
    /// Apply the config's [[patch]] entries to the model files now.
    Patch(PatchArgs),
    /// What a running instance is doing: exit 0 ready, 3 not ready, 4 not running.
    Status(StatusArgs),
    /// Every instance on the host, configured or running: its state,
    /// since when, pid, model, address, last load and estimate, last
    /// failure.
    List(ListArgs),
    /// Take the serving model out of rotation and hold it there (the
    /// server keeps running): exit 0 asked, 3 not serving, 4 not running,
    /// 77 permission denied on the control socket.
    Drain(InstanceArg),
    /// Put a drained model back into rotation.
    Undrain(InstanceArg),
    /// Drain, then start the model server again.
    Restart(InstanceArg),
    /// Read the config again and apply it, and say what became of it:
    /// exit 0 applied (in place, restarting the model server, or nothing
    /// changed), 78 refused (every problem is printed; the previous config
    /// keeps running), 4 not running, 77 permission denied. The unit's
    /// `ExecReload=`, so that `systemctl reload` fails on a bad config.
    Reload(InstanceArg),
    /// Replace the running warden by the binary now at its path, keeping
    /// the model serving (sends SIGUSR2): exit 0 asked, 4 not running, 77
    /// not allowed to signal it.
    Upgrade(InstanceArg),
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
    /// Print the completion script of SHELL, e.g.
    /// `vllm-warden completions bash > /etc/bash_completion.d/vllm-warden`.
    Completions {
        #[arg(value_enum)]
        shell: clap_complete::Shell,
    },
    /// Write the man pages (`DIR/man/`) and the bash, zsh and fish
    /// completions (`DIR/completions/`) into DIR, as the package installs
    /// them.
    Assets {
        #[arg(value_name = "DIR", value_hint = clap::ValueHint::DirPath)]
        dir: PathBuf,
    },
}
