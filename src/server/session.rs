//! One client connection: its socket, its read and write buffers, and its accounting.
//!
//! The read buffer comes from a [`BufferPool`] and is reused for the life of the session and
//! then by later sessions; frames are parsed in place from it (see [`crate::protocol`]) and it
//! is compacted only after the borrowed frames are consumed. The write buffer collects encoded
//! answers until the reactor flushes it with one `write` per pass.
//!
//! Limits: a session stops being *read* (not disconnected) while its unsent output passes
//! [`OUTPUT_BOUND_BYTES`] or while too many of its requests wait for other cores; it resumes
//! when they drain. Answers are never dropped.
//!
//! Not here: what a frame means (the reactor hands requests to the lock table).

use crate::lock_table::SessionId;
use mio::net::TcpStream;
use std::io::{self, Read, Write};

/// Bytes of a session's read buffer. Holds many frames, and at least two of the longest.
pub const READ_BUFFER_BYTES: usize = 16 * 1024;
/// Unsent output past which a session is not read until it drains.
pub const OUTPUT_BOUND_BYTES: usize = 64 * 1024;
/// Requests one session may have in flight to other cores (besides its pending acquires).
pub const REMOTE_IN_FLIGHT_MAX: u32 = 4096;
/// Buffer fills of input a lingering session drops per loop iteration.
const LINGER_READS_MAX: usize = 16;
/// Write capacity kept after a burst drains; more is given back to the allocator.
const WRITE_CAPACITY_KEPT_BYTES: usize = 4 * OUTPUT_BOUND_BYTES;

const _: () = assert!(READ_BUFFER_BYTES >= 2 * crate::protocol::REQUEST_BYTES_MAX);
const _: () = assert!(OUTPUT_BOUND_BYTES >= 64 * crate::protocol::RESPONSE_BYTES_MAX);

/// Reusable read buffers, so that sessions coming and going do not allocate.
#[derive(Default)]
pub struct BufferPool {
    free: Vec<Box<[u8]>>,
    kept_max: usize,
}

impl BufferPool {
    /// A pool that keeps at most `kept_max` idle buffers.
    pub fn new(kept_max: usize) -> BufferPool {
        BufferPool {
            free: Vec::new(),
            kept_max,
        }
    }

    /// A buffer of [`READ_BUFFER_BYTES`].
    pub fn take(&mut self) -> Box<[u8]> {
        self.free
            .pop()
            .unwrap_or_else(|| vec![0u8; READ_BUFFER_BYTES].into_boxed_slice())
    }

    /// Returns a buffer for reuse.
    pub fn give(&mut self, buffer: Box<[u8]>) {
        if self.free.len() < self.kept_max {
            self.free.push(buffer);
        }
    }
}

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

/// One client connection.
pub struct Session {
    /// The session's identity in lock tables and messages.
    pub id: SessionId,
    /// The socket.
    pub socket: TcpStream,
    /// Life phase.
    pub phase: Phase,
    /// Acquires with wait > 0 submitted and not yet answered: bookkeeping checked against the
    /// answers in debug builds. The limit on *queued* acquires is the lock tables' (shared
    /// counts across cores, see `server::queued`).
    pub pending: u32,
    /// Requests sent to other cores whose answer has not come back.
    pub remote_unanswered: u32,
    /// Of those, the ones answered as soon as the other core handles them (all but acquires
    /// that may wait): while some are out, the session's output is held back a little so that
    /// their answers leave in the same `write` (see the reactor's `flush_sessions`).
    pub remote_prompt: u32,
    /// While output is held for prompt remote answers: the time it is written regardless.
    pub hold_until_us: Option<u64>,
    /// Partitions that have not yet acknowledged the session's close.
    pub acks_awaited: u32,
    /// Set when the session is in the reactor's list of sessions to read without an event.
    pub scheduled: bool,
    /// Set when the session is in the reactor's list of sessions to flush.
    pub dirty: bool,
    /// Set when reading stopped because the session was over its bounds.
    pub paused: bool,
    /// While [`Phase::Lingering`]: when to close regardless.
    pub linger_until_us: u64,
    read_buffer: Box<[u8]>,
    read_start: usize,
    read_end: usize,
    write_buffer: Vec<u8>,
    write_start: usize,
}

impl Session {
    /// A new open session on `socket` reading into `read_buffer`.
    pub fn new(id: SessionId, socket: TcpStream, read_buffer: Box<[u8]>) -> Session {
        debug_assert_eq!(read_buffer.len(), READ_BUFFER_BYTES);
        Session {
            id,
            socket,
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
            read_buffer,
            read_start: 0,
            read_end: 0,
            write_buffer: Vec::new(),
            write_start: 0,
        }
    }

