//! Following the child's log file and telling what each line means.
//!
//! [`Follower`] reads the file from a thread of its own, woken by inotify
//! (no polling loop), and survives truncation, rename and re-creation. On
//! that thread, [`Splitter`] cuts the bytes into lines at `\n` or `\r`,
//! removes ANSI codes (only from the rare line that has a control byte) and
//! caps a line at 64 KiB; [`Classifier`] maps each line to a [`Class`] in
//! the order ignore → fatal/permanent → ready → progress and follows Python
//! tracebacks to their final exception line; a [`Tap`] sees every line.
//! Only the lines that matter to the state machine are handed on, in
//! batches, through a bounded channel: when the loop is behind, the
//! follower waits, and the file is the buffer. Restart policy is not known
//! here.

use std::collections::HashMap;
use std::fs::File;
use std::hash::BuildHasher;
use std::io;
use std::os::fd::{AsFd, AsRawFd};
use std::os::unix::fs::{FileExt, MetadataExt};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use nix::poll::{PollFd, PollFlags, PollTimeout};
use nix::sys::eventfd::{EfdFlags, EventFd};
use nix::sys::inotify::{AddWatchFlags, InitFlags, Inotify};
use regex::{Regex, RegexSet};
use tokio::sync::mpsc;

use crate::config::Rotation;
use crate::config::profile::Patterns;
use crate::observe::rotate::Rotator;
use crate::util::tasks::{Lifetime, Tasks};

/// Longest line kept; the rest of a longer line is dropped.
pub const MAX_LINE: usize = 64 * 1024;

/// How much of the file one read takes.
const READ: usize = 64 * 1024;

/// A batch is handed on once it holds this many lines or this many bytes of
/// text, and at the end of every read.
pub const BATCH_LINES: usize = 256;
pub const BATCH_BYTES: usize = 64 * 1024;

/// While a drain is asked for, an empty batch every this many reads
/// (1 MiB) tells the loop that a long tail is still being read.
const DRAIN_BEAT: usize = 16;

/// Batches that may wait for the loop; then the follower waits too.
pub const QUEUE: usize = 4;

/// Processes whose traceback state is kept; the least recently seen half
/// is forgotten when a new one would pass this.
pub const TRACEBACK_PROCESSES: usize = 1024;

/// Cuts a byte stream into clean text lines.
#[derive(Debug, Default)]
pub struct Splitter {
    buf: Vec<u8>,
    /// The current line passed [`MAX_LINE`] and was emitted already.
    overflow: bool,
    /// A line's text after [`strip`], when it had anything to remove.
    scratch: String,
}

impl Splitter {
    /// Cut `bytes` into lines, collecting the non-blank ones.
    pub fn push(&mut self, bytes: &[u8], out: &mut Vec<String>) {
        self.feed(bytes, |line| out.push(line.to_string()));
    }

    /// Cut `bytes` into lines and call `f` with each non-blank one; a line
    /// that is whole in `bytes` and needs no cleaning is not copied.
    pub fn feed(&mut self, mut bytes: &[u8], mut f: impl FnMut(&str)) {
        while !bytes.is_empty() {
            let end = memchr::memchr2(b'\n', b'\r', bytes);
            let chunk = &bytes[..end.unwrap_or(bytes.len())];
            if !self.overflow {
                if end.is_some() && self.buf.is_empty() {
                    emit(&chunk[..chunk.len().min(MAX_LINE)], &mut self.scratch, &mut f);
                } else {
                    let room = MAX_LINE - self.buf.len();
                    self.buf.extend_from_slice(&chunk[..chunk.len().min(room)]);
                    let full = chunk.len() >= room && (end.is_none() || chunk.len() > room);
                    if full || end.is_some() {
                        emit(&self.buf, &mut self.scratch, &mut f);
                        self.buf.clear();
                        self.overflow = full;
                    }
                }
            }
            match end {
                Some(i) => {
                    self.overflow = false;
                    bytes = &bytes[i + 1..];
                }
                None => break,
            }
        }
    }
}

fn emit(raw: &[u8], scratch: &mut String, f: &mut impl FnMut(&str)) {
    let text = clean(raw, scratch);
    if !text.trim().is_empty() {
        f(text);
    }
}

/// The text of a raw line: `raw` itself when it has no control byte and is
/// valid UTF-8 without C1 controls (nearly every line), else [`strip`]ped
/// into `scratch`.
fn clean<'a>(raw: &'a [u8], scratch: &'a mut String) -> &'a str {
    // Without an early exit, so that it vectorises.
    let control = raw.chunks(64).any(|c| c.iter().fold(false, |acc, &b| acc | (b < 0x20)));
    if !control && let Ok(text) = std::str::from_utf8(raw) {
        let c1 = !raw.is_ascii() && memchr::memchr_iter(0xc2, raw).any(|i| matches!(raw.get(i + 1), Some(0x80..=0x9f)));
        if !c1 {
            return text;
        }
    }
    scratch.clear();
    strip(raw, scratch);
    scratch
}

