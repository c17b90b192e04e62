//! Tests of the timing wheel: targeted cases plus a property test against a reference model.

use super::*;
use latchkey::rng::Rng;
use proptest::prelude::*;
use std::collections::BTreeMap;

/// Advances `wheel` to `now_tick`, checks invariants, and returns what fired, sorted.
fn advance_sorted(wheel: &mut Wheel<u64>, now_tick: u64) -> Vec<u64> {
    let mut expired = Vec::new();
    wheel.advance(now_tick, &mut expired);
    wheel.check_invariants();
    expired.sort_unstable();
    expired
}

/// Inserts and checks invariants.
fn insert(wheel: &mut Wheel<u64>, deadline_tick: u64, payload: u64) -> TimerHandle {
    let handle = wheel.insert(deadline_tick, payload);
    wheel.check_invariants();
    handle
}

#[test]
fn empty_wheel() {
    let mut wheel = Wheel::<u64>::new(1234);
    wheel.check_invariants();
    assert!(wheel.is_empty());
    assert_eq!(wheel.len(), 0);
    assert_eq!(wheel.now(), 1234);
    assert_eq!(wheel.next_deadline(), None);
    assert!(advance_sorted(&mut wheel, u64::MAX).is_empty());
    assert_eq!(wheel.now(), u64::MAX);
}

#[test]
fn tick_by_tick_fires_exactly_at_deadline_and_once() {
    let start_tick = 1_000_003;
    let mut wheel = Wheel::new(start_tick);
    let mut random = Rng::new(1);
    let mut deadlines = Vec::new();
    for payload in 0..500 {
        let deadline_tick = start_tick + 1 + random.below(20_000);
        deadlines.push(deadline_tick);
        insert(&mut wheel, deadline_tick, payload);
    }
    let mut fired = vec![0u32; deadlines.len()];
    let mut expired = Vec::new();
    for tick in start_tick + 1..=start_tick + 20_001 {
        expired.clear();
        wheel.advance(tick, &mut expired);
        for &payload in &expired {
            // Never early, and not late either when advancing every tick.
            assert_eq!(deadlines[payload as usize], tick, "payload {payload}");
            fired[payload as usize] += 1;
        }
        if tick % 97 == 0 {
            wheel.check_invariants();
        }
    }
    wheel.check_invariants();
    assert!(fired.iter().all(|&count| count == 1));
    assert!(wheel.is_empty());
}

#[test]
fn cancel_before_fire_prevents_firing() {
    let mut wheel = Wheel::new(0);
    let keep = insert(&mut wheel, 100, 1);
    let drop = insert(&mut wheel, 100, 2);
    let far = insert(&mut wheel, 1 << 30, 3);
    assert_eq!(wheel.cancel(drop), Some(2));
    wheel.check_invariants();
    assert_eq!(wheel.cancel(far), Some(3));
    wheel.check_invariants();
    assert_eq!(wheel.len(), 1);
    assert_eq!(advance_sorted(&mut wheel, 1 << 31), vec![1]);
    assert_eq!(wheel.cancel(keep), None, "already fired");
    assert_eq!(wheel.cancel(drop), None, "already cancelled");
}

#[test]
fn stale_handle_does_not_touch_new_occupant() {
    let mut wheel = Wheel::new(10);
    let old = insert(&mut wheel, 50, 1);
    assert_eq!(wheel.cancel(old), Some(1));
    let new = insert(&mut wheel, 60, 2);
    assert_eq!(old.index, new.index, "the slab slot is reused");
    assert_ne!(old, new);
    assert_eq!(wheel.cancel(old), None);
    assert_eq!(wheel.deadline(old), None);
    assert_eq!(wheel.deadline(new), Some(60));
    wheel.check_invariants();
    assert_eq!(advance_sorted(&mut wheel, 59), Vec::<u64>::new());
    assert_eq!(advance_sorted(&mut wheel, 60), vec![2]);
    // A fired timer's handle is stale too, also after the slot is reused again.
    let newer = insert(&mut wheel, 70, 3);
    assert_eq!(wheel.cancel(new), None);
    assert_eq!(wheel.deadline(newer), Some(70));
    assert_eq!(wheel.len(), 1);
}

#[test]
fn handle_from_out_of_range_index_is_none() {
    let mut wheel = Wheel::<u64>::new(0);
    let bogus = TimerHandle {
        index: 7,
        generation: 0,
    };
    assert_eq!(wheel.cancel(bogus), None);
    assert_eq!(wheel.deadline(bogus), None);
}

