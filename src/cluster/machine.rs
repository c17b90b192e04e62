//! [`ShardMachine`]: the replicated lock state of one shard, which every member builds by
//! applying the shard's committed raft entries in log order.
//!
//! It is sans-IO and has no clock: the caller passes `now_ms`, the member's local monotonic
//! milliseconds at apply time. Everything but the deadlines is a pure function of the commands
//! applied (compare members with `ShardMachine::digest` (tests)); deadlines are local to a member.
//!
//! # Tokens
//!
//! A grant applied at log index `i` of shard `s` (of `shards`) gets the token
//! `floor + i * shards + s`. `floor` is set once, by the first [`Command::Barrier`] applied
//! (rounded up to a multiple of `shards`, so that `token % shards == s` and the shards' token
//! sequences are disjoint), and kept in snapshots; later Barriers leave it alone. Tokens are
//! therefore never 0, unique, and strictly increasing per key (log indices only grow). A
//! grant before any Barrier is refused ([`Applied::NoFloor`]); an overflowing token is refused
//! ([`Applied::Exhausted`]), never wrapped.
//!
//! # Handoffs
//!
//! A [`Command::Release`] or [`Command::Expire`] may name a waiter (`then`): if it frees the
//! key, the same entry grants it to that waiter ([`Applied::HandedOff`]), with the token of
//! this entry's index, exactly as an `Acquire` at that index would. One grant per entry keeps
//! the tokens unique and increasing. If the release or expiry has no effect, neither has the
//! grant.
//!
//! # Leases never end early
//!
//! A member's deadline for a hold is never earlier than the client's (propose time + lease),
//! given that a member applies a command no earlier than it was proposed:
//! * Acquire and Extend count the lease from the apply time.
//! * [`ShardMachine::promote`] (a new leader, before it may expire anything) moves every
//!   deadline to `max(deadline, now) + grace`.
//! * [`Command::Checkpoint`] only caps a deadline at `apply time + remaining`, `remaining`
//!   being what the leader itself still promised at propose time; holds renewed after the
//!   leader computed it (`renewed_at > as_of`) are left alone. Checkpoints stop repeated
//!   elections (each adding grace) from renewing a lease forever.
//! * [`Command::Expire`] frees a hold only if it was not renewed after the leader saw its
//!   deadline pass (`renewed_at <= as_of`): an Extend proposed before the Expire but not yet
//!   applied by the leader wins.
//!
//! # Invariants (checked by [`ShardMachine::check_invariants`])
//!
//! At most `holds_max` holds; every hold is in the token index exactly once; every token is
//! `floor + i * shards + shard` with `1 <= i <= applied`, and `i <= renewed_at <= applied`.
//! No empty queue is kept, and the waiter count is the sum of the queues' lengths, at most
//! [`WAITERS_MAX`]. At most [`ENDED_MAX`] ended acquires, each under one client and owner and
//! one index at most `applied`, listed once in each of the two maps.
//!
//! # Deadlines
//!
//! Each hold carries this member's deadline (`Hold::deadline_ms`), which every command that
//! changes it reports in its [`Applied`] outcome. The machine keeps no index of them: only a
//! leader that serves the shard expires holds, and it keeps their timers on its core's timing
//! wheel, armed when it starts serving and from the outcomes after (`crate::cluster::partition`,
//! `duties.rs`). An ordered index here cost every member (followers too) a B-tree insert and
//! remove per hold — 640 ns per hold at a million holds, against the wheel's 23 ns
//! (`cargo bench --bench wheel -- deadline_index`).
//!
//! # Snapshots
//!
//! `ShardMachine::snapshot` is O(holds), too long for a core's loop at a million holds. The
//! holds and the token index are persistent maps (`imbl`, structurally shared), so
//! [`ShardMachine::freeze`] takes a consistent [`Frozen`] image in O(1); the machine copies a
//! map node only when it changes one the image still shares. The image encodes (elsewhere:
//! `crate::cluster::compactor`) to exactly the bytes `snapshot` gave at the freeze.
//!
//! # Queued acquires
//!
//! A leader queues acquires itself (`crate::cluster::shard`'s queues: sessions, wait timers,
//! places) and, once every member reads them, mirrors each queue here with
//! [`Command::Enqueue`] and [`Command::Withdraw`], so that a new leader queues its
//! predecessor's waiters again, in their order, and answers their clients' Resolves. A grant
//! (an `Acquire` or a `then`) takes its owner's first queued acquire of the key out of the
//! queue. Each waiter carries this member's deadline for its wait (`QueuedWait::deadline_ms`,
//! local like the holds' deadlines: the apply time of its `Enqueue` plus its wait, never before
//! the client's own deadline), which a new leader keeps; the leader withdraws what ends. At
//! most [`WAITERS_MAX`] per shard.
//!
//! # Ended acquires
//!
//! A `Withdraw` that says how its acquire was answered ([`Answered`]: `T` or `B`) leaves a
//! record of it under its client id and owner ([`ShardMachine::ended`]), so that any member
//! that leads the shard later answers the client's Resolve with that fate, as the leader that
//! answered it would. The last [`ENDED_MAX`] are kept, oldest forgotten first (by log index:
//! the same on every member); a forgotten one's Resolve says "never seen", as true for the
//! caller (nothing of it stands). In the digest, frozen images and snapshots.
//!
//! Deliberately not here: what a waiter waits for (the leader's queues), raft itself, and any
//! clock.

