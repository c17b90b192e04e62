use super::*;
use crate::cluster::machine::{Applied, Command, Queued};

const SHARDS: u32 = 2;

/// Shard `shard` of [`SHARDS`] after a barrier at `floor` and acquires of `keys` (one entry
/// each), then `skipped` empty entries.
fn machine(shard: u32, floor: Option<u64>, keys: &[&str], skipped: u64) -> ShardMachine {
    let mut machine = ShardMachine::new(shard, SHARDS);
    let mut index = 0;
    if let Some(floor) = floor {
        index += 1;
        machine.apply(index, &Command::Barrier { floor }, 0);
    }
    for key in keys {
        index += 1;
        let acquire = Command::Acquire {
            key: key.as_bytes().to_vec(),
            owner: 7,
            lease_ms: 30_000,
        };
        assert!(matches!(
            machine.apply(index, &acquire, 0),
            Applied::Granted { .. }
        ));
    }
    for _ in 0..skipped {
        index += 1;
        machine.skip(index);
    }
    machine
}

fn file_of(machines: &[ShardMachine], now_ms: u64) -> BackupFile {
    let shards = machines
        .iter()
        .map(|machine| {
            let bytes = ShardBackup::encode_of(machine, SHARDS, 3, now_ms).expect("a copy");
            ShardBackup::decode(&bytes).expect("decodes")
        })
        .collect();
    BackupFile { shards }
}

fn two_shards() -> BackupFile {
    let machines = [
        machine(0, Some(1_000), &["a", "b"], 50),
        machine(1, Some(2_000), &["c"], 0),
    ];
    file_of(&machines, 10_000)
}

#[test]
fn a_file_round_trips_with_its_holds_and_their_lease_left() {
    let file = two_shards();
    let bytes = file.encode().expect("encodes");
    assert!(bytes.starts_with(MAGIC));
    let decoded = BackupFile::decode(&bytes).expect("decodes");
    assert_eq!(decoded, file);
    assert_eq!(decoded.locks(), 3);
    let hold = &decoded.shards[0].image.holds[0];
    assert_eq!(
        hold.remaining_ms, 20_000,
        "30 s lease granted at 0, copied at 10 s"
    );
    assert_eq!(
        decoded.highest_token(),
        file.shards[1].image.holds.first().map(|h| h.token)
    );
}

#[test]
fn a_truncated_file_is_refused_at_every_length() {
    let bytes = two_shards().encode().expect("encodes");
    for cut in 0..bytes.len() {
        let error = BackupFile::decode(&bytes[..cut]).expect_err("truncated");
        let expected = match cut < MAGIC.len() {
            true => BackupError::NotBackup,
            false => BackupError::Checksum,
        };
        assert_eq!(error, expected, "cut at {cut}");
    }
}

#[test]
fn a_flipped_bit_is_refused() {
    let bytes = two_shards().encode().expect("encodes");
    for at in MAGIC.len() + 1..bytes.len() {
        let mut corrupt = bytes.clone();
        corrupt[at] ^= 0x10;
        let error = BackupFile::decode(&corrupt).expect_err("corrupt");
        assert_eq!(error, BackupError::Checksum, "byte {at}");
    }
    let mut other = bytes.clone();
    other[0] = b'X';
    assert_eq!(BackupFile::decode(&other), Err(BackupError::NotBackup));
}

#[test]
fn an_unknown_version_is_refused_by_name() {
    let mut bytes = two_shards().encode().expect("encodes");
    bytes[MAGIC.len()] = FORMAT_VERSION + 1;
    let error = BackupFile::decode(&bytes).expect_err("version");
    assert_eq!(error, BackupError::Version(FORMAT_VERSION + 1));
    assert!(
        error.to_string().contains("this build reads version 1"),
        "{error}"
    );
}

#[test]
fn a_well_framed_file_with_a_shard_missing_is_refused() {
    let mut file = two_shards();
    file.shards.pop();
    let mut bytes = file.encode().expect("encodes");
    // Claim two shards, checksum included: the records say otherwise.
    bytes[MAGIC.len() + 4] = 2;
    let end = bytes.len() - 4;
    let crc = crc32c(&bytes[..end]).to_be_bytes();
    bytes[end..].copy_from_slice(&crc);
    assert!(matches!(
        BackupFile::decode(&bytes),
        Err(BackupError::Corrupt(_))
    ));
}

