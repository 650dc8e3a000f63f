//! Files written whole or not at all, and names reached through folders that
//! someone else may own.
//!
//! [`replace`] writes the status document and the metrics file. [`Dir`] is
//! a folder opened once: every name under it is opened relative to that
//! descriptor and never through a symlink unless asked, temporary files get
//! names no one else uses (pid and 64 random bits), and [`Dir::open_beneath`]
//! follows symlinks by hand, refusing any that leads out of the folder. The
//! patches use it for model files and for the state directory, both of which
//! the service user can change while root reads them. [`read_small`] reads
//! a small file whole that someone else may have made a FIFO, a device or a
//! disk image: without blocking, regular files only, within a limit. What
//! is written or read is not known here.

use std::collections::VecDeque;
use std::ffi::{OsStr, OsString};
use std::fs::{self, File, OpenOptions};
use std::io::{self, Read, Write};
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::{MetadataExt, OpenOptionsExt, PermissionsExt};
use std::path::{Component, Path, PathBuf};

use rustix::fs::{AtFlags, Mode, OFlags, RenameFlags};

/// Replace `path` whole by rename, without fsync: a reader never sees a
/// half-written file, but a power loss may lose the last write. For files
/// that describe the running process (status, metrics), rewritten often and
/// meaningless after a reboot.
pub(crate) fn replace(path: &Path, bytes: &[u8], mode: u32) -> io::Result<()> {
    let name = path.file_name().and_then(|n| n.to_str()).unwrap_or("file");
    let tmp = path.with_file_name(format!(".{name}.vllm-warden.tmp"));
    let create = || OpenOptions::new().write(true).create_new(true).mode(mode).open(&tmp);
    let result = (|| {
        let mut f = match create() {
            // Left by a write that was cut short.
            Err(e) if e.kind() == io::ErrorKind::AlreadyExists => {
                let _ = fs::remove_file(&tmp);
                create()?
            }
            opened => opened?,
        };
        f.write_all(bytes)?;
        // The umask may have narrowed the mode given at creation.
        f.set_permissions(fs::Permissions::from_mode(mode))?;
        fs::rename(&tmp, path)
    })();
    if result.is_err() {
        let _ = fs::remove_file(&tmp);
    }
    result
}

/// Why this user cannot use a folder to write in: it must be a folder it
/// can write and enter, or one it can create.
#[derive(Debug)]
pub(crate) enum Unwritable {
    /// It is there, and is this kind of file (see [`kind_of`]).
    NotAFolder(&'static str),
    /// A folder this user may not write or enter.
    Denied(io::Error),
    /// Missing, and its nearest existing ancestor is not a folder.
    ParentNotAFolder(PathBuf),
    /// Missing, and its nearest existing ancestor may not be written.
    ParentDenied(PathBuf, io::Error),
    /// Missing, with no existing ancestor at all (a relative path).
    NoParent,
    Other(io::Error),
}

/// `Ok` when `dir` is a folder this user can write and enter (links
/// followed), or one it can create.
pub(crate) fn writable_folder(dir: &Path) -> Result<(), Unwritable> {
    use nix::unistd::{AccessFlags, access};
    let rw = |d: &Path| access(d, AccessFlags::W_OK | AccessFlags::X_OK).map_err(io::Error::from);
    match fs::metadata(dir) {
        Ok(m) if m.is_dir() => rw(dir).map_err(Unwritable::Denied),
        Ok(m) => Err(Unwritable::NotAFolder(kind_of(&m))),
        Err(e) if matches!(e.kind(), io::ErrorKind::NotFound | io::ErrorKind::NotADirectory) => {
            let parent =
                dir.ancestors().skip(1).find(|a| fs::symlink_metadata(a).is_ok()).ok_or(Unwritable::NoParent)?;
            if !parent.is_dir() {
                return Err(Unwritable::ParentNotAFolder(parent.to_path_buf()));
            }
            rw(parent).map_err(|e| Unwritable::ParentDenied(parent.to_path_buf(), e))
        }
        Err(e) => Err(Unwritable::Other(e)),
    }
}

/// The kind of a file, in words, for a message: `a FIFO (named pipe)`.
pub(crate) fn kind_of(m: &fs::Metadata) -> &'static str {
    use std::os::unix::fs::FileTypeExt;
    let t = m.file_type();
    if t.is_file() {
        "a regular file"
    } else if t.is_dir() {
        "a folder"
    } else if t.is_symlink() {
        "a symlink"
    } else if t.is_fifo() {
        "a FIFO (named pipe)"
    } else if t.is_socket() {
        "a socket"
    } else if t.is_char_device() {
        "a character device"
    } else if t.is_block_device() {
        "a block device"
    } else {
        "not a regular file"
    }
}

