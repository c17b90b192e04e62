//! The leader's timed work in one iteration: queued acquires whose wait ran out, expiries of
//! leases that ran out here, and checkpoints of the time left on every lease.
//!
//! Both kinds of deadline are on the core's timing wheels ([`latchkey_wheel::Wheel`], ticks of
//! `timer.tick_ms`), as on a single node: a timer fires at the first tick at or after its end
//! (never early, at most a tick late), and at most a bounded number fire per iteration.
//! * A wait timer whose waiter left its queue meanwhile (granted, cancelled, closed) is
//!   skipped when it fires.
//! * Lease timers are armed only on shards this member serves: all of a shard's holds when it
//!   starts serving (after the promotion's grace) or installs a snapshot, then from each
//!   applied outcome that changes a deadline (a grant, an extend, a release or expiry, a
//!   handoff, a checkpoint that lowered one). A member that stops serving drops its timers at
//!   once (the shard's lease epoch moves on; the wheel's entries of the old epoch are ignored
//!   when they fire). Followers arm none: the machine keeps each hold's deadline, and a new
//!   leader arms them all.

use super::requests::End;
use super::{
    ClusterPartition, Peers, PendingKind, CHECKPOINT_EVERY_US, CHECKPOINT_HOLDS,
    LEASE_TIMERS_PER_STEP_MAX, SHUTDOWN_HANDOVER_US, WAIT_TIMERS_PER_STEP_MAX,
};
use crate::cluster::machine::{Applied, Command};
use crate::cluster::shard::{Role, Shard};
use crate::cluster::writer::LogWriter;
use crate::partition::rules;
use crate::partition::BusyReason;
use crate::partition::{SessionId, NOBODY};
use latchkey_client::protocol::Response;

/// A queued acquire's wait timer: which waiter, and when its wait ends.
#[derive(Clone, Debug)]
pub(super) struct WaitTimer {
    /// The waiter's shard.
    pub shard: u32,
    /// Its key.
    pub key: Vec<u8>,
    /// Its number (`Waiter::seq`).
    pub seq: u64,
    /// When its wait ends (server clock, µs).
    pub deadline_us: u64,
}

/// A hold's lease timer: which hold, armed while its shard was served in which epoch.
#[derive(Clone, Copy, Debug)]
pub(super) struct LeaseTimer {
    /// The hosted shard's index on this core.
    local: u32,
    /// `Shard::lease_epoch` when armed.
    epoch: u32,
    /// The hold's token.
    token: u64,
}

impl<D: LogWriter, P: Peers> ClusterPartition<D, P> {
    /// Arms the wait timer of waiter `seq` of `key` on `shard`, whose wait ends at
    /// `deadline_us`.
    pub(super) fn arm_wait(&mut self, shard: u32, key: &[u8], seq: u64, deadline_us: u64) {
        let slot = self.wait_slots.insert(WaitTimer {
            shard,
            key: key.to_vec(),
            seq,
            deadline_us,
        });
        let tick = deadline_us.div_ceil(self.settings.tick_us);
        self.wait_timers.insert(tick, slot as u32);
    }

    /// Queued acquires whose wait ended: `T` (a proposed one is answered now and its grant,
    /// if it still commits, released) — except a head whose key's lease ran out before its
    /// wait did (this iteration is late): as on a single node (docs/protocol.md §3, deadline
    /// order), the expiry is proposed now and hands it the key. At most
    /// [`WAIT_TIMERS_PER_STEP_MAX`] timers (whole ticks) per iteration; the rest follow in the
    /// next ones.
    pub(super) fn fire_wait_timers(&mut self) {
        let mut fired = std::mem::take(&mut self.fired_waits);
        let tick = self.now_us / self.settings.tick_us;
        self.wait_timers
            .advance_bounded(tick, &mut fired, WAIT_TIMERS_PER_STEP_MAX);
        for &slot in &fired {
            let timer = self.wait_slots.remove(slot as usize);
            debug_assert!(timer.deadline_us <= self.now_us, "a wait timer fired early");
            self.wait_ran_out(timer);
        }
        fired.clear();
        self.fired_waits = fired;
    }

