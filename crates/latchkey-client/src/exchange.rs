//! One request's way to an answer: handing it to sessions of the right member, again while it
//! is definitely unsent, and following cluster redirects (`M`, docs/protocol.md §5).
//!
//! The rules (the module docs of [`super`] hold for every attempt):
//!
//! * An attempt goes to the member [`Members::route`] names for the request's key.
//! * A session that gives the request back unsent (it failed before sending it, its handshake
//!   ping went unanswered, or it is stalled: answers overdue) is avoided next; with several
//!   members the next attempt goes to the next member in turn, and the failed member stops
//!   being the key's route. Attempts are spaced by [`Backoff`] (at most [`BACKOFF_MAX`]).
//! * An `M` naming a leader: the leader is remembered and the same request (same owner, token
//!   or nonce, same deadline) goes to it at once. An `M` without a leader (an election, or no
//!   quorum): back off, then the next member in turn.
//! * The request ends *unsent* when its deadline passes while it is definitely unsent, after
//!   [`REDIRECTS_MAX`] `M`s, or (unless `ClientConfig::retry_refused`) as soon as every listed
//!   member refused a connection during the call: nothing listens anywhere, and failing at
//!   once is what a caller of a one-shot attempt (`flock -n`) expects. It counts as *serving* (an acquire then ends
//!   [`Timeout`](super::AcquireError::Timeout), like a wait that ran out) only when the
//!   deadline passed while it waited, unsent, on an established session. Otherwise nothing
//!   served it: it met only `M`s, failed sessions or silence, and it ends
//!   [`Unavailable`](super::AcquireError::Unavailable) (any other call
//!   [`Unavailable`](super::RequestError::Unavailable) either way), with an
//!   [`UnavailableReport`] of what each member did, kept for
//!   [`Client::last_unavailable`](super::Client::last_unavailable). An `M` naming a leader
//!   that then cannot be reached is such a case: nothing was executed anywhere.
//! * An `M` is a definite answer that nothing executed; a request that may have been sent and
//!   got no definite answer is never sent again: it ends
//!   [`Indeterminate`](super::Exchange::Indeterminate) at once — except an acquire on an
//!   identified session, which is *resolved* on another session (docs/protocol.md §5:
//!   [`Client::resolve`]; first at another member than the failed session's, `M` leading back
//!   to it), and a release or an extend, which names a token and is safe to send
//!   again (another attempt, as for an unsent one).
//!
//! Cost on a single node: the report is built only once an attempt fails; a call answered at
//! its first attempt allocates nothing here.
//!
//! Deliberately not here: what the answer means to the caller (see [`super::Client`]).

use std::net::SocketAddr;
use std::sync::Arc;
use std::thread;
use std::time::{Duration, Instant};

use crossbeam_channel::RecvTimeoutError;
use parking_lot::Mutex;

use super::call::{Call, Op, Outcome};
use super::members::Members;
use super::report::{MemberState, UnavailableReport};
use super::session::Session;
use super::{Client, Exchange, BACKOFF_MAX, MEMBERS_MAX};
use crate::protocol::{Fate, Response};

/// The most `M` answers one call follows before it gives up (a redirect loop ends).
pub const REDIRECTS_MAX: u32 = 64;

/// The state of one request across its attempts.
struct Attempts {
    backoff: Backoff,
    /// The session that last gave the request back unsent.
    avoid: Option<u64>,
    /// `M` answers followed so far (at most [`REDIRECTS_MAX`]).
    redirects: u32,
    /// Whether the request names a key.
    keyed: bool,
    /// What each member did, once an attempt did not end the call.
    report: Option<UnavailableReport>,
    /// An earlier attempt of this release or extend may have been sent: if no later one is
    /// answered, the request ends `Indeterminate`, not unsent.
    possibly_sent: bool,
    /// A member this attempt sequence leaves alone (a hedge's: the first attempt waits there),
    /// even when another member names it leader.
    skip: Option<SocketAddr>,
    /// Whether a refused connection is tried again (`ClientConfig::retry_refused`).
    retry_refused: bool,
    /// The addresses that refused a connection during this call, each once (at most
    /// [`MEMBERS_MAX`], the bound on a client's addresses).
    refused: Vec<SocketAddr>,
}

