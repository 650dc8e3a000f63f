//! Errors that are the warden's own, told apart from the child's.

/// The warden's own lack of a resource, named, when `e` is one: the error
/// is the warden's, never the child's.
pub(crate) fn own_shortage(e: &std::io::Error) -> Option<&'static str> {
    match e.raw_os_error()? {
        libc::EMFILE => Some("the warden is out of file descriptors"),
        libc::ENFILE => Some("the system is out of file descriptors"),
        libc::ENOMEM | libc::ENOBUFS => Some("the warden is out of memory"),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_wardens_own_shortages_are_named() {
        let e = |n| std::io::Error::from_raw_os_error(n);
        assert_eq!(own_shortage(&e(libc::EMFILE)), Some("the warden is out of file descriptors"));
        assert_eq!(own_shortage(&e(libc::ENFILE)), Some("the system is out of file descriptors"));
        assert_eq!(own_shortage(&e(libc::ENOMEM)), Some("the warden is out of memory"));
        assert_eq!(own_shortage(&e(libc::ECONNREFUSED)), None);
        assert_eq!(own_shortage(&e(libc::EADDRINUSE)), None);
    }
}
