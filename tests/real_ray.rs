//! One model served across two Ray nodes on this machine, each piece under
//! its own warden: a Ray head (127.0.0.3), a Ray node that joins it
//! (127.0.0.2), and `vllm serve` with the Ray executor and tensor parallel
//! 2, so that the serving group spans both nodes. Ignored by default:
//! `tests/real-ray/run.sh` installs vLLM and Ray (tests/real-ray/) and runs
//! it on the release build with `VLLM_WARDEN_VLLM` and `VLLM_WARDEN_MODELS`
//! set; Ray's `ray` is the one beside `vllm`.
//!
//! vLLM 0.32 on CPU refuses the Ray executor; the test venv's import hook
//! (tests/real-ray/vllm_warden_test_ray.py), switched on by
//! `VLLM_WARDEN_TEST_RAY_DEVICE_KEY`, gives its CPU platform Ray's
//! `neuron_cores` as device key, and each node offers one.
//!
//! Budgets as in `real_vllm.rs`: loads times the load ceiling
//! (`VLLM_WARDEN_LOAD_CEILING`, else 5 minutes), plus what the configs allow
//! on the way, plus a margin.

mod common;

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use common::real::{GRACE, MARGIN, REPORT, budget, by_title, ceiling, model, vllm};
use common::{Warden, gone, secs};
use nix::sys::signal::Signal;
use vllm_warden::process::child::ProcStat;

fn ray() -> String {
    Path::new(&vllm()).with_file_name("ray").to_string_lossy().into_owned()
}

/// `child.stop-timeout` of every piece.
const STOP_TIMEOUT: Duration = Duration::from_secs(30);
/// Ray marks a node that died dead after its health checks fail: about
/// 13 s here; the gate and a joining node wait for that.
const RAY_DETECTION: Duration = Duration::from_secs(30);

/// The head's GCS port, and the ports Ray would otherwise take by default
/// (and share with any other Ray on the machine): each its own.
struct Cluster {
    port: u16,
    client: u16,
    dashboard: u16,
    head_agent: u16,
    worker_agent: u16,
}

impl Cluster {
    fn address(&self) -> String {
        format!("127.0.0.3:{}", self.port)
    }
}

/// What every piece's config shares: its log and status files, quick
/// restarts, no GPU check, the load ceiling as its deadlines.
fn common(d: &Path, name: &str, profile: &str, command: &[String], env: &str, extra: &str) -> String {
    let argv: Vec<String> = command.iter().map(|a| format!("{a:?}")).collect();
    format!(
        r#"name = "{name}"
profile = "{profile}"
[child]
command = [{argv}]
env = {{ {env} }}
log-file = "{d}/t.log"
stop-timeout = "{stop}s"
[ready]
timeout = "{ceiling}s"
stall = "{ceiling}s"
[restart]
initial-delay = "1s"
max-delay = "5s"
max-attempts = 0
[status]
file = "{d}/status.json"
{extra}
"#,
        argv = argv.join(", "),
        d = d.display(),
        stop = STOP_TIMEOUT.as_secs(),
        ceiling = ceiling().0.as_secs(),
    )
}

const HOOK: &str = r#"VLLM_WARDEN_TEST_RAY_DEVICE_KEY = "neuron_cores", RAY_USAGE_STATS_ENABLED = "0""#;

fn head(c: &Cluster) -> Warden {
    let (port, client, dashboard, agent) = (c.port, c.client, c.dashboard, c.head_agent);
    Warden::start(move |d, _| {
        let argv = [
            ray().as_str(),
            "start",
            "--head",
            "--block",
            &format!("--port={port}"),
            &format!("--ray-client-server-port={client}"),
            &format!("--dashboard-port={dashboard}"),
            &format!("--dashboard-agent-listen-port={agent}"),
            "--node-ip-address=127.0.0.3",
            "--num-cpus=1",
            r#"--resources={"neuron_cores": 1}"#,
            "--include-dashboard=false",
            "--object-store-memory=200000000",
            &format!("--temp-dir={}/ray", d.display()),
        ]
        .map(String::from);
        common(d, "ray-head", "ray-head", &argv, HOOK, "[prestart]\ngpu-idle-wait = \"0s\"\n")
    })
}

