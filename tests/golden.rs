//! The golden check with the real binary and the simulated vLLM, whose
//! answers are a hash of a JSON file the config patches: a reference at
//! the first ready, the same answers after a restart, a patch that changes
//! them caught before `READY=1`, `golden diff`, `golden accept`.

mod common;

use common::*;

const FAST: &str = "[restart]\ninitial-delay = \"0s\"\npermanent-attempts = 1\n";

/// A config whose simulated model answers from `weights.json`, patched
/// to `value`; with `on_mismatch`.
fn golden_config(d: &std::path::Path, p: u16, value: u32, on_mismatch: &str) -> String {
    let weights = d.join("weights.json");
    if !weights.exists() {
        std::fs::write(&weights, "{\"rms_norm_eps\": 1e-06}\n").unwrap();
    }
    let w = weights.to_str().unwrap();
    let extra = format!(
        "{FAST}[golden]\non-mismatch = \"{on_mismatch}\"\nprompts = [\"one\", \"two\"]\n[[patch]]\nfile = \"{w}\"\nset = {{ rms_norm_eps = {value} }}\n"
    );
    config(d, p, &["--shards", "1", "--answers-from", w], "", &extra)
}

fn doc(w: &Warden) -> serde_json::Value {
    serde_json::from_str(&std::fs::read_to_string(w.path("status.json")).unwrap()).unwrap()
}

fn golden(w: &Warden, what: &str) -> (bool, String) {
    w.cli(&["golden", what])
}

#[test]
fn answers_are_recorded_kept_and_a_patch_that_changes_them_is_caught_before_ready() {
    let mut w = Warden::start(|d, p| golden_config(d, p, 1, "fail"));
    w.wait_ready();
    assert_eq!(doc(&w)["golden"]["verdict"], "recorded", "{}", doc(&w));
    assert_eq!(w.stop(), 0);
    // Again, the same setup: the same answers.
    w.spawn();
    w.wait_ready();
    assert_eq!(doc(&w)["golden"]["verdict"], "same", "{}", doc(&w));
    assert_eq!(w.stop(), 0);
    let (ok, nothing) = golden(&w, "diff");
    assert!(ok, "{nothing}");

    // A patch that changes the model's arithmetic: another setup, other
    // answers; failed before READY=1, its report with both answers.
    std::fs::write(w.path("t.toml"), golden_config(&w.path(""), w.port, 2, "fail")).unwrap();
    w.drain_notes();
    let from = w.notes.len();
    w.spawn();
    assert_eq!(w.wait_exit(), 78, "permanent after one try");
    w.drain_notes();
    assert!(!w.notes[from..].iter().any(|n| n == "READY=1"), "{:?}", &w.notes[from..]);
    let d = doc(&w);
    assert_eq!(d["golden"]["verdict"], "changed", "{d}");
    let cause = d["cause"].as_str().unwrap();
    assert!(cause.contains("answers changed after patched "), "{cause}");
    assert!(cause.contains("weights.json"), "{cause}");
    assert_eq!(d["last_failure"]["class"], "wrong_answers", "{d}");
    let report = std::path::PathBuf::from(d["last_failure"]["report"].as_str().unwrap());
    wait_for_file(&report.join("golden.txt"), || report.join("golden.txt").exists());
    let side = std::fs::read_to_string(report.join("golden.txt")).unwrap();
    assert!(side.contains("prompt: \"one\"") && side.contains("≠ token"), "{side}");
    let (ok, diff) = golden(&w, "diff");
    assert!(ok && diff.contains("≠ token") && diff.starts_with("answers changed after "), "{diff}");

    // Accepted: the next start passes.
    let (ok, said) = golden(&w, "accept");
    assert!(ok, "{said}");
    w.drain_notes();
    w.spawn();
    w.wait_ready();
    assert_eq!(doc(&w)["golden"]["verdict"], "same", "{}", doc(&w));
    let prom = std::fs::read_to_string(w.path("vllm_warden.prom")).unwrap();
    assert!(prom.contains("vllm_warden_golden_checks_total{name=\"t\",verdict=\"same\"} 1"), "{prom}");
    assert_eq!(w.stop(), 0);
    let (ok, show) = golden(&w, "show");
    assert!(ok && show.starts_with("last check: same at "), "{show}");
}

#[test]
fn with_warn_changed_answers_are_ready_with_a_warning() {
    let mut w = Warden::start(|d, p| golden_config(d, p, 1, "warn"));
    w.wait_ready();
    assert_eq!(w.stop(), 0);
    std::fs::write(w.path("t.toml"), golden_config(&w.path(""), w.port, 3, "warn")).unwrap();
    w.drain_notes();
    w.spawn();
    w.wait_ready();
    let ready = w.wait_note("ready", |n| n.starts_with("STATUS=ready: pid "));
    assert!(ready.contains("; WARNING: answers changed after patched "), "{ready}");
    assert!(w.stderr().contains("golden-mismatch"), "the journal's event");
    assert_eq!(w.stop(), 0);
}
