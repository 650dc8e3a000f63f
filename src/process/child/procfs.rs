//! The process table as `/proc` shows it: a process's stat line, the tree
//! under a pid (its children files, else a scan), the warden's helpers
//! left out, and what survives a stop.

use std::collections::{HashMap, HashSet, VecDeque};
use std::path::Path;
use std::sync::Mutex;

use ::procfs::FromRead;

use super::*;

/// One line of `/proc/PID/stat` that we need.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ProcStat {
    pub pid: i32,
    pub ppid: i32,
    pub state: char,
    /// Start time in clock ticks after boot: with the pid, names a process
    /// uniquely.
    pub start_time: u64,
}

/// Parse `/proc/PID/stat` (the `procfs` crate's parser): the command name,
/// which its process chooses, may hold spaces, ')' and bytes that are not
/// UTF-8; the fields are read after the last ')'.
#[cfg(test)]
pub(crate) fn parse_stat(text: &str) -> Option<ProcStat> {
    ::procfs::process::Stat::from_read(text.as_bytes()).ok().map(from_crate)
}

/// `pid`'s stat line; `None` for a process that is gone (or whose line
/// does not parse): a vanished process is never an error.
pub fn read_stat(pid: i32) -> Option<ProcStat> {
    ::procfs::process::Stat::from_file(format!("/proc/{pid}/stat")).ok().map(from_crate)
}

fn from_crate(st: ::procfs::process::Stat) -> ProcStat {
    ProcStat { pid: st.pid, ppid: st.ppid, state: st.state, start_time: st.starttime }
}

/// The warden's own helper processes that live beside the child's tree
/// (the kernel-message follower): pid and start time. They and their
/// descendants are never taken for part of the tree.
pub(super) static HELPERS: Mutex<Vec<(i32, u64)>> = Mutex::new(Vec::new());

/// `pid`, a child of the warden, is a helper, not part of the tree.
pub(crate) fn register_helper(pid: i32) {
    if let Some(st) = read_stat(pid) {
        HELPERS.lock().unwrap_or_else(|p| p.into_inner()).push((pid, st.start_time));
    }
    children_born();
}

pub(crate) fn unregister_helper(pid: i32) {
    HELPERS.lock().unwrap_or_else(|p| p.into_inner()).retain(|(p, _)| *p != pid);
}

pub(super) fn is_helper(st: &ProcStat) -> bool {
    HELPERS.lock().unwrap_or_else(|p| p.into_inner()).contains(&(st.pid, st.start_time))
}

/// Every live descendant of `root` (zombies left out), parents first; the
/// warden's helpers and their descendants left out.
///
/// Found by following `/proc/PID/task/TID/children` down from `root`,
/// which costs a few reads per process of the tree, whatever else runs on
/// the machine; where the kernel has no such files, by one pass over every
/// process in `/proc`. A process that exits during the walk hands its
/// children to the nearest subreaper (the warden, for its own tree): the
/// walk is made again until `root`'s children stay the same.
pub fn descendants(root: i32) -> Vec<ProcStat> {
    if !children_files() {
        return descendants_by_scan(root);
    }
    let mut last = None;
    for _ in 0..WALKS {
        let before = children(root);
        let out = walk(root, before.clone());
        if children(root) == before {
            return out;
        }
        last = Some(out);
    }
    last.unwrap_or_default()
}

/// Walks of the tree until the root's children stay the same; beyond it
/// the last walk stands (the tree is changing as fast as it is read).
pub(super) const WALKS: usize = 8;

pub(super) fn walk(root: i32, first: Vec<i32>) -> Vec<ProcStat> {
    let mut out = Vec::new();
    let mut seen = HashSet::from([root]);
    let mut queue: VecDeque<i32> = first.into();
    while let Some(pid) = queue.pop_front() {
        if !seen.insert(pid) || being_reaped(pid) {
            continue;
        }
        let Some(st) = read_stat(pid) else { continue };
        if is_helper(&st) || st.state == 'Z' || st.state == 'X' {
            // A zombie has no children: they were handed on at its exit.
            continue;
        }
        queue.extend(children(pid));
        out.push(st);
    }
    out
}

/// The children of every thread of `pid`, in the kernel's order; none for
/// a process that is gone. For the warden itself, once it holds a [`Tree`],
/// only the threads its tree's processes can be children of. Read by hand:
/// the procfs crate's `Task::children` opens each thread's directory first.
pub(super) fn children(pid: i32) -> Vec<i32> {
    let read = |path: &Path, out: &mut Vec<i32>| {
        if let Ok(text) = std::fs::read_to_string(path) {
            out.extend(text.split_ascii_whitespace().filter_map(|p| p.parse::<i32>().ok()));
        }
    };
    let mut out = Vec::new();
    if pid == std::process::id() as i32
        && let Some(tids) = TREE_THREADS.get()
    {
        let tids = tids.lock().unwrap_or_else(|p| p.into_inner()).clone();
        for tid in tids {
            read(Path::new(&format!("/proc/{pid}/task/{tid}/children")), &mut out);
        }
        return out;
    }
    let Ok(tasks) = std::fs::read_dir(format!("/proc/{pid}/task")) else { return Vec::new() };
    for task in tasks.flatten() {
        read(&task.path().join("children"), &mut out);
    }
    out
}

