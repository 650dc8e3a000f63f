use super::*;
use crate::supervisor::outcome::FailureClass;
use crate::tell::metrics::{Metrics, metrics};
use crate::tell::summary::{StatusVerdict, human_bytes, read, summary};
use std::collections::BTreeMap;

fn snap() -> Snapshot {
    Snapshot {
        fit: Default::default(),
        fit_moves: 0,
        setup: None,
        rolled_back: None,
        phase: Phase::Ready,
        ready_at: Some(crate::util::clock::now()),
        child_pid: Some(42),
        attempt: 2,
        restarts: 1,
        restarts_by: BTreeMap::from([(crate::supervisor::outcome::RestartReason::Failure, 1)]),
        starts: 2,
        progress: None,
        cause: None,
        hint: None,
        exits: 1,
        last_exit: Some(Exit::Code(1)),
        last_load: Some(Duration::from_millis(61_500)),
        failures: BTreeMap::from([(FailureClass::Exit, 1)]),
        exit_code: None,
        last_failure: None,
        load: None,
        last_load_record: None,
        loads_ended: 0,
        golden: None,
        golden_checks: 0,
        rechecks: 0,
        recheck_paused: Duration::ZERO,
        rechecking: None,
        idle_stops: 0,
        sleeps: 0,
        idle_eta: None,
    }
}

#[test]
fn metrics_follow_the_textfile_format() {
    let text = metrics("kimi", &snap(), SystemTime::UNIX_EPOCH + Duration::from_secs(1_700_000_000), 7);
    for want in [
        "# TYPE vllm_warden_state gauge\n",
        "vllm_warden_state{name=\"kimi\",state=\"ready\"} 1\n",
        "vllm_warden_state{name=\"kimi\",state=\"starting\"} 0\n",
        "vllm_warden_ready{name=\"kimi\"} 1\n",
        "# TYPE vllm_warden_child_starts_total counter\nvllm_warden_child_starts_total{name=\"kimi\"} 2\n",
        "vllm_warden_failures_total{name=\"kimi\",class=\"exit\"} 1\n",
        "vllm_warden_failures_total{name=\"kimi\",class=\"permanent\"} 0\n",
        "vllm_warden_last_load_duration_seconds{name=\"kimi\"} 61.5\n",
        "vllm_warden_start_time_seconds{name=\"kimi\"} 1700000000.0\n",
        "vllm_warden_state{name=\"kimi\",state=\"draining\"} 0\n",
        "# TYPE vllm_warden_journal_dropped_lines_total counter\nvllm_warden_journal_dropped_lines_total{name=\"kimi\"} 7\n",
        "# TYPE vllm_warden_loop_turn_duration_seconds histogram\n",
    ] {
        assert!(text.contains(want), "{want} not in\n{text}");
    }
    // Every sample line belongs to a metric announced with HELP and TYPE
    // (a histogram's samples by its name and a suffix).
    for line in text.lines().filter(|l| !l.starts_with('#')) {
        let sample = line.split('{').next().unwrap();
        let histogram = ["_bucket", "_sum", "_count"]
            .iter()
            .filter_map(|s| sample.strip_suffix(s))
            .find(|base| text.contains(&format!("# TYPE {base} histogram\n")));
        let name = histogram.unwrap_or(sample);
        assert!(text.contains(&format!("# HELP {name} ")) && text.contains(&format!("# TYPE {name} ")), "{line}");
    }
}

#[test]
fn the_document_is_rewritten_only_on_change_and_is_not_world_writable() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("status.json");
    let mut r = Reporter::new("kimi", &path, None, Outbox::direct());
    r.update(&snap());
    let doc: Doc = serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
    assert_eq!(doc.state, Phase::Ready);
    assert_eq!(doc.child_pid, Some(42));
    assert_eq!(doc.last_exit.as_ref().unwrap().code, Some(1));
    assert!(doc.ready_since.is_some());
    use std::os::unix::fs::{MetadataExt, PermissionsExt};
    assert_eq!(std::fs::metadata(&path).unwrap().permissions().mode() & 0o002, 0);
    let ino = std::fs::metadata(&path).unwrap().ino();
    r.update(&snap());
    assert_eq!(std::fs::metadata(&path).unwrap().ino(), ino, "unchanged: not rewritten");
}

