//! Replicated waiters: a leader mirrors its queues in the replicated state, and a new leader
//! adopts them (docs/cluster-design.md, "Waiters"; docs/protocol.md §5).
//!
//! * **Mirror.** A waiter of an identified client that had to queue (its key held or queued,
//!   its wait above 0) and still waits [`MIRROR_AFTER_US`] later is proposed as an `Enqueue`
//!   then: it adds no wait to any caller (a waiter is answered by a later grant, never by its
//!   `Enqueue`), and a waiter granted within that time — most of them, where a key changes
//!   hands often — costs no entry (measured: mirroring every waiter at once cost 19 % of the
//!   handoffs per second of one key among 8 clients; `benches/handoff_ab.sh`). A waiter that
//!   queued within that time before its leader died is not kept in its place. A grant
//!   (`Acquire` or `then`) takes it out of the replicated queue; any other way out of the
//!   leader's queue (`T`, Cancel, `B`, its client's grace) proposes a `Withdraw`
//!   ([`ClusterPartition::propose_withdrawals`]). Every
//!   entry that grants a waiter comes after its `Enqueue` in the log, so a grant never names a
//!   waiter the replicated queue lacks. Only once every member reads the two commands (the
//!   cluster version, `Peers::cluster_version`): a member of the previous build stops on an
//!   entry it cannot decode.
//! * **Fates.** From cluster version [`ANSWERED_PEER_VERSION`], a `Withdraw` says how the
//!   leader answered the waiter (`B` if it did, else `T`: its wait ran out, it was cancelled,
//!   or its client's grace ended), and every member remembers it under the client id and owner
//!   (`ShardMachine::ended`): a later leader answers the client's Resolve *timed out* or *busy*
//!   as this one would have (resume.rs).
//! * **Held answers.** A `T` or `B` is a promise that the acquire will never hold the key.
//!   So it is given only once the applied state neither queues that acquire (its `Withdraw`
//!   applied, whoever proposed it) nor holds the key for its owner (an in-flight grant
//!   decided, a grant's release applied): until then a later leader could adopt the waiter
//!   and grant it ([`HeldAnswer`]). This covers a waiter whose `Withdraw` is lost with its
//!   leader, a proposed head whose wait ends, a grant that came too late, and an adopted
//!   acquire sent again after its wait. Costs one commit of delay, on these paths only.
//! * **Adopt.** A member that begins to serve a shard (its barrier applied: it has applied
//!   every committed entry) queues the replicated waiters again, each in its place, detached
//!   (nobody reads their answers) and *adopted* ([`crate::cluster::shard::Waiter::origin`]):
//!   each wait ends at this member's deadline for it, the apply time of its `Enqueue` plus its
//!   wait (never before the client's own deadline, as a lease's), and one already over is
//!   withdrawn at once. Unattached, an adopted waiter leaves at the end of its client's grace
//!   if that comes first. A Resolve of its client attaches it to
//!   the session that asks (`queued`), and so does the same acquire sent again after an `M`
//!   (its old leader stepped down: the client asks the new one). A grant to an adopted waiter
//!   no session took yet is kept until its wait or grace would have ended, for a Resolve to
//!   find (`granted`), then released: no ghost hold outlives the client's grace.
//!
//! What is not mirrored stays leader-local as before: a waiter of a session that did not
//! identify (nobody could ask about it), one that found its key free (its `Acquire` is the
//! fact), and any while some member runs the previous build.

use super::{ClusterPartition, Peers, PendingKind, ANSWERED_PEER_VERSION, WAITERS_PEER_VERSION};
use crate::cluster::machine::{Answered, Command, Queued};
use crate::cluster::shard::{Waiter, Withdrawn, ADOPTED};
use crate::cluster::writer::LogWriter;
use crate::partition::{is_detached, Answer, ClientRef, GrantRef, SessionId, NOBODY};
use latchkey_client::protocol::Response;
use std::collections::HashMap;

/// How long a waiter waits before it is mirrored: one of the leader's ticks.
pub(super) const MIRROR_AFTER_US: u64 = 10_000;

/// How long an adopted acquire that ended unattached is remembered (the longest grace: a
/// client sends it again, after an `M`, within its own wait, which ended before).
const ADOPTED_ENDED_US: u64 = 60_000_000;
/// The most such acquires remembered (beyond, the oldest are dropped first once expired).
const ADOPTED_ENDED_MAX: usize = 65_536;

