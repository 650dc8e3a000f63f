//! The child's lines in the journal, under `SYSLOG_IDENTIFIER=vllm-<name>`,
//! with the priority taken from vLLM's level word. The child only ever
//! writes to its pipe, which the warden moves to the log file; the warden
//! forwards what it has read, so a slow journal can never slow the child. The lines go through a bounded queue
//! to a thread of their own (a [`crate::util::worker`]), so it never slows the warden either.

use tracing::Level as T;
use tracing_subscriber::prelude::*;

use crate::supervisor::classify::Level;
use crate::util::worker::Worker;

/// The tracing level whose journal PRIORITY is the syslog priority of a
/// vLLM level word: tracing-journald writes ERROR as 3 (err), WARN as 4
/// (warning), DEBUG as 6 (info) and TRACE as 7 (debug). A line without a
/// level word (uvicorn, a raw traceback, a progress bar) is info.
pub(crate) fn tracing_level(level: Option<Level>) -> T {
    match level {
        Some(Level::Error | Level::Critical) => T::ERROR,
        Some(Level::Warning) => T::WARN,
        Some(Level::Info) | None => T::DEBUG,
        Some(Level::Debug) => T::TRACE,
    }
}

/// How many lines, and how many bytes of them, may wait for journald; more
/// are dropped from the forwarding (never from the log file or the
/// classification) and counted.
pub(crate) const QUEUE: usize = 4096;
pub(crate) const QUEUE_BYTES: usize = 4 << 20;

/// How often, at the most, the lines dropped are said.
const SAY_DROPPED_EVERY: std::time::Duration = std::time::Duration::from_secs(10);

/// One line for journald, with its level.
type Line = (T, String);

/// Sends lines to journald from a worker of its own
/// ([`crate::util::worker`]), so that a slow journal never slows the
/// follower or the loop; built only when the warden runs under systemd.
#[derive(Debug)]
pub(crate) struct Forwarder {
    worker: Worker<Line>,
}

/// The forwarder's queue: bounded in lines and in bytes.
fn spec() -> crate::util::worker::Spec<Line> {
    Worker::named("journal", QUEUE).bytes(QUEUE_BYTES, |(_, text)| text.len())
}

impl Forwarder {
    /// `None` outside systemd (`JOURNAL_STREAM` unset) or without journald.
    pub(crate) fn from_env(name: &str) -> Option<Forwarder> {
        std::env::var_os("JOURNAL_STREAM")?;
        let layer = match tracing_journald::layer() {
            Ok(l) => l.with_field_prefix(None).with_syslog_identifier(format!("vllm-{name}")),
            Err(e) => {
                tracing::warn!(error = %e, "cannot reach journald: the child's lines stay in its log file only");
                return None;
            }
        };
        let dispatch = tracing::Dispatch::new(tracing_subscriber::registry().with(layer));
        let (instance, told) = (name.to_string(), name.to_string());
        // At most every 10 s, so that the report adds no burst of its own.
        let spawned = spec()
            .say_dropped(SAY_DROPPED_EVERY, move |_, total| {
                tracing::warn!(INSTANCE = told.as_str(), EVENT = "journal", "{} line(s) of the child dropped from the journal so far (journald too slow); the log file has them all", total);
            })
            .start(move |(level, text): Line| send(&dispatch, &instance, level, &crate::util::redact::text(&text)));
        match spawned {
            Ok(worker) => Some(Forwarder { worker }),
            Err(e) => {
                tracing::warn!(error = %e, "cannot start the journal thread: the child's lines stay in its log file only");
                None
            }
        }
    }

    /// What a follower forwards through: it gathers the lines of one read
    /// and queues them at once.
    pub(crate) fn gatherer(&self) -> Gatherer {
        Gatherer { worker: self.worker.clone(), lines: Vec::new() }
    }

    /// Lines dropped from the forwarding so far.
    pub(crate) fn dropped(&self) -> u64 {
        self.worker.dropped()
    }
}

/// Gathers lines for the journal on the follower's thread; never blocks.
/// A clone queues to the same journal.
#[derive(Debug, Clone)]
pub struct Gatherer {
    worker: Worker<Line>,
    lines: Vec<Line>,
}

impl Gatherer {
    pub(crate) fn line(&mut self, text: &str, level: Option<Level>) {
        self.lines.push((tracing_level(level), text.to_string()));
    }

    /// Queue what was gathered; what does not fit is dropped and counted.
    pub(crate) fn flush(&mut self) {
        for line in self.lines.drain(..) {
            self.worker.send(line);
        }
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

    /// A burst with no journald reading: the queue never holds more than
    /// its caps, and every line past them is counted.
    #[test]
    fn the_queue_is_capped_in_lines_and_bytes_and_counts_what_it_drops() {
        let worker = spec().unstarted();
        let mut g = Gatherer { worker: worker.clone(), lines: Vec::new() };
        for i in 0..10_000 {
            g.line(&format!("short line {i}"), Some(Level::Info));
            if i % 100 == 99 {
                g.flush();
            }
        }
        assert_eq!(worker.high_water().0, QUEUE);
        assert_eq!(worker.dropped(), 10_000 - QUEUE as u64);
        let fresh = spec().unstarted();
        let mut g = Gatherer { worker: fresh.clone(), lines: Vec::new() };
        let long = "x".repeat(64 * 1024);
        for _ in 0..100 {
            g.line(&long, None);
            g.flush();
        }
        assert!(fresh.high_water().1 <= QUEUE_BYTES, "{:?}", fresh.high_water());
        assert_eq!(fresh.high_water().0, QUEUE_BYTES / long.len());
        assert_eq!(fresh.dropped(), 100 - (QUEUE_BYTES / long.len()) as u64);
    }

    #[test]
    fn lines_are_taken_in_order_with_their_levels() {
        let (tx, rx) = std::sync::mpsc::channel();
        let worker = spec().start(move |line: Line| tx.send(line).unwrap()).unwrap();
        let mut g = Gatherer { worker: worker.clone(), lines: Vec::new() };
        for (t, l) in [("a", Some(Level::Error)), ("bb", None)] {
            g.line(t, l);
        }
        g.flush();
        assert!(worker.flush(std::time::Duration::from_secs(60)));
        assert_eq!(rx.try_iter().collect::<Vec<_>>(), [(T::ERROR, "a".to_string()), (T::DEBUG, "bb".to_string())]);
    }
}
