//! Ray: what a start waits for in the cluster (`prestart.ray-*`, the
//! gate), and how a Ray node's readiness is confirmed. The cluster is asked
//! by Ray's own client of its GCS (`ray._raylet.GcsClient`, as `ray status`
//! uses it) in the Python that has Ray, under a timeout: every node with
//! its state and resources, as the GCS knows them now (`ray status` shows
//! the autoscaler's last report instead, which lists a dead node as active
//! long after the GCS marked it dead). The answer is one JSON line, read
//! here; nothing in it is trusted beyond states, addresses compared for
//! equality, and resource figures.

use crate::config::Cluster;
use crate::config::command::flag;
use std::path::{Path, PathBuf};
use std::time::Duration;

/// How long one look may take (it starts a Python interpreter and imports
/// Ray, several seconds on a busy machine); the pre-start budget counts it.
pub(crate) use crate::config::defaults::RAY_STATUS_TIMEOUT as STATUS_TIMEOUT;

/// The look, run as `PYTHON -c ASK_GCS HEAD:PORT`: the GCS's nodes, each
/// with its address, whether it is alive, and its total and free
/// resources, as one JSON line. It does not join the cluster as a driver.
const ASK_GCS: &str = r#"import json, sys
from ray._raylet import GcsClient
from ray.core.generated.gcs_pb2 import GcsNodeInfo
gcs = GcsClient(address=sys.argv[1])
infos = gcs.get_all_node_info(timeout=10)
usage = gcs.get_all_resource_usage(timeout=10)
free = {b.node_id: dict(b.resources_available) for b in usage.resource_usage_data.batch}
nodes = []
for i in infos.values():
    total = dict(i.resources_total)
    mine = free.get(i.node_id, {})
    nodes.append({"ip": i.node_manager_address, "alive": i.state == GcsNodeInfo.GcsNodeState.Value("ALIVE"),
                  "total": total, "free": {k: mine.get(k, 0.0) for k in total}})
print(json.dumps({"nodes": nodes}))
"#;

/// What the GCS showed.
#[derive(Debug, Clone, Default, PartialEq)]
pub(crate) struct ClusterView {
    /// Nodes alive.
    pub(crate) nodes: u32,
    /// Their addresses.
    pub(crate) alive: Vec<String>,
    /// Free and total of each resource that the gate knows (`CPU`, `GPU`).
    pub(crate) cpus: (f64, f64),
    pub(crate) gpus: (f64, f64),
}

impl Cluster {
    /// What the cluster lacks for a start, in words; `None`: nothing.
    pub(crate) fn missing(&self, v: &ClusterView) -> Option<String> {
        let mut lack = Vec::new();
        if v.nodes < self.min_nodes {
            lack.push(format!("{} of {} nodes alive", v.nodes, self.min_nodes));
        }
        for (name, need, (free, total)) in [("CPUs", self.min_cpus, v.cpus), ("GPUs", self.min_gpus, v.gpus)] {
            if need > 0.0 && free < need {
                lack.push(format!("{} of {} {name} free ({} in the cluster)", num(free), num(need), num(total)));
            }
        }
        (!lack.is_empty()).then(|| lack.join(", "))
    }

    /// The argv that asks the cluster: the Python, found beside the
    /// child's program when it names no folder (the venv that runs `vllm`
    /// or `ray start`), else on `PATH`; the look; the address.
    pub(crate) fn command(&self, child: &[String]) -> Vec<String> {
        let mut python = self.python.clone();
        if !python.contains('/')
            && let Some(found) = beside(child, &python)
        {
            python = found.to_string_lossy().into_owned();
        }
        vec![python, "-c".into(), ASK_GCS.into(), self.address.clone()]
    }
}

/// `program` in the folder of the child's program, if it is there.
fn beside(child: &[String], program: &str) -> Option<PathBuf> {
    let dir = Path::new(child.first()?).parent().filter(|d| !d.as_os_str().is_empty())?;
    let candidate = dir.join(program);
    use std::os::unix::fs::PermissionsExt;
    let meta = std::fs::metadata(&candidate).ok()?;
    (meta.is_file() && meta.permissions().mode() & 0o111 != 0).then_some(candidate)
}

