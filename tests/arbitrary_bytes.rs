//! Arbitrary byte streams through the session pipeline: the CI stand-in for the fuzz targets.
//!
//! * Locally (no sockets), through `common/session_driver.rs` — the code the `session` fuzz
//!   target runs: raw random scripts, streams of valid frames split at random offsets, and
//!   valid streams with a few bytes mutated. The driver panics on any broken rule; these tests
//!   add that every valid frame is answered and that a stream ends either in an incomplete
//!   frame or in a closing `X`.
//! * Against the real two-core server over TCP: a few hundred random streams, each on its own
//!   connection, then a well-behaved session that must still be served. Every answer must match
//!   a frame of the stream (kind and correlation id), every frame that must be answered is, and
//!   a closing error is answered with its `X`.
//!
//! Budget: `PROPTEST_CASES` scales the local cases; `LATCHKEY_TCP_STREAMS` (default 300) the
//! TCP ones.

use common::server::{start_with, test_config, Conn};
use common::session_driver::Driver;
use latchkey::rng::Rng;
use latchkey_client::protocol::{parse_request, parse_response, ErrorCode, Request, Response};
use proptest::prelude::*;
use std::io::{ErrorKind, Read, Write};
use std::net::{Shutdown, SocketAddr, TcpStream};
use std::time::{Duration, Instant};

/// The key limit the streams are cut for (small, so that code 2 is reachable).
const KEY_BYTES_MAX: usize = 48;

const KEYS: [&str; 5] = [
    "a",
    "k1",
    "orders/7",
    "ключ",
    "long-key-name-that-is-still-inline?",
];

/// A valid request with random fields, encoded.
fn valid_frame(rng: &mut Rng, out: &mut Vec<u8>) {
    let random_key: Vec<u8>;
    let key = match rng.below(4) {
        0 => {
            let length = rng.between(1, KEY_BYTES_MAX as u64) as usize;
            random_key = (0..length).map(|_| rng.between(0x20, 0x7e) as u8).collect();
            &random_key[..]
        }
        _ => KEYS[rng.below(KEYS.len() as u64) as usize].as_bytes(),
    };
    let id = rng.next_u64();
    let lease_s = rng.between(1, 3) as u8;
    let request = match rng.below(6) {
        0 | 1 => Request::Acquire {
            wait_s: rng.between(0, 2) as u8,
            lease_s,
            owner: id,
            key,
        },
        2 => Request::Release { token: id, key },
        3 => Request::Extend {
            lease_s,
            token: id,
            key,
        },
        4 => Request::Cancel { owner: id, key },
        _ if rng.percent(50) => Request::Query { nonce: id, key },
        _ => Request::Ping { nonce: id },
    };
    request.encode(out);
}

/// A frame with one fault (or a few bytes of noise).
fn faulty_frame(rng: &mut Rng, out: &mut Vec<u8>) {
    let start = out.len();
    match rng.below(7) {
        0 => out.extend_from_slice(b"A\x01\x00\x00\x00\x00\x00\x00\x00\x00\x07k\n"), // lease 0
        1 => out.extend_from_slice(b"Q\x00\x00\x00\x00\x00\x00\x00\x09\n"),          // empty key
        2 => out.extend_from_slice(b"R\x00\x00\x00\x00\x00\x00\x00\x05\xff\xfe\n"),  // not UTF-8
        3 => {
            // One byte over the limit: code 2, closes.
            out.extend_from_slice(b"C\x00\x00\x00\x00\x00\x00\x00\x01");
            out.extend(std::iter::repeat(b'x').take(KEY_BYTES_MAX + 1));
        }
        4 => out.extend_from_slice(b"P\x00\x00\x00\x00\x00\x00\x00\x02!"), // code 6, closes
        5 => out.push(rng.pick(b"aZz\x00\n\xffXT")),                       // unknown op, closes
        _ => {
            let length = rng.between(1, 16) as usize;
            out.extend(rng.bytes(length));
        }
    }
    if rng.percent(30) {
        let at = start + rng.below((out.len() - start) as u64) as usize;
        out[at] ^= 1 << rng.below(8);
    }
}

