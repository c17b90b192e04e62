//! The health port (`server.health_listen`): plaintext HTTP on an address of its own that
//! answers `GET /health` and `HEAD /health` and nothing else, for a load balancer or an
//! orchestrator that cannot present a client certificate (with `tls.client_ca_file` the lock
//! port's handshake needs one, `/health` included).
//!
//! It reveals only what `/health` says (serving, or why not: shutting down, no quorum, shards
//! without a leader), so it needs neither TLS nor an identity; keep it on loopback or an
//! address only the prober reaches all the same. Its answer is the lock port's, decided by the
//! same rule ([`super::health::decide_figures`]) from what each core published last: a core
//! publishes its figures ([`HealthBoard`]) at least every [`HEALTH_PUBLISH_US`] while the
//! port exists, so an answer is at most that old. Until every core of a cluster member has
//! published once, the answer is `503 starting`.
//!
//! One thread serves it, one connection at a time: a request head must arrive within
//! [`REQUEST_DEADLINE`] (at most [`http::HEAD_BYTES_MAX`] bytes) and its answer leave within
//! the same, so a slow or silent client delays the next probe by at most that much.
//!
//! Deliberately not here: the other admin pages (`/metrics`, `/stats`, `/keys`, on the lock
//! port with its TLS and rules) and the lock protocol.

use std::io::{self, Read, Write};
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use parking_lot::Mutex;

use super::health::{decide_figures, Health, HealthFigures};
use super::http::{self, Head, Refusal, Route};
use crate::server::Shared;

/// How often a core publishes its figures while the health port exists (and so how old an
/// answer may be).
pub const HEALTH_PUBLISH_US: u64 = 250_000;
/// How long one connection may take to send its request head and take its answer.
pub const REQUEST_DEADLINE: Duration = Duration::from_secs(1);

/// What each core published last for the health port: `None` until it has, then its figures
/// (`None` inside for a single node's core, which has no cluster figures).
pub struct HealthBoard {
    cores: Mutex<Vec<Option<Option<HealthFigures>>>>,
    cluster: bool,
}

impl HealthBoard {
    /// A board for `cores` cores of a cluster member (`cluster`) or a single node.
    pub fn new(cores: usize, cluster: bool) -> HealthBoard {
        HealthBoard {
            cores: Mutex::new(vec![None; cores]),
            cluster,
        }
    }

    /// Core `core`'s figures now.
    pub fn publish(&self, core: usize, figures: Option<HealthFigures>) {
        if let Some(slot) = self.cores.lock().get_mut(core) {
            *slot = Some(figures);
        }
    }

    /// The answer to `/health` now: the lock port's rule over the figures published last.
    pub fn health(&self, shutting_down: bool) -> Health {
        if shutting_down || !self.cluster {
            return decide_figures(shutting_down, None);
        }
        let cores = self.cores.lock();
        let mut merged: Option<HealthFigures> = None;
        for published in cores.iter() {
            let Some(figures) = published else {
                return Health {
                    status: 503,
                    body: "starting\n".to_string(),
                };
            };
            let figures = figures.unwrap_or_default();
            merged = Some(merged.map_or(figures, |merged| merged.merge(figures)));
        }
        decide_figures(false, merged)
    }
}

/// The running health port.
pub struct HealthPort {
    addr: SocketAddr,
    stop: Arc<AtomicBool>,
    thread: JoinHandle<()>,
}

/// Binds `addr` for the health port (`server.health_listen ADDR: cause` when it cannot).
pub fn bind(addr: SocketAddr) -> io::Result<TcpListener> {
    TcpListener::bind(addr).map_err(|error| {
        let message = format!("server.health_listen {addr}: cannot listen: {error}");
        io::Error::new(error.kind(), message)
    })
}

impl HealthPort {
    /// Serves `listener` on a thread of its own (`latchkey-health`) until [`stop`](Self::stop).
    pub fn start(listener: TcpListener, shared: Arc<Shared>) -> io::Result<HealthPort> {
        let addr = listener.local_addr()?;
        let stop = Arc::new(AtomicBool::new(false));
        let stopping = Arc::clone(&stop);
        let thread = std::thread::Builder::new()
            .name("latchkey-health".into())
            .spawn(move || serve(&listener, &shared, &stopping))?;
        Ok(HealthPort { addr, stop, thread })
    }

    /// The address it listens on (the real port when 0 was configured).
    pub fn local_addr(&self) -> SocketAddr {
        self.addr
    }

    /// Stops the thread: a connection of our own wakes its `accept`.
    pub fn stop(self) {
        self.stop.store(true, Ordering::Release);
        let _ = TcpStream::connect_timeout(&reachable(self.addr), REQUEST_DEADLINE);
        let _ = self.thread.join();
    }
}

/// Where this process reaches a listener on `addr`: the loopback address of its family when it
/// listens on every interface.
fn reachable(addr: SocketAddr) -> SocketAddr {
    match addr.ip() {
        IpAddr::V4(ip) if ip.is_unspecified() => (Ipv4Addr::LOCALHOST, addr.port()).into(),
        IpAddr::V6(ip) if ip.is_unspecified() => (Ipv6Addr::LOCALHOST, addr.port()).into(),
        _ => addr,
    }
}

