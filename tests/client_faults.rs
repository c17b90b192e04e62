//! Fault injection: the client behind a TCP fault proxy, in front of the real server.
//!
//! Each test proves one rule of docs/protocol.md §4 from the outside: what the proxy saw the
//! client send (Acquire and Cancel frames per owner, connections) and what the server shows
//! afterwards (through a second client that does not go through the proxy).

use std::thread;
use std::time::{Duration, Instant};

use common::proxy::Proxy;
use common::{assert_between, client, start_server};
use latchkey::server::ServerHandle;
use latchkey_client::{AcquireError, Client};

const LATE: Duration = Duration::from_millis(1500);
const LEASE: Duration = Duration::from_secs(30);

fn ms(millis: u64) -> Duration {
    Duration::from_millis(millis)
}

/// The server under the proxy.
struct Upstream {
    server: ServerHandle,
}

impl Upstream {
    fn start() -> Upstream {
        Upstream {
            server: start_server(|_| {}),
        }
    }

    fn addr(&self) -> std::net::SocketAddr {
        self.server.local_addr()
    }

    /// A client that talks to the server directly, to observe it.
    fn observer(&self) -> Client {
        client(&[self.addr()], 1, Duration::from_secs(2))
    }
}

/// Polls `key` until it is free; returns how long that took, or `None` after `within`.
fn freed_within(observer: &Client, key: &str, within: Duration) -> Option<Duration> {
    let start = Instant::now();
    while start.elapsed() < within {
        if !observer.query(key).unwrap().held {
            return Some(start.elapsed());
        }
        thread::sleep(ms(10));
    }
    None
}

#[test]
fn a_session_refused_before_its_handshake_pong_gets_only_the_ping() {
    // A full server's X 7 comes before anything is read: the handshake ping is all the
    // refused session carries; the acquire goes out once, on the next session, with the
    // call's deadline (at most 1.7 s left).
    let upstream = Upstream::start();
    let proxy = Proxy::start(upstream.addr());
    proxy.refuse_next(1, ms(800));
    let client = client(&[proxy.addr()], 1, Duration::from_secs(2));
    let ticket = client.acquire("retry", ms(2500), LEASE).unwrap();
    let frames = proxy.acquire_frames();
    assert_eq!(
        frames.len(),
        1,
        "never sent to the refused session: {frames:?}"
    );
    assert_eq!(frames[0].1, 2, "same deadline: at most 1.7 s were left");
    assert_eq!(proxy.connections(), 2);
    assert_eq!(proxy.pings(), 2, "one handshake per session");
    assert!(upstream.observer().query("retry").unwrap().held);
    drop(ticket);
}

#[test]
fn unsent_retry_on_another_session_keeps_owner_and_deadline() {
    // The first session is established (its handshake answered) and then refused with X 7:
    // what was written to it counts as not sent (§4.3) and goes out again, same owner, same
    // deadline.
    let upstream = Upstream::start();
    let proxy = Proxy::start(upstream.addr());
    proxy.refuse_next_after_pong(1, ms(800));
    let client = client(&[proxy.addr()], 1, Duration::from_secs(2));
    let ticket = client.acquire("retry", ms(2500), LEASE).unwrap();
    let frames = proxy.acquire_frames();
    assert_eq!(
        frames.len(),
        2,
        "sent to the refused session, then once more: {frames:?}"
    );
    assert_eq!(frames[0].0, frames[1].0, "same owner");
    assert_eq!(frames[0].1, 3, "2.5 s rounds up to 3");
    assert_eq!(frames[1].1, 2, "same deadline: at most 1.7 s were left");
    assert_eq!(proxy.connections(), 2);
    assert!(upstream.observer().query("retry").unwrap().held);
    drop(ticket);
}

/// Bytes of a resuming client's handshake: an Identify (27), then the ping (10).
const HELLO: usize = 27 + 10;

