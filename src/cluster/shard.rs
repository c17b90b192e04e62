//! One shard on one member: its replicated [`ShardMachine`], this member's [`Role`] in its
//! group and, while this member leads it, the leader-local state: the queued acquires
//! ([`Queues`], in `shard/queues.rs`), the expiries in flight and where the next checkpoint
//! starts; besides, the compaction in flight, the received snapshots being decoded and the
//! grants this member answered.
//!
//! Every field is private: each change goes through a method that keeps the shard's invariants
//! (checked by [`Shard::check_invariants`] in debug builds after every change of the queues).

mod queues;

pub(crate) use queues::{Head, Waiter, Withdrawn, ADOPTED};

use super::machine::{Grant, ShardMachine};
use super::member::{Committed, Proposed};
use crate::hash::{Map as HashMap, Set as HashSet};
use crate::partition::{ClientRef, Places, SessionId};
use latchkey_wheel::TimerHandle;
use queues::Queues;
use std::collections::{BTreeMap, VecDeque};

/// Entries of the grant record checked (and dropped if their token no longer holds) per grant
/// recorded: the record is pruned a little at a time, so no call is O(grants) (at a million
/// grants one full pass took tens of milliseconds, one loop iteration), and it stays within
/// about twice the holds.
const GRANTS_PRUNED_PER_GRANT: usize = 2;

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

/// What waits, in a shard, for a received snapshot decoded off the loop.
#[derive(Debug)]
enum Held {
    /// Install the machine decoded for the snapshot at this index.
    Restore(u64),
    /// Apply this committed entry.
    Entry(Committed),
}

/// A grant this member answered, for `GET /keys`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Granted {
    /// The session the `A` went to.
    pub session: SessionId,
    /// When the grant was applied here (server clock, µs).
    pub at_us: u64,
}

/// A restore whose machine is decoded, ready to install: the machine, the snapshot's index,
/// and the committed entries held behind it (to apply after it, in order).
pub(crate) struct ReadyRestore {
    /// The decoded machine.
    pub machine: Box<ShardMachine>,
    /// The snapshot's index.
    pub index: u64,
    /// The entries that waited behind it, up to the next restore.
    pub entries: Vec<Committed>,
}

/// One hosted shard.
pub(crate) struct Shard {
    /// The replicated lock state.
    machine: ShardMachine,
    /// This member's role.
    role: Role,
    /// Queued acquires (leader only).
    queues: Queues,
    /// Tokens with an `Expire` in the log (leader only).
    expiring: HashSet<u64>,
    /// The lease timer of each hold on the core's wheel, by token (while serving only).
    leases: HashMap<u64, TimerHandle>,
    /// Which serving term the timers in `leases` belong to: a timer of an earlier one is stale
    /// and ignored when it fires (they are not cancelled one by one when the member stops
    /// serving).
    lease_epoch: u32,
    /// The token the next checkpoint continues after.
    checkpoint_after: u64,
    /// When the next checkpoint is due (server clock, µs).
    checkpoint_at_us: u64,
    /// The applied index of the last compaction (or restore).
    compacted_at: u64,
    /// The index of the image frozen for a compaction and not yet back from the core's
    /// compactor (one in flight per shard at most).
    compacting: Option<u64>,
    /// While a received snapshot is decoded off the loop (by the core's compactor): the
    /// restores raft handed out and the committed entries after them, in order. Nothing of
    /// this shard is applied while it is not empty; the front restore is installed once its
    /// machine is decoded, then the entries up to the next restore are applied.
    held: VecDeque<Held>,
    /// Machines decoded for the restores in `held`, by index, until their turn.
    decoded: BTreeMap<u64, Box<ShardMachine>>,
    /// Grants this member answered `A` for as leader: token → the session and when (server
    /// clock, µs). What `GET /keys` shows as PEER and HELD; a hold granted by another leader
    /// has no entry (unknown, and shown so). Entries whose token no longer holds are pruned a
    /// few at a time (see [`Shard::record_grant`]); a B-tree, so that growing it never rehashes
    /// it all in one iteration.
    grants: BTreeMap<u64, Granted>,
    /// The token the incremental pruning of `grants` goes on from (it wraps to the start).
    grants_cursor: u64,
    /// The index of the last entry this member proposed on the shard that may still commit.
    last_proposed: u64,
    /// The term of the last entry applied (0 before any since start or a restore).
    applied_term: u64,
}

