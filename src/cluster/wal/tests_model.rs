//! A seeded model test: random writes, syncs and crashes (drop without sync, sometimes cutting
//! the last file inside the last sync's bytes, or zeroing them from there as a write into the
//! preallocated segment that did not all reach the disk) against a model of the synced log of
//! each group.
//!
//! The model keeps each group's log in a `BTreeMap` by index, with raft's rules written
//! independently of `state.rs`. Seeds are printed; `WAL_SEED=<n>` replays one.

use super::tests::{entry, hard_state, snapshot as snapshot_at, TempDir};
use super::*;
use crate::cluster::load;
use crate::rng::Rng;

#[derive(Clone, Debug, Default, PartialEq)]
struct Group {
    hard_state: HardState,
    snapshot: Option<Snapshot>,
    log: BTreeMap<u64, Entry>,
}

impl Group {
    fn snapshot_index(&self) -> u64 {
        self.snapshot.as_ref().map_or(0, |s| s.get_metadata().index)
    }

    fn last_index(&self) -> u64 {
        self.log
            .keys()
            .next_back()
            .copied()
            .unwrap_or(self.snapshot_index())
    }

    fn to_recovered(&self) -> Recovered {
        Recovered {
            hard_state: self.hard_state.clone(),
            snapshot: self.snapshot.clone(),
            entries: self.log.values().cloned().collect(),
        }
    }
}

#[derive(Clone, Debug)]
enum Op {
    Append(u32, Vec<Entry>),
    HardState(u32, HardState),
    Snapshot(u32, Snapshot),
}

fn apply(model: &mut BTreeMap<u32, Group>, op: &Op) {
    match op {
        Op::Append(shard, entries) => {
            let group = model.entry(*shard).or_default();
            let first = entries[0].index;
            group.log.retain(|index, _| *index < first);
            for entry in entries {
                group.log.insert(entry.index, entry.clone());
            }
        }
        Op::HardState(shard, hard_state) => {
            model.entry(*shard).or_default().hard_state = hard_state.clone();
        }
        Op::Snapshot(shard, snapshot) => {
            let group = model.entry(*shard).or_default();
            let (index, term) = (snapshot.get_metadata().index, snapshot.get_metadata().term);
            let same_snapshot = group
                .snapshot
                .as_ref()
                .is_some_and(|s| s.get_metadata().index == index && s.get_metadata().term == term);
            let in_log = group.log.get(&index).is_some_and(|e| e.term == term);
            if same_snapshot || in_log {
                group.log.retain(|at, _| *at > index);
            } else {
                group.log.clear();
            }
            group.snapshot = Some(snapshot.clone());
            group.hard_state.commit = group.hard_state.commit.max(index);
            group.hard_state.term = group.hard_state.term.max(term);
        }
    }
}

/// A random valid write for a random one of four groups (a snapshot if `snapshot`).
fn random_op(rng: &mut Rng, model: &BTreeMap<u32, Group>, snapshot: bool) -> Op {
    let shard = rng.between(0, 3) as u32;
    let empty = Group::default();
    let group = model.get(&shard).unwrap_or(&empty);
    let (snap, last) = (group.snapshot_index(), group.last_index());
    match rng.between(0, 9) {
        _ if snapshot && last > snap && rng.between(0, 1) == 0 => {
            let index = rng.between(snap + 1, last);
            Op::Snapshot(shard, snapshot_at(index, group.log[&index].term))
        }
        _ if snapshot => Op::Snapshot(
            shard,
            snapshot_at(rng.between(snap.max(1), last + 3), rng.between(1, 4)),
        ),
        0..=6 => {
            // Mostly at the end, as a follower appends; sometimes over a conflicting suffix.
            let first = match rng.between(0, 4) {
                0 => rng.between(snap + 1, last + 1),
                _ => last + 1,
            };
            let term = rng.between(1, 4);
            let count = rng.between(1, 6);
            Op::Append(
                shard,
                (first..first + count).map(|i| entry(i, term)).collect(),
            )
        }
        _ => Op::HardState(
            shard,
            hard_state(rng.between(1, 9), rng.between(0, 3), last),
        ),
    }
}

fn perform(wal: &mut Wal, op: &Op) {
    let done = match op {
        Op::Append(shard, entries) => wal.append(*shard, entries),
        Op::HardState(shard, hard_state) => wal.set_hard_state(*shard, hard_state),
        Op::Snapshot(shard, snapshot) => wal.apply_snapshot(*shard, snapshot),
    };
    done.expect("a valid write");
}

fn recovered(model: &BTreeMap<u32, Group>) -> BTreeMap<u32, Recovered> {
    model
        .iter()
        .map(|(shard, group)| (*shard, group.to_recovered()))
        .collect()
}

/// The last sync, while its bytes are still the tail of the last file.
struct LastSync {
    path: PathBuf,
    start: u64,
    /// The end offset of each record of the sync, with its write.
    records: Vec<(u64, Op)>,
    /// The synced model before it.
    before: BTreeMap<u32, Group>,
}

