//! [`Member`]: the sans-IO host of one cluster member's Raft groups (one per shard).
//!
//! The voter set `{1..=n}` is fixed from configuration; every group starts with all voters
//! and there are no membership changes. The member owns no clock and no socket: the caller
//! ticks it every [`TICK_MS`], steps it with messages from peers, proposes, and drains.
//!
//! # Call order, once per loop iteration
//!
//! 1. [`Member::tick`] (if a tick is due), [`Member::step`], [`Member::propose`], ...
//! 2. [`Member::drain`]: what the writer synced since the last drain, then every ready group's
//!    writes as one batch handed to the writer (see `member/drain.rs`). Returns the messages
//!    to send, snapshots to restore, committed entries to apply, read results and leader
//!    changes.
//!
//! Nothing waits for the disk: the member hands its writes to a [`LogWriter`] (the core's
//! writer thread in a server) and learns later which batches are durable. Any method may be
//! called between two drains. After an error from a drain (the writer failed a write or a
//! sync) the member cannot go on: its groups believe writes that may not be on disk, and the
//! writer refuses everything after. A server stops the process (exit 70, an error line naming
//! the operation and the file: see `crate::cluster::partition`'s drain); only a test harness
//! rebuilds a member from what its durable image recovers.
//!
//! # Invariants (checked after every mutation in debug builds)
//! Per group: applied ≤ commit ≤ last index; the election timeout comes from the seeded
//! generator; a known leader is a voter; a leader names itself; the snapshot is committed.
//!
//! # Determinism
//! raft-rs draws election timeouts from `thread_rng`. Every time raft-rs re-draws (on a term
//! or role change) the group replaces the draw with one from a generator seeded by
//! `(seed, node id, shard)`, before anything reads it.
//!
//! It deliberately does not: change membership, send anything, keep a state machine, or
//! trust hostile peers beyond refusing unknown shards, non-voters, local message types,
//! foreign snapshot configurations, appends whose entries do not follow their index one by
//! one, and heartbeats committing past our log (raft-rs would panic on the last two: slicing
//! out of range, or committing past its last index). What entries and snapshots carry is
//! checked before they get here (`crate::cluster::peer::content`). raft-rs trusts its voters:
//! a Byzantine voter (the peer port has no authentication), or a member whose synced writes
//! were lost, can still make it panic, which stops the member.

mod drain;
mod group;
#[cfg(test)]
mod tests;

use crate::cluster::writer::{LogWriter, Record};
use crate::cluster::{load, Recovered};
use group::{conf_state, Group, GroupStorage, ELECTION_TICKS};
use raft::eraftpb::{Message, MessageType, Snapshot};
use raft::prelude::Config;
use raft::{ReadOnlyOption, Storage};
use std::fmt;

pub use drain::{
    Committed, EntryKind, Envelope, LeaderChanged, ReadReady, Restore, DRAIN_ENTRY_BYTES_MAX,
};

/// Milliseconds between two calls to [`Member::tick`].
pub const TICK_MS: u64 = 10;
/// Ticks between a leader's heartbeats.
pub const HEARTBEAT_TICKS: usize = 2;
/// Largest message raft-rs builds (appends are cut to this many bytes of entries).
pub const MESSAGE_BYTES_MAX: u64 = 1 << 20;
/// Appends in flight to one follower, per group. With `batch_append` raft-rs counts every
/// proposal it adds to an append not yet handed out as one more (1,024 measured no faster).
pub const INFLIGHT_MESSAGES_MAX: usize = 256;
/// Bytes of committed entries one group hands out per ready (apply batching).
pub const COMMITTED_BYTES_PER_READY: u64 = 1 << 20;
/// Bytes of proposed but uncommitted entries a leader accepts per group before it drops
/// proposals.
pub const UNCOMMITTED_BYTES_MAX: u64 = 8 << 20;
/// Largest proposal accepted by [`Member::propose`].
pub const PROPOSAL_BYTES_MAX: usize = 1 << 20;
/// Largest read context accepted by [`Member::read_index`].
pub const READ_CONTEXT_BYTES_MAX: usize = 64;
/// Groups one member hosts at most.
pub const GROUPS_MAX: usize = 4096;
/// Ticks between two leadership-balancing passes ([`Member::balance`]): 3 s.
pub const BALANCE_INTERVAL_TICKS: u64 = 300;