/// A grant to an adopted waiter that no session took yet.
#[derive(Clone, Copy, Debug)]
pub(super) struct AdoptedGrant {
    shard: u32,
    id: u128,
    owner: u64,
    /// When it is released if no Resolve took it.
    until_us: u64,
}

impl AdoptedGrant {
    /// When it is released if no Resolve took it.
    pub(super) fn until_us(&self) -> u64 {
        self.until_us
    }
}

/// The most `T` and `B` answers held at once (beyond, one is given at once, as when a
/// waiter is not mirrored).
const HELD_MAX: usize = 4_096;

/// The `T` or `B` of a mirrored waiter that left its leader's queue, held until the replicated
/// queue no longer has it and its owner holds no grant of the key: until then a later leader
/// would adopt it and could grant it, so the answer would be a promise this member cannot
/// keep. Decided by the applied state, not by this member's `Withdraw` alone, so it holds
/// across a lost proposal or a change of leader (the next leader adopts the waiter, and
/// withdraws or grants it in turn). Until then a Resolve of its client waits too (resume.rs).
#[derive(Clone, Debug)]
pub(super) struct HeldAnswer {
    shard: u32,
    key: Vec<u8>,
    /// The waiter's client id (its replicated record's).
    client: u128,
    answer: Answer,
    /// Its session closed: decided all the same (a Resolve of its client waits for it), but
    /// sent to nobody.
    gone: bool,
    /// The last entry proposed on the shard when it was held (its `Enqueue` and `Withdraw`
    /// among them): decided only once the state has applied that index.
    after: u64,
}

impl HeldAnswer {
    /// `session` closed: the answer is no longer sent.
    pub(super) fn session_closed(&mut self, session: SessionId) {
        self.gone |= self.answer.session == session;
    }
}

/// A waiter to mirror if it still waits at `due_us` (what its `Enqueue` says).
#[derive(Clone, Debug)]
pub(super) struct ToMirror {
    shard: u32,
    key: Vec<u8>,
    seq: u64,
    client: ClientRef,
    due_us: u64,
    owner: u64,
    lease_ms: u32,
    wait_s: u8,
}

impl ToMirror {
    /// When it is due.
    pub(super) fn due_us(&self) -> u64 {
        self.due_us
    }
}

impl<D: LogWriter, P: Peers> ClusterPartition<D, P> {
    /// Waiter `seq` of `key`, of `client`, had to queue: its `Enqueue` is proposed if it still
    /// waits [`MIRROR_AFTER_US`] from now, its client identified (see the module docs).
    pub(super) fn mirror_later(
        &mut self,
        shard: u32,
        key: &[u8],
        (seq, client): (u64, ClientRef),
        (owner, lease_ms, wait_s): (u64, u32, u8),
    ) {
        if !self.client_ids.contains_key(&client) {
            return;
        }
        self.to_mirror.push_back(ToMirror {
            shard,
            key: key.to_vec(),
            seq,
            client,
            due_us: self.now_us + MIRROR_AFTER_US,
            owner,
            lease_ms,
            wait_s,
        });
    }

    /// Proposes the `Enqueue` of each waiter due to be mirrored that still waits (queued, not
    /// proposed), in the order they queued, on the shards this member serves.
    pub(super) fn propose_due_mirrors(&mut self) {
        while self
            .to_mirror
            .front()
            .is_some_and(|m| m.due_us <= self.now_us)
        {
            let Some(due) = self.to_mirror.pop_front() else {
                break;
            };
            let local = self.local(due.shard);
            let shard = &self.shards[local];
            let waits = shard.waiter(&due.key, due.seq);
            let waits = waits.is_some_and(|w| !w.proposed && !w.mirrored && !w.abandoned);
            if !waits || !shard.serving() {
                continue;
            }
            let terms = (due.owner, due.lease_ms, due.wait_s);
            if self.propose_enqueue(due.shard, &due.key, due.client, terms) {
                self.shards[local].set_mirrored(&due.key, due.seq);
            }
        }
    }

    /// The client id `client` identified with, 0 if unknown here.
    pub(super) fn client_id(&self, client: ClientRef) -> u128 {
        self.client_ids.get(&client).map_or(0, |&(id, _)| id)
    }

