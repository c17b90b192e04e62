//! One peer's outbound lane: the queue of encoded envelopes and the socket they are written to,
//! shared by every thread that sends to that peer.
//!
//! The thread that produces a message writes it: a core's drain (a leader's appends) and a log
//! writer after its sync (a follower's append responses) lock the peer's lane, encode their
//! envelopes into its queue, and write the queue to the connection's socket themselves, so a
//! message does not wait for the peer thread to wake up and pass it on (one thread hand-off
//! less on each side of the replication round trip: docs/benchmarks.md, "Where a replicated
//! request's time goes"). The peer thread owns the connection's life (connect, hello, reply,
//! keepalives, reconnect, the writable events) and writes what the senders could not: the
//! socket was full, or not connected yet.
//!
//! Every byte reaches the socket under the lane's lock, control bytes (hello, keepalive) before
//! envelopes, through [`LaneState::flush`]: so envelopes are never interleaved, whichever
//! thread writes. With `[cluster.tls]` the lane owns the connection's rustls session with its
//! socket handle ([`PeerStream::Tls`]): the senders' writes and the peer thread's reads (the
//! handshake, the reply) all take the lane's lock, so the session is never used by two threads
//! at once; an envelope counts as sent once rustls took it, and the records rustls holds when
//! the socket is full are written like queued bytes (a flush, on the next writable event). A
//! sender never waits for the socket: a write that would block leaves the rest queued (the peer
//! thread's writable event finishes it); one that fails leaves the error for the peer thread,
//! which fails the link, and wakes it.
//!
//! Invariants (checked after every change in debug builds): envelopes are written only to an
//! accepted connection and after its control bytes; a lane without a connection has no control
//! bytes, is not blocked and holds no error; the queue's own ([`Queue`]).

use super::frame::{HELLO_BYTES, KEEPALIVE};
use super::queue::{Queue, Refused};
use super::tls::PeerStream;
use super::PeerStats;
use parking_lot::{Mutex, MutexGuard};
use raft::eraftpb::Message;
use std::io::{self, IoSlice, Read, Write};
use std::time::Instant;

/// Writes per flush of one lane, at most (each may carry many envelopes).
pub(crate) const WRITES_PER_FLUSH: usize = 16;

const _: () = assert!(KEEPALIVE.len() <= HELLO_BYTES);

/// Bytes written before any envelope: the hello, or a keepalive.
pub(crate) struct Control {
    bytes: [u8; HELLO_BYTES],
    len: usize,
    written: usize,
}

impl Control {
    /// Nothing to write.
    pub(crate) fn none() -> Control {
        Control::of(&[])
    }

    /// `bytes` to write (at most [`HELLO_BYTES`]).
    pub(crate) fn of(bytes: &[u8]) -> Control {
        let mut control = Control {
            bytes: [0; HELLO_BYTES],
            len: bytes.len(),
            written: 0,
        };
        control.bytes[..bytes.len()].copy_from_slice(bytes);
        control
    }

    /// What is left to write.
    pub(crate) fn unwritten(&self) -> &[u8] {
        &self.bytes[self.written..self.len]
    }
}

/// One peer's lane; see the module docs.
pub(crate) struct Lane {
    node_id: u64,
    state: Mutex<LaneState>,
}

/// What the lane's lock guards.
pub(crate) struct LaneState {
    /// Envelopes not wholly written yet.
    pub(crate) queue: Queue,
    /// The hello or a keepalive, written before any envelope.
    pub(crate) control: Control,
    /// A handle of the connection's socket (the peer thread's own is registered with its
    /// poll), and its TLS session if any: present from the connect's completion until the
    /// link fails or closes. Every read and write of the connection goes through it.
    stream: Option<PeerStream>,
    /// The peer accepted the hello: envelopes may be written.
    pub(crate) accepted: bool,
    /// A write would block: only the peer thread's writable event writes again.
    pub(crate) blocked: bool,
    /// When bytes were last written to the connection (for keepalives).
    pub(crate) last_write: Instant,
    /// A write by a sender failed: the peer thread fails the link with this error.
    pub(crate) failed: Option<io::Error>,
}

impl Lane {
    /// An empty lane to `node_id`, not connected.
    pub(crate) fn new(node_id: u64, queue: Queue, now: Instant) -> Lane {
        Lane {
            node_id,
            state: Mutex::new(LaneState {
                queue,
                control: Control::none(),
                stream: None,
                accepted: false,
                blocked: false,
                last_write: now,
                failed: None,
            }),
        }
    }

    /// The peer's node id.
    pub(crate) fn node_id(&self) -> u64 {
        self.node_id
    }

    /// The lane's state, locked.
    pub(crate) fn lock(&self) -> MutexGuard<'_, LaneState> {
        self.state.lock()
    }
}

