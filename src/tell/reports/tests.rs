//! Reports on real files: the log tail and traceback groups from a real
//! vLLM log, the tree of this very process, retention on a real folder.

use super::*;
use crate::config::profile::Profile;
use std::sync::Mutex;

fn classifier() -> Classifier {
    Classifier::new(&Profile::Vllm.patterns()).unwrap()
}

/// [`log_tail`] of the whole file from `offset`.
fn tail_of(log: &Path, offset: u64, keep: usize) -> Tail {
    let f = fs::File::open(log).unwrap();
    let end = f.metadata().unwrap().len();
    log_tail(&f, log, offset, end, keep, classifier()).unwrap()
}

const KV_CACHE: &str = include_str!("../../../tests/fixtures/b_b3-ct-kv-cache-scheme-fp4.log");

#[test]
fn folder_names_sort_by_time_and_are_read_back_for_their_instance_only() {
    let at = SystemTime::UNIX_EPOCH + Duration::from_millis(1_796_046_065_123);
    let name = folder_name(at, "kimi-k2.5", 3);
    assert_eq!(name, "20261130T134105.123Z-kimi-k2.5-3");
    assert_eq!(parse_name(&name, "kimi-k2.5"), Some(("20261130T134105.123Z", 3)));
    assert_eq!(parse_name(&name, "kimi"), None, "another instance's");
    assert_eq!(parse_name("20261130T134105.123Z-kimi-k2.5-3.bak", "kimi-k2.5"), None);
    assert_eq!(parse_name("notes", "kimi"), None);
    let later = folder_name(at + Duration::from_secs(1), "kimi-k2.5", 1);
    assert!(later > name);
}

#[test]
fn the_log_tail_holds_the_last_lines_and_every_traceback_group_in_full() {
    let dir = tempfile::tempdir().unwrap();
    let log = dir.path().join("t.log");
    // An earlier run before the offset must not be read.
    let earlier = "(APIServer pid=1) INFO 11-29 18:00:00 [x.py:1] an earlier run --api-key sk-earlier\n";
    let secret = "(APIServer pid=13424) INFO 11-29 18:16:29 [x.py:1] argv: vllm serve /m --api-key sk-live-1 \
                  HF_TOKEN=hf_secret\n";
    std::fs::write(&log, format!("{earlier}{KV_CACHE}{secret}")).unwrap();
    let tail = tail_of(&log, earlier.len() as u64, 5);
    assert_eq!(tail.lines, 5);
    assert!(!tail.text.contains("an earlier run"));
    // The last line, masked.
    assert!(tail.text.contains("--api-key *** HF_TOKEN=***"), "{}", tail.text);
    assert!(!tail.text.contains("sk-live-1") && !tail.text.contains("hf_secret"));
    // The groups: the worker's, the engine core's, and the API server's
    // chained pair, each from its header to its exception line.
    assert!(tail.groups >= 3, "{}", tail.groups);
    let groups: Vec<&str> = tail.text.split("\n# traceback group ").skip(1).collect();
    assert_eq!(groups.len(), tail.groups);
    let worker = groups.iter().find(|g| g.contains("(Worker pid=13437)")).expect("the worker's traceback");
    assert!(worker.contains("Traceback (most recent call last):"));
    assert!(worker.trim_end().ends_with(
        "NotImplementedError: Currently supported kv cache quantization is num_bits=8, type=float, however received \
         num_bits=4, type=float"
    ));
    let version = {
        let cut = dir.path().join("v.log");
        std::fs::write(&cut, KV_CACHE).unwrap();
        vllm_version(&fs::File::open(&cut).unwrap(), 0, KV_CACHE.len() as u64)
    };
    assert_eq!(version.as_deref(), Some("0.32.0"));
}

