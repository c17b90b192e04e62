//! Tests of `latchkey stats` and `latchkey keys` without a latchkey server: the renderings on
//! canned JSON, the answer checks on canned bytes, and the request over a scripted socket.

use std::io::{BufRead, BufReader, Write};
use std::net::TcpListener;
use std::thread;

use super::*;

/// The `GET /stats` object of the protocol's documentation, with a field this client does
/// not know (`future_field`).
const STATS: &str = r#"{"version":"0.1.0","commit":"6c97a315b5de","uptime_seconds":12.5,
  "cores":2,"shutting_down":false,"future_field":{"x":1},
  "limits":{"max_connections":10000,"max_keys":4000000,"max_waiters_per_key":1024,
            "max_pending_per_session":1024,"max_key_bytes":1024},
  "sessions":3,"sessions_refused":0,"locks_held":10,"waiters":2,
  "acquires":{"acquired":12,"timeout":1,"busy":2,"rejected":0},
  "releases":{"released":2,"not_held":0},"extends":{"extended":5,"not_held":1},
  "cancels":1,"lease_expirations":0,
  "busy":{"waiters_per_key":0,"keys":0,"pending_per_session":2,"shutdown":0,"tokens":0},
  "acquire_wait_seconds":{"count":5,"sum":0.5,"max":0.12,"p50":0.01,"p99":0.25,
                          "buckets":[[0.0001,0],[0.00025,1],[0.01,3],[0.25,5]]},
  "lock_hold_seconds":{"count":0,"sum":0,"max":0,"p50":null,"p99":null,"buckets":[]},
  "loop_iteration_seconds":[
    {"core":0,"count":2000,"sum":0.02,"max":0.0011,
     "buckets":[[0.000064,1900],[0.0005,1985],[0.001,1990],[0.002,2000]]},
    {"core":1,"count":1500,"sum":0.01,"max":0.0004,
     "buckets":[[0.000064,1490],[0.0005,1500],[0.001,1500],[0.002,1500]]}]}"#;

const STATS_TEXT: &str = "\
# Server
version: 0.1.0
commit:  6c97a315b5de
uptime:  12.5s
cores:   2
state:   serving

# Sessions
open:    3
refused: 0

# Locks
held:              10
waiters:           2
acquires:          15 (1.20/s): acquired 12, busy 2, rejected 0, timeout 1
releases:          2 (0.16/s): not_held 0, released 2
extends:           6 (0.48/s): extended 5, not_held 1
cancels:           1 (0.08/s)
lease_expirations: 0 (0.00/s)

# Latency
acquire_wait: p50 ≤ 10 ms, p99 ≤ 250 ms, max 120 ms (5 acquires that queued)
lock_hold:    no samples yet (0 holds that ended)

# Busy
keys:                0
pending_per_session: 2
shutdown:            0
tokens:              0
waiters_per_key:     0

# Loop
worst_iteration: 1.1 ms (core 0)
core 0:          10 of 2000 iterations over 1 ms
core 1:          0 of 1500 iterations over 1 ms
";

fn json(text: &str) -> Value {
    serde_json::from_str(text).unwrap()
}

#[test]
fn stats_render_as_sections() {
    let rendered = render_stats(&json(STATS));
    assert_eq!(rendered, STATS_TEXT, "\n{rendered}");
}

#[test]
fn stats_missing_fields_show_as_dashes() {
    let rendered = render_stats(&json("{}"));
    assert!(rendered.contains("\nversion: -\n"), "{rendered}");
    assert!(rendered.contains("\nacquires:          -\n"), "{rendered}");
    assert!(rendered.contains("\nacquire_wait: -\n"), "{rendered}");
    assert!(rendered.contains("\nworst_iteration: -\n"), "{rendered}");
    assert!(!rendered.contains("state:"));
    let odd = json(r#"{"uptime_seconds":0,"cancels":3,"acquires":"many","cores":"two"}"#);
    let rendered = render_stats(&odd);
    assert!(
        rendered.contains("cancels:           3 (-/s)"),
        "{rendered}"
    );
    assert!(rendered.contains("acquires:          -\n"), "{rendered}");
    assert!(rendered.contains("cores:   -\n"), "{rendered}");
}

#[test]
fn uptime_is_seconds_then_whole_units() {
    assert_eq!(uptime_text_of(0.04), "0.0s");
    assert_eq!(uptime_text_of(59.94), "59.9s");
    assert_eq!(uptime_text_of(60.0), "1m 0s");
    assert_eq!(uptime_text_of(3725.9), "1h 2m 5s");
    assert_eq!(uptime_text_of(2.0 * 86_400.0 + 1.0), "2d 0h 0m 1s");
}

fn uptime_text_of(seconds: f64) -> String {
    let stats = json(&format!(r#"{{"uptime_seconds":{seconds}}}"#));
    let rendered = render_stats(&stats);
    let line = rendered
        .lines()
        .find(|line| line.starts_with("uptime:"))
        .unwrap();
    line["uptime:".len()..].trim().to_owned()
}

#[test]
fn keys_render_as_an_aligned_table() {
    let long = "k".repeat(100);
    let keys = json(&format!(
        r#"[{{"key":"jobs/a","owner":7,"peer":"127.0.0.1:50122","held_ms":1200,
              "lease_ms":28000,"waiters":0,"extra":true}},
            {{"key":"{long}","owner":"18446744073709551615","peer":null,"held_ms":120000,
              "lease_ms":0,"waiters":3}},
            {{"key":"tab\there"}}]"#
    ));
    let rendered = render_keys(keys.as_array().unwrap());
    let shown_long = format!("{}… (100 bytes)", "k".repeat(64));
    let width = shown_long.chars().count();
    let pad = |text: &str| format!("{text:<width$}");
    let expected = [
        format!(
            "{}  OWNER                 PEER             HELD    LEASE  WAITERS",
            pad("KEY")
        ),
        format!(
            "{}  7                     127.0.0.1:50122  1200ms  28s    0",
            pad("jobs/a")
        ),
        format!(
            "{}  18446744073709551615  -                2m      0s     3",
            shown_long
        ),
        format!(
            "{}  -                     -                -       -      -",
            pad("tab\\there")
        ),
    ];
    assert_eq!(rendered, expected.join("\n") + "\n", "\n{rendered}");
}

