//! Tests of `mirror.rs` on a one-member cluster (its own majority) that restarts from its log:
//! the restarted member is a new leader, which adopts the queues its predecessor mirrored.

use crate::cluster::mem_durable::MemDurable;
use crate::cluster::mem_writer::MemWriter;
use crate::cluster::member::Member;
use crate::cluster::partition::alone::{run, Alone};
use crate::cluster::partition::{ClusterPartition, PartitionSettings};
use crate::partition::{ClientRef, Fate, Op, Partition, SessionId};
use latchkey_client::protocol::Response;

type Subject = ClusterPartition<MemWriter, Alone>;

const ALICE: ClientRef = ClientRef(7);
const BOB: ClientRef = ClientRef(8);
const KEY: &[u8] = b"mirrored";

/// A one-member partition on `durable`'s log (empty, or what a crash left), its clients
/// identified (`(client, id, grace_s)`), run until it serves.
fn start(
    durable: MemDurable,
    version: u8,
    clients: &[(ClientRef, u128, u8)],
    now_us: &mut u64,
) -> Subject {
    let recovered = durable.recovered();
    let writer = MemWriter::immediate(durable);
    let member = Member::new(1, &[1], &[0], writer, recovered, 5).expect("a member");
    let settings = PartitionSettings::one_member();
    let mut partition = ClusterPartition::new(settings, member, Alone { version });
    for &(client, id, grace_s) in clients {
        partition.handle_client_known(client, id, grace_s);
    }
    run(&mut partition, now_us, 100);
    assert!(partition.serving(0), "the one member serves");
    partition
}

/// The same member after a crash: a new partition on what its log kept, at cluster `version`.
fn restart(partition: Subject, version: u8, now_us: &mut u64) -> Subject {
    let durable = partition.member().writer().durable().clone();
    drop(partition);
    start(durable, version, &CLIENTS, now_us)
}

const CLIENTS: [(ClientRef, u128, u8); 2] = [(ALICE, 0xA11CE, 10), (BOB, 0xB0B, 2)];

/// Sends `op` on `session` of `client`; returns the answers given at once.
fn send(
    partition: &mut Subject,
    now_us: u64,
    (session, client): (SessionId, ClientRef),
    op: Op,
) -> Vec<Response> {
    partition.handle(now_us, session, client, op, KEY);
    partition
        .take_answers()
        .into_iter()
        .map(|a| a.response)
        .collect()
}

fn acquire(owner: u64, wait_s: u8) -> Op {
    Op::Acquire {
        wait_s,
        lease_s: 30,
        owner,
    }
}

fn queued_owners(partition: &Subject) -> Vec<u64> {
    let machine = partition.machine(0).expect("the shard");
    machine
        .waiting()
        .map(|(_, waiter)| waiter.queued.owner)
        .collect()
}

fn holder(partition: &Subject) -> Option<(u64, u64)> {
    let machine = partition.machine(0).expect("the shard");
    machine.holder(KEY).map(|hold| (hold.owner, hold.token))
}

/// Alice holds KEY (owner 1); Bob (owner 2), then Alice (owner 3) queue behind her, and the
/// leader mirrors both.
fn held_with_two_waiters(now_us: &mut u64) -> (Subject, u64) {
    let mut partition = start(
        MemDurable::new(),
        super::WAITERS_PEER_VERSION,
        &CLIENTS,
        now_us,
    );
    assert!(send(&mut partition, *now_us, (1, ALICE), acquire(1, 5)).is_empty());
    let answers = run(&mut partition, now_us, 5);
    let token = match answers.as_slice() {
        [(1, Response::Acquired { owner: 1, token })] => *token,
        other => panic!("{other:?}"),
    };
    assert!(send(&mut partition, *now_us, (2, BOB), acquire(2, 20)).is_empty());
    assert!(send(&mut partition, *now_us, (3, ALICE), acquire(3, 20)).is_empty());
    assert!(run(&mut partition, now_us, 5).is_empty());
    assert_eq!(queued_owners(&partition), [2, 3], "both mirrored, in order");
    (partition, token)
}

