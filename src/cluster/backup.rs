//! Backups of a cluster's locks (`latchkey cluster backup FILE`) and the state a new cluster
//! starts from (`cluster.restore_from`). Sans-IO: bytes in, bytes or values out.
//!
//! # One shard's copy
//!
//! The member that leads and serves a shard answers `GET /cluster/backup?shard=N` with a
//! [`ShardBackup`]: the shard, the shard count, the applied index and term, and the shard
//! machine's holds at that index as a snapshot image (the codec of
//! [`super::machine::SnapshotImage`]), each hold with the lease it has left. Queued acquires and
//! the ended acquires remembered for Resolves are left out: their sessions and client ids
//! belong to the old cluster. Bytes: `shard:u32 shards:u32 applied:u64 term:u64 length:u32`,
//! then the image (big-endian, like the codec). A shard of more than [`BACKUP_HOLDS_MAX`] holds,
//! or whose copy is over [`SHARD_BACKUP_BYTES_MAX`], is refused ([`BackupRefusal`]).
//!
//! # The file
//!
//! `MAGIC` (8 bytes), the format version ([`FORMAT_VERSION`], one byte), the shard count
//! (`u32`), then one `length:u32` and [`ShardBackup`] per shard in shard order, then the
//! CRC-32C (the write-ahead log's, `u32`) of every byte before it. A reader refuses a file that
//! is not one, of another version, over [`FILE_BYTES_MAX`], whose checksum does not match
//! (truncated or corrupt), or whose records are not every shard once, each a consistent state
//! ([`super::machine::ShardMachine::restore`] of it succeeds).
//!
//! # Starting from it
//!
//! [`BackupFile::initial_states`] gives each shard's initial Raft snapshot, the same on every
//! member (so members agree without exchanging it). Tokens continue above the backup's: the
//! old cluster issued no token above the *ceiling*, the highest `floor + applied × shards +
//! shard` over the shards (docs/cluster-design.md: a grant's token comes from its log index).
//! Each shard starts at an index at least its applied one, raised so that its next token is
//! above the ceiling; a shard that never had a floor gets the ceiling (rounded up to a multiple
//! of the shard count) as its floor. Holds keep their tokens, owners and the lease they had
//! left, counted from the moment each member of the new cluster loads the state.

use super::machine::{ShardMachine, SnapshotImage};
use super::wal::crc32c;
use std::fmt;

/// The file's first bytes.
pub const MAGIC: &[u8; 8] = b"LKBACKUP";
/// The file format this build writes and reads.
pub const FORMAT_VERSION: u8 = 1;
/// The most holds one shard's copy carries: the leader encodes it on its core's loop (O(holds),
/// like `/keys`' merge), so a shard holding more is refused rather than stall its core long.
pub const BACKUP_HOLDS_MAX: usize = 100_000;
/// The most bytes of one shard's copy (the answer must fit the admin client's 16 MiB).
pub const SHARD_BACKUP_BYTES_MAX: usize = 15 << 20;
/// The most bytes of a backup file that are read.
pub const FILE_BYTES_MAX: u64 = 1 << 30;

/// Bytes of a [`ShardBackup`]'s fixed fields.
const RECORD_HEAD_BYTES: usize = 4 + 4 + 8 + 8 + 4;
/// Bytes of the file's fixed fields: magic, version, shard count, checksum.
const FILE_FIXED_BYTES: usize = MAGIC.len() + 1 + 4 + 4;

/// One shard's copy (see the module docs).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ShardBackup {
    /// The shard.
    pub shard: u32,
    /// The shard count of its cluster.
    pub shards: u32,
    /// The leader's applied index at the copy.
    pub applied: u64,
    /// The leader's term at the copy.
    pub term: u64,
    /// The holds at `applied` (no waiters, no ended acquires).
    pub image: SnapshotImage,
}

/// Why a leader did not give a shard's copy.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum BackupRefusal {
    /// The server is a single node.
    NotCluster,
    /// No such shard.
    NoShard {
        /// The shard asked for.
        shard: u32,
        /// The cluster's shard count.
        shards: u32,
    },
    /// This member does not serve the shard.
    NotLeader {
        /// The shard.
        shard: u32,
        /// The leader this member knows of: its id and client address.
        leader: Option<(u64, String)>,
    },
    /// The shard holds more than [`BACKUP_HOLDS_MAX`] keys.
    TooManyHolds {
        /// The shard.
        shard: u32,
        /// Its holds.
        holds: usize,
    },
    /// The copy is over [`SHARD_BACKUP_BYTES_MAX`].
    TooLarge {
        /// The shard.
        shard: u32,
        /// Its bytes.
        bytes: usize,
    },
}

