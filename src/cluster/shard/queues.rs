//! [`Queues`]: a shard leader's queued acquires — the FIFO of each key, the places they hold in
//! their sessions' `max_pending_per_session`, and an index of each session's keys, so that
//! closing a session visits only the keys it queued on.
//!
//! The queues are the leader's: its sessions, wait timers and places. Once every member reads
//! them, a waiter of an identified client that had to queue is also *mirrored* in the
//! replicated state (its `Enqueue` proposed): every way out of a queue other than a grant
//! (which takes it out of the replicated queue itself) records its owner for the partition to
//! propose a `Withdraw` ([`Queues::take_withdrawn`]). A new leader *adopts* the replicated
//! queues ([`Waiter::origin`]): each waiter in its place, unattached until its client resolves
//! it or sends its acquire again ([`Queues::attach`], [`Queues::attach_adopted`]). A waiter of
//! an identified client outlives its session, detached, for its client's grace
//! ([`Queues::detach_session`], [`Queues::attach`]; docs/protocol.md §5).
//!
//! The head of a key's queue is *proposed* — an entry that grants it is in the log and not yet
//! applied: an `Acquire` of the key, free in the applied state, or the `then`
//! of a release or expiry of the key's holder (a handoff, one entry) — or it waits: for the
//! holder's release or expiry, which will carry it, or for a release or expiry already in the
//! log (proposed before it arrived) to free the key.
//!
//! A waiter that had to queue (its key was held or had a queue when it arrived, and its wait
//! is above 0) takes one of its session's places ([`Places`]) and gives it back when it leaves
//! its queue, is abandoned (answered early, or its session closed) or is proposed (the holder
//! to be: a single node would have granted it in the step that freed the key); every way out of
//! a queue is a method here that gives the place back, so none can forget it. For the same
//! reason a proposed head is not one of its key's waiters for `max_waiters_per_key` and `Q`
//! ([`Queues::waiting_len`]).
//!
//! # Invariants (checked by [`Queues::check_invariants`] in debug builds)
//!
//! No empty queue is kept; only a queue's head may be proposed; a handoff is proposed; an
//! abandoned waiter holds no place; the counts of waiters and of heads proposed by an `Acquire`
//! match the queues; the session index lists, per session and key, exactly that session's
//! waiters in that key's queue.

use crate::hash::Map as HashMap;
use crate::partition::{ClientRef, Places, SessionId, DETACHED};
use std::collections::VecDeque;

/// The session of adopted waiters no session took yet ([`Waiter::origin`]): a detached id no
/// client's is (a [`ClientRef`]'s generation never reaches `0xFFFF`), so nobody reads its
/// answers and no client's records are kept under it.
pub(crate) const ADOPTED: SessionId = DETACHED + 0xFFFF_FFFE;
const _: () = assert!(ADOPTED < crate::partition::NOBODY);

/// An acquire queued on the leader.
#[derive(Clone, Debug)]
pub(crate) struct Waiter {
    /// The session that sent it (or that a Resolve attached it to).
    pub session: SessionId,
    /// The identified client that sent it, while that client may still ask about it
    /// ([`Queues::attach`]); `NONE` for a session that did not identify, and once it is
    /// answered.
    pub client: ClientRef,
    /// Its correlation id.
    pub owner: u64,
    /// The lease it asks for.
    pub lease_ms: u32,
    /// When the entry that grants it was proposed (server clock, µs; 0 while not proposed):
    /// a grant applied a whole lease after that is stale (see `answer_grant`).
    pub proposed_us: u64,
    /// When its wait ends (server clock, µs).
    pub deadline_us: u64,
    /// Its wait was more than 0 (its answer ends a pending acquire of the session).
    pub ends_pending: bool,
    /// A unique number, to find it from its wait timer.
    pub seq: u64,
    /// An entry that grants it is in the log, not yet applied.
    pub proposed: bool,
    /// That entry is the `then` of a release or expiry (a handoff), not an `Acquire`: it
    /// adds no hold, so it does not count in `Shard::holds_and_grants`.
    pub handoff: bool,
    /// It was answered (`T` or `B`) or its session closed while proposed: a grant that still
    /// commits for it is released at once, unanswered — unless, after its session closed, a
    /// Resolve of its client attached it to another session first.
    pub abandoned: bool,
    /// It holds one of its session's places (see [`Places`]).
    pub counted: bool,
    /// Its `Enqueue` is in the log (proposed here, or adopted): leaving its queue other than by
    /// a grant records a `Withdraw` ([`Queues::take_withdrawn`]).
    pub mirrored: bool,
    /// Adopted from the replicated state when this member began to serve the shard, and not
    /// attached to a session since: the client id of its acquire (0 for any other waiter).
    pub origin: u128,
    /// For an adopted waiter: when its wait ends once attached (this member's deadline for it,
    /// from its apply of the waiter's `Enqueue`); unattached, it leaves at `deadline_us`, the
    /// sooner of that and the end of its client's grace.
    pub wait_end_us: u64,
}

