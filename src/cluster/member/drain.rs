//! A member's drain, once per loop iteration, and what it hands out.
//!
//! raft-rs's asynchronous persistence: every ready group's ready is written to the group's
//! `MemStorage` (raft reads it from there at once) and to the iteration's [`Batch`] for the
//! writer, then advanced with `advance_append_async`, all inside one call: no ready is ever held
//! across calls, so nothing else can run between a group's `ready` and its advance (the old
//! two-half drain's hazard is gone by construction). What depends on this member's own writes
//! waits with the number of the batch that holds them: the ready's persisted messages (a
//! follower's or candidate's: votes, append responses) go with the batch itself, and the writer
//! sends them as soon as the batch is durable (a follower's append response does not wait for
//! its core to wake up); a received snapshot to restore, and the messages of a ready with no
//! writes of its own, wait in the group ([`Persisting`]). When the writer reports that batch
//! synced, the next drain hands those out and calls `on_persist_ready`. Leaders' messages leave at once (raft thesis
//! 10.2.1), and raft-rs hands out committed entries only up to what this member persisted: so
//! nothing is sent, applied or answered on the strength of a write before it is durable.
//!
//! Invariants: batches are numbered 1, 2, 3, ... and handed over in order, each once; at most
//! [`BATCHES_IN_FLIGHT_MAX`] are handed over and not synced (past it no ready is taken: the
//! groups wait, nothing is lost); a group's persisting readies are in ready and batch order.
//!
//! Deliberately not here: the disk (the writer's, `crate::cluster::writer`), and waiting.

use super::{LogWriter, Member};
use crate::cluster::writer::{Batch, Record, BATCHES_IN_FLIGHT_MAX};
use raft::eraftpb::{Entry, EntryType, Message, MessageType};
use raft::SnapshotStatus;
use std::collections::VecDeque;
use std::io;

/// Bytes (entries appended and committed, snapshot data) one [`Member::drain`] collects before
/// it leaves the remaining groups for the next iteration. One group's ready (or one queued
/// compaction record) may exceed what is left, so a drain holds at most this plus one of
/// those: a group's appends (at most `UNCOMMITTED_BYTES_MAX` as a leader, what peers sent
/// since the last drain as a follower), twice [`super::COMMITTED_BYTES_PER_READY`] of
/// committed entries, or one snapshot (at most one write-ahead log record).
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
    /// The proposal's data (empty unless `kind` is `Command`), shared with the entry raft
    /// handed out: no copy.
    pub data: bytes::Bytes,
}

/// Replace the state machine of `shard` with a snapshot's data; entries after `index` follow.
#[derive(Clone, Debug, PartialEq)]
pub struct Restore {
    /// The group's shard.
    pub shard: u32,
    /// The state-machine data, as given to [`Member::compact`] on some member (shared with
    /// the snapshot raft keeps: no copy).
    pub data: bytes::Bytes,
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

/// What one [`Member::drain`] hands out.
#[derive(Debug, Default)]
pub struct Drain {
    /// Messages to send now: leaders' messages (which may leave before this member's own
    /// writes are synced) and the messages of readies whose batch is now synced.
    pub messages: Vec<Envelope>,
    /// Snapshots to restore, before applying `committed`.
    pub restores: Vec<Restore>,
    /// Entries known committed and persisted here, to apply.
    pub committed: Vec<Committed>,
    /// Linearizable reads ready once applied up to their index.
    pub reads: Vec<ReadReady>,
    /// Leader or term changes.
    pub leaders: Vec<LeaderChanged>,
}

/// A ready advanced before its batch was synced: what waits for that batch.
#[derive(Debug)]
pub(super) struct Persisting {
    /// The batch that holds its writes (or the last batch handed over, for a ready without
    /// writes: everything before it must be durable first).
    pub(super) batch: u64,
    /// raft-rs's number of the ready.
    pub(super) ready: u64,
    /// Its messages that may leave only once its writes are durable (a follower's or a
    /// candidate's: votes, append responses).
    pub(super) messages: Vec<Message>,
    /// A snapshot received from the leader: restored once it is durable here.
    pub(super) restore: Option<Restore>,
}

/// A ready taken in this drain, before its batch number is known.
struct Taken {
    slot: usize,
    ready: u64,
    messages: Vec<Message>,
    restore: Option<Restore>,
}

/// What a member keeps between drains about its writes.
pub(super) struct State {
    /// Snapshots recovered at start, handed out by the first drain.
    restores: Vec<Restore>,
    /// (slot, peer) of snapshots sent in this drain, to report once the drain is done.
    snapshots: Vec<(usize, u64)>,
    /// The group the next drain starts with (so no group waits forever for its turn).
    start: usize,
    /// Writes made outside a drain (compaction snapshots), for the next batch.
    records: VecDeque<Record>,
    /// The last batch number handed out (0: none yet).
    numbered: u64,
    /// The last batch known synced.
    synced: u64,
    /// A batch the writer could not take yet; handed again before any other.
    unsent: Option<Batch>,
}

impl State {
    pub(super) fn new(restores: Vec<Restore>) -> State {
        State {
            restores,
            snapshots: Vec::new(),
            start: 0,
            records: VecDeque::new(),
            numbered: 0,
            synced: 0,
            unsent: None,
        }
    }

