//! What a member makes durable, and what it gets back after a restart.
//!
//! Raft reads its log through [`raft::storage::MemStorage`], one per group, which holds the
//! entries since the last snapshot in memory. A [`Durable`] records the same writes (appended
//! entries, hard states, snapshots) so that they survive a crash once [`Durable::sync`] has
//! returned; a member calls `sync` once per loop iteration for all of its groups (group commit),
//! before it sends any message or acknowledges anything that depends on those writes.
//!
//! Two implementations: the write-ahead log of a real member, and an in-memory image in the
//! deterministic simulation, where a crash keeps only what was synced.

use raft::eraftpb::{Entry, HardState, Snapshot};
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
