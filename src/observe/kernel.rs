//! GPU faults from the kernel's messages. While a run lives, a source
//! command (by default `journalctl -k -f -n 0 -o json`: new kernel messages
//! as they come, one journal entry a line) is followed; a line of a fatal
//! NVIDIA Xid class about one of the instance's GPUs (every GPU, when they
//! cannot be told) ends the run with a permanent cause: no restart loop
//! against a dead GPU. A line of a class that does not end the process
//! ([`RECHECK_XIDS`]) about one of the instance's GPUs calls for the serving
//! model's answers to be checked again: after an MMU fault a server has
//! been seen answering 200 with garbage.
//!
//! Only the kernel's own messages count, read as the kernel writes them
//! ([`parse`]): a `/dev/kmsg` record (`PRI,SEQ,USEC,FLAGS;MESSAGE`) or a
//! journal entry (`journalctl -o json`) of facility 0. Whatever userspace
//! writes to `/dev/kmsg` is stored with another facility (`user` unless it
//! names one), and a line that does not say its facility (the journal's
//! short formats, `dmesg`) cannot be told from one: it counts for nothing.
//! A fault is the NVIDIA driver's message as the driver writes it, `NVRM:`
//! at the start of the message: the kernel's own lines quote text that
//! anyone chooses (a segfault line quotes the program's file name).
//!
//! The follower is a helper of the warden (its own process group, not part
//! of the child's tree, killed when the run ends). It keeps the latest
//! of the kernel's messages that concern the GPUs, numbered among all it
//! read, so that a failure report can take those of a run without running
//! a command (see [`Mark`]). What a fault leads to is not known here.

use std::collections::VecDeque;
use std::io::BufRead;
use std::process::{Command, Stdio};
use std::sync::{Arc, LazyLock, Mutex};

use regex::Regex;

/// The Xid classes that mean the GPU (or its memory) needs a reset or a
/// reboot, with NVIDIA's names for them:
/// 48 double-bit ECC error, 62 internal micro-controller halt, 79 GPU has
/// fallen off the bus, 92 high single-bit ECC error rate, 94 contained ECC
/// error, 95 uncontained ECC error, 119 GSP RPC timeout, 154 GPU recovery
/// action changed (a reset or reboot is required).
pub(crate) const FATAL_XIDS: &[(u32, &str)] = &[
    (48, "double-bit ECC error"),
    (62, "internal micro-controller halt"),
    (79, "GPU has fallen off the bus"),
    (92, "high single-bit ECC error rate"),
    (94, "contained ECC error"),
    (95, "uncontained ECC error"),
    (119, "GSP RPC timeout"),
    (154, "GPU recovery action changed"),
];

/// The Xid classes that leave the process running but may leave its
/// answers wrong, with what they mean (NVIDIA's Xid catalogue): the
/// serving model is taken out of rotation and its golden answers are asked
/// again.
pub(crate) const RECHECK_XIDS: &[(u32, &str)] = &[
    // An exception in the graphics engine (a kernel's illegal address or
    // instruction); usually the application's, the context may be damaged.
    (13, "graphics engine exception"),
    // An illegal memory access (MMU fault): a server was seen answering
    // HTTP 200 with prompt-independent punctuation after one.
    (31, "GPU memory page fault"),
    // The GPU stopped processing a channel (the context is torn down).
    (43, "GPU stopped processing"),
    // Channels cleaned up pre-emptively after an earlier error.
    (45, "preemptive cleanup, due to previous errors"),
    // A page retired or a row remapped after ECC errors (memory moved).
    (63, "ECC page retirement or row remapping recording event"),
    // The retirement or remapping could not be recorded.
    (64, "ECC page retirement or row remapper recording failure"),
    // The video decoder's exception.
    (68, "NVDEC0 exception"),
    // A graphics engine class error (a bad method or argument).
    (69, "graphics engine class error"),
    // An NVLink error (a link between GPUs retrained or down).
    (74, "NVLink error"),
];

/// `NVRM: Xid (PCI:0000:41:00): 79, pid=1234, name=python3, GPU has fallen off the bus.`,
/// the driver's message from its start.
static XID: LazyLock<Regex> = LazyLock::new(|| {
    Regex::new(r"^NVRM: Xid \(PCI:([0-9A-Fa-f]{4}:[0-9A-Fa-f]{2}:[0-9A-Fa-f]{2}(?:\.[0-7])?)\): (\d{1,9})(?:,|$)")
        .expect("static regex")
});
/// `NVRM: GPU at PCI:0000:41:00: GPU-… has fallen off the bus.`, or
/// `NVRM: GPU 0000:41:00.0: GPU has fallen off the bus.`
static OFF_THE_BUS: LazyLock<Regex> = LazyLock::new(|| {
    Regex::new(
        r"^NVRM: GPU (?:at PCI:)?([0-9A-Fa-f]{4}:[0-9A-Fa-f]{2}:[0-9A-Fa-f]{2}(?:\.[0-7])?): .*fallen off the bus",
    )
    .expect("static regex")
});
/// The OOM killer's line: `Out of memory: Killed process 4242 (python3) …`,
/// `Memory cgroup out of memory: Killed process …`, or `Killed process …`
/// alone (kernels before 5.1), from the message's start.
static OOM_KILL: LazyLock<Regex> = LazyLock::new(|| {
    Regex::new(r"^(?:(?:Memory cgroup out|Out) of memory(?: \([a-z_]+\))?: )?Killed process \d+ \(")
        .expect("static regex")
});

