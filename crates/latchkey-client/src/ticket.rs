//! [`Ticket`]: proof of a grant, with its fencing token and a local validity bound.
//!
//! The token is the authority: a caller passes it to every resource the lock protects, which
//! rejects writes carrying an older token. The validity bound (docs/protocol.md §4.5) is advice:
//! the instant the `A` was read plus the lease, minus a margin of max(100 ms, lease / 10).
//!
//! An Extend sets the server's lease to *its execution time* + its lease, which may be shorter
//! than what was left, so the bound follows the lease wherever the Extend puts it:
//!
//! * while an Extend is unanswered, the bound is the earlier of the old bound and what the
//!   Extend would give counted from the start of the call (which is before its send, and so
//!   before its execution);
//! * after a confirmed Extend, the bound is the instant it was handed to the socket plus its
//!   lease minus its margin, earlier or later than before;
//! * an Extend whose outcome stays unknown may still execute on the server at any later time
//!   (its bytes may be in flight on a session the client gave up), and whenever it does, the
//!   lease becomes that time plus *its* lease. So it keeps the bound at the earlier of the two
//!   for good, and every later confirmed Extend gives at most its send instant plus the
//!   shortest lease of all such unknown Extends (minus that lease's margin): if an unknown one
//!   executes after the confirmed one, it executes after that send instant.
//! * A refused (`X`) or never-sent Extend had no effect: the bound goes back to what it was.
//!
//! Extends of one ticket are serialized: a second thread's `extend` waits until the first
//! has its outcome (at most the transport timeout). That is what makes "the confirmed Extend
//! is the last one that executed, unless an unknown one executes later" true; pipelining two
//! Extends of one token would leave their execution order to the network.
//!
//! Invariants: a ticket releases its hold at most once on purpose (`release`, or in the
//! background when dropped), except that a release that was never sent is tried again in the
//! background. Deliberately not here: renewing the lease on its own (see `latchkey lock`).

use std::fmt;
use std::sync::Arc;
use std::time::{Duration, Instant};

use parking_lot::Mutex;

use super::args::{lease_s, valid_until};
use super::call::Op;
use super::error::RequestError;
use super::{Client, Exchange};
use crate::protocol::Response;

/// What the server said to a release.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ReleaseOutcome {
    /// The hold was released.
    Released,
    /// The token no longer held the key (its lease had run out; another holder may have it).
    NotHeld,
}

/// What the server said to an extend.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ExtendOutcome {
    /// The lease now runs from the Extend; [`Ticket::valid_until`] moved accordingly.
    Extended,
    /// The token no longer holds the key: the lock is lost.
    NotHeld,
}

/// A held lock. Dropping it releases the lock in the background.
///
/// `Ticket` is `Send + Sync`: one thread may extend it while another uses it.
///
/// ```
/// use std::time::{Duration, Instant};
/// use latchkey_client::{ExtendOutcome, ReleaseOutcome};
/// # let mut config = latchkey::config::Config::default();
/// # config.server.listen = "127.0.0.1:0".parse().unwrap();
/// # config.server.cores = 1;
/// # let server = latchkey::node::start(config)?;
/// # let client = latchkey_client::Client::connect(server.local_addr())?;
/// let ticket = client.acquire("k", Duration::from_secs(1), Duration::from_secs(10))?;
/// // The bound is the A's read plus the lease minus max(100 ms, lease / 10).
/// assert!(ticket.valid_until() <= Instant::now() + Duration::from_secs(9));
/// assert_eq!(ticket.extend(Duration::from_secs(20))?, ExtendOutcome::Extended);
/// assert!(ticket.valid_until() > Instant::now() + Duration::from_secs(10));
/// assert_eq!(ticket.release()?, ReleaseOutcome::Released);
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
pub struct Ticket {
    client: Client,
    key: Arc<str>,
    token: u64,
    bound: Mutex<Bound>,
    /// Held for the whole of an `extend`: extends of one ticket never overlap.
    extending: Mutex<()>,
    released: bool,
}

/// The validity bound and what constrains it.
#[derive(Clone, Copy, Debug)]
struct Bound {
    valid_until: Instant,
    /// The shortest lease (seconds) of the Extends whose outcome stayed unknown.
    unknown_lease_s: Option<u8>,
}

impl Bound {
    /// An Extend of `lease_s` may or may not have executed, and may still execute later: the
    /// bound stays the earlier one it already is, and the lease caps later confirmed Extends.
    fn outcome_unknown(&mut self, lease_s: u8) {
        let shortest = self.unknown_lease_s.map_or(lease_s, |s| s.min(lease_s));
        self.unknown_lease_s = Some(shortest);
    }
}

impl Ticket {
    pub(crate) fn new(
        client: Client,
        key: Arc<str>,
        token: u64,
        lease_s: u8,
        read_at: Instant,
    ) -> Ticket {
        let bound = Bound {
            valid_until: valid_until(read_at, lease_s),
            unknown_lease_s: None,
        };
        Ticket {
            client,
            key,
            token,
            bound: Mutex::new(bound),
            extending: Mutex::new(()),
            released: false,
        }
    }

    /// A grant found by a Resolve sent at `sent_at` (docs/protocol.md §5), whose lease had
    /// `lease_left` to run when the server answered: the bound is `sent_at + lease_left` minus
    /// the margin of the whole lease (`lease_s`).
    pub(crate) fn resumed(
        client: Client,
        key: Arc<str>,
        token: u64,
        lease_s: u8,
        sent_at: Instant,
        lease_left: Duration,
    ) -> Ticket {
        let margin = super::args::margin(Duration::from_secs(u64::from(lease_s)));
        let valid_until = (sent_at + lease_left)
            .checked_sub(margin)
            .unwrap_or(sent_at);
        let mut ticket = Ticket::new(client, key, token, lease_s, sent_at);
        ticket.bound.get_mut().valid_until = valid_until;
        ticket
    }

