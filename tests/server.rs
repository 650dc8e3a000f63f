//! The warden's HTTP endpoint, with the real binary and the simulated
//! vLLM: the unix socket and the TCP listener, the token, drain, undrain
//! and restart through the commands, and a drain that waits for a request
//! in flight.

mod common;
#[path = "support/nobody.rs"]
mod nobody;

use std::path::Path;
use std::time::{Duration, Instant};

use common::{TIMEOUT, Warden, config, free_port};

const FAST: &str = "[restart]\ninitial-delay = \"0s\"\n";

/// One request over the warden's unix socket.
fn local(socket: &Path, method: &str, path: &str) -> (u16, String) {
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
    rt.block_on(vllm_warden::daemon::server::client::call_within(socket, method, path, TIMEOUT)).unwrap()
}

/// One request over TCP, with a bearer token if given.
fn tcp(port: u16, method: &str, path: &str, token: Option<&str>) -> (u16, String) {
    let url = format!("http://127.0.0.1:{port}{path}");
    let r = match method {
        "GET" => common::http::get(&url, TIMEOUT),
        _ => common::http::post(&url, token, TIMEOUT),
    }
    .unwrap();
    (r.status, r.body)
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
        let r =
            common::http::post_json(&format!("http://127.0.0.1:{port}/v1/completions"), &body, common::http::FOREVER);
        (r.map(|r| r.status).unwrap_or(0), Instant::now())
    });
    // The request is in flight once the server counts it (each scrape is
    // an answer from the server; no sleep).
    let deadline = Instant::now() + TIMEOUT;
    loop {
        let m = common::http::get(&format!("http://127.0.0.1:{port}/metrics"), common::http::FOREVER).unwrap().body;
        if m.contains("vllm:num_requests_running{engine=\"0\",model_name=\"tiny-llama\"} 1.0") {
            break;
        }
        assert!(Instant::now() < deadline, "the completion never started");
    }
    let asked = Instant::now();
    w.signal(nix::sys::signal::Signal::SIGTERM);
    w.wait_note("stopping", |n| n == "STOPPING=1");
    let answered = asked.elapsed();
    // At the same instant in the machine (the driver test holds it to
    // the virtual millisecond); here a loaded machine (2 busy cores) gets
    // some room, well under the 2 s the completion still runs.
    assert!(answered < Duration::from_secs(3), "STOPPING=1 took {answered:?}");
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

/// The lines of the simulator's `--health-file`: one per `/health` answered.
fn health_answers(w: &Warden) -> usize {
    std::fs::read_to_string(w.path("health")).map_or(0, |t| t.lines().count())
}

/// A config with a TCP listener and health checks every 100 ms, the
/// simulator noting every `/health` it answers.
fn checked_config(d: &Path, p: u16, listen: u16) -> String {
    let health = d.join("health");
    let server = format!(
        "{FAST}[server]\nlisten = \"127.0.0.1:{listen}\"\n[health]\ninterval = \"100ms\"\ntimeout = \"2s\"\nfailures = 2\n"
    );
    config(d, p, &["--shards", "1", "--health-file", health.to_str().unwrap()], "", &server)
}

/// This process's own descriptor limit, raised to its hard limit: the
/// flood's connections are the test's descriptors.
fn raise_own_nofile() -> u64 {
    let mut lim = libc::rlimit { rlim_cur: 0, rlim_max: 0 };
    // SAFETY: getrlimit and setrlimit on a struct we own.
    unsafe {
        assert_eq!(libc::getrlimit(libc::RLIMIT_NOFILE, &mut lim), 0);
        lim.rlim_cur = lim.rlim_max;
        assert_eq!(libc::setrlimit(libc::RLIMIT_NOFILE, &lim), 0);
    }
    lim.rlim_cur
}

