//! The front door (`[front]`) with the real binary and the simulated vLLM:
//! requests held through a load and released on ready, refused at once
//! when they cannot be held, a killed engine under load (no connection
//! refused; 502 for what was in flight, or sent again with
//! `retry-unanswered`), server-sent events passed event by event, a client
//! gone cancelling its upstream request, and the protections (a body over
//! the limit, vLLM's development routes, request smuggling, slowloris).
//!
//! The simulator serves on a loopback port here (profile `none`: the
//! engine is the command's own port, `Engine::Loopback`).

mod common;

use std::io::{Read, Write};
use std::path::Path;
use std::time::{Duration, Instant};

use common::{TIMEOUT, Warden, free_port};

/// A config of the simulator under profile `none` (its ready line and
/// `/health`), with a front door on `front` and the endpoint on `server`
/// (for `/metrics`); `sim` are more arguments of the simulator, `more`
/// more keys of `[front]`.
fn front_config(d: &Path, p: u16, front: u16, server: u16, sim: &[&str], more: &str) -> String {
    let base = common::config(
        d,
        p,
        sim,
        "",
        &format!(
            "[restart]\ninitial-delay = \"0s\"\n[ready]\nlog = [\"Application startup complete\"]\nprogress = [\"checkpoint shards\"]\n\
             [server]\nlisten = \"127.0.0.1:{server}\"\nsocket = \"{}/control.sock\"\n[front]\nlisten = \"127.0.0.1:{front}\"\n{more}",
            d.display()
        ),
    );
    base.replacen("name = \"t\"\n", "name = \"t\"\nprofile = \"none\"\n", 1)
}

struct Door {
    w: Warden,
    front: u16,
    server: u16,
}

impl Door {
    fn start(sim: &[&str], more: &str) -> Door {
        Door::start_with(sim, more, common::Opts::default())
    }

    fn start_with(sim: &[&str], more: &str, opts: common::Opts) -> Door {
        let (front, server) = (free_port(), free_port());
        let mut w = Warden::start_with(|d, p| front_config(d, p, front, server, sim, more), opts);
        // The listeners are bound before the first start: its first
        // STATUS= comes after them.
        w.wait_note("the first STATUS=", |n| n.starts_with("STATUS="));
        Door { w, front, server }
    }

    fn url(&self, path: &str) -> String {
        format!("http://127.0.0.1:{}{path}", self.front)
    }

    /// A metric of the warden's endpoint: the first sample whose line
    /// starts with `name` (and a `{`) and has `label` (`outcome="held"`).
    fn metric(&self, name: &str) -> f64 {
        let (name, label) = name.split_once(' ').unwrap_or((name, ""));
        let m = common::http::get(&format!("http://127.0.0.1:{}/metrics", self.server), TIMEOUT).unwrap();
        m.body
            .lines()
            .filter(|l| l.strip_prefix(name).is_some_and(|r| r.starts_with('{')) && l.contains(label))
            .find_map(|l| l.rsplit(' ').next()?.parse().ok())
            .unwrap_or(0.0)
    }

    /// Wait (under one generous deadline) until `metric` is at least `n`.
    fn wait_metric(&self, name: &str, n: f64) {
        let deadline = Instant::now() + TIMEOUT;
        while self.metric(name) < n {
            assert!(Instant::now() < deadline, "timed out waiting for {name} ≥ {n}");
            std::thread::sleep(Duration::from_millis(20));
        }
    }
}

fn completion(prompt: &str, max_tokens: u64) -> serde_json::Value {
    serde_json::json!({"model": "tiny-llama", "prompt": prompt, "max_tokens": max_tokens})
}

const HELD: &str = "vllm_warden_front_held";
const IN_FLIGHT: &str = "vllm_warden_front_in_flight";
const FRONT: &str = "vllm_warden_front_requests_total";

fn outcome(d: &Door, outcome: &str) -> f64 {
    d.metric(&format!("{FRONT} outcome=\"{outcome}\""))
}

