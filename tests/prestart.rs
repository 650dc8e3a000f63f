//! The steps before every start, with real processes: leftovers of a killed
//! warden, shared memory held or mapped by live processes, a foreign
//! listener on the port, a busy GPU.

mod common;

use std::io::BufRead;
use std::process::{Child, Command, Stdio};

use common::{Opts, Warden, config, gone, wait_for_file};
use nix::sys::signal::Signal;

const FAST: &str = "[restart]\ninitial-delay = \"0s\"\n";

/// A helper process that holds `file` open (or mapped, closed); returns once
/// it says it does.
fn holder(flag: &str, file: &std::path::Path) -> Child {
    let mut c = Command::new(common::sim())
        .arg(flag)
        .arg(file)
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .unwrap();
    let mut line = String::new();
    std::io::BufReader::new(c.stdout.as_mut().unwrap()).read_line(&mut line).unwrap();
    assert_eq!(line.trim(), "holding");
    c
}

struct Reap(Vec<Child>);

impl Drop for Reap {
    fn drop(&mut self) {
        for c in &mut self.0 {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

#[test]
fn shared_memory_nobody_holds_is_removed_and_the_rest_kept() {
    let tag = format!("vwtest-{}", std::process::id());
    let shm = std::path::Path::new("/dev/shm");
    let [stale, open, mapped, foreign] = ["stale", "open", "mapped", "foreign"].map(|n| shm.join(format!("{tag}-{n}")));
    for f in [&stale, &open, &mapped, &foreign] {
        std::fs::write(f, b"segment").unwrap();
    }
    let _procs = Reap(vec![holder("--hold-file", &open), holder("--map-file", &mapped)]);
    let root = nix::unistd::geteuid().is_root();
    if root {
        std::os::unix::fs::chown(&foreign, Some(65534), Some(65534)).unwrap();
    }
    let globs = format!("[prestart]\nclean-shm = [\"{tag}-*\"]\n");
    let mut w = Warden::start(|d, p| config(d, p, &["--shards", "1"], "", &format!("{FAST}{globs}")));
    w.wait_ready();
    assert!(!stale.exists(), "a stale segment is removed");
    assert!(open.exists() && mapped.exists(), "segments of live processes are kept");
    w.wait_logged(&format!("removed {tag}-stale"));
    let err = w.stderr();
    assert!(err.contains(&format!("removed {tag}-stale")), "{err}");
    assert!(err.contains(&format!("kept {} (in use by pid ", open.display())), "{err}");
    assert!(err.contains(&format!("kept {} (in use by pid ", mapped.display())), "{err}");
    if root {
        assert!(foreign.exists(), "another user's segment is kept");
        assert!(err.contains(&format!("kept {} (owned by uid 65534)", foreign.display())), "{err}");
    }
    assert_eq!(w.stop(), 0);
    for f in [&open, &mapped, &foreign] {
        let _ = std::fs::remove_file(f);
    }
}

#[test]
fn a_foreign_listener_is_named_and_waited_for() {
    let port = common::free_port();
    let listener = std::net::TcpListener::bind(("0.0.0.0", port)).unwrap();
    let mut w = Warden::start(|d, _| {
        config(d, port, &["--shards", "1"], "", &format!("{FAST}[prestart]\nport-wait = \"60s\"\n"))
    });
    let me = std::process::id();
    let waiting = w.wait_note("port held", |n| n.starts_with("STATUS=waiting up to 1m: port "));
    assert!(waiting.contains(&format!("port {port} is held by pid {me} (")), "{waiting}");
    drop(listener);
    w.wait_ready();
    assert_eq!(w.stop(), 0);
}

/// Run in the foreground, the warden prints its status where the operator
/// looks: the port wait while it lasts, the load, ready; each text once.
#[test]
fn the_foreground_shows_the_port_wait_and_the_load_as_they_happen() {
    let port = common::free_port();
    let listener = std::net::TcpListener::bind(("0.0.0.0", port)).unwrap();
    let mut w = Warden::start(|d, _| {
        config(d, port, &["--shards", "1"], "", &format!("{FAST}[prestart]\nport-wait = \"60s\"\n"))
    });
    let progress = |w: &Warden| -> Vec<String> {
        w.stderr().lines().filter(|l| l.contains("EVENT=\"progress\"")).map(str::to_string).collect()
    };
    let stderr = w.path("warden.stderr");
    wait_for_file(&stderr, || {
        progress(&w).iter().any(|l| l.contains(&format!("waiting up to 1m: port {port} is held")))
    });
    drop(listener);
    w.wait_ready();
    let ready = w.statuses().last().unwrap().to_string();
    wait_for_file(&stderr, || progress(&w).iter().any(|l| l.contains(&ready)));
    let lines = progress(&w);
    assert!(lines.iter().any(|l| l.contains(" loading ") || l.contains("starting")), "{lines:#?}");
    let mut seen = std::collections::HashSet::new();
    for l in &lines {
        let text = l.split(" INFO ").nth(1).unwrap_or(l);
        assert!(seen.insert(text.to_string()), "printed twice: {text}");
    }
    assert_eq!(w.stop(), 0);
}

#[test]
fn a_port_held_too_long_fails_the_start_naming_the_holder() {
    let port = common::free_port();
    let _listener = std::net::TcpListener::bind(("127.0.0.1", port)).unwrap();
    let mut w = Warden::start(|d, _| {
        config(d, port, &["--shards", "1"], "", "[prestart]\nport-wait = \"200ms\"\n[restart]\nmax-attempts = 1\n")
    });
    assert_eq!(w.wait_exit(), 75);
    let last = w.statuses().last().unwrap().to_string();
    let me = std::process::id();
    assert!(last.starts_with(&format!("gave up after 1 failed starts: port {port} is held by pid {me} (")), "{last}");
    assert!(!w.log().contains("--- vllm-warden: start"), "nothing was spawned");
}

/// Issue "untrickable", case 1: a port holder whose command line holds
/// newlines and notify fields cannot make the warden say READY=1.
#[test]
fn notify_injection_a_port_holders_argv_never_becomes_a_notify_field() {
    let port = common::free_port();
    let script = format!(
        "import socket,sys,time\ns=socket.socket()\ns.bind(('127.0.0.1',{port}))\ns.listen()\nprint('held',flush=True)\ntime.sleep(1000)"
    );
    let mut holder = Command::new("python3")
        .args(["-c", &script, "x\nREADY=1\nSTATUS=pwned\n\x1b[2J", "--api-key", "sk-holder", "https://u:pw@h/"])
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    let mut line = String::new();
    std::io::BufRead::read_line(&mut std::io::BufReader::new(holder.stdout.take().unwrap()), &mut line).unwrap();
    let mut holder = Reap(vec![holder]);
    let pre = "[prestart]\nport-wait = \"5m\"\n";
    let mut w = Warden::start(|d, _| config(d, port, &["--shards", "1"], "", &format!("{FAST}{pre}")));
    let waiting = w.wait_note("the port", |n| n.starts_with("STATUS=waiting up to 5m: port"));
    assert!(waiting.contains("x\\nREADY=1\\nSTATUS=pwned\\n\\x1b[2J"), "{waiting}");
    // Case 6 too: the holder's secrets are masked.
    assert!(waiting.contains("--api-key *** https://***@h/"), "{waiting}");
    assert!(!w.notes.iter().any(|n| n == "READY=1" || n.starts_with("STATUS=pwned")), "{:?}", w.notes);
    holder.0[0].kill().unwrap();
    w.wait_ready();
    assert_eq!(w.notes.iter().filter(|n| *n == "READY=1").count(), 1);
    assert_eq!(w.stop(), 0);
}

#[test]
fn a_busy_gpu_is_waited_for() {
    let mut w = Warden::start(|d, p| {
        let script = d.join("gpu-query");
        let busy = d.join("busy");
        std::fs::write(&busy, "").unwrap();
        std::fs::write(&script, format!("#!/bin/sh\n[ -e {} ] && echo '4242, 81000'\nexit 0\n", busy.display()))
            .unwrap();
        std::fs::set_permissions(&script, std::os::unix::fs::PermissionsExt::from_mode(0o755)).unwrap();
        let pre = format!("[prestart]\ngpu-idle-wait = \"60s\"\ngpu-query = [\"{}\"]\n", script.display());
        config(d, p, &["--shards", "1"], "", &format!("{FAST}{pre}"))
    });
    let waiting = w.wait_note("gpu", |n| n.starts_with("STATUS=waiting up to 1m for GPU compute processes"));
    assert!(waiting.ends_with(": pid 4242 (81000 MiB)"), "{waiting}");
    std::fs::remove_file(w.path("busy")).unwrap();
    w.wait_ready();
    assert_eq!(w.stop(), 0);
}

/// A config whose GPU query writes its pid into `pid` (a FIFO when the test
/// wants to know the moment it runs) and never answers.
fn hanging_query(d: &std::path::Path, p: u16, max_attempts: u32) -> String {
    let script = d.join("gpu-query");
    std::fs::write(&script, format!("#!/bin/sh\necho $$ > {}/pid\nexec sleep 3600\n", d.display())).unwrap();
    std::fs::set_permissions(&script, std::os::unix::fs::PermissionsExt::from_mode(0o755)).unwrap();
    let restart = format!("[restart]\ninitial-delay = \"0s\"\nmax-attempts = {max_attempts}\n");
    let pre = format!("[prestart]\ngpu-idle-wait = \"60s\"\ngpu-query = [\"{}\"]\n", script.display());
    config(d, p, &["--shards", "1"], "", &format!("{restart}{pre}"))
}

fn alive(pid: i32) -> bool {
    vllm_warden::process::child::read_stat(pid).is_some_and(|s| s.state != 'Z')
}

#[test]
fn a_hanging_gpu_query_fails_the_start_naming_it() {
    let mut w = Warden::start(|d, p| hanging_query(d, p, 1));
    assert_eq!(w.wait_exit(), 75);
    let last = w.statuses().last().unwrap().to_string();
    assert!(last.contains("did not answer within 20s (killed)"), "{last}");
    assert!(last.contains("gpu-query"), "names the query: {last}");
    assert!(!w.log().contains("--- vllm-warden: start"), "nothing was spawned");
    let pid: i32 = std::fs::read_to_string(w.path("pid")).unwrap().trim().parse().unwrap();
    assert!(!alive(pid), "the query {pid} was killed");
}

#[test]
fn a_stop_during_a_hanging_gpu_query_is_answered_and_leaves_nothing() {
    let dir = tempfile::tempdir().unwrap();
    nix::unistd::mkfifo(&dir.path().join("pid"), nix::sys::stat::Mode::from_bits_truncate(0o600)).unwrap();
    let fifo = dir.path().join("pid");
    let mut w = Warden::start(|d, p| {
        std::os::unix::fs::symlink(&fifo, d.join("pid")).unwrap();
        hanging_query(d, p, 10)
    });
    // Blocks until the query has started and written its pid.
    let pid: i32 = std::fs::read_to_string(&fifo).unwrap().trim().parse().unwrap();
    assert!(alive(pid));
    let t = std::time::Instant::now();
    assert_eq!(w.stop(), 0);
    // Far less than the query's 20 s limit: the stop did not wait for it.
    assert!(t.elapsed() < std::time::Duration::from_secs(15), "{:?}", t.elapsed());
    assert!(w.notes.iter().any(|n| n == "STOPPING=1"), "{:?}", w.notes);
    assert!(!alive(pid), "query {pid} left behind");
}

#[test]
fn a_missing_gpu_query_is_skipped() {
    let mut w = Warden::start(|d, p| {
        let pre = "[prestart]\ngpu-query = [\"/nonexistent/nvidia-smi\"]\n";
        config(d, p, &["--shards", "1"], "", &format!("{FAST}{pre}"))
    });
    w.wait_ready();
    assert_eq!(w.stop(), 0);
    assert!(w.stderr().contains("/nonexistent/nvidia-smi not found: GPU check skipped"), "{}", w.stderr());
}

#[test]
fn a_killed_wardens_stubborn_tree_is_stopped_by_the_next_warden() {
    let mut w = Warden::start(|d, p| {
        config(d, p, &["--shards", "1", "--ignore-sigterm", "--setsid-engine"], "stop-timeout = \"1s\"", FAST)
    });
    w.wait_ready();
    // The engine starts after the leader; wait until the record has both.
    let tree = w.descendants();
    assert_eq!(tree.len(), 2, "{tree:?}");
    let record = w.path("state/tree.json");
    let want: Vec<i32> = tree.iter().map(|p| p.pid).collect();
    let recorded = || -> Vec<i32> {
        let v: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(&record).unwrap_or_default()).unwrap_or_default();
        v["tree"].as_array().map(|t| t.iter().map(|r| r["pid"].as_i64().unwrap() as i32).collect()).unwrap_or_default()
    };
    // The ready transition records the whole tree (by a thread of its own):
    // wait for the file to say so.
    wait_for_file(&record, || want.iter().all(|p| recorded().contains(p)));
    w.signal(Signal::SIGKILL);
    assert_eq!(w.wait_exit(), -1);
    assert!(tree.iter().all(|p| !gone(p)), "the tree outlives its warden");

    w.spawn();
    let stopping =
        w.wait_note("leftovers", |n| n.starts_with("STATUS=stopping 2 leftover process(es) of an earlier run"));
    for p in &want {
        assert!(stopping.contains(&format!("{p} (")), "{stopping}");
    }
    w.wait_ready();
    assert!(tree.iter().all(gone), "the old tree was stopped first: {tree:?}");
    assert_eq!(w.stop(), 0);
}

/// A record as a warden of instance `t` on this boot would write it.
fn record(token: &str, tree: &[(i32, u64)]) -> String {
    let boot = std::fs::read_to_string("/proc/sys/kernel/random/boot_id").unwrap();
    let procs: Vec<String> = tree.iter().map(|(p, s)| format!("{{\"pid\": {p}, \"start_time\": {s}}}")).collect();
    format!(
        "{{\"boot_id\": \"{}\", \"instance\": \"t\", \"token\": \"{token}\", \"tree\": [{}]}}",
        boot.trim(),
        procs.join(", ")
    )
}

/// A bystander process, a record made for it by `forge(pid, start time)`,
/// and a warden started on that record: the bystander must live on, and
/// nothing is called a leftover.
fn bystander_survives(forge: impl FnOnce(i32, u64) -> String) {
    let bystander = Command::new("sleep").arg("1000").spawn().unwrap();
    let mut bystander = Reap(vec![bystander]);
    let pid = bystander.0[0].id() as i32;
    let st = vllm_warden::process::child::read_stat(pid).unwrap();
    let opts = Opts { state_files: vec![("tree.json".into(), forge(pid, st.start_time))], ..Opts::default() };
    let mut w = Warden::start_with(|d, p| config(d, p, &["--shards", "1"], "", FAST), opts);
    w.wait_ready();
    assert!(!gone(&st), "the bystander lives");
    assert!(!w.notes.iter().any(|n| n.contains("leftover")), "{:?}", w.notes);
    assert_eq!(w.stop(), 0);
    bystander.0[0].kill().unwrap();
    bystander.0.clear();
}

#[test]
fn a_recorded_pid_now_used_by_another_process_is_untouched() {
    // The same pid, but another start time: a recycled pid.
    bystander_survives(|pid, start| record("x", &[(pid, start + 12345)]));
}

/// Issue "untrickable", case 4: a record forged to name an unrelated process
/// with its exact pid and start time (and pid 1, and the test itself) gets
/// nothing signalled: none carries the warden's run token.
#[test]
fn forged_leftovers_an_exact_record_of_an_unrelated_process_signals_nothing() {
    let init = vllm_warden::process::child::read_stat(1).unwrap();
    let me = vllm_warden::process::child::read_stat(std::process::id() as i32).unwrap();
    bystander_survives(|pid, start| record("anything", &[(pid, start), (1, init.start_time), (me.pid, me.start_time)]));
}

/// A record that is not a regular file (here a FIFO, which would block a
/// plain read for ever) is ignored, and the start goes on.
#[test]
fn forged_leftovers_a_fifo_as_the_record_is_ignored() {
    let mut w = Warden::start(|d, p| {
        std::fs::create_dir_all(d.join("state")).unwrap();
        nix::unistd::mkfifo(&d.join("state/tree.json"), nix::sys::stat::Mode::from_bits_truncate(0o600)).unwrap();
        config(d, p, &["--shards", "1"], "", FAST)
    });
    w.wait_ready();
    w.wait_logged("tree record ignored");
    assert_eq!(w.stop(), 0);
}

/// A POSIX semaphore as glibc makes one: a temporary file, mapped, linked
/// to its final name, the temporary name removed. The process's maps show
/// only the temporary name (`(deleted)`); the file in use is found by its
/// identity, and kept.
#[test]
fn a_semaphore_in_use_under_its_final_name_is_kept() {
    let tag = format!("vwtest-{}-sem", std::process::id());
    let shm = std::path::Path::new("/dev/shm");
    let (temp, last) = (shm.join(format!("{tag}.XXtmp")), shm.join(format!("{tag}.mp-final")));
    std::fs::write(&temp, vec![0u8; 4096]).unwrap();
    let _holder = Reap(vec![holder("--map-file", &temp)]);
    std::fs::hard_link(&temp, &last).unwrap();
    std::fs::remove_file(&temp).unwrap();
    let globs = format!("[prestart]\nclean-shm = [\"{tag}.mp-*\"]\n");
    let mut w = Warden::start(|d, p| config(d, p, &["--shards", "1"], "", &format!("{FAST}{globs}")));
    w.wait_ready();
    assert!(last.exists(), "the semaphore in use was removed");
    w.wait_logged(&format!("kept {}", last.display()));
    assert_eq!(w.stop(), 0);
    let _ = std::fs::remove_file(&last);
}

#[test]
fn what_the_run_left_in_shared_memory_goes_when_the_warden_stops() {
    let tag = format!("vwtest-{}-left", std::process::id());
    let globs = format!("[prestart]\nclean-shm = [\"{tag}*\"]\n");
    let mut w =
        Warden::start(|d, p| config(d, p, &["--shards", "1", "--shm-file", &tag], "", &format!("{FAST}{globs}")));
    w.wait_ready();
    let file = std::path::Path::new("/dev/shm").join(&tag);
    assert!(file.exists(), "the run left a segment");
    assert_eq!(w.stop(), 0);
    assert!(!file.exists(), "removed once the tree was gone");
}

#[test]
fn vllm_dist_files_in_the_temporary_folder_are_cleaned_by_the_same_rule() {
    let tmp = tempfile::tempdir().unwrap();
    let (stale, held) = (tmp.path().join("vllm_dist_0123abcd"), tmp.path().join("vllm_dist_4567ef01"));
    let other = tmp.path().join("not_vllm_dist");
    for f in [&stale, &held, &other] {
        std::fs::write(f, b"").unwrap();
    }
    let _holder = Reap(vec![holder("--hold-file", &held)]);
    let opts = Opts { env: vec![("TMPDIR".into(), tmp.path().display().to_string())], ..Opts::default() };
    let mut w = Warden::start_with(|d, p| config(d, p, &["--shards", "1"], "", FAST), opts);
    w.wait_ready();
    assert!(!stale.exists(), "a vllm_dist file nobody uses is removed");
    assert!(held.exists(), "one in use is kept");
    assert!(other.exists(), "other files are not touched");
    assert_eq!(w.stop(), 0);
}

/// A Python that answers the look as Ray 2.56.1's GCS did (real answers):
/// the second node dead until the file `joined` exists, both alive after;
/// the address is a listener of the test (only the connection is looked
/// at).
fn ray_gate(d: &std::path::Path, p: u16, address: &str, extra: &str, restart: &str) -> String {
    std::fs::write(d.join("two.json"), include_str!("fixtures/ray/gcs-two-nodes.json")).unwrap();
    std::fs::write(d.join("one.json"), include_str!("fixtures/ray/gcs-one-dead.json")).unwrap();
    let script = d.join("python3");
    let d = d.display();
    std::fs::write(
        &script,
        format!("#!/bin/sh\necho \"$1 $3\" > {d}/asked\nif [ -e {d}/joined ]; then cat {d}/two.json; else cat {d}/one.json; fi\n"),
    )
    .unwrap();
    std::fs::set_permissions(&script, std::os::unix::fs::PermissionsExt::from_mode(0o755)).unwrap();
    let pre = format!(
        "[prestart]\nray-address = \"{address}\"\nray-min-nodes = 2\nray-python = \"{}\"\n{extra}",
        script.display()
    );
    config(std::path::Path::new(&d.to_string()), p, &["--shards", "1"], "", &format!("{FAST}{restart}{pre}"))
}

#[test]
fn a_start_waits_at_the_ray_gate_until_the_cluster_is_whole() {
    let head = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let address = head.local_addr().unwrap().to_string();
    let mut w = Warden::start(|d, p| ray_gate(d, p, &address, "ray-wait = \"5m\"\n", ""));
    let waiting = w.wait_note("the gate", |n| n.starts_with("STATUS=waiting up to 5m for the Ray cluster at "));
    assert!(waiting.contains(&format!("at {address}: 1 of 2 nodes alive (next look in ")), "{waiting}");
    assert!(!w.log().contains("--- vllm-warden: start"), "nothing is spawned while the cluster is short");
    let asked = std::fs::read_to_string(w.path("asked")).unwrap();
    assert_eq!(asked.trim(), format!("-c {address}"));
    std::fs::write(w.path("joined"), "").unwrap();
    w.wait_ready();
    assert_eq!(w.stop(), 0);
}

#[test]
fn a_cluster_that_stays_short_fails_the_start_naming_what_is_missing() {
    let head = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let address = head.local_addr().unwrap().to_string();
    let mut w = Warden::start(|d, p| ray_gate(d, p, &address, "ray-wait = \"2s\"\n", "max-attempts = 1\n"));
    assert_eq!(w.wait_exit(), 75);
    let last = w.statuses().last().unwrap().to_string();
    assert!(last.contains(&format!("Ray cluster at {address} not ready after 2s: 1 of 2 nodes alive")), "{last}");
    assert!(!w.log().contains("--- vllm-warden: start"), "nothing was spawned");
    drop(head);
}

#[test]
fn a_head_that_is_not_there_is_named() {
    let address = format!("127.0.0.1:{}", common::free_port());
    let mut w = Warden::start(|d, p| ray_gate(d, p, &address, "ray-wait = \"1s\"\n", "max-attempts = 1\n"));
    assert_eq!(w.wait_exit(), 75);
    let last = w.statuses().last().unwrap().to_string();
    assert!(last.contains(&format!("not ready after 1s: nothing answers at {address} (Connection refused")), "{last}");
    assert!(!w.path("asked").exists(), "Ray was not asked");
}
