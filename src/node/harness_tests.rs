//! The cores with a cluster member's partitions instead of lock tables, in the default shape of
//! this machine (two cores): the cross-core paths a cluster partition shares with the single
//! node — a session on one core waiting on a shard of the other, its close withdrawing that
//! waiter, and a grant answered to a session that died on its way back being released by the
//! core that finds the session gone.
//!
//! The member is a one-member cluster (it elects itself; no network), on the in-memory durable
//! image of the simulations: everything is replicated through Raft entries as in a server.

use crate::cluster::machine::ShardMachine;
use crate::cluster::mem_durable::MemDurable;
use crate::cluster::mem_writer::MemWriter;
use crate::cluster::member::{Envelope, Member};
use crate::cluster::partition::{
    shard_of, shards_of_core, ClusterPartition, PartitionSettings, Peers,
};
use crate::partition::Partition;
use crate::partition::QueueCounts;
use crate::server::harness::*;
use latchkey_client::protocol::{Request, Response};
use raft::eraftpb::Message;
use std::sync::Arc;

const SHARDS: u32 = 4;
const LIMITS: Limits = Limits {
    cores: 2,
    max_keys: 64,
    max_waiters_per_key: 4,
    max_pending_per_session: 8,
};
/// Unread bytes a reading client lets the server write.
const OPEN: usize = 1 << 20;
/// Loop iterations a request may take to be answered (propose, drain, apply, route back).
const ROUNDS_MAX: usize = 64;

/// A one-member cluster has nobody to talk to.
struct NoPeers;

impl Peers for NoPeers {
    fn send(&mut self, _batch: Vec<Envelope>) {}

    fn try_recv(&mut self) -> Option<(u32, Message)> {
        None
    }
}

type MemberHarness = Harness<ClusterPartition<MemWriter, NoPeers>>;

/// A one-member cluster of two cores whose every shard is served.
fn member() -> MemberHarness {
    let mut harness = Harness::with_partitions(LIMITS, |core, shared| {
        let shards = shards_of_core(core, LIMITS.cores, SHARDS);
        let writer = MemWriter::immediate(MemDurable::new());
        let member =
            Member::new(1, &[1], &shards, writer, Vec::new(), 7).expect("a one-member group");
        let settings = PartitionSettings {
            node_id: 1,
            shards: SHARDS,
            core,
            cores: LIMITS.cores,
            clients: vec![(1, "127.0.0.1:7420".parse().expect("address"))],
            max_waiters_per_key: LIMITS.max_waiters_per_key,
            max_keys_per_shard: LIMITS.max_keys,
            max_pending_per_session: LIMITS.max_pending_per_session,
            compact_every: 24,
            tick_us: 1_000,
        };
        let mut partition = ClusterPartition::new(settings, member, NoPeers);
        if let Some(queues) = &shared.queues {
            partition.share_queue_counts(Arc::clone(queues) as Arc<dyn QueueCounts>);
        }
        partition
    });
    // Elections take 10 to 20 ticks of 10 ms; then the barrier applies.
    for _ in 0..100 {
        harness.advance(10_000);
        harness.step_all(1);
        if (0..SHARDS).all(|shard| serving(&harness, shard)) {
            return harness;
        }
    }
    panic!("a one-member cluster serves every shard within a second");
}

fn serving(harness: &MemberHarness, shard: u32) -> bool {
    let core = shard as usize % LIMITS.cores;
    harness.cores[core].table().serving(shard)
}

fn machine<'h>(harness: &'h MemberHarness, key: &[u8]) -> &'h ShardMachine {
    let shard = shard_of(key, SHARDS);
    let core = shard as usize % LIMITS.cores;
    harness.cores[core].table().machine(shard).expect("hosted")
}

/// A key whose shard lives on `core`.
fn key_on(core: usize, n: usize) -> Vec<u8> {
    (0..)
        .map(|i| format!("key/{n}/{i}").into_bytes())
        .find(|key| shard_of(key, SHARDS) as usize % LIMITS.cores == core)
        .expect("some key")
}

