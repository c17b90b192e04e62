//! One client connection: its stream, its input and output, and its accounting.
//!
//! Input is read into a buffer lent by the core's [`ReadBuffers`] and parsed in place; the
//! buffer goes back as soon as every byte read was parsed. Output collects encoded answers until
//! the core flushes it with one `write` per pass. Every `A` still in the output is remembered
//! with where it ends in the output stream, so that when the session dies before writing it
//! ([`Session::discard_output`]) the core can release that grant: an `A` never written was never
//! received (docs/protocol.md §3).
//!
//! Limits: a session stops being *read* (not disconnected) while its unsent output passes
//! [`OUTPUT_BOUND_BYTES`], while too many of its requests wait for other cores, or while the
//! way to the core one of its requests must go to is full; it resumes when they drain. Answers
//! are never dropped while the session lives.
//!
//! Invariants: the counts never go negative (each decrement matches an earlier increment);
//! `unsent_grants` is ordered by end offset and every end lies in the unsent output; a session
//! holds a read buffer only while it has unparsed bytes.
//!
//! Not here: what a frame means (the core hands requests to the lock table).

use super::buffers::{BufferId, ReadBuffers, READ_BUFFER_BYTES};
use super::net::Stream;
use crate::auth::{AuthRules, Grant};
use crate::partition::GrantRef;
use crate::partition::{ClientRef, SessionId};
use latchkey_client::protocol::Response;
use std::collections::VecDeque;
use std::io;
use std::net::SocketAddr;
use std::sync::Arc;

/// Unsent output past which a session is not read until it drains.
pub const OUTPUT_BOUND_BYTES: usize = 64 * 1024;
/// Requests one session may have in flight to other cores (besides its pending acquires).
pub const REMOTE_IN_FLIGHT_MAX: u32 = 4096;
/// Buffer fills of input a lingering session drops per loop iteration.
const LINGER_READS_MAX: usize = 16;
/// Write capacity kept after a burst drains; more is given back to the allocator.
const WRITE_CAPACITY_KEPT_BYTES: usize = 4 * OUTPUT_BOUND_BYTES;

const _: () = assert!(OUTPUT_BOUND_BYTES >= 64 * latchkey_client::protocol::RESPONSE_BYTES_MAX);

/// Where a session is in its life.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Phase {
    /// Reading and answering.
    Open,
    /// No more reading (end of input, or a closing error): answers still get written, and the
    /// session ends once every partition has withdrawn its waiters and the output is flushed.
    Draining,
    /// Everything was written and our side is shut: unread input is read and dropped until
    /// the peer ends or a short deadline passes. Closing a socket with unread input makes the
    /// kernel reset the connection, which would discard answers not yet delivered (the `X` of
    /// a closing error among them).
    Lingering,
    /// The socket failed: nothing more is written; ends once the partitions acknowledged.
    Dead,
}

/// What one read pass saw.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ReadOutcome {
    /// The socket has no more data now.
    Drained,
    /// The buffer filled: there may be more to read after the frames are processed.
    Full,
    /// End of input.
    Eof,
    /// The socket failed.
    Failed,
}

/// A grant whose `A` is in a session's output and not yet wholly written.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct UnsentGrant {
    /// Where the `A` ends in the session's output stream (bytes since the session began).
    end: u64,
    /// The partition that granted it.
    pub partition: u32,
    /// The grant as that partition names it.
    pub grant: GrantRef,
    /// The granted token.
    pub token: u64,
}

