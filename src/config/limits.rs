//! The range of every duration key: wide enough for any real setting, and
//! narrow enough that no deadline the warden computes from one can
//! overflow (`"500000000000y"` parses, and `Instant + Duration` panics).
//! The man page's table shows the same ranges; a test tries them.

use std::ops::RangeInclusive;
use std::time::Duration;

const DAY: Duration = Duration::from_secs(24 * 60 * 60);
/// The longest duration any key accepts (the core's bound on its deadlines).
pub use vllm_warden_core::policy::LONGEST;
/// The shortest duration a key that must be positive accepts.
pub(crate) const SHORTEST: Duration = Duration::from_millis(1);

/// A wait, delay or grace; zero means none.
pub(crate) const WAIT: RangeInclusive<Duration> = Duration::ZERO..=LONGEST;
/// A period or timeout that must be positive.
pub(crate) const PERIOD: RangeInclusive<Duration> = SHORTEST..=LONGEST;
/// The deadlines of one start (`ready.timeout`, `ready.stall`): a week
/// is far beyond any load.
pub(crate) const START: RangeInclusive<Duration> = SHORTEST..=DAY.saturating_mul(7);

/// A config file, in bytes: 1 MiB, some hundred times the longest real
/// one, so that a file that is something else (a disk image, a log, a
/// link to `/dev/zero`) is refused before it is read.
pub(crate) const CONFIG_SIZE: u64 = 1 << 20;

/// `[[patch]] max-size`, in bytes: up to 4 GiB, so that a mistake
/// cannot ask the warden to read a disk image.
pub(crate) const PATCH_MAX_SIZE: RangeInclusive<u64> = 1..=4 << 30;

/// `child.log-max-size`: from 1 MiB (smaller, and the file would be
/// copied many times a second by a chatty server) to 1 TiB.
pub(crate) const LOG_MAX_SIZE: RangeInclusive<u64> = 1 << 20..=1 << 40;
/// `child.log-keep`: copies kept.
pub(crate) const LOG_KEEP: RangeInclusive<u32> = 0..=1000;
/// `reports.timeout`: long enough for a slow `py-spy` on a big tree,
/// short enough that a failed run's stop is never held for long.
pub(crate) const REPORTS_TIMEOUT: RangeInclusive<Duration> = Duration::from_secs(1)..=Duration::from_secs(600);
/// `reports.max-size`, in bytes: 1 MiB to 1 TiB.
pub(crate) const REPORTS_MAX_SIZE: RangeInclusive<u64> = 1 << 20..=1 << 40;
/// `reports.lines`.
pub(crate) const REPORTS_LINES: RangeInclusive<u64> = 0..=1_000_000;

/// `ledger.slow-factor` and `ledger.deadline-factor`.
pub(crate) const LEDGER_FACTOR: (f64, f64) = (1.0, 100.0);

/// `prefetch.threads`.
pub(crate) const PREFETCH_THREADS: RangeInclusive<u32> = 1..=64;
/// `prefetch.max-memory-fraction`.
pub(crate) const PREFETCH_MEMORY_FRACTION: (f64, f64) = (0.01, 0.95);

/// `golden.prompts`: at most this many (a file adds as many more).
pub(crate) const GOLDEN_PROMPTS: usize = 32;

/// `front.max-body`, in bytes: 1 KiB to 4 GiB.
pub(crate) const FRONT_MAX_BODY: RangeInclusive<u64> = 1 << 10..=4 << 30;
/// `front.min-body-rate`, bytes a second: 0 (none) to 1 GiB.
pub(crate) const FRONT_MIN_BODY_RATE: RangeInclusive<u64> = 0..=1 << 30;
/// `front.max-held`: up to a million.
pub(crate) const FRONT_MAX_HELD: RangeInclusive<u32> = 0..=1_000_000;
/// `front.max-connections`.
pub(crate) const FRONT_MAX_CONNECTIONS: RangeInclusive<u32> = 1..=1_000_000;
/// A unix socket's path fits `sun_path` (108 bytes with its NUL).
pub(crate) const UNIX_PATH: usize = 107;
