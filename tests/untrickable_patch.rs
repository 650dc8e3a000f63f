//! "Nothing the warden reads may steer it", the patch side: one test per
//! case of the issue, named after it. The tests run as root, as `patch`
//! does in production; the service user's edits ("edited as nobody") are
//! made directly to the files it owns: the manifest, the originals, the
//! model folder.

use std::os::fd::AsFd;
use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::sync::mpsc;
use std::time::Duration;

use sha2::{Digest, Sha256};

#[path = "support/nobody.rs"]
mod nobody;
use vllm_warden::patch::{self, Patch, PatchError, Wait};

/// Long enough for a loaded machine; a passing test never waits for it.
const TIMEOUT: Duration = Duration::from_secs(60);

const CONFIG: &str = "{\n  \"hidden_size\": 7168,\n  \"quantization_config\": {\n    \"kv_cache_scheme\": {\n      \"num_bits\": 8\n    },\n    \"format\": \"nvfp4\"\n  }\n}\n";
const PATCHED: &str = "{\n  \"hidden_size\": 7168,\n  \"quantization_config\": {\n    \"format\": \"nvfp4\"\n  }\n}\n";
const REMOVE: &str = "remove = [\"quantization_config.kv_cache_scheme\"]";

fn sha256(b: &[u8]) -> String {
    Sha256::digest(b).iter().map(|x| format!("{x:02x}")).collect()
}

/// A folder with a config whose `[[patch]]` entries are given, and a
/// state directory.
struct Fixture {
    dir: tempfile::TempDir,
    cfg: PathBuf,
}

impl Fixture {
    fn new() -> Fixture {
        // Where an unprivileged user can reach it (a test runs as nobody).
        let dir = nobody::tempdir().unwrap_or_else(|_| tempfile::tempdir().unwrap());
        std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o755)).unwrap();
        let cfg = dir.path().join("kimi.toml");
        Fixture { dir, cfg }
    }

    fn path(&self, rel: &str) -> PathBuf {
        self.dir.path().join(rel)
    }

    /// A model folder `rel` with `config.json` holding `text`.
    fn model(&self, rel: &str, text: &str) -> PathBuf {
        let d = self.path(rel);
        std::fs::create_dir_all(&d).unwrap();
        std::fs::write(d.join("config.json"), text).unwrap();
        d.join("config.json")
    }

    /// A Hugging Face cache repository with `config.json` a link to its blob.
    fn cache(&self, text: &str) -> PathBuf {
        let repo = self.path("hub/models--org--m");
        std::fs::create_dir_all(repo.join("blobs")).unwrap();
        std::fs::create_dir_all(repo.join("snapshots/rev1")).unwrap();
        std::fs::write(repo.join("blobs/b1"), text).unwrap();
        std::os::unix::fs::symlink("../../blobs/b1", repo.join("snapshots/rev1/config.json")).unwrap();
        repo.join("snapshots/rev1/config.json")
    }

    /// The config: `[[patch]]` entries, one per file, each with `extra`.
    fn config(&self, files: &[&Path], extra: &str) {
        let mut text = "[child]\ncommand = [\"/bin/true\"]\n".to_string();
        for f in files {
            text.push_str(&format!("[[patch]]\nfile = \"{}\"\n{REMOVE}\n{extra}\n", f.display()));
        }
        std::fs::write(&self.cfg, text).unwrap();
    }

    fn patches(&self, files: &[&Path]) -> Vec<Patch> {
        let remove = vec!["quantization_config.kv_cache_scheme".to_string()];
        files
            .iter()
            .map(|f| Patch { file: f.to_path_buf(), remove: remove.clone(), set: vec![], max_size: None })
            .collect()
    }

    fn state(&self) -> PathBuf {
        self.path("state")
    }

    fn manifest(&self) -> PathBuf {
        self.state().join("patches/manifest.json")
    }

    fn command(&self, args: &[&str]) -> Command {
        self.command_of(Path::new(env!("CARGO_BIN_EXE_vllm-warden")), args)
    }

    /// The command run by the binary `exe`.
    fn command_of(&self, exe: &Path, args: &[&str]) -> Command {
        let mut c = Command::new(exe);
        c.args(args).arg("-c").arg(&self.cfg).env("STATE_DIRECTORY", self.state()).env_remove("JOURNAL_STREAM");
        c
    }

    /// Run the command, under one generous timeout: a run that hangs (on a
    /// FIFO) fails the test instead of hanging it.
    fn run(&self, args: &[&str]) -> Output {
        run_within(self.command(args))
    }
}