/// Why the look at the cluster gave no view of it; each says so in words
/// fit for `STATUS=`.
#[derive(Debug, thiserror::Error)]
pub(crate) enum RayError {
    #[error("{0} is not HOST:PORT")]
    NotHostPort(String),
    #[error("cannot resolve {host}: {source}")]
    Resolve { host: String, source: std::io::Error },
    #[error("{0} has no address")]
    NoAddress(String),
    #[error("nothing answers at {address} ({source})")]
    Refused { address: String, source: std::io::Error },
    #[error("no answer from {} within {}", .0, humantime::format_duration(CONNECT_TIMEOUT))]
    ConnectTimeout(String),
    /// The program of the look is not installed.
    #[error("{0} not found")]
    NotFound(String),
    #[error("the look at the Ray cluster took over {} (killed)", humantime::format_duration(STATUS_TIMEOUT))]
    TimedOut,
    /// The look could not be run.
    #[error("{0}")]
    Failed(String),
    #[error("the Ray cluster answered: {0}")]
    Answer(#[source] AnswerError),
}

/// Why the look's output is not a view of the cluster.
#[derive(Debug, thiserror::Error)]
pub(crate) enum AnswerError {
    /// No JSON line: the last line (one line, escaped), or that there was
    /// no output.
    #[error("{0}")]
    NoJson(String),
    #[error("not the answer asked for: {0}")]
    NotTheAnswer(serde_json::Error),
}

/// Ask the cluster at `address` with `argv` (from [`Cluster::command`])
/// under [`STATUS_TIMEOUT`]; `Err` says why there is no answer.
pub(crate) async fn ask(argv: &[String], address: &str) -> Result<ClusterView, RayError> {
    use crate::process::prestart::QueryError;
    let program = argv.first().map(String::as_str).unwrap_or_default();
    // Ray's client takes 40 s to give up on an address where nothing
    // listens, and a second of CPU to start: a refused connection says
    // the same at once.
    reachable(address).await?;
    match crate::process::prestart::run_command(argv, STATUS_TIMEOUT, 1 << 20, true).await {
        Ok(Some(out)) => parse_answer(&out).map_err(RayError::Answer),
        Ok(None) => Err(RayError::NotFound(program.to_string())),
        Err(QueryError::TimedOut(_)) => Err(RayError::TimedOut),
        Err(QueryError::Failed(e)) => Err(RayError::Failed(e)),
    }
}

/// How long a connection to the head's GCS port may take to open.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(3);

/// Whether something accepts connections at `address` (`HOST:PORT`).
async fn reachable(address: &str) -> Result<(), RayError> {
    let host_port = address.replace(['[', ']'], "");
    let attempt = async {
        let (host, port) = host_port.rsplit_once(':').ok_or_else(|| RayError::NotHostPort(address.to_string()))?;
        let port: u16 = port.parse().map_err(|_| RayError::NotHostPort(address.to_string()))?;
        let addrs: Vec<std::net::SocketAddr> = tokio::net::lookup_host((host, port))
            .await
            .map_err(|source| RayError::Resolve { host: host.to_string(), source })?
            .collect();
        let mut last = RayError::NoAddress(host.to_string());
        for a in addrs {
            match tokio::net::TcpStream::connect(a).await {
                Ok(_) => return Ok(()),
                Err(source) => last = RayError::Refused { address: address.to_string(), source },
            }
        }
        Err(last)
    };
    match tokio::time::timeout(CONNECT_TIMEOUT, attempt).await {
        Ok(r) => r,
        Err(_) => Err(RayError::ConnectTimeout(address.to_string())),
    }
}

/// What shows that a Ray node is in its cluster.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Member {
    /// A node alive at this address (the node's `--node-ip-address`).
    At(String),
    /// At least this many nodes alive (the node's address is Ray's
    /// choice: a head counts 1, a joining node 2, the head and itself).
    Count(u32),
}

