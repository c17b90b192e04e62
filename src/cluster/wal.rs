//! The write-ahead log of one core: a [`Durable`] on disk for every group the core hosts.
//!
//! A directory (`<data_dir>/core-<n>/`) holds segment files `wal-<16 hex first seq>.log` of
//! framed records (`record.rs`: `[len u32][crc32c u32][kind u8][shard u32][payload]`, payload the
//! protobuf of an entry batch, a `HardState` or a `Snapshot`).
//!
//! The log is owned by its core's writer thread (`crate::cluster::writer`), never touched by
//! the core's event loop. Writes only encode into a memory buffer; [`Durable::sync`] writes the
//! whole buffer with one `write` and, when `fsync` is on, one `fdatasync`: one sync covers every
//! group and every record since the last (group commit). [`Durable::flush`] writes without the
//! `fdatasync` (the next sync covers it; it never rotates, so that a segment is never left with
//! an unsynced tail). With `fsync` off a sync reaches the page cache only, which survives a
//! crash of the process but not of the machine.
//!
//! After a sync that leaves the current segment at or past [`Options::segment_bytes`], the log
//! rotates. If the live state (per group: hard state, last snapshot, entries after it) is under
//! a quarter of the files' bytes, it compacts: the live state goes to a temporary file that
//! starts with a checkpoint record, which is synced, renamed to the next segment name, and the
//! directory synced; then the older segments are deleted. A crash at any step leaves either the
//! old segments (the temporary file is deleted at open) or a checkpoint that supersedes them.
//! Otherwise the log simply starts a new empty segment.
//!
//! Recovery (`replay.rs`) rebuilds the same live state with the same rules (`state.rs`), cuts a
//! torn tail off the last segment, and refuses damage anywhere else, naming file and offset.
//!
//! Limits: a record is at most 64 MiB ([`RECORD_BYTES_MAX`]); the unsynced buffer at most
//! [`BUFFER_BYTES_MAX`] (a write past it fails: sync first); a segment file read back at most
//! 1 GiB. The log keeps the live state in memory (a second copy of what the groups'
//! `MemStorage`s hold) so that it can compact without reading its files back.
//!
//! Within one sync, a torn tail keeps a prefix of the records: record a ready's snapshot, then
//! its entries, then the hard state that may commit them, so that no recovered hard state
//! commits an entry that was lost.
//!
//! Segments are preallocated ahead of their records: a write that would pass the allocated
//! length first extends the file with `fallocate` to [`PREALLOCATE_BYTES`] (or the segment
//! size, if smaller) past its end, so that almost every sync writes into blocks the file
//! already has and its `fdatasync` need not also commit a larger file size (on ext4 here, a
//! 256-byte write's `fdatasync` took 139 µs appending and 98 µs into a preallocated file, p50
//! of 2,000). Records are written at their offset, and the zeros after them end a segment's
//! records on replay (`replay.rs`). A rotated segment is cut to its records' length; a file
//! system without `fallocate` just grows the file (the log stops trying after the first
//! refusal).
//!
//! Not done here: direct I/O, and reading entries back for raft (raft reads its
//! `MemStorage`). After a failed write or sync the log refuses everything (the state of the
//! file is unknown; restart and recover).

mod record;
mod replay;
mod state;
#[cfg(test)]
mod tests;
#[cfg(test)]
mod tests_model;

use super::{Durable, Recovered};
use raft::eraftpb::{Entry, HardState, Snapshot};
use record::BodyRef;
use std::collections::BTreeMap;
use std::fs::{self, File};
use std::io::{self, Write as _};
use std::os::unix::fs::FileExt as _;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};

pub use record::{crc32c, RECORD_BYTES_MAX};

/// Microseconds every [`Durable::sync`] of every log in the process waits after its
/// `fdatasync`: a hook for benchmarks that play a slow disk (`benches/stalls.rs`), 0 (off)
/// unless one sets it. Its cost when off is one relaxed load per sync.
#[doc(hidden)]
pub static BENCH_SYNC_DELAY_US: AtomicU64 = AtomicU64::new(0);

/// The most bytes buffered between two syncs (128 MiB): room for two records of the largest
/// size. A write that would pass it fails; a member drains a few MiB per loop iteration.
pub const BUFFER_BYTES_MAX: usize = 128 << 20;

const _: () = assert!(BUFFER_BYTES_MAX >= 2 * RECORD_BYTES_MAX);

