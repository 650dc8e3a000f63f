//! Golden answers: what the served model answered to fixed prompts
//! (greedy, a fixed seed, logprobs asked for), and whether two sets of
//! answers are the same — the same tokens, each logprob within a tolerance
//! (vLLM's snapshot oracle's rule). Pure: the HTTP and the files are
//! `observe::golden`'s.

use serde::{Deserialize, Serialize};

/// The answer to one prompt.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Answer {
    pub prompt: String,
    /// The tokens as the server named them (`token_id:N` where vLLM gives
    /// ids), else the text's pieces.
    pub tokens: Vec<String>,
    /// Each token's logprob; none where the server gave none.
    #[serde(default)]
    pub logprobs: Vec<Option<f64>>,
    pub text: String,
}

/// A set of answers: one per prompt, and how long they took.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Answers {
    pub answers: Vec<Answer>,
    /// The whole check's wall time, in milliseconds.
    pub ms: f64,
}

/// Where two sets of answers first part.
#[derive(Debug, Clone, PartialEq)]
pub struct Difference {
    pub prompt: String,
    /// The first token that differs (its index), or the first logprob
    /// beyond the tolerance.
    pub(crate) at: usize,
    pub what: String,
}

/// Compare `now` with `reference`: `Ok` when every prompt's tokens are the
/// same and each logprob moved by at most `tolerance` (where both have
/// one), else the first difference.
pub fn compare(reference: &Answers, now: &Answers, tolerance: f64) -> Result<(), Difference> {
    for (i, r) in reference.answers.iter().enumerate() {
        let Some(n) = now.answers.iter().find(|a| a.prompt == r.prompt) else {
            return Err(Difference { prompt: r.prompt.clone(), at: 0, what: format!("prompt {} not answered", i + 1) });
        };
        let differs = |at: usize, what: String| Err(Difference { prompt: r.prompt.clone(), at, what });
        for (j, (a, b)) in r.tokens.iter().zip(&n.tokens).enumerate() {
            if a != b {
                return differs(j, format!("token {}: {:?} then, {:?} now", j + 1, clip(a), clip(b)));
            }
        }
        if r.tokens.len() != n.tokens.len() {
            let at = r.tokens.len().min(n.tokens.len());
            return differs(at, format!("{} tokens then, {} now", r.tokens.len(), n.tokens.len()));
        }
        for (j, (a, b)) in r.logprobs.iter().zip(&n.logprobs).enumerate() {
            if let (Some(a), Some(b)) = (a, b)
                && ((a - b).abs() > tolerance || a.is_nan() != b.is_nan())
            {
                return differs(
                    j,
                    format!("token {}: logprob {a:.6} then, {b:.6} now (|Δ| {:.2e})", j + 1, (a - b).abs()),
                );
            }
        }
    }
    Ok(())
}

/// A token as shown in a cause: at most 40 characters (an answer is the
/// server's data, of any size).
fn clip(t: &str) -> String {
    t.chars().take(40).collect()
}

/// What the check found, as the machine acts on it.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Verdict {
    /// The same answers as this setup's reference.
    Same { prompts: usize, ms: u64 },
    /// No reference yet: these answers are now the setup's.
    Recorded { prompts: usize, ms: u64 },
    /// Different from the reference of this setup, or of the setup before
    /// (`after` says what changed); `text` says where.
    Changed { text: String, ms: u64 },
    /// The check could not be made: an unreadable prompts file, an answer
    /// that is no completion.
    Failed { text: String },
    /// The server did not answer: nothing within `golden.timeout`, no
    /// connection, or a 5xx. A model that cannot answer one short
    /// completion is not serving: a failed run whatever
    /// `golden.on-mismatch` says.
    NoAnswer { text: String },
    /// The model has no completions API (a pooling or embedding model:
    /// vLLM answers 404 or 400 for `/v1/completions`): nothing to compare,
    /// the check is skipped for the setup; `text` says what the server said.
    Skipped { text: String },
    /// The server answered, but the golden store could not be used: its
    /// references unreadable (the answers not compared), or the answers
    /// not recorded as a reference (too large to keep, or not written).
    /// The store's problem, not the model's: a warning, never a failed
    /// run; `text` says what and what to do.
    Unrecorded { text: String, ms: u64 },
}

impl Verdict {
    /// One line for `STATUS=`, the journal and the status document.
    pub fn text(&self) -> String {
        match self {
            Verdict::Same { prompts, ms } => format!("answers as recorded ({prompts} prompt(s), {ms} ms)"),
            Verdict::Recorded { prompts, ms } => {
                format!("answers recorded as the reference ({prompts} prompt(s), {ms} ms)")
            }
            Verdict::Changed { text, .. } => text.clone(),
            Verdict::Failed { text } => format!("golden check failed: {text}"),
            Verdict::NoAnswer { text } => format!("golden check: no answer: {text}"),
            Verdict::Skipped { text } => {
                format!("golden check skipped: the model has no completions API (a pooling or embedding model): {text}")
            }
            Verdict::Unrecorded { text, .. } => text.clone(),
        }
    }

