//! The real binary supervising the fake vLLM: real processes, signals,
//! inotify and HTTP, with a datagram socket in place of systemd.

mod common;

use common::{Opts, Warden, config, gone};
use nix::sys::signal::Signal;

const FAST: &str = "[restart]\ninitial-delay = \"0s\"\n";

#[test]
fn ready_after_the_line_and_http_then_a_clean_stop() {
    // A load long enough for its progress to be shown: a status held with
    // a put-off write goes out when the write does, at most 250 ms later.
    let mut w = Warden::start(|d, p| config(d, p, &["--shards", "4", "--shard-time", "400ms"], "", FAST));
    w.wait_ready();
    let ready_status = w.wait_note("ready status", |n| n.starts_with("STATUS=ready: pid "));
    // Progress came first, with the start timeout extended (statuses held
    // with a put-off write are coalesced: which shard shows may vary).
    let pos = |pred: &dyn Fn(&str) -> bool| w.notes.iter().position(|n| pred(n)).unwrap();
    // The phase and its place first: this setup has no earlier load.
    let shards = pos(&|n: &str| {
        n.starts_with("STATUS=loading 2/9 weights · ")
            && n.contains(" (no earlier load of this setup), pid ")
            && n.contains(": Loading safetensors checkpoint shards: ")
    });
    let ready = pos(&|n: &str| n == "READY=1");
    assert!(shards < ready);
    assert!(w.notes.iter().any(|n| n == "EXTEND_TIMEOUT_USEC=900000000"));

    // The child: its own group, no systemd variables, stdin from /dev/null.
    let pid: i32 = ready_status["STATUS=ready: pid ".len()..].split(',').next().unwrap().parse().unwrap();
    let environ = std::fs::read(format!("/proc/{pid}/environ")).unwrap();
    let environ = String::from_utf8_lossy(&environ);
    assert!(!environ.contains("NOTIFY_SOCKET="), "the child must not inherit NOTIFY_SOCKET");
    assert_eq!(nix::unistd::getpgid(Some(nix::unistd::Pid::from_raw(pid))).unwrap().as_raw(), pid);
    assert_eq!(std::fs::read_link(format!("/proc/{pid}/fd/0")).unwrap().to_str(), Some("/dev/null"));
    let log = w.log();
    assert!(log.starts_with("--- vllm-warden: start 1 at 20"), "{log}");
    assert!(log.contains("Application startup complete"));

    let tree = w.descendants();
    assert_eq!(w.stop(), 0);
    assert!(w.notes.iter().any(|n| n == "STOPPING=1"));
    assert!(tree.iter().all(gone), "left behind: {tree:?}");
}

#[test]
fn a_ready_child_exiting_0_after_a_fatal_engine_error_is_restarted() {
    let mut w = Warden::start(|d, p| {
        let count = d.join("runs");
        let count = count.to_str().unwrap();
        // The engine dies 1 s after the fake answered the readiness check:
        // the warden has long declared it ready by then.
        let args = [
            "--shards",
            "1",
            "--fail",
            "engine-death",
            "--fail-after",
            "1s",
            "--fail-times",
            "1",
            "--count-file",
            count,
        ];
        config(d, p, &args, "", FAST)
    });
    w.wait_ready();
    let restarting = w.wait_note("restart", |n| n.starts_with("STATUS=restarting in"));
    assert_eq!(
        restarting,
        "STATUS=restarting in 0s (attempt 2/10): RuntimeError: CUDA error: an illegal memory access was encountered"
    );
    w.wait_ready();
    assert!(w.log().contains("--- vllm-warden: start 2 at "));
    assert_eq!(w.stop(), 0);
}

#[test]
fn a_transient_nccl_error_succeeds_on_retry() {
    let mut w = Warden::start(|d, p| {
        let count = d.join("runs");
        config(
            d,
            p,
            &["--shards", "2", "--fail", "nccl", "--fail-times", "1", "--count-file", count.to_str().unwrap()],
            "",
            FAST,
        )
    });
    let restarting = w.wait_note("restart", |n| n.starts_with("STATUS=restarting in"));
    assert!(
        restarting
            .ends_with("(attempt 2/10): NCCL error: unhandled system error (run with NCCL_DEBUG=INFO for details)"),
        "{restarting}"
    );
    w.wait_ready();
    assert_eq!(w.stop(), 0);
}

#[test]
fn a_permanent_cause_ends_in_78() {
    let mut w = Warden::start(|d, p| config(d, p, &["--shards", "1", "--fail", "kv-cache"], "", FAST));
    assert_eq!(w.wait_exit(), 78);
    let last = w.statuses().last().unwrap().to_string();
    assert_eq!(
        last,
        "failed permanently (2 of 2 tries): NotImplementedError: Currently supported kv cache quantization is num_bits=8, type=float, however received num_bits=4, type=float"
    );
    assert_eq!(w.log().matches("--- vllm-warden: start").count(), 2);
}

#[test]
fn a_fatal_line_with_a_hanging_child_is_stopped_after_the_grace() {
    let mut w = Warden::start(|d, p| {
        let extra = "[fatal]\ngrace = \"200ms\"\n[restart]\nmax-attempts = 1\n";
        config(d, p, &["--shards", "1", "--fail", "fatal-hang"], "stop-timeout = \"2s\"", extra)
    });
    let failing = w.wait_note("fatal", |n| n.starts_with("STATUS=failing: "));
    assert!(failing.contains("EngineCore failed to start."));
    let tree = w.descendants();
    assert_eq!(w.wait_exit(), 75);
    assert_eq!(w.statuses().last().unwrap(), &"gave up after 1 failed starts: EngineCore failed to start.");
    assert!(tree.iter().all(gone), "left behind: {tree:?}");
}

#[test]
fn a_stalled_load_is_a_failed_start() {
    let mut w = Warden::start(|d, p| {
        let extra = "[ready]\nstall = \"500ms\"\n[restart]\nmax-attempts = 1\n";
        config(d, p, &["--shards", "4", "--fail", "stall"], "stop-timeout = \"2s\"", extra)
    });
    assert_eq!(w.wait_exit(), 75);
    let last = w.statuses().last().unwrap().to_string();
    assert_eq!(
        last,
        "gave up after 1 failed starts: no progress for 1s (ready.stall); last: Loading safetensors checkpoint shards: 2/4 (50%)"
    );
}

