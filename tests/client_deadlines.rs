//! The deadline rules of docs/protocol.md §4.2–§4.4 against a scripted server, each interleaving
//! forced by hand. Timing assertions are strict about "never early" and generous about late.

use std::net::SocketAddr;
use std::thread;
use std::time::{Duration, Instant};

use common::{assert_between, client, dead_addr, FakeServer, Frame, Got};
use latchkey_client::protocol::Response;
use latchkey_client::{AcquireError, Client, ClientConfig, Ticket};

/// Slack for "not too late" on a shared, noisy 2-core machine (never-early bounds stay strict).
const LATE: Duration = Duration::from_millis(3000);
const LEASE: Duration = Duration::from_secs(30);

fn ms(millis: u64) -> Duration {
    Duration::from_millis(millis)
}

type Acquired = (Result<Ticket, AcquireError>, Duration);

/// A client like `common::client` that tries refused connections again until the deadline
/// (`ClientConfig::retry_refused`): what these tests of §4.2's retries need.
fn retrying_client(addrs: &[SocketAddr], sessions: usize, transport_timeout: Duration) -> Client {
    let config = ClientConfig {
        addrs: addrs.to_vec(),
        sessions,
        connect_timeout: Duration::from_secs(2),
        transport_timeout,
        retry_refused: true,
        ..ClientConfig::default()
    };
    Client::with_config(config).expect("client")
}

fn acquire_in_background(client: &Client, wait: Duration) -> thread::JoinHandle<Acquired> {
    let client = client.clone();
    thread::spawn(move || {
        let start = Instant::now();
        let result = client.acquire("k", wait, LEASE);
        (result, start.elapsed())
    })
}

#[test]
fn x7_counts_as_unsent_and_the_retry_keeps_owner_and_deadline() {
    let refusing = FakeServer::start();
    let answering = FakeServer::start();
    FakeServer::one_cluster(&[&refusing, &answering]);
    let client = client(
        &[refusing.addr(), answering.addr()],
        1,
        Duration::from_secs(2),
    );
    let start = Instant::now();
    let call = acquire_in_background(&client, ms(2500));
    let mut first = refusing.accept();
    let (owner, wait_s, _, _) = first.acquire();
    assert_eq!(wait_s, 3, "2.5 s rounds up to 3");
    thread::sleep(ms(1200));
    first.refuse();
    let mut second = answering.accept();
    let (retry_owner, retry_wait_s, _, key) = second.acquire();
    assert_eq!(retry_owner, owner, "the retry keeps the owner");
    assert_eq!(
        retry_wait_s, 2,
        "the retry keeps the deadline: at most 1.3 s were left"
    );
    // The deadline is still 2.5 s after the call began: the Cancel comes then, not later.
    assert_eq!(second.frame(), Frame::Cancel { owner, key });
    assert_between(start.elapsed(), ms(2500), ms(2500) + LATE);
    second.send(Response::Timeout { owner });
    let (result, _) = call.join().unwrap();
    assert_eq!(result.unwrap_err(), AcquireError::Timeout);
}

#[test]
fn a_failed_connect_is_retried_on_another_session_within_the_same_deadline() {
    let server = FakeServer::start();
    let client = client(&[dead_addr(), server.addr()], 1, Duration::from_secs(2));
    let call = acquire_in_background(&client, ms(1500));
    let mut conn = server.accept();
    let (owner, wait_s, lease_s, key) = conn.acquire();
    assert_eq!((wait_s, lease_s, key.as_str()), (2, 30, "k"));
    conn.send(Response::Acquired { owner, token: 7 });
    let (result, elapsed) = call.join().unwrap();
    assert_eq!(result.unwrap().token(), 7);
    assert!(elapsed < ms(1500));
}

#[test]
fn an_unsent_request_keeps_trying_new_sessions_until_a_server_appears() {
    let addr = dead_addr();
    let client = retrying_client(&[addr], 1, Duration::from_secs(2));
    let start = Instant::now();
    let call = acquire_in_background(&client, ms(3000));
    thread::sleep(ms(1000));
    let server = FakeServer::start_on(addr);
    let appeared = Instant::now();
    let mut conn = server.accept();
    let (owner, wait_s, _, _) = conn.acquire();
    // Backoff is at most 250 ms: the request comes soon after the server does.
    assert!(appeared.elapsed() < ms(250) + LATE);
    let left = ms(3000).saturating_sub(start.elapsed());
    assert!(
        u64::from(wait_s) <= left.as_secs() + 1,
        "the deadline was kept"
    );
    assert!(wait_s <= 2);
    conn.send(Response::Acquired { owner, token: 3 });
    assert_eq!(call.join().unwrap().0.unwrap().token(), 3);
}

