//! Waits and leases on virtual time: never early, at most one tick late, FIFO handoff on expiry,
//! deadline order within one tick, `lease_ms` rounding and the reactor's next deadline.

use super::*;

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
            // First boundary at or after the end; both fire together. They are different keys'
            // events, so their answers may come in either order.
            let (fired_us, answers) = first_firing(&mut fixture, end_us - 1500, step_us);
            let tick_end_us = end_us.div_ceil(TICK_US) * TICK_US;
            assert!(fired_us >= end_us, "early: {fired_us} < {end_us}");
            assert!(fired_us >= tick_end_us && fired_us < tick_end_us + step_us);
            assert!(fired_us - end_us < TICK_US + step_us, "late: {fired_us}");
            let want = [timeout(2, 3, true), granted(3, 4, 3, true, b"lease")];
            let case = format!("offset {offset_us} step {step_us}: {answers:?}");
            assert_eq!(answers.len(), want.len(), "{case}");
            assert!(want.iter().all(|seen| answers.contains(seen)), "{case}");
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
fn one_late_step_answers_a_queue_as_if_each_timer_fired_at_its_end() {
    // The lease ends at +1 s 500 µs. Waits end before it, on it, twice after it, and long
    // after; timers run two seconds late, in one step.
    let mut fixture = Fixture::new(8, 8);
    fixture.now_us += 500;
    let token = fixture.grant(1, 1, 1, KEY);
    fixture.now_us -= 500;
    fixture.enqueue(2, 1, 5, 2, KEY); // wait ends +1 s: before the lease, `T`
    fixture.now_us += 500;
    fixture.enqueue(3, 1, 5, 3, KEY); // ends with the lease: the wait goes first, `T`
    fixture.now_us += 300;
    fixture.enqueue(4, 1, 5, 4, KEY); // ends after the lease: gets the key
    fixture.now_us += 100;
    fixture.enqueue(5, 1, 5, 5, KEY); // ends after the lease, behind the new holder: `T`
    fixture.enqueue(6, 9, 5, 6, KEY); // still waiting
    let answers = fixture.run_timers_at(START_US + 3 * SECOND_US);
    let want = [
        timeout(2, 2, true),
        timeout(3, 3, true),
        granted(4, 4, token + 1, true, KEY),
        timeout(5, 5, true),
    ];
    assert_eq!(answers.len(), want.len(), "{answers:?}");
    assert!(
        want.iter().all(|seen| answers.contains(seen)),
        "{answers:?}"
    );
    // The new lease counts from the step that granted it.
    assert_eq!(fixture.query(KEY), (true, 5_000, 1));
    fixture.table.check_invariants();
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
    // Whole ticks, earliest first, until at least TIMERS_PER_STEP_MAX (512) were fired.
    assert_eq!(freed_per_step, vec![1000; 5]);
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
