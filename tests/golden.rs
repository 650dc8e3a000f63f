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
    w.wait_logged("golden-mismatch");
    assert_eq!(w.stop(), 0);
}

/// 32 prompts of 2 000 tokens each (the simulated engine at once), the
/// setup changed by `child.env` only (the same answers).
fn long_config(d: &std::path::Path, p: u16, setup: u32) -> String {
    let prompts: Vec<String> = (0..32).map(|i| format!("\"prompt {i}\"")).collect();
    let extra =
        format!("{FAST}[golden]\non-mismatch = \"fail\"\nmax-tokens = 2000\nprompts = [{}]\n", prompts.join(", "));
    let setup = format!("env = {{ SETUP = \"{setup}\" }}");
    config(d, p, &["--shards", "1", "--token-time", "0s"], &setup, &extra)
}

/// The store at 32 answers of 2 000 tokens over five setups: each setup's
/// answers recorded, the store within what is read (it used to outgrow
/// its read cap at the third setup: "EOF while parsing" on every start,
/// exit 75 with "fail"), and `golden show` and `accept` work.
#[test]
fn the_store_keeps_working_with_32_answers_of_2000_tokens_over_five_setups() {
    let mut w = Warden::start(|d, p| long_config(d, p, 1));
    for setup in 1..=6 {
        if setup > 1 {
            // The sixth is the first again: compared with its own reference.
            let again = if setup == 6 { 1 } else { setup };
            std::fs::write(w.path("t.toml"), long_config(&w.path(""), w.port, again)).unwrap();
            w.spawn();
        }
        w.wait_ready();
        let d = doc(&w);
        let want = if setup == 1 { "recorded" } else { "same" };
        assert_eq!(d["golden"]["verdict"], want, "setup {setup}: {d}");
        assert!(d["golden"]["text"].as_str().unwrap().contains("(32 prompt(s), "), "{d}");
        assert_eq!(w.stop(), 0);
    }
    let store = w.path("state").join("golden").join("references.json");
    let size = std::fs::metadata(&store).unwrap().len();
    assert!(size <= vllm_warden::observe::golden::MAX_STORE, "{size}");
    let refs: serde_json::Value = serde_json::from_slice(&std::fs::read(&store).unwrap()).unwrap();
    let refs = refs.as_array().unwrap();
    assert_eq!(refs.len(), 5, "one reference per setup");
    assert!(refs.iter().all(|r| r["answers"]["answers"][31]["tokens"].as_array().unwrap().len() == 2000));
    let (ok, show) = golden(&w, "show");
    assert!(ok && show.starts_with("last check: same at "), "{show}");
    assert_eq!(show.matches("reference of setup ").count(), 5, "{show}");
    let (ok, said) = golden(&w, "accept");
    assert!(ok, "{said}");
}

/// A store that cannot be read is a warning, the run ready even with
/// "fail", the file left as it is; `golden accept` sets it aside and
/// begins a new store with the last answers, which the next start finds.
#[test]
fn a_corrupt_store_is_a_warning_and_golden_accept_replaces_it() {
    let mut w = Warden::start(|d, p| golden_config(d, p, 1, "fail"));
    w.wait_ready();
    assert_eq!(doc(&w)["golden"]["verdict"], "recorded", "{}", doc(&w));
    assert_eq!(w.stop(), 0);
    let golden_dir = w.path("state").join("golden");
    std::fs::write(golden_dir.join("references.json"), "[{\"fingerprint\": \"cut sh").unwrap();

    w.drain_notes();
    w.spawn();
    w.wait_ready();
    let ready = w.wait_note("ready", |n| n.starts_with("STATUS=ready: pid "));
    assert!(ready.contains("; WARNING: answers not compared: the golden references are unreadable ("), "{ready}");
    assert!(ready.contains("EOF while parsing"), "{ready}");
    assert_eq!(doc(&w)["golden"]["verdict"], "unrecorded", "{}", doc(&w));
    assert_eq!(doc(&w)["last_failure"], serde_json::Value::Null, "{}", doc(&w));
    assert_eq!(w.stop(), 0);
    let kept = std::fs::read_to_string(golden_dir.join("references.json")).unwrap();
    assert_eq!(kept, "[{\"fingerprint\": \"cut sh", "left as it is");

    // `show` shows the last check and says the store is unreadable.
    let (ok, show) = golden(&w, "show");
    assert!(!ok && show.starts_with("last check: unrecorded at "), "{show}");
    let (ok, said) = golden(&w, "accept");
    assert!(ok, "{said}");
    assert!(said.starts_with("the golden references were unreadable ("), "{said}");
    assert!(said.contains("set aside as golden/references.json.unreadable"), "{said}");
    assert_eq!(std::fs::read_to_string(golden_dir.join("references.json.unreadable")).unwrap(), kept);

    w.drain_notes();
    w.spawn();
    w.wait_ready();
    assert_eq!(doc(&w)["golden"]["verdict"], "same", "{}", doc(&w));
    assert_eq!(w.stop(), 0);
    let (ok, show) = golden(&w, "show");
    assert!(ok && show.starts_with("last check: same at "), "{show}");
}
