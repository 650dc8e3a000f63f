//! The read-ahead of the weights (`[prefetch]`): from the moment a start
//! begins, the model's weight files (those vLLM will read, in the order it
//! reads them) are read into the page cache by a few OS threads, while vLLM
//! imports torch and starts its engine with the disk idle; its own reads
//! then find them there. What is already in the page cache is measured
//! first (`mincore` on a mapping, which reads nothing) and never read
//! again, so a start on a warm cache costs nothing. Everything read at most
//! `max-memory-fraction` of `MemAvailable`.
//!
//! The model folder is someone else's: the read-ahead only reads, follows
//! the hub cache's links into its blobs, reads only what is a regular file
//! once opened (non-blocking, so a fifo cannot hang a thread), and no more
//! than the size it saw. A file it cannot read is a warning, never an error
//! of the start. Its threads are plain OS threads, off the loop; the loop
//! learns of it from a report every half second built from the counters
//! its threads keep (atomics).

use std::fs::File;
use std::num::NonZeroUsize;
use std::os::unix::fs::{FileExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use crate::supervisor::load::PrefetchNow;

/// What one thread reads at a time: as `dd bs=16M`, large enough that a
/// read is the disk's streaming speed, small enough that a stop is quick.
pub(crate) const CHUNK: u64 = 16 << 20;

/// How often the loop is told how far the read-ahead is.
const REPORT_EVERY: Duration = Duration::from_millis(500);

/// The residency of a file is measured this much of it at a time (one
/// mapping, one byte per page of it in memory).
const MAP_WINDOW: u64 = 1 << 30;

/// The most weight files looked at (a model of 540 GB has about 120).
const MAX_FILES: usize = 100_000;

/// Files vLLM 0.32 never reads as weights (its
/// `filter_files_not_needed_for_inference`).
const NOT_WEIGHTS: [&str; 5] = ["training_args.bin", "optimizer.bin", "optimizer.pt", "scheduler.pt", "scaler.pt"];

/// The weight files vLLM 0.32 reads from `folder` under `--load-format
/// load_format`, in the order it reads them, as its
/// `DefaultModelLoader._prepare_weights` and its weight iterators decide:
/// the first of its patterns with a match (safetensors before `.bin`),
/// only the files a safetensors index's `weight_map` names (where there is
/// an index), no training files; safetensors in natural order of their
/// names (`model-2-of-10` before `model-10-of-10`), other files in the
/// folder's own order (its `glob`). An error says why none is read.
pub(crate) fn vllm_order(folder: &Path, load_format: &str) -> Result<Vec<PathBuf>, String> {
    let names = names_in(folder)?;
    let mut index = "model.safetensors.index.json";
    let format = match load_format {
        "auto" if names.iter().any(|n| glob_match(n, "consolidated", ".safetensors")) => "mistral",
        "auto" => "hf",
        f => f,
    };
    let mut use_safetensors = false;
    let mut patterns: Vec<(&str, &str)> = match format {
        "hf" => vec![("", ".safetensors"), ("", ".bin")],
        "safetensors" | "fastsafetensors" | "instanttensor" => {
            use_safetensors = true;
            vec![("", ".safetensors")]
        }
        "mistral" => {
            use_safetensors = true;
            index = "consolidated.safetensors.index.json";
            vec![("consolidated", ".safetensors")]
        }
        "pt" => vec![("", ".pt")],
        "npcache" => vec![("", ".bin")],
        other => return Err(format!("vLLM reads the weights of load format {other:?} its own way")),
    };
    // Its `fall_back_to_pt`, on by default.
    if !use_safetensors {
        patterns.push(("", ".pt"));
    }
    let mut files: Vec<String> = Vec::new();
    for (prefix, suffix) in patterns {
        files = names.iter().filter(|n| glob_match(n, prefix, suffix)).cloned().collect();
        if !files.is_empty() {
            use_safetensors |= suffix == ".safetensors";
            break;
        }
    }
    if use_safetensors {
        if let Some(named) = index_files(&folder.join(index)) {
            files.retain(|f| named.iter().any(|n| n == f));
        }
        sort_natural(&mut files);
    } else {
        files.retain(|f| !NOT_WEIGHTS.iter().any(|x| f.ends_with(x)));
    }
    if files.is_empty() {
        return Err(format!("no weight file vLLM reads in {}", folder.display()));
    }
    Ok(files.into_iter().map(|f| folder.join(f)).collect())
}

/// The names in `folder`, in the folder's own order (as Python's `glob`
/// lists them), at most [`MAX_FILES`].
fn names_in(folder: &Path) -> Result<Vec<String>, String> {
    let entries = std::fs::read_dir(folder).map_err(|e| format!("cannot list {}: {e}", folder.display()))?;
    Ok(entries.flatten().take(MAX_FILES).filter_map(|e| e.file_name().into_string().ok()).collect())
}

/// Whether `name` matches the glob `PREFIX*SUFFIX` (a leading dot is
/// matched only by a pattern that has one, as in `glob`).
fn glob_match(name: &str, prefix: &str, suffix: &str) -> bool {
    !name.starts_with('.')
        && name.len() >= prefix.len() + suffix.len()
        && name.starts_with(prefix)
        && name.ends_with(suffix)
}

/// The file names a safetensors index's `weight_map` gives; none when the
/// file is missing, too large or not an index (vLLM then takes every file).
fn index_files(path: &Path) -> Option<Vec<String>> {
    use std::io::Read;
    let f = std::fs::OpenOptions::new().read(true).custom_flags(libc::O_NONBLOCK | libc::O_CLOEXEC).open(path).ok()?;
    if !f.metadata().ok()?.is_file() {
        return None;
    }
    let mut text = String::new();
    f.take(64 << 20).read_to_string(&mut text).ok()?;
    let v: serde_json::Value = serde_json::from_str(&text).ok()?;
    let map = v.get("weight_map")?.as_object()?;
    let mut out: Vec<String> = map.values().filter_map(|f| f.as_str().map(String::from)).collect();
    out.sort();
    out.dedup();
    Some(out)
}

/// One part of a name's natural-order key: Python's
/// `re.split(r"(\d+)", name)`, digits compared as numbers.
#[derive(Debug, PartialEq, Eq)]
enum Part<'a> {
    Text(&'a str),
    Number(&'a str),
}

impl Ord for Part<'_> {
    fn cmp(&self, other: &Self) -> std::cmp::Ordering {
        match (self, other) {
            (Part::Number(a), Part::Number(b)) => {
                let (a, b) = (a.trim_start_matches('0'), b.trim_start_matches('0'));
                a.len().cmp(&b.len()).then_with(|| a.cmp(b))
            }
            (Part::Text(a), Part::Text(b)) => a.cmp(b),
            // Never at the same place: the split alternates text and digits.
            (Part::Text(_), Part::Number(_)) => std::cmp::Ordering::Less,
            (Part::Number(_), Part::Text(_)) => std::cmp::Ordering::Greater,
        }
    }
}

impl PartialOrd for Part<'_> {
    fn partial_cmp(&self, other: &Self) -> Option<std::cmp::Ordering> {
        Some(self.cmp(other))
    }
}

