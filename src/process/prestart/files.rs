//! Files in use and stale files: who holds a path open or mapped, and
//! removing what matches a glob and no one holds.

use std::collections::{BTreeSet, HashMap};
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::sync::{LazyLock, Mutex};
use std::time::Duration;

use super::*;

/// The files of `dir` that a live process has open or mapped, with the pids.
pub fn in_use_under(dir: &Path) -> HashMap<PathBuf, BTreeSet<i32>> {
    let files: Vec<PathBuf> =
        std::fs::read_dir(dir).map(|d| d.flatten().map(|e| e.path()).collect()).unwrap_or_default();
    in_use(&files)
}

/// A file's identity: device and inode.
pub(super) fn identity(m: &std::fs::Metadata) -> (u64, u64) {
    (m.dev(), m.ino())
}

/// Those of `paths` that a live process has open or mapped, with the pids,
/// matched by identity (device and inode), not by name: a process maps a
/// POSIX semaphore under the temporary name it was created with
/// (`/dev/shm/sem.WUuiYZ (deleted)` in `/proc/PID/maps` for what is now
/// `/dev/shm/sem.mp-…`), and a renamed file keeps its inode. One pass over
/// `/proc`, none when no path names a regular file.
pub(crate) fn in_use(paths: &[PathBuf]) -> HashMap<PathBuf, BTreeSet<i32>> {
    let mut out: HashMap<PathBuf, BTreeSet<i32>> = HashMap::new();
    let ids: HashMap<(u64, u64), &PathBuf> = paths
        .iter()
        .filter_map(|p| std::fs::symlink_metadata(p).ok().filter(|m| m.is_file()).map(|m| (identity(&m), p)))
        .collect();
    if ids.is_empty() {
        return out;
    }
    for pid in crate::process::child::processes() {
        if let Ok(fds) = std::fs::read_dir(format!("/proc/{pid}/fd")) {
            for fd in fds.flatten() {
                // The magic link leads to the open file itself, renamed or not.
                if let Ok(m) = std::fs::metadata(fd.path())
                    && let Some(p) = ids.get(&identity(&m))
                {
                    out.entry((*p).clone()).or_default().insert(pid);
                }
            }
        }
        // By hand: the procfs crate's parser panics on a mapped file named
        // `/SYSV` and shorter than 13 bytes, which a process can make.
        if let Ok(maps) = std::fs::read_to_string(format!("/proc/{pid}/maps")) {
            for line in maps.lines() {
                // address perms offset dev(major:minor, hex) inode path
                let mut f = line.split_whitespace();
                let (Some(dev), Some(ino)) = (f.nth(3), f.next()) else { continue };
                let Some((major, minor)) = dev.split_once(':') else { continue };
                let (Ok(major), Ok(minor), Ok(ino)) =
                    (u64::from_str_radix(major, 16), u64::from_str_radix(minor, 16), ino.parse::<u64>())
                else {
                    continue;
                };
                if ino == 0 {
                    continue;
                }
                let dev = nix::sys::stat::makedev(major, minor);
                if let Some(p) = ids.get(&(dev, ino)) {
                    out.entry((*p).clone()).or_default().insert(pid);
                }
            }
        }
    }
    out
}

