//! `[preload]`: the weight-cache daemon (`vllm preload`) that holds the
//! model's post-processed weights in GPU memory, so that a restarted
//! engine maps them over CUDA IPC instead of loading them from disk.
//!
//! Off by default. When on, the daemon's command is derived from the serve
//! command (the same `vllm` program, `preload`, and the arguments that
//! define the weights, [`WEIGHT_FLAGS`]) unless `command` gives it; the
//! warden adds the socket folder and the health port to it, and
//! `--load-format ipc_cache` with the socket folder to the engine's command
//! unless that command already chooses a load format.
//!
//! Pure: what the daemon does at run time is `daemon::preload`'s.

use std::path::PathBuf;

use super::command::flag;
use super::reader::{Keys, Value};

/// The folder of the daemon's sockets, in the instance's runtime folder.
pub(crate) const SOCKET_DIR: &str = "weight-cache";
/// The health port's distance from the engine's when `health-port` is not
/// given.
pub(crate) const HEALTH_PORT_OFFSET: u16 = 1;
/// A unix socket's path holds at most 107 bytes; vLLM's socket names are
/// `weight_cache_<16 hex>_<role>.sock` (at most 40 bytes): the folder must
/// leave room for them.
pub(crate) const MAX_SOCKET_DIR: usize = 64;

/// The serve command's arguments that take a value and define the weights
/// the daemon must hold (vLLM's `WeightCacheKey`: the checkpoint, its
/// revision, dtype, quantization, the tensor/pipeline/data parallel layout)
/// or what it takes to build them (remote code, overrides, the draft model,
/// where the weights are downloaded, how they are read from disk).
pub(crate) const WEIGHT_FLAGS: &[&[&str]] = &[
    &["--model"],
    &["--tensor-parallel-size", "-tp"],
    &["--pipeline-parallel-size", "-pp"],
    &["--data-parallel-size", "-dp"],
    &["--data-parallel-size-local", "-dpl"],
    &["--data-parallel-start-rank", "-dpr"],
    &["--data-parallel-address", "-dpa"],
    &["--nnodes", "-n"],
    &["--node-rank", "-r"],
    &["--master-addr"],
    &["--quantization", "-q"],
    &["--dtype"],
    &["--revision"],
    &["--code-revision"],
    &["--tokenizer"],
    &["--hf-overrides"],
    &["--speculative-config"],
    &["--download-dir"],
    &["--load-format"],
];

/// The serve command's switches (no value) that define the weights.
pub(crate) const WEIGHT_SWITCHES: &[&str] = &[
    "--enable-expert-parallel",
    "-ep",
    "--no-enable-expert-parallel",
    "--trust-remote-code",
    "--no-trust-remote-code",
];

/// The settings of `[preload]`.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub(crate) struct Preload {
    pub(crate) enabled: bool,
    /// The daemon's argv, the socket folder and health port arguments
    /// included. Empty when off.
    pub(crate) command: Vec<String>,
    /// Its `/health` (on 127.0.0.1): 200 once every rank holds its weights.
    pub(crate) health_port: u16,
    /// Where the daemon's sockets go (0700, the warden's user).
    pub(crate) socket_dir: PathBuf,
}

impl Preload {
    /// `http://127.0.0.1:PORT/health`, when on.
    pub(crate) fn health_url(&self) -> Option<String> {
        self.enabled.then(|| format!("http://127.0.0.1:{}/health", self.health_port))
    }
}

/// What `vllm serve` takes as its model: the first argument after `serve`
/// when it is not a flag, else `--model`.
fn model_of(command: &[String], serve: usize) -> Option<String> {
    match command.get(serve + 1) {
        Some(m) if !m.starts_with('-') => Some(m.clone()),
        _ => flag(command, "--model"),
    }
}

/// The daemon's command derived from the serve command `command`: the
/// same program, `preload`, the model and every argument of
/// [`WEIGHT_FLAGS`] and [`WEIGHT_SWITCHES`] it gives. `Err` says why none
/// can be derived.
pub(crate) fn derive(command: &[String]) -> Result<Vec<String>, String> {
    let serve = command
        .iter()
        .position(|a| a == "serve")
        .ok_or("the serve command is not `vllm serve …`: give `[preload] command`")?;
    let model = model_of(command, serve).ok_or("the serve command names no model")?;
    let mut out: Vec<String> = command[..serve].to_vec();
    out.extend(["preload".into(), "--model".into(), model]);
    let mut it = command[serve + 1..].iter().peekable();
    while let Some(arg) = it.next() {
        let (name, inline) = match arg.split_once('=') {
            Some((n, v)) if n.starts_with('-') => (n, Some(v)),
            _ => (arg.as_str(), None),
        };
        if name == "--model" {
            // Given above; its value is not a positional argument.
            if inline.is_none() {
                it.next();
            }
            continue;
        }
        if WEIGHT_SWITCHES.contains(&name) {
            out.push(arg.clone());
        } else if let Some(spelling) = WEIGHT_FLAGS.iter().find(|f| f.contains(&name)) {
            let value = match inline {
                Some(v) => Some(v.to_string()),
                None => it.next_if(|v| !v.starts_with("--")).cloned(),
            };
            // The daemon itself loads from disk: an engine's `ipc_cache`
            // is not its format.
            if spelling[0] == "--load-format" && value.as_deref() == Some("ipc_cache") {
                continue;
            }
            if let Some(v) = value {
                out.extend([spelling[0].to_string(), v]);
            }
        }
    }
    Ok(out)
}

