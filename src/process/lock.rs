//! One warden per instance: an exclusive `flock` on `STATE_DIRECTORY/lock`,
//! taken before anything else and held until the warden exits. A second
//! warden on the same instance finds it held, names the pid that holds it
//! and touches nothing. The state directory belongs to the service user, so
//! the lock file is opened without following a symlink and must be a
//! regular file. A warden exec'd by an upgrading predecessor takes over the
//! lock's descriptor it inherited, found by the file it is open on.

use std::fs::File;
use std::io::{self, Read, Seek, Write};
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};

/// The held lock; released when dropped (or when the process ends).
#[derive(Debug)]
pub(crate) struct InstanceLock {
    _file: File,
}

#[derive(Debug, thiserror::Error)]
pub(crate) enum LockError {
    #[error("instance {instance:?} is already supervised by {holder} (lock {})", path.display())]
    Held { instance: String, holder: String, path: PathBuf },
    #[error("cannot take the lock {}: {source}", path.display())]
    Io { path: PathBuf, source: io::Error },
}

impl InstanceLock {
    pub(crate) fn take(state_dir: &Path, instance: &str) -> Result<InstanceLock, LockError> {
        let path = state_dir.join("lock");
        let io = |source| LockError::Io { path: path.clone(), source };
        std::fs::create_dir_all(state_dir).map_err(io)?;
        let mut file = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .mode(0o600)
            .custom_flags(libc::O_NOFOLLOW | libc::O_NONBLOCK | libc::O_CLOEXEC)
            .open(&path)
            .map_err(io)?;
        let meta = file.metadata().map_err(io)?;
        if !meta.is_file() {
            return Err(io(io::Error::new(io::ErrorKind::InvalidData, "not a regular file")));
        }
        // SAFETY: flock on a descriptor we own.
        if unsafe { libc::flock(std::os::fd::AsRawFd::as_raw_fd(&file), libc::LOCK_EX | libc::LOCK_NB) } != 0 {
            let e = io::Error::last_os_error();
            if e.raw_os_error() != Some(libc::EWOULDBLOCK) {
                return Err(io(e));
            }
            let mut text = String::new();
            let _ = (&file).take(64).read_to_string(&mut text);
            let holder = match text.trim().parse::<u32>() {
                Ok(pid) => format!("pid {pid}"),
                Err(_) => "another warden".into(),
            };
            return Err(LockError::Held { instance: instance.to_string(), holder, path });
        }
        file.set_len(0).map_err(io)?;
        file.rewind().map_err(io)?;
        writeln!(file, "{}", std::process::id()).map_err(io)?;
        Ok(InstanceLock { _file: file })
    }

    /// The lock an upgraded warden's predecessor held, open across the
    /// exec: found among this process's descriptors as the one open on this
    /// instance's lock file (same device and inode; the number the state
    /// file gives is not needed, so a state file that is missing, garbled or
    /// wrong cannot make this warden meet its own lock), and taken over if
    /// its `flock` is this descriptor's (an exclusive lock on the same open
    /// file is granted again). Any other descriptor on the lock file is
    /// closed. `None` when there is none, or when another process holds the
    /// lock.
    pub(crate) fn inherited(state_dir: &Path) -> Option<InstanceLock> {
        use std::os::fd::{AsRawFd, FromRawFd, RawFd};
        use std::os::unix::fs::MetadataExt;
        let path = std::fs::symlink_metadata(state_dir.join("lock")).ok().filter(|m| m.is_file())?;
        let mut open: Vec<RawFd> = std::fs::read_dir("/proc/self/fd")
            .ok()?
            .flatten()
            .filter_map(|e| e.file_name().to_str()?.parse().ok())
            .filter(|fd| {
                std::fs::metadata(format!("/proc/self/fd/{fd}"))
                    .is_ok_and(|m| (m.dev(), m.ino()) == (path.dev(), path.ino()))
            })
            .collect();
        open.sort_unstable();
        let mut found = None;
        for fd in open {
            // SAFETY: an open descriptor of this process on the lock file,
            // which nothing else of this process uses (the predecessor left
            // it for its successor): from now on this owns it.
            let file = unsafe { File::from_raw_fd(fd) };
            // SAFETY: flock on the descriptor just taken.
            let locked = unsafe { libc::flock(file.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) } == 0;
            if locked && found.is_none() {
                let _ = rustix::io::fcntl_setfd(&file, rustix::io::FdFlags::CLOEXEC);
                found = Some(InstanceLock { _file: file });
            }
            // Else dropped: closed.
        }
        found
    }

