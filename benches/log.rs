//! The log path under load, with the release binary and logs built from
//! the real vLLM 0.32 fixtures (`tests/fixtures/`):
//!
//! - follow + classify: a child writes a 120 MB log of real vLLM lines at
//!   once (no fatal or ready line until its last line, the ready line):
//!   the time from its first byte to `READY=1`, beside `grep -c -E -f` with
//!   the profile's own patterns over the same file;
//! - the same pipeline in-process (the follower's thread reading the file,
//!   splitting, stripping, classifying, tracking tracebacks), journald off;
//! - peak memory (VmHWM) of the warden through bursts: 1 GB of short lines,
//!   one 200 MB line, 1 GB of random bytes, 1 M traceback headers each with a
//!   process prefix of its own (profile `none`), each followed by the ready
//!   line, which must still arrive;
//! - the warden's CPU while a ready child writes 1 000 lines a second.
//!
//! Every baseline is measured in the same run. Sizes: `LOG_BENCH_MB`
//! (default 120) and `LOG_BENCH_BURST_MB` (default 1024).
//!
//! Run: `cargo bench --bench log`.

use std::io::{Read, Write};
use std::os::unix::net::UnixDatagram;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use vllm_warden::config::profile::{List, Profile};
use vllm_warden::observe::logwatch::{Delivery, LogFollower};
use vllm_warden::supervisor::classify::{Class, Classifier, Splitter};

const READY_LINE: &str = "INFO:     Application startup complete.";
/// The child's side of a run: what it writes, set in its environment.
const CHILD: &str = "LOG_BENCH_CHILD";

fn now_ns() -> u128 {
    SystemTime::now().duration_since(UNIX_EPOCH).unwrap().as_nanos()
}

fn env_mb(name: &str, default: u64) -> u64 {
    std::env::var(name).ok().and_then(|v| v.parse().ok()).unwrap_or(default)
}

fn median(mut xs: Vec<f64>) -> f64 {
    xs.sort_by(|a, b| a.partial_cmp(b).unwrap());
    xs[xs.len() / 2]
}

/// Every line of every fixture that is neither fatal nor ready nor empty.
fn fixture_lines() -> Vec<String> {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures");
    let mut names: Vec<PathBuf> = std::fs::read_dir(&dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|e| e == "log"))
        .collect();
    names.sort();
    let mut c = Classifier::new(&Profile::Vllm.patterns()).unwrap();
    let mut out = Vec::new();
    for p in names {
        let mut lines = Vec::new();
        let mut s = Splitter::default();
        s.push(&std::fs::read(&p).unwrap(), &mut lines);
        for l in lines {
            if !matches!(c.classify(l.clone()).class, Class::Fatal | Class::Ready) {
                out.push(l);
            }
        }
    }
    out
}

/// A realistic log of about `mb` MB from the fixtures, ending in the ready line.
fn realistic_log(path: &Path, mb: u64) -> u64 {
    let lines = fixture_lines();
    let mut f = std::io::BufWriter::new(std::fs::File::create(path).unwrap());
    let mut n = 0u64;
    'outer: loop {
        for l in &lines {
            f.write_all(l.as_bytes()).unwrap();
            f.write_all(b"\n").unwrap();
            n += l.len() as u64 + 1;
            if n >= mb << 20 {
                break 'outer;
            }
        }
    }
    writeln!(f, "{READY_LINE}").unwrap();
    f.flush().unwrap();
    n + READY_LINE.len() as u64 + 1
}

/// The profile's patterns, as `grep -E` reads them.
fn grep_patterns(path: &Path) {
    let p = Profile::Vllm.patterns();
    let mut text = String::new();
    for which in List::ALL {
        for pat in p.list(which) {
            text.push_str(&pat.replace(r"\d", "[0-9]"));
            text.push('\n');
        }
    }
    std::fs::write(path, text).unwrap();
}

/// `grep -c -E -f` over `log`, in the locale `locale`.
fn grep_seconds(patterns: &Path, log: &Path, locale: &str) -> f64 {
    let t = Instant::now();
    let out = Command::new("grep")
        .env("LC_ALL", locale)
        .arg("-c")
        .arg("-E")
        .arg("-f")
        .arg(patterns)
        .arg(log)
        .output()
        .unwrap();
    let s = t.elapsed().as_secs_f64();
    assert!(out.status.code() == Some(0), "grep: {}", String::from_utf8_lossy(&out.stderr));
    s
}