/// Accepts and answers connections one at a time until `stop`.
fn serve(listener: &TcpListener, shared: &Shared, stop: &AtomicBool) {
    // Bounded by the stop: every connection is answered within its deadline.
    loop {
        let accepted = listener.accept();
        if stop.load(Ordering::Acquire) {
            return;
        }
        match accepted {
            Ok((stream, _)) => answer(stream, shared),
            Err(error) if error.kind() == io::ErrorKind::Interrupted => {}
            Err(error) => {
                log::warn!("health port: accept failed: {error}");
                // A lasting failure (out of files) must not spin.
                std::thread::sleep(Duration::from_millis(100));
            }
        }
    }
}

/// Reads one request head from `stream` and answers it: `/health`, or a refusal.
fn answer(mut stream: TcpStream, shared: &Shared) {
    let deadline = Instant::now() + REQUEST_DEADLINE;
    let (head, answer) = match read_head(&mut stream, deadline) {
        Ok(head) => {
            let answer = respond(&head, shared);
            (head, answer)
        }
        Err(refusal) => (Vec::new(), http::refusal_response(refusal)),
    };
    let answer = match http::is_head_only(&head) {
        true => http::without_body(answer),
        false => answer,
    };
    let left = deadline.saturating_duration_since(Instant::now());
    let _ = stream.set_write_timeout(Some(left.max(Duration::from_millis(1))));
    let _ = stream.write_all(&answer);
}

/// The answer to a whole request head.
fn respond(head: &[u8], shared: &Shared) -> Vec<u8> {
    const ONLY_HEALTH: Refusal = Refusal {
        status: 404,
        reason: "this port serves only /health (the other pages are on the lock port)",
    };
    match http::parse_head(head) {
        Head::Complete(Ok(Route::Health)) => {
            let board = shared.health.as_ref().expect("a health port has a board");
            let health = board.health(shared.shutdown.load(Ordering::Acquire));
            let text = "text/plain; charset=utf-8";
            http::response(health.status, text, health.body.as_bytes())
        }
        Head::Complete(Ok(_)) => http::refusal_response(ONLY_HEALTH),
        Head::Complete(Err(refusal)) => http::refusal_response(refusal),
        Head::NotHttp | Head::Prefix | Head::Incomplete => http::refusal_response(Refusal {
            status: 400,
            reason: "not an HTTP GET or HEAD request",
        }),
    }
}

/// The request head, read until its blank line (or until it cannot be a request head); a
/// refusal when it does not come whole in time or is too large.
fn read_head(stream: &mut TcpStream, deadline: Instant) -> Result<Vec<u8>, Refusal> {
    let mut head = Vec::new();
    let mut chunk = [0u8; 1024];
    // Bounded: every pass reads at least a byte, and the head at most HEAD_BYTES_MAX + 1.
    loop {
        match http::parse_head(&head) {
            Head::Incomplete | Head::Prefix => {}
            Head::NotHttp if head.is_empty() => {}
            _ => return Ok(head),
        }
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() || stream.set_read_timeout(Some(left)).is_err() {
            return Err(Refusal::TIMEOUT);
        }
        match stream.read(&mut chunk) {
            Ok(0) => return Ok(head),
            Ok(read) => head.extend_from_slice(&chunk[..read]),
            Err(error) if error.kind() == io::ErrorKind::Interrupted => {}
            Err(_) => return Err(Refusal::TIMEOUT),
        }
        if head.len() > http::HEAD_BYTES_MAX {
            return Err(Refusal::TOO_LARGE);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn figures(shards: usize, leaderless: usize, quorum: bool) -> Option<HealthFigures> {
        let reachable = if quorum { 3 } else { 1 };
        Some(HealthFigures {
            shards,
            leaderless,
            quorum: Some((reachable, 3, quorum)),
        })
    }

    #[test]
    fn a_board_answers_as_the_lock_port_does_once_every_core_published() {
        let single = HealthBoard::new(2, false);
        assert_eq!(single.health(false).status, 200, "a single node serves");
        assert_eq!(single.health(true).body, "shutting down\n");
        let member = HealthBoard::new(2, true);
        assert_eq!(member.health(false).body, "starting\n");
        member.publish(0, figures(32, 0, true));
        assert_eq!(
            member.health(false).body,
            "starting\n",
            "core 1 has not yet"
        );
        member.publish(1, figures(32, 0, true));
        assert_eq!(member.health(false).status, 200);
        member.publish(1, figures(32, 4, false));
        let why = "no quorum: 1 of 3 members reachable; 4 of 64 shards without a leader";
        assert_eq!(member.health(false).body, format!("{why}\n"));
        assert_eq!(member.health(false).status, 503);
    }

    #[test]
    fn the_port_is_reached_on_loopback_when_it_listens_everywhere() {
        let any: SocketAddr = "0.0.0.0:7421".parse().unwrap();
        assert_eq!(reachable(any), "127.0.0.1:7421".parse().unwrap());
        let any6: SocketAddr = "[::]:7421".parse().unwrap();
        assert_eq!(reachable(any6), "[::1]:7421".parse().unwrap());
        let one: SocketAddr = "10.0.0.5:7421".parse().unwrap();
        assert_eq!(reachable(one), one);
    }
}
