//! What a legitimate leader never sends: invalid entries and snapshots dropped and counted,
//! crafted deep protobuf refused before parsing, and a real member that keeps serving.

use super::*;

/// An envelope of `bytes` for `shard`.
fn envelope(shard: u32, bytes: &[u8]) -> Vec<u8> {
    let mut wire = (4 + bytes.len() as u32).to_be_bytes().to_vec();
    wire.extend_from_slice(&shard.to_be_bytes());
    wire.extend_from_slice(bytes);
    wire
}

/// A hundred thousand nested groups in an unknown field: RUSTSEC-2024-0437's crafted input.
fn nested_groups() -> Vec<u8> {
    let (start, end) = ([0xa3, 0x01], [0xa4, 0x01]); // field 20, wire types 3 and 4
    let mut bytes = start.repeat(100_000);
    bytes.extend_from_slice(&end.repeat(100_000));
    bytes
}

fn encoded(message: &Message) -> Vec<u8> {
    use protobuf::Message as _;
    message.write_to_bytes().expect("encodes")
}

/// Member 3's messages to member 2 that a legitimate leader never sends: a snapshot whose data
/// is garbage, an append whose entry does not decode, an append of a configuration change.
fn invalid_messages() -> Vec<Message> {
    use raft::eraftpb::{ConfState, Entry, EntryType};
    let mut snapshot = message(3, 2, 0, 0);
    snapshot.set_msg_type(MessageType::MsgSnapshot);
    snapshot.set_term(5);
    let data = snapshot.mut_snapshot();
    data.set_data(b"not a shard snapshot".to_vec().into());
    data.mut_metadata().set_index(10);
    data.mut_metadata().set_term(5);
    let voters = ConfState::from((vec![1, 2, 3], vec![]));
    data.mut_metadata().set_conf_state(voters);
    let append = |kind: EntryType, data: &[u8]| {
        let mut append = message(3, 2, 0, 0);
        append.set_msg_type(MessageType::MsgAppend);
        append.set_term(5);
        let mut entry = Entry::default();
        entry.set_entry_type(kind);
        entry.set_index(1);
        entry.set_term(5);
        entry.set_data(data.to_vec().into());
        append.mut_entries().push(entry);
        append.set_commit(1);
        append
    };
    vec![
        snapshot,
        append(EntryType::EntryNormal, &[0xff; 12]),
        append(EntryType::EntryConfChange, &[1, 2]),
    ]
}

#[test]
fn invalid_content_is_dropped_and_counted_and_crafted_deep_protobuf_closes_the_link() {
    invalid_content(Reads::OnThePeerThread);
}

/// The same on a member whose cores read the connections (snapshots are checked on the peer
/// thread there, entries on the core).
#[test]
fn invalid_content_read_on_the_cores_is_dropped_and_counted_and_deep_protobuf_closes_it() {
    invalid_content(Reads::OnTheCores);
}

fn invalid_content(reads: Reads) {
    let all = addresses(3);
    let mut two = start_reading(2, &all, PeerLimits::default(), reads);
    let mut raw = TcpStream::connect(all[1]).expect("connect");
    raw.write_all(&hello(SHARDS, 3)).expect("hello");
    let mut reply = [0u8; REPLY_BYTES];
    raw.read_exact(&mut reply).expect("a reply");
    assert_eq!(reply[5], 0, "accepted");
    let mut wire = Vec::new();
    for invalid in invalid_messages() {
        wire.extend_from_slice(&envelope(1, &encoded(&invalid)));
    }
    wire.extend_from_slice(&envelope(1, &encoded(&message(3, 2, 77, 0))));
    raw.write_all(&wire).expect("write");
    // The invalid ones are dropped and counted; the heartbeat after them on the same
    // connection arrives: the connection stayed.
    let (received, _) = two.receive(1);
    assert_eq!(received.len(), 1);
    assert_eq!(received[0].2.commit, 77);
    // Counted by the thread that checked each (on the cores, the snapshot on the peer thread).
    wait_for("the invalid messages to be counted", || {
        load(&two.stats().drops_invalid) == 3
    });
    assert_eq!(two.handle.report().counters.invalid_dropped, 3);
    assert_eq!(load(&two.stats().refusals), 0);
    // Crafted deep nesting is refused before protobuf parses it: the connection is closed.
    raw.write_all(&envelope(1, &nested_groups()))
        .expect("write");
    let mut after = Vec::new();
    let deadline = Instant::now() + PATIENCE;
    while two
        .readers
        .iter()
        .map(CoreReader::connections)
        .sum::<usize>()
        > 0
    {
        assert!(Instant::now() < deadline, "the core closed the connection");
        two.pump(Duration::from_millis(10), &mut after);
    }
    assert!(closed_by_server(&mut raw), "closed");
    wait_for("the refusal to be counted", || {
        load(&two.stats().refusals) == 1
    });
    after.extend(two.receive_for(Duration::from_millis(100)));
    assert!(after.is_empty());
}

