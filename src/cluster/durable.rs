//! What a member makes durable, and what it gets back after a restart.
//!
//! Raft reads its log through [`raft::storage::MemStorage`], one per group, which holds the
//! entries since the last snapshot in memory. A [`Durable`] records the same writes (appended
//! entries, hard states, snapshots) so that they survive a crash once [`Durable::sync`] has
//! returned. A member does not call it itself: it hands each loop iteration's writes to its
//! core's writer (`crate::cluster::writer`), which owns the `Durable`, writes every batch it
//! finds queued and syncs once for all of them (group commit), and tells the member which batch
//! is synced; the member sends nothing and acknowledges nothing that depends on a write before
//! then.
//!
//! Two implementations: the write-ahead log of a real member, and an in-memory image in the
//! deterministic simulation, where a crash keeps only what was synced.

use raft::eraftpb::{ConfState, Entry, HardState, Snapshot};
use raft::storage::MemStorage;
use std::io;

/// The durable writes of one member, for all of its groups.
pub trait Durable {
    /// Records `entries` appended to group `shard`'s log. The first entry's index may be at or
    /// below the last one recorded: the suffix from that index on is replaced.
    fn append(&mut self, shard: u32, entries: &[Entry]) -> io::Result<()>;
    /// Records group `shard`'s hard state (term, vote, commit).
    fn set_hard_state(&mut self, shard: u32, hard_state: &HardState) -> io::Result<()>;
    /// Records a snapshot of group `shard` (received from a leader, or taken locally to compact
    /// the log): entries at or below its index are no longer needed.
    fn apply_snapshot(&mut self, shard: u32, snapshot: &Snapshot) -> io::Result<()>;
    /// Makes every write recorded so far durable. One call covers every group.
    fn sync(&mut self) -> io::Result<()>;
    /// Hands every write recorded so far on towards the disk without waiting for it to be
    /// durable (a `write` without `fdatasync`): for writes that raft allows to be lost (a hard
    /// state whose commit index alone changed). The next [`Durable::sync`] covers them.
    fn flush(&mut self) -> io::Result<()>;
}

/// One group's durable state as found at start: what to load into its `MemStorage`.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Recovered {
    /// The last hard state recorded (the default when none was).
    pub hard_state: HardState,
    /// The last snapshot recorded, if any.
    pub snapshot: Option<Snapshot>,
    /// The entries after the snapshot, contiguous and in index order.
    pub entries: Vec<Entry>,
}

/// Builds a group's `MemStorage` from what was recovered: the snapshot first, then the entries
/// after it, then the hard state. A fresh group (nothing recovered) starts with every member of
/// `voters` as a voter, so that all members agree on the configuration without a conf change.
pub fn load(recovered: &Recovered, voters: &[u64]) -> raft::Result<MemStorage> {
    let storage = MemStorage::new_with_conf_state(ConfState::from((voters.to_vec(), vec![])));
    {
        let mut core = storage.wl();
        if let Some(snapshot) = &recovered.snapshot {
            core.apply_snapshot(snapshot.clone())?;
        }
        core.append(&recovered.entries)?;
        core.set_hardstate(recovered.hard_state.clone());
    }
    Ok(storage)
}

#[cfg(test)]
mod tests {
    use super::*;
    use raft::Storage;

    fn entry(index: u64, term: u64) -> Entry {
        Entry {
            index,
            term,
            data: vec![index as u8].into(),
            ..Default::default()
        }
    }

    #[test]
    fn a_fresh_group_has_every_voter_and_an_empty_log() {
        let storage = load(&Recovered::default(), &[1, 2, 3]).expect("load");
        let state = storage.initial_state().expect("state");
        assert_eq!(state.conf_state.voters, vec![1, 2, 3]);
        assert_eq!(state.hard_state, HardState::default());
        assert_eq!(storage.last_index().expect("last"), 0);
    }

    #[test]
    fn a_snapshot_then_entries_then_the_hard_state() {
        let mut snapshot = Snapshot::default();
        snapshot.mut_metadata().index = 5;
        snapshot.mut_metadata().term = 2;
        snapshot
            .mut_metadata()
            .set_conf_state(ConfState::from((vec![1, 2, 3], vec![])));
        let hard_state = HardState {
            term: 3,
            vote: 2,
            commit: 6,
            ..Default::default()
        };
        let recovered = Recovered {
            hard_state: hard_state.clone(),
            snapshot: Some(snapshot),
            entries: vec![entry(6, 3), entry(7, 3)],
        };
        let storage = load(&recovered, &[1, 2, 3]).expect("load");
        assert_eq!(storage.first_index().expect("first"), 6);
        assert_eq!(storage.last_index().expect("last"), 7);
        assert_eq!(storage.term(5).expect("term"), 2);
        assert_eq!(
            storage.initial_state().expect("state").hard_state,
            hard_state
        );
    }
}
