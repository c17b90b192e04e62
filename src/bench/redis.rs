//! A minimal RESP (version 2) encoder and decoder, and the Redis dialect of the harness.
//!
//! The lock recipe is the usual single-instance one: acquire is `SET key owner NX PX lease_ms`
//! (`+OK` granted, null bulk when the key is held); release is `EVALSHA` of a compare-and-delete
//! script loaded once with `SCRIPT LOAD` (`:1` deleted, `:0` not ours). The owner value, written
//! as 16 hex digits, plays the part of the fencing token. `hold` reads what is left of a lease
//! with `PTTL`.
//!
//! The decoder handles the reply types these commands produce (simple string, error, integer,
//! bulk string including null). Arrays and RESP3 types are refused as errors: a connection that
//! receives one can no longer be trusted. Incomplete input is `Ok(None)`, never an error.
//!
//! Invariants: Redis answers in request order, so [`RedisWire`] keeps a FIFO of outstanding
//! requests, never longer than the pipeline; encoding writes into the caller's buffer through
//! stack arrays and does not allocate.
//!
//! Deliberately not here: sockets (the driver loads the script), clustering, `AUTH`.

use std::collections::VecDeque;
use std::fmt;

use super::wire::{Answer, ParseOutcome, Reply, Wire, WireError};

/// The release script: delete the key only if it still holds this owner's value.
pub const RELEASE_SCRIPT: &[u8] =
    b"if redis.call('get', KEYS[1]) ~= ARGV[1] then return 0 end return redis.call('del', KEYS[1])";

/// Bytes of a SHA-1 script digest in hex.
pub const SHA_BYTES: usize = 40;

/// The longest simple-string or error line, or bulk string, the decoder accepts.
pub const REPLY_BYTES_MAX: usize = 16 * 1024;

/// A RESP reply, borrowing from the read buffer.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RespValue<'a> {
    /// `+text`
    Simple(&'a [u8]),
    /// `-text`
    Error(&'a [u8]),
    /// `:n`
    Integer(i64),
    /// `$n` with its bytes, or `$-1` (None).
    Bulk(Option<&'a [u8]>),
}

/// A reply the decoder cannot parse.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RespError {
    /// The first byte is not a supported type.
    UnsupportedType(u8),
    /// A line is not terminated by `\r\n`, or a bulk string is not followed by it.
    MissingCrlf,
    /// An integer or length is not a decimal number.
    BadNumber,
    /// A line or bulk string is longer than [`REPLY_BYTES_MAX`].
    TooLong,
}

impl fmt::Display for RespError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            RespError::UnsupportedType(byte) => write!(f, "unsupported reply type 0x{byte:02x}"),
            RespError::MissingCrlf => write!(f, "missing CRLF"),
            RespError::BadNumber => write!(f, "bad number"),
            RespError::TooLong => write!(f, "reply longer than {REPLY_BYTES_MAX} bytes"),
        }
    }
}

/// Appends the command `args` as a RESP array of bulk strings.
pub fn encode_command(out: &mut Vec<u8>, args: &[&[u8]]) {
    out.push(b'*');
    push_decimal(out, args.len() as u64);
    out.extend_from_slice(b"\r\n");
    for arg in args {
        out.push(b'$');
        push_decimal(out, arg.len() as u64);
        out.extend_from_slice(b"\r\n");
        out.extend_from_slice(arg);
        out.extend_from_slice(b"\r\n");
    }
}

fn push_decimal(out: &mut Vec<u8>, value: u64) {
    let (digits, len) = decimal(value);
    out.extend_from_slice(&digits[digits.len() - len..]);
}

/// `value` in decimal: the digits are right-aligned in the array; `len` of them are used.
pub fn decimal(value: u64) -> ([u8; 20], usize) {
    let mut digits = [0u8; 20];
    let mut rest = value;
    let mut len = 0;
    loop {
        digits[19 - len] = b'0' + (rest % 10) as u8;
        rest /= 10;
        len += 1;
        if rest == 0 {
            return (digits, len);
        }
    }
}

/// `value` as 16 lowercase hex digits.
pub fn hex16(value: u64) -> [u8; 16] {
    const HEX: &[u8; 16] = b"0123456789abcdef";
    let mut text = [0u8; 16];
    for (index, byte) in text.iter_mut().enumerate() {
        *byte = HEX[((value >> (60 - 4 * index)) & 0xf) as usize];
    }
    text
}