mod codec;
#[cfg(test)]
mod handoff_tests;
#[cfg(test)]
mod tests;
#[cfg(test)]
mod waiting_tests;

pub use codec::{
    Answered, CheckpointHold, Command, DecodeError, Grant, Queued, SnapshotEnded, SnapshotHold,
    SnapshotImage, SnapshotWaiter, CHECKPOINT_HOLDS_MAX, ENDED_MAX, WAITERS_MAX,
};

use crate::config::HOLDS_MAX;
use crate::hash::MapHasher;

/// Up to this many holds, debug builds check every invariant after every mutation; above it,
/// only the index sizes (a full check is O(holds)).
const FULL_CHECK_HOLDS_MAX: usize = 4096;

/// The current holder of a key.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Hold {
    /// The fencing token of the grant.
    pub token: u64,
    /// The owner id the grant was made to.
    pub owner: u64,
    /// The lease last granted or extended, in milliseconds.
    pub lease_ms: u32,
    /// This member's deadline, in its local monotonic milliseconds.
    pub deadline_ms: u64,
    /// The log index of the grant or of the last extension.
    pub renewed_at: u64,
}

/// What applying one command did.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Applied {
    /// Acquire: the key was free and is now held with this token.
    Granted {
        /// The new token.
        token: u64,
        /// This member's deadline for the hold.
        deadline_ms: u64,
    },
    /// Acquire: the key is held by another grant (no change).
    Held {
        /// The current holder's token.
        token: u64,
    },
    /// Acquire: the shard already keeps `holds_max` holds (no change).
    Full,
    /// Acquire or Barrier: the token (or floor) would overflow `u64` (no change).
    Exhausted,
    /// Acquire: no Barrier has set the floor yet (no change).
    NoFloor,
    /// Release: the key is free (with a `then`: its grant was refused, the token would
    /// overflow).
    Released,
    /// Extend: the lease restarts from the apply time.
    Extended {
        /// This member's new deadline.
        deadline_ms: u64,
    },
    /// Expire: the key is free (with a `then`: as [`Applied::Released`]).
    Expired,
    /// Release or Expire with a `then`: the holder left and the key is now held by `then`'s
    /// owner with this token.
    HandedOff {
        /// The new token.
        token: u64,
        /// This member's deadline for the new hold.
        deadline_ms: u64,
    },
    /// Expire: the holder was renewed after the leader decided to expire it (no change).
    Renewed,
    /// Release, Extend or Expire: the token is not the key's holder (no change).
    NotHolder,
    /// Barrier: the floor in force.
    Barrier {
        /// The floor (set by this Barrier or an earlier one).
        floor: u64,
    },
    /// Enqueue: the waiter is at the back of its key's queue.
    Queued,
    /// Enqueue: the shard keeps [`WAITERS_MAX`] waiters already (no change).
    QueueFull,
    /// Withdraw: the owner's first waiter of the key left the queue.
    Withdrawn,
    /// Withdraw: the owner has no waiter in the key's queue (granted, or withdrawn before).
    NotQueued,
    /// Checkpoint: how many deadlines were lowered.
    Checkpointed {
        /// Holds whose deadline this checkpoint lowered on this member (local, like the
        /// deadlines: members may differ).
        capped: usize,
    },
}

/// The replicated lock state of one shard. Call order on a member: [`apply`](Self::apply) (or
/// [`skip`](Self::skip)) every committed entry in index order; on becoming leader,
/// [`promote`](Self::promote) once, then propose Expire for holds whose deadline passed (the
/// leader's lease timers) and [`checkpoint`](Self::checkpoint)s.
#[derive(Clone, Debug)]
pub struct ShardMachine {
    shard: u32,
    shards: u32,
    holds_max: usize,
    floor: Option<u64>,
    applied: u64,
    /// Persistent (structurally shared) maps: [`ShardMachine::freeze`] copies them in O(1).
    /// Keys are shared too ([`Key`]): a map node copied after a freeze copies no key bytes.
    holds: Holds,
    /// token → key, in token order (grant order).
    keys: imbl::OrdMap<u64, Key>,
    /// Key → its queued acquires, first in line first (no empty queue).
    waiting: Waiting,
    /// Queued acquires in all queues.
    waiters: usize,
    /// Acquires that ended without a grant, by the index of their `Withdraw` (oldest first).
    ended: EndedOrder,
    /// The same, by client id and owner → that index.
    ended_at: EndedAt,
}

