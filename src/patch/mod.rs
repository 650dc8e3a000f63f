//! Patching model files: JSON edits by dotted path that keep every byte
//! outside the edited span (`edit`), model files read as untrusted input
//! (`source`), the patches folder with its lock, manifest and originals
//! (`store`), and the all-or-nothing apply and the revert that put them
//! together. A Hugging Face cache symlink becomes a patched regular file;
//! the blob it points to is never written, and revert puts the link back.
//!
//! Revert touches only the files the config's `[[patch]]` entries name:
//! the manifest is an index, never an authority. The [`Patch`] type (one
//! `[[patch]]` entry) lives here; `config` builds it. Nothing here knows
//! about the child, systemd or how the config file is read.

use std::collections::HashSet;
use std::ffi::{OsStr, OsString};
use std::fmt;
use std::io;
use std::path::{Path, PathBuf};

use serde_json::Value;

use crate::util::fsutil::{BeneathError, Stamp};

mod edit;
mod error;
mod source;
mod store;

pub use self::error::PatchError;

pub(crate) use store::Manifest;
pub use store::Wait;

use edit::{EditError, Op};
use source::{Place, Source, sha256};
use store::{Entry, Lock, Store};

/// The largest model file a `[[patch]]` reads unless its `max-size` says
/// otherwise: far above any model's config, far below what would strain
/// the warden's memory.
pub(crate) const DEFAULT_MAX_SIZE: u64 = 64 << 20;

/// One `[[patch]]` entry: JSON edits applied before every start.
#[derive(Debug, Clone, PartialEq)]
pub struct Patch {
    pub file: PathBuf,
    /// Dotted paths (`a.b.0.c`, `a\.b` for a dot inside a key).
    pub remove: Vec<String>,
    /// Dotted path → value, in the order written.
    pub set: Vec<(String, Value)>,
    /// The largest `file` may be, in bytes; [`DEFAULT_MAX_SIZE`] when not
    /// given.
    pub max_size: Option<u64>,
}

impl Patch {
    /// What it does, in words: `remove a.b, set c` (for a hint that names
    /// the file).
    pub(crate) fn what(&self) -> String {
        let mut what: Vec<String> = self.remove.iter().map(|r| format!("remove {r}")).collect();
        what.extend(self.set.iter().map(|(k, _)| format!("set {k}")));
        what.join(", ")
    }
}

/// The patches of one file, in config order.
#[derive(Debug, Clone)]
pub(crate) struct FilePatch<'a> {
    pub(crate) file: PathBuf,
    pub(crate) patches: Vec<&'a Patch>,
}

impl FilePatch<'_> {
    /// The largest `max-size` its entries give, else the default.
    pub(crate) fn max_size(&self) -> u64 {
        self.patches.iter().filter_map(|p| p.max_size).max().unwrap_or(DEFAULT_MAX_SIZE)
    }

    fn ops(&self) -> Vec<Op<'_>> {
        let mut ops = Vec::new();
        for p in &self.patches {
            ops.extend(p.remove.iter().map(|path| Op::Remove(path)));
            ops.extend(p.set.iter().map(|(path, v)| Op::Set(path, v)));
        }
        ops
    }
}

/// Group patches by file, keeping the order of first appearance.
pub(crate) fn by_file(patches: &[Patch]) -> Vec<FilePatch<'_>> {
    let mut out: Vec<FilePatch<'_>> = Vec::new();
    for p in patches {
        match out.iter_mut().find(|f| f.file == p.file) {
            Some(f) => f.patches.push(p),
            None => out.push(FilePatch { file: p.file.clone(), patches: vec![p] }),
        }
    }
    out
}

/// What a file is now and what the patches would make of it.
#[derive(Debug, Clone)]
pub(crate) struct PatchPlan {
    pub(crate) file: PathBuf,
    pub(crate) old: String,
    pub(crate) new: String,
}

impl PatchPlan {
    pub(crate) fn changes(&self) -> bool {
        self.old != self.new
    }

