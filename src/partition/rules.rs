//! The lock rules of docs/protocol.md §3 that decide what becomes of a request, written once for
//! both partitions: a single node's lock table (`crate::lock_table`) and a cluster shard's
//! leader (`crate::cluster::partition`). Each rule is a pure function of what the partition
//! knows; the partitions differ only in how they know it (the table from its entries, the
//! cluster's leader from its applied state, its queues and the grants in flight) and in how they
//! carry a decision out (the table at once, the cluster through the log).
//!
//! * [`admit`]: an Acquire is granted, queued, timed out (`T`) or refused (`B`), checked in the
//!   contract's order: shutdown, then a free key (granted if the partition has room for one more
//!   key), then a taken key (`wait = 0`: `T`; a full queue: `B`; else it queues). Queuing also
//!   takes one of its session's places ([`crate::partition::Places`], the one per-session count
//!   of `max_pending_per_session`): none left is `B` too. The place is taken last, so that a
//!   place taken is always followed by the enqueue.
//! * [`wait_ends_first`]: when a lease and a queue head's wait run out in the same late step,
//!   they take effect in deadline order (a wait that ended at or before the lease is answered
//!   `T`; one that ended after it gets the key).
//! * [`withdraws`]: a Cancel withdraws the acquires queued by *its own session* with *its
//!   owner* on its key (each answered `T`); it never touches a holder or another session's
//!   waiter.
//! * A session's close withdraws its queued acquires silently and leaves its holds alone; a
//!   grant whose `A` never reached its session is released by the server at once
//!   ([`crate::partition::Partition::release_granted`]).
//!
//! The reference model beside this file (`model.rs`, tests only) states the same rules plainly
//! and is the net both partitions are checked against (`tests/queue_rules.rs`); it is not their
//! home.
//!
//! Deliberately not here: storage (queues, holds, timers are each partition's own), tokens, and
//! anything a partition must learn by I/O.

use crate::partition::{BusyReason, Places, SessionId};

/// What a partition knows when an Acquire arrives, as [`admit`] needs it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct AcquireView {
    /// The server is shutting down: every Acquire is refused.
    pub shutting_down: bool,
    /// The key is held or has a queue (a cluster counts a grant in flight as held).
    pub taken: bool,
    /// The partition may take one more key (`max_keys` per partition); asked of a free key.
    pub room_for_key: bool,
    /// The key's waiters as docs/protocol.md §3 counts them (`max_waiters_per_key`, `Q`).
    pub waiters: u32,
    /// `limits.max_waiters_per_key` (at least 1).
    pub max_waiters_per_key: u32,
    /// The acquire's wait in seconds (0: one immediate attempt, never queued).
    pub wait_s: u8,
}

/// What becomes of an Acquire.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Admit {
    /// The key is free: grant it (a partition that cannot issue a token refuses it `B`).
    Grant,
    /// Queue at the tail of the key's queue; a place of its session is taken already.
    Queue,
    /// `T` at once: the key is taken and the acquire may not wait.
    Timeout,
    /// `B`: the acquire is not executed.
    Busy(BusyReason),
}

/// Decides an Acquire of `session` (docs/protocol.md §3.1, §3.3). A [`Admit::Queue`] has taken
/// one of the session's places in `places`; every other outcome took none.
pub fn admit(view: &AcquireView, places: &mut Places, session: SessionId) -> Admit {
    if view.shutting_down {
        return Admit::Busy(BusyReason::Shutdown);
    }
    if !view.taken {
        return match view.room_for_key {
            true => Admit::Grant,
            false => Admit::Busy(BusyReason::Keys),
        };
    }
    if view.wait_s == 0 {
        return Admit::Timeout;
    }
    if view.waiters >= view.max_waiters_per_key {
        return Admit::Busy(BusyReason::WaitersPerKey);
    }
    // Taken last: a place taken (in shared counts too) is always followed by the enqueue.
    match places.try_take(session) {
        true => Admit::Queue,
        false => Admit::Busy(BusyReason::PendingPerSession),
    }
}

/// Whether a queue head whose wait ends at `wait_end_us` times out before a lease that ends at
/// `lease_end_us` would hand it the key, when both are processed in one late step
/// (docs/protocol.md §3.5: deadline order; on equal ends the wait goes first).
pub fn wait_ends_first(wait_end_us: u64, lease_end_us: u64) -> bool {
    wait_end_us <= lease_end_us
}

/// Whether a Cancel of `owner` from `session` withdraws a waiter queued by `waiter_session`
/// with `waiter_owner` on the Cancel's key.
pub fn withdraws(
    (waiter_session, waiter_owner): (SessionId, u64),
    (session, owner): (SessionId, u64),
) -> bool {
    waiter_session == session && waiter_owner == owner
}

#[cfg(test)]
mod tests {
    use super::*;

    fn view(taken: bool, wait_s: u8, waiters: u32) -> AcquireView {
        AcquireView {
            shutting_down: false,
            taken,
            room_for_key: true,
            waiters,
            max_waiters_per_key: 2,
            wait_s,
        }
    }

    #[test]
    fn admit_checks_in_the_contracts_order() {
        let mut places = Places::new(1);
        let shutdown = AcquireView {
            shutting_down: true,
            ..view(false, 1, 0)
        };
        assert_eq!(
            admit(&shutdown, &mut places, 1),
            Admit::Busy(BusyReason::Shutdown)
        );
        assert_eq!(admit(&view(false, 0, 0), &mut places, 1), Admit::Grant);
        let full = AcquireView {
            room_for_key: false,
            ..view(false, 5, 0)
        };
        assert_eq!(admit(&full, &mut places, 1), Admit::Busy(BusyReason::Keys));
        // A taken key: wait 0 times out even with a full queue and no place left.
        assert_eq!(admit(&view(true, 0, 9), &mut places, 1), Admit::Timeout);
        assert_eq!(
            admit(&view(true, 1, 2), &mut places, 1),
            Admit::Busy(BusyReason::WaitersPerKey)
        );
        assert_eq!(places.held(), 0, "no outcome but Queue takes a place");
        assert_eq!(admit(&view(true, 1, 1), &mut places, 1), Admit::Queue);
        assert_eq!(places.held(), 1);
        assert_eq!(
            admit(&view(true, 1, 0), &mut places, 1),
            Admit::Busy(BusyReason::PendingPerSession)
        );
        assert_eq!(admit(&view(true, 1, 0), &mut places, 2), Admit::Queue);
        assert_eq!(places.held(), 2);
    }

    #[test]
    fn deadline_order_and_cancel_matching() {
        assert!(wait_ends_first(5, 5));
        assert!(wait_ends_first(4, 5));
        assert!(!wait_ends_first(6, 5));
        assert!(withdraws((1, 7), (1, 7)));
        assert!(!withdraws((1, 7), (2, 7)));
        assert!(!withdraws((1, 7), (1, 8)));
    }
}
