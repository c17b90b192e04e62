//! docs/protocol.md §3 capacity rules against the real server: `max_waiters_per_key`, `max_keys`
//! (per partition), `max_pending_per_session`, `max_connections`, shutdown, and a slow reader.

use common::server::{
    encode_all, fresh_id, keys_on_partition, start, start_with, test_config, wait_until, Conn,
    KeyState, ANSWER_TIMEOUT,
};
use latchkey_client::protocol::{ErrorCode, Request, Response};
use std::collections::HashMap;
use std::io::{Read, Write};
use std::net::{Shutdown, SocketAddr};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::thread;
use std::time::{Duration, Instant};

const CORES: usize = 2;
const LONG_S: u8 = 60;

fn keys(prefix: &str) -> Vec<String> {
    (0..CORES)
        .map(|partition| keys_on_partition(prefix, partition, CORES, 1).remove(0))
        .collect()
}

#[test]
fn a_full_queue_answers_busy_to_wait_and_timeout_to_wait_zero() {
    let mut config = test_config(CORES);
    config.limits.max_waiters_per_key = 2;
    let server = start_with(config);
    let addr = server.local_addr();
    for key in keys("full-queue") {
        let mut holder = Conn::connect(addr);
        let mut queue = Conn::connect(addr);
        let mut late = Conn::connect(addr);
        holder.acquire_ok(&key, LONG_S, fresh_id());
        let first = fresh_id();
        queue.send_acquire(&key, LONG_S, LONG_S, first);
        queue.send_acquire(&key, LONG_S, LONG_S, fresh_id());
        assert_eq!(queue.state(&key).waiters, 2);
        let owner = fresh_id();
        assert_eq!(
            late.acquire(&key, LONG_S, LONG_S, owner),
            Response::Busy { owner }
        );
        assert_eq!(
            late.acquire(&key, 0, LONG_S, owner),
            Response::Timeout { owner }
        );
        // B is definitive: nothing was queued. A freed place is usable again.
        assert_eq!(late.state(&key).waiters, 2);
        queue.cancel(&key, first);
        assert_eq!(queue.recv(), Response::Timeout { owner: first });
        late.send_acquire(&key, LONG_S, LONG_S, owner);
        assert_eq!(late.state(&key).waiters, 2);
    }
}

#[test]
fn max_keys_is_enforced_per_partition_and_existing_keys_keep_working() {
    let mut config = test_config(CORES);
    config.limits.max_keys = 2 * CORES; // two key entries per partition
    let server = start_with(config);
    let mut conn = Conn::connect(server.local_addr());
    let mut waiter = Conn::connect(server.local_addr());
    let mut tokens = HashMap::new();
    let per_partition: Vec<Vec<String>> = (0..CORES)
        .map(|partition| keys_on_partition("max-keys", partition, CORES, 3))
        .collect();
    for keys in &per_partition {
        for key in &keys[..2] {
            tokens.insert(key.clone(), conn.acquire_ok(key, LONG_S, fresh_id()));
        }
    }
    for keys in &per_partition {
        let (existing, new) = (&keys[0], &keys[2]);
        // A new key is refused, whether the acquire would wait or not.
        for wait_s in [0, 5] {
            let owner = fresh_id();
            assert_eq!(
                conn.acquire(new, wait_s, 5, owner),
                Response::Busy { owner }
            );
        }
        assert_eq!(conn.state(new), KeyState::FREE);
        // An existing key answers as always: T for wait 0, a place in the queue for wait > 0.
        let owner = fresh_id();
        assert_eq!(
            conn.acquire(existing, 0, 5, owner),
            Response::Timeout { owner }
        );
        let queued = fresh_id();
        waiter.send_acquire(existing, LONG_S, LONG_S, queued);
        assert_eq!(waiter.state(existing).waiters, 1);
        let token = tokens[existing];
        assert_eq!(conn.release(existing, token), Response::Released { token });
        waiter.recv_granted(queued);
        // Freeing an entry makes room for a new key.
        let other = &keys[1];
        let token = tokens[other];
        assert_eq!(conn.release(other, token), Response::Released { token });
        conn.acquire_ok(new, LONG_S, fresh_id());
    }
}

