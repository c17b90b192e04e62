//! [`MemDurable`]: the [`Durable`] of the deterministic simulation, an in-memory image of
//! one member's writes in two layers, *written* (lost in a crash) and *synced*.
//!
//! Invariants: each group's image holds entries contiguous in index order, all after its
//! snapshot's index; its hard state's commit is at least the snapshot's index. A crash keeps
//! exactly the synced layer. For fault tests, [`SyncMode`] makes `sync` fail or lie.
//! Not a write-ahead log: nothing reaches a disk, and sizes are bounded only by what the
//! member compacts.

use super::durable::{Durable, Recovered};
use raft::eraftpb::{Entry, HardState, Snapshot};
use std::collections::{BTreeMap, BTreeSet};
use std::io;

/// What [`Durable::sync`] does.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SyncMode {
    /// Moves the written layer to the synced one.
    Normal,
    /// Returns an error and syncs nothing.
    Fail,
    /// Returns `Ok` but syncs nothing (a disk that lies: for showing the checks bite).
    Lie,
}

/// The in-memory durable image of one member.
#[derive(Clone, Debug)]
pub struct MemDurable {
    written: BTreeMap<u32, Recovered>,
    synced: BTreeMap<u32, Recovered>,
    /// Groups written since the last sync.
    dirty: BTreeSet<u32>,
    mode: SyncMode,
    syncs: u64,
}

impl Default for MemDurable {
    fn default() -> Self {
        Self::new()
    }
}

fn invalid(why: String) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidInput, why)
}

impl MemDurable {
    /// An empty image that syncs normally.
    pub fn new() -> Self {
        MemDurable {
            written: BTreeMap::new(),
            synced: BTreeMap::new(),
            dirty: BTreeSet::new(),
            mode: SyncMode::Normal,
            syncs: 0,
        }
    }

    /// Sets what later syncs do.
    pub fn set_sync_mode(&mut self, mode: SyncMode) {
        self.mode = mode;
    }

    /// Successful (or lying) syncs so far.
    pub fn syncs(&self) -> u64 {
        self.syncs
    }

    /// Loses every write since the last sync, as a crash would.
    pub fn crash(&mut self) {
        self.written = self.synced.clone();
        self.dirty.clear();
    }

    /// Every group's synced image, by shard, for [`crate::cluster::member::Member::new`].
    pub fn recovered(&self) -> Vec<(u32, Recovered)> {
        self.synced
            .iter()
            .map(|(shard, image)| (*shard, image.clone()))
            .collect()
    }

    fn image(&mut self, shard: u32) -> &mut Recovered {
        self.dirty.insert(shard);
        self.written.entry(shard).or_default()
    }

    /// Checks the image's invariants; panics on a broken one.
    pub fn check_invariants(&self) {
        for layer in [&self.written, &self.synced] {
            for (shard, image) in layer {
                let snapshot = image
                    .snapshot
                    .as_ref()
                    .map_or(0, |s| s.get_metadata().index);
                for (offset, entry) in image.entries.iter().enumerate() {
                    assert_eq!(entry.index, snapshot + 1 + offset as u64, "shard {shard}");
                }
                assert!(image.hard_state.commit >= snapshot, "shard {shard}: commit");
            }
        }
    }
}

impl Durable for MemDurable {
    fn append(&mut self, shard: u32, entries: &[Entry]) -> io::Result<()> {
        let Some(first) = entries.first() else {
            return Ok(());
        };
        let image = self.image(shard);
        let snapshot = image
            .snapshot
            .as_ref()
            .map_or(0, |s| s.get_metadata().index);
        let next = snapshot + 1 + image.entries.len() as u64;
        if first.index > next {
            return Err(invalid(format!(
                "shard {shard}: append at {} leaves a gap after {}",
                first.index,
                next - 1
            )));
        }
        let skip = (snapshot + 1).saturating_sub(first.index) as usize;
        let from = first.index.max(snapshot + 1);
        image.entries.truncate((from - snapshot - 1) as usize);
        image.entries.extend(entries.iter().skip(skip).cloned());
        Ok(())
    }

    fn set_hard_state(&mut self, shard: u32, hard_state: &HardState) -> io::Result<()> {
        self.image(shard).hard_state = hard_state.clone();
        Ok(())
    }