/// A client that does not resume calls (docs/protocol.md §5): the rules of §4 alone, as with a
/// server that does not know the extension.
fn client_without_resume(addr: std::net::SocketAddr, sessions: usize, timeout: Duration) -> Client {
    let config = latchkey_client::ClientConfig {
        addrs: vec![addr],
        sessions,
        connect_timeout: Duration::from_secs(2),
        transport_timeout: timeout,
        resume: None,
        ..latchkey_client::ClientConfig::default()
    };
    Client::with_config(config).expect("client")
}

#[test]
fn without_resuming_a_cut_after_a_partial_frame_is_indeterminate_and_never_resent() {
    let upstream = Upstream::start();
    let proxy = Proxy::start(upstream.addr());
    // The 10-byte handshake ping, then 5 bytes of the acquire.
    proxy.cut_after(10 + 5);
    let client = client_without_resume(proxy.addr(), 2, Duration::from_secs(1));
    let result = client.acquire("cut", ms(1000), LEASE);
    assert_eq!(result.unwrap_err(), AcquireError::Indeterminate);
    thread::sleep(ms(300));
    let acquires = proxy.acquires();
    assert_eq!(acquires.len(), 1);
    assert_eq!(
        acquires.values().copied().collect::<Vec<_>>(),
        vec![1],
        "zero resends"
    );
    assert!(
        !upstream.observer().query("cut").unwrap().held,
        "half a frame grants nothing"
    );
}

#[test]
fn without_resuming_a_cut_after_the_whole_frame_is_indeterminate_and_the_lease_recovers_it() {
    let upstream = Upstream::start();
    let proxy = Proxy::start(upstream.addr());
    proxy.cut_after(10 + 12 + "cut-whole".len());
    let client = client_without_resume(proxy.addr(), 1, Duration::from_secs(1));
    let result = client.acquire("cut-whole", ms(1000), Duration::from_secs(1));
    assert_eq!(result.unwrap_err(), AcquireError::Indeterminate);
    assert_eq!(
        proxy.acquires().values().copied().collect::<Vec<_>>(),
        vec![1]
    );
    let observer = upstream.observer();
    assert!(freed_within(&observer, "cut-whole", Duration::from_secs(1) + LATE).is_some());
}

#[test]
fn a_cut_after_a_partial_frame_is_resolved_never_seen_and_acquired_anew() {
    let upstream = Upstream::start();
    let proxy = Proxy::start(upstream.addr());
    // The handshake, then 5 bytes of the acquire: the server executes nothing.
    proxy.cut_next(HELLO + 5);
    let client = client(&[proxy.addr()], 2, Duration::from_secs(1));
    let ticket = client
        .acquire("cut", ms(2000), LEASE)
        .expect("acquired anew");
    let acquires = proxy.acquires();
    // The half-sent acquire was asked about ("never seen", so never to be executed) and never
    // sent again: the one whole acquire the proxy saw is a new one, on the second session.
    // (The proxy counts a frame it parsed whole even if it forwarded only its first bytes.)
    assert!(acquires.values().all(|&count| count == 1), "{acquires:?}");
    assert!((1..=2).contains(&acquires.len()), "{acquires:?}");
    let observer = upstream.observer();
    assert!(observer.query("cut").unwrap().held);
    drop(ticket);
    assert!(
        freed_within(&observer, "cut", LATE).is_some(),
        "no ghost hold"
    );
}

#[test]
fn a_cut_after_the_whole_frame_is_resolved_to_the_grant_it_made() {
    let upstream = Upstream::start();
    let proxy = Proxy::start(upstream.addr());
    proxy.cut_next(HELLO + 12 + "cut-whole".len());
    let client = client(&[proxy.addr()], 1, Duration::from_secs(1));
    let ticket = client
        .acquire("cut-whole", ms(2000), Duration::from_secs(30))
        .expect("the grant is found");
    // Sent once; its grant, made while the answer could not reach the client, is the ticket's.
    assert_eq!(
        proxy.acquires().values().copied().collect::<Vec<_>>(),
        vec![1]
    );
    assert!(ticket.valid_until() > Instant::now() + Duration::from_secs(20));
    let observer = upstream.observer();
    assert!(observer.query("cut-whole").unwrap().held);
    assert_eq!(
        ticket.release().expect("released"),
        latchkey_client::ReleaseOutcome::Released
    );
    assert!(!observer.query("cut-whole").unwrap().held, "no ghost hold");
}