#[test]
fn max_pending_per_session_answers_busy_beyond_and_spares_other_sessions() {
    let mut config = test_config(CORES);
    config.limits.max_pending_per_session = 2;
    let server = start_with(config);
    let addr = server.local_addr();
    let keys = keys("max-pending");
    let mut holder = Conn::connect(addr);
    for key in &keys {
        holder.acquire_ok(key, LONG_S, fresh_id());
    }
    let mut session = Conn::connect(addr);
    let mut other = Conn::connect(addr);
    // One queued acquire on each partition: the limit counts the session, not the partition.
    let queued: Vec<u64> = keys.iter().map(|_| fresh_id()).collect();
    for (key, &owner) in keys.iter().zip(&queued) {
        session.send_acquire(key, LONG_S, LONG_S, owner);
        assert_eq!(session.state(key).waiters, 1);
    }
    for key in &keys {
        let owner = fresh_id();
        assert_eq!(
            session.acquire(key, LONG_S, LONG_S, owner),
            Response::Busy { owner }
        );
        // Wait 0 never queues, so the limit does not apply to it.
        assert_eq!(
            session.acquire(key, 0, LONG_S, owner),
            Response::Timeout { owner }
        );
        assert_eq!(session.state(key).waiters, 1);
        // Another session is not affected.
        other.send_acquire(key, LONG_S, LONG_S, fresh_id());
        assert_eq!(other.state(key).waiters, 2);
    }
    let free = &keys_on_partition("max-pending-free", 1, CORES, 1)[0];
    session.acquire_ok(free, LONG_S, fresh_id());
    // An answered acquire frees its place.
    session.cancel(&keys[0], queued[0]);
    assert_eq!(session.recv(), Response::Timeout { owner: queued[0] });
    let owner = fresh_id();
    session.send_acquire(&keys[1], LONG_S, LONG_S, owner);
    assert_eq!(session.state(&keys[1]).waiters, 3);
}

/// Reads the first answer of a fresh session that sent nothing: `X` 7 or silence.
fn refused(addr: SocketAddr) -> bool {
    let mut conn = Conn::connect(addr);
    match conn.recv_within(Duration::from_millis(300)) {
        None => false,
        Some(answer) => {
            let refusal = Response::Error {
                code: ErrorCode::SessionRefused,
                id: 0,
            };
            assert_eq!(answer, refusal);
            assert!(conn.recv_until_closed().is_empty());
            true
        }
    }
}

#[test]
fn past_max_connections_a_session_gets_code_7_and_is_closed() {
    let mut config = test_config(CORES);
    config.limits.max_connections = 3;
    let server = start_with(config);
    let addr = server.local_addr();
    let mut sessions: Vec<Conn> = (0..3).map(|_| Conn::connect(addr)).collect();
    for (nonce, session) in sessions.iter_mut().enumerate() {
        let nonce = nonce as u64 + 1;
        assert_eq!(session.ping(nonce), Response::Pong { nonce });
    }
    let mut extra = Conn::connect(addr);
    let refusal = Response::Error {
        code: ErrorCode::SessionRefused,
        id: 0,
    };
    assert_eq!(extra.recv_until_closed(), [refusal]);
    // The admitted sessions are unaffected.
    for session in &mut sessions {
        assert!(!session.state("still-here").held);
    }
    // A slot freed is reusable (the count drops once the server has processed the close).
    drop(sessions.pop());
    assert!(wait_until(Duration::from_secs(5), || server.connections() == 2));
    let mut again = Conn::connect(addr);
    assert_eq!(again.ping(9), Response::Pong { nonce: 9 });
    assert!(refused(addr), "the limit holds again");
}

#[test]
fn shutdown_answers_every_queued_waiter_busy() {
    let server = start(CORES);
    let addr = server.local_addr();
    let keys = keys("shutdown-waiters");
    let mut holder = Conn::connect(addr);
    for key in &keys {
        holder.acquire_ok(key, LONG_S, fresh_id());
    }
    let mut waiters: Vec<(Conn, Vec<u64>)> =
        (0..2).map(|_| (Conn::connect(addr), Vec::new())).collect();
    for (conn, owners) in &mut waiters {
        for key in &keys {
            let owner = fresh_id();
            conn.send_acquire(key, LONG_S, LONG_S, owner);
            owners.push(owner);
            assert!(conn.state(key).waiters >= 1);
        }
    }
    let before = Instant::now();
    server.shutdown();
    for (conn, owners) in &mut waiters {
        let mut busy: Vec<Response> = conn.recv_n(owners.len());
        busy.sort_by_key(Response::correlation_id);
        let expected: Vec<Response> = owners
            .iter()
            .map(|&owner| Response::Busy { owner })
            .collect();
        assert_eq!(busy, expected);
    }
    assert!(wait_until(Duration::from_secs(5), || server.is_finished()));
    assert!(before.elapsed() < Duration::from_secs(5));
    server.join().expect("clean stop");
}

