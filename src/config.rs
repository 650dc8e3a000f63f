//! TOML → validated [`Settings`]. Every problem is collected, each naming the
//! file and, where the TOML has one, the line and column; nothing here knows
//! about processes or tokio.
//!
//! The document is parsed with `toml`'s spanned tree and read key by key,
//! rather than through `#[derive(Deserialize)]`, because serde stops at the
//! first error and `check` must list every one.

use std::collections::BTreeMap;
use std::fmt;
use std::path::{Path, PathBuf};
use std::time::Duration;

use nix::sys::signal::Signal;
use regex::Regex;
use toml::Spanned;
use toml::de::{DeTable, DeValue};

use crate::patch::Patch;
use crate::profile::{List, Patterns, Profile};

/// Where the config is read from when `-c` is not given.
pub const DEFAULT_CONFIG: &str = "/etc/vllm-warden/vllm-warden.toml";
/// The port vLLM listens on when the command has no `--port`.
pub const DEFAULT_PORT: u16 = defaults::PORT;

/// The value of every key the config leaves out. The man page's table
/// shows the same values; a test compares them.
pub mod defaults {
    use std::time::Duration;

    use nix::sys::signal::Signal;

    use crate::profile::Profile;

    const fn minutes(n: u64) -> Duration {
        Duration::from_secs(n * 60)
    }

    pub const PROFILE: Profile = Profile::Vllm;

    /// `child.log-file` is `NAME.log` in `$LOGS_DIRECTORY`, else here.
    pub const LOG_DIR: &str = "/var/log/vllm-warden";
    pub const STOP_SIGNAL: Signal = Signal::SIGTERM;
    pub const STOP_TIMEOUT: Duration = Duration::from_secs(90);

    /// The port vLLM listens on when the command has no `--port`.
    pub const PORT: u16 = 8000;
    pub const PORT_WAIT: Duration = Duration::from_secs(30);
    pub const GPU_IDLE_WAIT: Duration = minutes(2);
    pub const GPU_QUERY: [&str; 3] =
        ["nvidia-smi", "--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits"];

    pub const READY_TIMEOUT: Duration = minutes(90);
    pub const READY_STALL: Duration = minutes(15);

    pub const FATAL_GRACE: Duration = Duration::from_secs(30);

    pub const INITIAL_DELAY: Duration = Duration::from_secs(10);
    pub const MAX_DELAY: Duration = minutes(5);
    pub const FACTOR: f64 = 2.0;
    pub const JITTER: f64 = 0.1;
    pub const RESET_AFTER: Duration = minutes(10);
    pub const MAX_ATTEMPTS: u32 = 10;
    pub const PERMANENT_ATTEMPTS: u32 = 2;

    pub const HEALTH_INTERVAL: Duration = Duration::from_secs(15);
    pub const HEALTH_TIMEOUT: Duration = Duration::from_secs(5);
    pub const HEALTH_FAILURES: u32 = 3;
    /// Zero: no canary.
    pub const CANARY_INTERVAL: Duration = Duration::ZERO;
    pub const CANARY_TIMEOUT: Duration = minutes(1);

    /// `status.file` is `status.json` in `$RUNTIME_DIRECTORY`, else in
    /// `NAME/` here.
    pub const RUN_DIR: &str = "/run/vllm-warden";
    /// `$STATE_DIRECTORY`, else `NAME/` here.
    pub const STATE_DIR: &str = "/var/lib/vllm-warden";
}

/// A config that passed validation.
#[derive(Debug, Clone)]
pub struct Settings {
    /// The file it came from.
    pub source: PathBuf,
    /// Instance name: journal identifier `vllm-<name>`, default file names.
    pub name: String,
    pub profile: Profile,
    pub child: Child,
    pub patches: Vec<Patch>,
    pub prestart: Prestart,
    pub ready: Ready,
    pub fatal: Fatal,
    pub restart: Restart,
    pub health: Health,
    pub status: Status,
    /// `$STATE_DIRECTORY`, else `/var/lib/vllm-warden/<name>`.
    pub state_dir: PathBuf,
    /// The effective pattern lists: the profile's plus the config's.
    pub patterns: Patterns,
}

#[derive(Debug, Clone)]
pub struct Child {
    /// argv; never run through a shell.
    pub command: Vec<String>,
    pub env: BTreeMap<String, String>,
    pub cwd: Option<PathBuf>,
    pub log_file: PathBuf,
    pub stop_signal: Signal,
    pub stop_timeout: Duration,
}

#[derive(Debug, Clone)]
pub struct Prestart {
    /// Globs in `/dev/shm`, the profile's plus the config's.
    pub clean_shm: Vec<String>,
    pub port: u16,
    pub port_wait: Duration,
    pub gpu_idle_wait: Duration,
    pub gpu_query: Vec<String>,
}

#[derive(Debug, Clone)]
pub struct Ready {
    /// `None`: the HTTP check is off (`http = ""`).
    pub http: Option<String>,
    pub timeout: Duration,
    pub stall: Duration,
}

#[derive(Debug, Clone)]
pub struct Fatal {
    pub grace: Duration,
}

