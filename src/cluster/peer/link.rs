//! One outbound connection to one peer: connect, hello, reply, coalesced writes, keepalives,
//! reconnect.
//!
//! States: `Waiting` (the backoff's delay; at start, none) → `Connecting` (a non-blocking
//! connect in flight, bounded by the connect timeout) → `Connected` (the hello written, the
//! reply awaited within the reply timeout; once it accepts, the queue's bytes) → on any error
//! or refusal `Waiting` again. A link always tries to be connected, whether or not it has
//! something to send, so that a peer that came back is seen as soon as it is up. The queue (in
//! the link's [`Lane`], shared with the threads that send) survives every state: what was not
//! wholly written goes on the next connection.
//!
//! Only the reply to the hello is read ([`frame::REPLY_BYTES`], never more than it); any later
//! byte is a protocol error and closes the connection. With `[cluster.tls]` the connection is
//! TLS (`super::tls`): the hello is written into the session as soon as the connect completes
//! and leaves once the handshake is done; the handshake and the reply are read through the
//! lane (which owns the session) and must both be done within the reply timeout. A TLS failure
//! (the reader's certificate refused, or this member's by the reader: its alert) is a refusal,
//! logged with rustls's reason and a hint that every member must have `[cluster.tls]` or none.
//! A refusal is logged (rate-limited per link) with the reason the peer gave, and retried with
//! the backoff: a peer restarted with a fixed configuration is reconnected without a restart
//! here. The peer thread writes what the
//! senders left (the lane's [`LaneState::flush`]): writes stop at `WouldBlock` until the next
//! writable event. A connected link that wrote nothing for [`frame::KEEPALIVE_INTERVAL`] writes
//! a keepalive envelope.
//!
//! # Versions
//!
//! Each connection's hello is in this build's newest version, [`frame::VERSION`], unless the
//! previous connection was refused with [`frame::Verdict::Version`] naming another version this
//! build speaks ([`frame::Reply::fallback`]): then it is in that one, and dialed at once, not
//! after the backoff. So a reader of an earlier build, which refuses 5 naming its 4 (or its 3),
//! is spoken to in that from the next connection on; and after any connection ends, the next one
//! tries [`frame::VERSION`] again, so a peer upgraded meanwhile is spoken to in its newest (one
//! refused connection per reconnect to a peer that is still old, no more). That is the whole
//! rule; it also moves up when a peer refuses an older version naming a newer one. A second
//! such refusal in a row waits for the backoff like any refusal, so a peer that keeps naming
//! other versions cannot make this member redial in a loop. The version of an accepting reply
//! is noted as the peer's last known one (`super::versions`), and a change of what the peer
//! speaks is logged at info once, naming the member and both versions; a fallback is not
//! counted as a refusal.

use super::frame::{self, Hello, Reply, REPLY_BYTES};
use super::lane::{Control, Lane, LaneState};
use super::queue::{Backoff, Queue};
use super::status::LinkStatus;
use super::tls::{tls_failure, PeerStream, PeerTls, TlsFailure};
use super::versions::Versions;
use super::{PeerLimits, PeerStats};
use crate::logging::Throttle;
use crate::partition::cluster_stats::LinkState;
use mio::event::Event;
use mio::net::TcpStream;
use mio::{Interest, Registry, Token};
use std::io;
use std::net::SocketAddr;
use std::os::fd::AsFd;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// An established connection (its socket, registered with the peer thread's poll; the lane
/// holds a second handle to write with).
struct Connection {
    stream: TcpStream,
    since: Instant,
    reply: [u8; REPLY_BYTES],
    reply_read: usize,
    /// Until the reply accepts the hello, nothing but the hello is written.
    accepted: bool,
    reply_deadline: Instant,
}

enum State {
    Waiting {
        until: Instant,
    },
    Connecting {
        stream: TcpStream,
        deadline: Instant,
    },
    Connected(Box<Connection>),
}

/// Why a connection ended.
enum Failure {
    /// The socket failed or closed.
    Io(io::Error),
    /// The peer refused the hello (or its reply was not one): why, in words.
    Refused(String),
    /// The peer refused the hello's version, naming this other one, which this build speaks.
    Version(u8),
    /// This member refused the peer's TLS certificate (or its bytes were not TLS): why.
    Untrusted(String),
}

