//! The vocabulary between callers, the pool and a session: a [`Call`] (an [`Op`] with its
//! deadline and reply channel), its single [`Outcome`], and why a session ended
//! ([`CloseReason`]). No I/O, no logic beyond encoding an op.
//!
//! Invariant: a call with a reply channel receives exactly one outcome, from exactly one
//! session; a call given back unsent (`Err(call)` from a submission, or [`Outcome::NotSent`])
//! may be handed to another session with the same owner and deadline.

use std::fmt;
use std::io;
use std::sync::Arc;
use std::time::Instant;

use crossbeam_channel::Sender;

use crate::protocol::{ErrorCode, Request, Response, ResponseError};
use crate::tls::TlsError;
use crate::SPEAKS_TLS;

/// One request as the client wants it sent. Keys are shared with the caller's ticket.
#[derive(Clone, Debug)]
pub(crate) enum Op {
    /// Acquire; `wait_zero` is the single immediate attempt (wire wait 0), else the wire wait
    /// is computed from the call's deadline when the frame is encoded.
    Acquire {
        key: Arc<str>,
        wait_zero: bool,
        lease_s: u8,
        owner: u64,
    },
    /// Release the hold with `token`.
    Release { key: Arc<str>, token: u64 },
    /// Extend the hold with `token` to `lease_s` from now.
    Extend {
        key: Arc<str>,
        lease_s: u8,
        token: u64,
    },
    /// Query the state of `key`.
    Query { key: Arc<str>, nonce: u64 },
    /// Ping.
    Ping { nonce: u64 },
    /// Withdraw the acquire of `owner`; only the pipeline itself creates these.
    Cancel { key: Arc<str>, owner: u64 },
    /// Ask what became of this client's acquire of `key` with `owner`, sent on a session that
    /// failed (docs/protocol.md §5). A `Queued` answer turns the call into that acquire again,
    /// waiting on this session until `wait_deadline` (its own deadline), as if sent here.
    Resolve {
        key: Arc<str>,
        owner: u64,
        wait_zero: bool,
        lease_s: u8,
        wait_deadline: Instant,
    },
}

impl Op {
    /// The key the request names (all but Ping): what routes it to a cluster member.
    pub(crate) fn key(&self) -> Option<&Arc<str>> {
        match self {
            Op::Acquire { key, .. }
            | Op::Release { key, .. }
            | Op::Extend { key, .. }
            | Op::Query { key, .. }
            | Op::Cancel { key, .. }
            | Op::Resolve { key, .. } => Some(key),
            Op::Ping { .. } => None,
        }
    }

    pub(crate) fn request(&self, wait_s: u8) -> Request<'_> {
        match self {
            Op::Acquire {
                key,
                lease_s,
                owner,
                ..
            } => Request::Acquire {
                wait_s,
                lease_s: *lease_s,
                owner: *owner,
                key: key.as_bytes(),
            },
            Op::Release { key, token } => Request::Release {
                token: *token,
                key: key.as_bytes(),
            },
            Op::Extend {
                key,
                lease_s,
                token,
            } => Request::Extend {
                lease_s: *lease_s,
                token: *token,
                key: key.as_bytes(),
            },
            Op::Query { key, nonce } => Request::Query {
                nonce: *nonce,
                key: key.as_bytes(),
            },
            Op::Ping { nonce } => Request::Ping { nonce: *nonce },
            Op::Cancel { key, owner } => Request::Cancel {
                owner: *owner,
                key: key.as_bytes(),
            },
            Op::Resolve { key, owner, .. } => Request::Resolve {
                owner: *owner,
                key: key.as_bytes(),
            },
        }
    }
}

/// What became of a call on this session.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Outcome {
    /// A correlated answer. `sent_at` is when the writer handed the request's first byte to
    /// the socket (read before that write), `read_at` when the answer was read.
    Answer {
        response: Response,
        sent_at: Instant,
        read_at: Instant,
    },
    /// The deadline passed while no byte of the request had been handed to the socket;
    /// `established` says whether the session was connected at that moment.
    Expired { established: bool },
    /// The session ended before any byte of the request was handed to the socket (or it was
    /// refused with `X` code 7): the call may be retried on another session.
    NotSent,
    /// Like `NotSent`, but the session could not be established for a reason another attempt
    /// within this call would not fix (a TLS error in the handshake: an unknown CA, a refused
    /// certificate; or bytes that are not latchkey frames in answer to the handshake ping):
    /// the call fails at once instead of retrying until its deadline.
    Unreachable,
    /// The request may have reached the server and no definitive answer was delivered.
    Indeterminate,
    /// An `A` found late (at or after the deadline, or after the Cancel): a compensating
    /// release of its token went out, and the call ends `Indeterminate` (docs/protocol.md
    /// §4.2) — its fate is known, so it is not resolved.
    Compensated,
}

