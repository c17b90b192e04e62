//! One iteration's work of a cluster partition: peers' messages, ticks, wait timers, the
//! leader's expiries and checkpoints, the drain to the core's writer, and applying what committed
//! (with the compactions: a shard's machine is frozen every `compact_every` entries, encoded by
//! the core's compactor off the loop, and handed to the member at the start of a later drain;
//! and the restores: a received snapshot is decoded by the compactor too, and the shard's
//! committed entries wait behind it until its machine is installed).
//!
//! # Stopping the member
//!
//! Some failures leave this member unable to keep its promises, and it stops rather than go
//! on ([`stop_member`]): a write or sync of the write-ahead log that failed (what is on disk is
//! unknown, and the log refuses every later write), a snapshot that does not restore, a
//! committed entry that does not decode (skipping either would leave this replica's state apart
//! from the others', silently), and a compactor that failed (its thread died: the member would
//! never compact again). Peers' messages are checked before raft takes them
//! (`crate::cluster::peer::content`), so only a bug or damage on disk gets here. Stopping is
//! an `error!` line naming the shard, the index or the operation, then a panic of the core
//! thread: the server's existing failure path (`crate::server`'s failure guard) marks the
//! server failed, stops the other cores, and the binary exits 70. A panic is chosen over
//! unwinding by hand because the member's groups have advanced past writes whose fate is
//! unknown; nothing else may run on it after.

use super::requests::End;
use super::{
    ClusterPartition, Peers, Pending, PendingKind, CHECKPOINT_EVERY_US, CHECKPOINT_HOLDS,
    EXPIRIES_PER_ITERATION, INBOUND_PER_ITERATION, PROMOTE_GRACE_MS, TICKS_CAUGHT_UP_MAX, TICK_US,
};
use crate::cluster::compactor::{RestoreJob, Restored};
use crate::cluster::machine::{Applied, Command, ShardMachine};
use crate::cluster::member::{Committed, EntryKind, LeaderChanged, ReadReady};
use crate::cluster::shard::{Held, Role};
use crate::cluster::writer::LogWriter;
use crate::partition::BusyReason;
use crate::partition::NOBODY;
use latchkey_client::protocol::Response;
use std::time::SystemTime;

impl<D: LogWriter, P: Peers> ClusterPartition<D, P> {
    pub(super) fn step_inbound(&mut self) {
        for _ in 0..INBOUND_PER_ITERATION {
            let Some((shard, message)) = self.peers.try_recv() else {
                return;
            };
            if let Err(error) = self.member.step(shard, message) {
                // Expected now and then (a message for a term long gone); a peer's hostile
                // messages are refused and counted before they get here.
                log::debug!("shard {shard}: message refused: {error}");
            }
        }
    }

    pub(super) fn tick(&mut self) {
        if self.next_tick_us == 0 {
            self.next_tick_us = self.now_us + TICK_US;
            return;
        }
        let mut ticks = 0;
        while self.now_us >= self.next_tick_us && ticks < TICKS_CAUGHT_UP_MAX {
            self.member.tick();
            self.next_tick_us += TICK_US;
            ticks += 1;
        }
        if self.now_us >= self.next_tick_us {
            self.next_tick_us = self.now_us + TICK_US;
        }
    }

    /// Queued acquires whose wait ended: `T` (a proposed one is answered now and its grant,
    /// if it still commits, released) — except a head whose key's lease ran out before its
    /// wait did (this iteration is late): as on a single node (docs/protocol.md §3, deadline
    /// order), the expiry is proposed now and hands it the key.
    pub(super) fn fire_wait_timers(&mut self) {
        while let Some(entry) = self.wait_timers.first_entry() {
            let (deadline, seq) = *entry.key();
            if deadline > self.now_us {
                return;
            }
            let (shard, key) = entry.remove();
            let local = self.local(shard);
            let queue = self.shards[local].queues.get(&key);
            let Some(waiter) = queue.and_then(|queue| queue.iter().find(|w| w.seq == seq)) else {
                continue;
            };
            let (session, owner, ends) = (waiter.session, waiter.owner, waiter.ends_pending);
            if !waiter.proposed && self.expire_before_wait(shard, &key, seq, deadline) {
                continue;
            }
            let queue = self.shards[local].queues.get_mut(&key);
            let waiter = queue.and_then(|queue| queue.iter_mut().find(|w| w.seq == seq));
            let waiter = waiter.expect("the waiter found above");
            if waiter.proposed {
                if waiter.abandoned {
                    continue;
                }
                self.places.abandon(waiter);
            } else {
                self.shards[local].remove_where(&key, &mut self.places, |w| w.seq == seq);
            }
            self.stats.timed_out += 1;
            self.answer(session, Response::Timeout { owner }, ends);
            self.shards[local].check_invariants();
        }
    }