/// One client connection.
pub struct Session<S> {
    id: SessionId,
    socket: S,
    peer: Option<SocketAddr>,
    phase: Phase,
    /// Acquires with wait > 0 submitted and not yet answered.
    pending: u32,
    /// Requests sent to other cores whose answer has not come back.
    remote_unanswered: u32,
    /// Of those, the ones answered as soon as the other core handles them (all but acquires
    /// that may wait): while some are out, the output is held back a little so that their
    /// answers leave in the same `write`.
    remote_prompt: u32,
    /// While output is held for prompt remote answers: the time it is written regardless.
    hold_until_us: Option<u64>,
    /// Partitions that have not yet acknowledged the session's close.
    acks_awaited: u32,
    /// In the core's list of sessions to read without an event.
    scheduled: bool,
    /// In the core's list of sessions to flush.
    dirty: bool,
    /// Reading stopped because the session was over a bound.
    paused: bool,
    /// While [`Phase::Lingering`]: when to close regardless.
    linger_until_us: u64,
    buffer: Option<BufferId>,
    read_start: usize,
    read_end: usize,
    write_buffer: Vec<u8>,
    write_start: usize,
    /// Output bytes handed to the socket since the session began.
    written_total: u64,
    unsent_grants: VecDeque<UnsentGrant>,
    /// A frame of the lock protocol was consumed: the session is not an admin request.
    started: bool,
    /// The identified client it speaks for ([`ClientRef::NONE`] until an Identify).
    client: ClientRef,
    /// The session is an admin HTTP request (see [`super::admin`]).
    admin: bool,
    /// With authorization rules: what the session may use, worked out on first need.
    grant: Option<Arc<Grant>>,
}

impl<S: Stream> Session<S> {
    /// A new open session on `socket`.
    pub fn new(id: SessionId, socket: S) -> Session<S> {
        let peer = socket.peer();
        Session {
            id,
            socket,
            peer,
            phase: Phase::Open,
            pending: 0,
            remote_unanswered: 0,
            remote_prompt: 0,
            hold_until_us: None,
            acks_awaited: 0,
            scheduled: false,
            dirty: false,
            paused: false,
            linger_until_us: 0,
            buffer: None,
            read_start: 0,
            read_end: 0,
            write_buffer: Vec::new(),
            write_start: 0,
            written_total: 0,
            unsent_grants: VecDeque::new(),
            started: false,
            client: ClientRef::NONE,
            admin: false,
            grant: None,
        }
    }

    /// The identified client the session speaks for ([`ClientRef::NONE`] if it did not
    /// identify).
    pub fn client(&self) -> ClientRef {
        self.client
    }

    /// The session identified as `client` (docs/protocol.md §5).
    pub fn set_client(&mut self, client: ClientRef) {
        self.client = client;
    }

    /// Whether no lock-protocol frame was consumed yet (the session may be an admin request).
    pub fn is_fresh(&self) -> bool {
        !self.started
    }

    /// What the session may use under `rules`: worked out from its stream's identities the
    /// first time (after the handshake: no request is parsed before it ends), then kept.
    pub fn grant(&mut self, rules: &AuthRules) -> &Arc<Grant> {
        let socket = &self.socket;
        self.grant
            .get_or_insert_with(|| Arc::new(rules.grant(&socket.identities())))
    }

    /// Whether the session is an admin HTTP request.
    pub fn is_admin(&self) -> bool {
        self.admin
    }

    /// Marks the session as an admin HTTP request.
    pub fn set_admin(&mut self) {
        self.admin = true;
    }

    /// The session's identity in lock tables and messages.
    pub fn id(&self) -> SessionId {
        self.id
    }

    /// The peer's address, when known.
    pub fn peer(&self) -> Option<SocketAddr> {
        self.peer
    }

    /// Where the session is in its life.
    pub fn phase(&self) -> Phase {
        self.phase
    }

    /// The stream.
    pub fn socket(&self) -> &S {
        &self.socket
    }

    /// The stream, to deregister it.
    pub fn socket_mut(&mut self) -> &mut S {
        &mut self.socket
    }

    // ----- input ------------------------------------------------------------------------------

