//! Lock-table tests on virtual time: every cell of the PROTOCOL.md §3 matrix and every event,
//! then random operation sequences checked step by step against a small reference model and an
//! observer that only sees the answers.

use super::*;
use proptest::prelude::*;
use std::collections::{BTreeMap, HashMap, HashSet, VecDeque};

const TICK_US: u64 = 1000;
const SECOND_US: u64 = 1_000_000;
/// Virtual time at which every fixture starts (on a tick boundary).
const START_US: u64 = 7_000_000;
const FIRST_TOKEN: u64 = 1_000;
/// A session that only queries, so its answers never mix with the others'.
const SPECTATOR: SessionId = u64::MAX;

/// One answer as a test sees it: for a grant, the key its entry names instead of the index.
#[derive(Clone, Debug, PartialEq, Eq)]
struct Seen {
    session: SessionId,
    response: Response,
    ends_pending: bool,
    key: Option<Vec<u8>>,
}

fn said(session: SessionId, response: Response, ends_pending: bool) -> Seen {
    Seen {
        session,
        response,
        ends_pending,
        key: None,
    }
}

fn granted(session: SessionId, owner: u64, token: u64, ends_pending: bool, key: &[u8]) -> Seen {
    let response = Response::Acquired { owner, token };
    Seen {
        key: Some(key.to_vec()),
        ..said(session, response, ends_pending)
    }
}

fn timeout(session: SessionId, owner: u64, ends_pending: bool) -> Seen {
    said(session, Response::Timeout { owner }, ends_pending)
}

fn busy(session: SessionId, owner: u64, ends_pending: bool) -> Seen {
    said(session, Response::Busy { owner }, ends_pending)
}

/// Drains the table's answers, checking the invariants and what `entry` names.
fn drain(table: &mut LockTable) -> Vec<Seen> {
    table.check_invariants();
    let answers = table.take_answers();
    let seen = answers
        .iter()
        .map(|answer| {
            let key = match answer.response {
                Response::Acquired { .. } => {
                    let key = table
                        .entry_key(answer.entry)
                        .expect("a grant names a live entry");
                    Some(key.to_vec())
                }
                _ => {
                    assert_eq!(answer.entry, u32::MAX, "only grants name an entry");
                    None
                }
            };
            Seen {
                session: answer.session,
                response: answer.response,
                ends_pending: answer.ends_pending,
                key,
            }
        })
        .collect();
    table.return_answers(answers);
    seen
}

/// A table on virtual time.
struct Fixture {
    table: LockTable,
    now_us: u64,
}

impl Fixture {
    fn new(max_keys: usize, max_waiters_per_key: u32) -> Fixture {
        let tokens = TokenRange {
            next: FIRST_TOKEN,
            step: 1,
            limit: u64::MAX / 2,
        };
        Fixture::with_tokens(max_keys, max_waiters_per_key, START_US, tokens)
    }

    fn with_tokens(max_keys: usize, waiters: u32, now_us: u64, tokens: TokenRange) -> Fixture {
        let config = TableConfig {
            max_keys,
            max_waiters_per_key: waiters,
            tick_us: TICK_US,
            max_pending_per_session: u32::MAX,
        };
        Fixture {
            table: LockTable::new(config, now_us, tokens),
            now_us,
        }
    }

    fn request(&mut self, session: SessionId, request: Request<'_>) -> Vec<Seen> {
        self.table.handle_request(self.now_us, session, &request);
        drain(&mut self.table)
    }

    fn acquire(
        &mut self,
        session: SessionId,
        wait_s: u8,
        lease_s: u8,
        owner: u64,
        key: &[u8],
    ) -> Vec<Seen> {
        let request = Request::Acquire {
            wait_s,
            lease_s,
            owner,
            key,
        };
        self.request(session, request)
    }

    /// Acquires a key that must be granted at once; returns the token.
    fn grant(&mut self, session: SessionId, lease_s: u8, owner: u64, key: &[u8]) -> u64 {
        let answers = self.acquire(session, 0, lease_s, owner, key);
        match answers[..] {
            [Seen {
                response: Response::Acquired { owner: got, token },
                ..
            }] if got == owner => token,
            _ => panic!("expected a grant, got {answers:?}"),
        }
    }

    /// Queues an acquire that must get no answer yet.
    fn enqueue(&mut self, session: SessionId, wait_s: u8, lease_s: u8, owner: u64, key: &[u8]) {
        assert_eq!(self.acquire(session, wait_s, lease_s, owner, key), vec![]);
    }

    fn release(&mut self, session: SessionId, token: u64, key: &[u8]) -> Vec<Seen> {
        self.request(session, Request::Release { token, key })
    }

    fn extend(&mut self, session: SessionId, lease_s: u8, token: u64, key: &[u8]) -> Vec<Seen> {
        let request = Request::Extend {
            lease_s,
            token,
            key,
        };
        self.request(session, request)
    }

    fn cancel(&mut self, session: SessionId, owner: u64, key: &[u8]) -> Vec<Seen> {
        self.request(session, Request::Cancel { owner, key })
    }

    /// `(held, lease_ms, waiters)` of `key`.
    fn query(&mut self, key: &[u8]) -> (bool, u32, u32) {
        let answers = self.request(SPECTATOR, Request::Query { nonce: 5, key });
        match answers[..] {
            [Seen {
                response:
                    Response::State {
                        nonce: 5,
                        held,
                        lease_ms,
                        waiters,
                    },
                ends_pending: false,
                ..
            }] => (held, lease_ms, waiters),
            _ => panic!("expected one State, got {answers:?}"),
        }
    }

    /// Moves time to `now_us` and runs the timers, as one reactor iteration does.
    fn run_timers_at(&mut self, now_us: u64) -> Vec<Seen> {
        assert!(now_us >= self.now_us, "time goes forward");
        self.now_us = now_us;
        self.table.handle_timers(now_us);
        drain(&mut self.table)
    }

    fn advance(&mut self, by_us: u64) -> Vec<Seen> {
        self.run_timers_at(self.now_us + by_us)
    }
}

// ---------------------------------------------------------------------------------------------
// The §3 matrix, one test per row, each over the four key states

const KEY: &[u8] = b"matrix-key";
const HOLDER: SessionId = 1;
const HOLDER_OWNER: u64 = 100;
const HOLD_S: u8 = 30;
/// The waiters of a full queue, in order: (session, owner, lease).
const QUEUED: [(SessionId, u64, u8); 3] = [(2, 200, 7), (3, 300, 8), (2, 400, 9)];
const MAX_WAITERS: u32 = QUEUED.len() as u32;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum KeyState {
    /// F: free.
    Free,
    /// H0: held, no waiters.
    Held,
    /// Hq: held, queue with room.
    Queued,
    /// Hf: held, queue at `max_waiters_per_key`.
    Full,
}

const STATES: [KeyState; 4] = [
    KeyState::Free,
    KeyState::Held,
    KeyState::Queued,
    KeyState::Full,
];

/// A fixture with `KEY` in `state`; returns it and the holder's token (0 when free).
fn in_state(state: KeyState) -> (Fixture, u64) {
    let mut fixture = Fixture::new(16, MAX_WAITERS);
    if state == KeyState::Free {
        return (fixture, 0);
    }
    let token = fixture.grant(HOLDER, HOLD_S, HOLDER_OWNER, KEY);
    let queued = match state {
        KeyState::Queued => 1,
        KeyState::Full => QUEUED.len(),
        _ => 0,
    };
    for &(session, owner, lease_s) in &QUEUED[..queued] {
        fixture.enqueue(session, 5, lease_s, owner, KEY);
    }
    let waiters = queued as u32;
    assert_eq!(
        fixture.query(KEY),
        (true, u32::from(HOLD_S) * 1000, waiters)
    );
    (fixture, token)
}

fn waiters_of(state: KeyState) -> u32 {
    match state {
        KeyState::Free | KeyState::Held => 0,
        KeyState::Queued => 1,
        KeyState::Full => MAX_WAITERS,
    }
}

