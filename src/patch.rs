//! Patching model files: pure JSON edits by dotted path, atomic writes that
//! keep mode, owner, key order, number spelling and indentation, originals
//! saved once under the state directory with their sha256, and revert. A
//! Hugging Face cache symlink becomes a patched regular file; the blob it
//! points to is never written, and revert puts the link back. The [`Patch`]
//! type (one `[[patch]]` entry) lives here; `config` builds it. Nothing here
//! knows about the child, systemd or how the config file is read.

use std::collections::BTreeMap;
use std::fmt;
use std::fs;
use std::io;
use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};
use serde_json::Value;
use sha2::{Digest, Sha256};

use crate::fsutil::{rename_into_place, sync_dir, temp_name, write_atomic, write_temp};

/// One `[[patch]]` entry: JSON edits applied before every start.
#[derive(Debug, Clone, PartialEq)]
pub struct Patch {
    pub file: PathBuf,
    /// Dotted paths (`a.b.0.c`, `a\.b` for a dot inside a key).
    pub remove: Vec<String>,
    /// Dotted path → value, in the order written.
    pub set: Vec<(String, Value)>,
}

/// A patch that cannot be applied or reverted; names the file and why.
#[derive(Debug, thiserror::Error)]
pub enum PatchError {
    #[error("{file}: cannot read: {source}")]
    Read { file: PathBuf, source: io::Error },
    #[error("{file}: malformed JSON at line {line}, column {column}: {message}")]
    Json { file: PathBuf, line: usize, column: usize, message: String },
    #[error("{file}: cannot {op} `{path}`: {reason}")]
    Path { file: PathBuf, op: &'static str, path: String, reason: String },
    #[error("{file}: cannot write: {source}")]
    Write { file: PathBuf, source: io::Error },
    #[error("{file}: changed by someone else since it was patched (use --force to restore the original anyway)")]
    Changed { file: PathBuf },
    #[error("state directory {dir}: {source}")]
    State { dir: PathBuf, source: io::Error },
}

/// One step of a dotted path.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Step {
    Key(String),
    /// Digits: an index into an array, or a key of an object.
    Index(usize, String),
}

/// Split `a.b\.c.0` into `a`, `b.c`, `0`.
fn steps(path: &str) -> Vec<Step> {
    let mut out = Vec::new();
    let mut cur = String::new();
    let mut chars = path.chars().peekable();
    let mut push = |cur: &mut String| {
        let s = std::mem::take(cur);
        match s.parse::<usize>() {
            Ok(i) if !s.is_empty() && s.chars().all(|c| c.is_ascii_digit()) => out.push(Step::Index(i, s)),
            _ => out.push(Step::Key(s)),
        }
    };
    while let Some(c) = chars.next() {
        match c {
            '\\' if chars.peek() == Some(&'.') => {
                cur.push('.');
                chars.next();
            }
            '.' => push(&mut cur),
            c => cur.push(c),
        }
    }
    push(&mut cur);
    out
}

fn kind(v: &Value) -> &'static str {
    match v {
        Value::Null => "null",
        Value::Bool(_) => "a boolean",
        Value::Number(_) => "a number",
        Value::String(_) => "a string",
        Value::Array(_) => "an array",
        Value::Object(_) => "an object",
    }
}

/// Remove `path`; a missing key is not an error. Returns whether it changed.
pub fn remove(doc: &mut Value, path: &str) -> Result<bool, String> {
    let steps = steps(path);
    let (last, parents) = steps.split_last().ok_or("empty path")?;
    let mut node = doc;
    for (i, step) in parents.iter().enumerate() {
        node = match (node, step) {
            (Value::Object(m), Step::Key(k) | Step::Index(_, k)) => match m.get_mut(k) {
                Some(v) => v,
                None => return Ok(false),
            },
            (Value::Array(a), Step::Index(n, _)) => match a.get_mut(*n) {
                Some(v) => v,
                None => return Ok(false),
            },
            (other, _) => return Err(format!("`{}` goes through {}", path_prefix(&steps[..i]), kind(other))),
        };
    }
    match (node, last) {
        (Value::Object(m), Step::Key(k) | Step::Index(_, k)) => Ok(m.shift_remove(k).is_some()),
        (Value::Array(a), Step::Index(n, _)) if *n < a.len() => {
            a.remove(*n);
            Ok(true)
        }
        (Value::Array(_), Step::Index(..)) => Ok(false),
        (other, _) => Err(format!("`{}` is {}, not an object", path_prefix(parents), kind(other))),
    }
}

