//! The simulated world: three members in one thread, a seeded network, faults, a clock, and
//! each member's log writer, whose completions come some simulated milliseconds after the
//! drain that handed it a batch (seeded: usually 0-3 ms, now and then a slow sync of up to
//! 30 ms), interleaved with the network's deliveries.

use super::check::{Checker, Machine};
use latchkey::cluster::mem_durable::{MemDurable, SyncMode};
use latchkey::cluster::mem_writer::MemWriter;
use latchkey::cluster::member::{Committed, Envelope, Member, Restore};
use latchkey::rng::Rng;
use protobuf::Message as _;
use raft::eraftpb::Message;
use std::collections::BTreeMap;

pub const MEMBERS: u64 = 3;
pub const SHARDS: u32 = 4;
const COMPACT_EVERY: u64 = 16;

/// Fault rates; all zero once the faults end.
#[derive(Clone, Copy)]
pub struct Faults {
    pub loss: u64,
    pub duplicate: u64,
    pub crash: u64,
    /// A crash right after a drain handed its writer a batch (lost unless synced).
    pub crash_in_flight: u64,
    pub partition: u64,
}

pub const FAULTS: Faults = Faults {
    loss: 50_000,
    duplicate: 20_000,
    crash: 600,
    crash_in_flight: 300,
    partition: 2_000,
};

pub const CALM: Faults = Faults {
    loss: 0,
    duplicate: 0,
    crash: 0,
    crash_in_flight: 0,
    partition: 0,
};

/// Per million per ms: a writer's round takes long (a slow sync).
const SLOW_SYNC: u64 = 20_000;

pub struct Node {
    pub id: u64,
    pub member: Option<Member<MemWriter>>,
    parked: Option<MemDurable>,
    /// When the writer's round under way completes (0: none under way).
    write_done_at: u64,
    pub down_until: u64,
    pub machines: BTreeMap<u32, Machine>,
    compacted: BTreeMap<u32, u64>,
    tick_offset: u64,
    incarnation: u64,
}

struct InFlight {
    at: u64,
    seq: u64,
    from: u64,
    to: u64,
    shard: u32,
    bytes: Vec<u8>,
}

/// Counts of what happened.
#[derive(Default, Debug, Clone, Copy)]
pub struct Stats {
    pub crashes: u64,
    /// Crashes with batches handed to the writer and not synced.
    pub in_flight_crashes: u64,
    /// Writer rounds completed.
    pub rounds: u64,
    pub partitions: u64,
    pub lost: u64,
    pub duplicated: u64,
    pub refused: u64,
    pub proposals: u64,
    pub fault_steps: u64,
    /// Snapshots restored (at restart or sent by a leader).
    pub restores: u64,
}

pub struct World {
    pub now: u64,
    pub rng: Rng,
    seed: u64,
    pub nodes: Vec<Node>,
    network: Vec<InFlight>,
    seq: u64,
    /// cut[a][b]: messages from a+1 to b+1 are dropped.
    cut: [[bool; 3]; 3],
    heal_at: u64,
    pub checker: Checker,
    pub stats: Stats,
    next_proposal: u64,
    /// Propose only to this shard (for the failover measurement).
    pub only_shard: Option<u32>,
}

fn shards() -> Vec<u32> {
    (0..SHARDS).collect()
}

fn voters() -> Vec<u64> {
    (1..=MEMBERS).collect()
}

impl World {
    pub fn new(seed: u64, sync_mode: SyncMode) -> World {
        let mut rng = Rng::new(seed);
        let nodes = (1..=MEMBERS)
            .map(|id| {
                let mut durable = MemDurable::new();
                durable.set_sync_mode(sync_mode);
                let writer = MemWriter::new(durable);
                let member = Member::new(id, &voters(), &shards(), writer, Vec::new(), seed)
                    .expect("a fresh member");
                Node {
                    id,
                    member: Some(member),
                    parked: None,
                    write_done_at: 0,
                    down_until: 0,
                    machines: BTreeMap::new(),
                    compacted: BTreeMap::new(),
                    tick_offset: rng.below(10),
                    incarnation: 0,
                }
            })
            .collect();
        World {
            now: 0,
            rng,
            seed,
            nodes,
            network: Vec::new(),
            seq: 0,
            cut: [[false; 3]; 3],
            heal_at: 0,
            checker: Checker::default(),
            stats: Stats::default(),
            next_proposal: 1,
            only_shard: None,
        }
    }

    pub fn crash(&mut self, at: usize, down_ms: u64) {
        let node = &mut self.nodes[at];
        let Some(member) = node.member.take() else {
            return;
        };
        // Batches queued for the writer or written and not synced are lost.
        if member.writer().queued() > 0 {
            self.stats.in_flight_crashes += 1;
        }
        node.parked = Some(member.writer().crashed());
        node.write_done_at = 0;
        node.down_until = self.now + down_ms;
        node.machines.clear();
        node.compacted.clear();
        self.stats.crashes += 1;
    }

