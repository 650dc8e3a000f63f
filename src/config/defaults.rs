//! The value of every key the config leaves out. The man page's table
//! shows the same values; a test compares them.

use std::time::Duration;

use nix::sys::signal::Signal;

use vllm_warden_core::profile::Profile;

const fn minutes(n: u64) -> Duration {
    Duration::from_secs(n * 60)
}

pub(crate) const PROFILE: Profile = Profile::Vllm;

/// `child.log-file` is `NAME.log` in `$LOGS_DIRECTORY`, else here.
pub(crate) const LOG_DIR: &str = "/var/log/vllm-warden";
pub(crate) const STOP_SIGNAL: Signal = Signal::SIGTERM;
pub(crate) const STOP_TIMEOUT: Duration = Duration::from_secs(90);

/// The port vLLM listens on when the command has no `--port`, and the
/// Ray head's GCS port when `ray start --head` has none.
pub(crate) use crate::config::command::PORT;
/// How long a start waits for the Ray cluster (`prestart.ray-*`).
pub(crate) const RAY_WAIT: Duration = minutes(10);
/// How long one look at the Ray cluster may take: it starts a Python
/// interpreter and imports Ray, several seconds on a busy machine.
pub(crate) const RAY_STATUS_TIMEOUT: Duration = Duration::from_secs(30);
pub(crate) const RAY_MIN_NODES: u32 = 1;
/// The Python that asks the cluster (it must have Ray).
pub(crate) const RAY_PYTHON: &str = "python3";
pub(crate) const PORT_WAIT: Duration = Duration::from_secs(30);
pub(crate) const GPU_IDLE_WAIT: Duration = minutes(2);
pub(crate) const GPU_QUERY: [&str; 3] =
    ["nvidia-smi", "--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits"];

pub(crate) const READY_TIMEOUT: Duration = minutes(90);
pub(crate) const READY_STALL: Duration = minutes(15);

pub(crate) const FATAL_GRACE: Duration = Duration::from_secs(30);

pub(crate) const INITIAL_DELAY: Duration = Duration::from_secs(10);
pub(crate) const MAX_DELAY: Duration = minutes(5);
pub(crate) const FACTOR: f64 = 2.0;
pub(crate) const JITTER: f64 = 0.1;
pub(crate) const RESET_AFTER: Duration = minutes(10);
pub(crate) const MAX_ATTEMPTS: u32 = 10;
pub(crate) const PERMANENT_ATTEMPTS: u32 = 2;

pub(crate) const HEALTH_INTERVAL: Duration = Duration::from_secs(15);
pub(crate) const HEALTH_TIMEOUT: Duration = Duration::from_secs(5);
pub(crate) const HEALTH_FAILURES: u32 = 3;
/// Requests running or waiting and no token moving for this long: the
/// engine has stalled. Zero: no progress check.
pub(crate) const PROGRESS_STALL: Duration = minutes(2);
/// A one-token completion a minute, when the server is idle (it is
/// skipped while requests run or tokens flow): on a big model about
/// 50 ms of one prefill a minute. Zero: no canary.
pub(crate) const CANARY_INTERVAL: Duration = minutes(1);
pub(crate) const CANARY_TIMEOUT: Duration = minutes(1);
/// New kernel messages as they come, followed while a run lives.
pub(crate) const KERNEL_MESSAGES: [&str; 7] = ["journalctl", "-k", "-f", "-n", "0", "-o", "json"];

/// `status.file` is `status.json` in `$RUNTIME_DIRECTORY`, else in
/// `NAME/` here.
pub(crate) const RUN_DIR: &str = "/run/vllm-warden";
/// `$STATE_DIRECTORY`, else `NAME/` here.
pub(crate) const STATE_DIR: &str = "/var/lib/vllm-warden";

/// `[ledger]`: how many loads are kept, when a load is slow, and how much
/// longer than its longest recorded time a phase may go without progress.
pub(crate) const LEDGER_KEEP: u32 = 500;
pub(crate) const LEDGER_SLOW_FACTOR: f64 = 1.5;
pub(crate) const LEDGER_DEADLINE_FACTOR: f64 = 3.0;

/// `[prefetch]`: on; four threads (enough to keep a local NVMe's queue
/// busy, few enough not to crowd a 2-core machine); at most half of the
/// memory available at the start, so that the engine's own use of memory
/// (and of the page cache) is never crowded out by the read-ahead.
pub(crate) const PREFETCH_ENABLED: bool = true;
pub(crate) const PREFETCH_THREADS: u32 = 4;
pub(crate) const PREFETCH_MAX_MEMORY_FRACTION: f64 = 0.5;

