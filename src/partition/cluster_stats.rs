//! A cluster member's figures as `GET /stats`, `/metrics`, `/health` and `latchkey cluster
//! status` show them: its shards ([`ShardStatus`]), its peers and quorum ([`PeerReport`]).
//! Plain data, filled in by `crate::cluster` (the partition, the peer thread) and rendered by
//! the server's admin requests, which therefore need nothing of the cluster itself.

use crate::metrics::Histogram;
use std::net::SocketAddr;

/// One hosted shard as `GET /stats` and `latchkey cluster status` show it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ShardStatus {
    /// The shard.
    pub shard: u32,
    /// The leader this member knows of.
    pub leader: Option<u64>,
    /// Whether this member serves the shard (leads it and applied its barrier).
    pub serving: bool,
    /// The group's term.
    pub term: u64,
    /// The group's commit index on this member.
    pub commit: u64,
    /// The index this member applied.
    pub applied: u64,
    /// Keys its replicated state holds (on a follower: as far as it applied).
    pub holds: usize,
}

/// A cluster partition's figures (one core's shards).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ClusterStats {
    /// This member's id.
    pub node_id: u64,
    /// Every member's id and client address, as this member's configuration lists them.
    pub members: Vec<(u64, SocketAddr)>,
    /// The core's shards.
    pub shards: Vec<ShardStatus>,
    /// Times a shard of this core saw its leader change.
    pub leader_changes: u64,
    /// Entries this core proposed.
    pub proposals: u64,
    /// Snapshots this core's shards restored (from a leader, or from the log at start).
    pub restores: u64,
    /// From a client request's proposal to its entry's apply, in microseconds.
    pub commit_latency: Histogram,
    /// One round of the core's log writer (write, `fdatasync`), in microseconds.
    pub sync_latency: Histogram,
    /// The member's links to its peers and its quorum (the same on every core).
    pub peers: Option<PeerReport>,
}

/// Bounds of the commit and sync latency histograms, in microseconds.
pub const LATENCY_BOUNDS_US: &[u64] = &[
    50, 100, 250, 500, 1_000, 2_500, 5_000, 10_000, 25_000, 50_000, 100_000, 250_000, 1_000_000,
];

/// The state of this member's connection to a peer.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LinkState {
    /// Not connected yet since the start.
    Connecting,
    /// Connected, and the peer accepted the hello.
    Connected,
    /// The peer refused the hello (another cluster identity, shard count, a wrong address...).
    Refused,
    /// The connection failed or was lost (refused by the kernel, timed out, reset, closed).
    Unreachable,
}

impl LinkState {
    /// The state in one word, as `/stats` shows it.
    pub fn label(self) -> &'static str {
        match self {
            LinkState::Connecting => "connecting",
            LinkState::Connected => "connected",
            LinkState::Refused => "refused",
            LinkState::Unreachable => "unreachable",
        }
    }
}

/// One peer as `/stats` shows it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PeerStatus {
    /// Its node id.
    pub node_id: u64,
    /// The peer address this member dials.
    pub addr: SocketAddr,
    /// This member's connection to it.
    pub link: LinkState,
    /// Why it is refused or unreachable (empty when connected).
    pub reason: String,
    /// How long the link has been in this state, in milliseconds.
    pub for_ms: u64,
    /// Whether it is reachable (see the module docs).
    pub reachable: bool,
    /// How long ago something last arrived from it, in milliseconds (`None`: never).
    pub heard_ms_ago: Option<u64>,
    /// Why this member refused the last connection whose hello named this peer, if it did
    /// and accepted none from it since.
    pub refused_inbound: Option<String>,
    /// The peer wire version it was last heard from in (its hello accepted, or its reply
    /// accepting this member's), kept while it is down; the oldest this member speaks until
    /// it was heard from.
    pub version: u8,
    /// The incarnation of its data directory this member remembers (the first it accepted a
    /// hello of version 6 or later with), if any.
    pub incarnation: Option<u64>,
}

/// The peer thread's counters at one moment.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct PeerCounters {
    /// Inbound connections refused (bad hello, bad frame, hello timeout, over the limit).
    pub refusals: u64,
    /// Connections of this member that a peer refused.
    pub refused_by_peers: u64,
    /// Connections refused for TLS: inbound ones (in `refusals` too) of a plaintext or TLS
    /// dialer the member's `[cluster.tls]` disagrees with, with a certificate not signed by its
    /// CA or not naming the member the hello claims; and its own whose peer's certificate it
    /// refused.
    pub tls_refusals: u64,
    /// Messages dropped because what they carry for the shards does not decode.
    pub invalid_dropped: u64,
    /// Messages received from peers.
    pub messages_received: u64,
    /// Messages sent to peers.
    pub messages_sent: u64,
}

/// Every peer and the quorum, as `/stats` and `/health` use them.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PeerReport {
    /// Members of the cluster, this one included.
    pub members: u64,
    /// Members reachable from this one, itself included.
    pub reachable: u64,
    /// Whether `reachable` is a majority of `members`.
    pub quorum: bool,
    /// The newest peer wire version this member speaks (its build's).
    pub version: u8,
    /// This member's data-directory incarnation, which its hellos carry.
    pub incarnation: u64,
    /// The cluster version: the lowest peer wire version any member speaks (this member's,
    /// and each peer's as last known), which decides what shard commands may be proposed.
    pub cluster_version: u8,
    /// Each peer.
    pub peers: Vec<PeerStatus>,
    /// The counters.
    pub counters: PeerCounters,
}

/// Whether `reachable` of `members` members are a majority.
pub fn is_majority(reachable: u64, members: u64) -> bool {
    2 * reachable > members
}
