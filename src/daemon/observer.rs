//! The observer of the machine's state: after every change, the status
//! document and metrics, the journal's count of dropped lines, the tree
//! record in the state directory, the endpoint's view, and the front
//! door's gate.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use crate::config::Settings;
use crate::daemon::front::Gate;
use crate::supervisor::load::LoadNow;
use crate::supervisor::outcome::Phase;
use crate::supervisor::{Machine, State};
use crate::tell::outbox::Outbox;
use crate::util::redact;
use crate::util::worker::Worker;

/// The status files and the tree record, kept up to date by the loop.
pub struct StateObserver {
    pub status: crate::tell::status::Reporter,
    /// Its count of dropped lines goes into the metrics.
    journal: Option<crate::tell::journal::Forwarder>,
    /// When that count is read next.
    next_journal_count: std::time::Instant,
    pub tree: TreeRecord,
    /// Writes the status files and sends the notes behind them.
    pub outbox: Outbox,
    /// What the HTTP endpoint shows.
    view: tokio::sync::watch::Sender<crate::daemon::server::View>,
    /// The weight-cache daemon, for the status document.
    pub preload: Option<crate::daemon::preload::Preloader>,
    /// The front door (`[front]`): its gate, set from the machine after
    /// every change, and the door itself, for the status document.
    pub front: Option<FrontSide>,
}

/// What the observer keeps of the front door.
pub struct FrontSide {
    pub gate: tokio::sync::watch::Sender<Gate>,
    pub door: std::sync::Arc<crate::daemon::front::Door>,
    pub listen: Vec<String>,
    pub engine: String,
}

impl FrontSide {
    fn doc(&self) -> crate::tell::status::FrontDoc {
        let now = self.door.now();
        crate::tell::status::FrontDoc {
            listen: self.listen.clone(),
            engine: self.engine.clone(),
            held: now.held,
            in_flight: now.in_flight,
        }
    }
}

/// What the front door does with a request, from the machine: forward
/// while it is ready, hold while the engine will serve later (with the
/// load's estimate of when), refuse once the warden is done.
pub fn gate_of(m: &Machine) -> Gate {
    if m.failing() {
        return Gate::Holding { why: "model restarting".into(), eta: m.snapshot().last_load };
    }
    idle_gate(m).unwrap_or_else(|| gate(m.phase(), m.load_now().as_ref(), m.snapshot().last_load))
}

/// [`gate_of`] by the machine's phase, its load under way and the length
/// of its last load (the estimate of a start not yet loading). A new
/// state of the machine is a new row here.
pub fn gate(phase: Phase, load: Option<&LoadNow>, last_load: Option<Duration>) -> Gate {
    // A load past its estimate has none left (it may be close).
    // By the setup's median load, not the live estimate, which is never
    // behind the elapsed time.
    let load_left = load.and_then(|l| l.median.map(|e| e.saturating_sub(l.elapsed))).filter(|d| !d.is_zero());
    let holding = |why: &str, eta| Gate::Holding { why: why.to_string(), eta };
    match phase {
        Phase::Ready => Gate::Serving,
        // Loading (the golden check included: the machine is ready only
        // after it), or its pre-start steps before the load is known.
        Phase::Starting if load.is_some() => holding("model loading", load_left),
        Phase::Starting => holding("model starting", last_load),
        // Out of rotation, or about to restart: requests wait, never
        // refused (there is no estimate of an undrain).
        Phase::Draining | Phase::Drained => holding("model drained", None),
        // Out of rotation while its answers are proven again (a GPU fault
        // that did not end it, an upgrade, `golden.interval`): a few
        // completions' time.
        Phase::Rechecking => holding("model answers being checked", None),
        // Given back for want of requests: one starts or wakes it
        // ([`idle_gate`] gives the estimate).
        Phase::Idle => Gate::Idle { eta: None },
        Phase::Backoff | Phase::Failed | Phase::Stopping => holding("model restarting", last_load),
        Phase::Stopped => Gate::Closed,
    }
}