    /// A unified diff, empty when nothing changes.
    pub(crate) fn diff(&self) -> String {
        if !self.changes() {
            return String::new();
        }
        let name = self.file.display().to_string();
        similar::TextDiff::from_lines(&self.old, &self.new)
            .unified_diff()
            .context_radius(3)
            .header(&format!("a{name}"), &format!("b{name}"))
            .to_string()
    }
}

/// Compute what the patches of one file would do, writing nothing.
pub(crate) fn plan(fp: &FilePatch<'_>) -> Result<PatchPlan, PatchError> {
    let place = Place::open(&fp.file)?;
    let source = place.read(fp.max_size())?;
    plan_of(fp, &source)
}

fn plan_of(fp: &FilePatch<'_>, source: &Source) -> Result<PatchPlan, PatchError> {
    let file = fp.file.clone();
    let json_error = |e: serde_json::Error| PatchError::Json {
        file: file.clone(),
        line: e.line(),
        column: e.column(),
        message: e.to_string().split(" at line").next().unwrap_or_default().to_string(),
    };
    let old = match std::str::from_utf8(&source.bytes) {
        Ok(s) => s.to_string(),
        // serde_json says where the text stops being JSON.
        Err(e) => {
            return Err(match serde_json::from_slice::<serde::de::IgnoredAny>(&source.bytes) {
                Err(j) => json_error(j),
                Ok(_) => PatchError::Json {
                    file,
                    line: 0,
                    column: 0,
                    message: format!("not UTF-8 after byte {}", e.valid_up_to()),
                },
            });
        }
    };
    let ops = fp.ops();
    let patch_error = |e| match e {
        EditError::Json { line, column, message } => PatchError::Json { file: file.clone(), line, column, message },
        EditError::Path { op, path, reason } => PatchError::Path { file: file.clone(), op, path, reason },
        EditError::InPlace(reason) => PatchError::InPlace { file: file.clone(), reason },
    };
    let new = edit::edit(&old, &ops).map_err(patch_error)?;
    // Patched, the file must be left alone at the next start: entries that
    // undo each other would fail it, or change it at every start.
    if new != old {
        match edit::edit(&new, &ops) {
            Ok(again) if again == new => {}
            Ok(_) => return Err(contradiction(&file, "they would change it again at the next start".into())),
            Err(e) => return Err(contradiction(&file, patch_error(e).to_string())),
        }
    }
    Ok(PatchPlan { file, old, new })
}

fn contradiction(file: &Path, why: String) -> PatchError {
    PatchError::Contradiction { file: file.to_path_buf(), why }
}

/// What `apply` did to one file.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Applied {
    Unchanged(PathBuf),
    Patched(PathBuf),
}

impl fmt::Display for Applied {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Applied::Unchanged(p) => write!(f, "{}: already patched", p.display()),
            Applied::Patched(p) => write!(f, "{}: patched", p.display()),
        }
    }
}

/// Apply every patch. All or nothing: every file is read and planned, and
/// every new content written to a temporary file beside its target, its
/// original kept and the manifest saved, before any target is replaced;
/// each target is checked unchanged just before it is, and a failure puts
/// back the files already replaced.
pub fn apply(patches: &[Patch], state_dir: &Path, wait: Wait<'_>) -> Result<Vec<Applied>, PatchError> {
    prepare(patches, state_dir, wait)?.commit()
}

/// One model file, read and planned.
struct Planned {
    place: Place,
    source: Source,
    plan: PatchPlan,
}