#[derive(Debug, Clone, PartialEq)]
pub struct Restart {
    pub initial_delay: Duration,
    pub max_delay: Duration,
    pub factor: f64,
    pub jitter: f64,
    pub reset_after: Duration,
    /// 0 = never give up.
    pub max_attempts: u32,
    pub permanent_attempts: u32,
}

#[derive(Debug, Clone)]
pub struct Health {
    pub http: Option<String>,
    pub interval: Duration,
    pub timeout: Duration,
    pub failures: u32,
    pub canary_interval: Duration,
    pub canary_timeout: Duration,
}

#[derive(Debug, Clone)]
pub struct Status {
    pub file: PathBuf,
    pub metrics_file: Option<PathBuf>,
}

/// One problem found in a config file.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Problem {
    pub file: PathBuf,
    /// 1-based line and column, when the problem has a place in the TOML.
    pub at: Option<(usize, usize)>,
    pub message: String,
}

impl fmt::Display for Problem {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.at {
            Some((line, col)) => {
                write!(f, "{}:{line}:{col}: {}", self.file.display(), self.message)
            }
            None => write!(f, "{}: {}", self.file.display(), self.message),
        }
    }
}

/// Every problem of a config that did not validate.
#[derive(Debug, Clone, thiserror::Error)]
pub struct Problems(pub Vec<Problem>);

impl fmt::Display for Problems {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for (i, p) in self.0.iter().enumerate() {
            if i > 0 {
                writeln!(f)?;
            }
            write!(f, "{p}")?;
        }
        Ok(())
    }
}

/// The directories systemd hands a service (`RuntimeDirectory=` …), read
/// once so that validation stays a pure function of its inputs.
#[derive(Debug, Clone, Default)]
pub struct Dirs {
    pub runtime: Option<PathBuf>,
    pub state: Option<PathBuf>,
    pub logs: Option<PathBuf>,
}

impl Dirs {
    pub fn from_env() -> Dirs {
        // systemd joins several directories with ':'; the first is ours.
        let first = |var: &str| {
            std::env::var_os(var)
                .and_then(|v| v.to_str().and_then(|s| s.split(':').next()).map(PathBuf::from))
                .filter(|p| !p.as_os_str().is_empty())
        };
        Dirs { runtime: first("RUNTIME_DIRECTORY"), state: first("STATE_DIRECTORY"), logs: first("LOGS_DIRECTORY") }
    }
}

/// Read and validate a config file.
pub fn load(path: &Path, dirs: &Dirs) -> Result<Settings, Problems> {
    let text = std::fs::read_to_string(path).map_err(|e| {
        Problems(vec![Problem { file: path.to_path_buf(), at: None, message: format!("cannot read config: {e}") }])
    })?;
    parse(&text, path, dirs)
}

/// Validate config text; `path` names the file in problems and gives the
/// default instance name (its stem).
pub fn parse(text: &str, path: &Path, dirs: &Dirs) -> Result<Settings, Problems> {
    let (doc, syntax) = DeTable::parse_recoverable(text);
    let mut r = Reader { text, file: path, problems: Vec::new() };
    for e in syntax {
        r.problem(e.span(), e.message().trim_end().to_string());
    }
    if !r.problems.is_empty() {
        return Err(Problems(r.problems));
    }
    let settings = r.settings(doc.get_ref(), path, dirs);
    if r.problems.is_empty() {
        Ok(settings.expect("settings are complete when there is no problem"))
    } else {
        Err(Problems(r.problems))
    }
}

type Span = std::ops::Range<usize>;
type Table<'i> = DeTable<'i>;
type Value<'i> = Spanned<DeValue<'i>>;

/// Reads typed values out of the spanned tree, recording every problem.
struct Reader<'a> {
    text: &'a str,
    file: &'a Path,
    problems: Vec<Problem>,
}

