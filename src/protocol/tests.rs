//! Codec tests: the byte layouts of PROTOCOL.md §2.1/§2.2, round trips, frames split at every
//! offset, fixed headers full of `0x0A`, every error code of §2.3, and arbitrary input that never
//! panics.
//!
//! The expected outcome of a generated frame comes from [`expected`], a small restatement of
//! §2.3 written from the spec rather than from the parser, so the two can disagree.

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

// ---------------------------------------------------------------------------------------------
// Byte layouts (§2.1, §2.2)

#[test]
fn acquire_layout_is_12_plus_key_bytes() {
    let key = "kéy".as_bytes();
    let request = Request::Acquire {
        wait_s: 7,
        lease_s: 30,
        owner: 0x0102_0304_0506_0708,
        key,
    };
    let bytes = encoded(&request);
    let want = concat(&[b"A", &[7, 30], &[1, 2, 3, 4, 5, 6, 7, 8], key, b"\n"]);
    assert_eq!(bytes, want);
    assert_eq!(bytes.len(), 12 + key.len());
    assert_eq!(request.op(), b'A');
    assert_eq!(request.key(), Some(key));
    assert_eq!(request.correlation_id(), 0x0102_0304_0506_0708);
    assert_eq!(
        parse_request(&bytes, KEY_BYTES_MAX),
        Ok(Some((request, bytes.len())))
    );
}

