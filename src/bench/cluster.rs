//! Benchmarking a cluster: where each request goes, and following `M` (docs/protocol.md §5).
//!
//! With `--target a,b,c` every bench connection has one socket per member (a *lane*). A
//! request goes to the member the worker's [`Leaders`] cache names for its key; an `M` naming
//! a leader updates the cache and sends the same request (same owner, token or nonce; for an
//! acquire the wait left) to that leader at once; an `M` naming none (an election) sends it
//! to the next member after [`MOVED_RETRY`]. A cycle follows at most [`REDIRECTS_MAX`] `M`s;
//! past them it is given up and counted (`no_leader`, an unexpected answer). An `M` is a
//! definite answer that nothing was executed, so sending the request again is safe.
//!
//! The cache is per worker, direct-mapped over the key numbers (a key's cell is its number
//! modulo the cache size) and allocated once, at most [`LEADER_CACHE_MAX`] cells: a collision
//! or a stale cell only costs a redirect. With `--shards N` (the cluster's shard count) it is
//! per shard instead, as a client that knows the shard map keeps it: a key's cell is its shard
//! ([`crate::partition::partition_of`] of its name, the hash every member uses), so a key never
//! used before costs no redirect once its shard's leader is known — without it, every new key
//! of `uncontended` costs one, which is the client's cost and not the cluster's. A member that answers a request (not `M`) leads its
//! key, so the release after a grant goes where the grant came from. A key nobody learned yet
//! goes to the members in turn.
//!
//! Single node: one member, no cache: [`Leaders::member_for`] is one branch returning 0, and
//! a single node never answers `M`.
//!
//! Deliberately not here: sockets (the worker), and members outside `--target`: an `M`
//! naming one is an error of the run (list every member).

use std::net::SocketAddr;
use std::time::Duration;

use super::wire::{key_name, Wire};
use crate::partition::partition_of;

/// The most `M`s one cycle follows before it is given up.
pub const REDIRECTS_MAX: u8 = 64;
/// The most cells of a worker's leader cache (one byte each).
pub const LEADER_CACHE_MAX: u64 = 1 << 22;
/// How long a request waits after an `M` naming no leader before it goes to another member.
pub const MOVED_RETRY: Duration = Duration::from_millis(10);
/// The most members a target may list (as for the client).
pub const MEMBERS_MAX: usize = latchkey_client::MEMBERS_MAX;

const _: () = assert!(MEMBERS_MAX < u8::MAX as usize);

/// How a key number becomes its shard: the cluster's shard count and the run's key names.
#[derive(Clone, Copy, Debug)]
pub struct ShardMap {
    /// The cluster's shard count.
    pub shards: u32,
    /// The first byte of every key name of the run.
    pub prefix: u8,
    /// The run's tag in every key name.
    pub tag: [u8; 3],
}

impl ShardMap {
    /// The shard of key number `key`.
    #[inline]
    fn shard(&self, key: u64) -> usize {
        let name = key_name(self.prefix, self.tag, key);
        partition_of(&name, self.shards as usize)
    }
}

/// A worker's members and the leader it last learned for each key (or each shard).
#[derive(Clone, Debug)]
pub struct Leaders {
    members: Vec<SocketAddr>,
    /// A key's cell (see [`Leaders::cell`]) → member index + 1, 0 when unknown; empty with one
    /// member.
    cells: Box<[u8]>,
    /// Cells are shards, not key numbers.
    shards: Option<ShardMap>,
    /// The member the next key without a known leader goes to.
    next: usize,
}

impl Leaders {
    /// The cache for `members` (1..=[`MEMBERS_MAX`]) and keys numbered below `keys`: per key,
    /// or per shard with `shards`.
    pub fn new(members: Vec<SocketAddr>, keys: u64, shards: Option<ShardMap>) -> Leaders {
        debug_assert!((1..=MEMBERS_MAX).contains(&members.len()));
        let size = shards.map_or(keys, |map| u64::from(map.shards));
        let cells = if members.len() > 1 {
            vec![0u8; size.clamp(1, LEADER_CACHE_MAX) as usize].into_boxed_slice()
        } else {
            Box::default()
        };
        Leaders {
            members,
            cells,
            shards,
            next: 0,
        }
    }

    /// Key number `key`'s cell: its shard, or its number modulo the cache size. The cache must
    /// not be empty.
    #[inline]
    fn cell(&self, key: u64) -> usize {
        match &self.shards {
            Some(map) => map.shard(key),
            None => (key % self.cells.len() as u64) as usize,
        }
    }

    /// The number of members (lanes per connection).
    pub fn members(&self) -> usize {
        self.members.len()
    }

    /// The member a request on key number `key` goes to.
    #[inline]
    pub fn member_for(&mut self, key: u64) -> usize {
        if self.cells.is_empty() {
            return 0;
        }
        let cell = self.cells[self.cell(key)];
        if cell != 0 {
            return usize::from(cell - 1);
        }
        self.next = (self.next + 1) % self.members.len();
        self.next
    }

    /// An `M` named `leader` for `key`: remembered; its member index, or `None` when it is
    /// not one of the members.
    pub fn learn(&mut self, key: u64, leader: SocketAddr) -> Option<usize> {
        let member = self.members.iter().position(|&addr| addr == leader)?;
        if !self.cells.is_empty() {
            let cell = self.cell(key);
            self.cells[cell] = member as u8 + 1;
        }
        Some(member)
    }