/// Where a sequence of attempts starts, and what it leaves alone.
enum Start {
    /// At the key's route (an ordinary request).
    Route,
    /// At the key's route, recording in the cell the member each attempt is handed to (the
    /// first branch of a hedged request: its hedge leaves that member alone).
    Tracked(Arc<Mutex<Option<SocketAddr>>>),
    /// At the member after this one, never at this one, even when another member names it
    /// leader (a hedge: the first branch waits there).
    After(SocketAddr),
    /// At the key's route unless that is this member, else at the member after it; an `M`
    /// naming it is followed (a Resolve after a session to it failed: if it still leads the
    /// key, the others send the Resolve back to it; if it is paused, no new session waits out
    /// its handshake there first).
    Away(SocketAddr),
}

/// What to do after one attempt.
enum Next {
    /// The request ended.
    Done(Exchange),
    /// Try again at this member.
    Retry(SocketAddr),
}

impl Client {
    /// Hands `op` to sessions until one answers (other than `M`) or may have sent it, or the
    /// deadline passes while it is definitely unsent (see the module docs).
    pub(crate) fn exchange(&self, op: Op, deadline: Instant) -> Exchange {
        self.exchange_from(op, deadline, Start::Route)
    }

    /// [`exchange`](Self::exchange) of a release or an extend of a cluster's hold, *hedged*:
    /// when the first attempt is not answered within [`Client::hedge_after`] (its member may
    /// be paused: a VM stall, a slow disk, a cut link), the same request also goes to the
    /// other members — which redirect it to the new leader once one is elected — and the
    /// first answer wins. The hedge leaves alone the member where the first attempt waits
    /// *then*, not where it began: a redirect may have taken it to the paused leader. Both are
    /// safe to execute twice (docs/protocol.md §4.3): a second release answers `N`, and an
    /// extend executed twice counts its lease from the later execution, so the ticket's bound,
    /// taken from the answer that came, is never late.
    pub(crate) fn exchange_hedged(&self, op: Op, deadline: Instant) -> Exchange {
        let members = &self.shared.members;
        let hedged = matches!(op, Op::Release { .. } | Op::Extend { .. }) && members.listed() > 1;
        if !hedged {
            return self.exchange(op, deadline);
        }
        let waiting_at = Arc::new(Mutex::new(None));
        let (tx, rx) = crossbeam_channel::bounded::<Exchange>(2);
        let spawn = |start: Start| {
            let (client, op, tx) = (self.clone(), op.clone(), tx.clone());
            thread::Builder::new()
                .name("latchkey-hedge".into())
                .spawn(move || {
                    let _ = tx.send(client.exchange_from(op, deadline, start));
                })
        };
        if spawn(Start::Tracked(Arc::clone(&waiting_at))).is_err() {
            return self.exchange(op, deadline);
        }
        let backstop = deadline + 2 * self.config().transport_timeout;
        let mut outstanding = 1;
        let mut fallback = None;
        match rx.recv_timeout(self.hedge_after()) {
            Ok(exchange) if answered(&exchange) => return exchange,
            Ok(exchange) => {
                outstanding -= 1;
                fallback = Some(exchange);
            }
            Err(_) => {}
        }
        // Where the first attempt waits now (it has made one: the hedge waited a while).
        let silent = waiting_at
            .lock()
            .unwrap_or_else(|| members.route(op.key().map(|key| &**key)));
        log::debug!("a release or extend is unanswered at {silent}: also sent to the others");
        if spawn(Start::After(silent)).is_ok() {
            outstanding += 1;
        }
        // Bounded: each branch sends one result, by its deadline plus the transport allowance.
        while outstanding > 0 {
            let Ok(exchange) = rx.recv_deadline(backstop) else {
                break;
            };
            outstanding -= 1;
            if answered(&exchange) {
                return exchange;
            }
            // A branch that may have sent it makes the whole request's fate unknown.
            fallback = match (fallback, exchange) {
                (Some(Exchange::Indeterminate), _) | (_, Exchange::Indeterminate) => {
                    Some(Exchange::Indeterminate)
                }
                (_, other) => Some(other),
            };
        }
        fallback.unwrap_or(Exchange::Indeterminate)
    }