#[test]
fn a_long_run_log_is_read_from_its_last_part_only() {
    let dir = tempfile::tempdir().unwrap();
    let log = dir.path().join("t.log");
    let f = std::fs::File::create(&log).unwrap();
    // A sparse file far longer than what is read: only its end counts.
    f.set_len(LOG_SCAN + (8 << 20)).unwrap();
    drop(f);
    let mut f = std::fs::OpenOptions::new().append(true).open(&log).unwrap();
    std::io::Write::write_all(&mut f, b"\nthe last line\n").unwrap();
    let tail = tail_of(&log, 0, 3);
    assert!(tail.text.contains("its last 256 MiB read"), "{}", tail.text);
    assert!(tail.text.trim_end().ends_with("the last line"));
}

#[test]
fn the_tree_names_each_process_with_its_state_and_masked_command() {
    use std::io::BufRead;
    // It says so once it runs its own program; then it waits for a line.
    let mut child = std::process::Command::new("sh")
        .args(["-c", "echo up; read x", "sh", "--api-key", "sk-tree"])
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let mut up = String::new();
    std::io::BufReader::new(child.stdout.take().unwrap()).read_line(&mut up).unwrap();
    assert_eq!(up, "up\n");
    let pid = child.id() as i32;
    let st = crate::process::child::read_stat(pid).unwrap();
    let text = describe_tree(&[st]);
    let _ = child.kill();
    let _ = child.wait();
    let row = text.lines().find(|l| l.starts_with(&pid.to_string())).unwrap_or_else(|| panic!("{text}"));
    assert!(row.contains(" (sleeping)") || row.contains(" (running)"), "{row}");
    assert!(row.contains(" kB"), "RSS: {row}");
    assert!(row.contains("sh -c 'echo up; read x' sh --api-key ***"), "{row}");
    assert!(!row.contains("sk-tree"), "{row}");
    assert!(text.starts_with("# the server's process tree when the run failed: 1 process(es)\nPID"));
}

fn report(root: &Path, name: &str, bytes: usize) {
    let d = root.join(name);
    std::fs::create_dir_all(d.join(PY_SPY)).unwrap();
    std::fs::write(d.join(LOG_TAIL), vec![b'x'; bytes]).unwrap();
    std::fs::write(d.join(PY_SPY).join("42.txt"), b"dump").unwrap();
}

#[test]
fn retention_removes_the_oldest_of_ours_and_nothing_else() {
    let state = tempfile::tempdir().unwrap();
    let root = state.path().join(FOLDER);
    let names: Vec<String> = (0..5).map(|i| format!("2026113{i}T000000.000Z-t-1")).collect();
    for n in &names {
        report(&root, n, 1000);
    }
    // Not ours: another instance's report, a folder of another name, a
    // symlink with our name, and a file someone put into an old report.
    report(&root, "20260101T000000.000Z-other-1", 1000);
    std::fs::create_dir_all(root.join("keep-me")).unwrap();
    let outside = tempfile::tempdir().unwrap();
    std::fs::write(outside.path().join(LOG_TAIL), b"outside").unwrap();
    std::os::unix::fs::symlink(outside.path(), root.join("20250101T000000.000Z-t-1")).unwrap();
    std::fs::write(root.join(&names[1]).join("notes.txt"), b"mine").unwrap();
    std::fs::write(root.join(&names[1]).join(PY_SPY).join("core"), b"mine too").unwrap();

    retain(&root, "t", 3, 1 << 30, &names[4]);
    let left: Vec<String> = list(state.path(), "t").unwrap().into_iter().map(|r| r.name).collect();
    // names[1] lost its files but keeps the foreign note, and so its folder.
    assert_eq!(left, vec![names[1].clone(), names[2].clone(), names[3].clone(), names[4].clone()]);
    assert_eq!(std::fs::read_dir(root.join(&names[1])).unwrap().count(), 2);
    assert_eq!(std::fs::read(root.join(&names[1]).join(PY_SPY).join("core")).unwrap(), b"mine too");
    assert!(!root.join(&names[1]).join(PY_SPY).join("42.txt").exists());
    assert!(root.join("20260101T000000.000Z-other-1").join(LOG_TAIL).exists());
    assert!(root.join("keep-me").exists());
    assert_eq!(std::fs::read(outside.path().join(LOG_TAIL)).unwrap(), b"outside");

    // The total size: 2.5 reports' worth keeps the newest two.
    retain(&root, "t", 20, 2500, &names[4]);
    let left: Vec<String> = list(state.path(), "t").unwrap().into_iter().map(|r| r.name).collect();
    assert_eq!(left, vec![names[1].clone(), names[3].clone(), names[4].clone()]);
    // The newest stays even when it alone is over the size.
    retain(&root, "t", 20, 10, &names[4]);
    let left: Vec<String> = list(state.path(), "t").unwrap().into_iter().map(|r| r.name).collect();
    assert_eq!(left, vec![names[1].clone(), names[4].clone()]);
    // A later run's report, written beside an earlier one, is never the
    // earlier one's to remove.
    let later = "20261205T000000.000Z-t-2".to_string();
    report(&root, &later, 1000);
    retain(&root, "t", 1, 1 << 30, &names[4]);
    let left: Vec<String> = list(state.path(), "t").unwrap().into_iter().map(|r| r.name).collect();
    assert_eq!(left, vec![names[1].clone(), names[4].clone(), later.clone()]);
    retain(&root, "t", 1, 1 << 30, &later);
    let left: Vec<String> = list(state.path(), "t").unwrap().into_iter().map(|r| r.name).collect();
    assert_eq!(left, vec![names[1].clone(), later]);
}

