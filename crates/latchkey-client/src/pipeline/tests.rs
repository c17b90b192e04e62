//! The pipeline on virtual time: exact interleavings of writes, answers and deadlines.

use super::*;
use crate::protocol::{parse_request, Request, KEY_BYTES_MAX};
use crossbeam_channel::Receiver;

pub(super) const TRANSPORT: Duration = Duration::from_secs(5);
/// The silence limit (the client's connect timeout).
pub(super) const SILENCE: Duration = Duration::from_secs(2);
pub(super) const OWNER: u64 = 0xa11ce;
/// The nonce of the handshake ping.
pub(super) const HELLO: u64 = 0x4e110;

pub(super) fn ms(millis: u64) -> Duration {
    Duration::from_millis(millis)
}

/// An owned copy of a request frame, for assertions.
#[derive(Debug, PartialEq, Eq)]
pub(super) enum Sent {
    Acquire {
        wait_s: u8,
        lease_s: u8,
        owner: u64,
        key: String,
    },
    Release {
        token: u64,
        key: String,
    },
    Extend {
        lease_s: u8,
        token: u64,
        key: String,
    },
    Cancel {
        owner: u64,
        key: String,
    },
    Query {
        nonce: u64,
    },
    Ping {
        nonce: u64,
    },
    Identify {
        nonce: u64,
    },
    Resolve {
        owner: u64,
        key: String,
    },
}

pub(super) fn decode(mut bytes: &[u8]) -> Vec<Sent> {
    let mut frames = Vec::new();
    while let Some((request, used)) = parse_request(bytes, KEY_BYTES_MAX).unwrap() {
        let text = |key: &[u8]| String::from_utf8(key.to_vec()).unwrap();
        frames.push(match request {
            Request::Acquire {
                wait_s,
                lease_s,
                owner,
                key,
            } => Sent::Acquire {
                wait_s,
                lease_s,
                owner,
                key: text(key),
            },
            Request::Release { token, key } => Sent::Release {
                token,
                key: text(key),
            },
            Request::Extend {
                lease_s,
                token,
                key,
            } => Sent::Extend {
                lease_s,
                token,
                key: text(key),
            },
            Request::Cancel { owner, key } => Sent::Cancel {
                owner,
                key: text(key),
            },
            Request::Query { nonce, .. } => Sent::Query { nonce },
            Request::Ping { nonce } => Sent::Ping { nonce },
            Request::Identify { nonce, .. } => Sent::Identify { nonce },
            Request::Resolve { owner, key } => Sent::Resolve {
                owner,
                key: text(key),
            },
        });
        bytes = &bytes[used..];
    }
    assert!(bytes.is_empty(), "trailing partial frame");
    frames
}

/// Writes everything the pipeline offers at `now`, as a socket that takes it all would.
pub(super) fn write_all(pipeline: &mut Pipeline, now: Instant) -> Vec<Sent> {
    let mut output = pipeline.output(now);
    let bytes = output.bytes().to_vec();
    output.handed(bytes.len());
    drop(output);
    decode(&bytes)
}

/// One write attempt at `now` in which the socket takes `taken` bytes; returns how many bytes
/// were offered.
pub(super) fn write_some(pipeline: &mut Pipeline, now: Instant, taken: usize) -> usize {
    let mut output = pipeline.output(now);
    let offered = output.bytes().len();
    output.handed(taken);
    offered
}

pub(super) fn feed(pipeline: &mut Pipeline, response: Response, now: Instant) {
    let mut bytes = Vec::new();
    response.encode(&mut bytes);
    assert_eq!(pipeline.handle_read(&bytes, now), bytes.len());
}

/// Wakes up as a driver would, at every instant `next_deadline` names before `deadline`, the
/// earliest armed deadline: each wake-up is at most that deadline, does nothing observable,
/// and they converge on the deadline's own millisecond.
fn follow_wake_ups(pipeline: &mut Pipeline, deadline: Instant) {
    for _ in 0..64 {
        let at = pipeline.next_deadline().expect("a deadline is armed");
        assert!(at <= deadline, "a wake-up after the deadline");
        if deadline - at < ms(1) {
            return;
        }
        pipeline.handle_deadlines(at);
        assert_eq!(pipeline.close_reason(), None, "nothing happens early");
    }
    panic!("the wake-ups never reached the deadline's millisecond");
}

