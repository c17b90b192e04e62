//! One shard on one member: its replicated [`ShardMachine`] and, while this member leads the
//! shard, the leader-local state: the FIFO of queued acquires per key, the expiries in flight
//! and where the next checkpoint starts.
//!
//! Waiters are leader-local on purpose: a queued acquire is not a replicated fact until its
//! grant commits. The head of a key's queue is *proposed* — an entry that grants it is in the
//! log and not yet applied: an `Acquire` of the key, free in the applied state, or the `then`
//! of a release or expiry of the key's holder (a handoff, one entry) — or it waits: for the
//! holder's release or expiry, which will carry it, or for a release or expiry already in the
//! log (proposed before it arrived) to free the key.
//!
//! A waiter that had to queue (its key was held or had a queue when it arrived, and its wait
//! is above 0) takes one of its session's `limits.max_pending_per_session` places
//! (`Places`) and gives it back when it leaves its queue, is abandoned (answered early, or
//! its session closed) or is proposed (the holder to be: a single node would have granted it
//! in the step that freed the key); every way out of a queue is a method here that takes the
//! places, so none can forget them. For the same reason a proposed head is not one of its
//! key's waiters for `max_waiters_per_key` and `Q` (`Shard::waiting_len`).

use super::machine::{Grant, ShardMachine};
use super::member::{Committed, Proposed};
use crate::partition::{QueueCounts, SessionId};
use crate::hash::{Map as HashMap, Set as HashSet};
use std::collections::{BTreeMap, VecDeque};
use std::sync::Arc;

/// Entries of [`Shard::grants`] checked (and dropped if their token no longer holds) per grant
/// recorded: the record is pruned a little at a time, so no call is O(grants) (at a million
/// grants one full pass took tens of milliseconds, one loop iteration), and it stays within
/// about twice the holds.
const GRANTS_PRUNED_PER_GRANT: usize = 2;

/// An acquire queued on the leader.
#[derive(Clone, Debug)]
pub(crate) struct Waiter {
    /// The session that sent it.
    pub session: SessionId,
    /// Its correlation id.
    pub owner: u64,
    /// The lease it asks for.
    pub lease_ms: u32,
    /// When the entry that grants it was proposed (server clock, µs; 0 while not proposed):
    /// a grant applied a whole lease after that is stale (see `answer_grant`).
    pub proposed_us: u64,
    /// When its wait ends (server clock, µs).
    pub deadline_us: u64,
    /// Its wait was more than 0 (its answer ends a pending acquire of the session).
    pub ends_pending: bool,
    /// A unique number, to find it from its wait timer.
    pub seq: u64,
    /// An entry that grants it is in the log, not yet applied.
    pub proposed: bool,
    /// That entry is the `then` of a release or expiry (a handoff), not an `Acquire`: it
    /// adds no hold, so it does not count in [`Shard::holds_and_grants`].
    pub handoff: bool,
    /// It was answered (`T` or `B`) or its session closed while proposed: a grant that still
    /// commits for it is released at once, unanswered. Set with [`Places::abandon`].
    pub abandoned: bool,
    /// It holds one of its session's places (see [`Places`]).
    pub counted: bool,
}

/// The places queued acquires take in their sessions' `limits.max_pending_per_session`
/// (docs/protocol.md §3), for one partition's shards: counted here per session, and, with
/// shared counts (a server of more than one core, whose sessions' acquires queue on any core),
/// there too, where the limit is decided.
pub(crate) struct Places {
    max: u32,
    /// Places held by waiters of this partition, per session (no zero counts).
    held: HashMap<SessionId, u32>,
    shared: Option<Arc<dyn QueueCounts>>,
}

impl Places {
    /// No places held; a session may hold `max`.
    pub fn new(max: u32) -> Places {
        Places {
            max,
            held: HashMap::default(),
            shared: None,
        }
    }

    /// Decides the limit with `counts`, shared with the other partitions of the server (no
    /// place may be held yet).
    pub fn share(&mut self, counts: Arc<dyn QueueCounts>) {
        assert!(self.held.is_empty(), "places shared after some were taken");
        self.shared = Some(counts);
    }