impl Shard {
    pub fn new(shard: u32, shards: u32) -> Shard {
        Shard {
            machine: ShardMachine::new(shard, shards),
            role: Role::Follower,
            queues: Queues::default(),
            expiring: HashSet::default(),
            leases: HashMap::default(),
            lease_epoch: 0,
            checkpoint_after: 0,
            checkpoint_at_us: 0,
            compacted_at: 0,
            compacting: None,
            held: VecDeque::new(),
            decoded: BTreeMap::new(),
            grants: BTreeMap::new(),
            grants_cursor: 0,
            last_proposed: 0,
            applied_term: 0,
        }
    }
}

/// The machine and the role.
impl Shard {
    /// The replicated lock state.
    pub fn machine(&self) -> &ShardMachine {
        &self.machine
    }

    /// The replicated lock state, to apply committed entries to (the machine keeps its own
    /// invariants).
    pub fn machine_mut(&mut self) -> &mut ShardMachine {
        &mut self.machine
    }

    /// Installs `machine`, restored from the snapshot at `index`, and returns the one it
    /// replaces (the caller has it dropped off the loop).
    pub fn install(&mut self, machine: ShardMachine, index: u64) -> ShardMachine {
        self.compacted_at = index;
        std::mem::replace(&mut self.machine, machine)
    }

    /// This member proposed an entry at `index`.
    pub fn proposed_at(&mut self, index: u64) {
        self.last_proposed = self.last_proposed.max(index);
    }

    /// The index of the last entry this member proposed on the shard (0 before any): a query
    /// waits for it to apply.
    pub fn last_proposed(&self) -> u64 {
        self.last_proposed
    }

    /// Entries this member proposed past `index` were lost (a later term's entry applied
    /// before them): the last that may still commit is at `index`, or past it if given.
    pub fn proposals_lost(&mut self, index: u64, still: Option<u64>) {
        self.last_proposed = still.unwrap_or(index).max(index).min(self.last_proposed);
    }

    /// An entry of `term` applied: true if its term is above the last applied entry's. The
    /// log's terms never decrease with the index, so a proposal of an earlier term past this
    /// entry can never commit.
    pub fn term_applied(&mut self, term: u64) -> bool {
        let raised = term > self.applied_term;
        self.applied_term = self.applied_term.max(term);
        raised
    }

    /// This member's role.
    pub fn role(&self) -> Role {
        self.role
    }

    /// Whether this member serves requests of the shard now.
    pub fn serving(&self) -> bool {
        matches!(self.role, Role::Leader { .. })
    }

    /// This member leads and proposed its barrier at `barrier`.
    pub fn begin_promotion(&mut self, barrier: Proposed) {
        self.role = Role::Promoting { barrier };
    }

    /// The barrier of `term` applied at `now_ms` (apply time): every lease gets `grace_ms`
    /// more before it may expire here ([`ShardMachine::promote`]), then the shard is served;
    /// the first checkpoint is due at `checkpoint_at_us`. False (nothing changes) unless this
    /// member was promoting in `term`.
    pub fn serve(&mut self, term: u64, now_ms: u64, grace_ms: u64, checkpoint_at_us: u64) -> bool {
        if !matches!(self.role, Role::Promoting { barrier } if barrier.term == term) {
            return false;
        }
        self.machine.promote(now_ms, grace_ms);
        self.role = Role::Leader { term };
        self.checkpoint_at_us = checkpoint_at_us;
        true
    }

    /// This member stopped leading: no expiry of its is in flight any more, its lease timers
    /// are stale, and every waiter that was not proposed leaves the queues (returned; their
    /// places back in `places`). Proposed heads stay, to be decided by their entries.
    pub fn demote(&mut self, places: &mut Places) -> Vec<Waiter> {
        self.role = Role::Follower;
        self.expiring.clear();
        self.drop_lease_timers();
        let taken = self.queues.take_unproposed(places);
        self.check_invariants();
        taken
    }
}

