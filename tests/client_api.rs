//! The client's API surface: acquire, ticket (token, validity bound, extend, release, drop),
//! query, ping, correlation of pipelined calls from many threads.

use std::collections::HashSet;
use std::net::SocketAddr;
use std::sync::Arc;
use std::thread;
use std::time::{Duration, Instant};

use common::{client, start_server, FakeConn, FakeServer, Frame, Got, PATIENCE};
use latchkey_client::protocol::{ErrorCode, Response};
use latchkey_client::{
    AcquireError, Client, ClientConfig, ExtendOutcome, ReleaseOutcome, RequestError, Ticket,
};

fn ms(millis: u64) -> Duration {
    Duration::from_millis(millis)
}

fn wait_until_free(client: &Client, key: &str, within: Duration) -> bool {
    let until = Instant::now() + within;
    while Instant::now() < until {
        if !client.query(key).unwrap().held {
            return true;
        }
        thread::sleep(ms(10));
    }
    false
}

#[test]
fn acquire_query_extend_release() {
    let server = start_server(|_| {});
    let client = client(&[server.local_addr()], 2, Duration::from_secs(2));
    assert!(client.ping().unwrap() < PATIENCE);
    let before = Instant::now();
    let ticket = client
        .acquire("jobs/a", ms(500), Duration::from_secs(10))
        .unwrap();
    let after = Instant::now();
    assert_eq!(ticket.key(), "jobs/a");
    assert!(ticket.token() > 0);
    // Bound: (instant the A was read) + lease - max(100 ms, lease / 10); never later.
    let margin = Duration::from_secs(1);
    assert!(ticket.valid_until() <= after + Duration::from_secs(10) - margin);
    assert!(ticket.valid_until() >= before + Duration::from_secs(10) - margin);
    assert!(ticket.is_valid());
    let state = client.query("jobs/a").unwrap();
    assert!(state.held);
    assert!(state.lease_left <= Duration::from_secs(10));
    assert_eq!(state.waiters, 0);

    thread::sleep(ms(300));
    let before = Instant::now();
    assert_eq!(
        ticket.extend(Duration::from_secs(20)).unwrap(),
        ExtendOutcome::Extended
    );
    let after = Instant::now();
    let margin = Duration::from_secs(2);
    assert!(ticket.valid_until() >= before + Duration::from_secs(20) - margin);
    assert!(ticket.valid_until() <= after + Duration::from_secs(20) - margin);

    assert_eq!(ticket.release().unwrap(), ReleaseOutcome::Released);
    assert!(!client.query("jobs/a").unwrap().held);
}

#[test]
fn a_held_key_times_out_a_full_queue_is_busy_and_a_release_grants_the_waiter() {
    let server = start_server(|config| config.limits.max_waiters_per_key = 1);
    let client = client(&[server.local_addr()], 2, Duration::from_secs(2));
    let ticket = client
        .acquire("k", ms(100), Duration::from_secs(10))
        .unwrap();
    assert_eq!(
        client.acquire("k", Duration::ZERO, ms(1)).unwrap_err(),
        AcquireError::Timeout
    );
    assert_eq!(
        client.acquire("k", ms(200), ms(1)).unwrap_err(),
        AcquireError::Timeout
    );

    let waiter = client.clone();
    let waiting = thread::spawn(move || waiter.acquire("k", Duration::from_secs(5), ms(1)));
    thread::sleep(ms(200));
    assert_eq!(client.query("k").unwrap().waiters, 1);
    assert_eq!(
        client.acquire("k", ms(100), ms(1)).unwrap_err(),
        AcquireError::Busy
    );
    let first_token = ticket.token();
    assert_eq!(ticket.release().unwrap(), ReleaseOutcome::Released);
    let second = waiting.join().unwrap().unwrap();
    assert!(second.token() > first_token, "fencing tokens grow per key");
}

#[test]
fn a_server_shutting_down_answers_its_waiters_busy() {
    let server = start_server(|_| {});
    let client = client(&[server.local_addr()], 1, Duration::from_secs(2));
    let _holder = client
        .acquire("k", ms(100), Duration::from_secs(30))
        .unwrap();
    let waiter = client.clone();
    let waiting = thread::spawn(move || waiter.acquire("k", Duration::from_secs(5), ms(1)));
    thread::sleep(ms(200));
    server.shutdown();
    assert_eq!(waiting.join().unwrap().unwrap_err(), AcquireError::Busy);
}