/// What a name pointed at when it was looked at: a file replaced, or
/// written in place, since then has another stamp.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Stamp {
    pub(crate) dev: u64,
    pub(crate) ino: u64,
    pub(crate) size: u64,
    pub(crate) mtime: (i64, i64),
}

impl Stamp {
    pub(crate) fn of(m: &fs::Metadata) -> Stamp {
        Stamp { dev: m.dev(), ino: m.ino(), size: m.size(), mtime: (m.mtime(), m.mtime_nsec()) }
    }
}

/// Why a name under a folder could not be opened within it.
#[derive(Debug, thiserror::Error)]
pub enum BeneathError {
    /// A symlink on the way leads out of the folder.
    #[error("the link {} -> {} leads out of {}", link.display(), target.display(), root.display())]
    Escapes { link: PathBuf, target: PathBuf, root: PathBuf },
    /// A path that climbs out of the folder by itself.
    #[error("{} climbs out of {}", path.display(), root.display())]
    Outside { path: PathBuf, root: PathBuf },
    /// The name is not what was asked for (a FIFO where a file should be).
    #[error("{} is {kind}, not {wanted}", path.display())]
    Kind { path: PathBuf, kind: &'static str, wanted: &'static str },
    #[error("{}: {source}", path.display())]
    Io { path: PathBuf, source: io::Error },
}

impl BeneathError {
    fn io(path: &Path, source: impl Into<io::Error>) -> BeneathError {
        BeneathError::Io { path: path.to_path_buf(), source: source.into() }
    }

    /// The error of the system call, if that is what it was.
    pub(crate) fn io_error(&self) -> Option<&io::Error> {
        match self {
            BeneathError::Io { source, .. } => Some(source),
            _ => None,
        }
    }
}

/// How many symlinks one resolution follows, as the kernel's own limit.
const MAX_LINKS: usize = 40;

/// A folder, opened once. Names under it are opened relative to it.
#[derive(Debug)]
pub(crate) struct Dir {
    fd: OwnedFd,
    path: PathBuf,
}

impl Dir {
    /// Open the folder at `path`, following symlinks: the path itself is
    /// trusted (it comes from the config or from systemd).
    pub(crate) fn open(path: &Path) -> io::Result<Dir> {
        let fd = rustix::fs::open(path, OFlags::RDONLY | OFlags::DIRECTORY | OFlags::CLOEXEC, Mode::empty())?;
        Ok(Dir { fd, path: path.to_path_buf() })
    }

    /// The folder `name` right under this one, never through a symlink;
    /// created with `mode` first when `create` says so and it is missing.
    pub(crate) fn child_dir(&self, name: &OsStr, create: Option<u32>) -> io::Result<Dir> {
        if let Some(mode) = create {
            match rustix::fs::mkdirat(&self.fd, name, Mode::from_raw_mode(mode)) {
                Ok(()) | Err(rustix::io::Errno::EXIST) => {}
                Err(e) => return Err(e.into()),
            }
        }
        let flags = OFlags::RDONLY | OFlags::DIRECTORY | OFlags::NOFOLLOW | OFlags::CLOEXEC;
        let fd = rustix::fs::openat(&self.fd, name, flags, Mode::empty()).map_err(|e| match e {
            // A symlink with O_DIRECTORY | O_NOFOLLOW.
            rustix::io::Errno::LOOP | rustix::io::Errno::NOTDIR => {
                io::Error::new(io::ErrorKind::InvalidData, "not a folder (a symlink is not followed here)")
            }
            e => e.into(),
        })?;
        Ok(Dir { fd, path: self.path.join(name) })
    }