    /// The client this ticket was granted through.
    pub fn client(&self) -> &Client {
        &self.client
    }

    /// The key this ticket holds.
    pub fn key(&self) -> &str {
        &self.key
    }

    /// The fencing token: pass it to every resource the lock protects.
    pub fn token(&self) -> u64 {
        self.token
    }

    /// The local bound until which the hold is believed valid (docs/protocol.md §4.5; see the
    /// module docs for how extends move it).
    pub fn valid_until(&self) -> Instant {
        self.bound.lock().valid_until
    }

    /// Whether the local validity bound has not passed yet.
    pub fn is_valid(&self) -> bool {
        Instant::now() < self.valid_until()
    }

    /// Sets the lease to `lease` (rounded up to whole seconds) from now, which may shorten it.
    ///
    /// While the call runs, [`valid_until`](Self::valid_until) is already the earlier of the
    /// old bound and what this Extend would give. On [`ExtendOutcome::Extended`] the bound
    /// counts from the instant the Extend was handed to the socket, earlier or later than
    /// before (capped by any earlier Extend whose outcome stayed unknown; see the module
    /// docs). On [`ExtendOutcome::NotHeld`] the lock is lost and the bound is moved to the
    /// past. On [`RequestError::NoAnswer`] the outcome is unknown and the bound stays the
    /// earlier of the two; on any other error nothing was executed and the bound is as before.
    ///
    /// Extends of one ticket are serialized: a call made while another thread's extend of
    /// this ticket runs waits for its outcome first.
    pub fn extend(&self, lease: Duration) -> Result<ExtendOutcome, RequestError> {
        let lease_s = lease_s(lease)?;
        let _serialized = self.extending.lock();
        let op = Op::Extend {
            key: Arc::clone(&self.key),
            lease_s,
            token: self.token,
        };
        // Before anything is sent, so no execution of this Extend can precede it.
        let before = {
            let mut bound = self.bound.lock();
            let before = *bound;
            let would_give = valid_until(Instant::now(), lease_s);
            bound.valid_until = before.valid_until.min(would_give);
            before
        };
        let result = self.client.exchange_small(op);
        let mut bound = self.bound.lock();
        match result {
            Ok((Response::Extended { .. }, sent_at)) => {
                let shortest = before.unknown_lease_s.map_or(lease_s, |s| s.min(lease_s));
                bound.valid_until = valid_until(sent_at, shortest);
                Ok(ExtendOutcome::Extended)
            }
            Ok((Response::NotHeld { .. }, sent_at)) => {
                bound.valid_until = bound.valid_until.min(sent_at);
                Ok(ExtendOutcome::NotHeld)
            }
            Ok((response, _)) => {
                bound.outcome_unknown(lease_s);
                Err(unexpected(response))
            }
            Err(RequestError::NoAnswer) => {
                bound.outcome_unknown(lease_s);
                Err(RequestError::NoAnswer)
            }
            Err(error) => {
                // Refused or never sent: it had no effect on the server.
                *bound = before;
                Err(error)
            }
        }
    }

    /// Releases the lock and says whether the server still had it under this token.
    ///
    /// If the Release was never sent (no session), it is tried again in the background when
    /// the ticket is dropped, which this call does.
    pub fn release(mut self) -> Result<ReleaseOutcome, RequestError> {
        let op = Op::Release {
            key: Arc::clone(&self.key),
            token: self.token,
        };
        let result = self.client.exchange_small(op);
        self.released = result != Err(RequestError::Unavailable);
        match result? {
            (Response::Released { .. }, _) => Ok(ReleaseOutcome::Released),
            (Response::NotHeld { .. }, _) => Ok(ReleaseOutcome::NotHeld),
            (response, _) => Err(unexpected(response)),
        }
    }
}

/// A response of the wrong kind for a token: only a broken server sends one.
fn unexpected(response: Response) -> RequestError {
    log::warn!("unexpected answer {response:?} to a token request");
    RequestError::NoAnswer
}

impl Drop for Ticket {
    fn drop(&mut self) {
        if !self.released {
            self.client
                .release_in_background(Arc::clone(&self.key), self.token);
        }
    }
}

impl fmt::Debug for Ticket {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Ticket")
            .field("key", &self.key)
            .field("token", &self.token)
            .field("valid_until", &self.valid_until())
            .finish()
    }
}

impl Client {
    /// Sends a Release, Extend, Query or Ping with the transport timeout as its deadline;
    /// returns the answer and the instant its first byte was handed to the socket.
    pub(crate) fn exchange_small(&self, op: Op) -> Result<(Response, Instant), RequestError> {
        let deadline = Instant::now() + self.config().transport_timeout;
        match self.exchange_hedged(op, deadline) {
            Exchange::Answer {
                response: Response::Error { code, .. },
                ..
            } => Err(RequestError::Rejected(code)),
            Exchange::Answer {
                response, sent_at, ..
            } => Ok((response, sent_at)),
            Exchange::Unsent { .. } => Err(RequestError::Unavailable),
            // Only an acquire is resolved.
            Exchange::Indeterminate | Exchange::NeverSeen => Err(RequestError::NoAnswer),
        }
    }
}
