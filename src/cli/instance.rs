//! Which instance a command is about, and every instance of the host.
//!
//! An instance is named as the unit names it: `vllm-warden@kimi` reads
//! `/etc/vllm-warden/kimi.toml`, so `vllm-warden status kimi` reads the
//! same file (the folder moved by `VLLM_WARDEN_CONFIG_DIR`). A command
//! given neither a name nor `-c FILE` takes `$VLLM_WARDEN_CONFIG` (the
//! unit sets it), else the host's only instance: there is no default file
//! that nobody installs. The host's instances are the configs in the
//! config folder and the runtime folders (`/run/vllm-warden/NAME`) that
//! hold a control socket or a status file: a warden started by hand, or
//! one whose config was removed since, is an instance too.
//!
//! Everything read here (folder names) is someone else's: a name that is
//! not a valid instance name is left out, never used as a path.

use std::path::{Path, PathBuf};

use crate::config::{self, defaults};

/// The variable that moves the folder of the instances' configs.
pub(crate) const CONFIG_DIR_ENV: &str = "VLLM_WARDEN_CONFIG_DIR";
/// The variable that names the config file (the unit sets it).
pub(crate) const CONFIG_ENV: &str = "VLLM_WARDEN_CONFIG";

/// Why no config could be chosen; each says what to do.
#[derive(Debug, thiserror::Error)]
pub(crate) enum Choice {
    #[error("give the instance's NAME or -c FILE, not both")]
    Both,
    #[error("{}; a config file is given with -c FILE", config::not_a_name(.0))]
    BadName(String),
    #[error("no instance on this host (no NAME.toml in {dir}, none running in {run}): name its config with -c FILE")]
    None { dir: String, run: String },
    #[error("{} instances on this host ({}): name one, e.g. `vllm-warden {cmd} {}`", .names.len(), .names.join(", "), .names[0])]
    Many { names: Vec<String>, cmd: String },
    #[error("no instance {name:?} ({})", known_names(.known, .dir))]
    Unknown { name: String, known: Vec<String>, dir: String },
    #[error("{dir}: cannot list the instances: {source}")]
    Unlisted {
        dir: String,
        #[source]
        source: std::io::Error,
    },
}

/// `known: kimi, tiny`, or where none was found.
fn known_names(known: &[String], dir: &str) -> String {
    if known.is_empty() {
        format!("none on this host: no NAME.toml in {dir}, none running in {}", defaults::RUN_DIR)
    } else {
        format!("known: {}", known.join(", "))
    }
}

/// The folder of the instances' configs.
pub(crate) fn config_dir() -> PathBuf {
    std::env::var_os(CONFIG_DIR_ENV)
        .filter(|v| !v.is_empty())
        .map_or_else(|| PathBuf::from(config::CONFIG_DIR), PathBuf::from)
}

/// Instance `name`'s config file.
pub(crate) fn config_of(name: &str) -> PathBuf {
    config_dir().join(format!("{name}.toml"))
}

/// The config a command reads: `-c FILE`, else NAME's, else
/// `$VLLM_WARDEN_CONFIG`, else the host's only instance's. `cmd` names
/// the command in the message that asks for a name.
pub(crate) fn choose(file: Option<&Path>, name: Option<&str>, cmd: &str) -> Result<PathBuf, Choice> {
    match (file, name) {
        (Some(_), Some(_)) => Err(Choice::Both),
        (Some(f), None) => Ok(f.to_path_buf()),
        (None, Some(n)) if config::valid_name(n) => {
            let config = config_of(n);
            if !is_there(&config) && !has_folders(n) {
                // A typo (`drain kimmi`) is not an instance that is not
                // running: a `preStop: drain` must not skip its drain
                // in silence.
                let known = all().map(|f| f.into_iter().map(|f| f.name).collect()).unwrap_or_default();
                return Err(Choice::Unknown { name: n.to_string(), known, dir: config_dir().display().to_string() });
            }
            Ok(config)
        }
        (None, Some(n)) => Err(Choice::BadName(n.to_string())),
        (None, None) => {
            if let Some(f) = std::env::var_os(CONFIG_ENV).filter(|v| !v.is_empty()) {
                return Ok(PathBuf::from(f));
            }
            let all = all()?;
            match all.as_slice() {
                [one] => Ok(one.config.clone()),
                [] => Err(Choice::None { dir: config_dir().display().to_string(), run: defaults::RUN_DIR.to_string() }),
                many => {
                    Err(Choice::Many { names: many.iter().map(|f| f.name.clone()).collect(), cmd: cmd.to_string() })
                }
            }
        }
    }
}