#[test]
fn deadline_at_or_behind_now_fires_on_next_advance() {
    let mut wheel = Wheel::new(500);
    insert(&mut wheel, 500, 1);
    insert(&mut wheel, 3, 2);
    insert(&mut wheel, 0, 3);
    assert_eq!(wheel.next_deadline(), Some(0));
    // Going back in time is a no-op, even for due timers.
    assert!(advance_sorted(&mut wheel, 499).is_empty());
    assert_eq!(wheel.now(), 500);
    assert_eq!(advance_sorted(&mut wheel, 500), vec![1, 2, 3]);
    assert!(wheel.is_empty());
    assert_eq!(wheel.next_deadline(), None);
}

#[test]
fn advance_backwards_is_a_no_op() {
    let mut wheel = Wheel::new(1000);
    insert(&mut wheel, 1001, 1);
    assert!(advance_sorted(&mut wheel, 5).is_empty());
    assert_eq!(wheel.now(), 1000);
    assert_eq!(advance_sorted(&mut wheel, 1001), vec![1]);
}

#[test]
fn big_jumps_fire_everything_due_and_nothing_else() {
    let mut wheel = Wheel::new(7);
    let jump = 1u64 << 40;
    let deadlines = [
        8,
        64,
        4096,
        255_000,
        1 << 30,
        jump - 1,
        jump,
        jump + 1,
        jump << 3,
    ];
    for (payload, &deadline_tick) in deadlines.iter().enumerate() {
        insert(&mut wheel, deadline_tick, payload as u64);
    }
    assert_eq!(advance_sorted(&mut wheel, jump), vec![0, 1, 2, 3, 4, 5, 6]);
    assert_eq!(wheel.len(), 2);
    assert_eq!(advance_sorted(&mut wheel, jump), Vec::<u64>::new());
    assert_eq!(advance_sorted(&mut wheel, jump + 1), vec![7]);
    // Idle for ten minutes at 1 ms per tick with nothing pending.
    let idle_tick = wheel.now() + 600_000;
    assert!(advance_sorted(&mut wheel, idle_tick).is_empty());
    assert_eq!(advance_sorted(&mut wheel, u64::MAX), vec![8]);
}

#[test]
fn deadlines_across_ring_and_pages() {
    // Deadlines at, around and far beyond the ring's edge and page boundaries.
    let start_tick = 0x9123_4567_89AB_CDEF;
    let mut wheel = Wheel::with_horizon(start_tick, 100);
    let ring = wheel.ring_ticks();
    assert_eq!(ring, 128);
    let mut deadlines = Vec::new();
    for shift in 0..64u32 {
        let span = 1u64 << shift;
        for delta in [
            span - 1,
            span,
            span + 1,
            span.saturating_mul(5),
            ring - 1,
            ring + 1,
        ] {
            deadlines.push(start_tick.saturating_add(delta.max(1)));
        }
    }
    deadlines.extend([start_tick / 2 + u64::MAX / 2, u64::MAX - 1, u64::MAX]);
    deadlines.sort_unstable();
    for (payload, &deadline_tick) in deadlines.iter().enumerate() {
        insert(&mut wheel, deadline_tick, payload as u64);
    }
    // Advancing to each deadline in turn fires exactly the timers at that deadline.
    let mut fired = 0;
    let mut index = 0;
    while index < deadlines.len() {
        let deadline_tick = deadlines[index];
        assert!(advance_sorted(&mut wheel, deadline_tick - 1).is_empty());
        let expected: Vec<u64> = (index..deadlines.len())
            .take_while(|&i| deadlines[i] == deadline_tick)
            .map(|i| i as u64)
            .collect();
        assert_eq!(advance_sorted(&mut wheel, deadline_tick), expected);
        fired += expected.len();
        index += expected.len();
    }
    assert_eq!(fired, deadlines.len());
    assert!(wheel.is_empty());
}

