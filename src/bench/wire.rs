//! One interface over the two dialects the harness speaks, and the latchkey dialect itself.
//!
//! A [`Wire`] turns the workload's verbs (acquire, release, and for `hold` a query of the
//! lease left) into request bytes and turns
//! answer bytes back into an [`Answer`] with the correlation id the workload matches against
//! its slots. The latchkey dialect is a thin adapter over [`latchkey_client::protocol`]: framing is never
//! re-implemented here. Answers to pipelined latchkey requests may come back in any order, so
//! they carry no slot hint; Redis answers in order, so its dialect knows the slot.
//!
//! Invariants: `encode_*` only appends to the caller's buffer (which is sized for the pipeline,
//! so it does not grow); `parse` never consumes a partial frame.
//!
//! Deliberately not here: sockets, timing, or what an answer means to a workload.

use std::fmt;

use latchkey_client::protocol::{self, Request, Response, ResponseError};

use super::redis::RespError;

/// Bytes of every key name the harness uses.
pub const KEY_BYTES: usize = 16;

/// A key name: a workload prefix, a per-run tag and 12 decimal digits (16 bytes, valid UTF-8,
/// no `\n`). The tag keeps a run clear of keys an interrupted earlier run may still hold.
pub fn key_name(prefix: u8, tag: [u8; 3], index: u64) -> [u8; KEY_BYTES] {
    let mut name = [b'0'; KEY_BYTES];
    name[0] = prefix;
    name[1..4].copy_from_slice(&tag);
    let mut rest = index;
    for byte in name[4..].iter_mut().rev() {
        *byte = b'0' + (rest % 10) as u8;
        rest /= 10;
    }
    debug_assert_eq!(rest, 0, "key index {index} has more than 12 digits");
    name
}

/// An answer in the workload's terms. Redis answers are mapped onto the latchkey letters.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Answer {
    /// `A` (Redis `+OK` to `SET NX`): the acquire of `owner` holds the key with `token`.
    Granted {
        /// Correlation id of the acquire.
        owner: u64,
        /// Token to release with (Redis: the owner value itself).
        token: u64,
    },
    /// `T` (Redis: `SET NX` found the key held).
    Timeout {
        /// Correlation id of the acquire.
        owner: u64,
    },
    /// `B`: refused for capacity (no Redis equivalent).
    Busy {
        /// Correlation id of the acquire.
        owner: u64,
    },
    /// `R` (Redis: the script deleted the key).
    Released {
        /// The released token.
        token: u64,
    },
    /// `N` (Redis: the script found another value or no key).
    NotHeld {
        /// The token named by the release.
        token: u64,
    },
    /// `Q` (Redis: `PTTL`): what is left of a key's lease, `None` when the key is free.
    Remaining {
        /// Correlation id of the query.
        nonce: u64,
        /// Whole milliseconds left on the lease, rounded down.
        lease_ms: Option<u32>,
    },
    /// `X` (Redis: an error reply).
    Refused {
        /// Correlation id of the refused request (latchkey: 0 for codes 1 and 7).
        id: u64,
        /// The `X` code (Redis: 0).
        code: u8,
    },
    /// `M` (latchkey cluster members only): the request had no effect; `leader` leads its
    /// key, or `None` when the member knows no leader.
    Moved {
        /// Correlation id of the request (owner, token or nonce).
        id: u64,
        /// The member the answering one believes leads the key.
        leader: Option<std::net::SocketAddr>,
    },
}

/// An answer and, when the dialect knows it, the slot it belongs to.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Reply {
    /// What the server said.
    pub answer: Answer,
    /// The slot, for dialects that answer in order.
    pub slot: Option<u16>,
}

/// Bytes the harness could not make sense of: the connection can no longer be trusted.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum WireError {
    /// A latchkey response frame that does not parse.
    Frame(ResponseError),
    /// A latchkey response the harness never asks for (`E`, `P`).
    UnaskedOp(u8),
    /// A RESP reply that does not parse.
    Resp(RespError),
    /// A RESP reply of a type the command never returns.
    UnexpectedReply(u8),
    /// A reply with no request outstanding.
    Unsolicited,
}

