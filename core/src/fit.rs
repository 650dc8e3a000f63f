//! Memory fit: which way one of vLLM's memory-fit errors asks an argument
//! to move, and how far, within the bounds of `[fit]`. vLLM's two memory
//! errors of the KV cache need opposite fixes: a cache too small for one
//! request of `--max-model-len` is fixed by a shorter length (vLLM prints
//! the longest that fits), no memory left for the cache at all by a larger
//! `--gpu-memory-utilization`; running out of memory while the weights load
//! by a smaller one. Pure: the error comes parsed by the classifier, the
//! values a start used come from the backend, and whether the GPUs are
//! free is checked before the next start.

use std::collections::BTreeMap;

use serde::Serialize;

use crate::policy::{Fit, FitArg};

/// vLLM's `--gpu-memory-utilization` when its command sets none.
pub const VLLM_UTILIZATION: &str = "0.9";

/// One of vLLM's memory-fit errors.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Problem {
    /// The KV cache cannot hold one request of `max_model_len` tokens;
    /// vLLM's estimate of the longest that fits.
    KvCacheTooSmall { max_model_len: u64, estimate: Option<u64> },
    /// No memory is left for the KV cache at all.
    NoCacheMemory,
    /// Out of memory (while the weights load: the machine checks the phase).
    OutOfMemory,
}

impl Problem {
    pub(crate) fn text(&self) -> String {
        match self {
            Problem::KvCacheTooSmall { max_model_len, estimate: Some(e) } => {
                format!("the KV cache cannot hold one request of {max_model_len} tokens (vLLM estimates {e} fit)")
            }
            Problem::KvCacheTooSmall { max_model_len, estimate: None } => {
                format!("the KV cache cannot hold one request of {max_model_len} tokens")
            }
            Problem::NoCacheMemory => "no memory is left for the KV cache".into(),
            Problem::OutOfMemory => "out of memory while the weights load".into(),
        }
    }
}

/// Where a value a start used came from.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, strum::IntoStaticStr)]
#[serde(rename_all = "kebab-case")]
#[strum(serialize_all = "kebab-case")]
pub enum Source {
    /// The command line as configured.
    Config,
    /// Not on the command line: vLLM's default.
    Default,
    /// Fitted at an earlier start of this setup, and pinned when it
    /// reached ready.
    Pinned,
    /// Fitted after the last failure.
    Fitted,
}

impl Source {
    pub fn as_str(self) -> &'static str {
        self.into()
    }
}

/// The value of each fit argument a start used, and where it came from.
pub type Used = BTreeMap<FitArg, (String, Source)>;

/// The arguments of `used` set by memory fit (pinned or fitted), as
/// `--flag value` words: what `STATUS=` and the journal show.
pub(crate) fn shown(used: &Used) -> Option<String> {
    let words: Vec<String> = used
        .iter()
        .filter(|(_, (_, s))| matches!(s, Source::Pinned | Source::Fitted))
        .map(|(a, (v, s))| format!("{} {v} ({})", a.flag(), s.as_str()))
        .collect();
    (!words.is_empty()).then(|| words.join(", "))
}

/// Memory fit as the machine keeps it.
#[derive(Debug, Clone, Default)]
pub(crate) struct FitState {
    /// Set after failures, for the next starts (pinned once one reaches
    /// ready; dropped by a reload).
    pub(crate) set: BTreeMap<FitArg, String>,
    /// Adjustments since the last ready or reload.
    pub(crate) moves: u32,
    /// The memory-fit error the current run logged.
    pub(crate) problem: Option<Problem>,
    /// What the current (or last) run used.
    pub(crate) used: Used,
}

/// What memory fit does after a failure.
#[derive(Debug, Clone, PartialEq)]
pub(crate) enum Move {
    /// Start again with `arg` set to `to` (it was `from`).
    Set { arg: FitArg, from: String, to: String, why: String },
    /// Nothing within the bounds fits: give up, and why.
    Refuse(String),
}

