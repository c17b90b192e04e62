//! The writer of a core's write-ahead log: a thread that owns the core's [`Durable`] and makes
//! the member's writes durable off the core's event loop.
//!
//! Once per loop iteration a member hands its writer one [`Batch`]: the snapshots, entries and
//! hard states of every group that had a ready, numbered `1, 2, 3, ...` in the order the member
//! took them ([`LogWriter::submit`], which never blocks). The writer takes every batch it finds
//! queued (at most [`ROUND_BYTES_MAX`] of them, and at least one), records them in order, and
//! makes them durable with one `fdatasync` for all of them (group commit; [`write_round`]); then
//! it publishes "synced through batch N" ([`LogWriter::synced`]) and wakes the core once. A
//! round none of whose batches must be synced (raft says so: only commit indices changed) is
//! written without the `fdatasync`, which a later round's sync covers. Rounds run one after the
//! other, so a round is reported only once every earlier batch is durable.
//!
//! The member sends nothing and acknowledges nothing that depends on a batch before it sees it
//! synced ("persisted before acknowledged"); see `crate::cluster::member`.
//!
//! A failed write or sync ends the writer: it publishes the error (naming the operation and the
//! file) and stops taking batches; the member's next drain returns it, and the server stops the
//! process (exit 70), as before. Segment rotation and the log's own compaction run in the sync,
//! so on this thread too.
//!
//! Deliberately not here: what the records mean (the log's rules are `crate::cluster::wal`'s),
//! and the shard machines' snapshots (frozen on the core and encoded by its snapshot worker,
//! `crate::cluster::compactor`; the member hands them here as records).

use super::member::Envelope;
use super::Durable;
use crate::metrics::Histogram;
use crate::partition::cluster_stats::LATENCY_BOUNDS_US;
use crossbeam_channel::{Receiver, Sender, TrySendError};
use parking_lot::Mutex;
use raft::eraftpb::{Entry, HardState, Snapshot};
use std::io;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, OnceLock};
use std::thread::JoinHandle;
use std::time::Instant;

/// Batches handed to the writer and not yet synced, at most: a member stops taking readies at
/// this many (its raft groups wait; nothing is lost), and the channel holds exactly this many.
pub const BATCHES_IN_FLIGHT_MAX: u64 = 32;
/// Bytes of batches one round takes before it stops taking more (it takes at least one batch,
/// whatever its size). The log's buffer holds a round's worth plus one more batch: a batch is
/// at most a drain's entry budget plus one record or one group's ready (see
/// [`super::member::DRAIN_ENTRY_BYTES_MAX`]).
pub const ROUND_BYTES_MAX: usize = 32 << 20;

const _: () = assert!(
    ROUND_BYTES_MAX
        + super::member::DRAIN_ENTRY_BYTES_MAX
        + super::wal::RECORD_BYTES_MAX
        + super::member::UNCOMMITTED_BYTES_MAX as usize
        <= super::wal::BUFFER_BYTES_MAX
);

/// One write of a group, as raft-rs asks it to be persisted.
#[derive(Clone, Debug, PartialEq)]
pub enum Record {
    /// Entries appended to the shard's log (replacing the suffix from the first one on).
    Entries {
        /// The group's shard.
        shard: u32,
        /// The entries, contiguous.
        entries: Vec<Entry>,
    },
    /// The shard's hard state.
    HardState {
        /// The group's shard.
        shard: u32,
        /// Term, vote and commit.
        hard_state: HardState,
    },
    /// A snapshot of the shard: received from a leader, or taken here to compact the log.
    Snapshot {
        /// The group's shard.
        shard: u32,
        /// The snapshot, data included.
        snapshot: Snapshot,
    },
}

impl Record {
    /// Roughly the bytes the record takes in the log (its payload's data).
    pub fn bytes(&self) -> usize {
        match self {
            Record::Entries { entries, .. } => entries
                .iter()
                .map(|entry| entry.get_data().len() + entry.get_context().len() + 24)
                .sum(),
            Record::HardState { .. } => 32,
            Record::Snapshot { snapshot, .. } => snapshot.get_data().len() + 64,
        }
    }

