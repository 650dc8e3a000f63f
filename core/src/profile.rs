//! The built-in profiles: which log lines mean ready, progress, fatal,
//! benign and permanent, for vLLM and for the two roles of a Ray node. Only
//! the lists live here; how they are matched belongs to the supervisor's
//! classifier.
//!
//! Every pattern is a regular expression searched anywhere in a line whose
//! ANSI codes have been stripped. The lists come from real vLLM logs (see
//! `tests/fixtures/`, vLLM 0.32 on CPU) and from the messages in vLLM's own
//! source for failures that only happen on GPUs.

/// Pattern lists of one profile, or the effective lists after a config's
/// additions.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Patterns {
    /// A line matching one of these, then the HTTP check, means ready.
    pub ready: Vec<String>,
    /// Lines that show the load is moving (shown in `STATUS=`, restart the
    /// stall deadline).
    pub(crate) progress: Vec<String>,
    /// Lines that mean this run is lost.
    pub fatal: Vec<String>,
    /// Lines that are never fatal, whatever else they match.
    pub(crate) ignore: Vec<String>,
    /// Causes that a retry cannot fix; a line matching one is fatal too.
    pub(crate) permanent: Vec<String>,
    /// What lines tell of a load's phases and its compile cache (the load
    /// ledger); not changed by a config.
    pub load: Vec<(LoadSignal, String)>,
    /// The server's own words for one request that failed, at the start of
    /// a prefixed line's message: the log record such a line begins (every
    /// line of it carries the same prefix: the traceback under it, its
    /// exception, the chained ones) is the request's, never a fatal line,
    /// whatever it quotes. Not changed by a config.
    pub(crate) request_errors: Vec<String>,
}

/// The phases of a model's load, in their order: the process starts (and
/// its engine and workers), the weights are read, the model is compiled,
/// memory is profiled and the KV cache made, CUDA graphs are captured, the
/// engine warms up, the API server comes up, the HTTP check passes, and
/// the golden answers are checked.
/// A phase ends at its last line (see [`LoadSignal::Ends`]); a load on a
/// CPU, or with `--enforce-eager`, skips some.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum LoadPhase {
    Start,
    Weights,
    Compile,
    KvCache,
    CudaGraphs,
    Engine,
    Api,
    Http,
    Golden,
}

impl LoadPhase {
    pub const ALL: [LoadPhase; 9] = [
        LoadPhase::Start,
        LoadPhase::Weights,
        LoadPhase::Compile,
        LoadPhase::KvCache,
        LoadPhase::CudaGraphs,
        LoadPhase::Engine,
        LoadPhase::Api,
        LoadPhase::Http,
        LoadPhase::Golden,
    ];

    pub fn name(self) -> &'static str {
        match self {
            LoadPhase::Start => "start",
            LoadPhase::Weights => "weights",
            LoadPhase::Compile => "compile",
            LoadPhase::KvCache => "kv-cache",
            LoadPhase::CudaGraphs => "cuda-graphs",
            LoadPhase::Engine => "engine",
            LoadPhase::Api => "api",
            LoadPhase::Http => "http",
            LoadPhase::Golden => "golden",
        }
    }

    /// What the phase is, in a few words, for `loads show`.
    pub fn words(self) -> &'static str {
        match self {
            LoadPhase::Start => "process start, engine and workers up",
            LoadPhase::Weights => "weights read",
            LoadPhase::Compile => "torch.compile (or its cache)",
            LoadPhase::KvCache => "memory profiling, KV cache",
            LoadPhase::CudaGraphs => "CUDA graph capture",
            LoadPhase::Engine => "engine warm-up",
            LoadPhase::Api => "API server up",
            LoadPhase::Http => "HTTP check",
            LoadPhase::Golden => "golden answers",
        }
    }
}

impl std::fmt::Display for LoadPhase {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// What a line tells of a load.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LoadSignal {
    /// The phase's work is done (a later line of the same phase, before a
    /// later phase ended, moves its end).
    Ends(LoadPhase),
    /// The compiled model came from the cache.
    CacheHit,
    /// The model was compiled (and saved): nothing in the cache.
    CacheMiss,
    /// A cached compile was found and could not be loaded; the capture
    /// `reason` says why.
    CacheLoadFailure,
    /// vLLM's compile cache is off.
    CacheDisabled,
    /// vLLM's own time for reading the weights: captures `secs`, and `gib`
    /// where it gives the size.
    WeightsTook,
}

/// One of the five lists of [`Patterns`], by name.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum List {
    Ready,
    Progress,
    Fatal,
    Ignore,
    Permanent,
}

