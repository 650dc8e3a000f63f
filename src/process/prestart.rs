//! What must hold before every start, each found through `/proc` and never
//! by process name: no leftover tree of an earlier warden, no stale shared
//! memory, a free port, idle GPUs. The state machine is not known here; the
//! driver runs these steps in order and reports them.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::io;
use std::os::fd::{FromRawFd, OwnedFd};
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::sync::{Arc, LazyLock, Mutex};
use std::time::Duration;

use nix::sys::signal::Signal;
use serde::{Deserialize, Serialize};

use crate::process::child::{ProcStat, descendants, read_stat};
use crate::util::fsutil::replace;

/// One process of the child's tree, as recorded in the state directory.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Recorded {
    pub pid: i32,
    /// Clock ticks after boot: a recycled pid has another.
    pub start_time: u64,
}

/// The record: whose tree it is, on which boot, and the processes.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Record {
    /// `/proc/sys/kernel/random/boot_id`: start times mean nothing across boots.
    pub boot_id: String,
    /// The instance name: a record is never taken for another instance's.
    pub instance: String,
    /// The run token the warden put in its children's environment
    /// ([`RUN_TOKEN`]): a process is taken for a leftover only if its own
    /// environment holds it, which no record can forge.
    pub token: String,
    pub tree: Vec<Recorded>,
}

/// The environment variable that marks the warden's children as its own.
pub const RUN_TOKEN: &str = "VLLM_WARDEN_RUN_TOKEN";

/// A new run token: 128 random bits from the kernel, in hex.
pub fn new_run_token() -> io::Result<String> {
    use std::io::Read;
    let mut b = [0u8; 16];
    std::fs::File::open("/dev/urandom")?.read_exact(&mut b)?;
    Ok(b.iter().map(|x| format!("{x:02x}")).collect())
}

/// True when `pid`'s environment holds `RUN_TOKEN=token`.
fn carries_token(pid: i32, token: &str) -> bool {
    let want = format!("{RUN_TOKEN}={token}");
    std::fs::read(format!("/proc/{pid}/environ"))
        .is_ok_and(|env| env.split(|b| *b == 0).any(|kv| kv == want.as_bytes()))
}

/// The state directory belongs to the service user (the child's uid): a
/// record larger than this is not ours.
const MAX_RECORD: u64 = 1 << 20;

fn record_path(state_dir: &Path) -> PathBuf {
    state_dir.join("tree.json")
}

pub fn boot_id() -> String {
    std::fs::read_to_string("/proc/sys/kernel/random/boot_id").map(|s| s.trim().to_string()).unwrap_or_default()
}

/// Write the warden's live descendants (the child's tree) to the state
/// directory, so that a warden started after this one was killed can find
/// them.
pub fn record_tree(state_dir: &Path, instance: &str, token: &str) -> io::Result<()> {
    let tree: Vec<Recorded> = descendants(std::process::id() as i32)
        .into_iter()
        .map(|p| Recorded { pid: p.pid, start_time: p.start_time })
        .collect();
    std::fs::create_dir_all(state_dir)?;
    let record = Record { boot_id: boot_id(), instance: instance.to_string(), token: token.to_string(), tree };
    let text = serde_json::to_string(&record).map_err(io::Error::other)?;
    replace(&record_path(state_dir), text.as_bytes(), 0o600)
}

/// The tree is gone: forget it.
pub fn clear_record(state_dir: &Path) {
    let _ = std::fs::remove_file(record_path(state_dir));
}

/// Read a small regular file of the state directory, never following a
/// symlink and never blocking on a FIFO or a device.
pub fn read_state_file(path: &Path, max: u64) -> io::Result<Vec<u8>> {
    use std::io::Read;
    use std::os::unix::fs::OpenOptionsExt;
    let file = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NOFOLLOW | libc::O_NONBLOCK | libc::O_CLOEXEC)
        .open(path)?;
    let meta = file.metadata()?;
    if !meta.is_file() {
        return Err(io::Error::new(io::ErrorKind::InvalidData, "not a regular file"));
    }
    if meta.len() > max {
        return Err(io::Error::new(io::ErrorKind::InvalidData, format!("larger than {max} bytes")));
    }
    let mut out = Vec::new();
    file.take(max).read_to_end(&mut out)?;
    Ok(out)
}