    fn write<D: Durable>(&self, durable: &mut D) -> io::Result<()> {
        match self {
            Record::Entries { shard, entries } => durable.append(*shard, entries),
            Record::HardState { shard, hard_state } => durable.set_hard_state(*shard, hard_state),
            Record::Snapshot { shard, snapshot } => durable.apply_snapshot(*shard, snapshot),
        }
    }
}

/// One drain's writes, for every group that had a ready, in the order to record them (per
/// group: snapshot, entries, then the hard state that may commit them).
#[derive(Clone, Debug, PartialEq)]
pub struct Batch {
    /// Consecutive from 1 per member lifetime.
    pub number: u64,
    /// Whether some ready of it must be synced before raft may act on it (an entry, a
    /// snapshot, a term or a vote); otherwise written without `fdatasync`.
    pub must_sync: bool,
    /// The writes, in order.
    pub records: Vec<Record>,
    /// Messages that may leave only once these writes are durable (a follower's append
    /// responses, a candidate's votes): the writer sends them right after the round that
    /// synced this batch, before it reports the batch synced, so they do not wait for the core
    /// to wake up and pass them on.
    pub after_sync: Vec<Envelope>,
}

impl Batch {
    /// Roughly the bytes the batch takes in the log.
    pub fn bytes(&self) -> usize {
        self.records.iter().map(Record::bytes).sum()
    }
}

/// Where a member hands its batches, and how it learns they are durable.
pub trait LogWriter {
    /// Hands `batch` (numbered one above the last handed) to the writer; never blocks. Gives
    /// it back when the writer cannot take it now (full or failed): hand it again later, before
    /// any later batch.
    fn submit(&mut self, batch: Batch) -> Result<(), Batch>;
    /// The number of the last batch known durable (every batch up to it is); an error once the
    /// writer failed (the member must stop: what reached the disk is unknown).
    fn synced(&self) -> io::Result<u64>;
    /// How long the writer's rounds took (write and sync), in microseconds, if it measures them.
    fn sync_latency(&self) -> Option<Histogram> {
        None
    }
    /// Moves to `out` the `after_sync` messages of batches now synced, for a writer that does
    /// not send them itself (a simulation's); a writer thread sends them and gives none here.
    fn take_released(&mut self, _out: &mut Vec<Envelope>) {}
}

/// Records `batches` (in order) in `durable` and makes them durable: one sync if any must be
/// synced, else one flush. Returns the last batch's number. Errors say which step failed.
pub fn write_round<D: Durable>(durable: &mut D, batches: &[Batch]) -> io::Result<u64> {
    let Some(last) = batches.last() else {
        return Err(io::Error::other("an empty round"));
    };
    for record in batches.iter().flat_map(|batch| &batch.records) {
        if let Err(error) = record.write(durable) {
            let what = format!("writing the write-ahead log failed: {error}");
            return Err(io::Error::new(error.kind(), what));
        }
    }
    let result = if batches.iter().any(|batch| batch.must_sync) {
        durable.sync()
    } else {
        durable.flush()
    };
    if let Err(error) = result {
        let what = format!("syncing the write-ahead log failed: {error}");
        return Err(io::Error::new(error.kind(), what));
    }
    Ok(last.number)
}

/// What the writer thread tells its core.
struct Progress {
    /// The last batch synced.
    synced: AtomicU64,
    /// Set once, when the writer failed.
    failed: OnceLock<String>,
    /// Rounds' write-and-sync times, µs (read for stats only).
    latency: Mutex<Histogram>,
}

/// A core's writer thread, from the core's side. Dropping it lets the thread write what is
/// queued, and waits for it.
pub struct Writer {
    batches: Option<Sender<Batch>>,
    progress: Arc<Progress>,
    thread: Option<JoinHandle<()>>,
}

