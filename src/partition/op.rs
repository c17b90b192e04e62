//! [`Op`]: a keyed request without its key, the unit a partition executes.
//!
//! The parser produces [`Request`]s borrowing their key from a read buffer. A request for a
//! partition is that request's fixed fields plus its key: executed at once when the partition
//! is local, or sent to another core with a copy of the key. Ping and Identify name no key and
//! are never a partition's business: the core answers them.

use latchkey_client::protocol::Request;

/// The fixed fields of a keyed request.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Op {
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
    /// See [`Request::Resolve`] (an identified session's only).
    Resolve {
        /// The owner whose acquire is asked about.
        owner: u64,
    },
}

impl Op {
    /// A keyed request's fixed fields and its key; `None` for Ping.
    pub fn of<'a>(request: &Request<'a>) -> Option<(Op, &'a [u8])> {
        Some(match *request {
            Request::Acquire {
                wait_s,
                lease_s,
                owner,
                key,
            } => (
                Op::Acquire {
                    wait_s,
                    lease_s,
                    owner,
                },
                key,
            ),
            Request::Release { token, key } => (Op::Release { token }, key),
            Request::Extend {
                lease_s,
                token,
                key,
            } => (Op::Extend { lease_s, token }, key),
            Request::Cancel { owner, key } => (Op::Cancel { owner }, key),
            Request::Query { nonce, key } => (Op::Query { nonce }, key),
            Request::Resolve { owner, key } => (Op::Resolve { owner }, key),
            Request::Ping { .. } | Request::Identify { .. } => return None,
        })
    }

    /// The request again, borrowing `key`.
    #[cfg(test)]
    pub fn with_key<'a>(&self, key: &'a [u8]) -> Request<'a> {
        match *self {
            Op::Acquire {
                wait_s,
                lease_s,
                owner,
            } => Request::Acquire {
                wait_s,
                lease_s,
                owner,
                key,
            },
            Op::Release { token } => Request::Release { token, key },
            Op::Extend { lease_s, token } => Request::Extend {
                lease_s,
                token,
                key,
            },
            Op::Cancel { owner } => Request::Cancel { owner, key },
            Op::Query { nonce } => Request::Query { nonce, key },
            Op::Resolve { owner } => Request::Resolve { owner, key },
        }
    }

    /// Whether the partition sends exactly one answer for this op (Cancel: none of its own).
    pub fn expects_answer(&self) -> bool {
        !matches!(self, Op::Cancel { .. })
    }

    /// Whether this is an acquire that may queue (its answer may come much later).
    pub fn may_wait(&self) -> bool {
        matches!(self, Op::Acquire { wait_s: 1.., .. })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn op_round_trips() {
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
            let (op, named) = Op::of(&request).unwrap();
            assert_eq!(named, key);
            assert_eq!(op.with_key(key), request);
            assert_eq!(op.expects_answer(), !matches!(op, Op::Cancel { .. }));
        }
        assert!(Op::of(&Request::Ping { nonce: 1 }).is_none());
        assert!(Op::Acquire {
            wait_s: 1,
            lease_s: 1,
            owner: 1
        }
        .may_wait());
        assert!(!Op::Acquire {
            wait_s: 0,
            lease_s: 1,
            owner: 1
        }
        .may_wait());
    }
}
