//! Every exit code of every command, in one enum, turned into the process's
//! [`std::process::ExitCode`] in one place (`main`). What leads to each code
//! is decided elsewhere; only the numbers live here.

/// How a command ends.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Code {
    /// `run`: stopped on request; `check`: no problem; `status`: ready;
    /// `patch`: done.
    Ok,
    /// `patch`: a file could not be patched or restored.
    PatchFailed,
    /// `reports`, `loads`, `setups`, `golden`: no such record (report,
    /// load, setup, answers), or its file cannot be read.
    NoReport,
    /// The command line names no instance and the host has none or more
    /// than one, or names one wrongly (clap's own usage errors are 2 too).
    Usage,
    /// `status`: the warden runs, the model is not ready.
    NotReady,
    /// `status`: no warden runs for this config.
    NotRunning,
    /// EX_UNAVAILABLE: another warden already supervises this instance.
    AlreadyRunning,
    /// EX_NOPERM: a warden may run, or records exist, but this user may
    /// not reach them: the control socket's mode (`drain`, `undrain`,
    /// `restart`, `status`), a signal to another user's process or its
    /// lock (`upgrade`), the state folder (`reports`, `loads`, `setups`,
    /// `golden`).
    NoPermission,
    /// EX_SOFTWARE: the warden itself failed (a background task ended,
    /// the runtime could not start). The unit restarts it.
    Internal,
    /// EX_OSERR: processes of the tree survived SIGKILL (stuck in the
    /// kernel); restarting would meet them again. The unit does not restart.
    Unkillable,
    /// EX_TEMPFAIL: `max-attempts` failed starts in a row.
    GaveUp,
    /// EX_CONFIG: an invalid config, or a failure that retries cannot fix.
    Config,
}

impl Code {
    pub fn as_u8(self) -> u8 {
        match self {
            Code::Ok => 0,
            Code::PatchFailed | Code::NoReport => 1,
            Code::Usage => 2,
            Code::NotReady => 3,
            Code::NotRunning => 4,
            Code::AlreadyRunning => 69,
            Code::NoPermission => 77,
            Code::Internal => 70,
            Code::Unkillable => 71,
            Code::GaveUp => 75,
            Code::Config => 78,
        }
    }
}

impl From<Code> for std::process::ExitCode {
    fn from(c: Code) -> Self {
        std::process::ExitCode::from(c.as_u8())
    }
}

impl std::fmt::Display for Code {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}", self.as_u8())
    }
}
