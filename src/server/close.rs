//! The close protocol of a core's sessions, and the core's shutdown.
//!
//! # A session's end
//!
//! `Core::begin_close` stops reading the session, withdraws its waiters in the local
//! partition and asks every other core to withdraw them in theirs (`SessionClosed`, answered
//! by `ClosedAck`). A session whose socket failed ([`Phase::Dead`]) loses its unsent output,
//! and every grant whose `A` was in it is released by the partition that made it: that `A` was
//! never written (docs/protocol.md §3). A session that ends normally ([`Phase::Draining`]: end of
//! input, or a closing error) writes all its answers first. `Core::end_closed_sessions` frees
//! a session once every partition acknowledged, its output is flushed and, after a half-close,
//! the peer's unread input was drained ([`Phase::Lingering`], at most [`LINGER`]), so that a
//! reset cannot destroy answers in flight.
//!
//! # Shutdown
//!
//! A core stops accepting, answers every queued waiter `B` (and the table answers `B` to any
//! later Acquire), flushes, and stops once every core was quiescent at the same moment or
//! `SHUTDOWN_GRACE` (4.5 s) passed (the contract gives 5 s).
//!
//! Invariant: a slot is freed only after its session's id can no longer appear in any message.

use super::core::Core;
use super::net::Net;
use super::route::Msg;
use super::session::Phase;
use crate::partition::Partition;
use std::sync::atomic::Ordering;
use std::time::Duration;

/// How long a shutdown may take before the core stops regardless (the contract says 5 s).
const SHUTDOWN_GRACE: Duration = Duration::from_millis(4500);
/// How long a closed session keeps dropping the peer's unread input before the socket closes.
pub const LINGER: Duration = Duration::from_secs(2);

/// Why a session closes, for the log.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CloseReason {
    /// The peer ended its input.
    EndOfInput,
    /// Reading failed (typically a reset by the peer).
    ReadFailed,
    /// Writing failed (typically a reset by the peer).
    WriteFailed,
    /// A closing error was answered (`X` with this code).
    Error(u8),
    /// An admin HTTP request was answered.
    Admin,
    /// The TLS handshake did not finish in time.
    HandshakeTimeout,
    /// The TLS stream failed (its error is logged apart).
    TlsError,
}

impl std::fmt::Display for CloseReason {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            CloseReason::EndOfInput => write!(f, "end of input"),
            CloseReason::ReadFailed => write!(f, "read failed (reset?)"),
            CloseReason::WriteFailed => write!(f, "write failed (reset?)"),
            CloseReason::Error(code) => write!(f, "closing error code {code}"),
            CloseReason::Admin => write!(f, "admin request answered"),
            CloseReason::HandshakeTimeout => write!(f, "handshake deadline passed"),
            CloseReason::TlsError => write!(f, "TLS error"),
        }
    }
}

impl<N: Net, P: Partition> Core<N, P> {
    /// Stops reading a session and withdraws its waiters everywhere; it ends once every
    /// partition acknowledged and (unless dead) its output is flushed.
    pub(super) fn begin_close(&mut self, slot: usize, phase: Phase, reason: CloseReason) {
        let session = &mut self.sessions[slot];
        if session.phase() == Phase::Open {
            session.set_phase(phase);
            session.discard_input(&mut self.buffers);
            let id = session.id();
            match session.peer() {
                Some(peer) => log::debug!("session {id:#x} from {peer}: closing: {reason}"),
                None => log::debug!("session {id:#x}: closing: {reason}"),
            }
            let client = session.client();
            let mut acks = 0;
            for outbox in self.links.outboxes.iter_mut().flatten() {
                outbox.push(Msg::SessionClosed {
                    session: id,
                    client,
                });
                acks += 1;
            }
            self.sessions[slot].await_acks(acks);
            self.table.handle_session_closed(id, client);
            self.start_grace(client);
            self.closing.push(slot);
        } else if phase == Phase::Dead {
            session.set_phase(Phase::Dead);
        }
        if phase == Phase::Dead {
            // After the withdrawals of its waiters (here done, elsewhere sent first): a
            // released grant goes to another session's waiter, never to this one's next.
            self.release_unsent_grants(slot);
        }
        self.route_answers();
    }

