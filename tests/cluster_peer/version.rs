//! Members of several builds form a group: a member of this build dials a reader of an earlier
//! build (one that speaks peer wire version 3 alone, or 3 and 4) in its newest after its
//! refusal, and in this build's newest again once it was upgraded; a dialer of the earliest is
//! answered in 3; every member knows the cluster version, the lowest any member was last heard
//! in (3 until every member was heard from).

use super::*;
use latchkey::cluster::peer::frame::{hello_bytes, HELLO_BYTES_BEFORE_6, VERSION_MIN};
use std::sync::atomic::AtomicBool;
use std::sync::Mutex;

/// The peer wire version member `member` last heard peer `peer` in.
fn version_of(member: &Member, peer: u64) -> u8 {
    let report = member.handle.report();
    let found = report.peers.iter().find(|status| status.node_id == peer);
    found.expect("a peer of the member").version
}

/// A reply as a member of an earlier build writes it, in `version`; `verdict` 0 accepts, 1
/// refuses the version.
fn old_reply(verdict: u8, node_id: u64, version: u8) -> [u8; REPLY_BYTES] {
    let mut bytes = [0u8; REPLY_BYTES];
    bytes[..4].copy_from_slice(b"LKPR");
    bytes[4] = version;
    bytes[5] = verdict;
    bytes[6..10].copy_from_slice(&SHARDS.to_be_bytes());
    bytes[10..18].copy_from_slice(&node_id.to_be_bytes());
    bytes[18..].copy_from_slice(&IDENTITY.to_be_bytes());
    bytes
}

/// A reader of an earlier build playing member `node_id` on a thread: it accepts a hello of
/// version 3 to its `newest` (3: the build before peer versions were negotiated; 4: the build
/// before replicated fates), replying in the hello's version, and refuses any other with a
/// version reply carrying its newest, then closing; it keeps the version of every hello it read
/// and the numbers (`commit`) of the messages delivered to it.
struct OldReader {
    hellos: Arc<Mutex<Vec<u8>>>,
    numbers: Receiver<u64>,
    stop: Arc<AtomicBool>,
    join: Option<JoinHandle<()>>,
}

impl OldReader {
    fn start(listener: TcpListener, node_id: u64, newest: u8) -> OldReader {
        let hellos = Arc::new(Mutex::new(Vec::new()));
        let stop = Arc::new(AtomicBool::new(false));
        let (sender, numbers) = crossbeam_channel::unbounded();
        let (seen, stopping) = (Arc::clone(&hellos), Arc::clone(&stop));
        listener.set_nonblocking(true).expect("non-blocking");
        let join = thread::spawn(move || {
            while !stopping.load(Ordering::Relaxed) {
                let stream = match listener.accept() {
                    Ok((stream, _)) => stream,
                    Err(_) => {
                        thread::sleep(Duration::from_millis(5));
                        continue;
                    }
                };
                serve_old(stream, (node_id, newest), (&seen, &sender), &stopping);
            }
        });
        OldReader {
            hellos,
            numbers,
            stop,
            join: Some(join),
        }
    }

    /// The versions of the hellos it read, in order.
    fn hellos(&self) -> Vec<u8> {
        self.hellos.lock().expect("not poisoned").clone()
    }

    /// Waits until `count` messages arrived; their numbers.
    fn receive(&self, count: usize) -> HashSet<u64> {
        let deadline = Instant::now() + PATIENCE;
        let mut numbers = HashSet::new();
        while numbers.len() < count && Instant::now() < deadline {
            if let Ok(number) = self.numbers.recv_timeout(Duration::from_millis(20)) {
                numbers.insert(number);
            }
        }
        numbers
    }

    /// Stops its thread and closes its listener and connection (its address is free after).
    fn stop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(join) = self.join.take() {
            join.join().expect("the old reader's thread");
        }
    }
}

impl Drop for OldReader {
    fn drop(&mut self) {
        self.stop();
    }
}