#[test]
fn a_request_still_unsent_on_a_live_session_at_its_deadline_is_a_timeout_and_never_sent() {
    // Background releases of many 1000-byte keys fill the socket while the server stops
    // reading, so the acquire behind them is never handed to the socket. The server's receive
    // buffer is small; the client's send buffer grows at most to tcp_wmem's maximum.
    let wmem_max: usize = std::fs::read_to_string("/proc/sys/net/ipv4/tcp_wmem")
        .ok()
        .and_then(|text| text.split_whitespace().nth(2)?.parse().ok())
        .unwrap_or(4 << 20);
    let tickets_count = (wmem_max / 1000) * 5 / 4 + 500;
    let key = |i: usize| format!("{i:0>1000}");
    let server = FakeServer::start_small_buffer();
    let config = ClientConfig {
        addrs: vec![server.addr()],
        sessions: 1,
        session_calls_max: 2 * tickets_count,
        // The releases stay unanswered: a silence limit (the connect timeout) shorter than
        // the test would stall the session and hand the acquire back unsent (Unavailable).
        // This test is about a session that is up and merely full.
        connect_timeout: Duration::from_secs(30),
        ..ClientConfig::default()
    };
    let client = Client::with_config(config).unwrap();
    let granting = thread::spawn(move || {
        let mut conn = server.accept();
        for token in 1..=tickets_count as u64 {
            let (owner, _, _, _) = conn.acquire();
            conn.send(Response::Acquired { owner, token });
        }
        conn
    });
    let tickets: Vec<_> = (0..tickets_count)
        .map(|i| client.acquire(&key(i), ms(2000), LEASE).unwrap())
        .collect();
    let mut conn = granting.join().unwrap();
    drop(tickets);
    thread::sleep(ms(300));
    let start = Instant::now();
    let result = client.acquire("behind", ms(1000), LEASE);
    assert_eq!(
        result.unwrap_err(),
        AcquireError::Timeout,
        "not sent: definitive"
    );
    assert_between(start.elapsed(), ms(1000), ms(1000) + LATE);
    let mut releases = 0;
    while let Got::Frame(frame) = conn.read_frame(ms(1000)) {
        match frame {
            Frame::Release { .. } => releases += 1,
            other => panic!("only the releases were ever sent, not {other:?}"),
        }
    }
    assert_eq!(releases, tickets_count);
}

#[test]
fn a_deadline_while_queued_cancels_and_the_session_stays_open() {
    let server = FakeServer::start();
    let client = client(&[server.addr()], 1, Duration::from_secs(2));
    let mut conn = server.accept();
    let start = Instant::now();
    let call = acquire_in_background(&client, ms(1200));
    let (owner, wait_s, _, key) = conn.acquire();
    assert_eq!(wait_s, 2, "the wire wait is rounded up");
    assert_eq!(
        conn.frame(),
        Frame::Cancel { owner, key },
        "same session, key and owner"
    );
    assert_between(start.elapsed(), ms(1200), ms(1200) + LATE);
    conn.send(Response::Timeout { owner });
    let (result, elapsed) = call.join().unwrap();
    assert_eq!(result.unwrap_err(), AcquireError::Timeout);
    assert_between(elapsed, ms(1200), ms(1200) + LATE);
    // The session is still the one in use.
    let pinger = client.clone();
    let ping = thread::spawn(move || pinger.ping());
    let Frame::Ping { nonce } = conn.frame() else {
        panic!("expected a ping")
    };
    conn.send(Response::Pong { nonce });
    assert!(ping.join().unwrap().is_ok());
    assert!(server.try_accept(ms(100)).is_none(), "no new connection");
}

#[test]
fn a_timeout_found_after_the_deadline_is_still_a_timeout() {
    let server = FakeServer::start();
    let client = client(&[server.addr()], 1, Duration::from_secs(3));
    let mut conn = server.accept();
    let call = acquire_in_background(&client, ms(500));
    let (owner, _, _, _) = conn.acquire();
    assert!(matches!(conn.frame(), Frame::Cancel { .. }));
    thread::sleep(ms(800));
    conn.send(Response::Timeout { owner });
    let (result, elapsed) = call.join().unwrap();
    assert_eq!(result.unwrap_err(), AcquireError::Timeout);
    assert!(elapsed >= ms(1300));
}

#[test]
fn busy_found_after_the_deadline_is_still_busy() {
    let server = FakeServer::start();
    let client = client(&[server.addr()], 1, Duration::from_secs(3));
    let mut conn = server.accept();
    let call = acquire_in_background(&client, ms(300));
    let (owner, _, _, _) = conn.acquire();
    assert!(matches!(conn.frame(), Frame::Cancel { .. }));
    conn.send(Response::Busy { owner });
    assert_eq!(call.join().unwrap().0.unwrap_err(), AcquireError::Busy);
}