    /// The session's socket failed: its unsent output is gone, and so are the grants in it.
    fn release_unsent_grants(&mut self, slot: usize) {
        let client = self.sessions[slot].client();
        let unsent = self.sessions[slot].discard_output();
        for grant in unsent {
            self.release_grant(grant.partition as usize, grant.grant, grant.token, client);
        }
        self.route_answers();
    }

    /// Ends the closing sessions that are done: acknowledged everywhere, output flushed, and
    /// (unless dead) the peer's unread input drained or the linger deadline passed.
    pub(super) fn end_closed_sessions(&mut self) {
        let mut index = 0;
        self.lingering = 0;
        while index < self.closing.len() {
            let slot = self.closing[index];
            if !self.is_done_closing(slot) {
                index += 1;
                continue;
            }
            self.closing.swap_remove(index);
            self.free_session(slot);
        }
    }

    /// Whether the closing session in `slot` can be freed now; starts its linger when its
    /// output is out.
    fn is_done_closing(&mut self, slot: usize) -> bool {
        let now_us = self.now_us;
        let session = &mut self.sessions[slot];
        let flushed = session.phase() == Phase::Dead || !session.has_output();
        if session.acks_awaited() > 0 || !flushed {
            return false;
        }
        if session.phase() == Phase::Draining {
            session.linger(now_us + LINGER.as_micros() as u64);
        }
        let done = session.phase() == Phase::Dead
            || session.drop_incoming()
            || now_us >= session.linger_until_us();
        self.lingering += usize::from(!done);
        done
    }

    fn free_session(&mut self, slot: usize) {
        let mut session = self.sessions.remove(slot);
        // Every partition withdrew the session's waiters before acknowledging its close.
        debug_assert_eq!(
            self.links
                .shared
                .queues
                .as_ref()
                .map_or(0, |q| q.queued(session.id())),
            0,
            "session {:#x} freed with acquires counted as queued",
            session.id()
        );
        session.discard_input(&mut self.buffers);
        self.net.deregister(session.socket_mut());
        log::trace!("session {:#x}: freed", session.id());
        drop(session.into_socket());
        self.links
            .shared
            .connections
            .fetch_sub(1, Ordering::Relaxed);
    }

    /// Shutdown bookkeeping. Returns true when this core should stop now.
    pub(super) fn shutdown_step(&mut self) -> bool {
        if self.stop_deadline.is_none() {
            if !self.links.shared.shutdown.load(Ordering::Acquire) {
                return false;
            }
            self.begin_shutdown();
        }
        let quiescent = self.is_quiescent();
        let index = self.settings.index;
        let all = self.links.shared.mark_quiescent(index, quiescent);
        let late = self.stop_deadline.is_some_and(|at| self.now_us >= at);
        if late && !all {
            log::warn!("core {index}: shutdown grace ran out");
        }
        all || late
    }

    fn begin_shutdown(&mut self) {
        // A single node's holds end with it; a cluster member's are replicated, and the other
        // members keep serving them.
        let holds = match self.table.cluster_stats() {
            Some(_) => "held locks kept by the cluster",
            None => "held locks dropped",
        };
        log::info!(
            "core {}: shutting down: {} queued acquires answered B, {} {holds}, \
             {} sessions to close",
            self.settings.index,
            self.table.waiter_count(),
            self.table.key_count(),
            self.sessions.len()
        );
        self.stop_deadline = Some(self.now_us + SHUTDOWN_GRACE.as_micros() as u64);
        self.table.handle_shutdown();
        self.route_answers();
        self.flush_outboxes();
        self.flush_sessions();
    }
}
