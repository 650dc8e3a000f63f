//! What a reload changes: the running settings against the new ones, key by
//! key, each change sorted by what it touches. A change the child sees (its
//! command, environment, folder, log file, stop signal, the model files it
//! loads) needs the child started again; every other change is the
//! warden's own and applies to the running child in place; the instance's
//! name and state directory are its identity and change only with a new
//! warden. How the change is carried out is not known here.

use std::fmt;
use std::time::Duration;

use crate::config::Settings;

/// What a changed key touches.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Affects {
    /// The child sees it: the child must be started again.
    Child,
    /// The warden's own: applied to the running child in place.
    Warden,
    /// The instance's identity: read when the warden starts.
    Identity,
}

/// One changed key.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Change {
    pub key: &'static str,
    pub old: String,
    pub new: String,
    pub affects: Affects,
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

/// Every key that differs between `old` and `new`.
pub fn changes(old: &Settings, new: &Settings) -> Vec<Change> {
    use Affects::{Child, Identity, Warden};
    // Destructured whole: a new setting does not compile until it is sorted
    // here.
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
    let mut out = Vec::new();
    let mut cmp = |key: &'static str, affects: Affects, a: String, b: String| {
        if a != b {
            // Secrets never leave in a diff either (the environment).
            out.push(Change { key, old: a, new: b, affects });
        }
    };
    cmp("name", Identity, old.name.clone(), name.clone());
    cmp("state directory", Identity, dbg(&old.state_dir), dbg(state_dir));
    cmp("profile", Warden, old.profile.name().into(), profile.name().into());
    cmp(
        "child.command",
        Child,
        crate::util::redact::command(&old.child.command),
        crate::util::redact::command(&child.command),
    );
    // The child's keys by name: a new one does not compile until compared
    // (an unused binding is an error here).
    #[deny(unused_variables)]
    let crate::config::Child {
        command: _,
        env,
        cwd,
        cache_dir,
        // `$RUNTIME_DIRECTORY`, the unit's: the same for the warden's life.
        runtime_dir: _,
        log_file,
        log_rotation,
        stop_signal,
        stop_timeout,
    } = child;
    cmp("child.env", Child, crate::util::redact::env(&old.child.env), crate::util::redact::env(env));
    cmp("child.cwd", Child, dbg(&old.child.cwd), dbg(cwd));
    // The child's caches (vLLM's compile cache, Triton's, …) are in its
    // environment: the child starts again to use the new ones.
    cmp("child.cache-dir", Child, dbg(&old.child.cache_dir), dbg(cache_dir));
    cmp("child.log-file", Child, dbg(&old.child.log_file), dbg(log_file));
    let (lr, nr) = (&old.child.log_rotation, log_rotation);
    cmp("child.log-max-size", Warden, lr.max_size.to_string(), nr.max_size.to_string());
    cmp("child.log-keep", Warden, lr.keep.to_string(), nr.keep.to_string());
    cmp("child.log-compress", Warden, lr.compress.to_string(), nr.compress.to_string());
    cmp("child.stop-signal", Child, old.child.stop_signal.as_str().into(), stop_signal.as_str().into());
    cmp("child.stop-timeout", Warden, d(old.child.stop_timeout), d(*stop_timeout));
    cmp("patch", Child, dbg(&old.patches), dbg(patches));
    cmp("prestart.clean-shm", Warden, dbg(&old.prestart.clean_shm), dbg(&prestart.clean_shm));
    cmp("prestart.port", Warden, dbg(&old.prestart.port), dbg(&prestart.port));
    cmp("prestart.port-wait", Warden, d(old.prestart.port_wait), d(prestart.port_wait));
    cmp("prestart.gpu-idle-wait", Warden, d(old.prestart.gpu_idle_wait), d(prestart.gpu_idle_wait));
    cmp("prestart.gpu-query", Warden, dbg(&old.prestart.gpu_query), dbg(&prestart.gpu_query));
    cmp("prestart.ray-*", Warden, dbg(&old.prestart.ray), dbg(&prestart.ray));
    cmp("ready.http", Warden, dbg(&old.ready.http), dbg(&ready.http));
    cmp("ready.timeout", Warden, d(old.ready.timeout), d(ready.timeout));
    cmp("ready.stall", Warden, d(old.ready.stall), d(ready.stall));
    cmp("fatal.grace", Warden, d(old.fatal.grace), d(fatal.grace));
    let r = (&old.restart, restart);
    cmp("restart.initial-delay", Warden, d(r.0.initial_delay), d(r.1.initial_delay));
    cmp("restart.max-delay", Warden, d(r.0.max_delay), d(r.1.max_delay));
    cmp("restart.factor", Warden, r.0.factor.to_string(), r.1.factor.to_string());
    cmp("restart.jitter", Warden, r.0.jitter.to_string(), r.1.jitter.to_string());
    cmp("restart.reset-after", Warden, d(r.0.reset_after), d(r.1.reset_after));
    cmp("restart.max-attempts", Warden, r.0.max_attempts.to_string(), r.1.max_attempts.to_string());
    cmp("restart.permanent-attempts", Warden, r.0.permanent_attempts.to_string(), r.1.permanent_attempts.to_string());
    let h = (&old.health, health);
    cmp("health.http", Warden, dbg(&h.0.http), dbg(&h.1.http));
    cmp("health.interval", Warden, d(h.0.interval), d(h.1.interval));
    cmp("health.timeout", Warden, d(h.0.timeout), d(h.1.timeout));
    cmp("health.failures", Warden, h.0.failures.to_string(), h.1.failures.to_string());
    cmp("health.canary-interval", Warden, d(h.0.canary_interval), d(h.1.canary_interval));
    cmp("health.canary-timeout", Warden, d(h.0.canary_timeout), d(h.1.canary_timeout));
    cmp("health.progress-stall", Warden, d(h.0.progress_stall), d(h.1.progress_stall));
    cmp("health.kernel-messages", Warden, dbg(&h.0.kernel_messages), dbg(&h.1.kernel_messages));
    cmp("status.file", Warden, dbg(&old.status.file), dbg(&status.file));
    cmp("status.metrics-file", Warden, dbg(&old.status.metrics_file), dbg(&status.metrics_file));
    cmp("server.socket", Identity, dbg(&old.server.socket), dbg(&server.socket));
    cmp("server.listen", Identity, dbg(&old.server.listen), dbg(&server.listen));
    cmp("server.token-file", Identity, dbg(&old.server.token_file), dbg(&server.token_file));
    // The front door's addresses are the warden's own, bound once (or
    // passed by systemd): a new one needs a restart of the warden, as the
    // endpoint's. The rest applies to requests from then on.
    let listen = |f: &Option<crate::config::Front>| dbg(&f.as_ref().map(|f| &f.listen));
    cmp("front.listen", Identity, listen(&old.front), listen(front));
    // Each key on its own line, as every other key is said.
    let key = |f: &Option<crate::config::Front>, get: fn(&crate::config::Front) -> String| {
        f.as_ref().map_or_else(|| "none".to_string(), get)
    };
    let (of, nf) = (&old.front, front);
    cmp("front.hold", Warden, key(of, |f| d(f.hold)), key(nf, |f| d(f.hold)));
    cmp("front.max-held", Warden, key(of, |f| f.max_held.to_string()), key(nf, |f| f.max_held.to_string()));
    let retry = |f: &crate::config::Front| f.retry_unanswered.to_string();
    cmp("front.retry-unanswered", Warden, key(of, retry), key(nf, retry));
    cmp("front.max-body", Warden, key(of, |f| f.max_body.to_string()), key(nf, |f| f.max_body.to_string()));
    let conns = |f: &crate::config::Front| f.max_connections.to_string();
    cmp("front.max-connections", Warden, key(of, conns), key(nf, conns));
    let stop = |f: &crate::config::Front| f.idle_stop.map_or_else(|| "none".to_string(), d);
    cmp("front.idle-stop", Warden, key(of, stop), key(nf, stop));
    let action = |f: &crate::config::Front| format!("{:?}", f.idle_action).to_lowercase();
    cmp("front.idle-action", Warden, key(of, action), key(nf, action));
    let level = |f: &crate::config::Front| f.idle_sleep_level.to_string();
    cmp("front.idle-sleep-level", Warden, key(of, level), key(nf, level));
    let hold = |f: &crate::config::Front| f.idle_hold.map_or_else(|| "none".to_string(), d);
    cmp("front.idle-hold", Warden, key(of, hold), key(nf, hold));
    cmp("engine address", Child, dbg(&old.engine), dbg(engine));
    // The engine that sleeps is given vLLM's development mode in its
    // environment: a child started without it cannot sleep.
    let dev_mode = |s: &Settings| s.front.as_ref().is_some_and(crate::config::Front::sleeps).to_string();
    cmp("the engine's development mode (idle-action = \"sleep\")", Child, dev_mode(old), dev_mode(new));
    cmp("drain.delay", Warden, d(old.drain.delay), d(drain.delay));
    cmp("drain.timeout", Warden, d(old.drain.timeout), d(drain.timeout));
    cmp("drain.on-stop", Warden, old.drain.on_stop.to_string(), drain.on_stop.to_string());
    let lg = (&old.ledger, ledger);
    cmp("ledger.keep", Warden, lg.0.keep.to_string(), lg.1.keep.to_string());
    cmp("ledger.slow-factor", Warden, lg.0.slow_factor.to_string(), lg.1.slow_factor.to_string());
    cmp("ledger.deadline-factor", Warden, lg.0.deadline_factor.to_string(), lg.1.deadline_factor.to_string());
    // The read-ahead is of a start: the next one reads with the new values.
    let pf = (&old.prefetch, prefetch);
    cmp("prefetch.enabled", Warden, pf.0.enabled.to_string(), pf.1.enabled.to_string());
    cmp("prefetch.threads", Warden, pf.0.threads.to_string(), pf.1.threads.to_string());
    cmp(
        "prefetch.max-memory-fraction",
        Warden,
        pf.0.max_memory_fraction.to_string(),
        pf.1.max_memory_fraction.to_string(),
    );
    let g = (&old.golden, golden);
    cmp("golden.enabled", Warden, g.0.enabled.to_string(), g.1.enabled.to_string());
    cmp("golden.prompts", Warden, dbg(&g.0.prompts), dbg(&g.1.prompts));
    cmp("golden.prompts-file", Warden, dbg(&g.0.prompts_file), dbg(&g.1.prompts_file));
    cmp("golden.max-tokens", Warden, g.0.max_tokens.to_string(), g.1.max_tokens.to_string());
    cmp("golden.tolerance", Warden, g.0.tolerance.to_string(), g.1.tolerance.to_string());
    cmp("golden.on-mismatch", Warden, dbg(&g.0.on_mismatch), dbg(&g.1.on_mismatch));
    cmp("golden.accept-changes", Warden, g.0.accept_changes.to_string(), g.1.accept_changes.to_string());
    cmp("golden.timeout", Warden, d(g.0.timeout), d(g.1.timeout));
    cmp("golden.interval", Warden, d(g.0.interval), d(g.1.interval));
    let f = (&old.fit, fit);
    cmp("fit.enabled", Warden, f.0.enabled.to_string(), f.1.enabled.to_string());
    cmp("fit.adjust", Warden, dbg(&f.0.adjust), dbg(&f.1.adjust));
    cmp("fit.step", Warden, f.0.step.to_string(), f.1.step.to_string());
    cmp("fit.min-utilization", Warden, f.0.min_utilization.to_string(), f.1.min_utilization.to_string());
    cmp("fit.max-utilization", Warden, f.0.max_utilization.to_string(), f.1.max_utilization.to_string());
    cmp("fit.min-model-len", Warden, f.0.min_model_len.to_string(), f.1.min_model_len.to_string());
    cmp("fit.model-len-multiple", Warden, f.0.model_len_multiple.to_string(), f.1.model_len_multiple.to_string());
    cmp("fit.attempts", Warden, f.0.attempts.to_string(), f.1.attempts.to_string());
    cmp("rollback.enabled", Warden, old.rollback.enabled.to_string(), rollback.enabled.to_string());
    cmp("rollback.keep", Warden, old.rollback.keep.to_string(), rollback.keep.to_string());
    let rp = (&old.reports, reports);
    cmp("reports.keep", Warden, rp.0.keep.to_string(), rp.1.keep.to_string());
    cmp("reports.max-size", Warden, rp.0.max_size.to_string(), rp.1.max_size.to_string());
    cmp("reports.lines", Warden, rp.0.lines.to_string(), rp.1.lines.to_string());
    cmp("reports.timeout", Warden, d(rp.0.timeout), d(rp.1.timeout));
    cmp("reports.py-spy", Warden, dbg(&rp.0.py_spy), dbg(&rp.1.py_spy));
    cmp("reports.gpu-snapshot", Warden, dbg(&rp.0.gpu_snapshot), dbg(&rp.1.gpu_snapshot));
    cmp("reports.kernel-messages", Warden, dbg(&rp.0.kernel_messages), dbg(&rp.1.kernel_messages));
    // The daemon's command and folder: `daemon::preload` decides whether
    // the daemon itself starts again.
    let shown = |p: &crate::config::preload::Preload| if p.enabled { dbg(p) } else { "off".into() };
    cmp("preload", Child, shown(&old.preload), shown(preload));
    cmp("patterns", Warden, dbg(&old.patterns), dbg(patterns));
    cmp("hint", Warden, dbg(&old.hints), dbg(hints));
    out
}

