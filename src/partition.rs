//! What a core serves, in the words both kinds of partition speak: the [`Partition`] trait
//! between a core and the state it serves, the requests it executes ([`Op`]), the answers it
//! produces ([`Answer`], with a typed [`GrantRef`]), sessions ([`SessionId`], [`NOBODY`]),
//! the lock rules both partitions decide by ([`rules`]), the per-session places in
//! `max_pending_per_session` ([`Places`], over the [`QueueCounts`] shared between cores), what
//! it counts ([`stats`], [`cluster_stats`]) and the fixed hash that picks a key's partition
//! ([`partition_of`]: a single node's core, a cluster's shard). The reference model of the
//! rules (`model`, tests only) lives beside them.
//!
//! A single node's partition is its [`crate::lock_table::LockTable`]; a cluster member's is
//! the cluster partition of one core (`crate::cluster::partition`: its shards' Raft groups and
//! lock services). The core ([`crate::server`]) is generic over the trait, so the single node
//! compiles to direct calls into the lock table. This module is the only thing the server and
//! the cluster share: neither imports the other.
//!
//! Deliberately not here: storage and I/O. The rules of docs/protocol.md §3 are decided here
//! ([`rules`]) and carried out by each partition over its own storage (the lock table's
//! entries and wheel; the cluster's log, machines and queues); `tests/queue_rules.rs` checks
//! both against the one model.

pub mod clients;
pub mod cluster_stats;
#[cfg(any(test, feature = "testing"))]
pub mod model;
mod op;
mod places;
pub mod rules;
pub mod stats;

pub use cluster_stats::ClusterStats;
pub use latchkey_client::protocol::Fate;
pub use op::Op;
pub use places::Places;
pub use stats::{BusyCounts, BusyReason, HeldKey, TableStats};

use crate::tokens::TokenKeeper;
use latchkey_client::protocol::Response;

/// An opaque session identity chosen by the reactor (unique for the life of the process).
pub type SessionId = u64;

/// The session of answers nobody reads (releases of grants that were never delivered).
pub const NOBODY: SessionId = u64::MAX;

/// The first of the session ids under which a partition keeps the waiters and grants of an
/// identified client that has no session (docs/protocol.md §5): `DETACHED + client index`.
/// Above every id a core gives a session (a core's id starts with its index, below
/// `CORES_MAX`), below [`NOBODY`].
pub const DETACHED: SessionId = 0xFFFF_FFFF_0000_0000;

/// Which identified client a session speaks for (docs/protocol.md §5, resumable calls): the
/// small index the server gave the client id at its first Identify, or [`ClientRef::NONE`] for
/// a session that did not identify.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct ClientRef(pub u32);

impl ClientRef {
    /// A session that did not identify.
    pub const NONE: ClientRef = ClientRef(u32::MAX);

    /// Whether this names a client.
    pub fn is_some(self) -> bool {
        self != ClientRef::NONE
    }

    /// The session id this client's waiters and grants are kept under while it has no session
    /// (its answers go nowhere; a Resolve attaches them to the session that asks).
    pub fn detached(self) -> SessionId {
        debug_assert!(self.is_some());
        DETACHED + u64::from(self.0)
    }
}

/// Whether `session` is a detached client's ([`ClientRef::detached`]): nobody reads its
/// answers.
pub fn is_detached(session: SessionId) -> bool {
    (DETACHED..NOBODY).contains(&session)
}
/// Per-session counts of queued acquires shared by the partitions of one server, so that
/// `max_pending_per_session` bounds a session's queued acquires across all of them (its
/// acquires may queue in several). Without one, a table counts its own waiters of the session,
/// which is exact when there is one partition.
pub trait QueueCounts: Send + Sync {
    /// Counts one more queued acquire of `session`, unless it already has `max`: then counts
    /// nothing and returns false. Atomic: two partitions never both take the last place.
    fn try_add(&self, session: SessionId, max: u32) -> bool;
    /// One queued acquire of `session` left its queue (granted, timed out, cancelled,
    /// withdrawn or refused at shutdown).
    fn remove(&self, session: SessionId);
}

/// One answer the table produced, addressed to a session.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Answer {
    /// The session the answer goes to.
    pub session: SessionId,
    /// The frame to write.
    pub response: Response,
    /// True when this answers an Acquire with wait > 0 (the session's pending count drops).
    pub ends_pending: bool,
    /// For `Acquired`: which grant it was ([`GrantRef::NONE`] for any other answer).
    pub grant: GrantRef,
}

/// Which grant an `A` answer came from, as the partition that made it names it: what the core
/// gives back to [`Partition::release_granted`] when the answer never reached its session (its
/// session closed first). Opaque to the core: a single node's lock table names the held key's
/// entry (`LockTable::entry_key`), a cluster partition the shard.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct GrantRef(pub u32);

impl GrantRef {
    /// No grant: the reference of every answer but `A`.
    pub const NONE: GrantRef = GrantRef(u32::MAX);
}

/// Poll tokens a core reserves for its partition's own sources (a cluster member's peer
/// connections read on the core): [`Partition::on_source_ready`] gets their index.
pub const PARTITION_SOURCES: usize = 64;

