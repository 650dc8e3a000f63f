//! Where the warden's own events go: the journal, with structured fields
//! and no `F_` prefix, when systemd runs it (`JOURNAL_STREAM` set), and
//! readable lines on stderr otherwise. `RUST_LOG` sets the level (default
//! `info`).

use tracing_subscriber::EnvFilter;
use tracing_subscriber::prelude::*;

/// Install the global subscriber once; later calls do nothing.
pub fn init() {
    let filter = EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new("info"));
    if std::env::var_os("JOURNAL_STREAM").is_some() {
        match tracing_journald::layer() {
            Ok(layer) => {
                let layer = layer.with_field_prefix(None).with_syslog_identifier("vllm-warden".into());
                let _ = tracing_subscriber::registry().with(filter).with(layer).try_init();
                return;
            }
            Err(e) => eprintln!("vllm-warden: journal unavailable ({e}); logging to stderr"),
        }
    }
    let ansi = std::io::IsTerminal::is_terminal(&std::io::stderr());
    let fmt = tracing_subscriber::fmt::layer().with_writer(std::io::stderr).with_target(false).with_ansi(ansi);
    let _ = tracing_subscriber::registry().with(filter).with(fmt).try_init();
}
