//! Running the warden as an unprivileged user from a test run as root.
//!
//! The binary cargo built lives under the checkout, which may sit in a folder
//! another user cannot enter (root's home is 0700 on Debian, and so is a
//! `mktemp -d` folder). A test that switches to another uid runs a copy of
//! the binary placed where that user can reach it, and keeps its own files
//! there too.

use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};

/// The unprivileged user the tests switch to.
pub const UID: u32 = 65534;

/// Whether every folder from `/` down to `dir` can be entered by any user.
pub fn reachable_by_all(dir: &Path) -> bool {
    dir.ancestors().all(|d| std::fs::metadata(d).is_ok_and(|m| m.permissions().mode() & 0o001 != 0))
}

/// A new temporary folder (mode 0755) that any user can reach: under the
/// usual temporary folder when every folder above it can be entered by all,
/// else under `/tmp`, else `/var/tmp`. `None` with the reason when none can.
pub fn tempdir() -> Result<tempfile::TempDir, String> {
    let bases = [std::env::temp_dir(), PathBuf::from("/tmp"), PathBuf::from("/var/tmp")];
    let Some(base) = bases.iter().find(|b| reachable_by_all(b)) else {
        return Err(format!("none of {bases:?} can be entered by every user"));
    };
    let dir = tempfile::tempdir_in(base).map_err(|e| format!("{}: {e}", base.display()))?;
    std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o755)).map_err(|e| e.to_string())?;
    Ok(dir)
}

/// A copy of `exe` in `dir` (which the user can reach), mode 0755.
pub fn copy_binary(exe: &str, dir: &Path) -> PathBuf {
    let to = dir.join(Path::new(exe).file_name().unwrap());
    std::fs::copy(exe, &to).unwrap();
    std::fs::set_permissions(&to, std::fs::Permissions::from_mode(0o755)).unwrap();
    to
}
