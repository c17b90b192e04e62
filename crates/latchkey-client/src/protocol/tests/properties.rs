//! Property tests: generated frames and streams round-trip or are refused as [`expected`]
//! says, however the stream is split, and arbitrary bytes never panic either parser.

use super::*;

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
    let unknown = any::<u8>().prop_filter("unknown op", |op| !b"AERCQPIW".contains(op));
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
