//! One inbound connection from a peer: the hello checked and answered, envelopes read in place
//! from a reusable buffer, each message's shape checked ([`super::wire`]) before protobuf parses
//! it, what it carries for the shards checked ([`super::content`]), and handed to the core that
//! owns its shard.
//!
//! The buffer starts at [`BUFFER_BYTES`] and grows only to hold one envelope whose announced
//! length was checked (at most [`frame::FRAME_BYTES_MAX`] and a header), and only after the hello
//! was accepted; it shrinks back once that envelope is consumed. So an unknown connection holds
//! at most [`BUFFER_BYTES`], a peer's at most one envelope more. Such a large envelope, once
//! whole, is parsed from the buffer itself (which becomes the message's bytes: no copy) and the
//! connection gets a fresh buffer.
//!
//! The reply to the hello is the only thing written back: [`frame::REPLY_BYTES`] on a socket
//! that has never been written, which the kernel takes whole (a short write closes the
//! connection), in the hello's version (a version this member does not speak is refused in its
//! newest: [`frame`], "Versions"). An accepted hello's version is noted as the peer's last
//! known one (`super::versions`). From version 6 on, a hello's data-directory incarnation must
//! be the one this member remembers for its dialer ([`super::incarnations`]; checked last,
//! after the certificate on TLS, and a first one recorded before the reply is written). A
//! refused hello is answered, then the connection closed. A message whose shape is refused
//! closes the connection; one whose content is invalid is dropped and counted, and the
//! connection stays (raft tolerates loss).
//!
//! With `[cluster.tls]` the connection is TLS ([`PeerStream::Tls`]): the handshake happens in
//! the reads before the hello (bounded by the hello's deadline), an accepted hello's dialer must
//! be named by its certificate ([`super::tls::check_member`]; refused without a reply
//! otherwise), and a TLS failure closes the connection as a refusal. A plaintext latchkey hello
//! to a TLS member (its first bytes, peeked before rustls reads them, are [`frame::MAGIC`]) and
//! a TLS handshake to a plaintext member ([`frame::HelloError::Magic`] with a TLS record's
//! bytes) are refusals that say the members disagree about `[cluster.tls]`. Every such refusal
//! is counted in `tls_refusals` besides `refusals`.
//!
//! Deliberately not here: deciding what to do with a second connection from the same node (the
//! thread replaces the older one), and logging closes (the thread does, rate-limited).

use super::frame::{self, Envelope, Hello, Local, Reply, Verdict, HELLO_BYTES, LEN_BYTES};
use super::incarnations::Incarnations;
use super::tls::{check_member, tls_failure, PeerStream, TlsFailure};
use super::versions::Versions;
use super::{content, wire, CoreInbox, PeerConfig, PeerStats};
use crate::logging::Throttle;
use bytes::Bytes;
use crossbeam_channel::{Sender, TrySendError};
use mio::Waker;
use protobuf::Message as _;
use raft::eraftpb::{Message, MessageType};
use std::collections::VecDeque;
use std::io::{self, Read, Write};
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

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

/// A shard's core from its index (shared by the peer thread and the cores that read).
pub(crate) type Route = Arc<dyn Fn(u32) -> usize + Send + Sync>;

/// The cores that receive messages, and which of them were handed something this iteration.
/// On a core that reads connections itself (`local`), its own shards' messages go to a queue
/// it takes them from, not through its channel.
pub(crate) struct Cores {
    inbound: Vec<CoreInbox>,
    route: Route,
    delivered: Vec<bool>,
    local: Option<usize>,
    queue: VecDeque<(u32, Message)>,
}

impl Cores {
    /// Cores `inbound[i]`, with `route(shard)` the index of a shard's core; `local`: the core
    /// these deliveries are made on, if it is one.
    pub(crate) fn new(inbound: Vec<CoreInbox>, route: Route, local: Option<usize>) -> Cores {
        let delivered = vec![false; inbound.len()];
        Cores {
            inbound,
            route,
            delivered,
            local,
            queue: VecDeque::new(),
        }
    }

    /// The next message delivered to the local core, if any.
    pub(crate) fn pop_local(&mut self) -> Option<(u32, Message)> {
        self.queue.pop_front()
    }

    /// Whether messages for the local core wait.
    pub(crate) fn has_local(&self) -> bool {
        !self.queue.is_empty()
    }

