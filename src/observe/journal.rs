//! The child's lines in the journal, under `SYSLOG_IDENTIFIER=vllm-<name>`,
//! with the priority taken from vLLM's level word. The child only ever
//! writes to its pipe, which the warden moves to the log file; the warden
//! forwards what it has read, so a slow journal can never slow the child. The lines go through a bounded queue
//! to a thread of their own, so it never slows the warden either.

use tracing::Level as T;
use tracing_subscriber::prelude::*;

use crate::supervisor::classify::Level;

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

/// How many lines, and how many bytes of them, may wait for journald; more
/// are dropped from the forwarding (never from the log file or the
/// classification) and counted.
pub const QUEUE: usize = 4096;
pub const QUEUE_BYTES: usize = 4 << 20;

/// The lines of one read, packed in one string.
#[derive(Debug, Default, Clone)]
struct Batch {
    text: String,
    /// Each line's level and where it ends in `text`.
    lines: Vec<(T, usize)>,
}

/// The lines waiting for journald, bounded in lines and bytes.
#[derive(Debug, Default)]
pub struct Queue {
    batches: std::collections::VecDeque<Batch>,
    lines: usize,
    bytes: usize,
    /// The most lines and bytes that ever waited at once.
    high_water: (usize, usize),
    dropped: u64,
    /// The forwarder is gone: the thread stops once the queue is empty.
    closed: bool,
}

impl Queue {
    /// Take what fits of `batch`; count the rest as dropped.
    fn admit(&mut self, mut batch: Batch) {
        let room_lines = QUEUE - self.lines;
        let mut keep = 0;
        for (i, (_, end)) in batch.lines.iter().enumerate() {
            if i >= room_lines || self.bytes + end > QUEUE_BYTES {
                break;
            }
            keep = i + 1;
        }
        self.dropped += (batch.lines.len() - keep) as u64;
        if keep == 0 {
            return;
        }
        batch.lines.truncate(keep);
        batch.text.truncate(batch.lines[keep - 1].1);
        self.lines += keep;
        self.bytes += batch.text.len();
        self.high_water = (self.high_water.0.max(self.lines), self.high_water.1.max(self.bytes));
        self.batches.push_back(batch);
    }

    fn take(&mut self) -> Option<Batch> {
        let b = self.batches.pop_front()?;
        self.lines -= b.lines.len();
        self.bytes -= b.text.len();
        Some(b)
    }

    /// The most lines and bytes that ever waited at once.
    pub fn high_water(&self) -> (usize, usize) {
        self.high_water
    }

    pub fn dropped(&self) -> u64 {
        self.dropped
    }
}

#[derive(Debug, Default)]
struct Shared {
    queue: std::sync::Mutex<Queue>,
    ready: std::sync::Condvar,
}

impl Shared {
    fn lock(&self) -> std::sync::MutexGuard<'_, Queue> {
        self.queue.lock().unwrap_or_else(|p| p.into_inner())
    }
}

/// Sends lines to journald from a thread of its own, so that a slow journal
/// never slows the follower or the loop; built only when the warden runs
/// under systemd.
#[derive(Debug)]
pub struct Forwarder {
    shared: std::sync::Arc<Shared>,
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
        let shared = std::sync::Arc::new(Shared::default());
        let (instance, s) = (name.to_string(), shared.clone());
        let spawned = std::thread::Builder::new().name("journal".into()).spawn(move || {
            let (mut reported, mut last) = (0, std::time::Instant::now());
            loop {
                let batch = {
                    let mut q = s.lock();
                    loop {
                        if let Some(b) = q.take() {
                            break b;
                        }
                        if q.closed {
                            return;
                        }
                        q = s.ready.wait(q).unwrap_or_else(|p| p.into_inner());
                    }
                };
                let mut from = 0;
                for (level, end) in batch.lines {
                    send(&dispatch, &instance, level, &crate::util::redact::text(&batch.text[from..end]));
                    from = end;
                }
                let now = s.lock().dropped;
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
        Some(Forwarder { shared })
    }

    /// What a follower forwards through: it gathers the lines of one read
    /// and queues them at once.
    pub fn gatherer(&self) -> Gatherer {
        Gatherer { shared: self.shared.clone(), batch: Batch::default() }
    }

    /// Lines dropped from the forwarding so far.
    pub fn dropped(&self) -> u64 {
        self.shared.lock().dropped
    }
}

impl Drop for Forwarder {
    fn drop(&mut self) {
        self.shared.lock().closed = true;
        self.shared.ready.notify_one();
    }
}

/// Gathers lines for the journal on the follower's thread; never blocks.
/// A clone queues to the same journal.
#[derive(Debug, Clone)]
pub struct Gatherer {
    shared: std::sync::Arc<Shared>,
    batch: Batch,
}

impl Gatherer {
    pub fn line(&mut self, text: &str, level: Option<Level>) {
        self.batch.text.push_str(text);
        self.batch.lines.push((tracing_level(level), self.batch.text.len()));
    }

    /// Queue what was gathered.
    pub fn flush(&mut self) {
        if self.batch.lines.is_empty() {
            return;
        }
        let batch = std::mem::take(&mut self.batch);
        self.shared.lock().admit(batch);
        self.shared.ready.notify_one();
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
        let shared = std::sync::Arc::new(Shared::default());
        let mut g = Gatherer { shared: shared.clone(), batch: Batch::default() };
        for i in 0..10_000 {
            g.line(&format!("short line {i}"), Some(Level::Info));
            if i % 100 == 99 {
                g.flush();
            }
        }
        {
            let q = shared.lock();
            assert_eq!(q.high_water().0, QUEUE);
            assert_eq!(q.dropped(), 10_000 - QUEUE as u64);
        }
        let fresh = std::sync::Arc::new(Shared::default());
        let mut g = Gatherer { shared: fresh.clone(), batch: Batch::default() };
        let long = "x".repeat(64 * 1024);
        for _ in 0..100 {
            g.line(&long, None);
            g.flush();
        }
        let q = fresh.lock();
        assert!(q.high_water().1 <= QUEUE_BYTES, "{:?}", q.high_water());
        assert_eq!(q.lines, QUEUE_BYTES / long.len());
        assert_eq!(q.dropped(), 100 - (QUEUE_BYTES / long.len()) as u64);
    }

    #[test]
    fn a_batch_is_taken_in_order_with_its_levels() {
        let mut q = Queue::default();
        let mut b = Batch::default();
        for (t, l) in [("a", Some(Level::Error)), ("bb", None)] {
            b.text.push_str(t);
            b.lines.push((tracing_level(l), b.text.len()));
        }
        q.admit(b);
        let b = q.take().unwrap();
        assert_eq!(b.text, "abb");
        assert_eq!(b.lines, vec![(T::ERROR, 1), (T::DEBUG, 3)]);
        assert_eq!((q.lines, q.bytes), (0, 0));
    }
}