/// `command` with the socket folder and the health port the warden needs,
/// unless it names them itself.
pub(crate) fn daemon_command(mut command: Vec<String>, socket_dir: &str, health_port: u16) -> Vec<String> {
    if flag(&command, "--weight-cache-socket-dir").is_none() {
        command.extend(["--weight-cache-socket-dir".into(), socket_dir.into()]);
    }
    if flag(&command, "--weight-cache-health-port").is_none() {
        command.extend(["--weight-cache-health-port".into(), health_port.to_string()]);
    }
    if flag(&command, "--weight-cache-health-host").is_none() {
        command.extend(["--weight-cache-health-host".into(), "127.0.0.1".into()]);
    }
    command
}

/// The engine's command: `--load-format ipc_cache` and the socket folder
/// (`--model-loader-extra-config`) added, unless it chooses a load format
/// or a loader config itself.
pub(crate) fn engine_command(mut command: Vec<String>, socket_dir: &str) -> Vec<String> {
    let has = |c: &[String], name: &str| c.iter().any(|a| a == name || a.starts_with(&format!("{name}=")));
    if has(&command, "--load-format") || has(&command, "--model-loader-extra-config") {
        return command;
    }
    let extra = serde_json::json!({ "socket_dir": socket_dir }).to_string();
    command.extend(["--load-format".into(), "ipc_cache".into(), "--model-loader-extra-config".into(), extra]);
    command
}

/// `[preload]`: the daemon's settings; `engine` (the serve command) gains
/// the arguments that have it load from the daemon.
pub(super) fn preload(
    mut k: Keys<'_, '_, '_>,
    engine: &mut Vec<String>,
    port: Option<u16>,
    runtime_dir: PathBuf,
) -> Preload {
    let enabled = k.read("enabled", false, |r, v| r.boolean(v, "enabled"));
    let given = k.read("command", None, |r, v| {
        let c = r.strings(v, "command")?;
        if c.first().is_none_or(String::is_empty) {
            r.problem(Some(v.span()), "`[preload] command` must name a program to run");
            return None;
        }
        Some(Some(c))
    });
    let command_span = k.span_of("command");
    let engine_port = port.unwrap_or(super::command::PORT);
    let health_port = k.read("health-port", engine_port.saturating_add(HEALTH_PORT_OFFSET), |r, v| port_value(r, v));
    let health_span = k.span_of("health-port");
    let socket_dir = k.read("socket-dir", runtime_dir.join(SOCKET_DIR), |r, v| {
        let s = r.string(v, "socket-dir")?;
        if !s.starts_with('/') {
            r.problem(Some(v.span()), "`[preload] socket-dir` must be an absolute path");
            return None;
        }
        Some(PathBuf::from(s))
    });
    let socket_span = k.span_of("socket-dir");
    if !enabled {
        return Preload { enabled, command: Vec::new(), health_port, socket_dir };
    }
    if health_port == engine_port {
        let m =
            format!("`[preload] health-port` {health_port} is the engine's port: give the daemon's /health another");
        k.problem(health_span.or(k.span()), m);
    }
    let dir = socket_dir.to_string_lossy().into_owned();
    if dir.len() > MAX_SOCKET_DIR {
        let m = format!(
            "`[preload] socket-dir` {dir:?} is {} bytes: at most {MAX_SOCKET_DIR} leave room for vLLM's socket names \
             within a unix socket path's 107 bytes",
            dir.len()
        );
        k.problem(socket_span.or(k.span()), m);
    }
    let base = match given {
        Some(c) => c,
        None if engine.is_empty() => return Preload { enabled, command: Vec::new(), health_port, socket_dir },
        None => match derive(engine) {
            Ok(c) => c,
            Err(why) => {
                k.problem(
                    command_span.clone().or(k.span()),
                    format!("`[preload]`: cannot derive the daemon's command: {why}"),
                );
                Vec::new()
            }
        },
    };
    if base.iter().any(|a| a == "ipc_cache") {
        let m =
            "`[preload] command`: the daemon loads the weights from disk; `--load-format ipc_cache` is the engine's";
        k.problem(command_span.or(k.span()), m);
    }
    let command = daemon_command(base, &dir, health_port);
    *engine = engine_command(std::mem::take(engine), &dir);
    Preload { enabled, command, health_port, socket_dir }
}

