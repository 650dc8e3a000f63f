//! The engine's private socket folder (`$RUNTIME_DIRECTORY/engine/`, under
//! `[front]`): before every start it is the warden's own, mode 0700, so
//! that only the warden (and the engine it starts, as the same user)
//! reaches the engine; a socket left there by the last run goes, since
//! vLLM binds its `--uds` path anew.

use std::ffi::OsStr;
use std::os::unix::fs::{FileTypeExt, MetadataExt, PermissionsExt};
use std::path::Path;

use crate::util::fsutil::Dir;

/// Why the engine's folder cannot be made ready.
#[derive(Debug, thiserror::Error)]
pub(crate) enum EngineFolderError {
    #[error("the engine's socket {0} has no folder")]
    NoFolder(String),
    #[error("the engine's socket folder {path}: {source}")]
    Io {
        path: String,
        #[source]
        source: std::io::Error,
    },
    #[error(
        "the engine's socket folder {path} is owned by uid {owner}, not by the warden's uid {uid}: \
         remove it, or give it to the warden's user"
    )]
    Owner { path: String, owner: u32, uid: u32 },
    #[error("{path} is {kind}, not the engine's socket: refused to remove it; remove it yourself")]
    NotASocket { path: String, kind: &'static str },
}

/// Make the folder of `socket` the warden's, mode 0700 (created so when
/// missing, never through a symlink), and remove a socket left at `socket`
/// (only a socket: anything else there is refused, not removed).
pub(crate) fn engine_folder(socket: &Path) -> Result<(), EngineFolderError> {
    let shown = |p: &Path| crate::util::escape::one_line(&p.display().to_string(), 512);
    let (Some(parent), Some(name), Some(file)) =
        (socket.parent().and_then(Path::parent), socket.parent().and_then(Path::file_name), socket.file_name())
    else {
        return Err(EngineFolderError::NoFolder(shown(socket)));
    };
    let folder = socket.parent().unwrap_or(socket);
    let io = |source| EngineFolderError::Io { path: shown(folder), source };
    // The runtime directory itself is trusted (systemd's, or the config's).
    std::fs::create_dir_all(parent).map_err(io)?;
    let dir = Dir::open(parent).map_err(io)?.child_dir(name, Some(0o700)).map_err(io)?;
    let meta = dir.metadata().map_err(io)?;
    let uid = nix::unistd::geteuid().as_raw();
    if meta.uid() != uid {
        return Err(EngineFolderError::Owner { path: shown(folder), owner: meta.uid(), uid });
    }
    if meta.mode() & 0o7777 != 0o700 {
        // Through the descriptor: the folder checked is the folder changed.
        let f = std::fs::File::from(dir.fd().try_clone_to_owned().map_err(io)?);
        f.set_permissions(std::fs::Permissions::from_mode(0o700)).map_err(io)?;
    }
    match dir.lstat(OsStr::new(file)).map_err(io)? {
        None => Ok(()),
        Some(m) if m.file_type().is_socket() => dir.remove(OsStr::new(file)).map_err(io),
        Some(m) => Err(EngineFolderError::NotASocket { path: shown(socket), kind: crate::util::fsutil::kind_of(&m) }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn mode(p: &Path) -> u32 {
        std::fs::symlink_metadata(p).unwrap().mode() & 0o7777
    }

    #[test]
    fn the_folder_is_made_0700_and_a_stale_socket_goes() {
        let t = tempfile::tempdir().unwrap();
        let socket = t.path().join("run/engine/engine.sock");
        engine_folder(&socket).unwrap();
        assert_eq!(mode(&t.path().join("run/engine")), 0o700);
        // A folder opened up by someone is closed again; the last run's
        // socket is removed.
        std::fs::set_permissions(t.path().join("run/engine"), std::fs::Permissions::from_mode(0o755)).unwrap();
        let _l = std::os::unix::net::UnixListener::bind(&socket).unwrap();
        engine_folder(&socket).unwrap();
        assert_eq!(mode(&t.path().join("run/engine")), 0o700);
        assert!(!socket.exists());
    }

    #[test]
    fn a_symlink_or_a_file_in_the_way_is_refused() {
        let t = tempfile::tempdir().unwrap();
        let elsewhere = t.path().join("elsewhere");
        std::fs::create_dir(&elsewhere).unwrap();
        std::fs::set_permissions(&elsewhere, std::fs::Permissions::from_mode(0o755)).unwrap();
        std::fs::create_dir(t.path().join("run")).unwrap();
        std::os::unix::fs::symlink(&elsewhere, t.path().join("run/engine")).unwrap();
        let e = engine_folder(&t.path().join("run/engine/engine.sock")).unwrap_err();
        assert!(e.to_string().contains("not a folder"), "{e}");
        assert_eq!(mode(&elsewhere), 0o755, "the folder a symlink points to is left alone");

        let socket = t.path().join("ok/engine/engine.sock");
        engine_folder(&socket).unwrap();
        std::fs::write(&socket, b"data").unwrap();
        let e = engine_folder(&socket).unwrap_err();
        assert!(e.to_string().contains("is a regular file, not the engine's socket"), "{e}");
        assert!(socket.exists(), "a file that is not a socket is left alone");
    }
}
