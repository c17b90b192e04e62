//! The handshake ping and the stall rule on virtual time.

use std::sync::Arc;
use std::time::Instant;

use super::super::tests::{
    acquire, call, decode, established, feed, ms, write_all, write_some, Sent, HELLO, OWNER,
    SILENCE, TRANSPORT,
};
use super::super::{Call, CloseReason, Op, Outcome, Pipeline};
use crate::protocol::{ErrorCode, Response};

fn query(nonce: u64, deadline: Instant) -> (Call, crossbeam_channel::Receiver<Outcome>) {
    let op = Op::Query {
        key: Arc::from("k"),
        nonce,
    };
    call(op, deadline)
}

fn background_release(token: u64, deadline: Instant) -> Call {
    Call {
        op: Op::Release {
            key: Arc::from("k"),
            token,
        },
        deadline,
        reply: None,
        attempts: 0,
    }
}

#[test]
fn nothing_but_the_ping_goes_out_before_its_pong_and_the_pong_reaches_no_caller() {
    let t0 = Instant::now();
    let mut pipeline = Pipeline::new(TRANSPORT, SILENCE, t0);
    let (early, rx_early) = acquire(1, false, t0 + ms(3000));
    pipeline.submit(early);
    assert!(
        pipeline.output(t0).bytes().is_empty(),
        "not connected: nothing"
    );
    pipeline.start_handshake(HELLO, None);
    let (during, rx_during) = query(2, t0 + ms(3000));
    pipeline.submit(during);
    // The socket takes four bytes of the ping, then the rest: still nothing but the ping.
    assert_eq!(
        write_some(&mut pipeline, t0, 4),
        10,
        "only the ping is offered"
    );
    assert_eq!(
        write_some(&mut pipeline, t0, 6),
        6,
        "then its last 6 bytes only"
    );
    assert!(pipeline.output(t0).bytes().is_empty());
    assert!(pipeline.is_handshaking() && !pipeline.is_established());
    feed(&mut pipeline, Response::Pong { nonce: HELLO }, t0 + ms(1));
    assert!(pipeline.is_established());
    assert!(rx_early.try_recv().is_err() && rx_during.try_recv().is_err());
    let frames = write_all(&mut pipeline, t0 + ms(1));
    assert_eq!(frames.len(), 2, "the queued calls go out now: {frames:?}");
    assert!(matches!(frames[0], Sent::Acquire { owner: 1, .. }));
    assert_eq!(frames[1], Sent::Query { nonce: 2 });
    // Another pong of that nonce is nobody's answer.
    feed(&mut pipeline, Response::Pong { nonce: HELLO }, t0 + ms(2));
    assert!(rx_early.try_recv().is_err() && rx_during.try_recv().is_err());
    assert_eq!(pipeline.close_reason(), None);
}

#[test]
fn the_ping_written_in_pieces_is_counted_exactly() {
    let t0 = Instant::now();
    let mut pipeline = Pipeline::new(TRANSPORT, SILENCE, t0);
    pipeline.start_handshake(HELLO, None);
    let mut wire = Vec::new();
    for taken in [1, 0, 3, 6] {
        let mut output = pipeline.output(t0);
        wire.extend_from_slice(&output.bytes()[..taken]);
        output.handed(taken);
    }
    assert_eq!(decode(&wire), vec![Sent::Ping { nonce: HELLO }]);
    assert!(pipeline.output(t0).bytes().is_empty());
}

#[test]
fn no_pong_leaves_every_call_not_sent() {
    let t0 = Instant::now();
    let mut pipeline = Pipeline::new(TRANSPORT, SILENCE, t0);
    let (first, rx_first) = acquire(1, true, t0 + TRANSPORT);
    pipeline.submit(first);
    pipeline.start_handshake(HELLO, None);
    write_all(&mut pipeline, t0);
    let (second, rx_second) = query(2, t0 + TRANSPORT);
    pipeline.submit(second);
    pipeline.submit(background_release(7, t0 + TRANSPORT));
    // The driver's connect deadline passes with no pong.
    pipeline.close(CloseReason::HandshakeTimeout);
    let unsent = pipeline.finish();
    assert_eq!(rx_first.try_recv(), Ok(Outcome::NotSent));
    assert_eq!(rx_second.try_recv(), Ok(Outcome::NotSent));
    assert_eq!(
        unsent.len(),
        1,
        "the background release goes to another session"
    );
}