impl Reader<'_> {
    fn problem(&mut self, span: Option<Span>, message: String) {
        let at = span.map(|s| line_col(self.text, s.start));
        self.problems.push(Problem { file: self.file.to_path_buf(), at, message });
    }

    /// The keys of `table`, checking that each is one of `known`.
    fn keys<'t, 'i>(&mut self, table: &'t Table<'i>, section: &str, known: &[&str]) -> BTreeMap<String, &'t Value<'i>> {
        let mut out = BTreeMap::new();
        for (k, v) in table.iter() {
            let key: &str = k.get_ref();
            if known.contains(&key) {
                out.insert(key.to_string(), v);
            } else {
                let place = if section.is_empty() { String::new() } else { format!(" in [{section}]") };
                self.problem(Some(k.span()), format!("unknown key `{key}`{place} (known: {})", known.join(", ")));
            }
        }
        out
    }

    fn string(&mut self, v: &Value<'_>, key: &str) -> Option<String> {
        match v.get_ref() {
            DeValue::String(s) => Some(s.to_string()),
            other => {
                self.problem(Some(v.span()), format!("`{key}` must be a string, not {}", other.type_str()));
                None
            }
        }
    }

    fn strings(&mut self, v: &Value<'_>, key: &str) -> Option<Vec<String>> {
        let DeValue::Array(items) = v.get_ref() else {
            self.problem(Some(v.span()), format!("`{key}` must be an array of strings"));
            return None;
        };
        let mut out = Vec::new();
        let mut ok = true;
        for item in items.iter() {
            match self.string(item, key) {
                Some(s) => out.push(s),
                None => ok = false,
            }
        }
        ok.then_some(out)
    }

    fn patterns(&mut self, v: &Value<'_>, key: &str) -> Vec<String> {
        let DeValue::Array(items) = v.get_ref() else {
            self.problem(Some(v.span()), format!("`{key}` must be an array of regular expressions"));
            return Vec::new();
        };
        let mut out = Vec::new();
        for item in items.iter() {
            if let Some(s) = self.string(item, key) {
                match Regex::new(&s) {
                    Ok(_) => out.push(s),
                    Err(e) => {
                        let first = e.to_string().lines().last().unwrap_or_default().to_string();
                        self.problem(Some(item.span()), format!("`{key}`: invalid regular expression {s:?}: {first}"))
                    }
                }
            }
        }
        out
    }

    fn duration(&mut self, v: &Value<'_>, key: &str) -> Option<Duration> {
        let s = self.string(v, key)?;
        match humantime::parse_duration(&s) {
            Ok(d) => Some(d),
            Err(e) => {
                self.problem(
                    Some(v.span()),
                    format!("`{key}`: invalid duration {s:?}: {e} (write e.g. \"90s\", \"15m\")"),
                );
                None
            }
        }
    }

    fn integer(&mut self, v: &Value<'_>, key: &str, max: i64) -> Option<i64> {
        let parsed = match v.get_ref() {
            DeValue::Integer(i) => parse_int(i.as_str(), i.radix()),
            _ => None,
        };
        match parsed {
            Some(n) if (0..=max).contains(&n) => Some(n),
            _ => {
                self.problem(Some(v.span()), format!("`{key}` must be an integer from 0 to {max}"));
                None
            }
        }
    }

    fn float(&mut self, v: &Value<'_>, key: &str, min: f64, max: f64) -> Option<f64> {
        let parsed = match v.get_ref() {
            DeValue::Float(f) => f.as_str().replace('_', "").parse::<f64>().ok(),
            DeValue::Integer(i) => parse_int(i.as_str(), i.radix()).map(|n| n as f64),
            _ => None,
        };
        match parsed {
            Some(x) if x >= min && x <= max => Some(x),
            _ => {
                self.problem(Some(v.span()), format!("`{key}` must be a number from {min} to {max}"));
                None
            }
        }
    }

    fn table<'t, 'i>(&mut self, v: &'t Value<'i>, key: &str) -> Option<&'t Table<'i>> {
        match v.get_ref() {
            DeValue::Table(t) => Some(t),
            _ => {
                self.problem(Some(v.span()), format!("`{key}` must be a table"));
                None
            }
        }
    }

    fn url(&mut self, v: &Value<'_>, key: &str) -> Option<Option<String>> {
        let s = self.string(v, key)?;
        if s.is_empty() {
            return Some(None);
        }
        if !(s.starts_with("http://") || s.starts_with("https://")) {
            self.problem(Some(v.span()), format!("`{key}` must be an http:// URL or \"\" (off), not {s:?}"));
            return None;
        }
        Some(Some(s))
    }

    fn settings(&mut self, doc: &Table<'_>, path: &Path, dirs: &Dirs) -> Option<Settings> {
        let top = self.keys(
            doc,
            "",
            &["name", "profile", "child", "patch", "prestart", "ready", "fatal", "restart", "health", "status"],
        );
        let empty = Table::default();
        let section = |r: &mut Self, key: &str| -> &Table<'_> {
            match top.get(key) {
                Some(v) => r.table(v, key).unwrap_or(&empty),
                None => &empty,
            }
        };

        let stem = path.file_stem().and_then(|s| s.to_str()).unwrap_or("vllm").to_string();
        let name = match top.get("name") {
            Some(v) => self.string(v, "name").and_then(|n| {
                let ok = !n.is_empty()
                    && n.chars().all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.'))
                    && !n.starts_with('.');
                if !ok {
                    self.problem(Some(v.span()), format!("`name` {n:?} must be letters, digits, '-', '_' or '.'"));
                }
                ok.then_some(n)
            }),
            None => Some(stem),
        };
        let profile = match top.get("profile") {
            Some(v) => self.string(v, "profile").and_then(|p| {
                let parsed = Profile::parse(&p);
                if parsed.is_none() {
                    self.problem(Some(v.span()), format!("unknown profile {p:?} (known: vllm, none)"));
                }
                parsed
            }),
            None => Some(defaults::PROFILE),
        };
        let base = profile.unwrap_or(defaults::PROFILE);
        let name_or = name.clone().unwrap_or_else(|| "vllm".into());
        let mut patterns = base.patterns();

        // [child]
        let t = section(self, "child");
        let k = self.keys(t, "child", &["command", "env", "cwd", "log-file", "stop-signal", "stop-timeout"]);
        let command = match k.get("command") {
            Some(v) => self.strings(v, "command").and_then(|c| {
                if c.is_empty() || c[0].is_empty() {
                    self.problem(Some(v.span()), "`command` must name a program to run".into());
                    None
                } else {
                    Some(c)
                }
            }),
            None => {
                let span = top.get("child").map(|v| v.span());
                self.problem(span, "`[child] command` is required: the argv of the server to run".into());
                None
            }
        };
        let mut env = BTreeMap::new();
        if let Some(v) = k.get("env")
            && let Some(t) = self.table(v, "env")
        {
            for (key, val) in t.iter() {
                if let Some(s) = self.string(val, &format!("env.{}", key.get_ref())) {
                    env.insert(key.get_ref().to_string(), s);
                }
            }
        }
        let cwd = k.get("cwd").and_then(|v| self.string(v, "cwd")).map(PathBuf::from);
        let log_file = match k.get("log-file") {
            Some(v) => self.string(v, "log-file").map(PathBuf::from),
            None => Some(
                dirs.logs.clone().unwrap_or_else(|| PathBuf::from(defaults::LOG_DIR)).join(format!("{name_or}.log")),
            ),
        };
        let stop_signal = match k.get("stop-signal") {
            Some(v) => self.string(v, "stop-signal").and_then(|s| {
                let sig = parse_signal(&s);
                if sig.is_none() {
                    self.problem(
                        Some(v.span()),
                        format!("`stop-signal`: unknown signal {s:?} (e.g. \"SIGTERM\", \"SIGINT\")"),
                    );
                }
                sig
            }),
            None => Some(defaults::STOP_SIGNAL),
        };
        let stop_timeout = self.opt_duration(&k, "stop-timeout", defaults::STOP_TIMEOUT);

        // [[patch]]
        let mut patches = Vec::new();
        if let Some(v) = top.get("patch") {
            match v.get_ref() {
                DeValue::Array(items) => {
                    for item in items.iter() {
                        if let Some(p) = self.table(item, "patch").and_then(|t| self.patch(t, item.span())) {
                            patches.push(p);
                        }
                    }
                }
                _ => self.problem(Some(v.span()), "`patch` must be written as [[patch]] tables".into()),
            }
        }

        // [prestart]
        let t = section(self, "prestart");
        let k = self.keys(t, "prestart", &["clean-shm", "port", "port-wait", "gpu-idle-wait", "gpu-query"]);
        let mut clean_shm = base.shm_globs();
        if let Some(v) = k.get("clean-shm")
            && let Some(globs) = self.strings(v, "clean-shm")
        {
            for g in globs {
                if g.is_empty() || g.contains('/') || g == "*" {
                    self.problem(
                        Some(v.span()),
                        format!("`clean-shm`: {g:?} must be a file-name glob in /dev/shm, narrower than \"*\""),
                    );
                } else {
                    clean_shm.push(g);
                }
            }
        }
        let port = match k.get("port") {
            Some(v) => self.integer(v, "port", 65535).map(|n| n as u16),
            None => command.as_deref().map(|c| port_of(c).unwrap_or(DEFAULT_PORT)),
        };
        let port_wait = self.opt_duration(&k, "port-wait", defaults::PORT_WAIT);
        let gpu_idle_wait = self.opt_duration(&k, "gpu-idle-wait", defaults::GPU_IDLE_WAIT);
        let gpu_query = match k.get("gpu-query") {
            Some(v) => self.strings(v, "gpu-query"),
            None => Some(defaults::GPU_QUERY.map(String::from).to_vec()),
        };
        let default_health = port.map(|p| format!("http://127.0.0.1:{p}/health"));

        // [ready]
        let t = section(self, "ready");
        let k = self.keys(t, "ready", &["log", "http", "timeout", "stall", "progress"]);
        if let Some(v) = k.get("log") {
            let extra = self.patterns(v, "ready.log");
            patterns.ready.extend(extra);
        }
        if let Some(v) = k.get("progress") {
            let extra = self.patterns(v, "ready.progress");
            patterns.progress.extend(extra);
        }
        let ready_http = match k.get("http") {
            Some(v) => self.url(v, "ready.http"),
            None => Some(default_health.clone()),
        };
        let ready_timeout = self.opt_duration(&k, "timeout", defaults::READY_TIMEOUT);
        let stall = self.opt_duration(&k, "stall", defaults::READY_STALL);
        if let (Some(None), true) = (&ready_http, patterns.ready.is_empty()) {
            self.problem(
                None,
                "nothing can tell that the server is ready: `ready.log` has no pattern and `ready.http` is off".into(),
            );
        }

        // [fatal]
        let t = section(self, "fatal");
        let k = self.keys(t, "fatal", &["match", "ignore", "permanent", "grace"]);
        for (key, list) in [("match", List::Fatal), ("ignore", List::Ignore), ("permanent", List::Permanent)] {
            if let Some(v) = k.get(key) {
                let extra = self.patterns(v, &format!("fatal.{key}"));
                patterns.list_mut(list).extend(extra);
            }
        }
        let grace = self.opt_duration(&k, "grace", defaults::FATAL_GRACE);

        // [restart]
        let t = section(self, "restart");
        let k = self.keys(
            t,
            "restart",
            &["initial-delay", "max-delay", "factor", "jitter", "reset-after", "max-attempts", "permanent-attempts"],
        );
        let initial_delay = self.opt_duration(&k, "initial-delay", defaults::INITIAL_DELAY);
        let max_delay = self.opt_duration(&k, "max-delay", defaults::MAX_DELAY);
        let factor = match k.get("factor") {
            Some(v) => self.float(v, "factor", 1.0, 100.0),
            None => Some(defaults::FACTOR),
        };
        let jitter = match k.get("jitter") {
            Some(v) => self.float(v, "jitter", 0.0, 1.0),
            None => Some(defaults::JITTER),
        };
        let reset_after = self.opt_duration(&k, "reset-after", defaults::RESET_AFTER);
        let max_attempts = match k.get("max-attempts") {
            Some(v) => self.integer(v, "max-attempts", u32::MAX as i64).map(|n| n as u32),
            None => Some(defaults::MAX_ATTEMPTS),
        };
        let permanent_attempts = match k.get("permanent-attempts") {
            Some(v) => self.integer(v, "permanent-attempts", u32::MAX as i64).and_then(|n| {
                if n == 0 {
                    self.problem(Some(v.span()), "`permanent-attempts` must be at least 1".into());
                    None
                } else {
                    Some(n as u32)
                }
            }),
            None => Some(defaults::PERMANENT_ATTEMPTS),
        };
        if let (Some(a), Some(b)) = (initial_delay, max_delay)
            && a > b
        {
            self.problem(k.get("max-delay").map(|v| v.span()), "`max-delay` is shorter than `initial-delay`".into());
        }

        // [health]
        let t = section(self, "health");
        let k =
            self.keys(t, "health", &["http", "interval", "timeout", "failures", "canary-interval", "canary-timeout"]);
        let health_http = match k.get("http") {
            Some(v) => self.url(v, "health.http"),
            None => Some(default_health),
        };
        let interval = self.opt_duration(&k, "interval", defaults::HEALTH_INTERVAL);
        let health_timeout = self.opt_duration(&k, "timeout", defaults::HEALTH_TIMEOUT);
        let failures = match k.get("failures") {
            Some(v) => self.integer(v, "failures", u32::MAX as i64).and_then(|n| {
                if n == 0 {
                    self.problem(Some(v.span()), "`failures` must be at least 1".into());
                    None
                } else {
                    Some(n as u32)
                }
            }),
            None => Some(defaults::HEALTH_FAILURES),
        };
        let canary_interval = self.opt_duration(&k, "canary-interval", defaults::CANARY_INTERVAL);
        let canary_timeout = self.opt_duration(&k, "canary-timeout", defaults::CANARY_TIMEOUT);
        if interval == Some(Duration::ZERO) {
            self.problem(k.get("interval").map(|v| v.span()), "`interval` must be longer than 0s".into());
        }

        // [status]
        let t = section(self, "status");
        let k = self.keys(t, "status", &["file", "metrics-file"]);
        let status_file = match k.get("file") {
            Some(v) => self.string(v, "file").map(PathBuf::from),
            None => Some(match &dirs.runtime {
                Some(d) => d.join("status.json"),
                None => PathBuf::from(defaults::RUN_DIR).join(&name_or).join("status.json"),
            }),
        };
        let metrics_file = match k.get("metrics-file") {
            Some(v) => self.string(v, "metrics-file").map(|s| (!s.is_empty()).then(|| PathBuf::from(s))),
            None => Some(None),
        };

        let state_dir = dirs.state.clone().unwrap_or_else(|| PathBuf::from(defaults::STATE_DIR).join(&name_or));

        Some(Settings {
            source: path.to_path_buf(),
            name: name?,
            profile: profile?,
            child: Child {
                command: command?,
                env,
                cwd,
                log_file: log_file?,
                stop_signal: stop_signal?,
                stop_timeout: stop_timeout?,
            },
            patches,
            prestart: Prestart {
                clean_shm,
                port: port?,
                port_wait: port_wait?,
                gpu_idle_wait: gpu_idle_wait?,
                gpu_query: gpu_query?,
            },
            ready: Ready { http: ready_http?, timeout: ready_timeout?, stall: stall? },
            fatal: Fatal { grace: grace? },
            restart: Restart {
                initial_delay: initial_delay?,
                max_delay: max_delay?,
                factor: factor?,
                jitter: jitter?,
                reset_after: reset_after?,
                max_attempts: max_attempts?,
                permanent_attempts: permanent_attempts?,
            },
            health: Health {
                http: health_http?,
                interval: interval?,
                timeout: health_timeout?,
                failures: failures?,
                canary_interval: canary_interval?,
                canary_timeout: canary_timeout?,
            },
            status: Status { file: status_file?, metrics_file: metrics_file? },
            state_dir,
            patterns,
        })
    }

    fn opt_duration(&mut self, k: &BTreeMap<String, &Value<'_>>, key: &str, default: Duration) -> Option<Duration> {
        match k.get(key) {
            Some(v) => self.duration(v, key),
            None => Some(default),
        }
    }

    fn patch(&mut self, t: &Table<'_>, span: Span) -> Option<Patch> {
        let k = self.keys(t, "[patch]", &["file", "remove", "set"]);
        let file = match k.get("file") {
            Some(v) => self.string(v, "file").map(PathBuf::from),
            None => {
                self.problem(Some(span.clone()), "`[[patch]]` needs `file`".into());
                None
            }
        };
        let remove = match k.get("remove") {
            Some(v) => self.strings(v, "remove"),
            None => Some(Vec::new()),
        };
        let mut set = Vec::new();
        if let Some(v) = k.get("set")
            && let Some(t) = self.table(v, "set")
        {
            for (key, val) in t.iter() {
                match to_json(val.get_ref()) {
                    Ok(j) => set.push((key.get_ref().to_string(), j)),
                    Err(e) => self.problem(Some(val.span()), format!("`set.{}`: {e}", key.get_ref())),
                }
            }
        }
        for path in remove.iter().flatten().chain(set.iter().map(|(k, _)| k)) {
            if path.is_empty() {
                self.problem(Some(span.clone()), format!("`[[patch]]`: {path:?} is not a dotted JSON path"));
            }
        }
        if remove.as_ref().is_some_and(Vec::is_empty) && set.is_empty() {
            self.problem(Some(span), "`[[patch]]` changes nothing: give `remove` or `set`".into());
        }
        Some(Patch { file: file?, remove: remove?, set })
    }
}