/// Processes that may never be signalled as leftovers, whatever a record
/// says: pid 1, the warden itself and each of its ancestors.
fn protected() -> BTreeSet<i32> {
    let mut out = BTreeSet::from([1, std::process::id() as i32]);
    let mut pid = std::process::id() as i32;
    while let Some(st) = read_stat(pid) {
        if st.ppid <= 0 || !out.insert(st.ppid) {
            break;
        }
        pid = st.ppid;
    }
    out
}

/// Our own unit's cgroup, when the warden runs as a systemd service: the
/// only place its leftovers can be.
fn own_service_cgroup() -> Option<String> {
    std::env::var_os("INVOCATION_ID")?;
    let cg = cgroup_of(std::process::id() as i32)?;
    cg.ends_with(".service").then_some(cg)
}

fn cgroup_of(pid: i32) -> Option<String> {
    let text = std::fs::read_to_string(format!("/proc/{pid}/cgroup")).ok()?;
    // cgroup v2: "0::/system.slice/x.service"
    text.lines().find_map(|l| l.strip_prefix("0::")).map(str::to_string)
}

/// Recorded processes still alive with the same start time, and their live
/// descendants (whatever their group or session). The record is trusted
/// for nothing: it must be this boot's and this instance's, and each
/// process must carry the recorded run token in its own environment; a pid
/// now used by another process, a process of another user, one outside the
/// unit's cgroup (under systemd), pid 1, the warden and its ancestors are
/// left out.
pub fn leftovers(state_dir: &Path, instance: &str) -> Vec<ProcStat> {
    let path = record_path(state_dir);
    let text = match read_state_file(&path, MAX_RECORD) {
        Ok(t) => t,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Vec::new(),
        Err(e) => {
            tracing::warn!(file = %path.display(), error = %e, "tree record ignored");
            return Vec::new();
        }
    };
    let record: Record = match serde_json::from_slice(&text) {
        Ok(r) => r,
        Err(e) => {
            tracing::warn!(file = %path.display(), error = %e, "tree record ignored: not a record");
            return Vec::new();
        }
    };
    if record.boot_id != boot_id() || record.instance != instance {
        tracing::info!(file = %path.display(), "tree record of another boot or instance ignored");
        return Vec::new();
    }
    let protected = protected();
    let uid = nix::unistd::geteuid().as_raw();
    let cgroup = own_service_cgroup();
    let token = record.token.as_str();
    let ours = |p: &ProcStat| {
        !protected.contains(&p.pid)
            && !token.is_empty()
            && carries_token(p.pid, token)
            && std::fs::metadata(format!("/proc/{}", p.pid)).is_ok_and(|m| m.uid() == uid)
            && cgroup.as_ref().is_none_or(|cg| cgroup_of(p.pid).as_ref() == Some(cg))
    };
    let mut seen = BTreeSet::new();
    let mut out = Vec::new();
    for r in record.tree {
        let Some(st) = read_stat(r.pid) else { continue };
        if st.start_time != r.start_time || st.state == 'Z' || !ours(&st) {
            continue;
        }
        for p in std::iter::once(st).chain(descendants(r.pid)) {
            if ours(&p) && seen.insert(p.pid) {
                out.push(p);
            }
        }
    }
    out
}

/// The live processes of this warden's own tree before its first spawn:
/// only a predecessor that exec'd this warden (an upgrade) can have left
/// them, and they are provably that run's (this process is their parent or
/// subreaper). The warden's own helpers (a GPU query, the kernel-message
/// follower) are not running before the first spawn.
pub fn inherited_tree() -> Vec<ProcStat> {
    descendants(std::process::id() as i32).into_iter().filter(|p| p.state != 'Z').collect()
}

/// A process held by a pidfd: signals reach it and only it, and its exit
/// can be awaited, even though it is not our child.
struct PidFd {
    fd: tokio::io::unix::AsyncFd<OwnedFd>,
}