/// How far past the records a segment is preallocated when a write would pass its allocated
/// length (4 MiB: one extension every 4 MiB of records, and at most that much of zeros on disk
/// and to read back at open).
pub const PREALLOCATE_BYTES: u64 = 4 << 20;

/// The default size at which a segment is rotated (64 MiB).
pub const SEGMENT_BYTES_DEFAULT: u64 = 64 << 20;

/// How a log behaves.
#[derive(Clone, Copy, Debug)]
pub struct Options {
    /// Whether a sync ends with `fdatasync` (and compaction syncs files and the directory).
    pub fsync: bool,
    /// The segment size that triggers a rotation after a sync (at least 4 KiB).
    pub segment_bytes: u64,
    /// The most bytes buffered between two syncs: 4 KiB up to [`BUFFER_BYTES_MAX`] (the
    /// default). A record that does not fit is refused.
    pub buffer_bytes: usize,
}

impl Default for Options {
    fn default() -> Self {
        Options {
            fsync: true,
            segment_bytes: SEGMENT_BYTES_DEFAULT,
            buffer_bytes: BUFFER_BYTES_MAX,
        }
    }
}

/// Counters of what a log did, for measurement.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Stats {
    /// Records encoded.
    pub records: u64,
    /// Syncs that wrote something.
    pub syncs: u64,
    /// Flushes that wrote something (without `fdatasync`).
    pub flushes: u64,
    /// Bytes written by syncs (compaction not counted).
    pub bytes: u64,
    /// Rotations to a new empty segment.
    pub rotations: u64,
    /// Compactions.
    pub compactions: u64,
}

/// The steps of a compaction after which a test can stop it, to play a crash there.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Step {
    /// The temporary file is written and synced.
    TemporaryWritten,
    /// It is renamed to a segment name and the directory synced.
    Renamed,
    /// The oldest older segment is deleted.
    OneDeleted,
}

/// One core's write-ahead log. Call order: any number of `append` / `set_hard_state` /
/// `apply_snapshot`, then `sync` before acting on them; repeat.
pub struct Wal {
    dir: PathBuf,
    options: Options,
    /// Live state of every group: what a reopen would recover after a sync.
    groups: BTreeMap<u32, Recovered>,
    /// Encoded records not yet written; at most `options.buffer_bytes`.
    buffer: Vec<u8>,
    /// Records in `buffer`.
    buffered_records: u64,
    /// Segments in use, oldest first; the last one is `file`.
    segments: Vec<(u64, PathBuf)>,
    file: File,
    /// Bytes written to `file`.
    file_bytes: u64,
    /// Bytes of `file` known durable (the rest was flushed and waits for the next sync).
    synced_bytes: u64,
    /// The length `file` is extended to (records, then zeros): at least `file_bytes` unless
    /// `no_preallocation`.
    allocated_bytes: u64,
    /// Set when the file system refused `fallocate`: files just grow from then on.
    no_preallocation: bool,
    /// Bytes of all segments but the last.
    older_bytes: u64,
    /// Sequence number of the next record written to `file`.
    next_seq: u64,
    /// Set when a write or sync failed: everything is refused from then on.
    poisoned: bool,
    stats: Stats,
    #[cfg(test)]
    crash_at: Option<Step>,
}

impl Wal {
    /// Opens (creating if missing) the log in `dir`, syncing with `fdatasync` when `fsync`;
    /// returns each group's recovered state by shard.
    pub fn open(dir: &Path, fsync: bool) -> io::Result<(Wal, Vec<(u32, Recovered)>)> {
        let options = Options {
            fsync,
            ..Options::default()
        };
        Wal::open_with(dir, options)
    }

    /// [`Wal::open`] with every option.
    pub fn open_with(dir: &Path, options: Options) -> io::Result<(Wal, Vec<(u32, Recovered)>)> {
        if options.segment_bytes < 4096
            || !(4096..=BUFFER_BYTES_MAX).contains(&options.buffer_bytes)
        {
            let what = format!("wal options out of range: {options:?}");
            return Err(io::Error::new(io::ErrorKind::InvalidInput, what));
        }
        fs::create_dir_all(dir)?;
        let mut replayed = replay::replay(dir)?;
        if replayed.segments.is_empty() {
            let path = dir.join(replay::segment_name(0));
            create_file(&path, options.fsync)?;
            replayed.segments.push((0, path));
            replayed.last_bytes = 0;
        }
        let last = &replayed.segments[replayed.segments.len() - 1].1;
        let file = fs::OpenOptions::new().write(true).open(last)?;
        let recovered = replayed
            .groups
            .iter()
            .map(|(shard, group)| (*shard, group.clone()))
            .collect();
        let wal = Wal {
            dir: dir.to_path_buf(),
            options,
            groups: replayed.groups,
            buffer: Vec::new(),
            buffered_records: 0,
            segments: replayed.segments,
            file,
            file_bytes: replayed.last_bytes,
            synced_bytes: replayed.last_bytes,
            allocated_bytes: replayed.last_bytes,
            no_preallocation: false,
            older_bytes: replayed.older_bytes,
            next_seq: replayed.next_seq,
            poisoned: false,
            stats: Stats::default(),
            #[cfg(test)]
            crash_at: None,
        };
        Ok((wal, recovered))
    }