impl StateObserver {
    pub fn new(
        settings: &Settings,
        journal: Option<crate::tell::journal::Forwarder>,
        token: &str,
        view: tokio::sync::watch::Sender<crate::daemon::server::View>,
        outbox: Outbox,
    ) -> StateObserver {
        let s = settings;
        let mut status = crate::tell::status::Reporter::new(
            &s.name,
            &s.status.file,
            s.status.metrics_file.as_deref(),
            outbox.clone(),
        );
        status.resume(&s.state_dir);
        status.set_cache_dir(s.child.cache_dir.as_deref());
        StateObserver {
            status,
            journal,
            next_journal_count: std::time::Instant::now(),
            tree: TreeRecord::new(s.state_dir.clone(), s.name.clone(), token.to_string(), outbox.clone()),
            outbox,
            view,
            preload: None,
            front: None,
        }
    }

    fn publish(&self, m: Option<&Machine>) {
        let document = self.status.document();
        self.view.send_if_modified(|v| {
            let mut next = v.clone();
            if let Some(m) = m {
                next.phase = m.phase();
                // Said while it is what keeps the model out of rotation (a
                // drain held meanwhile says `drained`, as before).
                let why = m
                    .recheck_reason()
                    .filter(|_| m.phase() == crate::supervisor::outcome::Phase::Rechecking)
                    .map(|r| format!("the answers are being checked again after {r}"));
                next.cause = why
                    .or_else(|| m.cause().map(|c| c.text.clone()))
                    .map(|c| crate::util::escape::one_line(&redact::text(&c), crate::util::escape::MAX_LINE));
                next.load = m.load_now();
            }
            next.document = document;
            let changed = next != *v;
            *v = next;
            changed
        });
    }
}

/// The front door's gate for an idle engine (`front.idle-stop`): stopped,
/// or asleep, a request that comes is held and starts or wakes it; `eta`
/// is how long that should take (the ledger's estimate of a start, the
/// last wake). `None` when the engine is not idle: the gate is then what
/// the rest of the machine says. While it is falling asleep, and while it
/// wakes, the engine is not idle but the request is held all the same
/// (`Holding`), and one that came meanwhile is seen by the loop once the
/// engine sleeps.
// The front door's mapping of the machine to its gate asks this first.
pub fn idle_gate(m: &Machine) -> Option<crate::daemon::front::Gate> {
    (m.phase() == crate::supervisor::outcome::Phase::Idle)
        .then(|| crate::daemon::front::Gate::Idle { eta: m.idle_eta() })
}

/// How often the journal's count of dropped lines is brought into the
/// metrics while nothing else changes.
const JOURNAL_COUNT_EVERY: Duration = Duration::from_secs(5);

impl crate::daemon::driver::Observer for StateObserver {
    fn changed(&mut self, m: &Machine) {
        if let Some(j) = &self.journal {
            self.status.set_journal_dropped(j.dropped());
        }
        self.status.set_preload(self.preload.as_ref().and_then(|p| p.view()));
        if let Some(f) = &self.front {
            let next = gate_of(m);
            f.gate.send_if_modified(|g| {
                let changed = *g != next;
                *g = next;
                changed
            });
            self.status.set_front(Some(f.doc()));
        }
        self.status.update(&m.snapshot());
        self.tree.update(m);
        self.publish(Some(m));
    }
    fn reconfigure(&mut self, s: &Settings) {
        self.status.set_paths(&s.status.file, s.status.metrics_file.as_deref());
        self.status.set_cache_dir(s.child.cache_dir.as_deref());
    }

    fn reloaded(&mut self, reload: crate::tell::status::LastReload) {
        let shown = Arc::new(reload.clone());
        self.status.set_last_reload(reload);
        self.status.flush();
        self.view.send_modify(|v| {
            v.reloads += 1;
            v.last_reload = Some(shown);
        });
        self.publish(None);
    }

    fn settled(&mut self) {
        // The status files of a change that notified nothing.
        self.outbox.kick();
        self.tree.settle();
    }