/// What a terminal would print of `raw`: escape sequences (CSI, OSC, DCS,
/// …) and control characters removed, invalid UTF-8 shown as `�`, by the
/// `strip-ansi-escapes` crate (a `vte` terminal parser); a tab is the space
/// a terminal shows, not a control to drop (Ray's and Python logging's
/// `TIME\tLEVEL …`). Only lines that hold a control byte or a C1
/// character come here (see [`clean`]).
pub fn strip(raw: &[u8], out: &mut String) {
    let spaced: Vec<u8>;
    let raw = if memchr::memchr(b'\t', raw).is_some() {
        spaced = raw.iter().map(|&b| if b == b'\t' { b' ' } else { b }).collect();
        &spaced[..]
    } else {
        raw
    };
    out.push_str(&String::from_utf8_lossy(&strip_ansi_escapes::strip(raw)));
}

/// What a line means to the supervisor.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Class {
    /// Matched an ignore (benign) pattern.
    Ignored,
    Fatal,
    Ready,
    /// Shown in `STATUS=` as is.
    Progress(String),
    Plain,
}

/// vLLM's level word, for the journal priority.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Level {
    Debug,
    Info,
    Warning,
    Error,
    Critical,
}

/// The final exception line of a Python traceback.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Exception {
    /// Chained tracebacks ("During handling of the above exception …")
    /// share a group; a later line of the same group replaces an earlier.
    pub group: u64,
    pub text: String,
}

/// A classified line.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Line {
    /// The whole line, ANSI codes stripped.
    pub text: String,
    /// The line without vLLM's `(Proc pid=N) LEVEL date [file:line]` prefix.
    pub message: String,
    pub level: Option<Level>,
    pub class: Class,
    /// Set when this line ends a traceback.
    pub exception: Option<Exception>,
    /// Index of the first permanent pattern the line matches, for fatal
    /// lines and exception lines.
    pub permanent: Option<usize>,
    /// The cause a fatal line names in fewer words than its own, such as
    /// `engine worker died: illegal instruction (SIGILL)` for vLLM's
    /// `Worker proc VllmWorker-0 died unexpectedly (exit code: -4)`.
    pub cause: Option<String>,
}

impl Line {
    /// Whether the state machine acts on this line: a fatal, ready or
    /// progress line, or the end of a traceback. Every other line changes
    /// nothing but the journal.
    pub fn matters(&self) -> bool {
        matches!(self.class, Class::Fatal | Class::Ready | Class::Progress(_)) || self.exception.is_some()
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Tb {
    /// Inside a traceback's frames.
    Frames(u64),
    /// After an exception line: a chain marker may follow.
    After(u64),
    /// After "During handling …": the next traceback joins the group.
    Chained(u64),
}

/// Traceback state per process, bounded: at most [`TRACEBACK_PROCESSES`]
/// processes, each kept under a keyed hash of its prefix, so that a long
/// prefix costs no more than a short one and none can be chosen to collide.
#[derive(Debug, Clone, Default)]
struct Tracebacks {
    states: HashMap<u64, (Tb, u64)>,
    keys: std::collections::hash_map::RandomState,
    /// Counts uses, for the least recently seen.
    clock: u64,
    /// The most processes held at once.
    high_water: usize,
}

impl Tracebacks {
    fn key(&self, prefix: &str) -> u64 {
        self.keys.hash_one(prefix)
    }

    fn get(&mut self, key: u64) -> Option<Tb> {
        self.clock += 1;
        let clock = self.clock;
        self.states.get_mut(&key).map(|(tb, used)| {
            *used = clock;
            *tb
        })
    }

    fn insert(&mut self, key: u64, tb: Tb) {
        self.clock += 1;
        if self.states.len() >= TRACEBACK_PROCESSES && !self.states.contains_key(&key) {
            // Forget the least recently seen half: amortised O(1) a line.
            let mut used: Vec<u64> = self.states.values().map(|(_, u)| *u).collect();
            let mid = used.len() / 2;
            let (_, median, _) = used.select_nth_unstable(mid);
            let median = *median;
            self.states.retain(|_, (_, u)| *u > median);
        }
        self.states.insert(key, (tb, self.clock));
        self.high_water = self.high_water.max(self.states.len());
    }
}

/// vLLM's prefix: the process (`""` for lines without one), the level word
/// and where the message begins.
struct Prefix<'a> {
    process: &'a str,
    level: Option<Level>,
    end: usize,
}

const LEVELS: [(&str, Level); 5] = [
    ("DEBUG", Level::Debug),
    ("INFO", Level::Info),
    ("WARNING", Level::Warning),
    ("ERROR", Level::Error),
    ("CRITICAL", Level::Critical),
];

fn level_word(s: &str) -> Option<(Level, usize)> {
    LEVELS.iter().find(|(w, _)| s.starts_with(w)).map(|(w, l)| (*l, w.len()))
}

/// `(Proc pid=N) LEVEL MM-DD hh:mm:ss [file:line] ` or uvicorn's
/// `LEVEL:   `, read by hand: `Err(())` when a digit's place holds a
/// non-ASCII character (a Unicode digit), for the regex to decide.
fn parse_prefix(text: &str) -> Result<Option<Prefix<'_>>, ()> {
    let b = text.as_bytes();
    if b.first() == Some(&b'(') {
        let Some(close) = memchr::memchr(b')', b) else { return Ok(None) };
        let process = &text[1..close];
        let rest = &text[close + 1..];
        let Some(rest) = rest.strip_prefix(' ') else { return Ok(None) };
        let Some((level, n)) = level_word(rest) else { return Ok(None) };
        let at = text.len() - rest.len() + n;
        // " dd-dd dd:dd:dd ["
        const SHAPE: &[u8] = b" 00-00 00:00:00 [";
        // Too short in bytes is too short in characters too.
        let Some(got) = b.get(at..at + SHAPE.len()) else { return Ok(None) };
        for (want, &c) in SHAPE.iter().zip(got) {
            let ok = if *want == b'0' { c.is_ascii_digit() } else { c == *want };
            if !ok {
                return if *want == b'0' && !c.is_ascii() { Err(()) } else { Ok(None) };
            }
        }
        let from = at + SHAPE.len();
        let Some(close) = memchr::memchr(b']', &b[from..]) else { return Ok(None) };
        let mut end = from + close + 1;
        if b.get(end) == Some(&b' ') {
            end += 1;
        }
        return Ok(Some(Prefix { process, level: Some(level), end }));
    }
    let Some((level, n)) = level_word(text) else { return Ok(None) };
    let Some(rest) = text[n..].strip_prefix(':') else { return Ok(None) };
    let spaces = rest.len() - rest.trim_start().len();
    if spaces == 0 {
        return Ok(None);
    }
    Ok(Some(Prefix { process: "", level: Some(level), end: text.len() - rest.len() + spaces }))
}