fn run_within(mut c: Command) -> Output {
    let child = c.stdout(Stdio::piped()).stderr(Stdio::piped()).spawn().unwrap();
    let pid = child.id();
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        let _ = tx.send(child.wait_with_output());
    });
    match rx.recv_timeout(TIMEOUT) {
        Ok(out) => out.unwrap(),
        Err(_) => {
            let _ = nix::sys::signal::kill(nix::unistd::Pid::from_raw(pid as i32), nix::sys::signal::Signal::SIGKILL);
            panic!("the command did not finish within {TIMEOUT:?}");
        }
    }
}

fn stdout(o: &Output) -> String {
    String::from_utf8_lossy(&o.stdout).into_owned()
}

fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

fn ok(o: &Output) -> String {
    assert!(o.status.success(), "{}\n{}", stdout(o), stderr(o));
    stdout(o)
}

fn failed(o: &Output, code: i32, want: &str) -> String {
    let err = stderr(o);
    assert_eq!(o.status.code(), Some(code), "{}\n{err}", stdout(o));
    assert!(err.contains(want), "wanted {want:?} in:\n{err}");
    err
}

/// Temporary files the warden may have left beside the model's files.
fn temps(dir: &Path) -> Vec<String> {
    std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .filter(|n| n.contains(".vllm-warden."))
        .collect()
}

// ---- 2. Root file overwrite through the manifest ----

/// The attack: the manifest (the service user's) lists a root-owned
/// 0440 file outside any model, with hashes that match it and an "original"
/// of the attacker's choosing. Root's `patch --revert` used to write it.
#[test]
fn manifest_cannot_send_root_anywhere_a_file_no_patch_names_is_left_alone() {
    let f = Fixture::new();
    let model = f.model("m", CONFIG);
    f.config(&[&model], "");
    ok(&f.run(&["patch"]));
    let victim = f.path("etc/sudoers.d/vllm");
    std::fs::create_dir_all(victim.parent().unwrap()).unwrap();
    std::fs::write(&victim, "root ALL=(ALL) ALL\n").unwrap();
    std::fs::set_permissions(&victim, std::fs::Permissions::from_mode(0o440)).unwrap();
    let evil = b"nobody ALL=(ALL) NOPASSWD: ALL\n";
    std::fs::write(f.state().join("patches").join(sha256(evil)), evil).unwrap();
    let mut m: serde_json::Value = serde_json::from_slice(&std::fs::read(f.manifest()).unwrap()).unwrap();
    m["files"][victim.to_str().unwrap()] = serde_json::json!({
        "original_sha256": sha256(evil),
        "patched_sha256": sha256(b"root ALL=(ALL) ALL\n"),
    });
    std::fs::write(f.manifest(), serde_json::to_vec(&m).unwrap()).unwrap();

    for args in [&["patch", "--revert"][..], &["patch", "--revert", "--force"]] {
        let o = f.run(args);
        assert!(
            stderr(&o)
                .contains(&format!("{}: in the manifest, but no [[patch]] names it: left as it is", victim.display())),
            "{}",
            stderr(&o)
        );
        assert_eq!(std::fs::read_to_string(&victim).unwrap(), "root ALL=(ALL) ALL\n");
        assert_eq!(std::fs::metadata(&victim).unwrap().permissions().mode() & 0o777, 0o440);
    }
    // The model's own file was restored.
    assert_eq!(std::fs::read_to_string(&model).unwrap(), CONFIG);
}

/// A manifest that names its own backup (`../` included) is not a manifest:
/// the originals' names are their hashes, never read from it.
#[test]
fn manifest_cannot_send_root_anywhere_backup_names_come_from_the_hash() {
    let f = Fixture::new();
    let model = f.model("m", CONFIG);
    f.config(&[&model], "");
    ok(&f.run(&["patch"]));
    let victim = f.path("victim");
    std::fs::write(&victim, CONFIG).unwrap();
    let name = model.to_str().unwrap();
    let forged = [
        serde_json::json!({"files": {name: {
            "backup": "../../victim", "original_sha256": sha256(CONFIG.as_bytes()),
            "patched_sha256": sha256(PATCHED.as_bytes())}}}),
        serde_json::json!({"files": {name: {
            "original_sha256": "../../victim", "patched_sha256": sha256(PATCHED.as_bytes())}}}),
    ];
    for m in forged {
        std::fs::write(f.manifest(), serde_json::to_vec(&m).unwrap()).unwrap();
        let o = f.run(&["patch", "--revert", "--force"]);
        failed(&o, 1, &format!("{}: ", f.manifest().display()));
        assert!(victim.exists(), "the file the manifest named is still there");
        assert_eq!(std::fs::read_to_string(&model).unwrap(), PATCHED, "nothing restored from a forged manifest");
    }
}

