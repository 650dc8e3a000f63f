//! A model file read as untrusted input. The folders of a model belong to
//! the service user, and `patch` runs as root: so the file must be a
//! regular file (a FIFO, a device or a socket is refused, and opened
//! without blocking so that a FIFO cannot hold the open), no larger than
//! its `max-size`, and a symlink is followed only within the model's
//! folder: the folder the file is in or, in a Hugging Face cache
//! (`…/models--org--name/snapshots/<rev>/config.json → ../../blobs/<sha>`),
//! the repository folder it belongs to.

use std::ffi::OsString;
use std::io;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};

use sha2::{Digest, Sha256};

use super::error::PatchError;
use crate::util::fsutil::{BeneathError, Dir, Stamp, read_capped};

/// Where a model file may lead, and where its name is.
#[derive(Debug)]
pub(crate) struct Place {
    /// The file as the config names it.
    pub(crate) file: PathBuf,
    /// The folder symlinks must stay in.
    pub(crate) root: Dir,
    /// The folder the file's name is in, reached from `root` without
    /// following a symlink.
    pub(crate) dir: Dir,
    /// That folder, relative to `root`.
    pub(crate) dir_rel: PathBuf,
    pub(crate) name: OsString,
}

/// `…/models--org--name/snapshots/<rev>/FILE` → `…/models--org--name`
/// and `snapshots/<rev>`; any other file → its folder and `""`.
fn split(file: &Path) -> Option<(PathBuf, PathBuf, OsString)> {
    let name = file.file_name()?.to_os_string();
    let parent = file.parent().filter(|p| !p.as_os_str().is_empty()).unwrap_or(Path::new("."));
    let rev = parent.file_name();
    let snapshots = parent.parent();
    let repo = snapshots.and_then(Path::parent);
    let is_cache = snapshots.and_then(Path::file_name).is_some_and(|n| n == "snapshots")
        && repo.and_then(Path::file_name).and_then(|n| n.to_str()).is_some_and(|n| n.starts_with("models--"));
    match (is_cache, repo, rev) {
        (true, Some(repo), Some(rev)) => Some((repo.to_path_buf(), Path::new("snapshots").join(rev), name)),
        _ => Some((parent.to_path_buf(), PathBuf::new(), name)),
    }
}

impl Place {
    pub(crate) fn open(file: &Path) -> Result<Place, PatchError> {
        let (root_path, dir_rel, name) = split(file).ok_or_else(|| PatchError::Read {
            file: file.to_path_buf(),
            source: io::Error::new(io::ErrorKind::InvalidInput, "not a file name"),
        })?;
        let root = Dir::open(&root_path).map_err(|source| PatchError::Read { file: file.to_path_buf(), source })?;
        let dir = root.dir_beneath(&dir_rel).map_err(|e| beneath(file, e))?;
        Ok(Place { file: file.to_path_buf(), root, dir, dir_rel, name })
    }

    /// Read the file (through its symlink, if it is one).
    pub(crate) fn read(&self, max: u64) -> Result<Source, PatchError> {
        let file = &self.file;
        let read_err = |source| PatchError::Read { file: file.clone(), source };
        let entry = self
            .dir
            .lstat(&self.name)
            .map_err(read_err)?
            .ok_or_else(|| read_err(io::Error::from_raw_os_error(libc::ENOENT)))?;
        let (link, opened) = if entry.file_type().is_symlink() {
            let target = self.dir.read_link(&self.name).map_err(read_err)?;
            let b = self.root.open_beneath(&self.dir_rel.join(&self.name)).map_err(|e| beneath(file, e))?;
            (Some(target), (b.file, b.meta))
        } else {
            (None, self.dir.open_regular(&self.name, false).map_err(|e| beneath(file, e))?)
        };
        let (handle, meta) = opened;
        if meta.len() > max {
            return Err(PatchError::TooBig { file: file.clone(), size: meta.len(), max });
        }
        let bytes = match read_capped(&handle, max).map_err(read_err)? {
            Ok(b) => b,
            Err(size) => return Err(PatchError::TooBig { file: file.clone(), size, max }),
        };
        Ok(Source {
            entry: Stamp::of(&entry),
            content: Stamp::of(&meta),
            mode: meta.mode() & 0o7777,
            owner: (meta.uid(), meta.gid()),
            sha: sha256(&bytes),
            link,
            bytes,
        })
    }

    /// Whether the file is still what `seen` read: the same name entry, the
    /// same content file and the same bytes.
    pub(crate) fn unchanged(&self, seen: &Source, max: u64) -> bool {
        match self.read(max) {
            Ok(now) => now.fingerprint() == seen.fingerprint(),
            Err(_) => false,
        }
    }
}

/// A model file as read.
#[derive(Debug, Clone)]
pub(crate) struct Source {
    /// The name's own inode: the file, or the symlink.
    pub(crate) entry: Stamp,
    /// The content's inode: the file, or the file the symlink leads to.
    pub(crate) content: Stamp,
    /// Mode and owner of the content.
    pub(crate) mode: u32,
    pub(crate) owner: (u32, u32),
    pub(crate) sha: String,
    /// The symlink's target, when the name is one.
    pub(crate) link: Option<OsString>,
    pub(crate) bytes: Vec<u8>,
}

impl Source {
    fn fingerprint(&self) -> (Stamp, Stamp, &str, &Option<OsString>) {
        (self.entry, self.content, &self.sha, &self.link)
    }
}

pub(crate) fn sha256(bytes: &[u8]) -> String {
    let digest = Sha256::digest(bytes);
    digest.iter().map(|b| format!("{b:02x}")).collect()
}

/// A refusal of `fsutil` as a patch error naming the file.
pub(crate) fn beneath(file: &Path, e: BeneathError) -> PatchError {
    match e {
        BeneathError::Escapes { link, target, root } => {
            PatchError::Escapes { file: file.to_path_buf(), link, target, root }
        }
        e @ BeneathError::Outside { .. } => PatchError::Read {
            file: file.to_path_buf(),
            source: io::Error::new(io::ErrorKind::InvalidInput, e.to_string()),
        },
        BeneathError::Kind { path, kind, wanted } => PatchError::Kind { file: file.to_path_buf(), path, kind, wanted },
        BeneathError::Io { source, .. } => PatchError::Read { file: file.to_path_buf(), source },
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_root_is_the_cache_repository_or_the_folder() {
        let (root, rel, name) = split(Path::new("/c/models--o--m/snapshots/abc/config.json")).unwrap();
        assert_eq!((root.as_path(), rel.as_path()), (Path::new("/c/models--o--m"), Path::new("snapshots/abc")));
        assert_eq!(name, "config.json");
        let (root, rel, _) = split(Path::new("/models/Kimi/config.json")).unwrap();
        assert_eq!((root.as_path(), rel.as_path()), (Path::new("/models/Kimi"), Path::new("")));
        let (root, _, _) = split(Path::new("config.json")).unwrap();
        assert_eq!(root, Path::new("."));
    }
}
