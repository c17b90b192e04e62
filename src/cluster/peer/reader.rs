//! Peer connections read on a core's own loop.
//!
//! The peer thread accepts a connection and checks its hello; once accepted, it hands the
//! connection to one core ([`Handover`]: the peer's index modulo the core count), which
//! registers it on its own poll and reads it in its loop: the raft messages for its own shards
//! are stepped in the same iteration that read them, with no channel and no wake-up of another
//! thread between the socket and raft. Messages for another core's shards go on that core's
//! channel and wake it, as the peer thread does. The checks are the same code
//! ([`super::inbound`]); what changes is only who reads.
//!
//! A core keeps at most one connection per peer (a newer one from the same node replaces it,
//! as on the peer thread), in [`SOURCES`] slots whose tokens the core's poll reserves. A read
//! round reads each readable connection up to [`super::inbound::READS_PER_PASS`] times, at most
//! [`super::inbound::BUFFER_BYTES`] each (1 MiB a round: a large envelope, a snapshot of up to
//! 16 MiB, is read over several iterations, and parsed without a copy once whole); one cut
//! short stays readable ([`CoreReader::has_pending`]) and is read again next iteration.
//!
//! A connection closed for hostile input is reported to the peer thread ([`Refusal`]), which
//! counts it, logs it (rate-limited) and shows it in the peer's status, as for a connection it
//! reads itself. A connection that is gone is dropped with a `debug!` line: the peer redials.

use super::inbound::{wake_peer_thread, Close, Context, Inbound};
use super::PeerStats;
use crossbeam_channel::{Receiver, Sender, TrySendError};
use mio::{Interest, Registry, Token, Waker};
use raft::eraftpb::Message;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Instant;

/// Connections a core reads at most: one per peer.
pub const SOURCES: usize = super::PEERS_MAX;

/// A connection closed on a core for hostile input, for the peer thread to count and log.
pub(crate) struct Refusal {
    pub(crate) addr: SocketAddr,
    pub(crate) claimed: Option<u64>,
    pub(crate) reason: String,
}

/// The peer thread's side of the hand-over: one channel per core, and the way back for
/// refusals.
pub(crate) struct Handover {
    pub(crate) cores: Vec<Sender<Inbound>>,
    pub(crate) refusals: Receiver<Refusal>,
    /// Snapshots the cores read, to check here (see [`super::inbound::Context::snapshots`]).
    pub(crate) snapshots: Receiver<super::inbound::Unchecked>,
}

impl Handover {
    /// Hands `inbound` (whose hello from peer `index` was accepted, already deregistered from
    /// the peer thread's poll) to its core, whose index it returns; `None` if the core cannot
    /// take it (stopping, or [`SOURCES`] hand-overs not yet taken): the connection is then
    /// dropped and the peer redials.
    pub(crate) fn give(&self, index: usize, inbound: Inbound) -> Option<usize> {
        let core = index % self.cores.len();
        match self.cores[core].try_send(inbound) {
            Ok(()) => Some(core),
            Err(TrySendError::Full(_) | TrySendError::Disconnected(_)) => None,
        }
    }
}

/// What the core's poll gives a [`CoreReader`]: its registry and the first of the [`SOURCES`]
/// tokens reserved for it.
pub struct CorePoll {
    /// The core's poll's registry.
    pub registry: Registry,
    /// The token of slot 0; slot `i` is `token_base + i`.
    pub token_base: usize,
}

/// One core's peer connections (see the module docs).
pub struct CoreReader {
    handover: Receiver<Inbound>,
    poll: CorePoll,
    slots: Vec<Option<Inbound>>,
    readable: Vec<bool>,
    context: Context,
    stats: Arc<PeerStats>,
    refusals: Sender<Refusal>,
    peer_waker: Arc<Waker>,
}

impl CoreReader {
    pub(crate) fn new(
        handover: Receiver<Inbound>,
        poll: CorePoll,
        context: Context,
        stats: &Arc<PeerStats>,
        (refusals, peer_waker): (Sender<Refusal>, Arc<Waker>),
    ) -> CoreReader {
        CoreReader {
            handover,
            poll,
            slots: (0..SOURCES).map(|_| None).collect(),
            readable: vec![false; SOURCES],
            context,
            stats: Arc::clone(stats),
            refusals,
            peer_waker,
        }
    }

