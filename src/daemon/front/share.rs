//! The front door's connections by client, and which one makes room when
//! the door is full or a client holds its share.
//!
//! Each connection is told here where its request is: none yet, a body
//! being read (since when, how many bytes), a request in hand (held,
//! forwarded, answered), or nothing between two requests. Only two kinds
//! may be asked to make room: a kept-alive connection between two
//! requests (closed at once; its client opens another), and one whose body
//! comes slower than `front.min-body-rate` on average, judged after its
//! first [`JUDGED_AFTER`] (cut with 408: it would be cut by its own
//! deadline soon, see `pace.rs`). A connection whose request is held or
//! forwarded keeps its place, whoever sent it, and so does one whose head
//! has not come (the header timeout ends it in 5 s; it may be the request
//! another client waits for).
//!
//! A client is a TCP client's address, or a unix socket client's user. It
//! holds a share of the door, a [`PEER_SHARE`]th of its connections: a
//! client past its share makes room from its own for its new connection,
//! and when the door is full, the client holding the most makes room
//! first. So one address sending slowly cannot take the door, and its
//! newest connection is served in place of its slowest.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::sync::watch;
use tokio::time::Instant;

/// A client holds at most this fraction of the door's connections before
/// its new ones take the place of its own (as the endpoint's clients do).
pub(crate) const PEER_SHARE: usize = 4;

/// A body is judged slow only after it has been read this long: its first
/// moments say nothing of its rate.
pub(crate) const JUDGED_AFTER: Duration = Duration::from_secs(1);

pub(crate) use crate::util::peer::Peer;

/// Where a connection's request is.
#[derive(Debug, Clone, Copy, PartialEq)]
enum Stage {
    /// No request yet: its head is on the way.
    New,
    /// Its body is being read, since `since`.
    Sending { since: Instant, received: u64 },
    /// A request in hand: its body not read yet (held), or read, and the
    /// request held, forwarded or being answered.
    Asked,
    /// Between two requests of a kept-alive connection.
    Idle,
}

/// One connection, as its task tells it.
#[derive(Debug)]
pub(crate) struct Conn {
    stage: Mutex<Stage>,
    /// Set when it is asked to make room.
    cut: watch::Sender<bool>,
}

impl Conn {
    fn new() -> Conn {
        Conn { stage: Mutex::new(Stage::New), cut: watch::Sender::new(false) }
    }

    fn set(&self, f: impl FnOnce(&mut Stage)) {
        f(&mut self.stage.lock().unwrap_or_else(|p| p.into_inner()));
    }

    fn stage(&self) -> Stage {
        *self.stage.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// A request's head came.
    pub(crate) fn asked(&self) {
        self.set(|s| *s = Stage::Asked);
    }

    /// Its body is being read from now on.
    pub(crate) fn sending(&self, since: Instant) {
        self.set(|s| *s = Stage::Sending { since, received: 0 });
    }

    /// `n` bytes more of its body came.
    pub(crate) fn received(&self, n: u64) {
        self.set(|s| {
            if let Stage::Sending { received, .. } = s {
                *received += n;
            }
        });
    }

    /// Its body is read (whole, or not at all: it failed).
    pub(crate) fn read(&self) {
        self.set(|s| *s = Stage::Asked);
    }

    /// Its answer is done: between two requests.
    pub(crate) fn answered(&self) {
        self.set(|s| *s = Stage::Idle);
    }

    /// Resolves when the connection is asked to make room.
    pub(crate) fn cut(&self) -> impl std::future::Future<Output = ()> + Send + Sync + 'static {
        let mut rx = self.cut.subscribe();
        async move {
            if rx.wait_for(|c| *c).await.is_err() {
                std::future::pending::<()>().await;
            }
        }
    }
}

/// What made room.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) enum Made {
    /// A kept-alive connection between two requests, closed.
    Idle,
    /// A body slower than the floor, at this many bytes a second, cut.
    Slow(u64),
}

#[derive(Debug)]
struct Entry {
    peer: Peer,
    conn: Arc<Conn>,
    /// Asked to make room already: it no longer counts as its client's.
    told: bool,
}

/// The connections of the front door (all its listeners).
#[derive(Debug, Default)]
pub(crate) struct Table {
    inner: Mutex<Inner>,
}

#[derive(Debug, Default)]
struct Inner {
    next: u64,
    conns: HashMap<u64, Entry>,
}

