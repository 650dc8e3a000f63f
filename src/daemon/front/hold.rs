//! The queue of held requests: a request that arrives while the engine
//! does not serve waits here (at most `front.max-held` of them), and all
//! of them are released in arrival order when the gate opens — or told
//! the warden is closing. Whether a request may be held at all (the
//! queue's room, the load's estimate against the time it may wait) is
//! decided here too, under the queue's lock, against the gate as it is
//! then: a gate that opens between the look and the wait cannot leave a
//! request behind.

use std::collections::VecDeque;
use std::sync::Mutex;
use std::time::Duration;

use tokio::sync::{oneshot, watch};

use super::Gate;

/// What a held request is told when its wait ends.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Release {
    /// The engine serves: send it.
    Go,
    /// The warden is ending: answer 503.
    Closed,
    /// The warden is being upgraded: a held request cannot be carried
    /// across the exec; answer 503 with a short `Retry-After` (the
    /// successor holds it when it comes again).
    Upgrading,
}

/// Why a request is not held.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Refused {
    /// The queue holds `max-held` already.
    Full { why: String, eta: Option<Duration> },
    /// The engine will not serve before the request's wait is over.
    TooLong { why: String, eta: Duration },
    /// The warden is ending.
    Closed,
    /// The warden is being upgraded (see [`Release::Upgrading`]).
    Upgrading,
}

/// The outcome of asking for a place.
pub(crate) enum Place<'q> {
    /// The engine serves now: no wait.
    Go,
    /// Held: wait on the ticket.
    Held(Ticket<'q>),
}

/// The queue; shared by every connection of the front door.
pub(crate) struct Queue {
    max: usize,
    inner: Mutex<Inner>,
    /// Told the queue's length after every change (the held gauge).
    on_len: Box<dyn Fn(usize) + Send + Sync>,
}

impl std::fmt::Debug for Queue {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Queue").field("max", &self.max).finish_non_exhaustive()
    }
}

#[derive(Debug, Default)]
struct Inner {
    next: u64,
    /// An upgrade's exec is near: nothing more is held.
    handing_over: bool,
    waiting: VecDeque<(u64, oneshot::Sender<Release>)>,
}

/// A held request's place; dropping it (a client gone) frees the place.
pub(crate) struct Ticket<'q> {
    queue: &'q Queue,
    id: u64,
    pub(crate) release: oneshot::Receiver<Release>,
}

impl Drop for Ticket<'_> {
    fn drop(&mut self) {
        // Released, timed out, or its client gone (hyper drops the
        // request when its connection closes): the place is free.
        let mut inner = self.queue.lock();
        if let Some(i) = inner.waiting.iter().position(|(id, _)| *id == self.id) {
            inner.waiting.remove(i);
            (self.queue.on_len)(inner.waiting.len());
        }
    }
}

impl Queue {
    /// At most `max` held; `on_len` is told the length after each change.
    pub(crate) fn new(max: usize, on_len: impl Fn(usize) + Send + Sync + 'static) -> Queue {
        Queue { max, inner: Mutex::default(), on_len: Box::new(on_len) }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Inner> {
        self.inner.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Requests held now.
    pub(crate) fn len(&self) -> usize {
        self.lock().waiting.len()
    }

    /// A place for a request that may wait `budget`, the gate being what
    /// `gate` holds now.
    pub(crate) fn admit<'q>(&'q self, gate: &watch::Receiver<Gate>, budget: Duration) -> Result<Place<'q>, Refused> {
        let mut inner = self.lock();
        let (why, eta) = match &*gate.borrow() {
            Gate::Serving => return Ok(Place::Go),
            Gate::Closed => return Err(Refused::Closed),
            Gate::Holding { why, eta } => (why.clone(), *eta),
            Gate::Idle { eta } => (IDLE_WHY.to_string(), *eta),
        };
        if inner.handing_over {
            return Err(Refused::Upgrading);
        }
        if let Some(eta) = eta.filter(|e| *e > budget) {
            return Err(Refused::TooLong { why, eta });
        }
        if inner.waiting.len() >= self.max {
            return Err(Refused::Full { why, eta });
        }
        let (tx, rx) = oneshot::channel();
        let id = inner.next;
        inner.next += 1;
        inner.waiting.push_back((id, tx));
        (self.on_len)(inner.waiting.len());
        Ok(Place::Held(Ticket { queue: self, id, release: rx }))
    }

    /// The gate changed to `gate`: release every held request in arrival
    /// order when it serves (or is closed). Returns how many.
    pub(crate) fn gate_changed(&self, gate: &watch::Receiver<Gate>) -> usize {
        let mut inner = self.lock();
        let release = match &*gate.borrow() {
            Gate::Serving => Release::Go,
            Gate::Closed => Release::Closed,
            Gate::Holding { .. } | Gate::Idle { .. } => return 0,
        };
        let n = inner.waiting.len();
        for (_, tx) in inner.waiting.drain(..) {
            let _ = tx.send(release);
        }
        (self.on_len)(0);
        n
    }
}