#[test]
fn a_stop_during_a_load_kills_a_stubborn_tree_with_a_setsid_grandchild() {
    let mut w = Warden::start(|d, p| {
        config(
            d,
            p,
            &["--shards", "1000", "--shard-time", "1s", "--ignore-sigterm", "--setsid-engine"],
            "stop-timeout = \"2s\"",
            "",
        )
    });
    // Statuses held with a put-off write are coalesced: the first shown
    // may be a later shard than the first.
    w.wait_note("loading", |n| n.contains("Loading safetensors checkpoint shards: ") && n.contains("/1000"));
    let tree = w.descendants();
    assert!(tree.len() >= 2, "the fake and its engine: {tree:?}");
    let engine = tree.iter().find(|p| p.ppid != w.pid as i32).expect("a grandchild");
    assert_eq!(
        nix::unistd::getsid(Some(nix::unistd::Pid::from_raw(engine.pid))).unwrap().as_raw(),
        engine.pid,
        "the grandchild has its own session"
    );
    let t = std::time::Instant::now();
    assert_eq!(w.stop(), 0);
    assert!(tree.iter().all(gone), "left behind: {tree:?}");
    // The stop signal is repeated, then SIGKILL after min(stop-timeout, 10s).
    assert!(t.elapsed() < std::time::Duration::from_secs(30));
    assert!(w.stderr().contains("SIGKILL to the whole tree"), "{}", w.stderr());
}

#[test]
fn a_killed_api_server_leaves_no_orphan_behind() {
    let mut w =
        Warden::start(|d, p| config(d, p, &["--shards", "1", "--setsid-engine"], "stop-timeout = \"2s\"", FAST));
    w.wait_ready();
    kill_the_server_and_see_it_restart(&mut w);
    assert_eq!(w.stop(), 0);
}

/// SIGKILL the API server of a ready tree: the restart is for that, and
/// the engine it left is stopped before the next server is ready.
fn kill_the_server_and_see_it_restart(w: &mut Warden) {
    let tree = w.descendants();
    let leader = tree.iter().find(|p| p.ppid == w.pid as i32).unwrap().pid;
    nix::sys::signal::kill(nix::unistd::Pid::from_raw(leader), Signal::SIGKILL).unwrap();
    let restarting = w.wait_note("restart", |n| n.starts_with("STATUS=restarting in"));
    assert!(restarting.ends_with("exited while serving (killed by SIGKILL)"), "{restarting}");
    w.wait_ready();
    assert!(tree.iter().all(gone), "the orphaned engine was stopped before the restart: {tree:?}");
}

#[test]
fn a_dead_reaper_stops_the_tree_and_exits_70() {
    // The hook makes the reaper panic at an exit other than the child's
    // while the child runs: the kernel-message follower's, a `cat` of a
    // FIFO that ends when the test opens and closes the FIFO. No other
    // command may end meanwhile: no GPU query, and a PATH of `cat` alone,
    // so that no `nvidia-smi` (the host's, or the tests' stand-in) is
    // asked for the GPUs' addresses.
    let bin = tempfile::tempdir().unwrap();
    let cat = ["/usr/bin/cat", "/bin/cat"].into_iter().find(|c| std::path::Path::new(c).exists()).unwrap();
    std::os::unix::fs::symlink(cat, bin.path().join("cat")).unwrap();
    let opts = Opts {
        env: vec![
            ("VLLM_WARDEN_TEST_PANIC".into(), "reaper".into()),
            ("PATH".into(), bin.path().display().to_string()),
        ],
        host_tools: true,
        ..Opts::default()
    };
    let mut w = Warden::start_with(
        |d, p| {
            let fifo = d.join("go");
            nix::unistd::mkfifo(&fifo, nix::sys::stat::Mode::S_IRWXU).unwrap();
            let extra = format!(
                "{FAST}[prestart]\ngpu-idle-wait = \"0s\"\n[health]\nkernel-messages = [\"cat\", \"{}\"]\n",
                fifo.display()
            );
            config(d, p, &["--shards", "1", "--setsid-engine"], "", &extra)
        },
        opts,
    );
    w.wait_ready();
    let tree: Vec<_> = w.descendants().into_iter().filter(|p| p.pid != helper_pid(&w)).collect();
    assert!(tree.len() >= 2, "the server and its engine: {tree:?}");
    drop(std::fs::OpenOptions::new().write(true).open(w.path("go")).unwrap());
    assert_eq!(w.wait_exit(), 70);
    assert!(tree.iter().all(gone), "nothing of the tree is left: {tree:?}");
    assert!(w.stderr().contains("the reaper task panicked"), "{}", w.stderr());
    assert!(w.statuses().last().unwrap().starts_with("internal failure: the reaper task panicked"), "{:?}", w.notes);
}

#[test]
fn a_reap_that_never_ends_hides_no_later_exit() {
    // The hook makes every reap's thread stop for ever once it has reaped
    // its zombie, as a reap spinning in the kernel does: each exit after it
    // must still be seen, its tree stopped and the child started again.
    let opts = Opts { env: vec![("VLLM_WARDEN_TEST_PANIC".into(), "reap".into())], ..Opts::default() };
    let extra = format!("{FAST}[prestart]\ngpu-idle-wait = \"0s\"\n");
    let mut w = Warden::start_with(
        |d, p| config(d, p, &["--shards", "1", "--setsid-engine"], "stop-timeout = \"2s\"", &extra),
        opts,
    );
    w.wait_ready();
    for _ in 0..2 {
        kill_the_server_and_see_it_restart(&mut w);
    }
    assert_eq!(w.stop(), 0);
    let stderr = w.stderr();
    assert!(stderr.contains("has lasted over 200 ms") && stderr.contains("EVENT=\"reap\""), "{stderr}");
}

/// The warden's `cat` (its kernel-message follower in the reaper's test).
fn helper_pid(w: &Warden) -> i32 {
    vllm_warden::process::child::descendants(w.pid as i32)
        .into_iter()
        .find(|p| std::fs::read_to_string(format!("/proc/{}/comm", p.pid)).is_ok_and(|c| c.trim() == "cat"))
        .map_or(-1, |p| p.pid)
}

#[test]
fn an_exit_held_up_after_the_stop_ends_at_its_deadline_naming_the_step() {
    // The hook makes the exit's removal of the tree's files block for ever,
    // as a read of a process stuck in the kernel can.
    let opts = Opts { env: vec![("VLLM_WARDEN_TEST_PANIC".into(), "exit".into())], ..Opts::default() };
    let extra = format!("{FAST}[prestart]\ngpu-idle-wait = \"0s\"\n");
    let mut w = Warden::start_with(|d, p| config(d, p, &["--shards", "1"], "", &extra), opts);
    w.wait_ready();
    assert_eq!(w.stop(), 0, "the loop's code");
    let stderr = w.stderr();
    assert!(
        stderr.contains("the exit was held up for 15s at: removing the files the tree left; ending now with code 0"),
        "{stderr}"
    );
    assert_eq!(vllm_warden::daemon::EXIT_DEADLINE, std::time::Duration::from_secs(15));
}