    pub(crate) fn try_clone(&self) -> io::Result<Dir> {
        Ok(Dir { fd: self.fd.try_clone()?, path: self.path.clone() })
    }

    pub(crate) fn path(&self) -> &Path {
        &self.path
    }

    pub(crate) fn fd(&self) -> BorrowedFd<'_> {
        self.fd.as_fd()
    }

    /// The folder's own metadata.
    pub(crate) fn metadata(&self) -> io::Result<fs::Metadata> {
        let f = File::from(self.fd.try_clone()?);
        f.metadata()
    }

    /// What `name` is, without following it if it is a symlink; `None` when
    /// there is no such name.
    pub(crate) fn lstat(&self, name: &OsStr) -> io::Result<Option<fs::Metadata>> {
        let flags = OFlags::PATH | OFlags::NOFOLLOW | OFlags::CLOEXEC;
        match rustix::fs::openat(&self.fd, name, flags, Mode::empty()) {
            Ok(fd) => File::from(fd).metadata().map(Some),
            Err(rustix::io::Errno::NOENT) => Ok(None),
            Err(e) => Err(e.into()),
        }
    }

    /// The target of the symlink `name`.
    pub(crate) fn read_link(&self, name: &OsStr) -> io::Result<OsString> {
        let target = rustix::fs::readlinkat(&self.fd, name, Vec::new())?;
        Ok(OsStr::from_bytes(target.as_bytes()).to_os_string())
    }

    /// Open the regular file `name` for reading, never through a symlink,
    /// never blocking (a FIFO cannot hold the open), never making it the
    /// controlling terminal. Anything but a regular file is refused; so is
    /// one with more than one name (a hard link planted to reach a file
    /// elsewhere) when `single_link` says so.
    pub(crate) fn open_regular(&self, name: &OsStr, single_link: bool) -> Result<(File, fs::Metadata), BeneathError> {
        let path = self.path.join(name);
        let flags = OFlags::RDONLY | OFlags::NONBLOCK | OFlags::NOCTTY | OFlags::NOFOLLOW | OFlags::CLOEXEC;
        let fd = match rustix::fs::openat(&self.fd, name, flags, Mode::empty()) {
            Ok(fd) => fd,
            Err(rustix::io::Errno::LOOP) => {
                return Err(BeneathError::Kind { path, kind: "a symlink", wanted: "a regular file" });
            }
            // A socket cannot be opened; say what it is rather than ENXIO.
            Err(e) => {
                return Err(match self.lstat(name) {
                    Ok(Some(m)) if !m.is_file() => {
                        BeneathError::Kind { path, kind: kind_of(&m), wanted: "a regular file" }
                    }
                    _ => BeneathError::io(&path, e),
                });
            }
        };
        let file = File::from(fd);
        let meta = file.metadata().map_err(|e| BeneathError::io(&path, e))?;
        if !meta.is_file() {
            return Err(BeneathError::Kind { path, kind: kind_of(&meta), wanted: "a regular file" });
        }
        if single_link && meta.nlink() != 1 {
            let kind = "a file with more than one name (a hard link)";
            return Err(BeneathError::Kind { path, kind, wanted: "a file of its own" });
        }
        Ok((file, meta))
    }

    /// Open `rel`, a path relative to this folder, without leaving it:
    /// symlinks on the way are followed by hand, one component at a time,
    /// and one whose target is absolute (outside `self`'s real path) or
    /// climbs above the folder is refused. The result is a regular file
    /// opened for reading as [`Dir::open_regular`] does, with the path it
    /// really is at relative to this folder and the links followed.
    pub(crate) fn open_beneath(&self, rel: &Path) -> Result<Beneath, BeneathError> {
        let real = fs::canonicalize(&self.path).map_err(|e| BeneathError::io(&self.path, e))?;
        // The folders below `self` on the way, with their names.
        let mut stack: Vec<Dir> = Vec::new();
        let mut todo: VecDeque<OsString> = VecDeque::new();
        push_front(&mut todo, rel, &self.path)?;
        let mut links: Vec<(PathBuf, PathBuf)> = Vec::new();
        while let Some(name) = todo.pop_front() {
            let cur = stack.last().unwrap_or(self);
            if name == ".." {
                if stack.pop().is_none() {
                    let root = self.path.clone();
                    return Err(match links.last() {
                        Some((link, target)) => {
                            BeneathError::Escapes { link: link.clone(), target: target.clone(), root }
                        }
                        None => BeneathError::Outside { path: self.path.join(rel), root },
                    });
                }
                continue;
            }
            let here = cur.path.join(&name);
            let meta = cur
                .lstat(&name)
                .map_err(|e| BeneathError::io(&here, e))?
                .ok_or_else(|| BeneathError::io(&here, io::Error::from_raw_os_error(libc::ENOENT)))?;
            if meta.file_type().is_symlink() {
                if links.len() >= MAX_LINKS {
                    return Err(BeneathError::io(&here, io::Error::from_raw_os_error(libc::ELOOP)));
                }
                let target = PathBuf::from(cur.read_link(&name).map_err(|e| BeneathError::io(&here, e))?);
                links.push((here.clone(), target.clone()));
                if target.is_absolute() {
                    // Absolute, yet inside the folder: start again from it.
                    match target.strip_prefix(&real).or_else(|_| target.strip_prefix(&self.path)) {
                        Ok(inside) => {
                            stack.clear();
                            push_front(&mut todo, inside, &here)?;
                        }
                        Err(_) => {
                            return Err(BeneathError::Escapes { link: here, target, root: self.path.clone() });
                        }
                    }
                } else {
                    push_front(&mut todo, &target, &here)?;
                }
                continue;
            }
            if todo.is_empty() {
                let (file, meta) = cur.open_regular(&name, false)?;
                let mut path = PathBuf::new();
                for d in &stack {
                    path.push(d.path.file_name().unwrap_or_default());
                }
                path.push(&name);
                return Ok(Beneath { file, meta, rel: path, links });
            }
            if !meta.is_dir() {
                return Err(BeneathError::Kind { path: here, kind: kind_of(&meta), wanted: "a folder" });
            }
            let next = cur.child_dir(&name, None).map_err(|e| BeneathError::io(&here, e))?;
            stack.push(next);
        }
        Err(BeneathError::Kind { path: self.path.join(rel), kind: "a folder", wanted: "a regular file" })
    }

    /// The folder `rel` (relative to this one) without leaving this one:
    /// each component must be a real folder, never a symlink.
    pub(crate) fn dir_beneath(&self, rel: &Path) -> Result<Dir, BeneathError> {
        let mut cur: Option<Dir> = None;
        for c in rel.components() {
            match c {
                Component::CurDir => {}
                Component::Normal(name) => {
                    let base = cur.as_ref().unwrap_or(self);
                    let here = base.path.join(name);
                    match base.lstat(name).map_err(|e| BeneathError::io(&here, e))? {
                        Some(m) if m.is_dir() => {}
                        Some(m) => {
                            return Err(BeneathError::Kind { path: here, kind: kind_of(&m), wanted: "a folder" });
                        }
                        None => return Err(BeneathError::io(&here, io::Error::from_raw_os_error(libc::ENOENT))),
                    }
                    cur = Some(base.child_dir(name, None).map_err(|e| BeneathError::io(&here, e))?);
                }
                _ => return Err(BeneathError::Outside { path: self.path.join(rel), root: self.path.clone() }),
            }
        }
        match cur {
            Some(d) => Ok(d),
            None => self.try_clone().map_err(|e| BeneathError::io(&self.path, e)),
        }
    }

    /// Create a new file beside `target` under a name no other writer uses
    /// (`.NAME.vllm-warden.PID.RANDOM.tmp`), never through a symlink, and
    /// write `bytes` to it with `mode` and `owner` (when it differs from
    /// ours), synced. Returns its name. A file or folder left at an earlier
    /// name by a killed writer is in no one's way.
    pub(crate) fn write_temp(
        &self,
        target: &OsStr,
        bytes: &[u8],
        mode: u32,
        owner: Option<(u32, u32)>,
    ) -> io::Result<OsString> {
        let (file, name) = self.create_temp(target)?;
        let result = (|| {
            let mut f = file;
            f.write_all(bytes)?;
            set_owner_and_mode(&f, mode, owner)?;
            f.sync_all()
        })();
        match result {
            Ok(()) => Ok(name),
            Err(e) => {
                let _ = self.remove(&name);
                Err(e)
            }
        }
    }

    /// A symlink to `link_target` beside `target`, under a name as
    /// [`Dir::write_temp`] makes.
    pub(crate) fn symlink_temp(&self, target: &OsStr, link_target: &OsStr) -> io::Result<OsString> {
        loop {
            let name = temp_name(target);
            match rustix::fs::symlinkat(link_target, &self.fd, &name) {
                Ok(()) => return Ok(name),
                Err(rustix::io::Errno::EXIST) => continue,
                Err(e) => return Err(e.into()),
            }
        }
    }

    /// A new empty file beside `target`, named as [`Dir::write_temp`] names
    /// them, mode 0600, open for writing and reading back; the caller
    /// writes it and renames or removes it.
    pub(crate) fn create_temp(&self, target: &OsStr) -> io::Result<(File, OsString)> {
        let flags = OFlags::RDWR | OFlags::CREATE | OFlags::EXCL | OFlags::NOFOLLOW | OFlags::CLOEXEC;
        loop {
            let name = temp_name(target);
            match rustix::fs::openat(&self.fd, &name, flags, Mode::from_raw_mode(0o600)) {
                Ok(fd) => return Ok((File::from(fd), name)),
                Err(rustix::io::Errno::EXIST) => continue,
                Err(e) => return Err(e.into()),
            }
        }
    }

    /// Create `name` new with `bytes` (never replacing anything there),
    /// synced; `Ok(false)` when the name is taken.
    pub(crate) fn create_new(
        &self,
        name: &OsStr,
        bytes: &[u8],
        mode: u32,
        owner: Option<(u32, u32)>,
    ) -> io::Result<bool> {
        let flags = OFlags::WRONLY | OFlags::CREATE | OFlags::EXCL | OFlags::NOFOLLOW | OFlags::CLOEXEC;
        let mut f = match rustix::fs::openat(&self.fd, name, flags, Mode::from_raw_mode(0o600)) {
            Ok(fd) => File::from(fd),
            Err(rustix::io::Errno::EXIST) => return Ok(false),
            Err(e) => return Err(e.into()),
        };
        let result = (|| {
            f.write_all(bytes)?;
            set_owner_and_mode(&f, mode, owner)?;
            f.sync_all()
        })();
        if let Err(e) = result {
            let _ = self.remove(name);
            return Err(e);
        }
        Ok(true)
    }

    /// Write `name` whole by a temporary file and rename, synced, folder
    /// included.
    pub(crate) fn write_atomic(
        &self,
        name: &OsStr,
        bytes: &[u8],
        mode: u32,
        owner: Option<(u32, u32)>,
    ) -> io::Result<()> {
        let tmp = self.write_temp(name, bytes, mode, owner)?;
        if let Err(e) = self.rename(&tmp, name) {
            let _ = self.remove(&tmp);
            return Err(e);
        }
        self.sync()
    }

    /// Swap the entries `a` and `b` in one step (`RENAME_EXCHANGE`).
    /// `Ok(false)`: the filesystem cannot; nothing was done.
    pub(crate) fn exchange(&self, a: &OsStr, b: &OsStr) -> io::Result<bool> {
        match rustix::fs::renameat_with(&self.fd, a, &self.fd, b, RenameFlags::EXCHANGE) {
            Ok(()) => Ok(true),
            Err(rustix::io::Errno::INVAL | rustix::io::Errno::NOSYS | rustix::io::Errno::OPNOTSUPP) => Ok(false),
            Err(e) => Err(e.into()),
        }
    }

    pub(crate) fn rename(&self, from: &OsStr, to: &OsStr) -> io::Result<()> {
        Ok(rustix::fs::renameat(&self.fd, from, &self.fd, to)?)
    }

    /// Remove the name `name` (a file or a symlink, never a folder).
    pub(crate) fn remove(&self, name: &OsStr) -> io::Result<()> {
        Ok(rustix::fs::unlinkat(&self.fd, name, AtFlags::empty())?)
    }

    pub(crate) fn sync(&self) -> io::Result<()> {
        Ok(rustix::fs::fsync(&self.fd)?)
    }

    /// Whether the effective user may create and remove names here.
    pub(crate) fn writable(&self) -> io::Result<()> {
        let access = rustix::fs::Access::WRITE_OK | rustix::fs::Access::EXEC_OK;
        Ok(rustix::fs::accessat(&self.fd, ".", access, AtFlags::EACCESS)?)
    }

    /// Temporary files of [`Dir::write_temp`] beside `target` whose writer
    /// is gone (killed between its write and its rename): removed. A
    /// writer still alive keeps its own.
    pub(crate) fn remove_stale_temps(&self, target: &OsStr) {
        let Ok(list) = rustix::fs::Dir::read_from(&self.fd) else { return };
        let prefix = temp_prefix(target);
        for entry in list.flatten() {
            let name = OsStr::from_bytes(entry.file_name().to_bytes());
            let Some(rest) = name.as_bytes().strip_prefix(prefix.as_bytes()) else { continue };
            let Some(pid) = std::str::from_utf8(rest).ok().and_then(|r| r.split('.').next()?.parse::<i32>().ok())
            else {
                continue;
            };
            let gone = pid > 0
                && nix::sys::signal::kill(nix::unistd::Pid::from_raw(pid), None) == Err(nix::errno::Errno::ESRCH);
            if gone && self.lstat(name).ok().flatten().is_some_and(|m| !m.is_dir()) {
                let _ = self.remove(name);
            }
        }
    }
}

