//! Failure reports with the real binary and the fake vLLM: a wedged engine
//! caught by its metrics leaves a report with every part, secrets masked in
//! each; `vllm-warden reports` lists and shows it; a stop while a report
//! is written is answered at once; a command past the budget is killed.

mod common;

use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};

use common::{Warden, config};
use nix::sys::signal::Signal;

const FAST: &str = "[restart]\ninitial-delay = \"0s\"\n";
const SECRETS: [&str; 3] = ["sk-sim-secret", "hf_gpu_secret", "sk-kernel-secret"];

/// `[health]` that catches the wedge in a second, and `[reports]` whose GPU
/// snapshot and kernel messages are small commands that print secrets.
fn sections() -> String {
    let health = "[health]\ninterval = \"100ms\"\nprogress-stall = \"1s\"\ncanary-interval = \"0s\"\n";
    // It says whether the warden's RUST_LOG and NOTIFY_SOCKET reached it.
    let gpu = r#"["sh", "-c", "echo 'Product Name : Fake GPU'; echo HF_TOKEN=hf_gpu_secret; echo log=${RUST_LOG-none} notify=${NOTIFY_SOCKET-none}"]"#;
    let kernel = r#"["sh", "-c", "echo \"kernel: NVRM: Xid (PCI:0000:41:00): 13, since $1, --api-key sk-kernel-secret\"; echo 'kernel: usb 1-1: new device'", "sh", "{since}"]"#;
    let reports = format!(
        "[reports]\ngpu-snapshot = {gpu}\nkernel-messages = {kernel}\npy-spy = [\"py-spy-not-installed\", \"dump\", \"--pid\", \"{{pid}}\"]\n"
    );
    format!("{FAST}{health}{reports}")
}

fn reports_cmd(w: &Warden, args: &[&str]) -> (i32, String) {
    let out = w.command("reports").args(args).output().unwrap();
    (out.status.code().unwrap_or(-1), String::from_utf8_lossy(&out.stdout).into_owned())
}

/// Every file under `dir`, with its text.
fn files(dir: &Path) -> Vec<(PathBuf, String)> {
    let mut out = Vec::new();
    for e in std::fs::read_dir(dir).unwrap().flatten() {
        let p = e.path();
        if p.is_dir() {
            out.extend(files(&p));
        } else {
            out.push((p.clone(), std::fs::read_to_string(&p).unwrap()));
        }
    }
    out
}

fn wedge(w: &Warden) {
    let leader = w.descendants().iter().find(|p| p.ppid == w.pid as i32).unwrap().pid;
    let url = format!("http://127.0.0.1:{}/v1/completions", w.port);
    std::thread::spawn(move || {
        let body = serde_json::json!({"model": "tiny-llama", "prompt": "Hi", "max_tokens": 100000});
        let _ = common::http::post_json(&url, &body, common::http::FOREVER);
    });
    nix::sys::signal::kill(nix::unistd::Pid::from_raw(leader), Signal::SIGUSR2).unwrap();
}