impl PidFd {
    /// Open a pidfd, and check that the pid still names the process `p`.
    fn open(p: &ProcStat) -> Option<PidFd> {
        // SAFETY: pidfd_open takes a pid and flags and returns a new fd.
        let fd = unsafe { libc::syscall(libc::SYS_pidfd_open, p.pid, 0) };
        if fd < 0 {
            return None;
        }
        // SAFETY: the syscall returned a new descriptor that we now own.
        let owned = unsafe { OwnedFd::from_raw_fd(fd as i32) };
        // Checked after opening: from now on the pidfd cannot be recycled.
        if read_stat(p.pid).map(|s| s.start_time) != Some(p.start_time) {
            return None;
        }
        // SAFETY: `owned` is an open pidfd, owned by the AsyncFd from here on.
        let fd = unsafe { tokio::io::unix::AsyncFd::register_with_interest(owned, tokio::io::Interest::READABLE) };
        Some(PidFd { fd: fd.ok()? })
    }

    fn signal(&self, sig: Signal) {
        use std::os::fd::AsRawFd;
        // SAFETY: pidfd_send_signal(fd, sig, NULL, 0).
        unsafe {
            libc::syscall(libc::SYS_pidfd_send_signal, self.fd.as_raw_fd(), sig as i32, std::ptr::null::<u8>(), 0);
        }
    }

    /// Returns when the process has exited (the pidfd becomes readable).
    async fn exited(&self) {
        let _ = self.fd.readable().await;
    }
}

/// Stop leftover processes as a stop does: `sig`, then SIGKILL after
/// `timeout`, then at most `kill_grace` more. `Err` lists the processes
/// still there (stuck in the kernel).
pub async fn stop_leftovers(
    procs: &[ProcStat],
    sig: Signal,
    timeout: Duration,
    kill_grace: Duration,
) -> Result<(), String> {
    let fds: Vec<PidFd> = procs.iter().filter_map(PidFd::open).collect();
    for f in &fds {
        f.signal(sig);
    }
    if tokio::time::timeout(timeout, all_exited(&fds)).await.is_ok() {
        return Ok(());
    }
    for f in &fds {
        f.signal(Signal::SIGKILL);
    }
    if tokio::time::timeout(kill_grace, all_exited(&fds)).await.is_ok() {
        return Ok(());
    }
    let left: Vec<String> = procs
        .iter()
        .filter(|p| read_stat(p.pid).is_some_and(|s| s.start_time == p.start_time && s.state != 'Z'))
        .map(|p| format!("pid {} (state {})", p.pid, read_stat(p.pid).map_or('?', |s| s.state)))
        .collect();
    Err(format!("leftover process(es) survived SIGKILL: {}", left.join(", ")))
}

async fn all_exited(fds: &[PidFd]) {
    for f in fds {
        f.exited().await;
    }
}

/// The files of `dir` that a live process has open or mapped, with the pids.
pub fn in_use_under(dir: &Path) -> HashMap<PathBuf, BTreeSet<i32>> {
    let files: Vec<PathBuf> =
        std::fs::read_dir(dir).map(|d| d.flatten().map(|e| e.path()).collect()).unwrap_or_default();
    in_use(&files)
}

/// A file's identity: device and inode.
fn identity(m: &std::fs::Metadata) -> (u64, u64) {
    (m.dev(), m.ino())
}

/// Those of `paths` that a live process has open or mapped, with the pids,
/// matched by identity (device and inode), not by name: a process maps a
/// POSIX semaphore under the temporary name it was created with
/// (`/dev/shm/sem.WUuiYZ (deleted)` in `/proc/PID/maps` for what is now
/// `/dev/shm/sem.mp-…`), and a renamed file keeps its inode. One pass over
/// `/proc`, none when no path names a regular file.
pub fn in_use(paths: &[PathBuf]) -> HashMap<PathBuf, BTreeSet<i32>> {
    let mut out: HashMap<PathBuf, BTreeSet<i32>> = HashMap::new();
    let ids: HashMap<(u64, u64), &PathBuf> = paths
        .iter()
        .filter_map(|p| std::fs::symlink_metadata(p).ok().filter(|m| m.is_file()).map(|m| (identity(&m), p)))
        .collect();
    if ids.is_empty() {
        return out;
    }
    for pid in crate::process::child::processes() {
        if let Ok(fds) = std::fs::read_dir(format!("/proc/{pid}/fd")) {
            for fd in fds.flatten() {
                // The magic link leads to the open file itself, renamed or not.
                if let Ok(m) = std::fs::metadata(fd.path())
                    && let Some(p) = ids.get(&identity(&m))
                {
                    out.entry((*p).clone()).or_default().insert(pid);
                }
            }
        }
        if let Ok(maps) = std::fs::read_to_string(format!("/proc/{pid}/maps")) {
            for line in maps.lines() {
                // address perms offset dev(major:minor, hex) inode path
                let mut f = line.split_whitespace();
                let (Some(dev), Some(ino)) = (f.nth(3), f.next()) else { continue };
                let Some((major, minor)) = dev.split_once(':') else { continue };
                let (Ok(major), Ok(minor), Ok(ino)) =
                    (u64::from_str_radix(major, 16), u64::from_str_radix(minor, 16), ino.parse::<u64>())
                else {
                    continue;
                };
                if ino == 0 {
                    continue;
                }
                let dev = nix::sys::stat::makedev(major, minor);
                if let Some(p) = ids.get(&(dev, ino)) {
                    out.entry((*p).clone()).or_default().insert(pid);
                }
            }
        }
    }
    out
}

