//! Hostile TLS clients against a real two-core TLS server: handshakes that never finish
//! (slowloris), garbage before the ClientHello, a handshake flood past `max_connections`,
//! client certificates of a wrong CA or expired, and a pipeliner that never reads after its
//! handshake.
//!
//! Each attack is bounded by a limit of the server (the handshake deadline, the connection
//! limit, the session's output bound); a session closed for a TLS reason is logged at most once
//! per period per core and kind, naming the peer and the reason, and counted in
//! `latchkey_tls_failures_total`. In every scenario a well-behaved `Probe`
//! (tests/common/probe.rs) over TLS holds a lock on each partition from before the attack until
//! after it, and its p99 latency must stay under `P99_BOUND`.
//!
//! Where the log lines matter the server runs as the binary (its stderr collected), otherwise
//! in-process. The scenarios run one at a time (a process-wide lock), so that one's load does
//! not count against another's probe. Timing is asserted as "never early" strictly and "not too
//! late" with generous slack (debug build, shared cores). Every wait is bounded.

use common::pki::{
    client_hello, https_get, presenting_config, raw_client_config, raw_connect, tls_client,
    try_tls_client, HandDriven, Pki,
};
use common::probe::{serial, Probe};
use common::server::{
    rss_bytes, start_with, wait_for_line, wait_until, Conn, KeyState, ServerProcess,
};
use common::PATIENCE;
use latchkey::rng::Rng;
use latchkey::server::tls::HANDSHAKE_DEADLINE;
use latchkey::server::ServerHandle;
use latchkey_client::protocol::{parse_response, Request, Response};
use rustls::ClientConfig;
use std::collections::{BTreeMap, HashSet};
use std::io::{ErrorKind, Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::thread;
use std::time::{Duration, Instant};

const CORES: usize = 2;
/// How late past its deadline a close may come (generous: debug build, shared cores).
const LATE: Duration = Duration::from_secs(8);
/// "At once": well under the handshake deadline, so such a close is never a deadline close.
const PROMPTLY: Duration = Duration::from_secs(5);
/// The counter of sessions closed for a TLS error or a late handshake.
const TLS_FAILURES: &str = "latchkey_tls_failures_total";
const PING: [u8; 10] = [b'P', 0, 0, 0, 0, 0, 0, 0, 9, b'\n'];

// ----- helpers -----------------------------------------------------------------------------------

/// The server binary with TLS from `pki` (client certificates required when `client_ca`), two
/// cores, logging at info; its log is collected. Its files are named after `name`.
fn spawn_server(pki: &Pki, name: &str, client_ca: bool) -> (ServerProcess, Arc<Mutex<String>>) {
    let (cert, key) = pki.leaf(&format!("{name}-server"), "latchkey", &["127.0.0.1"]);
    let mut toml = format!("[tls]\ncert_file = {cert:?}\nkey_file = {key:?}\n");
    if client_ca {
        toml.push_str(&format!("client_ca_file = {:?}\n", pki.ca_file()));
    }
    let config = pki.write(&format!("{name}.toml"), &toml);
    let args = ["--config", config.to_str().unwrap(), "--cores", "2"];
    ServerProcess::spawn_logging(&args, "info")
}

/// A probe over TLS with `config`.
fn tls_probe(addr: SocketAddr, config: Arc<ClientConfig>) -> Probe {
    Probe::start_over(CORES, move || {
        let stream = raw_connect(addr, config);
        stream.sock.set_nodelay(true).unwrap();
        Conn::over(stream)
    })
}

/// The counter `name` of `GET /metrics`, asked over TLS with `config`.
fn metric(addr: SocketAddr, config: &Arc<ClientConfig>, name: &str) -> u64 {
    let text = https_get(addr, Arc::clone(config), "/metrics");
    let prefix = format!("{name} ");
    let value = text.lines().find_map(|line| line.strip_prefix(&prefix));
    value
        .and_then(|value| value.trim().parse().ok())
        .unwrap_or_else(|| panic!("no {name} in:\n{text}"))
}

/// Waits until the counter `name` is `expected` (it only grows), then checks it stays there.
fn expect_metric(addr: SocketAddr, config: &Arc<ClientConfig>, name: &str, expected: u64) {
    let mut seen = 0;
    wait_until(PATIENCE, || {
        seen = metric(addr, config, name);
        seen >= expected
    });
    thread::sleep(Duration::from_millis(200));
    seen = metric(addr, config, name);
    assert_eq!(seen, expected, "{name}");
}

/// The log lines that contain `part`, checked to be rate-limited: at least one, at most one per
/// core, each at info, naming its peer, and the first of its kind (`0 more`).
fn rate_limited_lines(log: &Arc<Mutex<String>>, part: &str) -> Vec<String> {
    wait_for_line(log, &[part], PATIENCE);
    // Every line was written before its session closed; give the collector a moment.
    thread::sleep(Duration::from_millis(200));
    let lines: Vec<String> = log
        .lock()
        .unwrap()
        .lines()
        .filter(|line| line.contains(part))
        .map(str::to_owned)
        .collect();
    let cores: HashSet<&str> = lines
        .iter()
        .map(|line| line.split("core ").nth(1).and_then(|s| s.split(':').next()))
        .map(|core| core.expect("the line names its core"))
        .collect();
    assert!(
        lines.len() <= CORES && cores.len() == lines.len(),
        "{part}: one line per core at most:\n{lines:#?}"
    );
    for line in &lines {
        assert!(line.contains(" INFO "), "{line}");
        assert!(line.contains("(0 more since the last such line)"), "{line}");
        named_peer(line);
    }
    lines
}

/// The peer a "closing the session of PEER: ..." line names.
fn named_peer(line: &str) -> SocketAddr {
    let peer = line.split("closing the session of ").nth(1);
    let peer = peer.and_then(|rest| rest.split(": ").next());
    let peer = peer.and_then(|peer| peer.parse().ok());
    peer.unwrap_or_else(|| panic!("no peer in {line}"))
}

/// Checks that every one of `lines` names one of `peers`.
fn name_these_peers(lines: &[String], peers: &[String]) {
    for line in lines {
        let named = named_peer(line).to_string();
        assert!(peers.contains(&named), "{line} names none of {peers:?}");
    }
}

/// Reads until the peer closes (an end or a reset), at most `limit`: what arrived, and whether
/// it closed.
fn read_until_closed(tcp: &mut TcpStream, limit: Duration) -> (Vec<u8>, bool) {
    let until = Instant::now() + limit;
    let (mut received, mut chunk) = (Vec::new(), [0u8; 4096]);
    loop {
        let Some(left) = until.checked_duration_since(Instant::now()) else {
            return (received, false);
        };
        tcp.set_read_timeout(Some(left.max(Duration::from_millis(1))))
            .unwrap();
        match tcp.read(&mut chunk) {
            Ok(0) => return (received, true),
            Ok(n) => received.extend_from_slice(&chunk[..n]),
            Err(e) if matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::TimedOut) => {}
            Err(_) => return (received, true),
        }
    }
}

