//! A config that passed validation: [`Settings`] and its sections, plain
//! data for every layer above.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::time::Duration;

use nix::sys::signal::Signal;

use crate::patch::Patch;
use vllm_warden_core::policy::{Fit, GoldenPolicy, IdleAction, Restart};
use vllm_warden_core::profile::{Patterns, Profile};

impl Settings {
    /// The cluster that confirms a Ray node's readiness after its ready
    /// line, unless `ready.http` is set: Ray nodes serve no HTTP.
    pub(crate) fn ready_by_ray(&self) -> Option<&Cluster> {
        if self.ready.http.is_some() || !self.profile.is_ray() {
            return None;
        }
        self.prestart.ray.as_ref()
    }
}

/// A config that passed validation.
#[derive(Debug, Clone)]
pub struct Settings {
    /// The file it came from.
    pub(crate) source: PathBuf,
    /// The text it was read from: kept as `running.toml` in the state
    /// directory, for `check --diff` against the running instance.
    pub(crate) text: String,
    /// Instance name: journal identifier `vllm-<name>`, default file names.
    pub(crate) name: String,
    pub profile: Profile,
    pub child: Child,
    pub(crate) patches: Vec<Patch>,
    pub prestart: Prestart,
    pub ready: Ready,
    pub fatal: Fatal,
    pub restart: Restart,
    pub health: Health,
    pub(crate) status: Status,
    pub server: Server,
    pub drain: Drain,
    pub(crate) reports: Reports,
    pub(crate) ledger: Ledger,
    pub(crate) golden: Golden,
    pub(crate) fit: Fit,
    pub(crate) rollback: Rollback,
    /// `[preload]`: the weight-cache daemon beside the engine.
    pub(crate) preload: crate::config::preload::Preload,
    /// `[prefetch]`: the weights read into the page cache as a start begins.
    pub(crate) prefetch: Prefetch,
    /// `[front]`: the model's address, owned by the warden; `None`: off
    /// (no `listen`), clients reach the engine itself.
    pub(crate) front: Option<Front>,
    /// Where the engine serves HTTP, as the warden reaches it; `None`: it
    /// serves none (a Ray node).
    pub(crate) engine: Option<Engine>,
    /// `$STATE_DIRECTORY`, else `/var/lib/vllm-warden/<name>`.
    pub(crate) state_dir: PathBuf,
    /// The effective pattern lists: the profile's plus the config's.
    pub patterns: Patterns,
    /// `[[hint]]`: `(match, text)`, tried before the profile's hints.
    pub(crate) hints: Vec<(String, String)>,
}

#[derive(Debug, Clone)]
pub struct Child {
    /// argv; never run through a shell.
    pub command: Vec<String>,
    pub(crate) env: BTreeMap<String, String>,
    pub(crate) cwd: Option<PathBuf>,
    /// `cache-dir`: where the child's caches go (see `process::caches`);
    /// `$CACHE_DIRECTORY` by default, `None` when there is none or it is
    /// set to `""`.
    pub(crate) cache_dir: Option<PathBuf>,
    /// `$RUNTIME_DIRECTORY`: vLLM's IPC sockets go into a folder of it.
    pub(crate) runtime_dir: Option<PathBuf>,
    pub(crate) log_file: PathBuf,
    /// `log-max-size`, `log-keep`, `log-compress`.
    pub(crate) log_rotation: Rotation,
    pub(crate) stop_signal: Signal,
    pub stop_timeout: Duration,
}

#[derive(Debug, Clone)]
pub struct Prestart {
    /// Globs in `/dev/shm`, the profile's plus the config's.
    pub(crate) clean_shm: Vec<String>,
    /// Checked free before each start; `None`: no port is known (a Ray
    /// node that joins a cluster).
    pub port: Option<u16>,
    pub port_wait: Duration,
    pub gpu_idle_wait: Duration,
    pub(crate) gpu_query: Vec<String>,
    /// The Ray cluster: waited for before each start (`gate`), and asked
    /// to confirm a Ray node's readiness.
    pub(crate) ray: Option<Cluster>,
}

#[derive(Debug, Clone)]
pub struct Ready {
    /// `None`: the HTTP check is off (`http = ""`).
    pub(crate) http: Option<String>,
    pub timeout: Duration,
    pub stall: Duration,
}

#[derive(Debug, Clone)]
pub struct Fatal {
    pub grace: Duration,
}

