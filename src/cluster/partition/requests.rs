//! Clients' acquires, cancels and queries on a shard this member serves, the proposals that
//! grant queue heads, and the answers of acquires.
//!
//! The queue rules are the single node's (docs/protocol.md §3), decided by the same functions
//! ([`crate::partition::rules`]) — by the shard's leader, from its applied state and its queues,
//! before anything is proposed, so that an acquire that changes nothing leaves nothing in the
//! log (`tests/queue_rules.rs` checks both partitions against one model of those rules). What
//! the cluster adds is how it carries them out:
//! * `wait = 0` on a key the applied state shows held, or with a queue, is answered `T` at
//!   once: no entry, no sync (docs/cluster-design.md says why that is safe).
//! * `wait > 0` on such a key queues without an entry: the head of a held key's queue is
//!   granted by the entry that ends the hold — the holder's release or the leader's expiry
//!   carries it as `then` (one commit per handoff). Only an acquire of a free key is proposed
//!   as an `Acquire` at once.
//! * `max_keys`: an acquire of a free key (no hold, no queue) while the shard's holds and
//!   grants in flight number `max_keys / shards` gets `B` (each shard is a partition of the key
//!   space, as each core is on a single node). Members' configs may differ, so the machine's
//!   own cap, applied on every member, is a constant ([`crate::config::HOLDS_MAX`]).
//! * `max_waiters_per_key`: an acquire with wait > 0 on a key whose queue is full gets `B`. A
//!   queue head with its grant in the log is not counted: on a single node it would hold the
//!   key already (granted in the step that freed it, or at once on a free key).
//! * `max_pending_per_session`: an acquire with wait > 0 that must queue (its key is held or
//!   has a queue) while its session has that many queued gets `B`; one on a free key is
//!   proposed at once and, as a grant at once on a single node, never counts; a queued one
//!   stops counting when its grant is proposed, for the same reason.

use super::{ClusterPartition, Peers, PendingKind, PendingRead};
use crate::cluster::machine::{Command, Grant};
use crate::cluster::shard::Waiter;
use crate::cluster::writer::LogWriter;
use crate::partition::rules::{self, AcquireView, Admit};
use crate::partition::GrantRef;
use crate::partition::{is_detached, NOBODY};
use crate::partition::{BusyReason, ClientRef, SessionId};
use latchkey_client::protocol::Response;

/// Up to this many queued waiters, debug builds check every place before each acquire.
const PLACES_CHECKED_WAITERS_MAX: usize = 4096;

/// How a hold ends (see [`ClusterPartition::propose_end`]).
#[derive(Clone, Copy, Debug)]
pub(super) enum End {
    /// A release of the token (a client's, or the leader's of an orphan grant).
    Release,
    /// The leader's expiry, decided with its applied index `as_of`.
    Expire {
        /// See [`Command::Expire`].
        as_of: u64,
    },
}

impl<D: LogWriter, P: Peers> ClusterPartition<D, P> {
    /// An acquire: proposed at once on a free key, answered `T` at once (wait 0) or queued
    /// (wait > 0) on a held one; `B` at a limit or during shutdown.
    pub(super) fn acquire(
        &mut self,
        shard: u32,
        (session, client): (SessionId, ClientRef),
        key: &[u8],
        (wait_s, lease_s, owner): (u8, u8, u64),
    ) {
        let ends_pending = wait_s > 0;
        if self.forgotten(session, owner) {
            return self.busy(session, owner, ends_pending, BusyReason::Resolved);
        }
        self.check_places();
        let local = self.local(shard);
        if wait_s > 0 && self.attach_adopted(shard, (session, client), key, owner) {
            return;
        }
        let state = &self.shards[local];
        let free = state.queue_len(key) == 0 && state.machine().holder(key).is_none();
        // The rules are the single node's ([`rules::admit`]), decided from the applied state
        // and the queues. A `wait = 0` acquire of a key held (as this leader applied it) or
        // queued is answered `T` at once, with no entry and no sync: `T` promises nothing (a
        // release still in the log makes it no less true, "held when asked") and the acquire
        // never queued (docs/cluster-design.md).
        let view = AcquireView {
            shutting_down: self.shutting_down,
            taken: !free,
            room_for_key: state.holds_and_grants() < self.settings.max_keys_per_shard,
            waiters: u32::try_from(state.waiting_len(key)).unwrap_or(u32::MAX),
            max_waiters_per_key: self.settings.max_waiters_per_key,
            wait_s,
        };
        let counted = match rules::admit(&view, &mut self.places, session) {
            Admit::Grant => false,
            Admit::Queue => true,
            Admit::Timeout => {
                self.stats.timed_out += 1;
                return self.answer(session, Response::Timeout { owner }, false);
            }
            // A member that stops executes nothing more; the cluster goes on without it.
            Admit::Busy(BusyReason::Shutdown) => {
                return self.refuse_at_shutdown(shard, session, owner, ends_pending);
            }
            Admit::Busy(reason) => return self.busy(session, owner, ends_pending, reason),
        };
        let deadline_us = self.now_us + u64::from(wait_s) * 1_000_000;
        let lease_ms = u32::from(lease_s) * 1000;
        let seq = self.seq();
        let waiter = Waiter {
            session,
            client,
            owner,
            lease_ms,
            proposed_us: 0,
            deadline_us,
            ends_pending,
            seq,
            proposed: false,
            handoff: false,
            abandoned: false,
            counted,
            mirrored: false,
            origin: 0,
            wait_end_us: deadline_us,
        };
        self.shards[local].enqueue(key, waiter);
        if counted {
            // One that had to queue is mirrored in the replicated state if it still waits a
            // little later (mirror.rs).
            self.mirror_later(shard, key, (seq, client), (owner, lease_ms, wait_s));
        }
        if wait_s > 0 {
            self.arm_wait(shard, key, seq, deadline_us);
        }
        if free {
            self.propose_head(shard, key);
        }
        self.shards[local].check_invariants();
    }

