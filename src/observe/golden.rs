//! The golden check's HTTP and files: the prompts asked of the served
//! model (`/v1/completions`, greedy, seed 0, logprobs, token ids), the
//! references kept per setup in `golden/references.json` of the state
//! directory and the last answers in `golden/last.json`, and the verdict
//! (`supervisor::golden` compares).

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};

use crate::observe::health::client;
use crate::supervisor::golden::{Answer, Answers, Verdict, compare};

/// The golden folder of the state directory.
pub const FOLDER: &str = "golden";
const REFERENCES: &str = "references.json";
const LAST: &str = "last.json";
/// References kept: one per setup, the oldest dropped.
pub const KEEP: usize = 50;
/// The most one answer, or a prompts file, may hold.
const MAX_BODY: usize = 1 << 20;
const MAX_FILE: u64 = 64 << 10;

/// A setup's reference answers.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Reference {
    pub fingerprint: String,
    /// The questions asked: the prompts and `max-tokens` (see
    /// [`questions`]); answers to other questions are not compared.
    #[serde(default)]
    pub questions: String,
    #[serde(default)]
    pub setup: serde_json::Value,
    pub at: String,
    pub answers: Answers,
}

/// The last check: its answers, what they were compared with and the
/// verdict.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Last {
    pub fingerprint: String,
    #[serde(default)]
    pub questions: String,
    #[serde(default)]
    pub setup: serde_json::Value,
    pub at: String,
    pub verdict: String,
    pub text: String,
    pub answers: Option<Answers>,
    /// The fingerprint of the reference compared with, if any.
    pub against: Option<String>,
    pub tolerance: f64,
}

/// The prompts: the config's, then the file's (one a line, blank lines
/// skipped), at most [`crate::config::limits::GOLDEN_PROMPTS`] in all.
pub fn prompts(g: &crate::config::Golden) -> Result<Vec<String>, String> {
    let mut out = g.prompts.clone();
    if let Some(path) = &g.prompts_file {
        let text = read_bounded(path, MAX_FILE).map_err(|e| format!("golden.prompts-file {}: {e}", path.display()))?;
        out.extend(text.lines().map(str::trim).filter(|l| !l.is_empty()).map(String::from));
    }
    out.truncate(crate::config::limits::GOLDEN_PROMPTS * 2);
    Ok(out)
}

fn read_bounded(path: &Path, max: u64) -> std::io::Result<String> {
    use std::io::Read;
    use std::os::unix::fs::OpenOptionsExt;
    let f = std::fs::OpenOptions::new().read(true).custom_flags(libc::O_NOFOLLOW | libc::O_NONBLOCK).open(path)?;
    if !f.metadata()?.is_file() {
        return Err(std::io::Error::other("not a regular file"));
    }
    let mut s = String::new();
    f.take(max).read_to_string(&mut s)?;
    Ok(s)
}

/// Ask `prompts` of the server at `base`, all within `timeout`.
pub async fn ask(base: &str, prompts: &[String], max_tokens: u32, timeout: Duration) -> Result<Answers, String> {
    let t0 = Instant::now();
    let left = || timeout.saturating_sub(t0.elapsed());
    let models = client::send(client::Request::get(&format!("{base}/v1/models")).read(MAX_BODY), left())
        .await
        .map_err(|e| format!("/v1/models: {e}"))?;
    if !models.status.is_success() {
        return Err(format!("/v1/models: HTTP {}", models.status.as_u16()));
    }
    let models = models.json().map_err(|e| format!("/v1/models: {e}"))?;
    let model = models["data"][0]["id"].as_str().ok_or("/v1/models lists no model")?.to_string();
    let mut answers = Vec::new();
    for prompt in prompts {
        let body = serde_json::json!({
            "model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "seed": 0,
            "logprobs": 1, "return_tokens_as_token_ids": true,
        });
        let url = format!("{base}/v1/completions");
        let r = match client::send(client::Request::post_json(&url, &body).read(MAX_BODY), left()).await {
            Ok(r) => r,
            Err(client::Error::Timeout) => {
                return Err(format!("no answer within {}", humantime::format_duration(timeout)));
            }
            Err(e) => return Err(format!("/v1/completions: {e}")),
        };
        if !r.status.is_success() {
            let said = crate::util::escape::one_line(&String::from_utf8_lossy(&r.body), 200);
            return Err(format!("/v1/completions: HTTP {}: {said}", r.status.as_u16()));
        }
        let v = r.json().map_err(|e| format!("/v1/completions: {e}"))?;
        answers.push(answer(prompt, &v).ok_or("/v1/completions: no choice in the answer")?);
    }
    Ok(Answers { answers, ms: t0.elapsed().as_secs_f64() * 1e3 })
}

