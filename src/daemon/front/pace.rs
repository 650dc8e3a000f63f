//! A request body's pace: the front door cuts a body that stops coming,
//! one that comes slower than `front.min-body-rate`, and one whose
//! connection is asked to make room for another (see `share.rs`); a body
//! read whole or streamed to the engine alike.
//!
//! The rule is a deadline for the whole body that grows only with what
//! comes: a body has [`BODY_START`] and one second more for every
//! `min-body-rate` bytes it sends (Apache's `mod_reqtimeout` shape, `body=
//! 20,MinRate=500`, with a floor a model's clients pass at any link they
//! send from). A sender cannot stretch it by sending a little at a time: a
//! body of N bytes is cut at the latest [`BODY_START`] + N / rate after it
//! began, and at a pause of [`BODY_IDLE_TIMEOUT`] whatever it sent before.
//! A rate measured over the whole body, not a sliding window: a client
//! whose link stalls for a moment keeps what it sent ahead.
//!
//! The clock starts when the body is first read, not at the head: a
//! request held while the engine loads (its body left in the socket) is
//! not the client's slowness. The body is polled before the clocks, so a
//! body the engine was slow to take (its socket full) has its bytes there
//! when it is read again.

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use hyper::body::{Body, Bytes, Frame, Incoming};
use tokio::time::{Instant, Sleep};

use super::share::Conn;

/// How long a body may make no progress (no byte comes): as the header
/// read's, a client that sends a body sends it at once.
pub(crate) const BODY_IDLE_TIMEOUT: Duration = Duration::from_secs(5);

/// The time a body has before its rate counts: the first bytes' way, a
/// client's own setup of its upload.
pub(crate) const BODY_START: Duration = Duration::from_secs(5);

type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// Why a body was cut: the error its reader meets, answered 408.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Cut {
    /// No byte came for [`BODY_IDLE_TIMEOUT`].
    Stalled,
    /// It came slower than this many bytes a second.
    Slow(u64),
    /// It came slower than the floor while the door was full, or its
    /// client held its share: its connection made room.
    MadeRoom,
}

impl std::fmt::Display for Cut {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Cut::Stalled => write!(f, "no byte of the body came for {}s", BODY_IDLE_TIMEOUT.as_secs()),
            Cut::Slow(rate) => {
                write!(f, "the body came slower than {rate} bytes a second (front.min-body-rate)")
            }
            Cut::MadeRoom => f.write_str(
                "the body came slower than front.min-body-rate while others waited for the connection: \
                 it was closed to make room",
            ),
        }
    }
}

impl std::error::Error for Cut {}

