//! What a reload changes: the running settings against the new ones, key by
//! key, each change sorted by what it touches. A change the child sees (its
//! command, environment, folder, log file, stop signal, the model files it
//! loads) needs the child started again; every other change is the
//! warden's own and applies to the running child in place; the instance's
//! name and state directory are its identity and change only with a new
//! warden. Which key is which is `config::keys`'s table, where each key
//! says what it touches; here each field of the settings is compared under
//! its key. How the change is carried out is not known here.

use std::fmt;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use nix::sys::signal::Signal;

use crate::config::keys::{self, Key};
use crate::config::preload::Preload;
use crate::config::profile::{Patterns, Profile};
use crate::config::{
    Child, Cluster, Drain, Engine, Fatal, Fit, FitArg, Front, Golden, GoldenPolicy, Health, IdleAction, Ledger,
    Prefetch, Prestart, Ready, Reports, Restart, Rollback, Rotation, Server, Settings, Status,
};
use crate::patch::Patch;

/// What a changed key touches, as `config::keys` says for each key.
pub(crate) use crate::config::keys::Affects;

/// One changed key.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Change {
    pub(crate) key: &'static str,
    pub(crate) old: String,
    pub(crate) new: String,
    pub(crate) affects: Affects,
}

impl fmt::Display for Change {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} {} → {}", self.key, self.old, self.new)
    }
}

fn d(x: Duration) -> String {
    humantime::format_duration(x).to_string()
}

fn dbg<T: fmt::Debug>(x: &T) -> String {
    crate::util::redact::text(&format!("{x:?}")).into_owned()
}

/// A value as a reload's line shows it: a duration as it is written,
/// numbers, switches and names as they are, the rest as Rust shows it,
/// secrets masked.
trait Shown {
    fn shown(&self) -> String;
}

impl Shown for Duration {
    fn shown(&self) -> String {
        d(*self)
    }
}

impl Shown for Option<Duration> {
    fn shown(&self) -> String {
        self.map_or_else(|| "none".to_string(), d)
    }
}

impl Shown for Signal {
    fn shown(&self) -> String {
        self.as_str().into()
    }
}

impl Shown for Profile {
    fn shown(&self) -> String {
        self.name().into()
    }
}

impl Shown for IdleAction {
    fn shown(&self) -> String {
        format!("{self:?}").to_lowercase()
    }
}

macro_rules! shown_as_displayed {
    ($($t:ty),*) => { $(impl Shown for $t { fn shown(&self) -> String { self.to_string() } })* };
}
shown_as_displayed!(String, u8, u32, u64, f64, bool);

macro_rules! shown_as_debugged {
    ($($t:ty),*) => { $(impl Shown for $t { fn shown(&self) -> String { dbg(self) } })* };
}
shown_as_debugged!(
    PathBuf,
    Option<PathBuf>,
    Option<String>,
    Option<u16>,
    Option<SocketAddr>,
    Option<Cluster>,
    Option<Engine>,
    Vec<String>,
    Vec<FitArg>,
    Vec<Patch>,
    Vec<(String, String)>,
    GoldenPolicy,
    Patterns
);

/// A comparison: the name a change is said by, and what it touches.
#[derive(Debug, Clone, Copy)]
struct Compared {
    name: &'static str,
    affects: Affects,
}

impl Compared {
    const fn of(key: &Key) -> Compared {
        Compared { name: key.change, affects: key.affects }
    }
}

/// The comparison of a key of `config::keys::KEYS`, or of the name some of
/// its keys are compared under together (`"patterns"`), with what the
/// table says the change touches. Evaluated as a constant: a name that is
/// in no row of the table does not compile.
macro_rules! key {
    ($name:literal) => {{
        const COMPARED: Compared = Compared::of(keys::compared($name));
        COMPARED
    }};
}

/// The comparison of a field of a section's settings, under the key of
/// the section it is named after (`restart`, `initial_delay`:
/// `restart.initial-delay`). Evaluated as a constant: a field named after
/// no key of the table does not compile.
macro_rules! field {
    ($section:ident, $field:ident) => {{
        const COMPARED: Compared = Compared::of(keys::named(stringify!($section), stringify!($field)));
        COMPARED
    }};
}

