//! The incarnations of its peers' data directories that a member has seen, and the rule that
//! refuses a peer whose data directory is not the one it was.
//!
//! Every data directory draws a random *incarnation* at its first start
//! ([`crate::cluster::data_dir::DataDir::incarnation`]); a hello of wire version 6 or later
//! carries its dialer's ([`super::frame::Hello::incarnation`]). A member remembers the first
//! incarnation each peer said hello with, in its own data directory
//! ([`crate::cluster::data_dir::PEERS_FILE`], written atomically before the hello is accepted,
//! so a crash cannot forget what was accepted), and from then on refuses a hello from that peer
//! with another one ([`super::frame::HelloError::Incarnation`]).
//!
//! Why: Raft's one leader per term rests on each voter remembering the votes it gave. A member
//! started again on an empty or another `data_dir` has forgotten them; if its peers let it
//! speak, two leaders of one term could commit different entries, and two clients hold one key.
//! All it says reaches its peers over the connections it dials, each of which opens with its
//! hello, so refusing those hellos is enough: its votes and answers never arrive. (The
//! connections its peers dial to it stay: what they send it is harmless.)
//!
//! What it does not catch, by construction:
//! * a peer first heard from after it lost its directory: there is nothing to compare with;
//! * a hello of a version before 6, which carries no incarnation (a member rolled back to an
//!   older build): accepted, as before;
//! * without `[cluster.tls]`, a dialer that claims another member's id: the peer port must sit
//!   on a trusted network then (`docs/security.md`), and the first incarnation it claims is
//!   remembered. With it, the hello is checked only after the certificate named the member.
//!
//! A member refused this way must join as a new member; until online membership changes exist,
//! that means a new cluster (`docs/cluster.md`).
//!
//! # Invariants
//!
//! An incarnation recorded for a peer never changes while the file stays (nothing here
//! overwrites one); every id in it passed the hello's checks (a configured peer), so it holds at
//! most one entry per member.

use super::frame::HelloError;
use crate::cluster::data_dir::write_atomically;
use std::collections::BTreeMap;
use std::fs::File;
use std::io::{self, Read};
use std::path::{Path, PathBuf};

/// The most bytes of the file read (an entry is about 30 bytes; a cluster has at most a few
/// hundred members).
const FILE_BYTES_MAX: u64 = 64 * 1024;

/// The incarnations this member has seen its peers say hello with (see the module docs).
#[derive(Debug)]
pub struct Incarnations {
    /// Where they are kept; `None`: in memory only (tests of the peer layer alone).
    file: Option<PathBuf>,
    known: BTreeMap<u64, u64>,
}

impl Incarnations {
    /// None seen, kept in memory only.
    pub fn in_memory() -> Incarnations {
        Incarnations {
            file: None,
            known: BTreeMap::new(),
        }
    }

    /// The incarnations kept in `file` (none if it does not exist yet). A damaged file is an
    /// error naming it: the member does not start without what it remembered.
    pub fn load(file: &Path) -> io::Result<Incarnations> {
        let mut text = String::new();
        let read = File::open(file)
            .and_then(|opened| opened.take(FILE_BYTES_MAX).read_to_string(&mut text));
        let known = match read {
            Ok(_) => parse(&text).map_err(|why| {
                let message = format!(
                    "{} is damaged ({why}); it holds the data-directory incarnations of the \
                     peers this member has heard from, so the member does not start without it",
                    file.display()
                );
                io::Error::new(io::ErrorKind::InvalidData, message)
            })?,
            Err(e) if e.kind() == io::ErrorKind::NotFound => BTreeMap::new(),
            Err(e) => {
                let message = format!("{}: {e}", file.display());
                return Err(io::Error::new(e.kind(), message));
            }
        };
        Ok(Incarnations {
            file: Some(file.to_path_buf()),
            known,
        })
    }

    /// The incarnation recorded for `peer`, if any.
    pub fn of(&self, peer: u64) -> Option<u64> {
        self.known.get(&peer).copied()
    }

    /// Whether the hello of `peer`, carrying `incarnation` (0: a hello before version 6, which
    /// carries none), may be accepted: yes if it is the one recorded or none is (then it is
    /// recorded first, and kept); no, with the refusal, if another one is. `Err`: it could not
    /// be recorded (nothing is, and the hello is not accepted: the dialer tries again).
    pub fn admit(&mut self, peer: u64, incarnation: u64) -> io::Result<Result<(), HelloError>> {
        if incarnation == 0 {
            return Ok(Ok(()));
        }
        match self.of(peer) {
            Some(known) if known == incarnation => Ok(Ok(())),
            Some(known) => Ok(Err(HelloError::Incarnation {
                from: peer,
                known,
                theirs: incarnation,
            })),
            None => {
                self.known.insert(peer, incarnation);
                if let Err(error) = self.save() {
                    self.known.remove(&peer);
                    return Err(error);
                }
                log::info!("peer {peer}: its data directory is incarnation {incarnation:016x}");
                Ok(Ok(()))
            }
        }
    }