/// Whether `bytes` is at most one TLS alert record (type 21, two bytes of payload): never a
/// plaintext answer.
fn at_most_an_alert(bytes: &[u8]) -> bool {
    bytes.is_empty() || (bytes.len() == 7 && bytes[0] == 21 && bytes[3..5] == [0, 2])
}

fn local_peer(tcp: &TcpStream) -> String {
    tcp.local_addr().unwrap().to_string()
}

// ----- slowloris ---------------------------------------------------------------------------------

const SLOW_CLIENTS: usize = 50;

/// How a handshake that never finished ended.
struct SlowClose {
    peer: String,
    /// From before the connect to the close.
    after: Duration,
    received: Vec<u8>,
    /// Bytes of the ClientHello sent.
    sent: usize,
}

/// Fifty clients start a handshake they never finish: half send half a ClientHello at once,
/// half drip it a byte a second. Each is closed at the handshake deadline, never before; each
/// core logs one line for all of its own (not one each), naming a peer; the metric counts all
/// fifty; meanwhile the probe and new TLS clients are served.
#[test]
fn slowloris_handshakes_are_closed_at_the_deadline_with_one_line_per_core() {
    let _serial = serial();
    let pki = Pki::new("slowloris");
    let (server, log) = spawn_server(&pki, "slowloris", false);
    let addr = server.addr;
    let config = raw_client_config(&pki.ca_file(), None);
    let probe = tls_probe(addr, Arc::clone(&config));
    let hello = Arc::new(client_hello(&config));
    let slow: Vec<_> = (0..SLOW_CLIENTS)
        .map(|i| {
            let hello = Arc::clone(&hello);
            thread::spawn(move || slow_handshake(addr, &hello, i % 2 == 1))
        })
        .collect();
    let fresh = fresh_clients(addr, &config, 40);
    let closes: Vec<SlowClose> = slow.into_iter().map(|t| t.join().unwrap()).collect();
    for c in &closes {
        let what = format!("{}: closed after {:?}, sent {}", c.peer, c.after, c.sent);
        assert!(c.after >= HANDSHAKE_DEADLINE, "early: {what}");
        assert!(c.sent < hello.len(), "the ClientHello was finished: {what}");
        assert!(c.received.is_empty(), "{what}, got {:?}", c.received);
    }
    let first = closes.iter().map(|c| c.after).min().unwrap();
    let last = closes.iter().map(|c| c.after).max().unwrap();
    expect_metric(addr, &config, TLS_FAILURES, SLOW_CLIENTS as u64);
    let peers: Vec<String> = closes.into_iter().map(|c| c.peer).collect();
    let lines = rate_limited_lines(&log, "no TLS handshake within 10s");
    name_these_peers(&lines, &peers);
    eprintln!(
        "slowloris: {SLOW_CLIENTS} closed after {first:.4?} to {last:.4?} (ClientHello of {} \
         bytes); meanwhile 40 new TLS clients connected and pinged, slowest {fresh:.1?}; log:\n{}",
        hello.len(),
        lines.join("\n")
    );
    assert!(fresh < Duration::from_secs(1), "a new client: {fresh:?}");
    probe.finish("slowloris handshakes");
}

