//! The front door's listeners, bound by the warden: each address of
//! `front.listen`, a TCP port or a unix socket, non-blocking and ready for
//! tokio. (Taking them from systemd, keeping them across an upgrade and in
//! the file-descriptor store is the listeners' own module's; this is the
//! plain binding the front door needs to serve.)

use crate::config::{Front, Listen};

/// A listening socket of the front door.
#[derive(Debug)]
pub enum Listener {
    Tcp(std::net::TcpListener),
    Unix(std::os::unix::net::UnixListener),
}

/// Why an address could not be listened on.
#[derive(Debug, thiserror::Error)]
#[error("cannot listen on {addr}: {source}")]
pub struct ListenError {
    pub addr: String,
    pub source: std::io::Error,
}

/// Bind every address of `front.listen`. A unix socket left at its path
/// (by an earlier warden of this instance, whose lock this one holds) is
/// replaced.
pub fn open(front: &Front) -> Result<Vec<(Listen, Listener)>, ListenError> {
    let mut out = Vec::new();
    for listen in &front.listen {
        let err = |source| ListenError { addr: listen.shown(), source };
        let l = match listen {
            Listen::Tcp(a) => {
                let l = std::net::TcpListener::bind(a).map_err(err)?;
                l.set_nonblocking(true).map_err(err)?;
                Listener::Tcp(l)
            }
            Listen::Unix(p) => {
                if std::fs::symlink_metadata(p).is_ok_and(|m| std::os::unix::fs::FileTypeExt::is_socket(&m.file_type()))
                {
                    let _ = std::fs::remove_file(p);
                }
                let l = std::os::unix::net::UnixListener::bind(p).map_err(err)?;
                l.set_nonblocking(true).map_err(err)?;
                Listener::Unix(l)
            }
        };
        out.push((listen.clone(), l));
    }
    Ok(out)
}