    /// Proposes the `Enqueue` of a waiter of `client` that had to queue on `key`, if the
    /// cluster reads it and the client identified; true if proposed (the waiter is mirrored).
    pub(super) fn propose_enqueue(
        &mut self,
        shard: u32,
        key: &[u8],
        client: ClientRef,
        (owner, lease_ms, wait_s): (u64, u32, u8),
    ) -> bool {
        if self.peers.cluster_version() < WAITERS_PEER_VERSION {
            return false;
        }
        let Some(&(id, grace_s)) = self.client_ids.get(&client) else {
            return false;
        };
        let waiter = Queued {
            owner,
            client: id,
            grace_s,
            lease_ms,
            wait_ms: u32::from(wait_s) * 1000,
        };
        let command = Command::Enqueue {
            key: key.to_vec(),
            waiter,
        };
        self.propose(shard, &command, NOBODY, PendingKind::Mirror)
    }

    /// Proposes the `Withdraw` of every mirrored waiter that left a queue other than by a
    /// grant since the last call, on the shards this member serves, saying how it was answered
    /// (`B` if this leader answered it so, else `T`). One that no longer leads leaves them to
    /// the next leader, which adopts those waiters and withdraws them in turn. Either way the
    /// `T` or `B` given in the same call is held until the log decides (see [`HeldAnswer`]).
    pub(super) fn propose_withdrawals(&mut self) {
        for local in 0..self.shards.len() {
            let withdrawn = self.shards[local].take_withdrawn();
            if withdrawn.is_empty() {
                continue;
            }
            let shard = self.shards[local].machine().shard();
            let first = self.held.len();
            self.hold_answers(shard, &withdrawn);
            if self.shards[local].serving() {
                for left in withdrawn {
                    let answered = match self.answered_busy(left.session, left.owner) {
                        true => Answered::Busy,
                        false => Answered::TimedOut,
                    };
                    self.propose_withdraw(shard, left.key, left.owner, answered);
                }
            }
            // Decided once the `Withdraw`s just proposed apply, too.
            let after = self.shards[local].last_proposed();
            self.held[first..]
                .iter_mut()
                .for_each(|held| held.after = after);
        }
    }

    /// Holds the `T` or `B` given in this call to each waiter of `withdrawn` (a detached
    /// session's got none: nobody reads it), taking it out of this call's answers.
    fn hold_answers(&mut self, shard: u32, withdrawn: &[Withdrawn]) {
        let mut wanted: HashMap<(SessionId, u64), &[u8]> = (withdrawn.iter())
            .map(|left| ((left.session, left.owner), &*left.key))
            .collect();
        let answers = std::mem::take(&mut self.answers);
        let mut kept = Vec::with_capacity(answers.len());
        for answer in answers {
            let id = (answer.session, answer.response.correlation_id());
            let key = match answer.response {
                Response::Timeout { .. } | Response::Busy { .. } => wanted.remove(&id),
                _ => None,
            };
            match key.and_then(|key| self.to_hold(shard, key, answer)) {
                Some(held) => self.held.push(held),
                None => kept.push(answer),
            }
        }
        self.answers = kept;
    }

    /// `response` (`T` or `B`) to `session` for an acquire of `key` that the replicated state
    /// may still queue or grant (a proposed head abandoned, a grant being released, an adopted
    /// waiter whose `Withdraw` may be in flight): held as [`HeldAnswer`], as a `Withdraw`'s is.
    pub(super) fn answer_held(
        &mut self,
        (shard, key): (u32, &[u8]),
        session: SessionId,
        response: Response,
        ends_pending: bool,
    ) {
        let answer = Answer {
            session,
            response,
            ends_pending,
            grant: GrantRef::NONE,
        };
        match self.to_hold(shard, key, answer) {
            Some(held) => {
                self.remember_answer(session, &response);
                self.held.push(held);
            }
            None => self.answer(session, response, ends_pending),
        }
    }

    /// `answer` held for the acquire of `key` until the entries proposed so far apply, or
    /// `None` if nobody reads it (a detached session) or [`HELD_MAX`] are held already. Client
    /// id 0 for a client that did not identify: only its owner's hold is looked at then.
    fn to_hold(&self, shard: u32, key: &[u8], answer: Answer) -> Option<HeldAnswer> {
        if is_detached(answer.session) || self.held.len() >= HELD_MAX {
            return None;
        }
        let client = self.client_of(answer.session);
        Some(HeldAnswer {
            shard,
            key: key.to_vec(),
            client: client.map_or(0, |client| self.client_id(client)),
            answer,
            gone: false,
            after: self.shards[self.local(shard)].last_proposed(),
        })
    }