/// A file opened by [`Dir::open_beneath`].
#[derive(Debug)]
pub(crate) struct Beneath {
    pub(crate) file: File,
    pub(crate) meta: fs::Metadata,
    /// Where it really is, relative to the folder, and the links followed
    /// on the way (each link and its target): what the tests of a
    /// resolution look at.
    #[cfg_attr(not(test), allow(dead_code))]
    pub(crate) rel: PathBuf,
    #[cfg_attr(not(test), allow(dead_code))]
    pub(crate) links: Vec<(PathBuf, PathBuf)>,
}

/// Put the components of `p` before those still to resolve.
fn push_front(todo: &mut VecDeque<OsString>, p: &Path, at: &Path) -> Result<(), BeneathError> {
    let mut parts = Vec::new();
    for c in p.components() {
        match c {
            Component::Normal(n) => parts.push(n.to_os_string()),
            Component::ParentDir => parts.push(OsString::from("..")),
            Component::CurDir => {}
            Component::RootDir | Component::Prefix(_) => {
                return Err(BeneathError::Outside { path: p.to_path_buf(), root: at.to_path_buf() });
            }
        }
    }
    for part in parts.into_iter().rev() {
        todo.push_front(part);
    }
    Ok(())
}

/// Whether [`read_small`] follows a symlink at the last component of its
/// path: a config may be a link to a file kept elsewhere; a file of the
/// state folder is never reached through one.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Links {
    Follow,
    Refuse,
}