/// The `symlink` field of a forged manifest: a link is restored only to
/// what the file was (its target's content hashes to the recorded
/// original), and only within the model's folder.
#[test]
fn manifest_cannot_send_root_anywhere_a_recorded_link_must_lead_to_the_original() {
    let f = Fixture::new();
    let link = f.cache(CONFIG);
    f.config(&[&link], "");
    ok(&f.run(&["patch"]));
    let real = std::fs::read(f.manifest()).unwrap();
    let repo = f.path("hub/models--org--m");
    std::fs::write(repo.join("blobs/other"), "{}\n").unwrap();
    std::fs::write(f.path("outside.json"), CONFIG).unwrap();
    let cases = [
        ("/etc/shadow", "leads out of"),
        ("../../../../outside.json", "leads out of"),
        ("../../blobs/other", "leads to a file that is not the original"),
        ("../../blobs/missing", "is refused"),
    ];
    for (target, why) in cases {
        let mut m: serde_json::Value = serde_json::from_slice(&real).unwrap();
        m["files"][link.to_str().unwrap()]["symlink"] = serde_json::json!(target);
        std::fs::write(f.manifest(), serde_json::to_vec(&m).unwrap()).unwrap();
        let o = f.run(&["patch", "--revert", "--force"]);
        failed(&o, 1, &format!("{}: not restored: the link it was, -> {target}, {why}", link.display()));
        assert!(!std::fs::symlink_metadata(&link).unwrap().file_type().is_symlink(), "{target}: no link made");
        assert_eq!(std::fs::read_to_string(&link).unwrap(), PATCHED);
    }
    std::fs::write(f.manifest(), real).unwrap();
    ok(&f.run(&["patch", "--revert"]));
    assert_eq!(std::fs::read_link(&link).unwrap(), Path::new("../../blobs/b1"));
}

/// An original that does not hash to its record is never restored, even
/// with `--force`.
#[test]
fn manifest_cannot_send_root_anywhere_an_original_must_hash_to_its_record() {
    let f = Fixture::new();
    let model = f.model("m", CONFIG);
    f.config(&[&model], "");
    ok(&f.run(&["patch"]));
    let backup = f.state().join("patches").join(sha256(CONFIG.as_bytes()));
    assert_eq!(std::fs::read_to_string(&backup).unwrap(), CONFIG, "the original is kept under its hash");
    std::fs::write(&backup, "{\"evil\": true}\n").unwrap();
    for args in [&["patch", "--revert"][..], &["patch", "--revert", "--force"]] {
        let o = f.run(args);
        failed(
            &o,
            1,
            &format!(
                "{}: not restored: its original {} does not match its recorded sha256",
                model.display(),
                backup.display()
            ),
        );
        assert_eq!(std::fs::read_to_string(&model).unwrap(), PATCHED);
    }
    // A hard link planted as the original is refused too.
    std::fs::remove_file(&backup).unwrap();
    let elsewhere = f.path("elsewhere");
    std::fs::write(&elsewhere, CONFIG).unwrap();
    std::fs::hard_link(&elsewhere, &backup).unwrap();
    failed(&f.run(&["patch", "--revert"]), 1, "a file with more than one name (a hard link)");
}

/// `patches` itself a symlink: nothing is written through it, nothing read.
#[test]
fn manifest_cannot_send_root_anywhere_a_linked_patches_folder_is_refused() {
    let f = Fixture::new();
    let model = f.model("m", CONFIG);
    f.config(&[&model], "");
    let elsewhere = f.path("elsewhere");
    std::fs::create_dir_all(&elsewhere).unwrap();
    std::fs::create_dir_all(f.state()).unwrap();
    std::os::unix::fs::symlink(&elsewhere, f.state().join("patches")).unwrap();
    failed(&f.run(&["patch"]), 1, "a symlink is not followed here");
    assert_eq!(std::fs::read_dir(&elsewhere).unwrap().count(), 0);
    assert_eq!(std::fs::read_to_string(&model).unwrap(), CONFIG);
    failed(&f.run(&["patch", "--revert"]), 1, "a symlink is not followed here");
    let o = f.run(&["check"]);
    failed(&o, 78, &format!("{}: is a symlink, not a folder", f.state().join("patches").display()));
}