/// A connection's place in the table, for as long as its task holds it.
#[derive(Debug)]
pub(crate) struct Slot {
    table: Arc<Table>,
    id: u64,
    pub(crate) conn: Arc<Conn>,
}

impl Drop for Slot {
    fn drop(&mut self) {
        self.table.lock().conns.remove(&self.id);
    }
}

impl Table {
    fn lock(&self) -> std::sync::MutexGuard<'_, Inner> {
        self.inner.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// A new connection from `peer`. When `peer` holds `per_peer` or more
    /// already, one of its own makes room (see [`Table::make_room`]), if
    /// one may: what made it is returned beside the slot.
    pub(crate) fn admit(self: &Arc<Self>, peer: Peer, per_peer: usize, floor: u64) -> (Slot, Option<Made>) {
        let mut inner = self.lock();
        let held = inner.conns.values().filter(|e| e.peer == peer && !e.told).count();
        let made = if held >= per_peer { inner.tell(|e| e.peer == peer, floor, Instant::now()) } else { None };
        let made = made.map(|(_, m)| m);
        let conn = Arc::new(Conn::new());
        let id = inner.next;
        inner.next += 1;
        inner.conns.insert(id, Entry { peer, conn: conn.clone(), told: false });
        (Slot { table: self.clone(), id, conn }, made)
    }

    /// The door is full and a new connection waits: ask one connection to
    /// make room, a kept-alive one between two requests or a body slower
    /// than `floor` bytes a second (none with a floor of 0), of the client
    /// holding the most, then the idle before the slow, the slowest first.
    /// When none may: the moment the first body now too young to judge
    /// will be judged, if there is one.
    pub(crate) fn make_room(&self, floor: u64) -> Result<(Peer, Made), Option<Instant>> {
        let mut inner = self.lock();
        let now = Instant::now();
        match inner.tell(|_| true, floor, now) {
            Some(told) => Ok(told),
            None => Err(inner.judged_next(floor, now)),
        }
    }

    /// Connections held and not asked to make room, for a test.
    #[cfg(test)]
    fn open(&self) -> usize {
        self.lock().conns.values().filter(|e| !e.told).count()
    }
}

impl Inner {
    /// The connection `of` those chosen that may make room, and how.
    fn victim(&self, of: impl Fn(&Entry) -> bool, floor: u64, now: Instant) -> Option<(u64, Made)> {
        let mut held: HashMap<Peer, usize> = HashMap::new();
        for e in self.conns.values().filter(|e| !e.told) {
            *held.entry(e.peer).or_default() += 1;
        }
        self.conns
            .iter()
            .filter(|(_, e)| !e.told && of(e))
            .filter_map(|(id, e)| {
                let made = match e.conn.stage() {
                    Stage::Idle => Made::Idle,
                    Stage::Sending { since, received } => {
                        let took = now.saturating_duration_since(since);
                        let rate = (received as f64 / took.as_secs_f64().max(f64::MIN_POSITIVE)) as u64;
                        if floor == 0 || took < JUDGED_AFTER || rate >= floor {
                            return None;
                        }
                        Made::Slow(rate)
                    }
                    Stage::New | Stage::Asked => return None,
                };
                Some((*id, e, made))
            })
            .min_by_key(|(id, e, made)| {
                let (kind, rate) = match made {
                    Made::Idle => (0, 0),
                    Made::Slow(rate) => (1, *rate),
                };
                (std::cmp::Reverse(held[&e.peer]), kind, rate, *id)
            })
            .map(|(id, _, made)| (id, made))
    }

    /// Ask the connection `of` those chosen that may make room to make it.
    fn tell(&mut self, of: impl Fn(&Entry) -> bool, floor: u64, now: Instant) -> Option<(Peer, Made)> {
        let (id, made) = self.victim(of, floor, now)?;
        let e = self.conns.get_mut(&id)?;
        e.told = true;
        e.conn.cut.send_replace(true);
        Some((e.peer, made))
    }