/// Connects and starts a handshake it never finishes: half the ClientHello at once, or with
/// `drip` a byte of it a second. Returns once the server closed.
fn slow_handshake(addr: SocketAddr, hello: &[u8], drip: bool) -> SlowClose {
    let started = Instant::now();
    let mut tcp = TcpStream::connect(addr).unwrap();
    tcp.set_nodelay(true).unwrap();
    let peer = local_peer(&tcp);
    let mut sent = if drip { 1 } else { hello.len() / 2 };
    tcp.write_all(&hello[..sent]).unwrap();
    tcp.set_read_timeout(Some(Duration::from_secs(1))).unwrap();
    let (mut received, mut chunk) = (Vec::new(), [0u8; 512]);
    loop {
        let after = started.elapsed();
        assert!(
            after < HANDSHAKE_DEADLINE + LATE,
            "{peer}: open after {after:?}"
        );
        match tcp.read(&mut chunk) {
            Ok(0) => break,
            Ok(n) => received.extend_from_slice(&chunk[..n]),
            Err(e) if matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::TimedOut) => {
                // A write after the server closed fails; the next read then sees the close.
                if drip && tcp.write_all(&hello[sent..sent + 1]).is_ok() {
                    sent += 1;
                }
            }
            Err(_) => break,
        }
    }
    SlowClose {
        peer,
        after: started.elapsed(),
        received,
        sent,
    }
}

/// `count` new TLS clients one after the other, each connecting and pinging once (a full
/// handshake each), every 50 ms; the slowest's time.
fn fresh_clients(addr: SocketAddr, config: &Arc<ClientConfig>, count: u64) -> Duration {
    let mut slowest = Duration::ZERO;
    for nonce in 0..count {
        let started = Instant::now();
        let mut conn = Conn::over(raw_connect(addr, Arc::clone(config)));
        conn.stream.sock.set_nodelay(true).unwrap();
        assert_eq!(conn.ping(nonce), Response::Pong { nonce });
        slowest = slowest.max(started.elapsed());
        thread::sleep(Duration::from_millis(50));
    }
    slowest
}

// ----- garbage -----------------------------------------------------------------------------------

/// The largest TLS record on the wire: a header and a ciphertext of at most 2^14 + 2048 bytes.
const RECORD_WIRE_MAX: u64 = 5 + 16_384 + 2048;
const RANDOM_GARBAGE: usize = 16;

