//! Real-process harness: the real `vllm-warden` binary supervising the fake
//! vLLM, with a `UnixDatagram` standing in for systemd's notify socket.
//! Every wait is on an event (a datagram, a process exit) under a deadline:
//! `TIMEOUT` for the fake vLLM, or a budget given by the caller (`*_within`);
//! nothing sleeps to wait for a condition. A wait that expires says which
//! wait it was, how long it was, and what the warden had said and written.
#![allow(dead_code)]

pub mod http;
pub mod real;
#[path = "../support/sim.rs"]
mod sim_path;

use std::os::unix::net::UnixDatagram;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

/// Long enough for a loaded CI machine; a passing test never waits for it.
pub const TIMEOUT: Duration = Duration::from_secs(60);

/// How much longer a warden's exit is waited for when a reap of its is
/// held in the kernel (on kernel 6.18, seen for 15 s to minutes).
pub const REAP_HOLD: Duration = Duration::from_secs(300);

pub fn exe() -> &'static str {
    env!("CARGO_BIN_EXE_vllm-warden")
}

/// The simulated vLLM, beside the warden (its own package of the workspace).
pub fn sim() -> &'static str {
    static SIM: std::sync::OnceLock<String> = std::sync::OnceLock::new();
    SIM.get_or_init(|| sim_path::beside(exe()).display().to_string())
}

pub fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port()
}

pub struct Warden {
    pub dir: tempfile::TempDir,
    /// How the next [`Warden::spawn`] starts it.
    pub opts: Opts,
    notify_socket: String,
    /// Lines of the notify socket, read as they come by a thread (as
    /// systemd does: a sender must never find the queue full).
    lines: mpsc::Receiver<String>,
    pub child: Option<Child>,
    pub pid: u32,
    /// Every notification so far, one line each (`READY=1`, `STATUS=…`).
    pub notes: Vec<String>,
    /// Notes before this index were consumed by an earlier wait.
    cursor: usize,
    exit: Option<mpsc::Receiver<i32>>,
    pub port: u16,
    /// The read end of an unread stderr pipe, kept open.
    unread: Option<std::os::fd::OwnedFd>,
}

/// A config whose command is the fake vLLM with `fake_args`; `extra` is
/// appended (more sections).
pub fn config(dir: &Path, port: u16, fake_args: &[&str], child_extra: &str, extra: &str) -> String {
    let mut argv = vec![sim().to_string(), "--port".into(), port.to_string()];
    argv.extend(fake_args.iter().map(|s| s.to_string()));
    let argv: Vec<String> = argv.iter().map(|a| format!("{a:?}")).collect();
    format!(
        "name = \"t\"\n[child]\ncommand = [{}]\nlog-file = \"{d}/t.log\"\n{child_extra}\n[status]\nfile = \"{d}/status.json\"\nmetrics-file = \"{d}/vllm_warden.prom\"\n{extra}\n",
        argv.join(", "),
        d = dir.display()
    )
}

/// How the warden's notify socket is set up.
#[derive(Debug, Clone, Default)]
pub struct Opts {
    /// Written into the state directory before the warden starts.
    pub state_files: Vec<(String, String)>,
    /// Bind an abstract socket (`@name`) instead of a path.
    pub abstract_socket: bool,
    /// More environment for the warden.
    pub env: Vec<(String, String)>,
    /// Start the warden with SIGTERM and SIGINT blocked.
    pub blocked_signals: bool,
    /// A command that runs the warden (`unshare … vllm-warden run …`);
    /// `pid` is then the wrapper's.
    pub wrapper: Vec<String>,
    /// More arguments of `run`.
    pub run_args: Vec<String>,
    /// Run this binary instead of the one cargo built.
    pub exe: Option<std::path::PathBuf>,
    /// The warden's descriptor limit (`RLIMIT_NOFILE`, soft and hard).
    pub nofile: Option<u64>,
    /// The warden's stderr is a pipe of one page that nobody reads (a log
    /// collector that stopped reading) instead of `warden.stderr`.
    pub stderr_unread: bool,
    /// Descriptors of the test's, given to the warden as descriptors 3, 4, …
    /// as systemd passes sockets (the test sets `LISTEN_FDS` and the rest).
    pub listen_fds: Vec<std::os::fd::RawFd>,
    /// Where the notifications that carry descriptors (`FDSTORE=1`) go,
    /// with the descriptors, as systemd receives them.
    pub notify_fds: Option<mpsc::Sender<(String, Vec<std::os::fd::OwnedFd>)>>,
    /// Leave the host's own `journalctl` and `nvidia-smi` to the warden.
    /// Without it, [`HOST_STUBS`] stand first in its `PATH`.
    pub host_tools: bool,
}

