//! Cluster mode: the lock table replicated over several members with raft-rs (issue 12).
//!
//! The key space is cut into a fixed number of *shards* by key hash (`[cluster] shards`, the
//! same on every member); each shard is one Raft group over all members. A member's cores each
//! host the groups of the shards they own, and leadership is spread over the members.
//!
//! | file | responsibility |
//! |---|---|
//! | `durable.rs` | [`Durable`]: what a member must make durable (entries, hard states, snapshots) and sync once per loop iteration for all its groups; what it recovers |
//! | `peer.rs` | [`peer`]: the peer thread: raft messages between members over TCP (envelopes, bounded queues, reconnects) |
//!
//! Everything here is sans-IO except the write-ahead log and the peer thread: the cores' mio loops tick, step and
//! drain the groups, and send their messages to the peers.

pub mod durable;
pub mod peer;

pub use durable::{load, Durable, Recovered};
