//! The single node's limits on a real cluster partition: one-member groups (a member is its
//! own majority, so it elects itself and serves) over a [`MemWriter`], driven on virtual time.
//! `max_keys` per shard counts grants in flight; `max_pending_per_session` counts only acquires
//! that queue, on one partition and across two sharing counts, and every way out of a queue
//! gives the place back.

use super::super::{ClusterPartition, PartitionSettings, Peers, COMPACT_EVERY};
use crate::cluster::mem_durable::MemDurable;
use crate::cluster::mem_writer::MemWriter;
use crate::cluster::member::{Envelope, Member};
use crate::lock_table::{Answer, BusyReason, Op, QueueCounts, SessionId};
use crate::protocol::Response;
use crate::server::core::session_id;
use crate::server::partition::Partition;
use crate::server::queued::SessionQueues;
use raft::eraftpb::Message;
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
        self.partition.handle(self.now_us, session, op, key);
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
    match *response {
        Response::Acquired { owner, .. }
        | Response::Timeout { owner }
        | Response::Busy { owner } => owner,
        Response::Released { token } | Response::Extended { token } => token,
        Response::NotHeld { token } => token,
        Response::Moved { id, .. } => id,
        Response::State { nonce, .. } | Response::Pong { nonce } => nonce,
        Response::Error { id, .. } => id,
    }
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
    bench.partition.handle_session_closed(waiter);
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
    // The release applies and proposes the waiter's grant; before it applies, the waiter's
    // session closes: its place is back at once (a server frees the session's slot next).
    bench.send(1, Op::Release { token }, key);
    let head_proposed = |bench: &Bench| {
        let queue = bench.partition.shards[0].queues.get(&key[..]);
        queue
            .and_then(|queue| queue.front())
            .is_some_and(|head| head.proposed)
    };
    for _ in 0..20 {
        bench.step();
        if head_proposed(&bench) {
            break;
        }
    }
    assert_eq!(bench.answer(token), Response::Released { token });
    assert!(head_proposed(&bench), "the grant is in flight");
    bench.partition.handle_session_closed(2);
    assert_eq!(bench.places(), 0);
    // The grant applies for nobody and is released: the key is free for the next session.
    bench.settle();
    assert!(bench.answers.is_empty(), "{:?}", bench.answers);
    bench.hold(3, key, 3);
}

#[test]
fn max_pending_per_session_holds_across_partitions_that_share_counts() {
    let limits = || Limits {
        keys_per_shard: 1000,
        pending_per_session: 2,
    };
    let counts = Arc::new(SessionQueues::new(2, 16));
    let mut cores: Vec<Bench> = (0..2)
        .map(|core| Bench::new(4, core, 2, limits()))
        .collect();
    for bench in &mut cores {
        bench
            .partition
            .share_queue_counts(Arc::clone(&counts) as Arc<dyn QueueCounts>);
    }
    let (holder, waiter) = (session_id(0, 1, 1), session_id(1, 2, 1));
    assert!(counts.admit(holder) && counts.admit(waiter));
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
        bench.partition.handle_session_closed(waiter);
    }
    assert_eq!(counts.queued(waiter), 0);
}