/// The first choice of a completion: its text, tokens and logprobs.
fn answer(prompt: &str, v: &serde_json::Value) -> Option<Answer> {
    let c = v["choices"].get(0)?;
    let text = c["text"].as_str().unwrap_or_default().to_string();
    let lp = &c["logprobs"];
    let tokens: Vec<String> = match lp["tokens"].as_array() {
        Some(t) => t.iter().map(|t| t.as_str().unwrap_or_default().to_string()).collect(),
        None => text.split_inclusive(' ').map(String::from).collect(),
    };
    let logprobs = lp["token_logprobs"].as_array().map(|l| l.iter().map(serde_json::Value::as_f64).collect());
    Some(Answer { prompt: prompt.to_string(), tokens, logprobs: logprobs.unwrap_or_default(), text })
}

fn folder(state_dir: &Path) -> PathBuf {
    state_dir.join(FOLDER)
}

/// The references, oldest first; none when there is no file (a file that
/// is not references is an error: it is not overwritten blindly).
pub fn references(state_dir: &Path) -> Result<Vec<Reference>, String> {
    let path = folder(state_dir).join(REFERENCES);
    match read_in(state_dir, REFERENCES, MAX_STORE) {
        Ok(text) => serde_json::from_str(&text).map_err(|e| format!("{}: {e}", path.display())),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(Vec::new()),
        Err(e) => Err(format!("{}: {e}", path.display())),
    }
}

pub fn last(state_dir: &Path) -> Result<Option<Last>, String> {
    let path = folder(state_dir).join(LAST);
    match read_in(state_dir, LAST, MAX_STORE) {
        Ok(text) => serde_json::from_str(&text).map(Some).map_err(|e| format!("{}: {e}", path.display())),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
        Err(e) => Err(format!("{}: {e}", path.display())),
    }
}

/// The most `references.json` or `last.json` may hold.
const MAX_STORE: u64 = 4 << 20;

/// `name` in the golden folder, read through the state directory's and the
/// folder's descriptors without following a link (the service user owns
/// both; `golden` may be run by root).
fn read_in(state_dir: &Path, name: &str, max: u64) -> std::io::Result<String> {
    use std::io::Read;
    let dir = crate::util::fsutil::Dir::open(state_dir)?.child_dir(FOLDER.as_ref(), None)?;
    let (f, _) = dir.open_regular(name.as_ref(), false).map_err(std::io::Error::other)?;
    let mut s = String::new();
    f.take(max).read_to_string(&mut s)?;
    Ok(s)
}

/// Write `name` whole (a new file renamed over the old), through the state
/// directory's and the folder's descriptors, never through a link. Root
/// writing for `golden accept` leaves the folder and the file to the
/// state directory's owner, the service user, who reads and writes them
/// next.
fn save<T: Serialize>(state_dir: &Path, name: &str, value: &T) -> std::io::Result<()> {
    use std::os::unix::fs::MetadataExt;
    let state = crate::util::fsutil::Dir::open(state_dir)?;
    let dir = state.child_dir(FOLDER.as_ref(), Some(0o750))?;
    let text = serde_json::to_string_pretty(value).map_err(std::io::Error::other)?;
    let owner = state.metadata()?;
    let owner = (nix::unistd::geteuid().is_root() && owner.uid() != 0).then_some((owner.uid(), owner.gid()));
    if let Some((uid, gid)) = owner {
        nix::unistd::fchown(dir.fd(), Some(uid.into()), Some(gid.into()))?;
    }
    dir.write_atomic(name.as_ref(), text.as_bytes(), 0o640, owner)
}

