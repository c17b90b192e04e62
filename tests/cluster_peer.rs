//! The peer transport over loopback TCP: delivery to the right core exactly once, reconnection
//! after a restart, hellos of misconfigured members refused on both sides and retried, who is
//! reachable, hostile connections and messages refused or dropped without harm to the others
//! (and without harm to a real member), bounded queues, members of the previous build's wire
//! version and the cluster version, and a member on another data directory refused.
//!
//! Every wait is bounded by a generous deadline; nothing asserts on speed.

#[path = "cluster_peer/content.rs"]
mod content;
#[path = "cluster_peer/incarnation.rs"]
mod incarnation;
#[path = "cluster_peer/reach.rs"]
mod reach;
#[path = "cluster_peer/tls.rs"]
mod tls;
#[path = "cluster_peer/version.rs"]
mod version;

use crossbeam_channel::Receiver;
use latchkey::cluster::peer::frame::{Hello, REPLY_BYTES, VERSION};
use latchkey::cluster::peer::{
    self, CorePoll, CoreReader, PeerConfig, PeerHandle, PeerLimits, PeerStats,
};
use latchkey::partition::cluster_stats::LinkState;
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

/// One member's peer thread and its cores' receiving ends: each core's channel and poll, and
/// its reader when the cores read the connections themselves.
struct Member {
    handle: PeerHandle,
    join: Option<JoinHandle<()>>,
    cores: Vec<(Receiver<(u32, Message)>, Poll)>,
    readers: Vec<CoreReader>,
}

/// Who reads a member's inbound connections.
#[derive(Clone, Copy, Debug)]
enum Reads {
    /// The peer thread (it hands messages to the cores' channels).
    OnThePeerThread,
    /// The cores, on their loops (the peer thread hands them accepted connections).
    OnTheCores,
}

/// The first token of a core's reader in these tests (the waker's is 0).
const SOURCE_BASE: usize = 1;

fn route(shard: u32) -> usize {
    shard as usize % CORES
}

fn start(node_id: u64, all: &[SocketAddr], limits: PeerLimits) -> Member {
    start_reading(node_id, all, limits, Reads::OnThePeerThread)
}

fn start_reading(node_id: u64, all: &[SocketAddr], limits: PeerLimits, reads: Reads) -> Member {
    let peers = (all.iter().enumerate())
        .map(|(i, &addr)| (i as u64 + 1, addr))
        .collect();
    let listen = all[node_id as usize - 1];
    start_as(node_id, listen, peers, (IDENTITY, limits), reads)
}

/// Member `node_id` listening on `listen`, dialing `peers`, of the cluster `identity`.
fn start_with(
    node_id: u64,
    listen: SocketAddr,
    peers: Vec<(u64, SocketAddr)>,
    identity: u64,
    limits: PeerLimits,
) -> Member {
    start_as(
        node_id,
        listen,
        peers,
        (identity, limits),
        Reads::OnThePeerThread,
    )
}

fn start_as(
    node_id: u64,
    listen: SocketAddr,
    peers: Vec<(u64, SocketAddr)>,
    (identity, limits): (u64, PeerLimits),
    reads: Reads,
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
        tls: None,
        incarnation: 0x1ca0 + node_id,
        peers_file: None,
    };
    spawn_member(config, reads)
}

/// Member `node_id`'s configuration among the members at `all` (ids 1..): plaintext, quick
/// limits, its incarnation `0x1ca0 + node_id`, the peers' kept in memory.
fn config_among(node_id: u64, all: &[SocketAddr]) -> PeerConfig {
    let peers = (all.iter().enumerate())
        .map(|(i, &addr)| (i as u64 + 1, addr))
        .collect();
    PeerConfig {
        node_id,
        listen: all[node_id as usize - 1],
        peers,
        shards: SHARDS,
        identity: IDENTITY,
        seed: 0x5eed + node_id,
        limits: quick_limits(),
        tls: None,
        incarnation: 0x1ca0 + node_id,
        peers_file: None,
    }
}