/// What the warden would ask of the host by default, answered as on a
/// machine without journald or GPUs, so that no test depends on the host it
/// runs on: `journalctl` (its kernel-message follower, `journalctl -k -f`:
/// on a host with journald every warden would see the kernel lines another
/// test writes to `/dev/kmsg`, and re-check) waits and says nothing, as it
/// does without a journal; `nvidia-smi` (the GPU query before a start and
/// the instance's GPU addresses: on a GPU host real addresses that no
/// test's fake Xid line names, and a busy GPU holding every start for
/// `gpu-idle-wait`) answers no GPU. The follower waits in a shell of its
/// own name (a `read` on a fifo nobody writes), with no child: the harness
/// tells it from the child's tree by its name. A test that sets its own
/// kernel source or GPU query in its config is not touched by them. Made in
/// each test's folder (`host-stubs/`).
pub const HOST_STUBS: [(&str, &str); 2] = [
    (
        "journalctl",
        "#!/bin/sh\n# Stands in for the host's journalctl (see tests/common/mod.rs).\n\
         for a in \"$@\"; do\n  case $a in -f|--follow) read -r _ <> \"${0%/*}/never\"; exit 0;; esac\ndone\nexit 0\n",
    ),
    ("nvidia-smi", "#!/bin/sh\n# Stands in for the host's nvidia-smi (see tests/common/mod.rs): no GPU.\nexit 0\n"),
];

/// [`HOST_STUBS`] in `dir` (made once), with the fifo the follower waits on.
fn host_stubs(dir: &Path) {
    use std::os::unix::fs::PermissionsExt;
    if dir.exists() {
        return;
    }
    std::fs::create_dir_all(dir).unwrap();
    for (name, text) in HOST_STUBS {
        let p = dir.join(name);
        std::fs::write(&p, text).unwrap();
        std::fs::set_permissions(&p, std::fs::Permissions::from_mode(0o755)).unwrap();
    }
    nix::unistd::mkfifo(&dir.join("never"), nix::sys::stat::Mode::from_bits_truncate(0o600)).unwrap();
}

/// The longest folder of a test's files: within it go sockets whose paths
/// have limits of their own (`preload.socket-dir` `DIR/wc`, at most 64
/// bytes; vLLM's sockets folder `DIR/run/vllm-ipc`, at most 70, else the
/// warden leaves it unset; `DIR/notify.sock` and `DIR/run/control.sock`
/// within `sun_path`'s 107).
pub const MAX_DIR: usize = 57;

/// A new temporary folder for a test's files: in the usual temporary
/// folder (`TMPDIR`), or in `/tmp` when a path there would be longer than
/// [`MAX_DIR`] (a deep `TMPDIR`, as some CI runners and `pam_tmpdir` set).
pub fn tempdir() -> tempfile::TempDir {
    let dir = tempfile::tempdir().unwrap();
    if dir.path().as_os_str().len() <= MAX_DIR {
        return dir;
    }
    tempfile::tempdir_in("/tmp").unwrap()
}

/// One datagram of the notify socket, with the descriptors it carries.
fn recv_with_fds(sock: &UnixDatagram, buf: &mut [u8]) -> std::io::Result<(usize, Vec<std::os::fd::OwnedFd>)> {
    use nix::sys::socket::{ControlMessageOwned, MsgFlags, recvmsg};
    use std::os::fd::{AsRawFd, FromRawFd};
    let mut iov = [std::io::IoSliceMut::new(buf)];
    let mut space = nix::cmsg_space!([std::os::fd::RawFd; 16]);
    let msg = recvmsg::<()>(sock.as_raw_fd(), &mut iov, Some(&mut space), MsgFlags::MSG_CMSG_CLOEXEC)?;
    let mut fds = Vec::new();
    for c in msg.cmsgs()? {
        if let ControlMessageOwned::ScmRights(got) = c {
            // SAFETY: the kernel just gave these descriptors to this process.
            fds.extend(got.into_iter().map(|fd| unsafe { std::os::fd::OwnedFd::from_raw_fd(fd) }));
        }
    }
    Ok((msg.bytes, fds))
}

