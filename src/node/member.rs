//! Starting a cluster member: its data directory, then per core a write-ahead log and the
//! writer thread that owns it, the snapshot worker thread (compactions off the loop), the Raft
//! groups of the core's shards and the [`ClusterPartition`] that serves them; one peer thread
//! for the member.
//!
//! The data directory is locked and its record checked ([`DataDir`]) before anything in it is
//! opened: a second process on the same directory, or a start whose node id, cluster or core
//! count differs from what the directory holds, is refused naming the key. A core count that
//! differed would look for the shards' logs in the wrong directories.

use crate::cluster::backup::{BackupFile, InitialState, FILE_BYTES_MAX};
use crate::cluster::compactor::SnapWorker;
use crate::cluster::data_dir::{DataDir, Expected};
use crate::cluster::member::{Envelope, Member};
use crate::cluster::partition::{shards_of_core, ClusterPartition, PartitionSettings, Peers};
use crate::cluster::peer::tls::PeerTls;
use crate::cluster::peer::{
    self, CorePoll, CoreReader, Outgoing, PeerConfig, PeerHandle, PeerLimits,
};
use crate::cluster::wal::Wal;
use crate::cluster::writer::Writer;
use crate::cluster::{Durable, Recovered};
use crate::config::{ClusterConfig, Config};
use crate::partition::cluster_stats::PeerReport;
use crate::partition::QueueCounts;
use crate::partition::PARTITION_SOURCES;
use crate::server::{Backend, Beside, Started, PARTITION_TOKEN_BASE};
use crossbeam_channel::Receiver;
use mio::{Registry, Waker};
use raft::eraftpb::{ConfState, HardState, Message, Snapshot};
use std::io::{self, Read};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{SystemTime, UNIX_EPOCH};

/// Raft messages from the peer thread (or another core's reader) waiting for one core at most.
const INBOUND_DEPTH: usize = 65_536;

// A core reserves a token for each connection its reader may hold.
const _: () = assert!(peer::SOURCES <= PARTITION_SOURCES);

/// A core's way to the other members: the peer thread's handle, the core's inbound channel
/// (messages the peer thread or another core read for it), and the connections it reads on
/// its own loop.
pub struct CorePeers {
    handle: PeerHandle,
    inbound: Receiver<(u32, Message)>,
    reader: CoreReader,
}

/// Hands `batch` to the peer thread. A full channel drops it (counted): Raft retransmits.
fn send_envelopes(handle: &PeerHandle, batch: Vec<Envelope>) {
    let batch = batch
        .into_iter()
        .map(|envelope| Outgoing {
            to: envelope.message.to,
            shard: envelope.shard,
            message: envelope.message,
        })
        .collect();
    handle.send_batch(batch);
}

impl Peers for CorePeers {
    fn send(&mut self, batch: Vec<Envelope>) {
        send_envelopes(&self.handle, batch);
    }

    fn try_recv(&mut self) -> Option<(u32, Message)> {
        // The channel first: what the peer thread read of a connection before handing it over
        // comes before what this core reads of it.
        self.inbound.try_recv().ok().or_else(|| self.reader.recv())
    }

    fn on_ready(&mut self, source: usize) {
        self.reader.on_ready(source);
    }

    fn has_pending(&self) -> bool {
        !self.inbound.is_empty() || self.reader.has_pending()
    }

    fn report(&self) -> Option<PeerReport> {
        Some(self.handle.report())
    }

    fn cluster_version(&self) -> u8 {
        self.handle.cluster_version()
    }
}

/// A member's partition on one core. Dropping it (when its core's loop ends) lets the core's
/// writer write what is queued and waits for the writer thread, so the log is closed before the
/// data directory is unlocked.
pub type MemberPartition = ClusterPartition<Writer, CorePeers>;

/// The member's peer thread, stopped after the cores.
pub struct PeerThread {
    handle: PeerHandle,
    thread: JoinHandle<()>,
}

impl PeerThread {
    /// Stops the peer thread and waits for it.
    pub fn stop(self) {
        self.handle.stop();
        if self.thread.join().is_err() {
            log::error!("the peer thread panicked");
        }
    }
}

