//! Scenario 15: loads at the speed of the disk (issue #48), against real
//! vLLM and the model of several GB (`models/big`, made by
//! `tests/real-vllm/make_big_model.py`: 4.3 GB of weights in three
//! safetensors shards, a tiny architecture that answers completions).
//!
//! One warden's config and state directory, started again for each load, so
//! that every load is in the same ledger and the same setup's history: cold
//! loads (the page cache dropped before each, which needs root), with the
//! read-ahead and without in turns, then warm loads, then one load with
//! part of the weights cached (as on a machine whose page cache others
//! share); one of each kind by default, three cold and warm ones with
//! `VLLM_WARDEN_S15_LOADS=3` (see [`loads`]). The page cache each load
//! begins with is made, then measured (`fincore`, which reads nothing)
//! before the spawn: a cold load's is dropped and found empty, a warm
//! load's weights are read and found cached, a part-cached load's are
//! read and a part of each file evicted (`POSIX_FADV_DONTNEED`). What a
//! load's record says of it is checked against that measure. Each
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

/// The weight files vLLM reads: the big model's safetensors shards.
fn weight_files() -> Vec<std::path::PathBuf> {
    let mut files: Vec<_> = std::fs::read_dir(model("big"))
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|x| x == "safetensors"))
        .collect();
    files.sort();
    assert!(!files.is_empty(), "no safetensors in {}", model("big").display());
    files
}

/// The fraction of the weights' bytes in the page cache now, as `fincore`
/// (util-linux: `mincore` on a mapping, which reads nothing) counts it.
fn cached_now(files: &[std::path::PathBuf]) -> f64 {
    let out = Command::new("fincore")
        .args(["--bytes", "--raw", "--noheadings", "--output", "RES,SIZE"])
        .args(files)
        .output()
        .unwrap_or_else(|e| panic!("scenario 15 measures the page cache with fincore (util-linux): {e}"));
    assert!(out.status.success(), "fincore: {}", String::from_utf8_lossy(&out.stderr));
    let (mut res, mut size) = (0u64, 0u64);
    for line in String::from_utf8_lossy(&out.stdout).lines() {
        let mut n = line.split_whitespace().map(|x| x.parse::<u64>().unwrap());
        res += n.next().unwrap();
        size += n.next().unwrap();
    }
    assert!(size > 0, "fincore counted no bytes: {files:?}");
    res.min(size) as f64 / size as f64
}

/// Read the weights whole: they are in the page cache after (where it can
/// hold them).
fn read_all(files: &[std::path::PathBuf]) {
    for f in files {
        std::io::copy(&mut std::fs::File::open(f).unwrap(), &mut std::io::sink()).unwrap();
    }
}

/// Drop the first `share` of each file's pages from the page cache.
fn evict_part(files: &[std::path::PathBuf], share: f64) {
    for f in files {
        let file = std::fs::File::open(f).unwrap();
        let len = (file.metadata().unwrap().len() as f64 * share) as i64;
        nix::fcntl::posix_fadvise(&file, 0, len, nix::fcntl::PosixFadviseAdvice::POSIX_FADV_DONTNEED).unwrap();
    }
}

/// The part of the weights evicted before the part-cached load: the
/// 22 % that cold CI's warm load found missing.
const EVICTED: f64 = 0.22;

/// Make the page cache `kind` asks for, and measure it: the fraction of
/// the weights cached just before the spawn. A page cache that is not what
/// the load needs is the scenario's failure, said plainly, not a load's.
fn prepare(kind: Kind, files: &[std::path::PathBuf]) -> f64 {
    match kind {
        Kind::ColdAhead | Kind::Cold => drop_caches(),
        Kind::Warm => read_all(files),
        Kind::Part => {
            read_all(files);
            evict_part(files, EVICTED);
        }
    }
    let now = cached_now(files);
    let pc = now * 100.0;
    match kind {
        Kind::ColdAhead | Kind::Cold => {
            assert!(now <= 0.02, "scenario 15: {pc:.1}% of the weights still cached after dropping the page cache")
        }
        Kind::Warm => assert!(
            now >= 0.95,
            "scenario 15: only {pc:.1}% of the weights cached right after reading them all: the page cache cannot \
             hold them on this machine now (a warm load needs it)"
        ),
        Kind::Part => assert!(
            (0.6..=0.9).contains(&now),
            "scenario 15: {pc:.1}% of the weights cached after evicting {:.0}% of each file",
            EVICTED * 100.0
        ),
    }
    now
}

