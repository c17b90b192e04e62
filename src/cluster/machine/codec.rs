//! The bytes of a shard's commands (a raft entry's `data`) and of its snapshots.
//!
//! Every form starts with a version byte ([`COMMAND_VERSION`], [`SNAPSHOT_VERSION`]); all
//! integers are big-endian; a key is a `u16` length then `1..=KEY_BYTES_MAX` bytes.
//!
//! # Versions of a command
//!
//! Commands are a replicated format: an entry written by an earlier build must still decode,
//! and mean the same, on every later one (a member replays its own log, and receives entries
//! that earlier leaders wrote). This build reads versions 1 to 3 and writes each form in the
//! oldest version that has it ([`Command::version`]):
//! * version 1: the forms of the first cluster build;
//! * version 2: the same forms, except that `Release` and `Expire` carry a `then` after their
//!   fixed fields — a flag byte (0: none; 1: a [`Grant`], `owner:u64 lease_ms:u32`, follows).
//!   A version-1 `Release` or `Expire` decodes with `then: None`, which is what it did.
//! * version 3: the forms of version 2, and two more, `Enqueue` and `Withdraw` (replicated
//!   waiters). The forms of version 2 are still written as version 2, so that a log without
//!   waiters stays readable by the previous build: a leader proposes the new forms only once
//!   every member of its cluster speaks the peer wire version that says it reads them.
//! * version 4: the forms of version 3, except that a `Withdraw` carries how its acquire was
//!   answered ([`Answered`]: a byte after the owner, 1 timed out, 2 busy), which every member
//!   then remembers for the client's Resolves. A `Withdraw` without it is still written as
//!   version 3, for the same reason.
//!
//! A member of an earlier build refuses an entry of a later version (unknown version) rather
//! than guess at it, and stops: members never disagree on what an entry does
//! (docs/cluster.md, upgrades).
//!
//! # Versions of a snapshot
//!
//! Version 1: shard, shards, floor, applied, holds. Version 2: the same, then the queued
//! acquires, each with the time left of its wait. Version 3: the same, then the acquires that
//! ended without a grant ([`SnapshotEnded`], oldest first). Each snapshot is written in the
//! oldest version that holds its contents (without ended acquires, 2; without waiters either,
//! 1), for the same reason.
//!
//! Invariants: decoding accepts any bytes and returns an error value for anything that is not
//! exactly one well-formed form (trailing bytes are an error); it never panics and never
//! allocates more than the input can hold. Encoding asserts what the caller must guarantee
//! (key length, hold count): those come from already validated requests, never from a peer.
//!
//! Deliberately not here: what a command *does* ([`super::ShardMachine`]) and whether a
//! snapshot's holds are consistent with its shard (checked by [`super::ShardMachine::restore`]).

use latchkey_client::protocol::KEY_BYTES_MAX;
use std::fmt;

/// The newest command version this build decodes (it decodes
/// [`COMMAND_VERSION_MIN`]`..=COMMAND_VERSION`, and writes each form as [`Command::version`]).
pub const COMMAND_VERSION: u8 = 4;
/// The oldest command version this build decodes.
pub const COMMAND_VERSION_MIN: u8 = 1;
/// The command version that added `Enqueue` and `Withdraw`.
pub const WAITERS_COMMAND_VERSION: u8 = 3;
/// The command version whose `Withdraw` carries how its acquire was answered.
pub const ANSWERED_COMMAND_VERSION: u8 = 4;
/// The newest snapshot version (it carries queued and ended acquires; see the module docs).
pub const SNAPSHOT_VERSION: u8 = 3;
/// The most queued acquires one shard's replicated state keeps: an `Enqueue` past it changes
/// nothing (the leader's own limits keep far below it).
pub const WAITERS_MAX: usize = super::HOLDS_MAX;
/// The most ended acquires one shard's replicated state remembers (a `Withdraw` past it forgets
/// the oldest first): at 33 bytes each in a snapshot, 135 KB per shard. A client asks about an
/// acquire within its grace (at most 60 s) of its answer, so this covers 68 answered
/// withdrawals per second and shard; past that, an older one's Resolve says "never seen",
/// which is as true for the caller (nothing of it stands).
pub const ENDED_MAX: usize = 4096;
/// The most holds one [`Command::Checkpoint`] may carry (its encoding stays under ~4.2 MB even
/// with 1024-byte keys, and one apply stays short). A leader with more holds checkpoints them
/// over several commands (see [`super::ShardMachine::checkpoint`]).
pub const CHECKPOINT_HOLDS_MAX: usize = 4096;
/// The most holds a snapshot may carry: the per-shard limit [`super::HOLDS_MAX`].
pub const SNAPSHOT_HOLDS_MAX: usize = super::HOLDS_MAX;