#[test]
fn the_keys_target_percent_encodes_the_prefix() {
    assert_eq!(keys_target("", 100), "/keys?prefix=&limit=100");
    assert_eq!(
        keys_target("jobs/a-b_c.d~e", 7),
        "/keys?prefix=jobs/a-b_c.d~e&limit=7"
    );
    assert_eq!(
        keys_target("a b+c&d=é%", 1),
        "/keys?prefix=a%20b%2Bc%26d%3D%C3%A9%25&limit=1"
    );
}

#[track_caller]
fn assert_failure(answer: &[u8], exit_code: u8, says: &str) {
    let failure = answer_body(answer).unwrap_err();
    assert_eq!(failure.exit_code, exit_code, "{failure:?}");
    assert!(
        failure.message.contains(says),
        "{failure:?} does not say {says:?}"
    );
}

#[test]
fn answers_are_checked() {
    let ok =
        b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\ncontent-length: 3\r\n\r\n[]\nxx";
    assert_eq!(answer_body(ok).unwrap(), b"[]\n");
    let without_length = b"HTTP/1.1 200 OK\r\nConnection: close\r\n\r\n{}";
    assert_eq!(answer_body(without_length).unwrap(), b"{}");
    let refused: &[u8] = b"HTTP/1.1 400 Bad Request\r\nContent-Length: 39\r\n\r\n\
        limit must be a number from 1 to 10000\n";
    let says = "the server answered `400 Bad Request`: limit must be a number from 1 to 10000";
    assert_failure(refused, EXIT_REJECTED, says);
    assert_failure(
        b"HTTP/1.1 503 Service Unavailable\r\n\r\n",
        EXIT_REJECTED,
        "503",
    );
    let short = b"HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\n{}";
    assert_failure(short, EXIT_INDETERMINATE, "cut short: 2 of 10 bytes");
    let malformed = b"HTTP/1.1 200 OK\r\nContent-Length: ten\r\n\r\n{}";
    assert_failure(malformed, EXIT_REJECTED, "length is malformed");
    assert_failure(b"HTTP/1.1 200 OK\r\n", EXIT_REJECTED, "no end of head");
    assert_failure(b"", EXIT_INDETERMINATE, "without an answer");
    assert_failure(
        b"-ERR unknown command 'GET'\r\n",
        EXIT_REJECTED,
        "not a latchkey server",
    );
    let mut x7 = Vec::new();
    Response::Error {
        code: ErrorCode::SessionRefused,
        id: 0,
    }
    .encode(&mut x7);
    assert_failure(&x7, EXIT_BUSY, "too many (X 7)");
    let mut x1 = Vec::new();
    Response::Error {
        code: ErrorCode::UnknownOp,
        id: 0,
    }
    .encode(&mut x1);
    assert_failure(&x1, EXIT_REJECTED, "without the admin requests");
}

#[test]
fn an_answer_that_cannot_be_http_is_recognized_early() {
    assert!(!surely_not_http(b"", b"HTTP/1.1 200"));
    assert!(!surely_not_http(b"HT", b"TP"));
    assert!(surely_not_http(b"", b"-ERR unknown command\r\n"));
    assert!(surely_not_http(b"HTTP/2", b" 200"));
    assert!(!surely_not_http(b"", b"X\x01"));
    assert!(surely_not_http(b"X\x01\0\0\0\0\0\0\0", b"\0\n"));
    // A TLS record's header: wait for its version.
    assert!(!surely_not_http(b"", b"\x15\x03"));
    assert!(surely_not_http(b"\x15", b"\x03\x03\0\x02\x02\x32"));
}

