//! The command line: parsing, the short commands (`check`, `patch`,
//! `status`), and the wiring of `run`: config, logging, signals as a
//! stream of requests, the runtime, then `daemon::run`. What the daemon
//! does is not known here.

pub mod args;
pub mod assets;
pub mod demo;
pub mod loads;
pub mod setups;

use std::path::{Path, PathBuf};

use clap::Parser;
use tokio_stream::{Stream, StreamExt};

use self::args::{Cli, Cmd, PatchArgs, ReportsArgs, ReportsCmd, StatusArgs};
use crate::config::{self, Dirs, Settings};
use crate::daemon::driver::Request;
use crate::observe::notify::{self, SdNotifier};
use crate::supervisor::exit::Code;

/// Parse the arguments, run the command, return its exit code.
pub fn main() -> Code {
    // First, before any thread: an upgrading predecessor's state file.
    let upgraded = crate::daemon::upgrade::take_from_env();
    let cli = Cli::parse();
    match cli.command {
        Cmd::Run(a) => run(&a.config.config, a.log_format, upgraded),
        Cmd::Upgrade(c) => upgrade(&c.config),
        Cmd::Check(c) => match check(&c.config.config) {
            Code::Ok if c.diff => diff(&c.config.config),
            code => code,
        },
        Cmd::Patch(a) => patch(&a),
        Cmd::Status(a) => status(&a),
        Cmd::Drain(c) => control(&c.config, "/drain"),
        Cmd::Undrain(c) => control(&c.config, "/undrain"),
        Cmd::Restart(c) => control(&c.config, "/restart"),
        Cmd::Reports(a) => reports(&a),
        Cmd::Loads(a) => loads_cmd(&a),
        Cmd::Setups(a) => setups_cmd(&a),
        Cmd::Golden(a) => golden_cmd(&a),
        Cmd::Demo => crate::cli::demo::main(),
        Cmd::Assets { dir } => match crate::cli::assets::write(&dir) {
            Ok(()) => Code::Ok,
            Err(e) => {
                eprintln!("vllm-warden: {}: {e}", dir.display());
                Code::Internal
            }
        },
    }
}

fn load(path: &Path) -> Result<Settings, Code> {
    config::load(path, &Dirs::from_env()).map_err(|problems| {
        for p in &problems.0 {
            eprintln!("{p}");
        }
        Code::Config
    })
}

/// Every problem `run` would meet at start, the config's and the
/// environment's together, whatever else is wrong; "valid" only when there
/// is none.
fn check(path: &Path) -> Code {
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
        println!("{}: config of instance {:?} is valid", path.display(), s.name);
        print!("{}", child.unwrap_or_default());
        print!("{}", config::describe_patterns(s));
        return Code::Ok;
    }
    for p in &problems {
        eprintln!("{p}");
    }
    eprintln!("{} problem(s) found", problems.len());
    Code::Config
}

/// What a reload of `path` would do against the running instance's config
/// (`STATE_DIRECTORY/running.toml`, kept by the running warden).
fn diff(path: &Path) -> Code {
    let dirs = Dirs::from_env();
    let Ok(new) = config::load(path, &dirs) else { return Code::Config };
    let running = crate::daemon::reload::running_path(&new.state_dir);
    let text = match crate::process::prestart::read_state_file(&running, 1 << 20) {
        Ok(bytes) => String::from_utf8_lossy(&bytes).into_owned(),
        Err(e) => {
            println!("no running instance to compare with ({}: {e})", running.display());
            return Code::NotRunning;
        }
    };
    let old = match config::parse(&text, path, &dirs) {
        Ok(s) => s,
        Err(p) => {
            eprintln!("{}: the running config no longer reads: {p}", running.display());
            return Code::Config;
        }
    };
    println!("{}", crate::daemon::reload::plan(&old, &new));
    for c in crate::daemon::reload::identity_left(&old, &new) {
        println!("{c}: takes effect when the warden itself restarts");
    }
    Code::Ok
}

