//! `[cluster]`: cluster mode, the lock table replicated over several members (see
//! [`crate::cluster`]).
//!
//! ```toml
//! [server]
//! cores = 2         # required: the data_dir records it
//!
//! [cluster]
//! node_id = 1
//! data_dir = "/var/lib/latchkey"
//! members = [
//!   { id = 1, client = "127.0.0.1:7420", peer = "127.0.0.1:7520" },
//!   { id = 2, client = "127.0.0.1:7421", peer = "127.0.0.1:7521" },
//!   { id = 3, client = "127.0.0.1:7422", peer = "127.0.0.1:7522" },
//! ]
//! # shards = 64     # the same on every member
//! # fsync = true    # false: replicated in memory only
//! # restore_from = "backup.lkb"   # first start only: the locks of `latchkey cluster backup`
//! ```
//!
//! Without the section the server is a single node. With it, `node_id`, `data_dir` and
//! `members` are required; the member serves clients on its `client` address (a `[server]
//! listen`, if given, must be that address) and its peers on `peer`.
//!
//! Cluster mode also asks of the other sections ([`check_mode`]):
//! * `[server] cores` (or `--cores`) must be an explicit count, not `0` (one per CPU): each core
//!   keeps its own write-ahead log in `data_dir` (its log writer thread makes the writes of all
//!   that core's shards durable together, one `fdatasync` per round), and the `data_dir` records the count, so a count
//!   that followed the machine's CPUs would tie the data to the machine. A count above the
//!   CPU count is allowed (a member moved to a smaller machine still starts).
//! * `[limits] max_keys` is split over the shards (each shard's leader refuses a new key past
//!   `max_keys / shards` holds and grants in flight); it must be at least `shards` and at most
//!   `shards ×` [`HOLDS_MAX`] (every member's machines refuse holds past that, whatever their
//!   configs say). Left out, it is the smaller of its default and that capacity.
//! * `[tokens]` and `[timer]` are the single node's: tokens come from the replicated log, and
//!   waits and leases have timers of their own, so `tokens.state_dir`, a `tokens.reservation`
//!   or a `timer.tick_ms` other than its default is refused rather than ignored.

use super::{described, Config, ConfigError, RESERVATION_DEFAULT, TICK_MS_DEFAULT};
use std::collections::HashSet;
use std::net::SocketAddr;
use std::path::PathBuf;
use toml::Value;

/// Members a cluster may have at most. Every shard is a Raft group over all of them, so each
/// write waits for a majority: more members buy tolerance of more failures at the cost of
/// latency and peer traffic.
pub const MEMBERS_MAX: usize = 9;
/// Shards at most (each one is a Raft group on every member).
pub const SHARDS_MAX: u32 = 4096;
/// The most holds one shard keeps; a grant beyond it is refused (the shard machine's
/// `Applied::Full`).
///
/// A constant, not `limits.max_keys`: applying is deterministic and members' configs may
/// differ, so the cap every member applies must be the same. A member's `limits.max_keys` is
/// enforced before this, by each shard's leader before it proposes a grant (see
/// `cluster/partition/requests.rs`), and may not exceed `shards × HOLDS_MAX`.
pub const HOLDS_MAX: usize = 1_000_000;
/// Shards by default.
pub const SHARDS_DEFAULT: u32 = 64;

/// `[cluster]`.
#[derive(Clone, Debug, PartialEq)]
pub struct ClusterConfig {
    /// `node_id`: which of `members` this server is. Required, at least 1.
    pub node_id: u64,
    /// `data_dir`: where this member keeps its write-ahead logs and snapshots, locked while it
    /// runs and recording whose data it holds (`cluster::data_dir`). Required.
    pub data_dir: PathBuf,
    /// `members`: every member of the cluster, this one included, in the file's order.
    pub members: Vec<MemberConfig>,
    /// `shards`: how many shards (Raft groups) the key space is cut into; the same on every
    /// member. `1..=SHARDS_MAX`, default [`SHARDS_DEFAULT`].
    pub shards: u32,
    /// `fsync`: whether a write is synced to disk before it counts as persisted (default
    /// `true`). `false` keeps the cluster's locks only in the members' memory (and page cache):
    /// faster, and a lock is lost only when a majority of members dies at once.
    pub fsync: bool,
    /// `[cluster.tls]`: with it every peer connection is TLS both ways, each member's id bound
    /// to its certificate; `None` (no section, the default): the peer port is plaintext. Every
    /// member must agree (a member refuses a peer that does not: see `cluster::peer::tls`).
    pub tls: Option<super::PeerTlsConfig>,
    /// `restore_from`: a file of `latchkey cluster backup` that this member starts from at its
    /// first start (an empty `data_dir`); ignored once the `data_dir` holds its data. Every
    /// member of the new cluster is given the same file (`cluster::backup`).
    pub restore_from: Option<PathBuf>,
}