/// Steps every core until `client` has an answer (bounded); the answers.
fn answers(harness: &mut MemberHarness, client: &mut Client) -> Vec<Response> {
    for _ in 0..ROUNDS_MAX {
        harness.step_all(1);
        let answers = harness.receive(client);
        if !answers.is_empty() {
            return answers;
        }
    }
    panic!("no answer within {ROUNDS_MAX} rounds");
}

fn acquire(key: &[u8], wait_s: u8, owner: u64) -> Request<'_> {
    Request::Acquire {
        wait_s,
        lease_s: 30,
        owner,
        key,
    }
}

/// Holds `key` from a session on `core`: the client and the token.
fn hold(harness: &mut MemberHarness, core: usize, key: &[u8]) -> (Client, u64) {
    let mut holder = harness.connect(core, OPEN);
    harness.send(&holder, &[acquire(key, 0, 1)]);
    match answers(harness, &mut holder)[..] {
        [Response::Acquired { owner: 1, token }] => (holder, token),
        ref other => panic!("not granted: {other:?}"),
    }
}

#[test]
fn a_waiter_on_another_core_is_withdrawn_when_its_session_closes() {
    let mut harness = member();
    let key = key_on(1, 0);
    let (mut holder, token) = hold(&mut harness, 0, &key);
    let mut waiter = harness.connect(0, OPEN);
    harness.send(&waiter, &[acquire(&key, 30, 2)]);
    harness.step_all(ROUNDS_MAX);
    assert!(
        harness.receive(&mut waiter).is_empty(),
        "queued behind the holder"
    );
    let shard_core = harness.cores[1].table();
    assert_eq!(shard_core.waiter_count(), 1);
    harness.reset(&waiter);
    harness.step_all(8);
    assert_eq!(
        harness.cores[1].table().waiter_count(),
        0,
        "withdrawn on the shard's core"
    );
    harness.send(&holder, &[Request::Release { token, key: &key }]);
    assert_eq!(
        answers(&mut harness, &mut holder),
        [Response::Released { token }]
    );
    harness.step_all(8);
    assert!(
        machine(&harness, &key).holder(&key).is_none(),
        "nobody got the key"
    );
    harness.check_queues();
}

#[test]
fn a_grant_whose_session_died_on_its_way_back_is_released_by_the_cores() {
    let mut harness = member();
    let key = key_on(1, 1);
    let (mut holder, token) = hold(&mut harness, 1, &key);
    let waiter = harness.connect(0, OPEN);
    harness.send(&waiter, &[acquire(&key, 30, 2)]);
    harness.step_all(ROUNDS_MAX);
    harness.send(&holder, &[Request::Release { token, key: &key }]);
    // Only the shard's core runs: the release commits and the waiter's grant with it; its `A`
    // waits in the channel to core 0.
    let mut granted = None;
    for _ in 0..ROUNDS_MAX {
        harness.step(1);
        granted = machine(&harness, &key).holder(&key).map(|hold| hold.token);
        if granted.is_some_and(|t| t != token) {
            break;
        }
    }
    let granted = granted.expect("the waiter's grant applied");
    assert_ne!(granted, token);
    assert_eq!(harness.receive(&mut holder), [Response::Released { token }]);
    // The waiter's session dies before its core handles the `A`.
    harness.reset(&waiter);
    for _ in 0..ROUNDS_MAX {
        harness.step_all(1);
        if machine(&harness, &key).holder(&key).is_none() {
            break;
        }
    }
    assert!(
        machine(&harness, &key).holder(&key).is_none(),
        "the undelivered grant {granted} was released"
    );
    // The key is free for anyone now.
    let (_, next) = hold(&mut harness, 0, &key);
    assert!(next > granted);
    harness.check_queues();
}
