//! What a peer's raft message carries for the shard machines, checked before it reaches raft.
//! No I/O.
//!
//! Raft replicates bytes it does not understand: an entry's `data` is a shard command, a
//! snapshot's `data` a shard snapshot. A legitimate leader only ever sends what its own shard
//! machine encoded, so bytes that do not decode come from a broken or hostile peer. Once raft
//! took them they cannot be refused any more: a snapshot that does not restore, or a committed
//! entry that does not decode, would leave this member's state apart from the other replicas'
//! (the partition then stops the member). So the thread that reads the connection (a core, or
//! the peer thread; a snapshot always on the peer thread) drops such a message before it is
//! delivered (raft tolerates loss), counts it and logs it; the connection stays up.
//!
//! Checked: every entry of a message is a normal entry whose data is empty (a new leader's
//! entry) or decodes as a [`Command`]; a snapshot's data restores as the snapshot of the
//! envelope's shard, applied up to the snapshot's own index.
//!
//! Deliberately not here: raft's own rules (the member refuses what raft-rs would panic on),
//! and the cost of a snapshot's full restore is paid twice (here, and on the core that restores
//! it): snapshots are rare, and the peer thread is not a core's loop.

use crate::cluster::machine::{Command, DecodeError, ShardMachine};
use raft::eraftpb::{EntryType, Message, MessageType};
use std::fmt;

/// Why a message was dropped.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Invalid {
    /// An entry of a type this cluster never proposes (a configuration change).
    EntryType {
        /// The entry's index.
        index: u64,
        /// Its type.
        kind: EntryType,
    },
    /// An entry whose data does not decode as a command.
    EntryData {
        /// The entry's index.
        index: u64,
        /// Why.
        error: DecodeError,
    },
    /// A snapshot whose data does not restore as this shard's.
    SnapshotData {
        /// The snapshot's index.
        index: u64,
        /// Why.
        error: DecodeError,
    },
    /// A snapshot whose data was taken at another index than its metadata says.
    SnapshotIndex {
        /// The snapshot's index (metadata).
        index: u64,
        /// The index its data was applied up to.
        applied: u64,
    },
}

impl fmt::Display for Invalid {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Invalid::EntryType { index, kind } => {
                write!(f, "entry {index} is a {kind:?} (never proposed here)")
            }
            Invalid::EntryData { index, error } => {
                write!(f, "entry {index} does not decode as a command: {error}")
            }
            Invalid::SnapshotData { index, error } => {
                write!(
                    f,
                    "the snapshot at {index} does not decode as this shard's: {error}"
                )
            }
            Invalid::SnapshotIndex { index, applied } => {
                write!(
                    f,
                    "the snapshot at {index} holds a state applied up to {applied}"
                )
            }
        }
    }
}

/// Checks what `message`, for shard `shard` of `shards`, carries for the shard machine.
pub fn check(shard: u32, shards: u32, message: &Message) -> Result<(), Invalid> {
    for entry in message.get_entries() {
        let index = entry.index;
        let kind = entry.get_entry_type();
        if kind != EntryType::EntryNormal {
            return Err(Invalid::EntryType { index, kind });
        }
        if !entry.get_data().is_empty() {
            Command::decode(entry.get_data())
                .map_err(|error| Invalid::EntryData { index, error })?;
        }
    }
    if message.get_msg_type() == MessageType::MsgSnapshot {
        let snapshot = message.get_snapshot();
        let index = snapshot.get_metadata().index;
        let machine = ShardMachine::restore(shard, shards, snapshot.get_data(), 0)
            .map_err(|error| Invalid::SnapshotData { index, error })?;
        if machine.applied() != index {
            let applied = machine.applied();
            return Err(Invalid::SnapshotIndex { index, applied });
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use raft::eraftpb::Entry;

    fn with_entries(entries: Vec<Entry>) -> Message {
        let mut message = Message::default();
        message.set_msg_type(MessageType::MsgAppend);
        message.set_entries(entries.into());
        message
    }

    fn entry(index: u64, kind: EntryType, data: Vec<u8>) -> Entry {
        let mut entry = Entry::default();
        entry.set_index(index);
        entry.set_entry_type(kind);
        entry.set_data(data.into());
        entry
    }

    fn snapshot(data: Vec<u8>, index: u64) -> Message {
        let mut message = Message::default();
        message.set_msg_type(MessageType::MsgSnapshot);
        message.mut_snapshot().set_data(data.into());
        message.mut_snapshot().mut_metadata().set_index(index);
        message
    }

    #[test]
    fn commands_empty_entries_and_snapshots_of_the_shard_pass() {
        let command = Command::Barrier { floor: 64 }.encode();
        let entries = vec![
            entry(5, EntryType::EntryNormal, Vec::new()),
            entry(6, EntryType::EntryNormal, command.clone()),
        ];
        assert_eq!(check(3, 8, &with_entries(entries)), Ok(()));
        let mut machine = ShardMachine::new(3, 8);
        machine.apply(1, &Command::decode(&command).expect("decodes"), 0);
        assert_eq!(check(3, 8, &snapshot(machine.snapshot(0), 1)), Ok(()));
        assert_eq!(
            check(3, 8, &Message::default()),
            Ok(()),
            "no entries, no snapshot"
        );
    }

    #[test]
    fn garbage_entries_conf_changes_and_foreign_snapshots_are_invalid() {
        let garbage = with_entries(vec![entry(7, EntryType::EntryNormal, vec![0xff; 9])]);
        let refused = check(0, 8, &garbage).expect_err("garbage");
        assert!(
            matches!(refused, Invalid::EntryData { index: 7, .. }),
            "{refused}"
        );
        let conf = with_entries(vec![entry(8, EntryType::EntryConfChange, vec![1])]);
        let refused = check(0, 8, &conf).expect_err("a conf change");
        assert!(refused.to_string().contains("entry 8"), "{refused}");
        let refused = check(0, 8, &snapshot(vec![0xde, 0xad], 4)).expect_err("garbage");
        assert!(
            matches!(refused, Invalid::SnapshotData { index: 4, .. }),
            "{refused}"
        );
        let mut machine = ShardMachine::new(3, 8);
        machine.apply(1, &Command::Barrier { floor: 64 }, 0);
        let other_shard = check(4, 8, &snapshot(machine.snapshot(0), 1));
        assert!(matches!(other_shard, Err(Invalid::SnapshotData { .. })));
        let other_index = check(3, 8, &snapshot(machine.snapshot(0), 9));
        let expected = Invalid::SnapshotIndex {
            index: 9,
            applied: 1,
        };
        assert_eq!(other_index, Err(expected));
    }
}
