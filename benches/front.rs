//! The front door against direct access to the same simulated vLLM, in the
//! same run, under the release binary:
//!
//! - latency and throughput: 16 client threads, each on one kept-alive
//!   connection, sending `GET /v1/models` (answered by the simulator at
//!   once, so that what is measured is the path, not the model) one after
//!   the other; the direct and the front door rounds take turns
//!   (`FRONT_BENCH_ROUNDS`, 4 each of `FRONT_BENCH_REQUESTS` = 1000
//!   requests a client), so that both meet the same load of the machine.
//!   Reported: the added latency at the median and the 99th percentile,
//!   the ratio of the 99th percentiles, and the ratio of the throughputs.
//!   Then the same with completions of one token (the simulator's 5 ms):
//!   the shortest answer a model gives. For both, each party's CPU time
//!   per request (the clients, the simulator, the warden) and the
//!   throughput ratio the CPU alone allows.
//! - server-sent events: a streamed completion of 300 tokens, one every
//!   5 ms; each event carries the simulator's stamp of its write
//!   (`sent_ns`), and its delay is its arrival at the client less that
//!   stamp. Reported: the delay's 99th percentile, direct and through the
//!   front door.
//! - memory: the warden's resident memory (`VmRSS`) while its engine
//!   loads, before and with 1000 requests held (1000 client connections,
//!   each one `POST /v1/completions`).
//!
//! Run: `cargo build --release && cargo bench --bench front` (the build
//! makes the simulator, a package of its own, beside the warden).

#[path = "../tests/support/sim.rs"]
mod sim;

use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpStream;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

const CLIENTS: usize = 16;

fn env_or(name: &str, default: usize) -> usize {
    std::env::var(name).ok().and_then(|n| n.parse().ok()).unwrap_or(default)
}

fn warden_exe() -> PathBuf {
    let me = std::env::current_exe().unwrap();
    // target/release/deps/front-… → target/release/vllm-warden
    me.parent().unwrap().parent().unwrap().join("vllm-warden")
}

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port()
}

/// A warden on a config of the simulator (profile `none`) with a front
/// door on `front` and its endpoint on `server`.
struct Warden {
    child: Child,
    _dir: tempfile::TempDir,
}

impl Warden {
    fn start(port: u16, front: u16, server: u16, sim_args: &[&str], more: &str) -> Warden {
        let dir = tempfile::tempdir().unwrap();
        let d = dir.path();
        let simulator = sim::beside(warden_exe().to_str().unwrap());
        let mut argv = vec![simulator.display().to_string(), "--port".into(), port.to_string()];
        argv.extend(sim_args.iter().map(|s| s.to_string()));
        let argv: Vec<String> = argv.iter().map(|a| format!("{a:?}")).collect();
        let cfg = format!(
            "name = \"b\"\nprofile = \"none\"\n[child]\ncommand = [{}]\nlog-file = \"{d}/b.log\"\n\
             [status]\nfile = \"{d}/status.json\"\n[ready]\nlog = [\"Application startup complete\"]\n\
             [golden]\nenabled = false\n[server]\nlisten = \"127.0.0.1:{server}\"\n\
             [front]\nlisten = \"127.0.0.1:{front}\"\n{more}",
            argv.join(", "),
            d = d.display()
        );
        std::fs::write(d.join("b.toml"), cfg).unwrap();
        std::fs::create_dir_all(d.join("state")).unwrap();
        let mut cmd = Command::new(warden_exe());
        cmd.arg("run")
            .arg("-c")
            .arg(d.join("b.toml"))
            .env("STATE_DIRECTORY", d.join("state"))
            .env("RUNTIME_DIRECTORY", d.join("run"))
            .env_remove("NOTIFY_SOCKET")
            .env_remove("JOURNAL_STREAM")
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(d.join("warden.stderr")).unwrap());
        {
            use std::os::unix::process::CommandExt;
            // SAFETY: only setrlimit between fork and exec.
            unsafe {
                cmd.pre_exec(|| {
                    let mut lim = libc::rlimit { rlim_cur: 0, rlim_max: 0 };
                    libc::getrlimit(libc::RLIMIT_NOFILE, &mut lim);
                    lim.rlim_cur = lim.rlim_max.min(65536);
                    libc::setrlimit(libc::RLIMIT_NOFILE, &lim);
                    Ok(())
                });
            }
        }
        Warden { child: cmd.spawn().unwrap(), _dir: dir }
    }

    /// The simulator: the warden's one child (profile `none`).
    fn sim_pid(&self) -> u32 {
        // A child is listed under the thread that forked it.
        let tasks = std::fs::read_dir(format!("/proc/{}/task", self.child.id())).unwrap();
        tasks
            .filter_map(|t| std::fs::read_to_string(t.ok()?.path().join("children")).ok())
            .find_map(|c| c.split_whitespace().next()?.parse().ok())
            .expect("the simulator runs")
    }

    fn rss_kib(&self) -> u64 {
        let s = std::fs::read_to_string(format!("/proc/{}/status", self.child.id())).unwrap();
        s.lines().find_map(|l| l.strip_prefix("VmRSS:")?.split_whitespace().next()?.parse().ok()).unwrap()
    }
}

