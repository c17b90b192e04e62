//! Record framing of the write-ahead log: `[len u32][crc32c u32][kind u8][shard u32][payload]`,
//! integers little-endian.
//!
//! `len` counts the bytes after the CRC (kind, shard and payload); the CRC-32C covers the same
//! bytes. A record is at most [`RECORD_BYTES_MAX`] bytes in all, checked on encode and decode.
//! Payloads are protobuf bytes: a `HardState`, a `Snapshot`, or an entry batch framed here as
//! `[len u32][Entry]...`. A checkpoint record (empty payload) opens a compacted segment.
//!
//! This module only turns values into bytes and back; it knows nothing of files or of what the
//! records mean for a group's log.

use protobuf::Message as _;
use raft::eraftpb::{Entry, HardState, Snapshot};

/// Bytes before the payload: length, CRC, kind and shard.
pub const HEADER_BYTES: usize = 4 + 4 + 1 + 4;

/// The largest record, header included (64 MiB). A bigger write is refused, and a bigger length
/// found on disk is damage.
pub const RECORD_BYTES_MAX: usize = 64 << 20;

/// What a record holds.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Kind {
    /// A batch of entries appended to a group's log.
    Entries = 1,
    /// A group's hard state.
    HardState = 2,
    /// A group's snapshot.
    Snapshot = 3,
    /// The first record of a compacted segment: what follows is the whole live state, and
    /// older segments are superseded.
    Checkpoint = 4,
}

impl Kind {
    fn from_byte(byte: u8) -> Option<Kind> {
        match byte {
            1 => Some(Kind::Entries),
            2 => Some(Kind::HardState),
            3 => Some(Kind::Snapshot),
            4 => Some(Kind::Checkpoint),
            _ => None,
        }
    }
}

/// A record's decoded content.
#[derive(Debug)]
pub enum Body {
    /// Entries appended to the shard's log.
    Entries(Vec<Entry>),
    /// The shard's hard state.
    HardState(HardState),
    /// The shard's snapshot.
    Snapshot(Snapshot),
    /// A compacted segment starts here.
    Checkpoint,
}

/// Why bytes are not a record.
#[derive(Debug, PartialEq, Eq)]
pub enum Bad {
    /// The bytes end before the record does (a torn write, or the end of the log).
    Truncated,
    /// The record is complete but damaged (CRC, length, kind or payload).
    Corrupt(String),
}

/// CRC-32C (Castagnoli) of `bytes`: the `crc32c` crate, with the CPU's CRC instruction where
/// there is one (SSE 4.2, ARMv8), a table otherwise.
pub fn crc32c(bytes: &[u8]) -> u32 {
    crc32c::crc32c(bytes)
}

/// Appends one framed record to `out`. Fails (leaving `out` as it was) when the record would
/// exceed [`RECORD_BYTES_MAX`].
pub fn encode(out: &mut Vec<u8>, shard: u32, body: &BodyRef<'_>) -> Result<usize, String> {
    let start = out.len();
    out.extend_from_slice(&[0u8; 8]);
    out.push(body.kind() as u8);
    out.extend_from_slice(&shard.to_le_bytes());
    let written = match body {
        BodyRef::Entries(entries) => encode_entries(out, start, entries),
        BodyRef::HardState(hard_state) => encode_message(out, start, *hard_state),
        BodyRef::Snapshot(snapshot) => encode_message(out, start, *snapshot),
        BodyRef::Checkpoint => Ok(()),
    };
    let total = out.len() - start;
    if let Err(error) = written.and_then(|()| check_size(total)) {
        out.truncate(start);
        return Err(error);
    }
    let len = (total - 8) as u32;
    let crc = crc32c(&out[start + 8..]);
    out[start..start + 4].copy_from_slice(&len.to_le_bytes());
    out[start + 4..start + 8].copy_from_slice(&crc.to_le_bytes());
    Ok(total)
}

/// The bytes `body` takes once framed, header included (computed, not encoded; saturating).
pub fn encoded_bytes(body: &BodyRef<'_>) -> u64 {
    use protobuf::Message as _;
    let payload = match body {
        BodyRef::Entries(entries) => entries.iter().fold(0u64, |sum, e| {
            sum.saturating_add(4 + e.compute_size() as u64)
        }),
        BodyRef::HardState(hard_state) => hard_state.compute_size() as u64,
        BodyRef::Snapshot(snapshot) => snapshot.compute_size() as u64,
        BodyRef::Checkpoint => 0,
    };
    payload.saturating_add(HEADER_BYTES as u64)
}

