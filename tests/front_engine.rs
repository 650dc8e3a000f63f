//! The engine behind the front door (`[front]`), with the real binary and
//! the simulated vLLM: the engine on its private unix socket (`--uds`),
//! reached there by readiness, health and the golden check, in a 0700
//! folder; an idle engine stopped and started by the next request; put to
//! sleep and woken, its golden answers checked before it serves; a wake that
//! fails or answers otherwise restarts it.
//!
//! Until the front door forwards, test builds answer on `front.listen`
//! with a stand-in (`daemon/standin.rs`) that tells the loop of each
//! request as the front door does and answers `200 ready` once the engine
//! serves: what is proven here is the engine's side.

mod common;

use std::io::{Read, Write};
use std::os::unix::fs::{FileTypeExt, PermissionsExt};
use std::path::Path;
use std::time::Duration;

use common::*;

const FAST: &str = "[restart]\ninitial-delay = \"0s\"\npermanent-attempts = 1\n";

/// A config of the simulator behind a front door on `127.0.0.1:port`
/// (no `--port`: the warden gives the engine its socket), with `sim_args`
/// and `front` (more keys of `[front]`), the golden check on.
fn front_config(d: &Path, port: u16, sim_args: &[&str], front: &str) -> String {
    let health = d.join("health");
    let mut argv = vec![sim().to_string(), "--shards".into(), "1".into()];
    argv.extend(["--health-file".to_string(), health.display().to_string()]);
    argv.extend(sim_args.iter().map(|s| s.to_string()));
    let argv: Vec<String> = argv.iter().map(|a| format!("{a:?}")).collect();
    format!(
        "name = \"t\"\n[child]\ncommand = [{}]\nlog-file = \"{d}/t.log\"\n[status]\nfile = \"{d}/status.json\"\n\
         metrics-file = \"{d}/vllm_warden.prom\"\n{FAST}[health]\ninterval = \"100ms\"\ntimeout = \"2s\"\n\
         [golden]\nprompts = [\"one\", \"two\"]\n[server]\nsocket = \"{d}/control.sock\"\n[front]\nlisten = \"127.0.0.1:{port}\"\n{front}\n",
        argv.join(", "),
        d = d.display()
    )
}

fn doc(w: &Warden) -> serde_json::Value {
    serde_json::from_str(&std::fs::read_to_string(w.path("status.json")).unwrap()).unwrap()
}

fn health_answers(w: &Warden) -> usize {
    std::fs::read_to_string(w.path("health")).map_or(0, |t| t.lines().count())
}

/// One request to the front door, answered once the engine serves: its
/// whole answer. Waits on the answer itself, under one generous deadline.
fn ask_front(port: u16) -> String {
    let mut c = std::net::TcpStream::connect(("127.0.0.1", port)).unwrap();
    c.set_read_timeout(Some(Duration::from_secs(120))).unwrap();
    c.write_all(b"GET /v1/models HTTP/1.1\r\nhost: model\r\nconnection: close\r\n\r\n").unwrap();
    let mut answer = String::new();
    c.read_to_string(&mut answer).unwrap();
    answer
}

/// The request's answer, asked from a thread: the test meanwhile waits for
/// what the warden says.
fn ask_front_later(port: u16) -> std::thread::JoinHandle<String> {
    std::thread::spawn(move || ask_front(port))
}

#[test]
fn the_engine_serves_on_its_private_socket_and_the_warden_reaches_it_there() {
    let mut w = Warden::start(|d, p| front_config(d, p, &[], ""));
    w.wait_ready();
    let folder = w.path("run").join("engine");
    let socket = folder.join("engine.sock");
    assert_eq!(std::fs::metadata(&folder).unwrap().permissions().mode() & 0o7777, 0o700);
    assert!(std::fs::symlink_metadata(&socket).unwrap().file_type().is_socket());
    // The golden answers and the health checks went through it.
    assert_eq!(doc(&w)["golden"]["verdict"], "recorded", "{}", doc(&w));
    w.wait_for_file("health", |w| health_answers(w) >= 3);
    // Nothing of the engine on TCP: the command's default port is not its.
    assert!(!w.log().contains("Address already in use"), "{}", w.log());
    // A second start finds the last run's socket and removes it (vLLM binds anew).
    let (ok, said) = w.cli(&["restart"]);
    assert!(ok, "{said}");
    w.wait_ready_within(Duration::from_secs(120), "READY=1 after the restart");
    assert_eq!(doc(&w)["golden"]["verdict"], "same", "{}", doc(&w));
    assert_eq!(w.stop(), 0);
}

