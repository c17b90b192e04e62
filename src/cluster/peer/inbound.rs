//! One inbound connection from a peer: the hello checked, envelopes read in place from a reusable
//! buffer, each message decoded and handed to the core that owns its shard.
//!
//! The buffer starts at [`BUFFER_BYTES`] and grows only to hold one envelope whose announced
//! length was checked (at most [`frame::FRAME_BYTES_MAX`] and a header), and only after the hello
//! was accepted; it shrinks back once that envelope is consumed. So an unknown connection holds
//! at most [`BUFFER_BYTES`], a peer's at most one envelope more.
//!
//! Deliberately not here: sending anything back (connections are one-way), and deciding what
//! to do with a second connection from the same node (the thread replaces the older one).

use super::frame::{self, Envelope, Hello, HELLO_BYTES, LEN_BYTES};
use super::{CoreInbox, PeerStats};
use crossbeam_channel::TrySendError;
use mio::net::TcpStream;
use protobuf::Message as _;
use raft::eraftpb::Message;
use std::io::{self, Read};
use std::net::SocketAddr;
use std::time::Instant;

/// A connection's read buffer when it is not holding a large envelope.
pub(crate) const BUFFER_BYTES: usize = 64 << 10;
/// Reads per readiness pass of one connection, at most; a pass cut short continues next loop.
pub(crate) const READS_PER_PASS: usize = 16;

const _: () = assert!(BUFFER_BYTES > HELLO_BYTES + frame::HEADER_BYTES);

/// How a connection ends.
pub(crate) enum Close {
    /// The peer closed it (expected: a restart), or the socket failed.
    Gone(io::Error),
    /// Hostile or broken input: logged with the address and counted as a refusal.
    Refused(String),
}

/// The cores that receive messages, and which of them were handed something this iteration.
pub(crate) struct Cores {
    inbound: Vec<CoreInbox>,
    route: Box<dyn Fn(u32) -> usize + Send>,
    delivered: Vec<bool>,
}

impl Cores {
    /// Cores `inbound[i]`, with `route(shard)` the index of a shard's core.
    pub(crate) fn new(inbound: Vec<CoreInbox>, route: Box<dyn Fn(u32) -> usize + Send>) -> Cores {
        let delivered = vec![false; inbound.len()];
        Cores {
            inbound,
            route,
            delivered,
        }
    }

    fn deliver(&mut self, shard: u32, message: Message, stats: &PeerStats) {
        let core = (self.route)(shard);
        assert!(
            core < self.inbound.len(),
            "route({shard}) = {core}: no such core"
        );
        match self.inbound[core].0.try_send((shard, message)) {
            Ok(()) => self.delivered[core] = true,
            Err(TrySendError::Full(_) | TrySendError::Disconnected(_)) => {
                PeerStats::add(&stats.drops_inbound, 1);
            }
        }
    }

    /// Wakes each core handed something since the last call, once.
    pub(crate) fn wake(&mut self) {
        for (core, delivered) in self.delivered.iter_mut().enumerate() {
            if std::mem::take(delivered) {
                if let Err(error) = self.inbound[core].1.wake() {
                    log::warn!("peer thread: cannot wake core {core}: {error}");
                }
            }
        }
    }
}

/// What every inbound connection checks its input against, and where it delivers.
pub(crate) struct Context {
    /// This member's node id: every message must be addressed to it.
    pub(crate) node_id: u64,
    /// The cluster's shard count.
    pub(crate) shards: u32,
    /// The peers' node ids: a hello must name one.
    pub(crate) peers: Vec<u64>,
    /// The cores.
    pub(crate) cores: Cores,
}

impl Context {
    fn deliver(
        &mut self,
        from: u64,
        envelope: Envelope<'_>,
        stats: &PeerStats,
    ) -> Result<(), Close> {
        let shard = envelope.shard;
        if shard >= self.shards {
            let reason = format!(
                "shard {shard} out of range (the cluster has {})",
                self.shards
            );
            return Err(Close::Refused(reason));
        }
        let message = Message::parse_from_bytes(envelope.message)
            .map_err(|error| Close::Refused(format!("undecodable message: {error}")))?;
        if message.from != from || message.to != self.node_id {
            let (sender, to) = (message.from, message.to);
            let reason = format!("a message from {sender} to {to} on node {from}'s connection");
            return Err(Close::Refused(reason));
        }
        PeerStats::add(&stats.messages_received, 1);
        PeerStats::add(
            &stats.bytes_received,
            (frame::HEADER_BYTES + envelope.message.len()) as u64,
        );
        self.cores.deliver(shard, message, stats);
        Ok(())
    }
}