impl Member {
    /// How a node started with `command` is seen in its cluster.
    pub(crate) fn of(command: &[String], head: bool) -> Member {
        match flag(command, "--node-ip-address") {
            Some(ip) => Member::At(ip),
            None => Member::Count(if head { 1 } else { 2 }),
        }
    }

    fn seen(&self, v: &ClusterView) -> bool {
        match self {
            Member::At(ip) => v.alive.iter().any(|a| a == ip),
            Member::Count(n) => v.nodes >= *n,
        }
    }
}

/// Look at the cluster until it has `member` alive: a Ray node's ready
/// line says its processes started, this that the cluster has it. The
/// start's own deadlines (`ready.timeout`) bound the wait.
pub(crate) async fn confirm(argv: &[String], address: &str, member: &Member) {
    let mut delay = Duration::from_millis(500);
    loop {
        match ask(argv, address).await {
            Ok(view) if member.seen(&view) => return,
            Ok(view) => tracing::info!(
                EVENT = "ray",
                "the Ray cluster does not show this node alive yet ({} node(s) alive: {})",
                view.nodes,
                view.alive.join(", ")
            ),
            Err(e) => tracing::info!(EVENT = "ray", "the Ray cluster does not answer yet: {e}"),
        }
        tokio::time::sleep(delay).await;
        delay = (delay * 2).min(Duration::from_secs(5));
    }
}

/// A count without a needless fraction: `2`, `0.5`.
fn num(x: f64) -> String {
    if x.fract() == 0.0 && x.abs() < 1e15 { format!("{}", x as i64) } else { format!("{x}") }
}

/// One node as the look prints it.
#[derive(Debug, serde::Deserialize)]
struct Node {
    ip: String,
    alive: bool,
    total: std::collections::BTreeMap<String, f64>,
    free: std::collections::BTreeMap<String, f64>,
}

#[derive(Debug, serde::Deserialize)]
struct Answer {
    nodes: Vec<Node>,
}

/// Reads the look's output: its last line that is a JSON object is the
/// answer (Ray's client may log warnings before it); without one, the
/// last line is the error (a Python exception).
pub(crate) fn parse_answer(text: &str) -> Result<ClusterView, AnswerError> {
    let lines = || text.lines().rev().map(str::trim).filter(|l| !l.is_empty());
    let Some(json) = lines().find(|l| l.starts_with('{')) else {
        return Err(AnswerError::NoJson(crate::util::escape::one_line(lines().next().unwrap_or("no output"), 300)));
    };
    let answer: Answer = serde_json::from_str(json).map_err(AnswerError::NotTheAnswer)?;
    let mut view = ClusterView::default();
    let sum = |into: &mut (f64, f64), n: &Node, name: &str| {
        let (free, total) = (n.free.get(name).copied().unwrap_or(0.0), n.total.get(name).copied().unwrap_or(0.0));
        if free.is_finite() && total.is_finite() {
            *into = (into.0 + free.max(0.0), into.1 + total.max(0.0));
        }
    };
    for n in answer.nodes.iter().filter(|n| n.alive) {
        view.nodes = view.nodes.saturating_add(1);
        view.alive.push(n.ip.clone());
        sum(&mut view.cpus, n, "CPU");
        sum(&mut view.gpus, n, "GPU");
    }
    Ok(view)
}

/// The folder a Ray node keeps its sessions in: `--temp-dir`, else
/// `RAY_TMPDIR` or `TMPDIR` (the child's environment first, then the
/// warden's) followed by `/ray`, else `/tmp/ray` — as Ray chooses it.
pub(crate) fn temp_dir(command: &[String], env: &std::collections::BTreeMap<String, String>) -> PathBuf {
    if let Some(dir) = flag(command, "--temp-dir") {
        return PathBuf::from(dir);
    }
    let var = |name: &str| env.get(name).cloned().or_else(|| std::env::var(name).ok()).filter(|v| !v.is_empty());
    if let Some(dir) = var("RAY_TMPDIR") {
        return PathBuf::from(dir);
    }
    PathBuf::from(var("TMPDIR").unwrap_or_else(|| "/tmp".into())).join("ray")
}