/// A record's content by reference, for encoding.
pub enum BodyRef<'a> {
    /// Entries appended to the shard's log.
    Entries(&'a [Entry]),
    /// The shard's hard state.
    HardState(&'a HardState),
    /// The shard's snapshot.
    Snapshot(&'a Snapshot),
    /// A compacted segment starts here.
    Checkpoint,
}

impl BodyRef<'_> {
    fn kind(&self) -> Kind {
        match self {
            BodyRef::Entries(_) => Kind::Entries,
            BodyRef::HardState(_) => Kind::HardState,
            BodyRef::Snapshot(_) => Kind::Snapshot,
            BodyRef::Checkpoint => Kind::Checkpoint,
        }
    }
}

fn check_size(total: usize) -> Result<(), String> {
    if total > RECORD_BYTES_MAX {
        return Err(format!(
            "record of {total} bytes over the limit of {RECORD_BYTES_MAX}"
        ));
    }
    Ok(())
}

fn encode_message(
    out: &mut Vec<u8>,
    start: usize,
    message: &dyn protobuf::Message,
) -> Result<(), String> {
    let size = message.compute_size() as usize;
    check_size(out.len() - start + size)?;
    message
        .write_to_vec(out)
        .map_err(|error| format!("protobuf encoding: {error}"))
}

fn encode_entries(out: &mut Vec<u8>, start: usize, entries: &[Entry]) -> Result<(), String> {
    for entry in entries {
        let size = entry.compute_size() as usize;
        check_size(out.len() - start + 4 + size)?;
        out.extend_from_slice(&(size as u32).to_le_bytes());
        entry
            .write_to_vec(out)
            .map_err(|error| format!("protobuf encoding: {error}"))?;
    }
    Ok(())
}

/// Decodes the record at the start of `bytes`: its shard, its body and its total length.
pub fn decode(bytes: &[u8]) -> Result<(u32, Body, usize), Bad> {
    let Some(header) = bytes.get(..8) else {
        return Err(Bad::Truncated);
    };
    let len = u32::from_le_bytes([header[0], header[1], header[2], header[3]]) as usize;
    let crc = u32::from_le_bytes([header[4], header[5], header[6], header[7]]);
    if !(HEADER_BYTES - 8..=RECORD_BYTES_MAX - 8).contains(&len) {
        return Err(Bad::Corrupt(format!("record length {len} out of range")));
    }
    let Some(rest) = bytes.get(8..8 + len) else {
        return Err(Bad::Truncated);
    };
    if crc32c(rest) != crc {
        return Err(Bad::Corrupt("CRC mismatch".to_string()));
    }
    let kind = Kind::from_byte(rest[0])
        .ok_or_else(|| Bad::Corrupt(format!("unknown record kind {}", rest[0])))?;
    let shard = u32::from_le_bytes([rest[1], rest[2], rest[3], rest[4]]);
    let payload = &rest[5..];
    let body = decode_body(kind, payload).map_err(Bad::Corrupt)?;
    Ok((shard, body, 8 + len))
}

fn decode_body(kind: Kind, payload: &[u8]) -> Result<Body, String> {
    let parse_error = |error: protobuf::ProtobufError| format!("protobuf: {error}");
    match kind {
        Kind::Entries => decode_entries(payload).map(Body::Entries),
        Kind::HardState => HardState::parse_from_bytes(payload)
            .map(Body::HardState)
            .map_err(parse_error),
        Kind::Snapshot => Snapshot::parse_from_bytes(payload)
            .map(Body::Snapshot)
            .map_err(parse_error),
        Kind::Checkpoint if payload.is_empty() => Ok(Body::Checkpoint),
        Kind::Checkpoint => Err("checkpoint with a payload".to_string()),
    }
}

fn decode_entries(mut payload: &[u8]) -> Result<Vec<Entry>, String> {
    let mut entries = Vec::new();
    // Bounded: each turn consumes at least the 4 length bytes of a payload of bounded size.
    while !payload.is_empty() {
        let Some(len_bytes) = payload.get(..4) else {
            return Err("entry batch: truncated length".to_string());
        };
        let len = u32::from_le_bytes([len_bytes[0], len_bytes[1], len_bytes[2], len_bytes[3]]);
        let Some(bytes) = payload.get(4..4 + len as usize) else {
            return Err("entry batch: entry past the record's end".to_string());
        };
        let entry = Entry::parse_from_bytes(bytes).map_err(|error| format!("entry: {error}"))?;
        entries.push(entry);
        payload = &payload[4 + len as usize..];
    }
    Ok(entries)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn crc32c_check_value() {
        assert_eq!(crc32c(b"123456789"), 0xE306_9283);
        assert_eq!(crc32c(b""), 0);
    }

    #[test]
    fn round_trip_and_every_cut_is_truncated() {
        let entries: Vec<Entry> = (1..4)
            .map(|index| Entry {
                index,
                term: 2,
                data: vec![7; index as usize].into(),
                ..Default::default()
            })
            .collect();
        let mut out = Vec::new();
        let total = encode(&mut out, 9, &BodyRef::Entries(&entries)).expect("encode");
        assert_eq!(total, out.len());
        assert_eq!(encoded_bytes(&BodyRef::Entries(&entries)), total as u64);
        let (shard, body, used) = decode(&out).expect("decode");
        assert_eq!((shard, used), (9, total));
        assert!(matches!(body, Body::Entries(decoded) if decoded == entries));
        for cut in 0..out.len() {
            assert_eq!(
                decode(&out[..cut]).err(),
                Some(Bad::Truncated),
                "cut at {cut}"
            );
        }
    }

    #[test]
    fn a_flipped_bit_is_corrupt() {
        let mut out = Vec::new();
        let hard_state = HardState {
            term: 3,
            vote: 1,
            commit: 2,
            ..Default::default()
        };
        encode(&mut out, 1, &BodyRef::HardState(&hard_state)).expect("encode");
        for byte in 8..out.len() {
            let mut bad = out.clone();
            bad[byte] ^= 0x10;
            assert!(matches!(decode(&bad), Err(Bad::Corrupt(_))), "byte {byte}");
        }
    }

    #[test]
    fn an_oversized_record_is_refused_and_leaves_nothing() {
        let big = [Entry {
            data: vec![0; RECORD_BYTES_MAX].into(),
            ..Default::default()
        }];
        assert!(encoded_bytes(&BodyRef::Entries(&big)) > RECORD_BYTES_MAX as u64);
        let mut out = vec![1, 2, 3];
        assert!(encode(&mut out, 0, &BodyRef::Entries(&big)).is_err());
        assert_eq!(out, vec![1, 2, 3]);
    }
}