    /// The moment the first body too young to judge now will be judged.
    fn judged_next(&self, floor: u64, now: Instant) -> Option<Instant> {
        if floor == 0 {
            return None;
        }
        self.conns
            .values()
            .filter(|e| !e.told)
            .filter_map(|e| match e.conn.stage() {
                Stage::Sending { since, .. } if since + JUDGED_AFTER > now => Some(since + JUDGED_AFTER),
                _ => None,
            })
            .min()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ip(n: u8) -> Peer {
        Peer::Ip(std::net::Ipv4Addr::new(10, 0, 0, n).into())
    }

    fn told(slot: &Slot) -> bool {
        *slot.conn.cut.borrow()
    }

    /// A connection sending its body for `took`, `received` bytes of it.
    fn sending(slot: &Slot, took: Duration, received: u64) {
        slot.conn.sending(Instant::now() - took);
        slot.conn.received(received);
    }

    #[tokio::test(start_paused = true)]
    async fn only_an_idle_connection_or_a_slow_body_makes_room() {
        tokio::time::advance(Duration::from_secs(60)).await;
        let t = Arc::new(Table::default());
        let floor = 1000;
        let (new, _) = t.admit(ip(1), 16, floor);
        let (held, _) = t.admit(ip(2), 16, floor);
        held.conn.asked();
        let (fast, _) = t.admit(ip(3), 16, floor);
        sending(&fast, Duration::from_secs(10), 100_000);
        let (young, _) = t.admit(ip(4), 16, floor);
        sending(&young, Duration::from_millis(500), 0);
        assert_eq!(
            t.make_room(floor),
            Err(Some(Instant::now() + Duration::from_millis(500))),
            "none may: new, held, fast, judged too soon (in half a second)"
        );
        let (slow, _) = t.admit(ip(5), 16, floor);
        sending(&slow, Duration::from_secs(4), 400);
        let (slower, _) = t.admit(ip(6), 16, floor);
        sending(&slower, Duration::from_secs(4), 40);
        let (idle, _) = t.admit(ip(7), 16, floor);
        idle.conn.answered();
        // The idle one first, then the slowest body.
        assert_eq!(t.make_room(floor), Ok((ip(7), Made::Idle)));
        assert!(told(&idle));
        assert_eq!(t.make_room(floor), Ok((ip(6), Made::Slow(10))));
        assert_eq!(t.make_room(floor), Ok((ip(5), Made::Slow(100))));
        assert_eq!(t.make_room(floor), Err(Some(Instant::now() + Duration::from_millis(500))), "each is asked once");
        assert!(!told(&new) && !told(&held) && !told(&fast) && !told(&young));
        // Without a floor, no body is slow.
        let (unfloored, _) = t.admit(ip(8), 16, 0);
        sending(&unfloored, Duration::from_secs(4), 0);
        assert_eq!(t.make_room(0), Err(None));
        assert_eq!(t.open(), 5);
        drop((new, held, fast, young, slow, slower, idle, unfloored));
        assert_eq!(t.lock().conns.len(), 0, "a slot goes with its connection");
    }

    #[tokio::test(start_paused = true)]
    async fn the_client_holding_the_most_makes_room_and_one_past_its_share_makes_its_own() {
        tokio::time::advance(Duration::from_secs(60)).await;
        let t = Arc::new(Table::default());
        let floor = 1000;
        // Another client's body, slower than any of the crowd's.
        let (other, _) = t.admit(ip(9), 2, floor);
        sending(&other, Duration::from_secs(5), 0);
        let (a, made) = t.admit(ip(1), 2, floor);
        assert_eq!(made, None);
        sending(&a, Duration::from_secs(5), 1000);
        let (b, made) = t.admit(ip(1), 2, floor);
        assert_eq!(made, None);
        sending(&b, Duration::from_secs(5), 2000);
        // The door full: the client holding the most makes room, its
        // slowest, though another's is slower.
        assert_eq!(t.make_room(floor), Ok((ip(1), Made::Slow(200))));
        assert!(told(&a) && !told(&b) && !told(&other));
        // Past its share, its new connection takes the place of its own.
        let (_c, made) = t.admit(ip(1), 2, floor);
        assert_eq!(made, None, "one told already no longer counts: at its share, not past it");
        let (_d, made) = t.admit(ip(1), 2, floor);
        assert_eq!(made, Some(Made::Slow(400)));
        assert!(told(&b) && !told(&other));
    }

    #[test]
    fn peers_are_named_as_the_warning_names_them() {
        let v6 = "::ffff:10.0.0.1".parse::<std::net::IpAddr>().unwrap().to_canonical();
        assert_eq!(Peer::Ip(v6).to_string(), "10.0.0.1");
        assert_eq!(Peer::Uid(1000).to_string(), "uid 1000");
    }
}
