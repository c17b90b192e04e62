//! The single node's limits on a real cluster partition: one-member groups (a member is its
//! own majority, so it elects itself and serves) over a [`MemWriter`], driven on virtual time.
//! `max_keys` per shard counts grants in flight; `max_pending_per_session` counts only acquires
//! that queue, on one partition and across two sharing counts, and every way out of a queue
//! gives the place back.

use super::super::{ClusterPartition, PartitionSettings, Peers, COMPACT_EVERY};
use crate::cluster::mem_durable::MemDurable;
use crate::cluster::mem_writer::MemWriter;
use crate::cluster::member::{Envelope, Member};
use crate::partition::{Answer, BusyReason, ClientRef, Op, Partition, QueueCounts, SessionId};
use latchkey_client::protocol::Response;
use raft::eraftpb::Message;
use std::collections::HashMap;
use std::sync::Arc;

/// A one-member cluster has no peers.
struct NoPeers;

impl Peers for NoPeers {
    fn send(&mut self, _batch: Vec<Envelope>) {}

    fn try_recv(&mut self) -> Option<(u32, Message)> {
        None
    }
}

type OneMember = ClusterPartition<MemWriter, NoPeers>;

/// A partition with its clock: core `core` of `cores` of a one-member cluster of `shards`.
struct Bench {
    partition: OneMember,
    now_us: u64,
    answers: Vec<Answer>,
}

/// The limits a bench's partition enforces.
struct Limits {
    keys_per_shard: usize,
    pending_per_session: u32,
}

impl Bench {
    fn new(shards: u32, core: usize, cores: usize, limits: Limits) -> Bench {
        let hosted = super::super::shards_of_core(core, cores, shards);
        let writer = MemWriter::immediate(MemDurable::new());
        let member =
            Member::new(1, &[1], &hosted, writer, Vec::new(), 7).expect("a one-member member");
        let settings = PartitionSettings {
            node_id: 1,
            shards,
            core,
            cores,
            clients: vec![(1, "127.0.0.1:7420".parse().unwrap())],
            max_waiters_per_key: 8,
            max_keys_per_shard: limits.keys_per_shard,
            max_pending_per_session: limits.pending_per_session,
            compact_every: COMPACT_EVERY,
            tick_us: 1_000,
        };
        let mut bench = Bench {
            partition: ClusterPartition::new(settings, member, NoPeers),
            now_us: 1_000_000,
            answers: Vec::new(),
        };
        // Elections take 10–20 ticks of 10 ms; a few seconds of virtual time is ample.
        for _ in 0..5_000 {
            if hosted.iter().all(|&shard| bench.partition.serving(shard)) {
                return bench;
            }
            bench.step();
        }
        panic!("the one-member groups did not elect themselves");
    }

    /// One loop iteration, a millisecond later; keeps what it answered.
    fn step(&mut self) {
        self.now_us += 1000;
        self.partition.handle_timers(self.now_us);
        self.collect();
    }

    fn collect(&mut self) {
        let answers = self.partition.take_answers();
        self.answers.extend(answers.iter().copied());
        self.partition.return_answers(answers);
    }

    /// Iterations until nothing is left to commit.
    fn settle(&mut self) {
        for _ in 0..20 {
            self.step();
        }
    }

    fn send(&mut self, session: SessionId, op: Op, key: &[u8]) {
        self.partition
            .handle(self.now_us, session, ClientRef::NONE, op, key);
        self.collect();
    }

    fn acquire(&mut self, session: SessionId, key: &[u8], wait_s: u8, owner: u64) {
        let op = Op::Acquire {
            wait_s,
            lease_s: 60,
            owner,
        };
        self.send(session, op, key);
    }

    /// The answer to the request with correlation id `id`, taken out.
    fn answer(&mut self, id: u64) -> Response {
        let at = self
            .answers
            .iter()
            .position(|a| response_id(&a.response) == id);
        let at = at.unwrap_or_else(|| panic!("no answer for {id}: {:?}", self.answers));
        self.answers.remove(at).response
    }

    /// Acquires `key` for `session` (wait 0) and returns the token.
    fn hold(&mut self, session: SessionId, key: &[u8], owner: u64) -> u64 {
        self.acquire(session, key, 0, owner);
        self.settle();
        match self.answer(owner) {
            Response::Acquired { token, .. } => token,
            other => panic!("acquire of {key:?} answered {other:?}"),
        }
    }