/// The line after the type byte up to `\r\n`: `Ok(None)` while incomplete, else the line and
/// the offset just past its `\r\n`.
fn line(buf: &[u8]) -> Result<Option<(&[u8], usize)>, RespError> {
    let search_end = buf.len().min(1 + REPLY_BYTES_MAX + 2);
    match buf[1..search_end].iter().position(|&b| b == b'\n') {
        Some(newline) if newline > 0 && buf[newline] == b'\r' => {
            Ok(Some((&buf[1..newline], newline + 2)))
        }
        Some(_) => Err(RespError::MissingCrlf),
        None if search_end == buf.len() => Ok(None),
        None => Err(RespError::TooLong),
    }
}

fn number(text: &[u8]) -> Result<i64, RespError> {
    let (negative, digits) = match text.split_first() {
        Some((b'-', rest)) => (true, rest),
        _ => (false, text),
    };
    if digits.is_empty() || digits.len() > 18 || !digits.iter().all(u8::is_ascii_digit) {
        return Err(RespError::BadNumber);
    }
    let magnitude = digits
        .iter()
        .fold(0i64, |acc, &d| acc * 10 + i64::from(d - b'0'));
    Ok(if negative { -magnitude } else { magnitude })
}

/// Parses the first reply in `buf`: `Ok(None)` while incomplete, else the value and the bytes
/// it used.
pub fn parse_reply(buf: &[u8]) -> Result<Option<(RespValue<'_>, usize)>, RespError> {
    let Some(&kind) = buf.first() else {
        return Ok(None);
    };
    if !matches!(kind, b'+' | b'-' | b':' | b'$') {
        return Err(RespError::UnsupportedType(kind));
    }
    let Some((text, after_line)) = line(buf)? else {
        return Ok(None);
    };
    let value = match kind {
        b'+' => RespValue::Simple(text),
        b'-' => RespValue::Error(text),
        b':' => RespValue::Integer(number(text)?),
        _ => {
            let len = number(text)?;
            if len == -1 {
                return Ok(Some((RespValue::Bulk(None), after_line)));
            }
            let len = usize::try_from(len).map_err(|_| RespError::BadNumber)?;
            if len > REPLY_BYTES_MAX {
                return Err(RespError::TooLong);
            }
            let end = after_line + len;
            if buf.len() < end + 2 {
                return Ok(None);
            }
            if &buf[end..end + 2] != b"\r\n" {
                return Err(RespError::MissingCrlf);
            }
            return Ok(Some((
                RespValue::Bulk(Some(&buf[after_line..end])),
                end + 2,
            )));
        }
    };
    Ok(Some((value, after_line)))
}

#[derive(Clone, Copy, Debug)]
enum Asked {
    Acquire,
    Release,
    Query,
}

#[derive(Clone, Copy, Debug)]
struct Outstanding {
    asked: Asked,
    slot: u16,
    id: u64,
}

/// The Redis dialect of one connection.
#[derive(Debug)]
pub struct RedisWire {
    outstanding: VecDeque<Outstanding>,
    sha: [u8; SHA_BYTES],
    lease_ms: ([u8; 20], usize),
    first_error: Option<String>,
}

impl RedisWire {
    /// A dialect for a connection with `pipeline` slots, releasing with script `sha`, asking
    /// for leases of `lease_ms`.
    pub fn new(pipeline: u16, sha: [u8; SHA_BYTES], lease_ms: u64) -> RedisWire {
        RedisWire {
            outstanding: VecDeque::with_capacity(usize::from(pipeline)),
            sha,
            lease_ms: decimal(lease_ms),
            first_error: None,
        }
    }

    fn answer(&mut self, asked: Outstanding, value: RespValue<'_>) -> Result<Answer, WireError> {
        let answer = match (asked.asked, value) {
            (Asked::Acquire, RespValue::Simple(b"OK")) => Answer::Granted {
                owner: asked.id,
                token: asked.id,
            },
            (Asked::Acquire, RespValue::Bulk(None)) => Answer::Timeout { owner: asked.id },
            (Asked::Release, RespValue::Integer(1)) => Answer::Released { token: asked.id },
            (Asked::Release, RespValue::Integer(0)) => Answer::NotHeld { token: asked.id },
            // PTTL: milliseconds left; -2 no such key, -1 a key without expiry (not a lock).
            (Asked::Query, RespValue::Integer(left)) => Answer::Remaining {
                nonce: asked.id,
                lease_ms: u32::try_from(left).ok(),
            },
            (_, RespValue::Error(text)) => {
                if self.first_error.is_none() {
                    self.first_error = Some(String::from_utf8_lossy(text).into_owned());
                }
                Answer::Refused {
                    id: asked.id,
                    code: 0,
                }
            }
            (_, RespValue::Simple(_)) => return Err(WireError::UnexpectedReply(b'+')),
            (_, RespValue::Integer(_)) => return Err(WireError::UnexpectedReply(b':')),
            (_, RespValue::Bulk(_)) => return Err(WireError::UnexpectedReply(b'$')),
        };
        Ok(answer)
    }
}

