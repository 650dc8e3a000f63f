//! Where the child writes: the caches of vLLM and the libraries it loads,
//! and vLLM's IPC sockets. Under the shipped unit (`ProtectSystem=strict`,
//! `ProtectHome=read-only`, `PrivateTmp=yes`) the service user may write
//! only the unit's own folders, while those libraries write under `$HOME`
//! (read-only) or `/tmp` (private, thrown away at every restart: every
//! start would compile again). The warden points each cache into the
//! cache directory (`child.cache-dir`, by default systemd's
//! `$CACHE_DIRECTORY`) and the sockets into the runtime directory, each
//! variable only where neither `child.env` nor the warden's own
//! environment sets it: an operator's choice always wins. It also says
//! what stands in the way, as the child's user, before a start (a folder
//! it cannot write, one that will not outlive the service).
//!
//! It must not know how the child is spawned nor when.

use std::collections::BTreeMap;
use std::io;
use std::os::unix::fs::{DirBuilderExt, FileTypeExt, MetadataExt};
use std::path::{Path, PathBuf};

/// What a variable names.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Kind {
    /// A folder of caches, kept across restarts.
    Cache,
    /// The folder of vLLM's ZMQ IPC sockets: one run's, emptied before the
    /// next.
    Sockets,
    /// The Hugging Face hub cache, kept where it was (see [`HF_HOME`]).
    Hub,
}

/// One variable the warden may set for the child.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Known {
    pub(crate) name: &'static str,
    /// Under the cache directory (or, for [`Kind::Sockets`], the runtime
    /// directory); empty: the folder itself.
    pub(crate) sub: &'static str,
    pub(crate) kind: Kind,
    /// The variable whose default this one derives from: when the operator
    /// sets that one, this one follows it and the warden leaves it alone.
    pub(crate) parent: Option<&'static str>,
}

/// Every variable set under the cache directory: read in vLLM 0.32's
/// `envs.py` and the libraries it loads (torch 2.13, Triton, Hugging Face,
/// numba, tvm-ffi), and FlashInfer's public source (not in the CPU build).
/// Two are left unset on purpose: `TRITON_CACHE_DIR` (when it is unset,
/// vLLM keeps Triton's kernels per model in its own compile cache; Triton's
/// own default follows `TRITON_HOME`), and `DG_JIT_CACHE_DIR` (vLLM sets it
/// to `VLLM_CACHE_ROOT/deep_gemm` when it is unset).
pub(crate) const CACHES: &[Known] = &[
    Known {
        name: "XDG_CACHE_HOME",
        sub: "",
        kind: Kind::Cache,
        parent: None,
        // Who writes there: the default cache root of vLLM (assets), torch (hub, kernels, extensions), numba, outlines
    },
    Known {
        name: "XDG_CONFIG_HOME",
        sub: "config",
        kind: Kind::Cache,
        parent: None,
        // Who writes there: configuration files written at run time
    },
    Known {
        name: "VLLM_CONFIG_ROOT",
        sub: "config/vllm",
        kind: Kind::Cache,
        parent: Some("XDG_CONFIG_HOME"),
        // Who writes there: vLLM's config root (usage statistics, `do_not_track`)
    },
    Known {
        name: "VLLM_CACHE_ROOT",
        sub: "vllm",
        kind: Kind::Cache,
        parent: Some("XDG_CACHE_HOME"),
        // Who writes there: vLLM: torch.compile artefacts (`torch_compile_cache/`, with inductor's and Triton's kernels
        // per model), model info, DeepGEMM's and FlashInfer's caches
    },
    Known {
        name: "TORCHINDUCTOR_CACHE_DIR",
        sub: "torchinductor",
        kind: Kind::Cache,
        parent: None,
        // Who writes there: torch inductor's kernels outside vLLM's compile (default `/tmp/torchinductor_USER`)
    },
    Known {
        name: "TRITON_HOME",
        sub: "",
        kind: Kind::Cache,
        parent: None,
        // Who writes there: Triton's `.triton/` (cache, dump, override; default `$HOME`)
    },
    Known {
        name: "CUDA_CACHE_PATH",
        sub: "nv/ComputeCache",
        kind: Kind::Cache,
        parent: None,
        // Who writes there: CUDA's JIT cache of PTX compiled for this GPU (default `~/.nv/ComputeCache`)
    },
    Known {
        name: "FLASHINFER_WORKSPACE_BASE",
        sub: "",
        kind: Kind::Cache,
        parent: None,
        // Who writes there: FlashInfer's JIT kernels and cubins (`.cache/flashinfer/` under it; default `$HOME`)
    },
    Known {
        name: "TVM_FFI_CACHE_DIR",
        sub: "tvm-ffi",
        kind: Kind::Cache,
        parent: None,
        // Who writes there: tvm-ffi's JIT builds, for FlashInfer and CuTe kernels (default `~/.cache/tvm-ffi`)
    },
    Known {
        name: "HF_MODULES_CACHE",
        sub: "huggingface/modules",
        kind: Kind::Cache,
        parent: Some("HF_HOME"),
        // Who writes there: the code of `--trust-remote-code` models (default `HF_HOME/modules`)
    },
    Known {
        name: "NUMBA_CACHE_DIR",
        sub: "numba",
        kind: Kind::Cache,
        parent: None,
        // Who writes there: numba's compiled functions (its default is beside the code, in the read-only venv)
    },
    Known {
        name: "OUTLINES_CACHE_DIR",
        sub: "outlines",
        kind: Kind::Cache,
        parent: None,
        // Who writes there: outlines' guided-decoding cache
    },
    // Who writes there: matplotlib's font cache.
    Known { name: "MPLCONFIGDIR", sub: "matplotlib", kind: Kind::Cache, parent: None },
];

