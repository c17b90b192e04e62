//! The wire codec: requests and responses of docs/protocol.md §2, parsed and encoded. No I/O.
//!
//! Every frame is `op`, a fixed binary header whose length depends on `op`, for requests that
//! name a key the key bytes, then `\n`. The fixed header may contain `0x0A`, so the parser
//! consumes it by length first and only then searches for the `\n` that ends the key.
//!
//! Parsing is *check, then parse, in place*: [`parse_request`] borrows the key from the caller's
//! buffer and reports how many bytes the frame used; an incomplete frame is `Ok(None)`, never an
//! error, so a caller may feed bytes split at any offset. Nothing here allocates.
//!
//! Invariants: a parsed [`Request`] always names a key of `1..=key_bytes_max` bytes of valid
//! UTF-8 without `\n`, and an Acquire or Extend always has a lease of at least one second. The
//! parser never reads past the frame it reports.
//!
//! Deliberately not here: what a request *does* (the server's lock table) and any socket.

use std::fmt;
use std::net::{IpAddr, Ipv6Addr, SocketAddr};

/// The longest key the protocol allows, in bytes. A server may be configured lower.
pub const KEY_BYTES_MAX: usize = 1024;
/// The longest fixed header of a request that names a key (Acquire: wait, lease, owner).
pub const REQUEST_HEADER_BYTES_MAX: usize = 10;
/// The longest request frame: op, header, key, `\n` (an Acquire with the longest key; an
/// Identify, the longest frame without a key, is 27 bytes).
pub const REQUEST_BYTES_MAX: usize = 1 + REQUEST_HEADER_BYTES_MAX + KEY_BYTES_MAX + 1;
/// The fixed header of an Identify (docs/protocol.md §5): grace, client id, nonce.
const IDENTIFY_HEADER_BYTES: usize = 1 + 16 + 8;
/// The longest grace an Identify may ask for, in seconds (docs/protocol.md §5).
pub const GRACE_S_MAX: u8 = 60;
const _: () = assert!(IDENTIFY_HEADER_BYTES + 2 <= REQUEST_BYTES_MAX);
/// The longest response frame (Moved: op, id, IPv6 address, port, `\n`; only a cluster member
/// sends it, docs/protocol.md §5).
pub const RESPONSE_BYTES_MAX: usize = 28;

/// A request from a client. Keys borrow from the read buffer.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Request<'a> {
    /// `A`: take the lock, queueing at most `wait_s` seconds, holding at most `lease_s`.
    Acquire {
        /// Seconds the acquire may queue; 0 is one immediate attempt.
        wait_s: u8,
        /// Seconds of lease granted, 1..=255.
        lease_s: u8,
        /// The caller's correlation id, echoed in `A`, `T` and `B`.
        owner: u64,
        /// The lock's name.
        key: &'a [u8],
    },
    /// `R`: give the lock back.
    Release {
        /// The fencing token of the hold being released.
        token: u64,
        /// The lock's name.
        key: &'a [u8],
    },
    /// `E`: renew the lease of a hold to `lease_s` seconds from now.
    Extend {
        /// Seconds of lease from now, 1..=255.
        lease_s: u8,
        /// The fencing token of the hold being extended.
        token: u64,
        /// The lock's name.
        key: &'a [u8],
    },
    /// `C`: withdraw this session's queued acquires of `key` with `owner`.
    Cancel {
        /// The owner of the acquires to withdraw.
        owner: u64,
        /// The lock's name.
        key: &'a [u8],
    },
    /// `Q`: report the state of a key.
    Query {
        /// Correlation id echoed in the answer.
        nonce: u64,
        /// The lock's name.
        key: &'a [u8],
    },
    /// `P`: liveness check.
    Ping {
        /// Correlation id echoed in the answer.
        nonce: u64,
    },
    /// `I`: identify the session as client `client`, whose calls the server remembers for
    /// `grace_s` seconds after its sessions end (docs/protocol.md §5, resumable calls).
    Identify {
        /// Seconds the server keeps the client's state once it has no session, 1..=60.
        grace_s: u8,
        /// The client's random id; never 0.
        client: u128,
        /// Correlation id echoed in the answer.
        nonce: u64,
    },
    /// `W`: what became of this client's acquire of `key` with `owner` (an identified session
    /// only; docs/protocol.md §5).
    Resolve {
        /// The acquire's owner.
        owner: u64,
        /// The lock's name.
        key: &'a [u8],
    },
}

