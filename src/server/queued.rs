//! How many acquires each session has queued, across every core's partition.
//!
//! `max_pending_per_session` bounds a session's *queued* acquires (docs/protocol.md §3), and a
//! session's acquires can queue in any partition. Only the partition that is about to queue an
//! acquire knows it is about to, so the count has to be one every partition can update: one
//! `AtomicU32` per session slot, taken with a bounded compare-and-swap before a waiter is
//! queued and given back when it leaves its queue. It is touched only when an acquire queues or
//! a waiter leaves, never on a grant, a release or any other request.
//!
//! Indexing: a session id names its core and its slab slot; slots are counted in chunks of
//! [`CHUNK_SLOTS`], allocated by the session's own core when it admits a session into a chunk
//! not used before (before any message can name that session), so memory follows the sessions a
//! core has had at once, not `cores × max_connections` (up to 4 GiB when configured large). A
//! slot's count is back to zero before the slot is reused: every partition withdraws a closed
//! session's waiters before the slot is freed.

use super::reactor::{core_of, slot_of};
use crate::partition::{QueueCounts, SessionId};
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::OnceLock;

/// Session slots per lazily allocated chunk of counts (16 KiB).
pub const CHUNK_SLOTS: usize = 4096;

type Chunk = Box<[AtomicU32; CHUNK_SLOTS]>;

/// Queued-acquire counts of every session slot of every core.
pub struct SessionQueues {
    chunks_per_core: usize,
    chunks: Box<[OnceLock<Chunk>]>,
}

impl SessionQueues {
    /// Counts for `cores` cores of at most `slots_per_core` sessions each, all zero; nothing is
    /// allocated for them until [`admit`](Self::admit).
    pub fn new(cores: usize, slots_per_core: usize) -> SessionQueues {
        let chunks_per_core = slots_per_core.div_ceil(CHUNK_SLOTS);
        SessionQueues {
            chunks_per_core,
            chunks: (0..cores * chunks_per_core)
                .map(|_| OnceLock::new())
                .collect(),
        }
    }

    /// Makes room for `session`'s count; its core calls this when it admits the session.
    /// False for a session outside the table.
    pub fn admit(&self, session: SessionId) -> bool {
        let Some(chunk) = self.chunk_index(session) else {
            return false;
        };
        self.chunks[chunk].get_or_init(|| Box::new(std::array::from_fn(|_| AtomicU32::new(0))));
        true
    }

    /// Chunks of counts allocated so far.
    #[cfg(test)]
    pub fn chunks_allocated(&self) -> usize {
        self.chunks
            .iter()
            .filter(|chunk| chunk.get().is_some())
            .count()
    }

    /// The acquires `session`'s slot has queued now (0 for a session outside the table).
    pub fn queued(&self, session: SessionId) -> u32 {
        self.count(session)
            .map_or(0, |count| count.load(Ordering::Relaxed))
    }

    fn chunk_index(&self, session: SessionId) -> Option<usize> {
        let chunk = slot_of(session) / CHUNK_SLOTS;
        if chunk >= self.chunks_per_core {
            return None;
        }
        let index = core_of(session).checked_mul(self.chunks_per_core)? + chunk;
        (index < self.chunks.len()).then_some(index)
    }

    fn count(&self, session: SessionId) -> Option<&AtomicU32> {
        let chunk = self.chunks[self.chunk_index(session)?].get()?;
        Some(&chunk[slot_of(session) % CHUNK_SLOTS])
    }
}

impl QueueCounts for SessionQueues {
    fn try_add(&self, session: SessionId, max: u32) -> bool {
        let Some(count) = self.count(session) else {
            // Not an admitted session slot (cannot happen, see the module docs): refuse.
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
    use crate::server::core::session_id;
    use std::sync::Arc;

    #[test]
    fn counts_per_session_up_to_the_limit() {
        let queues = SessionQueues::new(2, 4);
        let a = session_id(0, 3, 7);
        let b = session_id(1, 3, 7);
        assert!(queues.admit(a) && queues.admit(b));
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
        assert!(queues.admit(session));
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

    #[test]
    fn counts_are_allocated_by_chunk_as_slots_are_used() {
        // The largest configuration: a million sessions on each of 1,024 cores.
        let queues = SessionQueues::new(1024, 1_000_000);
        assert_eq!(
            queues.chunks_allocated(),
            0,
            "nothing before a session is admitted"
        );
        let first = session_id(7, 0, 1);
        let far = session_id(1023, 999_999, 1);
        assert!(queues.admit(first) && queues.admit(far));
        assert!(
            queues.admit(session_id(7, CHUNK_SLOTS - 1, 2)),
            "same chunk"
        );
        assert_eq!(queues.chunks_allocated(), 2);
        assert!(queues.try_add(far, 1));
        assert_eq!(queues.queued(far), 1);
        assert!(
            !queues.admit(session_id(0, 1_000_000 + CHUNK_SLOTS, 1)),
            "outside the table"
        );
    }
}