/// The files of `dir` whose names match one of `globs`, sorted.
///
/// A folder listed without a match is not listed again while it is the same
/// folder with the same modification time: making, renaming or removing an
/// entry changes that time, and `/tmp` can hold thousands of entries that
/// would be read before every start. The time must be older than the
/// listing by [`UNCHANGED_MARGIN`], as file times advance in clock ticks:
/// an entry made in the tick of the listing could leave it the same.
pub(crate) fn candidates(dir: &Path, globs: &[String]) -> Vec<PathBuf> {
    let stamp = folder_stamp(dir);
    let unchanged =
        |cache: &Matchless| stamp.is_some_and(|s| cache.get(dir).is_some_and(|(was, g)| *was == s && g == globs));
    if unchanged(&MATCHLESS.lock().unwrap_or_else(|p| p.into_inner())) {
        return Vec::new();
    }
    let listed_at = std::time::SystemTime::now();
    let patterns: Vec<glob::Pattern> = globs.iter().filter_map(|g| glob::Pattern::new(g).ok()).collect();
    let Ok(entries) = std::fs::read_dir(dir) else { return Vec::new() };
    let mut paths: Vec<PathBuf> = entries
        .flatten()
        .filter(|e| e.file_name().to_str().is_some_and(|n| patterns.iter().any(|g| g.matches(n))))
        .map(|e| e.path())
        .collect();
    paths.sort();
    let mut cache = MATCHLESS.lock().unwrap_or_else(|p| p.into_inner());
    match stamp.filter(|s| paths.is_empty() && s.modified + UNCHANGED_MARGIN <= listed_at) {
        Some(s) => cache.insert(dir.to_path_buf(), (s, globs.to_vec())),
        None => cache.remove(dir),
    };
    paths
}

/// See [`candidates`].
pub(crate) const UNCHANGED_MARGIN: Duration = Duration::from_secs(1);

/// Which folder is at a path, and when its entries last changed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct FolderStamp {
    pub(super) dev: u64,
    pub(super) ino: u64,
    pub(super) modified: std::time::SystemTime,
}

pub(super) fn folder_stamp(dir: &Path) -> Option<FolderStamp> {
    let m = std::fs::metadata(dir).ok()?;
    Some(FolderStamp { dev: m.dev(), ino: m.ino(), modified: m.modified().ok()? })
}

/// Folders last listed without a match, with their stamp and the globs.
pub(super) type Matchless = HashMap<PathBuf, (FolderStamp, Vec<String>)>;
pub(super) static MATCHLESS: LazyLock<Mutex<Matchless>> = LazyLock::new(Mutex::default);

/// What cleaning a folder did.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub(crate) struct Cleaned {
    pub(crate) removed: Vec<PathBuf>,
    /// Kept, and why.
    pub(crate) kept: Vec<(PathBuf, String)>,
}

impl Cleaned {
    pub(crate) fn describe(&self) -> String {
        let names = |v: &mut dyn Iterator<Item = &PathBuf>| {
            v.map(|p| p.file_name().map_or_else(String::new, |n| n.to_string_lossy().into_owned()))
                .collect::<Vec<_>>()
                .join(", ")
        };
        let mut parts = Vec::new();
        if !self.removed.is_empty() {
            parts.push(format!("removed {}", names(&mut self.removed.iter())));
        }
        for (p, why) in &self.kept {
            parts.push(format!("kept {} ({why})", p.display()));
        }
        if parts.is_empty() { "nothing to clean".into() } else { parts.join("; ") }
    }
}

/// Remove those of `paths` that are regular files of `uid` and that no
/// live process has open or mapped.
pub(crate) fn clean_candidates(paths: Vec<PathBuf>, uid: u32, in_use: &HashMap<PathBuf, BTreeSet<i32>>) -> Cleaned {
    let mut out = Cleaned::default();
    for path in paths {
        let Ok(meta) = std::fs::symlink_metadata(&path) else { continue };
        if !meta.is_file() {
            continue;
        }
        if meta.uid() != uid {
            out.kept.push((path, format!("owned by uid {}", meta.uid())));
            continue;
        }
        if let Some(pids) = in_use.get(&path) {
            let who: Vec<String> = pids.iter().map(|p| format!("pid {p} {}", cmdline(*p))).collect();
            out.kept.push((path, format!("in use by {}", who.join(", "))));
            continue;
        }
        match std::fs::remove_file(&path) {
            Ok(()) => out.removed.push(path),
            Err(e) => out.kept.push((path, format!("cannot remove: {e}"))),
        }
    }
    out
}
