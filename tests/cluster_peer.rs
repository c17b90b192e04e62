//! The peer transport over loopback TCP: delivery to the right core exactly once, reconnection
//! after a restart, hellos of misconfigured members refused on both sides and retried, who is
//! reachable, hostile connections and messages refused or dropped without harm to the others
//! (and without harm to a real member), bounded queues.
//!
//! Every wait is bounded by a generous deadline; nothing asserts on speed.

mod common;

use crossbeam_channel::Receiver;
use latchkey::cluster::peer::frame::{Hello, REPLY_BYTES, VERSION};
use latchkey::cluster::peer::{self, LinkState, PeerConfig, PeerHandle, PeerLimits, PeerStats};
use mio::{Events, Poll, Token, Waker};
use raft::eraftpb::{Message, MessageType};
use std::collections::HashSet;
use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::thread::{self, JoinHandle};
use std::time::{Duration, Instant};

const SHARDS: u32 = 8;
const CORES: usize = 2;
/// The cluster identity digest the members of these tests share.
const IDENTITY: u64 = 0x1d_e471_7e57;
/// Every wait gives up after this: far beyond what loopback needs.
const PATIENCE: Duration = Duration::from_secs(15);

/// Free loopback addresses (bound, then released for the members to bind).
fn addresses(count: usize) -> Vec<SocketAddr> {
    let listeners: Vec<TcpListener> = (0..count)
        .map(|_| TcpListener::bind("127.0.0.1:0").expect("bind an ephemeral port"))
        .collect();
    listeners
        .iter()
        .map(|listener| listener.local_addr().expect("bound"))
        .collect()
}

/// One member's peer thread and its cores' receiving ends.
struct Member {
    handle: PeerHandle,
    join: Option<JoinHandle<()>>,
    cores: Vec<(Receiver<(u32, Message)>, Poll)>,
}

fn route(shard: u32) -> usize {
    shard as usize % CORES
}

fn start(node_id: u64, all: &[SocketAddr], limits: PeerLimits) -> Member {
    let peers = (all.iter().enumerate())
        .map(|(i, &addr)| (i as u64 + 1, addr))
        .collect();
    start_with(node_id, all[node_id as usize - 1], peers, IDENTITY, limits)
}

/// Member `node_id` listening on `listen`, dialing `peers`, of the cluster `identity`.
fn start_with(
    node_id: u64,
    listen: SocketAddr,
    peers: Vec<(u64, SocketAddr)>,
    identity: u64,
    limits: PeerLimits,
) -> Member {
    let _ = env_logger::builder().is_test(true).try_init();
    let config = PeerConfig {
        node_id,
        listen,
        peers,
        shards: SHARDS,
        identity,
        seed: 0x5eed + node_id,
        limits,
    };
    let mut inbound = Vec::new();
    let mut cores = Vec::new();
    for _ in 0..CORES {
        let poll = Poll::new().expect("poll");
        let waker = Arc::new(Waker::new(poll.registry(), Token(0)).expect("waker"));
        let (sender, receiver) = crossbeam_channel::bounded(100_000);
        inbound.push((sender, waker));
        cores.push((receiver, poll));
    }
    let (handle, join) = peer::spawn(config, inbound, route).expect("spawn the peer thread");
    Member {
        handle,
        join: Some(join),
        cores,
    }
}

impl Member {
    fn stats(&self) -> &PeerStats {
        self.handle.stats()
    }

    fn stop(&mut self) {
        self.handle.stop();
        if let Some(join) = self.join.take() {
            join.join().expect("the peer thread ends cleanly");
        }
    }