impl fmt::Display for WireError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            WireError::Frame(error) => write!(f, "bad response frame: {error}"),
            WireError::UnaskedOp(op) => write!(f, "response `{}` to no request sent", *op as char),
            WireError::Resp(error) => write!(f, "bad RESP reply: {error}"),
            WireError::UnexpectedReply(kind) => {
                write!(
                    f,
                    "RESP reply of type `{}` to a command that never returns it",
                    *kind as char
                )
            }
            WireError::Unsolicited => write!(f, "a reply with no request outstanding"),
        }
    }
}

/// The result of one parse attempt: `Ok(None)` while the frame is incomplete.
pub type ParseOutcome = Result<Option<(Reply, usize)>, WireError>;

/// A server dialect. One value per connection: it may keep per-connection state (Redis keeps
/// the order of outstanding requests).
pub trait Wire {
    /// Appends an acquire of `key` for `owner` (queueing at most `wait_s` seconds where the
    /// server queues) on behalf of `slot`.
    fn encode_acquire(&mut self, out: &mut Vec<u8>, slot: u16, key: &[u8], owner: u64, wait_s: u8);
    /// Appends a release of `key` held with `token` on behalf of `slot`.
    fn encode_release(&mut self, out: &mut Vec<u8>, slot: u16, key: &[u8], token: u64);
    /// Appends a query of what is left of `key`'s lease, correlated by `nonce`.
    fn encode_query(&mut self, out: &mut Vec<u8>, slot: u16, key: &[u8], nonce: u64);
    /// Parses the first answer in `buf`.
    fn parse(&mut self, buf: &[u8]) -> ParseOutcome;
    /// The text of the first error reply seen, if the dialect has one (Redis error strings).
    fn first_error_text(&self) -> Option<&str> {
        None
    }
}

/// The latchkey dialect, by [`latchkey_client::protocol`].
#[derive(Clone, Copy, Debug)]
pub struct LatchkeyWire {
    lease_s: u8,
}

impl LatchkeyWire {
    /// A dialect that asks for leases of `lease_s` seconds (1..=255).
    pub fn new(lease_s: u8) -> LatchkeyWire {
        debug_assert!(lease_s >= 1);
        LatchkeyWire { lease_s }
    }
}

impl Wire for LatchkeyWire {
    fn encode_acquire(
        &mut self,
        out: &mut Vec<u8>,
        _slot: u16,
        key: &[u8],
        owner: u64,
        wait_s: u8,
    ) {
        Request::Acquire {
            wait_s,
            lease_s: self.lease_s,
            owner,
            key,
        }
        .encode(out);
    }

    fn encode_release(&mut self, out: &mut Vec<u8>, _slot: u16, key: &[u8], token: u64) {
        Request::Release { token, key }.encode(out);
    }

    fn encode_query(&mut self, out: &mut Vec<u8>, _slot: u16, key: &[u8], nonce: u64) {
        Request::Query { nonce, key }.encode(out);
    }