/// Bytes that are no TLS: random garbage (seeded) before a real ClientHello, records of random
/// bytes, a plaintext `GET /metrics` and a plaintext `P` frame, in rounds for a second. Each
/// session is closed at once (long before the handshake deadline) with nothing but an alert at
/// most sent back; each core logs one line for all of its own, naming a peer and "TLS error";
/// the metric counts every one.
#[test]
fn garbage_before_the_client_hello_is_closed_at_once_with_one_line_per_core() {
    let _serial = serial();
    let seed = 0x7e57_91ba_66a5_0001_u64;
    eprintln!("garbage: seed {seed:#x}");
    let mut rng = Rng::new(seed);
    let pki = Pki::new("garbage");
    let (server, log) = spawn_server(&pki, "garbage", false);
    let config = raw_client_config(&pki.ca_file(), None);
    let probe = tls_probe(server.addr, Arc::clone(&config));
    let hello = client_hello(&config);
    let (mut peers, mut slowest, mut alerts) = (Vec::new(), Duration::ZERO, BTreeMap::new());
    let started = Instant::now();
    // Rounds for a second (at most 20), so that the probe measures something meanwhile.
    while peers.is_empty() || (started.elapsed() < Duration::from_secs(1) && peers.len() < 400) {
        for (what, bytes) in garbage(&mut rng, &hello) {
            let (peer, after, received) = send_garbage(server.addr, &bytes);
            assert!(after < PROMPTLY, "{what}: closed after {after:?}");
            assert!(at_most_an_alert(&received), "{what}: got {received:?}");
            // By alert description (none: nothing arrived).
            *alerts.entry(received.get(6).copied()).or_insert(0) += 1;
            slowest = slowest.max(after);
            peers.push(peer);
        }
    }
    expect_metric(server.addr, &config, TLS_FAILURES, peers.len() as u64);
    let lines = rate_limited_lines(&log, "TLS error");
    name_these_peers(&lines, &peers);
    eprintln!(
        "garbage: {} sessions closed, slowest after {slowest:.1?}, alert descriptions {alerts:?}; \
         log:\n{}",
        peers.len(),
        lines.join("\n")
    );
    probe.finish("garbage before the ClientHello");
}

/// One round of inputs that are no TLS, each with what it is.
fn garbage(rng: &mut Rng, hello: &[u8]) -> Vec<(String, Vec<u8>)> {
    let mut inputs: Vec<(String, Vec<u8>)> = (0..RANDOM_GARBAGE)
        .map(|i| {
            // At least a whole record, so that even a valid record header is followed by all
            // it announces: the server has all it needs to decide, and never waits for more.
            let len = rng.between(RECORD_WIRE_MAX, 2 * RECORD_WIRE_MAX) as usize;
            let mut bytes = rng.bytes(len);
            bytes.extend_from_slice(hello);
            (format!("random garbage {i} ({len} bytes)"), bytes)
        })
        .collect();
    // Records that frame correctly, full of random bytes: a ClientHello (refused by the
    // handshake's parser, not the record layer), and application data before any handshake.
    let len = rng.between(64, 4096) as usize;
    let body = rng.bytes(len);
    let mut message = vec![1, 0];
    message.extend_from_slice(&(body.len() as u16).to_be_bytes());
    message.extend_from_slice(&body);
    inputs.push(("a ClientHello of random bytes".into(), record(22, &message)));
    inputs.push(("application data first".into(), record(23, &body)));
    let http = b"GET /metrics HTTP/1.1\r\nHost: latchkey\r\n\r\n".to_vec();
    inputs.push(("plaintext GET /metrics".into(), http));
    inputs.push(("plaintext P frame".into(), PING.to_vec()));
    inputs
}

/// A TLS record of content type `kind` carrying `payload` (at most 2^14 bytes).
fn record(kind: u8, payload: &[u8]) -> Vec<u8> {
    let mut record = vec![kind, 3, 1];
    record.extend_from_slice(&(payload.len() as u16).to_be_bytes());
    record.extend_from_slice(payload);
    record
}

/// Sends `bytes` on a new connection and reads until the server closes it: the connection's
/// peer address, when it closed (since before the connect) and what arrived.
fn send_garbage(addr: SocketAddr, bytes: &[u8]) -> (String, Duration, Vec<u8>) {
    let started = Instant::now();
    let mut tcp = TcpStream::connect(addr).unwrap();
    let peer = local_peer(&tcp);
    // The server may close (and reset) before it read everything.
    let _ = tcp.write_all(bytes);
    let (received, closed) = read_until_closed(&mut tcp, HANDSHAKE_DEADLINE + LATE);
    assert!(closed, "{peer}: never closed");
    (peer, started.elapsed(), received)
}

// ----- handshake flood ---------------------------------------------------------------------------