#[test]
fn bounded_advance_fires_whole_ticks_in_order_and_catches_up() {
    let mut wheel = Wheel::with_horizon(0, 1000);
    // Ten timers at each of the ticks 1..=100.
    for tick in 1..=100u64 {
        for i in 0..10 {
            insert(&mut wheel, tick, tick * 100 + i);
        }
    }
    let mut expired = Vec::new();
    let mut calls = 0;
    let mut last_tick = 0;
    while !wheel.advance_bounded(100, &mut expired, 25) {
        calls += 1;
        wheel.check_invariants();
        // At least 25 fired, never a split tick: a multiple of ten, in tick order.
        assert_eq!(expired.len(), 30, "three whole ticks reach the bound of 25");
        let ticks: Vec<u64> = expired.iter().map(|payload| payload / 100).collect();
        assert!(ticks.windows(2).all(|pair| pair[0] <= pair[1]));
        assert!(ticks[0] > last_tick);
        last_tick = *ticks.last().unwrap();
        assert_eq!(wheel.now(), last_tick);
        assert!(wheel.next_deadline().unwrap() <= 100, "the rest is due");
        expired.clear();
    }
    assert_eq!(calls, 33);
    assert_eq!(expired.len(), 10, "the last call fires the last tick");
    assert!(wheel.is_empty());
    assert_eq!(wheel.now(), 100);
}

#[test]
fn timers_far_beyond_the_ring_move_in_by_page_and_fire_on_time() {
    let mut wheel = Wheel::with_horizon(10, 63);
    assert_eq!(wheel.ring_ticks(), 64);
    let deadlines = [70, 74, 128, 129, 191, 192, 1000, 5000];
    for (payload, &deadline_tick) in deadlines.iter().enumerate() {
        insert(&mut wheel, deadline_tick, payload as u64);
    }
    assert_eq!(wheel.far_count, 6, "all but 70 and 74 are beyond now + 64");
    let mut fired = Vec::new();
    for tick in 11..=5000 {
        let expired = advance_sorted(&mut wheel, tick);
        for &payload in &expired {
            assert_eq!(
                deadlines[payload as usize], tick,
                "fired exactly at its deadline"
            );
        }
        fired.extend(expired);
        if let Some(next) = wheel.next_deadline() {
            assert!(next > tick, "nothing left due");
        }
    }
    fired.sort_unstable();
    assert_eq!(fired, (0..deadlines.len() as u64).collect::<Vec<_>>());
}

#[test]
fn next_deadline_is_a_lower_bound_and_makes_progress() {
    let mut random = Rng::new(42);
    for round in 0..200u64 {
        let start_tick = random.next_u64() >> (round % 40);
        let mut wheel = Wheel::new(start_tick);
        let mut earliest = u64::MAX;
        for payload in 0..(1 + round % 7) {
            // Up to 6 * (1 + round % 11) bits, so every level gets a turn.
            let shift = 64 - (6 * (1 + round % 11)).min(64) as u32;
            let delta = 1 + (random.next_u64() >> shift);
            let deadline_tick = start_tick.saturating_add(delta);
            earliest = earliest.min(deadline_tick);
            insert(&mut wheel, deadline_tick, payload);
        }
        // Following next_deadline() reaches the earliest deadline within a few steps (a page
        // start, then the deadline), and no step fires anything before its deadline.
        let mut steps = 0;
        loop {
            let next_tick = wheel.next_deadline().expect("timers are pending");
            assert!(
                next_tick <= earliest,
                "next_deadline after the earliest deadline"
            );
            assert!(next_tick > wheel.now(), "no timer is due at now");
            let fired = advance_sorted(&mut wheel, next_tick);
            steps += 1;
            assert!(steps <= 3, "no progress after {steps} steps");
            if !fired.is_empty() {
                assert_eq!(next_tick, earliest);
                break;
            }
        }
    }
}

#[test]
fn entries_are_reused_without_growing() {
    let mut wheel = Wheel::with_horizon(0, 300_000);
    let mut expired = Vec::with_capacity(64);
    for round in 0..100u64 {
        let base_tick = wheel.now();
        let handles: Vec<_> = (0..64)
            .map(|i| wheel.insert(base_tick + 1 + (i * 977 + round) % 300_000, i))
            .collect();
        for handle in handles.iter().step_by(2) {
            assert!(wheel.cancel(*handle).is_some());
        }
        expired.clear();
        wheel.advance(base_tick + 300_000, &mut expired);
        assert_eq!(expired.len(), 32);
        wheel.check_invariants();
    }
    assert_eq!(
        wheel.entries.len(),
        64,
        "the entries never grew past the live high-water mark"
    );
}