/// The process a line comes from, as vLLM's prefix names it (`""` for a
/// line without one), and the line's message after the prefix.
pub fn process_and_message(text: &str) -> (&str, &str) {
    match parse_prefix(text) {
        Ok(Some(p)) => (p.process, &text[p.end..]),
        _ => ("", text),
    }
}

/// The verdict on a line borrowed from the follower's buffer.
#[derive(Debug)]
pub struct Verdict {
    pub level: Option<Level>,
    /// The line, owned, when it [`matters`](Line::matters).
    pub line: Option<Line>,
}

/// Classifies lines with the effective patterns.
///
/// Its copies share the compiled patterns and their search caches (a
/// regex's clone starts with caches of its own, which are built again from
/// the first lines it reads): each run's follower, and each failure report,
/// goes on where the last left off.
#[derive(Debug, Clone)]
pub struct Classifier {
    /// Every pattern of every list as one set: a line that matches none of
    /// them (nearly every line) is plain after one search. `None` when the
    /// lists together pass the size limit (each list alone is checked).
    any: Option<Arc<RegexSet>>,
    ignore: Arc<RegexSet>,
    fatal: Arc<RegexSet>,
    permanent: Arc<RegexSet>,
    ready: Arc<RegexSet>,
    progress: Arc<RegexSet>,
    /// The prefix, for lines where a Unicode digit stands where vLLM writes
    /// an ASCII one ([`parse_prefix`] reads every other line).
    prefix: Arc<Regex>,
    shards: Arc<Regex>,
    /// vLLM's line for a worker process that ended ([`crate::config::profile::WORKER_DIED`]).
    worker_died: Arc<Regex>,
    /// Traceback state per process (vLLM prefixes each line with its
    /// process; raw stderr lines share the key "").
    tracebacks: Tracebacks,
    next_group: u64,
}

enum Kind {
    Ignored,
    Fatal,
    Ready,
    Progress,
    Plain,
}

impl Classifier {
    /// Patterns must have been validated (see `config`).
    pub fn new(p: &Patterns) -> Result<Classifier, regex::Error> {
        let lists = [&p.ignore, &p.fatal, &p.permanent, &p.ready, &p.progress];
        let [ignore, fatal, permanent, ready, progress] = lists.map(|l| RegexSet::new(l).map(Arc::new));
        let all: Vec<&String> = lists.iter().flat_map(|l| l.iter()).collect();
        Ok(Classifier {
            ignore: ignore?,
            fatal: fatal?,
            permanent: permanent?,
            ready: ready?,
            progress: progress?,
            any: RegexSet::new(all).ok().map(Arc::new),
            prefix: Arc::new(Regex::new(
                r"^(?:\((?<proc>[^)]*)\) (?<level>DEBUG|INFO|WARNING|ERROR|CRITICAL) \d\d-\d\d \d\d:\d\d:\d\d \[[^\]]*\] ?|(?<ulevel>DEBUG|INFO|WARNING|ERROR|CRITICAL):\s+)",
            )
            .expect("static regex")),
            shards: Arc::new(
                Regex::new(r"Loading safetensors checkpoint shards:\s+(\d+)% Completed \| (\d+)/(\d+)")
                    .expect("static regex"),
            ),
            worker_died: Arc::new(Regex::new(crate::config::profile::WORKER_DIED).expect("static regex")),
            tracebacks: Tracebacks::default(),
            next_group: 0,
        })
    }

    /// Forget traceback state between runs.
    pub fn reset(&mut self) {
        self.tracebacks.states.clear();
    }

