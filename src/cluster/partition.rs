//! A cluster member's partition on one core: the Raft groups of the shards this core hosts,
//! their lock state, and the requests of clients on them. It takes the place of the single
//! node's lock table in the core ([`Partition`]).
//!
//! Every grant, release, extend and expiry is a committed entry before its answer: a request
//! on a shard this member leads is proposed, remembered by the `(index, term)` its entry got,
//! and answered when the entry at that index is applied — from the entry's outcome if the
//! term matches, or with `M` (the request had no effect) if another entry took the index. A
//! request on a shard it does not lead gets `M` naming the leader. `Q` is served with Raft's
//! ReadIndex. See `docs/cluster-design.md`.
//!
//! One [`handle_timers`](Partition::handle_timers) call per loop iteration does the member's
//! I/O-free work: step the peers' messages, tick every 10 ms, time out waiters, expire leases
//! and checkpoint them (leader), then the group-commit drain: one WAL sync for every group.

use super::backup::{BackupRefusal, ShardBackup};
use super::compactor::Compactor;
#[cfg(any(test, feature = "testing"))]
use super::compactor::MemCompactor;
use super::machine::Command;
use super::member::{Envelope, Member};
use super::shard::Shard;
use super::writer::LogWriter;
use crate::hash::Map as HashMap;
use crate::metrics::Histogram;
use crate::partition::clients::ClientStates;
use crate::partition::cluster_stats::{ClusterStats, PeerReport, ShardStatus, LATENCY_BOUNDS_US};
use crate::partition::partition_of;
use crate::partition::GrantRef;
use crate::partition::Partition;
use crate::partition::{is_detached, NOBODY};
use crate::partition::{
    Answer, ClientRef, HeldKey, Op, Places, QueueCounts, SessionId, TableStats,
};
use crate::tokens::TokenKeeper;
use duties::{LeaseTimer, WaitTimer};
use latchkey_client::protocol::{Leader, Response};
use latchkey_wheel::Wheel;
use leadership_log::LeadershipLog;
use raft::eraftpb::Message;
use requests::End;
use slab::Slab;
use std::net::SocketAddr;

/// One Raft tick: 10 ms (the member's election timeout is 10–20 ticks, its heartbeat 2).
pub const TICK_US: u64 = super::member::TICK_MS * 1_000;
/// A new leader extends every lease by this before it may expire one: at least the longest
/// election timeout (20 ticks).
pub const PROMOTE_GRACE_MS: u64 = 200;
/// A leader checkpoints the remaining time of its leases this often.
pub const CHECKPOINT_EVERY_US: u64 = 1_000_000;
/// Holds one checkpoint entry carries at most.
const CHECKPOINT_HOLDS: usize = 1024;
/// How long a member that shuts down waits for the leaderships it hands over to move before it
/// answers its waiters without them (well within the 5 s a shutdown may take).
const SHUTDOWN_HANDOVER_US: u64 = 1_000_000;
/// Lease timers one iteration fires at most (whole ticks past it), all shards together: the
/// expiries proposed per iteration.
const LEASE_TIMERS_PER_STEP_MAX: usize = 512;
/// A shard's log is compacted into a snapshot after this many applied entries, at most (the
/// default of [`PartitionSettings::compact_every`] with up to 6 shards; [`compact_every`]).
pub const COMPACT_EVERY: u64 = 10_000;
/// Applied entries between two compactions of a shard, at least, in a server.
pub const COMPACT_EVERY_MIN: u64 = 1_000;
/// Entries a member lets its shards' logs grow to between compactions, all shards together,
/// before [`COMPACT_EVERY_MIN`]: every member keeps each entry twice (raft's `MemStorage` and
/// the write-ahead log's live state), and with 64 shards at 10,000 entries each, three members
/// held 650 MiB after 15 s at pipeline 16 (160 MiB at 1,000), their old entries out of cache.
pub const LOG_ENTRIES_PER_MEMBER: u64 = 64_000;

