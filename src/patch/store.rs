//! The patches folder, `$STATE_DIRECTORY/patches/`: the lock that
//! serialises every run of `patch` and the warden's pre-start patching, the
//! manifest, and the originals, each under the name of its own sha256.
//!
//! The state directory belongs to the service user, and `patch` may run as
//! root, so nothing here is trusted: the folder is opened without following
//! a symlink, every name in it is one the warden derives (`lock`,
//! `manifest.json`, 64 hex digits) and is opened relative to the folder
//! without following a symlink, a file with a second name (a hard link) is
//! refused, what is read has a size cap, and an original must hash to its
//! name. What root creates here is given to the folder's owner, so that the
//! warden running as the service user can go on using it.

use std::collections::BTreeMap;
use std::ffi::{OsStr, OsString};
use std::fs::File;
use std::io::{self, Read};
use std::os::fd::AsFd;
use std::os::unix::fs::{FileExt, MetadataExt};
use std::path::{Path, PathBuf};

use rustix::fs::{FlockOperation, Mode, OFlags};
use serde::{Deserialize, Serialize};

use super::error::{OriginalError, PatchError};
use super::source::sha256;
use crate::util::fsutil::{BeneathError, Dir, read_capped};

const MANIFEST: &str = "manifest.json";
const LOCK: &str = "lock";
/// Far above any manifest of a few files.
const MANIFEST_MAX: u64 = 16 << 20;

/// Whether to wait for a lock another run holds.
#[derive(Clone, Copy)]
pub enum Wait<'a> {
    /// Fail at once, naming the holder (the warden's pre-start: a start
    /// that fails this way is retried).
    No,
    /// Say so with this, then wait (`vllm-warden patch`).
    Block(&'a dyn Fn(&str)),
}

/// The index of what was patched: for each file, the sha256 of its
/// original (also the name of the original's copy) and of its patched
/// content, and the link's target when the file was a symlink. Only ever
/// an index: what is restored, and where, comes from the config.
#[derive(Debug, Default, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct Manifest {
    pub(crate) files: BTreeMap<PathBuf, Entry>,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct Entry {
    pub(crate) original_sha256: String,
    pub(crate) patched_sha256: String,
    /// The link's target, when the file was a symlink.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub(crate) symlink: Option<PathBuf>,
}

impl Manifest {
    /// Whether an entry keeps the original whose sha256 is `sha`.
    pub(crate) fn keeps(&self, sha: &str) -> bool {
        self.files.values().any(|e| e.original_sha256 == sha)
    }
}

fn is_sha256(s: &str) -> bool {
    s.len() == 64 && s.bytes().all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b))
}

/// The held lock: released when dropped, or when the process ends.
#[derive(Debug)]
pub(crate) struct Lock {
    _file: File,
}

/// The patches folder, opened.
#[derive(Debug)]
pub(crate) struct Store {
    dir: Dir,
    /// Who what we create here belongs to, when it is not us: the folder's
    /// owner, when root runs `patch` in the service user's state directory.
    owner: Option<(u32, u32)>,
}

impl Store {
    /// The patches folder of `state_dir`, created (with the state directory)
    /// when `create` says so; `None` when there is none and it is not to be
    /// created.
    pub(crate) fn open(state_dir: &Path, create: bool) -> Result<Option<Store>, PatchError> {
        let err = |source| PatchError::State { dir: state_dir.to_path_buf(), source };
        if create {
            std::fs::create_dir_all(state_dir).map_err(err)?;
        }
        let state = match Dir::open(state_dir) {
            Ok(d) => d,
            Err(e) if e.kind() == io::ErrorKind::NotFound && !create => return Ok(None),
            Err(e) => return Err(err(e)),
        };
        let name = OsStr::new("patches");
        let existed = state.lstat(name).map_err(err)?.is_some();
        if !existed && !create {
            return Ok(None);
        }
        let dir = state
            .child_dir(name, create.then_some(0o700))
            .map_err(|source| PatchError::State { dir: state_dir.join(name), source })?;
        let root = nix::unistd::geteuid().is_root();
        let owner = if root {
            let meta = state.metadata().map_err(err)?;
            Some((meta.uid(), meta.gid())).filter(|o| *o != (0, 0))
        } else {
            None
        };
        if let (false, Some((uid, gid))) = (existed, owner) {
            std::os::unix::fs::fchown(dir.fd(), Some(uid), Some(gid)).map_err(err)?;
        }
        Ok(Some(Store { dir, owner }))
    }

    pub(crate) fn path(&self) -> &Path {
        self.dir.path()
    }

