//! The peer thread's mio loop.
//!
//! One iteration: poll (timeout: the next backoff, connect, reply, keepalive, hello or
//! reachability deadline, zero if work was cut short, at most [`POLL_TIMEOUT_MAX`]) → handle
//! events (accept, connect completions, replies, reads delivered to cores; a hello accepted
//! hands its connection to its core when the cores read) → continue passes cut short last
//! time → the cores' refusals and snapshots (checked here, delivered) → timers (connect,
//! reconnect, keepalives, give up connects, replies and hellos) → flush every link the
//! senders left bytes in (or whose write failed) → wake each core delivered to, once → decide
//! who is reachable, log what changed, publish ([`super::status`]).
//! Outgoing messages do not pass through this loop: their senders write them ([`super::lane`]).
//!
//! Tokens: the waker, the listener, one per link (its index; a link's socket changes but a
//! stale event finds it waiting and is ignored), and one per inbound connection carrying its
//! slab key and a generation, so a reused slot is never confused with its predecessor.

use super::frame::{self, Hello};
use super::inbound::{Close, Context, Cores, Heard, Inbound, Route};
use super::incarnations::Incarnations;
use super::lane::Lane;
use super::link::Link;
use super::reader::Handover;
use super::status::{Board, Watch, PUBLISH_EVERY};
use super::tls::{PeerStream, PeerTls};
use super::versions::Versions;
use super::{CoreInbox, PeerConfig, PeerLimits, PeerStats, PEERS_MAX};
use crate::logging::{Throttle, LOG_PERIOD_US};
use mio::event::Event;
use mio::net::{TcpListener, TcpStream};
use mio::{Events, Interest, Poll, Token, Waker};
use slab::Slab;
use std::io;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

const WAKER: Token = Token(0);
const LISTENER: Token = Token(1);
const LINK_BASE: usize = 2;
const INBOUND_BASE: usize = LINK_BASE + PEERS_MAX;
/// Events per poll, at most.
const EVENTS_MAX: usize = 1024;
/// Connections accepted per readiness pass of the listener, at most.
const ACCEPTS_PER_PASS: usize = 64;
/// The longest poll: the stop flag is also seen by its waker, this is only a backstop.
pub(crate) const POLL_TIMEOUT_MAX: Duration = Duration::from_secs(1);

/// The peer thread's state; see the module docs.
pub(crate) struct Peer {
    poll: Poll,
    waker: Arc<Waker>,
    listener: TcpListener,
    links: Vec<Link>,
    connections: Slab<Inbound>,
    generation: usize,
    generations: usize,
    context: Context,
    stats: Arc<PeerStats>,
    stop: Arc<AtomicBool>,
    limits: PeerLimits,
    again: Vec<Token>,
    started: Instant,
    refusals_log: Throttle,
    /// Refusals of hellos that name a peer, one throttle per peer (links' order), so that a
    /// stranger's flood never hides a misconfigured member.
    peer_refusals_log: Vec<Throttle>,
    watch: Watch,
    board: Arc<parking_lot::Mutex<Board>>,
    /// When connections are read on the cores: where accepted ones go.
    handover: Option<Handover>,
    /// The heard-from times as last read, for the watch.
    heard: Vec<Option<Instant>>,
    /// `[cluster.tls]`: every accepted connection is TLS.
    tls: Option<PeerTls>,
}

