//! One request's way to an answer: handing it to sessions of the right member, again while it
//! is definitely unsent, and following cluster redirects (`M`, PROTOCOL.md §5).
//!
//! The rules (the module docs of [`super`] hold for every attempt):
//!
//! * An attempt goes to the member [`Members::route`] names for the request's key.
//! * A session that gives the request back unsent is avoided next; with several members the
//!   next attempt goes to the next member in turn, and the failed member stops being the
//!   key's route. Attempts are spaced by [`Backoff`] (at most [`BACKOFF_MAX`]).
//! * An `M` naming a leader: the leader is remembered and the same request (same owner, token
//!   or nonce, same deadline) goes to it at once. An `M` without a leader (an election): back
//!   off, then the next member in turn.
//! * A call follows at most [`REDIRECTS_MAX`] `M`s; past that it ends as an unsent request
//!   with a member that answered: an acquire [`Timeout`](super::AcquireError::Timeout) (it
//!   was never queued anywhere, like a wait that ran out), any other request
//!   [`Unavailable`](super::RequestError::Unavailable). The deadline ends it the same way.
//! * An `M` is a definite answer that nothing executed; a request that may have been sent and
//!   got no definite answer is never sent again: it ends
//!   [`Indeterminate`](super::Exchange::Indeterminate) at once.
//!
//! Deliberately not here: what the answer means to the caller (see [`super::Client`]).

use std::thread;
use std::time::{Duration, Instant};

use crossbeam_channel::RecvTimeoutError;

use super::call::{Call, Op, Outcome};
use super::members::Members;
use super::{Client, Exchange, BACKOFF_MAX};
use crate::protocol::Response;

/// The most `M` answers one call follows before it gives up (a redirect loop ends).
pub const REDIRECTS_MAX: u32 = 64;

/// The state of one request across its attempts.
struct Attempts {
    backoff: Backoff,
    /// The session that last gave the request back unsent.
    avoid: Option<u64>,
    /// `M` answers followed so far (at most [`REDIRECTS_MAX`]).
    redirects: u32,
    /// Whether some member answered (an `M`): at the deadline the call is a Timeout.
    answered: bool,
}

/// What to do after one attempt.
enum Next {
    /// The request ended.
    Done(Exchange),
    /// Try again at this member.
    Retry(std::net::SocketAddr),
}

impl Client {
    /// Hands `op` to sessions until one answers (other than `M`) or may have sent it, or the
    /// deadline passes while it is definitely unsent (see the module docs).
    pub(crate) fn exchange(&self, op: Op, deadline: Instant) -> Exchange {
        let members = &self.shared.members;
        let key = op.key().cloned();
        let mut attempts = Attempts {
            backoff: Backoff::default(),
            avoid: None,
            redirects: 0,
            answered: false,
        };
        let mut addr = members.route(key.as_deref());
        // Bounded: every pass either ends, sleeps a backoff, or counts a redirect.
        loop {
            if Instant::now() >= deadline {
                let established = attempts.answered;
                return Exchange::Unsent { established };
            }
            let pool = match members.pool(addr) {
                Ok(Some(pool)) => pool,
                Ok(None) => {
                    attempts.backoff.sleep(deadline);
                    addr = members.next_member_except(Some(addr));
                    continue;
                }
                Err(error) => {
                    log::warn!("cannot start a session pool for {addr}: {error}");
                    attempts.backoff.sleep(deadline);
                    addr = members.next_member_except(Some(addr));
                    continue;
                }
            };
            let session = match pool.pick(attempts.avoid) {
                Ok(session) => session,
                Err(error) => {
                    log::warn!("cannot start a session: {error}");
                    attempts.backoff.sleep(deadline);
                    continue;
                }
            };
            let outcome = self.attempt(&session, &op, deadline);
            match attempts.next(outcome, session.id(), addr, members, key.as_ref(), deadline) {
                Next::Done(exchange) => return exchange,
                Next::Retry(next) => addr = next,
            }
        }
    }

    /// Submits the call to `session` and waits for its outcome; `None` when the session
    /// would not take it (so it was not sent).
    fn attempt(
        &self,
        session: &super::session::Session,
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
    /// What one attempt at `addr` on session `session` means for the request.
    fn next(
        &mut self,
        outcome: Option<Result<Outcome, RecvTimeoutError>>,
        session: u64,
        addr: std::net::SocketAddr,
        members: &Members,
        key: Option<&std::sync::Arc<str>>,
        deadline: Instant,
    ) -> Next {
        let outcome = match outcome {
            None => Outcome::NotSent,
            Some(Ok(outcome)) => outcome,
            Some(Err(RecvTimeoutError::Timeout | RecvTimeoutError::Disconnected)) => {
                log::error!("session {session} gave no outcome");
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
            } => Next::Done(Exchange::Answer {
                response,
                sent_at,
                read_at,
            }),
            Outcome::Expired { established } => Next::Done(Exchange::Unsent {
                established: established || self.answered,
            }),
            // Retrying would meet the same TLS refusal: unavailable now.
            Outcome::Unreachable => Next::Done(Exchange::Unsent {
                established: self.answered,
            }),
            Outcome::NotSent => {
                self.avoid = Some(session);
                members.forget(key.map(|key| &**key), addr);
                self.backoff.sleep(deadline);
                Next::Retry(members.next_member_except(Some(addr)))
            }
            Outcome::Indeterminate => {
                // Never resent; but the key's next request tries elsewhere first.
                members.forget(key.map(|key| &**key), addr);
                Next::Done(Exchange::Indeterminate)
            }
        }
    }

    /// `addr` answered `M` naming `leader` (or none): where the request goes next.
    fn redirected(
        &mut self,
        leader: Option<std::net::SocketAddr>,
        addr: std::net::SocketAddr,
        members: &Members,
        key: Option<&std::sync::Arc<str>>,
        deadline: Instant,
    ) -> Next {
        self.answered = true;
        self.redirects += 1;
        if self.redirects > REDIRECTS_MAX {
            log::warn!("{REDIRECTS_MAX} redirects followed without an answer: giving up");
            return Next::Done(Exchange::Unsent { established: true });
        }
        self.avoid = None;
        match leader {
            Some(leader) if leader != addr => {
                members.learn(key, leader);
                Next::Retry(leader)
            }
            // No leader known, or this member names itself: wait for the election.
            _ => {
                members.forget(key.map(|key| &**key), addr);
                self.backoff.next = self.backoff.next.max(BACKOFF_MIN);
                self.backoff.sleep(deadline);
                Next::Retry(members.next_member_except(Some(addr)))
            }
        }
    }
}

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
