//! The backend's side of recovering by itself: what a start is made of
//! once its pre-start steps are done (the setup's fingerprint, memory fit's
//! values over the command line), the last-known-good setup and the
//! settings of a rollback. What to do when is the machine's
//! (`supervisor::fit`, `supervisor::machine`); the records on disk are
//! `tell::setups`.
//!
//! The last-known-good is kept in memory, never read back from the state
//! directory: that folder is the service user's, and the service user is
//! also who vLLM runs a model's remote code as, so a config read from it
//! could be anyone's command (and its `[[patch]]` anyone's file write). A
//! rollback starts only settings this warden parsed itself from the
//! operator's file and saw reach ready with good golden answers; a warden
//! just started (a boot, a restart, an upgrade in place) has none until a
//! setup does. Pins are read from the state directory, but as numbers that
//! `[fit]` bounds (`supervisor::fit::check_pin`).

use std::collections::BTreeMap;

use crate::config::{FitArg, Settings};
use crate::supervisor::fit::{Source, Used, VLLM_UTILIZATION};
use crate::supervisor::outcome::StartFailure;
use crate::tell::ledger::{Facts, Setup};

/// A setup that reached ready (with good golden answers, when asked) in
/// this warden's life: the settings it was started with, as this warden
/// read them from the operator's file.
#[derive(Debug, Clone)]
pub(crate) struct Good {
    pub(crate) fingerprint: String,
    /// When it reached ready (RFC 3339, UTC).
    pub(crate) at: String,
    pub(crate) settings: Settings,
    /// What the fingerprint is made of, to say what changed since.
    pub(crate) setup: Setup,
}

/// The setup a rollback start must be.
#[derive(Debug, Clone)]
pub(crate) struct Expect {
    pub(crate) fingerprint: String,
    pub(crate) setup: Setup,
}

/// What memory fit and a rollback ask of the next starts.
#[derive(Debug, Default)]
pub(crate) struct Recovery {
    /// Memory fit's values for the next starts (over the pinned ones).
    pub(crate) fit: BTreeMap<FitArg, String>,
    /// A rollback: the failed setup's patches, undone before the next
    /// start (once).
    pub(crate) revert: Option<Vec<crate::patch::Patch>>,
    /// A rollback: the setup the start must be.
    pub(crate) expect: Option<Expect>,
    /// The last-known-good setup: the newest that reached ready in this
    /// warden's life.
    pub(crate) good: Option<Good>,
    /// Pins whose start failed, per setup: not used again (their removal
    /// from the file goes on off the loop).
    pub(crate) dropped: BTreeMap<String, BTreeMap<FitArg, String>>,
}

/// A start, as its pre-start steps found it.
#[derive(Debug, Clone)]
pub(crate) struct Found {
    pub(crate) facts: Facts,
    /// The fit arguments the start uses, and where each comes from.
    pub(crate) used: Used,
    /// The command line with memory fit's values.
    pub(crate) argv: Vec<String>,
}