/// vLLM's ZMQ IPC sockets (default: the temporary folder, where every run
/// leaves its socket files), in the runtime directory.
pub(crate) const SOCKETS: Known = Known {
    name: "VLLM_RPC_BASE_PATH",
    sub: "vllm-ipc",
    kind: Kind::Sockets,
    parent: None,
    // Who writes there: vLLM's ZMQ IPC sockets between its processes
};

/// The longest sockets folder: ZMQ's `ipc://` paths are limited to 107
/// bytes (`sun_path`), and vLLM adds `/` and a 36-byte UUID.
pub(crate) const SOCKETS_MAX: usize = 70;

/// The Hugging Face hub cache follows `XDG_CACHE_HOME`: when the warden
/// sets that, `HF_HOME` is set to where the hub cache was before
/// (`$HOME/.cache/huggingface`), so that the operator's model store (unless
/// `HF_HUB_CACHE` names another) and the login token do not move. Not set
/// when `HF_HOME` is set already.
pub(crate) const HF_HOME: &str = "HF_HOME";

/// A variable the child will see, and where it comes from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Var {
    pub(crate) name: String,
    pub(crate) value: PathBuf,
    pub(crate) kind: Kind,
    /// Set by the warden (else by `child.env` or the warden's environment).
    pub(crate) ours: bool,
}

/// The folders the child writes and the variables that name them: each
/// known variable, with its value from `child.env`, else the warden's own
/// environment (`outer`), else the warden's default under `cache` (or
/// `runtime` for the sockets). A variable with none of the three is left
/// out (the library's own default applies).
pub(crate) fn plan(
    cache: Option<&Path>,
    runtime: Option<&Path>,
    env: &BTreeMap<String, String>,
    outer: &dyn Fn(&str) -> Option<String>,
) -> Vec<Var> {
    // Set, even to "": the operator's (the child gets exactly that).
    let given = |name: &str| env.get(name).cloned().or_else(|| outer(name));
    let mut out = Vec::new();
    let mut add = |k: &Known, base: Option<&Path>| match given(k.name) {
        Some(v) => out.push(Var { name: k.name.into(), value: PathBuf::from(v), kind: k.kind, ours: false }),
        // It follows the operator's choice of its parent.
        None if k.parent.is_some_and(|p| given(p).is_some()) => {}
        None => {
            if let Some(base) = base {
                let value = if k.sub.is_empty() { base.to_path_buf() } else { base.join(k.sub) };
                // Too long for a socket path: vLLM's default (the private
                // temporary folder) rather than a start that fails.
                if k.kind == Kind::Sockets && value.as_os_str().len() > SOCKETS_MAX {
                    return;
                }
                out.push(Var { name: k.name.into(), value, kind: k.kind, ours: true });
            }
        }
    };
    for k in CACHES {
        add(k, cache);
    }
    add(&SOCKETS, runtime);
    // The hub's home (its cache, unless HF_HUB_CACHE says otherwise, and
    // the login token) stays where it was.
    // The password database is asked only when HOME is not set (under the
    // unit, systemd sets it): this runs at every spawn, on the loop.
    let xdg_ours = out.iter().any(|v| v.name == "XDG_CACHE_HOME" && v.ours);
    if xdg_ours
        && given(HF_HOME).is_none()
        && let Some(home) = given("HOME").filter(|h| h.starts_with('/')).or_else(passwd_home)
    {
        out.push(Var {
            name: HF_HOME.into(),
            value: Path::new(&home).join(".cache/huggingface"),
            kind: Kind::Hub,
            ours: true,
        });
    }
    out
}

