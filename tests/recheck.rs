//! Correct or dark: the golden check with the real binary and the
//! simulated vLLM. No answer before ready is a failed run; a model without
//! completions is ready with the check skipped; while serving, an Xid line
//! written to the real kernel ring buffer (`/dev/kmsg`, followed through
//! the configured `health.kernel-messages` command) takes the model out of
//! rotation and its answers are asked again; `golden.interval` does the
//! same on a timer; an OOM kill the kernel reports for the engine's leader
//! is named. The kernel's own lines that quote a user's text, and lines a
//! program writes to `/dev/kmsg`, do nothing.
//!
//! The simulated engine answers from a file read at each request: written
//! anew while serving, the model "answers garbage" from then on.

mod common;
#[path = "support/nobody.rs"]
mod nobody;

use std::time::{Duration, Instant};

use common::*;

const FAST: &str = "[restart]\ninitial-delay = \"0s\"\n";

/// The kernel line's budget from its write to the model out of rotation.
const OUT_OF_ROTATION: Duration = Duration::from_secs(1);

fn doc(w: &Warden) -> serde_json::Value {
    serde_json::from_str(&std::fs::read_to_string(w.path("status.json")).unwrap()).unwrap()
}

/// A config whose simulated model answers from `weights`, with the golden
/// check (`golden` more keys of it), the endpoint on `listen` and `extra`.
fn recheck_config(d: &std::path::Path, p: u16, listen: u16, sim: &[&str], golden: &str, extra: &str) -> String {
    let weights = d.join("weights");
    std::fs::write(&weights, "the model's weights\n").unwrap();
    let token = d.join("token");
    std::fs::write(&token, "s3cret\n").unwrap();
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(&token, std::fs::Permissions::from_mode(0o600)).unwrap();
    let mut args = vec!["--shards", "1", "--answers-from", weights.to_str().unwrap()];
    args.extend(sim);
    let extra = format!(
        "{FAST}[golden]\nprompts = [\"one\"]\ntimeout = \"3s\"\n{golden}\n[server]\nlisten = \"127.0.0.1:{listen}\"\ntoken-file = \"{}\"\n{extra}",
        token.display()
    );
    config(d, p, &args, "", &extra)
}

fn readyz(listen: u16) -> (u16, String) {
    let a = http::get(&format!("http://127.0.0.1:{listen}/readyz"), Duration::from_secs(10)).unwrap();
    (a.status, a.body)
}

/// A server whose completions hang is not ready: a failed run of class
/// `no_answer` within `golden.timeout`, no `READY=1`, whatever
/// `golden.on-mismatch` says ("warn").
#[test]
fn completions_that_hang_before_ready_are_a_failed_run_within_the_golden_timeout() {
    let listen = free_port();
    let mut w = Warden::start(|d, p| {
        recheck_config(d, p, listen, &["--hang-completions"], "on-mismatch = \"warn\"", "")
            .replace(FAST, "[restart]\ninitial-delay = \"0s\"\nmax-attempts = 1\n")
    });
    let asked = w.wait_note("the golden check", |n| n.contains(": checking the golden answers"));
    let t0 = Instant::now();
    w.wait_note("the failure", |n| n.starts_with("STATUS=failed ("));
    let took = t0.elapsed();
    assert_eq!(w.wait_exit(), 75, "gave up after one failed start");
    w.drain_notes();
    assert!(!w.notes.iter().any(|n| n == "READY=1"), "{:?}", w.notes);
    let d = doc(&w);
    assert_eq!(d["last_failure"]["class"], "no_answer", "{d}");
    let cause = d["last_failure"]["cause"].as_str().unwrap();
    assert_eq!(cause, "golden check: no answer: nothing within 3s (/v1/completions)", "{asked}");
    assert_eq!(d["golden"]["verdict"], "no_answer", "{d}");
    // golden.timeout (3 s) from the check's start (a little before its
    // note came), and the time to say it.
    assert!(took >= Duration::from_millis(2500) && took < Duration::from_secs(5), "{took:?}");
    let prom = std::fs::read_to_string(w.path("vllm_warden.prom")).unwrap();
    assert!(prom.contains("vllm_warden_failures_total{name=\"t\",class=\"no_answer\"} 1"), "{prom}");
    eprintln!("no answer: failed {} ms after the check began", took.as_millis());
}