#[test]
fn a_request_the_server_refuses_is_rejected_with_its_code() {
    let server = start_server(|config| config.limits.max_key_bytes = 8);
    let client = client(&[server.local_addr()], 1, Duration::from_secs(2));
    let result = client.acquire("123456789", ms(100), ms(1));
    assert_eq!(
        result.unwrap_err(),
        AcquireError::Rejected(ErrorCode::KeyTooLong)
    );
    let again = client.acquire("12345678", ms(100), ms(1));
    assert!(again.is_ok(), "a new session is used: {again:?}");
}

/// docs/protocol.md §2.3: `X` 2 closes the session. The client retires that session before the
/// caller sees `Rejected`, so a call made right after it goes to a new session. Even rounds:
/// the server closes right after the `X`, as the real one does. Odd rounds: it keeps the
/// connection open until the client closes it, so a call wrongly written to the dying session
/// would be seen here rather than lost in a race with the server's close.
#[test]
fn code_8_is_rejected_8_and_the_session_goes_on() {
    // docs/protocol.md §5: X code 8 (forbidden) is Rejected(8); it does not close the session.
    let server = FakeServer::start();
    let client = client(&[server.addr()], 1, Duration::from_secs(2));
    let script = thread::spawn(move || {
        let mut conn = server.accept();
        let (owner, _, _, _) = conn.acquire();
        conn.send(Response::Error {
            code: ErrorCode::Forbidden,
            id: owner,
        });
        let Frame::Ping { nonce } = conn.frame() else {
            panic!("a ping on the same session")
        };
        conn.send(Response::Pong { nonce });
        server
    });
    let result = client.acquire("billing/invoices", ms(1000), ms(1000));
    assert_eq!(
        result.unwrap_err(),
        AcquireError::Rejected(ErrorCode::Forbidden)
    );
    assert!(client.ping().is_ok(), "the same session answers");
    let _server = script.join().unwrap();
}

#[test]
fn a_closing_rejection_retires_its_session_before_the_caller_sees_it() {
    for round in 0..50 {
        let server = FakeServer::start();
        let client = client(&[server.addr()], 1, Duration::from_secs(2));
        let script = thread::spawn(move || {
            let mut first = server.accept();
            let (owner, _, _, key) = first.acquire();
            first.send(Response::Error {
                code: ErrorCode::KeyTooLong,
                id: owner,
            });
            if round % 2 == 0 {
                first.close();
            } else {
                let written = first.expect_eof(PATIENCE);
                assert_eq!(written, [], "round {round}: written after the X");
            }
            let mut second = server.accept();
            let (owner, _, _, retried_key) = second.acquire();
            second.send(Response::Acquired { owner, token: 77 });
            (key, retried_key, second)
        });
        let result = client.acquire("123456789", ms(2000), ms(1000));
        assert_eq!(
            result.unwrap_err(),
            AcquireError::Rejected(ErrorCode::KeyTooLong),
            "round {round}"
        );
        let again = client.acquire("12345678", ms(2000), ms(1000));
        let (key, retried_key, _second) = script
            .join()
            .unwrap_or_else(|_| panic!("round {round}: the fake server's script failed"));
        assert_eq!(key, "123456789");
        assert_eq!(retried_key, "12345678", "round {round}");
        let ticket = again.unwrap_or_else(|error| panic!("round {round}: {error:?}"));
        assert_eq!(ticket.token(), 77);
    }
}

#[test]
fn a_full_server_refuses_sessions_and_a_freed_slot_is_used_before_the_deadline() {
    let server = start_server(|config| config.limits.max_connections = 1);
    let first = client(&[server.local_addr()], 1, Duration::from_secs(2));
    first.ping().unwrap();
    let second = client(&[server.local_addr()], 1, Duration::from_secs(2));
    let start = Instant::now();
    let result = second.acquire("full", ms(500), ms(1000));
    assert_eq!(
        result.unwrap_err(),
        AcquireError::Unavailable,
        "X 7 means never sent"
    );
    assert!(start.elapsed() >= ms(500));
    let acquiring = thread::spawn(move || second.acquire("full", Duration::from_secs(5), ms(1000)));
    thread::sleep(ms(500));
    drop(first);
    assert!(
        acquiring.join().unwrap().is_ok(),
        "retried until a session was accepted"
    );
}

