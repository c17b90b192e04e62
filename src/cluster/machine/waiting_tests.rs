//! Unit tests of the replicated queues: `Enqueue`, `Withdraw`, a grant taking its waiter out,
//! their bytes (version 3, refused in earlier versions), and snapshots that carry queues
//! (version 2, written only when there are waiters); and of the ended acquires a `Withdraw`
//! that says how it was answered records (version 4; snapshots of version 3).

use super::*;

/// A floor that is a multiple of every shard count used here.
const FLOOR: u64 = 1_000_000 * 1024;

fn key(text: &str) -> Vec<u8> {
    text.as_bytes().to_vec()
}

fn waiter(owner: u64) -> Queued {
    Queued {
        owner,
        client: 0xC11E_0000_0000_0000_0000_0000_0000_0000 + u128::from(owner),
        grace_s: 7,
        lease_ms: 1_000 + owner as u32,
        wait_ms: 5_000,
    }
}

fn enqueue(text: &str, owner: u64) -> Command {
    Command::Enqueue {
        key: key(text),
        waiter: waiter(owner),
    }
}

fn withdraw(text: &str, owner: u64) -> Command {
    Command::Withdraw {
        key: key(text),
        owner,
        answered: None,
    }
}

fn withdraw_answered(text: &str, owner: u64, answered: Answered) -> Command {
    Command::Withdraw {
        key: key(text),
        owner,
        answered: Some(answered),
    }
}

/// Shard 0 of 1 with the floor set at index 1 and `k` granted to owner 1 at index 2; returns
/// the machine and the token.
fn held() -> (ShardMachine, u64) {
    let mut machine = ShardMachine::new(0, 1);
    machine.apply(1, &Command::Barrier { floor: FLOOR }, 0);
    let acquire = Command::Acquire {
        key: key("k"),
        owner: 1,
        lease_ms: 1_000,
    };
    let Applied::Granted { token, .. } = machine.apply(2, &acquire, 0) else {
        panic!("not granted");
    };
    (machine, token)
}

fn queue(machine: &ShardMachine, text: &str) -> Vec<u64> {
    let waiting = machine.waiting().filter(|(k, _)| *k == text.as_bytes());
    waiting.map(|(_, waiter)| waiter.queued.owner).collect()
}

#[test]
fn waiters_queue_in_order_and_leave_by_withdraw_or_by_their_grant() {
    let (mut machine, token) = held();
    for (index, owner) in [(3, 10), (4, 11), (5, 12)] {
        assert_eq!(
            machine.apply(index, &enqueue("k", owner), 0),
            Applied::Queued
        );
    }
    assert_eq!(machine.apply(6, &enqueue("other", 20), 0), Applied::Queued);
    assert_eq!(queue(&machine, "k"), [10, 11, 12]);
    assert_eq!(machine.waiters(), 4);
    // A Withdraw takes the owner's waiter out, wherever it is; a second finds nothing.
    assert_eq!(machine.apply(7, &withdraw("k", 11), 0), Applied::Withdrawn);
    assert_eq!(machine.apply(8, &withdraw("k", 11), 0), Applied::NotQueued);
    assert_eq!(
        machine.apply(9, &withdraw("nokey", 10), 0),
        Applied::NotQueued
    );
    assert_eq!(queue(&machine, "k"), [10, 12]);
    // A handoff to the head takes it out of the queue with the grant.
    let release = Command::Release {
        key: key("k"),
        token,
        then: Some(Grant {
            owner: 10,
            lease_ms: 1_010,
        }),
    };
    let handed = machine.apply(10, &release, 0);
    assert!(matches!(handed, Applied::HandedOff { .. }), "{handed:?}");
    assert_eq!(queue(&machine, "k"), [12]);
    // A handoff that has no effect (another token) takes nobody out.
    let stale = Command::Release {
        key: key("k"),
        token,
        then: Some(Grant {
            owner: 12,
            lease_ms: 1_012,
        }),
    };
    assert_eq!(machine.apply(11, &stale, 0), Applied::NotHolder);
    assert_eq!(queue(&machine, "k"), [12]);
    // An Acquire that grants takes the owner out; one refused (held) leaves it queued.
    let acquire = |text: &str, owner| Command::Acquire {
        key: key(text),
        owner,
        lease_ms: 500,
    };
    assert!(matches!(
        machine.apply(12, &acquire("k", 12), 0),
        Applied::Held { .. }
    ));
    assert_eq!(queue(&machine, "k"), [12]);
    assert!(matches!(
        machine.apply(13, &acquire("other", 20), 0),
        Applied::Granted { .. }
    ));
    assert!(queue(&machine, "other").is_empty());
    assert_eq!(machine.waiters(), 1);
    machine.check_invariants();
}

