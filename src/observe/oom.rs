//! Host OOM kills: a process of the run ended by the kernel's OOM killer
//! (host memory, or the unit's `MemoryMax=`; not the GPU's). Told two
//! ways: the count of OOM kills of the warden's own cgroup (the unit's,
//! which holds the child's tree: cgroup v2 `memory.events`, v1
//! `memory.oom_control`, `oom_kill N`) rising during the run, and the
//! kernel's `Killed process PID (name) …` message naming the run's leader
//! as the kernel-message follower read it. The cause it makes names the
//! kill with the memory figures the kernel and the cgroup give. What a
//! kill does to the run is the supervisor's.

use std::path::{Path, PathBuf};
use std::sync::LazyLock;

use regex::Regex;

/// The cause's first words: `status`, the metrics and the tests find it.
pub(crate) const KILLED: &str = "killed by the kernel's OOM killer (host memory)";

/// The warden's memory cgroup: where its OOM kills are counted, and its
/// limit and peak.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Cgroup {
    dir: PathBuf,
    v2: bool,
}

/// The memory cgroup `/proc/self/cgroup` names (`0::/system.slice/x`, or
/// cgroup v1's `4:memory:/x`), under `root` (`/sys/fs/cgroup`).
pub(crate) fn cgroup_of(proc_self_cgroup: &str, root: &Path) -> Option<Cgroup> {
    use procfs::FromRead;
    let mut v2 = None;
    for group in procfs::ProcessCGroups::from_read(proc_self_cgroup.as_bytes()).ok()? {
        let rel = group.pathname.trim_start_matches('/');
        if group.controllers.iter().any(|c| c == "memory") {
            return Some(Cgroup { dir: root.join("memory").join(rel), v2: false });
        }
        if group.controllers.is_empty() {
            v2 = Some(Cgroup { dir: root.join(rel), v2: true });
        }
    }
    v2
}

/// The warden's own memory cgroup, when the files say which.
pub(crate) fn cgroup() -> Option<Cgroup> {
    let text = std::fs::read_to_string("/proc/self/cgroup").ok()?;
    cgroup_of(&text, Path::new("/sys/fs/cgroup")).filter(|c| c.kills().is_some())
}

/// Read a small file of the cgroup (kernel files: a page at most).
fn read(path: &Path) -> Option<String> {
    use std::io::Read;
    let mut s = String::new();
    std::fs::File::open(path).ok()?.take(64 << 10).read_to_string(&mut s).ok()?;
    Some(s)
}

/// `oom_kill N` of `memory.events` or `memory.oom_control`.
pub(crate) fn kills_in(text: &str) -> Option<u64> {
    text.lines().find_map(|l| l.strip_prefix("oom_kill ")).and_then(|n| n.trim().parse().ok())
}

fn size(bytes: u64) -> String {
    let mib = bytes as f64 / f64::from(1u32 << 20);
    if mib >= 1024.0 { format!("{:.1} GiB", mib / 1024.0) } else { format!("{mib:.0} MiB") }
}

impl Cgroup {
    /// OOM kills in the cgroup (and below it) so far.
    pub(crate) fn kills(&self) -> Option<u64> {
        let file = if self.v2 { "memory.events" } else { "memory.oom_control" };
        kills_in(&read(&self.dir.join(file))?)
    }

    /// Its limit and peak, as the cause shows them (`limit 512 MiB, peak
    /// 512 MiB`); what is readable.
    pub(crate) fn figures(&self) -> Option<String> {
        let (limit, peak) = if self.v2 {
            ("memory.max", "memory.peak")
        } else {
            ("memory.limit_in_bytes", "memory.max_usage_in_bytes")
        };
        let number = |f: &str| read(&self.dir.join(f)).and_then(|t| t.trim().parse::<u64>().ok());
        // No limit: `max` (v2), or a page-rounded i64::MAX (v1).
        let limit = number(limit).filter(|b| *b < 1 << 62).map(|b| format!("limit {}", size(b)));
        let peak = number(peak).map(|b| format!("peak {}", size(b)));
        let both: Vec<String> = [limit, peak].into_iter().flatten().collect();
        (!both.is_empty()).then(|| format!("the unit's memory: {}", both.join(", ")))
    }
}

/// One process the kernel's OOM killer ended, as its message says.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Kill {
    pub(crate) pid: u32,
    pub(crate) name: String,
    /// `total-vm`, `anon-rss`, in KiB.
    pub(crate) total_vm: Option<u64>,
    pub(crate) anon_rss: Option<u64>,
    /// Killed for a cgroup's limit (`Memory cgroup out of memory`), not
    /// the host's.
    pub(crate) cgroup: bool,
}

