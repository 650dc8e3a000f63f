//! The command line: parsing, the short commands (`check`, `patch`,
//! `status`, `list` …), and the wiring of `run`: config, logging, signals
//! as a stream of requests, the runtime, then `daemon::run`. What the
//! daemon does is not known here.
//!
//! Only `run`, `check` and `patch` need a valid config. The commands that
//! control or read a running instance (`status`, `drain`, `undrain`,
//! `restart`, `upgrade`, `reports`, `loads`, `setups`, `golden`) need only
//! its name and folders: with a config that does not validate (a typo
//! before any reload) they go on with what it gives and the defaults, and
//! say so in one line, so that a broken file never takes the control of a
//! serving model away.
//!
//! Output goes through [`out!`] and [`outln!`]: a reader that went away
//! (`vllm-warden loads | head -1`) ends the command quietly, with success.

/// `print!` whose broken pipe ends the command quietly ([`write_out`]).
macro_rules! out {
    ($($t:tt)*) => { $crate::cli::write_out(format_args!($($t)*)) };
}

/// `println!` whose broken pipe ends the command quietly ([`write_out`]).
macro_rules! outln {
    ($($t:tt)*) => { $crate::cli::write_out(format_args!("{}\n", format_args!($($t)*))) };
}

pub(crate) mod args;
pub(crate) mod assets;
pub(crate) mod demo;
pub(crate) mod instance;
pub(crate) mod list;
pub(crate) mod loads;
pub(crate) mod setups;

use std::path::{Path, PathBuf};

use tokio_stream::{Stream, StreamExt};

use self::args::{Cli, Cmd, InstanceArg, PatchArgs, ReportsArgs, ReportsCmd, StatusArgs};
use self::instance::Seen;
use crate::config::{self, Dirs, Settings};
use crate::daemon::driver::Request;
use crate::supervisor::exit::Code;
use crate::tell::notify::{self, SdNotifier};
use crate::util::logging::Colour;

/// Write to stdout. A reader that went away (`… | head -1`) ends the
/// process here, quietly and with success, as `head` asked for no more:
/// no panic, no message. Any other failure to write is said on stderr and
/// ends it with 70.
pub(crate) fn write_out(args: std::fmt::Arguments<'_>) {
    use std::io::Write;
    match std::io::stdout().lock().write_fmt(args) {
        Ok(()) => {}
        Err(e) if e.kind() == std::io::ErrorKind::BrokenPipe => std::process::exit(0),
        Err(e) => {
            eprintln!("vllm-warden: cannot write to stdout: {e}");
            std::process::exit(Code::Internal.as_u8().into());
        }
    }
}

/// Parse the arguments, run the command, return its exit code.
pub fn main() -> Code {
    // First, before any thread: an upgrading predecessor's state file.
    let upgraded = crate::daemon::upgrade::take_from_env();
    let cli = parse();
    let file = cli.config.as_deref();
    let colour = cli.color;
    // The config a command reads, or the reason none could be chosen.
    let chosen = |i: &InstanceArg, cmd: &str| choose(file, i, cmd);
    match cli.command {
        Cmd::Run(a) => {
            // Still before any thread: the sockets systemd passed (an
            // upgrade's successor has its predecessor's instead).
            let passed = crate::daemon::front::listen::Inherited::from_env(upgraded.is_none());
            match chosen(&a.instance, "run") {
                Ok(path) => run(&path, a.log_format, colour, upgraded, passed),
                Err(code) => code,
            }
        }
        Cmd::Upgrade(i) => chosen(&i, "upgrade").map_or_else(|c| c, |p| upgrade(&p)),
        Cmd::Check(c) => match chosen(&c.instance, "check") {
            Ok(path) => check(&path, c.diff, c.print_patterns),
            Err(code) => code,
        },
        Cmd::Patch(a) => chosen(&a.instance, "patch").map_or_else(|c| c, |p| patch(&p, &a)),
        Cmd::Status(a) if a.all => list(a.json),
        Cmd::Status(a) => chosen(&a.instance, "status").map_or_else(|c| c, |p| status(&p, &a)),
        Cmd::List(a) => list(a.json),
        Cmd::Drain(i) => chosen(&i, "drain").map_or_else(|c| c, |p| control(&p, "/drain")),
        Cmd::Undrain(i) => chosen(&i, "undrain").map_or_else(|c| c, |p| control(&p, "/undrain")),
        Cmd::Restart(i) => chosen(&i, "restart").map_or_else(|c| c, |p| control(&p, "/restart")),
        Cmd::Reload(i) => chosen(&i, "reload").map_or_else(|c| c, |p| control(&p, "/reload")),
        Cmd::Reports(mut a) => {
            settled(a.settle()).and_then(|()| chosen(&a.instance, "reports")).map_or_else(|c| c, |p| reports(&p, &a))
        }
        Cmd::Loads(mut a) => {
            settled(a.settle()).and_then(|()| chosen(&a.instance, "loads")).map_or_else(|c| c, |p| loads_cmd(&p, &a))
        }
        Cmd::Setups(mut a) => {
            settled(a.settle()).and_then(|()| chosen(&a.instance, "setups")).map_or_else(|c| c, |p| setups_cmd(&p, &a))
        }
        Cmd::Golden(mut a) => {
            settled(a.settle()).and_then(|()| chosen(&a.instance, "golden")).map_or_else(|c| c, |p| golden_cmd(&p, &a))
        }
        Cmd::Demo => crate::cli::demo::main(colour),
        Cmd::Completions { shell } => {
            out!("{}", String::from_utf8_lossy(&crate::cli::assets::completion(shell)));
            Code::Ok
        }
        Cmd::Assets { dir } => match crate::cli::assets::write(&dir) {
            Ok(()) => Code::Ok,
            Err(e) => {
                eprintln!("vllm-warden: {}: {e}", dir.display());
                Code::Internal
            }
        },
    }
}