impl Waiter {
    /// What it is as its queue's head.
    fn as_head(&self) -> Head {
        Head {
            session: self.session,
            owner: self.owner,
            lease_ms: self.lease_ms,
            proposed: self.proposed,
            seq: self.seq,
            ends_pending: self.ends_pending,
            mirrored: self.mirrored,
        }
    }

    /// Gives back the place this waiter holds in `places`, if it holds one.
    fn give_place_back(&mut self, places: &mut Places) {
        if std::mem::replace(&mut self.counted, false) {
            places.give_back(self.session);
        }
    }

    /// Marks it abandoned: it stays queued until its entry decides, and its session has the
    /// place back now. `answered` (`T` or `B`): its client can no longer attach it (a Resolve
    /// gets the answer it was given); else its session closed, and its client may.
    fn abandon(&mut self, places: &mut Places, answered: bool) {
        self.abandoned = true;
        if answered {
            self.client = ClientRef::NONE;
        }
        self.give_place_back(places);
    }
}

/// A mirrored waiter that left its queue other than by a grant: its `Withdraw` is due.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct Withdrawn {
    /// Its key.
    pub key: Vec<u8>,
    /// Its owner.
    pub owner: u64,
    /// The session it was answered on, if it was (the partition looks up how).
    pub session: SessionId,
}

/// What a queue head is, for the entry that may grant it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Head {
    /// Its session.
    pub session: SessionId,
    /// Its owner.
    pub owner: u64,
    /// The lease it asks for.
    pub lease_ms: u32,
    /// Whether an entry that grants it is in the log.
    pub proposed: bool,
    /// Its number (`Waiter::seq`).
    pub seq: u64,
    /// Its wait was more than 0 (see `Waiter::ends_pending`).
    pub ends_pending: bool,
    /// Its `Enqueue` is in the log (see `Waiter::mirrored`).
    pub mirrored: bool,
}

/// One shard's queued acquires on its leader. See the module docs.
#[derive(Default)]
pub(crate) struct Queues {
    /// The FIFO of each key (no empty one is kept).
    by_key: HashMap<Vec<u8>, VecDeque<Waiter>>,
    /// Waiters in all queues.
    waiters: usize,
    /// Queue heads proposed by an `Acquire` (grants that may add a hold when applied; a
    /// handoff adds none).
    proposed: usize,
    /// Each session's waiters per key (no zero counts, no empty maps).
    by_session: HashMap<SessionId, HashMap<Vec<u8>, u32>>,
    /// Mirrored waiters that left other than by a grant, for their `Withdraw`s (taken by the
    /// partition after each step; at most one per waiter that left).
    withdrawn: Vec<Withdrawn>,
}

impl Queues {
    /// Queues `waiter` at the back of `key`'s queue.
    pub fn enqueue(&mut self, key: &[u8], waiter: Waiter) {
        let keys = self.by_session.entry(waiter.session).or_default();
        match keys.get_mut(key) {
            Some(count) => *count += 1,
            None => {
                keys.insert(key.to_vec(), 1);
            }
        }
        match self.by_key.get_mut(key) {
            Some(queue) => queue.push_back(waiter),
            None => {
                self.by_key.insert(key.to_vec(), VecDeque::from([waiter]));
            }
        }
        self.waiters += 1;
    }

