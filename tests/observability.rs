//! Issue 47, observability as tested code: the alert rules, the dashboard
//! and the PrometheusRule of `packaging/observability/` and
//! `packaging/container/`. `promtool` checks and unit-tests the rules;
//! every query of the rules and the dashboard parses (`promtool` again);
//! every metric they name is in the exposition of a real warden (its own
//! `vllm_warden_*`) or of a real vLLM 0.32 (`vllm:*`, recorded in
//! `tests/fixtures/`); and a real Prometheus, scraping wardens that
//! supervise the simulated vLLM through scenarios, fires each alert within
//! its `for:` plus two scrape intervals, and none on a clean run.
//!
//! `promtool` and `prometheus` come with Debian's `prometheus` package
//! (`.ci/run` installs it). Without them these tests say so and pass; with
//! `CI` set they fail instead, so that CI cannot skip them unseen.

mod common;

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use common::{Warden, config, free_port, http};

fn root() -> &'static Path {
    Path::new(env!("CARGO_MANIFEST_DIR"))
}

fn rules_path() -> PathBuf {
    root().join("packaging/observability/vllm-warden.rules.yml")
}

fn dashboard_path() -> PathBuf {
    root().join("packaging/observability/vllm-warden.dashboard.json")
}

/// `program` when it is installed; else `None` after saying why the test
/// does nothing (a failure under CI, which must run it).
fn tool(program: &str) -> Option<&'static str> {
    let found = Command::new(program).arg("--version").output().is_ok_and(|o| o.status.success());
    if found {
        return Some(Box::leak(program.to_string().into_boxed_str()));
    }
    let why = format!("{program} is not installed (Debian: `apt-get install prometheus`): test skipped");
    assert!(std::env::var_os("CI").is_none(), "{why}; CI must run it");
    eprintln!("{why}");
    None
}

/// Run `promtool ARGS…`; its output, or a failure showing it.
fn promtool(promtool: &str, args: &[&str], dir: &Path) -> String {
    let out = Command::new(promtool).args(args).current_dir(dir).output().unwrap();
    let text = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    assert!(out.status.success(), "promtool {}:\n{text}", args.join(" "));
    text
}

/// One alert of the rule file, as its lines say.
#[derive(Debug, Default, Clone)]
struct Alert {
    name: String,
    expr: String,
    for_: String,
    severity: String,
    summary: String,
    runbook: String,
}

/// The alerts of a rule file written as ours is (one key a line, `expr`
/// on one line or as a `|` block): enough to hold its texts to the guide
/// and to make the end-to-end test's copy.
fn alerts(text: &str) -> Vec<Alert> {
    let mut out: Vec<Alert> = Vec::new();
    let mut in_expr = None;
    for line in text.lines() {
        let t = line.trim();
        if let Some(indent) = in_expr {
            if line.len() - line.trim_start().len() > indent && !t.is_empty() {
                let a = out.last_mut().unwrap();
                a.expr.push_str(t);
                a.expr.push('\n');
                continue;
            }
            in_expr = None;
        }
        let value = |key: &str| t.strip_prefix(key).map(|v| v.trim().trim_matches('"').to_string());
        if let Some(name) = value("- alert:") {
            out.push(Alert { name, ..Alert::default() });
        } else if let Some(a) = out.last_mut() {
            if let Some(v) = value("expr:") {
                if v == "|" {
                    in_expr = Some(line.len() - line.trim_start().len());
                } else {
                    a.expr = v;
                }
            } else if let Some(v) = value("for:") {
                a.for_ = v;
            } else if let Some(v) = value("severity:") {
                a.severity = v;
            } else if let Some(v) = value("summary:") {
                a.summary = v;
            } else if let Some(v) = value("runbook_url:") {
                a.runbook = v;
            }
        }
    }
    out
}

/// The anchors of the headings of a Markdown file, as GitHub makes them.
fn anchors(markdown: &str) -> BTreeSet<String> {
    markdown
        .lines()
        .filter_map(|l| l.strip_prefix('#'))
        .map(|h| {
            h.trim_start_matches('#')
                .trim()
                .to_lowercase()
                .chars()
                .filter(|c| c.is_alphanumeric() || *c == '-' || *c == ' ' || *c == '_')
                .map(|c| if c == ' ' { '-' } else { c })
                .collect()
        })
        .collect()
}

/// The alerts issue 47 asks for.
const ALERTS: [&str; 11] = [
    "VllmWardenDown",
    "VllmWardenNotReady",
    "VllmWardenRestartLoop",
    "VllmWardenGaveUp",
    "VllmWardenLoadSlow",
    "VllmWardenCompileCacheLost",
    "VllmWardenGoldenChanged",
    "VllmWardenReloadRefused",
    "VllmWardenEngineStalled",
    "VllmWardenGpuMemoryNotReleased",
    "VllmWardenDrainedTooLong",
];

/// Every alert is there, with a severity, a summary naming the instance,
/// and a runbook link to its own section of the operator's guide (as the
/// package installs it); each has a unit test among promtool's.
#[test]
fn every_alert_has_a_severity_a_summary_a_runbook_section_and_a_unit_test() {
    let rules = alerts(&std::fs::read_to_string(rules_path()).unwrap());
    let names: Vec<&str> = rules.iter().map(|a| a.name.as_str()).collect();
    assert_eq!(names, ALERTS, "the alerts, in order");
    let guide = std::fs::read_to_string(root().join("docs/operator-guide.md")).unwrap();
    let sections = anchors(&guide);
    let tests = std::fs::read_to_string(root().join("packaging/observability/vllm-warden.rules.test.yml")).unwrap();
    for a in &rules {
        assert!(["critical", "warning"].contains(&a.severity.as_str()), "{a:?}");
        assert!(a.summary.contains("{{ $labels.instance }}"), "the summary names the instance: {a:?}");
        let anchor = a
            .runbook
            .strip_prefix("file:///usr/share/doc/vllm-warden/docs/operator-guide.md#")
            .unwrap_or_else(|| panic!("a runbook into the installed guide: {a:?}"));
        assert_eq!(anchor, a.name.to_lowercase(), "{a:?}");
        assert!(sections.contains(anchor), "no section {anchor} in docs/operator-guide.md");
        assert!(tests.contains(&format!("alertname: {}\n", a.name)), "no promtool unit test of {}", a.name);
        assert!(guide.contains(&format!("`{}`", a.expr.lines().next().unwrap())), "the guide shows {}'s rule", a.name);
    }
}