/// A NAME given after a subcommand's own subcommand, settled
/// ([`args::settle`]); why not on stderr, and 2.
fn settled(r: Result<(), String>) -> Result<(), Code> {
    r.map_err(|e| {
        eprintln!("vllm-warden: {}", crate::util::escape::one_line(&e, crate::util::escape::MAX_LINE));
        Code::Usage
    })
}

/// The arguments, with clap's own help and errors coloured as `--color`
/// says (clap's `auto` already honours `NO_COLOR`); clap's usage errors
/// exit 2.
fn parse() -> Cli {
    use clap::{CommandFactory, FromArgMatches};
    let choice = match colour_asked(std::env::args_os().skip(1)) {
        Colour::Auto => clap::ColorChoice::Auto,
        Colour::Always => clap::ColorChoice::Always,
        Colour::Never => clap::ColorChoice::Never,
    };
    let matches = Cli::command().color(choice).get_matches();
    Cli::from_arg_matches(&matches).unwrap_or_else(|e| e.exit())
}

/// The last `--color WHEN` or `--color=WHEN` before `--`, read ahead of
/// clap, whose own messages it colours.
fn colour_asked(args: impl Iterator<Item = std::ffi::OsString>) -> Colour {
    use clap::ValueEnum;
    let mut colour = Colour::Auto;
    let mut args = args.map(|a| a.to_string_lossy().into_owned());
    while let Some(a) = args.next() {
        let value = match a.as_str() {
            "--" => break,
            "--color" => args.next(),
            _ => a.strip_prefix("--color=").map(str::to_string),
        };
        if let Some(c) = value.and_then(|v| Colour::from_str(&v, false).ok()) {
            colour = c;
        }
    }
    colour
}

/// The config file of a command ([`instance::choose`]); when none can be
/// chosen, the reason on stderr and its code.
fn choose(file: Option<&Path>, i: &InstanceArg, cmd: &str) -> Result<PathBuf, Code> {
    instance::choose(file, i.name.as_deref(), cmd).map_err(|e| {
        eprintln!("vllm-warden: {e}");
        match e {
            instance::Choice::Unlisted { source, .. } if source.kind() == std::io::ErrorKind::PermissionDenied => {
                Code::NoPermission
            }
            _ => Code::Usage,
        }
    })
}

/// A valid config, or every problem on stderr and 78.
fn load(path: &Path) -> Result<Settings, Code> {
    config::load(path, &Dirs::from_env()).map_err(|problems| {
        for p in &problems.0 {
            eprintln!("{p}");
        }
        Code::Config
    })
}

/// The instance of a command that needs only its name and folders: the
/// config as far as it reads (`config::load_lenient`); when it has
/// problems, one warning line saying what is used instead.
///
/// A file whose instance name is not one (`...toml` is not instance `..`)
/// gives no folders to go on with: refused, with 2, as a `NAME` that is
/// not one is.
fn lenient(path: &Path) -> Result<Settings, Code> {
    let (s, problems) = config::load_lenient(path, &Dirs::from_env());
    if !config::valid_name(&s.name) {
        eprintln!(
            "vllm-warden: {}: the instance is named after the file, and {}: rename the file NAME.toml, or give `name` in it",
            crate::util::escape::one_line(&path.display().to_string(), crate::util::escape::MAX_LINE),
            config::not_a_name(&s.name)
        );
        return Err(Code::Usage);
    }
    if let Some(first) = problems.first() {
        let more = match problems.len() - 1 {
            0 => String::new(),
            n => format!(" (and {}; `vllm-warden check` lists them)", count(n, "more problem")),
        };
        eprintln!(
            "vllm-warden: warning: {first}{more}; going on as instance {:?}: state {}, control socket {}",
            s.name,
            s.state_dir.display(),
            s.server.socket.display()
        );
    }
    Ok(s)
}

/// `1 problem`, `2 problems`.
fn count(n: usize, what: &str) -> String {
    if n == 1 { format!("1 {what}") } else { format!("{n} {what}s") }
}