/// Compares the fields of a section of the settings, in the order given:
/// `fields!(cmp, old.restart, restart: Restart { initial_delay, … })`,
/// `restart` the new settings' section, which names the keys. Each field
/// is compared under the key it is named after, shown as its type's
/// [`Shown`] says, or
/// - `field = "key"`: under another key, or a name some keys are
///   compared under together;
/// - `field as function`: shown by a function of its own;
/// - `field: { Type { … } }`: a part whose own fields are compared there;
/// - `field: _`: not here, with a comment that says why.
///
/// The section is destructured whole, without `..`: a field left out does
/// not compile (rustc: "pattern requires `..`"). With `opt`, the section
/// may be off (`None`), and each of its keys is then shown as `none`.
macro_rules! fields {
    ($cmp:ident, $old:expr, $new:ident: $ty:ident { $($body:tt)* }) => {
        fields!(@struct $cmp, $old, $new, $new, $ty { $($body)* })
    };
    ($cmp:ident, opt $old:expr, $new:ident: $ty:ident { $($field:ident $(: $skip:tt)?),* $(,)? }) => {{
        if let Some(section) = $new {
            let $ty { $($field: _),* } = section;
        }
        $( fields!(@opt $cmp, $old, $new, $ty, $field $(: $skip)?); )*
    }};
    (@struct $cmp:ident, $o:expr, $n:expr, $section:ident,
        $ty:ident { $($field:ident $(= $key:literal)? $(as $show:path)? $(: $skip:tt)?),* $(,)? }) => {{
        let $ty { $($field: _),* } = &$n;
        $( fields!(@one $cmp, $o, $n, $section, $field $(= $key)? $(as $show)? $(: $skip)?); )*
    }};
    (@one $cmp:ident, $o:expr, $n:expr, $section:ident, $field:ident: _) => {};
    (@one $cmp:ident, $o:expr, $n:expr, $section:ident, $field:ident: { $ty:ident { $($inner:tt)* } }) => {
        fields!(@struct $cmp, $o.$field, $n.$field, $section, $ty { $($inner)* })
    };
    (@one $cmp:ident, $o:expr, $n:expr, $section:ident, $field:ident = $key:literal) => {
        $cmp(key!($key), Shown::shown(&$o.$field), Shown::shown(&$n.$field))
    };
    (@one $cmp:ident, $o:expr, $n:expr, $section:ident, $field:ident as $show:path) => {
        $cmp(field!($section, $field), $show(&$o.$field), $show(&$n.$field))
    };
    (@one $cmp:ident, $o:expr, $n:expr, $section:ident, $field:ident) => {
        $cmp(field!($section, $field), Shown::shown(&$o.$field), Shown::shown(&$n.$field))
    };
    (@opt $cmp:ident, $o:expr, $n:ident, $ty:ident, $field:ident: _) => {};
    (@opt $cmp:ident, $o:expr, $n:ident, $ty:ident, $field:ident) => {{
        let shown = |s: &Option<$ty>| s.as_ref().map_or_else(|| "none".to_string(), |s| s.$field.shown());
        $cmp(field!($n, $field), shown(&$o), shown($n))
    }};
}

/// Every key that differs between `old` and `new`.
pub(crate) fn changes(old: &Settings, new: &Settings) -> Vec<Change> {
    let mut out = Vec::new();
    compare(old, new, &mut |c, a, b| {
        if a != b {
            // Secrets never leave in a diff either (the environment).
            out.push(Change { key: c.name, old: a, new: b, affects: c.affects });
        }
    });
    out
}

