//! A shape check of a raft message's protobuf bytes, before protobuf parses them. No I/O.
//!
//! # Why
//!
//! The peer port has no authentication, and the `protobuf` 2.28 crate that parses peer messages
//! is listed by RUSTSEC-2024-0437 (uncontrolled recursion on crafted input: nested *groups*,
//! wire types 3 and 4, in unknown fields). In 2.28 itself, as its source reads
//! (`rt::read_unknown_or_skip_group`, `rt::skip_group`, `CodedInputStream::read_unknown`), an
//! unknown group is skipped by a loop and a group nested in it is an error, and nested messages
//! go through `incr_recursion` (limit 100) — and raft's schema nests messages at most four
//! deep (`Message` → `Snapshot` → `SnapshotMetadata` → `ConfState`). So the stack it uses is
//! bounded today; the advisory's recursion is in later versions' `skip_group`. What a peer
//! sends must not depend on that staying true across an upgrade of either crate, so every
//! message is checked here first, without recursion and without allocating:
//!
//! * every field has a valid wire type and lies within its enclosing message;
//! * no group wire type appears at any level walked (raft's schema has no groups);
//! * the walk descends only into the message fields of raft's schema (`child`), at most
//!   [`DEPTH_MAX`] levels; every other length-delimited field is opaque bytes, which protobuf
//!   2.28 stores without parsing (an unknown field) or reads as bytes (`data`, `context`).
//!
//! A message refused here closes the connection it came on, like any other bad frame.
//!
//! Deliberately not here: whether the fields make sense to raft (the member checks that) or to
//! the shard machine (`super::content`).

use std::fmt;

/// Levels of messages the walk enters at most: raft's schema nests four.
pub const DEPTH_MAX: usize = 4;

/// The message types of raft's schema that contain message fields, and their leaves.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Kind {
    Message,
    Entry,
    Snapshot,
    Metadata,
    ConfState,
}

/// The message type of field `field` of `kind`, if it is a message field.
fn child(kind: Kind, field: u64) -> Option<Kind> {
    match (kind, field) {
        (Kind::Message, 7) => Some(Kind::Entry),
        (Kind::Message, 9) => Some(Kind::Snapshot),
        (Kind::Snapshot, 2) => Some(Kind::Metadata),
        (Kind::Metadata, 1) => Some(Kind::ConfState),
        _ => None,
    }
}

/// Why a message's bytes were refused before parsing.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum WireError {
    /// A varint or a field runs past the end of its message (at this byte offset).
    Truncated(usize),
    /// A varint of more than ten bytes (at this byte offset).
    VarintTooLong(usize),
    /// A field number of 0 or above protobuf's largest (this number).
    FieldNumber(u64),
    /// A group (wire type 3 or 4) in field `field`: raft's schema has none.
    Group {
        /// The field number.
        field: u64,
    },
    /// A wire type protobuf does not define (6 or 7).
    WireType {
        /// The field number.
        field: u64,
        /// The wire type.
        wire_type: u64,
    },
    /// Messages nested deeper than raft's schema allows.
    TooDeep,
}

impl fmt::Display for WireError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match *self {
            WireError::Truncated(at) => write!(f, "protobuf truncated at byte {at}"),
            WireError::VarintTooLong(at) => write!(f, "protobuf varint too long at byte {at}"),
            WireError::FieldNumber(field) => write!(f, "protobuf field number {field}"),
            WireError::Group { field } => {
                write!(
                    f,
                    "protobuf group in field {field} (raft messages have none)"
                )
            }
            WireError::WireType { field, wire_type } => {
                write!(f, "protobuf wire type {wire_type} in field {field}")
            }
            WireError::TooDeep => {
                write!(f, "protobuf messages nested over {DEPTH_MAX} deep")
            }
        }
    }
}

/// Protobuf's largest field number.
const FIELD_MAX: u64 = (1 << 29) - 1;

/// Reads a varint at `*at`, before `end`.
fn varint(bytes: &[u8], at: &mut usize, end: usize) -> Result<u64, WireError> {
    let start = *at;
    let mut value = 0u64;
    for shift in 0..10 {
        let Some(&byte) = bytes.get(*at).filter(|_| *at < end) else {
            return Err(WireError::Truncated(start));
        };
        *at += 1;
        value |= u64::from(byte & 0x7f) << (7 * shift);
        if byte & 0x80 == 0 {
            return Ok(value);
        }
    }
    Err(WireError::VarintTooLong(start))
}

/// Skips `count` bytes at `*at`, before `end`.
fn skip(at: &mut usize, count: u64, end: usize) -> Result<(), WireError> {
    let next = usize::try_from(count)
        .ok()
        .and_then(|count| at.checked_add(count))
        .filter(|&next| next <= end)
        .ok_or(WireError::Truncated(*at))?;
    *at = next;
    Ok(())
}

/// Checks that `bytes` (a `raft::eraftpb::Message`) has the shape described in the module
/// docs. Linear in the bytes, no recursion, no allocation.
pub fn check(bytes: &[u8]) -> Result<(), WireError> {
    check_within(bytes, DEPTH_MAX)
}

/// [`check`] with at most `depth_max` (at most [`DEPTH_MAX`]) levels.
fn check_within(bytes: &[u8], depth_max: usize) -> Result<(), WireError> {
    let depth_max = depth_max.min(DEPTH_MAX);
    // The open messages: each one's type and where it ends.
    let mut open = [(Kind::Message, 0usize); DEPTH_MAX];
    open[0] = (Kind::Message, bytes.len());
    let mut depth = 1;
    let mut at = 0;
    // Bounded: every pass reads a tag (at least one byte) or closes a level opened by one.
    for _ in 0..=2 * bytes.len() {
        let (kind, end) = open[depth - 1];
        if at == end {
            depth -= 1;
            if depth == 0 {
                return Ok(());
            }
            continue;
        }
        let key = varint(bytes, &mut at, end)?;
        let (field, wire_type) = (key >> 3, key & 7);
        if field == 0 || field > FIELD_MAX {
            return Err(WireError::FieldNumber(field));
        }
        match wire_type {
            0 => {
                varint(bytes, &mut at, end)?;
            }
            1 => skip(&mut at, 8, end)?,
            5 => skip(&mut at, 4, end)?,
            2 => {
                let len = varint(bytes, &mut at, end)?;
                let start = at;
                skip(&mut at, len, end)?;
                if let Some(inner) = child(kind, field) {
                    if depth == depth_max {
                        return Err(WireError::TooDeep);
                    }
                    open[depth] = (inner, at);
                    depth += 1;
                    at = start;
                }
            }
            3 | 4 => return Err(WireError::Group { field }),
            _ => return Err(WireError::WireType { field, wire_type }),
        }
    }
    Err(WireError::Truncated(at))
}

#[cfg(test)]
#[path = "wire_tests.rs"]
mod tests;