/// The state folder (and `sub` in it) may be read by this user, or the
/// reason on stderr and 77: records that cannot be read are not records
/// that are not there. A folder that is not there is no such problem (no
/// record yet).
fn readable(s: &Settings, sub: &[&str]) -> Result<(), Code> {
    use nix::unistd::{AccessFlags, access};
    let dirs = std::iter::once(s.state_dir.clone()).chain(sub.iter().map(|d| s.state_dir.join(d)));
    for dir in dirs {
        if let Err(e @ (nix::errno::Errno::EACCES | nix::errno::Errno::EPERM)) =
            access(&dir, AccessFlags::R_OK | AccessFlags::X_OK)
        {
            eprintln!(
                "vllm-warden: {}: permission denied: cannot read {} ({}): run this as the service's user or root",
                s.name,
                dir.display(),
                std::io::Error::from(e)
            );
            return Err(Code::NoPermission);
        }
    }
    Ok(())
}

/// A record's file could not be read: 77 when this user may not, 1 else.
fn unreadable(path: &Path, e: &std::io::Error) -> Code {
    if e.kind() == std::io::ErrorKind::PermissionDenied {
        eprintln!(
            "vllm-warden: permission denied: cannot read {} ({e}): run this as the service's user or root",
            path.display()
        );
        Code::NoPermission
    } else {
        eprintln!("vllm-warden: {}: {e}", path.display());
        Code::NoReport
    }
}

/// Every problem `run` would meet at start, the config's and the
/// environment's together, whatever else is wrong; "valid" only when there
/// is none. The verdict first; then (with `diff`) what a reload would do,
/// where the instance's files go, the child's caches and model, what the
/// read-ahead of the weights will read, and (when
/// asked) the effective pattern lists.
fn check(path: &Path, diff: bool, print_patterns: bool) -> Code {
    let (settings, mut problems) = config::load_all(path, &Dirs::from_env());
    let mut child = None;
    if let Some(s) = &settings {
        problems.extend(crate::daemon::environment::check_environment(s));
        let (said, warnings) = crate::daemon::environment::describe_child(s);
        for w in warnings {
            eprintln!("warning: {w}");
        }
        child = Some(said);
    }
    problems.dedup();
    if problems.is_empty()
        && let Some(s) = &settings
    {
        outln!("{}: config of instance {:?} is valid", path.display(), s.name);
        let code = if diff { reload_plan(path, s) } else { Code::Ok };
        outln!("state: {}", s.state_dir.display());
        outln!("log: {}", s.child.log_file.display());
        outln!("control socket: {}", s.server.socket.display());
        outln!("status file: {}", s.status.file.display());
        // The golden check skipped for the setup at its last start (a
        // pooling or embedding model): said where the check is looked at.
        if s.golden.enabled
            && let Ok(Some(last)) = crate::observe::golden::last(&s.state_dir)
            && last.verdict == "skipped"
        {
            outln!("golden: {}", crate::util::escape::one_line(&last.text, crate::util::escape::MAX_LINE));
        }
        match &s.child.cache_dir {
            Some(d) => outln!("caches: {}", d.display()),
            None => outln!("caches: where the child's environment puts them"),
        }
        out!("{}", child.unwrap_or_default());
        if s.profile == crate::config::profile::Profile::Vllm
            && crate::daemon::environment::model_of(&s.child.command).is_some()
        {
            outln!("{}", crate::daemon::prefetch::describe(s));
        }
        if print_patterns {
            out!("{}", config::describe_patterns(s));
        }
        return code;
    }
    for p in &problems {
        eprintln!("{p}");
    }
    eprintln!("{} found", count(problems.len(), "problem"));
    Code::Config
}

/// What a reload of `path` (valid: `new`) would do against the running
/// instance's config (`STATE_DIRECTORY/running.toml`, kept by the running
/// warden).
fn reload_plan(path: &Path, new: &Settings) -> Code {
    let running = crate::daemon::reload::running_path(&new.state_dir);
    let text = match crate::process::prestart::read_state_file(&running, 1 << 20) {
        Ok(bytes) => String::from_utf8_lossy(&bytes).into_owned(),
        Err(e) => {
            outln!("reload: no running instance to compare with ({}: {e})", running.display());
            return Code::NotRunning;
        }
    };
    let old = match config::parse(&text, path, &Dirs::from_env()) {
        Ok(s) => s,
        Err(p) => {
            eprintln!("{}: the running config no longer reads: {p}", running.display());
            return Code::Config;
        }
    };
    outln!("reload: {}", crate::daemon::reload::plan(&old, new));
    for c in crate::daemon::reload::identity_left(&old, new) {
        outln!("reload: {c}: takes effect when the warden itself restarts");
    }
    Code::Ok
}

/// `list`, `status --all`: every instance of the host.
fn list(json: bool) -> Code {
    let found = match instance::all() {
        Ok(f) => f,
        Err(e) => {
            eprintln!("vllm-warden: {e}");
            return match e {
                instance::Choice::Unlisted { source, .. } if source.kind() == std::io::ErrorKind::PermissionDenied => {
                    Code::NoPermission
                }
                _ => Code::Internal,
            };
        }
    };
    let rows = list::rows(&found);
    if json {
        // Rows of strings and numbers always serialise.
        outln!("{}", serde_json::to_string_pretty(&rows).unwrap_or_default());
    } else if rows.is_empty() {
        outln!(
            "no instance on this host (no NAME.toml in {}, none running in {})",
            instance::config_dir().display(),
            config::defaults::RUN_DIR
        );
    } else {
        out!("{}", list::table(&rows));
    }
    Code::Ok
}