const MAX_CONNECTIONS: usize = 32;
const FLOOD: usize = 100;
/// TLS clients that try a handshake while the flood fills the server.
const LATE_CLIENTS: usize = 8;

/// A handshake flood: with `max_connections` 32 and the probe holding one session, 100 TCP
/// connections that never handshake. 31 are admitted (holding their slot at most until the
/// handshake deadline); the 69 others are refused at once, at accept, before any handshake:
/// the `X` 7 the server writes goes into the TLS session that never started, so all they get
/// is a close_notify alert, then the end. TLS clients that come meanwhile fail their handshake
/// at once (the official client reports an error), the probe is served, and once the flood
/// leaves new TLS clients are served again. Two rounds.
#[test]
fn a_handshake_flood_past_max_connections_is_refused_at_once_and_recovers() {
    let _serial = serial();
    let pki = Pki::new("flood");
    let mut config = pki.server_config(false);
    config.server.cores = CORES;
    config.limits.max_connections = MAX_CONNECTIONS;
    let server = start_with(config);
    let addr = server.local_addr();
    let tls = raw_client_config(&pki.ca_file(), None);
    let probe = tls_probe(addr, Arc::clone(&tls));
    let refused_per_round = (FLOOD - (MAX_CONNECTIONS - 1) + LATE_CLIENTS) as u64;
    flood_round(&server, &pki, false);
    let refused = metric(addr, &tls, "latchkey_sessions_refused_total");
    assert_eq!(refused, refused_per_round, "sessions refused");
    flood_round(&server, &pki, true);
    let refused = metric(addr, &tls, "latchkey_sessions_refused_total");
    assert!(refused > 2 * refused_per_round, "and the official client's");
    assert_eq!(metric(addr, &tls, TLS_FAILURES), 0, "no TLS failure");
    probe.finish("handshake flood");
}

/// One round of the handshake flood (with the official client too when `official`), from and
/// back to the probe's session alone.
fn flood_round(server: &ServerHandle, pki: &Pki, official: bool) {
    let tls = &raw_client_config(&pki.ca_file(), None);
    let addr = server.local_addr();
    // The sessions of the last round and of the metrics are gone: only the probe's is left.
    assert!(wait_until(PATIENCE, || server.connections() == 1));
    let started = Instant::now();
    let flood: Vec<TcpStream> = (0..FLOOD)
        .map(|_| TcpStream::connect(addr).unwrap())
        .collect();
    let (refusals, slowest) = refused_at_once(&flood, started);
    for received in &refusals {
        assert_eq!(received, &CLOSE_NOTIFY, "what a refused connection gets");
    }
    assert!(
        wait_until(PATIENCE, || server.connections() == MAX_CONNECTIONS),
        "{} sessions",
        server.connections()
    );
    let mut errors = HashSet::new();
    for _ in 0..LATE_CLIENTS {
        errors.insert(late_client_refused(addr, tls));
    }
    let failure = official.then(|| official_client_fails(addr, &pki.ca_file(), None));
    drop(flood);
    let left = Instant::now();
    assert!(
        wait_until(PATIENCE, || server.connections() == 1),
        "the flood's sessions end: {} left",
        server.connections()
    );
    let gone = left.elapsed();
    for nonce in 0..LATE_CLIENTS as u64 {
        let mut conn = Conn::over(raw_connect(addr, Arc::clone(tls)));
        assert_eq!(conn.ping(nonce), Response::Pong { nonce });
        let key = format!("recovered/{nonce}");
        let token = conn.acquire_ok(&key, 5, nonce + 1);
        assert_eq!(conn.release(&key, token), Response::Released { token });
    }
    eprintln!(
        "handshake flood: {} of {FLOOD} refused at once (slowest {slowest:.1?}), {LATE_CLIENTS} \
         late TLS clients failed ({errors:?}), official client: {failure:?}; flood gone \
         {gone:.1?} after it closed, then {LATE_CLIENTS} new TLS clients served",
        refusals.len()
    );
}

/// A close_notify alert in a plaintext record: what a connection refused at accept gets.
const CLOSE_NOTIFY: [u8; 7] = [21, 3, 3, 0, 2, 1, 0];

