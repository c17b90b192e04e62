//! Writing on virtual time: when frames are encoded, what a write attempt leaves behind.

use super::super::tests::{
    acquire, decode, established, handshake, ms, write_all, write_some, Sent, OWNER, SILENCE,
    TRANSPORT,
};
use super::super::{Outcome, Pipeline};
use std::time::Instant;

#[test]
fn wire_wait_is_computed_when_the_frame_is_encoded_not_when_submitted() {
    let t0 = Instant::now();
    let mut pipeline = Pipeline::new(TRANSPORT, SILENCE, Instant::now());
    let (call, _rx) = acquire(OWNER, false, t0 + ms(3000));
    pipeline.submit(call);
    assert!(
        pipeline.output(t0).bytes().is_empty(),
        "nothing goes out before the connection is up"
    );
    handshake(&mut pipeline, t0 + ms(1000));
    let frames = write_all(&mut pipeline, t0 + ms(1500));
    let expected = Sent::Acquire {
        wait_s: 2,
        lease_s: 30,
        owner: OWNER,
        key: "k".into(),
    };
    assert_eq!(frames, vec![expected]);
}

#[test]
fn frames_the_socket_did_not_take_are_encoded_again_with_a_fresh_wait() {
    let t0 = Instant::now();
    let mut pipeline = established();
    let (first, _rx1) = acquire(1, false, t0 + ms(10_000));
    let (second, _rx2) = acquire(2, false, t0 + ms(10_000));
    pipeline.submit(first);
    pipeline.submit(second);
    // The socket takes the first frame and three bytes of the second, then blocks.
    let offered = write_some(&mut pipeline, t0, 12 + 1 + 3);
    assert_eq!(
        write_some(&mut pipeline, t0, offered - 16),
        offered - 16,
        "a started frame is never re-encoded"
    );
    // A third frame offered but not taken at all goes back to the queue...
    let (third, rx3) = acquire(3, false, t0 + ms(3000));
    pipeline.submit(third);
    assert!(write_some(&mut pipeline, t0, 0) > 0);
    // ...and is still definitely unsent: at its deadline it expires.
    pipeline.handle_deadlines(t0 + ms(3000));
    assert_eq!(rx3.try_recv(), Ok(Outcome::Expired { established: true }));
    let (fourth, _rx4) = acquire(4, false, t0 + ms(3000));
    pipeline.submit(fourth);
    let frames = write_all(&mut pipeline, t0 + ms(1200));
    let expected = Sent::Acquire {
        wait_s: 2,
        lease_s: 30,
        owner: 4,
        key: "k".into(),
    };
    assert_eq!(frames, vec![expected]);
}

#[test]
fn a_queued_request_found_expired_by_the_writer_is_not_sent() {
    let t0 = Instant::now();
    let mut pipeline = established();
    let (call, rx) = acquire(OWNER, false, t0 + ms(100));
    pipeline.submit(call);
    assert!(pipeline.output(t0 + ms(100)).bytes().is_empty());
    assert_eq!(rx.try_recv(), Ok(Outcome::Expired { established: true }));
}

#[test]
fn an_encoded_frame_the_socket_did_not_take_never_outlives_its_write_attempt() {
    let t0 = Instant::now();
    let mut pipeline = established();
    let (call, rx) = acquire(OWNER, false, t0 + ms(100));
    pipeline.submit(call);
    {
        let output = pipeline.output(t0);
        assert!(!output.bytes().is_empty());
        // The socket took nothing (it would block): the guard ends without `handed`.
    }
    pipeline.handle_deadlines(t0 + ms(100));
    assert_eq!(rx.try_recv(), Ok(Outcome::Expired { established: true }));
    assert!(
        pipeline.output(t0 + ms(100)).bytes().is_empty(),
        "a caller told Expired: its bytes never reach the socket"
    );
}

#[test]
fn after_a_partial_write_only_the_started_frame_stays_and_the_rest_is_encoded_afresh() {
    let t0 = Instant::now();
    let mut pipeline = established();
    let (first, _rx1) = acquire(1, false, t0 + ms(10_000));
    let (second, rx2) = acquire(2, false, t0 + ms(2_000));
    pipeline.submit(first);
    pipeline.submit(second);
    write_some(&mut pipeline, t0, 5);
    // The second frame went back to the queue: its deadline passes before the next write.
    pipeline.handle_deadlines(t0 + ms(2_000));
    assert_eq!(rx2.try_recv(), Ok(Outcome::Expired { established: true }));
    let mut output = pipeline.output(t0 + ms(2_500));
    let rest = output.bytes().to_vec();
    assert_eq!(rest.len(), 12 + 1 - 5, "only the rest of the started frame");
    output.handed(rest.len());
}

#[test]
fn a_frame_partly_handed_is_never_encoded_again_even_when_the_next_write_takes_nothing() {
    let t0 = Instant::now();
    let mut pipeline = established();
    let (first, _rx1) = acquire(1, false, t0 + ms(10_000));
    pipeline.submit(first);
    let mut wire = Vec::new();
    let mut output = pipeline.output(t0);
    wire.extend_from_slice(&output.bytes()[..5]);
    output.handed(5);
    drop(output);
    let (second, _rx2) = acquire(2, false, t0 + ms(10_000));
    pipeline.submit(second);
    assert_eq!(
        write_some(&mut pipeline, t0, 0),
        13 - 5 + 13,
        "the rest, then the next"
    );
    assert_eq!(
        write_some(&mut pipeline, t0, 0),
        13 - 5 + 13,
        "nothing encoded twice"
    );
    let mut output = pipeline.output(t0 + ms(1));
    wire.extend_from_slice(output.bytes());
    output.handed(13 - 5 + 13);
    drop(output);
    let owners: Vec<u64> = decode(&wire)
        .into_iter()
        .map(|frame| match frame {
            Sent::Acquire { owner, .. } => owner,
            other => panic!("{other:?}"),
        })
        .collect();
    assert_eq!(owners, [1, 2], "the stream is the two frames, each once");
}

#[test]
fn a_wait_zero_acquire_goes_out_with_wire_wait_zero() {
    let t0 = Instant::now();
    let mut pipeline = established();
    let (call, _rx) = acquire(OWNER, true, t0 + TRANSPORT);
    pipeline.submit(call);
    let frames = write_all(&mut pipeline, t0 + ms(4000));
    let expected = Sent::Acquire {
        wait_s: 0,
        lease_s: 30,
        owner: OWNER,
        key: "k".into(),
    };
    assert_eq!(frames, vec![expected]);
}