fn status(a: &StatusArgs) -> Code {
    let s = match load(&a.config.config) {
        Ok(s) => s,
        Err(code) => return code,
    };
    use crate::observe::status::StatusVerdict;
    // Through the socket when a warden answers there; else the file.
    let verdict = match ask(&s.server.socket, "GET", "/status") {
        Ok((200, body)) => crate::observe::status::verdict(&body),
        _ => crate::observe::status::read(&s.status.file),
    };
    if a.json {
        match &verdict {
            StatusVerdict::Ready(d) | StatusVerdict::NotReady(d) | StatusVerdict::NotRunning(Some(d)) => {
                // A document read back from JSON serialises again.
                println!("{}", serde_json::to_string_pretty(d).unwrap_or_default())
            }
            StatusVerdict::NotRunning(None) => eprintln!("{}: no status file", s.status.file.display()),
        }
    } else {
        println!("{}", crate::observe::status::summary(&verdict));
    }
    match verdict {
        StatusVerdict::Ready(_) => Code::Ok,
        StatusVerdict::NotReady(_) => Code::NotReady,
        StatusVerdict::NotRunning(_) => Code::NotRunning,
    }
}

/// How long a local command waits for the warden's answer.
const ANSWER_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(10);

/// One request over the control socket.
fn ask(socket: &Path, method: &str, path: &str) -> Result<(u16, String), crate::daemon::server::client::ClientError> {
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().map_err(|source| {
        crate::daemon::server::client::ClientError::Connect { path: socket.display().to_string(), source }
    })?;
    rt.block_on(crate::daemon::server::client::call_within(socket, method, path, ANSWER_TIMEOUT))
}

