//! Where the child writes, and what keeps it from starting, as the service
//! user sees it: the caches under the cache directory (an operator's
//! choice winning), vLLM's sockets in the runtime directory, and `check`
//! naming an interpreter the user cannot run, a model folder without its
//! config, a model of the hub that an offline start cannot find.

mod common;
#[path = "support/nobody.rs"]
mod nobody;

use std::os::unix::fs::PermissionsExt;
use std::os::unix::process::CommandExt;
use std::path::Path;
use std::process::{Command, Output};

use common::{Opts, Warden, config};

/// Every variable the warden may set, unset for the warden under test, so
/// that the runner's own environment does not decide.
const NAMES: &[&str] = &[
    "XDG_CACHE_HOME",
    "XDG_CONFIG_HOME",
    "VLLM_CONFIG_ROOT",
    "VLLM_CACHE_ROOT",
    "TORCHINDUCTOR_CACHE_DIR",
    "TRITON_CACHE_DIR",
    "TRITON_HOME",
    "CUDA_CACHE_PATH",
    "FLASHINFER_WORKSPACE_BASE",
    "TVM_FFI_CACHE_DIR",
    "DG_JIT_CACHE_DIR",
    "HF_MODULES_CACHE",
    "NUMBA_CACHE_DIR",
    "OUTLINES_CACHE_DIR",
    "MPLCONFIGDIR",
    "VLLM_RPC_BASE_PATH",
    "HF_HOME",
    "HF_HUB_CACHE",
    "HF_HUB_OFFLINE",
    "TRANSFORMERS_OFFLINE",
];

fn clean_env() -> Vec<String> {
    let mut w = vec!["env".to_string()];
    for n in NAMES {
        w.push("-u".into());
        w.push(n.to_string());
    }
    w
}

fn environ(pid: u64) -> Vec<(String, String)> {
    let raw = std::fs::read(format!("/proc/{pid}/environ")).unwrap();
    raw.split(|b| *b == 0)
        .filter_map(|kv| String::from_utf8_lossy(kv).split_once('=').map(|(k, v)| (k.to_string(), v.to_string())))
        .collect()
}

#[test]
fn the_child_writes_under_the_cache_and_runtime_directories_and_an_operators_choice_wins() {
    let opts =
        Opts { wrapper: clean_env(), env: vec![("HOME".into(), "/var/lib/vllm-warden".into())], ..Opts::default() };
    // The test's folder is known only once made: the config names the
    // cache directory (`child.cache-dir`; `check`'s test takes it from
    // CACHE_DIRECTORY).
    let mut w = Warden::start_with(
        |d, port| {
            let extra = format!(
                "cache-dir = \"{}/cache\"\nenv = {{ TORCHINDUCTOR_CACHE_DIR = \"{}/mine\" }}",
                d.display(),
                d.display()
            );
            config(d, port, &["--shards", "1"], &extra, "")
        },
        opts,
    );
    w.wait_ready();
    let d = w.dir.path().to_path_buf();
    let doc: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(w.path("status.json")).unwrap()).unwrap();
    let env = environ(doc["child_pid"].as_u64().unwrap());
    let get = |k: &str| env.iter().find(|(n, _)| n == k).map(|(_, v)| v.clone());
    let cache = d.join("cache");
    assert_eq!(get("XDG_CACHE_HOME"), Some(cache.display().to_string()));
    assert_eq!(get("VLLM_CACHE_ROOT"), Some(cache.join("vllm").display().to_string()));
    assert_eq!(get("TORCHINDUCTOR_CACHE_DIR"), Some(d.join("mine").display().to_string()), "child.env wins");
    assert_eq!(get("TRITON_HOME"), Some(cache.display().to_string()));
    assert_eq!(get("TRITON_CACHE_DIR"), None, "left to vLLM, which keeps Triton's kernels per model");
    assert_eq!(get("VLLM_RPC_BASE_PATH"), Some(d.join("run/vllm-ipc").display().to_string()));
    assert_eq!(get("HF_HOME").as_deref(), Some("/var/lib/vllm-warden/.cache/huggingface"), "the hub stays put");
    for sub in ["vllm", "tvm-ffi", "config/vllm"] {
        let m = std::fs::metadata(cache.join(sub)).unwrap();
        assert!(m.is_dir() && m.permissions().mode() & 0o077 == 0, "{sub}: made, 0700");
    }
    assert!(!d.join("mine").exists(), "an operator's folder is theirs to make");
    assert_eq!(doc["cache"]["dir"].as_str(), Some(cache.to_str().unwrap()));
    w.stop();
}

