//! The simulated vLLM starts and names itself. Having a test, the package
//! gets its binary built by `cargo nextest run` at the workspace root,
//! beside the warden's, where the warden's tests look for it.

#[test]
fn the_simulator_starts_and_names_itself() {
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_vllm-warden-sim")).arg("--version").output().unwrap();
    assert!(out.status.success(), "{out:?}");
    assert!(String::from_utf8_lossy(&out.stdout).starts_with("vllm-warden-sim "), "{out:?}");
}