/// 1-based line and column (in characters) of a byte offset.
fn line_col(text: &str, offset: usize) -> (usize, usize) {
    let offset = offset.min(text.len());
    let before = &text[..offset];
    let line = before.matches('\n').count() + 1;
    let col = before.rsplit('\n').next().map_or(0, |l| l.chars().count()) + 1;
    (line, col)
}

fn parse_int(s: &str, radix: u32) -> Option<i64> {
    let s = s.replace('_', "");
    let digits = if radix == 10 { s.as_str() } else { &s[2..] };
    i64::from_str_radix(digits, radix).ok()
}

/// TOML value → JSON value, for `set`.
fn to_json(v: &DeValue<'_>) -> Result<serde_json::Value, String> {
    use serde_json::Value as J;
    Ok(match v {
        DeValue::String(s) => J::String(s.to_string()),
        DeValue::Integer(i) => J::from(parse_int(i.as_str(), i.radix()).ok_or("integer out of range")?),
        DeValue::Float(f) => {
            let x: f64 = f.as_str().replace('_', "").parse().map_err(|_| "invalid float")?;
            J::from(serde_json::Number::from_f64(x).ok_or("JSON has no inf or nan")?)
        }
        DeValue::Boolean(b) => J::Bool(*b),
        DeValue::Datetime(d) => J::String(d.to_string()),
        DeValue::Array(a) => J::Array(a.iter().map(|x| to_json(x.get_ref())).collect::<Result<_, _>>()?),
        DeValue::Table(t) => {
            let mut m = serde_json::Map::new();
            for (k, x) in t.iter() {
                m.insert(k.get_ref().to_string(), to_json(x.get_ref())?);
            }
            J::Object(m)
        }
    })
}

