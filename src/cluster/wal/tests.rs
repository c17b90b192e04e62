//! Unit tests of the write-ahead log: round trips, log rules, torn tails, damage, rotation and
//! compaction (with crashes between its steps), limits; and the `measure` of group commit.

use super::*;
use crate::cluster::load;
use raft::eraftpb::ConfState;
use raft::Storage as _;
use std::sync::atomic::{AtomicU64, Ordering};

/// A fresh directory under the temp dir, removed on drop.
pub struct TempDir(pub PathBuf);

impl TempDir {
    pub fn new(name: &str) -> TempDir {
        static NEXT: AtomicU64 = AtomicU64::new(0);
        let unique = NEXT.fetch_add(1, Ordering::Relaxed);
        let pid = std::process::id();
        let path = std::env::temp_dir().join(format!("latchkey-wal-{name}-{pid}-{unique}"));
        let _ = fs::remove_dir_all(&path);
        TempDir(path)
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = fs::remove_dir_all(&self.0);
    }
}

pub fn entry(index: u64, term: u64) -> Entry {
    Entry {
        index,
        term,
        data: format!("e{index}t{term}").into_bytes().into(),
        ..Default::default()
    }
}

pub fn entries(range: std::ops::RangeInclusive<u64>, term: u64) -> Vec<Entry> {
    range.map(|index| entry(index, term)).collect()
}

pub fn snapshot(index: u64, term: u64) -> Snapshot {
    let mut snapshot = Snapshot::default();
    snapshot.set_data(format!("state at {index}").into_bytes().into());
    snapshot.mut_metadata().index = index;
    snapshot.mut_metadata().term = term;
    snapshot
        .mut_metadata()
        .set_conf_state(ConfState::from((vec![1, 2, 3], vec![])));
    snapshot
}

pub fn hard_state(term: u64, vote: u64, commit: u64) -> HardState {
    HardState {
        term,
        vote,
        commit,
        ..Default::default()
    }
}

fn options(segment_bytes: u64) -> Options {
    Options {
        fsync: false,
        segment_bytes,
        ..Options::default()
    }
}

fn reopen(dir: &Path, options: Options) -> (Wal, BTreeMap<u32, Recovered>) {
    let (wal, recovered) = Wal::open_with(dir, options).expect("open");
    (wal, recovered.into_iter().collect())
}

fn segment_files(dir: &Path) -> Vec<PathBuf> {
    let mut files: Vec<PathBuf> = fs::read_dir(dir)
        .expect("read_dir")
        .map(|item| item.expect("item").path())
        .collect();
    files.sort();
    files
}

#[test]
fn every_record_kind_round_trips_for_several_shards() {
    let dir = TempDir::new("round-trip");
    let (mut wal, recovered) = Wal::open(&dir.0, true).expect("open");
    assert!(recovered.is_empty());
    wal.append(0, &entries(1..=3, 1)).expect("append");
    wal.set_hard_state(0, &hard_state(1, 1, 2)).expect("hs");
    wal.apply_snapshot(7, &snapshot(10, 2)).expect("snapshot");
    wal.append(7, &entries(11..=12, 2)).expect("append");
    wal.set_hard_state(7, &hard_state(2, 3, 11)).expect("hs");
    wal.set_hard_state(3, &hard_state(4, 0, 0)).expect("hs");
    wal.sync().expect("sync");
    let expected = wal.groups.clone();
    drop(wal);
    let (_, recovered) = reopen(&dir.0, Options::default());
    assert_eq!(recovered, expected);
    assert_eq!(recovered[&0].entries, entries(1..=3, 1));
    assert_eq!(recovered[&3].hard_state, hard_state(4, 0, 0));
    let storage = load(&recovered[&7], &[1, 2, 3]).expect("load");
    assert_eq!(storage.first_index().expect("first"), 11);
    assert_eq!(storage.last_index().expect("last"), 12);
    let state = storage.initial_state().expect("state");
    assert_eq!(state.hard_state, hard_state(2, 3, 11));
}