#[test]
fn matrix_acquire_wait_0() {
    for state in STATES {
        let (mut fixture, _) = in_state(state);
        let answers = fixture.acquire(9, 0, 5, 900, KEY);
        if state == KeyState::Free {
            assert_eq!(answers, vec![granted(9, 900, FIRST_TOKEN, false, KEY)]);
            assert_eq!(fixture.query(KEY), (true, 5000, 0), "now H0");
        } else {
            assert_eq!(answers, vec![timeout(9, 900, false)], "{state:?}");
            let unchanged = (true, u32::from(HOLD_S) * 1000, waiters_of(state));
            assert_eq!(fixture.query(KEY), unchanged, "{state:?}");
        }
    }
}

#[test]
fn matrix_acquire_wait_positive() {
    for state in STATES {
        let (mut fixture, _) = in_state(state);
        let answers = fixture.acquire(9, 4, 5, 900, KEY);
        let (want, waiters) = match state {
            KeyState::Free => (vec![granted(9, 900, FIRST_TOKEN, true, KEY)], 0),
            KeyState::Held | KeyState::Queued => (vec![], waiters_of(state) + 1),
            KeyState::Full => (vec![busy(9, 900, true)], MAX_WAITERS),
        };
        assert_eq!(answers, want, "{state:?}");
        assert_eq!(fixture.query(KEY).2, waiters, "{state:?}");
    }
    // Enqueued at the tail: the new waiter is granted after the one already queued.
    let (mut fixture, token) = in_state(KeyState::Queued);
    fixture.enqueue(9, 4, 5, 900, KEY);
    let answers = fixture.release(HOLDER, token, KEY);
    assert_eq!(answers[1], granted(2, 200, token + 1, true, KEY));
    let answers = fixture.release(HOLDER, token + 1, KEY);
    assert_eq!(answers[1], granted(9, 900, token + 2, true, KEY));
}

#[test]
fn matrix_release_match() {
    for state in [KeyState::Held, KeyState::Queued, KeyState::Full] {
        let (mut fixture, token) = in_state(state);
        // The token is the authority: any session may release.
        let answers = fixture.release(8, token, KEY);
        let released = said(8, Response::Released { token }, false);
        if state == KeyState::Held {
            assert_eq!(answers, vec![released]);
            assert_eq!(fixture.query(KEY), (false, 0, 0));
            assert_eq!(fixture.table.key_count(), 0);
        } else {
            let (session, owner, lease_s) = QUEUED[0];
            let head = granted(session, owner, token + 1, true, KEY);
            assert_eq!(answers, vec![released, head], "{state:?}");
            let left = waiters_of(state) - 1;
            let lease_ms = u32::from(lease_s) * 1000;
            assert_eq!(fixture.query(KEY), (true, lease_ms, left), "{state:?}");
        }
    }
}

#[test]
fn matrix_release_and_extend_no_match() {
    for state in STATES {
        let (mut fixture, token) = in_state(state);
        for wrong in [token + 1, token.wrapping_sub(1), 0, u64::MAX] {
            let not_held = said(4, Response::NotHeld { token: wrong }, false);
            assert_eq!(fixture.release(4, wrong, KEY), vec![not_held.clone()]);
            assert_eq!(fixture.extend(4, 9, wrong, KEY), vec![not_held]);
        }
        let unchanged = match state {
            KeyState::Free => (false, 0, 0),
            _ => (true, u32::from(HOLD_S) * 1000, waiters_of(state)),
        };
        assert_eq!(fixture.query(KEY), unchanged, "{state:?}");
    }
}

#[test]
fn matrix_extend_match() {
    for state in [KeyState::Held, KeyState::Queued, KeyState::Full] {
        let (mut fixture, token) = in_state(state);
        fixture.advance(1_234_567);
        let extended = said(4, Response::Extended { token }, false);
        assert_eq!(
            fixture.extend(4, 2, token, KEY),
            vec![extended],
            "{state:?}"
        );
        // lease = now + lease: shorter than what was left, and counted from the Extend.
        let lease_end_us = fixture.now_us + 2 * SECOND_US;
        assert_eq!(fixture.query(KEY), (true, 2000, waiters_of(state)));
        // It fires at the first tick boundary at or after the new end, not before.
        let boundary_us = lease_end_us.div_ceil(TICK_US) * TICK_US;
        let quiet = fixture.run_timers_at(boundary_us - 1);
        assert!(quiet.is_empty() && fixture.query(KEY).0);
        let answers = fixture.run_timers_at(boundary_us);
        let want = match state {
            KeyState::Held => vec![],
            _ => vec![granted(2, 200, token + 1, true, KEY)],
        };
        assert_eq!(answers, want, "{state:?}");
    }
}

#[test]
fn matrix_cancel_queued() {
    for state in [KeyState::Queued, KeyState::Full] {
        let (mut fixture, token) = in_state(state);
        assert_eq!(fixture.cancel(2, 200, KEY), vec![timeout(2, 200, true)]);
        assert_eq!(fixture.query(KEY).2, waiters_of(state) - 1);
        let answers = fixture.release(HOLDER, token, KEY);
        if state == KeyState::Full {
            assert_eq!(answers[1], granted(3, 300, token + 1, true, KEY));
        } else {
            assert_eq!(answers.len(), 1);
            assert_eq!(fixture.query(KEY), (false, 0, 0));
        }
    }
}

#[test]
fn matrix_cancel_not_queued_does_nothing() {
    for state in STATES {
        let (mut fixture, _) = in_state(state);
        // An owner nobody queued; an owner queued by another session; the holder's own owner.
        for (session, owner) in [(2, 999), (3, 200), (HOLDER, HOLDER_OWNER), (9, 400)] {
            assert_eq!(fixture.cancel(session, owner, KEY), vec![], "{state:?}");
        }
        assert_eq!(fixture.cancel(2, 200, b"other-key"), vec![]);
        let unchanged = match state {
            KeyState::Free => (false, 0, 0),
            _ => (true, u32::from(HOLD_S) * 1000, waiters_of(state)),
        };
        assert_eq!(fixture.query(KEY), unchanged, "{state:?}");
    }
}

#[test]
fn matrix_query() {
    for state in STATES {
        let (mut fixture, _) = in_state(state);
        let answers = fixture.request(
            6,
            Request::Query {
                nonce: 77,
                key: KEY,
            },
        );
        let held = state != KeyState::Free;
        let state_answer = Response::State {
            nonce: 77,
            held,
            lease_ms: if held { u32::from(HOLD_S) * 1000 } else { 0 },
            waiters: waiters_of(state),
        };
        assert_eq!(answers, vec![said(6, state_answer, false)], "{state:?}");
    }
}

// ---------------------------------------------------------------------------------------------
// Events and limits

#[test]
fn grants_name_their_entry_inline_and_long_keys() {
    let mut fixture = Fixture::new(8, 2);
    let long = [b'L'; 200];
    for key in [
        &b"k"[..],
        &[b's'; 22],
        &[b'h'; 23],
        &long,
        "ключ".as_bytes(),
    ] {
        let token = fixture.grant(1, 3, 10, key);
        let answers = fixture.acquire(2, 0, 3, 11, key);
        assert_eq!(answers, vec![timeout(2, 11, false)]);
        assert_eq!(fixture.release(1, token, key).len(), 1);
    }
    // Keys compare byte for byte: a prefix is another key.
    fixture.grant(1, 3, 12, &long);
    fixture.grant(1, 3, 13, &long[..199]);
    assert_eq!(fixture.table.key_count(), 2);
}

#[test]
fn key_bytes_keep_their_bytes_inline_or_not() {
    for len in [
        1,
        INLINE_KEY_BYTES - 1,
        INLINE_KEY_BYTES,
        INLINE_KEY_BYTES + 1,
        1024,
    ] {
        let key: Vec<u8> = (0..len).map(|i| b'a' + (i % 26) as u8).collect();
        let kept = KeyBytes::new(&key);
        assert_eq!(&*kept, key.as_slice());
        assert_eq!(
            matches!(kept, KeyBytes::Inline { .. }),
            len <= INLINE_KEY_BYTES
        );
    }
}