    /// How long a release or an extend of a cluster's hold waits for its first attempt before
    /// it also goes to the other members: a quarter of the connect timeout, within 100..=500 ms
    /// (well under a lease's validity: a 2 s lease is valid for 1.8 s).
    pub(crate) fn hedge_after(&self) -> Duration {
        let quarter = self.config().connect_timeout / 4;
        quarter.clamp(HEDGE_AFTER_MIN, HEDGE_AFTER_MAX)
    }

    /// [`exchange`](Self::exchange), starting as `start` says.
    fn exchange_from(&self, op: Op, deadline: Instant, start: Start) -> Exchange {
        let (skip, waiting_at, away) = match start {
            Start::Route => (None, None, None),
            Start::Tracked(at) => (None, Some(at), None),
            Start::After(skip) => (Some(skip), None, None),
            Start::Away(away) => (None, None, Some(away)),
        };
        let members = &self.shared.members;
        let key = op.key().cloned();
        let mut attempts = Attempts {
            backoff: Backoff::default(),
            avoid: None,
            redirects: 0,
            keyed: key.is_some(),
            report: None,
            possibly_sent: false,
            retry_refused: self.config().retry_refused,
            refused: Vec::new(),
            skip,
        };
        let mut addr = match (skip, away) {
            (Some(skip), _) => attempts.next_addr(members, skip),
            (None, Some(away)) => match members.route(key.as_deref()) {
                routed if routed == away => members.next_member_except(Some(away)),
                routed => routed,
            },
            (None, None) => members.route(key.as_deref()),
        };
        // Bounded: every pass either ends, sleeps a backoff, or counts a redirect.
        loop {
            if Instant::now() >= deadline {
                return attempts.unavailable(members);
            }
            // Not sent after `Client::interrupt`: as a wait that ran out.
            if matches!(op, Op::Acquire { .. }) && self.is_interrupted() {
                return Exchange::Unsent { serving: true };
            }
            if let Err(unusable) = members.usable(addr, deadline) {
                let cause = unusable.cause;
                attempts.note(members, addr, MemberState::Unreachable { cause });
                if unusable.refused && attempts.refused_everywhere(addr, members) {
                    return attempts.unavailable(members);
                }
                attempts.backoff.sleep(deadline);
                addr = attempts.next_addr(members, addr);
                continue;
            }
            let pool = match members.pool(addr) {
                Ok(Some(pool)) => pool,
                Ok(None) => {
                    let cause = format!("more than {MEMBERS_MAX} members: no session to it");
                    attempts.note(members, addr, MemberState::Unreachable { cause });
                    attempts.backoff.sleep(deadline);
                    addr = attempts.next_addr(members, addr);
                    continue;
                }
                Err(error) => {
                    log::warn!("cannot start a session pool for {addr}: {error}");
                    let cause = error.to_string();
                    attempts.note(members, addr, MemberState::Unreachable { cause });
                    attempts.backoff.sleep(deadline);
                    addr = attempts.next_addr(members, addr);
                    continue;
                }
            };
            let session = match pool.pick(attempts.avoid) {
                Ok(session) => session,
                Err(error) => {
                    log::warn!("cannot start a session: {error}");
                    let cause = error.to_string();
                    attempts.note(members, addr, MemberState::Unreachable { cause });
                    attempts.backoff.sleep(deadline);
                    continue;
                }
            };
            if let Some(at) = &waiting_at {
                *at.lock() = Some(addr);
            }
            let outcome = self.attempt(&session, &op, deadline);
            let indeterminate = matches!(outcome, Some(Ok(Outcome::Indeterminate)));
            if indeterminate && matches!(op, Op::Acquire { .. }) && session.is_identified() {
                members.forget(key.as_deref(), addr);
                return self.resolve(&op, deadline, &session, addr);
            }
            match attempts.next(
                outcome,
                &op,
                &session,
                (addr, members),
                key.as_ref(),
                deadline,
            ) {
                Next::Done(exchange) => return exchange,
                Next::Retry(next) => addr = next,
            }
        }
    }