fn read_all(fps: &[FilePatch<'_>]) -> Result<Vec<Planned>, PatchError> {
    fps.iter()
        .map(|fp| {
            let place = Place::open(&fp.file)?;
            let source = place.read(fp.max_size())?;
            let plan = plan_of(fp, &source)?;
            Ok(Planned { place, source, plan })
        })
        .collect()
}

/// The first half of [`apply`]: everything but the replacement of the
/// targets, under the lock.
pub fn prepare(patches: &[Patch], state_dir: &Path, wait: Wait<'_>) -> Result<StagedPatches, PatchError> {
    let fps = by_file(patches);
    let mut planned = read_all(&fps)?;
    let mut prepared = StagedPatches::default();
    if planned.iter().any(|p| p.plan.changes()) {
        let store = Store::open(state_dir, true)?.ok_or_else(|| PatchError::State {
            dir: state_dir.to_path_buf(),
            source: io::Error::from_raw_os_error(libc::ENOENT),
        })?;
        prepared.lock = Some(store.lock(wait)?);
        // Read again under the lock: another run may have patched them.
        planned = read_all(&fps)?;
        prepared.before = store.load()?;
        prepared.store = Some(store);
    }
    let max: Vec<u64> = fps.iter().map(FilePatch::max_size).collect();
    for (p, max) in planned.into_iter().zip(max) {
        if !p.plan.changes() {
            prepared.results.push(Applied::Unchanged(p.plan.file));
            continue;
        }
        prepared.results.push(Applied::Patched(p.plan.file.clone()));
        let file = p.plan.file.clone();
        p.place.dir.remove_stale_temps(&p.place.name);
        let mode = p.source.mode & 0o777;
        let tmp = p
            .place
            .dir
            .write_temp(&p.place.name, p.plan.new.as_bytes(), mode, Some(p.source.owner))
            .map_err(|source| PatchError::Write { file, source })?;
        prepared.files.push(Staged {
            place: p.place,
            source: p.source,
            new: p.plan.new,
            max,
            tmp,
            state: State::Staged,
        });
    }
    if let Some(store) = &prepared.store {
        let mut manifest = prepared.before.clone();
        for f in &prepared.files {
            let patched = sha256(f.new.as_bytes());
            match manifest.files.get_mut(&f.place.file) {
                // Patched by us before (with other patches): the original stays.
                Some(e) if e.patched_sha256 == f.source.sha => e.patched_sha256 = patched,
                // Not patched yet, or replaced since: its content now is the original.
                _ => {
                    if store.keep_original(&f.source.bytes, &f.source.sha)? {
                        prepared.kept.push(f.source.sha.clone());
                    }
                    let entry = Entry {
                        original_sha256: f.source.sha.clone(),
                        patched_sha256: patched,
                        symlink: f.source.link.clone().map(PathBuf::from),
                    };
                    manifest.files.insert(f.place.file.clone(), entry);
                }
            }
        }
        // The manifest first: a crash before the renames leaves a manifest
        // that knows each original, and files that are still the original.
        store.save(&manifest)?;
    }
    Ok(prepared)
}

/// Where a staged file is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum State {
    /// Its new content is at the temporary name.
    Staged,
    /// In place; the old entry is at the temporary name (swapped), or gone
    /// (renamed over, on a filesystem that cannot swap).
    Swapped,
    Renamed,
}

/// A new content written and synced beside its target, not yet in place.
struct Staged {
    place: Place,
    source: Source,
    new: String,
    max: u64,
    tmp: OsString,
    state: State,
}

/// Every file planned, its new content staged, originals kept and the
/// manifest saved, under the lock: [`StagedPatches::commit`] puts them in place.
/// Dropped without a commit, it removes what it staged.
#[derive(Default)]
pub struct StagedPatches {
    store: Option<Store>,
    lock: Option<Lock>,
    /// The manifest as it was.
    before: Manifest,
    /// Originals written by this run.
    kept: Vec<String>,
    files: Vec<Staged>,
    results: Vec<Applied>,
}

