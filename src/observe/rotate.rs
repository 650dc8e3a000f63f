//! The child's log file rotated by the warden, which knows exactly what it
//! has read: when the file passes `child.log-max-size`, it is copied to
//! `NAME.1` (older copies shifted to `NAME.2`, … up to `child.log-keep`,
//! compressed with gzip beyond the first when `child.log-compress`), then
//! truncated in place. The child's `O_APPEND` writes go on at the new end.
//!
//! Where the filesystem can (ext4, XFS), the start of the file that has
//! been read and copied is cut out of it (`FALLOC_FL_COLLAPSE_RANGE`)
//! rather than truncated: the child's appends wait for the cut and go on,
//! the part not read yet stays, and nothing is lost, however fast the child
//! writes; a copy holds what had been read when the size was passed, cut at
//! a block boundary (a line may go on in the next file). Elsewhere (tmpfs,
//! btrfs, NFS) the file is truncated, only when the follower has read it to
//! the end, so no line is lost to classification; what the child writes in
//! the instant between the follower's last look at the size and the
//! truncation (two system calls apart) is lost from the files; see
//! [`Rotator::truncate`]. The follower's thread drives this; the
//! compression runs on a thread of its own.

use crate::config::Rotation;
use std::ffi::{OsStr, OsString};
use std::fs::File;
use std::io::{self, Read, Write};
use std::os::fd::AsRawFd;
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::{FileExt, MetadataExt};
use std::path::Path;
use std::sync::{Arc, Mutex};

use crate::util::fsutil::Dir;

/// Rotates one log file: the follower's thread holds it.
pub struct Rotator {
    pub settings: Rotation,
    dir: Dir,
    /// The log file's name in `dir`.
    name: OsString,
    /// A writable descriptor of the inode the child writes to, for the
    /// truncation; the path may name another file by now.
    writer: File,
    /// Held while names are shifted, and while the compressor renames its
    /// result: neither sees the other's half-done work.
    names: Arc<Mutex<()>>,
    compressor: Option<std::thread::JoinHandle<()>>,
    /// False once the filesystem refused [`Rotator::collapse`].
    can_collapse: bool,
    /// Taken for each rotation (see [`Hold`]).
    hold: Option<Hold>,
}

/// Held by whoever reads the log's bytes by offset (a failure report): no
/// rotation moves them meanwhile. A rotation takes it for its whole run, on
/// the follower's thread.
pub type Hold = Arc<tokio::sync::Mutex<()>>;

impl std::fmt::Debug for Rotator {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Rotator").field("settings", &self.settings).field("name", &self.name).finish_non_exhaustive()
    }
}

impl Rotator {
    /// For the log file `path`, opened by the warden as `log`.
    pub fn new(path: &Path, log: &File, settings: Rotation) -> io::Result<Rotator> {
        let name = path
            .file_name()
            .ok_or_else(|| io::Error::new(io::ErrorKind::InvalidInput, "the log file has no name"))?
            .to_os_string();
        let folder = path.parent().filter(|p| !p.as_os_str().is_empty()).unwrap_or(Path::new("."));
        let dir = Dir::open(folder)?;
        // A second open file of the same inode, writable, whatever its path.
        let writer = std::fs::OpenOptions::new().write(true).open(format!("/proc/self/fd/{}", log.as_raw_fd()))?;
        Ok(Rotator {
            settings,
            dir,
            name,
            writer,
            names: Arc::default(),
            compressor: None,
            can_collapse: true,
            hold: None,
        })
    }

    /// Rotate only while `hold` is free.
    pub fn with_hold(self, hold: Hold) -> Rotator {
        Rotator { hold: Some(hold), ..self }
    }

    /// The hold, to be taken for a rotation.
    pub fn hold(&self) -> Option<Hold> {
        self.hold.clone()
    }

    /// The name of copy `k` (`NAME.k`, `NAME.k.gz`).
    fn copy_name(&self, k: u32, gz: bool) -> OsString {
        copy_name(&self.name, k, gz)
    }

    /// A new temporary copy beside `NAME.1`; `None` when no copy is kept.
    pub fn begin(&self) -> io::Result<Option<(File, OsString)>> {
        if self.settings.keep == 0 {
            return Ok(None);
        }
        self.dir.create_temp(&self.copy_name(1, false)).map(Some)
    }

