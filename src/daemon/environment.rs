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
pub(crate) fn check_environment(s: &Settings) -> Vec<Problem> {
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
        && let Err(e) = crate::daemon::server::read_token(file)
    {
        say(format!("`server.token-file`: {e}"));
    }
    if s.golden.enabled
        && let Err(e) = crate::observe::golden::prompts(&s.golden)
    {
        say(e);
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
    for listen in s.front.iter().flat_map(|f| &f.listen) {
        if let crate::config::Listen::Unix(path) = listen
            && let Err(e) = crate::daemon::front::listen::unix_path_usable(path)
        {
            say(e.to_string());
        }
    }
    let tcp = s.front.iter().flat_map(|f| &f.listen).filter_map(|l| match l {
        crate::config::Listen::Tcp(a) => Some(("front.listen", *a)),
        crate::config::Listen::Unix(_) => None,
    });
    for (key, addr) in tcp.chain(s.server.listen.map(|a| ("server.listen", a))) {
        if let Some(who) = address_taken(addr, &s.state_dir) {
            say(format!("`{key}` {addr}: {who}: `run` could not listen there"));
        }
    }
    out
}

/// Who holds `addr`, when a listener could not be bound there now (as the
/// warden binds it: `SO_REUSEADDR`, an IPv6 address IPv6-only); none when
/// it could, or when only the instance's own running warden (the holder of
/// its lock) or systemd (a `.socket` unit, or the warden's sockets in its
/// store) holds it, which `run` is given, or when no holder can be seen
/// by this user.
fn address_taken(addr: std::net::SocketAddr, state_dir: &Path) -> Option<String> {
    use socket2::{Domain, Socket, Type};
    let socket = Socket::new(Domain::for_address(addr), Type::STREAM, None).ok()?;
    let _ = socket.set_reuse_address(true);
    if addr.is_ipv6() {
        let _ = socket.set_only_v6(true);
    }
    match socket.bind(&addr.into()) {
        Err(e) if e.kind() == io::ErrorKind::AddrInUse => {}
        _ => return None,
    }
    let ours: Vec<i32> = std::iter::once(1)
        .chain(crate::process::lock::InstanceLock::holder(state_dir).ok().flatten().map(|p| p as i32))
        .collect();
    let holders = crate::process::prestart::port_holders(addr.port());
    // A holder this user cannot see is left to `run`, which names it or is
    // given the socket: under the shipped unit `check` runs as the service
    // user, and across `systemctl restart` the front door's sockets wait in
    // systemd's store, held by PID 1, whose descriptors it may not read.
    if holders.is_empty() || holders.iter().any(|(pid, _)| ours.contains(pid)) {
        return None;
    }
    Some(crate::process::prestart::describe_holders(addr.port()))
}

/// What keeps the child from starting, as this process's user (the
/// child's) sees it: its program (and, for a script, the interpreter of
/// its `#!` line: a venv's `python3` is a link that may lead where the
/// service user cannot go), the model folder of `vllm serve`, a model of
/// the hub that cannot be read, and the folders the child writes. Checked
/// by `check` and before every start, so that such a start fails in a
/// second with the path, the uid and the fix, not after a load.
pub(crate) fn child_problems(s: &Settings) -> Vec<String> {
    let mut out = program_problems(s);
    out.extend(model_problems(s));
    out.extend(crate::process::caches::problems(&crate::process::caches::of(s)).0);
    out
}

/// The program of `child.command`, and the interpreter of its `#!` line,
/// as this user may run them.
pub(crate) fn program_problems(s: &Settings) -> Vec<String> {
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
    out
}

/// The model of a vLLM command, as this user may read it: a local folder
/// (or file), or a model of the hub. What may come right by itself (a
/// mount not there yet) is worth a retry: the pre-start step counts these
/// as transient.
pub(crate) fn model_problems(s: &Settings) -> Vec<String> {
    let uid = nix::unistd::geteuid();
    if s.profile != crate::config::profile::Profile::Vllm {
        return Vec::new();
    }
    let Some(model) = model_of(&s.child.command) else { return Vec::new() };
    let own_config = s.child.command.iter().any(|a| a == "--hf-config-path" || a.starts_with("--hf-config-path="));
    match Model::of(&model, &child_cwd(s)) {
        Model::Local(dir) => model_folder(&dir, !own_config)
            .err()
            .map(|e| format!("model {}: {e} for uid {uid}", dir.display()))
            .into_iter()
            .collect(),
        Model::Hub(id) => hub(s, &id).1,
        Model::Elsewhere => Vec::new(),
    }
}

/// The setup a start of `s` runs, and its model's weights (a local folder
/// of a vLLM command): the load ledger's facts. Blocking.
pub(crate) fn load_facts(s: &Settings) -> crate::tell::ledger::Facts {
    let model = weights_folder(s);
    let files: Vec<PathBuf> = s.patches.iter().map(|p| p.file.clone()).collect();
    crate::tell::ledger::Facts::gather(&s.child.command, &s.child.env, &files, model.as_deref())
}

/// The folder the child starts in: `child.cwd`, else the warden's.
fn child_cwd(s: &Settings) -> PathBuf {
    s.child.cwd.clone().or_else(|| std::env::current_dir().ok()).unwrap_or_else(|| PathBuf::from("/"))
}

/// What `check` shows of where the child writes and what it reads: each
/// variable with its value and who set it, the model; and the warnings (a
/// cache that will not outlive the service).
pub(crate) fn describe_child(s: &Settings) -> (String, Vec<String>) {
    use std::fmt::Write;
    let writes = crate::process::caches::of(s);
    let mut warnings = crate::process::caches::problems(&writes).1;
    warnings.extend(compile_problems(s));
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
    if s.profile == crate::config::profile::Profile::Vllm
        && let Some(model) = model_of(&s.child.command)
    {
        let mut hub_warnings = Vec::new();
        let said = match Model::of(&model, &child_cwd(s)) {
            Model::Local(p) if p.is_file() => format!("model {}: a local file", p.display()),
            Model::Local(p) => format!("model {}: a local folder", p.display()),
            Model::Hub(id) => {
                let (said, _, w) = hub(s, &id);
                hub_warnings = w;
                said
            }
            Model::Elsewhere => format!("model {model}: elsewhere (not looked at)"),
        };
        let _ = writeln!(out, "{said}");
        warnings.extend(hub_warnings);
    }
    if s.preload.enabled {
        let _ = writeln!(out, "weight-cache daemon: {}", crate::util::redact::command(&s.preload.command));
        match crate::process::preload::host_qualifies(Path::new("/dev")) {
            Ok(found) => {
                let _ = writeln!(out, "  {found}");
            }
            Err(why) => warnings.push(format!("[preload]: {why}")),
        }
    }
    if let Some(front) = &s.front {
        let (said, w) = describe_front(s, front, Path::new("/dev"));
        out.push_str(&said);
        warnings.extend(w);
    }
    (out, warnings)
}

/// Where clients connect and where the engine listens (`[front]`), what an
/// idle engine comes to; a warning where vLLM will refuse sleep mode. vLLM
/// supports it on CUDA, ROCm and XPU only: a host with none of their tools
/// or devices (`nvidia-smi`, `rocm-smi` or `/dev/kfd`, `xpu-smi`) is taken
/// as one where `--enable-sleep-mode` is refused.
fn describe_front(s: &Settings, front: &crate::config::Front, dev: &Path) -> (String, Vec<String>) {
    use std::fmt::Write;
    let mut out = String::new();
    let mut warnings = Vec::new();
    let listen: Vec<String> = front.listen.iter().map(crate::config::Listen::shown).collect();
    let _ = writeln!(out, "front door: clients connect to {}", listen.join(", "));
    if let Some(e) = &s.engine {
        let _ = writeln!(out, "  the engine serves on {} (only the warden reaches it)", e.shown());
    }
    match front.idle_stop {
        None => {}
        Some(after) => {
            let after = humantime::format_duration(after);
            let what = match front.idle_action {
                crate::config::IdleAction::Stop => "stopped".to_string(),
                crate::config::IdleAction::Sleep => format!("put to sleep (level {})", front.idle_sleep_level),
            };
            let _ = writeln!(out, "  after {after} without requests the engine is {what}");
            if front.idle_action == crate::config::IdleAction::Sleep && !sleep_capable(dev) {
                warnings.push(
                    "`idle-action = \"sleep\"`: vLLM supports sleep mode only on CUDA, ROCm and XPU, and none is \
                     found on this host (no nvidia-smi, rocm-smi or /dev/kfd, xpu-smi): vLLM will refuse \
                     `--enable-sleep-mode`"
                        .into(),
                );
            }
        }
    }
    (out, warnings)
}

/// A GPU platform vLLM's sleep mode works on: CUDA, ROCm or XPU.
fn sleep_capable(dev: &Path) -> bool {
    ["nvidia-smi", "rocm-smi", "xpu-smi"].iter().any(|t| which::which(t).is_ok()) || dev.join("kfd").exists()
}

/// Why this user cannot use a file the child needs: run its program, or
/// read its model.
#[derive(Debug, thiserror::Error)]
enum AccessError {
    /// It could not be looked at (missing, or a folder on the way denied).
    #[error("{0}")]
    Metadata(io::Error),
    #[error("not executable ({0})")]
    NotExecutable(io::Error),
    #[error("is not an executable file")]
    NotAFile,
    #[error("cannot be read ({0})")]
    Unreadable(io::Error),
    #[error("has no config.json")]
    NoConfig,
    #[error("cannot be listed ({0})")]
    Unlisted(io::Error),
    /// A file of the model folder (its name one visible line).
    #[error("{name} cannot be read ({source})")]
    FileUnreadable { name: String, source: io::Error },
}

/// `Ok` when this user may run `p` (a file with the right to execute).
fn executable(p: &Path) -> Result<(), AccessError> {
    match std::fs::metadata(p) {
        Ok(m) if m.is_file() => nix::unistd::access(p, nix::unistd::AccessFlags::X_OK)
            .map_err(|e| AccessError::NotExecutable(io::Error::from(e))),
        Ok(_) => Err(AccessError::NotAFile),
        Err(e) => Err(AccessError::Metadata(e)),
    }
}

/// The interpreter of a script's `#!` line, when this user cannot run it:
/// its path (for `#!/usr/bin/env NAME`, NAME as found in PATH) and why.
fn interpreter_problem(script: &Path, path: Option<&str>) -> Option<(String, String)> {
    use std::io::Read;
    use std::os::unix::fs::OpenOptionsExt;
    let mut head = [0u8; 4096];
    // Without blocking: a FIFO at the program's path cannot hold `check`.
    let mut file = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NONBLOCK | libc::O_NOCTTY | libc::O_CLOEXEC)
        .open(script)
        .ok()?;
    if !file.metadata().ok()?.is_file() {
        return None;
    }
    let n = file.read(&mut head).ok()?;
    let line = head[..n].strip_prefix(b"#!")?;
    let line = String::from_utf8_lossy(line.split(|b| *b == b'\n').next()?).into_owned();
    let mut words = line.split_whitespace();
    let first = words.next()?;
    let interpreter = if Path::new(first).file_name().is_some_and(|f| f == "env") {
        // `env -S VAR=1 python3 -u`: options and assignments come first.
        let name = words.find(|w| !w.starts_with('-') && !w.contains('='))?;
        match resolve_program(name, path) {
            Some(p) => p,
            None => return Some((name.to_string(), "not found in PATH".into())),
        }
    } else {
        PathBuf::from(first)
    };
    executable(&interpreter).err().map(|e| (interpreter.display().to_string(), e.to_string()))
}

