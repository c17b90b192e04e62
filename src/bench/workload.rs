//! The per-connection workload state machine: pipeline slots running acquire/release cycles.
//! No I/O, no clock reads: the driver passes `now` and an [`Outbox`] to write requests into.
//!
//! Call order, per driver iteration: [`Session::handle_reply`] for every parsed answer, then
//! [`Session::handle_timer`] for every due entry of [`Timers`], then flush the outbox bytes.
//! [`Session::kick`] starts a cycle on every idle slot (at the start and when `hold` moves to
//! its waiter phase); [`Session::stop`] lets cycles in flight finish without starting new ones.
//!
//! A slot is `Idle`, `Querying` (a `hold` waiter asking what is left of the lease), `Acquiring`
//! (one acquire outstanding), `Backoff` (Redis: `SET NX` found the key held; retry timer
//! pending), `Holding` (hold timer pending), `Releasing` (one release outstanding) or
//! `Rerouting` (a cluster member answered `M` naming no leader; the request goes to another
//! member when its timer fires). An `M` naming a leader sends the same request there at once
//! (`workload/redirect.rs`; routing in `cluster.rs`).
//! Invariants: a slot has at most one request outstanding and at most one timer pending;
//! `active` counts the slots that are not idle.
//!
//! Correlation: an owner is `sequence << 32 | connection << 12 | slot`, unique in the run (the
//! Redis value is the owner too), so an answer carrying an owner names its slot directly. An
//! answer carrying a token is matched by scanning the slots (the pipeline is small).
//!
//! Deliberately not here: sockets and buffers (the driver), turning requests into bytes (the
//! [`Wire`]).

use std::fmt;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

pub use super::cluster::Outbox;
use super::stats::Stats;
use super::wire::{key_name, Answer, Reply, Wire};
use super::{seconds_rounded_up, BenchConfig, Dialect, Workload, REDIS_RETRY, WIRE_SECONDS_MAX};
use crate::rng::Rng;

/// Slot numbers live in the low bits of an owner.
const SLOT_BITS: u32 = 12;
/// The most sampled keys `hold` queues waiters on.
pub const LATENESS_SAMPLES_MAX: u64 = 1000;
/// How much longer than the lease a `hold` waiter may wait.
const WAITER_WAIT_MARGIN: Duration = Duration::from_secs(2);

const _: () = assert!(1u64 << SLOT_BITS == super::PIPELINE_MAX as u64);
const _: () = assert!(1u64 << (32 - SLOT_BITS) == super::CONNECTIONS_MAX as u64);

/// What the run asks of every slot; fixed for the run.
#[derive(Clone, Debug)]
pub struct Plan {
    /// The workload.
    pub workload: Workload,
    /// First byte of every key name.
    pub prefix: u8,
    /// Per-run tag in every key name.
    pub tag: [u8; 3],
    /// `contended`: how long an acquire may wait.
    pub wait: Duration,
    /// `hold`: how long a waiter may wait (past the lease).
    pub waiter_wait: Duration,
    /// `contended`: how long a grant is held.
    pub hold: Duration,
    /// Redis: how often a failed `SET NX` is retried while there is wait left.
    pub retry_every: Option<Duration>,
}

impl Plan {
    /// The plan for `config`, with key names tagged `tag`.
    pub fn new(config: &BenchConfig, tag: [u8; 3]) -> Plan {
        let prefix = match config.workload {
            Workload::Uncontended => b'u',
            Workload::Contended => b'c',
            Workload::Hold => b'h',
        };
        let retry_every = (config.target.dialect == Dialect::Redis).then_some(REDIS_RETRY);
        Plan {
            workload: config.workload,
            prefix,
            tag,
            wait: config.wait,
            waiter_wait: config.lease + WAITER_WAIT_MARGIN,
            hold: config.hold,
            retry_every,
        }
    }
}

/// Wire seconds for a wait: rounded up, at most 255.
fn wait_seconds(wait: Duration) -> u8 {
    seconds_rounded_up(wait).min(WIRE_SECONDS_MAX) as u8
}

