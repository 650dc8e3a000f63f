//! Latency of the two paths that matter most, over 1000 real starts of the
//! fake vLLM under the release binary:
//!
//! - readiness line written → `READY=1` arriving on the notify socket (the
//!   kernel's stamp of the datagram), on a fresh warden and on one that has
//!   been running for minutes, its server logging steadily (1000 request
//!   lines a second for 3 minutes) before the measured starts;
//! - the child's exit → the next child's first instruction, with zero backoff.
//!
//! Each is reported with a baseline measured in the same run on the same
//! machine: for the first, what readiness cannot do without, a bare inotify
//! round trip (a line appended to a file → a blocked read of an inotify
//! watch returns, on another thread, as the warden's reader waits) plus
//! a bare `GET /health` with the warden's readiness client (asked on a
//! runtime's own thread, as the warden asks it), to a server up for a while and,
//! as the warden meets it, to a server that has just written its ready line
//! (inotify wake, read, `GET`: readiness with nothing of the warden's); for
//! the second, a bare spawn of the same binary (spawn → its first
//! instruction), and a bare respawn loop (the child's exit → waited for,
//! which includes the kernel's reap → the same command spawned → its first
//! instruction).
//!
//! Run: `cargo build --release && cargo bench --bench latency` (the build
//! makes the simulated vLLM, a package of its own, beside the warden); with
//! `LATENCY_BENCH_KERNEL_MESSAGES=off`, without the GPU fault watcher (its
//! command is started once per warden, and reads the kernel's messages
//! beside the warden); with `LATENCY_BENCH_REPORTS=off`, without the failure
//! report that every failed run gets before its stop (`reports.keep = 0`);
//! `LATENCY_BENCH_STARTS=N` for N starts instead of 1000 (a p99 over a
//! hundred is the second slowest, which on a shared machine is whatever
//! else ran then); `LATENCY_BENCH_ROUNDS=R` for the fresh case in R rounds
//! instead of 5, each a fresh warden's N/R starts followed by N/R samples
//! of the fresh-server baseline, so that both meet the same load of the
//! machine; `LATENCY_BENCH_WARDEN=PATH` measures the warden at PATH (and
//! the simulator beside it) instead of this build's;
//! `LATENCY_BENCH_SAMPLES=FILE` appends each measured start's two
//! stamps to FILE, for a trace of the same run; `LATENCY_BENCH_AGE=S` for a
//! long-running warden that logged for S seconds instead of 180 (0: that
//! case is left out), `LATENCY_BENCH_LOG_RATE=N` for N lines a second while
//! it did; `LATENCY_BENCH_LOAD=D` for a simulated load of D instead of none
//! (the last run's report is then written before the next ready line, and
//! the machine idles meanwhile). The fresh-server baseline is measured again
//! after the long-running case, and that case compared with it.

#[path = "../tests/support/sim.rs"]
mod sim;

