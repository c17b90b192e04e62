//! The two partitions under test behind one interface: the single node's [`LockTable`] and a
//! one-member cluster's [`ClusterPartition`] (its own majority: it elects itself and serves) on
//! [`MemDurable`] (behind a [`MemWriter`] that syncs every batch at once), both driven on the same virtual clock.
//!
//! Settling: a cluster partition answers a request only once its entry applied, which takes
//! loop iterations. [`Subject::settle`] runs `handle_timers` at the same instant until nothing
//! is ready (a one-member group commits what it proposed within an iteration or two), so that
//! after every step both subjects are compared in the same, quiet state, on the same clock.
//! That is the one documented difference allowed (docs/cluster-design.md: the cluster answers
//! after its entry applies); a one-member cluster never answers `M`.

use latchkey::cluster::mem_durable::MemDurable;
use latchkey::cluster::mem_writer::MemWriter;
use latchkey::cluster::member::{Envelope, Member};
use latchkey::cluster::partition::{ClusterPartition, PartitionSettings, Peers};
use latchkey::lock_table::{LockTable, TableConfig};
use latchkey::partition::{Answer, ClientRef, Op, Partition, SessionId};
use latchkey::tokens::TokenRange;
use latchkey_client::protocol::Response;
use raft::eraftpb::Message;
use std::collections::HashMap;

/// Iterations one settle may take before the subject is declared stuck.
const SETTLE_ITERATIONS_MAX: usize = 64;

/// A one-member cluster has no peers.
pub struct NoPeers;

impl Peers for NoPeers {
    fn send(&mut self, _batch: Vec<Envelope>) {}

    fn try_recv(&mut self) -> Option<(u32, Message)> {
        None
    }
}

/// The cluster partition under test.
pub type OneMember = ClusterPartition<MemWriter, NoPeers>;

/// Which partition.
pub enum Part {
    Table(Box<LockTable>),
    Cluster(Box<OneMember>),
}

/// One held key as a subject shows it: holder's owner, queued acquires, lease left (µs).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Shown {
    pub owner: u64,
    pub waiters: u32,
    pub lease_left_us: u64,
}

/// A partition under test and what the test tracks of it.
pub struct Subject {
    pub name: &'static str,
    pub part: Part,
    /// The subject's token of each grant, by the model's token of it.
    pub by_logical: HashMap<u64, u64>,
    /// Per key, the last token granted: tokens of a key strictly increase.
    pub last: Vec<u64>,
    /// Tokens of the releases and extends sent since it last settled (each answer echoes one).
    pub sent: Vec<u64>,
    /// Answers taken out before settling (see [`Subject::close`]).
    early: Vec<Answer>,
    /// Lease time the subject may show beyond the model's (never less): its granularity.
    pub lease_slack_us: u64,
}

/// The limits both subjects enforce.
#[derive(Clone, Copy, Debug)]
pub struct Limits {
    pub max_keys: usize,
    pub max_waiters_per_key: u32,
    pub max_pending_per_session: u32,
}

impl Subject {
    fn new(name: &'static str, part: Part, keys: usize, lease_slack_us: u64) -> Subject {
        Subject {
            name,
            part,
            by_logical: HashMap::new(),
            last: vec![0; keys],
            sent: Vec::new(),
            early: Vec::new(),
            lease_slack_us,
        }
    }

    /// The single node's table at `now_us`, ticking every millisecond (the default), with
    /// tokens that never run out.
    pub fn table(limits: Limits, keys: usize, now_us: u64) -> Subject {
        let config = TableConfig {
            max_keys: limits.max_keys,
            max_waiters_per_key: limits.max_waiters_per_key,
            max_pending_per_session: limits.max_pending_per_session,
            tick_us: 1000,
        };
        let tokens = TokenRange {
            next: 1,
            step: 1,
            limit: u64::MAX,
        };
        let table = LockTable::new(config, now_us, tokens);
        Subject::new("table", Part::Table(Box::new(table)), keys, 0)
    }