fn port_value(r: &mut super::reader::Reader<'_>, v: &Value<'_>) -> Option<u16> {
    let n = r.integer(v, "health-port", u16::MAX.into())?;
    if n == 0 {
        r.problem(Some(v.span()), "`health-port` must be at least 1");
        return None;
    }
    u16::try_from(n).ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn argv(s: &str) -> Vec<String> {
        s.split_whitespace().map(String::from).collect()
    }

    #[test]
    fn the_daemon_gets_the_weight_arguments_and_nothing_else() {
        let serve = argv(
            "/opt/vllm/bin/vllm serve /models/kimi --tensor-parallel-size 8 --port 8000 --dtype=bfloat16 \
             --enable-expert-parallel --max-num-seqs 64 -q modelopt_fp4 --trust-remote-code --api-key k",
        );
        assert_eq!(
            derive(&serve).unwrap(),
            argv(
                "/opt/vllm/bin/vllm preload --model /models/kimi --tensor-parallel-size 8 --dtype bfloat16 \
                 --enable-expert-parallel --quantization modelopt_fp4 --trust-remote-code"
            )
        );
    }

    #[test]
    fn a_model_given_as_a_flag_is_the_model() {
        let serve = argv("vllm serve --model /m -tp 2 --load-format ipc_cache --revision abc");
        assert_eq!(derive(&serve).unwrap(), argv("vllm preload --model /m --tensor-parallel-size 2 --revision abc"));
    }

    #[test]
    fn a_command_that_is_not_vllm_serve_cannot_be_derived() {
        let e = derive(&argv("python -m vllm.entrypoints.openai.api_server --model /m")).unwrap_err();
        assert!(e.contains("[preload] command"), "{e}");
        assert!(derive(&argv("vllm serve --port 8000")).unwrap_err().contains("no model"));
    }

    #[test]
    fn the_engine_loads_from_the_daemon_unless_it_says_otherwise() {
        let e = engine_command(argv("vllm serve /m"), "/run/x/weight-cache");
        assert_eq!(
            e[2..],
            argv("/m --load-format ipc_cache --model-loader-extra-config")
                .into_iter()
                .chain([r#"{"socket_dir":"/run/x/weight-cache"}"#.to_string()])
                .collect::<Vec<_>>()[..]
        );
        let own = argv("vllm serve /m --load-format=safetensors");
        assert_eq!(engine_command(own.clone(), "/d"), own);
    }

    #[test]
    fn the_daemon_gets_the_socket_folder_and_health_port_unless_given() {
        let c = daemon_command(argv("vllm preload --model /m"), "/run/w", 8001);
        assert_eq!(
            c,
            argv(
                "vllm preload --model /m --weight-cache-socket-dir /run/w --weight-cache-health-port 8001 \
                 --weight-cache-health-host 127.0.0.1"
            )
        );
        let own = argv(
            "vllm preload --model /m --weight-cache-socket-dir /s --weight-cache-health-port 9 --weight-cache-health-host ::1",
        );
        assert_eq!(daemon_command(own.clone(), "/run/w", 8001), own);
    }

    fn parse(text: &str) -> Result<crate::config::Settings, crate::config::Problems> {
        let dirs = crate::config::Dirs { runtime: Some("/run/w".into()), ..Default::default() };
        crate::config::parse(text, std::path::Path::new("/etc/vllm-warden/kimi.toml"), &dirs)
    }

    #[test]
    fn off_by_default_and_the_engine_command_untouched() {
        let s = parse("[child]\ncommand = [\"vllm\", \"serve\", \"/m\"]\n").unwrap();
        assert!(!s.preload.enabled);
        assert_eq!(s.child.command, argv("vllm serve /m"));
    }

    #[test]
    fn on_it_derives_both_commands() {
        let s = parse(
            "[child]\ncommand = [\"vllm\", \"serve\", \"/m\", \"--port\", \"9000\"]\n[preload]\nenabled = true\n",
        )
        .unwrap();
        assert_eq!(s.preload.health_port, 9001);
        assert_eq!(s.preload.socket_dir, PathBuf::from("/run/w/weight-cache"));
        assert_eq!(s.preload.command[..4], argv("vllm preload --model /m")[..]);
        assert_eq!(s.child.command[5..7], argv("--load-format ipc_cache")[..]);
    }

    #[test]
    fn every_problem_is_named() {
        let text = "[child]\ncommand = [\"python\", \"-m\", \"x\", \"--port\", \"9000\"]\n[preload]\nenabled = true\n\
                    health-port = 9000\nsocket-dir = \"/run/a-very-long-folder-name-that-leaves-no-room-for-the-sockets-of-vllm\"\n";
        let p = parse(text).unwrap_err().to_string();
        assert!(p.contains("kimi.toml:5:15: `[preload] health-port` 9000 is the engine's port"), "{p}");
        assert!(p.contains("`[preload] socket-dir`"), "{p}");
        assert!(p.contains("cannot derive the daemon's command: the serve command is not `vllm serve"), "{p}");
        let relative = parse("[child]\ncommand = [\"vllm\", \"serve\", \"/m\"]\n[preload]\nsocket-dir = \"w\"\n");
        assert!(relative.unwrap_err().to_string().contains("must be an absolute path"));
    }
}
