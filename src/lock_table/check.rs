//! The module docs' invariants, walked: the per-entry check runs after every mutation in debug
//! builds, `LockTable::check_invariants` (the whole table) in tests.

use super::LockTable;
#[cfg(any(debug_assertions, test, feature = "testing"))]
use super::NIL;
#[cfg(any(debug_assertions, test, feature = "testing"))]
use std::hash::BuildHasher;

impl LockTable {
    #[cfg(debug_assertions)]
    pub(super) fn debug_check_entry(&self, entry: u32) {
        if self.entries.contains(entry) {
            self.check_entry(entry);
        }
    }

    #[cfg(not(debug_assertions))]
    pub(super) fn debug_check_entry(&self, _entry: u32) {}

    /// Checks one entry and its queue; panics on a broken invariant.
    #[cfg(any(debug_assertions, test, feature = "testing"))]
    pub(super) fn check_entry(&self, entry: u32) {
        let held = &self.entries[entry];
        assert!(
            held.token != 0 && held.token < self.tokens.next,
            "token out of range"
        );
        assert_eq!(self.hasher.hash_one(held.key.as_slice()), held.hash);
        let deadline = self
            .wheel
            .deadline(held.lease_timer)
            .expect("lease timer is live");
        assert_eq!(deadline, self.tick_at_or_after(held.lease_end_us));
        let (mut cursor, mut prev, mut count) = (held.queue_head, NIL, 0u32);
        while cursor != NIL {
            let waiter = &self.waiters[cursor];
            assert_eq!(waiter.entry, entry, "waiter linked in another key's queue");
            assert_eq!(waiter.queue_prev, prev, "broken queue back link");
            assert!(
                self.wheel.deadline(waiter.timer).is_some(),
                "waiter without live timer"
            );
            count += 1;
            assert!(
                count <= self.config.max_waiters_per_key,
                "queue longer than its limit"
            );
            (prev, cursor) = (cursor, waiter.queue_next);
        }
        assert_eq!(held.queue_tail, prev);
        assert_eq!(held.waiters, count);
    }

    /// Checks every invariant of the module docs; panics on a broken one. O(keys + waiters).
    #[cfg(any(test, feature = "testing"))]
    pub fn check_invariants(&self) {
        self.wheel.check_invariants();
        self.entries.check_invariants();
        self.waiters.check_invariants();
        self.index.check_invariants();
        self.sessions.check_invariants();
        assert!(self.entries.len() <= self.config.max_keys);
        assert_eq!(self.index.len(), self.entries.len());
        let mut queued = 0usize;
        for (entry, held) in self.entries.iter() {
            self.check_entry(entry);
            let indexed = self.find(held.hash, held.key.as_slice());
            assert_eq!(indexed, Some(entry), "entry not indexed under its key");
            queued += held.waiters as usize;
        }
        assert_eq!(queued, self.waiters.len());
        assert_eq!(self.wheel.len(), self.entries.len() + self.waiters.len());
        let mut listed = 0usize;
        for &(session, list) in self.sessions.iter() {
            assert!(
                list.count <= self.config.max_pending_per_session,
                "session {session} has more queued acquires than the limit"
            );
            let (mut cursor, mut prev) = (list.head, NIL);
            for _ in 0..list.count {
                let waiter = &self.waiters[cursor];
                assert_eq!(waiter.session, session);
                assert_eq!(waiter.session_prev, prev);
                (prev, cursor) = (cursor, waiter.session_next);
            }
            assert_eq!(cursor, NIL, "session list longer than its count");
            assert_eq!(
                self.places.held_by(session),
                list.count,
                "session {session}'s places"
            );
            listed += list.count as usize;
        }
        assert_eq!(listed, self.waiters.len());
        assert_eq!(
            self.places.held(),
            self.waiters.len(),
            "every waiter holds a place"
        );
        if self.shutting_down {
            assert!(self.waiters.is_empty(), "waiters queued during shutdown");
        }
    }
}