/// Every comparison of `old` with `new`, changed or not, in the order a
/// reload names the changes.
///
/// No key can be missing here: every field of the settings is named,
/// each section destructured whole (a new field does not compile until
/// it is), and compared under the key of `config::keys::KEYS` it is
/// named after or is given (a field or a name in no row of the table
/// does not compile). A key of the table that no comparison names fails
/// `every_key_of_the_table_is_compared`, and one whose change alone is
/// not seen fails `every_key_changed_alone_is_seen_by_a_reload`.
fn compare(old: &Settings, new: &Settings, cmp: &mut dyn FnMut(Compared, String, String)) {
    use crate::util::redact;
    // The settings' own fields: an unused binding is an error.
    #[deny(unused_variables)]
    let Settings {
        source: _,
        text: _,
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
        state_dir,
        patterns,
        hints,
    } = new;
    cmp(key!("name"), old.name.shown(), name.shown());
    // Not a key: `$STATE_DIRECTORY`, else the name's.
    cmp(Compared { name: "state directory", affects: Affects::Identity }, old.state_dir.shown(), state_dir.shown());
    cmp(key!("profile"), old.profile.shown(), profile.shown());
    fields!(cmp, old.child, child: Child {
        command as redact::command,
        env as redact::env,
        cwd,
        cache_dir,
        // `$RUNTIME_DIRECTORY`, the unit's: the same for the warden's life.
        runtime_dir: _,
        log_file,
        log_rotation: { Rotation {
            max_size = "child.log-max-size",
            keep = "child.log-keep",
            compress = "child.log-compress",
        } },
        stop_signal,
        stop_timeout,
    });
    cmp(key!("patch"), old.patches.shown(), patches.shown());
    fields!(cmp, old.prestart, prestart: Prestart {
        clean_shm, port, port_wait, gpu_idle_wait, gpu_query, ray = "prestart.ray-*",
    });
    fields!(cmp, old.ready, ready: Ready { http, timeout, stall });
    fields!(cmp, old.fatal, fatal: Fatal { grace });
    fields!(cmp, old.restart, restart: Restart {
        initial_delay, max_delay, factor, jitter, reset_after, max_attempts, permanent_attempts,
    });
    fields!(cmp, old.health, health: Health {
        http, interval, timeout, failures, canary_interval, canary_timeout, progress_stall, kernel_messages,
    });
    fields!(cmp, old.status, status: Status { file, metrics_file });
    fields!(cmp, old.server, server: Server { socket, listen, token_file });
    // The addresses as they are, or `None` without a front door.
    let listen = |f: &Option<Front>| dbg(&f.as_ref().map(|f| &f.listen));
    cmp(key!("front.listen"), listen(&old.front), listen(front));
    fields!(cmp, opt old.front, front: Front {
        // Above.
        listen: _,
        hold, max_held, retry_unanswered, max_body, min_body_rate, max_connections, idle_stop, idle_action,
        idle_sleep_level,
        idle_hold,
    });
    // Not a key: where the engine serves follows from the command,
    // `prestart.port` and `[front]`.
    cmp(Compared { name: "engine address", affects: Affects::Child }, old.engine.shown(), engine.shown());
    // Not a key either: the engine that sleeps is given vLLM's development
    // mode in its environment, and a child started without it cannot sleep.
    let dev_mode = |s: &Settings| s.front.as_ref().is_some_and(Front::sleeps).to_string();
    let dev_mode_key =
        Compared { name: "the engine's development mode (idle-action = \"sleep\")", affects: Affects::Child };
    cmp(dev_mode_key, dev_mode(old), dev_mode(new));
    fields!(cmp, old.drain, drain: Drain { delay, timeout, on_stop });
    fields!(cmp, old.ledger, ledger: Ledger { keep, slow_factor, deadline_factor });
    fields!(cmp, old.prefetch, prefetch: Prefetch { enabled, threads, max_memory_fraction });
    fields!(cmp, old.golden, golden: Golden {
        enabled, prompts, prompts_file, max_tokens, tolerance, on_mismatch, accept_changes, timeout, interval,
    });
    fields!(cmp, old.fit, fit: Fit {
        enabled, adjust, step, min_utilization, max_utilization, min_model_len, model_len_multiple, attempts,
    });
    fields!(cmp, old.rollback, rollback: Rollback { enabled, keep });
    fields!(cmp, old.reports, reports: Reports {
        keep, max_size, lines, timeout, py_spy, gpu_snapshot, kernel_messages,
    });
    // Compared whole; off, the daemon's settings are not in use.
    let shown = |p: &Preload| if p.enabled { dbg(p) } else { "off".into() };
    cmp(key!("preload"), shown(&old.preload), shown(preload));
    cmp(key!("patterns"), old.patterns.shown(), patterns.shown());
    cmp(key!("hint"), old.hints.shown(), hints.shown());
}