    fn busy(&self, reason: BusyReason) -> u64 {
        self.partition.stats().busy.get(reason)
    }

    fn places(&self) -> usize {
        self.partition.places.held()
    }
}

fn response_id(response: &Response) -> u64 {
    response.correlation_id()
}

/// `count` keys of shard `shard` of `shards`.
fn keys_of_shard(shard: u32, shards: u32, count: usize) -> Vec<Vec<u8>> {
    (0..)
        .map(|n| format!("limits/{n}").into_bytes())
        .filter(|key| super::super::shard_of(key, shards) == shard)
        .take(count)
        .collect()
}

#[test]
fn max_keys_counts_holds_and_grants_in_flight_per_shard() {
    let limits = Limits {
        keys_per_shard: 2,
        pending_per_session: 16,
    };
    let mut bench = Bench::new(2, 0, 1, limits);
    let keys = keys_of_shard(0, 2, 4);
    // Three new keys in one burst: two proposals fill the shard's share before either applies.
    for (owner, key) in (1..=3).zip(&keys) {
        bench.acquire(10, key, 0, owner);
    }
    assert_eq!(bench.answer(3), Response::Busy { owner: 3 });
    assert_eq!(bench.busy(BusyReason::Keys), 1);
    bench.settle();
    assert!(matches!(bench.answer(1), Response::Acquired { .. }));
    let Response::Acquired { token, .. } = bench.answer(2) else {
        panic!("the second key is granted");
    };
    // Full: a new key is refused, with or without a wait; the other shard has its own share.
    bench.acquire(10, &keys[2], 5, 4);
    assert_eq!(bench.answer(4), Response::Busy { owner: 4 });
    let other = keys_of_shard(1, 2, 1);
    bench.hold(10, &other[0], 5);
    // A held key is not a new key: its acquires queue (and time out) as always.
    bench.acquire(11, &keys[0], 1, 6);
    bench.settle();
    assert!(bench.answers.is_empty(), "queued: {:?}", bench.answers);
    assert_eq!(bench.busy(BusyReason::Keys), 2);
    // A release makes room for a new key.
    bench.send(10, Op::Release { token }, &keys[1]);
    bench.settle();
    assert_eq!(bench.answer(token), Response::Released { token });
    bench.hold(10, &keys[3], 7);
}

#[test]
fn max_pending_per_session_counts_only_acquires_that_queue_and_they_give_their_places_back() {
    let limits = Limits {
        keys_per_shard: 1000,
        pending_per_session: 2,
    };
    let mut bench = Bench::new(4, 0, 1, limits);
    let keys: Vec<Vec<u8>> = (0..4)
        .flat_map(|shard| keys_of_shard(shard, 4, 1))
        .collect();
    for (owner, key) in (100..).zip(&keys[..3]) {
        bench.hold(1, key, owner);
    }
    let waiter = 2;
    // Two acquires queue (on different shards); a third that would queue is refused.
    bench.acquire(waiter, &keys[0], 30, 1);
    bench.acquire(waiter, &keys[1], 30, 2);
    bench.acquire(waiter, &keys[2], 30, 3);
    bench.settle();
    assert_eq!(bench.answer(3), Response::Busy { owner: 3 });
    assert_eq!(bench.busy(BusyReason::PendingPerSession), 1);
    assert_eq!(bench.places(), 2);
    // An acquire of a free key (wait > 0 or not) is granted, never counted; another session
    // has places of its own.
    bench.acquire(waiter, &keys[3], 30, 4);
    bench.acquire(3, &keys[2], 30, 5);
    bench.settle();
    assert!(matches!(bench.answer(4), Response::Acquired { .. }));
    assert_eq!(bench.places(), 3);
    // A cancel gives a place back: the next one queues.
    bench.send(waiter, Op::Cancel { owner: 1 }, &keys[0]);
    assert_eq!(bench.answer(1), Response::Timeout { owner: 1 });
    bench.acquire(waiter, &keys[2], 30, 6);
    bench.settle();
    assert!(bench.answers.is_empty(), "{:?}", bench.answers);
    assert_eq!(bench.places(), 3);
    // A wait that runs out gives its place back too; so does a closed session.
    bench.acquire(3, &keys[0], 1, 7);
    for _ in 0..1_100 {
        bench.step();
    }
    assert_eq!(bench.answer(7), Response::Timeout { owner: 7 });
    assert_eq!(bench.places(), 3);
    bench
        .partition
        .handle_session_closed(waiter, ClientRef::NONE);
    assert_eq!(bench.places(), 1);
    bench.partition.check_places();
}

