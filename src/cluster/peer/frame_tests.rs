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

const PEERS: [u64; 2] = [1, 3];

/// Member 2 of a cluster of 64 shards with identity 0xabc, peers 1 and 3.
fn local() -> Local<'static> {
    Local {
        shards: 64,
        node_id: 2,
        identity: 0xabc,
        peers: &PEERS,
    }
}

fn hello_from(from: u64) -> Hello {
    Hello {
        version: VERSION,
        shards: 64,
        from,
        to: 2,
        identity: 0xabc,
        incarnation: 0x1ca0 + from,
    }
}

#[test]
fn hello_round_trips_and_arrives_in_pieces() {
    let hello = hello_from(3);
    let bytes = hello.encode();
    assert_eq!(&bytes[..4], b"LKPR");
    assert_eq!(bytes[4], VERSION);
    assert_eq!(
        (bytes.len(), hello.encoded_len()),
        (HELLO_BYTES, HELLO_BYTES)
    );
    assert_eq!(
        &bytes[33..],
        &0x1ca3u64.to_be_bytes(),
        "the incarnation comes last"
    );
    for cut in 0..HELLO_BYTES {
        assert_eq!(Hello::decode(&bytes[..cut]), Ok(None), "cut {cut}");
    }
    assert_eq!(Hello::decode(&bytes), Ok(Some(hello)));
    assert_eq!(hello.check(&local()), Ok(()));
    // Before version 6 a hello is 8 bytes shorter and carries no incarnation (read as 0); the
    // bytes after it are the connection's first envelope, not read as a part of it.
    let older = Hello {
        version: 5,
        incarnation: 0,
        ..hello
    };
    let mut bytes = older.encode();
    assert_eq!(bytes.len(), HELLO_BYTES_BEFORE_6);
    for cut in 0..HELLO_BYTES_BEFORE_6 {
        assert_eq!(Hello::decode(&bytes[..cut]), Ok(None), "cut {cut}");
    }
    bytes.extend_from_slice(&KEEPALIVE);
    assert_eq!(Hello::decode(&bytes), Ok(Some(older)));
    let written = Hello {
        incarnation: 0x77,
        ..older
    };
    assert_eq!(
        written.encode(),
        older.encode()[..],
        "not sent before version 6"
    );
}

#[test]
fn every_hello_refusal_names_the_reason_and_has_a_verdict() {
    assert_eq!(Hello::decode(b"G"), Err(HelloError::Magic(*b"G\0\0\0")));
    let magic = Hello::decode(b"GET / HTTP/1.1");
    assert_eq!(magic, Err(HelloError::Magic(*b"GET ")));
    assert_eq!(magic.unwrap_err().verdict(), None, "no reply to a stranger");
    let mut version = hello_from(1).encode();
    version[4] = VERSION_MIN - 1;
    let refused = Hello::decode(&version[..5]).unwrap_err();
    assert_eq!(refused, HelloError::Version(VERSION_MIN - 1));
    assert_eq!(refused.verdict(), Some(Verdict::Version));
    let cases = [
        (
            Hello {
                shards: 32,
                ..hello_from(1)
            },
            HelloError::Shards {
                ours: 64,
                theirs: 32,
            },
            Verdict::Shards,
            "peer has 32 shards, this member has 64",
        ),
        (
            hello_from(9),
            HelloError::UnknownNode(9),
            Verdict::UnknownNode,
            "node id 9",
        ),
        (
            hello_from(2),
            HelloError::UnknownNode(2),
            Verdict::UnknownNode,
            "not a peer",
        ),
        (
            Hello {
                to: 3,
                ..hello_from(1)
            },
            HelloError::WrongMember {
                from: 1,
                to: 3,
                reached: 2,
            },
            Verdict::WrongMember,
            "node 1 dialed node 3 but reached node 2: member 1's peer address for 3 is wrong",
        ),
        (
            Hello {
                identity: 0xdef,
                ..hello_from(3)
            },
            HelloError::Identity {
                from: 3,
                ours: 0xabc,
                theirs: 0xdef,
            },
            Verdict::Identity,
            "cluster identity differs: node 3",
        ),
    ];
    let incarnation = HelloError::Incarnation {
        from: 3,
        known: 0xaa,
        theirs: 0x1ca3,
    };
    assert_eq!(incarnation.verdict(), Some(Verdict::Incarnation));
    let text = incarnation.to_string();
    assert!(
        text.contains(
            "node 3 says hello from data-directory incarnation 0000000000001ca3, this \
             member knew it as 00000000000000aa: its data_dir was lost or replaced"
        ),
        "{text}"
    );
    for (hello, error, verdict, text) in cases {
        let decoded = Hello::decode(&hello.encode())
            .expect("well formed")
            .expect("whole");
        assert_eq!(decoded.check(&local()), Err(error), "{hello:?}");
        assert_eq!(error.verdict(), Some(verdict));
        assert!(error.to_string().contains(text), "{error} lacks {text:?}");
    }
}