/// A cluster member as the server's [`Backend`]: its data directory (locked and checked by
/// [`MemberBackend::open`] before the server binds anything), its configuration, and its peer
/// TLS (`[cluster.tls]`, its files read and checked by the same).
pub struct MemberBackend {
    cluster: ClusterConfig,
    data_dir: DataDir,
    tls: Option<PeerTls>,
}

impl MemberBackend {
    /// Reads and checks the `[cluster.tls]` files (a bad one stops the member before its data
    /// directory is touched), checks what cluster mode asks of `config`, locks the member's
    /// data directory and checks its record: the first things a member does.
    pub fn open(config: &Config, cluster: &ClusterConfig) -> io::Result<MemberBackend> {
        let tls = (cluster.tls.as_ref())
            .map(|files| PeerTls::load(files, cluster.node_id))
            .transpose()?;
        let restore = read_restore(cluster)?;
        let data_dir = open_data_dir(config, cluster, restore.as_deref())?;
        Ok(MemberBackend {
            cluster: cluster.clone(),
            data_dir,
            tls,
        })
    }
}

/// What runs beside a member's cores: the peer thread, then the data directory, unlocked
/// when it drops (after the cores and the peer thread stopped).
struct MemberBeside {
    peers: PeerThread,
    _data_dir: DataDir,
}

impl Beside for MemberBeside {
    fn stop(self: Box<Self>) {
        self.peers.stop();
    }
}

impl Backend for MemberBackend {
    type Partition = MemberPartition;

    fn start(
        self,
        config: &Config,
        cores: (&[Arc<Waker>], Vec<Registry>),
        queues: Option<Arc<dyn QueueCounts>>,
    ) -> io::Result<Started<MemberPartition>> {
        let data_dir = (self.data_dir.incarnation(), self.data_dir.peers_file());
        let cluster = (&self.cluster, self.tls, data_dir);
        let (partitions, peers) = start(config, cluster, cores, queues)?;
        let beside = MemberBeside {
            peers,
            _data_dir: self.data_dir,
        };
        Ok((partitions, Box::new(beside)))
    }
}

/// Checks what cluster mode asks of `config` (again, for a configuration built in code), then
/// locks the member's data directory and checks its record: the first thing a member does, and
/// what it holds until it exits. At its first start from a backup (`restore`), every core's log
/// is seeded with its shards' initial states before the record is written: a start interrupted
/// meanwhile finds logs without a record and is refused, never silently empty.
fn open_data_dir(
    config: &Config,
    cluster: &ClusterConfig,
    restore: Option<&[InitialState]>,
) -> io::Result<DataDir> {
    config
        .check_cluster_mode()
        .map_err(|e| io::Error::new(io::ErrorKind::InvalidInput, e.to_string()))?;
    let cores = config.server.cores;
    let expected = Expected::of(cluster, cores);
    let Some(states) = restore else {
        return DataDir::open(&cluster.data_dir, &expected);
    };
    let voters = cluster.voters();
    let mut seed = |dir: &Path| {
        for core in 0..cores {
            let (mut wal, recovered) = open_log(dir, core, cluster.fsync)?;
            let shards = shards_of_core(core, cores, cluster.shards);
            seed_from_backup(&mut wal, states, (&shards, &voters), &recovered)?;
        }
        Ok(())
    };
    DataDir::open_seeding(&cluster.data_dir, &expected, &mut seed)
}

/// Core `core`'s write-ahead log in `data_dir`, and what it recovered.
fn open_log(data_dir: &Path, core: usize, fsync: bool) -> io::Result<(Wal, Vec<(u32, Recovered)>)> {
    let dir = data_dir.join(format!("core-{core}"));
    Wal::open(&dir, fsync)
        .map_err(|e| io::Error::new(e.kind(), format!("cluster.data_dir {}: {e}", dir.display())))
}