/// A pooling model (vLLM answers 404 for `/v1/completions`) is ready with
/// "fail", the check skipped and said: `STATUS=`, the status document,
/// `check`.
#[test]
fn a_model_without_completions_is_ready_with_the_check_skipped_and_said() {
    let listen = free_port();
    let mut w = Warden::start(|d, p| recheck_config(d, p, listen, &["--no-completions"], "on-mismatch = \"fail\"", ""));
    w.wait_ready();
    let ready = w.wait_note("ready", |n| n.starts_with("STATUS=ready: pid "));
    assert!(
        ready.ends_with(
            "; golden check skipped: the model has no completions API (a pooling or embedding model): \
             /v1/completions: HTTP 404: {\"detail\":\"Not Found\"}"
        ),
        "{ready}"
    );
    assert_eq!(doc(&w)["golden"]["verdict"], "skipped", "{}", doc(&w));
    assert_eq!(readyz(listen).0, 200);
    let (ok, said) = w.cli(&["check"]);
    assert!(ok, "{said}");
    assert!(said.contains("\ngolden: golden check skipped: the model has no completions API"), "{said}");
    assert_eq!(w.stop(), 0);
}

/// Whether this process may write to the kernel's ring buffer (as root);
/// under CI (`CI` set) it must.
fn kmsg() -> Option<std::fs::File> {
    let skip = |why: String| {
        assert!(std::env::var_os("CI").is_none(), "{why}; CI must run it");
        eprintln!("skipped: {why}");
        None
    };
    if !nix::unistd::geteuid().is_root() {
        return skip("writing to /dev/kmsg needs root".into());
    }
    match std::fs::OpenOptions::new().write(true).open("/dev/kmsg") {
        Ok(f) => Some(f),
        Err(e) => skip(format!("/dev/kmsg cannot be written: {e}")),
    }
}

/// A tag of this test's kernel lines: the warden follows only those
/// (other tests write theirs meanwhile).
fn tag() -> String {
    format!("vllm-warden-test-{}-{}", std::process::id(), free_port())
}

/// `health.kernel-messages`: the real ring buffer's records as the kernel
/// writes them (`PRI,SEQ,USEC,FLAGS;MESSAGE`), this test's only. What a
/// program writes to `/dev/kmsg` is stored with the facility `user`
/// (never the kernel's, 0), and the warden reads only the kernel's: this
/// source stands in for the NVIDIA driver by giving this test's lines the
/// kernel's facility.
fn kernel_source(tag: &str) -> String {
    format!(
        "[health]\nkernel-messages = [\"sh\", \"-c\", \"cat /dev/kmsg | grep --line-buffered -F {tag} | sed -u 's/^[0-9]*,/4,/'\"]\n"
    )
}

/// Write `line` to the kernel's ring buffer.
fn printk(f: &mut std::fs::File, line: &str) {
    use std::io::Write;
    f.write_all(format!("<4>{line}\n").as_bytes()).unwrap();
}

/// Serving, then wait until the follower reads the ring buffer: a line is
/// written and the warden's journal shows it read (its re-check passes).
fn serving_and_following(w: &mut Warden, k: &mut std::fs::File, tag: &str) {
    w.wait_ready();
    w.wait_note("ready", |n| n.starts_with("STATUS=ready: pid "));
    let probe = format!("NVRM: Xid (PCI:0000:41:00): 13, pid=1, name=probe {tag}");
    printk(k, &probe);
    let seen = |w: &Warden| w.stderr().contains(&format!("name=probe {tag}")) || w.stderr().contains("Xid 13");
    w.wait_for_file("warden.stderr", |w| seen(w));
}

