//! Where the warden's own events go: the journal, with structured fields
//! and no `F_` prefix, when systemd runs it (`JOURNAL_STREAM` set), and
//! readable lines on stderr otherwise; JSON lines on stderr when asked
//! (`--log-format json`, for a container's log collector). `RUST_LOG` sets
//! the level (default `info`).
//!
//! An event is formatted by the thread that logs it and written by a
//! thread of its own, through a bounded queue: a slow reader (journald
//! under load, a container's collector, a pipe nobody reads) never holds
//! the thread that logs, the loop above all. An event that finds the queue
//! full is dropped and counted, and the count said once the writer has
//! caught up; [`flush`] waits for the queue before the process ends.

use std::io::{self, Write};
use std::os::unix::net::UnixDatagram;
use std::sync::{Arc, OnceLock};
use std::time::Duration;

use tracing_subscriber::EnvFilter;
use tracing_subscriber::prelude::*;

use crate::util::worker::Worker;

/// How events are written to stderr.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, clap::ValueEnum)]
pub(crate) enum Format {
    /// The journal under systemd, else readable lines.
    #[default]
    Text,
    /// One JSON object a line, on stderr, even under systemd: `timestamp`,
    /// `level`, `fields` (`message`, `INSTANCE`, `EVENT` …).
    Json,
}

/// Whether colours are used: `--color`, and the `NO_COLOR` convention
/// (<https://no-color.org>: set and not empty, no colour unless asked).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, clap::ValueEnum)]
pub(crate) enum Colour {
    /// On a terminal, unless `NO_COLOR` is set.
    #[default]
    Auto,
    Always,
    Never,
}

impl Colour {
    /// Whether text written to stderr is coloured.
    pub(crate) fn on_stderr(self) -> bool {
        match self {
            Colour::Always => true,
            Colour::Never => false,
            Colour::Auto => {
                std::env::var_os("NO_COLOR").is_none_or(|v| v.is_empty())
                    && std::io::IsTerminal::is_terminal(&std::io::stderr())
            }
        }
    }
}

/// Install the global subscriber once; later calls do nothing.
pub(crate) fn init(format: Format, colour: Colour) {
    install(format, colour);
    // A panic may end the process: what was logged before it goes out first.
    static HOOK: std::sync::Once = std::sync::Once::new();
    HOOK.call_once(|| {
        let previous = std::panic::take_hook();
        std::panic::set_hook(Box::new(move |info| {
            flush(Duration::from_secs(1));
            previous(info);
        }));
    });
}

fn install(format: Format, colour: Colour) {
    let filter = EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new("info"));
    if format == Format::Json {
        let json = tracing_subscriber::fmt::layer()
            .json()
            .with_writer(Queued::start(Sink::Stderr))
            .with_target(false)
            .with_current_span(false)
            .with_span_list(false);
        let _ = tracing_subscriber::registry().with(filter).with(json).try_init();
        return;
    }
    if std::env::var_os("JOURNAL_STREAM").is_some() {
        match Journal::connect(JOURNALD_SOCKET, "vllm-warden") {
            Ok(layer) => {
                if tracing_subscriber::registry().with(filter).with(layer).try_init().is_ok() {
                    TO_JOURNAL.store(true, std::sync::atomic::Ordering::Relaxed);
                }
                return;
            }
            Err(e) => eprintln!("vllm-warden: journal unavailable ({e}); logging to stderr"),
        }
    }
    let ansi = colour.on_stderr();
    let fmt =
        tracing_subscriber::fmt::layer().with_writer(Queued::start(Sink::Stderr)).with_target(false).with_ansi(ansi);
    let _ = tracing_subscriber::registry().with(filter).with(fmt).try_init();
}

/// Whether the warden's own events go to the journal (else to stderr,
/// where whoever started it reads them).
pub(crate) fn to_journal() -> bool {
    TO_JOURNAL.load(std::sync::atomic::Ordering::Relaxed)
}