impl StagedPatches {
    /// Replace each target in order, each checked unchanged just before;
    /// on a failure, put back those already replaced.
    pub fn commit(mut self) -> Result<Vec<Applied>, PatchError> {
        for i in 0..self.files.len() {
            let f = &mut self.files[i];
            match swap_in(&f.place, &f.source, f.max, &f.tmp) {
                Ok(state) => f.state = state,
                Err(error) => {
                    let undone = self.undo();
                    return Err(PatchError::Undone { error: Box::new(error), undone });
                }
            }
        }
        for f in &mut self.files {
            if f.state == State::Swapped {
                let _ = f.place.dir.remove(&f.tmp);
            }
            f.state = State::Renamed;
            let _ = f.place.dir.sync();
        }
        self.lock = None;
        Ok(std::mem::take(&mut self.results))
    }

    /// Put back every file replaced, remove what was staged, and the
    /// manifest and originals as they were. Returns the files put back.
    fn undo(&mut self) -> Vec<PathBuf> {
        let mut undone = Vec::new();
        for f in self.files.iter_mut().rev() {
            match f.state {
                State::Staged => {}
                State::Swapped => {
                    if f.place.dir.exchange(&f.tmp, &f.place.name).unwrap_or(false) {
                        undone.push(f.place.file.clone());
                    }
                }
                State::Renamed => {
                    if put_back(f).is_ok() {
                        undone.push(f.place.file.clone());
                    }
                }
            }
            let _ = f.place.dir.remove(&f.tmp);
            let _ = f.place.dir.sync();
            f.state = State::Renamed;
        }
        if let Some(store) = &self.store {
            let _ = store.save(&self.before);
            for sha in &self.kept {
                if !self.before.keeps(sha) {
                    store.forget_original(sha);
                }
            }
        }
        undone.reverse();
        undone
    }
}

impl Drop for StagedPatches {
    fn drop(&mut self) {
        if self.files.iter().any(|f| f.state != State::Renamed) {
            self.undo();
        }
    }
}

/// Put the entry `tmp` in place of the file `source` read, if it is still
/// what was read: swapped with it (the old entry is then at `tmp`), or
/// renamed over it where the filesystem cannot swap. On an error, `tmp` is
/// where it was.
fn swap_in(place: &Place, source: &Source, max: u64, tmp: &OsStr) -> Result<State, PatchError> {
    let file = place.file.clone();
    if !place.unchanged(source, max) {
        return Err(PatchError::ChangedMeanwhile { file });
    }
    let werr = |source| PatchError::Write { file: file.clone(), source };
    if !place.dir.exchange(tmp, &place.name).map_err(werr)? {
        place.dir.rename(tmp, &place.name).map_err(werr)?;
        return Ok(State::Renamed);
    }
    // The entry swapped out must be the one checked.
    let out = place.dir.lstat(tmp).ok().flatten().map(|m| Stamp::of(&m));
    if out != Some(source.entry) {
        let _ = place.dir.exchange(tmp, &place.name);
        return Err(PatchError::ChangedMeanwhile { file });
    }
    Ok(State::Swapped)
}

/// Write the original back where the filesystem could not swap.
fn put_back(f: &Staged) -> io::Result<()> {
    let dir = &f.place.dir;
    let tmp = match &f.source.link {
        Some(target) => dir.symlink_temp(&f.place.name, target)?,
        None => dir.write_temp(&f.place.name, &f.source.bytes, f.source.mode & 0o777, Some(f.source.owner))?,
    };
    dir.rename(&tmp, &f.place.name).inspect_err(|_| {
        let _ = dir.remove(&tmp);
    })
}

/// What `revert` did.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub(crate) struct Reverted {
    /// Files put back as they were.
    pub(crate) restored: Vec<PathBuf>,
    /// Files the manifest names and no `[[patch]]` does: left as they are.
    pub(crate) ignored: Vec<PathBuf>,
}

/// What one file is restored to.
enum Original {
    /// It is already the original: only its entry goes.
    Already,
    Bytes(Vec<u8>),
    Link(PathBuf),
}

