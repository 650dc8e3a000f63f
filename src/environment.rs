//! The world outside the config file, as `check` and a reload see it: the
//! program to run, the working and log folders, the files the patches edit.
//! It reads the filesystem and changes nothing. It must not know how the
//! config file is read (that is `config`) nor how patches are applied (it
//! asks `patch`).

use std::path::{Path, PathBuf};

use crate::config::{Problem, Settings};

/// Problems outside the file: the program, the working folder, the log
/// folder, the patched files.
pub fn check_environment(s: &Settings) -> Vec<Problem> {
    let mut out = Vec::new();
    let mut say = |message: String| out.push(Problem { file: s.source.clone(), at: None, message });
    let program = s.child.command.first().map_or("", String::as_str);
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
    for problem in crate::patch::check(&s.patches, &s.state_dir) {
        say(format!("[[patch]] {problem}"));
    }
    out
}

/// A program name as `execvp` would find it.
pub fn resolve_program(program: &str, path_override: Option<&str>) -> Option<PathBuf> {
    if program.contains('/') {
        return Some(PathBuf::from(program));
    }
    let path = path_override.map(String::from).or_else(|| std::env::var("PATH").ok()).unwrap_or_default();
    path.split(':').filter(|d| !d.is_empty()).map(|d| Path::new(d).join(program)).find(|p| p.is_file())
}