/// `drain`, `undrain`, `restart`: a POST over the control socket.
fn control(config: &Path, path: &str) -> Code {
    let s = match load(config) {
        Ok(s) => s,
        Err(code) => return code,
    };
    match ask(&s.server.socket, "POST", path) {
        Ok((code, body)) => {
            let body = crate::util::escape::one_line(body.trim_end(), crate::util::escape::MAX_LINE);
            match code {
                200..=299 => {
                    println!("{}: {body}", s.name);
                    Code::Ok
                }
                409 => {
                    eprintln!("{}: {body}", s.name);
                    Code::NotReady
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

fn reports(a: &ReportsArgs) -> Code {
    let s = match load(&a.config.config) {
        Ok(s) => s,
        Err(code) => return code,
    };
    let all = match crate::observe::reports::list(&s.state_dir, &s.name) {
        Ok(all) => all,
        Err(e) => {
            eprintln!("vllm-warden: {}: {e}", s.state_dir.join(crate::observe::reports::FOLDER).display());
            return Code::NoReport;
        }
    };
    let pick = |id: &Option<String>| -> Result<crate::observe::reports::Listed, Code> {
        let found: Vec<&crate::observe::reports::Listed> = match id {
            None => all.last().into_iter().collect(),
            Some(id) => all.iter().filter(|r| r.name.starts_with(id.as_str())).collect(),
        };
        match found.as_slice() {
            [one] => Ok((*one).clone()),
            [] => {
                let what =
                    id.as_deref().map_or("any".to_string(), |i| format!("{:?}", crate::util::escape::one_line(i, 200)));
                eprintln!(
                    "vllm-warden: no failure report {what} in {}",
                    s.state_dir.join(crate::observe::reports::FOLDER).display()
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
        None | Some(ReportsCmd::List) => {
            if all.is_empty() {
                println!("no failure reports in {}", s.state_dir.join(crate::observe::reports::FOLDER).display());
            } else {
                print!("{}", crate::observe::reports::table(&all));
            }
            Code::Ok
        }
        Some(ReportsCmd::Show { id }) => match pick(id) {
            Ok(r) => {
                print!("{}", crate::observe::reports::show(&r));
                Code::Ok
            }
            Err(code) => code,
        },
        Some(ReportsCmd::Path { id }) => match pick(id) {
            Ok(r) => {
                println!("{}", r.path.display());
                Code::Ok
            }
            Err(code) => code,
        },
    }
}

fn loads_cmd(a: &args::LoadsArgs) -> Code {
    use args::LoadsCmd;
    let s = match load(&a.config.config) {
        Ok(s) => s,
        Err(code) => return code,
    };
    let path = s.state_dir.join(crate::observe::ledger::FILE);
    let all = match crate::observe::ledger::read(&path) {
        Ok((all, _)) => all,
        Err(e) => {
            eprintln!("vllm-warden: {}: {e}", path.display());
            return Code::NoReport;
        }
    };
    let pick = |id: Option<u64>| -> Result<&crate::supervisor::load::LoadRecord, Code> {
        let found = match id {
            None => all.last(),
            Some(id) => all.iter().find(|r| r.id == id),
        };
        found.ok_or_else(|| {
            let what = id.map_or("any load".to_string(), |i| format!("load {i}"));
            eprintln!("vllm-warden: no {what} in {}", path.display());
            Code::NoReport
        })
    };
    match &a.what {
        None | Some(LoadsCmd::List) => {
            if all.is_empty() {
                println!("no loads in {}", path.display());
            } else {
                print!("{}", loads::table(&all));
            }
            Code::Ok
        }
        Some(LoadsCmd::Show { id }) => match pick(*id) {
            Ok(r) => {
                print!("{}", loads::show(r));
                Code::Ok
            }
            Err(code) => code,
        },
        Some(LoadsCmd::Compare { a, b }) => match (pick(Some(*a)), pick(Some(*b))) {
            (Ok(x), Ok(y)) => {
                print!("{}", loads::compare(x, y));
                Code::Ok
            }
            (Err(code), _) | (_, Err(code)) => code,
        },
    }
}

fn setups_cmd(a: &args::SetupsArgs) -> Code {
    use args::SetupsCmd;
    let s = match load(&a.config.config) {
        Ok(s) => s,
        Err(code) => return code,
    };
    let all = crate::observe::setups::list(&s.state_dir);
    let fail = |why: String| {
        eprintln!("vllm-warden: {why}");
        Code::NoReport
    };
    match &a.what {
        None | Some(SetupsCmd::List) => {
            if all.is_empty() {
                println!("no setup has reached ready yet ({})", s.state_dir.join("setups").display());
            } else {
                print!("{}", setups::table(&all));
            }
            Code::Ok
        }
        Some(SetupsCmd::Show { id }) => {
            let found = match id {
                Some(id) => crate::observe::setups::find(&s.state_dir, id),
                None => all.first().cloned().ok_or_else(|| "no setup has reached ready yet".to_string()),
            };
            match found {
                Ok(r) => {
                    print!("{}", setups::show(&r));
                    Code::Ok
                }
                Err(why) => fail(why),
            }
        }
        Some(SetupsCmd::Diff { a: x, b: y }) => {
            // The newest load of another setup than `good`: after a
            // rollback, the setup that failed.
            let latest = |good: &str| {
                let path = s.state_dir.join(crate::observe::ledger::FILE);
                let loads = crate::observe::ledger::read(&path).map(|(l, _)| l).unwrap_or_default();
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
            let pair = ids.and_then(|(x, y)| Ok((setups::find(&s.state_dir, &x)?, setups::find(&s.state_dir, &y)?)));
            match pair {
                Ok((x, y)) => {
                    print!("{}", setups::diff(&x, &y));
                    Code::Ok
                }
                Err(why) => fail(why),
            }
        }
    }
}

fn golden_cmd(a: &args::GoldenArgs) -> Code {
    use crate::observe::golden;
    use crate::util::escape::one_line;
    use args::GoldenCmd;
    let s = match load(&a.config.config) {
        Ok(s) => s,
        Err(code) => return code,
    };
    let fail = |e: String| {
        eprintln!("vllm-warden: {e}");
        Code::NoReport
    };
    match a.what.as_ref().unwrap_or(&GoldenCmd::Show) {
        GoldenCmd::Show => {
            let (refs, last) = match (golden::references(&s.state_dir), golden::last(&s.state_dir)) {
                (Ok(r), Ok(l)) => (r, l),
                (Err(e), _) | (_, Err(e)) => return fail(e),
            };
            match &last {
                Some(l) => println!(
                    "last check: {} at {}, setup {}: {}",
                    one_line(&l.verdict, 40),
                    one_line(&l.at, 40),
                    one_line(&l.fingerprint, 40),
                    one_line(&l.text, 400)
                ),
                None => println!("no golden check yet"),
            }
            for r in &refs {
                println!("reference of setup {} (recorded {}):", one_line(&r.fingerprint, 40), one_line(&r.at, 40));
                for a in &r.answers.answers {
                    println!(
                        "  {:?} → {:?} ({} tokens)",
                        one_line(&a.prompt, 200),
                        one_line(&a.text, 400),
                        a.tokens.len()
                    );
                }
            }
            Code::Ok
        }
        GoldenCmd::Diff => match golden::diff(&s.state_dir) {
            Some(text) => {
                for line in text.lines() {
                    println!("{}", one_line(line, 2000));
                }
                Code::Ok
            }
            None => fail("no golden answers to compare yet (a check with a reference before it)".into()),
        },
        GoldenCmd::Accept => match golden::accept(&s.state_dir) {
            Ok(fp) => {
                println!(
                    "the last answers are the reference of setup {}: the next start compares against them",
                    one_line(&fp, 40)
                );
                Code::Ok
            }
            Err(e) => fail(e),
        },
    }
}

fn patch(a: &PatchArgs) -> Code {
    let s = match load(&a.config.config) {
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
                println!("nothing to restore");
            }
            for f in done.restored {
                println!("{}: restored", f.display());
            }
        })
    } else if a.dry_run {
        crate::patch::by_file(&s.patches).iter().try_for_each(|fp| {
            let plan = crate::patch::plan(fp)?;
            if plan.changes() {
                print!("{}", plan.diff());
            } else {
                println!("{}: unchanged", plan.file.display());
            }
            Ok(())
        })
    } else {
        crate::patch::apply(&s.patches, &s.state_dir, wait).map(|applied| {
            for a in applied {
                println!("{a}");
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

fn run(path: &Path, log_format: crate::util::logging::Format, upgraded: Option<PathBuf>) -> Code {
    let settings = match load(path) {
        Ok(s) => s,
        Err(code) => return code,
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
    crate::util::logging::init(log_format);
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
        crate::daemon::run(settings, SdNotifier::from_env(), notify::watchdog_interval(), requests, handover).await
    });
    // A blocking read of a stuck file or command must not hold the exit.
    rt.shutdown_timeout(std::time::Duration::from_secs(1));
    code
}

/// Ask the running warden of the instance to upgrade in place: SIGUSR2 to
/// the lock's holder, once it is seen to be a `vllm-warden run` process.
fn upgrade(path: &Path) -> Code {
    let settings = match load(path) {
        Ok(s) => s,
        Err(code) => return code,
    };
    let pid = match crate::process::lock::InstanceLock::holder(&settings.state_dir) {
        Ok(Some(pid)) => pid,
        Ok(None) => {
            eprintln!("vllm-warden: instance {:?} is not running", settings.name);
            return Code::NotRunning;
        }
        Err(e) => {
            eprintln!("vllm-warden: cannot read the instance's lock: {e}");
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
            println!("asked pid {pid} to upgrade in place; it does so once the model is ready (see the journal)");
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
