//! The command line: parsing, the commands, and the process exit code,
//! decided here in one place.

use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use clap::{Parser, Subcommand};
use tokio::sync::mpsc;

use crate::config::{self, DEFAULT_CONFIG, Dirs, Settings};
use crate::driver::{self, Context, Input, Real};
use crate::fake::{self, FakeArgs};
use crate::logwatch::Classifier;
use crate::supervisor::{Machine, Policy, exit};
use crate::systemd::{self, Note, Notifier, SdNotifier};

#[derive(Debug, Parser)]
#[command(name = "vllm-warden", version, about = "Supervise one vLLM server under systemd")]
pub struct Cli {
    #[command(subcommand)]
    pub command: Cmd,
}

#[derive(Debug, clap::Args)]
pub struct ConfigArg {
    /// Config file.
    #[arg(short, long, env = "VLLM_WARDEN_CONFIG", default_value = DEFAULT_CONFIG)]
    pub config: PathBuf,
}

#[derive(Debug, clap::Args)]
pub struct PatchArgs {
    #[command(flatten)]
    pub config: ConfigArg,
    /// Print a unified diff per file of what would change; write nothing.
    #[arg(long, conflicts_with = "revert")]
    pub dry_run: bool,
    /// Restore the original files (symlinks back to symlinks).
    #[arg(long)]
    pub revert: bool,
    /// With --revert: restore even files changed by someone else since.
    #[arg(long, requires = "revert")]
    pub force: bool,
}

#[derive(Debug, clap::Args)]
pub struct StatusArgs {
    #[command(flatten)]
    pub config: ConfigArg,
    /// Print the status document instead of a summary.
    #[arg(long)]
    pub json: bool,
}

#[derive(Debug, Subcommand)]
pub enum Cmd {
    /// Run the daemon in the foreground (systemd's ExecStart=).
    Run(ConfigArg),
    /// Validate the config and the environment; list every problem.
    Check(ConfigArg),
    /// Apply the config's [[patch]] entries to the model files now.
    Patch(PatchArgs),
    /// What a running instance is doing: exit 0 ready, 3 not ready, 4 not running.
    Status(StatusArgs),
    /// Run the whole lifecycle against a built-in simulated vLLM.
    Demo,
    /// A simulated vLLM server, for the demo and the tests.
    #[command(hide = true)]
    FakeVllm(Box<FakeArgs>),
    /// Write the man pages and shell completions into a folder (packaging).
    #[command(hide = true)]
    Assets { dir: PathBuf },
}

/// Parse the arguments, run the command, return the exit code.
pub fn main() -> i32 {
    let cli = Cli::parse();
    match cli.command {
        Cmd::Run(c) => run(&c.config),
        Cmd::Check(c) => check(&c.config),
        Cmd::Patch(a) => patch(&a),
        Cmd::Status(a) => status(&a),
        Cmd::Demo => demo(),
        Cmd::FakeVllm(a) => fake::main(*a),
        Cmd::Assets { dir } => match assets(&dir) {
            Ok(()) => exit::STOPPED,
            Err(e) => {
                eprintln!("vllm-warden: {}: {e}", dir.display());
                exit::INTERNAL
            }
        },
    }
}

fn load(path: &Path) -> Result<Settings, i32> {
    config::load(path, &Dirs::from_env()).map_err(|problems| {
        for p in &problems.0 {
            eprintln!("{p}");
        }
        exit::CONFIG
    })
}

fn check(path: &Path) -> i32 {
    let (settings, mut problems) = match config::load(path, &Dirs::from_env()) {
        Ok(s) => {
            let env = config::check_environment(&s);
            (Some(s), env)
        }
        Err(p) => (None, p.0),
    };
    if let Some(s) = &settings {
        println!("{}: config of instance {:?} is valid", path.display(), s.name);
        print!("{}", config::describe_patterns(s));
    }
    problems.dedup();
    for p in &problems {
        eprintln!("{p}");
    }
    if problems.is_empty() {
        exit::STOPPED
    } else {
        eprintln!("{} problem(s) found", problems.len());
        exit::CONFIG
    }
}

/// Exit codes of `status`.
const STATUS_NOT_READY: i32 = 3;
const STATUS_NOT_RUNNING: i32 = 4;