    /// Copy bytes `from..to` of the log to the end of `copy`.
    pub fn copy(&self, source: &File, copy: &mut File, from: u64, to: u64) -> io::Result<()> {
        copy_range(source, copy, from, to)
    }

    /// Remove the first `upto` bytes of the log, already read and copied,
    /// shifting the rest down (`FALLOC_FL_COLLAPSE_RANGE`): the child's
    /// appends wait for it and go on at the new end, and nothing is lost.
    /// `upto` is cut down to the filesystem's block size, as the call
    /// requires, and must leave at least one block. Returns the bytes
    /// removed; `Ok(None)` when this filesystem cannot (tmpfs, btrfs, NFS)
    /// or the file is too short: the caller truncates instead.
    pub fn collapse(&mut self, upto: u64) -> io::Result<Option<u64>> {
        if !self.can_collapse {
            return Ok(None);
        }
        let meta = self.writer.metadata()?;
        let block = meta.blksize().max(1);
        let n = upto / block * block;
        if n == 0 || n >= meta.len() {
            return Ok(None);
        }
        let flags = rustix::fs::FallocateFlags::COLLAPSE_RANGE;
        match rustix::fs::fallocate(&self.writer, flags, 0, n) {
            Ok(()) => Ok(Some(n)),
            Err(rustix::io::Errno::OPNOTSUPP | rustix::io::Errno::NOSYS) => {
                self.can_collapse = false;
                Ok(None)
            }
            // The size moved under a racing reader of the size, or a
            // filesystem that wants other alignment: truncate this time.
            Err(rustix::io::Errno::INVAL) => Ok(None),
            Err(e) => Err(e.into()),
        }
    }

    /// Truncate the log to nothing, if it holds no more than `read` bytes
    /// (everything read); false when more has been written since: the
    /// caller reads it first. The window in which the child's bytes are
    /// lost is between the `fstat` and the `ftruncate` here.
    pub fn truncate(&self, read: u64) -> io::Result<bool> {
        if self.writer.metadata()?.len() > read {
            return Ok(false);
        }
        self.writer.set_len(0)?;
        Ok(true)
    }

    /// Put the finished copy in place as `NAME.1`, shifting the older ones
    /// (the oldest beyond `keep` removed), and start compressing those
    /// beyond the first when asked.
    pub fn finish(&mut self, copy: Option<(File, OsString)>) -> io::Result<()> {
        let Some((file, tmp)) = copy else { return Ok(()) };
        drop(file);
        {
            let _names = self.names.lock().unwrap_or_else(|p| p.into_inner());
            let keep = self.settings.keep;
            for gz in [false, true] {
                let _ = self.remove_copy(keep, gz);
            }
            for k in (1..keep).rev() {
                for gz in [false, true] {
                    match self.dir.rename(&self.copy_name(k, gz), &self.copy_name(k + 1, gz)) {
                        Err(e) if e.kind() != io::ErrorKind::NotFound => {
                            tracing::warn!(error = %e, "cannot shift {}", self.copy_name(k, gz).to_string_lossy());
                        }
                        _ => {}
                    }
                }
            }
            if let Err(e) = self.dir.rename(&tmp, &self.copy_name(1, false)) {
                let _ = self.dir.remove(&tmp);
                return Err(e);
            }
        }
        if self.settings.compress && self.settings.keep >= 2 {
            self.compress_later();
        }
        Ok(())
    }

    /// Throw away an unfinished copy.
    pub fn discard(&self, tmp: &OsStr) {
        let _ = self.dir.remove(tmp);
    }

    /// Remove copy `k` if it is a file or a symlink (never a folder).
    fn remove_copy(&self, k: u32, gz: bool) -> io::Result<()> {
        let name = self.copy_name(k, gz);
        match self.dir.lstat(&name)? {
            Some(m) if !m.is_dir() => self.dir.remove(&name),
            _ => Ok(()),
        }
    }

