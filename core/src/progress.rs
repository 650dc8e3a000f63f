//! Forward progress from vLLM's own metrics. A wedged engine keeps `/health`
//! answering 200; its Prometheus endpoint (`/metrics` on the serving port)
//! shows it: requests running or waiting while the token counters stand
//! still. This module reads one scrape into a [`Reading`] (summed over label
//! sets, which differ between vLLM versions) and judges a series of them
//! ([`Watch`]). The HTTP, the clock's source and what a stall leads to are
//! not known here.

use std::time::Duration;

use crate::Instant;

/// Requests being generated now (a gauge).
pub(crate) const RUNNING: &str = "vllm:num_requests_running";
/// Requests queued (a gauge).
pub(crate) const WAITING: &str = "vllm:num_requests_waiting";
/// Tokens generated so far (a counter).
pub(crate) const GENERATION_TOKENS: &str = "vllm:generation_tokens_total";
/// Prompt tokens processed so far (a counter).
pub(crate) const PROMPT_TOKENS: &str = "vllm:prompt_tokens_total";

/// What one scrape says, each metric summed over its label sets.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Reading {
    pub running: f64,
    pub(crate) waiting: f64,
    /// Generation plus prompt tokens: either moving is progress.
    pub(crate) tokens: f64,
}

/// Why a scrape gives no reading.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum Unreadable {
    #[error("not in the Prometheus text format: {0}")]
    Format(String),
    #[error("no `{0}` in the metrics")]
    Missing(&'static str),
}

/// Read a scrape of vLLM's `/metrics` (the Prometheus text format, parsed
/// by `nom-openmetrics`).
pub fn read(text: &str) -> Result<Reading, Unreadable> {
    let (_, families) = nom_openmetrics::parser::prometheus(through_last_sample(text)).map_err(|e| {
        let shown = e.to_string();
        Unreadable::Format(shown.chars().take(200).collect())
    })?;
    let sum = |name: &'static str| -> Result<f64, Unreadable> {
        let mut found = false;
        let mut total = 0.0;
        for s in families.iter().flat_map(|f| &f.samples).filter(|s| s.name() == name) {
            found = true;
            total += s.number();
        }
        if found { Ok(total) } else { Err(Unreadable::Missing(name)) }
    };
    Ok(Reading {
        running: sum(RUNNING)?,
        waiting: sum(WAITING)?,
        tokens: sum(GENERATION_TOKENS)? + sum(PROMPT_TOKENS)?,
    })
}

/// The text up to the end of its last sample line. `nom-openmetrics`
/// refuses a family with no sample at the very end of a scrape, and vLLM
/// 0.32.0 ends every scrape before its first completion so (the HTTP
/// instrumentation's `http_request_duration_seconds`: only its `# HELP` and
/// `# TYPE`); such a family holds nothing to read anyway.
fn through_last_sample(text: &str) -> &str {
    let (mut end, mut at) = (0, 0);
    for line in text.split_inclusive('\n') {
        at += line.len();
        let t = line.trim();
        if !t.is_empty() && !t.starts_with('#') {
            end = at;
        }
    }
    &text[..end]
}

/// The requests running or waiting in a scrape, summed over label sets:
/// what a drain waits to see at zero.
pub fn in_flight(text: &str) -> Result<f64, Unreadable> {
    let (_, families) = nom_openmetrics::parser::prometheus(through_last_sample(text)).map_err(|e| {
        let shown = e.to_string();
        Unreadable::Format(shown.chars().take(200).collect())
    })?;
    let mut total = 0.0;
    for name in [RUNNING, WAITING] {
        let mut found = false;
        for s in families.iter().flat_map(|f| &f.samples).filter(|s| s.name() == name) {
            found = true;
            total += s.number();
        }
        if !found {
            return Err(Unreadable::Missing(name));
        }
    }
    // A NaN or a negative count is no count.
    if total.is_finite() && total >= 0.0 { Ok(total) } else { Err(Unreadable::Format(format!("{total} requests"))) }
}

