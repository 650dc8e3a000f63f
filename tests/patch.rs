//! `vllm-warden patch` on a Hugging Face cache layout built in a temp dir:
//! dry run, apply, re-apply, revert, bad input, and SIGKILL at random
//! instants.

use std::os::unix::fs::PermissionsExt;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};

#[path = "support/nobody.rs"]
mod nobody;

const CONFIG: &str = r#"{
  "architectures": [
    "DeepseekV3ForCausalLM"
  ],
  "hidden_size": 7168,
  "rms_norm_eps": 1e-06,
  "max_position_embeddings": 262144,
  "quantization_config": {
    "quant_method": "compressed-tensors",
    "kv_cache_scheme": {
      "num_bits": 8,
      "type": "float"
    },
    "format": "nvfp4-pack-quantized"
  },
  "vocab_size": 163840
}
"#;

const HF_QUANT: &str = "{\n    \"producer\": {\n        \"name\": \"modelopt\"\n    },\n    \"quantization\": {\n        \"quant_algo\": \"NVFP4\",\n        \"kv_cache_quant_algo\": \"FP8\"\n    }\n}\n";

struct Model {
    dir: tempfile::TempDir,
    snapshot: PathBuf,
    blobs: PathBuf,
    cfg: PathBuf,
}

impl Model {
    /// `models--org--m/{blobs,snapshots/rev}` with both files as symlinks.
    fn new() -> Model {
        // Where the unprivileged user of the read-only test can reach it.
        let dir = nobody::tempdir().unwrap_or_else(|_| tempfile::tempdir().unwrap());
        std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o755)).unwrap();
        let repo = dir.path().join("models--org--m");
        let blobs = repo.join("blobs");
        let snapshot = repo.join("snapshots").join("0123abc");
        std::fs::create_dir_all(&blobs).unwrap();
        std::fs::create_dir_all(&snapshot).unwrap();
        for (name, blob, text) in [("config.json", "b1c0ffee", CONFIG), ("hf_quant_config.json", "b2decade", HF_QUANT)]
        {
            std::fs::write(blobs.join(blob), text).unwrap();
            std::os::unix::fs::symlink(format!("../../blobs/{blob}"), snapshot.join(name)).unwrap();
        }
        let cfg = dir.path().join("kimi.toml");
        let text = format!(
            "[child]\ncommand = [\"/bin/true\"]\n\
             [[patch]]\nfile = \"{s}/hf_quant_config.json\"\nremove = [\"quantization.kv_cache_quant_algo\"]\n\
             [[patch]]\nfile = \"{s}/config.json\"\nremove = [\"quantization_config.kv_cache_scheme\"]\n\
             set = {{ max_position_embeddings = 131072 }}\n",
            s = snapshot.display()
        );
        std::fs::write(&cfg, text).unwrap();
        Model { dir, snapshot, blobs, cfg }
    }

    fn state(&self) -> PathBuf {
        self.dir.path().join("state")
    }

    fn run(&self, args: &[&str]) -> Output {
        self.command(args).output().unwrap()
    }

    fn command(&self, args: &[&str]) -> Command {
        self.command_of(Path::new(env!("CARGO_BIN_EXE_vllm-warden")), args)
    }

    /// `patch` run by the binary `exe`.
    fn command_of(&self, exe: &Path, args: &[&str]) -> Command {
        let mut c = Command::new(exe);
        c.arg("patch").arg("-c").arg(&self.cfg).args(args).env("STATE_DIRECTORY", self.state());
        c
    }

    fn config_json(&self) -> PathBuf {
        self.snapshot.join("config.json")
    }

    fn quant_json(&self) -> PathBuf {
        self.snapshot.join("hf_quant_config.json")
    }

    /// Every file under the model, with its bytes or link target.
    fn snapshot_of_files(&self) -> Vec<(PathBuf, String)> {
        let mut out = Vec::new();
        for d in [&self.blobs, &self.snapshot] {
            let mut entries: Vec<_> = std::fs::read_dir(d).unwrap().map(|e| e.unwrap().path()).collect();
            entries.sort();
            for p in entries {
                let m = std::fs::symlink_metadata(&p).unwrap();
                let v = if m.file_type().is_symlink() {
                    format!("-> {}", std::fs::read_link(&p).unwrap().display())
                } else {
                    std::fs::read_to_string(&p).unwrap()
                };
                out.push((p, v));
            }
        }
        out
    }
}

fn ok(o: &Output) -> String {
    assert!(o.status.success(), "{}\n{}", String::from_utf8_lossy(&o.stdout), String::from_utf8_lossy(&o.stderr));
    String::from_utf8_lossy(&o.stdout).into_owned()
}

fn is_link(p: &Path) -> bool {
    std::fs::symlink_metadata(p).unwrap().file_type().is_symlink()
}

