//! The simulated cluster: three members of [`CORES`] cores each (the shape a server runs by
//! default on this machine), and the network between them.
//!
//! Each core of a member is a `ClusterPartition<MemWriter, SimPeers>` hosting the shards `s`
//! with `s % CORES == core`, with its own write-ahead image, as in a server; a member's cores
//! share its monotonic clock (global virtual time plus a per-member offset; no drift). A core's
//! writer completes a round 50-600 µs (now and then 5-30 ms: a slow sync) after the iteration
//! that found batches queued, taking all of them or only the oldest few, and wakes the member
//! then: completions interleave with deliveries by their times.
//! `SimPeers` puts envelopes on a wire the world owns; the world delivers them after 0–20 ms to
//! the core that hosts the shard, or drops them (loss, a cut link, a crashed receiver), or
//! duplicates them. Delays are drawn per message, so messages reorder. A crash drops every core
//! of the member, keeps only the synced layer of each core's `MemDurable` (batches queued for
//! the writer or written and not synced are lost) and rebuilds the member from them on
//! restart.
//!
//! Bounds: at most [`IN_FLIGHT_MAX`] messages in flight (more are dropped, counted) and at
//! most [`INBOX_MAX`] delivered but not yet stepped per member.

use latchkey::cluster::compactor::MemCompactor;
use latchkey::cluster::mem_durable::MemDurable;
use latchkey::cluster::mem_writer::MemWriter;
use latchkey::cluster::member::{Envelope, Member};
use latchkey::cluster::partition::{ClusterPartition, PartitionSettings, Peers};
use latchkey::partition::Partition;
use latchkey::partition::{Answer, ClientRef};
use latchkey::rng::Rng;
use raft::eraftpb::Message;
use std::cell::RefCell;
use std::collections::{BTreeMap, VecDeque};
use std::net::SocketAddr;
use std::rc::Rc;

/// Members of the cluster, ids `1..=MEMBERS`.
pub const MEMBERS: u64 = 3;
/// Shards of the cluster.
pub const SHARDS: u32 = 4;
/// Cores of every member (each hosts the shards `s` with `s % CORES == core`).
pub const CORES: usize = 2;
/// Messages in flight at most.
pub const IN_FLIGHT_MAX: usize = 200_000;
/// Messages delivered to a member and not yet stepped, at most.
pub const INBOX_MAX: usize = 50_000;
/// The longest network delay.
pub const DELAY_US_MAX: u64 = 20_000;

/// The client address of member `id` (what `M` names).
pub fn client_addr(id: u64) -> SocketAddr {
    SocketAddr::from(([127, 0, 0, 1], 7000 + id as u16))
}

/// The member at a client address, if it is one.
pub fn member_at(addr: SocketAddr) -> Option<u64> {
    (1..=MEMBERS).find(|&id| client_addr(id) == addr)
}

/// What the members put on, and take off, the wire.
#[derive(Default)]
pub struct Wire {
    outbox: Vec<(u64, Envelope)>,
    /// Per (member, core): delivered, not yet stepped.
    inboxes: BTreeMap<(u64, usize), VecDeque<(u32, Message)>>,
}

/// The core of a member that hosts `shard`.
pub fn core_of(shard: u32) -> usize {
    shard as usize % CORES
}

/// One member core's way to the others: the shared wire.
pub struct SimPeers {
    id: u64,
    core: usize,
    wire: Rc<RefCell<Wire>>,
}

impl Peers for SimPeers {
    fn send(&mut self, batch: Vec<Envelope>) {
        let mut wire = self.wire.borrow_mut();
        wire.outbox
            .extend(batch.into_iter().map(|env| (self.id, env)));
    }

    fn try_recv(&mut self) -> Option<(u32, Message)> {
        self.wire
            .borrow_mut()
            .inboxes
            .get_mut(&(self.id, self.core))?
            .pop_front()
    }
}

/// Counts of what the network and the faults did.
#[derive(Clone, Copy, Debug, Default)]
pub struct FaultCounts {
    /// Messages sent.
    pub sent: u64,
    /// Messages dropped by loss.
    pub lost: u64,
    /// Messages dropped by a cut link or a crashed receiver.
    pub cut: u64,
    /// Messages delivered twice.
    pub duplicated: u64,
    /// Crashes.
    pub crashes: u64,
    /// Isolations of one member.
    pub isolations: u64,
    /// Snapshots members restored (counted when a member crashes, and at the end).
    pub restores: u64,
    /// Compaction snapshots that came back after a restore had passed them (dropped).
    pub compactions_dropped: u64,
    /// Queued acquires new leaders adopted from the replicated queues (counted as restores).
    pub adopted: u64,
}

