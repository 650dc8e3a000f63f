//! Scenario 15: loads at the speed of the disk (issue #48), against real
//! vLLM and the model of several GB (`models/big`, made by
//! `tests/real-vllm/make_big_model.py`: 4.3 GB of weights in three
//! safetensors shards, a tiny architecture that answers completions).
//!
//! One warden's config and state directory, started again for each load, so
//! that every load is in the same ledger and the same setup's history: cold
//! loads (the page cache dropped before each, which needs root), with the
//! read-ahead and without in turns, then warm loads; one of each kind by
//! default, three with `VLLM_WARDEN_S15_LOADS=3` (see [`loads`]). Each
//! load's row is read from the ledger's JSON lines (the fields of issue #48,
//! read as plain JSON so that a record without them still prints).
//!
//! The issue's goals on the machine it was written for: a cold weights
//! phase with the read-ahead at most 0.5x one without; a cold load's spawn
//! to the end of its weights within 1.2x of max(vLLM's start-up before it
//! reads, bytes / the disk's GB/s); the estimate within 10 % from 25 % of a
//! warm load on. They are printed, measured. What is asserted of every run
//! is what the warden did: the read-ahead read the bytes and measured the
//! disk, the ledger has each load's page cache and efficiency, the warm
//! loads found the weights cached. The speeds are asserted (physics, with
//! margins: see each assertion) only over three loads of each kind or more,
//! on their medians; one load of each is a measure of the moment.

use std::path::Path;
use std::process::Command;
use std::time::{Duration, Instant};

use crate::common::real::{MARGIN, budget, ceiling, model, vllm};
use crate::common::{Warden, exe, secs};

/// A ready child's stop (`child.stop-timeout`) and the harness's margin.
const STOP: Duration = Duration::from_secs(30);

/// How many loads of each kind: `VLLM_WARDEN_S15_LOADS`, else one. One of
/// each proves the read-ahead against the real loader (what CI runs: each
/// load of this model is over a minute on 2 cores); the measurement of
/// `docs/benchmarks.md` is three of each
/// (`VLLM_WARDEN_S15_LOADS=3 tests/real-vllm/run.sh s15`), which also
/// holds the repeated warm loads' estimate to its bound.
fn loads() -> usize {
    match std::env::var("VLLM_WARDEN_S15_LOADS") {
        Ok(v) => v
            .parse()
            .ok()
            .filter(|n| (1..=10).contains(n))
            .unwrap_or_else(|| panic!("VLLM_WARDEN_S15_LOADS={v}: a number of loads of each kind, from 1 to 10")),
        Err(_) => 1,
    }
}

/// The config of every load.
fn config(d: &Path, port: u16, prefetch: Option<bool>) -> String {
    let prefetch = prefetch.map_or(String::new(), |on| format!("[prefetch]\nenabled = {on}\n"));
    format!(
        r#"name = "t"
[child]
command = ["{vllm}", "serve", "{model}", "--port", "{port}", "--max-model-len", "256",
           "--enforce-eager", "--gpu-memory-utilization", "0.5"]
env = {{ HF_HUB_OFFLINE = "1", VLLM_CPU_KVCACHE_SPACE = "1" }}
log-file = "{d}/t.log"
stop-timeout = "{stop}s"
[ready]
timeout = "{ceiling}s"
stall = "{ceiling}s"
[prestart]
gpu-idle-wait = "0s"
[status]
file = "{d}/status.json"
{prefetch}"#,
        vllm = vllm(),
        model = model("big").display(),
        d = d.display(),
        stop = STOP.as_secs(),
        ceiling = ceiling().0.as_secs(),
    )
}

/// Whether this build of the warden knows `[prefetch]`: `check` of a
/// config that has it (a build without it refuses the key).
fn knows_prefetch(d: &Path) -> bool {
    let probe = d.join("probe.toml");
    std::fs::write(&probe, config(d, 1, Some(true))).unwrap();
    let out = Command::new(exe()).args(["check", "-c"]).arg(&probe).output().unwrap();
    let text = String::from_utf8_lossy(&out.stderr);
    !text.contains("prefetch")
}

/// Empty the page cache: the next load reads its weights from the disk.
fn drop_caches() {
    nix::unistd::sync();
    std::fs::write("/proc/sys/vm/drop_caches", "3").unwrap_or_else(|e| {
        panic!("scenario 15 drops the page cache before each cold load (/proc/sys/vm/drop_caches): {e}; run it as root")
    });
}

/// How a load began.
#[derive(Debug, Clone, Copy, PartialEq)]
enum Kind {
    /// Page cache dropped, read-ahead on.
    ColdAhead,
    /// Page cache dropped, read-ahead off.
    Cold,
    /// The weights still cached from the load before, read-ahead on.
    Warm,
}

