//! GPU faults from the kernel's messages. While a run lives, a source
//! command (by default `journalctl -k -f -n 0 -o short-iso`: new kernel
//! messages as they come) is followed; a line of a fatal NVIDIA Xid class
//! ends the run with a permanent cause: no restart loop against a dead GPU.
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
pub const FATAL_XIDS: &[(u32, &str)] = &[
    (48, "double-bit ECC error"),
    (62, "internal micro-controller halt"),
    (79, "GPU has fallen off the bus"),
    (92, "high single-bit ECC error rate"),
    (94, "contained ECC error"),
    (95, "uncontained ECC error"),
    (119, "GSP RPC timeout"),
    (154, "GPU recovery action changed"),
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
pub struct Fault {
    pub xid: u32,
    pub what: &'static str,
    /// `0000:41:00.0`
    pub pci: String,
}

impl Fault {
    pub fn cause(&self) -> String {
        format!("GPU fault: Xid {} ({}) on {} — needs a reset or reboot", self.xid, self.what, self.pci)
    }
}

fn with_function(pci: &str) -> String {
    if pci.contains('.') { pci.to_string() } else { format!("{pci}.0") }
}

/// The fatal fault a kernel message reports, if it reports one.
pub fn fault(line: &str) -> Option<Fault> {
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
/// of an instruction this CPU refused). What goes into a failure report's
/// `kernel.txt`.
pub fn gpu_related(line: &str) -> bool {
    static GPU: LazyLock<Regex> = LazyLock::new(|| {
        Regex::new(
            r"NVRM: Xid|fallen off the bus|GPU has fallen|NVRM: GPU at PCI|NVRM: .*(?:GSP|ECC|RmInit)|trap invalid opcode",
        )
        .expect("static regex")
    });
    GPU.is_match(line)
}

/// The follower of one run; killed (with its group) when dropped.
#[derive(Debug)]
pub struct KernelFollower {
    pid: nix::unistd::Pid,
    seen: Arc<Mutex<Seen>>,
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
pub struct Mark {
    seen: Arc<Mutex<Seen>>,
    at: u64,
}

/// The messages of a run that concern the GPUs, as its follower read them.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Since {
    pub gpu: Vec<String>,
    /// Every message read since the mark.
    pub all: u64,
    /// Some of those about the GPUs were dropped (the oldest first).
    pub cut: bool,
}

impl Mark {
    /// What was read since the mark; `None` when the follower has stopped
    /// reading, and may have missed some.
    pub fn since(&self) -> Option<Since> {
        let seen = self.seen.lock().unwrap_or_else(|p| p.into_inner());
        if !seen.reading {
            return None;
        }
        let gpu = seen.gpu.iter().filter(|(n, _)| *n >= self.at).map(|(_, t)| t.clone()).collect();
        Some(Since { gpu, all: seen.count - self.at, cut: seen.dropped.is_some_and(|n| n >= self.at) })
    }
}

impl KernelFollower {
    /// Here, among what the follower reads; `None` when it no longer reads.
    pub fn mark(&self) -> Option<Mark> {
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
/// fatal fault, and the follower reads on. `Ok(None)`: the command is not
/// installed.
pub fn follow(
    source: &[String],
    on_fault: impl FnOnce(Fault) + Send + 'static,
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
    let s = seen.clone();
    let read = std::thread::Builder::new().name("kernel messages".into()).spawn(move || {
        let mut on_fault = Some(on_fault);
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
                        if let Some(f) = fault(&text)
                            && let Some(call) = on_fault.take()
                        {
                            call(f);
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
    Ok(Some(KernelFollower { pid, seen }))
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
    fn other_xids_and_lines_are_not_faults() {
        // Xid 13 (graphics engine exception) and 31 (MMU fault) are the
        // application's; 43 (GPU stopped processing) lets the GPU go on.
        for xid in [13, 31, 43] {
            assert_eq!(fault(&format!("NVRM: Xid (PCI:0000:41:00): {xid}, pid=1, name=x, y")), None);
        }
        assert_eq!(fault("usb 1-1: new high-speed USB device"), None);
    }
}