/// Index of a `Withdraw` → the ended acquire it recorded: persistent, as [`Holds`].
type EndedOrder = imbl::OrdMap<u64, (u128, u64, Answered)>;
/// (client id, owner) → the index of the `Withdraw` that recorded it ([`EndedOrder`]).
type EndedAt = imbl::GenericHashMap<(u128, u64), u64, MapHasher, SharedPtr>;
/// The persistent maps' pointer kind.
type SharedPtr = imbl::shared_ptr::DefaultSharedPtr;

/// Key → queue: persistent, as [`Holds`].
type Waiting = imbl::GenericHashMap<
    Key,
    imbl::Vector<QueuedWait>,
    MapHasher,
    imbl::shared_ptr::DefaultSharedPtr,
>;

/// A queued acquire in the machine: what its `Enqueue` replicated, and this member's deadline.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct QueuedWait {
    /// The replicated fields.
    pub queued: Queued,
    /// This member's deadline for its wait, in its local monotonic milliseconds: the apply time
    /// of its `Enqueue` (after the client sent the acquire) plus its wait.
    pub deadline_ms: u64,
}

/// Key → hold: a persistent hash map with the maps' hasher ([`MapHasher`]).
type Holds = imbl::GenericHashMap<Key, Hold, MapHasher, imbl::shared_ptr::DefaultSharedPtr>;

/// A consistent, immutable image of a [`ShardMachine`] at one applied index and one instant,
/// taken in O(1) by [`ShardMachine::freeze`]: it shares the machine's persistent maps, which
/// the machine copies node by node as it changes them afterwards. [`Frozen::encode`] (O(holds))
/// runs on another thread (`crate::cluster::compactor`).
#[derive(Clone, Debug)]
pub struct Frozen {
    shard: u32,
    shards: u32,
    floor: Option<u64>,
    applied: u64,
    now_ms: u64,
    holds: Holds,
    keys: imbl::OrdMap<u64, Key>,
    /// Boxed to keep an image small to move (one allocation per freeze).
    waiting: Box<(Waiting, EndedOrder)>,
}

/// A held key, shared by both maps and by frozen images. Copying a persistent map's node (the
/// machine does after a freeze, when it changes one the image still shares) clones its keys:
/// with an `Arc` that allocates nothing, and the image's thread, dropping the old node, frees
/// no key bytes the core allocated (freed small blocks of another thread pile up in the core's
/// allocator and cost it a long consolidation later).
type Key = std::sync::Arc<[u8]>;

impl Frozen {
    /// The shard.
    pub fn shard(&self) -> u32 {
        self.shard
    }

    /// The index the machine had applied when frozen.
    pub fn applied(&self) -> u64 {
        self.applied
    }

    /// The state as versioned bytes ([`SnapshotImage`]): shard, shards, floor, applied, each
    /// hold in token order with its time remaining from the freeze's `now_ms`, and each key's
    /// queued acquires in queue order.
    pub fn encode(&self) -> Vec<u8> {
        let holds = self
            .keys
            .values()
            .map(|key| {
                let hold = &self.holds[key];
                SnapshotHold {
                    key: key.to_vec(),
                    token: hold.token,
                    owner: hold.owner,
                    lease_ms: hold.lease_ms,
                    renewed_at: hold.renewed_at,
                    remaining_ms: hold.deadline_ms.saturating_sub(self.now_ms),
                }
            })
            .collect();
        let (waiting, ended) = &*self.waiting;
        let waiters = waiting_in_order(waiting)
            .map(|(key, waiting)| SnapshotWaiter {
                key: key.to_vec(),
                waiter: waiting.queued,
                remaining_ms: waiting.deadline_ms.saturating_sub(self.now_ms),
            })
            .collect();
        let ended = (ended.iter())
            .map(|(&index, &(client, owner, answered))| SnapshotEnded {
                client,
                owner,
                answered,
                index,
            })
            .collect();
        let image = SnapshotImage {
            shard: self.shard,
            shards: self.shards,
            floor: self.floor,
            applied: self.applied,
            holds,
            waiters,
            ended,
        };
        image.encode()
    }
}

impl ShardMachine {
    /// An empty shard `shard` of `shards` that keeps at most [`HOLDS_MAX`] holds.
    pub fn new(shard: u32, shards: u32) -> Self {
        Self::with_holds_max(shard, shards, HOLDS_MAX)
    }

