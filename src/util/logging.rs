//! Where the warden's own events go: the journal, with structured fields
//! and no `F_` prefix, when systemd runs it (`JOURNAL_STREAM` set), and
//! readable lines on stderr otherwise; JSON lines on stderr when asked
//! (`--log-format json`, for a container's log collector). `RUST_LOG` sets
//! the level (default `info`).

use tracing_subscriber::EnvFilter;
use tracing_subscriber::prelude::*;

/// How events are written to stderr.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, clap::ValueEnum)]
pub enum Format {
    /// The journal under systemd, else readable lines.
    #[default]
    Text,
    /// One JSON object a line, on stderr, even under systemd: `timestamp`,
    /// `level`, `fields` (`message`, `INSTANCE`, `EVENT` …).
    Json,
}

/// Install the global subscriber once; later calls do nothing.
pub fn init(format: Format) {
    let filter = EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new("info"));
    if format == Format::Json {
        let json = tracing_subscriber::fmt::layer()
            .json()
            .with_writer(std::io::stderr)
            .with_target(false)
            .with_current_span(false)
            .with_span_list(false);
        let _ = tracing_subscriber::registry().with(filter).with(json).try_init();
        return;
    }
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