/// Issue "eyes after ready", part 2: the report of a wedged engine, written
/// before the stop, with every part and no secret in any.
#[test]
fn a_wedged_engine_leaves_a_failure_report_with_every_part_and_no_secret() {
    let mut w = Warden::start(|d, p| {
        let args = ["--shards", "1", "--wedge-on-usr2", "--api-key", "sk-sim-secret", "--python-engine", "python3"];
        config(d, p, &args, "", &sections())
    });
    w.wait_ready();
    let tree = w.descendants();
    let leader = tree.iter().find(|p| p.ppid == w.pid as i32).unwrap().pid;
    let python = tree.iter().find(|p| p.ppid == leader).expect("the Python engine").pid;
    wedge(&w);
    let failed = w.wait_note("the stall", |n| n.starts_with("STATUS=failed"));
    assert_eq!(
        failed,
        "STATUS=failed (attempt 1/10, writing the failure report): engine stalled: 1 running, 0 waiting, no token for 1s"
    );
    // The stop comes once the report is written.
    let stopping =
        w.wait_note("the stop after the report", |n| n.starts_with("STATUS=failed (attempt 1/10, stopping pid"));
    assert!(
        stopping.starts_with(&format!("STATUS=failed (attempt 1/10, stopping pid {leader}): engine stalled")),
        "{stopping}"
    );
    w.wait_ready();

    let root = w.path("state").join("reports");
    let names: Vec<String> =
        std::fs::read_dir(&root).unwrap().flatten().map(|e| e.file_name().to_string_lossy().into_owned()).collect();
    assert_eq!(names.len(), 1, "{names:?}");
    let dir = root.join(&names[0]);
    assert!(names[0].ends_with("Z-t-1"), "{names:?}");

    let summary: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("summary.json")).unwrap()).unwrap();
    assert_eq!(summary["cause"], "engine stalled: 1 running, 0 waiting, no token for 1s");
    assert_eq!(summary["class"], "health");
    assert_eq!(summary["attempt"], 1);
    assert_eq!(summary["pid"], leader, "the pid that ran");
    assert_eq!(summary["exit"], serde_json::Value::Null, "it was running when it failed");
    assert_eq!(summary["vllm_version"], "0.32.0");
    assert_eq!(summary["complete"], true);
    let text = std::fs::read_to_string(w.path("t.toml")).unwrap();
    assert_eq!(summary["config_sha256"], vllm_warden::tell::reports::sha256_hex(text.as_bytes()));
    let t = &summary["timings"];
    for k in ["spawn", "first_progress", "ready", "failure", "report_begun", "report_done"] {
        assert!(t[k].as_str().is_some_and(|s| s.starts_with("20") && s.ends_with('Z')), "{k}: {summary}");
    }
    assert!(t["spawn"].as_str() < t["ready"].as_str() && t["ready"].as_str() < t["failure"].as_str());
    assert_eq!(summary["parts"]["py-spy"], "py-spy-not-installed not found on PATH", "{summary}");

    let tree = std::fs::read_to_string(dir.join("tree.txt")).unwrap();
    let row = tree.lines().find(|l| l.starts_with(&leader.to_string())).unwrap_or_else(|| panic!("{tree}"));
    assert!(row.contains("vllm-warden-sim --port") && row.contains("--api-key ***"), "{row}");
    let row = tree.lines().find(|l| l.starts_with(&python.to_string())).unwrap_or_else(|| panic!("{tree}"));
    assert!(row.contains(&format!(" {leader} ")) && row.contains("python3 -c"), "{row}");
    let tail = std::fs::read_to_string(dir.join("log-tail.txt")).unwrap();
    assert!(tail.contains("version 0.32.0") && tail.contains("Application startup complete"), "{tail}");
    assert!(tail.contains("'api_key': '***'"), "{tail}");
    let gpu = std::fs::read_to_string(dir.join("gpu.txt")).unwrap();
    assert_eq!(gpu, "Product Name : Fake GPU\nHF_TOKEN=***\nlog=none notify=none\n");
    let kernel = std::fs::read_to_string(dir.join("kernel.txt")).unwrap();
    let since = summary["timings"]["spawn"].as_str().map(|s| humantime::parse_rfc3339(s).unwrap()).unwrap();
    let since = since.duration_since(std::time::UNIX_EPOCH).unwrap().as_secs();
    assert_eq!(
        kernel,
        format!(
            "# kernel messages since the run's spawn that concern the GPUs: 1 of 2\nkernel: NVRM: Xid (PCI:0000:41:00): 13, since {since}, --api-key ***\n"
        )
    );
    assert!(!dir.join("py-spy").exists(), "no py-spy folder without py-spy");
    for (path, text) in files(&dir) {
        for s in SECRETS {
            assert!(!text.contains(s), "{} holds {s}", path.display());
        }
    }

    // The journal event and the status document name the report.
    let stderr = w.stderr();
    let event = stderr.lines().find(|l| l.contains("run failed: engine stalled")).unwrap();
    assert!(
        event.contains(&format!("REPORT=\"{}\"", dir.display()))
            || event.contains(&format!("REPORT={}", dir.display())),
        "{event}"
    );
    let doc: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(w.path("status.json")).unwrap()).unwrap();
    assert_eq!(doc["last_failure"]["report"], dir.display().to_string(), "{doc}");
    assert_eq!(doc["last_failure"]["class"], "health");
    let status = w.command("status").output().unwrap();
    let status = String::from_utf8_lossy(&status.stdout);
    assert!(status.contains(&format!("\nreport: {}", dir.display())), "{status}");

    // `vllm-warden reports`.
    let (code, list) = reports_cmd(&w, &[]);
    assert_eq!(code, 0, "{list}");
    let time = names[0].split('-').next().unwrap();
    let line = list.lines().nth(1).unwrap();
    assert!(
        line.starts_with(time)
            && line.contains(" health ")
            && line.ends_with("engine stalled: 1 running, 0 waiting, no token for 1s"),
        "{list}"
    );
    assert_eq!(reports_cmd(&w, &["path"]), (0, format!("{}\n", dir.display())));
    assert_eq!(reports_cmd(&w, &["path", time]), (0, format!("{}\n", dir.display())));
    let (code, show) = reports_cmd(&w, &["show"]);
    assert_eq!(code, 0);
    assert!(show.contains("cause: engine stalled: 1 running, 0 waiting, no token for 1s\nclass: health\n"), "{show}");
    assert!(show.contains("vLLM 0.32.0") && show.contains("  tree.txt: written: "), "{show}");
    assert_eq!(reports_cmd(&w, &["show", "1999"]).0, 1, "no such report");
    assert_eq!(w.stop(), 0);
}