const TAG_BARRIER: u8 = 1;
const TAG_ACQUIRE: u8 = 2;
const TAG_RELEASE: u8 = 3;
const TAG_EXTEND: u8 = 4;
const TAG_EXPIRE: u8 = 5;
const TAG_CHECKPOINT: u8 = 6;
const TAG_ENQUEUE: u8 = 7;
const TAG_WITHDRAW: u8 = 8;

/// The smallest encoded checkpoint hold: token, remaining, key length, one key byte.
const CHECKPOINT_HOLD_BYTES_MIN: usize = 8 + 4 + 2 + 1;
/// The smallest encoded snapshot hold: token, owner, lease, renewed_at, remaining, key.
const SNAPSHOT_HOLD_BYTES_MIN: usize = 8 + 8 + 4 + 8 + 8 + 2 + 1;
/// The smallest encoded snapshot waiter: a [`Queued`], time remaining, key length, one key
/// byte.
const SNAPSHOT_WAITER_BYTES_MIN: usize = QUEUED_BYTES + 8 + 2 + 1;
/// Bytes of an encoded [`Queued`]: owner, client, grace, lease, wait.
const QUEUED_BYTES: usize = 8 + 16 + 1 + 4 + 4;
/// Bytes of an encoded [`SnapshotEnded`]: client, owner, answered, index.
const SNAPSHOT_ENDED_BYTES: usize = 16 + 8 + 1 + 8;

/// One command of a shard's replicated log, applied by every member in log order.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Command {
    /// Proposed by a new leader before anything else: sets the token floor if it is unset.
    Barrier {
        /// `crate::tokens::wall_clock_floor` at the proposer (rounded up to a multiple of the
        /// shard count when applied).
        floor: u64,
    },
    /// Grant `key` to `owner` for `lease_ms` if it is free.
    Acquire {
        /// The key, `1..=KEY_BYTES_MAX` bytes.
        key: Vec<u8>,
        /// The client's owner id (protocol §2.1).
        owner: u64,
        /// The lease, in milliseconds.
        lease_ms: u32,
    },
    /// Free `key` if `token` holds it; then, if `then` names a waiter, grant it the key in
    /// the same entry (one commit per handoff).
    Release {
        /// The key.
        key: Vec<u8>,
        /// The token the client holds.
        token: u64,
        /// The head of the key's queue on the leader, granted the key if the release takes
        /// effect (its token comes from this entry's index, as an `Acquire`'s would).
        then: Option<Grant>,
    },
    /// Restart the lease of `key` from the apply time if `token` holds it.
    Extend {
        /// The key.
        key: Vec<u8>,
        /// The token the client holds.
        token: u64,
        /// The new lease, in milliseconds.
        lease_ms: u32,
    },
    /// Free `key` because the leader saw `token`'s deadline pass.
    Expire {
        /// The key.
        key: Vec<u8>,
        /// The token whose lease ran out.
        token: u64,
        /// The leader's applied index when it saw the deadline pass: a grant or extension
        /// applied after it makes this expiry stale.
        as_of: u64,
        /// As [`Command::Release`]'s: granted the key if the expiry takes effect.
        then: Option<Grant>,
    },
    /// Caps each listed hold's deadline at `apply time + remaining_ms`.
    Checkpoint {
        /// The leader's applied index when it computed the remaining times: a hold renewed
        /// after it is left alone.
        as_of: u64,
        /// At most [`CHECKPOINT_HOLDS_MAX`] holds.
        holds: Vec<CheckpointHold>,
    },
    /// Queue `waiter` at the back of `key`'s queue (the leader queued it; it is granted by a
    /// later `Acquire` or `then` naming its owner, which takes it out of the queue).
    Enqueue {
        /// The key.
        key: Vec<u8>,
        /// The queued acquire.
        waiter: Queued,
    },
    /// Take `owner`'s first queued acquire out of `key`'s queue (it timed out, was cancelled,
    /// refused or left with its session).
    Withdraw {
        /// The key.
        key: Vec<u8>,
        /// The waiter's owner id.
        owner: u64,
        /// How the leader answered it (version 4; `None`: not said, version 3): remembered
        /// with its client id for a Resolve ([`super::ShardMachine::ended`]).
        answered: Option<Answered>,
    },
}

