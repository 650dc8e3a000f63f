//! The connections one listener serves, by peer: how many each peer
//! holds, which have had a request, and which one makes room when the
//! listener, or a peer, is at its cap.
//!
//! A kept-alive connection that asks something every few seconds is never
//! idle long enough for the endpoint's timeouts to end it: without this,
//! 64 of them hold the listener for as long as they like and a probe on a
//! new connection waits in the kernel's queue. So a connection that has
//! had a request is never owed its place: when a new connection needs it,
//! the one that has gone longest without a byte is told to close (at once
//! when it is between two requests, else after its answer, which then
//! says `Connection: close`). A connection that has not sent a request yet
//! keeps its place (the probe itself is one); the header timeout ends it
//! if it sends none.
//!
//! A peer is a TCP client's address, or a unix socket client's user id. It
//! holds at most [`Limits::per_peer`](super::Limits) of the listener's
//! connections: past that, its new connection takes the place of one of
//! its own, chosen as above but, when none of its own has had a request,
//! the one quiet the longest, closed at once (it was owed no answer). So a
//! peer that opens connections and sends nothing cannot take every place,
//! and its newest connection (a probe after a flood from the same address)
//! is served.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use super::Moved;

pub(crate) use crate::util::peer::Peer;

/// What a connection's task tells the table while it serves.
pub(crate) struct Use {
    /// When a byte last moved, either way.
    moved: Moved,
    /// Requests begun, and answered (a request in flight is their
    /// difference).
    begun: AtomicU64,
    answered: AtomicU64,
}

impl Use {
    /// A request begins; it is over when the guard is dropped.
    pub(crate) fn begin(self: &Arc<Self>) -> InFlight {
        self.begun.fetch_add(1, Ordering::Relaxed);
        InFlight(self.clone())
    }

    fn asked(&self) -> bool {
        self.begun.load(Ordering::Relaxed) > 0
    }

    fn busy(&self) -> bool {
        self.begun.load(Ordering::Relaxed) > self.answered.load(Ordering::Relaxed)
    }
}

/// A request in flight on a connection.
pub(crate) struct InFlight(Arc<Use>);

impl Drop for InFlight {
    fn drop(&mut self) {
        self.0.answered.fetch_add(1, Ordering::Relaxed);
    }
}

/// How a connection is told to close.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Close {
    /// It has had a request: at once between two, else after its answer
    /// (which says `Connection: close`).
    AfterAnswer,
    /// It has not: at once, whatever it was sending.
    Now,
}

struct Entry {
    peer: Peer,
    conn: Arc<Use>,
    /// Taken when the connection is told to close.
    close: Option<tokio::sync::oneshot::Sender<Close>>,
}

/// The connections of one listener.
#[derive(Default)]
pub(crate) struct Table {
    inner: Mutex<Inner>,
}

#[derive(Default)]
struct Inner {
    next: u64,
    conns: HashMap<u64, Entry>,
}

/// A connection's place in the table, for as long as its task holds it.
pub(crate) struct Slot {
    table: Arc<Table>,
    id: u64,
    pub(crate) conn: Arc<Use>,
    /// Fires when the connection should close, and how.
    pub(crate) close: tokio::sync::oneshot::Receiver<Close>,
}

impl Drop for Slot {
    fn drop(&mut self) {
        self.table.lock().conns.remove(&self.id);
    }
}

/// A new connection's place.
pub(crate) struct Admitted {
    pub(crate) slot: Slot,
    /// The peer held its most: one of its own connections was told to
    /// close for this one.
    pub(crate) made_room: bool,
}