/// The whole of a small regular file that someone else may have made
/// anything: opened without blocking (a FIFO cannot hold the open, nor a
/// device its read) and never as a controlling terminal, refused unless it
/// is a regular file, refused when it is larger than `max` bytes, and read
/// for at most `max` + 1 bytes whatever its size says (a file that grows
/// while it is read is refused too). Every file a command reads whole goes
/// through here. The errors say what the file is, without its path (the
/// caller names it): `a FIFO (named pipe), not a regular file`,
/// `1073741824 bytes, over the limit of 1048576`; a file that is not there,
/// or that this user may not open, keeps its own error kind.
pub(crate) fn read_small(path: &Path, max: u64, links: Links) -> io::Result<Vec<u8>> {
    let mut flags = libc::O_NONBLOCK | libc::O_NOCTTY | libc::O_CLOEXEC;
    if links == Links::Refuse {
        flags |= libc::O_NOFOLLOW;
    }
    let file = match OpenOptions::new().read(true).custom_flags(flags).open(path) {
        Ok(f) => f,
        // A socket cannot be opened (ENXIO), a symlink refused (ELOOP):
        // say what it is.
        Err(e) if matches!(e.raw_os_error(), Some(libc::ENXIO | libc::ELOOP)) => {
            return Err(match fs::symlink_metadata(path) {
                Ok(m) if !m.is_file() => not_regular(&m),
                _ => e,
            });
        }
        Err(e) => return Err(e),
    };
    let meta = file.metadata()?;
    if !meta.is_file() {
        return Err(not_regular(&meta));
    }
    let too_large =
        |size: u64| io::Error::new(io::ErrorKind::InvalidData, format!("{size} bytes, over the limit of {max}"));
    if meta.len() > max {
        return Err(too_large(meta.len()));
    }
    read_capped(&file, max)?.map_err(too_large)
}