/// `promtool check rules` and `promtool test rules` (a unit test per
/// alert: it fires on the series that should fire it, and stays silent
/// on the near miss), on the rule file and on the PrometheusRule's rules.
#[test]
fn the_rules_pass_promtool_check_and_their_unit_tests() {
    let Some(p) = tool("promtool") else { return };
    let dir = root().join("packaging/observability");
    let checked = promtool(p, &["check", "rules", "vllm-warden.rules.yml"], &dir);
    assert!(checked.contains(&format!("SUCCESS: {} rules found", ALERTS.len())), "{checked}");
    let tested = promtool(p, &["test", "rules", "vllm-warden.rules.test.yml"], &dir);
    assert!(tested.contains("SUCCESS"), "{tested}");
    // The PrometheusRule's `spec` is a rule file of its own.
    let manifest = std::fs::read_to_string(root().join("packaging/container/vllm-warden.prometheusrule.yaml")).unwrap();
    let spec: String = manifest
        .split_once("\nspec:\n")
        .expect("a spec")
        .1
        .lines()
        .map(|l| format!("{}\n", l.strip_prefix("  ").unwrap_or(l)))
        .collect();
    let tmp = tempfile::tempdir().unwrap();
    std::fs::write(tmp.path().join("spec.yml"), spec).unwrap();
    let checked = promtool(p, &["check", "rules", "spec.yml"], tmp.path());
    assert!(checked.contains(&format!("SUCCESS: {} rules found", ALERTS.len())), "{checked}");
}

/// The PrometheusRule beside the Kubernetes manifests is what its script
/// makes of the rule file: the same rules, word for word.
#[test]
fn the_prometheusrule_holds_the_rules_of_the_rule_file() {
    let out = Command::new(root().join("packaging/observability/prometheusrule.sh")).output().unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let shipped = std::fs::read_to_string(root().join("packaging/container/vllm-warden.prometheusrule.yaml")).unwrap();
    assert!(
        String::from_utf8_lossy(&out.stdout) == shipped,
        "packaging/container/vllm-warden.prometheusrule.yaml is not the rule file's: run packaging/observability/prometheusrule.sh >packaging/container/vllm-warden.prometheusrule.yaml"
    );
    assert!(shipped.contains("\napiVersion: monitoring.coreos.com/v1\nkind: PrometheusRule\n"), "{shipped}");
}

/// The dashboard: its JSON, the Grafana schema version it declares, and
/// every query of its panels and variables.
fn dashboard() -> serde_json::Value {
    let text = std::fs::read_to_string(dashboard_path()).unwrap();
    serde_json::from_str(&text).unwrap_or_else(|e| panic!("{}: not JSON: {e}", dashboard_path().display()))
}

/// The PromQL of the dashboard's panels, Grafana's variables given values
/// (`$__rate_interval` a duration, `$name` a regex).
fn dashboard_queries(d: &serde_json::Value) -> Vec<String> {
    let mut out = Vec::new();
    for p in d["panels"].as_array().unwrap() {
        for t in p["targets"].as_array().into_iter().flatten() {
            out.push(t["expr"].as_str().unwrap_or_else(|| panic!("a target without expr: {t}")).to_string());
        }
    }
    out
}

fn with_values(expr: &str) -> String {
    expr.replace("$__rate_interval", "1m")
        .replace("$__range", "1h")
        .replace("${host:regex}", "h")
        .replace("$host", "h")
        .replace("$name", ".*")
        .replace("$model", ".*")
}

/// The host variable is the part of `instance` before its port, for an
/// IPv6 target (`[::1]:9400`, which made it `[` and every panel a regexp
/// error), a DNS name and an IPv4 address alike; the panels select by it
/// escaped (`${host:regex}`, Grafana's regex format), so that each host's
/// instances and no other's match, as Prometheus matches (anchored).
#[test]
fn the_host_variable_selects_ipv6_dns_and_ipv4_targets() {
    let d = dashboard();
    let host = d["templating"]["list"].as_array().unwrap().iter().find(|v| v["name"] == "host").unwrap();
    let re = host["regex"].as_str().unwrap().trim_start_matches('/').trim_end_matches('/');
    let re = regex::Regex::new(re).unwrap();
    let targets = ["[::1]:9400", "[2001:db8::5]:9400", "gpu-7.example.com:9400", "10.1.2.3:9400", "localhost:9400"];
    let hosts: Vec<&str> = targets.iter().map(|t| re.captures(t).unwrap().get(1).unwrap().as_str()).collect();
    assert_eq!(hosts, ["[::1]", "[2001:db8::5]", "gpu-7.example.com", "10.1.2.3", "localhost"]);
    let text = serde_json::to_string(&d).unwrap();
    assert!(!text.contains("$host:"), "every selector takes the host escaped: ${{host:regex}}");
    for (h, target) in hosts.iter().zip(targets) {
        // Grafana's regex format escapes what a regex means.
        let selector = regex::Regex::new(&format!("^(?:{}:.*)$", regex::escape(h))).unwrap();
        let matched: Vec<&str> = targets.iter().copied().filter(|t| selector.is_match(t)).collect();
        assert_eq!(matched, [target], "{h}");
    }
}