/// Waits until the connections of `flood` past the limit are closed by the server, at once:
/// what each got, and the slowest close since `started`. The admitted ones stay open.
fn refused_at_once(flood: &[TcpStream], started: Instant) -> (Vec<Vec<u8>>, Duration) {
    let expected = FLOOD - (MAX_CONNECTIONS - 1);
    let (mut received, mut closed) = (vec![Vec::new(); flood.len()], vec![false; flood.len()]);
    let mut slowest = Duration::ZERO;
    let mut poll = || {
        for (i, tcp) in flood.iter().enumerate() {
            if !closed[i] && poll_closed(tcp, &mut received[i]) {
                (closed[i], slowest) = (true, started.elapsed());
            }
        }
        closed.iter().filter(|&&closed| closed).count()
    };
    while poll() < expected && started.elapsed() < PROMPTLY {
        thread::sleep(Duration::from_millis(5));
    }
    // And no admitted connection is closed meanwhile.
    thread::sleep(Duration::from_millis(300));
    assert_eq!(poll(), expected, "refused at once, within {PROMPTLY:?}");
    let refused = received
        .into_iter()
        .zip(closed)
        .filter(|(_, closed)| *closed);
    (refused.map(|(bytes, _)| bytes).collect(), slowest)
}

/// Reads what `tcp` has without waiting, appending it to `bytes`: whether it was closed.
fn poll_closed(mut tcp: &TcpStream, bytes: &mut Vec<u8>) -> bool {
    tcp.set_nonblocking(true).unwrap();
    let mut chunk = [0u8; 64];
    loop {
        match tcp.read(&mut chunk) {
            Ok(0) => return true,
            Ok(n) => bytes.extend_from_slice(&chunk[..n]),
            Err(e) if e.kind() == ErrorKind::WouldBlock => return false,
            Err(_) => return true,
        }
    }
}

/// A TLS client while the server is full: its handshake fails at once. Its error.
fn late_client_refused(addr: SocketAddr, tls: &Arc<ClientConfig>) -> String {
    let started = Instant::now();
    let mut stream = raw_connect(addr, Arc::clone(tls));
    let mut pong = [0u8; 10];
    let outcome = stream
        .write_all(&PING)
        .and_then(|()| stream.read_exact(&mut pong));
    let error = outcome.expect_err("refused while full").to_string();
    let took = started.elapsed();
    assert!(took < PROMPTLY, "refused after {took:?}");
    error
}

/// The official client (trusting `ca`, presenting `cert`) tries an acquire that must fail: an
/// error, not a hang. What it reported.
fn official_client_fails(addr: SocketAddr, ca: &Path, cert: Option<&(PathBuf, PathBuf)>) -> String {
    let client = tls_client(addr, ca, cert.map(|(cert, key)| (&**cert, &**key)));
    let started = Instant::now();
    let result = client.acquire("official/k", Duration::ZERO, Duration::from_secs(30));
    let took = started.elapsed();
    assert!(result.is_err(), "granted: {result:?}");
    assert!(took < PATIENCE, "failed after {took:?}");
    let failure = client.last_session_failure().map(|f| f.to_string());
    format!("{:?} after {took:.1?} ({failure:?})", result.err().unwrap())
}

// ----- refused client certificates ---------------------------------------------------------------

/// With `client_ca_file` set, a client presenting a certificate of another CA, or an expired one
/// of the right CA, is refused: the server's alert fails its first read (TLS 1.3: the client's
/// side of the handshake ends before the server checks its certificate), nothing it sent is
/// executed, and the server logs one line naming the peer and the reason. The official client
/// reports an error, not a hang: for another CA's certificate once the server refuses it, for
/// an expired one before it connects at all. A server process each, so that each reason gets its
/// own first line.
#[test]
fn client_certificates_of_a_wrong_ca_or_expired_are_refused_with_a_line_each() {
    let _serial = serial();
    let pki = Pki::new("certs");
    let wrong = Pki::new("wrong-ca");
    let of_wrong_ca = wrong.leaf("wrong", "billing", &["billing.example"]);
    let (wrong_line, wrong_client) =
        refused_certificate(&pki, "wrong-ca", &of_wrong_ca, "UnknownIssuer", |addr| {
            official_client_fails(addr, &pki.ca_file(), Some(&of_wrong_ca))
        });
    let expired = pki.leaf_with("expired", "billing", &["billing.example"], |params| {
        params.not_before = rcgen::date_time_ymd(2001, 1, 1);
        params.not_after = rcgen::date_time_ymd(2002, 1, 1);
    });
    let (expired_line, expired_client) =
        refused_certificate(&pki, "expired", &expired, "expired", |addr| {
            let cert = Some((&*expired.0, &*expired.1));
            let error = try_tls_client(addr, &pki.ca_file(), cert).err();
            let error = error.expect("an expired certificate is refused");
            assert!(error.to_string().contains("expired"), "{error}");
            error.to_string()
        });
    eprintln!(
        "wrong CA: {wrong_line}\n  official client: {wrong_client}\nexpired: {expired_line}\n  \
         official client: {expired_client}"
    );
}

