//! The commands as an operator types them: `check` and `demo`.

use std::process::Command;

fn warden(args: &[&str]) -> (i32, String, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_vllm-warden")).args(args).env_remove("JOURNAL_STREAM").output().unwrap();
    (
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

#[test]
fn check_accepts_a_valid_config_and_prints_the_effective_patterns() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = dir.path().join("kimi.toml");
    std::fs::write(&cfg, "[child]\ncommand = [\"/bin/true\"]\n[fatal]\nmatch = [\"illegal memory access\"]\n").unwrap();
    let (code, out, err) = warden(&["check", "-c", cfg.to_str().unwrap()]);
    assert_eq!(code, 0, "{err}");
    assert!(out.contains("config of instance \"kimi\" is valid"), "{out}");
    assert!(out.contains("fatal:\n  Traceback"), "{out}");
    assert!(out.contains("  illegal memory access\n"), "{out}");
    assert!(out.contains("permanent:\n  No available memory for the cache blocks"), "{out}");
}

#[test]
fn check_lists_every_problem_and_exits_78() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = dir.path().join("bad.toml");
    std::fs::write(
        &cfg,
        "[child]\ncommand = [\"/nonexistent/vllm\"]\nstop-timeout = \"soon\"\n[restart]\nmax-attemps = 3\n",
    )
    .unwrap();
    let (code, _, err) = warden(&["check", "-c", cfg.to_str().unwrap()]);
    assert_eq!(code, 78);
    let f = cfg.display().to_string();
    assert!(err.contains(&format!("{f}:3:16: `stop-timeout`: invalid duration \"soon\"")), "{err}");
    assert!(err.contains(&format!("{f}:5:1: unknown key `max-attemps` in [restart]")), "{err}");
    // The environment's problems beside the file's.
    assert!(err.contains(&format!("{f}: `command`: /nonexistent/vllm: No such file")), "{err}");
    assert!(err.contains("3 problem(s) found"), "{err}");
}

/// The Python that asks a Ray cluster is looked for where the warden will
/// run it: beside the child's program, else on PATH.
#[test]
fn check_reports_a_ray_python_that_is_not_there() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = dir.path().join("x.toml");
    let text = "[child]\ncommand = [\"/bin/true\"]\n[prestart]\nray-address = \"127.0.0.3:6379\"\nray-python = \"no-such-python\"\n";
    std::fs::write(&cfg, text).unwrap();
    let (code, _, err) = warden(&["check", "-c", cfg.to_str().unwrap()]);
    assert_eq!(code, 78);
    assert!(
        err.contains("`prestart.ray-python`: \"no-such-python\" not found beside \"/bin/true\" nor in PATH"),
        "{err}"
    );
    assert!(err.contains("1 problem(s) found"), "{err}");
    // Beside the child's program: found.
    let bin = dir.path().join("bin");
    std::fs::create_dir(&bin).unwrap();
    for name in ["server", "no-such-python"] {
        std::fs::write(bin.join(name), "#!/bin/sh\n").unwrap();
        std::fs::set_permissions(bin.join(name), std::os::unix::fs::PermissionsExt::from_mode(0o755)).unwrap();
    }
    let text = text.replace("/bin/true", &bin.join("server").to_string_lossy());
    std::fs::write(&cfg, text).unwrap();
    let (code, _, err) = warden(&["check", "-c", cfg.to_str().unwrap()]);
    assert_eq!(code, 0, "{err}");
}

#[test]
fn check_reports_a_program_that_is_not_there() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = dir.path().join("x.toml");
    std::fs::write(&cfg, "[child]\ncommand = [\"no-such-vllm-binary\"]\n").unwrap();
    let (code, _, err) = warden(&["check", "-c", cfg.to_str().unwrap()]);
    assert_eq!(code, 78);
    assert!(err.contains("program \"no-such-vllm-binary\" not found in PATH"), "{err}");
}

#[test]
fn config_comes_from_the_environment_when_not_given() {
    let (code, _, err) = Command::new(env!("CARGO_BIN_EXE_vllm-warden"))
        .arg("check")
        .env("VLLM_WARDEN_CONFIG", "/nonexistent/w.toml")
        .output()
        .map(|o| (o.status.code().unwrap(), (), String::from_utf8_lossy(&o.stderr).into_owned()))
        .unwrap();
    assert_eq!(code, 78);
    assert!(err.contains("/nonexistent/w.toml: cannot read config"), "{err}");
}

#[test]
fn run_with_an_invalid_config_exits_78() {
    let (code, _, err) = warden(&["run", "-c", "/nonexistent/w.toml"]);
    assert_eq!(code, 78);
    assert!(err.contains("cannot read config"), "{err}");
}

#[test]
fn demo_runs_the_whole_lifecycle() {
    let (code, out, err) = warden(&["demo"]);
    assert_eq!(code, 0, "{out}\n{err}");
    assert_eq!(out.matches("systemd <- READY=1").count(), 2, "{out}");
    assert!(out.contains("Loading safetensors checkpoint shards: 4/8 (50%)"), "{out}");
    assert!(out.contains("STATUS=applying 1 patch(es)"), "{out}");
    assert!(out.contains("STATUS=restarting in "), "{out}");
    assert!(out.contains("STOPPING=1"), "{out}");
    assert!(out.contains("the warden exited with code 0"), "{out}");
}

#[test]
fn check_refuses_a_token_file_every_user_can_read() {
    use std::os::unix::fs::PermissionsExt;
    let dir = tempfile::tempdir().unwrap();
    let token = dir.path().join("token");
    std::fs::write(&token, "s3cret\n").unwrap();
    std::fs::set_permissions(&token, std::fs::Permissions::from_mode(0o644)).unwrap();
    let cfg = dir.path().join("kimi.toml");
    std::fs::write(
        &cfg,
        format!(
            "[child]\ncommand = [\"/bin/true\"]\n[server]\nlisten = \"127.0.0.1:9400\"\ntoken-file = \"{}\"\n",
            token.display()
        ),
    )
    .unwrap();
    let (code, _, err) = warden(&["check", "-c", cfg.to_str().unwrap()]);
    assert_eq!(code, 78, "{err}");
    assert!(err.contains(&format!("`server.token-file`: {}: readable by every user", token.display())), "{err}");
    assert!(!err.contains("s3cret"), "the token is never shown: {err}");
    std::fs::set_permissions(&token, std::fs::Permissions::from_mode(0o600)).unwrap();
    let (code, _, err) = warden(&["check", "-c", cfg.to_str().unwrap()]);
    assert_eq!(code, 0, "{err}");
}