/// The leader's expiries and checkpoints.
impl Shard {
    /// Records that an `Expire` of `token` is in the log; false if one is already.
    pub fn mark_expiring(&mut self, token: u64) -> bool {
        self.expiring.insert(token)
    }

    /// Whether an `Expire` of `token` is in the log.
    pub fn expiring(&self, token: u64) -> bool {
        self.expiring.contains(&token)
    }

    /// The `Expire` of `token` applied or was lost.
    pub fn expiry_settled(&mut self, token: u64) {
        self.expiring.remove(&token);
    }

    /// Where the next checkpoint continues (after this token), if one is due at `now_us`.
    pub fn checkpoint_due(&self, now_us: u64) -> Option<u64> {
        let due = now_us >= self.checkpoint_at_us && !self.machine.is_empty();
        due.then_some(self.checkpoint_after)
    }

    /// A checkpoint was proposed: the next continues after `last` (0: from the start) and is
    /// due at `next_at_us`.
    pub fn checkpoint_proposed(&mut self, last: u64, next_at_us: u64) {
        self.checkpoint_after = last;
        self.checkpoint_at_us = next_at_us;
    }
}

/// The lease timers of a serving leader (armed by the partition on its core's wheel).
impl Shard {
    /// The epoch the lease timers armed now belong to.
    pub fn lease_epoch(&self) -> u32 {
        self.lease_epoch
    }

    /// Records `token`'s lease timer, returning the one it replaces (to cancel).
    pub fn set_lease_timer(&mut self, token: u64, timer: TimerHandle) -> Option<TimerHandle> {
        self.leases.insert(token, timer)
    }

    /// Forgets `token`'s lease timer, returning it (to cancel, unless it fired).
    pub fn take_lease_timer(&mut self, token: u64) -> Option<TimerHandle> {
        self.leases.remove(&token)
    }

    /// Forgets every lease timer: those on the wheel are stale from now on.
    pub fn drop_lease_timers(&mut self) {
        self.leases.clear();
        self.lease_epoch = self.lease_epoch.wrapping_add(1);
    }

    /// Lease timers armed (tests).
    #[cfg(test)]
    pub fn lease_timers(&self) -> usize {
        self.leases.len()
    }
}

/// Compactions and restores.
impl Shard {
    /// The applied index a compaction would freeze now, if one is due: `every` entries applied
    /// since the last, and none in flight.
    pub fn compaction_due(&self, every: u64) -> Option<u64> {
        let applied = self.machine.applied();
        let due = self.compacting.is_none() && applied >= self.compacted_at + every.max(1);
        due.then_some(applied)
    }

    /// The image frozen at `index` went to the compactor.
    pub fn compaction_started(&mut self, index: u64) {
        self.compacting = Some(index);
    }

    /// The compaction at `index` came back: recorded by the member (`recorded`), or dropped.
    pub fn compaction_done(&mut self, index: u64, recorded: bool) {
        debug_assert_eq!(self.compacting, Some(index));
        self.compacting = None;
        if recorded {
            self.compacted_at = self.compacted_at.max(index);
        }
    }

    /// The index of the compaction in flight.
    #[cfg(test)]
    pub fn compacting(&self) -> Option<u64> {
        self.compacting
    }

    /// Whether committed entries must wait behind a restore being decoded.
    pub fn restoring(&self) -> bool {
        !self.held.is_empty()
    }

    /// Whether nothing waits for a restore (nothing held, nothing decoded).
    #[cfg(test)]
    pub fn restores_settled(&self) -> bool {
        self.held.is_empty() && self.decoded.is_empty()
    }

    /// The snapshot at `index` is being decoded: entries committed after it wait behind it.
    pub fn hold_restore(&mut self, index: u64) {
        self.held.push_back(Held::Restore(index));
    }