    /// An acquire with a wait, sent again by the client of an adopted waiter of `key` with
    /// the same owner (its old leader answered `M`): the waiter is attached to `session` in its
    /// place, its wait ending at this member's deadline for it (mirror.rs). False if there is
    /// none.
    fn attach_adopted(
        &mut self,
        shard: u32,
        (session, client): (SessionId, ClientRef),
        key: &[u8],
        owner: u64,
    ) -> bool {
        let id = self.client_id(client);
        if id == 0 {
            return false;
        }
        if self.adopted_ended(id, owner) {
            // Adopted here and ended unattached: that acquire timed out (its grant, if it had
            // one, was released); sent again, it is not executed a second time. Held while
            // its `Withdraw` may be in flight (a later leader could adopt it again).
            self.stats.timed_out += 1;
            self.answer_held((shard, key), session, Response::Timeout { owner }, true);
            return true;
        }
        let local = self.local(shard);
        // Granted already — to the adopted waiter, or by an entry an earlier leader proposed
        // and this one applied — and answered by no session here: this is the same acquire,
        // so the same grant answers it (executed once), after an `Extend` of its lease, which
        // the client counts from this request's send (the grant came before).
        let hold = self.shards[local].machine().holder(key);
        let hold = hold.filter(|hold| hold.owner == owner);
        let hold = hold.map(|hold| (hold.token, hold.lease_ms));
        let answered = |token: &u64| self.shards[local].granted(*token).is_some();
        if let Some((token, lease_ms)) = hold.filter(|(token, _)| !answered(token)) {
            self.adopted_grant_delivered(token);
            let command = Command::Extend {
                key: key.to_vec(),
                token,
                lease_ms,
            };
            if !self.propose(shard, &command, session, PendingKind::Regrant { owner }) {
                let response = self.moved(shard, owner);
                self.answer(session, response, true);
            }
            return true;
        }
        let to = (session, &mut self.places);
        let attached = self.shards[local].attach_adopted(key, owner, (client, id), to);
        let Some((seq, deadline_us)) = attached else {
            return false;
        };
        self.arm_wait(shard, key, seq, deadline_us);
        true
    }

    /// Proposes the `Acquire` of the head of `key`'s queue if it waits and the key is free in
    /// the applied state (a head of a held key waits for the entry that ends the hold). A head
    /// that cannot be proposed (leadership just lost) is answered `M`.
    pub(super) fn propose_head(&mut self, shard: u32, key: &[u8]) {
        let local = self.local(shard);
        if self.shards[local].machine().holder(key).is_some() {
            return;
        }
        let Some(head) = self.shards[local].head(key) else {
            return;
        };
        if head.proposed {
            return;
        }
        let (session, owner, lease_ms) = (head.session, head.owner, head.lease_ms);
        let command = Command::Acquire {
            key: key.to_vec(),
            owner,
            lease_ms,
        };
        let kind = PendingKind::Acquire { key: key.to_vec() };
        if self.propose(shard, &command, session, kind) {
            self.shards[local].propose_head(key, false, self.now_us, &mut self.places);
        } else if let Some(head) = self.shards[local].pop_head(key, &mut self.places) {
            let response = self.moved(shard, head.owner);
            self.answer(head.session, response, head.ends_pending);
        }
    }

