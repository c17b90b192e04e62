//! A cluster member's data directory (`cluster.data_dir`): the lock that keeps it to one
//! process, and the record of whose data it holds.
//!
//! * `lock`: held with `flock(LOCK_EX | LOCK_NB)` for the life of the process ([`DataDir`] keeps
//!   the file open; the kernel releases the lock when it closes, on drop, exit or kill -9, so a
//!   crashed member never leaves a stale lock). It is taken before anything else in the
//!   directory is read or written, write-ahead logs included. The holder writes who it is into
//!   the file (`pid 1234, node 1, since 2026-12-03T13:11:03Z`), so that a second process,
//!   refused, can name it.
//! * `member.toml`: the record, written once at the directory's first start, atomically (a
//!   temporary file, fsync, rename, fsync of the directory): the member's node id, the cluster's
//!   identity ([`ClusterIdentity`]: shards, members' ids and client addresses), the core count
//!   (the write-ahead logs are per core) and the directory's *incarnation*, a random 64-bit
//!   value drawn at that start. A start whose configuration disagrees is refused, the error
//!   naming the key: `cluster.node_id`, `cluster.shards`, `cluster.members`, `server.cores`.
//!   A record of an earlier version has no incarnation: one is drawn and the record rewritten
//!   (an info line says so).
//! * The incarnation is what the member's peer hello carries (peer wire version 6): its peers
//!   remember it (in their own `peers.toml`, [`PEERS_FILE`], kept by
//!   [`super::peer::incarnations`]) and refuse the member once it says hello from another
//!   directory, one that has forgotten the votes the old one gave.
//! * A directory of an earlier version has a `layout` file (`shards=S cores=C`) and no record:
//!   its layout is checked as before, the record is written, `layout` is removed, and an info
//!   line says so. A directory with write-ahead logs (`core-N`) and neither file is refused:
//!   whose data it holds cannot be told.
//!
//! Deliberately not here: the write-ahead logs themselves ([`super::wal`]), and anything about
//! the peers (a member whose peers disagree with it is the peer hello's business).

use crate::config::{ClusterConfig, ClusterIdentity};
use std::fs::{File, OpenOptions};
use std::io::{self, Read, Write};
use std::os::fd::AsRawFd;
use std::path::{Path, PathBuf};
use std::time::SystemTime;

/// The lock file's name in the data directory.
pub const LOCK_FILE: &str = "lock";
/// The record's name in the data directory.
pub const RECORD_FILE: &str = "member.toml";
/// The record of an earlier version (shards and cores only).
pub const LAYOUT_FILE: &str = "layout";
/// The peers' incarnations this member has seen ([`super::peer::incarnations`]).
pub const PEERS_FILE: &str = "peers.toml";
/// The most bytes of the lock file's holder line that a refusal repeats.
const HOLDER_BYTES_MAX: usize = 200;
/// The most bytes of a record read (it is a few hundred).
const RECORD_BYTES_MAX: u64 = 64 * 1024;

/// An open, locked data directory whose record agrees with this member's configuration. The
/// lock lasts as long as this value.
#[derive(Debug)]
pub struct DataDir {
    path: PathBuf,
    incarnation: u64,
    _lock: File,
}

/// What a data directory must agree with: this start's member, cluster and core count.
#[derive(Clone, Debug)]
pub struct Expected {
    /// `cluster.node_id`.
    pub node_id: u64,
    /// `cluster.shards`.
    pub shards: u32,
    /// The cluster's identity (shards and members).
    pub identity: ClusterIdentity,
    /// `server.cores`.
    pub cores: usize,
}

impl Expected {
    /// What `cluster` with `cores` cores expects of its data directory.
    pub fn of(cluster: &ClusterConfig, cores: usize) -> Expected {
        Expected {
            node_id: cluster.node_id,
            shards: cluster.shards,
            identity: cluster.identity(),
            cores,
        }
    }