/// Applied entries between two compactions of each shard's log in a server of `shards` shards:
/// [`LOG_ENTRIES_PER_MEMBER`] shared among them, within [`COMPACT_EVERY_MIN`] and
/// [`COMPACT_EVERY`]. Fewer entries per compaction cost more snapshots (each encodes the
/// shard's holds, off the loop) and send a slow follower a snapshot more often (compaction
/// keeps no entries before the snapshot).
pub fn compact_every(shards: u32) -> u64 {
    (LOG_ENTRIES_PER_MEMBER / u64::from(shards.max(1))).clamp(COMPACT_EVERY_MIN, COMPACT_EVERY)
}
/// Wait timers one iteration fires at most (whole ticks past it): as the lock table's
/// `TIMERS_PER_STEP_MAX`, a burst of them never holds a loop iteration for long.
const WAIT_TIMERS_PER_STEP_MAX: usize = 512;
/// The longest wait or lease the wire can carry, in microseconds (the wheels' ring reaches
/// past it; a lease a promotion's grace moved further out waits in a page).
const WAIT_US_MAX: u64 = 255 * 1_000_000;
/// Peer messages stepped per iteration at most.
const INBOUND_PER_ITERATION: usize = 8192;
/// Ticks caught up at most after a stall (the rest are dropped: elections take longer).
const TICKS_CAUGHT_UP_MAX: u32 = 10;

/// The way to the other members (the peer thread in a server; a simulated network in tests).
pub trait Peers {
    /// Hands a batch of messages to the peers (never blocks; may drop).
    fn send(&mut self, batch: Vec<Envelope>);
    /// The next message a peer sent for one of this core's shards, if any.
    fn try_recv(&mut self) -> Option<(u32, Message)>;
    /// A readiness event for source `source` of the core's poll (a connection this way reads
    /// on the core).
    fn on_ready(&mut self, _source: usize) {}
    /// Whether [`Peers::try_recv`] has something without a new event (the partition then asks
    /// to run again at once).
    fn has_pending(&self) -> bool {
        false
    }
    /// The links to the other members and the quorum, if this way knows them.
    fn report(&self) -> Option<PeerReport> {
        None
    }
    /// The cluster version: the lowest peer wire version any member speaks
    /// ([`crate::cluster::peer::PeerHandle::cluster_version`]); a shard command of a newer
    /// version may be proposed only once it is high enough ([`WAITERS_PEER_VERSION`]). A way
    /// that knows of no older member (the simulations, test fakes) runs as a cluster of this
    /// build alone.
    fn cluster_version(&self) -> u8 {
        crate::cluster::peer::frame::VERSION
    }
}

/// The cluster version from which leaders mirror their queues in the replicated state
/// (`Command::Enqueue` and `Command::Withdraw`, which a member of an earlier build cannot
/// decode): see `mirror.rs`.
pub const WAITERS_PEER_VERSION: u8 = 4;
const _: () = assert!(WAITERS_PEER_VERSION <= crate::cluster::peer::frame::VERSION);
/// The cluster version from which a leader's `Command::Withdraw` says how the acquire was
/// answered, so that every member remembers its fate for a Resolve (`mirror.rs`).
pub const ANSWERED_PEER_VERSION: u8 = 5;
const _: () = assert!(ANSWERED_PEER_VERSION <= crate::cluster::peer::frame::VERSION);

/// What a cluster partition needs to know besides its member.
#[derive(Clone, Debug)]
pub struct PartitionSettings {
    /// This member's id.
    pub node_id: u64,
    /// Shards in the cluster.
    pub shards: u32,
    /// This core's index, and the member's core count.
    pub core: usize,
    /// Cores of this member.
    pub cores: usize,
    /// Every member's client address, by id (for `M`).
    pub clients: Vec<(u64, SocketAddr)>,
    /// Queued acquires per key at most (`limits.max_waiters_per_key`).
    pub max_waiters_per_key: u32,
    /// Holds plus grants in flight a shard this member leads may have before an acquire of a
    /// free key is refused `B` (`limits.max_keys / shards`, at least 1). Members' configs may
    /// differ; what every member's machine applies is [`crate::config::HOLDS_MAX`].
    pub max_keys_per_shard: usize,
    /// Acquires one session may have queued (`limits.max_pending_per_session`): on this
    /// partition, or on all with [`ClusterPartition::share_queue_counts`].
    pub max_pending_per_session: u32,
    /// Applied entries between two compactions of a shard's log into a snapshot (at least 1;
    /// [`compact_every`] in a server, smaller in tests so that snapshots are sent and restored).
    pub compact_every: u64,
    /// The wait timers' tick in microseconds (`timer.tick_ms`; at least 1): a wait ends at most
    /// one tick late, never early.
    pub tick_us: u64,
}