/// `[prestart] ray-*`: the cluster a start needs (what it asks and how:
/// `process::ray`).
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct Cluster {
    /// `HOST:PORT` of the head's GCS.
    pub(crate) address: String,
    /// The Python that has Ray (`prestart.ray-python`).
    pub(crate) python: String,
    /// Whether a start waits for the cluster (a head waits for none).
    pub(crate) gate: bool,
    pub(crate) min_nodes: u32,
    pub(crate) min_cpus: f64,
    pub(crate) min_gpus: f64,
    /// How long a start waits for it.
    pub(crate) wait: Duration,
}

/// `child.log-max-size`, `child.log-keep`, `child.log-compress` (carried
/// out by `observe::rotate`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Rotation {
    /// Rotate once the file holds this many bytes.
    pub(crate) max_size: u64,
    /// Copies kept: `NAME.1` to `NAME.KEEP`; 0 truncates without a copy.
    pub(crate) keep: u32,
    /// Copies beyond the first are gzip-compressed (`NAME.2.gz`, …).
    pub(crate) compress: bool,
}

#[derive(Debug, Clone)]
pub struct Health {
    pub(crate) http: Option<String>,
    pub interval: Duration,
    pub timeout: Duration,
    pub(crate) failures: u32,
    pub canary_interval: Duration,
    pub canary_timeout: Duration,
    /// Zero: no progress check from the server's metrics.
    pub progress_stall: Duration,
    /// A command whose output is new kernel messages, followed from each
    /// spawn for GPU faults; empty: off.
    pub(crate) kernel_messages: Vec<String>,
}

/// `[ledger]`: the record of every load (see `tell::ledger`).
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct Ledger {
    /// How many loads the ledger keeps; 0: none is recorded.
    pub(crate) keep: u32,
    /// A load of a known setup slower than its median by this factor,
    /// overall or in one phase, is a warning.
    pub(crate) slow_factor: f64,
    /// A phase without progress for this factor × its longest recorded
    /// time is a stall (when that is longer than `ready.stall-timeout`).
    pub(crate) deadline_factor: f64,
}

/// `[prefetch]`: the read-ahead of the model's weight files into the page
/// cache while vLLM starts (see `daemon::prefetch`).
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct Prefetch {
    /// On by default: it does something only for a vLLM command whose
    /// weights are on this machine (a folder, or the hub cache's copy).
    pub(crate) enabled: bool,
    /// The threads that read, each its own part of the files.
    pub(crate) threads: u32,
    /// At most this fraction of `MemAvailable` (at the start) is read.
    pub(crate) max_memory_fraction: f64,
}

/// `[golden]`: the answers checked at every ready.
#[derive(Debug, Clone, PartialEq)]
pub struct Golden {
    /// On by default for a vLLM server with an HTTP readiness check.
    pub(crate) enabled: bool,
    pub(crate) prompts: Vec<String>,
    /// More prompts, one a line, read at each check.
    pub(crate) prompts_file: Option<PathBuf>,
    pub(crate) max_tokens: u32,
    /// The largest difference of one token's logprob that is still the
    /// same answer.
    pub(crate) tolerance: f64,
    pub(crate) on_mismatch: GoldenPolicy,
    /// Changed answers after a changed setup become its reference.
    pub(crate) accept_changes: bool,
    /// What the whole check may take.
    pub(crate) timeout: Duration,
    /// While serving, the answers are checked again this often (out of
    /// rotation meanwhile); zero: never on a timer.
    pub(crate) interval: Duration,
}

/// `[rollback]`: a changed setup that fails permanently is replaced by
/// the last setup that reached ready.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct Rollback {
    pub(crate) enabled: bool,
    /// How many setups that reached ready are kept.
    pub(crate) keep: u32,
}

/// `[reports]`: the failure report written for every failed run.
#[derive(Debug, Clone, PartialEq)]
pub struct Reports {
    /// How many reports are kept; 0: none is written.
    pub(crate) keep: u32,
    /// The most all reports may take together, in bytes.
    pub(crate) max_size: u64,
    /// The last lines of the run's log in `log-tail.txt`.
    pub(crate) lines: u32,
    /// What one report may take in all.
    pub(crate) timeout: Duration,
    /// argv of a Python stack dump, `{pid}` in it; empty: none.
    pub(crate) py_spy: Vec<String>,
    /// argv of a GPU snapshot; empty: none.
    pub(crate) gpu_snapshot: Vec<String>,
    /// argv whose output is the kernel's messages since `{since}`; empty: none.
    pub(crate) kernel_messages: Vec<String>,
}

