//! The front door's listening sockets (`front.listen`): the model's
//! address, opened once and never closed while the instance runs.
//!
//! Where a socket comes from, in this order of preference, for each address:
//! - systemd socket activation: a `.socket` unit's socket passed in
//!   `LISTEN_FDS` (its name in `LISTEN_FDNAMES` is not `front-…`). Every one
//!   must be an address the config names: a socket clients reach that no
//!   warden would answer is refused at start.
//! - the predecessor of an upgrade in place: its sockets, kept open across
//!   the exec and named with their addresses in the hand-off.
//! - systemd's file-descriptor store: the sockets an earlier warden of the
//!   service stored (`FDSTORE=1`, `FDNAME=front-N`), passed back in
//!   `LISTEN_FDS` when systemd starts the service again. One that matches no
//!   configured address (the config changed) is closed and taken out of
//!   the store (`FDSTOREREMOVE=1`), never kept forever.
//! - bound here: TCP with `SO_REUSEADDR` (and `IPV6_V6ONLY` for IPv6, so
//!   that `0.0.0.0:8000` and `[::]:8000` can both be listed), or a unix
//!   socket of mode 0660 whose path holds no file or a stale socket (never
//!   another kind of file, and never a socket someone still listens on).
//!
//! Every inherited descriptor is data from someone else until checked: a
//! stream socket, listening (`SO_ACCEPTCONN`), whose local address
//! (`getsockname`) is the one expected. The backlog ([`BACKLOG`]) is deep
//! enough for clients to wait in the kernel through a warden's restart.
//! Under systemd every socket not from a `.socket` unit is then kept in the
//! service's store, so that a warden that dies leaves its address
//! listening for the next one.

use std::io;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, FromRawFd, OwnedFd, RawFd};
use std::os::unix::fs::{FileTypeExt, PermissionsExt};
use std::path::{Path, PathBuf};

use crate::config::{Front, Listen};

/// The listen queue asked for: clients that connect while the warden is
/// not accepting (its own restart, an upgrade's exec) wait here. The kernel
/// caps it at `net.core.somaxconn` (4096 by default since Linux 5.4).
pub(crate) const BACKLOG: i32 = 4096;

/// The names of the warden's own descriptors in systemd's store
/// (`front-0`, `front-1`, …). A `.socket` unit's `FileDescriptorName=` must
/// not begin with it.
pub(crate) const STORE_PREFIX: &str = "front-";

/// The mode of a unix socket the warden creates: the service's user and
/// group may connect.
pub(crate) const UNIX_MODE: u32 = 0o660;

/// One listening socket, non-blocking and closed on exec, ready for
/// tokio's `from_std`.
#[derive(Debug)]
pub(crate) enum Listener {
    Tcp(std::net::TcpListener),
    Unix(std::os::unix::net::UnixListener),
}

impl AsFd for Listener {
    fn as_fd(&self) -> BorrowedFd<'_> {
        match self {
            Listener::Tcp(l) => l.as_fd(),
            Listener::Unix(l) => l.as_fd(),
        }
    }
}

impl Listener {
    /// A checked listening socket of the kind `listen` names.
    fn from_fd(fd: OwnedFd, listen: &Listen) -> io::Result<Listener> {
        let socket = socket2::Socket::from(fd);
        socket.set_nonblocking(true)?;
        socket.set_cloexec(true)?;
        Ok(match listen {
            Listen::Tcp(_) => Listener::Tcp(socket.into()),
            Listen::Unix(_) => Listener::Unix(socket.into()),
        })
    }
}

/// Why the front door cannot open: said at start, and the warden ends
/// (exit 78).
#[derive(Debug, thiserror::Error)]
pub(crate) enum ListenError {
    #[error("front.listen {address}: cannot listen: {source}")]
    Bind { address: String, source: io::Error },
    #[error("front.listen unix:{}: its folder does not exist", .0.display())]
    NoFolder(PathBuf),
    #[error("front.listen unix:{}: a file that is not a socket is at that path; it is left alone: remove it or choose another path", .0.display())]
    NotASocket(PathBuf),
    #[error("front.listen unix:{}: another process listens on that socket", .0.display())]
    InUse(PathBuf),
    #[error("systemd passed socket {name:?}, which is not one the front door can use: {why}")]
    Unusable { name: String, why: String },
    #[error(
        "systemd passed socket {name:?} on {address}, which `front.listen` does not name: make the .socket unit's \
         ListenStream= and `front.listen` the same addresses"
    )]
    Unmatched { name: String, address: String },
    #[error("systemd passed socket {name:?} on {address}, but the config has no [front]")]
    NoFront { name: String, address: String },
}