#[test]
fn a_flush_writes_without_syncing_or_rotating_and_the_next_sync_covers_it() {
    let dir = TempDir::new("flush");
    let (mut wal, _) = Wal::open_with(&dir.0, options(4096)).expect("open");
    wal.append(4, &entries(1..=400, 1)).expect("append");
    wal.set_hard_state(4, &hard_state(1, 1, 3)).expect("hs");
    wal.flush().expect("flush");
    assert_eq!(
        (wal.stats.flushes, wal.stats.syncs, wal.stats.rotations),
        (1, 0, 0)
    );
    assert!(
        wal.file_bytes > 4096,
        "past the segment size, yet no rotation"
    );
    assert!(wal.synced_bytes < wal.file_bytes, "flushed, not synced");
    // In the file (a process crash keeps it); only a sync makes it durable on the disk.
    let (_, recovered) = reopen(&dir.0, options(4096));
    assert_eq!(recovered[&4].entries, entries(1..=400, 1));
    wal.flush().expect("an empty flush");
    assert_eq!(wal.stats.flushes, 1, "nothing written");
    // A sync with an empty buffer still syncs what was flushed, then rotates.
    wal.sync().expect("sync");
    assert_eq!((wal.stats.syncs, wal.synced_bytes), (1, wal.file_bytes));
    assert_eq!(wal.stats.rotations + wal.stats.compactions, 1);
    wal.sync().expect("a sync with nothing to do");
    assert_eq!(wal.stats.syncs, 1);
}

#[test]
fn conflicting_appends_replace_the_suffix() {
    let dir = TempDir::new("suffix");
    let (mut wal, _) = Wal::open(&dir.0, false).expect("open");
    wal.append(1, &entries(1..=5, 1)).expect("append");
    wal.append(1, &entries(3..=4, 2)).expect("append");
    wal.append(1, &entries(5..=5, 3)).expect("append");
    wal.sync().expect("sync");
    drop(wal);
    let (_, recovered) = reopen(&dir.0, options(SEGMENT_BYTES_DEFAULT));
    let mut expected = entries(1..=2, 1);
    expected.extend(entries(3..=4, 2));
    expected.extend(entries(5..=5, 3));
    assert_eq!(recovered[&1].entries, expected);
}

#[test]
fn a_snapshot_drops_earlier_entries_and_a_mismatched_one_drops_all() {
    let dir = TempDir::new("snapshot");
    let (mut wal, _) = Wal::open(&dir.0, false).expect("open");
    wal.append(2, &entries(1..=10, 1)).expect("append");
    wal.apply_snapshot(2, &snapshot(6, 1))
        .expect("local snapshot");
    wal.sync().expect("sync");
    drop(wal);
    let (mut wal, recovered) = reopen(&dir.0, options(SEGMENT_BYTES_DEFAULT));
    assert_eq!(recovered[&2].entries, entries(7..=10, 1));
    // A leader's snapshot whose term does not match the log's: every entry goes.
    wal.apply_snapshot(2, &snapshot(8, 5))
        .expect("leader snapshot");
    wal.sync().expect("sync");
    drop(wal);
    let (_, recovered) = reopen(&dir.0, options(SEGMENT_BYTES_DEFAULT));
    assert!(recovered[&2].entries.is_empty());
    assert_eq!(recovered[&2].snapshot, Some(snapshot(8, 5)));
    let storage = load(&recovered[&2], &[1, 2, 3]).expect("load");
    assert_eq!(storage.first_index().expect("first"), 9);
    // No hard state was written: the snapshot's commit and term stand in for it.
    assert_eq!(recovered[&2].hard_state, hard_state(5, 0, 8));
}

