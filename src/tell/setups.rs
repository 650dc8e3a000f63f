//! What the state directory keeps of setups: each setup that reached ready
//! (`setups/<fingerprint>.json`: the config file's text, the command line
//! and environment masked, the patched files' sha256, when), to show and
//! compare (`vllm-warden setups`); and memory fit's pinned values
//! (`fit-pins.json`: per setup fingerprint, the arguments that fitted).
//!
//! The state directory is the service user's — the user vLLM runs a
//! model's remote code as — and a file in it may have been written by
//! someone else. So a record here is never a command: a rollback starts
//! only a config this warden read itself from the operator's file
//! (`daemon::recover::Good`, kept in memory), and a pin is a number that
//! `supervisor::fit::check_pin` holds to `[fit]` before it is used. Every
//! name used here is derived (a fingerprint of 16 hex digits), what is read
//! has a size cap, a record whose fingerprint is not its name, or whose
//! config names another instance, is not read.

use std::collections::BTreeMap;
use std::ffi::OsString;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use crate::config::FitArg;
use crate::util::fsutil::{Dir, read_capped};

const SETUPS: &str = "setups";
const PINS: &str = "fit-pins.json";
/// Far above any config file and its setup.
const RECORD_MAX: u64 = 4 << 20;
/// The pins of many setups.
const PINS_MAX: u64 = 1 << 20;
/// Setups pinned at most (the oldest go first).
const PINS_KEEP: usize = 200;

/// A setup that reached ready.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub(crate) struct SetupRecord {
    pub(crate) fingerprint: String,
    /// When it reached ready last (RFC 3339, UTC).
    pub(crate) at: String,
    /// The config file, and its text as the warden ran it.
    pub(crate) config_file: PathBuf,
    pub(crate) config: String,
    /// vLLM's version, the command line and `child.env` (masked), the
    /// patched files' sha256.
    pub(crate) setup: crate::tell::ledger::Setup,
}

/// A fingerprint as the warden makes them: 16 lowercase hex digits.
pub fn valid_fingerprint(fp: &str) -> bool {
    fp.len() == 16 && fp.bytes().all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b))
}

fn now_rfc3339() -> String {
    humantime::format_rfc3339_seconds(std::time::SystemTime::now()).to_string()
}

fn read_json<T: for<'de> Deserialize<'de>>(dir: &Dir, name: &str, max: u64) -> Option<T> {
    let (file, _) = dir.open_regular(std::ffi::OsStr::new(name), true).ok()?;
    let bytes = read_capped(&file, max).ok()?.ok()?;
    serde_json::from_slice(&bytes).ok()
}

fn state(state_dir: &Path, create: bool) -> std::io::Result<Dir> {
    if create {
        std::fs::create_dir_all(state_dir)?;
    }
    Dir::open(state_dir)
}

fn setups_dir(state_dir: &Path, create: bool) -> std::io::Result<Dir> {
    state(state_dir, create)?.child_dir(std::ffi::OsStr::new(SETUPS), create.then_some(0o700))
}

/// Keep `record` as a setup that reached ready, and at most `keep` setups.
pub(crate) fn record_good(state_dir: &Path, record: &SetupRecord, keep: u32) -> std::io::Result<()> {
    if !valid_fingerprint(&record.fingerprint) {
        return Err(std::io::Error::other(format!("{:?} is not a setup fingerprint", record.fingerprint)));
    }
    let dir = setups_dir(state_dir, true)?;
    let bytes = serde_json::to_vec_pretty(record).map_err(std::io::Error::other)?;
    // The config may name secrets: the service user's only.
    dir.write_atomic(&OsString::from(format!("{}.json", record.fingerprint)), &bytes, 0o600, None)?;
    let all = list_in(&dir);
    for old in all.iter().skip(keep.max(1) as usize) {
        let _ = dir.remove(&OsString::from(format!("{}.json", old.fingerprint)));
    }
    Ok(())
}

/// A record of this warden's making, for a good setup now.
pub(crate) fn good_now(s: &crate::config::Settings, facts: &crate::tell::ledger::Facts) -> SetupRecord {
    SetupRecord {
        fingerprint: facts.fingerprint.clone(),
        at: now_rfc3339(),
        config_file: s.source.clone(),
        config: s.text.clone(),
        setup: facts.setup.clone(),
    }
}

/// The instance `r`'s config names; none when its text does not read.
fn instance_of(r: &SetupRecord) -> Option<String> {
    crate::config::instance_in(&r.config, &r.config_file)
}

fn list_in(dir: &Dir) -> Vec<SetupRecord> {
    let Ok(entries) = std::fs::read_dir(dir.path()) else { return Vec::new() };
    let mut out: Vec<SetupRecord> = entries
        .filter_map(|e| e.ok()?.file_name().into_string().ok())
        .filter_map(|name| {
            let fp = name.strip_suffix(".json")?;
            if !valid_fingerprint(fp) {
                return None;
            }
            let r: SetupRecord = read_json(dir, &name, RECORD_MAX)?;
            (r.fingerprint == fp).then_some(r)
        })
        .collect();
    // Newest first; RFC 3339 in UTC sorts as time does.
    out.sort_by(|a, b| b.at.cmp(&a.at).then_with(|| a.fingerprint.cmp(&b.fingerprint)));
    out
}