    /// The record's text, with the directory's `incarnation`.
    fn record(&self, incarnation: u64) -> String {
        let mut table = toml::Table::new();
        table.insert("node_id".into(), toml::Value::Integer(self.node_id as i64));
        table.insert("cores".into(), toml::Value::Integer(self.cores as i64));
        table.insert(
            "shards".into(),
            toml::Value::Integer(i64::from(self.shards)),
        );
        table.insert("identity".into(), self.identity.text.clone().into());
        table.insert("incarnation".into(), format!("{incarnation:016x}").into());
        format!(
            "# Written by latchkey at this data directory's first start: whose data it holds.\n\
             # A start whose configuration disagrees is refused. Do not edit.\n{table}"
        )
    }
}

/// What a record says.
#[derive(Clone, Debug, PartialEq, Eq)]
struct Record {
    node_id: u64,
    cores: usize,
    shards: u32,
    identity: String,
    /// `None` in a record of an earlier version.
    incarnation: Option<u64>,
}

impl DataDir {
    /// Creates `path` if needed, locks it, and checks (or, at its first start, writes) its
    /// record against `expected`. Every error names `cluster.data_dir` and the path; a
    /// disagreement names the key that disagrees.
    pub fn open(path: &Path, expected: &Expected) -> io::Result<DataDir> {
        DataDir::open_seeding(path, expected, &mut |_| Ok(()))
    }

    /// As [`DataDir::open`]; at a fresh directory's first start, `seed` writes into the locked
    /// directory before the record is (a start from a backup seeds the logs): a start stopped
    /// in between leaves logs without a record, which the next start refuses.
    pub fn open_seeding(
        path: &Path,
        expected: &Expected,
        seed: &mut dyn FnMut(&Path) -> io::Result<()>,
    ) -> io::Result<DataDir> {
        std::fs::create_dir_all(path).map_err(|e| named(path, e))?;
        let lock = lock(path, expected.node_id)?;
        let mut data_dir = DataDir {
            path: path.to_path_buf(),
            incarnation: 0,
            _lock: lock,
        };
        data_dir.incarnation = match data_dir.read_record()? {
            Some(record) => {
                data_dir.check(&record, expected)?;
                match record.incarnation {
                    Some(incarnation) => incarnation,
                    None => data_dir.first_incarnation(expected)?,
                }
            }
            None => data_dir.first_start(expected, seed)?,
        };
        debug_assert_ne!(data_dir.incarnation, 0);
        Ok(data_dir)
    }

    /// This directory's incarnation (never 0): drawn at its first start, kept in its record.
    pub fn incarnation(&self) -> u64 {
        self.incarnation
    }

    /// Where this member keeps its peers' incarnations ([`PEERS_FILE`]).
    pub fn peers_file(&self) -> PathBuf {
        self.path.join(PEERS_FILE)
    }

    /// A record of an earlier version, without an incarnation: one is drawn and the record
    /// rewritten with it.
    fn first_incarnation(&self, expected: &Expected) -> io::Result<u64> {
        let incarnation = self.write_record(expected)?;
        log::info!(
            "cluster.data_dir {}: the record of an earlier version now has an incarnation, \
             {incarnation:016x}, which the peer hello carries",
            self.path.display()
        );
        Ok(incarnation)
    }

    /// Whether `path` holds a member's data already: a record, an earlier version's layout
    /// file, or a write-ahead log. A directory that does not exist holds none.
    pub fn holds_data(path: &Path) -> io::Result<bool> {
        let entries = match std::fs::read_dir(path) {
            Ok(entries) => entries,
            Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(false),
            Err(e) => return Err(named(path, e)),
        };
        for entry in entries {
            let name = entry.map_err(|e| named(path, e))?.file_name();
            let name = name.to_string_lossy();
            if name == RECORD_FILE || name == LAYOUT_FILE || is_log(&name) {
                return Ok(true);
            }
        }
        Ok(false)
    }

    /// The directory.
    #[cfg(test)]
    pub fn path(&self) -> &Path {
        &self.path
    }

    fn named(&self, error: io::Error) -> io::Error {
        named(&self.path, error)
    }