    /// The leader's own proposals for shard `local`: expiries of leases that ran out here,
    /// and periodic checkpoints of the time left on every lease.
    pub(super) fn leader_duties(&mut self, local: usize) {
        if !self.shards[local].serving() {
            // A barrier that could not be proposed when this member became leader (a leader
            // transfer was under way) is proposed again.
            let shard = self.shards[local].machine.shard();
            let leads = self.member.leader(shard) == Some(self.settings.node_id);
            if leads && self.shards[local].role == Role::Follower {
                self.promote(shard);
            }
            return;
        }
        let shard_id = self.shards[local].machine.shard();
        let now_ms = self.now_ms();
        let due = self.shards[local]
            .machine
            .due(now_ms, EXPIRIES_PER_ITERATION);
        for (key, token) in due {
            self.propose_expiry(shard_id, &key, token);
        }
        let shard = &self.shards[local];
        if self.now_us >= shard.checkpoint_at_us && !shard.machine.is_empty() {
            let command =
                shard
                    .machine
                    .checkpoint(now_ms, shard.checkpoint_after, CHECKPOINT_HOLDS);
            let last = match &command {
                Command::Checkpoint { holds, .. } if holds.len() == CHECKPOINT_HOLDS => {
                    holds.last().map_or(0, |hold| hold.token)
                }
                _ => 0,
            };
            if self.propose(shard_id, &command, NOBODY, PendingKind::Orphan) {
                let shard = &mut self.shards[local];
                shard.checkpoint_after = last;
                shard.checkpoint_at_us = self.now_us + CHECKPOINT_EVERY_US;
            }
        }
    }

    /// Proposes the expiry of `token`'s hold on `key` (with the head of its queue as `then`,
    /// if it waits), unless one is in the log already. False when none was proposed now.
    fn propose_expiry(&mut self, shard: u32, key: &[u8], token: u64) -> bool {
        let local = self.local(shard);
        if self.shards[local].expiring.contains(&token) {
            return false;
        }
        let end = End::Expire {
            as_of: self.shards[local].machine.applied(),
        };
        let kind = PendingKind::Expire { token };
        let proposed = self.propose_end(shard, key, token, end, NOBODY, kind);
        if proposed {
            self.shards[local].expiring.insert(token);
        }
        proposed
    }

    /// Whether the waiter `seq`, whose wait ended at `wait_end_us`, is the head of `key`'s
    /// queue and the key's lease ended before that (in this member's applied state): then the
    /// expiry is proposed now with it as `then` (true), and the waiter is decided by that
    /// entry instead of being answered `T`.
    fn expire_before_wait(&mut self, shard: u32, key: &[u8], seq: u64, wait_end_us: u64) -> bool {
        let local = self.local(shard);
        let state = &self.shards[local];
        let head = state.queues.get(key).and_then(|queue| queue.front());
        if !state.serving() || !head.is_some_and(|head| head.seq == seq) {
            return false;
        }
        let lease = state.machine.holder(key).map(|h| (h.token, h.deadline_ms));
        match lease {
            Some((token, lease_end_ms)) if lease_end_ms.saturating_mul(1000) < wait_end_us => {
                self.propose_expiry(shard, key, token)
            }
            _ => false,
        }
    }

    /// Spreads leadership over the live members (the member rate-limits it: every 3 s at most).
    pub(super) fn balance(&mut self) {
        if !self.member.balance_due() {
            return;
        }
        let live = self.member.live_voters();
        for (shard, to) in self.member.balance(&live) {
            self.leadership_log.handed(shard, to);
        }
    }

