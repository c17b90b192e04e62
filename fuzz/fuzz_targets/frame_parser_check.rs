//! What the `frame_parser` fuzz target checks of `protocol::parse_request`, for any input:
//! shared by the target (`frame_parser.rs`) and the corpus replay of `tests/fuzz_corpus.rs`.
//!
//! Input: one byte that picks the key limit (0 → 1024, else 1..=255), then the bytes a session
//! would have buffered. The target walks them frame by frame as the reactor does and checks
//! what the parser promises: it never panics, never reads past the frame it reports, is
//! consistent on prefixes (a frame is incomplete until its last byte), re-encodes exactly,
//! and a refused frame ends at its newline unless its error closes the session.

use latchkey_client::protocol::{parse_request, FrameError, Request, KEY_BYTES_MAX};

/// Checks the parser on `data` (see the module docs); panics on a broken promise.
pub fn check(data: &[u8]) {
    let Some((&limit, mut rest)) = data.split_first() else {
        return;
    };
    let key_bytes_max = match limit {
        0 => KEY_BYTES_MAX,
        n => usize::from(n),
    };
    // Bounded: every pass consumes at least one byte or stops.
    loop {
        match parse_request(rest, key_bytes_max) {
            Ok(None) => return check_incomplete(rest, key_bytes_max),
            Ok(Some((request, used))) => {
                check_frame(rest, key_bytes_max, &request, used);
                rest = &rest[used..];
            }
            Err(error) => {
                check_refused(rest, key_bytes_max, error);
                if error.code.closes_session() {
                    return;
                }
                rest = &rest[error.consumed..];
            }
        }
    }
}

/// A few prefixes of a frame that is `used` bytes long: every one must be incomplete.
fn short_prefixes(used: usize) -> impl Iterator<Item = usize> {
    (0..used.min(13))
        .chain([used / 2, used.saturating_sub(1)])
        .filter(move |&k| k < used)
}

fn check_frame(buf: &[u8], key_bytes_max: usize, request: &Request<'_>, used: usize) {
    assert!(used > 0 && used <= buf.len());
    assert_eq!(used, request.encoded_len());
    let mut encoded = Vec::new();
    request.encode(&mut encoded);
    assert_eq!(
        &encoded[..],
        &buf[..used],
        "a parsed frame re-encodes to its bytes"
    );
    if let Some(key) = request.key() {
        assert!(!key.is_empty() && key.len() <= key_bytes_max);
        assert!(std::str::from_utf8(key).is_ok() && !key.contains(&b'\n'));
    }
    if let Request::Acquire { lease_s, .. } | Request::Extend { lease_s, .. } = *request {
        assert!(lease_s > 0);
    }
    let alone = parse_request(&buf[..used], key_bytes_max);
    assert_eq!(
        alone,
        Ok(Some((*request, used))),
        "the frame alone parses the same"
    );
    for k in short_prefixes(used) {
        assert_eq!(
            parse_request(&buf[..k], key_bytes_max),
            Ok(None),
            "prefix {k}"
        );
    }
}

fn check_refused(buf: &[u8], key_bytes_max: usize, error: FrameError) {
    assert!(error.consumed > 0 && error.consumed <= buf.len());
    if error.code.closes_session() {
        assert_eq!(
            error.consumed,
            buf.len(),
            "a closing error consumes everything"
        );
        return;
    }
    // A refused frame that lets the session go on is a whole frame: it ends at its newline,
    // and it is refused the same way with nothing after it.
    assert_eq!(buf[error.consumed - 1], b'\n');
    let alone = parse_request(&buf[..error.consumed], key_bytes_max);
    assert_eq!(
        alone,
        Err(error),
        "the refused frame alone is refused the same"
    );
    for k in short_prefixes(error.consumed) {
        assert_eq!(
            parse_request(&buf[..k], key_bytes_max),
            Ok(None),
            "prefix {k}"
        );
    }
}

/// An incomplete frame stays incomplete on its prefixes, and never holds a full key's worth
/// of bytes without a newline.
fn check_incomplete(buf: &[u8], key_bytes_max: usize) {
    assert!(
        buf.len() <= 1 + 10 + key_bytes_max,
        "an incomplete frame longer than any frame"
    );
    if let Some(k) = buf.len().checked_sub(1) {
        assert_eq!(parse_request(&buf[..k], key_bytes_max), Ok(None));
    }
}
