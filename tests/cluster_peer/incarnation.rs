//! A member started again on another data directory (a new incarnation) is refused by a peer
//! that knew the old one, on both sides' status and counters, across that peer's restart; its
//! messages never arrive; the old directory back, it is accepted again. A hello of a version
//! before 6 (no incarnation) is accepted as before.

use super::*;
use latchkey::cluster::peer::frame::VERSION_INCARNATION;
use std::path::PathBuf;

/// A fresh directory for member 2's peers file, removed on drop.
struct TempDir(PathBuf);

impl TempDir {
    fn new(name: &str) -> TempDir {
        let path = std::env::temp_dir().join(format!(
            "latchkey-peer-incarnation-{name}-{}",
            std::process::id()
        ));
        let _ = std::fs::remove_dir_all(&path);
        std::fs::create_dir_all(&path).expect("temp dir");
        TempDir(path)
    }

    fn peers_file(&self) -> PathBuf {
        self.0.join("peers.toml")
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// Member `node_id` of the members at `all`, its data directory's `incarnation`, keeping what
/// its peers said in `peers_file` (or in memory).
fn start_incarnation(
    node_id: u64,
    all: &[SocketAddr],
    incarnation: u64,
    peers_file: Option<PathBuf>,
) -> Member {
    let config = PeerConfig {
        incarnation,
        peers_file,
        ..config_among(node_id, all)
    };
    spawn_member(config, Reads::OnThePeerThread)
}

const FIRST: u64 = 0x0123_4567_89ab_cdef;
const SECOND: u64 = 0x0fed_cba9_8765_4321;

#[test]
fn a_member_on_another_data_directory_is_refused_by_a_peer_that_knew_the_old_one() {
    let dir = TempDir::new("refused");
    let all = addresses(2);
    let mut two = start_incarnation(2, &all, 0x2222, Some(dir.peers_file()));
    let mut one = start_incarnation(1, &all, FIRST, None);
    send_numbered(&one, 1, 2, 0..5);
    assert_eq!(
        two.receive(5).0.len(),
        5,
        "the first incarnation is accepted"
    );
    let kept = std::fs::read_to_string(dir.peers_file()).expect("member 2 recorded it");
    assert!(kept.contains("1 = \"0123456789abcdef\""), "{kept}");
    wait_for("member 2 to show it", || {
        view(&two, 1).incarnation == Some(FIRST)
    });
    assert_eq!(two.handle.report().incarnation, 0x2222, "its own");

    // Member 1 comes back on an empty data directory: a new incarnation.
    one.stop();
    let one = start_incarnation(1, &all, SECOND, None);
    wait_for("member 1 to see itself refused", || {
        view(&one, 2).link == LinkState::Refused
    });
    let reason = view(&one, 2).reason;
    assert!(
        reason.contains("knew this member by another data directory than this one")
            && reason.contains("0fedcba987654321")
            && reason.contains("may not rejoin as node 1"),
        "{reason}"
    );
    assert!(load(&one.stats().refused_by_peers) >= 1);
    wait_for("member 2 to report the refusal", || {
        view(&two, 1).refused_inbound.is_some()
    });
    let refused = view(&two, 1).refused_inbound.expect("refused");
    assert!(
        refused.contains("incarnation 0fedcba987654321, this member knew it as 0123456789abcdef"),
        "{refused}"
    );
    assert!(load(&two.stats().refusals) >= 1);
    assert_eq!(view(&two, 1).incarnation, Some(FIRST), "still the first");
    send_numbered(&one, 1, 2, 5..10);
    assert!(
        two.receive_for(Duration::from_millis(500)).is_empty(),
        "nothing of the new incarnation arrives"
    );

    // Member 2 restarted remembers it.
    two.stop();
    let mut two = start_incarnation(2, &all, 0x2222, Some(dir.peers_file()));
    wait_for("member 2, restarted, to refuse it again", || {
        view(&two, 1).refused_inbound.is_some()
    });
    assert!(two.receive_for(Duration::from_millis(300)).is_empty());

    // The old data directory back (the disk was only unplugged): accepted.
    drop(one);
    let one = start_incarnation(1, &all, FIRST, None);
    send_numbered(&one, 1, 2, 10..15);
    let numbers: HashSet<u64> = (two.receive(5).0.iter())
        .map(|(_, _, m)| m.commit)
        .collect();
    assert_eq!(numbers, (10..15).collect());
    wait_for("member 1 to be connected", || {
        view(&one, 2).link == LinkState::Connected
    });
}

/// A hello before version 6 carries no incarnation: accepted (a member rolled back to an older
/// build), and nothing is recorded for it.
#[test]
fn a_hello_before_version_6_is_accepted_without_an_incarnation() {
    assert_eq!(VERSION_INCARNATION, 6);
    let dir = TempDir::new("older");
    let all = addresses(3); // member 3 is played by raw connections
    let mut two = start_incarnation(2, &all, 0x2222, Some(dir.peers_file()));
    let mut five = hello(SHARDS, 3);
    five[4] = 5;
    five.truncate(latchkey::cluster::peer::frame::HELLO_BYTES_BEFORE_6);
    let mut stream = TcpStream::connect(all[1]).expect("connect");
    stream.write_all(&five).expect("the hello");
    let mut reply = [0u8; REPLY_BYTES];
    stream.read_exact(&mut reply).expect("the reply");
    assert_eq!((reply[4], reply[5]), (5, 0), "accepted, in 5");
    stream.write_all(&from_three(0..3)).expect("write");
    assert_eq!(two.receive(3).0.len(), 3);
    assert!(
        !dir.peers_file().exists(),
        "no incarnation, nothing recorded"
    );
    // In 6 with an incarnation: recorded; another one after it is refused with verdict 6.
    let (_kept, reply) = version::say_hello(all[1], &hello(SHARDS, 3));
    assert_eq!((reply[4], reply[5]), (VERSION, 0));
    let mut other = hello(SHARDS, 3);
    other[33..].copy_from_slice(&SECOND.to_be_bytes());
    let (mut refused, reply) = version::say_hello(all[1], &other);
    assert_eq!(
        (reply[4], reply[5]),
        (VERSION, 6),
        "refused: another incarnation"
    );
    assert!(closed_by_server(&mut refused));
}