/// The values of the fit arguments for `command`: `fit` first, then the
/// setup's pins, then the command line, then vLLM's default.
pub(crate) fn used(command: &[String], fit: &BTreeMap<FitArg, String>, pinned: &BTreeMap<FitArg, String>) -> Used {
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
pub(crate) fn argv(command: &[String], used: &Used) -> Vec<String> {
    used.iter()
        .filter(|(_, (_, s))| matches!(s, Source::Fitted | Source::Pinned))
        .fold(command.to_vec(), |c, (a, (v, _))| crate::config::command::with_flag(&c, a.flag(), v))
}

/// The pins of setup `fingerprint` (`raw`, as the file has them) that a
/// start of `s` may use: each other one is named in a warning, with why.
/// `dropped`: the values whose start failed in this warden's life.
pub(crate) fn usable_pins(
    s: &Settings,
    fingerprint: &str,
    raw: &BTreeMap<String, String>,
    dropped: Option<&BTreeMap<FitArg, String>>,
) -> BTreeMap<FitArg, String> {
    let mut out = BTreeMap::new();
    for (name, value) in raw {
        let Some(arg) = FitArg::of_name(name) else {
            tracing::warn!(
                INSTANCE = s.name.as_str(),
                EVENT = "fit",
                MESSAGE_ID = crate::supervisor::events::FIT_MESSAGE_ID,
                "memory fit: the pin {name:?} of setup {fingerprint} is not used: not an argument memory fit sets"
            );
            continue;
        };
        if dropped.and_then(|d| d.get(&arg)) == Some(value) {
            continue;
        }
        let own = crate::config::command::vllm_flag(&s.child.command, arg.flag());
        match crate::supervisor::fit::check_pin(arg, value, own.as_deref(), &s.fit) {
            Ok(()) => {
                out.insert(arg, value.clone());
            }
            Err(why) => tracing::warn!(
                INSTANCE = s.name.as_str(),
                EVENT = "fit",
                MESSAGE_ID = crate::supervisor::events::FIT_MESSAGE_ID,
                "memory fit: the pin {} {value:?} of setup {fingerprint} is not used: {why}",
                arg.flag()
            ),
        }
    }
    out
}

/// What the start of `s` is, off the loop: its facts and memory fit's
/// values (`fit`, then the usable pins). A rollback start whose setup is
/// not the one expected (`expect`) fails here, saying what differs.
pub(crate) fn find(
    s: &Settings,
    fit: &BTreeMap<FitArg, String>,
    expect: Option<&Expect>,
    dropped: &BTreeMap<String, BTreeMap<FitArg, String>>,
) -> Result<Found, StartFailure> {
    let facts = crate::daemon::environment::load_facts(s);
    if let Some(want) = expect
        && want.fingerprint != facts.fingerprint
    {
        let now = serde_json::to_value(&facts.setup).unwrap_or_default();
        let was = serde_json::to_value(&want.setup).unwrap_or_default();
        let what = crate::observe::golden::setup_changes(&was, &now).join("; ");
        let venv = if want.setup.vllm != facts.setup.vllm {
            " (the command's vLLM changed in place: side-by-side venvs make vLLM upgrades roll back)"
        } else {
            ""
        };
        return Err(StartFailure::permanent(format!(
            "the last-known-good setup {} cannot be started as it was: {what}{venv}",
            want.fingerprint
        )));
    }
    let raw = crate::tell::setups::pins(&s.state_dir, &facts.fingerprint);
    let pinned = usable_pins(s, &facts.fingerprint, &raw, dropped.get(&facts.fingerprint));
    let used = used(&s.child.command, fit, &pinned);
    let argv = argv(&s.child.command, &used);
    Ok(Found { facts, used, argv })
}

/// Memory fit moves an argument only while no other process holds GPU
/// memory: the holders are named, and the start fails, otherwise. Without
/// the GPU query (no `nvidia-smi`), nothing is known to hold any.
pub(crate) async fn gpus_free(s: &Settings, fit: &BTreeMap<FitArg, String>) -> Result<(), StartFailure> {
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

/// The settings of a rollback to `good`, for the warden now running
/// `current`: the good setup's own, as this warden read them. Held to the
/// instance all the same (a reload cannot change it).
pub(crate) fn rollback_settings(current: &Settings, good: &Good) -> Result<Settings, String> {
    let s = &good.settings;
    if s.name != current.name || s.state_dir != current.state_dir {
        return Err(format!("it was instance {:?}'s, not {:?}", s.name, current.name));
    }
    Ok(s.clone())
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

    fn settings(d: &std::path::Path, text: &str) -> Settings {
        let dirs = crate::config::Dirs { state: Some(d.join("state")), ..Default::default() };
        crate::config::parse(text, &d.join("m.toml"), &dirs).unwrap()
    }

    #[test]
    fn pins_are_used_only_as_fit_allows_and_not_after_their_start_failed() {
        let d = tempfile::tempdir().unwrap();
        let on =
            "name = \"m\"\n[child]\ncommand = [\"vllm\", \"--max-model-len\", \"100000\"]\n[fit]\nenabled = true\n";
        let s = settings(d.path(), on);
        let raw = BTreeMap::from([
            ("max-model-len".to_string(), "69632".to_string()),
            ("gpu-memory-utilization".to_string(), "0.01".to_string()),
            ("trust-remote-code".to_string(), "1".to_string()),
        ]);
        let got = usable_pins(&s, "00000000000000aa", &raw, None);
        assert_eq!(got, BTreeMap::from([(FitArg::MaxModelLen, "69632".to_string())]));
        let dropped = BTreeMap::from([(FitArg::MaxModelLen, "69632".to_string())]);
        assert!(usable_pins(&s, "00000000000000aa", &raw, Some(&dropped)).is_empty());
        let off = settings(d.path(), &on.replace("enabled = true", "enabled = false"));
        assert!(usable_pins(&off, "00000000000000aa", &raw, None).is_empty());
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
        let s = settings(d.path(), &text);
        let (none, no_drops) = (BTreeMap::new(), BTreeMap::new());
        let before = find(&s, &none, None, &no_drops).unwrap();
        let expect = Expect { fingerprint: before.facts.fingerprint.clone(), setup: before.facts.setup.clone() };
        assert!(find(&s, &none, Some(&expect), &no_drops).is_ok(), "as it was: it starts");
        // The venv upgraded where it stands.
        std::fs::rename(site.join("vllm-0.31.0.dist-info"), site.join("vllm-0.32.0.dist-info")).unwrap();
        let err = find(&s, &none, Some(&expect), &no_drops).unwrap_err();
        assert!(err.permanent);
        assert!(err.cause.contains("vllm: vllm 0.31.0 → vllm 0.32.0"), "{}", err.cause);
        assert!(err.cause.ends_with("side-by-side venvs make vLLM upgrades roll back)"), "{}", err.cause);
    }

    #[test]
    fn a_good_setup_of_another_instance_is_not_rolled_back_to() {
        let d = tempfile::tempdir().unwrap();
        let s = settings(d.path(), "name = \"m\"\n[child]\ncommand = [\"vllm\"]\n");
        let facts = crate::tell::ledger::Facts::gather(&["vllm".into()], &BTreeMap::new(), &[], None);
        let mut good =
            Good { fingerprint: facts.fingerprint.clone(), at: "2026".into(), settings: s.clone(), setup: facts.setup };
        assert!(rollback_settings(&s, &good).is_ok());
        good.settings = settings(d.path(), "name = \"other\"\n[child]\ncommand = [\"vllm\"]\n");
        assert!(rollback_settings(&s, &good).unwrap_err().contains("instance \"other\"'s"));
    }
}