/// Set `path` to `value`, creating missing objects on the way. Returns
/// whether it changed.
pub fn set(doc: &mut Value, path: &str, value: &Value) -> Result<bool, String> {
    let steps = steps(path);
    let (last, parents) = steps.split_last().ok_or("empty path")?;
    let mut node = doc;
    for (i, step) in parents.iter().enumerate() {
        let shown = path_prefix(&steps[..=i]);
        node = match (node, step) {
            (Value::Object(m), Step::Key(k) | Step::Index(_, k)) => {
                m.entry(k.clone()).or_insert_with(|| Value::Object(Default::default()))
            }
            (Value::Array(a), Step::Index(n, _)) => {
                let len = a.len();
                a.get_mut(*n).ok_or_else(|| format!("`{shown}`: index {n} is past the end ({len} elements)"))?
            }
            (other, _) => return Err(format!("`{}` goes through {}", path_prefix(&steps[..i]), kind(other))),
        };
    }
    let slot = match (node, last) {
        (Value::Object(m), Step::Key(k) | Step::Index(_, k)) => m.entry(k.clone()).or_insert(Value::Null),
        (Value::Array(a), Step::Index(n, _)) => {
            let len = a.len();
            a.get_mut(*n).ok_or_else(|| format!("`{path}`: index {n} is past the end ({len} elements)"))?
        }
        (other, _) => return Err(format!("`{}` is {}, not an object", path_prefix(parents), kind(other))),
    };
    if slot == value {
        return Ok(false);
    }
    *slot = value.clone();
    Ok(true)
}

fn path_prefix(steps: &[Step]) -> String {
    let parts: Vec<String> = steps
        .iter()
        .map(|s| match s {
            Step::Key(k) | Step::Index(_, k) => k.replace('.', "\\."),
        })
        .collect();
    if parts.is_empty() { "(the document)".into() } else { parts.join(".") }
}

/// The indentation the file uses: the leading whitespace of its first
/// indented line; `None` for a one-line document.
fn indentation(text: &str) -> Option<String> {
    text.lines()
        .skip(1)
        .map(|l| l.chars().take_while(|c| *c == ' ' || *c == '\t').collect::<String>())
        .find(|w| !w.is_empty())
}

/// Serialise `doc` in the style of `original`.
fn render(doc: &Value, original: &str) -> String {
    let mut out = match indentation(original) {
        Some(indent) => {
            let mut buf = Vec::new();
            let fmt = serde_json::ser::PrettyFormatter::with_indent(indent.as_bytes());
            let mut ser = serde_json::Serializer::with_formatter(&mut buf, fmt);
            doc.serialize(&mut ser).expect("a JSON value serialises");
            String::from_utf8(buf).expect("serde_json writes UTF-8")
        }
        None => serde_json::to_string(doc).expect("a JSON value serialises"),
    };
    if original.ends_with('\n') {
        out.push('\n');
    }
    out
}

/// The patches of one file, in config order.
#[derive(Debug, Clone)]
pub struct FilePatch<'a> {
    pub file: PathBuf,
    pub patches: Vec<&'a Patch>,
}

/// Group patches by file, keeping the order of first appearance.
pub fn by_file(patches: &[Patch]) -> Vec<FilePatch<'_>> {
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
pub struct Plan {
    pub file: PathBuf,
    pub old: String,
    pub new: String,
}

impl Plan {
    pub fn changes(&self) -> bool {
        self.old != self.new
    }

