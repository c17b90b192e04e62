//! One outbound connection to one peer: connect on demand, hello, coalesced writes, reconnect.
//!
//! States: `Idle` (no connection, nothing asked of it) → `Connecting` (a non-blocking connect
//! in flight, bounded by the connect timeout) → `Connected` (hello, then the queue's bytes) →
//! on any error `Waiting` (the backoff's delay) → `Connecting` again. The queue survives every
//! state: what was not wholly written goes on the next connection.
//!
//! The connection is write-only; it is registered for reading only to see the peer close it
//! (a restart) — any byte the peer writes is a protocol error and closes it. Writes stop at
//! `WouldBlock` until the next writable event, and at most [`WRITES_PER_FLUSH`] per flush.

use super::frame::HELLO_BYTES;
use super::queue::{Backoff, Queue, Refused};
use super::{PeerLimits, PeerStats};
use mio::event::Event;
use mio::net::TcpStream;
use mio::{Interest, Registry, Token};
use raft::eraftpb::Message;
use std::io::{self, IoSlice, Read, Write};
use std::net::SocketAddr;
use std::time::{Duration, Instant};

/// Writes per flush of one link, at most (each may carry many envelopes).
pub(crate) const WRITES_PER_FLUSH: usize = 16;

enum State {
    Idle,
    Waiting {
        until: Instant,
    },
    Connecting {
        stream: TcpStream,
        deadline: Instant,
    },
    Connected {
        stream: TcpStream,
        hello_written: usize,
        since: Instant,
        blocked: bool,
    },
}

/// The connection to one peer and the queue of what it has not sent yet.
pub(crate) struct Link {
    node_id: u64,
    addr: SocketAddr,
    token: Token,
    hello: [u8; HELLO_BYTES],
    queue: Queue,
    state: State,
    backoff: Backoff,
    connect_timeout: Duration,
    backoff_max: Duration,
}

impl Link {
    /// A link to `node_id` at `addr`, with nothing queued and no connection yet.
    pub(crate) fn new(
        (node_id, addr): (u64, SocketAddr),
        token: Token,
        hello: [u8; HELLO_BYTES],
        limits: &PeerLimits,
        seed: u64,
    ) -> Link {
        Link {
            node_id,
            addr,
            token,
            hello,
            queue: Queue::new(limits.queue_messages_max, limits.queue_bytes_max),
            state: State::Idle,
            backoff: Backoff::new(limits.backoff_min, limits.backoff_max, seed),
            connect_timeout: limits.connect_timeout,
            backoff_max: limits.backoff_max,
        }
    }

    /// The peer's node id.
    pub(crate) fn node_id(&self) -> u64 {
        self.node_id
    }

    /// The queue (for gauges).
    pub(crate) fn queue(&self) -> &Queue {
        &self.queue
    }

    /// Queues `message` for `shard`, counting a drop if it cannot be.
    pub(crate) fn push(&mut self, shard: u32, message: &Message, stats: &PeerStats) {
        match self.queue.push(shard, message) {
            Ok(()) => {}
            Err(Refused::Full) => PeerStats::add(&stats.drops_queue, 1),
            Err(Refused::Encode(error)) => {
                log::warn!(
                    "peer {}: message for shard {shard} dropped: {error}",
                    self.node_id
                );
                PeerStats::add(&stats.drops_oversized, 1);
            }
        }
    }

    /// When [`Link::on_timer`] next has something to do.
    pub(crate) fn deadline(&self) -> Option<Instant> {
        match self.state {
            State::Waiting { until } => Some(until),
            State::Connecting { deadline, .. } => Some(deadline),
            State::Idle | State::Connected { .. } => None,
        }
    }

    /// Whether a flush now would write (connected, writable, something to write).
    pub(crate) fn wants_flush(&self) -> bool {
        match self.state {
            State::Connected {
                hello_written,
                blocked,
                ..
            } => !blocked && (hello_written < HELLO_BYTES || !self.queue.unsent().is_empty()),
            _ => false,
        }
    }

    /// Connects when there is something to send and no reason to wait; gives up a connect that
    /// took too long.
    pub(crate) fn on_timer(&mut self, registry: &Registry, now: Instant, stats: &PeerStats) {
        match self.state {
            State::Idle if self.queue.messages() > 0 => self.connect(registry, now, stats),
            State::Waiting { until } if until <= now => {
                if self.queue.messages() > 0 {
                    self.connect(registry, now, stats);
                } else {
                    self.state = State::Idle; // nothing to send: no deadline to spin on
                }
            }
            State::Connecting { deadline, .. } if deadline <= now => {
                let error = io::Error::new(io::ErrorKind::TimedOut, "connect timed out");
                self.fail(registry, now, stats, &error);
            }
            _ => {}
        }
    }

    fn connect(&mut self, registry: &Registry, now: Instant, stats: &PeerStats) {
        let result = TcpStream::connect(self.addr).and_then(|mut stream| {
            registry.register(
                &mut stream,
                self.token,
                Interest::READABLE | Interest::WRITABLE,
            )?;
            Ok(stream)
        });
        match result {
            Ok(stream) => {
                let deadline = now + self.connect_timeout;
                self.state = State::Connecting { stream, deadline };
            }
            Err(error) => self.fail(registry, now, stats, &error),
        }
    }

