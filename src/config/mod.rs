//! TOML → validated [`Settings`]: one function per section, each returning
//! its struct, every default a constant in [`defaults`]. Every problem is
//! collected, each naming the file and, where the TOML has one, the line and
//! column.
//!
//! The document is parsed with `toml`'s spanned tree and read key by key
//! (see `reader`), rather than through `#[derive(Deserialize)]`, because
//! serde stops at the first error and `check` must list every one.
//!
//! This must not know processes, tokio or anything outside the one file: the
//! program, folders and patched files are checked by `environment`, and
//! what a patch does is `patch`'s.

pub(crate) mod command;
pub(crate) mod defaults;
pub(crate) mod keys;
pub mod limits;
pub(crate) mod preload;
mod problem;
pub use vllm_warden_core::profile;
mod reader;
mod settings;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::Duration;

use nix::sys::signal::Signal;
use toml::de::{DeTable, DeValue};

use self::command::port_of;
use self::reader::{Keys, Reader, Span, Table, Value, to_json};

use crate::config::profile::{List, Patterns, Profile};
use crate::patch::Patch;

pub(crate) use self::problem::{Problem, Problems};
pub use self::settings::Settings;
pub(crate) use self::settings::{
    Child, Cluster, Drain, Engine, Fatal, Front, Golden, Health, Ledger, Listen, Prefetch, Prestart, Ready, Reports,
    Rollback, Rotation, Server, Status,
};
/// The settings' parts the machine acts on, in the core's vocabulary.
pub use vllm_warden_core::policy::{Fit, FitArg, GoldenPolicy, IdleAction, Restart};

/// The folder of the instances' configs: `NAME.toml` is instance NAME's,
/// as the unit `vllm-warden@NAME` reads it.
pub(crate) const CONFIG_DIR: &str = "/etc/vllm-warden";

/// The directories systemd hands a service (`RuntimeDirectory=` …), read
/// once so that validation stays a pure function of its inputs.
#[derive(Debug, Clone, Default)]
pub struct Dirs {
    pub(crate) runtime: Option<PathBuf>,
    pub(crate) state: Option<PathBuf>,
    pub(crate) logs: Option<PathBuf>,
    pub(crate) cache: Option<PathBuf>,
}

impl Dirs {
    pub(crate) fn from_env() -> Dirs {
        // systemd joins several directories with ':'; the first is ours.
        let first = |var: &str| {
            std::env::var_os(var)
                .and_then(|v| v.to_str().and_then(|s| s.split(':').next()).map(PathBuf::from))
                .filter(|p| !p.as_os_str().is_empty())
        };
        Dirs {
            runtime: first("RUNTIME_DIRECTORY"),
            state: first("STATE_DIRECTORY"),
            logs: first("LOGS_DIRECTORY"),
            cache: first("CACHE_DIRECTORY"),
        }
    }
}

/// Read and validate a config file.
pub fn load(path: &Path, dirs: &Dirs) -> Result<Settings, Problems> {
    let text = read(path).map_err(|p| Problems(vec![p]))?;
    parse(&text, path, dirs)
}

/// The text of a config file: a regular file (or a link to one) of at most
/// [`limits::CONFIG_SIZE`] bytes, read without blocking
/// ([`crate::util::fsutil::read_small`]): a FIFO, a device or a huge file
/// is a problem said at once, never a command that hangs or fills memory.
pub(crate) fn read(path: &Path) -> Result<String, Problem> {
    let problem = |e: &dyn std::fmt::Display| Problem {
        file: path.to_path_buf(),
        at: None,
        message: format!("cannot read config: {e}"),
    };
    let bytes = crate::util::fsutil::read_small(path, limits::CONFIG_SIZE, crate::util::fsutil::Links::Follow)
        .map_err(|e| problem(&e))?;
    String::from_utf8(bytes).map_err(|_| problem(&"not UTF-8 text"))
}

/// Validate config text; `path` names the file in problems and gives the
/// default instance name (its stem). `Err` exactly when a problem was found.
pub fn parse(text: &str, path: &Path, dirs: &Dirs) -> Result<Settings, Problems> {
    match parse_all(text, path, dirs) {
        (Some(settings), problems) if problems.is_empty() => Ok(settings),
        (_, problems) => Err(Problems(problems)),
    }
}

/// Read a config and go on past its problems, for `check`, which lists
/// the environment's problems beside the file's: the settings as far as
/// they could be read (each value with a problem left at its default) and
/// every problem. No settings when the file cannot be read or is not TOML.
pub(crate) fn load_all(path: &Path, dirs: &Dirs) -> (Option<Settings>, Vec<Problem>) {
    match read(path) {
        Ok(text) => parse_all(&text, path, dirs),
        Err(p) => (None, vec![p]),
    }
}

/// A config read as far as it goes, for the commands that need only the
/// instance's name and folders (`status`, `drain`, `loads` …): a broken
/// config must not take the control of a running model away. What the
/// file says where it reads (each value with a problem at its default);
/// when it cannot be read or is not TOML, its `name` if that much reads,
/// else the file's stem, and every default. With every problem found.
pub(crate) fn load_lenient(path: &Path, dirs: &Dirs) -> (Settings, Vec<Problem>) {
    let text = read(path);
    let (settings, problems) = match &text {
        Ok(text) => parse_all(text, path, dirs),
        Err(p) => (None, vec![p.clone()]),
    };
    if let Some(s) = settings {
        return (s, problems);
    }
    // The settings of a config holding its name alone (checked as any
    // name is), whose problems (no command) are not this file's.
    let name = text.ok().and_then(|t| top_level_name(&t));
    let alone = name.map(|n| format!("name = {}\n", toml::Value::String(n))).unwrap_or_default();
    let (settings, _) = parse_all(&alone, path, dirs);
    let mut settings = settings.expect("a name alone is TOML");
    settings.text = String::new();
    (settings, problems)
}

/// The top-level `name` of a document that may not parse as a whole.
fn top_level_name(text: &str) -> Option<String> {
    let (doc, _) = DeTable::parse_recoverable(text);
    match doc.get_ref().get("name").map(|v| v.get_ref()) {
        Some(DeValue::String(s)) => Some(s.to_string()),
        _ => None,
    }
}

fn parse_all(text: &str, path: &Path, dirs: &Dirs) -> (Option<Settings>, Vec<Problem>) {
    let (doc, syntax) = DeTable::parse_recoverable(text);
    let mut r = Reader::new(text, path);
    if !syntax.is_empty() {
        for e in syntax {
            r.problem(e.span(), e.message().trim_end());
        }
        return (None, r.into_problems());
    }
    let mut settings = settings(&mut r, doc.get_ref(), path, dirs);
    settings.text = text.to_string();
    (Some(settings), r.into_problems())
}

