//! Raft I/O of one iteration: the peers' messages stepped into the member's groups, the
//! ticks, leadership balancing, and the drain — what the core's writer synced since the last
//! drain, then every ready group's writes handed to the writer as one batch (the group commit),
//! its messages to the peers, and its committed entries handed on to be applied
//! (`apply.rs`). Also the compactor's hand-offs: a shard's machine is frozen every
//! `compact_every` applied entries and encoded off the loop, and the bytes go to the member at
//! the start of a later drain; a received snapshot is decoded off the loop too, and the shard's
//! committed entries wait behind it until its machine is installed.
//!
//! Deliberately not here: what an applied entry means for the machines and the requests
//! (`apply.rs`), and the leader's timed work (`duties.rs`).
//!
//! # Stopping the member
//!
//! Some failures leave this member unable to keep its promises, and it stops rather than go
//! on ([`stop_member`]): a write or sync of the write-ahead log that failed (what is on disk is
//! unknown, and the log refuses every later write), a snapshot that does not restore, a
//! committed entry that does not decode (skipping either would leave this replica's state apart
//! from the others', silently), and a compactor that failed (its thread died: the member would
//! never compact again). Peers' messages are checked before raft takes them
//! (`crate::cluster::peer::content`), so only a bug or damage on disk gets here. Stopping is
//! an `error!` line naming the shard, the index or the operation, then a panic of the core
//! thread: the server's existing failure path (`crate::server`'s failure guard) marks the
//! server failed, stops the other cores, and the binary exits 70. A panic is chosen over
//! unwinding by hand because the member's groups have advanced past writes whose fate is
//! unknown; nothing else may run on it after.

use super::{ClusterPartition, Peers, INBOUND_PER_ITERATION, TICKS_CAUGHT_UP_MAX, TICK_US};
use crate::cluster::compactor::{RestoreJob, Restored};
use crate::cluster::writer::LogWriter;

impl<D: LogWriter, P: Peers> ClusterPartition<D, P> {
    pub(super) fn step_inbound(&mut self) {
        for _ in 0..INBOUND_PER_ITERATION {
            let Some((shard, message)) = self.peers.try_recv() else {
                return;
            };
            if let Err(error) = self.member.step(shard, message) {
                // Expected now and then (a message for a term long gone); a peer's hostile
                // messages are refused and counted before they get here.
                log::debug!("shard {shard}: message refused: {error}");
            }
        }
    }

    pub(super) fn tick(&mut self) {
        if self.next_tick_us == 0 {
            self.next_tick_us = self.now_us + TICK_US;
            return;
        }
        let mut ticks = 0;
        while self.now_us >= self.next_tick_us && ticks < TICKS_CAUGHT_UP_MAX {
            self.member.tick();
            self.next_tick_us += TICK_US;
            ticks += 1;
        }
        if self.now_us >= self.next_tick_us {
            self.next_tick_us = self.now_us + TICK_US;
        }
    }

    /// Spreads leadership over the live members (the member rate-limits it: every 3 s at most).
    pub(super) fn balance(&mut self) {
        if self.shutting_down || !self.member.balance_due() {
            return;
        }
        let live = self.member.live_voters();
        for (shard, to) in self.member.balance(&live) {
            self.leadership_log.handed(shard, to);
        }
    }

    /// The drain: what the core's writer synced since the last (the messages and restores
    /// that waited for it), then every ready group's writes handed to the writer as one batch,
    /// without waiting for the disk. A failed write or sync (the writer's error) stops the
    /// member: it cannot promise durability any more.
    pub(super) fn drain(&mut self) {
        self.take_compactions();
        if !self.member.has_ready() {
            self.serve_held();
            self.serve_resolves();
            return self.serve_reads();
        }
        let drain = match self.member.drain() {
            Ok(drain) => drain,
            Err(error) => stop_member(format!("core {}: {error}", self.settings.core)),
        };
        if !drain.messages.is_empty() {
            self.peers.send(drain.messages);
        }
        for restore in drain.restores {
            self.begin_restore(restore.shard, restore.data, restore.index);
        }
        self.apply(drain.committed);
        self.leaders_changed(&drain.leaders);
        self.reads_ready(drain.reads);
        self.serve_reads();
        self.serve_held();
        self.serve_resolves();
    }

