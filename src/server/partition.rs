//! What a core's partition of the key space must do: the interface between [`Core`] and the
//! state it serves.
//!
//! A single node's partition is its [`LockTable`]; a cluster member's is the cluster partition
//! of that core (its shards' Raft groups and lock services). The core is generic over this
//! trait, so the single node compiles to direct calls into the lock table, as before the trait
//! existed.
//!
//! [`Core`]: super::core::Core

use super::persist::TokenKeeper;
use super::route::partition_of;
use crate::lock_table::{Answer, HeldKey, LockTable, Op, SessionId, TableStats};

/// A core's partition: it executes keyed requests, fires its timers and produces answers for
/// sessions of any core (see [`Answer`]).
pub trait Partition {
    /// The core (of `cores`) whose partition serves `key`.
    fn core_of_key(&self, key: &[u8], cores: usize) -> usize;
    /// Executes a keyed request of `session` at `now_us`; its answers (now or later) come out
    /// of [`take_answers`](Self::take_answers).
    fn handle(&mut self, now_us: u64, session: SessionId, op: Op, key: &[u8]);
    /// Fires what is due at `now_us` and does the partition's periodic work.
    fn handle_timers(&mut self, now_us: u64);
    /// When [`handle_timers`](Self::handle_timers) must run next, if anything is scheduled.
    fn next_deadline_us(&self) -> Option<u64>;
    /// The answers produced since the last call (give the vector back with
    /// [`return_answers`](Self::return_answers), to keep its allocation).
    fn take_answers(&mut self) -> Vec<Answer>;
    /// Gives back a vector taken by [`take_answers`](Self::take_answers).
    fn return_answers(&mut self, answers: Vec<Answer>);
    /// Releases the grant of `token` on `entry`, which never reached its session.
    fn release_granted(&mut self, now_us: u64, entry: u32, token: u64);
    /// `session` closed: its queued acquires leave.
    fn handle_session_closed(&mut self, session: SessionId);
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
    fn cluster_stats(&self) -> Option<crate::cluster::partition::ClusterStats> {
        None
    }
    /// Scans at most `slots` entries from `cursor` for held keys starting with `prefix` (see
    /// [`LockTable::scan_held`]); `None` when the scan reached the end.
    fn scan_held(
        &self,
        now_us: u64,
        cursor: u32,
        slots: u32,
        prefix: &[u8],
        found: &mut dyn FnMut(HeldKey),
    ) -> Option<u32>;
}

impl Partition for LockTable {
    #[inline]
    fn core_of_key(&self, key: &[u8], cores: usize) -> usize {
        partition_of(key, cores)
    }

    #[inline]
    fn handle(&mut self, now_us: u64, session: SessionId, op: Op, key: &[u8]) {
        LockTable::handle(self, now_us, session, op, key);
    }

    #[inline]
    fn handle_timers(&mut self, now_us: u64) {
        LockTable::handle_timers(self, now_us);
    }

    #[inline]
    fn next_deadline_us(&self) -> Option<u64> {
        LockTable::next_deadline_us(self)
    }

    #[inline]
    fn take_answers(&mut self) -> Vec<Answer> {
        LockTable::take_answers(self)
    }

    #[inline]
    fn return_answers(&mut self, answers: Vec<Answer>) {
        LockTable::return_answers(self, answers);
    }

    #[inline]
    fn release_granted(&mut self, now_us: u64, entry: u32, token: u64) {
        LockTable::release_granted(self, now_us, entry, token);
    }

    fn handle_session_closed(&mut self, session: SessionId) {
        LockTable::handle_session_closed(self, session);
    }

    fn handle_shutdown(&mut self) {
        LockTable::handle_shutdown(self);
    }

    #[inline]
    fn top_up_tokens(&mut self, keeper: &mut TokenKeeper) {
        keeper.top_up(self);
    }

    fn stats(&self) -> &TableStats {
        LockTable::stats(self)
    }

    fn key_count(&self) -> usize {
        LockTable::key_count(self)
    }

    fn waiter_count(&self) -> usize {
        LockTable::waiter_count(self)
    }

    fn scan_held(
        &self,
        now_us: u64,
        cursor: u32,
        slots: u32,
        prefix: &[u8],
        found: &mut dyn FnMut(HeldKey),
    ) -> Option<u32> {
        LockTable::scan_held(self, now_us, cursor, slots, prefix, &mut |held| found(held))
    }
}
