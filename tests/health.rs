//! Liveness after ready and reload, with the real binary and the fake vLLM.

mod common;

use common::{Warden, config};
use nix::sys::signal::Signal;

const FAST: &str = "[restart]\ninitial-delay = \"0s\"\n";

#[test]
fn a_health_endpoint_turning_503_restarts_the_child() {
    let mut w = Warden::start(|d, p| {
        let health = "[health]\ninterval = \"100ms\"\ntimeout = \"1s\"\nfailures = 3\n";
        config(d, p, &["--shards", "1", "--unhealthy-after", "300ms"], "", &format!("{FAST}{health}"))
    });
    w.wait_ready();
    let restarting = w.wait_note("restart", |n| n.starts_with("STATUS=restarting in"));
    assert!(
        restarting.ends_with("(attempt 2/10): health check failed 3 times: 503 Service Unavailable"),
        "{restarting}"
    );
    w.wait_ready();
    assert_eq!(w.stop(), 0);
}

#[test]
fn a_canary_that_hangs_counts_as_a_failed_check() {
    let mut w = Warden::start(|d, p| {
        let health =
            "[health]\ninterval = \"100ms\"\nfailures = 1\ncanary-interval = \"100ms\"\ncanary-timeout = \"300ms\"\n";
        // The golden check would meet the same hang first, and a server
        // that gives no answer is not ready (tests/recheck.rs): off here,
        // where the canary is what is tested.
        let golden = "[golden]\nenabled = false\n";
        config(d, p, &["--shards", "1", "--hang-completions"], "", &format!("{FAST}{health}{golden}"))
    });
    w.wait_ready();
    let restarting = w.wait_note("restart", |n| n.starts_with("STATUS=restarting in"));
    assert!(restarting.ends_with("health check failed 1 times: canary: no completion within 300ms"), "{restarting}");
    assert_eq!(w.stop(), 0);
}

fn child_pid(w: &Warden) -> i32 {
    let doc: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(w.path("status.json")).unwrap()).unwrap();
    doc["child_pid"].as_i64().unwrap() as i32
}

#[test]
fn reload_with_a_broken_config_keeps_the_child_and_a_valid_one_restarts_it() {
    let mut w = Warden::start(|d, p| config(d, p, &["--shards", "1"], "env = { MARKER = \"1\" }", FAST));
    w.wait_ready();
    let first = child_pid(&w);
    let good = std::fs::read_to_string(w.path("t.toml")).unwrap();

    std::fs::write(w.path("t.toml"), good.replace("[child]", "[child]\nstop-timeout = \"soon\"")).unwrap();
    w.signal(Signal::SIGHUP);
    let refused = w.wait_note("refused", |n| n.starts_with("STATUS=reload refused"));
    assert!(
        refused.contains("1 problem in the new one") && refused.contains("`stop-timeout`: invalid duration"),
        "{refused}"
    );
    assert_eq!(child_pid(&w), first, "the child is untouched");
    assert!(std::path::Path::new(&format!("/proc/{first}")).exists());
    // Every problem is logged (the log is written off the loop: it may
    // come after the notification).
    w.wait_for_file("warden.stderr", |w| w.stderr().contains("t.toml:"));

    std::fs::write(w.path("t.toml"), good.replace("MARKER = \"1\"", "MARKER = \"2\"")).unwrap();
    w.signal(Signal::SIGHUP);
    w.wait_note("reloading", |n| n.starts_with("STATUS=reloading: stopping pid"));
    w.wait_ready();
    let second = child_pid(&w);
    assert_ne!(second, first);
    let environ = String::from_utf8_lossy(&std::fs::read(format!("/proc/{second}/environ")).unwrap()).into_owned();
    assert!(environ.split('\0').any(|v| v == "MARKER=2"), "the new environment: {environ}");
    assert_eq!(w.stop(), 0);
}