fn natural_key(name: &str) -> Vec<Part<'_>> {
    let mut out = Vec::new();
    let mut rest = name;
    loop {
        let digits = rest.find(|c: char| c.is_ascii_digit()).unwrap_or(rest.len());
        out.push(Part::Text(&rest[..digits]));
        rest = &rest[digits..];
        if rest.is_empty() {
            return out;
        }
        let end = rest.find(|c: char| !c.is_ascii_digit()).unwrap_or(rest.len());
        out.push(Part::Number(&rest[..end]));
        rest = &rest[end..];
        if rest.is_empty() {
            out.push(Part::Text(""));
            return out;
        }
    }
}

/// vLLM's `sorted(files, key=_natural_sort_key)`: stable.
fn sort_natural(names: &mut [String]) {
    names.sort_by(|a, b| natural_key(a).cmp(&natural_key(b)));
}

/// `MemAvailable` of `/proc/meminfo`, in bytes. Read by hand: the procfs
/// crate's `Meminfo` requires fields that gVisor's file does not have.
pub(crate) fn mem_available() -> Option<u64> {
    let text = std::fs::read_to_string("/proc/meminfo").ok()?;
    let line = text.lines().find(|l| l.starts_with("MemAvailable:"))?;
    let kb: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    kb.checked_mul(1024)
}

/// The page size, for `mincore`.
fn page() -> u64 {
    nix::unistd::sysconf(nix::unistd::SysconfVar::PAGE_SIZE).ok().flatten().map_or(4096, |p| p as u64)
}

/// Which pages of `len` bytes of `file` from `offset` (a multiple of the
/// page size) are in the page cache: one flag per page. Maps the range and
/// asks `mincore`, which reads nothing and touches no page.
fn resident(file: &File, offset: u64, len: u64) -> std::io::Result<Vec<bool>> {
    use nix::sys::mman::{MapFlags, ProtFlags, mmap, munmap};
    let Some(n) = NonZeroUsize::new(len as usize) else { return Ok(Vec::new()) };
    let pages = len.div_ceil(page()) as usize;
    let off = libc::off_t::try_from(offset).map_err(|_| std::io::Error::other("offset past off_t"))?;
    // SAFETY: a fresh shared read-only mapping of a file; its memory is
    // never read or written here (mincore only), so a file shortened
    // meanwhile cannot fault; it is unmapped before returning.
    let addr = unsafe { mmap(None, n, ProtFlags::PROT_READ, MapFlags::MAP_SHARED, file, off) }?;
    let mut vec = vec![0u8; pages];
    // SAFETY: `vec` has one byte per page of the mapping, as mincore wants.
    let rc = unsafe { libc::mincore(addr.as_ptr(), len as usize, vec.as_mut_ptr()) };
    let err = std::io::Error::last_os_error();
    // SAFETY: the mapping made above, of this length.
    let _ = unsafe { munmap(addr, len as usize) };
    if rc != 0 {
        return Err(err);
    }
    Ok(vec.into_iter().map(|b| b & 1 == 1).collect())
}