    /// An acquire that may have been sent on `failed`, an identified session, got no answer
    /// there: asks this client's other sessions what became of it (docs/protocol.md §5) — on
    /// the member that leads the key now, following `M` — until its `deadline`, or, when that
    /// passed, a transport allowance from now, to settle a grant it may have made
    /// (`settle_acquire` releases one found late). A Resolve is safe to repeat: one whose
    /// session fails, or that reaches no member, is asked again while time is left.
    fn resolve(
        &self,
        op: &Op,
        deadline: Instant,
        failed: &Session,
        failed_at: SocketAddr,
    ) -> Exchange {
        let Op::Acquire {
            key,
            wait_zero,
            lease_s,
            owner,
        } = op.clone()
        else {
            unreachable!("only an acquire is resolved")
        };
        let until = deadline.max(Instant::now() + self.config().transport_timeout);
        let resolve = Op::Resolve {
            key,
            owner,
            wait_zero,
            lease_s,
            wait_deadline: deadline,
        };
        let mut backoff = Backoff::default();
        log::debug!(
            "session {} of acquire {owner:#x} failed: resolving it",
            failed.id()
        );
        // Bounded by `until`: every pass asks once (the exchange ends by `until`), then backs
        // off. The first ask goes to another member first (`Start::Away`), later ones by route.
        let mut start = Start::Away(failed_at);
        while Instant::now() < until {
            match self.exchange_from(resolve.clone(), until, start) {
                Exchange::Answer {
                    response,
                    sent_at,
                    read_at,
                } => return resolved(response, owner, sent_at, read_at),
                Exchange::Indeterminate | Exchange::Unsent { .. } | Exchange::NeverSeen => {
                    start = Start::Route;
                    backoff.sleep(until)
                }
            }
        }
        log::debug!("acquire {owner:#x}: no session could say what became of it");
        Exchange::Indeterminate
    }

    /// Submits the call to `session` and waits for its outcome; `None` when the session
    /// would not take it (so it was not sent).
    fn attempt(
        &self,
        session: &Session,
        op: &Op,
        deadline: Instant,
    ) -> Option<Result<Outcome, RecvTimeoutError>> {
        let (tx, rx) = crossbeam_channel::bounded(1);
        let call = Call {
            op: op.clone(),
            deadline,
            reply: Some(tx),
            attempts: 0,
        };
        session.submit(call).ok()?;
        // Never reached by a working session thread, which answers by the deadline plus the
        // transport allowance; it only bounds the wait if that thread died.
        let backstop = deadline + 2 * self.config().transport_timeout;
        Some(rx.recv_deadline(backstop))
    }
}