    /// The most processes whose traceback state was held at once.
    pub fn traceback_high_water(&self) -> usize {
        self.tracebacks.high_water
    }

    pub fn classify(&mut self, text: String) -> Line {
        let (prefix, kind, exception) = self.judge(&text);
        let end = prefix.as_ref().map_or(0, |p| p.end);
        let level = prefix.and_then(|p| p.level);
        self.line(&text, end, level, kind, exception)
    }

    /// Classify a borrowed line; it is copied only if it matters.
    pub fn classify_ref(&mut self, text: &str) -> Verdict {
        let (prefix, kind, exception) = self.judge(text);
        let end = prefix.as_ref().map_or(0, |p| p.end);
        let level = prefix.and_then(|p| p.level);
        let matters = !matches!(kind, Kind::Plain | Kind::Ignored) || exception.is_some();
        Verdict { level, line: matters.then(|| self.line(text, end, level, kind, exception)) }
    }

    fn judge<'t>(&mut self, text: &'t str) -> (Option<Prefix<'t>>, Kind, Option<Exception>) {
        let prefix = match parse_prefix(text) {
            Ok(p) => p,
            Err(()) => self.prefix.captures(text).map(|c| Prefix {
                process: c.name("proc").map_or("", |m| m.as_str()),
                level: c.name("level").or(c.name("ulevel")).and_then(|m| level_word(m.as_str())).map(|(l, _)| l),
                end: c.get(0).map_or(0, |m| m.end()),
            }),
        };
        let kind = match &self.any {
            Some(any) if !any.is_match(text) => Kind::Plain,
            _ if self.ignore.is_match(text) => Kind::Ignored,
            _ if self.fatal.is_match(text) || self.permanent.is_match(text) => Kind::Fatal,
            _ if self.ready.is_match(text) => Kind::Ready,
            _ if self.progress.is_match(text) => Kind::Progress,
            _ => Kind::Plain,
        };
        let exception = match kind {
            Kind::Ignored => None,
            _ => {
                let (process, end) = prefix.as_ref().map_or(("", 0), |p| (p.process, p.end));
                self.traceback(process, &text[end..])
            }
        };
        (prefix, kind, exception)
    }

    fn line(&self, text: &str, end: usize, level: Option<Level>, kind: Kind, exception: Option<Exception>) -> Line {
        let message = &text[end..];
        let class = match kind {
            Kind::Ignored => Class::Ignored,
            Kind::Fatal => Class::Fatal,
            Kind::Ready => Class::Ready,
            Kind::Progress => Class::Progress(self.progress_text(message)),
            Kind::Plain => Class::Plain,
        };
        let permanent = if class == Class::Fatal || exception.is_some() {
            self.permanent.matches(text).iter().next()
        } else {
            None
        };
        let cause = if class == Class::Fatal { self.named_cause(message) } else { None };
        Line { text: text.to_string(), message: message.to_string(), level, class, exception, permanent, cause }
    }

    /// A worker of the engine killed by a signal, named by the signal: the
    /// exit code vLLM prints for it is the signal's number, negated.
    fn named_cause(&self, message: &str) -> Option<String> {
        let c = self.worker_died.captures(message)?;
        let signal = nix::sys::signal::Signal::try_from(c[1].parse::<i32>().ok()?).ok()?;
        Some(match crate::process::child::crash_words(signal) {
            Some(words) => format!("engine worker died: {words} ({})", signal.as_str()),
            None => format!("engine worker died: killed by {}", signal.as_str()),
        })
    }

    fn progress_text(&self, message: &str) -> String {
        if let Some(c) = self.shards.captures(message) {
            return format!("Loading safetensors checkpoint shards: {}/{} ({}%)", &c[2], &c[3], &c[1]);
        }
        let m = message.trim();
        match m.char_indices().nth(160) {
            Some((i, _)) => format!("{}…", &m[..i]),
            None => m.to_string(),
        }
    }

    fn traceback(&mut self, process: &str, message: &str) -> Option<Exception> {
        let is_header = message.starts_with("Traceback (most recent call last)");
        if !is_header && self.tracebacks.states.is_empty() {
            return None;
        }
        let key = self.tracebacks.key(process);
        let state = self.tracebacks.get(key);
        let is_chain = || {
            message.starts_with("During handling of the above exception")
                || message.starts_with("The above exception was the direct cause")
        };
        // Frames, their code lines, and the markers Python 3.11+ puts under
        // them (`^^^^`, `~~~^^~~`), which a prefix may have cut loose from
        // their indentation: never the exception.
        let marker = |m: &str| m.trim().chars().all(|c| matches!(c, '^' | '~' | ' '));
        let indented =
            message.starts_with(' ') || message.starts_with('\t') || message.trim().is_empty() || marker(message);
        match state {
            _ if is_header => {
                let group = match state {
                    Some(Tb::Chained(g)) => g,
                    _ => {
                        self.next_group += 1;
                        self.next_group
                    }
                };
                self.tracebacks.insert(key, Tb::Frames(group));
                None
            }
            Some(Tb::Frames(_)) if indented => None,
            Some(Tb::Frames(g)) => {
                self.tracebacks.insert(key, Tb::After(g));
                Some(Exception { group: g, text: message.trim_end().to_string() })
            }
            Some(Tb::After(g)) | Some(Tb::Chained(g)) if is_chain() || message.trim().is_empty() => {
                if is_chain() {
                    self.tracebacks.insert(key, Tb::Chained(g));
                }
                None
            }
            Some(_) => {
                self.tracebacks.states.remove(&key);
                None
            }
            None => None,
        }
    }
}