#[test]
fn a_grant_held_past_the_deadline_is_indeterminate_and_released_promptly() {
    let upstream = Upstream::start();
    let proxy = Proxy::start(upstream.addr());
    let client = client(&[proxy.addr()], 1, Duration::from_secs(3));
    // The session is up (its handshake pong passed) before the server's bytes are held.
    client.ping().unwrap();
    proxy.hold();
    let acquiring = {
        let client = client.clone();
        thread::spawn(move || client.acquire("held", ms(600), LEASE))
    };
    // The A stays in the proxy past the deadline; the Cancel goes through and does nothing.
    thread::sleep(ms(1200));
    let observer = upstream.observer();
    assert!(
        observer.query("held").unwrap().held,
        "the server granted at once"
    );
    proxy.release();
    assert_eq!(
        acquiring.join().unwrap().unwrap_err(),
        AcquireError::Indeterminate
    );
    let freed = freed_within(&observer, "held", LATE).expect("released well before the lease");
    assert!(freed < LATE);
    assert_eq!(proxy.acquires().len(), 1);
}

#[test]
fn a_deadline_while_queued_cancels_to_timeout_and_the_session_stays_open() {
    let upstream = Upstream::start();
    let observer = upstream.observer();
    let holder = observer.acquire("queued", ms(100), LEASE).unwrap();
    let proxy = Proxy::start(upstream.addr());
    let client = client(&[proxy.addr()], 1, Duration::from_secs(2));
    let start = Instant::now();
    let result = client.acquire("queued", ms(1100), LEASE);
    assert_eq!(result.unwrap_err(), AcquireError::Timeout);
    // The wire wait was 2 s: a Timeout at 1.1 s is the Cancel's doing.
    assert_between(start.elapsed(), ms(1100), ms(1100) + LATE);
    let cancels = proxy.cancels();
    assert_eq!(cancels.len(), 1);
    assert_eq!(
        cancels.keys().collect::<Vec<_>>(),
        proxy.acquires().keys().collect::<Vec<_>>()
    );
    assert_eq!(
        observer.query("queued").unwrap().waiters,
        0,
        "nothing left queued"
    );
    client.ping().unwrap();
    assert_eq!(proxy.connections(), 1, "the session stayed open");
    drop(holder);
}

#[test]
fn a_late_timeout_is_a_timeout() {
    let upstream = Upstream::start();
    let observer = upstream.observer();
    let holder = observer.acquire("late", ms(100), LEASE).unwrap();
    let proxy = Proxy::start(upstream.addr());
    let client = client(&[proxy.addr()], 1, Duration::from_secs(3));
    client.ping().unwrap();
    proxy.hold();
    let acquiring = {
        let client = client.clone();
        thread::spawn(move || {
            let start = Instant::now();
            (client.acquire("late", ms(500), LEASE), start.elapsed())
        })
    };
    thread::sleep(ms(1500));
    proxy.release();
    let (result, elapsed) = acquiring.join().unwrap();
    assert_eq!(result.unwrap_err(), AcquireError::Timeout);
    assert!(elapsed >= ms(1400), "the T came late: {elapsed:?}");
    drop(holder);
}

