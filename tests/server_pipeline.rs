//! Pipelining against the real server: thousands of mixed frames over many keys of both
//! partitions in one write, every answer correlated exactly once and in order per key; several
//! sessions at once, on their own keys and contending for the same keys.

use common::server::{fresh_id, keys_on_partition, start, Conn, Expect, Script};
use latchkey_client::protocol::{Request, Response};
use std::collections::{HashMap, HashSet};
use std::net::SocketAddr;
use std::thread;
use std::time::Duration;

const CORES: usize = 2;
const LONG_S: u8 = 60;

/// `count` keys, half on each partition, interleaved.
fn keys(prefix: &str, count: usize) -> Vec<String> {
    let per_partition: Vec<Vec<String>> = (0..CORES)
        .map(|partition| keys_on_partition(prefix, partition, CORES, count / CORES))
        .collect();
    (0..count / CORES)
        .flat_map(|i| per_partition.iter().map(move |keys| keys[i].clone()))
        .collect()
}

fn exact(response: Response) -> Expect {
    Expect::Exact(response)
}

fn state(nonce: u64, held: bool, waiters: u32) -> Expect {
    Expect::State {
        nonce,
        held,
        waiters,
    }
}

/// Runs three pipelined phases over `keys` on one session (each phase one write, its answers
/// checked per key) and returns the number of frames sent.
///
/// 1. grant, query, a `T` for wait 0, a queued acquire, `N` for a foreign token (Extend and
///    Release), a Cancel of an owner not queued, a query, a ping;
/// 2. release (`R` before the `A` it causes for the queued acquire of the same session), query,
///    queue and cancel (`T`), a `T` for wait 0;
/// 3. release of the handed-off token, query (free), a new grant with a larger token.
fn three_phases(addr: SocketAddr, keys: &[String]) -> usize {
    let mut conn = Conn::connect(addr);
    let (mut frames, one) = phase_one(&mut conn, keys);
    let (two_frames, handoffs) = phase_two(&mut conn, keys, &one);
    frames += two_frames;
    frames += phase_three(&mut conn, keys, &one, &handoffs);
    conn.expect_silence(Duration::from_millis(50));
    frames
}

/// What phase 1 leaves for the others, per key in order: the owner granted at once and the
/// owner queued behind it; and the tokens granted, per owner.
struct PhaseOne {
    first: Vec<u64>,
    queued: Vec<u64>,
    grants: HashMap<u64, u64>,
}

/// Phase 1 of [`three_phases`]; returns the frames sent and what the next phases need.
fn phase_one(conn: &mut Conn, keys: &[String]) -> (usize, PhaseOne) {
    let mut frames = 0;
    let mut script = Script::default();
    let mut first = Vec::new();
    let mut queued = Vec::new();
    for (stream, key) in keys.iter().enumerate() {
        let k = key.as_bytes();
        let ids: [u64; 9] = std::array::from_fn(|_| fresh_id());
        let requests = [
            acquire(0, ids[0], k),
            Request::Query {
                nonce: ids[1],
                key: k,
            },
            acquire(0, ids[2], k),
            acquire(LONG_S, ids[3], k),
            Request::Extend {
                lease_s: LONG_S,
                token: ids[4],
                key: k,
            },
            Request::Release {
                token: ids[5],
                key: k,
            },
            Request::Cancel {
                owner: ids[6],
                key: k,
            },
            Request::Query {
                nonce: ids[7],
                key: k,
            },
            Request::Ping { nonce: ids[8] },
        ];
        frames += requests.len();
        for request in requests {
            script.request(request);
        }
        script.expect(stream, Expect::Granted(ids[0]));
        script.expect(stream, state(ids[1], true, 0));
        script.expect(stream, exact(Response::Timeout { owner: ids[2] }));
        script.expect(stream, exact(Response::NotHeld { token: ids[4] }));
        script.expect(stream, exact(Response::NotHeld { token: ids[5] }));
        script.expect(stream, state(ids[7], true, 1));
        script.expect_any_order(Response::Pong { nonce: ids[8] });
        first.push(ids[0]);
        queued.push(ids[3]);
    }
    conn.send_raw(&script.bytes);
    let grants = script.check(conn);
    let one = PhaseOne {
        first,
        queued,
        grants,
    };
    (frames, one)
}

/// Phase 2 of [`three_phases`]; returns the frames sent and the tokens of the handoffs.
fn phase_two(conn: &mut Conn, keys: &[String], one: &PhaseOne) -> (usize, HashMap<u64, u64>) {
    let mut frames = 0;
    let mut script = Script::default();
    for (stream, key) in keys.iter().enumerate() {
        let k = key.as_bytes();
        let token = one.grants[&one.first[stream]];
        let ids: [u64; 3] = std::array::from_fn(|_| fresh_id());
        let requests = [
            Request::Release { token, key: k },
            Request::Query {
                nonce: ids[0],
                key: k,
            },
            acquire(LONG_S, ids[1], k),
            Request::Cancel {
                owner: ids[1],
                key: k,
            },
            acquire(0, ids[2], k),
        ];
        frames += requests.len();
        for request in requests {
            script.request(request);
        }
        script.expect(stream, exact(Response::Released { token }));
        script.expect(stream, Expect::Granted(one.queued[stream]));
        script.expect(stream, state(ids[0], true, 0));
        script.expect(stream, exact(Response::Timeout { owner: ids[1] }));
        script.expect(stream, exact(Response::Timeout { owner: ids[2] }));
    }
    conn.send_raw(&script.bytes);
    (frames, script.check(conn))
}