/// A program named `vllm` (it is `/bin/true`): the model of `vllm serve`
/// is looked at only for vLLM's own command lines.
fn fake_vllm(d: &Path) -> std::path::PathBuf {
    let bin = d.join("bin");
    std::fs::create_dir_all(&bin).unwrap();
    let vllm = bin.join("vllm");
    std::fs::copy("/bin/true", &vllm).unwrap();
    std::fs::set_permissions(&bin, std::fs::Permissions::from_mode(0o755)).unwrap();
    vllm
}

fn check(cfg: &Path, env: &[(&str, &str)]) -> Output {
    Command::new(common::exe()).arg("check").arg("-c").arg(cfg).env_clear().envs(env.iter().copied()).output().unwrap()
}

fn text(o: &Output) -> (String, String) {
    (String::from_utf8_lossy(&o.stdout).into_owned(), String::from_utf8_lossy(&o.stderr).into_owned())
}

#[test]
fn check_lists_the_childs_folders_and_names_one_it_cannot_write() {
    let dir = common::tempdir();
    let d = dir.path();
    let cfg = d.join("m.toml");
    std::fs::write(d.join("file"), "").unwrap();
    std::fs::write(&cfg, "[child]\ncommand = [\"/bin/true\"]\n").unwrap();
    let state = d.join("state");
    let env = |cache: &Path| {
        vec![
            ("CACHE_DIRECTORY", cache.to_str().unwrap().to_string()),
            ("RUNTIME_DIRECTORY", d.join("run").to_str().unwrap().to_string()),
            ("STATE_DIRECTORY", state.to_str().unwrap().to_string()),
            ("HOME", "/home/op".to_string()),
        ]
    };
    let owned = env(&d.join("cache"));
    let o = check(&cfg, &owned.iter().map(|(k, v)| (*k, v.as_str())).collect::<Vec<_>>());
    let (out, err) = text(&o);
    assert!(o.status.success(), "{out}{err}");
    assert!(out.contains(&format!("  VLLM_CACHE_ROOT={}/cache/vllm (set by the warden)\n", d.display())), "{out}");
    assert!(out.contains(&format!("  VLLM_RPC_BASE_PATH={}/run/vllm-ipc (set by the warden)\n", d.display())), "{out}");
    assert!(out.contains("  HF_HOME=/home/op/.cache/huggingface (set by the warden)\n"), "{out}");
    // A cache directory that is a file: every folder under it is named.
    let owned = env(&d.join("file"));
    let o = check(&cfg, &owned.iter().map(|(k, v)| (*k, v.as_str())).collect::<Vec<_>>());
    let (_, err) = text(&o);
    assert_eq!(o.status.code(), Some(78), "{err}");
    assert!(
        err.contains(&format!("XDG_CACHE_HOME={}/file: is a regular file, not a folder for uid", d.display())),
        "{err}"
    );
    assert!(err.contains("CacheDirectory="), "{err}");
    // A cache in a temporary folder: a warning, not a problem.
    let owned = env(Path::new("/tmp/vllm-warden-test-never-made"));
    let o = check(&cfg, &owned.iter().map(|(k, v)| (*k, v.as_str())).collect::<Vec<_>>());
    let (out, err) = text(&o);
    assert!(o.status.success(), "{out}{err}");
    assert!(err.contains("warning: XDG_CACHE_HOME=/tmp/vllm-warden-test-never-made is in a temporary folder"), "{err}");
}

