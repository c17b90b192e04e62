//! Applying committed entries: each shard's machine advances by the entries of its log, in
//! order, and what each outcome means for the requests waiting on it (answered from the
//! outcome if the entry is the one they proposed, `M` if another entry took its index) and for
//! the leader's queues (a head granted, refused or waiting again; a freed key handed to the
//! next waiter). Also what changes of leadership mean (the barrier proposed, the shard served
//! once it applies, queued acquires refused on stepping down) and restores (the requests whose
//! entries a restored snapshot covers, settled from the restored state).
//!
//! Deliberately not here: stepping raft, the drain and the writer (`raft_io.rs`); the queue
//! rules themselves ([`crate::partition::rules`], decided in `requests.rs`).

use super::raft_io::stop_member;
use super::{ClusterPartition, Peers, Pending, PendingKind, CHECKPOINT_EVERY_US, PROMOTE_GRACE_MS};
use crate::cluster::machine::{Applied, Command, ShardMachine};
use crate::cluster::member::{Committed, EntryKind, LeaderChanged, ReadReady};
use crate::cluster::shard::Role;
use crate::cluster::writer::LogWriter;
use crate::partition::BusyReason;
use crate::partition::{is_detached, NOBODY};
use latchkey_client::protocol::Response;
use std::time::SystemTime;

