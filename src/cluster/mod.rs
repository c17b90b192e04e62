//! Cluster mode: the lock table replicated over several members with raft-rs (issue 12).
//!
//! The key space is cut into a fixed number of *shards* by key hash (`[cluster] shards`, the
//! same on every member); each shard is one Raft group over all members. A member's cores each
//! host the groups of the shards they own, and leadership is spread over the members.
//!
//! | file | responsibility |
//! |---|---|
//! | `data_dir.rs` | [`data_dir::DataDir`]: the member's `data_dir`, locked for the life of the process, and its record of the member, the cluster's identity and the core count, checked at every start |
//! | `durable.rs` | [`Durable`]: what a member must make durable (entries, hard states, snapshots), synced by its core's writer for every group at once; what it recovers |
//! | `machine.rs` | [`machine::ShardMachine`]: one shard's replicated lock state (holds, tokens, local deadlines), applied from committed entries; `machine/codec.rs`: the bytes of its commands and snapshots |
//! | `wal.rs`, `wal/` | [`wal::Wal`]: one core's write-ahead log, a [`Durable`] on disk (framed records in segments, group commit, torn-tail recovery, compaction) |
//! | `writer.rs` | [`writer::Writer`]: a core's write-ahead log writer thread (batches from the member, group commit, "synced through batch N" back to the core) |
//! | `compactor.rs` | [`compactor::Compactor`]: where a core hands frozen shard machines to be encoded into snapshots, received snapshots to be decoded into machines, and replaced machines to be dropped, off its loop: [`compactor::SnapWorker`] (a thread per core, `latchkey-snap-N`) in a server, [`compactor::MemCompactor`] (in the caller's thread, at once or late) in the simulations |
//! | `member.rs` | [`member::Member`]: one member's Raft groups, sans-IO: tick, step, propose, read index, compact, and the drain that hands each iteration's writes to the writer (raft-rs's asynchronous persistence) |
//! | `mem_durable.rs` | [`mem_durable::MemDurable`]: the simulation's in-memory durable image (written and synced layers, crash drops the unsynced) |
//! | `mem_writer.rs` | [`mem_writer::MemWriter`]: the simulation's writer, completing batches when the test says |
//! | `balance.rs` | [`balance::plan`]: leader transfers that spread leadership evenly over the live members |
//! | `peer.rs` | [`peer`]: the peer thread: raft messages between members over TCP (envelopes, bounded queues, reconnects) |
//! | `partition.rs`, `partition/` | [`partition::ClusterPartition`]: a member's shards on one core in the lock table's place: proposals answered on apply, redirects, leader-local waiters, expiries, checkpoints, ReadIndex queries |
//! | `shard.rs` | one shard on one member: its machine, its role, the leader's queues |
//!
//! Everything here is sans-IO except the write-ahead log, its writer thread and the peer
//! thread: the cores' mio loops tick, step and drain the groups, hand their writes to the
//! writer, and send their messages to the peers.

pub mod balance;
pub mod compactor;
pub mod data_dir;
pub mod durable;
pub mod machine;
pub mod mem_durable;
pub mod mem_writer;
pub mod member;
pub mod partition;
pub mod peer;
pub mod shard;
pub mod wal;
pub mod writer;

pub use durable::{load, Durable, Recovered};
