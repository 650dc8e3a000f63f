use super::*;
use crate::config::command::port_of;

fn parse_str(text: &str) -> Result<Settings, Problems> {
    parse(text, Path::new("/etc/vllm-warden/kimi.toml"), &Dirs::default())
}

#[test]
fn minimal_config_has_vllm_defaults() {
    let s = parse_str("[child]\ncommand = [\"vllm\", \"serve\", \"/m\", \"--port\", \"8011\"]\n").unwrap();
    assert_eq!(s.name, "kimi");
    assert_eq!(s.prestart.port, Some(8011));
    assert_eq!(s.ready.http.as_deref(), Some("http://127.0.0.1:8011/health"));
    assert_eq!(s.health.http.as_deref(), Some("http://127.0.0.1:8011/health"));
    assert_eq!(s.child.log_file, PathBuf::from("/var/log/vllm-warden/kimi.log"));
    assert_eq!(s.status.file, PathBuf::from("/run/vllm-warden/kimi/status.json"));
    assert_eq!(s.state_dir, PathBuf::from("/var/lib/vllm-warden/kimi"));
    assert_eq!(s.child.stop_signal, Signal::SIGTERM);
    assert_eq!(s.restart.max_attempts, 10);
    assert!(s.patterns.ready.iter().any(|p| p.contains("Application startup complete")));
    assert_eq!(s.prestart.clean_shm, vec!["psm_*", "sem.mp-*", "vllm_*", "*-cpushm_*"]);
}

#[test]
fn systemd_directories_give_the_defaults() {
    let dirs = Dirs {
        runtime: Some("/run/vllm-warden/x".into()),
        state: Some("/var/lib/vllm-warden/x".into()),
        logs: Some("/var/log/vllm-warden".into()),
        cache: Some("/var/cache/vllm-warden/x".into()),
    };
    let s = parse("[child]\ncommand = [\"v\"]\n", Path::new("x.toml"), &dirs).unwrap();
    assert_eq!(s.status.file, PathBuf::from("/run/vllm-warden/x/status.json"));
    assert_eq!(s.child.log_file, PathBuf::from("/var/log/vllm-warden/x.log"));
    assert_eq!(s.child.cache_dir, Some(PathBuf::from("/var/cache/vllm-warden/x")));
    assert_eq!(s.child.runtime_dir, Some(PathBuf::from("/run/vllm-warden/x")));
    // `""`: no cache directory, whatever systemd gives.
    let s = parse("[child]\ncommand = [\"v\"]\ncache-dir = \"\"\n", Path::new("x.toml"), &dirs).unwrap();
    assert_eq!(s.child.cache_dir, None);
    let e = parse("[child]\ncommand = [\"v\"]\ncache-dir = \"rel\"\n", Path::new("x.toml"), &dirs).unwrap_err();
    assert!(e.to_string().contains("x.toml:3:13: `cache-dir` must be an absolute path"), "{e}");
}

#[test]
fn the_spec_example_is_valid() {
    let text = include_str!("../../examples/kimi-k2.5-nvfp4.toml");
    let s = parse_str(text).unwrap_or_else(|p| panic!("{p}"));
    assert_eq!(s.patches.len(), 2);
    assert!(s.patterns.fatal.iter().any(|p| p == "illegal memory access"));
    assert_eq!((s.prefetch.enabled, s.prefetch.threads, s.prefetch.max_memory_fraction), (true, 8, 0.8));
}

#[test]
fn the_front_door_example_is_valid() {
    let s = parse_str(include_str!("../../examples/kimi-front-door.toml")).unwrap_or_else(|p| panic!("{p}"));
    let front = s.front.expect("[front]");
    assert_eq!(front.listen.len(), 2);
    assert!(front.retry_unanswered);
    assert!(matches!(s.engine, Some(crate::config::Engine::Unix(_))));
}

