//! docs/protocol.md §3 against the real server: every cell of the request × key-state matrix and
//! every event row, on keys of both partitions of a two-core server (so requests are routed
//! to the session's own core and to the other one).
//!
//! A key is brought into a state by a fixture: **F** (free), **H0** (held by the fixture's
//! `holder` session), **Hq** (held, one acquire queued by its `queue` session, room for more),
//! **Hf** (held, queue at `max_waiters_per_key`). The request under test comes from a third
//! session, `client`, unless the cell is about the waiter's own session.

use common::assert_between;
use common::server::{
    fresh_id, keys_on_partition, start, start_with, test_config, wait_until, Conn, KeyState,
};
use latchkey::server::ServerHandle;
use latchkey_client::protocol::{Request, Response};
use std::net::SocketAddr;
use std::thread;
use std::time::{Duration, Instant};

const CORES: usize = 2;
/// `max_waiters_per_key` of the matrix server: Hq has one waiter, Hf two.
const QUEUE_MAX: u32 = 2;
/// Lease of the fixture's holder and waiters: long enough never to run out during a test.
const LONG_S: u8 = 60;
/// How long "nothing arrives" is watched for.
const QUIET: Duration = Duration::from_millis(100);

fn secs(seconds: u64) -> Duration {
    Duration::from_secs(seconds)
}

fn matrix_server() -> ServerHandle {
    let mut config = test_config(CORES);
    config.limits.max_waiters_per_key = QUEUE_MAX;
    start_with(config)
}