/// What the series of readings says.
#[derive(Debug, Clone, PartialEq)]
pub enum ProgressVerdict {
    /// Tokens moved, or nothing was asked of the engine.
    Fine,
    /// Requests running or waiting, and no token for `stall` or longer.
    Stalled { running: f64, waiting: f64, for_: Duration },
}

impl ProgressVerdict {
    /// The cause line of a stalled engine.
    pub fn cause(&self) -> Option<String> {
        match self {
            ProgressVerdict::Fine => None,
            ProgressVerdict::Stalled { running, waiting, for_ } => Some(format!(
                "engine stalled: {running} running, {waiting} waiting, no token for {}",
                humantime::format_duration(Duration::from_secs(for_.as_secs()))
            )),
        }
    }
}

/// Judges readings over time: the engine is stalled when it has had work
/// (running or waiting) for `stall` without a token moving.
#[derive(Debug, Clone)]
pub struct Watch {
    stall: Duration,
    last: Option<Reading>,
    /// When tokens last moved, or the engine last had nothing to do.
    moved_at: Option<Instant>,
}

impl Watch {
    pub fn new(stall: Duration) -> Watch {
        Watch { stall, last: None, moved_at: None }
    }

    pub fn observe(&mut self, r: Reading, now: Instant) -> ProgressVerdict {
        let idle = r.running + r.waiting <= 0.0;
        let moved = self.last.is_none_or(|l| r.tokens != l.tokens);
        self.last = Some(r);
        if idle || moved {
            self.moved_at = Some(now);
            return ProgressVerdict::Fine;
        }
        let since = *self.moved_at.get_or_insert(now);
        let for_ = now - since;
        if for_ >= self.stall {
            ProgressVerdict::Stalled { running: r.running, waiting: r.waiting, for_ }
        } else {
            ProgressVerdict::Fine
        }
    }