#[test]
fn ping_is_not_the_tables_business() {
    // The reactor answers Ping; handed to a table it changes nothing and answers nothing.
    let mut fixture = Fixture::new(1, 1);
    let answers = fixture.request(3, Request::Ping { nonce: 0x0A0A });
    assert!(answers.is_empty());
    assert_eq!(fixture.table.key_count(), 0);
}

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
    let mut fixture = Fixture::new(8, 8);
    fixture.table.config.max_pending_per_session = max_pending;
    fixture
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
fn cancel_withdraws_every_matching_waiter_in_order() {
    let mut fixture = Fixture::new(4, 8);
    let token = fixture.grant(1, 9, 1, KEY);
    fixture.grant(1, 9, 9, b"elsewhere");
    fixture.enqueue(2, 5, 3, 7, KEY);
    fixture.enqueue(3, 5, 3, 7, KEY);
    fixture.enqueue(2, 5, 3, 8, KEY);
    fixture.enqueue(2, 6, 4, 7, KEY);
    fixture.enqueue(2, 5, 3, 7, b"elsewhere");
    let answers = fixture.cancel(2, 7, KEY);
    assert_eq!(answers, vec![timeout(2, 7, true), timeout(2, 7, true)]);
    assert_eq!(fixture.query(KEY).2, 2);
    assert_eq!(fixture.query(b"elsewhere").2, 1);
    assert_eq!(fixture.cancel(2, 7, KEY), vec![]);
    let answers = fixture.release(1, token, KEY);
    assert_eq!(answers[1], granted(3, 7, token + 2, true, KEY));
}

#[test]
fn query_rounds_lease_down_to_milliseconds() {
    let mut fixture = Fixture::new(4, 4);
    fixture.grant(1, 2, 1, KEY);
    fixture.enqueue(2, 9, 1, 2, KEY);
    fixture.enqueue(3, 9, 1, 3, KEY);
    let lease_end_us = START_US + 2 * SECOND_US;
    for (at_us, lease_ms) in [
        (0, 2000),
        (1, 1999),
        (999, 1999),
        (1000, 1999),
        (1001, 1998),
        (1_999_999, 0),
    ] {
        fixture.now_us = START_US + at_us;
        assert_eq!(fixture.query(KEY), (true, lease_ms, 2), "at +{at_us} µs");
    }
    // At the lease end, before the timers run: still held, 0 ms left (at most one tick).
    fixture.now_us = lease_end_us;
    assert_eq!(fixture.query(KEY), (true, 0, 2));
    let answers = fixture.run_timers_at(lease_end_us);
    assert_eq!(answers, vec![granted(2, 2, FIRST_TOKEN + 1, true, KEY)]);
    assert_eq!(fixture.query(KEY), (true, 1000, 1));
}

#[test]
fn lease_expiry_hands_off_in_fifo_order_then_frees() {
    let mut fixture = Fixture::new(4, 4);
    let first = fixture.grant(1, 1, 1, KEY);
    fixture.enqueue(2, 9, 2, 2, KEY);
    fixture.enqueue(3, 9, 1, 3, KEY);
    let mut lease_end_us = START_US + SECOND_US;
    assert!(fixture.run_timers_at(lease_end_us - 1).is_empty());
    let answers = fixture.run_timers_at(lease_end_us);
    assert_eq!(answers, vec![granted(2, 2, first + 1, true, KEY)]);
    // The new lease counts from the handoff.
    lease_end_us += 2 * SECOND_US;
    assert_eq!(fixture.query(KEY), (true, 2000, 1));
    // The expired holder's token is dead.
    let not_held = said(1, Response::NotHeld { token: first }, false);
    assert_eq!(fixture.release(1, first, KEY), vec![not_held]);
    assert!(fixture.run_timers_at(lease_end_us - 1).is_empty());
    let answers = fixture.run_timers_at(lease_end_us);
    assert_eq!(answers, vec![granted(3, 3, first + 2, true, KEY)]);
    assert!(fixture
        .run_timers_at(lease_end_us + SECOND_US - 1)
        .is_empty());
    assert!(fixture.run_timers_at(lease_end_us + SECOND_US).is_empty());
    assert_eq!(fixture.query(KEY), (false, 0, 0));
    assert_eq!(
        (fixture.table.key_count(), fixture.table.waiter_count()),
        (0, 0)
    );
    assert_eq!(fixture.table.next_deadline_us(), None);
}

#[test]
fn wait_expiry_answers_timeout() {
    let mut fixture = Fixture::new(4, 4);
    fixture.grant(1, 60, 1, KEY);
    fixture.enqueue(2, 1, 5, 2, KEY);
    fixture.advance(300_000);
    fixture.enqueue(3, 1, 5, 3, KEY);
    let wait_end_us = START_US + SECOND_US;
    assert!(fixture.run_timers_at(wait_end_us - 1).is_empty());
    assert_eq!(
        fixture.run_timers_at(wait_end_us),
        vec![timeout(2, 2, true)]
    );
    assert_eq!(fixture.query(KEY), (true, 59_000, 1));
    assert!(fixture.run_timers_at(wait_end_us + 299_999).is_empty());
    assert_eq!(fixture.advance(1), vec![timeout(3, 3, true)]);
    assert_eq!(fixture.query(KEY).2, 0);
}

/// Runs the timers every `step_us` from `from_us` until something fires; returns when.
fn first_firing(fixture: &mut Fixture, from_us: u64, step_us: u64) -> (u64, Vec<Seen>) {
    let mut now_us = from_us;
    for _ in 0..10_000 {
        let answers = fixture.run_timers_at(now_us);
        if !answers.is_empty() {
            return (now_us, answers);
        }
        now_us += step_us;
    }
    panic!("nothing fired");
}

#[test]
fn timers_never_fire_early_and_at_most_one_tick_late() {
    for offset_us in [0, 1, 250, 999, 1000, 1001] {
        for step_us in [1, 7, 100, 1000] {
            let start_us = START_US + offset_us;
            let tokens = TokenRange {
                next: 1,
                step: 1,
                limit: 100,
            };
            let mut fixture = Fixture::with_tokens(4, 4, start_us, tokens);
            fixture.grant(1, 1, 1, b"lease");
            fixture.grant(1, 10, 2, b"wait");
            fixture.enqueue(2, 1, 1, 3, b"wait");
            fixture.enqueue(3, 9, 1, 4, b"lease");
            let end_us = start_us + SECOND_US;
            // First boundary at or after the end; both fire together, wait first.
            let (fired_us, answers) = first_firing(&mut fixture, end_us - 1500, step_us);
            let tick_end_us = end_us.div_ceil(TICK_US) * TICK_US;
            assert!(fired_us >= end_us, "early: {fired_us} < {end_us}");
            assert!(fired_us >= tick_end_us && fired_us < tick_end_us + step_us);
            assert!(fired_us - end_us < TICK_US + step_us, "late: {fired_us}");
            let want = vec![timeout(2, 3, true), granted(3, 4, 3, true, b"lease")];
            assert_eq!(answers, want, "offset {offset_us} step {step_us}");
        }
    }
}

#[test]
fn longest_lease_and_wait_fire_on_time_after_a_long_jump() {
    let start_us = START_US + 1234;
    let tokens = TokenRange {
        next: 1,
        step: 1,
        limit: 100,
    };
    let mut fixture = Fixture::with_tokens(4, 4, start_us, tokens);
    fixture.grant(1, 255, 1, KEY);
    assert!(fixture.advance(500_000).is_empty());
    fixture.enqueue(2, 255, 255, 2, KEY);
    fixture.enqueue(3, 255, 255, 3, KEY);
    // The first call jumps 254 s across the wheel's levels; then every microsecond.
    let lease_end_us = start_us + 255 * SECOND_US;
    let (fired_us, answers) = first_firing(&mut fixture, lease_end_us - 1500, 1);
    assert_eq!(fired_us, lease_end_us.div_ceil(TICK_US) * TICK_US);
    assert_eq!(answers, vec![granted(2, 2, 2, true, KEY)]);
    let wait_end_us = lease_end_us + 500_000;
    let (fired_us, answers) = first_firing(&mut fixture, wait_end_us - 1500, 1);
    assert_eq!(fired_us, wait_end_us.div_ceil(TICK_US) * TICK_US);
    assert_eq!(answers, vec![timeout(3, 3, true)]);
    assert_eq!(fixture.query(KEY).2, 0);
}