#[test]
fn a_grant_after_the_cancel_is_released_at_once_and_indeterminate() {
    let server = FakeServer::start();
    let client = client(&[server.addr()], 1, Duration::from_secs(3));
    let mut conn = server.accept();
    let call = acquire_in_background(&client, ms(300));
    let (owner, _, _, key) = conn.acquire();
    assert_eq!(
        conn.frame(),
        Frame::Cancel {
            owner,
            key: key.clone()
        }
    );
    conn.send(Response::Acquired { owner, token: 91 });
    assert_eq!(
        call.join().unwrap().0.unwrap_err(),
        AcquireError::Indeterminate
    );
    assert_eq!(
        conn.frame(),
        Frame::Release { token: 91, key },
        "that exact token"
    );
}

#[test]
fn no_answer_to_the_cancel_closes_that_session_and_is_indeterminate() {
    let server = FakeServer::start();
    let transport = Duration::from_secs(1);
    let client = client(&[server.addr()], 1, transport);
    let mut conn = server.accept();
    let call = acquire_in_background(&client, ms(300));
    conn.acquire();
    assert!(matches!(conn.frame(), Frame::Cancel { .. }));
    assert_eq!(
        conn.expect_eof(common::PATIENCE),
        vec![],
        "closed, nothing resent"
    );
    let (result, elapsed) = call.join().unwrap();
    assert_eq!(result.unwrap_err(), AcquireError::Indeterminate);
    assert_between(elapsed, ms(300) + transport, ms(300) + transport + LATE);
}

#[test]
fn wait_zero_is_one_attempt_with_its_own_transport_deadline_and_no_cancel() {
    let server = FakeServer::start();
    let transport = Duration::from_secs(1);
    let client = client(&[server.addr()], 1, transport);
    let mut conn = server.accept();
    let call = acquire_in_background(&client, Duration::ZERO);
    let (_, wait_s, _, _) = conn.acquire();
    assert_eq!(wait_s, 0, "a single immediate attempt on the wire");
    assert_eq!(
        conn.expect_eof(common::PATIENCE),
        vec![],
        "no Cancel, no resend"
    );
    let (result, elapsed) = call.join().unwrap();
    assert_eq!(result.unwrap_err(), AcquireError::Indeterminate);
    assert_between(elapsed, transport, transport + LATE);
    if let Some(mut next) = server.try_accept(ms(300)) {
        assert_eq!(
            next.read_frame(ms(300)),
            Got::Quiet,
            "never resent after a possible send"
        );
    }
}

#[test]
fn wait_zero_answered_in_time_is_acquired() {
    let server = FakeServer::start();
    let client = client(&[server.addr()], 1, Duration::from_secs(1));
    let mut conn = server.accept();
    let call = acquire_in_background(&client, Duration::ZERO);
    let (owner, _, _, _) = conn.acquire();
    thread::sleep(ms(400));
    conn.send(Response::Acquired { owner, token: 5 });
    assert_eq!(call.join().unwrap().0.unwrap().token(), 5);
}

#[test]
fn wait_zero_unsent_moves_to_another_session_with_the_same_owner() {
    let refusing = FakeServer::start();
    let answering = FakeServer::start();
    FakeServer::one_cluster(&[&refusing, &answering]);
    let client = client(
        &[refusing.addr(), answering.addr()],
        1,
        Duration::from_secs(2),
    );
    let call = acquire_in_background(&client, Duration::ZERO);
    let mut first = refusing.accept();
    let (owner, _, _, _) = first.acquire();
    first.refuse();
    let mut second = answering.accept();
    let (retry_owner, wait_s, _, _) = second.acquire();
    assert_eq!((retry_owner, wait_s), (owner, 0));
    second.send(Response::Timeout { owner });
    assert_eq!(call.join().unwrap().0.unwrap_err(), AcquireError::Timeout);
}

#[test]
fn a_session_failing_after_the_send_is_indeterminate_and_never_resent() {
    let server = FakeServer::start();
    let client = client(&[server.addr()], 2, Duration::from_secs(2));
    let mut conns = [server.accept(), server.accept()];
    let call = acquire_in_background(&client, ms(2000));
    // The request went to one of the two sessions; that one dies without answering.
    let index = loop {
        if let Some(i) = (0..2).find(|&i| matches!(conns[i].read_frame(ms(20)), Got::Frame(_))) {
            break i;
        }
    };
    let [first, second] = conns;
    let (mut other, failing) = if index == 0 {
        (second, first)
    } else {
        (first, second)
    };
    failing.close();
    let (result, _) = call.join().unwrap();
    assert_eq!(result.unwrap_err(), AcquireError::Indeterminate);
    assert_eq!(
        other.read_frame(ms(300)),
        Got::Quiet,
        "not resent on the other session"
    );
}

#[test]
fn the_server_down_is_unavailable_at_the_deadline() {
    let client = retrying_client(&[dead_addr()], 2, Duration::from_secs(1));
    let start = Instant::now();
    let result = client.acquire("k", ms(600), LEASE);
    assert_eq!(result.unwrap_err(), AcquireError::Unavailable);
    assert_between(start.elapsed(), ms(600), ms(600) + LATE);
    assert_eq!(
        client.ping().unwrap_err(),
        latchkey_client::RequestError::Unavailable
    );
}