/// What a slot does with a key.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Mode {
    /// Acquire, hold `--hold`, release (`uncontended`, `contended`).
    Cycle,
    /// Acquire and keep (`hold`, grant phase).
    Keep,
    /// Wait for a kept key's lease to run out, then release (`hold`, waiter phase).
    Waiter,
}

/// The next key a slot works on.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Pick {
    /// Key number.
    pub key: u64,
    /// What to do with it.
    pub mode: Mode,
    /// How long the acquire may wait.
    pub wait: Duration,
}

/// `hold`: the worker's range of keys to grant, then the sampled keys to wait on.
#[derive(Clone, Debug)]
pub struct HoldKeys {
    next: u64,
    end: u64,
    sample_stride: u64,
    /// Sampled keys kept.
    samples: Vec<u64>,
    waiting: bool,
    next_waiter: usize,
}

impl HoldKeys {
    /// Grants keys `range`, sampling every key divisible by `sample_stride`.
    pub fn new(range: std::ops::Range<u64>, sample_stride: u64) -> HoldKeys {
        debug_assert!(sample_stride >= 1);
        let samples = (range.end - range.start).div_ceil(sample_stride) + 1;
        HoldKeys {
            next: range.start,
            end: range.end,
            sample_stride,
            samples: Vec::with_capacity(samples as usize),
            waiting: false,
            next_waiter: 0,
        }
    }

    /// Whether every key of the range has been handed out (grants may still be outstanding).
    pub fn granting_done(&self) -> bool {
        self.waiting || self.next == self.end
    }

    /// Switches to the waiter phase, keeping at most `limit` samples (one per slot, so that
    /// every waiter is queued before its key expires).
    pub fn start_waiters(&mut self, limit: usize) {
        self.samples.truncate(limit);
        self.waiting = true;
    }

    /// Sampled keys granted.
    pub fn samples(&self) -> usize {
        self.samples.len()
    }

    fn note_kept(&mut self, key: u64) {
        if key % self.sample_stride == 0 && self.samples.len() < self.samples.capacity() {
            self.samples.push(key);
        }
    }
}

/// Where slots get their keys: one per worker.
#[derive(Clone, Debug)]
pub enum KeySource {
    /// `uncontended`: slot `s` of `stride` slots uses keys `s + stride * i`, `i < per_slot`.
    Spread {
        /// Slots in the run.
        stride: u64,
        /// Keys per slot.
        per_slot: u64,
        /// Picks `i`.
        rng: Rng,
    },
    /// `contended`: any of `count` keys.
    Hot {
        /// Hot keys.
        count: u64,
        /// Picks the key.
        rng: Rng,
    },
    /// `hold`.
    Hold(HoldKeys),
}

impl KeySource {
    /// The next key for the run-wide slot `global_slot`, or `None` when there is no more work.
    pub fn pick(&mut self, global_slot: u64, plan: &Plan) -> Option<Pick> {
        let cycle = |key| Pick {
            key,
            mode: Mode::Cycle,
            wait: Duration::ZERO,
        };
        match self {
            KeySource::Spread {
                stride,
                per_slot,
                rng,
            } => Some(cycle(global_slot + *stride * rng.below(*per_slot))),
            KeySource::Hot { count, rng } => Some(Pick {
                wait: plan.wait,
                ..cycle(rng.below(*count))
            }),
            KeySource::Hold(keys) if keys.waiting => {
                let &key = keys.samples.get(keys.next_waiter)?;
                keys.next_waiter += 1;
                Some(Pick {
                    key,
                    mode: Mode::Waiter,
                    wait: plan.waiter_wait,
                })
            }
            KeySource::Hold(keys) => {
                let key = keys.next;
                if key == keys.end {
                    return None;
                }
                keys.next += 1;
                Some(Pick {
                    mode: Mode::Keep,
                    ..cycle(key)
                })
            }
        }
    }
}

/// `contended`: when each hot key was last released, shared by all workers.
#[derive(Debug)]
pub struct HandoffClock {
    epoch: Instant,
    /// Nanoseconds since `epoch` plus one of the last release sent per key (0: never).
    released: Box<[AtomicU64]>,
}