/// Requests that arrive while the model loads wait, and are answered
/// once it is ready; the queue's count says they were held.
#[test]
fn requests_are_held_during_a_load_and_released_on_ready() {
    // A load of 3 s: long enough for the requests to come during it.
    let d = Door::start(&["--shards", "60", "--shard-time", "50ms"], "");
    let clients: Vec<_> = (0..5)
        .map(|i| {
            let url = d.url("/v1/completions");
            std::thread::spawn(move || common::http::post_json(&url, &completion(&format!("p{i}"), 2), TIMEOUT))
        })
        .collect();
    d.wait_metric(HELD, 5.0);
    let mut d = d;
    // STATUS= says how many wait, with the load's progress.
    d.w.wait_note("STATUS= with the requests held", |n| n.starts_with("STATUS=") && n.ends_with(" · 5 requests held"));
    d.w.wait_ready();
    for c in clients {
        let a = c.join().unwrap().expect("answered");
        assert_eq!(a.status, 200, "{}", a.body);
        assert_eq!(a.json()["object"], "text_completion");
    }
    assert_eq!(d.metric(HELD), 0.0);
    assert_eq!(outcome(&d, "held"), 5.0);
    assert_eq!(outcome(&d, "forwarded"), 5.0);
    // The status document says where clients connect and where the engine is.
    let doc: serde_json::Value = serde_json::from_str(
        &common::http::get(&format!("http://127.0.0.1:{}/status", d.server), TIMEOUT).unwrap().body,
    )
    .unwrap();
    assert_eq!(doc["front"]["listen"][0], format!("127.0.0.1:{}", d.front));
    assert_eq!(doc["front"]["engine"], format!("127.0.0.1:{}", d.w.port));
    assert_eq!(d.w.stop(), 0);
}

/// A full queue refuses at once: 503, `Retry-After`, an OpenAI-shaped
/// error saying why.
#[test]
fn a_full_queue_is_answered_503_with_retry_after() {
    let mut d = Door::start(&["--shards", "80", "--shard-time", "50ms"], "max-held = 2\n");
    let clients: Vec<_> = (0..2)
        .map(|i| {
            let url = d.url("/v1/completions");
            std::thread::spawn(move || common::http::post_json(&url, &completion(&format!("p{i}"), 1), TIMEOUT))
        })
        .collect();
    d.wait_metric(HELD, 2.0);
    let third = raw(d.front, &post_head("/v1/completions", &completion("p2", 1).to_string()));
    assert!(third.starts_with("HTTP/1.1 503"), "{third}");
    let retry = header(&third, "retry-after").expect("Retry-After");
    assert!(retry.parse::<u64>().unwrap() >= 1, "{retry}");
    let body: serde_json::Value = serde_json::from_str(third.split("\r\n\r\n").nth(1).unwrap().trim()).unwrap();
    assert_eq!(body["error"]["type"], "unavailable");
    assert_eq!(body["error"]["code"], 503);
    assert!(body["error"]["message"].as_str().unwrap().contains("too many requests waiting"), "{body}");
    d.w.wait_ready();
    for c in clients {
        assert_eq!(c.join().unwrap().unwrap().status, 200);
    }
    assert_eq!(outcome(&d, "rejected"), 1.0);
    assert_eq!(d.w.stop(), 0);
}

/// A client that goes away while held frees its place in the queue at
/// once: a flood of held requests that hang up fills nothing.
#[test]
fn a_client_gone_while_held_frees_its_place() {
    let mut d = Door::start(&["--shards", "200", "--shard-time", "50ms"], "max-held = 1\n");
    let mut s = std::net::TcpStream::connect(("127.0.0.1", d.front)).unwrap();
    s.write_all(post_head("/v1/completions", &completion("gone", 1).to_string()).as_bytes()).unwrap();
    d.wait_metric(HELD, 1.0);
    drop(s);
    let deadline = Instant::now() + TIMEOUT;
    while d.metric(HELD) > 0.0 {
        assert!(Instant::now() < deadline, "the place was not freed");
        std::thread::sleep(Duration::from_millis(20));
    }
    // The one place is free again: the next request is held, then answered.
    let a = common::http::post_json(&d.url("/v1/completions"), &completion("next", 1), TIMEOUT).unwrap();
    assert_eq!(a.status, 200, "{}", a.body);
    assert_eq!(outcome(&d, "held"), 2.0, "both were held: the first left before the engine served");
    d.w.wait_ready();
    assert_eq!(d.w.stop(), 0);
}

/// A request held past `front.hold` gets the 503 too.
#[test]
fn a_request_held_past_the_hold_is_answered_503() {
    let mut d = Door::start(&["--shards", "100", "--shard-time", "50ms"], "hold = \"300ms\"\n");
    let a = common::http::post_json(&d.url("/v1/completions"), &completion("p", 1), TIMEOUT).unwrap();
    assert_eq!(a.status, 503, "{}", a.body);
    assert!(a.json()["error"]["message"].as_str().unwrap().contains("the longest a request waits"), "{}", a.body);
    d.w.wait_ready();
    assert_eq!(d.w.stop(), 0);
}