    fn deliver(&mut self, shard: u32, message: Message, stats: &PeerStats) {
        let core = (self.route)(shard);
        assert!(
            core < self.inbound.len(),
            "route({shard}) = {core}: no such core"
        );
        if self.local == Some(core) {
            return self.queue.push_back((shard, message));
        }
        match self.inbound[core].0.try_send((shard, message)) {
            Ok(()) => self.delivered[core] = true,
            Err(TrySendError::Full(_) | TrySendError::Disconnected(_)) => {
                PeerStats::add(&stats.drops_inbound, 1);
            }
        }
    }

    /// Wakes core `core` now.
    pub(crate) fn wake_core(&self, core: usize) {
        if let Err(error) = self.inbound[core].1.wake() {
            log::warn!("peer: cannot wake core {core}: {error}");
        }
    }

    /// Wakes each core handed something since the last call, once.
    pub(crate) fn wake(&mut self) {
        for core in 0..self.delivered.len() {
            if std::mem::take(&mut self.delivered[core]) {
                self.wake_core(core);
            }
        }
    }
}

/// When something last arrived from each peer (the links' order), noted by whichever thread
/// reads its connection and read by the peer thread's [`super::status`] watch.
pub(crate) struct Heard {
    epoch: Instant,
    /// Microseconds since `epoch`, plus one; zero: never.
    at_us: Vec<AtomicU64>,
}

impl Heard {
    /// Nothing heard yet from any of `peers` peers.
    pub(crate) fn new(peers: usize, epoch: Instant) -> Heard {
        let at_us = (0..peers).map(|_| AtomicU64::new(0)).collect();
        Heard { epoch, at_us }
    }

    fn note(&self, index: usize, now: Instant) {
        let us = now.saturating_duration_since(self.epoch).as_micros() as u64 + 1;
        // A later note may be stored first by another thread: keep the latest.
        self.at_us[index].fetch_max(us, Ordering::Relaxed);
    }

    /// Each peer's last time, in the links' order, into `into`.
    pub(crate) fn read(&self, into: &mut Vec<Option<Instant>>) {
        into.clear();
        into.extend(
            self.at_us
                .iter()
                .map(|at| match at.load(Ordering::Relaxed) {
                    0 => None,
                    us => Some(self.epoch + Duration::from_micros(us - 1)),
                }),
        );
    }
}

/// What every inbound connection checks its input against, and where it delivers.
pub(crate) struct Context {
    /// This member's node id: every message must be addressed to it.
    pub(crate) node_id: u64,
    /// The cluster's shard count.
    pub(crate) shards: u32,
    /// This member's cluster identity digest: a hello must carry it.
    pub(crate) identity: u64,
    /// The peers' node ids, in the links' order: a hello must name one.
    pub(crate) peers: Vec<u64>,
    /// When something last arrived from each peer (same order).
    pub(crate) heard: Arc<Heard>,
    /// Each peer's last known wire version (same order).
    pub(crate) versions: Arc<Versions>,
    /// The incarnations the peers said hello with: the peer thread's, which reads every hello
    /// (`None` on a core, which is handed connections whose hello was accepted).
    pub(crate) incarnations: Option<Incarnations>,
    /// The cores.
    pub(crate) cores: Cores,
    /// The time of this loop iteration.
    pub(crate) now: Instant,
    /// When the thread started (the throttle's clock counts from it).
    pub(crate) epoch: Instant,
    /// Lines about dropped invalid messages.
    pub(crate) invalid_log: Throttle,
    /// On a core: where snapshots go to be checked (on the peer thread: a snapshot's check
    /// restores it whole, too long for a core's loop), and the peer thread's waker.
    pub(crate) snapshots: Option<(Sender<Unchecked>, Arc<Waker>)>,
    /// Bytes one read takes at most: a core reads a large envelope over several passes (at most
    /// [`READS_PER_PASS`] times this per pass), so that no iteration copies a whole one.
    pub(crate) read_bytes_max: usize,
}

/// Wakes the peer thread (from a core: it has something to take).
pub(crate) fn wake_peer_thread(waker: &Waker) {
    if let Err(error) = waker.wake() {
        log::warn!("peer thread: cannot wake it: {error}");
    }
}