impl List {
    pub const ALL: [List; 5] = [List::Ready, List::Progress, List::Fatal, List::Ignore, List::Permanent];

    pub fn name(self) -> &'static str {
        match self {
            List::Ready => "ready",
            List::Progress => "progress",
            List::Fatal => "fatal",
            List::Ignore => "ignore",
            List::Permanent => "permanent",
        }
    }
}

impl Patterns {
    pub fn list(&self, which: List) -> &Vec<String> {
        match which {
            List::Ready => &self.ready,
            List::Progress => &self.progress,
            List::Fatal => &self.fatal,
            List::Ignore => &self.ignore,
            List::Permanent => &self.permanent,
        }
    }

    pub fn list_mut(&mut self, which: List) -> &mut Vec<String> {
        match which {
            List::Ready => &mut self.ready,
            List::Progress => &mut self.progress,
            List::Fatal => &mut self.fatal,
            List::Ignore => &mut self.ignore,
            List::Permanent => &mut self.permanent,
        }
    }
}

/// The profiles a config can name with `profile = "…"`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Profile {
    Vllm,
    /// `ray start --head --block`: the Ray head node of a cluster.
    RayHead,
    /// `ray start --address=HEAD:PORT --block`: a node that joins it.
    RayWorker,
    None,
}

impl Profile {
    pub fn parse(name: &str) -> Option<Profile> {
        match name {
            "vllm" => Some(Profile::Vllm),
            "ray-head" => Some(Profile::RayHead),
            "ray-worker" => Some(Profile::RayWorker),
            "none" => Some(Profile::None),
            _ => None,
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            Profile::Vllm => "vllm",
            Profile::RayHead => "ray-head",
            Profile::RayWorker => "ray-worker",
            Profile::None => "none",
        }
    }

