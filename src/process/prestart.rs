//! What must hold before every start, each found through `/proc` and never
//! by process name: no leftover tree of an earlier warden, no stale shared
//! memory, a free port, idle GPUs. The state machine is not known here; the
//! driver runs these steps in order and reports them.

use std::path::{Path, PathBuf};

mod commands;
mod engine;
mod files;
mod leftovers;
mod port;

pub(crate) use self::commands::*;
pub(crate) use self::engine::*;
pub use self::files::*;
pub(crate) use self::leftovers::*;
pub(crate) use self::port::*;

/// Where vLLM leaves `vllm_dist_*` files: the temporary folders.
pub(crate) fn temp_dirs() -> Vec<PathBuf> {
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
    use crate::process::child::read_stat;
    use std::io;

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

    /// A process's cgroup v2 path is the one its table's `0::` line names;
    /// a process that is gone has none.
    #[test]
    fn the_cgroup_is_the_tables_v2_line() {
        let table = std::fs::read_to_string("/proc/self/cgroup").unwrap();
        let v2 = table.lines().find_map(|l| l.strip_prefix("0::")).map(str::to_string);
        assert_eq!(cgroup_of(std::process::id() as i32), v2);
        assert_eq!(cgroup_of(i32::MAX), None);
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
        // A privileged port without the right to bind it: unknown, not
        // held. Which ports are privileged is the host's
        // `net.ipv4.ip_unprivileged_port_start` (1024 by default; 0 in
        // rootless containers and some distributions: none is).
        let start: u16 = std::fs::read_to_string("/proc/sys/net/ipv4/ip_unprivileged_port_start")
            .ok()
            .and_then(|t| t.trim().parse().ok())
            .unwrap_or(1024);
        if !nix::unistd::geteuid().is_root() {
            match (1..start).find(|p| listening_inodes(*p).is_empty()) {
                Some(free) => assert!(
                    matches!(look_at_port(free), Port::Unknown(e) if e.kind() == io::ErrorKind::PermissionDenied)
                ),
                None => eprintln!("SKIPPED (in part): no privileged port here (ip_unprivileged_port_start = {start})"),
            }
        }
    }
}