/// The child: writes what `LOG_BENCH_CHILD` says to its stdout (the log
/// file), stamps when it began, and stays until killed.
fn child(spec: &str) -> ! {
    let mut parts = spec.split(':');
    let kind = parts.next().unwrap();
    let arg = parts.next().unwrap_or("");
    let stamp = parts.next().unwrap_or("");
    // Our own open file of the log, appending: copies go through the kernel.
    let mut out = std::fs::OpenOptions::new().append(true).open("/proc/self/fd/1").unwrap();
    if !stamp.is_empty() {
        std::fs::write(stamp, now_ns().to_string()).unwrap();
    }
    let mb: u64 = arg.parse().unwrap_or(0);
    let mut buf = Vec::with_capacity(1 << 20);
    match kind {
        "file" => {
            std::io::copy(&mut std::fs::File::open(arg).unwrap(), &mut out).unwrap();
            // When the last byte was written, before the ready line.
            let mut f = std::fs::OpenOptions::new().append(true).open(stamp).unwrap();
            writeln!(f, "\n{}", now_ns()).unwrap();
        }
        "short" => {
            let mut n = 0u64;
            let mut i = 0u64;
            while n < mb << 20 {
                buf.clear();
                while buf.len() < (1 << 20) - 64 {
                    i += 1;
                    let _ = writeln!(buf, "INFO 11-29 18:11:16 [x.py:1] request {i}");
                }
                out.write_all(&buf).unwrap();
                n += buf.len() as u64;
            }
        }
        "long" => {
            buf.resize(1 << 20, b'x');
            for _ in 0..mb {
                out.write_all(&buf).unwrap();
            }
            out.write_all(b"\n").unwrap();
        }
        "random" => {
            buf.resize(1 << 20, 0);
            for _ in 0..mb {
                fastrand::fill(&mut buf);
                out.write_all(&buf).unwrap();
            }
            out.write_all(b"\n").unwrap();
        }
        "prefixes" => {
            let count: u64 = arg.parse().unwrap();
            for i in 0..count {
                let _ = writeln!(
                    buf,
                    "(Worker_{i} pid={i}) ERROR 11-29 18:16:26 [multiproc_executor.py:953] Traceback (most recent call last):"
                );
                if buf.len() > (1 << 20) - 256 {
                    out.write_all(&buf).unwrap();
                    buf.clear();
                }
            }
            out.write_all(&buf).unwrap();
        }
        "steady" => {
            // The ready line, then `arg` lines a second, one write each.
            writeln!(out, "{READY_LINE}").unwrap();
            let lines = fixture_lines();
            let rate: u64 = arg.parse().unwrap();
            let t0 = Instant::now();
            for (i, l) in lines.iter().cycle().enumerate() {
                let due = t0 + Duration::from_nanos(1_000_000_000 / rate * i as u64);
                if let Some(d) = due.checked_duration_since(Instant::now()) {
                    std::thread::sleep(d);
                }
                out.write_all(format!("{l}\n").as_bytes()).unwrap();
            }
        }
        other => panic!("unknown child {other}"),
    }
    if kind != "file" {
        writeln!(out, "{READY_LINE}").unwrap();
    }
    loop {
        std::thread::sleep(Duration::from_secs(3600));
    }
}

/// A warden running one config, with its notify socket.
struct Warden {
    proc: Child,
    ready: mpsc::Receiver<u128>,
    dir: PathBuf,
}