/// Grafana dashboards of schema version 39 (Grafana 10.4 and 11): every
/// panel has a type, a title, a place on the grid and a unique id; the
/// Prometheus data source is the variable `datasource`; every query
/// parses (each made a recording rule that `promtool check rules` reads).
#[test]
fn the_dashboard_is_grafana_json_of_its_schema_version_and_every_query_parses() {
    let d = dashboard();
    assert_eq!(d["schemaVersion"], 39, "the schema version this file is written for");
    assert_eq!(d["uid"], "vllm-warden");
    let mut ids = BTreeSet::new();
    for p in d["panels"].as_array().unwrap() {
        assert!(p["type"].is_string() && p["title"].is_string(), "{p}");
        for k in ["h", "w", "x", "y"] {
            assert!(p["gridPos"][k].is_u64(), "{p}");
        }
        assert!(p["gridPos"]["x"].as_u64().unwrap() + p["gridPos"]["w"].as_u64().unwrap() <= 24, "{p}");
        assert!(ids.insert(p["id"].as_u64().unwrap()), "a second panel with id {}", p["id"]);
        if p["type"] != "row" {
            assert_eq!(p["datasource"]["uid"], "${datasource}", "{p}");
            assert!(p["description"].as_str().is_some_and(|s| !s.is_empty()), "each panel says what it shows: {p}");
        }
    }
    let vars: Vec<&str> =
        d["templating"]["list"].as_array().unwrap().iter().map(|v| v["name"].as_str().unwrap()).collect();
    assert_eq!(vars, ["datasource", "host", "name", "model"]);
    let queries = dashboard_queries(&d);
    assert!(queries.len() >= 20, "{queries:?}");
    let Some(p) = tool("promtool") else { return };
    let tmp = tempfile::tempdir().unwrap();
    let mut rules = String::from("groups:\n  - name: dashboard\n    rules:\n");
    let var_queries = d["templating"]["list"].as_array().unwrap().iter().filter_map(|v| v["definition"].as_str());
    for (i, q) in queries.iter().map(String::as_str).chain(var_queries).enumerate() {
        // label_values() is Grafana's, not PromQL: its first argument is.
        let q = q.strip_prefix("label_values(").map_or(q.to_string(), |rest| {
            rest.rsplit_once(',').map_or(rest.trim_end_matches(')').to_string(), |(m, _)| m.to_string())
        });
        rules +=
            &format!("      - record: dashboard:query_{i}\n        expr: {}\n", serde_json::json!(with_values(&q)));
    }
    std::fs::write(tmp.path().join("dashboard.yml"), &rules).unwrap();
    let checked = promtool(p, &["check", "rules", "dashboard.yml"], tmp.path());
    assert!(checked.contains("SUCCESS"), "{checked}\n{rules}");
}

/// The metric names a query uses: the warden's and vLLM's (Prometheus's
/// own `up` needs no exposition).
fn names_in(expr: &str) -> BTreeSet<String> {
    let mut out = BTreeSet::new();
    for start in ["vllm_warden_", "vllm:"] {
        let mut rest = expr;
        while let Some(i) = rest.find(start) {
            let name: String =
                rest[i..].chars().take_while(|c| c.is_ascii_alphanumeric() || *c == '_' || *c == ':').collect();
            rest = &rest[i + name.len()..];
            out.insert(name);
        }
    }
    out
}

/// The names an exposition declares (`# TYPE`), each with the names its
/// samples take (a histogram's `_bucket`, `_sum`, `_count`; a counter's
/// `_total`).
fn declared(exposition: &str) -> BTreeSet<String> {
    let mut out = BTreeSet::new();
    for l in exposition.lines() {
        let Some(rest) = l.strip_prefix("# TYPE ") else { continue };
        let mut words = rest.split_whitespace();
        let (Some(name), Some(kind)) = (words.next(), words.next()) else { continue };
        out.insert(name.to_string());
        match kind {
            "histogram" | "summary" => {
                for s in ["_bucket", "_sum", "_count"] {
                    out.insert(format!("{name}{s}"));
                }
            }
            "counter" if !name.ends_with("_total") => {
                out.insert(format!("{name}_total"));
            }
            _ => {}
        }
    }
    out
}