/// How a queued acquire that left its queue without a grant was answered (a Resolve's fate).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Answered {
    /// `T`: its wait ran out, it was cancelled, or its client's grace ended.
    TimedOut,
    /// `B`: refused (the shard's key limit, or its leader stopping with no other member up).
    Busy,
}

impl Answered {
    fn byte(self) -> u8 {
        match self {
            Answered::TimedOut => 1,
            Answered::Busy => 2,
        }
    }

    fn from_byte(byte: u8) -> Result<Answered, DecodeError> {
        match byte {
            1 => Ok(Answered::TimedOut),
            2 => Ok(Answered::Busy),
            other => Err(DecodeError::Flag(other)),
        }
    }
}

/// A queued acquire as the replicated state keeps it: what a new leader needs to queue it
/// again in its place and to answer its client's Resolve (docs/protocol.md §5).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Queued {
    /// Its owner id (protocol §2.1).
    pub owner: u64,
    /// The client id its session identified with (0: none; such a waiter cannot be resolved,
    /// and a new leader does not queue it again).
    pub client: u128,
    /// That client's grace, in seconds (how long a new leader keeps it for a Resolve).
    pub grace_s: u8,
    /// The lease it asks for, in milliseconds.
    pub lease_ms: u32,
    /// Its wait, in milliseconds (a new leader restarts it in full).
    pub wait_ms: u32,
}

/// The waiter a [`Command::Release`] or [`Command::Expire`] hands its key to.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Grant {
    /// The waiter's owner id (protocol §2.1).
    pub owner: u64,
    /// Its lease, in milliseconds.
    pub lease_ms: u32,
}

/// One hold in a [`Command::Checkpoint`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CheckpointHold {
    /// The key.
    pub key: Vec<u8>,
    /// The holder's token when the leader computed `remaining_ms`.
    pub token: u64,
    /// The leader's deadline minus its clock at propose time, in milliseconds.
    pub remaining_ms: u32,
}

/// One hold in a snapshot image: everything but the deadline, which is sent as time remaining.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SnapshotHold {
    /// The key.
    pub key: Vec<u8>,
    /// The holder's token.
    pub token: u64,
    /// The holder's owner id.
    pub owner: u64,
    /// The lease last granted or extended, in milliseconds.
    pub lease_ms: u32,
    /// The log index of the grant or last extension.
    pub renewed_at: u64,
    /// The snapshotting member's deadline minus its clock, in milliseconds.
    pub remaining_ms: u64,
}

/// One queued acquire in a snapshot image (in queue order within its key).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SnapshotWaiter {
    /// The key.
    pub key: Vec<u8>,
    /// The queued acquire.
    pub waiter: Queued,
    /// The snapshotting member's deadline for its wait minus its clock, in milliseconds.
    pub remaining_ms: u64,
}

