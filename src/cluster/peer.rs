//! The peer transport: raft messages between members over TCP, on one mio thread per member.
//!
//! A member runs one *peer thread* that dials the other members and listens on the member's
//! `peer` address. In a server ([`spawn_with_readers`]) it checks each accepted connection's
//! hello and then hands the connection to one core, which reads it on its own loop
//! (`reader.rs`): a message for that core's shards is stepped in the iteration that read it,
//! with no thread between the socket and raft; one for another core's shards goes on that
//! core's channel and wakes its `mio::Waker`, and a snapshot goes back to the peer thread to be
//! checked (a whole restore, too long for a core's loop). With `spawn` (tests) the peer thread
//! reads every connection itself and hands each message to its core's channel. Outgoing messages
//! are written by the thread that sends them ([`PeerHandle::send_batch`]: a core, or a log
//! writer after its sync) straight to the peer's connection, under the lock of the peer's
//! *lane* (`lane.rs`), and left queued there for the peer thread when the socket is full or not
//! connected; so a message leaves without waiting for the peer thread to wake up.
//!
//! Raft messages flow one way on a connection. A member keeps one connection to each other
//! member (its *link*: connected at start, and again after every failure, with a jittered
//! backoff from 50 ms doubling to 1 s by default). It writes a hello naming itself, the member
//! it meant to reach and the cluster's identity ([`frame`]); the reader checks it and replies
//! (accepted, or refused and why), so a misconfigured member is refused and logged on both
//! sides, and retried (a fixed configuration heals without a restart here). Once accepted, the
//! link writes envelopes, and a keepalive when it has nothing else to write. Each peer has a
//! bounded queue of encoded envelopes; when it is full the newest message is dropped and
//! counted (raft tolerates loss and retries).
//!
//! Each peer's state (connected, refused and why, unreachable and why, since when), whether it
//! is reachable and whether this member has a quorum are published ([`PeerHandle::report`]) and
//! logged when they change ([`status`]).
//!
//! Members of two builds form a group when their wire versions overlap ([`frame`], "Versions"):
//! a reader accepts a hello in any version it speaks and replies in it; a link dials in this
//! build's newest version and, refused by a reader of an older build that names its own
//! version, dials again in that one at once (`link.rs`). Each peer's *last known version* (the
//! version it was last heard from in, kept while it is down) and the *cluster version* (the
//! lowest version any member speaks: [`PeerHandle::cluster_version`], lock-free) are kept in
//! `versions.rs` and shown in the report, so a leader proposes what every member can apply
//! and an operator sees which member holds the cluster version down.
//!
//! Invariants (checked in debug builds): a queue's bounds ([`PeerLimits`]) hold after every push;
//! at most one connection per peer each way (a second hello from a node replaces its first
//! connection); each inbound connection's buffer holds at most one envelope's bytes beyond what
//! it has parsed ([`frame::FRAME_BYTES_MAX`]).
//!
//! Hostile or broken input (wrong magic, version, shard count or identity, an unknown node id or
//! recipient, an oversized envelope, a message whose protobuf shape is refused ([`wire`]: the
//! guard against RUSTSEC-2024-0437) or that does not parse, a message for a shard out of range
//! or not from the node that said hello) closes that one connection and counts a refusal, with a
//! `warn!` line naming the address and the reason (at most one line per 10 s per peer the hello
//! named, and one for strangers, counting those left out). A well-formed message whose entries
//! or snapshot do not decode for the shard machine is dropped and counted ([`content`]). No
//! input from the peer port panics. Deliberately not here: fault injection (tests put a proxy
//! in front), and acknowledgements (raft has its own).
//!
//! With `[cluster.tls]` ([`tls`]) every connection is mutual TLS under the hello (the frames and
//! versions do not change): each member presents a certificate naming it (`member-N`), a dialer
//! checks the reader's for the member it dialed, a reader checks the dialer's for the member its
//! hello claims. The dialer's rustls session lives in its lane with the socket, so the threads
//! that send and the peer thread (handshake, reply) use it under one lock; a handshake and its
//! hello must finish within [`PeerLimits::hello_timeout`]. A member with it and one without
//! refuse each other, each saying so; TLS refusals are counted in `tls_refusals`.
//!
//! | file | responsibility |
//! |---|---|
//! | `peer/frame.rs` | [`frame`]: hello, reply and envelope encode/decode. No I/O |
//! | `peer/wire.rs` | [`wire`]: a message's protobuf shape checked before it is parsed. No I/O |
//! | `peer/content.rs` | [`content`]: entries and snapshots checked for the shards. No I/O |
//! | `peer/queue.rs` | one peer's outbound queue of envelopes, the reconnect backoff. No I/O |
//! | `peer/lane.rs` | one peer's queue and socket, shared by the threads that send to it |
//! | `peer/link.rs` | one outbound connection: hello, reply, writes, keepalives, reconnect |
//! | `peer/inbound.rs` | one inbound connection: hello answered, envelopes read, dispatch |
//! | `peer/reader.rs` | a core's inbound connections, read on the core's loop |
//! | `peer/status.rs` | [`status`]: links, reachability and quorum: published and logged |
//! | `peer/versions.rs` | each peer's last known wire version, the cluster version. No I/O |
//! | `peer/tls.rs` | [`tls`]: `[cluster.tls]`'s configurations, the `member-N` rule, the stream |
//! | `peer/thread.rs` | the peer thread's mio loop |