fn status(path: &Path, a: &StatusArgs) -> Code {
    let s = match lenient(path) {
        Ok(s) => s,
        Err(code) => return code,
    };
    use crate::tell::summary::StatusVerdict;
    // Through the socket when a warden answers there; else the file.
    let verdict = match instance::look(&s, ANSWER_TIMEOUT) {
        Seen::Verdict(v) => *v,
        Seen::Denied(why) => {
            eprintln!("vllm-warden: {}: {why}: run this as the service's user or a member of its group", s.name);
            return Code::NoPermission;
        }
        Seen::Unreadable(why) => {
            eprintln!(
                "vllm-warden: {}: not running as far as can be seen: {}",
                s.name,
                crate::util::escape::one_line(&why, crate::util::escape::MAX_LINE)
            );
            return Code::NotRunning;
        }
    };
    if a.json {
        match &verdict {
            StatusVerdict::Ready(d) | StatusVerdict::NotReady(d) | StatusVerdict::NotRunning(Some(d)) => {
                // A document read back from JSON serialises again.
                outln!("{}", serde_json::to_string_pretty(d).unwrap_or_default())
            }
            StatusVerdict::NotRunning(None) => eprintln!("{}: no status file", s.status.file.display()),
        }
    } else if let StatusVerdict::NotRunning(None) = &verdict {
        outln!("{}: not running (no status file {})", s.name, s.status.file.display());
    } else {
        outln!("{}", crate::tell::summary::summary(&verdict));
    }
    match verdict {
        StatusVerdict::Ready(_) => Code::Ok,
        StatusVerdict::NotReady(_) => Code::NotReady,
        StatusVerdict::NotRunning(_) => Code::NotRunning,
    }
}

/// How long a local command waits for the warden's answer.
const ANSWER_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(10);

/// The verdict of `POST /reload` as the operator reads it: one line, and
/// each problem of a refused config on a line of its own.
fn reload_verdict(body: &str) -> String {
    match serde_json::from_str::<crate::tell::status::LastReload>(body) {
        Ok(r) => {
            // Escaped again here: the text reaches a terminal.
            let line = |t: &str| crate::util::escape::one_line(t, crate::util::escape::MAX_LINE);
            let mut out = format!("reload {}: {}", r.outcome.as_str(), line(&r.summary));
            for p in &r.problems {
                out.push_str("\n  ");
                out.push_str(&line(p));
            }
            out
        }
        Err(_) => crate::util::escape::one_line(body.trim_end(), crate::util::escape::MAX_LINE),
    }
}

/// `drain`, `undrain`, `restart`, `reload`: a POST over the control socket.
fn control(config: &Path, path: &str) -> Code {
    let s = match lenient(config) {
        Ok(s) => s,
        Err(code) => return code,
    };
    // A reload is answered once the config was read and checked: it may
    // take longer.
    let within = if path == "/reload" { crate::daemon::server::RELOAD_WAIT + ANSWER_TIMEOUT } else { ANSWER_TIMEOUT };
    match instance::ask(&s.server.socket, "POST", path, within) {
        Ok((code, body)) => {
            let body = if path == "/reload" {
                reload_verdict(&body)
            } else {
                crate::util::escape::one_line(body.trim_end(), crate::util::escape::MAX_LINE)
            };
            match code {
                200..=299 => {
                    outln!("{}: {body}", s.name);
                    Code::Ok
                }
                409 => {
                    eprintln!("{}: {body}", s.name);
                    Code::NotReady
                }
                422 => {
                    eprintln!("{}: {body}", s.name);
                    Code::Config
                }
                _ => {
                    eprintln!("vllm-warden: {}: unexpected answer {code}: {body}", s.server.socket.display());
                    Code::Internal
                }
            }
        }
        Err(crate::daemon::server::client::ClientError::Connect { path, source })
            if source.kind() == std::io::ErrorKind::PermissionDenied =>
        {
            // Not "not running": a warden may well run behind a socket this
            // user may not open (mode 0660, the service's user and group).
            eprintln!(
                "vllm-warden: {}: permission denied on the control socket {path} ({source}): run this as the service's user or a member of its group",
                s.name
            );
            Code::NoPermission
        }
        Err(e @ crate::daemon::server::client::ClientError::Connect { .. }) => {
            eprintln!("vllm-warden: {}: not running ({e})", s.name);
            Code::NotRunning
        }
        Err(e) => {
            eprintln!("vllm-warden: {}: {e}", s.server.socket.display());
            Code::Internal
        }
    }
}

