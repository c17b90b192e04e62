//! The capacity rules of docs/protocol.md §3 in one partition: `max_keys`, the per-session pending
//! limit (also shared across partitions), shutdown, and tokens that run out of reservation.

use super::*;

#[test]
fn max_keys_refuses_new_keys_only() {
    let mut fixture = Fixture::new(2, 2);
    let a = fixture.grant(1, 5, 1, b"a");
    fixture.grant(1, 5, 2, b"b");
    assert_eq!(fixture.acquire(2, 0, 5, 3, b"c"), vec![busy(2, 3, false)]);
    assert_eq!(fixture.acquire(2, 4, 5, 4, b"c"), vec![busy(2, 4, true)]);
    // An existing key still queues, and a handoff does not need a new entry.
    fixture.enqueue(2, 4, 5, 5, b"a");
    assert_eq!(
        fixture.release(1, a, b"a")[1],
        granted(2, 5, a + 2, true, b"a")
    );
    assert_eq!(fixture.table.key_count(), 2);
    assert_eq!(fixture.release(2, a + 2, b"a").len(), 1);
    assert_eq!(
        fixture.acquire(2, 0, 5, 6, b"c"),
        vec![granted(2, 6, a + 3, false, b"c")]
    );
}

/// A table whose sessions may queue `max_pending` acquires each.
fn with_pending_limit(max_pending: u32) -> Fixture {
    let fixture = Fixture::new(8, 8);
    let config = TableConfig {
        max_pending_per_session: max_pending,
        ..fixture.table.config
    };
    let tokens = TokenRange {
        next: FIRST_TOKEN,
        step: 1,
        limit: u64::MAX / 2,
    };
    Fixture {
        table: LockTable::new(config, fixture.now_us, tokens),
        ..fixture
    }
}

#[test]
fn pending_limit_refuses_only_what_would_queue() {
    let mut fixture = with_pending_limit(1);
    let holder = fixture.grant(1, 9, 1, KEY);
    fixture.grant(1, 9, 2, b"other");
    fixture.enqueue(2, 3, 5, 3, KEY);
    // At the limit: a second acquire that would queue is refused, whatever the key...
    assert_eq!(
        fixture.acquire(2, 3, 5, 4, b"other"),
        vec![busy(2, 4, true)]
    );
    // ...but one that is granted at once, or does not wait, is executed as usual.
    assert_eq!(
        fixture.acquire(2, 3, 5, 5, b"free"),
        vec![granted(2, 5, FIRST_TOKEN + 2, true, b"free")]
    );
    assert_eq!(fixture.acquire(2, 0, 5, 6, KEY), vec![timeout(2, 6, false)]);
    // Another session has its own count.
    fixture.enqueue(3, 3, 5, 7, KEY);
    // Once its waiter is granted, the session may queue again.
    let answers = fixture.release(1, holder, KEY);
    assert_eq!(answers[1], granted(2, 3, FIRST_TOKEN + 3, true, KEY));
    fixture.enqueue(2, 3, 5, 8, b"other");
    fixture.table.check_invariants();
}

/// Shared counts of a test "server": a session's places across partitions.
#[derive(Default)]
struct Places(std::sync::Mutex<HashMap<SessionId, u32>>);

impl QueueCounts for Places {
    fn try_add(&self, session: SessionId, max: u32) -> bool {
        let mut places = self.0.lock().unwrap();
        let queued = places.entry(session).or_insert(0);
        let free = *queued < max;
        *queued += u32::from(free);
        free
    }

    fn remove(&self, session: SessionId) {
        let mut places = self.0.lock().unwrap();
        let queued = places.get_mut(&session).expect("removed more than added");
        *queued -= 1;
    }
}

#[test]
fn shared_counts_bound_a_session_across_partitions() {
    let places = Arc::new(Places::default());
    let mut left = with_pending_limit(2);
    let mut right = with_pending_limit(2);
    left.table.share_queue_counts(places.clone());
    right.table.share_queue_counts(places.clone());
    let held_left = left.grant(1, 9, 1, KEY);
    right.grant(1, 9, 2, KEY);
    left.enqueue(2, 3, 5, 3, KEY);
    right.enqueue(2, 3, 5, 4, KEY);
    // Two queued in total: the next one that would queue is refused in either partition.
    assert_eq!(left.acquire(2, 3, 5, 5, KEY), vec![busy(2, 5, true)]);
    assert_eq!(right.acquire(2, 3, 5, 6, KEY), vec![busy(2, 6, true)]);
    // Granted at once does not take a place.
    assert_eq!(
        right.acquire(2, 3, 5, 7, b"free").len(),
        1,
        "a free key is granted at the limit"
    );
    // Every way out of a queue gives the place back: a grant...
    left.release(1, held_left, KEY);
    right.acquire(2, 3, 5, 8, KEY);
    assert_eq!(places.0.lock().unwrap()[&2], 2);
    // ...a timeout (both of `right`'s waiters), a close and a shutdown.
    right.advance(3 * SECOND_US + TICK_US);
    assert_eq!(places.0.lock().unwrap()[&2], 0);
    left.enqueue(2, 3, 5, 9, KEY);
    assert_eq!(places.0.lock().unwrap()[&2], 1);
    left.table.handle_session_closed(2);
    assert_eq!(places.0.lock().unwrap()[&2], 0);
    right.enqueue(2, 3, 5, 10, KEY);
    assert_eq!(places.0.lock().unwrap()[&2], 1);
    right.table.handle_shutdown();
    assert_eq!(places.0.lock().unwrap()[&2], 0);
    left.table.check_invariants();
    right.table.check_invariants();
}

