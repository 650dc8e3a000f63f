use super::*;
use crate::config::profile::Profile;
use proptest::prelude::*;
use std::io::Write;
use std::time::Duration;

/// Every line the follower reads, as its tap sees it.
struct Seen(mpsc::UnboundedSender<String>);

impl Tap for Seen {
    fn line(&mut self, text: &str, _level: Option<Level>) {
        let _ = self.0.send(text.to_string());
    }
}

async fn next<T>(rx: &mut mpsc::UnboundedReceiver<T>) -> T {
    tokio::time::timeout(Duration::from_secs(30), rx.recv()).await.expect("a line within 30 s").unwrap()
}

async fn delivery(rx: &mut mpsc::Receiver<Delivery>) -> Delivery {
    tokio::time::timeout(Duration::from_secs(30), rx.recv()).await.expect("a delivery within 30 s").unwrap()
}

fn append(path: &std::path::Path, text: &str) {
    let mut f = std::fs::OpenOptions::new().append(true).create(true).open(path).unwrap();
    f.write_all(text.as_bytes()).unwrap();
}

fn vllm() -> Classifier {
    Classifier::new(&Profile::Vllm.patterns()).unwrap()
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
    let (out, mut lines) = mpsc::channel(QUEUE);
    let mut tasks = Tasks::default();
    let f = Follower::start(&child, offset, 1, vllm(), Some(Box::new(Seen(tx))), None, out, &mut tasks).unwrap();
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
    // A partial line waits for its end; a drain reads to the end at once
    // and says so after every line it found.
    child.write_all(b"half").unwrap();
    assert_eq!(f.drained_to(), None);
    f.drain();
    assert!(matches!(delivery(&mut lines).await, Delivery::Drained { start: 1 }));
    assert_eq!(f.drained_to(), Some(child.metadata().unwrap().len()), "read to the end, the partial line too");
    assert!(rx.try_recv().is_err(), "a partial line is not a line");
    child.write_all(b" and whole\nINFO:     Application startup complete.\n").unwrap();
    f.drain();
    let mut ready = Vec::new();
    loop {
        match delivery(&mut lines).await {
            Delivery::Lines { start, lines, .. } => ready.extend(lines.into_iter().map(|l| (start, l.class))),
            Delivery::Drained { start } => {
                assert_eq!(start, 1);
                break;
            }
        }
    }
    assert_eq!(ready, vec![(1, Class::Ready)], "only the lines that matter are handed on");
    assert_eq!(next(&mut rx).await, "half and whole");
    let alive = tokio::time::timeout(Duration::from_millis(100), tasks.failed()).await;
    assert!(alive.is_err(), "the follower lives: {alive:?}");
}

/// The file is the buffer: a burst of lines that all matter, written while
/// the loop reads nothing, never holds more than the queue's few batches
/// in memory, and every line arrives, in order.
#[tokio::test]
async fn a_burst_is_held_in_the_file_not_in_memory() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("burst.log");
    let mut child = std::fs::OpenOptions::new().append(true).create(true).open(&path).unwrap();
    let (out, mut rx) = mpsc::channel(QUEUE);
    let mut tasks = Tasks::default();
    let f = Follower::start(&child, 0, 3, vllm(), None, None, out, &mut tasks).unwrap();
    const N: usize = 100_000;
    let mut text = String::new();
    for i in 0..N {
        text.push_str(&format!("(Worker pid={i}) ERROR 11-29 18:16:26 [core.py:1] EngineCore failed to start ({i})\n"));
    }
    child.write_all(text.as_bytes()).unwrap();
    f.drain();
    // The loop reads nothing until the queue is full: the follower waits.
    tokio::time::timeout(Duration::from_secs(30), async {
        while rx.len() < QUEUE {
            tokio::task::yield_now().await;
        }
    })
    .await
    .expect("the queue fills");
    let waiting = f.gauge().held();
    assert!(waiting < text.len() / 4, "{waiting} of {} bytes read ahead of the loop", text.len());
    let mut seen = 0;
    while let Delivery::Lines { start, lines, .. } = delivery(&mut rx).await {
        assert_eq!(start, 3);
        for l in lines {
            assert_eq!(l.class, Class::Fatal);
            assert!(l.text.ends_with(&format!("({seen})")), "{} out of order", l.text);
            seen += 1;
        }
    }
    assert_eq!(seen, N);
    let bound = (QUEUE + 2) * (BATCH_BYTES + 2 * MAX_LINE);
    assert!(f.gauge().high_water() <= bound, "{} bytes held at once, bound {bound}", f.gauge().high_water());
    assert!(f.gauge().high_water() > 0);
    assert_eq!(f.gauge().held(), 0, "every batch given back");
}

