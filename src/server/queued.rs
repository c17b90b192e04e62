//! How many acquires each session has queued, across every core's partition.
//!
//! `max_pending_per_session` bounds a session's *queued* acquires (PROTOCOL.md §3), and a
//! session's acquires can queue in any partition. Only the partition that is about to queue an
//! acquire knows it is about to, so the count has to be one every partition can update: one
//! `AtomicU32` per session slot, taken with a bounded compare-and-swap before a waiter is
//! queued and given back when it leaves its queue. It is touched only when an acquire queues or
//! a waiter leaves, never on a grant, a release or any other request.
//!
//! Indexing: a session id names its core and its slab slot; a core never has more sessions
//! than `max_connections` (it refuses the next one), and a slab hands out slots below its peak
//! occupancy, so `core * max_connections + slot` is in range. A slot's count is back to zero
//! before the slot is reused: every partition withdraws a closed session's waiters before the
//! slot is freed.

use super::reactor::{core_of, slot_of};
use crate::lock_table::{QueueCounts, SessionId};
use std::sync::atomic::{AtomicU32, Ordering};

/// Queued-acquire counts of every session slot of every core.
pub struct SessionQueues {
    slots_per_core: usize,
    counts: Box<[AtomicU32]>,
}

impl SessionQueues {
    /// Counts for `cores` cores of at most `slots_per_core` sessions each, all zero.
    pub fn new(cores: usize, slots_per_core: usize) -> SessionQueues {
        SessionQueues {
            slots_per_core,
            counts: (0..cores * slots_per_core)
                .map(|_| AtomicU32::new(0))
                .collect(),
        }
    }

    /// The acquires `session`'s slot has queued now (0 for a session outside the table).
    pub fn queued(&self, session: SessionId) -> u32 {
        self.count(session)
            .map_or(0, |count| count.load(Ordering::Relaxed))
    }

    fn count(&self, session: SessionId) -> Option<&AtomicU32> {
        let slot = slot_of(session);
        if slot >= self.slots_per_core {
            return None;
        }
        self.counts
            .get(core_of(session).checked_mul(self.slots_per_core)? + slot)
    }
}

impl QueueCounts for SessionQueues {
    fn try_add(&self, session: SessionId, max: u32) -> bool {
        let Some(count) = self.count(session) else {
            // Not a session slot (cannot happen, see the module docs): refuse to queue.
            debug_assert!(false, "session {session:#x} outside the queue counts");
            return false;
        };
        count
            .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |queued| {
                (queued < max).then_some(queued + 1)
            })
            .is_ok()
    }

    fn remove(&self, session: SessionId) {
        if let Some(count) = self.count(session) {
            let before = count.fetch_sub(1, Ordering::Relaxed);
            debug_assert!(
                before > 0,
                "session {session:#x}: more dequeues than queues"
            );
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::server::reactor::session_id;
    use std::sync::Arc;

    #[test]
    fn counts_per_session_up_to_the_limit() {
        let queues = SessionQueues::new(2, 4);
        let a = session_id(0, 3, 7);
        let b = session_id(1, 3, 7);
        assert!(queues.try_add(a, 2));
        assert!(queues.try_add(a, 2));
        assert!(!queues.try_add(a, 2), "third place over a limit of 2");
        assert_eq!(queues.queued(a), 2);
        assert_eq!(
            queues.queued(b),
            0,
            "same slot on another core is another session"
        );
        assert!(queues.try_add(b, 2));
        queues.remove(a);
        assert!(
            queues.try_add(a, 2),
            "a place given back can be taken again"
        );
        assert!(!queues.try_add(a, 2));
        queues.remove(a);
        queues.remove(a);
        queues.remove(b);
        assert_eq!((queues.queued(a), queues.queued(b)), (0, 0));
    }

    #[test]
    fn concurrent_takers_never_exceed_the_limit() {
        let queues = Arc::new(SessionQueues::new(1, 1));
        let session = session_id(0, 0, 1);
        let taken: u32 = (0..4)
            .map(|_| {
                let queues = Arc::clone(&queues);
                std::thread::spawn(move || {
                    (0..1000).filter(|_| queues.try_add(session, 100)).count()
                })
            })
            .collect::<Vec<_>>()
            .into_iter()
            .map(|thread| thread.join().unwrap() as u32)
            .sum();
        assert_eq!(taken, 100);
        assert_eq!(queues.queued(session), 100);
    }
}