/// Where an inherited descriptor came from.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Origin {
    /// A `.socket` unit's, with its name.
    Activation(String),
    /// The predecessor's, across an upgrade in place.
    Predecessor,
    /// systemd's store, with the name it was stored under.
    Store(String),
    /// Bound by this warden.
    Bound,
}

impl Origin {
    /// Which of two sockets for one address is used.
    fn rank(&self) -> u8 {
        match self {
            Origin::Activation(_) => 0,
            Origin::Predecessor => 1,
            Origin::Store(_) => 2,
            Origin::Bound => 3,
        }
    }
}

/// A descriptor handed to this warden, with what it was found to be.
#[derive(Debug)]
struct Passed {
    fd: OwnedFd,
    origin: Origin,
    /// Its local address if it is a listening stream socket; else why not.
    address: Result<Listen, String>,
}

/// The listening sockets this warden was handed (by systemd or by an
/// upgrading predecessor), to be matched to `front.listen` by [`open`].
#[derive(Debug, Default)]
pub struct Inherited {
    passed: Vec<Passed>,
    /// What was wrong with what was handed over, said once logging is up.
    notes: Vec<String>,
}

impl Inherited {
    /// The sockets systemd passed (`LISTEN_FDS`, `LISTEN_PID`,
    /// `LISTEN_FDNAMES`), taken out of the environment so that no child
    /// inherits them; with `take` false (an upgrade's successor, whose
    /// sockets come from the hand-off) only the variables are removed.
    /// Call from `main`, before any thread exists.
    pub(crate) fn from_env(take: bool) -> Inherited {
        let mut out = Inherited::default();
        // SAFETY: called from `main` before any other thread is started,
        // so no other thread reads the environment meanwhile.
        let passed = unsafe { sd_notify::listen_fds_with_names_and_unset_env() };
        if !take {
            return out;
        }
        match passed {
            Ok(fds) => {
                for (raw, name) in fds {
                    // SAFETY: systemd passed this descriptor to this process
                    // (LISTEN_PID is ours, and sd-notify found it open);
                    // nothing else of this process knows it.
                    let fd = unsafe { OwnedFd::from_raw_fd(raw) };
                    let origin =
                        if name.starts_with(STORE_PREFIX) { Origin::Store(name) } else { Origin::Activation(name) };
                    let address = local_listen(fd.as_fd());
                    out.passed.push(Passed { fd, origin, address });
                }
            }
            Err(e) => out.notes.push(format!("the sockets systemd passed cannot be read: {e}")),
        }
        out
    }

    /// The sockets an upgrading predecessor named in its hand-off, as
    /// `(descriptor, address)`: each is taken only once checked to be an
    /// open listening socket with that local address, never one of
    /// `reserved` (the lock, the child's output, the log) or a standard one.
    pub(crate) fn handed_over(named: &[(RawFd, String)], reserved: &[RawFd]) -> Inherited {
        let mut out = Inherited::default();
        let mut taken = Vec::new();
        for (raw, address) in named {
            let raw = *raw;
            let refuse = |why: &str| format!("the hand-off's socket {address} (descriptor {raw}) is not used: {why}");
            if raw <= 2 || reserved.contains(&raw) || taken.contains(&raw) {
                out.notes.push(refuse("not a descriptor a warden hands over"));
                continue;
            }
            let Some(expected) = parse_shown(address) else {
                out.notes.push(refuse("not an address"));
                continue;
            };
            // SAFETY: fcntl on a number: at worst EBADF.
            if unsafe { libc::fcntl(raw, libc::F_GETFD) } < 0 {
                out.notes.push(refuse("not open"));
                continue;
            }
            // SAFETY: open (checked just above), and only borrowed here.
            let found = local_listen(unsafe { BorrowedFd::borrow_raw(raw) });
            match found {
                Ok(a) if a == expected => {}
                Ok(a) => {
                    out.notes.push(refuse(&format!("it listens on {}", a.shown())));
                    continue;
                }
                Err(why) => {
                    out.notes.push(refuse(why.as_str()));
                    continue;
                }
            }
            taken.push(raw);
            // SAFETY: an open listening socket the predecessor kept open for
            // this warden, named once: from now on this owns it.
            let fd = unsafe { OwnedFd::from_raw_fd(raw) };
            out.passed.push(Passed { fd, origin: Origin::Predecessor, address: Ok(expected) });
        }
        out
    }

