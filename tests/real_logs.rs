//! Classification on real vLLM 0.32 logs (tests/fixtures/, see its README):
//! every log is fed, byte for byte, through the splitter, the classifier and
//! the state machine, and the verdict is checked against what really happened.

use std::time::Duration;

use vllm_warden::config::{self, Dirs};
use vllm_warden::process::child::Exit;
use vllm_warden::supervisor::Signal;
use vllm_warden::supervisor::classify::{Class, Classifier, Splitter};
use vllm_warden::supervisor::outcome::Phase;
use vllm_warden::supervisor::{Event, Machine, State};

fn lines(name: &str) -> Vec<String> {
    let path = format!("{}/tests/fixtures/{name}.log", env!("CARGO_MANIFEST_DIR"));
    let bytes = std::fs::read(&path).unwrap_or_else(|e| panic!("{path}: {e}"));
    let mut out = Vec::new();
    let mut s = Splitter::default();
    // Odd chunk sizes: lines must not depend on how reads fall.
    for chunk in bytes.chunks(4093) {
        s.push(chunk, &mut out);
    }
    s.push(b"\n", &mut out);
    out
}

fn settings() -> vllm_warden::config::Settings {
    config::parse("[child]\ncommand = [\"vllm\"]\n", std::path::Path::new("t.toml"), &Dirs::default()).unwrap()
}

/// Feed a whole log as one run, then the exit; returns the machine.
fn replay(name: &str, exit: Exit, stop_at: Option<&str>) -> Machine {
    let s = settings();
    let mut c = Classifier::new(&s.patterns).unwrap();
    let mut m = Machine::new(vllm_warden::daemon::policy::policy(&s), 1);
    let now = vllm_warden::util::clock::now();
    m.step(Event::Begin, now);
    m.step(Event::Spawned { start: 1, pid: 10 }, now);
    for text in lines(name) {
        if stop_at.is_some_and(|p| text.contains(p)) {
            m.step(Event::StopRequested, now);
        }
        let line = c.classify(text);
        if line.class == Class::Ready {
            m.step(Event::Line { start: 1, line }, now);
            m.step(Event::HttpReady { start: 1 }, now);
            // The golden check (on by default) passes.
            let verdict = vllm_warden::supervisor::golden::Verdict::Same { prompts: 1, ms: 5 };
            m.step(Event::GoldenChecked { start: 1, verdict }, now);
            continue;
        }
        m.step(Event::Line { start: 1, line }, now);
    }
    m.step(Event::ChildExited { pid: 10, exit }, now + Duration::from_millis(1));
    m
}

fn cause(m: &Machine) -> (String, bool) {
    let c = m.cause().cloned().expect("a cause");
    (c.text, c.permanence.is_permanent())
}

#[test]
fn successful_runs_become_ready_with_no_fatal_line_before_the_stop() {
    for name in ["a_success_sigterm_main", "a_enforce_eager", "b_b3-fixed-kv-cache-scheme-removed"] {
        let s = settings();
        let mut c = Classifier::new(&s.patterns).unwrap();
        let mut ready = false;
        for text in lines(name) {
            if text.contains("[shutdown]") {
                break;
            }
            let l = c.classify(text.clone());
            assert_ne!(l.class, Class::Fatal, "{name}: {text}");
            ready |= l.class == Class::Ready;
        }
        assert!(ready, "{name}: no ready line");
        // The shutdown that follows a stop request logs EngineDeadError: never a failure.
        let m = replay(name, Exit::Code(0), Some("[shutdown] API server: shutdown triggered"));
        assert_eq!(m.phase(), Phase::Stopping, "{name}");
        assert_eq!(m.cause(), None, "{name}");
    }
}