#[test]
fn a_proposed_waiter_gives_its_place_back_when_its_session_closes() {
    let limits = Limits {
        keys_per_shard: 1000,
        pending_per_session: 1,
    };
    let mut bench = Bench::new(1, 0, 1, limits);
    let key = b"limits/handover";
    let token = bench.hold(1, key, 1);
    bench.acquire(2, key, 30, 2);
    bench.settle();
    assert_eq!(bench.places(), 1);
    // The release carries the waiter's grant (one entry); before it applies, the waiter's
    // session closes: its place is back at once (a server frees the session's slot next).
    bench.send(1, Op::Release { token }, key);
    let head = bench.partition.shards[0].head_waiter(key);
    assert!(
        head.is_some_and(|head| head.proposed && head.handoff),
        "the grant is in flight"
    );
    bench.partition.handle_session_closed(2, ClientRef::NONE);
    assert_eq!(bench.places(), 0);
    // The release applies and grants the key to nobody, which is released: the key is free
    // for the next session.
    bench.settle();
    assert_eq!(bench.answer(token), Response::Released { token });
    assert!(bench.answers.is_empty(), "{:?}", bench.answers);
    bench.hold(3, key, 3);
}

#[test]
fn max_pending_per_session_holds_across_partitions_that_share_counts() {
    let limits = || Limits {
        keys_per_shard: 1000,
        pending_per_session: 2,
    };
    let counts = Arc::new(Counts::default());
    let mut cores: Vec<Bench> = (0..2)
        .map(|core| Bench::new(4, core, 2, limits()))
        .collect();
    for bench in &mut cores {
        bench
            .partition
            .share_queue_counts(Arc::clone(&counts) as Arc<dyn QueueCounts>);
    }
    let (holder, waiter) = (1, 2);
    // Shards 0 and 2 are core 0's, 1 and 3 core 1's.
    let keys: Vec<Vec<u8>> = (0..4)
        .flat_map(|shard| keys_of_shard(shard, 4, 1))
        .collect();
    for (shard, key) in keys.iter().enumerate() {
        cores[shard % 2].hold(holder, key, 100 + shard as u64);
    }
    cores[0].acquire(waiter, &keys[0], 30, 1);
    cores[1].acquire(waiter, &keys[1], 30, 2);
    cores[0].acquire(waiter, &keys[2], 30, 3);
    cores[1].acquire(waiter, &keys[3], 30, 4);
    for bench in &mut cores {
        bench.settle();
    }
    assert_eq!(cores[0].answer(3), Response::Busy { owner: 3 });
    assert_eq!(cores[1].answer(4), Response::Busy { owner: 4 });
    assert_eq!(counts.queued(waiter), 2);
    // Leaving on one core makes room on the other.
    cores[0].send(waiter, Op::Cancel { owner: 1 }, &keys[0]);
    assert_eq!(counts.queued(waiter), 1);
    cores[1].acquire(waiter, &keys[3], 30, 5);
    assert_eq!(counts.queued(waiter), 2);
    for bench in &mut cores {
        bench
            .partition
            .handle_session_closed(waiter, ClientRef::NONE);
    }
    assert_eq!(counts.queued(waiter), 0);
}

#[test]
fn a_wait_0_acquire_of_a_held_key_is_answered_t_without_an_entry() {
    let limits = Limits {
        keys_per_shard: 1000,
        pending_per_session: 16,
    };
    let mut bench = Bench::new(1, 0, 1, limits);
    let key = b"wait0/held".to_vec();
    let token = bench.hold(10, &key, 1);
    let proposals = |bench: &Bench| bench.partition.cluster_stats().map(|s| s.proposals);
    let before = proposals(&bench);
    bench.acquire(11, &key, 0, 2);
    assert_eq!(bench.answer(2), Response::Timeout { owner: 2 }, "at once");
    bench.settle();
    assert_eq!(proposals(&bench), before, "nothing proposed for it");
    assert!(
        bench.answers.is_empty(),
        "one answer only: {:?}",
        bench.answers
    );
    // Released, the key is granted to the next wait-0 acquire (through the log, as always).
    bench.send(10, Op::Release { token }, &key);
    bench.settle();
    assert_eq!(bench.answer(token), Response::Released { token });
    let next = bench.hold(11, &key, 3);
    assert!(next > token);
}