impl Attempts {
    /// What one attempt at `addr` on `session` means for the request.
    fn next(
        &mut self,
        outcome: Option<Result<Outcome, RecvTimeoutError>>,
        op: &Op,
        session: &Session,
        (addr, members): (SocketAddr, &Members),
        key: Option<&Arc<str>>,
        deadline: Instant,
    ) -> Next {
        let outcome = match outcome {
            None => Outcome::NotSent,
            Some(Ok(outcome)) => outcome,
            Some(Err(RecvTimeoutError::Timeout | RecvTimeoutError::Disconnected)) => {
                log::error!("session {} gave no outcome", session.id());
                return Next::Done(Exchange::Indeterminate);
            }
        };
        match outcome {
            Outcome::Answer {
                response: Response::Moved { leader, .. },
                ..
            } => self.redirected(leader.addr(), addr, members, key, deadline),
            Outcome::Answer {
                response,
                sent_at,
                read_at,
            } => {
                // Only the key's leader executes a token's request: its later ones (the
                // holder's extends and release) go straight there, not to a member in turn.
                let executed = !matches!(response, Response::Error { .. })
                    && !matches!(op, Op::Query { .. } | Op::Ping { .. });
                if executed {
                    members.confirm(key, addr);
                }
                Next::Done(Exchange::Answer {
                    response,
                    sent_at,
                    read_at,
                })
            }
            // An earlier attempt may have executed: whatever the later ones did, its fate is
            // unknown.
            Outcome::Expired { .. } | Outcome::Unreachable if self.possibly_sent => {
                Next::Done(Exchange::Indeterminate)
            }
            // It waited, unsent, on a session that was up: as when a wait runs out.
            Outcome::Expired { established: true } => {
                Next::Done(Exchange::Unsent { serving: true })
            }
            Outcome::Expired { established: false } => {
                self.note(members, addr, MemberState::Connecting);
                Next::Done(self.unavailable(members))
            }
            // Retrying would meet the same refusal (TLS, not a latchkey server): unavailable now.
            Outcome::Unreachable => {
                let state = Self::failed_state(session, addr, members);
                self.note(members, addr, state);
                Next::Done(self.unavailable(members))
            }
            Outcome::NotSent => {
                let state = Self::failed_state(session, addr, members);
                self.note(members, addr, state);
                let refused = session.is_failed()
                    && members
                        .failure_of(addr)
                        .is_some_and(|failure| failure.refused());
                if refused && self.refused_everywhere(addr, members) {
                    return Next::Done(self.unavailable(members));
                }
                self.avoid = Some(session.id());
                members.forget(key.map(|key| &**key), addr);
                self.backoff.sleep(deadline);
                Next::Retry(self.next_addr(members, addr))
            }
            // A release or an extend names a token and is safe to send again (a release that
            // executed twice says `N` the second time; an extend executed twice counts its
            // lease from the later): another session tries, within the same deadline.
            Outcome::Indeterminate if matches!(op, Op::Release { .. } | Op::Extend { .. }) => {
                self.possibly_sent = true;
                let state = Self::failed_state(session, addr, members);
                self.note(members, addr, state);
                self.avoid = Some(session.id());
                members.forget(key.map(|key| &**key), addr);
                self.backoff.sleep(deadline);
                Next::Retry(self.next_addr(members, addr))
            }
            Outcome::Indeterminate | Outcome::Compensated => {
                // Never resent; but the key's next request tries elsewhere first.
                members.forget(key.map(|key| &**key), addr);
                Next::Done(Exchange::Indeterminate)
            }
        }
    }

    /// Why `session` to `addr` gave a request back unsent: its failure, or its silence.
    fn failed_state(session: &Session, addr: SocketAddr, members: &Members) -> MemberState {
        if !session.is_failed() {
            if session.is_stalled() {
                return MemberState::Silent;
            }
            let cause = "its session took no more calls".to_string();
            return MemberState::Unreachable { cause };
        }
        let cause = members.failure_of(addr).map_or_else(
            || "its session ended".to_string(),
            |f| f.cause().to_string(),
        );
        MemberState::Unreachable { cause }
    }

    /// `addr` refused a connection (its session's, or its card's ask): whether, with that,
    /// every listed member this call may try refused one during it. Then, unless refused
    /// connections are retried, the call ends at once (nothing listens anywhere; a server down
    /// or restarting), and the report says so. A hedge never tries the member it skips (its
    /// first attempt's, which reports its own refusal): it counts the others.
    fn refused_everywhere(&mut self, addr: SocketAddr, members: &Members) -> bool {
        if self.retry_refused {
            return false;
        }
        if !self.refused.contains(&addr) {
            self.refused.push(addr);
        }
        let skipped = self.skip.is_some_and(|skip| members.is_listed(skip));
        let tried = members.listed() - usize::from(skipped);
        let everywhere = self.refused.len() >= tried.max(1);
        if everywhere {
            if let Some(report) = self.report.as_mut() {
                report.refused_everywhere();
            }
        }
        everywhere
    }

    /// `addr` answered `M` naming `leader` (or none): where the request goes next.
    fn redirected(
        &mut self,
        leader: Option<SocketAddr>,
        addr: SocketAddr,
        members: &Members,
        key: Option<&Arc<str>>,
        deadline: Instant,
    ) -> Next {
        self.redirects += 1;
        let named = leader.filter(|&leader| leader != addr && Some(leader) != self.skip);
        let state = match named {
            Some(leader) => MemberState::Redirected { leader },
            None => MemberState::NoLeader,
        };
        self.note(members, addr, state);
        if self.redirects > REDIRECTS_MAX {
            log::warn!("{REDIRECTS_MAX} redirects followed without an answer: giving up");
            if let Some(report) = self.report.as_mut() {
                report.redirects_exhausted();
            }
            return Next::Done(self.unavailable(members));
        }
        self.avoid = None;
        match named {
            Some(leader) => {
                members.learn(key, leader);
                Next::Retry(leader)
            }
            // No leader known, or this member names itself: wait for the election.
            None => {
                members.forget(key.map(|key| &**key), addr);
                self.backoff.next = self.backoff.next.max(BACKOFF_MIN);
                self.backoff.sleep(deadline);
                Next::Retry(self.next_addr(members, addr))
            }
        }
    }