/// Issue "eyes after ready": a wedged engine under traffic keeps `/health`
/// at 200; its own metrics show requests in flight and no token moving.
#[test]
fn a_wedged_engine_under_traffic_is_caught_from_its_metrics_and_restarted() {
    let mut w = Warden::start(|d, p| {
        let health = "[health]\ninterval = \"100ms\"\nprogress-stall = \"1s\"\ncanary-interval = \"0s\"\n";
        config(d, p, &["--shards", "1", "--wedge-on-usr2"], "", &format!("{FAST}{health}"))
    });
    w.wait_ready();
    let leader = w.descendants().iter().find(|p| p.ppid == w.pid as i32).unwrap().pid;
    let url = format!("http://127.0.0.1:{}/v1/completions", w.port);
    // A long request, in flight when the engine wedges (or arriving after:
    // either way it is counted as running and no token moves).
    std::thread::spawn(move || {
        let body = serde_json::json!({"model": "tiny-llama", "prompt": "Hi", "max_tokens": 100000});
        let _ = common::http::post_json(&url, &body, common::http::FOREVER);
    });
    nix::sys::signal::kill(nix::unistd::Pid::from_raw(leader), Signal::SIGUSR2).unwrap();
    let failed = w.wait_note("the stall", |n| n.starts_with("STATUS=failed"));
    assert!(failed.ends_with("engine stalled: 1 running, 0 waiting, no token for 1s"), "{failed}");
    w.wait_ready();
    assert_eq!(w.stop(), 0);
}

/// Issue "eyes after ready", GPU faults: a fatal Xid in the kernel's
/// messages ends the run for good (exit 78), naming the GPU; no restart
/// loop against a dead GPU. The source is a FIFO the test writes into.
#[test]
fn a_fatal_gpu_fault_in_the_kernel_messages_stops_the_restart_loop() {
    let dir = tempfile::tempdir().unwrap();
    let fifo = dir.path().join("kmsg");
    nix::unistd::mkfifo(&fifo, nix::sys::stat::Mode::from_bits_truncate(0o600)).unwrap();
    let source = format!("[health]\nkernel-messages = [\"cat\", \"{}\"]\n", fifo.display());
    let mut w = Warden::start(|d, p| config(d, p, &["--shards", "1"], "", &format!("{FAST}{source}")));
    w.wait_ready();
    let tree = w.descendants();
    // Opening blocks until the follower reads: no line can be missed.
    let mut kmsg = std::fs::OpenOptions::new().write(true).open(&fifo).unwrap();
    // A `/dev/kmsg` record of the kernel's (facility 0, level 4).
    std::io::Write::write_all(
        &mut kmsg,
        b"4,1234,5678901,-;NVRM: Xid (PCI:0000:41:00): 79, pid=1234, name=python3, GPU has fallen off the bus.\n",
    )
    .unwrap();
    assert_eq!(w.wait_exit(), 78);
    let last = w.statuses().last().unwrap().to_string();
    assert_eq!(
        last,
        "failed permanently: GPU fault: Xid 79 (GPU has fallen off the bus) on 0000:41:00.0 — needs a reset or reboot"
    );
    assert!(tree.iter().all(common::gone), "the tree is stopped: {tree:?}");
    assert_eq!(w.log().matches("--- vllm-warden: start").count(), 1, "no restart");
}

