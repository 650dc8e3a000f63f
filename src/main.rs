fn main() -> std::process::ExitCode {
    let code = vllm_warden::cli::main();
    std::process::ExitCode::from(u8::try_from(code).unwrap_or(70))
}