/// Sees every non-blank line the follower reads, on the follower's thread
/// (the journal, the traffic seen by the canary).
pub trait Tap: Send {
    fn line(&mut self, text: &str, level: Option<Level>);
    /// One read is done: a moment to pass on what was gathered.
    fn end_of_read(&mut self) {}
}

/// What a follower hands to the loop, in the order of the file.
#[derive(Debug)]
pub enum Delivery {
    /// Lines of start `start` that [matter](Line::matters) to the machine.
    Lines { start: u32, lines: Vec<Line>, held: Held },
    /// Everything that was in the file when [`Follower::drain`] was called
    /// has been delivered.
    Drained { start: u32 },
}

/// Bytes of line text handed on and not yet dropped by the loop, and the
/// most there ever were: the follower's memory, measured.
#[derive(Debug, Clone, Default)]
pub struct Gauge(Arc<(AtomicUsize, AtomicUsize)>);

impl Gauge {
    pub(crate) fn hold(&self, bytes: usize) -> Held {
        let now = self.0.0.fetch_add(bytes, Ordering::Relaxed) + bytes;
        self.0.1.fetch_max(now, Ordering::Relaxed);
        Held { gauge: self.clone(), bytes }
    }

    /// Bytes held now.
    pub fn held(&self) -> usize {
        self.0.0.load(Ordering::Relaxed)
    }

    /// The most bytes ever held at once.
    pub fn high_water(&self) -> usize {
        self.0.1.load(Ordering::Relaxed)
    }
}

/// A batch's bytes, counted in the [`Gauge`] until it is dropped.
#[derive(Debug)]
pub struct Held {
    gauge: Gauge,
    bytes: usize,
}

impl Drop for Held {
    fn drop(&mut self) {
        self.gauge.0.0.fetch_sub(self.bytes, Ordering::Relaxed);
    }
}

/// What the loop asks of the follower's thread.
#[derive(Debug, Default)]
struct Asked {
    drain: bool,
    stop: bool,
    /// Patterns reloaded: classify with these from the next read on.
    classifier: Option<Classifier>,
    /// Read at most this often (a drain is answered at once all the same).
    pace: Option<std::time::Duration>,
    /// New rotation settings (a reload).
    rotation: Option<Rotation>,
}

#[derive(Debug)]
struct Control {
    asked: Mutex<Asked>,
    /// Wakes the thread from its wait for inotify.
    wake: EventFd,
    /// Once the thread has ended: the offset of the first line it did not
    /// hand on whole.
    ended: Mutex<Option<u64>>,
    ended_now: std::sync::Condvar,
    /// Where the last read asked for by [`Follower::drain`] ended (the end
    /// of the file then), before its [`Delivery::Drained`] was sent;
    /// `u64::MAX` before one.
    drained: std::sync::atomic::AtomicU64,
}

impl Control {
    fn ask(&self, f: impl FnOnce(&mut Asked)) {
        f(&mut self.asked.lock().unwrap_or_else(|p| p.into_inner()));
        let _ = self.wake.write(1);
    }

    fn take(&self) -> (bool, bool, Option<std::time::Duration>) {
        let mut a = self.asked.lock().unwrap_or_else(|p| p.into_inner());
        (std::mem::take(&mut a.drain), a.stop, a.pace)
    }

    fn take_classifier(&self) -> Option<Classifier> {
        self.asked.lock().unwrap_or_else(|p| p.into_inner()).classifier.take()
    }

    fn take_rotation(&self) -> Option<Rotation> {
        self.asked.lock().unwrap_or_else(|p| p.into_inner()).rotation.take()
    }

    fn stopped(&self) -> bool {
        self.asked.lock().unwrap_or_else(|p| p.into_inner()).stop
    }
}

/// Lines that matter, gathered until they are handed on.
#[derive(Debug, Default)]
struct Batch {
    lines: Vec<Line>,
    bytes: usize,
}

impl Batch {
    fn push(&mut self, line: Line) {
        self.bytes += line.text.len() + line.message.len();
        self.lines.push(line);
    }

    fn full(&self) -> bool {
        self.lines.len() >= BATCH_LINES || self.bytes >= BATCH_BYTES
    }

    /// Hand the batch on, waiting while the loop is behind; false when the
    /// loop is gone.
    fn hand_on(&mut self, out: &mpsc::Sender<Delivery>, gauge: &Gauge, start: u32) -> bool {
        if self.lines.is_empty() {
            return true;
        }
        let held = gauge.hold(std::mem::take(&mut self.bytes));
        let lines = std::mem::take(&mut self.lines);
        out.blocking_send(Delivery::Lines { start, lines, held }).is_ok()
    }
}