/// Issue 56, the traceback question: a client's request can make vLLM's
/// API server log a traceback (`Error in completion stream generator.`: a
/// streamed completion with a token id out of the vocabulary, a
/// `logit_bias` out of it, a regex or JSON schema xgrammar rejects, one
/// quoting `EngineDeadError CUDA error Traceback (most recent call
/// last)`), and a traceback was a fatal line: one request failed the
/// serving run. The real log of such a corpus (`j_bad_requests`) has no
/// fatal line and its run no failure before the stop; the records are the
/// requests', the exceptions none of the run's.
#[test]
fn a_clients_bad_requests_never_fail_a_serving_run() {
    let s = settings();
    let mut c = Classifier::new(&s.patterns).unwrap();
    let (mut ready, mut tracebacks) = (false, 0);
    for text in lines("j_bad_requests") {
        if text.contains("[shutdown]") {
            break;
        }
        tracebacks += usize::from(text.contains("Traceback (most recent call last)"));
        let l = c.classify(text.clone());
        assert_ne!(l.class, Class::Fatal, "{text}");
        assert_eq!(l.exception, None, "{text}");
        ready |= l.class == Class::Ready;
    }
    assert!(ready && tracebacks >= 10, "{tracebacks} tracebacks");
    let m = replay("j_bad_requests", Exit::Code(0), Some("[shutdown] API server: shutdown triggered"));
    assert_eq!(m.phase(), Phase::Stopping);
    assert_eq!(m.cause(), None);
}

#[test]
fn progress_lines_are_seen_in_a_real_load() {
    let s = settings();
    let mut c = Classifier::new(&s.patterns).unwrap();
    let progress: Vec<String> = lines("a_success_sigterm_main")
        .into_iter()
        .filter_map(|t| if let Class::Progress(p) = c.classify(t).class { Some(p) } else { None })
        .collect();
    for want in [
        "Loading safetensors checkpoint shards: 1/1 (100%)",
        "init engine (profile, create kv cache, warmup model) took",
        "Starting vLLM server on http://0.0.0.0:8011",
    ] {
        assert!(progress.iter().any(|p| p.starts_with(want)), "{want} not in {progress:#?}");
    }
}

#[test]
fn kv_cache_scheme_fp4_names_the_real_exception_and_is_permanent() {
    let m = replay("b_b3-ct-kv-cache-scheme-fp4", Exit::Code(1), None);
    let (text, permanent) = cause(&m);
    assert_eq!(
        text,
        "NotImplementedError: Currently supported kv cache quantization is num_bits=8, type=float, however received num_bits=4, type=float"
    );
    assert!(permanent);
}

#[test]
fn nvfp4_without_a_kernel_is_permanent() {
    let (text, permanent) = cause(&replay("b_b1-nvfp4-hf-quant-config", Exit::Code(1), None));
    assert!(
        text.starts_with("ValueError: Failed to find a kernel that can implement the NVFP4 linear layer"),
        "{text}"
    );
    assert!(permanent);
}

/// No `openssl` on the host (nor a compiler, nor `Python.h`): torch
/// inductor cannot build vLLM's kernels, which no retry fixes; the cause
/// names it and the hint the packages and `--enforce-eager`.
#[test]
fn inductor_without_openssl_is_permanent_with_a_hint() {
    let (text, permanent) = cause(&replay("i_inductor_no_openssl", Exit::Code(1), None));
    assert_eq!(
        text,
        "torch._inductor.exc.InductorError: FileNotFoundError: [Errno 2] No such file or directory: 'openssl'"
    );
    assert!(permanent);
    let hint =
        vllm_warden::supervisor::hints::Hints::new(config::profile::Profile::Vllm, &[], Vec::new(), &[]).find(&text);
    let hint = hint.unwrap();
    assert!(hint.contains("apt install g++ python3-dev openssl") && hint.contains("--enforce-eager"), "{hint}");
    // The compiler and the headers, as torch and Triton say they miss them.
    let mut c = Classifier::new(&settings().patterns).unwrap();
    for line in [
        "torch._inductor.exc.InductorError: InvalidCxxCompiler: No working C++ compiler found in torch._inductor.config.cpp.cxx: (None, 'g++')",
        "RuntimeError: Failed to find C compiler. Please specify via CC environment variable or set triton.knobs.build.impl.",
        "/tmp/tmpa1b2c3/cuda_utils.c:6:10: fatal error: Python.h: No such file or directory",
    ] {
        assert!(c.classify(line.to_string()).permanent.is_some(), "{line}");
    }
}

#[test]
fn no_memory_for_the_kv_cache_is_permanent() {
    let (text, permanent) = cause(&replay("e_kv_cache_zero", Exit::Code(1), None));
    assert!(text.starts_with("ValueError: No available memory for the cache blocks."), "{text}");
    assert!(permanent);
}