/// The warden's threads whose children can be part of its tree: the main
/// thread, to which the kernel hands every orphan of a subreaper (the first
/// of its threads alive), and each thread that has spawned a leader (the
/// loop's, which is the main one). The others start only the warden's own
/// helpers, never part of the tree; reading only these few children files
/// spares a look at the tree a read per thread of the warden. Set once a
/// [`Tree`] exists; before, every thread is read.
pub(super) static TREE_THREADS: std::sync::OnceLock<Mutex<Vec<i32>>> = std::sync::OnceLock::new();

pub(super) fn tree_thread(tid: i32) {
    let me = std::process::id() as i32;
    let mut tids = TREE_THREADS.get_or_init(|| Mutex::new(vec![me])).lock().unwrap_or_else(|p| p.into_inner());
    if !tids.contains(&tid) {
        tids.push(tid);
    }
}

/// Whether this kernel lists each task's children (`CONFIG_PROC_CHILDREN`).
pub(super) fn children_files() -> bool {
    static HAS: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *HAS.get_or_init(|| {
        let tid = nix::unistd::gettid().as_raw();
        Path::new(&format!("/proc/self/task/{tid}/children")).exists()
    })
}

/// Every process listed in `/proc`, the warden's children being reaped
/// left out ([`being_reaped`]).
pub(crate) fn processes() -> impl Iterator<Item = i32> {
    std::fs::read_dir("/proc")
        .into_iter()
        .flatten()
        .flatten()
        .filter_map(|e| e.file_name().to_str().and_then(|s| s.parse::<i32>().ok()))
        .filter(|pid| !being_reaped(*pid))
}

/// [`descendants`] by one pass over every process in `/proc`.
pub(super) fn descendants_by_scan(root: i32) -> Vec<ProcStat> {
    let mut children: HashMap<i32, Vec<ProcStat>> = HashMap::new();
    for st in processes().filter_map(read_stat) {
        children.entry(st.ppid).or_default().push(st);
    }
    let mut out = Vec::new();
    let mut queue = VecDeque::from([root]);
    while let Some(p) = queue.pop_front() {
        for st in children.remove(&p).unwrap_or_default() {
            if is_helper(&st) {
                continue;
            }
            queue.push_back(st.pid);
            if st.state != 'Z' && st.state != 'X' {
                out.push(st);
            }
        }
    }
    out
}

/// Whether a live process of `root`'s tree is left, `leader`'s zombie aside.
///
/// One look at `root`'s children answers when it finds a live one, or none
/// but helpers, that zombie and those whose exit the reaper has read: any
/// other process of the tree has a live ancestor among them, or was handed
/// to `root` when its parent exited, which they did before their exit was
/// seen. Another zombie (or a child gone meanwhile) may have handed its
/// children over during the look: the whole tree is walked then.
pub(super) fn any_left(root: i32, leader: Option<i32>) -> bool {
    if children_files() {
        let mut sure = true;
        for pid in children(root) {
            if being_reaped(pid) {
                // Its exit was read after it had handed its children on.
                continue;
            }
            match read_stat(pid) {
                Some(st) if is_helper(&st) => {}
                Some(st) if st.state == 'Z' || st.state == 'X' => sure &= Some(pid) == leader,
                Some(_) => return true,
                None => sure = false,
            }
        }
        if sure {
            return false;
        }
    }
    !descendants(root).is_empty()
}

/// What is left of the warden's tree after SIGKILL: how many live
/// processes, and one description each: pid, state, `wchan` (where in the
/// kernel it waits) and name. Reads only `/proc/PID/{stat,wchan,comm}`,
/// which answer even for a process stuck in the kernel (its `cmdline` may
/// not). Zombies are not counted: they are gone but for their reap.
pub(crate) fn describe_survivors() -> (usize, String) {
    let me = std::process::id() as i32;
    let left = descendants(me);
    if left.is_empty() {
        return (0, "no live process of the tree is left after SIGKILL".into());
    }
    let read = |pid: i32, what: &str| {
        std::fs::read_to_string(format!("/proc/{pid}/{what}")).map(|s| s.trim().to_string()).unwrap_or_default()
    };
    let each: Vec<String> = left
        .iter()
        .map(|p| {
            let wchan = read(p.pid, "wchan");
            let wchan = if wchan.is_empty() || wchan == "0" { String::new() } else { format!(", wchan {wchan}") };
            let name = crate::util::escape::one_line(&read(p.pid, "comm"), 64);
            format!("pid {} ({name}, state {}{wchan})", p.pid, p.state)
        })
        .collect();
    let stuck = left.iter().any(|p| p.state == 'D');
    let why = if stuck {
        "stuck in the kernel (state D; for a GPU server, usually the driver): needs a GPU reset or a reboot"
    } else {
        "still there after SIGKILL"
    };
    (left.len(), format!("{} process(es) survived SIGKILL, {why}: {}", left.len(), each.join(", ")))
}