/// One accepted connection.
pub(crate) struct Inbound {
    stream: TcpStream,
    addr: SocketAddr,
    generation: usize,
    buffer: Vec<u8>,
    filled: usize,
    peer: Option<u64>,
    hello_deadline: Instant,
}

impl Inbound {
    /// A connection accepted from `addr`, which must say hello by `hello_deadline`.
    pub(crate) fn new(
        stream: TcpStream,
        addr: SocketAddr,
        generation: usize,
        hello_deadline: Instant,
    ) -> Inbound {
        let buffer = vec![0; BUFFER_BYTES];
        Inbound {
            stream,
            addr,
            generation,
            buffer,
            filled: 0,
            peer: None,
            hello_deadline,
        }
    }

    /// The generation its token carries.
    pub(crate) fn generation(&self) -> usize {
        self.generation
    }

    /// The remote address.
    pub(crate) fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// The node that said hello, once it has.
    pub(crate) fn peer(&self) -> Option<u64> {
        self.peer
    }

    /// When it must have said hello, until it has.
    pub(crate) fn hello_deadline(&self) -> Option<Instant> {
        self.peer.is_none().then_some(self.hello_deadline)
    }

    /// The socket, to deregister.
    pub(crate) fn stream(&mut self) -> &mut TcpStream {
        &mut self.stream
    }

    /// Reads and delivers until `WouldBlock` (`Ok(true)`) or [`READS_PER_PASS`] reads
    /// (`Ok(false)`: call again).
    pub(crate) fn read_pass(
        &mut self,
        context: &mut Context,
        stats: &PeerStats,
    ) -> Result<bool, Close> {
        for _ in 0..READS_PER_PASS {
            debug_assert!(self.filled < self.buffer.len(), "no room to read");
            match self.stream.read(&mut self.buffer[self.filled..]) {
                Ok(0) => {
                    let eof = io::Error::new(io::ErrorKind::UnexpectedEof, "closed by peer");
                    return Err(Close::Gone(eof));
                }
                Ok(read) => {
                    self.filled += read;
                    self.parse(context, stats)?;
                }
                Err(error) if error.kind() == io::ErrorKind::WouldBlock => return Ok(true),
                Err(error) if error.kind() == io::ErrorKind::Interrupted => continue,
                Err(error) => return Err(Close::Gone(error)),
            }
        }
        Ok(false)
    }

    /// Consumes the hello and every whole envelope in the buffer, then sizes it for the next.
    fn parse(&mut self, context: &mut Context, stats: &PeerStats) -> Result<(), Close> {
        let mut at = 0;
        let from = match self.peer {
            Some(from) => from,
            None => {
                let known = |id| context.peers.contains(&id);
                let bytes = &self.buffer[..self.filled];
                match Hello::decode(bytes, context.shards, known) {
                    Ok(None) => return Ok(()),
                    Ok(Some(hello)) => {
                        self.peer = Some(hello.node_id);
                        at = HELLO_BYTES;
                        hello.node_id
                    }
                    Err(error) => return Err(Close::Refused(error.to_string())),
                }
            }
        };
        // Bounded: each pass consumes at least a header's bytes of what was read.
        while let Some((envelope, used)) = frame::decode(&self.buffer[at..self.filled])
            .map_err(|error| Close::Refused(error.to_string()))?
        {
            context.deliver(from, envelope, stats)?;
            at += used;
        }
        self.buffer.copy_within(at..self.filled, 0);
        self.filled -= at;
        self.size_buffer()
    }

    /// Grows the buffer to hold the next envelope whole, or shrinks it back when it need not.
    fn size_buffer(&mut self) -> Result<(), Close> {
        let announced = frame::announced_len(&self.buffer[..self.filled])
            .map_err(|error| Close::Refused(error.to_string()))?;
        let needed = announced.map_or(0, |len| LEN_BYTES + len).max(BUFFER_BYTES);
        if needed > self.buffer.len() {
            self.buffer.resize(needed, 0);
        } else if needed == BUFFER_BYTES && self.buffer.len() > BUFFER_BYTES {
            debug_assert!(self.filled < BUFFER_BYTES);
            self.buffer.truncate(BUFFER_BYTES);
            self.buffer.shrink_to_fit();
        }
        debug_assert!(self.filled < self.buffer.len(), "the next envelope fits");
        Ok(())
    }
}