/// What a Ray node leaves in its temporary folder: a `session_*` folder
/// per start (logs, sockets, runtime resources; a few MB each), the
/// `session_latest` link to the newest, and `ray_current_cluster` (the
/// address a joining node last used).
const SESSION_PREFIX: &str = "session_";
const LATEST: &str = "session_latest";
const CURRENT_CLUSTER: &str = "ray_current_cluster";

/// Remove from `dir` the session folders of `uid` that no live process
/// uses (none has a file open or its working folder inside), then the
/// `session_latest` link when what it names is gone, and
/// `ray_current_cluster` when no session is left in use. Nothing else is
/// touched; a folder is removed without following a link inside it.
pub(crate) fn clean_sessions(dir: &Path, uid: u32) -> crate::process::prestart::Cleaned {
    use std::os::unix::fs::MetadataExt;
    let mut out = crate::process::prestart::Cleaned::default();
    let Ok(entries) = std::fs::read_dir(dir) else { return out };
    let mut sessions = Vec::new();
    for e in entries.flatten() {
        let name = e.file_name();
        let Some(name) = name.to_str() else { continue };
        if name == LATEST || !name.starts_with(SESSION_PREFIX) {
            continue;
        }
        let Ok(meta) = std::fs::symlink_metadata(e.path()) else { continue };
        if !meta.is_dir() {
            continue;
        }
        if meta.uid() != uid {
            out.kept.push((e.path(), format!("owned by uid {}", meta.uid())));
            continue;
        }
        sessions.push(e.path());
    }
    sessions.sort();
    let used = if sessions.is_empty() { Default::default() } else { used_folders(&sessions) };
    for path in sessions {
        if let Some(pids) = used.get(&path) {
            let who: Vec<String> = pids.iter().map(|p| format!("pid {p}")).collect();
            out.kept.push((path, format!("in use by {}", who.join(", "))));
            continue;
        }
        match std::fs::remove_dir_all(&path) {
            Ok(()) => out.removed.push(path),
            Err(e) => out.kept.push((path, format!("cannot remove: {e}"))),
        }
    }
    let latest = dir.join(LATEST);
    if std::fs::symlink_metadata(&latest).is_ok_and(|m| m.file_type().is_symlink() && m.uid() == uid)
        && std::fs::metadata(&latest).is_err()
        && std::fs::remove_file(&latest).is_ok()
    {
        out.removed.push(latest);
    }
    let current = dir.join(CURRENT_CLUSTER);
    if used.is_empty()
        && std::fs::symlink_metadata(&current).is_ok_and(|m| m.is_file() && m.uid() == uid)
        && std::fs::remove_file(&current).is_ok()
    {
        out.removed.push(current);
    }
    out
}

/// Those of `folders` that a live process has a file open in, or works
/// in, with the pids: one pass over `/proc`, comparing the kernel's names
/// of open files with each folder's real path.
fn used_folders(folders: &[PathBuf]) -> std::collections::HashMap<PathBuf, std::collections::BTreeSet<i32>> {
    let mut out: std::collections::HashMap<PathBuf, std::collections::BTreeSet<i32>> = Default::default();
    let real: Vec<(PathBuf, &PathBuf)> =
        folders.iter().filter_map(|f| std::fs::canonicalize(f).ok().map(|r| (r, f))).collect();
    for pid in crate::process::child::processes() {
        let fds = std::fs::read_dir(format!("/proc/{pid}/fd")).into_iter().flatten().flatten().map(|e| e.path());
        for link in fds.chain([PathBuf::from(format!("/proc/{pid}/cwd"))]) {
            let Ok(target) = std::fs::read_link(&link) else { continue };
            if let Some((_, f)) = real.iter().find(|(r, _)| target.starts_with(r)) {
                out.entry((*f).clone()).or_default().insert(pid);
            }
        }
    }
    out
}

#[cfg(test)]
mod tests;