#[cfg(test)]
impl PartitionSettings {
    /// A one-member cluster of one shard on one core, with small limits (the unit tests').
    fn one_member() -> PartitionSettings {
        PartitionSettings {
            node_id: 1,
            shards: 1,
            core: 0,
            cores: 1,
            clients: vec![(1, "127.0.0.1:7420".parse().expect("an address"))],
            max_waiters_per_key: 16,
            max_keys_per_shard: 1000,
            max_pending_per_session: 16,
            compact_every: 1000,
            tick_us: 1_000,
        }
    }
}

/// The shard of `key` among `shards`: the same on every member, whatever its core count.
pub fn shard_of(key: &[u8], shards: u32) -> u32 {
    partition_of(key, shards as usize) as u32
}

/// The shards core `core` of `cores` hosts.
pub fn shards_of_core(core: usize, cores: usize, shards: u32) -> Vec<u32> {
    (0..shards)
        .filter(|s| *s as usize % cores == core)
        .collect()
}

/// A request waiting for its entry to be applied.
#[derive(Clone, Debug)]
struct Pending {
    term: u64,
    session: SessionId,
    kind: PendingKind,
    /// When it was proposed (server clock, µs).
    proposed_us: u64,
    /// The key whose queue head this entry also grants: a release or expiry with a `then`
    /// (a handoff). The head is decided with the entry.
    handoff: Option<Vec<u8>>,
}

#[derive(Clone, Debug)]
enum PendingKind {
    /// The head of `key`'s queue (its owner is in the waiter).
    Acquire {
        key: Vec<u8>,
    },
    /// A client's release or extend of `token`.
    Release {
        token: u64,
    },
    Extend {
        token: u64,
    },
    /// A leader's own entries.
    Expire {
        token: u64,
    },
    Barrier,
    /// A checkpoint of the leases left.
    Checkpoint,
    /// The release of a grant nobody will receive (no answer; a Resolve of its owner is not
    /// answered "granted" meanwhile).
    Orphan {
        token: u64,
    },
    /// An `Enqueue` or `Withdraw` mirroring this leader's queues (no answer: `mirror.rs`).
    Mirror,
    /// The `Extend` that renews a grant to an adopted waiter whose acquire, sent again by its
    /// client, it answers (`A` once applied: `mirror.rs`).
    Regrant {
        owner: u64,
    },
    /// The `Extend` that renews a hold its owner's Resolve found (`resume.rs`): answered
    /// *granted* with `lease_ms` once applied, which every member counts from its apply (after
    /// the Resolve was sent); decided again if the hold is gone by then.
    Resolve {
        client: ClientRef,
        owner: u64,
        lease_ms: u32,
    },
}

/// A query waiting for its read index.
#[derive(Clone, Debug)]
struct PendingRead {
    shard: u32,
    session: SessionId,
    nonce: u64,
    key: Vec<u8>,
    /// The last entry proposed on the shard when the query arrived: the query is answered
    /// only once it is applied too, so that it never overtakes a request of the same session
    /// on the same key sent before it (docs/protocol.md §3.6).
    after: u64,
    /// The index the state must reach, once known.
    index: Option<u64>,
}