/// Restore every file the `[[patch]]` entries name and the manifest knows
/// to its original (a symlink back to the same symlink). Every file is
/// checked before any is restored: one changed by someone else since it
/// was patched is refused unless `force`; an original that does not hash
/// to its recorded sha256, and a link that would lead out of the model's
/// folder or to anything but the original, are refused whatever `force`
/// says.
pub(crate) fn revert(patches: &[Patch], state_dir: &Path, force: bool, wait: Wait<'_>) -> Result<Reverted, PatchError> {
    let Some(store) = Store::open(state_dir, false)? else { return Ok(Reverted::default()) };
    let _lock = store.lock(wait)?;
    let mut manifest = store.load()?;
    let fps = by_file(patches);
    let named: HashSet<&Path> = fps.iter().map(|f| f.file.as_path()).collect();
    let ignored: Vec<PathBuf> = manifest.files.keys().filter(|f| !named.contains(f.as_path())).cloned().collect();
    let mut todo = Vec::new();
    for fp in &fps {
        let Some(entry) = manifest.files.get(&fp.file).cloned() else { continue };
        let max = fp.max_size();
        let place = Place::open(&fp.file)?;
        let source = place.read(max)?;
        let original = original_of(&store, &place, &source, &entry, force, max)?;
        todo.push((place, source, entry, original, max));
    }
    let mut restored = Vec::new();
    for (place, source, entry, original, max) in todo {
        let file = place.file.clone();
        if !matches!(original, Original::Already) {
            restore(&place, &source, &original, max)?;
            restored.push(file.clone());
        }
        manifest.files.remove(&file);
        store.save(&manifest)?;
        if !manifest.keeps(&entry.original_sha256) {
            store.forget_original(&entry.original_sha256);
        }
    }
    Ok(Reverted { restored, ignored })
}

/// What `file` is to be restored to, checked.
fn original_of(
    store: &Store,
    place: &Place,
    source: &Source,
    entry: &Entry,
    force: bool,
    max: u64,
) -> Result<Original, PatchError> {
    let file = &place.file;
    let link_now = source.link.as_ref().map(PathBuf::from);
    if source.sha == entry.original_sha256 && link_now == entry.symlink {
        return Ok(Original::Already);
    }
    let ours = source.sha == entry.patched_sha256 && link_now.is_none();
    if !ours && !force {
        return Err(PatchError::Changed { file: file.clone() });
    }
    match &entry.symlink {
        Some(target) => {
            let refuse = |reason: String| PatchError::Link { file: file.clone(), target: target.clone(), reason };
            // Where the link leads, from the folder it is in, within the
            // model's folder.
            let rel = if target.is_absolute() {
                match target.strip_prefix(place.root.path()) {
                    Ok(inside) => inside.to_path_buf(),
                    Err(_) => return Err(refuse(format!("leads out of {}", place.root.path().display()))),
                }
            } else {
                place.dir_rel.join(target)
            };
            let root = place.root.path().display();
            let b = place.root.open_beneath(&rel).map_err(|e| match e {
                BeneathError::Outside { .. } => refuse(format!("leads out of {root}")),
                BeneathError::Escapes { link, target, .. } => {
                    refuse(format!("leads out of {root} (through {} -> {})", link.display(), target.display()))
                }
                e => refuse(format!("is refused: {e}")),
            })?;
            let bytes = match crate::util::fsutil::read_capped(&b.file, max) {
                Ok(Ok(bytes)) => bytes,
                Ok(Err(size)) => return Err(refuse(format!("leads to {size} bytes, more than `max-size`"))),
                Err(e) => return Err(refuse(format!("cannot be read: {e}"))),
            };
            if sha256(&bytes) != entry.original_sha256 {
                return Err(refuse("leads to a file that is not the original (its sha256 differs)".into()));
            }
            Ok(Original::Link(target.clone()))
        }
        None => store.original(&entry.original_sha256, max).map(Original::Bytes).map_err(|reason| PatchError::Backup {
            file: file.clone(),
            backup: store.original_path(&entry.original_sha256),
            reason,
        }),
    }
}