#[test]
fn a_release_after_the_lease_ran_out_is_not_held() {
    let server = start_server(|_| {});
    let client = client(&[server.local_addr()], 1, Duration::from_secs(2));
    let ticket = client.acquire("short", ms(100), ms(1)).unwrap();
    assert!(ticket.valid_until() <= Instant::now() + ms(900));
    thread::sleep(ms(1200));
    assert!(!ticket.is_valid());
    assert_eq!(ticket.extend(ms(1)).unwrap(), ExtendOutcome::NotHeld);
    assert_eq!(ticket.release().unwrap(), ReleaseOutcome::NotHeld);
}

#[test]
fn dropping_a_ticket_releases_it_in_the_background() {
    let server = start_server(|_| {});
    let client = client(&[server.local_addr()], 1, Duration::from_secs(2));
    let ticket = client
        .acquire("dropped", ms(100), Duration::from_secs(60))
        .unwrap();
    drop(ticket);
    assert!(wait_until_free(&client, "dropped", Duration::from_secs(2)));
}

#[test]
fn dropping_the_last_handle_still_sends_the_background_release() {
    let server = start_server(|_| {});
    let observer = client(&[server.local_addr()], 1, Duration::from_secs(2));
    for round in 0..5 {
        let key = format!("last-{round}");
        let client = client(&[server.local_addr()], 1, Duration::from_secs(2));
        let ticket = client
            .acquire(&key, ms(100), Duration::from_secs(60))
            .unwrap();
        drop(client);
        drop(ticket);
        assert!(
            wait_until_free(&observer, &key, Duration::from_secs(2)),
            "round {round}"
        );
    }
}

/// Has the client's next acquire of `key` granted on `conn` with `token`.
fn granted(client: &Client, conn: &mut FakeConn, key: &str, lease: Duration, token: u64) -> Ticket {
    let acquiring = {
        let (client, key) = (client.clone(), key.to_owned());
        thread::spawn(move || client.acquire(&key, ms(500), lease))
    };
    let (owner, _, _, _) = conn.acquire();
    conn.send(Response::Acquired { owner, token });
    acquiring.join().unwrap().unwrap()
}

fn extend_in_background(
    ticket: &Arc<Ticket>,
    lease: Duration,
) -> thread::JoinHandle<Result<ExtendOutcome, RequestError>> {
    let ticket = Arc::clone(ticket);
    thread::spawn(move || ticket.extend(lease))
}

/// A hold of `key` with `lease` and `token`, granted by a scripted server to a client with
/// one session.
struct ScriptedHold {
    server: FakeServer,
    conn: FakeConn,
    ticket: Arc<Ticket>,
}

impl ScriptedHold {
    fn start(key: &str, lease: Duration, token: u64) -> ScriptedHold {
        let server = FakeServer::start();
        let client = client(&[server.addr()], 1, Duration::from_secs(2));
        let mut conn = server.accept();
        let ticket = Arc::new(granted(&client, &mut conn, key, lease, token));
        ScriptedHold {
            server,
            conn,
            ticket,
        }
    }
}

/// Two holds the scripted server gave the same token (a real server never does) put two
/// requests naming one token on the wire at once; their answers go first in, first out.
#[test]
fn answers_naming_one_token_are_matched_first_in_first_out() {
    let server = FakeServer::start();
    let client = client(&[server.addr()], 1, Duration::from_secs(2));
    let mut conn = server.accept();
    let first = Arc::new(granted(
        &client,
        &mut conn,
        "fifo-1",
        Duration::from_secs(10),
        31,
    ));
    let second = Arc::new(granted(
        &client,
        &mut conn,
        "fifo-2",
        Duration::from_secs(10),
        31,
    ));
    let first = extend_in_background(&first, Duration::from_secs(10));
    assert!(matches!(conn.frame(), Frame::Extend { token: 31, .. }));
    let second = extend_in_background(&second, Duration::from_secs(10));
    assert!(matches!(conn.frame(), Frame::Extend { token: 31, .. }));
    conn.send(Response::Extended { token: 31 });
    conn.send(Response::NotHeld { token: 31 });
    assert_eq!(first.join().unwrap().unwrap(), ExtendOutcome::Extended);
    assert_eq!(second.join().unwrap().unwrap(), ExtendOutcome::NotHeld);
}