use std::io::Write;
use std::os::unix::net::UnixDatagram;
use std::process::{Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

/// How many starts each figure is over: `LATENCY_BENCH_STARTS`, else 1000.
static STARTS: std::sync::LazyLock<usize> = std::sync::LazyLock::new(|| {
    std::env::var("LATENCY_BENCH_STARTS").ok().and_then(|n| n.parse().ok()).unwrap_or(1000)
});

/// In how many rounds the fresh warden and its baseline take turns:
/// `LATENCY_BENCH_ROUNDS`, else 5.
static ROUNDS: std::sync::LazyLock<usize> = std::sync::LazyLock::new(|| {
    std::env::var("LATENCY_BENCH_ROUNDS").ok().and_then(|n| n.parse().ok()).unwrap_or(5).clamp(1, *STARTS)
});

fn now_ns() -> u128 {
    SystemTime::now().duration_since(UNIX_EPOCH).unwrap().as_nanos()
}

fn stats(name: &str, mut xs: Vec<f64>) -> (f64, f64) {
    xs.sort_by(|a, b| a.partial_cmp(b).unwrap());
    let med = xs[xs.len() / 2];
    let p99 = xs[((xs.len() as f64 * 0.99).ceil() as usize).min(xs.len()) - 1];
    println!("{name:<44} n={:<4} median {med:8.3} ms   p99 {p99:8.3} ms", xs.len());
    (med, p99)
}

/// A line appended -> a blocking read of an inotify watch on the file
/// returns: what the warden's reader waits on, bare.
fn inotify_baseline(dir: &std::path::Path) -> Vec<f64> {
    use nix::sys::inotify::{AddWatchFlags, InitFlags, Inotify};
    let path = dir.join("baseline.log");
    let mut f = std::fs::File::create(&path).unwrap();
    let inotify = Inotify::init(InitFlags::IN_CLOEXEC).unwrap();
    inotify.add_watch(&path, AddWatchFlags::IN_MODIFY).unwrap();
    let (tx, rx) = mpsc::channel();
    let (go_tx, go_rx) = mpsc::channel::<()>();
    std::thread::spawn(move || {
        while go_rx.recv().is_ok() {
            inotify.read_events().unwrap();
            let _ = tx.send(Instant::now());
        }
    });
    let mut out = Vec::new();
    for _ in 0..*STARTS {
        go_tx.send(()).unwrap();
        // Let the reader block in its read first.
        std::thread::sleep(Duration::from_millis(2));
        let t = Instant::now();
        writeln!(f, "INFO:     Application startup complete.").unwrap();
        let seen = rx.recv_timeout(Duration::from_secs(5)).unwrap();
        out.push((seen - t).as_secs_f64() * 1e3);
    }
    out
}

/// One readiness check, as the warden's loop makes it.
fn ready_get(rt: &tokio::runtime::Runtime, url: &str) -> bool {
    rt.block_on(vllm_warden::observe::health::http_ok_async(url, Duration::from_secs(5)))
}

/// A bare readiness check: `GET /health` on the fake, with the warden's client.
fn http_baseline(sim: &str, rt: &tokio::runtime::Runtime) -> Vec<f64> {
    let port = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
    let mut fake = Command::new(sim)
        .args(["--port", &port.to_string(), "--shards", "1", "--shard-time", "0s"])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let url = format!("http://127.0.0.1:{port}/health");
    let deadline = Instant::now() + Duration::from_secs(30);
    while !vllm_warden::observe::health::http_ok(&url, Duration::from_secs(1)) {
        assert!(Instant::now() < deadline, "the fake never answered");
        std::thread::sleep(Duration::from_millis(10));
    }
    let out = (0..*STARTS)
        .map(|_| {
            let t = Instant::now();
            assert!(ready_get(rt, &url));
            t.elapsed().as_secs_f64() * 1e3
        })
        .collect();
    let _ = fake.kill();
    let _ = fake.wait();
    out
}

/// What readiness cannot do without, against the server the warden meets:
/// a fresh one. Each time a new fake writes its log to a file; a thread
/// blocked on an inotify watch wakes, reads the file, finds the ready line
/// and sends one `GET /health` to that fake with the warden's client:
/// ready line written (the fake's stamp) → the answer.
fn fresh_baseline(sim: &str, dir: &std::path::Path, rt: &tokio::runtime::Runtime, n: usize) -> Vec<f64> {
    use nix::sys::inotify::{AddWatchFlags, InitFlags, Inotify};
    use std::io::Read;
    let (log, stamp) = (dir.join("fresh.log"), dir.join("fresh.stamps"));
    let mut out = Vec::new();
    for _ in 0..n {
        let _ = std::fs::remove_file(&stamp);
        let file = std::fs::File::create(&log).unwrap();
        let inotify = Inotify::init(InitFlags::IN_CLOEXEC).unwrap();
        inotify.add_watch(&log, AddWatchFlags::IN_MODIFY).unwrap();
        let port = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
        let mut fake = Command::new(sim)
            .args(["--port", &port.to_string(), "--shards", "1", "--shard-time", "0s", "--stamp-file"])
            .arg(&stamp)
            .stdout(file.try_clone().unwrap())
            .stderr(file)
            .spawn()
            .unwrap();
        let url = format!("http://127.0.0.1:{port}/health");
        let mut reader = std::fs::File::open(&log).unwrap();
        let mut text = String::new();
        let answered = loop {
            inotify.read_events().unwrap();
            reader.read_to_string(&mut text).unwrap();
            if text.contains("Application startup complete") {
                assert!(ready_get(rt, &url));
                break now_ns();
            }
        };
        let stamps = std::fs::read_to_string(&stamp).unwrap();
        let ready: u128 = stamps.lines().find_map(|l| l.strip_prefix("ready ")).unwrap().trim().parse().unwrap();
        out.push((answered - ready) as f64 / 1e6);
        let _ = fake.kill();
        let _ = fake.wait();
    }
    out
}

/// The fake's stamps of one kind (`start `, `ready `, `exit `), in order.
fn stamps_of(text: &str, kind: &str) -> Vec<u128> {
    text.lines().filter_map(|l| l.strip_prefix(kind)).map(|v| v.trim().parse().unwrap()).collect()
}

/// The fake with one shard loaded at once and `args`, stamping into
/// `stamp`, run to its end: its exit code.
fn run_sim(sim: &str, args: &[&str], stamp: &std::path::Path) -> Option<i32> {
    Command::new(sim)
        .args(["--shards", "1", "--shard-time", "0s"])
        .args(args)
        .arg("--stamp-file")
        .arg(stamp)
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .unwrap()
        .code()
}

fn spawn_baseline(sim: &str, dir: &std::path::Path) -> Vec<f64> {
    let stamp = dir.join("spawn.stamps");
    let mut out = Vec::new();
    for _ in 0..*STARTS {
        let _ = std::fs::remove_file(&stamp);
        let t = now_ns();
        // --fail exit1 returns at once after its first lines; only the start stamp matters.
        assert_eq!(run_sim(sim, &["--port", "0", "--fail", "exit1"], &stamp), Some(1));
        let text = std::fs::read_to_string(&stamp).unwrap();
        let started: u128 = text.lines().next().unwrap().split(' ').nth(1).unwrap().parse().unwrap();
        out.push((started - t) as f64 / 1e6);
    }
    out
}

/// The least any supervisor can do between a child's exit and the next
/// child: a loop that waits for the child (the kernel's reap included) and
/// spawns the same command again, nothing else. The child serves HTTP with
/// the same threads as in the warden's runs and exits once ready.
fn respawn_baseline(sim: &str, dir: &std::path::Path) -> Vec<f64> {
    let stamp = dir.join("respawn.stamps");
    let _ = std::fs::remove_file(&stamp);
    let port = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
    for _ in 0..=*STARTS {
        assert_eq!(run_sim(sim, &["--port", &port.to_string(), "--exit-after-ready", "0"], &stamp), Some(0));
    }
    let text = std::fs::read_to_string(&stamp).unwrap();
    let (starts, exits) = (stamps_of(&text, "start "), stamps_of(&text, "exit "));
    exits.iter().zip(starts.iter().skip(1)).map(|(e, s)| (*s as f64 - *e as f64) / 1e6).collect()
}

/// `LATENCY_BENCH_KERNEL_MESSAGES=off` measures without the GPU fault
/// watcher.
fn kernel_messages() -> &'static str {
    match std::env::var("LATENCY_BENCH_KERNEL_MESSAGES").as_deref() {
        Ok("off") => "[health]\nkernel-messages = []\n",
        _ => "",
    }
}