impl Drop for Warden {
    fn drop(&mut self) {
        let pid = nix::unistd::Pid::from_raw(self.child.id() as i32);
        let _ = nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGTERM);
        let _ = self.child.wait();
    }
}

/// One kept-alive client connection, reading answers by their length.
struct Conn {
    r: BufReader<TcpStream>,
}

impl Conn {
    fn open(port: u16) -> Conn {
        let deadline = Instant::now() + Duration::from_secs(60);
        loop {
            match TcpStream::connect(("127.0.0.1", port)) {
                Ok(s) => {
                    s.set_nodelay(true).unwrap();
                    s.set_read_timeout(Some(Duration::from_secs(120))).unwrap();
                    return Conn { r: BufReader::new(s) };
                }
                Err(e) if Instant::now() < deadline => {
                    let _ = e;
                    std::thread::sleep(Duration::from_millis(20));
                }
                Err(e) => panic!("127.0.0.1:{port}: {e}"),
            }
        }
    }

    fn send(&mut self, text: &str) {
        self.r.get_mut().write_all(text.as_bytes()).unwrap();
    }

    /// The status and body of the next answer (`Content-Length` bodies).
    fn answer(&mut self) -> (u16, Vec<u8>) {
        let mut line = String::new();
        self.r.read_line(&mut line).unwrap();
        let status: u16 = line.split(' ').nth(1).and_then(|s| s.parse().ok()).unwrap_or_else(|| panic!("{line:?}"));
        let mut len = 0;
        loop {
            let mut h = String::new();
            self.r.read_line(&mut h).unwrap();
            if h == "\r\n" || h.is_empty() {
                break;
            }
            if let Some((k, v)) = h.split_once(':')
                && k.eq_ignore_ascii_case("content-length")
            {
                len = v.trim().parse().unwrap();
            }
        }
        let mut body = vec![0; len];
        self.r.read_exact(&mut body).unwrap();
        (status, body)
    }

    fn get(&mut self, path: &str) -> u16 {
        self.send(&format!("GET {path} HTTP/1.1\r\nHost: b\r\n\r\n"));
        self.answer().0
    }
}

fn percentile(xs: &mut [f64], p: f64) -> f64 {
    xs.sort_by(|a, b| a.partial_cmp(b).unwrap());
    xs[((xs.len() as f64 * p).ceil() as usize).clamp(1, xs.len()) - 1]
}

/// What a client sends: `GET /v1/models` (answered at once: the path is
/// measured) or a completion of one token (answered after the simulator's
/// `--token-time`: the shortest answer a model gives).
#[derive(Clone, Copy)]
enum Ask {
    Models,
    OneToken,
}

impl Ask {
    fn once(self, c: &mut Conn) -> u16 {
        match self {
            Ask::Models => c.get("/v1/models"),
            Ask::OneToken => {
                let body = r#"{"prompt":"p","max_tokens":1}"#;
                c.send(&format!(
                    "POST /v1/completions HTTP/1.1\r\nHost: b\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
                    body.len()
                ));
                c.answer().0
            }
        }
    }
}

/// One round: 16 clients, `n` requests each; the latencies (ms) and the
/// throughput (requests a second).
fn round(port: u16, n: usize, ask: Ask) -> (Vec<f64>, f64) {
    let barrier = std::sync::Arc::new(std::sync::Barrier::new(CLIENTS + 1));
    let clients: Vec<_> = (0..CLIENTS)
        .map(|_| {
            let barrier = barrier.clone();
            std::thread::spawn(move || {
                let mut c = Conn::open(port);
                assert_eq!(ask.once(&mut c), 200);
                barrier.wait();
                let mut took = Vec::with_capacity(n);
                for _ in 0..n {
                    let t = Instant::now();
                    assert_eq!(ask.once(&mut c), 200);
                    took.push(t.elapsed().as_secs_f64() * 1000.0);
                }
                took
            })
        })
        .collect();
    barrier.wait();
    let began = Instant::now();
    let mut all = Vec::new();
    for c in clients {
        all.extend(c.join().unwrap());
    }
    let rate = all.len() as f64 / began.elapsed().as_secs_f64();
    (all, rate)
}