/// Applied entries between two compactions in the simulation.
pub const COMPACT_EVERY_IN_SIM: u64 = 24;
/// A compaction's snapshot comes back from the compactor 0 to this many iterations late.
pub const COMPACTION_LATE_MAX: u64 = 40;

/// A member core's partition in the simulation.
pub type SimPartition = ClusterPartition<MemWriter, SimPeers>;

/// One member: its cores' partitions while up, their durable images while down.
pub struct Node {
    /// The member's id.
    pub id: u64,
    /// Its clock: global time plus this.
    pub offset_us: u64,
    /// The partition of each core, while up (empty while down).
    pub partitions: Vec<SimPartition>,
    /// What survived the crash of each core, while down (empty while up).
    pub images: Vec<MemDurable>,
    /// Restarts so far.
    pub incarnation: u64,
    /// When it next runs `handle_timers` (global µs).
    pub wake_us: u64,
    /// Tokens its machines held after its last iteration, with their owners.
    pub holds: BTreeMap<u64, u64>,
    /// Per core: when its writer's round under way completes (global µs; 0: none).
    pub write_done_us: Vec<u64>,
}

/// The members and the network.
pub struct World {
    /// Members, at `id - 1`.
    pub nodes: Vec<Node>,
    wire: Rc<RefCell<Wire>>,
    /// (deliver at, seq) → (to, shard, message).
    in_flight: BTreeMap<(u64, u64), (u64, u32, Message)>,
    next_seq: u64,
    /// Percent of messages lost.
    pub loss_percent: u64,
    /// Percent of messages duplicated.
    pub dup_percent: u64,
    /// A member cut off from the others, if any.
    pub isolated: Option<u64>,
    /// What happened.
    pub counts: FaultCounts,
    seed: u64,
    /// Draws the writers' round times.
    writes: Rng,
}

impl Node {
    /// Whether the member is up.
    pub fn is_up(&self) -> bool {
        !self.partitions.is_empty()
    }

    /// The partition of the core that hosts `shard`, while up.
    pub fn partition_of(&self, shard: u32) -> Option<&SimPartition> {
        self.partitions.get(core_of(shard))
    }

    /// The machine of `shard`, while up.
    pub fn machine(&self, shard: u32) -> Option<&latchkey::cluster::machine::ShardMachine> {
        self.partition_of(shard)?.machine(shard)
    }
}

fn settings(id: u64, core: usize) -> PartitionSettings {
    PartitionSettings {
        node_id: id,
        shards: SHARDS,
        core,
        cores: CORES,
        clients: (1..=MEMBERS).map(|m| (m, client_addr(m))).collect(),
        max_waiters_per_key: 64,
        max_keys_per_shard: latchkey::config::HOLDS_MAX,
        max_pending_per_session: 1024,
        // Small, so that shards compact often and crashed or lagging members restore snapshots.
        compact_every: COMPACT_EVERY_IN_SIM,
        tick_us: 1_000,
    }
}

/// Snapshots `partition` restored so far.
pub fn restores_of(partition: &SimPartition) -> u64 {
    partition.cluster_stats().map_or(0, |stats| stats.restores)
}

/// Compaction snapshots `partition` dropped so far (a restore had passed them).
pub fn compactions_dropped_of(partition: &SimPartition) -> u64 {
    partition.compactions().1
}

impl World {
    /// Three fresh members with clock offsets drawn from `rng`.
    pub fn new(seed: u64, rng: &mut Rng) -> World {
        let wire = Rc::new(RefCell::new(Wire::default()));
        let mut world = World {
            nodes: Vec::new(),
            wire,
            in_flight: BTreeMap::new(),
            next_seq: 0,
            loss_percent: 0,
            dup_percent: 0,
            isolated: None,
            counts: FaultCounts::default(),
            seed,
            writes: Rng::new(seed ^ 0x5772_6974_6572_7321),
        };
        for id in 1..=MEMBERS {
            let offset_us = rng.between(1_000_000, 1_000_000_000);
            let mut node = Node {
                id,
                offset_us,
                partitions: Vec::new(),
                images: (0..CORES).map(|_| MemDurable::new()).collect(),
                incarnation: 0,
                wake_us: rng.below(1000),
                holds: BTreeMap::new(),
                write_done_us: Vec::new(),
            };
            world.start(&mut node);
            world.nodes.push(node);
        }
        world
    }