impl Peer {
    /// Binds the listener and registers it; the loop starts in [`Peer::run`].
    pub(crate) fn new(
        config: PeerConfig,
        (inbound, route): (Vec<CoreInbox>, Route),
        (heard, handover): (Arc<Heard>, Option<Handover>),
        stats: &Arc<PeerStats>,
        stop: &Arc<AtomicBool>,
        board: &Arc<parking_lot::Mutex<Board>>,
    ) -> io::Result<Peer> {
        let poll = Poll::new()?;
        let waker = Arc::new(Waker::new(poll.registry(), WAKER)?);
        let mut listener = TcpListener::bind(config.listen)?;
        poll.registry()
            .register(&mut listener, LISTENER, Interest::READABLE)?;
        let now = Instant::now();
        let versions = Arc::new(Versions::new(config.peers.len()));
        let links = (config.peers.iter().enumerate())
            .map(|(index, &peer)| {
                let hello = Hello {
                    version: frame::VERSION,
                    shards: config.shards,
                    from: config.node_id,
                    to: peer.0,
                    identity: config.identity,
                    incarnation: config.incarnation,
                };
                let seed = config.seed ^ (index as u64 + 1).wrapping_mul(0x9e37_79b9_7f4a_7c15);
                let token = Token(LINK_BASE + index);
                let known = (Arc::clone(&versions), index);
                let tls = config.tls.clone();
                Link::new(
                    peer,
                    (token, known),
                    (hello, tls),
                    &config.limits,
                    (seed, now),
                )
            })
            .collect();
        let connections_max = config.limits.inbound_connections_max.max(1);
        let cores = Cores::new(inbound, route, None);
        let mut context = Context::new(&config, (heard, versions), cores, now);
        context.incarnations = Some(match &config.peers_file {
            Some(file) => Incarnations::load(file)?,
            None => Incarnations::in_memory(),
        });
        let period = Duration::from_micros(LOG_PERIOD_US);
        let mut watch = Watch::new(&config.peers, now, period);
        watch.own_incarnation(config.incarnation);
        if let Some(known) = &context.incarnations {
            watch.known_incarnations(|peer| known.of(peer));
        }
        // Published before any core can ask: the members and every peer "connecting".
        watch.publish(&mut board.lock());
        Ok(Peer {
            poll,
            waker,
            listener,
            links,
            connections: Slab::with_capacity(connections_max),
            generation: 0,
            generations: (usize::MAX - INBOUND_BASE) / connections_max,
            context,
            stats: Arc::clone(stats),
            stop: Arc::clone(stop),
            limits: config.limits,
            again: Vec::with_capacity(connections_max + 1),
            started: now,
            refusals_log: Throttle::default(),
            peer_refusals_log: vec![Throttle::default(); config.peers.len()],
            watch,
            board: Arc::clone(board),
            handover,
            heard: Vec::with_capacity(config.peers.len()),
            tls: config.tls,
        })
    }

    /// The links' lanes, in the links' order, for the senders' handles.
    pub(crate) fn lanes(&self) -> Arc<[Arc<Lane>]> {
        self.links
            .iter()
            .map(|link| Arc::clone(link.lane()))
            .collect()
    }

    /// The waker the cores' handles use.
    pub(crate) fn waker(&self) -> Arc<Waker> {
        Arc::clone(&self.waker)
    }

    /// Each peer's last known wire version, for the handles.
    pub(crate) fn versions(&self) -> Arc<Versions> {
        Arc::clone(&self.context.versions)
    }

    /// The address listened on.
    pub(crate) fn local_addr(&self) -> io::Result<SocketAddr> {
        self.listener.local_addr()
    }

    /// The loop, until the stop flag is set (or poll fails).
    pub(crate) fn run(mut self) {
        let mut events = Events::with_capacity(EVENTS_MAX);
        loop {
            let timeout = self.timeout(Instant::now());
            if let Err(error) = self.poll.poll(&mut events, Some(timeout)) {
                if error.kind() == io::ErrorKind::Interrupted {
                    continue;
                }
                log::error!("peer thread: poll failed, stopping: {error}");
                break;
            }
            if self.stop.load(Ordering::Acquire) {
                break;
            }
            let now = Instant::now();
            self.context.now = now;
            for event in events.iter() {
                self.on_event(event, now);
            }
            for token in std::mem::take(&mut self.again) {
                self.on_ready(token, now);
            }
            self.take_from_cores(now);
            self.on_timers(now);
            let registry = self.poll.registry();
            for link in self.links.iter_mut().filter(|link| link.wants_flush()) {
                link.flush(registry, now, &self.stats);
            }
            self.context.cores.wake();
            self.update_gauges();
            let links = self
                .links
                .iter()
                .map(|link| (link.status(), link.accepted()));
            self.context.heard.read(&mut self.heard);
            self.watch.update(links, &self.heard, now, &self.board);
        }
        self.shut_down();
    }

    fn timeout(&self, now: Instant) -> Duration {
        let busy = !self.again.is_empty();
        if busy || self.links.iter().any(Link::wants_flush) {
            return Duration::ZERO;
        }
        let links = self.links.iter().filter_map(Link::deadline);
        let hellos = self
            .connections
            .iter()
            .filter_map(|(_, inbound)| inbound.hello_deadline());
        let watch = self.watch.deadline();
        let next = (links.chain(hellos).chain(watch))
            .min()
            .unwrap_or(now + POLL_TIMEOUT_MAX);
        // The cores note what they hear without waking this thread: look often enough to
        // publish it as fresh as when this thread read everything.
        let longest = match self.handover {
            Some(_) => PUBLISH_EVERY,
            None => POLL_TIMEOUT_MAX,
        };
        next.saturating_duration_since(now).min(longest)
    }