/// The CPU time (user and system) a process has used, in seconds.
fn cpu_of(pid: u32) -> f64 {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap();
    // The fields after the command's closing parenthesis: utime is the
    // 14th field of the line, stime the 15th.
    let rest = &stat[stat.rfind(')').unwrap() + 2..];
    let f: Vec<&str> = rest.split_whitespace().collect();
    let ticks: f64 = f[11].parse::<f64>().unwrap() + f[12].parse::<f64>().unwrap();
    // SAFETY: sysconf reads a constant of the system.
    let hz = unsafe { libc::sysconf(libc::_SC_CLK_TCK) } as f64;
    ticks / hz
}

/// The CPU time of the three parties: this process (the clients), the
/// simulator and the warden.
#[derive(Clone, Copy, Default)]
struct Cpu {
    clients: f64,
    sim: f64,
    warden: f64,
}

impl Cpu {
    fn now(w: &Warden) -> Cpu {
        Cpu { clients: cpu_of(std::process::id()), sim: cpu_of(w.sim_pid()), warden: cpu_of(w.child.id()) }
    }

    fn since(self, before: Cpu) -> Cpu {
        Cpu { clients: self.clients - before.clients, sim: self.sim - before.sim, warden: self.warden - before.warden }
    }

    fn add(&mut self, o: Cpu) {
        self.clients += o.clients;
        self.sim += o.sim;
        self.warden += o.warden;
    }

    /// Microseconds of each party's CPU per request.
    fn per(self, requests: usize) -> (f64, f64, f64) {
        let us = |s: f64| s * 1e6 / requests as f64;
        (us(self.clients), us(self.sim), us(self.warden))
    }
}

/// Rounds taking turns, direct and through the front door: the latencies,
/// the mean throughputs, the CPU each party used, and how many requests
/// each side sent.
struct Turns {
    direct: Vec<f64>,
    via: Vec<f64>,
    direct_rate: f64,
    via_rate: f64,
    direct_cpu: Cpu,
    via_cpu: Cpu,
    requests: usize,
}

fn turns(w: &Warden, port: u16, front: u16, rounds: usize, n: usize, ask: Ask) -> Turns {
    let mut t = Turns {
        direct: Vec::new(),
        via: Vec::new(),
        direct_rate: 0.0,
        via_rate: 0.0,
        direct_cpu: Cpu::default(),
        via_cpu: Cpu::default(),
        requests: rounds * n * CLIENTS,
    };
    for _ in 0..rounds {
        let before = Cpu::now(w);
        let (l, r) = round(port, n, ask);
        t.direct_cpu.add(Cpu::now(w).since(before));
        t.direct.extend(l);
        t.direct_rate += r / rounds as f64;
        let before = Cpu::now(w);
        let (l, r) = round(front, n, ask);
        t.via_cpu.add(Cpu::now(w).since(before));
        t.via.extend(l);
        t.via_rate += r / rounds as f64;
    }
    t
}

impl Turns {
    fn report(&mut self, what: &str) {
        let (d50, d99) = (percentile(&mut self.direct, 0.5), percentile(&mut self.direct, 0.99));
        let (f50, f99) = (percentile(&mut self.via, 0.5), percentile(&mut self.via, 0.99));
        println!("{what} direct        p50 {d50:7.3} ms  p99 {d99:7.3} ms  {:8.0} req/s", self.direct_rate);
        println!("{what} front door    p50 {f50:7.3} ms  p99 {f99:7.3} ms  {:8.0} req/s", self.via_rate);
        println!(
            "added: p50 +{:.3} ms (goal ≤ 0.2), p99 ×{:.2} (goal ≤ 1.5), throughput ×{:.2} (goal ≥ 0.8)",
            f50 - d50,
            f99 / d99,
            self.via_rate / self.direct_rate
        );
        let (dc, ds, _) = self.direct_cpu.per(self.requests);
        let (fc, fs, fw) = self.via_cpu.per(self.requests);
        // Where the CPU bounds both (every party busy on the same cores),
        // the throughputs go as the inverse of the CPU a request costs.
        println!(
            "CPU per request: direct clients {dc:.1} µs + simulator {ds:.1} µs; front door clients {fc:.1} µs + simulator {fs:.1} µs + warden {fw:.1} µs; \
             bound by CPU alone the ratio would be ×{:.2}",
            (dc + ds) / (fc + fs + fw)
        );
    }
}