/// The handshake at `now`, as a driver and a server run it: the ping goes out alone, its
/// pong establishes the session.
pub(super) fn handshake(pipeline: &mut Pipeline, now: Instant) {
    pipeline.start_handshake(HELLO, None);
    assert_eq!(write_all(pipeline, now), vec![Sent::Ping { nonce: HELLO }]);
    feed(pipeline, Response::Pong { nonce: HELLO }, now);
    assert!(pipeline.is_established());
}

pub(super) fn established() -> Pipeline {
    let now = Instant::now();
    let mut pipeline = Pipeline::new(TRANSPORT, SILENCE, now);
    handshake(&mut pipeline, now);
    pipeline
}

pub(super) fn call(op: Op, deadline: Instant) -> (Call, Receiver<Outcome>) {
    let (tx, rx) = crossbeam_channel::bounded(1);
    (
        Call {
            op,
            deadline,
            reply: Some(tx),
            attempts: 0,
        },
        rx,
    )
}

pub(super) fn acquire(owner: u64, wait_zero: bool, deadline: Instant) -> (Call, Receiver<Outcome>) {
    let op = Op::Acquire {
        key: Arc::from("k"),
        wait_zero,
        lease_s: 30,
        owner,
    };
    call(op, deadline)
}

pub(super) fn answered(rx: &Receiver<Outcome>) -> Response {
    match rx.try_recv() {
        Ok(Outcome::Answer { response, .. }) => response,
        other => panic!("expected an answer, got {other:?}"),
    }
}

#[test]
fn an_unsent_request_at_its_deadline_expires_and_is_never_encoded() {
    let t0 = Instant::now();
    for up in [false, true] {
        let mut pipeline = Pipeline::new(TRANSPORT, SILENCE, Instant::now());
        if up {
            handshake(&mut pipeline, t0);
        }
        let (call, rx) = acquire(OWNER, false, t0 + ms(100));
        pipeline.submit(call);
        follow_wake_ups(&mut pipeline, t0 + ms(100));
        pipeline.handle_deadlines(t0 + ms(99));
        assert!(rx.try_recv().is_err(), "never early");
        pipeline.handle_deadlines(t0 + ms(100));
        assert_eq!(rx.try_recv(), Ok(Outcome::Expired { established: up }));
        if !up {
            handshake(&mut pipeline, t0 + ms(100));
        }
        assert!(pipeline.output(t0 + ms(100)).bytes().is_empty());
    }
}

#[test]
fn a_sent_acquire_at_its_deadline_is_cancelled_and_the_late_timeout_decides() {
    let t0 = Instant::now();
    let mut pipeline = established();
    let (call, rx) = acquire(OWNER, false, t0 + ms(1500));
    pipeline.submit(call);
    write_all(&mut pipeline, t0);
    pipeline.handle_deadlines(t0 + ms(1500));
    assert!(rx.try_recv().is_err());
    let frames = write_all(&mut pipeline, t0 + ms(1500));
    assert_eq!(
        frames,
        vec![Sent::Cancel {
            owner: OWNER,
            key: "k".into()
        }]
    );
    feed(
        &mut pipeline,
        Response::Timeout { owner: OWNER },
        t0 + ms(1600),
    );
    assert_eq!(answered(&rx), Response::Timeout { owner: OWNER });
    assert_eq!(pipeline.close_reason(), None, "the session stays open");
}

#[test]
fn busy_found_after_the_cancel_stays_busy() {
    let t0 = Instant::now();
    let mut pipeline = established();
    let (call, rx) = acquire(OWNER, false, t0 + ms(1000));
    pipeline.submit(call);
    write_all(&mut pipeline, t0);
    pipeline.handle_deadlines(t0 + ms(1000));
    write_all(&mut pipeline, t0 + ms(1000));
    feed(
        &mut pipeline,
        Response::Busy { owner: OWNER },
        t0 + ms(1200),
    );
    assert_eq!(answered(&rx), Response::Busy { owner: OWNER });
}

#[test]
fn a_grant_after_the_cancel_is_released_and_the_call_is_indeterminate() {
    let t0 = Instant::now();
    let mut pipeline = established();
    let (call, rx) = acquire(OWNER, false, t0 + ms(1000));
    pipeline.submit(call);
    write_all(&mut pipeline, t0);
    pipeline.handle_deadlines(t0 + ms(1000));
    write_all(&mut pipeline, t0 + ms(1000));
    feed(
        &mut pipeline,
        Response::Acquired {
            owner: OWNER,
            token: 77,
        },
        t0 + ms(1010),
    );
    assert_eq!(rx.try_recv(), Ok(Outcome::Compensated));
    let frames = write_all(&mut pipeline, t0 + ms(1010));
    assert_eq!(
        frames,
        vec![Sent::Release {
            token: 77,
            key: "k".into()
        }]
    );
    assert_eq!(pipeline.close_reason(), None);
}

