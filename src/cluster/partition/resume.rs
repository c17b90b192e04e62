//! Resumable calls on a cluster member (docs/protocol.md §5): a Resolve is
//! answered by the member that leads the key now, from what it knows.
//!
//! * **Granted**: the key's hold, in the replicated state, is the owner's (every member that
//!   applied its grant knows it, so a new leader answers for an acquire its predecessor took),
//!   unless this leader proposed its release because nobody was told of it (the client would
//!   hold a lock being released). Holds carry the owner, not the client id: an owner is a
//!   random 64-bit id, and a client asks only about its own.
//! * **Queued**: one of this leader's waiters is the owner's, of the same client (its waiter
//!   remembers it, or, adopted, its client id): it is attached to the session that asks, in its
//!   place — a waiter whose session closed is kept for that (below), and so is a queue head
//!   whose grant is in the log.
//! * **Timed out, busy**: this leader answered it so (kept 60 s, bounded per client); or a
//!   `Withdraw` in the replicated state says a leader did (mirror.rs: a waiter that was
//!   mirrored, answered by this member's predecessor; the last `ENDED_MAX` per shard).
//! * **Never seen**: anything else — recorded, so that the acquire, should its bytes still
//!   reach this member, is refused `B` (busy reason `resolved`). A Resolve is answered only by
//!   a member that serves the key (its barrier applied: every entry committed before its term is
//!   applied), so an acquire another member proposed either shows in the state now, or can
//!   never commit; and one not proposed was queued on another member and is not in effect.
//! * **Not yet**: the replicated queue still has the owner's acquire (its `Enqueue` applied)
//!   but this leader's queue does not: it left (its wait ran out, say) and its `Withdraw`, or
//!   its grant, is in flight. Until that entry applies, no answer is true for every leader to
//!   come (one that lacks the entry adopts the waiter again, and may grant it), so the Resolve
//!   waits for it (at most [`DEFERRED_MAX`] per core; `M` if this member stops leading first).
//!   So does a Resolve of an acquire whose `T` or `B` this member holds (mirror.rs,
//!   `HeldAnswer`: the state may still queue or grant it), even once its session closed.
//!
//! As on a single node, a session of an identified client that closes leaves its waiters in
//! their places, *detached* (under [`ClientRef::detached`]: nothing is answered to it, a `T` or
//! `B` is remembered), and a grant that reaches no session of it (its head was detached, or its
//! `A` could not be written) is kept; when the client's grace ends with no session (the
//! server's registry says so), its detached waiters leave and its undelivered grants are
//! released. A waiter's place survives a change of leader when the old leader mirrored it in
//! the replicated state (`mirror.rs`): the new leader adopted it, and a Resolve of its client
//! attaches it (*queued*); a grant the new leader made to it is *granted* from the hold; its
//! `T` or `B`, *timed out* or *busy* from the replicated record. The `T` and `B` of an acquire
//! that was never mirrored (it never had to queue, or was answered within its first 10 ms)
//! are this leader's own: a new leader says "never seen" for them — as true for the caller,
//! since nothing of such an acquire stands.

use super::requests::End;
use super::{ClusterPartition, Peers, PendingKind};
use crate::cluster::machine::{Answered, Command};
use crate::cluster::shard::ADOPTED;
use crate::cluster::writer::LogWriter;
use crate::partition::{is_detached, ClientRef, Fate, SessionId, DETACHED, NOBODY};
use latchkey_client::protocol::{ErrorCode, Response};

/// The most Resolves one core keeps waiting for an entry in flight (past it: `X` 10).
const DEFERRED_MAX: usize = 4_096;

/// What a Resolve gets now: its answer, a wait for the entries in flight ([`PendingResolve`]),
/// or the renewal of the hold it found (answered once applied).
pub(super) enum Decided {
    Now(Response),
    Later,
    Proposed,
}

/// A Resolve whose acquire is in the replicated queue but left this leader's: answered once
/// the entries this leader proposed up to `after` applied (see [`ClusterPartition::resolved`]).
#[derive(Clone, Debug)]
pub(super) struct PendingResolve {
    shard: u32,
    session: SessionId,
    client: ClientRef,
    key: Vec<u8>,
    owner: u64,
    after: u64,
}