#[test]
fn a_wait_ending_after_the_lease_in_the_same_tick_gets_the_key() {
    let mut fixture = Fixture::new(4, 4);
    fixture.now_us += 100;
    let token = fixture.grant(1, 1, 1, KEY);
    fixture.now_us += 300;
    // The lease ends at +1 s 100 µs, the wait at +1 s 400 µs: both in the tick ending +1.001 s.
    // Processed in one step, they take effect in the order of their ends: the key is handed
    // to the waiter before its wait runs out.
    fixture.enqueue(2, 1, 5, 2, KEY);
    assert!(fixture.run_timers_at(START_US + SECOND_US + 999).is_empty());
    let answers = fixture.run_timers_at(START_US + SECOND_US + TICK_US);
    assert_eq!(answers, vec![granted(2, 2, token + 1, true, KEY)]);
    assert!(fixture.query(KEY).0);
}

#[test]
fn a_wait_ending_before_the_lease_in_the_same_tick_times_out() {
    let mut fixture = Fixture::new(4, 4);
    fixture.now_us += 400;
    fixture.grant(1, 1, 1, KEY);
    fixture.now_us -= 300;
    // The wait ends at +1 s 100 µs, the lease at +1 s 400 µs: the wait is answered `T` first,
    // and the key is free after the lease.
    fixture.enqueue(2, 1, 5, 2, KEY);
    let answers = fixture.run_timers_at(START_US + SECOND_US + TICK_US);
    assert_eq!(answers, vec![timeout(2, 2, true)]);
    assert_eq!(fixture.query(KEY), (false, 0, 0));
}

#[test]
fn timers_late_by_many_ticks_take_effect_in_deadline_order_across_keys() {
    // Two keys; on each, the waiter's wait ends after the lease but before the next tick the
    // reactor runs: one late step must hand both keys to their waiters.
    let mut fixture = Fixture::new(4, 4);
    fixture.grant(1, 1, 1, b"a");
    let token = fixture.grant(1, 2, 2, b"b");
    fixture.now_us += 10_000;
    fixture.enqueue(2, 1, 5, 3, b"a");
    let answers = fixture.run_timers_at(START_US + 3 * SECOND_US);
    // Key a: lease ends at +1 s, the wait at +1.01 s: granted, then its new lease runs.
    // Key b: lease ends at +2 s, nobody waits: freed.
    assert_eq!(answers, vec![granted(2, 3, token + 1, true, b"a")]);
    assert_eq!(fixture.query(b"b"), (false, 0, 0));
}

