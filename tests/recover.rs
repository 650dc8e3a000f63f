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
    assert!(ok && list.starts_with(good) && list.lines().next().unwrap().ends_with("newest"), "{list}");
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

/// The state directory is data, never a command.
mod state_is_data {
    use super::*;
    use nix::sys::signal::Signal;

    /// A record of setup `config` (its command `argv`) as the warden writes
    /// them, with the fingerprint anyone can compute, `at` the given time.
    fn forged_record(w: &Warden, argv: &[String], config: &str, at: &str) -> (String, String) {
        let facts = vllm_warden::tell::ledger::Facts::gather(argv, &Default::default(), &[], None);
        let record = serde_json::json!({
            "fingerprint": facts.fingerprint,
            "at": at,
            "config_file": w.path("t.toml"),
            "config": config,
            "setup": facts.setup,
        });
        (facts.fingerprint.clone(), serde_json::to_string_pretty(&record).unwrap())
    }

    /// The good setup ready and recorded; its fingerprint and config text.
    fn good_recorded(w: &mut Warden) -> (String, String) {
        w.wait_ready();
        let good = doc(w)["fingerprint"].as_str().unwrap().to_string();
        let record = format!("state/setups/{good}.json");
        w.wait_for_file(&record, |w| w.path(&record).exists());
        (good, std::fs::read_to_string(w.path("t.toml")).unwrap())
    }

    /// The config `text` with its command replaced by `argv`.
    fn with_command(text: &str, argv: &[String]) -> String {
        let quoted: Vec<String> = argv.iter().map(|a| format!("{a:?}")).collect();
        text.lines()
            .map(|l| if l.starts_with("command = ") { format!("command = [{}]", quoted.join(", ")) } else { l.into() })
            .collect::<Vec<_>>()
            .join("\n")
    }

    /// The reload to the setup that fails for good (`rollback(true)`'s).
    fn reload_to_the_bad_setup(w: &mut Warden) {
        let dir = w.path("");
        let extra = format!("{FAST}[rollback]\nenabled = true\n");
        std::fs::write(w.path("t.toml"), config(&dir, w.port, &["--shards", "1", "--fail", "kv-cache"], "", &extra))
            .unwrap();
        w.signal(Signal::SIGHUP);
    }

    fn good_config(d: &std::path::Path, p: u16) -> String {
        config(d, p, &["--shards", "1"], "", &format!("{FAST}[rollback]\nenabled = true\n"))
    }

    #[test]
    fn a_forged_setup_record_beside_the_real_one_never_runs_and_the_real_one_is_taken() {
        let mut w = Warden::start(good_config);
        let (good, text) = good_recorded(&mut w);
        // A newer record, its fingerprint computed as the warden does, whose
        // command would leave a mark and then serve as the model.
        let mark = w.path("pwned");
        let script = format!("echo PWNED >> {}; exec {} --port {} --shards 1", mark.display(), sim(), w.port);
        let argv: Vec<String> = vec!["/bin/sh".into(), "-c".into(), script];
        let (forged, json) = forged_record(&w, &argv, &with_command(&text, &argv), "2099-01-01T00:00:00Z");
        std::fs::write(w.path(&format!("state/setups/{forged}.json")), json).unwrap();

        reload_to_the_bad_setup(&mut w);
        let said = w.wait_note("the rollback", |n| n.starts_with("STATUS=the new setup "));
        assert!(said.contains(&format!("starting the last-known-good setup {good} from ")), "{said}");
        w.wait_ready();
        let d = doc(&w);
        assert_eq!((d["setup"].as_str(), d["fingerprint"].as_str()), (Some("last-known-good"), Some(good.as_str())));
        assert!(!w.stderr().contains("PWNED") && !w.stderr().contains("/bin/sh"), "the forged command ran");
        assert_eq!(w.stop(), 0);
        assert!(!mark.exists(), "the forged command ran");
    }

