//! The port a start needs: who listens on it, and how to say so.

use std::collections::{BTreeMap, BTreeSet};
use std::io;

/// A process's command line, for messages: an argument that is not UTF-8
/// shown lossy (the procfs crate refuses the whole line).
pub(crate) fn cmdline(pid: i32) -> String {
    let raw = std::fs::read(format!("/proc/{pid}/cmdline")).unwrap_or_default();
    let args: Vec<String> =
        raw.split(|b| *b == 0).filter(|a| !a.is_empty()).map(|a| String::from_utf8_lossy(a).into_owned()).collect();
    let line = crate::util::redact::command(&args);
    if line.is_empty() { "(unknown)".into() } else { format!("({line})") }
}

/// Socket inodes listening on `port` (TCP, IPv4 and IPv6): asked of the
/// kernel's socket diagnostics (netlink, as `ss` does), which hands over the
/// listening sockets alone; else read from `/proc/net/tcp{,6}`, which walks
/// every bucket of the connection table and takes milliseconds on a machine
/// with much memory, at every start.
pub(super) fn listening_inodes(port: u16) -> BTreeSet<u64> {
    match diag::listening_inodes(port) {
        Ok(found) => found,
        Err(e) => {
            tracing::debug!(error = %e, "socket diagnostics unavailable: reading /proc/net/tcp");
            listening_inodes_in_proc(port)
        }
    }
}

pub(super) fn listening_inodes_in_proc(port: u16) -> BTreeSet<u64> {
    use procfs::net::TcpState;
    [procfs::net::tcp(), procfs::net::tcp6()]
        .into_iter()
        .flatten()
        .flatten()
        .filter(|s| s.state == TcpState::Listen && s.local_address.port() == port)
        .map(|s| s.inode)
        .collect()
}

/// The kernel's socket diagnostics (`NETLINK_SOCK_DIAG`), for listening TCP
/// sockets.
pub(super) mod diag {
    use std::collections::BTreeSet;
    use std::io;

    use netlink_packet_core::{NLM_F_DUMP, NLM_F_REQUEST, NetlinkHeader, NetlinkMessage, NetlinkPayload};
    use netlink_packet_sock_diag::SockDiagMessage;
    use netlink_packet_sock_diag::constants::{AF_INET, AF_INET6, IPPROTO_TCP};
    use netlink_packet_sock_diag::inet::{ExtensionFlags, InetRequest, SocketId, StateFlags};
    use netlink_sys::protocols::NETLINK_SOCK_DIAG;
    use netlink_sys::{Socket, SocketAddr};

    /// A dump larger than this is not believed: a machine has at most 65536
    /// listening ports per address, and one message holds one socket.
    const MAX_MESSAGES: usize = 1 << 20;

    pub(crate) fn listening_inodes(port: u16) -> io::Result<BTreeSet<u64>> {
        let mut socket = Socket::new(NETLINK_SOCK_DIAG)?;
        socket.bind_auto()?;
        socket.connect(&SocketAddr::new(0, 0))?;
        let mut out = BTreeSet::new();
        for family in [AF_INET, AF_INET6] {
            dump(&socket, family, port, &mut out)?;
        }
        Ok(out)
    }

    fn bad(what: impl std::fmt::Display) -> io::Error {
        io::Error::new(io::ErrorKind::InvalidData, format!("socket diagnostics: {what}"))
    }