#[test]
fn a_burst_of_expiries_is_handled_over_several_bounded_steps_in_order() {
    // 1,000 leases end in each of five consecutive ticks; all are due by the time timers run.
    let keys: Vec<Vec<u8>> = (0..5000)
        .map(|i| format!("burst/{i}").into_bytes())
        .collect();
    let mut fixture = Fixture::new(keys.len(), 1);
    for (i, key) in keys.iter().enumerate() {
        // Straight to the table: checking every invariant after each grant is quadratic.
        let now_us = START_US + (i as u64 / 1000) * TICK_US;
        let acquire = Acquire {
            wait_s: 0,
            lease_s: 1,
            owner: i as u64 + 1,
        };
        fixture.table.handle_acquire(now_us, 1, acquire, key);
    }
    let answers = fixture.table.take_answers();
    assert!(answers
        .iter()
        .all(|a| matches!(a.response, Response::Acquired { .. })));
    fixture.table.check_invariants();
    let late_us = START_US + 10 * SECOND_US;
    let mut freed_per_step = Vec::new();
    while fixture.table.key_count() > 0 {
        let before = fixture.table.key_count();
        assert!(fixture.run_timers_at(late_us).is_empty());
        freed_per_step.push(before - fixture.table.key_count());
        if fixture.table.key_count() > 0 {
            let next = fixture.table.next_deadline_us().expect("more is due");
            assert!(next <= late_us, "the rest is due now: {next} > {late_us}");
        }
        assert!(freed_per_step.len() <= 5, "no progress");
    }
    // Whole ticks, earliest first, until at least TIMERS_PER_STEP_MAX were fired.
    assert_eq!(freed_per_step, vec![3000, 2000]);
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

#[test]
fn next_deadline_leads_the_reactor_to_each_expiry() {
    let mut fixture = Fixture::new(4, 4);
    assert_eq!(fixture.table.next_deadline_us(), None);
    fixture.grant(1, 3, 1, KEY);
    fixture.enqueue(2, 2, 1, 2, KEY);
    let mut fired = Vec::new();
    for _ in 0..64 {
        let Some(deadline_us) = fixture.table.next_deadline_us() else {
            break;
        };
        assert!(deadline_us <= START_US + 3 * SECOND_US);
        let answers = fixture.run_timers_at(deadline_us.max(fixture.now_us));
        fired.extend(answers.into_iter().map(|seen| (fixture.now_us, seen)));
    }
    let wait_end_us = START_US + 2 * SECOND_US;
    assert_eq!(fired, vec![(wait_end_us, timeout(2, 2, true))]);
    assert_eq!(fixture.query(KEY), (false, 0, 0));
    assert_eq!(fixture.now_us, START_US + 3 * SECOND_US);
}

#[test]
fn session_close_is_silent_and_keeps_holds() {
    let mut fixture = Fixture::new(4, 4);
    let kept = fixture.grant(2, 30, 1, b"kept");
    let token = fixture.grant(1, 30, 2, KEY);
    fixture.enqueue(3, 9, 5, 3, KEY);
    fixture.enqueue(2, 9, 5, 4, KEY);
    fixture.enqueue(2, 9, 5, 5, KEY);
    fixture.enqueue(3, 9, 5, 6, KEY);
    fixture.table.handle_session_closed(2);
    assert_eq!(drain(&mut fixture.table), vec![]);
    fixture.table.handle_session_closed(2);
    fixture.table.handle_session_closed(99);
    assert_eq!(drain(&mut fixture.table), vec![]);
    assert_eq!(fixture.query(KEY).2, 2);
    assert_eq!(fixture.query(b"kept"), (true, 30_000, 0));
    // The hold of the closed session lives on; any session may release it.
    let released = said(4, Response::Released { token: kept }, false);
    assert_eq!(fixture.release(4, kept, b"kept"), vec![released]);
    // The other session's waiters keep their order.
    assert_eq!(
        fixture.release(1, token, KEY)[1],
        granted(3, 3, kept + 2, true, KEY)
    );
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
fn ends_pending_marks_answers_to_acquires_that_waited() {
    let mut fixture = Fixture::new(1, 1);
    let token = fixture.grant(1, 5, 1, KEY);
    let flags = |answers: Vec<Seen>| answers.iter().map(|s| s.ends_pending).collect::<Vec<_>>();
    assert_eq!(flags(fixture.acquire(2, 0, 5, 2, KEY)), vec![false]);
    assert_eq!(flags(fixture.acquire(2, 0, 5, 3, b"other")), vec![false]);
    assert_eq!(flags(fixture.acquire(2, 1, 5, 4, b"other")), vec![true]);
    fixture.enqueue(2, 1, 5, 5, KEY);
    assert_eq!(flags(fixture.acquire(2, 1, 5, 6, KEY)), vec![true]);
    assert_eq!(flags(fixture.release(1, token, KEY)), vec![false, true]);
    assert_eq!(
        flags(fixture.acquire(3, 1, 5, 7, b"free-again")),
        vec![true]
    );
}

// ---------------------------------------------------------------------------------------------
// Random operation sequences against a reference model

/// The model's queued acquire.
#[derive(Clone, Debug)]
struct ModelWaiter {
    session: SessionId,
    owner: u64,
    lease_s: u8,
    wait_end_us: u64,
}

/// The model's held key.
#[derive(Debug)]
struct ModelHold {
    token: u64,
    lease_end_us: u64,
    queue: VecDeque<ModelWaiter>,
}

/// PROTOCOL.md §3 for one partition, written plainly: a map of held keys with FIFO queues.
/// Timers fire at the first tick at or after their end, in the order of their ends.
struct Model {
    config: TableConfig,
    holds: BTreeMap<Vec<u8>, ModelHold>,
    next_token: u64,
    token_step: u64,
    token_limit: u64,
    shutting_down: bool,
}

impl Model {
    fn issue(&mut self) -> Option<u64> {
        let token = self.next_token;
        (token <= self.token_limit).then(|| {
            self.next_token += self.token_step;
            token
        })
    }

    fn acquire(
        &mut self,
        now_us: u64,
        session: SessionId,
        acquire: Acquire,
        key: &[u8],
        at_limit: bool,
    ) -> Vec<Seen> {
        let Acquire {
            wait_s,
            lease_s,
            owner,
        } = acquire;
        let waits = wait_s > 0;
        if self.shutting_down {
            return vec![busy(session, owner, waits)];
        }
        let room = self.holds.len() < self.config.max_keys;
        let Some(hold) = self.holds.get_mut(key) else {
            let Some(token) = room.then(|| self.issue()).flatten() else {
                return vec![busy(session, owner, waits)];
            };
            let lease_end_us = now_us + u64::from(lease_s) * SECOND_US;
            let queue = VecDeque::new();
            let hold = ModelHold {
                token,
                lease_end_us,
                queue,
            };
            self.holds.insert(key.to_vec(), hold);
            return vec![granted(session, owner, token, waits, key)];
        };
        if !waits {
            return vec![timeout(session, owner, false)];
        }
        if hold.queue.len() >= self.config.max_waiters_per_key as usize || at_limit {
            return vec![busy(session, owner, true)];
        }
        let wait_end_us = now_us + u64::from(wait_s) * SECOND_US;
        hold.queue.push_back(ModelWaiter {
            session,
            owner,
            lease_s,
            wait_end_us,
        });
        vec![]
    }

    fn holds_with(&self, key: &[u8], token: u64) -> bool {
        self.holds.get(key).is_some_and(|hold| hold.token == token)
    }

    fn release(&mut self, now_us: u64, session: SessionId, token: u64, key: &[u8]) -> Vec<Seen> {
        if !self.holds_with(key, token) {
            return vec![said(session, Response::NotHeld { token }, false)];
        }
        let mut out = vec![said(session, Response::Released { token }, false)];
        self.end_hold(now_us, key, &mut out);
        out
    }

    fn extend(
        &mut self,
        now_us: u64,
        session: SessionId,
        lease_s: u8,
        token: u64,
        key: &[u8],
    ) -> Vec<Seen> {
        if !self.holds_with(key, token) {
            return vec![said(session, Response::NotHeld { token }, false)];
        }
        let hold = self.holds.get_mut(key).expect("held");
        hold.lease_end_us = now_us + u64::from(lease_s) * SECOND_US;
        vec![said(session, Response::Extended { token }, false)]
    }

    fn cancel(&mut self, session: SessionId, owner: u64, key: &[u8]) -> Vec<Seen> {
        let mut out = Vec::new();
        if let Some(hold) = self.holds.get_mut(key) {
            hold.queue.retain(|waiter| {
                let hit = waiter.session == session && waiter.owner == owner;
                if hit {
                    out.push(timeout(session, owner, true));
                }
                !hit
            });
        }
        out
    }

    fn state(&self, now_us: u64, key: &[u8]) -> (bool, u32, u32) {
        match self.holds.get(key) {
            None => (false, 0, 0),
            Some(hold) => {
                let lease_ms = hold.lease_end_us.saturating_sub(now_us) / 1000;
                (true, lease_ms as u32, hold.queue.len() as u32)
            }
        }
    }

    fn close(&mut self, session: SessionId) {
        for hold in self.holds.values_mut() {
            hold.queue.retain(|waiter| waiter.session != session);
        }
    }

    fn shutdown(&mut self) -> Vec<Seen> {
        self.shutting_down = true;
        let queues = self
            .holds
            .values_mut()
            .flat_map(|hold| hold.queue.drain(..));
        queues
            .map(|waiter| busy(waiter.session, waiter.owner, true))
            .collect()
    }

    /// Runs the timers. Per key, what ran out takes effect in the order of the ends (waits
    /// first on a tie): waits that ended before the lease answer `T`, then the lease hands
    /// off, then the later waits of those still queued answer `T`. The order in which leases
    /// ending in one batch are handled is the table's own (by their ends, then the wheel's);
    /// it decides which key gets which token and, when the tokens run out mid-batch, which
    /// keys still get a grant. `granted_first` are the keys the table granted, in its order:
    /// the model handles those leases first, in that order.
    fn timers(&mut self, now_us: u64, granted_first: &[Vec<u8>]) -> Vec<Seen> {
        let now_tick = now_us / self.config.tick_us;
        let tick_us = self.config.tick_us;
        let due = |end_us: u64| end_us.div_ceil(tick_us) <= now_tick;
        let mut out = Vec::new();
        for hold in self.holds.values_mut() {
            let lease_end_us = Some(hold.lease_end_us).filter(|&end_us| due(end_us));
            let first = |end_us: u64| due(end_us) && lease_end_us.is_none_or(|l| end_us <= l);
            expire_waits(hold, first, &mut out);
        }
        let mut expired: Vec<Vec<u8>> = (self.holds.iter())
            .filter(|(_, hold)| due(hold.lease_end_us))
            .map(|(key, _)| key.clone())
            .collect();
        let rank = |key: &Vec<u8>| granted_first.iter().position(|first| first == key);
        expired.sort_by_key(|key| rank(key).unwrap_or(usize::MAX));
        for key in expired {
            self.end_hold(now_us, &key, &mut out);
            if let Some(hold) = self.holds.get_mut(&key) {
                expire_waits(hold, due, &mut out);
            }
        }
        out
    }

    /// The holder is gone: grant the queue head in the same step, else free the key.
    fn end_hold(&mut self, now_us: u64, key: &[u8], out: &mut Vec<Seen>) {
        let mut hold = self.holds.remove(key).expect("held");
        while let Some(waiter) = hold.queue.pop_front() {
            let Some(token) = self.issue() else {
                out.push(busy(waiter.session, waiter.owner, true));
                continue;
            };
            hold.token = token;
            hold.lease_end_us = now_us + u64::from(waiter.lease_s) * SECOND_US;
            out.push(granted(waiter.session, waiter.owner, token, true, key));
            self.holds.insert(key.to_vec(), hold);
            return;
        }
    }

    /// The earliest tick boundary at which a timer is due, in µs.
    fn earliest_deadline_us(&self) -> Option<u64> {
        let tick_us = self.config.tick_us;
        let ends = self.holds.values().flat_map(|hold| {
            let waits = hold.queue.iter().map(|waiter| waiter.wait_end_us);
            waits.chain(std::iter::once(hold.lease_end_us))
        });
        ends.map(|end_us| end_us.div_ceil(tick_us) * tick_us).min()
    }
}

/// Answers `T` to the waiters of `hold` whose wait end passes `select`, and removes them.
fn expire_waits(hold: &mut ModelHold, select: impl Fn(u64) -> bool, out: &mut Vec<Seen>) {
    hold.queue.retain(|waiter| {
        if select(waiter.wait_end_us) {
            out.push(timeout(waiter.session, waiter.owner, true));
        }
        !select(waiter.wait_end_us)
    });
}

/// An acquire the observer saw queued: (session, owner, lease, end of the wait in µs).
type Queued = (SessionId, u64, u8, u64);

/// Checks that only use the answers, the requests and the clock: one holder at most, tokens
/// strictly increasing per key and never repeated, FIFO grants, every acquire answered once.
#[derive(Default)]
struct Observer {
    /// Per key, the last grant: token, lease end, and whether it was released since.
    holds: HashMap<Vec<u8>, (u64, u64, bool)>,
    /// Every token granted, in order.
    tokens: Vec<u64>,
    tokens_seen: HashSet<u64>,
    /// Per key, the acquires that got no answer yet, in order: (session, owner, lease, end of
    /// the wait in µs). A client may queue one owner twice (a resend): the wait end tells
    /// which of the two a timeout was for.
    queues: HashMap<Vec<u8>, VecDeque<Queued>>,
}

impl Observer {
    fn grant(
        &mut self,
        now_us: u64,
        key: &[u8],
        token: u64,
        lease_s: u8,
    ) -> Result<(), TestCaseError> {
        prop_assert!(
            token != 0 && self.tokens_seen.insert(token),
            "token {} reissued",
            token
        );
        if let Some(&(last, lease_end_us, released)) = self.holds.get(key) {
            prop_assert!(token > last, "token {} after {} on {:?}", token, last, key);
            prop_assert!(
                released || lease_end_us <= now_us,
                "two holders of {:?}",
                key
            );
        }
        let lease_end_us = now_us + u64::from(lease_s) * SECOND_US;
        self.holds
            .insert(key.to_vec(), (token, lease_end_us, false));
        self.tokens.push(token);
        Ok(())
    }

    /// The live holder of `key` with a lease that has not run out.
    fn valid_holder(&self, now_us: u64, key: &[u8]) -> Option<u64> {
        let &(token, lease_end_us, released) = self.holds.get(key)?;
        (!released && lease_end_us > now_us).then_some(token)
    }

    /// Removes a queued acquire answered later; `fifo` demands it was its queue's head.
    /// Removes the queued acquire an answer was for and returns its lease. `expired_at`: the
    /// answer is a wait that ran out by then, so among duplicates of the same owner it is the
    /// one whose wait ended first; otherwise the first queued.
    fn unqueue(
        &mut self,
        seen: &Seen,
        key: Option<&[u8]>,
        fifo: bool,
        expired_at: Option<u64>,
    ) -> Result<u8, TestCaseError> {
        let owner = seen.response.correlation_id();
        let wanted = |&(session, queued_owner, _, wait_end_us): &Queued| {
            session == seen.session
                && queued_owner == owner
                && expired_at.is_none_or(|now_us| wait_end_us <= now_us)
        };
        let found = self.queues.iter_mut().find_map(|(queued_key, queue)| {
            if key.is_some_and(|key| key != &queued_key[..]) {
                return None;
            }
            let position = match expired_at {
                Some(_) => queue
                    .iter()
                    .enumerate()
                    .filter(|(_, entry)| wanted(entry))
                    .min_by_key(|(position, entry)| (entry.3, *position))
                    .map(|(position, _)| position),
                None => queue.iter().position(wanted),
            }?;
            Some((queue, position))
        });
        let Some((queue, position)) = found else {
            return Err(TestCaseError::fail(format!(
                "answer to no queued acquire: {seen:?}"
            )));
        };
        prop_assert!(
            !fifo || position == 0,
            "not FIFO: {:?} at {}",
            seen,
            position
        );
        Ok(queue.remove(position).expect("found").2)
    }

    /// Answers to queued acquires (and the holder change they cause).
    fn later(&mut self, now_us: u64, seen: &Seen, fifo: bool) -> Result<(), TestCaseError> {
        match seen.response {
            Response::Acquired { token, .. } => {
                let key = seen.key.as_deref().expect("grants name a key");
                let lease_s = self.unqueue(seen, Some(key), fifo, None)?;
                self.grant(now_us, key, token, lease_s)
            }
            Response::Busy { .. } => self.unqueue(seen, None, fifo, None).map(drop),
            Response::Timeout { .. } => self.unqueue(seen, None, false, Some(now_us)).map(drop),
            _ => Err(TestCaseError::fail(format!("unexpected answer {seen:?}"))),
        }
    }

    fn holder_answer(
        &mut self,
        now_us: u64,
        key: &[u8],
        seen: &Seen,
        lease_s: Option<u8>,
    ) -> Result<(), TestCaseError> {
        let hold = self.holds.get_mut(key);
        match (seen.response, hold) {
            (Response::Released { token }, Some(hold)) if hold.0 == token && !hold.2 => {
                hold.2 = true;
            }
            (Response::Extended { token }, Some(hold)) if hold.0 == token && !hold.2 => {
                hold.1 = now_us + u64::from(lease_s.expect("extend")) * SECOND_US;
            }
            (Response::NotHeld { token }, _) => {
                let holder = self.valid_holder(now_us, key);
                prop_assert!(holder != Some(token), "valid holder {} told N", token);
            }
            _ => prop_assert!(false, "unexpected {:?} on {:?}", seen, key),
        }
        Ok(())
    }

    fn queued_count(&self, session: SessionId) -> usize {
        let queued = self.queues.values().flatten();
        queued.filter(|entry| entry.0 == session).count()
    }
}

const KEYS: [&[u8]; 3] = [b"a", b"b", b"a key longer than twenty-two bytes"];
const SESSIONS: usize = 3;

#[derive(Clone, Copy, Debug)]
enum TokenPick {
    /// The key's current holder, per the model.
    Current,
    /// Some token granted earlier (maybe of another key).
    Stale(usize),
    Other(u64),
}

#[derive(Clone, Debug)]
enum Op {
    Acquire {
        session: usize,
        key: usize,
        wait_s: u8,
        lease_s: u8,
    },
    /// The session's last acquire again: same owner, key and lease.
    Resend {
        session: usize,
        wait_s: u8,
    },
    Release {
        session: usize,
        key: usize,
        token: TokenPick,
    },
    Extend {
        session: usize,
        key: usize,
        lease_s: u8,
        token: TokenPick,
    },
    /// `None`: an owner the session has queued on the key, else its last owner.
    Cancel {
        session: usize,
        key: usize,
        owner: Option<u64>,
    },
    Query {
        session: usize,
        key: usize,
    },
    Close {
        session: usize,
    },
    Advance {
        by_us: u64,
        timers: bool,
    },
    /// To the table's next deadline (or 1 µs before it), then the timers.
    ToDeadline {
        before: bool,
    },
    RaiseTokens {
        by: u64,
    },
    Shutdown,
}

/// What the model expects of a step.
enum Want {
    /// These answers in this order.
    InOrder(Vec<Seen>),
    /// These answers in an order the table chooses (shutdown).
    AnyOrder(Vec<Seen>),
    /// Whatever the model's timers produce, in any order.
    Timers,
}

/// What a step was, for the observer.
enum Step {
    Acquire {
        session: SessionId,
        owner: u64,
        key: Vec<u8>,
        waits: bool,
        lease_s: u8,
        /// When the acquire's wait ends, in µs.
        wait_end_us: u64,
    },
    Holder {
        key: Vec<u8>,
        lease_s: Option<u8>,
    },
    Cancel {
        key: Vec<u8>,
    },
    Query {
        key: Vec<u8>,
    },
    Later {
        fifo: bool,
    },
}

/// The configuration of one simulated partition.
#[derive(Clone, Debug)]
struct SimConfig {
    max_keys: usize,
    max_waiters_per_key: u32,
    max_pending: u32,
    token_step: u64,
    token_budget: Option<u64>,
    start_offset_us: u64,
}

struct Sim {
    table: LockTable,
    model: Model,
    observer: Observer,
    now_us: u64,
    sessions: [SessionId; SESSIONS],
    next_session: SessionId,
    /// Acquires with wait > 0 not answered yet, per session, as the reactor counts them.
    pending: HashMap<SessionId, u32>,
    max_pending: u32,
    next_owner: u64,
    last_acquire: HashMap<SessionId, (u64, usize, u8)>,
}

impl Sim {
    fn new(config: &SimConfig) -> Sim {
        let tokens = TokenRange {
            next: FIRST_TOKEN,
            step: config.token_step,
            limit: config.token_budget.map_or(u64::MAX / 2, |budget| {
                FIRST_TOKEN + budget * config.token_step
            }),
        };
        let table_config = TableConfig {
            max_keys: config.max_keys,
            max_waiters_per_key: config.max_waiters_per_key,
            tick_us: TICK_US,
            max_pending_per_session: config.max_pending,
        };
        let now_us = START_US + config.start_offset_us;
        Sim {
            table: LockTable::new(table_config, now_us, tokens),
            model: Model {
                config: table_config,
                holds: BTreeMap::new(),
                next_token: tokens.next,
                token_step: tokens.step,
                token_limit: tokens.limit,
                shutting_down: false,
            },
            observer: Observer::default(),
            now_us,
            sessions: [1, 2, 3],
            next_session: 4,
            pending: HashMap::new(),
            max_pending: config.max_pending,
            next_owner: 1,
            last_acquire: HashMap::new(),
        }
    }

    fn token(&self, key: &[u8], pick: TokenPick) -> u64 {
        let tokens = &self.observer.tokens;
        match pick {
            TokenPick::Current => self
                .model
                .holds
                .get(key)
                .map_or(FIRST_TOKEN, |hold| hold.token),
            TokenPick::Stale(_) if tokens.is_empty() => 1,
            TokenPick::Stale(index) => tokens[index % tokens.len()],
            TokenPick::Other(token) => token,
        }
    }

    /// Sends an acquire from the session in `slot`. The model is told the session is at its
    /// pending limit when its unanswered waiting acquires reach it (in one partition those are
    /// exactly its queued ones, which is what the table counts itself).
    fn acquire(&mut self, slot: usize, key: usize, acquire: Acquire) -> (Want, Step) {
        let session = self.sessions[slot];
        let key = KEYS[key];
        let waits = acquire.wait_s > 0;
        let pending = self.pending.entry(session).or_default();
        let at_limit = waits && *pending >= self.max_pending;
        *pending += u32::from(waits);
        let request = Request::Acquire {
            wait_s: acquire.wait_s,
            lease_s: acquire.lease_s,
            owner: acquire.owner,
            key,
        };
        let now_us = self.now_us;
        self.table.handle_request(now_us, session, &request);
        let want = self.model.acquire(now_us, session, acquire, key, at_limit);
        let (owner, lease_s) = (acquire.owner, acquire.lease_s);
        let key = key.to_vec();
        let step = Step::Acquire {
            session,
            owner,
            key,
            waits,
            lease_s,
            wait_end_us: now_us + u64::from(acquire.wait_s) * SECOND_US,
        };
        (Want::InOrder(want), step)
    }

    /// Release (`lease_s` None) or Extend.
    fn holder(
        &mut self,
        slot: usize,
        key: usize,
        pick: TokenPick,
        lease_s: Option<u8>,
    ) -> (Want, Step) {
        let (session, key, now_us) = (self.sessions[slot], KEYS[key], self.now_us);
        let token = self.token(key, pick);
        let (request, want) = match lease_s {
            None => {
                let want = self.model.release(now_us, session, token, key);
                (Request::Release { token, key }, want)
            }
            Some(lease_s) => {
                let want = self.model.extend(now_us, session, lease_s, token, key);
                (
                    Request::Extend {
                        lease_s,
                        token,
                        key,
                    },
                    want,
                )
            }
        };
        self.table.handle_request(now_us, session, &request);
        let key = key.to_vec();
        (Want::InOrder(want), Step::Holder { key, lease_s })
    }

    fn cancel(&mut self, slot: usize, key: usize, owner: Option<u64>) -> (Want, Step) {
        let (session, key) = (self.sessions[slot], KEYS[key]);
        // Usually an owner this session has queued on the key, as a client's Cancel is.
        let mut queue = self.observer.queues.get(key).into_iter().flatten();
        let queued = queue.rfind(|entry| entry.0 == session).map(|entry| entry.1);
        let last = self.last_acquire.get(&session).map(|last| last.0);
        let guess = queued.or(last).unwrap_or(0);
        let owner = owner.map_or(guess, |owner| owner % self.next_owner);
        let request = Request::Cancel { owner, key };
        self.table.handle_request(self.now_us, session, &request);
        let want = self.model.cancel(session, owner, key);
        (Want::InOrder(want), Step::Cancel { key: key.to_vec() })
    }

    fn query(&mut self, slot: usize, key: usize) -> (Want, Step) {
        let (session, key) = (self.sessions[slot], KEYS[key]);
        let request = Request::Query { nonce: 3, key };
        self.table.handle_request(self.now_us, session, &request);
        let (held, lease_ms, waiters) = self.model.state(self.now_us, key);
        let state = Response::State {
            nonce: 3,
            held,
            lease_ms,
            waiters,
        };
        let want = vec![said(session, state, false)];
        (Want::InOrder(want), Step::Query { key: key.to_vec() })
    }

    fn close(&mut self, slot: usize) {
        let session = self.sessions[slot];
        self.table.handle_session_closed(session);
        self.model.close(session);
        for queue in self.observer.queues.values_mut() {
            queue.retain(|entry| entry.0 != session);
        }
        self.pending.remove(&session);
        self.sessions[slot] = self.next_session;
        self.next_session += 1;
    }

    /// Applies `op` to the table and the model; returns what the model expects and what the
    /// observer needs to know.
    fn apply(&mut self, op: &Op) -> (Want, Step) {
        let nothing = (Want::InOrder(vec![]), Step::Later { fifo: true });
        let timers = (Want::Timers, Step::Later { fifo: true });
        match *op {
            Op::Acquire {
                session,
                key,
                wait_s,
                lease_s,
            } => {
                let owner = self.next_owner;
                self.next_owner += 1;
                self.last_acquire
                    .insert(self.sessions[session], (owner, key, lease_s));
                self.acquire(
                    session,
                    key,
                    Acquire {
                        wait_s,
                        lease_s,
                        owner,
                    },
                )
            }
            Op::Resend { session, wait_s } => {
                let last = self.last_acquire.get(&self.sessions[session]);
                let Some(&(owner, key, lease_s)) = last else {
                    return nothing;
                };
                self.acquire(
                    session,
                    key,
                    Acquire {
                        wait_s,
                        lease_s,
                        owner,
                    },
                )
            }
            Op::Release {
                session,
                key,
                token,
            } => self.holder(session, key, token, None),
            Op::Extend {
                session,
                key,
                lease_s,
                token,
            } => self.holder(session, key, token, Some(lease_s)),
            Op::Cancel {
                session,
                key,
                owner,
            } => self.cancel(session, key, owner),
            Op::Query { session, key } => self.query(session, key),
            Op::Close { session } => {
                self.close(session);
                nothing
            }
            Op::Advance {
                by_us,
                timers: false,
            } => {
                self.now_us += by_us;
                nothing
            }
            Op::Advance {
                by_us,
                timers: true,
            } => {
                self.now_us += by_us;
                self.table.handle_timers(self.now_us);
                timers
            }
            Op::ToDeadline { before } => {
                if let Some(deadline_us) = self.table.next_deadline_us() {
                    let target_us = deadline_us.saturating_sub(u64::from(before));
                    self.now_us = self.now_us.max(target_us);
                }
                self.table.handle_timers(self.now_us);
                timers
            }
            Op::RaiseTokens { by } => {
                let limit = self.model.token_limit + by * self.model.token_step;
                self.table.raise_token_limit(limit);
                self.model.token_limit = limit;
                nothing
            }
            Op::Shutdown => {
                self.table.handle_shutdown();
                (
                    Want::AnyOrder(self.model.shutdown()),
                    Step::Later { fifo: false },
                )
            }
        }
    }

    fn observe(&mut self, seen: &[Seen], step: Step) -> Result<(), TestCaseError> {
        let now_us = self.now_us;
        let observer = &mut self.observer;
        match step {
            Step::Acquire {
                session,
                owner,
                key,
                waits,
                lease_s,
                wait_end_us,
            } => {
                prop_assert!(seen.len() <= 1, "one answer at most: {:?}", seen);
                let Some(answer) = seen.first() else {
                    prop_assert!(waits, "an acquire with wait 0 always gets an answer");
                    prop_assert!(observer.holds.get(&key).is_some_and(|hold| !hold.2));
                    let queue = observer.queues.entry(key).or_default();
                    queue.push_back((session, owner, lease_s, wait_end_us));
                    return Ok(());
                };
                prop_assert_eq!(
                    (answer.session, answer.response.correlation_id()),
                    (session, owner)
                );
                prop_assert_eq!(answer.ends_pending, waits);
                match answer.response {
                    Response::Acquired { token, .. } => {
                        observer.grant(now_us, &key, token, lease_s)?
                    }
                    Response::Timeout { .. } | Response::Busy { .. } => {}
                    _ => prop_assert!(false, "acquire answered {:?}", answer),
                }
            }
            Step::Holder { key, lease_s } => {
                let (first, handoff) = seen.split_first().expect("release and extend answer");
                observer.holder_answer(now_us, &key, first, lease_s)?;
                for answer in handoff {
                    observer.later(now_us, answer, true)?;
                }
            }
            Step::Cancel { key } => {
                for answer in seen {
                    let is_timeout = matches!(answer.response, Response::Timeout { .. });
                    prop_assert!(is_timeout, "cancel answered {:?}", answer);
                    observer.unqueue(answer, Some(&key), false, None)?;
                }
            }
            Step::Query { key } => {
                let Response::State { held, waiters, .. } = seen[0].response else {
                    return Err(TestCaseError::fail("query not answered with Q"));
                };
                let queued = observer.queues.get(&key).map_or(0, VecDeque::len);
                prop_assert_eq!(waiters as usize, queued);
                let valid = observer.valid_holder(now_us, &key).is_some();
                prop_assert!(held || !valid, "a valid hold reported free");
            }
            Step::Later { fifo } => {
                for answer in seen {
                    observer.later(now_us, answer, fifo)?;
                }
            }
        }
        Ok(())
    }

    /// Checks after every step that do not depend on what the step was.
    /// (`drain` already ran `check_invariants` after the step; queries change nothing.)
    fn check_state(&mut self) -> Result<(), TestCaseError> {
        let model = &self.model;
        prop_assert_eq!(self.table.key_count(), model.holds.len());
        let queued: usize = model.holds.values().map(|hold| hold.queue.len()).sum();
        prop_assert_eq!(self.table.waiter_count(), queued);
        prop_assert_eq!(self.table.next_token(), model.next_token);
        let deadline_us = self.table.next_deadline_us();
        let earliest_us = model.earliest_deadline_us();
        prop_assert_eq!(deadline_us.is_some(), earliest_us.is_some());
        prop_assert!(
            deadline_us <= earliest_us,
            "poll timeout after the earliest timer"
        );
        for key in KEYS {
            self.table.handle_query(self.now_us, SPECTATOR, 0, key);
            let answers = self.table.take_answers();
            prop_assert_eq!(answers.len(), 1);
            let Response::State {
                held,
                lease_ms,
                waiters,
                ..
            } = answers[0].response
            else {
                return Err(TestCaseError::fail("query not answered with Q"));
            };
            prop_assert_eq!(
                (held, lease_ms, waiters),
                model.state(self.now_us, key),
                "{:?}",
                key
            );
            let observed = self.observer.queues.get(key).map_or(0, VecDeque::len);
            prop_assert_eq!(waiters as usize, observed, "observer's queue of {:?}", key);
            // A free key has no waiters.
            prop_assert!(held || waiters == 0);
        }
        for &session in &self.sessions {
            let pending = self.pending.get(&session).copied().unwrap_or(0) as usize;
            prop_assert_eq!(
                pending,
                self.observer.queued_count(session),
                "pending of {}",
                session
            );
        }
        Ok(())
    }

    fn step(&mut self, op: &Op) -> Result<(), TestCaseError> {
        let (want, step) = self.apply(op);
        let mut got = drain(&mut self.table);
        for answer in &got {
            let live = self.sessions.contains(&answer.session);
            prop_assert!(live, "answer to a closed session: {:?}", answer);
            if answer.ends_pending {
                let pending = self.pending.get_mut(&answer.session);
                let Some(pending) = pending.filter(|count| **count > 0) else {
                    return Err(TestCaseError::fail(format!("ends no pending: {answer:?}")));
                };
                *pending -= 1;
            }
        }
        // The observer reads the answers in the order the table produced them.
        self.observe(&got, step)?;
        let (mut want, ordered) = match want {
            Want::InOrder(want) => (want, true),
            Want::AnyOrder(want) => (want, false),
            Want::Timers => {
                let granted: Vec<Vec<u8>> = got.iter().filter_map(|s| s.key.clone()).collect();
                (self.model.timers(self.now_us, &granted), false)
            }
        };
        if !ordered {
            got.sort_by_key(|seen| format!("{seen:?}"));
            want.sort_by_key(|seen| format!("{seen:?}"));
        }
        prop_assert_eq!(&got, &want, "at {} µs after {:?}", self.now_us, op);
        self.check_state()
    }
}

fn run_sim(
    config: &SimConfig,
    ops: &[Op],
    shutdown_at: Option<usize>,
) -> Result<(), TestCaseError> {
    let mut sim = Sim::new(config);
    for (index, op) in ops.iter().enumerate() {
        if shutdown_at == Some(index) {
            sim.step(&Op::Shutdown)?;
        }
        sim.step(op)?;
    }
    // Long enough for every wait (3 s) and every lease granted meanwhile (3 s) to run out.
    for _ in 0..16 {
        sim.step(&Op::Advance {
            by_us: 500_000,
            timers: true,
        })?;
    }
    prop_assert_eq!((sim.table.key_count(), sim.table.waiter_count()), (0, 0));
    prop_assert!(
        sim.observer.queues.values().all(VecDeque::is_empty),
        "unanswered acquires"
    );
    prop_assert!(sim.pending.values().all(|&count| count == 0));
    Ok(())
}

fn op_strategy() -> impl Strategy<Value = Op> {
    let session = 0..SESSIONS;
    let key = 0..KEYS.len();
    let seconds = 1u8..=3;
    let token = prop_oneof![
        6 => Just(TokenPick::Current),
        2 => any::<usize>().prop_map(TokenPick::Stale),
        1 => any::<u64>().prop_map(TokenPick::Other),
    ];
    let wait = prop_oneof![Just(0u8), 1u8..=3];
    let by_us = prop_oneof![0u64..2_000, 0u64..1_200_000, 1_000_000u64..4_000_000];
    prop_oneof![
        30 => (session.clone(), key.clone(), wait.clone(), seconds.clone())
            .prop_map(|(session, key, wait_s, lease_s)| Op::Acquire { session, key, wait_s, lease_s }),
        8 => (session.clone(), wait).prop_map(|(session, wait_s)| Op::Resend { session, wait_s }),
        12 => (session.clone(), key.clone(), token.clone())
            .prop_map(|(session, key, token)| Op::Release { session, key, token }),
        5 => (session.clone(), key.clone(), seconds, token)
            .prop_map(|(session, key, lease_s, token)| Op::Extend { session, key, lease_s, token }),
        8 => (session.clone(), key.clone(), prop::option::of(any::<u64>()))
            .prop_map(|(session, key, owner)| Op::Cancel { session, key, owner }),
        3 => (session.clone(), key).prop_map(|(session, key)| Op::Query { session, key }),
        3 => session.prop_map(|session| Op::Close { session }),
        25 => (by_us, prop::bool::weighted(0.85)).prop_map(|(by_us, timers)| Op::Advance { by_us, timers }),
        5 => any::<bool>().prop_map(|before| Op::ToDeadline { before }),
        2 => (1u64..20).prop_map(|by| Op::RaiseTokens { by }),
    ]
}

fn config_strategy() -> impl Strategy<Value = SimConfig> {
    let budget = prop::option::weighted(0.3, 0u64..16);
    (
        1usize..=3,
        1u32..=3,
        1u32..=3,
        1u64..=3,
        budget,
        0u64..3_000,
    )
        .prop_map(
            |(
                max_keys,
                max_waiters_per_key,
                max_pending,
                token_step,
                token_budget,
                start_offset_us,
            )| {
                SimConfig {
                    max_keys,
                    max_waiters_per_key,
                    max_pending,
                    token_step,
                    token_budget,
                    start_offset_us,
                }
            },
        )
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]

    #[test]
    fn matches_reference_model(
        config in config_strategy(),
        ops in prop::collection::vec(op_strategy(), 1..150),
        shutdown_at in prop::option::weighted(0.25, 0usize..150),
    ) {
        run_sim(&config, &ops, shutdown_at)?;
    }
}