/// Every setup of instance `instance` that reached ready, newest first: a
/// record whose config names another instance (or does not read) is
/// skipped.
pub(crate) fn list(state_dir: &Path, instance: &str) -> Vec<SetupRecord> {
    let all = setups_dir(state_dir, false).map(|d| list_in(&d)).unwrap_or_default();
    all.into_iter().filter(|r| instance_of(r).as_deref() == Some(instance)).collect()
}

/// The setup `id` of instance `instance` (a fingerprint, or a unique
/// beginning of one).
pub(crate) fn find(state_dir: &Path, instance: &str, id: &str) -> Result<SetupRecord, String> {
    let all = list(state_dir, instance);
    let hits: Vec<&SetupRecord> = all.iter().filter(|r| r.fingerprint.starts_with(id) && !id.is_empty()).collect();
    match hits.as_slice() {
        [one] => Ok((*one).clone()),
        [] => Err(format!("no recorded setup {id:?}")),
        _ => Err(format!("{id:?} names {} setups; give more of the fingerprint", hits.len())),
    }
}

type Pins = BTreeMap<String, BTreeMap<String, String>>;

/// A pin's name or value longer than this is not one the warden wrote.
const PIN_TEXT_MAX: usize = 64;

/// The values pinned for setup `fingerprint`, as the file has them
/// (argument name → value): data, for `supervisor::fit::check_pin` to
/// judge before a start uses any. A pins file that is not the pins' JSON is
/// none, said once per read.
pub(crate) fn pins(state_dir: &Path, fingerprint: &str) -> BTreeMap<String, String> {
    let Ok(dir) = state(state_dir, false) else { return BTreeMap::new() };
    let all: Pins = match read_pins(&dir) {
        Ok(all) => all,
        Err(why) => {
            tracing::warn!(EVENT = "fit", "{}: {why}: no pinned value is used", state_dir.join(PINS).display());
            return BTreeMap::new();
        }
    };
    all.get(fingerprint)
        .into_iter()
        .flatten()
        .map(|(k, v)| (crate::util::escape::one_line(k, PIN_TEXT_MAX), crate::util::escape::one_line(v, PIN_TEXT_MAX)))
        .collect()
}

/// The pins file: none when there is none.
fn read_pins(dir: &Dir) -> Result<Pins, String> {
    let file = match dir.open_regular(std::ffi::OsStr::new(PINS), true) {
        Ok((file, _)) => file,
        Err(e) if e.io_error().is_some_and(|e| e.kind() == std::io::ErrorKind::NotFound) => return Ok(Pins::new()),
        Err(e) => return Err(e.to_string()),
    };
    let bytes = read_capped(&file, PINS_MAX).map_err(|e| e.to_string())?.map_err(|_| "too large".to_string())?;
    serde_json::from_slice(&bytes).map_err(|e| format!("not memory fit's pins ({e})"))
}

/// Drop the pins of setup `fingerprint` that still have the values of
/// `values` (a start with them failed).
pub(crate) fn unpin(state_dir: &Path, fingerprint: &str, values: &BTreeMap<FitArg, String>) -> std::io::Result<()> {
    let dir = state(state_dir, false)?;
    let mut all: Pins = read_pins(&dir).unwrap_or_default();
    let Some(entry) = all.get_mut(fingerprint) else { return Ok(()) };
    let before = entry.len();
    entry.retain(|k, v| FitArg::of_name(k).and_then(|a| values.get(&a)) != Some(v));
    if entry.len() == before {
        return Ok(());
    }
    if entry.is_empty() {
        all.remove(fingerprint);
    }
    all.retain(|k, _| valid_fingerprint(k));
    let bytes = serde_json::to_vec_pretty(&all).map_err(std::io::Error::other)?;
    dir.write_atomic(std::ffi::OsStr::new(PINS), &bytes, 0o600, None)
}

