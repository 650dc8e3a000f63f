//! Masking secrets wherever text leaves the warden: the child's command
//! and environment as the warden prints them, other processes' command
//! lines (port holders, leftovers), and any free text on its way to the
//! journal, `STATUS=`, the status document or a terminal.
//!
//! What counts as a secret:
//! - the value of a command-line option whose name has a word `key`,
//!   `apikey`, `token`, `secret`, `password`, `passwd`, `credential(s)` or
//!   `auth` (`--api-key`, `--api_key`, `--hf-token`, `--token`,
//!   `--db-password`), written `--opt=value` or `--opt value`; words, not
//!   substrings, so `--max-num-batched-tokens` and `--tokenizer` stay shown;
//! - the value of an environment variable whose name contains `TOKEN`,
//!   `KEY`, `SECRET`, `PASSWORD`, `PASSWD`, `CREDENTIAL` or `AUTH`;
//! - the user information of any URL (`https://user:pw@host` →
//!   `https://***@host`), `HTTPS_PROXY=http://u:pw@proxy` included;
//! - in free text, the value of a Python dict entry whose key names a
//!   secret as an option does (`'api_key': ['sk-1']`, as vLLM prints its
//!   non-default arguments).

use std::borrow::Cow;
use std::collections::BTreeMap;
use std::sync::LazyLock;

use regex::Regex;

const MASK: &str = "***";

const OPTION_WORDS: [&str; 9] =
    ["key", "apikey", "token", "secret", "password", "passwd", "credential", "credentials", "auth"];
const ENV_WORDS: [&str; 7] = ["TOKEN", "KEY", "SECRET", "PASSWORD", "PASSWD", "CREDENTIAL", "AUTH"];

/// `--name` (without its value) names a secret.
fn secret_option(name: &str) -> bool {
    name.strip_prefix("--")
        .is_some_and(|n| n.split(['-', '_']).any(|w| OPTION_WORDS.iter().any(|s| w.eq_ignore_ascii_case(s))))
}

/// An environment variable's name names a secret.
pub(crate) fn secret_key(key: &str) -> bool {
    let k = key.to_ascii_uppercase();
    ENV_WORDS.iter().any(|w| k.contains(w))
}

static URL_USERINFO: LazyLock<Regex> =
    LazyLock::new(|| Regex::new(r"([A-Za-z][A-Za-z0-9+.-]*://)[^/\s@]+@").expect("static regex"));
/// Anything that could hold a secret: the cheap test before the others.
static MAYBE: LazyLock<Regex> =
    LazyLock::new(|| Regex::new(r"(?i)://|key|token|secret|passw|credential|auth").expect("static regex"));
static OPTION: LazyLock<Regex> =
    LazyLock::new(|| Regex::new(r"(--[A-Za-z0-9][A-Za-z0-9_-]*)(=|[ \t]+)([^\s]+)").expect("static regex"));
static DICT_ENTRY: LazyLock<Regex> = LazyLock::new(|| {
    Regex::new(r#"(['"])([A-Za-z0-9_-]+)(['"]):(\s*)('[^']*'|"[^"]*"|\[[^\]]*\])"#).expect("static regex")
});
static ENV_PAIR: LazyLock<Regex> =
    LazyLock::new(|| Regex::new(r"\b([A-Za-z_][A-Za-z0-9_]*)=([^\s]+)").expect("static regex"));

/// One argument with the user information of any URL in it masked.
fn url(arg: &str) -> Cow<'_, str> {
    if arg.contains("://") { URL_USERINFO.replace_all(arg, format!("${{1}}{MASK}@")) } else { Cow::Borrowed(arg) }
}

/// The command line, each argument quoted when it needs to be, secrets masked.
pub(crate) fn command(argv: &[String]) -> String {
    let mut out = Vec::with_capacity(argv.len());
    let mut mask_next = false;
    for arg in argv {
        if mask_next {
            out.push(MASK.to_string());
            mask_next = false;
        } else if let Some((name, _)) = arg.split_once('=')
            && secret_option(name)
        {
            out.push(format!("{name}={MASK}"));
        } else if secret_option(arg) {
            out.push(arg.clone());
            mask_next = true;
        } else if let Some((name, _)) = arg.split_once('=')
            && !name.starts_with('-')
            && secret_key(name)
        {
            out.push(format!("{name}={MASK}"));
        } else {
            out.push(quote(&url(arg)));
        }
    }
    out.join(" ")
}

/// `KEY=value` pairs, secrets masked.
pub(crate) fn env(env: &BTreeMap<String, String>) -> String {
    env.iter()
        .map(|(k, v)| if secret_key(k) { format!("{k}={MASK}") } else { format!("{k}={}", quote(&url(v))) })
        .collect::<Vec<_>>()
        .join(" ")
}

