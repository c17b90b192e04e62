//! Resumable calls on a real single node, over real sockets (docs/protocol.md §5): a session
//! identifies, its acquires outlive it — queued, granted or answered — and a later session of
//! the same client resolves them to a definite outcome; a client that never comes back leaves
//! no ghost hold once its grace ends.

use common::server::{start, wait_until, Conn};
use latchkey_client::protocol::{ErrorCode, Fate, Request, Response};
use std::time::Duration;

const CLIENT: u128 = 0x5eed_0000_0000_0000_0000_0000_0000_0001;

/// A session identified as `client` with a grace of `grace_s`.
fn identified(addr: std::net::SocketAddr, client: u128, grace_s: u8) -> Conn {
    let mut conn = Conn::connect(addr);
    conn.send(Request::Identify {
        grace_s,
        client,
        nonce: 1,
    });
    assert_eq!(conn.recv(), Response::Identified { nonce: 1, grace_s });
    conn
}

fn resolve(conn: &mut Conn, key: &str, owner: u64) -> Response {
    let key = key.as_bytes();
    conn.send(Request::Resolve { owner, key });
    conn.recv()
}

#[test]
fn identify_is_the_first_request_of_a_session_and_resolve_needs_it() {
    let server = start(2);
    let mut conn = Conn::connect(server.local_addr());
    conn.send(Request::Resolve {
        owner: 3,
        key: b"k",
    });
    let refused = Response::Error {
        code: ErrorCode::NotIdentified,
        id: 3,
    };
    assert_eq!(conn.recv(), refused);
    conn.send(Request::Identify {
        grace_s: 5,
        client: CLIENT,
        nonce: 4,
    });
    let not_first = Response::Error {
        code: ErrorCode::NotIdentified,
        id: 4,
    };
    assert_eq!(conn.recv(), not_first, "not the first request");
    for (grace_s, client) in [(0, CLIENT), (61, CLIENT), (5, 0)] {
        let mut fresh = Conn::connect(server.local_addr());
        fresh.send(Request::Identify {
            grace_s,
            client,
            nonce: 5,
        });
        let refused = Response::Error {
            code: ErrorCode::NotIdentified,
            id: 5,
        };
        assert_eq!(fresh.recv(), refused, "grace {grace_s}, client {client}");
        // The session goes on, not identified.
        assert!(matches!(fresh.ping(6), Response::Pong { nonce: 6 }));
    }
    server.shutdown();
    server.join().expect("a clean stop");
}

#[test]
fn a_cut_session_ends_in_a_definite_outcome_on_the_next_one() {
    let server = start(2);
    let addr = server.local_addr();
    let mut holder = Conn::connect(addr);
    let token = holder.acquire_ok("resume/queued", 30, 1);
    // A waiter, a grant and a timeout, then the session is cut: whatever it read of them, the
    // client resolves them on its next session. (The test reads the two prompt answers first,
    // only to know the server executed all three before the cut.)
    let mut first = identified(addr, CLIENT, 10);
    first.send_acquire("resume/queued", 30, 30, 2);
    first.send_acquire("resume/granted", 0, 30, 3);
    first.send_acquire("resume/queued", 0, 30, 4);
    let mut prompt = first.recv_n(2);
    prompt.sort_by_key(Response::correlation_id);
    assert!(
        matches!(prompt[0], Response::Acquired { owner: 3, .. }),
        "{prompt:?}"
    );
    assert_eq!(prompt[1], Response::Timeout { owner: 4 });
    drop(first);
    let mut second = identified(addr, CLIENT, 10);
    let Response::Resolved {
        fate: Fate::Granted,
        token: granted,
        lease_ms,
        ..
    } = resolve(&mut second, "resume/granted", 3)
    else {
        panic!("the grant is found");
    };
    assert!(lease_ms <= 30_000 && lease_ms > 20_000, "{lease_ms}");
    let timed_out = resolve(&mut second, "resume/queued", 4);
    assert!(
        matches!(
            timed_out,
            Response::Resolved {
                fate: Fate::TimedOut,
                ..
            }
        ),
        "{timed_out:?}"
    );
    let queued = resolve(&mut second, "resume/queued", 2);
    assert!(
        matches!(
            queued,
            Response::Resolved {
                fate: Fate::Queued,
                ..
            }
        ),
        "{queued:?}"
    );
    // The waiter is the second session's now: the holder's release grants it there.
    assert_eq!(
        holder.release("resume/queued", token),
        Response::Released { token }
    );
    let next = second.recv_granted(2);
    assert!(next > token);
    // Nothing is left held by nobody.
    assert_eq!(
        second.release("resume/granted", granted),
        Response::Released { token: granted }
    );
    assert_eq!(
        second.release("resume/queued", next),
        Response::Released { token: next }
    );
    assert!(!holder.state("resume/granted").held && !holder.state("resume/queued").held);
    server.shutdown();
    server.join().expect("a clean stop");
}

#[test]
fn never_seen_is_final_and_a_client_that_never_comes_back_leaves_no_ghost_hold() {
    let server = start(1);
    let addr = server.local_addr();
    let mut holder = Conn::connect(addr);
    let token = holder.acquire_ok("ghost/key", 30, 1);
    let mut first = identified(addr, CLIENT + 1, 1);
    first.send_acquire("ghost/key", 30, 30, 2);
    assert!(
        holder.state("ghost/key").waiters == 1
            || wait_until(Duration::from_secs(5), || {
                holder.state("ghost/key").waiters == 1
            })
    );
    drop(first);
    // Its owner 5 was never sent: "never seen", and should it come after all, not executed.
    let mut second = identified(addr, CLIENT + 1, 1);
    let never = resolve(&mut second, "ghost/other", 5);
    assert!(
        matches!(
            never,
            Response::Resolved {
                fate: Fate::NeverSeen,
                ..
            }
        ),
        "{never:?}"
    );
    assert_eq!(
        second.acquire("ghost/other", 0, 30, 5),
        Response::Busy { owner: 5 }
    );
    drop(second);
    assert!(wait_until(Duration::from_secs(10), || server.connections() == 1));
    // The holder leaves while the client is away: its waiter is granted, to nobody yet.
    assert_eq!(
        holder.release("ghost/key", token),
        Response::Released { token }
    );
    assert!(holder.state("ghost/key").held);
    // Its grace (1 s) ends without a session: the grant it never got is released.
    assert!(wait_until(Duration::from_secs(10), || !holder
        .state("ghost/key")
        .held));
    server.shutdown();
    server.join().expect("a clean stop");
}