/// With `cluster.restore_from` and a data directory that holds no data yet (its first start),
/// every shard's initial state from the backup file; `None` otherwise (logged once when the key
/// is ignored). A file that cannot be read, is not a whole backup, or is of another shard count
/// is refused naming the key, before the data directory is created.
fn read_restore(cluster: &ClusterConfig) -> io::Result<Option<Vec<InitialState>>> {
    let Some(path) = &cluster.restore_from else {
        return Ok(None);
    };
    if DataDir::holds_data(&cluster.data_dir)? {
        log::info!(
            "cluster.restore_from {} ignored: cluster.data_dir {} holds this member's data \
             already (the key counts at a member's first start only)",
            path.display(),
            cluster.data_dir.display()
        );
        return Ok(None);
    }
    let refused = |why: String| {
        let message = format!("cluster.restore_from {}: {why}", path.display());
        io::Error::new(io::ErrorKind::InvalidData, message)
    };
    let bytes = read_bounded(path).map_err(|e| refused(e.to_string()))?;
    let file = BackupFile::decode(&bytes).map_err(|e| refused(e.to_string()))?;
    let states = (file.initial_states(cluster.shards)).map_err(|e| refused(e.to_string()))?;
    log::info!(
        "cluster.restore_from {}: first start from a backup of {} shards, {} locks",
        path.display(),
        states.len(),
        file.locks()
    );
    Ok(Some(states))
}

/// The bytes of `path`, refused past [`FILE_BYTES_MAX`].
fn read_bounded(path: &Path) -> io::Result<Vec<u8>> {
    let mut bytes = Vec::new();
    std::fs::File::open(path)?
        .take(FILE_BYTES_MAX + 1)
        .read_to_end(&mut bytes)?;
    if bytes.len() as u64 > FILE_BYTES_MAX {
        let message = format!("larger than a backup may be ({FILE_BYTES_MAX} bytes)");
        return Err(io::Error::new(io::ErrorKind::InvalidData, message));
    }
    Ok(bytes)
}

/// Records each of `states` of `shards` (a core's) as its shard's snapshot and hard state
/// (commit at the snapshot) in that core's fresh log, synced: the same initial state on every
/// member, which the core recovers when it opens the log. A shard the log holds is left alone.
fn seed_from_backup(
    wal: &mut Wal,
    states: &[InitialState],
    (shards, voters): (&[u32], &[u64]),
    recovered: &[(u32, Recovered)],
) -> io::Result<()> {
    for state in states {
        let held = recovered.iter().any(|(shard, _)| *shard == state.shard);
        if !shards.contains(&state.shard) || held {
            continue;
        }
        let mut snapshot = Snapshot::default();
        snapshot.set_data(state.data.clone().into());
        let metadata = snapshot.mut_metadata();
        metadata.index = state.index;
        metadata.term = state.term;
        metadata.set_conf_state(ConfState::from((voters.to_vec(), vec![])));
        let hard_state = HardState {
            term: state.term,
            vote: 0,
            commit: state.index,
            ..Default::default()
        };
        wal.apply_snapshot(state.shard, &snapshot)?;
        wal.set_hard_state(state.shard, &hard_state)?;
    }
    wal.sync()
}

