//! One writer's thread: a named thread of its own fed by a bounded queue,
//! what it is handed done in order, what a full queue refuses dropped and
//! counted (the count readable, and said at most every so often), and a
//! flush that waits, under a deadline, until what was queued before it is
//! done. Every writer of the warden (the status files and notes, the
//! journal, its own log, the ledger and setups, the failure reports, the
//! tree record) is one of these with its own handler; what a writer adds
//! (coalescing, batching, an order between two kinds of news) is built on
//! top, in the writer.
//!
//! The handle is cheap to clone; when the last clone is dropped the thread
//! does what is queued and ends.

use std::collections::VecDeque;
use std::io;
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

/// A writer thread's stack. Writers format little and recurse not at all;
/// the default of 2 MiB is only address space, but what a thread touches
/// stays resident, and a smaller stack keeps a runaway from touching much.
pub(crate) const STACK: usize = 256 << 10;

/// How often, at the most, a worker says what it dropped.
pub(crate) const SAY_DROPPED_EVERY: Duration = Duration::from_secs(10);

/// What a worker's thread does with each item, and when it wakes by itself
/// with none (a retry that is due).
pub(crate) trait Handler<T>: Send + 'static {
    /// Do `item`: called in the order the items were queued.
    fn handle(&mut self, item: T);
    /// When to be woken with nothing queued; `None` waits for an item.
    fn wake_at(&self) -> Option<Instant>;
    /// Woken at [`Handler::wake_at`].
    fn wake(&mut self);
}

/// A closure as a handler that never wakes by itself.
struct Each<F>(F);

impl<T, F: FnMut(T) + Send + 'static> Handler<T> for Each<F> {
    fn handle(&mut self, item: T) {
        (self.0)(item)
    }
    fn wake_at(&self) -> Option<Instant> {
        None
    }
    fn wake(&mut self) {}
}

/// How a worker says what its full queue dropped: the number new since it
/// last said, and the total.
pub(crate) type Say = Box<dyn FnMut(u64, u64) + Send>;

/// The most bytes that may wait, and how an item is weighed.
type ByteBound<T> = (usize, fn(&T) -> usize);

/// A worker to be started: its name, bounds and stack.
pub(crate) struct Spec<T> {
    name: String,
    items: usize,
    bytes: Option<ByteBound<T>>,
    stack: usize,
    every: Duration,
    say: Option<Say>,
}

/// The handle of a worker's thread: queue, count, flush.
pub(crate) struct Worker<T> {
    open: Arc<Open<T>>,
}

impl<T> Clone for Worker<T> {
    fn clone(&self) -> Self {
        Worker { open: self.open.clone() }
    }
}

impl<T> std::fmt::Debug for Worker<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Worker").field("name", &self.open.shared.name).finish_non_exhaustive()
    }
}

/// Held by the handles only: when the last goes, the queue is closed.
struct Open<T> {
    shared: Arc<Shared<T>>,
}

impl<T> Drop for Open<T> {
    fn drop(&mut self) {
        self.shared.lock().closed = true;
        self.shared.posted.notify_one();
    }
}

struct Shared<T> {
    name: String,
    items: usize,
    bytes: Option<ByteBound<T>>,
    state: Mutex<State<T>>,
    /// Something was queued, or the queue closed.
    posted: Condvar,
    /// An item was done.
    done: Condvar,
}

struct State<T> {
    queue: VecDeque<T>,
    /// The bytes of what is queued, when the worker counts them.
    bytes: usize,
    /// Items taken into the queue, and items done, since the start.
    queued: u64,
    handled: u64,
    dropped: u64,
    /// The most items and bytes that ever waited at once.
    high_water: (usize, usize),
    closed: bool,
}

impl<T> Shared<T> {
    fn lock(&self) -> MutexGuard<'_, State<T>> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn weigh(&self, item: &T) -> usize {
        self.bytes.map_or(0, |(_, w)| w(item))
    }
}

