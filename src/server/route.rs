//! Which core owns a key, and the messages cores send each other.
//!
//! [`partition_of`] is a pure function of the key bytes and the core count, so every core
//! agrees on the owner without sharing anything. A request whose key belongs to another core
//! travels as a [`Msg`] (its key copied once into the message, inline when short); the answer
//! travels back the same way. Each destination has an [`Outbox`]: messages are queued during a
//! loop iteration and flushed at its end with one `Waker::wake` per destination at most. A
//! bounded channel that is full never blocks a core: the rest of the outbox waits for the next
//! iteration, in order.
//!
//! Ordering: one channel per (source, destination) pair in effect (crossbeam keeps each
//! sender's messages in order), so requests of one session for one key reach the partition in
//! the order sent, and the answers come back in the order produced.

use crate::lock_table::{Answer, KeyBytes, SessionId};
use crate::protocol::Request;
use crossbeam_channel::{Sender, TrySendError};
use mio::Waker;
use std::collections::VecDeque;
use std::sync::Arc;

/// Messages a core's inbox holds at most; past that, senders keep messages in their outbox.
pub const CHANNEL_DEPTH: usize = 65_536;

/// The core (partition) that owns `key` among `cores`: FNV-1a, a murmur3 finalizer (FNV's high
/// bits are poorly mixed for short keys), then a multiply-shift range reduction. Stable across
/// runs and builds: every core must agree, and a benchmark must be repeatable.
pub fn partition_of(key: &[u8], cores: usize) -> usize {
    if cores <= 1 {
        return 0;
    }
    let mut hash: u64 = 0xcbf2_9ce4_8422_2325;
    for &byte in key {
        hash ^= u64::from(byte);
        hash = hash.wrapping_mul(0x0000_0100_0000_01b3);
    }
    hash ^= hash >> 33;
    hash = hash.wrapping_mul(0xff51_afd7_ed55_8ccd);
    hash ^= hash >> 33;
    hash = hash.wrapping_mul(0xc4ce_b9fe_1a85_ec53);
    hash ^= hash >> 33;
    ((u128::from(hash) * cores as u128) >> 64) as usize
}

/// A request without its key: the fixed fields of the frame.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RemoteOp {
    /// See [`Request::Acquire`].
    Acquire {
        /// Seconds the acquire may queue.
        wait_s: u8,
        /// Seconds of lease.
        lease_s: u8,
        /// Correlation id.
        owner: u64,
    },
    /// See [`Request::Release`].
    Release {
        /// Token named by the request.
        token: u64,
    },
    /// See [`Request::Extend`].
    Extend {
        /// Seconds of lease.
        lease_s: u8,
        /// Token named by the request.
        token: u64,
    },
    /// See [`Request::Cancel`].
    Cancel {
        /// Owner to withdraw.
        owner: u64,
    },
    /// See [`Request::Query`].
    Query {
        /// Correlation id.
        nonce: u64,
    },
}

impl RemoteOp {
    /// The fixed fields of a keyed request; `None` for Ping.
    pub fn of(request: &Request<'_>) -> Option<RemoteOp> {
        Some(match *request {
            Request::Acquire {
                wait_s,
                lease_s,
                owner,
                ..
            } => RemoteOp::Acquire {
                wait_s,
                lease_s,
                owner,
            },
            Request::Release { token, .. } => RemoteOp::Release { token },
            Request::Extend { lease_s, token, .. } => RemoteOp::Extend { lease_s, token },
            Request::Cancel { owner, .. } => RemoteOp::Cancel { owner },
            Request::Query { nonce, .. } => RemoteOp::Query { nonce },
            Request::Ping { .. } => return None,
        })
    }

    /// The request again, borrowing `key`.
    pub fn with_key<'a>(&self, key: &'a [u8]) -> Request<'a> {
        match *self {
            RemoteOp::Acquire {
                wait_s,
                lease_s,
                owner,
            } => Request::Acquire {
                wait_s,
                lease_s,
                owner,
                key,
            },
            RemoteOp::Release { token } => Request::Release { token, key },
            RemoteOp::Extend { lease_s, token } => Request::Extend {
                lease_s,
                token,
                key,
            },
            RemoteOp::Cancel { owner } => Request::Cancel { owner, key },
            RemoteOp::Query { nonce } => Request::Query { nonce, key },
        }
    }

    /// Whether the partition will send exactly one answer for this request (Cancel: none).
    pub fn expects_answer(&self) -> bool {
        !matches!(self, RemoteOp::Cancel { .. })
    }
}