    fn manifest_path(&self) -> PathBuf {
        self.path().join(MANIFEST)
    }

    fn state_err(&self, source: io::Error) -> PatchError {
        PatchError::State { dir: self.path().to_path_buf(), source }
    }

    /// Take the lock (`flock` on `patches/lock`).
    pub(crate) fn lock(&self, wait: Wait<'_>) -> Result<Lock, PatchError> {
        let path = self.path().join(LOCK);
        let io_err = |source| PatchError::State { dir: path.clone(), source };
        let flags = OFlags::RDWR | OFlags::CREATE | OFlags::NOFOLLOW | OFlags::NONBLOCK | OFlags::CLOEXEC;
        let fd = rustix::fs::openat(self.dir.fd(), LOCK, flags, Mode::from_raw_mode(0o600))
            .map_err(|e| io_err(refusal(e, "a symlink")))?;
        let file = File::from(fd);
        let meta = file.metadata().map_err(io_err)?;
        if !meta.is_file() || meta.nlink() != 1 {
            return Err(io_err(io::Error::new(io::ErrorKind::InvalidData, "not a regular file of its own")));
        }
        if let Some((uid, gid)) = self.owner
            && meta.uid() != uid
        {
            std::os::unix::fs::fchown(&file, Some(uid), Some(gid)).map_err(io_err)?;
        }
        match rustix::fs::flock(file.as_fd(), FlockOperation::NonBlockingLockExclusive) {
            Ok(()) => {}
            Err(rustix::io::Errno::WOULDBLOCK) => {
                let mut text = String::new();
                let _ = (&file).take(32).read_to_string(&mut text);
                let holder = match text.trim().parse::<u32>() {
                    Ok(pid) => format!("pid {pid}"),
                    Err(_) => "another run".into(),
                };
                match wait {
                    Wait::No => return Err(PatchError::Locked { lock: path, holder }),
                    Wait::Block(say) => {
                        say(&format!("waiting for {}, held by {holder}", path.display()));
                        rustix::fs::flock(file.as_fd(), FlockOperation::LockExclusive).map_err(|e| io_err(e.into()))?;
                    }
                }
            }
            Err(e) => return Err(io_err(e.into())),
        }
        // Who holds it, for a run that finds it held.
        let pid = format!("{}\n", std::process::id());
        let _ = file.set_len(0).and_then(|()| file.write_all_at(pid.as_bytes(), 0));
        self.dir.remove_stale_temps(OsStr::new(MANIFEST));
        Ok(Lock { _file: file })
    }

    /// The manifest; empty when there is none.
    pub(crate) fn load(&self) -> Result<Manifest, PatchError> {
        let path = self.manifest_path();
        let bad = |reason: String| PatchError::Manifest { path: path.clone(), reason };
        let (file, _) = match self.dir.open_regular(OsStr::new(MANIFEST), true) {
            Ok(f) => f,
            Err(BeneathError::Io { source, .. }) if source.kind() == io::ErrorKind::NotFound => {
                return Ok(Manifest::default());
            }
            Err(BeneathError::Io { source, .. }) => return Err(bad(format!("cannot read: {source}"))),
            Err(BeneathError::Kind { kind, wanted, .. }) => return Err(bad(format!("is {kind}, not {wanted}"))),
            Err(e) => return Err(bad(e.to_string())),
        };
        let bytes = match read_capped(&file, MANIFEST_MAX) {
            Ok(Ok(b)) => b,
            Ok(Err(size)) => return Err(bad(format!("is {size} bytes, more than a manifest can be ({MANIFEST_MAX})"))),
            Err(e) => return Err(bad(format!("cannot read: {e}"))),
        };
        let m: Manifest = serde_json::from_slice(&bytes).map_err(|e| bad(format!("not a manifest: {e}")))?;
        for (file, e) in &m.files {
            for (key, sha) in [("original_sha256", &e.original_sha256), ("patched_sha256", &e.patched_sha256)] {
                if !is_sha256(sha) {
                    return Err(bad(format!("the entry of {}: `{key}` is not a sha256", file.display())));
                }
            }
        }
        Ok(m)
    }

    pub(crate) fn save(&self, m: &Manifest) -> Result<(), PatchError> {
        let text = serde_json::to_string_pretty(m).map_err(|e| self.state_err(io::Error::other(e)))?;
        self.dir.write_atomic(OsStr::new(MANIFEST), text.as_bytes(), 0o600, self.owner).map_err(|e| self.state_err(e))
    }

