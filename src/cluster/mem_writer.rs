//! [`MemWriter`]: the [`LogWriter`] of the simulations and unit tests: a core's writer run in
//! the caller's thread, when the caller says so ([`MemWriter::complete`]) or, in the immediate
//! mode, at once.
//!
//! It models what a server's writer thread does: a batch handed over is *queued* until a
//! completion writes it into the [`MemDurable`] and syncs it (or only writes it, when no batch
//! of the round must be synced), so a crash loses every batch queued or written since the last
//! sync ([`MemWriter::crashed`]); completions come whenever the caller chooses, later than the
//! iteration that handed the batch over and in any order relative to peers' messages, and may
//! take some of the queued batches only (a round ends where the writer found the queue's end).
//! A synced batch's `after_sync` messages wait here until the member's next drain takes them
//! ([`LogWriter::take_released`]), where the writer thread would have sent them itself.
//!
//! Not a thread and not a disk: nothing here blocks, and the queue is bounded only by the
//! member's own bound on batches in flight.

use super::mem_durable::MemDurable;
use super::member::Envelope;
use super::writer::{write_round, Batch, LogWriter};
use std::collections::VecDeque;
use std::io;

/// A core's writer in the caller's thread, over an in-memory durable image.
#[derive(Debug)]
pub struct MemWriter {
    durable: MemDurable,
    /// Batches handed over and not yet written, oldest first.
    queued: VecDeque<Batch>,
    synced: u64,
    failed: Option<String>,
    immediate: bool,
    rounds: u64,
    /// The `after_sync` messages of batches synced, until the member takes them.
    released: Vec<Envelope>,
}

impl MemWriter {
    /// A writer over `durable` whose completions wait for the caller.
    pub fn new(durable: MemDurable) -> MemWriter {
        MemWriter {
            durable,
            queued: VecDeque::new(),
            synced: 0,
            failed: None,
            immediate: false,
            rounds: 0,
            released: Vec::new(),
        }
    }

    /// A writer over `durable` that writes and syncs every batch as it is handed over.
    pub fn immediate(durable: MemDurable) -> MemWriter {
        let mut writer = MemWriter::new(durable);
        writer.immediate = true;
        writer
    }

    /// Whether completions come at once from now on (switching it on completes the queue).
    pub fn set_immediate(&mut self, immediate: bool) {
        self.immediate = immediate;
        if immediate {
            self.complete();
        }
    }

    /// Batches handed over and not yet written.
    pub fn queued(&self) -> usize {
        self.queued.len()
    }

    /// Rounds written so far (each one sync, or one flush).
    pub fn rounds(&self) -> u64 {
        self.rounds
    }

    /// Writes every queued batch as one round, as the writer thread does when it finds them
    /// all queued. True if there was something to write.
    pub fn complete(&mut self) -> bool {
        self.complete_some(usize::MAX)
    }

    /// Writes the oldest `count` queued batches (at least one) as one round. True if there was
    /// something to write. After a failure (the image's sync mode) nothing is written again.
    pub fn complete_some(&mut self, count: usize) -> bool {
        if self.queued.is_empty() || self.failed.is_some() {
            return false;
        }
        let take = count.clamp(1, self.queued.len());
        let mut round: Vec<Batch> = self.queued.drain(..take).collect();
        match write_round(&mut self.durable, &round) {
            Ok(through) => {
                self.synced = through;
                for batch in &mut round {
                    self.released.append(&mut batch.after_sync);
                }
            }
            Err(error) => self.failed = Some(error.to_string()),
        }
        self.rounds += 1;
        true
    }

    /// The durable image (written and synced layers).
    pub fn durable(&self) -> &MemDurable {
        &self.durable
    }

    /// The durable image, e.g. to make its later syncs fail.
    pub fn durable_mut(&mut self) -> &mut MemDurable {
        &mut self.durable
    }

    /// What a crash now leaves: the synced layer only (queued and unsynced batches are lost).
    pub fn crashed(&self) -> MemDurable {
        let mut image = self.durable.clone();
        image.crash();
        image
    }
}

impl LogWriter for MemWriter {
    fn submit(&mut self, batch: Batch) -> Result<(), Batch> {
        if self.failed.is_some() {
            return Err(batch);
        }
        let expected = self.queued.back().map_or(self.synced, |last| last.number) + 1;
        assert_eq!(
            batch.number, expected,
            "batches handed over in order, each once"
        );
        self.queued.push_back(batch);
        if self.immediate {
            self.complete();
        }
        Ok(())
    }

    fn synced(&self) -> io::Result<u64> {
        match &self.failed {
            Some(error) => Err(io::Error::other(error.clone())),
            None => Ok(self.synced),
        }
    }

    fn take_released(&mut self, out: &mut Vec<Envelope>) {
        out.append(&mut self.released);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cluster::mem_durable::SyncMode;
    use crate::cluster::writer::Record;
    use raft::eraftpb::Entry;

    fn batch(number: u64) -> Batch {
        let entry = Entry {
            index: number,
            term: 1,
            ..Default::default()
        };
        Batch {
            number,
            must_sync: true,
            records: vec![Record::Entries {
                shard: 0,
                entries: vec![entry],
            }],
            after_sync: Vec::new(),
        }
    }

    #[test]
    fn batches_wait_for_a_completion_and_a_crash_loses_them() {
        let mut writer = MemWriter::new(MemDurable::new());
        writer.submit(batch(1)).expect("taken");
        writer.submit(batch(2)).expect("taken");
        writer.submit(batch(3)).expect("taken");
        assert_eq!(writer.synced().expect("healthy"), 0);
        assert!(
            writer.crashed().recovered().is_empty(),
            "nothing synced yet"
        );
        assert!(writer.complete_some(2));
        assert_eq!(writer.synced().expect("healthy"), 2);
        assert_eq!(writer.rounds(), 1, "one round for both");
        let image = writer.crashed().recovered();
        assert_eq!(image[0].1.entries.len(), 2, "the queued batch is lost");
        assert!(writer.complete());
        assert_eq!(writer.synced().expect("healthy"), 3);
        assert!(!writer.complete(), "nothing left");
    }

    #[test]
    fn a_failed_sync_is_reported_and_refuses_later_batches() {
        let mut durable = MemDurable::new();
        durable.set_sync_mode(SyncMode::Fail);
        let mut writer = MemWriter::immediate(durable);
        writer.submit(batch(1)).expect("taken");
        let error = writer.synced().expect_err("failed");
        assert!(error
            .to_string()
            .contains("syncing the write-ahead log failed"));
        assert!(writer.submit(batch(2)).is_err());
    }
}