    fn apply_snapshot(&mut self, shard: u32, snapshot: &Snapshot) -> io::Result<()> {
        let image = self.image(shard);
        let metadata = snapshot.get_metadata();
        let old = image
            .snapshot
            .as_ref()
            .map_or(0, |s| s.get_metadata().index);
        if metadata.index <= old {
            return Ok(());
        }
        let at = (metadata.index - old - 1) as usize;
        // Keep the entries after the snapshot only if the log agrees with it at its index
        // (a local compaction); a snapshot from a leader replaces the whole log.
        let agrees = image
            .entries
            .get(at)
            .is_some_and(|entry| entry.term == metadata.term);
        if agrees {
            image.entries.drain(..=at);
        } else {
            image.entries.clear();
        }
        image.hard_state.commit = image.hard_state.commit.max(metadata.index);
        image.hard_state.term = image.hard_state.term.max(metadata.term);
        image.snapshot = Some(snapshot.clone());
        Ok(())
    }

    fn flush(&mut self) -> io::Result<()> {
        // Flushed writes stay in the written layer: a crash loses them, as a machine crash
        // can lose what a `write` left in the page cache.
        match self.mode {
            SyncMode::Fail => Err(io::Error::other("flush failed (injected)")),
            SyncMode::Normal | SyncMode::Lie => Ok(()),
        }
    }

    fn sync(&mut self) -> io::Result<()> {
        match self.mode {
            SyncMode::Fail => return Err(io::Error::other("sync failed (injected)")),
            SyncMode::Lie => {
                self.syncs += 1;
                return Ok(());
            }
            SyncMode::Normal => {}
        }
        for shard in std::mem::take(&mut self.dirty) {
            if let Some(image) = self.written.get(&shard) {
                self.synced.insert(shard, image.clone());
            }
        }
        self.syncs += 1;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn entry(index: u64, term: u64) -> Entry {
        Entry {
            index,
            term,
            ..Default::default()
        }
    }

    fn indexes(image: &Recovered) -> Vec<(u64, u64)> {
        image.entries.iter().map(|e| (e.index, e.term)).collect()
    }

    #[test]
    fn a_crash_keeps_only_the_synced() {
        let mut durable = MemDurable::new();
        durable
            .append(0, &[entry(1, 1), entry(2, 1)])
            .expect("append");
        durable.sync().expect("sync");
        durable.append(0, &[entry(3, 1)]).expect("append");
        durable.crash();
        let recovered = durable.recovered();
        assert_eq!(indexes(&recovered[0].1), vec![(1, 1), (2, 1)]);
        durable.check_invariants();
    }

    #[test]
    fn an_append_replaces_the_suffix_and_refuses_a_gap() {
        let mut durable = MemDurable::new();
        durable
            .append(0, &[entry(1, 1), entry(2, 1), entry(3, 1)])
            .expect("append");
        durable.append(0, &[entry(2, 2)]).expect("append");
        assert!(durable.append(0, &[entry(5, 2)]).is_err());
        durable.sync().expect("sync");
        assert_eq!(indexes(&durable.recovered()[0].1), vec![(1, 1), (2, 2)]);
    }

    #[test]
    fn a_compaction_keeps_the_suffix_a_foreign_snapshot_does_not() {
        let mut durable = MemDurable::new();
        durable
            .append(0, &[entry(1, 1), entry(2, 1), entry(3, 1)])
            .expect("append");
        let mut snapshot = Snapshot::default();
        snapshot.mut_metadata().index = 2;
        snapshot.mut_metadata().term = 1;
        durable.apply_snapshot(0, &snapshot).expect("snapshot");
        durable.sync().expect("sync");
        assert_eq!(indexes(&durable.recovered()[0].1), vec![(3, 1)]);
        snapshot.mut_metadata().index = 3;
        snapshot.mut_metadata().term = 2;
        durable.apply_snapshot(0, &snapshot).expect("snapshot");
        durable.sync().expect("sync");
        let image = &durable.recovered()[0].1;
        assert!(image.entries.is_empty());
        assert_eq!(image.hard_state.commit, 3);
        durable.check_invariants();
    }

    #[test]
    fn failing_and_lying_syncs_keep_nothing() {
        let mut durable = MemDurable::new();
        durable.set_sync_mode(SyncMode::Fail);
        durable.append(0, &[entry(1, 1)]).expect("append");
        assert!(durable.sync().is_err());
        durable.set_sync_mode(SyncMode::Lie);
        durable.sync().expect("lie");
        durable.crash();
        assert!(durable.recovered().is_empty());
    }
}