    /// The names `profile = "…"` accepts.
    pub const NAMES: [&'static str; 4] = ["vllm", "ray-head", "ray-worker", "none"];

    /// A Ray node, whose readiness is confirmed by the cluster and whose
    /// session folders are cleaned.
    pub fn is_ray(self) -> bool {
        matches!(self, Profile::RayHead | Profile::RayWorker)
    }

    pub fn patterns(self) -> Patterns {
        match self {
            Profile::None => Patterns::default(),
            Profile::Vllm => vllm(),
            Profile::RayHead | Profile::RayWorker => ray(self),
        }
    }

    /// Globs in the temporary folders: every vLLM run leaves a
    /// `vllm_dist_*` file (its torch.distributed rendezvous) behind.
    pub fn temp_globs(self) -> Vec<String> {
        match self {
            Profile::None | Profile::RayHead | Profile::RayWorker => Vec::new(),
            Profile::Vllm => to_strings(&["vllm_dist_*"]),
        }
    }

    /// Globs in `/dev/shm` that vLLM and Python's multiprocessing leave
    /// behind after a crash: `psm_*` (shared memory), `sem.mp-*`
    /// (semaphores), `vllm_*`, and `*-cpushm_*` (the CPU backend's segment
    /// per tensor-parallel group, `IDENT-NAME-[0-1]-cpushm_RANK`). On Ray,
    /// vLLM's workers run in the Ray nodes' trees: a node's warden cleans
    /// the same files. (Ray's own object store file is unlinked as soon as
    /// it is mapped.)
    pub fn shm_globs(self) -> Vec<String> {
        match self {
            Profile::None => Vec::new(),
            Profile::Vllm | Profile::RayHead | Profile::RayWorker => {
                to_strings(&["psm_*", "sem.mp-*", "vllm_*", "*-cpushm_*"])
            }
        }
    }
}

/// vLLM's line when the engine sees one of its worker processes end,
/// `Worker proc VllmWorker-0 died unexpectedly (exit code: -4), shutting
/// down executor.`: a negative code is the signal that killed it (here
/// SIGILL), which the cause then names.
pub(crate) const WORKER_DIED: &str = r"Worker proc \S+ died unexpectedly \(exit code: -(\d+)\)";

fn to_strings(list: &[&str]) -> Vec<String> {
    list.iter().map(|s| s.to_string()).collect()
}

fn vllm() -> Patterns {
    Patterns {
        // uvicorn prints this on stderr once the OpenAI server accepts requests.
        ready: to_strings(&["Application startup complete"]),
        progress: to_strings(&[
            r"Initializing a V1 LLM engine",
            r"Starting to load model",
            r"Loading safetensors checkpoint shards:\s+\d+% Completed",
            r"Loading weights took",
            r"Model loading took",
            r"Memory profiling takes",
            r"Available KV cache memory",
            r"KV cache size:",
            r"Capturing CUDA graphs",
            r"Graph capturing finished",
            r"init engine .* took",
            r"Starting vLLM server on",
            r"Waiting for application startup",
        ]),
        fatal: to_strings(&[
            r"Traceback \(most recent call last\)",
            r"EngineCore failed to start",
            r"WorkerProc failed to start",
            r"Engine core initialization failed",
            r"EngineCore encountered a fatal error",
            r"engine core exited unexpectedly",
            r"EngineDeadError",
            r"died unexpectedly",
            r"NCCL error",
            r"CUDA out of memory",
            r"CUDA error",
            r"Fatal Python error",
        ]),
        ignore: to_strings(&[
            // A warning at exit of Python's multiprocessing, not a failure.
            r"resource_tracker: There appear to be \d+ leaked",
            // A cache miss of torch.compile's artefacts: vLLM compiles again.
            r"Compiling model again due to a load failure",
        ]),
        permanent: to_strings(&[
            r"No available memory for the cache blocks",
            r"is larger than the available KV cache memory",
            r"No valid attention backend found",
            r"Currently supported kv cache quantization",
            r"Failed to find a kernel that can implement",
            r"is not a valid JSON file",
            r"validation errors? for (ModelConfig|VllmConfig|CacheConfig|ParallelConfig|SchedulerConfig)",
            // A worker killed by SIGILL: an instruction this CPU or kernel
            // refuses, met again at the same point of every run.
            r"died unexpectedly \(exit code: -4\)",
            // torch inductor cannot build its kernels on this host (vLLM
            // compiles unless --enforce-eager): no C++ compiler, no
            // `openssl` (it hashes the precompiled header with it), no
            // Python headers for Triton's launcher. No retry installs them.
            r"InductorError: FileNotFoundError: .*No such file or directory: '(openssl|g\+\+|gcc|c\+\+|cc|clang\+\+|clang)'",
            r"InvalidCxxCompiler|No working C\+\+ compiler found",
            r"Failed to find C compiler",
            r"Python\.h: No such file or directory",
        ]),
        load: vllm_load(),
        request_errors: vllm_request_errors(),
    }
}

/// vLLM's API server's messages for a request that failed, each logged
/// with its traceback (`logger.exception`) while the server serves on
/// (vLLM 0.32, `entrypoints/`): a streamed answer's error (a token id out of
/// the vocabulary, a `logit_bias` or structured-output schema it rejects,
/// found once the stream has begun), the other APIs' request errors, and
/// with `--log-error-stack` every error answered to a client. A client
/// writes them at will: one request must not fail a serving run. The
/// engine's death is told by its own lines and the server's exit.
fn vllm_request_errors() -> Vec<String> {
    to_strings(&[
        // completion, chat completion, transcription, translation
        r"Error in [a-z ]*stream generator\.",
        r"Error in parser creation\.",
        r"Error in token generation stream\.",
        r"Error in message stream converter\.",
        r"Error converting chat completion stream to v2",
        r"Error in (?:create_messages|count_tokens|/cohere/v2/chat(?:/render)?): ",
        r"Error (?:preparing request components|building prompts|during generation)$",
        r"(?:HTTPException|RequestValidationError|Engine Exception) caught\. Request id: ",
    ])
}

/// vLLM's lines for the phases of a load and its compile cache, from its
/// source (0.32: `model_loader/`, `compilation/`, `v1/worker/`,
/// `v1/engine/core.py`) and the real logs of `tests/fixtures/`. The API
/// phase ends at the ready line and the HTTP phase at the HTTP check: the
/// supervisor ends those two itself.
fn vllm_load() -> Vec<(LoadSignal, String)> {
    use LoadPhase as P;
    use LoadSignal as S;
    let list: &[(LoadSignal, &str)] = &[
        (S::Ends(P::Start), r"Starting to load model"),
        (S::Ends(P::Start), r"Loading model from scratch"),
        (S::Ends(P::Weights), r"Loading weights took"),
        (S::Ends(P::Weights), r"Model loading took"),
        (S::WeightsTook, r"Loading weights took (?<secs>[0-9.]+) seconds"),
        (S::WeightsTook, r"Model loading took (?<gib>[0-9.]+) GiB memory and (?<secs>[0-9.]+) seconds"),
        // The compile: AOT (the whole model) or per compile range.
        (S::Ends(P::Compile), r"saved AOT compiled function to"),
        (S::Ends(P::Compile), r"Directly load AOT compilation from path"),
        (S::Ends(P::Compile), r"torch\.compile took [0-9.]+ s in total"),
        (S::Ends(P::Compile), r"torch\.compile and initial profiling/warmup run together took"),
        (S::Ends(P::Compile), r"Compiling a graph for compile range .* takes"),
        (S::Ends(P::Compile), r"Directly load the compiled graph\(s\) for compile range"),
        (S::CacheHit, r"Directly load AOT compilation from path"),
        (S::CacheHit, r"Directly load the compiled graph\(s\) for compile range"),
        (S::CacheMiss, r"saved AOT compiled function to"),
        (S::CacheMiss, r"Compiling a graph for compile range .* takes"),
        (S::CacheLoadFailure, r"Compiling model again due to a load failure from .*, reason: (?<reason>.*)"),
        (S::CacheDisabled, r"vLLM's torch\.compile cache is disabled"),
        (S::Ends(P::KvCache), r"Memory profiling takes"),
        (S::Ends(P::KvCache), r"Available KV cache memory"),
        (S::Ends(P::KvCache), r"KV cache size:"),
        (S::Ends(P::CudaGraphs), r"Graph capturing finished"),
        (S::Ends(P::Engine), r"init engine .* took"),
    ];
    list.iter().map(|(s, p)| (*s, p.to_string())).collect()
}

/// `ray start --block`, head or joining node: what it prints on its
/// stdout and stderr (Ray's own processes log into the session folder).
fn ray(role: Profile) -> Patterns {
    let mut fatal = to_strings(&[
        // `--block` watches its processes: one ended, the rest are killed.
        r"Some Ray subprocesses exited unexpectedly",
        r"Remaining processes will be killed",
        r"Traceback \(most recent call last\)",
    ]);
    if role == Profile::RayWorker {
        // A joining node that cannot reach the head it was started for
        // (the gate saw it answer): fail now, wait at the gate again.
        fatal.push(r"Failed to connect to GCS at address".to_string());
    }
    Patterns {
        ready: to_strings(&[r"Ray runtime started"]),
        progress: to_strings(&[r"Local node IP:", r"Usage stats collection"]),
        fatal,
        ignore: Vec::new(),
        load: Vec::new(),
        request_errors: Vec::new(),
        permanent: to_strings(&[
            // click's usage errors: the command line itself is wrong.
            r"^Error: (No such option|Invalid value|Missing option|Got unexpected extra argument)",
        ]),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_builtin_pattern_compiles() {
        for profile in [Profile::Vllm, Profile::RayHead, Profile::RayWorker] {
            let p = profile.patterns();
            for which in List::ALL {
                for pat in p.list(which) {
                    regex::Regex::new(pat).unwrap_or_else(|e| panic!("{pat}: {e}"));
                }
            }
        }
    }

    /// Each Ray pattern against a line `ray start --block` wrote (Ray
    /// 2.56.1, tab and colour codes as the warden strips them).
    #[test]
    fn every_ray_pattern_matches_a_real_line() {
        let real = [
            (List::Ready, "2026-11-30 16:49:05,258 SUCC scripts.py:1082 -- Ray runtime started."),
            (List::Progress, "2026-11-30 16:49:00,991 INFO scripts.py:1042 -- Local node IP: 127.0.0.3"),
            (
                List::Progress,
                "2026-11-30 16:49:00,991 INFO usage_lib.py:474 -- Usage stats collection is enabled by default without user confirmation",
            ),
            (List::Fatal, "2026-11-30 17:09:42,138 ERR scripts.py:1304 -- Some Ray subprocesses exited unexpectedly:"),
            (List::Fatal, "2026-11-30 17:09:42,139 ERR scripts.py:1311 -- Remaining processes will be killed."),
            (List::Fatal, "Traceback (most recent call last):"),
            (
                List::Fatal,
                "[2026-11-30 17:16:18,596 W 17542 17542] rpc_client.h:153: Failed to connect to GCS at address 127.0.0.3:6399 within 5 seconds.",
            ),
            (List::Permanent, "Error: No such option '--bogus'. Did you mean '--verbose'?"),
            (List::Permanent, "Error: Invalid value for '--port': 'abc' is not a valid integer."),
        ];
        let worker = Profile::RayWorker.patterns();
        for which in List::ALL {
            for pat in worker.list(which) {
                let re = regex::Regex::new(pat).unwrap();
                assert!(
                    real.iter().any(|(l, line)| *l == which && re.is_match(line)),
                    "no real line for the {} pattern {pat}",
                    which.name()
                );
            }
        }
        // The head does not fail on a GCS it runs itself.
        assert!(!Profile::RayHead.patterns().fatal.iter().any(|p| p.contains("GCS")));
    }

    #[test]
    fn none_has_no_patterns() {
        assert_eq!(Profile::None.patterns(), Patterns::default());
        assert!(Profile::None.shm_globs().is_empty());
    }
}