    fn put_off(&self) -> bool {
        self.status.write_waits()
    }

    fn loop_turn(&mut self, took: Duration) {
        self.status.loop_turn(took);
    }

    /// `STATUS=` says how many requests the front door holds, when any
    /// (`loading 3/7 compile · 2m10s of ~4m50s · 12 requests held`).
    fn amend(&self, mut notes: Vec<crate::supervisor::events::Note>) -> Vec<crate::supervisor::events::Note> {
        let held = self.front.as_ref().map_or(0, |f| f.door.now().held);
        if held > 0 {
            for n in &mut notes {
                if let crate::supervisor::events::Note::Status(text) = n {
                    let s = if held == 1 { "" } else { "s" };
                    text.push_str(&format!(" · {held} request{s} held"));
                }
            }
        }
        notes
    }

    fn due(&self) -> Option<std::time::Instant> {
        let journal = self.journal.as_ref().map(|_| self.next_journal_count);
        [self.status.due(), journal].into_iter().flatten().min()
    }

    fn flush(&mut self) {
        let now = std::time::Instant::now();
        if let Some(j) = &self.journal
            && now >= self.next_journal_count
        {
            self.status.set_journal_dropped(j.dropped());
            self.next_journal_count = now + JOURNAL_COUNT_EVERY;
        }
        if let Some(f) = &self.front {
            self.status.set_front(Some(f.doc()));
        }
        if self.status.due().is_some_and(|d| d <= now) {
            self.status.flush();
            self.publish(None);
            self.outbox.kick();
        }
    }
}

/// Keeps the child's tree recorded in the state directory while it runs,
/// for a warden started after this one was killed (see `prestart`). The
/// `/proc` walk and the file write are done by a worker of its own
/// ([`crate::util::worker`]); of the jobs not yet taken only the latest is
/// kept, in a slot beside the worker's queue, handed on once the change's
/// news is out.
pub struct TreeRecord {
    state_dir: std::path::PathBuf,
    /// The recorder's next job; the worker is woken for it.
    slot: Slot,
    worker: Option<Worker<()>>,
    outbox: Outbox,
    /// The phase, progress and instant of the last record, while there is one.
    last: Option<(crate::supervisor::outcome::Phase, Option<String>, std::time::Instant)>,
    /// A job due, posted once the change's notifications are sent (the
    /// recorder's thread must not hold them back).
    due: Option<RecordJob>,
}

/// The recorder's next job.
type Slot = Arc<Mutex<Option<RecordJob>>>;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum RecordJob {
    Record,
    Clear,
}

/// How long the warden's exit waits for a record under way.
const RECORD_PATIENCE: Duration = Duration::from_secs(5);

impl TreeRecord {
    fn new(state_dir: std::path::PathBuf, instance: String, token: String, outbox: Outbox) -> TreeRecord {
        let slot: Slot = Arc::default();
        let (s, dir) = (slot.clone(), state_dir.clone());
        let spawned = Worker::named("tree record", 4).start(move |()| {
            let job = s.lock().unwrap_or_else(|p| p.into_inner()).take();
            match job {
                Some(RecordJob::Record) => {
                    if let Err(e) = crate::process::prestart::record_tree(&dir, &instance, &token) {
                        tracing::warn!(error = %e, "cannot record the child's tree in the state directory");
                    }
                }
                Some(RecordJob::Clear) => crate::process::prestart::clear_record(&dir),
                None => {}
            }
        });
        let worker = spawned
            .inspect_err(|e| {
                tracing::warn!(error = %e, "cannot start the tree recorder: a killed warden's leftovers will not be found")
            })
            .ok();
        TreeRecord { state_dir, slot, worker, outbox, last: None, due: None }
    }

    /// The warden is done and its tree gone: a job not yet taken is
    /// dropped, the one under way waited for, then no record is left
    /// behind.
    pub fn finish(&mut self) {
        self.due = None;
        self.slot.lock().unwrap_or_else(|p| p.into_inner()).take();
        if let Some(w) = self.worker.take()
            && !w.flush(RECORD_PATIENCE)
        {
            tracing::warn!("the tree record under way did not finish: it is cleared beside it");
        }
        crate::process::prestart::clear_record(&self.state_dir);
    }

