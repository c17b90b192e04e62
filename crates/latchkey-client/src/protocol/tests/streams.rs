//! Streams of mixed frames split at every offset parse the same, and every strict prefix of a
//! frame is incomplete.

use super::*;

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