/// One entry of `cluster.members`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MemberConfig {
    /// `id`: the member's id, at least 1, unique.
    pub id: u64,
    /// `client`: the address the member serves clients (and admin requests) on.
    pub client: SocketAddr,
    /// `peer`: the address the member's peers reach it on.
    pub peer: SocketAddr,
}

/// A cluster's identity: the shard count and the members' ids and client addresses, in a
/// canonical text (members sorted by id, whatever the file's order) and its 64-bit digest.
///
/// Peer addresses are deliberately left out: how one member reaches another may differ from
/// member to member (a proxy, another interface); a peer that dials the wrong member is caught
/// by the peer hello, which names the member it meant to reach. Client addresses are in: every
/// member hands them out in redirects, so they must be the same everywhere.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ClusterIdentity {
    /// `shards=64 members=1@127.0.0.1:7420,2@127.0.0.1:7421,3@127.0.0.1:7422`.
    pub text: String,
    /// FNV-1a 64 of `text`: what peers compare in their hello.
    pub digest: u64,
}

impl Default for ClusterConfig {
    fn default() -> ClusterConfig {
        ClusterConfig {
            node_id: 0,
            data_dir: PathBuf::new(),
            members: Vec::new(),
            shards: SHARDS_DEFAULT,
            fsync: true,
            tls: None,
            restore_from: None,
        }
    }
}

impl ClusterConfig {
    /// This member's entry (the configuration was checked: it exists).
    pub fn this_member(&self) -> Option<&MemberConfig> {
        self.members.iter().find(|m| m.id == self.node_id)
    }

    /// What every member of this cluster must agree on, and a data directory keeps: the shard
    /// count and every member's id and client address (see [`ClusterIdentity`]).
    pub fn identity(&self) -> ClusterIdentity {
        let mut members: Vec<(u64, SocketAddr)> =
            self.members.iter().map(|m| (m.id, m.client)).collect();
        members.sort_unstable();
        let list: Vec<String> = members
            .iter()
            .map(|(id, client)| format!("{id}@{client}"))
            .collect();
        let text = format!("shards={} members={}", self.shards, list.join(","));
        let mut fnv = crate::hash::Fnv::new();
        fnv.bytes(text.as_bytes());
        ClusterIdentity {
            digest: fnv.finish(),
            text,
        }
    }

    /// The member's role for the startup line: `cluster member 2 of 3, 64 shards, peers on
    /// 127.0.0.1:7521, fsync on` (and `, peer TLS on` with `[cluster.tls]`).
    pub fn role(&self) -> String {
        let peer = self
            .this_member()
            .map_or("none".to_string(), |member| member.peer.to_string());
        format!(
            "cluster member {} of {}, {} shards, peers on {peer}, fsync {}{}",
            self.node_id,
            self.members.len(),
            self.shards,
            if self.fsync { "on" } else { "off" },
            if self.tls.is_some() {
                ", peer TLS on"
            } else {
                ""
            }
        )
    }

    /// The ids of every member, in the file's order.
    pub fn voters(&self) -> Vec<u64> {
        self.members.iter().map(|m| m.id).collect()
    }

    /// Checks what relates the keys: the required ones are there, this node is a member, ids
    /// and addresses are unique, and `listen` (if the file or command line set one) is this
    /// member's client address.
    pub(super) fn check(&self, listen: Option<SocketAddr>) -> Result<(), ConfigError> {
        let error =
            |key: &str, problem: String| ConfigError::new(key, None, format!("{key}: {problem}"));
        if self.node_id == 0 {
            return Err(error("cluster.node_id", "required with [cluster]".into()));
        }
        if self.data_dir.as_os_str().is_empty() {
            return Err(error("cluster.data_dir", "required with [cluster]".into()));
        }
        if self.members.is_empty() {
            return Err(error("cluster.members", "required with [cluster]".into()));
        }
        let mut ids = HashSet::new();
        let mut addresses = HashSet::new();
        for member in &self.members {
            if !ids.insert(member.id) {
                return Err(error(
                    "cluster.members",
                    format!("id {} appears twice", member.id),
                ));
            }
            for address in [member.client, member.peer] {
                if !addresses.insert(address) {
                    return Err(error(
                        "cluster.members",
                        format!("address {address} appears twice"),
                    ));
                }
            }
        }
        let Some(this) = self.this_member() else {
            let problem = format!("{} is not the id of any of cluster.members", self.node_id);
            return Err(error("cluster.node_id", problem));
        };
        match listen {
            Some(listen) if listen != this.client => Err(error(
                "server.listen",
                format!(
                    "a cluster member listens on its cluster.members client address ({}), \
                     got {listen}; remove server.listen or make them equal",
                    this.client
                ),
            )),
            _ => Ok(()),
        }
    }
}

/// The most holds `shards` shards keep together: every member's machines refuse a grant past
/// [`HOLDS_MAX`] per shard.
pub(super) fn holds_max(shards: u32) -> usize {
    (shards as usize).saturating_mul(HOLDS_MAX)
}