/// A streamed completion's events: each one's delay, arrival less the
/// simulator's stamp of its write (ms).
fn sse_delays(port: u16, prompt: &str) -> Vec<f64> {
    let body = format!(r#"{{"prompt":"{prompt}","max_tokens":300,"stream":true}}"#);
    let mut c = Conn::open(port);
    c.send(&format!(
        "POST /v1/completions HTTP/1.1\r\nHost: b\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
        body.len()
    ));
    let mut delays = Vec::new();
    let mut line = String::new();
    while c.r.read_line(&mut line).unwrap_or(0) > 0 {
        let now = SystemTime::now().duration_since(UNIX_EPOCH).unwrap().as_nanos() as f64;
        if let Some(data) = line.trim_end().strip_prefix("data: ") {
            if data == "[DONE]" {
                break;
            }
            let v: serde_json::Value = serde_json::from_str(data).unwrap();
            delays.push((now - v["sent_ns"].as_u64().unwrap() as f64) / 1e6);
        }
        line.clear();
    }
    delays
}

fn main() {
    let rounds = env_or("FRONT_BENCH_ROUNDS", 4);
    let n = env_or("FRONT_BENCH_REQUESTS", 1000);
    raise_nofile();
    let (port, front, server) = (free_port(), free_port(), free_port());
    let w = Warden::start(port, front, server, &["--token-time", "5ms"], "");
    // Held until the engine serves: answered once it is ready.
    assert_eq!(Conn::open(front).get("/v1/models"), 200);
    println!("front door bench: {CLIENTS} kept-alive clients, {rounds} rounds of {n} requests each, taking turns");
    turns(&w, port, front, rounds, n, Ask::Models).report("GET /v1/models");
    // Against answers that take what a model's shortest does (one token
    // at the simulator's 5 ms): what a client of a model meets.
    let n = (n / 10).max(20);
    println!("{CLIENTS} clients, {rounds} rounds of {n} completions of one token (5 ms) each, taking turns");
    turns(&w, port, front, rounds, n, Ask::OneToken).report("POST 1-token completion");
    let (mut sd, mut sf) = (Vec::new(), Vec::new());
    for i in 0..3 {
        sd.extend(sse_delays(port, &format!("d{i}")));
        sf.extend(sse_delays(front, &format!("f{i}")));
    }
    let (sd99, sf99) = (percentile(&mut sd, 0.99), percentile(&mut sf, 0.99));
    println!(
        "SSE per-event delay p99: direct {sd99:.3} ms, front door {sf99:.3} ms (goal ≤ 1 ms), over {} events each",
        sd.len()
    );
    drop(w);
    held_memory();
}

/// The warden's memory while its engine loads, before and with 1000
/// requests held.
fn held_memory() {
    let held = env_or("FRONT_BENCH_HELD", 1000);
    let (port, front, server) = (free_port(), free_port(), free_port());
    let w = Warden::start(
        port,
        front,
        server,
        &["--shards", "100000", "--shard-time", "100ms"],
        &format!("hold = \"10m\"\nmax-held = {}\nmax-connections = {}\n", held + 10, held + 100),
    );
    // Bound and loading: a first request is held (its answer not awaited).
    let mut first = Conn::open(front);
    first.send("GET /v1/models HTTP/1.1\r\nHost: b\r\n\r\n");
    wait_held(server, 1);
    let before = w.rss_kib();
    let body = r#"{"prompt":"held","max_tokens":1}"#;
    let mut conns = Vec::new();
    for _ in 0..held {
        let mut c = Conn::open(front);
        c.send(&format!(
            "POST /v1/completions HTTP/1.1\r\nHost: b\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
            body.len()
        ));
        conns.push(c);
    }
    wait_held(server, held + 1);
    let with = w.rss_kib();
    println!(
        "RSS: {:.1} MB before, {:.1} MB with {held} more requests held: +{:.1} MB (goal ≤ 20 MB)",
        before as f64 / 1024.0,
        with as f64 / 1024.0,
        (with as f64 - before as f64) / 1024.0
    );
    drop(conns);
    drop(w);
}

/// Wait until the endpoint's `vllm_warden_front_held` is at least `n`.
fn wait_held(server: u16, n: usize) {
    let deadline = Instant::now() + Duration::from_secs(120);
    loop {
        let mut c = Conn::open(server);
        c.send("GET /metrics HTTP/1.1\r\nHost: b\r\nConnection: close\r\n\r\n");
        let (_, body) = c.answer();
        let text = String::from_utf8_lossy(&body);
        let now = text
            .lines()
            .find(|l| l.starts_with("vllm_warden_front_held{"))
            .and_then(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
            .unwrap_or(0.0);
        if now >= n as f64 {
            return;
        }
        assert!(Instant::now() < deadline, "{now} held, waiting for {n}");
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// This process holds 1000 connections for the memory figure.
fn raise_nofile() {
    let mut lim = libc::rlimit { rlim_cur: 0, rlim_max: 0 };
    // SAFETY: getrlimit and setrlimit on a struct we own.
    unsafe {
        libc::getrlimit(libc::RLIMIT_NOFILE, &mut lim);
        lim.rlim_cur = lim.rlim_max.min(65536);
        libc::setrlimit(libc::RLIMIT_NOFILE, &lim);
    }
}
