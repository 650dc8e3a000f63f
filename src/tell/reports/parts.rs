//! The parts of a report: the tree, the log's tail and its tracebacks, the
//! commands' output, the kernel's messages, the patched files.

use std::collections::{BTreeMap, HashMap, VecDeque};
use std::fmt::Write as _;
use std::fs;
use std::io::{self, Read, Seek};
use std::os::fd::AsRawFd;
use std::os::unix::fs::DirBuilderExt;
use std::path::Path;
use std::sync::LazyLock;
use std::time::{Duration, SystemTime};

use regex::Regex;

use super::*;
use crate::process::child::ProcStat;
use crate::process::prestart::QueryError;
use crate::supervisor::classify::Classifier;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Part {
    PySpy(i32),
    Gpu,
    Kernel,
}

/// One command's output into its file; the summary's note on it.
pub(super) fn write_output(
    dir: &Path,
    py_spy_dir: &Path,
    part: Part,
    program: &str,
    result: Result<Option<String>, QueryError>,
) -> (String, String) {
    let (key, folder, file) = match part {
        Part::PySpy(pid) => (format!("{PY_SPY}/{pid}.txt"), py_spy_dir, format!("{pid}.txt")),
        Part::Gpu => (GPU.to_string(), dir, GPU.to_string()),
        Part::Kernel => (KERNEL.to_string(), dir, KERNEL.to_string()),
    };
    let (text, note) = match result {
        Ok(None) => {
            // A missing program: one line saying so (and no py-spy folder).
            if matches!(part, Part::PySpy(_)) {
                return (PY_SPY.to_string(), format!("{program} not found on PATH"));
            }
            (format!("{program} not found on PATH\n"), format!("{program} not found"))
        }
        Ok(Some(out)) => match part {
            Part::Kernel => {
                let faults: Vec<String> =
                    out.lines().filter(|l| crate::observe::kernel::gpu_related(l)).map(String::from).collect();
                let since = crate::observe::kernel::Since { gpu: faults, all: out.lines().count() as u64, cut: false };
                kernel_text(&since)
            }
            _ => (masked(&out), format!("written ({} bytes)", out.len())),
        },
        Err(QueryError::TimedOut(why)) | Err(QueryError::Failed(why)) => (format!("{why}\n"), why),
    };
    if folder != dir
        && let Err(e) = fs::DirBuilder::new().mode(0o750).create(folder)
        && e.kind() != io::ErrorKind::AlreadyExists
    {
        return (key, format!("cannot create {}: {e}", folder.display()));
    }
    match create(folder, &file, text.as_bytes()) {
        Ok(()) => (key, note),
        Err(e) => (key, format!("cannot write: {e}")),
    }
}

/// `kernel.txt` and its note.
pub(super) fn kernel_text(since: &crate::observe::kernel::Since) -> (String, String) {
    let (n, all) = (since.gpu.len(), since.all);
    let mut text = format!("# kernel messages since the run's spawn that concern the GPUs: {n} of {all}\n");
    if since.cut {
        text.push_str("# (the oldest of them were not kept)\n");
    }
    for l in &since.gpu {
        text.push_str(&masked(l));
        text.push('\n');
    }
    (text, format!("written: {n} of {all} kernel message(s) concern the GPUs"))
}

/// `kernel.txt` from what the warden's follower read; the note.
pub(super) fn write_kernel(dir: &Path, since: &crate::observe::kernel::Since) -> String {
    let (text, note) = kernel_text(since);
    match create(dir, KERNEL, text.as_bytes()) {
        Ok(()) => note,
        Err(e) => format!("cannot write: {e}"),
    }
}

/// The run's log, opened when it was taken, and where it ended then.
pub(super) type Log = io::Result<(fs::File, u64)>;

/// What describes the run as it was, taken before anything is written.
pub(super) struct Look {
    /// `tree.txt`, and how many processes it names, how many Python.
    pub(super) tree: (String, usize, usize),
    /// The tree's Python processes.
    pub(super) pythons: Vec<i32>,
    pub(super) log: Log,
}

/// The tree, described; the log opened, and where it ends.
pub(super) fn look(job: &Job) -> Look {
    let tree = if job.gone() { Vec::new() } else { crate::process::child::descendants(job.warden) };
    let pythons: Vec<i32> = tree.iter().filter(|p| is_python(p.pid)).map(|p| p.pid).collect();
    let text = describe_tree(&tree);
    let log = match &job.log_taken {
        // A file of its own on the same inode: the child's descriptor
        // shares its offset.
        Some((f, end)) => fs::File::open(format!("/proc/self/fd/{}", f.as_raw_fd())).map(|f| (f, *end)),
        None => fs::File::open(&job.log_file).and_then(|f| {
            let end = f.metadata()?.len();
            Ok((f, end))
        }),
    };
    Look { tree: (text, tree.len(), pythons.len()), pythons, log }
}