/// This user's home in the password database, as Python falls back to
/// when `HOME` is not set.
fn passwd_home() -> Option<String> {
    let user = nix::unistd::User::from_uid(nix::unistd::geteuid()).ok()??;
    Some(user.dir.to_string_lossy().into_owned()).filter(|d| d.starts_with('/'))
}

/// A value the warden can look at as the child would use it: an absolute
/// path with no `~` or variable for the library to expand.
fn plain_path(p: &Path) -> bool {
    p.is_absolute() && !p.to_string_lossy().contains(['~', '$'])
}

/// The variables of one config, with the warden's own environment.
pub(crate) fn of(s: &crate::config::Settings) -> Vec<Var> {
    plan(s.child.cache_dir.as_deref(), s.child.runtime_dir.as_deref(), &s.child.env, &|k| std::env::var(k).ok())
}

/// What the warden adds to the child's environment.
pub(crate) fn child_env(vars: &[Var]) -> impl Iterator<Item = (String, String)> + '_ {
    vars.iter().filter(|v| v.ours).map(|v| (v.name.clone(), v.value.to_string_lossy().into_owned()))
}

/// The problems (that a start would die of) and the warnings (that cost
/// time) of the folders the child writes, seen as this process's user,
/// who is the child's: each must be a folder it can write, or one it can
/// create. The hub cache is not looked at here.
pub(crate) fn problems(vars: &[Var]) -> (Vec<String>, Vec<String>) {
    let (mut bad, mut warn) = (Vec::new(), Vec::new());
    let uid = nix::unistd::geteuid();
    for v in vars.iter().filter(|v| v.kind != Kind::Hub && plain_path(&v.value)) {
        let shown = format!("{}={}", v.name, v.value.display());
        if v.kind == Kind::Sockets && v.value.as_os_str().len() > SOCKETS_MAX {
            bad.push(format!(
                "{shown}: longer than {SOCKETS_MAX} bytes: vLLM's socket paths under it would pass the 107 bytes a \
                 UNIX socket path may have; choose a shorter folder"
            ));
            continue;
        }
        if let Err(why) = writable_or_creatable(&v.value) {
            let fix = if v.ours {
                "the cache directory is the unit's CacheDirectory= (or child.cache-dir)".to_string()
            } else {
                format!("set {} in child.env to a folder the service user can write", v.name)
            };
            bad.push(format!("{shown}: {why} for uid {uid}: vLLM would fail at start; {fix}"));
            continue;
        }
        if v.kind == Kind::Cache
            && let Some(why) = short_lived(&v.value)
        {
            warn.push(format!(
                "{shown} is {why}: its caches are lost at every restart, so every start compiles again (minutes \
                 on a big model); the unit's CacheDirectory= keeps them"
            ));
        }
    }
    (bad, warn)
}

