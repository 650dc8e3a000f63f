//! Every key of the file, once: its place (`child.cache-dir`, `[[patch]]
//! file`, as the man page's table writes it) and what a reload does when
//! it changes. The reader's known keys are this table's (an unknown key is
//! listed against them, a near miss suggested from them; a read of a key
//! that is not here is a bug its tests meet); `daemon::reload` names its
//! comparisons from it, each settings' field by the key it is named after,
//! and a field or a name that is not here does not compile (see [`named`],
//! [`compared`]); tests hold it to the man page, to the reader and to the
//! reload's comparisons.
//!
//! Adding a key: its row here, its read in its section's function, its
//! field compared in `daemon::reload`, its row in the man page.
//!
//! In the order the reader takes them, which is the order its messages
//! list them in: the top level's own keys, then each section's, the
//! sections in the order the top level takes them.

/// What a change of a key needs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Affects {
    /// The child sees it: the child must be started again.
    Child,
    /// The warden's own: applied to the running child in place.
    Warden,
    /// The instance's identity: read when the warden starts.
    Identity,
}

/// One key of the file.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Key {
    /// As the man page's table writes it: `name`, `child.cache-dir`,
    /// `[[patch]] file`.
    pub(crate) path: &'static str,
    /// What a reload does when it changes.
    pub(crate) affects: Affects,
    /// The name a reload gives its change: the key's own path, or the
    /// value it is read into together with other keys, which a reload
    /// compares as one (`patterns`: the profile's lists and the config's).
    pub(crate) change: &'static str,
}

impl Key {
    /// The table it is in: `child`; `patch` for `[[patch]]`; `""` at the
    /// top level.
    pub(crate) fn section(&self) -> &'static str {
        self.split().0
    }

    /// Its name within its table: `cache-dir`.
    pub(crate) fn name(&self) -> &'static str {
        self.split().1
    }

    /// Whether its table is one of an array (`[[patch]]`).
    #[cfg(test)]
    pub(crate) fn in_array(&self) -> bool {
        self.path.starts_with("[[")
    }

    fn split(&self) -> (&'static str, &'static str) {
        let path = self.path;
        if let Some(rest) = path.strip_prefix("[[") {
            return rest.split_once("]] ").unwrap_or(("", path));
        }
        path.split_once('.').unwrap_or(("", path))
    }
}

const fn own(path: &'static str, affects: Affects) -> Key {
    Key { path, affects, change: path }
}

const fn within(path: &'static str, affects: Affects, change: &'static str) -> Key {
    Key { path, affects, change }
}

use Affects::{Child, Identity, Warden};