#[test]
fn queues_are_in_the_digest_and_survive_a_snapshot() {
    let (mut machine, _) = held();
    let before = machine.digest();
    // Each wait's deadline is this member's: its apply time plus the wait (5 s).
    machine.apply(3, &enqueue("k", 10), 100);
    machine.apply(4, &enqueue("k", 11), 200);
    machine.apply(5, &enqueue("a", 12), 300);
    assert_ne!(machine.digest(), before, "the queues are replicated state");
    let bytes = machine.snapshot(1_000);
    assert_eq!(bytes[0], 2, "a snapshot with waiters is version 2");
    // Restored on a member whose clock reads 50: the time left, counted from there.
    let restored = ShardMachine::restore(0, 1, &bytes, 50).expect("restore");
    assert_eq!(restored.digest(), machine.digest());
    let restored: Vec<(Vec<u8>, Queued, u64)> = restored
        .waiting()
        .map(|(k, waiting)| (k.to_vec(), waiting.queued, waiting.deadline_ms))
        .collect();
    let expected = vec![
        (key("a"), waiter(12), 50 + 5_300 - 1_000),
        (key("k"), waiter(10), 50 + 5_100 - 1_000),
        (key("k"), waiter(11), 50 + 5_200 - 1_000),
    ];
    assert_eq!(restored, expected);
    // Without waiters the snapshot is version 1, as the previous build wrote and reads it.
    machine.apply(6, &withdraw("k", 10), 0);
    machine.apply(7, &withdraw("k", 11), 0);
    machine.apply(8, &withdraw("a", 12), 0);
    assert_eq!(machine.snapshot(0)[0], 1);
    assert_eq!(machine.digest(), {
        let (mut same, _) = held();
        for index in 3..=8 {
            same.skip(index);
        }
        same.digest()
    });
}

#[test]
fn a_frozen_image_keeps_the_queues_of_the_freeze() {
    let (mut machine, _) = held();
    machine.apply(3, &enqueue("k", 10), 0);
    let frozen = machine.freeze(0);
    let golden = machine.snapshot(0);
    machine.apply(4, &enqueue("k", 11), 0);
    machine.apply(5, &withdraw("k", 10), 0);
    assert_eq!(frozen.encode(), golden);
    let restored = ShardMachine::restore(0, 1, &golden, 0).expect("restore");
    assert_eq!(queue(&restored, "k"), [10]);
}

#[test]
fn the_new_forms_are_version_three_pinned_and_refused_in_earlier_versions() {
    let bytes = enqueue("k", 1).encode();
    let mut expected = vec![3, 7];
    expected.extend_from_slice(&1u64.to_be_bytes());
    expected.extend_from_slice(&waiter(1).client.to_be_bytes());
    expected.push(7);
    expected.extend_from_slice(&1_001u32.to_be_bytes());
    expected.extend_from_slice(&5_000u32.to_be_bytes());
    expected.extend_from_slice(&[0, 1, b'k']);
    assert_eq!(bytes, expected);
    let mut withdrawn = vec![3, 8];
    withdrawn.extend_from_slice(&9u64.to_be_bytes());
    withdrawn.extend_from_slice(&[0, 1, b'k']);
    assert_eq!(withdraw("k", 9).encode(), withdrawn);
    for mut bytes in [bytes, withdrawn] {
        assert!(Command::decode(&bytes).is_ok());
        for end in 0..bytes.len() {
            assert_eq!(Command::decode(&bytes[..end]), Err(DecodeError::Truncated));
        }
        let tag = bytes[1];
        for version in [1, 2] {
            bytes[0] = version;
            assert_eq!(Command::decode(&bytes), Err(DecodeError::Tag(tag)));
        }
    }
    // The earlier forms are still written as version 2.
    let acquire = Command::Acquire {
        key: key("k"),
        owner: 1,
        lease_ms: 2,
    };
    assert_eq!(acquire.encode()[0], 2);
}

