//! The child's lines in the journal, under `SYSLOG_IDENTIFIER=vllm-<name>`,
//! with the priority taken from vLLM's level word. The child only ever
//! writes to its log file; the warden forwards what it has read, so a slow
//! journal can never slow the child.

use tracing::Level as T;
use tracing_subscriber::prelude::*;

use crate::logwatch::{Level, Line};

/// The tracing level whose journal PRIORITY is the syslog priority of a
/// vLLM level word: tracing-journald writes ERROR as 3 (err), WARN as 4
/// (warning), DEBUG as 6 (info) and TRACE as 7 (debug). A line without a
/// level word (uvicorn, a raw traceback, a progress bar) is info.
pub fn tracing_level(level: Option<Level>) -> T {
    match level {
        Some(Level::Error | Level::Critical) => T::ERROR,
        Some(Level::Warning) => T::WARN,
        Some(Level::Info) | None => T::DEBUG,
        Some(Level::Debug) => T::TRACE,
    }
}

/// Sends lines to journald; built only when the warden runs under systemd.
pub struct Forwarder {
    dispatch: tracing::Dispatch,
    instance: String,
}

impl Forwarder {
    /// `None` outside systemd (`JOURNAL_STREAM` unset) or without journald.
    pub fn from_env(name: &str) -> Option<Forwarder> {
        std::env::var_os("JOURNAL_STREAM")?;
        let layer = match tracing_journald::layer() {
            Ok(l) => l.with_field_prefix(None).with_syslog_identifier(format!("vllm-{name}")),
            Err(e) => {
                tracing::warn!(error = %e, "cannot reach journald: the child's lines stay in its log file only");
                return None;
            }
        };
        let dispatch = tracing::Dispatch::new(tracing_subscriber::registry().with(layer));
        Some(Forwarder { dispatch, instance: name.to_string() })
    }

    pub fn forward(&self, line: &Line) {
        let (text, instance) = (line.text.as_str(), self.instance.as_str());
        tracing::dispatcher::with_default(&self.dispatch, || match tracing_level(line.level) {
            T::ERROR => tracing::error!(INSTANCE = instance, "{text}"),
            T::WARN => tracing::warn!(INSTANCE = instance, "{text}"),
            T::TRACE => tracing::trace!(INSTANCE = instance, "{text}"),
            _ => tracing::debug!(INSTANCE = instance, "{text}"),
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn vllm_levels_map_to_syslog_priorities() {
        // tracing-journald: ERROR→3, WARN→4, INFO→5, DEBUG→6, TRACE→7.
        assert_eq!(tracing_level(Some(Level::Error)), T::ERROR);
        assert_eq!(tracing_level(Some(Level::Critical)), T::ERROR);
        assert_eq!(tracing_level(Some(Level::Warning)), T::WARN);
        assert_eq!(tracing_level(Some(Level::Info)), T::DEBUG);
        assert_eq!(tracing_level(None), T::DEBUG);
        assert_eq!(tracing_level(Some(Level::Debug)), T::TRACE);
    }
}