    /// The lock file's descriptor (kept open across an upgrade's exec).
    pub(crate) fn fd(&self) -> std::os::fd::BorrowedFd<'_> {
        std::os::fd::AsFd::as_fd(&self._file)
    }

    /// The pid of the warden that holds the lock of the instance in
    /// `state_dir`: `Ok(None)` when none does (the lock is free). The pid
    /// is the holder's own word; the caller checks it before signalling.
    pub(crate) fn holder(state_dir: &Path) -> io::Result<Option<u32>> {
        let path = state_dir.join("lock");
        let file = match std::fs::OpenOptions::new()
            .read(true)
            .custom_flags(libc::O_NOFOLLOW | libc::O_NONBLOCK | libc::O_CLOEXEC)
            .open(&path)
        {
            Ok(f) => f,
            Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(None),
            Err(e) => return Err(e),
        };
        // A shared lock that we get means no warden holds it.
        if unsafe { libc::flock(std::os::fd::AsRawFd::as_raw_fd(&file), libc::LOCK_SH | libc::LOCK_NB) } == 0 {
            return Ok(None);
        }
        let mut text = String::new();
        (&file).take(64).read_to_string(&mut text)?;
        let Ok(pid) = text.trim().parse::<u32>() else {
            return Err(io::Error::new(io::ErrorKind::InvalidData, "the lock file names no pid"));
        };
        // The file's word is checked against the kernel's table of locks.
        let (dev, ino) = {
            use std::os::unix::fs::MetadataExt;
            let m = file.metadata()?;
            (m.dev(), m.ino())
        };
        let table = std::fs::read_to_string("/proc/locks")?;
        if flock_held_by(&table, pid, (libc::major(dev), libc::minor(dev)), ino) || holds_open((dev, ino), pid) {
            Ok(Some(pid))
        } else {
            Err(io::Error::new(
                io::ErrorKind::InvalidData,
                format!("pid {pid}, named in the lock file, does not hold it"),
            ))
        }
    }
}

/// Whether process `pid` has the file `(dev, ino)` open with an `flock`
/// on that descriptor, from its own `/proc/PID/fd` and `fdinfo`. On an
/// overlay filesystem (a container's root) the kernel's table names the
/// file by the inode of the layer below, which `stat` does not give; the
/// descriptor's own `stat` gives the same file as ours. Reading another
/// process's descriptors needs its user or root: without them, no.
fn holds_open(file: (u64, u64), pid: u32) -> bool {
    use std::os::unix::fs::MetadataExt;
    let Ok(fds) = std::fs::read_dir(format!("/proc/{pid}/fd")) else { return false };
    fds.flatten().any(|fd| {
        let same = std::fs::metadata(fd.path()).is_ok_and(|m| (m.dev(), m.ino()) == file);
        same && std::fs::read_to_string(format!("/proc/{pid}/fdinfo/{}", fd.file_name().to_string_lossy())).is_ok_and(
            |info| info.lines().any(|l| l.starts_with("lock:") && l.contains(" FLOCK ") && l.contains(" WRITE ")),
        )
    })
}