    pub(super) fn has_restores(&self) -> bool {
        !self.restores.is_empty()
    }

    /// Whether compaction snapshots wait for the next batch.
    pub(super) fn has_records(&self) -> bool {
        !self.records.is_empty()
    }

    /// Whether a batch waits to be handed to the writer again.
    pub(super) fn has_unsent(&self) -> bool {
        self.unsent.is_some()
    }

    /// Whether the writer has room for another batch.
    pub(super) fn has_room(&self) -> bool {
        self.unsent.is_none() && self.numbered - self.synced < BATCHES_IN_FLIGHT_MAX
    }

    /// Queues a write made between drains for the next batch.
    pub(super) fn queue(&mut self, record: Record) {
        self.records.push_back(record);
    }

    pub(super) fn synced(&self) -> u64 {
        self.synced
    }

    pub(super) fn check_invariants(&self) {
        assert!(
            self.synced <= self.numbered,
            "synced a batch never handed out"
        );
        if let Some(batch) = &self.unsent {
            assert_eq!(
                batch.number, self.numbered,
                "only the last batch waits to be sent"
            );
        }
    }
}

fn storage_error(error: raft::Error) -> io::Error {
    io::Error::other(format!("raft storage refused a write: {error}"))
}

/// The bytes of `entries`' data and context (what raft-rs's size limits count, near enough).
pub(super) fn entry_bytes(entries: &[Entry]) -> usize {
    entries.iter().map(payload_bytes).sum()
}

fn payload_bytes(entry: &Entry) -> usize {
    entry.get_data().len() + entry.get_context().len()
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
            EntryKind::Command => entry.take_data(),
            _ => bytes::Bytes::new(),
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
    for message in messages {
        split_append(message, &mut |message| {
            out.push(Envelope { shard, message })
        });
    }
}

/// Bytes an entry adds to an append besides its data and context (its index, term and type,
/// and protobuf's tags and lengths), counted generously.
const ENTRY_OVERHEAD_BYTES: usize = 32;

/// Hands out `message`, an append cut into consecutive appends of at most
/// [`MESSAGE_BYTES_MAX`](super::MESSAGE_BYTES_MAX) of entries each (at least one entry each).
/// raft-rs cuts the appends it builds at that size, but with `batch_append` it extends an
/// append it has not handed out yet without looking at the size: catching a follower up
/// (`send_append_aggressively`) puts every entry up to the in-flight window into one, which
/// could pass the peer frame's limit (`frame::FRAME_BYTES_MAX`) and never be delivered. Each
/// part after the first follows the previous part's last entry (its `index` and `log_term`),
/// with the same commit: what raft-rs would have sent without `batch_append`. Any other message
/// is handed out as it is.
pub(super) fn split_append(mut message: Message, out: &mut impl FnMut(Message)) {
    let limit = super::MESSAGE_BYTES_MAX as usize;
    let size = |entry: &Entry| payload_bytes(entry) + ENTRY_OVERHEAD_BYTES;
    if message.get_msg_type() != MessageType::MsgAppend
        || message.get_entries().iter().map(size).sum::<usize>() <= limit
    {
        return out(message);
    }
    let entries: Vec<Entry> = message.take_entries().into();
    let (mut index, mut log_term) = (message.index, message.log_term);
    let mut part: Vec<Entry> = Vec::new();
    let mut part_bytes = 0;
    let mut hand_out = |part: Vec<Entry>, index: u64, log_term: u64| {
        let mut piece = message.clone();
        piece.index = index;
        piece.log_term = log_term;
        piece.set_entries(part.into());
        out(piece);
    };
    for entry in entries {
        let bytes = size(&entry);
        if !part.is_empty() && part_bytes + bytes > limit {
            let last = part.last().expect("a part with entries");
            let next = (last.index, last.term);
            hand_out(std::mem::take(&mut part), index, log_term);
            (index, log_term) = next;
            part_bytes = 0;
        }
        part_bytes += bytes;
        part.push(entry);
    }
    hand_out(part, index, log_term);
}

impl<W: LogWriter> Member<W> {
    /// One drain, once per loop iteration: first what the writer synced since the last drain
    /// (the messages and restores that waited for it, and raft told), then, if the writer has
    /// room, every ready group's writes as one batch for the writer (leaders' messages and
    /// committed entries come out at once). Collects at most [`DRAIN_ENTRY_BYTES_MAX`] (see
    /// there). An error means the writer failed: the member cannot go on (see the module docs
    /// of [`Member`]).
    pub fn drain(&mut self) -> io::Result<Drain> {
        let mut out = Drain {
            restores: std::mem::take(&mut self.drain.restores),
            ..Drain::default()
        };
        self.learn_synced()?;
        self.release(&mut out);
        if let Some(batch) = self.drain.unsent.take() {
            self.drain.unsent = self.writer.submit(batch).err();
        }
        if self.drain.has_room() {
            self.take_readies(&mut out)?;
            // A writer that completes at once (a simulation's) lets raft know this drain.
            self.learn_synced()?;
            self.release(&mut out);
        }
        for (slot, to) in std::mem::take(&mut self.drain.snapshots) {
            // A snapshot is one message here: report it sent; if it is lost, the next probe
            // finds the follower still behind and sends it again.
            self.groups[slot]
                .raw
                .report_snapshot(to, SnapshotStatus::Finish);
            self.groups[slot].settle();
        }
        self.report_leaders(&mut out.leaders);
        self.debug_check();
        Ok(out)
    }

