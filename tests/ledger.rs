//! The load ledger with the real binary and the simulated vLLM: every load
//! recorded with its phases and compile cache, the estimate in `STATUS=`
//! from the second load of a setup on, an alarm when the cache is lost,
//! `vllm-warden loads`, and `/startupz`.

mod common;

use common::*;
use std::time::Duration;

const FAST: &str = "[restart]\ninitial-delay = \"0s\"\n";

fn kill_child(ready: &str) {
    let pid: i32 = ready["STATUS=ready: pid ".len()..].split(',').next().unwrap().parse().unwrap();
    nix::sys::signal::kill(nix::unistd::Pid::from_raw(pid), nix::sys::signal::Signal::SIGKILL).unwrap();
}

/// `vllm-warden loads WHAT…`, which must succeed.
fn loads(w: &Warden, args: &[&str]) -> String {
    let (ok, out) = w.cli(&[&["loads"], args].concat());
    assert!(ok, "loads {args:?}");
    out
}

#[test]
fn loads_are_recorded_estimated_and_a_lost_compile_cache_is_an_alarm() {
    let listen = free_port();
    let mut w = Warden::start(|d, p| {
        let aot = d.join("cache/aot");
        let args = ["--shards", "2", "--compile-cache", aot.to_str().unwrap(), "--compile-time", "200ms"];
        config(d, p, &args, "", &format!("{FAST}[server]\nlisten = \"127.0.0.1:{listen}\"\n"))
    });
    // 1: a miss, and no estimate yet.
    w.wait_ready();
    let startupz = http::get(&format!("http://127.0.0.1:{listen}/startupz"), Duration::from_secs(10)).unwrap();
    assert_eq!((startupz.status, startupz.body.as_str()), (200, "ready\n"));
    let ready = w.wait_note("ready", |n| n.starts_with("STATUS=ready: pid "));
    assert!(w.notes.iter().any(|n| n.contains("(no earlier load of this setup), pid ")), "{:?}", w.notes);
    // 2: the same setup, from its cache: the estimate comes from load 1.
    w.drain_notes();
    kill_child(&ready);
    w.wait_note("an estimate", |n| n.starts_with("STATUS=loading ") && n.contains(" of ~") && n.contains(" (last "));
    w.wait_ready();
    let ready = w.wait_note("ready", |n| n.starts_with("STATUS=ready: pid "));
    // 3: the cache is gone.
    std::fs::remove_file(w.path("cache/aot")).unwrap();
    kill_child(&ready);
    w.wait_ready();
    w.wait_for_file("status.json", |w| {
        std::fs::read_to_string(w.path("status.json")).is_ok_and(|t| t.contains("\"alarms\""))
    });
    let doc: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(w.path("status.json")).unwrap()).unwrap();
    let alarms = &doc["last_load"]["alarms"];
    assert_eq!(alarms[0], "compile cache: miss where earlier loads of this setup had hit (2 load(s))", "{doc}");
    assert_eq!(doc["last_load"]["cache"], "miss");
    let phases: Vec<&str> =
        doc["last_load"]["phases"].as_array().unwrap().iter().map(|p| p[0].as_str().unwrap()).collect();
    assert_eq!(phases, ["start", "weights", "compile", "kv-cache", "engine", "api", "http", "golden"], "{doc}");
    assert_eq!(w.stop(), 0);
    let stderr = w.stderr();
    assert!(stderr.contains("compile cache: miss where earlier loads of this setup had hit"), "{stderr}");
    let prom = std::fs::read_to_string(w.path("vllm_warden.prom")).unwrap();
    assert!(prom.contains("vllm_warden_load_alarms_total{name=\"t\",kind=\"cache\"} 1"), "{prom}");
    assert!(prom.contains("vllm_warden_load_cache_outcomes_total{name=\"t\",outcome=\"hit\"} 1"), "{prom}");

    // The ledger: three ready loads (the killed runs failed after ready,
    // their loads had ended at ready), the same setup.
    let table = loads(&w, &["list"]);
    let rows: Vec<&str> = table.lines().skip(1).collect();
    assert_eq!(rows.len(), 3, "{table}");
    for (row, cache) in rows.iter().zip(["miss", "hit", "miss"]) {
        assert!(row.contains(" ready ") && row.contains(cache), "{table}");
    }
    let compare = loads(&w, &["compare", "2", "3"]);
    let cache = compare.lines().find(|l| l.starts_with("compile cache ")).unwrap_or_default();
    assert!(cache.contains(" hit ") && cache.ends_with("miss"), "{compare}");
    assert!(compare.contains("same setup ("), "{compare}");
    assert!(compare.contains("B: alarm: compile cache: miss"), "{compare}");
    let show = loads(&w, &["show"]);
    assert!(show.starts_with("load 3 at "), "{show}");
    assert!(show.lines().any(|l| l.starts_with("compile      █")), "{show}");
}