    /// Waits (on each core's waker) until `count` messages have arrived in all; returns them
    /// with the core each came out of, and how many wakes the cores saw.
    fn receive(&mut self, count: usize) -> (Vec<(usize, u32, Message)>, usize) {
        let deadline = Instant::now() + PATIENCE;
        let (mut received, mut wakes) = (Vec::new(), 0);
        let mut events = Events::with_capacity(16);
        while received.len() < count && Instant::now() < deadline {
            for (core, (receiver, poll)) in self.cores.iter_mut().enumerate() {
                poll.poll(&mut events, Some(Duration::from_millis(20)))
                    .expect("poll");
                wakes += events.iter().count();
                received.extend(receiver.try_iter().map(|(shard, m)| (core, shard, m)));
            }
        }
        (received, wakes)
    }

    /// Whatever arrives within `within` (to show that nothing more does).
    fn receive_for(&mut self, within: Duration) -> Vec<(usize, u32, Message)> {
        thread::sleep(within);
        let cores = self.cores.iter().enumerate();
        cores
            .flat_map(|(core, (rx, _))| rx.try_iter().map(move |(s, m)| (core, s, m)))
            .collect()
    }
}

impl Drop for Member {
    fn drop(&mut self) {
        if self.join.is_some() {
            self.stop();
        }
    }
}

/// A heartbeat from `from` to `to` whose `commit` numbers it.
fn message(from: u64, to: u64, number: u64, padding: usize) -> Message {
    let mut message = Message::default();
    message.set_msg_type(MessageType::MsgHeartbeat);
    message.set_from(from);
    message.set_to(to);
    message.set_commit(number);
    message.set_context(vec![0x5a; padding].into());
    message
}

fn send_numbered(member: &Member, from: u64, to: u64, numbers: std::ops::Range<u64>) {
    let batch: Vec<peer::Outgoing> = numbers
        .map(|number| peer::Outgoing {
            to,
            shard: (number % u64::from(SHARDS)) as u32,
            message: message(from, to, number, 16),
        })
        .collect();
    for chunk in batch.chunks(50) {
        assert!(
            member.handle.send_batch(chunk.to_vec()),
            "the channel has room"
        );
    }
}

fn wait_for(what: &str, mut done: impl FnMut() -> bool) {
    let deadline = Instant::now() + PATIENCE;
    while !done() {
        assert!(Instant::now() < deadline, "gave up waiting for {what}");
        thread::sleep(Duration::from_millis(5));
    }
}

fn load(counter: &std::sync::atomic::AtomicU64) -> u64 {
    counter.load(Ordering::Relaxed)
}

#[test]
fn three_members_deliver_every_message_once_to_the_shards_core() {
    let all = addresses(3);
    let mut members: Vec<Member> = (1..=3)
        .map(|id| start(id, &all, PeerLimits::default()))
        .collect();
    const EACH: u64 = 2000;
    for from in 1..=3u64 {
        for to in (1..=3u64).filter(|&to| to != from) {
            let base = from * 1_000_000 + to * 10_000;
            send_numbered(&members[from as usize - 1], from, to, base..base + EACH);
        }
    }
    for (index, member) in members.iter_mut().enumerate() {
        let to = index as u64 + 1;
        let (received, wakes) = member.receive(2 * EACH as usize);
        assert!(wakes > 0, "the cores' wakers were used");
        let mut seen = HashSet::new();
        for (core, shard, message) in &received {
            assert_eq!(*core, route(*shard), "shard {shard} went to core {core}");
            assert_eq!(u64::from(*shard), message.commit % u64::from(SHARDS));
            assert_eq!(message.to, to);
            assert!(
                seen.insert((message.from, message.commit)),
                "a duplicate: {message:?}"
            );
        }
        let expected: HashSet<(u64, u64)> = (1..=3u64)
            .filter(|&from| from != to)
            .flat_map(|from| {
                let base = from * 1_000_000 + to * 10_000;
                (base..base + EACH).map(move |number| (from, number))
            })
            .collect();
        assert_eq!(seen, expected, "member {to} got every message");
        assert!(
            member.receive_for(Duration::from_millis(100)).is_empty(),
            "nothing more"
        );
    }
    for member in &members {
        let stats = member.stats();
        assert_eq!(load(&stats.messages_sent), 2 * EACH);
        assert_eq!(load(&stats.messages_received), 2 * EACH);
        assert_eq!(load(&stats.connects), 2, "one connection per peer");
        assert_eq!(load(&stats.accepts), 2);
        let drops = load(&stats.drops_channel) + load(&stats.drops_queue);
        assert_eq!(
            drops + load(&stats.drops_inbound) + load(&stats.refusals),
            0
        );
        assert!(load(&stats.bytes_sent) > 2 * EACH * 8);
    }
}