    /// Member `member` answered a request on `key` (not `M`): it leads the key.
    #[inline]
    pub fn confirm(&mut self, key: u64, member: u8) {
        if self.cells.is_empty() {
            return;
        }
        let cell = self.cell(key);
        self.cells[cell] = member + 1;
    }

    /// Member `member` knows no leader for `key`: its next request goes to the next member.
    pub fn pass(&mut self, key: u64, member: usize) {
        if self.cells.is_empty() {
            return;
        }
        let next = (member + 1) % self.members.len();
        let cell = self.cell(key);
        self.cells[cell] = next as u8 + 1;
    }
}

/// Where a session writes requests: one dialect and output buffer per member (one for a
/// single node), and the worker's leader cache that picks among them.
pub struct Outbox<'a, W: Wire> {
    /// Each member's dialect.
    pub wires: &'a mut [W],
    /// Each member's unsent bytes.
    pub outs: &'a mut [Vec<u8>],
    /// The worker's leader cache.
    pub leaders: &'a mut Leaders,
}

impl<W: Wire> Outbox<'_, W> {
    /// Appends an acquire of key number `key` (named `name`) to its member's buffer; returns
    /// the member.
    pub fn acquire(&mut self, slot: u16, key: u64, name: &[u8], owner: u64, wait_s: u8) -> u8 {
        let member = self.leaders.member_for(key);
        self.wires[member].encode_acquire(&mut self.outs[member], slot, name, owner, wait_s);
        member as u8
    }

    /// Appends a release of key number `key` held with `token`; returns the member.
    pub fn release(&mut self, slot: u16, key: u64, name: &[u8], token: u64) -> u8 {
        let member = self.leaders.member_for(key);
        self.wires[member].encode_release(&mut self.outs[member], slot, name, token);
        member as u8
    }

    /// Appends a query of what is left of key number `key`'s lease; returns the member.
    pub fn query(&mut self, slot: u16, key: u64, name: &[u8], nonce: u64) -> u8 {
        let member = self.leaders.member_for(key);
        self.wires[member].encode_query(&mut self.outs[member], slot, name, nonce);
        member as u8
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn addr(port: u16) -> SocketAddr {
        SocketAddr::from(([127, 0, 0, 1], port))
    }

    #[test]
    fn one_member_needs_no_cache() {
        let mut leaders = Leaders::new(vec![addr(1)], 1_000_000, None);
        assert!(leaders.cells.is_empty());
        assert_eq!(leaders.member_for(5), 0);
        assert_eq!(leaders.learn(5, addr(1)), Some(0));
        assert_eq!(leaders.learn(5, addr(2)), None, "not a member");
        leaders.pass(5, 0);
        assert_eq!(leaders.member_for(5), 0);
    }

    #[test]
    fn learned_leaders_are_used_and_unknown_keys_go_round() {
        let mut leaders = Leaders::new(vec![addr(1), addr(2), addr(3)], 100, None);
        assert_eq!(leaders.cells.len(), 100);
        let guesses: Vec<usize> = (0..6).map(|key| leaders.member_for(key)).collect();
        assert_eq!(guesses, [1, 2, 0, 1, 2, 0], "in turn");
        assert_eq!(leaders.learn(7, addr(3)), Some(2));
        assert_eq!(leaders.member_for(7), 2);
        assert_eq!(leaders.member_for(7), 2, "remembered");
        assert_eq!(
            leaders.member_for(107),
            2,
            "a collision only costs a redirect"
        );
        leaders.pass(7, 2);
        assert_eq!(leaders.member_for(7), 0, "no leader at 3: try the next");
        leaders.confirm(8, 1);
        assert_eq!(
            leaders.member_for(8),
            1,
            "a member that answered leads the key"
        );
    }

    #[test]
    fn the_cache_is_bounded() {
        let leaders = Leaders::new(vec![addr(1), addr(2)], u64::MAX, None);
        assert_eq!(leaders.cells.len() as u64, LEADER_CACHE_MAX);
        let tiny = Leaders::new(vec![addr(1), addr(2)], 0, None);
        assert_eq!(tiny.cells.len(), 1);
    }

    #[test]
    fn with_the_shard_map_a_new_key_of_a_known_shard_goes_to_its_leader() {
        let map = ShardMap {
            shards: 4,
            prefix: b'u',
            tag: *b"abc",
        };
        let mut leaders = Leaders::new(vec![addr(1), addr(2), addr(3)], 1_000_000, Some(map));
        assert_eq!(leaders.cells.len(), 4, "one cell per shard");
        let shard_of = |key: u64| partition_of(&key_name(b'u', *b"abc", key), 4);
        let sibling = (1..1000)
            .find(|&key| shard_of(key) == shard_of(0))
            .expect("a sibling");
        assert_eq!(leaders.learn(0, addr(3)), Some(2));
        assert_eq!(leaders.member_for(sibling), 2, "same shard, same leader");
        let other = (1..1000)
            .find(|&key| shard_of(key) != shard_of(0))
            .expect("another");
        assert_ne!(
            leaders.member_for(other),
            2,
            "another shard is not known yet"
        );
    }
}