impl Table {
    fn lock(&self) -> std::sync::MutexGuard<'_, Inner> {
        self.inner.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// A new connection from `peer`, which may hold at most `per_peer`
    /// (at least one) connections not told to close.
    pub(crate) fn admit(self: &Arc<Self>, peer: Peer, per_peer: usize, moved: Moved) -> Admitted {
        let mut inner = self.lock();
        let held = inner.conns.values().filter(|e| e.peer == peer && e.close.is_some()).count();
        // One of the peer's own makes room: any, those without a request
        // too, so there always is one.
        let made_room = held >= per_peer && inner.victim(|e| e.peer == peer, true).is_some_and(|id| inner.tell(id));
        let (tx, rx) = tokio::sync::oneshot::channel();
        let conn = Arc::new(Use { moved, begun: AtomicU64::new(0), answered: AtomicU64::new(0) });
        let id = inner.next;
        inner.next += 1;
        inner.conns.insert(id, Entry { peer, conn: conn.clone(), close: Some(tx) });
        Admitted { slot: Slot { table: self.clone(), id, conn, close: rx }, made_room }
    }

    /// Tell one connection that has had a request to close, for a new
    /// connection that waits for a place: one between two requests before
    /// one answering, then one of the peer that holds the most, then the
    /// one that has gone longest without a byte. False when none can: a
    /// connection that has not had its request yet keeps its place (it may
    /// be the probe that another is waiting behind).
    pub(crate) fn make_room(&self) -> bool {
        let mut inner = self.lock();
        inner.victim(|_| true, false).is_some_and(|id| inner.tell(id))
    }

    /// Connections held and not told to close, for a test.
    #[cfg(test)]
    fn open(&self) -> usize {
        self.lock().conns.values().filter(|e| e.close.is_some()).count()
    }
}

impl Inner {
    /// The connection `of` those chosen that makes room: between two
    /// requests, then answering one, then (with `fresh`) without one yet;
    /// of the peer holding the most; quiet the longest.
    fn victim(&self, of: impl Fn(&Entry) -> bool, fresh: bool) -> Option<u64> {
        let mut held: HashMap<Peer, usize> = HashMap::new();
        for e in self.conns.values().filter(|e| e.close.is_some()) {
            *held.entry(e.peer).or_default() += 1;
        }
        let rank = |e: &Entry| match (e.conn.asked(), e.conn.busy()) {
            (true, false) => 0,
            (true, true) => 1,
            (false, _) => 2,
        };
        self.conns
            .iter()
            .filter(|(_, e)| e.close.is_some() && (fresh || e.conn.asked()) && of(e))
            .min_by_key(|(id, e)| (rank(e), std::cmp::Reverse(held[&e.peer]), e.conn.moved.last(), **id))
            .map(|(id, _)| *id)
    }