/// A core's partition: it executes keyed requests, fires its timers and produces answers for
/// sessions of any core (see [`Answer`]).
pub trait Partition {
    /// The core (of `cores`) whose partition serves `key`.
    fn core_of_key(&self, key: &[u8], cores: usize) -> usize;
    /// Executes a keyed request of `session` (speaking for `client`, if it identified) at
    /// `now_us`; its answers (now or later) come out of [`take_answers`](Self::take_answers).
    fn handle(&mut self, now_us: u64, session: SessionId, client: ClientRef, op: Op, key: &[u8]);
    /// Fires what is due at `now_us` and does the partition's periodic work.
    fn handle_timers(&mut self, now_us: u64);
    /// When [`handle_timers`](Self::handle_timers) must run next, if anything is scheduled.
    fn next_deadline_us(&self) -> Option<u64>;
    /// A readiness event for source `source` (< [`PARTITION_SOURCES`]) that the partition
    /// registered on its core's poll; [`handle_timers`](Self::handle_timers) runs later in the
    /// same iteration. A single node registers none.
    fn on_source_ready(&mut self, _source: usize) {}
    /// The answers produced since the last call (give the vector back with
    /// [`return_answers`](Self::return_answers), to keep its allocation).
    fn take_answers(&mut self) -> Vec<Answer>;
    /// Gives back a vector taken by [`take_answers`](Self::take_answers).
    fn return_answers(&mut self, answers: Vec<Answer>);
    /// The grant `grant` of `token`, whose `A` never reached its session: released at once, or,
    /// for an identified `client`, kept for it to resolve until its grace ends.
    fn release_granted(&mut self, now_us: u64, grant: GrantRef, token: u64, client: ClientRef);
    /// `session` closed: its queued acquires leave — or, for a session of an identified
    /// `client`, stay queued for the client (detached) until a Resolve attaches them or its
    /// grace ends.
    fn handle_session_closed(&mut self, session: SessionId, client: ClientRef);
    /// `client`'s grace ended without a session: its detached waiters leave, its grants that
    /// never reached it are released, and what the partition remembered of it is dropped.
    fn handle_client_gone(&mut self, _now_us: u64, _client: ClientRef) {}
    /// A session identified as `client`, whose client id is `id` and grace `grace_s` (told to
    /// every partition before any request of that session reaches it): a cluster member keeps
    /// it to mirror the client's waiters in the replicated state and to find the waiters a
    /// predecessor queued for it. A single node needs none of it.
    fn handle_client_known(&mut self, _client: ClientRef, _id: u128, _grace_s: u8) {}
    /// Whether the partition has nothing left to do for a shutdown (a cluster member hands its
    /// leaderships over first, and answers its waiters once they moved): the core stops only
    /// once it is.
    fn is_quiescent(&self) -> bool {
        true
    }
    /// Whether the partition resumes calls (answers Resolve); the core refuses Identify where
    /// it does not.
    fn resumes_calls(&self) -> bool {
        false
    }
    /// The server is stopping: queued acquires are answered `B`, new ones refused.
    fn handle_shutdown(&mut self);
    /// Keeps the token reservation topped up (a single node's tokens are persisted ahead).
    fn top_up_tokens(&mut self, keeper: &mut TokenKeeper);
    /// The partition's counters.
    fn stats(&self) -> &TableStats;
    /// Keys held now.
    fn key_count(&self) -> usize;
    /// Acquires queued now.
    fn waiter_count(&self) -> usize;
    /// A cluster member's figures of this core's shards; `None` for a single node.
    fn cluster_stats(&self) -> Option<ClusterStats> {
        None
    }
    /// A copy of `shard`'s locks for `latchkey cluster backup` (`crate::cluster::backup`):
    /// given only by the member that serves the shard, on the core that hosts it.
    fn backup_shard(&self, _shard: u32) -> Result<Vec<u8>, crate::cluster::backup::BackupRefusal> {
        Err(crate::cluster::backup::BackupRefusal::NotCluster)
    }
    /// Scans at most `slots` entries from `cursor` for held keys starting with `prefix` (see
    /// [`crate::lock_table::LockTable::scan_held`]); `None` when the scan reached the end.
    fn scan_held(
        &self,
        now_us: u64,
        cursor: u32,
        slots: u32,
        prefix: &[u8],
        found: &mut dyn FnMut(HeldKey),
    ) -> Option<u32>;
}

/// The core (partition) that owns `key` among `cores`: FNV-1a, a murmur3 finalizer (FNV's high
/// bits are poorly mixed for short keys), then a multiply-shift range reduction. Stable across
/// runs and builds: every core must agree, and a benchmark must be repeatable.
pub fn partition_of(key: &[u8], cores: usize) -> usize {
    if cores <= 1 {
        return 0;
    }
    let mut hash: u64 = 0xcbf2_9ce4_8422_2325;
    for &byte in key {
        hash ^= u64::from(byte);
        hash = hash.wrapping_mul(0x0000_0100_0000_01b3);
    }
    hash ^= hash >> 33;
    hash = hash.wrapping_mul(0xff51_afd7_ed55_8ccd);
    hash ^= hash >> 33;
    hash = hash.wrapping_mul(0xc4ce_b9fe_1a85_ec53);
    hash ^= hash >> 33;
    ((u128::from(hash) * cores as u128) >> 64) as usize
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn partition_is_stable_and_in_range() {
        for cores in 1..9 {
            for i in 0..1000u32 {
                let key = format!("key-{i}");
                let p = partition_of(key.as_bytes(), cores);
                assert!(p < cores);
                assert_eq!(p, partition_of(key.as_bytes(), cores));
            }
        }
        // Fixed values: a change here would route keys differently after an upgrade.
        assert_eq!(partition_of(b"a", 2), 1);
        assert_eq!(partition_of(b"key-1", 4), 2);
        assert_eq!(partition_of(b"orders/42", 3), 0);
        assert_eq!(partition_of(b"k1", 2), 0);
        let spread: Vec<usize> = (0..1000u32)
            .map(|i| partition_of(format!("k{i}").as_bytes(), 4))
            .fold(vec![0; 4], |mut counts, p| {
                counts[p] += 1;
                counts
            });
        assert!(spread.iter().all(|&n| n > 150), "uneven spread {spread:?}");
    }
}