/// A member of `config`, its connections read as `reads` says.
fn spawn_member(config: PeerConfig, reads: Reads) -> Member {
    let _ = env_logger::builder().is_test(true).try_init();
    let mut inbound = Vec::new();
    let mut cores = Vec::new();
    for _ in 0..CORES {
        let poll = Poll::new().expect("poll");
        let waker = Arc::new(Waker::new(poll.registry(), Token(0)).expect("waker"));
        let (sender, receiver) = crossbeam_channel::bounded(100_000);
        inbound.push((sender, waker));
        cores.push((receiver, poll));
    }
    let (handle, join, readers) = match reads {
        Reads::OnThePeerThread => {
            let (handle, join) = peer::spawn(config, inbound, route).expect("spawn");
            (handle, join, Vec::new())
        }
        Reads::OnTheCores => {
            let polls = (cores.iter())
                .map(|(_, poll)| CorePoll {
                    registry: poll.registry().try_clone().expect("a registry"),
                    token_base: SOURCE_BASE,
                })
                .collect();
            peer::spawn_with_readers(config, inbound, polls, route).expect("spawn")
        }
    };
    Member {
        handle,
        join: Some(join),
        cores,
        readers,
    }
}

impl Member {
    fn stats(&self) -> &PeerStats {
        self.handle.stats()
    }

    /// Stops the member as a server does: its cores first (their readers close the connections
    /// they read), then the peer thread.
    fn stop(&mut self) {
        self.readers.clear();
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
        while received.len() < count && Instant::now() < deadline {
            wakes += self.pump(Duration::from_millis(20), &mut received);
        }
        (received, wakes)
    }

    /// Whatever arrives within `within` (to show that nothing more does).
    fn receive_for(&mut self, within: Duration) -> Vec<(usize, u32, Message)> {
        let deadline = Instant::now() + within;
        let mut received = Vec::new();
        while Instant::now() < deadline {
            self.pump(Duration::from_millis(10), &mut received);
        }
        received
    }

