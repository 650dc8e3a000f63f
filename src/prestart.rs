//! What must hold before every start, each found through `/proc` and never
//! by process name: no leftover tree of an earlier warden, no stale shared
//! memory, a free port, idle GPUs. The state machine is not known here; the
//! driver runs these steps in order and reports them.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::io;
use std::os::fd::{FromRawFd, OwnedFd};
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::time::Duration;

use nix::sys::signal::Signal;
use serde::{Deserialize, Serialize};

use crate::child::{ProcStat, descendants, read_stat};
use crate::fsutil::replace;

/// One process of the child's tree, as recorded in the state directory.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Recorded {
    pub pid: i32,
    /// Clock ticks after boot: a recycled pid has another.
    pub start_time: u64,
}

fn record_path(state_dir: &Path) -> PathBuf {
    state_dir.join("tree.json")
}

/// Write the warden's live descendants (the child's tree) to the state
/// directory, so that a warden started after this one was killed can find
/// them.
pub fn record_tree(state_dir: &Path) -> io::Result<()> {
    let tree: Vec<Recorded> = descendants(std::process::id() as i32)
        .into_iter()
        .map(|p| Recorded { pid: p.pid, start_time: p.start_time })
        .collect();
    std::fs::create_dir_all(state_dir)?;
    let text = serde_json::to_string(&tree).expect("records serialise");
    replace(&record_path(state_dir), text.as_bytes(), 0o600)
}

/// The tree is gone: forget it.
pub fn clear_record(state_dir: &Path) {
    let _ = std::fs::remove_file(record_path(state_dir));
}

/// Recorded processes still alive with the same start time, and their live
/// descendants (whatever their group or session). A pid now used by another
/// process is left out.
pub fn leftovers(state_dir: &Path) -> Vec<ProcStat> {
    let Ok(text) = std::fs::read_to_string(record_path(state_dir)) else { return Vec::new() };
    let recorded: Vec<Recorded> = serde_json::from_str(&text).unwrap_or_default();
    let mut seen = BTreeSet::new();
    let mut out = Vec::new();
    for r in recorded {
        let Some(st) = read_stat(r.pid) else { continue };
        if st.start_time != r.start_time || st.state == 'Z' {
            continue;
        }
        for p in std::iter::once(st).chain(descendants(r.pid)) {
            if seen.insert(p.pid) {
                out.push(p);
            }
        }
    }
    out
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
/// `timeout`; returns when all are gone.
pub async fn stop_leftovers(procs: &[ProcStat], sig: Signal, timeout: Duration) {
    let fds: Vec<PidFd> = procs.iter().filter_map(PidFd::open).collect();
    for f in &fds {
        f.signal(sig);
    }
    let all = all_exited(&fds);
    if tokio::time::timeout(timeout, all).await.is_err() {
        for f in &fds {
            f.signal(Signal::SIGKILL);
        }
        all_exited(&fds).await;
    }
}

async fn all_exited(fds: &[PidFd]) {
    for f in fds {
        f.exited().await;
    }
}

/// Paths under `dir` that a live process has open or mapped, with the pids.
pub fn in_use_under(dir: &Path) -> HashMap<PathBuf, BTreeSet<i32>> {
    let mut out: HashMap<PathBuf, BTreeSet<i32>> = HashMap::new();
    let Ok(procs) = std::fs::read_dir("/proc") else { return out };
    for entry in procs.flatten() {
        let Some(pid) = entry.file_name().to_str().and_then(|s| s.parse::<i32>().ok()) else { continue };
        if let Ok(fds) = std::fs::read_dir(format!("/proc/{pid}/fd")) {
            for fd in fds.flatten() {
                if let Ok(target) = std::fs::read_link(fd.path())
                    && target.starts_with(dir)
                {
                    out.entry(target).or_default().insert(pid);
                }
            }
        }
        if let Ok(maps) = std::fs::read_to_string(format!("/proc/{pid}/maps")) {
            for line in maps.lines() {
                // address perms offset dev inode path
                if let Some(path) = line.splitn(6, ' ').nth(5).map(str::trim_start)
                    && Path::new(path).starts_with(dir)
                {
                    let path = path.trim_end_matches(" (deleted)");
                    out.entry(PathBuf::from(path)).or_default().insert(pid);
                }
            }
        }
    }
    out
}

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
    let patterns: Vec<glob::Pattern> = globs.iter().filter_map(|g| glob::Pattern::new(g).ok()).collect();
    let mut out = Cleaned::default();
    let Ok(entries) = std::fs::read_dir(dir) else { return out };
    let mut paths: Vec<PathBuf> = entries
        .flatten()
        .map(|e| e.path())
        .filter(|p| p.file_name().and_then(|n| n.to_str()).is_some_and(|n| patterns.iter().any(|g| g.matches(n))))
        .collect();
    paths.sort();
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
    let line = crate::redact::command(&args);
    if line.is_empty() { "(unknown)".into() } else { format!("({line})") }
}

/// Socket inodes listening on `port` (TCP, IPv4 and IPv6).
fn listening_inodes(port: u16) -> BTreeSet<u64> {
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

/// The processes listening on `port`: pid and command line.
pub fn port_holders(port: u16) -> Vec<(i32, String)> {
    let inodes = listening_inodes(port);
    if inodes.is_empty() {
        return Vec::new();
    }
    let mut out = BTreeMap::new();
    if let Ok(procs) = std::fs::read_dir("/proc") {
        for entry in procs.flatten() {
            let Some(pid) = entry.file_name().to_str().and_then(|s| s.parse::<i32>().ok()) else { continue };
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
    }
    out.into_iter().collect()
}

/// True when a server could listen on `port` now.
pub fn port_free(port: u16) -> bool {
    listening_inodes(port).is_empty() && std::net::TcpListener::bind(("0.0.0.0", port)).is_ok()
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

/// Run `gpu-query`. `Ok(None)`: the command is not installed. Run in a
/// thread that only reads its output: the warden's reaper collects it.
pub async fn query_gpus(cmd: &[String]) -> Result<Option<Vec<GpuApp>>, String> {
    let cmd = cmd.to_vec();
    tokio::task::spawn_blocking(move || {
        use std::io::Read;
        let mut child = match std::process::Command::new(&cmd[0])
            .args(&cmd[1..])
            .stdin(std::process::Stdio::null())
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::null())
            .spawn()
        {
            Ok(c) => c,
            Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(None),
            Err(e) => return Err(format!("cannot run {}: {e}", cmd[0])),
        };
        let mut out = String::new();
        if let Some(mut s) = child.stdout.take() {
            let _ = s.read_to_string(&mut out);
        }
        // The exit status may already have been reaped by the warden's
        // reaper; the output is what matters.
        let _ = child.wait();
        Ok(Some(parse_gpu_apps(&out)))
    })
    .await
    .map_err(|e| e.to_string())?
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
}