#[test]
fn a_new_leader_keeps_each_waiter_in_its_place_for_a_resolve_or_the_same_acquire_sent_again() {
    let mut now_us = 0;
    let (partition, token) = held_with_two_waiters(&mut now_us);
    let mut partition = restart(partition, super::WAITERS_PEER_VERSION, &mut now_us);
    assert_eq!(partition.stats().adopted, 2);
    assert_eq!(
        holder(&partition),
        Some((1, token)),
        "the hold is replicated state"
    );
    // Bob asks what became of his acquire: queued, on the session that asks.
    let asked = send(&mut partition, now_us, (10, BOB), Op::Resolve { owner: 2 });
    assert!(
        matches!(
            asked.as_slice(),
            [Response::Resolved {
                owner: 2,
                fate: Fate::Queued,
                ..
            }]
        ),
        "{asked:?}"
    );
    // Alice's acquire was answered `M` (say) and she sends it again: attached, not queued anew.
    assert!(send(&mut partition, now_us, (11, ALICE), acquire(3, 20)).is_empty());
    assert_eq!(queued_owners(&partition), [2, 3], "no second Enqueue");
    // The holder releases: Bob first, then Alice, each on the session that took it over.
    let released = send(&mut partition, now_us, (12, ALICE), Op::Release { token });
    assert!(released.is_empty());
    let answers = run(&mut partition, &mut now_us, 5);
    let bob = answers
        .iter()
        .find_map(|(session, response)| match response {
            Response::Acquired { owner: 2, token } => Some((*session, *token)),
            _ => None,
        });
    let (session, bob_token) = bob.unwrap_or_else(|| panic!("Bob is granted: {answers:?}"));
    assert_eq!(session, 10);
    assert!(bob_token > token);
    assert_eq!(
        queued_owners(&partition),
        [3],
        "the grant took Bob out of the replicated queue"
    );
    assert!(send(
        &mut partition,
        now_us,
        (10, BOB),
        Op::Release { token: bob_token }
    )
    .is_empty());
    let answers = run(&mut partition, &mut now_us, 5);
    let alice = answers.iter().any(|(session, response)| {
        *session == 11 && matches!(response, Response::Acquired { owner: 3, .. })
    });
    assert!(alice, "Alice is granted on her new session: {answers:?}");
    assert!(queued_owners(&partition).is_empty());
}

#[test]
fn an_adopted_waiter_nobody_takes_leaves_at_its_grace_end_and_its_grant_is_released_then() {
    let mut now_us = 0;
    let (partition, token) = held_with_two_waiters(&mut now_us);
    // The new leader adopts at its promotion, after this.
    let adopted_after_us = now_us;
    let mut partition = restart(partition, super::WAITERS_PEER_VERSION, &mut now_us);
    // The holder releases at once: Bob (grace 2 s) is granted, and nobody takes the grant.
    assert!(send(&mut partition, now_us, (12, ALICE), Op::Release { token }).is_empty());
    run(&mut partition, &mut now_us, 5);
    let (owner, bob_token) = holder(&partition).expect("handed to Bob");
    assert_eq!(owner, 2);
    // Kept until Bob's grace ends (never early), then released: Alice's waiter is next.
    while now_us < adopted_after_us + 1_990_000 {
        run(&mut partition, &mut now_us, 10);
        assert_eq!(
            holder(&partition).map(|h| h.1),
            Some(bob_token),
            "kept for a Resolve"
        );
    }
    run(&mut partition, &mut now_us, 130);
    assert_ne!(
        holder(&partition).map(|h| h.1),
        Some(bob_token),
        "released at its grace end"
    );
    assert_eq!(partition.stats().grace_releases, 1);
    assert_eq!(
        holder(&partition).map(|h| h.0),
        Some(3),
        "Alice's adopted waiter next"
    );
    // Alice (grace 10 s) never comes back: her grant goes too, within her grace.
    run(&mut partition, &mut now_us, 1_100);
    assert_eq!(holder(&partition), None);
    assert!(queued_owners(&partition).is_empty());
}

