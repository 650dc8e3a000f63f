//! A stand-in for the front door's forwarding, in test builds only
//! (`fault-injection`), while the front door is built beside this: on each
//! TCP address of `front.listen`, every connection is one request that is
//! told to the loop as the front door tells it ([`Activity`]: it arrived,
//! waking an idle engine; it ended), held until the engine serves, then
//! answered `200` with `ready`. Nothing is forwarded. The front door
//! replaces it.

use std::sync::Arc;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::sync::watch;

use crate::config::{Front, Listen};
use crate::daemon::front::Activity;
use crate::daemon::server::View;
use crate::supervisor::outcome::Phase;
use crate::util::tasks::{Lifetime, Tasks};

pub fn serve(front: &Front, activity: &Arc<Activity>, view: &watch::Receiver<View>, tasks: &mut Tasks) {
    for l in &front.listen {
        let Listen::Tcp(addr) = l else { continue };
        let listener = match std::net::TcpListener::bind(addr).and_then(|l| {
            l.set_nonblocking(true)?;
            tokio::net::TcpListener::from_std(l)
        }) {
            Ok(l) => l,
            Err(e) => {
                tracing::error!(EVENT = "front", "the front door's stand-in cannot listen on {addr}: {e}");
                continue;
            }
        };
        let (activity, view) = (activity.clone(), view.clone());
        tasks.spawn("front door stand-in", Lifetime::Owned, async move {
            loop {
                let Ok((c, _)) = listener.accept().await else { continue };
                tokio::spawn(answer(c, activity.clone(), view.clone()));
            }
        });
    }
}

async fn answer(mut c: tokio::net::TcpStream, activity: Arc<Activity>, mut view: watch::Receiver<View>) {
    let mut head = Vec::new();
    let mut buf = [0u8; 1024];
    while !head.windows(4).any(|w| w == b"\r\n\r\n") && head.len() < 16 << 10 {
        match c.read(&mut buf).await {
            Ok(0) | Err(_) => return,
            Ok(n) => head.extend_from_slice(&buf[..n]),
        }
    }
    let idle = view.borrow().phase == Phase::Idle;
    activity.begin(idle);
    let ready = view.wait_for(|v| v.phase == Phase::Ready).await.is_ok();
    let answer: &[u8] = if ready {
        b"HTTP/1.1 200 OK\r\ncontent-length: 6\r\nconnection: close\r\n\r\nready\n"
    } else {
        b"HTTP/1.1 503 Service Unavailable\r\ncontent-length: 0\r\nconnection: close\r\n\r\n"
    };
    let _ = c.write_all(answer).await;
    activity.end();
}
