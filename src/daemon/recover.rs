//! The backend's side of recovering by itself: what a start is made of
//! once its pre-start steps are done (the setup's fingerprint, memory fit's
//! values over the command line, the last-known-good setup), and the
//! settings of a rollback. What to do when is the machine's
//! (`supervisor::fit`, `supervisor::machine`); the records are
//! `observe::setups`.

use std::collections::BTreeMap;

use crate::config::{FitArg, Settings};
use crate::observe::ledger::Facts;
use crate::observe::setups::{self, SetupRecord};
use crate::supervisor::fit::{Source, Used, VLLM_UTILIZATION};
use crate::supervisor::outcome::StartFailure;

/// What memory fit and a rollback ask of the next starts.
#[derive(Debug, Default)]
pub struct Recovery {
    /// Memory fit's values for the next starts (over the pinned ones).
    pub fit: BTreeMap<FitArg, String>,
    /// A rollback: the failed setup's patches, undone before the next
    /// start (once).
    pub revert: Option<Vec<crate::patch::Patch>>,
    /// A rollback: the fingerprint the start must have.
    pub expect: Option<String>,
    /// The last-known-good setup as the last start found it.
    pub last_good: Option<SetupRecord>,
}

/// A start, as its pre-start steps found it.
#[derive(Debug, Clone)]
pub struct Found {
    pub facts: Facts,
    /// The fit arguments the start uses, and where each comes from.
    pub used: Used,
    /// The command line with memory fit's values.
    pub argv: Vec<String>,
    /// The last-known-good setup.
    pub last_good: Option<SetupRecord>,
}

/// The values of the fit arguments for `command`: `fit` first, then the
/// setup's pins, then the command line, then vLLM's default.
pub fn used(command: &[String], fit: &BTreeMap<FitArg, String>, pinned: &BTreeMap<FitArg, String>) -> Used {
    let mut out = Used::new();
    for arg in FitArg::ALL {
        let v = if let Some(v) = fit.get(&arg) {
            Some((v.clone(), Source::Fitted))
        } else if let Some(v) = pinned.get(&arg) {
            Some((v.clone(), Source::Pinned))
        } else if let Some(v) = crate::config::command::vllm_flag(command, arg.flag()) {
            Some((v, Source::Config))
        } else {
            (arg == FitArg::GpuMemoryUtilization).then(|| (VLLM_UTILIZATION.to_string(), Source::Default))
        };
        if let Some(v) = v {
            out.insert(arg, v);
        }
    }
    out
}

/// `command` with the fitted and pinned values of `used` set.
pub fn argv(command: &[String], used: &Used) -> Vec<String> {
    used.iter()
        .filter(|(_, (_, s))| matches!(s, Source::Fitted | Source::Pinned))
        .fold(command.to_vec(), |c, (a, (v, _))| crate::config::command::with_flag(&c, a.flag(), v))
}

/// What the start of `s` is, off the loop: its facts, pins and the
/// last-known-good setup. A rollback start whose setup is not the one
/// recorded (`expect`) fails here, saying what differs.
pub fn find(s: &Settings, fit: &BTreeMap<FitArg, String>, expect: Option<&str>) -> Result<Found, StartFailure> {
    let facts = crate::daemon::environment::load_facts(s);
    let last_good = setups::last_good(&s.state_dir);
    if let Some(fp) = expect
        && fp != facts.fingerprint
    {
        // The record, read once: what differs, and whether vLLM itself did.
        let was = setups::find(&s.state_dir, fp).ok().map(|r| r.setup);
        let now = serde_json::to_value(&facts.setup).unwrap_or_default();
        let what = was.as_ref().map_or_else(
            || "its record is gone".to_string(),
            |w| crate::observe::ledger::setup_changes(&serde_json::to_value(w).unwrap_or_default(), &now).join("; "),
        );
        let venv = if was.is_some_and(|w| w.vllm != facts.setup.vllm) {
            " (the command's vLLM changed in place: side-by-side venvs make vLLM upgrades roll back)"
        } else {
            ""
        };
        return Err(StartFailure::permanent(format!(
            "the last-known-good setup {fp} cannot be started as it was: {what}{venv}"
        )));
    }
    let pinned = setups::pins(&s.state_dir, &facts.fingerprint);
    let used = used(&s.child.command, fit, &pinned);
    let argv = argv(&s.child.command, &used);
    Ok(Found { facts, used, argv, last_good })
}

/// Memory fit moves an argument only while no other process holds GPU
/// memory: the holders are named, and the start fails, otherwise. Without
/// the GPU query (no `nvidia-smi`), nothing is known to hold any.
pub async fn gpus_free(s: &Settings, fit: &BTreeMap<FitArg, String>) -> Result<(), StartFailure> {
    use crate::process::prestart::{QueryError, describe_gpu_apps, query_gpus};
    if fit.is_empty() || s.prestart.gpu_query.is_empty() {
        return Ok(());
    }
    let args: Vec<String> = fit.iter().map(|(a, v)| format!("{} {v}", a.flag())).collect();
    match query_gpus(&s.prestart.gpu_query, crate::supervisor::policy::COMMAND_TIMEOUT).await {
        Ok(Some(apps)) if !apps.is_empty() => Err(StartFailure::permanent(format!(
            "memory fit does not start with {} while other processes hold GPU memory: {}",
            args.join(", "),
            describe_gpu_apps(&apps)
        ))),
        Ok(_) => Ok(()),
        Err(QueryError::TimedOut(why) | QueryError::Failed(why)) => {
            tracing::warn!(EVENT = "fit", "cannot tell whether other processes hold GPU memory: {why}");
            Ok(())
        }
    }
}