impl PendingResolve {
    /// A Resolve waiting for nothing yet ([`ClusterPartition::settle`] sets what it waits for).
    fn new(shard: u32, (session, client): (SessionId, ClientRef), key: &[u8], owner: u64) -> Self {
        PendingResolve {
            shard,
            session,
            client,
            key: key.to_vec(),
            owner,
            after: 0,
        }
    }
}

impl<D: LogWriter, P: Peers> ClusterPartition<D, P> {
    /// Resolve from `session` (of `client`) on a shard this member serves: see the module docs.
    pub(super) fn resolve(
        &mut self,
        shard: u32,
        (session, client): (SessionId, ClientRef),
        key: &[u8],
        owner: u64,
    ) {
        if !client.is_some() {
            let code = ErrorCode::NotIdentified;
            return self.answer(session, Response::Error { code, id: owner }, false);
        }
        match self.resolved(shard, (session, client), key, owner) {
            Decided::Now(response) => self.answer_resolve(session, response),
            Decided::Proposed => {}
            Decided::Later if self.resolves.len() >= DEFERRED_MAX => {
                let response = Response::Error {
                    code: ErrorCode::Limit,
                    id: owner,
                };
                self.answer_resolve(session, response);
            }
            Decided::Later => {
                let mut resolve = PendingResolve::new(shard, (session, client), key, owner);
                self.settle(&mut resolve);
                self.resolves.push(resolve);
            }
        }
    }

    fn answer_resolve(&mut self, session: SessionId, response: Response) {
        if let Response::Resolved { fate, .. } = response {
            self.stats.resolves[fate as usize] += 1;
        }
        self.answers.push(crate::partition::Answer {
            session,
            response,
            ends_pending: false,
            grant: crate::partition::GrantRef::NONE,
        });
    }

    /// A deferred Resolve waits for the last entry proposed on its shard: the `Withdraw` (or
    /// grant) of its acquire is among them. With none in flight (the `Withdraw` could not be
    /// proposed when the waiter left), this leader proposes one now.
    fn settle(&mut self, resolve: &mut PendingResolve) {
        let local = self.local(resolve.shard);
        let shard = &self.shards[local];
        if shard.last_proposed() <= shard.machine().applied() {
            let (key, owner) = (resolve.key.clone(), resolve.owner);
            self.propose_withdraw(resolve.shard, key, owner, Answered::TimedOut);
        }
        resolve.after = self.shards[local].last_proposed();
    }

    /// Answers the deferred Resolves whose entries in flight applied: each is decided again
    /// (deferred again if its acquire is still in the replicated queue).
    pub(super) fn serve_resolves(&mut self) {
        if self.resolves.is_empty() {
            return;
        }
        let mut waiting = std::mem::take(&mut self.resolves);
        waiting.retain_mut(|resolve| {
            let applied = self.machine(resolve.shard).map_or(0, |m| m.applied());
            if applied < resolve.after {
                return true;
            }
            let asker = (resolve.session, resolve.client);
            match self.resolved(resolve.shard, asker, &resolve.key, resolve.owner) {
                Decided::Now(response) => {
                    self.answer_resolve(resolve.session, response);
                    false
                }
                Decided::Proposed => false,
                Decided::Later => {
                    self.settle(resolve);
                    true
                }
            }
        });
        waiting.append(&mut self.resolves);
        self.resolves = waiting;
    }

    /// This member stopped leading `shard`: its deferred Resolves get `M` (the client asks the
    /// new leader, which knows what became of the entries in flight).
    pub(super) fn demote_resolves(&mut self, shard: u32) {
        let mut moved = Vec::new();
        self.resolves.retain(|resolve| {
            let keep = resolve.shard != shard;
            if !keep {
                moved.push((resolve.session, resolve.owner));
            }
            keep
        });
        for (session, owner) in moved {
            let response = self.moved(shard, owner);
            self.answer(session, response, false);
        }
    }