#[test]
fn a_waiter_of_a_session_that_did_not_identify_or_of_an_older_cluster_is_not_mirrored() {
    let mut now_us = 0;
    let version = super::WAITERS_PEER_VERSION;
    let mut partition = start(MemDurable::new(), version, &CLIENTS, &mut now_us);
    assert!(send(&mut partition, now_us, (1, ALICE), acquire(1, 5)).is_empty());
    run(&mut partition, &mut now_us, 5);
    // Not identified: leader-local only.
    assert!(send(&mut partition, now_us, (2, ClientRef::NONE), acquire(2, 20)).is_empty());
    run(&mut partition, &mut now_us, 5);
    assert!(queued_owners(&partition).is_empty());
    // A cluster with a member of the previous build: nothing is mirrored.
    let mut now_us = 0;
    let mut old = start(
        MemDurable::new(),
        super::WAITERS_PEER_VERSION - 1,
        &CLIENTS,
        &mut now_us,
    );
    assert!(send(&mut old, now_us, (1, ALICE), acquire(1, 5)).is_empty());
    run(&mut old, &mut now_us, 5);
    assert!(send(&mut old, now_us, (2, BOB), acquire(2, 20)).is_empty());
    run(&mut old, &mut now_us, 5);
    assert!(queued_owners(&old).is_empty());
    // A waiter that leaves (its Cancel) is withdrawn from the replicated queue.
    assert!(send(&mut partition, now_us, (3, BOB), acquire(3, 20)).is_empty());
    run(&mut partition, &mut now_us, 5);
    assert_eq!(queued_owners(&partition), [3]);
    let cancelled = send(&mut partition, now_us, (3, BOB), Op::Cancel { owner: 3 });
    assert!(cancelled.is_empty(), "T once withdrawn: {cancelled:?}");
    let answers = run(&mut partition, &mut now_us, 5);
    assert_eq!(answers, [(3, Response::Timeout { owner: 3 })]);
    assert!(queued_owners(&partition).is_empty(), "withdrawn");
}

#[test]
fn a_new_leader_answers_a_resolve_of_a_waiter_its_predecessor_answered_t_as_timed_out() {
    for version in [super::ANSWERED_PEER_VERSION, super::WAITERS_PEER_VERSION] {
        let mut now_us = 0;
        let mut partition = start(MemDurable::new(), version, &CLIENTS, &mut now_us);
        assert!(send(&mut partition, now_us, (1, ALICE), acquire(1, 5)).is_empty());
        run(&mut partition, &mut now_us, 5);
        // Bob's wait (1 s) runs out, and Alice cancels hers: both mirrored, both answered `T`.
        assert!(send(&mut partition, now_us, (2, BOB), acquire(2, 1)).is_empty());
        assert!(send(&mut partition, now_us, (3, ALICE), acquire(3, 20)).is_empty());
        run(&mut partition, &mut now_us, 5);
        assert_eq!(queued_owners(&partition), [2, 3], "both mirrored");
        let cancelled = send(&mut partition, now_us, (3, ALICE), Op::Cancel { owner: 3 });
        assert!(cancelled.is_empty(), "T once withdrawn: {cancelled:?}");
        let answers = run(&mut partition, &mut now_us, 110);
        assert!(
            answers.contains(&(3, Response::Timeout { owner: 3 })),
            "Alice's Cancel: {answers:?}"
        );
        assert!(
            answers.contains(&(2, Response::Timeout { owner: 2 })),
            "Bob's wait ran out: {answers:?}"
        );
        assert!(queued_owners(&partition).is_empty(), "both withdrawn");
        // The leader dies before either client read its `T`; the next one is asked.
        let mut partition = restart(partition, version, &mut now_us);
        let fate = |partition: &mut Subject, now_us, (session, client), owner| match send(
            partition,
            now_us,
            (session, client),
            Op::Resolve { owner },
        )
        .as_slice()
        {
            [Response::Resolved { fate, .. }] => *fate,
            other => panic!("{other:?}"),
        };
        let bob = fate(&mut partition, now_us, (10, BOB), 2);
        let alice = fate(&mut partition, now_us, (11, ALICE), 3);
        if version >= super::ANSWERED_PEER_VERSION {
            assert_eq!(
                (bob, alice),
                (Fate::TimedOut, Fate::TimedOut),
                "replicated fates"
            );
        } else {
            // An older cluster: the fates were the dead leader's alone.
            assert_eq!((bob, alice), (Fate::NeverSeen, Fate::NeverSeen));
        }
        // Nobody else's: Alice asking about Bob's acquire hears nothing of it.
        assert_eq!(
            fate(&mut partition, now_us, (11, ALICE), 2),
            Fate::NeverSeen
        );
    }
}