/// One acquire that ended without a grant in a snapshot image (oldest first).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SnapshotEnded {
    /// Its client id (never 0).
    pub client: u128,
    /// Its owner id.
    pub owner: u64,
    /// How it was answered.
    pub answered: Answered,
    /// The log index of its `Withdraw`.
    pub index: u64,
}

/// A shard's state as bytes: see `ShardMachine::snapshot`.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct SnapshotImage {
    /// The shard index.
    pub shard: u32,
    /// The shard count.
    pub shards: u32,
    /// The token floor, once a Barrier set it.
    pub floor: Option<u64>,
    /// The last applied log index.
    pub applied: u64,
    /// The holds, at most [`HOLDS_MAX`](super::HOLDS_MAX).
    pub holds: Vec<SnapshotHold>,
    /// The queued acquires, at most [`WAITERS_MAX`], each key's in queue order.
    pub waiters: Vec<SnapshotWaiter>,
    /// The acquires that ended without a grant, at most [`ENDED_MAX`], oldest first.
    pub ended: Vec<SnapshotEnded>,
}

/// Why bytes are not a command or a snapshot (or a snapshot does not fit its shard).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum DecodeError {
    /// The bytes ended inside a field.
    Truncated,
    /// An unknown version byte.
    Version(u8),
    /// An unknown command tag.
    Tag(u8),
    /// A flag byte that is neither 0 nor 1, or an [`Answered`] byte that is neither 1 nor 2.
    Flag(u8),
    /// A key length outside `1..=KEY_BYTES_MAX`.
    KeyLength(usize),
    /// More holds (or waiters) than the form allows.
    TooManyHolds(usize),
    /// Bytes left over after a complete form.
    Trailing(usize),
    /// A snapshot whose contents are inconsistent (what is wrong, in words).
    Inconsistent(&'static str),
}

impl fmt::Display for DecodeError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Truncated => write!(f, "truncated"),
            Self::Version(v) => write!(f, "unknown version {v}"),
            Self::Tag(t) => write!(f, "unknown command tag {t}"),
            Self::Flag(b) => write!(f, "flag byte {b} out of range"),
            Self::KeyLength(n) => write!(f, "key length {n} outside 1..={KEY_BYTES_MAX}"),
            Self::TooManyHolds(n) => write!(f, "{n} holds is too many"),
            Self::Trailing(n) => write!(f, "{n} trailing bytes"),
            Self::Inconsistent(what) => write!(f, "inconsistent snapshot: {what}"),
        }
    }
}

impl std::error::Error for DecodeError {}

impl Command {
    /// Appends the encoding to `out`. Panics if a key is not `1..=KEY_BYTES_MAX` bytes or a
    /// checkpoint has more than [`CHECKPOINT_HOLDS_MAX`] holds: the proposer checks those.
    pub fn encode_into(&self, out: &mut Vec<u8>) {
        out.push(self.version());
        match self {
            Self::Barrier { floor } => {
                out.push(TAG_BARRIER);
                out.extend_from_slice(&floor.to_be_bytes());
            }
            Self::Acquire {
                key,
                owner,
                lease_ms,
            } => {
                out.push(TAG_ACQUIRE);
                out.extend_from_slice(&owner.to_be_bytes());
                out.extend_from_slice(&lease_ms.to_be_bytes());
                put_key(out, key);
            }
            Self::Release { key, token, then } => {
                out.push(TAG_RELEASE);
                out.extend_from_slice(&token.to_be_bytes());
                put_then(out, then);
                put_key(out, key);
            }
            Self::Extend {
                key,
                token,
                lease_ms,
            } => {
                out.push(TAG_EXTEND);
                out.extend_from_slice(&token.to_be_bytes());
                out.extend_from_slice(&lease_ms.to_be_bytes());
                put_key(out, key);
            }
            Self::Expire {
                key,
                token,
                as_of,
                then,
            } => {
                out.push(TAG_EXPIRE);
                out.extend_from_slice(&token.to_be_bytes());
                out.extend_from_slice(&as_of.to_be_bytes());
                put_then(out, then);
                put_key(out, key);
            }
            Self::Checkpoint { as_of, holds } => encode_checkpoint(out, *as_of, holds),
            Self::Enqueue { key, waiter } => {
                out.push(TAG_ENQUEUE);
                put_queued(out, waiter);
                put_key(out, key);
            }
            Self::Withdraw {
                key,
                owner,
                answered,
            } => {
                out.push(TAG_WITHDRAW);
                out.extend_from_slice(&owner.to_be_bytes());
                if let Some(answered) = answered {
                    out.push(answered.byte());
                }
                put_key(out, key);
            }
        }
    }

