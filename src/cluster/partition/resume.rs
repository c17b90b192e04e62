//! Resumable calls on a cluster member (docs/protocol.md §5), leader-local: a Resolve is
//! answered by the member that leads the key now, from what it knows.
//!
//! * **Granted**: the key's hold, in the replicated state, is the owner's (every member that
//!   applied its grant knows it, so a new leader answers for an acquire its predecessor took).
//!   Holds carry the owner, not the client id: an owner is a random 64-bit id, and a client
//!   asks only about its own.
//! * **Queued**: one of this leader's waiters is the owner's, queued by a session of the same
//!   client: it is attached to the session that asks — also a queue head whose grant is in the
//!   log while the session that sent it closed (else that grant, committed, would be released
//!   unanswered: an acquire executed after "never seen").
//! * **Timed out, busy**: this leader answered it so (kept 60 s, bounded per client).
//! * **Never seen**: anything else — recorded, so that the acquire, should its bytes still
//!   reach this member, is refused `B` (busy reason `resolved`). A Resolve is answered only by
//!   a member that serves the key (its barrier applied: every entry committed before its term is
//!   applied), so an acquire another member proposed either shows in the state now, or can
//!   never commit; and one not proposed was queued on another member and is not in effect.
//!
//! What a member of this version does not do (the single node does): a waiter's place is not
//! kept when its session ends or its leader changes — the new leader never knew it (waiters are
//! leader-local), so its client is told "never seen" and queues a new acquire, at the back —
//! and grants that never reached their session are not kept for the client's grace.

use super::{ClusterPartition, PendingKind, Peers};
use crate::cluster::writer::LogWriter;
use crate::partition::{ClientRef, Fate, SessionId};
use latchkey_client::protocol::{ErrorCode, Response};

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
        let response = self.resolved(shard, (session, client), key, owner);
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

    fn resolved(
        &mut self,
        shard: u32,
        (session, client): (SessionId, ClientRef),
        key: &[u8],
        owner: u64,
    ) -> Response {
        let resolved = |fate, token, lease_ms| Response::Resolved {
            owner,
            fate,
            token,
            lease_ms,
        };
        let local = self.local(shard);
        let now_ms = self.now_ms();
        let hold = self.shards[local].machine().holder(key);
        let hold = hold.filter(|hold| hold.owner == owner);
        if let Some(hold) = hold.filter(|hold| !self.releasing_undelivered(hold.token)) {
            let left_ms = hold.deadline_ms.saturating_sub(now_ms).min(hold.lease_ms.into());
            let token = hold.token;
            let lease_ms = u32::try_from(left_ms).unwrap_or(u32::MAX);
            self.shards[local].record_grant(token, session, self.now_us);
            return resolved(Fate::Granted, token, lease_ms);
        }
        let to = (session, &mut self.places);
        if self.shards[local].attach(key, owner, client, to) {
            self.session_clients.entry(session).or_insert(client);
            return resolved(Fate::Queued, 0, 0);
        }
        if let Some(fate) = self.clients.answer_of(client, owner, self.now_us) {
            return resolved(fate, 0, 0);
        }
        match self.clients.forget(client, owner, self.now_us) {
            Ok(()) => resolved(Fate::NeverSeen, 0, 0),
            Err(_) => Response::Error {
                code: ErrorCode::Limit,
                id: owner,
            },
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

    /// Keeps a `T` or `B` answer to an identified client's acquire for its Resolves.
    pub(super) fn remember_answer(&mut self, session: SessionId, response: &Response) {
        let Some(&client) = self.session_clients.get(&session) else {
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
}

#[cfg(test)]
#[path = "resume_tests.rs"]
mod tests;