/// `answers` become the reference of `fingerprint` (replacing its old one).
pub fn set_reference(state_dir: &Path, r: Reference) -> Result<(), String> {
    let mut all = references(state_dir)?;
    all.retain(|x| x.fingerprint != r.fingerprint || x.questions != r.questions);
    all.push(r);
    let drop = all.len().saturating_sub(KEEP);
    all.drain(..drop);
    save(state_dir, REFERENCES, &all).map_err(|e| format!("cannot save the golden references: {e}"))
}

fn now() -> String {
    humantime::format_rfc3339_seconds(std::time::SystemTime::now()).to_string()
}

/// What a setup is, for the check: its fingerprint and description, and
/// the questions asked of it.
#[derive(Debug, Clone)]
pub struct Subject {
    pub fingerprint: String,
    pub setup: serde_json::Value,
    pub questions: String,
}

/// The questions: a hash of the prompts and `max-tokens`. Other prompts,
/// or longer answers, are other questions with references of their own,
/// never "changed answers".
pub fn questions(prompts: &[String], max_tokens: u32) -> String {
    use sha2::{Digest, Sha256};
    let mut h = Sha256::new();
    h.update(max_tokens.to_le_bytes());
    for p in prompts {
        h.update((p.len() as u64).to_le_bytes());
        h.update(p.as_bytes());
    }
    h.finalize()[..8].iter().map(|b| format!("{b:02x}")).collect()
}

/// Judge `answers` for `subject` against the references, record what is
/// to be recorded, and say the verdict. Blocking (files).
pub fn judge(state_dir: &Path, subject: &Subject, answers: Answers, tolerance: f64, accept_changes: bool) -> Verdict {
    let ms = answers.ms.round() as u64;
    let prompts = answers.answers.len();
    let refs = match references(state_dir) {
        Ok(r) => r,
        Err(e) => return Verdict::Failed { text: e },
    };
    let refs: Vec<&Reference> = refs.iter().filter(|r| r.questions == subject.questions).collect();
    let own = refs.iter().copied().find(|r| r.fingerprint == subject.fingerprint);
    // A new setup is compared with the latest reference of another.
    let against = own.or_else(|| refs.last().copied());
    let reference = |answers: &Answers| Reference {
        fingerprint: subject.fingerprint.clone(),
        questions: subject.questions.clone(),
        setup: subject.setup.clone(),
        at: now(),
        answers: answers.clone(),
    };
    let (verdict, new_ref) = match against {
        None => (Verdict::Recorded { prompts, ms }, true),
        Some(r) => match compare(&r.answers, &answers, tolerance) {
            Ok(()) => (Verdict::Same { prompts, ms }, own.is_none()),
            Err(d) => {
                let after = if own.is_some() {
                    "with the same setup".to_string()
                } else {
                    let changes = crate::observe::ledger::setup_changes(&r.setup, &subject.setup);
                    format!("after {}", changes.join("; "))
                };
                let text = format!("answers changed {after}: prompt {:?}, {}", short(&d.prompt), d.what);
                if accept_changes && own.is_none() {
                    (Verdict::Changed { text: format!("{text} (accepted: golden.accept-changes)"), ms }, true)
                } else {
                    (Verdict::Changed { text, ms }, false)
                }
            }
        },
    };
    let mut recorded = None;
    if new_ref && let Err(e) = set_reference(state_dir, reference(&answers)) {
        recorded = Some(e);
    }
    save_last(state_dir, subject, &verdict, Some(answers), against.map(|r| r.fingerprint.clone()), tolerance);
    match recorded {
        Some(e) => Verdict::Failed { text: e },
        None => verdict,
    }
}

/// Record that the check could not be made.
pub fn failed(state_dir: &Path, subject: &Subject, text: &str, tolerance: f64) -> Verdict {
    let verdict = Verdict::Failed { text: text.to_string() };
    save_last(state_dir, subject, &verdict, None, None, tolerance);
    verdict
}