#[test]
fn writes_that_break_the_log_rules_are_refused_and_change_nothing() {
    let dir = TempDir::new("refused");
    let (mut wal, _) = Wal::open(&dir.0, false).expect("open");
    wal.append(0, &entries(1..=5, 1)).expect("append");
    wal.apply_snapshot(0, &snapshot(3, 1)).expect("snapshot");
    let before = wal.groups.clone();
    let gap = wal.append(0, &entries(7..=8, 1)).expect_err("gap");
    assert_eq!(gap.kind(), io::ErrorKind::InvalidInput);
    assert!(
        wal.append(0, &entries(2..=4, 1)).is_err(),
        "below the snapshot"
    );
    let holes = vec![entry(4, 1), entry(6, 1)];
    assert!(wal.append(0, &holes).is_err(), "not contiguous");
    assert!(
        wal.apply_snapshot(0, &snapshot(2, 1)).is_err(),
        "older snapshot"
    );
    assert!(
        wal.append(9, &entries(2..=2, 1)).is_err(),
        "a fresh group starts at 1"
    );
    assert_eq!(wal.groups, before);
    wal.sync().expect("sync");
    drop(wal);
    assert_eq!(reopen(&dir.0, options(SEGMENT_BYTES_DEFAULT)).1, before);
}

#[test]
fn the_buffer_is_bounded() {
    let dir = TempDir::new("buffer");
    let small = Options {
        fsync: false,
        segment_bytes: SEGMENT_BYTES_DEFAULT,
        buffer_bytes: 4096,
    };
    let (mut wal, _) = Wal::open_with(&dir.0, small).expect("open");
    let mut index = 1;
    let error = loop {
        match wal.append(0, &entries(index..=index, 1)) {
            Ok(()) => index += 1,
            Err(error) => break error,
        }
        assert!(index < 4096, "the buffer never filled");
    };
    assert_eq!(error.kind(), io::ErrorKind::OutOfMemory);
    assert!(wal.buffer.len() <= 4096);
    wal.sync().expect("sync");
    wal.append(0, &entries(index..=index, 1))
        .expect("room again after a sync");
}

/// The segment size of the torn-write tests: small, so that each of their many reopens reads
/// little.
const SEGMENT: u64 = 64 << 10;

/// Writes `first` records and syncs, then one more record and syncs; returns the file, its
/// records' bytes (not the preallocated zeros after them), where the last record starts, and
/// the state before it.
fn two_syncs(dir: &Path) -> (PathBuf, Vec<u8>, usize, BTreeMap<u32, Recovered>) {
    let (mut wal, _) = Wal::open_with(dir, options(SEGMENT)).expect("open");
    wal.append(4, &entries(1..=3, 1)).expect("append");
    wal.set_hard_state(4, &hard_state(1, 2, 1)).expect("hs");
    wal.sync().expect("sync");
    let before = wal.groups.clone();
    let start = wal.file_bytes as usize;
    wal.append(4, &entries(3..=4, 2)).expect("append");
    wal.sync().expect("sync");
    let path = wal.segments[0].1.clone();
    let length = wal.file_bytes as usize;
    drop(wal);
    let mut bytes = fs::read(&path).expect("read");
    assert_eq!(
        bytes.len() as u64,
        start as u64 + SEGMENT,
        "preallocated at the first write; the second fitted"
    );
    assert!(bytes[length..].iter().all(|byte| *byte == 0));
    bytes.truncate(length);
    (path, bytes, start, before)
}

/// `bytes` followed by zeros (as far as the tests' segment size): what a crash leaves of a
/// write into a preallocated segment that reached the disk only up to `bytes.len()`.
fn with_zero_tail(bytes: &[u8]) -> Vec<u8> {
    let mut file = bytes.to_vec();
    file.resize(SEGMENT as usize, 0);
    file
}

#[test]
fn a_torn_last_record_at_every_offset_is_cut_off() {
    let dir = TempDir::new("torn");
    let (path, bytes, start, before) = two_syncs(&dir.0);
    // A torn write leaves a shorter file (no preallocation) or zeros where it did not reach.
    for zeros in [false, true] {
        for cut in start..bytes.len() {
            let file = if zeros {
                with_zero_tail(&bytes[..cut])
            } else {
                bytes[..cut].to_vec()
            };
            fs::write(&path, file).expect("write");
            let (mut wal, recovered) = reopen(&dir.0, options(SEGMENT));
            assert_eq!(recovered, before, "cut at {cut}, zeros {zeros}");
            assert_eq!(wal.file_bytes, start as u64, "cut at {cut}, zeros {zeros}");
            // The log goes on after the cut.
            wal.append(4, &entries(4..=4, 3)).expect("append");
            wal.sync().expect("sync");
            drop(wal);
            let (_, again) = reopen(&dir.0, options(SEGMENT));
            assert_eq!(again[&4].entries.last(), Some(&entry(4, 3)), "cut at {cut}");
        }
    }
}