/// `LATENCY_BENCH_REPORTS=off` measures without failure reports, which
/// are written between a run's failure and its stop.
fn reports() -> &'static str {
    match std::env::var("LATENCY_BENCH_REPORTS").as_deref() {
        Ok("off") => "[reports]\nkeep = 0\n",
        _ => "",
    }
}

/// The next datagram on `sock` into `buf`: its length, and when it arrived
/// on the socket (the kernel's stamp, `SO_TIMESTAMPNS`, on the sim's
/// clock), not when this thread got round to reading it: the warden's
/// latency, without the receiver's own wake-up.
fn recv_stamped(sock: &UnixDatagram, buf: &mut [u8]) -> Option<(usize, u128)> {
    use std::os::fd::AsRawFd;
    let fd = sock.as_raw_fd();
    let on: libc::c_int = 1;
    let size = std::mem::size_of::<libc::c_int>() as libc::socklen_t;
    // SAFETY: setsockopt reads one int; recvmsg writes into the buffers
    // described by `msg`, which outlive the call; the control messages are
    // walked with the kernel's own macros within `control`.
    unsafe {
        libc::setsockopt(fd, libc::SOL_SOCKET, libc::SO_TIMESTAMPNS, (&on as *const libc::c_int).cast(), size);
        let mut control = [0u64; 16];
        let mut iov = libc::iovec { iov_base: buf.as_mut_ptr().cast(), iov_len: buf.len() };
        let mut msg: libc::msghdr = std::mem::zeroed();
        msg.msg_iov = &mut iov;
        msg.msg_iovlen = 1;
        msg.msg_control = control.as_mut_ptr().cast();
        msg.msg_controllen = std::mem::size_of_val(&control);
        let n = libc::recvmsg(fd, &mut msg, 0);
        if n < 0 {
            return None;
        }
        let mut stamp = now_ns();
        let mut c = libc::CMSG_FIRSTHDR(&msg);
        while !c.is_null() {
            if (*c).cmsg_level == libc::SOL_SOCKET && (*c).cmsg_type == libc::SCM_TIMESTAMPNS {
                let ts = std::ptr::read_unaligned(libc::CMSG_DATA(c).cast::<libc::timespec>());
                stamp = ts.tv_sec as u128 * 1_000_000_000 + ts.tv_nsec as u128;
            }
            c = libc::CMSG_NXTHDR(&msg, c);
        }
        Some((n as usize, stamp))
    }
}

