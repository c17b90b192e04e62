//! The two halves of a member's group-commit drain, and what they hand out.

use super::{Durable, Member};
use raft::eraftpb::{Entry, EntryType, Message, MessageType};
use raft::{Ready, SnapshotStatus};
use std::io;

/// Bytes of entries (appended plus committed) one [`Member::begin_drain`] collects before it
/// leaves the remaining groups for the next iteration. One group's ready may exceed what is
/// left, so a drain holds at most this plus one group's ready: that group's appends (at most
/// `UNCOMMITTED_BYTES_MAX` as a leader, what peers sent since the last drain as a follower)
/// and twice [`super::COMMITTED_BYTES_PER_READY`] of committed entries.
pub const DRAIN_ENTRY_BYTES_MAX: usize = 4 << 20;

/// A message for a peer, with the shard whose group it belongs to.
#[derive(Clone, Debug, PartialEq)]
pub struct Envelope {
    /// The group's shard.
    pub shard: u32,
    /// The Raft message; `message.to` is the peer.
    pub message: Message,
}

/// What kind of entry was committed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum EntryKind {
    /// A proposal's data: apply it.
    Command,
    /// The empty entry a new leader appends: skip it.
    Empty,
    /// A configuration change (never proposed here): skip it.
    ConfChange,
}

/// A committed entry to apply, in index order per shard, each exactly once per member
/// lifetime (after a restart, again from the restored snapshot on).
#[derive(Clone, Debug, PartialEq)]
pub struct Committed {
    /// The group's shard.
    pub shard: u32,
    /// The entry's log index.
    pub index: u64,
    /// The term it was appended in.
    pub term: u64,
    /// What to do with it.
    pub kind: EntryKind,
    /// The proposal's data (empty unless `kind` is `Command`).
    pub data: Vec<u8>,
}

/// Replace the state machine of `shard` with a snapshot's data; entries after `index` follow.
#[derive(Clone, Debug, PartialEq)]
pub struct Restore {
    /// The group's shard.
    pub shard: u32,
    /// The state-machine data, as given to [`Member::compact`] on some member.
    pub data: Vec<u8>,
    /// The last index the snapshot covers.
    pub index: u64,
}

/// A linearizable read may be served once the state machine has applied `index`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ReadReady {
    /// The group's shard.
    pub shard: u32,
    /// The context given to [`Member::read_index`].
    pub context: Vec<u8>,
    /// The commit index the read must wait for.
    pub index: u64,
}

/// The leader (or the term) a group knows of changed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LeaderChanged {
    /// The group's shard.
    pub shard: u32,
    /// The new leader, if one is known.
    pub leader: Option<u64>,
    /// The group's term.
    pub term: u64,
}

/// The first half of a drain: may be acted on before the sync.
#[derive(Debug, Default)]
pub struct Drain {
    /// Leader messages that may leave before this member's writes are synced.
    pub messages: Vec<Envelope>,
    /// Snapshots to restore, before applying `committed`.
    pub restores: Vec<Restore>,
    /// Entries known committed (and persisted) to apply.
    pub committed: Vec<Committed>,
}

/// The second half of a drain: after the sync.
#[derive(Debug, Default)]
pub struct Drained {
    /// Messages that may leave only now that the writes are synced.
    pub messages: Vec<Envelope>,
    /// More committed entries, after those of the [`Drain`].
    pub committed: Vec<Committed>,
    /// Linearizable reads ready once applied up to their index.
    pub reads: Vec<ReadReady>,
    /// Leader or term changes.
    pub leaders: Vec<LeaderChanged>,
}

/// A ready taken from a group and not yet advanced.
struct Taken {
    slot: usize,
    ready: Ready,
    /// Messages to send only after the sync.
    persisted: Vec<Message>,
}

/// What a member keeps between the halves of a drain.
pub(super) struct State {
    taken: Vec<Taken>,
    /// Snapshots recovered at start, handed out by the first drain.
    restores: Vec<Restore>,
    reads: Vec<ReadReady>,
    /// (slot, peer) of snapshots handed out before the sync, to report after the advance.
    snapshots: Vec<(usize, u64)>,
    /// The group the next drain starts with (so no group waits forever for its turn).
    start: usize,
    /// Set by `begin_drain`, cleared by a successful `finish_drain`.
    pending: bool,
}