/// The follower's thread: the inode the child writes to, read from where
/// the last read ended, and where its lines go.
struct Reader {
    file: File,
    pos: u64,
    splitter: Splitter,
    classifier: Classifier,
    tap: Option<Box<dyn Tap>>,
    start: u32,
    out: mpsc::Sender<Delivery>,
    gauge: Gauge,
    batch: Batch,
    rotator: Option<Rotator>,
    /// A read stops here, even before the end of the file (the rotation
    /// copies in steps).
    stop_at: Option<u64>,
    /// Every line before this offset has been handed on whole (or did not
    /// matter): where another follower goes on.
    resume_at: u64,
}

impl Reader {
    /// Read to the end of the file; false when the loop is gone or the
    /// follower was stopped. While `draining`, a read without a line that
    /// matters still says, every [`DRAIN_BEAT`] reads, that reading goes on.
    fn read_to_end(&mut self, buf: &mut [u8], control: &Control, draining: bool) -> bool {
        let mut quiet = 0;
        if let Ok(meta) = self.file.metadata()
            && meta.len() < self.pos
        {
            // Truncated in place (copytruncate): start over.
            self.pos = 0;
            self.splitter = Splitter::default();
        }
        loop {
            let n = match self.file.read_at(buf, self.pos) {
                Ok(0) => return true,
                Ok(n) => n,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                Err(_) => return true,
            };
            self.pos += n as u64;
            let Reader { splitter, classifier, tap, start, out, gauge, batch, .. } = self;
            let mut open = true;
            splitter.feed(&buf[..n], |text| {
                let v = classifier.classify_ref(text);
                if let Some(t) = tap.as_mut() {
                    t.line(text, v.level);
                }
                if let Some(line) = v.line {
                    batch.push(line);
                    if open && batch.full() {
                        open = batch.hand_on(out, gauge, *start);
                    }
                }
            });
            if let Some(t) = tap.as_mut() {
                t.end_of_read();
            }
            if !open || control.stopped() {
                return false;
            }
            if batch.lines.is_empty() && draining {
                quiet += 1;
                if quiet == DRAIN_BEAT {
                    quiet = 0;
                    let beat = Delivery::Lines { start: *start, lines: Vec::new(), held: gauge.hold(0) };
                    if out.blocking_send(beat).is_err() {
                        return false;
                    }
                }
            } else if !batch.hand_on(out, gauge, *start) {
                return false;
            } else {
                quiet = 0;
            }
            if batch.lines.is_empty() {
                let pending = if self.splitter.overflow { 0 } else { self.splitter.buf.len() as u64 };
                self.resume_at = self.pos.saturating_sub(pending);
            }
            if self.stop_at.is_some_and(|at| self.pos >= at) || (!draining && self.rotation_due()) {
                return true;
            }
        }
    }

    /// Copy what has been read, cut at a block boundary, and cut it out of
    /// the file; false when the filesystem cannot.
    fn rotate_by_collapse(&mut self, rot: &mut Rotator) -> io::Result<bool> {
        let meta = self.file.metadata()?;
        let block = meta.blksize().max(1);
        let upto = self.pos / block * block;
        let size = meta.len();
        if upto == 0 || upto >= size {
            return Ok(false);
        }
        let mut copy = rot.begin()?;
        if let Some((file, _)) = copy.as_mut()
            && let Err(e) = rot.copy(&self.file, file, 0, upto)
        {
            if let Some((_, tmp)) = copy {
                rot.discard(&tmp);
            }
            return Err(e);
        }
        match rot.collapse(upto) {
            Ok(Some(n)) => {
                // The copy may hold more than was cut (a larger block size
                // than reported): keep only what was cut.
                if let Some((file, _)) = copy.as_mut() {
                    file.set_len(n)?;
                }
                self.pos -= n;
                self.resume_at = self.resume_at.saturating_sub(n);
                let keep = rot.settings.keep;
                rot.finish(copy)?;
                tracing::info!(EVENT = "log-rotated", "log file rotated: its first {n} bytes moved out ({keep} kept)");
                Ok(true)
            }
            other => {
                if let Some((_, tmp)) = copy {
                    rot.discard(&tmp);
                }
                other.map(|_| false)
            }
        }
    }

    fn rotation_due(&self) -> bool {
        self.rotator.as_ref().is_some_and(|r| self.pos >= r.settings.max_size)
    }