/// Issue 56 (B4): a fatal Xid naming another GPU ended this instance for
/// good, although the non-fatal ones were filtered to its own GPUs. With
/// the instance's GPUs told (`nvidia-smi`, a stand-in on `PATH`, says GPU 0
/// is at 0000:41:00.0), an Xid 48 on 0000:5e:00 is said and does nothing;
/// the Xid 79 on its own GPU that follows ends the run, naming it (before:
/// the first, on the other GPU, ended it: exit 78 on 0000:5e:00.0).
#[test]
fn a_fatal_gpu_fault_on_another_gpu_leaves_the_instance_running() {
    let bin = tempfile::tempdir().unwrap();
    let smi = bin.path().join("nvidia-smi");
    std::fs::write(
        &smi,
        "#!/bin/sh\ncase \"$*\" in *--query-gpu=index,uuid,pci.bus_id*) echo '0, GPU-aaaa-1111, 00000000:41:00.0';; esac\n",
    )
    .unwrap();
    std::fs::set_permissions(&smi, std::os::unix::fs::PermissionsExt::from_mode(0o755)).unwrap();
    let path = format!("{}:{}", bin.path().display(), std::env::var("PATH").unwrap_or_default());
    let dir = tempfile::tempdir().unwrap();
    let fifo = dir.path().join("kmsg");
    nix::unistd::mkfifo(&fifo, nix::sys::stat::Mode::from_bits_truncate(0o600)).unwrap();
    let source = format!("[health]\nkernel-messages = [\"cat\", \"{}\"]\n", fifo.display());
    // Its own stand-in, not the harness's (which answers as a host without
    // GPUs would).
    let opts = common::Opts { env: vec![("PATH".into(), path)], host_tools: true, ..Default::default() };
    let mut w = Warden::start_with(|d, p| config(d, p, &["--shards", "1"], "", &format!("{FAST}{source}")), opts);
    w.wait_ready();
    w.wait_logged("the instance's GPUs, for the kernel's messages told=Some([\"0000:41:00.0\"])");
    let mut kmsg = std::fs::OpenOptions::new().write(true).open(&fifo).unwrap();
    std::io::Write::write_all(
        &mut kmsg,
        b"4,1,1000000,-;NVRM: Xid (PCI:0000:5e:00): 48, pid='<unknown>', name=<unknown>, An uncorrectable double bit error (DBE) has been detected on GPU in the framebuffer at partition 0, subpartition 0.\n",
    )
    .unwrap();
    w.wait_logged("kernel: GPU fault: Xid 48 (double-bit ECC error) on 0000:5e:00.0 (not one of this instance's GPUs)");
    std::io::Write::write_all(
        &mut kmsg,
        b"4,2,2000000,-;NVRM: Xid (PCI:0000:41:00): 79, pid=1234, name=python3, GPU has fallen off the bus.\n",
    )
    .unwrap();
    assert_eq!(w.wait_exit(), 78);
    let last = w.statuses().last().unwrap().to_string();
    assert_eq!(
        last,
        "failed permanently: GPU fault: Xid 79 (GPU has fallen off the bus) on 0000:41:00.0 — needs a reset or reboot"
    );
}

/// Issue "change without reloading the model": a reload that changes only
/// the warden's own settings keeps the child, and the new health cadence
/// takes hold (here it finds the 503 the old one never looked for).
#[test]
fn a_reload_of_the_health_interval_keeps_the_child_and_changes_the_cadence() {
    let mut w = Warden::start(|d, p| {
        let health = "[health]\ninterval = \"1h\"\nfailures = 1\ncanary-interval = \"0s\"\n";
        config(d, p, &["--shards", "1", "--unhealthy-after", "3s"], "", &format!("{FAST}{health}"))
    });
    w.wait_ready();
    let first = child_pid(&w);
    let text = std::fs::read_to_string(w.path("t.toml")).unwrap();
    std::fs::write(w.path("t.toml"), text.replace("interval = \"1h\"", "interval = \"100ms\"")).unwrap();
    // What a reload would do, asked before it is done.
    let diff = w.command("check").arg("--diff").output().unwrap();
    let out = String::from_utf8_lossy(&diff.stdout);
    assert_eq!(diff.status.code(), Some(0), "{out}");
    // The verdict first, then what the reload would do.
    assert!(out.lines().next().unwrap().ends_with("is valid"), "{out}");
    assert_eq!(out.lines().nth(1), Some("reload: reloaded in place: health.interval 1h → 100ms"), "{out}");
    w.signal(Signal::SIGHUP);
    let reloaded = w.wait_note("in place", |n| n.starts_with("STATUS=reloaded in place"));
    assert_eq!(reloaded, "STATUS=reloaded in place: health.interval 1h → 100ms");
    assert_eq!(child_pid(&w), first, "the child is untouched");
    let failed = w.wait_note("the new cadence", |n| n.starts_with("STATUS=failed"));
    assert!(failed.ends_with("health check failed 1 times: 503 Service Unavailable"), "{failed}");
    assert_eq!(w.stop(), 0);
}