    /// An empty shard that keeps at most `holds_max` (`<= HOLDS_MAX`) holds. All members of a
    /// group must use the same limit, or their states diverge.
    pub fn with_holds_max(shard: u32, shards: u32, holds_max: usize) -> Self {
        assert!(shard < shards, "shard {shard} of {shards}");
        assert!(holds_max <= HOLDS_MAX);
        let machine = ShardMachine {
            shard,
            shards,
            holds_max,
            floor: None,
            applied: 0,
            holds: Holds::default(),
            keys: imbl::OrdMap::new(),
            waiting: Waiting::default(),
            waiters: 0,
            ended: EndedOrder::new(),
            ended_at: EndedAt::default(),
        };
        machine.check_invariants();
        machine
    }

    /// Applies the committed `command` at log `index` (which must be above
    /// [`applied`](Self::applied)) at this member's time `now_ms`.
    pub fn apply(&mut self, index: u64, command: &Command, now_ms: u64) -> Applied {
        assert!(index > self.applied, "index {index} after {}", self.applied);
        self.applied = index;
        let applied = match command {
            Command::Barrier { floor } => self.barrier(*floor),
            Command::Acquire {
                key,
                owner,
                lease_ms,
            } => self.acquire(key, *owner, *lease_ms, now_ms),
            Command::Release { key, token, then } => {
                let released = self.release(key, *token);
                self.hand_off(key, released, then, now_ms)
            }
            Command::Extend {
                key,
                token,
                lease_ms,
            } => self.extend(key, *token, *lease_ms, now_ms),
            Command::Expire {
                key,
                token,
                as_of,
                then,
            } => {
                let expired = self.expire(key, *token, *as_of);
                self.hand_off(key, expired, then, now_ms)
            }
            Command::Checkpoint { as_of, holds } => self.cap(*as_of, holds, now_ms),
            Command::Enqueue { key, waiter } => self.enqueue(key, *waiter, now_ms),
            Command::Withdraw {
                key,
                owner,
                answered,
            } => self.withdraw(key, *owner, *answered),
        };
        self.after_mutation();
        applied
    }

    /// Records an entry without a command (empty, or a configuration change) at `index`.
    pub fn skip(&mut self, index: u64) {
        assert!(index > self.applied, "index {index} after {}", self.applied);
        self.applied = index;
        self.after_mutation();
    }

    /// The hold of `key` if the acquire at log `index` granted it and it is still held (with
    /// or without extensions since).
    pub fn granted_at(&self, key: &[u8], index: u64) -> Option<&Hold> {
        let token = token_at(self.floor?, index, self.shards, self.shard)?;
        self.holds.get(key).filter(|hold| hold.token == token)
    }

    /// The index of the last entry applied or skipped (0 before any).
    pub fn applied(&self) -> u64 {
        self.applied
    }

    /// The token floor, once a Barrier has set it.
    #[cfg(any(test, feature = "testing"))]
    pub fn floor(&self) -> Option<u64> {
        self.floor
    }

    /// The shard index.
    pub fn shard(&self) -> u32 {
        self.shard
    }

    /// The current holder of `key`, if any.
    pub fn holder(&self, key: &[u8]) -> Option<&Hold> {
        self.holds.get(key)
    }

    /// The key `token` holds, if it holds one.
    pub fn key_of(&self, token: u64) -> Option<&[u8]> {
        self.keys.get(&token).map(|key| &key[..])
    }

