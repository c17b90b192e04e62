//! Codec tests: the byte layouts of docs/protocol.md §2.1/§2.2, round trips, frames split at every
//! offset, fixed headers full of `0x0A`, every error code of §2.3, and arbitrary input that never
//! panics.
//!
//! The expected outcome of a generated frame comes from [`expected`], a small restatement of
//! §2.3 written from the spec rather than from the parser, so the two can disagree.
//!
//! This module holds the shared fixtures; the tests are in one file per theme.

mod errors;
mod layouts;
mod properties;
mod streams;

use super::*;
use proptest::prelude::*;

/// A fixed header made only of `0x0A` bytes: a parser that searches for `\n` too early breaks.
const NEWLINES_U64: u64 = 0x0A0A_0A0A_0A0A_0A0A;

/// Big-endian bytes of `value`.
fn be(value: u64) -> [u8; 8] {
    value.to_be_bytes()
}

/// The concatenation of `parts`.
fn concat(parts: &[&[u8]]) -> Vec<u8> {
    parts.concat()
}

fn encoded(request: &Request<'_>) -> Vec<u8> {
    let mut out = Vec::new();
    request.encode(&mut out);
    assert_eq!(out.len(), request.encoded_len());
    out
}

fn encoded_response(response: &Response) -> Vec<u8> {
    let mut out = vec![0xEE];
    response.encode(&mut out);
    assert_eq!(out[0], 0xEE, "encode appends");
    out.remove(0);
    let mut frame = [0u8; RESPONSE_BYTES_MAX];
    let len = response.encode_into(&mut frame);
    assert_eq!(&frame[..len], &out[..]);
    out
}

/// An owned request, so strategies can generate what [`Request`] borrows. It may describe a
/// faulty frame (empty key, lease 0, bad UTF-8): `Request::encode` does not validate.
#[derive(Clone, Debug)]
struct Owned {
    op: u8,
    wait_s: u8,
    lease_s: u8,
    id: u64,
    key: Vec<u8>,
}

impl Owned {
    fn new(op: u8, lease_s: u8, id: u64, key: &[u8]) -> Owned {
        Owned {
            op,
            wait_s: 3,
            lease_s,
            id,
            key: key.to_vec(),
        }
    }

    fn request(&self) -> Request<'_> {
        let key = &self.key[..];
        match self.op {
            b'A' => Request::Acquire {
                wait_s: self.wait_s,
                lease_s: self.lease_s,
                owner: self.id,
                key,
            },
            b'R' => Request::Release {
                token: self.id,
                key,
            },
            b'E' => Request::Extend {
                lease_s: self.lease_s,
                token: self.id,
                key,
            },
            b'C' => Request::Cancel {
                owner: self.id,
                key,
            },
            b'Q' => Request::Query {
                nonce: self.id,
                key,
            },
            b'P' => Request::Ping { nonce: self.id },
            other => panic!("not a request op: {other}"),
        }
    }

    fn bytes(&self) -> Vec<u8> {
        encoded(&self.request())
    }
}

/// What a session sees from one frame: a request (by its bytes) or an `X` code and id.
#[derive(Clone, Debug, PartialEq, Eq)]
enum Outcome {
    Frame(Vec<u8>),
    Refused(ErrorCode, u64),
}

/// §2.3 restated: the outcome of a well-delimited frame (key without `\n`) under `limit`.
fn expected(frame: &Owned, limit: usize) -> Outcome {
    let refused = |code| Outcome::Refused(code, frame.id);
    if frame.op == b'P' {
        return Outcome::Frame(frame.bytes());
    }
    let has_lease = matches!(frame.op, b'A' | b'E');
    if frame.key.len() > limit {
        refused(ErrorCode::KeyTooLong)
    } else if frame.key.is_empty() {
        refused(ErrorCode::EmptyKey)
    } else if std::str::from_utf8(&frame.key).is_err() {
        refused(ErrorCode::KeyNotUtf8)
    } else if has_lease && frame.lease_s == 0 {
        refused(ErrorCode::LeaseZero)
    } else {
        Outcome::Frame(frame.bytes())
    }
}

/// What feeding a stream produced.
#[derive(Debug, PartialEq, Eq)]
struct Fed {
    outcomes: Vec<Outcome>,
    /// The session ended on a closing error.
    closed: bool,
    /// Bytes still buffered at the end (an incomplete frame).
    leftover: usize,
}

/// Feeds `stream` to a session-like buffer, one chunk per cut (cuts ascending), parsing after
/// each chunk as the reactor does, and checks what every parse result claims about `consumed`.
fn feed(stream: &[u8], cuts: &[usize], limit: usize) -> Fed {
    let mut buf = Vec::new();
    let mut outcomes = Vec::new();
    let mut start = 0;
    for &end in cuts.iter().chain(std::iter::once(&stream.len())) {
        let end = end.clamp(start, stream.len());
        buf.extend_from_slice(&stream[start..end]);
        start = end;
        // Bounded: every pass either consumes at least one byte or leaves the loop.
        loop {
            match parse_request(&buf, limit) {
                Ok(None) => break,
                Ok(Some((request, used))) => {
                    assert!(used >= 1 && used <= buf.len());
                    let frame = encoded(&request);
                    assert_eq!(frame, buf[..used], "a frame re-encodes to its own bytes");
                    outcomes.push(Outcome::Frame(frame));
                    buf.drain(..used);
                }
                Err(error) => {
                    outcomes.push(Outcome::Refused(error.code, error.id));
                    if error.code.closes_session() {
                        assert_eq!(error.consumed, buf.len(), "a closing error takes all");
                        return Fed {
                            outcomes,
                            closed: true,
                            leftover: 0,
                        };
                    }
                    assert!(error.consumed >= 1 && error.consumed <= buf.len());
                    assert_eq!(buf[error.consumed - 1], b'\n', "skips exactly one frame");
                    buf.drain(..error.consumed);
                }
            }
        }
    }
    Fed {
        outcomes,
        closed: false,
        leftover: buf.len(),
    }
}
