fn main() -> std::process::ExitCode {
    vllm_warden::cli::main().into()
}