#[derive(Debug, Clone)]
pub(crate) struct Status {
    pub(crate) file: PathBuf,
    pub(crate) metrics_file: Option<PathBuf>,
}

/// `[server]`: the warden's own HTTP endpoint.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Server {
    /// The unix socket, always served: `control.sock` in the runtime
    /// directory unless set.
    pub(crate) socket: PathBuf,
    /// A TCP address to serve too (`127.0.0.1:9400`); none by default.
    pub listen: Option<std::net::SocketAddr>,
    /// A file holding the bearer token that allows the mutating endpoints
    /// over TCP; without it they are refused there.
    pub(crate) token_file: Option<PathBuf>,
}

/// `[drain]`: taking a serving child out of rotation before it stops.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Drain {
    /// Unready at once, then this long before looking at the requests in
    /// flight (the balancer's detection time).
    pub delay: Duration,
    /// The most the drain waits for no request running or waiting.
    pub timeout: Duration,
    /// A stop, and a reload that restarts the child, drain first. Default:
    /// true when `server.listen` is set.
    pub on_stop: bool,
}

/// Where the engine serves HTTP, as the warden (its checks, and the front
/// door) reaches it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Engine {
    /// `127.0.0.1:PORT`: the command's own port (no front door, or a
    /// command that cannot take `--uds`).
    Loopback(u16),
    /// vLLM's `--uds PATH`, chosen by the warden in a 0700 folder of the
    /// runtime directory when `[front]` is on: only the warden reaches it.
    Unix(PathBuf),
}

impl Engine {
    /// What a person reads: `127.0.0.1:8000`, `unix:/run/…/engine.sock`.
    pub(crate) fn shown(&self) -> String {
        match self {
            Engine::Loopback(port) => format!("127.0.0.1:{port}"),
            Engine::Unix(path) => format!("unix:{}", path.display()),
        }
    }
}

/// One address the front door listens on.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Listen {
    Tcp(std::net::SocketAddr),
    /// `unix:/path`: a unix socket the warden creates (replacing a stale
    /// one; the file is left at exit, for a socket kept by systemd).
    Unix(PathBuf),
}

impl Listen {
    /// As written in the config: `0.0.0.0:8000`, `unix:/run/…`.
    pub(crate) fn shown(&self) -> String {
        match self {
            Listen::Tcp(a) => a.to_string(),
            Listen::Unix(p) => format!("unix:{}", p.display()),
        }
    }
}

impl Front {
    /// The warden puts an idle engine to sleep (`idle-stop` with
    /// `idle-action = "sleep"`): the engine is given vLLM's development
    /// mode for it.
    pub(crate) fn sleeps(&self) -> bool {
        self.idle_stop.is_some() && self.idle_action == IdleAction::Sleep
    }
}

/// `[front]`: the warden owns the model's address and forwards to the
/// engine; requests wait while it is not serving.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct Front {
    /// Bound by the warden, unless systemd passes listening sockets
    /// (`LISTEN_FDS`), which are used instead.
    pub(crate) listen: Vec<Listen>,
    /// How long one request may wait for the engine to serve.
    pub(crate) hold: Duration,
    /// The most requests waiting at once.
    pub(crate) max_held: u32,
    /// A request in flight when the engine dies, that had received no
    /// byte of its answer, is held and sent once more after the restart.
    pub(crate) retry_unanswered: bool,
    /// The largest request body, in bytes.
    pub(crate) max_body: u64,
    /// The slowest a request body may come, in bytes a second, on average
    /// after its first seconds; 0: no such floor.
    pub(crate) min_body_rate: u64,
    /// The most client connections at once (kept under the descriptor
    /// limit).
    pub(crate) max_connections: u32,
    /// After this long without a request, the engine is stopped or put
    /// to sleep; `None`: never.
    pub(crate) idle_stop: Option<Duration>,
    pub(crate) idle_action: IdleAction,
    /// `idle-sleep-level`: vLLM's sleep level (1: weights to host memory,
    /// 2: weights dropped).
    pub(crate) idle_sleep_level: u8,
    /// How long a request that wakes an idle engine may wait; `None`: the
    /// setup's estimate from the ledger plus a margin.
    pub(crate) idle_hold: Option<Duration>,
}
