//! Admin requests in the deterministic harness: gathering over cores, bounded scans, and the
//! deadline when a core does not answer.

use crate::server::harness::{Client, Harness, Limits};
use latchkey_client::protocol::{Request, Response};

const OPEN: usize = 1 << 24;

/// Sends raw bytes from `client` and lets its core see them.
fn send_raw(harness: &mut Harness, client: &Client, bytes: &[u8]) {
    client
        .pipe
        .borrow_mut()
        .to_server
        .extend(bytes.iter().copied());
    harness.ready(client, true, false, false);
}

/// Everything the server wrote to `client` so far, as text.
fn written(client: &Client) -> String {
    let bytes: Vec<u8> = client.pipe.borrow_mut().to_client.drain(..).collect();
    String::from_utf8(bytes).expect("utf-8")
}

#[test]
fn keys_scans_a_large_partition_in_bounded_steps_and_merges_in_key_order() {
    let limits = Limits {
        cores: 2,
        max_keys: 20_000,
        max_waiters_per_key: 4,
        max_pending_per_session: 8,
    };
    let mut harness = Harness::new(limits);
    let mut holder = harness.connect(0, OPEN);
    let keys: Vec<String> = (0..30_000).map(|i| format!("k/{i:05}")).collect();
    for chunk in keys.chunks(500) {
        let acquires: Vec<Request<'_>> = chunk
            .iter()
            .enumerate()
            .map(|(i, key)| Request::Acquire {
                wait_s: 0,
                lease_s: 60,
                owner: i as u64 + 1,
                key: key.as_bytes(),
            })
            .collect();
        harness.send(&holder, &acquires);
        harness.step_all(4);
        harness.receive(&mut holder);
    }
    let held: usize = harness
        .cores
        .iter()
        .map(|core| core.table().key_count())
        .sum();
    assert_eq!(held, 30_000);
    let admin = harness.connect(1, OPEN);
    send_raw(
        &mut harness,
        &admin,
        b"GET /keys?prefix=k/&limit=3 HTTP/1.1\r\n\r\n",
    );
    // More than 4096 entry slots per partition: the scans take several iterations.
    let mut rounds = 0;
    let answer = loop {
        harness.step_all(1);
        rounds += 1;
        let text = written(&admin);
        if !text.is_empty() {
            break text;
        }
        assert!(rounds < 100, "no answer");
    };
    assert!(
        rounds >= 3,
        "a partition of ~15,000 keys scanned in {rounds} rounds"
    );
    let body = answer.split_once("\r\n\r\n").unwrap().1;
    let listed: serde_json::Value = serde_json::from_str(body).unwrap();
    let names: Vec<&str> = listed
        .as_array()
        .unwrap()
        .iter()
        .map(|k| k["key"].as_str().unwrap())
        .collect();
    assert_eq!(names, ["k/00000", "k/00001", "k/00002"]);
    assert!(listed[0]["peer"].is_null(), "pipes have no address");
    harness.check_bounds();
}

#[test]
fn a_core_that_does_not_answer_makes_the_request_503_at_the_deadline() {
    let limits = Limits {
        cores: 2,
        max_keys: 64,
        max_waiters_per_key: 4,
        max_pending_per_session: 8,
    };
    let mut harness = Harness::new(limits);
    let admin = harness.connect(0, OPEN);
    send_raw(&mut harness, &admin, b"GET /stats HTTP/1.1\r\n\r\n");
    harness.step(0);
    harness.advance(super::GATHER_DEADLINE_US - 1);
    harness.step(0);
    assert_eq!(written(&admin), "", "never before the deadline");
    harness.advance(1);
    harness.step(0);
    let answer = written(&admin);
    assert!(answer.starts_with("HTTP/1.1 503 "), "{answer}");
    // The late core answers a request that is gone: nothing happens.
    harness.step_all(3);
    assert_eq!(written(&admin), "");
    // A lock session on the same core still works.
    let mut client = harness.connect(0, OPEN);
    harness.send(&client, &[Request::Ping { nonce: 7 }]);
    harness.step_all(2);
    assert_eq!(harness.receive(&mut client), [Response::Pong { nonce: 7 }]);
    harness.check_bounds();
}