    /// The version this form is written in: the oldest that has it (see the module docs).
    pub fn version(&self) -> u8 {
        match self {
            Self::Withdraw {
                answered: Some(_), ..
            } => ANSWERED_COMMAND_VERSION,
            Self::Enqueue { .. } | Self::Withdraw { .. } => WAITERS_COMMAND_VERSION,
            _ => 2,
        }
    }

    /// The key the command names, if it names one.
    #[cfg(any(test, feature = "testing"))]
    pub fn key(&self) -> Option<&[u8]> {
        match self {
            Self::Acquire { key, .. }
            | Self::Release { key, .. }
            | Self::Extend { key, .. }
            | Self::Expire { key, .. }
            | Self::Enqueue { key, .. }
            | Self::Withdraw { key, .. } => Some(key),
            Self::Barrier { .. } | Self::Checkpoint { .. } => None,
        }
    }

    /// The encoding as a new vector.
    pub fn encode(&self) -> Vec<u8> {
        let mut out = Vec::new();
        self.encode_into(&mut out);
        out
    }

    /// Decodes exactly one command of any version this build reads (see the module docs).
    pub fn decode(bytes: &[u8]) -> Result<Command, DecodeError> {
        let mut reader = Reader::new(bytes);
        let version = reader.u8()?;
        if !(COMMAND_VERSION_MIN..=COMMAND_VERSION).contains(&version) {
            return Err(DecodeError::Version(version));
        }
        // Version 1 had no `then`; every later version has it.
        let has_then = version >= 2;
        let command = match reader.u8()? {
            TAG_BARRIER => Command::Barrier {
                floor: reader.u64()?,
            },
            TAG_ACQUIRE => {
                let (owner, lease_ms) = (reader.u64()?, reader.u32()?);
                let key = reader.key()?;
                Command::Acquire {
                    key,
                    owner,
                    lease_ms,
                }
            }
            TAG_RELEASE => {
                let token = reader.u64()?;
                let then = reader.then(has_then)?;
                Command::Release {
                    key: reader.key()?,
                    token,
                    then,
                }
            }
            TAG_EXTEND => {
                let (token, lease_ms) = (reader.u64()?, reader.u32()?);
                let key = reader.key()?;
                Command::Extend {
                    key,
                    token,
                    lease_ms,
                }
            }
            TAG_EXPIRE => {
                let (token, as_of) = (reader.u64()?, reader.u64()?);
                let then = reader.then(has_then)?;
                let key = reader.key()?;
                Command::Expire {
                    key,
                    token,
                    as_of,
                    then,
                }
            }
            TAG_CHECKPOINT => decode_checkpoint(&mut reader)?,
            TAG_ENQUEUE if version >= WAITERS_COMMAND_VERSION => {
                let waiter = reader.queued()?;
                Command::Enqueue {
                    key: reader.key()?,
                    waiter,
                }
            }
            TAG_WITHDRAW if version >= WAITERS_COMMAND_VERSION => {
                let owner = reader.u64()?;
                let answered = match version >= ANSWERED_COMMAND_VERSION {
                    true => Some(Answered::from_byte(reader.u8()?)?),
                    false => None,
                };
                Command::Withdraw {
                    key: reader.key()?,
                    owner,
                    answered,
                }
            }
            tag => return Err(DecodeError::Tag(tag)),
        };
        reader.finish()?;
        Ok(command)
    }
}