    fn parse(&mut self, buf: &[u8]) -> ParseOutcome {
        let Some((response, used)) = protocol::parse_response(buf).map_err(WireError::Frame)?
        else {
            return Ok(None);
        };
        let answer = match response {
            Response::Acquired { owner, token } => Answer::Granted { owner, token },
            Response::Timeout { owner } => Answer::Timeout { owner },
            Response::Busy { owner } => Answer::Busy { owner },
            Response::Released { token } => Answer::Released { token },
            Response::NotHeld { token } => Answer::NotHeld { token },
            Response::Error { code, id } => Answer::Refused {
                id,
                code: code as u8,
            },
            Response::State {
                nonce,
                held,
                lease_ms,
                ..
            } => Answer::Remaining {
                nonce,
                lease_ms: held.then_some(lease_ms),
            },
            Response::Extended { .. }
            | Response::Pong { .. }
            | Response::Identified { .. }
            | Response::Resolved { .. } => return Err(WireError::UnaskedOp(response.op())),
            Response::Moved { id, leader } => Answer::Moved {
                id,
                leader: leader.addr(),
            },
        };
        Ok(Some((Reply { answer, slot: None }, used)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use latchkey_client::protocol::{parse_request, ErrorCode, KEY_BYTES_MAX};

    #[test]
    fn key_names_are_sixteen_bytes_of_digits() {
        let name = key_name(b'u', *b"a0z", 42);
        assert_eq!(&name, b"ua0z000000000042");
        assert_eq!(
            &key_name(b'h', *b"xyz", 999_999_999_999),
            b"hxyz999999999999"
        );
    }

    #[test]
    fn latchkey_requests_use_the_codec() {
        let mut wire = LatchkeyWire::new(30);
        let mut out = Vec::new();
        wire.encode_acquire(&mut out, 3, b"k1", 77, 5);
        wire.encode_release(&mut out, 3, b"k1", 99);
        let (first, used) = parse_request(&out, KEY_BYTES_MAX).unwrap().unwrap();
        assert_eq!(
            first,
            Request::Acquire {
                wait_s: 5,
                lease_s: 30,
                owner: 77,
                key: b"k1"
            }
        );
        let (second, _) = parse_request(&out[used..], KEY_BYTES_MAX).unwrap().unwrap();
        assert_eq!(
            second,
            Request::Release {
                token: 99,
                key: b"k1"
            }
        );
    }

    #[test]
    fn latchkey_answers_map_and_split_frames_wait() {
        let mut wire = LatchkeyWire::new(30);
        let mut bytes = Vec::new();
        Response::Acquired { owner: 5, token: 9 }.encode(&mut bytes);
        Response::Error {
            code: ErrorCode::EmptyKey,
            id: 5,
        }
        .encode(&mut bytes);
        assert_eq!(wire.parse(&bytes[..17]), Ok(None));
        let (reply, used) = wire.parse(&bytes).unwrap().unwrap();
        assert_eq!(
            reply,
            Reply {
                answer: Answer::Granted { owner: 5, token: 9 },
                slot: None
            }
        );
        let (reply, _) = wire.parse(&bytes[used..]).unwrap().unwrap();
        assert_eq!(reply.answer, Answer::Refused { id: 5, code: 3 });
    }

    #[test]
    fn latchkey_queries_report_the_lease_left() {
        let mut wire = LatchkeyWire::new(30);
        let mut out = Vec::new();
        wire.encode_query(&mut out, 3, b"k1", 12);
        let (request, _) = parse_request(&out, KEY_BYTES_MAX).unwrap().unwrap();
        assert_eq!(
            request,
            Request::Query {
                nonce: 12,
                key: b"k1"
            }
        );
        for (held, expected) in [(true, Some(1234)), (false, None)] {
            let mut bytes = Vec::new();
            let state = Response::State {
                nonce: 8,
                held,
                lease_ms: 1234,
                waiters: 1,
            };
            state.encode(&mut bytes);
            let (reply, _) = wire.parse(&bytes).unwrap().unwrap();
            assert_eq!(
                reply.answer,
                Answer::Remaining {
                    nonce: 8,
                    lease_ms: expected
                }
            );
        }
    }

    #[test]
    fn latchkey_moved_names_the_leader_or_none() {
        let mut wire = LatchkeyWire::new(30);
        let leader: std::net::SocketAddr = "10.0.0.3:7420".parse().unwrap();
        for (named, expected) in [
            (latchkey_client::protocol::Leader::at(leader), Some(leader)),
            (latchkey_client::protocol::Leader::UNKNOWN, None),
        ] {
            let mut bytes = Vec::new();
            Response::Moved {
                id: 9,
                leader: named,
            }
            .encode(&mut bytes);
            let (reply, used) = wire.parse(&bytes).unwrap().unwrap();
            assert_eq!(used, bytes.len());
            assert_eq!(
                reply.answer,
                Answer::Moved {
                    id: 9,
                    leader: expected
                }
            );
        }
    }

    #[test]
    fn latchkey_unasked_answers_are_errors() {
        let mut wire = LatchkeyWire::new(30);
        let mut bytes = Vec::new();
        Response::Pong { nonce: 1 }.encode(&mut bytes);
        assert_eq!(wire.parse(&bytes), Err(WireError::UnaskedOp(b'P')));
        assert!(matches!(wire.parse(b"Z"), Err(WireError::Frame(_))));
    }
}