impl<'a> Request<'a> {
    /// The key the request names, if any (Ping names none).
    #[inline]
    pub fn key(&self) -> Option<&'a [u8]> {
        match *self {
            Request::Acquire { key, .. }
            | Request::Release { key, .. }
            | Request::Extend { key, .. }
            | Request::Cancel { key, .. }
            | Request::Query { key, .. }
            | Request::Resolve { key, .. } => Some(key),
            Request::Ping { .. } | Request::Identify { .. } => None,
        }
    }

    /// The correlation id an answer (or an `X`) to this request carries.
    #[inline]
    pub fn correlation_id(&self) -> u64 {
        match *self {
            Request::Acquire { owner, .. }
            | Request::Cancel { owner, .. }
            | Request::Resolve { owner, .. } => owner,
            Request::Release { token, .. } | Request::Extend { token, .. } => token,
            Request::Query { nonce, .. }
            | Request::Ping { nonce }
            | Request::Identify { nonce, .. } => nonce,
        }
    }

    /// The number of bytes [`encode`](Request::encode) writes.
    #[inline]
    pub fn encoded_len(&self) -> usize {
        let key_bytes = self.key().map_or(0, <[u8]>::len);
        1 + header_bytes(self.op()).unwrap_or(0) + key_bytes + 1
    }

    /// The op byte of the request.
    #[inline]
    pub fn op(&self) -> u8 {
        match self {
            Request::Acquire { .. } => b'A',
            Request::Release { .. } => b'R',
            Request::Extend { .. } => b'E',
            Request::Cancel { .. } => b'C',
            Request::Query { .. } => b'Q',
            Request::Ping { .. } => b'P',
            Request::Identify { .. } => b'I',
            Request::Resolve { .. } => b'W',
        }
    }

    /// Appends the frame to `out`. Does not validate the key: a client checks it before.
    pub fn encode(&self, out: &mut Vec<u8>) {
        out.push(self.op());
        match *self {
            Request::Acquire {
                wait_s,
                lease_s,
                owner,
                ..
            } => {
                out.push(wait_s);
                out.push(lease_s);
                out.extend_from_slice(&owner.to_be_bytes());
            }
            Request::Release { token, .. } => out.extend_from_slice(&token.to_be_bytes()),
            Request::Extend { lease_s, token, .. } => {
                out.push(lease_s);
                out.extend_from_slice(&token.to_be_bytes());
            }
            Request::Cancel { owner: id, .. }
            | Request::Query { nonce: id, .. }
            | Request::Ping { nonce: id }
            | Request::Resolve { owner: id, .. } => out.extend_from_slice(&id.to_be_bytes()),
            Request::Identify {
                grace_s,
                client,
                nonce,
            } => {
                out.push(grace_s);
                out.extend_from_slice(&client.to_be_bytes());
                out.extend_from_slice(&nonce.to_be_bytes());
            }
        }
        if let Some(key) = self.key() {
            out.extend_from_slice(key);
        }
        out.push(b'\n');
    }
}

/// The `X` error codes of docs/protocol.md §2.3.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[repr(u8)]
pub enum ErrorCode {
    /// 1: unknown op. Closes the session.
    UnknownOp = 1,
    /// 2: key longer than the limit. Closes the session.
    KeyTooLong = 2,
    /// 3: empty key.
    EmptyKey = 3,
    /// 4: key is not valid UTF-8.
    KeyNotUtf8 = 4,
    /// 5: lease 0 in Acquire or Extend.
    LeaseZero = 5,
    /// 6: the byte after a fixed-size frame is not `\n`. Closes the session.
    MissingNewline = 6,
    /// 7: the server already has `max_connections` sessions. Closes the session.
    SessionRefused = 7,
    /// 8: the session's identity may not use this key: sent only by a server with
    /// authorization rules (`[[auth.rule]]`: key prefixes per client-certificate identity,
    /// docs/protocol.md §5), never by one without. The session continues. Also an Identify
    /// whose client id another identity first used.
    Forbidden = 8,
    /// 9: an Identify that is not the session's first request, or asks a grace outside
    /// 1..=60 s or the client id 0, or comes to a server that does not resume calls (a cluster
    /// member of this version); a Resolve on a session that did not identify. The session
    /// continues, not identified.
    NotIdentified = 9,
    /// 10: the server keeps the records of as many identified clients, or as many "never
    /// seen" answers of this client, as it may; the session continues (an Identify: not
    /// identified).
    Limit = 10,
}