#[tokio::test]
async fn a_stopped_follower_is_not_a_failed_task() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("t.log");
    let child = std::fs::OpenOptions::new().append(true).create(true).open(&path).unwrap();
    let (out, _rx) = mpsc::channel(QUEUE);
    let mut tasks = Tasks::default();
    let f = Follower::start(&child, 0, 1, vllm(), None, None, out, &mut tasks).unwrap();
    drop(f);
    let r = tokio::time::timeout(Duration::from_millis(200), tasks.failed()).await;
    assert!(r.is_err(), "{r:?}");
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

/// A line of `ray start` as it writes it into a file: a tab after the
/// time, colour codes around the message.
#[test]
fn a_tab_is_a_space_and_colours_go() {
    let out = split(&[b"2026-11-30 16:49:05,258\tSUCC scripts.py:1082 -- \x1b[32mRay runtime started.\x1b[39m\n"]);
    assert_eq!(out, vec!["2026-11-30 16:49:05,258 SUCC scripts.py:1082 -- Ray runtime started."]);
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
    // Whole in one read, too long: cut the same way.
    let mut whole = vec![b'z'; MAX_LINE + 5];
    whole.extend_from_slice(b"\nnext\n");
    assert_eq!(split(&[&whole]), vec!["z".repeat(MAX_LINE), "next".to_string()]);
}

/// What the splitter did before it read lines in place: the whole line
/// through the terminal parser (`strip`).
fn old_split(chunks: &[&[u8]]) -> Vec<String> {
    let mut buf = Vec::new();
    let mut out = Vec::new();
    let mut overflow = false;
    let emit = |buf: &mut Vec<u8>, out: &mut Vec<String>| {
        if !buf.is_empty() {
            let mut line = String::new();
            strip(buf, &mut line);
            if !line.trim().is_empty() {
                out.push(line);
            }
        }
        buf.clear();
    };
    for mut bytes in chunks.iter().copied() {
        while !bytes.is_empty() {
            let end = bytes.iter().position(|&b| b == b'\n' || b == b'\r');
            let chunk = &bytes[..end.unwrap_or(bytes.len())];
            if !overflow {
                let room = MAX_LINE - buf.len();
                buf.extend_from_slice(&chunk[..chunk.len().min(room)]);
                if chunk.len() >= room && (end.is_none() || chunk.len() > room) {
                    emit(&mut buf, &mut out);
                    overflow = true;
                }
            }
            match end {
                Some(i) => {
                    if !overflow {
                        emit(&mut buf, &mut out);
                    }
                    overflow = false;
                    bytes = &bytes[i + 1..];
                }
                None => break,
            }
        }
    }
    out
}