/// What a reload does.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum ReloadPlan {
    Nothing,
    /// Only the warden's own settings changed: applied to the running child.
    InPlace(Vec<Change>),
    /// The child sees a change (`because`): it is started again with all of
    /// them.
    Restart {
        because: Vec<Change>,
        all: Vec<Change>,
    },
}

/// What reloading `new` over `old` does. Identity changes are left out:
/// they wait for a new warden (and are said so by [`identity_left`]).
pub(crate) fn plan(old: &Settings, new: &Settings) -> ReloadPlan {
    let all: Vec<Change> = changes(old, new).into_iter().filter(|c| c.affects != Affects::Identity).collect();
    let because: Vec<Change> = all.iter().filter(|c| c.affects == Affects::Child).cloned().collect();
    match (all.is_empty(), because.is_empty()) {
        (true, _) => ReloadPlan::Nothing,
        (false, true) => ReloadPlan::InPlace(all),
        (false, false) => ReloadPlan::Restart { because, all },
    }
}

/// Where a running warden keeps the config text it runs with.
pub(crate) fn running_path(state_dir: &std::path::Path) -> std::path::PathBuf {
    state_dir.join("running.toml")
}

/// Keep the config text the warden now runs with (for `check --diff`);
/// a failure is logged, never fatal.
pub(crate) fn save_running(s: &Settings) {
    let path = running_path(&s.state_dir);
    let saved = std::fs::create_dir_all(&s.state_dir)
        .and_then(|()| crate::util::fsutil::replace(&path, s.text.as_bytes(), 0o600));
    if let Err(e) = saved {
        tracing::warn!(error = %e, file = %path.display(), "cannot keep the running config");
    }
}

/// The identity changes a reload cannot apply.
pub(crate) fn identity_left(old: &Settings, new: &Settings) -> Vec<Change> {
    changes(old, new).into_iter().filter(|c| c.affects == Affects::Identity).collect()
}