    /// The drain: what the core's writer synced since the last (the messages and restores
    /// that waited for it), then every ready group's writes handed to the writer as one batch,
    /// without waiting for the disk. A failed write or sync (the writer's error) stops the
    /// member: it cannot promise durability any more.
    pub(super) fn drain(&mut self) {
        self.take_compactions();
        if !self.member.has_ready() {
            return self.serve_reads();
        }
        let drain = match self.member.drain() {
            Ok(drain) => drain,
            Err(error) => stop_member(format!("core {}: {error}", self.settings.core)),
        };
        if !drain.messages.is_empty() {
            self.peers.send(drain.messages);
        }
        for restore in drain.restores {
            self.begin_restore(restore.shard, restore.data, restore.index);
        }
        self.apply(drain.committed);
        self.leaders_changed(&drain.leaders);
        self.reads_ready(drain.reads);
        self.serve_reads();
    }

    /// The snapshots the compactor encoded since the last drain, handed to the member: each is
    /// recorded by this drain's batch, unless a received snapshot was restored past its index
    /// meanwhile (the member refuses it, and it is dropped). A compactor that failed (its
    /// thread died) stops the member: it would never compact again, and its log would grow
    /// without bound.
    fn take_compactions(&mut self) {
        let done = match self.compactor.take_done() {
            Ok(done) => done,
            Err(error) => stop_member(format!("core {}: {error}", self.settings.core)),
        };
        for restored in self.compactor.take_restored() {
            let local = self.local(restored.shard);
            self.decoded(restored);
            self.advance_held(local);
        }
        for compacted in done {
            let (shard, index) = (compacted.shard, compacted.index);
            let local = self.local(shard);
            debug_assert_eq!(self.shards[local].compacting, Some(index));
            self.shards[local].compacting = None;
            match self.member.compact(shard, index, compacted.data) {
                Ok(()) => {
                    self.compactions.0 += 1;
                    let state = &mut self.shards[local];
                    state.compacted_at = state.compacted_at.max(index);
                }
                Err(error) => {
                    self.compactions.1 += 1;
                    log::debug!("shard {shard}: the snapshot at {index} is dropped: {error}");
                }
            }
        }
    }

    /// The core's log writer, e.g. for a simulation to complete its rounds.
    #[cfg(any(test, feature = "testing"))]
    pub fn writer_mut(&mut self) -> &mut D {
        self.member.writer_mut()
    }

    /// A snapshot raft handed out to restore: decoded off the loop by the compactor (here, if
    /// it cannot take it now); until its machine is installed, the shard's committed entries
    /// wait behind it ([`Held`]). The machine's deadlines count from now, before it is
    /// installed: earlier than counting at the install would make them, still later than the
    /// sender's (its remaining times were measured when the snapshot was taken, before it was
    /// received here), so leases never end early.
    fn begin_restore(&mut self, shard: u32, data: bytes::Bytes, index: u64) {
        let local = self.local(shard);
        let job = RestoreJob {
            shard,
            shards: self.settings.shards,
            index,
            data,
            now_ms: self.apply_ms(),
        };
        self.shards[local].held.push_back(Held::Restore(index));
        if let Err(job) = self.compactor.submit_restore(job) {
            log::debug!("shard {shard}: the snapshot at {index} is decoded on the loop");
            self.decoded(job.decode());
        }
        self.advance_held(local);
    }

    /// Keeps a decoded machine for its turn; a snapshot that does not restore stops the member.
    fn decoded(&mut self, restored: Restored) {
        let (shard, index) = (restored.shard, restored.index);
        match restored.machine {
            Ok(machine) => {
                let local = self.local(shard);
                self.shards[local].decoded.insert(index, machine);
            }
            Err(error) => stop_member(format!(
                "shard {shard}: the snapshot at index {index} does not restore: {error}"
            )),
        }
    }

    /// Installs the front restore of shard `local` if its machine is decoded, then applies the
    /// entries held behind it, up to the next restore; again while it can.
    fn advance_held(&mut self, local: usize) {
        loop {
            let state = &mut self.shards[local];
            let Some(Held::Restore(index)) = state.held.front() else {
                return;
            };
            let index = *index;
            let Some(machine) = state.decoded.remove(&index) else {
                return;
            };
            state.held.pop_front();
            let mut entries = Vec::new();
            while let Some(Held::Entry(_)) = state.held.front() {
                if let Some(Held::Entry(entry)) = state.held.pop_front() {
                    entries.push(entry);
                }
            }
            let shard = state.machine.shard();
            self.install(shard, *machine, index);
            self.apply_now(entries);
            self.shards[local].check_invariants();
        }
    }