/// One line of the source, read as the kernel writes its messages.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Read {
    /// A message: its facility (0 is the kernel's own) and its text.
    Message(Message),
    /// A `/dev/kmsg` record's dictionary line (` SUBSYSTEM=pci`), or a
    /// journal entry without a message: nothing to read.
    Nothing,
    /// A line that does not say its facility (the journal's short formats,
    /// `dmesg`): it cannot be told from text that userspace wrote.
    Unknown,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Message {
    /// The syslog facility: 0 for the kernel's own messages.
    pub(crate) facility: u32,
    /// The message, as the kernel wrote it (a `/dev/kmsg` record's
    /// escapes, `\x0a`, kept).
    pub(crate) text: String,
    /// The line as a failure report shows it: the time the source gave
    /// (seconds since boot, or the journal's date) and the message on one
    /// line.
    pub(crate) shown: String,
}

impl Message {
    /// One of the kernel's own messages.
    pub(crate) fn is_kernel(&self) -> bool {
        self.facility == 0
    }
}

/// One line of the source: a `/dev/kmsg` record (`6,1234,5678901,-;text`:
/// the priority is facility × 8 + level) or a journal entry as
/// `journalctl -o json` writes it (`_TRANSPORT` `kernel`, the facility in
/// `SYSLOG_FACILITY`, which older journald left out of the kernel's own;
/// `MESSAGE` a string, or its bytes when they are not UTF-8).
pub(crate) fn parse(line: &str) -> Read {
    static KMSG: LazyLock<Regex> =
        LazyLock::new(|| Regex::new(r"^(\d{1,10}),\d{1,20},(\d{1,20}),[^;]*;").expect("static regex"));
    let line = line.trim_end_matches(['\n', '\r']);
    if let Some(c) = KMSG.captures(line) {
        let Ok(priority) = c[1].parse::<u32>() else { return Read::Unknown };
        let usec: u64 = c[2].parse().unwrap_or(0);
        let text = line[c.get(0).map_or(0, |m| m.end())..].to_string();
        let shown = format!("[{:5}.{:06}] {}", usec / 1_000_000, usec % 1_000_000, shown(&text));
        return Read::Message(Message { facility: priority >> 3, text, shown });
    }
    if line.starts_with(' ') && line.contains('=') {
        return Read::Nothing;
    }
    if !line.starts_with('{') {
        return Read::Unknown;
    }
    let Ok(entry) = serde_json::from_str::<serde_json::Map<String, serde_json::Value>>(line) else {
        return Read::Unknown;
    };
    let field = |k: &str| entry.get(k).and_then(serde_json::Value::as_str);
    let text = match entry.get("MESSAGE") {
        Some(serde_json::Value::String(s)) => s.clone(),
        Some(serde_json::Value::Array(bytes)) => {
            let bytes: Vec<u8> = bytes.iter().filter_map(|b| b.as_u64().and_then(|b| u8::try_from(b).ok())).collect();
            String::from_utf8_lossy(&bytes).into_owned()
        }
        _ => return Read::Nothing,
    };
    // Another transport is not the kernel's, whatever its facility.
    let facility = match (field("_TRANSPORT"), field("SYSLOG_FACILITY")) {
        (Some("kernel"), None) => 0,
        (Some("kernel"), Some(f)) => f.parse().unwrap_or(u32::MAX),
        _ => u32::MAX,
    };
    // A date RFC 3339 can write (before the year 10000).
    let when = field("__REALTIME_TIMESTAMP")
        .and_then(|t| t.parse::<u64>().ok())
        .filter(|us| *us < 253_402_300_800_000_000)
        .map(|us| humantime::format_rfc3339_micros(std::time::UNIX_EPOCH + std::time::Duration::from_micros(us)));
    let shown = match when {
        Some(t) => format!("{t} kernel: {}", shown(&text)),
        None => format!("kernel: {}", shown(&text)),
    };
    Read::Message(Message { facility, text, shown })
}

/// A message on one visible line, for a report.
fn shown(text: &str) -> String {
    crate::util::escape::one_line(text, 8 * crate::util::escape::MAX_LINE)
}