/// The table.
pub(crate) const KEYS: &[Key] = &[
    own("name", Identity),
    own("profile", Warden),
    own("child.command", Child),
    own("child.env", Child),
    own("child.cwd", Child),
    // The child's caches (vLLM's compile cache, Triton's, …) are in its
    // environment: the child starts again to use the new ones.
    own("child.cache-dir", Child),
    own("child.log-file", Child),
    own("child.log-max-size", Warden),
    own("child.log-keep", Warden),
    own("child.log-compress", Warden),
    own("child.stop-signal", Child),
    own("child.stop-timeout", Warden),
    // The model files the child loads.
    within("[[patch]] file", Child, "patch"),
    within("[[patch]] remove", Child, "patch"),
    within("[[patch]] set", Child, "patch"),
    within("[[patch]] max-size", Child, "patch"),
    own("prestart.clean-shm", Warden),
    own("prestart.port", Warden),
    own("prestart.port-wait", Warden),
    own("prestart.gpu-idle-wait", Warden),
    own("prestart.gpu-query", Warden),
    // One cluster, whose address may come from the command.
    within("prestart.ray-address", Warden, "prestart.ray-*"),
    within("prestart.ray-min-nodes", Warden, "prestart.ray-*"),
    within("prestart.ray-min-cpus", Warden, "prestart.ray-*"),
    within("prestart.ray-min-gpus", Warden, "prestart.ray-*"),
    within("prestart.ray-wait", Warden, "prestart.ray-*"),
    within("prestart.ray-python", Warden, "prestart.ray-*"),
    // The pattern lists are the profile's and the config's together.
    within("ready.log", Warden, "patterns"),
    own("ready.http", Warden),
    own("ready.timeout", Warden),
    own("ready.stall", Warden),
    within("ready.progress", Warden, "patterns"),
    within("fatal.match", Warden, "patterns"),
    within("fatal.ignore", Warden, "patterns"),
    within("fatal.permanent", Warden, "patterns"),
    own("fatal.grace", Warden),
    own("restart.initial-delay", Warden),
    own("restart.max-delay", Warden),
    own("restart.factor", Warden),
    own("restart.jitter", Warden),
    own("restart.reset-after", Warden),
    own("restart.max-attempts", Warden),
    own("restart.permanent-attempts", Warden),
    own("health.http", Warden),
    own("health.interval", Warden),
    own("health.timeout", Warden),
    own("health.failures", Warden),
    own("health.canary-interval", Warden),
    own("health.canary-timeout", Warden),
    own("health.progress-stall", Warden),
    own("health.kernel-messages", Warden),
    own("status.file", Warden),
    own("status.metrics-file", Warden),
    // The endpoint is bound once, as the warden starts.
    own("server.socket", Identity),
    own("server.listen", Identity),
    own("server.token-file", Identity),
    own("drain.delay", Warden),
    own("drain.timeout", Warden),
    own("drain.on-stop", Warden),
    within("[[hint]] match", Warden, "hint"),
    within("[[hint]] text", Warden, "hint"),
    own("reports.keep", Warden),
    own("reports.max-size", Warden),
    own("reports.lines", Warden),
    own("reports.timeout", Warden),
    own("reports.py-spy", Warden),
    own("reports.gpu-snapshot", Warden),
    own("reports.kernel-messages", Warden),
    own("ledger.keep", Warden),
    own("ledger.slow-factor", Warden),
    own("ledger.deadline-factor", Warden),
    own("golden.enabled", Warden),
    own("golden.prompts", Warden),
    own("golden.prompts-file", Warden),
    own("golden.max-tokens", Warden),
    own("golden.tolerance", Warden),
    own("golden.on-mismatch", Warden),
    own("golden.accept-changes", Warden),
    own("golden.timeout", Warden),
    own("golden.interval", Warden),
    own("fit.enabled", Warden),
    own("fit.adjust", Warden),
    own("fit.step", Warden),
    own("fit.min-utilization", Warden),
    own("fit.max-utilization", Warden),
    own("fit.min-model-len", Warden),
    own("fit.model-len-multiple", Warden),
    own("fit.attempts", Warden),
    own("rollback.enabled", Warden),
    own("rollback.keep", Warden),
    // The daemon's command and folder, and the engine's command that
    // loads from it: `daemon::preload` decides whether the daemon itself
    // starts again.
    within("preload.enabled", Child, "preload"),
    within("preload.command", Child, "preload"),
    within("preload.health-port", Child, "preload"),
    within("preload.socket-dir", Child, "preload"),
    // The front door's addresses are the warden's own, bound once (or
    // passed by systemd): a new one needs a restart of the warden, as the
    // endpoint's. The rest applies to requests from then on.
    own("front.listen", Identity),
    own("front.hold", Warden),
    own("front.max-held", Warden),
    own("front.retry-unanswered", Warden),
    own("front.max-body", Warden),
    own("front.min-body-rate", Warden),
    own("front.max-connections", Warden),
    own("front.idle-stop", Warden),
    own("front.idle-action", Warden),
    own("front.idle-sleep-level", Warden),
    own("front.idle-hold", Warden),
    // The read-ahead is of a start: the next one reads with the new values.
    own("prefetch.enabled", Warden),
    own("prefetch.threads", Warden),
    own("prefetch.max-memory-fraction", Warden),
];