const _: () = assert!(COMMITTED_BYTES_PER_READY <= UNCOMMITTED_BYTES_MAX);
const _: () = assert!(MESSAGE_BYTES_MAX <= UNCOMMITTED_BYTES_MAX);
const _: () = assert!(PROPOSAL_BYTES_MAX as u64 <= MESSAGE_BYTES_MAX);
const _: () = assert!(HEARTBEAT_TICKS < ELECTION_TICKS);

/// Where a proposal will sit in the log if it commits.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Proposed {
    /// Its log index.
    pub index: u64,
    /// The term of the leader that appended it.
    pub term: u64,
}

/// A proposal or request was refused because this member does not lead the group (or the
/// leader is busy transferring leadership, or the proposal is too large, or the shard is
/// unknown: then `hint` is `None`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct NotLeader {
    /// The leader this member knows of, to retry there.
    pub hint: Option<u64>,
}

impl fmt::Display for NotLeader {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.hint {
            Some(id) => write!(f, "not the leader; try member {id}"),
            None => write!(f, "not the leader; no leader known"),
        }
    }
}

impl std::error::Error for NotLeader {}

/// Why a message from a peer was refused.
#[derive(Debug)]
pub enum StepError {
    /// This member hosts no group for the shard.
    UnknownShard(u32),
    /// The sender is not a voter, or the message is not addressed to this member.
    Stranger {
        /// The claimed sender.
        from: u64,
        /// The claimed recipient.
        to: u64,
    },
    /// A local message type, or a snapshot whose configuration is not ours.
    Invalid(MessageType),
    /// raft-rs refused it.
    Raft(raft::Error),
}

impl fmt::Display for StepError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            StepError::UnknownShard(shard) => write!(f, "no group for shard {shard}"),
            StepError::Stranger { from, to } => write!(f, "message from {from} to {to} refused"),
            StepError::Invalid(kind) => write!(f, "message of type {kind:?} refused"),
            StepError::Raft(error) => write!(f, "raft refused the message: {error}"),
        }
    }
}

impl std::error::Error for StepError {}

/// Why [`Member::compact`] refused or failed.
#[derive(Debug)]
pub enum CompactError {
    /// This member hosts no group for the shard.
    UnknownShard(u32),
    /// The index is not between the last snapshot and the applied index.
    OutOfRange {
        /// The index asked for.
        index: u64,
        /// The last snapshot's index.
        snapshot: u64,
        /// The group's applied index.
        applied: u64,
    },
}

impl fmt::Display for CompactError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            CompactError::UnknownShard(shard) => write!(f, "no group for shard {shard}"),
            CompactError::OutOfRange {
                index,
                snapshot,
                applied,
            } => write!(
                f,
                "cannot compact at {index}: snapshot at {snapshot}, applied {applied}"
            ),
        }
    }
}

impl std::error::Error for CompactError {}

/// Why [`Member::new`] failed.
#[derive(Debug)]
pub enum NewError {
    /// Too many groups, duplicate shards, or this member is not a voter.
    Config(String),
    /// raft-rs refused the configuration or the recovered state.
    Raft(raft::Error),
}

impl fmt::Display for NewError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            NewError::Config(why) => write!(f, "bad member configuration: {why}"),
            NewError::Raft(error) => write!(f, "raft refused the recovered state: {error}"),
        }
    }
}

impl std::error::Error for NewError {}

/// The Raft groups of one member. See the module docs for the call order.
pub struct Member<W: LogWriter> {
    /// This member's id (a voter).
    id: u64,
    /// Every voter, sorted.
    voters: Vec<u64>,
    /// The hosted groups, sorted by shard.
    groups: Vec<Group>,
    /// Where the writes go, to be made durable off the loop.
    writer: W,
    /// Batches handed out and synced, writes waiting for the next batch.
    drain: drain::State,
    /// Ticks since start.
    ticks: u64,
    /// The tick of the last balancing pass.
    balanced_at_ticks: u64,
}

