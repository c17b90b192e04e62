//! Clients' acquires, cancels and queries on a shard this member serves, and the answers
//! of acquires.
//!
//! The single node's limits hold here with its rules (docs/protocol.md §3), decided by the
//! shard's leader before anything is proposed, so a refused acquire leaves nothing in the log:
//! * `max_keys`: an acquire of a free key (no hold, no queue) while the shard's holds and
//!   grants in flight number `max_keys / shards` gets `B` (each shard is a partition of the key
//!   space, as each core is on a single node). Members' configs may differ, so the machine's
//!   own cap, applied on every member, is a constant ([`crate::cluster::machine::HOLDS_MAX`]).
//! * `max_waiters_per_key`: an acquire with wait > 0 on a key whose queue is full gets `B`.
//! * `max_pending_per_session`: an acquire with wait > 0 that must queue (its key is held or
//!   has a queue) while its session has that many queued gets `B`; one on a free key is
//!   proposed at once and, as a grant at once on a single node, never counts.

use super::{ClusterPartition, Peers, PendingKind, PendingRead};
use crate::cluster::machine::Command;
use crate::cluster::shard::Waiter;
use crate::cluster::writer::LogWriter;
use crate::lock_table::{BusyReason, SessionId};
use crate::protocol::Response;

/// Up to this many queued waiters, debug builds check every place before each acquire.
const PLACES_CHECKED_WAITERS_MAX: usize = 4096;

impl<D: LogWriter, P: Peers> ClusterPartition<D, P> {
    /// An acquire: queued behind the key's queue, or proposed at once when the queue is empty.
    /// A `wait = 0` acquire never queues: with others queued it is answered `T`.
    pub(super) fn acquire(
        &mut self,
        shard: u32,
        session: SessionId,
        key: &[u8],
        (wait_s, lease_s, owner): (u8, u8, u64),
    ) {
        let ends_pending = wait_s > 0;
        if self.shutting_down {
            return self.busy(session, owner, ends_pending, BusyReason::Shutdown);
        }
        self.check_places();
        let local = self.local(shard);
        let queued = self.shards[local].queue_len(key);
        let free = queued == 0 && self.shards[local].machine.holder(key).is_none();
        if free && self.shards[local].holds_and_grants() >= self.settings.max_keys_per_shard {
            return self.busy(session, owner, ends_pending, BusyReason::Keys);
        }
        if queued > 0 && wait_s == 0 {
            self.stats.timed_out += 1;
            return self.answer(session, Response::Timeout { owner }, false);
        }
        if queued >= self.settings.max_waiters_per_key as usize {
            return self.busy(session, owner, ends_pending, BusyReason::WaitersPerKey);
        }
        // Taken last: a place taken (in shared counts too) is always followed by the enqueue.
        let counted = ends_pending && !free;
        if counted && !self.places.try_take(session) {
            return self.busy(session, owner, true, BusyReason::PendingPerSession);
        }
        let deadline_us = self.now_us + u64::from(wait_s) * 1_000_000;
        let seq = self.seq();
        let waiter = Waiter {
            session,
            owner,
            lease_ms: u32::from(lease_s) * 1000,
            received_us: self.now_us,
            deadline_us,
            ends_pending,
            seq,
            proposed: false,
            abandoned: false,
            counted,
        };
        self.shards[local].enqueue(key, waiter);
        if wait_s > 0 {
            self.wait_timers
                .insert((deadline_us, seq), (shard, key.to_vec()));
        }
        if queued == 0 {
            self.propose_head(shard, key);
        }
        self.shards[local].check_invariants();
    }

    /// Proposes the `Acquire` of the head of `key`'s queue, unless it is proposed already.
    /// A head that cannot be proposed (leadership just lost) is answered `M`.
    pub(super) fn propose_head(&mut self, shard: u32, key: &[u8]) {
        let local = self.local(shard);
        let Some(head) = self.shards[local].head_mut(key) else {
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
            self.shards[local].set_head_proposed(key, true);
        } else if let Some(head) = self.shards[local].pop_head(key, &mut self.places) {
            let response = self.moved(shard, head.owner);
            self.answer(head.session, response, head.ends_pending);
        }
    }

    /// Cancel: every queued, unproposed acquire of `owner` from `session` on `key` leaves
    /// with `T`. A proposed one is decided by its entry (the client's Cancel then waits for
    /// that single answer, as PROTOCOL.md §4.4 says).
    pub(super) fn cancel(&mut self, shard: u32, session: SessionId, key: &[u8], owner: u64) {
        self.stats.cancels += 1;
        let local = self.local(shard);
        let removed = self.shards[local].remove_where(key, &mut self.places, |w| {
            w.session == session && w.owner == owner
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
            let holder = shard.machine.holder(&read.key);
            let lease_ms = holder.map_or(0, |hold| hold.deadline_ms.saturating_sub(now_ms));
            let response = Response::State {
                nonce: read.nonce,
                held: holder.is_some(),
                lease_ms: u32::try_from(lease_ms).unwrap_or(u32::MAX),
                waiters: shard.queue_len(&read.key) as u32,
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

    /// The grant of the head of `key`'s queue was applied with `token`: answer it (the answer
    /// names the shard as its entry, so that an undelivered grant comes back here to be
    /// released), or release it at once if its waiter was abandoned.
    ///
    /// A grant applied a whole lease after its request arrived (this member lost its quorum
    /// and applies it only on rejoining) is stale: the rest of the cluster may have expired it
    /// and granted the key again since, so an `A` now would name an older token after a newer
    /// one. The client, counting from its send time, holds nothing any more anyway: it gets
    /// `T` and the grant is released.
    pub(super) fn answer_grant(&mut self, shard: u32, key: &[u8], token: u64) {
        let local = self.local(shard);
        let Some(head) = self.shards[local].pop_head(key, &mut self.places) else {
            return;
        };
        let lease_over_us = head.received_us + u64::from(head.lease_ms) * 1000;
        if head.abandoned || self.now_us >= lease_over_us {
            let command = Command::Release {
                key: key.to_vec(),
                token,
            };
            let nobody = crate::server::core::NOBODY;
            self.propose(shard, &command, nobody, PendingKind::Orphan);
            if !head.abandoned {
                self.stats.timed_out += 1;
                let response = Response::Timeout { owner: head.owner };
                self.answer(head.session, response, head.ends_pending);
            }
            return;
        }
        self.stats.acquired += 1;
        self.shards[local].record_grant(token, head.session, self.now_us);
        self.answers.push(crate::lock_table::Answer {
            session: head.session,
            response: Response::Acquired {
                owner: head.owner,
                token,
            },
            ends_pending: head.ends_pending,
            entry: shard,
        });
    }

    /// Checks that the places held are exactly those of the queued waiters that hold one (debug
    /// builds, up to [`PLACES_CHECKED_WAITERS_MAX`] waiters: it is O(waiters); before each
    /// acquire, so a way out of a queue that forgot its place shows at the next acquire).
    pub(super) fn check_places(&self) {
        let waiters: usize = self.shards.iter().map(|shard| shard.waiters).sum();
        if cfg!(debug_assertions) && waiters <= PLACES_CHECKED_WAITERS_MAX {
            let counted: usize = self.shards.iter().map(|shard| shard.counted(None)).sum();
            assert_eq!(counted, self.places.held(), "places held by queued waiters");
        }
    }
}

#[cfg(test)]
#[path = "limits_tests.rs"]
mod tests;