// ---- 3. Hostile model folder ----

/// `config.json -> /dev/zero` grew `check` to 4 GB: a link out of the
/// model's folder is refused before anything is read.
#[test]
fn hostile_model_folder_a_link_to_dev_zero_is_refused_at_once() {
    let f = Fixture::new();
    std::fs::create_dir_all(f.path("m")).unwrap();
    let model = f.path("m/config.json");
    std::os::unix::fs::symlink("/dev/zero", &model).unwrap();
    f.config(&[&model], "");
    let want = format!(
        "{}: the link {} -> /dev/zero leads out of {}",
        model.display(),
        model.display(),
        f.path("m").display()
    );
    failed(&f.run(&["check"]), 78, &want);
    failed(&f.run(&["patch"]), 1, &want);
    failed(&f.run(&["patch", "--dry-run"]), 1, &want);
}

/// A device inside the model's folder: refused without being opened.
#[test]
fn hostile_model_folder_a_device_is_refused() {
    let f = Fixture::new();
    std::fs::create_dir_all(f.path("m")).unwrap();
    let model = f.path("m/config.json");
    let dev = nix::sys::stat::makedev(1, 5);
    nix::sys::stat::mknod(&model, nix::sys::stat::SFlag::S_IFCHR, nix::sys::stat::Mode::from_bits_truncate(0o644), dev)
        .unwrap();
    f.config(&[&model], "");
    let want = format!("{}: is a character device, not a regular file", model.display());
    failed(&f.run(&["check"]), 78, &want);
    failed(&f.run(&["patch"]), 1, &want);
}

/// A FIFO as `config.json` hung `check`: opened without blocking, refused.
#[test]
fn hostile_model_folder_a_fifo_is_refused_without_hanging() {
    let f = Fixture::new();
    std::fs::create_dir_all(f.path("m")).unwrap();
    let model = f.path("m/config.json");
    nix::unistd::mkfifo(&model, nix::sys::stat::Mode::from_bits_truncate(0o644)).unwrap();
    f.config(&[&model], "");
    let want = format!("{}: is a FIFO (named pipe), not a regular file", model.display());
    failed(&f.run(&["check"]), 78, &want);
    failed(&f.run(&["patch"]), 1, &want);
    failed(&f.run(&["patch", "--dry-run"]), 1, &want);
    // Behind a link inside the folder too.
    std::fs::rename(&model, f.path("m/fifo")).unwrap();
    std::os::unix::fs::symlink("fifo", &model).unwrap();
    failed(
        &f.run(&["check"]),
        78,
        &format!("{}: {} is a FIFO (named pipe), not a regular file", model.display(), f.path("m/fifo").display()),
    );
}

/// A 275 MB `config.json` blocked for 9 s at 2 GB: above `max-size`
/// (64 MiB unless the entry says otherwise) a file is refused before it is
/// read; `max-size` lets a file that is right through.
#[test]
fn hostile_model_folder_a_file_over_max_size_is_refused_before_it_is_read() {
    let f = Fixture::new();
    let model = f.model("m", "");
    // Sparse: 275 MB of nothing, written in no time.
    std::fs::File::options().write(true).open(&model).unwrap().set_len(275 << 20).unwrap();
    f.config(&[&model], "");
    let want = format!("{}: is 275 MiB, more than its `max-size` of 64 MiB", model.display());
    failed(&f.run(&["check"]), 78, &want);
    failed(&f.run(&["patch"]), 1, &want);
    // A small cap, and a file just above it, then within a larger one.
    let model = f.model("m", CONFIG);
    f.config(&[&model], "max-size = 100");
    failed(
        &f.run(&["patch"]),
        1,
        &format!("{}: is {} bytes, more than its `max-size` of 100 bytes", model.display(), CONFIG.len()),
    );
    f.config(&[&model], "max-size = \"1 KiB\"");
    assert!(ok(&f.run(&["patch"])).contains("config.json: patched"));
}