fn interesting_bytes() -> impl Strategy<Value = Vec<u8>> {
    let byte = prop_oneof![
        4 => prop::sample::select(b"ab [];:0123456789m?PX^_\\".to_vec()),
        2 => prop::sample::select(vec![0x1b, 0x07, 0x18, 0x1a, 0x7f, 0x9c, 0x90, b'\t', 0x00, 0x08]),
        1 => prop::sample::select(vec![0xc2, 0x80, 0x85, 0x9f, 0xa0, 0xe2, 0x96, 0x88, 0xf0, 0xff]),
        1 => any::<u8>(),
    ];
    prop::collection::vec(byte, 0..80)
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(4000))]

    /// A line taken as it is (no control byte, valid UTF-8, no C1) is what
    /// the terminal parser would print of it: the fast path loses nothing.
    #[test]
    fn the_fast_path_is_what_the_terminal_parser_prints(raw in interesting_bytes()) {
        let mut scratch = String::new();
        let ours = clean(&raw, &mut scratch).to_string();
        let spaced: Vec<u8> = raw.iter().map(|&b| if b == b'\t' { b' ' } else { b }).collect();
        let theirs = String::from_utf8_lossy(&strip_ansi_escapes::strip(&spaced)).into_owned();
        prop_assert_eq!(ours, theirs);
    }

    /// Lines cut in place, whatever the reads, are the lines the old
    /// splitter made.
    #[test]
    fn the_splitter_makes_the_same_lines_as_before(
        raw in prop::collection::vec(prop_oneof![3 => interesting_bytes(), 1 => Just(b"\n".to_vec()), 1 => Just(b"\r".to_vec())], 0..20),
        cut in 1usize..50,
    ) {
        let bytes: Vec<u8> = raw.concat();
        let chunks: Vec<&[u8]> = bytes.chunks(cut).collect();
        prop_assert_eq!(split(&chunks), old_split(&chunks));
    }

    /// The prefix read by hand is the prefix the regex finds.
    #[test]
    fn the_prefix_reader_agrees_with_the_regex(
        proc_ in "[a-zA-Z0-9_= )]{0,12}",
        level in prop::sample::select(vec!["INFO", "ERROR", "WARNING", "DEBUG", "CRITICAL", "WARN", "info"]),
        date in "[0-9٣]{2}-[0-9]{2} [0-9]{2}:[0-9x]{2}:[0-9]{2}",
        file in "[a-z.:0-9\\]]{0,10}",
        rest in "[ \u{a0}a-z:]{0,6}",
        shape in 0..4usize,
    ) {
        let text = match shape {
            0 => format!("({proc_}) {level} {date} [{file}]{rest}"),
            1 => format!("{level}:{rest}"),
            2 => format!("({proc_}) {level} {date}"),
            _ => format!("{rest}{level}: x"),
        };
        static PREFIX: std::sync::LazyLock<Arc<Regex>> = std::sync::LazyLock::new(|| vllm().prefix);
        let theirs = PREFIX.captures(&text).map(|m| {
            let proc_ = m.name("proc").map_or("", |p| p.as_str()).to_string();
            let level = m.name("level").or(m.name("ulevel")).map(|l| l.as_str().to_string());
            (proc_, level, m.get(0).unwrap().end())
        });
        match parse_prefix(&text) {
            Ok(ours) => {
                let ours = ours.map(|p| {
                    let word = p.level.map(|l| LEVELS.iter().find(|(_, x)| *x == l).unwrap().0.to_string());
                    (p.process.to_string(), word, p.end)
                });
                prop_assert_eq!(ours, theirs, "{:?}", text);
            }
            Err(()) => prop_assert!(text.contains('٣'), "{:?}", text),
        }
    }
}