/// How a load began.
#[derive(Debug, Clone, Copy, PartialEq)]
enum Kind {
    /// Page cache dropped, read-ahead on.
    ColdAhead,
    /// Page cache dropped, read-ahead off.
    Cold,
    /// The weights read whole and found cached, read-ahead on.
    Warm,
    /// The weights read, then the first 22 % of each file evicted: about
    /// 78 % cached, read-ahead on.
    Part,
}

impl Kind {
    fn word(self) -> &'static str {
        match self {
            Kind::ColdAhead => "cold, read-ahead",
            Kind::Cold => "cold, none",
            Kind::Warm => "warm",
            Kind::Part => "part-cached",
        }
    }
}

/// One ready load's numbers, from its ledger record.
#[derive(Debug)]
struct Row {
    kind: Kind,
    /// The fraction of the weights cached just before the spawn, as the
    /// scenario measured it.
    before: f64,
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

fn row(kind: Kind, before: f64, r: &serde_json::Value) -> Row {
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
        before,
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
        3 * loads + 1,
        secs(load),
        secs(stop)
    );
    let t = Instant::now();
    let dir = tempfile::tempdir().unwrap();
    let ahead = knows_prefetch(dir.path());
    // A build without it would load the model cold six times alike and
    // prove nothing of the read-ahead.
    assert!(ahead, "scenario 15: this build of the warden refuses [prefetch]");
    let order: Vec<Kind> = (0..loads)
        .flat_map(|_| [Kind::ColdAhead, Kind::Cold])
        .chain(std::iter::repeat_n(Kind::Warm, loads))
        .chain([Kind::Part])
        .collect();
    let prefetch = |k: Kind| ahead.then_some(k != Kind::Cold);
    let files = weight_files();
    let mut before = Vec::new();
    let mut w = Warden::start(|d, p| {
        // Before the first spawn: the config of the first load, and its
        // page cache.
        before.push(prepare(order[0], &files));
        config(d, p, prefetch(order[0]))
    });
    for (i, &kind) in order.iter().enumerate() {
        if i > 0 {
            let port = w.port;
            std::fs::write(w.path("t.toml"), config(w.dir.path(), port, prefetch(kind))).unwrap();
            before.push(prepare(kind, &files));
            w.spawn();
        }
        w.wait_ready_within(load, &format!("READY=1 (load {} of {}, {})", i + 1, order.len(), kind.word()));
        assert_eq!(w.stop_within(stop, "the warden's exit after SIGTERM while serving"), 0);
    }

    let text = std::fs::read_to_string(w.path("state").join("loads.jsonl")).unwrap();
    let records: Vec<serde_json::Value> = text.lines().map(|l| serde_json::from_str(l).unwrap()).collect();
    let ready: Vec<&serde_json::Value> = records.iter().filter(|r| r["outcome"]["kind"] == "ready").collect();
    assert_eq!(ready.len(), order.len(), "one ready load each: {text}");
    let rows: Vec<Row> = order.iter().zip(&before).zip(&ready).map(|((&k, &b), r)| row(k, b, r)).collect();
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
        "  {:>3} {:<17} {:>7} {:>7} {:>7} {:>8} {:>13} {:>9} {:>8} {:>9} {:>10} {:>6} {:>6} {:>6}",
        "id",
        "load",
        "cached",
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
            "  {:>3} {:<17} {:>6.0}% {:>6.1}s {:>6.1}s {:>7.1}s {:>12.1}s {:>9} {:>8} {:>9} {:>10} {:>6} {:>6} {:>6}",
            r.id,
            r.kind.word(),
            r.before * 100.0,
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
        // Each load's page cache as the ledger saw it at the spawn, against
        // what the scenario made and measured just before (prepare): the
        // two agree (a machine others use may take a little back between
        // them). A cold load with the read-ahead has what it read during
        // the pre-start steps, which may be more.
        match r.residency {
            Some(res) => {
                let (pc, was) = (res * 100.0, r.before * 100.0);
                let agrees = match r.kind {
                    Kind::ColdAhead => res >= r.before - 0.05,
                    _ => (res - r.before).abs() <= 0.05,
                };
                check(
                    agrees,
                    format!(
                        "load {} ({}): the ledger says {pc:.0}% of the weights cached at the spawn, {was:.0}% were just before",
                        r.id,
                        r.kind.word()
                    ),
                );
            }
            None => check(false, format!("load {} ({}): no residency in the ledger", r.id, r.kind.word())),
        }
        // The weights phase against the disk, for the bytes it read from
        // it: above 1 it read them faster than the disk, which only a
        // wrong reference gives. The margin is for the disk's speed being
        // measured on another load.
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
    for kind in [Kind::ColdAhead, Kind::Cold, Kind::Warm, Kind::Part] {
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