/// A cluster member's partition on one core.
pub struct ClusterPartition<D: LogWriter, P: Peers> {
    settings: PartitionSettings,
    member: Member<D>,
    peers: P,
    /// Encodes the compactions' frozen images and drops replaced machines, off the loop.
    compactor: Box<dyn Compactor>,
    /// Compactions recorded, and dropped (a restore had passed their index).
    compactions: (u64, u64),
    /// Hosted shards, at `shard / cores`.
    shards: Vec<Shard>,
    pending: HashMap<(u32, u64), Pending>,
    reads: HashMap<u64, PendingRead>,
    /// Resolves waiting for an entry in flight (resume.rs).
    resolves: Vec<resume::PendingResolve>,
    /// `T` and `B` answers held until the applied state decides (mirror.rs, `HeldAnswer`).
    held: Vec<mirror::HeldAnswer>,
    next_seq: u64,
    /// Queued acquires' wait deadlines, by tick: slots of `wait_slots`.
    wait_timers: Wheel<u32>,
    /// What each armed wait timer is for.
    wait_slots: Slab<WaitTimer>,
    /// The slots the last `fire_wait_timers` took (kept for its allocation).
    fired_waits: Vec<u32>,
    /// The lease timers of the holds of the shards this member serves, by tick.
    lease_timers: Wheel<LeaseTimer>,
    /// The timers the last `fire_lease_timers` took (kept for its allocation).
    fired_leases: Vec<LeaseTimer>,
    answers: Vec<Answer>,
    /// Sessions' places in `max_pending_per_session`, taken by their queued waiters.
    places: Places,
    /// Resumable calls (docs/protocol.md §5), leader-local: the `T` and `B` answers this member
    /// gave identified clients' acquires and the owners it answered "never seen"
    /// (`partition/resume.rs`).
    clients: ClientStates,
    /// The client each identified session that sent an acquire here speaks for.
    session_clients: HashMap<SessionId, ClientRef>,
    /// Each identified client's id and grace, as its sessions identified (`mirror.rs`).
    client_ids: HashMap<ClientRef, (u128, u8)>,
    /// Grants applied to adopted waiters that no session took yet: token → shard and the end of
    /// the client's grace, when the grant is released if no Resolve took it (`mirror.rs`).
    adopted_grants: HashMap<u64, mirror::AdoptedGrant>,
    /// Adopted acquires that ended unattached (their wait or their client's grace ran out, a
    /// grant to one was released unresolved or expired), by client id and owner, until when
    /// they are remembered: the same acquire sent again then gets `T`, not a second execution
    /// (`mirror.rs`).
    adopted_ended: HashMap<(u128, u64), u64>,
    /// Waiters to mirror once they have waited [`mirror::MIRROR_AFTER_US`], in the order they
    /// queued (`mirror.rs`).
    to_mirror: std::collections::VecDeque<mirror::ToMirror>,
    stats: TableStats,
    cluster_stats: ClusterStats,
    now_us: u64,
    next_tick_us: u64,
    shutting_down: bool,
    /// While a shutdown hands this member's leaderships over: until when it waits for them.
    handover_until_us: Option<u64>,
    /// Other members were live when the shutdown began: its waiters and new acquires are sent
    /// to them (`M`); without any (a one-member cluster, or the last one up), they are refused
    /// `B`, as a single node does.
    others_at_shutdown: bool,
    /// This iteration's leadership changes, logged at its end.
    leadership_log: LeadershipLog,
}

impl<D: LogWriter, P: Peers> ClusterPartition<D, P> {
    /// The partition of core `settings.core` around `member` (which hosts exactly
    /// [`shards_of_core`] of it), its compactions encoded in this thread, at once (the
    /// simulations' and tests'; a server's go to a worker: [`Self::with_compactor`]).
    #[cfg(any(test, feature = "testing"))]
    pub fn new(settings: PartitionSettings, member: Member<D>, peers: P) -> Self {
        let compactor = Box::new(MemCompactor::immediate());
        Self::with_compactor(settings, member, peers, compactor)
    }