#[test]
fn a_restarted_member_is_reconnected_and_gets_what_was_queued_while_it_was_down() {
    let all = addresses(2);
    let mut one = start(1, &all, PeerLimits::default());
    let mut two = start(2, &all, PeerLimits::default());
    send_numbered(&one, 1, 2, 0..10);
    assert_eq!(two.receive(10).0.len(), 10);

    two.stop();
    assert!(
        !two.handle.send(1, 0, message(2, 1, 0, 0)),
        "a stopped thread takes nothing"
    );
    assert_eq!(load(&two.stats().drops_channel), 1);
    // Member 1 sees its connection closed, then queues while 2 is down.
    wait_for("member 1 to see the close", || {
        load(&one.stats().disconnects) >= 1
    });
    // With member 2 down, member 1 keeps trying to reach it (to see it come back), at most
    // once per backoff_max (1 s) once the backoff has grown, and does not spin.
    thread::sleep(Duration::from_millis(1500)); // the backoff reaches its maximum
    let stats = one.stats();
    let (iterations, disconnects) = (load(&stats.iterations), load(&stats.disconnects));
    thread::sleep(Duration::from_millis(2000));
    let idle = load(&stats.iterations) - iterations;
    let attempts = load(&stats.disconnects) - disconnects;
    assert!(
        (1..=5).contains(&attempts),
        "{attempts} connect attempts in 2 s"
    );
    assert!(
        idle <= 60,
        "{idle} loop iterations in 2 s with nothing to do"
    );
    send_numbered(&one, 1, 2, 10..110);
    wait_for("the messages to be queued", || {
        load(&one.stats().queued_messages) == 100
    });
    thread::sleep(Duration::from_millis(300)); // a few refused connects and backoffs

    let mut two = start(2, &all, PeerLimits::default());
    let (received, _) = two.receive(100);
    let numbers: HashSet<u64> = received.iter().map(|(_, _, m)| m.commit).collect();
    assert_eq!(numbers, (10..110).collect(), "every queued message, once");
    assert!(two.receive_for(Duration::from_millis(100)).is_empty());
    assert!(load(&one.stats().connects) >= 2, "reconnected");

    // And the other way, on a fresh outbound link from the restarted member.
    send_numbered(&two, 2, 1, 0..5);
    assert_eq!(one.receive(5).0.len(), 5);
    one.stop();
}

/// Whether the server closed `stream` (EOF or reset) within the patience.
fn closed_by_server(stream: &mut TcpStream) -> bool {
    closed_within(stream, PATIENCE)
}

/// Whether the server closed `stream` (EOF or reset) within `within`, having written at most
/// its reply to the hello.
fn closed_within(stream: &mut TcpStream, within: Duration) -> bool {
    stream.set_read_timeout(Some(within)).expect("timeout");
    let mut buffer = [0u8; 64];
    let mut read = 0;
    loop {
        match stream.read(&mut buffer) {
            Ok(0) => return true,
            Ok(more) if read + more <= REPLY_BYTES => read += more,
            Ok(_) => return false, // more than a reply
            Err(error) => {
                return !matches!(
                    error.kind(),
                    std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
                )
            }
        }
    }
}

/// A hello from `from` to member 2.
fn hello(shards: u32, from: u64) -> Vec<u8> {
    let identity = IDENTITY;
    let to = 2;
    Hello {
        shards,
        from,
        to,
        identity,
    }
    .encode()
    .to_vec()
}