impl ErrorCode {
    /// Whether the server closes the session after sending this error.
    #[inline]
    pub fn closes_session(self) -> bool {
        matches!(
            self,
            ErrorCode::UnknownOp
                | ErrorCode::KeyTooLong
                | ErrorCode::MissingNewline
                | ErrorCode::SessionRefused
        )
    }

    /// The code for a wire byte, if it is one of the defined codes.
    #[inline]
    pub fn from_u8(code: u8) -> Option<ErrorCode> {
        Some(match code {
            1 => ErrorCode::UnknownOp,
            2 => ErrorCode::KeyTooLong,
            3 => ErrorCode::EmptyKey,
            4 => ErrorCode::KeyNotUtf8,
            5 => ErrorCode::LeaseZero,
            6 => ErrorCode::MissingNewline,
            7 => ErrorCode::SessionRefused,
            8 => ErrorCode::Forbidden,
            9 => ErrorCode::NotIdentified,
            10 => ErrorCode::Limit,
            _ => return None,
        })
    }
}

impl fmt::Display for ErrorCode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let text = match self {
            ErrorCode::UnknownOp => "unknown op",
            ErrorCode::KeyTooLong => "key longer than the limit",
            ErrorCode::EmptyKey => "empty key",
            ErrorCode::KeyNotUtf8 => "key is not valid UTF-8",
            ErrorCode::LeaseZero => "lease 0",
            ErrorCode::MissingNewline => "byte after a fixed-size frame is not a newline",
            ErrorCode::SessionRefused => "session refused: too many connections",
            ErrorCode::Forbidden => "forbidden: this identity may not use this key",
            ErrorCode::NotIdentified => "not identified (resumable calls refused here)",
            ErrorCode::Limit => "the server's records of identified clients are full",
        };
        write!(f, "{text} (code {})", *self as u8)
    }
}

/// A request the parser refused: answer `X code id`, skip `consumed` bytes, and close the
/// session if `code.closes_session()`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct FrameError {
    /// Why the frame was refused.
    pub code: ErrorCode,
    /// The correlation id for the `X` (0 when the fixed header was not read).
    pub id: u64,
    /// Bytes of input the refused frame used (meaningful when the session continues).
    pub consumed: usize,
}

impl FrameError {
    /// The `X` response for this error.
    pub fn response(&self) -> Response {
        Response::Error {
            code: self.code,
            id: self.id,
        }
    }
}

/// The outcome of one parse attempt: a frame and the bytes it used, or `None` when more input
/// is needed.
pub type ParseResult<'a> = Result<Option<(Request<'a>, usize)>, FrameError>;

/// Length of the fixed header after `op`, or `None` for an unknown op.
fn header_bytes(op: u8) -> Option<usize> {
    match op {
        b'A' => Some(10),
        b'E' => Some(9),
        b'R' | b'C' | b'Q' | b'P' | b'W' => Some(8),
        b'I' => Some(IDENTIFY_HEADER_BYTES),
        _ => None,
    }
}

fn be_u64(bytes: &[u8]) -> u64 {
    let mut array = [0u8; 8];
    array.copy_from_slice(&bytes[..8]);
    u64::from_be_bytes(array)
}

