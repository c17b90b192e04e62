//! TLS sessions' failures: the handshake deadline, and TLS errors.
//!
//! A session whose stream is still in its handshake (TLS) when [`HANDSHAKE_DEADLINE`] has
//! passed since it was admitted is closed, so a client that connects and sends nothing (or a
//! byte a second) cannot hold a session slot. A session whose stream fails with a TLS error (a
//! plaintext client, garbage, a certificate the verifier refuses, an alert) is closed at once.
//!
//! Sessions enter [`Handshakes`] in admission order, so deadlines are in order: each iteration
//! looks at the front only, dropping sessions that finished their handshake or ended, and
//! closing the late ones. Plain TCP streams never handshake: the list stays empty and costs one
//! emptiness check per iteration.
//!
//! Each close is counted and logged at info, naming the peer and the reason, at most one line
//! per kind (deadline, TLS error) per [`LOG_PERIOD_US`](crate::logging::LOG_PERIOD_US), saying
//! how many more there were.
//!
//! Invariant: at most one entry per session, and no more entries than sessions.

use super::close::CloseReason;
use super::core::{slot_of, Core};
use super::net::{Net, Stream};
use super::session::Phase;
use super::tls::HANDSHAKE_DEADLINE;
use crate::logging::Throttle;
use crate::partition::Partition;
use crate::partition::SessionId;
use std::collections::VecDeque;

/// Sessions in their handshake, oldest first, with their deadlines.
#[derive(Default)]
pub struct Handshakes {
    waiting: VecDeque<(SessionId, u64)>,
    logs: Throttle,
    error_logs: Throttle,
}

impl Handshakes {
    /// The earliest deadline (perhaps of a session that is done: the wake-up is then early,
    /// never late).
    pub fn next_deadline_us(&self) -> Option<u64> {
        self.waiting.front().map(|&(_, deadline_us)| deadline_us)
    }
}

impl<N: Net, P: Partition> Core<N, P> {
    /// Starts the deadline of the session `id` if its stream is in a handshake. From the clock
    /// now, not the iteration's time: a connection accepted late in an iteration (after other
    /// sessions' events, or many accepts of a burst) would lose that much of its time, and be
    /// closed before the deadline from its own point of view.
    pub(super) fn watch_handshake(&mut self, id: SessionId) {
        let slot = slot_of(id);
        if self.sessions[slot].socket().handshaking() {
            let deadline_us = self.net.now_us() + HANDSHAKE_DEADLINE.as_micros() as u64;
            self.handshakes.waiting.push_back((id, deadline_us));
        }
    }

    /// Closes the session in `slot`, whose read failed: for a TLS error, counted and logged
    /// (rate-limited) with the peer and the error.
    pub(super) fn read_failed(&mut self, slot: usize) {
        let Some(error) = self.sessions[slot].socket().tls_error() else {
            return self.begin_close(slot, Phase::Dead, CloseReason::ReadFailed);
        };
        self.counters.tls_failures += 1;
        if let Some(suppressed) = self.handshakes.error_logs.allow(self.now_us) {
            let peer = self.sessions[slot].peer();
            let peer = peer.map_or_else(|| "an unknown peer".to_string(), |p| p.to_string());
            log::info!(
                "core {}: closing the session of {peer}: TLS error: {error} \
                 ({suppressed} more since the last such line)",
                self.settings.index
            );
        }
        self.begin_close(slot, Phase::Dead, CloseReason::TlsError);
    }

    fn log_handshake_timeout(&mut self, slot: usize) {
        let Some(suppressed) = self.handshakes.logs.allow(self.now_us) else {
            return;
        };
        let peer = self.sessions[slot].peer();
        let peer = peer.map_or_else(|| "an unknown peer".to_string(), |p| p.to_string());
        log::info!(
            "core {}: closing the session of {peer}: no TLS handshake within {:?} \
             ({suppressed} more since the last such line)",
            self.settings.index,
            HANDSHAKE_DEADLINE
        );
    }

    /// Closes the sessions whose handshake is late (see the module docs).
    pub(super) fn expire_handshakes(&mut self) {
        // Bounded: every pass removes an entry.
        while let Some(&(id, deadline_us)) = self.handshakes.waiting.front() {
            let slot = slot_of(id);
            let session = self.sessions.get(slot).filter(|s| s.id() == id);
            let waiting =
                session.is_some_and(|s| s.phase() == Phase::Open && s.socket().handshaking());
            if waiting && self.now_us < deadline_us {
                return;
            }
            self.handshakes.waiting.pop_front();
            if waiting {
                self.counters.tls_failures += 1;
                self.log_handshake_timeout(slot);
                self.begin_close(slot, Phase::Dead, CloseReason::HandshakeTimeout);
            }
        }
    }
}
