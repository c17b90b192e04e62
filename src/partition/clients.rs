//! What one partition remembers of identified clients (docs/protocol.md §5, resumable calls),
//! besides what its holds and waiters say already: the answers `T` and `B` it gave their
//! acquires (a grant is read from the key's hold, a queued acquire from its queue), the owners
//! a Resolve answered "never seen" (whose acquire, should it still arrive, is refused), and the
//! grants that never reached them (released when the client's grace ends). Kept by a single
//! node's lock table and, for the shards it leads, by a cluster member's partition (there,
//! leader-local: see `crate::cluster::partition`).
//!
//! # Bounds
//!
//! Each answer and each "never seen" is kept [`RETENTION_US`] (60 s, the longest grace), at
//! most [`FATES_PER_CLIENT_MAX`] answers and [`FORGOTTEN_PER_CLIENT_MAX`] owners per client.
//! Past the first bound the oldest answer is dropped (counted): a Resolve of it then says
//! "never seen", which is still true of what stands — a `T` or `B` left nothing on the server.
//! Past the second a Resolve is refused (`X` 10): forgetting an owner early could let its
//! acquire execute after "never seen" was said. Everything of a client goes when its grace
//! ends ([`ClientStates::remove`]).
//!
//! Deliberately not here: the client ids, their sessions and graces (the server's registry,
//! `crate::server::clients`), and the waiters and holds themselves (the lock table's).

use crate::hash::Map as HashMap;
use crate::partition::{ClientRef, Fate};
use std::collections::VecDeque;

/// How long an answer or a "never seen" is kept: the longest grace (docs/protocol.md §5).
pub const RETENTION_US: u64 = latchkey_client::protocol::GRACE_S_MAX as u64 * 1_000_000;
/// Answers (`T`, `B`) kept per client at most.
pub const FATES_PER_CLIENT_MAX: usize = 1024;
/// Owners answered "never seen" kept per client at most.
pub const FORGOTTEN_PER_CLIENT_MAX: usize = 1024;

/// One answer given to a client's acquire.
#[derive(Clone, Copy, Debug)]
struct Answered {
    at_us: u64,
    owner: u64,
    fate: Fate,
}

/// One client's records in this partition.
#[derive(Debug, Default)]
struct ClientState {
    /// Answers `T` and `B`, oldest first.
    answered: VecDeque<Answered>,
    /// Owners answered "never seen", oldest first (few: a linear search is cheap).
    forgotten: VecDeque<(u64, u64)>,
    /// Grants (entry, token) that never reached the client.
    undelivered: Vec<(u32, u64)>,
}

impl ClientState {
    #[cfg(any(test, feature = "testing"))]
    fn is_empty(&self) -> bool {
        self.answered.is_empty() && self.forgotten.is_empty() && self.undelivered.is_empty()
    }

    /// Drops what is older than the retention at `now_us`.
    fn prune(&mut self, now_us: u64) {
        let horizon = now_us.saturating_sub(RETENTION_US);
        while self.answered.front().is_some_and(|a| a.at_us < horizon) {
            self.answered.pop_front();
        }
        while self.forgotten.front().is_some_and(|&(_, at)| at < horizon) {
            self.forgotten.pop_front();
        }
    }
}

/// Why an owner could not be recorded "never seen".
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Full;

/// Every identified client's records in one partition.
#[derive(Debug, Default)]
pub(crate) struct ClientStates {
    by_client: HashMap<u32, ClientState>,
    /// Owners answered "never seen", all clients together: while 0, an acquire is not looked
    /// up (the common case costs nothing).
    forgotten: usize,
}

impl ClientStates {
    /// Records that `client`'s acquire of `owner` was answered `fate` (`T` or `B`) at `now_us`;
    /// true if an older answer was dropped for room.
    pub fn answered(&mut self, client: ClientRef, owner: u64, fate: Fate, now_us: u64) -> bool {
        debug_assert!(matches!(fate, Fate::TimedOut | Fate::Busy));
        let state = self.by_client.entry(client.0).or_default();
        let forgotten_before = state.forgotten.len();
        state.prune(now_us);
        self.forgotten -= forgotten_before - state.forgotten.len();
        let dropped = state.answered.len() >= FATES_PER_CLIENT_MAX;
        if dropped {
            state.answered.pop_front();
        }
        state.answered.push_back(Answered {
            at_us: now_us,
            owner,
            fate,
        });
        dropped
    }