/// Whether `/proc/locks` (`table`) shows an `flock` of process `pid` on the
/// file `dev` (major, minor), `ino`. A line: `1: FLOCK  ADVISORY  WRITE
/// 1234 08:01:5678 0 EOF`; a waiter's has `->` after the number (which the
/// procfs crate's `Lock` drops: read by hand).
fn flock_held_by(table: &str, pid: u32, dev: (u32, u32), ino: u64) -> bool {
    table.lines().any(|line| {
        let f: Vec<&str> = line.split_whitespace().collect();
        if f.get(1) != Some(&"FLOCK") {
            return false;
        }
        let mut id = f.get(5).map(|d| d.split(':')).into_iter().flatten();
        let (Some(major), Some(minor), Some(i)) = (id.next(), id.next(), id.next()) else { return false };
        f.get(4).and_then(|p| p.parse::<u32>().ok()) == Some(pid)
            && u32::from_str_radix(major, 16).ok() == Some(dev.0)
            && u32::from_str_radix(minor, 16).ok() == Some(dev.1)
            && i.parse::<u64>().ok() == Some(ino)
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The holder named in the lock file is believed only if the kernel's
    /// table of locks says it holds the lock; a forged pid is refused.
    #[test]
    fn the_holder_is_the_one_the_kernel_names() {
        let dir = tempfile::tempdir().unwrap();
        assert_eq!(InstanceLock::holder(dir.path()).unwrap(), None, "no lock file: no holder");
        let lock = InstanceLock::take(dir.path(), "t").unwrap();
        assert_eq!(InstanceLock::holder(dir.path()).unwrap(), Some(std::process::id()));
        // Someone with write access to the state directory names pid 1.
        std::fs::write(dir.path().join("lock"), "1\n").unwrap();
        let e = InstanceLock::holder(dir.path()).unwrap_err();
        assert_eq!(e.to_string(), "pid 1, named in the lock file, does not hold it");
        drop(lock);
        assert_eq!(InstanceLock::holder(dir.path()).unwrap(), None, "a free lock: no holder");
    }

    /// Where the kernel's table names another inode (an overlay
    /// filesystem), the holder's own descriptor is its proof.
    #[test]
    fn the_holder_is_found_by_its_descriptor_too() {
        use std::os::unix::fs::MetadataExt;
        let dir = tempfile::tempdir().unwrap();
        let lock = InstanceLock::take(dir.path(), "t").unwrap();
        let m = std::fs::metadata(dir.path().join("lock")).unwrap();
        assert!(holds_open((m.dev(), m.ino()), std::process::id()));
        assert!(!holds_open((m.dev(), m.ino() + 1), std::process::id()), "another file");
        drop(lock);
        assert!(!holds_open((m.dev(), m.ino()), std::process::id()), "released: no descriptor left");
    }

    #[test]
    fn lines_of_the_lock_table_are_read_exactly() {
        let table = "1: FLOCK  ADVISORY  WRITE 1234 08:01:5678 0 EOF\n\
                     1: -> FLOCK  ADVISORY  WRITE 99 08:01:5678 0 EOF\n\
                     2: POSIX  ADVISORY  WRITE 77 fd:00:42 0 EOF\n";
        assert!(flock_held_by(table, 1234, (8, 1), 5678));
        assert!(!flock_held_by(table, 99, (8, 1), 5678), "a waiter holds nothing");
        assert!(!flock_held_by(table, 77, (0xfd, 0), 42), "a POSIX lock is not the flock");
        assert!(!flock_held_by(table, 1234, (8, 2), 5678));
        assert!(!flock_held_by(table, 1234, (8, 1), 5679));
    }

    #[test]
    fn a_second_lock_names_the_first_holder() {
        let dir = tempfile::tempdir().unwrap();
        let first = InstanceLock::take(dir.path(), "t").unwrap();
        // flock locks belong to the open file description: a second open in
        // the same process conflicts as another process's would.
        let err = InstanceLock::take(dir.path(), "t").unwrap_err();
        assert_eq!(
            err.to_string(),
            format!(
                "instance \"t\" is already supervised by pid {} (lock {}/lock)",
                std::process::id(),
                dir.path().display()
            )
        );
        drop(first);
        assert!(InstanceLock::take(dir.path(), "t").is_ok());
    }

    /// An upgraded warden finds the lock its predecessor left open by the
    /// file it is open on, whatever number it has; it holds the instance.
    #[test]
    fn an_inherited_lock_is_found_by_its_file() {
        let dir = tempfile::tempdir().unwrap();
        assert!(InstanceLock::inherited(dir.path()).is_none(), "no lock file");
        let first = InstanceLock::take(dir.path(), "t").unwrap();
        // Left open across an exec: no longer owned by anything here.
        std::mem::forget(first);
        let inherited = InstanceLock::inherited(dir.path()).expect("found");
        assert!(matches!(InstanceLock::take(dir.path(), "t"), Err(LockError::Held { .. })), "still held");
        drop(inherited);
        assert!(InstanceLock::take(dir.path(), "t").is_ok(), "released with it");
    }

    #[test]
    fn a_symlink_as_the_lock_is_refused() {
        let dir = tempfile::tempdir().unwrap();
        let victim = dir.path().join("victim");
        std::fs::write(&victim, "keep").unwrap();
        std::os::unix::fs::symlink(&victim, dir.path().join("lock")).unwrap();
        assert!(InstanceLock::take(dir.path(), "t").is_err());
        assert_eq!(std::fs::read_to_string(&victim).unwrap(), "keep");
    }
}