    fn learn_synced(&mut self) -> io::Result<()> {
        let synced = self.writer.synced()?;
        assert!(
            synced <= self.drain.numbered,
            "the writer synced batch {synced}, never handed out"
        );
        self.drain.synced = self.drain.synced.max(synced);
        Ok(())
    }

    /// Tells every group which of its readies are now durable, and hands out the messages
    /// that waited for them.
    fn release(&mut self, out: &mut Drain) {
        self.writer.take_released(&mut out.messages);
        let synced = self.drain.synced;
        for (slot, group) in self.groups.iter_mut().enumerate() {
            let mut last = None;
            while let Some(persisting) = group.persisting.front() {
                if persisting.batch > synced {
                    break;
                }
                let persisting = group.persisting.pop_front().expect("a front");
                out.restores.extend(persisting.restore);
                note_snapshots(slot, &persisting.messages, &mut self.drain.snapshots);
                envelopes(group.shard, persisting.messages, &mut out.messages);
                last = Some(persisting.ready);
            }
            if let Some(number) = last {
                group.raw.on_persist_ready(number);
                group.catch_up_applied();
                group.settle();
            }
        }
    }

    /// Takes the ready groups' readies into one batch and hands it to the writer.
    fn take_readies(&mut self, out: &mut Drain) -> io::Result<()> {
        let mut records = Vec::new();
        let mut bytes = 0;
        while bytes < DRAIN_ENTRY_BYTES_MAX {
            let Some(record) = self.drain.records.pop_front() else {
                break;
            };
            bytes += record.bytes();
            records.push(record);
        }
        let mut must_sync = false;
        let mut taken = Vec::new();
        let count = self.groups.len();
        let mut next = self.drain.start;
        for step in 0..count {
            let slot = (self.drain.start + step) % count;
            next = slot;
            if bytes >= DRAIN_ENTRY_BYTES_MAX {
                break;
            }
            next = (slot + 1) % count;
            if self.groups[slot].raw.has_ready() {
                bytes += self.take_ready(slot, &mut records, &mut must_sync, out, &mut taken)?;
            }
        }
        self.drain.start = next;
        let number = if records.is_empty() {
            // Nothing to write: these readies wait only for the batches before them, and
            // their messages leave from here once those are synced.
            self.drain.numbered
        } else {
            self.drain.numbered += 1;
            // The writer sends the readies' messages itself once the batch is durable (one
            // wake-up fewer on a follower's path to its append response).
            let mut after_sync = Vec::new();
            for taken in &mut taken {
                let shard = self.groups[taken.slot].shard;
                note_snapshots(taken.slot, &taken.messages, &mut self.drain.snapshots);
                envelopes(shard, std::mem::take(&mut taken.messages), &mut after_sync);
            }
            let batch = Batch {
                number: self.drain.numbered,
                must_sync,
                records,
                after_sync,
            };
            self.drain.unsent = self.writer.submit(batch).err();
            self.drain.numbered
        };
        for Taken {
            slot,
            ready,
            messages,
            restore,
        } in taken
        {
            let persisting = Persisting {
                batch: number,
                ready,
                messages,
                restore,
            };
            self.groups[slot].persisting.push_back(persisting);
        }
        Ok(())
    }