/// A request with its deadline and where its outcome goes.
#[derive(Debug)]
pub(crate) struct Call {
    /// The request.
    pub op: Op,
    /// The call's deadline: an unsent request is not sent after it.
    pub deadline: Instant,
    /// Where the single outcome goes; `None` for fire-and-forget requests (background
    /// releases), which are handed back by [`Pipeline::finish`](super::pipeline::Pipeline::finish)
    /// when never sent.
    pub reply: Option<Sender<Outcome>>,
    /// How many sessions a fire-and-forget request was already handed back by.
    pub attempts: u8,
}

/// Why a session ended.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) enum CloseReason {
    /// The connection could not be established.
    ConnectFailed(io::ErrorKind),
    /// The connection was not established within the connect timeout.
    ConnectTimeout,
    /// TCP (and TLS) came up, but the handshake ping got no answer within the connect
    /// timeout: a paused or wedged server (the kernel accepts for it from its backlog).
    HandshakeTimeout,
    /// The handshake ping was answered with this op instead of its pong.
    HandshakeAnswer(u8),
    /// The server sent `X` code 7: every request of the session counts as not sent.
    Refused,
    /// The server closed the connection.
    Eof,
    /// The server sent an `X` whose code closes the session (1, 2 or 6; docs/protocol.md §2.3).
    ServerError(ErrorCode),
    /// A socket error.
    Io(io::ErrorKind),
    /// A TLS error (in the handshake or after it): the server's alert or our verifier's
    /// refusal, e.g. an unknown CA, a certificate the server requires or refuses.
    Tls(String),
    /// The server sent bytes that are not a response frame.
    Protocol(ResponseError),
    /// A request's deadline passed while part of it was on the wire.
    DeadlineMidFrame,
    /// A wait-0 acquire, or a cancelled one, got no answer by its transport deadline.
    Unanswered,
    /// An identified session with a waiting acquire on the wire read nothing while an answer
    /// (its probe's, at least) was overdue: a paused server; its acquires are resolved
    /// elsewhere (`pipeline/link.rs`).
    Silent,
    /// The client was dropped.
    Shutdown,
}

impl CloseReason {
    /// A failed read or write: a TLS error (the TLS stream's
    /// [`TlsError`]) or a socket error.
    pub(crate) fn of_io(error: &io::Error) -> CloseReason {
        let tls = error.get_ref().and_then(|e| e.downcast_ref::<TlsError>());
        match tls {
            Some(tls) => CloseReason::Tls(tls.to_string()),
            None => CloseReason::Io(error.kind()),
        }
    }
}

impl fmt::Display for CloseReason {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            CloseReason::ConnectFailed(kind) => write!(f, "cannot connect: {kind}"),
            CloseReason::ConnectTimeout => f.write_str("cannot connect: timed out"),
            CloseReason::HandshakeTimeout => f.write_str(
                "connected, but no answer to a ping within the connect timeout (the server \
                 may be paused or overloaded)",
            ),
            CloseReason::HandshakeAnswer(op) => write!(
                f,
                "not a latchkey server: it answered a ping with `{}`",
                op.escape_ascii()
            ),
            CloseReason::Refused => {
                f.write_str("the server refused the session: it has too many (X 7)")
            }
            CloseReason::Eof => f.write_str("the server closed the connection"),
            CloseReason::ServerError(code) => {
                write!(f, "the server closed the session after error {code}")
            }
            CloseReason::Io(kind) => write!(f, "socket error: {kind}"),
            CloseReason::Tls(message) => f.write_str(message),
            // An alert (21) or a handshake (22): a TLS server's answer to plaintext.
            CloseReason::Protocol(ResponseError::UnknownOp(21 | 22)) => {
                write!(f, "{SPEAKS_TLS}: connect with TLS, trusting its CA")
            }
            CloseReason::Protocol(error) => write!(
                f,
                "not a latchkey server: it answered bytes that are not latchkey frames ({error})"
            ),
            CloseReason::DeadlineMidFrame => f.write_str("deadline passed mid-frame"),
            CloseReason::Unanswered => f.write_str("no answer within the transport timeout"),
            CloseReason::Silent => f.write_str(
                "the server stopped answering (a ping went unanswered) while an acquire waited",
            ),
            CloseReason::Shutdown => f.write_str("client dropped"),
        }
    }
}