    /// A one-member cluster of `shards` shards on one core, elected and serving; returns it
    /// with the time it serves from (from `start_us`, whole milliseconds). `max_keys` is the
    /// per-shard cap (the server sets `max_keys / shards`).
    pub fn cluster(
        limits: Limits,
        shards: u32,
        keys: usize,
        start_us: u64,
        seed: u64,
    ) -> (Subject, u64) {
        let hosted: Vec<u32> = (0..shards).collect();
        let writer = MemWriter::immediate(MemDurable::new());
        let member =
            Member::new(1, &[1], &hosted, writer, Vec::new(), seed).expect("a one-member member");
        let settings = PartitionSettings {
            node_id: 1,
            shards,
            core: 0,
            cores: 1,
            clients: vec![(1, "127.0.0.1:7420".parse().unwrap())],
            max_waiters_per_key: limits.max_waiters_per_key,
            max_keys_per_shard: limits.max_keys,
            max_pending_per_session: limits.max_pending_per_session,
            compact_every: 1 + seed % 300,
            tick_us: 1_000,
        };
        let mut partition = ClusterPartition::new(settings, member, NoPeers);
        let mut now_us = start_us;
        // Elections take 10–20 ticks of 10 ms: a few seconds of virtual time is ample.
        for _ in 0..5_000 {
            if hosted.iter().all(|&shard| partition.serving(shard)) {
                let answers = partition.take_answers();
                assert!(
                    answers.is_empty(),
                    "answers before any request: {answers:?}"
                );
                // The cluster counts leases in whole milliseconds, rounded up (never early):
                // off the grid, a lease reads up to a millisecond more than the model's.
                let part = Part::Cluster(Box::new(partition));
                return (Subject::new("cluster", part, keys, 1000), now_us);
            }
            now_us += 1000;
            partition.handle_timers(now_us);
        }
        panic!("the one-member groups did not elect themselves");
    }

    pub fn partition(&mut self) -> &mut dyn Partition {
        match &mut self.part {
            Part::Table(table) => table.as_mut(),
            Part::Cluster(cluster) => cluster.as_mut(),
        }
    }

    fn partition_ref(&self) -> &dyn Partition {
        match &self.part {
            Part::Table(table) => table.as_ref(),
            Part::Cluster(cluster) => cluster.as_ref(),
        }
    }

    /// Runs the loop at `now_us` until nothing is left to do at that instant; every answer.
    pub fn settle(&mut self, now_us: u64) -> Result<Vec<Answer>, String> {
        let mut answers = std::mem::take(&mut self.early);
        answers.extend(self.take());
        for _ in 0..SETTLE_ITERATIONS_MAX {
            self.partition().handle_timers(now_us);
            answers.extend(self.take());
            let next = self.partition().next_deadline_us();
            if next.map_or(true, |next| next > now_us) {
                if let Part::Table(table) = &self.part {
                    table.check_invariants();
                }
                return Ok(answers);
            }
        }
        Err(format!(
            "{}: still busy after {SETTLE_ITERATIONS_MAX} iterations",
            self.name
        ))
    }

    fn take(&mut self) -> Vec<Answer> {
        let partition = self.partition();
        let answers = partition.take_answers();
        let kept = answers.clone();
        partition.return_answers(answers);
        kept
    }

    /// `session` closes. Its grants answered but not delivered yet (they would be in the
    /// session's unwritten output) are released, as a server's core does
    /// (`Partition::release_granted`); grants still in flight are the partition's business.
    pub fn close(&mut self, now_us: u64, session: SessionId) {
        // Withdrawn first, its waiters cannot be handed what its grants give back.
        self.partition()
            .handle_session_closed(session, ClientRef::NONE);
        let mut taken = std::mem::take(&mut self.early);
        taken.extend(self.take());
        for answer in taken {
            match answer.response {
                Response::Acquired { token, .. } if answer.session == session => {
                    self.partition()
                        .release_granted(now_us, answer.grant, token, ClientRef::NONE);
                }
                _ => self.early.push(answer),
            }
        }
    }

    /// A keyed request at `now_us` (its answers come with the next settle).
    pub fn send(&mut self, now_us: u64, session: SessionId, op: Op, key: &[u8]) {
        self.partition()
            .handle(now_us, session, ClientRef::NONE, op, key);
    }

    /// Every held key (by index into `keys`) as of `now_us`, and the queued acquires in all.
    pub fn shown(&self, now_us: u64, keys: &[Vec<u8>]) -> (Vec<Option<Shown>>, usize) {
        let mut shown = vec![None; keys.len()];
        let partition = self.partition_ref();
        let mut cursor = 0;
        loop {
            let next = partition.scan_held(now_us, cursor, 1024, b"", &mut |held| {
                let at = keys.iter().position(|key| key[..] == held.key[..]);
                let at = at.expect("a key the test never used");
                shown[at] = Some(Shown {
                    owner: held.owner,
                    waiters: held.waiters,
                    lease_left_us: held.lease_left_us,
                });
            });
            match next {
                Some(next) => cursor = next,
                None => break,
            }
        }
        let held = shown.iter().flatten().count();
        assert_eq!(held, partition.key_count(), "{}: key count", self.name);
        (shown, partition.waiter_count())
    }
}
