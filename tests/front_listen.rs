//! The front door's listening sockets, through the real binary: bound by
//! the warden (IPv4 and IPv6 on one port, a unix socket), taken from
//! systemd (socket activation, the file-descriptor store), and carried
//! across an upgrade in place, never closed. Nothing accepts on them yet in
//! these tests: a connection taken into the backlog (connect succeeds) is
//! the proof that a socket listens.

mod common;

use std::os::fd::{AsRawFd, OwnedFd};
use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::path::Path;
use std::sync::mpsc;

use common::{Opts, TIMEOUT, Warden, config};

const FAST: &str = "[restart]\ninitial-delay = \"0s\"\n";

/// A config whose engine is the simulator on its own port (profile
/// `none`: the engine stays on the command's port), with `[front]`
/// listening on `listen`.
fn front_config(dir: &Path, port: u16, listen: &[String]) -> String {
    let listen: Vec<String> = listen.iter().map(|a| format!("{a:?}")).collect();
    format!(
        "profile = \"none\"\n{}[ready]\nlog = [\"Application startup complete\"]\n[front]\nlisten = [{}]\n",
        config(dir, port, &["--shards", "1"], "", FAST),
        listen.join(", ")
    )
}

/// The inode of the socket behind a descriptor.
fn inode(fd: &impl AsRawFd) -> u64 {
    std::fs::metadata(format!("/proc/self/fd/{}", fd.as_raw_fd())).unwrap().ino()
}

/// The inodes of the sockets process `pid` holds.
fn sockets_of(pid: u32) -> Vec<u64> {
    std::fs::read_dir(format!("/proc/{pid}/fd"))
        .unwrap()
        .flatten()
        .filter_map(|e| std::fs::read_link(e.path()).ok())
        .filter_map(|l| l.to_str()?.strip_prefix("socket:[")?.strip_suffix(']')?.parse().ok())
        .collect()
}

/// The inode of the listening TCP socket on `127.0.0.1:port`, from
/// `/proc/net/tcp`.
fn listening_tcp(port: u16) -> Option<u64> {
    let local = format!("0100007F:{port:04X}");
    std::fs::read_to_string("/proc/net/tcp").unwrap().lines().skip(1).find_map(|l| {
        let f: Vec<&str> = l.split_whitespace().collect();
        (f[1] == local && f[3] == "0A").then(|| f[9].parse().unwrap())
    })
}

/// The inode of the listening unix socket at `path`, from `/proc/net/unix`.
fn listening_unix(path: &Path) -> Option<u64> {
    std::fs::read_to_string("/proc/net/unix").unwrap().lines().skip(1).find_map(|l| {
        let f: Vec<&str> = l.split_whitespace().collect();
        let listening = u32::from_str_radix(f[3], 16).unwrap() & 0x10000 != 0;
        (f.get(7) == Some(&path.to_str().unwrap()) && listening).then(|| f[6].parse().unwrap())
    })
}

fn connects_tcp(addr: &str) -> Result<(), String> {
    let addr: std::net::SocketAddr = addr.parse().unwrap();
    std::net::TcpStream::connect_timeout(&addr, TIMEOUT).map(drop).map_err(|e| format!("{addr}: {e}"))
}

fn connects_unix(path: &Path) -> Result<(), String> {
    std::os::unix::net::UnixStream::connect(path).map(drop).map_err(|e| format!("{}: {e}", path.display()))
}

/// Wait for the notifications that carry descriptors until `n` have come.
fn stored(rx: &mpsc::Receiver<(String, Vec<OwnedFd>)>, n: usize) -> Vec<(String, Vec<OwnedFd>)> {
    (0..n)
        .map(|i| rx.recv_timeout(TIMEOUT).unwrap_or_else(|_| panic!("descriptor message {i} of {n} never came")))
        .collect()
}