    /// `entry` waits behind a restore being decoded.
    pub fn hold_entry(&mut self, entry: Committed) {
        debug_assert!(self.restoring());
        self.held.push_back(Held::Entry(entry));
    }

    /// Keeps the machine decoded for the restore at `index` until its turn.
    pub fn keep_decoded(&mut self, index: u64, machine: Box<ShardMachine>) {
        self.decoded.insert(index, machine);
    }

    /// The front restore, once its machine is decoded, with the entries held behind it.
    pub fn take_ready_restore(&mut self) -> Option<ReadyRestore> {
        let Some(Held::Restore(index)) = self.held.front() else {
            return None;
        };
        let index = *index;
        let machine = self.decoded.remove(&index)?;
        self.held.pop_front();
        let mut entries = Vec::new();
        while let Some(Held::Entry(_)) = self.held.front() {
            if let Some(Held::Entry(entry)) = self.held.pop_front() {
                entries.push(entry);
            }
        }
        Some(ReadyRestore {
            machine,
            index,
            entries,
        })
    }
}

/// The grants this member answered.
impl Shard {
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

    /// The grant of `token` this member answered, if it did (and it is still recorded).
    pub fn granted(&self, token: u64) -> Option<Granted> {
        self.grants.get(&token).copied()
    }

    /// Grants recorded.
    #[cfg(test)]
    fn grants_recorded(&self) -> usize {
        self.grants.len()
    }
}

/// The queues (leader only; see [`Queues`]).
impl Shard {
    /// Queues `waiter` at the back of `key`'s queue.
    pub fn enqueue(&mut self, key: &[u8], waiter: Waiter) {
        self.queues.enqueue(key, waiter);
    }

    /// Waiters in all queues.
    pub fn waiter_count(&self) -> usize {
        self.queues.len()
    }

    /// The length of `key`'s queue.
    pub fn queue_len(&self, key: &[u8]) -> usize {
        self.queues.queue_len(key)
    }

    /// The waiters of `key` as docs/protocol.md §3 counts them: see [`Queues::waiting_len`].
    pub fn waiting_len(&self, key: &[u8]) -> usize {
        self.queues.waiting_len(key)
    }

    /// The head of `key`'s queue.
    pub fn head(&self, key: &[u8]) -> Option<Head> {
        self.queues.head(key)
    }

    /// The head of `key`'s queue, whole (tests).
    #[cfg(test)]
    pub fn head_waiter(&self, key: &[u8]) -> Option<&Waiter> {
        self.queues.head_waiter(key)
    }

    /// The waiter `seq` of `key`'s queue.
    pub fn waiter(&self, key: &[u8], seq: u64) -> Option<&Waiter> {
        self.queues.waiter(key, seq)
    }

    /// Whether the head of `key`'s queue is abandoned or its wait ended by `now_us`.
    pub fn head_is_over(&self, key: &[u8], now_us: u64) -> bool {
        self.queues.head_is_over(key, now_us)
    }

    /// See [`Queues::pop_head`].
    pub fn pop_head(&mut self, key: &[u8], places: &mut Places) -> Option<Waiter> {
        self.queues.pop_head(key, places)
    }

    /// See [`Queues::propose_head`].
    pub fn propose_head(&mut self, key: &[u8], handoff: bool, now_us: u64, places: &mut Places) {
        self.queues.propose_head(key, handoff, now_us, places);
    }

    /// See [`Queues::unpropose_head`].
    pub fn unpropose_head(&mut self, key: &[u8], places: &mut Places) -> bool {
        self.queues.unpropose_head(key, places)
    }

    /// See [`Queues::abandon_proposed`].
    pub fn abandon_proposed(&mut self, key: &[u8], seq: u64, places: &mut Places) -> bool {
        self.queues.abandon_proposed(key, seq, places)
    }

    /// See [`Queues::remove_where`].
    pub fn remove_where(
        &mut self,
        key: &[u8],
        places: &mut Places,
        remove: impl FnMut(&Waiter) -> bool,
    ) -> Vec<Waiter> {
        self.queues.remove_where(key, places, remove)
    }