    /// Every hold with its key, in token order.
    pub fn holds(&self) -> impl Iterator<Item = (&[u8], &Hold)> + '_ {
        self.keys.values().map(|key| (&key[..], &self.holds[key]))
    }

    /// Every key's queued acquires, first in line first, keys in byte order (the order a new
    /// leader queues them again in does not matter across keys; it is fixed for tests).
    pub fn waiting(&self) -> impl Iterator<Item = (&[u8], &QueuedWait)> + '_ {
        waiting_in_order(&self.waiting)
    }

    /// The number of queued acquires.
    pub fn waiters(&self) -> usize {
        self.waiters
    }

    /// Whether `key`'s replicated queue has the acquire of `owner` from client `client`: its
    /// `Enqueue` applied, and neither its grant nor its `Withdraw` yet.
    pub fn queues(&self, key: &[u8], client: u128, owner: u64) -> bool {
        let queue = self.waiting.get(key);
        queue.is_some_and(|queue| {
            (queue.iter()).any(|w| w.queued.client == client && w.queued.owner == owner)
        })
    }

    /// How the queued acquire of `owner` from client `client` was answered, if a `Withdraw`
    /// said so and it is among the last [`ENDED_MAX`] (see the module docs).
    pub fn ended(&self, client: u128, owner: u64) -> Option<Answered> {
        let index = self.ended_at.get(&(client, owner))?;
        self.ended.get(index).map(|&(_, _, answered)| answered)
    }

    /// The number of holds.
    pub fn len(&self) -> usize {
        self.holds.len()
    }

    /// Whether no key is held.
    pub fn is_empty(&self) -> bool {
        self.holds.is_empty()
    }

    /// Called once by a new leader before it may expire anything: every deadline becomes
    /// `max(deadline, now_ms) + grace_ms`, `grace_ms` being at least the election timeout.
    pub fn promote(&mut self, now_ms: u64, grace_ms: u64) {
        for (_, hold) in self.holds.iter_mut() {
            hold.deadline_ms = hold.deadline_ms.max(now_ms).saturating_add(grace_ms);
        }
        self.after_mutation();
    }

    /// At most `max` holds whose deadline is at or before `now_ms`, soonest first, as
    /// `(key, token)`: what a leader proposes `Command::Expire { key, token, as_of: applied() }`
    /// for. O(holds): a leader keeps its lease timers on its core's wheel instead (see the
    /// module docs); tests state what is due with it.
    #[cfg(any(test, feature = "testing"))]
    pub fn due(&self, now_ms: u64, max: usize) -> Vec<(Vec<u8>, u64)> {
        let mut due: Vec<(u64, u64)> = (self.holds.values())
            .filter(|hold| hold.deadline_ms <= now_ms)
            .map(|hold| (hold.deadline_ms, hold.token))
            .collect();
        due.sort_unstable();
        let due = due.into_iter().take(max);
        due.map(|(_, token)| (self.keys[&token].to_vec(), token))
            .collect()
    }

    /// The soonest deadline, if any key is held. O(holds), as [`Self::due`].
    #[cfg(any(test, feature = "testing"))]
    pub fn next_deadline(&self) -> Option<u64> {
        self.holds.values().map(|hold| hold.deadline_ms).min()
    }

    /// A Checkpoint of at most `max` (clamped to [`CHECKPOINT_HOLDS_MAX`]) holds with tokens
    /// above `after`, in token order, each with `deadline - now_ms` remaining. A leader cycles
    /// through all holds: start with `after = 0`, continue after the last token returned, and
    /// wrap to 0 when fewer than `max` come back. Holds with more than `u32::MAX` ms remaining
    /// are left out (a checkpoint must never shorten a lease).
    pub fn checkpoint(&self, now_ms: u64, after: u64, max: usize) -> Command {
        let max = max.min(CHECKPOINT_HOLDS_MAX);
        let holds = self
            .keys
            .range(after.saturating_add(1)..)
            .filter_map(|(_, key)| {
                let hold = &self.holds[key];
                let remaining = hold.deadline_ms.saturating_sub(now_ms);
                let remaining_ms = u32::try_from(remaining).ok()?;
                Some(CheckpointHold {
                    key: key.to_vec(),
                    token: hold.token,
                    remaining_ms,
                })
            })
            .take(max)
            .collect();
        Command::Checkpoint {
            as_of: self.applied,
            holds,
        }
    }

    /// The state as versioned bytes ([`SnapshotImage`]): shard, shards, floor, applied, and
    /// each hold in token order with its time remaining from `now_ms`. O(holds): a core's loop
    /// freezes instead and encodes elsewhere.
    #[cfg(any(test, feature = "testing"))]
    pub fn snapshot(&self, now_ms: u64) -> Vec<u8> {
        self.freeze(now_ms).encode()
    }

    /// An image of the state now, O(1), whose [`Frozen::encode`] is exactly
    /// `snapshot(now_ms)` of the state now, whatever is applied after.
    pub fn freeze(&self, now_ms: u64) -> Frozen {
        Frozen {
            shard: self.shard,
            shards: self.shards,
            floor: self.floor,
            applied: self.applied,
            now_ms,
            holds: self.holds.clone(),
            keys: self.keys.clone(),
            waiting: Box::new((self.waiting.clone(), self.ended.clone())),
        }
    }

    /// The holds alone as a [`SnapshotImage`], each with its lease left at `now_ms`, for a
    /// backup (`crate::cluster::backup`): no queued or ended acquires, whose sessions and
    /// client ids belong to this cluster. O(holds).
    pub fn backup_image(&self, now_ms: u64) -> SnapshotImage {
        let holds = (self.holds())
            .map(|(key, hold)| SnapshotHold {
                key: key.to_vec(),
                token: hold.token,
                owner: hold.owner,
                lease_ms: hold.lease_ms,
                renewed_at: hold.renewed_at,
                remaining_ms: hold.deadline_ms.saturating_sub(now_ms),
            })
            .collect();
        SnapshotImage {
            shard: self.shard,
            shards: self.shards,
            floor: self.floor,
            applied: self.applied,
            holds,
            waiters: Vec::new(),
            ended: Vec::new(),
        }
    }

    /// Rebuilds shard `shard` of `shards` from `snapshot` bytes at this
    /// member's time `now_ms`: each deadline is `now_ms + remaining`. Any bytes that are not a
    /// consistent snapshot of that shard are an error.
    pub fn restore(
        shard: u32,
        shards: u32,
        bytes: &[u8],
        now_ms: u64,
    ) -> Result<Self, DecodeError> {
        let image = SnapshotImage::decode(bytes)?;
        if image.shard != shard || image.shards != shards {
            return Err(DecodeError::Inconsistent("another shard"));
        }
        let mut machine = Self::new(shard, shards);
        if let Some(floor) = image.floor {
            if floor % u64::from(shards) != 0 {
                return Err(DecodeError::Inconsistent("floor"));
            }
        }
        machine.floor = image.floor;
        machine.applied = image.applied;
        for held in image.holds {
            let hold = Hold {
                token: held.token,
                owner: held.owner,
                lease_ms: held.lease_ms,
                deadline_ms: now_ms.saturating_add(held.remaining_ms),
                renewed_at: held.renewed_at,
            };
            if let Some(error) = machine.hold_error(&hold) {
                return Err(DecodeError::Inconsistent(error));
            }
            if machine.holds.contains_key(held.key.as_slice())
                || machine.keys.contains_key(&hold.token)
            {
                return Err(DecodeError::Inconsistent("duplicate key or token"));
            }
            machine.insert(Key::from(held.key), hold);
        }
        for queued in image.waiters {
            let deadline_ms = now_ms.saturating_add(queued.remaining_ms);
            let waiting = QueuedWait {
                queued: queued.waiter,
                deadline_ms,
            };
            machine.push_waiter(&queued.key, waiting);
        }
        let mut after = 0;
        for ended in image.ended {
            if ended.index <= after || ended.index > machine.applied || ended.client == 0 {
                return Err(DecodeError::Inconsistent(
                    "ended acquires' indices or client",
                ));
            }
            after = ended.index;
            let who = (ended.client, ended.owner);
            if machine.ended_at.insert(who, ended.index).is_some() {
                return Err(DecodeError::Inconsistent("an ended acquire listed twice"));
            }
            let record = (ended.client, ended.owner, ended.answered);
            machine.ended.insert(ended.index, record);
        }
        machine.check_invariants();
        Ok(machine)
    }

    /// A deterministic hash of everything members must agree on: shard, floor, applied index,
    /// each hold's key, token, owner, lease and renewal index (not its local deadline), and
    /// the queues.
    #[cfg(any(test, feature = "testing"))]
    pub fn digest(&self) -> u64 {
        let mut state = crate::hash::Fnv::new();
        state.u64(u64::from(self.shard));
        state.u64(u64::from(self.shards));
        state.u64(u64::from(self.floor.is_some()));
        state.u64(self.floor.unwrap_or(0));
        state.u64(self.applied);
        // Token order is the same on every member, whatever the hash map's order.
        for (token, key) in &self.keys {
            let hold = &self.holds[key];
            state.u64(*token);
            state.u64(key.len() as u64);
            state.bytes(key);
            state.u64(hold.owner);
            state.u64(u64::from(hold.lease_ms));
            state.u64(hold.renewed_at);
        }
        for (key, waiting) in self.waiting() {
            let waiter = &waiting.queued;
            state.u64(key.len() as u64);
            state.bytes(key);
            state.u64(waiter.owner);
            state.u64((waiter.client >> 64) as u64);
            state.u64(waiter.client as u64);
            state.u64(u64::from(waiter.grace_s));
            state.u64(u64::from(waiter.lease_ms));
            state.u64(u64::from(waiter.wait_ms));
        }
        for (&index, &(client, owner, answered)) in &self.ended {
            state.u64(index);
            state.u64((client >> 64) as u64);
            state.u64(client as u64);
            state.u64(owner);
            state.u64(u64::from(answered == Answered::Busy));
        }
        state.finish()
    }

    /// Panics if an invariant is broken (see the module docs). O(holds).
    pub fn check_invariants(&self) {
        assert!(self.shards >= 1 && self.shard < self.shards);
        assert!(self.holds_max <= HOLDS_MAX);
        assert!(self.holds.len() <= self.holds_max);
        assert_eq!(self.holds.len(), self.keys.len());
        if let Some(floor) = self.floor {
            assert_eq!(floor % u64::from(self.shards), 0, "floor {floor}");
        }
        for (key, hold) in &self.holds {
            if let Some(error) = self.hold_error(hold) {
                panic!("hold {hold:?}: {error}");
            }
            assert_eq!(self.keys.get(&hold.token), Some(key));
        }
        self.check_waiting();
    }

    /// The queues' part of [`Self::check_invariants`]. O(waiters).
    fn check_waiting(&self) {
        assert!(self.waiters <= WAITERS_MAX);
        let mut counted = 0;
        for queue in self.waiting.values() {
            assert!(!queue.is_empty(), "an empty queue is kept");
            counted += queue.len();
        }
        assert_eq!(counted, self.waiters);
        assert!(self.ended.len() <= ENDED_MAX);
        assert_eq!(self.ended.len(), self.ended_at.len());
        for (&index, &(client, owner, _)) in &self.ended {
            assert!(index <= self.applied && client != 0, "ended at {index}");
            assert_eq!(self.ended_at.get(&(client, owner)), Some(&index));
        }
    }
}

