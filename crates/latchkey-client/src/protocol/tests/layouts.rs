//! The byte layouts of every request and response (docs/protocol.md §2.1, §2.2), and fixed headers
//! full of `0x0A` that must be consumed by length.

use super::*;

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

/// Every response kind with `id` and `token`, and the bytes it must encode to.
fn response_layout_cases(id: u64, token: u64) -> Vec<(Response, Vec<u8>)> {
    vec![
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
        (
            Response::Moved {
                id,
                leader: Leader::at("10.1.2.3:7421".parse().unwrap()),
            },
            concat(&[
                b"M",
                &be(id),
                &[0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0xFF, 0xFF, 10, 1, 2, 3],
                &[0x1C, 0xFD],
                b"\n",
            ]),
        ),
        (
            Response::Moved {
                id,
                leader: Leader::UNKNOWN,
            },
            concat(&[b"M", &be(id), &[0; 18], b"\n"]),
        ),
    ]
}

#[test]
fn response_layouts() {
    let id = 0x0102_0304_0506_0708;
    let token = 0x1112_1314_1516_1718;
    let cases = response_layout_cases(id, token);
    for (response, want) in &cases {
        let bytes = encoded_response(response);
        assert_eq!(&bytes, want, "{response:?}");
        let len = match response.op() {
            b'A' => 18,
            b'Q' => 19,
            b'X' => 11,
            b'M' => 28,
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
    assert_eq!(encoded_response(&state).len(), 19);
    let moved = Response::Moved {
        id: 1,
        leader: Leader::at("[2001:db8::1]:65535".parse().unwrap()),
    };
    assert_eq!(encoded_response(&moved).len(), RESPONSE_BYTES_MAX);
}

#[test]
fn moved_names_ipv4_ipv6_or_no_leader() {
    for addr in ["127.0.0.1:7420", "[::1]:7420", "[2001:db8::7]:1"] {
        let addr: std::net::SocketAddr = addr.parse().unwrap();
        assert_eq!(Leader::at(addr).addr(), Some(addr));
    }
    assert_eq!(Leader::UNKNOWN.addr(), None);
    // Port 0 or the unspecified address is "no leader known".
    assert_eq!(Leader::at("10.0.0.1:0".parse().unwrap()).addr(), None);
    assert_eq!(Leader::at("0.0.0.0:7420".parse().unwrap()).addr(), None);
    assert_eq!(Leader::at("[::]:7420".parse().unwrap()).addr(), None);
    // A response stays a small Copy value.
    assert!(std::mem::size_of::<Response>() <= 32);
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
// Resumable calls (§5)

#[test]
fn identify_is_27_bytes_and_resolve_is_10_plus_key_bytes() {
    let client = 0x0102_0304_0506_0708_090A_0B0C_0D0E_0F10u128;
    let identify = Request::Identify {
        grace_s: 10,
        client,
        nonce: 0x0A0A_0A0A_0A0A_0A0A,
    };
    let bytes = encoded(&identify);
    let want = concat(&[b"I", &[10], &client.to_be_bytes(), &[0x0A; 8], b"\n"]);
    assert_eq!(bytes, want);
    assert_eq!(bytes.len(), 27);
    assert_eq!(identify.key(), None);
    assert_eq!(identify.correlation_id(), 0x0A0A_0A0A_0A0A_0A0A);
    assert_eq!(
        parse_request(&bytes, KEY_BYTES_MAX),
        Ok(Some((identify, 27)))
    );
    for prefix in 0..bytes.len() {
        assert_eq!(parse_request(&bytes[..prefix], KEY_BYTES_MAX), Ok(None));
    }
    let mut bad = bytes.clone();
    bad[26] = b'x';
    let error = parse_request(&bad, KEY_BYTES_MAX).unwrap_err();
    assert_eq!(
        (error.code, error.id),
        (ErrorCode::MissingNewline, 0x0A0A_0A0A_0A0A_0A0A)
    );
    let key = b"lock/1";
    let resolve = Request::Resolve { owner: 9, key };
    let bytes = encoded(&resolve);
    assert_eq!(bytes, concat(&[b"W", &be(9), key, b"\n"]));
    assert_eq!(
        parse_request(&bytes, KEY_BYTES_MAX),
        Ok(Some((resolve, 10 + key.len())))
    );
}

#[test]
fn identified_and_resolved_layouts() {
    let identified = Response::Identified {
        nonce: 7,
        grace_s: 30,
    };
    let bytes = encoded_response(&identified);
    assert_eq!(bytes, concat(&[b"I", &be(7), &[30], b"\n"]));
    assert_eq!(parse_response(&bytes), Ok(Some((identified, 11))));
    let resolved = Response::Resolved {
        owner: 9,
        fate: Fate::Granted,
        token: 0x0102,
        lease_ms: 2_500,
    };
    let bytes = encoded_response(&resolved);
    let want = concat(&[
        b"W",
        &be(9),
        &[1],
        &be(0x0102),
        &2_500u32.to_be_bytes(),
        b"\n",
    ]);
    assert_eq!(bytes, want);
    assert_eq!(bytes.len(), 23);
    assert_eq!(parse_response(&bytes), Ok(Some((resolved, 23))));
    assert_eq!(parse_response(&bytes[..22]), Ok(None));
    for fate in 0..=4u8 {
        let fate = Fate::from_u8(fate).expect("a fate");
        let response = Response::Resolved {
            owner: 1,
            fate,
            token: 0,
            lease_ms: 0,
        };
        let bytes = encoded_response(&response);
        assert_eq!(parse_response(&bytes), Ok(Some((response, 23))));
    }
    let mut unknown = bytes.clone();
    unknown[9] = 5;
    assert_eq!(parse_response(&unknown), Err(ResponseError::UnknownFate(5)));
    for code in [9, 10] {
        let code = ErrorCode::from_u8(code).expect("defined");
        assert!(!code.closes_session());
    }
}