impl Warden {
    fn start(dir: &Path, profile: &str, child_spec: &str) -> Warden {
        let exe = env!("CARGO_BIN_EXE_vllm-warden");
        let me = std::env::current_exe().unwrap();
        let run = dir.join("run");
        std::fs::create_dir_all(&run).unwrap();
        let port = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
        let ready_log = if profile == "none" { "log = [\"Application startup complete\"]\n" } else { "" };
        let cfg = dir.join("bench.toml");
        std::fs::write(
            &cfg,
            format!(
                "name = \"logbench\"\nprofile = \"{profile}\"\n[child]\ncommand = [\"{me}\"]\nlog-file = \"{d}/bench.log\"\n\
                 env = {{ {CHILD} = \"{child_spec}\" }}\n[ready]\nhttp = \"\"\n{ready_log}[health]\nhttp = \"\"\n\
                 [prestart]\nport = {port}\ngpu-idle-wait = \"0s\"\n[restart]\nmax-attempts = 1\n[status]\nfile = \"{r}/status.json\"\n[golden]\nenabled = false\n",
                me = me.display(),
                d = dir.display(),
                r = run.display(),
            ),
        )
        .unwrap();
        let sock_path = dir.join("notify.sock");
        let _ = std::fs::remove_file(&sock_path);
        let sock = UnixDatagram::bind(&sock_path).unwrap();
        let (tx, ready) = mpsc::channel();
        std::thread::spawn(move || {
            let mut buf = vec![0u8; 65536];
            while let Ok(n) = sock.recv(&mut buf) {
                let t = now_ns();
                if String::from_utf8_lossy(&buf[..n]).lines().any(|l| l == "READY=1") && tx.send(t).is_err() {
                    return;
                }
            }
        });
        let proc = Command::new(exe)
            .args(["run", "-c"])
            .arg(&cfg)
            .env("NOTIFY_SOCKET", &sock_path)
            .env("STATE_DIRECTORY", dir.join("state"))
            .env("RUST_LOG", "error")
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap();
        Warden { proc, ready, dir: dir.to_path_buf() }
    }

    fn wait_ready(&self, within: Duration) -> u128 {
        self.ready.recv_timeout(within).expect("READY=1")
    }

    /// `VmHWM`, the peak resident set, in MB.
    fn peak_rss_mb(&self) -> f64 {
        let s = std::fs::read_to_string(format!("/proc/{}/status", self.proc.id())).unwrap();
        let kb: f64 = s
            .lines()
            .find_map(|l| l.strip_prefix("VmHWM:"))
            .unwrap()
            .trim()
            .trim_end_matches(" kB")
            .trim()
            .parse()
            .unwrap();
        kb / 1024.0
    }

    /// CPU time of every thread of the warden, in seconds.
    fn cpu_seconds(&self) -> f64 {
        let mut total = 0u64;
        for t in std::fs::read_dir(format!("/proc/{}/task", self.proc.id())).unwrap().flatten() {
            if let Ok(s) = std::fs::read_to_string(t.path().join("schedstat")) {
                total += s.split(' ').next().unwrap().parse::<u64>().unwrap();
            }
        }
        total as f64 / 1e9
    }

    fn stop(mut self) {
        nix::sys::signal::kill(nix::unistd::Pid::from_raw(self.proc.id() as i32), nix::sys::signal::Signal::SIGTERM)
            .unwrap();
        let _ = self.proc.wait();
        let _ = std::fs::remove_file(self.dir.join("bench.log"));
    }
}

/// The follower over the whole of `log`: start to the drain's answer.
async fn follow_once(log: &Path) -> f64 {
    let file = std::fs::File::open(log).unwrap();
    let classifier = Classifier::new(&Profile::Vllm.patterns()).unwrap();
    let (out, mut rx) = tokio::sync::mpsc::channel(vllm_warden::observe::logwatch::QUEUE);
    let mut tasks = vllm_warden::util::tasks::Tasks::default();
    let t = Instant::now();
    let f = LogFollower::start(&file, 0, 1, classifier, None, None, None, out, &mut tasks).unwrap();
    f.drain();
    let mut matter = 0;
    while let Some(Delivery::Lines { lines, .. }) = rx.recv().await {
        matter += lines.len();
    }
    let s = t.elapsed().as_secs_f64();
    assert!(matter > 0);
    s
}

/// The child's stamps: when it began to write, and when it was done.
fn read_stamps(path: &Path) -> (u128, u128) {
    let mut s = String::new();
    std::fs::File::open(path).unwrap().read_to_string(&mut s).unwrap();
    let mut it = s.split_whitespace().map(|v| v.parse().unwrap());
    (it.next().unwrap(), it.next().unwrap())
}

