//! The lane over a real loopback connection: the hello first and alone until accepted, whole
//! envelopes in order however the socket cuts the writes, a full socket leaves the rest queued
//! and `blocked`, a failed socket is an error, and a disconnect rewinds.

use super::*;
use crate::cluster::peer::frame;
use protobuf::Message as _;
use std::io::Read;
use std::net::{TcpListener, TcpStream};
use std::time::Duration;

/// The lane's end (non-blocking, as the peer thread's) and the peer's end (blocking, with a
/// read timeout so that a test fails instead of hanging).
fn pair() -> (TcpStream, TcpStream) {
    let listener = TcpListener::bind("127.0.0.1:0").expect("bind");
    let ours = TcpStream::connect(listener.local_addr().expect("addr")).expect("connect");
    let (theirs, _) = listener.accept().expect("accept");
    ours.set_nonblocking(true).expect("non-blocking");
    theirs
        .set_read_timeout(Some(Duration::from_secs(10)))
        .expect("timeout");
    (ours, theirs)
}

/// The lane's end as the lane holds it (no TLS).
fn plain(ours: TcpStream) -> PeerStream {
    PeerStream::Plain(mio::net::TcpStream::from_std(ours))
}

fn message(number: u64, padding: usize) -> Message {
    let mut message = Message::default();
    message.set_commit(number);
    message.set_context(vec![0x5a; padding].into());
    message
}

/// A lane connected to the peer's end and accepted (no hello: the tests read envelopes only),
/// with `now` and fresh counters.
fn accepted_lane() -> (Lane, TcpStream, Instant, PeerStats) {
    let (ours, theirs) = pair();
    let now = Instant::now();
    let lane = Lane::new(2, Queue::new(100_000, 256 << 20), now);
    {
        let mut state = lane.lock();
        state.connect(plain(ours), b"", now);
        state.accepted = true;
    }
    (lane, theirs, now, PeerStats::default())
}

/// Reads envelopes from `stream` until `count` have arrived; returns their (shard, commit).
fn read_envelopes(stream: &mut TcpStream, buffer: &mut Vec<u8>, count: usize) -> Vec<(u32, u64)> {
    let mut out = Vec::new();
    let mut chunk = vec![0u8; 64 << 10];
    while out.len() < count {
        while let Some((envelope, used)) = frame::decode(buffer).expect("a well-formed envelope") {
            let parsed = Message::parse_from_bytes(envelope.message).expect("a whole message");
            out.push((envelope.shard, parsed.commit));
            buffer.drain(..used);
        }
        if out.len() >= count {
            break;
        }
        let read = stream.read(&mut chunk).expect("read within the timeout");
        assert!(read > 0, "closed early");
        buffer.extend_from_slice(&chunk[..read]);
    }
    out
}

#[test]
fn the_hello_goes_first_and_alone_until_accepted_then_the_envelopes_in_order() {
    let (ours, mut theirs) = pair();
    let (now, stats) = (Instant::now(), PeerStats::default());
    let lane = Lane::new(2, Queue::new(100, 1 << 20), now);
    let mut state = lane.lock();
    state.push(2, 3, &message(1, 10), &stats); // queued before any connection
    assert!(!state.wants_flush(), "no socket yet");
    state.connect(plain(ours), b"HELLO", now);
    assert!(state.wants_flush());
    state.flush(now, &stats).expect("flush");
    assert!(
        !state.wants_flush(),
        "nothing but the hello may go before acceptance"
    );
    let mut hello = [0u8; 5];
    theirs.read_exact(&mut hello).expect("the hello");
    assert_eq!(&hello, b"HELLO");
    assert_eq!(state.queue.messages(), 1, "the envelope still waits");

    state.accepted = true;
    state.push(2, 4, &message(2, 10), &stats);
    state.flush(now, &stats).expect("flush");
    assert_eq!(state.queue.messages(), 0);
    let got = read_envelopes(&mut theirs, &mut Vec::new(), 2);
    assert_eq!(got, vec![(3, 1), (4, 2)]);
    assert_eq!(
        stats
            .messages_sent
            .load(std::sync::atomic::Ordering::Relaxed),
        2
    );
}

#[test]
fn a_full_socket_leaves_the_rest_queued_and_blocked_and_nothing_is_cut_or_reordered() {
    let (lane, mut theirs, now, stats) = accepted_lane();
    let mut state = lane.lock();
    // The peer reads nothing: the socket's buffers fill and a write would block.
    let mut pushed = 0u64;
    while !state.blocked {
        assert!(pushed < 50_000, "the socket never filled");
        state.push(2, (pushed % 7) as u32, &message(pushed, 4000), &stats);
        pushed += 1;
        state.flush(now, &stats).expect("flush");
    }
    assert!(state.queue.messages() > 0, "what did not fit waits");
    assert!(
        !state.wants_flush(),
        "a blocked lane waits for the writable event"
    );
    state.push(2, (pushed % 7) as u32, &message(pushed, 4000), &stats);
    pushed += 1;
    state.flush(now, &stats).expect("flush");
    let waiting = state.queue.messages();
    assert!(
        waiting > 0 && state.blocked,
        "still blocked, nothing written"
    );

    // The peer reads everything; each writable event lets the lane write more.
    let (sent, mut buffer) = (pushed as usize, Vec::new());
    let mut got = Vec::new();
    while state.queue.messages() > 0 {
        got.extend(read_envelopes(&mut theirs, &mut buffer, 1));
        state.blocked = false;
        state.flush(now, &stats).expect("flush");
    }
    got.extend(read_envelopes(&mut theirs, &mut buffer, sent - got.len()));
    let expected: Vec<(u32, u64)> = (0..pushed).map(|n| ((n % 7) as u32, n)).collect();
    assert_eq!(got, expected, "every envelope whole, once, in order");
}

#[test]
fn a_closed_peer_is_an_error_and_a_disconnect_rewinds_the_partial_envelope() {
    let (lane, theirs, now, stats) = accepted_lane();
    let mut state = lane.lock();
    drop(theirs);
    let mut error = None;
    for number in 0..1000 {
        state.push(2, 0, &message(number, 1000), &stats);
        if let Err(failed) = state.flush(now, &stats) {
            error = Some(failed);
            break;
        }
        std::thread::sleep(Duration::from_millis(1));
    }
    let error = error.expect("writes to a closed peer fail");
    assert_ne!(error.kind(), io::ErrorKind::WouldBlock);
    state.failed = Some(error);
    assert!(!state.wants_flush(), "a failed lane does not write");
    state.disconnect();
    assert!(state.failed.is_none() && !state.accepted && !state.blocked);
    assert_eq!(
        state.queue.unsent().len(),
        state.queue.bytes(),
        "the next connection starts at an envelope's start"
    );
}