    #[test]
    fn a_record_naming_another_instance_is_skipped_and_the_real_last_known_good_taken() {
        let mut w = Warden::start(good_config);
        let (good, text) = good_recorded(&mut w);
        let argv: Vec<String> = vec![sim().into(), "--port".into(), w.port.to_string(), "--shards".into(), "2".into()];
        let other = with_command(&text, &argv).replace("name = \"t\"", "name = \"other\"");
        let (forged, json) = forged_record(&w, &argv, &other, "2099-01-01T00:00:00Z");
        std::fs::write(w.path(&format!("state/setups/{forged}.json")), json).unwrap();

        reload_to_the_bad_setup(&mut w);
        let said = w.wait_note("the rollback", |n| n.starts_with("STATUS=the new setup "));
        assert!(said.contains(&format!("starting the last-known-good setup {good} from ")), "{said}");
        w.wait_ready();
        assert_eq!(doc(&w)["fingerprint"], good.as_str());
        // What `setups` shows is this instance's.
        let (ok, list) = w.cli(&["setups"]);
        assert!(ok && !list.contains(&forged) && list.starts_with(&good), "{list}");
        assert_eq!(w.stop(), 0);
    }

    #[test]
    fn a_warden_started_again_rolls_back_to_nothing_it_did_not_see_ready() {
        let mut w = Warden::start(good_config);
        good_recorded(&mut w);
        assert_eq!(w.stop(), 0);
        // The next warden's config fails for good: the record of the last
        // warden's good setup is no command to it.
        let dir = w.path("");
        let extra = format!("{FAST}[rollback]\nenabled = true\n");
        std::fs::write(w.path("t.toml"), config(&dir, w.port, &["--shards", "1", "--fail", "kv-cache"], "", &extra))
            .unwrap();
        w.spawn();
        assert_eq!(w.wait_exit(), 78);
        assert!(!w.statuses().iter().any(|s| s.contains("last-known-good")), "{:?}", w.statuses());
    }

    /// The command lines of the spawns so far (the warden's `running …`).
    fn spawned(w: &Warden) -> Vec<String> {
        w.stderr()
            .lines()
            .filter(|l| l.contains("EVENT=\"spawn\""))
            .filter_map(|l| l.split_once("running ").map(|(_, c)| c.split(" (env:").next().unwrap().to_string()))
            .collect()
    }

    /// Start again with `fit` as `[fit]` and `pins` as the setup's pins;
    /// ready; the command line the simulator got.
    fn start_with_pins(w: &mut Warden, fp: &str, fit: &str, pins: &str) -> String {
        let dir = w.path("");
        let c = config(&dir, w.port, &["--shards", "1", "--max-model-len", "8192"], "", &format!("{FAST}{fit}"));
        std::fs::write(w.path("t.toml"), c).unwrap();
        std::fs::write(w.path("state/fit-pins.json"), format!("{{\"{fp}\": {pins}}}")).unwrap();
        let before = spawned(w).len();
        w.spawn();
        w.wait_ready();
        w.wait_for_file("warden.stderr", |w| spawned(w).len() > before);
        let cmd = spawned(w).pop().unwrap();
        assert_eq!(w.stop(), 0);
        cmd
    }

    /// A warden of the setup whose pins the tests plant, stopped once it
    /// served: its fingerprint.
    fn pinned_setup() -> (Warden, String) {
        let mut w = Warden::start(|d, p| config(d, p, &["--shards", "1", "--max-model-len", "8192"], "", FAST));
        w.wait_ready();
        let fp = doc(&w)["fingerprint"].as_str().unwrap().to_string();
        assert_eq!(w.stop(), 0);
        (w, fp)
    }

    const ON: &str = "[fit]\nenabled = true\nmin-model-len = 1024\n";