    /// The member after `from` in turn, never the one this sequence skips (unless it is the
    /// only member).
    fn next_addr(&self, members: &Members, from: SocketAddr) -> SocketAddr {
        let mut addr = members.next_member_except(Some(from));
        // Bounded by the member count: the turn goes round once at most.
        for _ in 0..members.listed() {
            if Some(addr) != self.skip {
                break;
            }
            addr = members.next_member_except(Some(addr));
        }
        addr
    }

    /// Records what `addr` did (the report is started on first use).
    fn note(&mut self, members: &Members, addr: SocketAddr, state: MemberState) {
        let keyed = self.keyed;
        self.report
            .get_or_insert_with(|| UnavailableReport::new(keyed, members.listed()))
            .record(addr, state);
    }

    /// The request ends unsent with nothing serving it: its report is kept for the caller. (A
    /// release or extend an earlier attempt may have sent ends `Indeterminate` instead.)
    fn unavailable(&mut self, members: &Members) -> Exchange {
        if self.possibly_sent {
            return Exchange::Indeterminate;
        }
        let keyed = self.keyed;
        let report = self
            .report
            .take()
            .unwrap_or_else(|| UnavailableReport::new(keyed, members.listed()));
        // A hedge skips the first attempt's member: the first attempt's report, which saw
        // every member, is the one kept.
        if self.skip.is_none() {
            members.note_unavailable(report);
        }
        Exchange::Unsent { serving: false }
    }
}

/// What a Resolve's answer (or, after `Queued`, the acquire's own answer) means for the call.
fn resolved(response: Response, owner: u64, sent_at: Instant, read_at: Instant) -> Exchange {
    let answer = |response| Exchange::Answer {
        response,
        sent_at,
        read_at,
    };
    match response {
        Response::Resolved {
            fate: Fate::NeverSeen,
            ..
        } => Exchange::NeverSeen,
        Response::Resolved {
            fate: Fate::TimedOut,
            ..
        } => answer(Response::Timeout { owner }),
        Response::Resolved {
            fate: Fate::Busy, ..
        } => answer(Response::Busy { owner }),
        // A grant (`Resolved` with its token and lease left), or the acquire's own `A`, `T`
        // or `B` after it was found queued; an `X` (the session was not identified after all,
        // or the server's records were full) settles nothing.
        Response::Error { code, .. } => {
            log::debug!("acquire {owner:#x} could not be resolved: {code}");
            Exchange::Indeterminate
        }
        other => answer(other),
    }
}

/// Whether a branch of a hedged request got a definite answer (anything but an `X` is one for
/// a release or an extend; an `X` is too: the request was refused).
fn answered(exchange: &Exchange) -> bool {
    matches!(exchange, Exchange::Answer { .. })
}

/// Bounds of [`Client::hedge_after`].
const HEDGE_AFTER_MIN: Duration = Duration::from_millis(100);
const HEDGE_AFTER_MAX: Duration = Duration::from_millis(500);

/// The first pause after an `M` without a leader (an election takes some time).
const BACKOFF_MIN: Duration = Duration::from_millis(10);

/// Pauses between attempts of an unsent request: none before the first retry (another
/// session may be up), then 10 ms doubling up to [`BACKOFF_MAX`], never past the deadline.
#[derive(Default)]
pub(super) struct Backoff {
    pub(super) next: Duration,
}

impl Backoff {
    pub(super) fn sleep(&mut self, deadline: Instant) {
        let left = deadline.saturating_duration_since(Instant::now());
        thread::sleep(self.next.min(left));
        self.next = (self.next * 2).clamp(BACKOFF_MIN, BACKOFF_MAX);
    }
}