    /// The listening sockets among this process's descriptors, found by
    /// what they are: for a successor whose hand-off could not be used
    /// (its predecessor kept them open all the same). Call before anything
    /// of this process opens a socket.
    pub(crate) fn found() -> Inherited {
        let mut out = Inherited::default();
        let Ok(dir) = std::fs::read_dir("/proc/self/fd") else { return out };
        let fds: Vec<RawFd> =
            dir.flatten().filter_map(|e| e.file_name().to_str()?.parse().ok()).filter(|fd| *fd > 2).collect();
        for raw in fds {
            // SAFETY: fcntl on a number: at worst EBADF (the directory's
            // own descriptor, closed by now).
            if unsafe { libc::fcntl(raw, libc::F_GETFD) } < 0 {
                continue;
            }
            // SAFETY: open (checked just above), and only borrowed here.
            if let Ok(address) = local_listen(unsafe { BorrowedFd::borrow_raw(raw) }) {
                // SAFETY: a listening socket the predecessor left open for
                // this warden; this process has opened none of its own yet.
                let fd = unsafe { OwnedFd::from_raw_fd(raw) };
                out.passed.push(Passed { fd, origin: Origin::Predecessor, address: Ok(address) });
            }
        }
        out
    }
}

/// The local address of a listening stream socket, or why `fd` is not one.
fn local_listen(fd: BorrowedFd<'_>) -> Result<Listen, String> {
    let socket = socket2::SockRef::from(&fd);
    match socket.r#type() {
        Ok(t) if t == socket2::Type::STREAM => {}
        Ok(_) => return Err("not a stream socket".into()),
        Err(e) if e.raw_os_error() == Some(libc::ENOTSOCK) => return Err("not a socket".into()),
        Err(e) => return Err(e.to_string()),
    }
    match socket.is_listener() {
        Ok(true) => {}
        Ok(false) => return Err("not listening".into()),
        Err(e) => return Err(e.to_string()),
    }
    let local = socket.local_addr().map_err(|e| e.to_string())?;
    if let Some(a) = local.as_socket() {
        return Ok(Listen::Tcp(a));
    }
    match local.as_pathname() {
        Some(p) => Ok(Listen::Unix(p.to_path_buf())),
        None => Err("a unix socket with no path".into()),
    }
}

/// An address as [`Listen::shown`] writes it.
fn parse_shown(s: &str) -> Option<Listen> {
    match s.strip_prefix("unix:") {
        Some(p) if p.starts_with('/') => Some(Listen::Unix(PathBuf::from(p))),
        Some(_) => None,
        None => s.parse().ok().map(Listen::Tcp),
    }
}

/// The front door's sockets, one for each of `front.listen` in its order:
/// taken from `inherited` where one listens on that address (see the
/// module's doc for which first), else bound here. What is handed over and
/// not used is closed (and, from systemd's store, taken out of it). Under
/// systemd, every socket not from a `.socket` unit is then kept in the
/// service's store. Call before anything starts.
pub(crate) fn open(front: &Front, inherited: Inherited) -> Result<Vec<(Listen, Listener)>, ListenError> {
    let (listeners, origins, stale) = take_or_bind(&front.listen, inherited, true)?;
    store(&listeners, &origins, &stale);
    Ok(listeners)
}

/// Without `[front]`: what was handed over is closed (and taken out of
/// systemd's store); a `.socket` unit's socket is an error, as nothing
/// would answer its clients.
pub(crate) fn without_front(inherited: Inherited) -> Result<(), ListenError> {
    let (_, _, stale) = take_or_bind(&[], inherited, false)?;
    store(&[], &[], &stale);
    Ok(())
}

/// The sockets for `wanted`, where each came from, and the names of
/// stored descriptors to take out of systemd's store.
type Taken = (Vec<(Listen, Listener)>, Vec<Origin>, Vec<String>);

