//! What the status document and the metrics say of the past, kept in the
//! state directory (`history.json`) so that a new warden of the instance
//! goes on saying it: after an upgrade in place (the run handed over) and
//! after systemd starts the warden again (a new run). The last exit, the
//! last failed run and when it was counted, the last load that ended, and
//! the last reload: each is shown until the new warden has one of its own.
//!
//! The file is the warden's, but read as anyone's: a regular file of at
//! most [`MAX_SIZE`], opened without following a link and without
//! blocking; every text in it is made safe to show again, a time that is
//! no time is dropped, and a file that is none of this is set aside with a
//! warning: the document then starts without a past, as before.

use std::os::unix::fs::OpenOptionsExt;
use std::path::Path;
use std::time::{Duration, SystemTime};

use serde::{Deserialize, Serialize};

use super::{LastExit, LastFailure, LastLoad, LastReload};

/// The file's name in the state directory.
pub(crate) const FILE: &str = "history.json";

/// A history larger than this is not read: what it holds is a few lines.
pub(crate) const MAX_SIZE: u64 = 64 << 10;

/// The past, as the document shows it.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub(crate) struct History {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub(crate) last_exit: Option<LastExit>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub(crate) last_failure: Option<LastFailure>,
    /// When the last failed run was counted, in seconds since the epoch
    /// (`vllm_warden_last_failure_timestamp_seconds`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub(crate) last_failure_at: Option<f64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub(crate) last_load: Option<LastLoad>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub(crate) last_reload: Option<LastReload>,
    /// The run ready now: its child, and since when, in seconds since the
    /// epoch; an upgrade's successor that takes the run over goes on
    /// saying it (what the machine hands over is a time elapsed, which the
    /// exec would add to).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub(crate) ready: Option<ReadyRun>,
}

#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub(crate) struct ReadyRun {
    pub(crate) pid: u32,
    pub(crate) since: f64,
}

impl History {
    /// The history in `state_dir`, or none: absent (a first start), or not
    /// one (logged, and not used).
    pub(crate) fn read(state_dir: &Path) -> History {
        let path = state_dir.join(FILE);
        match read(&path) {
            Ok(h) => h.unwrap_or_default(),
            Err(why) => {
                tracing::warn!(file = %path.display(), "the status history is not used: {why}");
                History::default()
            }
        }
    }

    /// As JSON, for the file.
    pub(crate) fn to_json(&self) -> String {
        serde_json::to_string_pretty(self).expect("the history serialises") + "\n"
    }
}

/// `Ok(None)`: no file.
fn read(path: &Path) -> Result<Option<History>, String> {
    let file = match std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NOFOLLOW | libc::O_NONBLOCK | libc::O_CLOEXEC)
        .open(path)
    {
        Ok(f) => f,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        Err(e) => return Err(e.to_string()),
    };
    let meta = file.metadata().map_err(|e| e.to_string())?;
    if !meta.is_file() {
        return Err(format!("a {}, not a regular file", crate::util::fsutil::kind_of(&meta)));
    }
    let bytes = match crate::util::fsutil::read_capped(&file, MAX_SIZE).map_err(|e| e.to_string())? {
        Ok(b) => b,
        Err(size) => return Err(format!("{size} bytes, over {MAX_SIZE}")),
    };
    let mut value: serde_json::Value = serde_json::from_slice(&bytes).map_err(|e| e.to_string())?;
    made_safe(&mut value);
    let mut h: History = serde_json::from_value(value).map_err(|e| e.to_string())?;
    h.last_failure_at = h.last_failure_at.filter(|t| a_time(*t));
    h.ready = h.ready.filter(|r| a_time(r.since));
    Ok(Some(h))
}

/// Every text made safe to show (one line, secrets masked, bounded), as
/// the warden makes its own.
fn made_safe(v: &mut serde_json::Value) {
    match v {
        serde_json::Value::String(s) => *s = super::safe(s),
        serde_json::Value::Array(a) => a.iter_mut().for_each(made_safe),
        serde_json::Value::Object(o) => o.values_mut().for_each(made_safe),
        _ => {}
    }
}

/// Seconds since the epoch that can be a time of this warden's past: after
/// the epoch, and not past a day from now.
fn a_time(t: f64) -> bool {
    let now = SystemTime::now().duration_since(SystemTime::UNIX_EPOCH).unwrap_or_default();
    t.is_finite() && t > 0.0 && t <= (now + Duration::from_secs(86_400)).as_secs_f64()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn failure() -> LastFailure {
        LastFailure { cause: "exit code 1".into(), class: crate::supervisor::outcome::FailureClass::Exit, report: None }
    }

    #[test]
    fn what_was_written_is_read_back() {
        let dir = tempfile::tempdir().unwrap();
        let h = History {
            last_exit: Some(LastExit { code: Some(1), signal: None, at: "2026-12-07T10:00:00Z".into() }),
            last_failure: Some(failure()),
            last_failure_at: Some(1.78e9),
            last_load: None,
            last_reload: None,
            ready: Some(ReadyRun { pid: 42, since: 1.78e9 }),
        };
        std::fs::write(dir.path().join(FILE), h.to_json()).unwrap();
        assert_eq!(History::read(dir.path()), h);
        assert_eq!(History::read(&dir.path().join("none")), History::default(), "no file: no past");
    }

    /// Written by someone else: a FIFO, a link, a huge file, a device, not
    /// JSON; control bytes in a text; a time that is none.
    #[test]
    fn a_history_written_by_someone_else_is_read_safely_or_not_at_all() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join(FILE);
        nix::unistd::mkfifo(&path, nix::sys::stat::Mode::from_bits_truncate(0o600)).unwrap();
        assert!(read(&path).unwrap_err().contains("not a regular file"), "a FIFO is not opened for ever");
        std::fs::remove_file(&path).unwrap();
        std::os::unix::fs::symlink("/dev/zero", &path).unwrap();
        assert!(read(&path).is_err(), "a link is not followed");
        std::fs::remove_file(&path).unwrap();
        std::fs::File::create(&path).unwrap().set_len(1 << 30).unwrap();
        assert!(read(&path).unwrap_err().contains("over"), "1 GiB is not read");
        std::fs::write(&path, "{not json").unwrap();
        assert_eq!(History::read(dir.path()), History::default());
        let evil = r#"{"last_failure": {"cause": "x\u001b[2J\nREADY=1", "class": "exit"}, "last_failure_at": 1e300}"#;
        std::fs::write(&path, evil).unwrap();
        let h = History::read(dir.path());
        let cause = h.last_failure.unwrap().cause;
        assert!(!cause.chars().any(char::is_control), "{cause:?}");
        assert_eq!(h.last_failure_at, None, "a time far in the future is none");
    }
}
