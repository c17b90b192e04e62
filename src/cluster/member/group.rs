//! One shard's Raft group inside a member: the `RawNode`, the storage it reads, the last
//! snapshot it can send, and the seeded election-timeout draws that make it deterministic.

use super::drain::Persisting;
use crate::rng::Rng;
use raft::eraftpb::{ConfState, Entry, Snapshot};
use raft::prelude::{Config, RawNode};
use raft::storage::MemStorage;
use raft::{GetEntriesContext, RaftState, StateRole, Storage, StorageError};
use std::collections::VecDeque;

/// Ticks of one election timeout; randomized timeouts are drawn from
/// `[ELECTION_TICKS, 2 * ELECTION_TICKS)` (raft-rs's default range), by [`Group::settle`].
pub(super) const ELECTION_TICKS: usize = 10;

/// The log a group's `RawNode` reads: raft-rs's `MemStorage` plus the snapshot last taken
/// (by [`super::Member::compact`]) or received, which is what a leader sends to a follower that
/// is behind the compacted log. `MemStorage::snapshot` would send metadata without data.
pub(super) struct GroupStorage {
    /// Entries, hard state and configuration.
    pub(super) memory: MemStorage,
    /// The last snapshot with its state-machine data; index 0 when none was taken yet.
    pub(super) snapshot: Snapshot,
}

impl Storage for GroupStorage {
    fn initial_state(&self) -> raft::Result<RaftState> {
        self.memory.initial_state()
    }

    fn entries(
        &self,
        low: u64,
        high: u64,
        max_size: impl Into<Option<u64>>,
        context: GetEntriesContext,
    ) -> raft::Result<Vec<Entry>> {
        self.memory.entries(low, high, max_size, context)
    }

    fn term(&self, index: u64) -> raft::Result<u64> {
        self.memory.term(index)
    }

    fn first_index(&self) -> raft::Result<u64> {
        self.memory.first_index()
    }

    fn last_index(&self) -> raft::Result<u64> {
        self.memory.last_index()
    }

    fn snapshot(&self, request_index: u64, _to: u64) -> raft::Result<Snapshot> {
        let index = self.snapshot.get_metadata().index;
        if index == 0 || index < request_index {
            return Err(raft::Error::Store(
                StorageError::SnapshotTemporarilyUnavailable,
            ));
        }
        Ok(self.snapshot.clone())
    }
}

/// One hosted group.
pub(super) struct Group {
    /// The shard this group replicates.
    pub(super) shard: u32,
    /// raft-rs's node.
    pub(super) raw: RawNode<GroupStorage>,
    /// Draws this group's election timeouts.
    rng: Rng,
    /// The (leader, term) last reported in a `LeaderChanged`.
    pub(super) reported: (u64, u64),
    /// The (term, role) and election timeout as of the last `settle`.
    settled: (u64, StateRole, usize),
    /// The index of the last committed entry (or restored snapshot) handed out.
    pub(super) handed: u64,
    /// Readies advanced before their batch was synced, oldest first.
    pub(super) persisting: VecDeque<Persisting>,
}

impl Group {
    /// Builds the group from its loaded storage and snapshot; `applied` is the snapshot's index.
    pub(super) fn new(
        shard: u32,
        config: &Config,
        storage: GroupStorage,
        logger: &slog::Logger,
        seed: u64,
    ) -> raft::Result<Group> {
        let raw = RawNode::new(config, storage, logger)?;
        let mut group = Group {
            shard,
            raw,
            rng: Rng::new(seed),
            reported: (0, 0),
            settled: (0, StateRole::Follower, 0),
            handed: config.applied,
            persisting: VecDeque::new(),
        };
        group.settle();
        Ok(group)
    }

    /// Replaces raft-rs's election-timeout draw (from `thread_rng`) with a seeded one. Called
    /// after every call into the `RawNode`. raft-rs re-draws only in `reset`, which runs only on
    /// a term or role change (`become_follower`, `_candidate`, `_leader`; in a group of more
    /// than one voter never returning to the same (term, role) within one call), and nothing
    /// reads the value later in that same call. The value check is a second net.
    pub(super) fn settle(&mut self) {
        let raft = &self.raw.raft;
        let now = (raft.term, raft.state, raft.randomized_election_timeout());
        if now == self.settled {
            return;
        }
        let spread = ELECTION_TICKS as u64;
        let timeout = ELECTION_TICKS + (self.rng.next_u64() % spread) as usize;
        self.raw.raft.set_randomized_election_timeout(timeout);
        self.settled = (now.0, now.1, timeout);
    }

    /// Tells raft-rs that everything handed out is applied, as far as it allows: never past
    /// what is committed and persisted here (a received snapshot counts once it is persisted).
    pub(super) fn catch_up_applied(&mut self) {
        let log = &self.raw.raft.raft_log;
        let target = self.handed.min(log.committed).min(log.persisted);
        if target > log.applied {
            self.raw.advance_apply_to(target);
        }
    }

    /// The leader this group knows of, if any.
    pub(super) fn leader(&self) -> Option<u64> {
        match self.raw.raft.leader_id {
            0 => None,
            id => Some(id),
        }
    }

    /// Whether this member leads the group.
    pub(super) fn is_leader(&self) -> bool {
        self.raw.raft.state == StateRole::Leader
    }

    /// Checks what must hold between calls; panics on a broken invariant.
    pub(super) fn check_invariants(&self, voters: &[u64]) {
        let raft = &self.raw.raft;
        let log = &raft.raft_log;
        assert!(log.applied <= log.committed, "applied past commit");
        assert!(
            log.applied <= self.handed,
            "applied what was not handed out"
        );
        assert!(self.handed <= log.committed, "handed out past commit");
        assert!(log.committed <= log.last_index(), "commit past the log");
        assert_eq!(
            (raft.term, raft.state, raft.randomized_election_timeout()),
            self.settled,
            "election timeout not drawn from the seeded generator"
        );
        assert!(raft.leader_id == 0 || voters.contains(&raft.leader_id));
        if self.is_leader() {
            assert_eq!(raft.leader_id, raft.id, "a leader names itself");
        }
        let snapshot_index = self.raw.store().snapshot.get_metadata().index;
        assert!(snapshot_index <= log.committed, "snapshot past commit");
        let batches = self.persisting.iter().map(|p| (p.batch, p.ready));
        let ordered = batches.clone().zip(batches.skip(1));
        for ((batch, ready), (next_batch, next_ready)) in ordered {
            assert!(
                batch <= next_batch && ready < next_ready,
                "readies out of order"
            );
        }
    }
}

/// The configuration every group starts with: all of `voters`.
pub(super) fn conf_state(voters: &[u64]) -> ConfState {
    ConfState::from((voters.to_vec(), vec![]))
}
