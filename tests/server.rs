//! The warden's HTTP endpoint, with the real binary and the simulated
//! vLLM: the unix socket and the TCP listener, the token, drain, undrain
//! and restart through the commands, and a drain that waits for a request
//! in flight.

mod common;

use std::path::Path;
use std::time::{Duration, Instant};

use common::{TIMEOUT, Warden, config, free_port};

const FAST: &str = "[restart]\ninitial-delay = \"0s\"\n";

/// One request over the warden's unix socket.
fn local(socket: &Path, method: &str, path: &str) -> (u16, String) {
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
    rt.block_on(vllm_warden::server::client::call_within(socket, method, path, TIMEOUT)).unwrap()
}

/// One request over TCP, with a bearer token if given.
fn tcp(port: u16, method: &str, path: &str, token: Option<&str>) -> (u16, String) {
    let agent: ureq::Agent =
        ureq::Agent::config_builder().http_status_as_error(false).timeout_global(Some(TIMEOUT)).build().into();
    let url = format!("http://127.0.0.1:{port}{path}");
    let mut r = match method {
        "GET" => agent.get(&url).call(),
        _ => {
            let mut req = agent.post(&url);
            if let Some(t) = token {
                req = req.header("Authorization", &format!("Bearer {t}"));
            }
            req.send_empty()
        }
    }
    .unwrap();
    (r.status().as_u16(), r.body_mut().read_to_string().unwrap())
}

fn command(w: &Warden, what: &str) -> (i32, String) {
    // The instance's environment, as a unit's ExecStartPost= would have it.
    let o = std::process::Command::new(common::exe())
        .args([what, "-c"])
        .arg(w.path("t.toml"))
        .env("RUNTIME_DIRECTORY", w.path("run"))
        .output()
        .unwrap();
    let text = format!("{}{}", String::from_utf8_lossy(&o.stdout), String::from_utf8_lossy(&o.stderr));
    (o.status.code().unwrap(), text)
}

fn server_config(d: &Path, p: u16, listen: u16, extra: &str) -> String {
    let token = d.join("token");
    std::fs::write(&token, "s3cret\n").unwrap();
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(&token, std::fs::Permissions::from_mode(0o600)).unwrap();
    let server =
        format!("{FAST}[server]\nlisten = \"127.0.0.1:{listen}\"\ntoken-file = \"{}\"\n{extra}", token.display());
    config(d, p, &["--shards", "2", "--shard-time", "20ms"], "", &server)
}

#[test]
fn the_endpoint_answers_on_the_socket_and_on_tcp_and_changes_need_the_token() {
    let listen = free_port();
    let mut w = Warden::start(|d, p| server_config(d, p, listen, "[drain]\ndelay = \"0s\"\n"));
    w.wait_ready();
    let socket = w.path("run/control.sock");
    use std::os::unix::fs::{FileTypeExt, PermissionsExt};
    let meta = std::fs::metadata(&socket).unwrap();
    assert!(meta.file_type().is_socket());
    assert_eq!(meta.permissions().mode() & 0o777, 0o660);

    assert_eq!(local(&socket, "GET", "/livez"), (200, "ready\n".into()));
    assert_eq!(tcp(listen, "GET", "/livez", None), (200, "ready\n".into()));
    assert_eq!(tcp(listen, "GET", "/readyz", None), (200, "ready\n".into()));
    let (code, doc) = tcp(listen, "GET", "/status", None);
    assert_eq!(code, 200);
    let doc: serde_json::Value = serde_json::from_str(&doc).unwrap();
    assert_eq!((doc["state"].as_str(), doc["warden_pid"].as_u64()), (Some("ready"), Some(w.pid.into())));
    let (code, metrics) = tcp(listen, "GET", "/metrics", None);
    assert_eq!(code, 200);
    assert!(metrics.contains("vllm_warden_ready{name=\"t\"} 1\n"), "{metrics}");
    assert!(metrics.contains("# TYPE vllm_warden_child_starts_total counter\n"), "{metrics}");
    // The textfile is the same registry: the same families, in the same form.
    let file = std::fs::read_to_string(w.path("vllm_warden.prom")).unwrap();
    let families = |t: &str| t.lines().filter(|l| l.starts_with("# TYPE")).map(String::from).collect::<Vec<_>>();
    assert_eq!(families(&file), families(&metrics));

    // Changes over TCP: only with the token.
    assert_eq!(tcp(listen, "POST", "/drain", None).0, 403);
    assert_eq!(tcp(listen, "POST", "/drain", Some("wrong")).0, 403);
    assert_eq!(tcp(listen, "GET", "/readyz", None).0, 200, "nothing changed");
    let (code, body) = tcp(listen, "POST", "/drain", Some("s3cret"));
    assert_eq!((code, body.as_str()), (202, "draining\n"));
    // Unready as soon as the drain was answered.
    let (code, body) = tcp(listen, "GET", "/readyz", None);
    assert_eq!(code, 503);
    assert!(body.starts_with("drain"), "{body}");
    w.wait_note("drained", |n| n.starts_with("STATUS=drained: pid "));
    assert_eq!(tcp(listen, "GET", "/livez", None), (200, "drained\n".into()));
    let (code, out) = command(&w, "status");
    assert_eq!(code, 3, "drained is not ready: {out}");
    assert!(out.starts_with("t: drained, pid "), "{out}");

    // Back into rotation with the command, over the socket.
    let (code, out) = command(&w, "undrain");
    assert_eq!((code, out.as_str()), (0, "t: ready\n"));
    assert_eq!(tcp(listen, "GET", "/readyz", None).0, 200);
    let (code, out) = command(&w, "undrain");
    assert_eq!((code, out.as_str()), (0, "t: ready\n"), "nothing to undo is no error");

    // A restart: drained, stopped, started again, ready again.
    let (code, out) = command(&w, "restart");
    assert_eq!(code, 0, "{out}");
    w.wait_note("the restart", |n| n.starts_with("STATUS=restarting: stopping pid "));
    w.wait_ready();
    assert_eq!(tcp(listen, "GET", "/readyz", None).0, 200);
    let doc: serde_json::Value = serde_json::from_str(&local(&socket, "GET", "/status").1).unwrap();
    assert_eq!(doc["restarts"], 1);
    assert_eq!(w.stop(), 0);
    assert!(!socket.exists(), "the socket goes with the warden");
    let (code, out) = command(&w, "drain");
    assert_eq!(code, 4, "not running: {out}");
}