#[test]
fn gpu_kernel_messages_are_told_from_the_rest() {
    assert!(crate::observe::kernel::gpu_related(
        "2026-11-30T10:00:00+0000 host kernel: NVRM: Xid (PCI:0000:41:00): 13, pid=1, name=x, Graphics Exception"
    ));
    assert!(crate::observe::kernel::gpu_related(
        "kernel: NVRM: GPU at PCI:0000:41:00: GPU-3b0b has fallen off the bus."
    ));
    assert!(!crate::observe::kernel::gpu_related("kernel: usb 1-1: new high-speed USB device number 2"));
    // An illegal instruction's trap names the library that holds it.
    assert!(crate::observe::kernel::gpu_related(
        "kernel: traps: VLLM::Worker[4242] trap invalid opcode ip:7f0e2c1d3a10 sp:7f0d8bffe5e0 error:0 in \
         _C.abi3.so[7f0e2b800000+1e00000]"
    ));
}

/// The tests of the start's flag, one at a time (it is the process's).
static START_FLAG: Mutex<()> = Mutex::new(());

#[test]
fn the_file_work_of_a_gone_run_waits_for_a_start_under_way() {
    let _one = START_FLAG.lock().unwrap_or_else(|p| p.into_inner());
    let begun = Instant::now();
    start_under_way(true);
    let over = StartOver;
    let (tx, rx) = std::sync::mpsc::channel();
    // Handed to the reports' thread at once; its result is not awaited.
    drop(work(true, move || {
        let _ = tx.send(());
    }));
    // Run within the second the wait may last: beside the start.
    if rx.recv_timeout(Duration::from_millis(200)).is_ok() {
        assert!(begun.elapsed() >= START_YIELD, "the file work ran beside the start");
    }
    drop(over);
    rx.recv_timeout(Duration::from_secs(30)).expect("the file work runs once the start is spawned");
}

#[test]
fn a_start_never_said_over_holds_the_file_work_for_a_second_at_most() {
    let _one = START_FLAG.lock().unwrap_or_else(|p| p.into_inner());
    start_under_way(true);
    let (tx, rx) = std::sync::mpsc::channel();
    drop(work(true, move || {
        let _ = tx.send(());
    }));
    rx.recv_timeout(Duration::from_secs(30)).expect("the file work runs after START_YIELD");
    start_under_way(false);
}
