//! The worker's timers: one FIFO per constant delay (hold, Redis retry, cluster reroute), so
//! entries are pushed in deadline order and popping the due ones is O(1). No clock reads.
//!
//! Invariant: a slot has at most one entry in all queues together (see the session).
//! Deliberately not here: what a due timer does (the session's `handle_timer`).

use std::collections::VecDeque;
use std::time::{Duration, Instant};

use super::{Plan, REDIS_RETRY};
use crate::bench::cluster::MOVED_RETRY;

/// Timers of one constant delay, so entries are pushed in deadline order and a FIFO suffices.
#[derive(Debug)]
pub struct DelayQueue {
    delay: Duration,
    entries: VecDeque<(Instant, u32, u16)>,
}

impl DelayQueue {
    /// A queue of `delay` timers with room for one per slot (`slots`).
    pub fn new(delay: Duration, slots: usize) -> DelayQueue {
        DelayQueue {
            delay,
            entries: VecDeque::with_capacity(slots),
        }
    }

    pub(in crate::bench) fn push(&mut self, now: Instant, connection: u32, slot: u16) {
        debug_assert!(self
            .entries
            .back()
            .map_or(true, |&(last, _, _)| last <= now + self.delay));
        self.entries.push_back((now + self.delay, connection, slot));
    }

    /// The next timer due at `now`: (worker's connection number, slot).
    pub fn pop_due(&mut self, now: Instant) -> Option<(u32, u16)> {
        let &(deadline, connection, slot) = self.entries.front()?;
        if deadline > now {
            return None;
        }
        self.entries.pop_front();
        Some((connection, slot))
    }

    /// When the next timer is due.
    pub fn next_deadline(&self) -> Option<Instant> {
        self.entries.front().map(|&(deadline, _, _)| deadline)
    }
}

/// The worker's timers: hold timers, Redis retry timers, and cluster reroutes.
#[derive(Debug)]
pub struct Timers {
    /// `--hold` timers.
    pub hold: DelayQueue,
    /// Redis `SET NX` retry timers.
    pub retry: DelayQueue,
    /// Requests an `M` without a leader sent back, due to go to another member.
    pub moved: DelayQueue,
}

impl Timers {
    /// Timers for a worker with `slots` slots.
    pub fn new(plan: &Plan, slots: usize) -> Timers {
        let retry = plan.retry_every.unwrap_or(REDIS_RETRY);
        Timers {
            hold: DelayQueue::new(plan.hold, slots),
            retry: DelayQueue::new(retry, slots),
            moved: DelayQueue::new(MOVED_RETRY, slots),
        }
    }

    /// When the next timer is due.
    pub fn next_deadline(&self) -> Option<Instant> {
        [
            self.hold.next_deadline(),
            self.retry.next_deadline(),
            self.moved.next_deadline(),
        ]
        .into_iter()
        .flatten()
        .min()
    }

    /// The next due timer of any kind: (worker's connection number, slot).
    pub fn pop_due(&mut self, now: Instant) -> Option<(u32, u16)> {
        self.hold
            .pop_due(now)
            .or_else(|| self.retry.pop_due(now))
            .or_else(|| self.moved.pop_due(now))
    }
}