/// A stream of `pieces` frames: mostly valid, some faulty, sometimes cut short.
fn random_stream(rng: &mut Rng, pieces: usize) -> Vec<u8> {
    let mut out = Vec::new();
    for _ in 0..pieces {
        match rng.below(10) {
            0 => faulty_frame(rng, &mut out),
            1 => {
                let mut frame = Vec::new();
                valid_frame(rng, &mut frame);
                let cut = rng.below(frame.len() as u64) as usize;
                out.extend_from_slice(&frame[..cut]);
            }
            _ => valid_frame(rng, &mut out),
        }
    }
    out
}

/// A script that feeds `stream` to session 0 in random chunks, with small time steps between.
fn script_for(rng: &mut Rng, stream: &[u8]) -> Vec<u8> {
    // Header: key limit KEY_BYTES_MAX (low bits 1..=3 select 1 + header >> 2), roomy limits.
    let mut script = vec![((KEY_BYTES_MAX as u8 - 1) << 2) | 1, 0xff];
    let mut rest = stream;
    while !rest.is_empty() {
        let length = (rng.between(1, 40) as usize).min(rest.len());
        script.extend_from_slice(&[0, length as u8]);
        script.extend_from_slice(&rest[..length]);
        rest = &rest[length..];
        if rng.percent(20) {
            script.extend_from_slice(&[48 << 2, rng.between(0, 255) as u8]);
        }
    }
    script
}

/// Cases per local property: `PROPTEST_CASES`, else 512.
fn local_cases() -> u32 {
    std::env::var("PROPTEST_CASES").map_or(512, |v| v.parse().expect("PROPTEST_CASES"))
}

proptest! {
    #![proptest_config(ProptestConfig { cases: local_cases(), ..ProptestConfig::default() })]

    /// Any bytes at all, as a script: sessions, chunks, time jumps, ends.
    #[test]
    fn raw_scripts_never_break_the_pipeline(data in prop::collection::vec(any::<u8>(), 0..3000)) {
        let driver = Driver::run_script(&data);
        driver.check_consumed();
    }

    /// Valid frames split at random offsets: every one is executed and answered once.
    #[test]
    fn valid_frames_are_all_answered(seed in any::<u64>(), pieces in 1usize..120) {
        let mut rng = Rng::new(seed);
        let mut stream = Vec::new();
        let mut requests = 0;
        let mut cancels = 0;
        for _ in 0..pieces {
            let start = stream.len();
            valid_frame(&mut rng, &mut stream);
            requests += 1;
            cancels += usize::from(stream[start] == b'C');
        }
        let driver = Driver::run_script(&script_for(&mut rng, &stream));
        let session = &driver.sessions[0];
        prop_assert_eq!(session.ended, None);
        prop_assert_eq!(session.frames, requests);
        prop_assert_eq!(session.refused, 0);
        prop_assert!(session.input.is_empty());
        // Each acquire is answered once (a Cancel's T answers the acquire it withdrew), and
        // each other frame but Cancel has its own answer.
        prop_assert_eq!(session.answers.len(), requests - cancels);
    }

    /// Mostly-valid streams with faults and noise, cut at random offsets.
    #[test]
    fn mutated_streams_never_break_the_pipeline(seed in any::<u64>(), pieces in 1usize..80) {
        let mut rng = Rng::new(seed);
        let stream = random_stream(&mut rng, pieces);
        let driver = Driver::run_script(&script_for(&mut rng, &stream));
        driver.check_consumed();
    }
}

// ----- the real server ----------------------------------------------------------------------

/// What one frame of a stream may be answered with.
#[derive(Debug)]
enum Sent {
    Acquire { owner: u64, waits: bool },
    Keyed { op: u8, id: u64 },
    Cancel,
    Ping { nonce: u64 },
    Refused { code: ErrorCode, id: u64 },
}