fn xid31(tag: &str) -> String {
    format!(
        "NVRM: Xid (PCI:0000:41:00): 31, pid=4242, name=python3, Ch 00000008, intr 10000000. MMU Fault: ENGINE \
         GRAPHICS GPCCLIENT_T1_0 faulted @ 0x7f_12340000. Fault is of type FAULT_PDE ACCESS_TYPE_VIRT_READ {tag}"
    )
}

/// An Xid 31 in the real ring buffer while serving, the model then
/// answering garbage: out of rotation within 1 s of the line, the re-check
/// fails (`wrong_answers`), the child is restarted.
#[test]
fn an_xid_31_in_the_kernel_ring_buffer_takes_the_model_out_and_wrong_answers_restart_it() {
    let Some(mut k) = kmsg() else { return };
    let (listen, tag) = (free_port(), tag());
    let mut w = Warden::start(|d, p| recheck_config(d, p, listen, &[], "on-mismatch = \"warn\"", &kernel_source(&tag)));
    serving_and_following(&mut w, &mut k, &tag);
    // The probe line was an Xid 13: its re-check is over first.
    w.wait_note("the probe's re-check", |n| n.contains("; back in rotation after "));
    assert_eq!(readyz(listen).0, 200);
    std::fs::write(w.path("weights"), "garbage now\n").unwrap();
    let t0 = Instant::now();
    printk(&mut k, &xid31(&tag));
    let out = w.wait_note("out of rotation", |n| n.starts_with("STATUS=rechecking pid "));
    let took = t0.elapsed();
    assert!(out.contains("(GPU fault: Xid 31 (GPU memory page fault) on 0000:41:00.0)"), "{out}");
    assert!(took <= OUT_OF_ROTATION, "{took:?}");
    let (code, body) = readyz(listen);
    assert!(
        code == 503
            && (body.starts_with("rechecking: the answers are being checked again after GPU fault: Xid 31")
                || body.starts_with("failed")),
        "{code} {body}"
    );
    w.wait_note("the failure", |n| n.starts_with("STATUS=failed ("));
    w.wait_ready();
    let d = doc(&w);
    assert_eq!(d["last_failure"]["class"], "wrong_answers", "{d}");
    let cause = d["last_failure"]["cause"].as_str().unwrap();
    assert!(cause.starts_with("re-checked after GPU fault: Xid 31 (GPU memory page fault) on 0000:41:00.0: answers changed with the same setup"), "{cause}");
    w.wait_logged("golden-mismatch");
    assert_eq!(w.stop(), 0);
    eprintln!("Xid 31 → out of rotation: {} ms", took.as_millis());
}

/// The same with the model still answering right: back in rotation, the
/// pause in the journal and the metrics.
#[test]
fn an_xid_31_with_the_answers_unchanged_puts_the_model_back_in_rotation() {
    let Some(mut k) = kmsg() else { return };
    let (listen, tag) = (free_port(), tag());
    let mut w = Warden::start(|d, p| recheck_config(d, p, listen, &[], "on-mismatch = \"warn\"", &kernel_source(&tag)));
    serving_and_following(&mut w, &mut k, &tag);
    w.wait_note("the probe's re-check", |n| n.contains("; back in rotation after "));
    let t0 = Instant::now();
    printk(&mut k, &xid31(&tag));
    w.wait_note("out of rotation", |n| n.starts_with("STATUS=rechecking pid "));
    let took = t0.elapsed();
    assert!(took <= OUT_OF_ROTATION, "{took:?}");
    let back = w.wait_note("back", |n| n.contains("; back in rotation after "));
    let back_at = t0.elapsed();
    assert!(
        back.contains(
            "re-checked after GPU fault: Xid 31 (GPU memory page fault) on 0000:41:00.0: answers as recorded"
        ),
        "{back}"
    );
    assert_eq!(readyz(listen), (200, "ready\n".to_string()));
    let d = doc(&w);
    assert_eq!(d["state"], "ready", "{d}");
    assert_eq!(d["rechecks"], 2, "the probe's and the Xid 31's: {d}");
    assert_eq!(d["last_failure"], serde_json::Value::Null, "{d}");
    w.wait_for_file("vllm_warden.prom", |w| {
        std::fs::read_to_string(w.path("vllm_warden.prom"))
            .unwrap_or_default()
            .contains("vllm_warden_golden_rechecks_total{name=\"t\"} 2")
    });
    let prom = std::fs::read_to_string(w.path("vllm_warden.prom")).unwrap();
    assert!(prom.contains("vllm_warden_golden_recheck_pause_seconds_total{name=\"t\"} "), "{prom}");
    w.wait_logged("back in rotation after");
    assert_eq!(w.stop(), 0);
    eprintln!("Xid 31 → out of rotation: {} ms; back in rotation after {} ms", took.as_millis(), back_at.as_millis());
}