/// A stop while the report is written is answered at once: its command is
/// gone and the warden exits long before the report's 20 s budget.
#[test]
fn a_stop_during_the_report_is_answered_at_once_and_leaves_no_command() {
    let fifos = tempfile::tempdir().unwrap();
    let fifo = fifos.path().join("started");
    nix::unistd::mkfifo(&fifo, nix::sys::stat::Mode::from_bits_truncate(0o600)).unwrap();
    // The snapshot command says its pid into the FIFO, then hangs.
    let gpu = format!(r#"["sh", "-c", "echo $$ > \"$0\"; exec sleep 29.5", "{}"]"#, fifo.display());
    let mut w = Warden::start(|d, p| {
        let health = "[health]\ninterval = \"100ms\"\nfailures = 1\ncanary-interval = \"0s\"\n";
        let reports = format!("[reports]\ntimeout = \"20s\"\ngpu-snapshot = {gpu}\nkernel-messages = []\nlines = 10\n");
        config(d, p, &["--shards", "1", "--unhealthy-after", "300ms"], "", &format!("{FAST}{health}{reports}"))
    });
    let (tx, rx) = std::sync::mpsc::channel();
    let reader = fifo.clone();
    std::thread::spawn(move || {
        // Opening blocks until the command opens it to write.
        let _ = tx.send(std::fs::read_to_string(reader));
    });
    w.wait_ready();
    w.wait_note("the failure", |n| n.starts_with("STATUS=failed (attempt 1/10, writing the failure report): "));
    let pid: i32 = rx.recv_timeout(common::TIMEOUT).expect("the report's command ran").unwrap().trim().parse().unwrap();
    let command = vllm_warden::process::child::read_stat(pid).unwrap();
    let t0 = std::time::Instant::now();
    assert_eq!(w.stop_within(std::time::Duration::from_secs(15), "the exit after a stop during the report"), 0);
    let took = t0.elapsed();
    assert!(common::gone(&command), "the snapshot command is killed");
    assert!(!w.statuses().iter().any(|s| s.starts_with("restarting")), "{:?}", w.statuses());
    let root = w.path("state").join("reports");
    let dir = std::fs::read_dir(&root).unwrap().flatten().next().unwrap().path();
    let summary: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("summary.json")).unwrap()).unwrap();
    assert_eq!(summary["complete"], false, "cut short: {summary}");
    assert!(dir.join("tree.txt").exists() && dir.join("log-tail.txt").exists());
    assert!(!dir.join("gpu.txt").exists());
    eprintln!("stop during the report: exit after {took:?}");
}