/// The reply member 2 sends with `verdict`.
fn reply(verdict: Verdict) -> Reply {
    Reply {
        version: VERSION,
        verdict,
        shards: 64,
        node_id: 2,
        identity: 0xabc,
    }
}

#[test]
fn replies_round_trip_split_anywhere_and_say_why_on_the_dialer_side() {
    let accepted = reply(Verdict::Accepted);
    let bytes = accepted.encode();
    for cut in 0..REPLY_BYTES {
        assert_eq!(Reply::decode(&bytes[..cut]), Ok(None), "cut {cut}");
    }
    assert_eq!(Reply::decode(&bytes), Ok(Some(accepted)));
    // Member 1 dialed member 2: accepted.
    let hello = Hello {
        from: 1,
        ..hello_from(1)
    };
    assert_eq!(accepted.refusal(&hello), None);
    let cases = [
        (reply(Verdict::Shards), "it has 64 shards"),
        (
            reply(Verdict::UnknownNode),
            "this member's id 1 is not in node 2's members list",
        ),
        (reply(Verdict::Identity), "cluster identity differs"),
        (reply(Verdict::Version), "wire version"),
        (
            reply(Verdict::Incarnation),
            "node 2 knew this member by another data directory than this one (incarnation \
             0000000000001ca1)",
        ),
    ];
    for (refusal, text) in cases {
        let decoded = Reply::decode(&refusal.encode())
            .expect("valid")
            .expect("whole");
        let why = decoded.refusal(&hello).expect("refused");
        assert!(why.contains(text), "{why} lacks {text:?}");
    }
    // Member 1 meant to reach member 5 and reached member 2, which said so (or, hostile or
    // confused, accepted): the dialer says which address is wrong either way.
    let wrong = Hello { to: 5, ..hello };
    for verdict in [Verdict::WrongMember, Verdict::Accepted] {
        let why = reply(verdict).refusal(&wrong).expect("refused");
        let expected = "node 1 dialed node 5 but reached node 2: member 1's peer address for 5";
        assert!(why.contains(expected), "{why}");
    }
    // An accepting reply with another identity is refused by the dialer.
    let other = Reply {
        identity: 0x1,
        ..accepted
    };
    assert!(other
        .refusal(&hello)
        .expect("refused")
        .contains("identity differs"));
    // Malformed replies.
    assert_eq!(Reply::decode(b"HTTP/1.1"), Err(ReplyError::Magic(*b"HTTP")));
    let mut version = bytes;
    version[4] = 1;
    assert_eq!(Reply::decode(&version), Err(ReplyError::Version(1)));
    let mut verdict = bytes;
    verdict[5] = 77;
    assert_eq!(Reply::decode(&verdict), Err(ReplyError::Verdict(77)));
}

#[test]
fn hellos_of_versions_3_to_6_are_accepted_and_say_which_others_are_refused_at_once() {
    assert_eq!((VERSION_MIN, VERSION), (3, 6), "this build speaks 3 to 6");
    for version in [3, 4, 5, 6] {
        let incarnation = if version < 6 { 0 } else { 0x1ca3 };
        let hello = Hello {
            version,
            incarnation,
            ..hello_from(3)
        };
        let bytes = hello.encode();
        assert_eq!(bytes[4], version, "the hello is in its version");
        let decoded = Hello::decode(&bytes).expect("spoken").expect("whole");
        assert_eq!(decoded.version, version, "the caller learns the version");
        assert_eq!(decoded, hello);
        assert_eq!(decoded.check(&local()), Ok(()));
        assert!(speaks(version));
    }
    for version in [0, 1, 2, 7, u8::MAX] {
        let mut bytes = hello_from(3).encode();
        bytes[4] = version;
        // Refused as soon as the version byte is there.
        let refused = Hello::decode(&bytes[..5]).unwrap_err();
        assert_eq!(refused, HelloError::Version(version));
        assert_eq!(refused.verdict(), Some(Verdict::Version));
        let text = refused.to_string();
        assert!(text.contains("this member speaks 3 to 6"), "{text}");
        assert!(!speaks(version));
    }
}