/// Whether a message's entries (if any) are at `index + 1`, `index + 2`, ...: raft-rs slices
/// an append by those positions and would panic on a gap.
fn entries_follow(message: &Message) -> bool {
    let mut expected = message.index;
    message.get_entries().iter().all(|entry| {
        expected = expected.saturating_add(1);
        entry.index == expected && expected != u64::MAX
    })
}

/// The raft-rs configuration of every group (see the constants for the values).
fn config(id: u64, applied: u64) -> Config {
    Config {
        id,
        election_tick: ELECTION_TICKS,
        heartbeat_tick: HEARTBEAT_TICKS,
        // raft-rs draws from thread_rng; `Group::settle` replaces every draw with a seeded one.
        min_election_tick: ELECTION_TICKS,
        max_election_tick: 2 * ELECTION_TICKS,
        applied,
        max_size_per_msg: MESSAGE_BYTES_MAX,
        max_inflight_msgs: INFLIGHT_MESSAGES_MAX,
        check_quorum: true,
        pre_vote: true,
        read_only_option: ReadOnlyOption::Safe,
        max_uncommitted_size: UNCOMMITTED_BYTES_MAX,
        max_committed_size_per_ready: COMMITTED_BYTES_PER_READY,
        // A leader whose commit index moved does not send every follower an append just to
        // say so: followers learn it from the next append or heartbeat (at most
        // `HEARTBEAT_TICKS` later). Only the leader answers clients, and a follower that
        // applies later counts its leases from later, never earlier; this halves the messages
        // (and the follower's writer rounds) of a lone request.
        skip_bcast_commit: true,
        // The proposals of one drain go to each follower as one append (raft-rs extends the
        // append it has not handed out yet) instead of one append, one follower step, one
        // response and one commit per proposal.
        batch_append: true,
        ..Default::default()
    }
}

/// Builds one group's storage from what was recovered.
fn storage(recovered: &mut Recovered, voters: &[u64]) -> raft::Result<GroupStorage> {
    let snapshot = recovered.snapshot.clone().unwrap_or_default();
    let index = snapshot.get_metadata().index;
    // A commit recorded before a later snapshot was synced must not sit below it.
    if recovered.hard_state.commit < index {
        recovered.hard_state.commit = index;
    }
    let memory = load(recovered, voters)?;
    let mut snapshot = snapshot;
    if index > 0 {
        snapshot.mut_metadata().set_conf_state(conf_state(voters));
    }
    Ok(GroupStorage { memory, snapshot })
}

impl<W: LogWriter> Member<W> {
    /// Builds member `node_id` of the voters `voters`, hosting a group for each of `shards`,
    /// each loaded from its entry in `recovered` (a shard missing there starts fresh), handing
    /// its writes to `writer` (which holds what `recovered` came from). `seed` fixes every
    /// election timeout this member draws. A recovered snapshot is handed out as a `Restore` by
    /// the first [`Member::drain`].
    pub fn new(
        node_id: u64,
        voters: &[u64],
        shards: &[u32],
        writer: W,
        recovered: Vec<(u32, Recovered)>,
        seed: u64,
    ) -> Result<Self, NewError> {
        let mut voters = voters.to_vec();
        voters.sort_unstable();
        voters.dedup();
        if node_id == 0 || !voters.contains(&node_id) {
            return Err(NewError::Config(format!("{node_id} is not a voter")));
        }
        let mut sorted = shards.to_vec();
        sorted.sort_unstable();
        sorted.dedup();
        if sorted.len() != shards.len() || sorted.len() > GROUPS_MAX {
            return Err(NewError::Config("duplicate shards or too many".into()));
        }
        let mut recovered = recovered;
        let logger = slog::Logger::root(slog::Discard, slog::o!());
        let mut groups = Vec::with_capacity(sorted.len());
        let mut restores = Vec::new();
        for shard in sorted {
            let mut state = match recovered.iter().position(|(s, _)| *s == shard) {
                Some(at) => recovered.swap_remove(at).1,
                None => Recovered::default(),
            };
            let storage = storage(&mut state, &voters).map_err(NewError::Raft)?;
            let applied = storage.snapshot.get_metadata().index;
            if applied > 0 {
                restores.push(Restore {
                    shard,
                    data: storage.snapshot.data.clone(),
                    index: applied,
                });
            }
            let group_seed = seed ^ node_id.rotate_left(32) ^ u64::from(shard).rotate_left(48);
            let config = config(node_id, applied);
            let group =
                Group::new(shard, &config, storage, &logger, group_seed).map_err(NewError::Raft)?;
            groups.push(group);
        }
        let member = Member {
            id: node_id,
            voters,
            groups,
            writer,
            drain: drain::State::new(restores),
            ticks: 0,
            balanced_at_ticks: 0,
        };
        member.check_invariants();
        Ok(member)
    }