    /// Keep `bytes`, whose sha256 is `sha`, as an original: under the name
    /// `sha`, unless a true copy is already there. Returns whether it was
    /// written now.
    pub(crate) fn keep_original(&self, bytes: &[u8], sha: &str) -> Result<bool, PatchError> {
        let name = name_of(sha).map_err(|e| self.state_err(e))?;
        if self.dir.create_new(&name, bytes, 0o600, self.owner).map_err(|e| self.state_err(e))? {
            self.dir.sync().map_err(|e| self.state_err(e))?;
            return Ok(true);
        }
        if self.original(sha, bytes.len() as u64).is_ok() {
            return Ok(false);
        }
        // Not a true copy: ours to replace.
        self.dir.write_atomic(&name, bytes, 0o600, self.owner).map_err(|e| self.state_err(e))?;
        Ok(true)
    }

    /// The original whose sha256 is `sha`, checked against it.
    pub(crate) fn original(&self, sha: &str, max: u64) -> Result<Vec<u8>, OriginalError> {
        let name = name_of(sha).map_err(OriginalError::Name)?;
        let (file, _) = match self.dir.open_regular(&name, true) {
            Ok(f) => f,
            Err(BeneathError::Io { source, .. }) if source.kind() == io::ErrorKind::NotFound => {
                return Err(OriginalError::Missing);
            }
            Err(BeneathError::Kind { kind, wanted, .. }) => return Err(OriginalError::Kind { kind, wanted }),
            Err(e) => return Err(OriginalError::Open(e)),
        };
        let bytes = match read_capped(&file, max) {
            Ok(Ok(b)) => b,
            Ok(Err(size)) => return Err(OriginalError::TooBig(size)),
            Err(e) => return Err(OriginalError::Read(e)),
        };
        if sha256(&bytes) != sha {
            return Err(OriginalError::Mismatch);
        }
        Ok(bytes)
    }

    /// The path of the original whose sha256 is `sha`, for messages.
    pub(crate) fn original_path(&self, sha: &str) -> PathBuf {
        self.path().join(sha)
    }

    /// Remove the original `sha`.
    pub(crate) fn forget_original(&self, sha: &str) {
        if let Ok(name) = name_of(sha) {
            let _ = self.dir.remove(&name);
            let _ = self.dir.sync();
        }
    }
}

/// The name of the original whose sha256 is `sha`: the hash itself, never
/// anything else.
fn name_of(sha: &str) -> io::Result<OsString> {
    if is_sha256(sha) {
        Ok(OsString::from(sha))
    } else {
        Err(io::Error::new(io::ErrorKind::InvalidInput, format!("{sha:?} is not a sha256")))
    }
}

/// ELOOP from `O_NOFOLLOW` as the refusal it is.
fn refusal(e: rustix::io::Errno, what: &str) -> io::Error {
    match e {
        rustix::io::Errno::LOOP => io::Error::new(io::ErrorKind::InvalidData, format!("is {what}, not a regular file")),
        e => e.into(),
    }
}

/// What `run` and `patch` would meet in the patches folder at start: a
/// folder that is not one, a lock that cannot be taken, a manifest that
/// cannot be read. Reads only.
pub(crate) fn check(state_dir: &Path) -> Vec<String> {
    let Ok(state) = Dir::open(state_dir) else { return Vec::new() };
    let name = OsStr::new("patches");
    let path = state_dir.join(name);
    match state.lstat(name) {
        Ok(None) => return Vec::new(),
        Ok(Some(m)) if m.is_dir() => {}
        Ok(Some(m)) => {
            return vec![format!("{}: is {}, not a folder", path.display(), crate::util::fsutil::kind_of(&m))];
        }
        Err(e) => return vec![format!("{}: {e}", path.display())],
    }
    let store = match state.child_dir(name, None) {
        Ok(dir) => Store { dir, owner: None },
        Err(e) => return vec![format!("{}: {e}", path.display())],
    };
    let mut out = Vec::new();
    if let Err(e) = store.dir.writable() {
        out.push(format!("{}: not writable: {e}", path.display()));
    }
    match store.dir.lstat(OsStr::new(LOCK)) {
        Ok(Some(m)) if !m.is_file() => {
            out.push(format!(
                "{}: is {}, not a regular file",
                path.join(LOCK).display(),
                crate::util::fsutil::kind_of(&m)
            ));
        }
        Ok(Some(m)) if m.nlink() != 1 => {
            out.push(format!("{}: has more than one name (a hard link)", path.join(LOCK).display()));
        }
        Ok(_) => {}
        Err(e) => out.push(format!("{}: {e}", path.join(LOCK).display())),
    }
    if let Err(e) = store.load() {
        out.push(e.to_string());
    }
    out
}