#[test]
fn check_names_a_model_folder_without_its_config_and_an_offline_hub_model_not_in_the_cache() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let cfg = d.join("m.toml");
    let state = d.join("state");
    let state_env = [("STATE_DIRECTORY", state.to_str().unwrap())];
    std::fs::create_dir_all(d.join("model")).unwrap();
    let vllm = fake_vllm(d);
    // `vllm serve MODEL`, with `env` (TOML) in [child].
    let write = |model: &str, env: &str| {
        let text = format!("[child]\ncommand = [\"{}\", \"serve\", \"{model}\"]\nenv = {{ {env} }}\n", vllm.display());
        std::fs::write(&cfg, text).unwrap();
    };
    write(&format!("{}/model", d.display()), "");
    let o = check(&cfg, &state_env);
    let (_, err) = text(&o);
    assert_eq!(o.status.code(), Some(78), "{err}");
    assert!(err.contains(&format!("model {}/model: has no config.json for uid", d.display())), "{err}");
    std::fs::write(d.join("model/config.json"), "{}").unwrap();
    let (out, err) = text(&check(&cfg, &state_env));
    assert!(out.contains(&format!("model {}/model: a local folder", d.display())), "{out}{err}");

    let hub = d.join("hub");
    write("org/m", &format!("HF_HUB_OFFLINE = \"1\", HF_HUB_CACHE = \"{}\"", hub.display()));
    let o = check(&cfg, &state_env);
    let (_, err) = text(&o);
    assert_eq!(o.status.code(), Some(78), "{err}");
    assert!(
        err.contains(&format!(
            "model org/m: not in the hub cache ({}/models--org--m is missing) and HF_HUB_OFFLINE=1 forbids a download",
            hub.display()
        )),
        "{err}"
    );
    // Online, a hub cache the user cannot write: said, not refused.
    std::fs::write(d.join("a-file"), "").unwrap();
    write("org/m", &format!("HF_HUB_CACHE = \"{}/a-file/hub\"", d.display()));
    let o = check(&cfg, &state_env);
    let (out, err) = text(&o);
    assert!(o.status.success(), "{out}{err}");
    assert!(
        err.contains("warning: model org/m: the hub cache")
            && err.contains("a download (a missing or changed file) would fail"),
        "{err}"
    );
    write("org/m", &format!("HF_HUB_OFFLINE = \"1\", HF_HUB_CACHE = \"{}\"", hub.display()));
    std::fs::create_dir_all(hub.join("models--org--m")).unwrap();
    let o = check(&cfg, &state_env);
    let (out, err) = text(&o);
    assert!(o.status.success(), "{out}{err}");
    assert!(
        out.contains(&format!(
            "model org/m: from the Hugging Face hub, offline (HF_HUB_OFFLINE=1), read from {}",
            hub.display()
        )),
        "{out}"
    );
}

