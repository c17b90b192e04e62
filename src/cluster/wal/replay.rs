//! Recovery: find the segments, replay their records into the live state, cut a torn tail.
//!
//! Segments are `wal-<16 hex digits>.log`, named by the sequence number of their first record
//! and replayed in that order. Replay starts at the newest segment that opens with a checkpoint
//! (a compacted segment; older ones are superseded and deleted) or else at the oldest, and each
//! segment must start where the previous one ended: a gap is a lost segment, an error.
//!
//! Segments are preallocated (`wal.rs`), so a segment's records are followed by zeros up to its
//! allocated length: a record header of zeros ends a segment's records. In an older segment
//! everything after it must be zeros too (anything else is damage); records lost there would
//! also show as a gap in the sequence numbers.
//!
//! A record that is cut short or damaged ends the log if it is in the LAST segment (a crash
//! mid-write leaves exactly that): the file is truncated after the last good record (also after
//! a clean end at zeros, so that nothing a torn write left further on survives to be read as
//! records once the log has written past it). In any older segment it is corruption and
//! recovery fails, naming the file and the byte offset; committed data is never dropped
//! silently. Leftover `*.tmp` files (a compaction that did not finish) are deleted. Other files
//! are left alone.

use super::super::Recovered;
use super::record::{self, Bad, Body, RECORD_BYTES_MAX};
use super::state;
use std::collections::BTreeMap;
use std::fs;
use std::io;
use std::path::{Path, PathBuf};

/// The largest segment file read back (1 GiB): far above the rotation size plus one sync's
/// buffer, so only a damaged or foreign file reaches it.
pub const SEGMENT_FILE_BYTES_MAX: u64 = 1 << 30;

/// The name of the segment whose first record has sequence number `seq`.
pub fn segment_name(seq: u64) -> String {
    format!("wal-{seq:016x}.log")
}

/// The name of the temporary file a compaction writes before renaming it to `segment_name`.
pub fn temporary_name(seq: u64) -> String {
    format!("wal-{seq:016x}.tmp")
}

fn parse_name(name: &str) -> Option<(u64, bool)> {
    let rest = name.strip_prefix("wal-")?;
    let (hex, temporary) = match (rest.strip_suffix(".log"), rest.strip_suffix(".tmp")) {
        (Some(hex), _) => (hex, false),
        (None, Some(hex)) => (hex, true),
        (None, None) => return None,
    };
    if hex.len() != 16 {
        return None;
    }
    u64::from_str_radix(hex, 16)
        .ok()
        .map(|seq| (seq, temporary))
}

/// An error about `path` at byte `offset`.
pub fn corrupt(path: &Path, offset: u64, what: &str) -> io::Error {
    io::Error::new(
        io::ErrorKind::InvalidData,
        format!("{}: offset {offset}: {what}", path.display()),
    )
}

/// `error` with the path it is about in its message.
fn named(path: &Path, error: io::Error) -> io::Error {
    io::Error::new(error.kind(), format!("{}: {error}", path.display()))
}

/// Lists the segments in `dir` by sequence number, deleting leftover temporary files.
pub fn list_segments(dir: &Path) -> io::Result<Vec<(u64, PathBuf)>> {
    let mut segments = Vec::new();
    for item in fs::read_dir(dir)? {
        let item = item?;
        let name = item.file_name();
        let Some((seq, temporary)) = name.to_str().and_then(parse_name) else {
            continue;
        };
        if temporary {
            log::warn!(
                "wal: deleting unfinished compaction {}",
                item.path().display()
            );
            fs::remove_file(item.path())?;
        } else {
            segments.push((seq, item.path()));
        }
    }
    segments.sort();
    Ok(segments)
}

/// What replay found: the state of every group, and where the log goes on.
#[derive(Debug, Default)]
pub struct Replayed {
    /// The live state of every group seen.
    pub groups: BTreeMap<u32, Recovered>,
    /// The segments still in use, oldest first (superseded ones are deleted).
    pub segments: Vec<(u64, PathBuf)>,
    /// The sequence number of the next record.
    pub next_seq: u64,
    /// The length of the last segment's records (the file is cut there).
    pub last_bytes: u64,
    /// The length of the records of all segments but the last.
    pub older_bytes: u64,
}

/// Replays the segments of `dir` (which exists).
pub fn replay(dir: &Path) -> io::Result<Replayed> {
    let mut segments = list_segments(dir)?;
    let start = newest_checkpoint(&segments)?;
    for (_, path) in segments.drain(..start) {
        log::debug!("wal: deleting superseded segment {}", path.display());
        fs::remove_file(&path)?;
    }
    let mut replayed = Replayed {
        next_seq: segments.first().map_or(0, |(seq, _)| *seq),
        ..Replayed::default()
    };
    let count = segments.len();
    for (position, (seq, path)) in segments.iter().enumerate() {
        if *seq != replayed.next_seq {
            let what = format!("starts at record {seq}, expected {}", replayed.next_seq);
            return Err(corrupt(path, 0, &what));
        }
        let last = position + 1 == count;
        let (records, good_bytes) = replay_segment(path, last, &mut replayed.groups)?;
        replayed.next_seq += records;
        if last {
            replayed.last_bytes = good_bytes;
        } else {
            replayed.older_bytes += good_bytes;
        }
    }
    replayed.segments = segments;
    Ok(replayed)
}

