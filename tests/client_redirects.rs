//! The client against fake cluster members (`tests/common/fake_member.rs`): following `M`
//! (Moved) to the named leader, the leader cache, backing off when no leader is known, a
//! redirect loop that ends, and the one rule `M` does not relax: a request that may have been
//! sent is never sent again to any member. Also `--server a,b,c` on the command line.
//!
//! Loopback only; every wait is bounded; no assertion on speed beyond generous ceilings.

use std::process::Command;
use std::sync::Arc;
use std::thread;
use std::time::{Duration, Instant};

use common::fake_member::{
    leader_reply, leading, moved, one_cluster, redirect_to, FakeMember, Reply, FAKE_CLUSTER,
};
use common::{assert_between, client, dead_addr, Frame};
use latchkey::cli;
use latchkey_client::card::Card;
use latchkey_client::protocol::{Fate, Response};
use latchkey_client::REDIRECTS_MAX;
use latchkey_client::{AcquireError, ExtendOutcome, ReleaseOutcome, RequestError};

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
    // Members answered, but none served the key and nothing was executed: Unavailable (a
    // Timeout is only a T, or a request waiting on a serving member's session).
    assert_eq!(result.unwrap_err(), AcquireError::Unavailable);
    let report = client.last_unavailable().expect("what the members did");
    assert_eq!(report.reachable(), 2);
    assert!(
        report
            .to_string()
            .starts_with(&format!("{REDIRECTS_MAX} redirects followed")),
        "{report}"
    );
    let (to_a, to_b) = (acquires(&a), acquires(&b));
    assert_eq!(to_a.len() + to_b.len(), REDIRECTS_MAX as usize + 1);
    assert!(to_a.iter().chain(&to_b).all(|owner| *owner == to_a[0]));
    // Other calls end Unavailable too.
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
// Lists that mix clusters: each address is asked for its card, and only one cluster's members
// are sent to (crates/latchkey-client/src/check.rs).

fn other_cluster(member: &FakeMember) -> Option<Card> {
    Some(Card::Member {
        cluster: FAKE_CLUSTER + 1,
        member: 1,
        shards: 1,
        clients: vec![(1, member.addr())],
    })
}

#[test]
fn a_list_that_mixes_clusters_is_refused_whole_and_nothing_is_sent() {
    let member = FakeMember::start(leading(3));
    let stranger = FakeMember::start(leading(9));
    stranger.set_card(other_cluster(&stranger));
    let standalone = FakeMember::start(leading(9));
    standalone.set_card(Some(Card::Standalone { instance: 5 }));
    let old = FakeMember::start(leading(9));
    old.set_card(None);
    let all = [&member, &stranger, &standalone, &old];
    // Whichever pair answers first, the list is refused once they differ.
    for pair in [
        [&member, &stranger],
        [&stranger, &member],
        [&member, &standalone],
        [&member, &old],
    ] {
        let addrs = [pair[0].addr(), pair[1].addr()];
        let client = client(&addrs, 1, TRANSPORT);
        let result = client.acquire("k", Duration::from_millis(500), LEASE);
        assert_eq!(result.unwrap_err(), AcquireError::Unavailable);
        let text = client.last_unavailable().expect("a report").to_string();
        assert!(text.contains("not the members of one cluster"), "{text}");
        let refused = client.refused_members(Duration::from_secs(5));
        let named: Vec<_> = refused.iter().map(|(addr, _)| *addr).collect();
        assert_eq!(named, addrs, "{refused:?}");
    }
    let client = client(&all.map(|member| member.addr()), 1, TRANSPORT);
    let refused = client.refused_members(Duration::from_secs(5));
    let says = |addr, what: &str| {
        refused
            .iter()
            .any(|(a, why)| *a == addr && why.contains(what))
    };
    assert!(
        says(member.addr(), "it is cluster fa4ec1057e200001"),
        "{refused:?}"
    );
    assert!(
        says(stranger.addr(), "it is cluster fa4ec1057e200002"),
        "{refused:?}"
    );
    assert!(
        says(standalone.addr(), "a standalone server"),
        "{refused:?}"
    );
    assert!(says(old.addr(), "HTTP 404"), "{refused:?}");
    assert!(client.query("k").is_err());
    for other in all {
        assert_eq!(other.received(), [], "never sent to");
    }
}

