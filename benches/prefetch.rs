//! The read-ahead of the weights (`[prefetch]`) alone, against `cat` and
//! `dd bs=16M` of the same files, cold, in the same run:
//!
//! - several GB of weight files made by the bench in a temporary folder
//!   (`PREFETCH_BENCH_GB`, default 4, in `PREFETCH_BENCH_FILES` files,
//!   default 8, under `PREFETCH_BENCH_DIR`, default the system's);
//! - before each read, the page cache dropped (as root: `sync` and
//!   `echo 3 > /proc/sys/vm/drop_caches`; else the bench says so and stops);
//! - in each of 3 rounds (`PREFETCH_BENCH_ROUNDS`), `cat FILES > /dev/null`,
//!   `dd if=F of=/dev/null bs=16M` of each file, and the read-ahead with its
//!   default 4 threads and with 1, in turns (the order rotates each round,
//!   so that none always follows the same one);
//! - then the warden's loop while it reads: the release warden on the
//!   simulated vLLM serving the same folder (a `vllm` link to the
//!   simulator), cold, with the read-ahead on and off in turns, its longest
//!   loop turn (which it logs as it exits) compared.
//!
//! Run: `cargo build --release && cargo bench --bench prefetch`.

use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use vllm_warden::daemon::prefetch::{Order, Prefetch};

#[path = "../tests/support/sim.rs"]
mod sim;

fn env_u64(name: &str, default: u64) -> u64 {
    std::env::var(name).ok().and_then(|v| v.parse().ok()).unwrap_or(default)
}

fn median(mut xs: Vec<f64>) -> f64 {
    xs.sort_by(f64::total_cmp);
    xs[xs.len() / 2]
}

/// Every page cache dropped: what was read comes from the disk again.
fn drop_caches() {
    let synced = Command::new("sync").status().is_ok_and(|s| s.success());
    assert!(synced, "sync failed");
    std::fs::write("/proc/sys/vm/drop_caches", "3\n").expect("cannot drop the page cache");
}

/// The weight files: `n` shards of `bytes` in all, of bytes that are not
/// all alike (a filesystem that compresses or dedups would cheat).
fn make_files(dir: &Path, bytes: u64, n: u64) -> Vec<PathBuf> {
    let each = bytes / n;
    let block: Vec<u8> = (0..(16u32 << 20)).map(|i| (i.wrapping_mul(2_654_435_761) >> 13) as u8).collect();
    (1..=n)
        .map(|i| {
            let p = dir.join(format!("model-{i:05}-of-{n:05}.safetensors"));
            let mut f = std::fs::File::create(&p).unwrap();
            let mut left = each;
            let mut k = 0u8;
            while left > 0 {
                let len = left.min(block.len() as u64) as usize;
                // Each block its own: its first byte changes.
                let mut b = block[..len].to_vec();
                b[0] = k;
                k = k.wrapping_add(1);
                f.write_all(&b).unwrap();
                left -= len as u64;
            }
            f.sync_all().unwrap();
            p
        })
        .collect()
}

fn run(cmd: &mut Command) {
    let st = cmd.stdout(Stdio::null()).stderr(Stdio::null()).status().unwrap();
    assert!(st.success(), "{cmd:?}: {st}");
}

/// One cold read of `files` by `how`: its seconds.
fn cold(how: &str, files: &[PathBuf]) -> f64 {
    drop_caches();
    let t = Instant::now();
    match how {
        "cat" => {
            let out = std::fs::File::create("/dev/null").unwrap();
            let st = Command::new("cat").args(files).stdout(out).status().unwrap();
            assert!(st.success());
        }
        "dd" => {
            for f in files {
                run(Command::new("dd").arg(format!("if={}", f.display())).args(["of=/dev/null", "bs=16M"]));
            }
        }
        threads => {
            let threads: u32 = threads.trim_start_matches("prefetch-").parse().unwrap();
            let order = Order { files: files.to_vec(), threads, budget: u64::MAX };
            let now = Prefetch::start(order, |_| {}).unwrap().wait();
            assert_eq!(now.read, now.total, "read all of it: {now:?}");
        }
    }
    t.elapsed().as_secs_f64()
}

