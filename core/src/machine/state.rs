//! The machine's states, each carrying exactly the data valid in it.

use std::time::Duration;

use crate::Instant;

use crate::classify::Exception;
use crate::events::{Cause, FailureKind};

use crate::exit::Code;
use crate::load::{LoadStart, LoadTrack, PrefetchNow};
use crate::outcome::Permanence;

/// What is known of one run of the child, from its spawn on.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct Run {
    pub(super) start: u32,
    pub(super) pid: u32,
    pub(super) spawned_at: Instant,
    /// The first progress line came at this instant.
    pub(super) first_progress: Option<Instant>,
    /// A fatal line was seen at this instant: the child has `grace` to exit.
    pub(super) fatal_at: Option<Instant>,
    /// The first fatal line (or a later permanent one), with its permanence.
    pub(super) first_fatal: Option<(String, Permanence)>,
    /// The first traceback's final exception line, and its permanence.
    pub(super) exception: Option<(Exception, Permanence)>,
    /// The kernel's OOM killer ended a process of the run: what it killed,
    /// with the memory figures. The cause, whatever the log says after
    /// (vLLM's front end logs its engine's death as an error of its own).
    pub(super) oom: Option<String>,
}

impl Run {
    /// The cause to report if this run fails now, when its log tells one.
    pub(super) fn logged_cause(&self) -> Option<Cause> {
        if let Some(oom) = &self.oom {
            return Some(Cause::new(oom.clone(), FailureKind::OomKilled));
        }
        let exc = self.exception.as_ref().map(|(e, p)| (e.text.clone(), *p));
        let fatal = self.first_fatal.clone();
        // A permanent match wins, then the exception line, then the fatal line.
        let (text, permanence) =
            [exc.clone(), fatal.clone()].into_iter().flatten().find(|(_, p)| p.is_permanent()).or(exc).or(fatal)?;
        Some(Cause { text, kind: FailureKind::FatalLine, permanence, hint: None })
    }

    /// The cause of this run's end when its fatal line's grace has passed.
    pub(super) fn fatal_grace_over(&self, grace: Duration, now: Instant) -> Option<Cause> {
        self.fatal_at.filter(|t| now >= *t + grace).and_then(|_| self.logged_cause())
    }
}

/// A run that is loading.
#[derive(Debug, Clone, PartialEq)]
pub struct Loading {
    pub(super) run: Run,
    /// The last progress line, and when it came (the stall deadline counts
    /// from it).
    pub(super) progress_at: Instant,
    pub(super) progress: Option<String>,
    /// The ready line was seen (or none is expected); waiting for HTTP 200.
    pub(super) awaiting_http: bool,
    /// HTTP answered; the golden check is under way.
    pub(super) golden: bool,
    /// The load's phases, its estimate and its deadlines from the ledger;
    /// it ends (into the ledger) when the run leaves loading.
    pub(super) track: Box<LoadTrack>,
    /// The instant of the last event while loading: the status document
    /// shows the load as of then.
    pub(super) seen: Instant,
}

/// A run that is serving.
#[derive(Debug, Clone, PartialEq)]
pub struct Serving {
    pub(super) run: Run,
    pub(super) ready_at: Instant,
    /// Being taken out of rotation, or held out of it.
    pub(super) drain: Option<ActiveDrain>,
    /// Out of rotation while the golden answers are asked again.
    pub(super) recheck: Option<Recheck>,
}

/// A re-check of a serving model's golden answers under way.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct Recheck {
    /// Why (the journal and `STATUS=` say it).
    pub(super) reason: String,
    /// Out of rotation since then: the pause the journal and metrics give.
    pub(super) began: Instant,
    /// Another reason came while the check was under way: the answers are
    /// asked again once it is over (those asked may predate it).
    pub(super) again: Option<String>,
}

/// What a drain ends in.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum DrainFor {
    /// The child keeps running, out of rotation, until undrained.
    Hold,
    /// The child is started again (`restart`).
    Restart,
    /// The child is started again with a new config.
    Reload,
    /// The warden stops.
    Stop,
}

/// How far a drain has gone.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum DrainStage {
    /// Unready; the balancer is given until then to notice.
    Delay { until: Instant },
    /// Waiting for no request running or waiting, at most until then.
    Quiesce { deadline: Instant },
    /// Out of rotation and quiet (a hold).
    Drained,
}

/// A drain under way: what it is for, how far it has gone, since when.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct ActiveDrain {
    pub(crate) for_: DrainFor,
    pub(crate) stage: DrainStage,
    pub(crate) began: Instant,
}

/// Why the tree is being stopped.
#[derive(Debug, Clone, PartialEq)]
pub enum Purpose {
    Shutdown,
    Failure(Cause),
    /// A new config: start again with it once the tree is gone.
    Reload,
    /// Asked for (`restart`): start again once the tree is gone.
    Restart,
    /// A part of the warden failed: exit 70 once the tree is gone.
    Internal(String),
    /// No request for this long (`front.idle-stop`): the engine is given
    /// back, and started again by the next request.
    Idle(Duration),
}

