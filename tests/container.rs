//! Container mode without a container runtime: `unshare --pid --fork
//! --mount-proc` runs the warden as PID 1 of a new pid namespace, with the
//! simulated vLLM; an orphaned grandchild is reaped, SIGTERM stops
//! everything, and `--log-format json` writes one JSON object a line. The
//! container's own files are checked too (the config parses; the manifests
//! are validated by `packaging/container/validate.sh`).

mod common;

use common::{Opts, Warden, config};
use nix::sys::signal::Signal;

const FAST: &str = "[restart]\ninitial-delay = \"0s\"\n";

/// `unshare` as root, or in a user namespace of its own otherwise.
fn pid_namespace() -> Vec<String> {
    let mut w: Vec<String> = ["unshare", "--pid", "--fork", "--mount-proc"].map(String::from).to_vec();
    if !nix::unistd::geteuid().is_root() {
        w.insert(1, "--map-root-user".into());
        w.insert(1, "--user".into());
    }
    w
}

/// Every zombie whose chain of parents reaches `root` (the warden's own
/// walk leaves zombies out).
fn zombies_under(root: i32) -> Vec<vllm_warden::process::child::ProcStat> {
    let all: Vec<_> = std::fs::read_dir("/proc")
        .unwrap()
        .flatten()
        .filter_map(|e| e.file_name().to_str()?.parse::<i32>().ok())
        .filter_map(vllm_warden::process::child::read_stat)
        .collect();
    let mut under = std::collections::HashSet::from([root]);
    let mut grew = true;
    while grew {
        grew = false;
        for p in &all {
            if under.contains(&p.ppid) && under.insert(p.pid) {
                grew = true;
            }
        }
    }
    all.into_iter().filter(|p| p.state == 'Z' && p.pid != root && under.contains(&p.pid)).collect()
}

/// Whether `wrapper` can make its namespaces here: it runs `true` first.
/// A new pid namespace needs CAP_SYS_ADMIN (root in a Docker container
/// lacks it), or, as another user, a user namespace of one's own, which
/// `kernel.apparmor_restrict_unprivileged_userns=1` (Ubuntu 23.10 on) and
/// `user.max_user_namespaces=0` refuse.
fn namespaces_allowed(wrapper: &[String]) -> Result<(), String> {
    let out = std::process::Command::new(&wrapper[0]).args(&wrapper[1..]).arg("true").output();
    match out {
        Ok(o) if o.status.success() => Ok(()),
        Ok(o) => {
            Err(format!("`{} true`: {}: {}", wrapper.join(" "), o.status, String::from_utf8_lossy(&o.stderr).trim()))
        }
        Err(e) => Err(format!("`{}`: {e}", wrapper[0])),
    }
}

#[test]
fn as_pid_1_the_warden_reaps_an_orphaned_grandchild_and_stops_everything_on_sigterm() {
    if let Err(why) = namespaces_allowed(&pid_namespace()) {
        // Not a pass: the warden cannot be PID 1 here, and the test says so.
        eprintln!("SKIPPED: no pid namespace can be made on this host: {why}");
        return;
    }
    let opts =
        Opts { wrapper: pid_namespace(), run_args: vec!["--log-format".into(), "json".into()], ..Opts::default() };
    let mut w = Warden::start_with(
        |d, p| config(d, p, &["--shards", "1", "--setsid-engine"], "stop-timeout = \"2s\"", FAST),
        opts,
    );
    w.wait_ready();
    // The warden is the wrapper's only child, and PID 1 inside.
    let tree = w.descendants();
    let warden = tree.iter().find(|p| p.ppid == w.pid as i32).expect("the warden").pid;
    let doc: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(w.path("status.json")).unwrap()).unwrap();
    assert_eq!(doc["warden_pid"], 1, "PID 1 in its namespace: {doc}");

    // The API server killed: its engine (its own session) is orphaned and
    // re-parented to PID 1; the warden stops it and reaps it.
    let leader = tree.iter().find(|p| p.ppid == warden).expect("the server").pid;
    let engine: Vec<_> = tree.iter().filter(|p| p.ppid == leader).copied().collect();
    assert!(!engine.is_empty(), "the engine child: {tree:?}");
    nix::sys::signal::kill(nix::unistd::Pid::from_raw(leader), Signal::SIGKILL).unwrap();
    w.wait_note("restart", |n| n.starts_with("STATUS=restarting in"));
    w.wait_ready();
    let zombies = zombies_under(w.pid as i32);
    assert!(zombies.is_empty(), "zombies left unreaped by PID 1: {zombies:?}");
    assert!(engine.iter().all(common::gone), "the orphaned engine was stopped: {engine:?}");

    // SIGTERM to PID 1 (from outside its namespace): a clean stop.
    let tree = w.descendants();
    nix::sys::signal::kill(nix::unistd::Pid::from_raw(warden), Signal::SIGTERM).unwrap();
    assert_eq!(w.wait_exit(), 0);
    assert!(w.notes.iter().any(|n| n == "STOPPING=1"));
    assert!(tree.iter().all(common::gone), "left behind: {tree:?}");

    // Every line of stderr is one JSON object with a level and a message.
    let stderr = w.stderr();
    let mut events = 0;
    for line in stderr.lines() {
        let v: serde_json::Value = serde_json::from_str(line).unwrap_or_else(|e| panic!("{e}: {line}"));
        assert!(v["level"].is_string() && v["fields"]["message"].is_string(), "{line}");
        events += 1;
    }
    assert!(stderr.contains("\"EVENT\":\"ready\""), "{stderr}");
    assert!(events > 5, "{stderr}");
}

/// The container's config is a valid config (its program is in the vLLM
/// image, not here: only the file itself is checked).
#[test]
fn the_container_config_parses() {
    let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("packaging/container/vllm-warden.toml");
    let s = vllm_warden::config::load(&path, &Default::default()).unwrap_or_else(|p| panic!("{p}"));
    assert_eq!(s.server.listen, Some("0.0.0.0:9400".parse().unwrap()));
    assert!(s.drain.on_stop, "SIGTERM drains in the container");
    // The pod's grace period covers a stop that drains first.
    let manifest = std::fs::read_to_string(path.with_file_name("deployment.yaml")).unwrap();
    let grace: u64 = manifest
        .lines()
        .find_map(|l| l.trim().strip_prefix("terminationGracePeriodSeconds:"))
        .and_then(|v| v.trim().parse().ok())
        .expect("terminationGracePeriodSeconds");
    let needed = s.drain.delay + s.drain.timeout + s.child.stop_timeout + vllm_warden::supervisor::policy::KILL_GRACE;
    assert!(grace >= needed.as_secs(), "terminationGracePeriodSeconds {grace} < {}", needed.as_secs());
}