#[test]
fn a_server_refusing_every_session_is_unavailable_and_nothing_was_executed() {
    let upstream = Upstream::start();
    let proxy = Proxy::start(upstream.addr());
    proxy.refuse_next(usize::MAX, ms(50));
    let client = client(&[proxy.addr()], 2, Duration::from_secs(1));
    let start = Instant::now();
    let result = client.acquire("refused", ms(800), LEASE);
    assert_eq!(result.unwrap_err(), AcquireError::Unavailable);
    assert_between(start.elapsed(), ms(800), ms(800) + LATE);
    // X 7 comes before the handshake pong on every session: the acquire was never sent.
    let acquires = proxy.acquires();
    assert!(acquires.is_empty(), "never sent: {acquires:?}");
}

#[test]
fn many_threads_through_a_slow_proxy_each_send_once_and_get_one_result() {
    const THREADS: usize = 6;
    const CALLS: usize = 25;
    let upstream = Upstream::start();
    let proxy = Proxy::start(upstream.addr());
    proxy.delay_up(ms(1));
    proxy.delay_down(ms(1));
    let client = client(&[proxy.addr()], 2, Duration::from_secs(2));
    let workers: Vec<_> = (0..THREADS)
        .map(|worker| {
            let client = client.clone();
            thread::spawn(move || {
                let mut results = 0;
                for call in 0..CALLS {
                    let key = format!("m{}", (worker * 7 + call) % 5);
                    match client.acquire(&key, ms(200), LEASE) {
                        Ok(ticket) => drop(ticket.release().unwrap()),
                        Err(AcquireError::Timeout) => {}
                        Err(other) => panic!("unexpected {other:?}"),
                    }
                    results += 1;
                }
                results
            })
        })
        .collect();
    let results: usize = workers.into_iter().map(|w| w.join().unwrap()).sum();
    assert_eq!(results, THREADS * CALLS);
    let acquires = proxy.acquires();
    assert_eq!(acquires.len(), THREADS * CALLS);
    assert!(acquires.values().all(|&count| count == 1));
}

#[test]
fn a_waiter_whose_session_is_cut_keeps_its_place_and_is_granted_on_the_next() {
    let upstream = Upstream::start();
    let observer = upstream.observer();
    let holder = observer.acquire("cut-queued", ms(100), LEASE).unwrap();
    let proxy = Proxy::start(upstream.addr());
    // The whole acquire goes up and queues; the session dies before anything comes back.
    proxy.cut_next(HELLO + 12 + "cut-queued".len());
    let client = client(&[proxy.addr()], 1, Duration::from_secs(1));
    let acquiring = {
        let client = client.clone();
        thread::spawn(move || client.acquire("cut-queued", ms(5000), LEASE))
    };
    // Its place is kept: the queue still has it while the client resolves it elsewhere.
    thread::sleep(ms(600));
    assert_eq!(observer.query("cut-queued").unwrap().waiters, 1);
    drop(holder);
    let ticket = acquiring
        .join()
        .unwrap()
        .expect("granted on the next session");
    assert_eq!(
        proxy.acquires().values().copied().collect::<Vec<_>>(),
        vec![1]
    );
    assert!(observer.query("cut-queued").unwrap().held);
    drop(ticket);
    assert!(freed_within(&observer, "cut-queued", LATE).is_some());
}

#[test]
fn a_timeout_lost_with_its_session_is_still_a_timeout() {
    let upstream = Upstream::start();
    let observer = upstream.observer();
    let holder = observer.acquire("cut-timeout", ms(100), LEASE).unwrap();
    let proxy = Proxy::start(upstream.addr());
    proxy.cut_next(HELLO + 12 + "cut-timeout".len());
    let client = client(&[proxy.addr()], 1, Duration::from_secs(1));
    // A wait-0 acquire on a held key: its `T` is lost with the session, and the Resolve says
    // so. Nothing is sent again (a wait-0 acquire is one attempt).
    let result = client.acquire("cut-timeout", Duration::ZERO, LEASE);
    assert_eq!(result.unwrap_err(), AcquireError::Timeout);
    assert_eq!(
        proxy.acquires().values().copied().collect::<Vec<_>>(),
        vec![1]
    );
    drop(holder);
}