    /// A readiness event for slot `source` (a stale one finds nothing to read: harmless).
    pub fn on_ready(&mut self, source: usize) {
        if let Some(readable) = self.readable.get_mut(source) {
            *readable = true;
        }
    }

    /// Whether a call to [`CoreReader::recv`] has something to do without a new event: a
    /// connection handed over, one cut short, or messages read and not taken.
    pub fn has_pending(&self) -> bool {
        self.context.cores.has_local()
            || !self.handover.is_empty()
            || (self.slots.iter().zip(&self.readable)).any(|(slot, &ready)| ready && slot.is_some())
    }

    /// The next message for this core's shards: what was read already, else what one read
    /// round of the readable connections (and any handed over since) brings.
    pub fn recv(&mut self) -> Option<(u32, Message)> {
        if let Some(message) = self.context.cores.pop_local() {
            return Some(message);
        }
        self.take_handovers();
        if self.readable.iter().any(|&ready| ready) {
            self.read_round();
        }
        self.context.cores.pop_local()
    }

    /// Connections this core reads now.
    #[cfg(any(test, feature = "testing"))]
    pub fn connections(&self) -> usize {
        self.slots.iter().flatten().count()
    }

    fn take_handovers(&mut self) {
        while let Ok(mut inbound) = self.handover.try_recv() {
            let peer = inbound.peer();
            // A newer connection from the same node replaces the older one, as on the thread.
            let older = self.slots.iter().position(|slot| {
                slot.as_ref()
                    .is_some_and(|held| held.peer().is_some() && held.peer() == peer)
            });
            if let Some(older) = older {
                let replaced = std::io::Error::other("replaced by a newer connection");
                self.close(older, Close::Gone(replaced));
            }
            let Some(free) = self.slots.iter().position(Option::is_none) else {
                // Unreachable while hellos name distinct peers (at most SOURCES of them).
                log::warn!("peer {peer:?}: connection dropped: no free slot on this core");
                continue;
            };
            let token = Token(self.poll.token_base + free);
            let registry = &self.poll.registry;
            if let Err(error) = registry.register(inbound.stream(), token, Interest::READABLE) {
                log::warn!("peer {peer:?}: connection dropped: cannot register it: {error}");
                continue;
            }
            self.slots[free] = Some(inbound);
            // Bytes may have arrived before the registration: read without waiting.
            self.readable[free] = true;
        }
    }

    fn read_round(&mut self) {
        self.context.now = Instant::now();
        for slot in 0..self.slots.len() {
            if !std::mem::take(&mut self.readable[slot]) {
                continue;
            }
            let Some(inbound) = self.slots[slot].as_mut() else {
                continue;
            };
            match inbound.read_pass(&mut self.context, &self.stats) {
                Ok(true) => {}
                Ok(false) => self.readable[slot] = true,
                Err(close) => self.close(slot, close),
            }
        }
        self.context.cores.wake();
    }

    fn close(&mut self, slot: usize, close: Close) {
        let Some(mut inbound) = self.slots[slot].take() else {
            return;
        };
        self.readable[slot] = false;
        let _ = self.poll.registry.deregister(inbound.stream());
        let (addr, claimed) = (inbound.addr(), inbound.claimed());
        match close {
            Close::Gone(error) => {
                log::debug!("peer {claimed:?} connection from {addr} closed: {error}")
            }
            Close::Refused(reason) => {
                let refusal = Refusal {
                    addr,
                    claimed,
                    reason,
                };
                if self.refusals.try_send(refusal).is_err() {
                    PeerStats::add(&self.stats.refusals, 1);
                }
                wake_peer_thread(&self.peer_waker);
            }
        }
    }
}

impl Drop for CoreReader {
    fn drop(&mut self) {
        for inbound in self.slots.iter_mut().flatten() {
            let _ = self.poll.registry.deregister(inbound.stream());
        }
    }
}