fn reports(path: &Path, a: &ReportsArgs) -> Code {
    let s = match lenient(path) {
        Ok(s) => s,
        Err(code) => return code,
    };
    if let Err(code) = readable(&s, &[crate::tell::reports::FOLDER]) {
        return code;
    }
    let all = match crate::tell::reports::list(&s.state_dir, &s.name) {
        Ok(all) => all,
        Err(e) => return unreadable(&s.state_dir.join(crate::tell::reports::FOLDER), &e),
    };
    let pick = |id: &Option<String>| -> Result<crate::tell::reports::Listed, Code> {
        let found: Vec<&crate::tell::reports::Listed> = match id {
            None => all.last().into_iter().collect(),
            Some(id) => all.iter().filter(|r| r.name.starts_with(id.as_str())).collect(),
        };
        match found.as_slice() {
            [one] => Ok((*one).clone()),
            [] => {
                let what =
                    id.as_deref().map_or(String::new(), |i| format!(" {:?}", crate::util::escape::one_line(i, 200)));
                eprintln!(
                    "vllm-warden: no failure report{what} in {}",
                    s.state_dir.join(crate::tell::reports::FOLDER).display()
                );
                Err(Code::NoReport)
            }
            many => {
                eprintln!("vllm-warden: {} reports begin so; give more of the name", many.len());
                Err(Code::NoReport)
            }
        }
    };
    match &a.what {
        None | Some(ReportsCmd::List { .. }) => {
            if all.is_empty() {
                outln!("no failure reports in {}", s.state_dir.join(crate::tell::reports::FOLDER).display());
            } else {
                out!("{}", crate::tell::reports::table(&all));
            }
            Code::Ok
        }
        Some(ReportsCmd::Show { id, .. }) => match pick(id) {
            Ok(r) => {
                out!("{}", crate::tell::reports::show(&r));
                Code::Ok
            }
            Err(code) => code,
        },
        Some(ReportsCmd::Path { id, .. }) => match pick(id) {
            Ok(r) => {
                outln!("{}", r.path.display());
                Code::Ok
            }
            Err(code) => code,
        },
    }
}

fn loads_cmd(config: &Path, a: &args::LoadsArgs) -> Code {
    use args::LoadsCmd;
    let s = match lenient(config) {
        Ok(s) => s,
        Err(code) => return code,
    };
    if let Err(code) = readable(&s, &[]) {
        return code;
    }
    let path = s.state_dir.join(crate::tell::ledger::FILE);
    let all = match crate::tell::ledger::read(&path) {
        Ok((all, _)) => all,
        Err(e) => return unreadable(&path, &e),
    };
    let pick = |id: Option<u64>| -> Result<&crate::supervisor::load::LoadRecord, Code> {
        let found = match id {
            None => all.last(),
            Some(id) => all.iter().find(|r| r.id == id),
        };
        found.ok_or_else(|| {
            let what = id.map_or("load".to_string(), |i| format!("load {i}"));
            eprintln!("vllm-warden: no {what} in {}", path.display());
            Code::NoReport
        })
    };
    match &a.what {
        None | Some(LoadsCmd::List { .. }) => {
            if all.is_empty() {
                outln!("no loads in {}", path.display());
            } else {
                out!("{}", loads::table(&all));
            }
            Code::Ok
        }
        Some(LoadsCmd::Show { id, .. }) => match pick(args::LoadsArgs::shown(id)) {
            Ok(r) => {
                out!("{}", loads::show(r));
                Code::Ok
            }
            Err(code) => code,
        },
        Some(LoadsCmd::Compare { a, b, .. }) => match (pick(Some(*a)), pick(Some(*b))) {
            (Ok(x), Ok(y)) => {
                out!("{}", loads::compare(x, y));
                Code::Ok
            }
            (Err(code), _) | (_, Err(code)) => code,
        },
    }
}

fn setups_cmd(config: &Path, a: &args::SetupsArgs) -> Code {
    use args::SetupsCmd;
    let s = match lenient(config) {
        Ok(s) => s,
        Err(code) => return code,
    };
    if let Err(code) = readable(&s, &["setups"]) {
        return code;
    }
    let all = crate::tell::setups::list(&s.state_dir, &s.name);
    let fail = |why: String| {
        eprintln!("vllm-warden: {why}");
        Code::NoReport
    };
    match &a.what {
        None | Some(SetupsCmd::List { .. }) => {
            if all.is_empty() {
                outln!("no setup has reached ready yet ({})", s.state_dir.join("setups").display());
            } else {
                out!("{}", setups::table(&all));
            }
            Code::Ok
        }
        Some(SetupsCmd::Show { id, .. }) => {
            let found = match id {
                Some(id) => crate::tell::setups::find(&s.state_dir, &s.name, id),
                None => all.first().cloned().ok_or_else(|| "no setup has reached ready yet".to_string()),
            };
            match found {
                Ok(r) => {
                    out!("{}", setups::show(&r));
                    Code::Ok
                }
                Err(why) => fail(why),
            }
        }
        Some(SetupsCmd::Diff { a: x, b: y, .. }) => {
            // The newest load of another setup than `good`: after a
            // rollback, the setup that failed.
            let latest = |good: &str| {
                let path = s.state_dir.join(crate::tell::ledger::FILE);
                let loads = crate::tell::ledger::read(&path).map(|(l, _)| l).unwrap_or_default();
                loads
                    .iter()
                    .rev()
                    .find(|r| r.fingerprint != good)
                    .map(|r| r.fingerprint.clone())
                    .ok_or_else(|| format!("no load of another setup than {good} in {}", path.display()))
            };
            let good = || {
                all.first().map(|r| r.fingerprint.clone()).ok_or_else(|| "no setup has reached ready yet".to_string())
            };
            let ids = match (x, y) {
                (Some(x), Some(y)) => Ok((x.clone(), y.clone())),
                (Some(x), None) => good().map(|g| (g, x.clone())),
                (None, _) => good().and_then(|g| latest(&g).map(|l| (g, l))),
            };
            let pair = ids.and_then(|(x, y)| {
                Ok((setups::find(&s.state_dir, &s.name, &x)?, setups::find(&s.state_dir, &s.name, &y)?))
            });
            match pair {
                Ok((x, y)) => {
                    out!("{}", setups::diff(&x, &y));
                    Code::Ok
                }
                Err(why) => fail(why),
            }
        }
    }
}