    /// Waiters in all queues.
    pub fn len(&self) -> usize {
        self.waiters
    }

    /// Heads proposed by an `Acquire`.
    pub fn proposed(&self) -> usize {
        self.proposed
    }

    /// The length of `key`'s queue.
    pub fn queue_len(&self, key: &[u8]) -> usize {
        self.by_key.get(key).map_or(0, VecDeque::len)
    }

    /// The waiters of `key` as docs/protocol.md §3 counts them (`max_waiters_per_key`, `Q`'s
    /// waiters): the queue but a proposed head. An entry that grants that head is in the log;
    /// on a single node it would hold the key already (granted in the step that freed it), so
    /// it is the holder to be, not a waiter (if the entry does not grant it, it waits again).
    pub fn waiting_len(&self, key: &[u8]) -> usize {
        let Some(queue) = self.by_key.get(key) else {
            return 0;
        };
        queue.len() - usize::from(queue.front().is_some_and(|head| head.proposed))
    }

    /// The head of `key`'s queue.
    pub fn head(&self, key: &[u8]) -> Option<Head> {
        self.by_key.get(key)?.front().map(Waiter::as_head)
    }

    /// The head of `key`'s queue, whole (tests).
    #[cfg(test)]
    pub fn head_waiter(&self, key: &[u8]) -> Option<&Waiter> {
        self.by_key.get(key)?.front()
    }

    /// The waiter `seq` of `key`'s queue.
    pub fn waiter(&self, key: &[u8], seq: u64) -> Option<&Waiter> {
        self.by_key
            .get(key)?
            .iter()
            .find(|waiter| waiter.seq == seq)
    }

    /// Whether the head of `key`'s queue is abandoned or its wait ended by `now_us`.
    pub fn head_is_over(&self, key: &[u8], now_us: u64) -> bool {
        let head = self.by_key.get(key).and_then(VecDeque::front);
        head.is_some_and(|head| head.abandoned || head.deadline_us <= now_us)
    }

    /// Removes and returns the head of `key`'s queue; its place goes back to `places`.
    pub fn pop_head(&mut self, key: &[u8], places: &mut Places) -> Option<Waiter> {
        let queue = self.by_key.get_mut(key)?;
        let mut head = queue.pop_front()?;
        if queue.is_empty() {
            self.by_key.remove(key);
        }
        self.left(key, &mut head, places);
        Some(head)
    }

    /// Removes and returns the head of `key`'s queue, whose grant was applied: the grant took it
    /// out of the replicated queue too, so no `Withdraw` is recorded.
    pub fn pop_granted_head(&mut self, key: &[u8], places: &mut Places) -> Option<Waiter> {
        if let Some(head) = self.by_key.get_mut(key).and_then(VecDeque::front_mut) {
            head.mirrored = false;
        }
        self.pop_head(key, places)
    }

    /// Marks the head of `key`'s queue proposed at `now_us`: by an `Acquire`, or (`handoff`)
    /// as the `then` of a release or expiry. The head must not be proposed already. It gives
    /// its place back to `places` now: on a single node it would hold the key already (granted
    /// in the step that freed it), so it no longer counts as queued (docs/protocol.md §3).
    pub fn propose_head(&mut self, key: &[u8], handoff: bool, now_us: u64, places: &mut Places) {
        let head = self.by_key.get_mut(key).and_then(VecDeque::front_mut);
        let head = head.expect("a head to propose");
        assert!(!head.proposed, "a head proposed twice");
        head.proposed = true;
        head.handoff = handoff;
        head.proposed_us = now_us;
        head.give_place_back(places);
        self.proposed += usize::from(!handoff);
    }