/// The whole document, section by section.
fn settings(r: &mut Reader<'_>, doc: &Table<'_>, path: &Path, dirs: &Dirs) -> Settings {
    let mut top = Keys::new(r, Some(doc), None, "", String::new());
    let name = top.read("name", stem_of(path), instance_name);
    let profile = top.read("profile", defaults::PROFILE, profile);
    let [
        child_v,
        patch_v,
        prestart_v,
        ready_v,
        fatal_v,
        restart_v,
        health_v,
        status_v,
        server_v,
        drain_v,
        hint_v,
        reports_v,
        ledger_v,
        golden_v,
        fit_v,
        rollback_v,
        preload_v,
        front_v,
        prefetch_v,
    ] = [
        "child", "patch", "prestart", "ready", "fatal", "restart", "health", "status", "server", "drain", "hint",
        "reports", "ledger", "golden", "fit", "rollback", "preload", "front", "prefetch",
    ]
    .map(|k| top.take(k));
    drop(top);
    // Without a valid `name`, the file's own name is the instance's, and
    // is held to the same rule: `...toml` is not instance `..`.
    if !valid_name(&name) {
        r.problem(
            None,
            format!(
                "the instance is named after the file, and {}: rename the file NAME.toml, or give `name` in it",
                not_a_name(&name)
            ),
        );
    }
    let hints = hints(r, hint_v);

    let mut patterns = profile.patterns();
    let command_span = child_v.and_then(|v| match v.get_ref() {
        DeValue::Table(t) => t.get("command").map(|c| c.span()),
        _ => None,
    });
    let mut child = child(r.section(child_v, "child"), &name, dirs);
    let patches = patches(r, patch_v);
    let prestart = prestart(r.section(prestart_v, "prestart"), profile, &child.command);
    let front = front(r.section(front_v, "front"), profile, &child.command);
    let engine =
        engine(r, front.as_ref(), profile, &child.command, command_span, prestart.port, runtime_dir(&name, dirs));
    // A Ray node serves no HTTP: its readiness is confirmed by the cluster.
    let health_url = engine.as_ref().map(|e| format!("{}/health", engine_base(e)));
    let ready = ready(r.section(ready_v, "ready"), &mut patterns, &health_url, front.as_ref());
    let fatal = fatal(r.section(fatal_v, "fatal"), &mut patterns);
    let restart = restart(r.section(restart_v, "restart"));
    let health = health(r.section(health_v, "health"), &health_url, front.as_ref());
    let status = status(r.section(status_v, "status"), &name, dirs);
    let server = server(r.section(server_v, "server"), &name, dirs);
    let drain = drain(r.section(drain_v, "drain"), server.listen.is_some());
    let reports = reports(r.section(reports_v, "reports"));
    let ledger = ledger(r.section(ledger_v, "ledger"));
    let golden = golden(r.section(golden_v, "golden"), profile == Profile::Vllm && ready.http.is_some());
    let fit = fit(r.section(fit_v, "fit"));
    let rollback = rollback(r.section(rollback_v, "rollback"));
    let prefetch = prefetch(r.section(prefetch_v, "prefetch"));
    // After every section that reads the serve command as the operator wrote it.
    let preload =
        preload::preload(r.section(preload_v, "preload"), &mut child.command, prestart.port, runtime_dir(&name, dirs));
    // The engine's private socket, given to vLLM as the last of its flags.
    if let Some(Engine::Unix(path)) = &engine
        && front.is_some()
    {
        child.command = command::with_flag(&child.command, "--uds", &path.to_string_lossy());
    }
    if let (Some(front), Some(listen)) = (&front, server.listen)
        && front.listen.contains(&Listen::Tcp(listen))
    {
        let span = server_v.map(|v| v.span());
        r.problem(
            span,
            format!("`server.listen` {listen} is also in `front.listen`: give the endpoint its own address"),
        );
    }
    let state_dir = dirs.state.clone().unwrap_or_else(|| PathBuf::from(defaults::STATE_DIR).join(&name));
    Settings {
        source: path.to_path_buf(),
        text: String::new(),
        name,
        profile,
        child,
        patches,
        prestart,
        ready,
        fatal,
        restart,
        health,
        status,
        server,
        drain,
        reports,
        ledger,
        golden,
        fit,
        rollback,
        preload,
        prefetch,
        front,
        engine,
        hints,
        state_dir,
        patterns,
    }
}

/// What an instance's name may be, as messages say it.
pub(crate) const NAME_RULE: &str = "letters, digits, '-', '_' or '.', not beginning with '.'";

/// An instance's name: [`NAME_RULE`]. It names folders and files
/// (`NAME.toml`, `/var/lib/vllm-warden/NAME`, `/run/vllm-warden/NAME`), so
/// `..` or a name with a newline or an escape must never be one. The one
/// rule for a name from anywhere: the `NAME` argument, a config's `name`,
/// a config file's name, a folder of the host's runtime folder.
pub(crate) fn valid_name(n: &str) -> bool {
    !n.is_empty() && n.chars().all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.')) && !n.starts_with('.')
}

/// `".." is not an instance name (letters, …)`: a name refused by
/// [`valid_name`], made one visible line.
pub(crate) fn not_a_name(n: &str) -> String {
    format!("\"{}\" is not an instance name ({NAME_RULE})", crate::util::escape::one_line(n, 200))
}

/// The instance name a config file's own name gives (its stem), before it
/// is checked: `kimi.toml` → `kimi`, `...toml` → `..`.
fn stem_of(path: &Path) -> String {
    path.file_stem().map_or_else(String::new, |s| s.to_string_lossy().into_owned())
}

/// The instance a config file's `text` at `path` names, as [`load`] reads
/// it (`name`, else the file's stem); none when the text is not TOML, its
/// `name` is not a string, or what it names is not an instance name.
pub(crate) fn instance_in(text: &str, path: &Path) -> Option<String> {
    let doc: toml::Table = toml::from_str(text).ok()?;
    let name = match doc.get("name") {
        Some(v) => v.as_str().map(str::to_string),
        None => Some(stem_of(path)),
    };
    name.filter(|n| valid_name(n))
}

fn instance_name(r: &mut Reader<'_>, v: &Value<'_>) -> Option<String> {
    let n = r.string(v, "name")?;
    let ok = valid_name(&n);
    if !ok {
        r.problem(Some(v.span()), format!("`name`: {}", not_a_name(&n)));
    }
    ok.then_some(n)
}

