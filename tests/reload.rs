//! `vllm-warden reload`, the unit's `ExecReload=`: it asks the running
//! warden over the control socket to read its config again and waits for
//! the verdict — applied in place, restarting the child, or refused with
//! every problem — with the real binary and the simulated vLLM. The
//! verdict is also in the status document and the metrics.

mod common;

use common::{Warden, config};

const FAST: &str = "[restart]\ninitial-delay = \"0s\"\n";

/// `vllm-warden reload -c FILE` as the unit runs it: its exit code, stdout
/// and stderr.
fn reload(w: &Warden) -> (i32, String, String) {
    let o = std::process::Command::new(common::exe())
        .args(["reload", "-c"])
        .arg(w.path("t.toml"))
        .env("RUNTIME_DIRECTORY", w.path("run"))
        .output()
        .unwrap();
    let text = |b: &[u8]| String::from_utf8_lossy(b).into_owned();
    (o.status.code().unwrap(), text(&o.stdout), text(&o.stderr))
}

fn doc(w: &Warden) -> serde_json::Value {
    serde_json::from_str(&std::fs::read_to_string(w.path("status.json")).unwrap()).unwrap()
}

/// The status files are written off the loop, a moment after the verdict
/// is answered: wait for them to say `outcome`.
fn wait_outcome(w: &mut Warden, outcome: &str) {
    let said = format!("vllm_warden_config_last_reload_successful{{name=\"t\"}} {}\n", u8::from(outcome != "refused"));
    w.wait_for_file("status.json", |w| {
        std::fs::read_to_string(w.path("status.json"))
            .ok()
            .and_then(|t| serde_json::from_str::<serde_json::Value>(&t).ok())
            .is_some_and(|d| d["last_reload"]["outcome"] == outcome)
            && metrics(w).contains(&said)
    });
}

fn metrics(w: &Warden) -> String {
    std::fs::read_to_string(w.path("vllm_warden.prom")).unwrap()
}

fn child_pid(w: &Warden) -> u64 {
    doc(w)["child_pid"].as_u64().unwrap()
}

#[test]
fn reload_says_applied_restarting_or_refused_and_fails_on_a_refused_config() {
    let mut w = Warden::start(|d, p| config(d, p, &["--shards", "1"], "env = { MARKER = \"1\" }", FAST));
    w.wait_ready();
    let first = child_pid(&w);
    let good = std::fs::read_to_string(w.path("t.toml")).unwrap();
    assert!(metrics(&w).contains("vllm_warden_config_last_reload_successful{name=\"t\"} 1\n"), "{}", metrics(&w));

    // Nothing changed.
    let (code, out, err) = reload(&w);
    assert_eq!(code, 0, "{out}{err}");
    assert_eq!(out, "t: reload unchanged: nothing changed\n");

    // A setting of the warden's own: applied in place, the child kept.
    std::fs::write(w.path("t.toml"), good.replace("[restart]\n", "[restart]\nmax-attempts = 7\n")).unwrap();
    let (code, out, err) = reload(&w);
    assert_eq!(code, 0, "{out}{err}");
    assert!(out.starts_with("t: reload applied: ") && out.contains("restart.max-attempts"), "{out}");
    assert_eq!(child_pid(&w), first);
    wait_outcome(&mut w, "applied");

    // A config whose program is gone: refused by the warden itself (it
    // parses; the environment check fails), exit 78, every problem said;
    // the child keeps serving.
    let gone = w.path("no-such-vllm");
    let broken = good.replacen(common::sim(), &gone.display().to_string(), 1);
    assert_ne!(broken, good);
    std::fs::write(w.path("t.toml"), &broken).unwrap();
    let (code, out, err) = reload(&w);
    assert_eq!(code, 78, "{out}{err}");
    assert!(err.starts_with("t: reload refused: still running the previous config: 1 problem"), "{err}");
    assert!(err.contains(&format!("\n  {}", w.path("t.toml").display())), "the problem, with its file: {err}");
    assert!(err.contains("no-such-vllm"), "{err}");
    wait_outcome(&mut w, "refused");
    let d = doc(&w);
    assert_eq!(d["last_reload"]["outcome"], "refused", "{d}");
    assert!(d["last_reload"]["problems"][0].as_str().unwrap().contains("no-such-vllm"), "{d}");
    assert_eq!(d["state"], "ready");
    assert_eq!(child_pid(&w), first, "the child is untouched");
    let (ok, status) = w.cli(&["status"]);
    assert!(ok, "{status}");
    assert!(status.contains("\nlast reload: refused at "), "{status}");
    assert!(status.contains("no-such-vllm"), "{status}");
    assert!(metrics(&w).contains("vllm_warden_config_last_reload_successful{name=\"t\"} 0\n"), "{}", metrics(&w));

    // A syntax error: refused too, with its line and column.
    std::fs::write(w.path("t.toml"), good.replace("[child]", "[child]\nstop-timeout = \"soon\"")).unwrap();
    let (code, out, err) = reload(&w);
    assert_eq!(code, 78, "{out}{err}");
    assert!(err.contains("`stop-timeout`: invalid duration"), "{err}");
    assert_eq!(child_pid(&w), first);

    // A change the child sees: restarting, and the new child has it.
    std::fs::write(w.path("t.toml"), good.replace("MARKER = \"1\"", "MARKER = \"2\"")).unwrap();
    let (code, out, err) = reload(&w);
    assert_eq!(code, 0, "{out}{err}");
    assert!(out.starts_with("t: reload restarting: ") && out.contains("child.env"), "{out}");
    w.wait_note("reloading", |n| n.starts_with("STATUS=reloading: stopping pid"));
    w.wait_ready();
    assert_ne!(child_pid(&w), first);
    wait_outcome(&mut w, "restarting");
    assert_eq!(w.stop(), 0);
}

#[test]
fn reload_of_an_instance_that_does_not_run_says_so() {
    let d = tempfile::tempdir().unwrap();
    let port = common::free_port();
    std::fs::write(d.path().join("t.toml"), config(d.path(), port, &[], "", "")).unwrap();
    let o = std::process::Command::new(common::exe())
        .args(["reload", "-c"])
        .arg(d.path().join("t.toml"))
        .env("RUNTIME_DIRECTORY", d.path().join("run"))
        .output()
        .unwrap();
    assert_eq!(o.status.code(), Some(4), "{}", String::from_utf8_lossy(&o.stderr));
    assert!(String::from_utf8_lossy(&o.stderr).contains("not running"));
}