/// The model of `vllm serve MODEL` (the last `--model` wins, as in
/// vLLM's argument parser), or of `python -m vllm.entrypoints… --model
/// MODEL`, as written. `None` for any other program (a container or a
/// remote shell that runs vLLM elsewhere: its paths are not this host's).
pub(crate) fn model_of(command: &[String]) -> Option<String> {
    let name = |a: &String| Path::new(a).file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default();
    let program = name(command.first()?);
    let args = &command[1..];
    let positional = if program == "vllm" && args.first().is_some_and(|a| a == "serve") {
        args.get(1).filter(|a| !a.starts_with('-')).cloned()
    } else if program.starts_with("python")
        && args.windows(2).any(|w| w[0] == "-m" && (w[1] == "vllm" || w[1].starts_with("vllm.")))
    {
        None
    } else {
        return None;
    };
    let mut flag = None;
    let mut it = args.iter();
    while let Some(a) = it.next() {
        if a == "--model" {
            flag = it.next().cloned().or(flag);
        } else if let Some(m) = a.strip_prefix("--model=") {
            flag = Some(m.to_string());
        }
    }
    flag.or(positional)
}

/// A model as vLLM reads it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Model {
    /// A folder (or file) on this machine.
    Local(PathBuf),
    /// A repository id of the Hugging Face hub, `org/name` or `name`.
    Hub(String),
    /// An object store (`s3://…`), or a path the warden cannot resolve as
    /// the child would (`~`, a variable): not looked at.
    Elsewhere,
}