    /// Copy the file to `NAME.1` and truncate it, reading (and classifying)
    /// what the child writes meanwhile; truncated only once everything is
    /// read. False when the loop is gone or the follower was stopped.
    fn rotate(&mut self, buf: &mut [u8], control: &Control) -> bool {
        /// Copied and read in steps of this much, until the last step is
        /// no larger than [`LAST_STEP`].
        const STEP: u64 = 8 << 20;
        const LAST_STEP: u64 = 64 << 10;
        /// Steps before giving up for now (a child writing faster than the
        /// follower reads): the file grows past the size, nothing is lost,
        /// and the next read tries again.
        const STEPS: usize = 64;
        let Some(mut rot) = self.rotator.take() else { return true };
        // A reader of the bytes by offset goes first.
        let hold = rot.hold();
        let _held = hold.as_ref().map(|h| h.blocking_lock());
        match self.rotate_by_collapse(&mut rot) {
            Ok(true) => {
                self.rotator = Some(rot);
                return true;
            }
            Ok(false) => {}
            Err(e) => tracing::warn!(error = %e, "cannot cut the log file's start: truncating it instead"),
        }
        let mut copy = match rot.begin() {
            Ok(c) => c,
            Err(e) => {
                tracing::warn!(error = %e, "cannot rotate the log file: no copy made; it grows on");
                rot.settings.max_size = rot.settings.max_size.saturating_mul(2);
                self.rotator = Some(rot);
                return true;
            }
        };
        let mut copied = 0;
        let mut open = true;
        let mut done = false;
        for _ in 0..STEPS {
            if let Some((file, _)) = copy.as_mut()
                && let Err(e) = rot.copy(&self.file, file, copied, self.pos)
            {
                tracing::warn!(error = %e, "cannot copy the log file for its rotation");
                break;
            }
            copied = self.pos;
            self.stop_at = Some(self.pos + STEP);
            open = self.read_to_end(buf, control, false);
            self.stop_at = None;
            if !open {
                break;
            }
            if self.pos - copied > LAST_STEP {
                continue;
            }
            if let Some((file, _)) = copy.as_mut()
                && let Err(e) = rot.copy(&self.file, file, copied, self.pos)
            {
                tracing::warn!(error = %e, "cannot copy the log file for its rotation");
                break;
            }
            copied = self.pos;
            match rot.truncate(self.pos) {
                Ok(true) => {
                    done = true;
                    break;
                }
                // Written since: read that too.
                Ok(false) => {}
                Err(e) => {
                    tracing::warn!(error = %e, "cannot truncate the log file");
                    break;
                }
            }
        }
        if done {
            // The child's next write lands at 0; a line cut by the rotation
            // goes on in the splitter.
            self.pos = 0;
            self.resume_at = 0;
            let keep = rot.settings.keep;
            match rot.finish(copy) {
                Ok(()) => {
                    tracing::info!(
                        EVENT = "log-rotated",
                        "log file rotated: {copied} bytes copied, then truncated ({keep} kept)"
                    )
                }
                Err(e) => tracing::warn!(error = %e, "log file truncated, but its copy could not be put in place"),
            }
        } else if let Some((_, tmp)) = copy {
            rot.discard(&tmp);
        }
        self.rotator = Some(rot);
        open
    }
}

/// Follows the log file the child writes to, from an offset, classifying
/// every line on a thread of its own and handing on those that matter.
///
/// It follows the *inode* the warden opened for the child, not the path:
/// whatever happens to the path (renamed any number of times, deleted,
/// re-created by someone else), the lines read are the child's, and a file
/// that others create at the path is not read.
pub struct Follower {
    control: Arc<Control>,
    task: tokio::task::AbortHandle,
    gauge: Gauge,
}

impl Follower {
    /// Start following the file `log` (the child's stdout and stderr) of
    /// start `start` from byte `offset`: every line goes to `tap`, the lines
    /// that matter to `out`, in batches; the file is rotated by `rotator`. The thread is watched as the task
    /// "log follower".
    #[allow(clippy::too_many_arguments)]
    pub fn start(
        log: &File,
        offset: u64,
        start: u32,
        classifier: Classifier,
        tap: Option<Box<dyn Tap>>,
        rotator: Option<Rotator>,
        out: mpsc::Sender<Delivery>,
        tasks: &mut Tasks,
    ) -> io::Result<Follower> {
        // A read-only open file of the same inode, whatever its name becomes.
        let file = File::open(format!("/proc/self/fd/{}", log.as_raw_fd()))?;
        let inotify = Inotify::init(InitFlags::IN_CLOEXEC | InitFlags::IN_NONBLOCK)?;
        // Watched through our own descriptor's magic link: inotify watches
        // the inode it resolves to, and the link stays valid while `file`
        // is open, whatever happens to the path.
        inotify.add_watch(
            format!("/proc/self/fd/{}", file.as_raw_fd()).as_str(),
            AddWatchFlags::IN_MODIFY | AddWatchFlags::IN_CLOSE_WRITE,
        )?;
        let wake = EventFd::from_flags(EfdFlags::EFD_CLOEXEC | EfdFlags::EFD_NONBLOCK)?;
        let control = Arc::new(Control {
            asked: Mutex::default(),
            wake,
            ended: Mutex::default(),
            ended_now: Default::default(),
            drained: u64::MAX.into(),
        });
        let gauge = Gauge::default();
        let reader = Reader {
            file,
            pos: offset,
            splitter: Splitter::default(),
            classifier,
            tap,
            start,
            out,
            gauge: gauge.clone(),
            batch: Batch::default(),
            rotator,
            stop_at: None,
            resume_at: offset,
        };
        let c = control.clone();
        // Started now, not when the loop next polls a task: the child's
        // first lines follow its spawn within a millisecond.
        let thread = tokio::task::spawn_blocking(move || follow(reader, &inotify, &c));
        let task = tasks.spawn("log follower", Lifetime::Owned, async move {
            // A panic on the thread is this task's panic.
            if let Err(e) = thread.await
                && e.is_panic()
            {
                std::panic::resume_unwind(e.into_panic());
            }
        });
        Ok(Follower { control, task, gauge })
    }