    /// The wait of `timer`'s waiter ran out (if it is still queued).
    fn wait_ran_out(&mut self, timer: WaitTimer) {
        let WaitTimer {
            shard,
            key,
            seq,
            deadline_us,
        } = timer;
        let local = self.local(shard);
        let Some(waiter) = self.shards[local].waiter(&key, seq) else {
            return;
        };
        if waiter.deadline_us > self.now_us {
            return; // its wait moved later (an adopted waiter attached): a later timer is armed
        }
        let (session, owner, ends) = (waiter.session, waiter.owner, waiter.ends_pending);
        let (proposed, origin) = (waiter.proposed, waiter.origin);
        if !proposed && self.expire_before_wait(shard, &key, seq, deadline_us) {
            return;
        }
        if proposed {
            if !self.shards[local].abandon_proposed(&key, seq, &mut self.places) {
                return;
            }
        } else {
            self.shards[local].remove_where(&key, &mut self.places, |w| w.seq == seq);
        }
        if origin != 0 {
            self.adopted_acquire_ended(origin, owner);
        }
        self.stats.timed_out += 1;
        if proposed {
            // Abandoned, but its entry may still grant it (and, mirrored, the replicated
            // queue has it until then).
            self.answer_held((shard, &key), session, Response::Timeout { owner }, ends);
        } else {
            self.answer(session, Response::Timeout { owner }, ends);
        }
        self.shards[local].check_invariants();
    }

    /// The leader's own proposals for shard `local`: expiries of leases that ran out here,
    /// and periodic checkpoints of the time left on every lease.
    pub(super) fn leader_duties(&mut self, local: usize) {
        let shard_id = self.shards[local].machine().shard();
        if !self.shards[local].serving() {
            // A barrier that could not be proposed when this member became leader (a leader
            // transfer was under way) is proposed again.
            let leads = self.member.leader(shard_id) == Some(self.settings.node_id);
            if leads && self.shards[local].role() == Role::Follower {
                self.promote(shard_id);
            }
            return;
        }
        let now_ms = self.now_ms();
        let Some(after) = self.shards[local].checkpoint_due(self.now_us) else {
            return;
        };
        let machine = self.shards[local].machine();
        let command = machine.checkpoint(now_ms, after, CHECKPOINT_HOLDS);
        let last = match &command {
            Command::Checkpoint { holds, .. } if holds.len() == CHECKPOINT_HOLDS => {
                holds.last().map_or(0, |hold| hold.token)
            }
            _ => 0,
        };
        if self.propose(shard_id, &command, NOBODY, PendingKind::Checkpoint) {
            let next_at_us = self.now_us + CHECKPOINT_EVERY_US;
            self.shards[local].checkpoint_proposed(last, next_at_us);
        }
    }

    /// Proposes the expiry of `token`'s hold on `key` (with the head of its queue as `then`,
    /// if it waits), unless one is in the log already. False when none was proposed now.
    fn propose_expiry(&mut self, shard: u32, key: &[u8], token: u64) -> bool {
        let local = self.local(shard);
        if !self.shards[local].mark_expiring(token) {
            return false;
        }
        let end = End::Expire {
            as_of: self.shards[local].machine().applied(),
        };
        let kind = PendingKind::Expire { token };
        let proposed = self.propose_end(shard, key, token, end, NOBODY, kind);
        if !proposed {
            self.shards[local].expiry_settled(token);
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
        let is_head = state.head(key).is_some_and(|head| head.seq == seq);
        if !state.serving() || !is_head {
            return false;
        }
        let lease = state
            .machine()
            .holder(key)
            .map(|h| (h.token, h.deadline_ms));
        match lease {
            Some((token, lease_end_ms))
                if !rules::wait_ends_first(wait_end_us, lease_end_ms.saturating_mul(1000)) =>
            {
                self.propose_expiry(shard, key, token)
            }
            _ => false,
        }
    }
}

/// Lease timers.
impl<D: LogWriter, P: Peers> ClusterPartition<D, P> {
    /// Arms (or moves) the lease timer of `token`'s hold on shard `local`, due at `deadline_ms`
    /// (this member's clock), if this member serves the shard.
    pub(super) fn arm_lease(&mut self, local: usize, token: u64, deadline_ms: u64) {
        if !self.shards[local].serving() {
            return;
        }
        let timer = LeaseTimer {
            local: local as u32,
            epoch: self.shards[local].lease_epoch(),
            token,
        };
        let tick = deadline_ms
            .saturating_mul(1000)
            .div_ceil(self.settings.tick_us);
        let handle = self.lease_timers.insert(tick, timer);
        if let Some(replaced) = self.shards[local].set_lease_timer(token, handle) {
            self.lease_timers.cancel(replaced);
        }
    }