pub mod content;
pub mod frame;
mod inbound;
pub mod incarnations;
mod lane;
mod link;
mod queue;
mod reader;
pub mod status;
mod thread;
pub mod tls;
mod versions;
pub mod wire;

pub use reader::{CorePoll, CoreReader, SOURCES};

use crossbeam_channel::Sender;
use raft::eraftpb::Message;
use std::io;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use crate::partition::cluster_stats::PeerReport;

/// The most other members a member may have (peers are looked up by a scan).
pub const PEERS_MAX: usize = 64;

/// Bounds and timings of the peer thread; [`Default`] gives the production values.
#[derive(Clone, Debug)]
pub struct PeerLimits {
    /// Messages waiting for one peer, at most (default 100,000).
    pub queue_messages_max: usize,
    /// Envelope bytes waiting for one peer, at most (default 64 MiB). The buffer holding them
    /// may reach about twice this before it compacts.
    pub queue_bytes_max: usize,
    /// Inbound connections at once, at most (default 64); more are closed at accept.
    pub inbound_connections_max: usize,
    /// An inbound connection must complete its hello (and its TLS handshake before it) within
    /// this, and a peer must reply to this member's hello (and finish the handshake) within it
    /// (default 5 s).
    pub hello_timeout: Duration,
    /// An outbound connect must complete within this (default 2 s).
    pub connect_timeout: Duration,
    /// The first reconnect delay (default 50 ms); it doubles after each failure.
    pub backoff_min: Duration,
    /// The largest reconnect delay (default 1 s).
    pub backoff_max: Duration,
}

impl Default for PeerLimits {
    fn default() -> PeerLimits {
        PeerLimits {
            queue_messages_max: 100_000,
            queue_bytes_max: 64 << 20,
            inbound_connections_max: 64,
            hello_timeout: Duration::from_secs(5),
            connect_timeout: Duration::from_secs(2),
            backoff_min: Duration::from_millis(50),
            backoff_max: Duration::from_secs(1),
        }
    }
}

/// What a member's peer thread needs to know.
#[derive(Clone, Debug)]
pub struct PeerConfig {
    /// This member's node id (raft's, never 0).
    pub node_id: u64,
    /// The member's `peer` address, listened on.
    pub listen: SocketAddr,
    /// The other members' node ids and `peer` addresses (an entry for `node_id` is ignored).
    pub peers: Vec<(u64, SocketAddr)>,
    /// The cluster's shard count, the same on every member.
    pub shards: u32,
    /// The cluster's identity digest ([`crate::config::ClusterIdentity`]), the same on every
    /// member: a hello with another one is refused.
    pub identity: u64,
    /// Seeds the reconnect jitter.
    pub seed: u64,
    /// Bounds and timings.
    pub limits: PeerLimits,
    /// `[cluster.tls]`, read and checked ([`tls::PeerTls::load`]): every connection is TLS
    /// both ways; `None`: plaintext.
    pub tls: Option<tls::PeerTls>,
    /// This member's data-directory incarnation, which its hellos carry (never 0).
    pub incarnation: u64,
    /// Where this member keeps the incarnations its peers said hello with
    /// ([`incarnations::Incarnations::load`]); `None`: in memory only.
    pub peers_file: Option<std::path::PathBuf>,
}