#[test]
fn a_segment_is_preallocated_a_step_ahead_of_its_records() {
    let dir = TempDir::new("prealloc");
    let (mut wal, _) = Wal::open_with(&dir.0, options(SEGMENT_BYTES_DEFAULT)).expect("open");
    let path = wal.segments[0].1.clone();
    let big = |index| Entry {
        index,
        term: 1,
        data: vec![7u8; 64 << 10].into(),
        ..Default::default()
    };
    let mut extensions = 0;
    let mut length = fs::metadata(&path).expect("meta").len();
    // 10 MiB of records: past the first step twice.
    for index in 1..=160 {
        wal.append(0, &[big(index)]).expect("append");
        wal.sync().expect("sync");
        let now = fs::metadata(&path).expect("meta").len();
        assert!(
            now >= wal.file_bytes && now - wal.file_bytes <= PREALLOCATE_BYTES,
            "records {} in a file of {now} bytes",
            wal.file_bytes
        );
        extensions += u64::from(now != length);
        length = now;
    }
    assert_eq!(
        extensions,
        wal.file_bytes / PREALLOCATE_BYTES + 1,
        "one extension per step"
    );
    let records = wal.file_bytes;
    drop(wal);
    let (wal, recovered) = reopen(&dir.0, options(SEGMENT_BYTES_DEFAULT));
    assert_eq!(recovered[&0].entries.len(), 160);
    assert_eq!(wal.file_bytes, records);
    assert_eq!(
        fs::metadata(&path).expect("meta").len(),
        records,
        "cut at open"
    );
}

#[test]
fn data_after_the_zeros_of_the_last_segment_is_cut_off_and_never_read_later() {
    // A torn write whose later page reached the disk and its earlier one did not: zeros, then
    // bytes. The records before the zeros are kept, and the bytes after them are cut, so that
    // they are not read as records once the log has written up to them.
    let dir = TempDir::new("after-zeros");
    let (path, bytes, start, before) = two_syncs(&dir.0);
    let mut file = with_zero_tail(&bytes[..start]);
    file[start + 300..bytes.len() + 300].copy_from_slice(&bytes[start..]);
    fs::write(&path, file).expect("write");
    let (mut wal, recovered) = reopen(&dir.0, options(SEGMENT));
    assert_eq!(recovered, before);
    let after = fs::read(&path).expect("read");
    assert!(after[start..].iter().all(|byte| *byte == 0), "cut");
    for index in 4..=40 {
        wal.append(4, &entries(index..=index, 3)).expect("append");
        wal.sync().expect("sync");
    }
    drop(wal);
    let (_, again) = reopen(&dir.0, options(SEGMENT));
    assert_eq!(again[&4].entries.last(), Some(&entry(40, 3)));
}

#[test]
fn a_flipped_bit_in_the_last_record_cuts_it_off() {
    let dir = TempDir::new("flip-last");
    let (path, bytes, start, before) = two_syncs(&dir.0);
    for byte in start..bytes.len() {
        let mut bad = bytes.clone();
        bad[byte] ^= 0x04;
        fs::write(&path, &bad).expect("write");
        let (_, recovered) = reopen(&dir.0, options(SEGMENT));
        assert_eq!(recovered, before, "bit flipped in byte {byte}");
    }
}

