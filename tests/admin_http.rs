//! The admin HTTP requests on the lock port (`GET /metrics`, `/stats`, `/keys`, `/health`, and
//! `HEAD` of them) against a real two-core server: exact figures after a known workload, the
//! key listing, and hostile HTTP clients (split heads, oversized heads, other methods, slow and
//! flooding clients) beside a well-behaved lock session whose p99 must stay low.

use common::probe::{key_per_partition, serial, Probe};
use common::server::{start_with, test_config, Conn};
use latchkey_client::protocol::{Request, Response};
use serde_json::Value;
use std::io::{ErrorKind, Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::thread;
use std::time::{Duration, Instant};

const CORES: usize = 2;

/// Sends `request` raw and reads the whole answer until the server closes: (status, body).
fn http_raw(addr: SocketAddr, request: &[u8]) -> (u16, String) {
    let mut stream = TcpStream::connect(addr).unwrap();
    stream
        .set_read_timeout(Some(Duration::from_secs(10)))
        .unwrap();
    stream.write_all(request).unwrap();
    read_answer(&mut stream)
}

fn read_answer(stream: &mut TcpStream) -> (u16, String) {
    let mut answer = Vec::new();
    stream
        .read_to_end(&mut answer)
        .expect("the answer, then the end");
    let text = String::from_utf8(answer).expect("utf-8");
    let (head, body) = text.split_once("\r\n\r\n").expect("a head and a body");
    let status = head[9..12].parse().expect("a status code");
    let length: usize = head
        .lines()
        .find_map(|line| line.strip_prefix("Content-Length: "))
        .expect("a length")
        .parse()
        .unwrap();
    assert_eq!(body.len(), length, "body length");
    assert!(head.contains("Connection: close"));
    (status, body.to_string())
}

fn get(addr: SocketAddr, path: &str) -> (u16, String) {
    http_raw(
        addr,
        format!("GET {path} HTTP/1.1\r\nHost: test\r\n\r\n").as_bytes(),
    )
}

fn get_json(addr: SocketAddr, path: &str) -> Value {
    let (status, body) = get(addr, path);
    assert_eq!(status, 200, "{path}: {body}");
    serde_json::from_str(&body).expect("JSON")
}

/// The value of one sample line of the metrics text.
fn sample(metrics: &str, series: &str) -> f64 {
    metrics
        .lines()
        .find_map(|line| line.strip_prefix(series)?.strip_prefix(' '))
        .unwrap_or_else(|| panic!("no sample {series} in\n{metrics}"))
        .parse()
        .unwrap()
}

#[test]
fn every_figure_matches_a_known_workload() {
    let _serial = serial();
    let mut config = test_config(CORES);
    config.limits.max_waiters_per_key = 1;
    let server = start_with(config);
    let addr = server.local_addr();
    let keys = key_per_partition("figures", CORES);
    let (k1, k2) = (keys[0].as_str(), keys[1].as_str());
    let (mut a, mut b, mut c, mut d) = (
        Conn::connect(addr),
        Conn::connect(addr),
        Conn::connect(addr),
        Conn::connect(addr),
    );
    let token_a = a.acquire_ok(k1, 60, 1); // acquired 1
    assert_eq!(b.acquire(k1, 0, 60, 2), Response::Timeout { owner: 2 }); // timeout 1
    b.send_acquire(k1, 30, 60, 3); // queued (the one waiter k1 may have)
                                   // Asked on the same session: answered after the acquire was queued (one key, one order).
    match b.query(k1, 1) {
        Response::State {
            held: true,
            waiters: 1,
            ..
        } => {}
        other => panic!("k1 held with one waiter: {other:?}"),
    }
    assert_eq!(c.acquire(k1, 30, 60, 4), Response::Busy { owner: 4 }); // busy waiters_per_key 1
    assert_eq!(
        a.release(k1, token_a),
        Response::Released { token: token_a }
    ); // released 1, hold 1
    let token_b = b.recv_granted(3); // acquired 2, wait 1
    assert_eq!(a.release(k1, token_a), Response::NotHeld { token: token_a }); // not_held 1
    assert_eq!(
        b.extend(k1, 60, token_b),
        Response::Extended { token: token_b }
    );
    assert_eq!(
        b.extend(k1, 60, token_a),
        Response::NotHeld { token: token_a }
    );
    c.send_acquire(k1, 30, 60, 5); // queued
    c.cancel(k1, 5); // cancels 1, timeout 2, wait 2
    assert_eq!(c.recv(), Response::Timeout { owner: 5 });
    d.send(Request::Acquire {
        wait_s: 0,
        lease_s: 0,
        owner: 6,
        key: k2.as_bytes(),
    });
    assert_eq!(d.recv().op(), b'X'); // rejected 1
    d.acquire_ok(k2, 1, 7); // acquired 3
    thread::sleep(Duration::from_millis(1500)); // k2 expires: expirations 1, hold 2
    assert_eq!(
        d.query(k2, 8),
        Response::State {
            nonce: 8,
            held: false,
            lease_ms: 0,
            waiters: 0
        }
    );

    let stats = get_json(addr, "/stats");
    let expect = |path: &str, want: u64| {
        let got = stats
            .pointer(path)
            .unwrap_or_else(|| panic!("no {path} in {stats}"));
        assert_eq!(got.as_u64(), Some(want), "{path} in {stats}");
    };
    for (path, want) in [
        ("/acquires/acquired", 3),
        ("/acquires/timeout", 2),
        ("/acquires/busy", 1),
        ("/acquires/rejected", 1),
        ("/busy/waiters_per_key", 1),
        ("/busy/keys", 0),
        ("/busy/pending_per_session", 0),
        ("/busy/shutdown", 0),
        ("/releases/released", 1),
        ("/releases/not_held", 1),
        ("/extends/extended", 1),
        ("/extends/not_held", 1),
        ("/cancels", 1),
        ("/lease_expirations", 1),
        ("/locks_held", 1),
        ("/waiters", 0),
        ("/sessions", 5), // four lock sessions and this request
        ("/sessions_refused", 0),
        ("/acquire_wait_seconds/count", 2),
        ("/lock_hold_seconds/count", 2),
        ("/cores", CORES as u64),
    ] {
        expect(path, want);
    }
    let loops = stats["loop_iteration_seconds"].as_array().unwrap();
    assert_eq!(loops.len(), CORES);
    assert!(loops.iter().all(|core| core["count"].as_u64().unwrap() > 0));
    let hold_sum = stats["lock_hold_seconds"]["sum"].as_f64().unwrap();
    assert!(hold_sum >= 1.0, "k2 was held a whole second: {hold_sum}");

    let (status, metrics) = get(addr, "/metrics");
    assert_eq!(status, 200);
    for (series, want) in [
        ("latchkey_acquires_total{result=\"acquired\"}", 3.0),
        ("latchkey_acquires_total{result=\"timeout\"}", 2.0),
        ("latchkey_acquires_total{result=\"busy\"}", 1.0),
        ("latchkey_acquires_total{result=\"rejected\"}", 1.0),
        ("latchkey_releases_total{result=\"released\"}", 1.0),
        ("latchkey_releases_total{result=\"not_held\"}", 1.0),
        ("latchkey_extends_total{result=\"extended\"}", 1.0),
        ("latchkey_extends_total{result=\"not_held\"}", 1.0),
        ("latchkey_cancels_total", 1.0),
        ("latchkey_lease_expirations_total", 1.0),
        ("latchkey_busy_total{reason=\"waiters_per_key\"}", 1.0),
        ("latchkey_busy_total{reason=\"shutdown\"}", 0.0),
        ("latchkey_locks_held", 1.0),
        ("latchkey_waiters", 0.0),
        ("latchkey_sessions", 5.0),
        ("latchkey_sessions_refused_total", 0.0),
        ("latchkey_acquire_wait_seconds_count", 2.0),
        ("latchkey_lock_hold_seconds_count", 2.0),
        ("latchkey_acquire_wait_seconds_bucket{le=\"+Inf\"}", 2.0),
    ] {
        assert_eq!(sample(&metrics, series), want, "{series}");
    }
    for core in 0..CORES {
        let count = sample(
            &metrics,
            &format!("latchkey_loop_iteration_seconds_count{{core=\"{core}\"}}"),
        );
        assert!(count > 0.0);
    }
    assert!(metrics.contains("latchkey_build_info{version=\""));
    assert!(metrics.trim_end().ends_with("# EOF"));
}

#[test]
fn keys_lists_holders_with_owner_peer_and_waiters_and_never_a_token() {
    let _serial = serial();
    let server = start_with(test_config(CORES));
    let addr = server.local_addr();
    let (mut a, mut b, mut c) = (
        Conn::connect(addr),
        Conn::connect(addr),
        Conn::connect(addr),
    );
    let token_a = a.acquire_ok("app/a", 60, 11);
    let token_b = b.acquire_ok("app/b", 60, 12);
    c.send_acquire("app/b", 30, 60, 13);
    assert_eq!(c.state("app/b").waiters, 1, "queued before the listing");
    let token_other = c.acquire_ok("other/c", 60, 14);
    // An owner id beyond 2^53, where a JSON number stops being exact in JavaScript and `jq`.
    let mut d = Conn::connect(addr);
    let large = u64::MAX - 1;
    let token_large = d.acquire_ok("app/large", 60, large);
    let peer_of = |conn: &Conn| conn.stream.local_addr().unwrap().to_string();
    thread::sleep(Duration::from_millis(50));
    let (status, body) = get(addr, "/keys?prefix=app%2F");
    assert_eq!(status, 200);
    for token in [token_a, token_b, token_other, token_large] {
        assert!(!body.contains(&token.to_string()), "a token in {body}");
    }
    let listed: Value = serde_json::from_str(&body).unwrap();
    let listed = listed.as_array().unwrap();
    assert_eq!(listed.len(), 3, "{body}");
    assert_eq!(listed[0]["key"], "app/a");
    assert_eq!(listed[0]["owner"], "11");
    assert_eq!(listed[0]["peer"], peer_of(&a).as_str());
    assert_eq!(listed[0]["waiters"], 0);
    assert_eq!(listed[1]["key"], "app/b");
    assert_eq!(listed[1]["owner"], "12");
    assert_eq!(listed[1]["peer"], peer_of(&b).as_str());
    assert_eq!(listed[1]["waiters"], 1);
    assert_eq!(listed[2]["key"], "app/large");
    assert_eq!(listed[2]["owner"], large.to_string().as_str());
    assert!(
        body.contains("\"owner\":\"18446744073709551614\""),
        "{body}"
    );
    let lease_ms = listed[0]["lease_ms"].as_u64().unwrap();
    assert!((55_000..=60_000).contains(&lease_ms), "{lease_ms}");
    assert!(listed[0]["held_ms"].as_u64().unwrap() < 5_000);
    // The limit keeps the first keys in key order; every key without a prefix.
    let first = get_json(addr, "/keys?limit=1");
    assert_eq!(first.as_array().unwrap().len(), 1);
    assert_eq!(first[0]["key"], "app/a");
    assert_eq!(get_json(addr, "/keys").as_array().unwrap().len(), 4);
    // The holder's session closed: its hold stays, its peer is gone.
    drop(a);
    thread::sleep(Duration::from_millis(200));
    let after = get_json(addr, "/keys?prefix=app/a");
    assert_eq!(after[0]["key"], "app/a");
    assert_eq!(after[0]["peer"], Value::Null);
    assert_eq!(get(addr, "/keys?limit=0").0, 400);
    assert_eq!(get(addr, "/keys?limit=10001").0, 400);
}

#[test]
fn odd_requests_are_answered_or_closed() {
    let _serial = serial();
    let server = start_with(test_config(CORES));
    let addr = server.local_addr();
    assert_eq!(get(addr, "/health"), (200, "serving\n".to_string()));
    assert_eq!(get(addr, "/nope").0, 404);
    assert_eq!(http_raw(addr, b"GET /metrics\r\n\r\n").0, 400);
    // A head split byte by byte.
    let mut stream = TcpStream::connect(addr).unwrap();
    stream.set_nodelay(true).unwrap();
    stream
        .set_read_timeout(Some(Duration::from_secs(10)))
        .unwrap();
    for byte in b"GET /health HTTP/1.1\r\nHost: split\r\n\r\n" {
        stream.write_all(&[*byte]).unwrap();
        thread::sleep(Duration::from_millis(2));
    }
    assert_eq!(read_answer(&mut stream).0, 200);
    // A 9 KiB head.
    let mut big = b"GET /metrics HTTP/1.1\r\nX-Filler: ".to_vec();
    big.resize(9 * 1024, b'a');
    big.extend_from_slice(b"\r\n\r\n");
    assert_eq!(http_raw(addr, &big).0, 431);
    // HEAD: the answer to GET without its body (a load balancer's probe), and its length.
    for (path, status, length) in [("/health", 200, 8), ("/nope", 404, 80)] {
        let mut stream = TcpStream::connect(addr).unwrap();
        stream
            .set_read_timeout(Some(Duration::from_secs(10)))
            .unwrap();
        let request = format!("HEAD {path} HTTP/1.1\r\nHost: probe\r\n\r\n");
        stream.write_all(request.as_bytes()).unwrap();
        let mut answer = String::new();
        stream
            .read_to_string(&mut answer)
            .expect("the head, then the end");
        let status_line = format!("HTTP/1.1 {status} ");
        assert!(answer.starts_with(&status_line), "{answer}");
        assert!(
            answer.contains(&format!("Content-Length: {length}\r\n")),
            "{answer}"
        );
        assert!(answer.ends_with("\r\n\r\n"), "no body: {answer}");
    }
    // Other methods are not admin requests: the lock protocol refuses them and closes.
    for request in [
        &b"POST /metrics HTTP/1.1\r\n\r\n"[..],
        b"PUT / HTTP/1.1\r\n\r\n",
    ] {
        let mut stream = TcpStream::connect(addr).unwrap();
        stream
            .set_read_timeout(Some(Duration::from_secs(10)))
            .unwrap();
        stream.write_all(request).unwrap();
        let mut answer = Vec::new();
        stream.read_to_end(&mut answer).expect("closed");
        assert_eq!(answer.first(), Some(&b'X'), "{answer:?}");
    }
    // The lock protocol still works on the same port.
    let mut conn = Conn::connect(addr);
    assert_eq!(conn.ping(5), Response::Pong { nonce: 5 });
}

#[test]
fn slow_and_flooding_http_clients_never_delay_a_lock_session() {
    let _serial = serial();
    let server = start_with(test_config(CORES));
    let addr = server.local_addr();
    let probe = Probe::start(addr, CORES);
    // Slow clients: half a head each, then nothing; more than the cores serve at once.
    let started = Instant::now();
    let slow: Vec<TcpStream> = (0..40)
        .map(|_| {
            let mut stream = TcpStream::connect(addr).unwrap();
            stream
                .set_read_timeout(Some(Duration::from_secs(15)))
                .unwrap();
            stream.write_all(b"GET /metrics HTTP/1.1\r\nHost:").unwrap();
            stream
        })
        .collect();
    // Meanwhile, a flood of whole requests: each is answered (200, or 503 when the cores are
    // busy with the slow ones).
    for _ in 0..200 {
        let (status, _) = get(addr, "/stats");
        assert!(status == 200 || status == 503, "{status}");
    }
    let mut statuses = Vec::new();
    for mut stream in slow {
        statuses.push(read_answer(&mut stream).0);
    }
    let waited = started.elapsed();
    // Those the cores took were closed at the 5 s read deadline (never early); the others
    // were refused at once.
    assert!(
        statuses.iter().all(|&s| s == 408 || s == 503),
        "{statuses:?}"
    );
    assert!(
        statuses.contains(&408) && statuses.contains(&503),
        "{statuses:?}"
    );
    assert!(
        waited >= Duration::from_secs(5),
        "closed before the deadline: {waited:?}"
    );
    assert!(waited < Duration::from_secs(15), "{waited:?}");
    probe.finish("slow and flooding HTTP clients");
}

#[test]
fn health_turns_503_while_shutting_down() {
    let _serial = serial();
    let server = start_with(test_config(CORES));
    let addr = server.local_addr();
    assert_eq!(get(addr, "/health").0, 200);
    let mut stream = TcpStream::connect(addr).unwrap();
    stream
        .set_read_timeout(Some(Duration::from_secs(10)))
        .unwrap();
    stream.write_all(b"GET /health HTTP/1.1\r\n").unwrap();
    thread::sleep(Duration::from_millis(100));
    server.shutdown();
    thread::sleep(Duration::from_millis(100));
    match stream.write_all(b"\r\n") {
        Ok(()) => {}
        Err(e) if e.kind() == ErrorKind::BrokenPipe => panic!("closed before answering"),
        Err(e) => panic!("{e}"),
    }
    let (status, body) = read_answer(&mut stream);
    assert_eq!((status, body.as_str()), (503, "shutting down\n"));
    server.join().expect("stops cleanly");
}
