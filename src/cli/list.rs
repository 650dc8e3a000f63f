//! `vllm-warden list` (and `status --all`): every instance of the host,
//! one line each: its state and since when, the model server's pid, the
//! model and the address it serves on, the last load and the estimate of
//! the next (or of the one under way), the cause of the last failure.
//!
//! The state comes from the warden (its control socket) or its status
//! file, the model and address from the config, the estimate from the
//! load ledger: each as far as this user may read it. Everything shown
//! comes from files someone else wrote: each field is made one visible
//! line.

use std::time::Duration;

use serde::Serialize;

use crate::cli::instance::{self, Found, Seen};
use crate::config::{self, Dirs};
use crate::tell::status::Doc;
use crate::tell::summary::StatusVerdict;
use crate::util::escape::one_line;

/// How long `list` waits for each warden's answer before it reads the
/// status file instead: a stuck warden must not hold the whole list.
const ANSWER_TIMEOUT: Duration = Duration::from_secs(2);

/// One instance, as `list` shows it (and `--json` writes it).
#[derive(Debug, Clone, Serialize)]
pub(crate) struct Row {
    pub(crate) name: String,
    /// `ready`, `starting` … while a warden runs; `stopped`, `exited N`
    /// (its last word), `gone` (it died), `not running` (no status), or
    /// `unknown` when this user may not read it.
    pub(crate) state: String,
    pub(crate) since: Option<String>,
    /// The model server's pid, and the warden's.
    pub(crate) pid: Option<u32>,
    pub(crate) warden_pid: Option<u32>,
    pub(crate) model: Option<String>,
    pub(crate) address: Option<String>,
    /// The last load that ended: its outcome and seconds.
    pub(crate) last_load: Option<String>,
    pub(crate) last_load_secs: Option<f64>,
    /// The load under way's expected seconds, else the next one's: the
    /// median of the setup's good loads in the ledger.
    pub(crate) estimate_secs: Option<f64>,
    pub(crate) last_failure: Option<String>,
    /// The config file, when there is one, and how many problems it has.
    pub(crate) config: Option<String>,
    pub(crate) config_problems: usize,
    /// Why the state is not known, when it is not.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(crate) unknown: Option<String>,
}

/// Every instance of the host, by name.
pub(crate) fn rows(found: &[Found]) -> Vec<Row> {
    found.iter().map(row).collect()
}

fn row(f: &Found) -> Row {
    // The folders as the reader's defaults have them: the variables
    // systemd sets are one instance's, not every instance's.
    let (s, problems) = config::load_lenient(&f.config, &Dirs::default());
    let seen = instance::look(&s, ANSWER_TIMEOUT);
    let mut r = Row {
        name: f.name.clone(),
        state: "not running".into(),
        since: None,
        pid: None,
        warden_pid: None,
        model: f.configured.then(|| crate::daemon::environment::model_of(&s.child.command)).flatten(),
        address: f.configured.then(|| address(&s)).flatten(),
        last_load: None,
        last_load_secs: None,
        estimate_secs: None,
        last_failure: None,
        config: f.configured.then(|| f.config.display().to_string()),
        config_problems: if f.configured { problems.len() } else { 0 },
        unknown: None,
    };
    let verdict = match &seen {
        Seen::Verdict(v) => Some(v.as_ref()),
        Seen::Denied(why) | Seen::Unreadable(why) => {
            r.state = "unknown".into();
            r.unknown = Some(why.clone());
            None
        }
    };
    let doc = match verdict {
        Some(StatusVerdict::Ready(d) | StatusVerdict::NotReady(d)) => {
            r.state = d.state.to_string();
            r.pid = d.child_pid;
            r.warden_pid = Some(d.warden_pid);
            Some(d)
        }
        Some(StatusVerdict::NotRunning(Some(d))) => {
            r.state = match d.exit_code {
                Some(0) => "stopped".into(),
                Some(code) => format!("exited {code}"),
                None => "gone".into(),
            };
            Some(d)
        }
        Some(StatusVerdict::NotRunning(None)) | None => None,
    };
    if let Some(d) = doc {
        fill(&mut r, d);
    }
    if r.estimate_secs.is_none() {
        r.estimate_secs = estimate(&s.state_dir, doc.and_then(|d| d.fingerprint.as_deref()), s.ready.timeout);
    }
    r
}

/// What the status document says.
fn fill(r: &mut Row, d: &Doc) {
    r.since = Some(d.since.clone());
    if let Some(l) = &d.last_load {
        r.last_load = Some(l.outcome.clone());
        r.last_load_secs = Some(l.total_secs);
    }
    r.estimate_secs = d.load.as_ref().and_then(|l| l.expected_secs);
    r.last_failure = d.last_failure.as_ref().map(|f| f.cause.clone());
}

/// The median of the good loads of `fingerprint` (else of the last
/// load's setup) in the ledger, when this user may read it; loads longer
/// than `timeout` (`ready.timeout`) are not counted.
fn estimate(state_dir: &std::path::Path, fingerprint: Option<&str>, timeout: std::time::Duration) -> Option<f64> {
    let (records, _) = crate::tell::ledger::read(&state_dir.join(crate::tell::ledger::FILE)).ok()?;
    let fp = fingerprint.map(str::to_string).or_else(|| records.last().map(|r| r.fingerprint.clone()))?;
    let h = crate::supervisor::load::History::of(&records, &fp, timeout)?;
    Some(h.median.as_secs_f64())
}

/// Where the model serves: the front door's addresses (`[front]`), else
/// vLLM's `--host` (every address when none) and port.
fn address(s: &config::Settings) -> Option<String> {
    if let Some(front) = &s.front {
        return Some(front.listen.iter().map(config::Listen::shown).collect::<Vec<_>>().join(","));
    }
    let port = s.prestart.port?;
    let host = config::command::flag(&s.child.command, "--host").unwrap_or_else(|| "*".into());
    Some(if host.contains(':') { format!("[{host}]:{port}") } else { format!("{host}:{port}") })
}

fn secs(x: f64) -> String {
    let d = Duration::from_secs(x.clamp(0.0, 1e9) as u64);
    if d.is_zero() { format!("{x:.1}s") } else { humantime::format_duration(d).to_string().replace(' ', "") }
}

/// The table: a header, then a line per instance.
pub(crate) fn table(rows: &[Row]) -> String {
    let dash = || "-".to_string();
    let cell = |s: &Option<String>, max: usize| s.as_deref().map_or_else(dash, |s| one_line(s, max));
    let mut lines = vec![
        ["NAME", "STATE", "SINCE", "PID", "MODEL", "ADDRESS", "LAST LOAD", "ESTIMATE", "LAST FAILURE"]
            .map(String::from)
            .to_vec(),
    ];
    for r in rows {
        let last_load = match (&r.last_load, r.last_load_secs) {
            (Some(o), Some(t)) => format!("{} {}", one_line(o, 40), secs(t)),
            (Some(o), None) => one_line(o, 40),
            _ => dash(),
        };
        let mut state = one_line(&r.state, 40);
        if r.config_problems > 0 {
            state.push_str(" (config invalid)");
        }
        lines.push(vec![
            one_line(&r.name, 60),
            state,
            cell(&r.since, 40),
            r.pid.map_or_else(dash, |p| p.to_string()),
            cell(&r.model, 60),
            cell(&r.address, 60),
            last_load,
            r.estimate_secs.map_or_else(dash, secs),
            cell(&r.last_failure, 80),
        ]);
    }
    crate::cli::loads::columns(&lines)
}