/// Why a cache folder cannot be used, or was not made.
#[derive(Debug, thiserror::Error)]
pub(crate) enum CacheError {
    #[error("not writable ({0})")]
    NotWritable(io::Error),
    #[error("is {0}, not a folder")]
    NotAFolder(&'static str),
    #[error("cannot be created: {} is not a folder", .0.display())]
    ParentNotAFolder(PathBuf),
    #[error("cannot be created: {} is not writable ({})", .0.display(), .1)]
    ParentNotWritable(PathBuf, io::Error),
    #[error("has no existing parent")]
    NoParent,
    #[error("{0}")]
    Other(io::Error),
    /// One of the warden's folders (`name=path`) could not be made.
    #[error("{name}={}: cannot be created: {source}", path.display())]
    Create { name: String, path: PathBuf, source: io::Error },
}

/// `Ok` when `dir` is a folder this user can write and enter, or can be
/// created by it; else why not.
fn writable_or_creatable(dir: &Path) -> Result<(), CacheError> {
    use crate::util::fsutil::Unwritable;
    crate::util::fsutil::writable_folder(dir).map_err(|why| match why {
        Unwritable::Denied(e) => CacheError::NotWritable(e),
        Unwritable::NotAFolder(kind) => CacheError::NotAFolder(kind),
        Unwritable::ParentNotAFolder(p) => CacheError::ParentNotAFolder(p),
        Unwritable::ParentDenied(p, e) => CacheError::ParentNotWritable(p, e),
        Unwritable::NoParent => CacheError::NoParent,
        Unwritable::Other(e) => CacheError::Other(e),
    })
}

/// Why a folder will not outlive the service, if it will not: on a tmpfs
/// (or ramfs), or in a temporary folder (the shipped unit's is private to
/// the service and emptied at every restart).
fn short_lived(dir: &Path) -> Option<String> {
    if dir.starts_with("/tmp") || dir.starts_with("/var/tmp") {
        return Some("in a temporary folder (PrivateTmp=yes makes it private and empties it at every restart)".into());
    }
    let existing = dir.ancestors().find(|a| a.exists())?;
    let fs = nix::sys::statfs::statfs(existing).ok()?;
    let t = fs.filesystem_type();
    // ramfs: 0x858458f6 (nix names no constant for it).
    (t == nix::sys::statfs::TMPFS_MAGIC || t.0 as i64 == 0x858458f6)
        .then(|| "on a tmpfs (memory, emptied at every reboot)".into())
}

/// Before each start: the warden's folders made (mode 0700; an existing
/// one is left as it is), and the sockets an earlier run left in the
/// sockets folder removed (only sockets, only this user's, never `keep`
/// (the warden's own control socket, should it be configured there); only
/// when the folder is a real folder of this user, not a link elsewhere:
/// the run that made them is gone). Returns what could not be done.
pub(crate) fn prepare(vars: &[Var], keep: &Path) -> Result<(), CacheError> {
    let uid = nix::unistd::geteuid().as_raw();
    for v in vars.iter().filter(|v| v.ours && v.kind != Kind::Hub) {
        std::fs::DirBuilder::new()
            .recursive(true)
            .mode(0o700)
            .create(&v.value)
            .map_err(|source| CacheError::Create { name: v.name.clone(), path: v.value.clone(), source })?;
        if v.kind == Kind::Sockets {
            let ours = std::fs::symlink_metadata(&v.value).is_ok_and(|m| m.is_dir() && m.uid() == uid);
            if !ours {
                tracing::warn!(
                    EVENT = "caches",
                    "{}={}: not a folder of uid {uid} (a link, or another owner): its sockets are left alone",
                    v.name,
                    v.value.display()
                );
                continue;
            }
            let Ok(entries) = std::fs::read_dir(&v.value) else { continue };
            for e in entries.flatten() {
                let path = e.path();
                if path != keep && e.metadata().is_ok_and(|m| m.file_type().is_socket() && m.uid() == uid) {
                    let _ = std::fs::remove_file(path);
                }
            }
        }
    }
    Ok(())
}

/// The size in bytes of what is under `dir` (files only, links not
/// followed, other filesystems not entered), and the number of files.
pub(crate) fn size_of(dir: &Path) -> io::Result<(u64, u64)> {
    // The folder itself may be a link (to a bigger disk): followed.
    let dev = std::fs::metadata(dir)?.dev();
    let (mut bytes, mut files) = (0, 0);
    let mut todo = vec![dir.to_path_buf()];
    while let Some(d) = todo.pop() {
        let Ok(entries) = std::fs::read_dir(&d) else { continue };
        for e in entries.flatten() {
            let Ok(m) = e.metadata() else { continue };
            if m.is_dir() && m.dev() == dev {
                todo.push(e.path());
            } else if m.is_file() {
                bytes += m.blocks() * 512;
                files += 1;
            }
        }
    }
    Ok((bytes, files))
}

/// The size of the cache directory, measured on a thread of its own (a
/// big cache holds many thousands of files) when asked, the last result
/// kept. The thread is started at the first measure and kept for the next
/// (a change into loading or ready asks for one: no thread is started on
/// the way to `READY=1`); it ends once no meter is left.
#[derive(Debug, Clone, Default)]
pub(crate) struct Meter {
    inner: std::sync::Arc<(std::sync::Mutex<Measured>, std::sync::Condvar)>,
}

#[derive(Debug, Default)]
struct Measured {
    measuring: bool,
    /// A result came that nobody took yet.
    fresh: bool,
    last: Option<Size>,
    /// The folder to measure next, for the thread.
    wanted: Option<PathBuf>,
    /// The thread is started.
    started: bool,
}

/// What a measure found.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Size {
    pub(crate) bytes: u64,
    pub(crate) files: u64,
    pub(crate) at: std::time::SystemTime,
}