fn take_or_bind(wanted: &[Listen], inherited: Inherited, front: bool) -> Result<Taken, ListenError> {
    for note in &inherited.notes {
        tracing::warn!(EVENT = "front", "{note}");
    }
    let mut passed = inherited.passed;
    for p in &passed {
        let Origin::Activation(name) = &p.origin else { continue };
        let name = name.clone();
        match &p.address {
            Err(why) => return Err(ListenError::Unusable { name, why: why.clone() }),
            Ok(a) if !front => return Err(ListenError::NoFront { name, address: a.shown() }),
            Ok(a) if !wanted.contains(a) => return Err(ListenError::Unmatched { name, address: a.shown() }),
            Ok(_) => {}
        }
    }
    let mut listeners = Vec::new();
    let mut origins = Vec::new();
    for want in wanted {
        let best = passed
            .iter()
            .enumerate()
            .filter(|(_, p)| p.address.as_ref() == Ok(want) && reachable(want))
            .min_by_key(|(_, p)| p.origin.rank())
            .map(|(i, _)| i);
        let (listener, origin) = match best {
            Some(i) => {
                let p = passed.remove(i);
                let listener = Listener::from_fd(p.fd, want)
                    .map_err(|source| ListenError::Bind { address: want.shown(), source })?;
                tracing::info!(EVENT = "front", "listening on {} ({})", want.shown(), described(&p.origin));
                (listener, p.origin)
            }
            None => {
                let listener = bind(want)?;
                tracing::info!(EVENT = "front", "listening on {}", want.shown());
                (listener, Origin::Bound)
            }
        };
        listeners.push((want.clone(), listener));
        origins.push(origin);
    }
    // What is left is closed as it is dropped here.
    let mut stale = Vec::new();
    for p in passed {
        let shown = p.address.as_ref().map_or_else(|why| why.clone(), Listen::shown);
        match p.origin {
            Origin::Store(name) => {
                tracing::info!(
                    EVENT = "front",
                    "closing the stored socket {name} ({shown}): no longer in front.listen, or its path is gone"
                );
                if !stale.contains(&name) {
                    stale.push(name);
                }
            }
            Origin::Predecessor => tracing::info!(
                EVENT = "front",
                "closing the predecessor's socket ({shown}): no longer in front.listen, or its path is gone"
            ),
            // A second one for an address, or a unix socket whose path is gone.
            Origin::Activation(name) => tracing::warn!(
                EVENT = "front",
                "not using socket {name} ({shown}): another serves that address, or its path is gone"
            ),
            Origin::Bound => {}
        }
    }
    Ok((listeners, origins, stale))
}

/// Whether clients can still reach a socket on `listen`: a unix socket
/// whose path is gone (or is now another kind of file) is not used; a new
/// one is bound there.
fn reachable(listen: &Listen) -> bool {
    match listen {
        Listen::Tcp(_) => true,
        Listen::Unix(p) => std::fs::symlink_metadata(p).is_ok_and(|m| m.file_type().is_socket()),
    }
}

fn described(origin: &Origin) -> String {
    match origin {
        Origin::Activation(name) => format!("passed by systemd as {name}"),
        Origin::Predecessor => "kept across the upgrade".into(),
        Origin::Store(name) => format!("from systemd's store, {name}"),
        Origin::Bound => "bound".into(),
    }
}

/// Bind and listen on `listen`.
fn bind(listen: &Listen) -> Result<Listener, ListenError> {
    let err = |source| ListenError::Bind { address: listen.shown(), source };
    match listen {
        Listen::Tcp(addr) => {
            let socket =
                socket2::Socket::new(socket2::Domain::for_address(*addr), socket2::Type::STREAM, None).map_err(err)?;
            // A restarted warden binds again at once, whatever connections
            // of the last one linger in TIME_WAIT.
            socket.set_reuse_address(true).map_err(err)?;
            if addr.is_ipv6() {
                // `[::]:8000` beside `0.0.0.0:8000`: each its own family.
                socket.set_only_v6(true).map_err(err)?;
            }
            socket.bind(&(*addr).into()).map_err(err)?;
            socket.listen(BACKLOG).map_err(err)?;
            socket.set_nonblocking(true).map_err(err)?;
            Ok(Listener::Tcp(socket.into()))
        }
        Listen::Unix(path) => {
            clear_unix_path(path)?;
            let socket = socket2::Socket::new(socket2::Domain::UNIX, socket2::Type::STREAM, None).map_err(err)?;
            socket.bind(&socket2::SockAddr::unix(path).map_err(err)?).map_err(err)?;
            std::fs::set_permissions(path, std::fs::Permissions::from_mode(UNIX_MODE)).map_err(err)?;
            socket.listen(BACKLOG).map_err(err)?;
            socket.set_nonblocking(true).map_err(err)?;
            Ok(Listener::Unix(socket.into()))
        }
    }
}

