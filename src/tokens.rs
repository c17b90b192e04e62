//! Fencing-token numbering: where each run starts, and the persisted high-water mark.
//!
//! Tokens must be greater than any token an earlier run issued, so that fencing survives a
//! restart. Two floors give that:
//!
//! * the wall clock: microseconds since the Unix epoch × 1024, so a new run starts above any
//!   earlier run that issued fewer than 1024 tokens per microsecond of its life;
//! * where `tokens.state_dir` is set, a *reservation* persisted before use: a partition writes
//!   "tokens up to N may have been issued" durably (temp file, fsync, rename, fsync of the
//!   directory) before it issues any token above the previous reservation. A crash therefore
//!   never leaves issued tokens above the mark, and a wall clock stepped back cannot make the
//!   next run reissue a token.
//!
//! Partitions draw from disjoint sequences: partition `p` of `n` issues tokens `≡ p (mod n)`
//! above the floor, so no counter is shared between cores.
//!
//! This module does file I/O; the lock table itself only sees a [`TokenRange`]. The
//! [`persister`] writes the marks on a thread of its own, at the request of each partition's
//! [`TokenKeeper`].

pub mod persister;

pub use persister::{Persister, TokenKeeper, TokenLimit};
use std::fs;
use std::io::{self, Write};
use std::path::{Path, PathBuf};
use std::time::{SystemTime, UNIX_EPOCH};

/// Tokens that must be left above a run's floor, or it refuses to start: 2^62, decades of
/// grants at any rate, so no arithmetic on tokens can come near `u64::MAX` while it runs. The
/// wall-clock floor alone reaches it in the year 2398; a hand-edited high-water file sooner.
pub const TOKEN_HEADROOM_MIN: u64 = 1 << 62;

/// The wall-clock floor: microseconds since the Unix epoch × 1024 (0 before the epoch).
pub fn wall_clock_floor(now: SystemTime) -> u64 {
    let micros = now.duration_since(UNIX_EPOCH).map_or(0, |d| d.as_micros());
    u64::try_from(micros.saturating_mul(1024)).unwrap_or(u64::MAX / 2)
}

/// A contiguous run of one partition's tokens: `next`, `next + step`, … up to `limit`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct TokenRange {
    /// The next token to issue.
    pub next: u64,
    /// Distance between two tokens of this partition (the partition count).
    pub step: u64,
    /// The largest token that may be issued without a new reservation.
    pub limit: u64,
}

impl TokenRange {
    /// Issues the next token, or `None` when the reservation is used up.
    pub fn issue(&mut self) -> Option<u64> {
        if self.next > self.limit {
            return None;
        }
        let token = self.next;
        self.next = self.next.checked_add(self.step)?;
        Some(token)
    }

    /// Whether [`issue`](Self::issue) would give a token now.
    pub fn can_issue(&self) -> bool {
        self.next <= self.limit && self.next.checked_add(self.step).is_some()
    }

    /// Tokens left before the reservation is used up.
    pub fn headroom(&self) -> u64 {
        self.limit.saturating_sub(self.next) / self.step + u64::from(self.next <= self.limit)
    }
}

/// The first token of partition `partition` of `partitions`, strictly above `floor`.
///
/// # Panics
///
/// When `floor` leaves no room (the start refuses such a floor with [`check_floor`]).
pub fn first_token(floor: u64, partition: usize, partitions: usize) -> u64 {
    let step = partitions as u64;
    (floor / step + 1)
        .checked_mul(step)
        .and_then(|base| base.checked_add(partition as u64))
        .expect("a floor checked by check_floor")
}

/// Refuses a floor that leaves fewer than [`TOKEN_HEADROOM_MIN`] tokens before `u64::MAX`:
/// tokens must never wrap. The error says where the floor came from.
pub fn check_floor(floor: u64, state: Option<&StateDir>) -> io::Result<()> {
    if floor <= u64::MAX - TOKEN_HEADROOM_MIN {
        return Ok(());
    }
    let source = match state {
        Some(state) => format!(
            "the token high-water mark persisted in tokens.state_dir {}",
            state.path().display()
        ),
        None => "the wall clock".to_string(),
    };
    let message = format!(
        "tokens: {source} is {floor}, which leaves fewer than 2^62 tokens before they would \
         wrap around u64::MAX; refusing to start (a hand-edited high-water file?)"
    );
    Err(io::Error::new(io::ErrorKind::InvalidData, message))
}

/// Whether `dir`'s parent is a directory (a relative path's empty parent is the working
/// directory).
fn parent_exists(dir: &Path) -> bool {
    match dir.parent() {
        Some(parent) if parent.as_os_str().is_empty() => true,
        Some(parent) => parent.is_dir(),
        None => true,
    }
}

/// The persisted high-water marks of a state directory: one file per partition.
#[derive(Clone, Debug)]
pub struct StateDir {
    dir: PathBuf,
}

impl StateDir {
    /// Opens the state directory, creating it if it is missing but its parent exists. A
    /// missing parent is refused rather than created: it is more likely a typo in the path
    /// than a wish, and a mark kept in the wrong place protects nothing after a restart.
    pub fn open(dir: &Path) -> io::Result<StateDir> {
        let named = |error: io::Error, why: &str| {
            let message = format!("tokens.state_dir {}: {why}: {error}", dir.display());
            io::Error::new(error.kind(), message)
        };
        match fs::create_dir(dir) {
            Ok(()) => {}
            Err(error) if error.kind() == io::ErrorKind::AlreadyExists && dir.is_dir() => {}
            Err(error) if !parent_exists(dir) => {
                let parent = dir.parent().unwrap_or(dir).display().to_string();
                let why = format!(
                    "cannot create it: its parent directory {parent} does not exist (a typo? \
                     create it first)"
                );
                return Err(named(error, &why));
            }
            Err(error) => return Err(named(error, "cannot create it")),
        }
        Ok(StateDir {
            dir: dir.to_path_buf(),
        })
    }

