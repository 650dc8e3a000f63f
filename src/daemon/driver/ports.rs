//! The driver's ports: where the machine's effects are carried out, one
//! trait per job, as the real backend (`daemon::backend`) groups its
//! parts. No method has a default body: whatever backs the driver (the
//! real one, the driver tests' fake) says what each one does, so that no
//! path of the loop is left untried because a fake could skip it. What a
//! port starts off the loop comes back as an `Input`, mostly the
//! machine's own `Event`.

use std::collections::BTreeMap;
use std::future::Future;
use std::time::Duration;

use nix::sys::signal::Signal;

use crate::config::{FitArg, Settings};
use crate::daemon::reload::ReloadPlan;
use crate::supervisor::classify::Classifier;
use crate::supervisor::load::{LoadRecord, LoadStart};
use crate::supervisor::outcome::{Exit, StartFailure};
use crate::supervisor::{ReportOrder, Saved};

/// A start and its tree: the pre-start steps, the spawn, the signals,
/// what is left after them, and the leader's exit.
pub(crate) trait Launch {
    /// Start the pre-start steps of `start`; `Event::Prepared` when done,
    /// `Event::PrepareStep` for each step.
    fn prepare(&mut self, start: u32);
    /// Give up the pre-start steps; `Event::Prepared` still follows.
    fn cancel_prepare(&mut self);
    /// Spawn start `start`: its leader's pid.
    fn spawn(&mut self, start: u32) -> Result<u32, StartFailure>;
    /// Signal the tree; `Input::Tree` says what ends.
    fn terminate(&mut self, sig: Signal);
    /// SIGKILL to the tree; `Input::Tree` says what ends.
    fn kill_tree(&mut self);
    /// Describe what is left of the tree, off the loop: `Event::Survivors`.
    fn describe_survivors(&mut self);
    /// The leader `pid` of the run exited so: the cause, when the kernel's
    /// OOM killer ended it or one of its processes (host memory).
    fn oom_killed(&mut self, pid: u32, exit: Exit) -> Option<String>;
    /// Have the current run's lines read to the end of the file, then
    /// `Delivery::Drained` sent after them; false when no run's lines are
    /// followed (nothing will follow).
    fn drain_lines(&mut self) -> bool;
}

/// The HTTP checks of a run: readiness, health, the golden answers, the
/// requests in flight.
pub(crate) trait Checks {
    /// Wait until start `start` answers: `Event::HttpReady`.
    fn probe(&mut self, start: u32);
    /// Check the health of ready start `start` until the run ends;
    /// `Event::HealthFailed` when it fails.
    fn health(&mut self, start: u32);
    /// Ask the golden prompts of start `start`, off the loop:
    /// `Event::GoldenChecked`. Asked only with `golden` in the policy.
    fn golden(&mut self, start: u32);
    /// Watch the requests in flight of run `start`; `Event::Quiet` once
    /// none is running or waiting.
    fn watch_load(&mut self, start: u32);
    fn unwatch_load(&mut self);
}

/// An engine without requests (`front.idle-stop`): asleep, awake, or
/// stopped and parked.
pub(crate) trait Idle {
    /// Put the engine of run `start` to sleep at `level`, its health checks
    /// ended: `Event::Slept`.
    fn sleep(&mut self, start: u32, level: u8);
    /// Wake the engine of run `start`: `Event::Woke`.
    fn wake(&mut self, start: u32);
    /// The engine was stopped for want of requests: what the tree left
    /// goes, and the GPUs are looked at, off the loop.
    fn parked(&mut self);
}

/// The failure report of a failed run.
pub(crate) trait Reports {
    /// Write the failure report of the failed run, off the loop, while
    /// its tree is still there; `Event::Reported` when done. Returns the
    /// report's folder, or `None` when no report can be written (nothing
    /// follows then).
    fn report(&mut self, order: ReportOrder) -> Option<std::path::PathBuf>;
    /// Give up the report under way at once: its commands are killed,
    /// what is written stays.
    fn cancel_report(&mut self);
}

/// The load ledger, and what a start is made of for recovering by
/// itself: memory fit's values and pins, the last-known-good setup, a
/// rollback to it.
pub(crate) trait Loads {
    /// What the ledger knows of the setup just spawned.
    fn load_start(&mut self) -> Option<LoadStart>;
    /// A load ended: into the ledger, off the loop.
    fn load_ended(&mut self, record: LoadRecord);
    /// Memory fit's values for the next starts (empty: none).
    fn fit(&mut self, set: BTreeMap<FitArg, String>);
    /// Pin memory fit's values for the setup just ready, off the loop.
    fn pin(&mut self, values: BTreeMap<FitArg, String>);
    /// Drop memory fit's pins of the setup whose start with them failed
    /// (the file off the loop).
    fn unpin(&mut self, values: BTreeMap<FitArg, String>);
    /// Keep the setup just ready as the last-known-good (its record written
    /// off the loop).
    fn setup_good(&mut self);
    /// The last-known-good setup's settings, to be used from the next
    /// start as a reload's are (`Config::reconfigure` follows); why not,
    /// else.
    fn rollback(&mut self) -> Result<Settings, String>;
}

/// The upgrade in place: the new binary checked, the run's lines paused
/// at a line's end, the exec that hands the ready run over.
pub(crate) trait Upgrade {
    /// Ask the binary at the warden's path for its version, off the loop:
    /// `Input::UpgradeChecked`.
    fn check_upgrade(&mut self);
    /// Stop following the run's lines; false when nothing is followed.
    fn pause_lines(&mut self) -> bool;
    /// After [`Upgrade::pause_lines`], once the follower has ended (waiting
    /// up to `wait`): the offset of the first line not handed on whole
    /// (every batch before it is in the line queue).
    fn lines_paused(&mut self, wait: Duration) -> Option<u64>;
    /// Follow the run's lines again from `offset` (an upgrade given up).
    fn resume_lines(&mut self, offset: u64);
    /// Replace the warden by the binary at its path, handing over `saved`
    /// and the lines from `offset`; returns only on failure, saying why.
    fn exec_upgrade(&mut self, saved: Saved, offset: u64) -> String;
}

/// The config: read again, and put to use.
pub(crate) trait Config {
    /// Read the config file again, off the loop; `Input::Reload` follows.
    fn read_config(&mut self);
    /// Use these settings: the warden's own at once (the health checks of a
    /// ready run start again with them, the running child's lines are
    /// classified with `classifier`, their patterns compiled), the child's
    /// from the next start. Returns what changed against the settings in
    /// use.
    fn reconfigure(&mut self, settings: Settings, classifier: Classifier) -> ReloadPlan;
}

/// The backend's own background tasks, watched.
pub(crate) trait Tasks {
    /// Wait until a background task of the backend ends unexpectedly, and
    /// name it; pending while none does. Cancel-safe. The backend has
    /// already done what it can so that the tree can still be stopped (the
    /// reaper is started again).
    fn task_failed(&mut self) -> impl Future<Output = String>;
}