/// One connection to the old reader: its hello read whole (as the old build reads what has
/// arrived), refused unless in version 3 to `newest`, then envelopes read until the dialer
/// closes it or the reader stops.
fn serve_old(
    mut stream: TcpStream,
    (node_id, newest): (u64, u8),
    (hellos, numbers): (&Mutex<Vec<u8>>, &crossbeam_channel::Sender<u64>),
    stop: &AtomicBool,
) {
    stream.set_nonblocking(false).expect("blocking");
    stream
        .set_read_timeout(Some(Duration::from_millis(50)))
        .expect("timeout");
    // Every build before 6 reads a hello of this size; a newer one is longer, and the old
    // build's read takes its rest with it (it reads what has arrived), so none is left unread
    // at the close (which would reset the connection before the dialer read the reply).
    let mut hello = [0u8; HELLO_BYTES_BEFORE_6];
    if stream.read_exact(&mut hello).is_err() {
        return;
    }
    assert_eq!(&hello[..4], b"LKPR", "a latchkey hello");
    let mut rest = vec![0u8; hello_bytes(hello[4]) - HELLO_BYTES_BEFORE_6];
    if stream.read_exact(&mut rest).is_err() {
        return;
    }
    hellos.lock().expect("not poisoned").push(hello[4]);
    if !(3..=newest).contains(&hello[4]) {
        let _ = stream.write_all(&old_reply(1, node_id, newest));
        return; // closed
    }
    stream
        .write_all(&old_reply(0, node_id, hello[4]))
        .expect("reply");
    let (mut buffer, mut chunk) = (Vec::new(), vec![0u8; 1 << 16]);
    while !stop.load(Ordering::Relaxed) {
        match stream.read(&mut chunk) {
            Ok(0) => return,
            Ok(read) => buffer.extend_from_slice(&chunk[..read]),
            Err(error) if error.kind() == std::io::ErrorKind::WouldBlock => continue,
            Err(error) if error.kind() == std::io::ErrorKind::TimedOut => continue,
            Err(_) => return,
        }
        let mut used = 0;
        while let Some((envelope, len)) =
            peer::frame::decode(&buffer[used..]).expect("whole envelopes")
        {
            if !envelope.is_keepalive() {
                use protobuf::Message as _;
                let message = Message::parse_from_bytes(envelope.message).expect("a message");
                let _ = numbers.send(message.commit);
            }
            used += len;
        }
        buffer.drain(..used);
    }
}

/// A rolling upgrade of member 2, then a roll back, as member 1 (this build) sees it.
#[test]
fn a_member_falls_back_to_version_3_for_a_reader_that_speaks_3_alone_and_back_up_after() {
    let all = addresses(2);
    let listener = TcpListener::bind(all[1]).expect("member 2's address");
    let mut old = OldReader::start(listener, 2, 3);
    let one = start(1, &all, PeerLimits::default());
    send_numbered(&one, 1, 2, 0..50);
    assert_eq!(
        old.receive(50),
        (0..50).collect(),
        "every message, in version 3"
    );
    let hellos = old.hellos();
    assert_eq!(
        hellos[..2],
        [VERSION, 3],
        "the newest first, refused, then 3"
    );
    wait_for("member 1 to report member 2 connected", || {
        let report = one.handle.report();
        report.peers[0].link == LinkState::Connected
    });
    let report = one.handle.report();
    assert_eq!((report.peers[0].version, report.cluster_version), (3, 3));
    assert_eq!((report.version, one.handle.cluster_version()), (VERSION, 3));
    assert_eq!(
        load(&one.stats().refused_by_peers),
        0,
        "a fallback is no refusal"
    );

    // Member 2 is upgraded: member 1 reconnects in the newest, the cluster version with it.
    let disconnects = load(&one.stats().disconnects);
    old.stop();
    // What is written to a connection as it closes is lost (raft sends again): send after.
    wait_for("member 1 to see the close", || {
        load(&one.stats().disconnects) > disconnects
    });
    let mut two = start(2, &all, PeerLimits::default());
    wait_for("member 1 to hear member 2 in the newest", || {
        version_of(&one, 2) == VERSION && one.handle.cluster_version() == VERSION
    });
    wait_for("member 1's link accepted in the newest", || {
        one.handle.report().peers[0].link == LinkState::Connected
    });
    send_numbered(&one, 1, 2, 50..60);
    assert_eq!(two.receive(10).0.len(), 10);
    assert_eq!(one.handle.report().cluster_version, VERSION);

    // Rolled back to the earlier build (not supported once the cluster version rose, but the
    // transport follows): member 1 falls back to 3 again and says so.
    let disconnects = load(&one.stats().disconnects);
    two.stop();
    wait_for("member 1 to see the close", || {
        load(&one.stats().disconnects) > disconnects
    });
    let listener = TcpListener::bind(all[1]).expect("member 2's address again");
    let old = OldReader::start(listener, 2, 3);
    send_numbered(&one, 1, 2, 60..70);
    assert_eq!(old.receive(10), (60..70).collect(), "in version 3 again");
    wait_for("member 1 to hear member 2 in 3", || {
        version_of(&one, 2) == 3 && one.handle.cluster_version() == 3
    });
}