    /// See [`Queues::attach`].
    pub fn attach(
        &mut self,
        key: &[u8],
        owner: u64,
        client: (ClientRef, u128),
        to: (SessionId, &mut Places),
    ) -> Option<Option<(u64, u64)>> {
        let attached = self.queues.attach(key, owner, client, to);
        self.check_invariants();
        attached
    }

    /// See [`Queues::attach_adopted`].
    pub fn attach_adopted(
        &mut self,
        key: &[u8],
        owner: u64,
        client: (ClientRef, u128),
        to: (SessionId, &mut Places),
    ) -> Option<(u64, u64)> {
        let attached = self.queues.attach_adopted(key, owner, client, to);
        self.check_invariants();
        attached
    }

    /// See [`Queues::has_owner`].
    pub fn has_owner(&self, key: &[u8], owner: u64) -> bool {
        self.queues.has_owner(key, owner)
    }

    /// See [`Queues::set_mirrored`].
    pub fn set_mirrored(&mut self, key: &[u8], seq: u64) {
        self.queues.set_mirrored(key, seq);
    }

    /// See [`Queues::take_withdrawn`].
    pub fn take_withdrawn(&mut self) -> Vec<Withdrawn> {
        self.queues.take_withdrawn()
    }

    /// See [`Queues::pop_granted_head`].
    pub fn pop_granted_head(&mut self, key: &[u8], places: &mut Places) -> Option<Waiter> {
        self.queues.pop_granted_head(key, places)
    }

    /// See [`Queues::close_session`].
    pub fn close_session(&mut self, session: SessionId, places: &mut Places) {
        self.queues.close_session(session, places);
        self.check_invariants();
    }

    /// See [`Queues::detach_session`].
    pub fn detach_session(&mut self, session: SessionId, detached: SessionId, places: &mut Places) {
        self.queues.detach_session(session, detached, places);
        self.check_invariants();
    }

    /// The server shuts down: every proposed head not abandoned yet is abandoned (to be
    /// answered `B` once its entry decides; a grant that still commits for it is released),
    /// returned with its key, and every other waiter leaves (to be answered `B` or `M`).
    pub fn shut_down(&mut self, places: &mut Places) -> (Vec<(Vec<u8>, Head)>, Vec<Waiter>) {
        let heads = self.queues.abandon_proposed_heads(places);
        let waiters = self.queues.take_unproposed(places);
        self.check_invariants();
        (heads, waiters)
    }

    /// The head of `key`'s queue as the `then` of a release or expiry of `token`: when it
    /// waits (is not proposed) and `token` holds the key in the applied state, so that the
    /// entry will very likely free the key.
    pub fn waiting_head(&self, key: &[u8], token: u64) -> Option<Grant> {
        let head = self.queues.head(key)?;
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
        self.machine.len() + self.queues.proposed()
    }

    /// Waiters that hold a place, of `session` or (`None`) of any session.
    pub fn counted(&self, session: Option<SessionId>) -> usize {
        self.queues.counted(session)
    }

    /// Checks the shard's invariants (debug builds, after every change of the queues).
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
            self.queues.check_invariants();
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
            .machine_mut()
            .apply(1, &Command::Barrier { floor: 1_000 }, 0);
        let mut index = 1;
        let mut live: Vec<(Vec<u8>, u64)> = Vec::new();
        let mut most = 0;
        // 100 keys held at a time; each round releases the oldest and grants a new one.
        for round in 0..5_000u64 {
            if live.len() == 100 {
                let (key, token) = live.remove(0);
                index += 1;
                shard.machine_mut().apply(
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
            shard.machine_mut().apply(index, &command, 0);
            let token = shard.machine().holder(&key).expect("granted").token;
            shard.record_grant(token, 1, round);
            live.push((key, token));
            most = most.max(shard.grants_recorded());
            for (_, token) in &live {
                assert!(shard.granted(*token).is_some(), "a live grant was dropped");
            }
        }
        assert!(most <= 2 * 100 + 2, "the record grew to {most}");
    }
}