/// One seeded run: the log, the model of what it holds, and what a crash would keep.
struct Run {
    seed: u64,
    rng: Rng,
    dir: TempDir,
    options: Options,
    wal: Wal,
    /// The model of everything written, and of what was synced.
    current: BTreeMap<u32, Group>,
    synced: BTreeMap<u32, Group>,
    /// The writes since the last sync, each with the buffer length after its record.
    pending: Vec<(u64, Op)>,
    last_sync: Option<LastSync>,
    /// Percent of writes that are snapshots: high values compact, low ones rotate.
    snapshot_percent: u64,
    crashes: u64,
    cuts: u64,
    totals: Stats,
}

impl Run {
    fn new(seed: u64) -> Run {
        let dir = TempDir::new("model");
        let options = Options {
            fsync: false,
            segment_bytes: 4096,
            ..Options::default()
        };
        let (wal, _) = Wal::open_with(&dir.0, options).expect("open");
        Run {
            seed,
            rng: Rng::new(seed),
            dir,
            options,
            wal,
            current: BTreeMap::new(),
            synced: BTreeMap::new(),
            pending: Vec::new(),
            last_sync: None,
            snapshot_percent: if seed % 2 == 0 { 2 } else { 20 },
            crashes: 0,
            cuts: 0,
            totals: Stats::default(),
        }
    }

    fn write(&mut self) {
        let snapshot = self.rng.between(0, 99) < self.snapshot_percent;
        let op = random_op(&mut self.rng, &self.current, snapshot);
        perform(&mut self.wal, &op);
        apply(&mut self.current, &op);
        self.pending.push((self.wal.buffer.len() as u64, op));
    }

    fn sync(&mut self) {
        let path = self.wal.segments[self.wal.segments.len() - 1].1.clone();
        let start = self.wal.file_bytes;
        self.wal.sync().expect("sync");
        let same_file = self.wal.segments[self.wal.segments.len() - 1].1 == path;
        let records: Vec<(u64, Op)> = self
            .pending
            .drain(..)
            .map(|(end, op)| (start + end, op))
            .collect();
        let before = std::mem::replace(&mut self.synced, self.current.clone());
        self.last_sync = (same_file && !records.is_empty()).then_some(LastSync {
            path,
            start,
            records,
            before,
        });
    }

    /// Drops the log unsynced, sometimes cutting the last sync's bytes short, and reopens it.
    fn crash(&mut self, step: u64) {
        self.crashes += 1;
        add(&mut self.totals, self.wal.stats());
        self.pending.clear();
        let cut = self
            .last_sync
            .take()
            .filter(|_| self.rng.between(0, 1) == 0);
        if let Some(last) = cut {
            let end = last.records[last.records.len() - 1].0;
            let cut = self.rng.between(last.start, end - 1);
            self.cuts += 1;
            let file = fs::OpenOptions::new()
                .write(true)
                .open(&last.path)
                .expect("open");
            if self.rng.between(0, 1) == 0 {
                file.set_len(cut).expect("cut");
            } else {
                // The write reached the preallocated segment only up to `cut`.
                use std::os::unix::fs::FileExt as _;
                let zeros = vec![0u8; (end - cut) as usize];
                file.write_all_at(&zeros, cut).expect("zeros");
            }
            self.synced = last.before;
            for (_, op) in last.records.iter().filter(|(end, _)| *end <= cut) {
                apply(&mut self.synced, op);
            }
        }
        let (wal, found) = Wal::open_with(&self.dir.0, self.options).expect("reopen");
        let found: BTreeMap<u32, Recovered> = found.into_iter().collect();
        let seed = self.seed;
        assert_eq!(
            found,
            recovered(&self.synced),
            "seed {seed} step {step}: recovered"
        );
        for group in found.values() {
            load(group, &[1, 2, 3]).expect("load");
        }
        self.wal = wal;
        self.current = self.synced.clone();
    }
}

fn run(seed: u64) {
    let mut run = Run::new(seed);
    for step in 0..1500 {
        match run.rng.between(0, 99) {
            0..=69 => run.write(),
            70..=97 => run.sync(),
            _ => run.crash(step),
        }
        if step % 16 == 0 {
            let expected = recovered(&run.current);
            assert_eq!(
                run.wal.groups, expected,
                "seed {seed} step {step}: live state"
            );
        }
    }
    add(&mut run.totals, run.wal.stats());
    let (crashes, cuts, totals) = (run.crashes, run.cuts, run.totals);
    println!("seed {seed}: {crashes} crashes ({cuts} cutting the last file), {totals:?}");
    assert!(
        crashes > 0 && totals.syncs > 0,
        "seed {seed}: crashes and syncs"
    );
}

fn add(totals: &mut Stats, stats: Stats) {
    totals.records += stats.records;
    totals.syncs += stats.syncs;
    totals.bytes += stats.bytes;
    totals.rotations += stats.rotations;
    totals.compactions += stats.compactions;
}

#[test]
fn random_writes_syncs_and_crashes_match_the_model() {
    let seeds: Vec<u64> = match std::env::var("WAL_SEED") {
        Ok(seed) => vec![seed.parse().expect("WAL_SEED is a number")],
        Err(_) => (1..=16).collect(),
    };
    for seed in seeds {
        println!("wal model: seed {seed} (replay with WAL_SEED={seed})");
        run(seed);
    }
}