/// Something is at `path` (a file, a link, even a broken one).
fn is_there(path: &Path) -> bool {
    std::fs::symlink_metadata(path).is_ok()
}

/// Instance `name` has a state or a runtime folder, where the config
/// reader would put them (`$STATE_DIRECTORY`, `$RUNTIME_DIRECTORY`, else
/// the defaults): it ran, or runs, even without a config.
fn has_folders(name: &str) -> bool {
    let dirs = config::Dirs::from_env();
    let state = dirs.state.clone().unwrap_or_else(|| Path::new(defaults::STATE_DIR).join(name));
    is_there(&state) || is_there(&config::runtime_dir(name, &dirs))
}

/// An instance of the host.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Found {
    pub(crate) name: String,
    /// Its config file (`NAME.toml` in the config folder), there or not.
    pub(crate) config: PathBuf,
    /// Whether the config file is there.
    pub(crate) configured: bool,
}

/// Every instance of the host, by name: a `NAME.toml` in the config
/// folder, or a folder of [`defaults::RUN_DIR`] holding a control socket
/// or a status file. A config folder that is not there has no instances;
/// one that cannot be read is an error (the list would be wrong).
pub(crate) fn all() -> Result<Vec<Found>, Choice> {
    all_in(&config_dir(), Path::new(defaults::RUN_DIR))
}

/// [`all`], with the config folder `dir` and the runtime folders in `run_dir`.
fn all_in(dir: &Path, run_dir: &Path) -> Result<Vec<Found>, Choice> {
    let mut names = std::collections::BTreeMap::new();
    match std::fs::read_dir(dir) {
        Ok(entries) => {
            for e in entries.flatten() {
                let path = e.path();
                let Some(name) = path.file_name().and_then(|n| n.to_str()).and_then(|n| n.strip_suffix(".toml")) else {
                    continue;
                };
                // A file, or a link to one (a config kept elsewhere).
                if config::valid_name(name) && path.is_file() {
                    names.insert(name.to_string(), true);
                }
            }
        }
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
        Err(source) => return Err(Choice::Unlisted { dir: dir.display().to_string(), source }),
    }
    if let Ok(entries) = std::fs::read_dir(run_dir) {
        for e in entries.flatten() {
            let Some(name) = e.file_name().to_str().map(str::to_string) else { continue };
            let run = e.path();
            let live = listened(&run.join(defaults::SOCKET)) || run.join("status.json").exists();
            if config::valid_name(&name) && live {
                names.entry(name).or_insert(false);
            }
        }
    }
    Ok(names
        .into_iter()
        .map(|(name, configured)| Found { config: dir.join(format!("{name}.toml")), name, configured })
        .collect())
}