impl Model {
    /// As vLLM decides, in the child's working folder `cwd`: what exists
    /// on disk is local, and so is what is written as a path; a name of
    /// one or two plain parts is an id of the hub.
    pub(crate) fn of(model: &str, cwd: &Path) -> Model {
        if model.contains("://") || model.starts_with('~') || model.contains('$') {
            return Model::Elsewhere;
        }
        let p = cwd.join(model);
        if model.starts_with('/') || model.starts_with("./") || model.starts_with("../") {
            return Model::Local(p);
        }
        if std::fs::symlink_metadata(&p).is_ok() {
            return Model::Local(p);
        }
        let plain = |part: &str| {
            !part.is_empty() && part.chars().all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.'))
        };
        let parts: Vec<&str> = model.split('/').collect();
        if parts.len() <= 2 && parts.iter().all(|p| plain(p)) {
            Model::Hub(model.to_string())
        } else {
            Model::Elsewhere
        }
    }
}

/// The files of a model folder that vLLM reads: configs, tokenizers,
/// weights. Others (a README, a `.git` folder) are not its business.
fn read_by_vllm(name: &str) -> bool {
    let ext = Path::new(name).extension().map(|e| e.to_string_lossy().to_ascii_lowercase()).unwrap_or_default();
    matches!(
        ext.as_str(),
        "json" | "safetensors" | "bin" | "pt" | "pth" | "gguf" | "model" | "tiktoken" | "txt" | "jinja"
    )
}