    /// Whether a `T` or `B` to the acquire of `owner` from client `id` on `shard` is held:
    /// its fate is not decided yet.
    pub(super) fn held_for(&self, shard: u32, id: u128, owner: u64) -> bool {
        (self.held.iter()).any(|held| {
            held.shard == shard
                && held.client == id
                && held.answer.response.correlation_id() == owner
        })
    }

    /// The entries this member proposed on `shard` past `last` were lost (a later term's
    /// entry applied first): held answers waiting for them wait for `last` at most.
    pub(super) fn held_entries_lost(&mut self, shard: u32, last: u64) {
        for held in self.held.iter_mut().filter(|held| held.shard == shard) {
            held.after = held.after.min(last);
        }
    }

    /// Answers the held `T` and `B` that the replicated state decided: the waiter is no
    /// longer in the replicated queue (withdrawn, or granted by a later leader that adopted
    /// it), and its owner holds no grant of the key (an adopted waiter's grant, kept for a
    /// Resolve, is released at the end of its wait). Not `M`: sent again, the acquire could
    /// meet a leader that no longer knows of that grant, and be executed twice.
    pub(super) fn serve_held(&mut self) {
        if self.held.is_empty() {
            return;
        }
        let mut held = std::mem::take(&mut self.held);
        let mut decided = Vec::new();
        held.retain(|held| {
            let Some(machine) = self.machine(held.shard) else {
                return true;
            };
            if machine.applied() < held.after {
                return true;
            }
            let owner = held.answer.response.correlation_id();
            let holds = machine
                .holder(&held.key)
                .is_some_and(|hold| hold.owner == owner);
            if holds || machine.queues(&held.key, held.client, owner) {
                return true;
            }
            if !held.gone {
                decided.push(held.answer);
            }
            false
        });
        self.held = held;
        // Remembered for Resolves when they were given (resume.rs).
        self.answers.extend(decided);
    }

    /// Proposes the `Withdraw` of `owner`'s waiter of `key`, saying it was `answered` if every
    /// member reads that.
    pub(super) fn propose_withdraw(
        &mut self,
        shard: u32,
        key: Vec<u8>,
        owner: u64,
        answered: Answered,
    ) {
        let readable = self.peers.cluster_version() >= ANSWERED_PEER_VERSION;
        let command = Command::Withdraw {
            key,
            owner,
            answered: Some(answered).filter(|_| readable),
        };
        self.propose(shard, &command, NOBODY, PendingKind::Mirror);
    }

    /// This member began to serve `shard`: it adopts the replicated queues (see the module
    /// docs), and proposes the heads of keys left free.
    pub(super) fn adopt_waiters(&mut self, shard: u32) {
        let local = self.local(shard);
        let machine = self.shards[local].machine();
        if machine.waiters() == 0 {
            return;
        }
        let replicated: Vec<(Vec<u8>, Queued, u64)> = machine
            .waiting()
            .map(|(key, waiting)| (key.to_vec(), waiting.queued, waiting.deadline_ms))
            .collect();
        let mut keys: Vec<Vec<u8>> = Vec::new();
        for (key, queued, deadline_ms) in replicated {
            // Its own waiters this member kept (proposed heads) are queued already.
            if queued.client == 0 || self.shards[local].has_owner(&key, queued.owner) {
                continue;
            }
            // This member's deadline for the wait (from its apply of the `Enqueue`, after the
            // client sent the acquire): never before the client's own.
            let wait_end_us = deadline_ms.saturating_mul(1000);
            if wait_end_us <= self.now_us {
                // Over already: its client gave up. Withdrawn, timed out, and the same acquire
                // sent again gets `T`.
                self.adopted_acquire_ended(queued.client, queued.owner);
                self.propose_withdraw(shard, key, queued.owner, Answered::TimedOut);
                continue;
            }
            let grace_end_us = self.now_us + u64::from(queued.grace_s) * 1_000_000;
            let deadline_us = wait_end_us.min(grace_end_us);
            let seq = self.seq();
            let waiter = Waiter {
                session: ADOPTED,
                client: ClientRef::NONE,
                owner: queued.owner,
                lease_ms: queued.lease_ms,
                proposed_us: 0,
                deadline_us,
                ends_pending: true,
                seq,
                proposed: false,
                handoff: false,
                abandoned: false,
                counted: false,
                mirrored: true,
                origin: queued.client,
                wait_end_us,
            };
            self.shards[local].enqueue(&key, waiter);
            self.arm_wait(shard, &key, seq, deadline_us);
            self.stats.adopted += 1;
            if keys.last() != Some(&key) {
                keys.push(key);
            }
        }
        for key in keys {
            self.propose_head(shard, &key);
        }
        self.shards[local].check_invariants();
    }