/// A warden whose child is stuck half way through its weights, silent for
/// ever, and the URL of its `/startupz`.
fn stuck_in_the_weights() -> (Warden, String) {
    let listen = free_port();
    let mut w = Warden::start(|d, p| {
        // Stuck half way through its weights, silent for ever.
        let extra = format!("{FAST}[server]\nlisten = \"127.0.0.1:{listen}\"\n");
        config(d, p, &["--shards", "4", "--fail", "stall"], "", &extra)
    });
    w.wait_note("the weights", |n| n.contains("Loading safetensors checkpoint shards: 2/4"));
    let url = format!("http://127.0.0.1:{listen}/startupz");
    (w, url)
}

#[test]
fn startupz_answers_503_with_the_phase_until_the_model_has_loaded() {
    let (mut w, url) = stuck_in_the_weights();
    let answer = http::get(&url, Duration::from_secs(10)).unwrap();
    assert_eq!(answer.status, 503, "{}", answer.body);
    let body = answer.json();
    assert_eq!(body["state"], "starting", "{body}");
    assert_eq!(body["load"]["phase"], "weights", "{body}");
    assert_eq!(body["load"]["index"], 2, "{body}");
    assert_eq!(body["load"]["of"], 9, "{body}");
    assert_eq!(w.stop(), 0);
}

/// The ledger is the service user's file: lines written there (or one real
/// outlier) lengthen a load's deadlines only within a bound of the config's.
#[test]
fn forged_ledger_lines_never_turn_off_the_stall_check() {
    let make = |d: &std::path::Path, p: u16| {
        let extra = format!("{FAST}max-attempts = 1\n[ready]\nstall = \"1s\"\ntimeout = \"60s\"\n");
        config(d, p, &["--shards", "4", "--fail", "stall"], "stop-timeout = \"2s\"", &extra)
    };
    let mut w = Warden::start(make);
    assert_eq!(w.wait_exit(), 75);
    let ledger = w.path("state/loads.jsonl");
    let first: serde_json::Value =
        serde_json::from_str(std::fs::read_to_string(&ledger).unwrap().lines().last().unwrap()).unwrap();
    let forge = |total: f64| -> String {
        (1..=30)
            .map(|id| {
                let line = serde_json::json!({
                    "id": id, "at": "2026-01-01T00:00:00Z", "start": 1, "outcome": {"kind": "ready"},
                    "total_secs": total,
                    "phases": [{"phase": "start", "secs": 1.0}, {"phase": "weights", "secs": total - 1.0}],
                    "fingerprint": first["fingerprint"], "setup": first["setup"],
                });
                format!("{line}\n")
            })
            .collect()
    };
    let gave_up = |w: &Warden| w.statuses().last().unwrap().to_string();

    // Thirty loads of a day each: none a load of a config whose loads take
    // at most a minute; the stall is the config's.
    std::fs::write(&ledger, forge(86_400.0)).unwrap();
    w.spawn();
    assert_eq!(w.wait_exit(), 75);
    let last = gave_up(&w);
    assert!(last.starts_with("gave up after 1 failed starts: no progress for 1s (ready.stall)"), "{last}");

    // Thirty within the timeout, silent for most of it: history lengthens
    // the stall, but to 4 × the config's at most.
    std::fs::write(&ledger, forge(50.0)).unwrap();
    w.spawn();
    assert_eq!(w.wait_exit(), 75);
    let last = gave_up(&w);
    assert!(
        last.starts_with("gave up after 1 failed starts: no progress for 4s (weights phase, from the ledger)"),
        "{last}"
    );
}

