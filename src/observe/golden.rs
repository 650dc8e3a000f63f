//! The golden check's HTTP and files: the prompts asked of the served
//! model (`/v1/completions`, greedy, seed 0, logprobs, token ids), the
//! references kept per setup in `golden/references.json` of the state
//! directory and the last answers in `golden/last.json`, and the verdict
//! (`supervisor::golden` compares).
//!
//! The store is read through a cap ([`MAX_STORE`]), so it is written
//! within it: a reference larger than [`MAX_REFERENCE`] is not kept, and
//! the oldest references are dropped to make room. A store that cannot
//! be read (another program's file, a disk's damage, an older warden's
//! larger file) is left as it is and the check is a warning; `golden
//! accept` sets it aside and starts a new one.

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};

use crate::observe::health::client;
use crate::supervisor::golden::{Answer, Answers, Verdict, compare};

/// The golden folder of the state directory.
pub(crate) const FOLDER: &str = "golden";
const REFERENCES: &str = "references.json";
const LAST: &str = "last.json";
/// References kept: one per setup, the oldest dropped.
pub(crate) const KEEP: usize = 50;
/// The most `references.json` or `last.json` may hold: what is read, and
/// so what is written.
pub const MAX_STORE: u64 = 16 << 20;
/// The most one reference may take in `references.json` (its answers
/// with their tokens and logprobs; 32 answers of 2 000 tokens take about
/// 3 MiB): a quarter of the store, so that four setups at least are
/// always kept.
pub(crate) const MAX_REFERENCE: usize = (MAX_STORE / 4) as usize;
/// Where `golden accept` puts an unreadable `references.json` before it
/// writes a new one (the last one set aside only).
pub(crate) const UNREADABLE: &str = "references.json.unreadable";
/// The most one answer, or a prompts file, may hold.
const MAX_BODY: usize = 1 << 20;
const MAX_FILE: u64 = 64 << 10;

/// A setup's reference answers.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub(crate) struct Reference {
    pub(crate) fingerprint: String,
    /// The questions asked: the prompts and `max-tokens` (see
    /// [`questions`]); answers to other questions are not compared.
    #[serde(default)]
    pub(crate) questions: String,
    #[serde(default)]
    pub(crate) setup: serde_json::Value,
    pub(crate) at: String,
    pub(crate) answers: Answers,
}

/// The last check: its answers, what they were compared with and the
/// verdict.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub(crate) struct Last {
    pub(crate) fingerprint: String,
    #[serde(default)]
    pub(crate) questions: String,
    #[serde(default)]
    pub(crate) setup: serde_json::Value,
    pub(crate) at: String,
    pub(crate) verdict: String,
    pub(crate) text: String,
    pub(crate) answers: Option<Answers>,
    /// The fingerprint of the reference compared with, if any.
    pub(crate) against: Option<String>,
    pub(crate) tolerance: f64,
}

/// The prompts: the config's, then the file's (one a line, blank lines
/// skipped), at most [`crate::config::limits::GOLDEN_PROMPTS`] in all.
pub(crate) fn prompts(g: &crate::config::Golden) -> Result<Vec<String>, String> {
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

/// Why the golden prompts got no answers to compare.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Unanswered {
    /// The server gave none: nothing within the timeout, no connection
    /// (refused, cut), or a 5xx. A failed run.
    NoAnswer(String),
    /// The model has no completions API (a pooling or embedding model:
    /// vLLM answers 404 or 400 for `/v1/completions`): the check is skipped.
    NoCompletions(String),
    /// Anything else (an answer that is no completion, a prompts file that
    /// cannot be read): `golden.on-mismatch` decides.
    Other(String),
}

impl Unanswered {
    /// The verdict it is.
    pub(crate) fn verdict(self) -> Verdict {
        match self {
            Unanswered::NoAnswer(text) => Verdict::NoAnswer { text },
            Unanswered::NoCompletions(text) => Verdict::Skipped { text },
            Unanswered::Other(text) => Verdict::Failed { text },
        }
    }
}

/// What a failed request is: no answer (a timeout, no connection), or an
/// answer that could not be read.
fn unanswered(what: &str, e: client::Error, timeout: Duration) -> Unanswered {
    match e {
        client::Error::Timeout => {
            Unanswered::NoAnswer(format!("nothing within {} ({what})", humantime::format_duration(timeout)))
        }
        e @ (client::Error::Io(_) | client::Error::Http(_)) => Unanswered::NoAnswer(format!("{what}: {e}")),
        e => Unanswered::Other(format!("{what}: {e}")),
    }
}

