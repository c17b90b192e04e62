//! Codec tests: round trips, every refusal, split input, and arbitrary bytes never panicking.

use super::*;
use proptest::prelude::*;
use proptest::test_runner::{Config, RngAlgorithm, TestRng, TestRunner};
use protobuf::Message as _;
use raft::eraftpb::{Entry, MessageType};

fn message(index: u64, payload: usize) -> Message {
    let mut message = Message::default();
    message.set_msg_type(MessageType::MsgAppend);
    message.set_to(2);
    message.set_from(1);
    message.set_term(7);
    message.set_index(index);
    let mut entry = Entry::default();
    entry.set_index(index + 1);
    entry.set_data(vec![0xab; payload].into());
    message.mut_entries().push(entry);
    message
}

#[test]
fn hello_round_trips_and_arrives_in_pieces() {
    let hello = Hello {
        shards: 64,
        node_id: 3,
    };
    let bytes = hello.encode();
    assert_eq!(&bytes[..4], b"LKPR");
    for cut in 0..HELLO_BYTES {
        assert_eq!(
            Hello::decode(&bytes[..cut], 64, |id| id == 3),
            Ok(None),
            "cut {cut}"
        );
    }
    assert_eq!(Hello::decode(&bytes, 64, |id| id == 3), Ok(Some(hello)));
}

#[test]
fn hello_refusals_name_the_reason() {
    let bytes = Hello {
        shards: 64,
        node_id: 9,
    }
    .encode();
    assert_eq!(
        Hello::decode(b"G", 64, |_| true),
        Err(HelloError::Magic(*b"G\0\0\0"))
    );
    assert_eq!(
        Hello::decode(b"GET / HTTP/1.1", 64, |_| true),
        Err(HelloError::Magic(*b"GET "))
    );
    let mut version = bytes;
    version[4] = 2;
    assert_eq!(
        Hello::decode(&version[..5], 64, |_| true),
        Err(HelloError::Version(2))
    );
    let shards = Hello::decode(&bytes, 32, |_| true);
    assert_eq!(
        shards,
        Err(HelloError::Shards {
            ours: 32,
            theirs: 64
        })
    );
    assert_eq!(
        Hello::decode(&bytes, 64, |id| id != 9),
        Err(HelloError::UnknownNode(9))
    );
    let text = HelloError::Shards {
        ours: 32,
        theirs: 64,
    }
    .to_string();
    assert!(text.contains("64 shards") && text.contains("32"), "{text}");
}

#[test]
fn envelopes_round_trip_back_to_back_and_split_anywhere() {
    let messages = [message(1, 0), message(2, 300), message(3, 5)];
    let mut wire = Vec::new();
    for (shard, message) in messages.iter().enumerate() {
        let len = encode(shard as u32, message, &mut wire).expect("encodes");
        assert_eq!(len, encoded_len(message).expect("fits"));
    }
    let mut at = 0;
    for (shard, expected) in messages.iter().enumerate() {
        let (envelope, used) = decode(&wire[at..]).expect("valid").expect("complete");
        assert_eq!(envelope.shard, shard as u32);
        assert_eq!(
            &Message::parse_from_bytes(envelope.message).expect("parses"),
            expected
        );
        for cut in 0..used {
            assert_eq!(decode(&wire[at..at + cut]), Ok(None), "cut {cut}");
        }
        at += used;
    }
    assert_eq!(at, wire.len());
}

#[test]
fn lengths_are_checked_before_anything_else() {
    let too_large = (FRAME_BYTES_MAX as u32 + 1).to_be_bytes();
    assert_eq!(
        decode(&too_large),
        Err(FrameError::TooLarge(FRAME_BYTES_MAX as u32 + 1))
    );
    assert_eq!(
        decode(&u32::MAX.to_be_bytes()),
        Err(FrameError::TooLarge(u32::MAX))
    );
    assert_eq!(decode(&3u32.to_be_bytes()), Err(FrameError::TooShort(3)));
    assert_eq!(decode(&0u32.to_be_bytes()), Err(FrameError::TooShort(0)));
    // The largest length is accepted, and incomplete until every byte is there.
    let largest = (FRAME_BYTES_MAX as u32).to_be_bytes();
    assert_eq!(announced_len(&largest), Ok(Some(FRAME_BYTES_MAX)));
    assert_eq!(decode(&largest), Ok(None));
    // An empty message (len 4) is a valid envelope.
    let empty = [0, 0, 0, 4, 0, 0, 0, 9];
    let decoded = decode(&empty).expect("valid").expect("complete");
    assert_eq!(
        decoded,
        (
            Envelope {
                shard: 9,
                message: &[]
            },
            8
        )
    );
}

#[test]
fn an_oversized_message_is_refused_and_nothing_is_appended() {
    let big = message(1, FRAME_BYTES_MAX);
    let mut wire = vec![1, 2, 3];
    let refused = encode(0, &big, &mut wire);
    assert!(matches!(refused, Err(EncodeError::TooLarge(len)) if len > FRAME_BYTES_MAX));
    assert_eq!(wire, [1, 2, 3]);
}

/// A runner with a fixed, printed seed: the same cases on every run.
fn seeded_runner(cases: u32) -> TestRunner {
    const SEED: [u8; 32] = *b"latchkey peer frame codec seed!!";
    println!("proptest seed: {SEED:?}");
    TestRunner::new_with_rng(
        Config::with_cases(cases),
        TestRng::from_seed(RngAlgorithm::ChaCha, &SEED),
    )
}

/// Feeds bytes to the reader's steps (hello, then envelopes, then protobuf) as a reader would.
fn read_all(bytes: &[u8]) {
    let after_hello = match Hello::decode(bytes, 64, |_| true) {
        Ok(Some(_)) => &bytes[HELLO_BYTES..],
        Ok(None) | Err(_) => bytes,
    };
    let mut at = 0;
    while let Ok(Some((envelope, used))) = decode(&after_hello[at..]) {
        assert!(used >= HEADER_BYTES && at + used <= after_hello.len());
        let _ = Message::parse_from_bytes(envelope.message);
        at += used;
    }
}

#[test]
fn arbitrary_bytes_never_panic() {
    let mut runner = seeded_runner(2048);
    let strategy = prop::collection::vec(any::<u8>(), 0..512);
    runner
        .run(&strategy, |bytes| {
            read_all(&bytes);
            Ok(())
        })
        .expect("never panics");
}

#[test]
fn valid_envelopes_with_arbitrary_message_bytes_never_panic() {
    let mut runner = seeded_runner(2048);
    let strategy = (any::<u32>(), prop::collection::vec(any::<u8>(), 0..256));
    runner
        .run(&strategy, |(shard, payload)| {
            let mut wire = Hello {
                shards: 64,
                node_id: 1,
            }
            .encode()
            .to_vec();
            wire.extend_from_slice(&(4 + payload.len() as u32).to_be_bytes());
            wire.extend_from_slice(&shard.to_be_bytes());
            wire.extend_from_slice(&payload);
            let (envelope, used) = decode(&wire[HELLO_BYTES..]).expect("valid").expect("whole");
            prop_assert_eq!(envelope.shard, shard);
            prop_assert_eq!(used, wire.len() - HELLO_BYTES);
            read_all(&wire);
            Ok(())
        })
        .expect("never panics");
}