/// Issue 43: `/startupz`'s `elapsed_secs` stood still through a phase that
/// logs nothing (it was the status document's, made at the last line). It
/// is computed when the request is answered: two reads in the same silent
/// phase differ, and its text agrees.
#[test]
fn startupz_elapsed_moves_in_a_phase_that_logs_nothing() {
    let (mut w, url) = stuck_in_the_weights();
    let load = || {
        let answer = http::get(&url, Duration::from_secs(10)).unwrap();
        assert_eq!(answer.status, 503, "{}", answer.body);
        let body = answer.json();
        assert_eq!((body["state"].as_str(), body["load"]["phase"].as_str()), (Some("starting"), Some("weights")));
        body["load"].clone()
    };
    let first = load();
    let elapsed = |l: &serde_json::Value| l["elapsed_secs"].as_f64().unwrap_or_else(|| panic!("{l}"));
    // Asked again until the answer moves (the clock moves by the
    // millisecond it is shown in); before, it never did.
    let deadline = std::time::Instant::now() + TIMEOUT;
    let later = loop {
        let l = load();
        if elapsed(&l) != elapsed(&first) {
            break l;
        }
        assert!(std::time::Instant::now() < deadline, "elapsed_secs stood still at {first}");
    };
    assert!(elapsed(&later) > elapsed(&first), "{first} then {later}");
    // The text says the same seconds as the number.
    // (the number is rounded to the millisecond, the text cut to the second).
    let text = later["text"].as_str().unwrap();
    assert!(text.starts_with("loading 2/9 weights · "), "{later}");
    let secs = elapsed(&later) as u64;
    assert!([secs, secs.saturating_sub(1)].iter().any(|s| text.contains(&format!(" · {s}s "))), "{later}");
    assert_eq!(w.stop(), 0);
}

/// Issue 48: each ready load of a known setup keeps what its estimate said
/// at 25, 50 and 75 % of its real duration and the error; `loads show`
/// prints them; the load under way carries the expected error from them,
/// in the status document and in `STATUS=`.
#[test]
fn each_load_keeps_what_its_estimate_said_and_the_next_carries_the_expected_error() {
    let mut w = Warden::start(|d, p| {
        // The compile cache is there from the first load on: loads alike,
        // until it is taken away.
        let aot = d.join("cache/aot");
        std::fs::create_dir_all(aot.parent().unwrap()).unwrap();
        std::fs::write(&aot, b"aot").unwrap();
        let args = ["--shards", "3", "--compile-cache", aot.to_str().unwrap(), "--compile-time", "5s"];
        config(d, p, &args, "", FAST)
    });
    for _ in 0..3 {
        w.wait_ready();
        let ready = w.wait_note("ready", |n| n.starts_with("STATUS=ready: pid "));
        kill_child(&ready);
    }
    // Load 4 compiles for 5 s, silent: the status document stays on it.
    std::fs::remove_file(w.path("cache/aot")).unwrap();
    w.wait_for_file("status.json", |w| {
        std::fs::read_to_string(w.path("status.json"))
            .ok()
            .and_then(|t| serde_json::from_str::<serde_json::Value>(&t).ok())
            .is_some_and(|d| d["load"]["expected_error"].is_number())
    });
    let doc: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(w.path("status.json")).unwrap()).unwrap();
    let expected = doc["load"]["expected_error"].as_f64().unwrap();
    assert!(expected.is_finite() && expected >= 0.0, "{doc}");
    let text = doc["load"]["text"].as_str().unwrap();
    assert!(text.contains(" ±") && text.contains(" (last "), "{doc}");
    w.wait_note("the expected error in STATUS=", |n| n.starts_with("STATUS=loading ") && n.contains("% (last "));
    w.wait_ready();
    assert_eq!(w.stop(), 0);

    // The ledger: the first load had nothing to go by; the others kept
    // their estimate at a quarter, half and three quarters.
    let ledger = std::fs::read_to_string(w.path("state/loads.jsonl")).unwrap();
    let records: Vec<serde_json::Value> = ledger.lines().map(|l| serde_json::from_str(l).unwrap()).collect();
    assert_eq!(records.len(), 4, "{ledger}");
    assert!(records[0].get("estimates").is_none(), "{ledger}");
    for r in &records[1..] {
        let total = r["total_secs"].as_f64().unwrap();
        let at: Vec<f64> = r["estimates"].as_array().unwrap().iter().map(|e| e["at"].as_f64().unwrap()).collect();
        assert_eq!(at, [0.25, 0.5, 0.75], "{r}");
        for e in r["estimates"].as_array().unwrap() {
            let (elapsed, expected, error) = (
                e["elapsed_secs"].as_f64().unwrap(),
                e["expected_secs"].as_f64().unwrap(),
                e["error"].as_f64().unwrap(),
            );
            assert!((elapsed - e["at"].as_f64().unwrap() * total).abs() < 1e-6, "{r}");
            // Never less than the time already spent.
            assert!(expected >= elapsed, "{r}");
            assert!((error - (expected - total) / total).abs() < 1e-9, "{r}");
        }
    }
    let show = loads(&w, &["show", "3"]);
    for at in ["25%", "50%", "75%"] {
        assert!(show.lines().any(|l| l.starts_with(&format!("estimate at {at}: ")) && l.contains("(error ")), "{show}");
    }
    let table = loads(&w, &["list"]);
    assert!(table.lines().next().unwrap().contains(" EST@50% "), "{table}");
}