/// One step of the property test.
#[derive(Clone, Debug)]
enum Op {
    /// Insert at `now + delta` (saturating); a negative delta lands behind now.
    Insert(i64),
    /// Cancel the n-th handle ever issued (modulo), live or stale.
    Cancel(usize),
    /// Advance by `delta` ticks (saturating); `None` means one tick back in time.
    Advance(Option<u64>),
}

fn op_strategy() -> impl Strategy<Value = Op> {
    let delta = prop_oneof![
        4 => 0i64..70,
        3 => 0i64..300_000,
        1 => -100i64..=0,
        1 => 0i64..(1 << 42),
        1 => Just(i64::MAX),
        // Log-uniform over the whole range, so every level is used.
        1 => (any::<u64>(), 1u32..64).prop_map(|(x, shift)| (x >> shift) as i64),
    ];
    let step = prop_oneof![
        4 => (0u64..70).prop_map(Some),
        2 => (0u64..20_000).prop_map(Some),
        1 => (0u64..(1 << 41)).prop_map(Some),
        1 => Just(None),
        // Log-uniform jumps, large enough to reach cascade points of the top levels.
        1 => (any::<u64>(), 0u32..64).prop_map(|(x, shift)| Some(x >> shift)),
    ];
    prop_oneof![
        5 => delta.prop_map(Op::Insert),
        2 => any::<usize>().prop_map(Op::Cancel),
        3 => step.prop_map(Op::Advance),
    ]
}

/// Reference model: payload -> deadline for live timers.
struct Model {
    live: BTreeMap<u64, u64>,
}

impl Model {
    /// Removes and returns, sorted, the payloads with deadline `<= now_tick`.
    fn fire(&mut self, now_tick: u64) -> Vec<u64> {
        let due: Vec<u64> = self
            .live
            .iter()
            .filter(|(_, &d)| d <= now_tick)
            .map(|(&p, _)| p)
            .collect();
        for payload in &due {
            self.live.remove(payload);
        }
        due
    }
}

fn run_ops(start_tick: u64, ring_horizon: u64, ops: &[Op]) -> Result<(), TestCaseError> {
    let mut wheel = Wheel::with_horizon(start_tick, ring_horizon);
    let mut model = Model {
        live: BTreeMap::new(),
    };
    let mut handles: Vec<(TimerHandle, u64)> = Vec::new();
    for op in ops {
        match *op {
            Op::Insert(delta) => {
                let now_tick = wheel.now();
                let deadline_tick = if delta < 0 {
                    now_tick.saturating_sub(delta.unsigned_abs())
                } else {
                    now_tick.saturating_add(delta as u64)
                };
                let payload = handles.len() as u64;
                handles.push((wheel.insert(deadline_tick, payload), payload));
                model.live.insert(payload, deadline_tick);
            }
            Op::Cancel(n) if !handles.is_empty() => {
                let (handle, payload) = handles[n % handles.len()];
                let expected = model.live.remove(&payload).map(|_| payload);
                prop_assert_eq!(wheel.cancel(handle), expected);
            }
            Op::Cancel(_) => {}
            Op::Advance(step) => {
                let now_tick = match step {
                    Some(delta) => wheel.now().saturating_add(delta),
                    None => wheel.now().saturating_sub(1),
                };
                let expected = if now_tick < wheel.now() {
                    Vec::new()
                } else {
                    model.fire(now_tick)
                };
                prop_assert_eq!(advance_sorted(&mut wheel, now_tick), expected);
            }
        }
        wheel.check_invariants();
        prop_assert_eq!(wheel.len(), model.live.len());
        let earliest = model.live.values().min().copied();
        match (wheel.next_deadline(), earliest) {
            (None, None) => {}
            (Some(next_tick), Some(earliest)) => prop_assert!(next_tick <= earliest),
            (got, want) => prop_assert!(false, "next_deadline {:?} vs earliest {:?}", got, want),
        }
        for &(handle, payload) in handles.iter().rev().take(8) {
            prop_assert_eq!(wheel.deadline(handle), model.live.get(&payload).copied());
        }
    }
    Ok(())
}

proptest! {
    #[test]
    fn matches_reference_model(
        start_tick in prop_oneof![
            Just(0u64),
            0u64..(1 << 50),
            any::<u64>(),
            (u64::MAX - (1 << 44))..=u64::MAX,
        ],
        ring_horizon in prop_oneof![Just(63u64), 0u64..5000, Just(300_000)],
        ops in proptest::collection::vec(op_strategy(), 1..200),
    ) {
        run_ops(start_tick, ring_horizon, &ops)?;
    }
}