/// The files of `dir` whose names match one of `globs`, sorted.
///
/// A folder listed without a match is not listed again while it is the same
/// folder with the same modification time: making, renaming or removing an
/// entry changes that time, and `/tmp` can hold thousands of entries that
/// would be read before every start. The time must be older than the
/// listing by [`UNCHANGED_MARGIN`], as file times advance in clock ticks:
/// an entry made in the tick of the listing could leave it the same.
pub fn candidates(dir: &Path, globs: &[String]) -> Vec<PathBuf> {
    let stamp = folder_stamp(dir);
    let unchanged =
        |cache: &Matchless| stamp.is_some_and(|s| cache.get(dir).is_some_and(|(was, g)| *was == s && g == globs));
    if unchanged(&MATCHLESS.lock().unwrap_or_else(|p| p.into_inner())) {
        return Vec::new();
    }
    let listed_at = std::time::SystemTime::now();
    let patterns: Vec<glob::Pattern> = globs.iter().filter_map(|g| glob::Pattern::new(g).ok()).collect();
    let Ok(entries) = std::fs::read_dir(dir) else { return Vec::new() };
    let mut paths: Vec<PathBuf> = entries
        .flatten()
        .filter(|e| e.file_name().to_str().is_some_and(|n| patterns.iter().any(|g| g.matches(n))))
        .map(|e| e.path())
        .collect();
    paths.sort();
    let mut cache = MATCHLESS.lock().unwrap_or_else(|p| p.into_inner());
    match stamp.filter(|s| paths.is_empty() && s.modified + UNCHANGED_MARGIN <= listed_at) {
        Some(s) => cache.insert(dir.to_path_buf(), (s, globs.to_vec())),
        None => cache.remove(dir),
    };
    paths
}

/// See [`candidates`].
pub const UNCHANGED_MARGIN: Duration = Duration::from_secs(1);

/// Which folder is at a path, and when its entries last changed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct FolderStamp {
    dev: u64,
    ino: u64,
    modified: std::time::SystemTime,
}

fn folder_stamp(dir: &Path) -> Option<FolderStamp> {
    let m = std::fs::metadata(dir).ok()?;
    Some(FolderStamp { dev: m.dev(), ino: m.ino(), modified: m.modified().ok()? })
}

/// Folders last listed without a match, with their stamp and the globs.
type Matchless = HashMap<PathBuf, (FolderStamp, Vec<String>)>;
static MATCHLESS: LazyLock<Mutex<Matchless>> = LazyLock::new(Mutex::default);

/// What cleaning a folder did.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct Cleaned {
    pub removed: Vec<PathBuf>,
    /// Kept, and why.
    pub kept: Vec<(PathBuf, String)>,
}

impl Cleaned {
    pub fn describe(&self) -> String {
        let names = |v: &mut dyn Iterator<Item = &PathBuf>| {
            v.map(|p| p.file_name().map_or_else(String::new, |n| n.to_string_lossy().into_owned()))
                .collect::<Vec<_>>()
                .join(", ")
        };
        let mut parts = Vec::new();
        if !self.removed.is_empty() {
            parts.push(format!("removed {}", names(&mut self.removed.iter())));
        }
        for (p, why) in &self.kept {
            parts.push(format!("kept {} ({why})", p.display()));
        }
        if parts.is_empty() { "nothing to clean".into() } else { parts.join("; ") }
    }
}