/// One core's inbox as the peer thread sees it: the channel it delivers `(shard, message)` on
/// (bounded by its creator; full means the message is dropped and counted), and the waker it
/// wakes once per loop iteration in which it delivered something.
pub type CoreInbox = (Sender<(u32, Message)>, Arc<mio::Waker>);

/// One message for the peer thread to send.
#[derive(Clone, Debug)]
pub struct Outgoing {
    /// The member to send it to.
    pub to: u64,
    /// The shard (raft group) it belongs to.
    pub shard: u32,
    /// The raft message.
    pub message: Message,
}

/// The peer thread's counters: plain atomics, read at any time (relaxed; totals, not a snapshot).
#[derive(Debug, Default)]
pub struct PeerStats {
    /// Messages wholly written to a peer's socket.
    pub messages_sent: AtomicU64,
    /// Envelope bytes wholly written to a peer's socket.
    pub bytes_sent: AtomicU64,
    /// Messages received and decoded: handed to their core, or counted in `drops_inbound` or
    /// `drops_invalid`.
    pub messages_received: AtomicU64,
    /// Envelope bytes received and decoded.
    pub bytes_received: AtomicU64,
    /// Messages dropped because the peer thread had stopped.
    pub drops_stopped: AtomicU64,
    /// Messages dropped because the peer's queue was full, or the peer unknown.
    pub drops_queue: AtomicU64,
    /// Messages dropped because they cannot be encoded (larger than an envelope may be).
    pub drops_oversized: AtomicU64,
    /// Messages received but dropped because the core's channel was full or closed.
    pub drops_inbound: AtomicU64,
    /// Outbound connections established.
    pub connects: AtomicU64,
    /// Outbound connections lost or failed to connect.
    pub disconnects: AtomicU64,
    /// Inbound connections whose hello was accepted.
    pub accepts: AtomicU64,
    /// Inbound connections refused: bad hello, bad envelope, hello timeout, over the limit.
    pub refusals: AtomicU64,
    /// Connections of this member that a peer refused (its reply said why).
    pub refused_by_peers: AtomicU64,
    /// Connections refused for TLS: inbound ones (counted in `refusals` too) of a plaintext
    /// dialer to a member with `[cluster.tls]`, of a TLS one to a member without, whose
    /// handshake failed (a certificate not signed by a CA in `ca_file`) or whose certificate
    /// does not name the member its hello claims; and this member's own connections whose
    /// peer's certificate it refused.
    pub tls_refusals: AtomicU64,
    /// Messages received but dropped because what they carry for the shards does not decode
    /// ([`content`]).
    pub drops_invalid: AtomicU64,
    /// Iterations of the peer thread's loop (an idle thread makes a few a second: keepalives,
    /// reconnects).
    pub iterations: AtomicU64,
    /// Messages now waiting in all peers' queues (a gauge, updated once per loop iteration).
    pub queued_messages: AtomicU64,
    /// Envelope bytes now waiting in all peers' queues (a gauge, as above).
    pub queued_bytes: AtomicU64,
}

impl PeerStats {
    fn add(counter: &AtomicU64, amount: u64) {
        counter.fetch_add(amount, Ordering::Relaxed);
    }
}

/// A core's way to send raft messages: cheap to clone, never waits for the network (it may
/// wait for a lane's lock, held by others only while they write to a non-blocking socket).
#[derive(Clone)]
pub struct PeerHandle {
    lanes: Arc<[Arc<lane::Lane>]>,
    waker: Arc<mio::Waker>,
    stop: Arc<AtomicBool>,
    stats: Arc<PeerStats>,
    board: Arc<parking_lot::Mutex<status::Board>>,
    versions: Arc<versions::Versions>,
    local_addr: SocketAddr,
}

impl PeerHandle {
    /// Sends one message to member `to`; false if it was dropped (channel full or closed).
    #[cfg(any(test, feature = "testing"))]
    pub fn send(&self, to: u64, shard: u32, message: Message) -> bool {
        self.send_batch(vec![Outgoing { to, shard, message }])
    }