/// Whether one of the kernel's messages is the OOM killer's, naming the
/// process it killed.
pub(crate) fn oom_kill(message: &str) -> bool {
    OOM_KILL.is_match(message)
}

/// A fatal GPU fault in a kernel message.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Fault {
    pub(crate) xid: u32,
    pub(crate) what: &'static str,
    /// `0000:41:00.0`
    pub(crate) pci: String,
}

impl Fault {
    /// Whether the fault is on one of `gpus` (`None`: they cannot be
    /// told, every GPU's counts).
    pub(crate) fn on(&self, gpus: Option<&Vec<String>>) -> bool {
        gpus.is_none_or(|g| g.contains(&self.pci.to_ascii_lowercase()))
    }

    pub(crate) fn cause(&self) -> String {
        format!("GPU fault: Xid {} ({}) on {} — needs a reset or reboot", self.xid, self.what, self.pci)
    }

    /// Why the answers are checked again, for one of [`RECHECK_XIDS`].
    pub(crate) fn recheck_reason(&self) -> String {
        format!("GPU fault: Xid {} ({}) on {}", self.xid, self.what, self.pci)
    }
}

/// What a kernel message means for the run.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Kernel {
    /// A fatal GPU fault (the first one only).
    Fatal(Fault),
    /// A fault that leaves the process running, on one of the instance's
    /// GPUs: its answers are to be checked again.
    Recheck(Fault),
    /// The OOM killer ended a process (any on the host: whose it is, the
    /// exit of the run tells; see `observe::oom`).
    OomKill(String),
}

/// A fault of one of [`RECHECK_XIDS`] one of the kernel's messages (its
/// text, from the start) reports, if it reports one.
pub(crate) fn recheck(message: &str) -> Option<Fault> {
    let c = XID.captures(message)?;
    let xid: u32 = c[2].parse().ok()?;
    let (_, what) = RECHECK_XIDS.iter().find(|(x, _)| *x == xid)?;
    Some(Fault { xid, what, pci: with_function(&c[1]) })
}

/// The instance's GPUs as PCI addresses (`0000:41:00.0`), from
/// `nvidia-smi --query-gpu=index,uuid,pci.bus_id --format=csv,noheader`
/// and the child's `CUDA_VISIBLE_DEVICES` (indexes or UUIDs; unset: every
/// GPU). `None` when they cannot be told (no answer, or a device the query
/// does not list): then every GPU counts.
pub(crate) fn instance_gpus(query: &str, visible: Option<&str>) -> Option<Vec<String>> {
    let mut all = Vec::new();
    for line in query.lines().filter(|l| !l.trim().is_empty()) {
        let f: Vec<&str> = line.split(',').map(str::trim).collect();
        let [index, uuid, bus] = f[..] else { return None };
        // `00000000:41:00.0`: the domain in 8 digits, the kernel's in 4.
        let (domain, rest) = bus.split_once(':')?;
        let domain = domain.get(domain.len().checked_sub(4)?..)?;
        all.push((index.to_string(), uuid.to_string(), format!("{domain}:{rest}").to_ascii_lowercase()));
    }
    if all.is_empty() {
        return None;
    }
    let Some(visible) = visible.map(str::trim).filter(|v| !v.is_empty()) else {
        return Some(all.into_iter().map(|(_, _, pci)| pci).collect());
    };
    visible
        .split(',')
        .map(str::trim)
        .map(|v| all.iter().find(|(i, u, _)| i == v || u == v || u.starts_with(v)).map(|(_, _, p)| p.clone()))
        .collect()
}

fn with_function(pci: &str) -> String {
    if pci.contains('.') { pci.to_string() } else { format!("{pci}.0") }
}

/// The fatal fault one of the kernel's messages (its text, from the
/// start) reports, if it reports one.
pub(crate) fn fault(message: &str) -> Option<Fault> {
    if let Some(c) = XID.captures(message) {
        let xid: u32 = c[2].parse().ok()?;
        let (_, what) = FATAL_XIDS.iter().find(|(x, _)| *x == xid)?;
        return Some(Fault { xid, what, pci: with_function(&c[1]) });
    }
    let c = OFF_THE_BUS.captures(message)?;
    Some(Fault { xid: 79, what: "GPU has fallen off the bus", pci: with_function(&c[1]) })
}