/// Readers of the builds before this one speak 3 and 4, or 3 to 5: each refuses this build's
/// 6 naming its newest, and is spoken to in it; the cluster version is that newest (4:
/// replicated waiters, no replicated fates; 5: no incarnations in the hellos).
#[test]
fn a_member_speaks_the_newest_of_a_reader_of_an_earlier_build_and_the_cluster_version_is_it() {
    assert_eq!(VERSION, 6, "this build's newest");
    for newest in [4, 5] {
        let all = addresses(2);
        let listener = TcpListener::bind(all[1]).expect("member 2's address");
        let old = OldReader::start(listener, 2, newest);
        let one = start(1, &all, PeerLimits::default());
        send_numbered(&one, 1, 2, 0..20);
        assert_eq!(
            old.receive(20),
            (0..20).collect(),
            "every message, in version {newest}"
        );
        assert_eq!(
            old.hellos()[..2],
            [6, newest],
            "6 first, refused, then {newest}"
        );
        wait_for("member 1 to hear member 2 in its newest", || {
            version_of(&one, 2) == newest && one.handle.cluster_version() == newest
        });
        assert_eq!(one.handle.report().cluster_version, newest);
        assert_eq!(
            load(&one.stats().refused_by_peers),
            0,
            "a fallback is no refusal"
        );
    }
}

/// Three members of this build: the cluster version is 3 until each has heard from every
/// other in this build's newest, then that, and it stays so while a member is down.
#[test]
fn the_cluster_version_is_the_newest_once_every_member_of_this_build_was_heard_from() {
    let all = addresses(3);
    let one = start(1, &all, PeerLimits::default());
    assert_eq!(
        one.handle.cluster_version(),
        VERSION_MIN,
        "nobody heard from"
    );
    let two = start(2, &all, PeerLimits::default());
    wait_for("members 1 and 2 to hear each other in the newest", || {
        version_of(&one, 2) == VERSION && version_of(&two, 1) == VERSION
    });
    for member in [&one, &two] {
        assert_eq!(
            member.handle.cluster_version(),
            3,
            "member 3 never heard from"
        );
        assert_eq!(member.handle.report().cluster_version, 3);
    }
    let mut three = start(3, &all, PeerLimits::default());
    let members = [&one, &two, &three];
    wait_for("every member's cluster version to be the newest", || {
        members.iter().all(|member| {
            let report = member.handle.report();
            member.handle.cluster_version() == VERSION
                && report.cluster_version == VERSION
                && report.peers.iter().all(|peer| peer.version == VERSION)
        })
    });
    // Member 3 stops: it keeps its last known version.
    three.stop();
    wait_for("member 1 to see member 3 down", || {
        let report = one.handle.report();
        report
            .peers
            .iter()
            .any(|peer| peer.node_id == 3 && !peer.reachable)
    });
    assert_eq!(version_of(&one, 3), VERSION);
    assert_eq!(one.handle.cluster_version(), VERSION);
}