#[test]
fn a_snapshot_claiming_more_waiters_than_its_bytes_is_refused_before_allocating() {
    let (mut machine, _) = held();
    machine.apply(3, &enqueue("k", 10), 0);
    let bytes = machine.snapshot(0);
    // The waiter count is the 4 bytes before the one waiter's 33 bytes, 8 of time left and 3
    // of key.
    let at = bytes.len() - (8 + 16 + 1 + 4 + 4) - 8 - 3 - 4;
    assert_eq!(bytes[at..at + 4], 1u32.to_be_bytes());
    let mut lying = bytes.clone();
    lying[at..at + 4].copy_from_slice(&1000u32.to_be_bytes());
    assert_eq!(
        ShardMachine::restore(0, 1, &lying, 0).map(|_| ()),
        Err(DecodeError::Truncated)
    );
    lying[at..at + 4].copy_from_slice(&u32::MAX.to_be_bytes());
    assert_eq!(
        ShardMachine::restore(0, 1, &lying, 0).map(|_| ()),
        Err(DecodeError::TooManyHolds(u32::MAX as usize))
    );
}

#[test]
fn a_withdraw_that_says_how_its_acquire_was_answered_leaves_a_record_for_resolves() {
    let (mut machine, token) = held();
    for (index, owner) in [(3, 10), (4, 11), (5, 12), (6, 13)] {
        machine.apply(index, &enqueue("k", owner), 0);
    }
    let client = |owner| waiter(owner).client;
    let answered = |text, owner, answered| withdraw_answered(text, owner, answered);
    assert_eq!(
        machine.apply(7, &answered("k", 10, Answered::TimedOut), 0),
        Applied::Withdrawn
    );
    assert_eq!(
        machine.apply(8, &answered("k", 11, Answered::Busy), 0),
        Applied::Withdrawn
    );
    // Not said (version 3), not queued, or granted: nothing is recorded.
    assert_eq!(machine.apply(9, &withdraw("k", 12), 0), Applied::Withdrawn);
    let missing = answered("k", 99, Answered::TimedOut);
    assert_eq!(machine.apply(10, &missing, 0), Applied::NotQueued);
    let release = Command::Release {
        key: key("k"),
        token,
        then: Some(Grant {
            owner: 13,
            lease_ms: 1_013,
        }),
    };
    assert!(matches!(
        machine.apply(11, &release, 0),
        Applied::HandedOff { .. }
    ));
    assert_eq!(machine.ended(client(10), 10), Some(Answered::TimedOut));
    assert_eq!(machine.ended(client(11), 11), Some(Answered::Busy));
    for owner in [12, 13, 99] {
        assert_eq!(machine.ended(client(owner), owner), None, "owner {owner}");
    }
    // Under its own client only.
    assert_eq!(machine.ended(client(11), 10), None);
    // Replicated state: in the digest, in snapshots (version 3) and frozen images.
    let bytes = machine.snapshot(0);
    assert_eq!(bytes[0], 3, "a snapshot with ended acquires is version 3");
    let restored = ShardMachine::restore(0, 1, &bytes, 0).expect("restore");
    assert_eq!(restored.digest(), machine.digest());
    assert_eq!(restored.ended(client(11), 11), Some(Answered::Busy));
    let frozen = machine.freeze(0);
    machine.apply(12, &enqueue("k", 14), 0);
    machine.apply(13, &answered("k", 14, Answered::TimedOut), 0);
    assert_eq!(frozen.encode(), bytes);
    let mut unsaid = held().0;
    for index in 3..=6 {
        unsaid.apply(index, &enqueue("k", index + 7), 0);
    }
    for (index, owner) in [(7, 10), (8, 11), (9, 12)] {
        unsaid.apply(index, &withdraw("k", owner), 0);
    }
    unsaid.skip(10);
    unsaid.apply(11, &release, 0);
    let at_11 = ShardMachine::restore(0, 1, &bytes, 0).expect("restore");
    assert_ne!(
        unsaid.digest(),
        at_11.digest(),
        "the records are in the digest"
    );
}