#[test]
fn hostile_connections_are_closed_and_the_others_keep_working() {
    let all = addresses(3); // member 3 never runs: its id is a known peer for the raw tests
    let limits = PeerLimits {
        hello_timeout: Duration::from_millis(300),
        ..PeerLimits::default()
    };
    let one = start(1, &all, limits.clone());
    let mut two = start(2, &all, limits);
    send_numbered(&one, 1, 2, 0..10);
    assert_eq!(two.receive(10).0.len(), 10);

    let mut wrong_version = hello(SHARDS, 3);
    wrong_version[4] = VERSION + 1;
    let mut oversized = hello(SHARDS, 3);
    oversized.extend_from_slice(&u32::MAX.to_be_bytes());
    let mut shard_out_of_range = hello(SHARDS, 3);
    shard_out_of_range.extend_from_slice(&[0, 0, 0, 4, 0, 0, 0, SHARDS as u8]);
    let mut undecodable = hello(SHARDS, 3);
    undecodable.extend_from_slice(&[0, 0, 0, 7, 0, 0, 0, 1, 0xff, 0xff, 0xff]);
    let mut wrong_sender = hello(SHARDS, 3);
    let mut forged = Vec::new();
    peer::frame::encode(1, &message(1, 2, 0, 0), &mut forged).expect("encodes");
    wrong_sender.extend_from_slice(&forged); // says it is node 1, on node 3's connection
    let mut wrong_member = hello(SHARDS, 3);
    wrong_member[17..25].copy_from_slice(&1u64.to_be_bytes()); // meant for member 1
    let mut wrong_identity = hello(SHARDS, 3);
    wrong_identity[25..].copy_from_slice(&(IDENTITY + 1).to_be_bytes());
    let attempts: Vec<(&str, Vec<u8>)> = vec![
        ("garbage", b"GET / HTTP/1.1\r\nHost: x\r\n\r\n".to_vec()),
        ("wrong version", wrong_version),
        ("wrong shard count", hello(SHARDS + 1, 3)),
        ("unknown node id", hello(SHARDS, 99)),
        ("its own node id", hello(SHARDS, 2)),
        ("meant for another member", wrong_member),
        ("another cluster identity", wrong_identity),
        ("an oversized length", oversized),
        ("a shard out of range", shard_out_of_range),
        ("an undecodable message", undecodable),
        ("a message from another node", wrong_sender),
    ];
    for (what, bytes) in &attempts {
        let mut stream = TcpStream::connect(all[1]).expect("connect");
        stream.write_all(bytes).expect("write");
        assert!(
            closed_by_server(&mut stream),
            "{what}: the connection was closed"
        );
    }
    // A connection that never says hello is closed at the hello timeout, never before.
    let started = Instant::now();
    let mut silent = TcpStream::connect(all[1]).expect("connect");
    assert!(
        closed_by_server(&mut silent),
        "a silent connection is closed"
    );
    assert!(
        started.elapsed() >= Duration::from_millis(300),
        "not before the hello timeout"
    );

    let refusals = load(&two.stats().refusals);
    assert_eq!(refusals, attempts.len() as u64 + 1, "each one counted");
    assert_eq!(
        load(&two.stats().accepts),
        1 + 4,
        "member 1, and the 4 with a good hello"
    );
    // Member 1's connection was never disturbed: messages still flow on it.
    send_numbered(&one, 1, 2, 10..20);
    assert_eq!(two.receive(10).0.len(), 10);
    assert_eq!(load(&one.stats().connects), 1);
}