    /// Cancels the lease timer of `token`'s hold on shard `local`, if one is armed.
    fn disarm_lease(&mut self, local: usize, token: u64) {
        if let Some(timer) = self.shards[local].take_lease_timer(token) {
            self.lease_timers.cancel(timer);
        }
    }

    /// Arms the lease timer of every hold of shard `local` (it starts serving, or installed a
    /// snapshot while serving); timers armed before are dropped. O(holds), as the promotion's
    /// grace that precedes it.
    pub(super) fn arm_all_leases(&mut self, local: usize) {
        self.shards[local].drop_lease_timers();
        let machine = self.shards[local].machine();
        let holds: Vec<(u64, u64)> = machine
            .holds()
            .map(|(_, hold)| (hold.token, hold.deadline_ms))
            .collect();
        for (token, deadline_ms) in holds {
            self.arm_lease(local, token, deadline_ms);
        }
    }

    /// What `command`, applied to shard `local` with `outcome`, did to the leases' deadlines:
    /// their timers follow (on a shard this member serves).
    pub(super) fn leases_applied(&mut self, local: usize, command: &Command, outcome: Applied) {
        if !self.shards[local].serving() {
            return;
        }
        match (command, outcome) {
            (_, Applied::Granted { token, deadline_ms }) => {
                self.arm_lease(local, token, deadline_ms)
            }
            (
                Command::Release { token: ended, .. } | Command::Expire { token: ended, .. },
                Applied::HandedOff { token, deadline_ms },
            ) => {
                self.disarm_lease(local, *ended);
                self.arm_lease(local, token, deadline_ms);
            }
            (
                Command::Release { token, .. } | Command::Expire { token, .. },
                Applied::Released | Applied::Expired,
            ) => self.disarm_lease(local, *token),
            (Command::Extend { token, .. }, Applied::Extended { deadline_ms }) => {
                self.arm_lease(local, *token, deadline_ms)
            }
            // An `Extend` applied between this expiry's proposal and its apply: the hold
            // stands, and its timer, which may have fired meanwhile and found the expiry in
            // flight, is armed again for the renewed deadline.
            (Command::Expire { key, token, .. }, Applied::Renewed) => {
                let hold = self.shards[local].machine().holder(key);
                let hold = hold.filter(|hold| hold.token == *token);
                if let Some(deadline_ms) = hold.map(|hold| hold.deadline_ms) {
                    self.arm_lease(local, *token, deadline_ms);
                }
            }
            (Command::Checkpoint { holds, .. }, Applied::Checkpointed { capped }) if capped > 0 => {
                for listed in holds {
                    let hold = self.shards[local].machine().holder(&listed.key);
                    if let Some(hold) = hold.filter(|hold| hold.token == listed.token) {
                        let (token, deadline_ms) = (hold.token, hold.deadline_ms);
                        self.arm_lease(local, token, deadline_ms);
                    }
                }
            }
            _ => {}
        }
    }

    /// Leases whose timer fired: the expiry is proposed (unless one is in the log already); a
    /// hold whose deadline moved later meanwhile gets its timer again, and one whose expiry
    /// could not be proposed is tried again at the next tick. At most
    /// [`LEASE_TIMERS_PER_STEP_MAX`] timers (whole ticks) per iteration.
    pub(super) fn fire_lease_timers(&mut self) {
        let mut fired = std::mem::take(&mut self.fired_leases);
        let tick = self.now_us / self.settings.tick_us;
        self.lease_timers
            .advance_bounded(tick, &mut fired, LEASE_TIMERS_PER_STEP_MAX);
        for &timer in &fired {
            self.lease_ran_out(timer);
        }
        fired.clear();
        self.fired_leases = fired;
    }

