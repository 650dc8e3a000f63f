use super::*;
use crate::config::profile::{Patterns, Profile};
use crate::supervisor::classify::{Class, MAX_LINE};
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
    let f =
        LogFollower::start(&child, offset, 1, vllm(), Some(Box::new(Seen(tx))), None, None, out, &mut tasks).unwrap();
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
    let f = LogFollower::start(&child, 0, 3, vllm(), None, None, None, out, &mut tasks).unwrap();
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
    let f = LogFollower::start(&child, 0, 1, vllm(), None, None, None, out, &mut tasks).unwrap();
    drop(f);
    let r = tokio::time::timeout(Duration::from_millis(200), tasks.failed()).await;
    assert!(r.is_err(), "{r:?}");
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
    let f = LogFollower::start(&child, 0, 5, none, None, None, None, out, &mut tasks).unwrap();
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
    let f = LogFollower::start(&child, 0, 2, vllm(), None, None, None, out, &mut tasks).unwrap();
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
        sink: None,
        rotator: None,
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

/// The child's end of the pipe, on a thread of its own.
struct Child(std::sync::mpsc::Sender<Vec<u8>>);

impl Child {
    fn write_all(&mut self, bytes: &[u8]) -> std::io::Result<()> {
        self.0.send(bytes.to_vec()).map_err(std::io::Error::other)
    }
}

/// A follower of the file a sink writes, from its start; the child's end of
/// the pipe and the sink.
fn piped(
    path: &std::path::Path,
    file: File,
    rotation: Option<Rotation>,
    tap: Option<Box<dyn Tap>>,
    out: mpsc::Sender<Delivery>,
    tasks: &mut Tasks,
) -> (LogFollower, File, Arc<Sink>, crate::observe::logpipe::Writer) {
    let (read, write) = crate::observe::logpipe::pipe().unwrap();
    let sink = Sink::new(read, file, path).unwrap();
    let writer = crate::observe::logpipe::Writer::start(sink.clone(), tasks);
    let rotator = rotation.map(|r| Rotator::new(sink.clone(), r).unwrap());
    let f =
        LogFollower::start(&sink.file().unwrap(), 0, 1, vllm(), tap, Some(sink.clone()), rotator, out, tasks).unwrap();
    (f, File::from(write), sink, writer)
}

/// Rotations of a file the warden writes, while the child writes lines
/// that end in the middle of a write: each copy ends with a whole line, the
/// files together hold every line once, in order, and the follower read
/// each line whole.
#[tokio::test]
async fn a_rotation_cuts_the_file_at_a_lines_end() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("t.log");
    let file = std::fs::OpenOptions::new().append(true).create(true).open(&path).unwrap();
    let (tx, mut rx) = mpsc::unbounded_channel();
    let (out, mut lines) = mpsc::channel(QUEUE);
    let mut tasks = Tasks::default();
    let rotation = Rotation { max_size: 1 << 20, keep: 1000, compress: false };
    let (f, mut child, _sink, _writer) = piped(&path, file, Some(rotation), Some(Box::new(Seen(tx))), out, &mut tasks);
    // Far more than the pipe holds: written from a thread of its own.
    let (to_child, from_test) = std::sync::mpsc::channel::<Vec<u8>>();
    let writing = std::thread::spawn(move || {
        while let Ok(bytes) = from_test.recv() {
            child.write_all(&bytes).unwrap();
        }
    });
    let mut child = Child(to_child);
    // Three bursts of a MiB and more, each ending in the first half of a
    // line: the rotation after each comes while a line is not yet ended.
    const N: usize = 60_000;
    let line = |i: usize| format!("line {i:08} of the child, long enough to fill a MiB sooner");
    for burst in 0..3 {
        let mut text = String::new();
        if burst > 0 {
            text.push_str("of the child, long enough to fill a MiB sooner\n");
        }
        for i in burst * N / 3 + usize::from(burst > 0)..(burst + 1) * N / 3 {
            text.push_str(&line(i));
            text.push('\n');
        }
        if burst < 2 {
            text.push_str(&format!("line {:08} ", (burst + 1) * N / 3));
        }
        child.write_all(text.as_bytes()).unwrap();
        for i in burst * N / 3..(burst + 1) * N / 3 {
            assert_eq!(next(&mut rx).await, line(i));
        }
    }
    f.drain();
    while !matches!(delivery(&mut lines).await, Delivery::Drained { .. }) {}
    let mut copies: Vec<(u32, std::path::PathBuf)> = std::fs::read_dir(dir.path())
        .unwrap()
        .filter_map(|e| {
            let name = e.unwrap().file_name().into_string().unwrap();
            Some((name.strip_prefix("t.log.")?.parse().ok()?, dir.path().join(name)))
        })
        .collect();
    copies.sort_by_key(|c| std::cmp::Reverse(c.0));
    drop(child);
    writing.join().unwrap();
    assert!(copies.len() >= 3, "{} rotations of {N} lines", copies.len());
    let mut all = String::new();
    for (_, p) in &copies {
        let text = std::fs::read_to_string(p).unwrap();
        assert!(text.ends_with('\n'), "{} ends inside a line", p.display());
        all.push_str(&text);
    }
    all.push_str(&std::fs::read_to_string(&path).unwrap());
    let want: String =
        (0..N).map(|i| format!("line {i:08} of the child, long enough to fill a MiB sooner\n")).collect();
    assert!(all == want, "the files together are not what the child wrote");
}