/// The report's folder and `tree.txt`: the parts so far, and their notes.
pub(super) fn make_folder(
    job: &Job,
    dir: &Path,
    tree: &(String, usize, usize),
) -> io::Result<BTreeMap<String, String>> {
    let root = job.state_dir.join(FOLDER);
    fs::DirBuilder::new().recursive(true).mode(0o750).create(&root)?;
    // The folder of every report is made here, never found: a name taken
    // (a report of the same millisecond) is an error, not a reuse.
    fs::DirBuilder::new().mode(0o750).create(dir)?;
    let (text, n, pythons) = tree;
    let note = match create(dir, TREE, text.as_bytes()) {
        Ok(()) => format!("written: {n} process(es), {pythons} of them Python"),
        Err(e) => format!("cannot write: {e}"),
    };
    Ok(BTreeMap::from([(TREE.to_string(), note)]))
}

/// `log-tail.txt`, from the log as it was taken, and the first
/// `summary.json`: the summary.
pub(super) fn log_parts(job: &Job, dir: &Path, mut parts: BTreeMap<String, String>, log: Log) -> io::Result<Summary> {
    let tail = log.and_then(|(f, end)| {
        let version = vllm_version(&f, job.log_offset, end);
        let tail =
            log_tail(&f, &job.log_file, job.log_offset, end, job.settings.lines as usize, job.classifier.clone());
        tail.map(|t| (t, version))
    });
    let (note, version) = match tail {
        Ok((tail, version)) => {
            let n = format!("written: {} line(s), {} traceback group(s)", tail.lines, tail.groups);
            let note = match create(dir, LOG_TAIL, tail.text.as_bytes()) {
                Ok(()) => n,
                Err(e) => format!("cannot write: {e}"),
            };
            (note, version)
        }
        Err(e) => {
            let why = format!("cannot read {}: {e}", job.log_file.display());
            let _ = create(dir, LOG_TAIL, format!("{why}\n").as_bytes());
            (why, None)
        }
    };
    parts.insert(LOG_TAIL.to_string(), note);

    let o = &job.order;
    let at = |d: Duration| rfc3339(job.spawned + d);
    let summary = Summary {
        instance: job.instance.clone(),
        start: o.start,
        attempt: o.attempt,
        pid: Some(o.pid),
        cause: masked(&o.cause),
        class: o.class,
        hint: o.hint.as_deref().map(masked),
        timings: Timings {
            spawn: rfc3339(job.spawned),
            first_progress: o.first_progress.map(at),
            ready: o.ready.map(at),
            failure: at(o.failed),
            report_begun: rfc3339(job.begun),
            report_done: None,
        },
        exit: o.exit.map(|e| e.to_string()),
        warden_version: env!("CARGO_PKG_VERSION").to_string(),
        vllm_version: version,
        config_sha256: job.config_sha256.clone(),
        patched_files: patched_files(&job.state_dir),
        parts,
        complete: false,
    };
    write_summary(dir, &summary)?;
    Ok(summary)
}

/// The files the patches changed, as their manifest records them.
pub(super) fn patched_files(state_dir: &Path) -> Vec<PatchedFile> {
    let Ok(Some(manifest)) = crate::patch::manifest(state_dir) else { return Vec::new() };
    manifest
        .files
        .into_iter()
        .map(|(file, e)| PatchedFile {
            file: masked(&file.display().to_string()),
            original_sha256: e.original_sha256,
            patched_sha256: e.patched_sha256,
        })
        .collect()
}

/// Whether a process runs a Python interpreter (its executable's name;
/// vLLM renames its processes' titles, not their executables).
pub(super) fn is_python(pid: i32) -> bool {
    fs::read_link(format!("/proc/{pid}/exe"))
        .ok()
        .and_then(|p| p.file_name().map(|n| n.to_string_lossy().starts_with("python")))
        .unwrap_or(false)
}

pub(super) fn read_proc(pid: i32, what: &str) -> String {
    fs::File::open(format!("/proc/{pid}/{what}"))
        .and_then(|f| {
            let mut out = Vec::new();
            f.take(PROC_MAX).read_to_end(&mut out)?;
            Ok(out)
        })
        .map(|b| String::from_utf8_lossy(&b).into_owned())
        .unwrap_or_default()
}