/// A command that does not answer within the report's budget is killed
/// with its group at once, even one that ignores SIGTERM: it neither holds
/// the stop nor outlives the report.
#[test]
fn a_command_past_the_report_budget_is_killed_and_the_run_restarted() {
    let fifos = tempfile::tempdir().unwrap();
    let fifo = fifos.path().join("started");
    nix::unistd::mkfifo(&fifo, nix::sys::stat::Mode::from_bits_truncate(0o600)).unwrap();
    let gpu = format!(r#"["sh", "-c", "trap '' TERM; echo $$ > \"$0\"; exec sleep 29.5", "{}"]"#, fifo.display());
    let mut w = Warden::start(|d, p| {
        let health = "[health]\ninterval = \"100ms\"\nfailures = 1\ncanary-interval = \"0s\"\n";
        let reports = format!("[reports]\ntimeout = \"1s\"\ngpu-snapshot = {gpu}\nkernel-messages = []\n");
        let args = ["--shards", "1", "--unhealthy-after", "500ms"];
        config(d, p, &args, "", &format!("{FAST}{health}{reports}"))
    });
    let (tx, rx) = std::sync::mpsc::channel();
    let reader = fifo.clone();
    std::thread::spawn(move || {
        let _ = tx.send(std::fs::read_to_string(reader));
    });
    w.wait_ready();
    let pid: i32 = rx.recv_timeout(common::TIMEOUT).expect("the report's command ran").unwrap().trim().parse().unwrap();
    let command = vllm_warden::process::child::read_stat(pid).unwrap();
    w.wait_note("the stop after the report", |n| n.starts_with("STATUS=failed (attempt 1/10, stopping pid"));
    // Left to the stop, it would hold the tree until the SIGKILL 10 s later.
    w.wait_ready_within(std::time::Duration::from_secs(8), "the restart's READY=1");
    assert!(common::gone(&command), "the command is killed");
    // The first run's report (the next run fails the same way later).
    let mut dirs: Vec<_> =
        std::fs::read_dir(w.path("state").join("reports")).unwrap().flatten().map(|e| e.path()).collect();
    dirs.sort();
    let dir = &dirs[0];
    let gpu = std::fs::read_to_string(dir.join("gpu.txt")).unwrap();
    assert!(
        gpu.starts_with("sh -c ") && gpu.contains(" did not answer within ") && gpu.ends_with(" (killed)\n"),
        "{gpu}"
    );
    let summary: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("summary.json")).unwrap()).unwrap();
    assert_eq!(summary["complete"], true, "{summary}");
    assert_eq!(w.stop(), 0);
}

/// Retention with the real binary: five failed runs, `keep = 2`: the two
/// newest reports are left, with their attempts, and nothing else in the
/// folder but what was there before (a file not ours).
#[test]
fn only_the_newest_reports_are_kept() {
    let mut w = Warden::start(|d, p| {
        let extra = "[restart]\ninitial-delay = \"0s\"\nmax-attempts = 5\n\
                     [reports]\nkeep = 2\ngpu-snapshot = []\nkernel-messages = []\n";
        config(d, p, &["--shards", "1", "--fail", "exit1"], "", extra)
    });
    std::fs::create_dir_all(w.path("state").join("reports")).unwrap();
    std::fs::write(w.path("state").join("reports").join("README"), "not a report").unwrap();
    assert_eq!(w.wait_exit(), 75);
    let mut names: Vec<String> = std::fs::read_dir(w.path("state").join("reports"))
        .unwrap()
        .flatten()
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .collect();
    names.sort();
    assert_eq!(names.len(), 3, "{names:?}");
    assert_eq!(names[2], "README");
    assert!(names[0].ends_with("-t-4") && names[1].ends_with("-t-5"), "{names:?}");
    let (code, list) = reports_cmd(&w, &[]);
    assert_eq!(code, 0);
    assert_eq!(list.lines().count(), 3, "a header and two reports: {list}");
}