/// docs/protocol.md §4.5: an Extend sets the lease to now + its lease, which may be shorter than
/// what was left; the bound follows it, and already while the Extend is unanswered.
#[test]
fn a_shorter_extend_moves_the_bound_earlier_already_while_unanswered() {
    let ScriptedHold {
        server: _server,
        mut conn,
        ticket,
    } = ScriptedHold::start("short", Duration::from_secs(3), 41);
    assert!(ticket.valid_until() > Instant::now() + ms(2000));
    let before = Instant::now();
    let extending = extend_in_background(&ticket, ms(1000));
    assert!(matches!(
        conn.frame(),
        Frame::Extend {
            lease_s: 1,
            token: 41,
            ..
        }
    ));
    assert!(
        ticket.valid_until() <= Instant::now() + ms(900),
        "unanswered: the earlier of the old bound and what the Extend would give"
    );
    conn.send(Response::Extended { token: 41 });
    assert_eq!(extending.join().unwrap().unwrap(), ExtendOutcome::Extended);
    let after = Instant::now();
    // The Extend's send instant + 1 s - 100 ms.
    assert!(ticket.valid_until() >= before + ms(900));
    assert!(ticket.valid_until() <= after + ms(900));
}

/// An Extend whose outcome stays unknown may still execute later and set the lease to that
/// time + its lease: it keeps the earlier bound and caps every later confirmed Extend.
#[test]
fn an_extend_of_unknown_outcome_caps_every_later_confirmed_extend() {
    let ScriptedHold {
        server,
        mut conn,
        ticket,
    } = ScriptedHold::start("unknown", Duration::from_secs(10), 42);
    let extending = extend_in_background(&ticket, Duration::from_secs(2));
    assert!(matches!(conn.frame(), Frame::Extend { lease_s: 2, .. }));
    conn.close();
    // An extend is safe to send again, so the client tries other sessions within its
    // deadline: none of them gets through, and its outcome stays unknown.
    while !extending.is_finished() {
        server.refuse_for(ms(50));
    }
    assert_eq!(extending.join().unwrap(), Err(RequestError::NoAnswer));
    assert!(ticket.valid_until() <= Instant::now() + ms(1800));

    let before = Instant::now();
    let extending = extend_in_background(&ticket, Duration::from_secs(20));
    let mut conn = server.accept();
    assert!(matches!(conn.frame(), Frame::Extend { lease_s: 20, .. }));
    conn.send(Response::Extended { token: 42 });
    assert_eq!(extending.join().unwrap().unwrap(), ExtendOutcome::Extended);
    let after = Instant::now();
    // Capped by the unknown 2 s Extend: its send instant + 2 s - 200 ms, not + 18 s.
    assert!(ticket.valid_until() >= before + ms(1800));
    assert!(ticket.valid_until() <= after + ms(1800));
}

#[test]
fn a_refused_extend_leaves_the_bound_as_it_was() {
    let ScriptedHold {
        server: _server,
        mut conn,
        ticket,
    } = ScriptedHold::start("refused", Duration::from_secs(10), 43);
    let bound = ticket.valid_until();
    let extending = extend_in_background(&ticket, Duration::from_secs(1));
    assert!(matches!(conn.frame(), Frame::Extend { lease_s: 1, .. }));
    assert!(ticket.valid_until() < bound, "lowered while unanswered");
    conn.send(Response::Error {
        code: ErrorCode::LeaseZero,
        id: 43,
    });
    let refused = extending.join().unwrap();
    assert_eq!(refused, Err(RequestError::Rejected(ErrorCode::LeaseZero)));
    assert_eq!(
        ticket.valid_until(),
        bound,
        "a refused request had no effect"
    );
}

#[test]
fn extends_of_one_ticket_from_two_threads_are_serialized() {
    let ScriptedHold {
        server: _server,
        mut conn,
        ticket,
    } = ScriptedHold::start("serial", Duration::from_secs(10), 44);
    let first = extend_in_background(&ticket, Duration::from_secs(5));
    assert!(matches!(conn.frame(), Frame::Extend { lease_s: 5, .. }));
    let second = extend_in_background(&ticket, Duration::from_secs(6));
    assert_eq!(
        conn.read_frame(ms(300)),
        Got::Quiet,
        "the second Extend waits for the first one's outcome"
    );
    conn.send(Response::Extended { token: 44 });
    assert!(matches!(conn.frame(), Frame::Extend { lease_s: 6, .. }));
    conn.send(Response::Extended { token: 44 });
    assert_eq!(first.join().unwrap().unwrap(), ExtendOutcome::Extended);
    assert_eq!(second.join().unwrap().unwrap(), ExtendOutcome::Extended);
}