#[test]
fn any_other_answer_to_the_ping_ends_the_session_with_nothing_sent() {
    let t0 = Instant::now();
    let refused = Response::Error {
        code: ErrorCode::SessionRefused,
        id: 0,
    };
    let closing = Response::Error {
        code: ErrorCode::UnknownOp,
        id: 0,
    };
    let cases = [
        (
            Response::Pong { nonce: HELLO + 1 },
            CloseReason::HandshakeAnswer(b'P'),
        ),
        (
            Response::Timeout { owner: OWNER },
            CloseReason::HandshakeAnswer(b'T'),
        ),
        (refused, CloseReason::Refused),
        (closing, CloseReason::ServerError(ErrorCode::UnknownOp)),
    ];
    for (answer, reason) in cases {
        let mut pipeline = Pipeline::new(TRANSPORT, SILENCE, t0);
        let (call, rx) = acquire(OWNER, false, t0 + ms(3000));
        pipeline.submit(call);
        pipeline.start_handshake(HELLO, None);
        write_all(&mut pipeline, t0);
        feed(&mut pipeline, answer, t0);
        assert_eq!(pipeline.close_reason(), Some(&reason), "{answer:?}");
        pipeline.finish();
        assert_eq!(rx.try_recv(), Ok(Outcome::NotSent), "{answer:?}");
    }
    // A pong before the ping was written whole answers no ping of ours.
    let mut pipeline = Pipeline::new(TRANSPORT, SILENCE, t0);
    pipeline.start_handshake(HELLO, None);
    write_some(&mut pipeline, t0, 9);
    feed(&mut pipeline, Response::Pong { nonce: HELLO }, t0);
    assert_eq!(
        pipeline.close_reason(),
        Some(&CloseReason::HandshakeAnswer(b'P'))
    );
}

#[test]
fn bytes_that_are_not_frames_in_answer_to_the_ping_make_calls_unreachable() {
    let t0 = Instant::now();
    let mut pipeline = Pipeline::new(TRANSPORT, SILENCE, t0);
    let (call, rx) = query(3, t0 + ms(3000));
    pipeline.submit(call);
    pipeline.start_handshake(HELLO, None);
    write_all(&mut pipeline, t0);
    pipeline.handle_read(b"-ERR unknown command\r\n", t0);
    assert!(matches!(
        pipeline.close_reason(),
        Some(CloseReason::Protocol(_))
    ));
    pipeline.finish();
    assert_eq!(rx.try_recv(), Ok(Outcome::Unreachable));
}

#[test]
fn an_overdue_answer_stalls_the_session_at_the_limit_never_before() {
    let t0 = Instant::now();
    let mut pipeline = established();
    let (sent, rx_sent) = query(1, t0 + TRANSPORT);
    pipeline.submit(sent);
    write_all(&mut pipeline, t0);
    let at = pipeline.next_deadline().expect("the stall is armed");
    assert!(at <= t0 + SILENCE, "the driver wakes for it");
    pipeline.handle_deadlines(t0 + SILENCE - ms(1));
    assert!(!pipeline.is_stalled(), "never early");
    // A call queued behind a full socket when the stall comes is handed back, unsent.
    let (queued, rx_queued) = query(2, t0 + TRANSPORT);
    pipeline.submit(queued);
    pipeline.handle_deadlines(t0 + SILENCE);
    assert!(pipeline.is_stalled());
    assert!(
        rx_queued.try_recv().is_err(),
        "resolved once the driver published the stall"
    );
    assert!(pipeline.resolve_returned().is_empty());
    assert_eq!(rx_queued.try_recv(), Ok(Outcome::NotSent));
    // New calls are handed back too; a background release goes back to the pool.
    let (new, rx_new) = acquire(3, true, t0 + TRANSPORT);
    pipeline.submit(new);
    pipeline.submit(background_release(9, t0 + TRANSPORT));
    assert_eq!(pipeline.resolve_returned().len(), 1);
    assert_eq!(rx_new.try_recv(), Ok(Outcome::NotSent));
    assert!(
        write_all(&mut pipeline, t0 + SILENCE).is_empty(),
        "nothing goes out"
    );
    // What was sent stays: it is answered when the answer comes, and the stall ends.
    let state = Response::State {
        nonce: 1,
        held: false,
        lease_ms: 0,
        waiters: 0,
    };
    feed(&mut pipeline, state, t0 + SILENCE + ms(500));
    assert!(matches!(rx_sent.try_recv(), Ok(Outcome::Answer { .. })));
    assert!(!pipeline.is_stalled(), "a read ends the stall");
    let (after, _rx_after) = query(4, t0 + ms(9000));
    pipeline.submit(after);
    assert_eq!(
        write_all(&mut pipeline, t0 + SILENCE + ms(500)),
        vec![Sent::Query { nonce: 4 }]
    );
}