    /// The fate of `owner`'s acquire, or `None` while the replicated queue still has it and
    /// this leader's queue does not: its way out (`Withdraw` or grant) is in flight, and until
    /// it applies, "never seen" would be false (a later leader, which lacks the entry in
    /// flight, adopts the waiter and may grant it).
    fn resolved(
        &mut self,
        shard: u32,
        (session, client): (SessionId, ClientRef),
        key: &[u8],
        owner: u64,
    ) -> Decided {
        let resolved = |fate, token, lease_ms| {
            Decided::Now(Response::Resolved {
                owner,
                fate,
                token,
                lease_ms,
            })
        };
        let local = self.local(shard);
        let now_ms = self.now_ms();
        let hold = self.shards[local].machine().holder(key);
        let hold = hold.filter(|hold| hold.owner == owner);
        if let Some(hold) = hold.filter(|hold| !self.releasing_undelivered(hold.token)) {
            let left_ms = hold
                .deadline_ms
                .saturating_sub(now_ms)
                .min(hold.lease_ms.into());
            let token = hold.token;
            let lease_ms = u32::try_from(left_ms).unwrap_or(u32::MAX);
            self.clients.delivered(client, token);
            self.adopted_grant_delivered(token);
            if lease_ms == 0 {
                // Ran out here: the client releases it at once (docs/protocol.md §5).
                self.shards[local].record_grant(token, session, self.now_us);
                return resolved(Fate::Granted, token, 0);
            }
            // This member's deadline bounds no other member's: it counts from its own apply,
            // late on a member that lagged, and holds a promotion's grace. The lease reported
            // is renewed first, so that every member counts it from its apply of the renewal,
            // after the Resolve was sent.
            let command = Command::Extend {
                key: key.to_vec(),
                token,
                lease_ms,
            };
            let kind = PendingKind::Resolve {
                client,
                owner,
                lease_ms,
            };
            if !self.propose(shard, &command, session, kind) {
                return Decided::Now(self.moved(shard, owner));
            }
            return Decided::Proposed;
        }
        let id = self.client_id(client);
        let to = (session, &mut self.places);
        if let Some(adopted) = self.shards[local].attach(key, owner, (client, id), to) {
            self.session_clients.entry(session).or_insert(client);
            if let Some((seq, deadline_us)) = adopted {
                self.arm_wait(shard, key, seq, deadline_us);
            }
            return resolved(Fate::Queued, 0, 0);
        }
        if id != 0 && self.shards[local].machine().queues(key, id, owner) {
            return Decided::Later;
        }
        if id != 0 && self.held_for(shard, id, owner) {
            return Decided::Later; // answered `T` or `B`, held until the log decides (mirror.rs)
        }
        if let Some(fate) = self.clients.answer_of(client, owner, self.now_us) {
            return resolved(fate, 0, 0);
        }
        let ended = (id != 0).then(|| self.shards[local].machine().ended(id, owner));
        match ended.flatten() {
            Some(Answered::TimedOut) => return resolved(Fate::TimedOut, 0, 0),
            Some(Answered::Busy) => return resolved(Fate::Busy, 0, 0),
            None => {}
        }
        match self.clients.forget(client, owner, self.now_us) {
            Ok(()) => resolved(Fate::NeverSeen, 0, 0),
            Err(_) => Decided::Now(Response::Error {
                code: ErrorCode::Limit,
                id: owner,
            }),
        }
    }

    /// The `Extend` a Resolve proposed for the hold it found (see [`Self::resolved`]) applied:
    /// *granted*, with the lease it `renewed`; if the hold is gone (released or expired first),
    /// the Resolve is decided again.
    pub(super) fn resolve_renewed(
        &mut self,
        (shard, key, owner): (u32, &[u8], u64),
        (session, client): (SessionId, ClientRef),
        (token, lease_ms): (u64, u32),
        renewed: bool,
    ) {
        if !renewed {
            let resolve = PendingResolve::new(shard, (session, client), key, owner);
            return self.resolves.push(resolve); // decided again in this drain
        }
        let local = self.local(shard);
        self.shards[local].record_grant(token, session, self.now_us);
        let response = Response::Resolved {
            owner,
            fate: Fate::Granted,
            token,
            lease_ms,
        };
        self.answer_resolve(session, response);
    }