/// Ask `prompts` of the server at `api`, all within `timeout`.
pub(crate) async fn ask(
    api: &crate::observe::health::Api,
    prompts: &[String],
    max_tokens: u32,
    timeout: Duration,
) -> Result<Answers, Unanswered> {
    let t0 = Instant::now();
    let left = || timeout.saturating_sub(t0.elapsed());
    let models = client::send(api.get(&api.url("/v1/models")).read(MAX_BODY), left())
        .await
        .map_err(|e| unanswered("/v1/models", e, timeout))?;
    if models.status.is_server_error() {
        return Err(Unanswered::NoAnswer(format!("/v1/models: HTTP {}", models.status.as_u16())));
    }
    if !models.status.is_success() {
        return Err(Unanswered::Other(format!("/v1/models: HTTP {}", models.status.as_u16())));
    }
    let models = models.json().map_err(|e| Unanswered::Other(format!("/v1/models: {e}")))?;
    let model = models["data"][0]["id"].as_str().ok_or(Unanswered::Other("/v1/models lists no model".into()))?;
    let model = model.to_string();
    let mut answers = Vec::new();
    for prompt in prompts {
        let body = serde_json::json!({
            "model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "seed": 0,
            "logprobs": 1, "return_tokens_as_token_ids": true,
        });
        let url = api.url("/v1/completions");
        let r = client::send(api.post_json(&url, &body).read(MAX_BODY), left())
            .await
            .map_err(|e| unanswered("/v1/completions", e, timeout))?;
        if !r.status.is_success() {
            let said = crate::util::escape::one_line(&String::from_utf8_lossy(&r.body), 200);
            let text = format!("/v1/completions: HTTP {}: {said}", r.status.as_u16());
            return Err(match r.status.as_u16() {
                // vLLM has no such route for a pooling model (404), or
                // refuses the task (400: "The model does not support
                // Completions API").
                404 | 400 => Unanswered::NoCompletions(text),
                500.. => Unanswered::NoAnswer(text),
                _ => Unanswered::Other(text),
            });
        }
        let v = r.json().map_err(|e| Unanswered::Other(format!("/v1/completions: {e}")))?;
        let a = answer(prompt, &v).ok_or(Unanswered::Other("/v1/completions: no choice in the answer".into()))?;
        answers.push(a);
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
/// is not references, or larger than [`MAX_STORE`], is an error: it is
/// not overwritten blindly).
pub(crate) fn references(state_dir: &Path) -> Result<Vec<Reference>, String> {
    let path = folder(state_dir).join(REFERENCES);
    match read_in(state_dir, REFERENCES, MAX_STORE) {
        Ok(text) => serde_json::from_str(&text).map_err(|e| format!("{}: {e}", path.display())),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(Vec::new()),
        Err(e) => Err(format!("{}: {e}", path.display())),
    }
}

pub(crate) fn last(state_dir: &Path) -> Result<Option<Last>, String> {
    let path = folder(state_dir).join(LAST);
    match read_in(state_dir, LAST, MAX_STORE) {
        Ok(text) => serde_json::from_str(&text).map(Some).map_err(|e| format!("{}: {e}", path.display())),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
        Err(e) => Err(format!("{}: {e}", path.display())),
    }
}

/// `name` in the golden folder, read through the state directory's and the
/// folder's descriptors without following a link (the service user owns
/// both; `golden` may be run by root); a file larger than `max` is not
/// read (a cut JSON text would only say "EOF while parsing").
fn read_in(state_dir: &Path, name: &str, max: u64) -> std::io::Result<String> {
    let dir = crate::util::fsutil::Dir::open(state_dir)?.child_dir(FOLDER.as_ref(), None)?;
    let (f, _) = dir.open_regular(name.as_ref(), false).map_err(std::io::Error::other)?;
    match crate::util::fsutil::read_capped(&f, max)? {
        Ok(bytes) => String::from_utf8(bytes).map_err(|_| std::io::Error::other("not UTF-8 text")),
        Err(size) => Err(std::io::Error::other(format!("{}, more than the {} the warden reads", mib(size), mib(max)))),
    }
}

/// Write `name` whole (a new file renamed over the old), through the state
/// directory's and the folder's descriptors, never through a link. Root
/// writing for `golden accept` leaves the folder and the file to the
/// state directory's owner, the service user, who reads and writes them
/// next.
///
/// `aside`: first rename the file there (`golden accept` replacing an
/// unreadable store keeps the old one).
fn save(state_dir: &Path, name: &str, text: &str, aside: Option<&str>) -> std::io::Result<()> {
    use std::os::unix::fs::MetadataExt;
    let state = crate::util::fsutil::Dir::open(state_dir)?;
    let dir = state.child_dir(FOLDER.as_ref(), Some(0o750))?;
    let owner = state.metadata()?;
    let owner = (nix::unistd::geteuid().is_root() && owner.uid() != 0).then_some((owner.uid(), owner.gid()));
    if let Some((uid, gid)) = owner {
        nix::unistd::fchown(dir.fd(), Some(uid.into()), Some(gid.into()))?;
    }
    if let Some(aside) = aside {
        match dir.rename(name.as_ref(), aside.as_ref()) {
            Err(e) if e.kind() != std::io::ErrorKind::NotFound => return Err(e),
            _ => {}
        }
    }
    dir.write_atomic(name.as_ref(), text.as_bytes(), 0o640, owner)
}

/// A size in MiB, for a message.
fn mib(n: u64) -> String {
    format!("{:.1} MiB", n as f64 / f64::from(1u32 << 20))
}

/// One reference as `references.json` holds it, or why it is not kept.
fn reference_text(r: &Reference) -> Result<String, String> {
    let text = serde_json::to_string(r).map_err(|e| e.to_string())?;
    if text.len() > MAX_REFERENCE {
        return Err(format!(
            "the answers take {} as a reference, more than the {} one may (fewer golden.prompts, or a smaller \
             golden.max-tokens)",
            mib(text.len() as u64),
            mib(MAX_REFERENCE as u64)
        ));
    }
    Ok(text)
}

/// `r` becomes the reference of its setup and questions among `all` (the
/// store as read; its old one replaced), and the store is written, within
/// what is read back: at most [`KEEP`] references in at most
/// [`MAX_STORE`], the oldest dropped; a reference larger than
/// [`MAX_REFERENCE`] is not kept. `aside`: see [`save`].
fn keep(state_dir: &Path, mut all: Vec<Reference>, r: Reference, aside: Option<&str>) -> Result<(), String> {
    let new = reference_text(&r)?;
    all.retain(|x| x.fingerprint != r.fingerprint || x.questions != r.questions);
    let mut texts = all.iter().map(serde_json::to_string).collect::<Result<Vec<_>, _>>().map_err(|e| e.to_string())?;
    texts.push(new);
    // `[a,b,c]`: the brackets and a comma between two.
    let mut size = texts.iter().map(|t| t.len() + 1).sum::<usize>() + 1;
    let mut drop = 0;
    while texts.len() - drop > KEEP || (size > MAX_STORE as usize && texts.len() - drop > 1) {
        size -= texts[drop].len() + 1;
        drop += 1;
    }
    if drop > 0 && texts.len() - drop < KEEP {
        tracing::info!(
            EVENT = "golden",
            "golden references: the {drop} oldest dropped to keep the store within {}",
            mib(MAX_STORE)
        );
    }
    let text = format!("[{}]", texts[drop..].join(","));
    save(state_dir, REFERENCES, &text, aside).map_err(|e| format!("cannot save the golden references: {e}"))
}

fn now() -> String {
    humantime::format_rfc3339_seconds(std::time::SystemTime::now()).to_string()
}

/// What a setup is, for the check: its fingerprint and description, and
/// the questions asked of it.
#[derive(Debug, Clone)]
pub(crate) struct Subject {
    pub(crate) fingerprint: String,
    pub(crate) setup: serde_json::Value,
    pub(crate) questions: String,
}

/// The questions: a hash of the prompts and `max-tokens`. Other prompts,
/// or longer answers, are other questions with references of their own,
/// never "changed answers".
pub(crate) fn questions(prompts: &[String], max_tokens: u32) -> String {
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
/// to be recorded, and say the verdict. Blocking (files). A store that
/// cannot be read or written is a warning ([`Verdict::Unrecorded`]), never
/// a failed check: the model answered.
pub(crate) fn judge(
    state_dir: &Path,
    subject: &Subject,
    answers: Answers,
    tolerance: f64,
    accept_changes: bool,
) -> Verdict {
    let ms = answers.ms.round() as u64;
    let prompts = answers.answers.len();
    let all = match references(state_dir) {
        Ok(r) => r,
        Err(e) => {
            // Left as it is: what it holds is not ours to throw away. The
            // answers are kept in `last.json` for `golden accept`.
            let text = format!(
                "answers not compared: the golden references are unreadable ({e}); `vllm-warden golden accept` \
                 makes these answers the reference (the file set aside as {UNREADABLE})"
            );
            let verdict = Verdict::Unrecorded { text, ms };
            save_last(state_dir, subject, &verdict, Some(answers), None, tolerance);
            return verdict;
        }
    };
    let (verdict, new_ref, against, accepted) = {
        let refs: Vec<&Reference> = all.iter().filter(|r| r.questions == subject.questions).collect();
        let own = refs.iter().copied().find(|r| r.fingerprint == subject.fingerprint);
        // A new setup is compared with the latest reference of another.
        let against = own.or_else(|| refs.last().copied());
        let (verdict, new_ref, accepted) = match against {
            None => (Verdict::Recorded { prompts, ms }, true, false),
            Some(r) => match compare(&r.answers, &answers, tolerance) {
                Ok(()) => (Verdict::Same { prompts, ms }, own.is_none(), false),
                Err(d) => {
                    let after = if own.is_some() {
                        "with the same setup".to_string()
                    } else {
                        let changes = setup_changes(&r.setup, &subject.setup);
                        format!("after {}", changes.join("; "))
                    };
                    let text = format!("answers changed {after}: prompt {:?}, {}", short(&d.prompt), d.what);
                    let accept = accept_changes && own.is_none();
                    (Verdict::Changed { text, ms }, accept, accept)
                }
            },
        };
        (verdict, new_ref, against.map(|r| r.fingerprint.clone()), accepted)
    };
    let recorded = if new_ref {
        let r = Reference {
            fingerprint: subject.fingerprint.clone(),
            questions: subject.questions.clone(),
            setup: subject.setup.clone(),
            at: now(),
            answers: answers.clone(),
        };
        keep(state_dir, all, r, None)
    } else {
        Ok(())
    };
    let verdict = match (verdict, recorded) {
        (Verdict::Changed { text, ms }, Ok(())) if accepted => {
            Verdict::Changed { text: format!("{text} (accepted: golden.accept-changes)"), ms }
        }
        (Verdict::Changed { text, ms }, Err(e)) => Verdict::Changed { text: format!("{text} (not accepted: {e})"), ms },
        (Verdict::Recorded { .. }, Err(e)) => {
            Verdict::Unrecorded { text: format!("answers not recorded as the reference: {e}"), ms }
        }
        (Verdict::Same { .. }, Err(e)) => Verdict::Unrecorded {
            text: format!(
                "answers as the reference of setup {}, not recorded as this setup's: {e}",
                short(against.as_deref().unwrap_or_default())
            ),
            ms,
        },
        (v, _) => v,
    };
    save_last(state_dir, subject, &verdict, Some(answers), against, tolerance);
    verdict
}

/// Record that the check could not be made, and why.
pub(crate) fn failed(state_dir: &Path, subject: &Subject, why: Unanswered, tolerance: f64) -> Verdict {
    let verdict = why.verdict();
    save_last(state_dir, subject, &verdict, None, None, tolerance);
    verdict
}

/// `last.json`: this check, for `golden show`, `diff` and `accept`; its
/// answers only when they could be a reference (within what is read).
fn save_last(
    state_dir: &Path,
    subject: &Subject,
    verdict: &Verdict,
    answers: Option<Answers>,
    against: Option<String>,
    tolerance: f64,
) {
    let mut last = Last {
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
    let mut text = serde_json::to_string(&last);
    if text.as_ref().is_ok_and(|t| t.len() > MAX_REFERENCE) {
        last.answers = None;
        text = serde_json::to_string(&last);
    }
    let saved = text.map_err(std::io::Error::other).and_then(|t| save(state_dir, LAST, &t, None));
    if let Err(e) = saved {
        tracing::warn!(error = %e, "cannot save the last golden answers");
    }
}

fn short(s: &str) -> String {
    let s: String = s.chars().take(60).collect();
    crate::util::escape::one_line(&s, 80)
}

/// The file of a failure report with the answers side by side.
pub(crate) const REPORT_FILE: &str = "golden.txt";

/// The last answers beside the reference they were compared with, token by
/// token; none without both.
pub(crate) fn diff(state_dir: &Path) -> Option<String> {
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

/// What `golden accept` did: the setup whose reference the last answers
/// became, and the error of the unreadable store it set aside, if any.
#[derive(Debug)]
pub(crate) struct Accepted {
    pub(crate) fingerprint: String,
    pub(crate) replaced: Option<String>,
}

/// `golden accept`: the last answers become the reference of their setup.
/// An unreadable store is set aside ([`UNREADABLE`]) and a new one begun
/// with them.
pub(crate) fn accept(state_dir: &Path) -> Result<Accepted, String> {
    let last = last(state_dir)?.ok_or("no golden answers yet")?;
    let answers = last.answers.ok_or_else(|| format!("the last golden check kept no answers: {}", last.text))?;
    let (all, replaced) = match references(state_dir) {
        Ok(all) => (all, None),
        Err(e) => (Vec::new(), Some(e)),
    };
    let r = Reference {
        fingerprint: last.fingerprint.clone(),
        questions: last.questions,
        setup: last.setup,
        at: now(),
        answers,
    };
    keep(state_dir, all, r, replaced.as_ref().map(|_| UNREADABLE))?;
    Ok(Accepted { fingerprint: last.fingerprint, replaced })
}

/// What differs between two setups, key by key: the reason of a verdict
/// whose answers changed with the setup (and what `loads`, `setups` and a
/// rollback show).
pub(crate) fn setup_changes(a: &serde_json::Value, b: &serde_json::Value) -> Vec<String> {
    use serde_json::Value;
    let mut out = Vec::new();
    let str_of = |v: Option<&Value>| match v {
        None | Some(Value::Null) => "(none)".to_string(),
        Some(Value::String(s)) => crate::util::escape::one_line(s, 300),
        Some(v) => crate::util::escape::one_line(&v.to_string(), 300),
    };
    for key in ["vllm", "command"] {
        let (x, y) = (a.get(key), b.get(key));
        if x != y {
            out.push(format!("{key}: {} → {}", str_of(x), str_of(y)));
        }
    }
    for key in ["env", "patched"] {
        let empty = serde_json::Map::new();
        let x = a.get(key).and_then(Value::as_object).unwrap_or(&empty);
        let y = b.get(key).and_then(Value::as_object).unwrap_or(&empty);
        let mut names: Vec<&String> = x.keys().chain(y.keys()).collect();
        names.sort();
        names.dedup();
        for n in names {
            if x.get(n) != y.get(n) {
                // A file's sha256 is told by its first 12 digits.
                let str_of = |v: Option<&Value>| {
                    let s = str_of(v);
                    if key == "patched" && s.len() == 64 { s[..12].to_string() } else { s }
                };
                out.push(format!(
                    "{key} {}: {} → {}",
                    crate::util::escape::one_line(n, 300),
                    str_of(x.get(n)),
                    str_of(y.get(n))
                ));
            }
        }
    }
    if out.is_empty() {
        out.push("(the records hold no more of the setups)".into());
    }
    out
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
        assert_eq!(accept(s).unwrap().fingerprint, "c");
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
        assert!(matches!(v, Verdict::Unrecorded { .. }), "{v:?}");
        assert_eq!(std::fs::read_dir(&elsewhere).unwrap().count(), 0);
        assert!(accept(&state).is_err());
        assert_eq!(std::fs::read_dir(&elsewhere).unwrap().count(), 0);
        std::fs::write(elsewhere.join(LAST), "{}").unwrap();
        assert!(last(&state).is_err());
    }

    /// An unreadable store is a warning, left as it is, until `golden
    /// accept` sets it aside and begins a new one with the last answers.
    #[test]
    fn an_unreadable_references_file_is_a_warning_kept_until_accept_replaces_it() {
        let d = tempfile::tempdir().unwrap();
        let s = d.path();
        std::fs::create_dir_all(s.join(FOLDER)).unwrap();
        std::fs::write(s.join(FOLDER).join(REFERENCES), "not json").unwrap();
        let v = judge(s, &subject("a", "x"), answers(&["1"]), 1e-3, false);
        let Verdict::Unrecorded { text, .. } = &v else { panic!("{v:?}") };
        assert!(text.starts_with("answers not compared: the golden references are unreadable ("), "{text}");
        assert!(text.contains("`vllm-warden golden accept` makes these answers the reference"), "{text}");
        assert_eq!(std::fs::read_to_string(s.join(FOLDER).join(REFERENCES)).unwrap(), "not json");
        assert_eq!(last(s).unwrap().unwrap().verdict, "unrecorded");

        let done = accept(s).unwrap();
        assert_eq!(done.fingerprint, "a");
        assert!(done.replaced.is_some_and(|e| e.contains("references.json: expected ident")));
        assert_eq!(std::fs::read_to_string(s.join(FOLDER).join(UNREADABLE)).unwrap(), "not json");
        assert_eq!(references(s).unwrap().len(), 1);
        assert_eq!(judge(s, &subject("a", "x"), answers(&["1"]), 1e-3, false).name(), "same");
    }

    /// Answers of `tokens` tokens of `width` bytes each.
    fn wide(tokens: usize, width: usize, seed: char) -> Answers {
        let t: String = std::iter::repeat_n(seed, width).collect();
        Answers {
            answers: vec![Answer {
                prompt: "p".into(),
                tokens: vec![t; tokens],
                logprobs: vec![Some(-0.5); tokens],
                text: String::new(),
            }],
            ms: 1.0,
        }
    }

    /// The store is written within what is read: the oldest references
    /// dropped for room, the newest always kept, every write readable.
    #[test]
    fn the_store_never_outgrows_what_is_read() {
        let d = tempfile::tempdir().unwrap();
        let s = d.path();
        // About 3.4 MiB a reference: four fit in 16 MiB, not five.
        let size = 3_500_000 / 1000;
        for (i, seed) in ('a'..='e').enumerate() {
            let v = judge(s, &subject(&format!("s{i}"), &format!("c{i}")), wide(size, 1000, seed), 1e-3, true);
            assert!(matches!(v, Verdict::Recorded { .. } | Verdict::Changed { .. }), "{i}: {v:?}");
            assert!(!v.text().contains("not accepted"), "{i}: {v:?}");
            let len = std::fs::metadata(s.join(FOLDER).join(REFERENCES)).unwrap().len();
            assert!(len <= MAX_STORE, "{i}: {len}");
        }
        let kept: Vec<String> = references(s).unwrap().into_iter().map(|r| r.fingerprint).collect();
        assert_eq!(kept, ["s1", "s2", "s3", "s4"]);
        assert!(std::fs::metadata(s.join(FOLDER).join(LAST)).unwrap().len() <= MAX_STORE);
        assert_eq!(accept(s).unwrap().fingerprint, "s4");
    }

    /// A reference larger than one may be is not kept: a warning, the
    /// store as it was; `last.json` keeps no answers it could not read.
    #[test]
    fn answers_too_large_to_keep_are_a_warning_and_the_store_is_unchanged() {
        let d = tempfile::tempdir().unwrap();
        let s = d.path();
        assert_eq!(judge(s, &subject("a", "x"), answers(&["1"]), 1e-3, false).name(), "recorded");
        let before = std::fs::read(s.join(FOLDER).join(REFERENCES)).unwrap();
        let v = judge(s, &subject("b", "y"), wide(MAX_REFERENCE / 1000 + 1, 1000, 'z'), 1e-3, true);
        let Verdict::Changed { text, .. } = &v else { panic!("{v:?}") };
        assert!(
            text.contains("(not accepted: the answers take 4.0 MiB as a reference, more than the 4.0 MiB"),
            "{text}"
        );
        let v = judge(s, &Subject { questions: "q2".into(), ..subject("b", "y") }, wide(5000, 1000, 'z'), 1e-3, false);
        let Verdict::Unrecorded { text, .. } = &v else { panic!("{v:?}") };
        assert!(text.starts_with("answers not recorded as the reference: the answers take 4.8 MiB"), "{text}");
        assert_eq!(std::fs::read(s.join(FOLDER).join(REFERENCES)).unwrap(), before);
        let l = last(s).unwrap().unwrap();
        assert_eq!((l.verdict.as_str(), l.answers.is_none()), ("unrecorded", true));
        let e = accept(s).unwrap_err();
        assert!(e.starts_with("the last golden check kept no answers: answers not recorded"), "{e}");
    }

    /// A store larger than what is read (an older warden's) says so, not
    /// "EOF while parsing".
    #[test]
    fn a_store_larger_than_what_is_read_says_so() {
        let d = tempfile::tempdir().unwrap();
        std::fs::create_dir_all(d.path().join(FOLDER)).unwrap();
        let f = std::fs::File::create(d.path().join(FOLDER).join(REFERENCES)).unwrap();
        f.set_len(MAX_STORE + 1).unwrap();
        let e = references(d.path()).unwrap_err();
        assert!(e.ends_with("references.json: 16.0 MiB, more than the 16.0 MiB the warden reads"), "{e}");
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
