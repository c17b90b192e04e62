//! The client against fake cluster members (`tests/common/fake_member.rs`): following `M`
//! (Moved) to the named leader, the leader cache, backing off when no leader is known, a
//! redirect loop that ends, and the one rule `M` does not relax: a request that may have been
//! sent is never sent again to any member. Also `--server a,b,c` on the command line.
//!
//! Loopback only; every wait is bounded; no assertion on speed beyond generous ceilings.

mod common;

use std::process::Command;
use std::sync::Arc;
use std::thread;
use std::time::{Duration, Instant};

use common::fake_member::{leader_reply, leading, moved, redirect_to, FakeMember, Reply};
use common::{assert_between, client, dead_addr, Frame};
use latchkey::client::REDIRECTS_MAX;
use latchkey::client::{cli, AcquireError, ExtendOutcome, ReleaseOutcome, RequestError};

const LEASE: Duration = Duration::from_secs(10);
const TRANSPORT: Duration = Duration::from_secs(2);

fn acquires(member: &FakeMember) -> Vec<u64> {
    let owner = |frame: Frame| match frame {
        Frame::Acquire { owner, .. } => Some(owner),
        _ => None,
    };
    member.received().into_iter().filter_map(owner).collect()
}

/// Waits (bounded) until `member` received `count` requests.
fn wait_received(member: &FakeMember, count: usize) {
    let start = Instant::now();
    while member.received().len() < count && start.elapsed() < Duration::from_secs(5) {
        thread::sleep(Duration::from_millis(5));
    }
}

#[test]
fn an_acquire_follows_one_moved_to_the_named_leader_and_remembers_it() {
    let leader = FakeMember::start(leading(77));
    let follower = FakeMember::start(redirect_to(Some(leader.addr())));
    let client = client(&[follower.addr()], 1, TRANSPORT);
    let ticket = client.acquire("k", Duration::from_secs(1), LEASE).unwrap();
    assert_eq!(ticket.token(), 77);
    let (asked, granted) = (acquires(&follower), acquires(&leader));
    assert_eq!(asked.len(), 1);
    assert_eq!(granted, asked, "the same owner goes to the leader");
    // The second call for the key goes straight to the leader.
    let seen = follower.received().len();
    let again = client.acquire("k", Duration::ZERO, LEASE).unwrap();
    assert_eq!(again.token(), 77);
    assert_eq!(acquires(&leader).len(), 2);
    assert_eq!(
        follower.received().len(),
        seen,
        "the follower saw nothing new"
    );
    drop((ticket, again));
}

#[test]
fn moved_without_a_leader_backs_off_and_another_member_grants() {
    let electing = FakeMember::start(redirect_to(None));
    let leader = FakeMember::start(leading(5));
    let client = client(&[electing.addr(), leader.addr()], 1, TRANSPORT);
    let start = Instant::now();
    let ticket = client.acquire("k", Duration::from_secs(2), LEASE).unwrap();
    // Never early: an M without a leader waits at least the first backoff (10 ms).
    assert_between(
        start.elapsed(),
        Duration::from_millis(10),
        Duration::from_secs(2),
    );
    assert_eq!(ticket.token(), 5);
    let asked = acquires(&electing);
    assert_eq!(asked.len(), 1);
    assert_eq!(
        acquires(&leader),
        asked,
        "the same owner, sent again after the M"
    );
}

#[test]
fn a_redirect_loop_ends_with_bounded_redirects() {
    let a = FakeMember::start(redirect_to(None));
    let b = FakeMember::start(redirect_to(Some(a.addr())));
    a.set_script(redirect_to(Some(b.addr())));
    let client = client(&[a.addr()], 1, TRANSPORT);
    let wait = Duration::from_secs(3);
    let start = Instant::now();
    let result = client.acquire("k", wait, LEASE);
    assert!(start.elapsed() <= wait + TRANSPORT, "ends by the deadline");
    // Members answered and nothing was ever queued: a Timeout, as when the wait runs out.
    assert_eq!(result.unwrap_err(), AcquireError::Timeout);
    let (to_a, to_b) = (acquires(&a), acquires(&b));
    assert_eq!(to_a.len() + to_b.len(), REDIRECTS_MAX as usize + 1);
    assert!(to_a.iter().chain(&to_b).all(|owner| *owner == to_a[0]));
    // Other calls end Unavailable.
    assert_eq!(client.query("k").unwrap_err(), RequestError::Unavailable);
}

#[test]
fn a_query_follows_moved() {
    let leader = FakeMember::start(leading(1));
    let follower = FakeMember::start(redirect_to(Some(leader.addr())));
    let client = client(&[follower.addr()], 1, TRANSPORT);
    let state = client.query("q").unwrap();
    assert!(!state.held);
    let (asked, answered) = (follower.received(), leader.received());
    assert_eq!((asked.len(), answered.len()), (1, 1));
    assert_eq!(asked, answered, "the same nonce");
    assert!(matches!(answered[0], Frame::Query { .. }));
}

