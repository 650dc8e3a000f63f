//! How fast a stop request is answered in every phase: SIGTERM sent to the
//! warden → `STOPPING=1` received on the notify socket, with the release
//! binary, while
//!
//! - the pre-start GPU query hangs (a failing driver's `nvidia-smi`);
//! - a 275 MB model `config.json` is being patched;
//! - the model loads; it serves; it waits in backoff.
//!
//! The baseline, measured in the same run, is the same round trip through a
//! bare process that answers SIGTERM with one datagram (a signal handler
//! thread, no supervision): what a stop answer cannot do without. The goal
//! is an answer within 100 ms in every phase.
//!
//! Run: `cargo build --release && cargo bench --bench stop` (the build makes
//! the simulated vLLM, a package of its own, beside the warden).

#[path = "../tests/support/sim.rs"]
mod sim;

use std::os::unix::net::UnixDatagram;
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

const SAMPLES: usize = 20;

fn stats(name: &str, mut xs: Vec<f64>) -> (f64, f64) {
    xs.sort_by(|a, b| a.partial_cmp(b).unwrap());
    let med = xs[xs.len() / 2];
    let max = xs[xs.len() - 1];
    println!("{name:<44} n={:<3} median {med:8.2} ms   max {max:8.2} ms", xs.len());
    (med, max)
}

/// A notify socket and the warden (or baseline) started on it.
struct Run {
    sock: UnixDatagram,
    child: Child,
}

impl Run {
    fn start(cmd: &mut Command, dir: &Path) -> Run {
        let path = dir.join("notify.sock");
        let _ = std::fs::remove_file(&path);
        let sock = UnixDatagram::bind(&path).unwrap();
        sock.set_read_timeout(Some(Duration::from_secs(120))).unwrap();
        let child = cmd.env("NOTIFY_SOCKET", &path).stdout(Stdio::null()).stderr(Stdio::null()).spawn().unwrap();
        Run { sock, child }
    }

    /// Wait for a datagram with a line satisfying `pred`.
    fn wait(&self, what: &str, pred: impl Fn(&str) -> bool) -> Instant {
        let mut buf = vec![0u8; 65536];
        loop {
            let n = self.sock.recv(&mut buf).unwrap_or_else(|e| panic!("waiting for {what}: {e}"));
            let t = Instant::now();
            if String::from_utf8_lossy(&buf[..n]).lines().any(&pred) {
                return t;
            }
        }
    }

    /// SIGTERM → STOPPING=1, in ms; then wait for the exit.
    fn stop(mut self) -> f64 {
        let t = Instant::now();
        nix::sys::signal::kill(nix::unistd::Pid::from_raw(self.child.id() as i32), nix::sys::signal::Signal::SIGTERM)
            .unwrap();
        let got = self.wait("STOPPING=1", |l| l == "STOPPING=1");
        let _ = self.child.wait();
        (got - t).as_secs_f64() * 1e3
    }
}

fn warden(exe: &str, dir: &Path, config: &str) -> Command {
    let cfg = dir.join("bench.toml");
    std::fs::write(&cfg, config).unwrap();
    let mut c = Command::new(exe);
    c.args(["run", "-c"]).arg(&cfg).env("STATE_DIRECTORY", dir.join("state")).env("RUST_LOG", "error");
    c
}

fn config(dir: &Path, sim: &str, sim_args: &str, more: &str) -> String {
    let port = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
    format!(
        "name = \"bench\"\n[child]\ncommand = [\"{sim}\", \"--port\", \"{port}\"{sim_args}]\nlog-file = \"{d}/bench.log\"\n\
         [status]\nfile = \"{d}/status.json\"\n[golden]\nenabled = false\n{more}",
        d = dir.display()
    )
}