#[test]
fn a_full_queue_drops_the_newest_and_counts_and_stays_bounded() {
    let all = addresses(2);
    let limits = PeerLimits {
        queue_messages_max: 1000,
        queue_bytes_max: 256 << 10,
        ..PeerLimits::default()
    };
    let one = start(1, &all, limits.clone());
    // Member 2 is down: everything for it waits in member 1's queue, or is dropped.
    const SENT: u64 = 20_000;
    for chunk in 0..SENT / 100 {
        let batch = (chunk * 100..chunk * 100 + 100)
            .map(|number| peer::Outgoing {
                to: 2,
                shard: 0,
                message: message(1, 2, number, 1000),
            })
            .collect();
        assert!(one.handle.send_batch(batch));
    }
    let stats = one.stats();
    wait_for("every message queued or dropped", || {
        load(&stats.queued_messages) + load(&stats.drops_queue) == SENT
    });
    let (queued, bytes) = (load(&stats.queued_messages), load(&stats.queued_bytes));
    assert!(bytes <= 256 << 10, "queued bytes {bytes} within the bound");
    assert!(
        queued > 100 && queued < 1000,
        "the byte bound held first: {queued} messages"
    );
    thread::sleep(Duration::from_millis(300)); // refused connects change nothing
    assert_eq!(load(&stats.queued_messages), queued);

    // When member 2 comes up, it gets exactly the oldest `queued` messages.
    let mut two = start(2, &all, limits);
    let (received, _) = two.receive(queued as usize);
    let numbers: HashSet<u64> = received.iter().map(|(_, _, m)| m.commit).collect();
    assert_eq!(
        numbers,
        (0..queued).collect(),
        "the newest were dropped, the oldest kept"
    );
    wait_for("the queue to drain", || load(&stats.queued_messages) == 0);
    assert_eq!(load(&stats.queued_bytes), 0);
}

/// Waits until at least one message arrives; returns how many did. Blocks only on the waker of
/// `core` (the others are checked without waiting), as that core's loop would.
fn receive_some(member: &mut Member, core: usize, events: &mut Events) -> usize {
    let deadline = Instant::now() + PATIENCE;
    loop {
        let mut arrived = 0;
        for (receiver, _) in &member.cores {
            arrived += receiver.try_iter().count();
        }
        if arrived == 0 {
            let poll = &mut member.cores[core].1;
            poll.poll(events, Some(Duration::from_millis(10)))
                .expect("poll");
        }
        if arrived > 0 {
            return arrived;
        }
        assert!(Instant::now() < deadline, "nothing arrived");
    }
}

/// A measurement, not a check: `cargo test --release --test cluster_peer -- --ignored
/// --nocapture`. Prints one-way throughput (a window of messages in flight) and the round trip
/// of one message there and back through both peer threads.
#[test]
#[ignore]
fn measure_throughput_and_round_trip() {
    let all = addresses(2);
    let mut one = start(1, &all, PeerLimits::default());
    let mut two = start(2, &all, PeerLimits::default());
    let mut events = Events::with_capacity(16);
    const TOTAL: u64 = 1_000_000;
    const WINDOW: u64 = 50_000;
    const BATCH: u64 = 256;
    let started = Instant::now();
    let (mut sent, mut received) = (0u64, 0u64);
    while received < TOTAL {
        while sent < TOTAL && sent - received < WINDOW {
            let batch = (sent..(sent + BATCH).min(TOTAL))
                .map(|n| peer::Outgoing {
                    to: 2,
                    shard: 0, // core 0, the one waited on
                    message: message(1, 2, n, 64),
                })
                .collect::<Vec<_>>();
            sent += batch.len() as u64;
            assert!(one.handle.send_batch(batch), "the channel has room");
        }
        received += receive_some(&mut two, 0, &mut events) as u64;
    }
    let elapsed = started.elapsed();
    let bytes = load(&one.stats().bytes_sent);
    println!(
        "one way: {TOTAL} messages ({} bytes each with 64 B of context) in {elapsed:?}: \
         {:.0} messages/s, {:.1} MB/s",
        bytes / TOTAL,
        TOTAL as f64 / elapsed.as_secs_f64(),
        bytes as f64 / elapsed.as_secs_f64() / 1e6
    );
    const ROUNDS: usize = 5000;
    let mut round_trips = Vec::with_capacity(ROUNDS);
    for round in 0..ROUNDS as u64 {
        let at = Instant::now();
        assert!(one.handle.send(2, 0, message(1, 2, round, 64)));
        assert_eq!(receive_some(&mut two, route(0), &mut events), 1);
        assert!(two.handle.send(1, 0, message(2, 1, round, 64)));
        assert_eq!(receive_some(&mut one, route(0), &mut events), 1);
        round_trips.push(at.elapsed());
    }
    round_trips.sort();
    let at = |quantile: f64| round_trips[((ROUNDS as f64 * quantile) as usize).min(ROUNDS - 1)];
    println!(
        "round trip over both peer threads ({ROUNDS} rounds): p50 {:?}, p99 {:?}, max {:?}",
        at(0.5),
        at(0.99),
        round_trips[ROUNDS - 1]
    );
}