impl LaneState {
    /// Queues `message` for `shard`, counting a drop if it cannot be.
    pub(crate) fn push(&mut self, node_id: u64, shard: u32, message: &Message, stats: &PeerStats) {
        match self.queue.push(shard, message) {
            Ok(()) => {}
            Err(Refused::Full) => PeerStats::add(&stats.drops_queue, 1),
            Err(Refused::Encode(error)) => {
                log::warn!("peer {node_id}: message for shard {shard} dropped: {error}");
                PeerStats::add(&stats.drops_oversized, 1);
            }
        }
    }

    /// Whether a flush now would write (connected, not blocked, not failed, something to
    /// write).
    pub(crate) fn wants_flush(&self) -> bool {
        let Some(stream) = &self.stream else {
            return false;
        };
        let writable = !self.blocked && self.failed.is_none();
        let envelopes = self.accepted && !self.queue.unsent().is_empty();
        let control = !self.control.unwritten().is_empty();
        writable && (envelopes || control || stream.wants_write())
    }

    /// Whether the connection's TLS handshake is under way.
    pub(crate) fn handshaking(&self) -> bool {
        self.stream.as_ref().is_some_and(PeerStream::handshaking)
    }

    /// Reads from the connection (the peer thread: the handshake, the reply, then only the
    /// end); `NotConnected` without one.
    pub(crate) fn read(&mut self, buffer: &mut [u8]) -> io::Result<usize> {
        match self.stream.as_mut() {
            Some(stream) => stream.read(buffer),
            None => Err(io::ErrorKind::NotConnected.into()),
        }
    }

    /// Whether the connection is TLS.
    pub(crate) fn is_tls(&self) -> bool {
        self.stream.as_ref().is_some_and(PeerStream::is_tls)
    }

    /// A new connection's socket (and TLS session), whose first bytes are `hello`.
    pub(crate) fn connect(&mut self, stream: PeerStream, hello: &[u8], now: Instant) {
        self.stream = Some(stream);
        self.control = Control::of(hello);
        (self.accepted, self.blocked, self.failed) = (false, false, None);
        self.last_write = now;
        self.check_invariants();
    }

    /// The connection is gone: its socket handle is dropped (closing it, once the peer
    /// thread's is too), and the partly written envelope goes again whole on the next one.
    pub(crate) fn disconnect(&mut self) {
        self.stream = None;
        self.control = Control::none();
        (self.accepted, self.blocked, self.failed) = (false, false, None);
        self.queue.rewind();
        self.check_invariants();
    }

    /// Writes the control bytes, then (once accepted) queued envelopes, until the socket is
    /// full, nothing is left, or [`WRITES_PER_FLUSH`] writes. `Err` is the socket's failure
    /// (the link must fail); a full socket is `Ok` with `blocked` set.
    pub(crate) fn flush(&mut self, now: Instant, stats: &PeerStats) -> io::Result<()> {
        let result = self.write_out(now, stats);
        self.check_invariants();
        result
    }

    fn write_out(&mut self, now: Instant, stats: &PeerStats) -> io::Result<()> {
        if self.blocked || self.failed.is_some() {
            return Ok(());
        }
        let Some(stream) = self.stream.as_mut() else {
            return Ok(());
        };
        for _ in 0..WRITES_PER_FLUSH {
            let control = self.control.unwritten();
            let unsent = match self.accepted {
                true => self.queue.unsent(),
                false => &[],
            };
            if control.is_empty() && unsent.is_empty() {
                // What rustls holds still goes out (a no-op on plain TCP).
                return match stream.flush() {
                    Err(error) if error.kind() == io::ErrorKind::WouldBlock => {
                        self.blocked = true;
                        Ok(())
                    }
                    other => other,
                };
            }
            let result = if control.is_empty() {
                stream.write(unsent)
            } else {
                stream.write_vectored(&[IoSlice::new(control), IoSlice::new(unsent)])
            };
            match result {
                Ok(0) => return Err(io::Error::new(io::ErrorKind::WriteZero, "wrote nothing")),
                Ok(written) => {
                    let of_control = written.min(control.len());
                    self.control.written += of_control;
                    self.last_write = now;
                    let (messages, bytes) = self.queue.advance(written - of_control);
                    PeerStats::add(&stats.messages_sent, messages);
                    PeerStats::add(&stats.bytes_sent, bytes);
                }
                Err(error) if error.kind() == io::ErrorKind::WouldBlock => {
                    self.blocked = true;
                    return Ok(());
                }
                Err(error) if error.kind() == io::ErrorKind::Interrupted => {}
                Err(error) => return Err(error),
            }
        }
        Ok(())
    }

    /// Panics if an invariant of the module docs is broken (debug builds and tests).
    pub(crate) fn check_invariants(&self) {
        if !cfg!(debug_assertions) {
            return;
        }
        self.queue.check_invariants();
        if self.stream.is_none() {
            assert!(
                self.control.unwritten().is_empty(),
                "control bytes, no socket"
            );
            assert!(!self.accepted && !self.blocked && self.failed.is_none());
        }
        if !self.accepted {
            let given = self.queue.bytes() - self.queue.unsent().len();
            assert_eq!(given, 0, "envelopes written before the hello was accepted");
        }
    }
}

#[cfg(test)]
#[path = "lane_tests.rs"]
mod tests;