/// A message between cores.
#[derive(Debug)]
pub enum Msg {
    /// A request for the destination's partition from a session of the source core.
    Request {
        /// The requesting session.
        session: SessionId,
        /// The request's fixed fields.
        op: RemoteOp,
        /// The key, copied once out of the session's read buffer.
        key: KeyBytes,
    },
    /// An answer from the source's partition for a session of the destination core.
    Answer {
        /// The answer.
        answer: Answer,
        /// For `Acquired`: the key, so a grant to a session found closed can be released.
        key: Option<KeyBytes>,
    },
    /// The session ended: withdraw its waiters, then acknowledge.
    SessionClosed {
        /// The session.
        session: SessionId,
    },
    /// The partition has withdrawn the session's waiters; no answer for it follows.
    ClosedAck {
        /// The session.
        session: SessionId,
    },
    /// A grant reached a session that had already closed: release it at once.
    OrphanRelease {
        /// The granted token.
        token: u64,
        /// The key.
        key: KeyBytes,
    },
}

/// The way to one other core: its channel, its waker, and what waits to be sent.
pub struct Outbox {
    sender: Sender<Msg>,
    waker: Arc<Waker>,
    queued: VecDeque<Msg>,
}

impl Outbox {
    /// An empty outbox towards a core.
    pub fn new(sender: Sender<Msg>, waker: Arc<Waker>) -> Outbox {
        Outbox {
            sender,
            waker,
            queued: VecDeque::new(),
        }
    }

    /// Queues a message; it is sent at the next [`flush`](Self::flush).
    pub fn push(&mut self, msg: Msg) {
        self.queued.push_back(msg);
    }

    /// Whether nothing waits to be sent.
    pub fn is_empty(&self) -> bool {
        self.queued.is_empty()
    }

    /// Sends what the channel takes, in order, and wakes the destination once if anything
    /// was sent. Returns false when the destination is gone (its core stopped).
    pub fn flush(&mut self) -> bool {
        let mut sent = false;
        while let Some(msg) = self.queued.pop_front() {
            match self.sender.try_send(msg) {
                Ok(()) => sent = true,
                Err(TrySendError::Full(msg)) => {
                    self.queued.push_front(msg);
                    break;
                }
                Err(TrySendError::Disconnected(_)) => {
                    self.queued.clear();
                    return false;
                }
            }
        }
        if sent {
            // A failed wake means the destination's poll is gone; its channel says so too.
            let _ = self.waker.wake();
        }
        true
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn partition_is_stable_and_in_range() {
        for cores in 1..9 {
            for i in 0..1000u32 {
                let key = format!("key-{i}");
                let p = partition_of(key.as_bytes(), cores);
                assert!(p < cores);
                assert_eq!(p, partition_of(key.as_bytes(), cores));
            }
        }
        // Fixed values: a change here would route keys differently after an upgrade.
        assert_eq!(partition_of(b"a", 2), 1);
        assert_eq!(partition_of(b"key-1", 4), 2);
        assert_eq!(partition_of(b"orders/42", 3), 0);
        assert_eq!(partition_of(b"k1", 2), 0);
        let spread: Vec<usize> = (0..1000u32)
            .map(|i| partition_of(format!("k{i}").as_bytes(), 4))
            .fold(vec![0; 4], |mut counts, p| {
                counts[p] += 1;
                counts
            });
        assert!(spread.iter().all(|&n| n > 150), "uneven spread {spread:?}");
    }

    #[test]
    fn remote_op_round_trips() {
        let key = b"k";
        let requests = [
            Request::Acquire {
                wait_s: 1,
                lease_s: 2,
                owner: 3,
                key,
            },
            Request::Release { token: 4, key },
            Request::Extend {
                lease_s: 5,
                token: 6,
                key,
            },
            Request::Cancel { owner: 7, key },
            Request::Query { nonce: 8, key },
        ];
        for request in requests {
            let op = RemoteOp::of(&request).unwrap();
            assert_eq!(op.with_key(key), request);
        }
        assert!(RemoteOp::of(&Request::Ping { nonce: 1 }).is_none());
    }
}