/// Issue 34: a client with no token flooded the TCP endpoint with idle and
/// slowloris connections until the warden ran out of descriptors; its own
/// `/health` probe then failed with "Too many open files" and the healthy
/// child was killed. With the warden's descriptor limit lowered to 256, a
/// flood of 2000 connections (half idle, half an unfinished head) holds no
/// more than the listener's cap of the warden's descriptors, the health
/// checks go on being answered through it, and the child is untouched.
#[test]
fn a_connection_flood_at_a_low_descriptor_limit_leaves_the_child_untouched() {
    const NOFILE: u64 = 256;
    const FLOOD: usize = 2000;
    let have = raise_own_nofile();
    assert!(have > FLOOD as u64 + 256, "this test needs {} descriptors of its own; has {have}", FLOOD + 256);
    let listen = free_port();
    let opts = common::Opts { nofile: Some(NOFILE), ..Default::default() };
    let mut w = Warden::start_with(|d, p| checked_config(d, p, listen), opts);
    w.wait_ready();
    let leader = w.descendants().into_iter().find(|p| p.ppid == w.pid as i32).unwrap();
    // An eighth of the limit per listener (the number in docs/operator-guide.md, "Limits of the endpoint").
    let cap = (NOFILE / 8) as usize;
    assert_eq!(vllm_warden::daemon::server::Limits::for_nofile(NOFILE).connections, cap);
    let (fds_before, rss_before) = (common::open_fds(w.pid), common::rss_kib(w.pid));

    // The flood: every connection opened at once and held; those past the
    // listener's cap wait in the kernel's queue or for their handshake.
    let (stop, stopped) = tokio::sync::watch::channel(false);
    let connected = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let counted = connected.clone();
    let flood = std::thread::spawn(move || {
        let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
        rt.block_on(async move {
            let mut all = tokio::task::JoinSet::new();
            for i in 0..FLOOD {
                let (mut stopped, connected) = (stopped.clone(), counted.clone());
                all.spawn(async move {
                    use tokio::io::AsyncWriteExt;
                    let held = async {
                        let mut s = tokio::net::TcpStream::connect(("127.0.0.1", listen)).await.ok()?;
                        connected.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                        if i % 2 == 1 {
                            s.write_all(b"GET /status HTTP/1.1\r\nHost: x\r\nX-Slow: ").await.ok()?;
                        }
                        Some(s)
                    };
                    let s = tokio::select! {
                        _ = stopped.wait_for(|s| *s) => None,
                        s = held => s,
                    };
                    if s.is_some() {
                        let _ = stopped.wait_for(|s| *s).await.map(|_| ());
                    }
                });
            }
            while all.join_next().await.is_some() {}
        });
    });
    // Past two header timeouts, so that the warden has closed connections
    // and taken others from its queue; counted in health checks answered
    // meanwhile (one each 100 ms), each sample taken as one is answered.
    let checks = health_answers(&w);
    let wanted = checks + 2 * vllm_warden::daemon::server::HEADER_READ_TIMEOUT.as_secs() as usize * 10 + 20;
    let peak = std::sync::Mutex::new((fds_before, rss_before));
    let began = Instant::now();
    common::wait_for_file(&w.path("health"), || {
        let mut p = peak.lock().unwrap();
        *p = (p.0.max(common::open_fds(w.pid)), p.1.max(common::rss_kib(w.pid)));
        health_answers(&w) >= wanted
    });
    let flood_for = began.elapsed();
    let (fds_peak, rss_peak) = *peak.lock().unwrap();
    let opened = connected.load(std::sync::atomic::Ordering::Relaxed);
    let _ = stop.send(true);
    flood.join().unwrap();

    let after = vllm_warden::process::child::read_stat(leader.pid).expect("the child lives");
    println!(
        "flood of {FLOOD} connections ({opened} connected) for {flood_for:?}, warden RLIMIT_NOFILE {NOFILE}, cap {cap}: \
         warden fds {fds_before} before, {fds_peak} at peak; RSS {rss_before} KiB before, {rss_peak} KiB at peak; \
         child pid {} before, {} after",
        leader.pid, after.pid
    );
    assert_eq!((after.ppid, after.start_time), (w.pid as i32, leader.start_time), "the same child, still ours");
    assert!(fds_peak <= fds_before + cap + 16, "{fds_peak} descriptors at peak; {fds_before} before; cap {cap}");
    assert!(rss_peak < rss_before + 32 * 1024, "RSS {rss_peak} KiB at peak; {rss_before} KiB before");
    assert!(!w.statuses().iter().any(|s| s.starts_with("restarting")), "{:?}", w.statuses());
    assert_eq!(w.notes.iter().filter(|n| *n == "READY=1").count(), 1, "no new start");
    // The endpoint serves again once the flood is gone.
    assert_eq!(tcp(listen, "GET", "/readyz", None), (200, "ready\n".into()));
    assert_eq!(w.stop(), 0);
    assert!(!w.stderr().contains("health check failed"), "{}", w.stderr());
}