/// Whether `stream` is still open after `within` (nothing read but an accepting reply, no
/// close).
fn still_open(stream: &mut TcpStream, within: Duration) -> bool {
    stream.set_read_timeout(Some(within)).expect("timeout");
    let mut reply = [0u8; REPLY_BYTES];
    if stream.read_exact(&mut reply).is_err() || reply[5] != 0 {
        return false; // closed, or refused
    }
    let mut buffer = [0u8; 8];
    match stream.read(&mut buffer) {
        Err(error) => matches!(
            error.kind(),
            std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
        ),
        Ok(read) => read > buffer.len(), // closed, or bytes beyond the reply: false
    }
}

#[test]
fn inbound_connections_beyond_the_limit_are_refused_at_accept_and_slots_come_back() {
    let all = addresses(3);
    let limits = PeerLimits {
        inbound_connections_max: 3,
        ..PeerLimits::default()
    };
    let one = start(1, &all, limits.clone());
    let mut two = start(2, &all, limits);
    send_numbered(&one, 1, 2, 0..5);
    assert_eq!(two.receive(5).0.len(), 5);
    // Member 1's connection and two silent ones fill the three slots.
    let silent: Vec<TcpStream> = (0..2)
        .map(|_| TcpStream::connect(all[1]).expect("connect"))
        .collect();
    wait_for("two more connections", || {
        let mut probe = TcpStream::connect(all[1]).expect("connect");
        closed_within(&mut probe, Duration::from_millis(500))
    });
    let refusals = load(&two.stats().refusals);
    assert!(refusals >= 1);
    drop(silent);
    // Once the server has seen them close, a good hello is admitted and kept.
    wait_for("a slot to come back", || {
        let mut stream = TcpStream::connect(all[1]).expect("connect");
        stream.write_all(&hello(SHARDS, 3)).expect("write");
        still_open(&mut stream, Duration::from_millis(200))
    });
    send_numbered(&one, 1, 2, 5..10);
    assert_eq!(
        two.receive(5).0.len(),
        5,
        "member 1's connection was never disturbed"
    );
}

#[test]
fn a_message_too_large_for_an_envelope_is_dropped_and_counted() {
    let all = addresses(2);
    let mut one = start(1, &all, PeerLimits::default());
    let mut two = start(2, &all, PeerLimits::default());
    let huge = message(1, 2, 0, peer::frame::FRAME_BYTES_MAX);
    assert!(one.handle.send(2, 0, huge), "taken by the channel");
    wait_for("the drop", || load(&one.stats().drops_oversized) == 1);
    assert_eq!(load(&one.stats().queued_messages), 0);
    // A large one that fits goes through.
    let large = message(1, 2, 1, peer::frame::FRAME_BYTES_MAX - 1024);
    assert!(one.handle.send(2, 0, large));
    let (received, _) = two.receive(1);
    assert_eq!(received[0].2.commit, 1);
    assert!(received[0].2.context.len() > peer::frame::FRAME_BYTES_MAX - 2048);
    assert_eq!(load(&two.stats().refusals), 0);
    one.stop();
}

/// Limits whose backoff tops out at 200 ms, so that retries come quickly.
fn quick_limits() -> PeerLimits {
    PeerLimits {
        backoff_max: Duration::from_millis(200),
        ..PeerLimits::default()
    }
}

