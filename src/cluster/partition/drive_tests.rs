//! A member stops, with a line naming what and where, when it cannot keep its state equal to
//! the other replicas': a committed entry that does not decode, a write-ahead log sync that
//! failed.

use crate::cluster::mem_durable::{MemDurable, SyncMode};
use crate::cluster::mem_writer::MemWriter;
use crate::cluster::member::{Envelope, Member};
use crate::cluster::partition::{ClusterPartition, PartitionSettings, Peers};
use crate::cluster::Recovered;
use crate::partition::Partition;
use raft::eraftpb::{Entry, HardState, Message};

/// No other member: a one-member cluster is its own majority.
struct Alone;

impl Peers for Alone {
    fn send(&mut self, _batch: Vec<Envelope>) {}

    fn try_recv(&mut self) -> Option<(u32, Message)> {
        None
    }
}

fn partition(
    durable: MemDurable,
    recovered: Vec<(u32, Recovered)>,
) -> ClusterPartition<MemWriter, Alone> {
    let writer = MemWriter::immediate(durable);
    let member = Member::new(1, &[1], &[0], writer, recovered, 5).expect("a member");
    let settings = PartitionSettings {
        node_id: 1,
        shards: 1,
        core: 0,
        cores: 1,
        clients: vec![(1, "127.0.0.1:7420".parse().expect("an address"))],
        max_waiters_per_key: 16,
        max_keys_per_shard: 1000,
        max_pending_per_session: 16,
        compact_every: 1000,
    };
    ClusterPartition::new(settings, member, Alone)
}

/// Runs the partition's timers every 10 ms of its clock until it panics (or 5 s pass);
/// returns the panic's message.
fn run_until_it_stops(mut partition: ClusterPartition<MemWriter, Alone>) -> String {
    let outcome = std::panic::catch_unwind(std::panic::AssertUnwindSafe(move || {
        for step in 1..=500u64 {
            partition.handle_timers(step * 10_000);
        }
    }));
    let payload = outcome.expect_err("the member stops");
    match payload.downcast::<String>() {
        Ok(message) => *message,
        Err(payload) => payload
            .downcast_ref::<&str>()
            .expect("a message")
            .to_string(),
    }
}

#[test]
fn a_committed_entry_that_does_not_decode_stops_the_member_naming_shard_and_index() {
    let entry = Entry {
        index: 1,
        term: 1,
        data: vec![0xff, 0, 1].into(),
        ..Default::default()
    };
    let recovered = Recovered {
        hard_state: HardState {
            term: 1,
            vote: 1,
            commit: 1,
            ..Default::default()
        },
        snapshot: None,
        entries: vec![entry],
    };
    let stopped = run_until_it_stops(partition(MemDurable::new(), vec![(0, recovered)]));
    assert!(
        stopped.contains("shard 0: committed entry 1 (term 1) does not decode"),
        "{stopped}"
    );
}

#[test]
fn a_failed_log_sync_stops_the_member_naming_the_operation() {
    let mut durable = MemDurable::new();
    durable.set_sync_mode(SyncMode::Fail);
    // The member elects itself, appends its first entries, and its writer syncs them: that
    // fails, and the next drain learns it.
    let stopped = run_until_it_stops(partition(durable, Vec::new()));
    assert!(
        stopped.contains("core 0: syncing the write-ahead log failed: sync failed (injected)"),
        "{stopped}"
    );
}