/// The fast path and the whole line classify every real line alike.
#[test]
fn borrowed_and_owned_classification_agree_on_real_logs() {
    let dir = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/fixtures");
    let mut n = 0;
    for e in std::fs::read_dir(dir).unwrap() {
        let p = e.unwrap().path();
        if p.extension().is_none_or(|x| x != "log") {
            continue;
        }
        let (mut a, mut b) = (vllm(), vllm());
        for text in split(&[&std::fs::read(&p).unwrap()]) {
            let whole = a.classify(text.clone());
            let v = b.classify_ref(&text);
            assert_eq!(v.level, whole.level, "{text}");
            assert_eq!(v.line.as_ref(), whole.matters().then_some(&whole), "{text}");
            n += usize::from(whole.matters());
        }
    }
    assert!(n > 100, "{n} lines that matter");
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
fn lists_too_big_together_still_classify_in_order() {
    let mut p = Profile::Vllm.patterns();
    // Each list fits the size limit alone; all of them together do not.
    p.progress.push(r"\w{110}y".into());
    p.fatal.push(r"\w{110}x".into());
    let mut c = Classifier::new(&p).unwrap();
    assert!(c.any.is_none());
    assert_eq!(c.classify("INFO:     Application startup complete.".into()).class, Class::Ready);
    assert_eq!(c.classify("plain".into()).class, Class::Plain);
}

#[test]
fn shard_progress_is_condensed() {
    let mut c = vllm();
    let l = c.classify("Loading safetensors checkpoint shards:  45% Completed | 29/64 [01:02<01:10,  2.1s/it]".into());
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

/// The markers under a frame's code (Python 3.11+), even with their
/// indentation cut off by a prefix, are frames, not the exception.
#[test]
fn caret_markers_are_never_the_exception() {
    let mut c = vllm();
    let w = "(Worker pid=7) ERROR 11-29 18:16:26 [multiproc_executor.py:953] ";
    let lines = [
        format!("{w}Traceback (most recent call last):"),
        format!("{w}  File \"a.py\", line 1, in f"),
        format!("{w}    return g(x)"),
        format!("{w}^^^^^^^^^^^^"),
        format!("{w}~~~~^^^~~~"),
        format!("{w}RuntimeError: CUDA error: an illegal memory access was encountered"),
    ];
    let got: Vec<String> = lines.into_iter().filter_map(|l| c.classify(l).exception.map(|x| x.text)).collect();
    assert_eq!(got, ["RuntimeError: CUDA error: an illegal memory access was encountered"]);
}

/// A million processes each opening a traceback (profile `none`): the
/// table never holds more than its cap, and the processes seen last still
/// have their tracebacks followed.
#[test]
fn traceback_state_is_capped_under_a_million_processes() {
    let mut c = Classifier::new(&Patterns::default()).unwrap();
    let prefix = |i: usize| format!("(Worker_{i} pid={i}) ERROR 11-29 18:16:26 [multiproc_executor.py:953] ");
    for i in 0..1_000_000 {
        let l = c.classify_ref(&format!("{}Traceback (most recent call last):", prefix(i)));
        assert!(l.line.is_none(), "a header matters to no one without a fatal pattern");
    }
    assert!(c.traceback_high_water() <= TRACEBACK_PROCESSES, "{}", c.traceback_high_water());
    assert!(c.traceback_high_water() >= TRACEBACK_PROCESSES / 2);
    let last = prefix(999_999);
    assert!(c.classify_ref(&format!("{last}  File \"a.py\", line 1")).line.is_none());
    let v = c.classify_ref(&format!("{last}RuntimeError: the last one"));
    assert_eq!(v.line.and_then(|l| l.exception).map(|e| e.text).as_deref(), Some("RuntimeError: the last one"));
    // The first process was forgotten: its exception line is a plain line.
    assert!(c.classify_ref(&format!("{}RuntimeError: forgotten", prefix(0))).line.is_none());
}

#[test]
fn a_long_process_prefix_costs_no_more_than_a_short_one() {
    let mut c = vllm();
    let long = "p".repeat(60_000);
    let head = format!("({long}) ERROR 11-29 18:16:26 [x.py:1] Traceback (most recent call last):");
    assert_eq!(c.classify(head).class, Class::Fatal);
    let end = c.classify(format!("({long}) ERROR 11-29 18:16:26 [x.py:1] ValueError: x"));
    assert_eq!(end.exception.map(|e| e.text).as_deref(), Some("ValueError: x"));
    assert_eq!(std::mem::size_of_val(&c.tracebacks.states.iter().next().unwrap()), 16);
}

/// Patterns reloaded in place apply to the running child's next lines.
#[tokio::test]
async fn a_running_follower_takes_reloaded_patterns() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("t.log");
    let mut child = std::fs::OpenOptions::new().append(true).create(true).open(&path).unwrap();
    let (out, mut rx) = mpsc::channel(QUEUE);
    let mut tasks = Tasks::default();
    let none = Classifier::new(&Patterns::default()).unwrap();
    let f = Follower::start(&child, 0, 5, none, None, None, out, &mut tasks).unwrap();
    child.write_all(b"INFO:     Application startup complete.\n").unwrap();
    f.drain();
    assert!(matches!(delivery(&mut rx).await, Delivery::Drained { .. }), "no pattern, nothing matters");
    f.reclassify(vllm());
    child.write_all(b"INFO:     Application startup complete.\n").unwrap();
    f.drain();
    match delivery(&mut rx).await {
        Delivery::Lines { lines, .. } => assert_eq!(lines[0].class, Class::Ready),
        other => panic!("{other:?}"),
    }
}

/// A serving child's log is read at most every `pace`, but a drain (the
/// child's exit) is answered at once: an hour's pace would time this out.
#[tokio::test]
async fn a_paced_follower_still_answers_a_drain_at_once() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("t.log");
    let mut child = std::fs::OpenOptions::new().append(true).create(true).open(&path).unwrap();
    let (out, mut rx) = mpsc::channel(QUEUE);
    let mut tasks = Tasks::default();
    let f = Follower::start(&child, 0, 2, vllm(), None, None, out, &mut tasks).unwrap();
    f.pace(Duration::from_secs(3600));
    child.write_all(b"INFO:     Application startup complete.\n").unwrap();
    f.drain();
    let mut got = Vec::new();
    while let Delivery::Lines { lines, .. } = delivery(&mut rx).await {
        got.extend(lines.into_iter().map(|l| l.class));
    }
    // The pause begins after a read: the next line waits for it, or a drain.
    child
        .write_all(b"(EngineCore pid=1) ERROR 11-29 18:16:28 [core.py:1] EngineCore encountered a fatal error\n")
        .unwrap();
    f.drain();
    while let Delivery::Lines { lines, .. } = delivery(&mut rx).await {
        got.extend(lines.into_iter().map(|l| l.class));
    }
    assert_eq!(got, vec![Class::Ready, Class::Fatal]);
}