fn error(key: &str, problem: String) -> ConfigError {
    ConfigError::new(key, None, format!("{key}: {problem}"))
}

/// Refuses a cluster member whose core count was not given (see the module docs).
pub(super) fn check_cores(config: &Config) -> Result<(), ConfigError> {
    if config.server.cores_explicit {
        return Ok(());
    }
    Err(error(
        "server.cores",
        "a cluster member needs an explicit core count (1 to 1024, in [server] cores or \
         --cores; 0 or left out means one per CPU): each core keeps its own write-ahead log in \
         cluster.data_dir, synced for all the core's shards at once, and the data_dir records \
         the count, so a count that followed the machine's CPUs would tie the data to the machine"
            .into(),
    ))
}

/// What cluster mode asks of the rest of `config` but the core count (see the module docs);
/// the first refusal, naming its key and saying why.
pub(super) fn check_mode(config: &Config, cluster: &ClusterConfig) -> Result<(), ConfigError> {
    let (max_keys, shards) = (config.limits.max_keys, cluster.shards);
    if max_keys > holds_max(shards) {
        return Err(error(
            "limits.max_keys",
            format!(
                "a cluster of {shards} shards holds at most {} keys ({HOLDS_MAX} per shard, the \
                 same cap on every member), got {max_keys}; lower it or raise cluster.shards",
                holds_max(shards)
            ),
        ));
    }
    if max_keys < shards as usize {
        return Err(error(
            "limits.max_keys",
            format!(
                "must be at least cluster.shards ({shards}), because the leader of each shard \
                 holds max_keys / shards keys, got {max_keys}"
            ),
        ));
    }
    if let Some(dir) = &config.tokens.state_dir {
        return Err(error(
            "tokens.state_dir",
            format!(
                "a cluster member's tokens come from the replicated log (they grow with its \
                 index, which survives restarts), so a token state directory has no meaning in \
                 cluster mode; remove it (got {:?})",
                dir.display().to_string()
            ),
        ));
    }
    if config.tokens.reservation != RESERVATION_DEFAULT {
        return Err(error(
            "tokens.reservation",
            "sizes the token reservations persisted in tokens.state_dir, which cluster mode \
             does not use; remove it"
                .into(),
        ));
    }
    if config.timer.tick_ms != TICK_MS_DEFAULT {
        return Err(error(
            "timer.tick_ms",
            format!(
                "sizes the single node's timing wheel; a cluster member times waits and leases \
                 with timers of its own (waits to the microsecond, leases to the millisecond), \
                 so a coarser tick has no meaning there; remove it or set 1 (got {})",
                config.timer.tick_ms
            ),
        ));
    }
    Ok(())
}

/// Reads `cluster.members` (`value`, on line `line`): an array of `{ id, client, peer }`.
pub(super) fn read_members(value: &Value, line: usize) -> Result<Vec<MemberConfig>, ConfigError> {
    let error = |path: &str, problem: String| {
        ConfigError::new(path, Some(line), format!("{path}: {problem}"))
    };
    let Value::Array(tables) = value else {
        let problem = format!(
            "expected an array of {{ id, client, peer }} tables, got {}",
            described(value)
        );
        return Err(error("cluster.members", problem));
    };
    if tables.len() > MEMBERS_MAX {
        let problem = format!("at most {MEMBERS_MAX} members, got {}", tables.len());
        return Err(error("cluster.members", problem));
    }
    let mut members = Vec::with_capacity(tables.len());
    for (index, table) in tables.iter().enumerate() {
        let at = |key: &str| format!("cluster.members[{index}].{key}");
        let Value::Table(table) = table else {
            let problem = format!("expected a table, got {}", described(table));
            return Err(error(&format!("cluster.members[{index}]"), problem));
        };
        if let Some(key) = table
            .keys()
            .find(|key| !["id", "client", "peer"].contains(&key.as_str()))
        {
            let problem = "unknown key (a member has `id`, `client` and `peer`)".to_string();
            return Err(error(&at(key), problem));
        }
        let id = match table.get("id") {
            Some(Value::Integer(id)) if *id >= 1 => *id as u64,
            Some(other) => {
                let problem = format!(
                    "expected an integer of at least 1, got {}",
                    described(other)
                );
                return Err(error(&at("id"), problem));
            }
            None => return Err(error(&at("id"), "required".into())),
        };
        let address = |key: &str| match table.get(key) {
            Some(Value::String(text)) => text.parse::<SocketAddr>().map_err(|_| {
                let problem = format!(
                    "expected an IP address and port such as \"127.0.0.1:7420\" (host names \
                     are not resolved), got {text:?}"
                );
                error(&at(key), problem)
            }),
            Some(other) => Err(error(
                &at(key),
                format!("expected a string, got {}", described(other)),
            )),
            None => Err(error(&at(key), "required".into())),
        };
        let client = address("client")?;
        let peer = address("peer")?;
        members.push(MemberConfig { id, client, peer });
    }
    Ok(members)
}

#[cfg(test)]
mod tests;
