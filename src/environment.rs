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
    for problem in child_problems(s) {
        say(problem);
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

/// What keeps the child from starting, as this process's user (the
/// child's) sees it: its program (and, for a script, the interpreter of
/// its `#!` line: a venv's `python3` is a link that may lead where the
/// service user cannot go), the model folder of `vllm serve`, a model of
/// the hub that cannot be read, and the folders the child writes. Checked
/// by `check` and before every start, so that such a start fails in a
/// second with the path, the uid and the fix, not after a load.
pub fn child_problems(s: &Settings) -> Vec<String> {
    let mut out = Vec::new();
    let uid = nix::unistd::geteuid();
    let program = s.child.command.first().map_or("", String::as_str);
    if !program.is_empty() {
        match resolve_program(program, s.child.env.get("PATH").map(String::as_str)) {
            Some(p) => {
                if let Err(e) = executable(&p) {
                    out.push(format!("`command`: {}: {e} for uid {uid}", p.display()));
                } else if let Some((interpreter, e)) =
                    interpreter_problem(&p, s.child.env.get("PATH").map(String::as_str))
                {
                    out.push(format!(
                        "`command`: {} runs {interpreter} (its #! line): {e} for uid {uid}; the service user must \
                         be able to run it (a venv made from an interpreter under a 0700 home is not)",
                        p.display()
                    ));
                }
            }
            None => out.push(format!("`command`: program {program:?} not found in PATH")),
        }
    }
    if s.profile == crate::profile::Profile::Vllm
        && let Some(model) = model_of(&s.child.command)
    {
        match Model::of(&model) {
            Model::Local(dir) => {
                out.extend(model_folder(&dir).err().map(|e| format!("model {}: {e} for uid {uid}", dir.display())))
            }
            Model::Hub(id) => out.extend(hub(s, &id).1),
        }
    }
    let writes = crate::caches::of(s);
    out.extend(crate::caches::problems(&writes).0);
    out
}

/// What `check` shows of where the child writes and what it reads: each
/// variable with its value and who set it, the model; and the warnings (a
/// cache that will not outlive the service).
pub fn describe_child(s: &Settings) -> (String, Vec<String>) {
    use std::fmt::Write;
    let writes = crate::caches::of(s);
    let mut out = String::new();
    if !writes.is_empty() {
        let _ = writeln!(out, "the child's caches and sockets:");
        for v in &writes {
            let by = if v.ours {
                "set by the warden"
            } else if s.child.env.contains_key(&v.name) {
                "from child.env"
            } else {
                "from the warden's environment"
            };
            let _ = writeln!(out, "  {}={} ({by})", v.name, v.value.display());
        }
    }
    if s.profile == crate::profile::Profile::Vllm
        && let Some(model) = model_of(&s.child.command)
    {
        let said = match Model::of(&model) {
            Model::Local(p) => format!("model {}: a local folder, readable", p.display()),
            Model::Hub(id) => hub(s, &id).0,
        };
        let _ = writeln!(out, "{said}");
    }
    (out, crate::caches::problems(&writes).1)
}

/// `Ok` when this user may run `p` (a file with the right to execute).
fn executable(p: &Path) -> Result<(), String> {
    match std::fs::metadata(p) {
        Ok(m) if m.is_file() => nix::unistd::access(p, nix::unistd::AccessFlags::X_OK)
            .map_err(|e| format!("not executable ({})", io::Error::from(e))),
        Ok(_) => Err("is not an executable file".into()),
        Err(e) => Err(e.to_string()),
    }
}

/// The interpreter of a script's `#!` line, when this user cannot run it:
/// its path (for `#!/usr/bin/env NAME`, NAME as found in PATH) and why.
fn interpreter_problem(script: &Path, path: Option<&str>) -> Option<(String, String)> {
    use std::io::Read;
    let mut head = [0u8; 256];
    let n = std::fs::File::open(script).and_then(|mut f| f.read(&mut head)).ok()?;
    let line = head[..n].strip_prefix(b"#!")?;
    let line = String::from_utf8_lossy(line.split(|b| *b == b'\n').next()?).into_owned();
    let mut words = line.split_whitespace();
    let first = words.next()?;
    let interpreter = if Path::new(first).file_name().is_some_and(|f| f == "env") {
        let name = words.find(|w| !w.starts_with('-'))?;
        match resolve_program(name, path) {
            Some(p) => p,
            None => return Some((name.to_string(), "not found in PATH".into())),
        }
    } else {
        PathBuf::from(first)
    };
    executable(&interpreter).err().map(|e| (interpreter.display().to_string(), e))
}

/// The model of `vllm serve MODEL` (or `--model MODEL`), as written.
pub fn model_of(command: &[String]) -> Option<String> {
    if let Some(i) = command.iter().position(|a| a == "--model") {
        return command.get(i + 1).cloned();
    }
    if let Some(m) = command.iter().find_map(|a| a.strip_prefix("--model=")) {
        return Some(m.to_string());
    }
    let serve = command.iter().position(|a| a == "serve")?;
    command.get(serve + 1).filter(|a| !a.starts_with('-')).cloned()
}

/// A model as vLLM reads it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Model {
    /// A folder (or file) on this machine.
    Local(PathBuf),
    /// A repository id of the Hugging Face hub, `org/name`.
    Hub(String),
}