#[test]
fn an_idle_engine_is_stopped_and_the_next_request_starts_it() {
    let mut w = Warden::start(|d, p| front_config(d, p, &[], "idle-stop = \"1s\"\n"));
    w.wait_ready();
    let first = doc(&w)["child_pid"].as_u64().unwrap();
    let said = w.wait_note("the idle stop", |n| n.starts_with("STATUS=idle: stopped after"));
    assert!(
        said.starts_with("STATUS=idle: stopped after 1s without requests; starts on the next request (about"),
        "{said}"
    );
    assert_eq!(doc(&w)["state"], "idle", "{}", doc(&w));
    assert!(doc(&w)["child_pid"].is_null(), "no engine: {}", doc(&w));
    let prom = std::fs::read_to_string(w.path("vllm_warden.prom")).unwrap();
    assert!(prom.contains("vllm_warden_idle_stops_total{name=\"t\"} 1"), "{prom}");
    assert!(prom.contains("vllm_warden_state{name=\"t\",state=\"idle\"} 1"), "{prom}");
    let answer = ask_front(w.port);
    assert!(answer.starts_with("HTTP/1.1 200"), "{answer}");
    // A normal start: patches, pre-start, load, golden, READY=1.
    w.wait_ready();
    let starts = w.statuses().iter().filter(|s| s.starts_with("starting (attempt 1")).count();
    assert_eq!(starts, 2, "{:?}", w.statuses());
    let d = doc(&w);
    assert_eq!((d["state"].as_str(), d["golden"]["verdict"].as_str()), (Some("ready"), Some("same")), "{d}");
    assert_ne!(d["child_pid"].as_u64().unwrap(), first, "a new engine");
    assert_eq!(w.stop(), 0);
}

#[test]
fn a_sleeping_engine_is_woken_checked_and_serves_again() {
    let mut w = Warden::start(|d, p| {
        front_config(d, p, &["--enable-sleep-mode"], "idle-stop = \"1s\"\nidle-action = \"sleep\"\n")
    });
    w.wait_ready();
    let pid = doc(&w)["child_pid"].as_u64().unwrap();
    w.wait_note("asleep", |n| n.starts_with("STATUS=idle: asleep (level 1) after 1s without requests"));
    // Development mode was given to this engine only because it sleeps.
    assert!(
        w.log().contains("SECURITY WARNING: Development endpoints are enabled! This should NOT be used in production!"),
        "{}",
        w.log()
    );
    // The engine's own line, through the warden's pipe into the log.
    w.wait_for_file("t.log", |w| w.log().contains("It took 0.21 seconds to fall asleep."));
    assert_eq!((doc(&w)["state"].as_str(), doc(&w)["child_pid"].as_u64()), (Some("idle"), Some(pid)));
    let checks = doc(&w)["golden"]["text"].clone();
    let answer = ask_front_later(w.port);
    w.wait_note("the wake", |n| n.starts_with("STATUS=ready: pid") && n.contains("woken in"));
    let answer = answer.join().unwrap();
    assert!(answer.starts_with("HTTP/1.1 200"), "{answer}");
    assert!(w.statuses().iter().any(|s| s.ends_with("checking the golden answers")), "{:?}", w.statuses());
    let d = doc(&w);
    assert_eq!((d["child_pid"].as_u64(), d["golden"]["verdict"].as_str()), (Some(pid), Some("same")), "{d}");
    assert_ne!(d["golden"]["text"], checks, "checked again after the wake");
    let prom = std::fs::read_to_string(w.path("vllm_warden.prom")).unwrap();
    assert!(prom.contains("vllm_warden_idle_sleeps_total{name=\"t\"} 1"), "{prom}");
    assert_eq!(w.stop(), 0);
}