/// `golden.interval`: the answers asked again on a timer, back in rotation
/// each time; a change of the answers meanwhile fails the run.
#[test]
fn golden_interval_rechecks_on_a_timer() {
    let listen = free_port();
    let mut w = Warden::start(|d, p| recheck_config(d, p, listen, &[], "interval = \"1s\"", ""));
    w.wait_ready();
    for _ in 0..2 {
        let out = w.wait_note("a re-check", |n| n.starts_with("STATUS=rechecking pid "));
        assert!(out.ends_with("(golden.interval)"), "{out}");
        let back = w.wait_note("back", |n| n.contains("; back in rotation after "));
        assert!(back.contains("re-checked after golden.interval: answers as recorded"), "{back}");
    }
    std::fs::write(w.path("weights"), "garbage now\n").unwrap();
    let failed = w.wait_note("the failure", |n| n.starts_with("STATUS=failed ("));
    assert!(failed.contains("re-checked after golden.interval: answers changed with the same setup"), "{failed}");
    assert_eq!(doc(&w)["last_failure"]["class"], "wrong_answers");
    assert_eq!(w.stop(), 0);
}

/// The kernel's OOM message for the engine's leader, then its SIGKILL:
/// named as the OOM killer's, with the figures, and restarted.
#[test]
fn an_oom_kill_of_the_leader_that_the_kernel_reports_is_named() {
    let Some(mut k) = kmsg() else { return };
    let (listen, tag) = (free_port(), tag());
    let mut w = Warden::start(|d, p| recheck_config(d, p, listen, &[], "", &kernel_source(&tag)));
    serving_and_following(&mut w, &mut k, &tag);
    let pid = doc(&w)["child_pid"].as_u64().unwrap() as i32;
    let line = format!(
        "Out of memory: Killed process {pid} (vllm-warden-sim) total-vm:8388608kB, anon-rss:5242880kB, \
         file-rss:0kB, shmem-rss:0kB, UID:0 pgtables:1024kB oom_score_adj:0 {tag}"
    );
    printk(&mut k, &line);
    w.wait_for_file("warden.stderr", |w| w.stderr().contains(&format!("Killed process {pid} ")));
    nix::sys::signal::kill(nix::unistd::Pid::from_raw(pid), nix::sys::signal::Signal::SIGKILL).unwrap();
    w.wait_ready();
    let d = doc(&w);
    let cause = d["last_failure"]["cause"].as_str().unwrap();
    assert!(
        cause.starts_with(&format!(
            "killed by the kernel's OOM killer (host memory): pid {pid} (vllm-warden-sim), anon-rss 5.0 GiB, total-vm 8.0 GiB"
        )),
        "{d}"
    );
    w.wait_logged("the host's memory (or the unit's MemoryMax=) ran out");
    assert_eq!(w.stop(), 0);
}

