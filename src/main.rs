fn main() -> std::process::ExitCode {
    let code = vllm_warden::cli::main();
    // The warden's own log is written by a thread of its own: its last
    // events go out before the process ends.
    vllm_warden::util::logging::flush(std::time::Duration::from_secs(2));
    code.into()
}