/// The runs of pages of a chunk that are not cached: (offset within the
/// chunk, length), the last bounded by `len`.
fn missing_runs(flags: &[bool], page: u64, len: u64) -> Vec<(u64, u64)> {
    let mut out = Vec::new();
    let mut i = 0;
    while i < flags.len() {
        if flags[i] {
            i += 1;
            continue;
        }
        let from = i;
        while i < flags.len() && !flags[i] {
            i += 1;
        }
        let start = from as u64 * page;
        let end = (i as u64 * page).min(len);
        if end > start {
            out.push((start, end - start));
        }
    }
    out
}

/// A weight file, open.
struct Weight {
    path: PathBuf,
    file: File,
    len: u64,
}

/// Open `path` to read ahead: links followed (the hub cache's point into
/// its blobs), non-blocking (a fifo cannot hang), a regular file only.
fn open(path: &Path) -> std::io::Result<Weight> {
    let file = std::fs::OpenOptions::new().read(true).custom_flags(libc::O_NONBLOCK | libc::O_CLOEXEC).open(path)?;
    let m = file.metadata()?;
    if !m.is_file() {
        return Err(std::io::Error::other("not a regular file"));
    }
    Ok(Weight { path: path.to_path_buf(), file, len: m.len() })
}

/// The counters the threads keep, which the reports are made of.
#[derive(Debug, Default)]
struct Counters {
    total: AtomicU64,
    cached_at_start: AtomicU64,
    read: AtomicU64,
    resident: AtomicU64,
    /// Nanoseconds from the first read to the end of the latest.
    nanos: AtomicU64,
    partial: AtomicBool,
    done: AtomicBool,
    /// Every weight file is a safetensors file.
    safetensors: AtomicBool,
    /// Threads read (else the residency only is measured).
    reads: AtomicBool,
    /// What was cached before the reads is counted.
    measured: AtomicBool,
}

impl Counters {
    fn now(&self) -> PrefetchNow {
        PrefetchNow {
            total: self.total.load(Ordering::Relaxed),
            cached_at_start: self.cached_at_start.load(Ordering::Relaxed),
            read: self.read.load(Ordering::Relaxed),
            resident: self.resident.load(Ordering::Relaxed),
            secs: self.nanos.load(Ordering::Relaxed) as f64 / 1e9,
            partial: self.partial.load(Ordering::Relaxed),
            done: self.done.load(Ordering::Relaxed),
            reads: self.reads.load(Ordering::Relaxed),
            measured: self.measured.load(Ordering::Relaxed),
        }
    }
}

/// What a read-ahead is to read, and how.
#[derive(Debug, Clone)]
pub struct Order {
    /// The files, in the order vLLM reads them.
    pub files: Vec<PathBuf>,
    /// 0: the residency is measured, nothing is read (`prefetch.enabled`
    /// off: the ledger still records the residency).
    pub threads: u32,
    /// At most this many bytes are read.
    pub budget: u64,
}

/// The read-ahead of a start of `s`: its files in vLLM's order, the
/// threads and the memory bound; none where the weights are not on this
/// machine (said in the log when the read-ahead is on). Blocking.
pub(crate) fn order_for(s: &crate::config::Settings) -> Option<Order> {
    let files = match files_of(s) {
        Ok((_, files)) => files,
        Err(why) => {
            if s.prefetch.enabled {
                tracing::info!(EVENT = "prefetch", "no read-ahead of the weights: {why}");
            }
            return None;
        }
    };
    let files = files.into_iter().map(|f| f.0).collect();
    if !s.prefetch.enabled {
        return Some(Order { files, threads: 0, budget: 0 });
    }
    let Some(available) = mem_available() else {
        tracing::warn!(EVENT = "prefetch", "no read-ahead of the weights: MemAvailable unknown (/proc/meminfo)");
        return Some(Order { files, threads: 0, budget: 0 });
    };
    let budget = (available as f64 * s.prefetch.max_memory_fraction) as u64;
    Some(Order { files, threads: s.prefetch.threads, budget })
}

