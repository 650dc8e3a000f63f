//! Masking secrets wherever the warden prints the child's command or
//! environment: the argument after `--api-key`, and values of environment
//! keys containing `TOKEN`, `KEY` or `SECRET`.

use std::collections::BTreeMap;

const MASK: &str = "***";

/// The command line, each argument quoted when it needs to be, secrets masked.
pub fn command(argv: &[String]) -> String {
    let mut out = Vec::with_capacity(argv.len());
    let mut mask_next = false;
    for arg in argv {
        if mask_next {
            out.push(MASK.to_string());
            mask_next = false;
        } else if arg == "--api-key" {
            out.push(arg.clone());
            mask_next = true;
        } else if arg.starts_with("--api-key=") {
            out.push(format!("--api-key={MASK}"));
        } else {
            out.push(quote(arg));
        }
    }
    out.join(" ")
}

/// `KEY=value` pairs, secrets masked.
pub fn env(env: &BTreeMap<String, String>) -> String {
    env.iter()
        .map(|(k, v)| if secret_key(k) { format!("{k}={MASK}") } else { format!("{k}={}", quote(v)) })
        .collect::<Vec<_>>()
        .join(" ")
}

fn secret_key(key: &str) -> bool {
    let k = key.to_ascii_uppercase();
    ["TOKEN", "KEY", "SECRET"].iter().any(|w| k.contains(w))
}

fn quote(s: &str) -> String {
    if !s.is_empty() && s.chars().all(|c| c.is_ascii_alphanumeric() || "-_./:=,+@%".contains(c)) {
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

    #[test]
    fn odd_arguments_are_quoted() {
        assert_eq!(command(&["a b".to_string(), "it's".to_string()]), r"'a b' 'it'\''s'");
    }
}