/// Whether a pinned `value` of `arg` may be used under `fit`, for a command
/// whose own value of the flag is `own`: why not, else nothing. A pin is
/// data from the state directory, which someone else may have written: it
/// moves only what `[fit]` lets memory fit move, as far as memory fit
/// could have moved it — with `fit.enabled`, an argument of `fit.adjust`,
/// a `--max-model-len` within `fit.min-model-len`, its multiple and the
/// command's own length (memory fit only shortens it), a
/// `--gpu-memory-utilization` within `fit.min-utilization` and
/// `fit.max-utilization` (memory fit moves it both ways between them).
pub fn check_pin(arg: FitArg, value: &str, own: Option<&str>, fit: &Fit) -> Result<(), String> {
    if !fit.enabled {
        return Err("`fit.enabled` is off".into());
    }
    if !fit.adjust.contains(&arg) {
        return Err(format!("`fit.adjust` does not allow {}", arg.flag()));
    }
    match arg {
        FitArg::MaxModelLen => {
            let whole = |v: &str| {
                (!v.is_empty() && v.len() <= 19 && v.bytes().all(|b| b.is_ascii_digit()))
                    .then(|| v.parse::<u64>().ok())
                    .flatten()
            };
            let Some(n) = whole(value) else { return Err("not a whole number".into()) };
            if n < fit.min_model_len {
                return Err(format!("below `fit.min-model-len` {}", fit.min_model_len));
            }
            if n % fit.model_len_multiple.max(1) != 0 {
                return Err(format!("not a multiple of `fit.model-len-multiple` {}", fit.model_len_multiple));
            }
            match own {
                None => Ok(()),
                Some(o) => match whole(o) {
                    Some(o) if n <= o => Ok(()),
                    Some(o) => Err(format!("longer than the command's own {} {o}", arg.flag())),
                    None => Err(format!("the command's own {} {o:?} is not a number to compare it with", arg.flag())),
                },
            }
        }
        FitArg::GpuMemoryUtilization => {
            // Digits and one point: no exponent, no `inf`, no sign.
            let plain = !value.is_empty()
                && value.len() <= 20
                && value.bytes().all(|b| b.is_ascii_digit() || b == b'.')
                && value.bytes().filter(|b| *b == b'.').count() <= 1
                && value.bytes().any(|b| b.is_ascii_digit());
            let Some(x) = plain.then(|| value.parse::<f64>().ok()).flatten() else {
                return Err("not a fraction".into());
            };
            // A hair of rounding is not past the bound.
            if x < fit.min_utilization - 1e-9 || x > fit.max_utilization + 1e-9 {
                return Err(format!(
                    "outside `fit.min-utilization` {} .. `fit.max-utilization` {}",
                    fit.min_utilization, fit.max_utilization
                ));
            }
            Ok(())
        }
    }
}

/// A utilization as vLLM reads it: at most three decimals, no trailing zeros.
fn fraction(x: f64) -> String {
    let s = format!("{:.3}", (x * 1000.0).round() / 1000.0);
    s.trim_end_matches('0').trim_end_matches('.').to_string()
}

