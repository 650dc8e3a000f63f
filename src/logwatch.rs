//! Following the child's log file and telling what each line means.
//!
//! [`Follower`] reads the file as it grows, woken by inotify (through the
//! `notify` crate; no polling loop), and survives truncation, rename and
//! re-creation. [`Splitter`] cuts bytes into lines at `\n` or `\r`, strips
//! ANSI codes and caps a line at 64 KiB. [`Classifier`] maps a line to a
//! [`Class`] in the order ignore → fatal/permanent → ready → progress, and
//! follows Python tracebacks to their final exception line. Restart policy
//! is not known here.

use std::collections::HashMap;
use std::fs::File;
use std::io;
use std::os::fd::AsRawFd;
use std::os::unix::fs::FileExt;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};

use notify::{RecursiveMode, Watcher};
use regex::{Regex, RegexSet};
use tokio::sync::mpsc;

use crate::profile::Patterns;
use crate::tasks::{Lifetime, Tasks};

/// Longest line kept; the rest of a longer line is dropped.
pub const MAX_LINE: usize = 64 * 1024;

/// Cuts a byte stream into clean text lines.
#[derive(Debug, Default)]
pub struct Splitter {
    buf: Vec<u8>,
    /// The current line passed [`MAX_LINE`] and was emitted already.
    overflow: bool,
}

impl Splitter {
    pub fn push(&mut self, mut bytes: &[u8], out: &mut Vec<String>) {
        while !bytes.is_empty() {
            let end = bytes.iter().position(|&b| b == b'\n' || b == b'\r');
            let chunk = &bytes[..end.unwrap_or(bytes.len())];
            if !self.overflow {
                let room = MAX_LINE - self.buf.len();
                self.buf.extend_from_slice(&chunk[..chunk.len().min(room)]);
                if chunk.len() >= room && (end.is_none() || chunk.len() > room) {
                    self.emit(out);
                    self.overflow = true;
                }
            }
            match end {
                Some(i) => {
                    if !self.overflow {
                        self.emit(out);
                    }
                    self.overflow = false;
                    bytes = &bytes[i + 1..];
                }
                None => break,
            }
        }
    }

    fn emit(&mut self, out: &mut Vec<String>) {
        if !self.buf.is_empty() {
            let clean = strip_ansi_escapes::strip(&self.buf);
            let line = String::from_utf8_lossy(&clean).into_owned();
            if !line.trim().is_empty() {
                out.push(line);
            }
        }
        self.buf.clear();
    }
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

/// Classifies lines with the effective patterns.
#[derive(Debug)]
pub struct Classifier {
    ignore: RegexSet,
    fatal: RegexSet,
    permanent: RegexSet,
    ready: RegexSet,
    progress: RegexSet,
    prefix: Regex,
    shards: Regex,
    /// Traceback state per process (vLLM prefixes each line with its
    /// process; raw stderr lines share the key "").
    tracebacks: HashMap<String, Tb>,
    next_group: u64,
}

impl Classifier {
    /// Patterns must have been validated (see `config`).
    pub fn new(p: &Patterns) -> Result<Classifier, regex::Error> {
        Ok(Classifier {
            ignore: RegexSet::new(&p.ignore)?,
            fatal: RegexSet::new(&p.fatal)?,
            permanent: RegexSet::new(&p.permanent)?,
            ready: RegexSet::new(&p.ready)?,
            progress: RegexSet::new(&p.progress)?,
            prefix: Regex::new(
                r"^(?:\((?<proc>[^)]*)\) (?<level>DEBUG|INFO|WARNING|ERROR|CRITICAL) \d\d-\d\d \d\d:\d\d:\d\d \[[^\]]*\] ?|(?<ulevel>DEBUG|INFO|WARNING|ERROR|CRITICAL):\s+)",
            )
            .expect("static regex"),
            shards: Regex::new(r"Loading safetensors checkpoint shards:\s+(\d+)% Completed \| (\d+)/(\d+)")
                .expect("static regex"),
            tracebacks: HashMap::new(),
            next_group: 0,
        })
    }

    /// Forget traceback state between runs.
    pub fn reset(&mut self) {
        self.tracebacks.clear();
    }