fn profile(r: &mut Reader<'_>, v: &Value<'_>) -> Option<Profile> {
    let p = r.string(v, "profile")?;
    let parsed = Profile::parse(&p);
    if parsed.is_none() {
        r.problem(Some(v.span()), format!("unknown profile {p:?} (known: {})", Profile::NAMES.join(", ")));
    }
    parsed
}

/// `[child]`
fn child(mut k: Keys<'_, '_, '_>, name: &str, dirs: &Dirs) -> Child {
    let command = match k.take("command") {
        Some(v) => command(k.reader(), v),
        None => {
            let span = k.span();
            k.problem(span, "`[child] command` is required: the argv of the server to run");
            Vec::new()
        }
    };
    let env = k.read("env", BTreeMap::new(), |r, v| {
        let t = r.table(v, "env")?;
        let mut env = BTreeMap::new();
        for (key, val) in t.iter() {
            if let Some(s) = r.string(val, &format!("env.{}", key.get_ref())) {
                env.insert(key.get_ref().to_string(), s);
            }
        }
        Some(env)
    });
    let cwd = k.read("cwd", None, |r, v| r.string(v, "cwd").map(|s| Some(PathBuf::from(s))));
    let cache_dir = k.read("cache-dir", dirs.cache.clone(), |r, v| {
        let s = r.string(v, "cache-dir")?;
        if !s.is_empty() && !s.starts_with('/') {
            r.problem(Some(v.span()), "`cache-dir` must be an absolute path, or \"\" for none");
            return None;
        }
        Some((!s.is_empty()).then(|| PathBuf::from(s)))
    });
    let log_dir = dirs.logs.clone().unwrap_or_else(|| PathBuf::from(defaults::LOG_DIR));
    let log_file = k.path("log-file", log_dir.join(format!("{name}.log")));
    let log_rotation = Rotation {
        max_size: k
            .read("log-max-size", defaults::LOG_MAX_SIZE, |r, v| size(r, v, "log-max-size", limits::LOG_MAX_SIZE)),
        keep: k.read("log-keep", defaults::LOG_KEEP, |r, v| {
            r.integer(v, "log-keep", (*limits::LOG_KEEP.end()).into()).and_then(|n| u32::try_from(n).ok())
        }),
        compress: k.read("log-compress", defaults::LOG_COMPRESS, |r, v| r.boolean(v, "log-compress")),
    };
    let stop_signal = k.read("stop-signal", defaults::STOP_SIGNAL, stop_signal);
    let stop_timeout = k.duration("stop-timeout", defaults::STOP_TIMEOUT, limits::WAIT);
    Child {
        command,
        env,
        cwd,
        cache_dir,
        runtime_dir: dirs.runtime.clone(),
        log_file,
        log_rotation,
        stop_signal,
        stop_timeout,
    }
}

fn command(r: &mut Reader<'_>, v: &Value<'_>) -> Vec<String> {
    let Some(command) = r.strings(v, "command") else { return Vec::new() };
    if command.first().is_none_or(String::is_empty) {
        r.problem(Some(v.span()), "`command` must name a program to run");
        return Vec::new();
    }
    if port_of(&command) == Some(0) {
        r.problem(Some(v.span()), "`command`: `--port 0` leaves the port to chance, and the warden must know it");
        return Vec::new();
    }
    command
}

fn stop_signal(r: &mut Reader<'_>, v: &Value<'_>) -> Option<Signal> {
    let s = r.string(v, "stop-signal")?;
    let Some(sig) = parse_signal(&s) else {
        r.problem(Some(v.span()), format!("`stop-signal`: unknown signal {s:?} (e.g. \"SIGTERM\", \"SIGINT\")"));
        return None;
    };
    match not_a_stop_request(sig) {
        None => Some(sig),
        Some(why) => {
            let message = format!(
                "`stop-signal`: {} cannot ask a process to exit gracefully: {why} (e.g. \"SIGTERM\", \"SIGINT\")",
                sig.as_str()
            );
            r.problem(Some(v.span()), message);
            None
        }
    }
}

/// Why `sig` cannot be the first signal of a stop, if it cannot. SIGKILL
/// is refused too: it cannot be caught, so vLLM's API server could not shut
/// its engine down, and a stop sends it anyway once `stop-timeout` is over.
fn not_a_stop_request(sig: Signal) -> Option<&'static str> {
    use Signal::*;
    match sig {
        SIGKILL => Some("it cannot be caught, and a stop sends it anyway after `stop-timeout`"),
        SIGSTOP | SIGTSTP | SIGTTIN | SIGTTOU => Some("it suspends the process"),
        SIGCONT => Some("it resumes a suspended process"),
        SIGCHLD | SIGURG | SIGWINCH => Some("it is ignored unless handled"),
        _ => None,
    }
}

/// `[[patch]]`, each entry.
/// `[[hint]] match = "…", text = "…"`: the config's remedy hints, tried
/// before the profile's.
fn hints(r: &mut Reader<'_>, v: Option<&Value<'_>>) -> Vec<(String, String)> {
    let Some(v) = v else { return Vec::new() };
    let DeValue::Array(items) = v.get_ref() else {
        r.problem(Some(v.span()), "`hint` must be written as [[hint]] tables");
        return Vec::new();
    };
    let mut out = Vec::new();
    for item in items.iter() {
        let Some(t) = r.table(item, "hint") else { continue };
        let mut k = Keys::new(r, Some(t), Some(item.span()), "hint", " in [[hint]]".into());
        let pattern = k.read("match", None, |r, v| r.regex(v, "hint.match").map(Some));
        let text = k.read("text", None, |r, v| r.string(v, "text").map(Some));
        match (pattern, text) {
            (Some(p), Some(t)) if !t.trim().is_empty() => out.push((p, t)),
            (Some(_), Some(_)) => k.problem(Some(item.span()), "`[[hint]]` needs a `text` that says something"),
            _ => k.problem(Some(item.span()), "`[[hint]]` needs `match` (a regular expression) and `text`"),
        }
    }
    out
}

fn patches(r: &mut Reader<'_>, v: Option<&Value<'_>>) -> Vec<Patch> {
    let Some(v) = v else { return Vec::new() };
    let DeValue::Array(items) = v.get_ref() else {
        r.problem(Some(v.span()), "`patch` must be written as [[patch]] tables");
        return Vec::new();
    };
    let mut out = Vec::new();
    for item in items.iter() {
        if let Some(t) = r.table(item, "patch") {
            out.push(patch(Keys::new(r, Some(t), Some(item.span()), "patch", " in [[patch]]".into())));
        }
    }
    out
}