    /// The lease timer `timer` fired.
    fn lease_ran_out(&mut self, timer: LeaseTimer) {
        let local = timer.local as usize;
        let shard = &mut self.shards[local];
        if shard.lease_epoch() != timer.epoch || !shard.serving() {
            return; // armed while an earlier term was served: stale
        }
        shard.take_lease_timer(timer.token);
        let machine = shard.machine();
        let Some(key) = machine.key_of(timer.token).map(<[u8]>::to_vec) else {
            return;
        };
        let Some(deadline_ms) = machine.holder(&key).map(|hold| hold.deadline_ms) else {
            return;
        };
        let shard_id = machine.shard();
        if deadline_ms > self.now_ms() {
            return self.arm_lease(local, timer.token, deadline_ms);
        }
        if !self.propose_expiry(shard_id, &key, timer.token)
            && !self.shards[local].expiring(timer.token)
        {
            // Not proposed now and none in the log: again at the next tick.
            let next_ms = (self.now_us + self.settings.tick_us).div_ceil(1000);
            self.arm_lease(local, timer.token, next_ms);
        }
    }
}

/// A member's shutdown (SIGTERM: a rolling restart, a machine taken out).
impl<D: LogWriter, P: Peers> ClusterPartition<D, P> {
    /// Hands every shard this member serves to another live member (raft's leader transfer),
    /// so that its clients and their requests move to a leader that stays; its waiters are
    /// answered once their shard moved (`M` naming the new leader, as any member that steps
    /// down does), or when [`SHUTDOWN_HANDOVER_US`] passed ([`Self::end_handover`]).
    pub(super) fn hand_over_leaderships(&mut self) {
        let me = self.settings.node_id;
        let others: Vec<u64> = (self.member.live_voters().into_iter())
            .filter(|&member| member != me)
            .collect();
        self.others_at_shutdown = !others.is_empty();
        let mut handed = 0;
        for (turn, local) in (0..self.shards.len()).enumerate() {
            let shard = self.shards[local].machine().shard();
            let leads = self.member.leader(shard) == Some(me);
            let Some(&to) = others.get(turn % others.len().max(1)) else {
                break;
            };
            if leads && self.member.transfer_leader(shard, to).is_ok() {
                self.leadership_log.handed(shard, to);
                handed += 1;
            }
        }
        if handed > 0 {
            log::info!(
                "core {}: shutting down: {handed} shard leaderships handed to other members",
                self.settings.core
            );
        }
        self.handover_until_us = Some(self.now_us + SHUTDOWN_HANDOVER_US);
        if !self.others_at_shutdown {
            self.end_handover();
        }
    }

    /// An acquire this stopping member will not execute: `M` (another member takes it), or
    /// `B` when no other member was up.
    pub(super) fn refuse_at_shutdown(
        &mut self,
        shard: u32,
        session: SessionId,
        owner: u64,
        ends_pending: bool,
    ) {
        if self.others_at_shutdown {
            let response = self.moved(shard, owner);
            self.answer(session, response, ends_pending);
        } else {
            self.busy(session, owner, ends_pending, BusyReason::Shutdown);
        }
    }

    /// Once every shard moved, or the handover's time is up: the waiters still queued here are
    /// answered (see `handle_shutdown`), and the partition is quiescent.
    pub(super) fn end_handover(&mut self) {
        let Some(until_us) = self.handover_until_us else {
            return;
        };
        let serving = self.shards.iter().any(Shard::serving);
        if self.others_at_shutdown && serving && self.now_us < until_us {
            return;
        }
        self.handover_until_us = None;
        for local in 0..self.shards.len() {
            let (heads, waiters) = self.shards[local].shut_down(&mut self.places);
            let shard = self.shards[local].machine().shard();
            // A head whose grant is in the log may still be granted (by the others, or when
            // they come back): `B` promises it never will be, so it is held until the log
            // decides (a grant that commits is released first). Should this member stop
            // before, the session closes unanswered and the client resolves the acquire.
            for (key, head) in heads {
                self.stats.busy.count(BusyReason::Shutdown);
                let response = Response::Busy { owner: head.owner };
                self.answer_held((shard, &key), head.session, response, head.ends_pending);
            }
            // The others were never proposed: nothing of them was executed, and the cluster
            // goes on without this member, so `M` sends them to the leader (or, none known
            // yet, to the next member) — unless no other member was up to take them.
            for waiter in waiters {
                self.refuse_at_shutdown(shard, waiter.session, waiter.owner, waiter.ends_pending);
            }
        }
    }
}
