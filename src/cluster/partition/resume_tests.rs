//! Tests of `resume.rs` on a one-member cluster (its own majority): what a Resolve answers.

use crate::cluster::mem_durable::MemDurable;
use crate::cluster::mem_writer::MemWriter;
use crate::cluster::member::Member;
use crate::cluster::partition::alone::{run, Alone};
use crate::cluster::partition::{ClusterPartition, PartitionSettings};
use crate::partition::{ClientRef, Fate, Op, Partition, SessionId};
use latchkey_client::protocol::Response;

/// A serving one-member partition, and its clock.
fn serving() -> (ClusterPartition<MemWriter, Alone>, u64) {
    let writer = MemWriter::immediate(MemDurable::new());
    let member = Member::new(1, &[1], &[0], writer, Vec::new(), 5).expect("a member");
    let settings = PartitionSettings::one_member();
    let mut partition = ClusterPartition::new(settings, member, Alone::default());
    let mut now_us = 0;
    run(&mut partition, &mut now_us, 100);
    assert!(partition.serving(0), "the one member serves");
    (partition, now_us)
}

const CLIENT: ClientRef = ClientRef(7);
const KEY: &[u8] = b"resumed";

fn acquire(owner: u64, wait_s: u8) -> Op {
    Op::Acquire {
        wait_s,
        lease_s: 30,
        owner,
    }
}

/// Resolves `owner` from `session`: answered at once, or (*granted*, after the renewal of
/// the hold) once the entry it proposed applied.
fn resolve(
    partition: &mut ClusterPartition<MemWriter, Alone>,
    now_us: &mut u64,
    session: SessionId,
    owner: u64,
) -> Response {
    partition.handle(*now_us, session, CLIENT, Op::Resolve { owner }, KEY);
    let answered = partition.take_answers().into_iter();
    let mut answers: Vec<_> = answered.map(|a| (a.session, a.response)).collect();
    for _ in 0..5 {
        if !answers.is_empty() {
            break;
        }
        answers = run(partition, now_us, 1);
    }
    assert_eq!(answers.len(), 1, "{answers:?}");
    assert_eq!(answers[0].0, session);
    answers[0].1
}

fn fate(response: Response) -> Fate {
    match response {
        Response::Resolved { fate, .. } => fate,
        other => panic!("not a Resolved: {other:?}"),
    }
}

#[test]
fn an_acquire_whose_session_closed_with_its_grant_in_the_log_is_attached_not_forgotten() {
    let (mut partition, mut now_us) = serving();
    // Proposed at once (a free key); its session closes before the entry applies.
    partition.handle(now_us, 1, CLIENT, acquire(1, 5), KEY);
    assert!(partition.take_answers().is_empty());
    partition.handle_session_closed(1, CLIENT);
    // The client asks on another session: the grant in the log is still its own.
    assert_eq!(
        fate(resolve(&mut partition, &mut now_us, 2, 1)),
        Fate::Queued
    );
    let answers = run(&mut partition, &mut now_us, 10);
    let granted: Vec<_> = answers
        .iter()
        .filter(|(_, r)| matches!(r, Response::Acquired { owner: 1, .. }))
        .collect();
    assert_eq!(granted.len(), 1, "{answers:?}");
    assert_eq!(granted[0].0, 2, "answered on the session that resolved it");
    // Held by it, and not released behind its back.
    let hold = partition
        .machine(0)
        .and_then(|m| m.holder(KEY))
        .map(|h| (h.owner, h.token));
    let (owner, token) = hold.expect("held");
    assert_eq!(owner, 1);
    // Asked again: granted, with its token.
    match resolve(&mut partition, &mut now_us, 2, 1) {
        Response::Resolved {
            fate: Fate::Granted,
            token: got,
            ..
        } => assert_eq!(got, token),
        other => panic!("{other:?}"),
    }
}

#[test]
fn a_grant_that_reached_no_session_is_kept_for_a_resolve_then_released_when_the_grace_ends() {
    let (mut partition, mut now_us) = serving();
    partition.handle(now_us, 1, CLIENT, acquire(1, 5), KEY);
    partition.handle_session_closed(1, CLIENT);
    // Nobody asked yet: the grant applies, and is kept for the client (no answer goes out).
    let answers = run(&mut partition, &mut now_us, 20);
    assert!(answers.is_empty(), "{answers:?}");
    let holder = partition
        .machine(0)
        .and_then(|m| m.holder(KEY))
        .map(|h| h.owner);
    assert_eq!(holder, Some(1), "kept for its client's grace");
    // The client's grace ends with no session: released, and never seen after.
    partition.handle_client_gone(now_us, CLIENT);
    run(&mut partition, &mut now_us, 20);
    let holder = partition
        .machine(0)
        .and_then(|m| m.holder(KEY))
        .map(|h| h.owner);
    assert_eq!(holder, None, "released at the end of the grace");
    assert_eq!(partition.stats().grace_releases, 1);
    assert_eq!(
        fate(resolve(&mut partition, &mut now_us, 2, 1)),
        Fate::NeverSeen
    );
    // Never seen is final: the same acquire, should it arrive, is refused.
    partition.handle(now_us, 2, CLIENT, acquire(1, 5), KEY);
    // (`run` takes what `handle` answered too.)
    let answers = run(&mut partition, &mut now_us, 5);
    assert!(
        answers
            .iter()
            .all(|(_, r)| !matches!(r, Response::Acquired { .. })),
        "{answers:?}"
    );
}

