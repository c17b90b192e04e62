//! [`Ticket`]: proof of a grant, with its fencing token and a local validity bound.
//!
//! The token is the authority: a caller passes it to every resource the lock protects, which
//! rejects writes carrying an older token. The validity bound (PROTOCOL.md §4.5) is advice:
//! the instant the `A` was read plus the lease, minus a margin of max(100 ms, lease / 10);
//! after a confirmed Extend it counts from the instant that Extend was handed to the socket.
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
/// use latchkey::client::{ExtendOutcome, ReleaseOutcome};
/// # let mut config = latchkey::config::Config::default();
/// # config.server.listen = "127.0.0.1:0".parse().unwrap();
/// # config.server.cores = 1;
/// # let server = latchkey::server::start(config)?;
/// # let client = latchkey::client::Client::connect(server.local_addr())?;
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
    valid_until: Mutex<Instant>,
    released: bool,
}

impl Ticket {
    pub(crate) fn new(
        client: Client,
        key: Arc<str>,
        token: u64,
        lease_s: u8,
        read_at: Instant,
    ) -> Ticket {
        let valid_until = Mutex::new(valid_until(read_at, lease_s));
        Ticket {
            client,
            key,
            token,
            valid_until,
            released: false,
        }
    }

    /// The key this ticket holds.
    pub fn key(&self) -> &str {
        &self.key
    }

    /// The fencing token: pass it to every resource the lock protects.
    pub fn token(&self) -> u64 {
        self.token
    }

    /// The local bound until which the hold is believed valid (PROTOCOL.md §4.5).
    pub fn valid_until(&self) -> Instant {
        *self.valid_until.lock()
    }

    /// Whether the local validity bound has not passed yet.
    pub fn is_valid(&self) -> bool {
        Instant::now() < self.valid_until()
    }

    /// Renews the lease to `lease` (rounded up to whole seconds) from now.
    ///
    /// On [`ExtendOutcome::Extended`] the validity bound counts from the instant the Extend
    /// was handed to the socket. On [`ExtendOutcome::NotHeld`] the lock is lost and the bound
    /// is moved to the past.
    pub fn extend(&self, lease: Duration) -> Result<ExtendOutcome, RequestError> {
        let lease_s = lease_s(lease)?;
        let op = Op::Extend {
            key: Arc::clone(&self.key),
            lease_s,
            token: self.token,
        };
        match self.client.exchange_small(op)? {
            (Response::Extended { .. }, sent_at) => {
                let mut bound = self.valid_until.lock();
                *bound = (*bound).max(valid_until(sent_at, lease_s));
                Ok(ExtendOutcome::Extended)
            }
            (Response::NotHeld { .. }, sent_at) => {
                let mut bound = self.valid_until.lock();
                *bound = (*bound).min(sent_at);
                Ok(ExtendOutcome::NotHeld)
            }
            (response, _) => Err(unexpected(response)),
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
        match self.exchange(op, deadline) {
            Exchange::Answer {
                response: Response::Error { code, .. },
                ..
            } => Err(RequestError::Rejected(code)),
            Exchange::Answer {
                response, sent_at, ..
            } => Ok((response, sent_at)),
            Exchange::Unsent { .. } => Err(RequestError::Unavailable),
            Exchange::Indeterminate => Err(RequestError::NoAnswer),
        }
    }
}