#[test]
fn a_flipped_bit_in_an_older_segment_is_an_error_naming_the_file() {
    let dir = TempDir::new("flip-older");
    three_segments(&dir.0);
    let files = segment_files(&dir.0);
    let victim = &files[1];
    let mut bytes = fs::read(victim).expect("read");
    bytes[100] ^= 0x01;
    fs::write(victim, &bytes).expect("write");
    let error = Wal::open_with(&dir.0, options(4096))
        .err()
        .expect("corruption refused");
    assert_eq!(error.kind(), io::ErrorKind::InvalidData);
    let message = error.to_string();
    let name = victim.file_name().and_then(|n| n.to_str()).expect("name");
    assert!(
        message.contains(name) && message.contains("offset"),
        "{message}"
    );
}

/// Drives group 0 and 1 forward (with snapshots trailing the log if `snapshots`), syncing after
/// each step, until `until` holds. Returns the next index.
fn drive(
    wal: &mut Wal,
    mut index: u64,
    snapshots: bool,
    until: impl Fn(&Wal) -> bool,
) -> io::Result<u64> {
    // Bounded by the assertion on `index`.
    while !until(wal) {
        assert!(index < 100_000, "drive never reached its goal");
        for shard in 0..2 {
            wal.append(shard, &entries(index..=index + 4, 1))?;
            wal.set_hard_state(shard, &hard_state(1, 1, index + 4))?;
            if snapshots && index > 20 {
                wal.apply_snapshot(shard, &snapshot(index - 10, 1))?;
            }
        }
        index += 5;
        wal.sync()?;
    }
    Ok(index)
}

#[test]
fn rotation_and_compaction_keep_exactly_the_live_state() {
    let dir = TempDir::new("compact");
    let (mut wal, _) = Wal::open_with(&dir.0, options(4096)).expect("open");
    drive(&mut wal, 1, true, |wal| wal.stats().compactions >= 3).expect("drive");
    assert!(
        wal.file_bytes() < 3 * 4096,
        "compaction bounds the files: {}",
        wal.file_bytes()
    );
    let expected = wal.groups.clone();
    assert_eq!(
        expected[&0].entries.len(),
        14,
        "ten after the snapshot, plus the last batch"
    );
    drop(wal);
    assert!(segment_files(&dir.0).len() <= 2);
    let (_, recovered) = reopen(&dir.0, options(4096));
    assert_eq!(recovered, expected);
}

#[test]
fn a_crash_between_compaction_steps_loses_nothing() {
    for step in [Step::TemporaryWritten, Step::Renamed, Step::OneDeleted] {
        let dir = TempDir::new("compact-crash");
        let (mut wal, _) = Wal::open_with(&dir.0, options(4096)).expect("open");
        // Without snapshots everything stays live: rotations, no compaction. Then snapshots
        // make most of it dead, and a compaction has several segments to delete.
        let index = drive(&mut wal, 1, false, |wal| wal.segments.len() >= 3).expect("drive");
        assert_eq!(wal.stats().compactions, 0);
        wal.crash_at = Some(step);
        let crashed = drive(&mut wal, index, true, |wal| wal.poisoned);
        assert!(crashed.is_err(), "{step:?}: the crash point was reached");
        let expected = wal.groups.clone();
        drop(wal);
        let (mut wal, recovered) = reopen(&dir.0, options(4096));
        assert_eq!(recovered, expected, "{step:?}");
        assert!(
            segment_files(&dir.0)
                .iter()
                .all(|p| p.extension().is_some_and(|e| e == "log")),
            "{step:?}: no temporary file is left"
        );
        // And the log goes on, compacting again.
        let index = expected[&0].entries.last().map_or(1, |e| e.index + 1);
        let before = wal.stats().compactions;
        drive(&mut wal, index, true, |wal| {
            wal.stats().compactions > before
        })
        .expect("drive");
        let expected = wal.groups.clone();
        drop(wal);
        assert_eq!(reopen(&dir.0, options(4096)).1, expected, "{step:?}");
    }
}

/// Writes three segments of 4 KiB, all entries live (no compaction); returns the next index.
fn three_segments(dir: &Path) -> u64 {
    let (mut wal, _) = Wal::open_with(dir, options(4096)).expect("open");
    let mut index = 1;
    while wal.segments.len() < 3 {
        wal.append(0, &entries(index..=index + 9, 1))
            .expect("append");
        wal.sync().expect("sync");
        index += 10;
    }
    assert_eq!(wal.stats().compactions, 0, "all entries are live");
    index
}