/// The warden's own descriptors run out while it runs (connections to its
/// endpoint fill the free numbers, then its soft limit is lowered to the
/// lowest number still free): its health checks cannot be made, and say so,
/// naming the warden's shortage; none counts against the child, which is
/// neither killed nor restarted, and the checks resume once descriptors
/// are back.
#[test]
fn a_warden_out_of_descriptors_does_not_blame_the_child() {
    use std::io::{Read, Write};
    let listen = free_port();
    let mut w = Warden::start(|d, p| checked_config(d, p, listen));
    w.wait_ready();
    let leader = w.descendants().into_iter().find(|p| p.ppid == w.pid as i32).unwrap();
    w.wait_for_file("health", |w| health_answers(w) >= 1);
    // Each connection answered once is held by the warden (until its
    // header timeout): together they fill the gaps among its numbers. From
    // four addresses, four each: under the cap per peer, so that none of
    // them makes room for another.
    let held: Vec<std::net::TcpStream> = (0..16)
        .map(|n| {
            let mut c = connect_std_from(loopback(2 + n % 4), listen);
            c.set_read_timeout(Some(common::TIMEOUT)).unwrap();
            c.write_all(b"GET /livez HTTP/1.1\r\nHost: x\r\n\r\n").unwrap();
            let mut buf = [0u8; 256];
            assert!(c.read(&mut buf).unwrap() > 0, "answered");
            c
        })
        .collect();
    let fds: Vec<i32> = std::fs::read_dir(format!("/proc/{}/fd", w.pid))
        .unwrap()
        .flatten()
        .filter_map(|e| e.file_name().to_str()?.parse().ok())
        .collect();
    // The lowest free number: with the soft limit there, no new one fits.
    let lowest_free = (0..).find(|n| !fds.contains(n)).unwrap();
    assert!(lowest_free > 16, "{fds:?}");
    let pid = w.pid as i32;
    let set_soft = |soft: u64| {
        let mut old = libc::rlimit { rlim_cur: 0, rlim_max: 0 };
        // SAFETY: prlimit on the warden, with structs we own.
        unsafe {
            assert_eq!(libc::prlimit(pid, libc::RLIMIT_NOFILE, std::ptr::null(), &mut old), 0);
            let new = libc::rlimit { rlim_cur: soft, rlim_max: old.rlim_max };
            assert_eq!(libc::prlimit(pid, libc::RLIMIT_NOFILE, &new, std::ptr::null_mut()), 0);
        }
        old.rlim_cur
    };
    let was = set_soft(lowest_free as u64);
    // A number freed after the listing (a check's socket closing) would
    // let checks through: connections waiting in the listener's queue take
    // any that frees (the listener tries its accept again within a second).
    let spare: Vec<std::net::TcpStream> = (0..8).map(|n| connect_std_from(loopback(6 + n % 2), listen)).collect();
    let said = "health check not made: the warden is out of file descriptors";
    // Twice as many misses as the failures that would restart the child.
    w.wait_for_file("warden.stderr", |w| w.stderr().matches(said).count() >= 4);
    set_soft(was);
    drop((held, spare));
    let answered = health_answers(&w);
    w.wait_for_file("health", |w| health_answers(w) > answered + 2);

    let after = vllm_warden::process::child::read_stat(leader.pid).expect("the child lives");
    assert_eq!((after.ppid, after.start_time), (w.pid as i32, leader.start_time), "the same child, still ours");
    let log = w.stderr();
    assert!(!log.contains("health check failed"), "{log}");
    assert!(!w.statuses().iter().any(|s| s.starts_with("restarting")), "{:?}", w.statuses());
    assert_eq!(tcp(listen, "GET", "/readyz", None), (200, "ready\n".into()));
    assert_eq!(w.stop(), 0);
}