    /// The record, `None` when there is none yet.
    fn read_record(&self) -> io::Result<Option<Record>> {
        let text = match read_bounded(&self.path.join(RECORD_FILE)) {
            Ok(text) => text,
            Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(None),
            Err(e) => return Err(self.named(e)),
        };
        parse_record(&text).map(Some).map_err(|why| {
            let message = format!(
                "cluster.data_dir {}: {RECORD_FILE} is damaged ({why}); it says whose data the \
                 directory holds, so the member does not start without it",
                self.path.display()
            );
            io::Error::new(io::ErrorKind::InvalidData, message)
        })
    }

    /// Refuses a record that disagrees with `expected`, naming the first key that does.
    fn check(&self, record: &Record, expected: &Expected) -> io::Result<()> {
        let dir = self.path.display();
        let (key, problem) = if record.node_id != expected.node_id {
            let problem = format!(
                "cluster.data_dir {dir} holds the data of member {}, this config says {} (each \
                 member keeps its own data_dir)",
                record.node_id, expected.node_id
            );
            ("cluster.node_id", problem)
        } else if record.shards != expected.shards {
            let problem = format!(
                "cluster.data_dir {dir} was written with cluster.shards = {}, this config has {} \
                 (a cluster keeps its shard count: each key's locks are in its shard's log)",
                record.shards, expected.shards
            );
            ("cluster.shards", problem)
        } else if record.identity != expected.identity.text {
            let problem = format!(
                "cluster.data_dir {dir} holds the data of the cluster `{}`, this config \
                 describes `{}` (members and their client addresses do not change online; see \
                 \"Changing the members safely\" in docs/cluster.md)",
                record.identity, expected.identity.text
            );
            ("cluster.members", problem)
        } else if record.cores != expected.cores {
            (
                "server.cores",
                cores_problem(&dir, record.cores, expected.cores),
            )
        } else {
            return Ok(());
        };
        Err(disagrees(key, problem))
    }

    /// No record yet: an earlier version's directory (its layout checked, then upgraded), a
    /// fresh one, or logs of unknown origin (refused). Returns the incarnation drawn for it.
    fn first_start(
        &self,
        expected: &Expected,
        seed: &mut dyn FnMut(&Path) -> io::Result<()>,
    ) -> io::Result<u64> {
        let layout_path = self.path.join(LAYOUT_FILE);
        let layout = match read_bounded(&layout_path) {
            Ok(text) => Some(text),
            Err(e) if e.kind() == io::ErrorKind::NotFound => None,
            Err(e) => return Err(self.named(e)),
        };
        match layout {
            Some(text) => {
                self.check_layout(text.trim(), expected)?;
                let incarnation = self.write_record(expected)?;
                std::fs::remove_file(&layout_path).map_err(|e| self.named(e))?;
                sync_dir(&self.path).map_err(|e| self.named(e))?;
                log::info!(
                    "cluster.data_dir {}: upgraded from the layout file of an earlier version: \
                     recorded member {} of `{}` with {} cores in {RECORD_FILE}",
                    self.path.display(),
                    expected.node_id,
                    expected.identity.text,
                    expected.cores
                );
                Ok(incarnation)
            }
            None => {
                if let Some(log) = self.first_log()? {
                    let message = format!(
                        "cluster.data_dir {}: holds write-ahead logs ({log}) but no {RECORD_FILE} \
                         saying whose they are; restore the record, or start this member with \
                         an empty data_dir",
                        self.path.display()
                    );
                    return Err(io::Error::new(io::ErrorKind::InvalidData, message));
                }
                seed(&self.path)?;
                let incarnation = self.write_record(expected)?;
                log::info!(
                    "cluster.data_dir {}: first start: recorded member {} of `{}` with {} \
                     cores, incarnation {incarnation:016x}",
                    self.path.display(),
                    expected.node_id,
                    expected.identity.text,
                    expected.cores
                );
                Ok(incarnation)
            }
        }
    }

