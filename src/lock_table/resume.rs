//! Resumable calls on a single node (docs/protocol.md §5): what a partition does for identified
//! clients — a Resolve answered from the key's entry, its queue or the answers remembered
//! (`clients.rs`); a closed session's waiters and undelivered grants kept for its client
//! (*detached*, under [`ClientRef::detached`]) instead of withdrawn or released; and all of it
//! let go when the client's grace ends.
//!
//! # Invariants
//!
//! A waiter of an identified client is linked in exactly one session list: its live session's,
//! or its client's detached one (where it holds a place like any waiter). A hold whose holder is
//! a detached id is recorded undelivered for that client (released at the end of its grace
//! unless a Resolve found it first). Nothing is ever answered to a detached id.
//!
//! Deliberately not here: client ids, graces and their timers (the server's registry), and
//! the rules of §3 (unchanged: a resumed waiter keeps its place in its queue).

use super::{LockTable, NIL};
use crate::partition::{ClientRef, Fate, SessionId};
use latchkey_client::protocol::{ErrorCode, Response};
use std::hash::BuildHasher;

impl LockTable {
    /// Resolve from `session` (of `client`): what became of its acquire of `key` with `owner`.
    /// A grant still held is now the session's (its `A` counts as delivered); a queued acquire
    /// is attached to the session (its answer will come there); a `T` or `B` is reported as
    /// remembered; anything else is recorded "never seen", so that the acquire, should it
    /// still arrive, is refused (`X` 10 when the client has as many as it may).
    pub fn handle_resolve(
        &mut self,
        now_us: u64,
        session: SessionId,
        client: ClientRef,
        owner: u64,
        key: &[u8],
    ) {
        self.now_us = self.now_us.max(now_us);
        if !client.is_some() {
            // The core refuses a Resolve of a session that did not identify; so does the table.
            let code = ErrorCode::NotIdentified;
            return self.answer(session, Response::Error { code, id: owner }, false);
        }
        let response = self.resolve(now_us, session, client, owner, key);
        if let Response::Resolved { fate, .. } = response {
            self.stats.resolves[fate as usize] += 1;
        }
        self.answer(session, response, false);
    }

    fn resolve(
        &mut self,
        now_us: u64,
        session: SessionId,
        client: ClientRef,
        owner: u64,
        key: &[u8],
    ) -> Response {
        let resolved = |fate, token, lease_ms| Response::Resolved {
            owner,
            fate,
            token,
            lease_ms,
        };
        let hash = self.hasher.hash_one(key);
        if let Some(entry) = self.find(hash, key) {
            let held = &mut self.entries[entry];
            if held.client == client && held.owner == owner {
                held.holder = session;
                let token = held.token;
                let left_ms = held.lease_end_us.saturating_sub(now_us) / 1000;
                self.clients.delivered(client, token);
                let lease_ms = u32::try_from(left_ms).unwrap_or(u32::MAX);
                return resolved(Fate::Granted, token, lease_ms);
            }
            // Bounded by `max_waiters_per_key`.
            let mut cursor = held.queue_head;
            while cursor != NIL {
                let waiter = &self.waiters[cursor];
                if waiter.client == client && waiter.owner == owner {
                    self.move_waiter(cursor, session);
                    self.debug_check_entry(entry);
                    return resolved(Fate::Queued, 0, 0);
                }
                cursor = waiter.queue_next;
            }
        }
        if let Some(fate) = self.clients.answer_of(client, owner, now_us) {
            return resolved(fate, 0, 0);
        }
        match self.clients.forget(client, owner, now_us) {
            Ok(()) => resolved(Fate::NeverSeen, 0, 0),
            Err(_) => Response::Error {
                code: ErrorCode::Limit,
                id: owner,
            },
        }
    }

    /// Moves `waiter` to `session`'s list, its place with it (taken whatever the new session
    /// holds: it keeps the place it had).
    fn move_waiter(&mut self, waiter: u32, session: SessionId) {
        let from = self.waiters[waiter].session;
        self.unlink_session(waiter);
        self.places.give_back(from);
        self.link_session(waiter, session);
        self.places.take_forced(session);
    }

    /// `session` closed. Without a client its waiters leave silently; with one they stay
    /// queued for the client, detached, until a Resolve attaches them or its grace ends.
    pub fn handle_session_closed_as(&mut self, session: SessionId, client: ClientRef) {
        if !client.is_some() {
            return self.handle_session_closed(session);
        }
        let Some(list) = self.session_list(session) else {
            return;
        };
        let detached = client.detached();
        let mut cursor = list.head;
        // Bounded by the session's waiter count in this partition.
        for _ in 0..list.count {
            let next = self.waiters[cursor].session_next;
            self.move_waiter(cursor, detached);
            cursor = next;
        }
        debug_assert!(self.session_list(session).is_none());
    }

    /// The grant of `token` on `entry` never reached its session. Without a client it is
    /// released at once; with one it stays, detached, for the client to resolve until its
    /// grace ends.
    pub fn release_granted_as(
        &mut self,
        now_us: u64,
        entry: u32,
        token: u64,
        client: ClientRef,
    ) -> bool {
        if !client.is_some() {
            return self.release_granted(now_us, entry, token);
        }
        let Some(held) = self
            .entries
            .get_mut(entry)
            .filter(|held| held.token == token)
        else {
            return false;
        };
        held.holder = client.detached();
        self.clients.undelivered(client, entry, token);
        true
    }

    /// `client`'s grace ended without a session: its detached waiters leave, its grants that
    /// never reached it are released, and its records go.
    pub fn handle_client_gone(&mut self, now_us: u64, client: ClientRef) {
        self.now_us = self.now_us.max(now_us);
        let detached = client.detached();
        self.handle_session_closed(detached);
        for (entry, token) in self.clients.remove(client) {
            let undelivered = self.entries.get(entry);
            if undelivered.is_some_and(|held| held.token == token && held.holder == detached) {
                self.stats.grace_releases += 1;
                self.release_granted(now_us, entry, token);
            }
        }
    }

    /// Identified clients this partition keeps records of.
    #[cfg(any(test, feature = "testing"))]
    pub fn client_records(&self) -> usize {
        self.clients.len()
    }
}