/// Member `member`'s view of peer `peer`.
fn view(member: &Member, peer: u64) -> peer::PeerStatus {
    let report = member.handle.report();
    let found = report
        .peers
        .into_iter()
        .find(|status| status.node_id == peer);
    found.expect("a peer of the member")
}

#[test]
fn members_of_another_cluster_identity_refuse_each_other_on_both_sides_until_fixed() {
    let all = addresses(2);
    let one = start(1, &all, quick_limits());
    let peers = vec![(1, all[0])];
    let mut two = start_with(2, all[1], peers, IDENTITY ^ 1, quick_limits());
    send_numbered(&one, 1, 2, 0..5);
    // Each side refuses the other's hello, and hears the other refuse its own.
    wait_for("both sides to refuse and be refused", || {
        [(&one, 2), (&two, 1)].iter().all(|&(member, other)| {
            let status = view(member, other);
            status.link == LinkState::Refused && status.refused_inbound.is_some()
        })
    });
    for (member, other) in [(&one, 2), (&two, 1)] {
        assert!(load(&member.stats().refusals) >= 1);
        assert!(load(&member.stats().refused_by_peers) >= 1);
        let status = view(member, other);
        assert_eq!(status.link, LinkState::Refused, "{status:?}");
        assert!(
            status.reason.contains("cluster identity differs"),
            "{status:?}"
        );
        let inbound = status.refused_inbound.as_deref().unwrap_or_default();
        assert!(inbound.contains("cluster identity differs"), "{status:?}");
        assert!(!status.reachable);
        let report = member.handle.report();
        assert_eq!((report.reachable, report.quorum), (1, false));
    }
    assert!(
        two.receive_for(Duration::from_millis(300)).is_empty(),
        "nothing delivered"
    );
    // Member 2 comes back with the cluster's identity: member 1 reconnects by itself (it keeps
    // retrying) and what it queued meanwhile arrives.
    two.stop();
    let mut two = start(2, &all, quick_limits());
    let numbers: HashSet<u64> = two.receive(5).0.iter().map(|(_, _, m)| m.commit).collect();
    assert_eq!(numbers, (0..5).collect());
    wait_for("member 1 to see member 2 connected and reachable", || {
        let status = view(&one, 2);
        status.link == LinkState::Connected && status.reachable
    });
}

#[test]
fn a_peer_address_that_leads_to_another_member_is_refused_as_dialed_but_reached() {
    let all = addresses(3);
    // Member 1 believes member 2 listens on member 3's address; member 2 never runs.
    let peers = vec![(2, all[2]), (3, all[2])];
    let one = start_with(1, all[0], peers, IDENTITY, quick_limits());
    let three = start(3, &all, quick_limits());
    let reason = "node 1 dialed node 2 but reached node 3: member 1's peer address for 2 is wrong";
    wait_for("member 1 to be told", || {
        view(&one, 2).reason.contains(reason)
    });
    assert_eq!(view(&one, 2).link, LinkState::Refused);
    wait_for("member 3 to say why", || {
        view(&three, 1).refused_inbound.is_some()
    });
    let refused = view(&three, 1).refused_inbound.unwrap_or_default();
    assert!(refused.contains(reason), "member 3 says why: {refused}");
    wait_for("member 1 and 3 to reach each other", || {
        view(&one, 3).reachable && view(&three, 1).reachable
    });
    let report = one.handle.report();
    assert_eq!(
        (report.members, report.reachable, report.quorum),
        (3, 2, true)
    );
}

#[test]
fn peers_are_reachable_while_they_talk_and_the_quorum_follows_them() {
    let all = addresses(3);
    let one = start(1, &all, quick_limits());
    let mut others: Vec<Member> = (2..=3).map(|id| start(id, &all, quick_limits())).collect();
    // Nothing is sent between them but keepalives: every peer is reachable all the same.
    wait_for("all three reachable", || one.handle.report().reachable == 3);
    assert!(one.handle.report().quorum);
    for member in &mut others {
        member.stop();
    }
    wait_for("member 1 alone, without a quorum", || {
        let report = one.handle.report();
        report.reachable == 1 && !report.quorum
    });
    let status = view(&one, 2);
    assert_ne!(status.link, LinkState::Connected, "{status:?}");
    assert!(!status.reason.is_empty(), "why: {status:?}");
    let _two = start(2, &all, quick_limits());
    wait_for("member 2 back, and the quorum", || {
        let report = one.handle.report();
        report.reachable == 2 && report.quorum
    });
}