#[test]
fn a_member_of_a_build_before_cards_is_vouched_for_by_the_upgraded_members_cards() {
    let upgraded = FakeMember::start(redirect_to(None));
    let old = FakeMember::start(leading(6));
    one_cluster(&[&upgraded, &old]);
    old.set_card(None);
    let listed = client(&[upgraded.addr(), old.addr()], 1, TRANSPORT);
    let ticket = listed.acquire("k", Duration::from_secs(3), LEASE).unwrap();
    assert_eq!(
        ticket.token(),
        6,
        "granted by the member that gives no card"
    );
    assert_eq!(listed.refused_members(Duration::ZERO), []);
    // None upgraded yet: the list is used as given, as before cards.
    let first = FakeMember::start(leading(2));
    first.set_card(None);
    let second = FakeMember::start(leading(2));
    second.set_card(None);
    let listed = client(&[first.addr(), second.addr()], 1, TRANSPORT);
    assert_eq!(
        listed
            .acquire("k", Duration::from_secs(3), LEASE)
            .unwrap()
            .token(),
        2
    );
}

#[test]
fn a_list_of_two_standalone_servers_is_unavailable_and_says_why() {
    let standalone = FakeMember::start(leading(9));
    standalone.set_card(Some(Card::Standalone { instance: 5 }));
    let another = FakeMember::start(leading(9));
    another.set_card(Some(Card::Standalone { instance: 6 }));
    let client = client(&[standalone.addr(), another.addr()], 1, TRANSPORT);
    let result = client.acquire("k", Duration::from_millis(300), LEASE);
    assert_eq!(result.unwrap_err(), AcquireError::Unavailable);
    let text = client.last_unavailable().expect("a report").to_string();
    assert!(
        text.contains("standalone server (run 0000000000000006)"),
        "{text}"
    );
    assert_eq!(standalone.received(), []);
    assert_eq!(another.received(), []);
}

#[test]
fn a_member_where_nothing_listens_or_that_never_answers_its_card_holds_nothing_back() {
    let leader = FakeMember::start(leading(8));
    let silent = FakeMember::start(leading(9));
    silent.pause_handshakes();
    one_cluster(&[&leader, &silent]);
    let listed = client(&[silent.addr(), dead_addr(), leader.addr()], 1, TRANSPORT);
    let ticket = listed.acquire("k", Duration::from_secs(3), LEASE).unwrap();
    assert_eq!(ticket.token(), 8);
    assert_eq!(listed.refused_members(Duration::ZERO), []);
    // Nothing listens anywhere: the call ends at once, as without cards.
    let client = client(&[dead_addr(), dead_addr()], 1, TRANSPORT);
    let start = Instant::now();
    let result = client.acquire("k", Duration::from_secs(20), LEASE);
    assert_eq!(result.unwrap_err(), AcquireError::Unavailable);
    assert!(
        start.elapsed() < Duration::from_secs(10),
        "{:?}",
        start.elapsed()
    );
    let text = client.last_unavailable().unwrap().to_string();
    assert!(text.contains("connection refused"), "{text}");
}

#[test]
fn one_standalone_server_at_every_address_is_used() {
    let standalone = FakeMember::start(leading(4));
    standalone.set_card(Some(Card::Standalone { instance: 5 }));
    let alias = FakeMember::start(leading(4));
    alias.set_card(Some(Card::Standalone { instance: 5 }));
    let client = client(&[standalone.addr(), alias.addr()], 1, TRANSPORT);
    let ticket = client.acquire("k", Duration::from_secs(2), LEASE).unwrap();
    assert_eq!(ticket.token(), 4);
    assert_eq!(client.refused_members(Duration::from_secs(5)), []);
}