/// A drain over a long tail of plain lines says, as it reads, that it is
/// still reading: the loop's patience is counted from the last word.
#[test]
fn a_long_drain_of_plain_lines_beats_while_it_reads() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("t.log");
    let plain = "(APIServer pid=1) INFO 11-29 18:11:16 [loggers.py:248] Received request\n".repeat(80_000);
    std::fs::write(&path, &plain).unwrap();
    let (out, mut rx) = mpsc::channel(1000);
    let mut reader = Reader {
        file: File::open(&path).unwrap(),
        pos: 0,
        splitter: Splitter::default(),
        classifier: vllm(),
        tap: None,
        start: 4,
        out,
        gauge: Gauge::default(),
        batch: Batch::default(),
        rotator: None,
        stop_at: None,
        resume_at: 0,
    };
    let control = Control {
        asked: Mutex::default(),
        wake: EventFd::new().unwrap(),
        ended: Mutex::default(),
        ended_now: Default::default(),
        drained: u64::MAX.into(),
    };
    let mut buf = vec![0u8; READ];
    assert!(reader.read_to_end(&mut buf, &control, true));
    let mut beats = 0;
    while let Ok(Delivery::Lines { start, lines, .. }) = rx.try_recv() {
        assert_eq!((start, lines.len()), (4, 0));
        beats += 1;
    }
    assert_eq!(beats, plain.len().div_ceil(READ) / DRAIN_BEAT, "{} bytes", plain.len());
    // Not draining: no word at all.
    reader.pos = 0;
    assert!(reader.read_to_end(&mut buf, &control, false));
    assert!(rx.try_recv().is_err());
}

/// A worker killed by a signal is named by it; a crash signal that a retry
/// meets again (SIGILL) is permanent; other exits keep vLLM's words.
#[test]
fn a_worker_killed_by_a_signal_is_named_by_it() {
    let mut c = vllm();
    let line = |code: &str| {
        format!(
            "(EngineCore pid=20138) ERROR 12-02 02:00:37 [multiproc_executor.py:315] Worker proc VllmWorker-0 died \
             unexpectedly (exit code: {code}), shutting down executor."
        )
    };
    let ill = c.classify(line("-4"));
    assert_eq!(ill.class, Class::Fatal);
    assert_eq!(ill.cause.as_deref(), Some("engine worker died: illegal instruction (SIGILL)"));
    assert!(ill.permanent.is_some());
    let segv = c.classify(line("-11"));
    assert_eq!(segv.cause.as_deref(), Some("engine worker died: segmentation fault (SIGSEGV)"));
    assert_eq!(segv.permanent, None);
    assert_eq!(c.classify(line("-9")).cause.as_deref(), Some("engine worker died: killed by SIGKILL"));
    for other in ["None", "1", "-99"] {
        let l = c.classify(line(other));
        assert_eq!((l.class, l.cause, l.permanent), (Class::Fatal, None, None), "{other}");
    }
}