    /// What the log has done since it was opened.
    #[cfg(any(test, feature = "testing"))]
    pub fn stats(&self) -> Stats {
        self.stats
    }

    /// The bytes of all segment files, the unsynced buffer not counted.
    pub fn file_bytes(&self) -> u64 {
        self.older_bytes + self.file_bytes
    }

    fn usable(&self) -> io::Result<()> {
        if self.poisoned {
            let what = format!(
                "write-ahead log {}: an earlier write or sync failed; reopen to recover",
                self.dir.display()
            );
            return Err(io::Error::other(what));
        }
        Ok(())
    }

    /// `error` of `operation` on the current segment, naming both (the kind is kept).
    fn on_segment(&self, operation: &str, error: io::Error) -> io::Error {
        let path = self.segments.last().map_or(&self.dir, |(_, path)| path);
        let what = format!("{operation} {}: {error}", path.display());
        io::Error::new(error.kind(), what)
    }

    /// Encodes one record into the buffer, refusing a record over [`RECORD_BYTES_MAX`] and one
    /// that would take the buffer past `options.buffer_bytes` (the buffer never grows past it).
    fn buffer_record(&mut self, shard: u32, body: &BodyRef<'_>) -> io::Result<()> {
        let bytes = record::encoded_bytes(body);
        if bytes > RECORD_BYTES_MAX as u64 {
            let what = format!("record of {bytes} bytes over the limit of {RECORD_BYTES_MAX}");
            return Err(io::Error::new(io::ErrorKind::InvalidInput, what));
        }
        if self.buffer.len() as u64 + bytes > self.options.buffer_bytes as u64 {
            let limit = self.options.buffer_bytes;
            let what = format!("wal buffer would pass {limit} bytes: sync first");
            return Err(io::Error::new(io::ErrorKind::OutOfMemory, what));
        }
        record::encode(&mut self.buffer, shard, body)
            .map_err(|what| io::Error::new(io::ErrorKind::InvalidInput, what))?;
        self.buffered_records += 1;
        self.stats.records += 1;
        Ok(())
    }

    /// Panics when the log's bookkeeping is broken. Runs after every sync in debug builds.
    fn check_invariants(&self) {
        if !cfg!(debug_assertions) {
            return;
        }
        assert!(
            self.buffer.len() <= self.options.buffer_bytes,
            "wal: buffer over its bound"
        );
        assert!(!self.segments.is_empty(), "wal: no current segment");
        assert!(
            self.synced_bytes <= self.file_bytes,
            "wal: synced past the file's end"
        );
        assert!(
            self.no_preallocation || self.file_bytes <= self.allocated_bytes,
            "wal: records past the preallocated length"
        );
        let seqs = self.segments.windows(2);
        assert!(
            seqs.clone().all(|pair| pair[0].0 < pair[1].0),
            "wal: segments out of order"
        );
        let last = self.segments[self.segments.len() - 1].0;
        assert!(
            last <= self.next_seq,
            "wal: the current segment starts after the next record"
        );
        assert_eq!(
            self.buffer.is_empty(),
            self.buffered_records == 0,
            "wal: buffer count"
        );
        self.groups.values().for_each(state::check);
    }

    /// Writes the buffer to the current segment after its records (one `pwrite`, retried only
    /// if short).
    fn write_buffer(&mut self) -> io::Result<()> {
        let end = self.file_bytes + self.buffer.len() as u64;
        if end > self.allocated_bytes && !self.no_preallocation {
            let length = end + PREALLOCATE_BYTES.min(self.options.segment_bytes);
            match preallocate(&self.file, length) {
                Ok(()) => self.allocated_bytes = length,
                Err(error) => {
                    log::debug!("wal: {}: no preallocation: {error}", self.dir.display());
                    self.no_preallocation = true;
                }
            }
        }
        if let Err(error) = self.file.write_all_at(&self.buffer, self.file_bytes) {
            self.poisoned = true;
            return Err(self.on_segment("write to", error));
        }
        self.file_bytes += self.buffer.len() as u64;
        self.next_seq += self.buffered_records;
        self.stats.bytes += self.buffer.len() as u64;
        self.buffer.clear();
        self.buffered_records = 0;
        Ok(())
    }