    /// Proposes the end of `token`'s hold on `key` — a client's release, an orphan's, or the
    /// leader's expiry — with the head of the key's queue as its `then` when the head waits
    /// and `token` holds the key in the applied state: one entry frees the key and grants it.
    /// False when this member cannot propose.
    pub(super) fn propose_end(
        &mut self,
        shard: u32,
        key: &[u8],
        token: u64,
        end: End,
        session: SessionId,
        kind: PendingKind,
    ) -> bool {
        let local = self.local(shard);
        let then: Option<Grant> = self.shards[local].waiting_head(key, token);
        let key = key.to_vec();
        let command = match end {
            End::Release => Command::Release { key, token, then },
            End::Expire { as_of } => Command::Expire {
                key,
                token,
                as_of,
                then,
            },
        };
        self.propose(shard, &command, session, kind)
    }

    /// Cancel: every queued, unproposed acquire of `owner` from `session` on `key` leaves
    /// with `T`. A proposed one is decided by its entry (the client's Cancel then waits for
    /// that single answer, as docs/protocol.md §4.4 says).
    pub(super) fn cancel(&mut self, shard: u32, session: SessionId, key: &[u8], owner: u64) {
        self.stats.cancels += 1;
        let local = self.local(shard);
        let removed = self.shards[local].remove_where(key, &mut self.places, |w| {
            rules::withdraws((w.session, w.owner), (session, owner))
        });
        for waiter in removed {
            self.stats.timed_out += 1;
            self.answer(
                waiter.session,
                Response::Timeout { owner },
                waiter.ends_pending,
            );
        }
        self.shards[local].check_invariants();
    }

    /// Query: a ReadIndex round; answered once the state has applied the read index.
    pub(super) fn query(&mut self, shard: u32, session: SessionId, key: &[u8], nonce: u64) {
        let seq = self.seq();
        match self.member.read_index(shard, seq.to_be_bytes().to_vec()) {
            Ok(()) => {
                let read = PendingRead {
                    shard,
                    session,
                    nonce,
                    key: key.to_vec(),
                    after: self.shards[self.local(shard)].last_proposed(),
                    index: None,
                };
                self.reads.insert(seq, read);
            }
            Err(_) => {
                let response = self.moved(shard, nonce);
                self.answer(session, response, false);
            }
        }
    }

    /// Answers the queries whose read index the state has reached.
    pub(super) fn serve_reads(&mut self) {
        let ready: Vec<u64> = self
            .reads
            .iter()
            .filter(|(_, read)| {
                read.index.is_some_and(|index| {
                    self.machine(read.shard)
                        .is_some_and(|machine| machine.applied() >= index)
                })
            })
            .map(|(seq, _)| *seq)
            .collect();
        let now_ms = self.now_ms();
        for seq in ready {
            let Some(read) = self.reads.remove(&seq) else {
                continue;
            };
            let local = self.local(read.shard);
            let shard = &self.shards[local];
            let holder = shard.machine().holder(&read.key);
            // At most the lease granted: the deadline counts from a rounded-up apply time.
            let lease_ms = holder.map_or(0, |hold| {
                let left_ms = hold.deadline_ms.saturating_sub(now_ms);
                left_ms.min(u64::from(hold.lease_ms))
            });
            let response = Response::State {
                nonce: read.nonce,
                held: holder.is_some(),
                lease_ms: u32::try_from(lease_ms).unwrap_or(u32::MAX),
                waiters: shard.waiting_len(&read.key) as u32,
            };
            self.answer(read.session, response, false);
        }
    }

    /// `B` for an acquire, counted.
    pub(super) fn busy(
        &mut self,
        session: SessionId,
        owner: u64,
        ends_pending: bool,
        reason: BusyReason,
    ) {
        self.stats.busy.count(reason);
        self.answer(session, Response::Busy { owner }, ends_pending);
    }