impl HandoffClock {
    /// A clock for `keys` keys (0 for workloads without handoffs).
    pub fn new(epoch: Instant, keys: u64) -> HandoffClock {
        HandoffClock {
            epoch,
            released: (0..keys).map(|_| AtomicU64::new(0)).collect(),
        }
    }

    fn stamp(&self, at: Instant) -> u64 {
        at.saturating_duration_since(self.epoch).as_nanos() as u64 + 1
    }

    fn note_release(&self, key: u64, now: Instant) {
        if let Some(cell) = self.released.get(key as usize) {
            cell.store(self.stamp(now), Ordering::Relaxed);
        }
    }

    /// The handoff time of a grant of `key` received at `now` to an acquire first sent at
    /// `first_at`: `None` unless the key was released while that acquire was waiting.
    fn handoff(&self, key: u64, first_at: Instant, now: Instant) -> Option<Duration> {
        let released = self.released.get(key as usize)?.load(Ordering::Relaxed);
        if released <= self.stamp(first_at) {
            return None;
        }
        let released_at = self.epoch + Duration::from_nanos(released - 1);
        Some(now.saturating_duration_since(released_at))
    }
}

/// Everything a session needs from its worker for one call.
pub struct Context<'a> {
    /// The time of this driver iteration.
    pub now: Instant,
    /// The run's plan.
    pub plan: &'a Plan,
    /// The worker's stats.
    pub stats: &'a mut Stats,
    /// The worker's timers.
    pub timers: &'a mut Timers,
    /// The worker's key source.
    pub keys: &'a mut KeySource,
    /// The run's handoff clock.
    pub clock: &'a HandoffClock,
}

/// An answer the session cannot apply: the connection can no longer be trusted.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ReplyError {
    /// It matches no outstanding request of the session.
    Uncorrelated(Answer),
    /// An `M` named a leader that is not one of the target's members.
    UnknownLeader(std::net::SocketAddr),
}

impl fmt::Display for ReplyError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            ReplyError::Uncorrelated(answer) => {
                write!(f, "answer {answer:?} matches no outstanding request")
            }
            ReplyError::UnknownLeader(leader) => write!(
                f,
                "a member named {leader} as a key's leader, which is not in the target: list \
                 every member of the cluster (--target a,b,c)"
            ),
        }
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum State {
    Idle,
    /// `hold` waiter: asking how much is left of the holder's lease.
    Querying,
    Acquiring,
    Backoff,
    Holding,
    Releasing,
    /// An `M` named no leader: the request goes to another member when its timer fires.
    Rerouting(Resend),
}

/// Which request of a slot an `M` sent back.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Resend {
    Acquire,
    Release,
    Query,
}

#[derive(Clone, Copy, Debug)]
struct Slot {
    state: State,
    mode: Mode,
    key: u64,
    owner: u64,
    token: u64,
    /// First attempt of the acquire.
    first_at: Instant,
    /// The outstanding request.
    sent_at: Instant,
    /// Until when the acquire may wait (Redis retries stop here).
    deadline: Instant,
    lease_end: Option<Instant>,
    /// The member the outstanding request went to (0 for a single node).
    member: u8,
    /// `M`s followed in this cycle (at most [`REDIRECTS_MAX`](super::cluster::REDIRECTS_MAX)).
    redirects: u8,
}

/// One connection's slots.
#[derive(Debug)]
pub struct Session {
    local: u32,
    global: u32,
    slots: Vec<Slot>,
    sequence: u64,
    stopping: bool,
    active: usize,
}

impl Session {
    /// Slots for the worker's connection `local`, run-wide connection `global`.
    pub fn new(local: u32, global: u32, pipeline: u16, now: Instant) -> Session {
        let idle = Slot {
            state: State::Idle,
            mode: Mode::Cycle,
            key: 0,
            owner: 0,
            token: 0,
            first_at: now,
            sent_at: now,
            deadline: now,
            lease_end: None,
            member: 0,
            redirects: 0,
        };
        Session {
            local,
            global,
            slots: vec![idle; usize::from(pipeline)],
            sequence: 0,
            stopping: false,
            active: 0,
        }
    }