    /// Tell `id` to close: after its answer if it has had a request, else
    /// now. True if it was not told before.
    fn tell(&mut self, id: u64) -> bool {
        let Some(e) = self.conns.get_mut(&id) else { return false };
        let how = if e.conn.asked() { Close::AfterAnswer } else { Close::Now };
        match e.close.take() {
            Some(tx) => {
                let _ = tx.send(how);
                true
            }
            None => false,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    fn ip(n: u8) -> Peer {
        Peer::Ip(std::net::Ipv4Addr::new(10, 0, 0, n).into())
    }

    fn admit(t: &Arc<Table>, peer: Peer, per_peer: usize) -> Slot {
        t.admit(peer, per_peer, Moved::since(tokio::time::Instant::now() - Duration::from_secs(60))).slot
    }

    /// A connection that has had a request and answered it, its last byte
    /// `ago` before the paused clock's now.
    fn served(slot: &Slot, ago: Duration) {
        drop(slot.conn.begin());
        slot.conn.moved.set(tokio::time::Instant::now() - ago);
    }

    fn told(slot: &mut Slot) -> bool {
        told_how(slot).is_some()
    }

    fn told_how(slot: &mut Slot) -> Option<Close> {
        slot.close.try_recv().ok()
    }

    #[tokio::test(start_paused = true)]
    async fn room_is_made_by_a_served_connection_never_by_a_new_one() {
        tokio::time::advance(Duration::from_secs(60)).await;
        let t = Arc::new(Table::default());
        let mut fresh = admit(&t, ip(1), 16);
        assert!(!t.make_room(), "a connection without a request keeps its place");
        assert!(!told(&mut fresh));
        let mut recent = admit(&t, ip(2), 16);
        let mut quiet = admit(&t, ip(3), 16);
        served(&recent, Duration::from_secs(1));
        served(&quiet, Duration::from_secs(3));
        let mut busy = admit(&t, ip(4), 16);
        let _asking = busy.conn.begin();
        busy.conn.moved.set(tokio::time::Instant::now() - Duration::from_secs(9));
        // Between two requests before answering; longest without a byte first.
        assert!(t.make_room());
        assert_eq!(told_how(&mut quiet), Some(Close::AfterAnswer));
        assert!(!told(&mut recent) && !told(&mut busy));
        assert!(t.make_room());
        assert!(told(&mut recent));
        // Then one answering: it closes after its answer.
        assert!(t.make_room());
        assert_eq!(told_how(&mut busy), Some(Close::AfterAnswer));
        assert!(!t.make_room(), "each is told once");
        assert!(!told(&mut fresh));
        drop((quiet, recent, busy));
        assert_eq!(t.open(), 1);
        drop(fresh);
        assert_eq!(t.lock().conns.len(), 0, "a slot goes with its connection");
    }

    #[tokio::test(start_paused = true)]
    async fn the_peer_holding_the_most_makes_room_first() {
        tokio::time::advance(Duration::from_secs(60)).await;
        let t = Arc::new(Table::default());
        let mut few = admit(&t, ip(1), 16);
        served(&few, Duration::from_secs(30));
        let mut many: Vec<Slot> = (0..3).map(|_| admit(&t, ip(2), 16)).collect();
        for m in &many {
            served(m, Duration::from_secs(1));
        }
        assert!(t.make_room());
        assert!(!told(&mut few), "the quieter one, but its peer holds one");
        assert_eq!(many.iter_mut().map(told).filter(|t| *t).count(), 1);
    }

    #[tokio::test(start_paused = true)]
    async fn a_peer_at_its_cap_makes_room_from_its_own() {
        tokio::time::advance(Duration::from_secs(60)).await;
        let t = Arc::new(Table::default());
        let mut other = admit(&t, ip(9), 2);
        served(&other, Duration::from_secs(50));
        let mut first = admit(&t, ip(1), 2);
        first.conn.moved.set(tokio::time::Instant::now() - Duration::from_secs(2));
        let mut second = admit(&t, ip(1), 2);
        second.conn.moved.set(tokio::time::Instant::now() - Duration::from_secs(4));
        served(&first, Duration::from_secs(1));
        // Its own served one makes room, after its answer; never another
        // peer's, nor one of its own still owed an answer.
        let third = t.admit(ip(1), 2, Moved::new());
        assert!(third.made_room);
        assert_eq!(told_how(&mut first), Some(Close::AfterAnswer));
        assert!(!told(&mut other) && !told(&mut second));
        // None of its own has had a request: the one quiet the longest
        // makes room at once.
        let mut third = third.slot;
        third.conn.moved.set(tokio::time::Instant::now() - Duration::from_secs(1));
        assert!(t.admit(ip(1), 2, Moved::new()).made_room);
        assert_eq!(told_how(&mut second), Some(Close::Now));
        assert!(!told(&mut third) && !told(&mut other));
        // Told to close, they no longer count against the peer's cap.
        assert_eq!(t.open(), 2, "the other peer's and the third (the fourth is gone)");
        assert!(!t.admit(ip(1), 2, Moved::new()).made_room);
    }

    #[test]
    fn peers_are_named_as_the_warning_names_them() {
        let v6 = "::ffff:10.0.0.1".parse::<std::net::IpAddr>().unwrap().to_canonical();
        assert_eq!(Peer::Ip(v6).to_string(), "10.0.0.1");
        assert_eq!(Peer::Uid(1000).to_string(), "uid 1000");
    }
}
