//! `vllm-warden demo`: the whole lifecycle against the simulated vLLM
//! (`vllm-warden-sim`), narrated: a patch, the load, ready, an engine
//! death, the backoff, the restart, ready again, and a stop, with every
//! notification printed as systemd would receive it.

use std::path::{Path, PathBuf};

use tokio::sync::mpsc;
use tokio_stream::wrappers::UnboundedReceiverStream;

use crate::config::{self, Dirs};
use crate::daemon::driver::Request;
use crate::supervisor::Note;
use crate::supervisor::exit::Code;
use crate::tell::notify::Notifier;

/// `println!` that goes on when nobody reads any more (`demo | head`):
/// the demo's warden must still end its run and stop its child.
macro_rules! say {
    ($($t:tt)*) => {{
        use std::io::Write as _;
        let _ = writeln!(std::io::stdout().lock(), $($t)*);
    }};
}

/// The simulator's name; the package installs it under [`SIM_DIR`].
pub(crate) const SIM: &str = "vllm-warden-sim";
pub(crate) const SIM_DIR: &str = "/usr/lib/vllm-warden";

/// Where the simulator is: beside this binary (a build tree), else where
/// the package installs it.
fn find_sim() -> Option<PathBuf> {
    let beside = std::env::current_exe().ok().map(|e| e.with_file_name(SIM));
    [beside, Some(Path::new(SIM_DIR).join(SIM))].into_iter().flatten().find(|p| p.is_file())
}

/// Prints every notification and asks for a stop after the second READY=1.
/// A timeout extension is printed once a kind of status (a phase): the
/// loop sends one with every status, the same most of the time.
struct Narrator {
    readies: u32,
    /// The last status, and whether a timeout extension was printed since.
    status: String,
    extended: bool,
    /// Held for the whole run: the end of the requests would be a stop.
    stop: mpsc::UnboundedSender<Request>,
    started: std::time::Instant,
}

impl Notifier for Narrator {
    fn notify(&mut self, notes: &[Note]) {
        let t = self.started.elapsed().as_secs_f64();
        for n in notes {
            let line = match n {
                Note::Ready => "READY=1".to_string(),
                Note::Status(s) => {
                    if !crate::tell::notify::same_kind(&self.status, s) {
                        self.extended = false;
                    }
                    self.status.clone_from(s);
                    format!("STATUS={s}")
                }
                Note::Stopping => "STOPPING=1".to_string(),
                Note::ExtendTimeout(_) if self.extended => continue,
                Note::ExtendTimeout(d) => {
                    self.extended = true;
                    format!("EXTEND_TIMEOUT_USEC={}", d.as_micros())
                }
                Note::Watchdog => "WATCHDOG=1".to_string(),
            };
            say!("[{t:6.2}s] systemd <- {line}");
            if *n == Note::Ready {
                self.readies += 1;
                if self.readies == 2 {
                    say!("[{t:6.2}s] demo: ready again after the crash; stopping the warden as `systemctl stop` would");
                    let _ = self.stop.send(Request::Stop);
                }
            }
        }
    }
}

pub(crate) fn main(colour: crate::util::logging::Colour) -> Code {
    let Some(sim) = find_sim() else {
        eprintln!("demo: {SIM} not found beside this binary or in {SIM_DIR} (cargo build --release builds it)");
        return Code::Internal;
    };
    let dir = std::env::temp_dir().join(format!("vllm-warden-demo-{}", std::process::id()));
    let code = demo_in(&dir, &sim, colour);
    if dir.exists() {
        let d = dir.display();
        say!(
            "demo: kept in {d}: demo.toml (its config), demo.log (the child's log), status.json, state/ (the load ledger, setups, golden answers), run/ (the control socket); rm -r {d} removes it"
        );
        say!(
            "demo: next: STATE_DIRECTORY={d}/state vllm-warden loads -c {d}/demo.toml   (the two loads, phase by phase)"
        );
        say!(
            "demo: next: the README's Install section serves a real model under systemd; vllm-warden(8) has every command"
        );
    }
    code
}

fn demo_in(dir: &Path, sim: &Path, colour: crate::util::logging::Colour) -> Code {
    let fail = |e: &dyn std::fmt::Display| {
        eprintln!("demo: {e}");
        Code::Internal
    };
    if let Err(e) = std::fs::create_dir_all(dir) {
        return fail(&e);
    }
    let port = match std::net::TcpListener::bind("127.0.0.1:0").and_then(|l| l.local_addr()) {
        Ok(a) => a.port(),
        Err(e) => return fail(&e),
    };
    let d = dir.display();
    // A model whose config.json asks for a 4-bit KV cache: the simulated
    // vLLM refuses it, as vLLM 0.32 does, unless the patch removes it.
    let model = dir.join("model");
    let model_cfg = "{\n  \"architectures\": [\"LlamaForCausalLM\"],\n  \"quantization_config\": {\n    \"quant_method\": \"compressed-tensors\",\n    \"kv_cache_scheme\": {\"num_bits\": 4, \"type\": \"float\"}\n  }\n}\n";
    if let Err(e) = std::fs::create_dir_all(&model).and_then(|()| std::fs::write(model.join("config.json"), model_cfg))
    {
        return fail(&e);
    }
    let text = format!(
        r#"name = "demo"
[child]
command = ["{sim}", "--port", "{port}", "--model", "{d}/model", "--shards", "8", "--shard-time", "300ms",
           "--fail", "engine-death", "--fail-after", "3s", "--fail-times", "1", "--count-file", "{d}/runs"]
log-file = "{d}/demo.log"
stop-timeout = "5s"
[[patch]]
file = "{d}/model/config.json"
remove = ["quantization_config.kv_cache_scheme"]
[restart]
initial-delay = "2s"
[status]
file = "{d}/status.json"
"#,
        sim = sim.display()
    );
    let cfg = dir.join("demo.toml");
    if let Err(e) = std::fs::write(&cfg, &text) {
        return fail(&e);
    }
    // Every folder of its own in `dir`: nothing is left in /run or /var.
    let dirs = Dirs {
        state: Some(dir.join("state")),
        runtime: Some(dir.join("run")),
        logs: Some(dir.to_path_buf()),
        cache: Some(dir.join("cache")),
    };
    let settings = match config::parse(&text, &cfg, &dirs) {
        Ok(s) => s,
        Err(p) => return fail(&p),
    };
    say!("demo: a simulated vLLM on port {port}. Its model's config.json asks for a 4-bit KV cache, which it");
    say!("demo: refuses; a [[patch]] removes the key before each start. It loads 8 shards, serves, its engine");
    say!("demo: dies 3 s after the first ready (the API server then exits 0), and the second start stays up.");
    say!("demo: the child's log: {d}/demo.log");
    crate::util::logging::init(crate::util::logging::Format::Text, colour);
    let rt = match crate::daemon::runtime() {
        Ok(rt) => rt,
        Err(code) => return code,
    };
    let started = std::time::Instant::now();
    let (stop, requests) = mpsc::unbounded_channel();
    let narrator = Narrator { readies: 0, status: String::new(), extended: false, stop, started };
    let code = rt.block_on(crate::daemon::run(
        settings,
        narrator,
        None,
        UnboundedReceiverStream::new(requests),
        Default::default(),
    ));
    say!("[{:6.2}s] demo: the warden exited with code {code}", started.elapsed().as_secs_f64());
    code
}