#[test]
fn shutdown_answers_busy_to_waiters_and_later_acquires() {
    let mut fixture = Fixture::new(4, 4);
    let token = fixture.grant(1, 2, 1, KEY);
    fixture.enqueue(2, 9, 5, 2, KEY);
    fixture.enqueue(3, 9, 5, 3, KEY);
    fixture.table.handle_shutdown();
    let mut answers = drain(&mut fixture.table);
    answers.sort_by_key(|seen| seen.session);
    assert_eq!(answers, vec![busy(2, 2, true), busy(3, 3, true)]);
    assert!(fixture.table.is_shutting_down());
    assert_eq!(
        fixture.acquire(4, 0, 5, 4, b"free"),
        vec![busy(4, 4, false)]
    );
    assert_eq!(fixture.acquire(4, 3, 5, 5, KEY), vec![busy(4, 5, true)]);
    // Holds still work until they are released or run out.
    let extended = said(1, Response::Extended { token }, false);
    assert_eq!(fixture.extend(1, 1, token, KEY), vec![extended]);
    assert!(fixture.advance(SECOND_US).is_empty());
    assert_eq!(fixture.query(KEY), (false, 0, 0));
}

#[test]
fn token_reservation_exhaustion_answers_busy_until_raised() {
    let tokens = TokenRange {
        next: FIRST_TOKEN,
        step: 4,
        limit: FIRST_TOKEN + 4,
    };
    let mut fixture = Fixture::with_tokens(8, 4, START_US, tokens);
    assert_eq!(fixture.table.token_headroom(), 2);
    let a = fixture.grant(1, 5, 1, b"a");
    let b = fixture.grant(1, 5, 2, b"b");
    assert_eq!((a, b), (FIRST_TOKEN, FIRST_TOKEN + 4));
    assert_eq!(fixture.table.token_headroom(), 0);
    assert_eq!(fixture.acquire(2, 0, 5, 3, b"c"), vec![busy(2, 3, false)]);
    assert_eq!(fixture.acquire(2, 2, 5, 4, b"c"), vec![busy(2, 4, true)]);
    // Queueing needs no token; the handoff does: every waiter gets B and the key is freed.
    fixture.enqueue(2, 9, 5, 5, b"a");
    fixture.enqueue(3, 9, 5, 6, b"a");
    let answers = fixture.release(1, a, b"a");
    let released = said(1, Response::Released { token: a }, false);
    assert_eq!(answers, vec![released, busy(2, 5, true), busy(3, 6, true)]);
    assert_eq!(fixture.query(b"a"), (false, 0, 0));
    fixture.table.raise_token_limit(FIRST_TOKEN + 12);
    fixture.table.raise_token_limit(FIRST_TOKEN);
    assert_eq!(fixture.table.token_headroom(), 2);
    assert_eq!(fixture.table.next_token(), FIRST_TOKEN + 8);
    assert_eq!(fixture.grant(2, 5, 7, b"c"), FIRST_TOKEN + 8);
}

#[test]
fn cancel_costs_at_most_the_sessions_own_waiters() {
    let mut fixture = Fixture::new(4, 5_000);
    fixture.grant(1, 255, 1, KEY);
    for owner in 0..2_000 {
        let acquire = Acquire {
            wait_s: 255,
            lease_s: 1,
            owner: 100 + owner,
        };
        fixture
            .table
            .handle_acquire(START_US, 2 + owner % 4, acquire, KEY);
    }
    fixture.enqueue(99, 255, 1, 7, KEY);
    assert!(fixture
        .request(99, Request::Cancel { owner: 8, key: KEY })
        .is_empty());
    assert_eq!(
        fixture.table.cancel_steps, 1,
        "one waiter of session 99 looked at"
    );
    let answers = fixture.request(99, Request::Cancel { owner: 7, key: KEY });
    assert_eq!(answers, vec![timeout(99, 7, true)]);
    assert_eq!(fixture.table.cancel_steps, 1);
    // A session with nothing queued here costs nothing; a short queue is walked instead.
    assert!(fixture
        .request(98, Request::Cancel { owner: 7, key: KEY })
        .is_empty());
    assert_eq!(fixture.table.cancel_steps, 0);
    assert_eq!(fixture.query(KEY).2, 2_000);
}