/// `Ok` when the model folder can be read, with its `config.json` (or
/// `params.json`, Mistral's format; not asked for when `need_config` is
/// false: `--hf-config-path` names another), and every file in it that
/// vLLM reads (configs, tokenizer, weights; links followed, as into a
/// Hugging Face cache's blobs); a single file (GGUF) must be readable.
fn model_folder(p: &Path, need_config: bool) -> Result<(), AccessError> {
    use nix::unistd::{AccessFlags, access};
    let readable = |f: &Path| access(f, AccessFlags::R_OK).map_err(io::Error::from);
    let m = std::fs::metadata(p).map_err(AccessError::Metadata)?;
    if m.is_file() {
        return readable(p).map_err(AccessError::Unreadable);
    }
    access(p, AccessFlags::R_OK | AccessFlags::X_OK).map_err(|e| AccessError::Unreadable(io::Error::from(e)))?;
    // Looked at, never opened: a FIFO in its place must not hang a check.
    let config =
        ["config.json", "params.json"].iter().find(|n| std::fs::metadata(p.join(n)).is_ok_and(|m| m.is_file()));
    if need_config && config.is_none() {
        return Err(AccessError::NoConfig);
    }
    let entries = std::fs::read_dir(p).map_err(AccessError::Unlisted)?;
    let mut names: Vec<_> = entries.flatten().map(|e| e.path()).collect();
    names.sort();
    for f in names {
        let name = f.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default();
        if read_by_vllm(&name)
            && std::fs::metadata(&f).is_ok_and(|m| m.is_file())
            && let Err(source) = readable(&f)
        {
            // A name from the model folder: shown as one visible line.
            let name = crate::util::escape::one_line(&name, crate::util::escape::MAX_LINE);
            return Err(AccessError::FileUnreadable { name, source });
        }
    }
    Ok(())
}

/// The hub's cache folder as the child finds it, from the variables
/// `get` gives (the child's, the warden's, the warden's cache folders).
fn hub_cache(get: &dyn Fn(&str) -> Option<String>) -> PathBuf {
    get("HF_HUB_CACHE").or_else(|| get("HUGGINGFACE_HUB_CACHE")).map(PathBuf::from).unwrap_or_else(|| {
        let home = get("HF_HOME").map(PathBuf::from).unwrap_or_else(|| {
            let xdg = get("XDG_CACHE_HOME").map(PathBuf::from);
            xdg.unwrap_or_else(|| Path::new(&get("HOME").unwrap_or_else(|| "/".into())).join(".cache"))
                .join("huggingface")
        });
        home.join("hub")
    })
}