/// Parses the first request in `buf`, allowing keys of at most `key_bytes_max` bytes.
///
/// Returns `Ok(None)` while the frame is incomplete. On a refused frame the error says how
/// many bytes to skip; for a closing error the session ends, so `consumed` is all of `buf`.
/// When one frame has several faults the lowest code is reported.
pub fn parse_request(buf: &[u8], key_bytes_max: usize) -> ParseResult<'_> {
    debug_assert!((1..=KEY_BYTES_MAX).contains(&key_bytes_max));
    let Some(&op) = buf.first() else {
        return Ok(None);
    };
    let Some(header_len) = header_bytes(op) else {
        return Err(FrameError {
            code: ErrorCode::UnknownOp,
            id: 0,
            consumed: buf.len(),
        });
    };
    let body_start = 1 + header_len;
    if buf.len() < body_start {
        return Ok(None);
    }
    let header = &buf[1..body_start];
    let id = header_id(op, header);
    if op == b'P' || op == b'I' {
        return parse_unkeyed_end(buf, body_start, op, header, id);
    }
    let Some(key_len) = find_key_end(buf, body_start, key_bytes_max, id)? else {
        return Ok(None);
    };
    let key = &buf[body_start..body_start + key_len];
    let consumed = body_start + key_len + 1;
    let refuse = |code| Err(FrameError { code, id, consumed });
    if let Err(code) = check_key(key) {
        return refuse(code);
    }
    match keyed_request(op, header, id, key) {
        Request::Acquire { lease_s: 0, .. } | Request::Extend { lease_s: 0, .. } => {
            refuse(ErrorCode::LeaseZero)
        }
        request => Ok(Some((request, consumed))),
    }
}

/// The correlation id in a complete fixed header: the `u64` that ends it.
#[inline]
fn header_id(op: u8, header: &[u8]) -> u64 {
    match op {
        b'A' => be_u64(&header[2..]),
        b'E' => be_u64(&header[1..]),
        b'I' => be_u64(&header[17..]),
        _ => be_u64(header),
    }
}

/// The end of a Ping or an Identify, whose fixed header ends at `body_start`: `\n` or code 6.
/// The Identify's grace and client id are not checked here (the server answers them `X` 9).
#[inline]
fn parse_unkeyed_end(
    buf: &[u8],
    body_start: usize,
    op: u8,
    header: &[u8],
    nonce: u64,
) -> ParseResult<'static> {
    match buf.get(body_start) {
        None => Ok(None),
        Some(b'\n') if op == b'P' => Ok(Some((Request::Ping { nonce }, body_start + 1))),
        Some(b'\n') => {
            let mut client = [0u8; 16];
            client.copy_from_slice(&header[1..17]);
            let identify = Request::Identify {
                grace_s: header[0],
                client: u128::from_be_bytes(client),
                nonce,
            };
            Ok(Some((identify, body_start + 1)))
        }
        Some(_) => Err(FrameError {
            code: ErrorCode::MissingNewline,
            id: nonce,
            consumed: buf.len(),
        }),
    }
}

/// The length of the key that starts at `body_start`: `Ok(None)` while its `\n` may still
/// come, code 2 once `key_bytes_max + 1` bytes have come without one.
#[inline]
fn find_key_end(
    buf: &[u8],
    body_start: usize,
    key_bytes_max: usize,
    id: u64,
) -> Result<Option<usize>, FrameError> {
    // The key ends at the first `\n` after the fixed header; limit + 1 bytes without one is
    // code 2, so never search further than that.
    let search_end = buf.len().min(body_start + key_bytes_max + 1);
    match buf[body_start..search_end].iter().position(|&b| b == b'\n') {
        Some(key_len) => Ok(Some(key_len)),
        None if search_end - body_start > key_bytes_max => Err(FrameError {
            code: ErrorCode::KeyTooLong,
            id,
            consumed: buf.len(),
        }),
        None => Ok(None),
    }
}

/// Codes 3 and 4, in that order: the key is empty, or not valid UTF-8.
#[inline]
fn check_key(key: &[u8]) -> Result<(), ErrorCode> {
    if key.is_empty() {
        return Err(ErrorCode::EmptyKey);
    }
    // Keys are nearly always ASCII: the inlined word-at-a-time check skips the general
    // validator's call (a measurable share of a pipelined request's parse).
    if !key.is_ascii() && std::str::from_utf8(key).is_err() {
        return Err(ErrorCode::KeyNotUtf8);
    }
    Ok(())
}