/// A flood of progress lines is one write per [`PROGRESS_EVERY`]; a
/// change of state is written at once, progress included.
#[test]
fn progress_alone_is_coalesced_and_a_change_of_state_is_written_at_once() {
    use std::os::unix::fs::MetadataExt;
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("status.json");
    let metrics_path = dir.path().join("metrics.prom");
    let mut r = Reporter::new("kimi", &path, Some(&metrics_path), Outbox::direct());
    let mut s = snap();
    s.phase = Phase::Starting;
    r.update(&s);
    assert_eq!(r.due(), None);
    let ino = std::fs::metadata(&path).unwrap().ino();
    for i in 0..1000 {
        s.progress = Some(format!("shard {i}"));
        r.update(&s);
    }
    assert_eq!(std::fs::metadata(&path).unwrap().ino(), ino, "not rewritten for each progress line");
    let due = r.due().expect("the latest progress waits");
    assert!(due <= std::time::Instant::now() + PROGRESS_EVERY);
    r.flush();
    assert_eq!(r.due(), None);
    let doc: Doc = serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
    assert_eq!(doc.progress.as_deref(), Some("shard 999"));
    // Right after a write, a progress line waits again; readiness does not.
    s.progress = Some("shard 1000".into());
    r.update(&s);
    assert!(r.due().is_some());
    s.phase = Phase::Ready;
    r.update(&s);
    assert_eq!(r.due(), None, "written at once");
    let doc: Doc = serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
    assert_eq!((doc.state, doc.progress.as_deref()), (Phase::Ready, Some("shard 1000")));
    // The journal's dropped lines reach the metrics at the next flush.
    r.set_journal_dropped(12);
    assert!(r.due().is_some());
    r.flush();
    let text = std::fs::read_to_string(&metrics_path).unwrap();
    assert!(text.contains("vllm_warden_journal_dropped_lines_total{name=\"kimi\"} 12\n"), "{text}");
}

/// The cache directory and its size, measured off the caller's thread
/// when the server starts and when it is ready, reach the document
/// and `status`.
#[test]
fn the_document_names_the_cache_directory_and_its_size() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("status.json");
    let cache = dir.path().join("cache");
    std::fs::create_dir_all(cache.join("vllm/torch_compile_cache")).unwrap();
    std::fs::write(cache.join("vllm/torch_compile_cache/a"), vec![7u8; 10_000]).unwrap();
    let mut r = Reporter::new("kimi", &path, None, Outbox::direct());
    r.set_cache_dir(Some(&cache));
    let read = || serde_json::from_str::<Doc>(&std::fs::read_to_string(&path).unwrap()).unwrap();
    let mut s = snap();
    s.phase = Phase::Starting;
    r.update(&s);
    r.meter.wait(Duration::from_secs(60));
    // A size that came after the write waits for the next one (one
    // that came before it is in it already).
    if read().cache.is_none_or(|c| c.bytes.is_none()) {
        assert!(r.due().is_some(), "a new size waits to be written");
    }
    r.flush();
    let c = read().cache.unwrap();
    assert_eq!((c.dir.as_str(), c.files), (cache.to_str().unwrap(), Some(1)));
    assert!(c.bytes.unwrap() >= 10_000 && c.measured_at.is_some(), "{c:?}");
    // The load wrote more: measured again at ready.
    std::fs::write(cache.join("vllm/torch_compile_cache/b"), vec![7u8; 10_000]).unwrap();
    r.update(&snap());
    r.meter.wait(Duration::from_secs(60));
    r.flush();
    let doc = read();
    assert_eq!(doc.cache.as_ref().unwrap().files, Some(2));
    let shown = summary(&StatusVerdict::Ready(doc));
    assert!(
        shown.contains(&format!("\ncache: {}, ", cache.display())) && shown.contains(" in 2 file(s) (measured "),
        "{shown}"
    );
    assert_eq!(human_bytes(1536), "1.5 KiB");
    assert_eq!(human_bytes(3 << 30), "3.0 GiB");
}