/// Remove the entries of `dir` matching `globs` that belong to `uid` and
/// that no live process has open or mapped.
pub fn clean(dir: &Path, globs: &[String], uid: u32, in_use: &HashMap<PathBuf, BTreeSet<i32>>) -> Cleaned {
    clean_candidates(candidates(dir, globs), uid, in_use)
}

/// Remove those of `paths` that are regular files of `uid` and that no
/// live process has open or mapped.
pub fn clean_candidates(paths: Vec<PathBuf>, uid: u32, in_use: &HashMap<PathBuf, BTreeSet<i32>>) -> Cleaned {
    let mut out = Cleaned::default();
    for path in paths {
        let Ok(meta) = std::fs::symlink_metadata(&path) else { continue };
        if !meta.is_file() {
            continue;
        }
        if meta.uid() != uid {
            out.kept.push((path, format!("owned by uid {}", meta.uid())));
            continue;
        }
        if let Some(pids) = in_use.get(&path) {
            let who: Vec<String> = pids.iter().map(|p| format!("pid {p} {}", cmdline(*p))).collect();
            out.kept.push((path, format!("in use by {}", who.join(", "))));
            continue;
        }
        match std::fs::remove_file(&path) {
            Ok(()) => out.removed.push(path),
            Err(e) => out.kept.push((path, format!("cannot remove: {e}"))),
        }
    }
    out
}