/// The request a keyed `op` (not `P`) names, from its fixed header, id and key. The lease is
/// not checked here.
#[inline]
fn keyed_request<'a>(op: u8, header: &[u8], id: u64, key: &'a [u8]) -> Request<'a> {
    match op {
        b'A' => Request::Acquire {
            wait_s: header[0],
            lease_s: header[1],
            owner: id,
            key,
        },
        b'R' => Request::Release { token: id, key },
        b'E' => Request::Extend {
            lease_s: header[0],
            token: id,
            key,
        },
        b'C' => Request::Cancel { owner: id, key },
        b'W' => Request::Resolve { owner: id, key },
        _ => Request::Query { nonce: id, key },
    }
}

/// A response from the server.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Response {
    /// `A`: the acquire of `owner` holds the lock with fencing token `token`.
    Acquired {
        /// The acquire's correlation id.
        owner: u64,
        /// The fencing token of the grant; never 0.
        token: u64,
    },
    /// `T`: the acquire of `owner` timed out (or was cancelled).
    Timeout {
        /// The acquire's correlation id.
        owner: u64,
    },
    /// `B`: the acquire of `owner` was refused for capacity or shutdown.
    Busy {
        /// The acquire's correlation id.
        owner: u64,
    },
    /// `R`: the hold with `token` was released.
    Released {
        /// The released token.
        token: u64,
    },
    /// `E`: the hold with `token` was extended.
    Extended {
        /// The extended token.
        token: u64,
    },
    /// `N`: `token` is not the key's current holder.
    NotHeld {
        /// The token named by the request.
        token: u64,
    },
    /// `Q`: the state of a key.
    State {
        /// The query's correlation id.
        nonce: u64,
        /// Whether the key is held.
        held: bool,
        /// Milliseconds left on the lease, rounded down; 0 when free.
        lease_ms: u32,
        /// Acquires queued on the key.
        waiters: u32,
    },
    /// `P`: answer to a ping.
    Pong {
        /// The ping's correlation id.
        nonce: u64,
    },
    /// `X`: the request was refused.
    Error {
        /// Why.
        code: ErrorCode,
        /// The request's correlation id, or 0 for codes 1 and 7.
        id: u64,
    },
    /// `M`: a cluster member does not lead the request's key; the request had no effect and
    /// may be sent to `leader`. A single node never sends it.
    Moved {
        /// The request's correlation id.
        id: u64,
        /// The member that leads the key, as far as this member knows.
        leader: Leader,
    },
    /// `I`: the session is identified; the server keeps the client's state `grace_s` seconds
    /// after its last session ends.
    Identified {
        /// The Identify's correlation id.
        nonce: u64,
        /// The grace granted (at most the one asked for).
        grace_s: u8,
    },
    /// `W`: what became of the acquire of `owner` (answers a Resolve).
    Resolved {
        /// The acquire's owner.
        owner: u64,
        /// Its fate.
        fate: Fate,
        /// For [`Fate::Granted`]: the grant's token (0 otherwise).
        token: u64,
        /// For [`Fate::Granted`]: milliseconds left on the lease, rounded down (0 otherwise).
        lease_ms: u32,
    },
}

/// What became of an acquire, as a Resolve reports it (docs/protocol.md §5).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[repr(u8)]
pub enum Fate {
    /// 0: the server has no acquire of that owner in effect and records that none will ever
    /// be executed: it was never read, or whatever it did no longer stands (its grant ended,
    /// its answer was forgotten). The caller may send a new acquire, under a new owner.
    NeverSeen = 0,
    /// 1: granted and still held by that owner: the token and the lease left come with it.
    Granted = 1,
    /// 2: still queued; the waiter now belongs to the session that asked, where its `A`, `T`
    /// or `B` will come.
    Queued = 2,
    /// 3: answered `T` (its wait ran out, it was cancelled, or it could not wait).
    TimedOut = 3,
    /// 4: answered `B`: it was not executed.
    Busy = 4,
}

impl Fate {
    /// The fate for a wire byte, if it is one of the defined fates.
    pub fn from_u8(fate: u8) -> Option<Fate> {
        Some(match fate {
            0 => Fate::NeverSeen,
            1 => Fate::Granted,
            2 => Fate::Queued,
            3 => Fate::TimedOut,
            4 => Fate::Busy,
            _ => return None,
        })
    }
}

/// The leader a [`Response::Moved`] names: an IP address and port, or none known. Kept as the
/// wire's 18 bytes (IPv4 as IPv4-mapped IPv6) so that a [`Response`] stays small and `Copy`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Leader {
    ip: [u8; 16],
    port: u16,
}

