//! What a client does with the answer to its pending request, and what the checker learns.

use super::{Grant, Pending, Request, Sim, RESENDS_MAX, SHARDS};
use crate::world::member_at;
use latchkey::cluster::partition::shard_of;
use latchkey::partition::Fate;
use latchkey_client::protocol::Response;

impl Sim {
    /// The answer `response` from `member` to client `index`'s pending request.
    pub(super) fn outcome(
        &mut self,
        index: usize,
        member: u64,
        pending: Pending,
        response: Response,
    ) {
        let now = self.now_us;
        let key = pending.key.clone();
        self.clients[index].pending = None;
        let client = &mut self.clients[index];
        client.next_us = now + client.rng.between(1_000, 100_000);
        match (pending.request, response) {
            (_, Response::Moved { leader, .. }) => self.moved(index, member, pending, leader),
            (Request::Acquire { owner, lease_s, .. }, Response::Acquired { token, .. }) => {
                let grant = Grant {
                    client: index,
                    owner,
                    token,
                    sent_us: pending.sent_us,
                    lease_us: u64::from(lease_s) * 1_000_000,
                };
                self.checker.granted(now, grant, &key);
                let shard = shard_of(&key, SHARDS) as usize;
                if let Some(from) = self.failover_from[shard].take() {
                    self.stats.failovers_us.push(now - from);
                }
                if self.clients[index].probe {
                    // It releases when the run tells it to.
                    self.clients[index].probe_token = Some(token);
                    self.clients[index].probe_granted = true;
                    self.clients[index].next_us = u64::MAX;
                }
            }
            (Request::Acquire { owner, .. }, Response::Timeout { .. } | Response::Busy { .. }) => {
                let what = if matches!(response, Response::Busy { .. }) {
                    'B'
                } else {
                    'T'
                };
                self.checker.answered_ended(now, owner, what);
                if self.clients[index].probe {
                    self.clients[index].probe_failed = Some(what);
                }
            }
            (
                request @ Request::Resolve { .. },
                Response::Resolved {
                    fate,
                    token,
                    lease_ms,
                    ..
                },
            ) => {
                self.resolved(index, (member, pending), request, (fate, token, lease_ms));
            }
            (Request::Release { token }, Response::Released { .. }) => {
                if let Some(belief) = self.checker.belief_mut(token) {
                    belief.ended = true;
                }
            }
            (Request::Release { token }, Response::NotHeld { .. }) => {
                if let Some(belief) = self.checker.belief_mut(token) {
                    belief.releasing = false;
                }
                self.checker.not_held(now, token, "release");
            }
            (Request::Extend { token, lease_s }, Response::Extended { .. }) => {
                if let Some(belief) = self.checker.belief_mut(token) {
                    belief.deadline_us = pending.sent_us + u64::from(lease_s) * 1_000_000;
                    belief.extending = None;
                }
            }
            (Request::Extend { token, .. }, Response::NotHeld { .. }) => {
                // Judged by the client's count while the extend was in flight (the earlier of
                // its deadline and the extend's): it may have applied, shortening the lease,
                // before the hold ended (a member that restored a snapshot past both says N).
                self.checker.not_held(now, token, "extend");
                if let Some(belief) = self.checker.belief_mut(token) {
                    belief.extending = None;
                }
            }
            (Request::Query { .. }, Response::State { held, .. }) => {
                if !held {
                    self.checker.queried_free(now, pending.sent_us, &key);
                }
            }
            (request, response) => {
                let what = format!("{request:?} answered {response:?}");
                self.checker.fail(now, what);
            }
        }
    }

    /// What a Resolve of client `index`'s acquire answered (docs/protocol.md §5).
    fn resolved(
        &mut self,
        index: usize,
        (member, pending): (u64, Pending),
        request: Request,
        (fate, token, lease_ms): (Fate, u64, u32),
    ) {
        let now = self.now_us;
        let Request::Resolve {
            owner,
            wait_s,
            lease_s,
        } = request
        else {
            unreachable!("a Resolve's answer");
        };
        self.stats.resolves[fate as usize] += 1;
        match fate {
            Fate::Granted => {
                // Held for the lease left, counted from the Resolve's send.
                let grant = Grant {
                    client: index,
                    owner,
                    token,
                    sent_us: pending.sent_us,
                    lease_us: u64::from(lease_ms) * 1000,
                };
                if lease_ms > u32::from(lease_s) * 1000 {
                    let what = format!("resolve of {owner:#x}: {lease_ms} ms left of {lease_s} s");
                    self.checker.fail(now, what);
                }
                self.checker.granted(now, grant, &pending.key);
            }
            Fate::Queued => {
                // Its acquire waits on the session that asked: its answer comes there.
                let acquire = Request::Acquire {
                    owner,
                    wait_s,
                    lease_s,
                };
                let client = &mut self.clients[index];
                client.pending = Some(Pending {
                    request: acquire,
                    ..pending
                });
                client.next_us = now + client.rng.between(1_000, 100_000);
            }
            Fate::TimedOut | Fate::Busy => self.checker.resolved_ended(now, member, owner),
            Fate::NeverSeen => self.checker.never_seen(now, member, owner),
        }
    }

    /// `M`: not executed; resend to the named leader (or another member) after a backoff.
    fn moved(
        &mut self,
        index: usize,
        member: u64,
        mut pending: Pending,
        leader: latchkey_client::protocol::Leader,
    ) {
        let now = self.now_us;
        match pending.request {
            Request::Release { token } => {
                if let Some(belief) = self.checker.belief_mut(token) {
                    belief.releasing = false;
                }
            }
            Request::Extend { token, .. } => {
                if let Some(belief) = self.checker.belief_mut(token) {
                    belief.extending = None; // M: it had no effect
                }
            }
            _ => {}
        }
        let shard = shard_of(&pending.key, SHARDS) as usize;
        let named = leader.addr().and_then(member_at);
        let client = &mut self.clients[index];
        let pick = client.rng.next_u64();
        client.leaders[shard] =
            Some(named.unwrap_or_else(|| crate::clients::Client::other_member(member, pick)));
        if pending.resends >= RESENDS_MAX {
            if client.probe {
                client.probe_failed = Some('M');
            }
            if let Request::Resolve { .. } = pending.request {
                self.stats.indeterminate += 1;
            }
            return;
        }
        pending.resends += 1;
        pending.sent = None;
        let backoff = if named.is_some() { 1_000 } else { 10_000 };
        client.next_us = now + backoff + client.rng.below(backoff * 4);
        client.pending = Some(pending);
    }
}