    /// The grant of `token` on `shard` reached no session of `client`, detached: kept for a
    /// Resolve until the client's grace ends.
    pub(super) fn keep_undelivered(&mut self, client: ClientRef, shard: u32, token: u64) {
        self.clients.undelivered(client, shard, token);
    }

    /// `client`'s grace ended without a session: its detached waiters leave (a proposed one is
    /// abandoned: a grant that still commits for it is released), its grants that never
    /// reached it are released, and its records go.
    pub(super) fn client_gone(&mut self, client: ClientRef) {
        let detached = client.detached();
        for shard in &mut self.shards {
            shard.close_session(detached, &mut self.places);
        }
        for (shard, token) in self.clients.remove(client) {
            if self
                .shard(shard)
                .is_some_and(|s| s.machine().key_of(token).is_some())
            {
                self.stats.grace_releases += 1;
                self.release_undelivered(shard, token);
            }
        }
    }

    /// Releases the grant of `token` on `shard`, which nobody received (no answer), if it
    /// still holds its key and this member leads the shard (else its lease frees the key).
    pub(super) fn release_undelivered(&mut self, shard: u32, token: u64) {
        let Some(key) = self
            .shard(shard)
            .and_then(|s| s.machine().key_of(token))
            .map(<[u8]>::to_vec)
        else {
            return;
        };
        let kind = PendingKind::Orphan { token };
        if !self.propose_end(shard, &key, token, End::Release, NOBODY, kind) {
            log::warn!(
                "shard {shard}: cannot release undelivered token {token} (not the leader); \
                 its lease will free the key"
            );
        }
    }

    /// Whether this leader proposed the release of `token`, a grant nobody was told of (its
    /// session closed, or its waiter was answered): it will not stand, so it is not "granted".
    /// Looked for among the proposals in flight: a Resolve is rare, and comes after a failure.
    /// (A release that a crashed leader proposed is in this leader's state already, applied
    /// before it serves, or can never commit: then the hold stands, and is granted.)
    fn releasing_undelivered(&self, token: u64) -> bool {
        let mut kinds = self.pending.values().map(|pending| &pending.kind);
        kinds.any(|kind| matches!(kind, PendingKind::Orphan { token: t } if *t == token))
    }

    /// Whether a Resolve answered `session`'s client's `owner` "never seen" (its acquire is
    /// refused).
    pub(super) fn forgotten(&self, session: SessionId, owner: u64) -> bool {
        let client = self.session_clients.get(&session);
        client.is_some_and(|&client| self.clients.is_forgotten(client, owner))
    }

    /// Keeps a `T` or `B` answer to an identified client's acquire for its Resolves (one of a
    /// detached waiter's too).
    pub(super) fn remember_answer(&mut self, session: SessionId, response: &Response) {
        let Some(client) = self.client_of(session) else {
            return;
        };
        let fate = match response {
            Response::Timeout { .. } => Fate::TimedOut,
            _ => Fate::Busy,
        };
        let owner = response.correlation_id();
        if self.clients.answered(client, owner, fate, self.now_us) {
            self.stats.fates_dropped += 1;
        }
    }

    /// Whether this member answered `owner`'s acquire `B` on `session` (kept as a Resolve
    /// would find it).
    pub(super) fn answered_busy(&self, session: SessionId, owner: u64) -> bool {
        let client = self.client_of(session);
        let fate = client.and_then(|client| self.clients.answer_of(client, owner, self.now_us));
        fate == Some(Fate::Busy)
    }

    /// The identified client of `session` (a detached one's too), whose answers are kept for
    /// its Resolves; `None` for a session that did not identify, and for adopted waiters nobody
    /// took (their client asks about them by their place).
    pub(super) fn client_of(&self, session: SessionId) -> Option<ClientRef> {
        if session == ADOPTED {
            return None;
        }
        match is_detached(session) {
            true => Some(ClientRef((session - DETACHED) as u32)),
            false => self.session_clients.get(&session).copied(),
        }
    }
}

#[cfg(test)]
#[path = "resume_tests.rs"]
mod tests;
