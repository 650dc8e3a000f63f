//! The child's log file rotated by the warden, which knows exactly what it
//! has read and is the file's only writer (`observe::logpipe`): when the
//! file passes `child.log-max-size`, what has been read is copied to
//! `NAME.1` (older copies shifted to `NAME.2`, … up to `child.log-keep`,
//! compressed with gzip beyond the first when `child.log-compress`), then
//! the file is cut in place.
//!
//! The copy ends after the last whole line the follower has read; then,
//! holding the log writer ([`crate::observe::logpipe::Sink::lock`]), so that
//! the file stands still, the warden empties it and writes back what
//! followed the copied part: the start of a line not yet ended and what the
//! follower has not read yet. No line is lost and none is torn in two, on
//! any filesystem, however fast the child writes (meanwhile its output
//! waits in the pipe). What is written back is kept small: once the file
//! has reached its size the writer waits for the rotation
//! (`observe::logpipe`), and a rotation waits while the follower is more
//! than 1 MiB behind (`observe::logwatch`); more than 1 MiB goes through a
//! temporary file. Emptying in place rather than
//! renaming keeps the inode that the follower, the failure reports (which
//! read by offset, under [`Hold`]) and an upgrade's hand-off know the file
//! by. The follower's thread drives this; the compression runs on a thread
//! of its own.

use crate::config::Rotation;
use std::ffi::{OsStr, OsString};
use std::fs::File;
use std::io::{self, Read, Write};
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::{FileExt, MetadataExt};
use std::path::Path;
use std::sync::{Arc, Mutex};

use crate::observe::logpipe::{Log, Sink};
use crate::util::fsutil::Dir;

/// Rotates one log file: the follower's thread holds it.
pub struct Rotator {
    pub(crate) settings: Rotation,
    dir: Dir,
    /// The log file's name in `dir`.
    name: OsString,
    /// The log's writer, held for a rotation's last step.
    sink: Arc<Sink>,
    /// Held while names are shifted, and while the compressor renames its
    /// result: neither sees the other's half-done work.
    names: Arc<Mutex<()>>,
    compressor: Option<std::thread::JoinHandle<()>>,
    /// Taken for each rotation (see [`Hold`]).
    hold: Option<Hold>,
}

/// Held by whoever reads the log's bytes by offset (a failure report): no
/// rotation moves them meanwhile. A rotation takes it for its whole run, on
/// the follower's thread.
pub(crate) type Hold = Arc<tokio::sync::Mutex<()>>;

impl std::fmt::Debug for Rotator {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Rotator").field("settings", &self.settings).field("name", &self.name).finish_non_exhaustive()
    }
}

impl Rotator {
    /// For the log file that `sink` writes.
    pub(crate) fn new(sink: Arc<Sink>, settings: Rotation) -> io::Result<Rotator> {
        let path = sink.path();
        let name = path
            .file_name()
            .ok_or_else(|| io::Error::new(io::ErrorKind::InvalidInput, "the log file has no name"))?
            .to_os_string();
        let folder = path.parent().filter(|p| !p.as_os_str().is_empty()).unwrap_or(Path::new("."));
        let dir = Dir::open(folder)?;
        Ok(Rotator { settings, dir, name, sink, names: Arc::default(), compressor: None, hold: None })
    }

    /// Rotate only while `hold` is free.
    pub(crate) fn with_hold(self, hold: Hold) -> Rotator {
        Rotator { hold: Some(hold), ..self }
    }

    /// The hold, to be taken for a rotation.
    pub(crate) fn hold(&self) -> Option<Hold> {
        self.hold.clone()
    }

    /// The log's writer.
    pub(crate) fn sink(&self) -> &Arc<Sink> {
        &self.sink
    }

    /// The name of copy `k` (`NAME.k`, `NAME.k.gz`).
    fn copy_name(&self, k: u32, gz: bool) -> OsString {
        copy_name(&self.name, k, gz)
    }

    /// A new temporary copy beside `NAME.1`; `None` when no copy is kept.
    pub(crate) fn begin(&self) -> io::Result<Option<(File, OsString)>> {
        if self.settings.keep == 0 {
            return Ok(None);
        }
        self.dir.create_temp(&self.copy_name(1, false)).map(Some)
    }

    /// Copy bytes `from..to` of the log to the end of `copy`.
    pub(crate) fn copy(&self, source: &File, copy: &mut File, from: u64, to: u64) -> io::Result<()> {
        copy_range(source, copy, from, to)
    }

    /// Cut the first `at` bytes (copied) out of the log, its writer held
    /// as `log` (the file stands still): the rest is kept aside, the file
    /// emptied and the rest written back at its start. Up to 1 MiB is kept
    /// in memory; more (a follower far behind a flooding child) in a
    /// temporary file beside the log, removed after.
    pub(crate) fn cut(&self, log: &mut Log, source: &File, at: u64) -> io::Result<()> {
        const IN_MEMORY: u64 = 1 << 20;
        let end = log.len();
        let rest_len = end.saturating_sub(at);
        if rest_len <= IN_MEMORY {
            let mut rest = vec![0; usize::try_from(rest_len).unwrap_or(0)];
            source.read_exact_at(&mut rest, at)?;
            return log.cut(at, |f| f.write_all(&rest));
        }
        let (mut tmp, name) = self.dir.create_temp(&append(&self.name, ".rest"))?;
        let _ = self.dir.remove(&name);
        copy_range(source, &mut tmp, at, end)?;
        log.cut(at, |f| copy_range(&tmp, f, 0, rest_len))
    }