/// The engine killed under a steady load: no client is refused; each
/// request is answered 200 (those that came while it restarted were
/// held) or 502 (those in flight when it died).
#[test]
fn a_killed_engine_refuses_no_client() {
    let mut d = Door::start(&["--token-time", "10ms"], "");
    d.w.wait_ready();
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let clients: Vec<_> = (0..4)
        .map(|i| {
            let (url, stop) = (d.url("/v1/completions"), stop.clone());
            std::thread::spawn(move || {
                let mut seen = Vec::new();
                while !stop.load(std::sync::atomic::Ordering::SeqCst) {
                    let a = common::http::post_json(&url, &completion(&format!("c{i}"), 20), TIMEOUT);
                    seen.push(a.map(|a| a.status));
                }
                seen
            })
        })
        .collect();
    d.wait_metric(&format!("{FRONT} outcome=\"forwarded\""), 8.0);
    let sim = sim_pid(&d.w);
    nix::sys::signal::kill(nix::unistd::Pid::from_raw(sim as i32), nix::sys::signal::Signal::SIGKILL).unwrap();
    d.w.wait_ready();
    let after = outcome(&d, "forwarded");
    d.wait_metric(&format!("{FRONT} outcome=\"forwarded\""), after + 8.0);
    stop.store(true, std::sync::atomic::Ordering::SeqCst);
    let mut statuses = std::collections::BTreeMap::new();
    for c in clients {
        for s in c.join().unwrap() {
            let s = s.unwrap_or_else(|e| panic!("a client was not answered: {e}"));
            *statuses.entry(s).or_insert(0) += 1;
        }
    }
    assert!(statuses.keys().all(|s| *s == 200 || *s == 502), "{statuses:?}");
    assert!(statuses[&200] >= 16, "{statuses:?}");
    assert!(outcome(&d, "held") >= 1.0, "requests came while it restarted: {statuses:?}");
    assert_eq!(d.w.stop(), 0);
}

/// With `retry-unanswered`, a request in flight when the engine dies,
/// answered by no byte yet, is held and sent once more after the restart.
#[test]
fn an_unanswered_request_is_sent_again_after_the_restart() {
    let mut d = Door::start(&["--token-time", "20ms"], "retry-unanswered = true\n");
    d.w.wait_ready();
    // Long enough to be in flight when the engine is killed.
    let url = d.url("/v1/completions");
    let client = std::thread::spawn(move || common::http::post_json(&url, &completion("long", 500), TIMEOUT));
    d.wait_metric(IN_FLIGHT, 1.0);
    let sim = sim_pid(&d.w);
    nix::sys::signal::kill(nix::unistd::Pid::from_raw(sim as i32), nix::sys::signal::Signal::SIGKILL).unwrap();
    d.w.wait_ready();
    let a = client.join().unwrap().expect("answered");
    assert_eq!(a.status, 200, "{}", a.body);
    assert_eq!(outcome(&d, "retried"), 1.0);
    assert_eq!(outcome(&d, "upstream_error"), 0.0);
    assert_eq!(d.w.stop(), 0);
}

/// Without it, the same request is answered 502, OpenAI-shaped.
#[test]
fn a_request_in_flight_when_the_engine_dies_gets_502() {
    let mut d = Door::start(&["--token-time", "20ms"], "");
    d.w.wait_ready();
    let url = d.url("/v1/completions");
    let client = std::thread::spawn(move || common::http::post_json(&url, &completion("long", 500), TIMEOUT));
    d.wait_metric(IN_FLIGHT, 1.0);
    let sim = sim_pid(&d.w);
    nix::sys::signal::kill(nix::unistd::Pid::from_raw(sim as i32), nix::sys::signal::Signal::SIGKILL).unwrap();
    let a = client.join().unwrap().expect("answered");
    assert_eq!(a.status, 502, "{}", a.body);
    assert_eq!(a.json()["error"]["type"], "upstream_error");
    d.w.wait_ready();
    assert_eq!(d.w.stop(), 0);
}

/// Server-sent events pass one by one, as the engine writes them: the
/// first arrives long before the last is generated.
#[test]
fn server_sent_events_pass_event_by_event() {
    let mut d = Door::start(&["--token-time", "400ms"], "");
    d.w.wait_ready();
    let mut body = completion("sse", 5);
    body["stream"] = true.into();
    let mut at = Vec::new();
    let status = common::http::post_json_lines(&d.url("/v1/completions"), &body, TIMEOUT, |line| {
        if line.starts_with("data: ") {
            at.push((Instant::now(), line.to_string()));
        }
    })
    .unwrap();
    assert_eq!(status, 200);
    assert_eq!(at.len(), 6, "5 tokens and [DONE]: {at:?}");
    assert_eq!(at[5].1, "data: [DONE]");
    // Buffered, they would arrive together; passed on, 400 ms apart (at
    // least 100 ms at the client: a loaded machine may hold it 300 ms).
    for pair in at[..5].windows(2) {
        assert!(pair[1].0 - pair[0].0 >= Duration::from_millis(100), "{at:?}");
    }
    assert_eq!(d.w.stop(), 0);
}