    /// The partition of core `settings.core` around `member` (which hosts exactly
    /// [`shards_of_core`] of it), handing its compactions (and replaced machines) to
    /// `compactor`: a server's [`super::compactor::SnapWorker`].
    pub fn with_compactor(
        settings: PartitionSettings,
        member: Member<D>,
        peers: P,
        compactor: Box<dyn Compactor>,
    ) -> Self {
        let hosted = shards_of_core(settings.core, settings.cores, settings.shards);
        let shards = hosted
            .iter()
            .map(|&shard| Shard::new(shard, settings.shards))
            .collect();
        let node_id = settings.node_id;
        let members = settings.clients.clone();
        let places = Places::new(settings.max_pending_per_session);
        assert!(settings.tick_us >= 1, "a tick of at least a microsecond");
        let tick_us = settings.tick_us;
        ClusterPartition {
            settings,
            member,
            peers,
            compactor,
            compactions: (0, 0),
            shards,
            pending: HashMap::default(),
            reads: HashMap::default(),
            resolves: Vec::new(),
            held: Vec::new(),
            next_seq: 1,
            wait_timers: Wheel::with_horizon(0, WAIT_US_MAX.div_ceil(tick_us) + 1),
            wait_slots: Slab::new(),
            fired_waits: Vec::new(),
            lease_timers: Wheel::with_horizon(0, WAIT_US_MAX.div_ceil(tick_us) + 1),
            fired_leases: Vec::new(),
            answers: Vec::new(),
            places,
            clients: ClientStates::default(),
            session_clients: HashMap::default(),
            client_ids: HashMap::default(),
            adopted_grants: HashMap::default(),
            to_mirror: std::collections::VecDeque::new(),
            adopted_ended: HashMap::default(),
            stats: TableStats::default(),
            cluster_stats: ClusterStats {
                node_id,
                members,
                shards: Vec::new(),
                leader_changes: 0,
                proposals: 0,
                restores: 0,
                commit_latency: Histogram::new(LATENCY_BOUNDS_US),
                sync_latency: Histogram::new(LATENCY_BOUNDS_US),
                peers: None,
            },
            now_us: 0,
            next_tick_us: 0,
            shutting_down: false,
            handover_until_us: None,
            others_at_shutdown: false,
            leadership_log: LeadershipLog::default(),
        }
    }

    /// Makes `max_pending_per_session` count a session's queued acquires in every partition
    /// sharing `counts` (a server's cores), as [`crate::lock_table::LockTable`] does. Before
    /// any request.
    pub fn share_queue_counts(&mut self, counts: std::sync::Arc<dyn QueueCounts>) {
        self.places.share(counts);
    }

    /// Hands this core's compactions (and replaced machines) to `compactor` instead (the
    /// simulations' and tests' late or failing compactors). Before any entry is applied.
    #[cfg(any(test, feature = "testing"))]
    pub fn set_compactor(&mut self, compactor: Box<dyn Compactor>) {
        self.compactor = compactor;
    }

    /// Compactions handed to the member so far, and compactions dropped because a received
    /// snapshot was restored past their index before they came back (for tests).
    #[cfg(any(test, feature = "testing"))]
    pub fn compactions(&self) -> (u64, u64) {
        self.compactions
    }

    /// The member (for status and tests).
    #[cfg(any(test, feature = "testing"))]
    pub fn member(&self) -> &Member<D> {
        &self.member
    }

    /// The member, to stall its writer (tests).
    #[cfg(test)]
    pub(crate) fn member_mut(&mut self) -> &mut Member<D> {
        &mut self.member
    }

    /// The shard machine of `shard` (hosted here), for tests and status.
    pub fn machine(&self, shard: u32) -> Option<&super::machine::ShardMachine> {
        self.shard(shard).map(Shard::machine)
    }

    /// Whether this member serves `shard` now (leads it and applied its barrier).
    pub fn serving(&self, shard: u32) -> bool {
        self.shard(shard).is_some_and(Shard::serving)
    }

    fn shard(&self, shard: u32) -> Option<&Shard> {
        let local = shard as usize / self.settings.cores;
        (shard as usize % self.settings.cores == self.settings.core)
            .then(|| self.shards.get(local))
            .flatten()
    }

    fn local(&self, shard: u32) -> usize {
        debug_assert_eq!(shard as usize % self.settings.cores, self.settings.core);
        shard as usize / self.settings.cores
    }

    /// Now in whole milliseconds, rounded down: what is due by now is due by this.
    fn now_ms(&self) -> u64 {
        self.now_us / 1000
    }