fn not_regular(m: &fs::Metadata) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidInput, format!("{}, not a regular file", kind_of(m)))
}

/// Read at most `max` bytes of `file`; `Err(size)` when there are more.
pub(crate) fn read_capped(file: &File, max: u64) -> io::Result<Result<Vec<u8>, u64>> {
    let mut buf = Vec::new();
    file.take(max.saturating_add(1)).read_to_end(&mut buf)?;
    if buf.len() as u64 > max {
        let size = file.metadata().map(|m| m.len()).unwrap_or(buf.len() as u64);
        return Ok(Err(size.max(buf.len() as u64)));
    }
    Ok(Ok(buf))
}

fn set_owner_and_mode(f: &File, mode: u32, owner: Option<(u32, u32)>) -> io::Result<()> {
    if let Some((uid, gid)) = owner
        && (uid, gid) != (nix::unistd::geteuid().as_raw(), nix::unistd::getegid().as_raw())
    {
        std::os::unix::fs::fchown(f, Some(uid), Some(gid))?;
    }
    // The umask may have narrowed the mode given at creation.
    f.set_permissions(fs::Permissions::from_mode(mode))
}

/// `.NAME.vllm-warden.`: what every temporary name beside NAME starts with.
fn temp_prefix(target: &OsStr) -> OsString {
    // Room for the pid, the random part and the suffix within NAME_MAX.
    let bytes = target.as_bytes();
    let short = &bytes[..bytes.len().min(200)];
    let mut p = OsString::from(".");
    p.push(OsStr::from_bytes(short));
    p.push(".vllm-warden.");
    p
}