    /// Compress every plain copy beyond the first, on a thread of its own
    /// (one at a time; a rotation never waits for it).
    fn compress_later(&mut self) {
        if self.compressor.as_ref().is_some_and(|h| !h.is_finished()) {
            // The running one looks again for work before it ends.
            return;
        }
        let (Ok(dir), names, name, keep) =
            (self.dir.try_clone(), self.names.clone(), self.name.clone(), self.settings.keep)
        else {
            return;
        };
        let spawned = std::thread::Builder::new()
            .name("log compressor".into())
            .spawn(move || compress_all(&dir, &names, &name, keep));
        match spawned {
            Ok(h) => self.compressor = Some(h),
            Err(e) => tracing::warn!(error = %e, "cannot start the log compressor"),
        }
    }

    /// Wait for the compressor (tests, and the end of a follower).
    pub fn wait_compressed(&mut self) {
        if let Some(h) = self.compressor.take() {
            let _ = h.join();
        }
    }
}

fn copy_name(name: &OsStr, k: u32, gz: bool) -> OsString {
    let mut n = name.to_os_string();
    n.push(format!(".{k}{}", if gz { ".gz" } else { "" }));
    n
}

/// Bytes `from..to` of `source` appended to `out`: in the kernel where the
/// filesystem can (`copy_file_range`), else through a buffer.
fn copy_range(source: &File, out: &mut File, mut from: u64, to: u64) -> io::Result<()> {
    while from < to {
        let len = usize::try_from(to - from).unwrap_or(usize::MAX).min(1 << 30);
        let mut off = from;
        match rustix::fs::copy_file_range(source, Some(&mut off), &*out, None, len) {
            Ok(0) => return Ok(()),
            Ok(n) => from += n as u64,
            Err(rustix::io::Errno::INTR) => {}
            Err(_) => return copy_by_buffer(source, out, from, to),
        }
    }
    Ok(())
}

fn copy_by_buffer(source: &File, out: &mut File, mut from: u64, to: u64) -> io::Result<()> {
    let mut buf = vec![0u8; 1 << 16];
    while from < to {
        let want = usize::try_from(to - from).unwrap_or(usize::MAX).min(buf.len());
        let n = source.read_at(&mut buf[..want], from)?;
        if n == 0 {
            return Ok(());
        }
        out.write_all(&buf[..n])?;
        from += n as u64;
    }
    Ok(())
}

/// Compress each plain copy `NAME.k` (k ≥ 2) to `NAME.k.gz`, until none is
/// left. A copy is followed by its inode: if a rotation shifted it while it
/// was being compressed, the result takes its new number; if it was removed,
/// the result is thrown away.
fn compress_all(dir: &Dir, names: &Mutex<()>, name: &OsStr, keep: u32) {
    // Each pass compresses at least one copy or ends; a bounded number of
    // passes whatever rotations happen meanwhile.
    for _ in 0..keep.saturating_mul(4).max(4) {
        let found = (2..=keep).find_map(|k| {
            let plain = copy_name(name, k, false);
            let m = dir.lstat(&plain).ok().flatten()?;
            m.is_file().then_some(plain)
        });
        let Some(plain) = found else { return };
        if let Err(e) = compress_one(dir, names, name, keep, &plain) {
            tracing::warn!(error = %e, "cannot compress {}", plain.to_string_lossy());
            return;
        }
    }
}

fn compress_one(dir: &Dir, names: &Mutex<()>, name: &OsStr, keep: u32, plain: &OsStr) -> io::Result<()> {
    let (mut source, meta) = dir.open_regular(plain, true).map_err(|e| io::Error::other(e.to_string()))?;
    let inode = (meta.dev(), meta.ino());
    let (tmp_file, tmp) = dir.create_temp(&append(plain, ".gz"))?;
    let written = (|| {
        let mut gz = flate2::write::GzEncoder::new(io::BufWriter::new(tmp_file), flate2::Compression::default());
        let mut buf = vec![0u8; 1 << 16];
        loop {
            let n = source.read(&mut buf)?;
            if n == 0 {
                break;
            }
            gz.write_all(&buf[..n])?;
        }
        gz.finish()?.flush()
    })();
    let _names = names.lock().unwrap_or_else(|p| p.into_inner());
    if let Err(e) = written {
        let _ = dir.remove(&tmp);
        return Err(e);
    }
    // Where the copy is now.
    let now = (2..=keep)
        .map(|k| copy_name(name, k, false))
        .find(|n| dir.lstat(n).ok().flatten().is_some_and(|m| m.is_file() && (m.dev(), m.ino()) == inode));
    match now {
        Some(n) => {
            dir.rename(&tmp, &append(&n, ".gz"))?;
            dir.remove(&n)
        }
        None => dir.remove(&tmp),
    }
}