    pub fn restart(&mut self, at: usize) {
        let node = &mut self.nodes[at];
        let Some(durable) = node.parked.take() else {
            return;
        };
        node.incarnation += 1;
        let seed = self.seed ^ node.incarnation.wrapping_mul(0x5851_F42D_4C95_7F2D);
        let recovered = durable.recovered();
        let writer = MemWriter::new(durable);
        let member = Member::new(node.id, &voters(), &shards(), writer, recovered, seed);
        node.member = Some(member.expect("a member rebuilt from its synced image"));
    }

    /// Sends `envelopes` from member `from` over the seeded network.
    fn send(&mut self, from: u64, envelopes: Vec<Envelope>, faults: Faults) {
        for Envelope { shard, message } in envelopes {
            let to = message.to;
            if !(1..=MEMBERS).contains(&to) || self.cut[(from - 1) as usize][(to - 1) as usize] {
                continue;
            }
            if self.rng.per_million(faults.loss) {
                self.stats.lost += 1;
                continue;
            }
            let bytes = message.write_to_bytes().expect("encode a raft message");
            let copies = if self.rng.per_million(faults.duplicate) {
                2
            } else {
                1
            };
            self.stats.duplicated += copies - 1;
            for _ in 0..copies {
                self.seq += 1;
                let at = self.now + self.rng.below(21);
                let (seq, bytes) = (self.seq, bytes.clone());
                self.network.push(InFlight {
                    at,
                    seq,
                    from,
                    to,
                    shard,
                    bytes,
                });
            }
        }
    }

    fn deliver(&mut self) {
        let mut due: Vec<InFlight> = Vec::new();
        let mut later = Vec::with_capacity(self.network.len());
        for flight in self.network.drain(..) {
            if flight.at <= self.now {
                due.push(flight);
            } else {
                later.push(flight);
            }
        }
        self.network = later;
        due.sort_by_key(|f| (f.at, f.seq));
        for flight in due {
            if self.cut[(flight.from - 1) as usize][(flight.to - 1) as usize] {
                continue;
            }
            let node = &mut self.nodes[(flight.to - 1) as usize];
            let Some(member) = node.member.as_mut() else {
                continue;
            };
            let Ok(message) = Message::parse_from_bytes(&flight.bytes) else {
                panic!("a message the network carried intact does not decode");
            };
            if member.step(flight.shard, message).is_err() {
                self.stats.refused += 1;
            }
        }
    }

    fn apply(&mut self, at: usize, restores: &[Restore], committed: &[Committed]) {
        let now = self.now;
        let node = &mut self.nodes[at];
        self.stats.restores += restores.len() as u64;
        for restore in restores {
            let machine = node.machines.entry(restore.shard).or_default();
            let (shard, index) = (restore.shard, restore.index);
            self.checker
                .restore(now, node.id, machine, shard, index, &restore.data);
            node.compacted.insert(shard, index);
        }
        for entry in committed {
            let machine = node.machines.entry(entry.shard).or_default();
            self.checker.apply(now, node.id, machine, entry);
        }
    }

    /// One drain of node `at`; may crash it right after, with its batch handed to the
    /// writer and not synced.
    fn drain(&mut self, at: usize, faults: Faults) {
        let Some(member) = self.nodes[at].member.as_mut() else {
            return;
        };
        if !member.has_ready() {
            return;
        }
        let from = member.id();
        let drain = member.drain().expect("a drain on a healthy image");
        self.send(from, drain.messages, faults);
        self.apply(at, &drain.restores, &drain.committed);
        if self.rng.per_million(faults.crash_in_flight) {
            let down = 20 + self.rng.below(300);
            self.crash(at, down);
            return;
        }
        self.compact(at);
    }

    /// Node `at`'s writer: a round starts when batches are queued and none is under way, and
    /// completes some simulated ms later, taking every batch queued by then or only the
    /// oldest few (a round ends where the writer found the queue's end).
    fn write(&mut self, at: usize) {
        let node = &mut self.nodes[at];
        let Some(member) = node.member.as_mut() else {
            return;
        };
        let queued = member.writer().queued();
        if node.write_done_at == 0 {
            if queued > 0 {
                let slow = self.rng.per_million(SLOW_SYNC);
                let took = if slow {
                    self.rng.below(31)
                } else {
                    self.rng.below(4)
                };
                node.write_done_at = self.now + took;
            }
            return;
        }
        if node.write_done_at > self.now {
            return;
        }
        node.write_done_at = 0;
        let count = if self.rng.per_million(500_000) {
            queued
        } else {
            1 + self.rng.below(queued as u64) as usize
        };
        if member.writer_mut().complete_some(count) {
            self.stats.rounds += 1;
        }
    }

    fn compact(&mut self, at: usize) {
        let node = &mut self.nodes[at];
        let Some(member) = node.member.as_mut() else {
            return;
        };
        for (shard, machine) in &node.machines {
            let done = node.compacted.get(shard).copied().unwrap_or(0);
            if machine.applied >= done + COMPACT_EVERY {
                member
                    .compact(*shard, machine.applied, machine.encode())
                    .expect("compact what was applied");
                node.compacted.insert(*shard, machine.applied);
            }
        }
    }