#[test]
fn a_resolve_waits_for_the_withdraw_in_flight_of_a_waiter_that_left_the_leaders_queue() {
    let mut now_us = 0;
    let version = super::ANSWERED_PEER_VERSION;
    let mut partition = start(MemDurable::new(), version, &CLIENTS, &mut now_us);
    assert!(send(&mut partition, now_us, (1, ALICE), acquire(1, 5)).is_empty());
    run(&mut partition, &mut now_us, 5);
    // Bob queues for 1 s and is mirrored; then the leader dies, and the next one adopts him.
    assert!(send(&mut partition, now_us, (2, BOB), acquire(2, 1)).is_empty());
    run(&mut partition, &mut now_us, 5);
    assert_eq!(queued_owners(&partition), [2]);
    let mut partition = restart(partition, version, &mut now_us);
    assert_eq!(partition.stats().adopted, 1);
    // Its disk stalls, and the adopted wait runs out meanwhile: the waiter leaves this
    // leader's queue, and its `Withdraw` is proposed but cannot commit.
    partition.member_mut().writer_mut().set_immediate(false);
    run(&mut partition, &mut now_us, 120);
    assert_eq!(queued_owners(&partition), [2], "the Withdraw is in flight");
    // Bob asks: not "never seen" (a later leader, without the Withdraw, would adopt and may
    // grant him), nor anything else yet — the answer waits for the entry.
    assert!(send(&mut partition, now_us, (10, BOB), Op::Resolve { owner: 2 }).is_empty());
    assert!(run(&mut partition, &mut now_us, 5).is_empty());
    partition.member_mut().writer_mut().set_immediate(true);
    let answers = run(&mut partition, &mut now_us, 5);
    assert!(
        only_resolved(&answers, 10, (2, Fate::TimedOut)),
        "answered from the replicated record once it applied: {answers:?}"
    );
    assert!(queued_owners(&partition).is_empty());
}

