//! Recovering by itself, with the real binary and the simulated vLLM, which
//! fails with vLLM's own memory-fit errors: memory fit moves the argument
//! the error asks for, the fitted value reaching ready is pinned and used
//! from the first try by the next warden; a reload to a setup that fails
//! for good is replaced by the last-known-good, which serves, said in the
//! status document with both fingerprints; without `[rollback]`, exit 78.

mod common;

use common::*;

const FAST: &str = "[restart]\ninitial-delay = \"0s\"\npermanent-attempts = 1\n[golden]\nenabled = false\n";

fn doc(w: &Warden) -> serde_json::Value {
    serde_json::from_str(&std::fs::read_to_string(w.path("status.json")).unwrap()).unwrap()
}

#[test]
fn a_kv_cache_too_small_is_fitted_pinned_and_used_at_once_next_time() {
    let make = |d: &std::path::Path, p: u16| {
        let extra = format!("{FAST}[fit]\nenabled = true\nmin-model-len = 1024\n");
        config(d, p, &["--shards", "1", "--max-model-len", "100000", "--kv-cache-tokens", "70000"], "", &extra)
    };
    let mut w = Warden::start(make);
    let moved = w.wait_note("memory fit's move", |n| n.starts_with("STATUS=memory fit 1/3"));
    assert_eq!(
        moved,
        "STATUS=memory fit 1/3: the KV cache cannot hold one request of 100000 tokens (vLLM estimates 70000 fit); restarting with --max-model-len 69632 (was 100000: vLLM estimates 70000 tokens fit, rounded down to a multiple of 1024)"
    );
    w.wait_ready();
    let ready = w.wait_note("the ready status", |n| n.starts_with("STATUS=ready: "));
    assert!(ready.ends_with("; --max-model-len 69632 (fitted)"), "{ready}");
    let d = doc(&w);
    assert_eq!(d["fit"]["max-model-len"], serde_json::json!({"value": "69632", "source": "fitted"}), "{d}");
    // The child ran with the value, as its one setting of the flag (the
    // log is written off the loop: it may come after the notification).
    w.wait_for_file("warden.stderr", |w| {
        w.stderr().contains("memory fit: --max-model-len 69632 reached ready; pinned for setup ")
    });
    let stderr = w.stderr();
    assert!(stderr.contains("--kv-cache-tokens 70000 --max-model-len 69632 (env:"), "{stderr}");
    // Every event of memory fit carries its MESSAGE_ID, the pin too.
    let fit_id = format!("MESSAGE_ID=\"{}\"", vllm_warden::supervisor::events::FIT_MESSAGE_ID);
    let fits: Vec<&str> = stderr.lines().filter(|l| l.contains("EVENT=\"fit\"")).collect();
    assert_eq!(fits.len(), 2, "{stderr}");
    assert!(fits.iter().all(|l| l.contains(&fit_id)), "{fits:?}");
    assert_eq!(w.stop(), 0);
    let ledger = std::fs::read_to_string(w.path("state/loads.jsonl")).unwrap();
    let last: serde_json::Value = serde_json::from_str(ledger.lines().last().unwrap()).unwrap();
    assert_eq!(last["fit"]["max-model-len"], "69632", "{last}");

    // The next warden: pinned, ready at the first try.
    w.drain_notes();
    let from = w.notes.len();
    w.spawn();
    w.wait_ready();
    assert!(!w.notes[from..].iter().any(|n| n.starts_with("STATUS=memory fit")), "{:?}", &w.notes[from..]);
    let d = doc(&w);
    assert_eq!(d["fit"]["max-model-len"]["source"], "pinned", "{d}");
    assert_eq!(d["restarts"], 0, "{d}");
    let (ok, status) = w.cli(&["status"]);
    assert!(ok && status.contains("memory fit: --max-model-len 69632 (pinned)"), "{status}");
    assert_eq!(w.stop(), 0);
}

#[test]
fn a_move_past_its_bound_ends_the_warden_saying_why() {
    let make = |d: &std::path::Path, p: u16| {
        let extra = format!("{FAST}[fit]\nenabled = true\nmax-utilization = 0.92\n");
        config(d, p, &["--shards", "1", "--kv-cache-needs", "0.95"], "", &extra)
    };
    let mut w = Warden::start(make);
    w.wait_note("the raise", |n| n.contains("restarting with --gpu-memory-utilization 0.92 (was 0.9"));
    assert_eq!(w.wait_exit(), 78);
    let cause = doc(&w)["cause"].as_str().unwrap().to_string();
    assert!(
        cause.ends_with("memory fit cannot help: --gpu-memory-utilization 0.92 is at `fit.max-utilization` 0.92"),
        "{cause}"
    );
}