#[test]
fn many_threads_pipelining_get_exactly_one_result_each() {
    const THREADS: usize = 8;
    const CALLS: usize = 40;
    let server = start_server(|_| {});
    let client = client(&[server.local_addr()], 3, Duration::from_secs(2));
    let workers: Vec<_> = (0..THREADS)
        .map(|worker| {
            let client = client.clone();
            thread::spawn(move || {
                let mut tokens = Vec::new();
                let mut timeouts = 0;
                for call in 0..CALLS {
                    let key = format!("k{}", (worker + call) % 4);
                    let wait = ms((call % 3) as u64 * 50);
                    match client.acquire(&key, wait, Duration::from_secs(5)) {
                        Ok(ticket) => {
                            assert_eq!(ticket.key(), key);
                            tokens.push(ticket.token());
                            assert_eq!(ticket.release().unwrap(), ReleaseOutcome::Released);
                        }
                        Err(AcquireError::Timeout) => timeouts += 1,
                        Err(other) => panic!("unexpected {other:?}"),
                    }
                }
                (tokens, timeouts)
            })
        })
        .collect();
    let mut tokens = HashSet::new();
    let mut results = 0;
    for worker in workers {
        let (granted, timeouts) = worker.join().unwrap();
        results += granted.len() + timeouts;
        for token in granted {
            assert!(tokens.insert(token), "token {token} delivered twice");
        }
    }
    assert_eq!(results, THREADS * CALLS);
    assert!(!tokens.is_empty());
}

#[test]
fn the_client_remembers_why_its_last_session_failed() {
    let dead = common::dead_addr();
    let client = client(&[dead], 1, Duration::from_secs(2));
    assert_eq!(
        client.acquire("k", ms(300), ms(1000)).unwrap_err(),
        AcquireError::Unavailable
    );
    let failure = client
        .last_session_failure()
        .expect("a failure was recorded");
    assert_eq!(failure.addr(), dead);
    assert!(!failure.connected());
    assert_eq!(
        failure.to_string(),
        format!("{dead}: cannot connect: connection refused")
    );

    // Something that answers, but not in latchkey frames (here: like Redis).
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap();
    let serving = thread::spawn(move || {
        use std::io::{Read, Write};
        let (mut stream, _) = listener.accept().unwrap();
        let mut chunk = [0u8; 64];
        let _ = stream.read(&mut chunk);
        let _ = stream.write_all(b"-ERR unknown command\r\n");
        thread::sleep(ms(500));
    });
    // The handshake ping met it: the ping call itself was never sent, and the session never
    // counted as connected.
    let client = common::client(&[addr], 1, Duration::from_secs(2));
    assert_eq!(client.ping(), Err(RequestError::Unavailable));
    let failure = client
        .last_session_failure()
        .expect("a failure was recorded");
    assert!(!failure.connected());
    assert!(
        failure.cause().starts_with("not a latchkey server"),
        "{failure}"
    );
    serving.join().unwrap();
}

/// A client of `addrs` that retries refused connections or not.
fn client_retrying(addrs: &[SocketAddr], retry_refused: bool) -> Client {
    let config = ClientConfig {
        addrs: addrs.to_vec(),
        sessions: 1,
        retry_refused,
        ..ClientConfig::default()
    };
    Client::with_config(config).unwrap()
}

#[test]
fn a_refused_connection_ends_the_call_at_once_unless_it_is_retried() {
    let dead = common::dead_addr();
    let wait = Duration::from_secs(60);
    let client = client_retrying(&[dead], false);
    let start = Instant::now();
    let result = client.acquire("k", wait, ms(1000));
    assert_eq!(result.unwrap_err(), AcquireError::Unavailable);
    assert_eq!(client.query("k"), Err(RequestError::Unavailable));
    assert_eq!(client.ping(), Err(RequestError::Unavailable));
    assert!(
        start.elapsed() < Duration::from_secs(30),
        "at once: {:?}",
        start.elapsed()
    );
    let failure = client.last_session_failure().expect("a failure");
    assert!(failure.refused() && !failure.connected(), "{failure}");
    assert!(client.last_unavailable().unwrap().all_refused());

    // Retried: the whole wait (never early).
    let client = client_retrying(&[dead], true);
    let start = Instant::now();
    let result = client.acquire("k", ms(600), ms(1000));
    assert_eq!(result.unwrap_err(), AcquireError::Unavailable);
    assert!(start.elapsed() >= ms(600), "{:?}", start.elapsed());
    assert!(!client.last_unavailable().unwrap().all_refused());

    // One member refusing among several is not the end: the next one serves.
    let server = start_server(|_| {});
    let client = client_retrying(&[dead, server.local_addr()], false);
    let ticket = client.acquire("k", wait, ms(1000)).unwrap();
    ticket.release().unwrap();
}