#[test]
fn a_malformed_config_json_names_the_outer_exception() {
    let (text, permanent) = cause(&replay("d_config_json_malformed", Exit::Code(1), None));
    assert_eq!(
        text,
        "OSError: It looks like the config file at '/srv/models/d-config-json-malformed/config.json' is not a valid JSON file."
    );
    assert!(permanent);
}

#[test]
fn max_model_len_too_large_is_a_validation_error() {
    let (text, permanent) = cause(&replay("e_max_model_len_too_large", Exit::Code(1), None));
    assert!(
        text.starts_with("pydantic_core._pydantic_core.ValidationError: 1 validation error for ModelConfig"),
        "{text}"
    );
    assert!(permanent);
}

#[test]
fn a_port_in_use_is_worth_a_retry() {
    let (text, permanent) = cause(&replay("c_port_in_use", Exit::Code(1), None));
    assert_eq!(text, "OSError: [Errno 98] Address already in use");
    assert!(!permanent);
}

#[test]
fn engine_death_while_serving_with_exit_0_is_a_failure() {
    let m = replay("f_kill-engine", Exit::Code(0), None);
    // A failed run: its failure report is written before its stop.
    assert!(matches!(m.state(), State::Reporting(_)));
    let (text, permanent) = cause(&m);
    assert!(text.contains("EngineDeadError"), "{text}");
    assert!(!permanent);
}

/// The worker died of SIGILL (as on a CPU with AMX whose process never asked
/// the kernel for tile state): named by its signal, not by the
/// `EngineDeadError` that follows, and permanent (the same instruction is
/// met again by the next run).
#[test]
fn a_worker_killed_by_sigill_is_named_and_permanent() {
    let m = replay("g_worker-sigill", Exit::Code(0), None);
    assert!(matches!(m.state(), State::Reporting(_)));
    assert_eq!(cause(&m), ("engine worker died: illegal instruction (SIGILL)".to_string(), true));
    let hint = m.cause().and_then(|c| c.hint.clone()).expect("a hint");
    assert!(hint.contains("ARCH_REQ_XCOMP_PERM") && hint.contains("--dtype float32"), "{hint}");
}

/// Where the warden sees the signal itself (the API server killed by it).
#[test]
fn a_server_killed_by_sigill_names_the_instruction() {
    let m = replay("sig_kill-main", Exit::Signal(Signal::SIGILL), None);
    assert_eq!(cause(&m).0, "exited while serving (killed by SIGILL: illegal instruction)");
    assert!(m.cause().and_then(|c| c.hint.clone()).expect("a hint").contains("lscpu"));
}

#[test]
fn a_killed_api_server_is_an_exit_cause() {
    let m = replay("sig_kill-main", Exit::Signal(Signal::SIGKILL), None);
    assert_eq!(cause(&m).0, "exited while serving (killed by SIGKILL)");
}

#[test]
fn a_sigterm_during_startup_then_a_stop_is_not_a_failure() {
    let m =
        replay("h_term-main_during_startup_at_15s", Exit::Code(0), Some("[shutdown] API server: shutdown triggered"));
    assert_eq!(m.cause(), None);
}

/// The hint the machine attaches to the cause of each real failure.
fn hint(name: &str) -> Option<String> {
    replay(name, Exit::Code(1), None).cause().and_then(|c| c.hint.clone())
}

#[test]
fn real_failures_carry_their_hints() {
    let kv = hint("b_b3-ct-kv-cache-scheme-fp4").expect("a hint");
    assert!(kv.contains("remove = [\"quantization_config.kv_cache_scheme\"]"), "{kv}");
    assert!(kv.contains("remove = [\"quantization.kv_cache_quant_algo\"]"), "{kv}");
    assert!(hint("e_kv_cache_zero").expect("a hint").contains("--gpu-memory-utilization"));
    assert!(hint("c_port_in_use").expect("a hint").contains("prestart.port-wait"));
    let json = hint("d_config_json_malformed").expect("a hint");
    assert!(json.starts_with("/srv/models/d-config-json-malformed/config.json is not valid JSON"), "{json}");
    assert_eq!(hint("e_max_model_len_too_large"), None, "no hint is made up");
}

