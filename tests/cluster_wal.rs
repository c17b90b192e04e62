//! The write-ahead log through its public surface: a member's view (open, write, sync, reopen,
//! load into raft's storage) and refusals that must be errors, not panics.

use latchkey::cluster::wal::{Options, Wal};
use latchkey::cluster::{load, Durable, Recovered};
use raft::eraftpb::{Entry, HardState};
use raft::Storage as _;
use std::path::PathBuf;

struct TempDir(PathBuf);

impl TempDir {
    fn new(name: &str) -> TempDir {
        let path = std::env::temp_dir().join(format!(
            "latchkey-cluster-wal-{name}-{}",
            std::process::id()
        ));
        let _ = std::fs::remove_dir_all(&path);
        TempDir(path)
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

fn entry(index: u64, term: u64) -> Entry {
    Entry {
        index,
        term,
        data: vec![index as u8; 16].into(),
        ..Default::default()
    }
}

#[test]
fn a_member_recovers_what_it_synced_and_nothing_it_did_not() {
    let dir = TempDir::new("member");
    let core = dir.0.join("core-0");
    let (mut wal, recovered) = Wal::open(&core, true).expect("open creates the directory");
    assert!(recovered.is_empty());
    let durable: &mut dyn Durable = &mut wal;
    for shard in 0..8u32 {
        let entries: Vec<Entry> = (1..=4).map(|index| entry(index, 1)).collect();
        durable.append(shard, &entries).expect("append");
        let hard_state = HardState {
            term: 1,
            vote: 1,
            commit: 3,
            ..Default::default()
        };
        durable
            .set_hard_state(shard, &hard_state)
            .expect("hard state");
    }
    durable.sync().expect("sync");
    durable
        .append(0, &[entry(5, 1)])
        .expect("append, never synced");
    drop(wal);

    let (_, recovered) = Wal::open(&core, true).expect("reopen");
    assert_eq!(recovered.len(), 8);
    for (shard, group) in &recovered {
        let storage = load(group, &[1, 2, 3]).expect("load");
        assert_eq!(storage.last_index().expect("last"), 4, "shard {shard}");
        let state = storage.initial_state().expect("state");
        assert_eq!(state.hard_state.commit, 3, "shard {shard}");
        assert_eq!(state.conf_state.voters, vec![1, 2, 3]);
    }
}

#[test]
fn bad_places_and_bad_options_are_errors() {
    let dir = TempDir::new("bad");
    std::fs::create_dir_all(&dir.0).expect("mkdir");
    let file = dir.0.join("a-file");
    std::fs::write(&file, b"not a directory").expect("write");
    assert!(Wal::open(&file, false).is_err());
    let tiny = Options {
        segment_bytes: 1,
        ..Options::default()
    };
    assert!(Wal::open_with(&dir.0.join("core-1"), tiny).is_err());
    // Garbage in a lone segment is a torn tail: the log is cut to nothing, not refused.
    let core = dir.0.join("core-2");
    std::fs::create_dir_all(&core).expect("mkdir");
    std::fs::write(core.join("wal-0000000000000000.log"), [0xff; 100]).expect("write");
    let (_, recovered) = Wal::open(&core, false).expect("open");
    assert_eq!(recovered, Vec::<(u32, Recovered)>::new());
}
