//! Whether a session may carry requests: the handshake ping that establishes it, and the
//! silence that stops it taking calls (docs/protocol.md §4.3).
//!
//! **Handshake.** A TCP connect can succeed with nobody serving it: the kernel completes it
//! from the listen backlog of a paused (SIGSTOP) or wedged process. So a session counts as
//! established only after a round trip that carries no request: once TCP (and TLS) is up, the
//! pipeline offers one `P` with a nonce of its own and encodes nothing else until that `P`
//! comes back. The driver ends the session at its connect deadline if it does not; every call
//! it held is then definitely unsent and goes to another session or member. The pong is never
//! delivered to a caller, and any other answer to the ping ends the session (nothing was sent).
//!
//! A client that resumes calls (docs/protocol.md §5) puts an Identify before that ping: the
//! server answers it first (`I`: the session is identified; `X` 9, 8 or 10: it is not, and the
//! session goes on), then the pong. A server that does not know Identify answers `X` 1 and
//! closes the session: nothing was sent, and the driver reports it so that the next sessions
//! do not identify ([`CloseReason::ServerError`] with [`ErrorCode::UnknownOp`]).
//!
//! **Silence.** An established session *stalls* when an answer is overdue: some request the
//! server answers at once was handed to the socket at least `silence_limit` (the client's
//! connect timeout) ago, and nothing at all was read since it was handed. "Answered at once"
//! is every request but an acquire with a wait above zero, which may legitimately queue for
//! up to 255 s: release, extend, query, ping, an acquire with wait 0, and the Cancel of an
//! acquire at its deadline (its `T` comes at once). A stalled pipeline takes no new call and
//! hands back every call still queued, unsent, so the client sends them elsewhere; what was
//! already handed to the socket stays and follows its own deadline (§4.2–§4.4). The first
//! byte read ends the stall. A stall never closes the session: a slow server that answers
//! late is not a dead one, and closing would turn sent requests `Indeterminate` early.
//!
//! **Probes.** A waiting acquire is not answered at once, so a session that carries only
//! waiters would never notice a paused server (a leader stopped by SIGSTOP, a stalled VM): its
//! waiters would wait the pause out, although another member may lead their keys within a
//! second. So an *identified* session with a waiting acquire on the wire that reads nothing
//! for a quarter of its silence limit ([`PROBE_QUIET`]) sends a `P` of its own (never delivered
//! to a caller); a live server answers it at once. When nothing is read within half the silence
//! limit of the probe ([`PROBE_ANSWER`]), or the session stalls (another request's answer
//! overdue), while a waiting acquire is on the wire, the session *closes*
//! ([`CloseReason::Silent`]): its acquires end `Indeterminate` here, and the client resolves
//! them on another session (docs/protocol.md §5) — at the member that leads the key now, or,
//! once the paused one answers again, there: a server keeps an identified client's waiters in
//! their places when its session closes, and the Resolve finds them. An unidentified session
//! never probes and never closes for silence: without Resolve, closing would only turn its
//! waiters `Indeterminate` early.
//!
//! Deliberately not here: the connect deadline itself (the driver's), and choosing another
//! session (the pool and the exchange).

use std::time::Instant;

use super::{reply, Call, CloseReason, ErrorCode, Handle, Op, Outcome, Pipeline, Stage};
use crate::protocol::{Request, Response};

/// Bytes of a `P` frame.
pub(super) const PING_BYTES: usize = 10;
/// The fraction of the silence limit a session with a waiting acquire on the wire stays
/// quiet before it probes (module docs): with the default connect timeout of 2 s, a probe
/// after 500 ms without a read.
const PROBE_QUIET: u32 = 4;
/// The fraction of the silence limit a probe's pong may take (module docs): with the default
/// connect timeout, 1 s, so a paused server is found at most 1.5 s after its last answer. A
/// live but slow server found so costs a Resolve, which finds the waiter in its place.
const PROBE_ANSWER: u32 = 2;
/// Bytes of an `I` frame.
const IDENTIFY_BYTES: usize = 27;
/// Bytes of the longest handshake: an Identify, then the ping.
pub(super) const HELLO_BYTES_MAX: usize = IDENTIFY_BYTES + PING_BYTES;

/// How a session identifies in its handshake (docs/protocol.md §5).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Identity {
    /// The client id, shared by every session of a client; never 0.
    pub client: u128,
    /// The grace asked for, 1..=60 s.
    pub grace_s: u8,
}

/// How far a session's connection is.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Link {
    /// TCP (and TLS) are not up yet: nothing is written or read.
    Connecting,
    /// The handshake (an Identify, if the session identifies, and the ping) is offered or out
    /// (`written` of its `len` bytes handed to the socket); nothing else is encoded until the
    /// pong. `identify` is the Identify's nonce while its answer is awaited.
    Handshake {
        nonce: u64,
        written: usize,
        len: usize,
        identify: Option<u64>,
    },
    /// The pong came back: requests go out.
    Established,
}