/// The commands, one function each; [`ShardMachine::apply`] has advanced `applied` already.
impl ShardMachine {
    fn barrier(&mut self, proposed: u64) -> Applied {
        if let Some(floor) = self.floor {
            return Applied::Barrier { floor };
        }
        match proposed.checked_next_multiple_of(u64::from(self.shards)) {
            Some(floor) => {
                self.floor = Some(floor);
                Applied::Barrier { floor }
            }
            None => Applied::Exhausted,
        }
    }

    fn acquire(&mut self, key: &[u8], owner: u64, lease_ms: u32, now_ms: u64) -> Applied {
        if let Some(hold) = self.holds.get(key) {
            return Applied::Held { token: hold.token };
        }
        let Some(floor) = self.floor else {
            return Applied::NoFloor;
        };
        if self.holds.len() >= self.holds_max {
            return Applied::Full;
        }
        let Some(token) = token_at(floor, self.applied, self.shards, self.shard) else {
            return Applied::Exhausted;
        };
        let deadline_ms = now_ms.saturating_add(u64::from(lease_ms));
        let hold = Hold {
            token,
            owner,
            lease_ms,
            deadline_ms,
            renewed_at: self.applied,
        };
        self.insert(Key::from(key), hold);
        self.take_waiter(key, owner);
        Applied::Granted { token, deadline_ms }
    }