impl Leader {
    /// No leader known (on the wire: the unspecified address `::` and port 0).
    pub const UNKNOWN: Leader = Leader {
        ip: [0; 16],
        port: 0,
    };

    /// The leader at `addr`.
    pub fn at(addr: SocketAddr) -> Leader {
        let ip = match addr.ip() {
            IpAddr::V4(v4) => v4.to_ipv6_mapped(),
            IpAddr::V6(v6) => v6,
        };
        Leader {
            ip: ip.octets(),
            port: addr.port(),
        }
    }

    /// The leader's address, or `None` when no leader is known (port 0 or the unspecified
    /// address). An IPv4-mapped address comes back as IPv4.
    pub fn addr(&self) -> Option<SocketAddr> {
        let ip = Ipv6Addr::from(self.ip);
        let ip = ip.to_ipv4_mapped().map_or(IpAddr::V6(ip), IpAddr::V4);
        if self.port == 0 || ip.is_unspecified() {
            return None;
        }
        Some(SocketAddr::new(ip, self.port))
    }
}

impl Response {
    /// The op byte of the response.
    #[inline]
    pub fn op(&self) -> u8 {
        match self {
            Response::Acquired { .. } => b'A',
            Response::Timeout { .. } => b'T',
            Response::Busy { .. } => b'B',
            Response::Released { .. } => b'R',
            Response::Extended { .. } => b'E',
            Response::NotHeld { .. } => b'N',
            Response::State { .. } => b'Q',
            Response::Pong { .. } => b'P',
            Response::Error { .. } => b'X',
            Response::Moved { .. } => b'M',
            Response::Identified { .. } => b'I',
            Response::Resolved { .. } => b'W',
        }
    }

    /// The correlation id the response carries.
    #[inline]
    pub fn correlation_id(&self) -> u64 {
        match *self {
            Response::Acquired { owner, .. }
            | Response::Timeout { owner }
            | Response::Busy { owner }
            | Response::Resolved { owner, .. } => owner,
            Response::Released { token }
            | Response::Extended { token }
            | Response::NotHeld { token } => token,
            Response::State { nonce, .. }
            | Response::Pong { nonce }
            | Response::Identified { nonce, .. } => nonce,
            Response::Error { id, .. } | Response::Moved { id, .. } => id,
        }
    }

    /// Appends the frame to `out`.
    #[inline]
    pub fn encode(&self, out: &mut Vec<u8>) {
        let mut frame = [0u8; RESPONSE_BYTES_MAX];
        let len = self.encode_into(&mut frame);
        out.extend_from_slice(&frame[..len]);
    }

    /// Writes the frame into `frame` and returns its length.
    pub fn encode_into(&self, frame: &mut [u8; RESPONSE_BYTES_MAX]) -> usize {
        frame[0] = self.op();
        let body_len = match *self {
            Response::Acquired { owner, token } => {
                frame[1..9].copy_from_slice(&owner.to_be_bytes());
                frame[9..17].copy_from_slice(&token.to_be_bytes());
                16
            }
            Response::State {
                nonce,
                held,
                lease_ms,
                waiters,
            } => {
                frame[1..9].copy_from_slice(&nonce.to_be_bytes());
                frame[9] = u8::from(held);
                frame[10..14].copy_from_slice(&lease_ms.to_be_bytes());
                frame[14..18].copy_from_slice(&waiters.to_be_bytes());
                17
            }
            Response::Error { code, id } => {
                frame[1] = code as u8;
                frame[2..10].copy_from_slice(&id.to_be_bytes());
                9
            }
            Response::Moved { id, leader } => {
                frame[1..9].copy_from_slice(&id.to_be_bytes());
                frame[9..25].copy_from_slice(&leader.ip);
                frame[25..27].copy_from_slice(&leader.port.to_be_bytes());
                26
            }
            Response::Identified { nonce, grace_s } => {
                frame[1..9].copy_from_slice(&nonce.to_be_bytes());
                frame[9] = grace_s;
                9
            }
            Response::Resolved {
                owner,
                fate,
                token,
                lease_ms,
            } => {
                frame[1..9].copy_from_slice(&owner.to_be_bytes());
                frame[9] = fate as u8;
                frame[10..18].copy_from_slice(&token.to_be_bytes());
                frame[18..22].copy_from_slice(&lease_ms.to_be_bytes());
                21
            }
            _ => {
                frame[1..9].copy_from_slice(&self.correlation_id().to_be_bytes());
                8
            }
        };
        frame[1 + body_len] = b'\n';
        2 + body_len
    }
}

