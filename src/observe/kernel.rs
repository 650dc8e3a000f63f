//! GPU faults from the kernel's messages. While a run lives, a source
//! command (by default `journalctl -k -f -n 0 -o short-iso`: new kernel
//! messages as they come) is followed; a line of a fatal NVIDIA Xid class
//! ends the run with a permanent cause: no restart loop against a dead GPU.
//! A line of a class that does not end the process ([`RECHECK_XIDS`]) about
//! one of the instance's GPUs (every GPU, when they cannot be told) calls
//! for the serving model's answers to be checked again: after an MMU fault
//! a server has been seen answering 200 with garbage.
//! The follower is a helper of the warden (its own process group, not part
//! of the child's tree, killed when the run ends). It keeps the latest
//! messages that concern the GPUs, numbered among all it read, so that a
//! failure report can take those of a run without running a command (see
//! [`Mark`]). What a fault leads to is not known here.

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

/// `NVRM: Xid (PCI:0000:41:00): 79, pid=1234, name=python3, GPU has fallen off the bus.`
static XID: LazyLock<Regex> = LazyLock::new(|| {
    Regex::new(r"NVRM: Xid \(PCI:([0-9A-Fa-f]{4}:[0-9A-Fa-f]{2}:[0-9A-Fa-f]{2}(?:\.[0-7])?)\): (\d+)")
        .expect("static regex")
});
/// `NVRM: GPU at PCI:0000:41:00: GPU-… has fallen off the bus.`
static OFF_THE_BUS: LazyLock<Regex> = LazyLock::new(|| {
    Regex::new(r"NVRM: GPU at PCI:([0-9A-Fa-f]{4}:[0-9A-Fa-f]{2}:[0-9A-Fa-f]{2}(?:\.[0-7])?).*fallen off the bus")
        .expect("static regex")
});

/// A fatal GPU fault in a kernel message.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Fault {
    pub(crate) xid: u32,
    pub(crate) what: &'static str,
    /// `0000:41:00.0`
    pub(crate) pci: String,
}