/// The frames of `stream` as the server will cut them, up to a closing error.
fn frames_of(stream: &[u8]) -> Vec<Sent> {
    let mut sent = Vec::new();
    let mut rest = stream;
    // Bounded: every pass consumes bytes or stops.
    loop {
        match parse_request(rest, KEY_BYTES_MAX) {
            Ok(None) => return sent,
            Ok(Some((request, used))) => {
                sent.push(match request {
                    Request::Acquire { wait_s, owner, .. } => Sent::Acquire {
                        owner,
                        waits: wait_s > 0,
                    },
                    Request::Cancel { .. } => Sent::Cancel,
                    Request::Ping { nonce } => Sent::Ping { nonce },
                    other => Sent::Keyed {
                        op: other.op(),
                        id: other.correlation_id(),
                    },
                });
                rest = &rest[used..];
            }
            Err(error) => {
                sent.push(Sent::Refused {
                    code: error.code,
                    id: error.id,
                });
                if error.code.closes_session() {
                    return sent;
                }
                rest = &rest[error.consumed..];
            }
        }
    }
}

/// Whether `response` is a possible answer to `sent`.
fn answers(sent: &Sent, response: &Response) -> bool {
    match (sent, *response) {
        (Sent::Acquire { owner, .. }, Response::Acquired { owner: got, .. })
        | (Sent::Acquire { owner, .. }, Response::Timeout { owner: got })
        | (Sent::Acquire { owner, .. }, Response::Busy { owner: got }) => *owner == got,
        (Sent::Keyed { op: b'R', id }, Response::Released { token })
        | (
            Sent::Keyed {
                op: b'R' | b'E',
                id,
            },
            Response::NotHeld { token },
        )
        | (Sent::Keyed { op: b'E', id }, Response::Extended { token }) => *id == token,
        (Sent::Keyed { op: b'Q', id }, Response::State { nonce, .. }) => *id == nonce,
        (Sent::Ping { nonce }, Response::Pong { nonce: got }) => *nonce == got,
        (
            Sent::Refused { code, id },
            Response::Error {
                code: got,
                id: got_id,
            },
        ) => *code == got && *id == got_id,
        _ => false,
    }
}

/// Sends `stream` in random chunks, half-closes, and reads every answer until the server
/// closes. Returns the answers and whether the connection was reset.
fn exchange(addr: SocketAddr, rng: &mut Rng, stream: &[u8]) -> (Vec<Response>, bool) {
    let mut socket = TcpStream::connect(addr).expect("connect");
    socket.set_nodelay(true).unwrap();
    let mut rest = stream;
    while !rest.is_empty() {
        let length = (rng.between(1, 200) as usize).min(rest.len());
        if socket.write_all(&rest[..length]).is_err() {
            break; // the server closed after a closing error
        }
        rest = &rest[length..];
    }
    let _ = socket.shutdown(Shutdown::Write);
    socket
        .set_read_timeout(Some(Duration::from_secs(10)))
        .unwrap();
    let (mut input, mut reset) = (Vec::new(), false);
    let mut chunk = [0u8; 4096];
    loop {
        match socket.read(&mut chunk) {
            Ok(0) => break,
            Ok(n) => input.extend_from_slice(&chunk[..n]),
            Err(e) if e.kind() == ErrorKind::ConnectionReset => {
                reset = true;
                break;
            }
            Err(e) => panic!(
                "reading answers: {e}; read so far {:?}; stream {stream:?}",
                parse_all(&input)
            ),
        }
    }
    (parse_all(&input), reset)
}

/// Every response in `input`, which must hold whole frames only.
fn parse_all(input: &[u8]) -> Vec<Response> {
    let mut responses = Vec::new();
    let mut rest = input;
    while let Some((response, used)) = parse_response(rest).expect("a valid response") {
        responses.push(response);
        rest = &rest[used..];
    }
    assert!(rest.is_empty(), "a partial response frame");
    responses
}