/// A link out of the model's folder was followed for reading as root: a
/// 0600 file outside was read and printed by `--dry-run`. Never read now;
/// links inside the folder are followed as before.
#[test]
fn hostile_model_folder_a_link_out_of_the_folder_is_never_read() {
    let f = Fixture::new();
    let secret = f.path("root-only/secret.json");
    std::fs::create_dir_all(secret.parent().unwrap()).unwrap();
    std::fs::write(&secret, "{\"quantization_config\": {\"kv_cache_scheme\": \"TOPSECRET\"}}\n").unwrap();
    std::fs::set_permissions(&secret, std::fs::Permissions::from_mode(0o600)).unwrap();
    std::fs::create_dir_all(f.path("m")).unwrap();
    let model = f.path("m/config.json");
    std::os::unix::fs::symlink("../root-only/secret.json", &model).unwrap();
    f.config(&[&model], "");
    for args in [&["patch", "--dry-run"][..], &["patch"], &["check"]] {
        let o = f.run(args);
        assert!(!o.status.success());
        assert!(!stdout(&o).contains("TOPSECRET") && !stderr(&o).contains("TOPSECRET"), "{args:?} printed the secret");
        assert!(stderr(&o).contains("leads out of"), "{}", stderr(&o));
    }
    // A link within the folder is followed, and put back by revert.
    std::fs::remove_file(&model).unwrap();
    std::fs::create_dir_all(f.path("m/orig")).unwrap();
    std::fs::write(f.path("m/orig/config.json"), CONFIG).unwrap();
    std::os::unix::fs::symlink("orig/config.json", &model).unwrap();
    assert!(ok(&f.run(&["patch", "--dry-run"])).contains("-    \"kv_cache_scheme\": {"));
    ok(&f.run(&["patch"]));
    assert_eq!(std::fs::read_to_string(&model).unwrap(), PATCHED);
    ok(&f.run(&["patch", "--revert"]));
    assert_eq!(std::fs::read_link(&model).unwrap(), Path::new("orig/config.json"));
}

// ---- 8. Patch integrity ----

/// Backups were named `0001-config.json`, `0002-…` by the manifest's size:
/// after a partial revert, the next one took a name in use and destroyed
/// another file's original. Named by their hash, they cannot collide.
#[test]
fn patch_integrity_backup_names_never_collide_after_a_partial_revert() {
    let f = Fixture::new();
    let a = f.model("a", CONFIG);
    let b_text = CONFIG.replace("7168", "4096");
    let b = f.model("b", &b_text);
    f.config(&[&a, &b], "");
    ok(&f.run(&["patch"]));
    // Revert only `a` (the config names only it), then patch both again.
    f.config(&[&a], "");
    ok(&f.run(&["patch", "--revert"]));
    assert_eq!(std::fs::read_to_string(&a).unwrap(), CONFIG);
    f.config(&[&a, &b], "");
    ok(&f.run(&["patch"]));
    ok(&f.run(&["patch", "--revert"]));
    assert_eq!(std::fs::read_to_string(&a).unwrap(), CONFIG);
    assert_eq!(std::fs::read_to_string(&b).unwrap(), b_text, "b got its own original back");
}

/// A file replaced (or written in place) while `patch` runs was
/// overwritten, and the other writer's update lost. Each target is checked
/// just before it is replaced; a changed one is refused, and the files
/// already replaced are put back.
#[test]
fn patch_integrity_a_file_replaced_meanwhile_is_not_overwritten() {
    for in_place in [false, true] {
        let f = Fixture::new();
        let a = f.model("a", CONFIG);
        let b = f.model("b", CONFIG);
        let a_ino = std::fs::metadata(&a).unwrap().ino();
        let prepared = patch::prepare(&f.patches(&[&a, &b]), &f.state(), Wait::No).unwrap();
        let theirs = CONFIG.replace("7168", "8192");
        if in_place {
            std::fs::write(&b, &theirs).unwrap();
        } else {
            std::fs::write(f.path("b/new"), &theirs).unwrap();
            std::fs::rename(f.path("b/new"), &b).unwrap();
        }
        let e = prepared.commit().unwrap_err();
        assert!(
            e.to_string().starts_with(&format!("{}: changed by someone else meanwhile; left as it is", b.display())),
            "{e}"
        );
        assert!(e.is_transient());
        assert_eq!(std::fs::read_to_string(&b).unwrap(), theirs, "their update is kept");
        assert_eq!(std::fs::read_to_string(&a).unwrap(), CONFIG, "a is put back");
        assert_eq!(std::fs::metadata(&a).unwrap().ino(), a_ino, "as the very same file");
        assert!(temps(&f.path("a")).is_empty() && temps(&f.path("b")).is_empty());
        let manifest: serde_json::Value = serde_json::from_slice(&std::fs::read(f.manifest()).unwrap()).unwrap();
        assert_eq!(manifest, serde_json::json!({"files": {}}), "the manifest as it was");
    }
}