/// For a test that runs the warden as nobody: a folder nobody can reach,
/// with a copy of the binary in it; `None` (the test says why it did not
/// run) when not root or no such folder can be made. What the test makes
/// from then on is readable by nobody whatever the host's umask (027 or
/// 077 on hardened hosts): nextest runs each test in a process of its own,
/// so the umask set here touches no other test.
fn as_nobody() -> Option<(tempfile::TempDir, std::path::PathBuf)> {
    nix::sys::stat::umask(nix::sys::stat::Mode::from_bits_truncate(0o022));
    if !nix::unistd::geteuid().is_root() {
        eprintln!("SKIPPED: needs root, to run the warden as uid {}", nobody::UID);
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

/// The venv of a service: its `vllm` script's `#!` names the venv's
/// `python3`, a link into a folder only root may enter (a pyenv build in
/// root's home). As the service user, `check` names the interpreter, and
/// `run` fails the start at once with exit 78, not after a load.
#[test]
fn an_interpreter_the_service_user_cannot_reach_is_named_before_any_start() {
    let Some((dir, exe)) = as_nobody() else { return };
    let d = dir.path();
    let private = d.join("root-home");
    std::fs::create_dir_all(&private).unwrap();
    std::fs::copy("/bin/true", private.join("python3.11")).unwrap();
    std::fs::set_permissions(&private, std::fs::Permissions::from_mode(0o700)).unwrap();
    let bin = d.join("venv/bin");
    std::fs::create_dir_all(&bin).unwrap();
    std::os::unix::fs::symlink(private.join("python3.11"), bin.join("python3")).unwrap();
    std::fs::write(bin.join("vllm"), format!("#!{}/python3\nimport sys\n", bin.display())).unwrap();
    std::fs::set_permissions(bin.join("vllm"), std::fs::Permissions::from_mode(0o755)).unwrap();
    let state = d.join("state");
    std::fs::create_dir_all(&state).unwrap();
    std::os::unix::fs::chown(&state, Some(nobody::UID), Some(nobody::UID)).unwrap();
    let cfg = d.join("m.toml");
    std::fs::write(
        &cfg,
        format!(
            "[child]\ncommand = [\"{}/vllm\"]\nlog-file = \"{s}/m.log\"\n[status]\nfile = \"{s}/status.json\"\n\
             [restart]\ninitial-delay = \"0s\"\n",
            bin.display(),
            s = state.display()
        ),
    )
    .unwrap();
    std::fs::set_permissions(&cfg, std::fs::Permissions::from_mode(0o644)).unwrap();
    let want = format!(
        "`command`: {b}/vllm runs {b}/python3 (its #! line): Permission denied (os error 13) for uid 65534",
        b = bin.display()
    );
    let run = |cmd: &str| {
        Command::new(&exe)
            .arg(cmd)
            .arg("-c")
            .arg(&cfg)
            .env_clear()
            .env("STATE_DIRECTORY", &state)
            .env("RUNTIME_DIRECTORY", state.join("run"))
            .uid(nobody::UID)
            .gid(nobody::UID)
            .output()
            .unwrap()
    };
    let o = run("check");
    let (_, err) = text(&o);
    assert_eq!(o.status.code(), Some(78), "{err}");
    assert!(err.contains(&want), "{err}");
    let o = run("run");
    let (_, err) = text(&o);
    assert_eq!(o.status.code(), Some(78), "{err}");
    assert!(err.contains(&want), "{err}");
    // As root the same venv runs: it is the user, not the file.
    let o = Command::new(&exe)
        .arg("check")
        .arg("-c")
        .arg(&cfg)
        .env_clear()
        .env("STATE_DIRECTORY", &state)
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", text(&o).1);
}

/// Weights the service user cannot read (safetensors writes its files
/// 0600): named by `check` as that user, not found by vLLM minutes later as
/// a `FileNotFoundError` in every restart.
#[test]
fn a_weights_file_the_service_user_cannot_read_is_named() {
    let Some((dir, exe)) = as_nobody() else { return };
    let d = dir.path();
    let model = d.join("model");
    std::fs::create_dir_all(&model).unwrap();
    std::fs::write(model.join("config.json"), "{}").unwrap();
    std::fs::write(model.join("model.safetensors"), "weights").unwrap();
    std::fs::set_permissions(model.join("config.json"), std::fs::Permissions::from_mode(0o644)).unwrap();
    std::fs::set_permissions(model.join("model.safetensors"), std::fs::Permissions::from_mode(0o600)).unwrap();
    let state = d.join("state");
    std::fs::create_dir_all(&state).unwrap();
    std::os::unix::fs::chown(&state, Some(nobody::UID), Some(nobody::UID)).unwrap();
    let cfg = d.join("m.toml");
    // README.md 0600 is not vLLM's business; the weights are.
    std::fs::write(model.join("README.md"), "private notes").unwrap();
    std::fs::set_permissions(model.join("README.md"), std::fs::Permissions::from_mode(0o600)).unwrap();
    let vllm = fake_vllm(d);
    std::fs::write(&cfg, format!("[child]\ncommand = [\"{}\", \"serve\", \"{}\"]\n", vllm.display(), model.display()))
        .unwrap();
    std::fs::set_permissions(&cfg, std::fs::Permissions::from_mode(0o644)).unwrap();
    let check = |as_nobody: bool| {
        let mut c = Command::new(&exe);
        c.arg("check").arg("-c").arg(&cfg).env_clear().env("STATE_DIRECTORY", &state);
        if as_nobody {
            c.uid(nobody::UID).gid(nobody::UID);
        }
        c.output().unwrap()
    };
    let o = check(true);
    let (_, err) = text(&o);
    assert_eq!(o.status.code(), Some(78), "{err}");
    assert!(
        err.contains(&format!(
            "model {}: model.safetensors cannot be read (Permission denied (os error 13)) for uid 65534",
            model.display()
        )),
        "{err}"
    );
    std::fs::set_permissions(model.join("model.safetensors"), std::fs::Permissions::from_mode(0o644)).unwrap();
    let o = check(true);
    assert!(o.status.success(), "{}", text(&o).1);
    // A name from the model folder reaches the terminal as one visible line.
    let hostile = model.join("x\x1b]0;pwned\x07\nREADY=1.json");
    std::fs::write(&hostile, "{}").unwrap();
    std::fs::set_permissions(&hostile, std::fs::Permissions::from_mode(0o600)).unwrap();
    let o = check(true);
    let (_, err) = text(&o);
    assert_eq!(o.status.code(), Some(78), "{err}");
    assert!(err.contains("cannot be read (Permission denied"), "{err}");
    assert!(!err.contains('\x1b') && !err.contains("\nREADY=1"), "{err:?}");
}