#[test]
fn the_childs_log_is_followed_through_five_rotations_and_others_lines_are_not_read() {
    let extra = format!("{FAST}[fatal]\ngrace = \"1s\"\n");
    let mut w = Warden::start(|d, p| config(d, p, &["--shards", "1", "--fatal-on-usr1"], "", &extra));
    w.wait_ready();
    let leader = w.descendants().iter().find(|p| p.ppid == w.pid as i32).unwrap().pid;
    for i in 1..=5 {
        std::fs::rename(w.path("t.log"), w.path(&format!("t.log.{i}"))).unwrap();
        // Someone else's file at the path, with a line that would be a
        // permanent cause if it were read as the child's.
        std::fs::write(w.path("t.log"), "ValueError: No available memory for the cache blocks\n").unwrap();
    }
    nix::sys::signal::kill(nix::unistd::Pid::from_raw(leader), Signal::SIGUSR1).unwrap();
    let failed = w.wait_note("the failure", |n| n.starts_with("STATUS=failed"));
    assert!(failed.ends_with("RuntimeError: CUDA error: an illegal memory access was encountered"), "{failed}");
    w.wait_ready();
    assert_eq!(w.stop(), 0);
}

/// Issue "untrickable", case 5: a second warden on the same config exits at
/// once, naming the first, and touches nothing of its run.
#[test]
fn a_second_warden_on_the_same_instance_exits_69_and_touches_nothing() {
    let mut w = Warden::start(|d, p| config(d, p, &["--shards", "1"], "", FAST));
    w.wait_ready();
    let tree = w.descendants();
    let out = w.command("run").env_remove("NOTIFY_SOCKET").output().unwrap();
    assert_eq!(out.status.code(), Some(69));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains(&format!("instance \"t\" is already supervised by pid {}", w.pid)), "{err}");
    assert!(tree.iter().all(|p| !gone(p)), "the first warden's tree is untouched");
    assert_eq!(w.log().matches("--- vllm-warden: start").count(), 1, "nothing was spawned");
    assert_eq!(w.stop(), 0);
}

#[test]
fn sigint_stops_like_sigterm() {
    let mut w = Warden::start(|d, p| config(d, p, &["--shards", "1"], "", FAST));
    w.wait_ready();
    w.signal(Signal::SIGINT);
    assert_eq!(w.wait_exit(), 0);
}

#[test]
fn a_missing_program_is_permanent() {
    let mut w = Warden::start(|d, _| {
        format!(
            "[child]\ncommand = [\"/nonexistent/vllm\"]\nlog-file = \"{0}/t.log\"\n[status]\nfile = \"{0}/s.json\"\n{FAST}",
            d.display()
        )
    });
    assert_eq!(w.wait_exit(), 78);
    // Named by the step before the spawn, with the uid.
    let last = w.statuses().last().unwrap().to_string();
    assert!(last.contains("`command`: /nonexistent/vllm: No such file or directory (os error 2) for uid"), "{last}");
}

#[test]
fn an_abstract_notify_socket_works() {
    let opts = Opts { abstract_socket: true, ..Opts::default() };
    let mut w = Warden::start_with(|d, p| config(d, p, &["--shards", "1"], "", FAST), opts);
    w.wait_ready();
    assert_eq!(w.stop(), 0);
}

#[test]
fn the_watchdog_is_fed_at_half_its_period() {
    let opts = Opts { env: vec![("WATCHDOG_USEC".into(), "200000".into())], ..Opts::default() };
    let mut w = Warden::start_with(|d, p| config(d, p, &["--shards", "1"], "", FAST), opts);
    w.wait_ready();
    w.wait_note("WATCHDOG=1", |n| n == "WATCHDOG=1");
    w.wait_note("WATCHDOG=1", |n| n == "WATCHDOG=1");
    assert_eq!(w.stop(), 0);
}

#[test]
fn the_watchdog_of_another_pid_is_not_ours() {
    let env = vec![("WATCHDOG_USEC".into(), "100000".into()), ("WATCHDOG_PID".into(), "1".into())];
    let mut w = Warden::start_with(|d, p| config(d, p, &["--shards", "1"], "", FAST), Opts { env, ..Opts::default() });
    w.wait_ready();
    assert_eq!(w.stop(), 0);
    assert!(!w.notes.iter().any(|n| n == "WATCHDOG=1"), "{:?}", w.notes);
}

#[test]
fn without_notify_socket_the_warden_works_the_same() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = dir.path().join("t.toml");
    std::fs::write(&cfg, config(dir.path(), common::free_port(), &["--shards", "1", "--fail", "kv-cache"], "", FAST))
        .unwrap();
    let out = std::process::Command::new(common::exe())
        .args(["run", "-c"])
        .arg(&cfg)
        .env_remove("NOTIFY_SOCKET")
        .env_remove("JOURNAL_STREAM")
        .env("STATE_DIRECTORY", dir.path().join("state"))
        // Its own control socket, not /run/vllm-warden/t/'s.
        .env("RUNTIME_DIRECTORY", dir.path().join("run"))
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(78));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("failed permanently (2 of 2 tries)"), "{err}");
    assert!(!err.contains("cannot notify"), "{err}");
}

#[test]
fn secrets_are_masked_where_the_command_is_printed() {
    let env = "env = { HF_TOKEN = \"hf_secret\", PLAIN = \"shown\" }";
    let mut w = Warden::start(|d, p| config(d, p, &["--shards", "1", "--api-key", "sk-very-secret"], env, FAST));
    w.wait_ready();
    assert_eq!(w.stop(), 0);
    let err = w.stderr();
    assert!(err.contains("--api-key ***") && err.contains("HF_TOKEN=***") && err.contains("PLAIN=shown"), "{err}");
    assert!(!err.contains("sk-very-secret") && !err.contains("hf_secret"), "{err}");
}