fn golden_cmd(config: &Path, a: &args::GoldenArgs) -> Code {
    use crate::observe::golden;
    use crate::util::escape::one_line;
    use args::GoldenCmd;
    let s = match lenient(config) {
        Ok(s) => s,
        Err(code) => return code,
    };
    if let Err(code) = readable(&s, &[golden::FOLDER]) {
        return code;
    }
    let fail = |e: String| {
        eprintln!("vllm-warden: {e}");
        Code::NoReport
    };
    match a.what.as_ref().unwrap_or(&GoldenCmd::Show { name: None }) {
        GoldenCmd::Show { .. } => {
            // What can be read is shown; what cannot is said (and `accept`
            // replaces an unreadable store).
            let mut code = Code::Ok;
            let mut unreadable = |e: String, then: &str| {
                eprintln!("vllm-warden: {}{then}", one_line(&e, 1000));
                code = Code::NoReport;
            };
            match golden::last(&s.state_dir) {
                Ok(Some(l)) => outln!(
                    "last check: {} at {}, setup {}: {}",
                    one_line(&l.verdict, 40),
                    one_line(&l.at, 40),
                    one_line(&l.fingerprint, 40),
                    one_line(&l.text, 400)
                ),
                Ok(None) => outln!("no golden check yet"),
                Err(e) => unreadable(e, ""),
            }
            let refs = golden::references(&s.state_dir).unwrap_or_else(|e| {
                let then = "; the next check is a warning, and `vllm-warden golden accept` makes the last answers \
                            the reference in a new file";
                unreadable(e, then);
                Vec::new()
            });
            for r in &refs {
                outln!("reference of setup {} (recorded {}):", one_line(&r.fingerprint, 40), one_line(&r.at, 40));
                for a in &r.answers.answers {
                    outln!(
                        "  {:?} → {:?} ({} tokens)",
                        one_line(&a.prompt, 200),
                        one_line(&a.text, 400),
                        a.tokens.len()
                    );
                }
            }
            code
        }
        GoldenCmd::Diff { .. } => match golden::diff(&s.state_dir) {
            Some(text) => {
                for line in text.lines() {
                    outln!("{}", one_line(line, 2000));
                }
                Code::Ok
            }
            None => fail("no golden answers to compare yet (a check with a reference before it)".into()),
        },
        GoldenCmd::Accept { .. } => match golden::accept(&s.state_dir) {
            Ok(done) => {
                if let Some(e) = &done.replaced {
                    outln!(
                        "the golden references were unreadable ({}): set aside as {}/{}, a new store begun",
                        one_line(e, 1000),
                        golden::FOLDER,
                        golden::UNREADABLE
                    );
                }
                outln!(
                    "the last answers are the reference of setup {}: the next start compares against them",
                    one_line(&done.fingerprint, 40)
                );
                Code::Ok
            }
            Err(e) => fail(e),
        },
    }
}

fn patch(config: &Path, a: &PatchArgs) -> Code {
    let s = match load(config) {
        Ok(s) => s,
        Err(code) => return code,
    };
    let say = |what: &str| eprintln!("vllm-warden: {what}");
    let wait = crate::patch::Wait::Block(&say);
    let result = if a.revert {
        crate::patch::revert(&s.patches, &s.state_dir, a.force, wait).map(|done| {
            for f in &done.ignored {
                eprintln!("vllm-warden: {}: in the manifest, but no [[patch]] names it: left as it is", f.display());
            }
            if done.restored.is_empty() {
                outln!("nothing to restore");
            }
            for f in done.restored {
                outln!("{}: restored", f.display());
            }
        })
    } else if a.dry_run {
        crate::patch::by_file(&s.patches).iter().try_for_each(|fp| {
            let plan = crate::patch::plan(fp)?;
            if plan.changes() {
                out!("{}", plan.diff());
            } else {
                outln!("{}: unchanged", plan.file.display());
            }
            Ok(())
        })
    } else {
        crate::patch::apply(&s.patches, &s.state_dir, wait).map(|applied| {
            for a in applied {
                outln!("{a}");
            }
        })
    };
    match result {
        Ok(()) => Code::Ok,
        Err(e) => {
            eprintln!("vllm-warden: {e}");
            Code::PatchFailed
        }
    }
}

