//! Where the simulated vLLM is: its own package of the workspace, built
//! into the same folder as the warden (`cargo build` and `cargo nextest
//! run` at the root build both).

use std::path::{Path, PathBuf};

/// `vllm-warden-sim` beside the `warden` binary cargo gave the test or
/// bench; a clear panic, naming the command that builds it, when it is not
/// there.
pub fn beside(warden: &str) -> PathBuf {
    let dir = Path::new(warden).parent().expect("the warden's binary is in a folder");
    let sim = dir.join("vllm-warden-sim");
    if !sim.is_file() {
        let release = dir.ends_with("release");
        panic!(
            "{} is not built: the simulated vLLM is its own package; run `cargo build{} -p vllm-warden-sim` (or `cargo {}` at the workspace root, which builds both)",
            sim.display(),
            if release { " --release" } else { "" },
            if release { "build --release" } else { "nextest run" },
        );
    }
    sim
}