#[test]
fn blocked_signals_are_unblocked_for_the_warden_and_its_child() {
    let opts = Opts { blocked_signals: true, ..Opts::default() };
    // A fake that ignores SIGTERM rather than blocking it for sigwait, so
    // that its mask is what it inherited.
    let make =
        |d: &std::path::Path, p| config(d, p, &["--shards", "1", "--ignore-sigterm"], "stop-timeout = \"1s\"", FAST);
    let mut w = Warden::start_with(make, opts);
    w.wait_ready();
    let leader = w.descendants().into_iter().find(|p| p.ppid == w.pid as i32).unwrap();
    let status = std::fs::read_to_string(format!("/proc/{}/status", leader.pid)).unwrap();
    let blocked = status.lines().find(|l| l.starts_with("SigBlk:")).unwrap();
    assert_eq!(blocked.split_whitespace().nth(1), Some("0000000000000000"), "{blocked}");
    assert_eq!(w.stop(), 0);
}

/// A model folder whose config.json asks for a 4-bit KV cache, which the
/// fake (like vLLM 0.32) refuses.
fn fp4_model(d: &std::path::Path) -> std::path::PathBuf {
    let m = d.join("model");
    std::fs::create_dir_all(&m).unwrap();
    let cfg = "{\n  \"architectures\": [\"LlamaForCausalLM\"],\n  \"quantization_config\": {\n    \"quant_method\": \"compressed-tensors\",\n    \"kv_cache_scheme\": {\"num_bits\": 4, \"type\": \"float\"}\n  }\n}\n";
    std::fs::write(m.join("config.json"), cfg).unwrap();
    m
}

#[test]
fn the_kv_cache_patch_makes_a_failing_model_load() {
    // Without the patch: the real exception names the cause, then 78.
    let mut w = Warden::start(|d, p| {
        let m = fp4_model(d);
        config(d, p, &["--shards", "1", "--model", m.to_str().unwrap()], "", FAST)
    });
    assert_eq!(w.wait_exit(), 78);
    assert!(w.statuses().last().unwrap().contains("NotImplementedError: Currently supported kv cache quantization is num_bits=8, type=float, however received num_bits=4"));

    // With the patch, applied before the start: it loads.
    let mut w = Warden::start(|d, p| {
        let m = fp4_model(d);
        let patch = format!(
            "[[patch]]\nfile = \"{}/config.json\"\nremove = [\"quantization_config.kv_cache_scheme\"]\n",
            m.display()
        );
        config(d, p, &["--shards", "1", "--model", m.to_str().unwrap()], "", &format!("{FAST}{patch}"))
    });
    w.wait_note("patching", |n| n == "STATUS=applying 1 patch");
    w.wait_ready();
    let cfg = std::fs::read_to_string(w.path("model/config.json")).unwrap();
    assert!(!cfg.contains("kv_cache_scheme") && cfg.contains("compressed-tensors"), "{cfg}");
    assert_eq!(w.stop(), 0);
}

#[test]
fn a_patch_that_cannot_apply_is_a_permanent_failed_start() {
    let mut w = Warden::start(|d, p| {
        let m = d.join("model");
        std::fs::create_dir_all(&m).unwrap();
        std::fs::write(m.join("config.json"), "{ \"truncated\": ").unwrap();
        let patch = format!("[[patch]]\nfile = \"{}/config.json\"\nremove = [\"a\"]\n", m.display());
        config(d, p, &["--shards", "1"], "", &format!("{FAST}{patch}"))
    });
    assert_eq!(w.wait_exit(), 78);
    let last = w.statuses().last().unwrap().to_string();
    assert!(
        last.starts_with("failed permanently (2 of 2 tries): patch failed: ")
            && last.contains("config.json: malformed JSON at line 1"),
        "{last}"
    );
    assert!(!w.log().contains("--- vllm-warden: start"), "nothing was spawned");
}

fn status_cmd(w: &Warden, json: bool) -> (i32, String) {
    let mut c = w.command("status");
    if json {
        c.arg("--json");
    }
    let o = c.output().unwrap();
    (o.status.code().unwrap(), String::from_utf8_lossy(&o.stdout).into_owned())
}

#[test]
fn the_status_document_command_and_metrics_follow_the_run() {
    let mut w = Warden::start(|d, p| config(d, p, &["--shards", "1000", "--shard-time", "50ms"], "", FAST));
    // Statuses held with a put-off write are coalesced: the first shown
    // may be a later shard than the first.
    w.wait_note("loading", |n| n.contains("Loading safetensors checkpoint shards: ") && n.contains("/1000"));
    let (code, out) = status_cmd(&w, false);
    assert_eq!(code, 3, "running, not ready: {out}");
    assert!(out.starts_with("t: starting, pid "), "{out}");
    assert!(out.contains("progress: Loading safetensors checkpoint shards: "), "{out}");
    let (_, json) = status_cmd(&w, true);
    let doc: serde_json::Value = serde_json::from_str(&json).unwrap();
    assert_eq!(doc["state"], "starting");
    assert_eq!(doc["warden_pid"], w.pid);
    assert_eq!(doc["attempt"], 1);
    assert!(doc["child_pid"].as_u64().unwrap() > 0);
    let metrics = std::fs::read_to_string(w.path("vllm_warden.prom")).unwrap();
    assert!(metrics.contains("vllm_warden_state{name=\"t\",state=\"starting\"} 1"), "{metrics}");
    // Every turn of the loop, timed.
    assert!(metrics.contains("vllm_warden_loop_turn_duration_seconds_count{name=\"t\"} "), "{metrics}");
    assert!(metrics.contains("vllm_warden_child_starts_total{name=\"t\"} 1"), "{metrics}");
    assert_eq!(w.stop(), 0);
    let (code, out) = status_cmd(&w, false);
    assert_eq!(code, 4, "{out}");
    assert!(out.contains("not running (exited with 0") && out.ends_with(": stopped on request\n"), "{out}");
    let doc: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(w.path("status.json")).unwrap()).unwrap();
    assert_eq!(doc["state"], "stopped");
    assert_eq!(doc["exit_code"], 0);
}

#[test]
fn status_is_0_when_ready_and_counts_failures_by_class() {
    let mut w = Warden::start(|d, p| {
        let count = d.join("runs");
        let args = ["--shards", "1", "--fail", "nccl", "--fail-times", "1", "--count-file", count.to_str().unwrap()];
        config(d, p, &args, "", FAST)
    });
    w.wait_ready();
    let (code, out) = status_cmd(&w, false);
    assert_eq!(code, 0, "{out}");
    assert!(out.contains("t: ready, pid ") && out.contains("attempt 2, 1 restart(s)"), "{out}");
    assert!(out.contains("last exit: exit code 1 at "), "{out}");
    let (_, json) = status_cmd(&w, true);
    let doc: serde_json::Value = serde_json::from_str(&json).unwrap();
    assert!(doc["ready_since"].is_string());
    assert_eq!(doc["last_exit"]["code"], 1);
    let metrics = std::fs::read_to_string(w.path("vllm_warden.prom")).unwrap();
    for want in [
        "vllm_warden_ready{name=\"t\"} 1",
        "vllm_warden_failures_total{name=\"t\",class=\"fatal_line\"} 1",
        "vllm_warden_restarts_total{name=\"t\",reason=\"failure\"} 1",
        "vllm_warden_restarts_total{name=\"t\",reason=\"restart\"} 0",
        "vllm_warden_last_load_duration_seconds{name=\"t\"} ",
    ] {
        assert!(metrics.contains(want), "{want}:\n{metrics}");
    }
    assert_eq!(w.stop(), 0);
}