/// Clears `chattr +i` when dropped, so that the folder can be removed.
struct Immutable(PathBuf);

impl Immutable {
    fn set(path: &Path, on: bool) {
        let f = std::fs::File::open(path).unwrap();
        let mut flags = rustix::fs::ioctl_getflags(f.as_fd()).unwrap();
        flags.set(rustix::fs::IFlags::IMMUTABLE, on);
        rustix::fs::ioctl_setflags(f.as_fd(), flags).expect("chattr +i (root, and a filesystem that has it)");
    }

    fn new(path: &Path) -> Immutable {
        Immutable::set(path, true);
        Immutable(path.to_path_buf())
    }
}

impl Drop for Immutable {
    fn drop(&mut self) {
        Immutable::set(&self.0, false);
    }
}

/// With the second of two files immutable, the first was patched and the
/// second not. Now `check` says so beforehand, and `patch` puts the first
/// back when the second cannot be replaced.
#[test]
fn patch_integrity_an_immutable_second_file_leaves_the_first_as_it_was() {
    let f = Fixture::new();
    let a = f.model("a", CONFIG);
    let b = f.model("b", CONFIG);
    f.config(&[&a, &b], "");
    let a_ino = std::fs::metadata(&a).unwrap().ino();
    let _guard = Immutable::new(&b);
    failed(&f.run(&["check"]), 78, &format!("{}: cannot be replaced: it is immutable (chattr +i)", b.display()));
    let err = failed(&f.run(&["patch"]), 1, &format!("{}: cannot write: Operation not permitted", b.display()));
    assert!(err.contains(&format!("the files already replaced were put back as they were: {}", a.display())), "{err}");
    assert_eq!(std::fs::read_to_string(&a).unwrap(), CONFIG);
    assert_eq!(std::fs::metadata(&a).unwrap().ino(), a_ino);
    assert!(temps(&f.path("a")).is_empty() && temps(&f.path("b")).is_empty());
}

/// The same rollback when a rename fails for any reason: here the second
/// file's staged content vanishes before its turn.
#[test]
fn patch_integrity_a_failed_rename_puts_back_the_files_already_replaced() {
    let f = Fixture::new();
    let a = f.cache(CONFIG);
    let b = f.model("b", CONFIG);
    let prepared = patch::prepare(&f.patches(&[&a, &b]), &f.state(), Wait::No).unwrap();
    for t in temps(&f.path("b")) {
        std::fs::remove_file(f.path("b").join(t)).unwrap();
    }
    let e = prepared.commit().unwrap_err();
    assert!(matches!(&e, PatchError::Undone { undone, .. } if undone == &vec![a.clone()]), "{e}");
    assert_eq!(std::fs::read_link(&a).unwrap(), Path::new("../../blobs/b1"), "the link is back");
    assert_eq!(std::fs::read_to_string(&b).unwrap(), CONFIG);
    assert!(temps(&f.path("hub/models--org--m/snapshots/rev1")).is_empty());
    // Nothing of the failed run is kept as an original either.
    let kept: Vec<_> = std::fs::read_dir(f.state().join("patches")).unwrap().map(|e| e.unwrap().file_name()).collect();
    assert!(kept.iter().all(|n| n == "lock" || n == "manifest.json"), "{kept:?}");
}