impl<T: Send + 'static> Worker<T> {
    /// A worker named `name` (its thread's name), holding at most `items`.
    pub(crate) fn named(name: &str, items: usize) -> Spec<T> {
        Spec { name: name.to_string(), items, bytes: None, stack: STACK, every: SAY_DROPPED_EVERY, say: None }
    }

    /// Queue `item`; `false` if the queue is full (the item is dropped and
    /// counted) or the thread is gone.
    pub(crate) fn send(&self, item: T) -> bool {
        self.try_send(item).map_err(|_| self.open.shared.lock().dropped += 1).is_ok()
    }

    /// Queue `item`, or have it back, not counted, when it does not fit:
    /// for a writer that does it some other way.
    pub(crate) fn try_send(&self, item: T) -> Result<(), T> {
        let s = &self.open.shared;
        let weight = s.weigh(&item);
        let mut st = s.lock();
        let over_bytes = s.bytes.is_some_and(|(max, _)| st.bytes + weight > max);
        if st.queue.len() >= s.items || over_bytes {
            return Err(item);
        }
        st.queue.push_back(item);
        st.bytes += weight;
        st.queued += 1;
        st.high_water = (st.high_water.0.max(st.queue.len()), st.high_water.1.max(st.bytes));
        drop(st);
        // Woken with the lock let go: it does not wake only to wait for it.
        s.posted.notify_one();
        Ok(())
    }

    /// Items dropped so far.
    pub(crate) fn dropped(&self) -> u64 {
        self.open.shared.lock().dropped
    }

    /// The most items, and bytes, that ever waited at once.
    #[cfg(test)]
    pub(crate) fn high_water(&self) -> (usize, usize) {
        self.open.shared.lock().high_water
    }

    /// Wait until every item queued before this call is done, at most
    /// `limit`; whether that came.
    pub(crate) fn flush(&self, limit: Duration) -> bool {
        let s = &self.open.shared;
        let st = s.lock();
        let target = st.queued;
        let (_st, waited) =
            s.done.wait_timeout_while(st, limit, |st| st.handled < target).unwrap_or_else(|p| p.into_inner());
        !waited.timed_out()
    }
}

impl<T: Send + 'static> Spec<T> {
    /// Bound the queue in bytes too, each item weighed by `weigh`.
    pub(crate) fn bytes(mut self, max: usize, weigh: fn(&T) -> usize) -> Spec<T> {
        self.bytes = Some((max, weigh));
        self
    }

    /// The thread's stack, when it needs more than [`STACK`].
    pub(crate) fn stack(mut self, bytes: usize) -> Spec<T> {
        self.stack = bytes;
        self
    }

    /// Say the drops with `say`, at most every `every` (by default in the
    /// log, every [`SAY_DROPPED_EVERY`]): the warden's own log writer
    /// cannot log through itself.
    pub(crate) fn say_dropped(mut self, every: Duration, say: impl FnMut(u64, u64) + Send + 'static) -> Spec<T> {
        self.every = every;
        self.say = Some(Box::new(say));
        self
    }

    /// Start the thread, `handle` called with each item.
    pub(crate) fn start(self, handle: impl FnMut(T) + Send + 'static) -> io::Result<Worker<T>> {
        self.start_with(Each(handle))
    }

    /// Start the thread with a handler that may also wake by itself.
    pub(crate) fn start_with(self, handler: impl Handler<T>) -> io::Result<Worker<T>> {
        let (worker, shared) = self.unstarted_parts();
        let name = shared.name.clone();
        let every = self.every;
        let say = self.say.unwrap_or_else(|| {
            let name = name.clone();
            Box::new(move |_, total| {
                tracing::warn!(EVENT = "dropped", "{total} item(s) dropped so far by the {name} (it fell behind)")
            })
        });
        std::thread::Builder::new()
            .name(name)
            .stack_size(self.stack)
            .spawn(move || run(&shared, handler, every, say))?;
        Ok(worker)
    }

    /// The queue with no thread behind it: what is sent waits. For the
    /// tests of a writer's bounds.
    #[cfg(test)]
    pub(crate) fn unstarted(self) -> Worker<T> {
        self.unstarted_parts().0
    }

    fn unstarted_parts(&self) -> (Worker<T>, Arc<Shared<T>>) {
        let shared = Arc::new(Shared {
            name: self.name.clone(),
            items: self.items,
            bytes: self.bytes,
            state: Mutex::new(State {
                queue: VecDeque::new(),
                bytes: 0,
                queued: 0,
                handled: 0,
                dropped: 0,
                high_water: (0, 0),
                closed: false,
            }),
            posted: Condvar::new(),
            done: Condvar::new(),
        });
        (Worker { open: Arc::new(Open { shared: shared.clone() }) }, shared)
    }
}

