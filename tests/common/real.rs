//! What the tests against a real vLLM (`real_vllm.rs`) and a real Ray
//! cluster (`real_ray.rs`) share: where vLLM and the models are, the load
//! ceiling and the budgets reckoned from it, and how a tree and a server
//! are looked at.

use std::path::PathBuf;
use std::time::Duration;

use vllm_warden::process::child::ProcStat;

pub fn vllm() -> String {
    std::env::var("VLLM_WARDEN_VLLM").expect("VLLM_WARDEN_VLLM: run tests/real-vllm/run.sh or tests/real-ray/run.sh")
}

pub fn model(name: &str) -> PathBuf {
    PathBuf::from(std::env::var("VLLM_WARDEN_MODELS").expect("VLLM_WARDEN_MODELS")).join(name)
}

/// A load of the tiny model took 20 s on an idle 2-core machine, 32–45 s
/// while the same machine compiled, 37 s for each of two at once; this
/// leaves room for a machine several times slower.
pub const DEFAULT_CEILING: Duration = Duration::from_secs(5 * 60);

/// The longest one load may take here, and where that figure comes from.
pub fn ceiling() -> (Duration, &'static str) {
    match std::env::var("VLLM_WARDEN_LOAD_CEILING") {
        Ok(v) => (
            humantime::parse_duration(&v).unwrap_or_else(|e| panic!("VLLM_WARDEN_LOAD_CEILING={v}: {e}")),
            "VLLM_WARDEN_LOAD_CEILING",
        ),
        Err(_) => (DEFAULT_CEILING, "default"),
    }
}

/// Beyond the loads, stops and backoffs in a wait: the warden's pre-start
/// steps, readiness probe and reaping, and the harness, on a busy machine.
pub const MARGIN: Duration = Duration::from_secs(60);
/// The configs' `fatal.grace`: a child that logged a fatal line may take
/// this long to exit on its own.
pub const GRACE: Duration = Duration::from_secs(30);
/// One one-token completion (the warden's canary, with its timeout).
pub const COMPLETION: Duration = Duration::from_secs(60);
/// A failed run's report before its stop: `reports.timeout` (its default,
/// 20 s) and the 5 s the warden allows beyond it.
pub const REPORT: Duration = Duration::from_secs(25);

/// A wait holding `loads` model loads and `extra` (stops, graces, backoffs).
pub fn budget(loads: u32, extra: Duration) -> Duration {
    ceiling().0 * loads + extra + MARGIN
}

/// The processes of `tree` whose command line contains `title`.
pub fn by_title<'a>(tree: &'a [ProcStat], title: &str) -> Vec<&'a ProcStat> {
    tree.iter()
        .filter(|p| {
            String::from_utf8_lossy(&std::fs::read(format!("/proc/{}/cmdline", p.pid)).unwrap_or_default())
                .contains(title)
        })
        .collect()
}

/// A one-token completion from the server on `port`.
pub fn completion(port: u16) -> Result<(), String> {
    vllm_warden::observe::health::canary(&format!("http://127.0.0.1:{port}"), COMPLETION).map_err(|e| e.to_string())
}