    /// Replaces shard `shard`'s machine with one restored from the snapshot at `index`, and
    /// settles the requests whose entries it covers.
    fn install(&mut self, shard: u32, machine: ShardMachine, index: u64) {
        let local = self.local(shard);
        self.cluster_stats.restores += 1;
        let replaced = std::mem::replace(&mut self.shards[local].machine, machine);
        // Dropping a machine is O(holds): done by the compactor, off the loop.
        self.compactor.retire(replaced);
        self.shards[local].compacted_at = index;
        let mut covered: Vec<(u64, Pending)> = Vec::new();
        self.pending.retain(|&(s, i), pending| {
            let keep = s != shard || i > index;
            if !keep {
                covered.push((i, pending.clone()));
            }
            keep
        });
        covered.sort_by_key(|(i, _)| *i);
        for (at, pending) in covered {
            self.settle_covered(shard, at, pending);
        }
    }

    /// A request whose entry (at `at`) a restored snapshot covers: its outcome is read from
    /// the restored state where it can be, and is otherwise answered on the safe side. An
    /// acquire granted at `at` and still held gets its `A`; any other acquire had no effect
    /// that still stands (`M`) — and so for a queue head handed the key by a release or expiry
    /// at `at`. A release whose token still holds had no effect (`M`); one whose token holds
    /// nothing gets `R`: it was released by this request or, if its lease ran out first,
    /// expired no earlier than its holder's own count of the lease, so `R` tells the holder
    /// nothing it may act on (an `N` would tell a holder whose lease still runs that it lost
    /// the lock early). An extend renewed at `at` gets `E`; one whose token holds without it
    /// `M`; one whose token holds nothing `N`.
    fn settle_covered(&mut self, shard: u32, at: u64, mut pending: Pending) {
        let local = self.local(shard);
        // A head carried by a release is answered after the release (its `R` first).
        let handoff = pending.handoff.take();
        match &pending.kind {
            PendingKind::Acquire { key } => {
                let key = key.clone();
                self.settle_covered_head(shard, at, &key);
            }
            PendingKind::Release { token } => {
                let token = *token;
                match self.shards[local].machine.key_of(token) {
                    Some(_) => self.lost(shard, pending),
                    None => {
                        self.stats.released += 1;
                        self.answer(pending.session, Response::Released { token }, false);
                    }
                }
            }
            PendingKind::Extend { token } => {
                let token = *token;
                let machine = &self.shards[local].machine;
                let renewed = machine
                    .key_of(token)
                    .and_then(|key| machine.holder(key))
                    .map(|hold| hold.renewed_at == at);
                match renewed {
                    Some(true) => {
                        self.stats.extended += 1;
                        self.answer(pending.session, Response::Extended { token }, false);
                    }
                    Some(false) => self.lost(shard, pending),
                    None => {
                        self.stats.extend_not_held += 1;
                        self.answer(pending.session, Response::NotHeld { token }, false);
                    }
                }
            }
            PendingKind::Expire { .. } | PendingKind::Barrier | PendingKind::Orphan => {
                self.lost(shard, pending);
            }
        }
        if let Some(key) = handoff {
            self.settle_covered_head(shard, at, &key);
        }
    }

    /// The head of `key`'s queue, proposed at `at` (which a restored snapshot covers): `A` if
    /// the hold that entry granted is still there, else `M` (see `settle_covered`).
    fn settle_covered_head(&mut self, shard: u32, at: u64, key: &[u8]) {
        let local = self.local(shard);
        let head_owner = self.shards[local].head_mut(key).map(|head| head.owner);
        let granted = self.shards[local]
            .machine
            .granted_at(key, at)
            .filter(|hold| Some(hold.owner) == head_owner)
            .map(|hold| hold.token);
        match granted {
            Some(token) => self.answer_grant(shard, key, token),
            None => self.head_lost(shard, key),
        }
        self.shards[local].check_invariants();
    }