fn patch(mut k: Keys<'_, '_, '_>) -> Patch {
    let file = match k.take("file") {
        Some(v) => k.reader().string(v, "file").map(PathBuf::from).unwrap_or_default(),
        None => {
            let span = k.span();
            k.problem(span, "`[[patch]]` needs `file`");
            PathBuf::new()
        }
    };
    let remove = k.read("remove", Vec::new(), |r, v| {
        let paths = r.strings(v, "remove")?;
        if let DeValue::Array(items) = v.get_ref() {
            for (path, item) in paths.iter().zip(items.iter()) {
                json_path(r, path, item.span());
            }
        }
        Some(paths)
    });
    let mut set = Vec::new();
    if let Some(t) = k.table("set") {
        for (key, val) in t.iter() {
            json_path(k.reader(), key.get_ref(), key.span());
            match to_json(val.get_ref()) {
                Ok(j) => set.push((key.get_ref().to_string(), j)),
                Err(e) => k.problem(Some(val.span()), format!("`set.{}`: {e}", key.get_ref())),
            }
        }
    }
    let max_size = k.read("max-size", None, |r, v| size(r, v, "max-size", limits::PATCH_MAX_SIZE).map(Some));
    if k.ok("remove") && remove.is_empty() && set.is_empty() {
        let span = k.span();
        k.problem(span, "`[[patch]]` changes nothing: give `remove` or `set`");
    }
    Patch { file, remove, set, max_size }
}

/// A size in bytes: an integer, or a string with a binary unit
/// (`"300 MiB"`; `B`, `KiB`, `MiB`, `GiB`), within `range`.
fn size(r: &mut Reader<'_>, v: &Value<'_>, key: &str, range: std::ops::RangeInclusive<u64>) -> Option<u64> {
    let shown = |n: u64| match n {
        n if n >= 1 << 30 && n % (1 << 30) == 0 => format!("{} GiB", n >> 30),
        n if n >= 1 << 20 && n % (1 << 20) == 0 => format!("{} MiB", n >> 20),
        n => format!("{n} bytes"),
    };
    let n = match v.get_ref() {
        DeValue::Integer(i) => reader::parse_int(i.as_str(), i.radix()).and_then(|n| u64::try_from(n).ok()),
        DeValue::String(s) => {
            let s = s.trim();
            let digits = s.find(|c: char| !c.is_ascii_digit()).unwrap_or(s.len());
            let unit = match s[digits..].trim_start() {
                "" | "B" => Some(1u64),
                "KiB" => Some(1 << 10),
                "MiB" => Some(1 << 20),
                "GiB" => Some(1 << 30),
                _ => None,
            };
            match (s[..digits].parse::<u64>(), unit) {
                (Ok(n), Some(unit)) => Some(n.saturating_mul(unit)),
                _ => {
                    let message = format!(
                        "`{key}`: invalid size {s:?} (write a number of bytes, or e.g. \"300 MiB\"; units: B, KiB, \
                         MiB, GiB)"
                    );
                    r.problem(Some(v.span()), message);
                    return None;
                }
            }
        }
        other => {
            let message =
                format!("`{key}` must be a number of bytes or a size such as \"300 MiB\", not {}", other.type_str());
            r.problem(Some(v.span()), message);
            return None;
        }
    };
    match n {
        Some(n) if range.contains(&n) => Some(n),
        _ => {
            let (lo, hi) = (*range.start(), *range.end());
            r.problem(
                Some(v.span()),
                format!("`{key}` must be from {} to {} ({hi} bytes)", shown(lo).trim_end_matches('s'), shown(hi)),
            );
            None
        }
    }
}

/// Checks a dotted JSON path as `patch` reads it: keys between unescaped
/// dots, `\.` for a dot inside a key. An empty key (`a..b`, `.`) or a
/// trailing backslash (`a\`) is almost surely a typo, and is refused.
fn json_path(r: &mut Reader<'_>, path: &str, span: Span) {
    let why = if path.is_empty() {
        ""
    } else if path.ends_with('\\') {
        ": it ends in a lone backslash (`\\.` is a dot inside a key)"
    } else if path.replace("\\.", "x").split('.').any(str::is_empty) {
        ": a key between its dots is empty"
    } else {
        return;
    };
    r.problem(Some(span), format!("`[[patch]]`: {path:?} is not a dotted JSON path{why}"));
}

/// `[prestart]`
fn prestart(mut k: Keys<'_, '_, '_>, profile: Profile, command: &[String]) -> Prestart {
    let clean_shm = k.read("clean-shm", profile.shm_globs(), |r, v| {
        let mut globs = profile.shm_globs();
        for g in r.strings(v, "clean-shm")? {
            if g.is_empty() || g.contains('/') || g == "*" {
                r.problem(
                    Some(v.span()),
                    format!("`clean-shm`: {g:?} must be a file-name glob in /dev/shm, narrower than \"*\""),
                );
            } else {
                globs.push(g);
            }
        }
        Some(globs)
    });
    let port = k.read("port", command::default_port(profile, command), |r, v| {
        let n = r.integer(v, "port", u16::MAX.into())?;
        if n == 0 {
            r.problem(Some(v.span()), "`port` must be at least 1");
            return None;
        }
        u16::try_from(n).ok().map(Some)
    });
    let port_wait = k.duration("port-wait", defaults::PORT_WAIT, limits::WAIT);
    let gpu_idle_wait = k.duration("gpu-idle-wait", defaults::GPU_IDLE_WAIT, limits::WAIT);
    let gpu_query = k.read("gpu-query", defaults::GPU_QUERY.map(String::from).to_vec(), |r, v| {
        let query = r.strings(v, "gpu-query")?;
        if query.first().is_some_and(String::is_empty) {
            r.problem(Some(v.span()), "`gpu-query` must name a program to run, or be [] (no GPU check)");
            return None;
        }
        Some(query)
    });
    let ray = ray_cluster(&mut k, profile, command);
    Prestart { clean_shm, port, port_wait, gpu_idle_wait, gpu_query, ray }
}