    /// The answer `client`'s acquire of `owner` got, if it is still kept.
    pub fn answer_of(&self, client: ClientRef, owner: u64, now_us: u64) -> Option<Fate> {
        let state = self.by_client.get(&client.0)?;
        let horizon = now_us.saturating_sub(RETENTION_US);
        let answered = state.answered.iter().rev();
        let kept = answered.take_while(|a| a.at_us >= horizon);
        kept.filter(|a| a.owner == owner).map(|a| a.fate).next()
    }

    /// Records that `client`'s `owner` was answered "never seen" at `now_us`; `Err(Full)` when
    /// the client has as many as it may (nothing recorded).
    pub fn forget(&mut self, client: ClientRef, owner: u64, now_us: u64) -> Result<(), Full> {
        let state = self.by_client.entry(client.0).or_default();
        let before = state.forgotten.len();
        state.prune(now_us);
        self.forgotten -= before - state.forgotten.len();
        if state.forgotten.len() >= FORGOTTEN_PER_CLIENT_MAX {
            return Err(Full);
        }
        state.forgotten.push_back((owner, now_us));
        self.forgotten += 1;
        Ok(())
    }

    /// Whether a Resolve answered `client`'s `owner` "never seen" (its acquire is refused).
    #[inline]
    pub fn is_forgotten(&self, client: ClientRef, owner: u64) -> bool {
        if self.forgotten == 0 {
            return false;
        }
        let state = self.by_client.get(&client.0);
        state.is_some_and(|state| state.forgotten.iter().any(|&(o, _)| o == owner))
    }

    /// Records that the grant of `token` on `entry` never reached `client`.
    pub fn undelivered(&mut self, client: ClientRef, entry: u32, token: u64) {
        let state = self.by_client.entry(client.0).or_default();
        state.undelivered.push((entry, token));
    }

    /// The grant of `token` reached `client` after all (a Resolve found it).
    pub fn delivered(&mut self, client: ClientRef, token: u64) {
        if let Some(state) = self.by_client.get_mut(&client.0) {
            state.undelivered.retain(|&(_, t)| t != token);
        }
    }

    /// Forgets `client` (its grace ended), returning the grants that never reached it.
    pub fn remove(&mut self, client: ClientRef) -> Vec<(u32, u64)> {
        let Some(state) = self.by_client.remove(&client.0) else {
            return Vec::new();
        };
        self.forgotten -= state.forgotten.len();
        state.undelivered
    }

    /// Clients with records here.
    #[cfg(any(test, feature = "testing"))]
    pub fn len(&self) -> usize {
        self.by_client
            .values()
            .filter(|state| !state.is_empty())
            .count()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const C: ClientRef = ClientRef(3);

    #[test]
    fn answers_are_kept_for_the_retention_and_the_newest_wins() {
        let mut states = ClientStates::default();
        assert!(!states.answered(C, 7, Fate::TimedOut, 1_000));
        assert_eq!(states.answer_of(C, 7, 1_000), Some(Fate::TimedOut));
        assert_eq!(states.answer_of(ClientRef(4), 7, 1_000), None);
        assert_eq!(states.answer_of(C, 8, 1_000), None);
        let late = 1_000 + RETENTION_US + 1;
        assert_eq!(states.answer_of(C, 7, late), None, "past the retention");
        for owner in 0..FATES_PER_CLIENT_MAX as u64 {
            states.answered(C, 100 + owner, Fate::Busy, 2_000);
        }
        assert!(
            states.answered(C, 9, Fate::Busy, 2_000),
            "the oldest dropped for room"
        );
        assert_eq!(states.answer_of(C, 100, 2_000), None);
        assert_eq!(states.answer_of(C, 9, 2_000), Some(Fate::Busy));
    }

    #[test]
    fn never_seen_owners_are_refused_until_their_client_goes() {
        let mut states = ClientStates::default();
        assert!(!states.is_forgotten(C, 5));
        states.forget(C, 5, 10).expect("room");
        assert!(states.is_forgotten(C, 5));
        assert!(!states.is_forgotten(ClientRef(4), 5));
        for owner in 1..FORGOTTEN_PER_CLIENT_MAX as u64 {
            states.forget(C, 1_000 + owner, 10).expect("room");
        }
        assert_eq!(states.forget(C, 6, 10), Err(Full));
        assert!(!states.is_forgotten(C, 6));
        // Past the retention they go, and room comes back.
        states.forget(C, 6, 20 + RETENTION_US).expect("room again");
        assert!(!states.is_forgotten(C, 5));
        states.undelivered(C, 1, 77);
        states.undelivered(C, 2, 78);
        states.delivered(C, 77);
        assert_eq!(states.remove(C), vec![(2, 78)]);
        assert!(!states.is_forgotten(C, 6));
        assert_eq!(states.len(), 0);
    }
}