/// Two concurrent runs failed on their shared temporary name. A lock in the
/// patches folder serialises them (the warden's pre-start too, which does
/// not wait but fails the start, to be retried).
#[test]
fn patch_integrity_concurrent_runs_are_serialised() {
    let f = Fixture::new();
    let a = f.model("a", CONFIG);
    f.config(&[&a], "");
    let prepared = patch::prepare(&f.patches(&[&a]), &f.state(), Wait::No).unwrap();
    // The warden's pre-start does not wait.
    let held = patch::apply(&f.patches(&[&a]), &f.state(), Wait::No).unwrap_err();
    assert!(held.to_string().contains(&format!("held by pid {}", std::process::id())), "{held}");
    assert!(held.is_transient());
    // `vllm-warden patch` waits, and says so.
    let mut child = f.command(&["patch"]).stdout(Stdio::piped()).stderr(Stdio::piped()).spawn().unwrap();
    let mut err = std::io::BufReader::new(child.stderr.take().unwrap());
    let mut line = String::new();
    std::io::BufRead::read_line(&mut err, &mut line).unwrap();
    assert!(line.contains("waiting for") && line.contains("patches/lock"), "{line}");
    assert_eq!(std::fs::read_to_string(&a).unwrap(), CONFIG, "nothing written while it waits");
    prepared.commit().unwrap();
    let out = child.wait_with_output().unwrap();
    assert!(out.status.success());
    assert!(stdout(&out).contains("config.json: already patched"), "{}", stdout(&out));

    // Eight at once: all succeed, the file is patched once.
    ok(&f.run(&["patch", "--revert"]));
    let runs: Vec<_> =
        (0..8).map(|_| f.command(&["patch"]).stdout(Stdio::piped()).stderr(Stdio::piped()).spawn().unwrap()).collect();
    let outs: Vec<Output> = runs.into_iter().map(|c| c.wait_with_output().unwrap()).collect();
    for o in &outs {
        ok(o);
    }
    assert_eq!(outs.iter().filter(|o| stdout(o).contains("config.json: patched")).count(), 1);
    assert_eq!(std::fs::read_to_string(&a).unwrap(), PATCHED);
    ok(&f.run(&["patch", "--revert"]));
    assert_eq!(std::fs::read_to_string(&a).unwrap(), CONFIG);
}

/// `1e400` became `1e+400`, `1E5` `1e+5`, `"caf\u00e9 \/"` `"café /"`, and
/// compact arrays were spread over lines, though the docs promised the
/// rest of the file kept its spelling. Every byte outside the edit is kept.
#[test]
fn patch_integrity_edits_keep_every_byte_outside_the_edited_span() {
    let original = "{\r\n  \"big\": 1e400,\r\n  \"e\" :1E5, \"s\":\"caf\\u00e9 \\/\",\r\n  \"layers\": [1,2,  3],\r\n\t\"quantization_config\": {\"kv_cache_scheme\": {\"num_bits\": 8}, \"format\": \"nvfp4\"},\r\n  \"max_position_embeddings\": 262144\r\n}";
    let f = Fixture::new();
    let model = f.model("m", original);
    std::fs::write(
        &f.cfg,
        format!(
            "[child]\ncommand = [\"/bin/true\"]\n[[patch]]\nfile = \"{}\"\n{REMOVE}\nset = {{ max_position_embeddings = 131072, rope_scaling = {{ factor = 2.0, type = \"yarn\" }} }}\n",
            model.display()
        ),
    )
    .unwrap();
    ok(&f.run(&["patch"]));
    let want = "{\r\n  \"big\": 1e400,\r\n  \"e\" :1E5, \"s\":\"caf\\u00e9 \\/\",\r\n  \"layers\": [1,2,  3],\r\n\t\"quantization_config\": {\"format\": \"nvfp4\"},\r\n  \"max_position_embeddings\": 131072,\r\n  \"rope_scaling\": {\r\n    \"factor\": 2.0,\r\n    \"type\": \"yarn\"\r\n  }\r\n}";
    assert_eq!(std::fs::read_to_string(&model).unwrap(), want);
    assert!(ok(&f.run(&["patch"])).contains("already patched"));
    ok(&f.run(&["patch", "--revert"]));
    assert_eq!(std::fs::read_to_string(&model).unwrap(), original);
}

/// A run killed between its write and its rename left its temporary file;
/// with one fixed name, that (or a folder there) stopped every later run.
#[test]
fn patch_integrity_a_stale_temp_of_a_killed_run_is_in_no_ones_way() {
    let f = Fixture::new();
    let model = f.model("m", CONFIG);
    f.config(&[&model], "");
    let stale = f.path("m/.config.json.vllm-warden.2147483646.0123456789abcdef.tmp");
    std::fs::write(&stale, "half").unwrap();
    std::fs::create_dir(f.path("m/.config.json.vllm-warden.tmp")).unwrap();
    ok(&f.run(&["patch"]));
    assert_eq!(std::fs::read_to_string(&model).unwrap(), PATCHED);
    assert!(!stale.exists(), "the dead run's file is cleared");
}

// ---- 9. check = run ----

