//! Cluster mode: the lock table replicated over several members with raft-rs (issue 12).
//!
//! The key space is cut into a fixed number of *shards* by key hash (`[cluster] shards`, the
//! same on every member); each shard is one Raft group over all members. A member's cores each
//! host the groups of the shards they own, and leadership is spread over the members.
//!
//! Where each part lives, file by file: `docs/architecture.md`.
//!
//! Everything here is sans-IO except the write-ahead log, its writer thread and the peer
//! thread: the cores' mio loops tick, step and drain the groups, hand their writes to the
//! writer, and send their messages to the peers.

pub mod backup;
pub mod balance;
pub mod compactor;
pub mod data_dir;
pub mod durable;
pub mod machine;
#[cfg(any(test, feature = "testing"))]
pub mod mem_durable;
#[cfg(any(test, feature = "testing"))]
pub mod mem_writer;
pub mod member;
pub mod partition;
pub mod peer;
pub mod shard;
pub mod wal;
pub mod writer;

pub use durable::{load, Durable, Recovered};