/// Issue 34: permission denied on the control socket read as "not running"
/// (exit 4), so a preStop hook that takes 4 for "nothing to do" skipped the
/// drain. It is exit 77 with a message of its own; the warden is untouched.
#[test]
fn permission_denied_on_the_control_socket_is_not_not_running() {
    use std::os::unix::fs::PermissionsExt;
    use std::os::unix::process::CommandExt;
    let listen = free_port();
    let mut w = Warden::start(|d, p| server_config(d, p, listen, ""));
    w.wait_ready();
    let root = nix::unistd::geteuid().is_root();
    // As another user, a copy of the binary that user can reach (the
    // checkout may be in a 0700 folder).
    let copy = nobody::tempdir();
    let mut exe = std::path::PathBuf::from(common::exe());
    if root {
        // Another user: the folders on the way may be read, the socket
        // (root's, mode 0660) may not be opened.
        std::fs::set_permissions(w.dir.path(), std::fs::Permissions::from_mode(0o755)).unwrap();
        match &copy {
            Ok(dir) if nobody::reachable_by_all(w.dir.path()) => exe = nobody::copy_binary(common::exe(), dir.path()),
            _ => {
                // Not a pass: the test did not run, and says why.
                eprintln!("SKIPPED: no folder uid {} can reach for the binary or the warden's files", nobody::UID);
                assert_eq!(w.stop(), 0);
                return;
            }
        }
    } else {
        std::fs::set_permissions(w.path("run/control.sock"), std::fs::Permissions::from_mode(0o000)).unwrap();
    }
    for what in ["drain", "undrain", "restart"] {
        let mut cmd = std::process::Command::new(&exe);
        cmd.args([what, "-c"]).arg(w.path("t.toml")).env("RUNTIME_DIRECTORY", w.path("run"));
        if root {
            cmd.uid(nobody::UID).gid(nobody::UID);
        }
        let o = cmd.output().unwrap();
        let err = String::from_utf8_lossy(&o.stderr);
        assert_eq!(o.status.code(), Some(77), "{what}: {err}");
        assert!(err.contains("permission denied on the control socket"), "{what}: {err}");
        assert!(!err.contains("not running"), "{what}: {err}");
    }
    assert_eq!(tcp(listen, "GET", "/readyz", None), (200, "ready\n".into()), "nothing changed");
    assert_eq!(w.stop(), 0);
    let (code, out) = command(&w, "drain");
    assert_eq!(code, 4, "no warden: still 4: {out}");
}

/// A warden run from a copy of the binary (which an upgrade runs again),
/// with the endpoint on TCP and `extra` config.
fn upgradable(listen: u16, extra: &'static str) -> (tempfile::TempDir, std::path::PathBuf, Warden) {
    let bin = tempfile::tempdir().unwrap();
    let path = bin.path().join("vllm-warden");
    std::fs::copy(common::exe(), &path).unwrap();
    let opts = common::Opts { exe: Some(path.clone()), ..Default::default() };
    let w = Warden::start_with(move |d, p| server_config(d, p, listen, extra), opts);
    (bin, path, w)
}