#[test]
fn a_sent_request_given_up_keeps_the_session_stalled_until_it_reads() {
    let t0 = Instant::now();
    let mut pipeline = established();
    let (ping, rx) = call(Op::Ping { nonce: 5 }, t0 + ms(500));
    pipeline.submit(ping);
    write_all(&mut pipeline, t0);
    pipeline.handle_deadlines(t0 + ms(500));
    assert_eq!(rx.try_recv(), Ok(Outcome::Indeterminate));
    pipeline.handle_deadlines(t0 + SILENCE);
    assert!(
        pipeline.is_stalled(),
        "nothing read since the ping went out"
    );
    pipeline.handle_deadlines(t0 + SILENCE * 10);
    assert!(pipeline.is_stalled());
    assert_eq!(
        pipeline.close_reason(),
        None,
        "a stall never closes the session"
    );
    // The late pong of the ping given up: nobody's answer, but a byte read.
    feed(
        &mut pipeline,
        Response::Pong { nonce: 5 },
        t0 + SILENCE * 10,
    );
    assert!(!pipeline.is_stalled());
}

#[test]
fn an_acquire_that_may_queue_never_stalls_but_its_cancel_is_due_at_once() {
    let t0 = Instant::now();
    let mut pipeline = established();
    let (queued, rx) = acquire(OWNER, false, t0 + ms(10_000));
    pipeline.submit(queued);
    write_all(&mut pipeline, t0);
    pipeline.handle_deadlines(t0 + ms(9_999));
    assert!(!pipeline.is_stalled(), "a queued acquire may stay silent");
    // At the deadline the Cancel goes out; its T is due at once.
    pipeline.handle_deadlines(t0 + ms(10_000));
    let cancel = write_all(&mut pipeline, t0 + ms(10_000));
    assert!(matches!(cancel[..], [Sent::Cancel { owner: OWNER, .. }]));
    pipeline.handle_deadlines(t0 + ms(10_000) + SILENCE - ms(1));
    assert!(!pipeline.is_stalled());
    pipeline.handle_deadlines(t0 + ms(10_000) + SILENCE);
    assert!(pipeline.is_stalled());
    feed(
        &mut pipeline,
        Response::Timeout { owner: OWNER },
        t0 + ms(12_500),
    );
    assert!(matches!(rx.try_recv(), Ok(Outcome::Answer { .. })));
    assert!(!pipeline.is_stalled());
}

#[test]
fn a_cancel_still_goes_out_on_a_stalled_session() {
    let t0 = Instant::now();
    let mut pipeline = established();
    let (queued, _rx) = acquire(OWNER, false, t0 + ms(3_000));
    let (ping, _rx_ping) = call(Op::Ping { nonce: 6 }, t0 + TRANSPORT);
    pipeline.submit(queued);
    pipeline.submit(ping);
    write_all(&mut pipeline, t0);
    pipeline.handle_deadlines(t0 + SILENCE);
    assert!(pipeline.is_stalled());
    pipeline.handle_deadlines(t0 + ms(3_000));
    let frames = write_all(&mut pipeline, t0 + ms(3_000));
    assert!(
        matches!(frames[..], [Sent::Cancel { owner: OWNER, .. }]),
        "the acquire's single terminal answer needs it: {frames:?}"
    );
}

#[test]
fn a_read_after_a_send_clears_the_evidence_against_it() {
    let t0 = Instant::now();
    let mut pipeline = established();
    let (first, _rx1) = query(1, t0 + ms(9_000));
    pipeline.submit(first);
    write_all(&mut pipeline, t0);
    // Something is read at 1 s (an answer to another request): the server is alive.
    feed(
        &mut pipeline,
        Response::Pong { nonce: 0xdead },
        t0 + ms(1_000),
    );
    let (second, _rx2) = query(2, t0 + ms(9_000));
    pipeline.submit(second);
    write_all(&mut pipeline, t0 + ms(1_500));
    pipeline.handle_deadlines(t0 + ms(1_500) + SILENCE - ms(1));
    assert!(
        !pipeline.is_stalled(),
        "the first query's silence was broken by the read"
    );
    pipeline.handle_deadlines(t0 + ms(1_500) + SILENCE);
    assert!(pipeline.is_stalled());
}

/// An identified session (docs/protocol.md §5), established at `now`.
fn identified(now: Instant) -> Pipeline {
    let mut pipeline = Pipeline::new(TRANSPORT, SILENCE, now);
    let identity = super::Identity {
        client: 7,
        grace_s: 10,
    };
    pipeline.start_handshake(HELLO, Some(identity));
    let hello = write_all(&mut pipeline, now);
    let identify = HELLO.wrapping_add(1);
    assert_eq!(
        hello,
        vec![
            Sent::Identify { nonce: identify },
            Sent::Ping { nonce: HELLO }
        ]
    );
    let answer = Response::Identified {
        nonce: identify,
        grace_s: 10,
    };
    feed(&mut pipeline, answer, now);
    feed(&mut pipeline, Response::Pong { nonce: HELLO }, now);
    assert!(pipeline.is_established() && pipeline.is_identified());
    pipeline
}