fn run(
    path: &Path,
    log_format: crate::util::logging::Format,
    colour: Colour,
    upgraded: Option<PathBuf>,
    passed: crate::daemon::front::listen::Inherited,
) -> Code {
    let settings = match load(path) {
        Ok(s) => s,
        Err(code) => match upgraded.as_ref().and_then(|_| running_config(path)) {
            Some(s) => s,
            None => return code,
        },
    };
    // An upgrade's lock: the descriptor the predecessor left open on the
    // instance's lock file, found whatever the state file says (a state
    // file that cannot be used must not make this warden meet its own
    // lock). Then the state, checked against the live system and the lock.
    if upgraded.is_some() {
        // What the predecessor kept open for this warden is found by what
        // it is, and never reaches a process this warden starts.
        crate::daemon::upgrade::close_inherited_on_exec();
    }
    let inherited = upgraded.as_ref().and_then(|_| crate::process::lock::InstanceLock::inherited(&settings.state_dir));
    let adopted = upgraded.map(|p| {
        let state = crate::daemon::upgrade::read(&p, &settings.name, &settings.child.log_file)?;
        let held = inherited.as_ref().map(|l| std::os::fd::AsRawFd::as_raw_fd(&l.fd()));
        if held != Some(state.lock_fd) {
            return Err(crate::daemon::upgrade::UpgradeError::NotTheLock(state.lock_fd));
        }
        Ok(state)
    });
    // The front door's sockets an upgrading predecessor kept open: those
    // its state names, once checked; found by what they are when the state
    // cannot be used (they are open all the same, and no other warden may
    // bind the address while they are).
    let listeners = match &adopted {
        Some(Ok(state)) => {
            let named: Vec<_> = state.listeners.iter().map(|l| (l.fd, l.address.clone())).collect();
            crate::daemon::front::listen::Inherited::handed_over(&named, &[state.lock_fd, state.pipe_fd, state.log_fd])
        }
        Some(Err(_)) => crate::daemon::front::listen::Inherited::found(),
        None => passed,
    };
    // Before anything else: a second warden of this instance touches nothing.
    let lock = match inherited
        .map_or_else(|| crate::process::lock::InstanceLock::take(&settings.state_dir, &settings.name), Ok)
    {
        Ok(l) => l,
        Err(e) => {
            eprintln!("vllm-warden: {e}");
            return match e {
                crate::process::lock::LockError::Held { .. } => Code::AlreadyRunning,
                crate::process::lock::LockError::Io { .. } => Code::Config,
            };
        }
    };
    crate::util::logging::init(log_format, colour);
    // What the operator's setup risks (caches lost at every restart …),
    // said by `run`; never by the demo, whose setup is its own.
    for w in crate::daemon::environment::describe_child(&settings).1 {
        tracing::warn!(INSTANCE = settings.name.as_str(), EVENT = "caches", "{w}");
    }
    let from_upgrade = adopted.is_some();
    let adopted = match adopted {
        Some(Ok(state)) => Some(state),
        Some(Err(why)) => {
            tracing::error!(
                EVENT = "upgrade",
                "the upgrade's state is unusable ({why}): stopping what the predecessor left and starting again"
            );
            None
        }
        None => None,
    };
    let handover = crate::daemon::Handover {
        exe: std::env::current_exe().ok(),
        lock_fd: Some(std::os::fd::AsRawFd::as_raw_fd(&lock.fd())),
        adopted,
        from_upgrade,
        listeners,
        kept: Vec::new(),
    };
    let rt = match crate::daemon::runtime() {
        Ok(rt) => rt,
        Err(code) => return code,
    };
    let code = rt.block_on(async {
        let requests = match signal_requests() {
            Ok(r) => r,
            Err(e) => {
                tracing::error!(error = %e, "cannot listen for signals");
                return Code::Internal;
            }
        };
        // Only now, with the handlers in place: a signal blocked by whoever
        // started the warden (or by an upgrading predecessor, across its
        // exec) reaches its handler, never the default action.
        if let Err(e) = crate::process::child::unblock_all_signals() {
            tracing::error!(error = %e, "cannot unblock signals");
            return Code::Internal;
        }
        // In the foreground the status is printed too: nobody reads
        // `STATUS=` there (under systemd, `systemctl status` shows it).
        let notifier: Box<dyn notify::Notifier> = if crate::util::logging::to_journal() {
            Box::new(SdNotifier::from_env())
        } else {
            Box::new(notify::Foreground::new(SdNotifier::from_env()))
        };
        crate::daemon::run(settings, notifier, notify::watchdog_interval(), requests, handover).await
    });
    // A blocking read of a stuck file or command must not hold the exit.
    rt.shutdown_timeout(std::time::Duration::from_secs(1));
    code
}