/// One case of [`client_certificates_of_a_wrong_ca_or_expired_are_refused_with_a_line_each`]:
/// a server requiring client certificates, the probe, a raw client presenting `cert` (the log
/// line must name its peer and contain `reason`), then `official` (given the address). The log
/// line and what `official` returned.
fn refused_certificate(
    pki: &Pki,
    case: &str,
    cert: &(PathBuf, PathBuf),
    reason: &str,
    official: impl FnOnce(SocketAddr) -> String,
) -> (String, String) {
    let (server, log) = spawn_server(pki, case, true);
    let good = pki.leaf(&format!("{case}-good"), "ops", &["ops.example"]);
    let good = raw_client_config(&pki.ca_file(), Some((&good.0, &good.1)));
    let probe = tls_probe(server.addr, Arc::clone(&good));
    let key = format!("certs/{case}");
    let started = Instant::now();
    let mut stream = raw_connect(server.addr, presenting_config(&pki.ca_file(), cert));
    let peer = local_peer(&stream.sock);
    let mut acquire = Vec::new();
    Request::Acquire {
        wait_s: 0,
        lease_s: 30,
        owner: 1,
        key: key.as_bytes(),
    }
    .encode(&mut acquire);
    let mut answer = [0u8; 64];
    let outcome = stream
        .write_all(&acquire)
        .and_then(|()| stream.read(&mut answer));
    let error = outcome.expect_err("refused").to_string();
    let took = started.elapsed();
    assert!(error.contains("alert"), "{case}: {error}");
    assert!(took < PROMPTLY, "{case}: refused after {took:?}");
    let line = wait_for_line(
        &log,
        &["TLS error", &format!("of {peer}:"), reason],
        PATIENCE,
    );
    let mut conn = Conn::over(raw_connect(server.addr, Arc::clone(&good)));
    assert_eq!(conn.state(&key), KeyState::FREE, "{case}: nothing granted");
    expect_metric(server.addr, &good, TLS_FAILURES, 1);
    let official = official(server.addr);
    // However many sessions the official client tried, still one line per core at most (the
    // other core's names one of the official client's sessions).
    let lines = rate_limited_lines(&log, "TLS error");
    assert!(lines.contains(&line), "{lines:#?}");
    eprintln!("{case}: the raw client got {error:?} after {took:.1?}");
    probe.finish(&format!("client certificate: {case}"));
    (line, official)
}

// ----- a client that never reads -----------------------------------------------------------------

/// The never-reading client's requests: acquires and queries of `keys` numbered from 1, every
/// id sent (or being sent) recorded in `ids`.
struct Pipeliner {
    keys: Vec<String>,
    ids: Vec<u64>,
}

impl Pipeliner {
    /// The next 256 requests, encoded.
    fn batch(&mut self) -> Vec<u8> {
        let mut bytes = Vec::new();
        for i in 0..256 {
            let id = self.ids.len() as u64 + 1;
            self.ids.push(id);
            let key = self.keys[i % self.keys.len()].as_bytes();
            let request = match i % 2 {
                0 => Request::Acquire {
                    wait_s: 0,
                    lease_s: 1,
                    owner: id,
                    key,
                },
                _ => Request::Query { nonce: id, key },
            };
            request.encode(&mut bytes);
        }
        bytes
    }
}

/// Where a never-reading client stood once the server stopped reading it.
struct Paused {
    /// Plaintext rustls took (most of it sent).
    written: u64,
    /// From the first write to the last that made progress.
    took: Duration,
    /// The highest resident memory seen while nothing was taken.
    rss_max: u64,
    /// The batch being written, of which `offset` bytes were.
    pending: Vec<u8>,
    offset: usize,
}

