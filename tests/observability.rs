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
        .replace("$host", "h")
        .replace("$name", ".*")
        .replace("$model", ".*")
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
    for (i, q) in queries.iter().map(String::as_str).chain(var_queries.map(|q| q)).enumerate() {
        // label_values() is Grafana's, not PromQL: its first argument is.
        let q = q.strip_prefix("label_values(").map_or(q.to_string(), |rest| {
            rest.rsplit_once(',').map_or(rest.trim_end_matches(')').to_string(), |(m, _)| m.to_string())
        });
        rules += &format!("      - record: dashboard:query_{i}\n        expr: {}\n", serde_json::json!(with_values(&q)));
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
