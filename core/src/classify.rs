//! What a line of the child's log says. [`Splitter`] cuts bytes into lines
//! at `\n` or `\r`, removes ANSI codes (only from the rare line that has a
//! control byte) and caps a line at [`MAX_LINE`]; [`Classifier`] maps each
//! line to a [`Class`] in the order ignore → fatal/permanent → ready →
//! progress and follows Python tracebacks to their final exception line.
//! Pure: the file and its follower are `observe::logwatch`'s.

use std::collections::HashMap;
use std::hash::BuildHasher;
use std::sync::{Arc, Mutex};

use regex::Regex;

use crate::load::{CacheOutcome, LoadMark};
use crate::profile::{LoadSignal, Patterns};

/// Longest line kept; the rest of a longer line is dropped.
pub const MAX_LINE: usize = 64 * 1024;

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
    /// Bytes of a line not yet ended, read but not handed on (none while
    /// the rest of an over-long line is being dropped).
    pub fn pending(&self) -> u64 {
        if self.overflow { 0 } else { self.buf.len() as u64 }
    }

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
    pub(crate) text: String,
}

/// A classified line.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Line {
    /// The whole line, ANSI codes stripped.
    pub text: String,
    /// The line without vLLM's `(Proc pid=N) LEVEL date [file:line]` prefix.
    pub message: String,
    pub(crate) level: Option<Level>,
    pub class: Class,
    /// Set when this line ends a traceback.
    pub exception: Option<Exception>,
    /// Index of the first permanent pattern the line matches, for fatal
    /// lines and exception lines.
    pub permanent: Option<usize>,
    /// The cause a fatal line names in fewer words than its own, such as
    /// `engine worker died: illegal instruction (SIGILL)` for vLLM's
    /// `Worker proc VllmWorker-0 died unexpectedly (exit code: -4)`.
    pub(crate) cause: Option<String>,
    /// What the line tells of the load's phases and compile cache.
    pub load: Vec<LoadMark>,
    /// One of vLLM's memory-fit errors, on a fatal line or an exception
    /// line.
    pub(crate) fit: Option<crate::fit::Problem>,
}