    /// Gives the read buffer back (at the end of the session).
    pub fn into_read_buffer(self) -> Box<[u8]> {
        self.read_buffer
    }

    /// Received bytes not yet parsed.
    pub fn unparsed(&self) -> &[u8] {
        &self.read_buffer[self.read_start..self.read_end]
    }

    /// Marks `bytes` of the unparsed input as consumed.
    pub fn consume(&mut self, bytes: usize) {
        debug_assert!(self.read_start + bytes <= self.read_end);
        self.read_start += bytes;
        if self.read_start == self.read_end {
            self.read_start = 0;
            self.read_end = 0;
        }
    }

    /// Drops every unparsed byte (after a closing error).
    pub fn discard_input(&mut self) {
        self.read_start = 0;
        self.read_end = 0;
    }

    /// Whether the session must not be read or parsed now: its output or its requests to other
    /// cores are over their bounds.
    pub fn over_bounds(&self, pending_max: u32) -> bool {
        self.unsent() >= OUTPUT_BOUND_BYTES
            || self.remote_unanswered >= REMOTE_IN_FLIGHT_MAX + pending_max
    }

    /// Whether a session paused over its bounds is back under them and may be read again.
    pub fn may_resume(&self, pending_max: u32) -> bool {
        self.paused && self.phase == Phase::Open && !self.over_bounds(pending_max)
    }

    /// Reads into the free part of the buffer (moving a partial frame to the front first).
    ///
    /// With `until_would_block` false, a short read ends the pass: it proves the socket was
    /// empty at that moment, and with edge-triggered readiness anything arriving later raises
    /// a new event. That saves one `read` per readiness on the request path. The caller must
    /// pass true when the readiness said the peer closed its side (an end of input that came
    /// with the data raises no further event) and when there is no readiness event at all.
    pub fn read(&mut self, until_would_block: bool) -> ReadOutcome {
        if self.read_start > 0 {
            self.read_buffer
                .copy_within(self.read_start..self.read_end, 0);
            self.read_end -= self.read_start;
            self.read_start = 0;
        }
        // Bounded: every pass fills part of the buffer, or returns.
        loop {
            let space = &mut self.read_buffer[self.read_end..];
            if space.is_empty() {
                // A full buffer always holds a complete frame, which the reactor parses first.
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

    /// Shuts our side and starts [`Phase::Lingering`] until `until_us`.
    pub fn linger(&mut self, until_us: u64) {
        debug_assert_eq!(self.unsent(), 0);
        let _ = self.socket.shutdown(std::net::Shutdown::Write);
        self.phase = Phase::Lingering;
        self.linger_until_us = until_us;
    }

    /// Reads and drops incoming bytes, a bounded amount per call. True when the peer ended its
    /// side (or the socket failed): the session can be closed without a reset.
    pub fn drop_incoming(&mut self) -> bool {
        for _ in 0..LINGER_READS_MAX {
            match self.socket.read(&mut self.read_buffer) {
                Ok(0) => return true,
                Ok(_) => {}
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => return false,
                Err(_) => return true,
            }
        }
        false
    }

    /// The output buffer, to encode answers into.
    pub fn output(&mut self) -> &mut Vec<u8> {
        &mut self.write_buffer
    }

    /// Bytes encoded but not yet written.
    pub fn unsent(&self) -> usize {
        self.write_buffer.len() - self.write_start
    }

    /// Writes what the socket takes. `Ok(true)` when everything was written.
    pub fn flush(&mut self) -> io::Result<bool> {
        while self.write_start < self.write_buffer.len() {
            match self.socket.write(&self.write_buffer[self.write_start..]) {
                Ok(0) => return Err(io::ErrorKind::WriteZero.into()),
                Ok(n) => self.write_start += n,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => break,
                Err(e) => return Err(e),
            }
        }
        if self.write_start == self.write_buffer.len() {
            self.write_buffer.clear();
            self.write_start = 0;
            if self.write_buffer.capacity() > WRITE_CAPACITY_KEPT_BYTES {
                self.write_buffer.shrink_to(OUTPUT_BOUND_BYTES);
            }
            return Ok(true);
        }
        if self.write_start >= self.write_buffer.len() / 2 {
            self.write_buffer.drain(..self.write_start);
            self.write_start = 0;
        }
        Ok(false)
    }

    /// Forgets unsent output (the socket is gone).
    pub fn discard_output(&mut self) {
        self.write_buffer.clear();
        self.write_start = 0;
    }
}