#[test]
fn a_tls_answer_to_plaintext_says_to_use_tls() {
    // The alert a TLS server sends a plaintext request (decode_error), and a ServerHello start.
    for answer in [
        &b"\x15\x03\x03\0\x02\x02\x32"[..],
        b"\x16\x03\x01\0\x7a\x02",
    ] {
        assert_failure(answer, EXIT_UNAVAILABLE, latchkey_client::SPEAKS_TLS);
        assert_failure(answer, EXIT_UNAVAILABLE, "--tls-ca");
    }
    assert!(!is_tls_record(b"\x15\x03"), "too short to tell");
    assert!(!is_tls_record(b"\x15\x02\x00"), "not TLS 1.x");
    assert!(
        !is_tls_record(b"\x17\x03\x03"),
        "application data is never the first record"
    );
}

/// A one-shot server on 127.0.0.1: reads the request head, checks its first line, answers
/// `answer` and closes (or, with `None`, stays silent until the client gives up).
fn scripted(expected_line: &'static str, answer: Option<Vec<u8>>) -> SocketAddr {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap();
    thread::spawn(move || {
        let (stream, _) = listener.accept().unwrap();
        let mut reader = BufReader::new(stream);
        let mut head = Vec::new();
        loop {
            let mut line = String::new();
            if reader.read_line(&mut line).unwrap_or(0) == 0 || line == "\r\n" {
                break;
            }
            head.push(line);
        }
        assert_eq!(head[0], format!("{expected_line}\r\n"));
        assert!(head.contains(&format!("Host: {addr}\r\n")), "{head:?}");
        assert!(
            head.contains(&"Connection: close\r\n".to_owned()),
            "{head:?}"
        );
        let mut stream = reader.into_inner();
        match answer {
            Some(answer) => {
                let _ = stream.write_all(&answer);
            }
            // Hold the connection open until the client closes it.
            None => while reader_closed(&mut stream).is_none() {},
        }
    });
    addr
}

fn reader_closed(stream: &mut TcpStream) -> Option<()> {
    let mut byte = [0; 1];
    match stream.read(&mut byte) {
        Ok(0) | Err(_) => Some(()),
        Ok(_) => None,
    }
}

#[test]
fn fetch_gets_the_body_of_a_200() {
    let answer = b"HTTP/1.1 200 OK\r\nContent-Length: 3\r\nConnection: close\r\n\r\n[]\n".to_vec();
    let addr = scripted("GET /keys?prefix=a%20b&limit=5 HTTP/1.1", Some(answer));
    let body = fetch(
        &[addr],
        &keys_target("a b", 5),
        Duration::from_secs(5),
        None,
    )
    .unwrap();
    assert_eq!(body, b"[]\n");
}

#[test]
fn fetch_failures_name_the_address_and_the_exit_code() {
    let dead = TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap();
    let failure = fetch(&[dead], "/stats", Duration::from_secs(5), None).unwrap_err();
    assert_eq!(failure.exit_code, EXIT_UNAVAILABLE);
    let says = format!("cannot reach the server: {dead}: cannot connect: connection refused");
    assert!(failure.message.starts_with(&says), "{}", failure.message);
    let hint = "nothing listens there; --retry-refused keeps trying until --transport-timeout 5s \
                runs out)";
    assert!(failure.message.ends_with(hint), "{}", failure.message);
    // With --retry-refused, until the timeout runs out (never early).
    let patience = Patience {
        timeout: Duration::from_millis(300),
        retry_refused: true,
    };
    let start = Instant::now();
    let failure = fetch(&[dead], "/stats", patience, None).unwrap_err();
    assert!(start.elapsed() >= Duration::from_millis(300));
    assert!(
        failure.message.ends_with("of --transport-timeout 300ms)"),
        "{}",
        failure.message
    );

    let silent = scripted("GET /stats HTTP/1.1", None);
    let start = Instant::now();
    let failure = fetch(&[silent], "/stats", Duration::from_millis(200), None).unwrap_err();
    assert!(start.elapsed() < Duration::from_secs(5));
    assert_eq!(failure.exit_code, EXIT_INDETERMINATE);
    let says = format!("{silent}: no complete answer within --transport-timeout");
    assert_eq!(failure.message, says);

    let oversized = vec![b'x'; HEAD_BYTES_MAX + BODY_BYTES_MAX + 1];
    let mut answer = b"HTTP/1.1 200 OK\r\n\r\n".to_vec();
    answer.extend_from_slice(&oversized);
    let large = scripted("GET /stats HTTP/1.1", Some(answer));
    let failure = fetch(&[large], "/stats", Duration::from_secs(10), None).unwrap_err();
    assert_eq!(failure.exit_code, EXIT_REJECTED);
    assert!(
        failure
            .message
            .ends_with("the answer is larger than 16 MiB"),
        "{failure:?}"
    );
}