/// Every metric a rule or a dashboard query names is in an exposition:
/// the warden's own in the `/metrics` of a real warden supervising the
/// simulated vLLM (read while it loads and once it is ready), vLLM's in a
/// scrape of a real vLLM 0.32 (`tests/fixtures/vllm-0.32.0-metrics.txt`).
#[test]
fn every_metric_a_rule_or_the_dashboard_names_exists_in_a_real_exposition() {
    let mut used = BTreeSet::new();
    for a in alerts(&std::fs::read_to_string(rules_path()).unwrap()) {
        used.extend(names_in(&a.expr));
    }
    let d = dashboard();
    for q in dashboard_queries(&d) {
        used.extend(names_in(&q));
    }
    for v in d["templating"]["list"].as_array().unwrap() {
        used.extend(names_in(v["definition"].as_str().unwrap_or("")));
    }
    assert!(used.len() > 25, "{used:?}");

    // A warden whose every metric has a value: its first start fails
    // (the last failure's time), its command is `vllm serve FOLDER` (the
    // weights' size, so their read rate), and a second run, whose first
    // start fails too, has the first's load as history (the expected
    // time).
    let listen = free_port();
    let mut w = Warden::start(|d, p| {
        let vllm = d.join("bin/vllm");
        std::fs::create_dir_all(vllm.parent().unwrap()).unwrap();
        std::os::unix::fs::symlink(common::sim(), &vllm).unwrap();
        let model = d.join("model");
        std::fs::create_dir_all(&model).unwrap();
        std::fs::write(model.join("config.json"), "{}\n").unwrap();
        std::fs::write(model.join("model.safetensors"), vec![0u8; 1 << 20]).unwrap();
        let argv: Vec<String> = [
            vllm.to_str().unwrap(),
            "serve",
            model.to_str().unwrap(),
            "--port",
            &p.to_string(),
            "--shards",
            "3",
            "--shard-time",
            "300ms",
            "--fail",
            "exit1",
            "--fail-times",
            "1",
            "--count-file",
            d.join("count").to_str().unwrap(),
        ]
        .iter()
        .map(|a| format!("{a:?}"))
        .collect();
        format!(
            "name = \"t\"\n[child]\ncommand = [{}]\nlog-file = \"{d}/t.log\"\n[status]\nfile = \"{d}/status.json\"\n[restart]\ninitial-delay = \"0s\"\n[server]\nlisten = \"127.0.0.1:{listen}\"\n",
            argv.join(", "),
            d = d.display()
        )
    });
    let scrape = || {
        let a = http::get(&format!("http://127.0.0.1:{listen}/metrics"), common::TIMEOUT).unwrap();
        assert_eq!(a.status, 200, "{}", a.body);
        a.body
    };
    w.wait_ready();
    assert_eq!(w.stop(), 0);
    // Again, its first start failing again.
    std::fs::remove_file(w.path("count")).unwrap();
    w.spawn();
    w.wait_note("the weights", |n| n.contains("Loading safetensors checkpoint shards: 1/3"));
    let loading = scrape();
    w.wait_ready();
    let ready = scrape();
    assert_eq!(w.stop(), 0);
    let mut exposed = declared(&loading);
    exposed.extend(declared(&ready));
    assert!(loading.contains("vllm_warden_load_elapsed_seconds{"), "a sample during the load:\n{loading}");
    let vllm = declared(&std::fs::read_to_string(root().join("tests/fixtures/vllm-0.32.0-metrics.txt")).unwrap());
    let missing: Vec<&String> = used
        .iter()
        .filter(|n| if n.starts_with("vllm:") { !vllm.contains(*n) } else { !exposed.contains(*n) })
        .collect();
    assert!(missing.is_empty(), "named by a rule or the dashboard, in no exposition: {missing:?}\n{ready}");
}

/// The value of the sample `name{name="t"}` in an exposition.
fn sample(exposition: &str, name: &str) -> Option<f64> {
    let prefix = format!("{name}{{name=\"t\"}} ");
    exposition.lines().find_map(|l| l.strip_prefix(&prefix)).and_then(|v| v.parse().ok())
}

/// `vllm_warden_gpu_release_wait_seconds` while a start waits for the
/// GPUs (a query that says one is busy, until the test frees it), as of
/// the answer; 0 once the wait is over.
#[test]
fn the_gpu_wait_is_in_the_metrics_while_it_lasts() {
    let listen = free_port();
    let mut w = Warden::start(|d, p| {
        let script = d.join("gpu-query");
        let busy = d.join("busy");
        std::fs::write(&busy, "").unwrap();
        std::fs::write(&script, format!("#!/bin/sh\n[ -e {} ] && echo '4242, 81000'\nexit 0\n", busy.display()))
            .unwrap();
        std::fs::set_permissions(&script, std::os::unix::fs::PermissionsExt::from_mode(0o755)).unwrap();
        let more = format!(
            "[server]\nlisten = \"127.0.0.1:{listen}\"\n[prestart]\ngpu-idle-wait = \"60s\"\ngpu-query = [\"{}\"]\n",
            script.display()
        );
        config(d, p, &["--shards", "1"], "", &more)
    });
    let scrape = || http::get(&format!("http://127.0.0.1:{listen}/metrics"), common::TIMEOUT).unwrap().body;
    w.wait_note("the wait", |n| n.starts_with("STATUS=waiting up to 1m for GPU compute processes"));
    let first = sample(&scrape(), "vllm_warden_gpu_release_wait_seconds").expect("the gauge");
    assert!(first > 0.0, "waiting: {first}");
    // Asked again until the answer moves: the wait is timed as of each answer.
    let deadline = Instant::now() + common::TIMEOUT;
    while sample(&scrape(), "vllm_warden_gpu_release_wait_seconds").unwrap() <= first {
        assert!(Instant::now() < deadline, "the wait's time stood still at {first}");
    }
    std::fs::remove_file(w.path("busy")).unwrap();
    w.wait_ready();
    assert_eq!(sample(&scrape(), "vllm_warden_gpu_release_wait_seconds"), Some(0.0));
    assert_eq!(w.stop(), 0);
}

/// Shipped: the package installs the rules, the PrometheusRule and the
/// dashboard in `/usr/share/vllm-warden/`, and the container image has
/// them there too (`tests/systemd/run.sh` installs the package and looks).
#[test]
fn the_package_and_the_image_ship_the_rules_and_the_dashboard() {
    let deb = std::fs::read_to_string(root().join("packaging/build-deb.sh")).unwrap();
    let image = std::fs::read_to_string(root().join("packaging/container/Dockerfile")).unwrap();
    let copy = image.lines().find(|l| l.starts_with("COPY packaging/observability/")).expect("a COPY of them");
    assert!(copy.ends_with(" /usr/share/vllm-warden/"), "{copy}");
    for file in [
        "packaging/observability/vllm-warden.rules.yml",
        "packaging/observability/vllm-warden.dashboard.json",
        "packaging/container/vllm-warden.prometheusrule.yaml",
    ] {
        assert!(root().join(file).is_file(), "{file}");
        assert!(deb.contains(&format!("\"{file} usr/share/vllm-warden/ 644\"")), "build-deb.sh installs {file}");
        assert!(copy.contains(&format!(" {file} ")), "the image has {file}");
    }
}