#[test]
fn zeros_after_an_older_segments_records_end_them_and_anything_else_is_an_error() {
    let dir = TempDir::new("older-zeros");
    let next = three_segments(&dir.0);
    let files = segment_files(&dir.0);
    let victim = &files[1];
    let records = fs::read(victim).expect("read");
    assert!(
        records.len() < 8192,
        "a rotated segment keeps its records only"
    );
    // A crash before the rotation's cut reached the disk leaves the preallocated zeros.
    let mut file = records.clone();
    file.resize(64 << 10, 0);
    fs::write(victim, &file).expect("write");
    let (_, recovered) = reopen(&dir.0, options(4096));
    assert_eq!(recovered[&0].entries.last(), Some(&entry(next - 1, 1)));
    // Bytes after those zeros are damage.
    file[40 << 10] = 1;
    fs::write(victim, &file).expect("write");
    let error = Wal::open_with(&dir.0, options(4096))
        .err()
        .expect("damage refused");
    assert_eq!(error.kind(), io::ErrorKind::InvalidData);
    assert!(error.to_string().contains("zero record header"), "{error}");
    // Zeros in place of an older segment's last record are a gap in the sequence.
    let mut file = records.clone();
    file[last_record_start(&records)..].fill(0);
    fs::write(victim, &file).expect("write");
    let error = Wal::open_with(&dir.0, options(4096))
        .err()
        .expect("gap refused");
    assert!(error.to_string().contains("expected"), "{error}");
}

/// Where the last record of a segment's `records` starts.
fn last_record_start(records: &[u8]) -> usize {
    let mut offset = 0;
    loop {
        let (_, _, used) = record::decode(&records[offset..]).expect("record");
        if offset + used == records.len() {
            return offset;
        }
        offset += used;
    }
}

#[test]
fn a_missing_segment_is_an_error() {
    let dir = TempDir::new("gap");
    three_segments(&dir.0);
    let files = segment_files(&dir.0);
    fs::remove_file(&files[1]).expect("remove");
    let error = Wal::open_with(&dir.0, options(4096))
        .err()
        .expect("gap refused");
    assert!(error.to_string().contains("expected"), "{error}");
}

/// Group commit: syncs/s and records/s with fsync on and off, 64 groups, one 128-byte entry
/// per record, each group compacting every 1,000 entries (run in release).
#[test]
#[ignore]
fn measure() {
    const SHARDS: u64 = 64;
    for fsync in [true, false] {
        for records_per_sync in [1u64, 16, 256] {
            let dir = TempDir::new("measure");
            let opts = Options {
                fsync,
                ..Options::default()
            };
            let (mut wal, _) = Wal::open_with(&dir.0, opts).expect("open");
            let mut next = vec![1u64; SHARDS as usize];
            let started = std::time::Instant::now();
            let mut turn = 0u64;
            while started.elapsed() < std::time::Duration::from_secs(1) {
                for _ in 0..records_per_sync {
                    let shard = turn % SHARDS;
                    let index = next[shard as usize];
                    let mut one = entry(index, 1);
                    one.set_data(vec![0xab; 128].into());
                    wal.append(shard as u32, &[one]).expect("append");
                    if index % 1000 == 0 {
                        wal.apply_snapshot(shard as u32, &snapshot(index - 100, 1))
                            .expect("snapshot");
                    }
                    next[shard as usize] += 1;
                    turn += 1;
                }
                wal.sync().expect("sync");
            }
            let seconds = started.elapsed().as_secs_f64();
            let stats = wal.stats();
            println!(
                "fsync={fsync:<5} records/sync={records_per_sync:<4} syncs/s={:>9.0} \
                 records/s={:>10.0} MB/s={:>7.1} compactions={} rotations={}",
                stats.syncs as f64 / seconds,
                stats.records as f64 / seconds,
                stats.bytes as f64 / seconds / 1e6,
                stats.compactions,
                stats.rotations,
            );
        }
    }
}