impl fmt::Display for ReloadPlan {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let list = |v: &[Change]| v.iter().map(Change::to_string).collect::<Vec<_>>().join(", ");
        match self {
            ReloadPlan::Nothing => write!(f, "nothing changed"),
            ReloadPlan::InPlace(all) => write!(f, "reloaded in place: {}", list(all)),
            ReloadPlan::Restart { because, all } => {
                let keys: Vec<&str> = because.iter().map(|c| c.key).collect();
                write!(f, "restarting the child: {} changed ({})", keys.join(", "), list(all))
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::path::Path;

    fn parse(extra: &str) -> Settings {
        let text = format!(
            "[child]\ncommand = [\"vllm\", \"serve\", \"/m\"]\nenv = {{ A = \"1\", HF_TOKEN = \"x\" }}\n{extra}"
        );
        crate::config::parse(&text, Path::new("/etc/vllm-warden/t.toml"), &Default::default()).unwrap()
    }

    /// An idle engine put to sleep needs vLLM's development mode in its
    /// environment: turning sleep on or off restarts the child; the idle
    /// time alone is the warden's.
    #[test]
    fn turning_sleep_on_restarts_the_child_and_the_idle_time_does_not() {
        let (stop, sleep) = (
            parse("[front]\nlisten = \"127.0.0.1:8000\"\nidle-stop = \"30m\"\n"),
            crate::config::parse(
                "[child]\ncommand = [\"vllm\", \"serve\", \"/m\", \"--enable-sleep-mode\"]\nenv = { A = \"1\", HF_TOKEN = \"x\" }\n\
                 [front]\nlisten = \"127.0.0.1:8000\"\nidle-stop = \"30m\"\nidle-action = \"sleep\"\n",
                Path::new("/etc/vllm-warden/t.toml"),
                &Default::default(),
            )
            .unwrap(),
        );
        let p = plan(&stop, &sleep);
        assert!(matches!(p, ReloadPlan::Restart { .. }), "{p}");
        assert!(p.to_string().contains("development mode"), "{p}");
        let longer = parse("[front]\nlisten = \"127.0.0.1:8000\"\nidle-stop = \"1h\"\n");
        assert!(matches!(plan(&stop, &longer), ReloadPlan::InPlace(_)), "{}", plan(&stop, &longer));
        assert_eq!(plan(&stop, &longer).to_string(), "reloaded in place: front.idle-stop 30m → 1h");
    }

    /// The child's caches are in its environment: a reload that changes
    /// only `child.cache-dir` starts the child again on the new ones.
    #[test]
    fn a_new_cache_folder_restarts_the_child() {
        let with = |dir: &str| {
            let text = format!("[child]\ncommand = [\"vllm\", \"serve\", \"/m\"]\ncache-dir = \"{dir}\"\n");
            crate::config::parse(&text, Path::new("/etc/vllm-warden/t.toml"), &Default::default()).unwrap()
        };
        let p = plan(&with("/var/cache/a"), &with("/var/cache/b"));
        assert!(matches!(p, ReloadPlan::Restart { .. }), "{p}");
        assert_eq!(
            p.to_string(),
            "restarting the child: child.cache-dir changed (child.cache-dir Some(\"/var/cache/a\") → Some(\"/var/cache/b\"))"
        );
        assert_eq!(plan(&with("/var/cache/a"), &with("/var/cache/a")), ReloadPlan::Nothing);
    }

    #[test]
    fn a_warden_side_change_is_applied_in_place_and_said_in_a_line() {
        let p = plan(&parse("[health]\ninterval = \"15s\"\n"), &parse("[health]\ninterval = \"30s\"\n"));
        assert_eq!(p.to_string(), "reloaded in place: health.interval 15s → 30s");
        assert!(matches!(p, ReloadPlan::InPlace(_)));
    }

    #[test]
    fn a_change_the_child_sees_restarts_it_and_names_the_key_with_secrets_masked() {
        let old = parse("");
        let new = crate::config::parse(
            "[child]\ncommand = [\"vllm\", \"serve\", \"/m\"]\nenv = { A = \"2\", HF_TOKEN = \"y\" }\n[health]\ninterval = \"30s\"\n",
            Path::new("/etc/vllm-warden/t.toml"),
            &Default::default(),
        )
        .unwrap();
        let p = plan(&old, &new);
        let ReloadPlan::Restart { because, .. } = &p else { panic!("{p:?}") };
        assert_eq!(because.iter().map(|c| c.key).collect::<Vec<_>>(), ["child.env"]);
        let shown = p.to_string();
        assert!(
            shown.starts_with("restarting the child: child.env changed (child.env A=1 HF_TOKEN=*** → A=2 HF_TOKEN=***"),
            "{shown}"
        );
        assert!(shown.contains("health.interval 15s → 1m") || shown.contains("health.interval 15s → 30s"), "{shown}");
    }

    #[test]
    fn nothing_changed_is_nothing_and_identity_waits_for_a_new_warden() {
        assert_eq!(plan(&parse(""), &parse("")), ReloadPlan::Nothing);
        let text = "name = \"other\"\n[child]\ncommand = [\"vllm\", \"serve\", \"/m\"]\nenv = { A = \"1\", HF_TOKEN = \"x\" }\n";
        let renamed = crate::config::parse(text, Path::new("/etc/vllm-warden/t.toml"), &Default::default()).unwrap();
        let left: Vec<&str> = identity_left(&parse(""), &renamed).iter().map(|c| c.key).collect();
        // The default socket is in the name's runtime folder.
        assert_eq!(left, ["name", "state directory", "server.socket"]);
        // The name also names the default log file: that, the child sees.
        let ReloadPlan::Restart { because, .. } = plan(&parse(""), &renamed) else { panic!() };
        assert_eq!(because.iter().map(|c| c.key).collect::<Vec<_>>(), ["child.log-file"]);
    }

    /// Every key of the table is compared, under the name and with what
    /// it touches as the table says.
    #[test]
    fn every_key_of_the_table_is_compared() {
        let s = parse("");
        let mut named = Vec::new();
        compare(&s, &s, &mut |c, _, _| named.push((c.name, c.affects)));
        for k in keys::KEYS {
            assert!(named.contains(&(k.change, k.affects)), "a reload compares no `{}` ({:?})", k.change, k.affects);
        }
    }

    /// A config that gives the key `key` the value `value` (a TOML
    /// literal), with what the key needs beside it to be read and in use:
    /// a command (one that can sleep), the first keys of an array's
    /// entry, a front door's address, a cluster's, the endpoint's
    /// listener, the weight-cache daemon on.
    fn config_with(key: &Key, value: &str) -> String {
        let (section, name) = (key.section(), key.name());
        let line = format!("{name} = {value}\n");
        let mut text = if section.is_empty() { line.clone() } else { String::new() };
        text.push_str("[child]\n");
        if key.path != "child.command" {
            text.push_str("command = [\"vllm\", \"serve\", \"/m\", \"--enable-sleep-mode\"]\n");
        }
        if section.is_empty() || section == "child" {
            return if section.is_empty() { text } else { text + &line };
        }
        text.push_str(&if key.in_array() { format!("[[{section}]]\n") } else { format!("[{section}]\n") });
        let beside: &[&str] = match section {
            "patch" => &["file = \"/m/config.json\"", "remove = [\"a\"]"],
            "hint" => &["match = \"x\"", "text = \"y\""],
            "front" => &["listen = \"127.0.0.1:8000\""],
            "server" => &["listen = \"127.0.0.1:9400\""],
            "preload" => &["enabled = true"],
            "prestart" if name.starts_with("ray-") => &["ray-address = \"127.0.0.3:6391\""],
            _ => &[],
        };
        for b in beside.iter().filter(|b| !b.starts_with(&format!("{name} = "))) {
            text.push_str(&format!("{b}\n"));
        }
        text + &line
    }

    /// Values to try for any key, as TOML: one of each shape the reader
    /// knows, twice.
    const VALUES: [&str; 38] = [
        "true",
        "false",
        "1",
        "2",
        "0.5",
        "0.25",
        "\"1s\"",
        "\"2s\"",
        "\"1h\"",
        "\"2h\"",
        "\"/a\"",
        "\"/b\"",
        "\"4 MiB\"",
        "\"8 MiB\"",
        "[]",
        "[\"a\"]",
        "[\"b\"]",
        "[\"a\", \"{pid}\"]",
        "[\"max-model-len\"]",
        "[\"gpu-memory-utilization\"]",
        "{ A = \"1\" }",
        "{ A = \"2\" }",
        "\"http://127.0.0.1:1/a\"",
        "\"http://127.0.0.1:1/b\"",
        "\"127.0.0.1:9001\"",
        "\"127.0.0.1:9002\"",
        "\"SIGINT\"",
        "\"SIGHUP\"",
        "\"warn\"",
        "\"fail\"",
        "\"stop\"",
        "\"sleep\"",
        "\"vllm\"",
        "\"none\"",
        "\"a\"",
        "\"b\"",
        "[\"vllm\", \"serve\", \"/n\"]",
        "[\"vllm\", \"serve\", \"/o\"]",
    ];

    /// Every key of the table, changed alone, is a change a reload names,
    /// with what the table says it touches: for each key, the first two
    /// values of [`VALUES`] that read into different settings are
    /// reloaded one over the other. (`child.cache-dir` was once read and
    /// not compared: a reload that changed only it said nothing changed.)
    #[test]
    fn every_key_changed_alone_is_seen_by_a_reload() {
        let read = |text: &str| {
            let mut s = crate::config::parse(text, Path::new("/etc/vllm-warden/t.toml"), &Default::default()).ok()?;
            s.text = String::new();
            let shown = format!("{s:?}");
            Some((s, shown))
        };
        for k in keys::KEYS {
            let mut first: Option<(Settings, String, &str)> = None;
            let mut pair = None;
            for value in VALUES {
                let Some((s, shown)) = read(&config_with(k, value)) else { continue };
                match &first {
                    None => first = Some((s, shown, value)),
                    Some((a, a_shown, a_value)) if *a_shown != shown => {
                        pair = Some((a.clone(), s, *a_value, value));
                        break;
                    }
                    Some(_) => {}
                }
            }
            let Some((a, b, x, y)) = pair else {
                panic!("no two values of `{}` read differently: give VALUES one that does", k.path)
            };
            let seen = changes(&a, &b);
            assert!(
                seen.iter().any(|c| c.key == k.change && c.affects == k.affects),
                "`{}` from {x} to {y}: a reload says {seen:?}, not `{}` ({:?})",
                k.path,
                k.change,
                k.affects
            );
        }
    }
}