impl State {
    pub(super) fn new(restores: Vec<Restore>) -> State {
        State {
            taken: Vec::new(),
            restores,
            reads: Vec::new(),
            snapshots: Vec::new(),
            start: 0,
            pending: false,
        }
    }

    pub(super) fn pending(&self) -> bool {
        self.pending
    }

    pub(super) fn has_restores(&self) -> bool {
        !self.restores.is_empty()
    }
}

fn storage_error(error: raft::Error) -> io::Error {
    io::Error::other(format!("raft storage refused a write: {error}"))
}

fn entry_bytes(entries: &[Entry]) -> usize {
    entries
        .iter()
        .map(|entry| entry.get_data().len() + entry.get_context().len())
        .sum()
}

fn committed(shard: u32, handed: &mut u64, entries: Vec<Entry>, out: &mut Vec<Committed>) {
    for mut entry in entries {
        assert_eq!(
            entry.index,
            *handed + 1,
            "shard {shard}: committed out of order"
        );
        *handed = entry.index;
        let kind = match entry.get_entry_type() {
            EntryType::EntryNormal if entry.get_data().is_empty() => EntryKind::Empty,
            EntryType::EntryNormal => EntryKind::Command,
            _ => EntryKind::ConfChange,
        };
        let data = match kind {
            EntryKind::Command => entry.take_data().to_vec(),
            _ => Vec::new(),
        };
        out.push(Committed {
            shard,
            index: entry.index,
            term: entry.term,
            kind,
            data,
        });
    }
}

fn envelopes(shard: u32, messages: Vec<Message>, out: &mut Vec<Envelope>) {
    out.extend(
        messages
            .into_iter()
            .map(|message| Envelope { shard, message }),
    );
}

impl<D: Durable> Member<D> {
    /// First half of a drain: writes every ready group's snapshot, entries and hard state to
    /// its storage and to the durable (unsynced), and returns what may be acted on before the
    /// sync. Collects at most [`DRAIN_ENTRY_BYTES_MAX`] (see there). After an error the member
    /// cannot go on (see the module docs of [`Member`]).
    pub fn begin_drain(&mut self) -> io::Result<Drain> {
        assert!(!self.drain.pending, "begin_drain twice");
        self.drain.pending = true;
        let mut out = Drain {
            restores: std::mem::take(&mut self.drain.restores),
            ..Drain::default()
        };
        let count = self.groups.len();
        let mut bytes = 0;
        let mut next = self.drain.start;
        for step in 0..count {
            let slot = (self.drain.start + step) % count;
            next = slot;
            if bytes >= DRAIN_ENTRY_BYTES_MAX {
                break;
            }
            next = (slot + 1) % count;
            if self.groups[slot].raw.has_ready() {
                bytes += self.take_ready(slot, &mut out)?;
            }
        }
        self.drain.start = next;
        Ok(out)
    }

    /// Takes one group's ready and persists it (unsynced); returns its entry bytes.
    fn take_ready(&mut self, slot: usize, out: &mut Drain) -> io::Result<usize> {
        let group = &mut self.groups[slot];
        let shard = group.shard;
        let mut ready = group.raw.ready();
        let store = group.raw.mut_store();
        if !ready.snapshot().is_empty() {
            let snapshot = ready.snapshot().clone();
            let index = snapshot.get_metadata().index;
            store
                .memory
                .wl()
                .apply_snapshot(snapshot.clone())
                .map_err(storage_error)?;
            self.durable.apply_snapshot(shard, &snapshot)?;
            out.restores.push(Restore {
                shard,
                data: snapshot.get_data().to_vec(),
                index,
            });
            store.snapshot = snapshot;
            group.handed = index;
        }
        let mut bytes = entry_bytes(ready.entries());
        if !ready.entries().is_empty() {
            store
                .memory
                .wl()
                .append(ready.entries())
                .map_err(storage_error)?;
            self.durable.append(shard, ready.entries())?;
        }
        if let Some(hard_state) = ready.hs() {
            store.memory.wl().set_hardstate(hard_state.clone());
            self.durable.set_hard_state(shard, hard_state)?;
        }
        for read in ready.take_read_states() {
            self.drain.reads.push(ReadReady {
                shard,
                context: read.request_ctx,
                index: read.index,
            });
        }
        let messages = ready.take_messages();
        note_snapshots(slot, &messages, &mut self.drain.snapshots);
        envelopes(shard, messages, &mut out.messages);
        let entries = ready.take_committed_entries();
        bytes += entry_bytes(&entries);
        committed(shard, &mut group.handed, entries, &mut out.committed);
        let persisted = ready.take_persisted_messages();
        self.drain.taken.push(Taken {
            slot,
            ready,
            persisted,
        });
        Ok(bytes)
    }