/// The config an upgraded warden's predecessor ran (`running.toml` in the
/// state folder), when the file no longer validates: an upgrade changes
/// the binary, not the config, and must not stop a serving model over a
/// typo made since (a reload would have refused it the same way).
fn running_config(path: &Path) -> Option<Settings> {
    let dirs = Dirs::from_env();
    let (s, _) = config::load_lenient(path, &dirs);
    if !config::valid_name(&s.name) {
        return None;
    }
    let running = crate::daemon::reload::running_path(&s.state_dir);
    let bytes = crate::process::prestart::read_state_file(&running, 1 << 20).ok()?;
    let settings = config::parse(&String::from_utf8_lossy(&bytes), path, &dirs).ok()?;
    eprintln!(
        "vllm-warden: {}: the config does not validate: going on with the one the model was started with ({}); fix the file, then reload",
        settings.name,
        running.display()
    );
    Some(settings)
}

/// Ask the running warden of the instance to upgrade in place: SIGUSR2 to
/// the lock's holder, once it is seen to be a `vllm-warden run` process.
fn upgrade(path: &Path) -> Code {
    let settings = match lenient(path) {
        Ok(s) => s,
        Err(code) => return code,
    };
    let pid = match crate::process::lock::InstanceLock::holder(&settings.state_dir) {
        Ok(Some(pid)) => pid,
        Ok(None) => {
            eprintln!("vllm-warden: instance {:?} is not running", settings.name);
            return Code::NotRunning;
        }
        Err(e) if e.kind() == std::io::ErrorKind::PermissionDenied => {
            // Not "not running": the lock is the service's, and a warden
            // may well hold it.
            eprintln!(
                "vllm-warden: {}: permission denied: cannot read the instance's lock in {} ({e}): run this as the service's user or root",
                settings.name,
                settings.state_dir.display()
            );
            return Code::NoPermission;
        }
        Err(e) => {
            eprintln!("vllm-warden: {}: cannot read the instance's lock: {e}", settings.name);
            return Code::Internal;
        }
    };
    let cmdline = std::fs::read(format!("/proc/{pid}/cmdline")).unwrap_or_default();
    let args: Vec<&[u8]> = cmdline.split(|b| *b == 0).collect();
    let ours = args.first().is_some_and(|a| a.ends_with(b"vllm-warden") || a.ends_with(b"vllm-warden (deleted)"))
        && args.get(1).is_some_and(|a| *a == b"run");
    if !ours {
        eprintln!("vllm-warden: pid {pid}, named by the lock, is not a vllm-warden run process: not signalled");
        return Code::NotRunning;
    }
    match nix::sys::signal::kill(nix::unistd::Pid::from_raw(pid as i32), nix::sys::signal::Signal::SIGUSR2) {
        Ok(()) => {
            outln!("asked pid {pid} to upgrade in place; it does so once the model is ready (see the journal)");
            Code::Ok
        }
        Err(nix::errno::Errno::EPERM) => {
            eprintln!(
                "vllm-warden: cannot signal pid {pid}: permission denied: run this as the service's user or root"
            );
            Code::NoPermission
        }
        Err(e) => {
            eprintln!("vllm-warden: cannot signal pid {pid}: {e}");
            Code::Internal
        }
    }
}

/// SIGTERM and SIGINT ask for a stop, SIGHUP for a reload, SIGUSR2 for an
/// upgrade in place. Needs a runtime.
fn signal_requests() -> std::io::Result<impl Stream<Item = Request>> {
    use tokio::signal::unix::{SignalKind, signal};
    use tokio_stream::wrappers::SignalStream;
    let on = |kind: SignalKind, request: Request| -> std::io::Result<_> {
        Ok(SignalStream::new(signal(kind)?).map(move |()| request))
    };
    let stop = on(SignalKind::terminate(), Request::Stop)?.merge(on(SignalKind::interrupt(), Request::Stop)?);
    Ok(stop.merge(on(SignalKind::hangup(), Request::Reload)?).merge(on(SignalKind::user_defined2(), Request::Upgrade)?))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn asked(args: &[&str]) -> Colour {
        colour_asked(args.iter().map(std::ffi::OsString::from))
    }

    #[test]
    fn the_colour_is_read_ahead_of_clap_wherever_it_is() {
        assert_eq!(asked(&["status"]), Colour::Auto);
        assert_eq!(asked(&["status", "--color", "never"]), Colour::Never);
        assert_eq!(asked(&["--color=always", "loads", "show", "3"]), Colour::Always);
        assert_eq!(asked(&["--color=never", "status", "--color=always"]), Colour::Always, "the last one");
        assert_eq!(asked(&["status", "--", "--color=never"]), Colour::Auto, "not after --");
        assert_eq!(asked(&["status", "--color=blue"]), Colour::Auto, "clap says what is wrong with it");
    }

    #[test]
    fn counts_read_as_words() {
        assert_eq!(count(1, "problem"), "1 problem");
        assert_eq!(count(3, "problem"), "3 problems");
    }
}