/// The connection to one peer, and its lane: the queue of what it has not sent yet.
pub(crate) struct Link {
    node_id: u64,
    addr: SocketAddr,
    token: Token,
    hello: Hello,
    lane: Arc<Lane>,
    state: State,
    status: LinkStatus,
    backoff: Backoff,
    connect_timeout: Duration,
    reply_timeout: Duration,
    backoff_max: Duration,
    epoch: Instant,
    refusals_log: Throttle,
    /// Every peer's last known version, and this peer's index among them.
    versions: (Arc<Versions>, usize),
    /// The version the peer was last found to speak (accepted or named in a refusal), for the
    /// log line when it changes; [`frame::VERSION`] at start.
    spoken: u8,
    /// The last connection ended in a fallback (the next refusal of a version waits).
    fell_back: bool,
    /// `[cluster.tls]`: every connection is TLS.
    tls: Option<PeerTls>,
}

impl Link {
    /// A link to `node_id` at `addr` saying `hello` (in [`frame::VERSION`]), with nothing
    /// queued, connecting at `now` (over TLS with `tls`); it notes the peer's version in
    /// `versions` at `index`.
    pub(crate) fn new(
        (node_id, addr): (u64, SocketAddr),
        (token, versions): (Token, (Arc<Versions>, usize)),
        (hello, tls): (Hello, Option<PeerTls>),
        limits: &PeerLimits,
        (seed, now): (u64, Instant),
    ) -> Link {
        Link {
            node_id,
            addr,
            token,
            hello,
            lane: Arc::new(Lane::new(
                node_id,
                Queue::new(limits.queue_messages_max, limits.queue_bytes_max),
                now,
            )),
            state: State::Waiting { until: now },
            status: LinkStatus {
                state: LinkState::Connecting,
                reason: String::new(),
                since: now,
            },
            backoff: Backoff::new(limits.backoff_min, limits.backoff_max, seed),
            connect_timeout: limits.connect_timeout,
            reply_timeout: limits.hello_timeout,
            backoff_max: limits.backoff_max,
            epoch: now,
            refusals_log: Throttle::default(),
            versions,
            spoken: frame::VERSION,
            fell_back: false,
            tls,
        }
    }

    /// The lane the senders write to.
    pub(crate) fn lane(&self) -> &Arc<Lane> {
        &self.lane
    }

    /// The link's state, why, and since when.
    pub(crate) fn status(&self) -> &LinkStatus {
        &self.status
    }

    /// Whether the link is connected and the peer accepted its hello.
    pub(crate) fn accepted(&self) -> bool {
        matches!(&self.state, State::Connected(connection) if connection.accepted)
    }

    /// When [`Link::on_timer`] next has something to do.
    pub(crate) fn deadline(&self) -> Option<Instant> {
        match &self.state {
            State::Waiting { until } => Some(*until),
            State::Connecting { deadline, .. } => Some(*deadline),
            State::Connected(connection) if !connection.accepted => Some(connection.reply_deadline),
            State::Connected(_) => {
                let lane = self.lane.lock();
                idle(&lane).then_some(lane.last_write + frame::KEEPALIVE_INTERVAL)
            }
        }
    }

    /// Whether a flush now would write (connected, writable, something to write), or must fail
    /// the link (a sender's write failed).
    pub(crate) fn wants_flush(&self) -> bool {
        let lane = self.lane.lock();
        lane.wants_flush() || lane.failed.is_some()
    }