/// One key of each partition, named after `prefix`.
fn keys(prefix: &str) -> Vec<String> {
    (0..CORES)
        .map(|partition| keys_on_partition(prefix, partition, CORES, 1).remove(0))
        .collect()
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Start {
    F,
    H0,
    Hq,
    Hf,
}

const STATES: [Start; 4] = [Start::F, Start::H0, Start::Hq, Start::Hf];

impl Start {
    fn waiters(self) -> u32 {
        match self {
            Start::F | Start::H0 => 0,
            Start::Hq => 1,
            Start::Hf => QUEUE_MAX,
        }
    }
}

/// A key in a known state and the sessions that put it there.
struct Fixture {
    key: String,
    holder: Conn,
    /// The holder's token (0 for F).
    token: u64,
    queue: Conn,
    /// Owners queued by `queue`, head first.
    queued: Vec<u64>,
    client: Conn,
}

impl Fixture {
    /// Brings a fresh key (`prefix`, `state`, partition) into `state`.
    fn new(addr: SocketAddr, prefix: &str, state: Start, partition: usize) -> Fixture {
        let key = keys_on_partition(&format!("{prefix}-{state:?}"), partition, CORES, 1).remove(0);
        let mut holder = Conn::connect(addr);
        let mut queue = Conn::connect(addr);
        let client = Conn::connect(addr);
        let token = match state {
            Start::F => 0,
            _ => holder.acquire_ok(&key, LONG_S, fresh_id()),
        };
        let mut queued = Vec::new();
        for _ in 0..state.waiters() {
            let owner = fresh_id();
            queue.send_acquire(&key, LONG_S, LONG_S, owner);
            queued.push(owner);
        }
        let mut fixture = Fixture {
            key,
            holder,
            token,
            queue,
            queued,
            client,
        };
        fixture.expect_state(state);
        fixture
    }

    /// Asserts (from the `queue` session, which also confirms its acquires were queued) that
    /// the key is in `state`.
    #[track_caller]
    fn expect_state(&mut self, state: Start) {
        let seen = self.queue.state(&self.key);
        assert_eq!(seen.held, state != Start::F, "{state:?}: {seen:?}");
        assert_eq!(seen.waiters, state.waiters(), "{state:?}: {seen:?}");
        if state == Start::F {
            assert_eq!(seen, KeyState::FREE);
        } else {
            assert!(seen.lease_ms <= u32::from(LONG_S) * 1000, "{seen:?}");
        }
    }

    /// Asserts that no session of the fixture received anything unexpected.
    fn expect_no_more(&mut self) {
        thread::sleep(QUIET);
        for conn in [&mut self.holder, &mut self.queue, &mut self.client] {
            conn.expect_silence(Duration::from_millis(1));
        }
    }
}

/// Runs `cell` for every state in `states` on a key of each partition, all cells at once
/// (each on its own key and sessions).
fn each_cell(prefix: &str, states: &[Start], cell: impl Fn(Start, &mut Fixture) + Sync) {
    let server = matrix_server();
    let addr = server.local_addr();
    thread::scope(|scope| {
        let cells: Vec<_> = states
            .iter()
            .flat_map(|&state| (0..CORES).map(move |partition| (state, partition)))
            .map(|(state, partition)| {
                let cell = &cell;
                scope.spawn(move || {
                    let mut fixture = Fixture::new(addr, prefix, state, partition);
                    cell(state, &mut fixture);
                    fixture.expect_no_more();
                })
            })
            .collect();
        for handle in cells {
            handle.join().expect("matrix cell");
        }
    });
    assert!(!server.failed());
}

#[test]
fn acquire_wait_zero_grants_a_free_key_and_times_out_on_a_held_one() {
    each_cell("a0", &STATES, |state, f| {
        let owner = fresh_id();
        if state == Start::F {
            f.client.acquire_ok(&f.key, LONG_S, owner);
            f.expect_state(Start::H0);
        } else {
            let answer = f.client.acquire(&f.key, 0, LONG_S, owner);
            assert_eq!(answer, Response::Timeout { owner }, "{state:?}");
            f.expect_state(state);
        }
    });
}

#[test]
fn acquire_with_wait_grants_enqueues_at_the_tail_or_is_busy_when_full() {
    each_cell("aw", &STATES, |state, f| {
        let owner = fresh_id();
        f.client.send_acquire(&f.key, LONG_S, LONG_S, owner);
        match state {
            Start::F => {
                f.client.recv_granted(owner);
                f.expect_state(Start::H0);
            }
            Start::H0 | Start::Hq => {
                // Queued behind every earlier waiter: the fixture's waiters are granted first.
                let seen = f.client.state(&f.key);
                assert_eq!(seen.waiters, state.waiters() + 1, "{state:?}");
                let mut token = f.token;
                for &earlier in &f.queued.clone() {
                    assert_eq!(
                        f.holder.release(&f.key, token),
                        Response::Released { token }
                    );
                    token = f.queue.recv_granted(earlier);
                    f.client.expect_silence(QUIET);
                }
                assert_eq!(
                    f.holder.release(&f.key, token),
                    Response::Released { token }
                );
                assert!(f.client.recv_granted(owner) > token);
            }
            Start::Hf => {
                assert_eq!(f.client.recv(), Response::Busy { owner });
                f.expect_state(Start::Hf);
            }
        }
    });
}

#[test]
fn release_by_the_holders_token_frees_or_hands_off_from_any_session() {
    each_cell("rm", &[Start::H0, Start::Hq, Start::Hf], |state, f| {
        let token = f.token;
        assert_eq!(
            f.client.release(&f.key, token),
            Response::Released { token }
        );
        if state == Start::H0 {
            return f.expect_state(Start::F);
        }
        let next = f.queue.recv_granted(f.queued[0]);
        assert!(next > token, "handoff token {next} not above {token}");
        let seen = f.client.state(&f.key);
        assert!(seen.held);
        assert_eq!(seen.waiters, state.waiters() - 1);
    });
}

#[test]
fn release_with_another_token_is_not_held_and_changes_nothing() {
    each_cell("rn", &STATES, |state, f| {
        let wrong = if state == Start::F {
            12_345
        } else {
            f.token + 1
        };
        assert_eq!(
            f.client.release(&f.key, wrong),
            Response::NotHeld { token: wrong }
        );
        f.expect_state(state);
    });
}

#[test]
fn extend_by_the_holders_token_sets_the_lease_to_now_plus_lease() {
    each_cell("em", &[Start::H0, Start::Hq, Start::Hf], |state, f| {
        let token = f.token;
        // Longer than the fixture's lease, then shorter: the lease is now + lease either way.
        for lease_s in [200u8, 5] {
            assert_eq!(
                f.client.extend(&f.key, lease_s, token),
                Response::Extended { token }
            );
            let seen = f.client.state(&f.key);
            let lease_ms = u32::from(lease_s) * 1000;
            assert!(
                seen.lease_ms <= lease_ms && seen.lease_ms + 5000 > lease_ms,
                "{state:?}: lease_ms {} after extending to {lease_s} s",
                seen.lease_ms
            );
            assert!(seen.held);
            assert_eq!(seen.waiters, state.waiters());
        }
    });
}

#[test]
fn extend_with_another_token_is_not_held_and_changes_nothing() {
    each_cell("en", &STATES, |state, f| {
        let wrong = if state == Start::F {
            12_345
        } else {
            f.token + 1
        };
        assert_eq!(
            f.client.extend(&f.key, 200, wrong),
            Response::NotHeld { token: wrong }
        );
        // The lease is still at most the fixture's, not 200 s.
        f.expect_state(state);
    });
}

#[test]
fn cancel_of_a_queued_owner_removes_it_and_answers_timeout() {
    each_cell("cq", &[Start::Hq, Start::Hf], |state, f| {
        // Withdraw the tail; the head stays queued and is granted on release.
        let tail = *f.queued.last().unwrap();
        f.queue.cancel(&f.key, tail);
        assert_eq!(f.queue.recv(), Response::Timeout { owner: tail });
        let seen = f.queue.state(&f.key);
        assert_eq!(seen.waiters, state.waiters() - 1);
        if state == Start::Hf {
            let token = f.token;
            assert_eq!(
                f.holder.release(&f.key, token),
                Response::Released { token }
            );
            let head = f.queued[0];
            f.queue.recv_granted(head);
        }
    });
}

#[test]
fn cancel_of_an_owner_not_queued_on_this_session_does_nothing() {
    each_cell("cn", &STATES, |state, f| {
        f.client.cancel(&f.key, fresh_id());
        // The same owner as a waiter of another session: not this session's, so untouched.
        if let Some(&theirs) = f.queued.first() {
            f.client.cancel(&f.key, theirs);
        }
        // Each `state` reads the next answer and requires it to be the Q: no T came first.
        let seen = f.client.state(&f.key);
        assert_eq!(seen.waiters, state.waiters());
        f.expect_state(state);
    });
}

#[test]
fn query_reports_held_lease_and_waiters_without_the_token() {
    each_cell("q", &STATES, |state, f| {
        let seen = f.client.state(&f.key);
        match state {
            Start::F => assert_eq!(seen, KeyState::FREE),
            _ => {
                assert!(seen.held);
                let lease_ms = u32::from(LONG_S) * 1000;
                assert!(seen.lease_ms <= lease_ms && seen.lease_ms + 5000 > lease_ms);
                assert_eq!(seen.waiters, state.waiters());
            }
        }
    });
}

// ---------------------------------------------------------------------------------------------
// Events.

/// Runs `test` once per partition, concurrently (timing tests then cost their time once).
fn on_both_partitions(prefix: &str, test: impl Fn(SocketAddr, String) + Sync) {
    let server = start(CORES);
    let addr = server.local_addr();
    thread::scope(|scope| {
        let handles: Vec<_> = keys(prefix)
            .into_iter()
            .map(|key| scope.spawn(|| test(addr, key)))
            .collect();
        for handle in handles {
            handle.join().expect("partition test");
        }
    });
    assert!(!server.failed());
}

#[test]
fn lease_running_out_hands_the_key_to_the_queue_head_with_a_larger_token() {
    on_both_partitions("lease-handoff", |addr, key| {
        let mut holder = Conn::connect(addr);
        let mut waiter = Conn::connect(addr);
        let before_grant = Instant::now();
        let token = holder.acquire_ok(&key, 1, fresh_id());
        let owner = fresh_id();
        waiter.send_acquire(&key, 10, LONG_S, owner);
        assert_eq!(waiter.state(&key).waiters, 1);
        assert!(waiter.recv_granted(owner) > token);
        assert_between(before_grant.elapsed(), secs(1), secs(2));
        assert_eq!(holder.release(&key, token), Response::NotHeld { token });
        let seen = holder.state(&key);
        assert!(seen.held && seen.waiters == 0);
    });
}

#[test]
fn lease_running_out_frees_a_key_without_waiters() {
    on_both_partitions("lease-free", |addr, key| {
        let mut holder = Conn::connect(addr);
        let mut observer = Conn::connect(addr);
        let before_grant = Instant::now();
        let token = holder.acquire_ok(&key, 1, fresh_id());
        let freed = wait_until(secs(3), || {
            let seen = observer.state(&key);
            assert!(seen.lease_ms <= 1000, "{seen:?}");
            !seen.held
        });
        assert!(freed, "the lease never ran out");
        // The free answer was read after the lease ran out, never before.
        assert_between(before_grant.elapsed(), secs(1), secs(2));
        assert_eq!(observer.state(&key), KeyState::FREE);
        assert_eq!(holder.release(&key, token), Response::NotHeld { token });
        observer.acquire_ok(&key, LONG_S, fresh_id());
    });
}

#[test]
fn extend_pushes_the_lease_end_from_the_time_of_the_extend() {
    on_both_partitions("extend-timing", |addr, key| {
        let mut holder = Conn::connect(addr);
        let mut waiter = Conn::connect(addr);
        let before_grant = Instant::now();
        let token = holder.acquire_ok(&key, 1, fresh_id());
        let owner = fresh_id();
        waiter.send_acquire(&key, 10, LONG_S, owner);
        assert_eq!(waiter.state(&key).waiters, 1);
        thread::sleep(Duration::from_millis(500));
        let before_extend = Instant::now();
        assert_eq!(holder.extend(&key, 1, token), Response::Extended { token });
        waiter.recv_granted(owner);
        assert_between(before_extend.elapsed(), secs(1), secs(2));
        assert!(before_grant.elapsed() >= Duration::from_millis(1500));
    });
}

#[test]
fn wait_running_out_answers_timeout_and_leaves_the_queue() {
    on_both_partitions("wait-out", |addr, key| {
        let mut holder = Conn::connect(addr);
        let mut waiter = Conn::connect(addr);
        holder.acquire_ok(&key, LONG_S, fresh_id());
        let owner = fresh_id();
        let before_enqueue = Instant::now();
        waiter.send_acquire(&key, 1, LONG_S, owner);
        assert_eq!(waiter.state(&key).waiters, 1);
        assert_eq!(waiter.recv(), Response::Timeout { owner });
        assert_between(before_enqueue.elapsed(), secs(1), secs(2));
        let seen = waiter.state(&key);
        assert!(seen.held && seen.waiters == 0, "{seen:?}");
        waiter.expect_silence(QUIET);
    });
}

#[test]
fn session_close_withdraws_its_waiters_silently_and_keeps_its_holds() {
    let server = start(CORES);
    let addr = server.local_addr();
    for partition in 0..CORES {
        let held_key = keys_on_partition("close-held", partition, CORES, 1).remove(0);
        let queued_key = keys_on_partition("close-queued", 1 - partition, CORES, 1).remove(0);
        let mut closing = Conn::connect(addr);
        let mut other = Conn::connect(addr);
        let mut third = Conn::connect(addr);
        let held_token = closing.acquire_ok(&held_key, LONG_S, fresh_id());
        let other_token = other.acquire_ok(&queued_key, LONG_S, fresh_id());
        closing.send_acquire(&queued_key, LONG_S, LONG_S, fresh_id());
        assert_eq!(closing.state(&queued_key).waiters, 1);
        drop(closing);
        assert!(
            wait_until(secs(5), || other.state(&queued_key).waiters == 0),
            "the closed session's waiter stayed queued"
        );
        // Releasing the key it waited on grants nobody: the key is free.
        assert_eq!(
            other.release(&queued_key, other_token),
            Response::Released { token: other_token }
        );
        assert_eq!(other.state(&queued_key), KeyState::FREE);
        // Its hold survives, and another session may extend and release it; the release hands
        // the key to a waiter of yet another session.
        let seen = third.state(&held_key);
        assert!(seen.held, "the hold of a closed session was dropped");
        let owner = fresh_id();
        other.send_acquire(&held_key, LONG_S, LONG_S, owner);
        assert_eq!(other.state(&held_key).waiters, 1);
        assert_eq!(
            third.extend(&held_key, LONG_S, held_token),
            Response::Extended { token: held_token }
        );
        assert_eq!(
            third.release(&held_key, held_token),
            Response::Released { token: held_token }
        );
        assert!(other.recv_granted(owner) > held_token);
        other.expect_silence(QUIET);
        third.expect_silence(QUIET);
    }
}

#[test]
fn waiters_are_granted_in_fifo_order_with_increasing_tokens() {
    on_both_partitions("fifo", |addr, key| {
        let mut holder = Conn::connect(addr);
        let mut waiters: Vec<Conn> = (0..4).map(|_| Conn::connect(addr)).collect();
        let mut token = holder.acquire_ok(&key, LONG_S, fresh_id());
        // Queue order: sessions 0, 1, 2, 3, then session 1 again. Each enqueue is confirmed
        // before the next is sent, so the order of arrival is the order listed.
        let order = [0usize, 1, 2, 3, 1];
        let mut owners = Vec::new();
        for (position, &session) in order.iter().enumerate() {
            let owner = fresh_id();
            waiters[session].send_acquire(&key, LONG_S, LONG_S, owner);
            assert_eq!(waiters[session].state(&key).waiters, position as u32 + 1);
            owners.push(owner);
        }
        let mut releaser = holder;
        for (&session, &owner) in order.iter().zip(&owners) {
            assert_eq!(releaser.release(&key, token), Response::Released { token });
            let next = match waiters[session].recv_within(secs(3)) {
                Some(Response::Acquired {
                    owner: o,
                    token: next,
                }) if o == owner => next,
                other => panic!("expected A for {owner} on session {session}, got {other:?}"),
            };
            assert!(next > token, "token {next} after {token}");
            token = next;
            releaser = Conn::connect(addr);
        }
        assert_eq!(releaser.release(&key, token), Response::Released { token });
        for waiter in &mut waiters {
            waiter.expect_silence(QUIET);
        }
        assert_eq!(releaser.state(&key), KeyState::FREE);
    });
}

#[test]
fn a_release_answer_is_written_before_the_grant_it_causes_on_the_same_session() {
    on_both_partitions("r-before-a", |addr, key| {
        let mut session = Conn::connect(addr);
        let token = session.acquire_ok(&key, LONG_S, fresh_id());
        let owner = fresh_id();
        session.send_acquire(&key, LONG_S, LONG_S, owner);
        session.send(Request::Release {
            token,
            key: key.as_bytes(),
        });
        // The Acquire was sent first, so it is queued before the Release executes.
        assert_eq!(session.recv(), Response::Released { token });
        assert!(session.recv_granted(owner) > token);
        session.expect_silence(QUIET);
    });
}

#[test]
fn cancel_withdraws_every_acquire_of_that_owner_each_answered_timeout() {
    on_both_partitions("cancel-all", |addr, key| {
        let mut holder = Conn::connect(addr);
        let mut session = Conn::connect(addr);
        let token = holder.acquire_ok(&key, LONG_S, fresh_id());
        let (cancelled, kept) = (fresh_id(), fresh_id());
        for owner in [cancelled, kept, cancelled, cancelled] {
            session.send_acquire(&key, LONG_S, LONG_S, owner);
        }
        assert_eq!(session.state(&key).waiters, 4);
        session.cancel(&key, cancelled);
        for _ in 0..3 {
            assert_eq!(session.recv(), Response::Timeout { owner: cancelled });
        }
        assert_eq!(session.state(&key).waiters, 1);
        assert_eq!(holder.release(&key, token), Response::Released { token });
        session.recv_granted(kept);
        session.expect_silence(QUIET);
    });
}

#[test]
fn the_holders_own_session_acquiring_again_is_treated_like_anyone() {
    on_both_partitions("reacquire", |addr, key| {
        let mut session = Conn::connect(addr);
        let owner = fresh_id();
        let token = session.acquire_ok(&key, LONG_S, owner);
        // Same key, same owner, same session: not reentrant, not a renewal.
        assert_eq!(
            session.acquire(&key, 0, LONG_S, owner),
            Response::Timeout { owner }
        );
        session.send_acquire(&key, 1, LONG_S, owner);
        let seen = session.state(&key);
        assert_eq!(seen.waiters, 1);
        assert!(seen.lease_ms <= u32::from(LONG_S) * 1000);
        // It waits like anyone: its wait of 1 s runs out while the session still holds.
        assert_eq!(
            session.recv_within(secs(3)),
            Some(Response::Timeout { owner })
        );
        assert_eq!(session.release(&key, token), Response::Released { token });
        assert_eq!(session.state(&key), KeyState::FREE);
    });
}