fn worker(c: &Cluster) -> Warden {
    let (address, agent) = (c.address(), c.worker_agent);
    Warden::start(move |d, _| {
        let argv = [
            ray().as_str(),
            "start",
            &format!("--address={address}"),
            "--block",
            "--node-ip-address=127.0.0.2",
            "--num-cpus=1",
            r#"--resources={"neuron_cores": 1}"#,
            &format!("--dashboard-agent-listen-port={agent}"),
            "--object-store-memory=200000000",
            &format!("--temp-dir={}/ray", d.display()),
        ]
        .map(String::from);
        // A node gives up on a lost head after 5 s instead of Ray's 60.
        let env = format!("{HOOK}, RAY_gcs_rpc_server_reconnect_timeout_s = \"5\"");
        common(d, "ray-worker", "ray-worker", &argv, &env, "[prestart]\ngpu-idle-wait = \"0s\"\nray-wait = \"10m\"\n")
    })
}

fn server(c: &Cluster) -> Warden {
    let address = c.address();
    Warden::start(move |d, port| {
        let argv = [
            vllm().as_str(),
            "serve",
            &model("tiny").to_string_lossy(),
            "--port",
            &port.to_string(),
            "--max-model-len",
            "256",
            "--enforce-eager",
            "--distributed-executor-backend",
            "ray",
            "--tensor-parallel-size",
            "2",
        ]
        .map(String::from);
        let env = format!(r#"{HOOK}, HF_HUB_OFFLINE = "1", VLLM_CPU_KVCACHE_SPACE = "1", RAY_ADDRESS = "{address}""#);
        let extra = format!(
            "[fatal]\ngrace = \"{}s\"\n[prestart]\ngpu-idle-wait = \"0s\"\nray-address = \"{address}\"\nray-min-nodes = 2\nray-min-cpus = 2\nray-wait = \"10m\"\n",
            GRACE.as_secs()
        );
        common(d, "t", "vllm", &argv, &env, &extra)
    })
}

fn kill(p: &ProcStat) {
    nix::sys::signal::kill(nix::unistd::Pid::from_raw(p.pid), Signal::SIGKILL).unwrap();
}

/// The session folders in a node's temporary folder.
fn sessions(w: &Warden) -> Vec<String> {
    std::fs::read_dir(w.path("ray"))
        .map(|d| d.flatten().map(|e| e.file_name().to_string_lossy().into_owned()).collect())
        .unwrap_or_default()
}

fn shm() -> BTreeSet<PathBuf> {
    std::fs::read_dir("/dev/shm").map(|d| d.flatten().map(|e| e.path()).collect()).unwrap_or_default()
}

/// The cause in a `STATUS=failed (…): CAUSE` or `restarting in … (…): CAUSE`
/// note.
fn cause(note: &str) -> &str {
    note.split_once("): ").map_or(note, |(_, c)| c)
}

#[test]
#[ignore]
fn r1_a_group_across_two_ray_nodes_recovers_from_either_node_dying() {
    let shm_before = shm();
    let [port, client, dashboard, head_agent, worker_agent] = [(); 5].map(|_| common::free_port());
    let c = Cluster { port, client, dashboard, head_agent, worker_agent };
    let node_up = budget(0, RAY_DETECTION);
    let load = budget(1, Duration::ZERO);
    // The server's run fails (its exit, or the grace), its report, its
    // stop; the node comes back and Ray sees it; one more load.
    let again = budget(1, GRACE + REPORT + STOP_TIMEOUT + RAY_DETECTION * 2);
    eprintln!(
        "ray scenario budgets (load ceiling {}): node up {}, serving {}, serving again {}",
        secs(ceiling().0),
        secs(node_up),
        secs(load),
        secs(again)
    );

    let t = Instant::now();
    let mut h = head(&c);
    h.wait_ready_within(node_up, "the head's READY=1");
    let head_ready = t.elapsed();
    let t = Instant::now();
    let mut w = worker(&c);
    w.wait_ready_within(node_up, "the worker's READY=1");
    let worker_ready = t.elapsed();
    let t = Instant::now();
    let mut s = server(&c);
    s.wait_ready_within(load, "the server's READY=1 (one load, TP 2 across both nodes)");
    let served = t.elapsed();
    common::real::completion(s.port).expect("a completion across both nodes");
    // One Ray worker process of the group on each node.
    let on = |x: &Warden| by_title(&x.descendants(), "RayWorkerProc").len();
    assert_eq!((on(&h), on(&w)), (1, 1), "one rank on each node");

    // Fault 1: the joining node's raylet dies.
    let tree = w.descendants();
    let raylet = by_title(&tree, "raylet/raylet");
    assert_eq!(raylet.len(), 1, "{:?}", w.descendants());
    let t = Instant::now();
    kill(raylet[0]);
    let failed = s.wait_note_within(again, "the server's failure after the worker node died", |n| {
        n.starts_with("STATUS=failed (")
    });
    w.wait_ready_within(again, "the worker's READY=1 after its raylet was killed");
    let worker_back = t.elapsed();
    s.wait_ready_within(again, "the server's READY=1 after the worker node died");
    let server_back = t.elapsed();
    common::real::completion(s.port).expect("a completion after the worker node came back");
    assert!(failed.contains("(hint: a worker process of the engine died"), "{failed}");
    let gated = s.statuses().iter().any(|n| n.starts_with("waiting up to 10m for the Ray cluster at"));
    let worker_cause = w.statuses().iter().rev().find(|n| n.starts_with("failed (")).map(|n| cause(n).to_string());
    eprintln!(
        "ray fault 1, worker raylet SIGKILL: worker cause \"{}\", server cause \"{}\"; worker ready again {:.1} s, server ready again {:.1} s{}",
        worker_cause.unwrap_or_default(),
        cause(&failed),
        worker_back.as_secs_f64(),
        server_back.as_secs_f64(),
        if gated { " (waited at the gate)" } else { "" }
    );

    // Fault 2: the head's Ray dies (its GCS, then `ray start --block`
    // ends the rest).
    let tree = h.descendants();
    let gcs = by_title(&tree, "gcs_server");
    assert_eq!(gcs.len(), 1, "{:?}", h.descendants());
    let t = Instant::now();
    kill(gcs[0]);
    let failed2 = s.wait_note_within(again, "the server's failure after the head's Ray died", |n| {
        n.starts_with("STATUS=failed (")
    });
    h.wait_ready_within(again, "the head's READY=1 after its GCS was killed");
    let head_back = t.elapsed();
    w.wait_ready_within(again, "the worker's READY=1 after the head came back");
    let worker_back2 = t.elapsed();
    s.wait_ready_within(again, "the server's READY=1 after the head came back");
    let server_back2 = t.elapsed();
    common::real::completion(s.port).expect("a completion after the head came back");
    let last_cause = |x: &Warden| {
        x.statuses().iter().rev().find(|n| n.starts_with("failed (")).map(|n| cause(n).to_string()).unwrap_or_default()
    };
    for x in [&h, &w] {
        assert!(last_cause(x).contains("(hint: one of Ray's processes on this node died"), "{:?}", x.statuses());
    }
    eprintln!(
        "ray fault 2, head GCS SIGKILL: head cause \"{}\", worker cause \"{}\", server cause \"{}\"; head ready again {:.1} s, worker {:.1} s, server {:.1} s",
        last_cause(&h),
        last_cause(&w),
        cause(&failed2),
        head_back.as_secs_f64(),
        worker_back2.as_secs_f64(),
        server_back2.as_secs_f64()
    );

    // Stop all, the server first: nothing of Ray or vLLM is left.
    let trees: Vec<ProcStat> = [&s, &w, &h].iter().flat_map(|x| x.descendants()).collect();
    let t = Instant::now();
    for x in [&mut s, &mut w, &mut h] {
        assert_eq!(x.stop_within(STOP_TIMEOUT + MARGIN, "a warden's exit after SIGTERM"), 0);
    }
    let stopped = t.elapsed();
    let left: Vec<&ProcStat> = trees.iter().filter(|p| !gone(p)).collect();
    assert!(left.is_empty(), "left running: {left:?}");
    for x in [&h, &w] {
        let s = sessions(x);
        assert!(s.is_empty(), "left in {}: {s:?}", x.path("ray").display());
    }
    let new: Vec<PathBuf> = shm().difference(&shm_before).cloned().collect();
    assert!(new.is_empty(), "left in /dev/shm: {new:?}");
    eprintln!(
        "ray scenario: PASS  head ready {:.1} s, worker {:.1} s, server (TP 2 across both) {:.1} s; stop all {:.1} s, {} processes, nothing left",
        head_ready.as_secs_f64(),
        worker_ready.as_secs_f64(),
        served.as_secs_f64(),
        stopped.as_secs_f64(),
        trees.len()
    );
}