    /// Received bytes not yet parsed.
    pub fn unparsed<'a>(&self, buffers: &'a ReadBuffers) -> &'a [u8] {
        match self.buffer {
            Some(id) => &buffers.get(id)[self.read_start..self.read_end],
            None => &[],
        }
    }

    /// Marks `bytes` of the unparsed input as consumed; the buffer goes back once empty.
    pub fn consume(&mut self, bytes: usize, buffers: &mut ReadBuffers) {
        debug_assert!(self.read_start + bytes <= self.read_end);
        self.started = true;
        self.read_start += bytes;
        if self.read_start == self.read_end {
            self.discard_input(buffers);
        }
    }

    /// Drops every unparsed byte and gives the buffer back.
    pub fn discard_input(&mut self, buffers: &mut ReadBuffers) {
        self.read_start = 0;
        self.read_end = 0;
        if let Some(id) = self.buffer.take() {
            buffers.give(id);
        }
    }

    /// Reads into the free part of a buffer (moving a partial frame to the front first).
    ///
    /// With `until_would_block` false, a short read ends the pass: it proves the socket was
    /// empty at that moment, and with edge-triggered readiness anything arriving later raises
    /// a new event. That saves one `read` per readiness on the request path. The caller must
    /// pass true when the readiness said the peer closed its side (an end of input that came
    /// with the data raises no further event) and when there is no readiness event at all.
    pub fn read(&mut self, buffers: &mut ReadBuffers, until_would_block: bool) -> ReadOutcome {
        let id = *self.buffer.get_or_insert_with(|| buffers.take());
        let buffer = buffers.get_mut(id);
        if self.read_start > 0 {
            buffer.copy_within(self.read_start..self.read_end, 0);
            self.read_end -= self.read_start;
            self.read_start = 0;
        }
        let outcome = self.read_into(buffer, until_would_block);
        if self.read_end == 0 {
            self.discard_input(buffers);
        }
        outcome
    }

    fn read_into(
        &mut self,
        buffer: &mut [u8; READ_BUFFER_BYTES],
        until_would_block: bool,
    ) -> ReadOutcome {
        // Bounded: every pass fills part of the buffer, or returns.
        loop {
            let space = &mut buffer[self.read_end..];
            if space.is_empty() {
                // A full buffer always holds a complete frame, which the core parses first.
                return ReadOutcome::Full;
            }
            let wanted = space.len();
            match self.socket.read(space) {
                Ok(0) => return ReadOutcome::Eof,
                Ok(n) => {
                    self.read_end += n;
                    if n < wanted && !until_would_block {
                        return ReadOutcome::Drained;
                    }
                }
                Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => return ReadOutcome::Drained,
                Err(e) => {
                    log::debug!("session {:#x}: read failed: {e}", self.id);
                    return ReadOutcome::Failed;
                }
            }
        }
    }

    // ----- bounds and scheduling --------------------------------------------------------------

    /// Whether the session must not be read or parsed now: its output or its requests to other
    /// cores are over their bounds.
    pub fn over_bounds(&self, pending_max: u32) -> bool {
        self.unsent() >= OUTPUT_BOUND_BYTES
            || self.remote_unanswered >= REMOTE_IN_FLIGHT_MAX + pending_max
    }

    /// Stops reading until [`resume`](Self::resume).
    pub fn pause(&mut self) {
        self.paused = true;
    }

    /// Whether a paused session is back under its bounds: then it is unpaused and the caller
    /// schedules a read.
    pub fn resume(&mut self, pending_max: u32) -> bool {
        let resume = self.paused && self.phase == Phase::Open && !self.over_bounds(pending_max);
        if resume {
            self.paused = false;
        }
        resume
    }

    /// Enters the core's read list; false when already in it.
    pub fn mark_scheduled(&mut self) -> bool {
        !std::mem::replace(&mut self.scheduled, true)
    }

    /// Leaves the core's read list.
    pub fn clear_scheduled(&mut self) {
        self.scheduled = false;
    }

    /// Enters the core's flush list; false when already in it.
    pub fn mark_dirty(&mut self) -> bool {
        !std::mem::replace(&mut self.dirty, true)
    }

    /// Leaves the core's flush list.
    pub fn clear_dirty(&mut self) {
        self.dirty = false;
    }

    /// Whether nothing is owed to or by this session now: no close acknowledgement awaited,
    /// and, while it is written to, no output unsent (and, while open, no answer from another
    /// core outstanding).
    pub fn is_settled(&self) -> bool {
        self.acks_awaited == 0
            && match self.phase {
                Phase::Open => self.remote_unanswered == 0 && !self.has_output(),
                Phase::Draining => !self.has_output(),
                Phase::Lingering | Phase::Dead => true,
            }
    }

    // ----- accounting -------------------------------------------------------------------------

    /// One request executed: `waits` for an acquire that may queue, `remote` when it went to
    /// another core and will be answered.
    pub fn note_request(&mut self, waits: bool, remote: bool) {
        self.pending += u32::from(waits);
        self.remote_unanswered += u32::from(remote);
        self.remote_prompt += u32::from(remote && !waits);
    }

    /// One answer arrived: `ends_pending` for the answer of an acquire that may have queued,
    /// `remote` when it came from another core.
    pub fn note_answer(&mut self, ends_pending: bool, remote: bool) {
        debug_assert!(self.pending >= u32::from(ends_pending));
        debug_assert!(self.remote_unanswered >= u32::from(remote));
        self.pending = self.pending.saturating_sub(u32::from(ends_pending));
        self.remote_unanswered = self.remote_unanswered.saturating_sub(u32::from(remote));
        // Only answers to acquires that may wait end a pending acquire; every other remote
        // answer is the answer of a prompt request.
        let prompt = remote && !ends_pending;
        debug_assert!(self.remote_prompt >= u32::from(prompt));
        self.remote_prompt = self.remote_prompt.saturating_sub(u32::from(prompt));
    }

    /// Requests sent to other cores and not answered yet.
    #[cfg(any(test, feature = "testing"))]
    pub fn remote_unanswered(&self) -> u32 {
        self.remote_unanswered
    }

    /// Acquires that may queue, not answered yet.
    #[cfg(any(test, feature = "testing"))]
    pub fn pending(&self) -> u32 {
        self.pending
    }

    /// Whether its output must wait for prompt answers from other cores: the instant until
    /// which it is held (set on the first call), or `None` to write now.
    pub fn hold_output(&mut self, now_us: u64, hold_us: u64) -> Option<u64> {
        if self.remote_prompt == 0 || self.phase != Phase::Open {
            self.hold_until_us = None;
            return None;
        }
        let until = *self.hold_until_us.get_or_insert(now_us + hold_us);
        if now_us < until {
            return Some(until);
        }
        self.hold_until_us = None;
        None
    }

    // ----- output -----------------------------------------------------------------------------

    /// Appends an answer.
    pub fn push_answer(&mut self, response: &Response) {
        response.encode(&mut self.write_buffer);
    }

    /// Appends bytes that are not a frame (an admin session's HTTP answer).
    pub fn push_raw(&mut self, bytes: &[u8]) {
        self.write_buffer.extend_from_slice(bytes);
    }

    /// Appends the `A` of `grant` by `partition`, remembering it until written.
    pub fn push_grant(&mut self, response: &Response, partition: usize, grant: GrantRef) {
        let Response::Acquired { token, .. } = *response else {
            return self.push_answer(response);
        };
        self.push_answer(response);
        self.unsent_grants.push_back(UnsentGrant {
            end: self.written_total + self.unsent() as u64,
            partition: partition as u32,
            grant,
            token,
        });
    }

    /// Bytes encoded but not yet written.
    pub fn unsent(&self) -> usize {
        self.write_buffer.len() - self.write_start
    }

    /// Whether anything is left to write: encoded bytes, or output the stream holds (TLS).
    pub fn has_output(&self) -> bool {
        self.unsent() > 0 || self.socket.wants_write()
    }

    /// Writes what the socket takes. `Ok(true)` when everything was written.
    pub fn flush(&mut self) -> io::Result<bool> {
        let before = self.write_start;
        let result = self.write_out();
        self.written_total += (self.write_start - before) as u64;
        while let Some(grant) = self.unsent_grants.front() {
            if grant.end > self.written_total {
                break;
            }
            self.unsent_grants.pop_front();
        }
        let done = result?;
        if done {
            self.write_buffer.clear();
            self.write_start = 0;
            if self.write_buffer.capacity() > WRITE_CAPACITY_KEPT_BYTES {
                self.write_buffer.shrink_to(OUTPUT_BOUND_BYTES);
            }
        } else if self.write_start >= self.write_buffer.len() / 2 {
            self.write_buffer.drain(..self.write_start);
            self.write_start = 0;
        }
        Ok(done)
    }

    fn write_out(&mut self) -> io::Result<bool> {
        while self.write_start < self.write_buffer.len() {
            match self.socket.write(&self.write_buffer[self.write_start..]) {
                Ok(0) => return Err(io::ErrorKind::WriteZero.into()),
                Ok(n) => self.write_start += n,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => return Ok(false),
                Err(e) => return Err(e),
            }
        }
        // A stream with output of its own (TLS records) writes it now; the next writable
        // event finishes what the socket does not take. Constant false for TCP.
        if !self.socket.wants_write() {
            return Ok(true);
        }
        match self.socket.flush() {
            Ok(()) => Ok(true),
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => Ok(false),
            Err(e) => Err(e),
        }
    }

    /// The socket is gone: forgets the unsent output and returns the grants whose `A` was not
    /// wholly written (a partial frame cannot be read either). The caller releases them.
    pub fn discard_output(&mut self) -> VecDeque<UnsentGrant> {
        self.write_buffer.clear();
        self.write_start = 0;
        std::mem::take(&mut self.unsent_grants)
    }

    // ----- the close protocol -----------------------------------------------------------------

    /// Enters `phase` (not [`Phase::Open`]); the partitions' acknowledgements are awaited.
    pub fn set_phase(&mut self, phase: Phase) {
        debug_assert!(phase != Phase::Open);
        self.phase = phase;
    }

    /// Awaits `acks` acknowledgements of the close.
    pub fn await_acks(&mut self, acks: u32) {
        self.acks_awaited = acks;
    }

    /// One partition acknowledged the close.
    pub fn ack(&mut self) {
        debug_assert!(self.acks_awaited > 0);
        self.acks_awaited = self.acks_awaited.saturating_sub(1);
    }

    /// Partitions that have not acknowledged the close yet.
    pub fn acks_awaited(&self) -> u32 {
        self.acks_awaited
    }

    /// Shuts our side and starts [`Phase::Lingering`] until `until_us`.
    pub fn linger(&mut self, until_us: u64) {
        debug_assert_eq!(self.unsent(), 0);
        let _ = self.socket.shutdown_write();
        self.phase = Phase::Lingering;
        self.linger_until_us = until_us;
    }

    /// While lingering: when to close regardless.
    pub fn linger_until_us(&self) -> u64 {
        self.linger_until_us
    }

    /// Reads and drops incoming bytes, a bounded amount per call. True when the peer ended its
    /// side (or the socket failed): the session can be closed without a reset.
    pub fn drop_incoming(&mut self) -> bool {
        let mut sink = [0u8; 4096];
        for _ in 0..LINGER_READS_MAX {
            match self.socket.read(&mut sink) {
                Ok(0) => return true,
                Ok(_) => {}
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => return false,
                Err(_) => return true,
            }
        }
        false
    }

    /// The stream, once the session ends.
    pub fn into_socket(self) -> S {
        self.socket
    }
}

#[cfg(test)]
mod tests;
