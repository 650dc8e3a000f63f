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

/// How many lines may wait for journald; more are dropped from the
/// forwarding (never from the log file or the classification) and counted.
pub const QUEUE: usize = 4096;

/// Sends lines to journald from a thread of its own, so that a slow journal
/// never slows the loop; built only when the warden runs under systemd.
pub struct Forwarder {
    queue: std::sync::mpsc::SyncSender<(T, String)>,
    /// Lines dropped because the queue was full.
    dropped: std::sync::Arc<std::sync::atomic::AtomicU64>,
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
        let (queue, lines) = std::sync::mpsc::sync_channel::<(T, String)>(QUEUE);
        let dropped = std::sync::Arc::new(std::sync::atomic::AtomicU64::new(0));
        let (instance, counted) = (name.to_string(), dropped.clone());
        let spawned = std::thread::Builder::new().name("journal".into()).spawn(move || {
            let (mut reported, mut last) = (0, std::time::Instant::now());
            for (level, text) in lines {
                send(&dispatch, &instance, level, &crate::redact::text(&text));
                let now = counted.load(std::sync::atomic::Ordering::Relaxed);
                // At most every 10 s, so that the report adds no burst of its own.
                if now != reported && last.elapsed() >= std::time::Duration::from_secs(10) {
                    last = std::time::Instant::now();
                    tracing::warn!(INSTANCE = instance.as_str(), EVENT = "journal", "{} line(s) of the child dropped from the journal so far (journald too slow); the log file has them all", now);
                    reported = now;
                }
            }
        });
        if let Err(e) = spawned {
            tracing::warn!(error = %e, "cannot start the journal thread: the child's lines stay in its log file only");
            return None;
        }
        Some(Forwarder { queue, dropped })
    }

    /// Queue `line` for the journal; never blocks.
    pub fn forward(&self, line: &Line) {
        if self.queue.try_send((tracing_level(line.level), line.text.clone())).is_err() {
            self.dropped.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        }
    }

    /// Lines dropped from the forwarding so far.
    pub fn dropped(&self) -> u64 {
        self.dropped.load(std::sync::atomic::Ordering::Relaxed)
    }
}

fn send(dispatch: &tracing::Dispatch, instance: &str, level: T, text: &str) {
    tracing::dispatcher::with_default(dispatch, || match level {
        T::ERROR => tracing::error!(INSTANCE = instance, "{text}"),
        T::WARN => tracing::warn!(INSTANCE = instance, "{text}"),
        T::TRACE => tracing::trace!(INSTANCE = instance, "{text}"),
        _ => tracing::debug!(INSTANCE = instance, "{text}"),
    });
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