impl Fault {
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

/// A fault of one of [`RECHECK_XIDS`] a kernel message reports, if it
/// reports one.
pub(crate) fn recheck(line: &str) -> Option<Fault> {
    let c = XID.captures(line)?;
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

/// The fatal fault a kernel message reports, if it reports one.
pub(crate) fn fault(line: &str) -> Option<Fault> {
    if let Some(c) = XID.captures(line) {
        let xid: u32 = c[2].parse().ok()?;
        let (_, what) = FATAL_XIDS.iter().find(|(x, _)| *x == xid)?;
        return Some(Fault { xid, what, pci: with_function(&c[1]) });
    }
    let c = OFF_THE_BUS.captures(line)?;
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
    /// The latest that concern the GPUs, each with its number among all.
    gpu: VecDeque<(u64, String)>,
    bytes: usize,
    /// The number of the latest one dropped to stay within the bounds.
    dropped: Option<u64>,
    /// False once the follower stopped reading (its command ended).
    reading: bool,
}

impl Seen {
    fn line(&mut self, text: &str) {
        let n = self.count;
        self.count += 1;
        if !gpu_related(text) {
            return;
        }
        let text = text.trim_end_matches(['\n', '\r']).to_string();
        self.bytes += text.len();
        self.gpu.push_back((n, text));
        while self.gpu.len() > KEEP_LINES || self.bytes > KEEP_BYTES {
            let Some((n, old)) = self.gpu.pop_front() else { break };
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
        let gpu = seen.gpu.iter().filter(|(n, _)| *n >= self.at).map(|(_, t)| t.clone()).collect();
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
        seen.gpu.iter().filter(|(n, t)| *n >= at && t.contains("Killed process ")).map(|(_, t)| t.clone()).collect()
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
        let mut fatal_told = false;
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
                        s.lock().unwrap_or_else(|p| p.into_inner()).line(&text);
                        if let Some(f) = fault(&text) {
                            if !std::mem::replace(&mut fatal_told, true) {
                                on_fault(Kernel::Fatal(f));
                            }
                        } else if text.contains("Killed process ") {
                            on_fault(Kernel::OomKill(text.trim_end().to_string()));
                        } else if let Some(f) = recheck(&text) {
                            let ours = ours.lock().unwrap_or_else(|p| p.into_inner());
                            if ours.as_ref().is_none_or(|g| g.contains(&f.pci.to_ascii_lowercase())) {
                                drop(ours);
                                on_fault(Kernel::Recheck(f));
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

    #[test]
    fn fatal_xids_are_found_with_their_gpu() {
        let line = "2026-11-30T10:00:00+0000 host kernel: NVRM: Xid (PCI:0000:41:00): 79, pid=1234, name=python3, GPU has fallen off the bus.";
        let f = fault(line).unwrap();
        assert_eq!(
            f.cause(),
            "GPU fault: Xid 79 (GPU has fallen off the bus) on 0000:41:00.0 — needs a reset or reboot"
        );
        let ecc = "kernel: NVRM: Xid (PCI:0000:c1:00): 48, pid='<unknown>', name=<unknown>, An uncorrectable double bit error (DBE) has been detected on GPU in the framebuffer at partition 0, subpartition 0.";
        assert_eq!(fault(ecc).map(|f| f.xid), Some(48));
        let bus =
            "kernel: NVRM: GPU at PCI:0000:41:00: GPU-3b0b3b0b-0000-0000-0000-000000000000 has fallen off the bus.";
        assert_eq!(fault(bus).map(|f| f.pci), Some("0000:41:00.0".to_string()));
    }

    /// What a follower read since a mark: the messages about the GPUs,
    /// bounded, and the count of all; nothing once it stopped reading.
    #[test]
    fn a_mark_gives_the_gpu_messages_read_since() {
        let seen = Arc::new(Mutex::new(Seen { reading: true, ..Seen::default() }));
        let read = |t: &str| seen.lock().unwrap().line(t);
        read("kernel: NVRM: Xid (PCI:0000:41:00): 13, before\n");
        let mark = Mark { seen: seen.clone(), at: seen.lock().unwrap().count };
        read("kernel: usb 1-1: new high-speed USB device\n");
        read("kernel: NVRM: Xid (PCI:0000:41:00): 31, after\n");
        let after = "kernel: NVRM: Xid (PCI:0000:41:00): 31, after".to_string();
        assert_eq!(mark.since(), Some(Since { gpu: vec![after.clone()], all: 2, cut: false }));
        for i in 0..KEEP_LINES {
            read(&format!("kernel: NVRM: Xid (PCI:0000:41:00): 13, {i}\n"));
        }
        let since = mark.since().unwrap();
        assert!(since.cut && !since.gpu.contains(&after), "the oldest go first");
        assert_eq!((since.gpu.len(), since.all), (KEEP_LINES, KEEP_LINES as u64 + 2));
        seen.lock().unwrap().reading = false;
        assert_eq!(mark.since(), None, "it may have missed some");
    }

    #[test]
    fn xids_that_leave_the_process_running_call_for_a_recheck() {
        let line = "kernel: NVRM: Xid (PCI:0000:41:00): 31, pid=4242, name=python3, Ch 00000008, intr 10000000. MMU Fault: ENGINE GRAPHICS GPCCLIENT_T1_0 faulted @ 0x7f_12340000. Fault is of type FAULT_PDE ACCESS_TYPE_VIRT_READ";
        let f = recheck(line).unwrap();
        assert_eq!(f.recheck_reason(), "GPU fault: Xid 31 (GPU memory page fault) on 0000:41:00.0");
        for (xid, _) in RECHECK_XIDS {
            assert!(recheck(&format!("NVRM: Xid (PCI:0000:41:00): {xid}, pid=1, name=x, y")).is_some(), "{xid}");
            assert!(fault(&format!("NVRM: Xid (PCI:0000:41:00): {xid}, pid=1, name=x, y")).is_none(), "{xid}");
        }
        assert_eq!(recheck("NVRM: Xid (PCI:0000:41:00): 79, pid=1, name=x, y"), None, "fatal, not a re-check");
        assert_eq!(recheck("NVRM: Xid (PCI:0000:41:00): 999, pid=1, name=x, y"), None);
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