    /// The grant of `token` on `shard` went to the adopted waiter of `owner` from client `id`,
    /// which no session took: kept for a Resolve until `until_us`, then released.
    pub(super) fn keep_adopted_grant(
        &mut self,
        (shard, token): (u32, u64),
        (id, owner): (u128, u64),
        until_us: u64,
    ) {
        let grant = AdoptedGrant {
            shard,
            id,
            owner,
            until_us,
        };
        self.adopted_grants.insert(token, grant);
    }

    /// A Resolve told its client of the grant of `token`, or an `Extend` of it applied (its
    /// client has it: see `apply_now`).
    pub(super) fn adopted_grant_delivered(&mut self, token: u64) {
        if !self.adopted_grants.is_empty() {
            self.adopted_grants.remove(&token);
        }
    }

    /// The `Extend` renewing the grant of `token` to an adopted waiter applied with `outcome`:
    /// the acquire of `owner` that `session` sent again gets its `A` (the lease renewed after
    /// it was sent); if the hold is gone (its lease ran out first), `T`, which promises
    /// nothing.
    pub(super) fn regranted(
        &mut self,
        shard: u32,
        session: crate::partition::SessionId,
        (owner, token): (u64, u64),
        outcome: crate::cluster::machine::Applied,
    ) {
        use crate::cluster::machine::Applied;
        use latchkey_client::protocol::Response;
        if !matches!(outcome, Applied::Extended { .. }) {
            self.stats.timed_out += 1;
            return self.answer(session, Response::Timeout { owner }, true);
        }
        self.answer_acquired(shard, (session, true), owner, token);
    }

    /// Remembers that the adopted acquire of `owner` from client `id` ended unattached, for
    /// [`ADOPTED_ENDED_US`]: the same acquire sent again gets `T`.
    pub(super) fn adopted_acquire_ended(&mut self, id: u128, owner: u64) {
        let now_us = self.now_us;
        if self.adopted_ended.len() >= ADOPTED_ENDED_MAX {
            self.adopted_ended.retain(|_, until_us| *until_us > now_us);
        }
        if self.adopted_ended.len() < ADOPTED_ENDED_MAX {
            self.adopted_ended
                .insert((id, owner), now_us + ADOPTED_ENDED_US);
        }
    }

    /// Whether the adopted acquire of `owner` from client `id` ended unattached here lately —
    /// or was granted and its hold is gone already (its lease ran out before anyone asked).
    pub(super) fn adopted_ended(&self, id: u128, owner: u64) -> bool {
        let until = self.adopted_ended.get(&(id, owner));
        if until.is_some_and(|&until_us| until_us > self.now_us) {
            return true;
        }
        // Few: grants to adopted waiters nobody asked about yet.
        self.adopted_grants.iter().any(|(&token, grant)| {
            let shard = self.shard(grant.shard);
            let gone = shard.is_some_and(|s| s.machine().key_of(token).is_none());
            grant.id == id && grant.owner == owner && gone
        })
    }

    /// Releases the grants to adopted waiters whose time for a Resolve ended.
    pub(super) fn release_unresolved_grants(&mut self) {
        if self.adopted_grants.is_empty() {
            return;
        }
        let now_us = self.now_us;
        let due: Vec<(u64, u32, u128, u64)> = (self.adopted_grants.iter())
            .filter(|(_, grant)| grant.until_us <= now_us)
            .map(|(&token, grant)| (token, grant.shard, grant.id, grant.owner))
            .collect();
        for (token, shard, id, owner) in due {
            self.adopted_grants.remove(&token);
            self.adopted_acquire_ended(id, owner);
            if self
                .shard(shard)
                .is_some_and(|s| s.machine().key_of(token).is_some())
            {
                self.stats.grace_releases += 1;
                self.release_undelivered(shard, token);
            }
        }
    }
}

#[cfg(test)]
#[path = "mirror_tests.rs"]
mod tests;