#[test]
fn another_shard_count_is_refused() {
    let file = two_shards();
    let error = file.initial_states(3).expect_err("3 shards");
    assert_eq!(error, BackupError::Shards { file: 2, config: 3 });
    assert!(error.to_string().contains("cluster.shards is 3"), "{error}");
}

#[test]
fn a_copy_with_queued_acquires_is_refused() {
    let mut machine = machine(0, Some(1_000), &["a"], 0);
    let waiter = Queued {
        owner: 9,
        client: 5,
        grace_s: 10,
        lease_ms: 1_000,
        wait_ms: 1_000,
    };
    let key = b"a".to_vec();
    machine.apply(3, &Command::Enqueue { key, waiter }, 0);
    let copy = ShardBackup {
        shard: 0,
        shards: SHARDS,
        applied: 3,
        term: 1,
        image: SnapshotImage::decode(&machine.snapshot(0)).expect("an image"),
    };
    let error = ShardBackup::decode(&copy.encode()).expect_err("waiters");
    assert!(error.to_string().contains("no queued acquires"), "{error}");
    // The copy a leader gives leaves them out.
    let given = ShardBackup::encode_of(&machine, SHARDS, 1, 0).expect("a copy");
    let given = ShardBackup::decode(&given).expect("decodes");
    assert!(given.image.waiters.is_empty() && given.image.holds.len() == 1);
}

/// Every shard of a new cluster started from the file keeps the holds, and its next grant
/// has a token above every token the old cluster may have issued, in any shard; a shard that
/// never had a floor gets one above them too.
#[test]
fn tokens_continue_above_the_backups_in_every_shard() {
    for floors in [
        [Some(1_000), Some(2_000)],
        [Some(5_000), None],
        [None, Some(4)],
    ] {
        let machines = [
            machine(
                0,
                floors[0],
                if floors[0].is_some() {
                    &["a", "b"]
                } else {
                    &[]
                },
                50,
            ),
            machine(
                1,
                floors[1],
                if floors[1].is_some() { &["c"] } else { &[] },
                0,
            ),
        ];
        let file = file_of(&machines, 0);
        let ceiling = (file.shards.iter())
            .filter_map(|copy| copy.ceiling())
            .max()
            .expect("a floor");
        let highest = file.highest_token().expect("a hold");
        assert!(highest <= ceiling);
        for state in file.initial_states(SHARDS).expect("states") {
            let mut restored = ShardMachine::restore(state.shard, SHARDS, &state.data, 100)
                .expect("a consistent state");
            restored.check_invariants();
            let kept = &machines[state.shard as usize];
            assert_eq!(restored.len(), kept.len());
            for (key, hold) in kept.holds() {
                let now = restored.holder(key).expect("still held");
                assert_eq!((now.token, now.owner), (hold.token, hold.owner));
                assert_eq!(
                    now.deadline_ms,
                    100 + 30_000,
                    "the lease left, from the start"
                );
            }
            let barrier = Command::Barrier { floor: 1 };
            restored.apply(state.index + 1, &barrier, 100);
            let acquire = Command::Acquire {
                key: b"new".to_vec(),
                owner: 1,
                lease_ms: 1,
            };
            let Applied::Granted { token, .. } = restored.apply(state.index + 2, &acquire, 100)
            else {
                panic!("granted");
            };
            assert!(
                token > ceiling,
                "{floors:?} shard {}: {token} <= {ceiling}",
                state.shard
            );
        }
    }
}

#[test]
fn a_leader_refuses_a_shard_over_the_limits_by_name() {
    let refusal = BackupRefusal::TooManyHolds {
        shard: 4,
        holds: BACKUP_HOLDS_MAX + 1,
    };
    assert_eq!(refusal.status(), 507);
    assert!(
        refusal.to_string().contains("100000 per shard"),
        "{refusal}"
    );
    let refusal = BackupRefusal::NotLeader {
        shard: 4,
        leader: Some((2, "127.0.0.1:7421".into())),
    };
    assert_eq!(refusal.status(), 421);
    assert!(refusal.to_string().contains("member 2 at 127.0.0.1:7421"));
}