/// Issue 34: SIGUSR2 while drained came back ready (`/readyz` 200), putting
/// a node taken out for maintenance back into rotation. The drain is handed
/// over: the new warden holds the same child drained until `undrain`.
#[test]
fn an_upgrade_while_drained_comes_back_drained() {
    let listen = free_port();
    let (_bin, path, mut w) = upgradable(listen, "[drain]\ndelay = \"0s\"\n");
    w.wait_ready();
    let leader = w.descendants().into_iter().find(|p| p.ppid == w.pid as i32).unwrap();
    let (code, out) = command(&w, "drain");
    assert_eq!(code, 0, "{out}");
    w.wait_note("drained", |n| n.starts_with("STATUS=drained: pid "));
    w.ask_upgrade(&path);
    let note = w.wait_note("the upgrade", |n| n.starts_with("STATUS=upgraded from"));
    assert!(note.ends_with(&format!("; drained: pid {}, out of rotation", leader.pid)), "{note}");
    let (code, body) = tcp(listen, "GET", "/readyz", None);
    assert_eq!((code, body.as_str()), (503, "drained\n"), "still out of rotation");
    // The new warden re-checks the answers of what it took over, drained.
    let checked = w.wait_note("the re-check", |n| n.contains("; re-checked after the warden upgraded from "));
    assert!(checked.starts_with(&format!("STATUS=drained: pid {}, out of rotation; ", leader.pid)), "{checked}");
    let now = vllm_warden::process::child::read_stat(leader.pid).unwrap();
    assert_eq!((now.ppid, now.start_time), (w.pid as i32, leader.start_time), "the same child");
    let (code, out) = command(&w, "undrain");
    assert_eq!((code, out.as_str()), (0, "t: ready\n"));
    assert_eq!(tcp(listen, "GET", "/readyz", None).0, 200);
    assert_eq!(w.stop(), 0);
}

/// Issue 34: SIGUSR2 during a restart's drain cancelled the restart. The
/// upgrade now waits for the drain to end: the restart happens, then the
/// upgrade, on the new child.
#[test]
fn an_upgrade_during_a_restarts_drain_waits_for_the_restart() {
    let listen = free_port();
    // The drain's delay leaves the upgrade, asked once the drain is seen,
    // time to come during it on a machine starved of CPU (a turn of the
    // loop was once held 1.4 s, past a delay of 2 s).
    let (_bin, path, mut w) = upgradable(listen, "[drain]\ndelay = \"6s\"\n");
    w.wait_ready();
    let leader = w.descendants().into_iter().find(|p| p.ppid == w.pid as i32).unwrap();
    let (code, out) = command(&w, "restart");
    assert_eq!(code, 0, "{out}");
    w.wait_note("the drain", |n| n.starts_with("STATUS=draining pid ") && n.ends_with(", then restarting"));
    w.ask_upgrade(&path);
    w.wait_note("the restart", |n| n.starts_with("STATUS=restarting: stopping pid "));
    w.wait_ready();
    let note = w.wait_note("the upgrade", |n| n.starts_with("STATUS=upgraded from"));
    let child = w.descendants().into_iter().find(|p| p.ppid == w.pid as i32).unwrap();
    assert_ne!(child.pid, leader.pid, "restarted");
    assert!(note.ends_with(&format!("; ready: pid {}", child.pid)), "{note}");
    w.wait_logged("waits until the drain ends");
    // The new warden re-checks the answers of the run it took over first.
    w.wait_note("back in rotation", |n| n.contains("; back in rotation after "));
    assert_eq!(tcp(listen, "GET", "/readyz", None).0, 200);
    assert_eq!(w.stop(), 0);
}

/// The loopback address `127.0.0.n`: every one of them is this machine, and
/// the warden sees each as a peer of its own.
fn loopback(n: u8) -> std::net::Ipv4Addr {
    std::net::Ipv4Addr::new(127, 0, 0, n)
}

/// A TCP connection to the warden's `port` from the address `from`.
async fn connect_from(from: std::net::Ipv4Addr, port: u16) -> std::io::Result<tokio::net::TcpStream> {
    let s = tokio::net::TcpSocket::new_v4()?;
    s.bind((from, 0).into())?;
    s.connect((std::net::Ipv4Addr::LOCALHOST, port).into()).await
}

/// [`connect_from`], as a blocking stream.
fn connect_std_from(from: std::net::Ipv4Addr, port: u16) -> std::net::TcpStream {
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
    let s = rt.block_on(connect_from(from, port)).unwrap().into_std().unwrap();
    s.set_nonblocking(false).unwrap();
    s
}