    /// The run-wide connection number.
    pub fn connection(&self) -> u32 {
        self.global
    }

    /// The worker's connection number.
    pub fn local(&self) -> u32 {
        self.local
    }

    /// Whether every slot is idle.
    pub fn is_idle(&self) -> bool {
        self.active == 0
    }

    /// Starts no new cycles from now on.
    pub fn stop(&mut self) {
        self.stopping = true;
    }

    /// Forgets every slot (the connection is gone).
    pub fn abandon(&mut self) {
        self.stopping = true;
        for slot in &mut self.slots {
            slot.state = State::Idle;
        }
        self.active = 0;
    }

    /// Starts a cycle on every idle slot.
    pub fn kick<W: Wire>(&mut self, ctx: &mut Context<'_>, outbox: &mut Outbox<'_, W>) {
        for index in 0..self.slots.len() {
            if self.slots[index].state == State::Idle {
                self.start(index, ctx, outbox);
            }
        }
        self.check_invariants();
    }

    fn start<W: Wire>(&mut self, index: usize, ctx: &mut Context<'_>, outbox: &mut Outbox<'_, W>) {
        if self.stopping {
            return;
        }
        let global_slot = u64::from(self.global) * self.slots.len() as u64 + index as u64;
        let Some(pick) = ctx.keys.pick(global_slot, ctx.plan) else {
            return;
        };
        self.sequence += 1;
        let owner = (self.sequence & 0xFFFF_FFFF) << 32
            | u64::from(self.global) << SLOT_BITS
            | index as u64;
        let now = ctx.now;
        let waiter = pick.mode == Mode::Waiter;
        self.slots[index] = Slot {
            state: if waiter {
                State::Querying
            } else {
                State::Acquiring
            },
            mode: pick.mode,
            key: pick.key,
            owner,
            token: 0,
            first_at: now,
            sent_at: now,
            deadline: now + pick.wait,
            lease_end: None,
            member: 0,
            redirects: 0,
        };
        self.active += 1;
        let key = key_name(ctx.plan.prefix, ctx.plan.tag, pick.key);
        let slot = index as u16;
        self.slots[index].member = if waiter {
            // The owner doubles as the query's nonce; the acquire follows the answer.
            outbox.query(slot, pick.key, &key, owner)
        } else {
            let wait_s = wait_seconds(pick.wait);
            outbox.acquire(slot, pick.key, &key, owner, wait_s)
        };
    }

    /// A `hold` waiter learnt what is left of the holder's lease: the lease ends then, give or
    /// take half the query's round trip and the rounding down to whole milliseconds (both
    /// centred here). Then it queues its acquire. A key already free is a missed sample.
    fn remaining<W: Wire>(
        &mut self,
        index: usize,
        lease_ms: Option<u32>,
        ctx: &mut Context<'_>,
        outbox: &mut Outbox<'_, W>,
    ) {
        let Some(lease_ms) = lease_ms else {
            ctx.stats.expiry_missed += 1;
            self.finish(index, ctx, outbox);
            return;
        };
        let now = ctx.now;
        let slot = &mut self.slots[index];
        let answered_at = slot.sent_at + now.saturating_duration_since(slot.sent_at) / 2;
        let left = Duration::from_millis(u64::from(lease_ms)) + Duration::from_micros(500);
        slot.lease_end = Some(answered_at + left);
        slot.state = State::Acquiring;
        (slot.first_at, slot.sent_at) = (now, now);
        slot.deadline = now + ctx.plan.waiter_wait;
        let key = key_name(ctx.plan.prefix, ctx.plan.tag, slot.key);
        let wait_s = wait_seconds(ctx.plan.waiter_wait);
        slot.member = outbox.acquire(index as u16, slot.key, &key, slot.owner, wait_s);
    }

    fn finish<W: Wire>(&mut self, index: usize, ctx: &mut Context<'_>, outbox: &mut Outbox<'_, W>) {
        self.slots[index].state = State::Idle;
        self.active -= 1;
        self.start(index, ctx, outbox);
    }