    /// This member's id.
    #[cfg(any(test, feature = "testing"))]
    pub fn id(&self) -> u64 {
        self.id
    }

    /// The shards hosted here, ascending.
    #[cfg(any(test, feature = "testing"))]
    pub fn shards(&self) -> impl Iterator<Item = u32> + '_ {
        self.groups.iter().map(|group| group.shard)
    }

    /// The writer (to inspect it).
    pub fn writer(&self) -> &W {
        &self.writer
    }

    /// The writer, e.g. to reach the core's other background work through it.
    #[cfg(any(test, feature = "testing"))]
    pub fn writer_mut(&mut self) -> &mut W {
        &mut self.writer
    }

    /// Gives the writer back, e.g. to recover from what it made durable after a crash.
    #[cfg(any(test, feature = "testing"))]
    pub fn into_writer(self) -> W {
        self.writer
    }

    /// The last batch known durable (0 before any).
    #[cfg(any(test, feature = "testing"))]
    pub fn synced(&self) -> u64 {
        self.drain.synced()
    }

    fn slot(&self, shard: u32) -> Option<usize> {
        self.groups
            .binary_search_by_key(&shard, |group| group.shard)
            .ok()
    }

    fn group(&self, shard: u32) -> Option<&Group> {
        self.slot(shard).map(|slot| &self.groups[slot])
    }

    /// The group for `shard`, to call into its `RawNode`.
    fn group_mut(&mut self, shard: u32) -> Option<&mut Group> {
        let slot = self.slot(shard)?;
        Some(&mut self.groups[slot])
    }

    /// Advances every group by one tick ([`TICK_MS`] of the caller's clock).
    pub fn tick(&mut self) {
        self.ticks += 1;
        for group in &mut self.groups {
            group.raw.tick();
            group.settle();
        }
        self.debug_check();
    }

    /// Hands a peer's message for `shard` to its group. Messages for unknown shards, from
    /// non-voters, not addressed here, of local types, carrying a snapshot of another
    /// configuration, or entries that do not follow the message's index one by one are
    /// refused.
    pub fn step(&mut self, shard: u32, message: Message) -> Result<(), StepError> {
        let (id, voters_ok) = (self.id, self.voters.contains(&message.from));
        if message.to != id || !voters_ok {
            return Err(StepError::Stranger {
                from: message.from,
                to: message.to,
            });
        }
        let kind = message.get_msg_type();
        let invalid = raft::raw_node::is_local_msg(kind)
            || !self.snapshot_fits(&message)
            || !entries_follow(&message);
        if invalid {
            return Err(StepError::Invalid(kind));
        }
        let group = self
            .group_mut(shard)
            .ok_or(StepError::UnknownShard(shard))?;
        let raft = &group.raw.raft;
        if kind == MessageType::MsgHeartbeat
            && message.term >= raft.term
            && message.commit > raft.raft_log.last_index()
        {
            // The leader believes this member holds entries it does not: synced writes were
            // lost. raft-rs would panic; refuse instead (the group stays stuck here).
            log::error!(
                "shard {shard}: heartbeat commits {} beyond our last index {}: lost writes?",
                message.commit,
                raft.raft_log.last_index()
            );
            return Err(StepError::Invalid(kind));
        }
        let result = group.raw.step(message);
        group.settle();
        self.debug_check();
        result.map_err(StepError::Raft)
    }

    /// Whether a message's snapshot (if any) has exactly our voters and no learners.
    fn snapshot_fits(&self, message: &Message) -> bool {
        if message.get_msg_type() != MessageType::MsgSnapshot {
            return true;
        }
        let conf = message.get_snapshot().get_metadata().get_conf_state();
        let mut voters = conf.get_voters().to_vec();
        voters.sort_unstable();
        voters == self.voters
            && conf.get_learners().is_empty()
            && conf.get_voters_outgoing().is_empty()
    }

    /// Proposes `data` to `shard`'s group; returns where the entry was appended. It is
    /// acknowledged only when an entry with that index *and term* comes out committed.
    pub fn propose(&mut self, shard: u32, data: Vec<u8>) -> Result<Proposed, NotLeader> {
        let refused = NotLeader { hint: None };
        if data.len() > PROPOSAL_BYTES_MAX {
            return Err(refused);
        }
        let group = self.group_mut(shard).ok_or(refused)?;
        let hint = NotLeader {
            hint: group.leader(),
        };
        if !group.is_leader() {
            return Err(hint);
        }
        let expected = data.clone();
        let result = group.raw.propose(Vec::new(), data);
        group.settle();
        let proposed = result.ok().and_then(|()| {
            let raft = &group.raw.raft;
            let last = raft.raft_log.unstable_entries().last()?;
            let appended = last.index == raft.raft_log.last_index()
                && last.term == raft.term
                && last.get_data() == expected.as_slice();
            appended.then_some(Proposed {
                index: last.index,
                term: last.term,
            })
        });
        self.debug_check();
        proposed.ok_or(hint)
    }

    /// Starts a linearizable read on `shard` (ReadIndex); the result comes out of a later
    /// [`Member::drain`] as a `ReadReady` with the same `context`. A read that cannot be
    /// served (no leader, lost messages) never comes back: the caller times it out.
    pub fn read_index(&mut self, shard: u32, context: Vec<u8>) -> Result<(), NotLeader> {
        let refused = NotLeader { hint: None };
        if context.len() > READ_CONTEXT_BYTES_MAX {
            return Err(refused);
        }
        let group = self.group_mut(shard).ok_or(refused)?;
        group.raw.read_index(context);
        group.settle();
        self.debug_check();
        Ok(())
    }

    /// Asks `shard`'s leader (this member) to hand leadership to voter `to`.
    pub fn transfer_leader(&mut self, shard: u32, to: u64) -> Result<(), NotLeader> {
        let voter = self.voters.contains(&to);
        let group = self.group_mut(shard).ok_or(NotLeader { hint: None })?;
        if !group.is_leader() || !voter {
            return Err(NotLeader {
                hint: group.leader(),
            });
        }
        group.raw.transfer_leader(to);
        group.settle();
        self.debug_check();
        Ok(())
    }

    /// The leader `shard`'s group knows of.
    pub fn leader(&self, shard: u32) -> Option<u64> {
        self.group(shard)?.leader()
    }

    /// This member's role in `shard`'s group.
    #[cfg(any(test, feature = "testing"))]
    pub fn role(&self, shard: u32) -> Option<raft::StateRole> {
        Some(self.group(shard)?.raw.raft.state)
    }

    /// `shard`'s current term (0 for an unknown shard).
    pub fn term(&self, shard: u32) -> u64 {
        self.group(shard).map_or(0, |group| group.raw.raft.term)
    }

    /// `shard`'s commit index (0 for an unknown shard).
    pub fn commit(&self, shard: u32) -> u64 {
        self.group(shard)
            .map_or(0, |group| group.raw.raft.raft_log.committed)
    }

    /// The index of the last entry of `shard` handed out to apply (0 for an unknown shard).
    #[cfg(any(test, feature = "testing"))]
    pub fn applied(&self, shard: u32) -> u64 {
        self.group(shard)
            .map_or(0, |group| group.raw.raft.raft_log.applied)
    }

    /// Whether [`Member::drain`] has work now: restores to hand out, batches synced (or a
    /// writer failure) it did not learn of yet, a batch to hand over again, or, while the
    /// writer has room, ready groups or compaction snapshots to record (with no room, the
    /// writer's next completion is the work, and it wakes the caller).
    pub fn has_ready(&self) -> bool {
        let synced = self.writer.synced().unwrap_or(u64::MAX);
        let learned = synced > self.drain.synced();
        let writes = self.drain.has_records() || self.groups.iter().any(|g| g.raw.has_ready());
        let ready = self.drain.has_room() && writes;
        self.drain.has_restores() || learned || self.drain.has_unsent() || ready
    }

    /// Compacts `shard`'s log up to `index` after the caller's state machine took a snapshot
    /// of everything applied up to it: `data` becomes the snapshot a leader sends to members
    /// that are behind, and is recorded by the next drain's batch. `index` must be above the
    /// last snapshot and at most the applied index.
    pub fn compact(&mut self, shard: u32, index: u64, data: Vec<u8>) -> Result<(), CompactError> {
        let voters = conf_state(&self.voters);
        let group = self
            .group_mut(shard)
            .ok_or(CompactError::UnknownShard(shard))?;
        let snapshot_index = group.raw.store().snapshot.get_metadata().index;
        let applied = group.raw.raft.raft_log.applied;
        let out_of_range = CompactError::OutOfRange {
            index,
            snapshot: snapshot_index,
            applied,
        };
        if index <= snapshot_index || index > applied {
            return Err(out_of_range);
        }
        let term = group.raw.store().term(index).map_err(|_| out_of_range)?;
        let mut snapshot = Snapshot::default();
        snapshot.set_data(data.into());
        let metadata = snapshot.mut_metadata();
        metadata.index = index;
        metadata.term = term;
        metadata.set_conf_state(voters);
        let store = group.raw.mut_store();
        // Keep the entry at `index` itself so its term stays known to raft-rs.
        if let Err(error) = store.memory.wl().compact(index) {
            panic!("compacting {index} within the applied log failed: {error}");
        }
        store.snapshot = snapshot.clone();
        self.drain.queue(Record::Snapshot { shard, snapshot });
        self.debug_check();
        Ok(())
    }

    /// The members this one has heard from recently, itself included: the voters that the
    /// progress of some group it leads marks recently active (raft-rs resets the marks every
    /// election timeout under check_quorum). A member that leads nothing knows only itself.
    pub fn live_voters(&self) -> Vec<u64> {
        let mut live = vec![self.id];
        for group in &self.groups {
            let raft = &group.raw.raft;
            if raft.state != raft::StateRole::Leader {
                continue;
            }
            for &voter in &self.voters {
                let active = raft.prs().get(voter).is_some_and(|p| p.recent_active);
                if active && !live.contains(&voter) {
                    live.push(voter);
                }
            }
        }
        live.sort_unstable();
        live
    }

    /// Whether [`Member::balance`] would plan now (once every [`BALANCE_INTERVAL_TICKS`]), so
    /// that a caller asks who is live only then.
    pub fn balance_due(&self) -> bool {
        self.ticks >= self.balanced_at_ticks + BALANCE_INTERVAL_TICKS
    }

    /// Spreads leadership: at most once every [`BALANCE_INTERVAL_TICKS`] (otherwise does
    /// nothing), plans moves with [`crate::cluster::balance::plan`] over this member's view of
    /// every group's leader and the members the caller believes are up (`live`), and starts
    /// the transfers away from this member. Returns the `(shard, to)` transfers started.
    pub fn balance(&mut self, live: &[u64]) -> Vec<(u32, u64)> {
        if !self.balance_due() {
            return Vec::new();
        }
        self.balanced_at_ticks = self.ticks;
        let leaders: Vec<Option<u64>> = self.groups.iter().map(Group::leader).collect();
        let mut started = Vec::new();
        for step in crate::cluster::balance::plan(&leaders, live) {
            let shard = self.groups[step.position].shard;
            if step.from == self.id && self.transfer_leader(shard, step.to).is_ok() {
                started.push((shard, step.to));
            }
        }
        started
    }

    /// Checks every group's invariants; panics on a broken one.
    pub fn check_invariants(&self) {
        for pair in self.groups.windows(2) {
            assert!(pair[0].shard < pair[1].shard, "groups sorted by shard");
        }
        for group in &self.groups {
            group.check_invariants(&self.voters);
        }
        self.drain.check_invariants();
    }

    fn debug_check(&self) {
        if cfg!(debug_assertions) {
            self.check_invariants();
        }
    }
}