#[test]
fn status_without_a_running_instance_is_4() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = dir.path().join("x.toml");
    std::fs::write(
        &cfg,
        format!("[child]\ncommand = [\"/bin/true\"]\n[status]\nfile = \"{}/none.json\"\n", dir.path().display()),
    )
    .unwrap();
    let o = std::process::Command::new(common::exe())
        .args(["status", "-c"])
        .arg(&cfg)
        .env("RUNTIME_DIRECTORY", dir.path().join("run"))
        .output()
        .unwrap();
    assert_eq!(o.status.code(), Some(4));
    assert!(
        String::from_utf8_lossy(&o.stdout)
            .starts_with(&format!("x: not running (no status file {}/none.json)", dir.path().display()))
    );
}

/// A child that writes 50 MB at full speed before its ready line, into a
/// log rotated every MiB: the ready line and then the fatal line are still
/// seen; every line written is in one of the files, once, in order, and
/// whole (each rotation is cut at the end of a line); and no file holds
/// more than the size, one read of the pipe (256 KiB) and what the pipe
/// held at the child's exit (the writer waits for each rotation: a
/// follower behind the child, as a debug build is, made fewer, larger
/// copies before).
#[test]
fn the_log_rotated_under_a_flood_loses_no_line() {
    rotated_under_a_flood(None);
}

/// The same on tmpfs.
#[test]
fn the_log_rotated_on_tmpfs_under_a_flood_loses_no_line() {
    // /dev/shm is half the memory by default, but a container's is 64 MiB:
    // the flood's log needs room, twice it for a margin.
    let free = nix::sys::statvfs::statvfs("/dev/shm").map(|s| s.blocks_available() * s.fragment_size());
    match free {
        Ok(free) if free >= 2 * FLOOD => {}
        Ok(free) => {
            eprintln!(
                "SKIPPED: /dev/shm has {} MiB free, under the {} MiB this test wants",
                free >> 20,
                (2 * FLOOD) >> 20
            );
            return;
        }
        Err(e) => {
            eprintln!("SKIPPED: /dev/shm: {e}");
            return;
        }
    }
    let shm = tempfile::tempdir_in("/dev/shm").unwrap();
    rotated_under_a_flood(Some(shm.path()));
}

/// What the child writes before its ready line in the flood tests.
const FLOOD: u64 = 50 << 20;

fn rotated_under_a_flood(log_dir: Option<&std::path::Path>) {
    let log_dir = log_dir.map(|p| p.to_path_buf());
    let mut w = Warden::start(|d, p| {
        let count = d.join("runs");
        let flood = FLOOD.to_string();
        let args = [
            "--shards",
            "1",
            "--fail",
            "engine-death",
            "--fail-after",
            "1s",
            "--fail-times",
            "1",
            "--count-file",
            count.to_str().unwrap(),
            "--flood-before-ready",
            flood.as_str(),
        ];
        let text = config(d, p, &args, "log-max-size = \"1 MiB\"\nlog-keep = 1000\nlog-compress = false", FAST);
        match &log_dir {
            Some(l) => text.replace(&format!("{}/t.log", d.display()), &format!("{}/t.log", l.display())),
            None => text,
        }
    });
    w.wait_ready();
    let restarting = w.wait_note("restart", |n| n.starts_with("STATUS=restarting in"));
    assert!(restarting.ends_with("RuntimeError: CUDA error: an illegal memory access was encountered"), "{restarting}");
    w.wait_ready();
    assert_eq!(w.stop(), 0);

    // Every file of the log, oldest first: t.log.N … t.log.1, t.log.
    let dir = log_dir.as_deref().unwrap_or(w.dir.path());
    let mut copies: Vec<(u32, std::path::PathBuf)> = std::fs::read_dir(dir)
        .unwrap()
        .filter_map(|e| {
            let name = e.unwrap().file_name().into_string().unwrap();
            let k = name.strip_prefix("t.log.")?.parse().ok()?;
            Some((k, dir.join(name)))
        })
        .collect();
    copies.sort_by_key(|c| std::cmp::Reverse(c.0));
    assert!(!copies.is_empty(), "no rotation");
    // Each file on its own: a line cut by a rotation is torn in two, the
    // end of one file and the start of the next, neither a whole line.
    let (mut seen, mut torn, mut largest) = (Vec::new(), Vec::new(), 0);
    for path in copies.iter().map(|(_, p)| p).chain([&dir.join("t.log")]) {
        let text = std::fs::read(path).unwrap();
        largest = largest.max(text.len());
        if path.extension().is_some_and(|e| e != "log") && !text.ends_with(b"\n") {
            torn.push(format!("{} ends inside a line", path.display()));
        }
        for line in text.split(|b| *b == b'\n') {
            let line = String::from_utf8_lossy(line);
            if let Some((_, rest)) = line.split_once(" flood ")
                && !rest.starts_with("done")
            {
                // `flood 0000000042 Received request cmpl-2a`, whole.
                match rest.get(..10).and_then(|n| n.parse::<u64>().ok()) {
                    Some(n) if rest == format!("{n:010} Received request cmpl-{n:x}") => seen.push(n),
                    _ => torn.push(format!("{}: {line:?}", path.display())),
                }
            }
        }
    }
    let last = *seen.iter().max().unwrap();
    let lost = last + 1 - seen.len() as u64;
    println!(
        "{} copies; {lost} of {} lines lost, {} torn; largest file {largest} bytes (size 1 MiB)",
        copies.len(),
        last + 1,
        torn.len()
    );
    assert!(torn.is_empty(), "{} torn line(s), the first: {:?}", torn.len(), &torn[..torn.len().min(5)]);
    // In order, no line twice, none missing.
    assert!(seen.windows(2).all(|w| w[0] < w[1]), "lines out of order or twice");
    assert_eq!(lost, 0, "lines lost in {} rotations", copies.len());
    assert!(largest <= (1 << 20) + (256 << 10) + (1 << 20), "a file of {largest} bytes (size 1 MiB)");
}