    fn release<W: Wire>(
        &mut self,
        index: usize,
        ctx: &mut Context<'_>,
        outbox: &mut Outbox<'_, W>,
    ) {
        let slot = &mut self.slots[index];
        slot.state = State::Releasing;
        slot.sent_at = ctx.now;
        if ctx.plan.workload == Workload::Contended {
            ctx.clock.note_release(slot.key, ctx.now);
        }
        let key = key_name(ctx.plan.prefix, ctx.plan.tag, slot.key);
        slot.member = outbox.release(index as u16, slot.key, &key, slot.token);
    }

    /// The slot an answer belongs to.
    fn find(&self, reply: &Reply) -> Option<usize> {
        let waiting_on = |index: usize, state: State, id: u64| {
            let slot = self.slots.get(index)?;
            let slot_id = match state {
                State::Acquiring | State::Querying => slot.owner,
                _ => slot.token,
            };
            (slot.state == state && slot_id == id).then_some(index)
        };
        let scan = |state: State, id: u64| match reply.slot {
            Some(index) => waiting_on(usize::from(index), state, id),
            None => (0..self.slots.len()).find_map(|index| waiting_on(index, state, id)),
        };
        match reply.answer {
            Answer::Granted { owner, .. } | Answer::Timeout { owner } | Answer::Busy { owner } => {
                let index = reply.slot.map_or(owner & ((1 << SLOT_BITS) - 1), u64::from);
                waiting_on(index as usize, State::Acquiring, owner)
            }
            Answer::Remaining { nonce, .. } => {
                let index = reply.slot.map_or(nonce & ((1 << SLOT_BITS) - 1), u64::from);
                waiting_on(index as usize, State::Querying, nonce)
            }
            Answer::Released { token } | Answer::NotHeld { token } => scan(State::Releasing, token),
            Answer::Refused { id, .. } => scan(State::Acquiring, id)
                .or_else(|| scan(State::Releasing, id))
                .or_else(|| scan(State::Querying, id)),
            // An owner (acquire, query) names its slot; a token (release) is scanned for.
            Answer::Moved { id, .. } => {
                let index = reply.slot.map_or(id & ((1 << SLOT_BITS) - 1), u64::from) as usize;
                waiting_on(index, State::Acquiring, id)
                    .or_else(|| waiting_on(index, State::Querying, id))
                    .or_else(|| scan(State::Releasing, id))
            }
        }
    }

    /// Applies one answer. An answer that matches nothing is an error: the connection can no
    /// longer be trusted.
    pub fn handle_reply<W: Wire>(
        &mut self,
        reply: Reply,
        ctx: &mut Context<'_>,
        outbox: &mut Outbox<'_, W>,
    ) -> Result<(), ReplyError> {
        let index = self
            .find(&reply)
            .ok_or(ReplyError::Uncorrelated(reply.answer))?;
        match reply.answer {
            Answer::Moved { leader, .. } => return self.redirected(index, leader, ctx, outbox),
            // The member that answered leads the key: the cycle's next request goes there.
            Answer::Refused { .. } => {}
            _ => {
                let slot = &self.slots[index];
                outbox.leaders.confirm(slot.key, slot.member);
            }
        }
        ctx.stats
            .request(ctx.now.saturating_duration_since(self.slots[index].sent_at));
        let workload = ctx.plan.workload;
        match reply.answer {
            Answer::Granted { token, .. } => {
                self.granted(index, token, ctx, outbox);
                return Ok(());
            }
            Answer::Timeout { .. } => {
                self.timed_out(index, ctx, outbox);
                return Ok(());
            }
            Answer::Remaining { lease_ms, .. } => {
                self.remaining(index, lease_ms, ctx, outbox);
                self.check_invariants();
                return Ok(());
            }
            Answer::Busy { .. } => ctx.stats.answer(workload, |c| c.busy += 1),
            Answer::Released { .. } => {
                ctx.stats.answer(workload, |c| c.released += 1);
                if self.slots[index].mode == Mode::Cycle {
                    ctx.stats.cycle();
                }
            }
            Answer::NotHeld { .. } => ctx.stats.answer(workload, |c| c.not_held += 1),
            Answer::Refused { .. } => ctx.stats.answer(workload, |c| c.refused += 1),
            Answer::Moved { .. } => unreachable!("handled above"),
        }
        self.finish(index, ctx, outbox);
        self.check_invariants();
        Ok(())
    }