    pub fn name(&self) -> &'static str {
        match self {
            Verdict::Same { .. } => "same",
            Verdict::Recorded { .. } => "recorded",
            Verdict::Changed { .. } => "changed",
            Verdict::Failed { .. } => "failed",
            Verdict::Unrecorded { .. } => "unrecorded",
            Verdict::NoAnswer { .. } => "no_answer",
            Verdict::Skipped { .. } => "skipped",
        }
    }

    pub const NAMES: [&'static str; 7] =
        ["same", "recorded", "changed", "failed", "unrecorded", "no_answer", "skipped"];
}

/// Two sets of answers side by side, token by token, for `golden diff` and
/// a failure report.
pub fn side_by_side(reference: &Answers, now: &Answers, tolerance: f64) -> String {
    use std::fmt::Write;
    let mut out = String::new();
    for r in &reference.answers {
        let _ = writeln!(out, "prompt: {:?}", r.prompt);
        let Some(n) = now.answers.iter().find(|a| a.prompt == r.prompt) else {
            let _ = writeln!(out, "  (not answered now)");
            continue;
        };
        let _ = writeln!(out, "  then: {:?}", r.text);
        let _ = writeln!(out, "  now:  {:?}", n.text);
        let _ = writeln!(
            out,
            "  {:>3}  {:<20} {:<20} {:>12} {:>12}",
            "#", "token then", "token now", "logprob then", "logprob now"
        );
        for j in 0..r.tokens.len().max(n.tokens.len()) {
            let (a, b) = (r.tokens.get(j), n.tokens.get(j));
            let (la, lb) = (r.logprobs.get(j).copied().flatten(), n.logprobs.get(j).copied().flatten());
            let lp = |x: Option<f64>| x.map_or_else(|| "-".to_string(), |v| format!("{v:.6}"));
            let mark = match (a, b, la, lb) {
                (Some(a), Some(b), _, _) if a != b => "  ≠ token",
                (_, _, Some(x), Some(y)) if (x - y).abs() > tolerance => "  ≠ logprob",
                (None, _, _, _) | (_, None, _, _) => "  ≠ length",
                _ => "",
            };
            let t = |x: Option<&String>| x.map_or_else(|| "-".to_string(), |s| format!("{s:?}"));
            let _ = writeln!(out, "  {:>3}  {:<20} {:<20} {:>12} {:>12}{mark}", j + 1, t(a), t(b), lp(la), lp(lb));
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn answers(tokens: &[&str], logprobs: &[Option<f64>]) -> Answers {
        Answers {
            answers: vec![Answer {
                prompt: "p".into(),
                tokens: tokens.iter().map(|t| t.to_string()).collect(),
                logprobs: logprobs.to_vec(),
                text: tokens.concat(),
            }],
            ms: 1.0,
        }
    }

    #[test]
    fn the_same_tokens_within_the_tolerance_are_the_same_answer() {
        let a = answers(&["a", "b"], &[Some(-0.5), Some(-1.0)]);
        assert_eq!(compare(&a, &answers(&["a", "b"], &[Some(-0.5004), Some(-1.0)]), 1e-3), Ok(()));
        let far = compare(&a, &answers(&["a", "b"], &[Some(-0.5), Some(-1.01)]), 1e-3).unwrap_err();
        assert_eq!(far.at, 1);
        assert!(far.what.starts_with("token 2: logprob -1.000000 then, -1.010000 now"), "{far:?}");
    }

    #[test]
    fn another_token_a_truncation_or_a_missing_prompt_differs() {
        let a = answers(&["a", "b", "c"], &[]);
        assert_eq!(
            compare(&a, &answers(&["a", "x", "c"], &[]), 1e-3).unwrap_err().what,
            "token 2: \"b\" then, \"x\" now"
        );
        assert_eq!(compare(&a, &answers(&["a", "b"], &[]), 1e-3).unwrap_err().what, "3 tokens then, 2 now");
        let none = Answers { answers: vec![], ms: 0.0 };
        assert_eq!(compare(&a, &none, 1e-3).unwrap_err().what, "prompt 1 not answered");
    }

    #[test]
    fn missing_logprobs_compare_the_tokens_alone() {
        let a = answers(&["a"], &[None]);
        assert_eq!(compare(&a, &answers(&["a"], &[Some(-3.0)]), 1e-3), Ok(()));
        let b = answers(&["a"], &[Some(f64::NAN)]);
        assert!(compare(&answers(&["a"], &[Some(-1.0)]), &b, 1e-3).is_err(), "NaN is no logprob of the reference");
    }

    #[test]
    fn side_by_side_marks_where_they_part() {
        let text = side_by_side(
            &answers(&["a", "b"], &[Some(-0.5), Some(-1.0)]),
            &answers(&["a", "x", "y"], &[Some(-0.5), Some(-2.0), Some(-3.0)]),
            1e-3,
        );
        let rows: Vec<&str> = text.lines().collect();
        assert!(rows[4].ends_with("-0.500000"), "{text}");
        assert!(rows[5].ends_with("≠ token"), "{text}");
        assert!(rows[6].ends_with("≠ length"), "{text}");
    }
}
