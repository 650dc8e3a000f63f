//! GPU faults from the kernel's messages. While a run lives, a source
//! command (by default `journalctl -k -f -n 0 -o short-iso`: new kernel
//! messages as they come) is followed; a line of a fatal NVIDIA Xid class
//! ends the run with a permanent cause: no restart loop against a dead GPU.
//! The follower is a helper of the warden (its own process group, not part
//! of the child's tree, killed when the run ends). What a fault leads to is
//! not known here.

use std::io::BufRead;
use std::process::{Command, Stdio};
use std::sync::LazyLock;

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
/// reports. What goes into a failure report's `kernel.txt`.
pub fn gpu_related(line: &str) -> bool {
    static GPU: LazyLock<Regex> = LazyLock::new(|| {
        Regex::new(r"NVRM: Xid|fallen off the bus|GPU has fallen|NVRM: GPU at PCI|NVRM: .*(?:GSP|ECC|RmInit)")
            .expect("static regex")
    });
    GPU.is_match(line)
}

/// The follower of one run; killed (with its group) when dropped.
#[derive(Debug)]
pub struct Follower {
    pid: nix::unistd::Pid,
}

impl Drop for Follower {
    fn drop(&mut self) {
        let _ = nix::sys::signal::killpg(self.pid, nix::sys::signal::Signal::SIGKILL);
        crate::child::unregister_helper(self.pid.as_raw());
    }
}

/// Start following `source` (an argv whose output is kernel messages, one
/// per line); `on_fault` is called from a thread of its own for the first
/// fatal fault. `Ok(None)`: the command is not installed.
pub fn follow(source: &[String], on_fault: impl FnOnce(Fault) + Send + 'static) -> std::io::Result<Option<Follower>> {
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
    crate::child::register_helper(pid.as_raw());
    let stdout = child.stdout.take();
    std::thread::Builder::new().name("kernel messages".into()).spawn(move || {
        let Some(out) = stdout else { return };
        // Lines are capped: a runaway source cannot fill memory.
        let mut reader = std::io::BufReader::new(out);
        let mut line = Vec::new();
        loop {
            line.clear();
            match std::io::Read::take(&mut reader, 64 * 1024).read_until(b'\n', &mut line) {
                Ok(0) | Err(_) => break,
                Ok(_) => {
                    if let Some(f) = fault(&String::from_utf8_lossy(&line)) {
                        on_fault(f);
                        break;
                    }
                    // A line longer than the cap: skip the rest of it.
                    if !line.ends_with(b"\n") && reader.skip_until(b'\n').is_err() {
                        break;
                    }
                }
            }
        }
        // The warden's reaper collects its exit; this only drops the handle.
        drop(child);
    })?;
    Ok(Some(Follower { pid }))
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