    pub fn classify(&mut self, text: String) -> Line {
        let (key, level, message) = match self.prefix.captures(&text) {
            Some(c) => {
                let lvl = c.name("level").or(c.name("ulevel")).map(|m| m.as_str());
                let key = c.name("proc").map_or("", |m| m.as_str()).to_string();
                let end = c.get(0).map_or(0, |m| m.end());
                (key, lvl.and_then(parse_level), text[end..].to_string())
            }
            None => (String::new(), None, text.clone()),
        };
        let class = if self.ignore.is_match(&text) {
            Class::Ignored
        } else if self.fatal.is_match(&text) || self.permanent.is_match(&text) {
            Class::Fatal
        } else if self.ready.is_match(&text) {
            Class::Ready
        } else if self.progress.is_match(&text) {
            Class::Progress(self.progress_text(&message))
        } else {
            Class::Plain
        };
        let exception = if class == Class::Ignored { None } else { self.traceback(key, &message) };
        let permanent = if class == Class::Fatal || exception.is_some() {
            self.permanent.matches(&text).iter().next()
        } else {
            None
        };
        Line { text, message, level, class, exception, permanent }
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

    fn traceback(&mut self, key: String, message: &str) -> Option<Exception> {
        let state = self.tracebacks.get(&key).copied();
        let is_header = message.starts_with("Traceback (most recent call last)");
        let is_chain = message.starts_with("During handling of the above exception")
            || message.starts_with("The above exception was the direct cause");
        let indented = message.starts_with(' ') || message.starts_with('\t') || message.trim().is_empty();
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
            Some(Tb::After(g)) | Some(Tb::Chained(g)) if is_chain || message.trim().is_empty() => {
                if is_chain {
                    self.tracebacks.insert(key, Tb::Chained(g));
                }
                None
            }
            Some(_) => {
                self.tracebacks.remove(&key);
                None
            }
            None => None,
        }
    }
}

fn parse_level(s: &str) -> Option<Level> {
    Some(match s {
        "DEBUG" => Level::Debug,
        "INFO" => Level::Info,
        "WARNING" => Level::Warning,
        "ERROR" => Level::Error,
        "CRITICAL" => Level::Critical,
        _ => return None,
    })
}

/// The inode the child writes to, read from where the last read ended.
#[derive(Debug)]
struct Reader {
    file: File,
    pos: u64,
    splitter: Splitter,
}

impl Reader {
    fn drain(&mut self, out: &mut Vec<String>) {
        if let Ok(meta) = self.file.metadata()
            && meta.len() < self.pos
        {
            // Truncated in place (copytruncate): start over.
            self.pos = 0;
            self.splitter = Splitter::default();
        }
        let mut buf = vec![0u8; 64 * 1024];
        loop {
            match self.file.read_at(&mut buf, self.pos) {
                Ok(0) => break,
                Ok(n) => {
                    self.pos += n as u64;
                    self.splitter.push(&buf[..n], out);
                }
                Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                Err(_) => break,
            }
        }
    }
}

/// Follows the log file the child writes to, from an offset, sending each
/// complete line.
///
/// It follows the *inode* the warden opened for the child, not the path:
/// whatever happens to the path (renamed any number of times, deleted,
/// re-created by someone else), the lines read are the child's, and a file
/// that others create at the path is not read.
pub struct Follower {
    reader: Arc<Mutex<Reader>>,
    task: tokio::task::AbortHandle,
    _watcher: notify::RecommendedWatcher,
}

impl Follower {
    /// Start following the file `log` (the child's stdout and stderr) from
    /// byte `offset`. Each line goes to `sink` (called with the reader
    /// locked, so that [`Follower::drain_now`] returns only after every line
    /// read before it was delivered); `sink` returns false to stop.
    pub fn start(
        log: &File,
        offset: u64,
        sink: impl Fn(String) -> bool + Send + 'static,
        tasks: &mut Tasks,
    ) -> io::Result<Follower> {
        // A read-only open file of the same inode, whatever its name becomes.
        let own = PathBuf::from(format!("/proc/self/fd/{}", log.as_raw_fd()));
        let file = File::open(&own)?;
        // Watched through our own descriptor's magic link: inotify watches
        // the inode it resolves to, and the link stays valid while `file`
        // is open, whatever happens to the path.
        let watched = PathBuf::from(format!("/proc/self/fd/{}", file.as_raw_fd()));
        let reader = Arc::new(Mutex::new(Reader { file, pos: offset, splitter: Splitter::default() }));
        let (wake_tx, mut wake_rx) = mpsc::unbounded_channel::<()>();
        let mut watcher = notify::recommended_watcher(move |_res: notify::Result<notify::Event>| {
            let _ = wake_tx.send(());
        })
        .map_err(io::Error::other)?;
        watcher.watch(&watched, RecursiveMode::NonRecursive).map_err(io::Error::other)?;
        let r = reader.clone();
        let task = tasks.spawn("log follower", Lifetime::Owned, async move {
            let mut out = Vec::new();
            loop {
                {
                    let mut reader = r.lock().unwrap_or_else(|p| p.into_inner());
                    reader.drain(&mut out);
                    for line in out.drain(..) {
                        if !sink(line) {
                            return;
                        }
                    }
                }
                if wake_rx.recv().await.is_none() {
                    return;
                }
                while wake_rx.try_recv().is_ok() {}
            }
        });
        Ok(Follower { reader, task, _watcher: watcher })
    }