/// How often an idle measuring thread looks whether its meter is gone.
const METER_IDLE_LOOK: std::time::Duration = std::time::Duration::from_secs(60);

impl Meter {
    /// Measure `dir` now, unless a measure is under way.
    pub(crate) fn measure(&self, dir: &Path) {
        let mut m = self.inner.0.lock().unwrap_or_else(|e| e.into_inner());
        if m.measuring {
            return;
        }
        m.measuring = true;
        m.wanted = Some(dir.to_path_buf());
        if m.started {
            self.inner.1.notify_all();
            return;
        }
        let inner = self.inner.clone();
        let spawned = std::thread::Builder::new().name("cache size".into()).spawn(move || measure_when_asked(inner));
        match spawned {
            Ok(_) => m.started = true,
            Err(_) => {
                m.measuring = false;
                m.wanted = None;
            }
        }
    }

    /// Wait until no measure is under way, at most `limit`.
    #[cfg(test)]
    pub(crate) fn wait(&self, limit: std::time::Duration) {
        let m = self.inner.0.lock().unwrap_or_else(|e| e.into_inner());
        let _ = self.inner.1.wait_timeout_while(m, limit, |m| m.measuring);
    }

    /// A measure is under way, or its result not taken yet.
    pub(crate) fn waiting(&self) -> bool {
        let m = self.inner.0.lock().unwrap_or_else(|e| e.into_inner());
        m.measuring || m.fresh
    }

    /// The last size, and whether it is new since the last call.
    pub(crate) fn take(&self) -> (Option<Size>, bool) {
        let mut m = self.inner.0.lock().unwrap_or_else(|e| e.into_inner());
        (m.last, std::mem::take(&mut m.fresh))
    }
}