impl Warden {
    /// Start `vllm-warden run` on a config made by `make(dir, port)`.
    pub fn start(make: impl FnOnce(&Path, u16) -> String) -> Warden {
        Warden::start_with(make, Opts::default())
    }

    pub fn start_with(make: impl FnOnce(&Path, u16) -> String, opts: Opts) -> Warden {
        let dir = tempdir();
        let port = free_port();
        let cfg = dir.path().join("t.toml");
        std::fs::write(&cfg, make(dir.path(), port)).unwrap();
        std::fs::create_dir_all(dir.path().join("state")).unwrap();
        for (name, text) in &opts.state_files {
            std::fs::write(dir.path().join("state").join(name), text).unwrap();
        }
        let (sock, notify_socket) = if opts.abstract_socket {
            use std::os::linux::net::SocketAddrExt;
            let name = format!("vllm-warden-test-{}-{port}", std::process::id());
            let addr = std::os::unix::net::SocketAddr::from_abstract_name(name.as_bytes()).unwrap();
            (UnixDatagram::bind_addr(&addr).unwrap(), format!("@{name}"))
        } else {
            let path = dir.path().join("notify.sock");
            (UnixDatagram::bind(&path).unwrap(), path.to_str().unwrap().to_string())
        };
        let (tx, lines) = mpsc::channel();
        let fds_tx = opts.notify_fds.clone();
        std::thread::spawn(move || {
            let mut buf = vec![0u8; 65536];
            while let Ok((n, fds)) = recv_with_fds(&sock, &mut buf) {
                let text = String::from_utf8_lossy(&buf[..n]).into_owned();
                if let (Some(fds_tx), false) = (&fds_tx, fds.is_empty()) {
                    let _ = fds_tx.send((text.clone(), fds));
                }
                for line in text.lines() {
                    if tx.send(line.to_string()).is_err() {
                        return;
                    }
                }
            }
        });
        let mut w = Warden {
            dir,
            opts,
            notify_socket,
            lines,
            child: None,
            pid: 0,
            notes: Vec::new(),
            cursor: 0,
            exit: None,
            port,
            unread: None,
        };
        w.spawn();
        w
    }