    /// Takes a place for `session`; false (nothing taken) when it holds `max` already. The
    /// caller queues a waiter with `counted` set right after.
    pub fn try_take(&mut self, session: SessionId) -> bool {
        let held = self.held.get(&session).copied().unwrap_or(0);
        let free = match &self.shared {
            Some(shared) => shared.try_add(session, self.max),
            None => held < self.max,
        };
        if free {
            self.held.insert(session, held + 1);
        }
        free
    }

    /// Gives back the place `waiter` holds, if it holds one.
    pub fn give_back(&mut self, waiter: &mut Waiter) {
        if !std::mem::replace(&mut waiter.counted, false) {
            return;
        }
        let session = waiter.session;
        match self.held.get_mut(&session) {
            Some(held) if *held > 1 => *held -= 1,
            Some(_) => {
                self.held.remove(&session);
            }
            None => panic!("session {session:#x}: a place given back that was not taken"),
        }
        if let Some(shared) = &self.shared {
            shared.remove(session);
        }
    }

    /// Marks `waiter` abandoned (answered early, or its session closed): it stays queued
    /// until its entry decides, and its session has the place back now.
    pub fn abandon(&mut self, waiter: &mut Waiter) {
        waiter.abandoned = true;
        self.give_back(waiter);
    }

    /// Places held by waiters of this partition.
    pub fn held(&self) -> usize {
        self.held.values().map(|&held| held as usize).sum()
    }
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

/// What waits, in a shard, for a received snapshot decoded off the loop (see [`Shard::held`]).
#[derive(Debug)]
pub(crate) enum Held {
    /// Install the machine decoded for the snapshot at this index.
    Restore(u64),
    /// Apply this committed entry.
    Entry(Committed),
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
    /// Queue heads with an `Acquire` in the log (grants that may add a hold when applied;
    /// a handoff adds none).
    proposed: usize,
    /// Tokens with an `Expire` in the log (leader only).
    pub expiring: HashSet<u64>,
    /// The token the next checkpoint continues after.
    pub checkpoint_after: u64,
    /// When the next checkpoint is due (server clock, µs).
    pub checkpoint_at_us: u64,
    /// The applied index of the last compaction.
    pub compacted_at: u64,
    /// The index of the image frozen for a compaction and not yet back from the core's
    /// compactor (one in flight per shard at most).
    pub compacting: Option<u64>,
    /// While a received snapshot is decoded off the loop (by the core's compactor): the
    /// restores raft handed out and the committed entries after them, in order. Nothing of
    /// this shard is applied while it is not empty; the front restore is installed once its
    /// machine is decoded, then the entries up to the next restore are applied.
    pub held: VecDeque<Held>,
    /// Machines decoded for the restores in `held`, by index, until their turn.
    pub decoded: BTreeMap<u64, Box<ShardMachine>>,
    /// Grants this member answered `A` for as leader: token → the session and when (server
    /// clock, µs). What `GET /keys` shows as PEER and HELD; a hold granted by another leader
    /// has no entry (unknown, and shown so). Entries whose token no longer holds are pruned a
    /// few at a time (see [`Shard::record_grant`]); a B-tree, so that growing it never rehashes
    /// it all in one iteration.
    pub grants: BTreeMap<u64, Granted>,
    /// The token the incremental pruning of `grants` goes on from (it wraps to the start).
    grants_cursor: u64,
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
            queues: HashMap::default(),
            waiters: 0,
            proposed: 0,
            expiring: HashSet::default(),
            checkpoint_after: 0,
            checkpoint_at_us: 0,
            compacted_at: 0,
            compacting: None,
            held: VecDeque::new(),
            decoded: BTreeMap::new(),
            grants: BTreeMap::new(),
            grants_cursor: 0,
        }
    }

    /// Remembers that `token` was granted to `session` at `at_us`. Bounded: each call also
    /// checks the next [`GRANTS_PRUNED_PER_GRANT`] entries in token order (wrapping around)
    /// and drops those whose token no longer holds, so every dead entry goes within a pass and
    /// the record stays within about twice the holds, without any call scanning it all.
    pub fn record_grant(&mut self, token: u64, session: SessionId, at_us: u64) {
        self.grants.insert(token, Granted { session, at_us });
        for _ in 0..GRANTS_PRUNED_PER_GRANT {
            let next = self.grants.range(self.grants_cursor..).next();
            let Some(checked) = next.or_else(|| self.grants.iter().next()).map(|(t, _)| *t) else {
                return;
            };
            self.grants_cursor = checked.saturating_add(1);
            if self.machine.key_of(checked).is_none() {
                self.grants.remove(&checked);
            }
        }
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

    /// The waiters of `key` as docs/protocol.md §3 counts them (`max_waiters_per_key`, `Q`'s
    /// waiters): the queue but a proposed head. An entry that grants that head is in the log;
    /// on a single node it would hold the key already (granted in the step that freed it), so
    /// it is the holder to be, not a waiter (if the entry does not grant it, it waits again).
    pub fn waiting_len(&self, key: &[u8]) -> usize {
        let Some(queue) = self.queues.get(key) else {
            return 0;
        };
        queue.len() - usize::from(queue.front().is_some_and(|head| head.proposed))
    }

    /// Removes and returns the head of `key`'s queue; its place goes back to `places`.
    pub fn pop_head(&mut self, key: &[u8], places: &mut Places) -> Option<Waiter> {
        let queue = self.queues.get_mut(key)?;
        let mut head = queue.pop_front()?;
        if queue.is_empty() {
            self.queues.remove(key);
        }
        self.waiters -= 1;
        self.proposed -= usize::from(head.proposed && !head.handoff);
        places.give_back(&mut head);
        Some(head)
    }

    /// The head of `key`'s queue.
    pub fn head_mut(&mut self, key: &[u8]) -> Option<&mut Waiter> {
        self.queues.get_mut(key).and_then(VecDeque::front_mut)
    }

    /// Marks the head of `key`'s queue proposed at `now_us`: by an `Acquire`, or (`handoff`)
    /// as the `then` of a release or expiry. The head must not be proposed already. It gives
    /// its place back to `places` now: on a single node it would hold the key already (granted
    /// in the step that freed it), so it no longer counts as queued (docs/protocol.md §3).
    pub fn propose_head(&mut self, key: &[u8], handoff: bool, now_us: u64, places: &mut Places) {
        let head = self.queues.get_mut(key).and_then(VecDeque::front_mut);
        let head = head.expect("a head to propose");
        assert!(!head.proposed, "a head proposed twice");
        head.proposed = true;
        head.handoff = handoff;
        head.proposed_us = now_us;
        places.give_back(head);
        self.proposed += usize::from(!handoff);
    }

    /// Marks the head of `key`'s queue waiting again (its entry did not grant it the key);
    /// false when the queue has no proposed head. A head that had to queue (`ends_pending`)
    /// takes a place of its session's again if one is free; if none is (the session queued
    /// more meanwhile), it waits uncounted: at most one such waiter per key, the head, and
    /// answering it `B` would refuse an acquire the single node would have granted.
    pub fn unpropose_head(&mut self, key: &[u8], places: &mut Places) -> bool {
        let Some(head) = self.queues.get_mut(key).and_then(VecDeque::front_mut) else {
            return false;
        };
        if !head.proposed {
            return false;
        }
        self.proposed -= usize::from(!head.handoff);
        head.proposed = false;
        head.handoff = false;
        head.proposed_us = 0;
        if head.ends_pending && !head.abandoned && places.try_take(head.session) {
            head.counted = true;
        }
        true
    }

    /// The head of `key`'s queue as the `then` of a release or expiry of `token`: when it
    /// waits (is not proposed) and `token` holds the key in the applied state, so that the
    /// entry will very likely free the key.
    pub fn waiting_head(&self, key: &[u8], token: u64) -> Option<Grant> {
        let head = self.queues.get(key).and_then(VecDeque::front)?;
        let holds = self
            .machine
            .holder(key)
            .is_some_and(|hold| hold.token == token);
        (holds && !head.proposed).then_some(Grant {
            owner: head.owner,
            lease_ms: head.lease_ms,
        })
    }

    /// Holds plus grants in flight: what the shard's holds may number once the proposed
    /// acquires apply (a proposed acquire on a held key is counted too, until it applies).
    pub fn holds_and_grants(&self) -> usize {
        self.machine.len() + self.proposed
    }

    /// Removes the waiters `remove` picks from `key`'s queue, returning them, their places
    /// back in `places` (a proposed head is never removed: `remove` is asked only about the
    /// others).
    pub fn remove_where(
        &mut self,
        key: &[u8],
        places: &mut Places,
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
        for waiter in &mut removed {
            places.give_back(waiter);
        }
        removed
    }

    /// Takes every waiter that is not proposed out of every queue (the member stops leading),
    /// their places back in `places`; proposed heads stay, to be decided by the entry in the
    /// log.
    pub fn take_unproposed(&mut self, places: &mut Places) -> Vec<Waiter> {
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
        for waiter in &mut taken {
            places.give_back(waiter);
        }
        taken
    }

    /// Waiters that hold a place, of `session` or (`None`) of any session.
    pub fn counted(&self, session: Option<SessionId>) -> usize {
        let waiters = self.queues.values().flatten();
        waiters
            .filter(|w| w.counted && session.map_or(true, |session| w.session == session))
            .count()
    }

    /// Checks the counts (debug builds, after every change of the queues).
    pub fn check_invariants(&self) {
        if cfg!(debug_assertions) {
            assert!(
                matches!(self.held.front(), None | Some(Held::Restore(_))),
                "entries are held only behind a restore"
            );
            for index in self.decoded.keys() {
                let waits = self
                    .held
                    .iter()
                    .any(|h| matches!(h, Held::Restore(i) if i == index));
                assert!(waits, "a machine decoded for a restore that is not held");
            }
            let counted: usize = self.queues.values().map(VecDeque::len).sum();
            assert_eq!(counted, self.waiters, "waiter count");
            let heads = self.queues.values().filter_map(VecDeque::front);
            let proposed = heads.filter(|head| head.proposed && !head.handoff).count();
            assert_eq!(proposed, self.proposed, "heads proposed by an Acquire");
            for queue in self.queues.values() {
                assert!(!queue.is_empty(), "an empty queue is kept");
                assert!(
                    queue.iter().skip(1).all(|waiter| !waiter.proposed),
                    "only the head of a queue may be proposed"
                );
                assert!(
                    queue
                        .iter()
                        .all(|waiter| waiter.proposed || !waiter.handoff),
                    "a handoff that is not proposed"
                );
                assert!(
                    queue
                        .iter()
                        .all(|waiter| !(waiter.counted && waiter.abandoned)),
                    "an abandoned waiter holds a place"
                );
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cluster::machine::Command;

    #[test]
    fn the_grant_record_keeps_every_live_grant_and_stays_within_about_twice_the_holds() {
        let mut shard = Shard::new(0, 1);
        shard
            .machine
            .apply(1, &Command::Barrier { floor: 1_000 }, 0);
        let mut index = 1;
        let mut live: Vec<(Vec<u8>, u64)> = Vec::new();
        let mut most = 0;
        // 100 keys held at a time; each round releases the oldest and grants a new one.
        for round in 0..5_000u64 {
            if live.len() == 100 {
                let (key, token) = live.remove(0);
                index += 1;
                shard.machine.apply(
                    index,
                    &Command::Release {
                        key,
                        token,
                        then: None,
                    },
                    0,
                );
            }
            index += 1;
            let key = format!("k{round}").into_bytes();
            let command = Command::Acquire {
                key: key.clone(),
                owner: round,
                lease_ms: 60_000,
            };
            shard.machine.apply(index, &command, 0);
            let token = shard.machine.holder(&key).expect("granted").token;
            shard.record_grant(token, 1, round);
            live.push((key, token));
            most = most.max(shard.grants.len());
            for (_, token) in &live {
                assert!(shard.grants.contains_key(token), "a live grant was dropped");
            }
        }
        assert!(most <= 2 * 100 + 2, "the record grew to {most}");
    }
}