fn encode_checkpoint(out: &mut Vec<u8>, as_of: u64, holds: &[CheckpointHold]) {
    assert!(holds.len() <= CHECKPOINT_HOLDS_MAX, "checkpoint too large");
    out.push(TAG_CHECKPOINT);
    out.extend_from_slice(&as_of.to_be_bytes());
    // The assert above keeps the count within u16.
    out.extend_from_slice(&(holds.len() as u16).to_be_bytes());
    for hold in holds {
        out.extend_from_slice(&hold.token.to_be_bytes());
        out.extend_from_slice(&hold.remaining_ms.to_be_bytes());
        put_key(out, &hold.key);
    }
}

fn decode_checkpoint(reader: &mut Reader<'_>) -> Result<Command, DecodeError> {
    let as_of = reader.u64()?;
    let count = usize::from(reader.u16()?);
    if count > CHECKPOINT_HOLDS_MAX {
        return Err(DecodeError::TooManyHolds(count));
    }
    reader.can_hold(count, CHECKPOINT_HOLD_BYTES_MIN)?;
    let mut holds = Vec::with_capacity(count);
    for _ in 0..count {
        let (token, remaining_ms) = (reader.u64()?, reader.u32()?);
        let key = reader.key()?;
        holds.push(CheckpointHold {
            key,
            token,
            remaining_ms,
        });
    }
    Ok(Command::Checkpoint { as_of, holds })
}

impl SnapshotImage {
    /// The encoding: version, shard, shards, floor flag and value, applied, count, holds, then
    /// (version 2, only if there are waiters or ended acquires) count, waiters, then (version 3,
    /// only if there are ended acquires) count, ended acquires. Panics on a key of the wrong
    /// length, more than [`HOLDS_MAX`](super::HOLDS_MAX) holds, [`WAITERS_MAX`] waiters or
    /// [`ENDED_MAX`] ended acquires.
    pub fn encode(&self) -> Vec<u8> {
        assert!(self.holds.len() <= SNAPSHOT_HOLDS_MAX, "snapshot too large");
        assert!(self.waiters.len() <= WAITERS_MAX, "snapshot too large");
        assert!(self.ended.len() <= ENDED_MAX, "snapshot too large");
        let mut out = Vec::with_capacity(32 + self.holds.len() * 48);
        let version = match (self.waiters.is_empty(), self.ended.is_empty()) {
            (_, false) => 3,
            (false, true) => 2,
            (true, true) => 1,
        };
        out.push(version);
        out.extend_from_slice(&self.shard.to_be_bytes());
        out.extend_from_slice(&self.shards.to_be_bytes());
        out.push(u8::from(self.floor.is_some()));
        out.extend_from_slice(&self.floor.unwrap_or(0).to_be_bytes());
        out.extend_from_slice(&self.applied.to_be_bytes());
        // The assert above keeps the count within u32.
        out.extend_from_slice(&(self.holds.len() as u32).to_be_bytes());
        for hold in &self.holds {
            out.extend_from_slice(&hold.token.to_be_bytes());
            out.extend_from_slice(&hold.owner.to_be_bytes());
            out.extend_from_slice(&hold.lease_ms.to_be_bytes());
            out.extend_from_slice(&hold.renewed_at.to_be_bytes());
            out.extend_from_slice(&hold.remaining_ms.to_be_bytes());
            put_key(&mut out, &hold.key);
        }
        if version >= 2 {
            // The assert above keeps the count within u32.
            out.extend_from_slice(&(self.waiters.len() as u32).to_be_bytes());
            for queued in &self.waiters {
                put_queued(&mut out, &queued.waiter);
                out.extend_from_slice(&queued.remaining_ms.to_be_bytes());
                put_key(&mut out, &queued.key);
            }
        }
        if version >= 3 {
            // The assert above keeps the count within u32.
            out.extend_from_slice(&(self.ended.len() as u32).to_be_bytes());
            for ended in &self.ended {
                out.extend_from_slice(&ended.client.to_be_bytes());
                out.extend_from_slice(&ended.owner.to_be_bytes());
                out.push(ended.answered.byte());
                out.extend_from_slice(&ended.index.to_be_bytes());
            }
        }
        out
    }