/// A stream whose engine dies between two events ends as vLLM ends a
/// stream whose generation failed: an error event, then `[DONE]`, and the
/// transfer whole — not a connection torn under the client.
#[test]
fn a_stream_whose_engine_dies_ends_with_an_error_event() {
    let mut d = Door::start(&["--token-time", "100ms"], "");
    d.w.wait_ready();
    let sim = sim_pid(&d.w);
    let mut body = completion("sse", 500);
    body["stream"] = true.into();
    let mut lines = Vec::new();
    let status = common::http::post_json_lines(&d.url("/v1/completions"), &body, TIMEOUT, |line| {
        if line.starts_with("data: ") {
            lines.push(line.to_string());
            if lines.len() == 2 {
                let pid = nix::unistd::Pid::from_raw(sim as i32);
                nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGKILL).unwrap();
            }
        }
    })
    .unwrap_or_else(|e| panic!("the stream was torn: {e}"));
    assert_eq!(status, 200);
    let n = lines.len();
    assert!((4..500).contains(&n), "{lines:?}");
    let error: serde_json::Value = serde_json::from_str(lines[n - 2].strip_prefix("data: ").unwrap()).unwrap();
    assert_eq!(error["error"]["type"], "upstream_error", "{lines:?}");
    assert_eq!(error["error"]["code"], 502, "{lines:?}");
    assert_eq!(lines[n - 1], "data: [DONE]");
    d.w.wait_ready();
    assert_eq!(d.w.stop(), 0);
}

/// A client that goes away mid-stream cancels its request at the engine,
/// which logs it aborted.
#[test]
fn a_client_gone_cancels_its_upstream_request() {
    let mut d = Door::start(&["--token-time", "20ms"], "");
    d.w.wait_ready();
    let mut body = completion("gone", 100_000);
    body["stream"] = true.into();
    let mut s = std::net::TcpStream::connect(("127.0.0.1", d.front)).unwrap();
    s.write_all(post_head("/v1/completions", &body.to_string()).as_bytes()).unwrap();
    let mut buf = [0u8; 4096];
    let n = s.read(&mut buf).unwrap();
    assert!(String::from_utf8_lossy(&buf[..n]).starts_with("HTTP/1.1 200"));
    drop(s);
    let log = d.w.path("t.log");
    common::wait_for_file(&log, || {
        std::fs::read_to_string(&log).unwrap_or_default().contains("Aborted request cmpl-gone.")
    });
    assert_eq!(d.w.stop(), 0);
}

/// A body over `front.max-body` is answered 413; vLLM's development
/// routes 404; neither reaches the engine.
#[test]
fn large_bodies_and_development_routes_are_answered_by_the_door() {
    let mut d = Door::start(&[], "max-body = \"1 KiB\"\n");
    d.w.wait_ready();
    let big = completion(&"x".repeat(2048), 1);
    let a = common::http::post_json(&d.url("/v1/completions"), &big, TIMEOUT).unwrap();
    assert_eq!(a.status, 413, "{}", a.body);
    // Chunked, with no length said: refused once past the limit.
    let chunked = format!(
        "POST /v1/completions HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\n{:x}\r\n{}\r\n0\r\n\r\n",
        2048,
        "x".repeat(2048)
    );
    let r = raw(d.front, &chunked);
    assert!(r.starts_with("HTTP/1.1 413"), "{r}");
    for path in ["/sleep?level=1", "/wake_up", "/collective_rpc", "/%73leep", "//server_info"] {
        let r = raw(d.front, &post_head(path, "{}"));
        assert!(r.starts_with("HTTP/1.1 404"), "{path}: {r}");
    }
    let ok = common::http::get(&d.url("/v1/models"), TIMEOUT).unwrap();
    assert_eq!(ok.status, 200);
    assert_eq!(d.w.stop(), 0);
}

