//! One shard on one member: its replicated [`ShardMachine`] and, while this member leads the
//! shard, the leader-local state: the FIFO of queued acquires per key, the expiries in flight
//! and where the next checkpoint starts.
//!
//! Waiters are leader-local on purpose: a queued acquire is not a replicated fact until its
//! grant commits. The head of a key's queue is *proposed* (an `Acquire` entry is in the log
//! and not yet applied) or waits for the key to be freed by a committed release or expiry.

use super::machine::ShardMachine;
use super::member::Proposed;
use crate::lock_table::SessionId;
use std::collections::{HashMap, HashSet, VecDeque};

/// Entries [`Shard::grants`] may hold beyond twice the shard's holds before it is pruned.
const GRANTS_SLACK: usize = 64;

/// An acquire queued on the leader.
#[derive(Clone, Debug)]
pub(crate) struct Waiter {
    /// The session that sent it.
    pub session: SessionId,
    /// Its correlation id.
    pub owner: u64,
    /// The lease it asks for.
    pub lease_ms: u32,
    /// When it arrived (server clock, µs): a grant applied a whole lease after that is
    /// stale (see `answer_grant`).
    pub received_us: u64,
    /// When its wait ends (server clock, µs).
    pub deadline_us: u64,
    /// Its wait was more than 0 (its answer ends a pending acquire of the session).
    pub ends_pending: bool,
    /// A unique number, to find it from its wait timer.
    pub seq: u64,
    /// An `Acquire` entry for it is in the log, not yet applied.
    pub proposed: bool,
    /// It was answered (`T` or `B`) or its session closed while proposed: a grant that still
    /// commits for it is released at once, unanswered.
    pub abandoned: bool,
}

/// This member's role in the shard's group, as far as serving requests goes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Role {
    /// Another member leads (or none): requests are redirected.
    Follower,
    /// This member leads and waits for its barrier entry to apply: until then it may not know
    /// every committed entry, so it serves nothing yet.
    Promoting {
        /// Where the barrier sits.
        barrier: Proposed,
    },
    /// This member leads, has applied everything committed before its term, and extended
    /// every lease by the grace: it serves.
    Leader {
        /// The term it leads in.
        term: u64,
    },
}

/// One hosted shard.
pub(crate) struct Shard {
    /// The replicated lock state.
    pub machine: ShardMachine,
    /// This member's role.
    pub role: Role,
    /// Queued acquires per key (leader only; empty queues are removed).
    pub queues: HashMap<Vec<u8>, VecDeque<Waiter>>,
    /// Waiters in all queues.
    pub waiters: usize,
    /// Tokens with an `Expire` in the log (leader only).
    pub expiring: HashSet<u64>,
    /// The token the next checkpoint continues after.
    pub checkpoint_after: u64,
    /// When the next checkpoint is due (server clock, µs).
    pub checkpoint_at_us: u64,
    /// The applied index of the last compaction.
    pub compacted_at: u64,
    /// Grants this member answered `A` for as leader: token → the session and when (server
    /// clock, µs). What `GET /keys` shows as PEER and HELD; a hold granted by another leader
    /// has no entry (unknown, and shown so). Entries whose token no longer holds are pruned
    /// when the map outgrows the holds (see [`Shard::record_grant`]).
    pub grants: HashMap<u64, Granted>,
}

/// A grant this member answered, for `GET /keys`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Granted {
    /// The session the `A` went to.
    pub session: SessionId,
    /// When the grant was applied here (server clock, µs).
    pub at_us: u64,
}

impl Shard {
    pub fn new(shard: u32, shards: u32) -> Shard {
        Shard {
            machine: ShardMachine::new(shard, shards),
            role: Role::Follower,
            queues: HashMap::new(),
            waiters: 0,
            expiring: HashSet::new(),
            checkpoint_after: 0,
            checkpoint_at_us: 0,
            compacted_at: 0,
            grants: HashMap::new(),
        }
    }

    /// Remembers that `token` was granted to `session` at `at_us`. Bounded: when the record
    /// holds more than twice the shard's holds (plus a little), it keeps only tokens that
    /// still hold, so it never outgrows the machine by more than that.
    pub fn record_grant(&mut self, token: u64, session: SessionId, at_us: u64) {
        if self.grants.len() >= 2 * self.machine.len() + GRANTS_SLACK {
            let machine = &self.machine;
            self.grants
                .retain(|&token, _| machine.key_of(token).is_some());
        }
        self.grants.insert(token, Granted { session, at_us });
    }

    /// Whether this member serves requests of the shard now.
    pub fn serving(&self) -> bool {
        matches!(self.role, Role::Leader { .. })
    }

    /// Queues `waiter` at the back of `key`'s queue.
    pub fn enqueue(&mut self, key: &[u8], waiter: Waiter) {
        self.queues
            .entry(key.to_vec())
            .or_default()
            .push_back(waiter);
        self.waiters += 1;
    }

    /// The queue of `key`, if it has one.
    pub fn queue_len(&self, key: &[u8]) -> usize {
        self.queues.get(key).map_or(0, VecDeque::len)
    }

    /// Removes and returns the head of `key`'s queue.
    pub fn pop_head(&mut self, key: &[u8]) -> Option<Waiter> {
        let queue = self.queues.get_mut(key)?;
        let head = queue.pop_front();
        if queue.is_empty() {
            self.queues.remove(key);
        }
        if head.is_some() {
            self.waiters -= 1;
        }
        head
    }

    /// The head of `key`'s queue.
    pub fn head_mut(&mut self, key: &[u8]) -> Option<&mut Waiter> {
        self.queues.get_mut(key).and_then(VecDeque::front_mut)
    }

    /// Removes the waiters `keep` refuses from `key`'s queue, returning them (a proposed head
    /// is never removed: `keep` sees it and decides only for the others).
    pub fn remove_where(
        &mut self,
        key: &[u8],
        mut remove: impl FnMut(&Waiter) -> bool,
    ) -> Vec<Waiter> {
        let Some(queue) = self.queues.get_mut(key) else {
            return Vec::new();
        };
        let mut removed = Vec::new();
        queue.retain(|waiter| {
            if !waiter.proposed && remove(waiter) {
                removed.push(waiter.clone());
                false
            } else {
                true
            }
        });
        if queue.is_empty() {
            self.queues.remove(key);
        }
        self.waiters -= removed.len();
        removed
    }

    /// Takes every waiter that is not proposed out of every queue (the member stops leading);
    /// proposed heads stay, to be decided by the entry in the log.
    pub fn take_unproposed(&mut self) -> Vec<Waiter> {
        let mut taken = Vec::new();
        for queue in self.queues.values_mut() {
            queue.retain(|waiter| {
                if waiter.proposed {
                    true
                } else {
                    taken.push(waiter.clone());
                    false
                }
            });
        }
        self.queues.retain(|_, queue| !queue.is_empty());
        self.waiters -= taken.len();
        taken
    }

    /// Checks the counts (debug builds, after every change of the queues).
    pub fn check_invariants(&self) {
        if cfg!(debug_assertions) {
            let counted: usize = self.queues.values().map(VecDeque::len).sum();
            assert_eq!(counted, self.waiters, "waiter count");
            for queue in self.queues.values() {
                assert!(!queue.is_empty(), "an empty queue is kept");
                assert!(
                    queue.iter().skip(1).all(|waiter| !waiter.proposed),
                    "only the head of a queue may be proposed"
                );
            }
        }
    }
}