    /// Applies committed entries, except those of a shard whose restore is still being
    /// decoded: they wait behind it ([`Held`]).
    fn apply(&mut self, committed: Vec<Committed>) {
        if self.shards.iter().all(|shard| shard.held.is_empty()) {
            return self.apply_now(committed);
        }
        let mut now = Vec::with_capacity(committed.len());
        for entry in committed {
            let local = self.local(entry.shard);
            if self.shards[local].held.is_empty() {
                now.push(entry);
            } else {
                self.shards[local].held.push_back(Held::Entry(entry));
            }
        }
        self.apply_now(now);
    }

    fn apply_now(&mut self, committed: Vec<Committed>) {
        let now_ms = self.apply_ms();
        for entry in committed {
            let local = self.local(entry.shard);
            let machine = &mut self.shards[local].machine;
            if entry.index <= machine.applied() {
                continue;
            }
            let command = match entry.kind {
                EntryKind::Command => match Command::decode(&entry.data) {
                    Ok(command) => Some(command),
                    Err(error) => stop_member(format!(
                        "shard {}: committed entry {} (term {}) does not decode: {error}",
                        entry.shard, entry.index, entry.term
                    )),
                },
                EntryKind::Empty | EntryKind::ConfChange => None,
            };
            let applied = match &command {
                Some(command) => Some(machine.apply(entry.index, command, now_ms)),
                None => {
                    machine.skip(entry.index);
                    None
                }
            };
            let pending = self.pending.remove(&(entry.shard, entry.index));
            self.applied(entry.shard, entry.term, command.as_ref(), applied, pending);
            self.maybe_compact(local);
        }
    }

    /// What an applied entry means for the requests waiting on it, and for the queues.
    fn applied(
        &mut self,
        shard: u32,
        term: u64,
        command: Option<&Command>,
        applied: Option<Applied>,
        pending: Option<Pending>,
    ) {
        let ours = pending.as_ref().is_some_and(|p| p.term == term);
        if let Some(pending) = pending.as_ref().filter(|p| ours && p.session != NOBODY) {
            let latency = self.now_us.saturating_sub(pending.proposed_us);
            self.cluster_stats.commit_latency.record(latency);
        }
        if let (Some(pending), false) = (&pending, ours) {
            self.lost(shard, pending.clone());
        }
        let (Some(command), Some(applied)) = (command, applied) else {
            return;
        };
        // The queue head this entry carries (ours only: another term's `then` is nobody's here).
        let handoff = pending
            .as_ref()
            .filter(|_| ours)
            .is_some_and(|p| p.handoff.is_some());
        match (command, applied) {
            (Command::Acquire { key, .. }, outcome) if ours => {
                self.acquire_applied(shard, key, outcome);
            }
            (Command::Release { key, token, .. }, outcome) => {
                if ours {
                    self.release_applied(&pending, *token, outcome);
                }
                self.hold_ended(shard, key, outcome, handoff);
            }
            (Command::Extend { token, .. }, outcome) if ours => {
                let session = pending.as_ref().map_or(0, |p| p.session);
                let response = match outcome {
                    Applied::Extended { .. } => {
                        self.stats.extended += 1;
                        Response::Extended { token: *token }
                    }
                    _ => {
                        self.stats.extend_not_held += 1;
                        Response::NotHeld { token: *token }
                    }
                };
                self.answer(session, response, false);
            }
            (Command::Expire { key, token, .. }, outcome) => {
                let local = self.local(shard);
                self.shards[local].expiring.remove(token);
                if matches!(outcome, Applied::Expired | Applied::HandedOff { .. }) {
                    self.stats.lease_expirations += 1;
                }
                self.hold_ended(shard, key, outcome, handoff);
            }
            (Command::Barrier { .. }, _) if ours => self.promoted(shard, term),
            _ => {}
        }
    }

