//! `[preload]` with the real binary: the simulated `vllm preload` daemon
//! beside the simulated engine, which loads only from the daemon's
//! socket. Which child starts again after which failure, the order of the
//! stop, what a reload restarts, and a platform the daemon refuses.

mod common;

use common::{Warden, config, sim};
use nix::sys::signal::{Signal, kill};
use nix::unistd::Pid;

const FAST: &str = "[restart]\ninitial-delay = \"0s\"\n";

/// The engine: a `serve` command the daemon's is derived from.
fn engine(d: &std::path::Path, p: u16, extra_engine: &[&str], preload: &str) -> String {
    let stamps = d.join("stamps").display().to_string();
    // Loads long enough for their progress to reach `STATUS=` (a status
    // is held at most 250 ms behind a put-off write).
    let mut args = vec!["--shards", "2", "--shard-time", "300ms", "--stamp-file", &stamps];
    args.extend(extra_engine);
    let text = config(d, p, &args, "", FAST);
    // `vllm serve MODEL` as the simulator takes it.
    let text = text.replacen(&format!("{:?}, ", sim()), &format!("{:?}, \"serve\", \"/srv/models/tiny\", ", sim()), 1);
    format!(
        "{text}[preload]\nenabled = true\nhealth-port = {hp}\nsocket-dir = \"{d}/wc\"\n{preload}\n",
        hp = common::free_port(),
        d = d.display()
    )
}

/// The daemon's own command, stamping its starts beside the engine's.
fn daemon_command(d: &std::path::Path, extra: &[&str]) -> String {
    let stamps = d.join("stamps").display().to_string();
    let mut argv = vec![sim(), "preload", "--model", "/srv/models/tiny", "--shard-time", "20ms", "--stamp-file"];
    argv.push(&stamps);
    argv.extend(extra);
    let quoted: Vec<String> = argv.iter().map(|a| format!("{a:?}")).collect();
    format!("command = [{}]\n", quoted.join(", "))
}

fn doc(w: &Warden) -> serde_json::Value {
    std::fs::read_to_string(w.path("status.json")).ok().and_then(|t| serde_json::from_str(&t).ok()).unwrap_or_default()
}

/// The status document once it shows a ready engine beside a ready
/// daemon: (engine pid, daemon pid).
fn pids_when_ready(w: &mut Warden) -> (u32, u32) {
    w.wait_for_file("status.json", |w| {
        let d = doc(w);
        d["state"] == "ready" && d["preload"]["state"] == "ready"
    });
    let d = doc(w);
    (d["child_pid"].as_u64().unwrap() as u32, d["preload"]["pid"].as_u64().unwrap() as u32)
}

fn stamps(w: &Warden) -> Vec<String> {
    std::fs::read_to_string(w.path("stamps"))
        .unwrap_or_default()
        .lines()
        .filter_map(|l| l.split_whitespace().next().map(String::from))
        .collect()
}

fn count(w: &Warden, what: &str) -> usize {
    stamps(w).iter().filter(|s| *s == what).count()
}

fn alive(pid: u32) -> bool {
    vllm_warden::process::child::read_stat(pid as i32).is_some_and(|s| s.state != 'Z')
}

#[test]
fn the_daemon_starts_first_and_the_engine_loads_from_its_socket() {
    let mut w = Warden::start(|d, p| engine(d, p, &[], &daemon_command(d, &[])));
    w.wait_ready();
    let (_, daemon) = pids_when_ready(&mut w);
    assert_eq!(stamps(&w)[..3], ["preload-start", "preload-ready", "start"], "{:?}", stamps(&w));
    assert!(w.log().contains("Mapped 291 tensors (+0 aliases) from the weight cache daemon"), "{}", w.log());
    let preload_log = std::fs::read_to_string(w.path("t.preload.log")).unwrap();
    assert!(preload_log.contains("===== Weight cache daemon READY"), "{preload_log}");
    let full = w.statuses().iter().any(|s| s.contains(" · full start (a new weight-cache daemon loaded the weights)"));
    assert!(full, "{:?}", w.statuses());
    // The socket folder is the warden user's alone, as vLLM requires.
    use std::os::unix::fs::PermissionsExt;
    assert_eq!(std::fs::metadata(w.path("wc")).unwrap().permissions().mode() & 0o777, 0o700);
    // The ledger says which kind of start it was.
    // The record is written off the loop, after READY=1: wait for its line.
    w.wait_for_file("state/loads.jsonl", |w| {
        std::fs::read_to_string(w.path("state/loads.jsonl")).is_ok_and(|l| l.ends_with('\n'))
    });
    let ledger = std::fs::read_to_string(w.path("state/loads.jsonl")).unwrap();
    assert!(ledger.contains("\"preload\":{\"kind\":\"full\""), "{ledger}");
    assert_eq!(w.stop(), 0);
    assert!(!alive(daemon), "the daemon is stopped with the warden");
}