#[test]
fn withdrawn_acquires_are_cancelled_when_sent_and_expire_when_not() {
    let t0 = Instant::now();
    let mut pipeline = established();
    let (sent, sent_rx) = acquire(OWNER, false, t0 + ms(60_000));
    pipeline.submit(sent);
    write_all(&mut pipeline, t0);
    let (unsent, unsent_rx) = acquire(OWNER + 1, false, t0 + ms(60_000));
    pipeline.submit(unsent);
    let (immediate, immediate_rx) = acquire(OWNER + 2, true, t0 + ms(5_000));
    pipeline.submit(immediate);
    let (ping, ping_rx) = call(Op::Ping { nonce: 9 }, t0 + ms(5_000));
    pipeline.submit(ping);
    pipeline.withdraw_acquires(t0 + ms(10));
    assert_eq!(
        unsent_rx.try_recv(),
        Ok(Outcome::Expired { established: true }),
        "never sent"
    );
    assert!(sent_rx.try_recv().is_err(), "its answer decides");
    let frames = write_all(&mut pipeline, t0 + ms(10));
    assert_eq!(
        frames,
        vec![
            Sent::Acquire {
                wait_s: 0,
                lease_s: 30,
                owner: OWNER + 2,
                key: "k".into()
            },
            Sent::Ping { nonce: 9 },
            Sent::Cancel {
                owner: OWNER,
                key: "k".into()
            },
        ],
        "a wait-0 acquire and the rest go out as they were"
    );
    // Withdrawing again sends no second Cancel.
    pipeline.withdraw_acquires(t0 + ms(11));
    assert!(write_all(&mut pipeline, t0 + ms(11)).is_empty());
    feed(&mut pipeline, Response::Pong { nonce: 9 }, t0 + ms(12));
    assert_eq!(answered(&ping_rx), Response::Pong { nonce: 9 });
    feed(
        &mut pipeline,
        Response::Timeout { owner: OWNER },
        t0 + ms(12),
    );
    assert_eq!(answered(&sent_rx), Response::Timeout { owner: OWNER });
    assert!(immediate_rx.try_recv().is_err(), "not answered yet");
    assert_eq!(pipeline.close_reason(), None, "the session stays open");
}

#[test]
fn a_grant_that_crosses_the_withdrawal_before_the_deadline_is_delivered() {
    let t0 = Instant::now();
    let mut pipeline = established();
    let (call, rx) = acquire(OWNER, false, t0 + ms(60_000));
    pipeline.submit(call);
    write_all(&mut pipeline, t0);
    pipeline.withdraw_acquires(t0 + ms(10));
    write_all(&mut pipeline, t0 + ms(10));
    let granted = Response::Acquired {
        owner: OWNER,
        token: 81,
    };
    feed(&mut pipeline, granted, t0 + ms(11));
    // The caller is still there (its deadline has not passed): it gets the lock and
    // releases it, rather than the session releasing it behind its back.
    assert_eq!(answered(&rx), granted);
    assert!(write_all(&mut pipeline, t0 + ms(11)).is_empty());
}

#[test]
fn a_grant_read_at_the_deadline_before_it_was_processed_is_released() {
    let t0 = Instant::now();
    let mut pipeline = established();
    let (call, rx) = acquire(OWNER, false, t0 + ms(1000));
    pipeline.submit(call);
    write_all(&mut pipeline, t0);
    feed(
        &mut pipeline,
        Response::Acquired {
            owner: OWNER,
            token: 78,
        },
        t0 + ms(1000),
    );
    assert_eq!(rx.try_recv(), Ok(Outcome::Compensated));
    let frames = write_all(&mut pipeline, t0 + ms(1000));
    assert_eq!(
        frames,
        vec![Sent::Release {
            token: 78,
            key: "k".into()
        }]
    );
}