/// How far a stop has escalated.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Escalation {
    /// The stop signal was sent; it is sent again at `resend_at` (before
    /// ready, while the leader lives), and SIGKILL follows at `kill_at`.
    Signalled { kill_at: Instant, resend_at: Option<Instant> },
    /// SIGKILL was sent to the whole tree at this instant.
    Killed { at: Instant },
    /// Processes survived SIGKILL; waiting for their description until then.
    Abandoning { until: Instant },
}

#[derive(Debug, Clone, PartialEq)]
pub struct Stop {
    pub(super) purpose: Purpose,
    /// The leader's pid, until it is reaped.
    pub(super) leader: Option<u32>,
    /// How long the run had been ready, if it was.
    pub(super) ready_for: Option<Duration>,
    pub(super) escalation: Escalation,
}

/// A run on its way out (failed, or being stopped): loading, its load
/// over, or serving.
#[derive(Debug, Clone, PartialEq)]
pub(crate) enum Leaving {
    Loading(Run),
    Serving(Serving),
}

impl Leaving {
    pub(super) fn run(&self) -> &Run {
        match self {
            Leaving::Loading(run) => run,
            Leaving::Serving(s) => &s.run,
        }
    }

    /// When it became ready, if it did.
    pub(super) fn ready_at(&self) -> Option<Instant> {
        match self {
            Leaving::Loading(_) => None,
            Leaving::Serving(s) => Some(s.ready_at),
        }
    }
}

/// A failed run whose report is being written before its tree is stopped.
#[derive(Debug, Clone, PartialEq)]
pub struct Reporting {
    /// The run as it was when it failed.
    pub(super) run: Box<Leaving>,
    /// What the stop that follows is for: the failure, or what came since
    /// (a reload, a failure of the warden).
    pub(super) purpose: Purpose,
    /// The report's budget: the stop begins then, written or not.
    pub(super) until: Instant,
    /// The leader has not exited.
    pub(super) leader: bool,
}

/// What is known of a start's load before its spawn: what the ledger
/// says of its setup, and the read-ahead's latest counters.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Known {
    pub(super) setup: Option<Box<LoadStart>>,
    pub(super) prefetch: Option<PrefetchNow>,
}

/// What to do once the pre-start steps are over.
#[derive(Debug, Clone, PartialEq)]
pub enum AfterPrepare {
    /// Spawn, if the steps are over by `deadline`; `step` is the one now
    /// under way.
    Spawn { deadline: Instant, step: Option<String> },
    /// A reload or a restart came meanwhile: start again (with the new
    /// config), for this reason.
    Relaunch(crate::outcome::RestartReason),
    /// A stop (or a failure of the warden) came meanwhile.
    Stop(Purpose),
}

#[derive(Debug, Clone, PartialEq)]
pub enum State {
    Idle,
    /// The end of retries (`code`, said by `text`) held while the backend
    /// turns to the last-known-good setup (`RolledBack` follows at once):
    /// a start with it, or that end if it cannot be made.
    RollingBack {
        code: Code,
        text: String,
    },
    /// Pre-start steps and spawn of `start`.
    Launching {
        start: u32,
        then: AfterPrepare,
        known: Known,
    },
    Starting(Loading),
    Ready(Serving),
    /// The ready run taken over from a predecessor warden (version
    /// `from`), before its first event says so.
    Adopted {
        serving: Serving,
        from: String,
    },
    Reporting(Reporting),
    Stopping(Stop),
    Backoff {
        until: Instant,
        cause: Cause,
    },
    Done(Code),
    /// Stopped for want of requests (`idle-action = "stop"`): no child;
    /// the next request starts one.
    Parked(Parked),
    /// Put to sleep for want of requests (`idle-action = "sleep"`): the
    /// child is there, its GPUs' memory given back; the next request wakes it.
    Asleep(Dormant),
}

/// An engine stopped for want of requests.
#[derive(Debug, Clone, PartialEq)]
pub struct Parked {
    pub(super) since: Instant,
    /// How long no request had come when it was stopped.
    pub(super) quiet: Duration,
}

/// A serving run put to sleep, and how far its sleep or wake has gone.
#[derive(Debug, Clone, PartialEq)]
pub struct Dormant {
    pub(super) serving: Serving,
    pub(super) quiet: Duration,
    pub(super) stage: SleepStage,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum SleepStage {
    /// `/sleep` asked, not yet confirmed.
    Falling,
    /// Confirmed asleep since then.
    Asleep { since: Instant },
    /// A request came: `/wake_up` asked at this instant.
    Waking { at: Instant },
    /// Awake again: the golden answers are being checked before it serves.
    Checking { at: Instant },
}