    /// The last reading: are requests in flight?
    pub fn busy(&self) -> bool {
        self.last.is_some_and(|r| r.running + r.waiting > 0.0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The shape of vLLM 0.32's scrape: HELP and TYPE lines, label sets per
    /// engine and model, counters with `_total`, and other families around.
    fn scrape(running: u32, waiting: u32, generated: u32) -> String {
        format!(
            "# HELP vllm:num_requests_running Number of requests in model execution batches.\n\
             # TYPE vllm:num_requests_running gauge\n\
             vllm:num_requests_running{{engine=\"0\",model_name=\"tiny\"}} {running}.0\n\
             # HELP vllm:num_requests_waiting Number of requests waiting to be processed.\n\
             # TYPE vllm:num_requests_waiting gauge\n\
             vllm:num_requests_waiting{{engine=\"0\",model_name=\"tiny\"}} {waiting}.0\n\
             # HELP vllm:prompt_tokens_total Number of prefill tokens processed.\n\
             # TYPE vllm:prompt_tokens_total counter\n\
             vllm:prompt_tokens_total{{engine=\"0\",model_name=\"tiny\"}} 40.0\n\
             # HELP vllm:generation_tokens_total Number of generation tokens processed.\n\
             # TYPE vllm:generation_tokens_total counter\n\
             vllm:generation_tokens_total{{engine=\"0\",model_name=\"tiny\"}} {generated}.0\n\
             vllm:generation_tokens_total{{engine=\"1\",model_name=\"tiny\"}} 2.0\n\
             # TYPE vllm:e2e_request_latency_seconds histogram\n\
             vllm:e2e_request_latency_seconds_bucket{{engine=\"0\",le=\"0.3\"}} 1.0\n\
             vllm:e2e_request_latency_seconds_bucket{{engine=\"0\",le=\"+Inf\"}} 1.0\n"
        )
    }

    #[test]
    fn a_scrape_is_summed_over_label_sets() {
        assert_eq!(read(&scrape(2, 1, 10)), Ok(Reading { running: 2.0, waiting: 1.0, tokens: 52.0 }));
    }

    /// A whole scrape of vLLM 0.32.0's `/metrics` (the tiny model after one
    /// completion): every family vLLM, the Python client and the HTTP
    /// instrumentation write, as they write them.
    #[test]
    fn a_real_vllm_scrape_is_read() {
        let text = include_str!("../../tests/fixtures/vllm-0.32.0-metrics.txt");
        let r = read(text).unwrap();
        assert_eq!((r.running, r.waiting), (0.0, 0.0));
        assert!(r.tokens > 0.0, "{r:?}");
    }

    /// The scrape of a fresh vLLM 0.32.0, before its first completion: it
    /// ends with a family that has no sample (this turned the check off).
    #[test]
    fn a_fresh_vllm_scrape_ending_in_an_empty_family_is_read() {
        let text = include_str!("../../tests/fixtures/vllm-0.32.0-metrics-fresh.txt");
        assert!(text.trim_end().ends_with("# TYPE http_request_duration_seconds histogram"));
        assert!(nom_openmetrics::parser::prometheus(text).is_err(), "the parser alone refuses it");
        let r = read(text).unwrap();
        assert_eq!(r, Reading { running: 0.0, waiting: 0.0, tokens: 0.0 });
    }

    #[test]
    fn requests_in_flight_are_running_plus_waiting() {
        assert_eq!(in_flight(&scrape(2, 1, 10)), Ok(3.0));
        assert_eq!(in_flight(&scrape(0, 0, 10)), Ok(0.0));
        assert_eq!(in_flight("process_cpu_seconds_total 1.0\n"), Err(Unreadable::Missing(RUNNING)));
        let negative = scrape(0, 0, 1).replace(
            "vllm:num_requests_waiting{engine=\"0\",model_name=\"tiny\"} 0.0",
            "vllm:num_requests_waiting{engine=\"0\",model_name=\"tiny\"} -5.0",
        );
        assert!(in_flight(&negative).is_err(), "{negative}");
    }

    /// A drain counts on a real vLLM that has served no request yet (its
    /// scrape ends with a family without samples) and on one that has.
    #[test]
    fn requests_in_flight_on_real_scrapes() {
        let fixture = |name: &str| {
            std::fs::read_to_string(format!("{}/../tests/fixtures/{name}", env!("CARGO_MANIFEST_DIR"))).unwrap()
        };
        assert_eq!(in_flight(&fixture("vllm-0.32.0-metrics-fresh.txt")), Ok(0.0));
        let served = fixture("vllm-0.32.0-metrics.txt");
        assert_eq!(in_flight(&served), Ok(0.0));
        let running = "vllm:num_requests_running{engine=\"0\",model_name=\"/var/cache/vllm-warden-ci/models/tiny\"}";
        let busy = served.replace(&format!("{running} 0.0"), &format!("{running} 2.0"));
        assert_ne!(busy, served);
        assert_eq!(in_flight(&busy), Ok(2.0));
    }

    #[test]
    fn a_missing_metric_is_named() {
        assert_eq!(read("process_cpu_seconds_total 1.0\n"), Err(Unreadable::Missing(RUNNING)));
    }

    #[test]
    fn busy_with_tokens_standing_still_is_a_stall_after_the_window() {
        let t0 = Instant::now();
        let s = Duration::from_secs;
        let mut w = Watch::new(s(120));
        let r = |running, tokens| Reading { running, waiting: 1.0, tokens };
        assert_eq!(w.observe(r(2.0, 10.0), t0), ProgressVerdict::Fine);
        assert_eq!(w.observe(r(2.0, 11.0), t0 + s(15)), ProgressVerdict::Fine, "moved");
        assert_eq!(w.observe(r(2.0, 11.0), t0 + s(120)), ProgressVerdict::Fine, "105 s still");
        let v = w.observe(r(2.0, 11.0), t0 + s(135));
        assert_eq!(v.cause().as_deref(), Some("engine stalled: 2 running, 1 waiting, no token for 2m"));
    }

    #[test]
    fn an_idle_engine_never_stalls() {
        let t0 = Instant::now();
        let mut w = Watch::new(Duration::from_secs(1));
        let idle = Reading { running: 0.0, waiting: 0.0, tokens: 5.0 };
        for i in 0..10 {
            assert_eq!(w.observe(idle, t0 + Duration::from_secs(i * 60)), ProgressVerdict::Fine);
        }
        assert!(!w.busy());
    }
}
