//! The read-ahead of the weights (`[prefetch]`) with the real binary and
//! the simulated vLLM on a model folder of real files: the weights read
//! while the model loads (`STATUS=` says how far), each load's record with
//! the residency at the spawn and the read-ahead's bytes, a warm restart
//! reading nothing, and `check` and `loads show` saying so.

mod common;

use common::*;
use std::path::{Path, PathBuf};

/// Out of the page cache, as after a reboot: on the disk, its clean pages
/// dropped (the test folders are on a disk, not tmpfs).
fn evict(path: &Path) {
    let f = std::fs::File::open(path).unwrap();
    f.sync_all().unwrap();
    nix::fcntl::posix_fadvise(&f, 0, 0, nix::fcntl::PosixFadviseAdvice::POSIX_FADV_DONTNEED).unwrap();
}

const SHARD: usize = 12 << 20;

/// A model folder of two safetensors shards named by their index, and a
/// `.bin` copy vLLM would not read.
fn model(d: &Path) -> (PathBuf, Vec<PathBuf>) {
    let model = d.join("model");
    std::fs::create_dir_all(&model).unwrap();
    std::fs::write(model.join("config.json"), "{}\n").unwrap();
    let shards: Vec<PathBuf> = (1..=2)
        .map(|i| {
            let p = model.join(format!("model-0000{i}-of-00002.safetensors"));
            std::fs::write(&p, vec![i as u8; SHARD]).unwrap();
            p
        })
        .collect();
    std::fs::write(
        model.join("model.safetensors.index.json"),
        r#"{"weight_map": {"a": "model-00001-of-00002.safetensors", "b": "model-00002-of-00002.safetensors"}}"#,
    )
    .unwrap();
    std::fs::write(model.join("pytorch_model.bin"), vec![9u8; 1 << 20]).unwrap();
    (model, shards)
}

fn records(w: &Warden) -> Vec<serde_json::Value> {
    std::fs::read_to_string(w.path("state/loads.jsonl"))
        .unwrap_or_default()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect()
}

#[test]
fn the_weights_are_read_ahead_and_each_load_records_the_page_cache() {
    let mut shards = Vec::new();
    let mut w = Warden::start(|d, p| {
        let vllm = d.join("bin/vllm");
        std::fs::create_dir_all(vllm.parent().unwrap()).unwrap();
        std::os::unix::fs::symlink(sim(), &vllm).unwrap();
        let (model, files) = model(d);
        for f in &files {
            evict(f);
        }
        shards = files;
        let argv: Vec<String> = [
            vllm.to_str().unwrap(),
            "serve",
            model.to_str().unwrap(),
            "--port",
            &p.to_string(),
            "--shards",
            "4",
            "--shard-time",
            "400ms",
        ]
        .iter()
        .map(|a| format!("{a:?}"))
        .collect();
        format!(
            "name = \"t\"\n[child]\ncommand = [{}]\nlog-file = \"{d}/t.log\"\n[status]\nfile = \"{d}/status.json\"\n\
             [restart]\ninitial-delay = \"0s\"\n[prefetch]\nthreads = 2\n",
            argv.join(", "),
            d = d.display()
        )
    });
    // While the weights load, STATUS= shows them read ahead: all of the
    // two shards, none of the `.bin` file.
    w.wait_note("the read-ahead", |n| n.starts_with("STATUS=loading ") && n.contains("read ahead 25.2 of 25.2 MB"));
    w.wait_ready();
    let ready = w.wait_note("ready", |n| n.starts_with("STATUS=ready: pid "));
    w.wait_for_file("state/loads.jsonl", |w| records(w).len() == 1);
    let rs = records(&w);
    let cold = rs.last().unwrap();
    assert_eq!(cold["weights_bytes"], 2 * SHARD as u64, "{cold}");
    assert_eq!(cold["prefetch"]["bytes"], 2 * SHARD as u64, "{cold}");
    assert_eq!(cold["prefetch"]["resident_bytes"], 0, "{cold}");
    assert!(cold["prefetch"]["gbps"].as_f64().unwrap() > 0.0, "{cold}");
    assert!(cold.get("cold").is_none(), "the residency replaces the guess: {cold}");
    assert!((0.0..=1.0).contains(&cold["residency"].as_f64().unwrap()), "{cold}");

    // A restart on a warm cache reads nothing: all of it was cached.
    w.drain_notes();
    let pid: i32 = ready["STATUS=ready: pid ".len()..].split(',').next().unwrap().parse().unwrap();
    nix::sys::signal::kill(nix::unistd::Pid::from_raw(pid), nix::sys::signal::Signal::SIGKILL).unwrap();
    w.wait_note("the second load", |n| n.starts_with("STATUS=loading "));
    w.wait_ready();
    w.wait_for_file("state/loads.jsonl", |w| records(w).len() == 2);
    let rs = records(&w);
    let warm = rs.last().unwrap();
    assert_eq!(warm["residency"], 1.0, "{warm}");
    assert_eq!(warm["prefetch"]["bytes"], 0, "{warm}");
    assert_eq!(warm["prefetch"]["resident_bytes"], 2 * SHARD as u64, "{warm}");
    assert!(warm.get("efficiency").is_none(), "nothing read from the disk, nothing to measure: {warm}");
    assert_eq!(w.stop(), 0);

    let (ok, show) = w.cli(&["loads", "show", "1"]);
    assert!(ok, "{show}");
    assert!(show.contains("read-ahead: 0.03 GB read from the disk in "), "{show}");
    let (ok, list) = w.cli(&["loads", "list"]);
    assert!(ok && list.lines().next().unwrap().contains("CACHED  DISK  EFF"), "{list}");
    assert!(list.lines().nth(2).unwrap().contains("100%"), "{list}");
    // `check` says what the read-ahead will do: both shards are cached now.
    let (_, text) = w.cli(&["check"]);
    let err = "";
    assert!(text.contains("read-ahead of the weights: 2 file(s) of "), "{text}{err}");
    assert!(text.contains("0.03 GB, in vLLM's order, 2 thread(s); 100% in the page cache now"), "{text}");
    let _ = shards;
}