/// A name beside `target` that no other writer uses: our pid and 64
/// random bits.
fn temp_name(target: &OsStr) -> OsString {
    let mut n = temp_prefix(target);
    n.push(format!("{}.{:016x}.tmp", std::process::id(), fastrand::u64(..)));
    n
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn temp_names_differ_and_a_folder_at_one_is_in_no_ones_way() {
        let d = tempfile::tempdir().unwrap();
        let dir = Dir::open(d.path()).unwrap();
        std::fs::create_dir(d.path().join(".config.json.vllm-warden.tmp")).unwrap();
        let a = dir.write_temp(OsStr::new("config.json"), b"a", 0o644, None).unwrap();
        let b = dir.write_temp(OsStr::new("config.json"), b"b", 0o644, None).unwrap();
        assert_ne!(a, b);
        assert!(a.to_string_lossy().starts_with(&format!(".config.json.vllm-warden.{}.", std::process::id())));
        assert_eq!(std::fs::read(d.path().join(&a)).unwrap(), b"a");
    }

    #[test]
    fn stale_temps_of_a_dead_writer_are_removed_and_a_live_ones_kept() {
        let d = tempfile::tempdir().unwrap();
        let dir = Dir::open(d.path()).unwrap();
        let mine = dir.write_temp(OsStr::new("c.json"), b"x", 0o644, None).unwrap();
        // pid_max is at most 2^22: this pid cannot be alive.
        let dead = ".c.json.vllm-warden.2147483646.0123456789abcdef.tmp";
        std::fs::write(d.path().join(dead), "old").unwrap();
        let other = ".d.json.vllm-warden.2147483646.0123456789abcdef.tmp";
        std::fs::write(d.path().join(other), "old").unwrap();
        dir.remove_stale_temps(OsStr::new("c.json"));
        assert!(!d.path().join(dead).exists());
        assert!(d.path().join(&mine).exists());
        assert!(d.path().join(other).exists(), "another target's temporary file is not ours to judge");
    }

    #[test]
    fn open_beneath_follows_links_inside_and_refuses_links_out() {
        let d = tempfile::tempdir().unwrap();
        let root = d.path().join("models--o--m");
        std::fs::create_dir_all(root.join("blobs")).unwrap();
        std::fs::create_dir_all(root.join("snapshots/r")).unwrap();
        std::fs::write(root.join("blobs/b"), "{}").unwrap();
        std::os::unix::fs::symlink("../../blobs/b", root.join("snapshots/r/ok.json")).unwrap();
        std::os::unix::fs::symlink(root.join("blobs/b"), root.join("snapshots/r/abs.json")).unwrap();
        std::os::unix::fs::symlink("../../../secret", root.join("snapshots/r/up.json")).unwrap();
        std::os::unix::fs::symlink("/etc/passwd", root.join("snapshots/r/etc.json")).unwrap();
        std::fs::write(d.path().join("secret"), "s").unwrap();
        let dir = Dir::open(&root).unwrap();
        let ok = dir.open_beneath(Path::new("snapshots/r/ok.json")).unwrap();
        assert_eq!(ok.rel, Path::new("blobs/b"));
        assert_eq!(ok.links.len(), 1);
        assert_eq!(dir.open_beneath(Path::new("snapshots/r/abs.json")).unwrap().rel, Path::new("blobs/b"));
        for bad in ["snapshots/r/up.json", "snapshots/r/etc.json"] {
            let e = dir.open_beneath(Path::new(bad)).unwrap_err();
            assert!(matches!(e, BeneathError::Escapes { .. }), "{bad}: {e}");
        }
        let e = dir.open_beneath(Path::new("../secret")).unwrap_err();
        assert!(matches!(e, BeneathError::Outside { .. }), "{e}");
    }

    #[test]
    fn a_small_file_is_read_whole_and_anything_else_refused_at_once() {
        let d = tempfile::tempdir().unwrap();
        let file = d.path().join("f");
        std::fs::write(&file, b"0123456789").unwrap();
        assert_eq!(read_small(&file, 10, Links::Refuse).unwrap(), b"0123456789");
        let e = read_small(&file, 9, Links::Refuse).unwrap_err();
        assert_eq!(e.to_string(), "10 bytes, over the limit of 9");
        let fifo = d.path().join("fifo");
        nix::unistd::mkfifo(&fifo, nix::sys::stat::Mode::from_bits_truncate(0o644)).unwrap();
        let e = read_small(&fifo, 1 << 20, Links::Follow).unwrap_err();
        assert_eq!(e.to_string(), "a FIFO (named pipe), not a regular file");
        let zero = d.path().join("zero");
        std::os::unix::fs::symlink("/dev/zero", &zero).unwrap();
        let e = read_small(&zero, 1 << 20, Links::Follow).unwrap_err();
        assert_eq!(e.to_string(), "a character device, not a regular file");
        let e = read_small(&zero, 1 << 20, Links::Refuse).unwrap_err();
        assert_eq!(e.to_string(), "a symlink, not a regular file");
        let link = d.path().join("link");
        std::os::unix::fs::symlink(&file, &link).unwrap();
        assert_eq!(read_small(&link, 10, Links::Follow).unwrap(), b"0123456789");
        let e = read_small(&d.path().join("none"), 10, Links::Follow).unwrap_err();
        assert_eq!(e.kind(), io::ErrorKind::NotFound);
    }

    #[test]
    fn a_fifo_is_refused_without_blocking() {
        let d = tempfile::tempdir().unwrap();
        nix::unistd::mkfifo(&d.path().join("f"), nix::sys::stat::Mode::from_bits_truncate(0o644)).unwrap();
        let dir = Dir::open(d.path()).unwrap();
        let e = dir.open_beneath(Path::new("f")).unwrap_err();
        assert!(e.to_string().ends_with("is a FIFO (named pipe), not a regular file"), "{e}");
    }
}