    fn on_event(&mut self, event: &Event, now: Instant) {
        match event.token() {
            WAKER => {} // a stop, or a lane to flush: every iteration looks
            Token(index) if (LINK_BASE..INBOUND_BASE).contains(&index) => {
                if let Some(link) = self.links.get_mut(index - LINK_BASE) {
                    link.on_event(self.poll.registry(), event, now, &self.stats);
                }
            }
            token => self.on_ready(token, now),
        }
    }

    /// The listener or an inbound connection is readable (or was cut short last time).
    fn on_ready(&mut self, token: Token, now: Instant) {
        if token == LISTENER {
            return self.accept(now);
        }
        let Some(offset) = token.0.checked_sub(INBOUND_BASE) else {
            return;
        };
        let capacity = self.limits.inbound_connections_max.max(1);
        let (key, generation) = (offset % capacity, offset / capacity);
        let Some(inbound) = self.connections.get_mut(key) else {
            return;
        };
        if inbound.generation() != generation {
            return; // the slot's previous connection
        }
        let before = inbound.peer();
        let result = inbound.read_pass(&mut self.context, &self.stats);
        let hello = if before.is_none() {
            inbound.peer()
        } else {
            None
        };
        if hello.is_some() {
            PeerStats::add(&self.stats.accepts, 1);
        }
        match result {
            Ok(true) => {}
            Ok(false) => self.again.push(token),
            Err(close) => return self.close(key, close, now),
        }
        if let Some(node_id) = hello {
            self.on_hello(key, node_id, now);
            self.hand_over(key, node_id);
        }
    }

    /// Gives an accepted connection to its core, when the cores read their connections.
    fn hand_over(&mut self, key: usize, node_id: u64) {
        let Some(handover) = &self.handover else {
            return;
        };
        let Some(index) = self.context.peers.iter().position(|&id| id == node_id) else {
            return;
        };
        let mut inbound = self.connections.remove(key);
        let _ = self.poll.registry().deregister(inbound.stream());
        let addr = inbound.addr();
        match handover.give(index, inbound) {
            Some(core) => self.context.cores.wake_core(core),
            None => log::warn!("peer {node_id} connection from {addr} dropped: no core takes it"),
        }
    }

    /// Counts and logs the connections the cores refused; checks and delivers the snapshots
    /// they read.
    fn take_from_cores(&mut self, now: Instant) {
        let Some(handover) = &self.handover else {
            return;
        };
        let refusals: Vec<_> = handover.refusals.try_iter().collect();
        // Bounded: the channel holds at most SOURCES snapshots.
        let snapshots: Vec<_> = handover.snapshots.try_iter().collect();
        for refusal in refusals {
            self.log_refusal(refusal.addr, refusal.claimed, &refusal.reason, now);
        }
        for (from, shard, message) in snapshots {
            self.context
                .check_and_deliver(from, shard, message, &self.stats);
        }
    }

    /// A connection from `node_id` said hello: it replaces any older one from that node.
    fn on_hello(&mut self, key: usize, node_id: u64, now: Instant) {
        let older: Vec<usize> = (self.connections.iter())
            .filter(|&(other, inbound)| other != key && inbound.peer() == Some(node_id))
            .map(|(other, _)| other)
            .collect();
        for other in older {
            let replaced = io::Error::other("replaced by a newer connection from the same node");
            self.close(other, Close::Gone(replaced), now);
        }
        if let Some(index) = self.context.peers.iter().position(|&id| id == node_id) {
            self.watch.accepted_inbound(index);
        }
        if let Some(known) = &self.context.incarnations {
            self.watch.known_incarnations(|peer| known.of(peer));
        }
        log::debug!(
            "peer {node_id} connected from {}",
            self.connections[key].addr()
        );
    }

    fn accept(&mut self, now: Instant) {
        for _ in 0..ACCEPTS_PER_PASS {
            match self.listener.accept() {
                Ok((stream, addr)) => self.admit(stream, addr, now),
                Err(error) if error.kind() == io::ErrorKind::WouldBlock => return,
                Err(error) if error.kind() == io::ErrorKind::Interrupted => continue,
                Err(error) => {
                    // EMFILE and the like: the next connection's event retries.
                    log::warn!("peer thread: accept failed: {error}");
                    return;
                }
            }
        }
        self.again.push(LISTENER);
    }

