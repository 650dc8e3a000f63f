//! Scenario 16: a client's bad requests never restart the model (issue 56).
//! vLLM 0.32's API server logs a traceback for some of them (a streamed
//! request whose error is found once the stream has begun); a traceback
//! was a fatal line, so one request could fail a serving run. One load,
//! then a corpus of bad requests through the front door: malformed JSON,
//! unknown and out-of-range parameters, prompts over the context, token ids
//! out of the vocabulary, bad `logit_bias`, structured-output regexes and
//! JSON schemas vLLM rejects (one quoting the words of fatal lines), tools
//! it refuses; each plain and streamed. Then a good completion, and the
//! last request: one the config's `fatal.match` names (its access line),
//! whose fatal line must be the first of the run: every line before it was
//! classified and none was fatal. Prints the answers counted by kind.

use std::collections::BTreeMap;
use std::io::{Read, Write};
use std::path::Path;
use std::time::Duration;

use crate::common::real::{GRACE, MARGIN, budget, ceiling, model, vllm};
use crate::common::{Warden, free_port, secs};

/// A ready child's stop (`child.stop-timeout`).
const STOP: Duration = Duration::from_secs(30);

/// One request's answer.
const ANSWER: Duration = Duration::from_secs(60);

fn config(d: &Path, front: u16, model: &Path, tag: &str) -> String {
    let template = d.join("chat.jinja");
    std::fs::write(&template, "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}assistant:")
        .unwrap();
    format!(
        r#"name = "t"
[child]
command = ["{vllm}", "serve", "{model}", "--max-model-len", "256", "--enforce-eager",
           "--gpu-memory-utilization", "0.5", "--chat-template", "{template}"]
env = {{ HF_HUB_OFFLINE = "1", VLLM_CPU_KVCACHE_SPACE = "1" }}
log-file = "{d}/t.log"
stop-timeout = "{stop}s"
[ready]
timeout = "{ceiling}s"
stall = "{ceiling}s"
[fatal]
grace = "{grace}s"
match = ["GET /s16-last-request-{tag} "]
[prestart]
gpu-idle-wait = "0s"
[status]
file = "{d}/status.json"
[front]
listen = "127.0.0.1:{front}"
"#,
        vllm = vllm(),
        model = model.display(),
        template = template.display(),
        d = d.display(),
        stop = STOP.as_secs(),
        ceiling = ceiling().0.as_secs(),
        grace = GRACE.as_secs(),
    )
}

/// `METHOD path` with `body` on a connection of its own (HTTP/1.1,
/// `Connection: close`): the status and the body as sent (a stream's
/// chunks raw), or why there was none.
fn request(port: u16, method: &str, path: &str, body: &[u8]) -> Result<(u16, String), String> {
    let mut s = std::net::TcpStream::connect(("127.0.0.1", port)).map_err(|e| e.to_string())?;
    s.set_read_timeout(Some(ANSWER)).map_err(|e| e.to_string())?;
    let head = format!(
        "{method} {path} HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n",
        body.len()
    );
    s.write_all(head.as_bytes()).and_then(|_| s.write_all(body)).map_err(|e| e.to_string())?;
    let mut out = Vec::new();
    s.read_to_end(&mut out).map_err(|e| e.to_string())?;
    let text = String::from_utf8_lossy(&out).into_owned();
    let status = text.get(9..12).and_then(|c| c.parse().ok()).ok_or_else(|| format!("no status: {text:?}"))?;
    let body = text.split_once("\r\n\r\n").map_or("", |(_, b)| b).to_string();
    Ok((status, body))
}

/// The kind of an answer, for the counts.
fn kind(answer: &Result<(u16, String), String>) -> String {
    match answer {
        Err(_) => "no answer".into(),
        Ok((200, body)) if body.contains("data: {\"error\"") => "200, the stream's error event".into(),
        Ok((200, body)) if body.contains("data: [DONE]") => "200, streamed".into(),
        Ok((200, _)) => "200".into(),
        Ok((code, _)) => code.to_string(),
    }
}