impl Pipeline {
    /// TCP (and TLS) are up: the handshake ping with `nonce` (one the client uses for nothing
    /// else) is the only frame offered until its pong is read.
    /// With `identity`, an Identify (whose nonce is `nonce + 1`) goes first.
    pub(crate) fn start_handshake(&mut self, nonce: u64, identity: Option<Identity>) {
        debug_assert_eq!(self.link, Link::Connecting, "one handshake per session");
        let mut frame = Vec::with_capacity(HELLO_BYTES_MAX);
        let identify = identity.map(|identity| {
            let identify_nonce = nonce.wrapping_add(1);
            let request = Request::Identify {
                grace_s: identity.grace_s,
                client: identity.client,
                nonce: identify_nonce,
            };
            request.encode(&mut frame);
            identify_nonce
        });
        Request::Ping { nonce }.encode(&mut frame);
        self.probe_nonce = nonce.wrapping_add(2);
        self.hello[..frame.len()].copy_from_slice(&frame);
        self.link = Link::Handshake {
            nonce,
            written: 0,
            len: frame.len(),
            identify,
        };
        self.check_invariants();
    }

    /// Whether the server identified this session (docs/protocol.md §5): a Resolve may then
    /// ask it what became of an acquire of this client's.
    pub(crate) fn is_identified(&self) -> bool {
        self.identified
    }

    /// Whether TCP (and TLS) are still coming up.
    pub(crate) fn is_connecting(&self) -> bool {
        self.link == Link::Connecting
    }

    /// Whether the handshake ping is out and its pong not read yet.
    pub(crate) fn is_handshaking(&self) -> bool {
        matches!(self.link, Link::Handshake { .. })
    }

    /// Whether the handshake pong was read: requests may go out.
    pub(crate) fn is_established(&self) -> bool {
        self.link == Link::Established
    }

    /// Whether answers are overdue and nothing was read since (see the module docs): the
    /// session takes no new call until it reads again.
    pub(crate) fn is_stalled(&self) -> bool {
        self.stalled
    }

    /// Resolves the calls handed back unsent since the last time: their callers hear
    /// `NotSent`; the fire-and-forget releases are returned, for another session. The driver
    /// calls it after it published the stall, so that a caller who hears `NotSent` from a
    /// stalled session sees it stalled.
    pub(crate) fn resolve_returned(&mut self) -> Vec<Call> {
        let mut background = Vec::new();
        for call in self.returned.drain(..) {
            match call.reply {
                Some(tx) => {
                    reply(Some(tx), Outcome::NotSent);
                }
                None if matches!(call.op, Op::Release { .. }) => background.push(call),
                None => {}
            }
        }
        background
    }

    /// The bytes of the handshake ping not handed to the socket yet.
    pub(super) fn hello_offered(&self) -> &[u8] {
        match self.link {
            Link::Handshake { written, len, .. } => &self.hello[written..len],
            _ => &[],
        }
    }

    /// The socket took `written` more bytes of the handshake ping; `false` when the link is
    /// not in its handshake (the bytes are requests').
    pub(super) fn hello_written(&mut self, written: usize) -> bool {
        let Link::Handshake {
            written: done, len, ..
        } = &mut self.link
        else {
            return false;
        };
        *done += written;
        assert!(*done <= *len, "socket took more bytes than offered");
        true
    }

    /// An answer read while the handshake ping is out: its pong establishes the session;
    /// anything else ends it with nothing sent.
    pub(super) fn handle_handshake_answer(&mut self, response: Response) {
        let Link::Handshake {
            nonce,
            written,
            len,
            identify,
        } = self.link
        else {
            unreachable!("called only during the handshake")
        };
        let refused = |code| {
            matches!(
                code,
                ErrorCode::NotIdentified | ErrorCode::Forbidden | ErrorCode::Limit
            )
        };
        match response {
            Response::Identified { nonce: echoed, .. } if identify == Some(echoed) => {
                self.identified = true;
                self.link = Link::Handshake {
                    nonce,
                    written,
                    len,
                    identify: None,
                };
            }
            Response::Error { code, id } if identify == Some(id) && refused(code) => {
                log::debug!("the server did not identify the session: {code}");
                self.link = Link::Handshake {
                    nonce,
                    written,
                    len,
                    identify: None,
                };
            }
            Response::Pong { nonce: echoed }
                if echoed == nonce && written == len && identify.is_none() =>
            {
                self.link = Link::Established;
            }
            Response::Error {
                code: ErrorCode::SessionRefused,
                ..
            } => self.close(CloseReason::Refused),
            Response::Error { code, .. } if code.closes_session() => {
                self.close(CloseReason::ServerError(code))
            }
            other => self.close(CloseReason::HandshakeAnswer(other.op())),
        }
    }

    /// Bytes were read at `now`: nothing is overdue any more, and a probe's quiet time starts
    /// again.
    pub(super) fn note_read(&mut self, now: Instant) {
        self.awaiting_since = None;
        self.probe_out = None;
        if self.probe_from.is_some() {
            self.probe_from = Some(now);
        }
        if self.stalled {
            log::debug!("a stalled session read again: it takes calls again");
            self.stalled = false;
        }
    }