/// A server that exits and leaves nothing behind is reported beside the
/// next start, which does not wait for the report; yet each report
/// describes its run as it ended: a tree with nothing of the next run in
/// it, the log up to the run's end, and the kernel's messages about the
/// GPUs that the warden's follower read from the spawn on (no command).
#[test]
fn an_exited_run_is_reported_beside_the_next_start() {
    // In place of `journalctl -k -f`: a GPU message and another, again and
    // again, as the kernel's records (`/dev/kmsg`).
    let follower = r#"["sh", "-c", "while :; do echo '4,1,2000001,-;NVRM: Xid (PCI:0000:41:00): 13, pid=1, name=x'; echo '6,2,2000002,-;usb 1-1: new device'; sleep 0.02; done"]"#;
    let mut w = Warden::start(|d, p| {
        let extra = format!(
            "[restart]\ninitial-delay = \"0s\"\nmax-attempts = 3\n[health]\nkernel-messages = {follower}\n\
             [reports]\ngpu-snapshot = []\n"
        );
        config(d, p, &["--shards", "1", "--shard-time", "200ms", "--fail", "exit1"], "", &extra)
    });
    assert_eq!(w.wait_exit(), 75);
    let mut dirs: Vec<_> =
        std::fs::read_dir(w.path("state").join("reports")).unwrap().flatten().map(|e| e.path()).collect();
    dirs.sort();
    assert_eq!(dirs.len(), 3, "{dirs:?}");
    for (i, dir) in dirs.iter().enumerate() {
        let summary: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(dir.join("summary.json")).unwrap()).unwrap();
        assert_eq!(summary["complete"], true, "{summary}");
        assert_eq!(summary["exit"], "exit code 1", "{summary}");
        let tree = std::fs::read_to_string(dir.join("tree.txt")).unwrap();
        assert!(tree.starts_with("# the server's process tree when the run failed: 0 process(es)\n"), "{tree}");
        let tail = std::fs::read_to_string(dir.join("log-tail.txt")).unwrap();
        assert!(tail.contains("Loading weights took"), "{tail}");
        assert!(!tail.contains(&format!("--- vllm-warden: start {}", i + 2)), "the next run's lines: {tail}");
    }
    // The first run was spawned before the follower: its report runs the
    // command; the later ones take what the follower read.
    for dir in &dirs[1..] {
        let kernel = std::fs::read_to_string(dir.join("kernel.txt")).unwrap();
        let (head, lines) = kernel.split_once('\n').unwrap();
        let counts = head.strip_prefix("# kernel messages since the run's spawn that concern the GPUs: ").unwrap();
        let (n, all) = counts.split_once(" of ").unwrap();
        let (n, all): (usize, usize) = (n.parse().unwrap(), all.parse().unwrap());
        assert!(n >= 2 && all >= 2 * n - 1, "{kernel}");
        assert_eq!(lines.lines().count(), n, "{kernel}");
        assert!(lines.lines().all(|l| l == "[    2.000001] NVRM: Xid (PCI:0000:41:00): 13, pid=1, name=x"), "{kernel}");
    }
}