    /// An earlier version's `layout` (`shards=S cores=C`) against `expected`.
    fn check_layout(&self, layout: &str, expected: &Expected) -> io::Result<()> {
        let dir = self.path.display();
        let field = |name: &str| {
            layout
                .split_whitespace()
                .find_map(|part| part.strip_prefix(name)?.strip_prefix('='))
                .and_then(|value| value.parse::<u64>().ok())
        };
        let (Some(shards), Some(cores)) = (field("shards"), field("cores")) else {
            let message = format!(
                "cluster.data_dir {dir}: {LAYOUT_FILE} of an earlier version is damaged \
                 ({:?}); it says how the logs are laid out, so the member does not start",
                layout.chars().take(HOLDER_BYTES_MAX).collect::<String>()
            );
            return Err(io::Error::new(io::ErrorKind::InvalidData, message));
        };
        if shards != u64::from(expected.shards) {
            let problem = format!(
                "cluster.data_dir {dir} was written with cluster.shards = {shards}, this config \
                 has {} (a cluster keeps its shard count: each key's locks are in its shard's log)",
                expected.shards
            );
            return Err(disagrees("cluster.shards", problem));
        }
        if cores != expected.cores as u64 {
            let problem = cores_problem(&dir, cores as usize, expected.cores);
            return Err(disagrees("server.cores", problem));
        }
        Ok(())
    }

    /// The first entry that looks like a core's write-ahead log directory, if any.
    fn first_log(&self) -> io::Result<Option<String>> {
        let entries = std::fs::read_dir(&self.path).map_err(|e| self.named(e))?;
        for entry in entries {
            let name = entry.map_err(|e| self.named(e))?.file_name();
            let name = name.to_string_lossy();
            if is_log(&name) {
                return Ok(Some(name.into_owned()));
            }
        }
        Ok(None)
    }

    /// Writes the record atomically, with a new incarnation, which it returns: a temporary
    /// file, synced, renamed over, the directory synced (a crash leaves the old state or the
    /// whole record, never a torn one).
    fn write_record(&self, expected: &Expected) -> io::Result<u64> {
        let path = self.path.join(RECORD_FILE);
        let incarnation = new_incarnation().map_err(|e| self.named(e))?;
        let record = expected.record(incarnation);
        write_atomically(&path, record.as_bytes()).map_err(|e| self.named(e))?;
        Ok(incarnation)
    }
}

/// Writes `bytes` to `path` atomically: a temporary file beside it (`NAME.tmp`), synced,
/// renamed over `path`, the directory synced. A crash leaves the old file or the whole new one,
/// never a torn one; a failure removes the temporary file.
pub fn write_atomically(path: &Path, bytes: &[u8]) -> io::Result<()> {
    let dir = match path.parent() {
        Some(dir) if !dir.as_os_str().is_empty() => dir,
        _ => Path::new("."),
    };
    let Some(name) = path.file_name() else {
        let message = format!("{} is not a file name", path.display());
        return Err(io::Error::new(io::ErrorKind::InvalidInput, message));
    };
    let temporary = dir.join(format!("{}.tmp", name.to_string_lossy()));
    let write = || -> io::Result<()> {
        let mut file = File::create(&temporary)?;
        file.write_all(bytes)?;
        file.sync_all()?;
        std::fs::rename(&temporary, path)?;
        sync_dir(dir)
    };
    let written = write();
    if written.is_err() {
        let _ = std::fs::remove_file(&temporary);
    }
    written
}

/// A new incarnation: 64 bits from the kernel's random source, never 0 (a hello before
/// version 6 carries none, which reads as 0). Unpredictable, so that two directories of one
/// member never share one.
fn new_incarnation() -> io::Result<u64> {
    let mut random = File::open("/dev/urandom")?;
    loop {
        let mut bytes = [0u8; 8];
        random.read_exact(&mut bytes)?;
        let incarnation = u64::from_ne_bytes(bytes);
        if incarnation != 0 {
            return Ok(incarnation);
        }
    }
}

/// Whether a data directory's entry `name` is a core's write-ahead log directory (`core-N`).
fn is_log(name: &str) -> bool {
    name.starts_with("core-")
}