    fn start(&self, node: &mut Node) {
        let mut images = std::mem::take(&mut node.images);
        images.resize_with(CORES, MemDurable::new);
        let voters: Vec<u64> = (1..=MEMBERS).collect();
        let seed = self.seed ^ node.incarnation.wrapping_mul(0x9e37_79b9_7f4a_7c15);
        for (core, durable) in images.into_iter().enumerate() {
            let recovered = durable.recovered();
            let shards: Vec<u32> = (0..SHARDS).filter(|&s| core_of(s) == core).collect();
            let writer = MemWriter::new(durable);
            let member = Member::new(node.id, &voters, &shards, writer, recovered, seed)
                .expect("a member builds from its recovered image");
            let peers = SimPeers {
                id: node.id,
                core,
                wire: Rc::clone(&self.wire),
            };
            let settings = settings(node.id, core);
            let mut partition = ClusterPartition::new(settings, member, peers);
            // Every session identifies, as a server tells each core before the session's
            // requests: client `i` has the id `i + 1` (mirrored waiters carry it).
            for client in 0..super::sim::CLIENTS {
                partition.handle_client_known(ClientRef(client as u32), client as u128 + 1, 30);
            }
            // Compactions come back up to COMPACTION_LATE_MAX iterations late, out of order:
            // after more entries were applied, or a received snapshot was restored.
            let compactor_seed = seed ^ (core as u64 + 1).wrapping_mul(0xbf58_476d_1ce4_e5b9);
            partition.set_compactor(Box::new(MemCompactor::late(
                compactor_seed,
                COMPACTION_LATE_MAX,
            )));
            node.partitions.push(partition);
            self.wire
                .borrow_mut()
                .inboxes
                .insert((node.id, core), VecDeque::new());
        }
        node.holds.clear();
        node.write_done_us = vec![0; CORES];
    }

    /// Whether member `id` is up.
    pub fn up(&self, id: u64) -> bool {
        self.nodes[(id - 1) as usize].is_up()
    }

    /// Crashes member `id`: every core's partition is dropped, its unsynced writes are lost.
    pub fn crash(&mut self, id: u64) {
        let node = &mut self.nodes[(id - 1) as usize];
        if !node.is_up() {
            return;
        }
        for (core, partition) in std::mem::take(&mut node.partitions).into_iter().enumerate() {
            self.counts.restores += restores_of(&partition);
            self.counts.compactions_dropped += compactions_dropped_of(&partition);
            self.counts.adopted += partition.stats().adopted;
            node.images.push(partition.member().writer().crashed());
            self.wire.borrow_mut().inboxes.remove(&(id, core));
        }
        self.counts.crashes += 1;
    }

    /// Restarts member `id` from what its image recovers.
    pub fn restart(&mut self, id: u64, now_us: u64) {
        let mut node = std::mem::replace(
            &mut self.nodes[(id - 1) as usize],
            Node {
                id,
                offset_us: 0,
                partitions: Vec::new(),
                images: Vec::new(),
                incarnation: 0,
                wake_us: 0,
                holds: BTreeMap::new(),
                write_done_us: Vec::new(),
            },
        );
        if !node.is_up() {
            node.incarnation += 1;
            node.wake_us = now_us;
            self.start(&mut node);
        }
        self.nodes[(id - 1) as usize] = node;
    }

    /// Member `id`'s clock at global time `now_us`.
    pub fn local_us(&self, id: u64, now_us: u64) -> u64 {
        now_us + self.nodes[(id - 1) as usize].offset_us
    }

    fn linked(&self, from: u64, to: u64) -> bool {
        !matches!(self.isolated, Some(cut) if cut == from || cut == to)
    }

    /// Moves what members sent onto the network, with delays, loss and duplicates.
    pub fn transmit(&mut self, now_us: u64, rng: &mut Rng) {
        let sent = std::mem::take(&mut self.wire.borrow_mut().outbox);
        for (from, envelope) in sent {
            self.counts.sent += 1;
            let to = envelope.message.to;
            if !self.linked(from, to) {
                self.counts.cut += 1;
                continue;
            }
            if rng.percent(self.loss_percent) || self.in_flight.len() >= IN_FLIGHT_MAX {
                self.counts.lost += 1;
                continue;
            }
            let copies = if rng.percent(self.dup_percent) { 2 } else { 1 };
            self.counts.duplicated += copies - 1;
            for _ in 0..copies {
                let at = now_us + rng.below(DELAY_US_MAX + 1);
                self.next_seq += 1;
                let message = (to, envelope.shard, envelope.message.clone());
                self.in_flight.insert((at, self.next_seq), message);
            }
        }
    }

    /// When the next message arrives, if any is in flight.
    pub fn next_delivery_us(&self) -> Option<u64> {
        self.in_flight.keys().next().map(|(at, _)| *at)
    }

    /// Delivers every message due by `now_us` (dropping those to crashed or cut members).
    pub fn deliver(&mut self, now_us: u64) {
        while let Some(entry) = self.in_flight.first_entry() {
            if entry.key().0 > now_us {
                return;
            }
            let (to, shard, message) = entry.remove();
            let linked = self.linked(message.from, to);
            let mut wire = self.wire.borrow_mut();
            match wire.inboxes.get_mut(&(to, core_of(shard))) {
                Some(inbox) if linked && inbox.len() < INBOX_MAX => {
                    inbox.push_back((shard, message))
                }
                _ => self.counts.cut += 1,
            }
        }
    }