/// `0.0.0.0:P` and `[::]:P` side by side, and a unix socket whose path
/// held a stale socket: all listen before the engine is ready, the unix
/// one with mode 0660. Under systemd each is kept in the store, named
/// `front-N` in the config's order, with the very socket the warden holds.
#[test]
fn the_front_door_listens_on_every_address_and_keeps_them_in_the_store() {
    let front = common::free_port();
    let (tx, rx) = mpsc::channel();
    let opts = Opts { notify_fds: Some(tx), ..Opts::default() };
    let stale = common::tempdir();
    let sock = stale.path().join("front.sock");
    // A socket file nobody listens on: what a warden killed leaves.
    drop(std::os::unix::net::UnixListener::bind(&sock).unwrap());
    // IPv6 may be off (`ipv6.disable=1`, `net.ipv6.conf.all.disable_ipv6`,
    // a container without it): then `[::]:P` is left out, and the test
    // says so.
    let ipv6 = match std::net::TcpListener::bind("[::1]:0") {
        Ok(_) => true,
        Err(e) => {
            eprintln!("SKIPPED (in part): no IPv6 on this host ([::1]: {e}): [::]:{front} is not tried");
            false
        }
    };
    let mut listen = vec![format!("0.0.0.0:{front}"), format!("unix:{}", sock.display())];
    if ipv6 {
        listen.insert(1, format!("[::]:{front}"));
    }
    let mut w = Warden::start_with(|d, p| front_config(d, p, &listen), opts);
    let got = stored(&rx, listen.len());
    for (i, (text, fds)) in got.iter().enumerate() {
        assert_eq!(text, &format!("FDSTORE=1\nFDNAME=front-{i}\n"));
        assert_eq!(fds.len(), 1, "one descriptor a message");
    }
    let theirs = sockets_of(w.pid);
    for (_, fds) in &got {
        assert!(theirs.contains(&inode(&fds[0])), "the stored socket is the one the warden holds");
    }
    let local = |fd: &OwnedFd| socket2::SockRef::from(fd).local_addr().unwrap();
    assert_eq!(local(&got[0].1[0]).as_socket().unwrap().to_string(), format!("0.0.0.0:{front}"));
    if ipv6 {
        assert_eq!(local(&got[1].1[0]).as_socket().unwrap().to_string(), format!("[::]:{front}"));
    }
    assert_eq!(local(&got.last().unwrap().1[0]).as_pathname().unwrap(), sock);
    connects_tcp(&format!("127.0.0.1:{front}")).unwrap();
    if ipv6 {
        connects_tcp(&format!("[::1]:{front}")).unwrap();
    }
    connects_unix(&sock).unwrap();
    assert_eq!(std::fs::metadata(&sock).unwrap().permissions().mode() & 0o777, 0o660);
    w.wait_ready();
    assert_eq!(w.stop(), 0);
}

/// A regular file at the unix socket's path is never removed: the warden
/// refuses to start (78) and says why; the file is as it was.
#[test]
fn a_regular_file_at_the_unix_path_is_refused_and_kept() {
    let d = common::tempdir();
    let path = d.path().join("front.sock");
    std::fs::write(&path, "precious").unwrap();
    let listen = vec![format!("unix:{}", path.display())];
    let mut w = Warden::start(|dir, p| front_config(dir, p, &listen));
    assert_eq!(w.wait_exit(), 78);
    assert!(
        w.stderr().contains(&format!(
            "front.listen unix:{}: a file that is not a socket is at that path; it is left alone",
            path.display()
        )),
        "{}",
        w.stderr()
    );
    assert_eq!(std::fs::read_to_string(&path).unwrap(), "precious");
}

/// Socket activation as systemd does it (`LISTEN_FDS`, `LISTEN_PID` the
/// warden's own, `LISTEN_FDNAMES`): the passed socket is used, not bound
/// again (the warden holds the very socket, and a bind of its own would
/// fail on the taken address), a socket systemd holds is not stored again,
/// and the engine does not inherit the variables.
#[test]
fn a_socket_passed_by_systemd_is_used_and_not_bound() {
    let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = l.local_addr().unwrap().to_string();
    let (tx, rx) = mpsc::channel();
    let opts = Opts {
        listen_fds: vec![l.as_raw_fd()],
        notify_fds: Some(tx),
        env: vec![("LISTEN_FDS".into(), "1".into()), ("LISTEN_FDNAMES".into(), "web.socket".into())],
        wrapper: vec!["sh".into(), "-c".into(), "LISTEN_PID=$$ exec \"$0\" \"$@\"".into()],
        ..Opts::default()
    };
    let listen = vec![addr.clone()];
    let mut w = Warden::start_with(|d, p| front_config(d, p, &listen), opts);
    w.wait_ready();
    assert!(sockets_of(w.pid).contains(&inode(&l)), "the warden holds the socket systemd passed");
    w.wait_logged(&format!("listening on {addr} (passed by systemd as web.socket)"));
    let stderr = w.stderr();
    assert!(stderr.contains(&format!("listening on {addr} (passed by systemd as web.socket)")), "{stderr}");
    drop(l);
    connects_tcp(&addr).unwrap();
    let engine = w.descendants().into_iter().find(|p| p.ppid == w.pid as i32).unwrap();
    let environ = std::fs::read(format!("/proc/{}/environ", engine.pid)).unwrap();
    let environ = String::from_utf8_lossy(&environ);
    assert!(!environ.contains("LISTEN_"), "the engine inherits no LISTEN_ variable");
    assert!(rx.try_recv().is_err(), "a socket of systemd's is not stored again");
    assert!(!w.notes.iter().any(|n| n.starts_with("FDSTORE")), "{:?}", w.notes);
    assert_eq!(w.stop(), 0);
}

