//! Tests of `raft_io.rs` and `apply.rs`. A member stops, with a line naming what and where, when it cannot keep its state equal to
//! the other replicas': a committed entry that does not decode, a write-ahead log sync that
//! failed.

use crate::cluster::compactor::{Compactor, MemCompactor, RestoreJob, Restored};
use crate::cluster::machine::{Frozen, ShardMachine};
use crate::cluster::mem_durable::{MemDurable, SyncMode};
use crate::cluster::mem_writer::MemWriter;
use crate::cluster::member::Member;
use crate::cluster::partition::alone::{run, Alone};
use crate::cluster::partition::{ClusterPartition, PartitionSettings};
use crate::cluster::Recovered;
use crate::partition::{ClientRef, Op, Partition};
use latchkey_client::protocol::Response;
use raft::eraftpb::{Entry, HardState};

fn partition(
    durable: MemDurable,
    recovered: Vec<(u32, Recovered)>,
) -> ClusterPartition<MemWriter, Alone> {
    let writer = MemWriter::immediate(durable);
    let member = Member::new(1, &[1], &[0], writer, recovered, 5).expect("a member");
    let settings = PartitionSettings::one_member();
    ClusterPartition::new(settings, member, Alone::default())
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

#[test]
fn a_compactor_that_failed_stops_the_member() {
    let mut partition = partition(MemDurable::new(), Vec::new());
    let mut compactor = MemCompactor::immediate();
    compactor.fail("the snapshot worker thread panicked");
    partition.set_compactor(Box::new(compactor));
    let stopped = run_until_it_stops(partition);
    assert!(
        stopped.contains("core 0: the snapshot worker thread panicked"),
        "{stopped}"
    );
}

#[test]
fn compactions_that_come_back_late_record_the_state_at_their_own_index() {
    let mut partition = partition(MemDurable::new(), Vec::new());
    partition.settings.compact_every = 4;
    partition.set_compactor(Box::new(MemCompactor::late(11, 5)));
    let mut now_us = 0;
    run(&mut partition, &mut now_us, 100);
    assert!(partition.serving(0), "the one member serves");
    let mut granted = 0;
    for i in 0..200u64 {
        let key = format!("key-{i}");
        let op = Op::Acquire {
            wait_s: 0,
            lease_s: 60,
            owner: i + 1,
        };
        partition.handle(now_us, 1, ClientRef::NONE, op, key.as_bytes());
        let answers = run(&mut partition, &mut now_us, 1);
        granted += answers
            .iter()
            .filter(|(_, response)| matches!(response, Response::Acquired { .. }))
            .count();
    }
    granted += run(&mut partition, &mut now_us, 20)
        .iter()
        .filter(|(_, response)| matches!(response, Response::Acquired { .. }))
        .count();
    assert_eq!(granted, 200);
    let (recorded, dropped) = partition.compactions();
    assert!(recorded >= 10, "compactions recorded: {recorded}");
    assert_eq!(dropped, 0, "no restore here");
    // The snapshot recorded last holds exactly the grants up to its index, not the later ones.
    let recovered = partition.member().writer().durable().recovered();
    let snapshot = recovered[0].1.snapshot.clone().expect("a snapshot");
    let index = snapshot.get_metadata().index;
    let restored = ShardMachine::restore(0, 1, snapshot.get_data(), 0).expect("restores");
    assert_eq!(restored.applied(), index);
    let live = partition.machine(0).expect("shard 0");
    let floor = live.floor().expect("a floor");
    let expected: Vec<(Vec<u8>, u64)> = live
        .holds()
        .filter(|(_, hold)| hold.token - floor <= index)
        .map(|(key, hold)| (key.to_vec(), hold.token))
        .collect();
    let got: Vec<(Vec<u8>, u64)> = restored
        .holds()
        .map(|(key, hold)| (key.to_vec(), hold.token))
        .collect();
    assert_eq!(got, expected);
    assert!(live.applied() >= index);
}

/// A compactor that keeps every image until the test lets it go.
#[derive(Clone, Default)]
struct Held(std::sync::Arc<parking_lot::Mutex<(Vec<crate::cluster::machine::Frozen>, bool)>>);

impl crate::cluster::compactor::Compactor for Held {
    fn submit(
        &mut self,
        frozen: crate::cluster::machine::Frozen,
    ) -> Result<(), crate::cluster::machine::Frozen> {
        self.0.lock().0.push(frozen);
        Ok(())
    }

    fn retire(&mut self, _machine: ShardMachine) {}

    fn take_done(&mut self) -> std::io::Result<Vec<crate::cluster::compactor::Compacted>> {
        let mut held = self.0.lock();
        if !held.1 {
            return Ok(Vec::new());
        }
        let done = held
            .0
            .drain(..)
            .map(|frozen| crate::cluster::compactor::Compacted {
                shard: frozen.shard(),
                index: frozen.applied(),
                data: frozen.encode(),
            });
        Ok(done.collect())
    }

    fn has_done(&self) -> bool {
        let held = self.0.lock();
        held.1 && !held.0.is_empty()
    }
}

#[test]
fn a_compaction_that_comes_back_after_a_later_snapshot_is_dropped_and_the_next_one_goes_on() {
    let mut partition = partition(MemDurable::new(), Vec::new());
    partition.settings.compact_every = 4;
    let held = Held::default();
    partition.set_compactor(Box::new(held.clone()));
    let mut now_us = 0;
    run(&mut partition, &mut now_us, 100);
    assert!(partition.serving(0), "the one member serves");
    let mut owner = 0;
    let mut acquire = |partition: &mut ClusterPartition<MemWriter, Alone>, now_us: &mut u64| {
        owner += 1;
        let op = Op::Acquire {
            wait_s: 0,
            lease_s: 60,
            owner,
        };
        partition.handle(
            *now_us,
            1,
            ClientRef::NONE,
            op,
            format!("key-{owner}").as_bytes(),
        );
        run(partition, now_us, 1);
    };
    for _ in 0..10 {
        acquire(&mut partition, &mut now_us);
    }
    // One image is frozen and held (one in flight per shard: no second one).
    let frozen_at = partition.shards[0]
        .compacting()
        .expect("an image in flight");
    assert_eq!(held.0.lock().0.len(), 1);
    // Meanwhile the shard's log gets a snapshot past it (as a received snapshot would).
    let applied = partition.machine(0).expect("shard 0").applied();
    assert!(applied > frozen_at);
    let later = partition.machine(0).expect("shard 0").snapshot(0);
    partition
        .member
        .compact(0, applied, later)
        .expect("the later snapshot");
    // The held image comes back: refused by the member, dropped.
    held.0.lock().1 = true;
    partition.handle_timers(now_us);
    assert_eq!(partition.compactions(), (0, 1));
    // Free to freeze again (it may have, on an entry applied in the same iteration).
    let again = partition.shards[0].compacting();
    assert!(
        !matches!(again, Some(index) if index <= frozen_at),
        "{again:?}"
    );
    // The next compaction is frozen and recorded.
    for _ in 0..10 {
        acquire(&mut partition, &mut now_us);
    }
    run(&mut partition, &mut now_us, 2);
    assert!(
        partition.compactions().0 >= 1,
        "{:?}",
        partition.compactions()
    );
    let recovered = partition.member().writer().durable().recovered();
    let snapshot = recovered[0].1.snapshot.clone().expect("a snapshot");
    assert!(snapshot.get_metadata().index > applied);
}

/// A compactor that encodes at once but keeps every received snapshot to decode until the
/// test lets them go.
#[derive(Clone, Default)]
struct SlowRestores(std::sync::Arc<parking_lot::Mutex<(Vec<RestoreJob>, bool)>>);

impl Compactor for SlowRestores {
    fn submit(&mut self, frozen: Frozen) -> Result<(), Frozen> {
        Err(frozen)
    }

    fn retire(&mut self, _machine: ShardMachine) {}

    fn take_done(&mut self) -> std::io::Result<Vec<crate::cluster::compactor::Compacted>> {
        Ok(Vec::new())
    }

    fn has_done(&self) -> bool {
        let held = self.0.lock();
        held.1 && !held.0.is_empty()
    }

    fn submit_restore(&mut self, job: RestoreJob) -> Result<(), RestoreJob> {
        self.0.lock().0.push(job);
        Ok(())
    }

    fn take_restored(&mut self) -> Vec<Restored> {
        let mut held = self.0.lock();
        if !held.1 {
            return Vec::new();
        }
        held.0.drain(..).map(|job| job.decode()).collect()
    }
}

#[test]
fn entries_after_a_snapshot_decoded_off_the_loop_wait_for_it_then_apply_in_order() {
    // A member that compacted, then granted more: its log is a snapshot and entries after it.
    let mut first = partition(MemDurable::new(), Vec::new());
    first.settings.compact_every = 4;
    let mut now_us = 0;
    run(&mut first, &mut now_us, 100);
    for i in 0..10u64 {
        let op = Op::Acquire {
            wait_s: 0,
            lease_s: 60,
            owner: i + 1,
        };
        first.handle(
            now_us,
            1,
            ClientRef::NONE,
            op,
            format!("key-{i}").as_bytes(),
        );
        run(&mut first, &mut now_us, 1);
    }
    run(&mut first, &mut now_us, 5);
    let holds = |machine: &ShardMachine| -> Vec<(Vec<u8>, u64)> {
        let held = machine
            .holds()
            .map(|(key, hold)| (key.to_vec(), hold.token));
        held.collect()
    };
    let expected = holds(first.machine(0).expect("shard 0"));
    assert_eq!(expected.len(), 10);
    let recovered = first.member().writer().durable().recovered();
    let snapshot_at = recovered[0].1.snapshot.as_ref().expect("a snapshot");
    let snapshot_at = snapshot_at.get_metadata().index;
    let last = recovered[0]
        .1
        .entries
        .last()
        .expect("entries after it")
        .index;
    assert!(last > snapshot_at, "{last} after {snapshot_at}");
    // It restarts with a compactor that has not decoded the snapshot yet.
    let mut second = partition(first.member().writer().durable().clone(), recovered);
    let slow = SlowRestores::default();
    second.set_compactor(Box::new(slow.clone()));
    let mut now_us = 1_000_000;
    run(&mut second, &mut now_us, 3);
    assert_eq!(slow.0.lock().0.len(), 1, "the snapshot is being decoded");
    let machine = second.machine(0).expect("shard 0");
    assert_eq!(
        machine.applied(),
        0,
        "nothing applied before the snapshot is installed"
    );
    assert!(!second.serving(0));
    // Decoded: installed, then the entries after it, in order.
    slow.0.lock().1 = true;
    run(&mut second, &mut now_us, 100);
    let machine = second.machine(0).expect("shard 0");
    assert!(machine.applied() >= last, "{} < {last}", machine.applied());
    assert_eq!(holds(machine), expected);
    assert!(second.serving(0), "and it serves again");
    assert!(second.shards[0].restores_settled());
}

#[test]
fn a_server_compacts_more_often_the_more_shards_share_a_members_log_budget() {
    use crate::cluster::partition::{compact_every, COMPACT_EVERY, COMPACT_EVERY_MIN};
    assert_eq!(compact_every(0), COMPACT_EVERY);
    assert_eq!(compact_every(1), COMPACT_EVERY);
    assert_eq!(compact_every(6), COMPACT_EVERY);
    assert_eq!(compact_every(7), 9_142);
    assert_eq!(compact_every(16), 4_000);
    assert_eq!(compact_every(64), COMPACT_EVERY_MIN);
    assert_eq!(compact_every(crate::config::SHARDS_MAX), COMPACT_EVERY_MIN);
}

/// `GET /cluster/backup`'s source: refused (421, no leader known) before the member serves the
/// shard, and unknown shards are refused (404); once it serves, the copy holds the grants, and
/// a member started from it (the seeded snapshot of `cluster.restore_from`) holds them too and
/// grants a token above them.
#[test]
fn the_serving_member_gives_a_shard_copy_that_a_new_member_starts_from() {
    use crate::cluster::backup::{BackupFile, BackupRefusal, ShardBackup};
    use crate::cluster::Durable;
    use raft::eraftpb::Snapshot;
    let mut leader = partition(MemDurable::new(), Vec::new());
    let refused = leader.backup_shard(0).expect_err("not serving yet");
    assert_eq!(
        refused,
        BackupRefusal::NotLeader {
            shard: 0,
            leader: None
        }
    );
    assert_eq!(refused.status(), 421);
    let unknown = leader.backup_shard(3).expect_err("no shard 3");
    assert_eq!(unknown.status(), 404);
    let mut now_us = 0;
    run(&mut leader, &mut now_us, 100);
    assert!(leader.serving(0), "the one member serves");
    let mut tokens = Vec::new();
    for owner in 1..=3u64 {
        let op = Op::Acquire {
            wait_s: 0,
            lease_s: 60,
            owner,
        };
        leader.handle(
            now_us,
            1,
            ClientRef::NONE,
            op,
            format!("k{owner}").as_bytes(),
        );
        for (_, answer) in run(&mut leader, &mut now_us, 10) {
            if let Response::Acquired { token, .. } = answer {
                tokens.push(token);
            }
        }
    }
    assert_eq!(tokens.len(), 3);
    let copy = leader.backup_shard(0).expect("the serving member's copy");
    let file = BackupFile {
        shards: vec![ShardBackup::decode(&copy).expect("decodes")],
    };
    assert_eq!(file.locks(), 3);
    let state = file.initial_states(1).expect("a state").remove(0);
    let mut snapshot = Snapshot::default();
    snapshot.set_data(state.data.into());
    snapshot.mut_metadata().index = state.index;
    snapshot.mut_metadata().term = state.term;
    let voters = raft::eraftpb::ConfState::from((vec![1], vec![]));
    snapshot.mut_metadata().set_conf_state(voters);
    let seeded = Recovered {
        hard_state: HardState {
            term: state.term,
            commit: state.index,
            ..Default::default()
        },
        snapshot: Some(snapshot),
        entries: Vec::new(),
    };
    // What `cluster.restore_from` records in a fresh log before the member starts.
    let mut durable = MemDurable::new();
    let snapshot = seeded.snapshot.clone().expect("a snapshot");
    durable.apply_snapshot(0, &snapshot).expect("recorded");
    durable
        .set_hard_state(0, &seeded.hard_state)
        .expect("recorded");
    durable.sync().expect("synced");
    let mut restored = partition(durable, vec![(0, seeded)]);
    let mut now_us = 0;
    run(&mut restored, &mut now_us, 100);
    assert!(restored.serving(0), "the new member serves");
    let machine = restored.machine(0).expect("shard 0");
    machine.check_invariants();
    assert_eq!(machine.len(), 3);
    let op = Op::Acquire {
        wait_s: 0,
        lease_s: 60,
        owner: 9,
    };
    restored.handle(now_us, 1, ClientRef::NONE, op, b"new");
    let answers = run(&mut restored, &mut now_us, 10);
    let Some((_, Response::Acquired { token, .. })) = answers.first() else {
        panic!("{answers:?}");
    };
    assert!(
        tokens.iter().all(|old| token > old),
        "{token} after {tokens:?}"
    );
}