fn status(a: &StatusArgs) -> i32 {
    let s = match load(&a.config.config) {
        Ok(s) => s,
        Err(code) => return code,
    };
    use crate::status::Verdict;
    let verdict = crate::status::read(&s.status.file);
    if a.json {
        match &verdict {
            Verdict::Ready(d) | Verdict::NotReady(d) | Verdict::NotRunning(Some(d)) => {
                println!("{}", serde_json::to_string_pretty(d).expect("the document serialises"))
            }
            Verdict::NotRunning(None) => eprintln!("{}: no status file", s.status.file.display()),
        }
    } else {
        println!("{}", crate::status::summary(&verdict));
    }
    match verdict {
        Verdict::Ready(_) => exit::STOPPED,
        Verdict::NotReady(_) => STATUS_NOT_READY,
        Verdict::NotRunning(_) => STATUS_NOT_RUNNING,
    }
}

/// Exit code of `patch` when a file cannot be patched or restored.
const PATCH_FAILED: i32 = 1;

fn patch(a: &PatchArgs) -> i32 {
    let s = match load(&a.config.config) {
        Ok(s) => s,
        Err(code) => return code,
    };
    let result = if a.revert {
        crate::patch::revert(&s.state_dir, a.force).map(|files| {
            if files.is_empty() {
                println!("nothing to restore");
            }
            for f in files {
                println!("{}: restored", f.display());
            }
        })
    } else if a.dry_run {
        crate::patch::by_file(&s.patches).iter().try_for_each(|fp| {
            let plan = crate::patch::plan(fp)?;
            if plan.changes() {
                print!("{}", plan.diff());
            } else {
                println!("{}: unchanged", plan.file.display());
            }
            Ok(())
        })
    } else {
        crate::patch::apply(&s.patches, &s.state_dir).map(|applied| {
            for a in applied {
                println!("{a}");
            }
        })
    };
    match result {
        Ok(()) => exit::STOPPED,
        Err(e) => {
            eprintln!("vllm-warden: {e}");
            PATCH_FAILED
        }
    }
}

/// The man pages, from their Markdown sources in `docs/`, and the shell
/// completions, from the command-line definition: both generated, never
/// kept by hand.
fn assets(dir: &Path) -> std::io::Result<()> {
    use clap::CommandFactory;
    let man = dir.join("man");
    let comp = dir.join("completions");
    std::fs::create_dir_all(&man)?;
    std::fs::create_dir_all(&comp)?;
    let page = |md: &str, title: &str, section: u8| mandown::convert(&for_man(md), title, section);
    std::fs::write(man.join("vllm-warden.8"), page(include_str!("../docs/vllm-warden.8.md"), "VLLM-WARDEN", 8))?;
    std::fs::write(
        man.join("vllm-warden.toml.5"),
        page(include_str!("../docs/vllm-warden.toml.5.md"), "VLLM-WARDEN.TOML", 5),
    )?;
    for (shell, file) in [
        (clap_complete::Shell::Bash, "vllm-warden.bash"),
        (clap_complete::Shell::Zsh, "_vllm-warden"),
        (clap_complete::Shell::Fish, "vllm-warden.fish"),
    ] {
        let mut out = Vec::new();
        clap_complete::generate(shell, &mut Cli::command(), "vllm-warden", &mut out);
        std::fs::write(comp.join(file), out)?;
    }
    Ok(())
}

/// Markdown as the man page converter renders well: table rows become
/// list items (the header row a sentence), code spans plain text.
fn for_man(md: &str) -> String {
    let mut out = String::new();
    let mut header = true;
    for line in md.lines() {
        let t = line.trim();
        if t.starts_with('|') {
            let cells: Vec<&str> = t.trim_matches('|').split('|').map(str::trim).collect();
            if cells.iter().all(|c| c.chars().all(|ch| ch == '-' || ch == ':')) {
                continue;
            }
            if header {
                header = false;
                continue;
            }
            match cells.as_slice() {
                [key, default, meaning] => out.push_str(&format!("- **{key}** (default: {default}): {meaning}\n")),
                [a, rest @ ..] => out.push_str(&format!("- **{a}**: {}\n", rest.join("; "))),
                [] => {}
            }
        } else {
            header = true;
            out.push_str(line);
            out.push('\n');
        }
    }
    out.replace('`', "")
}

fn runtime() -> Result<tokio::runtime::Runtime, i32> {
    tokio::runtime::Builder::new_current_thread().enable_all().build().map_err(|e| {
        eprintln!("vllm-warden: cannot start the runtime: {e}");
        exit::INTERNAL
    })
}