    /// Rotates when the current segment is full: compacts, or starts a new empty segment.
    fn maybe_rotate(&mut self) -> io::Result<()> {
        if self.file_bytes < self.options.segment_bytes {
            return Ok(());
        }
        let live: u64 = self.groups.values().map(state::live_bytes).sum();
        if live.saturating_mul(4) < self.file_bytes() {
            return self.compact();
        }
        let seq = self.next_seq;
        let path = self.dir.join(replay::segment_name(seq));
        // The full segment keeps its records only (its zeros would end them on replay too).
        self.file.set_len(self.file_bytes)?;
        let file = create_file(&path, self.options.fsync)?;
        self.older_bytes += self.file_bytes;
        self.segments.push((seq, path));
        self.file = file;
        self.file_bytes = 0;
        self.synced_bytes = 0;
        self.allocated_bytes = 0;
        self.stats.rotations += 1;
        Ok(())
    }

    /// Writes the live state as a checkpoint segment and deletes the older ones.
    fn compact(&mut self) -> io::Result<()> {
        let seq = self.next_seq;
        // The current segment holds records (it is full), so the new name is a new file.
        assert!(
            self.segments.iter().all(|(old, _)| *old < seq),
            "wal: compaction name taken"
        );
        let mut bytes = Vec::new();
        let mut records = 1;
        record::encode(&mut bytes, 0, &BodyRef::Checkpoint).map_err(io::Error::other)?;
        for (shard, group) in &self.groups {
            records += encode_group(&mut bytes, *shard, group)?;
        }
        let temporary = self.dir.join(replay::temporary_name(seq));
        let path = self.dir.join(replay::segment_name(seq));
        {
            let mut file = fs::OpenOptions::new()
                .write(true)
                .create_new(true)
                .open(&temporary)?;
            file.write_all(&bytes)?;
            if self.options.fsync {
                file.sync_data()?;
            }
        }
        self.crash_point(Step::TemporaryWritten)?;
        fs::rename(&temporary, &path)?;
        if self.options.fsync {
            sync_dir(&self.dir)?;
        }
        self.crash_point(Step::Renamed)?;
        // From here on the checkpoint supersedes the older segments: the new file is live even
        // if deleting them fails.
        let older = std::mem::replace(&mut self.segments, vec![(seq, path.clone())]);
        self.file = fs::OpenOptions::new().write(true).open(&path)?;
        self.file_bytes = bytes.len() as u64;
        self.synced_bytes = self.file_bytes;
        self.allocated_bytes = self.file_bytes;
        self.older_bytes = 0;
        self.next_seq = seq + records;
        self.stats.compactions += 1;
        for (position, (_, old)) in older.iter().enumerate() {
            fs::remove_file(old)?;
            if position == 0 {
                self.crash_point(Step::OneDeleted)?;
            }
        }
        Ok(())
    }

    #[cfg(test)]
    fn crash_point(&mut self, point: Step) -> io::Result<()> {
        if self.crash_at == Some(point) {
            self.poisoned = true;
            return Err(io::Error::other(format!("test crash at {point:?}")));
        }
        Ok(())
    }

    #[cfg(not(test))]
    fn crash_point(&mut self, _point: Step) -> io::Result<()> {
        Ok(())
    }
}

/// Encodes one group's live state (snapshot, entries, hard state); returns the record count.
fn encode_group(out: &mut Vec<u8>, shard: u32, group: &Recovered) -> io::Result<u64> {
    let invalid = |what| io::Error::new(io::ErrorKind::InvalidData, what);
    let mut records = 0;
    if let Some(snapshot) = &group.snapshot {
        record::encode(out, shard, &BodyRef::Snapshot(snapshot)).map_err(invalid)?;
        records += 1;
    }
    // Batches stay well under the record limit: split by size.
    let mut start = 0;
    while start < group.entries.len() {
        let mut end = start;
        let mut size = 0usize;
        while end < group.entries.len() && (end == start || size < RECORD_BYTES_MAX / 4) {
            size += protobuf::Message::compute_size(&group.entries[end]) as usize + 4;
            end += 1;
        }
        let batch = &group.entries[start..end];
        record::encode(out, shard, &BodyRef::Entries(batch)).map_err(invalid)?;
        records += 1;
        start = end;
    }
    record::encode(out, shard, &BodyRef::HardState(&group.hard_state)).map_err(invalid)?;
    Ok(records + 1)
}