/// Whether a kernel message concerns an NVIDIA GPU's health: any Xid (not
/// only the fatal ones), a GPU fallen off the bus, the driver's GSP or ECC
/// reports; or a process's illegal instruction (`traps: python3[4242] trap
/// invalid opcode ip:… in libfoo.so`: the address, and the library it is in,
/// of an instruction this CPU refused); or the OOM killer's (`Killed process
/// PID (name) total-vm:…`, `oom-kill:…`: the memory figures of a host OOM
/// kill). What goes into a failure report's `kernel.txt`.
pub(crate) fn gpu_related(line: &str) -> bool {
    static GPU: LazyLock<Regex> = LazyLock::new(|| {
        Regex::new(
            r"NVRM: Xid|fallen off the bus|GPU has fallen|NVRM: GPU at PCI|NVRM: .*(?:GSP|ECC|RmInit)|trap invalid opcode|Killed process \d+|oom-kill:",
        )
        .expect("static regex")
    });
    GPU.is_match(line)
}

/// The follower of one run; killed (with its group) when dropped.
#[derive(Debug)]
pub(crate) struct KernelFollower {
    pid: nix::unistd::Pid,
    seen: Arc<Mutex<Seen>>,
    /// The instance's GPUs; `None`: not known, every GPU counts.
    gpus: Arc<Mutex<Option<Vec<String>>>>,
}

/// GPU-related messages kept at most, and their bytes.
const KEEP_LINES: usize = 10_000;
const KEEP_BYTES: usize = 4 << 20;

/// What a follower has read.
#[derive(Debug, Default)]
struct Seen {
    /// Messages read, all of them.
    count: u64,
    /// The latest of the kernel's own that concern the GPUs, each with its
    /// number among all, as a report shows it, and whether it is an OOM
    /// kill.
    gpu: VecDeque<(u64, String, bool)>,
    bytes: usize,
    /// The number of the latest one dropped to stay within the bounds.
    dropped: Option<u64>,
    /// False once the follower stopped reading (its command ended).
    reading: bool,
}

impl Seen {
    fn line(&mut self, m: &Message) {
        let n = self.count;
        self.count += 1;
        if !m.is_kernel() || !gpu_related(&m.text) {
            return;
        }
        self.bytes += m.shown.len();
        self.gpu.push_back((n, m.shown.clone(), oom_kill(&m.text)));
        while self.gpu.len() > KEEP_LINES || self.bytes > KEEP_BYTES {
            let Some((n, old, _)) = self.gpu.pop_front() else { break };
            self.bytes -= old.len();
            self.dropped = Some(n);
        }
    }
}

/// Where a run began among the messages of a follower: what the follower
/// reads from then on is the run's (see [`Mark::since`]).
#[derive(Debug, Clone)]
pub(crate) struct Mark {
    seen: Arc<Mutex<Seen>>,
    at: u64,
}

/// The messages of a run that concern the GPUs, as its follower read them.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Since {
    pub(crate) gpu: Vec<String>,
    /// Every message read since the mark.
    pub(crate) all: u64,
    /// Some of those about the GPUs were dropped (the oldest first).
    pub(crate) cut: bool,
}

impl Mark {
    /// What was read since the mark; `None` when the follower has stopped
    /// reading, and may have missed some.
    pub(crate) fn since(&self) -> Option<Since> {
        let seen = self.seen.lock().unwrap_or_else(|p| p.into_inner());
        if !seen.reading {
            return None;
        }
        let gpu = seen.gpu.iter().filter(|(n, _, _)| *n >= self.at).map(|(_, t, _)| t.clone()).collect();
        Some(Since { gpu, all: seen.count - self.at, cut: seen.dropped.is_some_and(|n| n >= self.at) })
    }
}

impl KernelFollower {
    /// The instance's GPUs, whose faults call for a re-check (`None`:
    /// every GPU's).
    pub(crate) fn set_gpus(&self, gpus: Option<Vec<String>>) {
        *self.gpus.lock().unwrap_or_else(|p| p.into_inner()) = gpus;
    }

    /// The follower's list of the instance's GPUs, to be set later (off
    /// the loop, once asked).
    pub(crate) fn gpus(&self) -> Arc<Mutex<Option<Vec<String>>>> {
        self.gpus.clone()
    }

    /// The messages of the latest OOM kills the follower read (the
    /// kernel's `Killed process PID (name) …` lines), newest last.
    pub(crate) fn oom_kills(&self, since: Option<&Mark>) -> Vec<String> {
        let seen = self.seen.lock().unwrap_or_else(|p| p.into_inner());
        let at = since.map_or(0, |m| m.at);
        seen.gpu.iter().filter(|(n, _, oom)| *n >= at && *oom).map(|(_, t, _)| t.clone()).collect()
    }

    /// Here, among what the follower reads; `None` when it no longer reads.
    pub(crate) fn mark(&self) -> Option<Mark> {
        let at = {
            let seen = self.seen.lock().unwrap_or_else(|p| p.into_inner());
            seen.reading.then_some(seen.count)?
        };
        Some(Mark { seen: self.seen.clone(), at })
    }
}