#[test]
fn a_wake_that_fails_or_answers_otherwise_restarts_the_engine() {
    for (knob, cause) in [
        (&["--wake-fails-from", "1"][..], "the wake from sleep failed: /wake_up: HTTP 500"),
        (&["--wrong-after-wake"][..], "after a wake from sleep: "),
    ] {
        let mut args = vec!["--enable-sleep-mode"];
        args.extend(knob);
        let mut w = Warden::start(|d, p| front_config(d, p, &args, "idle-stop = \"1s\"\nidle-action = \"sleep\"\n"));
        w.wait_ready();
        let pid = doc(&w)["child_pid"].as_u64().unwrap();
        w.wait_note("asleep", |n| n.starts_with("STATUS=idle: asleep"));
        let answer = ask_front_later(w.port);
        let failed = w.wait_note("the failed wake", |n| n.starts_with("STATUS=failed"));
        assert!(failed.contains(cause), "{failed}");
        // Started again; the request held meanwhile is answered once it serves.
        w.wait_ready();
        let answer = answer.join().unwrap();
        assert!(answer.starts_with("HTTP/1.1 200"), "{answer}");
        assert_ne!(doc(&w)["child_pid"].as_u64().unwrap(), pid, "a new engine");
        assert_eq!(w.stop(), 0);
    }
}

/// The requests the simulated engine is generating, from its own
/// `/metrics` on its private socket.
fn engine_running(w: &Warden) -> f64 {
    let Ok(mut c) = std::os::unix::net::UnixStream::connect(w.path("run").join("engine").join("engine.sock")) else {
        return 0.0;
    };
    let mut answer = String::new();
    let asked = c.write_all(b"GET /metrics HTTP/1.1\r\nhost: engine\r\nconnection: close\r\n\r\n");
    if asked.and_then(|()| c.read_to_string(&mut answer)).is_err() {
        return 0.0;
    }
    answer
        .lines()
        .find(|l| l.starts_with("vllm:num_requests_running{"))
        .and_then(|l| l.rsplit(' ').next()?.parse().ok())
        .unwrap_or(0.0)
}

/// `n` completions of 100 tokens (two seconds) sent to the front door at
/// once, each from its thread; once the engine generates them all, its
/// EngineCore dies as vLLM's does under SIGKILL (`--engine-killed-on-usr1`):
/// vLLM's API server answers each 500 (`EngineDeadError`) before the
/// warden sees the death. Their answers.
fn killed_under(w: &mut Warden, port: u16, n: usize) -> Vec<common::http::Answer> {
    w.wait_ready();
    let clients: Vec<_> = (0..n)
        .map(|i| {
            let url = format!("http://127.0.0.1:{port}/v1/completions");
            let body = serde_json::json!({"model": "tiny-llama", "prompt": format!("d{i}"), "max_tokens": 100});
            std::thread::spawn(move || common::http::post_json(&url, &body, TIMEOUT))
        })
        .collect();
    let deadline = std::time::Instant::now() + TIMEOUT;
    while engine_running(w) < n as f64 {
        assert!(std::time::Instant::now() < deadline, "the requests never reached the engine{}", w.seen());
        std::thread::sleep(Duration::from_millis(20));
    }
    let sim = doc(w)["child_pid"].as_u64().expect("a child") as i32;
    nix::sys::signal::kill(nix::unistd::Pid::from_raw(sim), nix::sys::signal::Signal::SIGUSR1).unwrap();
    clients.into_iter().map(|c| c.join().unwrap().expect("answered")).collect()
}

/// vLLM's own 500 in the moment its engine dies is the engine's death for
/// the request: 502 from the front door, said as the front door's.
#[test]
fn vllms_engine_dead_answer_is_a_502() {
    let port = free_port();
    let mut w = Warden::start(|d, _| front_config(d, port, &["--engine-killed-on-usr1", "--token-time", "20ms"], ""));
    for a in killed_under(&mut w, port, 3) {
        assert_eq!(a.status, 502, "{}", a.body);
        assert_eq!(a.json()["error"]["type"], "upstream_error", "{}", a.body);
    }
    w.wait_ready();
    assert_eq!(w.stop(), 0);
}

