//! The read-ahead of the weights (`[prefetch]`) with the real binary and
//! the simulated vLLM on a model folder of real files: the weights read
//! while the model loads (`STATUS=` says how far), each load's record with
//! the residency at the spawn and the read-ahead's bytes, a warm restart
//! reading nothing, and `check` and `loads show` saying so.

mod common;

use common::*;
use std::path::{Path, PathBuf};

/// Out of the page cache, as after a reboot: on the disk, its clean pages
/// dropped. Whether they left, as `mincore` sees it: on tmpfs (`/tmp` under
/// systemd's tmp.mount) the file is its pages, and nothing is dropped.
fn evict(path: &Path) -> Result<(), String> {
    let f = std::fs::File::open(path).unwrap();
    f.sync_all().unwrap();
    nix::fcntl::posix_fadvise(&f, 0, 0, nix::fcntl::PosixFadviseAdvice::POSIX_FADV_DONTNEED).unwrap();
    match resident_pages(&f) {
        0 => Ok(()),
        n => Err(format!("{}: {n} page(s) still cached after POSIX_FADV_DONTNEED", path.display())),
    }
}

/// How many pages of `file` are in the page cache (`mincore` on a mapping
/// of it, which reads nothing).
fn resident_pages(file: &std::fs::File) -> usize {
    use nix::sys::mman::{MapFlags, ProtFlags, mmap, munmap};
    let len = file.metadata().unwrap().len() as usize;
    let Some(n) = std::num::NonZeroUsize::new(len) else { return 0 };
    // SAFETY: a fresh read-only mapping of a file, never read (mincore
    // only), unmapped before returning.
    let addr = unsafe { mmap(None, n, ProtFlags::PROT_READ, MapFlags::MAP_SHARED, file, 0) }.unwrap();
    let mut flags = vec![0u8; len.div_ceil(4096)];
    // SAFETY: one byte per page of the mapping (pages of 4 KiB or more).
    let rc = unsafe { libc::mincore(addr.as_ptr(), len, flags.as_mut_ptr()) };
    let err = std::io::Error::last_os_error();
    // SAFETY: the mapping made above, of this length.
    unsafe { munmap(addr, len) }.unwrap();
    assert_eq!(rc, 0, "mincore: {err}");
    flags.iter().filter(|f| **f & 1 == 1).count()
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
    // The model beside the build, on its disk: the temporary folder may be
    // tmpfs, whose pages cannot be dropped.
    let disk = tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).unwrap();
    let (model, shards) = model(disk.path());
    if let Err(why) = shards.iter().try_for_each(|f| evict(f)) {
        // Not a pass: a cold load cannot be made here, and the test says so.
        eprintln!("SKIPPED: the weights cannot be put out of the page cache: {why}");
        return;
    }
    let mut w = Warden::start(|d, p| {
        let vllm = d.join("bin/vllm");
        std::fs::create_dir_all(vllm.parent().unwrap()).unwrap();
        std::os::unix::fs::symlink(sim(), &vllm).unwrap();
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
    // Warm: what the first load read is cached, less what memory pressure
    // on a busy machine may have taken back since (a few pages were seen
    // to go); the read-ahead reads exactly what is not.
    let residency = warm["residency"].as_f64().unwrap();
    assert!(residency >= 0.98, "{warm}");
    let (read, resident) =
        (warm["prefetch"]["bytes"].as_u64().unwrap(), warm["prefetch"]["resident_bytes"].as_u64().unwrap());
    assert_eq!(read + resident, 2 * SHARD as u64, "{warm}");
    assert!(resident as f64 >= 0.98 * (2 * SHARD) as f64, "{warm}");
    assert!(warm.get("efficiency").is_none(), "nothing read from the disk, nothing to measure: {warm}");
    assert_eq!(w.stop(), 0);

    let (ok, show) = w.cli(&["loads", "show", "1"]);
    assert!(ok, "{show}");
    assert!(show.contains("read-ahead: 0.03 GB read from the disk in "), "{show}");
    let (ok, list) = w.cli(&["loads", "list"]);
    assert!(ok && list.lines().next().unwrap().contains("CACHED  DISK  EFF"), "{list}");
    assert!(list.lines().nth(2).unwrap().contains(&format!("{:.0}%", residency * 100.0)), "{list}");
    // `check` says what the read-ahead will do: both shards are cached now.
    let (_, text) = w.cli(&["check"]);
    let err = "";
    assert!(text.contains("read-ahead of the weights: 2 file(s) of "), "{text}{err}");
    // What is cached now, as measured now (a busy machine's memory
    // pressure may have taken a few pages back).
    let now = text.split("0.03 GB, in vLLM's order, 2 thread(s); ").nth(1).and_then(|t| t.split('%').next());
    assert!(now.and_then(|p| p.parse::<u32>().ok()).is_some_and(|p| p >= 98), "{text}");
}