/// The `Cut` under an error, if a body was cut.
pub(crate) fn cut_of(e: &(dyn std::error::Error + 'static)) -> Option<Cut> {
    let mut source: Option<&(dyn std::error::Error + 'static)> = Some(e);
    while let Some(s) = source {
        if let Some(c) = s.downcast_ref::<Cut>() {
            return Some(*c);
        }
        source = s.source();
    }
    None
}

/// A client's request body under the pace's rule; the connection is told
/// how it comes.
pub(crate) struct Paced<B = Incoming> {
    body: B,
    /// `front.min-body-rate`; 0: no floor.
    rate: u64,
    conn: Arc<Conn>,
    /// Set at the first read.
    clocks: Option<Clocks>,
    cut: Pin<Box<dyn Future<Output = ()> + Send + Sync>>,
    ended: bool,
}

struct Clocks {
    began: Instant,
    received: u64,
    idle: Pin<Box<Sleep>>,
    due: Pin<Box<Sleep>>,
}

impl<B> Paced<B> {
    pub(crate) fn new(body: B, rate: u64, conn: Arc<Conn>) -> Paced<B> {
        let cut = Box::pin(conn.cut());
        Paced { body, rate, conn, clocks: None, cut, ended: false }
    }

    /// The deadline of a body that began at `began` and sent `received`.
    fn due(&self, began: Instant, received: u64) -> Instant {
        match self.rate {
            // No floor: as far as the pauses let it go.
            0 => began + Duration::from_secs(100 * 365 * 86400),
            rate => began + BODY_START + Duration::from_secs_f64(received as f64 / rate as f64),
        }
    }

    fn end(&mut self, why: Option<Cut>) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        self.ended = true;
        self.conn.read();
        Poll::Ready(why.map(|c| Err(c.into())))
    }
}

impl<B> Body for Paced<B>
where
    B: Body<Data = Bytes> + Unpin,
    B::Error: Into<BoxError>,
{
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        if self.ended {
            return Poll::Ready(None);
        }
        if self.clocks.is_none() {
            if self.body.is_end_stream() {
                // No body (a GET, `Content-Length: 0`): nothing to time.
                return self.end(None);
            }
            let now = Instant::now();
            let due = self.due(now, 0);
            self.conn.sending(now);
            self.clocks = Some(Clocks {
                began: now,
                received: 0,
                idle: Box::pin(tokio::time::sleep_until(now + BODY_IDLE_TIMEOUT)),
                due: Box::pin(tokio::time::sleep_until(due)),
            });
        }
        match Pin::new(&mut self.body).poll_frame(cx) {
            Poll::Ready(Some(Ok(frame))) => {
                let n = frame.data_ref().map_or(0, |d| d.len() as u64);
                if n > 0 {
                    let now = Instant::now();
                    let (began, received) = {
                        let c = self.clocks.as_mut().expect("set above");
                        c.received += n;
                        (c.began, c.received)
                    };
                    let due = self.due(began, received);
                    let c = self.clocks.as_mut().expect("set above");
                    c.idle.as_mut().reset(now + BODY_IDLE_TIMEOUT);
                    c.due.as_mut().reset(due);
                    self.conn.received(n);
                }
                return Poll::Ready(Some(Ok(frame)));
            }
            Poll::Ready(Some(Err(e))) => {
                self.ended = true;
                self.conn.read();
                return Poll::Ready(Some(Err(e.into())));
            }
            Poll::Ready(None) => return self.end(None),
            Poll::Pending => {}
        }
        if self.cut.as_mut().poll(cx).is_ready() {
            return self.end(Some(Cut::MadeRoom));
        }
        let rate = self.rate;
        let c = self.clocks.as_mut().expect("set above");
        if c.idle.as_mut().poll(cx).is_ready() {
            return self.end(Some(Cut::Stalled));
        }
        if c.due.as_mut().poll(cx).is_ready() {
            return self.end(Some(Cut::Slow(rate)));
        }
        Poll::Pending
    }

    fn is_end_stream(&self) -> bool {
        self.ended || self.body.is_end_stream()
    }

    fn size_hint(&self) -> hyper::body::SizeHint {
        self.body.size_hint()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::daemon::front::share::{Made, Peer, Slot, Table};
    use http_body_util::BodyExt;

    /// A body fed by a test, a piece at a time.
    struct Fed(tokio::sync::mpsc::UnboundedReceiver<Bytes>);

    impl Body for Fed {
        type Data = Bytes;
        type Error = std::convert::Infallible;
        fn poll_frame(
            mut self: Pin<&mut Self>,
            cx: &mut Context<'_>,
        ) -> Poll<Option<Result<Frame<Bytes>, Self::Error>>> {
            self.0.poll_recv(cx).map(|b| b.map(|b| Ok(Frame::data(b))))
        }
    }

    /// A body at `rate` whose client sends `piece` bytes every `every`,
    /// `pieces` of them (then holds its connection open, sending nothing).
    fn fed(rate: u64, piece: usize, every: Duration, pieces: usize) -> (Paced<Fed>, Arc<Table>, Slot) {
        let table = Arc::new(Table::default());
        let (slot, _) = table.admit(Peer::Unknown, 4, rate);
        let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
        tokio::spawn(async move {
            for _ in 0..pieces {
                if tx.send(Bytes::from(vec![b' '; piece])).is_err() {
                    return;
                }
                tokio::time::sleep(every).await;
            }
            std::future::pending::<()>().await;
        });
        (Paced::new(Fed(rx), rate, slot.conn.clone()), table, slot)
    }

    /// Read until the body ends: what it read, and the cut (if any).
    async fn read(mut body: Paced<Fed>) -> (u64, Option<Cut>) {
        let mut n = 0;
        while let Some(frame) = body.frame().await {
            match frame {
                Ok(f) => n += f.data_ref().map_or(0, |d| d.len() as u64),
                Err(e) => return (n, cut_of(&*e)),
            }
        }
        (n, None)
    }

    #[tokio::test(start_paused = true)]
    async fn a_body_a_little_at_a_time_cannot_stretch_its_deadline() {
        // 4 KiB a second against a floor of 16: 5 s + 4t/16 = t, at 6.7 s.
        let (body, _t, _slot) = fed(16 << 10, 1024, Duration::from_millis(250), usize::MAX);
        let began = Instant::now();
        let (n, cut) = read(body).await;
        let took = began.elapsed();
        assert_eq!(cut, Some(Cut::Slow(16 << 10)));
        assert!(took > Duration::from_millis(6500) && took < Duration::from_millis(6800), "{took:?}");
        assert!(n < 30 << 10, "{n}");
    }

    #[tokio::test(start_paused = true)]
    async fn a_body_that_stops_is_cut_after_five_seconds_whatever_it_sent_before() {
        let (body, _t, _slot) = fed(16 << 10, 1 << 20, Duration::from_millis(10), 1);
        let began = Instant::now();
        assert_eq!(read(body).await, (1 << 20, Some(Cut::Stalled)));
        assert_eq!(began.elapsed(), BODY_IDLE_TIMEOUT);
    }

    #[tokio::test(start_paused = true)]
    async fn a_body_at_the_floor_comes_whole_and_its_clock_starts_when_it_is_read() {
        // 32 KiB a second against a floor of 16, read after 30 s held:
        // the wait is not the client's.
        let (mut body, _t, _slot) = fed(16 << 10, 1024, Duration::from_micros(31_250), 640);
        tokio::time::sleep(Duration::from_secs(30)).await;
        let mut n = 0;
        loop {
            match tokio::time::timeout(Duration::from_secs(60), body.frame()).await {
                Ok(Some(Ok(f))) => n += f.data_ref().map_or(0, |d| d.len()),
                Ok(other) => panic!("{:?}", other.map(|r| r.map(|_| ()))),
                Err(_) => panic!("never cut, never ended"),
            }
            if n == 640 << 10 {
                break;
            }
        }
    }

    #[tokio::test(start_paused = true)]
    async fn a_slow_body_asked_to_make_room_is_cut() {
        let rate = 16 << 10;
        let (body, table, _slot) = fed(rate, 100, Duration::from_millis(250), usize::MAX);
        let reading = tokio::spawn(read(body));
        tokio::time::sleep(Duration::from_secs(2)).await;
        assert!(matches!(table.make_room(rate), Ok((Peer::Unknown, Made::Slow(r))) if r < 1000));
        assert_eq!(reading.await.unwrap().1, Some(Cut::MadeRoom));
    }
}