    /// Marks the head of `key`'s queue waiting again (its entry did not grant it the key);
    /// false when the queue has no proposed head. A head that had to queue (`ends_pending`)
    /// takes a place of its session's again if one is free; if none is (the session queued
    /// more meanwhile), it waits uncounted: at most one such waiter per key, the head, and
    /// answering it `B` would refuse an acquire the single node would have granted.
    pub fn unpropose_head(&mut self, key: &[u8], places: &mut Places) -> bool {
        let Some(head) = self.by_key.get_mut(key).and_then(VecDeque::front_mut) else {
            return false;
        };
        if !head.proposed {
            return false;
        }
        self.proposed -= usize::from(!head.handoff);
        head.proposed = false;
        head.handoff = false;
        head.proposed_us = 0;
        // An adopted waiter no session took holds no session's place.
        let adopted = head.origin != 0;
        if head.ends_pending && !head.abandoned && !adopted && places.try_take(head.session) {
            head.counted = true;
        }
        true
    }

    /// Abandons the waiter `seq` of `key`'s queue if it is proposed (its entry decides it, and
    /// a grant for it is released unanswered); true if it was proposed and not abandoned yet.
    pub fn abandon_proposed(&mut self, key: &[u8], seq: u64, places: &mut Places) -> bool {
        let queue = self.by_key.get_mut(key);
        let waiter = queue.and_then(|queue| queue.iter_mut().find(|w| w.seq == seq));
        match waiter {
            Some(waiter) if waiter.proposed && !waiter.abandoned => {
                waiter.abandon(places, true);
                true
            }
            _ => false,
        }
    }

    /// Moves the waiter of `key`'s queue with `owner` sent by `client` (identified, client id
    /// `id`, 0 if unknown here) to `session` (a Resolve attaches it there, docs/protocol.md
    /// §5), its place with it; `None` if there is none. A proposed head abandoned when its
    /// session closed is taken back: its grant, should it commit, is answered on `session`.
    /// An adopted waiter of that client id is attached too: then its `seq` and its new wait
    /// deadline come back, for the caller to arm (this member's deadline for its wait).
    pub fn attach(
        &mut self,
        key: &[u8],
        owner: u64,
        (client, id): (ClientRef, u128),
        (session, places): (SessionId, &mut Places),
    ) -> Option<Option<(u64, u64)>> {
        if !client.is_some() {
            return None;
        }
        let queue = self.by_key.get_mut(key)?;
        let adopted = |w: &Waiter| id != 0 && w.origin == id;
        let waiter = queue
            .iter_mut()
            .find(|w| w.owner == owner && (w.client == client || adopted(w)))?;
        // Only a session's close abandons a waiter and leaves its client (see `abandon`).
        waiter.abandoned = false;
        waiter.client = client;
        let rearm = (waiter.origin != 0).then(|| {
            waiter.origin = 0;
            waiter.deadline_us = waiter.wait_end_us;
            (waiter.seq, waiter.deadline_us)
        });
        let from = std::mem::replace(&mut waiter.session, session);
        let counted = waiter.counted;
        self.moved(key, (from, session), counted, places);
        Some(rearm)
    }

    /// [`Queues::attach`] for an acquire sent again (after an `M`) by the client its adopted
    /// waiter came from: only an adopted waiter is taken (any other acquire with the same
    /// owner queues as a new one, as on a single node).
    pub fn attach_adopted(
        &mut self,
        key: &[u8],
        owner: u64,
        (client, id): (ClientRef, u128),
        to: (SessionId, &mut Places),
    ) -> Option<(u64, u64)> {
        let queue = self.by_key.get(key)?;
        let found = queue
            .iter()
            .any(|w| w.owner == owner && id != 0 && w.origin == id);
        if !found {
            return None;
        }
        self.attach(key, owner, (client, id), to).flatten()
    }

    /// Whether `key`'s queue has a waiter of `owner`.
    pub fn has_owner(&self, key: &[u8], owner: u64) -> bool {
        let queue = self.by_key.get(key);
        queue.is_some_and(|queue| queue.iter().any(|w| w.owner == owner))
    }