/// A real member keeps serving through what crashed it or forked its replica before: a peer
/// sends it a snapshot whose data is garbage (it panicked restoring it) and an entry that does
/// not decode, committed (it skipped the entry: its state silently apart from the others').
/// Both are dropped before raft takes them, counted in `/stats`, and the member serves on.
#[test]
fn a_real_member_drops_invalid_snapshots_and_entries_and_keeps_serving() {
    use common::cluster::http_get;
    use common::server::{Conn, TempDir};
    use latchkey::config::{ClusterConfig, Config, MemberConfig};
    use latchkey_client::protocol::Response;
    let dir = TempDir::new("peer-invalid");
    let ports = addresses(6);
    let members: Vec<MemberConfig> = (0..3)
        .map(|i| MemberConfig {
            id: i as u64 + 1,
            client: ports[2 * i],
            peer: ports[2 * i + 1],
        })
        .collect();
    let cluster = ClusterConfig {
        node_id: 1,
        data_dir: dir.path().join("data"),
        members,
        shards: 1,
        fsync: false,
        tls: None,
        restore_from: None,
    };
    let identity = cluster.identity().digest;
    let mut config = Config::default();
    config.server.listen = ports[0];
    config.server.cores = 1;
    config.server.cores_explicit = true;
    config.limits.max_keys = 1_000_000;
    config.cluster = Some(cluster);
    let server = latchkey::node::start(config).expect("member 1 starts");
    // The test speaks as member 2 (member 3 never runs).
    let mut raw = TcpStream::connect(ports[1]).expect("member 1's peer port");
    let hello = Hello {
        version: VERSION,
        shards: 1,
        from: 2,
        to: 1,
        identity,
        incarnation: 0x1ca2,
    };
    raw.write_all(&hello.encode()).expect("hello");
    let mut reply = [0u8; REPLY_BYTES];
    raw.read_exact(&mut reply).expect("a reply");
    assert_eq!(reply[5], 0, "accepted");
    let mut wire = Vec::new();
    for mut invalid in invalid_messages() {
        (invalid.from, invalid.to) = (2, 1);
        wire.extend_from_slice(&envelope(0, &encoded(&invalid)));
    }
    raw.write_all(&wire).expect("write");
    let started = Instant::now();
    let invalid = loop {
        let (_, body) = http_get(ports[0], "/stats").expect("/stats");
        let stats: serde_json::Value = serde_json::from_str(&body).expect("JSON");
        let counted = stats["cluster"]["peer_counters"]["invalid_messages"].as_u64();
        if counted == Some(3) || started.elapsed() > PATIENCE {
            break counted;
        }
        thread::sleep(Duration::from_millis(20));
    };
    assert_eq!(invalid, Some(3), "each invalid message counted");
    assert!(!server.failed(), "the member is alive");
    let mut conn = Conn::connect(ports[0]);
    assert_eq!(conn.ping(9), Response::Pong { nonce: 9 });
    server.shutdown();
    server.join().expect("a clean stop");
}