/// `prestart.ray-*`: the Ray cluster a start waits for. A node's own
/// command names its cluster (`ray-address` then defaults to it); a joining
/// node waits for its head, a head for nothing.
fn ray_cluster(k: &mut Keys<'_, '_, '_>, profile: Profile, command: &[String]) -> Option<Cluster> {
    let head = profile == Profile::RayHead;
    let own = profile.is_ray().then(|| command::address_in(command, head)).flatten();
    let given = k.read("ray-address", None, |r, v| {
        let a = r.string(v, "ray-address")?;
        if !command::valid_address(&a) {
            r.problem(
                Some(v.span()),
                format!("`ray-address` {a:?} must be HOST:PORT, as `ray start --address` takes it"),
            );
            return None;
        }
        Some(Some(a))
    });
    let min_nodes = k.count("ray-min-nodes", defaults::RAY_MIN_NODES, 1);
    let min_cpus = k.number("ray-min-cpus", 0.0, 0.0, 1e9);
    let min_gpus = k.number("ray-min-gpus", 0.0, 0.0, 1e9);
    let wait = k.duration("ray-wait", defaults::RAY_WAIT, limits::WAIT);
    let python = k.read("ray-python", defaults::RAY_PYTHON.to_string(), |r, v| {
        let p = r.string(v, "ray-python")?;
        if p.is_empty() {
            r.problem(Some(v.span()), "`ray-python` must name the Python that has Ray");
            return None;
        }
        Some(p)
    });
    let thresholds = ["ray-min-nodes", "ray-min-cpus", "ray-min-gpus", "ray-wait"];
    let set: Vec<&str> = thresholds.into_iter().filter(|key| k.span_of(key).is_some()).collect();
    if head && (given.is_some() || !set.is_empty()) {
        let span = k.span_of("ray-address").or_else(|| set.first().and_then(|key| k.span_of(key)));
        k.problem(span, "a `ray-head` starts the cluster and waits for none: `ray-address` and `ray-min-*` are for the nodes and servers that need it");
        return None;
    }
    if given.is_none() && own.is_none() {
        if let Some(key) = set.first() {
            let span = k.span_of(key);
            k.problem(span, format!("`{key}` needs `ray-address`: the cluster to wait for"));
        }
        return None;
    }
    let address = given.or(own)?;
    Some(Cluster { address, python, gate: !head, min_nodes, min_cpus, min_gpus, wait })
}

/// `[ready]`; adds its patterns to the ready and progress lists.
fn ready(
    mut k: Keys<'_, '_, '_>,
    patterns: &mut Patterns,
    health_url: &Option<String>,
    front: Option<&Front>,
) -> Ready {
    k.patterns("log", patterns.list_mut(List::Ready), List::Ready.name());
    let http = k.url("http", health_url.clone());
    not_the_front_door(&mut k, http.as_deref(), front);
    let timeout = k.duration("timeout", defaults::READY_TIMEOUT, limits::START);
    let stall = k.duration("stall", defaults::READY_STALL, limits::START);
    k.patterns("progress", patterns.list_mut(List::Progress), List::Progress.name());
    if http.is_none() && patterns.ready.is_empty() {
        k.problem(
            None,
            "nothing can tell that the server is ready: `ready.log` has no pattern and `ready.http` is off",
        );
    }
    Ready { http, timeout, stall }
}

/// With `[front]`, a check's `http` URL that names one of the front door's
/// own addresses would be answered by the warden itself, holding the
/// request until the engine serves: a readiness check waiting on itself.
/// The default URL reaches the engine on its socket; an address of
/// another server is asked as written.
fn not_the_front_door(k: &mut Keys<'_, '_, '_>, url: Option<&str>, front: Option<&Front>) {
    let (Some(url), Some(front)) = (url, front) else { return };
    let Some(at) = front_address_of(url, front) else { return };
    let span = k.span_of("http");
    let key = k.dotted("http");
    k.problem(
        span,
        format!(
            "`{key}` {url} is the front door's own address {at}: the warden would wait on itself;              leave it unset (the engine is then asked on its private socket)"
        ),
    );
}

/// The address of `front.listen` that `url` names, if any: the same
/// address, or the same port of an address that listens on every
/// interface, asked through loopback (`127.0.0.1`, `[::1]`, `localhost`).
fn front_address_of(url: &str, front: &Front) -> Option<String> {
    let rest = url.strip_prefix("http://")?;
    let authority = rest.split(['/', '?', '#']).next()?;
    let authority = authority.rsplit_once('@').map_or(authority, |(_, a)| a);
    let (host, port) = match authority.parse::<std::net::SocketAddr>() {
        Ok(a) => (Some(a.ip()), a.port()),
        Err(_) => {
            let (host, port) = authority.rsplit_once(':').map_or((authority, "80"), |(h, p)| (h, p));
            let ip = if host.eq_ignore_ascii_case("localhost") {
                Some(std::net::IpAddr::from([127, 0, 0, 1]))
            } else {
                host.trim_matches(['[', ']']).parse().ok()
            };
            (ip, port.parse().ok()?)
        }
    };
    front.listen.iter().find_map(|l| match l {
        Listen::Tcp(a) if a.port() == port => {
            let same = match host {
                Some(ip) => ip == a.ip() || (a.ip().is_unspecified() && (ip.is_loopback() || ip.is_unspecified())),
                // Another machine's name is not known to be this one.
                None => false,
            };
            same.then(|| a.to_string())
        }
        _ => None,
    })
}

/// `[fatal]`; adds its patterns to the fatal, ignore and permanent lists.
fn fatal(mut k: Keys<'_, '_, '_>, patterns: &mut Patterns) -> Fatal {
    for (key, which) in [("match", List::Fatal), ("ignore", List::Ignore), ("permanent", List::Permanent)] {
        k.patterns(key, patterns.list_mut(which), which.name());
    }
    let grace = k.duration("grace", defaults::FATAL_GRACE, limits::WAIT);
    Fatal { grace }
}

/// `[restart]`
fn restart(mut k: Keys<'_, '_, '_>) -> Restart {
    let initial_delay = k.duration("initial-delay", defaults::INITIAL_DELAY, limits::WAIT);
    let max_delay = k.duration("max-delay", defaults::MAX_DELAY, limits::WAIT);
    let factor = k.number("factor", defaults::FACTOR, 1.0, 100.0);
    let jitter = k.number("jitter", defaults::JITTER, 0.0, 1.0);
    let reset_after = k.duration("reset-after", defaults::RESET_AFTER, limits::WAIT);
    let max_attempts = k.count("max-attempts", defaults::MAX_ATTEMPTS, 0);
    let permanent_attempts = k.count("permanent-attempts", defaults::PERMANENT_ATTEMPTS, 1);
    if k.ok("initial-delay") && k.ok("max-delay") && initial_delay > max_delay {
        let span = k.span_of("max-delay");
        k.problem(span, "`max-delay` is shorter than `initial-delay`");
    }
    Restart { initial_delay, max_delay, factor, jitter, reset_after, max_attempts, permanent_attempts }
}