/// `"SIGTERM"`, `"TERM"` or `"15"` → a signal.
pub fn parse_signal(s: &str) -> Option<Signal> {
    if let Ok(n) = s.parse::<i32>() {
        return Signal::try_from(n).ok();
    }
    let upper = s.to_ascii_uppercase();
    let full = if upper.starts_with("SIG") { upper } else { format!("SIG{upper}") };
    full.parse().ok()
}

/// The value of `--port N` or `--port=N` in a command line.
pub fn port_of(command: &[String]) -> Option<u16> {
    let mut it = command.iter();
    while let Some(arg) = it.next() {
        if arg == "--port" {
            return it.next().and_then(|p| p.parse().ok());
        }
        if let Some(p) = arg.strip_prefix("--port=") {
            return p.parse().ok();
        }
    }
    None
}

/// The effective pattern lists, as `check` prints them.
pub fn describe_patterns(s: &Settings) -> String {
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
mod tests {
    use super::*;

    fn parse_str(text: &str) -> Result<Settings, Problems> {
        parse(text, Path::new("/etc/vllm-warden/kimi.toml"), &Dirs::default())
    }

    #[test]
    fn minimal_config_has_vllm_defaults() {
        let s = parse_str("[child]\ncommand = [\"vllm\", \"serve\", \"/m\", \"--port\", \"8011\"]\n").unwrap();
        assert_eq!(s.name, "kimi");
        assert_eq!(s.prestart.port, 8011);
        assert_eq!(s.ready.http.as_deref(), Some("http://127.0.0.1:8011/health"));
        assert_eq!(s.health.http.as_deref(), Some("http://127.0.0.1:8011/health"));
        assert_eq!(s.child.log_file, PathBuf::from("/var/log/vllm-warden/kimi.log"));
        assert_eq!(s.status.file, PathBuf::from("/run/vllm-warden/kimi/status.json"));
        assert_eq!(s.state_dir, PathBuf::from("/var/lib/vllm-warden/kimi"));
        assert_eq!(s.child.stop_signal, Signal::SIGTERM);
        assert_eq!(s.restart.max_attempts, 10);
        assert!(s.patterns.ready.iter().any(|p| p.contains("Application startup complete")));
        assert_eq!(s.prestart.clean_shm, vec!["psm_*", "sem.mp-*", "vllm_*"]);
    }

    #[test]
    fn systemd_directories_give_the_defaults() {
        let dirs = Dirs {
            runtime: Some("/run/vllm-warden/x".into()),
            state: Some("/var/lib/vllm-warden/x".into()),
            logs: Some("/var/log/vllm-warden".into()),
        };
        let s = parse("[child]\ncommand = [\"v\"]\n", Path::new("x.toml"), &dirs).unwrap();
        assert_eq!(s.status.file, PathBuf::from("/run/vllm-warden/x/status.json"));
        assert_eq!(s.child.log_file, PathBuf::from("/var/log/vllm-warden/x.log"));
    }

    #[test]
    fn the_spec_example_is_valid() {
        let text = include_str!("../examples/kimi-k2.5-nvfp4.toml");
        let s = parse_str(text).unwrap_or_else(|p| panic!("{p}"));
        assert_eq!(s.patches.len(), 2);
        assert!(s.patterns.fatal.iter().any(|p| p == "illegal memory access"));
    }

    #[test]
    fn every_problem_is_listed_with_line_and_column() {
        let text = "\
nme = \"x\"
[child]
command = [\"vllm\"]
stop-timeout = \"ninety\"
stop-signal = \"SIGFOO\"
[ready]
log = [\"(unclosed\"]
[restart]
factor = \"two\"
max-attempts = -1
";
        let p = parse_str(text).unwrap_err().0;
        let shown: Vec<String> = p.iter().map(|p| p.to_string()).collect();
        assert_eq!(p.len(), 6, "{shown:#?}");
        assert!(shown[0].starts_with("/etc/vllm-warden/kimi.toml:1:1: unknown key `nme`"), "{}", shown[0]);
        assert!(shown.iter().any(|s| s.contains(":4:16: `stop-timeout`: invalid duration")), "{shown:#?}");
        assert!(shown.iter().any(|s| s.contains(":5:15: `stop-signal`: unknown signal")), "{shown:#?}");
        assert!(shown.iter().any(|s| s.contains(":7:8: `ready.log`: invalid regular expression")), "{shown:#?}");
        assert!(shown.iter().any(|s| s.contains(":9:10: `factor` must be a number")), "{shown:#?}");
        assert!(shown.iter().any(|s| s.contains(":10:16: `max-attempts` must be an integer")), "{shown:#?}");
    }

    #[test]
    fn syntax_errors_have_a_place() {
        let p = parse_str("[child]\ncommand = [\"a\"\n").unwrap_err().0;
        assert!(p[0].at.is_some(), "{:?}", p);
    }

    #[test]
    fn missing_command_is_an_error() {
        let p = parse_str("name = \"x\"\n").unwrap_err().0;
        assert!(p[0].message.contains("`[child] command` is required"), "{p:?}");
    }

    #[test]
    fn unknown_keys_in_every_section_are_errors() {
        let text = "[child]\ncommand=[\"a\"]\nbogus=1\n[health]\nintervl=\"1s\"\n[[patch]]\nfile=\"/f\"\nremove=[\"a\"]\ndelete=[\"b\"]\n";
        let p = parse_str(text).unwrap_err().0;
        assert_eq!(p.len(), 3, "{p:?}");
    }

    #[test]
    fn profile_none_drops_builtin_patterns() {
        let s = parse_str("profile = \"none\"\n[child]\ncommand=[\"a\"]\n[ready]\nlog=[\"up\"]\n").unwrap();
        assert_eq!(s.patterns.ready, vec!["up"]);
        assert!(s.patterns.fatal.is_empty());
        assert!(s.prestart.clean_shm.is_empty());
    }

    #[test]
    fn http_off_and_no_ready_pattern_is_an_error() {
        let p = parse_str("profile = \"none\"\n[child]\ncommand=[\"a\"]\n[ready]\nhttp=\"\"\n").unwrap_err();
        assert!(p.to_string().contains("nothing can tell"), "{p}");
    }

    #[test]
    fn set_values_become_json() {
        let text = "[child]\ncommand=[\"a\"]\n[[patch]]\nfile=\"/m/config.json\"\nset={ \"max_position_embeddings\" = 131072, \"a.b\" = [1.5, true, \"x\"] }\n";
        let s = parse_str(text).unwrap();
        let set = &s.patches[0].set;
        assert!(set.contains(&("max_position_embeddings".into(), serde_json::json!(131072))));
        assert!(set.contains(&("a.b".into(), serde_json::json!([1.5, true, "x"]))));
    }

    #[test]
    fn port_comes_from_the_command() {
        let c = |v: &[&str]| v.iter().map(|s| s.to_string()).collect::<Vec<_>>();
        assert_eq!(port_of(&c(&["vllm", "serve", "--port", "9000"])), Some(9000));
        assert_eq!(port_of(&c(&["vllm", "serve", "--port=9001"])), Some(9001));
        assert_eq!(port_of(&c(&["vllm", "serve"])), None);
    }

    /// The man page's table of keys: (key, default column), row by row.
    fn man_page_rows() -> Vec<(String, String)> {
        include_str!("../docs/vllm-warden.toml.5.md")
            .lines()
            .filter(|l| l.starts_with("| `"))
            .map(|l| {
                let cells: Vec<&str> = l.trim_matches('|').split(" | ").map(str::trim).collect();
                (cells[0].trim_matches('`').to_string(), cells[1].to_string())
            })
            .collect()
    }

    #[test]
    fn the_man_page_shows_the_default_constants() {
        let quoted = |s: &str| format!("`\"{s}\"`");
        let duration = |d: Duration| quoted(&humantime::format_duration(d).to_string());
        let expected = [
            ("profile", quoted(defaults::PROFILE.name())),
            ("child.stop-signal", quoted(defaults::STOP_SIGNAL.as_str())),
            ("child.stop-timeout", duration(defaults::STOP_TIMEOUT)),
            ("prestart.port-wait", duration(defaults::PORT_WAIT)),
            ("prestart.gpu-idle-wait", duration(defaults::GPU_IDLE_WAIT)),
            ("prestart.gpu-query", format!("`{}`", defaults::GPU_QUERY.join(" "))),
            ("ready.timeout", duration(defaults::READY_TIMEOUT)),
            ("ready.stall", duration(defaults::READY_STALL)),
            ("fatal.grace", duration(defaults::FATAL_GRACE)),
            ("restart.initial-delay", duration(defaults::INITIAL_DELAY)),
            ("restart.max-delay", duration(defaults::MAX_DELAY)),
            ("restart.factor", format!("{:?}", defaults::FACTOR)),
            ("restart.jitter", format!("{:?}", defaults::JITTER)),
            ("restart.reset-after", duration(defaults::RESET_AFTER)),
            ("restart.max-attempts", defaults::MAX_ATTEMPTS.to_string()),
            ("restart.permanent-attempts", defaults::PERMANENT_ATTEMPTS.to_string()),
            ("health.interval", duration(defaults::HEALTH_INTERVAL)),
            ("health.timeout", duration(defaults::HEALTH_TIMEOUT)),
            ("health.failures", defaults::HEALTH_FAILURES.to_string()),
            ("health.canary-interval", duration(defaults::CANARY_INTERVAL)),
            ("health.canary-timeout", duration(defaults::CANARY_TIMEOUT)),
        ];
        let rows = man_page_rows();
        let row = |key: &str| {
            rows.iter().find(|(k, _)| k == key).map(|(_, d)| d.as_str()).unwrap_or_else(|| panic!("no row for {key}"))
        };
        for (key, want) in &expected {
            assert_eq!(row(key), want, "the man page's default of `{key}`");
        }
        // A duration in the table without a constant here would go unchecked.
        for (key, default) in &rows {
            let inner = default.strip_prefix("`\"").and_then(|d| d.strip_suffix("\"`"));
            if inner.is_some_and(|d| humantime::parse_duration(d).is_ok()) {
                assert!(expected.iter().any(|(k, _)| k == key), "`{key}` has a duration default but no constant");
            }
        }
        assert!(row("prestart.port").ends_with(&format!("else {}", defaults::PORT)));
        assert!(row("child.log-file").contains(&format!("`{}/NAME.log`", defaults::LOG_DIR)));
        assert!(row("status.file").contains(&format!("`{}/NAME/status.json`", defaults::RUN_DIR)));
    }

    /// The known keys of each section, as the unknown-key problem lists
    /// them, are exactly the keys the man page documents.
    #[test]
    fn the_man_page_documents_every_known_key() {
        let text = "zz = 1\n[child]\ncommand = [\"a\"]\nzz = 1\n[[patch]]\nfile = \"/f\"\nremove = [\"a\"]\nzz = 1\n\
                    [prestart]\nzz = 1\n[ready]\nzz = 1\n[fatal]\nzz = 1\n[restart]\nzz = 1\n[health]\nzz = 1\n\
                    [status]\nzz = 1\n";
        let problems = parse_str(text).unwrap_err().0;
        let mut known: Vec<String> = Vec::new();
        for p in &problems {
            let rest = p.message.strip_prefix("unknown key `zz`").unwrap_or_else(|| panic!("{p}"));
            let (place, list) = rest.split_once(" (known: ").unwrap_or_else(|| panic!("{p}"));
            let section = match place.trim_start_matches(" in ") {
                "" => String::new(),
                "[[patch]]" => "[[patch]] ".to_string(),
                s => format!("{}.", s.trim_matches(['[', ']'])),
            };
            for key in list.trim_end_matches(')').split(", ") {
                known.push(format!("{section}{key}"));
            }
        }
        assert_eq!(problems.len(), 9, "{problems:?}");
        let sections = ["child", "patch", "prestart", "ready", "fatal", "restart", "health", "status"];
        let mut documented: Vec<String> = man_page_rows().into_iter().map(|(k, _)| k).collect();
        documented.extend(sections.map(String::from));
        known.sort();
        documented.sort();
        assert_eq!(known, documented);
    }

    #[test]
    fn signals_parse_in_every_spelling() {
        assert_eq!(parse_signal("SIGINT"), Some(Signal::SIGINT));
        assert_eq!(parse_signal("term"), Some(Signal::SIGTERM));
        assert_eq!(parse_signal("9"), Some(Signal::SIGKILL));
        assert_eq!(parse_signal("SIGNOPE"), None);
    }
}