/// Issue "untrickable", case 1: escape sequences from a port holder's
/// argv never reach the terminal through `status`.
#[test]
fn notify_injection_no_control_character_reaches_the_document_or_the_terminal() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("status.json");
    let mut r = Reporter::new("kimi", &path, None, Outbox::direct());
    let mut s = snap();
    s.phase = Phase::Starting;
    s.cause = Some("port 8000 is held by pid 9 (x\nREADY=1\n\x1b]0;pwned\x07)".into());
    r.update(&s);
    let doc: Doc = serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
    assert!(!doc.cause.as_deref().unwrap().chars().any(crate::util::escape::is_unsafe));
    let mut forged = doc.clone();
    forged.cause = Some("\x1b[2J\nfake line".into());
    let text = summary(&StatusVerdict::NotReady(forged));
    assert!(!text.lines().any(|l| l.chars().any(crate::util::escape::is_unsafe)), "{text:?}");
    assert!(text.contains("\\x1b[2J\\nfake line"), "{text}");
}

/// The load under way and the last load, in the document and in
/// `status`; the cache's reason (from the child's log) made one line.
#[test]
fn the_document_and_status_show_the_load_and_the_last_load() {
    use crate::supervisor::load::{CacheOutcome, LoadNow, LoadOutcome, LoadPhase, LoadRecord, PhaseTime};
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("status.json");
    let mut r = Reporter::new("kimi", &path, None, Outbox::direct());
    let mut s = snap();
    s.phase = Phase::Starting;
    s.load = Some(LoadNow {
        phase: LoadPhase::Compile,
        index: 3,
        of: 7,
        elapsed: Duration::from_secs(130),
        began: crate::util::clock::now(),
        expected: Some(Duration::from_secs(290)),
        last: Some(Duration::from_secs(282)),
        fingerprint: "abc".into(),
        preload: None,
        median: Some(Duration::from_secs(290)),
        estimate: None,
        error: Some(0.04125),
        prefetch: None,
    });
    s.loads_ended = 1;
    s.last_load_record = Some(Arc::new(LoadRecord {
        fit: Default::default(),
        rollback: false,
        id: 4,
        at: String::new(),
        start: 1,
        outcome: LoadOutcome::Ready,
        total_secs: 61.25,
        phases: vec![PhaseTime { phase: LoadPhase::Start, secs: 20.5 }],
        cache: Some(CacheOutcome::LoadFailure { reason: "bad\nREADY=1".into() }),
        weights_bytes: None,
        weights_secs: None,
        gbps: Some(1.5),
        cold: Some(true),
        alarms: vec!["slow load: 1m01s against a median of 30s over 2 load(s) (2.0×)".into()],
        fingerprint: "abc".into(),
        setup: serde_json::Value::Null,
        boot: None,
        weights_id: None,
        estimates: vec![],
        residency: None,
        prefetch: None,
        efficiency: None,
    }));
    r.update(&s);
    let doc: Doc = serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
    let load = doc.load.as_ref().unwrap();
    assert_eq!((load.phase.as_str(), load.index, load.of, load.expected_secs), ("compile", 3, 7, Some(290.0)));
    assert_eq!(load.text, "loading 3/7 compile · 2m10s of ~4m50s ±4% (last 4m42s)");
    assert_eq!(load.expected_error, Some(0.041));
    let last = doc.last_load.as_ref().unwrap();
    assert_eq!(last.phases, [("start".to_string(), 20.5)]);
    let text = summary(&StatusVerdict::NotReady(doc.clone()));
    assert!(text.contains("\nload: loading 3/7 compile · 2m10s of ~4m50s ±4% (last 4m42s)"), "{text}");
    assert!(text.contains("\nlast load: ready after 61.2s (start 20.5s); compile cache: load-failure (bad\\nREADY=1); weights 1.50 GB/s"), "{text}");
    assert!(text.contains("\nload alarm: slow load: 1m01s"), "{text}");
    // The metrics count the load once.
    let m = Metrics::new("kimi", SystemTime::UNIX_EPOCH);
    m.set(&s, 0);
    m.set(&s, 0);
    let text = m.encode();
    assert!(text.contains("vllm_warden_load_alarms_total{name=\"kimi\",kind=\"slow-load\"} 1"), "{text}");
    assert!(text.contains("vllm_warden_load_cache_outcomes_total{name=\"kimi\",outcome=\"load-failure\"} 1"), "{text}");
    assert!(text.contains("vllm_warden_last_load_weights_gigabytes_per_second{name=\"kimi\"} 1.5"), "{text}");
    assert!(text.contains("vllm_warden_last_load_weights_bytes_per_second{name=\"kimi\"} 1500000000.0"), "{text}");
    assert!(text.contains("vllm_warden_load_phase_duration_seconds_count{name=\"kimi\",phase=\"start\"} 1"), "{text}");
}