    /// Read the file to its end now, without waiting for inotify, then
    /// deliver [`Delivery::Drained`]: used when the child has exited, so
    /// that its last lines are seen before its exit.
    pub fn drain(&self) {
        self.control.ask(|a| a.drain = true);
    }

    /// Classify with `classifier` (reloaded patterns) from the next read on.
    pub fn reclassify(&self, classifier: Classifier) {
        self.control.ask(|a| a.classifier = Some(classifier));
    }

    /// Where the file ended when the follower last read it to its end for
    /// [`Follower::drain`]: known once its [`Delivery::Drained`] is received.
    pub fn drained_to(&self) -> Option<u64> {
        Some(self.control.drained.load(Ordering::SeqCst)).filter(|at| *at != u64::MAX)
    }

    /// Read at most every `every` from now on: a serving child's lines are
    /// gathered for a few milliseconds, so that a chatty child costs a few
    /// wake-ups a second, not one a line. A drain is still answered at once.
    pub fn pace(&self, every: std::time::Duration) {
        self.control.ask(|a| a.pace = Some(every));
    }

    /// Rotate with these settings from now on (a reload).
    pub fn rotation(&self, settings: Rotation) {
        self.control.ask(|a| a.rotation = Some(settings));
    }

    /// The bytes of the batches handed on and not yet dropped.
    pub fn gauge(&self) -> &Gauge {
        &self.gauge
    }
}

impl Follower {
    /// Stop reading: the thread ends after the read under way; see
    /// [`Follower::ended`].
    pub fn stop_reading(&self) {
        self.control.ask(|a| a.stop = true);
    }

    /// Once the thread has ended (waiting up to `patience`): the offset of
    /// the first line not handed on whole, from which another follower can
    /// go on. Every batch handed on before it is in the channel; the
    /// thread may wait for room there, so the caller empties it meanwhile.
    pub fn ended(&self, patience: std::time::Duration) -> Option<u64> {
        let ended = self.control.ended.lock().unwrap_or_else(|p| p.into_inner());
        let (ended, _) = self
            .control
            .ended_now
            .wait_timeout_while(ended, patience, |e| e.is_none())
            .unwrap_or_else(|p| p.into_inner());
        *ended
    }
}

impl Drop for Follower {
    fn drop(&mut self) {
        self.task.abort();
        self.control.ask(|a| a.stop = true);
    }
}

/// The follower's thread; at its end, where the next reader should start.
fn follow(mut reader: Reader, inotify: &Inotify, control: &Control) {
    follow_until_stopped(&mut reader, inotify, control);
    *control.ended.lock().unwrap_or_else(|p| p.into_inner()) = Some(reader.resume_at);
    control.ended_now.notify_all();
}

/// Read, then wait for inotify or a request, until stopped.
fn follow_until_stopped(reader: &mut Reader, inotify: &Inotify, control: &Control) {
    let mut buf = vec![0u8; READ];
    let mut events = [0u8; 4096];
    loop {
        let (drain, stop, pace) = control.take();
        if let Some(c) = control.take_classifier() {
            reader.classifier = c;
        }
        if let Some(settings) = control.take_rotation()
            && let Some(r) = reader.rotator.as_mut()
        {
            r.settings = settings;
        }
        if stop || !reader.read_to_end(&mut buf, control, drain) {
            return;
        }
        if reader.rotation_due() {
            if !reader.rotate(&mut buf, control) {
                return;
            }
            // Read on at once: the rotation may have stopped mid-file.
            if !drain {
                continue;
            }
            if !reader.read_to_end(&mut buf, control, true) {
                return;
            }
        }
        if drain {
            control.drained.store(reader.pos, Ordering::SeqCst);
            if reader.out.blocking_send(Delivery::Drained { start: reader.start }).is_err() {
                return;
            }
        }
        if let Some(pace) = pace {
            // Let lines gather; only a request ends the pause early.
            let ms = PollTimeout::try_from(pace).unwrap_or(PollTimeout::MAX);
            if wait(&mut [PollFd::new(control.wake.as_fd(), PollFlags::POLLIN)], ms).is_err() {
                return;
            }
        }
        let mut fds =
            [PollFd::new(inotify.as_fd(), PollFlags::POLLIN), PollFd::new(control.wake.as_fd(), PollFlags::POLLIN)];
        if wait(&mut fds, PollTimeout::NONE).is_err() {
            return;
        }
        // Empty what woke us: it said "look again", and that is next.
        if fds[0].any().unwrap_or(true) {
            while nix::unistd::read(inotify, &mut events).is_ok_and(|n| n > 0) {}
        }
        if fds[1].any().unwrap_or(true) {
            let _ = control.wake.read();
        }
    }
}

fn wait(fds: &mut [PollFd], timeout: PollTimeout) -> Result<(), ()> {
    match nix::poll::poll(fds, timeout) {
        Ok(_) | Err(nix::errno::Errno::EINTR) => Ok(()),
        Err(e) => {
            tracing::error!(error = %e, "cannot wait for the log file to grow");
            Err(())
        }
    }
}

#[cfg(test)]
mod tests;