#[test]
fn a_head_with_its_grant_in_flight_is_the_holder_to_be_not_a_waiter() {
    let limits = Limits {
        keys_per_shard: 1000,
        pending_per_session: 16,
    };
    let mut bench = Bench::new(1, 0, 1, limits);
    bench.partition.settings.max_waiters_per_key = 1;
    let key = b"limits/in-flight";
    // An acquire of a free key is proposed; before it applies, one more queues behind it (as
    // behind the holder on a single node, which granted the first at once), and a third is
    // refused: that queue is full.
    bench.acquire(1, key, 5, 1);
    bench.acquire(2, key, 5, 2);
    bench.acquire(3, key, 5, 3);
    assert_eq!(bench.answer(3), Response::Busy { owner: 3 });
    bench.send(4, Op::Query { nonce: 9 }, key);
    bench.settle();
    let Response::Acquired { token, .. } = bench.answer(1) else {
        panic!("the first acquire holds the key");
    };
    let state = bench.answer(9);
    assert!(
        matches!(state, Response::State { waiters: 1, .. }),
        "{state:?}"
    );
    assert!(bench.answers.is_empty(), "2 waits: {:?}", bench.answers);
    // The same with a handoff in flight: the release carries 2's grant, and 4 queues behind.
    bench.send(1, Op::Release { token }, key);
    bench.acquire(3, key, 5, 4);
    bench.settle();
    assert_eq!(bench.answer(token), Response::Released { token });
    assert!(matches!(bench.answer(2), Response::Acquired { .. }));
    assert!(bench.answers.is_empty(), "4 waits: {:?}", bench.answers);
    assert_eq!(bench.partition.shards[0].queue_len(key), 1);
}

#[test]
fn a_head_handed_the_key_gives_its_place_back_with_the_entry_that_grants_it() {
    let limits = Limits {
        keys_per_shard: 1000,
        pending_per_session: 1,
    };
    let mut bench = Bench::new(1, 0, 1, limits);
    let keys: [&[u8]; 2] = [b"limits/first", b"limits/second"];
    let token = bench.hold(1, keys[0], 1);
    bench.hold(1, keys[1], 2);
    bench.acquire(2, keys[0], 30, 3);
    bench.settle();
    assert_eq!(bench.places(), 1);
    // The release carries 3's grant: on a single node 3 holds the key now and queues no more,
    // so its session may queue another acquire before the entry applies.
    bench.send(1, Op::Release { token }, keys[0]);
    assert_eq!(bench.places(), 0);
    bench.acquire(2, keys[1], 30, 4);
    bench.settle();
    assert_eq!(bench.answer(token), Response::Released { token });
    assert!(matches!(bench.answer(3), Response::Acquired { .. }));
    assert!(bench.answers.is_empty(), "4 waits: {:?}", bench.answers);
    assert_eq!(bench.places(), 1);
    bench.partition.check_places();
}

#[test]
fn a_head_whose_handoff_misses_waits_again_and_is_granted() {
    let limits = Limits {
        keys_per_shard: 1000,
        pending_per_session: 1,
    };
    let mut bench = Bench::new(1, 0, 1, limits);
    let (key, other): (&[u8], &[u8]) = (b"limits/miss", b"limits/other");
    let op = Op::Acquire {
        wait_s: 0,
        lease_s: 1,
        owner: 1,
    };
    bench.send(1, op, key);
    bench.settle();
    let Response::Acquired { token, .. } = bench.answer(1) else {
        panic!("the key is granted");
    };
    bench.hold(1, other, 2);
    // Past the lease, the leader proposes the expiry: in the log, not applied yet (a loop
    // iteration would apply it at once on one member; here the requests come in between).
    bench.now_us += 1_001_000;
    bench.partition.now_us = bench.now_us;
    bench.partition.fire_lease_timers();
    assert!(bench.partition.shards[0].expiring(token));
    assert!(bench.partition.shards[0].machine().holder(key).is_some());
    // 3 queues (the applied state holds the key) and the holder's release carries its grant.
    bench.acquire(2, key, 30, 3);
    bench.send(1, Op::Release { token }, key);
    let head = bench.partition.shards[0].head_waiter(key).cloned();
    assert!(head.is_some_and(|head| head.proposed && head.handoff));
    // Proposed, 3 is the holder to be: its session's place goes to 4.
    assert_eq!(bench.places(), 0);
    bench.acquire(2, other, 30, 4);
    assert_eq!(bench.places(), 1);
    bench.settle();
    // The expiry applied first, so the release freed nothing and granted nothing: 3 waited
    // again (uncounted: its session's place is 4's) and got the key by an Acquire of its own.
    assert_eq!(bench.answer(token), Response::NotHeld { token });
    assert!(matches!(bench.answer(3), Response::Acquired { .. }));
    assert!(bench.answers.is_empty(), "4 waits: {:?}", bench.answers);
    assert_eq!(bench.places(), 1);
    bench.partition.check_places();
}