// --- End to end: a real Prometheus with the shipped rules -----------------

/// The end-to-end test's scrape and rule-evaluation intervals.
const SCRAPE: Duration = Duration::from_secs(1);
const EVAL: Duration = Duration::from_millis(500);
/// The `for:` of the test's copy of the rules (the shipped ones are what an
/// operator needs: minutes), for every rule whose `for:` is not 0.
const FOR: Duration = Duration::from_secs(2);
/// `VllmWardenDown`'s: longer than a warden takes to bind its endpoint on
/// a busy machine (a scenario's warden is started while Prometheus runs).
const FOR_DOWN: Duration = Duration::from_secs(10);
/// How often the test asks Prometheus for its alerts.
const POLL: Duration = Duration::from_millis(100);

/// The shipped rules with the test's `for:`; each alert's `for:` there.
fn test_rules(text: &str) -> (String, BTreeMap<String, Duration>) {
    let mut out = String::new();
    let mut fors = BTreeMap::new();
    let mut alert = String::new();
    for line in text.lines() {
        let t = line.trim();
        if let Some(name) = t.strip_prefix("- alert:") {
            alert = name.trim().to_string();
        }
        match t.strip_prefix("for:").map(str::trim) {
            Some(v) => {
                let d = match v {
                    "0m" | "0s" => Duration::ZERO,
                    _ if alert == "VllmWardenDown" => FOR_DOWN,
                    _ => FOR,
                };
                fors.insert(alert.clone(), d);
                let indent = &line[..line.len() - line.trim_start().len()];
                out += &format!("{indent}for: {}ms\n", d.as_millis());
            }
            None => out += &format!("{line}\n"),
        }
    }
    (out, fors)
}

/// A Prometheus server, killed when dropped.
struct Prometheus {
    child: std::process::Child,
    port: u16,
    _dir: tempfile::TempDir,
}

impl Prometheus {
    /// Start `prometheus` on `config` and `rules`; returns once it says it
    /// is ready to receive web requests (read from its log, as it comes).
    fn start(program: &str, config: &str, rules: &str) -> Prometheus {
        use std::io::BufRead;
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join("prometheus.yml"), config).unwrap();
        std::fs::write(dir.path().join("rules.yml"), rules).unwrap();
        let port = free_port();
        let mut child = Command::new(program)
            .arg(format!("--config.file={}", dir.path().join("prometheus.yml").display()))
            .arg(format!("--storage.tsdb.path={}", dir.path().join("data").display()))
            .arg(format!("--web.listen-address=127.0.0.1:{port}"))
            .arg("--log.level=info")
            .stdin(std::process::Stdio::null())
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::piped())
            .spawn()
            .unwrap();
        let (tx, rx) = std::sync::mpsc::channel();
        let stderr = child.stderr.take().unwrap();
        std::thread::spawn(move || {
            for line in std::io::BufReader::new(stderr).lines().map_while(Result::ok) {
                let _ = tx.send(line);
            }
        });
        let mut seen = Vec::new();
        let deadline = Instant::now() + common::TIMEOUT;
        loop {
            match rx.recv_timeout(deadline.saturating_duration_since(Instant::now())) {
                Ok(line) if line.contains("Server is ready to receive web requests") => break,
                Ok(line) => seen.push(line),
                Err(e) => {
                    let _ = child.kill();
                    panic!("prometheus not ready ({e}):\n{}", seen.join("\n"))
                }
            }
        }
        // Its log from now on: read and dropped, so that it never blocks.
        std::thread::spawn(move || while rx.recv().is_ok() {});
        Prometheus { child, port, _dir: dir }
    }

    /// The answer to an instant query, for a failure message.
    fn query(&self, expr: &str) -> String {
        let mut url = format!("http://127.0.0.1:{}/api/v1/query?query=", self.port);
        for b in expr.bytes() {
            if b.is_ascii_alphanumeric() || b"_-.".contains(&b) {
                url.push(b as char);
            } else {
                url += &format!("%{b:02X}");
            }
        }
        http::get(&url, common::TIMEOUT).map(|a| a.body).unwrap_or_else(|e| e)
    }

    /// When Prometheus took its first sample of `selector`: the first
    /// sample of the series it has kept for the last 10 minutes.
    fn first_sample(&self, selector: &str) -> Instant {
        let body = self.query(&format!("{selector}[10m]"));
        let v: serde_json::Value = serde_json::from_str(&body).unwrap_or_else(|e| panic!("{e}: {body}"));
        let first = v["data"]["result"]
            .as_array()
            .into_iter()
            .flatten()
            .filter_map(|series| series["values"][0][0].as_f64())
            .reduce(f64::min)
            .unwrap_or_else(|| panic!("no sample of {selector}: {body}"));
        let now = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().as_secs_f64();
        Instant::now() - Duration::from_secs_f64((now - first).max(0.0))
    }

    /// The alerts, pending and firing: (labels, state).
    fn alerts(&self) -> Vec<(BTreeMap<String, String>, String)> {
        let a = http::get(&format!("http://127.0.0.1:{}/api/v1/alerts", self.port), common::TIMEOUT).unwrap();
        assert_eq!(a.status, 200, "{}", a.body);
        let body = a.json();
        body["data"]["alerts"]
            .as_array()
            .unwrap_or_else(|| panic!("{body}"))
            .iter()
            .map(|x| {
                let labels = x["labels"]
                    .as_object()
                    .unwrap()
                    .iter()
                    .map(|(k, v)| (k.clone(), v.as_str().unwrap_or_default().to_string()))
                    .collect();
                (labels, x["state"].as_str().unwrap_or_default().to_string())
            })
            .collect()
    }
}