/// Whether a unix socket can be made at `path`, as `check` sees it: its
/// folder exists, and the path holds nothing or a socket (stale, or the
/// one a running warden or a `.socket` unit listens on). Changes nothing.
pub(crate) fn unix_path_usable(path: &Path) -> Result<(), ListenError> {
    let folder = path.parent().unwrap_or(Path::new("/"));
    if !folder.is_dir() {
        return Err(ListenError::NoFolder(path.to_path_buf()));
    }
    match std::fs::symlink_metadata(path) {
        Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(()),
        Err(source) => Err(ListenError::Bind { address: format!("unix:{}", path.display()), source }),
        Ok(m) if !m.file_type().is_socket() => Err(ListenError::NotASocket(path.to_path_buf())),
        Ok(_) => Ok(()),
    }
}

/// Make room for a unix socket at `path`: nothing there, or a stale socket
/// (nobody listens on it), which is removed. Another kind of file is never
/// removed; a socket something listens on is not taken.
fn clear_unix_path(path: &Path) -> Result<(), ListenError> {
    unix_path_usable(path)?;
    if std::fs::symlink_metadata(path).is_err() {
        return Ok(());
    }
    match std::os::unix::net::UnixStream::connect(path) {
        Ok(_) => Err(ListenError::InUse(path.to_path_buf())),
        Err(_) => std::fs::remove_file(path)
            .or_else(|e| if e.kind() == io::ErrorKind::NotFound { Ok(()) } else { Err(e) })
            .map_err(|source| ListenError::Bind { address: format!("unix:{}", path.display()), source }),
    }
}

/// Under systemd (`$NOTIFY_SOCKET`): take the `stale` names out of the
/// store, then store every socket not from a `.socket` unit (which systemd
/// holds already) under a name of its own. A socket stored already is
/// stored again only if its name was among the stale ones; systemd ignores
/// a descriptor it holds already. A failure is said, and the front door
/// serves all the same: only a warden that dies would then leave its
/// address closed until the next one binds it.
fn store(listeners: &[(Listen, Listener)], origins: &[Origin], stale: &[String]) {
    let failed = |e: io::Error| {
        tracing::warn!(
            EVENT = "front",
            error = %e,
            "cannot keep the front door's sockets in systemd's store: if the warden dies, clients are refused until it is back"
        )
    };
    for name in stale {
        match crate::tell::notify::remove_stored(name) {
            Ok(true) => {}
            Ok(false) => return,
            Err(e) => return failed(e),
        }
    }
    for (i, name) in store_plan(origins, stale) {
        match crate::tell::notify::store_fd(&name, listeners[i].1.as_fd()) {
            Ok(true) => {}
            Ok(false) => return,
            Err(e) => return failed(e),
        }
    }
}

/// Which of the sockets (by their `origins`) go into the store once the
/// `stale` names are out of it, and under which name: a stored one only if
/// its name was taken out (under that name again); one bound here or kept
/// across an upgrade under `front-N`, N its place in `front.listen` unless
/// a stored one has that name, then the first name free. Names stay
/// unique, so that taking one out never takes another socket with it.
fn store_plan(origins: &[Origin], stale: &[String]) -> Vec<(usize, String)> {
    let mut names: Vec<String> = origins
        .iter()
        .filter_map(|o| match o {
            Origin::Store(n) => Some(n.clone()),
            _ => None,
        })
        .collect();
    let mut plan = Vec::new();
    for (i, origin) in origins.iter().enumerate() {
        match origin {
            Origin::Activation(_) => {}
            Origin::Store(n) if !stale.contains(n) => {}
            Origin::Store(n) => plan.push((i, n.clone())),
            Origin::Predecessor | Origin::Bound => {
                let name = (i..).map(|n| format!("{STORE_PREFIX}{n}")).find(|n| !names.contains(n)).unwrap_or_default();
                names.push(name.clone());
                plan.push((i, name));
            }
        }
    }
    plan
}

/// A listening socket kept for an upgrade's successor: a second descriptor
/// of the front door's socket, which the front door's own may be closed
/// beside without closing the socket.
#[derive(Debug)]
pub struct Kept {
    pub(crate) listen: Listen,
    pub(crate) fd: OwnedFd,
}

impl Kept {
    /// What the hand-off says of it: its descriptor and address.
    pub(crate) fn handed(&self) -> (RawFd, String) {
        (self.fd.as_raw_fd(), self.listen.shown())
    }
}