/// One `GET path` on a kept-alive connection: the status, and whether the
/// warden said it closes the connection after it (`Connection: close`);
/// none when the connection ended first.
async fn ask_on(s: &mut tokio::net::TcpStream, path: &str) -> Option<(u16, bool)> {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    s.write_all(format!("GET {path} HTTP/1.1\r\nHost: x\r\n\r\n").as_bytes()).await.ok()?;
    let mut got = Vec::new();
    loop {
        if let Some(end) = got.windows(4).position(|w| w == b"\r\n\r\n") {
            let head = String::from_utf8_lossy(&got[..end]).to_ascii_lowercase();
            let len: usize =
                head.lines().find_map(|l| l.strip_prefix("content-length:")).and_then(|v| v.trim().parse().ok())?;
            if got.len() >= end + 4 + len {
                let status = head.get(9..12)?.parse().ok()?;
                let close = head.lines().any(|l| l.starts_with("connection:") && l.contains("close"));
                return Some((status, close));
            }
        }
        let mut chunk = [0u8; 1024];
        match s.read(&mut chunk).await {
            Ok(0) | Err(_) => return None,
            Ok(n) => got.extend_from_slice(&chunk[..n]),
        }
    }
}

/// A client that keeps one connection to the warden and asks `/livez` on
/// it every `every` (a balancer's health check, a scraper) until `stop`;
/// when the warden closes it, the next question goes on a new one. Sends
/// its number on `answered` for every 200.
async fn keep_asking(
    n: usize,
    from: std::net::Ipv4Addr,
    port: u16,
    every: Duration,
    answered: std::sync::mpsc::Sender<usize>,
    mut stop: tokio::sync::watch::Receiver<bool>,
) {
    let mut conn = None;
    loop {
        let fresh = conn.is_none();
        if fresh {
            conn = connect_from(from, port).await.ok();
        }
        if let Some(s) = conn.as_mut() {
            match ask_on(s, "/livez").await {
                Some((200, close)) => {
                    let _ = answered.send(n);
                    if close {
                        conn = None;
                    }
                }
                // Closed between two questions: asked again at once, on a
                // new connection (a new one closed unanswered waits).
                None if !fresh => {
                    conn = None;
                    continue;
                }
                _ => conn = None,
            }
        }
        tokio::select! {
            _ = stop.wait_for(|s| *s) => return,
            () = tokio::time::sleep(every) => {}
        }
    }
}

/// How long a `/livez` probe may take beside the clients of the issue 43
/// tests: a kubelet's probe waits 1 s (`timeoutSeconds`); 3 s here, for a
/// loaded machine of 2 cores. Unfixed, the probe waited for good.
const PROBE_WITHIN: Duration = Duration::from_secs(3);