/// The position of the newest segment that starts with a valid checkpoint record (0 if none).
fn newest_checkpoint(segments: &[(u64, PathBuf)]) -> io::Result<usize> {
    for (position, (_, path)) in segments.iter().enumerate().rev() {
        let mut head = [0u8; record::HEADER_BYTES];
        let read = read_prefix(path, &mut head).map_err(|error| named(path, error))?;
        if let Ok((_, Body::Checkpoint, _)) = record::decode(&head[..read]) {
            return Ok(position);
        }
    }
    Ok(0)
}

fn read_prefix(path: &Path, buffer: &mut [u8]) -> io::Result<usize> {
    use std::io::Read as _;
    let file = fs::File::open(path)?;
    let mut filled = 0;
    let mut limited = file.take(buffer.len() as u64);
    // Bounded: each turn reads at least one byte of a fixed-size buffer, or stops.
    loop {
        match limited.read(&mut buffer[filled..]) {
            Ok(0) => return Ok(filled),
            Ok(read) => filled += read,
            Err(error) if error.kind() == io::ErrorKind::Interrupted => {}
            Err(error) => return Err(error),
        }
    }
}

/// Replays one segment into `groups`: returns how many records it holds and their length. The
/// last segment is cut after its last good record.
fn replay_segment(
    path: &Path,
    last: bool,
    groups: &mut BTreeMap<u32, Recovered>,
) -> io::Result<(u64, u64)> {
    let size = fs::metadata(path)
        .map_err(|error| named(path, error))?
        .len();
    if size > SEGMENT_FILE_BYTES_MAX {
        let what = format!("segment of {size} bytes over the limit of {SEGMENT_FILE_BYTES_MAX}");
        return Err(corrupt(path, 0, &what));
    }
    let bytes = fs::read(path).map_err(|error| named(path, error))?;
    let (mut offset, mut records) = (0usize, 0u64);
    // Bounded: each turn consumes one record of at least HEADER_BYTES, or stops.
    while offset < bytes.len() {
        let rest = &bytes[offset..];
        let what = if rest[..rest.len().min(record::HEADER_BYTES)]
            .iter()
            .all(|byte| *byte == 0)
        {
            // The preallocated rest of the segment: its records end here.
            match rest.iter().position(|byte| *byte != 0) {
                None if last => break,
                None => return Ok((records, offset as u64)),
                Some(at) => format!("a zero record header, then data at offset {}", offset + at),
            }
        } else {
            match record::decode(rest) {
                Ok((shard, body, used)) => match apply(groups, shard, body) {
                    Ok(()) => {
                        offset += used;
                        records += 1;
                        continue;
                    }
                    Err(what) => what,
                },
                Err(Bad::Truncated) => "record cut short".to_string(),
                Err(Bad::Corrupt(what)) => what,
            }
        };
        if !last {
            return Err(corrupt(path, offset as u64, &what));
        }
        log::warn!(
            "wal: {}: offset {offset}: {what}; the log ends here",
            path.display()
        );
        break;
    }
    if last && (offset as u64) < size {
        cut(path, offset as u64).map_err(|error| named(path, error))?;
    }
    debug_assert!(RECORD_BYTES_MAX as u64 <= SEGMENT_FILE_BYTES_MAX);
    Ok((records, offset as u64))
}

/// Truncates `path` to `length` bytes and makes that durable.
fn cut(path: &Path, length: u64) -> io::Result<()> {
    let file = fs::OpenOptions::new().write(true).open(path)?;
    file.set_len(length)?;
    file.sync_all()
}

/// Applies one replayed record; a record the rules refuse is damage.
fn apply(groups: &mut BTreeMap<u32, Recovered>, shard: u32, body: Body) -> Result<(), String> {
    match body {
        Body::Checkpoint => {
            // Only valid first in a segment replay started from; anywhere else it would mean
            // the state before it is superseded, which replay did not do.
            if groups.is_empty() {
                Ok(())
            } else {
                Err("checkpoint after other records".to_string())
            }
        }
        Body::Entries(entries) => {
            let group = groups.entry(shard).or_default();
            state::check_append(group, &entries)?;
            state::append(group, &entries);
            Ok(())
        }
        Body::HardState(hard_state) => {
            state::set_hard_state(groups.entry(shard).or_default(), &hard_state);
            Ok(())
        }
        Body::Snapshot(snapshot) => {
            let group = groups.entry(shard).or_default();
            state::check_snapshot(group, &snapshot)?;
            state::apply_snapshot(group, &snapshot);
            Ok(())
        }
    }
}