impl Wire for RedisWire {
    fn encode_acquire(
        &mut self,
        out: &mut Vec<u8>,
        slot: u16,
        key: &[u8],
        owner: u64,
        _wait_s: u8,
    ) {
        let value = hex16(owner);
        let (digits, len) = &self.lease_ms;
        let lease = &digits[digits.len() - len..];
        encode_command(out, &[b"SET", key, &value, b"NX", b"PX", lease]);
        debug_assert!(self.outstanding.len() < self.outstanding.capacity());
        self.outstanding.push_back(Outstanding {
            asked: Asked::Acquire,
            slot,
            id: owner,
        });
    }

    fn encode_release(&mut self, out: &mut Vec<u8>, slot: u16, key: &[u8], token: u64) {
        let value = hex16(token);
        encode_command(out, &[b"EVALSHA", &self.sha, b"1", key, &value]);
        debug_assert!(self.outstanding.len() < self.outstanding.capacity());
        self.outstanding.push_back(Outstanding {
            asked: Asked::Release,
            slot,
            id: token,
        });
    }

    fn encode_query(&mut self, out: &mut Vec<u8>, slot: u16, key: &[u8], nonce: u64) {
        encode_command(out, &[b"PTTL", key]);
        debug_assert!(self.outstanding.len() < self.outstanding.capacity());
        self.outstanding.push_back(Outstanding {
            asked: Asked::Query,
            slot,
            id: nonce,
        });
    }

    fn parse(&mut self, buf: &[u8]) -> ParseOutcome {
        let Some((value, used)) = parse_reply(buf).map_err(WireError::Resp)? else {
            return Ok(None);
        };
        let asked = self.outstanding.pop_front().ok_or(WireError::Unsolicited)?;
        let answer = self.answer(asked, value)?;
        Ok(Some((
            Reply {
                answer,
                slot: Some(asked.slot),
            },
            used,
        )))
    }