impl BackupRefusal {
    /// The HTTP status of the refusal: 404 (no such shard here), 421 (ask its leader), 507
    /// (over a limit).
    pub fn status(&self) -> u16 {
        match self {
            Self::NotCluster | Self::NoShard { .. } => 404,
            Self::NotLeader { .. } => 421,
            Self::TooManyHolds { .. } | Self::TooLarge { .. } => 507,
        }
    }
}

impl fmt::Display for BackupRefusal {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::NotCluster => write!(f, "not a cluster member: nothing to back up"),
            Self::NoShard { shard, shards } => {
                write!(f, "no shard {shard}: the cluster has {shards} shards")
            }
            Self::NotLeader {
                shard,
                leader: Some((id, client)),
            } => write!(
                f,
                "this member does not serve shard {shard}: its leader is member {id} at {client}"
            ),
            Self::NotLeader {
                shard,
                leader: None,
            } => write!(
                f,
                "this member does not serve shard {shard}, and knows no leader of it (an \
                 election, or no quorum)"
            ),
            Self::TooManyHolds { shard, holds } => write!(
                f,
                "shard {shard} holds {holds} keys, more than a backup takes \
                 ({BACKUP_HOLDS_MAX} per shard)"
            ),
            Self::TooLarge { shard, bytes } => write!(
                f,
                "the copy of shard {shard} is {bytes} bytes, more than a backup takes \
                 ({SHARD_BACKUP_BYTES_MAX} per shard)"
            ),
        }
    }
}

/// Why bytes are not a backup (file or shard copy), or not one a cluster can start from.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum BackupError {
    /// Not a backup file at all (another magic).
    NotBackup,
    /// A format version this build does not read.
    Version(u8),
    /// The checksum does not match: truncated or corrupt.
    Checksum,
    /// Larger than [`FILE_BYTES_MAX`].
    TooLarge(u64),
    /// Well framed but wrong inside (what, in words).
    Corrupt(String),
    /// The file's shard count is not the cluster's.
    Shards {
        /// The file's.
        file: u32,
        /// The configuration's.
        config: u32,
    },
}

impl fmt::Display for BackupError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::NotBackup => write!(f, "not a latchkey backup file"),
            Self::Version(v) => write!(
                f,
                "backup format version {v}; this build reads version {FORMAT_VERSION}"
            ),
            Self::Checksum => write!(f, "checksum mismatch: the file is truncated or corrupt"),
            Self::TooLarge(n) => {
                write!(f, "{n} bytes, more than a backup may be ({FILE_BYTES_MAX})")
            }
            Self::Corrupt(why) => write!(f, "corrupt: {why}"),
            Self::Shards { file, config } => write!(
                f,
                "the backup has {file} shards, cluster.shards is {config} (a backup starts a \
                 cluster of the same shard count)"
            ),
        }
    }
}

impl std::error::Error for BackupError {}

fn corrupt(why: impl Into<String>) -> BackupError {
    BackupError::Corrupt(why.into())
}

impl ShardBackup {
    /// The copy of `machine` now (its applied index, `term`, each hold with its lease left at
    /// `now_ms`), or why not: more than [`BACKUP_HOLDS_MAX`] holds or
    /// [`SHARD_BACKUP_BYTES_MAX`] bytes. O(holds).
    pub fn encode_of(
        machine: &ShardMachine,
        shards: u32,
        term: u64,
        now_ms: u64,
    ) -> Result<Vec<u8>, BackupRefusal> {
        let shard = machine.shard();
        if machine.len() > BACKUP_HOLDS_MAX {
            let holds = machine.len();
            return Err(BackupRefusal::TooManyHolds { shard, holds });
        }
        let copy = ShardBackup {
            shard,
            shards,
            applied: machine.applied(),
            term,
            image: machine.backup_image(now_ms),
        };
        let bytes = copy.encode();
        if bytes.len() > SHARD_BACKUP_BYTES_MAX {
            let bytes = bytes.len();
            return Err(BackupRefusal::TooLarge { shard, bytes });
        }
        Ok(bytes)
    }