fn run(path: &Path) -> i32 {
    let settings = match load(path) {
        Ok(s) => s,
        Err(code) => return code,
    };
    crate::logging::init();
    if let Err(e) = crate::child::unblock_all_signals() {
        tracing::error!(error = %e, "cannot unblock signals");
        return exit::INTERNAL;
    }
    let rt = match runtime() {
        Ok(rt) => rt,
        Err(code) => return code,
    };
    rt.block_on(supervise(settings, SdNotifier::from_env(), systemd::watchdog_interval(), |_| {}))
}

/// Supervise `settings` until stopped: signals, the real backend, the loop.
/// `hook` gets a sender of inputs (the demo uses it to ask for a stop).
pub async fn supervise(
    settings: Settings,
    mut notifier: impl Notifier,
    watchdog: Option<Duration>,
    hook: impl FnOnce(mpsc::UnboundedSender<Input>),
) -> i32 {
    let (tx, mut rx) = mpsc::unbounded_channel();
    if let Err(e) = listen_for_signals(tx.clone(), settings.source.clone()) {
        tracing::error!(error = %e, "cannot listen for signals");
        return exit::INTERNAL;
    }
    let classifier = match Classifier::new(&settings.patterns) {
        Ok(c) => c,
        Err(e) => {
            tracing::error!(error = %e, "invalid pattern");
            return exit::CONFIG;
        }
    };
    let ctx = Context { instance: settings.name.clone(), watchdog };
    let reporter =
        crate::status::Reporter::new(&settings.name, &settings.status.file, settings.status.metrics_file.as_deref());
    let machine = Machine::new(Policy::from_settings(&settings), fastrand::u64(..));
    hook(tx.clone());
    let tree = TreeRecord { state_dir: settings.state_dir.clone(), last: None };
    let cleanup = settings.clone();
    let traffic = crate::health::Traffic::default();
    let mut backend = match Real::new(settings, tx, traffic.clone()) {
        Ok(b) => b,
        Err(e) => {
            tracing::error!(error = %e, "cannot become a subreaper");
            return exit::INTERNAL;
        }
    };
    let journal = crate::journal::Forwarder::from_env(&ctx.instance);
    let mut observer = Reports { status: reporter, journal, tree, traffic, generation: Default::default() };
    let code = driver::drive(machine, &mut backend, &mut notifier, classifier, &mut rx, &ctx, &mut observer).await;
    // The tree is gone: what it left in /dev/shm goes now, not at the next start.
    crate::prepare::clean_leftover_files(&cleanup);
    code
}

/// The status files and the journal, kept up to date by the loop.
struct Reports {
    status: crate::status::Reporter,
    journal: Option<crate::journal::Forwarder>,
    tree: TreeRecord,
    traffic: crate::health::Traffic,
    generation: crate::health::GenerationLine,
}