/// Request smuggling: conflicting lengths are refused (400), or read as
/// RFC 9112 says (chunked wins, and the connection closes after the
/// answer); nothing smuggled behind a body reaches the engine.
#[test]
fn conflicting_lengths_smuggle_nothing() {
    let mut d = Door::start(&[], "");
    d.w.wait_ready();
    let smuggled = r#"{"prompt":"smuggled","stream":true,"max_tokens":1}"#;
    let hidden = format!(
        "POST /v1/completions HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{smuggled}",
        smuggled.len()
    );
    for head in [
        format!("Content-Length: {}\r\nContent-Length: {}\r\n", smuggled.len(), smuggled.len() + 1),
        "Transfer-Encoding: chunked, identity\r\n".to_string(),
        // Read as chunked, the JSON is no chunk: refused before it is sent.
        format!("Content-Length: {}\r\nTransfer-Encoding: chunked\r\n", smuggled.len()),
    ] {
        let r = raw(d.front, &format!("POST /v1/completions HTTP/1.1\r\nHost: t\r\n{head}\r\n{smuggled}"));
        assert!(r.starts_with("HTTP/1.1 400"), "{head}: {r}");
    }
    // A valid empty chunked body, a request hidden behind it (as a server
    // that reads the Content-Length would see it): one answer, then the
    // connection is closed.
    for head in
        ["Content-Length: 5\r\nTransfer-Encoding: chunked\r\n", "Transfer-Encoding: chunked\r\nContent-Length: 5\r\n"]
    {
        let r = raw(d.front, &format!("POST /v1/models HTTP/1.1\r\nHost: t\r\n{head}\r\n0\r\n\r\n{hidden}"));
        assert_eq!(r.matches("HTTP/1.1 ").count(), 1, "{r}");
    }
    assert!(!d.w.log().contains("cmpl-smuggled"), "{}", d.w.log());
    assert_eq!(d.w.stop(), 0);
}

/// Slowloris: a connection that sends its head a byte at a time is closed
/// after the header-read timeout, and others are served meanwhile.
#[test]
fn a_slow_head_is_cut_off() {
    let mut d = Door::start(&[], "");
    d.w.wait_ready();
    let mut s = std::net::TcpStream::connect(("127.0.0.1", d.front)).unwrap();
    s.set_read_timeout(Some(TIMEOUT)).unwrap();
    let began = Instant::now();
    s.write_all(b"GET /v1/models HTTP/1.1\r\n").unwrap();
    let dribble = std::thread::spawn({
        let mut s = s.try_clone().unwrap();
        move || {
            for _ in 0..100 {
                if s.write_all(b"X").is_err() {
                    return;
                }
                std::thread::sleep(Duration::from_millis(200));
            }
        }
    });
    assert_eq!(common::http::get(&d.url("/v1/models"), TIMEOUT).unwrap().status, 200);
    let mut rest = Vec::new();
    let _ = s.read_to_end(&mut rest);
    let took = began.elapsed();
    assert!(took >= Duration::from_secs(4) && took < Duration::from_secs(15), "{took:?}");
    dribble.join().unwrap();
    assert_eq!(d.w.stop(), 0);
}

/// The simulator's pid: the warden's child.
fn sim_pid(w: &Warden) -> u32 {
    let doc: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(w.path("status.json")).unwrap()).unwrap();
    doc["child_pid"].as_u64().expect("a child") as u32
}