#[test]
fn replies_are_in_the_hellos_version_and_a_version_refusal_naming_another_is_a_fallback() {
    let hello_in = |version: u8| Hello {
        version,
        from: 1,
        ..hello_from(1)
    };
    let reply_in = |version: u8, verdict: Verdict| Reply {
        version,
        ..reply(verdict)
    };
    for version in [3, 4, 5, 6] {
        let accepted = reply_in(version, Verdict::Accepted);
        let bytes = accepted.encode();
        assert_eq!(bytes[4], version, "the reply is in its version");
        assert_eq!(Reply::decode(&bytes), Ok(Some(accepted)));
        assert_eq!(
            accepted.refusal(&hello_in(version)),
            None,
            "accepted in {version}"
        );
        assert_eq!(accepted.fallback(&hello_in(version)), None);
    }
    // An accepting reply in another version than the hello's is refused by the dialer.
    let other = reply_in(3, Verdict::Accepted).refusal(&hello_in(4));
    let why = other.expect("refused");
    assert!(
        why.contains("replied in peer wire version 3 to a hello in version 4"),
        "{why}"
    );
    let other = reply_in(4, Verdict::Identity).refusal(&hello_in(3));
    assert!(other
        .expect("refused")
        .contains("replied in peer wire version 4"));
    // A reader of the previous build refuses 4 naming its 3: the dialer falls back to 3. A
    // reader refusing 3 naming 4 (upgraded, or a build past 3) moves the dialer up again.
    let old = reply_in(3, Verdict::Version);
    assert_eq!(old.fallback(&hello_in(4)), Some(3));
    let why = old.refusal(&hello_in(4)).expect("a refusal all the same");
    assert!(
        why.contains("does not speak peer wire version 4 (it speaks 3)"),
        "{why}"
    );
    assert_eq!(
        reply_in(4, Verdict::Version).fallback(&hello_in(3)),
        Some(4)
    );
    // A reader of the build before this one speaks 3 and 4: it refuses 5 naming its 4.
    assert_eq!(
        reply_in(4, Verdict::Version).fallback(&hello_in(5)),
        Some(4)
    );
    // Refused in the version it named itself: nothing to fall back to.
    assert_eq!(reply_in(4, Verdict::Version).fallback(&hello_in(4)), None);
    assert_eq!(
        reply_in(3, Verdict::Shards).fallback(&hello_in(4)),
        None,
        "not a version"
    );
    // Replies in versions this build does not speak are refused as they arrive.
    for version in [0, 2, 7, u8::MAX] {
        let mut bytes = reply_in(4, Verdict::Version).encode();
        bytes[4] = version;
        assert_eq!(
            Reply::decode(&bytes[..5]),
            Err(ReplyError::Version(version))
        );
        let unspoken = Reply {
            version,
            ..reply(Verdict::Version)
        };
        assert_eq!(
            unspoken.fallback(&hello_in(4)),
            None,
            "{version} is not spoken"
        );
    }
}

#[test]
fn a_keepalive_is_an_envelope_for_no_shard() {
    let (envelope, used) = decode(&KEEPALIVE).expect("valid").expect("whole");
    assert!(envelope.is_keepalive());
    assert_eq!(used, KEEPALIVE.len());
    let not = Envelope {
        shard: KEEPALIVE_SHARD,
        message: &[1],
    };
    assert!(!not.is_keepalive(), "a keepalive carries nothing");
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

/// Feeds bytes to the reader's steps (hello, then envelopes, then the shape check, protobuf
/// and the content check) as a reader would.
fn read_all(bytes: &[u8]) {
    let after_hello = match Hello::decode(bytes) {
        Ok(Some(hello)) => {
            let _ = hello.check(&local());
            &bytes[hello.encoded_len()..]
        }
        Ok(None) | Err(_) => bytes,
    };
    let _ = Reply::decode(bytes);
    let mut at = 0;
    while let Ok(Some((envelope, used))) = decode(&after_hello[at..]) {
        assert!(used >= HEADER_BYTES && at + used <= after_hello.len());
        if super::super::wire::check(envelope.message).is_ok() {
            if let Ok(message) = Message::parse_from_bytes(envelope.message) {
                let _ = super::super::content::check(envelope.shard % 64, 64, &message);
            }
        }
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
            let mut wire = hello_from(1).encode().to_vec();
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

/// The first bytes of a TLS record where a hello or a reply was expected say that the members
/// disagree about `[cluster.tls]`; other bytes are "not a latchkey peer" as before.
#[test]
fn a_tls_record_instead_of_a_hello_or_a_reply_says_so() {
    let client_hello = [0x16, 0x03, 0x01, 0x00, 0xf4];
    let error = Hello::decode(&client_hello).unwrap_err();
    assert!(error.is_tls());
    assert!(
        error.to_string().contains("the dialer has [cluster.tls]"),
        "{error}"
    );
    let alert = [0x15, 0x03, 0x03, 0x00, 0x02, 0x02, 0x32];
    let error = Reply::decode(&alert).unwrap_err().to_string();
    assert!(
        error.contains("it has [cluster.tls], this member has not"),
        "{error}"
    );
    let garbage = Hello::decode(b"GET / HTTP/1.1").unwrap_err();
    assert!(!garbage.is_tls());
    assert!(
        garbage.to_string().contains("not a latchkey peer"),
        "{garbage}"
    );
}