#[test]
fn a_grant_nobody_waits_for_any_more_is_released() {
    let t0 = Instant::now();
    let mut pipeline = established();
    let (call, rx) = acquire(OWNER, false, t0 + ms(1000));
    pipeline.submit(call);
    write_all(&mut pipeline, t0);
    drop(rx);
    feed(
        &mut pipeline,
        Response::Acquired {
            owner: OWNER,
            token: 79,
        },
        t0 + ms(10),
    );
    let frames = write_all(&mut pipeline, t0 + ms(10));
    assert_eq!(
        frames,
        vec![Sent::Release {
            token: 79,
            key: "k".into()
        }]
    );
}

#[test]
fn a_grant_in_time_is_delivered_with_its_read_instant() {
    let t0 = Instant::now();
    let mut pipeline = established();
    let (call, rx) = acquire(OWNER, false, t0 + ms(1000));
    pipeline.submit(call);
    write_all(&mut pipeline, t0 + ms(5));
    feed(
        &mut pipeline,
        Response::Acquired {
            owner: OWNER,
            token: 80,
        },
        t0 + ms(999),
    );
    let response = Response::Acquired {
        owner: OWNER,
        token: 80,
    };
    let expected = Outcome::Answer {
        response,
        sent_at: t0 + ms(5),
        read_at: t0 + ms(999),
    };
    assert_eq!(rx.try_recv(), Ok(expected));
}

#[test]
fn an_unanswered_cancel_closes_the_session_at_the_transport_allowance() {
    let t0 = Instant::now();
    let mut pipeline = established();
    let (call, rx) = acquire(OWNER, false, t0 + ms(1000));
    pipeline.submit(call);
    write_all(&mut pipeline, t0);
    pipeline.handle_deadlines(t0 + ms(1000));
    write_all(&mut pipeline, t0 + ms(1000));
    follow_wake_ups(&mut pipeline, t0 + ms(1000) + TRANSPORT);
    pipeline.handle_deadlines(t0 + ms(999) + TRANSPORT);
    assert_eq!(pipeline.close_reason(), None, "never early");
    pipeline.handle_deadlines(t0 + ms(1000) + TRANSPORT);
    assert_eq!(pipeline.close_reason(), Some(&CloseReason::Unanswered));
    pipeline.finish();
    assert_eq!(rx.try_recv(), Ok(Outcome::Indeterminate));
}

#[test]
fn a_sent_wait_zero_acquire_at_its_deadline_closes_the_session_without_cancel() {
    let t0 = Instant::now();
    let mut pipeline = established();
    let (call, rx) = acquire(OWNER, true, t0 + TRANSPORT);
    pipeline.submit(call);
    write_all(&mut pipeline, t0);
    pipeline.handle_deadlines(t0 + TRANSPORT);
    assert_eq!(pipeline.close_reason(), Some(&CloseReason::Unanswered));
    assert!(
        pipeline.output(t0 + TRANSPORT).bytes().is_empty(),
        "no Cancel: it was never queued"
    );
    pipeline.finish();
    assert_eq!(rx.try_recv(), Ok(Outcome::Indeterminate));
}

#[test]
fn a_deadline_with_part_of_the_frame_on_the_wire_closes_the_session() {
    let t0 = Instant::now();
    let mut pipeline = established();
    let (call, rx) = acquire(OWNER, false, t0 + ms(1000));
    pipeline.submit(call);
    write_some(&mut pipeline, t0, 1);
    pipeline.handle_deadlines(t0 + ms(1000));
    assert_eq!(
        pipeline.close_reason(),
        Some(&CloseReason::DeadlineMidFrame)
    );
    pipeline.finish();
    assert_eq!(rx.try_recv(), Ok(Outcome::Indeterminate));
}

#[test]
fn a_failed_session_separates_possibly_sent_from_definitely_unsent() {
    let t0 = Instant::now();
    let mut pipeline = established();
    let (sent, rx_sent) = acquire(1, false, t0 + ms(3000));
    let (partial, rx_partial) = acquire(2, false, t0 + ms(3000));
    let (unsent, rx_unsent) = acquire(3, false, t0 + ms(3000));
    pipeline.submit(sent);
    pipeline.submit(partial);
    write_some(&mut pipeline, t0, 12 + 1 + 1);
    pipeline.submit(unsent);
    pipeline.close(CloseReason::Eof);
    assert!(pipeline.finish().is_empty());
    assert_eq!(rx_sent.try_recv(), Ok(Outcome::Indeterminate));
    assert_eq!(rx_partial.try_recv(), Ok(Outcome::Indeterminate));
    assert_eq!(rx_unsent.try_recv(), Ok(Outcome::NotSent));
}

