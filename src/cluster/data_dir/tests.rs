//! Unit tests of the data directory: the lock, the record, every disagreement naming its key,
//! the upgrade from an earlier version's `layout`, and what is refused as damaged.

use super::*;
use crate::config::MemberConfig;
use std::sync::atomic::{AtomicU64, Ordering};

/// A fresh directory under the temp dir, removed on drop.
struct TempDir(PathBuf);

impl TempDir {
    fn new(name: &str) -> TempDir {
        static NEXT: AtomicU64 = AtomicU64::new(0);
        let unique = NEXT.fetch_add(1, Ordering::Relaxed);
        let pid = std::process::id();
        let path = std::env::temp_dir().join(format!("latchkey-data-dir-{name}-{pid}-{unique}"));
        let _ = std::fs::remove_dir_all(&path);
        TempDir(path)
    }

    /// The data directory inside it (not created: `open` creates it).
    fn data(&self) -> PathBuf {
        self.0.join("data")
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// A cluster of `members` members (ids 1..), `shards` shards, this member `node_id`.
fn cluster(node_id: u64, members: u64, shards: u32) -> ClusterConfig {
    ClusterConfig {
        node_id,
        data_dir: PathBuf::from("unused"),
        members: (1..=members)
            .map(|id| MemberConfig {
                id,
                client: format!("127.0.0.1:{}", 7420 + id).parse().unwrap(),
                peer: format!("127.0.0.1:{}", 7520 + id).parse().unwrap(),
            })
            .collect(),
        shards,
        fsync: true,
        tls: None,
        restore_from: None,
    }
}

fn expected(node_id: u64, members: u64, shards: u32, cores: usize) -> Expected {
    Expected::of(&cluster(node_id, members, shards), cores)
}

/// Opening `dir` with `expected` is refused by an error that starts with `key` and says `says`.
fn assert_refused(dir: &Path, expected: &Expected, key: &str, says: &str) {
    let error = DataDir::open(dir, expected).expect_err("refused");
    let message = error.to_string();
    assert!(message.starts_with(&format!("{key}: ")), "{message}");
    assert!(message.contains(says), "{message:?} does not say {says:?}");
    assert!(!message.contains('\n'), "{message:?} is not one line");
}

#[test]
fn a_first_start_records_the_member_and_a_later_one_with_the_same_config_opens() {
    let temp = TempDir::new("first");
    let wanted = expected(2, 3, 8, 2);
    let opened = DataDir::open(&temp.data(), &wanted).expect("opens");
    assert_eq!(opened.path(), temp.data());
    let record = std::fs::read_to_string(temp.data().join(RECORD_FILE)).unwrap();
    let parsed = parse_record(&record).expect("parses");
    let incarnation = opened.incarnation();
    assert_ne!(incarnation, 0);
    assert_eq!(
        parsed,
        Record {
            node_id: 2,
            cores: 2,
            shards: 8,
            identity: wanted.identity.text.clone(),
            incarnation: Some(incarnation),
        }
    );
    assert!(!temp.data().join(format!("{RECORD_FILE}.tmp")).exists());
    assert_eq!(opened.peers_file(), temp.data().join(PEERS_FILE));
    drop(opened);
    // The same configuration, members listed in another order, opens again, the same
    // incarnation.
    let mut reordered = cluster(2, 3, 8);
    reordered.members.reverse();
    let again = DataDir::open(&temp.data(), &Expected::of(&reordered, 2)).expect("opens again");
    assert_eq!(again.incarnation(), incarnation);
    drop(again);
    // The directory emptied (a lost disk): another incarnation.
    std::fs::remove_dir_all(temp.data()).unwrap();
    let fresh = DataDir::open(&temp.data(), &wanted).expect("a fresh start");
    assert_ne!(
        fresh.incarnation(),
        incarnation,
        "a new directory, a new incarnation"
    );
}

/// A record of the version before incarnations gets one at its next start, kept from then on;
/// a damaged incarnation is refused as a damaged record.
#[test]
fn a_record_without_an_incarnation_gets_one_and_keeps_it() {
    let temp = TempDir::new("incarnation");
    let dir = temp.data();
    let wanted = expected(1, 3, 4, 1);
    drop(DataDir::open(&dir, &wanted).expect("first start"));
    let record = std::fs::read_to_string(dir.join(RECORD_FILE)).unwrap();
    let earlier: String = (record.lines())
        .filter(|line| !line.starts_with("incarnation"))
        .map(|line| format!("{line}\n"))
        .collect();
    assert_eq!(parse_record(&earlier).expect("parses").incarnation, None);
    std::fs::write(dir.join(RECORD_FILE), &earlier).unwrap();
    let opened = DataDir::open(&dir, &wanted).expect("an earlier record opens");
    let drawn = opened.incarnation();
    drop(opened);
    let rewritten = parse_record(&std::fs::read_to_string(dir.join(RECORD_FILE)).unwrap());
    assert_eq!(rewritten.expect("parses").incarnation, Some(drawn));
    assert_eq!(
        DataDir::open(&dir, &wanted).expect("opens").incarnation(),
        drawn
    );
    for bad in [
        "\"12\"",
        "\"0000000000000000\"",
        "\"zzzzzzzzzzzzzzzz\"",
        "12",
    ] {
        let damaged = format!("{earlier}incarnation = {bad}\n");
        std::fs::write(dir.join(RECORD_FILE), damaged).unwrap();
        let error = DataDir::open(&dir, &wanted).expect_err("damaged");
        let message = error.to_string();
        assert!(
            message.contains("member.toml is damaged (incarnation"),
            "{message}"
        );
    }
}

#[test]
fn a_second_opener_is_refused_naming_the_holder_until_the_first_lets_go() {
    let temp = TempDir::new("lock");
    let held = DataDir::open(&temp.data(), &expected(1, 3, 4, 1)).expect("opens");
    let holder = std::fs::read_to_string(temp.data().join(LOCK_FILE)).unwrap();
    let pid = std::process::id();
    assert!(
        holder.starts_with(&format!("pid {pid}, node 1, since 20")),
        "{holder}"
    );
    // Another member's config on the same directory: refused before its record is looked at.
    let error = DataDir::open(&temp.data(), &expected(3, 3, 4, 1)).expect_err("locked");
    assert_eq!(error.kind(), io::ErrorKind::AddrInUse);
    let message = error.to_string();
    let dir = temp.data().display().to_string();
    assert!(
        message.starts_with(&format!(
            "cluster.data_dir {dir} is in use by another latchkey process: pid {pid}, node 1, \
             since "
        )),
        "{message}"
    );
    drop(held);
    DataDir::open(&temp.data(), &expected(1, 3, 4, 1)).expect("free again");
}

#[test]
fn each_disagreement_with_the_record_names_its_key() {
    let temp = TempDir::new("disagree");
    let dir = temp.data();
    drop(DataDir::open(&dir, &expected(1, 3, 4, 2)).expect("opens"));
    assert_refused(
        &dir,
        &expected(3, 3, 4, 2),
        "cluster.node_id",
        "holds the data of member 1, this config says 3",
    );
    assert_refused(
        &dir,
        &expected(1, 3, 8, 2),
        "cluster.shards",
        "cluster.shards = 4, this config has 8",
    );
    let five = expected(1, 5, 4, 2);
    assert_refused(
        &dir,
        &five,
        "cluster.members",
        &format!(
            "`{}`, this config describes `{}`",
            expected(1, 3, 4, 2).identity.text,
            five.identity.text
        ),
    );
    let mut moved = cluster(1, 3, 4);
    moved.members[1].client = "127.0.0.1:9999".parse().unwrap();
    assert_refused(
        &dir,
        &Expected::of(&moved, 2),
        "cluster.members",
        "127.0.0.1:9999",
    );
    assert_refused(
        &dir,
        &expected(1, 3, 4, 3),
        "server.cores",
        "server.cores = 2, this start has 3",
    );
    // A peer address is not part of what the directory records.
    let mut repeered = cluster(1, 3, 4);
    repeered.members[2].peer = "10.0.0.3:7000".parse().unwrap();
    DataDir::open(&dir, &Expected::of(&repeered, 2)).expect("peer addresses may change");
}

#[test]
fn an_earlier_versions_layout_is_checked_then_upgraded_to_a_record() {
    let temp = TempDir::new("upgrade");
    let dir = temp.data();
    std::fs::create_dir_all(dir.join("core-0")).unwrap();
    std::fs::write(dir.join(LAYOUT_FILE), "shards=4 cores=1\n").unwrap();
    assert_refused(
        &dir,
        &expected(1, 3, 4, 2),
        "server.cores",
        "server.cores = 1, this start has 2",
    );
    assert_refused(
        &dir,
        &expected(1, 3, 8, 1),
        "cluster.shards",
        "cluster.shards = 4, this config has 8",
    );
    assert!(!dir.join(RECORD_FILE).exists(), "a refusal writes nothing");
    drop(DataDir::open(&dir, &expected(2, 3, 4, 1)).expect("upgrades"));
    assert!(!dir.join(LAYOUT_FILE).exists());
    let record = parse_record(&std::fs::read_to_string(dir.join(RECORD_FILE)).unwrap());
    assert_eq!(record.expect("parses").node_id, 2);
    // From now on the record decides.
    assert_refused(&dir, &expected(1, 3, 4, 1), "cluster.node_id", "member 2");
}

#[test]
fn logs_without_a_record_and_a_damaged_record_or_layout_are_refused() {
    let temp = TempDir::new("damaged");
    let dir = temp.data();
    std::fs::create_dir_all(dir.join("core-1")).unwrap();
    let error = DataDir::open(&dir, &expected(1, 3, 4, 2)).expect_err("whose logs?");
    assert!(
        error
            .to_string()
            .contains("holds write-ahead logs (core-1) but no member.toml"),
        "{error}"
    );
    std::fs::write(dir.join(RECORD_FILE), "node_id = 1\ncores = \"two\"\n").unwrap();
    let error = DataDir::open(&dir, &expected(1, 3, 4, 2)).expect_err("damaged");
    assert!(
        error
            .to_string()
            .contains("member.toml is damaged (cores is \"two\""),
        "{error}"
    );
    std::fs::remove_file(dir.join(RECORD_FILE)).unwrap();
    std::fs::write(dir.join(LAYOUT_FILE), "garbage").unwrap();
    let error = DataDir::open(&dir, &expected(1, 3, 4, 2)).expect_err("damaged layout");
    assert!(
        error
            .to_string()
            .contains("layout of an earlier version is damaged"),
        "{error}"
    );
}

#[test]
fn a_holders_line_is_repeated_bounded_and_escaped() {
    assert_eq!(holder_text(b""), "it has not written who it is yet");
    assert_eq!(
        holder_text(b"pid 7, node 2, since x\n"),
        "pid 7, node 2, since x"
    );
    assert_eq!(
        holder_text(b"evil\rforged\x1b[2J"),
        "evil\\rforged\\u{1b}[2J"
    );
    assert_eq!(holder_text(b"one\ntwo"), "one");
}

/// A start from a backup seeds the fresh directory before its record is written: a seed that
/// fails leaves no record, the logs it wrote make the next start a refusal, and a directory that
/// holds data is never seeded again.
#[test]
fn a_fresh_directory_is_seeded_before_its_record_and_only_then() {
    let temp = TempDir::new("seeded");
    let wanted = expected(1, 3, 4, 1);
    assert!(!DataDir::holds_data(&temp.data()).expect("looks"));
    let mut failing = |dir: &Path| {
        std::fs::create_dir_all(dir.join("core-0"))?;
        Err(io::Error::other("seeding failed (injected)"))
    };
    let error = DataDir::open_seeding(&temp.data(), &wanted, &mut failing).expect_err("fails");
    assert!(error.to_string().contains("injected"), "{error}");
    assert!(!temp.data().join(RECORD_FILE).exists());
    assert!(DataDir::holds_data(&temp.data()).expect("looks"));
    let refused = DataDir::open(&temp.data(), &wanted).expect_err("logs without a record");
    assert!(refused.to_string().contains("no member.toml"), "{refused}");

    let temp = TempDir::new("seeded-once");
    let mut seeds = 0;
    let mut seed = |dir: &Path| {
        assert!(!dir.join(RECORD_FILE).exists(), "seeded before the record");
        seeds += 1;
        Ok(())
    };
    drop(DataDir::open_seeding(&temp.data(), &wanted, &mut seed).expect("opens"));
    drop(DataDir::open_seeding(&temp.data(), &wanted, &mut seed).expect("opens again"));
    assert_eq!(seeds, 1);
    assert!(DataDir::holds_data(&temp.data()).expect("looks"));
}