    /// Decodes exactly one snapshot image from `bytes` (its form only; see
    /// [`super::ShardMachine::restore`] for its meaning).
    pub fn decode(bytes: &[u8]) -> Result<SnapshotImage, DecodeError> {
        let mut reader = Reader::new(bytes);
        let version = reader.u8()?;
        if !(1..=SNAPSHOT_VERSION).contains(&version) {
            return Err(DecodeError::Version(version));
        }
        let (shard, shards) = (reader.u32()?, reader.u32()?);
        let floor = match (reader.u8()?, reader.u64()?) {
            (0, 0) => None,
            (1, floor) => Some(floor),
            _ => return Err(DecodeError::Inconsistent("floor flag")),
        };
        let applied = reader.u64()?;
        let count = reader.count(SNAPSHOT_HOLDS_MAX, SNAPSHOT_HOLD_BYTES_MIN)?;
        let mut holds = Vec::with_capacity(count);
        for _ in 0..count {
            let (token, owner, lease_ms) = (reader.u64()?, reader.u64()?, reader.u32()?);
            let (renewed_at, remaining_ms) = (reader.u64()?, reader.u64()?);
            let key = reader.key()?;
            holds.push(SnapshotHold {
                key,
                token,
                owner,
                lease_ms,
                renewed_at,
                remaining_ms,
            });
        }
        let mut waiters = Vec::new();
        if version >= 2 {
            let count = reader.count(WAITERS_MAX, SNAPSHOT_WAITER_BYTES_MIN)?;
            waiters.reserve_exact(count);
            for _ in 0..count {
                let (waiter, remaining_ms) = (reader.queued()?, reader.u64()?);
                let key = reader.key()?;
                waiters.push(SnapshotWaiter {
                    key,
                    waiter,
                    remaining_ms,
                });
            }
        }
        let mut ended = Vec::new();
        if version >= 3 {
            let count = reader.count(ENDED_MAX, SNAPSHOT_ENDED_BYTES)?;
            ended.reserve_exact(count);
            for _ in 0..count {
                let (client, owner) = (reader.u128()?, reader.u64()?);
                let answered = Answered::from_byte(reader.u8()?)?;
                let index = reader.u64()?;
                ended.push(SnapshotEnded {
                    client,
                    owner,
                    answered,
                    index,
                });
            }
        }
        reader.finish()?;
        Ok(SnapshotImage {
            shard,
            shards,
            floor,
            applied,
            holds,
            waiters,
            ended,
        })
    }
}

fn put_then(out: &mut Vec<u8>, then: &Option<Grant>) {
    match then {
        None => out.push(0),
        Some(grant) => {
            out.push(1);
            out.extend_from_slice(&grant.owner.to_be_bytes());
            out.extend_from_slice(&grant.lease_ms.to_be_bytes());
        }
    }
}

fn put_queued(out: &mut Vec<u8>, queued: &Queued) {
    out.extend_from_slice(&queued.owner.to_be_bytes());
    out.extend_from_slice(&queued.client.to_be_bytes());
    out.push(queued.grace_s);
    out.extend_from_slice(&queued.lease_ms.to_be_bytes());
    out.extend_from_slice(&queued.wait_ms.to_be_bytes());
}

fn put_key(out: &mut Vec<u8>, key: &[u8]) {
    assert!(
        (1..=KEY_BYTES_MAX).contains(&key.len()),
        "key of {} bytes",
        key.len()
    );
    // KEY_BYTES_MAX fits in u16 (checked below at compile time).
    out.extend_from_slice(&(key.len() as u16).to_be_bytes());
    out.extend_from_slice(key);
}