#[test]
fn the_last_ended_max_ended_acquires_are_kept_the_oldest_forgotten_first() {
    let (mut machine, _) = held();
    let mut index = 2;
    let extra = 5;
    for owner in 0..(ENDED_MAX + extra) as u64 {
        index += 1;
        machine.apply(index, &enqueue("k", owner), 0);
        index += 1;
        machine.apply(index, &withdraw_answered("k", owner, Answered::TimedOut), 0);
    }
    machine.check_invariants();
    let ended = |machine: &ShardMachine, owner: u64| machine.ended(waiter(owner).client, owner);
    for owner in 0..extra as u64 {
        assert_eq!(ended(&machine, owner), None, "owner {owner} is forgotten");
    }
    for owner in [extra as u64, (ENDED_MAX + extra - 1) as u64] {
        assert_eq!(
            ended(&machine, owner),
            Some(Answered::TimedOut),
            "owner {owner}"
        );
    }
    // The same owner ended again moves to the back (one record per client and owner).
    index += 1;
    machine.apply(index, &enqueue("k", extra as u64), 0);
    index += 1;
    let again = withdraw_answered("k", extra as u64, Answered::Busy);
    machine.apply(index, &again, 0);
    index += 1;
    machine.apply(index, &enqueue("k", 1), 0);
    index += 1;
    machine.apply(index, &withdraw_answered("k", 1, Answered::TimedOut), 0);
    assert_eq!(ended(&machine, extra as u64), Some(Answered::Busy));
    assert_eq!(ended(&machine, 1), Some(Answered::TimedOut));
    assert_eq!(ended(&machine, extra as u64 + 1), None, "the oldest went");
    machine.check_invariants();
    let restored = ShardMachine::restore(0, 1, &machine.snapshot(0), 0).expect("restore");
    assert_eq!(restored.digest(), machine.digest());
}

#[test]
fn a_withdraw_that_says_how_it_was_answered_is_version_four_pinned() {
    let command = withdraw_answered("k", 9, Answered::Busy);
    let mut bytes = vec![4, 8];
    bytes.extend_from_slice(&9u64.to_be_bytes());
    bytes.push(2);
    bytes.extend_from_slice(&[0, 1, b'k']);
    assert_eq!(command.encode(), bytes);
    assert_eq!(Command::decode(&bytes), Ok(command));
    for end in 0..bytes.len() {
        assert_eq!(Command::decode(&bytes[..end]), Err(DecodeError::Truncated));
    }
    for byte in [0, 3, 255] {
        let mut wrong = bytes.clone();
        wrong[10] = byte;
        assert_eq!(Command::decode(&wrong), Err(DecodeError::Flag(byte)));
    }
    // Read as version 3, the byte is part of the key's length: not a command.
    bytes[0] = 3;
    assert!(Command::decode(&bytes).is_err());
    // Version 5 is unknown.
    bytes[0] = 5;
    assert_eq!(Command::decode(&bytes), Err(DecodeError::Version(5)));
    // Without it, still version 3.
    assert_eq!(withdraw("k", 9).encode()[0], 3);
}

#[test]
fn a_snapshot_whose_ended_acquires_are_out_of_order_or_listed_twice_is_refused() {
    let (mut machine, _) = held();
    for (index, owner) in [(3, 10), (4, 11)] {
        machine.apply(index, &enqueue("k", owner), 0);
    }
    machine.apply(5, &withdraw_answered("k", 10, Answered::TimedOut), 0);
    machine.apply(6, &withdraw_answered("k", 11, Answered::TimedOut), 0);
    let image = SnapshotImage::decode(&machine.snapshot(0)).expect("decode");
    assert_eq!(image.ended.len(), 2);
    let refused = |image: &SnapshotImage| {
        let restored = ShardMachine::restore(0, 1, &image.encode(), 0);
        assert!(
            matches!(restored, Err(DecodeError::Inconsistent(_))),
            "{restored:?}"
        );
    };
    let mut twice = image.clone();
    twice.ended[0].owner = 11;
    twice.ended[0].client = twice.ended[1].client;
    refused(&twice);
    let mut swapped = image.clone();
    swapped.ended.swap(0, 1);
    refused(&swapped);
    let mut ahead = image.clone();
    ahead.ended[1].index = 7;
    refused(&ahead);
    let mut nobody = image;
    nobody.ended[0].client = 0;
    refused(&nobody);
}