/// The thread: each item in order, a wake-up when the handler asks, the
/// drops said; ends once the queue is closed and empty.
fn run<T>(shared: &Shared<T>, mut handler: impl Handler<T>, every: Duration, mut say: Say) {
    let (mut said, mut last_said) = (0u64, None::<Instant>);
    loop {
        let item = {
            let mut st = shared.lock();
            loop {
                if let Some(item) = st.queue.pop_front() {
                    st.bytes -= shared.weigh(&item);
                    break Some(item);
                }
                if st.closed {
                    return;
                }
                match handler.wake_at() {
                    Some(at) => {
                        let left = at.saturating_duration_since(Instant::now());
                        if left.is_zero() {
                            break None;
                        }
                        st = shared.posted.wait_timeout(st, left).unwrap_or_else(|p| p.into_inner()).0;
                    }
                    None => st = shared.posted.wait(st).unwrap_or_else(|p| p.into_inner()),
                }
            }
        };
        let Some(item) = item else {
            handler.wake();
            continue;
        };
        // A handler's panic is its item's: the thread and the queue go on.
        let _ = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| handler.handle(item)));
        let dropped = {
            let mut st = shared.lock();
            st.handled += 1;
            st.dropped
        };
        shared.done.notify_all();
        if dropped != said && last_said.is_none_or(|t| t.elapsed() >= every) {
            say(dropped - said, dropped);
            (said, last_said) = (dropped, Some(Instant::now()));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::mpsc;

    /// A handler that tells each item it begins, then waits to be let go.
    fn gated() -> (impl FnMut(u32) + Send + 'static, mpsc::Receiver<u32>, mpsc::Sender<()>) {
        let (began_tx, began) = mpsc::channel();
        let (go, go_rx) = mpsc::channel::<()>();
        let handle = move |n| {
            let _ = began_tx.send(n);
            let _ = go_rx.recv();
        };
        (handle, began, go)
    }

    #[test]
    fn items_are_done_in_the_order_queued() {
        let (tx, rx) = mpsc::channel();
        let w = Worker::named("order", 100).start(move |n: u32| tx.send(n).unwrap()).unwrap();
        for n in 0..50 {
            assert!(w.send(n));
        }
        assert!(w.flush(Duration::from_secs(60)));
        assert_eq!(rx.try_iter().collect::<Vec<_>>(), (0..50).collect::<Vec<_>>());
        assert_eq!(w.dropped(), 0);
    }

    #[test]
    fn a_full_queue_drops_and_counts_and_says_so() {
        let (handle, began, go) = gated();
        let (said_tx, said) = mpsc::channel();
        let w = Worker::named("full", 3)
            .say_dropped(Duration::ZERO, move |new, total| said_tx.send((new, total)).unwrap())
            .start(handle)
            .unwrap();
        assert!(w.send(0));
        // The thread holds item 0: the queue has room for three more.
        assert_eq!(began.recv().unwrap(), 0);
        assert!(w.send(1) && w.send(2) && w.send(3));
        assert!(!w.send(4));
        assert!(!w.send(5));
        assert_eq!(w.try_send(6), Err(6), "given back, not counted");
        assert_eq!(w.dropped(), 2);
        assert_eq!(w.high_water().0, 3);
        for _ in 0..4 {
            go.send(()).unwrap();
        }
        assert!(w.flush(Duration::from_secs(60)));
        assert_eq!(began.try_iter().collect::<Vec<_>>(), [1, 2, 3]);
        assert_eq!(said.recv().unwrap(), (2, 2), "said once, after the item under way when they were dropped");
        assert!(said.try_recv().is_err());
    }

    #[test]
    fn the_queue_is_bounded_in_bytes_too() {
        let w = Worker::named("bytes", 100).bytes(10, |s: &String| s.len()).unstarted();
        assert!(w.send("12345".into()));
        assert!(w.send("1234".into()));
        assert!(!w.send("12".into()));
        assert!(w.send("1".into()));
        assert_eq!((w.dropped(), w.high_water()), (1, (3, 10)));
    }

    #[test]
    fn flush_waits_for_what_was_queued_before_it_under_its_deadline() {
        let (handle, began, go) = gated();
        let w = Worker::named("flush", 10).start(handle).unwrap();
        assert!(w.send(1));
        assert_eq!(began.recv().unwrap(), 1);
        // Item 1 is held: a flush cannot finish, and says so at its deadline.
        let asked = Instant::now();
        assert!(!w.flush(Duration::from_millis(50)));
        assert!(asked.elapsed() >= Duration::from_millis(50));
        // Let go from another thread while a flush waits: it finishes, though
        // an item queued after it is still held.
        let (w2, (flushed_tx, flushed)) = (w.clone(), mpsc::channel());
        let flushing = std::thread::spawn(move || flushed_tx.send(w2.flush(Duration::from_secs(60))).unwrap());
        go.send(()).unwrap();
        assert!(flushed.recv().unwrap());
        flushing.join().unwrap();
        assert!(w.send(2));
        assert_eq!(began.recv().unwrap(), 2);
        assert!(!w.flush(Duration::ZERO));
        go.send(()).unwrap();
        assert!(w.flush(Duration::from_secs(60)));
    }

    #[test]
    fn a_handler_that_panics_loses_its_item_only() {
        let (tx, rx) = mpsc::channel();
        let w = Worker::named("panic", 10)
            .start(move |n: u32| {
                assert!(n != 1, "item 1");
                tx.send(n).unwrap();
            })
            .unwrap();
        for n in 0..3 {
            w.send(n);
        }
        assert!(w.flush(Duration::from_secs(60)));
        assert_eq!(rx.try_iter().collect::<Vec<_>>(), [0, 2]);
    }

    /// The last handle dropped: the thread does what was queued, then ends.
    #[test]
    fn the_thread_ends_after_its_queue_once_the_handles_are_gone() {
        let (mut handle, began, go) = gated();
        let (tx, rx) = mpsc::channel();
        let w = Worker::named("end", 10)
            .start(move |n| {
                handle(n);
                tx.send(n).unwrap();
            })
            .unwrap();
        w.send(1);
        w.send(2);
        assert_eq!(began.recv().unwrap(), 1);
        drop(w);
        go.send(()).unwrap();
        go.send(()).unwrap();
        assert_eq!(rx.iter().collect::<Vec<_>>(), [1, 2], "the sender went with the thread");
    }

    /// A handler that asks to be woken is, with nothing queued.
    #[test]
    fn a_handler_is_woken_when_it_asks() {
        struct Retry {
            at: Option<Instant>,
            woken: mpsc::Sender<()>,
        }
        impl Handler<()> for Retry {
            fn handle(&mut self, _: ()) {
                self.at = Some(Instant::now());
            }
            fn wake_at(&self) -> Option<Instant> {
                self.at
            }
            fn wake(&mut self) {
                self.at = None;
                self.woken.send(()).unwrap();
            }
        }
        let (tx, rx) = mpsc::channel();
        let w = Worker::named("wake", 10).start_with(Retry { at: None, woken: tx }).unwrap();
        w.send(());
        rx.recv().unwrap();
        assert!(rx.try_recv().is_err());
    }
}