/// Issue 43: a client asking every 2 s on each of the listener's 64
/// connections is never idle, so a new connection waited in the kernel's
/// queue for as long as it stayed: 5 of 5 `/livez` probes timed out, and a
/// kubelet probing `/livez` over TCP would restart a healthy model. With
/// the listener full, a new connection takes the place of a kept-alive one
/// (closed after its current request, here at once: it was between two):
/// every probe is answered (within [`PROBE_WITHIN`]), and every client is
/// still answered after.
#[test]
fn kept_alive_clients_on_every_connection_do_not_lock_out_a_probe() {
    // The clients come from 8 addresses, 8 from each: under the cap per
    // peer, so that the listener's own cap is what fills.
    const CLIENTS: usize = vllm_warden::daemon::server::MAX_CONNECTIONS;
    const PEERS: usize = 8;
    assert!(CLIENTS / PEERS < vllm_warden::daemon::server::Limits::for_nofile(1024).per_peer);
    let listen = free_port();
    let opts = common::Opts { nofile: Some(1024), ..Default::default() };
    let mut w = Warden::start_with(|d, p| server_config(d, p, listen, ""), opts);
    w.wait_ready();

    let (stop, stopped) = tokio::sync::watch::channel(false);
    let (answered, answers) = std::sync::mpsc::channel();
    let clients = std::thread::spawn(move || {
        let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
        rt.block_on(async move {
            let mut all = tokio::task::JoinSet::new();
            for n in 0..CLIENTS {
                let from = loopback(2 + (n % PEERS) as u8);
                all.spawn(keep_asking(n, from, listen, Duration::from_secs(2), answered.clone(), stopped.clone()));
            }
            while all.join_next().await.is_some() {}
        });
    });
    // Every client answered once: the listener serves all 64, its most.
    let mut seen = std::collections::BTreeSet::new();
    let deadline = Instant::now() + TIMEOUT;
    while seen.len() < CLIENTS {
        let left = deadline.saturating_duration_since(Instant::now());
        seen.insert(answers.recv_timeout(left).expect("every client answered once"));
    }

    let mut took = Vec::new();
    for _ in 0..5 {
        let asked = Instant::now();
        let probe = common::http::get(&format!("http://127.0.0.1:{listen}/livez"), PROBE_WITHIN);
        took.push(asked.elapsed());
        let probe = probe.unwrap_or_else(|e| panic!("a /livez probe beside {CLIENTS} kept-alive clients: {e}"));
        assert_eq!((probe.status, probe.body.as_str()), (200, "ready\n"));
    }
    eprintln!("/livez beside {CLIENTS} kept-alive clients: answered in {took:?}");

    // The clients whose connection made room are served on a new one.
    while answers.try_recv().is_ok() {}
    let mut again = std::collections::BTreeSet::new();
    while again.len() < CLIENTS {
        let left = deadline.saturating_duration_since(Instant::now());
        again.insert(answers.recv_timeout(left).expect("every client answered again"));
    }
    let _ = stop.send(true);
    clients.join().unwrap();
    assert_eq!(w.stop(), 0);
}

/// Issue 43: one peer could take every connection of the listener. A peer
/// holds at most a quarter of them (16 of 64): past that, a new connection
/// of its takes the place of one of its own (one that has had a request,
/// else, as here where none sends anything, the one quiet the longest,
/// closed at once). Another peer's probe is answered (within
/// [`PROBE_WITHIN`]), and the warden holds no more of the peer's
/// connections than its share.
#[test]
fn one_peer_cannot_take_every_connection() {
    let listen = free_port();
    let opts = common::Opts { nofile: Some(1024), ..Default::default() };
    let mut w = Warden::start_with(|d, p| server_config(d, p, listen, ""), opts);
    w.wait_ready();
    let limits = vllm_warden::daemon::server::Limits::for_nofile(1024);
    let (cap, per_peer) = (limits.connections, limits.per_peer);
    assert_eq!((cap, per_peer), (64, 16), "the numbers in docs/operator-guide.md, \"Limits of the endpoint\"");
    let fds_before = common::open_fds(w.pid);
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
    // As many connections as the listener serves, from one address, each
    // sending nothing (never served, so none can be closed for another).
    let held: Vec<tokio::net::TcpStream> = rt.block_on(async {
        let mut held = Vec::new();
        for _ in 0..cap {
            held.push(connect_from(loopback(2), listen).await.unwrap());
        }
        held
    });
    // The probe's connection is queued behind all of them: answered once
    // the warden has taken each.
    let asked = Instant::now();
    let probe = common::http::get(&format!("http://127.0.0.1:{listen}/livez"), PROBE_WITHIN);
    let took = asked.elapsed();
    let probe = probe.unwrap_or_else(|e| panic!("a /livez probe beside one peer's {cap} connections: {e}"));
    assert_eq!((probe.status, probe.body.as_str()), (200, "ready\n"));
    let fds = common::open_fds(w.pid);
    eprintln!(
        "/livez beside one peer's {cap} silent connections: answered in {took:?}; warden fds {fds_before} → {fds}"
    );
    assert!(fds < fds_before + per_peer + 8, "{fds} descriptors; {fds_before} before; {per_peer} per peer");
    let said = "serves 16 connections from 127.0.0.2, the most one peer may: one of them is closed for each new one";
    w.wait_for_file("warden.stderr", |w| w.stderr().contains(said));
    drop(held);
    assert_eq!(w.stop(), 0);
}