/// `vllm-warden upgrade` while ready, with the binary at the warden's path
/// replaced by another file: the warden runs the new file (same pid), the
/// child keeps its pid and stays the warden's child, systemd hears the
/// upgrade and no new READY=1; the new warden checks the golden answers
/// again; the ready run is then supervised as before (a killed child is
/// restarted).
#[test]
fn an_upgrade_in_place_keeps_the_child_and_supervises_it_after() {
    use std::os::unix::fs::MetadataExt;
    let (bin, path, mut w) = warden_from_a_copy(&["--shards", "1"]);
    w.wait_ready();
    let leader = w.descendants().into_iter().find(|p| p.ppid == w.pid as i32).unwrap();

    // The package manager's way: a new file renamed over the old name.
    let new = bin.path().join("vllm-warden.new");
    std::fs::copy(common::exe(), &new).unwrap();
    std::fs::rename(&new, &path).unwrap();
    let new_ino = std::fs::metadata(&path).unwrap().ino();
    w.ask_upgrade(&path);

    let note = w.wait_note("the upgrade", |n| n.starts_with("STATUS=upgraded from"));
    let v = env!("CARGO_PKG_VERSION");
    assert_eq!(note, format!("STATUS=upgraded from {v} to {v}; ready: pid {}", leader.pid));
    assert_eq!(std::fs::metadata(format!("/proc/{}/exe", w.pid)).unwrap().ino(), new_ino, "the new file runs");
    let now = vllm_warden::process::child::read_stat(leader.pid).unwrap();
    assert_eq!((now.ppid, now.start_time), (w.pid as i32, leader.start_time), "the same child, still ours");
    assert_eq!(w.notes.iter().filter(|n| *n == "READY=1").count(), 1, "no new READY=1");
    assert!(!w.path("upgrade.json").exists(), "the state file is gone");
    // The new warden proves the answers of what it took over before it
    // vouches for them: out of rotation, the golden check, back.
    let out = w.wait_note("the re-check", |n| n.starts_with("STATUS=rechecking pid "));
    assert!(out.ends_with(&format!("(the warden upgraded from {v} to {v})")), "{out}");
    let back = w.wait_note("back in rotation", |n| n.contains("; back in rotation after "));
    assert!(
        back.contains(&format!("re-checked after the warden upgraded from {v} to {v}: answers as recorded")),
        "{back}"
    );

    // Supervised as before.
    nix::sys::signal::kill(nix::unistd::Pid::from_raw(leader.pid), nix::sys::signal::Signal::SIGKILL).unwrap();
    w.wait_note("restart", |n| n.starts_with("STATUS=restarting in"));
    w.wait_ready();
    assert_eq!(w.stop(), 0);
}

/// A simulated vLLM whose first run fails (NCCL), then serves.
fn failing_once(d: &std::path::Path, p: u16) -> String {
    let count = d.join("runs");
    let args = ["--shards", "1", "--fail", "nccl", "--fail-times", "1", "--count-file", count.to_str().unwrap()];
    config(d, p, &args, "", FAST)
}

/// The status document as it is now.
fn doc(w: &Warden) -> serde_json::Value {
    serde_json::from_str(&std::fs::read_to_string(w.path("status.json")).unwrap()).unwrap()
}

/// What the status document and the metrics say of the past is the same
/// after an upgrade in place as before it: the last exit, the last failed
/// run and when it was counted, the last load, since when the run is
/// ready, the restarts by why; only the warden's own fields change.
#[test]
fn an_upgrade_in_place_keeps_the_status_history() {
    let bin = tempfile::tempdir().unwrap();
    let path = bin.path().join("vllm-warden");
    std::fs::copy(common::exe(), &path).unwrap();
    let opts = common::Opts { exe: Some(path.clone()), ..Default::default() };
    let mut w = Warden::start_with(failing_once, opts);
    w.wait_ready();
    let metric = |w: &Warden, name: &str| -> String {
        let text = std::fs::read_to_string(w.path("vllm_warden.prom")).unwrap();
        let mut lines: Vec<_> = text.lines().filter(|l| l.starts_with(name)).collect();
        lines.sort();
        lines.join("\n")
    };
    let before = doc(&w);
    let failed_at = metric(&w, "vllm_warden_last_failure_timestamp_seconds");
    let restarts = metric(&w, "vllm_warden_restarts_total");
    assert!(before["last_exit"].is_object() && before["last_load"].is_object(), "{before:#}");
    assert!(before["last_failure"].is_object() && before["ready_since"].is_string(), "{before:#}");
    assert!(!failed_at.is_empty() && restarts.contains("reason=\"failure\"} 1"), "{failed_at}\n{restarts}");
    // Past a second: a time taken anew would show.
    std::thread::sleep(std::time::Duration::from_millis(1100));
    w.ask_upgrade(&path);
    w.wait_note("the upgrade", |n| n.starts_with("STATUS=upgraded from"));
    w.wait_note("back in rotation", |n| n.contains("; back in rotation after "));
    w.wait_for_file("status.json", |w| doc(w)["state"] == "ready" && doc(w)["golden"]["verdict"] == "same");
    let after = doc(&w);
    for field in ["last_exit", "last_failure", "last_load", "ready_since", "restarts", "child_pid"] {
        assert_eq!(after[field], before[field], "{field} after the upgrade:\n{after:#}\nbefore:\n{before:#}");
    }
    assert_eq!(metric(&w, "vllm_warden_last_failure_timestamp_seconds"), failed_at);
    assert_eq!(metric(&w, "vllm_warden_restarts_total"), restarts);
    assert_eq!(w.stop(), 0);
}

/// A new warden of the instance (systemd started it again) goes on from
/// the past its predecessor kept in the state directory: the last failed
/// run and when it was counted, and the last exit, until it has its own.
#[test]
fn a_new_warden_of_the_instance_goes_on_from_the_history_in_its_state_directory() {
    let mut w = Warden::start(failing_once);
    w.wait_ready();
    let failed_at = |w: &Warden| {
        let text = std::fs::read_to_string(w.path("vllm_warden.prom")).unwrap();
        text.lines().find(|l| l.starts_with("vllm_warden_last_failure_timestamp_seconds")).map(String::from)
    };
    let before = doc(&w);
    let at = failed_at(&w).expect("a failure was counted");
    assert_eq!(w.stop(), 0);
    let stopped = doc(&w);
    assert!(stopped["last_exit"].is_object(), "{stopped:#}");
    assert!(w.path("state/history.json").is_file(), "kept in the state directory");
    std::fs::remove_file(w.path("status.json")).unwrap();
    w.spawn();
    w.wait_ready();
    let after = doc(&w);
    assert_eq!(after["last_failure"], before["last_failure"], "{after:#}");
    assert_eq!(after["last_exit"], stopped["last_exit"], "{after:#}");
    assert_eq!(failed_at(&w).as_deref(), Some(at.as_str()));
    assert_eq!(after["restarts"], 0, "the new warden's own count");
    assert_eq!(w.stop(), 0);
}

