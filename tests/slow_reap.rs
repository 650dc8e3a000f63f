//! A slow reap never freezes the warden: while the reap of the server's
//! leader is held (by the test hook, or by the kernel taking down a great
//! many `/proc` entries), the warden restarts the server, answers its status
//! endpoint and `vllm-warden status`, feeds the watchdog and honours a stop.
//!
//! No wait sleeps for a condition: each is on an event (a datagram, a file
//! written, an answer, an exit) under a deadline far below the reap's hold,
//! and the held reaper, still in its reap after them, proves they all
//! happened during it.

mod common;

use std::time::{Duration, Instant};

use common::{Opts, Warden, config};
use nix::sys::signal::Signal;

const FAST: &str = "[restart]\ninitial-delay = \"0s\"\n[prestart]\ngpu-idle-wait = \"0s\"\n";

/// How long the hook holds each reap of the server's leader: far beyond
/// every wait of the test (the longest, [`common::TIMEOUT`], is a minute), so that a
/// loop frozen by it fails them all.
const HOLD: Duration = Duration::from_secs(600);

/// `WATCHDOG_USEC`: 200 ms, so `WATCHDOG=1` every 100 ms.
const WATCHDOG_USEC: &str = "200000";

/// The longest wait for a `WATCHDOG=1`: many periods, far below the hold.
const WATCHDOG_GAP: Duration = Duration::from_secs(5);

/// A stop's bounds: `STOPPING=1` well within this (the stop bench answers
/// in under 5 ms), the exit within the stop's timeout and this much more.
const STOPPING_WITHIN: Duration = Duration::from_secs(5);
const STOP_TIMEOUT: Duration = Duration::from_secs(2);
const EXIT_MARGIN: Duration = Duration::from_secs(8);

/// The pid in `STATUS=ready: pid N, …`.
fn ready_pid(w: &mut Warden) -> i32 {
    let s = w.wait_note("the ready status", |n| n.starts_with("STATUS=ready: pid "));
    s["STATUS=ready: pid ".len()..].split(',').next().unwrap().parse().unwrap()
}

/// How many of the warden's threads are reapers: one, but while an old one
/// is held in its reap, handed over to a new one.
fn reapers(w: &Warden) -> usize {
    let comm = |t: &std::fs::DirEntry| std::fs::read_to_string(t.path().join("comm")).unwrap_or_default();
    let tasks = std::fs::read_dir(format!("/proc/{}/task", w.pid)).unwrap();
    tasks.flatten().filter(|t| comm(t).trim() == "reaper").count()
}

/// `GET /status` on the warden's control socket, answered within `budget`.
fn status_endpoint(w: &Warden, budget: Duration) -> serde_json::Value {
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
    let socket = w.path("run/control.sock");
    let (code, body) = rt
        .block_on(vllm_warden::daemon::server::client::call_within(&socket, "GET", "/status", budget))
        .unwrap_or_else(|e| panic!("the status endpoint did not answer within {budget:?}: {e}"));
    assert_eq!(code, 200, "{body}");
    serde_json::from_str(&body).unwrap()
}

/// `vllm-warden status -c …`: its exit code and output.
fn status_command(w: &Warden) -> (i32, String) {
    let o = w.command("status").output().unwrap();
    (o.status.code().unwrap(), String::from_utf8_lossy(&o.stdout).into_owned())
}

/// `n` more `WATCHDOG=1`, each within [`WATCHDOG_GAP`] of the last.
fn watchdog_fed(w: &mut Warden, n: usize) {
    for i in 0..n {
        w.wait_note_within(WATCHDOG_GAP, &format!("WATCHDOG=1 number {} during the reap", i + 1), |s| {
            s == "WATCHDOG=1"
        });
    }
}

/// SIGTERM: `STOPPING=1` and the exit, each within the stop's bounds.
fn stop_within_bounds(w: &mut Warden) {
    let t = Instant::now();
    w.signal(Signal::SIGTERM);
    w.wait_note_within(STOPPING_WITHIN, "STOPPING=1 after SIGTERM", |n| n == "STOPPING=1");
    let code = w.wait_exit_strictly_within(STOP_TIMEOUT + EXIT_MARGIN, "the exit after SIGTERM");
    assert_eq!(code, 0);
    eprintln!("stopped in {} ms", t.elapsed().as_millis());
}

#[test]
fn a_held_reap_of_the_server_freezes_neither_the_restart_nor_status_watchdog_and_stop() {
    // The hook holds the reaper between reading the server's exit and its
    // reap, its zombie still there, for ten minutes: after 200 ms a new
    // reaper waits for the other exits (and takes the zombie).
    let env = vec![
        ("VLLM_WARDEN_TEST_SLOW_REAP".into(), HOLD.as_millis().to_string()),
        ("WATCHDOG_USEC".into(), WATCHDOG_USEC.into()),
    ];
    let stop_timeout = format!("stop-timeout = \"{}s\"", STOP_TIMEOUT.as_secs());
    let mut w = Warden::start_with(
        |d, p| config(d, p, &["--shards", "1"], &stop_timeout, FAST),
        Opts { env, ..Opts::default() },
    );
    w.wait_ready();
    let old = ready_pid(&mut w);
    assert_eq!(reapers(&w), 1);

    // The server dies; the reap of it is held from here.
    nix::sys::signal::kill(nix::unistd::Pid::from_raw(old), Signal::SIGKILL).unwrap();
    let restarting = w.wait_note("the restart", |n| n.starts_with("STATUS=restarting in"));
    assert!(restarting.ends_with("exited while serving (killed by SIGKILL)"), "{restarting}");
    w.wait_ready();
    let new = ready_pid(&mut w);
    assert_ne!(new, old);
    let handed = format!("the reap of pid {old} has lasted over 200 ms");
    w.wait_for_file("warden.stderr", |w| w.stderr().contains(&handed));

    // (a) The endpoint, on the loop's runtime, and the status files, written
    // by the loop, say the new run.
    let doc = status_endpoint(&w, Duration::from_secs(5));
    assert_eq!((doc["state"].as_str(), doc["child_pid"].as_i64()), (Some("ready"), Some(new.into())), "{doc}");
    let (code, out) = status_command(&w);
    assert_eq!(code, 0, "{out}");
    assert!(out.starts_with(&format!("t: ready, pid {new}")), "{out}");

    // (b) The watchdog is fed.
    watchdog_fed(&mut w, 5);

    // All of it during the reap: the held reaper is still in it.
    assert_eq!(reapers(&w), 2, "the held reaper, and the one that took over");

    // (c) A stop is honoured within its bounds (the new server's reap is
    // held too: its tree is seen gone without it).
    stop_within_bounds(&mut w);
}