/// Issue 47: the metrics an alert needs, in base units, from the
/// snapshot; the load's gauges only during a load.
#[test]
fn the_metrics_an_alert_needs_follow_the_snapshot() {
    use crate::supervisor::load::{LoadNow, LoadPhase};
    let m = Metrics::new("kimi", SystemTime::UNIX_EPOCH);
    let mut s = snap();
    s.phase = Phase::Starting;
    s.load = Some(LoadNow {
        phase: LoadPhase::Weights,
        index: 2,
        of: 7,
        elapsed: Duration::from_secs(130),
        began: crate::util::clock::now() - Duration::from_secs(130),
        expected: Some(Duration::from_secs(300)), // the live estimate: not the metric
        last: None,
        fingerprint: "abc".into(),
        preload: None,
        median: Some(Duration::from_secs(290)),
        estimate: None,
        error: None,
        prefetch: None,
    });
    m.set(&s, 0);
    let text = m.encode();
    let value = |text: &str, sample: &str| -> f64 {
        let line = text.lines().find(|l| l.starts_with(sample)).unwrap_or_else(|| panic!("no {sample} in\n{text}"));
        line.rsplit(' ').next().unwrap().parse().unwrap()
    };
    assert!(
        text.contains(&format!(
            "vllm_warden_build_info{{name=\"kimi\",version=\"{}\"}} 1\n",
            env!("CARGO_PKG_VERSION")
        )),
        "{text}"
    );
    assert!((130.0..200.0).contains(&value(&text, "vllm_warden_load_elapsed_seconds{")), "{text}");
    assert_eq!(value(&text, "vllm_warden_load_expected_seconds{"), 290.0);
    assert_eq!(value(&text, "vllm_warden_load_phase{name=\"kimi\",phase=\"weights\"}"), 1.0);
    assert_eq!(value(&text, "vllm_warden_load_phase{name=\"kimi\",phase=\"start\"}"), 0.0);
    assert!(value(&text, "vllm_warden_last_failure_timestamp_seconds{") > 1.7e9, "the failure of the snapshot");
    assert_eq!(value(&text, "vllm_warden_health_check_failures_total{name=\"kimi\",check=\"progress\"}"), 0.0);
    assert_eq!(value(&text, "vllm_warden_gpu_release_wait_seconds{"), 0.0);
    assert_eq!(value(&text, "vllm_warden_draining{"), 0.0);
    assert_eq!(value(&text, "vllm_warden_gave_up{"), 0.0);
    // Out of the load, drained, after a changed golden answer, given up.
    s.load = None;
    s.phase = Phase::Drained;
    s.golden = Some(crate::supervisor::golden::Verdict::Failed { text: "no answer".into() });
    s.golden_checks = 1;
    s.exit_code = Some(crate::supervisor::exit::Code::GaveUp);
    m.set(&s, 0);
    let text = m.encode();
    assert!(!text.contains("vllm_warden_load_elapsed_seconds{"), "{text}");
    assert!(!text.contains("vllm_warden_load_expected_seconds{"), "{text}");
    assert_eq!(value(&text, "vllm_warden_load_phase{name=\"kimi\",phase=\"weights\"}"), 0.0);
    assert_eq!(value(&text, "vllm_warden_draining{"), 1.0);
    assert_eq!(value(&text, "vllm_warden_golden_last_verdict{name=\"kimi\",verdict=\"failed\"}"), 1.0);
    assert_eq!(value(&text, "vllm_warden_golden_last_verdict{name=\"kimi\",verdict=\"same\"}"), 0.0);
    assert_eq!(value(&text, "vllm_warden_gave_up{"), 1.0);
}