    fn admit(&mut self, mut stream: TcpStream, addr: SocketAddr, now: Instant) {
        let capacity = self.limits.inbound_connections_max.max(1);
        if self.connections.len() >= capacity {
            let reason = format!("{capacity} connections already");
            self.log_refusal(addr, None, &reason, now);
            return;
        }
        let entry = self.connections.vacant_entry();
        let token = Token(INBOUND_BASE + self.generation * capacity + entry.key());
        if let Err(error) = self
            .poll
            .registry()
            .register(&mut stream, token, Interest::READABLE)
        {
            log::warn!("peer connection from {addr} dropped: cannot register: {error}");
            return;
        }
        let stream = match &self.tls {
            None => PeerStream::Plain(stream),
            Some(tls) => match tls.accept(stream) {
                Ok(tls) => PeerStream::Tls(Box::new(tls)),
                Err(error) => {
                    log::warn!("peer connection from {addr} dropped: no TLS session: {error}");
                    return;
                }
            },
        };
        // The deadline bounds the TLS handshake too: a silent dialer cannot hold a slot.
        let deadline = now + self.limits.hello_timeout;
        entry.insert(Inbound::new(stream, addr, self.generation, deadline));
        self.generation = (self.generation + 1) % self.generations;
        // A connection may have sent its bytes before the registration: read now.
        self.again.push(token);
    }

    fn close(&mut self, key: usize, close: Close, now: Instant) {
        let mut inbound = self.connections.remove(key);
        let _ = self.poll.registry().deregister(inbound.stream());
        let (addr, claimed) = (inbound.addr(), inbound.claimed());
        match close {
            Close::Gone(error) => {
                log::debug!("peer {claimed:?} connection from {addr} closed: {error}")
            }
            Close::Refused(reason) => {
                self.log_refusal(addr, claimed, &reason, now);
            }
        }
    }

    /// Counts a refusal and logs it, at most one line per [`LOG_PERIOD_US`] for strangers and
    /// one per peer the hello named (saying how many were left out), so that a stream of hostile
    /// connections never floods the log nor hides a misconfigured member.
    fn log_refusal(&mut self, addr: SocketAddr, claimed: Option<u64>, reason: &str, now: Instant) {
        PeerStats::add(&self.stats.refusals, 1);
        let now_us = now.saturating_duration_since(self.started).as_micros() as u64;
        let index = claimed.and_then(|id| self.context.peers.iter().position(|&p| p == id));
        if let Some(index) = index {
            self.watch.refused_inbound(index, reason);
        }
        let throttle = match index {
            Some(index) => &mut self.peer_refusals_log[index],
            None => &mut self.refusals_log,
        };
        if let Some(suppressed) = throttle.allow(now_us) {
            let node = claimed.map_or(String::new(), |id| format!(" (node {id})"));
            log::warn!(
                "peer connection from {addr}{node} refused: {reason} \
                 ({suppressed} more refused since the last such line)"
            );
        }
    }

    fn on_timers(&mut self, now: Instant) {
        let registry = self.poll.registry();
        for link in &mut self.links {
            link.on_timer(registry, now, &self.stats);
        }
        let is_late = |inbound: &Inbound| inbound.hello_deadline().is_some_and(|at| at <= now);
        if !self.connections.iter().any(|(_, inbound)| is_late(inbound)) {
            return;
        }
        let late: Vec<usize> = (self.connections.iter())
            .filter(|(_, inbound)| is_late(inbound))
            .map(|(key, _)| key)
            .collect();
        for key in late {
            let reason = format!("no hello within {:?}", self.limits.hello_timeout);
            self.close(key, Close::Refused(reason), now);
        }
    }

    fn update_gauges(&self) {
        let (mut messages, mut bytes) = (0, 0);
        for link in &self.links {
            let lane = link.lane().lock();
            messages += lane.queue.messages() as u64;
            bytes += lane.queue.bytes() as u64;
        }
        self.stats
            .queued_messages
            .store(messages, Ordering::Relaxed);
        self.stats.queued_bytes.store(bytes, Ordering::Relaxed);
        PeerStats::add(&self.stats.iterations, 1);
    }

    fn shut_down(&mut self) {
        let registry = self.poll.registry();
        for link in &mut self.links {
            link.close(registry);
        }
        for (_, inbound) in self.connections.iter_mut() {
            let _ = registry.deregister(inbound.stream());
        }
        self.connections.clear();
        let _ = registry.deregister(&mut self.listener);
        log::debug!("peer thread stopped");
    }
}