/// A passed socket on an address the config does not name is refused at
/// start, named: its clients would wait for a warden that never answers.
#[test]
fn a_passed_socket_the_config_does_not_name_is_refused() {
    let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = l.local_addr().unwrap().to_string();
    let opts = Opts {
        listen_fds: vec![l.as_raw_fd()],
        env: vec![("LISTEN_FDS".into(), "1".into()), ("LISTEN_FDNAMES".into(), "web.socket".into())],
        wrapper: vec!["sh".into(), "-c".into(), "LISTEN_PID=$$ exec \"$0\" \"$@\"".into()],
        ..Opts::default()
    };
    let other = format!("127.0.0.1:{}", common::free_port());
    let mut w = Warden::start_with(|d, p| front_config(d, p, std::slice::from_ref(&other)), opts);
    assert_eq!(w.wait_exit(), 78);
    let want = format!(
        "systemd passed socket \"web.socket\" on {addr}, which `front.listen` does not name: make the .socket unit's ListenStream= and `front.listen` the same addresses"
    );
    assert!(w.stderr().contains(&want), "{}", w.stderr());
}

/// A warden that dies, started again by systemd with its store: while no
/// warden runs, clients are taken into the backlog of the stored sockets
/// (never refused); the new warden uses the stored sockets themselves, and
/// a stored socket whose address the config no longer names is closed and
/// taken out of the store.
#[test]
fn a_warden_started_again_takes_its_sockets_back_from_the_store() {
    let front = common::free_port();
    let (tx, rx) = mpsc::channel();
    let opts = Opts { notify_fds: Some(tx), ..Opts::default() };
    let listen = vec![format!("127.0.0.1:{front}")];
    let mut w = Warden::start_with(|d, p| front_config(d, p, &listen), opts);
    let mut got = stored(&rx, 1);
    let (text, mut fds) = got.remove(0);
    assert_eq!(text, "FDSTORE=1\nFDNAME=front-0\n");
    let kept = fds.remove(0);
    w.wait_ready();
    w.signal(nix::sys::signal::Signal::SIGKILL);
    w.wait_exit();
    // No warden: the store (this test) holds the socket; a client waits.
    connects_tcp(&format!("127.0.0.1:{front}")).unwrap();

    // Started again on the same instance, with a stale stored socket
    // beside it: an address removed from the config.
    let removed = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    w.opts.listen_fds = vec![kept.as_raw_fd(), removed.as_raw_fd()];
    w.opts.env = vec![("LISTEN_FDS".into(), "2".into()), ("LISTEN_FDNAMES".into(), "front-0:front-1".into())];
    w.opts.wrapper = vec!["sh".into(), "-c".into(), "LISTEN_PID=$$ exec \"$0\" \"$@\"".into()];
    w.spawn();
    let mut w2 = w;
    w2.wait_note("the stale one out of the store", |n| n == "FDNAME=front-1");
    let removal = w2.notes.iter().rposition(|n| n == "FDNAME=front-1").unwrap();
    assert_eq!(w2.notes[removal - 1], "FDSTOREREMOVE=1");
    w2.wait_ready();
    let theirs = sockets_of(w2.pid);
    assert!(theirs.contains(&inode(&kept)), "the warden uses the stored socket");
    assert!(!theirs.contains(&inode(&removed)), "the stale one is closed");
    assert!(rx.try_recv().is_err(), "a socket taken from the store is not stored again");
    w2.wait_logged("from systemd's store, front-0");
    connects_tcp(&format!("127.0.0.1:{front}")).unwrap();
    assert_eq!(w2.stop(), 0);
}