/// The sections, in the table's order.
pub(crate) fn sections() -> Vec<&'static str> {
    let mut out: Vec<&'static str> = Vec::new();
    for s in KEYS.iter().map(Key::section).filter(|s| !s.is_empty()) {
        if !out.contains(&s) {
            out.push(s);
        }
    }
    out
}

/// The names a table may hold: a section's keys; at the top level, its
/// own keys and then the sections.
pub(crate) fn known(section: &str) -> Vec<&'static str> {
    let mut out: Vec<&'static str> = KEYS.iter().filter(|k| k.section() == section).map(Key::name).collect();
    if section.is_empty() {
        out.extend(sections());
    }
    out
}

/// The first key a reload names `change`: the key `change` itself, or
/// the first of the keys compared together under that name. For a
/// comparison's name in a constant, where a name that is no key's does
/// not compile: `const { compared("child.cache-dir") }`.
pub(crate) const fn compared(change: &str) -> &'static Key {
    let mut i = 0;
    while i < KEYS.len() {
        if same(KEYS[i].change, change) {
            return &KEYS[i];
        }
        i += 1;
    }
    panic!("no key of config::keys::KEYS is compared under this name")
}

/// The key of `section` that a field of the section's settings is named
/// after: `named("restart", "initial_delay")` is `restart.initial-delay`
/// (a `_` of the field's name is a `-` of the key's). For a comparison of
/// a field in a constant, where a field named after no key does not
/// compile.
pub(crate) const fn named(section: &str, field: &str) -> &'static Key {
    let mut i = 0;
    while i < KEYS.len() {
        if is_named(KEYS[i].path, section, field) {
            return &KEYS[i];
        }
        i += 1;
    }
    panic!("no key of config::keys::KEYS is named after this field")
}

/// Whether `path` is `section.field`, a `_` of `field` a `-` of `path`.
const fn is_named(path: &str, section: &str, field: &str) -> bool {
    let (p, s, f) = (path.as_bytes(), section.as_bytes(), field.as_bytes());
    if p.len() != s.len() + 1 + f.len() {
        return false;
    }
    let mut i = 0;
    while i < s.len() {
        if p[i] != s[i] {
            return false;
        }
        i += 1;
    }
    if p[i] != b'.' {
        return false;
    }
    let mut j = 0;
    while j < f.len() {
        let c = if f[j] == b'_' { b'-' } else { f[j] };
        if p[i + 1 + j] != c {
            return false;
        }
        j += 1;
    }
    true
}

const fn same(a: &str, b: &str) -> bool {
    let (a, b) = (a.as_bytes(), b.as_bytes());
    if a.len() != b.len() {
        return false;
    }
    let mut i = 0;
    while i < a.len() {
        if a[i] != b[i] {
            return false;
        }
        i += 1;
    }
    true
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_key_is_once_in_the_table() {
        for (i, k) in KEYS.iter().enumerate() {
            assert!(!KEYS[..i].iter().any(|o| o.path == k.path), "`{}` is twice in the table", k.path);
        }
    }

    /// A reload names the keys compared together by their first: they
    /// must agree on what their change needs.
    #[test]
    fn keys_compared_together_need_the_same() {
        for k in KEYS {
            let first = compared(k.change);
            assert_eq!(k.affects, first.affects, "`{}` and `{}` are compared as `{}`", k.path, first.path, k.change);
        }
    }

    #[test]
    fn a_key_names_its_section() {
        let key = |path| KEYS.iter().find(|k| k.path == path).unwrap();
        assert_eq!((key("name").section(), key("name").name()), ("", "name"));
        assert_eq!((key("child.cache-dir").section(), key("child.cache-dir").name()), ("child", "cache-dir"));
        let patch = key("[[patch]] max-size");
        assert_eq!((patch.section(), patch.name(), patch.in_array()), ("patch", "max-size", true));
        assert_eq!(known("rollback"), ["enabled", "keep"]);
        assert_eq!(named("restart", "initial_delay").path, "restart.initial-delay");
        assert_eq!(named("child", "cache_dir").path, "child.cache-dir");
        assert_eq!(&known("")[..3], ["name", "profile", "child"]);
    }
}