/// The settings of the last-known-good setup `good`, for the warden now
/// running `current`: its recorded config text, read again. The record
/// lives in the state directory; a record that names another instance is
/// refused.
pub fn rollback_settings(
    current: &Settings,
    good: &SetupRecord,
    dirs: &crate::config::Dirs,
) -> Result<Settings, String> {
    let s = crate::config::parse(&good.config, &current.source, dirs).map_err(|p| {
        let first = p.0.first().map(ToString::to_string).unwrap_or_default();
        format!("its recorded config no longer reads: {first}")
    })?;
    if s.name != current.name || s.state_dir != current.state_dir {
        return Err(format!("its record names instance {:?}, not {:?}", s.name, current.name));
    }
    Ok(s)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn v(s: &[&str]) -> Vec<String> {
        s.iter().map(|x| x.to_string()).collect()
    }

    #[test]
    fn fitted_beats_pinned_beats_the_command_line_beats_the_default() {
        let cmd = v(&["vllm", "serve", "m", "--max-model-len", "1500000"]);
        let none = BTreeMap::new();
        let u = used(&cmd, &none, &none);
        assert_eq!(u[&FitArg::MaxModelLen], ("1500000".into(), Source::Config));
        assert_eq!(u[&FitArg::GpuMemoryUtilization], ("0.9".into(), Source::Default));
        assert_eq!(argv(&cmd, &u), cmd, "nothing fitted: the command as it is");
        let pinned = BTreeMap::from([(FitArg::MaxModelLen, "1047552".to_string())]);
        let u = used(&cmd, &none, &pinned);
        assert_eq!(argv(&cmd, &u), v(&["vllm", "serve", "m", "--max-model-len", "1047552"]));
        let fit = BTreeMap::from([(FitArg::GpuMemoryUtilization, "0.92".to_string())]);
        let u = used(&cmd, &fit, &pinned);
        assert_eq!(u[&FitArg::GpuMemoryUtilization].1, Source::Fitted);
        assert_eq!(
            argv(&cmd, &u),
            v(&["vllm", "serve", "m", "--max-model-len", "1047552", "--gpu-memory-utilization", "0.92"])
        );
    }

    #[test]
    fn a_last_known_good_whose_vllm_changed_in_place_is_refused_saying_so() {
        let d = tempfile::tempdir().unwrap();
        let venv = d.path().join("venv");
        std::fs::create_dir_all(venv.join("bin")).unwrap();
        std::fs::write(venv.join("bin/vllm"), "#!/bin/sh\n").unwrap();
        let site = venv.join("lib/python3.11/site-packages");
        std::fs::create_dir_all(site.join("vllm-0.31.0.dist-info")).unwrap();
        let text =
            format!("name = \"m\"\n[child]\ncommand = [\"{}\", \"serve\", \"m\"]\n", venv.join("bin/vllm").display());
        let dirs = crate::config::Dirs { state: Some(d.path().join("state")), ..Default::default() };
        let s = crate::config::parse(&text, &d.path().join("m.toml"), &dirs).unwrap();
        let before = find(&s, &BTreeMap::new(), None).unwrap();
        setups::record_good(&s.state_dir, &setups::good_now(&s, &before.facts), 5).unwrap();
        assert!(find(&s, &BTreeMap::new(), Some(&before.facts.fingerprint)).is_ok(), "as it was: it starts");
        // The venv upgraded where it stands.
        std::fs::rename(site.join("vllm-0.31.0.dist-info"), site.join("vllm-0.32.0.dist-info")).unwrap();
        let err = find(&s, &BTreeMap::new(), Some(&before.facts.fingerprint)).unwrap_err();
        assert!(err.permanent);
        assert!(err.cause.contains("vllm: vllm 0.31.0 → vllm 0.32.0"), "{}", err.cause);
        assert!(err.cause.ends_with("side-by-side venvs make vLLM upgrades roll back)"), "{}", err.cause);
    }

    #[test]
    fn a_record_of_another_instance_is_not_rolled_back_to() {
        let d = tempfile::tempdir().unwrap();
        let dirs = crate::config::Dirs { state: Some(d.path().join("state")), ..Default::default() };
        let s = crate::config::parse("name = \"m\"\n[child]\ncommand = [\"vllm\"]\n", &d.path().join("m.toml"), &dirs)
            .unwrap();
        let mut good =
            setups::good_now(&s, &crate::observe::ledger::Facts::gather(&["vllm".into()], &BTreeMap::new(), &[], None));
        assert!(rollback_settings(&s, &good, &dirs).is_ok());
        good.config = "name = \"other\"\n[child]\ncommand = [\"vllm\"]\n".into();
        assert!(rollback_settings(&s, &good, &dirs).unwrap_err().contains("instance \"other\""));
        good.config = "[child\n".into();
        assert!(rollback_settings(&s, &good, &dirs).unwrap_err().starts_with("its recorded config no longer reads"));
    }
}