/// A log file that cannot be written (as on a full disk): the child's
/// lines are still read and classified, none is written, and the child is
/// never held up.
#[tokio::test]
async fn a_file_that_cannot_be_written_still_has_its_lines_classified() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("t.log");
    std::fs::write(&path, "before\n").unwrap();
    // Open for reading only: every write fails.
    let file = File::open(&path).unwrap();
    let (tx, mut rx) = mpsc::unbounded_channel();
    let (out, mut lines) = mpsc::channel(QUEUE);
    let mut tasks = Tasks::default();
    let (f, mut child, _sink, _writer) = piped(&path, file, None, Some(Box::new(Seen(tx))), out, &mut tasks);
    assert_eq!(next(&mut rx).await, "before");
    // Far more than the memory set aside (4 MiB) and the pipe: the child
    // writes it all, and every line is read.
    const N: usize = 100_000;
    let writing = std::thread::spawn(move || {
        for i in 0..N {
            writeln!(child, "plain line {i:08} of the child while the disk is full, some 80 bytes").unwrap();
        }
        child.write_all(b"INFO:     Application startup complete.\n").unwrap();
        child
    });
    for i in 0..N {
        assert_eq!(
            next(&mut rx).await,
            format!("plain line {i:08} of the child while the disk is full, some 80 bytes")
        );
    }
    assert_eq!(next(&mut rx).await, "INFO:     Application startup complete.");
    let _child = writing.join().unwrap();
    f.drain();
    let mut ready = Vec::new();
    while let Delivery::Lines { lines, .. } = delivery(&mut lines).await {
        ready.extend(lines.into_iter().map(|l| l.class));
    }
    assert_eq!(ready, vec![Class::Ready]);
    assert_eq!(std::fs::read_to_string(&path).unwrap(), "before\n");
}

/// Counts the lines the follower read, and tells at the end of each read.
struct Counted {
    now: u64,
    read: Arc<(Mutex<u64>, std::sync::Condvar)>,
}

impl Tap for Counted {
    fn line(&mut self, _text: &str, _level: Option<Level>) {
        self.now += 1;
    }

    fn end_of_read(&mut self) {
        *self.read.0.lock().unwrap() = self.now;
        self.read.1.notify_all();
    }
}

