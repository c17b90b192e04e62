//! The live state of every group a log holds, and the rules that change it.
//!
//! Writes and replay go through the same three functions, so what a reopened log recovers is
//! exactly what the writer held. Per group the rules are those of raft's log:
//! - an entry batch must start no later than one past the last entry and after the snapshot;
//!   from its first index on, it replaces the suffix (later appends win over conflicts);
//! - a snapshot may not go back (its index is at least the current one, and not 0). If the log holds an
//!   entry at its index with its term (a snapshot taken locally to compact), the entries after
//!   it stay; otherwise (a leader's snapshot that does not match) every entry is dropped;
//!   Either way the hard state's commit and term are raised to at least the snapshot's;
//! - a hard state replaces the previous one.
//!
//! Invariant ([`check`]): entries are contiguous and start one past the snapshot's index.

use super::super::Recovered;
use raft::eraftpb::{Entry, HardState, Snapshot};

/// The index of the group's snapshot (0 when it has none).
pub fn snapshot_index(group: &Recovered) -> u64 {
    group
        .snapshot
        .as_ref()
        .map_or(0, |s| s.get_metadata().index)
}

/// The index of the group's last entry (the snapshot's when it has no entries).
pub fn last_index(group: &Recovered) -> u64 {
    group
        .entries
        .last()
        .map_or_else(|| snapshot_index(group), |entry| entry.index)
}

/// Checks that `entries` may be appended to `group`; says why not.
pub fn check_append(group: &Recovered, entries: &[Entry]) -> Result<(), String> {
    let Some(first) = entries.first() else {
        return Ok(());
    };
    let (snapshot, last) = (snapshot_index(group), last_index(group));
    if first.index <= snapshot || first.index > last + 1 {
        return Err(format!(
            "append at index {} outside {}..={} (snapshot at {snapshot})",
            first.index,
            snapshot + 1,
            last + 1
        ));
    }
    for pair in entries.windows(2) {
        if pair[1].index != pair[0].index + 1 {
            return Err(format!(
                "entries {} then {}: not contiguous",
                pair[0].index, pair[1].index
            ));
        }
    }
    Ok(())
}

/// Appends `entries` (already checked) to `group`, replacing the suffix from their first index.
pub fn append(group: &mut Recovered, entries: &[Entry]) {
    let Some(first) = entries.first() else {
        return;
    };
    let keep = (first.index - snapshot_index(group) - 1) as usize;
    group.entries.truncate(keep);
    group.entries.extend_from_slice(entries);
    check(group);
}

/// Checks that `snapshot` may be recorded for `group`; says why not.
pub fn check_snapshot(group: &Recovered, snapshot: &Snapshot) -> Result<(), String> {
    let (index, current) = (snapshot.get_metadata().index, snapshot_index(group));
    if index == 0 {
        return Err("snapshot at index 0".to_string());
    }
    if index < current {
        return Err(format!(
            "snapshot at index {index} is older than the current one at {current}"
        ));
    }
    Ok(())
}

/// Records `snapshot` (already checked) for `group`.
pub fn apply_snapshot(group: &mut Recovered, snapshot: &Snapshot) {
    let (index, term) = (snapshot.get_metadata().index, snapshot.get_metadata().term);
    let current = snapshot_index(group);
    let matches = match group.snapshot.as_ref() {
        Some(old) if index == current => old.get_metadata().term == term,
        _ => {
            index > current
                && group
                    .entries
                    .get((index - current - 1) as usize)
                    .is_some_and(|entry| entry.term == term)
        }
    };
    if matches {
        group.entries.drain(..(index - current) as usize);
    } else {
        group.entries.clear();
    }
    group.snapshot = Some(snapshot.clone());
    // As MemStorage does: a snapshot is committed, and raft refuses at restart a hard state
    // that commits less than the snapshot (if the hard state written after it was torn off).
    group.hard_state.commit = group.hard_state.commit.max(index);
    group.hard_state.term = group.hard_state.term.max(term);
    check(group);
}

/// Records `hard_state` for `group`.
pub fn set_hard_state(group: &mut Recovered, hard_state: &HardState) {
    group.hard_state = hard_state.clone();
}

/// Panics when `group` breaks its invariant (entries contiguous, right after the snapshot).
/// Runs in debug builds and tests.
pub fn check(group: &Recovered) {
    if cfg!(debug_assertions) {
        let first = snapshot_index(group) + 1;
        for (expected, entry) in (first..).zip(&group.entries) {
            assert_eq!(entry.index, expected, "wal state: entries not contiguous");
        }
    }
}

/// The encoded size of `group`'s live state, a little over what a compacted segment needs.
pub fn live_bytes(group: &Recovered) -> u64 {
    use protobuf::Message as _;
    let snapshot = group
        .snapshot
        .as_ref()
        .map_or(0, |s| s.compute_size() as u64);
    let entries: u64 = group
        .entries
        .iter()
        .map(|e| e.compute_size() as u64 + 4)
        .sum();
    64 + snapshot + entries + group.hard_state.compute_size() as u64
}