/// The corpus: a name, the path, the body.
fn corpus(model: &str) -> Vec<(String, &'static str, Vec<u8>)> {
    use serde_json::json;
    let (c, ch) = ("/v1/completions", "/v1/chat/completions");
    let msgs = json!([{"role": "user", "content": "hi"}]);
    let mut out: Vec<(String, &'static str, Vec<u8>)> = vec![
        ("malformed JSON".into(), c, br#"{"model": "x", "prompt": "#.to_vec()),
        ("not an object".into(), c, b"[1,2,3]".to_vec()),
        ("malformed JSON, chat".into(), ch, b"{\"messages\": [".to_vec()),
    ];
    let faults = json!("EngineDeadError CUDA error NCCL error Traceback (most recent call last)");
    let bad_tool = json!([{"type": "function", "function": {"name": "f",
        "parameters": {"type": "object", "properties": {"a": {"type": "nonsense"}}}}}]);
    let completions = [
        ("an unknown parameter", json!({"prompt": "a", "max_tokens": 2, "bogus_param": 1})),
        ("temperature -1", json!({"prompt": "a", "max_tokens": 2, "temperature": -1})),
        ("top_p 2", json!({"prompt": "a", "max_tokens": 2, "top_p": 2})),
        ("max_tokens -5", json!({"prompt": "a", "max_tokens": -5})),
        ("n 0", json!({"prompt": "a", "max_tokens": 2, "n": 0})),
        ("logprobs 100", json!({"prompt": "a", "max_tokens": 2, "logprobs": 100})),
        ("max_tokens over the context", json!({"prompt": "a", "max_tokens": 1_000_000_000})),
        ("an unknown model", json!({"model": "nope", "prompt": "a", "max_tokens": 2})),
        ("a prompt over the context", json!({"prompt": "hello ".repeat(600), "max_tokens": 2})),
        ("token ids over the context", json!({"prompt": vec![5; 300], "max_tokens": 2})),
        ("a token id out of the vocabulary", json!({"prompt": [1, 2, 999_999], "max_tokens": 2})),
        ("a negative token id", json!({"prompt": [1, -5], "max_tokens": 2})),
        (
            "a token id of 2^70",
            json!({"prompt": serde_json::from_str::<serde_json::Value>("[1, 1180591620717411303424]").unwrap(), "max_tokens": 2}),
        ),
        ("an empty token list", json!({"prompt": [], "max_tokens": 2})),
        ("logit_bias of a key not a number", json!({"prompt": "a", "max_tokens": 2, "logit_bias": {"abc": 1}})),
        ("logit_bias out of the vocabulary", json!({"prompt": "a", "max_tokens": 2, "logit_bias": {"999999": 5}})),
        ("logit_bias of 1e9", json!({"prompt": "a", "max_tokens": 2, "logit_bias": {"5": 1e9}})),
        (
            "a JSON schema of an unknown type",
            json!({"prompt": "a", "max_tokens": 2,
            "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nonsense"}}}}),
        ),
        (
            "a JSON schema quoting fatal words",
            json!({"prompt": "a", "max_tokens": 2,
            "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": faults}}}}),
        ),
        (
            "a JSON schema of a dangling $ref",
            json!({"prompt": "a", "max_tokens": 2,
            "structured_outputs": {"json": {"type": "object", "properties": {"a": {"$ref": "#/nowhere"}}}}}),
        ),
        (
            "a regex not closed",
            json!({"prompt": "a", "max_tokens": 2, "structured_outputs": {"regex": "(CUDA error["}}),
        ),
        (
            "a grammar not closed",
            json!({"prompt": "a", "max_tokens": 2, "structured_outputs": {"grammar": "root ::= ("}}),
        ),
    ];
    let chats = [
        (
            "chat: logit_bias out of the vocabulary",
            json!({"messages": msgs, "max_tokens": 2, "logit_bias": {"999999": 5}}),
        ),
        (
            "chat: a regex not closed",
            json!({"messages": msgs, "max_tokens": 2, "structured_outputs": {"regex": "(unclosed["}}),
        ),
        (
            "chat: a tool schema it cannot parse, required",
            json!({"messages": msgs, "max_tokens": 2, "tools": bad_tool, "tool_choice": "required"}),
        ),
        (
            "chat: a tool schema it cannot parse, named",
            json!({"messages": msgs, "max_tokens": 2, "tools": bad_tool,
            "tool_choice": {"type": "function", "function": {"name": "f"}}}),
        ),
        (
            "chat: a tool schema it cannot parse, none",
            json!({"messages": msgs, "max_tokens": 2, "tools": bad_tool, "tool_choice": "none"}),
        ),
        ("chat: tools not a list", json!({"messages": msgs, "max_tokens": 2, "tools": "x"})),
        ("chat: a role it does not know", json!({"messages": [{"role": "wizard", "content": "x"}], "max_tokens": 2})),
        (
            "chat: an image to a text model",
            json!({"messages": [{"role": "user", "content": [{"type": "image_url",
            "image_url": {"url": "file:///etc/passwd"}}]}], "max_tokens": 2}),
        ),
        ("chat: a template of its own", json!({"messages": msgs, "max_tokens": 2, "chat_template": "{% for %}"})),
    ];
    for (path, list) in [(c, &completions[..]), (ch, &chats[..])] {
        for (name, body) in list {
            for stream in [false, true] {
                let mut body = body.clone();
                body.as_object_mut().unwrap().entry("model").or_insert(json!(model));
                if stream {
                    body["stream"] = json!(true);
                }
                let name = if stream { format!("{name}, streamed") } else { name.to_string() };
                out.push((name, path, body.to_string().into_bytes()));
            }
        }
    }
    out
}

