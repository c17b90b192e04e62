//! How a session's end meets the grants and answers it still owes, over real sockets.
//!
//! docs/protocol.md §3: a grant to a waiter whose session is known closed before the `A` is written
//! is released by the server at once, and an `A` still in the session's unsent output when the
//! session dies (reset, error) was never written: that grant is released too, and the key goes
//! to the next waiter. Before this was so, such a key stayed held for the whole lease with no
//! holder anywhere.

use common::server::{keys_on_partition, start, wait_until, Conn};
use latchkey_client::protocol::Request;
use std::io::{ErrorKind, Write};
use std::time::{Duration, Instant};

/// A session that queues an acquire on `key` and then stops reading while it floods pings, so
/// that its unsent output backs up past the server's bound and the server stops reading it.
fn stalled_waiter(addr: std::net::SocketAddr, key: &str, owner: u64) -> Conn {
    let mut conn = Conn::connect_small_buffer(addr);
    conn.send_acquire(key, 60, 30, owner);
    conn.stream.set_nonblocking(true).expect("nonblocking");
    let mut pings = Vec::new();
    for nonce in 0..4096u64 {
        Request::Ping { nonce }.encode(&mut pings);
    }
    // Write until the kernel takes nothing for a while: the server has stopped reading.
    let mut last_progress = Instant::now();
    while last_progress.elapsed() < Duration::from_millis(300) {
        match conn.stream.write(&pings) {
            Ok(0) => break,
            Ok(_) => last_progress = Instant::now(),
            Err(e) if e.kind() == ErrorKind::WouldBlock => {
                std::thread::sleep(Duration::from_millis(5))
            }
            Err(e) => panic!("write: {e}"),
        }
        assert!(
            last_progress.elapsed() < Duration::from_secs(20),
            "the server kept reading"
        );
    }
    conn
}

/// Closes with a reset (SO_LINGER 0): the server's next write to it fails.
fn reset(conn: Conn) {
    let socket = socket2::SockRef::from(&conn.stream);
    socket.set_linger(Some(Duration::ZERO)).expect("SO_LINGER");
    drop(conn);
}

fn grant_in_unsent_output_is_released_when_the_session_dies(cores: usize, key_partition: usize) {
    let server = start(cores);
    let addr = server.local_addr();
    let key = &keys_on_partition("close/unsent", key_partition, cores, 1)[0];
    let mut holder = Conn::connect(addr);
    let token = holder.acquire_ok(key, 60, 1);
    let victim = stalled_waiter(addr, key, 2);
    // The next waiter, behind the victim.
    let mut next = Conn::connect(addr);
    next.send_acquire(key, 30, 30, 3);
    std::thread::sleep(Duration::from_millis(100));
    // The release grants the victim; its `A` joins the unsent output it does not read.
    holder.release(key, token);
    std::thread::sleep(Duration::from_millis(100));
    reset(victim);
    // The victim's grant was never written: the key goes to the next waiter at once, not
    // after the victim's 30 s lease.
    let granted = next.recv_granted(3);
    assert!(granted > token, "a later grant carries a larger token");
    let mut observer = Conn::connect(addr);
    assert!(wait_until(Duration::from_secs(5), || observer
        .state(key)
        .held));
}

#[test]
fn unsent_grant_is_released_on_reset_one_core() {
    grant_in_unsent_output_is_released_when_the_session_dies(1, 0);
}

#[test]
fn unsent_grant_of_another_core_is_released_on_reset() {
    // The session lives on whichever core accepted it; with two cores and keys on both, one of
    // the two runs crosses cores.
    for partition in 0..2 {
        grant_in_unsent_output_is_released_when_the_session_dies(2, partition);
    }
}