impl Drop for KernelFollower {
    fn drop(&mut self) {
        let _ = nix::sys::signal::killpg(self.pid, nix::sys::signal::Signal::SIGKILL);
        crate::process::child::unregister_helper(self.pid.as_raw());
    }
}

/// What one of the kernel's own messages (its text) means: a fatal fault
/// (the first one only), an OOM kill, a fault that calls for a re-check.
/// A fault counts when it is on one of the instance's GPUs (`ours`; all of
/// them when they cannot be told).
fn kernel_message(
    text: &str,
    ours: &Mutex<Option<Vec<String>>>,
    fatal_told: &mut bool,
    on_fault: &mut impl FnMut(Kernel),
) {
    let ours_has = |f: &Fault| f.on(ours.lock().unwrap_or_else(|p| p.into_inner()).as_ref());
    if let Some(f) = fault(text) {
        if !ours_has(&f) {
            tracing::info!(EVENT = "gpus", "kernel: {} (not one of this instance's GPUs)", f.recheck_reason());
        } else if !std::mem::replace(fatal_told, true) {
            on_fault(Kernel::Fatal(f));
        }
    } else if oom_kill(text) {
        on_fault(Kernel::OomKill(text.trim_end().to_string()));
    } else if let Some(f) = recheck(text)
        && ours_has(&f)
    {
        on_fault(Kernel::Recheck(f));
    }
}