    /// Runs one client request of `client`'s session `session` on member `id` (which must be
    /// up); returns its answers.
    pub fn handle(
        &mut self,
        id: u64,
        now_us: u64,
        (session, client): (u64, ClientRef),
        op: latchkey::partition::Op,
        key: &[u8],
    ) -> Vec<Answer> {
        let local = self.local_us(id, now_us);
        let node = &mut self.nodes[(id - 1) as usize];
        let core = core_of(latchkey::cluster::partition::shard_of(key, SHARDS));
        let Some(partition) = node.partitions.get_mut(core) else {
            return Vec::new();
        };
        partition.handle(local, session, client, op, key);
        node.wake_us = node.wake_us.min(now_us + 10);
        partition.take_answers()
    }

    /// Client `client`'s session `session` to member `id` closed (a cut connection): every
    /// core of the member hears it, as a server's cores do.
    pub fn close_session(&mut self, id: u64, session: u64, client: ClientRef) {
        let node = &mut self.nodes[(id - 1) as usize];
        for partition in &mut node.partitions {
            partition.handle_session_closed(session, client);
        }
        node.wake_us = 0;
    }

    /// One loop iteration of member `id`; returns its answers, the tokens its machines
    /// stopped holding since its last iteration, and the holds (token, owner) they started.
    pub fn iterate(&mut self, id: u64, now_us: u64, jitter_us: u64) -> Iterated {
        let local = self.local_us(id, now_us);
        let node = &mut self.nodes[(id - 1) as usize];
        if !node.is_up() {
            return Iterated::default();
        }
        let mut answers = Vec::new();
        for (core, partition) in node.partitions.iter_mut().enumerate() {
            let done_us = &mut node.write_done_us[core];
            complete_due(partition, done_us, now_us, &mut self.writes);
            partition.handle_timers(local);
            answers.extend(partition.take_answers());
            schedule_round(partition, done_us, now_us, &mut self.writes);
        }
        let holds: BTreeMap<u64, u64> = (0..SHARDS)
            .filter_map(|shard| node.machine(shard))
            .flat_map(|machine| machine.holds().map(|(_, hold)| (hold.token, hold.owner)))
            .collect();
        let freed = node.holds.keys().filter(|t| !holds.contains_key(t));
        let freed = freed.copied().collect();
        let started = holds.iter().filter(|(t, _)| !node.holds.contains_key(t));
        let started = started.map(|(&token, &owner)| (token, owner)).collect();
        node.holds = holds;
        let deadline = node
            .partitions
            .iter()
            .filter_map(|partition| partition.next_deadline_us())
            .min()
            .map_or(u64::MAX, |at| at.saturating_sub(node.offset_us));
        node.wake_us = deadline.clamp(now_us + 10, now_us + 1000 + jitter_us);
        let rounds = node.write_done_us.iter().filter(|&&at| at != 0);
        node.wake_us = rounds.fold(node.wake_us, |wake, &at| wake.min(at));
        Iterated {
            answers,
            freed,
            started,
        }
    }

    /// Whether member `id` serves `shard` now.
    pub fn serving(&self, id: u64, shard: u32) -> bool {
        let node = &self.nodes[(id - 1) as usize];
        node.partition_of(shard).is_some_and(|p| p.serving(shard))
    }
}

/// What one iteration of a member gave (see [`World::iterate`]).
#[derive(Default)]
pub struct Iterated {
    /// Its answers.
    pub answers: Vec<Answer>,
    /// Tokens its machines stopped holding.
    pub freed: Vec<u64>,
    /// Holds (token, owner) its machines started: grants executed.
    pub started: Vec<(u64, u64)>,
}

/// Completes the writer's round of `partition` if it is due by `now_us`: all the batches
/// queued, or only the oldest few (the writer took the queue as it found it).
fn complete_due(partition: &mut SimPartition, done_us: &mut u64, now_us: u64, rng: &mut Rng) {
    if *done_us == 0 || *done_us > now_us {
        return;
    }
    *done_us = 0;
    let writer = partition.writer_mut();
    let queued = writer.queued() as u64;
    let count = if rng.percent(50) {
        queued
    } else {
        rng.between(1, queued.max(1))
    };
    writer.complete_some(count as usize);
}

/// Starts a writer's round when batches wait and none is under way.
fn schedule_round(partition: &SimPartition, done_us: &mut u64, now_us: u64, rng: &mut Rng) {
    if *done_us != 0 || partition.member().writer().queued() == 0 {
        return;
    }
    let took_us = if rng.percent(2) {
        rng.between(5_000, 30_000)
    } else {
        rng.between(50, 600)
    };
    *done_us = now_us + took_us;
}