fn post_head(path: &str, body: &str) -> String {
    format!(
        "POST {path} HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    )
}

/// Send `text` on a new connection; all that comes back until it closes.
fn raw(port: u16, text: &str) -> String {
    let mut s = std::net::TcpStream::connect(("127.0.0.1", port)).unwrap();
    s.set_read_timeout(Some(TIMEOUT)).unwrap();
    s.write_all(text.as_bytes()).unwrap();
    let mut out = Vec::new();
    let _ = s.read_to_end(&mut out);
    String::from_utf8_lossy(&out).into_owned()
}

fn header(answer: &str, name: &str) -> Option<String> {
    answer.split("\r\n\r\n").next()?.lines().find_map(|l| {
        let (k, v) = l.split_once(':')?;
        k.eq_ignore_ascii_case(name).then(|| v.trim().to_string())
    })
}

/// Wait (on inotify, under one generous deadline) until the warden has
/// logged `what`.
fn wait_logged(d: &mut Door, what: &str) {
    d.w.wait_for_file("warden.stderr", |w| w.stderr().contains(what));
}

/// A completion sent on `conn` (asking to close it), and all that came
/// back until it closed.
fn complete_on(conn: &mut std::net::TcpStream, prompt: &str) -> (std::io::Result<usize>, String) {
    let body = completion(prompt, 2).to_string();
    let request = format!(
        "POST /v1/completions HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    );
    conn.write_all(request.as_bytes()).unwrap();
    let mut out = Vec::new();
    let read = conn.read_to_end(&mut out);
    (read, String::from_utf8_lossy(&out).into_owned())
}

/// A connection accepted before an upgrade's hand-over whose request comes
/// after it is not idle: its request is answered, not its connection
/// closed under it (which its client meets as a reset or a broken pipe).
#[test]
fn a_connection_whose_request_comes_during_the_hand_over_is_answered() {
    let bin = tempfile::tempdir().unwrap();
    let exe = bin.path().join("vllm-warden");
    std::fs::copy(common::exe(), &exe).unwrap();
    let opts = common::Opts { exe: Some(exe.clone()), ..common::Opts::default() };
    let mut d = Door::start_with(&["--token-time", "20ms"], "", opts);
    d.w.wait_ready();
    // Connected first; the long request's connection after it: once that
    // request is in flight, this one was accepted (one listener, taken in
    // order).
    let mut early = std::net::TcpStream::connect(("127.0.0.1", d.front)).unwrap();
    early.set_read_timeout(Some(TIMEOUT)).unwrap();
    let url = d.url("/v1/completions");
    let long = std::thread::spawn(move || common::http::post_json(&url, &completion("long", 150), TIMEOUT));
    d.wait_metric(IN_FLIGHT, 1.0);
    d.w.ask_upgrade(&exe);
    wait_logged(&mut d, "the front door takes no new connection");
    wait_logged(&mut d, "waits for 2 open");
    let (read, answer) = complete_on(&mut early, "early");
    assert!(read.is_ok() && answer.starts_with("HTTP/1.1 200"), "{read:?}: {answer}");
    assert!(answer.contains("text_completion"), "{answer}");
    let a = long.join().unwrap().unwrap_or_else(|e| panic!("the long request was cut: {e}"));
    assert_eq!(a.status, 200, "{}", a.body);
    d.w.wait_note("the upgrade", |n| n.starts_with("STATUS=upgraded from"));
    assert_eq!(d.w.stop(), 0);
}

/// The warden's exit (a stop, a service restart) gives a connection it
/// accepted its answer before the process ends, though its request is
/// still on its way: a 503 (it will not serve again), not a reset.
#[test]
fn a_connection_open_at_the_exit_is_answered_not_reset() {
    // No drain before the stop: the connection's header-read timeout
    // would close it first.
    let mut d = Door::start(&[], "[drain]\non-stop = false\n");
    d.w.wait_ready();
    let mut early = std::net::TcpStream::connect(("127.0.0.1", d.front)).unwrap();
    early.set_read_timeout(Some(TIMEOUT)).unwrap();
    d.w.signal(nix::sys::signal::Signal::SIGTERM);
    wait_logged(&mut d, "the front door answers its last requests: 1 connections open");
    let (read, answer) = complete_on(&mut early, "late");
    assert!(read.is_ok() && answer.starts_with("HTTP/1.1 503"), "{read:?}: {answer}");
    assert_eq!(d.w.wait_exit(), 0);
    assert!(!d.w.stderr().contains("did not empty"), "{}", d.w.stderr());
}

/// `vllm-warden upgrade` while requests are being forwarded, streamed and
/// not: the front door takes no new connection, every request in flight
/// is answered whole by the old warden before the exec (200, a stream to
/// its `[DONE]`), a client that connects meanwhile waits in the backlog
/// and is answered by the successor, which serves the next ones.
#[test]
fn an_upgrade_cuts_no_request_in_flight() {
    let bin = tempfile::tempdir().unwrap();
    let exe = bin.path().join("vllm-warden");
    std::fs::copy(common::exe(), &exe).unwrap();
    let opts = common::Opts { exe: Some(exe.clone()), ..common::Opts::default() };
    // 150 tokens of 20 ms: three seconds an answer, far longer than an
    // upgrade takes without the wait.
    let mut d = Door::start_with(&["--token-time", "20ms"], "", opts);
    d.w.wait_ready();
    let plain: Vec<_> = (0..3)
        .map(|i| {
            let url = d.url("/v1/completions");
            std::thread::spawn(move || common::http::post_json(&url, &completion(&format!("u{i}"), 150), TIMEOUT))
        })
        .collect();
    let streamed: Vec<_> = (0..3)
        .map(|i| {
            let url = d.url("/v1/completions");
            std::thread::spawn(move || {
                let mut body = completion(&format!("s{i}"), 150);
                body["stream"] = true.into();
                let mut events = Vec::new();
                let status = common::http::post_json_lines(&url, &body, TIMEOUT, |line| {
                    if let Some(data) = line.strip_prefix("data: ") {
                        events.push(data.to_string());
                    }
                });
                status.map(|s| (s, events))
            })
        })
        .collect();
    d.wait_metric(IN_FLIGHT, 6.0);
    d.w.ask_upgrade(&exe);
    // The door empties (or, as it did before, the exec comes at once): a
    // new client now waits in the backlog.
    let deadline = Instant::now() + TIMEOUT;
    while !["the front door takes no new connection", "upgrading to"].iter().any(|l| d.w.stderr().contains(l)) {
        assert!(Instant::now() < deadline, "no hand-over{}", d.w.seen());
        std::thread::sleep(Duration::from_millis(20));
    }
    let url = d.url("/v1/completions");
    let waiting = std::thread::spawn(move || common::http::post_json(&url, &completion("later", 2), TIMEOUT));
    for c in plain {
        let a = c.join().unwrap().unwrap_or_else(|e| panic!("a request was cut: {e}"));
        assert_eq!(a.status, 200, "{}", a.body);
        assert_eq!(a.json()["object"], "text_completion");
    }
    for c in streamed {
        let (status, events) = c.join().unwrap().unwrap_or_else(|e| panic!("a stream was cut: {e}"));
        assert_eq!(status, 200);
        assert_eq!(events.len(), 151, "150 tokens and [DONE]");
        assert_eq!(events[150], "[DONE]");
    }
    d.w.wait_note("the upgrade", |n| n.starts_with("STATUS=upgraded from"));
    let a = waiting.join().unwrap().expect("the client that came during the upgrade is answered");
    assert_eq!(a.status, 200, "{}", a.body);
    let a = common::http::post_json(&d.url("/v1/completions"), &completion("after", 2), TIMEOUT).unwrap();
    assert_eq!(a.status, 200, "{}", a.body);
    assert!(!d.w.stderr().contains("the upgrade cuts"), "{}", d.w.stderr());
    assert_eq!(d.w.stop(), 0);
}

/// What outsiders found: a body that stops coming is answered 408 after
/// `BODY_IDLE_TIMEOUT` (5 s), not after a deadline for the whole body; a request
/// with two `Host` headers is answered 400 and `CONNECT` 405, neither
/// forwarded.
#[test]
fn a_stalled_body_two_hosts_and_connect_are_answered_by_the_door() {
    let mut d = Door::start(&[], "");
    d.w.wait_ready();
    let started = Instant::now();
    let r = raw(
        d.front,
        "POST /v1/completions HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\nContent-Length: 100\r\n\r\n{\"prompt\":",
    );
    assert!(r.starts_with("HTTP/1.1 408"), "{r}");
    assert!(r.contains("no byte of the body came for 5s"), "{r}");
    assert!(started.elapsed() < Duration::from_secs(30), "408 after {:?}", started.elapsed());
    let r = raw(d.front, "GET /v1/models HTTP/1.1\r\nHost: a\r\nHost: b\r\nConnection: close\r\n\r\n");
    assert!(r.starts_with("HTTP/1.1 400"), "{r}");
    assert!(r.contains("more than one Host header"), "{r}");
    let r = raw(d.front, "CONNECT 127.0.0.1:22 HTTP/1.1\r\nHost: 127.0.0.1:22\r\n\r\n");
    assert!(r.starts_with("HTTP/1.1 405"), "{r}");
    assert_eq!(outcome(&d, "forwarded"), 0.0, "none of them reached the engine");
    assert_eq!(d.w.stop(), 0);
}

/// The status document's `front.held` is the count now, not as of the
/// machine's last change: requests held while the model is drained (no
/// change of the machine comes with them) are counted.
#[test]
fn the_status_document_counts_the_held_requests_now() {
    let mut d = Door::start(&[], "");
    d.w.wait_ready();
    let (ok, out) = d.w.cli(&["drain"]);
    assert!(ok, "{out}");
    let clients: Vec<_> = (0..2)
        .map(|i| {
            let url = d.url("/v1/completions");
            std::thread::spawn(move || common::http::post_json(&url, &completion(&format!("h{i}"), 1), TIMEOUT))
        })
        .collect();
    d.wait_metric(HELD, 2.0);
    let doc: serde_json::Value = serde_json::from_str(
        &common::http::get(&format!("http://127.0.0.1:{}/status", d.server), TIMEOUT).unwrap().body,
    )
    .unwrap();
    assert_eq!(doc["front"]["held"], 2, "{doc}");
    let (ok, out) = d.w.cli(&["undrain"]);
    assert!(ok, "{out}");
    for c in clients {
        assert_eq!(c.join().unwrap().unwrap().status, 200);
    }
    assert_eq!(d.w.stop(), 0);
}

/// A slow sender of the attack in issue 56 (B1): from `from`, a request
/// whose body (`len` bytes, `Content-Length`) comes a KiB every 250 ms, on
/// a new connection each time the door cuts it, until `stop` and cut once
/// at least. What it was answered each time (`None`: the connection ended
/// with no answer read).
fn slow_sender(
    port: u16,
    from: std::net::Ipv4Addr,
    len: usize,
    stop: &std::sync::atomic::AtomicBool,
    attached: std::sync::mpsc::Sender<()>,
) -> Vec<Option<String>> {
    let began = Instant::now();
    let mut answers = Vec::new();
    let mut attached = Some(attached);
    while answers.is_empty() || !stop.load(std::sync::atomic::Ordering::SeqCst) {
        assert!(began.elapsed() < TIMEOUT * 2, "a slow sender was never cut: {answers:?}");
        let sock = socket2::Socket::new(socket2::Domain::IPV4, socket2::Type::STREAM, None).unwrap();
        sock.bind(&std::net::SocketAddr::from((from, 0)).into()).unwrap();
        sock.connect(&std::net::SocketAddr::from(([127, 0, 0, 1], port)).into()).unwrap();
        let mut s: std::net::TcpStream = sock.into();
        let head = format!(
            "POST /v1/completions HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\nContent-Length: {len}\r\n\r\n"
        );
        let mut sent = s.write_all(head.as_bytes());
        if let Some(a) = attached.take() {
            let _ = a.send(());
        }
        let mut answer = Vec::new();
        while sent.is_ok() {
            sent = s.write_all(&[b' '; 1024]);
            std::thread::sleep(Duration::from_millis(250));
            // Anything come back (the door's answer, or its close)? Looked
            // at before the next write, which a closed socket would answer
            // with a reset.
            s.set_nonblocking(true).unwrap();
            let mut b = [0u8; 1];
            let ended = !matches!(s.peek(&mut b), Err(e) if e.kind() == std::io::ErrorKind::WouldBlock);
            s.set_nonblocking(false).unwrap();
            if ended {
                break;
            }
        }
        s.set_read_timeout(Some(TIMEOUT)).unwrap();
        let _ = s.read_to_end(&mut answer);
        let answer = String::from_utf8_lossy(&answer).into_owned();
        answers.push((!answer.is_empty()).then_some(answer));
    }
    answers
}

/// What outsiders found (issue 56, B1): 40 clients sending their bodies a
/// KiB at a time at a cap of 32 connections held the front door: bodies
/// over 1 MiB streamed to the engine were never cut, smaller ones held
/// their place for 60 s, and 0 of 10 fresh requests were served. Now a
/// body has 5 s and a second more for every `front.min-body-rate` bytes
/// (16 KiB here; they send 4 KiB a second), the door at its cap makes room
/// by cutting the slowest body of the client holding the most, and one
/// client past its share (a quarter) makes room from its own: the fresh
/// requests, from another address, are all served; every slow sender is
/// cut with 408, the engine's side of a streamed one aborted.
#[test]
fn slow_bodies_at_the_connection_cap_are_cut_and_fresh_requests_served() {
    let mut d = Door::start(&[], "max-connections = 32\nmin-body-rate = \"16 KiB\"\n");
    d.w.wait_ready();
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let (attached, all_attached) = std::sync::mpsc::channel();
    const SLOW: usize = 40;
    let slow: Vec<_> = (0..SLOW)
        .map(|i| {
            let (port, stop, attached) = (d.front, stop.clone(), attached.clone());
            // Two in three streamed to the engine (over 1 MiB), one in
            // three read whole before it is sent.
            let len = if i % 3 == 2 { 256 << 10 } else { 2 << 20 };
            std::thread::spawn(move || slow_sender(port, [127, 0, 0, 2].into(), len, &stop, attached))
        })
        .collect();
    for _ in 0..SLOW {
        all_attached.recv_timeout(TIMEOUT).expect("every slow sender connected");
    }
    let fresh: Vec<_> = (0..10)
        .map(|i| {
            let url = d.url("/v1/completions");
            std::thread::spawn(move || {
                let asked = Instant::now();
                let a = common::http::post_json(&url, &completion(&format!("fresh{i}"), 1), TIMEOUT);
                (a, asked.elapsed())
            })
        })
        .collect();
    let mut took = Vec::new();
    for f in fresh {
        let (a, t) = f.join().unwrap();
        let a = a.expect("a fresh request answered");
        assert_eq!(a.status, 200, "{}", a.body);
        took.push(t);
    }
    took.sort();
    eprintln!("fresh requests with {SLOW} slow senders attached: {took:?}");
    stop.store(true, std::sync::atomic::Ordering::SeqCst);
    let (mut cut, mut unread) = (0, 0);
    for s in slow {
        for a in s.join().unwrap() {
            let Some(a) = a else {
                unread += 1;
                continue;
            };
            assert!(a.starts_with("HTTP/1.1 408"), "{a}");
            assert!(header(&a, "connection").is_some_and(|c| c == "close"), "{a}");
            cut += 1;
        }
    }
    eprintln!("slow senders cut: {cut} answered 408, {unread} closed before their answer was read");
    assert!(cut >= SLOW, "{cut} answered 408, {unread} closed unread");
    // Nothing of theirs left with the engine.
    let deadline = Instant::now() + TIMEOUT;
    while d.metric(IN_FLIGHT) > 0.0 {
        assert!(Instant::now() < deadline, "requests still in flight");
        std::thread::sleep(Duration::from_millis(20));
    }
    let said = d.w.stderr();
    assert!(said.contains("came too slowly"), "{said}");
    assert_eq!(d.w.stop(), 0);
}