#[test]
fn a_head_that_waits_again_takes_its_place_back() {
    let limits = Limits {
        keys_per_shard: 1000,
        pending_per_session: 1,
    };
    let mut bench = Bench::new(1, 0, 1, limits);
    let key: &[u8] = b"limits/again";
    let token = bench.hold(1, key, 1);
    bench.acquire(2, key, 30, 2);
    bench.send(1, Op::Release { token }, key);
    assert_eq!(bench.places(), 0, "proposed, 2 is the holder to be");
    // Its entry did not grant it the key (as when another entry took the key first): it
    // waits again, and counts again, while the applied state still shows the key held.
    bench.partition.head_missed(0, key);
    let head = bench.partition.shards[0].head_waiter(key).cloned();
    assert!(head.is_some_and(|head| !head.proposed && head.counted));
    assert_eq!(bench.places(), 1);
    bench.partition.check_places();
}

/// Queue counts shared by two cores' partitions, as a server's are (the server's own keeps
/// them per session slot; here a map is enough).
#[derive(Default)]
struct Counts(parking_lot::Mutex<HashMap<SessionId, u32>>);

impl Counts {
    fn queued(&self, session: SessionId) -> u32 {
        self.0.lock().get(&session).copied().unwrap_or(0)
    }
}

impl QueueCounts for Counts {
    fn try_add(&self, session: SessionId, max: u32) -> bool {
        let mut counts = self.0.lock();
        let count = counts.entry(session).or_insert(0);
        if *count >= max {
            return false;
        }
        *count += 1;
        true
    }

    fn remove(&self, session: SessionId) {
        let mut counts = self.0.lock();
        let count = counts
            .get_mut(&session)
            .expect("a queued acquire to remove");
        *count -= 1;
    }
}

/// Steps the bench's clock to `at_us`, a millisecond at a time.
fn run_until(bench: &mut Bench, at_us: u64) {
    while bench.now_us < at_us {
        bench.step();
    }
}

#[test]
fn lease_timers_follow_grants_extends_and_releases_and_never_fire_early() {
    let limits = Limits {
        keys_per_shard: 1000,
        pending_per_session: 8,
    };
    let mut bench = Bench::new(1, 0, 1, limits);
    let key: &[u8] = b"leases/extended";
    let op = Op::Acquire {
        wait_s: 0,
        lease_s: 1,
        owner: 1,
    };
    bench.send(1, op, key);
    bench.settle();
    let Response::Acquired { token, .. } = bench.answer(1) else {
        panic!("the key is granted");
    };
    let granted_us = bench.now_us;
    assert_eq!(
        bench.partition.shards[0].lease_timers(),
        1,
        "armed at the grant"
    );
    // Half a second in, a 2 s extend: the timer moves with the deadline.
    run_until(&mut bench, granted_us + 500_000);
    let extend = Op::Extend { lease_s: 2, token };
    bench.send(1, extend, key);
    bench.settle();
    assert_eq!(bench.answer(token), Response::Extended { token });
    let extended_us = bench.now_us;
    // Past the first lease, before the extended one: still held, no expiry in flight.
    run_until(&mut bench, extended_us + 1_900_000);
    assert!(!bench.partition.shards[0].expiring(token));
    assert!(bench.partition.shards[0].machine().holder(key).is_some());
    // Past the extended lease: expired, its timer gone.
    run_until(&mut bench, extended_us + 2_100_000);
    assert!(bench.partition.shards[0].machine().holder(key).is_none());
    assert_eq!(bench.partition.shards[0].lease_timers(), 0);
    // A release cancels the timer of the hold it ends.
    let token = bench.hold(1, key, 2);
    assert_eq!(bench.partition.shards[0].lease_timers(), 1);
    bench.send(1, Op::Release { token }, key);
    bench.settle();
    assert_eq!(bench.answer(token), Response::Released { token });
    assert_eq!(bench.partition.shards[0].lease_timers(), 0);
    assert!(bench.answers.is_empty(), "{:?}", bench.answers);
}