#[test]
fn dry_run_prints_a_diff_and_changes_nothing() {
    let m = Model::new();
    let before = m.snapshot_of_files();
    let out = ok(&m.run(&["--dry-run"]));
    assert!(out.contains(&format!("+++ b{}", m.quant_json().display())), "{out}");
    assert!(out.contains("-        \"kv_cache_quant_algo\": \"FP8\""), "{out}");
    assert!(out.contains("-  \"max_position_embeddings\": 262144,\n+  \"max_position_embeddings\": 131072,"), "{out}");
    assert!(out.contains("-    \"kv_cache_scheme\": {"), "{out}");
    assert_eq!(m.snapshot_of_files(), before);
    assert!(!m.state().exists(), "a dry run writes nothing, not even state");
}

#[test]
fn apply_reapply_and_revert_round_trip_with_symlinks() {
    let m = Model::new();
    let before = m.snapshot_of_files();
    let out = ok(&m.run(&[]));
    assert!(out.contains("config.json: patched"), "{out}");
    // Patched regular files; the blobs untouched.
    assert!(!is_link(&m.config_json()) && !is_link(&m.quant_json()));
    assert_eq!(std::fs::read_to_string(m.blobs.join("b1c0ffee")).unwrap(), CONFIG);
    assert_eq!(std::fs::read_to_string(m.blobs.join("b2decade")).unwrap(), HF_QUANT);
    let patched = std::fs::read_to_string(m.config_json()).unwrap();
    assert_eq!(
        patched,
        "{\n  \"architectures\": [\n    \"DeepseekV3ForCausalLM\"\n  ],\n  \"hidden_size\": 7168,\n  \"rms_norm_eps\": 1e-06,\n  \"max_position_embeddings\": 131072,\n  \"quantization_config\": {\n    \"quant_method\": \"compressed-tensors\",\n    \"format\": \"nvfp4-pack-quantized\"\n  },\n  \"vocab_size\": 163840\n}\n"
    );
    let quant = std::fs::read_to_string(m.quant_json()).unwrap();
    assert_eq!(
        quant,
        "{\n    \"producer\": {\n        \"name\": \"modelopt\"\n    },\n    \"quantization\": {\n        \"quant_algo\": \"NVFP4\"\n    }\n}\n"
    );
    // Mode kept from the blob.
    let mode = std::fs::metadata(m.config_json()).unwrap().permissions().mode() & 0o777;
    assert_eq!(mode, std::fs::metadata(m.blobs.join("b1c0ffee")).unwrap().permissions().mode() & 0o777);

    // Idempotent: nothing written the second time.
    let ino = std::os::unix::fs::MetadataExt::ino(&std::fs::metadata(m.config_json()).unwrap());
    let out = ok(&m.run(&[]));
    assert!(out.contains("config.json: already patched"), "{out}");
    assert_eq!(ino, std::os::unix::fs::MetadataExt::ino(&std::fs::metadata(m.config_json()).unwrap()));

    // Revert: the links come back, byte-identical content.
    let out = ok(&m.run(&["--revert"]));
    assert!(out.contains("config.json: restored"), "{out}");
    assert_eq!(m.snapshot_of_files(), before);
    assert!(ok(&m.run(&["--revert"])).contains("nothing to restore"));
}

#[test]
fn revert_refuses_a_file_changed_since_unless_forced() {
    let m = Model::new();
    ok(&m.run(&[]));
    std::fs::write(m.config_json(), "{\"edited\": \"by hand\"}\n").unwrap();
    let o = m.run(&["--revert"]);
    assert!(!o.status.success());
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(err.contains("config.json: changed by someone else since it was patched"), "{err}");
    assert_eq!(std::fs::read_to_string(m.config_json()).unwrap(), "{\"edited\": \"by hand\"}\n");
    ok(&m.run(&["--revert", "--force"]));
    assert!(is_link(&m.config_json()));
    assert_eq!(std::fs::read_to_string(m.config_json()).unwrap(), CONFIG);
}

fn assert_untouched_after_error(m: &Model, args: &[&str], want: &str) {
    let before = m.snapshot_of_files();
    let o = m.run(args);
    assert!(!o.status.success(), "must fail");
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(err.contains(want), "{err}");
    assert_eq!(m.snapshot_of_files(), before, "nothing written");
    let stray: Vec<_> = std::fs::read_dir(&m.snapshot)
        .unwrap()
        .filter(|e| e.as_ref().unwrap().file_name().to_string_lossy().ends_with(".tmp"))
        .collect();
    assert!(stray.is_empty(), "{stray:?}");
}

#[test]
fn malformed_json_is_a_clear_error_and_nothing_is_written() {
    let m = Model::new();
    std::fs::write(m.blobs.join("b1c0ffee"), "{\n  \"hidden_size\": 7168,\n  \"vocab\n").unwrap();
    let want = format!("{}: malformed JSON at line ", m.config_json().display());
    assert_untouched_after_error(&m, &[], &want);
    // check reports it up front too.
    let o = Command::new(env!("CARGO_BIN_EXE_vllm-warden")).arg("check").arg("-c").arg(&m.cfg).output().unwrap();
    assert_eq!(o.status.code(), Some(78));
    assert!(String::from_utf8_lossy(&o.stderr).contains(&want));
}