impl Drop for Prometheus {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Serves the file at `path` to every request, as node_exporter's textfile
/// collector serves the metrics file; its port.
fn serve_file(path: PathBuf) -> u16 {
    use std::io::{Read, Write};
    let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let port = l.local_addr().unwrap().port();
    std::thread::spawn(move || {
        for mut c in l.incoming().flatten() {
            let mut buf = [0u8; 4096];
            let _ = c.read(&mut buf);
            let body = std::fs::read_to_string(&path).unwrap_or_default();
            let _ = write!(
                c,
                "HTTP/1.1 200 OK\r\ncontent-type: text/plain; version=0.0.4\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{body}",
                body.len()
            );
        }
    });
    port
}

const TOKEN: &str = "s3cret";

/// A scenario's warden: the simulated vLLM with `fake` arguments, the
/// endpoint on `listen` (token [`TOKEN`]), no drain delay; `restart` keys
/// of `[restart]`, and `more` sections.
fn scenario_config(d: &Path, p: u16, listen: u16, fake: &[&str], restart: &str, more: &str) -> String {
    let token = d.join("token");
    std::fs::write(&token, format!("{TOKEN}\n")).unwrap();
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(&token, std::fs::Permissions::from_mode(0o600)).unwrap();
    let extra = format!(
        "[restart]\ninitial-delay = \"0s\"\n{restart}[server]\nlisten = \"127.0.0.1:{listen}\"\ntoken-file = \"{}\"\n[drain]\ndelay = \"0s\"\n{more}",
        token.display()
    );
    config(d, p, fake, "", &extra)
}

/// The golden scenario's config: the simulated model answers from a file
/// that the config patches to `value`; a mismatch is a warning.
fn golden_config(d: &Path, p: u16, listen: u16, value: u32) -> String {
    let weights = d.join("weights.json");
    if !weights.exists() {
        std::fs::write(&weights, "{\"rms_norm_eps\": 1e-06}\n").unwrap();
    }
    let w = weights.to_str().unwrap();
    let more = format!(
        "[golden]\non-mismatch = \"warn\"\nprompts = [\"one\"]\n[[patch]]\nfile = \"{w}\"\nset = {{ rms_norm_eps = {value} }}\n"
    );
    scenario_config(d, p, listen, &["--shards", "1", "--answers-from", w], "", &more)
}

/// What a scenario's thread hands back: its warden (still running), and
/// for each alert it expects, when the condition began (as the warden
/// told it).
type Outcome = (Warden, Vec<(&'static str, Instant)>);

/// Issue 47's proof: a real Prometheus (scrape every 1 s, rules every
/// 0.5 s) with the shipped rules, `for:` shortened to seconds, scrapes
/// wardens that supervise the simulated vLLM through a crash loop, a
/// give-up, a stall after ready, a load slower than its history, a golden
/// mismatch, a refused reload and a long drain, each its own warden, all
/// at once. Each scenario's alert fires within its `for:` plus two scrape
/// intervals of the moment its condition began; no scenario fires an
/// alert it should not; a clean run, there all along, fires none.
#[test]
fn a_real_prometheus_fires_each_alert_on_its_scenario_and_none_on_a_clean_run() {
    let Some(program) = tool("prometheus") else { return };
    let began = Instant::now();
    let ports: BTreeMap<&str, u16> =
        ["clean", "crash-loop", "give-up", "stall", "slow-load", "golden", "reload", "drain"]
            .into_iter()
            .map(|s| (s, free_port()))
            .collect();
    let listen = |s: &str| ports[s];

    // Before Prometheus: the wardens whose scenario begins from a ready
    // server (or, for the give-up, has already ended).
    let one = &["--shards", "1"][..];
    let mut clean = Warden::start(|d, p| scenario_config(d, p, listen("clean"), one, "", ""));
    let mut give_up = Warden::start(|d, p| {
        scenario_config(
            d,
            p,
            listen("give-up"),
            &["--shards", "1", "--fail", "kv-cache"],
            "permanent-attempts = 1\n",
            "",
        )
    });
    let stall_health = "[health]\ninterval = \"100ms\"\nprogress-stall = \"1s\"\ncanary-interval = \"0s\"\n";
    let mut stall = Warden::start(|d, p| {
        scenario_config(d, p, listen("stall"), &["--shards", "1", "--wedge-on-usr2"], "", stall_health)
    });
    let slow_args = &["--shards", "6", "--shard-time", "1500ms"][..];
    let mut slow = Warden::start(|d, p| scenario_config(d, p, listen("slow-load"), slow_args, "", ""));
    let golden_listen = listen("golden");
    let mut golden = Warden::start(|d, p| golden_config(d, p, golden_listen, 1));
    let mut reload = Warden::start(|d, p| scenario_config(d, p, listen("reload"), one, "", ""));
    let mut drain = Warden::start(|d, p| scenario_config(d, p, listen("drain"), one, "", ""));
    // The crash loop begins with a reload that makes every start fail.
    let crash_delay = Duration::from_millis(300);
    let crash_restart =
        format!("max-delay = \"{ms}ms\"\njitter = 0.0\nmax-attempts = 0\n", ms = crash_delay.as_millis());
    let crash_listen = listen("crash-loop");
    let crash_config = move |d: &Path, p: u16, fake: &[&str]| {
        let c = scenario_config(d, p, crash_listen, fake, &crash_restart, "");
        c.replace("initial-delay = \"0s\"", &format!("initial-delay = \"{}ms\"", crash_delay.as_millis()))
    };
    let mut crash = Warden::start(|d, p| crash_config(d, p, one));
    for w in [&mut clean, &mut stall, &mut golden, &mut reload, &mut drain, &mut crash] {
        w.wait_ready();
    }
    assert_eq!(give_up.wait_exit(), 78, "a permanent cause, once");
    // The slow load's history: its setup's loads took a second each.
    slow.wait_ready();
    assert_eq!(slow.stop(), 0);
    let ledger = slow.path("state/loads.jsonl");
    let last: serde_json::Value =
        serde_json::from_str(std::fs::read_to_string(&ledger).unwrap().lines().last().unwrap()).unwrap();
    let history: String = (1..=30)
        .map(|id| {
            let line = serde_json::json!({
                "id": id, "at": "2026-01-01T00:00:00Z", "start": 1, "outcome": {"kind": "ready"},
                "total_secs": 1.0, "phases": [{"phase": "start", "secs": 0.5}, {"phase": "weights", "secs": 0.5}],
                "fingerprint": last["fingerprint"], "setup": last["setup"],
            });
            format!("{line}\n")
        })
        .collect();
    std::fs::write(&ledger, history).unwrap();
    let textfile = serve_file(give_up.path("vllm_warden.prom"));

    let (rules, fors) = test_rules(&std::fs::read_to_string(rules_path()).unwrap());
    let mut config = format!(
        "global:\n  scrape_interval: {}ms\n  scrape_timeout: {}ms\n  evaluation_interval: {}ms\nrule_files: [rules.yml]\nscrape_configs:\n  - job_name: vllm-warden\n    static_configs:\n",
        SCRAPE.as_millis(),
        SCRAPE.as_millis() * 8 / 10,
        EVAL.as_millis()
    );
    for (scenario, port) in &ports {
        config += &format!("      - targets: ['127.0.0.1:{port}']\n        labels: {{scenario: {scenario}}}\n");
    }
    config += &format!(
        "  - job_name: vllm-warden-textfile\n    static_configs:\n      - targets: ['127.0.0.1:{textfile}']\n        labels: {{scenario: give-up}}\n"
    );
    let prometheus = Prometheus::start(program, &config, &rules);
    let scraping = Instant::now();
    // Every warden that runs scraped once before a scenario begins: a
    // counter's first sample is its value before (as in production, where
    // Prometheus has watched a warden long before anything happens).
    // All but the give-up (over) and the slow load (stopped, to start again).
    let running = ports.len() - 2;
    // When each alert first fired, and every alert ever seen by scenario.
    let mut fired: BTreeMap<(String, String), Instant> = BTreeMap::new();
    let mut seen: BTreeSet<(String, String, String)> = BTreeSet::new();
    let watch = |fired: &mut BTreeMap<(String, String), Instant>, seen: &mut BTreeSet<(String, String, String)>| {
        let now = Instant::now();
        for (labels, state) in prometheus.alerts() {
            let scenario = labels.get("scenario").cloned().unwrap_or_default();
            let alert = labels.get("alertname").cloned().unwrap_or_default();
            seen.insert((scenario.clone(), alert.clone(), state.clone()));
            if state == "firing" {
                fired.entry((scenario, alert)).or_insert(now);
            }
        }
    };
    let deadline = Instant::now() + common::TIMEOUT;
    while !prometheus.query("count(up{job=\"vllm-warden\"} == 1)").contains(&format!(",\"{running}\"]")) {
        assert!(Instant::now() < deadline, "the wardens not scraped: {}", prometheus.query("up"));
        watch(&mut fired, &mut seen);
        // Prometheus can only be asked: asked again shortly.
        std::thread::sleep(POLL);
    }

    // The scenarios, each on its own thread, all at once.
    let mut threads: Vec<(&str, std::thread::JoinHandle<Outcome>)> = Vec::new();
    threads.push((
        "give-up",
        std::thread::spawn(move || {
            // Over before the first scrape: the condition is there from it on
            // (below, when Prometheus took that scrape).
            (give_up, vec![("VllmWardenGaveUp", scraping), ("VllmWardenDown", scraping)])
        }),
    ));
    threads.push((
        "crash-loop",
        std::thread::spawn(move || {
            let text = crash_config(&crash.path(""), crash.port, &["--shards", "1", "--fail", "exit1"]);
            std::fs::write(crash.path("t.toml"), text).unwrap();
            crash.signal(nix::sys::signal::Signal::SIGHUP);
            // Three restarts counted (the status document and the metrics
            // count them alike, the reload's own restart among them).
            let restarts = |w: &Warden| {
                std::fs::read_to_string(w.path("status.json"))
                    .ok()
                    .and_then(|t| serde_json::from_str::<serde_json::Value>(&t).ok())
                    .and_then(|d| d["restarts"].as_u64())
                    .unwrap_or(0)
            };
            crash.wait_for_file("status.json", |w| restarts(w) >= 3);
            (crash, vec![("VllmWardenRestartLoop", Instant::now())])
        }),
    ));
    threads.push((
        "stall",
        std::thread::spawn(move || {
            let leader = stall.descendants().iter().find(|p| p.ppid == stall.pid as i32).unwrap().pid;
            let url = format!("http://127.0.0.1:{}/v1/completions", stall.port);
            // A long request in flight when the engine wedges.
            std::thread::spawn(move || {
                let body = serde_json::json!({"model": "tiny-llama", "prompt": "Hi", "max_tokens": 100000});
                let _ = http::post_json(&url, &body, http::FOREVER);
            });
            nix::sys::signal::kill(nix::unistd::Pid::from_raw(leader), nix::sys::signal::Signal::SIGUSR2).unwrap();
            stall.wait_note("the stall", |n| n.starts_with("STATUS=failed") && n.contains("engine stalled"));
            let at = Instant::now();
            (stall, vec![("VllmWardenEngineStalled", at)])
        }),
    ));
    threads.push((
        "slow-load",
        std::thread::spawn(move || {
            slow.spawn();
            // The load's first word, at its spawn: its estimate from the
            // history, a second; 1.5 s in, it is slower than that.
            slow.wait_note("the load", |n| n.starts_with("STATUS=loading ") && n.contains(" of ~1s"));
            let at = Instant::now() + Duration::from_millis(1500);
            (slow, vec![("VllmWardenLoadSlow", at)])
        }),
    ));
    threads.push((
        "golden",
        std::thread::spawn(move || {
            let text = golden_config(&golden.path(""), golden.port, golden_listen, 2);
            std::fs::write(golden.path("t.toml"), text).unwrap();
            golden.signal(nix::sys::signal::Signal::SIGHUP);
            golden.wait_note("the changed answers", |n| {
                n.starts_with("STATUS=ready") && n.contains("WARNING: answers changed")
            });
            let at = Instant::now();
            (golden, vec![("VllmWardenGoldenChanged", at)])
        }),
    ));
    threads.push((
        "reload",
        std::thread::spawn(move || {
            let good = std::fs::read_to_string(reload.path("t.toml")).unwrap();
            std::fs::write(reload.path("t.toml"), good.replace("[child]", "[child]\nstop-timeout = \"soon\"")).unwrap();
            reload.signal(nix::sys::signal::Signal::SIGHUP);
            reload.wait_note("the refusal", |n| n.starts_with("STATUS=reload refused"));
            let at = Instant::now();
            (reload, vec![("VllmWardenReloadRefused", at)])
        }),
    ));
    let drain_listen = listen("drain");
    threads.push((
        "drain",
        std::thread::spawn(move || {
            let url = format!("http://127.0.0.1:{drain_listen}/drain");
            let a = http::post(&url, Some(TOKEN), common::TIMEOUT).unwrap();
            assert_eq!(a.status, 202, "{}", a.body);
            let at = Instant::now();
            (drain, vec![("VllmWardenDrainedTooLong", at)])
        }),
    ));

    // Watch Prometheus's alerts until every expected one fires.
    let expected: BTreeMap<&str, BTreeSet<&str>> = [
        ("clean", &[][..]),
        ("crash-loop", &["VllmWardenRestartLoop"][..]),
        ("give-up", &["VllmWardenGaveUp", "VllmWardenDown"][..]),
        ("stall", &["VllmWardenEngineStalled"][..]),
        ("slow-load", &["VllmWardenLoadSlow"][..]),
        ("golden", &["VllmWardenGoldenChanged"][..]),
        ("reload", &["VllmWardenReloadRefused"][..]),
        ("drain", &["VllmWardenDrainedTooLong"][..]),
    ]
    .into_iter()
    .map(|(s, a)| (s, a.iter().copied().collect()))
    .collect();
    let want: usize = expected.values().map(BTreeSet::len).sum();
    let deadline = Instant::now() + Duration::from_secs(120);
    while fired.len() < want || threads.iter().any(|(_, t)| !t.is_finished()) {
        let now = Instant::now();
        watch(&mut fired, &mut seen);
        let unexpected: Vec<_> = seen
            .iter()
            // Pending is not firing (a warden's endpoint is down until it
            // binds it), but the clean run raises nothing at all.
            .filter(|(s, a, state)| {
                (state == "firing" || s == "clean") && !expected.get(s.as_str()).is_some_and(|e| e.contains(a.as_str()))
            })
            .collect();
        assert!(unexpected.is_empty(), "alerts no scenario should raise: {unexpected:?}");
        if now >= deadline {
            let missing: Vec<_> = expected
                .iter()
                .flat_map(|(s, a)| a.iter().map(move |a| (s.to_string(), a.to_string())))
                .filter(|k| !fired.contains_key(k))
                .collect();
            let scrapes = prometheus.query("up == 0 or vllm_warden_health_check_failures_total > 0");
            panic!("after {}, not fired: {missing:?}; seen: {seen:?}\n{scrapes}", common::secs(now - began));
        }
        // Prometheus's alerts can only be asked for: asked again shortly.
        std::thread::sleep(POLL);
    }
    let mut outcomes: Vec<(&str, Outcome)> = threads.into_iter().map(|(s, t)| (s, t.join().unwrap())).collect();
    let first = [
        ("VllmWardenGaveUp", prometheus.first_sample("vllm_warden_gave_up{scenario=\"give-up\"}")),
        ("VllmWardenDown", prometheus.first_sample("up{scenario=\"give-up\", job=\"vllm-warden\"}")),
    ];
    for (scenario, (_, began)) in &mut outcomes {
        if *scenario == "give-up" {
            *began = first.to_vec();
        }
    }
    let (mut report, mut late) = (Vec::new(), Vec::new());
    for (scenario, (_, began)) in &outcomes {
        for (alert, at) in began {
            let fired_at = fired[&(scenario.to_string(), alert.to_string())];
            let took = fired_at.saturating_duration_since(*at);
            let budget = fors[*alert] + SCRAPE * 2;
            report.push(format!(
                "{scenario:>10} {alert:<32} fired {:>6} ms after its condition (for: {} ms, budget {} ms)",
                took.as_millis(),
                fors[*alert].as_millis(),
                budget.as_millis()
            ));
            if took > budget {
                late.push(format!(
                    "{alert} on {scenario}: {} after its condition, over {}",
                    common::secs(took),
                    common::secs(budget)
                ));
            }
        }
    }
    eprintln!("{}\nwhole test: {}", report.join("\n"), common::secs(began.elapsed()));
    assert!(late.is_empty(), "{late:?}");
    drop(prometheus);
    for (_, (mut w, _)) in outcomes {
        if w.child.is_some() {
            w.stop();
        }
    }
}