#[test]
fn a_tls_error_before_the_session_was_established_makes_every_call_unreachable() {
    let t0 = Instant::now();
    for established_first in [false, true] {
        let mut pipeline = Pipeline::new(TRANSPORT, SILENCE, t0);
        if established_first {
            handshake(&mut pipeline, t0);
        }
        let (call, rx) = acquire(OWNER, false, t0 + ms(3000));
        pipeline.submit(call);
        pipeline.close(CloseReason::Tls(
            "TLS: invalid peer certificate".to_string(),
        ));
        assert!(pipeline.finish().is_empty());
        // Once established, a TLS error is like any other: unsent calls may be retried.
        let expected = match established_first {
            false => Outcome::Unreachable,
            true => Outcome::NotSent,
        };
        assert_eq!(rx.try_recv(), Ok(expected));
    }
}

#[test]
fn a_session_refused_with_code_7_counts_everything_as_not_sent() {
    let t0 = Instant::now();
    let mut pipeline = established();
    let (call, rx) = acquire(OWNER, false, t0 + ms(3000));
    pipeline.submit(call);
    write_all(&mut pipeline, t0);
    let key: Arc<str> = Arc::from("k");
    pipeline.release_in_background(Arc::clone(&key), 5, t0);
    write_all(&mut pipeline, t0);
    feed(
        &mut pipeline,
        Response::Error {
            code: ErrorCode::SessionRefused,
            id: 0,
        },
        t0,
    );
    assert_eq!(pipeline.close_reason(), Some(&CloseReason::Refused));
    let orphans = pipeline.finish();
    assert_eq!(rx.try_recv(), Ok(Outcome::NotSent));
    assert_eq!(
        orphans.len(),
        1,
        "the unsent background release goes to another session"
    );
}

#[test]
fn answers_naming_one_token_are_matched_in_send_order() {
    let t0 = Instant::now();
    let mut pipeline = established();
    let extend = || Op::Extend {
        key: Arc::from("k"),
        lease_s: 10,
        token: 9,
    };
    let (first, rx1) = call(extend(), t0 + TRANSPORT);
    let (second, rx2) = call(extend(), t0 + TRANSPORT);
    pipeline.submit(first);
    pipeline.submit(second);
    write_all(&mut pipeline, t0);
    feed(&mut pipeline, Response::Extended { token: 9 }, t0);
    feed(&mut pipeline, Response::NotHeld { token: 9 }, t0);
    assert_eq!(answered(&rx1), Response::Extended { token: 9 });
    assert_eq!(answered(&rx2), Response::NotHeld { token: 9 });
}

#[test]
fn a_token_request_given_up_still_takes_its_answer_in_order() {
    let t0 = Instant::now();
    let mut pipeline = established();
    let release = || Op::Release {
        key: Arc::from("k"),
        token: 9,
    };
    let (first, rx1) = call(release(), t0 + ms(100));
    pipeline.submit(first);
    write_all(&mut pipeline, t0);
    pipeline.handle_deadlines(t0 + ms(100));
    assert_eq!(rx1.try_recv(), Ok(Outcome::Indeterminate));
    let (second, rx2) = call(release(), t0 + TRANSPORT);
    pipeline.submit(second);
    write_all(&mut pipeline, t0 + ms(100));
    feed(&mut pipeline, Response::Released { token: 9 }, t0 + ms(150));
    assert!(
        rx2.try_recv().is_err(),
        "the first answer belongs to the first release"
    );
    feed(&mut pipeline, Response::NotHeld { token: 9 }, t0 + ms(150));
    assert_eq!(answered(&rx2), Response::NotHeld { token: 9 });
}

#[test]
fn errors_are_correlated_by_owner_nonce_or_token() {
    let t0 = Instant::now();
    let mut pipeline = established();
    let (acquire_call, rx_acquire) = acquire(OWNER, false, t0 + ms(3000));
    let (query, rx_query) = call(
        Op::Query {
            key: Arc::from("k"),
            nonce: 44,
        },
        t0 + TRANSPORT,
    );
    let (release, rx_release) = call(
        Op::Release {
            key: Arc::from("k"),
            token: 55,
        },
        t0 + TRANSPORT,
    );
    pipeline.submit(acquire_call);
    pipeline.submit(query);
    pipeline.submit(release);
    write_all(&mut pipeline, t0);
    for id in [55, 44, OWNER] {
        feed(
            &mut pipeline,
            Response::Error {
                code: ErrorCode::LeaseZero,
                id,
            },
            t0,
        );
    }
    assert_eq!(
        pipeline.close_reason(),
        None,
        "code 5 does not close the session"
    );
    for rx in [rx_acquire, rx_query, rx_release] {
        assert!(matches!(
            answered(&rx),
            Response::Error {
                code: ErrorCode::LeaseZero,
                ..
            }
        ));
    }
}