/// Takes the directory's lock and writes who holds it; refuses, naming the holder, when another
/// process has it.
fn lock(dir: &Path, node_id: u64) -> io::Result<File> {
    let path = dir.join(LOCK_FILE);
    let mut file = OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(false)
        .open(&path)
        .map_err(|e| named(dir, e))?;
    // SAFETY: flock takes a file descriptor we own (it lives as long as `file`) and flags; it
    // touches no memory of ours.
    if unsafe { libc::flock(file.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) } != 0 {
        let error = io::Error::last_os_error();
        if error.kind() != io::ErrorKind::WouldBlock {
            return Err(named(dir, error));
        }
        let mut said = Vec::new();
        let _ = (&mut file)
            .take(HOLDER_BYTES_MAX as u64)
            .read_to_end(&mut said);
        let message = format!(
            "cluster.data_dir {} is in use by another latchkey process: {}",
            dir.display(),
            holder_text(&said)
        );
        return Err(io::Error::new(io::ErrorKind::AddrInUse, message));
    }
    let since = crate::logging::timestamp(SystemTime::now());
    let holder = format!(
        "pid {}, node {node_id}, since {since}\n",
        std::process::id()
    );
    // Truncated only now that it is ours: the holder's line is what a refused start reads.
    let said = file
        .set_len(0)
        .and_then(|()| file.write_all(holder.as_bytes()));
    said.map_err(|e| named(dir, e))?;
    Ok(file)
}

/// The holder's line as a refusal repeats it: its first line, at most [`HOLDER_BYTES_MAX`]
/// bytes, control characters escaped (the file may hold anything).
fn holder_text(said: &[u8]) -> String {
    let text = String::from_utf8_lossy(said);
    let line = text.lines().next().unwrap_or("").trim();
    if line.is_empty() {
        return "it has not written who it is yet".to_string();
    }
    line.chars().flat_map(char::escape_default).collect()
}

fn parse_record(text: &str) -> Result<Record, String> {
    let table: toml::Table = text.parse().map_err(|e: toml::de::Error| {
        let detail: Vec<&str> = e.message().lines().collect();
        detail.join("; ")
    })?;
    let integer = |key: &str| match table.get(key) {
        Some(toml::Value::Integer(n)) if *n >= 0 => Ok(*n as u64),
        Some(other) => Err(format!("{key} is {other}, not a count")),
        None => Err(format!("no {key}")),
    };
    let node_id = integer("node_id")?;
    let cores = usize::try_from(integer("cores")?).map_err(|e| e.to_string())?;
    let shards = u32::try_from(integer("shards")?).map_err(|e| e.to_string())?;
    let Some(toml::Value::String(identity)) = table.get("identity") else {
        return Err("no identity".to_string());
    };
    let incarnation = match table.get("incarnation") {
        None => None,
        Some(toml::Value::String(hex)) => match u64::from_str_radix(hex, 16) {
            Ok(incarnation) if incarnation != 0 && hex.len() == 16 => Some(incarnation),
            _ => {
                return Err(format!(
                    "incarnation {hex:?} is not 16 hex digits, not all 0"
                ))
            }
        },
        Some(other) => return Err(format!("incarnation is {other}, not 16 hex digits")),
    };
    Ok(Record {
        node_id,
        cores,
        shards,
        identity: identity.clone(),
        incarnation,
    })
}

fn cores_problem(dir: &impl std::fmt::Display, recorded: usize, now: usize) -> String {
    format!(
        "cluster.data_dir {dir} was written with server.cores = {recorded}, this start has \
         {now} (the write-ahead logs are per core: start it with server.cores = {recorded} or \
         --cores {recorded})"
    )
}

fn disagrees(key: &str, problem: String) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidInput, format!("{key}: {problem}"))
}

fn named(dir: &Path, error: io::Error) -> io::Error {
    let message = format!("cluster.data_dir {}: {error}", dir.display());
    io::Error::new(error.kind(), message)
}

fn read_bounded(path: &Path) -> io::Result<String> {
    let mut text = String::new();
    File::open(path)?
        .take(RECORD_BYTES_MAX)
        .read_to_string(&mut text)?;
    Ok(text)
}

fn sync_dir(dir: &Path) -> io::Result<()> {
    File::open(dir)?.sync_all()
}

#[cfg(test)]
mod tests;