    fn enqueue(&mut self, key: &[u8], queued: Queued, now_ms: u64) -> Applied {
        if self.waiters >= WAITERS_MAX {
            return Applied::QueueFull;
        }
        let deadline_ms = now_ms.saturating_add(u64::from(queued.wait_ms));
        self.push_waiter(
            key,
            QueuedWait {
                queued,
                deadline_ms,
            },
        );
        Applied::Queued
    }

    fn withdraw(&mut self, key: &[u8], owner: u64, answered: Option<Answered>) -> Applied {
        let Some(waiter) = self.take_waiter(key, owner) else {
            return Applied::NotQueued;
        };
        if let (Some(answered), client @ 1..) = (answered, waiter.client) {
            self.record_ended(client, owner, answered);
        }
        Applied::Withdrawn
    }

    /// Remembers that the acquire of `owner` from `client` ended `answered`, at this index;
    /// the oldest record goes past [`ENDED_MAX`].
    fn record_ended(&mut self, client: u128, owner: u64, answered: Answered) {
        if let Some(before) = self.ended_at.insert((client, owner), self.applied) {
            self.ended.remove(&before);
        }
        self.ended.insert(self.applied, (client, owner, answered));
        if self.ended.len() > ENDED_MAX {
            if let Some(&(index, (client, owner, _))) = self.ended.get_min() {
                self.ended.remove(&index);
                self.ended_at.remove(&(client, owner));
            }
        }
    }

    fn push_waiter(&mut self, key: &[u8], waiter: QueuedWait) {
        match self.waiting.get_mut(key) {
            Some(queue) => queue.push_back(waiter),
            None => {
                self.waiting
                    .insert(Key::from(key), imbl::Vector::unit(waiter));
            }
        }
        self.waiters += 1;
    }

    /// Takes `owner`'s first queued acquire of `key` out of its queue, if it has one.
    fn take_waiter(&mut self, key: &[u8], owner: u64) -> Option<Queued> {
        let queue = self.waiting.get_mut(key)?;
        let at = queue
            .iter()
            .position(|waiter| waiter.queued.owner == owner)?;
        let taken = queue.remove(at).queued;
        if queue.is_empty() {
            self.waiting.remove(key);
        }
        self.waiters -= 1;
        Some(taken)
    }

    fn release(&mut self, key: &[u8], token: u64) -> Applied {
        if !self.is_holder(key, token) {
            return Applied::NotHolder;
        }
        self.remove(key);
        Applied::Released
    }