    /// Start a warden on this instance's config, state and notify socket
    /// (again, after the last one exited or was killed).
    pub fn spawn(&mut self) {
        self.exit = None;
        let cfg = self.path("t.toml");
        let opts = &self.opts;
        let stderr: Stdio = if self.opts.stderr_unread {
            let (read, write) = nix::unistd::pipe().unwrap();
            // One page: a few events fill it.
            // SAFETY: fcntl on a descriptor we own.
            unsafe { libc::fcntl(std::os::fd::AsRawFd::as_raw_fd(&write), libc::F_SETPIPE_SZ, 4096) };
            self.unread = Some(read);
            std::fs::File::from(write).into()
        } else {
            std::fs::OpenOptions::new().create(true).append(true).open(self.path("warden.stderr")).unwrap().into()
        };
        let warden = opts.exe.as_deref().unwrap_or(Path::new(exe()));
        let mut cmd = match opts.wrapper.split_first() {
            Some((first, rest)) => {
                let mut c = Command::new(first);
                c.args(rest).arg(warden);
                c
            }
            None => Command::new(warden),
        };
        cmd.arg("run")
            .args(&opts.run_args)
            .arg("-c")
            .arg(&cfg)
            .env("NOTIFY_SOCKET", &self.notify_socket)
            .envs(opts.env.clone())
            .env("STATE_DIRECTORY", self.path("state"))
            // The control socket's folder: one per test, not /run.
            .env("RUNTIME_DIRECTORY", self.path("run"))
            .env_remove("JOURNAL_STREAM")
            .env("RUST_LOG", "debug")
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(stderr);
        if !opts.host_tools {
            // Before the test's own PATH, if it sets one.
            let stubs = self.path("host-stubs");
            host_stubs(&stubs);
            let path = opts.env.iter().rev().find(|(k, _)| k == "PATH").map(|(_, v)| v.clone());
            let path = path.or_else(|| std::env::var("PATH").ok()).unwrap_or_default();
            cmd.env("PATH", format!("{}:{path}", stubs.display()));
        }
        if opts.blocked_signals {
            use std::os::unix::process::CommandExt;
            // SAFETY: only sigprocmask between fork and exec.
            unsafe {
                cmd.pre_exec(|| {
                    let mut set = nix::sys::signal::SigSet::empty();
                    set.add(nix::sys::signal::Signal::SIGTERM);
                    set.add(nix::sys::signal::Signal::SIGINT);
                    let _ = set.thread_set_mask();
                    Ok(())
                });
            }
        }
        if !opts.listen_fds.is_empty() {
            use std::os::unix::process::CommandExt;
            let fds = opts.listen_fds.clone();
            // SAFETY: only fcntl and dup2 between fork and exec.
            unsafe {
                cmd.pre_exec(move || {
                    // Out of the way first, then to 3, 4, … (a source may be
                    // one of those numbers), open across the exec.
                    let mut high = Vec::new();
                    for &fd in &fds {
                        let h = libc::fcntl(fd, libc::F_DUPFD, 100);
                        if h < 0 {
                            return Err(std::io::Error::last_os_error());
                        }
                        high.push(h);
                    }
                    for (i, &h) in high.iter().enumerate() {
                        if libc::dup2(h, 3 + i as i32) < 0 {
                            return Err(std::io::Error::last_os_error());
                        }
                        libc::close(h);
                    }
                    Ok(())
                });
            }
        }
        if let Some(n) = opts.nofile {
            use std::os::unix::process::CommandExt;
            // SAFETY: only setrlimit between fork and exec.
            unsafe {
                cmd.pre_exec(move || {
                    let lim = libc::rlimit { rlim_cur: n, rlim_max: n };
                    if libc::setrlimit(libc::RLIMIT_NOFILE, &lim) != 0 {
                        return Err(std::io::Error::last_os_error());
                    }
                    Ok(())
                });
            }
        }
        let child = cmd.spawn().unwrap();
        self.pid = child.id();
        self.child = Some(child);
    }

    pub fn path(&self, name: &str) -> PathBuf {
        self.dir.path().join(name)
    }

    /// Wait for the next notification (after those consumed by earlier
    /// waits) that satisfies `pred`; returns it.
    pub fn wait_note(&mut self, what: &str, pred: impl Fn(&str) -> bool) -> String {
        self.wait_note_within(TIMEOUT, what, pred)
    }

    /// `wait_note` with a deadline of `budget`.
    pub fn wait_note_within(&mut self, budget: Duration, what: &str, pred: impl Fn(&str) -> bool) -> String {
        if let Some(i) = self.notes[self.cursor..].iter().position(|n| pred(n)) {
            self.cursor += i + 1;
            return self.notes[self.cursor - 1].clone();
        }
        let start = Instant::now();
        let deadline = start + budget;
        loop {
            let now = Instant::now();
            if now >= deadline {
                break;
            }
            // Wake up now and then to notice a warden that died.
            match self.lines.recv_timeout((deadline - now).min(Duration::from_millis(250))) {
                Ok(line) => {
                    self.notes.push(line);
                    if pred(self.notes.last().unwrap()) {
                        self.cursor = self.notes.len();
                        return self.notes[self.cursor - 1].clone();
                    }
                }
                Err(mpsc::RecvTimeoutError::Timeout) => {
                    if let Some(code) = self.try_exit() {
                        self.drain_notes();
                        panic!(
                            "warden exited with {code} after {} while waiting for {what} (budget {}){}",
                            secs(start.elapsed()),
                            secs(budget),
                            self.seen()
                        );
                    }
                }
                Err(e) => panic!("notify socket: {e}"),
            }
        }
        panic!("timed out after {} waiting for {what}{}", secs(budget), self.seen());
    }

    /// Wait for the next `READY=1`.
    pub fn wait_ready(&mut self) {
        self.wait_ready_within(TIMEOUT, "READY=1");
    }