#[test]
fn an_engine_crash_restarts_the_engine_alone() {
    let mut w = Warden::start(|d, p| engine(d, p, &[], &daemon_command(d, &[])));
    w.wait_ready();
    let (engine_pid, daemon) = pids_when_ready(&mut w);
    kill(Pid::from_raw(engine_pid as i32), Signal::SIGKILL).unwrap();
    w.wait_ready();
    w.wait_for_file("status.json", |w| doc(w)["child_pid"].as_u64().is_some_and(|p| p as u32 != engine_pid));
    let (again, daemon_after) = pids_when_ready(&mut w);
    assert_ne!(again, engine_pid);
    assert_eq!(daemon_after, daemon, "the daemon holds the weights across the engine's restart");
    assert!(alive(daemon));
    assert_eq!((count(&w, "preload-start"), count(&w, "start")), (1, 2), "{:?}", stamps(&w));
    let kind = " · engine only (weights mapped from the weight-cache daemon)";
    assert!(w.statuses().iter().any(|s| s.contains(kind)), "{:?}", w.statuses());
    w.wait_for_file("state/loads.jsonl", |w| {
        std::fs::read_to_string(w.path("state/loads.jsonl")).is_ok_and(|l| l.ends_with('\n') && l.lines().count() == 2)
    });
    let ledger = std::fs::read_to_string(w.path("state/loads.jsonl")).unwrap();
    let second = ledger.lines().nth(1).unwrap();
    assert!(second.contains(&format!("\"preload\":{{\"kind\":\"engine-only\",\"daemon_pid\":{daemon}}}")), "{second}");
    assert_eq!(w.stop(), 0);
}

#[test]
fn a_daemon_crash_restarts_both() {
    let mut w = Warden::start(|d, p| engine(d, p, &[], &daemon_command(d, &[])));
    w.wait_ready();
    let (engine_pid, daemon) = pids_when_ready(&mut w);
    kill(Pid::from_raw(daemon as i32), Signal::SIGKILL).unwrap();
    let lost =
        w.wait_note("the daemon's end", |n| n.contains(&format!("the weight-cache daemon (pid {daemon}) ended")));
    assert!(lost.contains("killed by SIGKILL"), "{lost}");
    w.wait_ready();
    w.wait_for_file("status.json", |w| doc(w)["preload"]["pid"].as_u64().is_some_and(|p| p as u32 != daemon));
    let (engine_after, daemon_after) = pids_when_ready(&mut w);
    assert_ne!(daemon_after, daemon);
    assert_ne!(engine_after, engine_pid, "the engine started again with the new daemon");
    assert!(!alive(engine_pid));
    assert_eq!((count(&w, "preload-start"), count(&w, "start")), (2, 2), "{:?}", stamps(&w));
    assert_eq!(w.stop(), 0);
}

#[test]
fn the_stop_ends_the_engine_then_the_daemon() {
    let mut w = Warden::start(|d, p| engine(d, p, &[], &daemon_command(d, &[])));
    w.wait_ready();
    let (engine_pid, daemon) = pids_when_ready(&mut w);
    assert_eq!(w.stop(), 0);
    assert!(!alive(engine_pid) && !alive(daemon));
    let s = stamps(&w);
    let at = |what: &str| s.iter().position(|x| x == what).unwrap_or_else(|| panic!("no {what} in {s:?}"));
    assert!(at("stopped") < at("preload-stopped"), "the engine first: {s:?}");
}