    /// Read whatever is in the file now, without waiting for inotify: used
    /// when the child has exited, so that its last lines are seen before
    /// its exit.
    pub fn drain_now(&self) -> Vec<String> {
        let mut out = Vec::new();
        self.reader.lock().unwrap_or_else(|p| p.into_inner()).drain(&mut out);
        out
    }
}

impl Drop for Follower {
    fn drop(&mut self) {
        self.task.abort();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::profile::Profile;
    use std::io::Write;
    use std::time::Duration;

    async fn next(rx: &mut mpsc::UnboundedReceiver<String>) -> String {
        tokio::time::timeout(Duration::from_secs(30), rx.recv()).await.expect("a line within 30 s").unwrap()
    }

    fn append(path: &std::path::Path, text: &str) {
        let mut f = std::fs::OpenOptions::new().append(true).create(true).open(path).unwrap();
        f.write_all(text.as_bytes()).unwrap();
    }

    #[tokio::test]
    async fn the_follower_reads_the_childs_inode_through_truncation_renames_and_recreation() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("t.log");
        append(&path, "old line, before the offset\n");
        let offset = std::fs::metadata(&path).unwrap().len();
        // What the child writes to.
        let mut child = std::fs::OpenOptions::new().append(true).open(&path).unwrap();
        let (tx, mut rx) = mpsc::unbounded_channel();
        let mut tasks = Tasks::default();
        let f = Follower::start(&child, offset, move |l| tx.send(l).is_ok(), &mut tasks).unwrap();
        child.write_all(b"first line, long enough to be longer than what follows a truncation\n").unwrap();
        assert_eq!(next(&mut rx).await, "first line, long enough to be longer than what follows a truncation");
        // Truncated in place, as logrotate's copytruncate does.
        std::fs::OpenOptions::new().write(true).open(&path).unwrap().set_len(0).unwrap();
        child.write_all(b"after truncation\n").unwrap();
        assert_eq!(next(&mut rx).await, "after truncation");
        // Renamed five times, re-created by someone else each time: only
        // the child's inode is read.
        for i in 1..=5 {
            std::fs::rename(&path, dir.path().join(format!("t.log.{i}"))).unwrap();
            append(&path, &format!("someone else's line {i}\n"));
            child.write_all(format!("the child after rotation {i}\n").as_bytes()).unwrap();
            assert_eq!(next(&mut rx).await, format!("the child after rotation {i}"));
        }
        std::fs::remove_file(dir.path().join("t.log.5")).unwrap();
        child.write_all(b"after deletion\n").unwrap();
        assert_eq!(next(&mut rx).await, "after deletion");
        // A partial line is delivered once complete; drain_now reads at once.
        child.write_all(b"half").unwrap();
        assert!(f.drain_now().is_empty());
        child.write_all(b" and whole\n").unwrap();
        let mut got = f.drain_now();
        if got.is_empty() {
            got.push(next(&mut rx).await);
        }
        assert_eq!(got, vec!["half and whole"]);
    }

    fn split(chunks: &[&[u8]]) -> Vec<String> {
        let mut s = Splitter::default();
        let mut out = Vec::new();
        for c in chunks {
            s.push(c, &mut out);
        }
        out
    }