/// The next start waits for the GPU snapshot of a run that exited (taken
/// before a new child can use the GPUs), not for the rest of its report:
/// here a kernel-message command that takes a second.
#[test]
fn the_next_start_waits_for_the_gpu_snapshot_of_an_exited_run_only() {
    let mut w = Warden::start(|d, p| {
        let extra = "[restart]\ninitial-delay = \"0s\"\nmax-attempts = 2\n[health]\nkernel-messages = []\n\
                     [reports]\ngpu-snapshot = [\"sh\", \"-c\", \"sleep 0.3; echo gpu\"]\n\
                     kernel-messages = [\"sh\", \"-c\", \"sleep 1; echo kernel\"]\n";
        config(d, p, &["--shards", "1", "--fail", "exit1"], "", extra)
    });
    assert_eq!(w.wait_exit(), 75);
    let mut dirs: Vec<_> =
        std::fs::read_dir(w.path("state").join("reports")).unwrap().flatten().map(|e| e.path()).collect();
    dirs.sort();
    assert_eq!(dirs.len(), 2, "{dirs:?}");
    let timings: Vec<serde_json::Value> = dirs
        .iter()
        .map(|d| serde_json::from_str::<serde_json::Value>(&std::fs::read_to_string(d.join("summary.json")).unwrap()))
        .map(|s| s.unwrap()["timings"].clone())
        .collect();
    let at = |t: &serde_json::Value, k: &str| humantime::parse_rfc3339(t[k].as_str().unwrap()).unwrap();
    let (failed, done, next) = (at(&timings[0], "failure"), at(&timings[0], "report_done"), at(&timings[1], "spawn"));
    assert!(next >= failed + std::time::Duration::from_millis(300), "{timings:?}");
    assert!(next < done, "{timings:?}");
    assert_eq!(std::fs::read_to_string(dirs[0].join("gpu.txt")).unwrap(), "gpu\n");
}

/// A start redone while it waits for the last run's report (a reload that
/// changes the child's environment) waits for it again: the report's GPU
/// snapshot is taken before any new child runs.
#[test]
fn a_start_redone_while_it_waits_for_the_report_still_waits_for_it() {
    let fifos = tempfile::tempdir().unwrap();
    let go = fifos.path().join("go");
    nix::unistd::mkfifo(&go, nix::sys::stat::Mode::from_bits_truncate(0o600)).unwrap();
    // The snapshot answers once the test lets it.
    let gpu = format!(r#"["sh", "-c", "read x < \"$0\"; echo gpu", "{}"]"#, go.display());
    let mut w = Warden::start(|d, p| {
        let extra = format!(
            "[restart]\ninitial-delay = \"0s\"\nmax-attempts = 2\n[health]\nkernel-messages = []\n\
             [reports]\ngpu-snapshot = {gpu}\nkernel-messages = []\n"
        );
        // Only the first run fails: the redone start's child loads.
        let count = d.join("count");
        let args = ["--shards", "1", "--fail", "exit1", "--fail-times", "1", "--count-file", count.to_str().unwrap()];
        config(d, p, &args, "env = { MARKER = \"1\" }", &extra)
    });
    const WAITING: &str = "STATUS=waiting for the failure report of the last run";
    w.wait_note("the start waiting for the report", |n| n == WAITING);
    let cfg = std::fs::read_to_string(w.path("t.toml")).unwrap();
    std::fs::write(w.path("t.toml"), cfg.replace("MARKER = \"1\"", "MARKER = \"2\"")).unwrap();
    w.signal(Signal::SIGHUP);
    let next = w.wait_note("the redone start", |n| n == WAITING || n.starts_with("STATUS=loading"));
    assert_eq!(next, WAITING, "a new child ran before the last run's GPU snapshot: {:?}", w.statuses());
    // Without blocking: the snapshot must be there, reading.
    let mut fifo = std::fs::OpenOptions::new()
        .write(true)
        .custom_flags(libc::O_NONBLOCK)
        .open(&go)
        .expect("the snapshot is still waiting");
    std::io::Write::write_all(&mut fifo, b"go\n").unwrap();
    drop(fifo);
    w.wait_note("the next child", |n| n.starts_with("STATUS=loading"));
    w.wait_ready();
    assert_eq!(w.stop(), 0);
}
