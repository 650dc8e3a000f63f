//! Writing files whole or not at all: a temporary file beside the target,
//! fsync, rename, fsync of the folder. Used for model files, the patch
//! manifest, the status document and the metrics file.

use std::fs::{self, File, OpenOptions};
use std::io::{self, Write};
use std::os::unix::fs::{OpenOptionsExt, PermissionsExt};
use std::path::{Path, PathBuf};

/// Write `bytes` to `path` atomically: a temporary file in the same folder,
/// fsync, rename over `path` (a symlink at `path` is replaced, never
/// followed), fsync of the folder. Never leaves a half-written file, even
/// across a power loss.
pub fn write_atomic(path: &Path, bytes: &[u8], mode: u32, owner: Option<(u32, u32)>) -> io::Result<()> {
    let tmp = write_temp(path, bytes, mode, owner)?;
    rename_into_place(&tmp, path).inspect_err(|_| {
        let _ = fs::remove_file(&tmp);
    })
}

/// Replace `path` whole by rename, without fsync: a reader never sees a
/// half-written file, but a power loss may lose the last write. For files
/// that describe the running process (status, metrics), rewritten often and
/// meaningless after a reboot.
pub fn replace(path: &Path, bytes: &[u8], mode: u32) -> io::Result<()> {
    let tmp = temp_name(path);
    let _ = fs::remove_file(&tmp);
    let result = (|| {
        let mut f = OpenOptions::new().write(true).create_new(true).mode(mode).open(&tmp)?;
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

/// The temporary file beside `path`, written and synced, with mode and owner.
pub fn write_temp(path: &Path, bytes: &[u8], mode: u32, owner: Option<(u32, u32)>) -> io::Result<PathBuf> {
    let tmp = temp_name(path);
    // Left by a writer killed before its rename: never the target itself.
    let _ = fs::remove_file(&tmp);
    let result = (|| {
        let mut f = OpenOptions::new().write(true).create_new(true).mode(0o600).open(&tmp)?;
        f.write_all(bytes)?;
        if let Some((uid, gid)) = owner
            && (uid, gid) != (nix::unistd::geteuid().as_raw(), nix::unistd::getegid().as_raw())
        {
            std::os::unix::fs::fchown(&f, Some(uid), Some(gid))?;
        }
        f.set_permissions(fs::Permissions::from_mode(mode))?;
        f.sync_all()
    })();
    match result {
        Ok(()) => Ok(tmp),
        Err(e) => {
            let _ = fs::remove_file(&tmp);
            Err(e)
        }
    }
}

pub fn rename_into_place(tmp: &Path, path: &Path) -> io::Result<()> {
    fs::rename(tmp, path)?;
    sync_dir(path)
}

/// One fixed name per target: a temporary file left by a killed writer is
/// found and replaced by the next one.
pub fn temp_name(path: &Path) -> PathBuf {
    let name = path.file_name().and_then(|n| n.to_str()).unwrap_or("file");
    path.with_file_name(format!(".{name}.vllm-warden.tmp"))
}

pub fn sync_dir(path: &Path) -> io::Result<()> {
    let dir = path.parent().filter(|d| !d.as_os_str().is_empty()).unwrap_or(Path::new("."));
    File::open(dir)?.sync_all()
}