impl Queue {
    /// An upgrade's exec is near (`on`), or was given up: while it is,
    /// nothing is held, and what is held now is told
    /// [`Release::Upgrading`] (its wait lives in this process, which the
    /// exec ends). Returns how many were held.
    pub(crate) fn hand_over(&self, on: bool) -> usize {
        let mut inner = self.lock();
        inner.handing_over = on;
        if !on {
            return 0;
        }
        let n = inner.waiting.len();
        for (_, tx) in inner.waiting.drain(..) {
            let _ = tx.send(Release::Upgrading);
        }
        (self.on_len)(0);
        n
    }
}

/// What a request held for an idle engine is told.
pub(crate) const IDLE_WHY: &str = "model idle, starting";

#[cfg(test)]
mod tests {
    use super::*;

    fn holding(eta: Option<u64>) -> Gate {
        Gate::Holding { why: "model loading".into(), eta: eta.map(Duration::from_secs) }
    }

    #[tokio::test]
    async fn held_requests_are_released_in_arrival_order_when_the_gate_opens() {
        let (tx, rx) = watch::channel(holding(None));
        let told = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(99));
        let gauge = told.clone();
        let q = Queue::new(8, move |n| gauge.store(n, std::sync::atomic::Ordering::SeqCst));
        let told = move || told.load(std::sync::atomic::Ordering::SeqCst);
        let mut tickets: Vec<Ticket> = (0..5)
            .map(|_| match q.admit(&rx, Duration::from_secs(30)) {
                Ok(Place::Held(t)) => t,
                _ => panic!("not held"),
            })
            .collect();
        // One client went away: its place is freed, the others keep theirs.
        assert_eq!(told(), 5);
        tickets.remove(2);
        assert_eq!(q.len(), 4);
        assert_eq!(told(), 4, "the gauge follows a place freed");
        tx.send(holding(Some(3))).unwrap();
        assert_eq!(q.gate_changed(&rx), 0, "still holding");
        tx.send(Gate::Serving).unwrap();
        // The release order is the queue's order: the senders are woken
        // front to back (each got its `Go` before the next one's).
        let ids: Vec<u64> = q.lock().waiting.iter().map(|(id, _)| *id).collect();
        assert_eq!(ids, [0, 1, 3, 4]);
        assert_eq!(q.gate_changed(&rx), 4);
        assert_eq!(told(), 0);
        for t in &mut tickets {
            assert_eq!(t.release.try_recv(), Ok(Release::Go));
        }
        assert_eq!(q.len(), 0);
        assert!(matches!(q.admit(&rx, Duration::from_secs(30)), Ok(Place::Go)));
    }

    #[tokio::test]
    async fn a_full_queue_or_a_long_estimate_refuses_at_once() {
        let (tx, rx) = watch::channel(holding(Some(20)));
        let q = Queue::new(2, |_| {});
        let _a = q.admit(&rx, Duration::from_secs(30)).ok().unwrap();
        let _b = q.admit(&rx, Duration::from_secs(30)).ok().unwrap();
        assert!(matches!(q.admit(&rx, Duration::from_secs(30)), Err(Refused::Full { eta: Some(_), .. })));
        assert!(matches!(
            q.admit(&rx, Duration::from_secs(10)),
            Err(Refused::TooLong { eta, .. }) if eta == Duration::from_secs(20)
        ));
        tx.send(Gate::Closed).unwrap();
        assert!(matches!(q.admit(&rx, Duration::from_secs(30)), Err(Refused::Closed)));
        let mut a = _a;
        assert_eq!(q.gate_changed(&rx), 2);
        match &mut a {
            Place::Held(t) => assert_eq!(t.release.try_recv(), Ok(Release::Closed)),
            Place::Go => panic!(),
        }
    }

    #[tokio::test]
    async fn an_upgrade_answers_what_is_held_and_holds_nothing_more() {
        let (_tx, rx) = watch::channel(holding(None));
        let q = Queue::new(8, |_| {});
        let mut held = match q.admit(&rx, Duration::from_secs(30)) {
            Ok(Place::Held(t)) => t,
            _ => panic!("not held"),
        };
        assert_eq!(q.hand_over(true), 1);
        assert_eq!(held.release.try_recv(), Ok(Release::Upgrading));
        assert!(matches!(q.admit(&rx, Duration::from_secs(30)), Err(Refused::Upgrading)));
        // Given up: held again.
        assert_eq!(q.hand_over(false), 0);
        assert!(matches!(q.admit(&rx, Duration::from_secs(30)), Ok(Place::Held(_))));
    }
}
