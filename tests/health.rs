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
        config(d, p, &["--shards", "1", "--hang-completions"], "", &format!("{FAST}{health}"))
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
    assert!(refused.contains("1 problem(s)") && refused.contains("`stop-timeout`: invalid duration"), "{refused}");
    assert_eq!(child_pid(&w), first, "the child is untouched");
    assert!(std::path::Path::new(&format!("/proc/{first}")).exists());
    assert!(w.stderr().contains("t.toml:"), "every problem is logged: {}", w.stderr());

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