    fn propose(&mut self) {
        let any = self.rng.below(u64::from(SHARDS)) as u32;
        let shard = self.only_shard.unwrap_or(any);
        let id = self.next_proposal;
        let mut data = id.to_le_bytes().to_vec();
        let extra = self.rng.below(24) as usize;
        data.extend((0..extra).map(|_| self.rng.next_u64() as u8));
        let start = self.rng.below(MEMBERS) as usize;
        let count = self.nodes.len();
        for k in 0..count {
            let node = &mut self.nodes[(start + k) % count];
            let Some(member) = node.member.as_mut() else {
                continue;
            };
            if member.leader(shard) != Some(node.id) {
                continue;
            }
            if let Ok(at) = member.propose(shard, data) {
                self.checker.proposed(id, shard, at);
                self.checker.note_proposed_at(id, self.now);
                self.next_proposal += 1;
                self.stats.proposals += 1;
            }
            return;
        }
    }

    fn faults(&mut self, faults: Faults) {
        if self.heal_at != 0 && self.now >= self.heal_at {
            self.cut = [[false; 3]; 3];
            self.heal_at = 0;
        }
        for at in 0..self.nodes.len() {
            let node = &self.nodes[at];
            if node.member.is_none() && node.down_until <= self.now {
                self.restart(at);
            } else if node.member.is_some() && self.rng.per_million(faults.crash) {
                let down = 20 + self.rng.below(500);
                self.crash(at, down);
            }
        }
        if self.heal_at == 0 && self.rng.per_million(faults.partition) {
            self.partition();
        }
    }

    fn partition(&mut self) {
        self.stats.partitions += 1;
        let a = self.rng.below(MEMBERS) as usize;
        let b = (a + 1 + self.rng.below(MEMBERS - 1) as usize) % MEMBERS as usize;
        match self.rng.below(3) {
            // Isolate a.
            0 => {
                for other in 0..MEMBERS as usize {
                    if other != a {
                        self.cut[a][other] = true;
                        self.cut[other][a] = true;
                    }
                }
            }
            // Cut one link both ways.
            1 => {
                self.cut[a][b] = true;
                self.cut[b][a] = true;
            }
            // Cut one direction only.
            _ => self.cut[a][b] = true,
        }
        self.heal_at = self.now + 100 + self.rng.below(900);
    }

    /// Heals everything: partitions, down members.
    pub fn heal(&mut self) {
        self.cut = [[false; 3]; 3];
        self.heal_at = 0;
        for at in 0..self.nodes.len() {
            self.restart(at);
        }
    }

    pub fn faulty(&self) -> bool {
        self.heal_at != 0 || self.nodes.iter().any(|n| n.member.is_none())
    }

    /// One simulated millisecond.
    pub fn step(&mut self, faults: Faults, propose_per_million: u64) {
        self.now += 1;
        self.faults(faults);
        if self.faulty() {
            self.stats.fault_steps += 1;
        }
        // Writers' completions and the network's deliveries in a seeded order.
        let writes_first = self.rng.per_million(500_000);
        if writes_first {
            (0..self.nodes.len()).for_each(|at| self.write(at));
        }
        self.deliver();
        if !writes_first {
            (0..self.nodes.len()).for_each(|at| self.write(at));
        }
        for node in &mut self.nodes {
            if let Some(member) = node.member.as_mut() {
                if (self.now + node.tick_offset) % 10 == 0 {
                    member.tick();
                }
            }
        }
        if self.rng.per_million(propose_per_million) {
            self.propose();
        }
        let live: Vec<u64> = self
            .nodes
            .iter()
            .filter(|n| n.member.is_some())
            .map(|n| n.id)
            .collect();
        for at in 0..self.nodes.len() {
            self.drain(at, faults);
            if let Some(member) = self.nodes[at].member.as_mut() {
                member.balance(&live);
            }
        }
        self.check_leaders();
    }

    fn check_leaders(&mut self) {
        for node in &self.nodes {
            let Some(member) = node.member.as_ref() else {
                continue;
            };
            for shard in 0..SHARDS {
                if member.leader(shard) == Some(node.id) {
                    self.checker
                        .leader(self.now, shard, member.term(shard), node.id);
                }
            }
        }
    }

    /// After healing: every member agrees on each shard's leader, commit and applied state.
    pub fn converged(&self) -> Result<(), String> {
        for shard in 0..SHARDS {
            let mut seen = Vec::new();
            for node in &self.nodes {
                let member = node
                    .member
                    .as_ref()
                    .ok_or(format!("member {} down", node.id))?;
                let machine = node.machines.get(&shard).copied().unwrap_or_default();
                seen.push((member.leader(shard), member.commit(shard), machine));
            }
            if seen[0].0.is_none() || seen.iter().any(|s| *s != seen[0]) {
                let roles: Vec<_> = self
                    .nodes
                    .iter()
                    .filter_map(|n| n.member.as_ref())
                    .map(|m| (m.role(shard), m.term(shard)))
                    .collect();
                return Err(format!("shard {shard} not converged: {seen:?} {roles:?}"));
            }
        }
        Ok(())
    }
}
