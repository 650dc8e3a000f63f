//! A patch that cannot be applied or reverted, named with its file and why.

use std::io;
use std::path::{Path, PathBuf};

use crate::util::fsutil::BeneathError;

/// A patch that cannot be applied or reverted; names the file and why.
#[derive(Debug, thiserror::Error)]
pub enum PatchError {
    #[error("{file}: cannot read: {source}")]
    Read { file: PathBuf, source: io::Error },
    #[error("{file}: {}is {kind}, not {wanted}", named(file, path))]
    Kind { file: PathBuf, path: PathBuf, kind: &'static str, wanted: &'static str },
    #[error(
        "{file}: the link {link} -> {target} leads out of {root}; a model file's links are followed only within \
         its folder, or within its Hugging Face cache repository"
    )]
    Escapes { file: PathBuf, link: PathBuf, target: PathBuf, root: PathBuf },
    #[error(
        "{file}: is {}, more than its `max-size` of {} (raise `max-size` in its [[patch]] if the file is right)",
        size_of(*.size),
        size_of(*.max)
    )]
    TooBig { file: PathBuf, size: u64, max: u64 },
    #[error("{file}: malformed JSON at line {line}, column {column}: {message}")]
    Json { file: PathBuf, line: usize, column: usize, message: String },
    #[error("{file}: cannot {op} `{path}`: {reason}")]
    Path { file: PathBuf, op: &'static str, path: String, reason: String },
    #[error("{file}: its [[patch]] entries undo each other: applied to the patched file, {why}")]
    Contradiction { file: PathBuf, why: String },
    #[error("{file}: cannot be edited in place: {reason}")]
    InPlace { file: PathBuf, reason: String },
    #[error("{file}: cannot write: {source}")]
    Write { file: PathBuf, source: io::Error },
    #[error("{file}: changed by someone else since it was patched (use --force to restore the original anyway)")]
    Changed { file: PathBuf },
    #[error("{file}: changed by someone else meanwhile; left as it is")]
    ChangedMeanwhile { file: PathBuf },
    #[error("{file}: not restored: its original {backup} {reason}")]
    Backup { file: PathBuf, backup: PathBuf, reason: OriginalError },
    #[error("{file}: not restored: the link it was, -> {target}, {reason}")]
    Link { file: PathBuf, target: PathBuf, reason: String },
    #[error("{path}: {reason}")]
    Manifest { path: PathBuf, reason: String },
    #[error("{lock}: held by {holder}, which is changing the patches of this instance")]
    Locked { lock: PathBuf, holder: String },
    #[error("state directory {dir}: {source}")]
    State { dir: PathBuf, source: io::Error },
    #[error("{error}{}", undone_note(.undone))]
    Undone { error: Box<PatchError>, undone: Vec<PathBuf> },
}

/// Why a kept original cannot be used to restore its file.
#[derive(Debug, thiserror::Error)]
pub enum OriginalError {
    /// The recorded sha256 is not one (so names no file).
    #[error("{0}")]
    Name(io::Error),
    #[error("is missing")]
    Missing,
    #[error("is {kind}, not {wanted}")]
    Kind { kind: &'static str, wanted: &'static str },
    #[error("{0}")]
    Open(BeneathError),
    #[error("is {0} bytes, more than the file's `max-size`")]
    TooBig(u64),
    #[error("cannot be read: {0}")]
    Read(io::Error),
    #[error("does not match its recorded sha256")]
    Mismatch,
}

impl PatchError {
    /// Whether trying again later may succeed: another run held the lock,
    /// or a file changed under this one.
    pub fn is_transient(&self) -> bool {
        match self {
            PatchError::Locked { .. } | PatchError::ChangedMeanwhile { .. } => true,
            PatchError::Undone { error, .. } => error.is_transient(),
            _ => false,
        }
    }
}

fn named(file: &Path, path: &Path) -> String {
    if file == path { String::new() } else { format!("{} ", path.display()) }
}

fn size_of(n: u64) -> String {
    const MIB: u64 = 1 << 20;
    if n >= MIB && n.is_multiple_of(MIB) {
        format!("{} MiB", n / MIB)
    } else if n >= MIB {
        format!("{:.1} MiB ({n} bytes)", n as f64 / MIB as f64)
    } else {
        format!("{n} bytes")
    }
}

fn undone_note(undone: &[PathBuf]) -> String {
    if undone.is_empty() {
        return String::new();
    }
    let files: Vec<String> = undone.iter().map(|f| f.display().to_string()).collect();
    format!("; the files already replaced were put back as they were: {}", files.join(", "))
}