    /// Marks the waiter `seq` of `key`'s queue mirrored (its `Enqueue` was just proposed).
    pub fn set_mirrored(&mut self, key: &[u8], seq: u64) {
        let queue = self.by_key.get_mut(key);
        if let Some(waiter) = queue.and_then(|queue| queue.iter_mut().find(|w| w.seq == seq)) {
            waiter.mirrored = true;
        }
    }

    /// Each mirrored waiter that left other than by a grant since the last call: their
    /// `Withdraw`s are due.
    pub fn take_withdrawn(&mut self) -> Vec<Withdrawn> {
        std::mem::take(&mut self.withdrawn)
    }

    /// `session`, of an identified client, closed: its waiters stay in their places under
    /// `detached` (its client's [`ClientRef::detached`] id), for a Resolve to attach them, or
    /// the client's grace to end ([`Queues::close_session`] of `detached` then). Visits only
    /// the keys the session queued on.
    pub fn detach_session(&mut self, session: SessionId, detached: SessionId, places: &mut Places) {
        let Some(keys) = self.by_session.get(&session) else {
            return;
        };
        let keys: Vec<Vec<u8>> = keys.keys().cloned().collect();
        for key in keys {
            let queue = self
                .by_key
                .get_mut(&key)
                .expect("an indexed key has a queue");
            let mut moved = Vec::new();
            for waiter in queue.iter_mut().filter(|w| w.session == session) {
                waiter.session = detached;
                moved.push(waiter.counted);
            }
            for counted in moved {
                self.moved(&key, (session, detached), counted, places);
            }
        }
    }

    /// One waiter of `key` went from session `from` to session `to`: the session index, and
    /// its place if it holds one (taken whatever `to` holds: it keeps the place it had).
    fn moved(
        &mut self,
        key: &[u8],
        (from, to): (SessionId, SessionId),
        counted: bool,
        places: &mut Places,
    ) {
        if counted {
            places.give_back(from);
            places.take_forced(to);
        }
        let keys = self
            .by_session
            .get_mut(&from)
            .expect("a waiter's session is indexed");
        let count = keys.get_mut(key).expect("a waiter's key is indexed");
        *count -= 1;
        if *count == 0 {
            keys.remove(key);
            if keys.is_empty() {
                self.by_session.remove(&from);
            }
        }
        *self
            .by_session
            .entry(to)
            .or_default()
            .entry(key.to_vec())
            .or_default() += 1;
    }

    /// Removes the waiters `remove` picks from `key`'s queue, returning them, their places
    /// back in `places` (a proposed head is never removed: `remove` is asked only about the
    /// others).
    pub fn remove_where(
        &mut self,
        key: &[u8],
        places: &mut Places,
        mut remove: impl FnMut(&Waiter) -> bool,
    ) -> Vec<Waiter> {
        let Some(queue) = self.by_key.get_mut(key) else {
            return Vec::new();
        };
        let mut removed = Vec::new();
        queue.retain(|waiter| {
            if !waiter.proposed && remove(waiter) {
                removed.push(waiter.clone());
                false
            } else {
                true
            }
        });
        if queue.is_empty() {
            self.by_key.remove(key);
        }
        for waiter in &mut removed {
            self.left(key, waiter, places);
        }
        removed
    }

    /// `session` closed: its waiters leave silently, but a proposed one, which its entry
    /// decides, is abandoned (a grant that still commits for it is released). Visits only the
    /// keys the session queued on.
    pub fn close_session(&mut self, session: SessionId, places: &mut Places) {
        let Some(keys) = self.by_session.get(&session) else {
            return;
        };
        let keys: Vec<Vec<u8>> = keys.keys().cloned().collect();
        for key in keys {
            if let Some(head) = self.by_key.get_mut(&key).and_then(VecDeque::front_mut) {
                if head.session == session && head.proposed {
                    head.abandon(places, false);
                }
            }
            self.remove_where(&key, places, |waiter| waiter.session == session);
        }
    }

    /// Takes every waiter that is not proposed out of every queue (the member stops leading,
    /// or shuts down), their places back in `places`; proposed heads stay, to be decided by the
    /// entry in the log.
    pub fn take_unproposed(&mut self, places: &mut Places) -> Vec<Waiter> {
        let keys: Vec<Vec<u8>> = self.by_key.keys().cloned().collect();
        let mut taken = Vec::new();
        for key in keys {
            taken.extend(self.remove_where(&key, places, |_| true));
        }
        taken
    }