#[test]
fn the_cli_refuses_a_list_that_mixes_a_standalone_server_with_members() {
    let member = FakeMember::start(leading(4));
    let standalone = FakeMember::start(leading(4));
    standalone.set_card(Some(Card::Standalone { instance: 5 }));
    let list = format!("{},{}", member.addr(), standalone.addr());
    let output = latchkey(&["query", "--server", &list, "k"])
        .output()
        .unwrap();
    assert_eq!(
        output.status.code(),
        Some(i32::from(cli::EXIT_USAGE)),
        "{output:?}"
    );
    let stderr = String::from_utf8_lossy(&output.stderr);
    let named = format!(
        "latchkey query: {}: it is a standalone server",
        standalone.addr()
    );
    assert!(stderr.contains(&named), "{stderr}");
    assert!(stderr.contains("nothing was sent"), "{stderr}");
    assert_eq!(standalone.received(), [], "never sent to");
    assert_eq!(member.received(), [], "never sent to");
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

/// A `latchkey lock` that lost its lease (its leader A went silent, and B, where the extend was
/// hedged, knew no leader before the bound) still releases the lock, at the member that
/// answers: an extend may have executed unanswered, and the key would otherwise stay held by
/// nobody for up to one more lease. Before, the release was left to a background call on A's
/// silent session, and the process exited: B never saw it.
#[test]
fn latchkey_lock_releases_at_another_member_after_losing_its_lease() {
    // B knows no leader for the key's extends (an election under way), and leads by the time
    // of the release.
    let b = FakeMember::start(Arc::new(|frame: &Frame| match frame {
        Frame::Release { .. } => leader_reply(frame, 0),
        _ => moved(frame, None),
    }));
    let a = FakeMember::start(Arc::new(|frame: &Frame| match frame {
        Frame::Acquire { .. } => leader_reply(frame, 33),
        _ => Reply::Silent,
    }));
    let list = format!("{},{}", a.addr(), b.addr());
    let output = latchkey(&[
        "lock", "--server", &list, "--lease", "1s", "k", "--", "sleep", "30",
    ])
    .output()
    .unwrap();
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert_eq!(
        output.status.code(),
        Some(i32::from(cli::EXIT_LEASE_LOST)),
        "{stderr}"
    );
    let release = Frame::Release {
        token: 33,
        key: "k".into(),
    };
    assert!(b.received().contains(&release), "B released it: {stderr}");
}

// ---------------------------------------------------------------------------------------------
// Paused members, silent sessions, and the truth about "unavailable".

/// A client of `addrs` whose connect timeout (and silence limit) is `connect`.
fn client_with_connect(
    addrs: &[std::net::SocketAddr],
    connect: Duration,
) -> latchkey_client::Client {
    let config = latchkey_client::ClientConfig {
        addrs: addrs.to_vec(),
        sessions: 1,
        connect_timeout: connect,
        transport_timeout: TRANSPORT,
        ..latchkey_client::ClientConfig::default()
    };
    latchkey_client::Client::with_config(config).unwrap()
}

#[test]
fn a_paused_member_gets_only_the_handshake_ping_and_the_next_one_serves() {
    let paused = FakeMember::start(leading(1));
    paused.pause_handshakes();
    let leader = FakeMember::start(Arc::new(|frame| match *frame {
        Frame::Acquire { owner, .. } => {
            Reply::Answer(latchkey_client::protocol::Response::Timeout { owner })
        }
        _ => leader_reply(frame, 2),
    }));
    one_cluster(&[&paused, &leader]);
    let connect = Duration::from_millis(400);
    // The first member's session starts connecting when the client is built.
    let start = Instant::now();
    let client = client_with_connect(&[paused.addr(), leader.addr()], connect);
    // A held key, wait 0: the answer is the leader's T, not Indeterminate.
    let result = client.acquire("k", Duration::ZERO, LEASE);
    let elapsed = start.elapsed();
    assert_eq!(result.unwrap_err(), AcquireError::Timeout);
    assert_between(elapsed, connect, connect + Duration::from_secs(3));
    assert_eq!(paused.handshakes(), 1);
    assert_eq!(
        paused.received(),
        [],
        "nothing but the handshake ping reached it"
    );
    assert_eq!(acquires(&leader).len(), 1);
    // Query and ping go on to the member that answers too.
    assert!(!client.query("q").unwrap().held);
    client.ping().unwrap();
    assert_eq!(paused.received(), []);
}

#[test]
fn a_member_that_stops_answering_stops_taking_calls() {
    // It answers the handshake, then nothing: its session stalls once an answer is overdue
    // (the connect timeout), and later calls go to the other member.
    let silent = FakeMember::start(Arc::new(|_| Reply::Silent));
    let leader = FakeMember::start(leading(8));
    let connect = Duration::from_millis(300);
    let client = client_with_connect(&[silent.addr(), leader.addr()], connect);
    assert_eq!(client.query("first").unwrap_err(), RequestError::NoAnswer);
    assert_eq!(
        silent.received().len(),
        1,
        "the query went to the silent member"
    );
    for key in ["a", "b", "c", "d"] {
        let ticket = client.acquire(key, Duration::ZERO, LEASE).unwrap();
        assert_eq!(ticket.token(), 8);
    }
    let to_silent = silent.received();
    assert_eq!(to_silent.len(), 1, "nothing more reached it: {to_silent:?}");
    assert_eq!(acquires(&leader).len(), 4);
}

#[test]
fn an_acquire_that_met_only_no_leader_is_unavailable_and_says_so() {
    let electing = FakeMember::start(redirect_to(None));
    let (dead1, dead2) = (dead_addr(), dead_addr());
    let client = client(&[electing.addr(), dead1, dead2], 1, TRANSPORT);
    let wait = Duration::from_millis(800);
    let start = Instant::now();
    let result = client.acquire("k", wait, LEASE);
    assert_eq!(
        result.unwrap_err(),
        AcquireError::Unavailable,
        "not Timeout"
    );
    assert_between(start.elapsed(), wait, wait + TRANSPORT);
    let report = client.last_unavailable().expect("what the members did");
    assert_eq!((report.reachable(), report.listed()), (1, 3));
    assert!(report.no_quorum());
    let text = report.to_string();
    assert!(
        text.starts_with("no leader for this key: 1 of 3 members reachable, no quorum ("),
        "{text}"
    );
    assert!(text.contains(&format!("{dead1}: cannot connect")), "{text}");
    // The same for a query; and nothing was ever granted or queued.
    assert_eq!(client.query("k").unwrap_err(), RequestError::Unavailable);
    assert!(client
        .last_unavailable()
        .unwrap()
        .to_string()
        .starts_with("no leader"));
}

#[test]
fn an_acquire_that_met_a_leaders_timeout_is_a_timeout() {
    let electing = FakeMember::start(redirect_to(None));
    let leader = FakeMember::start(Arc::new(|frame| match *frame {
        Frame::Acquire { owner, .. } => {
            Reply::Answer(latchkey_client::protocol::Response::Timeout { owner })
        }
        _ => Reply::Silent,
    }));
    let client = client(&[electing.addr(), leader.addr()], 1, TRANSPORT);
    let result = client.acquire("k", Duration::from_millis(800), LEASE);
    assert_eq!(result.unwrap_err(), AcquireError::Timeout);
    assert_eq!(acquires(&leader).len(), 1);
}

#[test]
fn a_named_leader_that_cannot_be_reached_is_unavailable_and_named() {
    let gone = dead_addr();
    let follower = FakeMember::start(redirect_to(Some(gone)));
    let client = client(&[follower.addr()], 1, TRANSPORT);
    let result = client.acquire("k", Duration::from_millis(600), LEASE);
    assert_eq!(result.unwrap_err(), AcquireError::Unavailable);
    let text = client.last_unavailable().unwrap().to_string();
    assert!(
        text.starts_with(&format!(
            "the key's leader {gone} (named by {}) cannot be reached: cannot connect",
            follower.addr()
        )),
        "{text}"
    );
}

#[test]
fn the_cli_says_no_leader_and_no_quorum_and_exits_83() {
    let electing = FakeMember::start(redirect_to(None));
    let list = format!("{},{},{}", electing.addr(), dead_addr(), dead_addr());
    let output = latchkey(&["lock", "--server", &list, "--wait", "1s", "k", "--", "true"])
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert_eq!(
        output.status.code(),
        Some(i32::from(cli::EXIT_UNAVAILABLE)),
        "{stderr}"
    );
    assert!(
        stderr.contains(
            "latchkey lock: k: no leader for this key: 1 of 3 members reachable, no quorum"
        ),
        "{stderr}"
    );
    assert!(
        stderr.contains("nothing was executed (tried for ") && stderr.contains(" of --wait 1s)"),
        "{stderr}"
    );
    assert!(!stderr.contains("held by someone else"), "{stderr}");
    let output = latchkey(&["query", "--server", &list, "--transport-timeout", "1s", "k"])
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert_eq!(
        output.status.code(),
        Some(i32::from(cli::EXIT_UNAVAILABLE)),
        "{stderr}"
    );
    assert!(
        stderr.starts_with("latchkey query: k: no leader for this key: 1 of 3 members reachable"),
        "{stderr}"
    );
}

#[test]
fn a_release_fails_fast_when_every_member_refuses_even_once_hedged() {
    // A release is hedged (two members); when both stop, every attempt is refused: the call
    // ends Unavailable at once, as any call of a client that does not retry refused
    // connections — the hedge, which never tries the member the first attempt went to, counts
    // that member's refusal too — instead of trying until the transport deadline.
    let first = FakeMember::start(leading(5));
    let second = FakeMember::start(leading(5));
    let transport = Duration::from_secs(20);
    let client = client(&[first.addr(), second.addr()], 1, transport);
    let ticket = client.acquire("k", Duration::from_secs(1), LEASE).unwrap();
    drop((first, second));
    // The members' sockets close (their threads poll every 20 ms).
    thread::sleep(Duration::from_millis(300));
    let started = Instant::now();
    let outcome = ticket.release();
    let took = started.elapsed();
    assert!(
        matches!(outcome, Err(RequestError::Unavailable)),
        "{outcome:?}"
    );
    assert!(
        took < Duration::from_secs(8),
        "took {took:?} of the 20 s deadline"
    );
}

/// A waiter whose leader goes silent (paused: its port still accepts connections, nothing
/// answers) asks another member what became of the acquire first: its session closes once its
/// probe goes unanswered, and the Resolve goes to a member other than the silent one — not to
/// a new session there that would wait out its handshake (the connect timeout) — even when
/// the members' turn names the silent one next. Members `[C, A, B]`: C redirects the acquire
/// to A, so the turn's next member is A. Before, the Resolve went there first.
#[test]
fn a_waiter_whose_leader_goes_silent_asks_another_member_first() {
    let a = FakeMember::start(Arc::new(|_: &Frame| Reply::Silent));
    let c = FakeMember::start(redirect_to(Some(a.addr())));
    let b = FakeMember::start(redirect_to(Some(a.addr())));
    for member in [&c, &a, &b] {
        member.identify_sessions();
    }
    let config = latchkey_client::ClientConfig {
        addrs: vec![c.addr(), a.addr(), b.addr()],
        sessions: 1,
        connect_timeout: Duration::from_secs(2),
        transport_timeout: TRANSPORT,
        ..Default::default()
    };
    let client = latchkey_client::Client::with_config(config).unwrap();
    let waiter = thread::spawn(move || client.acquire("k", Duration::from_secs(20), LEASE));
    wait_received(&a, 1);
    assert_eq!(acquires(&a).len(), 1, "queued at A: {:?}", a.received());
    // A is paused from now on; B leads the key and never saw the acquire.
    a.pause_handshakes();
    let new_leader = Arc::new(|frame: &Frame| match *frame {
        Frame::Resolve { owner, .. } => Reply::Answer(Response::Resolved {
            owner,
            fate: Fate::NeverSeen,
            token: 0,
            lease_ms: 0,
        }),
        _ => leader_reply(frame, 91),
    });
    b.set_script(new_leader);
    c.set_script(redirect_to(Some(b.addr())));
    let ticket = waiter.join().unwrap().expect("granted by the new leader");
    assert_eq!(ticket.token(), 91);
    assert_eq!(a.handshakes(), 1, "no new session to the silent member");
    drop(ticket);
}