#[test]
fn a_grant_kept_for_its_client_is_granted_to_the_session_that_resolves_it() {
    let (mut partition, mut now_us) = serving();
    partition.handle(now_us, 1, CLIENT, acquire(1, 5), KEY);
    partition.handle_session_closed(1, CLIENT);
    run(&mut partition, &mut now_us, 20);
    let token = partition
        .machine(0)
        .and_then(|m| m.holder(KEY))
        .map(|h| h.token);
    let (sent_us, applied) = (now_us, partition.machine(0).map(|m| m.applied()));
    match resolve(&mut partition, &mut now_us, 2, 1) {
        Response::Resolved {
            fate: Fate::Granted,
            token: got,
            lease_ms,
            ..
        } => {
            assert_eq!(Some(got), token);
            assert!(lease_ms <= 30_000 && lease_ms > 29_000, "{lease_ms}");
            // The lease it reports was renewed by an entry proposed after the Resolve came,
            // so every member counts it from later than the Resolve's send.
            let hold = partition.machine(0).and_then(|m| m.holder(KEY)).cloned();
            let hold = hold.expect("held");
            assert!(Some(hold.renewed_at) > applied, "{hold:?}");
            assert!(hold.deadline_ms * 1_000 >= sent_us + u64::from(lease_ms) * 1_000);
        }
        other => panic!("{other:?}"),
    }
    // Delivered now: the end of the grace no longer releases it.
    partition.handle_client_gone(now_us, CLIENT);
    run(&mut partition, &mut now_us, 20);
    let holder = partition
        .machine(0)
        .and_then(|m| m.holder(KEY))
        .map(|h| h.token);
    assert_eq!(holder, token, "still held by the session that resolved it");
}

#[test]
fn a_waiter_whose_session_closed_keeps_its_place_for_a_resolve() {
    let (mut partition, mut now_us) = serving();
    partition.handle(now_us, 10, ClientRef::NONE, acquire(100, 0), KEY);
    let answers = run(&mut partition, &mut now_us, 5);
    let holder_token = match answers[..] {
        [(10, Response::Acquired { token, .. })] => token,
        _ => panic!("{answers:?}"),
    };
    // The client's waiter queues first, another behind it; the client's session closes.
    partition.handle(now_us, 1, CLIENT, acquire(1, 10), KEY);
    partition.handle(now_us, 3, ClientRef::NONE, acquire(2, 10), KEY);
    partition.handle_session_closed(1, CLIENT);
    assert!(run(&mut partition, &mut now_us, 5).is_empty());
    // Resolved from another session: still queued, in its place, now that session's.
    assert_eq!(
        fate(resolve(&mut partition, &mut now_us, 2, 1)),
        Fate::Queued
    );
    let release = Op::Release {
        token: holder_token,
    };
    partition.handle(now_us, 10, ClientRef::NONE, release, KEY);
    let answers = run(&mut partition, &mut now_us, 10);
    let granted: Vec<_> = answers
        .iter()
        .filter_map(|(session, r)| match r {
            Response::Acquired { owner, .. } => Some((*session, *owner)),
            _ => None,
        })
        .collect();
    assert_eq!(
        granted,
        vec![(2, 1)],
        "the first in line, on the session that resolved it"
    );
}

#[test]
fn a_detached_waiter_leaves_when_its_clients_grace_ends() {
    let (mut partition, mut now_us) = serving();
    partition.handle(now_us, 10, ClientRef::NONE, acquire(100, 0), KEY);
    let answers = run(&mut partition, &mut now_us, 5);
    let holder_token = match answers[..] {
        [(10, Response::Acquired { token, .. })] => token,
        _ => panic!("{answers:?}"),
    };
    partition.handle(now_us, 1, CLIENT, acquire(1, 10), KEY);
    partition.handle(now_us, 3, ClientRef::NONE, acquire(2, 10), KEY);
    partition.handle_session_closed(1, CLIENT);
    partition.handle_client_gone(now_us, CLIENT);
    let release = Op::Release {
        token: holder_token,
    };
    partition.handle(now_us, 10, ClientRef::NONE, release, KEY);
    let answers = run(&mut partition, &mut now_us, 10);
    assert!(
        answers
            .iter()
            .any(|(session, r)| *session == 3 && matches!(r, Response::Acquired { owner: 2, .. })),
        "the next in line gets it: {answers:?}"
    );
    assert_eq!(
        fate(resolve(&mut partition, &mut now_us, 2, 1)),
        Fate::NeverSeen
    );
}

#[test]
fn a_proposed_acquire_answered_timeout_is_not_attached_and_resolves_as_timed_out() {
    let (mut partition, mut now_us) = serving();
    // Held by another; the client's waiter queues behind it with a 1 s wait.
    partition.handle(now_us, 10, ClientRef::NONE, acquire(100, 0), KEY);
    let answers = run(&mut partition, &mut now_us, 5);
    assert!(
        matches!(answers[..], [(10, Response::Acquired { .. })]),
        "{answers:?}"
    );
    partition.handle(now_us, 1, CLIENT, acquire(1, 1), KEY);
    let answers = run(&mut partition, &mut now_us, 120);
    assert!(
        matches!(answers[..], [(1, Response::Timeout { owner: 1 })]),
        "{answers:?}"
    );
    partition.handle_session_closed(1, CLIENT);
    assert_eq!(
        fate(resolve(&mut partition, &mut now_us, 2, 1)),
        Fate::TimedOut
    );
}