/// The folder of the model's weights as vLLM will read them: a local
/// folder, or the hub cache's snapshot of a hub model (its `--revision`,
/// else `main`, as `refs/` names it); none for anything else (an object
/// store, ModelScope, a model not in the cache yet). Blocking.
pub(crate) fn weights_folder(s: &Settings) -> Option<PathBuf> {
    if s.profile != crate::config::profile::Profile::Vllm {
        return None;
    }
    let model = model_of(&s.child.command)?;
    match Model::of(&model, &child_cwd(s)) {
        Model::Local(dir) => dir.is_dir().then_some(dir),
        Model::Hub(id) => {
            let writes = crate::process::caches::of(s);
            let get = |k: &str| {
                s.child
                    .env
                    .get(k)
                    .cloned()
                    .or_else(|| std::env::var(k).ok())
                    .or_else(|| writes.iter().find(|v| v.name == k).map(|v| v.value.display().to_string()))
                    .filter(|v| !v.is_empty())
            };
            if get("VLLM_USE_MODELSCOPE").is_some_and(|v| matches!(v.to_ascii_lowercase().as_str(), "1" | "true"))
                || get("VLLM_MODEL_REDIRECT_PATH").is_some()
            {
                return None;
            }
            let cache = hub_cache(&get);
            if !cache.is_absolute() {
                return None;
            }
            let repo = cache.join(format!("models--{}", id.replace('/', "--")));
            let revision = crate::config::command::vllm_flag(&s.child.command, "--revision");
            let revision = revision.as_deref().unwrap_or("main");
            snapshot(&repo, revision)
        }
        Model::Elsewhere => None,
    }
}

/// The snapshot folder of `revision` in a hub cache's `repo` folder: a
/// commit's own folder, or the commit a ref's file names. The cache is
/// someone else's: a ref is read bounded and must be one plain name.
fn snapshot(repo: &Path, revision: &str) -> Option<PathBuf> {
    let plain =
        |r: &str| !r.is_empty() && r.len() <= 128 && r.chars().all(|c| c.is_ascii_alphanumeric() || "-_.".contains(c));
    if !plain(revision) || revision.starts_with('.') {
        return None;
    }
    let direct = repo.join("snapshots").join(revision);
    if direct.is_dir() {
        return Some(direct);
    }
    let file = repo.join("refs").join(revision);
    let text = crate::util::fsutil::read_small(&file, 256, crate::util::fsutil::Links::Follow).ok()?;
    let text = String::from_utf8_lossy(&text);
    let commit = text.trim();
    (plain(commit) && !commit.starts_with('.')).then(|| repo.join("snapshots").join(commit)).filter(|d| d.is_dir())
}

/// What `check` says of a model of the hub, and the problems: whether it is
/// read offline (`HF_HUB_OFFLINE`), from which hub cache, and, when a
/// download may happen, whether the service user can write that cache.
/// Returns what to say, the problems, and the warnings.
pub(crate) fn hub(s: &Settings, id: &str) -> (String, Vec<String>, Vec<String>) {
    let writes = crate::process::caches::of(s);
    let get = |k: &str| {
        s.child
            .env
            .get(k)
            .cloned()
            .or_else(|| std::env::var(k).ok())
            .or_else(|| writes.iter().find(|v| v.name == k).map(|v| v.value.display().to_string()))
            .filter(|v| !v.is_empty())
    };
    let uid = nix::unistd::geteuid();
    if ["VLLM_USE_MODELSCOPE"]
        .iter()
        .any(|k| get(k).is_some_and(|v| matches!(v.to_ascii_lowercase().as_str(), "1" | "true")))
        || get("VLLM_MODEL_REDIRECT_PATH").is_some()
    {
        return (format!("model {id}: from ModelScope or a redirect (not looked at)"), vec![], vec![]);
    }
    let cache = hub_cache(&get);
    if !cache.is_absolute() || cache.to_string_lossy().contains(['~', '$']) {
        return (
            format!("model {id}: from the Hugging Face hub, cache {} (not looked at)", cache.display()),
            vec![],
            vec![],
        );
    }
    let offline = ["HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"]
        .iter()
        .find(|k| get(k).is_some_and(|v| matches!(v.to_ascii_lowercase().as_str(), "1" | "on" | "yes" | "true")));
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
            (said, problems, vec![])
        }
        None => {
            let said = format!(
                "model {id}: from the Hugging Face hub, online: downloaded into {} when missing or changed",
                cache.display()
            );
            let var = crate::process::caches::Var {
                name: "HF_HUB_CACHE".into(),
                value: cache.clone(),
                kind: crate::process::caches::Kind::Cache,
                ours: false,
            };
            // A warning, not a problem: a complete cache still serves while
            // the hub says it is current.
            let warnings = crate::process::caches::problems(&[var])
                .0
                .into_iter()
                .map(|_| {
                    format!(
                        "model {id}: the hub cache {} is not writable by uid {uid}, so a download (a missing or \
                         changed file) would fail: set HF_HUB_OFFLINE = \"1\" in child.env with the model in the \
                         cache, or HF_HOME in child.env to a folder the service user can write (and ReadWritePaths= \
                         for it)",
                        cache.display()
                    )
                })
                .collect();
            (said, vec![], warnings)
        }
    }
}