#[test]
fn extend_and_release_follow_moved_after_a_leader_change() {
    let first = FakeMember::start(leading(9));
    let second = FakeMember::start(redirect_to(Some(first.addr())));
    // `second` is asked first, and names `first`: the key's leader is cached.
    let client = client(&[second.addr(), first.addr()], 1, TRANSPORT);
    let ticket = client.acquire("k", Duration::from_secs(1), LEASE).unwrap();
    assert_eq!((acquires(&second).len(), acquires(&first).len()), (1, 1));
    // Leadership moves to `second`: `first` redirects, `second` leads.
    second.set_script(leading(9));
    first.set_script(redirect_to(Some(second.addr())));
    assert_eq!(ticket.extend(LEASE).unwrap(), ExtendOutcome::Extended);
    let extend = Frame::Extend {
        lease_s: 10,
        token: 9,
        key: "k".into(),
    };
    assert_eq!(first.received().last(), Some(&extend));
    assert_eq!(second.received().last(), Some(&extend));
    // And back: the release goes to `second` (cached), which redirects to `first`.
    first.set_script(leading(9));
    second.set_script(redirect_to(Some(first.addr())));
    assert_eq!(ticket.release().unwrap(), ReleaseOutcome::Released);
    let release = Frame::Release {
        token: 9,
        key: "k".into(),
    };
    assert_eq!(second.received().last(), Some(&release));
    assert_eq!(first.received().last(), Some(&release));
}

#[test]
fn an_acquire_that_may_have_been_sent_is_never_sent_to_another_member() {
    let closer = FakeMember::start(Arc::new(|_| Reply::Close));
    let leader = FakeMember::start(leading(3));
    let client = client(&[closer.addr(), leader.addr()], 1, TRANSPORT);
    let result = client.acquire("k", Duration::from_secs(1), LEASE);
    assert_eq!(result.unwrap_err(), AcquireError::Indeterminate);
    let owner = acquires(&closer);
    assert_eq!(owner.len(), 1);
    thread::sleep(Duration::from_millis(300));
    let received = leader.received();
    assert!(
        received.iter().all(|frame| match frame {
            Frame::Acquire { owner: o, .. } | Frame::Cancel { owner: o, .. } => *o != owner[0],
            _ => true,
        }),
        "the owner reached another member: {received:?}"
    );
}

#[test]
fn an_unreachable_member_is_skipped_for_the_next() {
    let leader = FakeMember::start(leading(11));
    let client = client(&[dead_addr(), leader.addr()], 1, TRANSPORT);
    let ticket = client.acquire("k", Duration::from_secs(2), LEASE).unwrap();
    assert_eq!(ticket.token(), 11);
}

#[test]
fn a_single_address_sees_one_request_per_call() {
    // One address, no M: today's traffic (one request per call, to that address).
    let only = FakeMember::start(Arc::new(|frame| leader_reply(frame, 2)));
    let client = client(&[only.addr()], 1, TRANSPORT);
    for key in ["a", "b", "c"] {
        client.query(key).unwrap();
    }
    wait_received(&only, 3);
    assert_eq!(only.received().len(), 3);
}

// ---------------------------------------------------------------------------------------------
// The command line.

fn latchkey(args: &[&str]) -> Command {
    let mut command = Command::new(env!("CARGO_BIN_EXE_latchkey"));
    command.env_remove("LATCHKEY_SERVER").args(args);
    command
}

#[test]
fn the_cli_takes_a_list_of_members_and_follows_moved() {
    let leader = FakeMember::start(leading(4));
    let follower = FakeMember::start(redirect_to(Some(leader.addr())));
    let list = format!("{},{}", follower.addr(), dead_addr());
    let output = latchkey(&["query", "--server", &list, "k"])
        .output()
        .unwrap();
    assert!(output.status.success(), "{output:?}");
    assert_eq!(
        String::from_utf8_lossy(&output.stdout).trim(),
        "held=0 lease_ms=0 waiters=0"
    );
    let output = latchkey(&["query", "k"])
        .env("LATCHKEY_SERVER", &list)
        .output()
        .unwrap();
    assert!(output.status.success(), "{output:?}");
    assert_eq!(leader.received().len(), 2);
}

#[test]
fn a_bad_item_of_the_server_list_is_named() {
    let good = dead_addr().to_string();
    let list = format!("{good},not-an-address");
    let output = latchkey(&["query", "--server", &list, "k"])
        .output()
        .unwrap();
    assert_eq!(output.status.code(), Some(i32::from(cli::EXIT_USAGE)));
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(stderr.contains("--server not-an-address:"), "{stderr}");
    let output = latchkey(&["ping"])
        .env("LATCHKEY_SERVER", format!("{good},,{good}"))
        .output()
        .unwrap();
    assert_eq!(output.status.code(), Some(i32::from(cli::EXIT_USAGE)));
    let parsed = cli::parse_servers(&format!("{good}, 127.0.0.1:9")).unwrap();
    assert_eq!(parsed.len(), 2);
}

#[test]
fn latchkey_lock_keeps_its_lock_through_a_leader_change() {
    // A leads, then closes every connection for 400 ms (a crash), then names B, which leads.
    let start = Instant::now();
    let b = FakeMember::start(redirect_to(None));
    let a = FakeMember::start({
        let b = b.addr();
        Arc::new(move |frame| match start.elapsed().as_millis() {
            0..=999 => leader_reply(frame, 21),
            1000..=1399 => Reply::Close,
            _ => moved(frame, Some(b)),
        })
    });
    b.set_script({
        let a = a.addr();
        Arc::new(move |frame| match start.elapsed().as_millis() {
            0..=1399 => moved(frame, Some(a)),
            _ => leader_reply(frame, 21),
        })
    });
    let list = format!("{},{}", a.addr(), b.addr());
    let output = latchkey(&[
        "lock", "--server", &list, "--lease", "2s", "k", "--", "sleep", "3",
    ])
    .output()
    .unwrap();
    eprintln!("{}", String::from_utf8_lossy(&output.stderr));
    assert!(output.status.success(), "{output:?}");
    let extended = |frame: &Frame| matches!(frame, Frame::Extend { .. });
    assert!(b.received().iter().any(extended), "B extended the lease");
    let release = Frame::Release {
        token: 21,
        key: "k".into(),
    };
    assert!(b.received().contains(&release), "B released it");
}