    /// One turn of each core, as its loop would take it: poll (up to `timeout`), hand its
    /// reader the readiness of its connections, take what arrived. Returns the events seen.
    fn pump(&mut self, timeout: Duration, into: &mut Vec<(usize, u32, Message)>) -> usize {
        let mut events = Events::with_capacity(16);
        let mut seen = 0;
        for (core, (receiver, poll)) in self.cores.iter_mut().enumerate() {
            poll.poll(&mut events, Some(timeout)).expect("poll");
            seen += events.iter().count();
            into.extend(receiver.try_iter().map(|(shard, m)| (core, shard, m)));
            let Some(reader) = self.readers.get_mut(core) else {
                continue;
            };
            for event in events.iter() {
                if let Some(source) = event.token().0.checked_sub(SOURCE_BASE) {
                    reader.on_ready(source);
                }
            }
            while let Some((shard, message)) = reader.recv() {
                into.push((core, shard, message));
            }
        }
        seen
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

/// Heartbeats from `from` to `to`, numbered (`commit`) by `numbers`, each with `padding` bytes
/// of context, for the shard `shard_of` its number.
fn numbered(
    (from, to): (u64, u64),
    numbers: std::ops::Range<u64>,
    padding: usize,
    shard_of: impl Fn(u64) -> u32,
) -> Vec<peer::Outgoing> {
    numbers
        .map(|number| peer::Outgoing {
            to,
            shard: shard_of(number),
            message: message(from, to, number, padding),
        })
        .collect()
}

/// Heartbeats from member 1 to member 2 for `shard`, numbered by `numbers` ([`numbered`]).
fn one_to_two(shard: u32, numbers: std::ops::Range<u64>, padding: usize) -> Vec<peer::Outgoing> {
    numbered((1, 2), numbers, padding, |_| shard)
}

fn send_numbered(member: &Member, from: u64, to: u64, numbers: std::ops::Range<u64>) {
    let batch = numbered((from, to), numbers, 16, |number| {
        (number % u64::from(SHARDS)) as u32
    });
    for chunk in batch.chunks(50) {
        assert!(
            member.handle.send_batch(chunk.to_vec()),
            "the peer thread runs"
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
    deliver_every_message_once(Reads::OnThePeerThread);
}

/// The same with the connections read on the cores: a core's reader hands the other core's
/// messages to that core's channel.
#[test]
fn three_members_deliver_every_message_once_to_the_shards_core_reading_on_the_cores() {
    deliver_every_message_once(Reads::OnTheCores);
}

fn deliver_every_message_once(reads: Reads) {
    let all = addresses(3);
    let mut members: Vec<Member> = (1..=3)
        .map(|id| start_reading(id, &all, PeerLimits::default(), reads))
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
        let drops = load(&stats.drops_stopped) + load(&stats.drops_queue);
        assert_eq!(
            drops + load(&stats.drops_inbound) + load(&stats.refusals),
            0
        );
        assert!(load(&stats.bytes_sent) > 2 * EACH * 8);
    }
}

/// Cores and log writers send to the same peer at once, each writing to the connection itself:
/// with messages large enough to fill the socket (so that writes are cut and the peer thread
/// finishes what the senders left), every message arrives once, whole, and in each sender's
/// order.
#[test]
fn concurrent_senders_share_a_connection_without_cutting_or_reordering_their_messages() {
    let all = addresses(2);
    let one = start(1, &all, PeerLimits::default());
    let mut two = start(2, &all, PeerLimits::default());
    const SENDERS: u64 = 4;
    const EACH: u64 = 2000;
    let senders: Vec<JoinHandle<()>> = (0..SENDERS)
        .map(|sender| {
            let handle = one.handle.clone();
            thread::spawn(move || {
                for chunk in 0..EACH / 20 {
                    let first = sender * 1_000_000 + chunk * 20;
                    let batch = one_to_two(sender as u32, first..first + 20, 4096);
                    assert!(handle.send_batch(batch), "the peer thread runs");
                }
            })
        })
        .collect();
    for sender in senders {
        sender.join().expect("a sender thread");
    }
    let (received, _) = two.receive((SENDERS * EACH) as usize);
    assert_eq!(received.len() as u64, SENDERS * EACH);
    for sender in 0..SENDERS {
        let numbers: Vec<u64> = (received.iter())
            .filter(|(_, shard, _)| u64::from(*shard) == sender)
            .map(|(_, _, message)| message.commit)
            .collect();
        let expected: Vec<u64> = (0..EACH).map(|n| sender * 1_000_000 + n).collect();
        assert_eq!(
            numbers, expected,
            "sender {sender}'s messages, once, in order"
        );
    }
    assert!(two.receive_for(Duration::from_millis(100)).is_empty());
    let stats = one.stats();
    assert_eq!(load(&stats.messages_sent), SENDERS * EACH);
    assert_eq!(load(&stats.drops_queue) + load(&stats.drops_stopped), 0);
    assert_eq!(load(&two.stats().refusals), 0);
}

/// Envelopes larger than a connection's usual buffer (up to a few MiB, as snapshots are) arrive
/// whole and in order among small ones, read by the peer thread or by a core (which reads them
/// over several passes) and parsed without a copy.
#[test]
fn large_envelopes_arrive_whole_and_in_order_among_small_ones() {
    large_envelopes(Reads::OnThePeerThread);
}

#[test]
fn large_envelopes_read_on_the_cores_arrive_whole_and_in_order_among_small_ones() {
    large_envelopes(Reads::OnTheCores);
}

fn large_envelopes(reads: Reads) {
    let all = addresses(2);
    let one = start_reading(1, &all, PeerLimits::default(), reads);
    let mut two = start_reading(2, &all, PeerLimits::default(), reads);
    let paddings = [10, 70_000, 100, 3_000_000, 5, 1_000_000, 65_530, 2];
    for (number, &padding) in paddings.iter().enumerate() {
        let number = number as u64;
        let batch = one_to_two(0, number..number + 1, padding);
        assert!(one.handle.send_batch(batch), "the peer thread runs");
    }
    let (received, _) = two.receive(paddings.len());
    let numbers: Vec<u64> = received.iter().map(|(_, _, m)| m.commit).collect();
    assert_eq!(
        numbers,
        (0..paddings.len() as u64).collect::<Vec<_>>(),
        "in order"
    );
    for ((_, _, message), &padding) in received.iter().zip(&paddings) {
        let context = message.get_context();
        assert_eq!(context.len(), padding, "message {} whole", message.commit);
        assert!(context.iter().all(|&byte| byte == 0x5a), "its bytes intact");
    }
    assert!(two.receive_for(Duration::from_millis(100)).is_empty());
    assert_eq!(
        load(&two.stats().refusals) + load(&two.stats().drops_inbound),
        0
    );
}

/// A connected peer that stops reading (a member stopped by SIGSTOP: its kernel still acks):
/// senders never wait for it, its lane stays within its bounds and counts what it drops, and
/// once it reads again it gets what was kept, whole and in order.
#[test]
fn a_peer_that_stops_reading_never_holds_up_senders_and_gets_the_kept_messages_in_order() {
    let all = addresses(2);
    let listener = TcpListener::bind(all[1]).expect("member 2's address");
    let limits = PeerLimits {
        queue_messages_max: 1000,
        queue_bytes_max: 256 << 10,
        ..PeerLimits::default()
    };
    let one = start(1, &all, limits);
    let mut stalled = reach::accept_as(&listener, 2);
    wait_for("member 1's link accepted", || {
        one.handle
            .report()
            .peers
            .iter()
            .any(|peer| peer.link == LinkState::Connected)
    });
    const SENT: u64 = 20_000;
    let mut slowest = Duration::ZERO;
    for chunk in 0..SENT / 100 {
        let batch = one_to_two(0, chunk * 100..chunk * 100 + 100, 1000);
        let started = Instant::now();
        assert!(one.handle.send_batch(batch));
        slowest = slowest.max(started.elapsed());
    }
    // Generous: a send that waited for the network would never return.
    assert!(slowest < Duration::from_secs(2), "a send took {slowest:?}");
    let stats = one.stats();
    let accounted =
        || load(&stats.messages_sent) + load(&stats.queued_messages) + load(&stats.drops_queue);
    wait_for("every message written, queued or dropped", || {
        accounted() == SENT
    });
    assert!(
        load(&stats.queued_bytes) <= 256 << 10,
        "the lane's byte bound"
    );
    let dropped = load(&stats.drops_queue);
    assert!(
        dropped > 0,
        "20 MB cannot fit in the socket and a 256 KiB lane"
    );

    // The peer reads again: everything not dropped arrives, whole and in order.
    stalled
        .set_read_timeout(Some(PATIENCE))
        .expect("read timeout");
    let (mut buffer, mut chunk, mut numbers) = (Vec::new(), vec![0u8; 1 << 16], Vec::new());
    while (numbers.len() as u64) < SENT - dropped {
        let read = stalled.read(&mut chunk).expect("member 1 keeps writing");
        assert!(read > 0, "member 1 closed the connection");
        buffer.extend_from_slice(&chunk[..read]);
        let mut used = 0;
        while let Some((envelope, len)) =
            peer::frame::decode(&buffer[used..]).expect("whole envelopes")
        {
            if !envelope.is_keepalive() {
                use protobuf::Message as _;
                let message = Message::parse_from_bytes(envelope.message).expect("a message");
                numbers.push(message.commit);
            }
            used += len;
        }
        buffer.drain(..used);
    }
    assert_eq!(numbers.len() as u64, SENT - dropped);
    assert!(
        numbers.windows(2).all(|pair| pair[0] < pair[1]),
        "in the order sent, none twice"
    );
    assert_eq!(numbers[0], 0, "the oldest were kept");
}

#[test]
fn a_restarted_member_is_reconnected_and_gets_what_was_queued_while_it_was_down() {
    restarted_member(Reads::OnThePeerThread);
}

#[test]
fn a_restarted_member_reading_on_its_cores_is_reconnected_and_gets_what_was_queued() {
    restarted_member(Reads::OnTheCores);
}

fn restarted_member(reads: Reads) {
    let all = addresses(2);
    let mut one = start_reading(1, &all, PeerLimits::default(), reads);
    let mut two = start_reading(2, &all, PeerLimits::default(), reads);
    send_numbered(&one, 1, 2, 0..10);
    assert_eq!(two.receive(10).0.len(), 10);

    two.stop();
    assert!(
        !two.handle.send(1, 0, message(2, 1, 0, 0)),
        "a stopped thread takes nothing"
    );
    assert_eq!(load(&two.stats().drops_stopped), 1);
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

    let mut two = start_reading(2, &all, PeerLimits::default(), reads);
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

/// Limits whose backoff tops out at 200 ms, so that retries come quickly.
fn quick_limits() -> PeerLimits {
    PeerLimits {
        backoff_max: Duration::from_millis(200),
        ..PeerLimits::default()
    }
}

/// Member `member`'s view of peer `peer`.
fn view(member: &Member, peer: u64) -> latchkey::partition::cluster_stats::PeerStatus {
    let report = member.handle.report();
    let found = report
        .peers
        .into_iter()
        .find(|status| status.node_id == peer);
    found.expect("a peer of the member")
}

/// A hello from `from` to member `to`.
fn hello_to(to: u64, from: u64) -> Vec<u8> {
    let hello = Hello {
        version: VERSION,
        shards: SHARDS,
        from,
        to,
        identity: IDENTITY,
        incarnation: 0x1ca0 + from,
    };
    hello.encode().to_vec()
}

/// A hello from `from` to member 2.
fn hello(shards: u32, from: u64) -> Vec<u8> {
    let identity = IDENTITY;
    let to = 2;
    Hello {
        version: VERSION,
        shards,
        from,
        to,
        identity,
        incarnation: 0x1ca0 + from,
    }
    .encode()
    .to_vec()
}

/// A raw connection from node 3 to member 2 whose hello was accepted (the reply read).
fn connect_as_three(member_two: SocketAddr) -> TcpStream {
    let mut stream = TcpStream::connect(member_two).expect("connect");
    stream
        .write_all(&hello(SHARDS, 3))
        .expect("write the hello");
    let mut reply = [0u8; REPLY_BYTES];
    stream.read_exact(&mut reply).expect("the reply");
    let reply = peer::frame::Reply::decode(&reply)
        .expect("a reply")
        .expect("whole");
    assert_eq!(reply.verdict, peer::frame::Verdict::Accepted);
    stream
}

/// Numbered heartbeats from 3 to 2, as envelopes.
fn from_three(numbers: std::ops::Range<u64>) -> Vec<u8> {
    let mut bytes = Vec::new();
    for number in numbers {
        let shard = (number % u64::from(SHARDS)) as u32;
        peer::frame::encode(shard, &message(3, 2, number, 0), &mut bytes).expect("encodes");
    }
    bytes
}

/// On a member whose cores read the connections: what a peer sends after its hello is read and
/// routed by a core; a newer connection from the same node replaces the older one there; a
/// hostile envelope closes the connection and is counted and shown as a refusal, as on the
/// peer thread; and what arrives counts as heard from the peer.
#[test]
fn connections_read_on_the_cores_route_replace_refuse_and_count_as_heard() {
    let all = addresses(3); // members 1 and 3 never run: 3 is played by raw connections
    let mut two = start_reading(2, &all, PeerLimits::default(), Reads::OnTheCores);
    let mut first = connect_as_three(all[1]);
    first.write_all(&from_three(0..40)).expect("write");
    let (received, _) = two.receive(40);
    let numbers: HashSet<u64> = received.iter().map(|(_, _, m)| m.commit).collect();
    assert_eq!(numbers, (0..40).collect(), "every message, once");
    for (core, shard, _) in &received {
        assert_eq!(*core, route(*shard), "shard {shard} went to core {core}");
    }
    let readers: Vec<usize> = two.readers.iter().map(CoreReader::connections).collect();
    assert_eq!(
        readers.iter().sum::<usize>(),
        1,
        "one core reads it: {readers:?}"
    );
    wait_for("the peer thread to publish what the core heard", || {
        let report = two.handle.report();
        let three = report.peers.iter().find(|status| status.node_id == 3);
        three.is_some_and(|status| status.heard_ms_ago.is_some_and(|ago| ago < 5_000))
    });

    let mut second = connect_as_three(all[1]);
    second.write_all(&from_three(40..50)).expect("write");
    let (received, _) = two.receive(10);
    let numbers: HashSet<u64> = received.iter().map(|(_, _, m)| m.commit).collect();
    assert_eq!(numbers, (40..50).collect());
    assert!(
        closed_by_server(&mut first),
        "the older connection was replaced"
    );
    let readers: usize = two.readers.iter().map(CoreReader::connections).sum();
    assert_eq!(readers, 1);

    // A shard out of range, after the hello and some good envelopes: the core refuses it.
    let mut hostile = from_three(50..52);
    hostile.extend_from_slice(&[0, 0, 0, 4, 0, 0, 0, SHARDS as u8]);
    second.write_all(&hostile).expect("write");
    let mut received = Vec::new();
    let deadline = Instant::now() + PATIENCE;
    while two
        .readers
        .iter()
        .map(CoreReader::connections)
        .sum::<usize>()
        > 0
    {
        assert!(Instant::now() < deadline, "the core closed the connection");
        two.pump(Duration::from_millis(10), &mut received);
    }
    // One core's reader may have handed a message to the other core after it was pumped.
    received.extend(two.receive_for(Duration::from_millis(100)));
    assert!(closed_by_server(&mut second), "closed");
    let numbers: HashSet<u64> = received.iter().map(|(_, _, m)| m.commit).collect();
    assert_eq!(
        numbers,
        (50..52).collect(),
        "what came before it was delivered"
    );
    wait_for("the refusal to be counted", || {
        load(&two.stats().refusals) == 1
    });
    let report = two.handle.report();
    let three = report.peers.iter().find(|status| status.node_id == 3);
    let refused = three.and_then(|status| status.refused_inbound.clone());
    assert!(
        refused
            .as_deref()
            .is_some_and(|why| why.contains("out of range")),
        "the peer's status says why: {refused:?}"
    );
    assert_eq!(load(&two.stats().accepts), 2);
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
    wrong_identity[25..33].copy_from_slice(&(IDENTITY + 1).to_be_bytes());
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
        let batch = one_to_two(0, chunk * 100..chunk * 100 + 100, 1000);
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
            // Shard 0: core 0, the one waited on.
            let batch = one_to_two(0, sent..(sent + BATCH).min(TOTAL), 64);
            sent += batch.len() as u64;
            assert!(one.handle.send_batch(batch), "the peer thread runs");
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
