//! The results a caller can get back that are not a lock: argument errors found before anything
//! is sent, the non-`Acquired` results of docs/protocol.md §4.1, and the failures of the small
//! requests (release, extend, query, ping); and [`SessionFailure`], why a session ended, which
//! the client remembers so that a message can name the address and the cause.
//!
//! Every variant says whether the request may have reached the server: that is the one fact a
//! caller needs to decide what to do next. Deliberately not here: retry policy (the client
//! already retried everything that was definitely not sent, see [`super`]).

use std::fmt;
use std::net::SocketAddr;

use crate::protocol::ErrorCode;

/// How a session failure begins when a TLS server answered the plaintext handshake ping with a
/// TLS record (an alert): the client must speak TLS, trusting the server's CA. The same words in
/// every client and command (the `latchkey` commands and the Python client add how to give the
/// CA), so that a person meets one message wherever they made the mistake.
pub const SPEAKS_TLS: &str = "the server speaks TLS (it answered with a TLS record)";

/// Why a session to a server ended without the client ending it, as
/// [`Client::last_session_failure`](super::Client::last_session_failure) reports it: the
/// address and the cause, for messages to a person (`127.0.0.1:7420: cannot connect:
/// connection refused`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SessionFailure {
    addr: SocketAddr,
    cause: String,
    connected: bool,
    refused: bool,
}

impl SessionFailure {
    pub(crate) fn new(addr: SocketAddr, cause: String, connected: bool) -> SessionFailure {
        SessionFailure {
            addr,
            cause,
            connected,
            refused: false,
        }
    }

    /// The same failure, saying whether the TCP connection was refused.
    pub(crate) fn with_refused(self, refused: bool) -> SessionFailure {
        SessionFailure { refused, ..self }
    }

    /// The server address of the session.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// Why it ended, in words.
    pub fn cause(&self) -> &str {
        &self.cause
    }

    /// Whether the connection had been established. A session that never connected sent
    /// nothing, so the calls it held are tried again on another session until their deadline.
    pub fn connected(&self) -> bool {
        self.connected
    }

    /// Whether the TCP connection was refused: nothing listens at the address (a server that is
    /// down, or restarting). Unless [`ClientConfig::retry_refused`](super::ClientConfig) is
    /// set, a call ends at once when every listed address refused it.
    pub fn refused(&self) -> bool {
        self.refused
    }
}

impl fmt::Display for SessionFailure {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}: {}", self.addr, self.cause)
    }
}

/// An argument the client refused before sending anything.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ArgumentError {
    /// The key is empty.
    KeyEmpty,
    /// The key is longer than [`crate::protocol::KEY_BYTES_MAX`] bytes.
    KeyTooLong,
    /// The key contains a newline, which the wire format uses to end it.
    KeyContainsNewline,
    /// The wait, rounded up to whole milliseconds, is more than 255 s.
    WaitTooLong,
    /// The lease is zero.
    LeaseZero,
    /// The lease, rounded up to whole seconds, is more than 255 s.
    LeaseTooLong,
}

impl fmt::Display for ArgumentError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            ArgumentError::KeyEmpty => "the key is empty",
            ArgumentError::KeyTooLong => "the key is longer than 1024 bytes",
            ArgumentError::KeyContainsNewline => "the key contains a newline",
            ArgumentError::WaitTooLong => "the wait is longer than 255 s",
            ArgumentError::LeaseZero => "the lease is zero",
            ArgumentError::LeaseTooLong => "the lease is longer than 255 s",
        })
    }
}

impl std::error::Error for ArgumentError {}

/// Why [`Client::acquire`](super::Client::acquire) did not return a ticket (docs/protocol.md §4.1).
///
/// All variants but [`Indeterminate`](AcquireError::Indeterminate) are definitive: nothing of
/// the call is left on the server.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum AcquireError {
    /// The server answered `T` (the wait ran out or the call was cancelled at its deadline), or
    /// a session was up but the request had not been handed to it when the deadline passed.
    Timeout,
    /// The server answered `B`: a capacity limit, or the server is shutting down.
    Busy,
    /// The server refused the request with `X` and this code.
    Rejected(ErrorCode),
    /// No server could take the request before the deadline: no session was established,
    /// every session failed or stalled before any byte of the request was handed to it, or
    /// the cluster members that answered knew no leader for the key (or named one that could
    /// not be reached). The request was never sent and nothing was executed;
    /// [`Client::last_unavailable`](super::Client::last_unavailable) says what each member
    /// did.
    Unavailable,
    /// The request may have reached the server and no definitive answer was delivered. The
    /// caller does not hold the lock; a grant it did not observe is recovered at the latest
    /// when its lease expires (and usually at once: the client sends a compensating release
    /// whenever it learns the token).
    Indeterminate,
    /// An argument was refused before anything was sent.
    InvalidArgument(ArgumentError),
}

impl AcquireError {
    /// Whether the result is final: nothing of this call is left on the server.
    pub fn is_definitive(&self) -> bool {
        !matches!(self, AcquireError::Indeterminate)
    }
}

impl fmt::Display for AcquireError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            AcquireError::Timeout => f.write_str("timed out waiting for the lock"),
            AcquireError::Busy => f.write_str("the server is busy (capacity or shutdown)"),
            AcquireError::Rejected(code) => write!(f, "the server rejected the request: {code}"),
            AcquireError::Unavailable => f.write_str(
                "no server could take the request before the deadline; nothing was sent",
            ),
            AcquireError::Indeterminate => {
                f.write_str("the outcome is unknown (the request may have reached the server)")
            }
            AcquireError::InvalidArgument(error) => write!(f, "invalid argument: {error}"),
        }
    }
}

impl std::error::Error for AcquireError {}

impl From<ArgumentError> for AcquireError {
    fn from(error: ArgumentError) -> Self {
        AcquireError::InvalidArgument(error)
    }
}

/// Why a release, extend, query or ping got no answer.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RequestError {
    /// The request was never sent: no server could take it before its transport deadline
    /// (as for [`AcquireError::Unavailable`]; see
    /// [`Client::last_unavailable`](super::Client::last_unavailable)).
    Unavailable,
    /// The request may have reached the server, and no answer came within the transport
    /// timeout (or its session failed).
    NoAnswer,
    /// The server refused the request with `X` and this code.
    Rejected(ErrorCode),
    /// An argument was refused before anything was sent.
    InvalidArgument(ArgumentError),
}

impl fmt::Display for RequestError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            RequestError::Unavailable => f.write_str(
                "no server could take the request before the deadline; nothing was sent",
            ),
            RequestError::NoAnswer => f.write_str("no answer from the server"),
            RequestError::Rejected(code) => write!(f, "the server rejected the request: {code}"),
            RequestError::InvalidArgument(error) => write!(f, "invalid argument: {error}"),
        }
    }
}

impl std::error::Error for RequestError {}

impl From<ArgumentError> for RequestError {
    fn from(error: ArgumentError) -> Self {
        RequestError::InvalidArgument(error)
    }
}