/// With `retry-unanswered`, the same requests (no byte of an answer came)
/// are held and sent once more after the restart: all answered 200.
#[test]
fn vllms_engine_dead_answer_is_sent_again_with_retry_unanswered() {
    let port = free_port();
    let sim = ["--engine-killed-on-usr1", "--token-time", "20ms"];
    let mut w = Warden::start(|d, _| front_config(d, port, &sim, "retry-unanswered = true"));
    for a in killed_under(&mut w, port, 3) {
        assert_eq!(a.status, 200, "{}", a.body);
        assert_eq!(a.json()["object"], "text_completion", "{}", a.body);
    }
    assert_eq!(w.stop(), 0);
}

/// A metric of the warden's endpoint on `server`: the first sample of
/// `name`.
fn metric(server: u16, name: &str) -> f64 {
    let m = common::http::get(&format!("http://127.0.0.1:{server}/metrics"), TIMEOUT).unwrap();
    m.body
        .lines()
        .filter(|l| l.strip_prefix(name).is_some_and(|r| r.starts_with('{')))
        .find_map(|l| l.rsplit(' ').next()?.parse().ok())
        .unwrap_or(0.0)
}

/// What outsiders found (issue 56, B2): requests held while the model is
/// drained, released at once into an engine whose accept queue is small
/// (uvicorn's is capped by `somaxconn`; 5 here) and full (the engine is
/// stopped with SIGSTOP over the release, so that the queue fills
/// whatever the machine's speed): a connect fails at once (`EAGAIN` on a
/// unix socket). They were held again as if the engine had died, nothing
/// released them, and they were answered 503 when `hold` ran out (250 of
/// 256); the error was not logged. Now the connect is tried again under a
/// deadline of its own, said once: all 256 answered.
#[test]
fn held_requests_released_into_a_full_accept_queue_are_all_answered() {
    let server = free_port();
    let mut w = Warden::start(|d, p| {
        front_config(d, p, &["--backlog", "5", "--token-time", "0s"], "hold = \"20s\"\n")
            // No health check lands while the engine is stopped.
            .replace("interval = \"100ms\"", "interval = \"1h\"")
            .replace("[server]\n", &format!("[server]\nlisten = \"127.0.0.1:{server}\"\n"))
    });
    w.wait_ready();
    let (ok, out) = w.cli(&["drain"]);
    assert!(ok, "{out}");
    const N: usize = 256;
    let clients: Vec<_> = (0..N)
        .map(|i| {
            let url = format!("http://127.0.0.1:{}/v1/completions", w.port);
            let body = serde_json::json!({"model": "tiny-llama", "prompt": format!("h{i}"), "max_tokens": 1});
            std::thread::spawn(move || common::http::post_json(&url, &body, TIMEOUT))
        })
        .collect();
    let deadline = std::time::Instant::now() + TIMEOUT;
    while metric(server, "vllm_warden_front_held") < N as f64 {
        assert!(std::time::Instant::now() < deadline, "the requests were not all held{}", w.seen());
        std::thread::sleep(Duration::from_millis(20));
    }
    let sim = nix::unistd::Pid::from_raw(doc(&w)["child_pid"].as_u64().expect("a child") as i32);
    nix::sys::signal::kill(sim, nix::sys::signal::Signal::SIGSTOP).unwrap();
    let (ok, out) = w.cli(&["undrain"]);
    assert!(ok, "{out}");
    // Released into the full queue: the connect error is said, once.
    w.wait_logged("the engine takes no connection now");
    nix::sys::signal::kill(sim, nix::sys::signal::Signal::SIGCONT).unwrap();
    let answers: Vec<_> = clients.into_iter().map(|c| c.join().unwrap().expect("answered")).collect();
    let refused: Vec<_> = answers.iter().filter(|a| a.status != 200).collect();
    assert!(refused.is_empty(), "{} of {N} not answered 200, the first: {:?}", refused.len(), refused.first());
    assert_eq!(w.stderr().matches("the engine takes no connection now").count(), 1, "{}", w.stderr());
    assert_eq!(w.stop(), 0);
}
