//! Processes beside the tree whose exit someone waits for (the
//! weight-cache daemon): the reaper reads every exit, and hands theirs on.

use std::io;
use std::process::Command;
use std::sync::Mutex;

use super::Exit;

/// Called with the exit of a watched pid, once.
pub(crate) type OnExit = Box<dyn FnOnce(Exit) + Send>;

/// The pids whose exit someone waits for. Held across a spawn and its
/// registration: the reaper, reading the exit of a process that died at
/// once, waits here until it is known whose it is.
static WATCHED: Mutex<Vec<(i32, OnExit)>> = Mutex::new(Vec::new());

/// The reaper read the exit of `pid`: hand it to whoever watches it.
pub(super) fn exited(pid: i32, exit: Exit) {
    let mut watched = WATCHED.lock().unwrap_or_else(|p| p.into_inner());
    if let Some(i) = watched.iter().position(|(p, _)| *p == pid) {
        let (_, on_exit) = watched.swap_remove(i);
        drop(watched);
        on_exit(exit);
    }
}

/// Spawn `cmd` (the caller sets its group, descriptors and environment);
/// `on_exit(pid)` makes what is called with its exit, which the reaper
/// cannot read before it is registered. `registered(pid)` runs first,
/// before any exit of it can be handed on.
pub(crate) fn spawn_watched(
    cmd: &mut Command,
    registered: impl FnOnce(i32),
    on_exit: impl FnOnce(i32) -> OnExit,
) -> io::Result<u32> {
    let mut watched = WATCHED.lock().unwrap_or_else(|p| p.into_inner());
    let child = cmd.spawn()?;
    let pid = child.id();
    // The reaper collects it; std's handle must not.
    drop(child);
    super::children_born();
    registered(pid as i32);
    watched.push((pid as i32, on_exit(pid as i32)));
    Ok(pid)
}