/// A snapshot a core read, for the peer thread to check and deliver: its sender and shard.
pub(crate) type Unchecked = (u64, u32, Message);

impl Context {
    /// The context of the peer thread, which reads whole envelopes at once and checks
    /// snapshots itself; a core that reads connections sets [`Context::snapshots`] and
    /// [`Context::read_bytes_max`] on it. `epoch` starts its clock.
    pub(crate) fn new(
        config: &PeerConfig,
        (heard, versions): (Arc<Heard>, Arc<Versions>),
        cores: Cores,
        epoch: Instant,
    ) -> Context {
        Context {
            node_id: config.node_id,
            shards: config.shards,
            identity: config.identity,
            peers: config.peers.iter().map(|&(id, _)| id).collect(),
            heard,
            versions,
            incarnations: None,
            cores,
            now: epoch,
            epoch,
            invalid_log: Throttle::default(),
            snapshots: None,
            read_bytes_max: usize::MAX,
        }
    }

    fn local(&self) -> Local<'_> {
        Local {
            shards: self.shards,
            node_id: self.node_id,
            identity: self.identity,
            peers: &self.peers,
        }
    }

    /// The reply with `verdict`, in `version`.
    fn reply(&self, verdict: Verdict, version: u8) -> [u8; frame::REPLY_BYTES] {
        let reply = Reply {
            version,
            verdict,
            shards: self.shards,
            node_id: self.node_id,
            identity: self.identity,
        };
        reply.encode()
    }

    /// Notes that `peer`'s hello in `version` was accepted.
    fn note_version(&self, peer: u64, version: u8) {
        if let Some(index) = self.peers.iter().position(|&id| id == peer) {
            self.versions.note(index, version);
        }
    }

    /// Notes that something arrived from `peer` now.
    fn note_heard(&mut self, peer: u64) {
        if let Some(index) = self.peers.iter().position(|&id| id == peer) {
            self.heard.note(index, self.now);
        }
    }

    /// Checks and delivers one envelope; `whole`: the same bytes as `envelope.message`, owned,
    /// when the envelope filled a buffer grown for it (parsed without a copy: its bytes fields
    /// share the buffer).
    fn deliver(
        &mut self,
        from: u64,
        envelope: Envelope<'_>,
        whole: Option<Bytes>,
        stats: &PeerStats,
    ) -> Result<(), Close> {
        if envelope.is_keepalive() {
            return Ok(());
        }
        let shard = envelope.shard;
        if shard >= self.shards {
            let reason = format!(
                "shard {shard} out of range (the cluster has {})",
                self.shards
            );
            return Err(Close::Refused(reason));
        }
        wire::check(envelope.message)
            .map_err(|error| Close::Refused(format!("shard {shard}: refused unparsed: {error}")))?;
        let parsed = match &whole {
            Some(bytes) => Message::parse_from_carllerche_bytes(bytes),
            None => Message::parse_from_bytes(envelope.message),
        };
        let message =
            parsed.map_err(|error| Close::Refused(format!("undecodable message: {error}")))?;
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
        if let Some((snapshots, peer_waker)) = &self.snapshots {
            if message.get_msg_type() == MessageType::MsgSnapshot {
                if snapshots.try_send((from, shard, message)).is_err() {
                    PeerStats::add(&stats.drops_inbound, 1);
                }
                wake_peer_thread(peer_waker);
                return Ok(());
            }
        }
        self.check_and_deliver(from, shard, message, stats);
        Ok(())
    }

    /// Checks what `message` (from `from`, for `shard`) carries for the shards, then hands it to
    /// its core; an invalid one is dropped, counted and logged (rate-limited).
    pub(crate) fn check_and_deliver(
        &mut self,
        from: u64,
        shard: u32,
        message: Message,
        stats: &PeerStats,
    ) {
        if let Err(invalid) = content::check(shard, self.shards, &message) {
            PeerStats::add(&stats.drops_invalid, 1);
            let now_us = self.now.saturating_duration_since(self.epoch).as_micros() as u64;
            if let Some(left_out) = self.invalid_log.allow(now_us) {
                let kind = message.get_msg_type();
                log::warn!(
                    "peer {from}: a {kind:?} for shard {shard} dropped: {invalid} ({left_out} \
                     more invalid messages dropped since the last such line)"
                );
            }
            return;
        }
        self.cores.deliver(shard, message, stats);
    }
}