/// `[health]`
fn health(mut k: Keys<'_, '_, '_>, health_url: &Option<String>, front: Option<&Front>) -> Health {
    let http = k.url("http", health_url.clone());
    not_the_front_door(&mut k, http.as_deref(), front);
    let interval = k.duration("interval", defaults::HEALTH_INTERVAL, limits::PERIOD);
    let timeout = k.duration("timeout", defaults::HEALTH_TIMEOUT, limits::PERIOD);
    let failures = k.count("failures", defaults::HEALTH_FAILURES, 1);
    // The canary and the progress check ask the server's API: a child that
    // serves none (a Ray node) has neither unless the config asks.
    let serves = |d: Duration| if health_url.is_some() { d } else { Duration::ZERO };
    let canary_interval = k.duration("canary-interval", serves(defaults::CANARY_INTERVAL), limits::WAIT);
    let canary_timeout = k.duration("canary-timeout", defaults::CANARY_TIMEOUT, limits::PERIOD);
    let progress_stall = k.duration("progress-stall", serves(defaults::PROGRESS_STALL), limits::WAIT);
    let default_source = defaults::KERNEL_MESSAGES.map(String::from).to_vec();
    let kernel_messages = k.read("kernel-messages", default_source, |r, v| r.strings(v, "kernel-messages"));
    if kernel_messages.first().is_some_and(String::is_empty) {
        k.problem(None, "`health.kernel-messages` must name a program to run, or be [] (off)");
    }
    Health { http, interval, timeout, failures, canary_interval, canary_timeout, progress_stall, kernel_messages }
}

/// `[status]`
fn status(mut k: Keys<'_, '_, '_>, name: &str, dirs: &Dirs) -> Status {
    let file = k.path("file", runtime_dir(name, dirs).join("status.json"));
    let metrics_file =
        k.read("metrics-file", None, |r, v| r.string(v, "metrics-file").map(|s| (!s.is_empty()).then(|| s.into())));
    Status { file, metrics_file }
}

/// `$RUNTIME_DIRECTORY`, else `NAME/` in [`defaults::RUN_DIR`].
pub(crate) fn runtime_dir(name: &str, dirs: &Dirs) -> PathBuf {
    match &dirs.runtime {
        Some(d) => d.clone(),
        None => PathBuf::from(defaults::RUN_DIR).join(name),
    }
}

/// `[server]`
fn server(mut k: Keys<'_, '_, '_>, name: &str, dirs: &Dirs) -> Server {
    let socket = k.path("socket", runtime_dir(name, dirs).join(defaults::SOCKET));
    let listen = k.read("listen", None, |r, v| {
        let s = r.string(v, "listen")?;
        if s.is_empty() {
            return Some(None);
        }
        match s.parse::<std::net::SocketAddr>() {
            Ok(a) => Some(Some(a)),
            Err(_) => {
                r.problem(
                    Some(v.span()),
                    format!(
                        "`server.listen`: {s:?} is not an address and port (e.g. \"127.0.0.1:9400\", \"[::1]:9400\")"
                    ),
                );
                None
            }
        }
    });
    let token_file =
        k.read("token-file", None, |r, v| r.string(v, "token-file").map(|s| (!s.is_empty()).then(|| s.into())));
    if token_file.is_some() && listen.is_none() && k.ok("listen") {
        let span = k.span_of("token-file");
        k.problem(span, "`server.token-file` is for the TCP listener, and `server.listen` is not set");
    }
    Server { socket, listen, token_file }
}

/// The base URL of the engine's HTTP API as the warden's clients write it:
/// `http://127.0.0.1:PORT`, or `http://localhost` for an engine on a unix
/// socket (the clients connect such URLs through the socket).
pub(crate) fn engine_base(engine: &Engine) -> String {
    match engine {
        Engine::Loopback(port) => format!("http://127.0.0.1:{port}"),
        Engine::Unix(_) => "http://localhost".to_string(),
    }
}

/// `[front]`: `None` when the file has no such table.
fn front(mut k: Keys<'_, '_, '_>, profile: Profile, command: &[String]) -> Option<Front> {
    let table = k.span()?;
    let listen = k.read("listen", Vec::new(), |r, v| {
        let list = match v.get_ref() {
            DeValue::String(_) => vec![r.string(v, "listen")?],
            _ => r.strings(v, "listen")?,
        };
        let mut out = Vec::new();
        for a in list {
            match listen_address(&a) {
                Ok(l) if out.contains(&l) => r.problem(Some(v.span()), format!("`front.listen`: {a:?} is given twice")),
                Ok(l) => out.push(l),
                Err(why) => r.problem(Some(v.span()), format!("`front.listen`: {a:?} {why}")),
            }
        }
        Some(out)
    });
    let hold = k.duration("hold", defaults::FRONT_HOLD, limits::WAIT);
    let max_held = k.read("max-held", defaults::FRONT_MAX_HELD, |r, v| {
        let n = r.integer(v, "max-held", (*limits::FRONT_MAX_HELD.end()).into())?;
        u32::try_from(n).ok()
    });
    let retry_unanswered = k.read("retry-unanswered", false, |r, v| r.boolean(v, "retry-unanswered"));
    let max_body = k.read("max-body", defaults::FRONT_MAX_BODY, |r, v| size(r, v, "max-body", limits::FRONT_MAX_BODY));
    let min_body_rate = k.read("min-body-rate", defaults::FRONT_MIN_BODY_RATE, |r, v| {
        size(r, v, "min-body-rate", limits::FRONT_MIN_BODY_RATE)
    });
    let max_connections = k.read("max-connections", defaults::FRONT_MAX_CONNECTIONS, |r, v| {
        let n = r.integer(v, "max-connections", (*limits::FRONT_MAX_CONNECTIONS.end()).into())?;
        if n < 1 {
            r.problem(Some(v.span()), "`max-connections` must be at least 1");
            return None;
        }
        u32::try_from(n).ok()
    });
    let idle_stop = k.duration("idle-stop", Duration::ZERO, limits::WAIT);
    let idle_stop = (!idle_stop.is_zero()).then_some(idle_stop);
    let idle_action = k.read("idle-action", IdleAction::Stop, |r, v| match r.string(v, "idle-action")?.as_str() {
        "stop" => Some(IdleAction::Stop),
        "sleep" => Some(IdleAction::Sleep),
        other => {
            r.problem(Some(v.span()), format!("`idle-action` {other:?} must be \"stop\" or \"sleep\""));
            None
        }
    });
    let idle_sleep_level = k.read("idle-sleep-level", defaults::FRONT_IDLE_SLEEP_LEVEL, |r, v| {
        let n = r.integer(v, "idle-sleep-level", 2)?;
        u8::try_from(n).ok()
    });
    let idle_hold =
        k.read("idle-hold", None, |r, v| r.duration(v, "idle-hold", "front.idle-hold", &limits::WAIT).map(Some));
    if k.ok("listen") && listen.is_empty() {
        k.problem(
            Some(table.clone()),
            "`[front]` needs `listen`: the addresses clients connect to (e.g. \"0.0.0.0:8000\")",
        );
    }
    if profile.is_ray() {
        k.problem(Some(table), "`[front]`: a Ray node serves no HTTP, so there is nothing to put a front door before");
    }
    let sleeps = command.iter().any(|a| a == "--enable-sleep-mode" || a == "--enable_sleep_mode");
    if idle_action == IdleAction::Sleep && !sleeps {
        let span = k.span_of("idle-action");
        k.problem(span, "`idle-action = \"sleep\"` needs `--enable-sleep-mode` in the command");
    }
    Some(Front {
        listen,
        hold,
        max_held,
        retry_unanswered,
        max_body,
        min_body_rate,
        max_connections,
        idle_stop,
        idle_action,
        idle_sleep_level,
        idle_hold,
    })
}