/// Start following `source` (an argv whose output is kernel messages, one
/// per line); `on_fault` is called from a thread of its own for the first
/// fatal fault and for every fault that calls for a re-check, and the
/// follower reads on. `Ok(None)`: the command is not installed.
pub(crate) fn follow(
    source: &[String],
    mut on_fault: impl FnMut(Kernel) + Send + 'static,
) -> std::io::Result<Option<KernelFollower>> {
    use std::os::unix::process::CommandExt;
    let Some(program) = source.first() else { return Ok(None) };
    let mut cmd = Command::new(program);
    cmd.args(&source[1..]).stdin(Stdio::null()).stdout(Stdio::piped()).stderr(Stdio::null()).process_group(0);
    // SAFETY: between fork and exec only prctl, which is async-signal-safe.
    // The follower dies with the warden, even a SIGKILLed one (it is spawned
    // from the loop's thread, which lives as long as the warden).
    unsafe {
        cmd.pre_exec(|| {
            if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL as libc::c_ulong, 0, 0, 0) == 0 {
                Ok(())
            } else {
                Err(std::io::Error::last_os_error())
            }
        });
    }
    let child = cmd.spawn();
    let mut child = match child {
        Ok(c) => c,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        Err(e) => return Err(e),
    };
    let pid = nix::unistd::Pid::from_raw(child.id() as i32);
    crate::process::child::register_helper(pid.as_raw());
    let stdout = child.stdout.take();
    let seen = Arc::new(Mutex::new(Seen { reading: true, ..Seen::default() }));
    let gpus: Arc<Mutex<Option<Vec<String>>>> = Arc::default();
    let (s, ours) = (seen.clone(), gpus.clone());
    let read = std::thread::Builder::new().name("kernel messages".into()).spawn(move || {
        let (mut fatal_told, mut unknown_told) = (false, false);
        if let Some(out) = stdout {
            // Lines are capped: a runaway source cannot fill memory.
            let mut reader = std::io::BufReader::new(out);
            let mut line = Vec::new();
            loop {
                line.clear();
                match std::io::Read::take(&mut reader, 64 * 1024).read_until(b'\n', &mut line) {
                    Ok(0) | Err(_) => break,
                    Ok(_) => {
                        let text = String::from_utf8_lossy(&line);
                        match parse(&text) {
                            Read::Message(m) => {
                                s.lock().unwrap_or_else(|p| p.into_inner()).line(&m);
                                if m.is_kernel() {
                                    kernel_message(&m.text, &ours, &mut fatal_told, &mut on_fault);
                                }
                            }
                            Read::Nothing => {}
                            Read::Unknown => {
                                s.lock().unwrap_or_else(|p| p.into_inner()).count += 1;
                                if !std::mem::replace(&mut unknown_told, true) {
                                    tracing::warn!(
                                        EVENT = "gpus",
                                        "kernel messages: a line that does not say its facility (neither a /dev/kmsg \
                                         record nor a journal entry of `journalctl -o json`) cannot be told from text \
                                         written by any program: GPU faults are read only from the kernel's own \
                                         messages (health.kernel-messages)"
                                    );
                                }
                            }
                        }
                        // A line longer than the cap: skip the rest of it.
                        if !line.ends_with(b"\n") && reader.skip_until(b'\n').is_err() {
                            break;
                        }
                    }
                }
            }
        }
        s.lock().unwrap_or_else(|p| p.into_inner()).reading = false;
        // The warden's reaper collects its exit; this only drops the handle.
        drop(child);
    });
    if let Err(e) = read {
        let _ = nix::sys::signal::killpg(pid, nix::sys::signal::Signal::SIGKILL);
        crate::process::child::unregister_helper(pid.as_raw());
        return Err(e);
    }
    Ok(Some(KernelFollower { pid, seen, gpus }))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A `/dev/kmsg` record of the kernel's own (facility 0, level 4).
    fn kernel(text: &str) -> Message {
        match parse(&format!("4,1234,5678901,-;{text}\n")) {
            Read::Message(m) => m,
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn fatal_xids_are_found_with_their_gpu() {
        let line = "NVRM: Xid (PCI:0000:41:00): 79, pid=1234, name=python3, GPU has fallen off the bus.";
        let f = fault(line).unwrap();
        assert_eq!(
            f.cause(),
            "GPU fault: Xid 79 (GPU has fallen off the bus) on 0000:41:00.0 — needs a reset or reboot"
        );
        let ecc = "NVRM: Xid (PCI:0000:c1:00): 48, pid='<unknown>', name=<unknown>, An uncorrectable double bit error (DBE) has been detected on GPU in the framebuffer at partition 0, subpartition 0.";
        assert_eq!(fault(ecc).map(|f| f.xid), Some(48));
        let bus = "NVRM: GPU at PCI:0000:41:00: GPU-3b0b3b0b-0000-0000-0000-000000000000 has fallen off the bus.";
        assert_eq!(fault(bus).map(|f| f.pci), Some("0000:41:00.0".to_string()));
        let bus = "NVRM: GPU 0000:41:00.0: GPU has fallen off the bus.";
        assert_eq!(fault(bus).map(|f| f.pci), Some("0000:41:00.0".to_string()));
    }

    /// Issue 56 (B3): the kernel's own lines quote text anyone chooses. A
    /// segfault line begins with the program's name (its first 15 bytes)
    /// and quotes the file its instruction was in; neither makes a fault,
    /// nor does the driver's text anywhere but at the message's start.
    #[test]
    fn the_driver_message_counts_only_from_the_start_of_a_message() {
        let name = "NVRM: Xid (PCI:0000:41:00): 79, pid=1, name=x, GPU has fallen off the bus.";
        let segfault = format!(
            "NVRM: Xid (PCI:[4242]: segfault at 0 ip 000055d0c0de1234 sp 00007ffd00001000 error 4 in {name}[1234,55d0c0de0000+2000] likely on CPU 1 (core 1, socket 0)"
        );
        let m = kernel(&segfault);
        assert!(m.is_kernel());
        assert_eq!((fault(&m.text), recheck(&m.text)), (None, None));
        let again = segfault.replace(": 79,", ": 31,");
        assert_eq!((fault(&again), recheck(&again)), (None, None));
        for quoted in [
            format!("traps: x[1] general protection fault ip:0 sp:0 error:0 in {name}[0+1000]"),
            format!("kernel: {name}"),
            format!(" {name}"),
            format!("[ 12.345678] {name}"),
            format!("audit: comm=\"{name}\""),
            "NVRM: GPU at PCI:[77]: whatever fallen off the bus".into(),
            "NVRM: Xid (PCI:0000:41:00): 79x".into(),
        ] {
            assert_eq!((fault(&quoted), recheck(&quoted)), (None, None), "{quoted}");
        }
        // An OOM kill is the OOM killer's line, not a quote of one.
        assert!(oom_kill("Out of memory: Killed process 4242 (python3) total-vm:1kB"));
        assert!(oom_kill("Memory cgroup out of memory: Killed process 77 (eat) total-vm:1kB"));
        assert!(oom_kill("Out of memory (oom_kill_allocating_task): Killed process 77 (eat)"));
        assert!(oom_kill("Killed process 77 (eat) total-vm:1000kB"));
        assert!(!oom_kill("a.out[1]: segfault at 0 in Out of memory: Killed process 4242 (python3)[0+1000]"));
    }

    /// Issue 56 (B3): a record's facility says whose it is. What userspace
    /// writes to `/dev/kmsg` is `user` (1) unless it names another
    /// non-zero one (`<0>` is `user`, level 0: the priorities below are the
    /// kernel's on this machine for `echo … > /dev/kmsg`); a journal entry
    /// is the kernel's when its transport is and its facility 0 or left
    /// out; a line that does not say is unknown.
    #[test]
    fn records_say_whose_they_are() {
        let xid = "NVRM: Xid (PCI:0000:41:00): 79, pid=1, name=x, GPU has fallen off the bus.";
        for (record, facility) in [
            (format!("4,10,20,-;{xid}"), 0),
            (format!("0,10,20,c;{xid}"), 0),
            (format!("12,343,247838375,-;{xid}"), 1),
            (format!("11,344,247838403,-;{xid}"), 1),
            (format!("8,345,247839509,-;{xid}"), 1),
            (format!("28,346,247840115,-;{xid}"), 3),
            (format!("4,10,20,-,caller=T1;{xid}"), 0),
        ] {
            match parse(&record) {
                Read::Message(m) => {
                    assert_eq!((m.facility, m.is_kernel(), m.text.as_str()), (facility, facility == 0, xid), "{record}")
                }
                other => panic!("{record}: {other:?}"),
            }
        }
        assert_eq!(kernel(xid).shown, format!("[    5.678901] {xid}"));
        assert_eq!(kernel("rcu: \\x09Max phase").text, "rcu: \\x09Max phase", "the record's escapes are kept");
        assert_eq!(parse(" SUBSYSTEM=pci\n"), Read::Nothing);
        assert_eq!(parse(" DEVICE=+pci:0000:41:00.0"), Read::Nothing);
        for line in [
            format!("2026-11-30T10:00:00+0000 host kernel: {xid}"),
            format!("[ 12.345678] {xid}"),
            format!("<4>[ 12.345678] {xid}"),
            format!("kern  :warn  : [ 12.345678] {xid}"),
            xid.to_string(),
            "{not json".into(),
            "".into(),
        ] {
            assert_eq!(parse(&line), Read::Unknown, "{line}");
        }
        let journal = |fields: &str| match parse(&format!("{{{fields}}}\n")) {
            Read::Message(m) => (m.facility, m.text, m.shown),
            other => panic!("{fields}: {other:?}"),
        };
        let (f, text, shown) = journal(&format!(
            r#""__REALTIME_TIMESTAMP":"1796665271000123","_TRANSPORT":"kernel","SYSLOG_FACILITY":"0","SYSLOG_IDENTIFIER":"kernel","MESSAGE":"{xid}""#
        ));
        assert_eq!((f, text.as_str()), (0, xid));
        assert_eq!(shown, format!("2026-12-07T17:41:11.000123Z kernel: {xid}"));
        assert_eq!(journal(&format!(r#""_TRANSPORT":"kernel","MESSAGE":"{xid}""#)).0, 0, "older journald");
        let user = journal(
            r#""_TRANSPORT":"kernel","SYSLOG_FACILITY":"1","SYSLOG_IDENTIFIER":"NVRM","MESSAGE":"Xid (PCI:0000:41:00): 79""#,
        );
        assert_eq!(user.0, 1);
        assert_eq!(journal(&format!(r#""_TRANSPORT":"syslog","SYSLOG_FACILITY":"0","MESSAGE":"{xid}""#)).0, u32::MAX);
        assert_eq!(journal(&format!(r#""_TRANSPORT":"kernel","SYSLOG_FACILITY":"x","MESSAGE":"{xid}""#)).0, u32::MAX);
        let bytes = journal(r#""_TRANSPORT":"kernel","MESSAGE":[78,86,82,77,58,32,255,10,120]"#);
        assert_eq!((bytes.1.as_str(), bytes.2.as_str()), ("NVRM: \u{fffd}\nx", "kernel: NVRM: \u{fffd}\\nx"));
        assert_eq!(parse(r#"{"_TRANSPORT":"kernel","MESSAGE":null}"#), Read::Nothing);
        let late = journal(r#""__REALTIME_TIMESTAMP":"18446744073709551615","_TRANSPORT":"kernel","MESSAGE":"x""#);
        assert_eq!(late.2, "kernel: x", "a date past 9999 is left out");
    }

    /// What a follower read since a mark: the kernel's messages about the
    /// GPUs, bounded, and the count of all; nothing once it stopped
    /// reading.
    #[test]
    fn a_mark_gives_the_gpu_messages_read_since() {
        let seen = Arc::new(Mutex::new(Seen { reading: true, ..Seen::default() }));
        let read = |t: &str| seen.lock().unwrap().line(&kernel(t));
        read("NVRM: Xid (PCI:0000:41:00): 13, before");
        let mark = Mark { seen: seen.clone(), at: seen.lock().unwrap().count };
        read("usb 1-1: new high-speed USB device");
        read("NVRM: Xid (PCI:0000:41:00): 31, after");
        let Read::Message(user) = parse("12,1,2,-;NVRM: Xid (PCI:0000:41:00): 31, written by a program") else {
            panic!()
        };
        seen.lock().unwrap().line(&user);
        let after = "[    5.678901] NVRM: Xid (PCI:0000:41:00): 31, after".to_string();
        assert_eq!(mark.since(), Some(Since { gpu: vec![after.clone()], all: 3, cut: false }), "the kernel's only");
        for i in 0..KEEP_LINES {
            read(&format!("NVRM: Xid (PCI:0000:41:00): 13, {i}"));
        }
        let since = mark.since().unwrap();
        assert!(since.cut && !since.gpu.contains(&after), "the oldest go first");
        assert_eq!((since.gpu.len(), since.all), (KEEP_LINES, KEEP_LINES as u64 + 3));
        seen.lock().unwrap().reading = false;
        assert_eq!(mark.since(), None, "it may have missed some");
    }

    #[test]
    fn xids_that_leave_the_process_running_call_for_a_recheck() {
        let line = "NVRM: Xid (PCI:0000:41:00): 31, pid=4242, name=python3, Ch 00000008, intr 10000000. MMU Fault: ENGINE GRAPHICS GPCCLIENT_T1_0 faulted @ 0x7f_12340000. Fault is of type FAULT_PDE ACCESS_TYPE_VIRT_READ";
        let f = recheck(line).unwrap();
        assert_eq!(f.recheck_reason(), "GPU fault: Xid 31 (GPU memory page fault) on 0000:41:00.0");
        for (xid, _) in RECHECK_XIDS {
            assert!(recheck(&format!("NVRM: Xid (PCI:0000:41:00): {xid}, pid=1, name=x, y")).is_some(), "{xid}");
            assert!(fault(&format!("NVRM: Xid (PCI:0000:41:00): {xid}, pid=1, name=x, y")).is_none(), "{xid}");
        }
        assert_eq!(recheck("NVRM: Xid (PCI:0000:41:00): 79, pid=1, name=x, y"), None, "fatal, not a re-check");
        assert_eq!(recheck("NVRM: Xid (PCI:0000:41:00): 999, pid=1, name=x, y"), None);
    }

    /// Issue 56 (B4): a fault counts for the instance when it is on one of
    /// its GPUs, fatal or not; every GPU's when they cannot be told. A
    /// fatal one on another GPU does not use up the one fatal fault told.
    #[test]
    fn a_fault_counts_on_the_instance_gpus_only_fatal_or_not() {
        let told = |gpus: Option<Vec<String>>, lines: &[&str]| {
            let ours = Mutex::new(gpus);
            let (mut fatal_told, mut said) = (false, Vec::new());
            for l in lines {
                kernel_message(l, &ours, &mut fatal_told, &mut |k| said.push(k));
            }
            said
        };
        let other48 = "NVRM: Xid (PCI:0000:5e:00): 48, pid=1, name=x, An uncorrectable double bit error";
        let other31 = "NVRM: Xid (PCI:0000:5E:00): 31, pid=1, name=x, MMU Fault";
        let ours79 = "NVRM: Xid (PCI:0000:41:00): 79, pid=1, name=x, GPU has fallen off the bus.";
        let ours = Some(vec!["0000:41:00.0".to_string()]);
        assert_eq!(told(ours.clone(), &[other48, other31]), vec![]);
        let said = told(ours, &[other48, ours79]);
        assert!(matches!(&said[..], [Kernel::Fatal(f)] if f.pci == "0000:41:00.0"), "{said:?}");
        let said = told(None, &[other48, other31, ours79]);
        assert!(
            matches!(&said[..], [Kernel::Fatal(f), Kernel::Recheck(_)] if f.pci == "0000:5e:00.0"),
            "not told: every GPU's: {said:?}"
        );
    }

    /// The instance's GPUs from nvidia-smi and CUDA_VISIBLE_DEVICES;
    /// `None` (every GPU counts) when they cannot be told.
    #[test]
    fn the_instance_gpus_are_told_by_index_or_uuid() {
        let q = "0, GPU-aaaa-1111, 00000000:41:00.0\n1, GPU-bbbb-2222, 00000000:C1:00.0\n";
        assert_eq!(instance_gpus(q, None), Some(vec!["0000:41:00.0".to_string(), "0000:c1:00.0".into()]));
        assert_eq!(instance_gpus(q, Some("1")), Some(vec!["0000:c1:00.0".to_string()]));
        assert_eq!(instance_gpus(q, Some("GPU-aaaa")), Some(vec!["0000:41:00.0".to_string()]));
        assert_eq!(instance_gpus(q, Some("0,7")), None, "a device not listed: not told");
        assert_eq!(instance_gpus("", Some("0")), None);
        assert_eq!(instance_gpus("garbage", None), None);
    }

    #[test]
    fn other_xids_and_lines_are_not_faults() {
        // Xid 13 (graphics engine exception) and 31 (MMU fault) are the
        // application's; 43 (GPU stopped processing) lets the GPU go on.
        for xid in [13, 31, 43] {
            assert_eq!(fault(&format!("NVRM: Xid (PCI:0000:41:00): {xid}, pid=1, name=x, y")), None);
        }
        assert_eq!(fault("usb 1-1: new high-speed USB device"), None);
    }
}