    /// Now in whole milliseconds, rounded up: the time an applied lease counts from, so that
    /// a deadline in milliseconds is never before `now_us + lease` (rounded down, a lease
    /// could end up to a millisecond early).
    fn apply_ms(&self) -> u64 {
        self.now_us.div_ceil(1000)
    }

    fn answer(&mut self, session: SessionId, response: Response, ends_pending: bool) {
        if let Response::Timeout { .. } | Response::Busy { .. } = response {
            self.remember_answer(session, &response);
        }
        if is_detached(session) {
            return; // nobody reads it: its client has no session (resume.rs)
        }
        self.answers.push(Answer {
            session,
            response,
            ends_pending,
            grant: GrantRef::NONE,
        });
    }

    /// The `M` for a request on `shard`: the leader's client address, if one is known and is
    /// not this member (which leads but does not serve yet).
    fn moved(&self, shard: u32, id: u64) -> Response {
        let leader = self
            .member
            .leader(shard)
            .filter(|&leader| leader != self.settings.node_id)
            .and_then(|leader| {
                let found = self.settings.clients.iter().find(|(id, _)| *id == leader);
                found.map(|(_, addr)| Leader::at(*addr))
            })
            .unwrap_or(Leader::UNKNOWN);
        Response::Moved { id, leader }
    }

    fn seq(&mut self) -> u64 {
        self.next_seq += 1;
        self.next_seq
    }

    /// Proposes `command` on `shard` and remembers what to do when it applies. A release or
    /// expiry with a `then` marks the head of its key's queue proposed with it (the caller
    /// took `then` from that head). False when this member cannot propose (not the leader any
    /// more, or the proposal was refused).
    fn propose(
        &mut self,
        shard: u32,
        command: &Command,
        session: SessionId,
        kind: PendingKind,
    ) -> bool {
        match self.member.propose(shard, command.encode()) {
            Ok(proposed) => {
                let handoff = match command {
                    Command::Release { key, then, .. } | Command::Expire { key, then, .. } => {
                        then.is_some().then(|| key.clone())
                    }
                    _ => None,
                };
                if let Some(key) = &handoff {
                    let local = self.local(shard);
                    self.shards[local].propose_head(key, true, self.now_us, &mut self.places);
                }
                let pending = Pending {
                    term: proposed.term,
                    session,
                    kind,
                    proposed_us: self.now_us,
                    handoff,
                };
                self.cluster_stats.proposals += 1;
                let local = self.local(shard);
                self.shards[local].proposed_at(proposed.index);
                self.track(shard, proposed.index, pending);
                true
            }
            Err(not_leader) => {
                log::debug!("shard {shard}: proposal refused: {not_leader}");
                false
            }
        }
    }

    /// Remembers `pending`, proposed at `index` on `shard`. A proposal this member made at
    /// the same index in an earlier term was truncated from its log: it is lost (settled now;
    /// the others past it are when an entry of a later term applies, apply.rs).
    fn track(&mut self, shard: u32, index: u64, pending: Pending) {
        if let Some(displaced) = self.pending.insert((shard, index), pending) {
            self.lost(shard, displaced);
        }
    }
}

impl<D: LogWriter, P: Peers> Partition for ClusterPartition<D, P> {
    fn core_of_key(&self, key: &[u8], cores: usize) -> usize {
        shard_of(key, self.settings.shards) as usize % cores
    }

    fn handle(&mut self, now_us: u64, session: SessionId, client: ClientRef, op: Op, key: &[u8]) {
        self.now_us = self.now_us.max(now_us);
        if client.is_some() {
            self.session_clients.entry(session).or_insert(client);
        }
        let shard = shard_of(key, self.settings.shards);
        let serving = self.shard(shard).is_some_and(Shard::serving);
        if !serving {
            if let Op::Cancel { .. } = op {
                return; // nothing is queued here
            }
            let response = self.moved(shard, op_id(&op));
            return self.answer(session, response, op.may_wait());
        }
        match op {
            Op::Acquire {
                wait_s,
                lease_s,
                owner,
            } => self.acquire(shard, (session, client), key, (wait_s, lease_s, owner)),
            Op::Release { token } => {
                let kind = PendingKind::Release { token };
                if !self.propose_end(shard, key, token, End::Release, session, kind) {
                    let response = self.moved(shard, token);
                    self.answer(session, response, false);
                }
            }
            Op::Extend { lease_s, token } => {
                let command = Command::Extend {
                    key: key.to_vec(),
                    token,
                    lease_ms: u32::from(lease_s) * 1000,
                };
                if !self.propose(shard, &command, session, PendingKind::Extend { token }) {
                    let response = self.moved(shard, token);
                    self.answer(session, response, false);
                }
            }
            Op::Cancel { owner } => self.cancel(shard, session, key, owner),
            Op::Query { nonce } => self.query(shard, session, key, nonce),
            Op::Resolve { owner } => self.resolve(shard, (session, client), key, owner),
        }
        self.propose_withdrawals();
    }