/// A process's command line, for messages.
pub fn cmdline(pid: i32) -> String {
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
fn listening_inodes(port: u16) -> BTreeSet<u64> {
    match diag::listening_inodes(port) {
        Ok(found) => found,
        Err(e) => {
            tracing::debug!(error = %e, "socket diagnostics unavailable: reading /proc/net/tcp");
            listening_inodes_in_proc(port)
        }
    }
}

fn listening_inodes_in_proc(port: u16) -> BTreeSet<u64> {
    let mut out = BTreeSet::new();
    for table in ["/proc/net/tcp", "/proc/net/tcp6"] {
        let Ok(text) = std::fs::read_to_string(table) else { continue };
        for line in text.lines().skip(1) {
            let f: Vec<&str> = line.split_whitespace().collect();
            // sl local_address rem_address st tx:rx tr:when retrnsmt uid timeout inode
            let (Some(local), Some(state), Some(inode)) = (f.get(1), f.get(3), f.get(9)) else { continue };
            let lport = local.rsplit(':').next().and_then(|h| u16::from_str_radix(h, 16).ok());
            if lport == Some(port)
                && *state == "0A"
                && let Ok(i) = inode.parse()
            {
                out.insert(i);
            }
        }
    }
    out
}

/// The kernel's socket diagnostics (`NETLINK_SOCK_DIAG`), for listening TCP
/// sockets.
mod diag {
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

    pub fn listening_inodes(port: u16) -> io::Result<BTreeSet<u64>> {
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
pub fn port_holders(port: u16) -> Vec<(i32, String)> {
    let inodes = listening_inodes(port);
    if inodes.is_empty() {
        return Vec::new();
    }
    let mut out = BTreeMap::new();
    for pid in crate::process::child::processes() {
        let Ok(fds) = std::fs::read_dir(format!("/proc/{pid}/fd")) else { continue };
        for fd in fds.flatten() {
            let target = std::fs::read_link(fd.path()).ok();
            let inode = target
                .as_ref()
                .and_then(|t| t.to_str())
                .and_then(|t| t.strip_prefix("socket:["))
                .and_then(|t| t.strip_suffix(']'))
                .and_then(|t| t.parse::<u64>().ok());
            if inode.is_some_and(|i| inodes.contains(&i)) {
                out.insert(pid, cmdline(pid));
                break;
            }
        }
    }
    out.into_iter().collect()
}

/// What a look at a port found.
#[derive(Debug)]
pub enum Port {
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
pub fn look_at_port(port: u16) -> Port {
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
pub fn port_free(port: u16) -> bool {
    matches!(look_at_port(port), Port::Free)
}

/// A bind error that says nothing about the port, as a cause: the warden's
/// own shortage named as such, else the error as it is.
pub fn describe_port_error(port: u16, e: &io::Error) -> String {
    match crate::util::errno::own_shortage(e) {
        Some(why) => format!("cannot check port {port}: {why} ({e})"),
        None => format!("cannot check port {port}: binding it failed: {e}"),
    }
}

/// Why a server could not listen on `port` now (`None`: it could): its
/// holders, or the bind's own error.
pub fn port_blocker(port: u16) -> Option<String> {
    match look_at_port(port) {
        Port::Free => None,
        Port::Held => Some(describe_holders(port)),
        Port::Unknown(e) => Some(describe_port_error(port, &e)),
    }
}

/// The holders of `port`, for a cause or a status line.
pub fn describe_holders(port: u16) -> String {
    let holders = port_holders(port);
    if holders.is_empty() {
        return format!("port {port} is in use");
    }
    let who: Vec<String> = holders.iter().map(|(pid, cmd)| format!("pid {pid} {cmd}")).collect();
    format!("port {port} is held by {}", who.join(", "))
}

/// GPU compute processes as `gpu-query` lists them: `pid, used_memory`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GpuApp {
    pub pid: i32,
    pub mem_mib: u64,
}

/// Parse nvidia-smi's `--query-compute-apps=pid,used_memory --format=csv,noheader,nounits`.
pub fn parse_gpu_apps(text: &str) -> Vec<GpuApp> {
    text.lines()
        .filter_map(|l| {
            let mut f = l.split(',').map(str::trim);
            let pid = f.next()?.parse().ok()?;
            let mem_mib = f.next().and_then(|m| m.parse().ok()).unwrap_or(0);
            Some(GpuApp { pid, mem_mib })
        })
        .collect()
}

pub fn describe_gpu_apps(apps: &[GpuApp]) -> String {
    apps.iter().map(|a| format!("pid {} ({} MiB)", a.pid, a.mem_mib)).collect::<Vec<_>>().join(", ")
}

/// Why the GPU query gave no answer.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum QueryError {
    /// It could not be run (other than not installed).
    Failed(String),
    /// It did not finish within its time limit and was killed.
    TimedOut(String),
}

/// Run `gpu-query` under `timeout`. `Ok(None)`: the command is not
/// installed. It runs in its own process group, which is SIGKILLed when the
/// time is up (a query that hangs on a failing driver must not hold the
/// start).
pub async fn query_gpus(cmd: &[String], timeout: Duration) -> Result<Option<Vec<GpuApp>>, QueryError> {
    let shown = crate::util::redact::command(cmd);
    match run_command(cmd, timeout, 1 << 20, false).await {
        Ok(out) => Ok(out.map(|o| parse_gpu_apps(&o))),
        Err(QueryError::TimedOut(_)) => {
            let t = humantime::format_duration(timeout);
            Err(QueryError::TimedOut(format!("GPU query {shown} did not answer within {t} (killed)")))
        }
        Err(e) => Err(e),
    }
}

/// A helper command of the warden (not part of the child's tree), as its
/// thread and its caller see it: its group, once started; whether its
/// caller gave up on it (then it is SIGKILLed as soon as it is known), and
/// whether it finished (then its group may be gone and its id reused).
#[derive(Debug, Default)]
struct Helper {
    group: Option<nix::unistd::Pid>,
    given_up: bool,
    finished: bool,
}

/// The caller's hold on a [`Helper`]: dropped before the command finished
/// (a timeout, a cancelled start or report), its group is SIGKILLed.
struct Hold(Arc<Mutex<Helper>>);

impl Drop for Hold {
    fn drop(&mut self) {
        let mut h = self.0.lock().unwrap_or_else(|p| p.into_inner());
        h.given_up = true;
        if let Some(group) = h.group.filter(|_| !h.finished) {
            let _ = nix::sys::signal::killpg(group, Signal::SIGKILL);
        }
    }
}

/// Run `cmd` under `timeout` and return its output (stdout, and stderr
/// with it when `stderr`), at most `max` bytes of it, without the
/// warden's systemd variables and log level in its environment. `Ok(None)`: the
/// command is not installed. It runs in its own process group, which is
/// SIGKILLed when the time is up or when the future is dropped; it is not
/// counted as part of the child's tree. It is started and read in a
/// blocking thread (starting a process holds the thread that does it until
/// the process has exec'd); the warden's reaper collects its exit, which is
/// not needed.
pub async fn run_command(
    cmd: &[String],
    timeout: Duration,
    max: u64,
    stderr: bool,
) -> Result<Option<String>, QueryError> {
    let shown = crate::util::redact::command(cmd);
    let Some(first) = cmd.first() else { return Ok(None) };
    // Looked up before starting anything: on a machine without GPUs the
    // query is missing, and a start attempt that fails costs a process.
    let Ok(program) = which::which(first) else { return Ok(None) };
    let helper = Arc::new(Mutex::new(Helper::default()));
    // Killed however this ends: in time, late, or dropped by a cancel.
    let hold = Hold(helper.clone());
    let (args, what) = (cmd[1..].to_vec(), shown.clone());
    let run = tokio::task::spawn_blocking(move || run_helper(program, &args, &what, max, stderr, &helper));
    match tokio::time::timeout(timeout, run).await {
        Ok(run) => {
            drop(hold);
            run.unwrap_or_else(|e| Err(QueryError::Failed(format!("{shown}: {e}"))))
        }
        Err(_) => {
            drop(hold);
            let t = humantime::format_duration(timeout);
            Err(QueryError::TimedOut(format!("{shown} did not answer within {t} (killed)")))
        }
    }
}

/// [`run_command`]'s blocking part.
fn run_helper(
    program: PathBuf,
    args: &[String],
    shown: &str,
    max: u64,
    stderr: bool,
    helper: &Mutex<Helper>,
) -> Result<Option<String>, QueryError> {
    use std::io::Read;
    use std::os::unix::process::CommandExt;
    let mut command = std::process::Command::new(program);
    command.args(args).stdin(std::process::Stdio::null()).process_group(0);
    // Neither systemd's variables nor the warden's log level are the
    // command's (py-spy reads RUST_LOG too, and writes its debug log into
    // its output).
    for var in crate::process::child::SCRUBBED_ENV.iter().chain(&["RUST_LOG"]) {
        command.env_remove(var);
    }
    let (reader, writer) = std::io::pipe().map_err(|e| QueryError::Failed(format!("cannot run {shown}: {e}")))?;
    let err_out = if stderr {
        let w = writer.try_clone().map_err(|e| QueryError::Failed(format!("cannot run {shown}: {e}")))?;
        std::process::Stdio::from(w)
    } else {
        std::process::Stdio::null()
    };
    command.stdout(writer).stderr(err_out);
    let spawned = command.spawn();
    // The write ends go with the command: the read sees the end of the
    // output when the command (and what it started) closes its own.
    drop(command);
    let mut child = match spawned {
        Ok(c) => c,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(None),
        Err(e) => return Err(QueryError::Failed(format!("cannot run {shown}: {e}"))),
    };
    let group = nix::unistd::Pid::from_raw(child.id() as i32);
    crate::process::child::register_helper(group.as_raw());
    {
        let mut h = helper.lock().unwrap_or_else(|p| p.into_inner());
        if h.given_up {
            let _ = nix::sys::signal::killpg(group, Signal::SIGKILL);
        }
        h.group = Some(group);
    }
    // A bounded read: a runaway command cannot fill the warden's memory.
    let mut out = Vec::new();
    let _ = (&reader).take(max).read_to_end(&mut out);
    drop(reader);
    // It closed its output: once waited for, its group may be gone and its
    // id reused, so it is not signalled any more (given up, it was killed).
    helper.lock().unwrap_or_else(|p| p.into_inner()).finished = true;
    let _ = child.wait();
    crate::process::child::unregister_helper(group.as_raw());
    Ok(Some(String::from_utf8_lossy(&out).into_owned()))
}

/// Where vLLM leaves `vllm_dist_*` files: the temporary folders.
pub fn temp_dirs() -> Vec<PathBuf> {
    let mut dirs: Vec<PathBuf> = std::env::var_os("TMPDIR").map(PathBuf::from).into_iter().collect();
    for d in ["/tmp", "/var/tmp"] {
        if !dirs.iter().any(|x| x == Path::new(d)) {
            dirs.push(PathBuf::from(d));
        }
    }
    dirs
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The kernel's socket diagnostics and `/proc/net/tcp{,6}` name the
    /// same listening sockets, IPv4 and IPv6; a closed one is gone from both.
    #[test]
    fn socket_diagnostics_find_the_listeners_proc_lists() {
        let v4 = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let port = v4.local_addr().unwrap().port();
        let v6 = std::net::TcpListener::bind(("::1", port)).ok();
        let by_diag = diag::listening_inodes(port).unwrap();
        assert_eq!(by_diag.len(), 1 + usize::from(v6.is_some()), "{by_diag:?}");
        assert_eq!(by_diag, listening_inodes_in_proc(port));
        assert!(!port_free(port));
        drop((v4, v6));
        assert!(diag::listening_inodes(port).unwrap().is_empty());
    }

    /// A folder found without a match is not listed again while it stays
    /// as it was; a file made in it since is found.
    #[test]
    fn a_folder_is_listed_again_once_its_entries_changed() {
        let dir = tempfile::tempdir().unwrap();
        let globs = vec!["vllm_dist_*".to_string()];
        std::fs::write(dir.path().join("other"), "").unwrap();
        let old = std::time::SystemTime::now() - UNCHANGED_MARGIN * 10;
        std::fs::File::open(dir.path()).unwrap().set_modified(old).unwrap();
        assert!(candidates(dir.path(), &globs).is_empty());
        let stamp = folder_stamp(dir.path()).unwrap();
        assert!(MATCHLESS.lock().unwrap().get(dir.path()).is_some_and(|(s, _)| *s == stamp), "remembered as matchless");
        assert!(candidates(dir.path(), &globs).is_empty());
        let made = dir.path().join("vllm_dist_1");
        std::fs::write(&made, "").unwrap();
        assert_eq!(candidates(dir.path(), &globs), vec![made.clone()]);
        // Other globs are another question.
        std::fs::remove_file(&made).unwrap();
        std::fs::File::open(dir.path()).unwrap().set_modified(old).unwrap();
        assert!(candidates(dir.path(), &globs).is_empty());
        assert_eq!(candidates(dir.path(), &["oth*".to_string()]), vec![dir.path().join("other")]);
    }

    /// A folder changed within the margin is listed every time: an entry made
    /// in the same clock tick could leave its time as it was.
    #[test]
    fn a_folder_changed_just_now_is_not_remembered() {
        let dir = tempfile::tempdir().unwrap();
        assert!(candidates(dir.path(), &["x*".to_string()]).is_empty());
        assert!(!MATCHLESS.lock().unwrap().contains_key(dir.path()));
    }

    #[test]
    fn pid_1_the_warden_and_its_ancestors_are_protected() {
        let p = protected();
        let me = std::process::id() as i32;
        assert!(p.contains(&1) && p.contains(&me));
        assert!(p.contains(&read_stat(me).unwrap().ppid));
    }

    #[test]
    fn nvidia_smi_csv_parses() {
        let apps = parse_gpu_apps("4242, 81000\n4243, 512\n\n");
        assert_eq!(apps, vec![GpuApp { pid: 4242, mem_mib: 81000 }, GpuApp { pid: 4243, mem_mib: 512 }]);
        assert_eq!(describe_gpu_apps(&apps), "pid 4242 (81000 MiB), pid 4243 (512 MiB)");
        assert!(parse_gpu_apps("").is_empty());
    }

    #[test]
    fn a_listener_is_found_with_its_pid() {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let port = l.local_addr().unwrap().port();
        assert!(!port_free(port));
        let holders = port_holders(port);
        assert_eq!(holders.len(), 1);
        assert_eq!(holders[0].0, std::process::id() as i32);
        drop(l);
        assert!(port_free(port));
    }

    /// Only "address in use" is a held port; another bind error is named
    /// as it is, and the warden's own shortage of descriptors as that.
    #[test]
    fn bind_errors_are_named_as_they_are() {
        let emfile = io::Error::from_raw_os_error(libc::EMFILE);
        assert_eq!(
            describe_port_error(8000, &emfile),
            format!("cannot check port 8000: the warden is out of file descriptors ({emfile})")
        );
        let eacces = io::Error::from_raw_os_error(libc::EACCES);
        assert_eq!(describe_port_error(80, &eacces), format!("cannot check port 80: binding it failed: {eacces}"));
        assert!(!describe_port_error(80, &eacces).contains("in use"));
        // A port below 1024 without the right to bind it: unknown, not held.
        if !nix::unistd::geteuid().is_root() {
            let free = (1..1024u16).find(|p| listening_inodes(*p).is_empty()).unwrap();
            assert!(matches!(look_at_port(free), Port::Unknown(e) if e.kind() == io::ErrorKind::PermissionDenied));
        }
    }
}