/// Opens every core's log, builds its groups and partition, and starts the peer thread. The
/// data directory must be open ([`open_data_dir`]): its incarnation and peers file are given.
fn start(
    config: &Config,
    (cluster, tls, (incarnation, peers_file)): (&ClusterConfig, Option<PeerTls>, (u64, PathBuf)),
    (wakers, registries): (&[Arc<Waker>], Vec<Registry>),
    queues: Option<Arc<dyn QueueCounts>>,
) -> io::Result<(Vec<MemberPartition>, PeerThread)> {
    let cores = config.server.cores;
    let this = cluster
        .this_member()
        .ok_or_else(|| io::Error::other("cluster.node_id is not a member"))?;
    let channels: Vec<_> = (0..cores)
        .map(|_| crossbeam_channel::bounded(INBOUND_DEPTH))
        .collect();
    let seed = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos() as u64)
        ^ cluster.node_id;
    let peer_config = PeerConfig {
        node_id: cluster.node_id,
        listen: this.peer,
        peers: cluster.members.iter().map(|m| (m.id, m.peer)).collect(),
        shards: cluster.shards,
        identity: cluster.identity().digest,
        seed,
        limits: PeerLimits::default(),
        tls,
        incarnation,
        peers_file: Some(peers_file),
    };
    let inbound = channels
        .iter()
        .zip(wakers)
        .map(|((sender, _), waker)| (sender.clone(), Arc::clone(waker)))
        .collect();
    let polls = (registries.into_iter())
        .map(|registry| CorePoll {
            registry,
            token_base: PARTITION_TOKEN_BASE,
        })
        .collect();
    let route = move |shard| shard as usize % cores;
    let (handle, thread, readers) = peer::spawn_with_readers(peer_config, inbound, polls, route)
        .map_err(|e| {
            io::Error::new(e.kind(), format!("cluster peer address {}: {e}", this.peer))
        })?;
    let peer_thread = PeerThread { handle, thread };
    let mut partitions = Vec::with_capacity(cores);
    for (core, ((_, receiver), reader)) in channels.into_iter().zip(readers).enumerate() {
        let waker = Arc::clone(&wakers[core]);
        let handle = &peer_thread.handle;
        let peers = CorePeers {
            handle: handle.clone(),
            inbound: receiver,
            reader,
        };
        match core_partition(config, cluster, (core, waker), seed, handle, peers) {
            Ok(mut partition) => {
                // With more than one core a session's acquires may queue on several.
                if let Some(queues) = &queues {
                    partition.share_queue_counts(Arc::clone(queues));
                }
                partitions.push(partition);
            }
            Err(error) => {
                peer_thread.stop();
                return Err(error);
            }
        }
    }
    Ok((partitions, peer_thread))
}

fn core_partition(
    config: &Config,
    cluster: &ClusterConfig,
    (core, waker): (usize, Arc<mio::Waker>),
    seed: u64,
    handle: &PeerHandle,
    peers: CorePeers,
) -> io::Result<MemberPartition> {
    let cores = config.server.cores;
    let (wal, recovered) = open_log(&cluster.data_dir, core, cluster.fsync)?;
    let shards = shards_of_core(core, cores, cluster.shards);
    let voters = cluster.voters();
    // The compactor wakes the core once per snapshot it encoded (and when it failed).
    let snap_waker = Arc::clone(&waker);
    let snap_wake = move || {
        if let Err(error) = snap_waker.wake() {
            log::error!("core {core}: waking the core after a snapshot was encoded: {error}");
        }
    };
    // The writer wakes the core once per round it wrote (and when it failed).
    let wake = move || {
        if let Err(error) = waker.wake() {
            log::error!("core {core}: waking the core after a write-ahead log round: {error}");
        }
    };
    // It sends the messages that wait for its writes itself (append responses, votes).
    let writer_peers = handle.clone();
    let send = move |batch| send_envelopes(&writer_peers, batch);
    let writer = Writer::spawn(format!("latchkey-wal-{core}"), wal, wake, send)?;
    let member = Member::new(cluster.node_id, &voters, &shards, writer, recovered, seed)
        .map_err(|e| io::Error::other(format!("cluster core {core}: {e}")))?;
    let settings = PartitionSettings {
        node_id: cluster.node_id,
        shards: cluster.shards,
        core,
        cores,
        clients: cluster.members.iter().map(|m| (m.id, m.client)).collect(),
        max_waiters_per_key: config.limits.max_waiters_per_key,
        max_keys_per_shard: (config.limits.max_keys / cluster.shards as usize).max(1),
        max_pending_per_session: config.limits.max_pending_per_session,
        compact_every: crate::cluster::partition::compact_every(cluster.shards),
        tick_us: u64::from(config.timer.tick_ms) * 1_000,
    };
    let compactor = SnapWorker::spawn(format!("latchkey-snap-{core}"), snap_wake)?;
    let partition = ClusterPartition::with_compactor(settings, member, peers, Box::new(compactor));
    Ok(partition)
}