    /// Writes the file (atomically) if there is one.
    fn save(&self) -> io::Result<()> {
        let Some(file) = &self.file else {
            return Ok(());
        };
        let mut table = toml::Table::new();
        for (&peer, &incarnation) in &self.known {
            table.insert(peer.to_string(), format!("{incarnation:016x}").into());
        }
        let mut top = toml::Table::new();
        top.insert("incarnations".into(), toml::Value::Table(table));
        let text = format!(
            "# Written by latchkey: the data-directory incarnation each peer first said hello \
             with.\n# A peer that says hello with another one is refused (docs/cluster.md). Do \
             not edit.\n{top}"
        );
        write_atomically(file, text.as_bytes())
            .map_err(|e| io::Error::new(e.kind(), format!("{}: {e}", file.display())))
    }
}

/// The file's incarnations, or why it is damaged.
fn parse(text: &str) -> Result<BTreeMap<u64, u64>, String> {
    let top: toml::Table = text.parse().map_err(|e: toml::de::Error| {
        let detail: Vec<&str> = e.message().lines().collect();
        detail.join("; ")
    })?;
    let table = match top.get("incarnations") {
        None => return Ok(BTreeMap::new()),
        Some(toml::Value::Table(table)) => table,
        Some(other) => return Err(format!("incarnations is {other}, not a table")),
    };
    let mut known = BTreeMap::new();
    for (peer, value) in table {
        let id = peer.parse::<u64>().ok().filter(|&id| id != 0);
        let hex = value.as_str().filter(|hex| hex.len() == 16);
        let incarnation = hex.and_then(|hex| u64::from_str_radix(hex, 16).ok());
        match (id, incarnation) {
            (Some(id), Some(incarnation)) if incarnation != 0 => {
                known.insert(id, incarnation);
            }
            _ => return Err(format!("{peer} = {value}: not a node id and 16 hex digits")),
        }
    }
    Ok(known)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn temp_file(name: &str) -> PathBuf {
        let dir = std::env::temp_dir().join(format!(
            "latchkey-incarnations-{name}-{}",
            std::process::id()
        ));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        dir.join("peers.toml")
    }

    #[test]
    fn the_first_incarnation_is_kept_across_restarts_and_another_is_refused() {
        let file = temp_file("kept");
        let mut seen = Incarnations::load(&file).expect("no file yet: none seen");
        assert_eq!(seen.of(2), None);
        assert!(matches!(seen.admit(2, 0xaa), Ok(Ok(()))), "first: recorded");
        assert!(
            matches!(seen.admit(2, 0xaa), Ok(Ok(()))),
            "the same: accepted"
        );
        assert!(
            matches!(seen.admit(3, 0), Ok(Ok(()))),
            "version 5: no incarnation"
        );
        assert_eq!(seen.of(3), None, "nothing recorded for a hello without one");
        let refused = seen.admit(2, 0xbb).expect("no I/O");
        let expected = HelloError::Incarnation {
            from: 2,
            known: 0xaa,
            theirs: 0xbb,
        };
        assert_eq!(refused, Err(expected));
        assert_eq!(seen.of(2), Some(0xaa), "a refusal changes nothing");
        // A restart of this member remembers it.
        let mut again = Incarnations::load(&file).expect("loads");
        assert_eq!(again.of(2), Some(0xaa));
        assert!(matches!(again.admit(2, 0xbb), Ok(Err(_))));
        assert!(matches!(again.admit(3, 0xcc), Ok(Ok(()))));
        let reloaded = Incarnations::load(&file).expect("loads");
        assert_eq!((reloaded.of(2), reloaded.of(3)), (Some(0xaa), Some(0xcc)));
        let _ = std::fs::remove_dir_all(file.parent().unwrap());
    }

    #[test]
    fn a_damaged_file_is_refused_naming_it_and_a_failed_write_records_nothing() {
        let file = temp_file("damaged");
        for bad in [
            "[incarnations]\n2 = \"12\"\n",
            "[incarnations]\nx = \"00000000000000aa\"\n",
            "[incarnations]\n0 = \"00000000000000aa\"\n",
            "[incarnations]\n2 = \"0000000000000000\"\n",
            "incarnations = 3\n",
            "[[[",
        ] {
            std::fs::write(&file, bad).unwrap();
            let error = Incarnations::load(&file).expect_err(bad);
            let message = error.to_string();
            assert!(message.contains("peers.toml is damaged"), "{message}");
        }
        // A file that cannot be written (its directory is gone): an error, nothing recorded.
        let _ = std::fs::remove_dir_all(file.parent().unwrap());
        let mut seen = Incarnations {
            file: Some(file.clone()),
            known: BTreeMap::new(),
        };
        assert!(seen.admit(2, 0xaa).is_err());
        assert_eq!(seen.of(2), None);
        let mut memory = Incarnations::in_memory();
        assert!(matches!(memory.admit(2, 0xaa), Ok(Ok(()))));
        assert!(matches!(memory.admit(2, 0xab), Ok(Err(_))));
    }
}