/// The release warden on the simulated vLLM serving `model`, cold, with the
/// read-ahead on or off: its longest loop turn (ms), from its last line.
fn longest_turn(exe: &str, sim: &Path, model: &Path, d: &Path, prefetch: bool) -> f64 {
    let _ = std::fs::remove_dir_all(d);
    std::fs::create_dir_all(d.join("bin")).unwrap();
    let vllm = d.join("bin/vllm");
    std::os::unix::fs::symlink(sim, &vllm).unwrap();
    let port = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
    let cfg = d.join("bench.toml");
    std::fs::write(
        &cfg,
        format!(
            r#"name = "bench"
[child]
command = ["{vllm}", "serve", "{model}", "--port", "{port}", "--shards", "8", "--shard-time", "500ms"]
log-file = "{d}/bench.log"
[status]
file = "{d}/status.json"
[golden]
enabled = false
[prefetch]
enabled = {prefetch}
"#,
            vllm = vllm.display(),
            model = model.display(),
            d = d.display()
        ),
    )
    .unwrap();
    drop_caches();
    let stderr = std::fs::File::create(d.join("warden.err")).unwrap();
    let mut w = Command::new(exe)
        .args(["run", "-c"])
        .arg(&cfg)
        .env("STATE_DIRECTORY", d.join("state"))
        .env("RUST_LOG", "info")
        .stdout(Stdio::null())
        .stderr(stderr)
        .spawn()
        .unwrap();
    // Until ready (the status file says so), then a stop.
    let until = Instant::now() + Duration::from_secs(300);
    loop {
        let doc = std::fs::read_to_string(d.join("status.json")).unwrap_or_default();
        if doc.contains("\"state\": \"ready\"") || doc.contains("\"state\":\"ready\"") {
            break;
        }
        assert!(Instant::now() < until, "not ready: {doc}");
        std::thread::sleep(Duration::from_millis(50));
    }
    nix::sys::signal::kill(nix::unistd::Pid::from_raw(w.id() as i32), nix::sys::signal::Signal::SIGTERM).unwrap();
    assert!(w.wait().unwrap().success());
    let err = std::fs::read_to_string(d.join("warden.err")).unwrap();
    let line = err.lines().rev().find(|l| l.contains("the loop's longest turn: ")).expect("the longest turn is logged");
    let ms = line.split("the loop's longest turn: ").nth(1).unwrap().split(' ').next().unwrap();
    ms.parse().unwrap()
}

fn main() {
    if !nix::unistd::geteuid().is_root() {
        println!("prefetch bench: skipped: dropping the page cache before each cold read needs root");
        return;
    }
    let gb = env_u64("PREFETCH_BENCH_GB", 4);
    let n = env_u64("PREFETCH_BENCH_FILES", 8);
    let rounds = env_u64("PREFETCH_BENCH_ROUNDS", 3) as usize;
    let base = std::env::var("PREFETCH_BENCH_DIR").map(PathBuf::from).unwrap_or_else(|_| std::env::temp_dir());
    let dir = tempfile::tempdir_in(&base).unwrap();
    let model = dir.path().join("model");
    std::fs::create_dir_all(&model).unwrap();
    std::fs::write(model.join("config.json"), "{}\n").unwrap();
    println!("making {gb} GB in {n} files under {}", base.display());
    let files = make_files(&model, gb << 30, n);
    let bytes: u64 = files.iter().map(|f| f.metadata().unwrap().len()).sum();
    let ways = ["cat", "dd", "prefetch-4", "prefetch-1"];
    let mut secs: Vec<Vec<f64>> = vec![Vec::new(); ways.len()];
    for round in 0..rounds {
        for k in 0..ways.len() {
            let i = (k + round) % ways.len();
            let s = cold(ways[i], &files);
            println!("round {}: {:<10} {:6.2} s  {:6.3} GB/s", round + 1, ways[i], s, bytes as f64 / 1e9 / s);
            secs[i].push(s);
        }
    }
    println!("\ncold reads of {:.2} GB ({n} files), median of {rounds} rounds:", bytes as f64 / 1e9);
    let gbps: Vec<f64> = secs.iter().map(|s| bytes as f64 / 1e9 / median(s.clone())).collect();
    for (w, g) in ways.iter().zip(&gbps) {
        println!("  {w:<10} {g:6.3} GB/s");
    }
    for (i, w) in ways.iter().enumerate().skip(2) {
        // Per round, against the baselines of the same round.
        let vs = |b: usize| median(secs[b].iter().zip(&secs[i]).map(|(b, p)| b / p).collect());
        println!("  {w:<10} {:.2}× cat, {:.2}× dd (median of the rounds' ratios)", vs(0), vs(1));
    }
    let exe = env!("CARGO_BIN_EXE_vllm-warden");
    let sim = sim::beside(exe);
    let (mut on, mut off) = (Vec::new(), Vec::new());
    for round in 0..rounds {
        let d = dir.path().join("warden");
        for prefetch in if round % 2 == 0 { [true, false] } else { [false, true] } {
            let ms = longest_turn(exe, &sim, &model, &d, prefetch);
            println!(
                "round {}: warden, read-ahead {}: longest loop turn {ms:.2} ms",
                round + 1,
                if prefetch { "on" } else { "off" }
            );
            if prefetch { on.push(ms) } else { off.push(ms) }
        }
    }
    println!(
        "\nthe loop's longest turn, median of {rounds}: {:.2} ms with the read-ahead, {:.2} ms without",
        median(on),
        median(off)
    );
}