    /// The directory.
    pub fn path(&self) -> &Path {
        &self.dir
    }

    fn partition_path(&self, partition: usize) -> PathBuf {
        self.dir.join(format!("tokens-{partition}.hwm"))
    }

    /// The largest mark any partition of any earlier run wrote (0 when none). A file that
    /// exists but cannot be read or parsed is an error: starting below it could reissue tokens.
    pub fn high_water(&self) -> io::Result<u64> {
        let mut high = 0;
        for entry in fs::read_dir(&self.dir)? {
            let entry = entry?;
            let name = entry.file_name();
            let name = name.to_string_lossy();
            if !(name.starts_with("tokens-") && name.ends_with(".hwm")) {
                continue;
            }
            let text = fs::read_to_string(entry.path())?;
            let mark: u64 = text.trim().parse().map_err(|_| {
                io::Error::new(
                    io::ErrorKind::InvalidData,
                    format!("{}: not a token high-water mark", entry.path().display()),
                )
            })?;
            high = high.max(mark);
        }
        Ok(high)
    }

    /// Durably records that `partition` may issue tokens up to `mark`.
    pub fn persist(&self, partition: usize, mark: u64) -> io::Result<()> {
        let path = self.partition_path(partition);
        let tmp = self.dir.join(format!("tokens-{partition}.tmp"));
        let mut file = fs::File::create(&tmp)?;
        writeln!(file, "{mark}")?;
        file.sync_all()?;
        drop(file);
        fs::rename(&tmp, &path)?;
        fs::File::open(&self.dir)?.sync_all()
    }
}

/// The floor for this run: the wall clock, raised above the persisted mark when there is one.
pub fn run_floor(state: Option<&StateDir>, now: SystemTime) -> io::Result<u64> {
    let wall = wall_clock_floor(now);
    let persisted = match state {
        Some(state) => state.high_water().map_err(|error| {
            let path = state.path().display();
            let message =
                format!("tokens.state_dir {path}: cannot read the high-water mark: {error}");
            io::Error::new(error.kind(), message)
        })?,
        None => 0,
    };
    let floor = wall.max(persisted);
    check_floor(floor, state)?;
    Ok(floor)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[test]
    fn ranges_of_partitions_are_disjoint_and_above_the_floor() {
        let floor = 1_000_003;
        let mut seen = std::collections::HashSet::new();
        for partition in 0..3 {
            let first = first_token(floor, partition, 3);
            assert!(first > floor);
            let mut range = TokenRange {
                next: first,
                step: 3,
                limit: first + 3 * 99,
            };
            assert_eq!(range.headroom(), 100);
            let mut last = 0;
            while let Some(token) = range.issue() {
                assert!(token > last);
                assert!(seen.insert(token), "token {token} issued twice");
                last = token;
            }
            assert_eq!(range.headroom(), 0);
        }
        assert_eq!(seen.len(), 300);
    }

    #[test]
    fn wall_clock_floor_grows_with_time() {
        let t = UNIX_EPOCH + Duration::from_secs(1_700_000_000);
        assert!(wall_clock_floor(t + Duration::from_micros(1)) >= wall_clock_floor(t) + 1024);
        assert_eq!(wall_clock_floor(UNIX_EPOCH), 0);
    }

    #[test]
    fn persisted_mark_raises_the_floor_over_a_clock_stepped_back() {
        let dir = std::env::temp_dir().join(format!("latchkey-tokens-{}", std::process::id()));
        let _ = fs::remove_dir_all(&dir);
        let state = StateDir::open(&dir).unwrap();
        assert_eq!(state.high_water().unwrap(), 0);
        let now = SystemTime::now();
        let far = wall_clock_floor(now) + 1_000_000_000;
        state.persist(1, far).unwrap();
        state.persist(0, 5).unwrap();
        let stepped_back = now - Duration::from_secs(3600);
        assert_eq!(run_floor(Some(&state), stepped_back).unwrap(), far);
        fs::write(dir.join("tokens-9.hwm"), "garbage").unwrap();
        assert!(state.high_water().is_err());
        fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn a_floor_near_the_top_of_u64_is_refused_before_anything_wraps() {
        let dir = std::env::temp_dir().join(format!("latchkey-top-{}", std::process::id()));
        let _ = fs::remove_dir_all(&dir);
        let state = StateDir::open(&dir).unwrap();
        state.persist(0, u64::MAX - 5).unwrap();
        let error = run_floor(Some(&state), SystemTime::now()).unwrap_err();
        let message = error.to_string();
        assert!(message.contains("18446744073709551610"), "{message}");
        assert!(message.contains(&dir.display().to_string()), "{message}");
        assert!(message.contains("wrap"), "{message}");
        state.persist(0, u64::MAX - TOKEN_HEADROOM_MIN).unwrap();
        let floor = run_floor(Some(&state), SystemTime::now()).unwrap();
        assert_eq!(floor, u64::MAX - TOKEN_HEADROOM_MIN);
        // The arithmetic of a run from that floor stays in range.
        let first = first_token(floor, 1023, 1024);
        assert!(first > floor);
        fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn an_unusable_state_dir_is_named_with_its_key() {
        let error = StateDir::open(Path::new("/proc/nope/latchkey")).unwrap_err();
        let message = error.to_string();
        assert!(message.starts_with("tokens.state_dir /proc/nope/latchkey: cannot create it: "));
    }
}
