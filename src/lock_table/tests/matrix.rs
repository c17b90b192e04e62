//! Every cell of the docs/protocol.md §3 request × key-state matrix: one test per row, each run
//! over the four key states F, H0, Hq and Hf.

use super::*;

// ---------------------------------------------------------------------------------------------
// The §3 matrix, one test per row, each over the four key states

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
