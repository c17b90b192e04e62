//! [`Places`]: the places queued acquires take in their sessions' `max_pending_per_session`
//! (docs/protocol.md §3.3), the one count of them both partitions keep.
//!
//! A server of one core counts a session's places here alone. A server of several cores shares
//! [`QueueCounts`] between its partitions (a session's acquires may queue on any core), where
//! the limit is decided atomically; each partition still counts the places its own waiters hold,
//! so that it gives back exactly what it took and its invariant checks can compare the count
//! with its queues.
//!
//! Invariant (each partition checks it against its queues): the places held by a session here
//! are the waiters of that session here that hold one. No zero counts are kept. A detached
//! client's waiters (`crate::partition::ClientRef::detached`) hold places here only: no session
//! of a core counts them.
//!
//! Deliberately not here: which waiters hold a place (a single node's waiters all do; a
//! cluster's proposed queue head gives its place back while its grant is in the log), and the
//! waiters themselves.

use crate::hash::Map as HashMap;
use crate::partition::{is_detached, QueueCounts, SessionId};
use std::sync::Arc;

/// Per-session places of one partition. See the module docs.
pub struct Places {
    max: u32,
    /// Places held by this partition's waiters, per session (no zero counts).
    held: HashMap<SessionId, u32>,
    /// Their sum.
    total: usize,
    shared: Option<Arc<dyn QueueCounts>>,
}

impl Places {
    /// No places held; a session may hold `max` (at least 1).
    pub fn new(max: u32) -> Places {
        assert!(max >= 1, "max_pending_per_session must be at least 1");
        Places {
            max,
            held: HashMap::default(),
            total: 0,
            shared: None,
        }
    }

    /// Decides the limit with `counts`, shared with the other partitions of the server. Before
    /// any place is taken.
    pub fn share(&mut self, counts: Arc<dyn QueueCounts>) {
        assert!(self.held.is_empty(), "places shared after some were taken");
        self.shared = Some(counts);
    }

    /// Takes a place for `session`; false (nothing taken) when it holds `max` already, here or
    /// (shared) in all partitions together. The caller queues a waiter that holds it right
    /// after.
    pub fn try_take(&mut self, session: SessionId) -> bool {
        let held = self.held_by(session);
        let free = match &self.shared {
            Some(shared) => shared.try_add(session, self.max),
            None => held < self.max,
        };
        if free {
            self.held.insert(session, held + 1);
            self.total += 1;
        }
        free
    }

    /// Takes a place for `session` whatever it holds: a waiter that changes hands (a detached
    /// client's waiter, or one a Resolve attached to a new session) keeps the place it had.
    pub fn take_forced(&mut self, session: SessionId) {
        if let Some(shared) = self.shared.as_ref().filter(|_| !is_detached(session)) {
            let taken = shared.try_add(session, u32::MAX);
            debug_assert!(taken, "a forced place is always taken");
        }
        *self.held.entry(session).or_insert(0) += 1;
        self.total += 1;
    }

    /// Gives back one place of `session`. Panics if it holds none here (a bug: every place
    /// given back was taken).
    pub fn give_back(&mut self, session: SessionId) {
        match self.held.get_mut(&session) {
            Some(held) if *held > 1 => *held -= 1,
            Some(_) => {
                self.held.remove(&session);
            }
            None => panic!("session {session:#x}: a place given back that was not taken"),
        }
        self.total -= 1;
        if let Some(shared) = self.shared.as_ref().filter(|_| !is_detached(session)) {
            shared.remove(session);
        }
    }

    /// Places `session` holds here.
    pub fn held_by(&self, session: SessionId) -> u32 {
        self.held.get(&session).copied().unwrap_or(0)
    }

    /// Places held here, all sessions together.
    pub fn held(&self) -> usize {
        self.total
    }

    /// Every session's places here (for invariant checks).
    pub fn iter(&self) -> impl Iterator<Item = (SessionId, u32)> + '_ {
        self.held.iter().map(|(&session, &held)| (session, held))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicU32, Ordering};

    /// One session's count, shared.
    struct OneCount(AtomicU32);

    impl QueueCounts for OneCount {
        fn try_add(&self, _session: SessionId, max: u32) -> bool {
            let taken = self
                .0
                .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| {
                    (n < max).then_some(n + 1)
                });
            taken.is_ok()
        }

        fn remove(&self, _session: SessionId) {
            self.0.fetch_sub(1, Ordering::SeqCst);
        }
    }

    #[test]
    fn places_count_per_session_up_to_the_limit() {
        let mut places = Places::new(2);
        assert!(places.try_take(1) && places.try_take(1));
        assert!(!places.try_take(1), "a third place past the limit");
        assert!(places.try_take(2));
        assert_eq!(
            (places.held_by(1), places.held_by(2), places.held()),
            (2, 1, 3)
        );
        places.give_back(1);
        places.give_back(2);
        assert_eq!(
            (places.held_by(1), places.held_by(2), places.held()),
            (1, 0, 1)
        );
        assert_eq!(places.iter().collect::<Vec<_>>(), vec![(1, 1)]);
    }

    #[test]
    fn shared_counts_decide_the_limit_across_partitions() {
        let counts: Arc<dyn QueueCounts> = Arc::new(OneCount(AtomicU32::new(0)));
        let (mut a, mut b) = (Places::new(2), Places::new(2));
        a.share(counts.clone());
        b.share(counts);
        assert!(a.try_take(1) && b.try_take(1));
        assert!(!a.try_take(1) && !b.try_take(1), "two places across both");
        b.give_back(1);
        assert!(a.try_take(1));
        assert_eq!((a.held(), b.held()), (2, 0));
    }

    #[test]
    #[should_panic(expected = "not taken")]
    fn a_place_never_taken_cannot_be_given_back() {
        Places::new(1).give_back(3);
    }
}
