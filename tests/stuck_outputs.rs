//! What the warden writes out can get stuck without holding it: a status
//! file that cannot be written (a filesystem that never answers) holds the
//! files and the notifications behind them, on their own thread; a log
//! nobody reads (a collector that stopped reading) holds the log's writer,
//! on its own thread. Meanwhile the loop feeds the watchdog, serves the
//! endpoint, runs the child and honours a stop.

mod common;

use std::time::Duration;

use common::{Opts, Warden, config};
use nix::sys::signal::Signal;

#[test]
fn a_status_write_that_never_returns_holds_neither_the_loop_nor_the_stop() {
    // The hook makes every write of the status files block for ever.
    let env = vec![("VLLM_WARDEN_TEST_PANIC".into(), "status-write".into()), ("WATCHDOG_USEC".into(), "200000".into())];
    let fast = "[restart]\ninitial-delay = \"0s\"\n[prestart]\ngpu-idle-wait = \"0s\"\n";
    let mut w = Warden::start_with(
        |d, p| config(d, p, &["--shards", "1"], "stop-timeout = \"2s\"", fast),
        Opts { env, ..Opts::default() },
    );
    // The loop turns: the watchdog is fed, every 100 ms.
    for i in 0..5 {
        w.wait_note_within(Duration::from_secs(5), &format!("WATCHDOG=1 number {}", i + 1), |n| n == "WATCHDOG=1");
    }
    // The child becomes ready (the loop says so in its log), though no file
    // says so and no READY=1 can pass the stuck write; the endpoint, on the
    // loop's runtime, answers that it is.
    w.wait_for_file("warden.stderr", |w| w.stderr().contains("EVENT=\"ready\""));
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
    let socket = w.path("run/control.sock");
    let livez = vllm_warden::daemon::server::client::call_within(&socket, "GET", "/livez", Duration::from_secs(5));
    let answer = rt.block_on(livez).unwrap_or_else(|e| panic!("the endpoint did not answer within 5 s: {e}"));
    assert_eq!(answer, (200, "ready\n".to_string()));
    w.wait_note_within(Duration::from_secs(5), "WATCHDOG=1 once ready", |n| n == "WATCHDOG=1");
    assert!(!w.notes.iter().any(|n| n == "READY=1"), "READY=1 waits for the file that says ready: {:?}", w.notes);
    assert!(!w.path("status.json").exists());
    // A stop: the tree is stopped and the warden exits, having waited 5 s
    // for the stuck write.
    w.signal(Signal::SIGTERM);
    assert_eq!(w.wait_exit_strictly_within(Duration::from_secs(15), "the exit after SIGTERM"), 0);
    assert!(w.stderr().contains("stopped on request"), "{}", w.stderr());
}

#[test]
fn a_log_that_nobody_reads_holds_neither_the_loop_nor_the_stop() {
    // The warden's stderr is a pipe of one page that is never read: the
    // events of five failed starts (NCCL errors, each with its report,
    // backoff and spawn) fill it before the sixth start is ready.
    let env = vec![("WATCHDOG_USEC".into(), "200000".into())];
    let fast = "[restart]\ninitial-delay = \"0s\"\n[prestart]\ngpu-idle-wait = \"0s\"\n";
    let mut w = Warden::start_with(
        |d, p| {
            let count = d.join("runs");
            let args =
                ["--shards", "2", "--fail", "nccl", "--fail-times", "5", "--count-file", count.to_str().unwrap()];
            config(d, p, &args, "", fast)
        },
        Opts { env, stderr_unread: true, ..Opts::default() },
    );
    w.wait_ready();
    assert_eq!(w.notes.iter().filter(|n| n.starts_with("STATUS=restarting in")).count(), 5, "{:?}", w.notes);
    for i in 0..5 {
        w.wait_note_within(Duration::from_secs(5), &format!("WATCHDOG=1 number {}", i + 1), |n| n == "WATCHDOG=1");
    }
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
    let socket = w.path("run/control.sock");
    let livez = vllm_warden::daemon::server::client::call_within(&socket, "GET", "/livez", Duration::from_secs(5));
    let answer = rt.block_on(livez).unwrap_or_else(|e| panic!("the endpoint did not answer within 5 s: {e}"));
    assert_eq!(answer, (200, "ready\n".to_string()));
    w.signal(Signal::SIGTERM);
    w.wait_note_within(Duration::from_secs(5), "STOPPING=1", |n| n == "STOPPING=1");
    // The exit waits 2 s for the stuck log, then ends.
    assert_eq!(w.wait_exit_strictly_within(Duration::from_secs(15), "the exit after SIGTERM"), 0);
}