    /// Connects when the backoff allows; gives up a connect or a reply that took too long;
    /// writes a keepalive on an idle connection.
    pub(crate) fn on_timer(&mut self, registry: &Registry, now: Instant, stats: &PeerStats) {
        match &mut self.state {
            State::Waiting { until } if *until <= now => self.connect(registry, now, stats),
            State::Connecting { deadline, .. } if *deadline <= now => {
                let error = io::Error::new(io::ErrorKind::TimedOut, "connect timed out");
                self.fail(registry, now, stats, Failure::Io(error));
            }
            State::Connected(connection)
                if !connection.accepted && connection.reply_deadline <= now =>
            {
                let what = match self.lane.lock().handshaking() {
                    true => format!("no TLS handshake within {:?}", self.reply_timeout),
                    false => format!("no reply to the hello within {:?}", self.reply_timeout),
                };
                let error = io::Error::new(io::ErrorKind::TimedOut, what);
                self.fail(registry, now, stats, Failure::Io(error));
            }
            State::Connected(connection) if connection.accepted => {
                let mut lane = self.lane.lock();
                if idle(&lane) && lane.last_write + frame::KEEPALIVE_INTERVAL <= now {
                    lane.control = Control::of(&frame::KEEPALIVE);
                }
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
            Err(error) => self.fail(registry, now, stats, Failure::Io(error)),
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
            State::Connecting { stream, .. } => match connect_outcome(stream) {
                Ok(true) => return self.connected(registry, now, stats),
                Ok(false) => Ok(()),
                Err(error) => Err(Failure::Io(error)),
            },
            State::Connected(connection) => {
                let mut lane = self.lane.lock();
                if event.is_writable() {
                    lane.blocked = false;
                }
                let before = connection.accepted;
                let result = read_reply(connection, &self.hello, &mut lane);
                let accepted = connection.accepted && !before;
                lane.accepted |= accepted;
                drop(lane);
                if accepted {
                    self.on_accepted();
                }
                result
            }
            State::Waiting { .. } => Ok(()), // a stale event
        };
        match outcome {
            Ok(()) => {
                if self.accepted() && self.status.state != LinkState::Connected {
                    self.status.set(LinkState::Connected, String::new(), now);
                    log::debug!("peer {}: {} accepted the hello", self.node_id, self.addr);
                }
            }
            Err(failure) => self.fail(registry, now, stats, failure),
        }
    }

    /// The peer accepted the hello: its version is the peer's last known one.
    fn on_accepted(&mut self) {
        let version = self.hello.version;
        let (versions, index) = &self.versions;
        versions.note(*index, version);
        self.fell_back = false;
        if version != self.spoken {
            log::info!(
                "peer {} ({}) accepted peer wire version {version} (it spoke {} before)",
                self.node_id,
                self.addr,
                self.spoken
            );
            self.spoken = version;
        }
    }

    /// The connect completed: the hello goes first, and the reply is awaited.
    fn connected(&mut self, registry: &Registry, now: Instant, stats: &PeerStats) {
        let State::Connecting { mut stream, .. } =
            std::mem::replace(&mut self.state, State::Waiting { until: now })
        else {
            unreachable!("connected runs only while connecting");
        };
        if let Err(error) = stream.set_nodelay(true) {
            log::warn!("peer {}: TCP_NODELAY not set: {error}", self.node_id);
        }
        // The lane's handle to the same socket (and its TLS session), for the threads that
        // send and for reading.
        let handle = stream.as_fd().try_clone_to_owned().and_then(|fd| {
            let tcp = TcpStream::from_std(std::net::TcpStream::from(fd));
            match &self.tls {
                None => Ok(PeerStream::Plain(tcp)),
                Some(tls) => Ok(PeerStream::Tls(Box::new(tls.dial(tcp, self.node_id)?))),
            }
        });
        let handle = match handle {
            Ok(handle) => handle,
            Err(error) => {
                let _ = registry.deregister(&mut stream);
                return self.fail(registry, now, stats, Failure::Io(error));
            }
        };
        log::debug!("peer {}: connected to {}", self.node_id, self.addr);
        PeerStats::add(&stats.connects, 1);
        self.lane.lock().connect(handle, &self.hello.encode(), now);
        self.state = State::Connected(Box::new(Connection {
            stream,
            since: now,
            reply: [0; REPLY_BYTES],
            reply_read: 0,
            accepted: false,
            reply_deadline: now + self.reply_timeout,
        }));
    }

    /// Writes what the senders left: the hello or a keepalive, then queued envelopes (once
    /// accepted), until the socket is full or nothing is left; fails the link if a write (its
    /// own or a sender's) failed.
    pub(crate) fn flush(&mut self, registry: &Registry, now: Instant, stats: &PeerStats) {
        if !matches!(self.state, State::Connected(_)) {
            return;
        }
        let result = {
            let mut lane = self.lane.lock();
            match lane.failed.take() {
                Some(error) => Err(error),
                None => lane.flush(now, stats),
            }
        };
        if let Err(error) = result {
            self.fail(registry, now, stats, Failure::Io(error));
        }
    }

    /// Closes the connection if any (at shutdown).
    pub(crate) fn close(&mut self, registry: &Registry) {
        let state = std::mem::replace(&mut self.state, State::Waiting { until: self.epoch });
        match state {
            State::Connecting { mut stream, .. } => {
                let _ = registry.deregister(&mut stream);
            }
            State::Connected(mut connection) => {
                let _ = registry.deregister(&mut connection.stream);
                self.lane.lock().disconnect();
            }
            State::Waiting { .. } => {}
        }
    }

    fn fail(&mut self, registry: &Registry, now: Instant, stats: &PeerStats, failure: Failure) {
        if let State::Connected(connection) = &self.state {
            // A connection that lived long was a success: the next failure starts afresh.
            let lived = now.saturating_duration_since(connection.since);
            if connection.accepted && lived >= self.backoff_max {
                self.backoff.reset();
            }
        }
        self.close(registry);
        PeerStats::add(&stats.disconnects, 1);
        // The next connection is in the newest version, but after a fallback (module docs).
        let refused_in = std::mem::replace(&mut self.hello.version, frame::VERSION);
        let fell_back = std::mem::take(&mut self.fell_back);
        if let Failure::Version(version) = failure {
            if !fell_back {
                return self.fall_back(refused_in, version, now);
            }
        }
        let delay = self.backoff.next_delay();
        match failure {
            Failure::Io(error) => {
                log::debug!(
                    "peer {} at {}: {error}; retry in {delay:?}",
                    self.node_id,
                    self.addr
                );
                self.status
                    .set(LinkState::Unreachable, error.to_string(), now);
            }
            Failure::Refused(reason) => self.refused(reason, now, stats),
            Failure::Untrusted(why) => self.untrusted(why, now, stats),
            Failure::Version(version) => {
                // Refused again right after a fallback: the next connection is in the version
                // named, but after the backoff, as after any refusal.
                (self.hello.version, self.fell_back) = (version, true);
                let why = format!(
                    "it does not speak peer wire version {refused_in} (it speaks {version})"
                );
                self.refused(why, now, stats);
            }
        }
        self.state = State::Waiting { until: now + delay };
    }

    /// The peer refused this member's connection for `reason`: counted, logged (rate-limited),
    /// shown.
    fn refused(&mut self, reason: String, now: Instant, stats: &PeerStats) {
        PeerStats::add(&stats.refused_by_peers, 1);
        let now_us = now.saturating_duration_since(self.epoch).as_micros() as u64;
        if let Some(left_out) = self.refusals_log.allow(now_us) {
            let more = match left_out {
                0 => String::new(),
                n => format!("; {n} more refusals since the last such line"),
            };
            log::warn!(
                "peer {} at {} refused this member's connection: {reason} (retrying with a \
                 backoff{more})",
                self.node_id,
                self.addr
            );
        }
        self.status.set(LinkState::Refused, reason, now);
    }

    /// This member refused the peer's TLS certificate for `why`: counted as a TLS refusal,
    /// logged (rate-limited, with the link's refusals), shown.
    fn untrusted(&mut self, why: String, now: Instant, stats: &PeerStats) {
        PeerStats::add(&stats.tls_refusals, 1);
        let now_us = now.saturating_duration_since(self.epoch).as_micros() as u64;
        if let Some(left_out) = self.refusals_log.allow(now_us) {
            log::warn!(
                "peer {} at {}: this member refused its TLS certificate: {why} (retrying with \
                 a backoff; {left_out} more refusals since the last such line)",
                self.node_id,
                self.addr
            );
        }
        let reason = format!("this member refused its TLS certificate: {why}");
        self.status.set(LinkState::Refused, reason, now);
    }

    /// The peer refused version `refused_in`, naming `version`, which this build speaks: the
    /// next connection is in `version`, at once (logged at info when what the peer speaks
    /// changed).
    fn fall_back(&mut self, refused_in: u8, version: u8, now: Instant) {
        let (id, addr) = (self.node_id, self.addr);
        if version != self.spoken {
            log::info!(
                "peer {id} ({addr}) speaks peer wire version {version}, not {refused_in}: \
                 dialing it again in {version}"
            );
            self.spoken = version;
        } else {
            log::debug!("peer {id} ({addr}) refused version {refused_in}: dialing in {version}");
        }
        (self.hello.version, self.fell_back) = (version, true);
        self.state = State::Waiting { until: now };
    }
}

/// Whether a connected lane has nothing to write: time for a keepalive once it has written
/// nothing for [`frame::KEEPALIVE_INTERVAL`].
fn idle(lane: &LaneState) -> bool {
    lane.control.unwritten().is_empty() && lane.queue.messages() == 0
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

/// Reads what the peer sent through the lane (which owns the socket handle and any TLS
/// session): its reply to the hello (never more than it), then nothing — a close or any byte
/// after the reply is an error.
fn read_reply(
    connection: &mut Connection,
    hello: &Hello,
    lane: &mut LaneState,
) -> Result<(), Failure> {
    let mut scratch = [0u8; 64];
    let tls = lane.is_tls();
    // Bounded: every pass but an interrupted one returns or reads a byte of the reply.
    for _ in 0..REPLY_BYTES + 16 {
        let into = match connection.accepted {
            true => &mut scratch[..],
            false => &mut connection.reply[connection.reply_read..],
        };
        match lane.read(into) {
            Ok(0) if connection.accepted => {
                let error = io::Error::new(io::ErrorKind::UnexpectedEof, "closed by peer");
                return Err(Failure::Io(error));
            }
            Ok(0) => return Err(closed_before_reply(tls)),
            Ok(read) if connection.accepted => {
                let what = format!("peer wrote {read} bytes after its reply");
                return Err(Failure::Io(io::Error::new(
                    io::ErrorKind::InvalidData,
                    what,
                )));
            }
            Ok(read) => {
                connection.reply_read += read;
                match Reply::decode(&connection.reply[..connection.reply_read]) {
                    Ok(None) => {}
                    Ok(Some(reply)) => {
                        if let Some(version) = reply.fallback(hello) {
                            return Err(Failure::Version(version));
                        }
                        match reply.refusal(hello) {
                            None => connection.accepted = true,
                            Some(reason) => return Err(Failure::Refused(reason)),
                        }
                    }
                    Err(error) => return Err(Failure::Refused(error.to_string())),
                }
            }
            Err(error) if error.kind() == io::ErrorKind::WouldBlock => return Ok(()),
            Err(error) if error.kind() == io::ErrorKind::Interrupted => continue,
            Err(error) => match tls_failure(&error) {
                None => return Err(Failure::Io(error)),
                Some(TlsFailure::ByPeer) => {
                    let why = format!(
                        "{error}: it refused this member's certificate (is it signed by a CA in \
                         the peer's cluster.tls.ca_file?)"
                    );
                    return Err(Failure::Refused(why));
                }
                Some(TlsFailure::ByThisMember) => {
                    let why = format!(
                        "{error} (is its certificate signed by a CA in this member's \
                         cluster.tls.ca_file, naming the member dialed? every member must have \
                         [cluster.tls], or none)"
                    );
                    return Err(Failure::Untrusted(why));
                }
            },
        }
    }
    Ok(())
}

/// The peer closed the connection before its reply: on TLS, it refused the handshake or this
/// member's certificate, or does not speak TLS.
fn closed_before_reply(tls: bool) -> Failure {
    if tls {
        let what = "closed by peer before it replied to the hello: has it [cluster.tls] (every \
                    member must, or none), and does its cluster.tls.ca_file trust this member's \
                    certificate, which must name this member?";
        return Failure::Refused(what.to_string());
    }
    let what = "closed by peer before it replied to the hello (not a latchkey peer of this \
                version, or one with [cluster.tls]? every member must have it, or none)";
    Failure::Io(io::Error::new(io::ErrorKind::UnexpectedEof, what))
}