    /// Post the job due, if any, once the change's status files and
    /// notifications are out: this is housekeeping, they are news (woken
    /// beside them, the recorder's `/proc` walk takes a CPU they wait for).
    fn settle(&mut self) {
        if let (Some(job), Some(w)) = (self.due.take(), &self.worker) {
            let (slot, w) = (self.slot.clone(), w.clone());
            self.outbox.after_sent(move || post(&slot, &w, job));
        }
    }

    /// Recorded again at every change of phase and, while loading, of the
    /// progress line (vLLM starts its engine and workers after the spawn;
    /// at most once a second); cleared when the tree is gone.
    fn update(&mut self, m: &Machine) {
        let phase = m.phase();
        let progress = m.progress().map(String::from);
        match m.state() {
            State::Starting(_) | State::Ready(_) => {
                let due = match &self.last {
                    Some((p, text, t)) => *p != phase || (*text != progress && t.elapsed() >= Duration::from_secs(1)),
                    None => true,
                };
                if due {
                    self.due = Some(RecordJob::Record);
                    self.last = Some((phase, progress, std::time::Instant::now()));
                }
            }
            // The tree is gone (a start without a backoff clears it here,
            // beside its pre-start steps).
            State::Backoff { .. } | State::Launching { .. } | State::Done(_) if self.last.is_some() => {
                self.due = Some(RecordJob::Clear);
                self.last = None;
            }
            _ => {}
        }
    }
}

/// Leave `job` in the recorder's slot, in place of a job not yet taken;
/// the worker is woken when the slot was empty (a wake-up is queued for a
/// job already there).
fn post(slot: &Slot, worker: &Worker<()>, job: RecordJob) {
    let was = slot.lock().unwrap_or_else(|p| p.into_inner()).replace(job);
    if was.is_none() {
        worker.send(());
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn load(elapsed: u64, expected: Option<u64>) -> LoadNow {
        LoadNow {
            phase: crate::supervisor::load::LoadPhase::Weights,
            index: 1,
            of: 3,
            elapsed: Duration::from_secs(elapsed),
            began: crate::util::clock::now(),
            expected: expected.map(Duration::from_secs),
            last: None,
            fingerprint: String::new(),
            preload: None,
            median: expected.map(Duration::from_secs),
            estimate: None,
            error: None,
            prefetch: None,
        }
    }

    #[test]
    fn the_gate_follows_the_machine() {
        let secs = |s| Some(Duration::from_secs(s));
        let hold = |why: &str, eta: Option<Duration>| Gate::Holding { why: why.into(), eta };
        let rows: [(Phase, Option<LoadNow>, Option<Duration>, Gate); 11] = [
            (Phase::Ready, None, secs(90), Gate::Serving),
            (Phase::Starting, Some(load(30, Some(90))), secs(80), hold("model loading", secs(60))),
            (Phase::Starting, Some(load(100, Some(90))), secs(80), hold("model loading", None)),
            (Phase::Starting, Some(load(5, None)), None, hold("model loading", None)),
            (Phase::Starting, None, secs(80), hold("model starting", secs(80))),
            (Phase::Draining, None, secs(80), hold("model drained", None)),
            (Phase::Drained, None, secs(80), hold("model drained", None)),
            (Phase::Backoff, None, secs(80), hold("model restarting", secs(80))),
            (Phase::Failed, None, None, hold("model restarting", None)),
            (Phase::Stopping, None, secs(80), hold("model restarting", secs(80))),
            (Phase::Stopped, None, secs(80), Gate::Closed),
        ];
        for (phase, l, last, want) in rows {
            assert_eq!(gate(phase, l.as_ref(), last), want, "{phase:?} {l:?}");
        }
        // Every phase has its row.
        for &p in Phase::ALL {
            let _ = gate(p, None, None);
        }
    }
}