/// One of `front.listen`: `HOST:PORT` (an IP address; IPv6 in brackets)
/// or `unix:/absolute/path`.
fn listen_address(a: &str) -> Result<Listen, String> {
    if let Some(path) = a.strip_prefix("unix:") {
        if !path.starts_with('/') {
            return Err("must be an absolute path after `unix:`".into());
        }
        if path.len() > limits::UNIX_PATH {
            return Err(format!("is longer than a unix socket's {} bytes", limits::UNIX_PATH));
        }
        return Ok(Listen::Unix(PathBuf::from(path)));
    }
    match a.parse::<std::net::SocketAddr>() {
        Ok(s) if s.port() == 0 => Err("needs a port other than 0".into()),
        Ok(s) => Ok(Listen::Tcp(s)),
        Err(_) => Err("is not an address and port (e.g. \"0.0.0.0:8000\", \"[::]:8000\") or \"unix:/path\"".into()),
    }
}

/// Where the engine serves. With the front door, a vLLM engine serves on
/// a unix socket the warden chooses: an address of its own in the command
/// (`--host`, `--port`, `--uds`) is a problem that names the command's
/// line, never silently overridden. A command of another profile keeps its
/// port, which must not be one the front door listens on.
fn engine(
    r: &mut Reader<'_>,
    front: Option<&Front>,
    profile: Profile,
    command: &[String],
    command_span: Option<Span>,
    port: Option<u16>,
    runtime: PathBuf,
) -> Option<Engine> {
    if profile.is_ray() {
        return None;
    }
    let Some(front) = front else { return port.map(Engine::Loopback) };
    if profile == Profile::Vllm {
        for flag in ["--host", "--port", "--uds"] {
            if let Some(value) = crate::config::command::vllm_flag(command, flag) {
                let message = format!(
                    "`{flag} {value}` in the command: with `[front]`, clients connect to `front.listen` and the \
                     warden gives the engine a private socket; remove it"
                );
                r.problem(command_span.clone(), message);
            }
        }
        let path = runtime.join(defaults::ENGINE_DIR).join(defaults::ENGINE_SOCKET);
        if path.as_os_str().len() > limits::UNIX_PATH {
            let message = format!(
                "the engine's socket {} is longer than a unix socket's {} bytes: use a shorter runtime directory",
                path.display(),
                limits::UNIX_PATH
            );
            r.problem(None, message);
        }
        return Some(Engine::Unix(path));
    }
    let port = port?;
    if front.listen.iter().any(|l| matches!(l, Listen::Tcp(a) if a.port() == port)) {
        let message =
            format!("the command serves on port {port}, which `front.listen` takes: give the command a private port");
        r.problem(command_span, message);
    }
    Some(Engine::Loopback(port))
}

/// `[drain]`; `listening`: the server has a TCP listener (a balancer may be
/// routing to the instance), which makes stops drain by default.
fn drain(mut k: Keys<'_, '_, '_>, listening: bool) -> Drain {
    let delay = k.duration("delay", defaults::DRAIN_DELAY, limits::WAIT);
    let timeout = k.duration("timeout", defaults::DRAIN_TIMEOUT, limits::WAIT);
    let on_stop = k.read("on-stop", listening, |r, v| r.boolean(v, "on-stop"));
    Drain { delay, timeout, on_stop }
}

/// `[ledger]`
fn ledger(mut k: Keys<'_, '_, '_>) -> Ledger {
    let keep = k.count("keep", defaults::LEDGER_KEEP, 0);
    let (lo, hi) = limits::LEDGER_FACTOR;
    let slow_factor = k.number("slow-factor", defaults::LEDGER_SLOW_FACTOR, lo, hi);
    let deadline_factor = k.number("deadline-factor", defaults::LEDGER_DEADLINE_FACTOR, lo, hi);
    Ledger { keep, slow_factor, deadline_factor }
}

/// `[prefetch]`
fn prefetch(mut k: Keys<'_, '_, '_>) -> Prefetch {
    let enabled = k.read("enabled", defaults::PREFETCH_ENABLED, |r, v| r.boolean(v, "enabled"));
    let threads = k.read("threads", defaults::PREFETCH_THREADS, |r, v| {
        let n = r.integer(v, "threads", u32::MAX.into())?;
        let range = limits::PREFETCH_THREADS;
        match u32::try_from(n) {
            Ok(n) if range.contains(&n) => Some(n),
            _ => {
                r.problem(
                    Some(v.span()),
                    format!("`threads` must be from {} to {}, not {n}", range.start(), range.end()),
                );
                None
            }
        }
    });
    let (lo, hi) = limits::PREFETCH_MEMORY_FRACTION;
    let max_memory_fraction = k.number("max-memory-fraction", defaults::PREFETCH_MAX_MEMORY_FRACTION, lo, hi);
    Prefetch { enabled, threads, max_memory_fraction }
}