/// How long the long-running warden's server logs before the measured
/// starts: `LATENCY_BENCH_AGE` seconds, else 180; 0 leaves that case out.
static AGE: std::sync::LazyLock<Duration> = std::sync::LazyLock::new(|| {
    Duration::from_secs(std::env::var("LATENCY_BENCH_AGE").ok().and_then(|n| n.parse().ok()).unwrap_or(180))
});

/// How many lines a second the long-running warden's server writes while
/// it ages: `LATENCY_BENCH_LOG_RATE`, else 1000.
static LOG_RATE: std::sync::LazyLock<u64> = std::sync::LazyLock::new(|| {
    std::env::var("LATENCY_BENCH_LOG_RATE").ok().and_then(|n| n.parse().ok()).unwrap_or(1000).max(1)
});

/// What one warden's run measured: each start's ready line → `READY=1`,
/// and each exit → the next child's first instruction, in ms.
struct Measured {
    ready: Vec<f64>,
    respawn: Vec<f64>,
}

/// Run the release warden on the simulated vLLM for `n` measured
/// starts (each server ready, then its engine dies 20 ms after the first
/// `GET /health`, then a restart with no backoff), in the folder `d`.
/// With `age`, the first server logs a request line every `1/LOG_RATE`
/// for that long before its engine dies, and the starts after it are
/// measured: a warden that has been running and logging for minutes.
fn run_warden(exe: &str, sim: &str, d: &std::path::Path, age: Option<Duration>, n: usize) -> Measured {
    std::fs::create_dir_all(d).unwrap();
    let port = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
    let stamps = d.join("stamps");
    let aging = d.join("aging");
    let steady = match age {
        Some(_) => {
            std::fs::write(&aging, "").unwrap();
            let every = Duration::from_nanos(1_000_000_000 / *LOG_RATE);
            format!(r#", "--log-while", "{}", "--log-every", "{}""#, aging.display(), humantime::format_duration(every))
        }
        None => String::new(),
    };
    // The status file lives in /run, a tmpfs, under systemd: the same here.
    let run = tempfile::tempdir_in("/dev/shm").unwrap();
    let cfg = d.join("bench.toml");
    std::fs::write(
        &cfg,
        format!(
            r#"name = "bench"
[child]
command = ["{sim}", "--port", "{port}", "--shards", "1", "--shard-time", "{load}",
           "--fail", "engine-death", "--fail-after", "20ms", "--stamp-file", "{stamps}"{steady}]
log-file = "{d}/bench.log"
[restart]
initial-delay = "0s"
max-attempts = 0
[status]
file = "{run}/status.json"
# The golden check (on by default) asks the server its prompts between the
# HTTP check and READY=1: the server's time, not the warden's; off here.
[golden]
enabled = false
{kernel}{reports}"#,
            kernel = kernel_messages(),
            reports = reports(),
            load = std::env::var("LATENCY_BENCH_LOAD").unwrap_or_else(|_| "0s".into()),
            stamps = stamps.display(),
            d = d.display(),
            run = run.path().display()
        ),
    )
    .unwrap();
    let sock_path = d.join("notify.sock");
    let sock = UnixDatagram::bind(&sock_path).unwrap();
    let (tx, rx) = mpsc::channel::<u128>();
    std::thread::spawn(move || {
        let mut buf = vec![0u8; 65536];
        while let Some((n, t)) = recv_stamped(&sock, &mut buf) {
            if String::from_utf8_lossy(&buf[..n]).lines().any(|l| l == "READY=1") && tx.send(t).is_err() {
                return;
            }
        }
    });
    let began = Instant::now();
    let mut warden = Command::new(exe)
        .args(["run", "-c"])
        .arg(&cfg)
        .env("NOTIFY_SOCKET", &sock_path)
        .env("STATE_DIRECTORY", d.join("state"))
        .env("RUST_LOG", "warn")
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let mut ready_at = Vec::new();
    // The aging server's readiness is not measured.
    let skip = usize::from(age.is_some());
    if let Some(age) = age {
        ready_at.push(rx.recv_timeout(Duration::from_secs(60)).expect("READY=1"));
        eprintln!(
            "the long-running warden's server logs {} lines/s for {}",
            *LOG_RATE,
            humantime::format_duration(age)
        );
        // The warden runs and follows the log meanwhile: there is no
        // condition to wait for, only the time to let pass.
        std::thread::sleep(age);
        std::fs::remove_file(&aging).unwrap();
    }
    for _ in 0..n + 1 {
        ready_at.push(rx.recv_timeout(Duration::from_secs(60)).expect("READY=1"));
    }
    if age.is_some() {
        let log = std::fs::metadata(d.join("bench.log")).map(|m| m.len()).unwrap_or(0);
        eprintln!(
            "the long-running warden was measured after {} of running; its log: {} MB",
            humantime::format_duration(Duration::from_secs(began.elapsed().as_secs())),
            log >> 20
        );
    }
    nix::sys::signal::kill(nix::unistd::Pid::from_raw(warden.id() as i32), nix::sys::signal::Signal::SIGTERM).unwrap();
    assert_eq!(warden.wait().unwrap().code(), Some(0));

    let text = std::fs::read_to_string(&stamps).unwrap();
    let (starts, readies, exits) = (stamps_of(&text, "start "), stamps_of(&text, "ready "), stamps_of(&text, "exit "));
    let pairs: Vec<(u128, u128)> = readies.iter().zip(&ready_at).skip(skip).take(n).map(|(w, r)| (*w, *r)).collect();
    if let Ok(file) = std::env::var("LATENCY_BENCH_SAMPLES") {
        // Each start's two stamps (ns, the realtime clock), for lining them
        // up with a trace of the same run.
        let mut out = std::fs::OpenOptions::new().create(true).append(true).open(file).unwrap();
        for (w, r) in &pairs {
            writeln!(out, "{} {w} {r}", d.display()).unwrap();
        }
    }
    let ready = pairs.iter().map(|(w, r)| (*r as f64 - *w as f64) / 1e6).collect();
    let respawn = exits
        .iter()
        .zip(starts.iter().skip(1))
        .skip(skip)
        .take(n)
        .map(|(e, s)| (*s as f64 - *e as f64) / 1e6)
        .collect();
    Measured { ready, respawn }
}

fn main() {
    // `LATENCY_BENCH_WARDEN=PATH` measures another build of the warden
    // (its simulator beside it), for comparing two builds in turns.
    let exe = &std::env::var("LATENCY_BENCH_WARDEN").unwrap_or_else(|_| env!("CARGO_BIN_EXE_vllm-warden").into());
    let sim = &sim::beside(exe).display().to_string();
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();

    // The fresh warden and the fresh-server baseline take turns, a fresh
    // warden each round.
    let (mut ready, mut respawn, mut fresh_server) = (Vec::new(), Vec::new(), Vec::new());
    for round in 0..*ROUNDS {
        let n = *STARTS / *ROUNDS + usize::from(round < *STARTS % *ROUNDS);
        let fresh = run_warden(exe, sim, &d.join(format!("fresh{round}")), None, n);
        ready.extend(fresh.ready);
        respawn.extend(fresh.respawn);
        fresh_server.extend(fresh_baseline(sim, d, &rt, n));
    }
    println!("vllm-warden latency, {} starts ({} fresh wardens), release build", *STARTS, *ROUNDS);
    let (rm, rp) = stats("ready line written -> READY=1 received", ready);
    let (bm, bp) = stats("baseline: line appended -> inotify event", inotify_baseline(d));
    let (hm, hp) = stats("baseline: GET /health round trip", http_baseline(sim, &rt));
    let (fm, fp) = stats("baseline: inotify + GET, fresh server", fresh_server);
    let (cm, cp) = stats("child exit -> next child running (0 backoff)", respawn);
    let (sm, sp) = stats("baseline: spawn -> child running", spawn_baseline(sim, d));
    let (lm, lp) = stats("baseline: exit -> wait + spawn -> running", respawn_baseline(sim, d));
    let long = (!AGE.is_zero()).then(|| {
        let measured = run_warden(exe, sim, &d.join("long"), Some(*AGE), *STARTS);
        let name = format!("long-running ({} s, {}/s): ready -> READY=1", AGE.as_secs(), *LOG_RATE);
        let ready = stats(&name, measured.ready);
        let baseline = stats("baseline again: inotify + GET, fresh server", fresh_baseline(sim, d, &rt, *STARTS));
        let respawn = stats("long-running: child exit -> next child running", measured.respawn);
        (ready, baseline, respawn)
    });
    println!("ratio ready/(inotify + GET): median {:.1}x  p99 {:.1}x", rm / (bm + hm), rp / (bp + hp));
    println!("ratio ready/(inotify + GET, fresh server): median {:.1}x  p99 {:.1}x", rm / fm, rp / fp);
    if let Some(((lrm, lrp), (lfm, lfp), _)) = long {
        println!(
            "ratio long-running ready/(inotify + GET, fresh server, measured after it): median {:.1}x  p99 {:.1}x",
            lrm / lfm,
            lrp / lfp
        );
        println!("ratio long-running ready/fresh ready: median {:.1}x  p99 {:.1}x", lrm / rm, lrp / rp);
    }
    println!("ratio respawn/baseline: median {:.1}x  p99 {:.1}x", cm / sm, cp / sp);
    println!("ratio respawn/(bare wait + spawn loop): median {:.1}x  p99 {:.1}x", cm / lm, cp / lp);
}