static TO_JOURNAL: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

/// Wait until every event logged so far is written, at most `limit`:
/// before the process ends or execs.
pub fn flush(limit: Duration) {
    if let Some(q) = QUEUE.get() {
        q.flush(limit);
    }
}

/// journald's socket for native messages.
const JOURNALD_SOCKET: &str = "/run/systemd/journal/socket";

/// How many events, and how many bytes of them, may wait for the writer.
const QUEUE_EVENTS: usize = 4096;
const QUEUE_BYTES: usize = 4 << 20;

/// Where the writer's thread writes.
enum Sink {
    Stderr,
    /// A datagram per event to journald's socket (the native protocol).
    Journal(UnixDatagram, std::path::PathBuf),
}

impl Sink {
    fn write(&self, event: &[u8]) -> io::Result<()> {
        match self {
            Sink::Stderr => io::stderr().lock().write_all(event),
            Sink::Journal(sock, path) => sock.send_to(event, path).map(|_| ()),
        }
    }

    /// What says that `n` events were dropped, in this sink's form.
    fn dropped(&self, n: u64) -> Vec<u8> {
        let text = format!("{n} event(s) of the warden's own log dropped: the log's reader was too slow");
        match self {
            Sink::Stderr => format!("vllm-warden: {text}\n").into_bytes(),
            Sink::Journal(..) => {
                let mut buf = Vec::new();
                put_field(&mut buf, "PRIORITY", b"4");
                put_field(&mut buf, "SYSLOG_IDENTIFIER", b"vllm-warden");
                put_field(&mut buf, "EVENT", b"log");
                put_field(&mut buf, "MESSAGE", text.as_bytes());
                buf
            }
        }
    }
}

/// The events waiting for the writer: a worker of its own
/// ([`crate::util::worker`]) bounded in events and bytes, whose drops are
/// said in the sink itself (the log cannot say them through itself) as
/// soon as the writer has caught up; or the sink itself, when the thread
/// cannot be started.
struct Queue {
    worker: Option<Worker<Vec<u8>>>,
    direct: Option<Arc<Sink>>,
}

static QUEUE: OnceLock<Queue> = OnceLock::new();

impl Queue {
    fn start(sink: Sink) -> Queue {
        let sink = Arc::new(sink);
        let (to, said) = (sink.clone(), sink.clone());
        let started = spec()
            .say_dropped(Duration::ZERO, move |new, _| {
                let _ = said.write(&said.dropped(new));
            })
            .start(move |event: Vec<u8>| {
                let _ = to.write(&event);
            });
        match started {
            Ok(worker) => Queue { worker: Some(worker), direct: None },
            Err(_) => Queue { worker: None, direct: Some(sink) },
        }
    }

    fn push(&self, event: Vec<u8>) {
        if event.is_empty() {
            return;
        }
        match (&self.worker, &self.direct) {
            (Some(w), _) => {
                w.send(event);
            }
            (None, Some(sink)) => {
                let _ = sink.write(&event);
            }
            (None, None) => {}
        }
    }

    fn flush(&self, limit: Duration) {
        if let Some(w) = &self.worker {
            w.flush(limit);
        }
    }
}

/// The writer's queue: bounded in events and bytes.
fn spec() -> crate::util::worker::Spec<Vec<u8>> {
    Worker::named("log writer", QUEUE_EVENTS).bytes(QUEUE_BYTES, Vec::len)
}

/// The queue, and its writer's thread writing to `sink`; started once (the
/// first sink stays).
fn queue(sink: Sink) -> &'static Queue {
    QUEUE.get_or_init(|| Queue::start(sink))
}

