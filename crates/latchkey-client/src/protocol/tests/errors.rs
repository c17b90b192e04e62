//! Every error code of docs/protocol.md §2.3: its correlation id, what it consumes, whether it
//! closes the session, and which code wins when a frame has several faults; and the response
//! parser's own errors.

use super::*;

// ---------------------------------------------------------------------------------------------
// Error codes (§2.3)

#[test]
fn code_1_unknown_op_has_id_0_and_closes() {
    for op in 0..=u8::MAX {
        if b"AERCQPIW".contains(&op) {
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
        if b"ATBRENQPXMIW".contains(&op) {
            continue;
        }
        let buf = concat(&[&[op], &[b'\n'; 27]]);
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
    for byte in [0, 11, 0xFF] {
        code[1] = byte;
        assert_eq!(
            parse_response(&code),
            Err(ResponseError::UnknownErrorCode(byte))
        );
    }
    let errors = [
        ResponseError::UnknownOp(0x5A),
        ResponseError::MissingNewline(0x78),
        ResponseError::UnknownErrorCode(9),
        ResponseError::BadHeld(2),
    ];
    for (error, shown) in errors.iter().zip(["0x5a", "0x78", "code 9", "byte 2"]) {
        assert!(error.to_string().contains(shown), "{error}");
    }
}

#[test]
fn code_8_is_a_known_error_that_does_not_close() {
    // docs/protocol.md §5: a client treats X code 8 as Rejected(8); the session goes on.
    let frame = [b'X', 8, 0, 0, 0, 0, 0, 0, 0, 42, b'\n'];
    let expected = Response::Error {
        code: ErrorCode::Forbidden,
        id: 42,
    };
    assert_eq!(parse_response(&frame), Ok(Some((expected, frame.len()))));
    assert!(!ErrorCode::Forbidden.closes_session());
    assert_eq!(ErrorCode::from_u8(8), Some(ErrorCode::Forbidden));
}