/// A session that pipelines pings from a writer thread and does not read: once its writes stop
/// making progress, the server has paused it with unsent answers (so it is not quiescent).
struct SlowReader {
    conn: Conn,
    written: Arc<AtomicUsize>,
    writer: thread::JoinHandle<()>,
}

impl SlowReader {
    fn start(addr: SocketAddr, frames: Vec<u8>) -> SlowReader {
        let conn = Conn::connect_small_buffer(addr);
        let mut stream = conn.stream.try_clone().unwrap();
        let written = Arc::new(AtomicUsize::new(0));
        let progress = Arc::clone(&written);
        let writer = thread::spawn(move || {
            for chunk in frames.chunks(4096) {
                if stream.write_all(chunk).is_err() {
                    return;
                }
                progress.fetch_add(chunk.len(), Ordering::Relaxed);
            }
        });
        SlowReader {
            conn,
            written,
            writer,
        }
    }

    /// Waits until the writer has made no progress for a while (or finished).
    fn wait_stalled(&self) -> bool {
        let mut last = usize::MAX;
        wait_until(Duration::from_secs(10), || {
            thread::sleep(Duration::from_millis(100));
            let now = self.written.load(Ordering::Relaxed);
            let stalled = now == last;
            last = now;
            stalled || self.writer.is_finished()
        })
    }
}

fn pings(count: u64) -> Vec<u8> {
    let requests: Vec<Request> = (1..=count).map(|nonce| Request::Ping { nonce }).collect();
    encode_all(&requests)
}

#[test]
fn during_shutdown_a_further_acquire_is_busy() {
    let server = start(CORES);
    let addr = server.local_addr();
    let keys = keys("shutdown-further");
    let mut holder = Conn::connect(addr);
    for key in &keys {
        holder.acquire_ok(key, LONG_S, fresh_id());
    }
    let mut late = Conn::connect(addr);
    // A slow reader with answers the server cannot flush keeps the server stopping (not
    // stopped) for up to its grace period: the window in which a further Acquire arrives.
    let slow = SlowReader::start(addr, pings(1_000_000));
    assert!(slow.wait_stalled());
    assert!(
        !slow.writer.is_finished(),
        "the server never paused the slow reader"
    );
    server.shutdown();
    assert!(wait_until(Duration::from_secs(2), || server.is_stopping()));
    thread::sleep(Duration::from_millis(50));
    for key in &keys {
        for wait_s in [0, 5] {
            let owner = fresh_id();
            assert_eq!(
                late.acquire(key, wait_s, 5, owner),
                Response::Busy { owner }
            );
        }
        let owner = fresh_id();
        let free = format!("{key}-free");
        assert_eq!(late.acquire(&free, 0, 5, owner), Response::Busy { owner });
    }
    assert!(!server.is_finished());
    // Reset the slow reader: its answers can then be dropped, and the server stops.
    slow.conn.stream.shutdown(Shutdown::Both).unwrap();
    let _ = slow.writer.join();
    drop(slow.conn);
    assert!(wait_until(Duration::from_secs(5), || server.is_finished()));
    server.join().expect("clean stop");
}

#[test]
fn a_slow_reader_is_not_disconnected_and_gets_every_answer() {
    let server = start(CORES);
    let addr = server.local_addr();
    let keys: Vec<String> = (0..CORES)
        .flat_map(|partition| keys_on_partition("slow", partition, CORES, 2))
        .collect();
    // About 7 MB of requests: more than the kernel buffers between the two ends take, so the
    // writer stalls and the server pauses the session over its output bound.
    let count = 700_000u64;
    let requests: Vec<Request> = (1..=count)
        .map(|id| match id % 4 {
            0 => Request::Query {
                nonce: id,
                key: keys[(id / 4) as usize % keys.len()].as_bytes(),
            },
            _ => Request::Ping { nonce: id },
        })
        .collect();
    let mut slow = SlowReader::start(addr, encode_all(&requests));
    assert!(slow.wait_stalled());
    thread::sleep(Duration::from_millis(300));
    // Now read everything. Queries of one key come back in the order sent.
    let mut seen = vec![false; count as usize + 1];
    let mut last_of_key: HashMap<usize, u64> = HashMap::new();
    let deadline = Instant::now() + ANSWER_TIMEOUT;
    for _ in 0..count {
        let answer = slow.conn.recv();
        let id = answer.correlation_id();
        assert!(!seen[id as usize], "answer {id} twice");
        seen[id as usize] = true;
        match answer {
            Response::Pong { .. } => assert_ne!(id % 4, 0),
            Response::State { held: false, .. } => {
                assert_eq!(id % 4, 0);
                let key = (id / 4) as usize % keys.len();
                let last = last_of_key.insert(key, id).unwrap_or(0);
                assert!(id > last, "answer {id} after {last} for one key");
            }
            other => panic!("unexpected {other:?}"),
        }
        assert!(Instant::now() < deadline, "answers too slow");
    }
    slow.writer.join().unwrap();
    assert_eq!(slow.conn.ping(0), Response::Pong { nonce: 0 });
    let mut rest = [0u8; 1];
    slow.conn
        .stream
        .set_read_timeout(Some(Duration::from_millis(50)))
        .unwrap();
    assert!(
        slow.conn.stream.read(&mut rest).is_err(),
        "nothing more, still open"
    );
}