/// Put `original` in place of the file `source` read, if it is still that.
fn restore(place: &Place, source: &Source, original: &Original, max: u64) -> Result<(), PatchError> {
    let file = place.file.clone();
    let werr = |source| PatchError::Write { file: file.clone(), source };
    let dir = &place.dir;
    let tmp = match original {
        Original::Already => return Ok(()),
        Original::Link(target) => dir.symlink_temp(&place.name, target.as_os_str()).map_err(werr)?,
        Original::Bytes(b) => dir.write_temp(&place.name, b, source.mode & 0o777, Some(source.owner)).map_err(werr)?,
    };
    let result = swap_in(place, source, max, &tmp);
    // Swapped: the patched file is at `tmp`; failed: the original is.
    if !matches!(result, Ok(State::Renamed)) {
        let _ = dir.remove(&tmp);
    }
    let _ = dir.sync();
    result.map(|_| ())
}

/// The patches' manifest in `state_dir`, read without the lock and
/// without creating anything: `None` when nothing was ever patched.
pub(crate) fn manifest(state_dir: &Path) -> Result<Option<store::Manifest>, PatchError> {
    match store::Store::open(state_dir, false)? {
        Some(s) => s.load().map(Some),
        None => Ok(None),
    }
}

/// Problems `run` and `patch` would meet at start, found without writing
/// anything: every file that cannot be read or patched now (its kind, its
/// size, a link out of its folder, its JSON, its paths), a folder or file
/// that could not be replaced (not writable, immutable, an owner that
/// could not be kept), and in the state directory a patches folder, lock
/// or manifest that cannot be used.
pub(crate) fn check(patches: &[Patch], state_dir: &Path) -> Vec<String> {
    let mut out = Vec::new();
    let fps = by_file(patches);
    for fp in fps.iter().filter(|fp| !fp.file.as_os_str().is_empty()) {
        let planned = Place::open(&fp.file).and_then(|place| {
            let source = place.read(fp.max_size())?;
            let plan = plan_of(fp, &source)?;
            Ok((place, source, plan))
        });
        match planned {
            Err(e) => out.push(e.to_string()),
            Ok((place, source, plan)) if plan.changes() => out.extend(replaceable(&place, &source)),
            Ok(_) => {}
        }
    }
    if !fps.is_empty() {
        out.extend(store::check(state_dir));
    }
    out
}

/// Why the file at `place` could not be replaced now, if it could not.
fn replaceable(place: &Place, source: &Source) -> Vec<String> {
    let file = place.file.display();
    let dir = place.dir.path().display();
    let mut out = Vec::new();
    if let Err(e) = place.dir.writable() {
        out.push(format!("{file}: cannot write: folder {dir} is not writable ({e})"));
    }
    if let Some(why) = attributes(place.dir.fd()) {
        out.push(format!("{file}: cannot write: folder {dir} is {why}"));
    }
    if source.link.is_none()
        && let Ok((f, _)) = place.dir.open_regular(&place.name, false)
        && let Some(why) = attributes(std::os::fd::AsFd::as_fd(&f))
    {
        out.push(format!("{file}: cannot be replaced: it is {why}"));
    }
    let euid = nix::unistd::geteuid().as_raw();
    if euid != 0 && source.owner.0 != euid {
        out.push(format!(
            "{file}: belongs to uid {}, and the patched file would keep its owner: only root can give a file \
             to another user (the warden runs as uid {euid})",
            source.owner.0
        ));
    }
    out
}

/// `immutable (chattr +i)` or `append-only (chattr +a)`, if the inode is.
fn attributes(fd: std::os::fd::BorrowedFd<'_>) -> Option<&'static str> {
    let flags = rustix::fs::ioctl_getflags(fd).ok()?;
    if flags.contains(rustix::fs::IFlags::IMMUTABLE) {
        Some("immutable (chattr +i)")
    } else if flags.contains(rustix::fs::IFlags::APPEND) {
        Some("append-only (chattr +a)")
    } else {
        None
    }
}

#[cfg(test)]
mod properties;