    /// The bytes (see the module docs).
    pub fn encode(&self) -> Vec<u8> {
        let image = self.image.encode();
        let mut out = Vec::with_capacity(RECORD_HEAD_BYTES + image.len());
        out.extend_from_slice(&self.shard.to_be_bytes());
        out.extend_from_slice(&self.shards.to_be_bytes());
        out.extend_from_slice(&self.applied.to_be_bytes());
        out.extend_from_slice(&self.term.to_be_bytes());
        // The image of at most SHARD_BACKUP_BYTES_MAX is checked by the caller; a larger one
        // still fits u32 (holds are bounded by HOLDS_MAX of at most ~1 KiB each).
        out.extend_from_slice(&(image.len() as u32).to_be_bytes());
        out.extend_from_slice(&image);
        out
    }

    /// Decodes exactly one copy and checks it: its image is of its shard and applied index,
    /// has no waiters or ended acquires, and is a consistent state.
    pub fn decode(bytes: &[u8]) -> Result<ShardBackup, BackupError> {
        let mut reader = Cursor { bytes, at: 0 };
        let (shard, shards) = (reader.u32()?, reader.u32()?);
        let (applied, term) = (reader.u64()?, reader.u64()?);
        let length = reader.u32()? as usize;
        let image_bytes = reader.take(length)?;
        if reader.at != bytes.len() {
            return Err(corrupt(format!(
                "{} bytes after a shard's copy",
                bytes.len() - reader.at
            )));
        }
        if shards == 0 || shard >= shards {
            return Err(corrupt(format!("shard {shard} of {shards}")));
        }
        let image = SnapshotImage::decode(image_bytes)
            .map_err(|e| corrupt(format!("shard {shard}: {e}")))?;
        if image.shard != shard || image.shards != shards || image.applied != applied {
            return Err(corrupt(format!(
                "shard {shard}: its image is of another shard or index"
            )));
        }
        if !image.waiters.is_empty() || !image.ended.is_empty() {
            return Err(corrupt(format!(
                "shard {shard}: a backup carries no queued acquires"
            )));
        }
        ShardMachine::restore(shard, shards, image_bytes, 0)
            .map_err(|e| corrupt(format!("shard {shard}: {e}")))?;
        Ok(ShardBackup {
            shard,
            shards,
            applied,
            term,
            image,
        })
    }

    /// The highest token the old cluster may have issued on this shard: `floor + applied ×
    /// shards + shard` (`None` without a floor: it issued none).
    fn ceiling(&self) -> Option<u64> {
        let floor = self.image.floor?;
        let offset = self.applied.saturating_mul(u64::from(self.shards));
        Some(
            floor
                .saturating_add(offset)
                .saturating_add(u64::from(self.shard)),
        )
    }
}

/// A whole backup: every shard's copy, in shard order.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct BackupFile {
    /// One per shard, shard `i` at `i`.
    pub shards: Vec<ShardBackup>,
}

/// A shard's initial state in a new cluster (see [`BackupFile::initial_states`]).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct InitialState {
    /// The shard.
    pub shard: u32,
    /// The index its Raft log starts after (its snapshot's).
    pub index: u64,
    /// The term of that snapshot.
    pub term: u64,
    /// The snapshot image's bytes.
    pub data: Vec<u8>,
}

impl BackupFile {
    /// The file's bytes, or [`BackupError::TooLarge`] past [`FILE_BYTES_MAX`] (a file no
    /// member would read).
    pub fn encode(&self) -> Result<Vec<u8>, BackupError> {
        let mut out = Vec::new();
        out.extend_from_slice(MAGIC);
        out.push(FORMAT_VERSION);
        // At most SHARDS_MAX shards (the CLI builds a file from a cluster's answers).
        out.extend_from_slice(&(self.shards.len() as u32).to_be_bytes());
        for copy in &self.shards {
            let record = copy.encode();
            out.extend_from_slice(&(record.len() as u32).to_be_bytes());
            out.extend_from_slice(&record);
        }
        let crc = crc32c(&out);
        out.extend_from_slice(&crc.to_be_bytes());
        match out.len() as u64 {
            bytes if bytes > FILE_BYTES_MAX => Err(BackupError::TooLarge(bytes)),
            _ => Ok(out),
        }
    }