const _: () = assert!(KEY_BYTES_MAX <= u16::MAX as usize);
const _: () = assert!(CHECKPOINT_HOLDS_MAX <= u16::MAX as usize);
const _: () = assert!(SNAPSHOT_HOLDS_MAX <= u32::MAX as usize);
const _: () = assert!(WAITERS_MAX <= u32::MAX as usize);
const _: () = assert!(ENDED_MAX <= u32::MAX as usize);

/// A cursor over untrusted bytes: every read checks the length first.
struct Reader<'a> {
    bytes: &'a [u8],
    at: usize,
}

impl<'a> Reader<'a> {
    fn new(bytes: &'a [u8]) -> Self {
        Reader { bytes, at: 0 }
    }

    fn take<const N: usize>(&mut self) -> Result<[u8; N], DecodeError> {
        let rest = &self.bytes[self.at..];
        let field = rest.get(..N).ok_or(DecodeError::Truncated)?;
        let mut out = [0u8; N];
        out.copy_from_slice(field);
        self.at += N;
        Ok(out)
    }

    fn u8(&mut self) -> Result<u8, DecodeError> {
        Ok(self.take::<1>()?[0])
    }

    fn u16(&mut self) -> Result<u16, DecodeError> {
        Ok(u16::from_be_bytes(self.take()?))
    }

    fn u32(&mut self) -> Result<u32, DecodeError> {
        Ok(u32::from_be_bytes(self.take()?))
    }

    fn u64(&mut self) -> Result<u64, DecodeError> {
        Ok(u64::from_be_bytes(self.take()?))
    }

    fn key(&mut self) -> Result<Vec<u8>, DecodeError> {
        let length = usize::from(self.u16()?);
        if !(1..=KEY_BYTES_MAX).contains(&length) {
            return Err(DecodeError::KeyLength(length));
        }
        let rest = &self.bytes[self.at..];
        let key = rest.get(..length).ok_or(DecodeError::Truncated)?;
        self.at += length;
        Ok(key.to_vec())
    }

    fn u128(&mut self) -> Result<u128, DecodeError> {
        Ok(u128::from_be_bytes(self.take()?))
    }

    fn queued(&mut self) -> Result<Queued, DecodeError> {
        let (owner, client, grace_s) = (self.u64()?, self.u128()?, self.u8()?);
        let (lease_ms, wait_ms) = (self.u32()?, self.u32()?);
        Ok(Queued {
            owner,
            client,
            grace_s,
            lease_ms,
            wait_ms,
        })
    }

    /// A `then` if the version has one (`present`): a flag byte, and a [`Grant`] after a 1.
    fn then(&mut self, present: bool) -> Result<Option<Grant>, DecodeError> {
        if !present {
            return Ok(None);
        }
        match self.u8()? {
            0 => Ok(None),
            1 => {
                let (owner, lease_ms) = (self.u64()?, self.u32()?);
                Ok(Some(Grant { owner, lease_ms }))
            }
            flag => Err(DecodeError::Flag(flag)),
        }
    }

    /// A snapshot list's `u32` count of records: refused above `max` (`TooManyHolds`), or when
    /// the remaining bytes cannot hold that many records of `record_bytes_min` (before anything
    /// is allocated for them).
    fn count(&mut self, max: usize, record_bytes_min: usize) -> Result<usize, DecodeError> {
        let count = usize::try_from(self.u32()?).unwrap_or(usize::MAX);
        if count > max {
            return Err(DecodeError::TooManyHolds(count));
        }
        self.can_hold(count, record_bytes_min)?;
        Ok(count)
    }

    /// Refuses a count of records that the remaining bytes cannot hold, before allocating.
    fn can_hold(&self, count: usize, record_bytes_min: usize) -> Result<(), DecodeError> {
        let rest = self.bytes.len() - self.at;
        if count.saturating_mul(record_bytes_min) > rest {
            return Err(DecodeError::Truncated);
        }
        Ok(())
    }

    fn finish(&self) -> Result<(), DecodeError> {
        match self.bytes.len() - self.at {
            0 => Ok(()),
            rest => Err(DecodeError::Trailing(rest)),
        }
    }
}