/// The fmt layers' writer: each event is formatted into a buffer of its
/// own, queued whole when the layer is done with it.
#[derive(Clone, Copy)]
struct Queued(&'static Queue);

impl Queued {
    fn start(sink: Sink) -> Queued {
        Queued(queue(sink))
    }
}

impl<'a> tracing_subscriber::fmt::MakeWriter<'a> for Queued {
    type Writer = Event;

    fn make_writer(&'a self) -> Event {
        Event { queue: self.0, buf: Vec::new() }
    }
}

/// One event being formatted.
struct Event {
    queue: &'static Queue,
    buf: Vec<u8>,
}

impl Write for Event {
    fn write(&mut self, b: &[u8]) -> io::Result<usize> {
        self.buf.extend_from_slice(b);
        Ok(b.len())
    }

    fn flush(&mut self) -> io::Result<()> {
        Ok(())
    }
}

impl Drop for Event {
    fn drop(&mut self) {
        self.queue.push(std::mem::take(&mut self.buf));
    }
}

/// The journal's layer: each event as journald's native protocol wants it,
/// with the fields `tracing-journald` gives (`PRIORITY`, `TARGET`,
/// `CODE_FILE`, `CODE_LINE`, `SYSLOG_IDENTIFIER`, then the event's own,
/// their names upper-cased, no prefix), queued for the writer.
struct Journal {
    queue: &'static Queue,
    identifier: String,
}

impl Journal {
    /// A layer for journald at `socket`, if it answers.
    fn connect(socket: &str, identifier: &str) -> io::Result<Journal> {
        let sock = UnixDatagram::unbound()?;
        // journald drops an empty message: it only says the socket is there.
        sock.send_to(&[], socket)?;
        Ok(Journal { queue: queue(Sink::Journal(sock, socket.into())), identifier: identifier.to_string() })
    }

    /// The datagram for `event`.
    fn payload(&self, event: &tracing::Event<'_>) -> Vec<u8> {
        let meta = event.metadata();
        let mut buf = Vec::with_capacity(256);
        let priority = match *meta.level() {
            tracing::Level::ERROR => b"3",
            tracing::Level::WARN => b"4",
            tracing::Level::INFO => b"5",
            tracing::Level::DEBUG => b"6",
            tracing::Level::TRACE => b"7",
        };
        put_field(&mut buf, "PRIORITY", priority);
        put_field(&mut buf, "TARGET", meta.target().as_bytes());
        if let Some(file) = meta.file() {
            put_field(&mut buf, "CODE_FILE", file.as_bytes());
        }
        if let Some(line) = meta.line() {
            let _ = writeln!(buf, "CODE_LINE={line}");
        }
        put_field(&mut buf, "SYSLOG_IDENTIFIER", self.identifier.as_bytes());
        event.record(&mut Fields(&mut buf));
        buf
    }
}

impl<S: tracing::Subscriber> tracing_subscriber::Layer<S> for Journal {
    fn on_event(&self, event: &tracing::Event<'_>, _: tracing_subscriber::layer::Context<'_, S>) {
        self.queue.push(self.payload(event));
    }
}

/// A field whose value may hold anything: its name, then the value's length
/// (64 bits, little-endian) and the value.
fn put_field(buf: &mut Vec<u8>, name: &str, value: &[u8]) {
    buf.extend_from_slice(name.as_bytes());
    buf.push(b'\n');
    buf.extend_from_slice(&(value.len() as u64).to_le_bytes());
    buf.extend_from_slice(value);
    buf.push(b'\n');
}

/// An event's own fields, named as journald wants: `.` becomes `_`, leading
/// `_` go, only letters, digits and `_` stay, upper-cased.
struct Fields<'a>(&'a mut Vec<u8>);

impl Fields<'_> {
    fn put(&mut self, name: &str, value: &[u8]) {
        let name: String = name
            .bytes()
            .map(|c| if c == b'.' { b'_' } else { c })
            .skip_while(|&c| c == b'_')
            .filter(|&c| c == b'_' || c.is_ascii_alphanumeric())
            .map(|c| char::from(c.to_ascii_uppercase()))
            .collect();
        put_field(self.0, &name, value);
    }
}