impl Kind {
    fn word(self) -> &'static str {
        match self {
            Kind::ColdAhead => "cold, read-ahead",
            Kind::Cold => "cold, none",
            Kind::Warm => "warm",
        }
    }
}

/// One ready load's numbers, from its ledger record.
#[derive(Debug)]
struct Row {
    kind: Kind,
    id: u64,
    total: f64,
    /// vLLM's start-up before it reads: the `start` phase.
    start: f64,
    weights: f64,
    /// Spawn to the end of the weights phase.
    to_weights: f64,
    bytes: Option<f64>,
    residency: Option<f64>,
    /// The read-ahead's GB/s: the disk's for this model on this load.
    gbps: Option<f64>,
    ahead_bytes: Option<f64>,
    efficiency: Option<f64>,
    /// The estimate's signed error at 25, 50 and 75 % of the load.
    errors: [Option<f64>; 3],
}

fn row(kind: Kind, r: &serde_json::Value) -> Row {
    let phases = r["phases"].as_array().cloned().unwrap_or_default();
    let phase = |name: &str| phases.iter().find(|p| p["phase"] == name).and_then(|p| p["secs"].as_f64());
    let weights = phase("weights").unwrap_or_else(|| panic!("no weights phase in {r}"));
    let upto = phases.iter().position(|p| p["phase"] == "weights").unwrap();
    let to_weights = phases[..=upto].iter().filter_map(|p| p["secs"].as_f64()).sum();
    let at = |q: f64| {
        r["estimates"]
            .as_array()?
            .iter()
            .find(|e| e["at"].as_f64().is_some_and(|a| (a - q).abs() < 1e-6))
            .and_then(|e| e["error"].as_f64())
    };
    Row {
        kind,
        id: r["id"].as_u64().unwrap(),
        total: r["total_secs"].as_f64().unwrap(),
        start: phase("start").unwrap_or(0.0),
        weights,
        to_weights,
        bytes: r["weights_bytes"].as_f64(),
        residency: r["residency"].as_f64(),
        // A load without the read-ahead has its part with nothing read.
        gbps: r["prefetch"]["gbps"].as_f64().filter(|g| *g > 0.0),
        ahead_bytes: r["prefetch"]["bytes"].as_f64(),
        efficiency: r["efficiency"].as_f64(),
        errors: [at(0.25), at(0.5), at(0.75)],
    }
}

fn opt(x: Option<f64>, f: impl Fn(f64) -> String) -> String {
    x.map_or("-".to_string(), f)
}

fn pct(x: Option<f64>) -> String {
    opt(x, |e| format!("{:+.0}%", e * 100.0))
}

fn median(mut xs: Vec<f64>) -> f64 {
    assert!(!xs.is_empty());
    xs.sort_by(f64::total_cmp);
    xs[xs.len() / 2]
}