    /// Sends a batch: per peer, in the batch's order, the messages are queued in the peer's
    /// lane and written to its connection now, as far as the socket takes them (one write for
    /// all of them, usually); the peer thread writes the rest. Wakes the peer thread only if a
    /// write failed or the socket took too little. False if the whole batch was dropped (the
    /// peer thread had stopped; each message is counted in `drops_stopped`). A message for an
    /// unknown member or over a lane's bounds is dropped and counted (`drops_queue`).
    pub fn send_batch(&self, batch: Vec<Outgoing>) -> bool {
        if batch.is_empty() {
            return true;
        }
        if self.stop.load(Ordering::Acquire) {
            PeerStats::add(&self.stats.drops_stopped, batch.len() as u64);
            return false;
        }
        let now = Instant::now();
        let (mut queued, mut wake) = (0, false);
        // Lanes one at a time, in their order: a sender never holds two lanes' locks.
        for lane in self.lanes.iter() {
            let mut state = None;
            for outgoing in batch
                .iter()
                .filter(|outgoing| outgoing.to == lane.node_id())
            {
                let state = state.get_or_insert_with(|| lane.lock());
                state.push(
                    lane.node_id(),
                    outgoing.shard,
                    &outgoing.message,
                    &self.stats,
                );
                queued += 1;
            }
            let Some(mut state) = state else {
                continue;
            };
            if let Err(error) = state.flush(now, &self.stats) {
                state.failed = Some(error);
            }
            wake |= state.wants_flush() || state.failed.is_some();
        }
        if queued < batch.len() {
            log::debug!(
                "peer: {} messages for unknown members",
                batch.len() - queued
            );
            PeerStats::add(&self.stats.drops_queue, (batch.len() - queued) as u64);
        }
        if wake {
            if let Err(error) = self.waker.wake() {
                log::warn!("peer thread: cannot wake it: {error}");
            }
        }
        true
    }

    /// The counters.
    #[cfg(any(test, feature = "testing"))]
    pub fn stats(&self) -> &Arc<PeerStats> {
        &self.stats
    }

    /// Every peer's link and reachability, the quorum, and the counters, as the peer thread
    /// last published them (at most about 100 ms old).
    pub fn report(&self) -> PeerReport {
        self.board
            .lock()
            .report(Instant::now(), &self.stats, &self.versions)
    }

    /// The cluster version: the lowest peer wire version any member speaks, as far as this
    /// member knows ([`frame::VERSION_MIN`] until every peer was heard from, a peer that is
    /// down counting at its last known version; `versions.rs`). A shard command of a newer
    /// version is proposed only once this is high enough. Lock-free: a load per peer.
    pub fn cluster_version(&self) -> u8 {
        self.versions.cluster_version()
    }

    /// The address the peer thread listens on (the port chosen if `listen` had port 0).
    #[cfg(any(test, feature = "testing"))]
    pub fn local_addr(&self) -> SocketAddr {
        self.local_addr
    }

    /// Asks the peer thread to stop: it closes every connection and its listener, then returns
    /// (join its `JoinHandle`). Messages still queued are dropped.
    pub fn stop(&self) {
        self.stop.store(true, Ordering::Release);
        if let Err(error) = self.waker.wake() {
            log::warn!("peer thread: cannot wake it to stop: {error}");
        }
    }
}

/// Starts a member's peer thread: binds `config.listen` (an error is returned here), then runs
/// until [`PeerHandle::stop`]. `inbound[i]` is core `i`'s channel and waker; `route(shard)` is
/// the index of the core that owns `shard` (a bug if out of range). Dropping every handle does
/// not stop the thread: call [`PeerHandle::stop`]. The peer thread reads every connection.
#[cfg(any(test, feature = "testing"))]
pub fn spawn<R>(
    config: PeerConfig,
    inbound: Vec<CoreInbox>,
    route: R,
) -> io::Result<(PeerHandle, JoinHandle<()>)>
where
    R: Fn(u32) -> usize + Send + Sync + 'static,
{
    let (handle, join, _) = spawn_inner(config, inbound, Arc::new(route), None)?;
    Ok((handle, join))
}

/// As `spawn` (tests), but each accepted connection is read on a core's own loop (`reader.rs`):
/// `polls[i]` is core `i`'s, and the [`CoreReader`]s returned (one per core, in order) read
/// them; a core passes each readiness event of its reserved tokens to its reader and takes
/// messages with [`CoreReader::recv`] besides its channel.
pub fn spawn_with_readers<R>(
    config: PeerConfig,
    inbound: Vec<CoreInbox>,
    polls: Vec<CorePoll>,
    route: R,
) -> io::Result<(PeerHandle, JoinHandle<()>, Vec<CoreReader>)>
where
    R: Fn(u32) -> usize + Send + Sync + 'static,
{
    if polls.len() != inbound.len() {
        let what = format!("{} polls for {} cores", polls.len(), inbound.len());
        return Err(io::Error::new(io::ErrorKind::InvalidInput, what));
    }
    spawn_inner(config, inbound, Arc::new(route), Some(polls))
}