/// A child flooding its log, rotated every MiB, first kept about a MiB
/// ahead of the follower (each rotation then comes with the follower
/// almost a MiB behind, while the child writes on), then as fast as it
/// can write: every line it wrote (numbered) is in the files once, in
/// order and whole, and every copy holds the size and at most one read of
/// the pipe more (the writer waits for each rotation). Before, the rest of
/// a cut past a MiB was lost whole (a file or two of lines at a file's
/// boundary), and a follower behind a child writing at full speed made no
/// copy until the child stopped.
#[tokio::test]
async fn a_flood_rotated_every_mib_loses_and_tears_no_line() {
    const N: u64 = 400_000;
    const SIZE: u64 = 1 << 20;
    let line =
        |i: u64| format!("(APIServer pid=1) INFO 12-07 17:00:00 [loggers.py:248] flood {i:010} Received request\n");
    let len = line(0).len() as u64;
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("t.log");
    let file = std::fs::OpenOptions::new().append(true).create(true).open(&path).unwrap();
    let (out, mut lines) = mpsc::channel(QUEUE);
    let mut tasks = Tasks::default();
    let rotation = Rotation { max_size: SIZE, keep: 1000, compress: false };
    let read = Arc::new((Mutex::new(0u64), std::sync::Condvar::new()));
    let tap = Counted { now: 0, read: read.clone() };
    let (f, mut child, _sink, _writer) = piped(&path, file, Some(rotation), Some(Box::new(tap)), out, &mut tasks);
    let (drained_tx, drained) = tokio::sync::oneshot::channel();
    tokio::spawn(async move {
        while let Some(d) = lines.recv().await {
            if matches!(d, Delivery::Drained { .. }) {
                let _ = drained_tx.send(());
                return;
            }
        }
    });
    let writing = std::thread::spawn(move || {
        let mut w = std::io::BufWriter::with_capacity(64 << 10, &mut child);
        // About a MiB ahead of the follower, in writes of 64 KiB.
        let ahead = (SIZE + (128 << 10)) / len;
        for i in 0..N / 2 {
            if i % 512 == 0 {
                w.flush().unwrap();
                let (lock, cv) = &*read;
                let mut n = lock.lock().unwrap();
                while i > *n + ahead {
                    n = cv.wait(n).unwrap();
                }
            }
            w.write_all(line(i).as_bytes()).unwrap();
        }
        let began = std::time::Instant::now();
        for i in N / 2..N {
            w.write_all(line(i).as_bytes()).unwrap();
        }
        w.flush().unwrap();
        drop(w);
        (child, began.elapsed())
    });
    let (child, took) = tokio::task::spawn_blocking(move || writing.join().unwrap()).await.unwrap();
    f.drain();
    tokio::time::timeout(Duration::from_secs(60), drained).await.expect("drained within 60 s").unwrap();
    drop(child);
    let mut copies: Vec<(u32, std::path::PathBuf)> = std::fs::read_dir(dir.path())
        .unwrap()
        .filter_map(|e| {
            let name = e.unwrap().file_name().into_string().unwrap();
            Some((name.strip_prefix("t.log.")?.parse().ok()?, dir.path().join(name)))
        })
        .collect();
    copies.sort_by_key(|c| std::cmp::Reverse(c.0));
    let (mut next, mut lost, mut gaps, mut torn, mut largest) = (0u64, 0u64, 0, Vec::new(), 0);
    for p in copies.iter().map(|(_, p)| p).chain([&path]) {
        let text = std::fs::read(p).unwrap();
        // The newest copy may hold what the drain moved from the pipe at
        // once.
        if p != &path && p != &dir.path().join("t.log.1") {
            largest = largest.max(text.len() as u64);
        }
        for l in text.split_inclusive(|b| *b == b'\n') {
            let l = String::from_utf8_lossy(l);
            match l.split_once(" flood ").and_then(|(_, r)| r.get(..10)?.parse::<u64>().ok()) {
                Some(n) if l == line(n) && n >= next => {
                    lost += n - next;
                    gaps += usize::from(n > next);
                    next = n + 1;
                }
                _ => torn.push(format!("{}: {l:?}", p.display())),
            }
        }
    }
    lost += N - next;
    println!(
        "{N} lines ({} MB), the second half written in {:.2} s ({:.1} MB/s): {} copies, the largest {largest} bytes; \
         {lost} lost in {gaps} gap(s), {} torn",
        N * len / 1_000_000,
        took.as_secs_f64(),
        (N / 2 * len) as f64 / 1e6 / took.as_secs_f64(),
        copies.len(),
        torn.len()
    );
    assert!(torn.is_empty(), "{} torn, out of order or twice; the first: {:?}", torn.len(), &torn[..torn.len().min(3)]);
    assert_eq!(lost, 0, "lines lost in {} rotations", copies.len());
    // One read of the pipe past the size, at most.
    assert!(largest <= SIZE + (256 << 10), "a copy of {largest} bytes, for a size of {SIZE}");
    assert!(copies.len() as u64 >= N * len / (SIZE + (256 << 10)), "{} copies", copies.len());
}