    fn first_error_text(&self) -> Option<&str> {
        self.first_error.as_deref()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn commands_are_arrays_of_bulk_strings() {
        let mut out = Vec::new();
        encode_command(&mut out, &[b"SET", b"k", b"", b"NX"]);
        assert_eq!(out, b"*4\r\n$3\r\nSET\r\n$1\r\nk\r\n$0\r\n\r\n$2\r\nNX\r\n");
    }

    #[test]
    fn numbers_format_without_allocating() {
        let (digits, len) = decimal(0);
        assert_eq!(&digits[20 - len..], b"0");
        let (digits, len) = decimal(u64::MAX);
        assert_eq!(&digits[20 - len..], b"18446744073709551615");
        assert_eq!(&hex16(0xdead_beef), b"00000000deadbeef");
        let text = hex16(u64::MAX - 7);
        let back = u64::from_str_radix(std::str::from_utf8(&text).unwrap(), 16);
        assert_eq!(back, Ok(u64::MAX - 7));
    }

    #[test]
    fn replies_of_each_type_parse() {
        assert_eq!(
            parse_reply(b"+OK\r\n"),
            Ok(Some((RespValue::Simple(b"OK"), 5)))
        );
        assert_eq!(
            parse_reply(b"-ERR no\r\n"),
            Ok(Some((RespValue::Error(b"ERR no"), 9)))
        );
        assert_eq!(
            parse_reply(b":-12\r\n"),
            Ok(Some((RespValue::Integer(-12), 6)))
        );
        assert_eq!(
            parse_reply(b"$-1\r\n"),
            Ok(Some((RespValue::Bulk(None), 5)))
        );
        assert_eq!(
            parse_reply(b"$3\r\na\nb\r\n"),
            Ok(Some((RespValue::Bulk(Some(b"a\nb")), 9)))
        );
        assert_eq!(
            parse_reply(b"$0\r\n\r\n"),
            Ok(Some((RespValue::Bulk(Some(b"")), 6)))
        );
    }

    #[test]
    fn every_prefix_of_a_reply_is_incomplete() {
        let replies: [&[u8]; 4] = [b"+OK\r\n", b":1\r\n", b"$-1\r\n", b"$5\r\nhello\r\n"];
        for reply in replies {
            for cut in 0..reply.len() {
                assert_eq!(
                    parse_reply(&reply[..cut]),
                    Ok(None),
                    "{reply:?} cut at {cut}"
                );
            }
        }
    }

    #[test]
    fn malformed_replies_are_errors() {
        assert_eq!(
            parse_reply(b"*1\r\n"),
            Err(RespError::UnsupportedType(b'*'))
        );
        assert_eq!(parse_reply(b"+OK\n"), Err(RespError::MissingCrlf));
        assert_eq!(parse_reply(b":12a\r\n"), Err(RespError::BadNumber));
        assert_eq!(parse_reply(b":\r\n"), Err(RespError::BadNumber));
        assert_eq!(parse_reply(b"$2\r\nabcd"), Err(RespError::MissingCrlf));
        assert_eq!(parse_reply(b"$99999999\r\n"), Err(RespError::TooLong));
        let long = [b'+'; REPLY_BYTES_MAX + 8];
        assert_eq!(parse_reply(&long), Err(RespError::TooLong));
    }

    #[test]
    fn set_and_evalsha_are_encoded_in_full() {
        let mut wire = RedisWire::new(4, [b'f'; SHA_BYTES], 30_000);
        let mut out = Vec::new();
        wire.encode_acquire(&mut out, 2, b"key", 0xab, 0);
        let expected = b"*6\r\n$3\r\nSET\r\n$3\r\nkey\r\n$16\r\n00000000000000ab\r\n\
                         $2\r\nNX\r\n$2\r\nPX\r\n$5\r\n30000\r\n";
        assert_eq!(out, expected.to_vec());
        out.clear();
        wire.encode_release(&mut out, 2, b"key", 0xab);
        let text = String::from_utf8(out).unwrap();
        assert!(
            text.starts_with("*5\r\n$7\r\nEVALSHA\r\n$40\r\nffff"),
            "{text}"
        );
        assert!(
            text.ends_with("$1\r\n1\r\n$3\r\nkey\r\n$16\r\n00000000000000ab\r\n"),
            "{text}"
        );
    }

    #[test]
    fn answers_follow_request_order() {
        let mut wire = RedisWire::new(4, [b'0'; SHA_BYTES], 1000);
        let mut out = Vec::new();
        wire.encode_acquire(&mut out, 0, b"a", 10, 0);
        wire.encode_acquire(&mut out, 1, b"b", 11, 0);
        wire.encode_release(&mut out, 2, b"c", 12);
        wire.encode_release(&mut out, 3, b"d", 13);
        let input = b"+OK\r\n$-1\r\n:1\r\n:0\r\n";
        let mut offset = 0;
        let mut seen = Vec::new();
        while let Some((reply, used)) = wire.parse(&input[offset..]).unwrap() {
            seen.push(reply);
            offset += used;
        }
        let expected = [
            Reply {
                answer: Answer::Granted {
                    owner: 10,
                    token: 10,
                },
                slot: Some(0),
            },
            Reply {
                answer: Answer::Timeout { owner: 11 },
                slot: Some(1),
            },
            Reply {
                answer: Answer::Released { token: 12 },
                slot: Some(2),
            },
            Reply {
                answer: Answer::NotHeld { token: 13 },
                slot: Some(3),
            },
        ];
        assert_eq!(seen, expected);
        assert_eq!(wire.parse(b"+OK\r\n"), Err(WireError::Unsolicited));
    }

    #[test]
    fn pttl_reports_the_lease_left() {
        let mut wire = RedisWire::new(3, [b'0'; SHA_BYTES], 1000);
        let mut out = Vec::new();
        for slot in 0..3 {
            wire.encode_query(&mut out, slot, b"k", 40 + u64::from(slot));
        }
        assert!(out.starts_with(b"*2\r\n$4\r\nPTTL\r\n$1\r\nk\r\n"));
        let mut left = |input: &[u8]| wire.parse(input).unwrap().unwrap().0.answer;
        assert_eq!(
            left(b":1500\r\n"),
            Answer::Remaining {
                nonce: 40,
                lease_ms: Some(1500)
            }
        );
        assert_eq!(
            left(b":-2\r\n"),
            Answer::Remaining {
                nonce: 41,
                lease_ms: None
            }
        );
        assert_eq!(
            left(b":-1\r\n"),
            Answer::Remaining {
                nonce: 42,
                lease_ms: None
            }
        );
    }

    #[test]
    fn error_replies_are_refusals_and_keep_their_text() {
        let mut wire = RedisWire::new(2, [b'0'; SHA_BYTES], 1000);
        let mut out = Vec::new();
        wire.encode_release(&mut out, 1, b"a", 7);
        wire.encode_acquire(&mut out, 0, b"a", 8, 0);
        let (reply, used) = wire.parse(b"-NOSCRIPT missing\r\n:1\r\n").unwrap().unwrap();
        assert_eq!(reply.answer, Answer::Refused { id: 7, code: 0 });
        assert_eq!(wire.first_error_text(), Some("NOSCRIPT missing"));
        assert_eq!(used, 19);
        assert_eq!(wire.parse(b":1\r\n"), Err(WireError::UnexpectedReply(b':')));
    }
}