/// `last.json`: this check, for `golden show`, `diff` and `accept`.
fn save_last(
    state_dir: &Path,
    subject: &Subject,
    verdict: &Verdict,
    answers: Option<Answers>,
    against: Option<String>,
    tolerance: f64,
) {
    let last = Last {
        fingerprint: subject.fingerprint.clone(),
        questions: subject.questions.clone(),
        setup: subject.setup.clone(),
        at: now(),
        verdict: verdict.name().into(),
        text: verdict.text(),
        answers,
        against,
        tolerance,
    };
    if let Err(e) = save(state_dir, LAST, &last) {
        tracing::warn!(error = %e, "cannot save the last golden answers");
    }
}

fn short(s: &str) -> String {
    let s: String = s.chars().take(60).collect();
    crate::util::escape::one_line(&s, 80)
}

/// The file of a failure report with the answers side by side.
pub const REPORT_FILE: &str = "golden.txt";

/// The last answers beside the reference they were compared with, token by
/// token; none without both.
pub fn diff(state_dir: &Path) -> Option<String> {
    let last = last(state_dir).ok()??;
    let answers = last.answers.as_ref()?;
    let against = last.against.as_deref()?;
    let refs = references(state_dir).ok()?;
    let r = refs.iter().find(|r| r.fingerprint == against && r.questions == last.questions)?;
    let head = format!(
        "{}\nthen: setup {} (reference of {})\nnow:  setup {} ({})\n\n",
        last.text, r.fingerprint, r.at, last.fingerprint, last.at
    );
    Some(head + &crate::supervisor::golden::side_by_side(&r.answers, answers, last.tolerance))
}