/// The entries of `pid`'s `/proc` folder that a reap takes down, each
/// looked up (`lstat`) so that the kernel holds it: the descriptors (in
/// `fd/` and `fdinfo/`, and again under `task/PID/`) and the mappings
/// (`map_files/`). How many.
fn look_up_proc_entries(pid: i32) -> usize {
    let mut n = 0;
    for dir in ["fd", "fdinfo", &format!("task/{pid}/fd"), &format!("task/{pid}/fdinfo"), "map_files"] {
        let dir = format!("/proc/{pid}/{dir}");
        for e in std::fs::read_dir(&dir).unwrap().flatten() {
            n += usize::from(std::fs::symlink_metadata(e.path()).is_ok());
        }
    }
    n
}

/// The milliseconds in `… took N ms` after `prefix` in `text`.
fn ms_after(text: &str, prefix: &str) -> Option<u64> {
    let at = text.find(prefix)? + prefix.len();
    text[at..].split(' ').next()?.parse().ok()
}

#[test]
fn a_real_slow_reap_holds_no_turn_of_the_loop() {
    // The kernel's own slow reap: a server holding 100 000 descriptors (as
    // many as its limit allows) and 60 000 mappings, each looked up in its
    // /proc folder, whose entries the reap takes down one by one (about
    // 0.2 s on the 2-core machine measured; a vLLM reap was seen taking
    // 15 s to minutes).
    let env = vec![("WATCHDOG_USEC".into(), WATCHDOG_USEC.into())];
    // The server inherits the warden's descriptor limit, and opens that
    // many less 256: the warden's is set (soft and hard) to the hard limit
    // the test has, up to 100 000 and those 256. The soft limit alone may
    // be 1024 (systemd's for a login), far too few.
    let mut lim = libc::rlimit { rlim_cur: 0, rlim_max: 0 };
    // SAFETY: getrlimit into a local.
    assert_eq!(unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut lim) }, 0);
    let nofile = lim.rlim_max.min(100_512);
    let mut w = Warden::start_with(
        |d, p| {
            let stop_timeout = format!("stop-timeout = \"{}s\"", STOP_TIMEOUT.as_secs());
            config(d, p, &["--shards", "1", "--descriptors", "100000", "--mappings", "60000"], &stop_timeout, FAST)
        },
        Opts { env, nofile: Some(nofile), ..Opts::default() },
    );
    w.wait_ready();
    let old = ready_pid(&mut w);
    let entries = look_up_proc_entries(old);
    let before = w.stderr().len();

    nix::sys::signal::kill(nix::unistd::Pid::from_raw(old), Signal::SIGKILL).unwrap();
    w.wait_note("the restart", |n| n.starts_with("STATUS=restarting in"));
    w.wait_ready();
    let new = ready_pid(&mut w);
    watchdog_fed(&mut w, 3);
    let took = format!("the reap of pid {old} took ");
    w.wait_for_file("warden.stderr", |w| w.stderr().contains(&took));
    let stderr = w.stderr();
    let reap = ms_after(&stderr, &took).unwrap();
    eprintln!("{entries} entries of /proc/{old} looked up: its reap took {reap} ms");
    // The premise: a reap far beyond the kernel's usual (up to 1.4 ms), and
    // longer than a turn of the loop that is logged. Not met (a hard limit
    // of few descriptors, a fast machine), the test proves nothing, and
    // says so rather than pass.
    if reap <= vllm_warden::daemon::driver::SLOW_TURN.as_millis() as u64 {
        eprintln!(
            "SKIPPED: the reap of {entries} /proc entries (descriptor limit {nofile}) took only {reap} ms on this \
             machine, not over {} ms: no slow reap to hold the loop",
            vllm_warden::daemon::driver::SLOW_TURN.as_millis()
        );
        stop_within_bounds(&mut w);
        return;
    }
    // No turn of the loop was held for half the reap (a loop that waited
    // for it would have been held for nearly all of it: its exit reaches
    // the loop as the reap begins).
    let held = "the loop was held for ";
    for line in stderr[before..].lines().filter(|l| l.contains(held)) {
        let ms = ms_after(line, held).unwrap();
        assert!(ms < reap / 2, "a turn of the loop took {ms} ms during a reap of {reap} ms: {line}");
    }
    assert_eq!(status_endpoint(&w, Duration::from_secs(5))["child_pid"].as_i64(), Some(new.into()));
    stop_within_bounds(&mut w);
}