    /// The first byte of `op` was handed to the socket at `now`.
    pub(super) fn note_handed(&mut self, handle: Handle, now: Instant) {
        let answered_at_once = self.entry(handle).is_some_and(|entry| match entry.call.op {
            Op::Acquire { wait_zero, .. } => wait_zero,
            _ => true,
        });
        if answered_at_once && self.awaiting_since.is_none() {
            self.awaiting_since = Some(now);
        }
        if !answered_at_once && self.identified && self.probe_from.is_none() {
            self.probe_from = Some(now);
        }
    }

    /// Whether a waiting acquire may be on the wire (some byte of it handed, no answer yet).
    /// O(acquires of the session): called at most once per probe interval and at a stall.
    fn waiter_on_the_wire(&self) -> bool {
        self.owners.values().any(|&handle| {
            self.entry(handle).is_some_and(|entry| {
                let waits = matches!(
                    entry.call.op,
                    Op::Acquire {
                        wait_zero: false,
                        ..
                    }
                );
                waits
                    && matches!(
                        entry.stage,
                        Stage::Partial | Stage::Sent | Stage::Cancelling
                    )
            })
        })
    }

    /// When this session probes its server, or gives up on its probe, unless it reads before
    /// (module docs): `None` when no probe is armed, or when another answer is awaited and no
    /// probe is out (the stall covers it).
    pub(super) fn probe_at(&self) -> Option<Instant> {
        if self.stalled || !self.is_established() || self.close.is_some() {
            return None;
        }
        if let Some(out) = self.probe_out {
            return Some(out + self.silence_limit / PROBE_ANSWER);
        }
        if self.awaiting_since.is_some() {
            return None;
        }
        let quiet = self.silence_limit / PROBE_QUIET;
        self.probe_from.map(|from| from + quiet)
    }

    /// At a probe's instant: a `P` of the session's own when a waiting acquire may still be on
    /// the wire, else the probe is disarmed (the next waiting acquire handed arms it again); at
    /// a probe's overdue instant with a waiter still on the wire, the session closes.
    fn handle_probe(&mut self, now: Instant) {
        let Some(at) = self.probe_at() else {
            return;
        };
        if now < at {
            return;
        }
        let waiting = self.waiter_on_the_wire();
        if self.probe_out.is_some() {
            if waiting {
                log::debug!(
                    "a probe ping unanswered for {:?} with a waiter on the wire: the session \
                     closes and its acquires are resolved elsewhere",
                    self.silence_limit / PROBE_ANSWER
                );
                self.close(CloseReason::Silent);
            } else {
                self.probe_out = None;
                self.probe_from = None;
            }
            return;
        }
        if !waiting {
            self.probe_from = None;
            return;
        }
        self.probe_from = Some(now);
        self.probe_out = Some(now);
        let mut nonce = self.probe_nonce;
        while self.nonces.contains_key(&nonce) {
            nonce = nonce.wrapping_add(1);
        }
        self.probe_nonce = nonce.wrapping_add(1);
        log::trace!(
            "no byte read for {:?} with a waiter on the wire: probing",
            now - at
        );
        self.submit(Call {
            op: Op::Ping { nonce },
            deadline: now + self.transport_timeout,
            reply: None,
            attempts: 0,
        });
    }

    /// When the session stalls unless it reads before: `None` when nothing is overdue-able.
    pub(super) fn stall_at(&self) -> Option<Instant> {
        if self.stalled || !self.is_established() || self.close.is_some() {
            return None;
        }
        self.awaiting_since.map(|since| since + self.silence_limit)
    }

    /// Probes when a probe is due, and stalls the session once an answer is overdue at `now`
    /// (never before the instant); an identified session that stalls with a waiting acquire on
    /// the wire closes (module docs).
    pub(super) fn handle_silence(&mut self, now: Instant) {
        self.handle_probe(now);
        let Some(at) = self.stall_at() else {
            return;
        };
        if now < at {
            return;
        }
        if self.identified && self.waiter_on_the_wire() {
            log::debug!(
                "no byte read for {:?} while answers are due, with a waiter on the wire: the \
                 session closes and its acquires are resolved elsewhere",
                self.silence_limit
            );
            self.close(CloseReason::Silent);
            return;
        }
        log::debug!(
            "no byte read for {:?} while answers are due: the session takes no new call",
            self.silence_limit
        );
        self.stalled = true;
        let queue = std::mem::take(&mut self.queue);
        for handle in queue {
            let queued = self.entry(handle).map(|entry| {
                let cancel = matches!(entry.call.op, Op::Cancel { .. });
                (entry.stage == Stage::Queued, cancel)
            });
            match queued {
                Some((true, false)) => {
                    let entry = self.take(handle);
                    self.hand_back(entry.call);
                }
                // A Cancel belongs to an acquire already on this session: it must go here.
                Some(_) => self.queue.push_back(handle),
                None => {}
            }
        }
    }

    /// A call this session will not send: kept for
    /// [`resolve_returned`](Self::resolve_returned).
    pub(super) fn hand_back(&mut self, call: Call) {
        self.returned.push(call);
    }
}

#[cfg(test)]
mod tests;