/// `vllm-warden upgrade` while clients keep connecting: none is refused,
/// before, during (the exec) or after, and the listening sockets are the
/// same ones (same inodes) before and after: never closed, never bound
/// again.
#[test]
fn an_upgrade_keeps_the_front_doors_sockets() {
    let bin = tempfile::tempdir().unwrap();
    let exe = bin.path().join("vllm-warden");
    std::fs::copy(common::exe(), &exe).unwrap();
    let front = common::free_port();
    let sock_dir = common::tempdir();
    let sock = sock_dir.path().join("front.sock");
    let listen = vec![format!("127.0.0.1:{front}"), format!("unix:{}", sock.display())];
    let opts = Opts { exe: Some(exe.clone()), ..Opts::default() };
    let mut w = Warden::start_with(|d, p| front_config(d, p, &listen), opts);
    w.wait_ready();
    let before = (listening_tcp(front).unwrap(), listening_unix(&sock).unwrap());

    let done = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let client = {
        let (done, sock) = (done.clone(), sock.clone());
        std::thread::spawn(move || {
            // Bounded under the backlog (nothing accepts yet).
            let mut tries = 0;
            while !done.load(std::sync::atomic::Ordering::SeqCst) && tries < 3500 {
                connects_tcp(&format!("127.0.0.1:{front}"))?;
                connects_unix(&sock)?;
                tries += 1;
            }
            Ok::<u32, String>(tries)
        })
    };
    w.ask_upgrade(&exe);
    w.wait_note("the upgrade", |n| n.starts_with("STATUS=upgraded from"));
    done.store(true, std::sync::atomic::Ordering::SeqCst);
    let tries = client.join().unwrap().expect("no connection refused across the upgrade");
    eprintln!("{tries} connections of each kind during the upgrade, none refused");
    let after = (listening_tcp(front).unwrap(), listening_unix(&sock).unwrap());
    assert_eq!(before, after, "the same sockets listen after the upgrade");
    w.wait_logged("(kept across the upgrade)");
    connects_tcp(&format!("127.0.0.1:{front}")).unwrap();
    assert_eq!(w.stop(), 0);
}

/// An upgrade whose hand-off the successor cannot use (here: garbage in
/// the state file) starts the model again, but the listening sockets,
/// open all the same, are found by what they are and kept: the same
/// sockets listen, nothing was refused.
#[test]
fn an_unusable_hand_off_still_keeps_the_sockets() {
    let bin = tempfile::tempdir().unwrap();
    let exe = bin.path().join("vllm-warden");
    std::fs::copy(common::exe(), &exe).unwrap();
    let front = common::free_port();
    let listen = vec![format!("127.0.0.1:{front}")];
    let opts = Opts { exe: Some(exe.clone()), ..Opts::default() };
    let mut w = Warden::start_with(|d, p| front_config(d, p, &listen), opts);
    w.wait_ready();
    let before = listening_tcp(front).unwrap();
    let real = bin.path().join("real");
    std::fs::copy(common::exe(), &real).unwrap();
    let script = format!(
        "#!/bin/sh\nif [ \"$1\" = --version ]; then exec {real} --version; fi\necho garbage > \"$VLLM_WARDEN_UPGRADE_STATE\"\nexec {real} \"$@\"\n",
        real = real.display()
    );
    let new = bin.path().join("script");
    std::fs::write(&new, script).unwrap();
    std::fs::set_permissions(&new, std::fs::Permissions::from_mode(0o755)).unwrap();
    std::fs::rename(&new, &exe).unwrap();
    w.ask_upgrade(&real);
    w.wait_ready_within(TIMEOUT, "READY=1 of the start after a refused upgrade");
    w.wait_logged("the upgrade's state is unusable (");
    let log = w.stderr();
    assert!(log.contains("the upgrade's state is unusable ("), "{log}");
    assert!(log.contains(&format!("listening on 127.0.0.1:{front} (kept across the upgrade)")), "{log}");
    assert_eq!(listening_tcp(front), Some(before), "the same socket listens");
    connects_tcp(&format!("127.0.0.1:{front}")).unwrap();
    assert_eq!(w.stop(), 0);
}

/// `check` says before any start what would stop the front door: a unix
/// socket's path that holds another kind of file, or whose folder is
/// missing.
#[test]
fn check_names_a_unix_path_the_front_door_cannot_use() {
    let d = common::tempdir();
    let file = d.path().join("file.sock");
    std::fs::write(&file, "").unwrap();
    let missing = d.path().join("no-such-folder/front.sock");
    let cfg = d.path().join("t.toml");
    let listen = vec![format!("unix:{}", file.display()), format!("unix:{}", missing.display())];
    std::fs::write(&cfg, front_config(d.path(), common::free_port(), &listen)).unwrap();
    let out = std::process::Command::new(common::exe())
        .args(["check", "-c"])
        .arg(&cfg)
        .env("STATE_DIRECTORY", d.path())
        .output()
        .unwrap();
    let text = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    assert_eq!(out.status.code(), Some(78), "{text}");
    assert!(text.contains(&format!("front.listen unix:{}: a file that is not a socket", file.display())), "{text}");
    assert!(text.contains(&format!("front.listen unix:{}: its folder does not exist", missing.display())), "{text}");
}
