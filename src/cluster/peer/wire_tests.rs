//! The shape check: every message raft builds passes; groups, bad wire types, truncation and
//! crafted deep nesting are refused or passed as opaque bytes, without recursion (proved on a
//! thread with a small stack).

use super::*;
use proptest::prelude::*;
use proptest::test_runner::{Config, RngAlgorithm, TestRng, TestRunner};
use protobuf::Message as _;
use raft::eraftpb::{ConfState, Entry, EntryType, Message, MessageType, Snapshot};

fn varint_into(mut value: u64, out: &mut Vec<u8>) {
    while value >= 0x80 {
        out.push(value as u8 | 0x80);
        value >>= 7;
    }
    out.push(value as u8);
}

fn tag(field: u64, wire_type: u64, out: &mut Vec<u8>) {
    varint_into(field << 3 | wire_type, out);
}

/// A snapshot message with every nested level of raft's schema filled in.
fn snapshot_message() -> Message {
    let mut message = Message::default();
    message.set_msg_type(MessageType::MsgSnapshot);
    message.set_from(1);
    message.set_to(2);
    message.set_term(3);
    let mut snapshot = Snapshot::default();
    snapshot.set_data(vec![7; 100].into());
    let metadata = snapshot.mut_metadata();
    metadata.set_index(40);
    metadata.set_term(3);
    metadata.set_conf_state(ConfState::from((vec![1, 2, 3], vec![])));
    message.set_snapshot(snapshot);
    message
}

fn append_message(entries: usize) -> Message {
    let mut message = Message::default();
    message.set_msg_type(MessageType::MsgAppend);
    message.set_from(1);
    message.set_to(2);
    message.set_index(9);
    message.set_log_term(2);
    message.set_commit(8);
    message.set_context(b"ctx".to_vec().into());
    for i in 0..entries {
        let mut entry = Entry::default();
        entry.set_entry_type(EntryType::EntryNormal);
        entry.set_index(10 + i as u64);
        entry.set_term(2);
        entry.set_data(vec![i as u8; i * 3].into());
        message.mut_entries().push(entry);
    }
    message
}

#[test]
fn messages_raft_builds_pass() {
    for message in [Message::default(), snapshot_message(), append_message(5)] {
        let bytes = message.write_to_bytes().expect("encodes");
        assert_eq!(check(&bytes), Ok(()), "{message:?}");
    }
    // The snapshot message needs all four levels; three are not enough.
    let bytes = snapshot_message().write_to_bytes().expect("encodes");
    assert_eq!(check_within(&bytes, 3), Err(WireError::TooDeep));
    assert_eq!(check_within(&bytes, 4), Ok(()));
}

#[test]
fn groups_bad_wire_types_field_numbers_and_truncation_are_refused() {
    let mut group = Vec::new();
    tag(20, 3, &mut group); // a start group in an unknown field: protobuf would skip it
    tag(20, 4, &mut group);
    assert_eq!(check(&group), Err(WireError::Group { field: 20 }));
    let mut end_group = Vec::new();
    tag(5, 4, &mut end_group);
    assert_eq!(check(&end_group), Err(WireError::Group { field: 5 }));
    let mut wire_type = Vec::new();
    tag(2, 6, &mut wire_type);
    let refused = WireError::WireType {
        field: 2,
        wire_type: 6,
    };
    assert_eq!(check(&wire_type), Err(refused));
    assert_eq!(check(&[0x00, 0x01]), Err(WireError::FieldNumber(0)));
    assert_eq!(
        check(&[0x10]),
        Err(WireError::Truncated(1)),
        "a varint field without value"
    );
    assert_eq!(check(&[0x10, 0x80]), Err(WireError::Truncated(1)));
    let too_long = [
        0x10, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0x01,
    ];
    assert_eq!(check(&too_long), Err(WireError::VarintTooLong(1)));
    assert_eq!(
        check(&[0x62, 0x05, 1, 2]),
        Err(WireError::Truncated(2)),
        "bytes past the end"
    );
    assert_eq!(
        check(&[0x11, 1, 2, 3]),
        Err(WireError::Truncated(1)),
        "a short fixed64"
    );
    // A group inside an entry is found too: every level of the schema is walked.
    let mut entry = append_message(1).get_entries()[0]
        .write_to_bytes()
        .expect("encodes");
    tag(31, 3, &mut entry);
    tag(31, 4, &mut entry);
    let mut crafted = append_message(0).write_to_bytes().expect("encodes");
    tag(7, 2, &mut crafted);
    varint_into(entry.len() as u64, &mut crafted);
    crafted.extend_from_slice(&entry);
    assert_eq!(check(&crafted), Err(WireError::Group { field: 31 }));
}