#[test]
fn the_ray_examples_are_valid_and_wait_as_they_say() {
    let head = parse_str(include_str!("../../examples/ray/ray-head.toml")).unwrap_or_else(|p| panic!("{p}"));
    let worker = parse_str(include_str!("../../examples/ray/ray-worker.toml")).unwrap_or_else(|p| panic!("{p}"));
    let server = parse_str(include_str!("../../examples/ray/kimi-ray.toml")).unwrap_or_else(|p| panic!("{p}"));
    let gate = |s: &Settings| s.prestart.ray.clone().map(|c| (c.address, c.gate, c.min_nodes, c.min_gpus));
    assert_eq!(gate(&head), Some(("10.0.0.1:6379".into(), false, 1, 0.0)));
    assert_eq!(gate(&worker), Some(("10.0.0.1:6379".into(), true, 1, 0.0)));
    assert_eq!(gate(&server), Some(("10.0.0.1:6379".into(), true, 2, 16.0)));
    assert_eq!((head.prestart.port, worker.prestart.port, server.prestart.port), (Some(6379), None, Some(8000)));
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

/// One row of the man page's table of keys.
struct Row {
    key: String,
    default: String,
    /// `` `A` to `B` ``, or empty.
    range: String,
}

/// The range is the end of the meaning: `…; from `A` to `B``.
fn man_page_rows() -> Vec<Row> {
    // The keys' table, in DESCRIPTION (other sections have tables too).
    include_str!("../../docs/vllm-warden.toml.5.md")
        .lines()
        .skip_while(|l| *l != "# DESCRIPTION")
        .skip(1)
        .take_while(|l| !l.starts_with("# "))
        .filter(|l| l.starts_with("| `"))
        .map(|l| {
            let cells: Vec<&str> = l.trim_matches('|').split('|').map(str::trim).collect();
            let range = cells[2].rsplit_once("; from ").map_or("", |(_, r)| r);
            Row { key: cells[0].trim_matches('`').into(), default: cells[1].into(), range: range.into() }
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
        ("prestart.ray-min-nodes", defaults::RAY_MIN_NODES.to_string()),
        ("prestart.ray-wait", duration(defaults::RAY_WAIT)),
        ("prestart.ray-python", format!("`\"{}\"`", defaults::RAY_PYTHON)),
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
        ("health.progress-stall", duration(defaults::PROGRESS_STALL)),
        ("drain.delay", duration(defaults::DRAIN_DELAY)),
        ("drain.timeout", duration(defaults::DRAIN_TIMEOUT)),
        ("[[patch]] max-size", quoted(&format!("{} MiB", defaults::PATCH_MAX_SIZE >> 20))),
        ("child.log-max-size", quoted(&format!("{} GiB", defaults::LOG_MAX_SIZE >> 30))),
        ("child.log-keep", format!("`{}`", defaults::LOG_KEEP)),
        ("child.log-compress", format!("`{}`", defaults::LOG_COMPRESS)),
        ("reports.keep", defaults::REPORTS_KEEP.to_string()),
        ("reports.max-size", quoted(&format!("{} MiB", defaults::REPORTS_MAX_SIZE >> 20))),
        ("reports.lines", defaults::REPORTS_LINES.to_string()),
        ("reports.timeout", duration(defaults::REPORTS_TIMEOUT)),
        ("reports.py-spy", format!("`{}`", defaults::REPORTS_PY_SPY.join(" "))),
        ("reports.gpu-snapshot", format!("`{}`", defaults::REPORTS_GPU_SNAPSHOT.join(" "))),
        ("reports.kernel-messages", format!("`{}`", defaults::REPORTS_KERNEL_MESSAGES.join(" "))),
        ("ledger.keep", defaults::LEDGER_KEEP.to_string()),
        ("ledger.slow-factor", format!("{:?}", defaults::LEDGER_SLOW_FACTOR)),
        ("ledger.deadline-factor", format!("{:?}", defaults::LEDGER_DEADLINE_FACTOR)),
        ("prefetch.enabled", format!("`{}`", defaults::PREFETCH_ENABLED)),
        ("prefetch.threads", defaults::PREFETCH_THREADS.to_string()),
        ("prefetch.max-memory-fraction", format!("{:?}", defaults::PREFETCH_MAX_MEMORY_FRACTION)),
        ("golden.max-tokens", defaults::GOLDEN_MAX_TOKENS.to_string()),
        ("golden.tolerance", format!("{:?}", defaults::GOLDEN_TOLERANCE)),
        ("golden.timeout", duration(defaults::GOLDEN_TIMEOUT)),
        ("golden.interval", duration(defaults::GOLDEN_INTERVAL)),
        ("golden.prompts", format!("`[{:?}]`", defaults::GOLDEN_PROMPT)),
        ("front.hold", duration(defaults::FRONT_HOLD)),
        ("front.max-held", defaults::FRONT_MAX_HELD.to_string()),
        ("front.max-body", quoted(&format!("{} MiB", defaults::FRONT_MAX_BODY >> 20))),
        ("front.min-body-rate", quoted(&format!("{} KiB", defaults::FRONT_MIN_BODY_RATE >> 10))),
        ("front.max-connections", defaults::FRONT_MAX_CONNECTIONS.to_string()),
        ("front.idle-sleep-level", defaults::FRONT_IDLE_SLEEP_LEVEL.to_string()),
        ("front.idle-stop", quoted("0s")),
    ];
    let rows = man_page_rows();
    let row = |key: &str| {
        rows.iter().find(|r| r.key == key).map(|r| r.default.as_str()).unwrap_or_else(|| panic!("no row for {key}"))
    };
    for (key, want) in &expected {
        assert_eq!(row(key), want, "the man page's default of `{key}`");
    }
    // A duration in the table without a constant here would go unchecked.
    for Row { key, default, .. } in &rows {
        let inner = default.strip_prefix("`\"").and_then(|d| d.strip_suffix("\"`"));
        if inner.is_some_and(|d| humantime::parse_duration(d).is_ok()) {
            assert!(expected.iter().any(|(k, _)| k == key), "`{key}` has a duration default but no constant");
        }
    }
    assert!(row("prestart.port").ends_with(&format!("else {}", defaults::PORT)));
    assert!(row("child.log-file").contains(&format!("`{}/NAME.log`", defaults::LOG_DIR)));
    assert!(row("status.file").contains(&format!("`{}/NAME/status.json`", defaults::RUN_DIR)));
    assert!(row("server.socket").contains(&format!("`{}/NAME/{}`", defaults::RUN_DIR, defaults::SOCKET)));
}

/// A config that holds every section of [`keys::KEYS`], each with
/// `lines(section)` and what the section cannot be without (`[[patch]]`
/// its `file` and a change, `[[hint]]` its two keys, `[front]` an
/// address, `[child]` a command), unless `lines` gives those keys itself.
fn every_section(lines: impl Fn(&str) -> Vec<String>) -> String {
    let needs = |section: &str| -> &[&str] {
        match section {
            "child" => &["command = [\"a\"]"],
            "patch" => &["file = \"/f\"", "remove = [\"a\"]"],
            "hint" => &["match = \"x\"", "text = \"y\""],
            "front" => &["listen = \"127.0.0.1:8000\""],
            _ => &[],
        }
    };
    let mut text = lines("").join("");
    for section in keys::sections() {
        let array = keys::KEYS.iter().any(|k| k.section() == section && k.in_array());
        text.push_str(&if array { format!("[[{section}]]\n") } else { format!("[{section}]\n") });
        let given = lines(section);
        for need in needs(section) {
            let key = need.split(" = ").next().unwrap_or_default();
            if !given.iter().any(|l| l.starts_with(&format!("{key} = "))) {
                text.push_str(&format!("{need}\n"));
            }
        }
        text.extend(given);
    }
    text
}

/// The known keys of each section, as the unknown-key problem lists
/// them, are exactly the keys the man page documents.
#[test]
fn the_man_page_documents_every_known_key() {
    let text = every_section(|_| vec!["zz = 1\n".to_string()]);
    let problems = parse_str(&text).unwrap_err().0;
    let mut known: Vec<String> = Vec::new();
    for p in &problems {
        let rest = p.message.strip_prefix("unknown key `zz`").unwrap_or_else(|| panic!("{p}"));
        let (place, list) = rest.split_once(" (known: ").unwrap_or_else(|| panic!("{p}"));
        let section = match place.trim_start_matches(" in ") {
            "" => String::new(),
            "[[patch]]" => "[[patch]] ".to_string(),
            "[[hint]]" => "[[hint]] ".to_string(),
            s => format!("{}.", s.trim_matches(['[', ']'])),
        };
        for key in list.trim_end_matches(')').split(", ") {
            known.push(format!("{section}{key}"));
        }
    }
    let sections = keys::sections();
    assert_eq!(problems.len(), sections.len() + 1, "{problems:?}");
    let mut documented: Vec<String> = man_page_rows().into_iter().map(|r| r.key).collect();
    documented.extend(sections.into_iter().map(String::from));
    known.sort();
    documented.sort();
    assert_eq!(known, documented);
}

/// Every key of the table is read: given them all (each with a value of
/// the wrong type, which is a problem of its own), the reader leaves none
/// of them as unknown. (A read of a key the table lacks stops a debug
/// build, this test's, at the read.)
#[test]
fn every_key_of_the_table_is_read() {
    let text = every_section(|section| {
        let keys = keys::KEYS.iter().filter(|k| k.section() == section);
        keys.map(|k| format!("{} = 1\n", k.name())).collect()
    });
    let problems = parse_str(&text).unwrap_err().0;
    let unknown: Vec<&Problem> = problems.iter().filter(|p| p.message.starts_with("unknown key")).collect();
    assert!(unknown.is_empty(), "keys of the table left unread: {unknown:#?}");
    // Each key was read: its wrong value is a problem.
    assert!(problems.len() >= keys::KEYS.len() / 2, "{problems:#?}");
}

/// What the man page's table of keys and [`keys::KEYS`] disagree on: the
/// keys the page does not document, and the rows that name no key.
fn man_page_against(table: &[keys::Key], rows: &[Row]) -> (Vec<String>, Vec<String>) {
    let undocumented = table.iter().filter(|k| !rows.iter().any(|r| r.key == k.path)).map(|k| k.path.to_string());
    let unknown = rows.iter().filter(|r| !table.iter().any(|k| k.path == r.key)).map(|r| r.key.clone());
    (undocumented.collect(), unknown.collect())
}

/// Every key of the table has its row in the man page, written as the
/// page writes keys (`child.cache-dir`, `[[patch]] file`), and every row
/// is a key of the table.
#[test]
fn the_man_page_documents_every_key_of_the_table() {
    let (undocumented, unknown) = man_page_against(keys::KEYS, &man_page_rows());
    assert!(undocumented.is_empty(), "keys the man page does not document: {undocumented:?}");
    assert!(unknown.is_empty(), "the man page documents keys that are not in config::keys: {unknown:?}");
}

/// A key added to the table alone fails the man page's check, and so
/// does a row of the man page alone.
#[test]
fn a_key_in_the_table_alone_fails_the_man_page_check() {
    let new = keys::Key { path: "health.new-key", affects: keys::Affects::Warden, change: "health.new-key" };
    let table: Vec<keys::Key> = keys::KEYS.iter().copied().chain([new]).collect();
    let rows = man_page_rows();
    assert_eq!(man_page_against(&table, &rows), (vec!["health.new-key".to_string()], vec![]));
    let rows: Vec<Row> = rows
        .into_iter()
        .chain([Row { key: "health.new-key".into(), default: "1".into(), range: String::new() }])
        .collect();
    assert_eq!(man_page_against(keys::KEYS, &rows), (vec![], vec!["health.new-key".to_string()]));
}

#[test]
fn signals_parse_in_every_spelling() {
    assert_eq!(parse_signal("SIGINT"), Some(Signal::SIGINT));
    assert_eq!(parse_signal("term"), Some(Signal::SIGTERM));
    assert_eq!(parse_signal("9"), Some(Signal::SIGKILL));
    assert_eq!(parse_signal("SIGNOPE"), None);
}

/// `section.key = value` in a config that is otherwise valid.
fn with_value(dotted: &str, value: &str) -> String {
    if let Some(key) = dotted.strip_prefix("[[patch]] ") {
        let patch = "[[patch]]\nfile = \"/m/config.json\"\nremove = [\"a\"]\n";
        return format!("[child]\ncommand = [\"vllm\"]\n{patch}{key} = {value}\n");
    }
    let (section, key) = dotted.split_once('.').unwrap_or(("", dotted));
    // The two delays must stay in order whatever one of them is set to.
    let other = match dotted {
        "restart.initial-delay" => "max-delay = \"30days\"\n",
        "restart.max-delay" => "initial-delay = \"0s\"\n",
        // What a cluster must have needs a cluster.
        _ if key.starts_with("ray-") && key != "ray-address" => "ray-address = \"127.0.0.3:6391\"\n",
        // A front door needs its address.
        _ if section == "front" && key != "listen" => "listen = \"127.0.0.1:8000\"\n",
        _ => "",
    };
    let child = "[child]\ncommand = [\"vllm\"]\n";
    if section == "child" {
        format!("{child}{key} = {value}\n")
    } else {
        format!("{child}[{section}]\n{other}{key} = {value}\n")
    }
}

/// The man page's range of every duration and number is the range the
/// reader enforces: both ends are accepted, one step beyond either is not.
#[test]
fn the_man_page_shows_the_ranges_the_reader_enforces() {
    let mut tried = 0;
    for Row { key, default, range } in man_page_rows() {
        if default.starts_with("`\"") && humantime::parse_duration(default.trim_matches(['`', '"'])).is_ok() {
            assert!(!range.is_empty(), "the duration `{key}` has no range in the man page");
        }
        let Some((min, max)) = range.split_once(" to ") else { continue };
        let (min, max) = (min.trim_matches('`'), max.trim_matches('`'));
        let accepted = |value: &str| {
            let text = with_value(&key, value);
            if let Err(p) = parse_str(&text) {
                panic!("`{key} = {value}` is in the man page's range but refused: {p}");
            }
        };
        let refused = |value: &str, why: &str| {
            let text = with_value(&key, value);
            match parse_str(&text) {
                Ok(_) => panic!("`{key} = {value}` is outside the man page's range but accepted"),
                Err(p) => assert!(p.to_string().contains(why), "`{key} = {value}`: {p}"),
            }
        };
        match (humantime::parse_duration(min), humantime::parse_duration(max)) {
            (Ok(lo), Ok(hi)) => {
                accepted(&format!("{min:?}"));
                accepted(&format!("{max:?}"));
                let above = humantime::format_duration(hi + Duration::from_millis(1)).to_string();
                refused(&format!("{above:?}"), &format!("` must be from {min} to {max}, not {above:?}"));
                if !lo.is_zero() {
                    refused("\"0s\"", "` must be longer than 0s");
                }
            }
            _ => {
                let (lo, hi): (f64, f64) = (min.parse().unwrap(), max.parse().unwrap());
                accepted(min);
                accepted(max);
                refused(&format!("{}", hi + 1.0), "` must be ");
                if lo >= 1.0 {
                    refused(&format!("{}", lo - 1.0), "` must be ");
                }
            }
        }
        tried += 1;
    }
    assert_eq!(tried, 56, "every duration and number has a range");
}

#[test]
fn durations_that_overflow_are_refused() {
    for key in [
        "child.stop-timeout",
        "prestart.port-wait",
        "prestart.gpu-idle-wait",
        "ready.timeout",
        "ready.stall",
        "fatal.grace",
        "restart.initial-delay",
        "restart.max-delay",
        "restart.reset-after",
        "health.interval",
        "health.timeout",
        "health.canary-interval",
        "health.canary-timeout",
    ] {
        let p = parse_str(&with_value(key, "\"500000000000y\"")).unwrap_err().to_string();
        assert!(p.contains(&format!("`{key}` must be from ")) && p.contains(", not \"500000000000y\""), "{p}");
    }
    let p = parse_str("[child]\ncommand = [\"vllm\"]\n[ready]\nstall = \"500000000000y\"\n").unwrap_err();
    assert_eq!(
        p.to_string(),
        "/etc/vllm-warden/kimi.toml:4:9: `ready.stall` must be from 1ms to 7days, not \"500000000000y\""
    );
}

#[test]
fn zero_timeouts_are_refused() {
    for (key, bare) in [("ready.timeout", "timeout"), ("ready.stall", "stall"), ("health.timeout", "timeout")] {
        let p = parse_str(&with_value(key, "\"0s\"")).unwrap_err();
        assert_eq!(p.0.len(), 1, "{p}");
        assert!(p.0[0].at.is_some() && p.0[0].message == format!("`{bare}` must be longer than 0s"), "{p}");
    }
}

#[test]
fn port_zero_is_refused() {
    let p = parse_str(&with_value("prestart.port", "0")).unwrap_err();
    assert!(p.to_string().ends_with(":4:8: `port` must be at least 1"), "{p}");
}

#[test]
fn patch_paths_with_an_empty_key_are_refused() {
    for (entry, at) in [
        (r#"set = {"." = 1}"#, "7:8"),
        (r#"set = {"a..b" = 1}"#, "7:8"),
        (r#"remove = [".a"]"#, "7:11"),
        (r#"remove = ["a.", "ok"]"#, "7:11"),
        (r#"remove = [""]"#, "7:11"),
    ] {
        let text = format!("[child]\ncommand = [\"vllm\"]\n\n[[patch]]\nfile = \"/m/config.json\"\n\n{entry}\n");
        let p = parse_str(&text).unwrap_err();
        assert_eq!(p.0.len(), 1, "{entry}: {p}");
        let shown = p.to_string();
        assert!(
            shown.contains(&format!(":{at}: `[[patch]]`: ")) && shown.contains("is not a dotted JSON path"),
            "{shown}"
        );
    }
    // A backslash-escaped dot is a dot inside a key, not a separator.
    let text = "[child]\ncommand = [\"vllm\"]\n[[patch]]\nfile = \"/m/c.json\"\nremove = ['a\\.b.c', 'a\\..b']\n";
    let s = parse_str(text).unwrap_or_else(|p| panic!("{p}"));
    assert_eq!(s.patches[0].remove, vec![r"a\.b.c", r"a\..b"]);
}

#[test]
fn patch_paths_ending_in_a_lone_backslash_are_refused() {
    let text = "[child]\ncommand = [\"vllm\"]\n[[patch]]\nfile = \"/m/c.json\"\nremove = [\"a\\\\\"]\n";
    let p = parse_str(text).unwrap_err();
    assert_eq!(
        p.to_string(),
        "/etc/vllm-warden/kimi.toml:5:11: `[[patch]]`: \"a\\\\\" is not a dotted JSON path: it ends in a lone \
         backslash (`\\.` is a dot inside a key)"
    );
}

#[test]
fn an_empty_gpu_query_program_is_refused() {
    let p = parse_str(&with_value("prestart.gpu-query", r#"["", "--x"]"#)).unwrap_err();
    assert_eq!(
        p.to_string(),
        "/etc/vllm-warden/kimi.toml:4:13: `gpu-query` must name a program to run, or be [] (no GPU check)"
    );
    let s = parse_str(&with_value("prestart.gpu-query", "[]")).unwrap_or_else(|p| panic!("{p}"));
    assert!(s.prestart.gpu_query.is_empty());
}

#[test]
fn stop_signals_that_cannot_ask_for_a_graceful_stop_are_refused() {
    for (sig, why) in [
        ("SIGKILL", "it cannot be caught"),
        ("9", "it cannot be caught"),
        ("SIGSTOP", "it suspends the process"),
        ("TSTP", "it suspends the process"),
        ("SIGTTIN", "it suspends the process"),
        ("SIGTTOU", "it suspends the process"),
        ("SIGCONT", "it resumes a suspended process"),
        ("SIGCHLD", "it is ignored unless handled"),
        ("SIGWINCH", "it is ignored unless handled"),
        ("SIGURG", "it is ignored unless handled"),
    ] {
        let p = parse_str(&with_value("child.stop-signal", &format!("{sig:?}"))).unwrap_err().to_string();
        assert!(
            p.contains(":3:15: `stop-signal`: SIG") && p.contains("cannot ask a process to exit gracefully"),
            "{p}"
        );
        assert!(p.contains(why), "{sig}: {p}");
    }
    for sig in ["SIGTERM", "SIGINT", "SIGHUP", "SIGQUIT", "SIGUSR1", "SIGUSR2"] {
        let s = parse_str(&with_value("child.stop-signal", &format!("{sig:?}"))).unwrap_or_else(|p| panic!("{p}"));
        assert_eq!(s.child.stop_signal.as_str(), sig);
    }
}

#[test]
fn patterns_too_big_together_are_refused() {
    // Each fits the regex size limit alone; the classifier's set of both does not.
    let big = r"\\w{150}";
    let text = format!("[child]\ncommand = [\"vllm\"]\n[fatal]\nmatch = [\"{big}\", \"{big}x\"]\n");
    let p = parse_str(&text).unwrap_err();
    let mut patterns = Profile::Vllm.patterns();
    patterns.fatal.extend([r"\w{150}".to_string(), r"\w{150}x".to_string()]);
    let Err(run) = crate::supervisor::classify::Classifier::new(&patterns) else {
        panic!("`run` accepts these patterns")
    };
    assert_eq!(
        p.to_string(),
        format!("/etc/vllm-warden/kimi.toml:4:9: `fatal.match`: the effective fatal list cannot be compiled: {run}")
    );
}

#[test]
fn a_command_port_of_zero_is_refused() {
    for command in [r#"["vllm", "--port", "000"]"#, r#"["vllm", "--port=0"]"#] {
        let p = parse_str(&format!("[child]\ncommand = {command}\n")).unwrap_err();
        assert_eq!(p.0.len(), 1, "{p}");
        assert!(
            p.to_string()
                .ends_with(":2:11: `command`: `--port 0` leaves the port to chance, and the warden must know it"),
            "{p}"
        );
    }
}

#[test]
fn a_tcp_listener_makes_stops_drain_by_default_and_a_token_file_needs_one() {
    let base = "[child]\ncommand = [\"vllm\"]\n";
    let s = parse_str(base).unwrap();
    assert_eq!((s.server.listen, s.drain.on_stop), (None, false));
    assert_eq!(s.server.socket, std::path::PathBuf::from(format!("{}/kimi/control.sock", defaults::RUN_DIR)));
    let s = parse_str(&format!("{base}[server]\nlisten = \"127.0.0.1:9400\"\n")).unwrap();
    assert_eq!((s.server.listen, s.drain.on_stop), (Some("127.0.0.1:9400".parse().unwrap()), true));
    let s = parse_str(&format!("{base}[server]\nlisten = \"[::1]:9400\"\n[drain]\non-stop = false\n")).unwrap();
    assert!(!s.drain.on_stop);
    let p = parse_str(&format!("{base}[server]\nlisten = \"localhost\"\n")).unwrap_err().to_string();
    assert!(p.contains("`server.listen`: \"localhost\" is not an address and port"), "{p}");
    let p = parse_str(&format!("{base}[server]\ntoken-file = \"/etc/t\"\n")).unwrap_err().to_string();
    assert!(p.contains("`server.token-file` is for the TCP listener"), "{p}");
    let p = parse_str(&format!("{base}[drain]\non-stop = \"yes\"\n")).unwrap_err().to_string();
    assert!(p.contains("`on-stop` must be true or false, not string"), "{p}");
}

/// The log's rotation: defaults, a size in units, and a size below 1 MiB
/// refused with the range.
#[test]
fn log_rotation_keys() {
    let base = "[child]\ncommand = [\"vllm\", \"serve\", \"/m\"]\n";
    let s = parse_str(base).unwrap();
    let r = s.child.log_rotation;
    assert_eq!((r.max_size, r.keep, r.compress), (1 << 30, 3, true));
    let s = parse_str(&format!("{base}log-max-size = \"64 MiB\"\nlog-keep = 0\nlog-compress = false\n")).unwrap();
    let r = s.child.log_rotation;
    assert_eq!((r.max_size, r.keep, r.compress), (64 << 20, 0, false));
    let problems = parse_str(&format!("{base}log-max-size = \"512 KiB\"\n")).unwrap_err().0;
    assert_eq!(problems.len(), 1, "{problems:?}");
    assert!(problems[0].message.contains("`log-max-size`") && problems[0].message.contains("1 MiB"), "{}", problems[0]);
    let problems = parse_str(&format!("{base}log-compress = \"yes\"\n")).unwrap_err().0;
    assert!(problems[0].message.contains("true or false"), "{}", problems[0]);
}

#[test]
fn a_ray_worker_waits_for_its_head_and_serves_no_http() {
    let text = "profile = \"ray-worker\"\n[child]\ncommand = [\"/v/bin/ray\", \"start\", \"--address=127.0.0.3:6391\", \"--block\"]\n";
    let s = parse_str(text).unwrap();
    let c = s.prestart.ray.as_ref().unwrap();
    assert_eq!((c.address.as_str(), c.gate, c.min_nodes), ("127.0.0.3:6391", true, 1));
    assert_eq!(s.prestart.port, None);
    assert_eq!((s.ready.http.as_deref(), s.health.http.as_deref()), (None, None));
    assert!(s.health.canary_interval.is_zero() && s.health.progress_stall.is_zero());
    assert_eq!(s.ready_by_ray().map(|c| c.address.as_str()), Some("127.0.0.3:6391"));
    assert!(s.patterns.ready.iter().any(|p| p.contains("Ray runtime started")));
}

#[test]
fn a_ray_head_confirms_itself_and_waits_for_nothing() {
    let cmd = "[child]\ncommand = [\"ray\", \"start\", \"--head\", \"--port=6391\", \"--node-ip-address=127.0.0.3\"]\n";
    let s = parse_str(&format!("profile = \"ray-head\"\n{cmd}")).unwrap();
    let c = s.prestart.ray.as_ref().unwrap();
    assert_eq!((c.address.as_str(), c.gate), ("127.0.0.3:6391", false));
    assert_eq!(s.prestart.port, Some(6391));
    assert_eq!(crate::daemon::policy::prepare_timeout(&s), {
        let mut plain = s.clone();
        plain.prestart.ray = None;
        crate::daemon::policy::prepare_timeout(&plain)
    });
    let p = parse_str(&format!("profile = \"ray-head\"\n{cmd}[prestart]\nray-min-nodes = 2\n")).unwrap_err();
    assert!(p.to_string().contains("a `ray-head` starts the cluster and waits for none"), "{p}");
}

#[test]
fn a_server_on_ray_waits_for_the_cluster_it_names() {
    let base = "[child]\ncommand = [\"vllm\", \"serve\", \"/m\"]\n[prestart]\n";
    let s = parse_str(&format!(
        "{base}ray-address = \"127.0.0.3:6391\"\nray-min-nodes = 2\nray-min-cpus = 2\nray-wait = \"5m\"\n"
    ))
    .unwrap();
    let c = s.prestart.ray.clone().unwrap();
    assert_eq!((c.gate, c.min_nodes, c.min_cpus, c.min_gpus), (true, 2, 2.0, 0.0));
    assert_eq!(s.ready_by_ray(), None, "a vLLM server is ready by its HTTP check");
    let mut without = s.clone();
    without.prestart.ray = None;
    let extra = crate::daemon::policy::prepare_timeout(&s) - crate::daemon::policy::prepare_timeout(&without);
    assert_eq!(extra, Duration::from_secs(300) + crate::process::ray::STATUS_TIMEOUT);
    // Not the default profile's server without an address.
    assert!(parse_str(&format!("{base}ray-address = \"127.0.0.3:6391\"\n")).unwrap().prestart.ray.is_some());
    assert!(parse_str("[child]\ncommand = [\"vllm\"]\n").unwrap().prestart.ray.is_none());
    let p = parse_str(&format!("{base}ray-min-gpus = 8\n")).unwrap_err();
    assert!(p.to_string().contains("`ray-min-gpus` needs `ray-address`"), "{p}");
    let p = parse_str(&format!("{base}ray-address = \"head\"\n")).unwrap_err();
    assert!(p.to_string().contains("must be HOST:PORT"), "{p}");
}

#[test]
fn a_near_miss_of_a_known_key_is_named() {
    let p = parse_str("[child]\ncommand = [\"a\"]\nstop-timout = \"3s\"\n[health]\nfoo = 1\n").unwrap_err().0;
    assert_eq!(p.len(), 2, "{p:#?}");
    assert!(
        p[0].message.starts_with("unknown key `stop-timout` in [child]: did you mean `stop-timeout`? (known: command,"),
        "{}",
        p[0].message
    );
    assert!(p[1].message.starts_with("unknown key `foo` in [health] (known: "), "nothing near: {}", p[1].message);
}

#[test]
fn a_broken_config_still_gives_its_name_and_folders() {
    let dir = tempfile::tempdir().unwrap();
    let dirs = Dirs { runtime: Some("/run/x".into()), ..Dirs::default() };
    // Not there: the stem, every default.
    let (s, p) = load_lenient(&dir.path().join("kimi.toml"), &Dirs::default());
    assert_eq!((s.name.as_str(), p.len()), ("kimi", 1), "{p:?}");
    assert!(p[0].message.starts_with("cannot read config: "), "{p:?}");
    assert_eq!(s.state_dir, PathBuf::from(defaults::STATE_DIR).join("kimi"));
    // Not TOML: its name, as far as it reads; the systemd folders.
    let cfg = dir.path().join("k.toml");
    std::fs::write(&cfg, "name = \"k2\"\n[child\ncommand = [\"a\"]\n").unwrap();
    let (s, p) = load_lenient(&cfg, &dirs);
    assert_eq!(s.name, "k2");
    assert_eq!(s.server.socket, PathBuf::from("/run/x/control.sock"));
    assert!(!p.is_empty());
    // An invalid value: what reads is kept.
    std::fs::write(&cfg, "[child]\ncommand = [\"a\"]\nstop-timeout = \"soon\"\n[server]\nsocket = \"/s.sock\"\n")
        .unwrap();
    let (s, p) = load_lenient(&cfg, &dirs);
    assert_eq!((s.name.as_str(), s.server.socket.to_str().unwrap(), p.len()), ("k", "/s.sock", 1), "{p:?}");
}

#[test]
fn the_front_door_moves_the_engine_to_a_private_socket() {
    let text = "[child]\ncommand = [\"vllm\", \"serve\", \"/m\"]\n[front]\nlisten = [\"0.0.0.0:8000\", \"unix:/run/m.sock\"]\n";
    let s = parse_str(text).unwrap();
    let front = s.front.as_ref().unwrap();
    assert_eq!(front.listen, vec![Listen::Tcp("0.0.0.0:8000".parse().unwrap()), Listen::Unix("/run/m.sock".into())]);
    assert_eq!((front.hold, front.max_held, front.idle_stop), (defaults::FRONT_HOLD, defaults::FRONT_MAX_HELD, None));
    let sock = PathBuf::from("/run/vllm-warden/kimi/engine/engine.sock");
    assert_eq!(s.engine, Some(Engine::Unix(sock.clone())));
    assert_eq!(s.child.command[3..], ["--uds".to_string(), sock.display().to_string()]);
    assert_eq!(s.ready.http.as_deref(), Some("http://localhost/health"));
    // One string is a list of one; without [front], the engine is the command's port.
    let one = parse_str("[child]\ncommand = [\"vllm\", \"serve\", \"/m\"]\n[front]\nlisten = \"[::]:8000\"\n").unwrap();
    assert_eq!(one.front.unwrap().listen.len(), 1);
    let plain = parse_str("[child]\ncommand = [\"vllm\", \"serve\", \"/m\"]\n").unwrap();
    assert_eq!((plain.front, plain.engine), (None, Some(Engine::Loopback(8000))));
}

#[test]
fn an_address_of_its_own_in_the_command_is_a_problem_naming_its_line() {
    for flag in ["--port\", \"8000", "--host=0.0.0.0", "--uds\", \"/tmp/s"] {
        let text = format!(
            "name = \"m\"\n[child]\ncommand = [\"vllm\", \"serve\", \"/m\", \"{flag}\"]\n[front]\nlisten = \"0.0.0.0:8000\"\n"
        );
        let p = parse_str(&text).unwrap_err().0;
        assert_eq!(p.len(), 1, "{p:?}");
        assert_eq!(p[0].at.map(|a| a.0), Some(3), "{p:?}");
        assert!(p[0].message.contains("with `[front]`"), "{p:?}");
    }
    for (listen, why) in [
        ("\"unix:run/x\"", "absolute"),
        ("\"localhost:80\"", "not an address"),
        ("[\"0.0.0.0:1\", \"0.0.0.0:1\"]", "twice"),
        ("[]", "needs `listen`"),
    ] {
        let text = format!("[child]\ncommand = [\"vllm\", \"serve\", \"/m\"]\n[front]\nlisten = {listen}\n");
        let p = parse_str(&text).unwrap_err().0;
        assert!(p.iter().any(|p| p.message.contains(why)), "{listen}: {p:?}");
    }
    let sleep =
        "[child]\ncommand = [\"vllm\", \"serve\", \"/m\"]\n[front]\nlisten = \"0.0.0.0:1\"\nidle-action = \"sleep\"\n";
    let p = parse_str(sleep).unwrap_err().0;
    assert!(p[0].message.contains("--enable-sleep-mode"), "{p:?}");
}

#[test]
fn a_check_that_would_ask_the_front_door_itself_is_a_problem() {
    let with = |ready: &str| {
        format!(
            "[child]\ncommand = [\"vllm\", \"serve\", \"/m\"]\n[front]\nlisten = [\"0.0.0.0:8000\", \"127.0.0.2:9000\"]\n{ready}"
        )
    };
    for own in ["http://127.0.0.1:8000/health", "http://localhost:8000/health", "http://127.0.0.2:9000/health"] {
        let problems = parse_str(&with(&format!("[ready]\nhttp = \"{own}\"\n"))).unwrap_err().0;
        assert_eq!(problems.len(), 1, "{problems:?}");
        let said = problems[0].to_string();
        assert!(said.contains("`ready.http`") && said.contains("the front door's own address"), "{said}");
        let problems = parse_str(&with(&format!("[health]\nhttp = \"{own}\"\n"))).unwrap_err().0;
        assert!(problems[0].to_string().contains("`health.http`"), "{problems:?}");
    }
    // Another server is asked as written; the default reaches the engine's socket.
    for other in ["http://127.0.0.1:8001/health", "http://127.0.0.3:9000/health", "http://gpu-box:8000/health"] {
        let s = parse_str(&with(&format!("[ready]\nhttp = \"{other}\"\n"))).unwrap();
        assert_eq!(s.ready.http.as_deref(), Some(other));
    }
}