    /// Put the finished copy in place as `NAME.1`, shifting the older ones
    /// (the oldest beyond `keep` removed), and start compressing those
    /// beyond the first when asked.
    pub(crate) fn finish(&mut self, copy: Option<(File, OsString)>) -> io::Result<()> {
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
    pub(crate) fn discard(&self, tmp: &OsStr) {
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

    /// Wait for the compressor.
    #[cfg(test)]
    pub(crate) fn wait_compressed(&mut self) {
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

    /// A rotator of `path`, and the write end of the pipe its writer reads.
    fn rotator(path: &Path, settings: Rotation) -> (Rotator, File) {
        let log = std::fs::OpenOptions::new().create(true).append(true).open(path).unwrap();
        let (read, write) = crate::observe::logpipe::pipe().unwrap();
        let sink = Sink::new(read, log, path).unwrap();
        (Rotator::new(sink, settings).unwrap(), File::from(write))
    }

    /// One rotation of everything in the file.
    fn rotate_all(r: &mut Rotator, path: &Path) {
        let mut copy = r.begin().unwrap();
        let sink = r.sink().clone();
        let mut log = sink.lock();
        if let Some((file, _)) = copy.as_mut() {
            r.copy(&File::open(path).unwrap(), file, 0, log.len()).unwrap();
        }
        let len = log.len();
        r.cut(&mut log, &File::open(path).unwrap(), len).unwrap();
        drop(log);
        r.finish(copy).unwrap();
        r.wait_compressed();
    }

    /// Three rotations with `keep = 2`: the newest copy plain, the one
    /// before compressed, the oldest gone; each holds what the log held.
    #[test]
    fn copies_shift_compress_and_expire() {
        let d = tempfile::tempdir().unwrap();
        let path = d.path().join("m.log");
        let (mut r, mut child) = rotator(&path, settings(2, true));
        for round in 1..=3 {
            child.write_all(format!("round {round}\n").as_bytes()).unwrap();
            r.sink().flush();
            rotate_all(&mut r, &path);
        }
        assert_eq!(names(d.path()), ["m.log", "m.log.1", "m.log.2.gz"]);
        assert_eq!(std::fs::read_to_string(d.path().join("m.log.1")).unwrap(), "round 3\n");
        let mut unzipped = String::new();
        flate2::read::GzDecoder::new(File::open(d.path().join("m.log.2.gz")).unwrap())
            .read_to_string(&mut unzipped)
            .unwrap();
        assert_eq!(unzipped, "round 2\n");
        assert_eq!(std::fs::metadata(&path).unwrap().len(), 0);
        // The writer goes on at the new start.
        child.write_all(b"after\n").unwrap();
        r.sink().flush();
        assert_eq!(std::fs::read_to_string(&path).unwrap(), "after\n");
    }

    /// A cut whose rest is more than is kept in memory (the child wrote on
    /// while the copy was made): the rest goes through a temporary file and
    /// is the file's new start, every byte of it. (It was lost: the
    /// temporary file, open for writing only, could not be read back.)
    #[test]
    fn a_rest_larger_than_memory_is_written_back_whole() {
        let d = tempfile::tempdir().unwrap();
        let path = d.path().join("m.log");
        let (mut r, mut child) = rotator(&path, settings(3, false));
        let line = |i: u32| format!("line {i:08} of the child, long enough to fill some MiB in a moment\n");
        let text: String = (0..60_000).map(line).collect();
        // More than the pipe holds: written from a thread of its own.
        let writing = std::thread::spawn(move || child.write_all(text.as_bytes()).map(|()| child));
        let sink = r.sink().clone();
        while !writing.is_finished() {
            sink.flush();
        }
        let _child = writing.join().unwrap().unwrap();
        sink.flush();
        let all = std::fs::read(&path).unwrap();
        assert_eq!(all.len(), 60_000 * line(0).len());
        // Cut after the first MiB's last line: more than 1 MiB is left.
        let at = all[..1 << 20].iter().rposition(|b| *b == b'\n').unwrap() as u64 + 1;
        let mut copy = r.begin().unwrap();
        r.copy(&File::open(&path).unwrap(), &mut copy.as_mut().unwrap().0, 0, at).unwrap();
        let mut log = sink.lock();
        r.cut(&mut log, &File::open(&path).unwrap(), at).unwrap();
        assert_eq!(log.len(), all.len() as u64 - at);
        drop(log);
        r.finish(copy).unwrap();
        assert_eq!(std::fs::read(d.path().join("m.log.1")).unwrap(), &all[..at as usize]);
        let rest = std::fs::read(&path).unwrap();
        assert!(
            rest == all[at as usize..],
            "the file holds {} of the rest's {} bytes",
            rest.len(),
            all.len() as u64 - at
        );
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
        let (mut r, mut child) = rotator(&path, settings(2, true));
        child.write_all(b"x\n").unwrap();
        r.sink().flush();
        rotate_all(&mut r, &path);
        assert_eq!(std::fs::read_to_string(&victim).unwrap(), "precious");
        assert_eq!(std::fs::read_to_string(d.path().join("m.log.1")).unwrap(), "x\n");
        // The shifted link is a link still, not compressed through.
        assert!(std::fs::symlink_metadata(d.path().join("m.log.2")).unwrap().file_type().is_symlink());
    }
}