    fn handle_timers(&mut self, now_us: u64) {
        self.now_us = self.now_us.max(now_us);
        self.step_inbound();
        self.tick();
        self.fire_wait_timers();
        self.fire_lease_timers();
        for local in 0..self.shards.len() {
            self.leader_duties(local);
        }
        self.release_unresolved_grants();
        self.propose_due_mirrors();
        self.propose_withdrawals();
        self.balance();
        self.drain();
        self.end_handover();
        for line in self.leadership_log.take_lines(self.settings.core) {
            log::info!("{line}");
        }
    }

    fn on_source_ready(&mut self, source: usize) {
        self.peers.on_ready(source);
    }

    fn next_deadline_us(&self) -> Option<u64> {
        if self.member.has_ready() || self.compactor.has_done() || self.peers.has_pending() {
            return Some(self.now_us);
        }
        let waits = self.wait_timers.next_deadline();
        let waits = waits.map(|tick| tick.saturating_mul(self.settings.tick_us));
        let leases = self.lease_timers.next_deadline();
        let leases = leases.map(|tick| tick.saturating_mul(self.settings.tick_us));
        let adopted = self
            .adopted_grants
            .values()
            .map(mirror::AdoptedGrant::until_us)
            .min();
        let mirrors = self.to_mirror.front().map(mirror::ToMirror::due_us);
        [
            Some(self.next_tick_us),
            waits,
            leases,
            self.handover_until_us,
            adopted,
            mirrors,
        ]
        .into_iter()
        .flatten()
        .min()
    }

    fn take_answers(&mut self) -> Vec<Answer> {
        std::mem::take(&mut self.answers)
    }

    fn return_answers(&mut self, mut answers: Vec<Answer>) {
        answers.clear();
        if self.answers.is_empty() && answers.capacity() > self.answers.capacity() {
            self.answers = answers;
        }
    }

    fn release_granted(&mut self, now_us: u64, grant: GrantRef, token: u64, client: ClientRef) {
        self.now_us = self.now_us.max(now_us);
        // A cluster partition's grant reference is the shard (see `answer_grant`).
        let GrantRef(shard) = grant;
        if client.is_some() {
            // Kept for its client's grace, for a Resolve to find (resume.rs).
            return self.keep_undelivered(client, shard, token);
        }
        self.release_undelivered(shard, token);
    }

    fn handle_session_closed(&mut self, session: SessionId, client: ClientRef) {
        // An identified client's waiters stay, detached, for its grace (resume.rs).
        let detached = client.is_some().then(|| client.detached());
        for shard in &mut self.shards {
            match detached {
                Some(detached) => shard.detach_session(session, detached, &mut self.places),
                None => shard.close_session(session, &mut self.places),
            }
        }
        self.session_clients.remove(&session);
        for held in &mut self.held {
            held.session_closed(session);
        }
    }

    fn handle_client_gone(&mut self, now_us: u64, client: ClientRef) {
        self.now_us = self.now_us.max(now_us);
        self.client_gone(client);
        self.client_ids.remove(&client);
        self.propose_withdrawals();
    }

    fn handle_client_known(&mut self, client: ClientRef, id: u128, grace_s: u8) {
        self.client_ids.insert(client, (id, grace_s));
    }

    fn resumes_calls(&self) -> bool {
        true
    }

    fn handle_shutdown(&mut self) {
        self.shutting_down = true;
        self.hand_over_leaderships();
        self.propose_withdrawals();
    }