    fn extend(&mut self, key: &[u8], token: u64, lease_ms: u32, now_ms: u64) -> Applied {
        if !self.is_holder(key, token) {
            return Applied::NotHolder;
        }
        let deadline_ms = now_ms.saturating_add(u64::from(lease_ms));
        let applied = self.applied;
        self.set_deadline(key, deadline_ms);
        if let Some(hold) = self.holds.get_mut(key) {
            hold.lease_ms = lease_ms;
            hold.renewed_at = applied;
        }
        Applied::Extended { deadline_ms }
    }

    fn expire(&mut self, key: &[u8], token: u64, as_of: u64) -> Applied {
        match self.holds.get(key) {
            Some(hold) if hold.token == token && hold.renewed_at > as_of => Applied::Renewed,
            Some(hold) if hold.token == token => {
                self.remove(key);
                Applied::Expired
            }
            _ => Applied::NotHolder,
        }
    }

    fn cap(&mut self, as_of: u64, holds: &[CheckpointHold], now_ms: u64) -> Applied {
        let mut capped = 0;
        for listed in holds {
            let Some(hold) = self.holds.get(listed.key.as_slice()) else {
                continue;
            };
            if hold.token != listed.token || hold.renewed_at > as_of {
                continue;
            }
            let cap_ms = now_ms.saturating_add(u64::from(listed.remaining_ms));
            if cap_ms < hold.deadline_ms {
                self.set_deadline(&listed.key, cap_ms);
                capped += 1;
            }
        }
        Applied::Checkpointed { capped }
    }

    /// After a release or expiry: grants the key to `then` if the holder left (`ended` is
    /// `Released` or `Expired`); any other outcome stands unchanged.
    fn hand_off(
        &mut self,
        key: &[u8],
        ended: Applied,
        then: &Option<Grant>,
        now_ms: u64,
    ) -> Applied {
        let Some(grant) = then else {
            return ended;
        };
        if !matches!(ended, Applied::Released | Applied::Expired) {
            return ended;
        }
        // The key is free and a hold was just removed, so neither `Held` nor `Full` can come
        // back, nor `NoFloor` (a hold existed); only an overflowing token.
        match self.acquire(key, grant.owner, grant.lease_ms, now_ms) {
            Applied::Granted { token, deadline_ms } => Applied::HandedOff { token, deadline_ms },
            refused => {
                debug_assert_eq!(refused, Applied::Exhausted);
                ended
            }
        }
    }

    fn is_holder(&self, key: &[u8], token: u64) -> bool {
        self.holds.get(key).is_some_and(|hold| hold.token == token)
    }

    fn insert(&mut self, key: Key, hold: Hold) {
        self.keys.insert(hold.token, key.clone());
        self.holds.insert(key, hold);
    }

    fn remove(&mut self, key: &[u8]) {
        if let Some(hold) = self.holds.remove(key) {
            self.keys.remove(&hold.token);
        }
    }

    fn set_deadline(&mut self, key: &[u8], deadline_ms: u64) {
        if let Some(hold) = self.holds.get_mut(key) {
            hold.deadline_ms = deadline_ms;
        }
    }

    /// What is wrong with `hold`'s token and renewal index, if anything.
    fn hold_error(&self, hold: &Hold) -> Option<&'static str> {
        let Some(floor) = self.floor else {
            return Some("a hold without a floor");
        };
        let shards = u64::from(self.shards);
        let Some(offset) = hold.token.checked_sub(floor) else {
            return Some("token below the floor");
        };
        if offset % shards != u64::from(self.shard) {
            return Some("token of another shard");
        }
        let index = offset / shards;
        if index == 0 || index > self.applied {
            return Some("token from an index not applied");
        }
        if hold.renewed_at < index || hold.renewed_at > self.applied {
            return Some("renewal index out of range");
        }
        None
    }

    fn after_mutation(&self) {
        if cfg!(debug_assertions) {
            if self.holds.len() + self.waiters + self.ended.len() <= FULL_CHECK_HOLDS_MAX {
                self.check_invariants();
            } else {
                assert_eq!(self.holds.len(), self.keys.len());
            }
        }
    }
}

/// Every key's queued acquires in `waiting`, first in line first, keys in byte order.
fn waiting_in_order(waiting: &Waiting) -> impl Iterator<Item = (&[u8], &QueuedWait)> + '_ {
    let mut keys: Vec<&Key> = waiting.keys().collect();
    keys.sort_unstable();
    keys.into_iter()
        .flat_map(move |key| waiting[key].iter().map(move |waiter| (&key[..], waiter)))
}

/// `floor + index * shards + shard`, or `None` on overflow.
fn token_at(floor: u64, index: u64, shards: u32, shard: u32) -> Option<u64> {
    index
        .checked_mul(u64::from(shards))?
        .checked_add(floor)?
        .checked_add(u64::from(shard))
}
