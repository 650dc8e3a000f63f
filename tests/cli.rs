//! The commands as an operator types them: `check`, `demo`, instances by
//! name and the host's list, control with a broken config, a closed pipe,
//! the shell completion, permissions.

mod common;
#[path = "support/nobody.rs"]
mod nobody;

use std::path::Path;
use std::process::Command;

use common::{Warden, config};

fn warden(args: &[&str]) -> (i32, String, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_vllm-warden")).args(args).env_remove("JOURNAL_STREAM").output().unwrap();
    (
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

#[test]
fn check_says_its_verdict_first_then_where_things_live_and_the_patterns_when_asked() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = dir.path().join("kimi.toml");
    std::fs::write(&cfg, "[child]\ncommand = [\"/bin/true\"]\n[fatal]\nmatch = [\"illegal memory access\"]\n").unwrap();
    let (code, out, err) = warden(&["check", "-c", cfg.to_str().unwrap()]);
    assert_eq!(code, 0, "{err}");
    let mut lines = out.lines();
    assert_eq!(lines.next().unwrap(), format!("{}: config of instance \"kimi\" is valid", cfg.display()), "{out}");
    assert_eq!(lines.next().unwrap(), "state: /var/lib/vllm-warden/kimi", "{out}");
    assert!(out.contains("\nlog: /var/log/vllm-warden/kimi.log\n"), "{out}");
    assert!(out.contains("\ncontrol socket: /run/vllm-warden/kimi/control.sock\n"), "{out}");
    assert!(!out.contains("Traceback"), "the pattern lists only when asked: {out}");
    let (code, out, err) = warden(&["check", "--print-patterns", "-c", cfg.to_str().unwrap()]);
    assert_eq!(code, 0, "{err}");
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
    assert!(
        err.contains(&format!("{f}:5:1: unknown key `max-attemps` in [restart]: did you mean `max-attempts`?")),
        "{err}"
    );
    // The environment's problems beside the file's.
    assert!(err.contains(&format!("{f}: `command`: /nonexistent/vllm: No such file")), "{err}");
    assert!(err.ends_with("\n3 problems found\n"), "{err}");
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
    assert!(err.ends_with("\n1 problem found\n"), "{err}");
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
    // Issue 56: its first screen was 13 warnings of 340 characters about
    // the caches it put in its own temporary folder.
    let said = format!("{out}{err}");
    assert!(!said.contains("EVENT=\"caches\"") && !said.contains("temporary folder"), "{said}");
    assert_eq!(out.matches("systemd <- READY=1").count(), 2, "{out}");
    assert!(out.contains("Loading safetensors checkpoint shards: 4/8 (50%)"), "{out}");
    assert!(out.contains("STATUS=applying 1 patch"), "{out}");
    // One timeout extension a phase, not one a status.
    let extensions = out.matches("EXTEND_TIMEOUT_USEC=").count();
    let statuses = out.matches("STATUS=").count();
    assert!(extensions > 0 && extensions * 2 < statuses, "{extensions} extensions for {statuses} statuses:\n{out}");
    // What it names is kept, its runtime folder included, and it says so.
    let kept = out.lines().find_map(|l| l.strip_prefix("demo: kept in ")).unwrap_or_else(|| panic!("{out}"));
    let dir = std::path::Path::new(kept.split(':').next().unwrap());
    assert!(dir.join("demo.log").is_file() && dir.join("demo.toml").is_file(), "{out}");
    assert!(dir.join("run").is_dir(), "its runtime folder is its own: {out}");
    assert!(out.contains("demo: next: "), "{out}");
    std::fs::remove_dir_all(dir).unwrap();
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

/// A command on a config file, with the instance's environment as the
/// unit gives it (its state and runtime folders): its exit code, stdout
/// and stderr.
fn on(exe: &Path, w: &Warden, args: &[&str]) -> (i32, String, String) {
    let out = Command::new(exe)
        .args(args)
        .arg("-c")
        .arg(w.path("t.toml"))
        .env("STATE_DIRECTORY", w.path("state"))
        .env("RUNTIME_DIRECTORY", w.path("run"))
        .env_remove("JOURNAL_STREAM")
        .output()
        .unwrap();
    (
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

const FAST: &str = "[restart]\ninitial-delay = \"0s\"\n[drain]\ndelay = \"0s\"\n";

/// Issue 44: a typo in the config, before any reload, made `status`,
/// `drain` and `upgrade` exit 78 while the model served. They need only
/// the instance's name and folders: they warn and work, and the upgraded
/// warden goes on with the config the model was started with.
#[test]
fn a_broken_config_does_not_take_the_control_of_a_serving_model() {
    // The warden runs from a copy of the binary, which the upgrade runs again.
    let bin = tempfile::tempdir().unwrap();
    let exe = bin.path().join("vllm-warden");
    std::fs::copy(common::exe(), &exe).unwrap();
    let opts = common::Opts { exe: Some(exe.clone()), ..Default::default() };
    let mut w = Warden::start_with(|d, p| config(d, p, &["--shards", "1"], "", FAST), opts);
    w.wait_ready();
    // Not TOML any more: the name is still read.
    let good = std::fs::read_to_string(w.path("t.toml")).unwrap();
    std::fs::write(w.path("t.toml"), good.replace("[child]", "[child")).unwrap();
    let warned = |err: &str| err.contains("warning: ") && err.contains("going on as instance \"t\"");

    let (code, out, err) = on(&exe, &w, &["status"]);
    assert_eq!(code, 0, "{out}{err}");
    assert!(out.starts_with("t: ready"), "{out}");
    assert!(warned(&err) && err.lines().count() == 1, "one warning line: {err}");

    let (code, out, err) = on(&exe, &w, &["drain"]);
    assert_eq!(code, 0, "{out}{err}");
    assert!(warned(&err), "{err}");
    w.wait_note("drained", |n| n.starts_with("STATUS=drained: pid "));
    let (code, out, err) = on(&exe, &w, &["undrain"]);
    assert_eq!(code, 0, "{out}{err}");

    let (code, out, err) = on(&exe, &w, &["upgrade"]);
    assert_eq!(code, 0, "{out}{err}");
    assert!(warned(&err), "{err}");
    w.wait_note("the upgrade", |n| n.starts_with("STATUS=upgraded from"));
    // The new warden re-checks the answers of what it took over first.
    w.wait_note("back in rotation", |n| n.contains("; back in rotation after "));
    let (code, out, _) = on(&exe, &w, &["status"]);
    assert_eq!(code, 0, "the model still serves, under the upgraded warden: {out}");

    // `run` and `check` still refuse the file.
    let (code, _, err) = on(&exe, &w, &["check"]);
    assert_eq!(code, 78, "{err}");
    std::fs::write(w.path("t.toml"), good).unwrap();
    assert_eq!(w.stop(), 0);
}

/// A config for the folder of configs: the warden's own, with its control
/// socket named (the list asks every warden there).
fn named_config(d: &Path, p: u16, name: &str) -> String {
    let server = format!("{FAST}[server]\nsocket = \"{}\"\n", d.join("run/control.sock").display());
    config(d, p, &["--shards", "1"], "", &server).replacen("name = \"t\"", &format!("name = \"{name}\""), 1)
}

/// Instances by name (`NAME.toml` in `$VLLM_WARDEN_CONFIG_DIR`) and the
/// host's list: one running, one stopped, one never started; `-c` after
/// the subcommand; output into a closed pipe.
#[test]
fn instances_have_names_and_the_host_lists_them() {
    let configs = tempfile::tempdir().unwrap();
    let mut one = Warden::start(|d, p| named_config(d, p, "one"));
    let mut two = Warden::start(|d, p| named_config(d, p, "two"));
    one.wait_ready();
    two.wait_ready();
    assert_eq!(two.stop(), 0);
    std::fs::copy(one.path("t.toml"), configs.path().join("one.toml")).unwrap();
    std::fs::copy(two.path("t.toml"), configs.path().join("two.toml")).unwrap();
    std::fs::write(configs.path().join("three.toml"), "[child]\ncommand = [\"/bin/true\"]\n").unwrap();
    let cli = |args: &[&str]| {
        let o = Command::new(common::exe())
            .args(args)
            .env("VLLM_WARDEN_CONFIG_DIR", configs.path())
            .env_remove("VLLM_WARDEN_CONFIG")
            .output()
            .unwrap();
        (
            o.status.code().unwrap(),
            String::from_utf8_lossy(&o.stdout).into_owned(),
            String::from_utf8_lossy(&o.stderr).into_owned(),
        )
    };

    let (code, out, err) = cli(&["status", "one"]);
    assert_eq!(code, 0, "{out}{err}");
    assert!(out.starts_with("one: ready, pid "), "{out}");
    assert_eq!(cli(&["status", "two"]).0, 4);
    let (code, out, _) = cli(&["status", "three"]);
    assert_eq!((code, out.starts_with("three: not running (no status file /")), (4, true), "{out}");
    let (code, _, err) = cli(&["status"]);
    assert_eq!(code, 2, "no name and three instances: {err}");
    assert!(
        err.contains("instances on this host (") && ["one", "two", "three"].iter().all(|n| err.contains(n)),
        "{err}"
    );
    let (code, _, err) = cli(&["status", "../one"]);
    assert_eq!(code, 2, "{err}");

    let (code, out, err) = cli(&["list"]);
    assert_eq!(code, 0, "{err}");
    let line = |name: &str| {
        out.lines()
            .find(|l| l.split_whitespace().next() == Some(name))
            .unwrap_or_else(|| panic!("{name}: {out}"))
            .to_string()
    };
    assert!(out.starts_with("NAME "), "{out}");
    let child = one.descendants().into_iter().find(|p| p.ppid == one.pid as i32).unwrap().pid;
    let l = line("one");
    assert!(
        l.contains(" ready ") && l.contains(&format!(" {child} ")) && l.contains(&format!(":{} ", one.port)),
        "{l}"
    );
    assert!(l.matches(" ready").count() == 2, "the state and the last load: {l}");
    assert!(line("two").contains(" stopped "), "{out}");
    assert!(line("three").contains(" not running "), "{out}");
    let (code, json, _) = cli(&["status", "--all", "--json"]);
    assert_eq!(code, 0);
    let rows: serde_json::Value = serde_json::from_str(&json).unwrap();
    let row = |name: &str| rows.as_array().unwrap().iter().find(|r| r["name"] == name).unwrap().clone();
    assert_eq!(row("one")["state"], "ready", "{json}");
    assert_eq!(row("one")["pid"], child, "{json}");
    assert_eq!(row("one")["warden_pid"], one.pid, "{json}");
    assert_eq!(row("one")["last_load"], "ready", "{json}");
    assert_eq!(row("two")["state"], "stopped", "{json}");
    assert_eq!(row("three")["state"], "not running", "{json}");

    // `-c` anywhere: after the subcommand's own subcommand too.
    let cfg = one.path("t.toml");
    let o = Command::new(common::exe())
        .args(["reports", "list", "-c"])
        .arg(&cfg)
        .env("STATE_DIRECTORY", one.path("state"))
        .output()
        .unwrap();
    assert_eq!(o.status.code(), Some(0), "{}", String::from_utf8_lossy(&o.stderr));

    // Into a pipe whose reader is gone (`… | head -1` once it has its
    // line): a quiet exit with success, no panic.
    for args in [&["loads"][..], &["status", "--json"], &["list"], &["--help"]] {
        let (read, write) = nix::unistd::pipe().unwrap();
        drop(read);
        let o = Command::new(common::exe())
            .args(args)
            .arg("-c")
            .arg(&cfg)
            .env("STATE_DIRECTORY", one.path("state"))
            .env("VLLM_WARDEN_CONFIG_DIR", configs.path())
            .stdout(std::process::Stdio::from(write))
            .output()
            .unwrap();
        let err = String::from_utf8_lossy(&o.stderr);
        assert_eq!(o.status.code(), Some(0), "{args:?}: {err}");
        assert!(!err.contains("panicked"), "{args:?}: {err}");
    }
    assert_eq!(one.stop(), 0);
}

/// The bash completion completes past the first word (clap#6421: a
/// hyphenated name made every state of the script spelt two ways).
#[test]
fn the_bash_completion_completes_every_level() {
    let dir = tempfile::tempdir().unwrap();
    let (code, _, err) = warden(&["assets", dir.path().to_str().unwrap()]);
    assert_eq!(code, 0, "{err}");
    let script = dir.path().join("completions/vllm-warden.bash");
    let ask = |words: &[&str]| {
        let cword = words.len() - 1;
        let quoted: Vec<String> = words.iter().map(|w| format!("'{w}'")).collect();
        let body = format!(
            "source '{}'\nCOMP_WORDS=({})\nCOMP_CWORD={cword}\nf=$(complete -p vllm-warden | sed -E 's/.*-F ([^ ]+) .*/\\1/')\n\"$f\" vllm-warden '{}' '{}'\necho \"${{COMPREPLY[*]}}\"\n",
            script.display(),
            quoted.join(" "),
            words[cword],
            words[cword - 1]
        );
        let o = Command::new("bash").arg("-c").arg(body).output().unwrap();
        assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
        String::from_utf8_lossy(&o.stdout).split_whitespace().map(String::from).collect::<Vec<_>>()
    };
    let loads = ask(&["vllm-warden", "loads", ""]);
    for w in ["list", "show", "compare"] {
        assert!(loads.contains(&w.to_string()), "vllm-warden loads <Tab>: {loads:?}");
    }
    let status = ask(&["vllm-warden", "status", "-"]);
    for w in ["--json", "--all", "--config"] {
        assert!(status.contains(&w.to_string()), "vllm-warden status -<Tab>: {status:?}");
    }
    let show = ask(&["vllm-warden", "setups", "diff", "-"]);
    assert!(show.contains(&"--config".to_string()), "vllm-warden setups diff -<Tab>: {show:?}");
}

/// For a test that runs the warden as [`nobody::UID`]: a folder that user
/// can reach and a copy of the binary in it; `None`, said SKIPPED with
/// `why` root is needed, when not root or no such folder can be had.
fn as_nobody(why: &str) -> Option<(tempfile::TempDir, std::path::PathBuf)> {
    if !nix::unistd::geteuid().is_root() {
        eprintln!("SKIPPED: needs root, {why} (uid {})", nobody::UID);
        return None;
    }
    match nobody::tempdir() {
        Ok(dir) => {
            let exe = nobody::copy_binary(common::exe(), dir.path());
            Some((dir, exe))
        }
        Err(why) => {
            eprintln!("SKIPPED: {why}");
            None
        }
    }
}

/// A user who may not read the state folder is told so, with 77: not "no
/// setup has reached ready yet" and 0, not "none", not 70.
#[test]
fn records_this_user_may_not_read_are_said_so() {
    use std::os::unix::fs::PermissionsExt;
    use std::os::unix::process::CommandExt;
    let Some((dir, exe)) = as_nobody("to run the commands as another user") else { return };
    let state = dir.path().join("state");
    std::fs::create_dir_all(state.join("setups")).unwrap();
    std::fs::set_permissions(&state, std::fs::Permissions::from_mode(0o700)).unwrap();
    let cfg = dir.path().join("kimi.toml");
    let text =
        format!("[child]\ncommand = [\"/bin/true\"]\n[status]\nfile = \"{}\"\n", state.join("status.json").display());
    std::fs::write(&cfg, text).unwrap();
    std::fs::set_permissions(&cfg, std::fs::Permissions::from_mode(0o644)).unwrap();
    for what in [&["setups"][..], &["loads"], &["reports"], &["golden"], &["upgrade"], &["status"]] {
        let o = Command::new(&exe)
            .args(what)
            .arg("-c")
            .arg(&cfg)
            .env("STATE_DIRECTORY", &state)
            .env_remove("RUNTIME_DIRECTORY")
            .uid(nobody::UID)
            .gid(nobody::UID)
            .output()
            .unwrap();
        let (out, err) = (String::from_utf8_lossy(&o.stdout), String::from_utf8_lossy(&o.stderr));
        assert_eq!(o.status.code(), Some(77), "{what:?}: {out}{err}");
        assert!(err.contains("permission denied"), "{what:?}: {err}");
        assert!(!out.contains("no setup") && !out.contains("not running"), "{what:?}: {out}");
    }
}

/// A command run with its output in files, waited for with `wait4` under
/// [`common::TIMEOUT`] (killed, and `None`, when it does not end): its
/// exit code, stdout, stderr and its peak resident memory in KiB. Its
/// address space is capped at 1 GiB, so that a command that reads without
/// bound fails here instead of filling the machine's memory.
// The child is reaped by `wait4`, for its resource usage, not by `Child::wait`.
#[allow(clippy::zombie_processes)]
fn measured(args: &[&str], env: &[(&str, &Path)]) -> Option<(i32, String, String, u64)> {
    use std::os::unix::process::CommandExt;
    let out = tempfile::tempdir().unwrap();
    let (o, e) = (out.path().join("out"), out.path().join("err"));
    let mut cmd = Command::new(common::exe());
    cmd.args(args)
        .env_remove("JOURNAL_STREAM")
        .env_remove("VLLM_WARDEN_CONFIG")
        .stdin(std::process::Stdio::null())
        .stdout(std::fs::File::create(&o).unwrap())
        .stderr(std::fs::File::create(&e).unwrap());
    for (k, v) in env {
        cmd.env(k, v);
    }
    // SAFETY: setrlimit is async-signal-safe.
    unsafe {
        cmd.pre_exec(|| {
            let cap = libc::rlimit { rlim_cur: 1 << 30, rlim_max: 1 << 30 };
            if libc::setrlimit(libc::RLIMIT_AS, &cap) != 0 {
                return Err(std::io::Error::last_os_error());
            }
            Ok(())
        });
    }
    let child = cmd.spawn().unwrap();
    let pid = child.id() as libc::pid_t;
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let (mut status, mut usage) = (0, unsafe { std::mem::zeroed::<libc::rusage>() });
        // SAFETY: waits for our own child; both pointers are to locals.
        let r = unsafe { libc::wait4(pid, &mut status, 0, &mut usage) };
        assert_eq!(r, pid);
        let code = if libc::WIFEXITED(status) { libc::WEXITSTATUS(status) } else { -libc::WTERMSIG(status) };
        let _ = tx.send((code, usage.ru_maxrss as u64));
    });
    let Ok((code, rss)) = rx.recv_timeout(common::TIMEOUT) else {
        let _ = nix::sys::signal::kill(nix::unistd::Pid::from_raw(pid), nix::sys::signal::Signal::SIGKILL);
        return None;
    };
    std::mem::forget(child);
    Some((code, std::fs::read_to_string(o).unwrap(), std::fs::read_to_string(e).unwrap(), rss))
}

/// The resident memory a command may reach on a file it must refuse.
const RSS_CAP_KIB: u64 = 64 << 10;

/// Files that are not configs: a FIFO, a link to `/dev/zero`, a 1 GB
/// sparse file. Each is made in `dir` as `NAME.toml`.
fn not_configs(dir: &Path, name: &str) -> Vec<(&'static str, std::path::PathBuf)> {
    let fifo = dir.join(format!("fifo-{name}"));
    nix::unistd::mkfifo(&fifo, nix::sys::stat::Mode::from_bits_truncate(0o644)).unwrap();
    let zero = dir.join(format!("zero-{name}"));
    std::os::unix::fs::symlink("/dev/zero", &zero).unwrap();
    let huge = dir.join(format!("huge-{name}"));
    std::fs::File::create(&huge).unwrap().set_len(1 << 30).unwrap();
    vec![
        ("a FIFO (named pipe), not a regular file", fifo),
        ("a character device, not a regular file", zero),
        ("1073741824 bytes, over the limit of ", huge),
    ]
}

/// Issue 56 B5: a FIFO config hung `status` and `drain` for ever,
/// `/dev/zero` grew `undrain` and `reload` to 22.9 GB, a 1 GB file aborted
/// on a 7.3 GB allocation. Each command now refuses the file at once, in
/// little memory, and says what it is; the commands that work under a
/// broken config go on as the instance of the file's name.
#[test]
fn a_config_that_is_a_fifo_a_device_or_huge_is_refused_at_once_in_little_memory() {
    let d = tempfile::tempdir().unwrap();
    let (state, run) = (d.path().join("state"), d.path().join("run"));
    let env = [("STATE_DIRECTORY", state.as_path()), ("RUNTIME_DIRECTORY", run.as_path())];
    let mut peak = Vec::new();
    for (said, file) in not_configs(d.path(), "cfg") {
        let cfg = d.path().join("kimi.toml");
        let _ = std::fs::remove_file(&cfg);
        std::os::unix::fs::symlink(&file, &cfg).unwrap();
        let cfg = cfg.to_str().unwrap();
        for (cmd, want) in [("status", 4), ("drain", 4), ("undrain", 4), ("reload", 4), ("loads", 0), ("check", 78)] {
            let (code, out, err, rss) = measured(&[cmd, "-c", cfg], &env)
                .unwrap_or_else(|| panic!("`{cmd}` on {} did not end", file.display()));
            assert_eq!(code, want, "`{cmd}` on {}: {out}{err}", file.display());
            assert!(
                err.contains(&format!("{cfg}: cannot read config: {said}")),
                "`{cmd}` on {}: {err}",
                file.display()
            );
            assert!(rss < RSS_CAP_KIB, "`{cmd}` on {}: {rss} KiB", file.display());
            if cmd != "check" {
                assert!(err.contains("going on as instance \"kimi\""), "`{cmd}`: {err}");
            }
            peak.push((cmd, file.file_name().unwrap().to_string_lossy().into_owned(), rss));
        }
    }
    eprintln!("peak resident memory (KiB): {peak:?}");
}

/// Issue 56 B5: `list` hung on a FIFO `status.json` and spent 2.1 GB on
/// `/dev/zero`. The status file is refused at once and said so: `status`
/// exits 4 with the reason, `list` shows the state as unknown and why.
#[test]
fn a_status_file_that_is_a_fifo_a_device_or_huge_is_refused_at_once_in_little_memory() {
    let d = tempfile::tempdir().unwrap();
    let configs = d.path().join("configs");
    std::fs::create_dir(&configs).unwrap();
    let env = [("VLLM_WARDEN_CONFIG_DIR", configs.as_path())];
    let mut peak = Vec::new();
    for (said, file) in not_configs(d.path(), "status") {
        let text = format!(
            "[child]\ncommand = [\"/bin/true\"]\n[status]\nfile = \"{}\"\n[server]\nsocket = \"{}\"\n",
            file.display(),
            d.path().join("control.sock").display()
        );
        std::fs::write(configs.join("kimi.toml"), text).unwrap();
        let (code, out, err, rss) =
            measured(&["list", "--json"], &env).unwrap_or_else(|| panic!("`list` on {} did not end", file.display()));
        assert_eq!(code, 0, "{out}{err}");
        let rows: serde_json::Value = serde_json::from_str(&out).unwrap();
        assert_eq!(rows[0]["state"], "unknown", "{out}");
        assert!(rows[0]["unknown"].as_str().unwrap().contains(said), "{out}");
        assert!(rss < RSS_CAP_KIB, "`list` on {}: {rss} KiB", file.display());
        peak.push(("list", file.file_name().unwrap().to_string_lossy().into_owned(), rss));
        let (code, out, err, rss) =
            measured(&["status", "kimi"], &env).unwrap_or_else(|| panic!("`status` on {} did not end", file.display()));
        assert_eq!(code, 4, "{out}{err}");
        assert!(err.contains(&format!("its status file {} cannot be read: {said}", file.display())), "{err}");
        assert!(rss < RSS_CAP_KIB, "`status` on {}: {rss} KiB", file.display());
        peak.push(("status", file.file_name().unwrap().to_string_lossy().into_owned(), rss));
    }
    eprintln!("peak resident memory (KiB): {peak:?}");
}

/// Issue 56 B6: `name = ".."` was refused, but a file named `...toml` was
/// instance `..` (state `/var/lib/vllm-warden/..`, control socket
/// `/run/control.sock`), and a file's name with a newline or an escape
/// was a name too. One rule for a name from anywhere: every command
/// refuses such a file, and says why.
#[test]
fn an_instance_named_after_its_file_is_held_to_the_rule_of_names() {
    let d = tempfile::tempdir().unwrap();
    let text = "[child]\ncommand = [\"/bin/true\"]\n";
    for stem in ["..", "a\nb", "a\u{1b}[31mb"] {
        let cfg = d.path().join(format!("{stem}.toml"));
        std::fs::write(&cfg, text).unwrap();
        let cfg = cfg.to_str().unwrap();
        for (cmd, want) in [("check", 78), ("run", 78), ("status", 2), ("drain", 2), ("loads", 2), ("upgrade", 2)] {
            let (code, out, err) = warden(&[cmd, "-c", cfg]);
            assert_eq!(code, want, "`{cmd}` on {stem:?}: {out}{err}");
            assert!(err.contains("is not an instance name (letters, digits"), "`{cmd}` on {stem:?}: {err}");
            assert!(!err.contains('\u{1b}'), "`{cmd}`: the escape is shown escaped: {err:?}");
            assert!(!err.contains("going on as instance"), "`{cmd}` on {stem:?}: {err}");
            assert!(!out.contains("/run/control.sock") && !err.contains("/run/control.sock"), "{out}{err}");
        }
        // A `name` in the file names the instance: its file's name is then only a file's.
        std::fs::write(d.path().join(format!("{stem}.toml")), format!("name = \"kimi\"\n{text}")).unwrap();
        let (code, out, err) = warden(&["check", "-c", cfg]);
        assert_eq!(code, 0, "{out}{err}");
        assert!(out.contains("config of instance \"kimi\" is valid"), "{out}");
    }
    let (code, _, err) = warden(&["status", ".."]);
    assert_eq!(code, 2, "{err}");
    assert!(err.contains("\"..\" is not an instance name"), "{err}");
}

/// Issue 56: a typo in the instance's name (`drain kimmi`) read as "not
/// running", exit 4, the documented "nothing to do": a `preStop: drain`
/// with a typo skipped its drain. A name with no config, no state and no
/// runtime folder is no instance: said, with the known ones, and 2.
#[test]
fn a_name_that_is_no_instance_is_said_so_not_taken_for_one_not_running() {
    let d = tempfile::tempdir().unwrap();
    let configs = d.path().join("configs");
    std::fs::create_dir(&configs).unwrap();
    std::fs::write(configs.join("kimi.toml"), "[child]\ncommand = [\"/bin/true\"]\n").unwrap();
    let (state, run) = (d.path().join("state"), d.path().join("run"));
    let cli = |args: &[&str], state: &Path| {
        let o = Command::new(common::exe())
            .args(args)
            .env("VLLM_WARDEN_CONFIG_DIR", &configs)
            .env("STATE_DIRECTORY", state)
            .env("RUNTIME_DIRECTORY", &run)
            .env_remove("VLLM_WARDEN_CONFIG")
            .output()
            .unwrap();
        (o.status.code().unwrap(), String::from_utf8_lossy(&o.stderr).into_owned())
    };
    for cmd in ["drain", "undrain", "restart", "reload", "status", "upgrade", "loads", "check", "run"] {
        let (code, err) = cli(&[cmd, "kimmi"], &state);
        assert_eq!(code, 2, "`{cmd} kimmi`: {err}");
        assert!(err.contains("no instance \"kimmi\" (known: kimi)"), "`{cmd} kimmi`: {err}");
    }
    // The instance that is there but not running: 4, as before.
    assert_eq!(cli(&["drain", "kimi"], &state).0, 4);
    // No config, but a state folder: an instance that ran (its config
    // removed since) is still one.
    std::fs::create_dir(&state).unwrap();
    let (code, err) = cli(&["drain", "kimmi"], &state);
    assert_eq!(code, 4, "{err}");
}

/// Issue 56: a `front.listen` or `server.listen` port already taken
/// passed `check`; `run` exited 78 without naming the holder and left its
/// control socket behind, which `list` then showed as an instance.
/// `check` names the holder, by pid and command line, as the port check
/// before a start does; so does `run`, which leaves no socket.
#[test]
fn a_listen_address_already_taken_is_named_with_its_holder_and_leaves_nothing_behind() {
    let holder = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let taken = holder.local_addr().unwrap();
    let me = std::process::id();
    for (key, top, section) in [
        ("front.listen", "profile = \"none\"\n", format!("[front]\nlisten = [\"{taken}\"]\n")),
        ("server.listen", "", format!("[server]\nlisten = \"{taken}\"\n")),
    ] {
        let d = tempfile::tempdir().unwrap();
        let (state, run) = (d.path().join("state"), d.path().join("run"));
        let text =
            format!("{top}{}{section}", common::config(d.path(), common::free_port(), &["--shards", "1"], "", ""));
        let cfg = d.path().join("t.toml");
        std::fs::write(&cfg, text).unwrap();
        let cmd = |what: &str| {
            let o = Command::new(common::exe())
                .args([what, "-c"])
                .arg(&cfg)
                .env("STATE_DIRECTORY", &state)
                .env("RUNTIME_DIRECTORY", &run)
                .env_remove("JOURNAL_STREAM")
                .env_remove("NOTIFY_SOCKET")
                .output()
                .unwrap();
            (o.status.code().unwrap_or(-1), String::from_utf8_lossy(&o.stderr).into_owned())
        };
        let held = format!("port {} is held by pid {me} (", taken.port());
        let (code, err) = cmd("check");
        assert_eq!(code, 78, "{key}: {err}");
        assert!(err.contains(&format!("`{key}` {taken}: {held}")), "{key}: {err}");
        let (code, err) = cmd("run");
        assert_eq!(code, 78, "{key}: {err}");
        assert!(err.contains(&held), "{key}: the holder is named: {err}");
        let socket = run.join("control.sock");
        assert!(!socket.exists(), "{key}: no control socket is left behind: {err}");
    }
    drop(holder);
}

/// A holder the user running `check` cannot see (another user's process:
/// under the shipped unit `check` runs as the service user, and across
/// `systemctl restart` the front door's sockets wait in systemd's store,
/// held by PID 1) is left to `run`: `check` does not fail the start on it.
#[test]
fn check_leaves_a_holder_it_cannot_see_to_run() {
    use std::os::unix::fs::PermissionsExt;
    use std::os::unix::process::CommandExt;
    let Some((dir, exe)) = as_nobody("to hold the port as another user than the check's") else { return };
    let holder = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let taken = holder.local_addr().unwrap();
    let state = dir.path().join("state");
    std::fs::create_dir_all(&state).unwrap();
    nix::unistd::chown(&state, Some(nix::unistd::Uid::from_raw(nobody::UID)), None).unwrap();
    let cfg = dir.path().join("kimi.toml");
    let text = format!(
        "[child]\ncommand = [\"/bin/true\"]\n[status]\nfile = \"{}\"\n[server]\nlisten = \"{taken}\"\n",
        state.join("status.json").display()
    );
    std::fs::write(&cfg, text).unwrap();
    std::fs::set_permissions(&cfg, std::fs::Permissions::from_mode(0o644)).unwrap();
    let o = Command::new(&exe)
        .args(["check", "-c"])
        .arg(&cfg)
        .env("STATE_DIRECTORY", &state)
        .env_remove("RUNTIME_DIRECTORY")
        .uid(nobody::UID)
        .gid(nobody::UID)
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(!err.contains("`server.listen`"), "a holder this user cannot see is left to `run`: {err}");
    drop(holder);
}

/// Issue 56: `loads show NAME` and `golden diff NAME` refused the NAME
/// after the subcommand's own subcommand, though `-c` goes anywhere. It
/// goes there too, after the IDs; a lone word that cannot be an ID is the
/// NAME; a NAME given twice is a usage error.
#[test]
fn the_name_goes_after_a_subcommands_own_subcommand_too() {
    let d = tempfile::tempdir().unwrap();
    std::fs::write(d.path().join("kimi.toml"), "[child]\ncommand = [\"/bin/true\"]\n").unwrap();
    let cli = |args: &[&str]| {
        let o = Command::new(common::exe())
            .args(args)
            .env("VLLM_WARDEN_CONFIG_DIR", d.path())
            .env_remove("VLLM_WARDEN_CONFIG")
            .env_remove("STATE_DIRECTORY")
            .output()
            .unwrap();
        let text = format!("{}{}", String::from_utf8_lossy(&o.stdout), String::from_utf8_lossy(&o.stderr));
        (o.status.code().unwrap(), text)
    };
    let state = "/var/lib/vllm-warden/kimi";
    for (args, code, said) in [
        (&["loads", "show", "kimi"][..], 1, format!("no load in {state}/loads.jsonl")),
        (&["loads", "show", "3", "kimi"], 1, format!("no load 3 in {state}/loads.jsonl")),
        (&["loads", "kimi", "show", "3"], 1, format!("no load 3 in {state}/loads.jsonl")),
        (&["loads", "list", "kimi"], 0, format!("no loads in {state}/loads.jsonl")),
        (&["loads", "compare", "1", "2", "kimi"], 1, format!("no load 1 in {state}/loads.jsonl")),
        (&["golden", "diff", "kimi"], 1, "no golden answers to compare yet".into()),
        (&["golden", "show", "kimi"], 0, "no golden check yet".into()),
        (&["reports", "show", "kimi"], 1, format!("no failure report in {state}/reports")),
        (&["reports", "list", "kimi"], 0, format!("no failure reports in {state}/reports")),
        (&["setups", "show", "kimi"], 1, "no setup has reached ready yet".into()),
        (&["setups", "diff", "kimi"], 1, "no setup has reached ready yet".into()),
        (&["loads", "kimi", "show", "kimi"], 2, "the instance is named twice".into()),
        (&["loads", "show", "x", "kimi"], 2, "\"x\" is not a load's ID".into()),
    ] {
        let (got, text) = cli(args);
        assert_eq!(got, code, "{args:?}: {text}");
        assert!(text.contains(&said), "{args:?}: {text}");
    }
}

/// Issue 56: a user of the source found no completions (`completions` was
/// unknown; the generator was a hidden `assets DIR`). `completions SHELL`
/// prints the script the package installs; `assets DIR` writes the man
/// pages and every script, and is listed.
#[test]
fn completions_are_printed_for_each_shell_and_the_assets_are_listed() {
    let dir = tempfile::tempdir().unwrap();
    let (code, _, err) = warden(&["assets", dir.path().to_str().unwrap()]);
    assert_eq!(code, 0, "{err}");
    for (shell, file, first) in [
        ("bash", "vllm-warden.bash", "_vllm_warden() {"),
        ("zsh", "_vllm-warden", "#compdef vllm-warden"),
        ("fish", "vllm-warden.fish", ""),
    ] {
        let (code, out, err) = warden(&["completions", shell]);
        assert_eq!(code, 0, "{shell}: {err}");
        assert_eq!(out, std::fs::read_to_string(dir.path().join("completions").join(file)).unwrap(), "{shell}");
        assert!(out.starts_with(first) && out.contains("completions"), "{shell}: {out}");
    }
    assert!(dir.path().join("man/vllm-warden.8").is_file() && dir.path().join("man/vllm-warden.toml.5").is_file());
    let (_, help, _) = warden(&["--help"]);
    assert!(help.contains("\n  completions ") && help.contains("\n  assets "), "{help}");
    let (code, _, err) = warden(&["completions", "tcsh"]);
    assert_eq!(code, 2, "{err}");
}

/// Issue 56 B5: `check` opened the token file blocking, so a FIFO there
/// held it for ever. It is refused at once.
#[test]
fn check_refuses_a_token_file_that_is_a_fifo_at_once() {
    let d = tempfile::tempdir().unwrap();
    let token = d.path().join("token");
    nix::unistd::mkfifo(&token, nix::sys::stat::Mode::from_bits_truncate(0o600)).unwrap();
    let cfg = d.path().join("kimi.toml");
    let text = format!(
        "[child]\ncommand = [\"/bin/true\"]\n[server]\nlisten = \"127.0.0.1:0\"\ntoken-file = \"{}\"\n",
        token.display()
    );
    std::fs::write(&cfg, text).unwrap();
    let state = d.path().join("state");
    let (code, out, err, rss) = measured(&["check", "-c", cfg.to_str().unwrap()], &[("STATE_DIRECTORY", &state)])
        .expect("`check` on a FIFO token file did not end");
    assert_eq!(code, 78, "{out}{err}");
    assert!(err.contains(&format!("`server.token-file`: {}: not a regular file", token.display())), "{err}");
    assert!(rss < RSS_CAP_KIB, "{rss} KiB");
}