fn append(name: &OsStr, suffix: &str) -> OsString {
    let mut n = OsString::from(OsStr::from_bytes(name.as_bytes()));
    n.push(suffix);
    n
}

#[cfg(test)]
mod tests {
    use super::*;

    fn settings(keep: u32, compress: bool) -> Rotation {
        Rotation { max_size: 1 << 20, keep, compress }
    }

    fn names(dir: &Path) -> Vec<String> {
        let mut v: Vec<String> =
            std::fs::read_dir(dir).unwrap().map(|e| e.unwrap().file_name().to_string_lossy().into_owned()).collect();
        v.sort();
        v
    }

    /// Three rotations with `keep = 2`: the newest copy plain, the one
    /// before compressed, the oldest gone; each holds what the log held.
    #[test]
    fn copies_shift_compress_and_expire() {
        let d = tempfile::tempdir().unwrap();
        let path = d.path().join("m.log");
        let log = std::fs::OpenOptions::new().create(true).append(true).open(&path).unwrap();
        let mut r = Rotator::new(&path, &log, settings(2, true)).unwrap();
        for round in 1..=3 {
            let text = format!("round {round}\n");
            (&log).write_all(text.as_bytes()).unwrap();
            let mut copy = r.begin().unwrap();
            let (file, _) = copy.as_mut().unwrap();
            r.copy(&File::open(&path).unwrap(), file, 0, text.len() as u64).unwrap();
            assert!(r.truncate(text.len() as u64).unwrap());
            r.finish(copy).unwrap();
            r.wait_compressed();
        }
        assert_eq!(names(d.path()), ["m.log", "m.log.1", "m.log.2.gz"]);
        assert_eq!(std::fs::read_to_string(d.path().join("m.log.1")).unwrap(), "round 3\n");
        let mut unzipped = String::new();
        flate2::read::GzDecoder::new(File::open(d.path().join("m.log.2.gz")).unwrap())
            .read_to_string(&mut unzipped)
            .unwrap();
        assert_eq!(unzipped, "round 2\n");
        assert_eq!(std::fs::metadata(&path).unwrap().len(), 0);
    }

    /// A file written past what was read is not truncated: the follower
    /// reads it first.
    #[test]
    fn unread_bytes_hold_the_truncation_back() {
        let d = tempfile::tempdir().unwrap();
        let path = d.path().join("m.log");
        let log = std::fs::OpenOptions::new().create(true).append(true).open(&path).unwrap();
        let r = Rotator::new(&path, &log, settings(1, false)).unwrap();
        (&log).write_all(b"read\nnot read\n").unwrap();
        assert!(!r.truncate(5).unwrap());
        assert_eq!(std::fs::metadata(&path).unwrap().len(), 14);
    }

    /// A symlink planted where a copy goes is moved or removed as a name,
    /// never followed: the file it points to is untouched.
    #[test]
    fn a_planted_symlink_is_never_followed() {
        let d = tempfile::tempdir().unwrap();
        let path = d.path().join("m.log");
        let victim = d.path().join("victim");
        std::fs::write(&victim, "precious").unwrap();
        std::os::unix::fs::symlink(&victim, d.path().join("m.log.1")).unwrap();
        std::os::unix::fs::symlink(&victim, d.path().join("m.log.2")).unwrap();
        let log = std::fs::OpenOptions::new().create(true).append(true).open(&path).unwrap();
        let mut r = Rotator::new(&path, &log, settings(2, true)).unwrap();
        (&log).write_all(b"x\n").unwrap();
        let mut copy = r.begin().unwrap();
        r.copy(&File::open(&path).unwrap(), &mut copy.as_mut().unwrap().0, 0, 2).unwrap();
        r.truncate(2).unwrap();
        r.finish(copy).unwrap();
        r.wait_compressed();
        assert_eq!(std::fs::read_to_string(&victim).unwrap(), "precious");
        assert_eq!(std::fs::read_to_string(d.path().join("m.log.1")).unwrap(), "x\n");
        // The shifted link is a link still, not compressed through.
        assert!(std::fs::symlink_metadata(d.path().join("m.log.2")).unwrap().file_type().is_symlink());
    }
}