pub(super) fn field<'a>(status: &'a str, name: &str) -> Option<&'a str> {
    status.lines().find_map(|l| l.strip_prefix(name).and_then(|r| r.strip_prefix(':'))).map(str::trim)
}

/// Boot time (seconds since the epoch) and clock ticks a second, for the
/// start times in `/proc/PID/stat`.
pub(super) fn clock() -> Option<(u64, u64)> {
    let stat = fs::read_to_string("/proc/stat").ok()?;
    let btime = stat.lines().find_map(|l| l.strip_prefix("btime "))?.trim().parse().ok()?;
    let tck = nix::unistd::sysconf(nix::unistd::SysconfVar::CLK_TCK).ok()??;
    Some((btime, u64::try_from(tck).ok().filter(|t| *t > 0)?))
}

/// `tree.txt`: one process a line, parents first.
pub(crate) fn describe_tree(tree: &[ProcStat]) -> String {
    let clock = clock();
    let mut out = format!(
        "# the server's process tree when the run failed: {} process(es)\n{:<8} {:<8} {:<16} {:<24} {:<24} {:>10}  {}\n",
        tree.len(),
        "PID",
        "PPID",
        "STATE",
        "WCHAN",
        "STARTED",
        "RSS",
        "COMMAND"
    );
    for p in tree {
        let status = read_proc(p.pid, "status");
        let state = field(&status, "State").map(String::from).unwrap_or_else(|| p.state.to_string());
        let rss = field(&status, "VmRSS").unwrap_or("-").to_string();
        let wchan = match read_proc(p.pid, "wchan").trim() {
            "" | "0" => "-".to_string(),
            w => w.to_string(),
        };
        let started = clock
            .map(|(btime, tck)| {
                let t = SystemTime::UNIX_EPOCH
                    + Duration::from_secs(btime)
                    + Duration::from_millis(p.start_time * 1000 / tck);
                humantime::format_rfc3339_seconds(t).to_string()
            })
            .unwrap_or_else(|| format!("{} ticks", p.start_time));
        let raw = read_proc(p.pid, "cmdline");
        let argv: Vec<String> = raw.split('\0').filter(|a| !a.is_empty()).map(String::from).collect();
        let command = if argv.is_empty() {
            format!("[{}]", read_proc(p.pid, "comm").trim())
        } else {
            crate::util::redact::command(&argv)
        };
        let one = |s: &str, n| crate::util::escape::one_line(s, n);
        let _ = writeln!(
            out,
            "{:<8} {:<8} {:<16} {:<24} {:<24} {:>10}  {}",
            p.pid,
            p.ppid,
            one(&state, 16),
            one(&wchan, 64),
            started,
            one(&rss, 16),
            one(&command, 4096)
        );
    }
    out
}

/// vLLM's version, from its banner near the start of the run's log
/// (`… api_utils.py:347]  ▄▄ ▄█ █ … version 0.32.0`, or, from older
/// versions, `vLLM API server version 0.6.3`).
pub(super) fn vllm_version(mut f: &fs::File, offset: u64, end: u64) -> Option<String> {
    static VERSION: LazyLock<Regex> = LazyLock::new(|| {
        Regex::new(r"(?:vLLM API server version|█\s+version|vLLM version)\s+v?(\d+\.\d+[0-9A-Za-z.+_-]*)")
            .expect("static regex")
    });
    f.seek(io::SeekFrom::Start(offset)).ok()?;
    let mut buf = Vec::new();
    f.take(VERSION_SCAN.min(end.saturating_sub(offset))).read_to_end(&mut buf).ok()?;
    let text = String::from_utf8_lossy(&buf);
    let v = VERSION.captures(&text)?.get(1)?.as_str();
    Some(crate::util::escape::one_line(v, 64))
}

/// What `log-tail.txt` holds.
pub(super) struct Tail {
    pub(super) text: String,
    pub(super) lines: usize,
    pub(super) groups: usize,
}