/// Free text (a log line, a cause, a status) with every secret the rules
/// above can see masked. Text with nothing that could be one is returned
/// as it is, after one cheap scan.
pub(crate) fn text(s: &str) -> Cow<'_, str> {
    if !MAYBE.is_match(s) {
        return Cow::Borrowed(s);
    }
    let s = url(s);
    let s = match OPTION.replace_all(&s, |c: &regex::Captures<'_>| {
        if secret_option(&c[1]) { format!("{}{}{MASK}", &c[1], &c[2]) } else { c[0].to_string() }
    }) {
        Cow::Borrowed(_) => s,
        Cow::Owned(o) => Cow::Owned(o),
    };
    let s = match DICT_ENTRY.replace_all(&s, |c: &regex::Captures<'_>| {
        if secret_option(&format!("--{}", &c[2])) {
            format!("{}{}{}:{}'{MASK}'", &c[1], &c[2], &c[3], &c[4])
        } else {
            c[0].to_string()
        }
    }) {
        Cow::Borrowed(_) => s,
        Cow::Owned(o) => Cow::Owned(o),
    };
    let masked =
        ENV_PAIR.replace_all(
            &s,
            |c: &regex::Captures<'_>| {
                if secret_key(&c[1]) { format!("{}={MASK}", &c[1]) } else { c[0].to_string() }
            },
        );
    match masked {
        Cow::Borrowed(_) => s,
        Cow::Owned(o) => Cow::Owned(o),
    }
}

fn quote(s: &str) -> String {
    if !s.is_empty() && s.chars().all(|c| c.is_ascii_alphanumeric() || "-_./:=,+@%*".contains(c)) {
        s.to_string()
    } else {
        format!("'{}'", s.replace('\'', r"'\''"))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn api_key_is_masked_in_both_spellings() {
        let argv: Vec<String> = ["vllm", "serve", "/m", "--api-key", "sk-123", "--api-key=sk-456", "--port", "8000"]
            .map(String::from)
            .to_vec();
        assert_eq!(command(&argv), "vllm serve /m --api-key *** --api-key=*** --port 8000");
    }

    #[test]
    fn secret_env_values_are_masked() {
        let mut e = BTreeMap::new();
        e.insert("HF_TOKEN".to_string(), "hf_abc".to_string());
        e.insert("OPENAI_API_KEY".to_string(), "sk".to_string());
        e.insert("MY_SECRET_THING".to_string(), "x".to_string());
        e.insert("VLLM_ATTENTION_BACKEND".to_string(), "TRITON_MLA".to_string());
        assert_eq!(env(&e), "HF_TOKEN=*** MY_SECRET_THING=*** OPENAI_API_KEY=*** VLLM_ATTENTION_BACKEND=TRITON_MLA");
    }

    /// Issue "untrickable", case 6: every spelling of a secret is masked.
    #[test]
    fn secrets_in_clear_every_spelling_is_masked() {
        let argv: Vec<String> = [
            "vllm",
            "serve",
            "/m",
            "--hf-token",
            "hf_a",
            "--hf-token=hf_b",
            "--api_key",
            "k1",
            "--token=t",
            "--db-password",
            "pw",
            "--max-num-batched-tokens",
            "8192",
            "--tokenizer",
            "/t",
            "--download-dir",
            "https://user:pw@host/x",
            "DB_PASSWORD=x",
        ]
        .map(String::from)
        .to_vec();
        assert_eq!(
            command(&argv),
            "vllm serve /m --hf-token *** --hf-token=*** --api_key *** --token=*** --db-password *** \
             --max-num-batched-tokens 8192 --tokenizer /t --download-dir https://***@host/x DB_PASSWORD=***"
        );
        let mut e = BTreeMap::new();
        e.insert("HTTPS_PROXY".to_string(), "http://u:pw@proxy:3128".to_string());
        e.insert("PGPASSWD".to_string(), "x".to_string());
        e.insert("AWS_CREDENTIAL_FILE".to_string(), "/c".to_string());
        e.insert("BASIC_AUTH".to_string(), "u:p".to_string());
        assert_eq!(env(&e), "AWS_CREDENTIAL_FILE=*** BASIC_AUTH=*** HTTPS_PROXY=http://***@proxy:3128 PGPASSWD=***");
    }

    #[test]
    fn secrets_in_clear_free_text_is_masked_and_plain_text_is_untouched() {
        let line = "ERROR crash: vllm serve /m --api-key sk-1 --hf-token=hf_2 from https://a:b@h/p with HF_TOKEN=hf_3";
        assert_eq!(
            text(line),
            "ERROR crash: vllm serve /m --api-key *** --hf-token=*** from https://***@h/p with HF_TOKEN=***"
        );
        let plain = "Loading safetensors checkpoint shards: 45% Completed | 29/64";
        assert!(matches!(text(plain), Cow::Borrowed(_)));
        assert_eq!(text("--max-num-batched-tokens 8192"), "--max-num-batched-tokens 8192");
    }

    #[test]
    fn secrets_in_vllm_s_argument_dict_are_masked() {
        let line = "(APIServer pid=1) INFO 11-29 18:22:32 [api_utils.py:286] non-default args: {'model_tag': '/m', \
                    'api_key': ['sk-1', 'sk-2'], \"hf_token\": \"hf_x\", 'max_num_batched_tokens': 8192}";
        assert_eq!(
            text(line),
            "(APIServer pid=1) INFO 11-29 18:22:32 [api_utils.py:286] non-default args: {'model_tag': '/m', \
             'api_key': '***', \"hf_token\": '***', 'max_num_batched_tokens': 8192}"
        );
    }

    #[test]
    fn odd_arguments_are_quoted() {
        assert_eq!(command(&["a b".to_string(), "it's".to_string()]), r"'a b' 'it'\''s'");
    }
}