/// Phase 3 of [`three_phases`]; returns the frames sent.
fn phase_three(
    conn: &mut Conn,
    keys: &[String],
    one: &PhaseOne,
    handoffs: &HashMap<u64, u64>,
) -> usize {
    let mut frames = 0;
    let mut script = Script::default();
    let mut last = Vec::new();
    for (stream, key) in keys.iter().enumerate() {
        let k = key.as_bytes();
        let token = handoffs[&one.queued[stream]];
        assert!(
            token > one.grants[&one.first[stream]],
            "handoff token not larger"
        );
        let ids: [u64; 2] = std::array::from_fn(|_| fresh_id());
        let requests = [
            Request::Release { token, key: k },
            Request::Query {
                nonce: ids[0],
                key: k,
            },
            acquire(0, ids[1], k),
        ];
        frames += requests.len();
        for request in requests {
            script.request(request);
        }
        script.expect(stream, exact(Response::Released { token }));
        script.expect(stream, state(ids[0], false, 0));
        script.expect(stream, Expect::Granted(ids[1]));
        last.push((ids[1], token));
    }
    conn.send_raw(&script.bytes);
    let regrants = script.check(conn);
    for (owner, previous) in last {
        assert!(
            regrants[&owner] > previous,
            "a new grant's token not larger"
        );
    }
    frames
}

fn acquire(wait_s: u8, owner: u64, key: &[u8]) -> Request<'_> {
    Request::Acquire {
        wait_s,
        lease_s: LONG_S,
        owner,
        key,
    }
}

#[test]
fn thousands_of_pipelined_frames_are_each_answered_once_in_order_per_key() {
    let server = start(CORES);
    // 560 keys × 9 frames: the first write alone is 5,040 frames.
    let frames = three_phases(server.local_addr(), &keys("pipeline", 560));
    assert!(frames > 9_000, "{frames}");
    assert!(!server.failed());
}

#[test]
fn several_sessions_pipeline_at_once_on_their_own_keys() {
    let server = start(CORES);
    let addr = server.local_addr();
    thread::scope(|scope| {
        let sessions: Vec<_> = (0..4)
            .map(|session| {
                let keys = keys(&format!("session{session}"), 200);
                scope.spawn(move || three_phases(addr, &keys))
            })
            .collect();
        for session in sessions {
            session.join().expect("session");
        }
    });
    assert!(!server.failed());
}

/// One contending session: queue an acquire for every key at once, release each grant as soon
/// as it is read, until every acquire was granted and every release answered. Returns the
/// tokens granted, per key.
fn contend(addr: SocketAddr, keys: &[String]) -> HashMap<String, u64> {
    let mut conn = Conn::connect(addr);
    let mut key_of = HashMap::new();
    let mut bytes = Vec::new();
    for key in keys {
        let owner = fresh_id();
        key_of.insert(owner, key.clone());
        Request::Acquire {
            wait_s: 30,
            lease_s: 30,
            owner,
            key: key.as_bytes(),
        }
        .encode(&mut bytes);
    }
    conn.send_raw(&bytes);
    let mut granted = HashMap::new();
    let mut released = HashSet::new();
    while released.len() < keys.len() {
        match conn.recv() {
            Response::Acquired { owner, token } => {
                let key = key_of.remove(&owner).expect("one answer per acquire");
                conn.send(Request::Release {
                    token,
                    key: key.as_bytes(),
                });
                granted.insert(key, token);
            }
            Response::Released { token } => assert!(released.insert(token)),
            other => panic!("unexpected {other:?}"),
        }
    }
    assert!(key_of.is_empty());
    conn.expect_silence(Duration::from_millis(50));
    granted
}

#[test]
fn sessions_contending_for_the_same_keys_each_get_every_key_once() {
    let server = start(CORES);
    let addr = server.local_addr();
    let keys = keys("contended", 40);
    let results: Vec<HashMap<String, u64>> = thread::scope(|scope| {
        let sessions: Vec<_> = (0..4)
            .map(|_| scope.spawn(|| contend(addr, &keys)))
            .collect();
        sessions
            .into_iter()
            .map(|s| s.join().expect("session"))
            .collect()
    });
    for key in &keys {
        let tokens: HashSet<u64> = results.iter().map(|granted| granted[key]).collect();
        assert_eq!(tokens.len(), results.len(), "{key}: a token granted twice");
    }
    let mut observer = Conn::connect(addr);
    for key in &keys {
        assert!(!observer.state(key).held, "{key} left held");
    }
}