/// The sockets of `listeners`, kept for an upgrade in place.
pub(crate) fn kept(listeners: &[(Listen, Listener)]) -> io::Result<Vec<Kept>> {
    listeners.iter().map(|(l, s)| Ok(Kept { listen: l.clone(), fd: s.as_fd().try_clone_to_owned()? })).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tcp(s: &str) -> Listen {
        Listen::Tcp(s.parse().unwrap())
    }

    /// An address is written in the hand-off as the config shows it, and
    /// read back the same.
    #[test]
    fn an_address_is_read_back_as_shown() {
        for l in [tcp("0.0.0.0:8000"), tcp("[::]:8000"), tcp("[::1]:1"), Listen::Unix("/run/x/y.sock".into())] {
            assert_eq!(parse_shown(&l.shown()), Some(l.clone()));
        }
        assert_eq!(parse_shown("unix:relative"), None);
        assert_eq!(parse_shown("8000"), None);
    }

    /// A descriptor that is not a listening stream socket is said to be
    /// what it is.
    #[test]
    fn what_is_not_a_listening_socket_is_named() {
        let file = tempfile::tempfile().unwrap();
        assert_eq!(local_listen(file.as_fd()), Err("not a socket".into()));
        let udp = std::net::UdpSocket::bind("127.0.0.1:0").unwrap();
        assert_eq!(local_listen(udp.as_fd()), Err("not a stream socket".into()));
        let s = socket2::Socket::new(socket2::Domain::IPV4, socket2::Type::STREAM, None).unwrap();
        s.bind(&"127.0.0.1:0".parse::<std::net::SocketAddr>().unwrap().into()).unwrap();
        assert_eq!(local_listen(s.as_fd()), Err("not listening".into()));
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        assert_eq!(local_listen(l.as_fd()), Ok(Listen::Tcp(l.local_addr().unwrap())));
    }

    /// A socket goes into the store unless it is there already (or is a
    /// `.socket` unit's), under a name no other stored socket has.
    #[test]
    fn the_store_gets_each_socket_once_under_a_name_of_its_own() {
        let s = |n: &str| Origin::Store(n.into());
        let named = |p: Vec<(usize, String)>| p.into_iter().map(|(i, n)| format!("{i}={n}")).collect::<Vec<_>>();
        // A first start: front-0, front-1, … in the config's order.
        assert_eq!(named(store_plan(&[Origin::Bound, Origin::Bound], &[])), ["0=front-0", "1=front-1"]);
        // Taken back from the store: nothing to send; a .socket unit's: never.
        assert!(store_plan(&[s("front-0"), Origin::Activation("web".into())], &[]).is_empty());
        // A new address where a stored one keeps its old name front-0.
        assert_eq!(named(store_plan(&[Origin::Bound, s("front-0")], &[])), ["0=front-1"]);
        // front-1 named both a kept socket and a stale one: the name was
        // taken out of the store with both, the kept one goes back under
        // it, and a new one does not take it.
        let plan = store_plan(&[s("front-0"), Origin::Bound, s("front-1")], &["front-1".into()]);
        assert_eq!(named(plan), ["1=front-2", "2=front-1"]);
        // Across an upgrade: stored again under front-N (systemd ignores a
        // descriptor it holds already).
        assert_eq!(named(store_plan(&[Origin::Predecessor], &[])), ["0=front-0"]);
    }

    /// The hand-off's descriptors are taken only when they are what it
    /// says: a listening socket on the named address, named once.
    #[test]
    fn a_handed_over_socket_is_checked() {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let fd = l.as_raw_fd();
        let addr = l.local_addr().unwrap().to_string();
        let file = tempfile::tempfile().unwrap();
        let got = Inherited::handed_over(
            &[(file.as_raw_fd(), addr.clone()), (fd, "127.0.0.1:1".into()), (fd, addr.clone()), (fd, addr.clone())],
            &[],
        );
        assert_eq!(got.passed.len(), 1, "{got:?}");
        assert_eq!(got.notes.len(), 3, "{:?}", got.notes);
        assert!(got.notes[0].ends_with("not a socket"), "{}", got.notes[0]);
        assert!(got.notes[1].contains(&format!("it listens on {addr}")), "{}", got.notes[1]);
        assert!(got.notes[2].contains("not a descriptor a warden hands over"), "{}", got.notes[2]);
        // The inherited one owns the descriptor now.
        std::mem::forget(l);
        let reserved = Inherited::handed_over(&[(fd, addr)], &[fd]);
        assert!(reserved.passed.is_empty());
    }
}