    fn release_applied(&mut self, pending: &Option<Pending>, token: u64, outcome: Applied) {
        let Some(pending) = pending else {
            return;
        };
        if !matches!(pending.kind, PendingKind::Release { .. }) {
            return; // an orphan release: nobody to answer
        }
        let response = match outcome {
            Applied::Released | Applied::HandedOff { .. } => {
                self.stats.released += 1;
                Response::Released { token }
            }
            _ => {
                self.stats.release_not_held += 1;
                Response::NotHeld { token }
            }
        };
        self.answer(pending.session, response, false);
    }

    /// A release or expiry of `key` applied with `outcome`; `handoff`: it carried this
    /// member's queue head as `then`. The head handed the key gets its answer; a head the
    /// entry did not grant waits again (or leaves); a freed key goes to the next waiter.
    fn hold_ended(&mut self, shard: u32, key: &[u8], outcome: Applied, handoff: bool) {
        match outcome {
            Applied::HandedOff { token, .. } if handoff => self.answer_grant(shard, key, token),
            // Another leader's handoff: nobody here waits for that grant.
            Applied::HandedOff { .. } => {}
            Applied::Released | Applied::Expired => {
                if handoff {
                    // The key is free but the grant was refused (its token would overflow).
                    self.head_refused(shard, key);
                }
                self.key_freed(shard, key);
            }
            _ if handoff => self.head_missed(shard, key),
            _ => {}
        }
    }

    fn acquire_applied(&mut self, shard: u32, key: &[u8], outcome: Applied) {
        let local = self.local(shard);
        match outcome {
            Applied::Granted { token, .. } => self.answer_grant(shard, key, token),
            Applied::Held { .. } => self.head_missed(shard, key),
            _ => {
                // Full, Exhausted, NoFloor: refused for capacity.
                self.head_refused(shard, key);
                self.propose_head(shard, key);
            }
        }
        self.shards[local].check_invariants();
    }

    /// The proposed head of `key`'s queue was refused the key for capacity: `B`.
    fn head_refused(&mut self, shard: u32, key: &[u8]) {
        let local = self.local(shard);
        if let Some(head) = self.shards[local].pop_head(key, &mut self.places) {
            if !head.abandoned {
                let reason = BusyReason::Keys;
                self.busy(head.session, head.owner, head.ends_pending, reason);
            }
        }
    }

    /// A committed release or expiry freed `key`: the leader proposes the next waiter.
    fn key_freed(&mut self, shard: u32, key: &[u8]) {
        if self.serving(shard) {
            self.propose_head(shard, key);
        }
    }

    /// A proposal whose index got another entry: it had no effect. Its client gets `M`, and
    /// so does a queue head it carried.
    fn lost(&mut self, shard: u32, pending: Pending) {
        let local = self.local(shard);
        if let Some(key) = pending.handoff.as_deref() {
            self.head_lost(shard, key);
        }
        match pending.kind {
            PendingKind::Acquire { key } => self.head_lost(shard, &key),
            PendingKind::Release { token } | PendingKind::Extend { token } => {
                let response = self.moved(shard, token);
                self.answer(pending.session, response, false);
            }
            PendingKind::Expire { token } => {
                self.shards[local].expiring.remove(&token);
            }
            PendingKind::Barrier | PendingKind::Orphan => {}
        }
    }

    /// The entry proposed for the head of `key`'s queue had no effect that still stands: the
    /// head leaves with `M` (the client asks the leader again), and a free key goes to the next
    /// waiter.
    fn head_lost(&mut self, shard: u32, key: &[u8]) {
        let local = self.local(shard);
        if let Some(head) = self.shards[local].pop_head(key, &mut self.places) {
            if !head.abandoned {
                let response = self.moved(shard, head.owner);
                self.answer(head.session, response, head.ends_pending);
            }
        }
        self.key_freed(shard, key);
        self.shards[local].check_invariants();
    }

    /// The barrier of `term` applied: this member has everything committed before its term.
    /// Every lease gets the grace before it may expire here, then the shard is served.
    fn promoted(&mut self, shard: u32, term: u64) {
        let local = self.local(shard);
        let now_ms = self.apply_ms();
        let state = &mut self.shards[local];
        if !matches!(state.role, Role::Promoting { barrier } if barrier.term == term) {
            return;
        }
        state.machine.promote(now_ms, PROMOTE_GRACE_MS);
        state.role = Role::Leader { term };
        state.checkpoint_at_us = self.now_us + CHECKPOINT_EVERY_US;
        self.leadership_log.serving(shard, term);
    }