/// The last `keep` lines of the run's log `f` (at `log`) from `offset` to
/// `len`, and the traceback groups seen in it in full, masked. At most the
/// last [`LOG_SCAN`] bytes are read, in pieces: never the whole file at once.
pub(super) fn log_tail(
    mut f: &fs::File,
    log: &Path,
    offset: u64,
    len: u64,
    keep: usize,
    mut classifier: Classifier,
) -> io::Result<Tail> {
    let mut notes = Vec::new();
    let from = if len < offset {
        notes.push(format!("the log is shorter than where the run began (offset {offset}): read from its start"));
        0
    } else if len - offset > LOG_SCAN {
        notes.push(format!("the run's log holds {} MiB: its last {} MiB read", (len - offset) >> 20, LOG_SCAN >> 20));
        len - LOG_SCAN
    } else {
        offset
    };
    f.seek(io::SeekFrom::Start(from))?;
    let mut reader = io::BufReader::new((&mut f).take(len - from));
    if from != offset && from != 0 {
        // A cut read begins inside a line: skip to the next one.
        let mut piece = Vec::new();
        io::BufRead::read_until(
            &mut (&mut reader).take(crate::supervisor::classify::MAX_LINE as u64),
            b'\n',
            &mut piece,
        )?;
    }
    classifier.reset();
    let mut splitter = crate::supervisor::classify::Splitter::default();
    let mut tail: VecDeque<String> = VecDeque::with_capacity(keep.min(1 << 16));
    let mut tb = Tracebacks::default();
    let mut total = 0usize;
    let mut buf = vec![0u8; 64 * 1024];
    loop {
        let n = reader.read(&mut buf)?;
        if n == 0 {
            break;
        }
        splitter.feed(&buf[..n], |line| {
            total += 1;
            let line = cut(line);
            tb.line(&line, &mut classifier);
            if keep > 0 {
                if tail.len() == keep {
                    tail.pop_front();
                }
                tail.push_back(line);
            }
        });
    }
    let groups = tb.groups.len();
    let mut text = format!(
        "# the last {} of {total} line(s) of the run's log {}, then its {groups} traceback group(s) in full\n",
        tail.len(),
        log.display()
    );
    for n in notes {
        let _ = writeln!(text, "# {n}");
    }
    for l in &tail {
        text.push_str(&masked(l));
        text.push('\n');
    }
    for (i, (_, lines)) in tb.groups.iter().enumerate() {
        let _ = writeln!(text, "\n# traceback group {} of {groups}", i + 1);
        for l in lines {
            text.push_str(&masked(l));
            text.push('\n');
        }
    }
    Ok(Tail { text, lines: tail.len(), groups })
}

/// A line as kept: at most [`LINE_MAX`] bytes.
pub(super) fn cut(line: &str) -> String {
    if line.len() <= LINE_MAX {
        return line.to_string();
    }
    let mut end = LINE_MAX;
    while !line.is_char_boundary(end) {
        end -= 1;
    }
    format!("{}…", &line[..end])
}

/// The traceback groups of a log, as the classifier tells them: the lines
/// of each process from `Traceback (most recent call last):` to the
/// exception line, chained tracebacks in one group. Bounded: the latest
/// [`GROUPS_MAX`] groups, [`GROUP_LINES`] lines each.
#[derive(Default)]
pub(super) struct Tracebacks {
    /// Per process: the lines of a traceback not yet ended.
    pub(super) open: HashMap<String, Vec<String>>,
    /// Per process: the group of its last exception (a chain marker joins it).
    pub(super) last: HashMap<String, u64>,
    pub(super) groups: BTreeMap<u64, Vec<String>>,
}

impl Tracebacks {
    pub(super) fn line(&mut self, line: &str, c: &mut Classifier) {
        let (process, message) = crate::supervisor::classify::process_and_message(line);
        let exception = c.classify_ref(line).line.and_then(|l| l.exception);
        if message.starts_with("Traceback (most recent call last)") {
            if self.open.len() >= crate::supervisor::classify::TRACEBACK_PROCESSES {
                self.open.clear();
            }
            self.open.insert(process.to_string(), Vec::new());
        }
        if let Some(lines) = self.open.get_mut(process) {
            if lines.len() < GROUP_LINES {
                lines.push(line.to_string());
            }
        } else if (message.starts_with("During handling of the above exception")
            || message.starts_with("The above exception was the direct cause"))
            && let Some(g) = self.last.get(process)
            && let Some(lines) = self.groups.get_mut(g)
            && lines.len() < GROUP_LINES
        {
            lines.push(line.to_string());
        }
        if let Some(exc) = exception {
            let lines = self.open.remove(process).unwrap_or_else(|| vec![line.to_string()]);
            let group = self.groups.entry(exc.group).or_default();
            let room = GROUP_LINES.saturating_sub(group.len());
            group.extend(lines.into_iter().take(room));
            if self.last.len() >= crate::supervisor::classify::TRACEBACK_PROCESSES {
                self.last.clear();
            }
            self.last.insert(process.to_string(), exc.group);
            while self.groups.len() > GROUPS_MAX {
                self.groups.pop_first();
            }
        }
    }
}