#[test]
fn garbage_from_the_server_closes_the_session() {
    let mut pipeline = established();
    assert_eq!(pipeline.handle_read(b"Zxxxxxxxxxx", Instant::now()), 0);
    assert!(matches!(
        pipeline.close_reason(),
        Some(CloseReason::Protocol(_))
    ));
}

#[test]
fn a_closing_error_ends_the_session_and_its_answer_waits_for_finish() {
    let t0 = Instant::now();
    let mut pipeline = established();
    let (rejected, rx_rejected) = acquire(1, false, t0 + ms(3000));
    let (sent, rx_sent) = acquire(2, false, t0 + ms(3000));
    let (unsent, rx_unsent) = acquire(3, false, t0 + ms(3000));
    pipeline.submit(rejected);
    pipeline.submit(sent);
    write_all(&mut pipeline, t0);
    pipeline.submit(unsent);
    let rejection = Response::Error {
        code: ErrorCode::KeyTooLong,
        id: 1,
    };
    feed(&mut pipeline, rejection, t0 + ms(10));
    assert_eq!(
        pipeline.close_reason(),
        Some(&CloseReason::ServerError(ErrorCode::KeyTooLong))
    );
    assert!(
        rx_rejected.try_recv().is_err(),
        "held until the driver has retired the session"
    );
    assert!(
        pipeline.output(t0 + ms(10)).bytes().is_empty(),
        "nothing more is sent"
    );
    let (late, rx_late) = acquire(4, false, t0 + ms(3000));
    pipeline.submit(late);
    assert_eq!(
        rx_late.try_recv(),
        Ok(Outcome::NotSent),
        "a call reaching the closed pipeline is given back unsent"
    );
    assert!(pipeline.finish().is_empty());
    assert_eq!(
        rx_rejected.try_recv(),
        Ok(Outcome::Answer {
            response: rejection,
            sent_at: t0,
            read_at: t0 + ms(10),
        })
    );
    assert_eq!(rx_sent.try_recv(), Ok(Outcome::Indeterminate));
    assert_eq!(rx_unsent.try_recv(), Ok(Outcome::NotSent));
}

#[test]
fn closing_errors_correlate_by_nonce_and_token_and_code_1_by_nothing() {
    let t0 = Instant::now();
    let key: Arc<str> = Arc::from("k");
    let cases = [
        (ErrorCode::MissingNewline, 44, Some(0)),
        (ErrorCode::KeyTooLong, 55, Some(1)),
        (ErrorCode::UnknownOp, 0, None),
    ];
    for (code, id, answered_index) in cases {
        let mut pipeline = established();
        let (query, rx_query) = call(
            Op::Query {
                key: Arc::clone(&key),
                nonce: 44,
            },
            t0 + TRANSPORT,
        );
        let (release, rx_release) = call(
            Op::Release {
                key: Arc::clone(&key),
                token: 55,
            },
            t0 + TRANSPORT,
        );
        pipeline.submit(query);
        pipeline.submit(release);
        write_all(&mut pipeline, t0);
        let error = Response::Error { code, id };
        feed(&mut pipeline, error, t0);
        assert_eq!(
            pipeline.close_reason(),
            Some(&CloseReason::ServerError(code))
        );
        assert!(rx_query.try_recv().is_err() && rx_release.try_recv().is_err());
        pipeline.finish();
        for (index, rx) in [rx_query, rx_release].iter().enumerate() {
            let outcome = rx.try_recv().unwrap();
            if answered_index == Some(index) {
                assert!(
                    matches!(outcome, Outcome::Answer { response, .. } if response == error),
                    "{code}: {outcome:?}"
                );
            } else {
                assert_eq!(outcome, Outcome::Indeterminate, "{code}");
            }
        }
    }
}