/// One accepted connection.
pub(crate) struct Inbound {
    stream: PeerStream,
    /// On TLS, before the first read: the first bytes were peeked, and whether they were a
    /// plaintext hello's ([`frame::MAGIC`]).
    peeked: Option<bool>,
    addr: SocketAddr,
    generation: usize,
    buffer: Vec<u8>,
    filled: usize,
    peer: Option<u64>,
    /// The node a whole hello named, accepted or not.
    claimed: Option<u64>,
    hello_deadline: Instant,
}

impl Inbound {
    /// A connection accepted from `addr`, which must say hello by `hello_deadline`.
    pub(crate) fn new(
        stream: PeerStream,
        addr: SocketAddr,
        generation: usize,
        hello_deadline: Instant,
    ) -> Inbound {
        let buffer = vec![0; BUFFER_BYTES];
        Inbound {
            stream,
            peeked: None,
            addr,
            generation,
            buffer,
            filled: 0,
            peer: None,
            claimed: None,
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

    /// The node its hello named, even if the hello was refused.
    pub(crate) fn claimed(&self) -> Option<u64> {
        self.claimed
    }

    /// When it must have said hello, until it has.
    pub(crate) fn hello_deadline(&self) -> Option<Instant> {
        self.peer.is_none().then_some(self.hello_deadline)
    }

    /// The socket, to register and deregister.
    pub(crate) fn stream(&mut self) -> &mut PeerStream {
        &mut self.stream
    }

    /// On TLS, before rustls reads anything: whether the dialer's first bytes are a plaintext
    /// hello's (peeked, so rustls still reads them and answers with its alert).
    fn peek_plaintext(&mut self) {
        if self.peeked.is_some() || !self.stream.is_tls() {
            return;
        }
        let mut first = [0u8; frame::MAGIC.len()];
        match self.stream.tcp().peek(&mut first) {
            Ok(0) | Err(_) => {} // nothing yet (or an error the read will see)
            Ok(seen) => self.peeked = Some(first[..seen] == frame::MAGIC[..seen]),
        }
    }

    /// Closes the connection for a TLS reason: counted besides the refusal.
    fn tls_refused(stats: &PeerStats, reason: String) -> Close {
        PeerStats::add(&stats.tls_refusals, 1);
        Close::Refused(reason)
    }

    /// How a read's `error` closes the connection: gone (the socket's), or refused for TLS,
    /// saying why (a plaintext dialer, this member's certificate refused by the dialer, or the
    /// dialer's by this member).
    fn failed(&self, error: io::Error, stats: &PeerStats) -> Close {
        let reason = match tls_failure(&error) {
            None => return Close::Gone(error),
            Some(_) if self.peeked == Some(true) => "a plaintext peer connection: this member \
                has [cluster.tls], the dialer has not (every member must have it, or none)"
                .to_string(),
            Some(TlsFailure::ByPeer) => format!(
                "the dialer refused this member's certificate: {error} (is it signed by a CA in \
                 the dialer's cluster.tls.ca_file?)"
            ),
            Some(TlsFailure::ByThisMember) => format!(
                "{error} (is the dialer's certificate signed by a CA in cluster.tls.ca_file?)"
            ),
        };
        Inbound::tls_refused(stats, reason)
    }

    /// Reads and delivers until `WouldBlock` (`Ok(true)`) or [`READS_PER_PASS`] reads
    /// (`Ok(false)`: call again).
    pub(crate) fn read_pass(
        &mut self,
        context: &mut Context,
        stats: &PeerStats,
    ) -> Result<bool, Close> {
        for _ in 0..READS_PER_PASS {
            self.peek_plaintext();
            debug_assert!(self.filled < self.buffer.len(), "no room to read");
            let end = (self.buffer.len()).min(self.filled.saturating_add(context.read_bytes_max));
            match self.stream.read(&mut self.buffer[self.filled..end]) {
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
                Err(error) => return Err(self.failed(error, stats)),
            }
        }
        Ok(false)
    }

    /// Consumes the hello and every whole envelope in the buffer, then sizes it for the next.
    fn parse(&mut self, context: &mut Context, stats: &PeerStats) -> Result<(), Close> {
        let mut at = 0;
        let from = match self.peer {
            Some(from) => from,
            None => match self.hello(context, stats)? {
                Some((from, used)) => {
                    at = used;
                    from
                }
                None => return Ok(()),
            },
        };
        // Bytes arrived from it (a part of a large envelope counts: the peer is talking).
        context.note_heard(from);
        // Bounded: each pass consumes at least a header's bytes of what was read.
        while let Some((envelope, used)) = frame::decode(&self.buffer[at..self.filled])
            .map_err(|error| Close::Refused(error.to_string()))?
        {
            if at == 0 && used == self.filled && self.buffer.len() > BUFFER_BYTES {
                // A large envelope (a snapshot, usually) alone in the buffer grown for it: its
                // bytes are handed on as they are, not copied once more by the parse.
                let start = envelope.message.as_ptr() as usize - self.buffer.as_ptr() as usize;
                let (end, shard) = (start + envelope.message.len(), envelope.shard);
                let grown = std::mem::replace(&mut self.buffer, vec![0; BUFFER_BYTES]);
                self.filled = 0;
                let whole = Bytes::from(grown).slice(start..end);
                let envelope = Envelope {
                    shard,
                    message: &whole,
                };
                context.deliver(from, envelope, Some(whole.clone()), stats)?;
                return self.size_buffer();
            }
            context.deliver(from, envelope, None, stats)?;
            at += used;
        }
        self.buffer.copy_within(at..self.filled, 0);
        self.filled -= at;
        self.size_buffer()
    }

    /// Reads and answers the hello once it is whole: the node it names if accepted, and the
    /// bytes the hello took. Its incarnation is checked last, once the certificate (on TLS)
    /// named the member it claims: only then is a first one recorded.
    fn hello(
        &mut self,
        context: &mut Context,
        stats: &PeerStats,
    ) -> Result<Option<(u64, usize)>, Close> {
        // The reply in `version` (none to a stranger), then the close.
        let refuse =
            |stream: &mut PeerStream, context: &Context, error: frame::HelloError, version: u8| {
                if let Some(verdict) = error.verdict() {
                    // Best effort: the dialer learns why; the close follows anyway.
                    let _ = stream.write(&context.reply(verdict, version));
                }
                if error.is_tls() {
                    return Inbound::tls_refused(stats, error.to_string());
                }
                Close::Refused(error.to_string())
            };
        let hello = match Hello::decode(&self.buffer[..self.filled]) {
            Ok(None) => return Ok(None),
            Ok(Some(hello)) => hello,
            // A version this member does not speak: its newest, for the dialer to fall back to.
            Err(error) => return Err(refuse(&mut self.stream, context, error, frame::VERSION)),
        };
        self.claimed = Some(hello.from);
        if let Err(error) = hello.check(&context.local()) {
            return Err(refuse(&mut self.stream, context, error, hello.version));
        }
        if self.stream.is_tls() {
            // No reply: the dialer's certificate is not the member it says it is.
            check_member(self.stream.peer_certificate(), hello.from).map_err(|why| {
                Inbound::tls_refused(
                    stats,
                    format!("node {} claimed by a dialer: {why}", hello.from),
                )
            })?;
        }
        let Some(incarnations) = context.incarnations.as_mut() else {
            debug_assert!(false, "a hello read on a core");
            return Err(Close::Refused("a hello where none is read".to_string()));
        };
        match incarnations.admit(hello.from, hello.incarnation) {
            Ok(Ok(())) => {}
            Ok(Err(error)) => return Err(refuse(&mut self.stream, context, error, hello.version)),
            Err(error) => {
                let why = format!("node {}'s incarnation not recorded: {error}", hello.from);
                return Err(Close::Refused(why));
            }
        }
        let reply = context.reply(Verdict::Accepted, hello.version);
        match self.stream.write(&reply) {
            // On TLS, rustls must have written it whole too (nothing else is ever written).
            Ok(written) if written == reply.len() && !self.stream.wants_write() => {}
            Ok(written) => {
                let what = format!("the reply to the hello: {written} of {} bytes", reply.len());
                return Err(Close::Gone(io::Error::new(io::ErrorKind::WriteZero, what)));
            }
            Err(error) => return Err(Close::Gone(error)),
        }
        context.note_version(hello.from, hello.version);
        self.peer = Some(hello.from);
        Ok(Some((hello.from, hello.encoded_len())))
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