impl Model {
    /// As vLLM decides: what exists on disk is local, and so is what is
    /// written as a path; else an id of the hub.
    pub fn of(model: &str) -> Model {
        let p = Path::new(model);
        let pathlike = model.starts_with('/') || model.starts_with("./") || model.starts_with("../");
        if pathlike || std::fs::symlink_metadata(p).is_ok() || model.split('/').count() > 2 {
            Model::Local(p.to_path_buf())
        } else {
            Model::Hub(model.to_string())
        }
    }
}

/// `Ok` when the model folder can be read, with its `config.json` (or
/// `params.json`, Mistral's format), and every file in it (the weights;
/// links followed, as into a Hugging Face cache's blobs); a single file
/// (GGUF) must be readable.
fn model_folder(p: &Path) -> Result<(), String> {
    use nix::unistd::{AccessFlags, access};
    let m = std::fs::metadata(p).map_err(|e| e.to_string())?;
    if m.is_file() {
        return std::fs::File::open(p).map(drop).map_err(|e| format!("cannot be read ({e})"));
    }
    access(p, AccessFlags::R_OK | AccessFlags::X_OK).map_err(|e| format!("cannot be read ({})", io::Error::from(e)))?;
    let mut config = Err("has no config.json".to_string());
    for name in ["config.json", "params.json"] {
        match std::fs::File::open(p.join(name)) {
            Ok(_) => {
                config = Ok(());
                break;
            }
            Err(e) if e.kind() == io::ErrorKind::NotFound => {}
            Err(e) => config = Err(format!("{name} cannot be read ({e})")),
        }
    }
    config?;
    let entries = std::fs::read_dir(p).map_err(|e| format!("cannot be listed ({e})"))?;
    let mut names: Vec<_> = entries.flatten().map(|e| e.path()).collect();
    names.sort();
    for f in names {
        if std::fs::metadata(&f).is_ok_and(|m| m.is_file())
            && let Err(e) = access(&f, AccessFlags::R_OK)
        {
            let name = f.file_name().map_or_else(|| f.display().to_string(), |n| n.to_string_lossy().into_owned());
            return Err(format!("{name} cannot be read ({})", io::Error::from(e)));
        }
    }
    Ok(())
}

/// What `check` says of a model of the hub, and the problems: whether it is
/// read offline (`HF_HUB_OFFLINE`), from which hub cache, and, when a
/// download may happen, whether the service user can write that cache.
pub fn hub(s: &Settings, id: &str) -> (String, Vec<String>) {
    let writes = crate::caches::of(s);
    let get = |k: &str| {
        s.child
            .env
            .get(k)
            .cloned()
            .or_else(|| std::env::var(k).ok())
            .or_else(|| writes.iter().find(|v| v.name == k).map(|v| v.value.display().to_string()))
            .filter(|v| !v.is_empty())
    };
    let cache = get("HF_HUB_CACHE").map(PathBuf::from).unwrap_or_else(|| {
        let home = get("HF_HOME").map(PathBuf::from).unwrap_or_else(|| {
            let xdg = get("XDG_CACHE_HOME").map(PathBuf::from);
            xdg.unwrap_or_else(|| Path::new(&get("HOME").unwrap_or_else(|| "/".into())).join(".cache"))
                .join("huggingface")
        });
        home.join("hub")
    });
    let offline = ["HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"]
        .iter()
        .find(|k| get(k).is_some_and(|v| matches!(v.to_ascii_lowercase().as_str(), "1" | "on" | "yes" | "true")));
    let uid = nix::unistd::geteuid();
    let folder = cache.join(format!("models--{}", id.replace('/', "--")));
    match offline {
        Some(k) => {
            let said = format!("model {id}: from the Hugging Face hub, offline ({k}=1), read from {}", cache.display());
            let problems = if folder.is_dir() {
                vec![]
            } else {
                vec![format!(
                    "model {id}: not in the hub cache ({} is missing) and {k}=1 forbids a download",
                    folder.display()
                )]
            };
            (said, problems)
        }
        None => {
            let said = format!(
                "model {id}: from the Hugging Face hub, online: downloaded into {} when missing or changed",
                cache.display()
            );
            let var = crate::caches::Var {
                name: "HF_HUB_CACHE".into(),
                value: cache.clone(),
                kind: crate::caches::Kind::Cache,
                ours: false,
            };
            let problems = crate::caches::problems(&[var])
                .0
                .into_iter()
                .map(|_| {
                    format!(
                        "model {id}: the hub cache {} is not writable by uid {uid}, so a download would fail: set \
                         HF_HUB_OFFLINE = \"1\" in child.env with the model in the cache, or HF_HOME in child.env to a \
                         folder the service user can write (and ReadWritePaths= for it)",
                        cache.display()
                    )
                })
                .collect();
            (said, problems)
        }
    }
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