#[test]
fn a_mirrored_waiter_that_leaves_is_answered_once_its_withdraw_applies() {
    let mut now_us = 0;
    let version = super::ANSWERED_PEER_VERSION;
    let mut partition = start(MemDurable::new(), version, &CLIENTS, &mut now_us);
    assert!(send(&mut partition, now_us, (1, ALICE), acquire(1, 5)).is_empty());
    run(&mut partition, &mut now_us, 5);
    assert!(send(&mut partition, now_us, (2, BOB), acquire(2, 20)).is_empty());
    assert!(send(&mut partition, now_us, (3, BOB), acquire(3, 1)).is_empty());
    run(&mut partition, &mut now_us, 5);
    assert_eq!(queued_owners(&partition), [2, 3], "both mirrored");
    // The disk stalls: Bob cancels one acquire and the other's wait runs out. Both leave
    // this leader's queue, but until their `Withdraw` commits a later leader would adopt and
    // could grant them: no `T` yet.
    partition.member_mut().writer_mut().set_immediate(false);
    assert!(send(&mut partition, now_us, (2, BOB), Op::Cancel { owner: 2 }).is_empty());
    assert!(run(&mut partition, &mut now_us, 1_100).is_empty(), "held");
    assert_eq!(queued_owners(&partition), [2, 3], "in flight");
    partition.member_mut().writer_mut().set_immediate(true);
    let mut answers = run(&mut partition, &mut now_us, 5);
    answers.sort_by_key(|(session, _)| *session);
    assert_eq!(
        answers,
        [
            (2, Response::Timeout { owner: 2 }),
            (3, Response::Timeout { owner: 3 })
        ]
    );
    assert!(queued_owners(&partition).is_empty());
}

#[test]
fn a_resolve_waits_for_a_held_answer_whose_session_closed() {
    let mut now_us = 0;
    let version = super::ANSWERED_PEER_VERSION;
    let mut partition = start(MemDurable::new(), version, &CLIENTS, &mut now_us);
    // The disk stalls; Bob's acquire finds the key free, and its `Acquire` is in flight when
    // his wait runs out: its `T` is held (the entry may still grant it). His connection drops.
    partition.member_mut().writer_mut().set_immediate(false);
    assert!(send(&mut partition, now_us, (2, BOB), acquire(2, 1)).is_empty());
    assert!(run(&mut partition, &mut now_us, 1_100).is_empty(), "held");
    partition.handle_session_closed(2, BOB);
    // Bob asks on a new session: the `T` is not the fate until the entry decides.
    assert!(send(&mut partition, now_us, (10, BOB), Op::Resolve { owner: 2 }).is_empty());
    assert!(run(&mut partition, &mut now_us, 5).is_empty());
    partition.member_mut().writer_mut().set_immediate(true);
    let answers = run(&mut partition, &mut now_us, 20);
    assert!(
        only_resolved(&answers, 10, (2, Fate::TimedOut)),
        "decided once the grant was released, nothing to the closed session: {answers:?}"
    );
    assert_eq!(holder(&partition), None);
}

#[test]
fn a_head_proposed_when_its_member_stops_gets_busy_only_once_its_grant_is_undone() {
    let mut now_us = 0;
    let version = super::ANSWERED_PEER_VERSION;
    let mut partition = start(MemDurable::new(), version, &CLIENTS, &mut now_us);
    // The disk stalls; Bob's acquire finds the key free, and its `Acquire` is in flight when
    // the member is told to stop, with no other member up to hand the shard to.
    partition.member_mut().writer_mut().set_immediate(false);
    assert!(send(&mut partition, now_us, (2, BOB), acquire(2, 5)).is_empty());
    partition.handle_shutdown();
    // No `B` while the entry may still grant it.
    assert!(run(&mut partition, &mut now_us, 20).is_empty(), "held");
    assert!(partition.is_quiescent(), "the stop does not wait for it");
    // The disk comes back: the grant commits, nobody takes it, and it is released; only then
    // is Bob told `B`.
    partition.member_mut().writer_mut().set_immediate(true);
    let answers = run(&mut partition, &mut now_us, 20);
    assert_eq!(answers, [(2, Response::Busy { owner: 2 })]);
    assert_eq!(holder(&partition), None, "released before the B");
}

/// Whether `answers` is one Resolve's answer alone, to `session`: `owner`'s acquire `fate`.
fn only_resolved(
    answers: &[(SessionId, Response)],
    session: SessionId,
    (owner, fate): (u64, Fate),
) -> bool {
    matches!(
        answers,
        [(to, Response::Resolved { owner: of, fate: was, .. })]
            if *to == session && *of == owner && *was == fate
    )
}