    /// Wait for the next `READY=1` for at most `budget`; `what` names the
    /// wait in a failure message.
    pub fn wait_ready_within(&mut self, budget: Duration, what: &str) {
        self.wait_note_within(budget, what, |n| n == "READY=1");
    }

    /// What the warden has said and written so far, for a failure message:
    /// its last notifications, the tail of its stderr and of the child's log.
    pub fn seen(&mut self) -> String {
        while let Ok(line) = self.lines.try_recv() {
            self.notes.push(line);
        }
        let skipped = self.notes.len().saturating_sub(SEEN_NOTES);
        format!(
            "\n--- last {} of {} notifications\n{}\n--- warden stderr above DEBUG, last lines\n{}\n--- {}, last lines\n{}",
            self.notes.len() - skipped,
            self.notes.len(),
            self.notes[skipped..].join("\n"),
            tail(&above_debug(&self.stderr()), SEEN_LINES),
            self.path("t.log").display(),
            tail(&self.log(), SEEN_LINES)
        )
    }

    pub fn stderr(&self) -> String {
        std::fs::read_to_string(self.path("warden.stderr")).unwrap_or_default()
    }

    pub fn log(&self) -> String {
        std::fs::read_to_string(self.path("t.log")).unwrap_or_default()
    }

    fn watch_exit(&mut self) {
        if self.exit.is_none()
            && let Some(mut child) = self.child.take()
        {
            let (tx, rx) = mpsc::channel();
            std::thread::spawn(move || {
                let code = child.wait().map(|s| s.code().unwrap_or(-1)).unwrap_or(-1);
                let _ = tx.send(code);
            });
            self.exit = Some(rx);
        }
    }

    fn try_exit(&mut self) -> Option<i32> {
        self.watch_exit();
        self.exit.as_ref().and_then(|rx| rx.try_recv().ok())
    }

    /// Wait for the warden to exit; returns its exit code.
    pub fn wait_exit(&mut self) -> i32 {
        self.wait_exit_within(TIMEOUT, "the warden's exit")
    }

    /// Wait for the warden to exit for at most `budget` (and at most
    /// [`REAP_HOLD`] more if it said a reap of its is held in the kernel);
    /// `what` names the wait in a failure message. Returns the exit code.
    pub fn wait_exit_within(&mut self, budget: Duration, what: &str) -> i32 {
        self.wait_exit_for(budget, what, true)
    }

    /// Wait for the warden to exit for at most `budget`, however long a
    /// reap of its is held: for a test of the stop's own bounds.
    pub fn wait_exit_strictly_within(&mut self, budget: Duration, what: &str) -> i32 {
        self.wait_exit_for(budget, what, false)
    }

    fn wait_exit_for(&mut self, budget: Duration, what: &str, reap_may_hold: bool) -> i32 {
        self.watch_exit();
        let mut exit = self.exit.as_ref().unwrap().recv_timeout(budget);
        if exit.is_err() && reap_may_hold && self.stderr().contains("EVENT=\"reap\"") {
            // A reap of the warden's still in the kernel holds its exit (a
            // process ends only when none of its threads is in a system
            // call); the warden said so. The kernel's time, not the warden's.
            eprintln!("{what}: held by a reap still in the kernel; waiting up to {} more", secs(REAP_HOLD));
            exit = self.exit.as_ref().unwrap().recv_timeout(REAP_HOLD);
        }
        match exit {
            Ok(code) => {
                self.drain_notes();
                // What the warden says of its loop at its exit, for the
                // tests that print their figures.
                if let Some(l) = self.stderr().lines().rev().find(|l| l.contains("the loop's longest turn")) {
                    eprintln!("warden exit {code}: {}", l.trim());
                }
                code
            }
            Err(_) => panic!(
                "timed out after {} waiting for {what}: the warden is still running{}",
                secs(budget),
                self.seen()
            ),
        }
    }

    /// Collect notifications already sent (the warden has exited).
    pub fn drain_notes(&mut self) {
        while let Ok(line) = self.lines.recv_timeout(Duration::from_millis(100)) {
            self.notes.push(line);
        }
    }

    pub fn signal(&self, sig: nix::sys::signal::Signal) {
        nix::sys::signal::kill(nix::unistd::Pid::from_raw(self.pid as i32), sig).unwrap();
    }