    fn leaders_changed(&mut self, changes: &[LeaderChanged]) {
        for change in changes {
            self.cluster_stats.leader_changes += 1;
            let local = self.local(change.shard);
            let leads = change.leader == Some(self.settings.node_id);
            let role = self.shards[local].role;
            match (leads, role) {
                (true, Role::Follower) => self.promote(change.shard),
                (
                    true,
                    Role::Leader { term }
                    | Role::Promoting {
                        barrier: crate::cluster::member::Proposed { term, .. },
                    },
                ) if term != change.term => {
                    self.demote(change.shard);
                    self.promote(change.shard);
                }
                (false, Role::Leader { .. } | Role::Promoting { .. }) => self.demote(change.shard),
                _ => {}
            }
        }
    }

    /// This member became the leader: propose the barrier (with the token floor it sets if
    /// the shard has none yet).
    fn promote(&mut self, shard: u32) {
        let floor = crate::tokens::wall_clock_floor(SystemTime::now());
        let command = Command::Barrier { floor };
        match self.member.propose(shard, command.encode()) {
            Ok(barrier) => {
                let pending = Pending {
                    term: barrier.term,
                    session: NOBODY,
                    kind: PendingKind::Barrier,
                    proposed_us: self.now_us,
                    handoff: None,
                };
                self.pending.insert((shard, barrier.index), pending);
                let local = self.local(shard);
                self.shards[local].role = Role::Promoting { barrier };
            }
            Err(error) => log::debug!("shard {shard}: barrier refused: {error}"),
        }
    }

    /// This member stopped leading: queued acquires that were never proposed get `B`;
    /// proposed ones wait for their entry; queries in flight get `M`.
    fn demote(&mut self, shard: u32) {
        let local = self.local(shard);
        self.shards[local].role = Role::Follower;
        self.shards[local].expiring.clear();
        for waiter in self.shards[local].take_unproposed(&mut self.places) {
            self.busy(
                waiter.session,
                waiter.owner,
                waiter.ends_pending,
                BusyReason::Leadership,
            );
        }
        let reads: Vec<u64> = self
            .reads
            .iter()
            .filter(|(_, read)| read.shard == shard)
            .map(|(seq, _)| *seq)
            .collect();
        for seq in reads {
            if let Some(read) = self.reads.remove(&seq) {
                let response = self.moved(shard, read.nonce);
                self.answer(read.session, response, false);
            }
        }
        self.shards[local].check_invariants();
        self.leadership_log.stepped_down(shard);
    }

    fn reads_ready(&mut self, ready: Vec<ReadReady>) {
        for read in ready {
            let Ok(bytes) = <[u8; 8]>::try_from(read.context.as_slice()) else {
                continue;
            };
            if let Some(pending) = self.reads.get_mut(&u64::from_be_bytes(bytes)) {
                pending.index = Some(read.index);
            }
        }
    }

    /// Every `compact_every` applied entries, right after applying one (nothing else applied
    /// since), freezes the shard's machine (O(1)) and hands the image to the compactor, which
    /// encodes it off the loop; [`Self::take_compactions`] hands the bytes to the member later.
    /// One image per shard in flight at most.
    fn maybe_compact(&mut self, local: usize) {
        let shard = &self.shards[local];
        let applied = shard.machine.applied();
        if shard.compacting.is_some()
            || applied < shard.compacted_at + self.settings.compact_every.max(1)
        {
            return;
        }
        let frozen = shard.machine.freeze(self.now_ms());
        let shard_id = shard.machine.shard();
        match self.compactor.submit(frozen) {
            Ok(()) => self.shards[local].compacting = Some(applied),
            Err(_) => log::debug!("shard {shard_id}: compaction deferred: the compactor is full"),
        }
    }
}

/// Stops this member: see the module docs. `what` names the shard and index, or the operation.
pub(crate) fn stop_member(what: String) -> ! {
    log::error!(
        "{what}: this member stops (the process exits 70) rather than go on with a state it \
         cannot vouch for"
    );
    panic!("cluster member stopped: {what}");
}

#[cfg(test)]
#[path = "drive_tests.rs"]
mod tests;
