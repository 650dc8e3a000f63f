//! Who opened a connection to one of the warden's servers (the endpoint,
//! the front door): the unit of their per-client shares.

/// Who opened a connection.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub(crate) enum Peer {
    /// A TCP client's address (an IPv4 address mapped into IPv6 as the
    /// IPv4 address).
    Ip(std::net::IpAddr),
    /// A unix socket client's user.
    Uid(u32),
    /// A unix socket client whose credentials could not be read: all of
    /// them count as one.
    Unknown,
}

impl std::fmt::Display for Peer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Peer::Ip(ip) => write!(f, "{ip}"),
            Peer::Uid(uid) => write!(f, "uid {uid}"),
            Peer::Unknown => f.write_str("an unknown user"),
        }
    }
}