    fn dump(socket: &Socket, family: u8, port: u16, out: &mut BTreeSet<u64>) -> io::Result<()> {
        let mut header = NetlinkHeader::default();
        header.flags = NLM_F_REQUEST | NLM_F_DUMP;
        let request = InetRequest {
            family,
            protocol: IPPROTO_TCP,
            extensions: ExtensionFlags::empty(),
            states: StateFlags::LISTEN,
            socket_id: if family == AF_INET { SocketId::new_v4() } else { SocketId::new_v6() },
        };
        let mut packet = NetlinkMessage::new(header, SockDiagMessage::InetRequest(request).into());
        packet.finalize();
        let mut buf = vec![0; packet.buffer_len()];
        packet.serialize(&mut buf);
        socket.send(&buf, 0)?;

        let mut seen = 0usize;
        loop {
            let (data, _) = socket.recv_from_full()?;
            if data.is_empty() {
                return Err(bad("the dump ended without its end marker"));
            }
            let mut at = 0;
            while at < data.len() {
                let msg = <NetlinkMessage<SockDiagMessage>>::deserialize(&data[at..]).map_err(bad)?;
                let len = msg.header.length as usize;
                if len == 0 {
                    return Err(bad("a message of length 0"));
                }
                match msg.payload {
                    NetlinkPayload::Done(_) => return Ok(()),
                    NetlinkPayload::Error(e) => return Err(bad(format!("{e:?}"))),
                    NetlinkPayload::InnerMessage(SockDiagMessage::InetResponse(r))
                        if r.header.socket_id.source_port == port =>
                    {
                        out.insert(u64::from(r.header.inode));
                    }
                    _ => {}
                }
                seen += 1;
                if seen > MAX_MESSAGES {
                    return Err(bad("a dump without end"));
                }
                // Messages are aligned to 4 bytes.
                at += len.div_ceil(4) * 4;
            }
        }
    }
}

/// The processes listening on `port`: pid and command line.
pub(crate) fn port_holders(port: u16) -> Vec<(i32, String)> {
    let inodes = listening_inodes(port);
    if inodes.is_empty() {
        return Vec::new();
    }
    let mut out = BTreeMap::new();
    for pid in crate::process::child::processes() {
        let Ok(fds) = procfs::process::Process::new(pid).and_then(|p| p.fd()) else { continue };
        let socket = |fd: procfs::process::FDInfo| match fd.target {
            procfs::process::FDTarget::Socket(inode) => Some(inode),
            _ => None,
        };
        if fds.flatten().filter_map(socket).any(|i| inodes.contains(&i)) {
            out.insert(pid, cmdline(pid));
        }
    }
    out.into_iter().collect()
}

/// What a look at a port found.
#[derive(Debug)]
pub(crate) enum Port {
    /// A server could listen on it now.
    Free,
    /// Something listens on it, or the bind says it is in use.
    Held,
    /// The bind failed for another reason: no answer about the port.
    Unknown(io::Error),
}

/// Look at `port`: a listening socket on it, else a trial bind. Only
/// `EADDRINUSE` means held; another bind error (permission denied, the
/// warden out of descriptors) is [`Port::Unknown`] with that error.
pub(crate) fn look_at_port(port: u16) -> Port {
    if !listening_inodes(port).is_empty() {
        return Port::Held;
    }
    match std::net::TcpListener::bind(("0.0.0.0", port)) {
        Ok(_) => Port::Free,
        Err(e) if e.kind() == io::ErrorKind::AddrInUse => Port::Held,
        Err(e) => Port::Unknown(e),
    }
}

/// True when a server could listen on `port` now.
pub(crate) fn port_free(port: u16) -> bool {
    matches!(look_at_port(port), Port::Free)
}

/// A bind error that says nothing about the port, as a cause: the warden's
/// own shortage named as such, else the error as it is.
pub(crate) fn describe_port_error(port: u16, e: &io::Error) -> String {
    match crate::util::errno::own_shortage(e) {
        Some(why) => format!("cannot check port {port}: {why} ({e})"),
        None => format!("cannot check port {port}: binding it failed: {e}"),
    }
}

/// Why a server could not listen on `port` now (`None`: it could): its
/// holders, or the bind's own error.
pub(crate) fn port_blocker(port: u16) -> Option<String> {
    match look_at_port(port) {
        Port::Free => None,
        Port::Held => Some(describe_holders(port)),
        Port::Unknown(e) => Some(describe_port_error(port, &e)),
    }
}

/// The holders of `port`, for a cause or a status line.
pub(crate) fn describe_holders(port: u16) -> String {
    let holders = port_holders(port);
    if holders.is_empty() {
        return format!("port {port} is in use");
    }
    let who: Vec<String> = holders.iter().map(|(pid, cmd)| format!("pid {pid} {cmd}")).collect();
    format!("port {port} is held by {}", who.join(", "))
}