/// Which way `problem` moves an argument of `used`, within `fit`.
pub(crate) fn decide(problem: &Problem, used: &Used, fit: &Fit) -> Move {
    let value = |a: FitArg| used.get(&a).map(|(v, _)| v.clone());
    let allowed = |a: FitArg| fit.adjust.contains(&a);
    match problem {
        Problem::KvCacheTooSmall { max_model_len, estimate } => {
            let arg = FitArg::MaxModelLen;
            if !allowed(arg) {
                return Move::Refuse(format!("`fit.adjust` does not allow {}", arg.flag()));
            }
            let Some(estimate) = estimate else {
                return Move::Refuse("vLLM gave no estimate of the length that fits".into());
            };
            let to = estimate / fit.model_len_multiple * fit.model_len_multiple;
            if to < fit.min_model_len {
                return Move::Refuse(format!(
                    "vLLM's estimate {estimate}, rounded down to a multiple of {}, is {to}: below `fit.min-model-len` {}",
                    fit.model_len_multiple, fit.min_model_len
                ));
            }
            if to >= *max_model_len {
                return Move::Refuse(format!("vLLM's estimate {estimate} is no shorter than {max_model_len}"));
            }
            let from = value(arg).unwrap_or_else(|| max_model_len.to_string());
            let why = format!(
                "vLLM estimates {estimate} tokens fit, rounded down to a multiple of {}",
                fit.model_len_multiple
            );
            Move::Set { arg, from, to: to.to_string(), why }
        }
        Problem::NoCacheMemory | Problem::OutOfMemory => {
            let arg = FitArg::GpuMemoryUtilization;
            if !allowed(arg) {
                return Move::Refuse(format!("`fit.adjust` does not allow {}", arg.flag()));
            }
            let from = value(arg).unwrap_or_else(|| VLLM_UTILIZATION.to_string());
            let Some(now) = from.parse::<f64>().ok().filter(|x| x.is_finite()) else {
                return Move::Refuse(format!("{} {from:?} is not a number", arg.flag()));
            };
            let raise = *problem == Problem::NoCacheMemory;
            let to = if raise { now + fit.step } else { now - fit.step };
            // A hair of rounding is not a step past the bound.
            let (bound, past) = if raise {
                (fit.max_utilization, to > fit.max_utilization + 1e-9)
            } else {
                (fit.min_utilization, to < fit.min_utilization - 1e-9)
            };
            if past {
                let which = if raise { "max" } else { "min" };
                return Move::Refuse(format!("{} {from} is at `fit.{which}-utilization` {bound}", arg.flag()));
            }
            let why = if raise { "more memory for the KV cache" } else { "less memory taken at the weights' load" };
            Move::Set { arg, from, to: fraction(to.clamp(0.0, 1.0)), why: why.into() }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// On, with the documented defaults (the tests rely on their values).
    fn fit() -> Fit {
        Fit { enabled: true, ..Fit::default() }
    }

    fn used(pairs: &[(FitArg, &str)]) -> Used {
        pairs.iter().map(|(a, v)| (*a, (v.to_string(), Source::Config))).collect()
    }

    fn set(m: Move) -> (FitArg, String, String) {
        match m {
            Move::Set { arg, from, to, .. } => (arg, from, to),
            Move::Refuse(why) => panic!("refused: {why}"),
        }
    }

    #[test]
    fn a_kv_cache_too_small_shortens_the_length_to_the_estimate_rounded_down() {
        let p = Problem::KvCacheTooSmall { max_model_len: 1_500_000, estimate: Some(1_048_448) };
        let (a, from, to) = set(decide(&p, &used(&[(FitArg::MaxModelLen, "1500000")]), &fit()));
        assert_eq!((a, from.as_str(), to.as_str()), (FitArg::MaxModelLen, "1500000", "1047552"));
        // Not on the command line: the length vLLM said it used.
        let (_, from, _) = set(decide(&p, &Used::new(), &fit()));
        assert_eq!(from, "1500000");
    }

    #[test]
    fn the_length_is_never_set_below_its_floor_nor_without_an_estimate() {
        let p = Problem::KvCacheTooSmall { max_model_len: 32768, estimate: Some(5000) };
        let f = Fit { min_model_len: 8192, ..fit() };
        assert!(matches!(decide(&p, &Used::new(), &f), Move::Refuse(w) if w.contains("fit.min-model-len")));
        let p = Problem::KvCacheTooSmall { max_model_len: 32768, estimate: None };
        assert!(matches!(decide(&p, &Used::new(), &fit()), Move::Refuse(w) if w.contains("no estimate")));
        // An estimate that is no shorter moves nothing.
        let p = Problem::KvCacheTooSmall { max_model_len: 8192, estimate: Some(9000) };
        assert!(matches!(decide(&p, &Used::new(), &fit()), Move::Refuse(_)));
    }

    #[test]
    fn the_two_memory_errors_move_the_utilization_opposite_ways_within_bounds() {
        let u = used(&[(FitArg::GpuMemoryUtilization, "0.9")]);
        assert_eq!(set(decide(&Problem::NoCacheMemory, &u, &fit())).2, "0.92");
        assert_eq!(set(decide(&Problem::OutOfMemory, &u, &fit())).2, "0.88");
        // vLLM's default when the command sets none.
        assert_eq!(set(decide(&Problem::NoCacheMemory, &Used::new(), &fit())).1, "0.9");
        let top = used(&[(FitArg::GpuMemoryUtilization, "0.94")]);
        assert!(
            matches!(decide(&Problem::NoCacheMemory, &top, &fit()), Move::Refuse(w) if w.contains("max-utilization"))
        );
        let at = used(&[(FitArg::GpuMemoryUtilization, "0.93")]);
        assert_eq!(set(decide(&Problem::NoCacheMemory, &at, &fit())).2, "0.95");
        let low = used(&[(FitArg::GpuMemoryUtilization, "0.51")]);
        assert!(
            matches!(decide(&Problem::OutOfMemory, &low, &fit()), Move::Refuse(w) if w.contains("min-utilization"))
        );
    }

    #[test]
    fn an_argument_not_in_adjust_is_never_touched() {
        let f = Fit { adjust: vec![FitArg::GpuMemoryUtilization], ..fit() };
        let p = Problem::KvCacheTooSmall { max_model_len: 1_500_000, estimate: Some(1_048_448) };
        assert!(matches!(decide(&p, &Used::new(), &f), Move::Refuse(w) if w.contains("fit.adjust")));
        let f = Fit { adjust: vec![FitArg::MaxModelLen], ..fit() };
        assert!(
            matches!(decide(&Problem::NoCacheMemory, &Used::new(), &f), Move::Refuse(w) if w.contains("fit.adjust"))
        );
    }

    #[test]
    fn a_pin_moves_only_what_fit_may_move_and_only_as_far() {
        let len = FitArg::MaxModelLen;
        let util = FitArg::GpuMemoryUtilization;
        assert_eq!(check_pin(len, "69632", Some("100000"), &fit()), Ok(()));
        assert_eq!(check_pin(len, "69632", None, &fit()), Ok(()));
        assert_eq!(check_pin(util, "0.92", None, &fit()), Ok(()));
        // Off, or not an argument of `fit.adjust`.
        let off = Fit { enabled: false, ..fit() };
        assert!(check_pin(len, "69632", None, &off).unwrap_err().contains("`fit.enabled` is off"));
        let only_util = Fit { adjust: vec![util], ..fit() };
        assert!(check_pin(len, "69632", None, &only_util).unwrap_err().contains("`fit.adjust`"));
        // Out of bounds.
        let f = Fit { min_model_len: 4096, min_utilization: 0.5, ..fit() };
        assert!(check_pin(len, "2048", None, &f).unwrap_err().contains("below `fit.min-model-len` 4096"));
        assert!(check_pin(len, "5000", None, &f).unwrap_err().contains("multiple"));
        assert!(check_pin(len, "200704", Some("100000"), &f).unwrap_err().contains("longer than the command's own"));
        assert!(check_pin(len, "8192", Some("32k"), &f).is_err());
        assert!(check_pin(util, "0.01", None, &f).unwrap_err().contains("outside `fit.min-utilization` 0.5"));
        assert!(check_pin(util, "0.99", None, &f).unwrap_err().contains("`fit.max-utilization` 0.95"));
        assert_eq!(check_pin(util, "0.5", None, &f), Ok(()));
        // Not numbers vLLM would take.
        for bad in ["", ".", "1.2.3", "0.9e0", "inf", "-0.9", "0.9 --trust-remote-code"] {
            assert!(check_pin(util, bad, None, &f).is_err(), "{bad:?}");
        }
        for bad in ["", "8192.0", "+8192", "99999999999999999999"] {
            assert!(check_pin(len, bad, None, &f).is_err(), "{bad:?}");
        }
    }

    #[test]
    fn only_fitted_and_pinned_values_are_shown() {
        let mut u = used(&[(FitArg::GpuMemoryUtilization, "0.5")]);
        assert_eq!(shown(&u), None);
        u.insert(FitArg::MaxModelLen, ("1024".into(), Source::Pinned));
        assert_eq!(shown(&u).as_deref(), Some("--max-model-len 1024 (pinned)"));
    }
}