fn spawn_inner(
    config: PeerConfig,
    inbound: Vec<CoreInbox>,
    route: inbound::Route,
    polls: Option<Vec<CorePoll>>,
) -> io::Result<(PeerHandle, JoinHandle<()>, Vec<CoreReader>)> {
    let config = validate(config, inbound.len())?;
    let stats = Arc::new(PeerStats::default());
    let stop = Arc::new(AtomicBool::new(false));
    let board = Arc::new(parking_lot::Mutex::new(status::Board::default()));
    let epoch = Instant::now();
    let heard = Arc::new(inbound::Heard::new(config.peers.len(), epoch));
    let (refusals_in, refusals) = crossbeam_channel::bounded(SOURCES);
    let (snapshots_in, snapshots) = crossbeam_channel::bounded(SOURCES);
    let mut handovers = Vec::new();
    let mut receivers = Vec::new();
    for _ in polls.iter().flatten() {
        let (sender, receiver) = crossbeam_channel::bounded(SOURCES);
        handovers.push(sender);
        receivers.push(receiver);
    }
    let handover = polls.is_some().then(|| reader::Handover {
        cores: handovers,
        refusals,
        snapshots,
    });
    let cores = (inbound.clone(), Arc::clone(&route));
    let peer = thread::Peer::new(
        config.clone(),
        cores,
        (Arc::clone(&heard), handover),
        &stats,
        &stop,
        &board,
    )?;
    let handle = PeerHandle {
        lanes: peer.lanes(),
        waker: peer.waker(),
        stop,
        stats,
        board,
        versions: peer.versions(),
        local_addr: peer.local_addr()?,
    };
    let readers = (polls.into_iter().flatten().zip(receivers).enumerate())
        .map(|(core, (poll, receiver))| {
            let cores = inbound::Cores::new(inbound.clone(), Arc::clone(&route), Some(core));
            let context = inbound::Context {
                snapshots: Some((snapshots_in.clone(), Arc::clone(&handle.waker))),
                read_bytes_max: inbound::BUFFER_BYTES,
                ..inbound::Context::new(
                    &config,
                    (Arc::clone(&heard), Arc::clone(&handle.versions)),
                    cores,
                    epoch,
                )
            };
            let back = (refusals_in.clone(), Arc::clone(&handle.waker));
            CoreReader::new(receiver, poll, context, &handle.stats, back)
        })
        .collect();
    let name = format!("lk-peer-{}", handle.local_addr.port());
    let join = std::thread::Builder::new()
        .name(name)
        .spawn(move || peer.run())?;
    Ok((handle, join, readers))
}

fn validate(mut config: PeerConfig, cores: usize) -> io::Result<PeerConfig> {
    let invalid = |what: String| io::Error::new(io::ErrorKind::InvalidInput, what);
    config.peers.retain(|&(id, _)| id != config.node_id);
    if config.node_id == 0 {
        return Err(invalid("cluster node_id must not be 0".into()));
    }
    if config.incarnation == 0 {
        return Err(invalid("a data-directory incarnation is never 0".into()));
    }
    if config.shards == 0 || cores == 0 {
        return Err(invalid(
            "cluster needs at least one shard and one core".into(),
        ));
    }
    if config.peers.len() > PEERS_MAX {
        return Err(invalid(format!(
            "at most {PEERS_MAX} peers, not {}",
            config.peers.len()
        )));
    }
    let mut ids: Vec<u64> = config.peers.iter().map(|&(id, _)| id).collect();
    ids.sort_unstable();
    if ids.windows(2).any(|pair| pair[0] == pair[1]) || ids.first() == Some(&0) {
        return Err(invalid("peer node ids must be distinct and not 0".into()));
    }
    let limits = &config.limits;
    if limits.queue_messages_max == 0 {
        return Err(invalid("peer queue limits must not be 0".into()));
    }
    if limits.backoff_min > limits.backoff_max || limits.backoff_min.is_zero() {
        return Err(invalid(
            "peer backoff_min must be above 0 and at most backoff_max".into(),
        ));
    }
    Ok(config)
}