/// Run as a program of its own by
/// `a_user_program_whose_file_name_is_an_xid_line_changes_nothing` (a
/// copy of this binary under another name): a read of an unmapped address,
/// in this binary's own code, so that the kernel's segfault line names
/// this file. Does nothing in a test run.
#[test]
fn segfault_helper() {
    if std::env::var_os("VLLM_WARDEN_TEST_SEGFAULT").is_none() {
        return;
    }
    // SAFETY: none: the point is the fault (an address no one maps; not
    // null, which a debug build's check would turn into an abort).
    unsafe { std::ptr::read_volatile(16 as *const u8) };
}

/// Issue 56 (B3): any user on the host stopped the model. A program run as
/// `nobody` whose file name is an Xid line segfaults: the kernel's own line
/// (facility 0) quotes the name, `NVRM: Xid (PCI:[PID]: segfault at … in
/// NVRM: Xid (PCI:0000:41:00): 79, …`; and root writes an Xid line to
/// `/dev/kmsg` (facility `user`). The follower reads the real ring buffer's
/// records as they are: an Xid 79 and an Xid 31 quoted that way, and the
/// written one, change nothing (before: "failed permanently", exit 78).
/// The last line the test writes is one the source gives without its
/// record's header, which the warden says it cannot read: every line before
/// it was read. Needs root (to switch to `nobody` and write `/dev/kmsg`).
#[test]
fn a_user_program_whose_file_name_is_an_xid_line_changes_nothing() {
    let Some(mut k) = kmsg() else { return };
    let (listen, tag) = (free_port(), tag());
    // The records as the kernel wrote them; the last line without its header.
    let source = format!(
        "[health]\nkernel-messages = [\"sh\", \"-c\", \"cat /dev/kmsg | grep --line-buffered -F {tag} | sed -u '/last-line-{tag}/s/^[^;]*;//'\"]\n"
    );
    let mut w = Warden::start(|d, p| recheck_config(d, p, listen, &[], "on-mismatch = \"warn\"", &source));
    w.wait_ready();
    w.wait_note("ready", |n| n.starts_with("STATUS=ready: pid "));
    let dir = nobody::tempdir().expect("a folder nobody can reach");
    for xid in [79, 31] {
        let name = format!("NVRM: Xid (PCI:0000:41:00): {xid}, pid=1, name={tag}, GPU has fallen off the bus.");
        let exe = nobody::copy_binary(&std::env::current_exe().unwrap().to_string_lossy(), dir.path());
        let program = dir.path().join(&name);
        std::fs::rename(&exe, &program).unwrap();
        use std::os::unix::process::{CommandExt, ExitStatusExt};
        let status = std::process::Command::new(&program)
            .args(["--exact", "segfault_helper", "--nocapture", "--test-threads", "1"])
            .env("VLLM_WARDEN_TEST_SEGFAULT", "1")
            .uid(nobody::UID)
            .gid(nobody::UID)
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .status()
            .unwrap();
        assert_eq!(status.signal(), Some(libc::SIGSEGV), "{status:?}");
    }
    printk(&mut k, &format!("NVRM: Xid (PCI:0000:41:00): 79, pid=1, name={tag}, GPU has fallen off the bus."));
    printk(&mut k, &format!("last-line-{tag}"));
    let unknown = "kernel messages: a line that does not say its facility";
    w.wait_logged(unknown);
    assert_eq!(readyz(listen), (200, "ready\n".to_string()));
    let d = doc(&w);
    assert_eq!((d["state"].as_str(), d["rechecks"].as_u64().unwrap_or(0)), (Some("ready"), 0), "{d}");
    assert_eq!(w.stderr().matches(unknown).count(), 1);
    assert!(!w.stderr().contains("GPU fault: "), "{}", w.stderr());
    assert_eq!(w.stop(), 0);
    w.drain_notes();
    assert!(w.statuses().iter().all(|s| !s.contains("GPU fault: ") && !s.starts_with("rechecking")), "{:?}", w.notes);
}
