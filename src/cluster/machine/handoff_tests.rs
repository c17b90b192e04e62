//! Unit tests of handoffs (a release or expiry that grants its key to a waiter in the same
//! entry) and of the command versions: what version 1 wrote still decodes and means the same.

use super::*;

/// A floor that is a multiple of every shard count used here.
const FLOOR: u64 = 1_000_000 * 1024;

fn key(text: &str) -> Vec<u8> {
    text.as_bytes().to_vec()
}

fn grant(owner: u64, lease_ms: u32) -> Option<Grant> {
    Some(Grant { owner, lease_ms })
}

fn release(text: &str, token: u64, then: Option<Grant>) -> Command {
    Command::Release {
        key: key(text),
        token,
        then,
    }
}

fn expire(text: &str, token: u64, as_of: u64, then: Option<Grant>) -> Command {
    Command::Expire {
        key: key(text),
        token,
        as_of,
        then,
    }
}

/// Shard `shard` of `shards` with the floor set at index 1 and `k` granted at index 2
/// (lease 1 s from time 0); returns the machine and that token.
fn held(shard: u32, shards: u32) -> (ShardMachine, u64) {
    let mut machine = ShardMachine::new(shard, shards);
    machine.apply(1, &Command::Barrier { floor: FLOOR }, 0);
    let acquire = Command::Acquire {
        key: key("k"),
        owner: 1,
        lease_ms: 1_000,
    };
    match machine.apply(2, &acquire, 0) {
        Applied::Granted { token, .. } => (machine, token),
        other => panic!("not granted: {other:?}"),
    }
}

#[test]
fn a_release_with_then_hands_the_key_over_with_its_own_index_token() {
    let (mut machine, first) = held(2, 4);
    let handed = machine.apply(5, &release("k", first, grant(9, 3_000)), 100);
    let token = FLOOR + 5 * 4 + 2;
    assert_eq!(
        handed,
        Applied::HandedOff {
            token,
            deadline_ms: 3_100
        }
    );
    assert!(token > first);
    let hold = Hold {
        token,
        owner: 9,
        lease_ms: 3_000,
        deadline_ms: 3_100,
        renewed_at: 5,
    };
    assert_eq!(machine.holder(b"k"), Some(&hold));
    assert_eq!(machine.key_of(first), None);
    assert_eq!(machine.granted_at(b"k", 5), Some(&hold));
    assert_eq!(machine.len(), 1);
    // The old token is gone: its release (with or without a waiter) changes nothing.
    let again = machine.apply(6, &release("k", first, grant(10, 1)), 200);
    assert_eq!(again, Applied::NotHolder);
    assert_eq!(machine.holder(b"k"), Some(&hold));
}

#[test]
fn a_release_that_has_no_effect_grants_nothing() {
    let (mut machine, token) = held(0, 1);
    let wrong = machine.apply(3, &release("k", token + 1, grant(9, 10)), 0);
    assert_eq!(wrong, Applied::NotHolder);
    assert_eq!(machine.holder(b"k").map(|hold| hold.token), Some(token));
    let free = machine.apply(4, &release("other", token, grant(9, 10)), 0);
    assert_eq!(free, Applied::NotHolder);
    assert!(machine.holder(b"other").is_none());
    assert_eq!(machine.len(), 1);
    // Without a waiter, a release frees the key as it always did.
    assert_eq!(
        machine.apply(5, &release("k", token, None), 0),
        Applied::Released
    );
    assert!(machine.is_empty());
}

#[test]
fn an_expiry_with_then_hands_over_only_if_it_takes_effect() {
    let (mut machine, token) = held(0, 1);
    // Renewed at 3, after the leader decided at 2 to expire it: no expiry, no grant.
    let extend = Command::Extend {
        key: key("k"),
        token,
        lease_ms: 1_000,
    };
    machine.apply(3, &extend, 500);
    let stale = machine.apply(4, &expire("k", token, 2, grant(9, 10)), 1_600);
    assert_eq!(stale, Applied::Renewed);
    assert_eq!(machine.holder(b"k").map(|hold| hold.owner), Some(1));
    // Decided after the renewal: it expires and the waiter holds the key.
    let handed = machine.apply(5, &expire("k", token, 4, grant(9, 10)), 1_600);
    assert_eq!(
        handed,
        Applied::HandedOff {
            token: FLOOR + 5,
            deadline_ms: 1_610
        }
    );
    assert_eq!(machine.holder(b"k").map(|hold| hold.owner), Some(9));
    // An expiry without a waiter frees the key.
    let expired = machine.apply(6, &expire("k", FLOOR + 5, 5, None), 1_700);
    assert_eq!(expired, Applied::Expired);
    assert!(machine.is_empty());
}