    /// Decodes and checks a whole file (see the module docs).
    pub fn decode(bytes: &[u8]) -> Result<BackupFile, BackupError> {
        if bytes.len() as u64 > FILE_BYTES_MAX {
            return Err(BackupError::TooLarge(bytes.len() as u64));
        }
        if bytes.len() < MAGIC.len() || &bytes[..MAGIC.len()] != MAGIC {
            return Err(BackupError::NotBackup);
        }
        let Some(&version) = bytes.get(MAGIC.len()) else {
            return Err(BackupError::Checksum);
        };
        if version != FORMAT_VERSION {
            return Err(BackupError::Version(version));
        }
        if bytes.len() < FILE_FIXED_BYTES {
            return Err(BackupError::Checksum);
        }
        let (body, sum) = bytes.split_at(bytes.len() - 4);
        if crc32c(body).to_be_bytes() != sum {
            return Err(BackupError::Checksum);
        }
        let mut reader = Cursor {
            bytes: body,
            at: MAGIC.len() + 1,
        };
        let count = reader.u32()?;
        if count == 0 || count > crate::config::SHARDS_MAX {
            return Err(corrupt(format!("{count} shards")));
        }
        let mut shards = Vec::new();
        for expected in 0..count {
            let length = reader.u32()? as usize;
            let copy = ShardBackup::decode(reader.take(length)?)?;
            if copy.shard != expected || copy.shards != count {
                let found = (copy.shard, copy.shards);
                let why = format!("record {expected} is shard {} of {}", found.0, found.1);
                return Err(corrupt(why));
            }
            shards.push(copy);
        }
        if reader.at != body.len() {
            return Err(corrupt(format!(
                "{} bytes after the last shard",
                body.len() - reader.at
            )));
        }
        Ok(BackupFile { shards })
    }

    /// The keys held, all shards together.
    pub fn locks(&self) -> usize {
        self.shards.iter().map(|copy| copy.image.holds.len()).sum()
    }

    /// The highest token of a held key (`None` when no key is held).
    pub fn highest_token(&self) -> Option<u64> {
        let holds = self.shards.iter().flat_map(|copy| &copy.image.holds);
        holds.map(|hold| hold.token).max()
    }

    /// Each shard's initial state in a new cluster of `shards` shards, the same on every
    /// member: refused if the file has another shard count, or its tokens are near the end of
    /// `u64`. See the module docs for how tokens continue above the backup's.
    pub fn initial_states(&self, shards: u32) -> Result<Vec<InitialState>, BackupError> {
        let file = self.shards.len() as u32;
        if file != shards {
            return Err(BackupError::Shards {
                file,
                config: shards,
            });
        }
        let ceiling = self.shards.iter().filter_map(ShardBackup::ceiling).max();
        let exhausted = || corrupt("its tokens are too close to the end of the token space");
        let step = u64::from(shards);
        let mut states = Vec::with_capacity(self.shards.len());
        for copy in &self.shards {
            let mut image = copy.image.clone();
            if let Some(ceiling) = ceiling {
                let floor = match image.floor {
                    Some(floor) => floor,
                    None => ceiling
                        .checked_next_multiple_of(step)
                        .ok_or_else(exhausted)?,
                };
                image.floor = Some(floor);
                // The next index `i` must give `floor + i × shards + shard > ceiling`.
                let above = ceiling.saturating_sub(floor.saturating_add(u64::from(copy.shard)));
                image.applied = image.applied.max(above / step);
                let next = image.applied.checked_add(1).ok_or_else(exhausted)?;
                let token = (next.checked_mul(step))
                    .and_then(|offset| offset.checked_add(floor))
                    .and_then(|token| token.checked_add(u64::from(copy.shard)));
                if !token.is_some_and(|token| token > ceiling) {
                    return Err(exhausted());
                }
            }
            states.push(InitialState {
                shard: copy.shard,
                index: image.applied,
                term: copy.term.max(1),
                data: image.encode(),
            });
        }
        Ok(states)
    }
}

/// A cursor over untrusted bytes; every read checks the length first.
struct Cursor<'a> {
    bytes: &'a [u8],
    at: usize,
}

impl<'a> Cursor<'a> {
    fn take(&mut self, n: usize) -> Result<&'a [u8], BackupError> {
        let rest = &self.bytes[self.at..];
        let field = rest
            .get(..n)
            .ok_or_else(|| corrupt("a record runs past the end"))?;
        self.at += n;
        Ok(field)
    }

    fn u32(&mut self) -> Result<u32, BackupError> {
        let mut out = [0; 4];
        out.copy_from_slice(self.take(4)?);
        Ok(u32::from_be_bytes(out))
    }

    fn u64(&mut self) -> Result<u64, BackupError> {
        let mut out = [0; 8];
        out.copy_from_slice(self.take(8)?);
        Ok(u64::from_be_bytes(out))
    }
}

#[cfg(test)]
mod tests;