    /// The grant of the head of `key`'s queue was applied with `token` (by its `Acquire` or
    /// as a handoff): answer it (the answer names the shard as its entry, so that an
    /// undelivered grant comes back here to be released), or release it at once if its waiter
    /// was abandoned — handing the key on to the next waiter in the same entry.
    ///
    /// A grant applied a whole lease after the entry that granted it was proposed (this member
    /// lost its quorum and applies it only on rejoining) is stale: the rest of the cluster,
    /// which applied the entry no earlier than it was proposed and counts the lease from
    /// there, may have expired it and granted the key again since, so an `A` now would name an
    /// older token after a newer one. The client gets `T` and the grant is released. (Counted
    /// from the proposal, not from the request's arrival: a waiter that queued longer than its
    /// lease is granted normally.)
    pub(super) fn answer_grant(&mut self, shard: u32, key: &[u8], token: u64) {
        let local = self.local(shard);
        let Some(head) = self.shards[local].pop_granted_head(key, &mut self.places) else {
            return;
        };
        let lease_over_us = head.proposed_us + u64::from(head.lease_ms) * 1000;
        if is_detached(head.session) && !head.abandoned && self.now_us < lease_over_us {
            // Its client has no session: the grant waits for a Resolve, or its grace.
            self.stats.acquired += 1;
            if head.origin != 0 {
                let until_us = head.deadline_us.max(self.now_us);
                let adopted = (head.origin, head.owner);
                return self.keep_adopted_grant((shard, token), adopted, until_us);
            }
            return self.keep_undelivered(head.client, shard, token);
        }
        if head.abandoned || self.now_us >= lease_over_us {
            let orphan = PendingKind::Orphan { token };
            self.propose_end(shard, key, token, End::Release, NOBODY, orphan);
            if !head.abandoned {
                // Held until that release applies: the replicated state holds the key for
                // this owner until then.
                self.stats.timed_out += 1;
                let response = Response::Timeout { owner: head.owner };
                self.answer_held((shard, key), head.session, response, head.ends_pending);
            }
            return;
        }
        let to = (head.session, head.ends_pending);
        self.answer_acquired(shard, to, head.owner, token);
    }

    /// `A` of `owner`'s acquire with `token` to `session` (`ends_pending`: see
    /// [`crate::partition::Answer`]), counted and recorded as this member's grant; the answer
    /// names the shard, so that a grant it does not deliver comes back here to be released.
    pub(super) fn answer_acquired(
        &mut self,
        shard: u32,
        (session, ends_pending): (SessionId, bool),
        owner: u64,
        token: u64,
    ) {
        self.stats.acquired += 1;
        let local = self.local(shard);
        self.shards[local].record_grant(token, session, self.now_us);
        self.answers.push(crate::partition::Answer {
            session,
            response: Response::Acquired { owner, token },
            ends_pending,
            grant: GrantRef(shard),
        });
    }

    /// The entry proposed for the head of `key`'s queue did not grant it the key (an
    /// `Acquire` found it held, or a release or expiry carrying it had no effect): the head
    /// waits again — or, abandoned or with its wait over, leaves (`T` if not answered yet) —
    /// and a key left free goes to the next waiter.
    pub(super) fn head_missed(&mut self, shard: u32, key: &[u8]) {
        let local = self.local(shard);
        if !self.shards[local].unpropose_head(key, &mut self.places) {
            return;
        }
        let over = self.shards[local].head_is_over(key, self.now_us);
        if over {
            let head = self.shards[local].pop_head(key, &mut self.places);
            let head = head.expect("a head");
            if !head.abandoned {
                self.stats.timed_out += 1;
                let response = Response::Timeout { owner: head.owner };
                self.answer(head.session, response, head.ends_pending);
            }
        }
        if self.serving(shard) {
            self.propose_head(shard, key);
        }
        self.shards[local].check_invariants();
    }

    /// Checks that the places held are exactly those of the queued waiters that hold one (debug
    /// builds, up to [`PLACES_CHECKED_WAITERS_MAX`] waiters: it is O(waiters); before each
    /// acquire, so a way out of a queue that forgot its place shows at the next acquire).
    pub(super) fn check_places(&self) {
        if !cfg!(debug_assertions) {
            return;
        }
        let waiters: usize = self.shards.iter().map(|shard| shard.waiter_count()).sum();
        if waiters <= PLACES_CHECKED_WAITERS_MAX {
            let counted: usize = self.shards.iter().map(|shard| shard.counted(None)).sum();
            assert_eq!(counted, self.places.held(), "places held by queued waiters");
            for (session, held) in self.places.iter() {
                let counted: usize = self.shards.iter().map(|s| s.counted(Some(session))).sum();
                assert_eq!(counted, held as usize, "session {session:#x}'s places");
            }
        }
    }
}

#[cfg(test)]
#[path = "limits_tests.rs"]
mod tests;