/// An upgrade in place while the child logs a request line every
/// millisecond: the lines written before, during (while no warden reads the
/// pipe, across the exec) and after it are all in the log, in order, once
/// each and whole.
#[test]
fn an_upgrade_in_place_loses_no_line_of_a_logging_child() {
    let bin = tempfile::tempdir().unwrap();
    let path = bin.path().join("vllm-warden");
    std::fs::copy(common::exe(), &path).unwrap();
    let opts = common::Opts { exe: Some(path.clone()), ..Default::default() };
    let mut w = Warden::start_with(
        |d, p| {
            let logging = d.join("logging");
            std::fs::write(&logging, "").unwrap();
            let logging = logging.to_str().unwrap();
            config(d, p, &["--shards", "1", "--log-while", logging, "--log-every", "1ms"], "", FAST)
        },
        opts,
    );
    w.wait_ready();
    let lines = |w: &Warden| w.log().matches("Received request cmpl-").count();
    w.wait_for_file("t.log", |w| lines(w) >= 100);
    w.ask_upgrade(&path);
    w.wait_note("the upgrade", |n| n.starts_with("STATUS=upgraded from"));
    // Lines the new warden moved: at least as many again as at the upgrade.
    let at_upgrade = lines(&w);
    w.wait_for_file("t.log", |w| lines(w) >= at_upgrade + 200);
    std::fs::remove_file(w.path("logging")).unwrap();
    assert_eq!(w.stop(), 0);

    let log = w.log();
    let mut seen = Vec::new();
    for line in log.lines().filter(|l| l.contains("Received request")) {
        // `… Received request cmpl-000000000000002a-0: params: …`, whole.
        let n = line
            .split_once("Received request cmpl-")
            .and_then(|(_, r)| r.get(..16))
            .and_then(|n| u64::from_str_radix(n, 16).ok())
            .filter(|_| line.ends_with("max_tokens=16)") && line.starts_with("(APIServer pid="));
        match n {
            Some(n) => seen.push(n),
            None => panic!("a torn line: {line:?}"),
        }
    }
    println!("{} lines, {at_upgrade} of them before the upgrade was done", seen.len());
    assert!(seen.len() >= at_upgrade + 200);
    let expected: Vec<u64> = (0..seen.len() as u64).collect();
    assert!(seen == expected, "lines lost, twice or out of order across the upgrade");
}

/// A warden run from a copy of the binary in a folder of its own (which a
/// test may replace), on the simulator with `fake_args`.
fn warden_from_a_copy(fake_args: &'static [&'static str]) -> (tempfile::TempDir, std::path::PathBuf, Warden) {
    let bin = tempfile::tempdir().unwrap();
    let path = bin.path().join("vllm-warden");
    std::fs::copy(common::exe(), &path).unwrap();
    let opts = common::Opts { exe: Some(path.clone()), ..Default::default() };
    let w = Warden::start_with(move |d, p| config(d, p, fake_args, "", FAST), opts);
    (bin, path, w)
}

/// A binary at the warden's path that does not answer `--version` as a
/// vllm-warden is refused: the warden goes on with its child, and says why.
#[test]
fn an_upgrade_to_a_binary_that_is_not_a_warden_is_refused() {
    use std::os::unix::fs::PermissionsExt;
    let (bin, path, mut w) = warden_from_a_copy(&["--shards", "1"]);
    w.wait_ready();
    let leader = w.descendants().into_iter().find(|p| p.ppid == w.pid as i32).unwrap();
    let keep = bin.path().join("real");
    std::fs::copy(common::exe(), &keep).unwrap();
    let script = bin.path().join("script");
    std::fs::write(&script, "#!/bin/sh\necho 'not a warden'\n").unwrap();
    std::fs::set_permissions(&script, std::fs::Permissions::from_mode(0o755)).unwrap();
    std::fs::rename(&script, &path).unwrap();
    w.ask_upgrade(&keep);
    let note = w.wait_note("the refusal", |n| n.starts_with("STATUS=upgrade refused"));
    assert!(note.contains("--version did not name a vllm-warden version"), "{note}");
    let now = vllm_warden::process::child::read_stat(leader.pid).unwrap();
    assert_eq!((now.ppid, now.start_time), (w.pid as i32, leader.start_time));
    assert!(std::fs::read_link(format!("/proc/{}/exe", w.pid)).unwrap().ends_with("vllm-warden (deleted)"));
    assert_eq!(w.stop(), 0);
}

/// Asked while the model loads, the upgrade waits for READY=1, then
/// happens.
#[test]
fn an_upgrade_asked_while_loading_waits_until_ready() {
    let (_bin, path, mut w) = warden_from_a_copy(&["--shards", "6", "--shard-time", "300ms"]);
    w.wait_note("loading", |n| n.starts_with("STATUS=loading"));
    w.ask_upgrade(&path);
    w.wait_ready();
    w.wait_note("the upgrade", |n| n.starts_with("STATUS=upgraded from"));
    assert_eq!(w.stop(), 0);
}