    #[test]
    fn pins_within_fit_and_its_bounds_are_used() {
        let (mut w, fp) = pinned_setup();
        let cmd = start_with_pins(&mut w, &fp, ON, r#"{"max-model-len": "4096", "gpu-memory-utilization": "0.6"}"#);
        assert!(cmd.contains("--max-model-len 4096 --gpu-memory-utilization 0.6"), "{cmd}");
        assert!(!w.stderr().contains("is not used"), "{}", w.stderr());
    }

    #[test]
    fn a_pin_is_not_used_with_fit_off() {
        let (mut w, fp) = pinned_setup();
        let cmd = start_with_pins(&mut w, &fp, "", r#"{"max-model-len": "2048"}"#);
        assert!(cmd.ends_with("--max-model-len 8192"), "{cmd}");
        let said = format!("the pin --max-model-len \"2048\" of setup {fp} is not used: `fit.enabled` is off");
        w.wait_logged(&said);
    }

    #[test]
    fn a_pin_of_an_argument_outside_fit_adjust_is_not_used() {
        let (mut w, fp) = pinned_setup();
        let only = format!("{ON}adjust = [\"gpu-memory-utilization\"]\n");
        let cmd = start_with_pins(&mut w, &fp, &only, r#"{"max-model-len": "4096"}"#);
        assert!(cmd.ends_with("--max-model-len 8192"), "{cmd}");
        w.wait_logged("`fit.adjust` does not allow --max-model-len");
    }

    #[test]
    fn pins_out_of_bounds_are_not_used() {
        let (mut w, fp) = pinned_setup();
        // Under `fit.min-utilization`; longer than the command's own length.
        let cmd = start_with_pins(&mut w, &fp, ON, r#"{"max-model-len": "16384", "gpu-memory-utilization": "0.01"}"#);
        assert!(cmd.ends_with("--max-model-len 8192") && !cmd.contains("--gpu-memory-utilization"), "{cmd}");
        let stderr = w.stderr();
        assert!(stderr.contains("the pin --gpu-memory-utilization \"0.01\" of setup"), "{stderr}");
        assert!(stderr.contains("outside `fit.min-utilization` 0.5 .. `fit.max-utilization` 0.95"), "{stderr}");
        assert!(stderr.contains("longer than the command's own --max-model-len 8192"), "{stderr}");
    }

    #[test]
    fn an_unparsable_pin_is_not_used_and_named() {
        let (mut w, fp) = pinned_setup();
        // vLLM (and the simulator) would refuse its arguments at every start.
        let cmd = start_with_pins(&mut w, &fp, ON, r#"{"gpu-memory-utilization": "1.2.3"}"#);
        assert!(!cmd.contains("--gpu-memory-utilization"), "{cmd}");
        let stderr = w.stderr();
        assert!(stderr.contains("the pin --gpu-memory-utilization \"1.2.3\" of setup"), "{stderr}");
        assert!(stderr.contains("is not used: not a fraction"), "{stderr}");
    }

    #[test]
    fn a_pinned_start_that_fails_drops_its_pin_and_says_so() {
        // The first two starts fail, the third serves.
        let make = |d: &std::path::Path, p: u16| {
            let count = d.join("count");
            let args = ["--shards", "1", "--max-model-len", "8192", "--fail", "exit1", "--fail-times", "2"];
            let args = [&args[..], &["--count-file", count.to_str().unwrap()]].concat();
            config(d, p, &args, "", &format!("{FAST}[fit]\nenabled = true\nmin-model-len = 1024\n"))
        };
        let mut w = Warden::start(make);
        w.wait_ready();
        let fp = doc(&w)["fingerprint"].as_str().unwrap().to_string();
        assert_eq!(w.stop(), 0);
        std::fs::remove_file(w.path("count")).unwrap();
        std::fs::write(w.path("state/fit-pins.json"), format!("{{\"{fp}\": {{\"max-model-len\": \"4096\"}}}}"))
            .unwrap();
        let before = spawned(&w).len();
        w.spawn();
        w.wait_ready();
        w.wait_for_file("warden.stderr", |w| spawned(w).len() >= before + 3);
        let cmds = spawned(&w)[before..].to_vec();
        assert!(cmds[0].contains("--max-model-len 4096"), "{cmds:?}");
        assert!(cmds[1..].iter().all(|c| c.contains("--max-model-len 8192")), "{cmds:?}");
        let said = format!(
            "memory fit: the start with the pinned --max-model-len 4096 failed; the pin is dropped for setup {fp}"
        );
        w.wait_logged(&said);
        assert_eq!(w.stop(), 0);
        let pins = std::fs::read_to_string(w.path("state/fit-pins.json")).unwrap();
        assert!(!pins.contains("4096"), "{pins}");
    }
}