/// A hello and its reply, on a raw connection to `member`; the reply's bytes.
pub(crate) fn say_hello(member: SocketAddr, hello: &[u8]) -> (TcpStream, [u8; REPLY_BYTES]) {
    let mut stream = TcpStream::connect(member).expect("connect");
    stream.write_all(hello).expect("write the hello");
    stream
        .set_read_timeout(Some(PATIENCE))
        .expect("read timeout");
    let mut reply = [0u8; REPLY_BYTES];
    stream.read_exact(&mut reply).expect("the reply");
    (stream, reply)
}

/// A hello from node 3 to member 2 in `version` (its incarnation from 6 on; a version this
/// build does not speak is as long as its newest).
fn hello_in(version: u8) -> Vec<u8> {
    let mut bytes = hello(SHARDS, 3);
    bytes[4] = version;
    if peer::frame::speaks(version) {
        bytes.truncate(hello_bytes(version));
    }
    bytes
}

/// What a dialer of the previous build checks: the reply's version byte is exactly 3.
#[test]
fn a_version_3_dialer_is_answered_in_3_and_others_as_they_speak() {
    let all = addresses(3); // member 3 is played by raw connections
    let _one = start(1, &all, PeerLimits::default());
    let mut two = start(2, &all, PeerLimits::default());
    wait_for("member 2 to hear member 1 in the newest", || {
        version_of(&two, 1) == VERSION
    });

    // In the newest first: the peer is known at it, and so is the cluster.
    let (mut newer, reply) = say_hello(all[1], &hello_in(VERSION));
    assert_eq!((reply[4], reply[5]), (VERSION, 0), "accepted in the newest");
    newer.write_all(&from_three(0..5)).expect("write");
    assert_eq!(two.receive(5).0.len(), 5);
    wait_for("member 2 to know member 3 at the newest", || {
        version_of(&two, 3) == VERSION && two.handle.cluster_version() == VERSION
    });

    // Node 3 comes back as the previous build: answered in 3, and the cluster version is 3.
    let (mut older, reply) = say_hello(all[1], &hello_in(3));
    assert_eq!(&reply[..4], b"LKPR");
    assert_eq!(
        (reply[4], reply[5]),
        (3, 0),
        "accepted, in 3: what an old dialer reads"
    );
    older.write_all(&from_three(5..10)).expect("write");
    let numbers: HashSet<u64> = two.receive(5).0.iter().map(|(_, _, m)| m.commit).collect();
    assert_eq!(numbers, (5..10).collect());
    assert!(
        closed_by_server(&mut newer),
        "the newer hello's connection replaced"
    );
    assert_eq!(version_of(&two, 3), 3);
    assert_eq!(two.handle.cluster_version(), 3);
    assert_eq!(two.handle.report().cluster_version, 3);

    // A version-3 hello refused for another reason is answered in 3 (the old dialer logs why);
    // a version this build does not speak is refused in its newest.
    let mut identity = hello_in(3);
    identity[25..].copy_from_slice(&(IDENTITY ^ 1).to_be_bytes());
    let (mut refused, reply) = say_hello(all[1], &identity);
    assert_eq!(
        (reply[4], reply[5]),
        (3, 5),
        "refused for the identity, in 3"
    );
    assert!(closed_by_server(&mut refused));
    for version in [2, VERSION + 1] {
        let (mut refused, reply) = say_hello(all[1], &hello_in(version));
        assert_eq!(
            (reply[4], reply[5]),
            (VERSION, 1),
            "version {version} refused in the newest"
        );
        assert!(closed_by_server(&mut refused));
    }
    assert_eq!(version_of(&two, 3), 3, "refused hellos change nothing");
}