    /// A unified diff, empty when nothing changes.
    pub fn diff(&self) -> String {
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
pub fn plan(fp: &FilePatch<'_>) -> Result<Plan, PatchError> {
    let file = fp.file.clone();
    let old = fs::read_to_string(&file).map_err(|source| PatchError::Read { file: file.clone(), source })?;
    let mut doc: Value = serde_json::from_str(&old).map_err(|e| PatchError::Json {
        file: file.clone(),
        line: e.line(),
        column: e.column(),
        message: e.to_string().split(" at line").next().unwrap_or_default().to_string(),
    })?;
    let mut changed = false;
    for p in &fp.patches {
        for path in &p.remove {
            changed |= remove(&mut doc, path).map_err(|reason| PatchError::Path {
                file: file.clone(),
                op: "remove",
                path: path.clone(),
                reason,
            })?;
        }
        for (path, value) in &p.set {
            changed |= set(&mut doc, path, value).map_err(|reason| PatchError::Path {
                file: file.clone(),
                op: "set",
                path: path.clone(),
                reason,
            })?;
        }
    }
    let new = if changed { render(&doc, &old) } else { old.clone() };
    Ok(Plan { file, old, new })
}

/// One patched file in the manifest.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
struct Entry {
    /// The backup's file name in the patches folder.
    backup: String,
    original_sha256: String,
    patched_sha256: String,
    /// The link target, when the file was a symlink.
    symlink: Option<PathBuf>,
}

#[derive(Debug, Default, Serialize, Deserialize)]
struct Manifest {
    files: BTreeMap<PathBuf, Entry>,
}

fn sha256(bytes: &[u8]) -> String {
    let digest = Sha256::digest(bytes);
    digest.iter().map(|b| format!("{b:02x}")).collect()
}

/// Where originals and the manifest live: `<state>/patches/`.
pub struct Store {
    dir: PathBuf,
}

impl Store {
    pub fn new(state_dir: &Path) -> Store {
        Store { dir: state_dir.join("patches") }
    }

    fn manifest_path(&self) -> PathBuf {
        self.dir.join("manifest.json")
    }

    fn load(&self) -> Result<Manifest, PatchError> {
        match fs::read(self.manifest_path()) {
            Ok(b) => serde_json::from_slice(&b).map_err(|e| PatchError::State {
                dir: self.dir.clone(),
                source: io::Error::new(io::ErrorKind::InvalidData, format!("manifest.json: {e}")),
            }),
            Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(Manifest::default()),
            Err(source) => Err(PatchError::State { dir: self.dir.clone(), source }),
        }
    }

    fn save(&self, m: &Manifest) -> Result<(), PatchError> {
        let text = serde_json::to_string_pretty(m).expect("manifest serialises");
        write_atomic(&self.manifest_path(), text.as_bytes(), 0o600, None)
            .map_err(|source| PatchError::State { dir: self.dir.clone(), source })
    }

    fn ensure_dir(&self) -> Result<(), PatchError> {
        fs::create_dir_all(&self.dir).map_err(|source| PatchError::State { dir: self.dir.clone(), source })?;
        let _ = fs::set_permissions(&self.dir, fs::Permissions::from_mode(0o700));
        Ok(())
    }
}

/// What `apply` did to one file.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Applied {
    Unchanged(PathBuf),
    Patched(PathBuf),
}

/// Apply every patch. All or nothing: every file is planned, and every
/// new content written to a temporary file beside its target, before any
/// target is replaced; malformed JSON, a bad path or an unwritable folder in
/// any file leaves every file as it was.
pub fn apply(patches: &[Patch], state_dir: &Path) -> Result<Vec<Applied>, PatchError> {
    let plans = by_file(patches).iter().map(plan).collect::<Result<Vec<_>, _>>()?;
    let mut staged: Vec<(&Plan, Staged)> = Vec::new();
    for p in plans.iter().filter(|p| p.changes()) {
        match stage(p) {
            Ok(st) => staged.push((p, st)),
            Err(e) => {
                for (_, st) in staged {
                    let _ = fs::remove_file(&st.tmp);
                }
                return Err(e);
            }
        }
    }
    let store = Store::new(state_dir);
    let mut manifest = store.load()?;
    let mut staged = staged.into_iter();
    while let Some((plan, st)) = staged.next() {
        if let Err(e) = commit(&store, &mut manifest, plan, &st) {
            let _ = fs::remove_file(&st.tmp);
            for (_, rest) in staged {
                let _ = fs::remove_file(&rest.tmp);
            }
            return Err(e);
        }
    }
    Ok(plans
        .into_iter()
        .map(|p| if p.changes() { Applied::Patched(p.file) } else { Applied::Unchanged(p.file) })
        .collect())
}

/// A new content written and synced beside its target, not yet in place.
struct Staged {
    tmp: PathBuf,
    /// The link target, when the file is a symlink now.
    symlink: Option<PathBuf>,
}

fn stage(plan: &Plan) -> Result<Staged, PatchError> {
    let file = &plan.file;
    let werr = |source| PatchError::Write { file: file.clone(), source };
    let link = fs::symlink_metadata(file).map_err(werr)?;
    let symlink = if link.file_type().is_symlink() { Some(fs::read_link(file).map_err(werr)?) } else { None };
    // Mode and owner of the content (the blob, for a symlink).
    let meta = fs::metadata(file).map_err(werr)?;
    let tmp =
        write_temp(file, plan.new.as_bytes(), meta.mode() & 0o7777, Some((meta.uid(), meta.gid()))).map_err(werr)?;
    Ok(Staged { tmp, symlink })
}

/// Keep the original (once), save the manifest, put the staged file in place.
fn commit(store: &Store, manifest: &mut Manifest, plan: &Plan, st: &Staged) -> Result<(), PatchError> {
    let file = &plan.file;
    let original_sha = sha256(plan.old.as_bytes());
    let patched_sha = sha256(plan.new.as_bytes());
    match manifest.files.get_mut(file) {
        // Patched by us before (with other patches): the original stays.
        Some(e) if e.patched_sha256 == original_sha => e.patched_sha256 = patched_sha,
        // Not patched yet, or replaced since: its content now is the original.
        _ => {
            store.ensure_dir()?;
            let backup = format!(
                "{:04}-{}",
                manifest.files.len() + 1,
                file.file_name().and_then(|n| n.to_str()).unwrap_or("file")
            );
            write_atomic(&store.dir.join(&backup), plan.old.as_bytes(), 0o600, None)
                .map_err(|source| PatchError::State { dir: store.dir.clone(), source })?;
            let entry = Entry {
                backup,
                original_sha256: original_sha,
                patched_sha256: patched_sha,
                symlink: st.symlink.clone(),
            };
            manifest.files.insert(file.clone(), entry);
        }
    }
    // The manifest first: a crash between the two leaves a manifest that
    // knows the original, and a file that is still the original.
    store.save(manifest)?;
    rename_into_place(&st.tmp, file).map_err(|source| PatchError::Write { file: file.clone(), source })
}

/// Restore every file in the manifest to its original (a symlink back to a
/// symlink). Refuses a file changed by someone else since it was patched,
/// unless `force`. Returns the files restored.
pub fn revert(state_dir: &Path, force: bool) -> Result<Vec<PathBuf>, PatchError> {
    let store = Store::new(state_dir);
    let mut manifest = store.load()?;
    let mut done = Vec::new();
    let files: Vec<PathBuf> = manifest.files.keys().cloned().collect();
    for file in files {
        let entry = manifest.files[&file].clone();
        let current = fs::read(&file).ok();
        let current_sha = current.as_deref().map(sha256);
        let still_ours = current_sha.as_deref() == Some(entry.patched_sha256.as_str());
        let already_original =
            current_sha.as_deref() == Some(entry.original_sha256.as_str()) && is_link(&file) == entry.symlink.is_some();
        if already_original {
            manifest.files.remove(&file);
            store.save(&manifest)?;
            continue;
        }
        if !still_ours && !force {
            return Err(PatchError::Changed { file });
        }
        let werr = |source| PatchError::Write { file: file.clone(), source };
        match &entry.symlink {
            Some(target) => replace_with_symlink(&file, target).map_err(werr)?,
            None => {
                let original = fs::read(store.dir.join(&entry.backup))
                    .map_err(|source| PatchError::State { dir: store.dir.clone(), source })?;
                let meta = fs::metadata(&file).map_err(werr)?;
                write_atomic(&file, &original, meta.mode() & 0o7777, Some((meta.uid(), meta.gid()))).map_err(werr)?;
            }
        }
        manifest.files.remove(&file);
        store.save(&manifest)?;
        let _ = fs::remove_file(store.dir.join(&entry.backup));
        done.push(file);
    }
    Ok(done)
}

fn is_link(p: &Path) -> bool {
    fs::symlink_metadata(p).is_ok_and(|m| m.file_type().is_symlink())
}

fn replace_with_symlink(path: &Path, target: &Path) -> io::Result<()> {
    let tmp = temp_name(path);
    let _ = fs::remove_file(&tmp);
    std::os::unix::fs::symlink(target, &tmp)?;
    if let Err(e) = fs::rename(&tmp, path) {
        let _ = fs::remove_file(&tmp);
        return Err(e);
    }
    sync_dir(path)
}

/// Problems `check` reports up front: every patch that could not be applied
/// now, and folders a changing patch could not write.
pub fn check(patches: &[Patch]) -> Vec<String> {
    let mut out = Vec::new();
    for fp in by_file(patches) {
        match plan(&fp) {
            Err(e) => out.push(e.to_string()),
            Ok(p) if p.changes() => {
                let dir = p.file.parent().unwrap_or(Path::new("."));
                if nix::unistd::access(dir, nix::unistd::AccessFlags::W_OK).is_err() {
                    out.push(format!("{}: cannot write: folder {} is not writable", p.file.display(), dir.display()));
                }
            }
            Ok(_) => {}
        }
    }
    out
}

impl fmt::Display for Applied {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Applied::Unchanged(p) => write!(f, "{}: already patched", p.display()),
            Applied::Patched(p) => write!(f, "{}: patched", p.display()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn paths_split_on_unescaped_dots() {
        assert_eq!(
            steps(r"a.b\.c.0"),
            vec![Step::Key("a".into()), Step::Key("b.c".into()), Step::Index(0, "0".into())]
        );
    }

    #[test]
    fn remove_by_path_and_a_missing_key_is_fine() {
        let mut d = json!({"q": {"kv_cache_quant_algo": "FP8", "x": 1}, "l": [{"n": 1}, {"n": 2}], "a.b": 3});
        assert_eq!(remove(&mut d, "q.kv_cache_quant_algo"), Ok(true));
        assert_eq!(remove(&mut d, "q.kv_cache_quant_algo"), Ok(false));
        assert_eq!(remove(&mut d, "missing.deeper.key"), Ok(false));
        assert_eq!(remove(&mut d, "l.1.n"), Ok(true));
        assert_eq!(remove(&mut d, r"a\.b"), Ok(true));
        assert_eq!(d, json!({"q": {"x": 1}, "l": [{"n": 1}, {}]}));
    }

    #[test]
    fn a_path_through_a_non_object_is_an_error() {
        let mut d = json!({"a": "text", "n": 5});
        assert_eq!(remove(&mut d, "a.b.c"), Err("`a` goes through a string".to_string()));
        assert!(set(&mut d, "n.m", &json!(1)).unwrap_err().contains("is a number, not an object"));
    }

    #[test]
    fn set_creates_objects_and_is_idempotent() {
        let mut d = json!({"a": 1});
        assert_eq!(set(&mut d, "b.c", &json!([1, 2])), Ok(true));
        assert_eq!(set(&mut d, "b.c", &json!([1, 2])), Ok(false));
        assert_eq!(d, json!({"a": 1, "b": {"c": [1, 2]}}));
    }

    #[test]
    fn rendering_keeps_order_numbers_and_indentation() {
        let text =
            "{\n    \"zeta\": 1,\n    \"eps\": 1e-05,\n    \"alpha\": [\n        1.0\n    ],\n    \"kv\": \"x\"\n}\n";
        let mut d: Value = serde_json::from_str(text).unwrap();
        remove(&mut d, "kv").unwrap();
        assert_eq!(
            render(&d, text),
            "{\n    \"zeta\": 1,\n    \"eps\": 1e-05,\n    \"alpha\": [\n        1.0\n    ]\n}\n"
        );
        let compact = "{\"b\":1,\"a\":2}";
        let d: Value = serde_json::from_str(compact).unwrap();
        assert_eq!(render(&d, compact), compact);
    }
}