    /// Stop with SIGTERM, as systemd does; returns the exit code.
    pub fn stop(&mut self) -> i32 {
        self.stop_within(TIMEOUT, "the warden's exit after SIGTERM")
    }

    /// `stop`, waiting for the exit for at most `budget`.
    pub fn stop_within(&mut self, budget: Duration, what: &str) -> i32 {
        self.signal(nix::sys::signal::Signal::SIGTERM);
        self.wait_exit_within(budget, what)
    }

    /// `vllm-warden COMMAND -c CONFIG ARGS…` on this instance's config and
    /// state, as an operator runs it: whether it exited 0, and its stdout.
    pub fn cli(&self, args: &[&str]) -> (bool, String) {
        let out = self.command(args[0]).args(&args[1..]).output().unwrap();
        let text = String::from_utf8_lossy(&out.stdout).into_owned();
        if !out.status.success() {
            eprintln!("vllm-warden {}: {}", args.join(" "), String::from_utf8_lossy(&out.stderr));
        }
        (out.status.success(), text)
    }

    /// `vllm-warden COMMAND -c CONFIG` on this instance, in its unit's
    /// environment: its state and runtime folders (without the latter a
    /// command asks `/run/vllm-warden/t/control.sock`, which another test's
    /// warden of the same name may hold). More arguments may follow.
    pub fn command(&self, what: &str) -> Command {
        self.command_of(Path::new(exe()), what)
    }

    /// [`Warden::command`] with another binary.
    pub fn command_of(&self, exe: &Path, what: &str) -> Command {
        let mut c = Command::new(exe);
        c.arg(what)
            .arg("-c")
            .arg(self.path("t.toml"))
            .env("STATE_DIRECTORY", self.path("state"))
            .env("RUNTIME_DIRECTORY", self.path("run"));
        c
    }

    /// `EXE upgrade` on this instance, as an operator runs it: exit 0.
    pub fn ask_upgrade(&self, exe: &Path) {
        let out = self.command_of(exe, "upgrade").output().unwrap();
        assert_eq!(out.status.code(), Some(0), "{}", String::from_utf8_lossy(&out.stderr));
    }

    /// Live descendants of the warden that belong to the child's tree: the
    /// warden's own helper (its kernel-message follower, `journalctl`) left
    /// out, as the warden leaves it out.
    pub fn descendants(&self) -> Vec<vllm_warden::process::child::ProcStat> {
        vllm_warden::process::child::descendants(self.pid as i32)
            .into_iter()
            .filter(|p| {
                std::fs::read_to_string(format!("/proc/{}/comm", p.pid)).map_or(true, |c| c.trim() != "journalctl")
            })
            .collect()
    }

    /// Wait (on inotify) until `done` holds for the file `name` of this
    /// instance's folder; on a timeout, says what the warden said.
    pub fn wait_for_file(&mut self, name: &str, done: impl Fn(&Warden) -> bool) {
        let path = self.path(name);
        let waited = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| wait_for_file(&path, || done(self))));
        if waited.is_err() {
            panic!("gave up waiting for {name}{}", self.seen());
        }
    }

    /// Wait (on inotify, under one generous deadline) until the warden has
    /// logged `what`: its lines reach stderr through its log's writer
    /// thread, a moment after the notification that follows them.
    pub fn wait_logged(&mut self, what: &str) {
        self.wait_for_file("warden.stderr", |w| w.stderr().contains(what));
    }

    pub fn statuses(&self) -> Vec<&str> {
        self.notes.iter().filter_map(|n| n.strip_prefix("STATUS=")).collect()
    }
}

impl Drop for Warden {
    fn drop(&mut self) {
        // A failed test must leave neither the warden nor the fake's tree
        // behind. A warden still running (not yet reaped: the thread that
        // waits for it has sent nothing) is frozen first, so that it starts
        // no new child while its tree is killed, then killed itself.
        use nix::sys::signal::{Signal, kill};
        let pid = nix::unistd::Pid::from_raw(self.pid as i32);
        let running = self.child.is_some()
            || self.exit.as_ref().is_some_and(|rx| matches!(rx.try_recv(), Err(mpsc::TryRecvError::Empty)));
        if running {
            let _ = kill(pid, Signal::SIGSTOP);
        }
        for p in self.descendants() {
            let _ = kill(nix::unistd::Pid::from_raw(p.pid), Signal::SIGKILL);
        }
        if running {
            let _ = kill(pid, Signal::SIGKILL);
        }
        if let Some(mut c) = self.child.take() {
            let _ = c.wait();
        }
    }
}