/// A drain waits until the server's own metrics show no request in flight:
/// the drained status comes only after the running completion has been
/// answered, and the stop signal after it.
#[test]
fn a_stop_drains_and_waits_for_the_request_in_flight() {
    let listen = free_port();
    let mut w = Warden::start(|d, p| server_config(d, p, listen, "[drain]\ndelay = \"100ms\"\n"));
    w.wait_ready();
    let port = w.port;
    // 100 tokens, one every 20 ms: about 2 s in flight.
    let client = std::thread::spawn(move || {
        let body = serde_json::json!({"model": "tiny-llama", "prompt": "x", "max_tokens": 100});
        let r = ureq::post(&format!("http://127.0.0.1:{port}/v1/completions")).send_json(&body);
        (r.map(|r| r.status().as_u16()).unwrap_or(0), Instant::now())
    });
    // The request is in flight once the server counts it (each scrape is
    // an answer from the server; no sleep).
    let deadline = Instant::now() + TIMEOUT;
    loop {
        let m = ureq::get(&format!("http://127.0.0.1:{port}/metrics")).call().unwrap().body_mut().read_to_string();
        if m.unwrap().contains("vllm:num_requests_running{engine=\"0\",model_name=\"tiny-llama\"} 1.0") {
            break;
        }
        assert!(Instant::now() < deadline, "the completion never started");
    }
    let asked = Instant::now();
    w.signal(nix::sys::signal::Signal::SIGTERM);
    w.wait_note("stopping", |n| n == "STOPPING=1");
    let answered = asked.elapsed();
    // At the same instant in the machine (the driver test holds it to
    // the virtual millisecond); here a loaded machine gets some room.
    assert!(answered < Duration::from_secs(1), "STOPPING=1 took {answered:?}");
    eprintln!("SIGTERM during a request in flight: STOPPING=1 after {answered:?}");
    assert_eq!(tcp(listen, "GET", "/readyz", None).0, 503);
    assert_eq!(w.wait_exit(), 0);
    let (code, finished) = client.join().unwrap();
    assert_eq!(code, 200, "the request in flight was served");
    assert!(finished.duration_since(asked) > Duration::from_millis(500), "the completion was still running");
    let log = w.stderr();
    assert!(log.contains("1 request(s) running or waiting"), "{log}");
    assert!(log.contains("no request in flight after"), "{log}");
}

#[test]
fn a_tcp_listener_that_cannot_be_had_is_exit_78() {
    let held = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let listen = held.local_addr().unwrap().port();
    let mut w = Warden::start(|d, p| server_config(d, p, listen, ""));
    assert_eq!(w.wait_exit(), 78);
    assert!(w.stderr().contains("cannot listen on 127.0.0.1:"), "{}", w.stderr());
}
