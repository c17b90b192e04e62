//! What the server logs, as a process: session open and close with peer and reason (debug),
//! refused frames and `B` answers at info and rate-limited, and what a shutdown drops.

use common::server::{self, fresh_id, keys_on_partition, Conn, ServerProcess, TempDir};
use latchkey_client::protocol::{Request, Response};
use std::sync::{Arc, Mutex};
use std::time::Duration;

/// Waits until the collected log has a line containing every one of `parts`; returns it.
fn wait_for_line(log: &Arc<Mutex<String>>, parts: &[&str]) -> String {
    server::wait_for_line(log, parts, Duration::from_secs(10))
}

fn count_lines(log: &Arc<Mutex<String>>, part: &str) -> usize {
    log.lock()
        .unwrap()
        .lines()
        .filter(|line| line.contains(part))
        .count()
}

#[test]
fn sessions_errors_busy_and_shutdown_are_logged() {
    let dir = TempDir::new("logs");
    let config = dir.path().join("latchkey.toml");
    std::fs::write(&config, "[limits]\nmax_waiters_per_key = 1\n").unwrap();
    let config = config.to_str().unwrap().to_string();
    let (mut server, log) =
        ServerProcess::spawn_logging(&["--config", &config, "--cores", "2"], "debug");
    // Open and close, with the peer and the reason.
    let mut quick = Conn::connect(server.addr);
    let peer = quick.stream.local_addr().unwrap().to_string();
    assert_eq!(quick.ping(1), Response::Pong { nonce: 1 });
    drop(quick);
    wait_for_line(&log, &[&format!("from {peer}: opened")]);
    wait_for_line(&log, &[&format!("from {peer}: closing: end of input")]);
    // Two refused frames of one kind: one info line (rate-limited), naming the peer and code.
    let mut bad = Conn::connect(server.addr);
    let bad_peer = bad.stream.local_addr().unwrap().to_string();
    for owner in [1, 2] {
        let key = b"logs/bad";
        bad.send(Request::Acquire {
            wait_s: 0,
            lease_s: 0,
            owner,
            key,
        });
        assert_eq!(bad.recv().op(), b'X');
    }
    wait_for_line(&log, &["INFO", &bad_peer, "X code 5"]);
    assert_eq!(count_lines(&log, "X code 5"), 1);
    // A `B`: logged with its reason.
    let key = &keys_on_partition("logs", 0, 2, 1)[0];
    let mut holder = Conn::connect(server.addr);
    holder.acquire_ok(key, 60, fresh_id());
    let mut waiter = Conn::connect(server.addr);
    let owner = fresh_id();
    waiter.send_acquire(key, 30, 60, owner);
    assert_eq!(waiter.state(key).waiters, 1);
    let busy_owner = fresh_id();
    assert_eq!(
        bad.acquire(key, 30, 60, busy_owner),
        Response::Busy { owner: busy_owner }
    );
    wait_for_line(&log, &["INFO", "acquires answered B", "waiters_per_key 1"]);
    // A shutdown says what it dropped: one held lock and one waiter, on the key's core.
    server.signal(libc::SIGTERM);
    assert_eq!(waiter.recv(), Response::Busy { owner });
    let status = server.wait_timeout(Duration::from_secs(6)).expect("exits");
    assert!(status.success());
    wait_for_line(
        &log,
        &["shutting down: 1 queued acquires answered B, 1 held locks dropped"],
    );
    eprintln!("{}", log.lock().unwrap());
}