/// Someone listens on the unix socket at `path`, or may (this user may
/// not connect, or its queue is full): a connection tried without
/// waiting. A socket nobody listens on (left by a warden that was killed)
/// is no running instance.
pub(crate) fn listened(path: &Path) -> bool {
    use nix::errno::Errno;
    use nix::sys::socket::{AddressFamily, SockFlag, SockType, UnixAddr, connect, socket};
    let Ok(addr) = UnixAddr::new(path) else { return false };
    let Ok(fd) = socket(AddressFamily::Unix, SockType::Stream, SockFlag::SOCK_NONBLOCK | SockFlag::SOCK_CLOEXEC, None)
    else {
        // Cannot tell: as before, what is there counts.
        return path.exists();
    };
    match connect(std::os::fd::AsRawFd::as_raw_fd(&fd), &addr) {
        Ok(()) | Err(Errno::EAGAIN | Errno::EINPROGRESS | Errno::EACCES | Errno::EPERM) => true,
        Err(_) => false,
    }
}

/// One request over the control socket, answered within `timeout`.
pub(crate) fn ask(
    socket: &Path,
    method: &str,
    path: &str,
    timeout: std::time::Duration,
) -> Result<(u16, String), crate::daemon::server::client::ClientError> {
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().map_err(|source| {
        crate::daemon::server::client::ClientError::Connect { path: socket.display().to_string(), source }
    })?;
    rt.block_on(crate::daemon::server::client::call_within(socket, method, path, timeout))
}

/// What can be seen of an instance's state.
#[derive(Debug, Clone)]
pub(crate) enum Seen {
    Verdict(Box<crate::tell::summary::StatusVerdict>),
    /// Neither the control socket nor the status file may be read by this
    /// user: a warden may well run. Why, in a sentence.
    Denied(String),
    /// No warden answers, and the status file is there but cannot be read
    /// (a FIFO, a device, too large, not a file). Why, in a sentence.
    Unreadable(String),
}

/// The instance's status: from its warden (the control socket) when one
/// answers, else from the status file. "Not running" only when that is
/// what was seen, never when this user was refused.
pub(crate) fn look(s: &crate::config::Settings, timeout: std::time::Duration) -> Seen {
    use crate::daemon::server::client::ClientError;
    let denied = |e: &std::io::Error| e.kind() == std::io::ErrorKind::PermissionDenied;
    let socket = match ask(&s.server.socket, "GET", "/status", timeout) {
        Ok((200, body)) => return Seen::Verdict(Box::new(crate::tell::summary::verdict(&body))),
        Err(ClientError::Connect { source, .. }) if denied(&source) => Some(source),
        _ => None,
    };
    match crate::tell::summary::read(&s.status.file) {
        Ok(v) => Seen::Verdict(Box::new(v)),
        Err(e) if denied(&e) => {
            let socket = socket.map_or_else(String::new, |e| format!(", nor open {} ({e})", s.server.socket.display()));
            Seen::Denied(format!("permission denied: cannot read {} ({e}){socket}", s.status.file.display()))
        }
        Err(e) => Seen::Unreadable(format!(
            "no warden answers on {}, and its status file {} cannot be read: {e}",
            s.server.socket.display(),
            s.status.file.display()
        )),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Issue 56: a warden that ended before it served (its front door's
    /// port taken) left its control socket, which `list` counted as a
    /// running instance, so every command without a NAME refused. A
    /// socket nobody listens on is no instance; one a warden listens on is.
    #[test]
    fn a_control_socket_nobody_listens_on_is_no_instance() {
        let d = tempfile::tempdir().unwrap();
        let (configs, run) = (d.path().join("configs"), d.path().join("run"));
        for name in ["dead", "live"] {
            std::fs::create_dir_all(run.join(name)).unwrap();
        }
        drop(std::os::unix::net::UnixListener::bind(run.join("dead").join(defaults::SOCKET)).unwrap());
        let _live = std::os::unix::net::UnixListener::bind(run.join("live").join(defaults::SOCKET)).unwrap();
        assert!(run.join("dead").join(defaults::SOCKET).exists(), "the socket file stays");
        let names: Vec<String> = all_in(&configs, &run).unwrap().into_iter().map(|f| f.name).collect();
        assert_eq!(names, ["live"]);
        assert!(!listened(&d.path().join("nothing-here")));
    }
}