    #[test]
    fn lines_end_at_newline_or_carriage_return() {
        let out = split(&[b"a\nb\rc\r\nd", b"e\n"]);
        assert_eq!(out, vec!["a", "b", "c", "de"]);
    }

    #[test]
    fn partial_lines_wait_for_their_end() {
        assert!(split(&[b"no end yet"]).is_empty());
    }

    #[test]
    fn ansi_codes_are_stripped() {
        let out = split(&[b"\x1b[32mINFO\x1b[0m 11-29 ready\n"]);
        assert_eq!(out, vec!["INFO 11-29 ready"]);
    }

    #[test]
    fn long_lines_are_cut_at_64k() {
        let long = vec![b'x'; MAX_LINE * 2 + 10];
        let out = split(&[&long, b"\nnext\n"]);
        assert_eq!(out.len(), 2);
        assert_eq!(out[0].len(), MAX_LINE);
        assert_eq!(out[1], "next");
        let exact = vec![b'y'; MAX_LINE];
        let out = split(&[&exact, b"\n"]);
        assert_eq!(out.len(), 1);
        assert_eq!(out[0].len(), MAX_LINE);
    }

    fn vllm() -> Classifier {
        Classifier::new(&Profile::Vllm.patterns()).unwrap()
    }

    #[test]
    fn classification_order_is_ignore_fatal_ready_progress() {
        let mut c = vllm();
        assert_eq!(c.classify("INFO:     Application startup complete.".into()).class, Class::Ready);
        let l = c.classify("(EngineCore pid=1) ERROR 11-29 18:16:28 [core.py:1510] EngineCore failed to start.".into());
        assert_eq!(l.class, Class::Fatal);
        assert_eq!(l.message, "EngineCore failed to start.");
        assert_eq!(l.level, Some(Level::Error));
        let l = c.classify(
            "/usr/lib/python3.11/multiprocessing/resource_tracker.py:254: UserWarning: resource_tracker: There appear to be 1 leaked shared_memory objects; NCCL error".into(),
        );
        assert_eq!(l.class, Class::Ignored);
    }

    #[test]
    fn shard_progress_is_condensed() {
        let mut c = vllm();
        let l =
            c.classify("Loading safetensors checkpoint shards:  45% Completed | 29/64 [01:02<01:10,  2.1s/it]".into());
        assert_eq!(l.class, Class::Progress("Loading safetensors checkpoint shards: 29/64 (45%)".into()));
    }

    #[test]
    fn chained_tracebacks_share_a_group() {
        let mut c = vllm();
        let lines = [
            "Traceback (most recent call last):",
            "  File \"x.py\", line 1, in <module>",
            "json.decoder.JSONDecodeError: Unterminated string",
            "",
            "During handling of the above exception, another exception occurred:",
            "",
            "Traceback (most recent call last):",
            "  File \"y.py\", line 2, in f",
            "OSError: It looks like the config file at '/m/config.json' is not a valid JSON file.",
            "Traceback (most recent call last):",
            "  File \"z.py\", line 3, in g",
            "RuntimeError: later",
        ];
        let ex: Vec<Exception> = lines.iter().filter_map(|l| c.classify(l.to_string()).exception).collect();
        assert_eq!(ex.len(), 3);
        assert_eq!(ex[0].group, ex[1].group);
        assert_ne!(ex[1].group, ex[2].group);
        assert!(ex[1].text.starts_with("OSError: It looks like"));
    }

    #[test]
    fn prefixed_tracebacks_are_tracked_per_process() {
        let mut c = vllm();
        let w = "(Worker pid=7) ERROR 11-29 18:16:26 [multiproc_executor.py:953] ";
        let e = "(EngineCore pid=6) INFO 11-29 18:16:26 [core.py:1] ";
        let lines = [
            format!("{w}Traceback (most recent call last):"),
            format!("{e}something unrelated"),
            format!("{w}  File \"a.py\", line 1"),
            format!("{w}NotImplementedError: Currently supported kv cache quantization is num_bits=8"),
        ];
        let mut got = Vec::new();
        for l in lines {
            let l = c.classify(l);
            if let Some(x) = l.exception {
                got.push((x.text, l.permanent));
            }
        }
        assert_eq!(got.len(), 1);
        assert!(got[0].0.starts_with("NotImplementedError: Currently supported"));
        assert!(got[0].1.is_some(), "the kv cache quantization message is permanent");
    }
}