#[test]
#[ignore]
fn s15_weights_read_ahead_while_vllm_starts_measured_against_the_disk() {
    let loads = loads();
    let load = budget(1, Duration::ZERO);
    let stop = STOP + MARGIN;
    let (c, from) = ceiling();
    eprintln!(
        "scenario 15 budgets (load ceiling {} from {from}): each of {} loads {}, each stop {}",
        secs(c),
        3 * loads,
        secs(load),
        secs(stop)
    );
    let t = Instant::now();
    let dir = tempfile::tempdir().unwrap();
    let ahead = knows_prefetch(dir.path());
    // A build without it would load the model cold six times alike and
    // prove nothing of the read-ahead.
    assert!(ahead, "scenario 15: this build of the warden refuses [prefetch]");
    let order: Vec<Kind> =
        (0..loads).flat_map(|_| [Kind::ColdAhead, Kind::Cold]).chain(std::iter::repeat_n(Kind::Warm, loads)).collect();
    let prefetch = |k: Kind| ahead.then_some(k != Kind::Cold);
    let mut w = Warden::start(|d, p| {
        // Before the first spawn: the config of the first load, and a cold
        // page cache.
        drop_caches();
        config(d, p, prefetch(order[0]))
    });
    for (i, &kind) in order.iter().enumerate() {
        if i > 0 {
            let port = w.port;
            std::fs::write(w.path("t.toml"), config(w.dir.path(), port, prefetch(kind))).unwrap();
            if kind != Kind::Warm {
                drop_caches();
            }
            w.spawn();
        }
        w.wait_ready_within(load, &format!("READY=1 (load {} of {}, {})", i + 1, order.len(), kind.word()));
        assert_eq!(w.stop_within(stop, "the warden's exit after SIGTERM while serving"), 0);
    }

    let text = std::fs::read_to_string(w.path("state").join("loads.jsonl")).unwrap();
    let records: Vec<serde_json::Value> = text.lines().map(|l| serde_json::from_str(l).unwrap()).collect();
    let ready: Vec<&serde_json::Value> = records.iter().filter(|r| r["outcome"]["kind"] == "ready").collect();
    assert_eq!(ready.len(), order.len(), "one ready load each: {text}");
    let rows: Vec<Row> = order.iter().zip(&ready).map(|(&k, r)| row(k, r)).collect();
    // The disk's speed for the loads that did not measure it: this run's
    // read-ahead's.
    let measured: Vec<f64> = rows.iter().filter(|r| r.kind == Kind::ColdAhead).filter_map(|r| r.gbps).collect();
    let disk = (!measured.is_empty()).then(|| median(measured.clone()));
    eprintln!(
        "scenario 15 loads of {} ({}):",
        model("big").display(),
        opt(rows[0].bytes, |b| format!("{:.2} GB of weights", b / 1e9))
    );
    eprintln!(
        "  {:>3} {:<17} {:>7} {:>7} {:>8} {:>13} {:>9} {:>8} {:>9} {:>10} {:>6} {:>6} {:>6}",
        "id",
        "load",
        "total",
        "start",
        "weights",
        "spawn→weights",
        "resident",
        "ahead",
        "disk",
        "efficiency",
        "err25",
        "err50",
        "err75"
    );
    for r in &rows {
        // The disk's speed as this cold load's read-ahead measured it; for
        // the others (in brackets) the median of this run's.
        let disk = match (r.gbps, r.kind) {
            (Some(g), Kind::ColdAhead) => format!("{g:.2} GB/s"),
            _ => opt(disk, |g| format!("({g:.2})")),
        };
        eprintln!(
            "  {:>3} {:<17} {:>6.1}s {:>6.1}s {:>7.1}s {:>12.1}s {:>9} {:>8} {:>9} {:>10} {:>6} {:>6} {:>6}",
            r.id,
            r.kind.word(),
            r.total,
            r.start,
            r.weights,
            r.to_weights,
            opt(r.residency, |x| format!("{:.0}%", x * 100.0)),
            opt(r.ahead_bytes, |b| format!("{:.2} GB", b / 1e9)),
            disk,
            opt(r.efficiency, |x| format!("{:.0}%", x * 100.0)),
            pct(r.errors[0]),
            pct(r.errors[1]),
            pct(r.errors[2]),
        );
    }
    let of = |k: Kind| rows.iter().filter(move |r| r.kind == k);
    let cold_weights = median(of(Kind::Cold).map(|r| r.weights).collect());
    let warm_weights = median(of(Kind::Warm).map(|r| r.weights).collect());
    eprintln!(
        "scenario 15 weights phase, median: cold without read-ahead {cold_weights:.1} s, warm {warm_weights:.1} s \
         (the loader's own time on cached pages: what no read-ahead can remove)"
    );

    // What is wrong, said all at once after every measure is printed.
    let mut wrong: Vec<String> = Vec::new();
    let mut check = |ok: bool, what: String| {
        if !ok {
            wrong.push(what);
        }
    };
    for r in &rows {
        // Each load's page cache as the ledger saw it at the spawn: dropped
        // before the cold ones, most of it kept for the warm ones (a
        // machine others use may take some back). A cold load with the
        // read-ahead has what it read during the pre-start steps.
        if let Some(res) = r.residency {
            let pc = res * 100.0;
            match r.kind {
                Kind::Warm => {
                    check(res >= 0.8, format!("load {}, warm: {pc:.0}% of the weights cached at the spawn", r.id))
                }
                Kind::Cold => {
                    check(res <= 0.1, format!("load {}, cold: {pc:.0}% of the weights cached at the spawn", r.id))
                }
                Kind::ColdAhead => {}
            }
        }
        // The weights phase against what the machine could do: above 1 it
        // ran faster than the disk or the page cache it read from, which
        // only a wrong reference gives (a load whose read-ahead filled the
        // page cache before vLLM read is to be measured against the page
        // cache). The margin is for both speeds being measured.
        if let Some(e) = r.efficiency {
            check(e <= 1.5, format!("load {}: efficiency {:.0}%, faster than the machine", r.id, e * 100.0));
        }
    }

    if ahead {
        let with = median(of(Kind::ColdAhead).map(|r| r.weights).collect());
        // Goal: <= 0.5x. Physics, on any disk: what was read ahead while
        // vLLM started is not read again, so a cold weights phase with the
        // read-ahead is shorter than one without.
        eprintln!(
            "scenario 15 goal: cold weights phase with read-ahead / without = {with:.1} s / {cold_weights:.1} s = {:.2} (goal <= 0.5)",
            with / cold_weights
        );
        // Asserted on the medians of three loads of each kind or more: one
        // load of each is at the mercy of whatever else the machine's cores
        // do then (on 2 busy cores the read-ahead's own reads were seen to
        // slow vLLM's start-up more than they saved), and the loader's
        // speed on this model varies several times over between runs.
        if loads >= 3 {
            check(with < cold_weights, "the read-ahead did not shorten a cold weights phase".to_string());
        }
        for r in of(Kind::ColdAhead) {
            if !r.ahead_bytes.is_some_and(|b| b > 0.0) || r.gbps.is_none() {
                check(false, format!("load {}, cold: the read-ahead read nothing, no disk speed", r.id));
                continue;
            }
            // Goal: within 1.2x of max(start-up, bytes / GB/s), the limit
            // of overlapping the two. Physics adds the loader's own time on
            // cached pages (the warm loads' weights phase), which reading
            // ahead cannot overlap with vLLM's start-up: vLLM copies the
            // weights only once its workers are up.
            let bytes = r.bytes.expect("weights bytes");
            let limit = r.start.max(bytes / 1e9 / r.gbps.unwrap());
            eprintln!(
                "scenario 15 goal: load {} spawn→weights {:.1} s / max(start-up {:.1} s, {:.2} GB / {:.2} GB/s) = {:.2} (goal <= 1.2); \
                 with the warm loader's {warm_weights:.1} s added to the limit: {:.2}",
                r.id,
                r.to_weights,
                r.start,
                bytes / 1e9,
                r.gbps.unwrap(),
                r.to_weights / limit,
                r.to_weights / (limit + warm_weights)
            );
            // Asserted with room for a machine whose cores are busy while
            // vLLM starts (1.11-1.14 and 1.04-1.06 in the runs so far):
            // the goal is printed above.
            check(
                loads < 3 || r.to_weights <= 1.5 * (limit + warm_weights),
                format!(
                    "load {}: spawn to weights done {:.1} s, beyond 1.5 x (max(start-up, disk) {limit:.1} s + the warm loader's {warm_weights:.1} s)",
                    r.id, r.to_weights
                ),
            );
        }
    }

    // Goal: within ±10 % from 25 % of a load on, across repeated loads
    // of one setup, cold and warm. A load is estimated from the earlier
    // loads of its page-cache class once its residency is counted: the
    // first of a class (the first warm load follows six cold ones) has
    // only the others to go by, and is printed apart.
    let worst = |r: &Row| r.errors.iter().flatten().fold(None, |a: Option<f64>, e| Some(a.unwrap_or(0.0).max(e.abs())));
    let mut repeated: Vec<(Kind, f64)> = Vec::new();
    for (i, r) in rows.iter().enumerate() {
        let Some(e) = worst(r) else { continue };
        if rows[..i].iter().any(|q| q.kind == r.kind) {
            repeated.push((r.kind, e));
        } else {
            eprintln!(
                "scenario 15: load {} ({}), the first of its kind, estimated from the others: worst error from 25 % on {:.1}%",
                r.id,
                r.kind.word(),
                e * 100.0
            );
        }
    }
    if rows.iter().all(|r| worst(r).is_none()) {
        eprintln!("scenario 15: no estimate snapshots in the ledger (this build does not record them)");
    }
    for kind in [Kind::ColdAhead, Kind::Cold, Kind::Warm] {
        let errors: Vec<f64> = repeated.iter().filter(|(k, _)| *k == kind).map(|(_, e)| *e).collect();
        if let Some(w) = errors.iter().copied().reduce(f64::max) {
            eprintln!(
                "scenario 15 goal: the repeated {} loads' worst estimate error from 25 % on {:.1}% (goal <= 10%)",
                kind.word(),
                w * 100.0
            );
            // The warm loads, estimated from the warm ones before them
            // (2.3 % and 5.0 % in two runs), asserted with room for
            // a busy one; the cold ones' history is of one or two loads
            // whose start-up varies with what else reads the disk.
            if kind == Kind::Warm {
                check(w <= 0.2, format!("the repeated warm loads' estimate was {:.0}% off from 25 % on", w * 100.0));
            }
        }
    }
    assert!(wrong.is_empty(), "scenario 15:\n  {}\n{rows:#?}", wrong.join("\n  "));
    eprintln!(
        "scenario 15 loads at the speed of the disk: PASS  {} loads in {:.0} s",
        rows.len(),
        t.elapsed().as_secs_f64()
    );
}
