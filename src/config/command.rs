//! What the warden reads in the child's command line: the port it serves
//! on, a flag's value, the Ray head's address a node names. The servers'
//! own default ports live here, below the profiles and the defaults that
//! both use them.

use vllm_warden_core::profile::Profile;

/// vLLM's port when its command names none.
pub(crate) const PORT: u16 = 8000;
/// A Ray head's GCS port when its command names none.
pub(crate) const RAY_PORT: u16 = 6379;

/// The value of `--port N` or `--port=N` in a command line.
pub(crate) fn port_of(command: &[String]) -> Option<u16> {
    let mut it = command.iter();
    while let Some(arg) = it.next() {
        if arg == "--port" {
            return it.next().and_then(|p| p.parse().ok());
        }
        if let Some(p) = arg.strip_prefix("--port=") {
            return p.parse().ok();
        }
    }
    None
}

/// The value of `--name VALUE` or `--name=VALUE`.
pub(crate) fn flag(command: &[String], name: &str) -> Option<String> {
    let mut it = command.iter();
    while let Some(arg) = it.next() {
        if arg == name {
            return it.next().cloned();
        }
        if let Some(v) = arg.strip_prefix(name).and_then(|r| r.strip_prefix('=')) {
            return Some(v.to_string());
        }
    }
    None
}

/// The value vLLM takes for `--name`: its last setting, `--name V` or
/// `--name=V`, in either of vLLM's spellings (`--max-model-len`,
/// `--max_model_len`).
pub(crate) fn vllm_flag(command: &[String], name: &str) -> Option<String> {
    let under = underscored(name);
    let mut last = None;
    let mut it = command.iter().skip(1);
    while let Some(arg) = it.next() {
        if arg == name || *arg == under {
            last = it.next().cloned().or(last);
            continue;
        }
        for n in [name, under.as_str()] {
            if let Some(v) = arg.strip_prefix(n).and_then(|r| r.strip_prefix('=')) {
                last = Some(v.to_string());
            }
        }
    }
    last
}

/// vLLM's underscore spelling of a flag: `--max_model_len`.
fn underscored(name: &str) -> String {
    format!("--{}", name.trim_start_matches("--").replace('-', "_"))
}

/// `command` with `--name VALUE` as its one setting of `name`: every
/// earlier `--name V`, `--name=V` (and vLLM's underscore spelling of
/// them) is taken out, and the new one goes at the end.
pub(crate) fn with_flag(command: &[String], name: &str, value: &str) -> Vec<String> {
    let under = underscored(name);
    let mut out = Vec::with_capacity(command.len() + 2);
    let mut it = command.iter().enumerate();
    while let Some((i, arg)) = it.next() {
        // The program itself is never a flag.
        if i > 0 && (arg == name || *arg == under) {
            it.next();
            continue;
        }
        let eq = |n: &str| arg.strip_prefix(n).is_some_and(|r| r.starts_with('='));
        if i > 0 && (eq(name) || eq(&under)) {
            continue;
        }
        out.push(arg.clone());
    }
    out.push(name.to_string());
    out.push(value.to_string());
    out
}

/// The head's GCS address a node's own command names: `--address` of a
/// joining node; `--node-ip-address` (else 127.0.0.1) and `--port` (else
/// 6379) of a head.
pub(crate) fn address_in(command: &[String], head: bool) -> Option<String> {
    if head {
        let ip = flag(command, "--node-ip-address").unwrap_or_else(|| "127.0.0.1".into());
        let port = port_of(command).unwrap_or(RAY_PORT);
        Some(format!("{}:{port}", bracketed(&ip)))
    } else {
        flag(command, "--address")
    }
}

fn bracketed(ip: &str) -> String {
    if ip.contains(':') && !ip.starts_with('[') { format!("[{ip}]") } else { ip.to_string() }
}

/// Whether `address` is `HOST:PORT` as Ray takes it: a host name, an IPv4
/// address or a bracketed IPv6 one, and a port from 1 to 65535.
pub(crate) fn valid_address(address: &str) -> bool {
    let Some((host, port)) = address.rsplit_once(':') else { return false };
    let port_ok = port.parse::<u16>().is_ok_and(|p| p > 0);
    let host_ok = if let Some(v6) = host.strip_prefix('[').and_then(|h| h.strip_suffix(']')) {
        v6.parse::<std::net::Ipv6Addr>().is_ok()
    } else {
        !host.is_empty()
            && host.len() <= 253
            && host.chars().all(|c| c.is_ascii_alphanumeric() || c == '.' || c == '-')
            && !host.starts_with('-')
    };
    port_ok && host_ok
}

/// The port checked free before a start when the config gives none:
/// `--port` in the command, else the server's default (vLLM's 8000,
/// the Ray head's GCS on 6379); a node joining a Ray cluster listens on
/// none that is known beforehand.
pub(crate) fn default_port(profile: Profile, command: &[String]) -> Option<u16> {
    let given = port_of(command);
    match profile {
        Profile::Vllm | Profile::None => Some(given.unwrap_or(PORT)),
        Profile::RayHead => Some(given.unwrap_or(RAY_PORT)),
        Profile::RayWorker => None,
    }
}

#[cfg(test)]
mod flag_tests {
    use super::*;

    fn v(s: &[&str]) -> Vec<String> {
        s.iter().map(|x| x.to_string()).collect()
    }

    #[test]
    fn with_flag_replaces_every_spelling_and_keeps_the_rest() {
        let c =
            v(&["vllm", "serve", "m", "--max-model-len", "9", "--port", "1", "--max_model_len=8", "--max-model-len=7"]);
        let got = with_flag(&c, "--max-model-len", "4096");
        assert_eq!(got, v(&["vllm", "serve", "m", "--port", "1", "--max-model-len", "4096"]));
        assert_eq!(flag(&got, "--max-model-len").as_deref(), Some("4096"));
        // What vLLM takes: the last setting, in either spelling.
        assert_eq!(vllm_flag(&c, "--max-model-len").as_deref(), Some("7"));
        let c = v(&["vllm", "--gpu-memory-utilization", "0.5", "--gpu_memory_utilization", "0.8"]);
        assert_eq!(vllm_flag(&c, "--gpu-memory-utilization").as_deref(), Some("0.8"));
        assert_eq!(vllm_flag(&v(&["vllm", "--max-model-len-x", "3"]), "--max-model-len"), None);
        // A flag whose name only begins the same is another flag.
        let c = v(&["vllm", "--max-model-len-x", "3"]);
        assert_eq!(
            with_flag(&c, "--max-model-len", "5"),
            v(&["vllm", "--max-model-len-x", "3", "--max-model-len", "5"])
        );
    }
}