    /// A readiness event on this link's token.
    pub(crate) fn on_event(
        &mut self,
        registry: &Registry,
        event: &Event,
        now: Instant,
        stats: &PeerStats,
    ) {
        let outcome = match &mut self.state {
            State::Connecting { stream, .. } => connect_outcome(stream),
            State::Connected {
                stream, blocked, ..
            } => {
                if event.is_writable() {
                    *blocked = false;
                }
                read_until_blocked(stream).map(|()| false)
            }
            State::Idle | State::Waiting { .. } => Ok(false), // a stale event
        };
        match outcome {
            Ok(true) => {
                let State::Connecting { stream, .. } =
                    std::mem::replace(&mut self.state, State::Idle)
                else {
                    unreachable!("connect_outcome runs only while connecting");
                };
                if let Err(error) = stream.set_nodelay(true) {
                    log::warn!("peer {}: TCP_NODELAY not set: {error}", self.node_id);
                }
                log::debug!("peer {}: connected to {}", self.node_id, self.addr);
                PeerStats::add(&stats.connects, 1);
                let connected = State::Connected {
                    stream,
                    hello_written: 0,
                    since: now,
                    blocked: false,
                };
                self.state = connected;
            }
            Ok(false) => {}
            Err(error) => self.fail(registry, now, stats, &error),
        }
    }

    /// Writes the hello and queued envelopes until the socket is full or the queue empty.
    pub(crate) fn flush(&mut self, registry: &Registry, now: Instant, stats: &PeerStats) {
        let State::Connected {
            stream,
            hello_written,
            blocked,
            ..
        } = &mut self.state
        else {
            return;
        };
        // Bounded: at most WRITES_PER_FLUSH writes, whatever the socket takes.
        for _ in 0..WRITES_PER_FLUSH {
            let hello = &self.hello[*hello_written..];
            let unsent = self.queue.unsent();
            if hello.is_empty() && unsent.is_empty() {
                return;
            }
            let result = if hello.is_empty() {
                stream.write(unsent)
            } else {
                stream.write_vectored(&[IoSlice::new(hello), IoSlice::new(unsent)])
            };
            let error = match result {
                Ok(0) => io::Error::new(io::ErrorKind::WriteZero, "wrote nothing"),
                Ok(written) => {
                    let of_hello = written.min(hello.len());
                    *hello_written += of_hello;
                    let (messages, bytes) = self.queue.advance(written - of_hello);
                    PeerStats::add(&stats.messages_sent, messages);
                    PeerStats::add(&stats.bytes_sent, bytes);
                    continue;
                }
                Err(error) if error.kind() == io::ErrorKind::WouldBlock => {
                    *blocked = true;
                    return;
                }
                Err(error) if error.kind() == io::ErrorKind::Interrupted => continue,
                Err(error) => error,
            };
            return self.fail(registry, now, stats, &error);
        }
    }

    /// Closes the connection if any (at shutdown).
    pub(crate) fn close(&mut self, registry: &Registry) {
        let state = std::mem::replace(&mut self.state, State::Idle);
        if let State::Connecting { mut stream, .. } | State::Connected { mut stream, .. } = state {
            let _ = registry.deregister(&mut stream);
        }
    }

    fn fail(&mut self, registry: &Registry, now: Instant, stats: &PeerStats, error: &io::Error) {
        if let State::Connected { since, .. } = self.state {
            // A connection that lived long was a success: the next failure starts afresh.
            if now.saturating_duration_since(since) >= self.backoff_max {
                self.backoff.reset();
            }
        }
        self.close(registry);
        self.queue.rewind();
        let delay = self.backoff.next_delay();
        log::debug!(
            "peer {} at {}: {error}; retry in {delay:?}",
            self.node_id,
            self.addr
        );
        PeerStats::add(&stats.disconnects, 1);
        self.state = State::Waiting { until: now + delay };
    }
}

/// Whether a non-blocking connect has completed (`Ok(false)`: not yet).
fn connect_outcome(stream: &TcpStream) -> io::Result<bool> {
    if let Some(error) = stream.take_error()? {
        return Err(error);
    }
    match stream.peer_addr() {
        Ok(_) => Ok(true),
        Err(error) if error.kind() == io::ErrorKind::NotConnected => Ok(false),
        Err(error) => Err(error),
    }
}

/// Reads what the peer sent on a write-only connection: nothing is fine, a close or a byte is an
/// error.
fn read_until_blocked(stream: &mut TcpStream) -> io::Result<()> {
    let mut scratch = [0u8; 64];
    // Bounded: every pass but an interrupted one returns.
    for _ in 0..16 {
        match stream.read(&mut scratch) {
            Ok(0) => {
                return Err(io::Error::new(
                    io::ErrorKind::UnexpectedEof,
                    "closed by peer",
                ))
            }
            Ok(read) => {
                let message = format!("peer wrote {read} bytes on a write-only connection");
                return Err(io::Error::new(io::ErrorKind::InvalidData, message));
            }
            Err(error) if error.kind() == io::ErrorKind::WouldBlock => return Ok(()),
            Err(error) if error.kind() == io::ErrorKind::Interrupted => continue,
            Err(error) => return Err(error),
        }
    }
    Ok(())
}