    fn granted<W: Wire>(
        &mut self,
        index: usize,
        token: u64,
        ctx: &mut Context<'_>,
        outbox: &mut Outbox<'_, W>,
    ) {
        let now = ctx.now;
        let slot = &mut self.slots[index];
        slot.token = token;
        ctx.stats.granted(
            self.local as usize,
            now.saturating_duration_since(slot.first_at),
        );
        if ctx.plan.workload == Workload::Contended {
            if let Some(handoff) = ctx.clock.handoff(slot.key, slot.first_at, now) {
                ctx.stats.handoff(handoff);
            }
        }
        match slot.mode {
            Mode::Cycle if ctx.plan.hold.is_zero() || self.stopping => {
                self.release(index, ctx, outbox)
            }
            Mode::Cycle => {
                slot.state = State::Holding;
                ctx.timers.hold.push(now, self.local, index as u16);
            }
            Mode::Keep => {
                if let KeySource::Hold(keys) = ctx.keys {
                    keys.note_kept(slot.key);
                }
                ctx.stats.cycle();
                self.finish(index, ctx, outbox);
            }
            Mode::Waiter => {
                let lease_end = slot.lease_end.unwrap_or(now);
                ctx.stats.lateness(now.checked_duration_since(lease_end));
                self.release(index, ctx, outbox);
            }
        }
        self.check_invariants();
    }

    fn timed_out<W: Wire>(
        &mut self,
        index: usize,
        ctx: &mut Context<'_>,
        outbox: &mut Outbox<'_, W>,
    ) {
        let slot = &mut self.slots[index];
        match ctx.plan.retry_every {
            Some(retry) if !self.stopping && ctx.now + retry <= slot.deadline => {
                ctx.stats.answer(ctx.plan.workload, |c| c.retries += 1);
                slot.state = State::Backoff;
                ctx.timers.retry.push(ctx.now, self.local, index as u16);
            }
            _ => {
                ctx.stats.answer(ctx.plan.workload, |c| c.timeout += 1);
                self.finish(index, ctx, outbox);
            }
        }
        self.check_invariants();
    }

    /// A hold or retry timer of `slot` is due.
    pub fn handle_timer<W: Wire>(
        &mut self,
        slot: u16,
        ctx: &mut Context<'_>,
        outbox: &mut Outbox<'_, W>,
    ) {
        let index = usize::from(slot);
        match self.slots[index].state {
            State::Holding => self.release(index, ctx, outbox),
            State::Backoff if self.stopping => {
                self.slots[index].state = State::Idle;
                self.active -= 1;
            }
            State::Backoff => {
                let slot = &mut self.slots[index];
                slot.state = State::Acquiring;
                slot.sent_at = ctx.now;
                let key = key_name(ctx.plan.prefix, ctx.plan.tag, slot.key);
                let wait_s = wait_seconds(slot.deadline.saturating_duration_since(ctx.now));
                slot.member = outbox.acquire(index as u16, slot.key, &key, slot.owner, wait_s);
            }
            State::Rerouting(resend) => self.resend(index, resend, ctx, outbox),
            // A connection that was abandoned leaves its timers behind.
            State::Idle | State::Querying | State::Acquiring | State::Releasing => {}
        }
        self.check_invariants();
    }

    fn check_invariants(&self) {
        if cfg!(debug_assertions) {
            let busy = self
                .slots
                .iter()
                .filter(|slot| slot.state != State::Idle)
                .count();
            assert_eq!(busy, self.active, "active slot count");
        }
    }
}

mod redirect;
mod timers;

#[cfg(test)]
use timers::DelayQueue;
pub use timers::Timers;

#[cfg(test)]
#[path = "workload_tests.rs"]
mod tests;