    fn is_quiescent(&self) -> bool {
        self.handover_until_us.is_none()
    }

    fn top_up_tokens(&mut self, _keeper: &mut TokenKeeper) {
        // Tokens come from the log index: nothing to reserve.
    }

    fn stats(&self) -> &TableStats {
        &self.stats
    }

    fn key_count(&self) -> usize {
        self.shards.iter().map(|s| s.machine().len()).sum()
    }

    fn waiter_count(&self) -> usize {
        self.shards.iter().map(Shard::waiter_count).sum()
    }

    fn cluster_stats(&self) -> Option<ClusterStats> {
        let mut stats = self.cluster_stats.clone();
        stats.shards = self
            .shards
            .iter()
            .map(|state| {
                let shard = state.machine().shard();
                ShardStatus {
                    shard,
                    leader: self.member.leader(shard),
                    serving: state.serving(),
                    term: self.member.term(shard),
                    commit: self.member.commit(shard),
                    applied: state.machine().applied(),
                    holds: state.machine().len(),
                }
            })
            .collect();
        stats.peers = self.peers.report();
        stats.sync_latency = self
            .member
            .writer()
            .sync_latency()
            .unwrap_or(stats.sync_latency);
        Some(stats)
    }

    fn backup_shard(&self, shard: u32) -> Result<Vec<u8>, BackupRefusal> {
        let shards = self.settings.shards;
        let Some(state) = self.shard(shard) else {
            return Err(BackupRefusal::NoShard { shard, shards });
        };
        if !state.serving() {
            let leader = (self.member.leader(shard))
                .filter(|&leader| leader != self.settings.node_id)
                .and_then(|leader| {
                    let found = self.settings.clients.iter().find(|(id, _)| *id == leader);
                    found.map(|(id, addr)| (*id, addr.to_string()))
                });
            return Err(BackupRefusal::NotLeader { shard, leader });
        }
        let term = self.member.term(shard);
        ShardBackup::encode_of(state.machine(), shards, term, self.now_ms())
    }

    fn scan_held(
        &self,
        _now_us: u64,
        cursor: u32,
        slots: u32,
        prefix: &[u8],
        found: &mut dyn FnMut(HeldKey),
    ) -> Option<u32> {
        // The cursor walks the hosted shards; a scan lists only shards this member serves.
        let now_ms = self.now_ms();
        let end = (cursor as usize)
            .saturating_add(slots.max(1) as usize)
            .min(self.shards.len());
        for shard in &self.shards[(cursor as usize).min(end)..end] {
            if !shard.serving() {
                continue;
            }
            for (key, hold) in shard.machine().holds() {
                if !key.starts_with(prefix) {
                    continue;
                }
                let granted = shard.granted(hold.token);
                found(HeldKey {
                    key: key.into(),
                    owner: hold.owner,
                    holder: granted.map_or(NOBODY, |granted| granted.session),
                    held_us: granted.map(|granted| self.now_us.saturating_sub(granted.at_us)),
                    lease_left_us: hold.deadline_ms.saturating_sub(now_ms) * 1000,
                    waiters: shard.waiting_len(key) as u32,
                });
            }
        }
        (end < self.shards.len()).then_some(end as u32)
    }
}

/// The correlation id of a keyed request.
fn op_id(op: &Op) -> u64 {
    match *op {
        Op::Acquire { owner, .. } | Op::Cancel { owner } | Op::Resolve { owner } => owner,
        Op::Release { token } | Op::Extend { token, .. } => token,
        Op::Query { nonce } => nonce,
    }
}

#[cfg(test)]
#[path = "partition/alone.rs"]
mod alone;
#[path = "partition/apply.rs"]
mod apply;
#[path = "partition/duties.rs"]
mod duties;
#[path = "partition/leadership_log.rs"]
mod leadership_log;
#[path = "partition/mirror.rs"]
mod mirror;
#[path = "partition/raft_io.rs"]
mod raft_io;
pub(crate) use leadership_log::shard_list;
#[path = "partition/requests.rs"]
mod requests;
#[path = "partition/resume.rs"]
mod resume;