/// The load's phases and compile cache as a real load of vLLM 0.32 on a
/// CPU tells them (the full compile: no `--enforce-eager`; its AOT cache
/// there but not loadable on this build, so vLLM compiles again).
#[test]
fn a_real_load_tells_its_phases_and_its_compile_cache() {
    use vllm_warden::supervisor::load::{CacheOutcome, LoadMark, LoadPhase, LoadStart, LoadTrack};
    let s = settings();
    let mut c = Classifier::new(&s.patterns).unwrap();
    let t0 = vllm_warden::util::clock::now();
    let mut track = LoadTrack::new(LoadStart::default(), t0);
    let mut marks = Vec::new();
    for (i, text) in lines("a_success_sigterm_main").into_iter().enumerate() {
        let line = c.classify(text);
        let now = t0 + Duration::from_secs(i as u64);
        for m in &line.load {
            track.mark(m, now);
            marks.push(m.clone());
        }
        if line.class == Class::Ready {
            track.end(LoadPhase::Api, now);
            break;
        }
    }
    let ends: Vec<LoadPhase> =
        marks.iter().filter_map(|m| if let LoadMark::Ends(p) = m { Some(*p) } else { None }).collect();
    assert_eq!(
        ends,
        [LoadPhase::Start, LoadPhase::Weights, LoadPhase::Compile, LoadPhase::KvCache, LoadPhase::Engine],
        "{marks:?}"
    );
    assert!(marks.contains(&LoadMark::WeightsTook { took: Duration::ZERO, bytes: None }), "{marks:?}");
    assert!(marks.contains(&LoadMark::Cache(CacheOutcome::LoadFailure {
        reason: "'function' object has no attribute 'finalize_loading'".into()
    })));
    let r = track.finish(vllm_warden::supervisor::load::LoadOutcome::Ready, 1, t0 + Duration::from_secs(200), 1.5);
    let phases: Vec<LoadPhase> = r.phases.iter().map(|t| t.phase).collect();
    assert_eq!(
        phases,
        [
            LoadPhase::Start,
            LoadPhase::Weights,
            LoadPhase::Compile,
            LoadPhase::KvCache,
            LoadPhase::Engine,
            LoadPhase::Api
        ]
    );
    assert!(r.phases.iter().all(|t| t.secs > 0.0), "{r:?}");
    assert_eq!(r.cache.as_ref().map(CacheOutcome::name), Some("load-failure"));
}

/// The GPU's lines, as vLLM 0.32's source writes them (this machine has no
/// GPU to print them): a compile cache hit, per range and whole (AOT), a
/// compile per range, the model's load and the CUDA graphs.
#[test]
fn the_gpu_lines_of_a_load_are_read_as_vllm_writes_them() {
    use vllm_warden::supervisor::load::{CacheOutcome, LoadMark, LoadPhase};
    let s = settings();
    let mut c = Classifier::new(&s.patterns).unwrap();
    let p = "(EngineCore_DP0 pid=2841) INFO 11-29 18:09:41 [backends.py:296] ";
    let cases: [(&str, Vec<LoadMark>); 6] = [
        (
            "[backbone] Directly load the compiled graph(s) for compile range (1, 8192) from the cache, took 4.312 s",
            vec![LoadMark::Ends(LoadPhase::Compile), LoadMark::Cache(CacheOutcome::Hit)],
        ),
        (
            "[backbone] Directly load AOT compilation from path /c/torch_aot_compile/ab/rank_0_0/model",
            vec![LoadMark::Ends(LoadPhase::Compile), LoadMark::Cache(CacheOutcome::Hit)],
        ),
        (
            "[backbone] Compiling a graph for compile range (1, 8192) takes 61.06 s",
            vec![LoadMark::Ends(LoadPhase::Compile), LoadMark::Cache(CacheOutcome::Miss)],
        ),
        (
            "Model loading took 555.3 GiB memory and 412.118340 seconds",
            vec![
                LoadMark::Ends(LoadPhase::Weights),
                LoadMark::WeightsTook { took: Duration::from_secs_f64(412.11834), bytes: Some(596_248_834_867) },
            ],
        ),
        ("Graph capturing finished in 38 secs, took 1.52 GiB", vec![LoadMark::Ends(LoadPhase::CudaGraphs)]),
        ("torch.compile took 95.35 s in total", vec![LoadMark::Ends(LoadPhase::Compile)]),
    ];
    for (text, want) in cases {
        let mut got = c.classify(format!("{p}{text}")).load;
        got.sort_by_key(|m| format!("{m:?}"));
        let mut want = want;
        want.sort_by_key(|m| format!("{m:?}"));
        assert_eq!(got, want, "{text}");
    }
}