/// Keeps the child's tree recorded in the state directory while it runs,
/// for a warden started after this one was killed (see `prestart`).
struct TreeRecord {
    state_dir: std::path::PathBuf,
    last: Option<(&'static str, std::time::Instant)>,
}

impl TreeRecord {
    /// Recorded again at every state change, and at most once a second
    /// while lines come in (vLLM starts its engine and workers after the
    /// spawn).
    fn update(&mut self, m: &Machine) {
        let state = crate::supervisor::state_name(&m.state);
        match &m.state {
            crate::supervisor::State::Starting(_) | crate::supervisor::State::Ready(_) => {
                let due = match self.last {
                    Some((s, t)) => s != state || t.elapsed() >= Duration::from_secs(1),
                    None => true,
                };
                if due {
                    if let Err(e) = crate::prestart::record_tree(&self.state_dir) {
                        tracing::warn!(error = %e, "cannot record the child's tree in the state directory");
                    }
                    self.last = Some((state, std::time::Instant::now()));
                }
            }
            crate::supervisor::State::Backoff { .. } | crate::supervisor::State::Done(_) if self.last.is_some() => {
                crate::prestart::clear_record(&self.state_dir);
                self.last = None;
            }
            _ => {}
        }
    }
}

impl driver::Observer for Reports {
    fn changed(&mut self, m: &Machine) {
        self.status.update(&m.snapshot());
        self.tree.update(m);
    }
    fn line(&mut self, line: &crate::logwatch::Line) {
        if let Some(j) = &self.journal {
            j.forward(line);
        }
        if self.generation.matches(&line.text) {
            self.traffic.saw_generation();
        }
    }
}

fn listen_for_signals(tx: mpsc::UnboundedSender<Input>, config: std::path::PathBuf) -> std::io::Result<()> {
    use tokio::signal::unix::{SignalKind, signal};
    let mut term = signal(SignalKind::terminate())?;
    let mut int = signal(SignalKind::interrupt())?;
    let mut hup = signal(SignalKind::hangup())?;
    tokio::spawn(async move {
        loop {
            tokio::select! {
                _ = term.recv() => { let _ = tx.send(Input::Stop); }
                _ = int.recv() => { let _ = tx.send(Input::Stop); }
                _ = hup.recv() => {
                    tracing::info!(EVENT = "reload", "SIGHUP: reading {} again", config.display());
                    let loaded = config::load(&config, &Dirs::from_env()).and_then(|s| {
                        let env = config::check_environment(&s);
                        if env.is_empty() { Ok(s) } else { Err(config::Problems(env)) }
                    });
                    let _ = tx.send(Input::Reload(Box::new(loaded)));
                }
            }
        }
    });
    Ok(())
}

/// Prints every notification and asks for a stop after the second READY=1.
type StopSlot = Arc<Mutex<Option<mpsc::UnboundedSender<Input>>>>;

struct Narrator {
    readies: u32,
    stop: StopSlot,
    started: std::time::Instant,
}

impl Notifier for Narrator {
    fn notify(&mut self, notes: &[Note]) {
        let t = self.started.elapsed().as_secs_f64();
        for n in notes {
            let line = match n {
                Note::Ready => "READY=1".to_string(),
                Note::Status(s) => format!("STATUS={s}"),
                Note::Stopping => "STOPPING=1".to_string(),
                Note::ExtendTimeout(d) => format!("EXTEND_TIMEOUT_USEC={}", d.as_micros()),
                Note::Watchdog => "WATCHDOG=1".to_string(),
            };
            println!("[{t:6.2}s] systemd <- {line}");
            if *n == Note::Ready {
                self.readies += 1;
                if self.readies == 2
                    && let Some(tx) = self.stop.lock().expect("slot lock").take()
                {
                    println!(
                        "[{t:6.2}s] demo: ready again after the crash; stopping the warden as `systemctl stop` would"
                    );
                    let _ = tx.send(Input::Stop);
                }
            }
        }
    }
}

fn demo() -> i32 {
    let dir = std::env::temp_dir().join(format!("vllm-warden-demo-{}", std::process::id()));
    let code = demo_in(&dir);
    let _ = std::fs::remove_dir_all(&dir);
    code
}

fn demo_in(dir: &Path) -> i32 {
    let fail = |e: &dyn std::fmt::Display| {
        eprintln!("demo: {e}");
        exit::INTERNAL
    };
    if let Err(e) = std::fs::create_dir_all(dir) {
        return fail(&e);
    }
    let exe = match std::env::current_exe() {
        Ok(e) => e,
        Err(e) => return fail(&e),
    };
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
command = ["{exe}", "fake-vllm", "--port", "{port}", "--model", "{d}/model", "--shards", "8", "--shard-time", "300ms",
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
        exe = exe.display()
    );
    let cfg = dir.join("demo.toml");
    if let Err(e) = std::fs::write(&cfg, &text) {
        return fail(&e);
    }
    let dirs = Dirs { state: Some(dir.join("state")), ..Dirs::default() };
    let settings = match config::parse(&text, &cfg, &dirs) {
        Ok(s) => s,
        Err(p) => return fail(&p),
    };
    println!("demo: a simulated vLLM on port {port}. Its model's config.json asks for a 4-bit KV cache, which it");
    println!("demo: refuses; a [[patch]] removes the key before each start. It loads 8 shards, serves, its engine");
    println!("demo: dies 3 s after the first ready (the API server then exits 0), and the second start stays up.");
    println!("demo: the child's log: {d}/demo.log");
    crate::logging::init();
    let rt = match runtime() {
        Ok(rt) => rt,
        Err(code) => return code,
    };
    let started = std::time::Instant::now();
    let slot: StopSlot = Arc::default();
    let narrator = Narrator { readies: 0, stop: slot.clone(), started };
    let code = rt.block_on(supervise(settings, narrator, None, move |tx| {
        *slot.lock().expect("slot lock") = Some(tx);
    }));
    println!("[{:6.2}s] demo: the warden exited with code {code}", started.elapsed().as_secs_f64());
    code
}