/// Pipelines batches on `client` until nothing is taken for half a second (and that within 15
/// seconds: the server must stop reading a session that never reads).
fn write_until_paused(client: &mut HandDriven, pipeliner: &mut Pipeliner) -> Paused {
    let (mut pending, mut offset) = (pipeliner.batch(), 0);
    let (mut written, mut rss_max) = (0u64, rss_bytes());
    let started = Instant::now();
    let mut progress = started;
    while progress.elapsed() < Duration::from_millis(500) {
        let elapsed = started.elapsed();
        assert!(
            elapsed < Duration::from_secs(15),
            "still read: {written} bytes"
        );
        match client.push(&pending[offset..]) {
            0 => {
                rss_max = rss_max.max(rss_bytes());
                thread::sleep(Duration::from_millis(5));
            }
            n => {
                (written, offset, progress) = (written + n as u64, offset + n, Instant::now());
                if offset == pending.len() {
                    (pending, offset) = (pipeliner.batch(), 0);
                }
            }
        }
    }
    Paused {
        written,
        took: progress - started,
        rss_max,
        pending,
        offset,
    }
}

/// Reads on `client` (writing the rest of `paused`'s batch meanwhile) until `count` answers
/// came, within a minute.
fn read_answers(client: &mut HandDriven, paused: &Paused, count: usize) -> Vec<Response> {
    let started = Instant::now();
    let (mut offset, mut plaintext, mut answers) = (paused.offset, Vec::new(), Vec::new());
    while answers.len() < count {
        assert!(
            started.elapsed() < Duration::from_secs(60),
            "{} answers",
            answers.len()
        );
        offset += client.push(&paused.pending[offset..]);
        let before = plaintext.len();
        client.pull(&mut plaintext);
        let mut used = 0;
        while let Some((answer, n)) = parse_response(&plaintext[used..]).expect("valid") {
            answers.push(answer);
            used += n;
        }
        plaintext.drain(..used);
        if plaintext.len() == before && used == 0 {
            thread::sleep(Duration::from_millis(1));
        }
    }
    answers
}

/// A client pipelines acquires and queries over TLS and never reads: the server stops reading
/// it once its output is over the session's bound (rustls holds at most 64 KiB more), so the
/// client stalls for good, memory stays bounded and the probe is served. One such client that
/// then closes is cleaned up (its session ends); one that then reads gets every answer.
#[test]
fn a_tls_pipeliner_that_never_reads_is_paused_then_served_or_cleaned_up() {
    let _serial = serial();
    let pki = Pki::new("never-reads");
    let mut config = pki.server_config(false);
    config.server.cores = CORES;
    let server = start_with(config);
    let addr = server.local_addr();
    let tls = raw_client_config(&pki.ca_file(), None);
    let probe = tls_probe(addr, Arc::clone(&tls));
    let rss_before = rss_bytes();
    let keys: Vec<String> = (0..CORES)
        .flat_map(|partition| common::server::keys_on_partition("never", partition, CORES, 4))
        .collect();
    let mut closer = HandDriven::connect(addr, &tls);
    let mut pipeliner = Pipeliner {
        keys: keys.clone(),
        ids: Vec::new(),
    };
    let paused = write_until_paused(&mut closer, &mut pipeliner);
    assert_eq!(server.connections(), 2, "paused, not disconnected");
    drop(closer);
    assert!(
        wait_until(PATIENCE, || server.connections() == 1),
        "the closer's session ends"
    );
    let mut reader = HandDriven::connect(addr, &tls);
    let mut pipeliner = Pipeliner {
        keys,
        ids: Vec::new(),
    };
    let paused_again = write_until_paused(&mut reader, &mut pipeliner);
    let growth = paused
        .rss_max
        .max(paused_again.rss_max)
        .saturating_sub(rss_before);
    assert!(growth < 64 << 20, "memory grew {growth} bytes");
    let answers = read_answers(&mut reader, &paused_again, pipeliner.ids.len());
    let mut answered: Vec<u64> = answers.iter().map(Response::correlation_id).collect();
    answered.sort_unstable();
    assert_eq!(
        answered, pipeliner.ids,
        "every request answered exactly once"
    );
    eprintln!(
        "never-reading TLS pipeliner: paused after {} bytes ({:.1?}), then after {} bytes \
         ({:.1?}); {} answers delivered; memory growth {} KiB",
        paused.written,
        paused.took,
        paused_again.written,
        paused_again.took,
        answers.len(),
        growth / 1024
    );
    probe.finish("never-reading TLS pipeliner");
}