    /// The snapshots the compactor encoded since the last drain, handed to the member: each is
    /// recorded by this drain's batch, unless a received snapshot was restored past its index
    /// meanwhile (the member refuses it, and it is dropped). A compactor that failed (its
    /// thread died) stops the member: it would never compact again, and its log would grow
    /// without bound.
    fn take_compactions(&mut self) {
        let done = match self.compactor.take_done() {
            Ok(done) => done,
            Err(error) => stop_member(format!("core {}: {error}", self.settings.core)),
        };
        for restored in self.compactor.take_restored() {
            let local = self.local(restored.shard);
            self.decoded(restored);
            self.advance_held(local);
        }
        for compacted in done {
            let (shard, index) = (compacted.shard, compacted.index);
            let local = self.local(shard);
            let recorded = match self.member.compact(shard, index, compacted.data) {
                Ok(()) => {
                    self.compactions.0 += 1;
                    true
                }
                Err(error) => {
                    self.compactions.1 += 1;
                    log::debug!("shard {shard}: the snapshot at {index} is dropped: {error}");
                    false
                }
            };
            self.shards[local].compaction_done(index, recorded);
        }
    }

    /// The core's log writer, e.g. for a simulation to complete its rounds.
    #[cfg(any(test, feature = "testing"))]
    pub fn writer_mut(&mut self) -> &mut D {
        self.member.writer_mut()
    }

    /// A snapshot raft handed out to restore: decoded off the loop by the compactor (here, if
    /// it cannot take it now); until its machine is installed, the shard's committed entries
    /// wait behind it. The machine's deadlines count from now, before it is
    /// installed: earlier than counting at the install would make them, still later than the
    /// sender's (its remaining times were measured when the snapshot was taken, before it was
    /// received here), so leases never end early.
    fn begin_restore(&mut self, shard: u32, data: bytes::Bytes, index: u64) {
        let local = self.local(shard);
        let job = RestoreJob {
            shard,
            shards: self.settings.shards,
            index,
            data,
            now_ms: self.apply_ms(),
        };
        self.shards[local].hold_restore(index);
        if let Err(job) = self.compactor.submit_restore(job) {
            log::debug!("shard {shard}: the snapshot at {index} is decoded on the loop");
            self.decoded(job.decode());
        }
        self.advance_held(local);
    }

    /// Keeps a decoded machine for its turn; a snapshot that does not restore stops the member.
    fn decoded(&mut self, restored: Restored) {
        let (shard, index) = (restored.shard, restored.index);
        match restored.machine {
            Ok(machine) => {
                let local = self.local(shard);
                self.shards[local].keep_decoded(index, machine);
            }
            Err(error) => stop_member(format!(
                "shard {shard}: the snapshot at index {index} does not restore: {error}"
            )),
        }
    }

    /// Installs the front restore of shard `local` if its machine is decoded, then applies the
    /// entries held behind it, up to the next restore; again while it can.
    fn advance_held(&mut self, local: usize) {
        while let Some(ready) = self.shards[local].take_ready_restore() {
            let shard = self.shards[local].machine().shard();
            self.install(shard, *ready.machine, ready.index);
            self.apply_now(ready.entries);
            self.shards[local].check_invariants();
        }
    }

    /// Every `compact_every` applied entries, right after applying one (nothing else applied
    /// since), freezes the shard's machine (O(1)) and hands the image to the compactor, which
    /// encodes it off the loop; [`Self::take_compactions`] hands the bytes to the member later.
    /// One image per shard in flight at most.
    pub(super) fn maybe_compact(&mut self, local: usize) {
        let Some(applied) = self.shards[local].compaction_due(self.settings.compact_every) else {
            return;
        };
        let machine = self.shards[local].machine();
        let (frozen, shard) = (machine.freeze(self.now_ms()), machine.shard());
        match self.compactor.submit(frozen) {
            Ok(()) => self.shards[local].compaction_started(applied),
            Err(_) => log::debug!("shard {shard}: compaction deferred: the compactor is full"),
        }
    }
}

/// Stops this member: see the module docs. `what` names the shard and index, or the operation.
pub(crate) fn stop_member(what: String) -> ! {
    log::error!(
        "{what}: this member stops (the process exits 70) rather than go on with a state it \
         cannot vouch for"
    );
    panic!("cluster member stopped: {what}");
}

#[cfg(test)]
#[path = "drive_tests.rs"]
mod tests;