/// Issue 34: a successor that refuses the upgrade's state must not meet
/// its own inherited lock (it used to exit 69, "already supervised by pid
/// <its own pid>", leaving the child to run on under pid 1). The binary at
/// the warden's path is a script that answers `--version` as the warden,
/// then does `tamper` to the state file (`$S`) and runs the warden: for
/// each way, the warden (same pid) says why it refuses, stops the child it
/// could not take over, starts the model again and is ready; nothing is
/// orphaned, and a stop ends in 0.
fn a_refused_upgrade_starts_again(how: &str, tamper: &str) -> String {
    use std::os::unix::fs::PermissionsExt;
    let (bin, path, mut w) = warden_from_a_copy(&["--shards", "1"]);
    w.wait_ready();
    let leader = w.descendants().into_iter().find(|p| p.ppid == w.pid as i32).unwrap();
    let real = bin.path().join("real");
    std::fs::copy(common::exe(), &real).unwrap();
    let tamper = tamper.replace("LEADER", &leader.pid.to_string());
    let script = format!(
        "#!/bin/sh\nif [ \"$1\" = --version ]; then exec {real} --version; fi\nS=\"$VLLM_WARDEN_UPGRADE_STATE\"\n{tamper}\nexec {real} \"$@\"\n",
        real = real.display()
    );
    let new = bin.path().join("script");
    std::fs::write(&new, script).unwrap();
    std::fs::set_permissions(&new, std::fs::Permissions::from_mode(0o755)).unwrap();
    std::fs::rename(&new, &path).unwrap();
    w.ask_upgrade(&real);

    w.wait_ready_within(common::TIMEOUT, &format!("READY=1 of the start after a refused upgrade ({how})"));
    w.wait_logged("the upgrade's state is unusable (");
    let log = w.stderr();
    assert!(log.contains("the upgrade's state is unusable ("), "{how}: {log}");
    assert!(!log.contains("already supervised"), "{how}: {log}");
    assert!(gone(&leader), "{how}: the old child was stopped, not orphaned");
    let now = w.descendants().into_iter().find(|p| p.ppid == w.pid as i32).unwrap();
    assert_ne!(now.pid, leader.pid, "{how}: a new child");
    assert_eq!(
        std::fs::read_link(format!("/proc/{}/exe", w.pid)).unwrap(),
        real,
        "{how}: the same warden pid runs the new binary"
    );
    assert_eq!(w.stop(), 0, "{how}");
    log
}

#[test]
fn a_refused_upgrade_state_file_missing_empty_truncated_or_garbage_starts_again() {
    for (how, tamper) in [
        ("missing", "rm -f \"$S\""),
        ("empty", ": > \"$S\""),
        ("truncated", "head -c 40 \"$S\" > \"$S.cut\" && mv \"$S.cut\" \"$S\""),
        ("garbage", "printf 'not json\\n' > \"$S\""),
    ] {
        a_refused_upgrade_starts_again(how, tamper);
    }
}

#[test]
fn a_refused_upgrade_state_file_fifo_symlink_or_huge_starts_again() {
    for (how, tamper) in [
        ("a FIFO", "rm -f \"$S\" && mkfifo \"$S\""),
        ("a symlink", "rm -f \"$S\" && ln -s /etc/hostname \"$S\""),
        ("1 GiB", "truncate -s 1G \"$S\""),
    ] {
        a_refused_upgrade_starts_again(how, tamper);
    }
}

#[test]
fn a_refused_upgrade_state_with_a_wrong_field_starts_again() {
    for (how, tamper) in [
        ("wrong format", "sed -i 's/\"format\": 2,/\"format\": 3,/' \"$S\""),
        ("wrong instance", "sed -i 's/\"instance\": \"t\"/\"instance\": \"u\"/' \"$S\""),
        ("wrong pid", "sed -i 's/\"pid\": [0-9]*/\"pid\": 1/' \"$S\""),
        ("wrong start time", "sed -i 's/\"child_start_time\": [0-9]*/\"child_start_time\": 1/' \"$S\""),
        ("wrong lock fd", "sed -i 's/\"lock_fd\": [0-9]*/\"lock_fd\": 0/' \"$S\""),
        // The warden's own stderr: a pipe too, but not the child's.
        ("wrong pipe fd", "sed -i 's/\"pipe_fd\": [0-9]*/\"pipe_fd\": 2/' \"$S\""),
        // The pipe named as the log file.
        (
            "wrong log fd",
            "P=$(sed -n 's/.*\"pipe_fd\": \\([0-9]*\\).*/\\1/p' \"$S\") && sed -i \"s/\\\"log_fd\\\": [0-9]*/\\\"log_fd\\\": $P/\" \"$S\"",
        ),
        ("another log inode", "sed -i 's/\"log_ino\": [0-9]*/\"log_ino\": 1/' \"$S\""),
        // No record of the tree either: the child is found as the warden's own.
        ("no state and no tree record", "rm -f \"$S\" \"$STATE_DIRECTORY/tree.json\""),
    ] {
        a_refused_upgrade_starts_again(how, tamper);
    }
}

/// A run token of the right shape that the child does not carry: taken
/// over, it would be written into the tree's record, and after a crash
/// the next warden would not know the child (which keeps the port) as a
/// leftover. Refused, saying so.
#[test]
fn a_refused_upgrade_state_with_a_forged_run_token_starts_again() {
    let forge = "sed -i 's/\"token\": \"[0-9a-f]*\"/\"token\": \"0123456789abcdef0123456789abcdef\"/' \"$S\"";
    let log = a_refused_upgrade_starts_again("forged token", forge);
    assert!(log.contains("does not carry the state's run token in its environment"), "{log}");
}

/// With no tampering: the child dies between the SIGUSR2 and the
/// successor's look at it.
#[test]
fn a_child_that_dies_during_the_upgrade_is_started_again() {
    a_refused_upgrade_starts_again("the child died", "kill -9 LEADER");
}

/// The `failed` events of runs killed while serving, in the JSON log: each
/// carries the pid that ran and the attempt that failed (not the next
/// attempt's number, nor `CHILD_PID=0` for a leader already gone), with
/// failure reports and without.
#[test]
fn a_run_killed_while_serving_logs_its_failure_with_its_pid_and_attempt() {
    for reports in ["", "[reports]\nkeep = 0\n"] {
        let opts = Opts { run_args: vec!["--log-format".into(), "json".into()], ..Opts::default() };
        let extra = format!("{FAST}{reports}");
        let mut w = Warden::start_with(move |d, p| config(d, p, &["--shards", "1"], "", &extra), opts);
        let mut killed = Vec::new();
        for attempt in 1..=2 {
            w.wait_ready();
            let leader = w.descendants().into_iter().find(|p| p.ppid == w.pid as i32).unwrap();
            nix::sys::signal::kill(nix::unistd::Pid::from_raw(leader.pid), Signal::SIGKILL).unwrap();
            w.wait_note("restart", |n| n.starts_with("STATUS=restarting in"));
            killed.push((leader.pid as u64, attempt));
        }
        w.wait_ready();
        assert_eq!(w.stop(), 0);
        let failed: Vec<(u64, u64)> = w
            .stderr()
            .lines()
            .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
            .filter(|v| v["fields"]["EVENT"] == "failed")
            .map(|v| (v["fields"]["CHILD_PID"].as_u64().unwrap(), v["fields"]["ATTEMPT"].as_u64().unwrap()))
            .collect();
        assert_eq!(failed, killed, "reports {reports:?}: {}", w.stderr());
    }
}