/// A good setup, then a reload to one whose start fails for good.
fn rollback(enabled: bool) -> Warden {
    let make = move |d: &std::path::Path, p: u16, bad: bool| {
        let extra = format!("{FAST}[rollback]\nenabled = {enabled}\n");
        let fail: &[&str] = if bad { &["--fail", "kv-cache"] } else { &[] };
        config(d, p, &[&["--shards", "1"], fail].concat(), "", &extra)
    };
    let mut w = Warden::start(move |d, p| make(d, p, false));
    w.wait_ready();
    let dir = w.path("");
    std::fs::write(w.path("t.toml"), make(&dir, w.port, true)).unwrap();
    w.signal(nix::sys::signal::Signal::SIGHUP);
    w
}

#[test]
fn a_changed_setup_that_fails_for_good_is_replaced_by_the_last_known_good() {
    let mut w = rollback(true);
    let said = w.wait_note("the rollback", |n| n.starts_with("STATUS=the new setup "));
    assert!(said.contains(" failed: NotImplementedError: Currently supported kv cache quantization"), "{said}");
    w.wait_ready();
    let ready = w.wait_note("the ready status", |n| n.starts_with("STATUS="));
    assert!(ready.starts_with("STATUS=serving last-known-good from "), "{ready}");
    assert!(ready.contains("; the new setup failed: NotImplementedError: "), "{ready}");
    let d = doc(&w);
    assert_eq!(d["setup"], "last-known-good", "{d}");
    let (failed, good) = (d["rollback"]["failed"].as_str().unwrap(), d["rollback"]["good"].as_str().unwrap());
    assert_ne!(failed, good);
    assert_eq!(d["fingerprint"], good, "{d}");
    // The failed setup against the good one.
    let (ok, diff) = w.cli(&["setups", "diff", good, failed]);
    assert!(ok && diff.contains("command: ") && diff.contains("--fail kv-cache"), "{diff}");
    // Without arguments: the last-known-good against the setup that failed.
    let (ok, plain) = w.cli(&["setups", "diff"]);
    assert!(ok && plain == diff, "{plain}");
    let (ok, list) = w.cli(&["setups"]);
    assert!(ok && list.starts_with(good) && list.lines().next().unwrap().ends_with("last-known-good"), "{list}");
    w.wait_for_file("warden.stderr", |w| w.stderr().contains("starting the last-known-good setup"));

    // The operator's config again, fixed: the rollback is over.
    let d2 = w.path("");
    let fixed = config(&d2, w.port, &["--shards", "2"], "", &format!("{FAST}[rollback]\nenabled = true\n"));
    std::fs::write(w.path("t.toml"), fixed).unwrap();
    w.signal(nix::sys::signal::Signal::SIGHUP);
    w.wait_ready();
    let d = doc(&w);
    assert_eq!(d["setup"], "configured", "{d}");
    assert!(d.get("rollback").is_none(), "{d}");
    assert_eq!(w.stop(), 0);
}

#[test]
fn without_rollback_a_failed_setup_ends_the_warden_as_before() {
    let mut w = rollback(false);
    assert_eq!(w.wait_exit(), 78);
    assert!(!w.statuses().iter().any(|s| s.contains("last-known-good")));
}

#[test]
fn a_patch_that_breaks_the_model_is_undone_and_the_good_setup_patched_again() {
    let make = |d: &std::path::Path, p: u16, bad: bool| {
        let model = d.join("model");
        if !model.exists() {
            std::fs::create_dir_all(&model).unwrap();
            std::fs::write(model.join("config.json"), "{\n  \"rope_theta\": 10000.0,\n  \"vocab_size\": 2048\n}\n")
                .unwrap();
        }
        let file = model.join("config.json");
        let set = if bad {
            "{ rope_theta = 500000.0, quantization_config = { kv_cache_scheme = { num_bits = 4 } } }"
        } else {
            "{ rope_theta = 500000.0 }"
        };
        let extra =
            format!("{FAST}[rollback]\nenabled = true\n[[patch]]\nfile = \"{}\"\nset = {set}\n", file.display());
        config(d, p, &["--shards", "1", "--model", model.to_str().unwrap()], "", &extra)
    };
    let mut w = Warden::start(move |d, p| make(d, p, false));
    w.wait_ready();
    let good = std::fs::read(w.path("model/config.json")).unwrap();
    assert!(String::from_utf8_lossy(&good).contains("500000"));
    let dir = w.path("");
    std::fs::write(w.path("t.toml"), make(&dir, w.port, true)).unwrap();
    w.signal(nix::sys::signal::Signal::SIGHUP);
    w.wait_note("the rollback", |n| n.starts_with("STATUS=the new setup "));
    w.wait_ready();
    assert_eq!(doc(&w)["setup"], "last-known-good");
    // The good setup's file, byte for byte: the bad patch undone, the
    // good one made again from the original.
    assert_eq!(std::fs::read(w.path("model/config.json")).unwrap(), good);
    let d = doc(&w);
    let (ok, diff) =
        w.cli(&["setups", "diff", d["rollback"]["good"].as_str().unwrap(), d["rollback"]["failed"].as_str().unwrap()]);
    assert!(ok && diff.contains("patched ") && diff.contains("config.json"), "{diff}");
    assert_eq!(w.stop(), 0);
}