#[test]
fn release_extend_cancel_query_ping_layouts() {
    let key = b"lock/1";
    let id = 0xA1B2_C3D4_E5F6_0718;
    let cases: [(Request<'_>, Vec<u8>); 5] = [
        (
            Request::Release { token: id, key },
            concat(&[b"R", &be(id), key, b"\n"]),
        ),
        (
            Request::Extend {
                lease_s: 200,
                token: id,
                key,
            },
            concat(&[b"E", &[200], &be(id), key, b"\n"]),
        ),
        (
            Request::Cancel { owner: id, key },
            concat(&[b"C", &be(id), key, b"\n"]),
        ),
        (
            Request::Query { nonce: id, key },
            concat(&[b"Q", &be(id), key, b"\n"]),
        ),
        (Request::Ping { nonce: id }, concat(&[b"P", &be(id), b"\n"])),
    ];
    let fixed = [10, 11, 10, 10, 10];
    for ((request, want), fixed_bytes) in cases.iter().zip(fixed) {
        let bytes = encoded(request);
        assert_eq!(&bytes, want, "{request:?}");
        let key_bytes = request.key().map_or(0, <[u8]>::len);
        assert_eq!(bytes.len(), fixed_bytes + key_bytes, "{request:?}");
        assert_eq!(request.correlation_id(), id);
        assert_eq!(bytes[0], request.op());
        let parsed = parse_request(&bytes, KEY_BYTES_MAX);
        assert_eq!(parsed, Ok(Some((*request, bytes.len()))));
    }
}

#[test]
fn response_layouts() {
    let id = 0x0102_0304_0506_0708;
    let token = 0x1112_1314_1516_1718;
    let cases: Vec<(Response, Vec<u8>)> = vec![
        (
            Response::Acquired { owner: id, token },
            concat(&[b"A", &be(id), &be(token), b"\n"]),
        ),
        (
            Response::Timeout { owner: id },
            concat(&[b"T", &be(id), b"\n"]),
        ),
        (
            Response::Busy { owner: id },
            concat(&[b"B", &be(id), b"\n"]),
        ),
        (
            Response::Released { token },
            concat(&[b"R", &be(token), b"\n"]),
        ),
        (
            Response::Extended { token },
            concat(&[b"E", &be(token), b"\n"]),
        ),
        (
            Response::NotHeld { token },
            concat(&[b"N", &be(token), b"\n"]),
        ),
        (
            Response::State {
                nonce: id,
                held: true,
                lease_ms: 0x2122_2324,
                waiters: 0x3132_3334,
            },
            concat(&[
                b"Q",
                &be(id),
                &[1],
                &[0x21, 0x22, 0x23, 0x24],
                &[0x31, 0x32, 0x33, 0x34],
                b"\n",
            ]),
        ),
        (
            Response::State {
                nonce: id,
                held: false,
                lease_ms: 0,
                waiters: 0,
            },
            concat(&[b"Q", &be(id), &[0; 9], b"\n"]),
        ),
        (
            Response::Pong { nonce: id },
            concat(&[b"P", &be(id), b"\n"]),
        ),
        (
            Response::Error {
                code: ErrorCode::LeaseZero,
                id,
            },
            concat(&[b"X", &[5], &be(id), b"\n"]),
        ),
    ];
    for (response, want) in &cases {
        let bytes = encoded_response(response);
        assert_eq!(&bytes, want, "{response:?}");
        let len = match response.op() {
            b'A' => 18,
            b'Q' => 19,
            b'X' => 11,
            _ => 10,
        };
        assert_eq!(bytes.len(), len, "{response:?}");
        assert_eq!(parse_response(&bytes), Ok(Some((*response, len))));
    }
    let id_of_error = Response::Error {
        code: ErrorCode::UnknownOp,
        id: 0,
    };
    assert_eq!(id_of_error.correlation_id(), 0);
    assert_eq!(cases[0].0.correlation_id(), id);
    assert_eq!(cases[3].0.correlation_id(), token);
}

#[test]
fn request_limits_are_consistent() {
    let longest = Request::Acquire {
        wait_s: 255,
        lease_s: 255,
        owner: u64::MAX,
        key: &[b'k'; KEY_BYTES_MAX],
    };
    assert_eq!(encoded(&longest).len(), REQUEST_BYTES_MAX);
    let state = Response::State {
        nonce: 1,
        held: true,
        lease_ms: 1,
        waiters: 1,
    };
    assert_eq!(encoded_response(&state).len(), RESPONSE_BYTES_MAX);
}

// ---------------------------------------------------------------------------------------------
// Fixed headers full of 0x0A are consumed by length

#[test]
fn headers_full_of_newlines_parse_by_length() {
    let key = b"k";
    let requests = [
        Request::Acquire {
            wait_s: 0x0A,
            lease_s: 0x0A,
            owner: NEWLINES_U64,
            key,
        },
        Request::Release {
            token: NEWLINES_U64,
            key,
        },
        Request::Extend {
            lease_s: 0x0A,
            token: NEWLINES_U64,
            key,
        },
        Request::Cancel {
            owner: NEWLINES_U64,
            key,
        },
        Request::Query {
            nonce: NEWLINES_U64,
            key,
        },
        Request::Ping {
            nonce: NEWLINES_U64,
        },
    ];
    for request in requests {
        let bytes = encoded(&request);
        let newlines = bytes.iter().filter(|&&b| b == b'\n').count();
        assert_eq!(
            newlines,
            bytes.len() - 1 - request.key().map_or(0, <[u8]>::len)
        );
        assert_eq!(
            parse_request(&bytes, KEY_BYTES_MAX),
            Ok(Some((request, bytes.len())))
        );
        // The header alone (every byte of it a newline) is still incomplete.
        for cut in 0..bytes.len() {
            assert_eq!(
                parse_request(&bytes[..cut], KEY_BYTES_MAX),
                Ok(None),
                "{cut}"
            );
        }
    }
    // An empty key after a header of newlines is code 3 for this frame only, not a misparse.
    let empty = concat(&[b"Q", &be(NEWLINES_U64), b"\n"]);
    let error = parse_request(&empty, 4).unwrap_err();
    assert_eq!(error.code, ErrorCode::EmptyKey);
    assert_eq!((error.id, error.consumed), (NEWLINES_U64, 10));
}

#[test]
fn responses_full_of_newlines_parse_by_length() {
    let responses = [
        Response::Acquired {
            owner: NEWLINES_U64,
            token: NEWLINES_U64,
        },
        Response::State {
            nonce: NEWLINES_U64,
            held: false,
            lease_ms: 0x0A0A_0A0A,
            waiters: 0x0A0A_0A0A,
        },
        Response::Error {
            code: ErrorCode::KeyTooLong,
            id: NEWLINES_U64,
        },
        Response::Pong {
            nonce: NEWLINES_U64,
        },
    ];
    for response in responses {
        let bytes = encoded_response(&response);
        assert_eq!(parse_response(&bytes), Ok(Some((response, bytes.len()))));
        for cut in 0..bytes.len() {
            assert_eq!(parse_response(&bytes[..cut]), Ok(None));
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Streams split anywhere

/// Frames of every kind, with headers full of newlines and keys that need several bytes.
fn mixed_stream() -> (Vec<u8>, Vec<Outcome>) {
    let mut frames = Vec::new();
    for (index, &op) in b"AERCQP".iter().enumerate() {
        let id = NEWLINES_U64 ^ index as u64;
        frames.push(Owned::new(op, 0x0A, id, "ключ/𝄞".as_bytes()));
        frames.push(Owned::new(op, 1, NEWLINES_U64, b"\x0b"));
        frames.push(Owned::new(op, 255, u64::MAX, &[b'z'; 40]));
        // Refused frames that do not close the session sit between good ones.
        frames.push(Owned::new(op, 0, id, b"after-lease-0"));
        frames.push(Owned::new(op, 9, id, b""));
        frames.push(Owned::new(op, 9, id, b"\xff\xfe"));
    }
    let mut stream = Vec::new();
    let mut outcomes = Vec::new();
    for frame in &frames {
        stream.extend_from_slice(&frame.bytes());
        outcomes.push(expected(frame, KEY_BYTES_MAX));
    }
    (stream, outcomes)
}

#[test]
fn stream_split_at_every_offset_parses_the_same() {
    let (stream, outcomes) = mixed_stream();
    let whole = feed(&stream, &[], KEY_BYTES_MAX);
    assert_eq!(whole.outcomes, outcomes);
    assert_eq!((whole.closed, whole.leftover), (false, 0));
    for cut in 0..=stream.len() {
        assert_eq!(feed(&stream, &[cut], KEY_BYTES_MAX), whole, "cut at {cut}");
    }
    let every_byte: Vec<usize> = (1..stream.len()).collect();
    assert_eq!(feed(&stream, &every_byte, KEY_BYTES_MAX), whole);
}

#[test]
fn incomplete_frames_are_ok_none_at_every_prefix() {
    let (stream, _) = mixed_stream();
    let mut start = 0;
    // Walk frame by frame; every strict prefix of the frame at `start` is Ok(None).
    while start < stream.len() {
        let used = match parse_request(&stream[start..], KEY_BYTES_MAX) {
            Ok(Some((_, used))) => used,
            Err(error) => error.consumed,
            Ok(None) => panic!("complete stream reported incomplete at {start}"),
        };
        for end in start..start + used {
            assert_eq!(parse_request(&stream[start..end], KEY_BYTES_MAX), Ok(None));
        }
        start += used;
    }
}

// ---------------------------------------------------------------------------------------------
// Error codes (§2.3)

#[test]
fn code_1_unknown_op_has_id_0_and_closes() {
    for op in 0..=u8::MAX {
        if b"AERCQP".contains(&op) {
            continue;
        }
        let buf = concat(&[&[op], &be(77), b"key\n"]);
        let error = parse_request(&buf, KEY_BYTES_MAX).unwrap_err();
        let want = FrameError {
            code: ErrorCode::UnknownOp,
            id: 0,
            consumed: buf.len(),
        };
        assert_eq!(error, want, "op {op}");
        assert!(error.code.closes_session());
        // The op byte alone is enough to know.
        assert_eq!(parse_request(&[op], 8).unwrap_err().consumed, 1);
    }
    assert_eq!(parse_request(&[], KEY_BYTES_MAX), Ok(None));
}

#[test]
fn code_2_key_longer_than_the_limit() {
    for limit in [1, 5, 64, KEY_BYTES_MAX] {
        for op in *b"AREQC" {
            let owned = Owned::new(op, 0x0A, NEWLINES_U64, &vec![b'k'; limit]);
            let exact = owned.bytes();
            // Exactly `limit` bytes: valid, and incomplete until its newline.
            let parsed = parse_request(&exact, limit).unwrap().unwrap();
            assert_eq!(parsed.1, exact.len());
            assert_eq!(parse_request(&exact[..exact.len() - 1], limit), Ok(None));
            // limit + 1 bytes without a newline: code 2, with the header's id, closing.
            let mut long = exact[..exact.len() - 1].to_vec();
            long.push(b'k');
            let error = parse_request(&long, limit).unwrap_err();
            let want = FrameError {
                code: ErrorCode::KeyTooLong,
                id: NEWLINES_U64,
                consumed: long.len(),
            };
            assert_eq!(error, want, "limit {limit} op {}", op as char);
            assert!(error.code.closes_session());
            // Whatever follows (even the newline right after) does not change it.
            long.extend_from_slice(b"\nmore");
            assert_eq!(
                parse_request(&long, limit).unwrap_err().code,
                ErrorCode::KeyTooLong
            );
            assert_eq!(
                parse_request(&long, limit).unwrap_err().consumed,
                long.len()
            );
        }
    }
}

#[test]
fn code_3_empty_key_continues() {
    for op in *b"AREQC" {
        let owned = Owned::new(op, 1, 0xBEEF, b"");
        let mut buf = owned.bytes();
        let frame_len = buf.len();
        assert_eq!(
            frame_len,
            if op == b'A' {
                12
            } else if op == b'E' {
                11
            } else {
                10
            }
        );
        buf.extend_from_slice(b"Q");
        let error = parse_request(&buf, KEY_BYTES_MAX).unwrap_err();
        let want = FrameError {
            code: ErrorCode::EmptyKey,
            id: 0xBEEF,
            consumed: frame_len,
        };
        assert_eq!(error, want);
        assert!(!error.code.closes_session());
    }
}

#[test]
fn code_4_key_not_utf8_continues() {
    let bad_keys: [&[u8]; 6] = [
        b"\xff",
        b"ok\xc3",
        b"\xc3(",
        b"\xed\xa0\x80",
        b"\xc0\x80",
        b"\x80abc",
    ];
    for op in *b"AREQC" {
        for key in bad_keys {
            let owned = Owned::new(op, 1, 42, key);
            let buf = owned.bytes();
            let error = parse_request(&buf, KEY_BYTES_MAX).unwrap_err();
            let want = FrameError {
                code: ErrorCode::KeyNotUtf8,
                id: 42,
                consumed: buf.len(),
            };
            assert_eq!(error, want, "{key:?}");
            assert!(!error.code.closes_session());
        }
    }
}

#[test]
fn code_5_lease_zero_in_acquire_and_extend_only() {
    for op in *b"AE" {
        let buf = Owned::new(op, 0, 9, b"k").bytes();
        let error = parse_request(&buf, KEY_BYTES_MAX).unwrap_err();
        let want = FrameError {
            code: ErrorCode::LeaseZero,
            id: 9,
            consumed: buf.len(),
        };
        assert_eq!(error, want);
        assert!(!error.code.closes_session());
    }
    // A wait of 0 is a valid immediate attempt.
    let mut zero_wait = Owned::new(b'A', 1, 9, b"k");
    zero_wait.wait_s = 0;
    assert!(parse_request(&zero_wait.bytes(), KEY_BYTES_MAX)
        .unwrap()
        .is_some());
}

#[test]
fn code_6_ping_without_newline_closes() {
    for trailing in [0u8, b'k', b'P', 0xFF] {
        let buf = concat(&[b"P", &be(NEWLINES_U64), &[trailing], b"\n"]);
        let error = parse_request(&buf, KEY_BYTES_MAX).unwrap_err();
        let want = FrameError {
            code: ErrorCode::MissingNewline,
            id: NEWLINES_U64,
            consumed: buf.len(),
        };
        assert_eq!(error, want);
        assert!(error.code.closes_session());
    }
    assert_eq!(parse_request(&concat(&[b"P", &be(1)]), 8), Ok(None));
}

#[test]
fn lowest_code_wins() {
    let cases: [(u8, &[u8], usize, ErrorCode); 8] = [
        (0, b"", 8, ErrorCode::EmptyKey),
        (0, b"\xff", 8, ErrorCode::KeyNotUtf8),
        (0, b"\xffxxxxx", 4, ErrorCode::KeyTooLong),
        (0, b"xxxxx", 4, ErrorCode::KeyTooLong),
        (1, b"\xffxxxxx", 4, ErrorCode::KeyTooLong),
        (0, b"ok", 8, ErrorCode::LeaseZero),
        (1, b"", 8, ErrorCode::EmptyKey),
        (1, b"\xc3", 8, ErrorCode::KeyNotUtf8),
    ];
    for op in *b"AE" {
        for (lease_s, key, limit, code) in cases {
            let owned = Owned::new(op, lease_s, 5, key);
            let error = parse_request(&owned.bytes(), limit).unwrap_err();
            assert_eq!(
                error.code, code,
                "{} lease {lease_s} key {key:?}",
                op as char
            );
            assert_eq!(error.id, 5);
            assert_eq!(expected(&owned, limit), Outcome::Refused(code, 5));
        }
    }
}

#[test]
fn frame_error_response_and_error_code_table() {
    let closing = [1, 2, 6, 7];
    for byte in 0..=u8::MAX {
        let Some(code) = ErrorCode::from_u8(byte) else {
            assert!(byte == 0 || byte > 7, "{byte}");
            continue;
        };
        assert_eq!(code as u8, byte);
        assert_eq!(code.closes_session(), closing.contains(&byte), "{code}");
        assert!(code.to_string().contains(&format!("code {byte}")));
        let error = FrameError {
            code,
            id: 3,
            consumed: 1,
        };
        let bytes = encoded_response(&error.response());
        assert_eq!(bytes, concat(&[b"X", &[byte], &be(3), b"\n"]));
    }
}

#[test]
fn response_parser_errors() {
    for op in 0..=u8::MAX {
        if b"ATBRENQPX".contains(&op) {
            continue;
        }
        let buf = concat(&[&[op], &[b'\n'; 18]]);
        assert_eq!(parse_response(&buf), Err(ResponseError::UnknownOp(op)));
        assert_eq!(parse_response(&buf[..1]), Err(ResponseError::UnknownOp(op)));
    }
    let frames = [
        encoded_response(&Response::Acquired { owner: 1, token: 2 }),
        encoded_response(&Response::Busy { owner: 1 }),
        encoded_response(&Response::State {
            nonce: 1,
            held: true,
            lease_ms: 5,
            waiters: 2,
        }),
        encoded_response(&Response::Error {
            code: ErrorCode::EmptyKey,
            id: 4,
        }),
    ];
    for frame in &frames {
        let mut bad = frame.clone();
        *bad.last_mut().unwrap() = b'x';
        assert_eq!(
            parse_response(&bad),
            Err(ResponseError::MissingNewline(b'x'))
        );
    }
    let mut held = frames[2].clone();
    for byte in [2, 0x0A, 0xFF] {
        held[9] = byte;
        assert_eq!(parse_response(&held), Err(ResponseError::BadHeld(byte)));
    }
    let mut code = frames[3].clone();
    for byte in [0, 8, 0xFF] {
        code[1] = byte;
        assert_eq!(
            parse_response(&code),
            Err(ResponseError::UnknownErrorCode(byte))
        );
    }
    let errors = [
        ResponseError::UnknownOp(0x5A),
        ResponseError::MissingNewline(0x78),
        ResponseError::UnknownErrorCode(8),
        ResponseError::BadHeld(2),
    ];
    for (error, shown) in errors.iter().zip(["0x5a", "0x78", "code 8", "byte 2"]) {
        assert!(error.to_string().contains(shown), "{error}");
    }
}

// ---------------------------------------------------------------------------------------------
// Properties

/// Correlation ids, biased towards bytes that look like the end of a frame.
fn id_strategy() -> impl Strategy<Value = u64> {
    prop_oneof![
        any::<u64>(),
        Just(NEWLINES_U64),
        Just(0x0A),
        Just(0x0A << 56),
        Just(0),
        Just(u64::MAX),
    ]
}

/// A byte for wait or lease, biased towards 0 and 0x0A.
fn small_strategy() -> impl Strategy<Value = u8> {
    prop_oneof![any::<u8>(), Just(0), Just(0x0A), Just(1)]
}

/// Keys without `\n`: valid UTF-8 (usually), empty, or with a byte that breaks UTF-8.
fn key_strategy() -> impl Strategy<Value = Vec<u8>> {
    let text = "[^\n]{1,12}".prop_map(String::into_bytes);
    let bad = (
        "[^\n]{0,4}",
        prop::sample::select(vec![0xFFu8, 0xFE, 0xC3, 0x80]),
        "[^\n]{0,4}",
    )
        .prop_map(|(head, bad, tail)| concat(&[head.as_bytes(), &[bad], tail.as_bytes()]));
    prop_oneof![
        6 => text,
        1 => Just(Vec::new()),
        1 => bad,
        1 => (1usize..=48).prop_map(|len| vec![b'*'; len]),
    ]
}

fn owned_strategy() -> impl Strategy<Value = Owned> {
    let op = prop::sample::select(b"AERCQP".to_vec());
    (
        op,
        small_strategy(),
        small_strategy(),
        id_strategy(),
        key_strategy(),
    )
        .prop_map(|(op, wait_s, lease_s, id, key)| Owned {
            op,
            wait_s,
            lease_s,
            id,
            key,
        })
}

/// A frame the session cannot survive, placed at the end of a stream.
#[derive(Clone, Debug)]
enum Tail {
    None,
    UnknownOp(u8),
    PingWithoutNewline(u64, u8),
    /// An Acquire whose key is `limit + 1 + extra` bytes without a newline.
    TooLong(u64, usize),
}

fn tail_strategy() -> impl Strategy<Value = Tail> {
    let unknown = any::<u8>().prop_filter("unknown op", |op| !b"AERCQP".contains(op));
    prop_oneof![
        3 => Just(Tail::None),
        1 => unknown.prop_map(Tail::UnknownOp),
        1 => (id_strategy(), any::<u8>().prop_filter("not a newline", |&b| b != b'\n'))
            .prop_map(|(id, byte)| Tail::PingWithoutNewline(id, byte)),
        1 => (id_strategy(), 0usize..4).prop_map(|(id, extra)| Tail::TooLong(id, extra)),
    ]
}

impl Tail {
    fn append(&self, limit: usize, stream: &mut Vec<u8>, outcomes: &mut Vec<Outcome>) {
        match *self {
            Tail::None => {}
            Tail::UnknownOp(op) => {
                stream.extend_from_slice(&[op, b'\n', b'A']);
                outcomes.push(Outcome::Refused(ErrorCode::UnknownOp, 0));
            }
            Tail::PingWithoutNewline(id, byte) => {
                stream.extend_from_slice(&concat(&[b"P", &be(id), &[byte]]));
                outcomes.push(Outcome::Refused(ErrorCode::MissingNewline, id));
            }
            Tail::TooLong(id, extra) => {
                stream.extend_from_slice(&concat(&[b"A", &[1, 0], &be(id)]));
                stream.resize(stream.len() + limit + 1 + extra, b'k');
                outcomes.push(Outcome::Refused(ErrorCode::KeyTooLong, id));
            }
        }
    }

    fn closes(&self) -> bool {
        !matches!(self, Tail::None)
    }
}

/// Cut points from chunk lengths, ascending.
fn cuts_from(chunks: &[usize], len: usize) -> Vec<usize> {
    let mut at = 0;
    let mut cuts = Vec::new();
    for &chunk in chunks.iter().cycle().take(len) {
        at += chunk;
        if at >= len {
            break;
        }
        cuts.push(at);
    }
    cuts
}

/// Every request in `parse_request`'s answer for `buf` is sound, or the error is.
fn check_parse(buf: &[u8], limit: usize) -> Result<Option<usize>, TestCaseError> {
    match parse_request(buf, limit) {
        Ok(None) => Ok(None),
        Ok(Some((request, used))) => {
            prop_assert!(used >= 1 && used <= buf.len());
            prop_assert_eq!(encoded(&request), &buf[..used]);
            prop_assert_eq!(
                parse_request(&buf[..used], limit),
                Ok(Some((request, used)))
            );
            if let Some(key) = request.key() {
                prop_assert!(!key.is_empty() && key.len() <= limit);
                prop_assert!(std::str::from_utf8(key).is_ok() && !key.contains(&b'\n'));
            }
            if let Request::Acquire { lease_s, .. } | Request::Extend { lease_s, .. } = request {
                prop_assert!(lease_s > 0);
            }
            Ok(Some(used))
        }
        Err(error) => {
            prop_assert!(error.consumed <= buf.len());
            if error.code.closes_session() {
                prop_assert_eq!(error.consumed, buf.len());
                return Ok(None);
            }
            prop_assert!(error.consumed >= 1);
            let alone = parse_request(&buf[..error.consumed], limit);
            prop_assert_eq!(alone, Err(error));
            Ok(Some(error.consumed))
        }
    }
}

/// Bytes that often start like a frame, with newlines sprinkled in.
fn noise_strategy() -> impl Strategy<Value = Vec<u8>> {
    let byte = prop_oneof![4 => any::<u8>(), 1 => Just(b'\n'), 1 => Just(b'A'), 1 => Just(b'P')];
    prop_oneof![
        prop::collection::vec(any::<u8>(), 0..64),
        prop::collection::vec(byte.clone(), 0..300),
        (
            prop::sample::select(b"AERCQP".to_vec()),
            prop::collection::vec(byte, 0..1200)
        )
            .prop_map(|(op, rest)| concat(&[&[op], &rest])),
    ]
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]

    #[test]
    fn requests_round_trip(owned in owned_strategy(), limit in 1usize..=KEY_BYTES_MAX) {
        let bytes = owned.bytes();
        let outcome = expected(&owned, limit);
        let fed = feed(&bytes, &[], limit);
        prop_assert_eq!(&fed.outcomes, &vec![outcome.clone()]);
        if let Outcome::Frame(_) = outcome {
            let parsed = parse_request(&bytes, limit);
            prop_assert_eq!(parsed, Ok(Some((owned.request(), bytes.len()))));
            // Trailing bytes are the next frame's business.
            let mut longer = bytes.clone();
            longer.extend_from_slice(b"\xffjunk");
            prop_assert_eq!(parse_request(&longer, limit), Ok(Some((owned.request(), bytes.len()))));
            for end in 0..bytes.len() {
                prop_assert_eq!(parse_request(&bytes[..end], limit), Ok(None));
            }
        }
    }

    #[test]
    fn responses_round_trip(
        pick in 0usize..9,
        id in id_strategy(),
        token in id_strategy(),
        held in any::<bool>(),
        counts in (any::<u32>(), any::<u32>()),
        code in 1u8..=7,
    ) {
        let code = ErrorCode::from_u8(code).unwrap();
        let response = [
            Response::Acquired { owner: id, token },
            Response::Timeout { owner: id },
            Response::Busy { owner: id },
            Response::Released { token: id },
            Response::Extended { token: id },
            Response::NotHeld { token: id },
            Response::State { nonce: id, held, lease_ms: counts.0, waiters: counts.1 },
            Response::Pong { nonce: id },
            Response::Error { code, id },
        ][pick];
        let bytes = encoded_response(&response);
        prop_assert_eq!(bytes[0], response.op());
        prop_assert_eq!(response.correlation_id(), id);
        prop_assert_eq!(parse_response(&bytes), Ok(Some((response, bytes.len()))));
        let mut longer = bytes.clone();
        longer.push(b'Z');
        prop_assert_eq!(parse_response(&longer), Ok(Some((response, bytes.len()))));
        for end in 0..bytes.len() {
            prop_assert_eq!(parse_response(&bytes[..end]), Ok(None));
        }
    }

    #[test]
    fn streams_parse_the_same_however_split(
        frames in prop::collection::vec(owned_strategy(), 0..12),
        tail in tail_strategy(),
        limit in prop_oneof![Just(KEY_BYTES_MAX), 48usize..=64],
        chunks in prop::collection::vec(1usize..40, 1..8),
    ) {
        let mut stream = Vec::new();
        let mut outcomes = Vec::new();
        for frame in &frames {
            stream.extend_from_slice(&frame.bytes());
            outcomes.push(expected(frame, limit));
        }
        tail.append(limit, &mut stream, &mut outcomes);
        let whole = feed(&stream, &[], limit);
        prop_assert_eq!(&whole.outcomes, &outcomes);
        prop_assert_eq!((whole.closed, whole.leftover), (tail.closes(), 0));
        prop_assert_eq!(&feed(&stream, &cuts_from(&chunks, stream.len()), limit), &whole);
        for cut in 0..=stream.len() {
            prop_assert_eq!(&feed(&stream, &[cut], limit), &whole, "cut at {}", cut);
        }
    }

    #[test]
    fn small_limits_and_long_keys(
        limit in 1usize..=16,
        key_len in 1usize..=20,
        op in prop::sample::select(b"AERCQ".to_vec()),
        lease_s in small_strategy(),
        id in id_strategy(),
    ) {
        let owned = Owned { op, wait_s: 1, lease_s, id, key: vec![b'q'; key_len] };
        let bytes = owned.bytes();
        let fed = feed(&bytes, &[], limit);
        prop_assert_eq!(&fed.outcomes, &vec![expected(&owned, limit)]);
        prop_assert_eq!(fed.closed, key_len > limit);
    }

    #[test]
    fn arbitrary_bytes_never_panic(
        bytes in noise_strategy(),
        limit in prop_oneof![1usize..=16, 1usize..=KEY_BYTES_MAX],
    ) {
        let mut start = 0;
        // Bounded: every step consumes at least one byte or stops.
        while let Some(used) = check_parse(&bytes[start..], limit)? {
            start += used;
        }
        // Prefixes of noise are no different.
        for end in (0..=bytes.len()).step_by(7) {
            check_parse(&bytes[..end], limit)?;
        }
        let mut at = 0;
        while let Ok(Some((response, used))) = parse_response(&bytes[at..]) {
            prop_assert!(used >= 10 && used <= bytes.len() - at);
            prop_assert_eq!(encoded_response(&response), &bytes[at..at + used]);
            at += used;
        }
    }
}
