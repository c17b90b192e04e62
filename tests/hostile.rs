//! Hostile clients against a real two-core server: slowloris, a pipeliner that never reads, a
//! connection flood past `max_connections`, acquire floods past `max_keys` and
//! `max_pending_per_session`, and frames split at every byte offset on many sessions at once.
//!
//! In every scenario a well-behaved `Probe` (tests/common/probe.rs) on its own session holds a lock on each partition
//! from before the attack until after it; meanwhile it pings, queries both partitions and
//! extends its holds in a loop. Each scenario checks that its limit holds, that the probe's
//! p99 latency stays under `P99_BOUND` (generous: debug build, shared cores) and that
//! nothing it held was lost: every extend succeeded and its tokens still release with `R`.
//!
//! The scenarios run one at a time (a process-wide lock), so that one's load does not count
//! against another's latency bound and the memory reading is not shared.

use common::probe::{self, serial, Probe};
use common::server::{keys_on_partition, rss_bytes, start_with, test_config, Conn};
use latchkey::partition::partition_of;
use latchkey::server::ServerHandle;
use latchkey_client::protocol::{parse_response, ErrorCode, Request, Response};
use std::collections::{HashMap, HashSet};
use std::io::{ErrorKind, Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::thread;
use std::time::{Duration, Instant};

const CORES: usize = 2;

fn server(configure: impl FnOnce(&mut latchkey::config::Config)) -> ServerHandle {
    let mut config = test_config(CORES);
    configure(&mut config);
    start_with(config)
}

/// One key per partition, named `prefix-N`.
fn key_per_partition(prefix: &str) -> Vec<String> {
    probe::key_per_partition(prefix, CORES)
}

// ----- helpers ----------------------------------------------------------------------------------

fn encode(requests: &[Request<'_>]) -> Vec<u8> {
    let mut bytes = Vec::new();
    for request in requests {
        request.encode(&mut bytes);
    }
    bytes
}

/// Reads `count` responses from `stream` (blocking), within `limit`.
fn read_responses(stream: &mut TcpStream, count: usize, limit: Duration) -> Vec<Response> {
    let until = Instant::now() + limit;
    let (mut buffer, mut responses) = (Vec::new(), Vec::with_capacity(count));
    let mut chunk = vec![0u8; 64 * 1024];
    while responses.len() < count {
        let left = until.saturating_duration_since(Instant::now());
        assert!(
            !left.is_zero(),
            "{} of {count} answers in {limit:?}",
            responses.len()
        );
        stream.set_read_timeout(Some(left)).unwrap();
        match stream.read(&mut chunk) {
            Ok(0) => panic!("closed after {} of {count} answers", responses.len()),
            Ok(n) => buffer.extend_from_slice(&chunk[..n]),
            Err(e) if matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::TimedOut) => {}
            Err(e) => panic!("read: {e}"),
        }
        let mut used = 0;
        while let Some((response, n)) = parse_response(&buffer[used..]).expect("valid") {
            responses.push(response);
            used += n;
        }
        buffer.drain(..used);
    }
    responses
}

/// Waits until `condition` holds, up to ten seconds.
fn eventually(what: &str, condition: impl Fn() -> bool) {
    let until = Instant::now() + Duration::from_secs(10);
    while !condition() {
        assert!(Instant::now() < until, "never: {what}");
        thread::sleep(Duration::from_millis(10));
    }
}

// ----- scenarios --------------------------------------------------------------------------------

/// Sixteen sessions each send a Ping and a Query one byte every 150 ms (about four seconds):
/// they hold the server's read buffers, not its attention; each is answered once complete.
#[test]
fn slowloris_sessions_are_answered_and_starve_no_one() {
    let _serial = serial();
    let server = server(|_| {});
    let addr = server.local_addr();
    let probe = Probe::start(addr, CORES);
    let keys = key_per_partition("slow");
    let mut sessions: Vec<TcpStream> = (0..16).map(|_| TcpStream::connect(addr).unwrap()).collect();
    for session in &sessions {
        session.set_nodelay(true).unwrap();
    }
    let frames: Vec<Vec<u8>> = (0..sessions.len())
        .map(|i| {
            let key = keys[i % CORES].as_bytes();
            encode(&[
                Request::Ping { nonce: i as u64 },
                Request::Query {
                    nonce: i as u64,
                    key,
                },
            ])
        })
        .collect();
    for at in 0..frames[0].len() {
        for (session, frame) in sessions.iter_mut().zip(&frames) {
            session.write_all(&frame[at..at + 1]).unwrap();
        }
        thread::sleep(Duration::from_millis(150));
    }
    for (i, session) in sessions.iter_mut().enumerate() {
        let answers = read_responses(session, 2, Duration::from_secs(10));
        assert!(
            answers.iter().all(|r| r.correlation_id() == i as u64),
            "{answers:?}"
        );
    }
    probe.finish("slowloris");
}

/// A session that pipelines acquires and queries and never reads: the server stops reading it
/// once its unsent answers pass the output bound, so the writer stalls for good (not just
/// now and then, as it would behind a slow but unbounded server), memory stays bounded and
/// other sessions are served. When it finally reads, every answer is there.
#[test]
fn a_pipeliner_that_never_reads_is_paused_not_buffered() {
    let _serial = serial();
    let server = server(|_| {});
    let addr = server.local_addr();
    let probe = Probe::start(addr, CORES);
    let rss_before = rss_bytes();
    let mut pipeliner = Pipeliner {
        keys: (0..CORES)
            .flat_map(|partition| keys_on_partition("flood", partition, CORES, 4))
            .collect(),
        next_id: 0,
        ids: Vec::new(),
    };
    let mut stream = TcpStream::connect(addr).unwrap();
    stream.set_nonblocking(true).unwrap();
    let paused = write_until_paused(&mut stream, &mut pipeliner, rss_before);
    // It pushed back after a bounded amount (socket buffers and its own bounded buffers), and
    // memory did not grow with what was sent.
    let growth = paused.rss_max.saturating_sub(rss_before);
    assert!(growth < 128 << 20, "memory grew {growth} bytes");
    // Now read: every request (including the last batch, finished meanwhile) has its answer.
    stream.set_nonblocking(false).unwrap();
    let mut reader = stream.try_clone().unwrap();
    let ids = pipeliner.ids;
    let expected = ids.len();
    let reading =
        thread::spawn(move || read_responses(&mut reader, expected, Duration::from_secs(60)));
    stream.write_all(&paused.pending[paused.offset..]).unwrap();
    let answers = reading.join().expect("every answer arrives");
    let mut answered: Vec<u64> = answers.iter().map(Response::correlation_id).collect();
    answered.sort_unstable();
    assert_eq!(answered, ids, "every request answered exactly once");
    eprintln!(
        "never-reading pipeliner: {} bytes accepted before the server stopped reading \
         ({:.1?}), {expected} requests answered, memory growth {} KiB",
        paused.written,
        paused.took,
        growth / 1024
    );
    probe.finish("never-reading pipeliner");
}

/// The never-reading pipeliner's requests: acquires and queries of `keys`, numbered from
/// `next_id` on, every id sent (or being sent) recorded in `ids`.
struct Pipeliner {
    keys: Vec<String>,
    next_id: u64,
    ids: Vec<u64>,
}

impl Pipeliner {
    /// The next 256 requests, encoded.
    fn batch(&mut self) -> Vec<u8> {
        let requests: Vec<Request<'_>> = (0..256)
            .map(|i| {
                self.next_id += 1;
                self.ids.push(self.next_id);
                let key = self.keys[i % self.keys.len()].as_bytes();
                match i % 2 {
                    0 => Request::Acquire {
                        wait_s: 0,
                        lease_s: 1,
                        owner: self.next_id,
                        key,
                    },
                    _ => Request::Query {
                        nonce: self.next_id,
                        key,
                    },
                }
            })
            .collect();
        encode(&requests)
    }
}

/// Where the never-reading pipeliner stood once the server stopped reading it.
struct Paused {
    /// Bytes the server took.
    written: u64,
    /// The highest resident memory seen while writes were refused.
    rss_max: u64,
    /// From the first write to the last that made progress.
    took: Duration,
    /// The batch being written, of which `offset` bytes were.
    pending: Vec<u8>,
    offset: usize,
}

/// Writes batches on the non-blocking `stream` until the server stops taking anything: no
/// write succeeds for half a second (and that within 15 seconds).
fn write_until_paused(
    stream: &mut TcpStream,
    pipeliner: &mut Pipeliner,
    rss_before: u64,
) -> Paused {
    let (mut pending, mut offset) = (pipeliner.batch(), 0);
    let (mut written, mut rss_max) = (0u64, rss_before);
    let started = Instant::now();
    let mut progress = started;
    while progress.elapsed() < Duration::from_millis(500) {
        assert!(
            started.elapsed() < Duration::from_secs(15),
            "the server kept reading a session that never reads: {written} bytes"
        );
        match stream.write(&pending[offset..]) {
            Ok(n) => {
                (written, offset, progress) = (written + n as u64, offset + n, Instant::now());
                if offset == pending.len() {
                    (pending, offset) = (pipeliner.batch(), 0);
                }
            }
            Err(e) if e.kind() == ErrorKind::WouldBlock => {
                rss_max = rss_max.max(rss_bytes());
                thread::sleep(Duration::from_millis(5));
            }
            Err(e) => panic!("write: {e}"),
        }
    }
    Paused {
        written,
        rss_max,
        took: progress - started,
        pending,
        offset,
    }
}

/// Rounds of at least this long for the scenarios that are quick, so that the probe measures
/// something while they last.
const ROUNDS_FOR: Duration = Duration::from_secs(1);

/// Past `max_connections` a session gets `X` 7 (unprompted) and is closed; the admitted ones and
/// the probe are served; once the flood leaves, new sessions are admitted again. In rounds.
#[test]
fn a_connection_flood_is_refused_past_max_connections_and_recovers() {
    let _serial = serial();
    let max_connections = 8;
    let server = server(|config| config.limits.max_connections = max_connections);
    let addr = server.local_addr();
    let probe = Probe::start(addr, CORES);
    let started = Instant::now();
    let mut rounds = 0;
    while rounds < 3 || started.elapsed() < ROUNDS_FOR {
        connection_flood_round(&server, max_connections, 40);
        rounds += 1;
    }
    eprintln!(
        "connection flood: {rounds} rounds of 40 sessions past max_connections {max_connections}"
    );
    probe.finish("connection flood");
}

fn connection_flood_round(server: &ServerHandle, max_connections: usize, sessions: u64) {
    let addr = server.local_addr();
    let (mut admitted, mut refused) = (Vec::new(), 0);
    for nonce in 0..sessions {
        let mut conn = Conn::connect(addr);
        conn.send(Request::Ping { nonce });
        match conn.recv() {
            Response::Pong { nonce: got } if got == nonce => admitted.push(conn),
            Response::Error {
                code: ErrorCode::SessionRefused,
                id: 0,
            } => {
                let rest = conn.recv_until_closed();
                assert!(rest.is_empty(), "more after X 7: {rest:?}");
                refused += 1;
            }
            other => panic!("flood session {nonce} answered {other:?}"),
        }
    }
    assert_eq!(
        admitted.len(),
        max_connections - 1,
        "the probe holds one session"
    );
    assert_eq!(refused, sessions as usize - admitted.len());
    for (nonce, conn) in admitted.iter_mut().enumerate() {
        conn.send(Request::Ping {
            nonce: nonce as u64,
        });
        assert_eq!(
            conn.recv(),
            Response::Pong {
                nonce: nonce as u64
            }
        );
    }
    drop(admitted);
    eventually("the flood's sessions end", || server.connections() == 1);
}

/// Acquires of new keys past `max_keys` (per partition): every one answered, the grants exactly
/// up to the limit, `B` beyond; once the flood's keys are released new keys are granted again.
/// In rounds.
#[test]
fn an_acquire_flood_past_max_keys_is_all_busy_and_recovers() {
    let _serial = serial();
    let max_keys = 64;
    let server = server(|config| config.limits.max_keys = max_keys);
    let addr = server.local_addr();
    let probe = Probe::start(addr, CORES);
    let started = Instant::now();
    let mut rounds = 0;
    while rounds < 3 || started.elapsed() < ROUNDS_FOR {
        // Each partition holds max_keys / CORES entries at most, one of them the probe's.
        max_keys_round(addr, rounds, max_keys / CORES - 1);
        rounds += 1;
    }
    eprintln!("max_keys flood: {rounds} rounds of 400 acquires of new keys");
    probe.finish("max_keys flood");
}

fn max_keys_round(addr: SocketAddr, round: usize, room: usize) {
    let keys: Vec<String> = (0..400)
        .map(|i| format!("keys-flood-{round}-{i}"))
        .collect();
    let requests: Vec<Request<'_>> = keys
        .iter()
        .enumerate()
        .map(|(i, key)| Request::Acquire {
            wait_s: (i % 3) as u8,
            lease_s: 30,
            owner: i as u64,
            key: key.as_bytes(),
        })
        .collect();
    let mut flood = Conn::connect(addr);
    flood.send_raw(&encode(&requests));
    let answers = read_responses(&mut flood.stream, keys.len(), Duration::from_secs(30));
    let mut per_partition = vec![0usize; CORES];
    let mut granted = HashMap::new();
    for answer in &answers {
        match *answer {
            Response::Acquired { owner, token } => {
                let key = &keys[owner as usize];
                per_partition[partition_of(key.as_bytes(), CORES)] += 1;
                granted.insert(key.clone(), token);
            }
            Response::Busy { .. } => {}
            other => panic!("flood answered {other:?}"),
        }
    }
    assert_eq!(per_partition, vec![room; CORES], "grants per partition");
    let mut owners: Vec<u64> = answers.iter().map(Response::correlation_id).collect();
    owners.sort_unstable();
    assert_eq!(
        owners,
        (0..keys.len() as u64).collect::<Vec<_>>(),
        "none lost"
    );
    // Full: a new key is refused to anyone; released entries make room again.
    let mut other = Conn::connect(addr);
    let fresh = key_per_partition(&format!("keys-fresh-{round}"));
    for key in &fresh {
        assert_eq!(other.acquire(key, 0, 5, 7), Response::Busy { owner: 7 });
    }
    for (key, token) in &granted {
        assert_eq!(
            flood.release(key, *token),
            Response::Released { token: *token }
        );
    }
    for key in &fresh {
        let token = other.acquire_ok(key, 5, 8);
        assert_eq!(other.release(key, token), Response::Released { token });
    }
}

/// Acquires that would queue past `max_pending_per_session`: `max_pending_per_session` of them
/// queue, the rest get `B` at once; cancelling answers the queued ones `T`, so every request has
/// its answer; after that the session can queue again. In rounds.
#[test]
fn an_acquire_flood_past_max_pending_is_all_busy_and_recovers() {
    let _serial = serial();
    let max_pending = 16u32;
    let server = server(|config| config.limits.max_pending_per_session = max_pending);
    let addr = server.local_addr();
    let probe = Probe::start(addr, CORES);
    let started = Instant::now();
    let mut rounds = 0;
    while rounds < 3 || started.elapsed() < ROUNDS_FOR {
        max_pending_round(addr, rounds, max_pending);
        rounds += 1;
    }
    eprintln!("max_pending flood: {rounds} rounds of 200 acquires, {max_pending} queued each");
    probe.finish("max_pending flood");
}

fn max_pending_round(addr: SocketAddr, round: usize, max_pending: u32) {
    let held: Vec<String> = (0..CORES)
        .flat_map(|partition| keys_on_partition(&format!("held-{round}"), partition, CORES, 2))
        .collect();
    let mut holder = Conn::connect(addr);
    let tokens: Vec<u64> = held
        .iter()
        .map(|key| holder.acquire_ok(key, 30, 1))
        .collect();
    let total = 200u64;
    let requests: Vec<Request<'_>> = (0..total)
        .map(|owner| Request::Acquire {
            wait_s: 30,
            lease_s: 5,
            owner,
            key: held[owner as usize % held.len()].as_bytes(),
        })
        .collect();
    let mut flood = Conn::connect(addr);
    flood.send_raw(&encode(&requests));
    let queued = u64::from(max_pending);
    let busy = read_responses(
        &mut flood.stream,
        (total - queued) as usize,
        Duration::from_secs(30),
    );
    flood.expect_silence(Duration::from_millis(50));
    // Exactly max_pending were queued; all the others are B.
    assert!(
        busy.iter().all(|r| r.op() == b'B'),
        "only B at once: {busy:?}"
    );
    let busy_owners: HashSet<u64> = busy.iter().map(Response::correlation_id).collect();
    assert_eq!(busy_owners.len() as u64, total - queued, "one answer each");
    let queued_owners: Vec<u64> = (0..total).filter(|o| !busy_owners.contains(o)).collect();
    check_queued_first_per_key(&held, total, &busy_owners);
    cancel_the_queued(&mut flood, &held, &queued_owners, queued as usize);
    queue_again_and_release(&mut holder, &mut flood, &held, &tokens);
}

/// Of the `total` flood acquires (owner `o` on `held[o % held.len()]`), the ones refused are
/// `busy_owners`. The partitions decide concurrently, so which ones queued depends on how their
/// work interleaved, but on each key (executed in order, with no place freed meanwhile) the
/// queued ones come first.
fn check_queued_first_per_key(held: &[String], total: u64, busy_owners: &HashSet<u64>) {
    for (index, key) in held.iter().enumerate() {
        let on_key = (0..total).filter(|owner| *owner as usize % held.len() == index);
        let queued_on_key = on_key.clone().filter(|o| !busy_owners.contains(o)).count();
        assert!(
            on_key
                .take(queued_on_key)
                .all(|o| !busy_owners.contains(&o)),
            "{key}: a later acquire queued after an earlier one was refused"
        );
    }
}

/// Cancels the `queued` flood acquires (`queued_owners`): each is answered `T`, none lost.
fn cancel_the_queued(flood: &mut Conn, held: &[String], queued_owners: &[u64], queued: usize) {
    let cancels: Vec<Request<'_>> = queued_owners
        .iter()
        .map(|&owner| Request::Cancel {
            owner,
            key: held[owner as usize % held.len()].as_bytes(),
        })
        .collect();
    flood.send_raw(&encode(&cancels));
    let timeouts = read_responses(&mut flood.stream, queued, Duration::from_secs(10));
    let mut cancelled: Vec<u64> = timeouts.iter().map(Response::correlation_id).collect();
    cancelled.sort_unstable();
    assert!(timeouts.iter().all(|r| r.op() == b'T'), "{timeouts:?}");
    assert_eq!(cancelled, queued_owners, "none lost");
}

/// Recovered: the flood's session queues again and is granted on release; then every hold is
/// released.
fn queue_again_and_release(holder: &mut Conn, flood: &mut Conn, held: &[String], tokens: &[u64]) {
    flood.send(Request::Acquire {
        wait_s: 30,
        lease_s: 5,
        owner: 999,
        key: held[0].as_bytes(),
    });
    assert_eq!(
        holder.release(&held[0], tokens[0]),
        Response::Released { token: tokens[0] }
    );
    let Response::Acquired { owner: 999, token } = flood.recv() else {
        panic!("the queued acquire was not granted");
    };
    assert_eq!(flood.release(&held[0], token), Response::Released { token });
    for (key, &token) in held.iter().zip(tokens).skip(1) {
        assert_eq!(holder.release(key, token), Response::Released { token });
    }
}

/// One pipelined stream (every request type, headers full of 0x0A, keys on both partitions),
/// split in two at every byte offset, each split on its own session, all at once.
#[test]
fn frames_split_at_every_offset_on_many_sessions_at_once() {
    let _serial = serial();
    let server = server(|_| {});
    let addr = server.local_addr();
    let probe = Probe::start(addr, CORES);
    let length = split_stream(0).len();
    assert!((1..length).all(|k| split_stream(k).len() == length));
    let mut sessions: Vec<Conn> = (1..length).map(|_| Conn::connect(addr)).collect();
    let streams: Vec<Vec<u8>> = (1..length).map(split_stream).collect();
    for (at, (session, bytes)) in (1..length).zip(sessions.iter_mut().zip(&streams)) {
        session.send_raw(&bytes[..at]);
    }
    thread::sleep(Duration::from_millis(20));
    for (at, (session, bytes)) in (1..length).zip(sessions.iter_mut().zip(&streams)) {
        session.send_raw(&bytes[at..]);
    }
    for (k, session) in (1..length).zip(sessions.iter_mut()) {
        check_split_answers(k, session);
    }
    eprintln!(
        "split frames: {} sessions, each split at its own offset",
        length - 1
    );
    probe.finish("split at every offset");
}

/// The owner, nonce and token of split stream `k`: 0x0A0A_0A0A_0A0A_0A0A + `k`, so that its
/// headers are full of newline bytes.
fn split_newlines(k: usize) -> u64 {
    0x0a0a_0a0a_0a0a_0a0a_u64 + k as u64
}

/// Split stream `k`'s keys, one per partition; of one length, so that every stream has the
/// same length and offsets.
fn split_keys(k: usize) -> Vec<String> {
    (0..CORES)
        .map(|partition| {
            (0..)
                .map(|i| format!("split-{k:04}-{i:04}"))
                .find(|key| partition_of(key.as_bytes(), CORES) == partition)
                .unwrap()
        })
        .collect()
}

/// Split stream `k`: on each of its keys an acquire, query, extend, cancel and release, then a
/// ping; nine answers.
fn split_stream(k: usize) -> Vec<u8> {
    let keys = split_keys(k);
    let newlines = split_newlines(k);
    let mut requests = Vec::new();
    for key in &keys {
        let key = key.as_bytes();
        requests.extend([
            Request::Acquire {
                wait_s: 0,
                lease_s: 5,
                owner: newlines,
                key,
            },
            Request::Query {
                nonce: newlines,
                key,
            },
            Request::Extend {
                lease_s: 1,
                token: newlines,
                key,
            },
            Request::Cancel { owner: 1, key },
            Request::Release { token: 0x0a, key },
        ]);
    }
    requests.push(Request::Ping { nonce: newlines });
    encode(&requests)
}

/// The session that sent split stream `k` gets exactly its nine answers, with its ids.
fn check_split_answers(k: usize, session: &mut Conn) {
    let answers = read_responses(&mut session.stream, 9, Duration::from_secs(10));
    let newlines = split_newlines(k);
    let mut ops: Vec<u8> = answers.iter().map(Response::op).collect();
    ops.sort_unstable();
    assert_eq!(ops, b"AANNNNPQQ", "split at {k}: {answers:?}");
    for answer in &answers {
        let id = answer.correlation_id();
        assert!(id == newlines || id == 0x0a, "split at {k}: {answer:?}");
    }
    session.expect_silence(Duration::from_millis(1));
}

/// A client pipelines pings, then sends a frame with a closing error and more bytes after it,
/// and reads nothing until the server has closed. Every pong and the `X` must still arrive:
/// the contract says the server flushes the `X` and answers are never dropped.
///
/// Without care the server would close the socket with the bytes after the bad frame still
/// unread in the kernel; Linux answers such a close with a reset (RFC 1122 §4.2.2.13), which
/// discards every answer still queued in the server's send buffer, the `X` included; the client
/// reads only what had already reached it, then `ECONNRESET`. Without the trailing bytes the same
/// exchange delivers everything (second half of this test). The server therefore lingers:
/// after a closing error it shuts its side once the output is flushed, then reads and drops
/// input until the peer ends or a short deadline passes, and only then closes.
#[test]
fn a_closing_error_followed_by_more_bytes_loses_no_answer() {
    let _serial = serial();
    let server = server(|_| {});
    let pings = 20_000u64;
    for trailing in [100_000usize, 0] {
        let mut stream = TcpStream::connect(server.local_addr()).unwrap();
        let mut bytes = encode(
            &(0..pings)
                .map(|nonce| Request::Ping { nonce })
                .collect::<Vec<_>>(),
        );
        bytes.extend_from_slice(b"Z\n");
        bytes.extend(std::iter::repeat(b'j').take(trailing));
        let mut writer = stream.try_clone().unwrap();
        let writing = thread::spawn(move || writer.write_all(&bytes).is_ok());
        eventually("the server ends the session", || server.connections() == 0);
        let mut received = Vec::new();
        let outcome = stream.read_to_end(&mut received);
        let _ = writing.join();
        let mut answers = 0;
        let mut rest = &received[..];
        while let Some((_, used)) = parse_response(rest).expect("valid") {
            answers += 1;
            rest = &rest[used..];
        }
        let unknown_op = Response::Error {
            code: ErrorCode::UnknownOp,
            id: 0,
        };
        let last = parse_response(&received[received.len().saturating_sub(11)..]);
        assert!(
            outcome.is_ok() && answers == pings + 1 && last == Ok(Some((unknown_op, 11))),
            "{trailing} bytes after the bad frame: {answers} of {} answers, then {outcome:?}",
            pings + 1
        );
    }
}