    /// Takes one group's ready: writes it to raft's storage and to `records`, hands out what
    /// may be acted on now, and advances the group without waiting for the writes. Returns the
    /// bytes it adds to the drain (entries, committed entries, snapshot data).
    fn take_ready(
        &mut self,
        slot: usize,
        records: &mut Vec<Record>,
        must_sync: &mut bool,
        out: &mut Drain,
        taken: &mut Vec<Taken>,
    ) -> io::Result<usize> {
        let group = &mut self.groups[slot];
        let shard = group.shard;
        let mut ready = group.raw.ready();
        *must_sync |= ready.must_sync();
        let store = group.raw.mut_store();
        let mut bytes = 0;
        let mut restore = None;
        if !ready.snapshot().is_empty() {
            let snapshot = ready.snapshot().clone();
            let index = snapshot.get_metadata().index;
            store
                .memory
                .wl()
                .apply_snapshot(snapshot.clone())
                .map_err(storage_error)?;
            bytes += snapshot.get_data().len();
            restore = Some(Restore {
                shard,
                data: snapshot.data.clone(),
                index,
            });
            store.snapshot = snapshot.clone();
            records.push(Record::Snapshot { shard, snapshot });
            group.handed = index;
        }
        if !ready.entries().is_empty() {
            store
                .memory
                .wl()
                .append(ready.entries())
                .map_err(storage_error)?;
            let entries = ready.take_entries();
            bytes += entry_bytes(&entries);
            records.push(Record::Entries { shard, entries });
        }
        if let Some(hard_state) = ready.hs() {
            store.memory.wl().set_hardstate(hard_state.clone());
            let hard_state = hard_state.clone();
            records.push(Record::HardState { shard, hard_state });
        }
        for read in ready.take_read_states() {
            out.reads.push(ReadReady {
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
        taken.push(Taken {
            slot,
            ready: ready.number(),
            messages: ready.take_persisted_messages(),
            restore,
        });
        group.raw.advance_append_async(ready);
        group.catch_up_applied();
        group.settle();
        Ok(bytes)
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