/// Pin `values` for setup `fingerprint` (over what it had).
pub(crate) fn pin(state_dir: &Path, fingerprint: &str, values: &BTreeMap<FitArg, String>) -> std::io::Result<()> {
    if !valid_fingerprint(fingerprint) {
        return Err(std::io::Error::other(format!("{fingerprint:?} is not a setup fingerprint")));
    }
    let dir = state(state_dir, true)?;
    let mut all: Pins = read_pins(&dir).unwrap_or_default();
    all.retain(|k, _| valid_fingerprint(k));
    let entry = all.entry(fingerprint.to_string()).or_default();
    for (a, v) in values {
        entry.insert(a.name().to_string(), v.clone());
    }
    while all.len() > PINS_KEEP {
        let Some(k) = all.keys().find(|k| k.as_str() != fingerprint).cloned() else { break };
        all.remove(&k);
    }
    let bytes = serde_json::to_vec_pretty(&all).map_err(std::io::Error::other)?;
    dir.write_atomic(std::ffi::OsStr::new(PINS), &bytes, 0o600, None)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rec(fp: &str, at: &str) -> SetupRecord {
        SetupRecord {
            fingerprint: fp.into(),
            at: at.into(),
            config_file: "/etc/vllm-warden/m.toml".into(),
            config: "name = \"m\"\n".into(),
            setup: crate::tell::ledger::Setup {
                vllm: Some("0.32.0".into()),
                command: "vllm serve m".into(),
                env: BTreeMap::new(),
                patched: BTreeMap::new(),
                preload: None,
            },
        }
    }

    #[test]
    fn the_newest_good_setup_is_first_and_only_keep_are_kept() {
        let d = tempfile::tempdir().unwrap();
        let newest = |d: &Path| list(d, "m").into_iter().next().unwrap().fingerprint;
        record_good(d.path(), &rec("00000000000000aa", "2026-01-01T00:00:00Z"), 2).unwrap();
        record_good(d.path(), &rec("00000000000000bb", "2026-01-02T00:00:00Z"), 2).unwrap();
        assert_eq!(newest(d.path()), "00000000000000bb");
        record_good(d.path(), &rec("00000000000000aa", "2026-01-03T00:00:00Z"), 2).unwrap();
        assert_eq!(newest(d.path()), "00000000000000aa");
        record_good(d.path(), &rec("00000000000000cc", "2026-01-04T00:00:00Z"), 2).unwrap();
        let fps: Vec<String> = list(d.path(), "m").into_iter().map(|r| r.fingerprint).collect();
        assert_eq!(fps, ["00000000000000cc", "00000000000000aa"]);
        assert_eq!(find(d.path(), "m", "00000000000000c").unwrap().fingerprint, "00000000000000cc");
        assert!(find(d.path(), "m", "0000").is_err(), "two setups begin so");
        // Not a fingerprint: never a file name.
        assert!(record_good(d.path(), &rec("../../x", "2026"), 5).is_err());
    }

    #[test]
    fn a_record_whose_name_is_not_its_fingerprint_or_of_another_instance_is_not_read() {
        let d = tempfile::tempdir().unwrap();
        record_good(d.path(), &rec("00000000000000aa", "2026-01-01T00:00:00Z"), 5).unwrap();
        let forged = serde_json::to_vec(&rec("00000000000000ff", "2099-01-01T00:00:00Z")).unwrap();
        std::fs::write(d.path().join("setups/00000000000000ee.json"), forged).unwrap();
        // Newer, and named as it should be, but of another instance; and
        // one whose config does not read.
        let mut other = rec("00000000000000dd", "2099-01-01T00:00:00Z");
        other.config = "name = \"other\"\n".into();
        std::fs::write(d.path().join("setups/00000000000000dd.json"), serde_json::to_vec(&other).unwrap()).unwrap();
        let mut broken = rec("00000000000000cc", "2099-01-01T00:00:00Z");
        broken.config = "[child\n".into();
        std::fs::write(d.path().join("setups/00000000000000cc.json"), serde_json::to_vec(&broken).unwrap()).unwrap();
        let fps: Vec<String> = list(d.path(), "m").into_iter().map(|r| r.fingerprint).collect();
        assert_eq!(fps, ["00000000000000aa"]);
        assert_eq!(list(d.path(), "other")[0].fingerprint, "00000000000000dd");
        // Without `name`, the config file's stem names the instance.
        let mut unnamed = rec("00000000000000bb", "2026-01-02T00:00:00Z");
        unnamed.config = "[child]\n".into();
        record_good(d.path(), &unnamed, 5).unwrap();
        assert_eq!(list(d.path(), "m")[0].fingerprint, "00000000000000bb");
    }

    #[test]
    fn pins_are_per_setup_read_as_written_and_dropped_by_value() {
        let d = tempfile::tempdir().unwrap();
        let v = BTreeMap::from([(FitArg::MaxModelLen, "1047552".to_string())]);
        pin(d.path(), "00000000000000aa", &v).unwrap();
        assert_eq!(pins(d.path(), "00000000000000aa"), BTreeMap::from([("max-model-len".into(), "1047552".into())]));
        assert!(pins(d.path(), "00000000000000bb").is_empty());
        // Another value than the one that failed stays.
        unpin(d.path(), "00000000000000aa", &BTreeMap::from([(FitArg::MaxModelLen, "1".to_string())])).unwrap();
        assert_eq!(pins(d.path(), "00000000000000aa").len(), 1);
        unpin(d.path(), "00000000000000aa", &v).unwrap();
        assert!(pins(d.path(), "00000000000000aa").is_empty());
        // What the file says, one visible line each: judged by the caller.
        std::fs::write(
            d.path().join(PINS),
            r#"{"00000000000000aa": {"max-model-len": "1\n--trust-remote-code", "gpu-memory-utilization": "0.92"}}"#,
        )
        .unwrap();
        let got = pins(d.path(), "00000000000000aa");
        assert_eq!(got["max-model-len"], "1\\n--trust-remote-code");
        assert_eq!(got["gpu-memory-utilization"], "0.92");
        std::fs::write(d.path().join(PINS), "not json").unwrap();
        assert!(pins(d.path(), "00000000000000aa").is_empty());
    }
}