#[test]
fn a_reload_restarts_the_daemon_only_when_the_weights_change() {
    // The daemon's command derived from the engine's.
    let mut w = Warden::start(|d, p| engine(d, p, &["--dtype", "bfloat16"], ""));
    w.wait_ready();
    let (engine_pid, daemon) = pids_when_ready(&mut w);
    let cmdline =
        String::from_utf8_lossy(&std::fs::read(format!("/proc/{daemon}/cmdline")).unwrap()).replace('\0', " ");
    assert!(
        cmdline.contains(" preload --model /srv/models/tiny --dtype bfloat16 --weight-cache-socket-dir "),
        "{cmdline}"
    );
    let text = std::fs::read_to_string(w.path("t.toml")).unwrap();

    // An engine-only change: the engine alone.
    let engine_only = text.replace("\"--shards\", \"2\"", "\"--shards\", \"3\"");
    assert_ne!(engine_only, text);
    std::fs::write(w.path("t.toml"), &engine_only).unwrap();
    w.signal(Signal::SIGHUP);
    w.wait_ready();
    w.wait_for_file("status.json", |w| doc(w)["child_pid"].as_u64().is_some_and(|p| p as u32 != engine_pid));
    let (engine2, daemon2) = pids_when_ready(&mut w);
    assert_ne!(engine2, engine_pid);
    assert_eq!(daemon2, daemon, "the weights are the same: the daemon stays");

    // A weight-defining change: both.
    std::fs::write(w.path("t.toml"), engine_only.replace("bfloat16", "float32")).unwrap();
    w.signal(Signal::SIGHUP);
    w.wait_ready();
    w.wait_for_file("status.json", |w| doc(w)["preload"]["pid"].as_u64().is_some_and(|p| p as u32 != daemon));
    let (engine3, daemon3) = pids_when_ready(&mut w);
    assert_ne!(engine3, engine2);
    assert_ne!(daemon3, daemon);
    assert!(!alive(daemon));
    let cmdline =
        String::from_utf8_lossy(&std::fs::read(format!("/proc/{daemon3}/cmdline")).unwrap()).replace('\0', " ");
    assert!(cmdline.contains("--dtype float32"), "{cmdline}");
    assert_eq!(w.stop(), 0);
}

#[test]
fn a_platform_the_daemon_refuses_ends_the_warden_before_any_engine() {
    let mut w = Warden::start(|d, p| engine(d, p, &[], &daemon_command(d, &["--refuse-platform"])));
    let code = w.wait_exit();
    assert_eq!(code, 78, "{}", w.seen());
    let last = w.statuses().last().copied().unwrap_or_default().to_string();
    assert!(last.contains("failed permanently: the weight-cache daemon ended before it was ready (exit code 1): UnsupportedPlatformForIPCError: platform 'cpu' does not support CUDA IPC"), "{last}");
    let d = doc(&w);
    assert!(d["hint"].as_str().unwrap_or_default().contains("[preload] enabled = false"), "{d}");
    assert_eq!(count(&w, "preload-start"), 1, "no retry: {:?}", stamps(&w));
    assert_eq!(count(&w, "start"), 0, "no engine was started: {:?}", stamps(&w));
}

#[test]
fn a_daemon_left_by_a_killed_warden_is_stopped_before_a_new_one() {
    let mut w = Warden::start(|d, p| engine(d, p, &[], &daemon_command(d, &[])));
    w.wait_ready();
    let (engine_pid, daemon) = pids_when_ready(&mut w);
    w.wait_for_file("state/weight-cache.json", |w| {
        std::fs::read_to_string(w.path("state/weight-cache.json"))
            .is_ok_and(|t| t.contains(&format!("\"pid\":{daemon},")))
    });
    w.signal(Signal::SIGKILL);
    assert_eq!(w.wait_exit(), -1);
    assert!(alive(daemon), "the daemon outlives its warden");

    w.spawn();
    let stopping = w.wait_note("the daemon's leftovers", |n| {
        n.starts_with("STATUS=stopping 1 leftover process(es) of an earlier weight-cache daemon: ")
    });
    assert!(stopping.contains(&format!("{daemon} ")), "{stopping}");
    w.wait_ready();
    let (engine_after, daemon_after) = pids_when_ready(&mut w);
    assert!(!alive(daemon) && !alive(engine_pid), "the old children were stopped first");
    assert_ne!((engine_after, daemon_after), (engine_pid, daemon));
    assert_eq!(w.stop(), 0);
    assert!(!w.path("state/weight-cache.json").exists(), "the record goes with the daemon");
}