/// Matches every answer to a distinct frame; then checks every frame that must be answered.
fn check_exchange(stream: &[u8], responses: &[Response], reset: bool) -> Result<(), String> {
    let sent = frames_of(stream);
    let mut answered = vec![false; sent.len()];
    for response in responses {
        let found = (0..sent.len()).find(|&i| !answered[i] && answers(&sent[i], response));
        let index = found.ok_or_else(|| format!("{response:?} answers no frame of {sent:?}"))?;
        answered[index] = true;
    }
    let closing = matches!(sent.last(), Some(Sent::Refused { code, .. }) if code.closes_session());
    if reset && closing {
        // The server closed with our bytes unread, so the kernel reset the connection; what
        // was read is checked above, the rest may be lost in the reset.
        return Ok(());
    }
    for (frame, answered) in sent.iter().zip(&answered) {
        let optional = matches!(frame, Sent::Cancel | Sent::Acquire { waits: true, .. });
        if !answered && !optional {
            return Err(format!("{frame:?} was not answered (reset: {reset})"));
        }
    }
    Ok(())
}

#[test]
fn random_streams_against_the_real_server() {
    let streams = std::env::var("LATCHKEY_TCP_STREAMS").map_or(300, |v| v.parse().unwrap());
    let mut config = test_config(2);
    config.limits.max_key_bytes = KEY_BYTES_MAX;
    let server = start_with(config);
    let addr = server.local_addr();
    let started = Instant::now();
    let mut resets = 0;
    for seed in 0..streams {
        let mut rng = Rng::new(seed);
        let pieces = rng.between(1, 60) as usize;
        let stream = random_stream(&mut rng, pieces);
        let (responses, reset) = exchange(addr, &mut rng, &stream);
        resets += usize::from(reset);
        if let Err(error) = check_exchange(&stream, &responses, reset) {
            panic!("stream seed {seed}: {error}\nstream {stream:?}\nanswers {responses:?}");
        }
    }
    // A well-behaved session is still served, and every random session has ended.
    let mut conn = Conn::connect(addr);
    let token = conn.acquire_ok("after-the-storm", 5, 1);
    assert_eq!(
        conn.release("after-the-storm", token),
        Response::Released { token }
    );
    conn.send(Request::Ping { nonce: 9 });
    assert_eq!(conn.recv(), Response::Pong { nonce: 9 });
    let until = Instant::now() + Duration::from_secs(10);
    while server.connections() > 1 && Instant::now() < until {
        std::thread::sleep(Duration::from_millis(10));
    }
    assert_eq!(server.connections(), 1, "sessions left open");
    eprintln!(
        "{streams} random streams over TCP in {:.1?} ({resets} ended in a reset)",
        started.elapsed()
    );
    assert!(!server.failed());
}

/// The committed fuzz seeds replay through the same driver (so they stay meaningful), and the
/// handoff seeds do hand off.
#[test]
fn committed_fuzz_seeds_replay() {
    let dir = concat!(env!("CARGO_MANIFEST_DIR"), "/fuzz/corpus/session");
    let mut replayed = 0;
    for entry in std::fs::read_dir(dir).expect("the session seed corpus") {
        let path = entry.unwrap().path();
        let script = std::fs::read(&path).unwrap();
        let driver = Driver::run_script(&script);
        driver.check_consumed();
        let name = path.file_name().unwrap().to_string_lossy().into_owned();
        let answers = |index: usize| driver.sessions[index].answers.clone();
        let granted = |index: usize| answers(index).iter().any(|r| r.op() == b'A');
        match name.as_str() {
            "release_hands_off" | "lease_expiry_hands_off" => assert!(granted(1), "{name}"),
            "cancel_withdraws" => {
                let timeouts = answers(1).iter().filter(|r| r.op() == b'T').count();
                assert_eq!(timeouts, 2, "{name}");
            }
            "every_frame" => {
                let ops: Vec<u8> = answers(0).iter().map(Response::op).collect();
                assert_eq!(ops, b"AEQPR", "{name}");
            }
            _ => {}
        }
        replayed += 1;
    }
    assert!(replayed >= 10, "only {replayed} seeds");
}