/// What a reload does.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ReloadPlan {
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
pub fn plan(old: &Settings, new: &Settings) -> ReloadPlan {
    let all: Vec<Change> = changes(old, new).into_iter().filter(|c| c.affects != Affects::Identity).collect();
    let because: Vec<Change> = all.iter().filter(|c| c.affects == Affects::Child).cloned().collect();
    match (all.is_empty(), because.is_empty()) {
        (true, _) => ReloadPlan::Nothing,
        (false, true) => ReloadPlan::InPlace(all),
        (false, false) => ReloadPlan::Restart { because, all },
    }
}

/// Where a running warden keeps the config text it runs with.
pub fn running_path(state_dir: &std::path::Path) -> std::path::PathBuf {
    state_dir.join("running.toml")
}

/// Keep the config text the warden now runs with (for `check --diff`);
/// a failure is logged, never fatal.
pub fn save_running(s: &Settings) {
    let path = running_path(&s.state_dir);
    let saved = std::fs::create_dir_all(&s.state_dir)
        .and_then(|()| crate::util::fsutil::replace(&path, s.text.as_bytes(), 0o600));
    if let Err(e) = saved {
        tracing::warn!(error = %e, file = %path.display(), "cannot keep the running config");
    }
}

/// The identity changes a reload cannot apply.
pub fn identity_left(old: &Settings, new: &Settings) -> Vec<Change> {
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
}