/// `Out of memory: Killed process 4242 (python3) total-vm:8123456kB,
/// anon-rss:5234567kB, …` (or `Memory cgroup out of memory: …`).
pub(crate) fn kill(line: &str) -> Option<Kill> {
    static KILL: LazyLock<Regex> = LazyLock::new(|| {
        Regex::new(r"(Memory cgroup )?[Oo]ut of memory.*: Killed process (\d+) \(([^)]*)\)(.*)").expect("static regex")
    });
    static KIB: LazyLock<Regex> = LazyLock::new(|| Regex::new(r"(total-vm|anon-rss):(\d+)kB").expect("static regex"));
    let c = KILL.captures(line)?;
    let mut k = Kill {
        pid: c[2].parse().ok()?,
        name: c[3].to_string(),
        total_vm: None,
        anon_rss: None,
        cgroup: c.get(1).is_some(),
    };
    for m in KIB.captures_iter(&c[4]) {
        let n = m[2].parse().ok();
        if &m[1] == "total-vm" { k.total_vm = n } else { k.anon_rss = n }
    }
    Some(k)
}

/// The cause of a run one of whose processes the OOM killer ended: `kill`
/// as the kernel's message named it, else `kills` counted by the cgroup
/// during the run; `figures` the cgroup's.
pub(crate) fn cause(kill: Option<&Kill>, kills: u64, figures: Option<&str>) -> String {
    let mut text = match kill {
        Some(k) => {
            let mut t = format!("{KILLED}: pid {} ({})", k.pid, crate::util::escape::one_line(&k.name, 64));
            if let Some(rss) = k.anon_rss {
                t.push_str(&format!(", anon-rss {}", size(rss * 1024)));
            }
            if let Some(vm) = k.total_vm {
                t.push_str(&format!(", total-vm {}", size(vm * 1024)));
            }
            if k.cgroup {
                t.push_str(", at its cgroup's limit");
            }
            t
        }
        None => format!("{KILLED}: {kills} OOM kill(s) in the unit's cgroup during the run"),
    };
    if let Some(f) = figures {
        text.push_str(&format!("; {f}"));
    }
    text
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_memory_cgroup_is_found_for_v2_and_v1() {
        let root = Path::new("/sys/fs/cgroup");
        let v2 = cgroup_of("0::/system.slice/vllm-warden@kimi.service\n", root).unwrap();
        assert_eq!(v2, Cgroup { dir: root.join("system.slice/vllm-warden@kimi.service"), v2: true });
        let v1 = cgroup_of("9:name=systemd:/\n4:memory:/process_api/f8\n0::/\n", root).unwrap();
        assert_eq!(v1, Cgroup { dir: root.join("memory/process_api/f8"), v2: false });
        assert_eq!(cgroup_of("garbage", root), None);
    }

    #[test]
    fn the_kill_count_is_read_from_either_file() {
        let v2 = "low 0\nhigh 0\nmax 12\noom 2\noom_kill 1\noom_group_kill 0\n";
        assert_eq!(kills_in(v2), Some(1));
        assert_eq!(kills_in("oom_kill_disable 0\nunder_oom 0\noom_kill 3\n"), Some(3));
        assert_eq!(kills_in("nothing"), None);
    }

    #[test]
    fn the_kernel_message_names_the_process_and_its_memory() {
        let line = "[13395.3] Out of memory: Killed process 4242 (python3) total-vm:12582912kB, anon-rss:5347737kB, file-rss:0kB, shmem-rss:0kB, UID:999 pgtables:11000kB oom_score_adj:0";
        let k = kill(line).unwrap();
        assert_eq!((k.pid, k.name.as_str(), k.cgroup), (4242, "python3", false));
        assert_eq!(
            cause(Some(&k), 1, Some("the unit's memory: limit 8.0 GiB, peak 8.0 GiB")),
            "killed by the kernel's OOM killer (host memory): pid 4242 (python3), anon-rss 5.1 GiB, total-vm 12.0 GiB; \
             the unit's memory: limit 8.0 GiB, peak 8.0 GiB"
        );
        let cg = kill("Memory cgroup out of memory: Killed process 77 (eat) total-vm:1000kB, anon-rss:900kB").unwrap();
        assert!(cg.cgroup);
        assert_eq!(kill("oom-kill:constraint=CONSTRAINT_NONE,task=python3,pid=4242"), None);
        assert_eq!(
            cause(None, 2, None),
            "killed by the kernel's OOM killer (host memory): 2 OOM kill(s) in the unit's cgroup during the run"
        );
    }
}