/// docs/protocol.md §3: `B` for "an Acquire with wait>0 that would enqueue while its session
/// already has `max_pending_per_session` queued acquires": acquires granted at once, even pipelined
/// to other cores, never count.
#[test]
fn acquires_granted_at_once_do_not_count_as_queued() {
    let mut config = test_config(CORES);
    config.limits.max_pending_per_session = 2;
    let server = start_with(config);
    let addr = server.local_addr();
    let held = keys("pending-held");
    let mut holder = Conn::connect(addr);
    for key in &held {
        holder.acquire_ok(key, LONG_S, fresh_id());
    }
    // Four acquires with wait > 0 of free keys (two on each partition) are granted at once;
    // then one acquire queues on a held key. The session never has more than one queued.
    let free: Vec<String> = (0..CORES)
        .flat_map(|partition| keys_on_partition("pending-free", partition, CORES, 2))
        .collect();
    let mut requests: Vec<Request> = free
        .iter()
        .map(|key| Request::Acquire {
            wait_s: 5,
            lease_s: LONG_S,
            owner: fresh_id(),
            key: key.as_bytes(),
        })
        .collect();
    let queued = fresh_id();
    requests.push(Request::Acquire {
        wait_s: 5,
        lease_s: LONG_S,
        owner: queued,
        key: held[0].as_bytes(),
    });
    let mut session = Conn::connect(addr);
    session.send_raw(&encode_all(&requests));
    let answers = session.recv_n(free.len());
    for answer in &answers {
        assert!(matches!(answer, Response::Acquired { .. }), "{answers:?}");
    }
    let seen = session.state(&held[0]);
    assert_eq!(
        seen.waiters,
        1,
        "the acquire was refused: {:?}",
        session.recv_within(Duration::ZERO)
    );
}

/// The same limit counts a session's queued acquires in every partition together.
#[test]
fn the_pending_limit_spans_partitions() {
    let mut config = test_config(CORES);
    config.limits.max_pending_per_session = 2;
    let server = start_with(config);
    let addr = server.local_addr();
    let held = keys("span-held");
    let more = keys("span-more");
    let mut holder = Conn::connect(addr);
    for key in held.iter().chain(&more) {
        holder.acquire_ok(key, LONG_S, fresh_id());
    }
    let mut session = Conn::connect(addr);
    // One queued acquire on each partition: the limit of 2 is reached.
    let queued: Vec<u64> = held
        .iter()
        .map(|key| {
            let owner = fresh_id();
            session.send_acquire(key, LONG_S, LONG_S, owner);
            owner
        })
        .collect();
    for key in &held {
        assert!(wait_until(Duration::from_secs(5), || session
            .state(key)
            .waiters
            == 1));
    }
    // A third that would queue is refused, on either partition.
    for key in &more {
        let owner = fresh_id();
        assert_eq!(
            session.acquire(key, LONG_S, LONG_S, owner),
            Response::Busy { owner }
        );
    }
    // Withdrawing one frees a place, on whichever partition it was.
    session.cancel(&held[0], queued[0]);
    assert_eq!(session.recv(), Response::Timeout { owner: queued[0] });
    let owner = fresh_id();
    session.send_acquire(&more[1], LONG_S, LONG_S, owner);
    assert!(wait_until(Duration::from_secs(5), || session
        .state(&more[1])
        .waiters
        == 1));
    session.expect_silence(Duration::from_millis(50));
}