/// `[golden]`
fn golden(mut k: Keys<'_, '_, '_>, served: bool) -> Golden {
    let enabled = k.read("enabled", served, |r, v| r.boolean(v, "enabled"));
    let prompts = k.read("prompts", vec![defaults::GOLDEN_PROMPT.to_string()], |r, v| {
        let list = r.strings(v, "prompts")?;
        if list.is_empty() || list.len() > limits::GOLDEN_PROMPTS || list.iter().any(String::is_empty) {
            let n = limits::GOLDEN_PROMPTS;
            r.problem(Some(v.span()), format!("`golden.prompts` must hold 1 to {n} prompts, none empty"));
            return None;
        }
        Some(list)
    });
    let prompts_file = k.read("prompts-file", None, |r, v| r.string(v, "prompts-file").map(|s| Some(PathBuf::from(s))));
    let max_tokens = k.count("max-tokens", defaults::GOLDEN_MAX_TOKENS, 1);
    let tolerance = k.number("tolerance", defaults::GOLDEN_TOLERANCE, 0.0, 100.0);
    let on_mismatch = k.read("on-mismatch", GoldenPolicy::Warn, |r, v| match r.string(v, "on-mismatch")?.as_str() {
        "warn" => Some(GoldenPolicy::Warn),
        "fail" => Some(GoldenPolicy::Fail),
        other => {
            r.problem(Some(v.span()), format!("`golden.on-mismatch` must be \"warn\" or \"fail\", not {other:?}"));
            None
        }
    });
    let accept_changes = k.read("accept-changes", false, |r, v| r.boolean(v, "accept-changes"));
    let timeout = k.duration("timeout", defaults::GOLDEN_TIMEOUT, limits::START);
    let interval = k.duration("interval", defaults::GOLDEN_INTERVAL, limits::WAIT);
    Golden { enabled, prompts, prompts_file, max_tokens, tolerance, on_mismatch, accept_changes, timeout, interval }
}

/// `[fit]`
fn fit(mut k: Keys<'_, '_, '_>) -> Fit {
    let enabled = k.read("enabled", false, |r, v| r.boolean(v, "enabled"));
    let adjust = k.read("adjust", FitArg::ALL.to_vec(), |r, v| {
        let mut out = Vec::new();
        for name in r.strings(v, "adjust")? {
            match FitArg::ALL.iter().find(|a| a.name() == name) {
                Some(a) if !out.contains(a) => out.push(*a),
                Some(_) => {}
                None => {
                    let known: Vec<&str> = FitArg::ALL.iter().map(|a| a.name()).collect();
                    r.problem(Some(v.span()), format!("`fit.adjust`: {name:?} is not one of {}", known.join(", ")));
                    return None;
                }
            }
        }
        Some(out)
    });
    let step = k.number("step", defaults::FIT_STEP, 0.001, 0.5);
    let min_utilization = k.number("min-utilization", defaults::FIT_MIN_UTILIZATION, 0.01, 1.0);
    let max_utilization = k.number("max-utilization", defaults::FIT_MAX_UTILIZATION, 0.01, 1.0);
    let min_model_len = u64::from(k.count("min-model-len", defaults::FIT_MIN_MODEL_LEN, 1));
    let model_len_multiple = u64::from(k.count("model-len-multiple", defaults::FIT_MODEL_LEN_MULTIPLE, 1));
    let attempts = k.count("attempts", defaults::FIT_ATTEMPTS, 1);
    Fit { enabled, adjust, step, min_utilization, max_utilization, min_model_len, model_len_multiple, attempts }
}

/// `[rollback]`
fn rollback(mut k: Keys<'_, '_, '_>) -> Rollback {
    let enabled = k.read("enabled", false, |r, v| r.boolean(v, "enabled"));
    let keep = k.count("keep", defaults::ROLLBACK_KEEP, 1);
    Rollback { enabled, keep }
}

/// `[reports]`
fn reports(mut k: Keys<'_, '_, '_>) -> Reports {
    let keep = k.count("keep", defaults::REPORTS_KEEP, 0);
    let max_size =
        k.read("max-size", defaults::REPORTS_MAX_SIZE, |r, v| size(r, v, "max-size", limits::REPORTS_MAX_SIZE));
    let lines = k.read("lines", defaults::REPORTS_LINES, |r, v| {
        let n = r.integer(v, "lines", i64::MAX)?;
        let range = &limits::REPORTS_LINES;
        match u64::try_from(n) {
            Ok(n) if range.contains(&n) => u32::try_from(n).ok(),
            _ => {
                let message = format!("`lines` must be from {} to {}", range.start(), range.end());
                r.problem(Some(v.span()), message);
                None
            }
        }
    });
    let timeout = k.duration("timeout", defaults::REPORTS_TIMEOUT, limits::REPORTS_TIMEOUT);
    fn argv(k: &mut Keys<'_, '_, '_>, key: &'static str, default: &[&str], needs: Option<&str>) -> Vec<String> {
        k.read(key, default.iter().map(|s| s.to_string()).collect(), |r, v| {
            let argv = r.strings(v, key)?;
            if argv.first().is_some_and(String::is_empty) {
                r.problem(Some(v.span()), format!("`reports.{key}` must name a program to run, or be [] (none)"));
                return None;
            }
            if let Some(p) = needs
                && !argv.is_empty()
                && !argv.iter().any(|a| a.contains(p))
            {
                r.problem(Some(v.span()), format!("`reports.{key}` must hold {p} where the value goes"));
                return None;
            }
            Some(argv)
        })
    }
    let py_spy = argv(&mut k, "py-spy", &defaults::REPORTS_PY_SPY, Some("{pid}"));
    let gpu_snapshot = argv(&mut k, "gpu-snapshot", &defaults::REPORTS_GPU_SNAPSHOT, None);
    let kernel_messages = argv(&mut k, "kernel-messages", &defaults::REPORTS_KERNEL_MESSAGES, None);
    Reports { keep, max_size, lines, timeout, py_spy, gpu_snapshot, kernel_messages }
}

/// `"SIGTERM"`, `"TERM"` or `"15"` → a signal.
pub(crate) fn parse_signal(s: &str) -> Option<Signal> {
    if let Ok(n) = s.parse::<i32>() {
        return Signal::try_from(n).ok();
    }
    let upper = s.to_ascii_uppercase();
    let full = if upper.starts_with("SIG") { upper } else { format!("SIG{upper}") };
    full.parse().ok()
}

/// The effective pattern lists, as `check` prints them.
pub(crate) fn describe_patterns(s: &Settings) -> String {
    let mut out = format!("profile: {}\n", s.profile.name());
    let lists = List::ALL.map(|l| (if l == List::Ignore { "ignore (benign)" } else { l.name() }, s.patterns.list(l)));
    for (title, list) in lists.into_iter().chain([("clean-shm", &s.prestart.clean_shm)]) {
        out.push_str(&format!("{title}:\n"));
        for pat in list {
            out.push_str(&format!("  {pat}\n"));
        }
    }
    out
}

#[cfg(test)]
mod tests;
