//! A session's answer to `M` (a cluster member that does not lead the key): the same request
//! again, to the leader it named or, when it named none, to another member after
//! [`MOVED_RETRY`](crate::bench::cluster::MOVED_RETRY). An `M` means nothing was executed,
//! so this never sends twice what may have been executed once.
//!
//! The request keeps its correlation id (owner, token or nonce) and its first send instant, so
//! the latency recorded for it includes the redirects; an acquire's wait is what is left of its
//! deadline. A cycle follows at most [`REDIRECTS_MAX`] `M`s, then it is given up and counted
//! as `no_leader` (unexpected). Deliberately not here: which member a request goes to (the
//! [`Leaders`](crate::bench::cluster::Leaders) cache behind the outbox).

use std::net::SocketAddr;

use super::{key_name, wait_seconds, Context, Outbox, ReplyError, Resend, Session, State, Wire};
use crate::bench::cluster::REDIRECTS_MAX;

impl Session {
    /// The request outstanding on slot `index` was answered `M` naming `leader` (or none).
    pub(super) fn redirected<W: Wire>(
        &mut self,
        index: usize,
        leader: Option<SocketAddr>,
        ctx: &mut Context<'_>,
        outbox: &mut Outbox<'_, W>,
    ) -> Result<(), ReplyError> {
        let workload = ctx.plan.workload;
        ctx.stats.answer(workload, |c| c.moved += 1);
        let slot = &mut self.slots[index];
        let resend = match slot.state {
            State::Acquiring => Resend::Acquire,
            State::Releasing => Resend::Release,
            State::Querying => Resend::Query,
            other => unreachable!("an M is matched to an outstanding request, not {other:?}"),
        };
        slot.redirects = slot.redirects.saturating_add(1);
        if slot.redirects > REDIRECTS_MAX {
            ctx.stats.answer(workload, |c| c.no_leader += 1);
            self.finish(index, ctx, outbox);
            self.check_invariants();
            return Ok(());
        }
        match leader {
            Some(leader) => {
                if outbox.leaders.learn(slot.key, leader).is_none() {
                    return Err(ReplyError::UnknownLeader(leader));
                }
                self.resend(index, resend, ctx, outbox);
            }
            None => {
                outbox.leaders.pass(slot.key, usize::from(slot.member));
                slot.state = State::Rerouting(resend);
                ctx.timers.moved.push(ctx.now, self.local, index as u16);
            }
        }
        self.check_invariants();
        Ok(())
    }

    /// Sends slot `index`'s request again, to the member the cache names now.
    pub(super) fn resend<W: Wire>(
        &mut self,
        index: usize,
        resend: Resend,
        ctx: &mut Context<'_>,
        outbox: &mut Outbox<'_, W>,
    ) {
        let slot = &mut self.slots[index];
        let key = key_name(ctx.plan.prefix, ctx.plan.tag, slot.key);
        let at = index as u16;
        (slot.state, slot.member) = match resend {
            Resend::Acquire => {
                let wait_s = wait_seconds(slot.deadline.saturating_duration_since(ctx.now));
                let member = outbox.acquire(at, slot.key, &key, slot.owner, wait_s);
                (State::Acquiring, member)
            }
            Resend::Release => {
                let member = outbox.release(at, slot.key, &key, slot.token);
                (State::Releasing, member)
            }
            Resend::Query => {
                let member = outbox.query(at, slot.key, &key, slot.owner);
                (State::Querying, member)
            }
        };
    }
}