/// A reload that moves the files: the next update writes them at the
/// new place, even when nothing else changed.
#[test]
fn moved_files_are_written_at_the_next_update_whatever_changed() {
    let dir = tempfile::tempdir().unwrap();
    let (old, new) = (dir.path().join("old.json"), dir.path().join("new.json"));
    let mut r = Reporter::new("kimi", &old, None, Outbox::direct());
    r.update(&snap());
    r.set_paths(&new, Some(&dir.path().join("new.prom")));
    r.update(&snap());
    let doc: Doc = serde_json::from_str(&std::fs::read_to_string(&new).unwrap()).unwrap();
    assert_eq!(doc.state, Phase::Ready);
    assert!(dir.path().join("new.prom").exists());
}

#[test]
fn a_gone_warden_is_not_running() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("status.json");
    assert_eq!(read(&path).unwrap(), StatusVerdict::NotRunning(None));
    let mut doc = Reporter::new("kimi", &path, None, Outbox::direct()).doc(&snap());
    doc.warden_pid = u32::MAX - 1;
    std::fs::write(&path, serde_json::to_string(&doc).unwrap()).unwrap();
    assert!(matches!(read(&path).unwrap(), StatusVerdict::NotRunning(Some(_))));
    assert!(summary(&read(&path).unwrap()).contains("not running (warden"));
}

/// vllm-warden(8)'s METRICS table names every metric the warden exposes,
/// and nothing else: each `# TYPE` of a full exposition (the front door's
/// included) is a row, and each row is a metric of the registry (those
/// shown "absent" until they have a value too).
#[test]
fn the_man_pages_metrics_table_is_the_exposition() {
    let man = include_str!("../../../docs/vllm-warden.8.md");
    let section = man.split("\n# METRICS\n").nth(1).unwrap().split("\n# ").next().unwrap();
    let rows: std::collections::BTreeSet<String> = section
        .lines()
        .filter_map(|l| l.strip_prefix("| `vllm_warden_"))
        .map(|l| format!("vllm_warden_{}", l.split(['`', '{']).next().unwrap()))
        .collect();
    let text = crate::tell::metrics::metrics("kimi", &snap(), std::time::SystemTime::now(), 0);
    let mut exposed = std::collections::BTreeSet::new();
    for l in text.lines() {
        let Some(rest) = l.strip_prefix("# TYPE ") else { continue };
        exposed.insert(rest.split_once(' ').unwrap().0.to_string());
    }
    let undocumented: Vec<_> = exposed.difference(&rows).collect();
    assert!(undocumented.is_empty(), "exposed, not in vllm-warden(8) METRICS: {undocumented:?}");
    let unsaid: Vec<_> = rows
        .difference(&exposed)
        .filter(|row| {
            let line = section.lines().find(|l| l.starts_with(&format!("| `{row}"))).unwrap();
            !line.contains("absent") && !line.contains("during a load only")
        })
        .collect();
    assert!(unsaid.is_empty(), "in the table, not exposed, and not said to be absent without a value: {unsaid:?}");
}