/// Why the warden could not use `dir` as its state directory (its lock,
/// its record of the tree, the patches), if it could not: it must be a
/// folder the warden can write, or one it can create.
fn state_directory(dir: &Path) -> Option<String> {
    use crate::util::fsutil::Unwritable;
    let shown = dir.display();
    let uid = nix::unistd::geteuid();
    match crate::util::fsutil::writable_folder(dir) {
        Ok(()) => match std::fs::symlink_metadata(dir.join("lock")) {
            Ok(l) if !l.is_file() => Some(format!(
                "state directory {shown}: its lock {}/lock is {}, not a regular file",
                shown,
                crate::util::fsutil::kind_of(&l)
            )),
            _ => None,
        },
        Err(Unwritable::Denied(e)) => Some(format!("state directory {shown}: not writable by uid {uid}: {e}")),
        Err(Unwritable::NotAFolder(kind)) => Some(format!("state directory {shown}: is {kind}, not a folder")),
        Err(Unwritable::ParentNotAFolder(p)) => {
            Some(format!("state directory {shown}: cannot be created: {} is not a folder", p.display()))
        }
        Err(Unwritable::ParentDenied(p, e)) => Some(format!(
            "state directory {shown}: cannot be created: {} is not writable by uid {uid}: {e}",
            p.display()
        )),
        Err(Unwritable::NoParent) => None,
        Err(Unwritable::Other(e)) => Some(format!("state directory {shown}: {e}")),
    }
}

/// What torch inductor needs to build vLLM's kernels and cannot find for
/// this user (`check` runs as the service user under the unit): a vLLM
/// command that compiles (no `--enforce-eager`) fails at its first
/// compile without them, on every start.
pub(crate) fn compile_problems(s: &Settings) -> Vec<String> {
    if s.profile != crate::config::profile::Profile::Vllm || model_of(&s.child.command).is_none() {
        return Vec::new();
    }
    let path = s.child.env.get("PATH").cloned().or_else(|| std::env::var("PATH").ok()).unwrap_or_default();
    let program = resolve_program(s.child.command.first().map_or("", String::as_str), Some(&path));
    let missing = compile_missing(&s.child.command, &path, program.as_deref());
    if missing.is_empty() {
        return Vec::new();
    }
    vec![format!(
        "the command compiles vLLM's kernels with torch inductor (no --enforce-eager), but {} cannot be found \
         for uid {}: every start would fail at the compile; install them (Debian: apt install g++ python3-dev \
         openssl) or add --enforce-eager",
        missing.join(", "),
        nix::unistd::geteuid()
    )]
}

/// [`compile_problems`]' findings: what is missing on `path` (a C++
/// compiler, `openssl`) and beside `program`'s Python (its headers).
fn compile_missing(command: &[String], path: &str, program: Option<&Path>) -> Vec<&'static str> {
    if command.iter().any(|a| a == "--enforce-eager" || a == "--enforce_eager" || a == "-O0") {
        return Vec::new();
    }
    let found = |name: &str| which::which_in(name, Some(path), "/").is_ok();
    let mut missing = Vec::new();
    if !["g++", "c++", "clang++"].into_iter().any(found) {
        missing.push("a C++ compiler (g++)");
    }
    if !found("openssl") {
        missing.push("openssl");
    }
    if program.is_some_and(|p| !python_headers(p)) {
        missing.push("the Python headers (Python.h)");
    }
    missing
}