/// The measuring thread: each folder asked for, until no meter is left.
fn measure_when_asked(inner: std::sync::Arc<(std::sync::Mutex<Measured>, std::sync::Condvar)>) {
    let (lock, cond) = &*inner;
    let mut m = lock.lock().unwrap_or_else(|e| e.into_inner());
    loop {
        let Some(dir) = m.wanted.take() else {
            let (next, waited) = cond.wait_timeout(m, METER_IDLE_LOOK).unwrap_or_else(|e| e.into_inner());
            m = next;
            // Only this thread holds the meter: nobody will ask again.
            if waited.timed_out() && m.wanted.is_none() && std::sync::Arc::strong_count(&inner) == 1 {
                m.started = false;
                return;
            }
            continue;
        };
        drop(m);
        let found = size_of(&dir).ok();
        m = lock.lock().unwrap_or_else(|e| e.into_inner());
        m.measuring = false;
        m.fresh = true;
        if let Some((bytes, files)) = found {
            m.last = Some(Size { bytes, files, at: std::time::SystemTime::now() });
        }
        cond.notify_all();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn none(_: &str) -> Option<String> {
        None
    }

    #[test]
    fn every_cache_goes_under_the_cache_directory_and_the_sockets_under_the_runtime_one() {
        let vars = plan(
            Some(Path::new("/var/cache/vllm-warden/kimi")),
            Some(Path::new("/run/vllm-warden/kimi")),
            &BTreeMap::new(),
            &|k| (k == "HOME").then(|| "/var/lib/vllm-warden".to_string()),
        );
        let get = |n: &str| vars.iter().find(|v| v.name == n).map(|v| v.value.to_string_lossy().into_owned());
        assert_eq!(get("XDG_CACHE_HOME").as_deref(), Some("/var/cache/vllm-warden/kimi"));
        assert_eq!(get("VLLM_CACHE_ROOT").as_deref(), Some("/var/cache/vllm-warden/kimi/vllm"));
        assert_eq!(get("TORCHINDUCTOR_CACHE_DIR").as_deref(), Some("/var/cache/vllm-warden/kimi/torchinductor"));
        assert_eq!(get("VLLM_RPC_BASE_PATH").as_deref(), Some("/run/vllm-warden/kimi/vllm-ipc"));
        // The hub cache stays where it was.
        assert_eq!(get("HF_HOME").as_deref(), Some("/var/lib/vllm-warden/.cache/huggingface"));
        assert!(vars.iter().all(|v| v.ours));
        assert_eq!(vars.len(), CACHES.len() + 2);
        assert!(!vars.iter().any(|v| v.name == "TRITON_CACHE_DIR" || v.name == "DG_JIT_CACHE_DIR"), "left to vLLM");
    }

    /// The man page's table says every variable and its value.
    #[test]
    fn the_man_page_lists_every_variable_with_its_value() {
        let page = include_str!("../../docs/vllm-warden.toml.5.md");
        for k in CACHES.iter().chain([&SOCKETS]) {
            let base = if k.kind == Kind::Sockets { "R" } else { "C" };
            let value = if k.sub.is_empty() { format!("`{base}`") } else { format!("`{base}/{}`", k.sub) };
            let row = format!("| `{}` | {value} | ", k.name);
            assert!(page.contains(&row), "the man page has no row {row}");
        }
        assert!(page.contains("| `HF_HOME` | `$HOME/.cache/huggingface` |"));
    }

    #[test]
    fn an_operators_choice_wins_and_nothing_is_set_without_a_cache_directory() {
        let env = BTreeMap::from([("TORCHINDUCTOR_CACHE_DIR".to_string(), "/srv/inductor".to_string())]);
        let outer = |k: &str| (k == "HF_HUB_CACHE").then(|| "/models/hub".to_string());
        let vars = plan(Some(Path::new("/c")), None, &env, &outer);
        let triton = vars.iter().find(|v| v.name == "TORCHINDUCTOR_CACHE_DIR").unwrap();
        assert_eq!((triton.value.as_path(), triton.ours), (Path::new("/srv/inductor"), false));
        // The operator's hub cache is theirs; the hub's home (its login
        // token) stays where it was, in the user's home when HOME is unset.
        let hf = vars.iter().find(|v| v.name == "HF_HOME").unwrap();
        assert!(hf.value.ends_with(".cache/huggingface") && hf.value.is_absolute(), "{hf:?}");
        assert!(!vars.iter().any(|v| v.name == "VLLM_RPC_BASE_PATH"), "no runtime directory, no sockets folder");
        let ours: Vec<_> = child_env(&vars).map(|(k, _)| k).collect();
        assert!(!ours.contains(&"TORCHINDUCTOR_CACHE_DIR".to_string()));
        assert_eq!(plan(None, None, &BTreeMap::new(), &none), vec![]);
        // An operator's XDG_CACHE_HOME: the hub and vLLM's cache follow it,
        // as they chose.
        let env = BTreeMap::from([("XDG_CACHE_HOME".to_string(), "/srv/cache".to_string())]);
        let vars = plan(Some(Path::new("/c")), None, &env, &none);
        assert!(!vars.iter().any(|v| v.name == "HF_HOME" || v.name == "VLLM_CACHE_ROOT"), "{vars:?}");
        assert!(vars.iter().any(|v| v.name == "TORCHINDUCTOR_CACHE_DIR" && v.ours));
        // A runtime directory too deep for socket paths: vLLM's default.
        let deep = format!("/run/vllm-warden/{}", "n".repeat(60));
        let vars = plan(None, Some(Path::new(&deep)), &BTreeMap::new(), &none);
        assert!(vars.is_empty(), "{vars:?}");
        let env = BTreeMap::from([("VLLM_RPC_BASE_PATH".to_string(), deep.clone())]);
        let (bad, _) = problems(&plan(None, None, &env, &none));
        assert!(bad[0].contains("longer than 70 bytes"), "{bad:?}");
    }

    #[test]
    fn folders_that_cannot_be_written_or_will_not_last_are_named() {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("file");
        std::fs::write(&file, "").unwrap();
        let var =
            |name: &str, value: &Path, ours| Var { name: name.into(), value: value.into(), kind: Kind::Cache, ours };
        let (bad, _) = problems(&[var("TORCHINDUCTOR_CACHE_DIR", &file, false)]);
        assert_eq!(bad.len(), 1);
        assert!(
            bad[0].starts_with(&format!(
                "TORCHINDUCTOR_CACHE_DIR={}: is a regular file, not a folder for uid",
                file.display()
            )),
            "{bad:?}"
        );
        assert!(bad[0].contains("set TORCHINDUCTOR_CACHE_DIR in child.env"), "{bad:?}");
        let (bad, _) = problems(&[var("XDG_CACHE_HOME", &file.join("sub"), true)]);
        assert!(bad[0].contains("is not a folder") && bad[0].contains("CacheDirectory="), "{bad:?}");
        let (bad, warn) = problems(&[var("XDG_CACHE_HOME", Path::new("/tmp/vllm-warden-test/never-made"), true)]);
        assert!(bad.is_empty(), "{bad:?}");
        assert!(warn[0].contains("PrivateTmp=yes"), "{warn:?}");
        let (bad, warn) = problems(&[var("XDG_CACHE_HOME", Path::new("/dev/shm/vllm-warden-test"), true)]);
        assert!(bad.is_empty() && warn[0].contains("on a tmpfs"), "{warn:?}");
    }

    #[test]
    fn prepare_makes_the_folders_and_empties_the_sockets_folder_of_sockets_only() {
        let dir = tempfile::tempdir().unwrap();
        let ipc = dir.path().join("run/vllm-ipc");
        let vars = vec![
            Var { name: "VLLM_CACHE_ROOT".into(), value: dir.path().join("c/vllm"), kind: Kind::Cache, ours: true },
            Var { name: "VLLM_RPC_BASE_PATH".into(), value: ipc.clone(), kind: Kind::Sockets, ours: true },
            Var {
                name: "TORCHINDUCTOR_CACHE_DIR".into(),
                value: dir.path().join("theirs"),
                kind: Kind::Cache,
                ours: false,
            },
        ];
        prepare(&vars, Path::new("/nonexistent")).unwrap();
        assert!(dir.path().join("c/vllm").is_dir() && ipc.is_dir());
        assert!(!dir.path().join("theirs").exists(), "an operator's folder is theirs to make");
        let sock = ipc.join("0b6f8a2e-socket");
        let _l = std::os::unix::net::UnixListener::bind(&sock).unwrap();
        std::fs::write(ipc.join("note.txt"), "kept").unwrap();
        let control = ipc.join("control.sock");
        let _c = std::os::unix::net::UnixListener::bind(&control).unwrap();
        prepare(&vars, &control).unwrap();
        assert!(!sock.exists() && ipc.join("note.txt").exists());
        assert!(control.exists(), "the warden's own socket is kept");
        // A sockets folder that is a link elsewhere: nothing there is touched.
        let elsewhere = dir.path().join("elsewhere");
        std::fs::create_dir_all(&elsewhere).unwrap();
        let theirs = elsewhere.join("theirs.sock");
        let _t = std::os::unix::net::UnixListener::bind(&theirs).unwrap();
        let link = dir.path().join("run/linked");
        std::os::unix::fs::symlink(&elsewhere, &link).unwrap();
        let linked = vec![Var { name: "VLLM_RPC_BASE_PATH".into(), value: link, kind: Kind::Sockets, ours: true }];
        prepare(&linked, Path::new("/nonexistent")).unwrap();
        assert!(theirs.exists());
        assert_eq!(size_of(dir.path()).unwrap().1, 1);
    }
}