/// Creates an empty segment file and, with `fsync`, makes its name durable.
fn create_file(path: &Path, fsync: bool) -> io::Result<File> {
    let file = fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .open(path)?;
    if fsync {
        if let Some(dir) = path.parent() {
            sync_dir(dir)?;
        }
    }
    Ok(file)
}

/// Extends `file` to `bytes` (if shorter) with allocated blocks that read as zeros, keeping
/// every byte already there. An error means a file system without `fallocate` or a full disk;
/// the caller writes anyway (the file grows, or the write fails for want of room).
fn preallocate(file: &File, bytes: u64) -> io::Result<()> {
    #[cfg(target_os = "linux")]
    {
        use std::os::fd::AsRawFd as _;
        let length = libc::off_t::try_from(bytes)
            .map_err(|_| io::Error::new(io::ErrorKind::InvalidInput, "length out of range"))?;
        // SAFETY: fallocate only changes the file behind a descriptor `file` owns; mode 0
        // allocates and extends the size, keeping every byte already there.
        if unsafe { libc::fallocate(file.as_raw_fd(), 0, 0, length) } != 0 {
            return Err(io::Error::last_os_error());
        }
        Ok(())
    }
    #[cfg(not(target_os = "linux"))]
    {
        let _ = (file, bytes);
        Err(io::Error::new(
            io::ErrorKind::Unsupported,
            "fallocate is Linux only",
        ))
    }
}

fn sync_dir(dir: &Path) -> io::Result<()> {
    File::open(dir)?.sync_all()
}

impl Durable for Wal {
    fn append(&mut self, shard: u32, entries: &[Entry]) -> io::Result<()> {
        self.usable()?;
        if entries.is_empty() {
            return Ok(());
        }
        let empty = Recovered::default();
        let group = self.groups.get(&shard).unwrap_or(&empty);
        state::check_append(group, entries)
            .map_err(|what| io::Error::new(io::ErrorKind::InvalidInput, what))?;
        self.buffer_record(shard, &BodyRef::Entries(entries))?;
        let group = self.groups.entry(shard).or_default();
        state::append(group, entries);
        Ok(())
    }

    fn set_hard_state(&mut self, shard: u32, hard_state: &HardState) -> io::Result<()> {
        self.usable()?;
        self.buffer_record(shard, &BodyRef::HardState(hard_state))?;
        state::set_hard_state(self.groups.entry(shard).or_default(), hard_state);
        Ok(())
    }

    fn apply_snapshot(&mut self, shard: u32, snapshot: &Snapshot) -> io::Result<()> {
        self.usable()?;
        let empty = Recovered::default();
        let group = self.groups.get(&shard).unwrap_or(&empty);
        state::check_snapshot(group, snapshot)
            .map_err(|what| io::Error::new(io::ErrorKind::InvalidInput, what))?;
        self.buffer_record(shard, &BodyRef::Snapshot(snapshot))?;
        let group = self.groups.entry(shard).or_default();
        state::apply_snapshot(group, snapshot);
        Ok(())
    }

    fn flush(&mut self) -> io::Result<()> {
        self.usable()?;
        if self.buffer.is_empty() {
            return Ok(());
        }
        self.write_buffer()?;
        self.stats.flushes += 1;
        self.check_invariants();
        Ok(())
    }

    fn sync(&mut self) -> io::Result<()> {
        self.usable()?;
        if self.buffer.is_empty() && self.synced_bytes == self.file_bytes {
            return Ok(());
        }
        self.write_buffer()?;
        if self.options.fsync {
            if let Err(error) = self.file.sync_data() {
                self.poisoned = true;
                return Err(self.on_segment("fdatasync of", error));
            }
        }
        self.synced_bytes = self.file_bytes;
        let delay_us = BENCH_SYNC_DELAY_US.load(Ordering::Relaxed);
        if delay_us > 0 {
            std::thread::sleep(std::time::Duration::from_micros(delay_us));
        }
        self.stats.syncs += 1;
        if let Err(error) = self.maybe_rotate() {
            self.poisoned = true;
            let what = format!("rotating or compacting {}: {error}", self.dir.display());
            return Err(io::Error::new(error.kind(), what));
        }
        self.check_invariants();
        Ok(())
    }
}
