//! Admission: a new connection becomes a session, or is refused at `max_connections` with
//! `X` code 7 and a close (over TLS the refusal is written before any handshake, so a TLS
//! client sees its connection end during the handshake).
//!
//! Invariant: the server-wide session count (`Shared::connections`) counts every session of
//! every core, and never more than `max_connections` (a refused connection is uncounted at
//! once).

use super::core::{session_id, Core, SLOTS_MAX};
use super::net::{Net, Stream};
use super::session::Session;
use crate::partition::Partition;
use latchkey_client::protocol::{ErrorCode, Response};
use std::io::Write;
use std::sync::atomic::Ordering;

impl<N: Net, P: Partition> Core<N, P> {
    /// Takes a new connection: a session, or `X` code 7 and a close when the server is full.
    pub fn admit(&mut self, mut stream: N::Stream) {
        let shared = &self.links.shared;
        let count = shared.connections.fetch_add(1, Ordering::Relaxed);
        if count >= self.settings.max_connections || self.sessions.len() + 1 >= SLOTS_MAX {
            shared.connections.fetch_sub(1, Ordering::Relaxed);
            return self.refuse(stream);
        }
        let slot = self.sessions.vacant_key();
        let id = session_id(self.settings.index, slot, self.generation.wrapping_add(1));
        let counted = shared
            .queues
            .as_ref()
            .map_or(true, |queues| queues.admit(id));
        if let Err(e) = self.net.register(&mut stream, slot) {
            log::warn!(
                "core {}: cannot register a session: {e}",
                self.settings.index
            );
            shared.connections.fetch_sub(1, Ordering::Relaxed);
            return;
        }
        debug_assert!(counted, "every slot below SLOTS_MAX is counted");
        self.generation = self.generation.wrapping_add(1);
        let session = Session::new(id, stream);
        match session.peer() {
            Some(peer) => log::debug!("session {id:#x} from {peer}: opened"),
            None => log::debug!("session {id:#x}: opened"),
        }
        self.sessions.insert(session);
        self.watch_handshake(id);
    }

    /// Sends `X` code 7 (best effort, without reading anything) and closes.
    fn refuse(&mut self, mut stream: N::Stream) {
        self.counters.sessions_refused += 1;
        let mut frame = Vec::with_capacity(11);
        let refused = Response::Error {
            code: ErrorCode::SessionRefused,
            id: 0,
        };
        refused.encode(&mut frame);
        let _ = stream.write(&frame);
        let _ = stream.shutdown_write();
        if self.now_us >= self.refusals_logged_us + 1_000_000 || self.refusals_logged_us == 0 {
            self.refusals_logged_us = self.now_us.max(1);
            log::warn!(
                "core {}: refusing a session: max_connections ({}) reached",
                self.settings.index,
                self.settings.max_connections
            );
        }
    }
}