#[test]
fn handoff_tokens_are_unique_and_increase_along_a_chain() {
    let (mut machine, mut token) = held(1, 2);
    let mut seen = vec![token];
    for index in 3..40u64 {
        let then = grant(index, 100);
        let command = match index % 2 {
            0 => release("k", token, then),
            _ => expire("k", token, index - 1, then),
        };
        match machine.apply(index, &command, index) {
            Applied::HandedOff { token: next, .. } => {
                assert!(next > token, "token {next} after {token}");
                assert_eq!(next % 2, 1, "shard 1's residue");
                token = next;
            }
            other => panic!("index {index}: {other:?}"),
        }
        assert!(!seen.contains(&token));
        seen.push(token);
        machine.check_invariants();
    }
}

#[test]
fn a_handoff_whose_token_would_overflow_frees_the_key() {
    // Index 2's token is the last one below u64::MAX: index 3's would overflow.
    let mut machine = ShardMachine::new(1, 4);
    let floor = u64::MAX - 11;
    machine.apply(1, &Command::Barrier { floor }, 0);
    let acquire = Command::Acquire {
        key: key("k"),
        owner: 1,
        lease_ms: 10,
    };
    let Applied::Granted { token, .. } = machine.apply(2, &acquire, 0) else {
        panic!("granted");
    };
    assert_eq!(token, u64::MAX - 2);
    let ended = machine.apply(3, &release("k", token, grant(9, 10)), 0);
    assert_eq!(ended, Applied::Released);
    assert!(machine.is_empty());
}

#[test]
fn version_one_commands_still_decode_and_mean_the_same() {
    // Bytes as the first cluster build wrote them (COMMAND_VERSION 1), pinned here.
    let release_v1 = [1, 3, 0, 0, 0, 0, 0, 0, 0, 7, 0, 1, b'k'];
    assert_eq!(
        Command::decode(&release_v1),
        Ok(release("k", 7, None)),
        "a version 1 release"
    );
    let mut expire_v1 = vec![1, 5];
    expire_v1.extend_from_slice(&8u64.to_be_bytes());
    expire_v1.extend_from_slice(&9u64.to_be_bytes());
    expire_v1.extend_from_slice(&[0, 2, b'k', b'2']);
    assert_eq!(Command::decode(&expire_v1), Ok(expire("k2", 8, 9, None)));
    let mut acquire_v1 = vec![1, 2];
    acquire_v1.extend_from_slice(&5u64.to_be_bytes());
    acquire_v1.extend_from_slice(&1_000u32.to_be_bytes());
    acquire_v1.extend_from_slice(&[0, 1, b'k']);
    let acquire = Command::Acquire {
        key: key("k"),
        owner: 5,
        lease_ms: 1_000,
    };
    assert_eq!(Command::decode(&acquire_v1), Ok(acquire.clone()));
    // The forms without a `then` are the same bytes after the version byte.
    for command in [acquire, Command::Barrier { floor: 3 }] {
        let mut v1 = command.encode();
        assert_eq!(v1[0], 2, "the forms of version 2 are still written as 2");
        v1[0] = 1;
        assert_eq!(Command::decode(&v1), Ok(command));
    }
    // Applied, a version 1 release does what it did: it frees the key and grants nothing.
    let (mut machine, token) = held(0, 1);
    let mut bytes = release_v1.to_vec();
    bytes[2..10].copy_from_slice(&token.to_be_bytes());
    let decoded = Command::decode(&bytes).expect("decodes");
    assert_eq!(machine.apply(3, &decoded, 0), Applied::Released);
    assert!(machine.is_empty());
}

#[test]
fn version_two_is_pinned_and_refuses_a_bad_flag() {
    let bytes = release("k", 7, grant(2, 3)).encode();
    let expected = [
        2, 3, 0, 0, 0, 0, 0, 0, 0, 7, 1, 0, 0, 0, 0, 0, 0, 0, 2, 0, 0, 0, 3, 0, 1, b'k',
    ];
    assert_eq!(bytes, expected);
    let none = release("k", 7, None).encode();
    assert_eq!(none, [2, 3, 0, 0, 0, 0, 0, 0, 0, 7, 0, 0, 1, b'k']);
    let mut bad = none.clone();
    bad[10] = 2;
    assert_eq!(Command::decode(&bad), Err(DecodeError::Flag(2)));
    // A version 1 release has no flag: the same bytes read as version 1 are another form.
    let mut old = none;
    old[0] = 1;
    assert!(Command::decode(&old).is_err());
}