/// How many notifications and lines of output a failure message shows.
const SEEN_NOTES: usize = 20;
const SEEN_LINES: usize = 30;

/// The last `n` lines of `text`.
fn tail(text: &str, n: usize) -> String {
    let lines: Vec<&str> = text.lines().collect();
    lines[lines.len().saturating_sub(n)..].join("\n")
}

/// The lines of the warden's stderr that are not at DEBUG or TRACE level.
fn above_debug(text: &str) -> String {
    let low = |l: &str| matches!(l.split_whitespace().nth(1), Some("DEBUG" | "TRACE"));
    text.lines().filter(|l| !low(l)).collect::<Vec<_>>().join("\n")
}

/// A duration for a message: whole seconds from 10 s up (`4m 20s`), else
/// milliseconds.
pub fn secs(d: Duration) -> String {
    let d = if d >= Duration::from_secs(10) {
        Duration::from_secs(d.as_secs())
    } else {
        Duration::from_millis(d.as_millis() as u64)
    };
    humantime::format_duration(d).to_string()
}

/// Wait (on inotify, under one generous deadline) until `done` holds for
/// the file at `path`.
pub fn wait_for_file(path: &Path, done: impl Fn() -> bool) {
    wait_for_file_within(TIMEOUT, path, done)
}

/// [`wait_for_file`] under the deadline `budget`.
pub fn wait_for_file_within(budget: Duration, path: &Path, done: impl Fn() -> bool) {
    wait_for(budget, path, &done)
}

fn wait_for(budget: Duration, path: &Path, done: &dyn Fn() -> bool) {
    use notify::Watcher;
    let start = Instant::now();
    // A folder that is not there yet (made by the warden later): wait for
    // it first, in its own parent. `done` is checked once the watch is on,
    // before any wait: nothing made in between is missed.
    let parent = path.parent().unwrap();
    if !parent.exists() && !done() {
        wait_for(budget, parent, &|| parent.exists() || done());
    }
    if done() {
        return;
    }
    let budget = budget.saturating_sub(start.elapsed());
    let (tx, rx) = mpsc::channel();
    // Held here so that the wait below waits, with or without a watcher.
    let _held = tx.clone();
    let watcher = notify::recommended_watcher(move |_| {
        let _ = tx.send(());
    })
    .and_then(|mut w| w.watch(path.parent().unwrap(), notify::RecursiveMode::NonRecursive).map(|()| w));
    // A watcher is an inotify instance, and a user has
    // `fs.inotify.max_user_instances` of them (128 by default) for all
    // its processes: on a many-core host running as many tests at once,
    // with the wardens' own, they run out. Then the file is looked at
    // every 50 ms instead.
    let poll = match &watcher {
        Ok(_) => None,
        Err(e) => {
            eprintln!("no inotify watch on {} ({e}): looking every 50 ms", path.display());
            Some(Duration::from_millis(50))
        }
    };
    let deadline = Instant::now() + budget;
    while !done() {
        let left = deadline.saturating_duration_since(Instant::now());
        assert!(!left.is_zero(), "timed out after {} waiting for {}", secs(budget), path.display());
        let _ = rx.recv_timeout(poll.map_or(left, |p| p.min(left)));
    }
    drop(watcher);
}

/// The number of descriptors `pid` has open.
pub fn open_fds(pid: u32) -> usize {
    std::fs::read_dir(format!("/proc/{pid}/fd")).map(|d| d.count()).unwrap_or(0)
}

/// The resident memory of `pid`, in KiB (`VmRSS`).
pub fn rss_kib(pid: u32) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap_or_default();
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.split_whitespace().next())
        .and_then(|v| v.parse().ok())
        .unwrap_or(0)
}

/// True when `pid` with this start time is gone (or only a zombie).
pub fn gone(p: &vllm_warden::process::child::ProcStat) -> bool {
    match vllm_warden::process::child::read_stat(p.pid) {
        None => true,
        Some(now) => now.start_time != p.start_time || now.state == 'Z',
    }
}