impl tracing::field::Visit for Fields<'_> {
    fn record_str(&mut self, field: &tracing::field::Field, value: &str) {
        self.put(field.name(), value.as_bytes());
    }

    fn record_debug(&mut self, field: &tracing::field::Field, value: &dyn std::fmt::Debug) {
        self.put(field.name(), format!("{value:?}").as_bytes());
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The fields of a native journal message, in order.
    fn fields(mut p: &[u8]) -> Vec<(String, String)> {
        let mut out = Vec::new();
        while !p.is_empty() {
            let nl = p.iter().position(|&b| b == b'\n').unwrap();
            let line = std::str::from_utf8(&p[..nl]).unwrap();
            if let Some((name, value)) = line.split_once('=') {
                out.push((name.to_string(), value.to_string()));
                p = &p[nl + 1..];
                continue;
            }
            let len = u64::from_le_bytes(p[nl + 1..nl + 9].try_into().unwrap()) as usize;
            let value = std::str::from_utf8(&p[nl + 9..nl + 9 + len]).unwrap();
            out.push((line.to_string(), value.to_string()));
            assert_eq!(p[nl + 9 + len], b'\n');
            p = &p[nl + 10 + len..];
        }
        out
    }

    /// An event reaches a journal socket through the writer's thread, with
    /// the fields tracing-journald gives it.
    #[test]
    fn an_event_reaches_the_journal_with_its_fields() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("journal.sock");
        let journal = UnixDatagram::bind(&path).unwrap();
        let sock = UnixDatagram::unbound().unwrap();
        let queue: &'static Queue = Box::leak(Box::new(Queue::start(Sink::Journal(sock, path))));
        let layer = Journal { queue, identifier: "vllm-warden".into() };
        let subscriber = tracing_subscriber::registry().with(layer);
        tracing::subscriber::with_default(subscriber, || {
            tracing::warn!(INSTANCE = "t", CHILD_PID = 42, EVENT = "backoff", error.kind = %"x", "restarting\nin 0s");
        });
        let mut buf = vec![0u8; 65536];
        let n = journal.recv(&mut buf).unwrap();
        let got = fields(&buf[..n]);
        let names: Vec<&str> = got.iter().map(|(n, _)| n.as_str()).collect();
        assert_eq!(
            names,
            [
                "PRIORITY",
                "TARGET",
                "CODE_FILE",
                "CODE_LINE",
                "SYSLOG_IDENTIFIER",
                "MESSAGE",
                "INSTANCE",
                "CHILD_PID",
                "EVENT",
                "ERROR_KIND"
            ]
        );
        let value = |name: &str| got.iter().find(|(n, _)| n == name).unwrap().1.clone();
        assert_eq!(value("PRIORITY"), "4");
        assert_eq!(value("MESSAGE"), "restarting\nin 0s");
        assert_eq!(value("CHILD_PID"), "42");
        assert_eq!(value("SYSLOG_IDENTIFIER"), "vllm-warden");
        assert!(value("CODE_FILE").ends_with("logging.rs"));
    }

    /// A writer that does not write (a reader that stopped reading) holds
    /// no one who logs: past the bound, events are dropped and counted.
    #[test]
    fn a_stuck_writer_drops_and_counts_what_does_not_fit() {
        let worker = spec().unstarted();
        let queue = Queue { worker: Some(worker.clone()), direct: None };
        for i in 0..QUEUE_EVENTS + 10 {
            queue.push(format!("event {i}\n").into_bytes());
        }
        assert_eq!((worker.high_water().0, worker.dropped()), (QUEUE_EVENTS, 10));
        assert_eq!(
            Sink::Stderr.dropped(10),
            b"vllm-warden: 10 event(s) of the warden's own log dropped: the log's reader was too slow\n"
        );
    }
}