fn main() {
    let exe = env!("CARGO_BIN_EXE_vllm-warden");
    let sim = &sim::beside(exe).display().to_string();
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();

    // A query that never answers, writing its pid so that the bench knows it runs.
    let query = d.join("gpu-query");
    std::fs::write(&query, format!("#!/bin/sh\necho $$ > {}/query.pid\nexec sleep 3600\n", d.display())).unwrap();
    std::fs::set_permissions(&query, std::os::unix::fs::PermissionsExt::from_mode(0o755)).unwrap();
    // A 275 MB model config, patched at every start.
    let model = d.join("model");
    std::fs::create_dir_all(&model).unwrap();
    let mut big = String::from(
        "{\n  \"architectures\": [\"LlamaForCausalLM\"],\n  \"kv_cache_scheme\": {\"num_bits\": 4},\n  \"vocab\": [\n",
    );
    let entry = "    \"token-with-a-long-enough-name-to-fill-the-file-quickly-0123456789abcdef\",\n";
    while big.len() < 275 << 20 {
        big.push_str(entry);
    }
    big.push_str("    \"end\"\n  ]\n}\n");
    let cfg_json = model.join("config.json");

    let mut rows = Vec::new();
    {
        let mut xs = Vec::new();
        for _ in 0..SAMPLES {
            let _ = std::fs::remove_file(d.join("query.pid"));
            let more = format!(
                "[prestart]\ngpu-idle-wait = \"10m\"\ngpu-query = [\"{}\"]\n[restart]\ninitial-delay = \"0s\"\n",
                query.display()
            );
            let run = Run::start(&mut warden(exe, d, &config(d, sim, "", &more)), d);
            run.wait("the GPU check", |l| l.starts_with("STATUS=checking the GPUs"));
            xs.push(run.stop());
        }
        rows.push(stats("stop while the GPU query hangs", xs));
    }
    {
        let mut xs = Vec::new();
        for _ in 0..SAMPLES {
            std::fs::write(&cfg_json, &big).unwrap();
            let more = format!(
                "[[patch]]\nfile = \"{}\"\nremove = [\"kv_cache_scheme\"]\nmax-size = \"300 MiB\"\n",
                cfg_json.display()
            );
            let run = Run::start(&mut warden(exe, d, &config(d, sim, "", &more)), d);
            run.wait("the patch", |l| l.starts_with("STATUS=applying"));
            xs.push(run.stop());
        }
        rows.push(stats("stop while a 275 MB config.json is patched", xs));
    }
    for (name, sim_args, more, wait) in [
        ("stop while the model loads", ", \"--shards\", \"1000\", \"--shard-time\", \"1s\"", "", "STATUS=loading, pid"),
        ("stop while serving", ", \"--shards\", \"1\"", "", "READY=1"),
        (
            "stop in backoff",
            ", \"--shards\", \"1\", \"--fail\", \"exit1\"",
            "[restart]\ninitial-delay = \"10m\"\nmax-delay = \"10m\"\n",
            "STATUS=restarting in",
        ),
    ] {
        let mut xs = Vec::new();
        for _ in 0..SAMPLES {
            let run = Run::start(&mut warden(exe, d, &config(d, sim, sim_args, more)), d);
            run.wait(name, |l| l.starts_with(wait));
            xs.push(run.stop());
        }
        rows.push(stats(name, xs));
    }
    // The baseline: a bare process that answers SIGTERM with STOPPING=1.
    let mut xs = Vec::new();
    for _ in 0..SAMPLES {
        let script = "import os,signal,socket,time\n\
                      s=socket.socket(socket.AF_UNIX,socket.SOCK_DGRAM)\n\
                      signal.signal(signal.SIGTERM,lambda *a:(s.sendto(b'STOPPING=1\\n',os.environ['NOTIFY_SOCKET']),os._exit(0)))\n\
                      s.sendto(b'READY=1\\n',os.environ['NOTIFY_SOCKET'])\n\
                      time.sleep(3600)\n";
        let run = Run::start(Command::new("python3").args(["-c", script]), d);
        run.wait("READY=1", |l| l == "READY=1");
        xs.push(run.stop());
    }
    let (bm, _) = stats("baseline: bare SIGTERM -> STOPPING=1", xs);
    let worst = rows.iter().map(|(_, max)| *max).fold(0.0, f64::max);
    println!("worst case {worst:.2} ms (goal: under 100 ms); baseline median {bm:.2} ms");
}