impl<D: LogWriter, P: Peers> ClusterPartition<D, P> {
    /// Replaces shard `shard`'s machine with one restored from the snapshot at `index`, and
    /// settles the requests whose entries it covers.
    pub(super) fn install(&mut self, shard: u32, machine: ShardMachine, index: u64) {
        let local = self.local(shard);
        self.cluster_stats.restores += 1;
        let replaced = self.shards[local].install(machine, index);
        // Dropping a machine is O(holds): done by the compactor, off the loop.
        self.compactor.retire(replaced);
        if self.shards[local].serving() {
            self.arm_all_leases(local);
        }
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
        let (handoff, term) = (pending.handoff.take(), pending.term);
        match &pending.kind {
            PendingKind::Acquire { key } => {
                let key = key.clone();
                self.settle_covered_head(shard, (at, term), &key);
            }
            PendingKind::Release { token } => {
                let token = *token;
                match self.shards[local].machine().key_of(token) {
                    Some(_) => self.lost(shard, pending),
                    None => {
                        self.stats.released += 1;
                        self.answer(pending.session, Response::Released { token }, false);
                    }
                }
            }
            PendingKind::Extend { token } => {
                let token = *token;
                let machine = self.shards[local].machine();
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
            PendingKind::Expire { .. }
            | PendingKind::Barrier
            | PendingKind::Checkpoint
            | PendingKind::Orphan { .. }
            | PendingKind::Mirror
            | PendingKind::Regrant { .. }
            | PendingKind::Resolve { .. } => {
                self.lost(shard, pending);
            }
        }
        if let Some(key) = handoff {
            self.settle_covered_head(shard, (at, term), &key);
        }
    }

    /// The head of `key`'s queue, proposed at `at` in `term` (which a restored snapshot
    /// covers): `A` if the hold that entry granted is still there, else `M` (see
    /// `settle_covered`).
    ///
    /// The snapshot does not say which term's entry granted that hold. While this member's
    /// term is still `term`, its own (no other entry took the index), and so for a waiter
    /// never mirrored (no other member knew its owner); after a change of leader, a mirrored
    /// waiter's may be another leader's grant of the same owner at the same index, made to its
    /// adopted copy of the waiter and answered, or kept for a Resolve, by that leader (which
    /// releases it when its client's grace ends unclaimed). Answering it here too would have
    /// two members each believe that it alone told the client (one then releases a lock the
    /// client holds), and releasing it could end a lock that leader granted. So the head gets
    /// `T`, held until the hold ends (released by that leader, or expired); its client, past
    /// its deadline, resolves the acquire with the leader.
    fn settle_covered_head(&mut self, shard: u32, (at, term): (u64, u64), key: &[u8]) {
        let local = self.local(shard);
        let head = self.shards[local].head(key);
        let head_owner = head.map(|head| head.owner);
        let granted = self.shards[local]
            .machine()
            .granted_at(key, at)
            .filter(|hold| Some(hold.owner) == head_owner)
            .map(|hold| hold.token);
        let mirrored = head.is_some_and(|head| head.mirrored);
        let ours = self.member.term(shard) == term || !mirrored;
        match granted {
            Some(token) if ours => self.answer_grant(shard, key, token),
            Some(_) => self.covered_grant_unclaimed(shard, key),
            None => self.head_lost(shard, key),
        }
        self.shards[local].check_invariants();
    }

    /// The head of `key`'s queue, granted by a covered entry that may be another leader's (see
    /// `settle_covered_head`): it leaves, its `T` held; the grant is neither answered nor
    /// released here.
    fn covered_grant_unclaimed(&mut self, shard: u32, key: &[u8]) {
        let local = self.local(shard);
        let Some(head) = self.shards[local].pop_granted_head(key, &mut self.places) else {
            return;
        };
        if !head.abandoned && !is_detached(head.session) {
            self.stats.timed_out += 1;
            let response = Response::Timeout { owner: head.owner };
            self.answer_held((shard, key), head.session, response, head.ends_pending);
        }
    }

    /// Applies committed entries, except those of a shard whose restore is still being
    /// decoded: they wait behind it.
    pub(super) fn apply(&mut self, committed: Vec<Committed>) {
        if !self.shards.iter().any(|shard| shard.restoring()) {
            return self.apply_now(committed);
        }
        let mut now = Vec::with_capacity(committed.len());
        for entry in committed {
            let local = self.local(entry.shard);
            if self.shards[local].restoring() {
                self.shards[local].hold_entry(entry);
            } else {
                now.push(entry);
            }
        }
        self.apply_now(now);
    }

    pub(super) fn apply_now(&mut self, committed: Vec<Committed>) {
        let now_ms = self.apply_ms();
        for entry in committed {
            let local = self.local(entry.shard);
            let machine = self.shards[local].machine_mut();
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
            if let (Some(command), Some(applied)) = (&command, applied) {
                self.leases_applied(local, command, applied);
                if let (Command::Extend { token, .. }, Applied::Extended { .. }) =
                    (command, applied)
                {
                    // Renewed: its client has it (its own extend, or a Resolve's or a resent
                    // acquire's renewal, answered by whichever member proposed it), so a grant
                    // this member kept for a Resolve is no longer its to release.
                    self.adopted_grant_delivered(*token);
                }
            }
            let pending = self.pending.remove(&(entry.shard, entry.index));
            self.applied(entry.shard, entry.term, command.as_ref(), applied, pending);
            if self.shards[local].term_applied(entry.term) {
                self.older_terms_lost(entry.shard, entry.term, entry.index);
            }
            self.maybe_compact(local);
        }
        self.propose_withdrawals();
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
            (Command::Extend { key, token, .. }, outcome) if ours => {
                let session = pending.as_ref().map_or(0, |p| p.session);
                match pending.as_ref().map(|p| &p.kind) {
                    Some(PendingKind::Regrant { owner }) => {
                        return self.regranted(shard, session, (*owner, *token), outcome);
                    }
                    Some(&PendingKind::Resolve {
                        client,
                        owner,
                        lease_ms,
                    }) => {
                        let asker = (session, client);
                        let renewed = matches!(outcome, Applied::Extended { .. });
                        return self.resolve_renewed(
                            (shard, key, owner),
                            asker,
                            (*token, lease_ms),
                            renewed,
                        );
                    }
                    _ => {}
                }
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
                self.shards[local].expiry_settled(*token);
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

    /// An entry of `term` at `index` applied, the first of its term here: every proposal of
    /// an earlier term can never commit (the log's terms never decrease with the index), and
    /// is lost now rather than when its own index applies — which may be long after, or (a
    /// queue head waiting on it) hold its key's queue until then.
    fn older_terms_lost(&mut self, shard: u32, term: u64, index: u64) {
        let mut lost: Vec<(u64, Pending)> = Vec::new();
        self.pending.retain(|&(s, i), pending| {
            let keep = s != shard || pending.term >= term;
            if !keep {
                lost.push((i, pending.clone()));
            }
            keep
        });
        lost.sort_by_key(|(i, _)| *i);
        for (_, pending) in lost {
            self.lost(shard, pending);
        }
        let still = (self.pending.keys())
            .filter(|&&(s, _)| s == shard)
            .map(|&(_, i)| i)
            .max();
        let local = self.local(shard);
        self.shards[local].proposals_lost(index, still);
        let last = self.shards[local].last_proposed();
        self.held_entries_lost(shard, last);
    }

    /// A proposal whose index got another entry: it had no effect. Its client gets `M`, and
    /// so does a queue head it carried.
    pub(super) fn lost(&mut self, shard: u32, pending: Pending) {
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
            PendingKind::Regrant { owner } => {
                let response = self.moved(shard, owner);
                self.answer(pending.session, response, true);
            }
            PendingKind::Resolve { owner, .. } => {
                let response = self.moved(shard, owner);
                self.answer(pending.session, response, false);
            }
            PendingKind::Expire { token } => {
                // Its timer fired: armed again, for a hold still served here.
                self.shards[local].expiry_settled(token);
                let machine = self.shards[local].machine();
                let key = machine.key_of(token);
                let hold = key.and_then(|key| machine.holder(key));
                if let Some(deadline_ms) = hold.map(|hold| hold.deadline_ms) {
                    self.arm_lease(local, token, deadline_ms);
                }
            }
            PendingKind::Barrier
            | PendingKind::Checkpoint
            | PendingKind::Orphan { .. }
            | PendingKind::Mirror => {}
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
        let (now_ms, checkpoint_at_us) = (self.apply_ms(), self.now_us + CHECKPOINT_EVERY_US);
        if self.shards[local].serve(term, now_ms, PROMOTE_GRACE_MS, checkpoint_at_us) {
            self.arm_all_leases(local);
            self.adopt_waiters(shard);
            self.leadership_log.serving(shard, term);
        }
    }

    pub(super) fn leaders_changed(&mut self, changes: &[LeaderChanged]) {
        for change in changes {
            self.cluster_stats.leader_changes += 1;
            let local = self.local(change.shard);
            let leads = change.leader == Some(self.settings.node_id);
            let role = self.shards[local].role();
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
    pub(super) fn promote(&mut self, shard: u32) {
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
                let local = self.local(shard);
                self.shards[local].begin_promotion(barrier);
                self.track(shard, barrier.index, pending);
            }
            Err(error) => log::debug!("shard {shard}: barrier refused: {error}"),
        }
    }

    /// This member stopped leading: queued acquires that were never proposed get `M` (nothing
    /// of them was executed: the client asks the leader again, within its deadline); proposed
    /// ones wait for their entry; queries in flight get `M`.
    fn demote(&mut self, shard: u32) {
        let local = self.local(shard);
        for waiter in self.shards[local].demote(&mut self.places) {
            let response = self.moved(shard, waiter.owner);
            self.answer(waiter.session, response, waiter.ends_pending);
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
        self.demote_resolves(shard);
        self.shards[local].check_invariants();
        self.leadership_log.stepped_down(shard);
    }

    pub(super) fn reads_ready(&mut self, ready: Vec<ReadReady>) {
        for read in ready {
            let Ok(bytes) = <[u8; 8]>::try_from(read.context.as_slice()) else {
                continue;
            };
            if let Some(pending) = self.reads.get_mut(&u64::from_be_bytes(bytes)) {
                pending.index = Some(read.index.max(pending.after));
            }
        }
    }
}