/// A read-ahead under way; stopped when dropped.
pub struct Prefetch {
    cancel: Arc<AtomicBool>,
    counters: Arc<Counters>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl Prefetch {
    /// Begin reading `order` ahead on threads of its own; `report` is
    /// called (on them) every half second and once at the end.
    pub fn start(order: Order, report: impl Fn(PrefetchNow) + Send + 'static) -> std::io::Result<Prefetch> {
        Prefetch::planned(move || Some(order), report)
    }

    /// The same, with the order made by `plan` on the read-ahead's own
    /// thread (it looks at the model's folder): nothing when it gives none.
    pub(crate) fn planned(
        plan: impl FnOnce() -> Option<Order> + Send + 'static,
        report: impl Fn(PrefetchNow) + Send + 'static,
    ) -> std::io::Result<Prefetch> {
        let cancel = Arc::new(AtomicBool::new(false));
        let counters = Arc::new(Counters::default());
        let (c, k) = (cancel.clone(), counters.clone());
        let thread = std::thread::Builder::new().name("prefetch".into()).spawn(move || match plan() {
            Some(order) => run(order, &c, &k, &report),
            None => k.done.store(true, Ordering::Relaxed),
        })?;
        Ok(Prefetch { cancel, counters, thread: Some(thread) })
    }

    /// Whether the weights are all safetensors files (vLLM's faster
    /// loaders read those), as far as the read-ahead looked.
    pub(crate) fn safetensors(&self) -> bool {
        self.counters.safetensors.load(Ordering::Relaxed)
    }

    /// Whether it reads (else it measured the residency only).
    pub(crate) fn reads(&self) -> bool {
        self.counters.reads.load(Ordering::Relaxed)
    }

    /// The counters now.
    pub(crate) fn now(&self) -> PrefetchNow {
        self.counters.now()
    }

    /// Stop at the next chunk; the threads end by themselves.
    pub(crate) fn stop(&self) {
        self.cancel.store(true, Ordering::Relaxed);
    }

    /// Stop, and wait for the threads to end (tests, benchmarks).
    #[cfg(test)]
    pub(crate) fn join(mut self) -> PrefetchNow {
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
        self.now()
    }

    /// Wait for the read-ahead to end by itself.
    pub fn wait(mut self) -> PrefetchNow {
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
        self.now()
    }
}

impl Drop for Prefetch {
    fn drop(&mut self) {
        self.stop();
    }
}

/// The read-ahead's own thread: opens the files, measures what is cached,
/// starts the readers and reports until they end.
fn run(order: Order, cancel: &Arc<AtomicBool>, c: &Arc<Counters>, report: &(dyn Fn(PrefetchNow) + Send)) {
    c.safetensors.store(
        !order.files.is_empty() && order.files.iter().all(|f| f.to_string_lossy().ends_with(".safetensors")),
        Ordering::Relaxed,
    );
    c.reads.store(order.threads > 0, Ordering::Relaxed);
    let mut files = Vec::new();
    for path in &order.files {
        match open(path) {
            Ok(w) => files.push(w),
            Err(e) => tracing::warn!(EVENT = "prefetch", file = %path.display(), "not read ahead: {e}"),
        }
    }
    let page = page();
    let total: u64 = files.iter().map(|w| w.len).sum();
    c.total.store(total, Ordering::Relaxed);
    // What is cached before anything is read: the residency of the start.
    let mut cached = 0u64;
    for w in &files {
        let mut off = 0;
        while off < w.len && !cancel.load(Ordering::Relaxed) {
            let len = MAP_WINDOW.min(w.len - off);
            match resident(&w.file, off, len) {
                Ok(flags) => {
                    let whole = flags.iter().filter(|r| **r).count() as u64 * page;
                    // The last page of the file counts only its bytes.
                    let tail = if flags.last() == Some(&true) { (len.div_ceil(page) * page) - len } else { 0 };
                    cached += whole - tail;
                }
                Err(e) => {
                    tracing::debug!(file = %w.path.display(), "residency not measured: {e}");
                    break;
                }
            }
            off += len;
        }
    }
    c.cached_at_start.store(cached, Ordering::Relaxed);
    c.measured.store(true, Ordering::Relaxed);
    if order.threads == 0 {
        c.done.store(true, Ordering::Relaxed);
        report(c.now());
        return;
    }
    report(c.now());
    let chunks: Vec<(usize, u64, u64)> = files
        .iter()
        .enumerate()
        .flat_map(|(i, w)| (0..w.len.div_ceil(CHUNK)).map(move |k| (i, k * CHUNK, CHUNK.min(w.len - k * CHUNK))))
        .collect();
    let shared = Arc::new(Readers {
        files,
        chunks,
        next: AtomicUsize::new(0),
        budget: order.budget,
        reserved: AtomicU64::new(0),
        began: Instant::now(),
        page,
    });
    let (done_tx, done_rx) = std::sync::mpsc::channel::<()>();
    let mut started = 0;
    for n in 0..order.threads.max(1) {
        let (r, cancel, c, tx) = (shared.clone(), cancel.clone(), c.clone(), done_tx.clone());
        let spawned = std::thread::Builder::new().name(format!("prefetch-{n}")).spawn(move || {
            r.read(&cancel, &c);
            drop(tx);
        });
        match spawned {
            Ok(_) => started += 1,
            Err(e) => tracing::warn!(EVENT = "prefetch", "no thread {n} for the read-ahead: {e}"),
        }
    }
    drop(done_tx);
    if started > 0 {
        // Every reader's sender dropped: all of them ended.
        while let Err(std::sync::mpsc::RecvTimeoutError::Timeout) = done_rx.recv_timeout(REPORT_EVERY) {
            report(c.now());
        }
    }
    c.done.store(true, Ordering::Relaxed);
    let now = c.now();
    let gb = |b: u64| b as f64 / 1e9;
    let speed = now.record().map_or(0.0, |r| r.gbps);
    if cancel.load(Ordering::Relaxed) {
        tracing::info!(EVENT = "prefetch", "read-ahead stopped: {:.2} GB read in {:.1}s", gb(now.read), now.secs);
    } else if now.partial {
        tracing::warn!(
            EVENT = "prefetch",
            "read ahead in part: {:.2} of {:.2} GB (at most {:.2} GB: prefetch.max-memory-fraction of MemAvailable), \
             {:.2} GB were cached already; {:.2} GB/s",
            gb(now.read),
            gb(now.total),
            gb(order.budget),
            gb(now.cached_at_start),
            speed
        );
    } else {
        tracing::info!(
            EVENT = "prefetch",
            "read ahead {:.2} GB of {:.2} GB of weights in {:.1}s ({speed:.2} GB/s), {:.2} GB were cached already",
            gb(now.read),
            gb(now.total),
            now.secs,
            gb(now.resident)
        );
    }
    report(now);
}

/// Read `buf.len()` bytes at `off`, or to the end of the file: how many.
fn read_at(file: &File, buf: &mut [u8], off: u64) -> std::io::Result<u64> {
    let mut done = 0usize;
    while done < buf.len() {
        match file.read_at(&mut buf[done..], off + done as u64) {
            Ok(0) => break,
            Ok(n) => done += n,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(done as u64)
}

/// What the reader threads share: the chunks in order, the next one, and
/// the memory bound.
struct Readers {
    files: Vec<Weight>,
    /// (file, offset, length), in the order vLLM reads them.
    chunks: Vec<(usize, u64, u64)>,
    next: AtomicUsize,
    budget: u64,
    reserved: AtomicU64,
    began: Instant,
    page: u64,
}

impl Readers {
    /// One thread: the next chunk not taken, until none is left, the
    /// bound is reached or the read-ahead is stopped.
    fn read(&self, cancel: &AtomicBool, c: &Counters) {
        let mut buf = vec![0u8; CHUNK as usize];
        let mut failed: Option<usize> = None;
        loop {
            if cancel.load(Ordering::Relaxed) || c.partial.load(Ordering::Relaxed) {
                return;
            }
            let i = self.next.fetch_add(1, Ordering::Relaxed);
            let Some(&(f, off, len)) = self.chunks.get(i) else { return };
            if failed == Some(f) {
                continue;
            }
            let w = &self.files[f];
            // What is cached now (vLLM may have read it meanwhile) is not
            // read again.
            let runs = match resident(&w.file, off, len) {
                Ok(flags) => missing_runs(&flags, self.page, len),
                Err(_) => vec![(0, len)],
            };
            let missing: u64 = runs.iter().map(|r| r.1).sum();
            c.resident.fetch_add(len - missing, Ordering::Relaxed);
            for (at, n) in runs {
                if cancel.load(Ordering::Relaxed) {
                    return;
                }
                if self.reserved.fetch_add(n, Ordering::Relaxed).saturating_add(n) > self.budget {
                    c.partial.store(true, Ordering::Relaxed);
                    return;
                }
                match read_at(&w.file, &mut buf[..n as usize], off + at) {
                    Ok(got) => {
                        c.read.fetch_add(got, Ordering::Relaxed);
                        c.nanos.fetch_max(self.began.elapsed().as_nanos() as u64, Ordering::Relaxed);
                        if got < n {
                            // Shorter than it was: the rest is not there.
                            break;
                        }
                    }
                    Err(e) => {
                        tracing::warn!(EVENT = "prefetch", file = %w.path.display(), "read-ahead stopped for this file: {e}");
                        failed = Some(f);
                        break;
                    }
                }
            }
        }
    }
}

/// The weights a start of `s` reads: the folder, its files in vLLM's
/// order and their bytes; or why there are none. Blocking.
pub(crate) fn files_of(s: &crate::config::Settings) -> Result<(PathBuf, Vec<(PathBuf, u64)>), String> {
    if s.profile != crate::config::profile::Profile::Vllm {
        return Err("none: not a vLLM command".into());
    }
    let folder = crate::daemon::environment::weights_folder(s)
        .ok_or("none: the model's weights are not on this machine (not a local folder, nor in the hub cache)")?;
    let format = crate::config::command::vllm_flag(&s.child.command, "--load-format");
    let files = vllm_order(&folder, format.as_deref().unwrap_or("auto"))?;
    let sized = files
        .into_iter()
        .map(|f| {
            let len = std::fs::metadata(&f).ok().filter(|m| m.is_file()).map_or(0, |m| m.len());
            (f, len)
        })
        .collect();
    Ok((folder, sized))
}

/// vLLM's faster loaders, named where they apply to `command`: weights in
/// safetensors files, and a load format that is not already one of them.
pub(crate) fn faster_loaders(command: &[String], safetensors: bool) -> Option<String> {
    let format = crate::config::command::vllm_flag(command, "--load-format").unwrap_or_else(|| "auto".into());
    if !safetensors || ["runai_streamer", "runai_streamer_sharded", "fastsafetensors"].contains(&format.as_str()) {
        return None;
    }
    Some(
        "vLLM's faster loaders may read them at the disk's speed: `--load-format runai_streamer` (with \
         `--model-loader-extra-config '{\"concurrency\":16}'`) or `--load-format fastsafetensors`"
            .into(),
    )
}

/// What `check` says of the read-ahead: the files, their bytes, what is
/// cached now, and the memory bound. Blocking.
pub(crate) fn describe(s: &crate::config::Settings) -> String {
    let gb = |b: u64| b as f64 / 1e9;
    if !s.prefetch.enabled {
        return "read-ahead of the weights: off (prefetch.enabled = false)".into();
    }
    match files_of(s) {
        Err(why) => format!("read-ahead of the weights: {why}"),
        Ok((folder, files)) => {
            let total: u64 = files.iter().map(|f| f.1).sum();
            let mut cached = 0u64;
            let page = page();
            for (path, _) in &files {
                let Ok(w) = open(path) else { continue };
                let mut off = 0;
                while off < w.len {
                    let len = MAP_WINDOW.min(w.len - off);
                    let Ok(flags) = resident(&w.file, off, len) else { break };
                    cached += (flags.iter().filter(|r| **r).count() as u64 * page).min(len);
                    off += len;
                }
            }
            let cached = cached.min(total);
            let budget = mem_available().map(|m| (m as f64 * s.prefetch.max_memory_fraction) as u64);
            let to_read = total - cached;
            let fit = match budget {
                Some(b) if to_read > b => format!(
                    "; only {:.2} GB of the {:.2} GB not cached will be read (at most {} of MemAvailable: {:.2} GB)",
                    gb(b),
                    gb(to_read),
                    s.prefetch.max_memory_fraction,
                    gb(b)
                ),
                Some(b) => {
                    format!("; within the bound ({} of MemAvailable: {:.2} GB)", s.prefetch.max_memory_fraction, gb(b))
                }
                None => "; MemAvailable unknown: nothing will be read".into(),
            };
            format!(
                "read-ahead of the weights: {} file(s) of {}, {:.2} GB, in vLLM's order, {} thread(s); {:.0}% in the \
                 page cache now{fit}",
                files.len(),
                folder.display(),
                gb(total),
                s.prefetch.threads,
                if total > 0 { cached as f64 * 100.0 / total as f64 } else { 100.0 }
            )
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn folder(names: &[&str]) -> tempfile::TempDir {
        let dir = tempfile::tempdir().unwrap();
        for n in names {
            std::fs::write(dir.path().join(n), b"w").unwrap();
        }
        dir
    }

    fn names(files: &[PathBuf]) -> Vec<String> {
        files.iter().map(|f| f.file_name().unwrap().to_string_lossy().into_owned()).collect()
    }

    /// vLLM's `_natural_sort_key`: numbers as numbers, so shard 2 comes
    /// before shard 10 (a plain sort puts 10 first).
    #[test]
    fn safetensors_are_read_in_natural_order() {
        let d = folder(&[
            "model-10-of-12.safetensors",
            "model-2-of-12.safetensors",
            "model-1-of-12.safetensors",
            "config.json",
            ".hidden.safetensors",
        ]);
        let got = names(&vllm_order(d.path(), "auto").unwrap());
        assert_eq!(got, ["model-1-of-12.safetensors", "model-2-of-12.safetensors", "model-10-of-12.safetensors"]);
        // Equal numbers keep their order (a stable sort); text after them
        // decides. As Python sorts ['a2.st', 'a02.st', 'a2b.st', 'a10.st'].
        let mut v: Vec<String> = ["a10.st", "a2.st", "a2b.st", "a02.st"].map(String::from).to_vec();
        sort_natural(&mut v);
        assert_eq!(v, ["a2.st", "a02.st", "a2b.st", "a10.st"]);
    }

    /// Safetensors over `.bin` (its first pattern with a match wins), and
    /// only the files the index's `weight_map` names (a consolidated copy
    /// beside the shards is not read).
    #[test]
    fn safetensors_win_over_bin_and_the_index_decides_which() {
        let d = folder(&[
            "pytorch_model.bin",
            "model-00002-of-00002.safetensors",
            "model-00001-of-00002.safetensors",
            "model.safetensors",
        ]);
        // No index: every safetensors file, in vLLM's order (Python's
        // `sorted` with its key puts `model-` before `model.safetensors`).
        let got = names(&vllm_order(d.path(), "auto").unwrap());
        assert_eq!(got, ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors", "model.safetensors"]);
        std::fs::write(
            d.path().join("model.safetensors.index.json"),
            r#"{"metadata":{},"weight_map":{"a":"model-00002-of-00002.safetensors","b":"model-00001-of-00002.safetensors","c":"model-00001-of-00002.safetensors"}}"#,
        )
        .unwrap();
        let got = names(&vllm_order(d.path(), "auto").unwrap());
        assert_eq!(got, ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]);
        // `--load-format pt` reads neither.
        assert!(vllm_order(d.path(), "pt").is_err());
    }

    /// Without safetensors, `.bin` files in the folder's own order (vLLM
    /// does not sort them), training files left out; then `.pt`.
    #[test]
    fn bin_files_in_the_folders_order_without_training_files() {
        let d = folder(&["pytorch_model-00002.bin", "training_args.bin", "pytorch_model-00001.bin", "optimizer.pt"]);
        let listed: Vec<String> = std::fs::read_dir(d.path())
            .unwrap()
            .flatten()
            .map(|e| e.file_name().into_string().unwrap())
            .filter(|n| n.starts_with("pytorch_model"))
            .collect();
        assert_eq!(names(&vllm_order(d.path(), "auto").unwrap()), listed);
        let d = folder(&["weights.pt", "optimizer.pt"]);
        assert_eq!(names(&vllm_order(d.path(), "auto").unwrap()), ["weights.pt"]);
        // A format vLLM reads its own way: no read-ahead.
        let err = vllm_order(d.path(), "runai_streamer").unwrap_err();
        assert!(err.contains("its own way"), "{err}");
        // A Mistral folder: only the consolidated files.
        let d = folder(&["consolidated.safetensors", "model-1.safetensors"]);
        assert_eq!(names(&vllm_order(d.path(), "auto").unwrap()), ["consolidated.safetensors"]);
    }

    fn weights(dir: &Path, name: &str, len: usize) -> PathBuf {
        let p = dir.join(name);
        let bytes: Vec<u8> = (0..len).map(|i| (i * 7 + len) as u8).collect();
        std::fs::write(&p, bytes).unwrap();
        p
    }

    /// Out of the page cache, as after a reboot: written to the disk, then
    /// its clean pages dropped. False where the filesystem keeps them
    /// (tmpfs), which a test then says.
    pub(crate) fn evict(path: &Path) -> bool {
        let f = File::open(path).unwrap();
        f.sync_all().unwrap();
        nix::fcntl::posix_fadvise(&f, 0, 0, nix::fcntl::PosixFadviseAdvice::POSIX_FADV_DONTNEED).unwrap();
        let len = f.metadata().unwrap().len();
        !resident(&f, 0, len).unwrap().iter().any(|r| *r)
    }

    /// A folder on the disk the test binary is on (the temporary folder
    /// may be tmpfs, where no page can be dropped).
    fn on_disk() -> tempfile::TempDir {
        let exe = std::env::current_exe().unwrap();
        tempfile::tempdir_in(exe.parent().unwrap()).unwrap()
    }

    /// Every file evicted; false, once the test has said it is skipped and
    /// why, where the page cache keeps them.
    fn cold(files: &[PathBuf]) -> bool {
        let kept: Vec<_> = files.iter().filter(|f| !evict(f)).collect();
        if !kept.is_empty() {
            eprintln!("SKIPPED: pages of {kept:?} stay in the page cache after POSIX_FADV_DONTNEED: no cold read here");
        }
        kept.is_empty()
    }

    /// Bytes counted: a cold file is read whole once; read again, nothing
    /// is read (its pages are cached) and all of it counts as resident.
    #[test]
    fn what_is_cached_is_not_read_again() {
        let dir = on_disk();
        let files = vec![weights(dir.path(), "a.safetensors", 3 << 20), weights(dir.path(), "b.safetensors", 1 << 20)];
        if !cold(&files) {
            return;
        }
        let order = Order { files: files.clone(), threads: 2, budget: u64::MAX };
        let first = Prefetch::start(order.clone(), |_| {}).unwrap().wait();
        assert_eq!((first.total, first.cached_at_start, first.read, first.resident), (4 << 20, 0, 4 << 20, 0));
        assert!(first.secs > 0.0 && first.done, "{first:?}");
        let second = Prefetch::start(order.clone(), |_| {}).unwrap().wait();
        assert_eq!((second.read, second.resident, second.cached_at_start), (0, 4 << 20, 4 << 20), "{second:?}");
        assert_eq!(second.residency(), Some(1.0));
        // Half cached: only the other half is read.
        assert!(evict(&files[0]));
        let third = Prefetch::start(order, |_| {}).unwrap().wait();
        assert_eq!((third.read, third.resident, third.cached_at_start), (3 << 20, 1 << 20, 1 << 20), "{third:?}");
    }

    /// A cold start: the counters say the cache was counted (nothing of
    /// the file in it) and that the file was read.
    #[test]
    fn a_cold_read_ahead_counts_the_cache_and_reads() {
        let dir = on_disk();
        let files = vec![weights(dir.path(), "a.safetensors", (CHUNK + (1 << 20)) as usize)];
        if !cold(&files) {
            return;
        }
        let now = Prefetch::start(Order { files, threads: 1, budget: u64::MAX }, |_| {}).unwrap().wait();
        // What the kernel's own read-ahead brought in first is found
        // cached, not read.
        assert_eq!((now.cached_at_start, now.read + now.resident), (0, CHUNK + (1 << 20)), "{now:?}");
        assert!(now.read >= CHUNK, "{now:?}");
        assert!(now.measured && now.reads && now.done, "{now:?}");
    }

    /// Never more than the budget: what would pass it is not read, and the
    /// read-ahead says it stopped in part.
    #[test]
    fn the_memory_bound_stops_the_read_ahead_in_part() {
        let dir = on_disk();
        let files: Vec<PathBuf> = (0..3).map(|i| weights(dir.path(), &format!("{i}.safetensors"), 1 << 20)).collect();
        if !cold(&files) {
            return;
        }
        let now = Prefetch::start(Order { files: files.clone(), threads: 1, budget: 2 << 20 }, |_| {}).unwrap().wait();
        assert!(now.partial, "{now:?}");
        assert_eq!(now.read, 2 << 20, "{now:?}");
        // The first files, as vLLM reads them: the last is the one left.
        let cached = |p: &Path| {
            let f = File::open(p).unwrap();
            resident(&f, 0, 1 << 20).unwrap().iter().filter(|r| **r).count()
        };
        assert_eq!(cached(&files[2]), 0);
        assert_eq!(cached(&files[0]), 256);
    }

    /// What is not a regular file once opened is not read: a fifo (which
    /// would block a plain open) and a device.
    #[test]
    fn odd_files_are_skipped_without_hanging() {
        let dir = tempfile::tempdir().unwrap();
        let fifo = dir.path().join("f.safetensors");
        nix::unistd::mkfifo(&fifo, nix::sys::stat::Mode::S_IRWXU).unwrap();
        let files = vec![fifo, PathBuf::from("/dev/zero"), weights(dir.path(), "ok.safetensors", 4096)];
        let now = Prefetch::start(Order { files, threads: 2, budget: u64::MAX }, |_| {}).unwrap().wait();
        assert_eq!(now.total, 4096);
    }

    /// A stop ends the threads at their next chunk.
    #[test]
    fn a_stop_ends_the_read_ahead() {
        let dir = tempfile::tempdir().unwrap();
        let files = vec![weights(dir.path(), "a.safetensors", 1 << 20)];
        let p = Prefetch::start(Order { files, threads: 1, budget: u64::MAX }, |_| {}).unwrap();
        p.stop();
        assert!(p.join().done);
    }

    /// The runs of a chunk that are read: only the pages not cached, the
    /// last one bounded by the chunk's bytes.
    #[test]
    fn only_the_missing_pages_are_read() {
        let flags = [true, false, false, true, false];
        assert_eq!(missing_runs(&flags, 4096, 4 * 4096 + 100), [(4096, 8192), (4 * 4096, 100)]);
        assert!(missing_runs(&[true, true], 4096, 8192).is_empty());
    }

    #[test]
    fn faster_loaders_only_where_they_apply() {
        let cmd =
            |f: &[&str]| -> Vec<String> { ["vllm", "serve", "/m"].iter().chain(f).map(|s| s.to_string()).collect() };
        assert!(faster_loaders(&cmd(&[]), true).unwrap().contains("runai_streamer"));
        assert!(faster_loaders(&cmd(&["--load-format", "fastsafetensors"]), true).is_none());
        assert!(faster_loaders(&cmd(&["--load-format=runai_streamer"]), true).is_none());
        // `.bin` weights: neither applies.
        assert!(faster_loaders(&cmd(&[]), false).is_none());
    }
}