/// The quiet time before a probe: a quarter of the silence limit.
const QUIET: std::time::Duration = std::time::Duration::from_millis(500);

#[test]
fn an_identified_waiter_on_a_silent_server_is_probed_then_its_session_closes() {
    let t0 = Instant::now();
    let mut pipeline = identified(t0);
    let (queued, rx) = acquire(OWNER, false, t0 + ms(30_000));
    pipeline.submit(queued);
    write_all(&mut pipeline, t0);
    assert_eq!(pipeline.next_deadline(), Some(t0 + QUIET));
    pipeline.handle_deadlines(t0 + QUIET - ms(1));
    assert_eq!(write_all(&mut pipeline, t0 + QUIET - ms(1)), vec![]);
    pipeline.handle_deadlines(t0 + QUIET);
    let probe = write_all(&mut pipeline, t0 + QUIET);
    let [Sent::Ping { nonce }] = probe[..] else {
        panic!("a probe ping, got {probe:?}");
    };
    assert!(nonce != HELLO && nonce != HELLO.wrapping_add(1));
    // Its pong is overdue half a silence limit after it went out: never before.
    let overdue = t0 + QUIET + SILENCE / 2;
    assert_eq!(pipeline.next_deadline(), Some(overdue));
    pipeline.handle_deadlines(overdue - ms(1));
    assert_eq!(pipeline.close_reason(), None);
    assert!(rx.try_recv().is_err(), "the waiter still waits");
    pipeline.handle_deadlines(overdue);
    assert_eq!(pipeline.close_reason(), Some(&CloseReason::Silent));
    pipeline.finish();
    assert!(
        matches!(rx.try_recv(), Ok(Outcome::Indeterminate)),
        "the client resolves it elsewhere"
    );
}

#[test]
fn a_live_server_answers_the_probes_and_the_waiter_keeps_waiting() {
    let t0 = Instant::now();
    let mut pipeline = identified(t0);
    let (queued, rx) = acquire(OWNER, false, t0 + ms(30_000));
    pipeline.submit(queued);
    write_all(&mut pipeline, t0);
    let mut now = t0;
    for _ in 0..10 {
        now += QUIET;
        assert_eq!(pipeline.next_deadline(), Some(now));
        pipeline.handle_deadlines(now);
        let probe = write_all(&mut pipeline, now);
        let [Sent::Ping { nonce }] = probe[..] else {
            panic!("a probe ping, got {probe:?}");
        };
        // The pong comes 900 ms later (within half the silence limit); it reaches no caller.
        now += ms(900);
        pipeline.handle_deadlines(now);
        feed(&mut pipeline, Response::Pong { nonce }, now);
        assert!(rx.try_recv().is_err());
        // Quiet again from the read on.
        assert_eq!(pipeline.next_deadline(), Some(now + QUIET));
    }
    assert_eq!(pipeline.close_reason(), None);
    assert!(!pipeline.is_stalled());
    let token = 41;
    feed(
        &mut pipeline,
        Response::Acquired {
            owner: OWNER,
            token,
        },
        now,
    );
    assert_eq!(
        super::super::tests::answered(&rx),
        Response::Acquired {
            owner: OWNER,
            token
        }
    );
    // Nothing waits any more: the next probe instant disarms the probe, and nothing wakes
    // the driver after it.
    pipeline.handle_deadlines(now + QUIET);
    assert_eq!(write_all(&mut pipeline, now + QUIET), vec![]);
    assert_eq!(pipeline.next_deadline(), None);
}

#[test]
fn an_unidentified_waiter_is_never_probed_and_its_session_never_closes_for_silence() {
    let t0 = Instant::now();
    let mut pipeline = established();
    let (queued, rx) = acquire(OWNER, false, t0 + ms(30_000));
    pipeline.submit(queued);
    write_all(&mut pipeline, t0);
    for second in 1..=29 {
        let now = t0 + ms(second * 1_000);
        pipeline.handle_deadlines(now);
        assert_eq!(write_all(&mut pipeline, now), vec![]);
    }
    assert_eq!(pipeline.close_reason(), None);
    assert!(rx.try_recv().is_err());
}

#[test]
fn an_identified_session_without_a_waiter_stalls_as_before_and_stays_open() {
    let t0 = Instant::now();
    let mut pipeline = identified(t0);
    let (first, _rx) = query(1, t0 + ms(9_000));
    pipeline.submit(first);
    write_all(&mut pipeline, t0);
    pipeline.handle_deadlines(t0 + SILENCE);
    assert!(pipeline.is_stalled());
    assert_eq!(pipeline.close_reason(), None);
}