#[test]
fn a_missing_file_and_a_path_through_a_non_object_are_clear_errors() {
    let m = Model::new();
    std::fs::remove_file(m.quant_json()).unwrap();
    assert_untouched_after_error(&m, &[], &format!("{}: cannot read: No such file", m.quant_json().display()));
    let m = Model::new();
    std::fs::write(m.blobs.join("b2decade"), "{\"quantization\": \"FP8\"}\n").unwrap();
    let want = "cannot remove `quantization.kv_cache_quant_algo`: `quantization` is a string, not an object";
    assert_untouched_after_error(&m, &[], want);
}

#[test]
fn a_read_only_folder_is_a_clear_error_and_nothing_is_written() {
    // What it makes must be readable by nobody whatever the host's umask
    // (027 or 077 on hardened hosts). nextest runs each test in a process
    // of its own, so this touches no other test.
    nix::sys::stat::umask(nix::sys::stat::Mode::from_bits_truncate(0o022));
    let m = Model::new();
    std::fs::set_permissions(&m.snapshot, std::fs::Permissions::from_mode(0o555)).unwrap();
    // Root writes anywhere: run the command as nobody then, from a copy of
    // the binary nobody can reach (the checkout may be in a 0700 folder).
    let root = nix::unistd::geteuid().is_root();
    let mut exe = PathBuf::from(env!("CARGO_BIN_EXE_vllm-warden"));
    if root {
        if !nobody::reachable_by_all(m.dir.path()) {
            // Not a pass: the test did not run, and says why.
            eprintln!(
                "SKIPPED: no temporary folder uid {} can reach ({}); as root the write cannot be refused",
                nobody::UID,
                nobody::tempdir().err().unwrap_or_default()
            );
            return;
        }
        exe = nobody::copy_binary(env!("CARGO_BIN_EXE_vllm-warden"), m.dir.path());
        std::fs::create_dir_all(m.state()).unwrap();
        std::os::unix::fs::chown(m.state(), Some(nobody::UID), Some(nobody::UID)).unwrap();
        for d in [m.dir.path().join("models--org--m"), m.dir.path().join("models--org--m/snapshots")] {
            std::fs::set_permissions(d, std::fs::Permissions::from_mode(0o755)).unwrap();
        }
    }
    let before = m.snapshot_of_files();
    let mut cmd = m.command_of(&exe, &[]);
    if root {
        cmd.uid(nobody::UID).gid(nobody::UID);
    }
    let o = cmd.output().unwrap();
    assert!(!o.status.success());
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(err.contains("cannot write: Permission denied"), "{err}");
    assert_eq!(m.snapshot_of_files(), before);
    std::fs::set_permissions(&m.snapshot, std::fs::Permissions::from_mode(0o755)).unwrap();
}

#[test]
fn sigkill_at_any_instant_leaves_the_old_or_the_new_file() {
    let m = Model::new();
    // A big file, so that a run takes long enough to be cut in many places.
    let big: Vec<String> = (0..200_000).map(|i| format!("\"w{i}\"")).collect();
    let original = CONFIG
        .replace("\"vocab_size\": 163840", &format!("\"vocab_size\": 163840,\n  \"weights\": [{}]", big.join(", ")));
    std::fs::remove_file(m.config_json()).unwrap();
    std::fs::write(m.config_json(), &original).unwrap();
    let t = std::time::Instant::now();
    ok(&m.run(&[]));
    let took = t.elapsed();
    let patched = std::fs::read_to_string(m.config_json()).unwrap();
    assert_ne!(patched, original);
    let (mut olds, mut news) = (0, 0);
    for _ in 0..40 {
        ok(&m.run(&["--revert", "--force"]));
        let mut child = m.command(&[]).spawn().unwrap();
        // Choosing the instant, not waiting for a condition.
        std::thread::sleep(took.mul_f64(fastrand::f64() * 1.2));
        let _ = child.kill();
        let _ = child.wait();
        let now = std::fs::read_to_string(m.config_json()).unwrap();
        assert!(now == original || now == patched, "a broken file after SIGKILL");
        serde_json::from_str::<serde_json::Value>(&now).unwrap();
        if now == original {
            olds += 1
        } else {
            news += 1
        }
        let manifest = m.state().join("patches/manifest.json");
        if manifest.exists() {
            serde_json::from_slice::<serde_json::Value>(&std::fs::read(&manifest).unwrap()).unwrap();
        }
    }
    eprintln!("killed 40 times: {olds} old, {news} new (one run takes {took:?})");
}