/// Accepts `listener`'s next connection and answers its hello as member `node_id` (accepting
/// it); returns the stream (the dialer's bytes after the hello are left unread).
fn accept_as(listener: &TcpListener, node_id: u64) -> TcpStream {
    use latchkey::cluster::peer::frame::{Reply, Verdict, HELLO_BYTES};
    let (mut stream, _) = listener.accept().expect("member 1 dials");
    let mut hello = [0u8; HELLO_BYTES];
    stream.read_exact(&mut hello).expect("its hello");
    let reply = Reply {
        verdict: Verdict::Accepted,
        shards: SHARDS,
        node_id,
        identity: IDENTITY,
    };
    stream.write_all(&reply.encode()).expect("reply");
    stream
}

#[test]
fn a_silent_peer_is_unreachable_after_the_window_although_its_connections_are_up() {
    let all = addresses(2);
    // The test plays member 2: it accepts member 1's connection and says hello to member 1,
    // then writes nothing, as a member stopped by SIGSTOP would (its kernel still acks).
    let listener = TcpListener::bind(all[1]).expect("member 2's address");
    let one = start(1, &all, quick_limits());
    let _incoming = accept_as(&listener, 2);
    let mut outgoing = TcpStream::connect(all[0]).expect("connect to member 1");
    outgoing.write_all(&hello_to(1, 2)).expect("hello");
    wait_for("member 2 reachable", || view(&one, 2).reachable);
    let reachable_at = Instant::now();
    wait_for("member 2 unreachable", || !view(&one, 2).reachable);
    let waited = reachable_at.elapsed();
    assert!(
        waited >= Duration::from_millis(900),
        "not before the window: {waited:?}"
    );
    let status = view(&one, 2);
    assert_eq!(status.link, LinkState::Connected, "TCP is fine: {status:?}");
    // A keepalive makes it reachable again.
    outgoing
        .write_all(&peer::frame::KEEPALIVE)
        .expect("keepalive");
    wait_for("member 2 reachable again", || view(&one, 2).reachable);
}

/// A hello from `from` to member `to`.
fn hello_to(to: u64, from: u64) -> Vec<u8> {
    let hello = Hello {
        shards: SHARDS,
        from,
        to,
        identity: IDENTITY,
    };
    hello.encode().to_vec()
}

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
    let all = addresses(3);
    let mut two = start(2, &all, PeerLimits::default());
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
    assert_eq!(load(&two.stats().drops_invalid), 3);
    assert_eq!(two.handle.report().counters.invalid_dropped, 3);
    assert_eq!(load(&two.stats().refusals), 0);
    // Crafted deep nesting is refused before protobuf parses it: the connection is closed.
    raw.write_all(&envelope(1, &nested_groups()))
        .expect("write");
    assert!(closed_by_server(&mut raw), "closed");
    assert_eq!(load(&two.stats().refusals), 1);
    assert!(two.receive_for(Duration::from_millis(100)).is_empty());
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
    use latchkey::protocol::Response;
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
    };
    let identity = cluster.identity().digest;
    let mut config = Config::default();
    config.server.listen = ports[0];
    config.server.cores = 1;
    config.cluster = Some(cluster);
    let server = latchkey::server::start(config).expect("member 1 starts");
    // The test speaks as member 2 (member 3 never runs).
    let mut raw = TcpStream::connect(ports[1]).expect("member 1's peer port");
    let hello = Hello {
        shards: 1,
        from: 2,
        to: 1,
        identity,
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