/// Scenario 16 (see the module's text). Needs nothing beyond the others.
#[test]
#[ignore]
fn s16_a_clients_bad_requests_never_restart_the_model() {
    let ready = budget(1, Duration::ZERO);
    let failing = MARGIN;
    eprintln!(
        "scenario 16 budgets (load ceiling {}): READY=1 {}, each answer {}, the last request's fatal line {}, stop {}",
        secs(ceiling().0),
        secs(ready),
        secs(ANSWER),
        secs(failing),
        secs(STOP + MARGIN)
    );
    let (front, tag) = (free_port(), format!("{}-{}", std::process::id(), free_port()));
    let tiny = model("tiny");
    let mut w = Warden::start(|d, _| config(d, front, &tiny, &tag));
    w.wait_ready_within(ready, "READY=1 (one load)");
    w.wait_note("ready", |n| n.starts_with("STATUS=ready: pid "));
    let model = tiny.display().to_string();
    let mut counts: BTreeMap<String, Vec<String>> = BTreeMap::new();
    let sent = corpus(&model);
    for (name, path, body) in &sent {
        let answer = request(front, "POST", path, body);
        let k = kind(&answer);
        assert!(!matches!(answer, Err(_) | Ok((502..=504, _))), "{name}: the engine did not answer: {answer:?}");
        counts.entry(k).or_default().push(name.clone());
    }
    let good = serde_json::json!({"model": model, "prompt": "The capital of France is", "max_tokens": 4});
    let (status, body) = request(front, "POST", "/v1/completions", good.to_string().as_bytes()).unwrap();
    assert!(status == 200 && body.contains("\"choices\""), "{status} {body}");
    let (status, _) = request(front, "GET", &format!("/s16-last-request-{tag}"), b"").unwrap();
    assert_eq!(status, 404);
    let first = w.wait_note_within(failing, "the last request's fatal line", |n| n.starts_with("STATUS=failing: "));
    assert!(first.contains(&format!("/s16-last-request-{tag}")), "a line before the last request was fatal: {first}");
    let log = std::fs::read_to_string(w.path("t.log")).unwrap();
    let tracebacks = log.matches("Traceback (most recent call last)").count();
    let records = log.matches(" stream generator.").count();
    let doc: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(w.path("status.json")).unwrap()).unwrap();
    assert_eq!((doc["restarts"].as_u64(), doc["attempt"].as_u64()), (Some(0), Some(1)), "{doc}");
    // The journal's line may follow the note by a moment (another thread
    // writes it): waited for, then counted.
    w.wait_logged("fatal line: ");
    assert_eq!(w.stderr().matches("fatal line: ").count(), 1, "the last request's only");
    let code = w.stop_within(STOP + MARGIN, "the warden's exit after SIGTERM while serving");
    assert!(tracebacks > 0, "no request made vLLM log a traceback: the scenario tests nothing");
    eprintln!(
        "scenario 16 bad requests: PASS  {} requests, 0 restarts; vLLM logged {tracebacks} traceback(s) in {records} \
         request record(s), 0 fatal lines; the warden's exit {code}",
        sent.len()
    );
    for (k, names) in &counts {
        eprintln!("scenario 16 answers {k}: {} ({})", names.len(), names.join("; "));
    }
}