fn main() {
    if let Ok(spec) = std::env::var(CHILD) {
        child(&spec);
    }
    let mb = env_mb("LOG_BENCH_MB", 120);
    let burst = env_mb("LOG_BENCH_BURST_MB", 1024);
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let log = d.join("realistic.log");
    let size = realistic_log(&log, mb);
    let patterns = d.join("patterns.txt");
    grep_patterns(&patterns);
    let load = std::fs::read_to_string("/proc/loadavg").unwrap_or_default();
    println!(
        "vllm-warden log path, release build; load average {}",
        load.split(' ').take(3).collect::<Vec<_>>().join(" ")
    );
    println!("realistic log: {:.1} MB of real vLLM 0.32 lines", size as f64 / 1e6);

    // Follow + classify in-process: the follower's thread over the whole
    // file (read, split, strip, classify, tracebacks), journald off.
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
    let mut inproc = Vec::new();
    let mut grep_c = Vec::new();
    let mut grep_utf8 = Vec::new();
    for _ in 0..5 {
        grep_c.push(grep_seconds(&patterns, &log, "C"));
        grep_utf8.push(grep_seconds(&patterns, &log, "C.UTF-8"));
        inproc.push(rt.block_on(follow_once(&log)));
    }
    let (fs, gc, gu) = (median(inproc), median(grep_c), median(grep_utf8));
    let mbs = |s: f64| size as f64 / 1e6 / s;
    println!("{:<52} {:>8} {:>10} {:>22} {:>22}", "", "time", "MB/s", "grep LC_ALL=C", "grep LC_ALL=C.UTF-8");
    println!(
        "{:<52} {fs:7.3}s {:10.1} {gc:7.3}s {:6.1} MB/s {:3.2}x {gu:7.3}s {:6.1} MB/s {:3.2}x",
        "follow + classify, in-process (median of 5)",
        mbs(fs),
        mbs(gc),
        fs / gc,
        mbs(gu),
        fs / gu
    );

    // Follow + classify, end to end: first byte written -> READY=1.
    let (mut warden_s, mut tail_ms) = (Vec::new(), Vec::new());
    for i in 0..3 {
        let run = d.join(format!("e2e{i}"));
        std::fs::create_dir_all(&run).unwrap();
        let stamp = run.join("stamp");
        let w = Warden::start(&run, "vllm", &format!("file:{}:{}", log.display(), stamp.display()));
        let ready = w.wait_ready(Duration::from_secs(600));
        let (began, done) = read_stamps(&stamp);
        warden_s.push((ready - began) as f64 / 1e9);
        tail_ms.push((ready - done) as f64 / 1e6);
        w.stop();
    }
    let (ws, tail) = (median(warden_s), median(tail_ms));
    println!(
        "{:<52} {ws:7.3}s {:10.1} {:>22} {:>22}",
        "written at once -> READY=1, release binary (median of 3)",
        mbs(ws),
        format!("{:3.2}x", ws / gc),
        format!("{:3.2}x", ws / gu)
    );
    println!("{:<52} {tail:7.1} ms", "  of which: last byte written -> READY=1");
    if std::env::var("LOG_BENCH_ONLY").is_ok_and(|v| v == "throughput") {
        return;
    }

    // Peak memory through bursts.
    for (name, profile, spec) in [
        (format!("{burst} MB of short lines"), "vllm", format!("short:{burst}")),
        ("one 200 MB line".to_string(), "vllm", "long:200".to_string()),
        (format!("{burst} MB of random bytes"), "vllm", format!("random:{burst}")),
        ("1 M distinct process prefixes (profile none)".to_string(), "none", "prefixes:1000000".to_string()),
    ] {
        let run = d.join("burst");
        std::fs::create_dir_all(&run).unwrap();
        let t = Instant::now();
        let w = Warden::start(&run, profile, &spec);
        w.wait_ready(Duration::from_secs(1800));
        let secs = t.elapsed().as_secs_f64();
        println!("{:<52} peak RSS {:7.1} MB   ready line seen after {secs:6.1} s", name, w.peak_rss_mb());
        w.stop();
    }

    // CPU while a ready child writes 1 000 lines a second.
    let run = d.join("steady");
    std::fs::create_dir_all(&run).unwrap();
    let w = Warden::start(&run, "vllm", "steady:1000");
    w.wait_ready(Duration::from_secs(60));
    let (c0, t0) = (w.cpu_seconds(), Instant::now());
    std::thread::sleep(Duration::from_secs(10));
    let (c1, t1) = (w.cpu_seconds(), Instant::now());
    println!(
        "{:<52} {:6.2} % of one core",
        "warden CPU, child writing 1 000 lines/s (10 s)",
        (c1 - c0) / (t1 - t0).as_secs_f64() * 100.0
    );
    w.stop();
}