/// Whether the Python of the venv `program` is in has its headers: the
/// base installation's `include/pythonX.Y/Python.h`, as `pyvenv.cfg`
/// names it. True when that cannot be told (not a venv).
fn python_headers(program: &Path) -> bool {
    let Some(venv) = program.parent().and_then(Path::parent) else { return true };
    let Ok(cfg) =
        crate::util::fsutil::read_small(&venv.join("pyvenv.cfg"), 64 << 10, crate::util::fsutil::Links::Follow)
    else {
        return true;
    };
    let cfg = String::from_utf8_lossy(&cfg);
    let key = |k: &str| {
        cfg.lines().find_map(|l| {
            let (a, b) = l.split_once('=')?;
            (a.trim() == k).then(|| b.trim().to_string())
        })
    };
    let (Some(home), Some(version)) = (key("home"), key("version").or_else(|| key("version_info"))) else {
        return true;
    };
    let short: Vec<&str> = version.split('.').take(2).collect();
    let Some(prefix) = Path::new(&home).parent() else { return true };
    let include = format!("include/python{}", short.join("."));
    [prefix.join(&include), venv.join(&include)].iter().any(|d| d.join("Python.h").is_file())
}

/// A program name as `execvp` would find it.
pub(crate) fn resolve_program(program: &str, path_override: Option<&str>) -> Option<PathBuf> {
    if program.contains('/') {
        return Some(PathBuf::from(program));
    }
    let path = path_override.map(String::from).or_else(|| std::env::var("PATH").ok()).unwrap_or_default();
    path.split(':').filter(|d| !d.is_empty()).map(|d| Path::new(d).join(program)).find(|p| p.is_file())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn argv(s: &str) -> Vec<String> {
        s.split_whitespace().map(String::from).collect()
    }

    /// `check` says where clients connect and where the engine serves,
    /// and what an idle engine comes to; sleep mode on a host with none of
    /// CUDA, ROCm, XPU is a warning (a ROCm device counts as one).
    #[test]
    fn check_says_where_clients_connect_and_warns_where_sleep_mode_is_refused() {
        let text = "name = \"k\"\n[child]\ncommand = [\"vllm\", \"serve\", \"/m\", \"--enable-sleep-mode\"]\n\
                    [front]\nlisten = [\"0.0.0.0:8000\", \"unix:/run/k.sock\"]\nidle-stop = \"30m\"\nidle-action = \"sleep\"\n";
        let dirs = crate::config::Dirs { runtime: Some("/run/vllm-warden/k".into()), ..Default::default() };
        let s = crate::config::parse(text, Path::new("/etc/vllm-warden/k.toml"), &dirs).unwrap();
        let front = s.front.clone().unwrap();
        let t = tempfile::tempdir().unwrap();
        std::fs::write(t.path().join("kfd"), "").unwrap();
        let (said, warnings) = describe_front(&s, &front, t.path());
        assert_eq!(
            said,
            "front door: clients connect to 0.0.0.0:8000, unix:/run/k.sock\n  the engine serves on \
             unix:/run/vllm-warden/k/engine/engine.sock (only the warden reaches it)\n  after 30m without requests \
             the engine is put to sleep (level 1)\n"
        );
        assert!(warnings.is_empty(), "{warnings:?}");
        if !sleep_capable(Path::new("/nonexistent")) {
            let (_, warnings) = describe_front(&s, &front, Path::new("/nonexistent"));
            assert!(warnings[0].contains("vLLM will refuse `--enable-sleep-mode`"), "{warnings:?}");
        }
    }

    /// Only vLLM's own command lines name a model of this host; the last
    /// `--model` wins, as in vLLM's parser.
    /// What inductor needs, looked for on the child's PATH and beside its
    /// venv's Python; nothing asked of a command that does not compile.
    #[test]
    fn a_compiling_command_names_what_inductor_misses() {
        use std::os::unix::fs::PermissionsExt;
        let d = tempfile::tempdir().unwrap();
        let bin = d.path().join("bin");
        std::fs::create_dir(&bin).unwrap();
        let tool = |name: &str| {
            std::fs::write(bin.join(name), "#!/bin/sh\n").unwrap();
            std::fs::set_permissions(bin.join(name), std::fs::Permissions::from_mode(0o755)).unwrap();
        };
        let venv = d.path().join("venv");
        std::fs::create_dir_all(venv.join("bin")).unwrap();
        let base = d.path().join("base");
        std::fs::write(venv.join("pyvenv.cfg"), format!("home = {}/bin\nversion = 3.11.2\n", base.display())).unwrap();
        let vllm = venv.join("bin/vllm");
        let path = bin.to_str().unwrap();
        let cmd = argv("vllm serve /m");
        assert_eq!(
            compile_missing(&cmd, path, Some(&vllm)),
            ["a C++ compiler (g++)", "openssl", "the Python headers (Python.h)"]
        );
        tool("g++");
        tool("openssl");
        std::fs::create_dir_all(base.join("include/python3.11")).unwrap();
        std::fs::write(base.join("include/python3.11/Python.h"), "").unwrap();
        assert!(compile_missing(&cmd, path, Some(&vllm)).is_empty());
        std::fs::remove_file(bin.join("openssl")).unwrap();
        assert_eq!(compile_missing(&cmd, path, Some(&vllm)), ["openssl"]);
        assert!(compile_missing(&argv("vllm serve /m --enforce-eager"), path, Some(&vllm)).is_empty());
    }

    #[test]
    fn the_model_is_read_from_vllms_command_lines_only() {
        assert_eq!(model_of(&argv("/opt/v/bin/vllm serve /m --port 8")).as_deref(), Some("/m"));
        assert_eq!(model_of(&argv("vllm serve /m --model /a --model=/b")).as_deref(), Some("/b"));
        assert_eq!(model_of(&argv("vllm serve --port 8 --model /a")).as_deref(), Some("/a"));
        assert_eq!(model_of(&argv("python3 -m vllm.entrypoints.openai.api_server --model /a")).as_deref(), Some("/a"));
        for elsewhere in [
            "docker run -v /srv:/models vllm/vllm-openai --model /models/l",
            "ssh gpu1 vllm serve /models/l",
            "systemd-cat -t serve vllm serve /m",
            "vllm-warden-sim --port 8",
        ] {
            assert_eq!(model_of(&argv(elsewhere)), None, "{elsewhere}");
        }
    }

    #[test]
    fn a_model_is_local_on_the_hub_or_elsewhere_as_vllm_sees_it() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::create_dir(dir.path().join("llama")).unwrap();
        let cwd = dir.path();
        assert_eq!(Model::of("./llama", cwd), Model::Local(cwd.join("./llama")));
        assert_eq!(Model::of("llama", cwd), Model::Local(cwd.join("llama")), "a folder in the child's cwd");
        assert_eq!(Model::of("/srv/m", cwd), Model::Local(PathBuf::from("/srv/m")));
        assert_eq!(Model::of("org/name-1.5", cwd), Model::Hub("org/name-1.5".into()));
        assert_eq!(Model::of("gpt2", cwd), Model::Hub("gpt2".into()));
        for elsewhere in ["s3://bucket/models/l", "~/models/l", "$MODELS/l", "a/b/c"] {
            assert_eq!(Model::of(elsewhere, cwd), Model::Elsewhere, "{elsewhere}");
        }
    }

    /// A FIFO where config.json should be is not opened (a check must not
    /// hang); files vLLM does not read are not its business.
    #[test]
    fn a_model_folder_is_looked_at_never_opened() {
        let dir = tempfile::tempdir().unwrap();
        nix::unistd::mkfifo(&dir.path().join("config.json"), nix::sys::stat::Mode::S_IRWXU).unwrap();
        assert_eq!(model_folder(dir.path(), true).unwrap_err().to_string(), "has no config.json");
        assert!(model_folder(dir.path(), false).is_ok(), "--hf-config-path names another");
        assert!(read_by_vllm("model-00001-of-00064.safetensors") && read_by_vllm("tokenizer.model"));
        assert!(!read_by_vllm("README.md") && !read_by_vllm(".gitattributes"));
    }

    #[test]
    fn an_env_s_line_names_its_program() {
        let dir = tempfile::tempdir().unwrap();
        let script = dir.path().join("s");
        std::fs::write(&script, "#!/usr/bin/env -S PYTHONUNBUFFERED=1 no-such-python-here -u\n").unwrap();
        let (name, why) = interpreter_problem(&script, Some("/usr/bin:/bin")).unwrap();
        assert_eq!((name.as_str(), why.as_str()), ("no-such-python-here", "not found in PATH"));
        std::fs::write(&script, "#!/usr/bin/env -S PYTHONUNBUFFERED=1 sh -e\n").unwrap();
        assert_eq!(interpreter_problem(&script, Some("/usr/bin:/bin")), None);
    }
}