impl Line {
    /// Whether the state machine acts on this line: a fatal, ready or
    /// progress line, or the end of a traceback. Every other line changes
    /// nothing but the journal.
    #[cfg(test)]
    pub(crate) fn matters(&self) -> bool {
        matches!(self.class, Class::Fatal | Class::Ready | Class::Progress(_))
            || self.exception.is_some()
            || !self.load.is_empty()
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

/// The prefix as a pattern, for lines where a Unicode digit stands where
/// vLLM writes an ASCII one ([`parse_prefix`] reads every other line).
/// Compiled at the first such line, which a run seldom meets: its one-pass
/// DFA alone is about 340 KB.
static PREFIX: std::sync::LazyLock<Regex> = std::sync::LazyLock::new(|| {
    Regex::new(
        r"^(?:\((?<proc>[^)]*)\) (?<level>DEBUG|INFO|WARNING|ERROR|CRITICAL) \d\d-\d\d \d\d:\d\d:\d\d \[[^\]]*\] ?|(?<ulevel>DEBUG|INFO|WARNING|ERROR|CRITICAL):\s+)",
    )
    .expect("static regex")
});

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
pub struct LineVerdict {
    pub level: Option<Level>,
    /// The line, owned, when it [`matters`](Line::matters).
    pub line: Option<Line>,
}

/// Classifies lines with the effective patterns.
///
/// Its copies share the compiled patterns and their search caches: each
/// run's follower, and each failure report, goes on where the last left
/// off (see [`Set`]).
#[derive(Debug, Clone)]
pub struct Classifier {
    /// Every pattern of every list as one set: a line that matches none of
    /// them (nearly every line) is plain after one search. `None` when the
    /// lists together pass the size limit (each list alone is checked).
    any: Option<Searcher>,
    ignore: Searcher,
    fatal: Searcher,
    permanent: Searcher,
    ready: Searcher,
    progress: Searcher,
    /// The load's signals, as one set and each with its captures.
    load: Searcher,
    load_signals: Arc<Vec<(LoadSignal, Regex)>>,
    shards: Arc<Regex>,
    /// vLLM's line for a worker process that ended ([`crate::profile::WORKER_DIED`]).
    worker_died: Arc<Regex>,
    /// Traceback state per process (vLLM prefixes each line with its
    /// process; raw stderr lines share the key "").
    tracebacks: Tracebacks,
    next_group: u64,
    /// The server's words for a failed request, from a message's start
    /// (`Patterns::request_errors`).
    request: Searcher,
    /// Per process, the prefix of the request's record under way (see
    /// [`Classifier::request_record`]), at most [`REQUEST_RECORDS`].
    requests: HashMap<String, String>,
}

/// Processes whose request record is followed at once; more forget all.
const REQUEST_RECORDS: usize = 64;

enum Kind {
    Ignored,
    Fatal,
    Ready,
    Progress,
    Plain,
}

/// A set of patterns compiled once, with a spare search cache that the
/// classifier's copies hand on to each other. `regex`'s own caches are
/// kept per thread: a follower that starts on another thread than the last
/// (a new run, a new blocking thread) built the lazy DFA's states again
/// from its first lines, about 1 ms for the simulated server's dozen
/// first lines against 30 µs warm.
#[derive(Debug)]
struct Set {
    re: regex_automata::meta::Regex,
    spare: Mutex<Option<regex_automata::meta::Cache>>,
}

/// A classifier's hold on a [`Set`]: the cache it took, which it gives
/// back when dropped (its follower ended) for the next copy to take.
#[derive(Debug)]
struct Searcher {
    set: Arc<Set>,
    cache: Option<regex_automata::meta::Cache>,
}

impl Searcher {
    /// The patterns as one set, built as `regex::RegexSet` builds them
    /// (and failing as it does).
    fn new<P: AsRef<str>>(patterns: &[P]) -> Result<Searcher, regex::Error> {
        use regex_automata::meta;
        let config = meta::Config::new()
            .match_kind(regex_automata::MatchKind::All)
            .utf8_empty(true)
            .nfa_size_limit(Some(10 * (1 << 20)))
            .hybrid_cache_capacity(2 * (1 << 20));
        let re = meta::Builder::new()
            .configure(config)
            .syntax(regex_automata::util::syntax::Config::new().utf8(true))
            .build_many(patterns)
            .map_err(|e| match e.size_limit() {
                Some(limit) => regex::Error::CompiledTooBig(limit),
                None => regex::Error::Syntax(e.to_string()),
            })?;
        Ok(Searcher { set: Arc::new(Set { re, spare: Mutex::new(None) }), cache: None })
    }

    fn cache(&mut self) -> (&regex_automata::meta::Regex, &mut regex_automata::meta::Cache) {
        let set = &self.set;
        let cache = self.cache.get_or_insert_with(|| {
            let spare = set.spare.lock().unwrap_or_else(|p| p.into_inner()).take();
            spare.unwrap_or_else(|| set.re.create_cache())
        });
        (&set.re, cache)
    }

    /// Some pattern of the set matches somewhere in `text`.
    fn is_match(&mut self, text: &str) -> bool {
        let (re, cache) = self.cache();
        re.search_half_with(cache, &regex_automata::Input::new(text).earliest(true)).is_some()
    }

    /// Every pattern of the set that matches somewhere in `text`.
    fn matches(&mut self, text: &str) -> regex_automata::PatternSet {
        let (re, cache) = self.cache();
        let mut hits = regex_automata::PatternSet::new(re.pattern_len());
        re.which_overlapping_matches_with(cache, &regex_automata::Input::new(text), &mut hits);
        hits
    }
}

impl Clone for Searcher {
    /// The same set; its cache is taken at the first search.
    fn clone(&self) -> Searcher {
        Searcher { set: self.set.clone(), cache: None }
    }
}

impl Drop for Searcher {
    fn drop(&mut self) {
        if let Some(cache) = self.cache.take() {
            let mut spare = self.set.spare.lock().unwrap_or_else(|p| p.into_inner());
            if spare.is_none() {
                *spare = Some(cache);
            }
        }
    }
}

impl Classifier {
    /// Patterns must have been validated (see `config`).
    pub fn new(p: &Patterns) -> Result<Classifier, regex::Error> {
        let lists = [&p.ignore, &p.fatal, &p.permanent, &p.ready, &p.progress];
        let [ignore, fatal, permanent, ready, progress] = lists.map(|l| Searcher::new(l));
        let load: Vec<&String> = p.load.iter().map(|(_, pat)| pat).collect();
        let all: Vec<&String> =
            lists.iter().flat_map(|l| l.iter()).chain(load.iter().copied()).chain(p.request_errors.iter()).collect();
        let request: Vec<String> = p.request_errors.iter().map(|r| format!("^(?:{r})")).collect();
        let load_signals =
            p.load.iter().map(|(sig, pat)| Regex::new(pat).map(|re| (*sig, re))).collect::<Result<Vec<_>, _>>()?;
        Ok(Classifier {
            load: Searcher::new(&load)?,
            load_signals: Arc::new(load_signals),
            ignore: ignore?,
            fatal: fatal?,
            permanent: permanent?,
            ready: ready?,
            progress: progress?,
            any: Searcher::new(&all).ok(),
            shards: Arc::new(
                Regex::new(r"Loading safetensors checkpoint shards:\s+(\d+)% Completed \| (\d+)/(\d+)")
                    .expect("static regex"),
            ),
            worker_died: Arc::new(Regex::new(crate::profile::WORKER_DIED).expect("static regex")),
            tracebacks: Tracebacks::default(),
            next_group: 0,
            request: Searcher::new(&request)?,
            requests: HashMap::new(),
        })
    }

    /// Forget traceback state between runs.
    pub fn reset(&mut self) {
        self.tracebacks.states.clear();
        self.requests.clear();
    }

    /// Whether a prefixed line belongs to the log record of a request that
    /// failed: one whose message begins with the server's words for it
    /// (`Patterns::request_errors`), and the lines of the same process
    /// after it with the very same prefix (vLLM writes a record's prefix,
    /// its time to the second and its source line included, on each of its
    /// lines: the traceback's, the exception's, the chained ones'). A line
    /// of that process with another prefix ends the record.
    fn request_record(&mut self, process: &str, head: &str, message: &str, plain: bool) -> bool {
        if process.is_empty() {
            return false;
        }
        if !plain && self.request.is_match(message) {
            if self.requests.len() >= REQUEST_RECORDS && !self.requests.contains_key(process) {
                self.requests.clear();
            }
            self.requests.insert(process.to_string(), head.to_string());
            return true;
        }
        match self.requests.get(process) {
            Some(h) if h == head => true,
            Some(_) => {
                self.requests.remove(process);
                false
            }
            None => false,
        }
    }

    /// The most processes whose traceback state was held at once.
    #[cfg(test)]
    pub(crate) fn traceback_high_water(&self) -> usize {
        self.tracebacks.high_water
    }

    pub fn classify(&mut self, text: String) -> Line {
        let (prefix, kind, exception, load) = self.judge(&text);
        let end = prefix.as_ref().map_or(0, |p| p.end);
        let level = prefix.and_then(|p| p.level);
        self.line(&text, end, level, kind, exception, load)
    }

    /// Classify a borrowed line; it is copied only if it matters.
    pub fn classify_ref(&mut self, text: &str) -> LineVerdict {
        let (prefix, kind, exception, load) = self.judge(text);
        let end = prefix.as_ref().map_or(0, |p| p.end);
        let level = prefix.and_then(|p| p.level);
        let matters = !matches!(kind, Kind::Plain | Kind::Ignored) || exception.is_some() || !load.is_empty();
        LineVerdict { level, line: matters.then(|| self.line(text, end, level, kind, exception, load)) }
    }

    /// What `text` tells of the load: one mark per signal pattern it matches.
    fn load_marks(&mut self, text: &str) -> Vec<LoadMark> {
        let hits = self.load.matches(text);
        if hits.is_empty() {
            return Vec::new();
        }
        let mut marks = Vec::new();
        for i in hits.iter() {
            let (signal, re) = &self.load_signals[i.as_usize()];
            let mark = match signal {
                LoadSignal::Ends(p) => Some(LoadMark::Ends(*p)),
                LoadSignal::CacheHit => Some(LoadMark::Cache(CacheOutcome::Hit)),
                LoadSignal::CacheMiss => Some(LoadMark::Cache(CacheOutcome::Miss)),
                LoadSignal::CacheDisabled => Some(LoadMark::Cache(CacheOutcome::Disabled)),
                LoadSignal::CacheLoadFailure => {
                    let reason = re.captures(text).and_then(|c| c.name("reason")).map_or("", |m| m.as_str());
                    let reason = reason.trim().chars().take(200).collect();
                    Some(LoadMark::Cache(CacheOutcome::LoadFailure { reason }))
                }
                LoadSignal::WeightsTook => re.captures(text).and_then(|c| {
                    let took = std::time::Duration::try_from_secs_f64(c.name("secs")?.as_str().parse().ok()?).ok()?;
                    let gib = c.name("gib").and_then(|g| g.as_str().parse::<f64>().ok());
                    let bytes = gib.filter(|g| g.is_finite() && *g >= 0.0).map(|g| (g * 1024f64.powi(3)) as u64);
                    Some(LoadMark::WeightsTook { took, bytes })
                }),
            };
            marks.extend(mark);
        }
        marks
    }

    #[allow(clippy::type_complexity)]
    fn judge<'t>(&mut self, text: &'t str) -> (Option<Prefix<'t>>, Kind, Option<Exception>, Vec<LoadMark>) {
        let prefix = match parse_prefix(text) {
            Ok(p) => p,
            Err(()) => PREFIX.captures(text).map(|c| Prefix {
                process: c.name("proc").map_or("", |m| m.as_str()),
                level: c.name("level").or(c.name("ulevel")).and_then(|m| level_word(m.as_str())).map(|(l, _)| l),
                end: c.get(0).map_or(0, |m| m.end()),
            }),
        };
        let plain = self.any.as_mut().is_some_and(|any| !any.is_match(text));
        if let Some(p) = &prefix
            && (!self.requests.is_empty() || !plain)
            && self.request_record(p.process, &text[..p.end], &text[p.end..], plain)
        {
            // A request's failure, whatever it quotes: neither fatal nor a
            // traceback of the run's.
            return (prefix, Kind::Plain, None, Vec::new());
        }
        let load = if plain { Vec::new() } else { self.load_marks(text) };
        let kind = match () {
            _ if plain => Kind::Plain,
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
        (prefix, kind, exception, load)
    }

    fn line(
        &mut self,
        text: &str,
        end: usize,
        level: Option<Level>,
        kind: Kind,
        exception: Option<Exception>,
        load: Vec<LoadMark>,
    ) -> Line {
        let message = &text[end..];
        let class = match kind {
            Kind::Ignored => Class::Ignored,
            Kind::Fatal => Class::Fatal,
            Kind::Ready => Class::Ready,
            Kind::Progress => Class::Progress(self.progress_text(message)),
            Kind::Plain => Class::Plain,
        };
        let permanent = if class == Class::Fatal || exception.is_some() {
            self.permanent.matches(text).iter().next().map(|p| p.as_usize())
        } else {
            None
        };
        let cause = if class == Class::Fatal { self.named_cause(message) } else { None };
        let fit = if class == Class::Fatal || exception.is_some() { fit_problem(message) } else { None };
        Line {
            text: text.to_string(),
            message: message.to_string(),
            level,
            class,
            exception,
            permanent,
            cause,
            load,
            fit,
        }
    }

    /// A worker of the engine killed by a signal, named by the signal: the
    /// exit code vLLM prints for it is the signal's number, negated.
    fn named_cause(&self, message: &str) -> Option<String> {
        let c = self.worker_died.captures(message)?;
        let signal = crate::Signal::from_number(c[1].parse::<i32>().ok()?)?;
        Some(match crate::outcome::crash_words(signal) {
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

/// One of vLLM's memory-fit errors in `message`
/// (`vllm/v1/core/kv_cache_utils.py`, torch's out-of-memory errors).
pub(crate) fn fit_problem(message: &str) -> Option<crate::fit::Problem> {
    use crate::fit::Problem;
    static KV: std::sync::LazyLock<Regex> = std::sync::LazyLock::new(|| {
        Regex::new(r"max seq len \((\d{1,12})\).*larger than the available KV cache memory").expect("a valid pattern")
    });
    static ESTIMATE: std::sync::LazyLock<Regex> = std::sync::LazyLock::new(|| {
        Regex::new(r"estimated maximum model length is (\d{1,12})").expect("a valid pattern")
    });
    if message.contains("No available memory for the cache blocks") {
        return Some(Problem::NoCacheMemory);
    }
    if let Some(c) = KV.captures(message) {
        let max_model_len = c[1].parse().ok()?;
        let estimate = ESTIMATE.captures(message).and_then(|c| c[1].parse().ok());
        return Some(Problem::KvCacheTooSmall { max_model_len, estimate });
    }
    (message.contains("CUDA out of memory") || message.contains("OutOfMemoryError")).then_some(Problem::OutOfMemory)
}

#[cfg(test)]
mod tests;