/// `levels` start-group tags then as many end-group tags in unknown field 20.
fn nested_groups(levels: usize) -> Vec<u8> {
    let mut bytes = Vec::with_capacity(levels * 4);
    for _ in 0..levels {
        tag(20, 3, &mut bytes);
    }
    for _ in 0..levels {
        tag(20, 4, &mut bytes);
    }
    bytes
}

/// `levels` length-delimited fields each holding the next, in unknown field 20 of a message:
/// the shape of a deeply nested message, which no field of raft's schema can carry.
fn nested_lengths(levels: usize) -> Vec<u8> {
    // Lengths from the innermost field out, then the tags and lengths from the outermost in.
    let mut lengths = Vec::with_capacity(levels);
    let mut inner = 0u64;
    for _ in 0..levels {
        lengths.push(inner);
        let mut header = Vec::new();
        tag(20, 2, &mut header);
        varint_into(inner, &mut header);
        inner += header.len() as u64;
    }
    let mut bytes = Vec::with_capacity(inner as usize);
    for &length in lengths.iter().rev() {
        tag(20, 2, &mut bytes);
        varint_into(length, &mut bytes);
    }
    bytes
}

/// RUSTSEC-2024-0437's crafted input, a hundred thousand nested groups, and a hundred thousand
/// nested messages, on a thread with a 64 KiB stack: the check refuses the groups and passes
/// the nested lengths as opaque bytes, which protobuf then stores without descending; neither
/// overflows the stack (a recursion per level would need megabytes).
#[test]
fn crafted_deep_nesting_is_refused_or_opaque_without_a_stack_overflow() {
    let worker = std::thread::Builder::new()
        .stack_size(64 << 10)
        .spawn(|| {
            let groups = nested_groups(100_000);
            assert_eq!(check(&groups), Err(WireError::Group { field: 20 }));
            let mut in_snapshot = snapshot_message().write_to_bytes().expect("encodes");
            let crafted = nested_groups(100_000);
            let mut snapshot = Vec::new();
            tag(9, 2, &mut snapshot);
            varint_into(crafted.len() as u64, &mut snapshot);
            snapshot.extend_from_slice(&crafted);
            in_snapshot.extend_from_slice(&snapshot);
            assert_eq!(check(&in_snapshot), Err(WireError::Group { field: 20 }));
            let lengths = nested_lengths(100_000);
            assert_eq!(check(&lengths), Ok(()));
            let parsed = Message::parse_from_bytes(&lengths).expect("an unknown field, kept");
            assert_eq!(parsed.get_unknown_fields().iter().count(), 1);
        })
        .expect("spawn a small-stack thread");
    worker.join().expect("no stack overflow, no panic");
}

/// A runner with a fixed, printed seed: the same cases on every run.
fn seeded_runner(cases: u32) -> TestRunner {
    const SEED: [u8; 32] = *b"latchkey peer wire shape check!!";
    println!("proptest seed: {SEED:?}");
    TestRunner::new_with_rng(
        Config::with_cases(cases),
        TestRng::from_seed(RngAlgorithm::ChaCha, &SEED),
    )
}

#[test]
fn arbitrary_bytes_never_panic_the_check_or_the_parse_after_it() {
    let mut runner = seeded_runner(4096);
    let strategy = prop::collection::vec(any::<u8>(), 0..256);
    runner
        .run(&strategy, |bytes| {
            if check(&bytes).is_ok() {
                // What passes, protobuf parses or refuses without a group or deep recursion.
                let _ = Message::parse_from_bytes(&bytes);
            }
            Ok(())
        })
        .expect("never panics");
}

#[test]
fn arbitrary_append_messages_pass() {
    let mut runner = seeded_runner(512);
    let strategy = (
        0usize..8,
        any::<u64>(),
        prop::collection::vec(any::<u8>(), 0..64),
    );
    runner
        .run(&strategy, |(entries, commit, context)| {
            let mut message = append_message(entries);
            message.set_commit(commit);
            message.set_context(context.into());
            let bytes = message.write_to_bytes().expect("encodes");
            prop_assert_eq!(check(&bytes), Ok(()));
            Ok(())
        })
        .expect("every message raft builds passes");
}
