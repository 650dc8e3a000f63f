//! The world outside the config file, as `check` and a reload see it: the
//! program to run, the working and log folders, the state directory, the
//! files the patches edit and the patches folder. It reads the filesystem
//! and changes nothing. It must not know how the config file is read (that
//! is `config`) nor how patches are applied (it asks `patch`).

use std::io;
use std::path::{Path, PathBuf};

use crate::config::{Problem, Settings};

/// Problems outside the file: the program, the working folder, the log
/// folder, the state directory, the patched files. Values the config left
/// empty because they had a problem of their own are not looked at again.
pub fn check_environment(s: &Settings) -> Vec<Problem> {
    let mut out = Vec::new();
    let mut say = |message: String| out.push(Problem { file: s.source.clone(), at: None, message });
    let program = s.child.command.first().map_or("", String::as_str);
    if !program.is_empty() {
        match resolve_program(program, s.child.env.get("PATH").map(String::as_str)) {
            Some(p) => {
                use std::os::unix::fs::PermissionsExt;
                match std::fs::metadata(&p) {
                    Ok(m) if m.is_file() && m.permissions().mode() & 0o111 != 0 => {}
                    Ok(_) => say(format!("`command`: {} is not an executable file", p.display())),
                    Err(e) => say(format!("`command`: {}: {e}", p.display())),
                }
            }
            None => say(format!("`command`: program {program:?} not found in PATH")),
        }
    }
    if let Some(cluster) = &s.prestart.ray {
        // The Python that asks the cluster: beside the child's program,
        // else on the warden's PATH, as the warden runs it.
        let argv = cluster.command(&s.child.command);
        let python = argv.first().map_or("", String::as_str);
        if resolve_program(python, None).is_none_or(|p| !p.is_file()) {
            say(format!("`prestart.ray-python`: {python:?} not found beside {program:?} nor in PATH"));
        }
    }
    if let Some(file) = &s.server.token_file
        && let Err(e) = crate::server::read_token(file)
    {
        say(format!("`server.token-file`: {e}"));
    }
    if let Some(cwd) = &s.child.cwd
        && !cwd.is_dir()
    {
        say(format!("`cwd`: {} is not a folder", cwd.display()));
    }
    if let Some(dir) = s.child.log_file.parent()
        && let Some(existing) = dir.ancestors().find(|a| a.exists())
        && !existing.is_dir()
    {
        say(format!("`log-file`: {} is not a folder", existing.display()));
    }
    if let Some(problem) = state_directory(&s.state_dir) {
        say(problem);
    }
    for problem in crate::patch::check(&s.patches, &s.state_dir) {
        say(format!("[[patch]] {problem}"));
    }
    out
}

/// Why the warden could not use `dir` as its state directory (its lock,
/// its record of the tree, the patches), if it could not: it must be a
/// folder the warden can write, or one it can create.
fn state_directory(dir: &Path) -> Option<String> {
    let shown = dir.display();
    let writable = |d: &Path| {
        nix::unistd::access(d, nix::unistd::AccessFlags::W_OK | nix::unistd::AccessFlags::X_OK).map_err(io::Error::from)
    };
    let uid = nix::unistd::geteuid();
    match std::fs::metadata(dir) {
        Ok(m) if m.is_dir() => match writable(dir) {
            Ok(()) => match std::fs::symlink_metadata(dir.join("lock")) {
                Ok(l) if !l.is_file() => Some(format!(
                    "state directory {shown}: its lock {}/lock is {}, not a regular file",
                    shown,
                    crate::fsutil::kind_of(&l)
                )),
                _ => None,
            },
            Err(e) => Some(format!("state directory {shown}: not writable by uid {uid}: {e}")),
        },
        Ok(m) => Some(format!("state directory {shown}: is {}, not a folder", crate::fsutil::kind_of(&m))),
        Err(e) if e.kind() == io::ErrorKind::NotFound => {
            let existing = dir.ancestors().skip(1).find(|a| a.exists())?;
            if !existing.is_dir() {
                return Some(format!(
                    "state directory {shown}: cannot be created: {} is not a folder",
                    existing.display()
                ));
            }
            writable(existing).err().map(|e| {
                format!(
                    "state directory {shown}: cannot be created: {} is not writable by uid {uid}: {e}",
                    existing.display()
                )
            })
        }
        Err(e) => Some(format!("state directory {shown}: {e}")),
    }
}

/// A program name as `execvp` would find it.
pub fn resolve_program(program: &str, path_override: Option<&str>) -> Option<PathBuf> {
    if program.contains('/') {
        return Some(PathBuf::from(program));
    }
    let path = path_override.map(String::from).or_else(|| std::env::var("PATH").ok()).unwrap_or_default();
    path.split(':').filter(|d| !d.is_empty()).map(|d| Path::new(d).join(program)).find(|p| p.is_file())
}