/// `golden accept`: the last answers become the reference of their setup.
pub fn accept(state_dir: &Path) -> Result<String, String> {
    let last = last(state_dir)?.ok_or("no golden answers yet")?;
    let answers = last.answers.ok_or("the last golden check has no answers (it failed)")?;
    set_reference(
        state_dir,
        Reference {
            fingerprint: last.fingerprint.clone(),
            questions: last.questions,
            setup: last.setup,
            at: now(),
            answers,
        },
    )?;
    Ok(last.fingerprint)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn answers(tokens: &[&str]) -> Answers {
        Answers {
            answers: vec![Answer {
                prompt: "p".into(),
                tokens: tokens.iter().map(|t| t.to_string()).collect(),
                logprobs: vec![Some(-1.0); tokens.len()],
                text: tokens.concat(),
            }],
            ms: 12.4,
        }
    }

    fn subject(fp: &str, cmd: &str) -> Subject {
        Subject { fingerprint: fp.into(), setup: serde_json::json!({"command": cmd}), questions: "q".into() }
    }

    #[test]
    fn other_questions_are_never_changed_answers() {
        let d = tempfile::tempdir().unwrap();
        let s = d.path();
        assert_eq!(judge(s, &subject("a", "x"), answers(&["1", "2"]), 1e-3, false).name(), "recorded");
        let other = Subject { questions: "q2".into(), ..subject("a", "x") };
        assert_eq!(judge(s, &other, answers(&["1", "2", "3"]), 1e-3, false).name(), "recorded");
        assert_eq!(judge(s, &other, answers(&["1", "2", "3"]), 1e-3, false).name(), "same");
        assert_eq!(judge(s, &subject("a", "x"), answers(&["1", "2"]), 1e-3, false).name(), "same");
        assert_ne!(questions(&["p".into()], 8), questions(&["p".into()], 16));
        assert_ne!(questions(&["p".into()], 8), questions(&["p".into(), "q".into()], 8));
    }

    #[test]
    fn the_first_answers_are_the_reference_then_compared_and_a_new_setup_against_the_last() {
        let d = tempfile::tempdir().unwrap();
        let s = d.path();
        assert_eq!(
            judge(s, &subject("a", "x"), answers(&["1", "2"]), 1e-3, false),
            Verdict::Recorded { prompts: 1, ms: 12 }
        );
        assert_eq!(
            judge(s, &subject("a", "x"), answers(&["1", "2"]), 1e-3, false),
            Verdict::Same { prompts: 1, ms: 12 }
        );
        let Verdict::Changed { text, .. } = judge(s, &subject("a", "x"), answers(&["1", "3"]), 1e-3, false) else {
            panic!()
        };
        assert_eq!(text, "answers changed with the same setup: prompt \"p\", token 2: \"2\" then, \"3\" now");
        // A new setup with the same answers takes them as its reference.
        assert_eq!(
            judge(s, &subject("b", "y"), answers(&["1", "2"]), 1e-3, false),
            Verdict::Same { prompts: 1, ms: 12 }
        );
        assert_eq!(references(s).unwrap().len(), 2);
        // Another with other answers: changed, after what changed; not
        // recorded until accepted.
        let Verdict::Changed { text, .. } = judge(s, &subject("c", "z"), answers(&["9"]), 1e-3, false) else {
            panic!()
        };
        assert!(text.starts_with("answers changed after command: y → z: prompt \"p\", token 1"), "{text}");
        assert_eq!(references(s).unwrap().len(), 2);
        assert_eq!(accept(s).unwrap(), "c");
        assert_eq!(judge(s, &subject("c", "z"), answers(&["9"]), 1e-3, false), Verdict::Same { prompts: 1, ms: 12 });
        // With accept-changes, a changed setup's answers are its reference.
        let v = judge(s, &subject("d", "w"), answers(&["7"]), 1e-3, true);
        assert!(
            matches!(&v, Verdict::Changed { text, .. } if text.ends_with("(accepted: golden.accept-changes)")),
            "{v:?}"
        );
        assert_eq!(judge(s, &subject("d", "w"), answers(&["7"]), 1e-3, false).name(), "same");
    }

    /// `golden accept` may run as root on the service user's folder: a
    /// link in place of `golden` is neither written nor read through.
    #[test]
    fn a_link_in_place_of_the_golden_folder_is_not_followed() {
        let d = tempfile::tempdir().unwrap();
        let elsewhere = d.path().join("elsewhere");
        std::fs::create_dir(&elsewhere).unwrap();
        let state = d.path().join("state");
        std::fs::create_dir(&state).unwrap();
        std::os::unix::fs::symlink(&elsewhere, state.join(FOLDER)).unwrap();
        let v = judge(&state, &subject("a", "x"), answers(&["1"]), 1e-3, false);
        assert!(matches!(v, Verdict::Failed { .. }), "{v:?}");
        assert_eq!(std::fs::read_dir(&elsewhere).unwrap().count(), 0);
        std::fs::write(elsewhere.join(LAST), "{}").unwrap();
        assert!(last(&state).is_err());
    }

    #[test]
    fn a_references_file_that_is_not_one_is_a_failed_check_and_is_kept() {
        let d = tempfile::tempdir().unwrap();
        std::fs::create_dir_all(d.path().join(FOLDER)).unwrap();
        std::fs::write(d.path().join(FOLDER).join(REFERENCES), "not json").unwrap();
        let v = judge(d.path(), &subject("a", "x"), answers(&["1"]), 1e-3, false);
        assert!(matches!(v, Verdict::Failed { .. }), "{v:?}");
        assert_eq!(std::fs::read_to_string(d.path().join(FOLDER).join(REFERENCES)).unwrap(), "not json");
    }

    #[test]
    fn a_completion_with_token_ids_and_logprobs_is_read() {
        let v = serde_json::json!({"choices": [{"text": " Paris", "logprobs": {
            "tokens": ["token_id:3681", "token_id:29889"], "token_logprobs": [-0.25, null]}}]});
        let a = answer("p", &v).unwrap();
        assert_eq!(a.tokens, ["token_id:3681", "token_id:29889"]);
        assert_eq!(a.logprobs, [Some(-0.25), None]);
        // Without logprobs: the text's pieces.
        let a = answer("p", &serde_json::json!({"choices": [{"text": "a b"}]})).unwrap();
        assert_eq!((a.tokens, a.logprobs), (vec!["a ".to_string(), "b".into()], vec![]));
    }
}