/// `[golden]`: the built-in prompt, how many tokens each answer has, how
/// far a logprob may move (vLLM's snapshot oracle's rule) and how long the
/// whole check may take.
pub(crate) const GOLDEN_PROMPT: &str = "The capital of France is";
pub(crate) const GOLDEN_MAX_TOKENS: u32 = 8;
pub(crate) const GOLDEN_TOLERANCE: f64 = 1e-3;
pub(crate) const GOLDEN_TIMEOUT: Duration = Duration::from_secs(60);
/// `golden.interval`: off (a re-check takes the model out of rotation).
pub(crate) const GOLDEN_INTERVAL: Duration = Duration::ZERO;

/// `[fit]`: how far `--gpu-memory-utilization` moves at a time and
/// between which bounds (vLLM's own default is 0.9), the shortest
/// `--max-model-len` set and the multiple it is rounded down to, and how
/// many adjustments in a row.
pub(crate) use vllm_warden_core::policy::{
    FIT_ATTEMPTS, FIT_MAX_UTILIZATION, FIT_MIN_MODEL_LEN, FIT_MIN_UTILIZATION, FIT_MODEL_LEN_MULTIPLE, FIT_STEP,
};

/// `[rollback]`: how many setups that reached ready are kept.
pub(crate) const ROLLBACK_KEEP: u32 = 10;

/// `[reports]`: how many failure reports are kept, and their total size.
pub(crate) const REPORTS_KEEP: u32 = 20;
pub(crate) const REPORTS_MAX_SIZE: u64 = 200 << 20;
/// The last lines of a failed run's log in its report.
pub(crate) const REPORTS_LINES: u32 = 2000;
/// What one failure report may take in all: the stop of a failed run
/// waits at most this long for it.
pub(crate) const REPORTS_TIMEOUT: Duration = Duration::from_secs(20);
/// A dump of the Python stacks of one process; `{pid}` is its pid.
/// Without pausing it: py-spy's pause (a ptrace stop) fails on a
/// process that is stopped already (`Failed to suspend process`, seen
/// with py-spy 0.4.3 on a SIGSTOPped EngineCore), and a wedged server
/// is exactly what a report is for.
pub(crate) const REPORTS_PY_SPY: [&str; 5] = ["py-spy", "dump", "--nonblocking", "--pid", "{pid}"];
pub(crate) const REPORTS_GPU_SNAPSHOT: [&str; 2] = ["nvidia-smi", "-q"];
/// The kernel's messages since the run's spawn; `{since}` is the spawn
/// in seconds since the epoch.
pub(crate) const REPORTS_KERNEL_MESSAGES: [&str; 6] = ["journalctl", "-k", "-o", "short-iso", "--since", "@{since}"];

/// `[[patch]] max-size`: the largest model file a patch reads.
#[cfg(test)]
pub(crate) const PATCH_MAX_SIZE: u64 = crate::patch::DEFAULT_MAX_SIZE;

/// `server.socket` is this file in the runtime directory (the folder of
/// the default status file).
pub(crate) const SOCKET: &str = "control.sock";
/// How long a drain waits before it looks at the requests in flight:
/// the time a load balancer takes to see `/readyz` fail.
pub(crate) const DRAIN_DELAY: Duration = Duration::from_secs(5);
/// The most a drain waits for the requests in flight to end.
pub(crate) const DRAIN_TIMEOUT: Duration = Duration::from_secs(60);
/// `child.log-max-size`: a day or more of request logging on a busy
/// server; a restart loop writes about 1 KiB a start.
pub(crate) const LOG_MAX_SIZE: u64 = 1 << 30;
pub(crate) const LOG_KEEP: u32 = 3;
pub(crate) const LOG_COMPRESS: bool = true;

/// `front.hold`: long enough for an engine restart with `[preload]`, short
/// enough that a client's own timeout has not given up.
pub(crate) const FRONT_HOLD: Duration = Duration::from_secs(30);
/// `front.max-held`.
pub(crate) const FRONT_MAX_HELD: u32 = 256;
/// `front.max-body`: 32 MiB, room for long prompts and images inline.
pub(crate) const FRONT_MAX_BODY: u64 = 32 << 20;
/// `front.min-body-rate`, bytes a second: 256 kbit/s, under any link a
/// client of a model's API sends from (a 100 MB body over it takes 53
/// minutes), and over what a slow sender that holds a connection cheaply
/// pays (1 KiB every 4 s is 256 B/s).
pub(crate) const FRONT_MIN_BODY_RATE: u64 = 32 << 10;
/// `front.max-connections`.
pub(crate) const FRONT_MAX_CONNECTIONS: u32 = 1024;
/// `front.idle-sleep-level`.
pub(crate) const FRONT_IDLE_SLEEP_LEVEL: u8 = 1;
/// The engine's socket, in a folder of its own under the runtime directory.
pub(crate) const ENGINE_DIR: &str = "engine";
pub(crate) const ENGINE_SOCKET: &str = "engine.sock";