    /// Abandons every proposed head not abandoned yet (the server shuts down: they are answered
    /// `B` once their entries decide, and a grant that still commits for one is released),
    /// returning them with their keys.
    pub fn abandon_proposed_heads(&mut self, places: &mut Places) -> Vec<(Vec<u8>, Head)> {
        let heads = (self.by_key.iter_mut()).filter_map(|(key, q)| Some((key, q.front_mut()?)));
        let mut abandoned = Vec::new();
        for (key, head) in heads.filter(|(_, head)| head.proposed && !head.abandoned) {
            head.abandon(places, true);
            abandoned.push((key.clone(), head.as_head()));
        }
        abandoned
    }

    /// Waiters that hold a place, of `session` or (`None`) of any session.
    pub fn counted(&self, session: Option<SessionId>) -> usize {
        let waiters = self.by_key.values().flatten();
        waiters
            .filter(|w| w.counted && session.map_or(true, |session| w.session == session))
            .count()
    }

    /// A waiter left `key`'s queue: the counts, the session index and its place.
    fn left(&mut self, key: &[u8], waiter: &mut Waiter, places: &mut Places) {
        self.waiters -= 1;
        if std::mem::replace(&mut waiter.mirrored, false) {
            self.withdrawn.push(Withdrawn {
                key: key.to_vec(),
                owner: waiter.owner,
                session: waiter.session,
            });
        }
        self.proposed -= usize::from(waiter.proposed && !waiter.handoff);
        waiter.give_place_back(places);
        let keys = self.by_session.get_mut(&waiter.session);
        let keys = keys.expect("a waiter's session is indexed");
        let count = keys.get_mut(key).expect("a waiter's key is indexed");
        *count -= 1;
        if *count == 0 {
            keys.remove(key);
            if keys.is_empty() {
                self.by_session.remove(&waiter.session);
            }
        }
    }

    /// Checks the invariants of the module docs (debug builds; O(waiters)).
    pub fn check_invariants(&self) {
        if !cfg!(debug_assertions) {
            return;
        }
        let counted: usize = self.by_key.values().map(VecDeque::len).sum();
        assert_eq!(counted, self.waiters, "waiter count");
        let heads = self.by_key.values().filter_map(VecDeque::front);
        let proposed = heads.filter(|head| head.proposed && !head.handoff).count();
        assert_eq!(proposed, self.proposed, "heads proposed by an Acquire");
        let mut indexed: HashMap<(SessionId, &[u8]), u32> = HashMap::default();
        for (key, queue) in &self.by_key {
            assert!(!queue.is_empty(), "an empty queue is kept");
            for (position, waiter) in queue.iter().enumerate() {
                assert!(
                    position == 0 || !waiter.proposed,
                    "only a head may be proposed"
                );
                assert!(
                    waiter.proposed || !waiter.handoff,
                    "a handoff that is not proposed"
                );
                let both = waiter.counted && waiter.abandoned;
                assert!(!both, "an abandoned waiter holds a place");
                let adopted = waiter.origin != 0;
                assert!(!adopted || waiter.mirrored, "an adopted waiter is mirrored");
                assert!(
                    !adopted || !waiter.counted,
                    "an adopted waiter holds a place"
                );
                *indexed.entry((waiter.session, key.as_slice())).or_default() += 1;
            }
        }
        let listed: usize = self.by_session.values().map(HashMap::len).sum();
        assert_eq!(listed, indexed.len(), "the session index lists other keys");
        for (session, keys) in &self.by_session {
            assert!(!keys.is_empty(), "an empty session entry is kept");
            for (key, count) in keys {
                let queued = indexed.get(&(*session, key.as_slice())).copied();
                assert_eq!(
                    queued,
                    Some(*count),
                    "session {session:#x}'s waiters on a key"
                );
            }
        }
    }
}