    /// Second half of a drain: syncs the durable once for every group, then advances the
    /// groups and returns what may be sent or applied only now. On an error nothing is
    /// advanced, and the member cannot go on (see the module docs of [`Member`]).
    pub fn finish_drain(&mut self) -> io::Result<Drained> {
        assert!(self.drain.pending, "finish_drain without begin_drain");
        let mut out = Drained::default();
        if !self.drain.taken.is_empty() {
            self.durable.sync()?;
        }
        let taken = std::mem::take(&mut self.drain.taken);
        let mut snapshots_sent = std::mem::take(&mut self.drain.snapshots);
        for Taken {
            slot,
            ready,
            persisted,
        } in taken
        {
            let shard = self.groups[slot].shard;
            note_snapshots(slot, &persisted, &mut snapshots_sent);
            envelopes(shard, persisted, &mut out.messages);
            self.advance(slot, ready, &mut out, &mut snapshots_sent)?;
        }
        self.drain.pending = false;
        for (slot, to) in snapshots_sent {
            // A snapshot is one message here: report it sent; if it is lost, the next probe
            // finds the follower still behind and sends it again.
            self.groups[slot]
                .raw
                .report_snapshot(to, SnapshotStatus::Finish);
            self.groups[slot].settle();
        }
        out.reads = std::mem::take(&mut self.drain.reads);
        self.report_leaders(&mut out.leaders);
        self.debug_check();
        Ok(out)
    }

    /// Advances one group past its (now synced) ready.
    fn advance(
        &mut self,
        slot: usize,
        ready: Ready,
        out: &mut Drained,
        snapshots_sent: &mut Vec<(usize, u64)>,
    ) -> io::Result<()> {
        let group = &mut self.groups[slot];
        let shard = group.shard;
        let mut light = group.raw.advance_append(ready);
        if let Some(commit) = light.commit_index() {
            let store = group.raw.mut_store();
            let hard_state = {
                let mut core = store.memory.wl();
                core.mut_hard_state().commit = commit;
                core.hard_state().clone()
            };
            self.durable.set_hard_state(shard, &hard_state)?;
        }
        let messages = light.take_messages();
        note_snapshots(slot, &messages, snapshots_sent);
        envelopes(shard, messages, &mut out.messages);
        let entries = light.take_committed_entries();
        committed(shard, &mut group.handed, entries, &mut out.committed);
        group.raw.advance_apply();
        group.settle();
        Ok(())
    }

    /// Emits a `LeaderChanged` for every group whose (leader, term) changed since the last.
    fn report_leaders(&mut self, out: &mut Vec<LeaderChanged>) {
        for group in &mut self.groups {
            let now = (group.raw.raft.leader_id, group.raw.raft.term);
            if now != group.reported {
                group.reported = now;
                out.push(LeaderChanged {
                    shard: group.shard,
                    leader: group.leader(),
                    term: now.1,
                });
            }
        }
    }
}

fn note_snapshots(slot: usize, messages: &[Message], out: &mut Vec<(usize, u64)>) {
    for message in messages {
        if message.get_msg_type() == MessageType::MsgSnapshot {
            out.push((slot, message.to));
        }
    }
}