impl Writer {
    /// Starts the thread `name`, which owns `durable`; `wake` is called after every round (and
    /// on failure), `send` with the round's `after_sync` messages once it is durable (before
    /// `wake`), both from the writer's thread.
    pub fn spawn<D, F, S>(name: String, durable: D, wake: F, send: S) -> io::Result<Writer>
    where
        D: Durable + Send + 'static,
        F: Fn() + Send + 'static,
        S: Fn(Vec<Envelope>) + Send + 'static,
    {
        let (sender, receiver) = crossbeam_channel::bounded(BATCHES_IN_FLIGHT_MAX as usize);
        let progress = Arc::new(Progress {
            synced: AtomicU64::new(0),
            failed: OnceLock::new(),
            latency: Mutex::new(Histogram::new(LATENCY_BOUNDS_US)),
        });
        let shared = Arc::clone(&progress);
        let thread = std::thread::Builder::new()
            .name(name)
            .spawn(move || run(durable, &receiver, &shared, (&wake, &send)))?;
        Ok(Writer {
            batches: Some(sender),
            progress,
            thread: Some(thread),
        })
    }
}

impl LogWriter for Writer {
    fn submit(&mut self, batch: Batch) -> Result<(), Batch> {
        let Some(sender) = &self.batches else {
            return Err(batch);
        };
        match sender.try_send(batch) {
            Ok(()) => Ok(()),
            Err(TrySendError::Full(batch) | TrySendError::Disconnected(batch)) => Err(batch),
        }
    }

    fn synced(&self) -> io::Result<u64> {
        let synced = self.progress.synced.load(Ordering::Acquire);
        match self.progress.failed.get() {
            Some(error) => Err(io::Error::other(error.clone())),
            None => Ok(synced),
        }
    }

    fn sync_latency(&self) -> Option<Histogram> {
        Some(self.progress.latency.lock().clone())
    }
}

impl Drop for Writer {
    fn drop(&mut self) {
        // Closing the channel ends the thread once it wrote what is queued.
        self.batches = None;
        if let Some(thread) = self.thread.take() {
            if thread.join().is_err() {
                log::error!("a write-ahead log writer thread panicked");
            }
        }
    }
}

/// Reports a panic of a core's helper thread (this writer, a broken invariant of the log; the
/// snapshot worker, `super::compactor`) to the core as a failure, and wakes it: otherwise the
/// core would wait forever for results that never come. Held for the thread's whole run.
pub(super) struct PanicReport<'a> {
    /// Where the core looks for the failure.
    pub(super) failed: &'a OnceLock<String>,
    /// The failure's text: which thread panicked.
    pub(super) what: &'static str,
    /// Wakes the core.
    pub(super) wake: &'a dyn Fn(),
}

impl Drop for PanicReport<'_> {
    fn drop(&mut self) {
        if std::thread::panicking() {
            let _ = self.failed.set(self.what.to_string());
            (self.wake)();
        }
    }
}

/// The writer thread: rounds until the core hangs up or a round fails. A round's
/// `after_sync` messages are sent once it is durable and before it is published, so that
/// messages a core releases on seeing a later batch synced never overtake them.
fn run<D: Durable>(
    mut durable: D,
    batches: &Receiver<Batch>,
    progress: &Progress,
    (wake, send): (&dyn Fn(), &dyn Fn(Vec<Envelope>)),
) {
    let _report = PanicReport {
        failed: &progress.failed,
        what: "the write-ahead log writer thread panicked",
        wake,
    };
    let mut round: Vec<Batch> = Vec::new();
    while let Ok(first) = batches.recv() {
        let mut bytes = first.bytes();
        round.push(first);
        while bytes < ROUND_BYTES_MAX {
            let Ok(next) = batches.try_recv() else {
                break;
            };
            bytes += next.bytes();
            round.push(next);
        }
        let started = Instant::now();
        let result = write_round(&mut durable, &round);
        let took_us = started.elapsed().as_micros() as u64;
        let released: Vec<Envelope> = match result {
            Ok(_) => round
                .iter_mut()
                .flat_map(|batch| std::mem::take(&mut batch.after_sync))
                .collect(),
            Err(_) => Vec::new(),
        };
        round.clear();
        match result {
            Ok(through) => {
                if !released.is_empty() {
                    send(released);
                }
                progress.latency.lock().record(took_us);
                progress.synced.store(through, Ordering::Release);
                wake();
            }
            Err(error) => {
                let _ = progress.failed.set(error.to_string());
                wake();
                return;
            }
        }
    }
}

#[cfg(test)]
#[path = "writer_tests.rs"]
mod tests;