/// A corrupt manifest: `check` said valid, and `run` failed.
#[test]
fn check_equals_run_a_corrupt_manifest() {
    let f = Fixture::new();
    let model = f.model("m", CONFIG);
    f.config(&[&model], "");
    ok(&f.run(&["patch"]));
    ok(&f.run(&["check"]));
    std::fs::write(f.manifest(), "{\"files\": [").unwrap();
    std::fs::write(&model, CONFIG).unwrap();
    let want = format!("{}: not a manifest: ", f.manifest().display());
    failed(&f.run(&["check"]), 78, &want);
    failed(&f.run(&["patch"]), 1, &want);
    assert_eq!(std::fs::read_to_string(&model).unwrap(), CONFIG, "nothing written on a manifest it cannot read");
}

/// A folder at the temporary file's name: `check` said valid, and `run`
/// failed. Temporary names are unique now: both succeed.
#[test]
fn check_equals_run_a_directory_at_the_temp_name() {
    let f = Fixture::new();
    let model = f.model("m", CONFIG);
    f.config(&[&model], "");
    std::fs::create_dir(f.path("m/.config.json.vllm-warden.tmp")).unwrap();
    let out = ok(&f.run(&["check"]));
    assert!(out.contains("is valid"), "{out}");
    ok(&f.run(&["patch"]));
    assert_eq!(std::fs::read_to_string(&model).unwrap(), PATCHED);
}

/// `check` skipped the environment's problems when the file had one too.
#[test]
fn check_equals_run_environment_problems_are_listed_beside_the_files() {
    let f = Fixture::new();
    let model = f.model("m", "{\"a\": ");
    std::fs::write(
        &f.cfg,
        format!(
            "[child]\ncommand = [\"no-such-vllm\"]\nbogus = 1\n[[patch]]\nfile = \"{}\"\nremove = [\"a\"]\n",
            model.display()
        ),
    )
    .unwrap();
    let o = f.run(&["check"]);
    let err = failed(&o, 78, "3 problems found");
    assert!(err.contains(&format!("{}:3:1: unknown key `bogus` in [child]", f.cfg.display())), "{err}");
    assert!(err.contains("`command`: program \"no-such-vllm\" not found in PATH"), "{err}");
    assert!(err.contains(&format!("[[patch]] {}: malformed JSON at line 1, column 6", model.display())), "{err}");
    assert!(!stdout(&o).contains("valid"), "{}", stdout(&o));
}

/// A config whose only problem was its environment was called "valid",
/// then "1 problem(s) found".
#[test]
fn check_equals_run_never_valid_with_a_problem() {
    let f = Fixture::new();
    std::fs::write(&f.cfg, "[child]\ncommand = [\"no-such-vllm\"]\n").unwrap();
    let o = f.run(&["check"]);
    failed(&o, 78, "1 problem found");
    assert_eq!(stdout(&o), "", "nothing said valid, no patterns printed");
}

/// An unwritable state directory: `run` cannot take its lock, and `check`
/// says so.
#[test]
fn check_equals_run_an_unwritable_state_directory() {
    let f = Fixture::new();
    std::fs::write(&f.cfg, "[child]\ncommand = [\"/bin/true\"]\n").unwrap();
    // A file where the folder should be.
    std::fs::write(f.state(), "").unwrap();
    failed(
        &f.run(&["check"]),
        78,
        &format!("state directory {}: is a regular file, not a folder", f.state().display()),
    );
    failed(&f.run(&["run"]), 78, "cannot take the lock");
    // A folder the service user cannot write (root's, 0755).
    std::fs::remove_file(f.state()).unwrap();
    std::fs::create_dir(f.state()).unwrap();
    std::fs::set_permissions(&f.cfg, std::fs::Permissions::from_mode(0o644)).unwrap();
    if !nobody::reachable_by_all(f.dir.path()) {
        // Not a pass: the rest did not run, and says why.
        eprintln!("SKIPPED the uid switch: no temporary folder uid {} can reach", nobody::UID);
        return;
    }
    // A copy of the binary nobody can reach (the checkout may be in a 0700 folder).
    let exe = nobody::copy_binary(env!("CARGO_BIN_EXE_vllm-warden"), f.dir.path());
    let mut c = f.command_of(&exe, &["check"]);
    c.uid(nobody::UID).gid(nobody::UID);
    failed(&run_within(c), 78, &format!("state directory {}: not writable by uid 65534", f.state().display()));
    let mut c = f.command_of(&exe, &["run"]);
    c.uid(nobody::UID).gid(nobody::UID);
    failed(&run_within(c), 78, "cannot take the lock");
}