/// A response frame the client could not parse: the session cannot find frame boundaries.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ResponseError {
    /// The op byte is not a response op.
    UnknownOp(u8),
    /// The byte after the frame is not `\n`.
    MissingNewline(u8),
    /// An `X` frame carries an undefined code.
    UnknownErrorCode(u8),
    /// A `Q` frame's `held` byte is neither 0 nor 1.
    BadHeld(u8),
    /// A `W` frame carries an undefined fate.
    UnknownFate(u8),
}

impl fmt::Display for ResponseError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            ResponseError::UnknownOp(op) => write!(f, "unknown response op 0x{op:02x}"),
            ResponseError::MissingNewline(b) => {
                write!(f, "response frame ends with 0x{b:02x}, not a newline")
            }
            ResponseError::UnknownErrorCode(c) => write!(f, "unknown error code {c}"),
            ResponseError::BadHeld(b) => write!(f, "query answer has held byte {b}"),
            ResponseError::UnknownFate(b) => write!(f, "resolve answer has unknown fate {b}"),
        }
    }
}

impl std::error::Error for ResponseError {}

/// Parses the first response in `buf`: `Ok(None)` while incomplete, else the response and the
/// bytes it used.
pub fn parse_response(buf: &[u8]) -> Result<Option<(Response, usize)>, ResponseError> {
    let Some(&op) = buf.first() else {
        return Ok(None);
    };
    let frame_len = match op {
        b'A' => 18,
        b'Q' => 19,
        b'X' => 11,
        b'M' => 28,
        b'W' => 23,
        b'I' => 11,
        b'T' | b'B' | b'R' | b'E' | b'N' | b'P' => 10,
        _ => return Err(ResponseError::UnknownOp(op)),
    };
    if buf.len() < frame_len {
        return Ok(None);
    }
    let last = buf[frame_len - 1];
    if last != b'\n' {
        return Err(ResponseError::MissingNewline(last));
    }
    let id = be_u64(&buf[1..9]);
    let response = match op {
        b'A' => Response::Acquired {
            owner: id,
            token: be_u64(&buf[9..17]),
        },
        b'T' => Response::Timeout { owner: id },
        b'B' => Response::Busy { owner: id },
        b'R' => Response::Released { token: id },
        b'E' => Response::Extended { token: id },
        b'N' => Response::NotHeld { token: id },
        b'P' => Response::Pong { nonce: id },
        b'M' => {
            let mut ip = [0u8; 16];
            ip.copy_from_slice(&buf[9..25]);
            let port = u16::from_be_bytes([buf[25], buf[26]]);
            Response::Moved {
                id,
                leader: Leader { ip, port },
            }
        }
        b'I' => Response::Identified {
            nonce: id,
            grace_s: buf[9],
        },
        b'W' => Response::Resolved {
            owner: id,
            fate: Fate::from_u8(buf[9]).ok_or(ResponseError::UnknownFate(buf[9]))?,
            token: be_u64(&buf[10..18]),
            lease_ms: u32::from_be_bytes([buf[18], buf[19], buf[20], buf[21]]),
        },
        b'Q' => {
            let held = match buf[9] {
                0 => false,
                1 => true,
                other => return Err(ResponseError::BadHeld(other)),
            };
            let lease_ms = u32::from_be_bytes([buf[10], buf[11], buf[12], buf[13]]);
            let waiters = u32::from_be_bytes([buf[14], buf[15], buf[16], buf[17]]);
            Response::State {
                nonce: id,
                held,
                lease_ms,
                waiters,
            }
        }
        _ => {
            let code = ErrorCode::from_u8(buf[1]).ok_or(ResponseError::UnknownErrorCode(buf[1]))?;
            Response::Error {
                code,
                id: be_u64(&buf[2..10]),
            }
        }
    };
    Ok(Some((response, frame_len)))
}

#[cfg(test)]
mod tests;