#[test]
fn answers_read_before_a_closing_error_are_delivered_at_once() {
    let t0 = Instant::now();
    let mut pipeline = established();
    let (granted, rx_granted) = acquire(1, false, t0 + ms(3000));
    let (rejected, rx_rejected) = acquire(2, false, t0 + ms(3000));
    pipeline.submit(granted);
    pipeline.submit(rejected);
    write_all(&mut pipeline, t0);
    let mut bytes = Vec::new();
    Response::Acquired { owner: 1, token: 7 }.encode(&mut bytes);
    Response::Error {
        code: ErrorCode::KeyTooLong,
        id: 2,
    }
    .encode(&mut bytes);
    assert_eq!(pipeline.handle_read(&bytes, t0), bytes.len());
    assert_eq!(
        answered(&rx_granted),
        Response::Acquired { owner: 1, token: 7 }
    );
    assert!(rx_rejected.try_recv().is_err());
    pipeline.finish();
    assert!(matches!(
        answered(&rx_rejected),
        Response::Error {
            code: ErrorCode::KeyTooLong,
            id: 2
        }
    ));
}

#[test]
fn answered_and_expired_calls_leave_no_timer_behind() {
    let t0 = Instant::now();
    let mut pipeline = established();
    let key: Arc<str> = Arc::from("k");
    for round in 1..=2_000u64 {
        let deadline = t0 + ms(10_000);
        let (granted, rx_granted) = acquire(round, false, deadline);
        let (query, rx_query) = call(
            Op::Query {
                key: Arc::clone(&key),
                nonce: round,
            },
            deadline,
        );
        let (extend, rx_extend) = call(
            Op::Extend {
                key: Arc::clone(&key),
                lease_s: 5,
                token: round,
            },
            deadline,
        );
        pipeline.submit(granted);
        pipeline.submit(query);
        pipeline.submit(extend);
        write_all(&mut pipeline, t0);
        let token = round;
        feed(
            &mut pipeline,
            Response::Acquired {
                owner: round,
                token,
            },
            t0,
        );
        feed(&mut pipeline, Response::Pong { nonce: round }, t0);
        feed(&mut pipeline, Response::Extended { token }, t0);
        answered(&rx_granted);
        answered(&rx_query);
        answered(&rx_extend);
    }
    // An expired call and a cancelled acquire answered after its Cancel leave none either.
    let (unsent, rx_unsent) = acquire(u64::MAX, false, t0 + ms(100));
    pipeline.submit(unsent);
    pipeline.handle_deadlines(t0 + ms(100));
    assert_eq!(
        rx_unsent.try_recv(),
        Ok(Outcome::Expired { established: true })
    );
    let (cancelled, rx_cancelled) = acquire(u64::MAX - 1, false, t0 + ms(200));
    pipeline.submit(cancelled);
    write_all(&mut pipeline, t0);
    pipeline.handle_deadlines(t0 + ms(200));
    write_all(&mut pipeline, t0 + ms(200));
    let owner = u64::MAX - 1;
    feed(&mut pipeline, Response::Timeout { owner }, t0 + ms(300));
    assert_eq!(answered(&rx_cancelled), Response::Timeout { owner });
    assert_eq!(
        pipeline.timers_len(),
        0,
        "every answered call's timer was cancelled"
    );
    assert_eq!(pipeline.next_deadline(), None, "nothing to wake up for");
}

#[test]
fn a_deadline_inside_a_millisecond_fires_at_its_exact_instant_never_before() {
    let epoch = Instant::now();
    let mut pipeline = Pipeline::new(TRANSPORT, SILENCE, epoch);
    handshake(&mut pipeline, epoch);
    let deadline = epoch + Duration::from_micros(100_500);
    let (call, rx) = acquire(OWNER, false, deadline);
    pipeline.submit(call);
    pipeline.handle_deadlines(epoch + Duration::from_micros(100_200));
    assert!(
        rx.try_recv().is_err(),
        "the wheel's millisecond is not the deadline"
    );
    assert_eq!(
        pipeline.timers_len(),
        1,
        "armed again for its exact instant"
    );
    let wake = pipeline.next_deadline().unwrap();
    assert_eq!(
        wake, deadline,
        "the next wake-up is the exact instant, not at once"
    );
    pipeline.handle_deadlines(deadline);
    assert_eq!(rx.try_recv(), Ok(Outcome::Expired { established: true }));
    assert_eq!(pipeline.timers_len(), 0);
}
