//! A core's part in resumable calls (docs/protocol.md §5): the Identify that makes a session
//! speak for a client, and the graces of the clients whose last session closed on this core.
//!
//! An Identify is answered here, like a Ping: it must be the session's first request, ask a
//! grace of 1..=60 s and a client id other than 0, and reach a partition that resumes calls
//! (`X` 9 otherwise); the registry (`clients.rs`) refuses another identity's client id (`X` 8)
//! and a client past its bound (`X` 10). A Resolve is a keyed request like any other (the key's
//! partition answers it), allowed only on an identified session (`X` 9).
//!
//! When an identified session closes, the partitions keep its waiters and grants for its client
//! (`Partition::handle_session_closed`); if it was the client's last session, this core keeps
//! the end of its grace and, once it passes with no session back, has every partition let the
//! client go (`Msg::ClientGone`, sent after the session's own close on every channel, so each
//! partition detaches before it drops).

use super::clients::Refused;
use super::core::{Core, Step};
use super::net::{Net, Stream};
use super::route::Msg;
use crate::partition::{ClientRef, Partition};
use latchkey_client::protocol::{ErrorCode, Response, GRACE_S_MAX};
use std::cmp::Reverse;

impl<N: Net, P: Partition> Core<N, P> {
    /// Answers an Identify of the session in `slot` (`used` bytes); see the module docs.
    pub(super) fn identify(
        &mut self,
        slot: usize,
        (grace_s, client, nonce): (u8, u128, u64),
        used: usize,
    ) -> Step {
        let session = &mut self.sessions[slot];
        let valid = (1..=GRACE_S_MAX).contains(&grace_s) && client != 0;
        let refused = |code| Response::Error { code, id: nonce };
        let response = if !session.is_fresh() || !valid || !self.table.resumes_calls() {
            refused(ErrorCode::NotIdentified)
        } else {
            let identities = session.socket().identities();
            match self
                .links
                .shared
                .clients
                .identify(client, grace_s, &identities)
            {
                Ok((client_ref, grace_s)) => {
                    session.set_client(client_ref);
                    self.table.handle_client_known(client_ref, client, grace_s);
                    // Before any request of this session reaches another core's partition:
                    // the same channels carry both, in order.
                    for outbox in self.links.outboxes.iter_mut().flatten() {
                        let known = Box::new((client_ref, client, grace_s));
                        outbox.push(Msg::ClientKnown(known));
                    }
                    Response::Identified { nonce, grace_s }
                }
                Err(Refused::Forbidden) => refused(ErrorCode::Forbidden),
                Err(Refused::Full) => refused(ErrorCode::Limit),
            }
        };
        session.push_answer(&response);
        session.consume(used, &mut self.buffers);
        self.mark_dirty(slot);
        Step::Executed
    }

    /// A session of `client` closed: if it was the client's last, its grace starts.
    pub(super) fn start_grace(&mut self, client: ClientRef) {
        if !client.is_some() {
            return;
        }
        let clients = &self.links.shared.clients;
        if let Some(end_us) = clients.session_closed(client, self.now_us) {
            self.graces.push(Reverse((end_us, client.0)));
        }
    }

    /// Lets go the clients whose grace ended with no session back.
    pub(super) fn end_graces(&mut self) {
        while let Some(&Reverse((end_us, client))) = self.graces.peek() {
            if end_us > self.now_us {
                break;
            }
            self.graces.pop();
            let client = ClientRef(client);
            if !self.links.shared.clients.expire(client, self.now_us) {
                continue; // back within its grace (a later close started another)
            }
            log::debug!("client {:#x}: its grace ended without a session", client.0);
            for outbox in self.links.outboxes.iter_mut().flatten() {
                outbox.push(Msg::ClientGone { client });
            }
            self.table.handle_client_gone(self.now_us, client);
            self.route_answers();
        }
    }

    /// When the next grace ends, if one runs on this core.
    pub(super) fn grace_wake_us(&self) -> Option<u64> {
        self.graces.peek().map(|&Reverse((end_us, _))| end_us)
    }
}
