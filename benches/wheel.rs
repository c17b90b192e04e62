//! Benchmarks of the timing wheel: the costs the lock table pays per lease and per expiry, and
//! (`deadline_index`) what a cluster member's ordered deadline index costs beside it.
//!
//! Every benchmark keeps one wheel across iterations and leaves it empty after each, so the
//! slab is warm and the measured work allocates nothing (the steady state of a running server).

use criterion::{black_box, criterion_group, criterion_main, Criterion, Throughput};
use latchkey_wheel::{TimerHandle, Wheel};

/// Timers per iteration.
const TIMERS: usize = 10_000;
/// How far ahead deadlines reach: 255 s at 1 ms per tick, the longest lease.
const HORIZON_TICKS: u64 = 255_000;

/// `TIMERS` deadline offsets in `1..=horizon`, spread deterministically (Knuth's multiplier).
fn offsets(horizon_ticks: u64) -> Vec<u64> {
    (0..TIMERS as u64)
        .map(|i| 1 + i.wrapping_mul(2_654_435_761) % horizon_ticks)
        .collect()
}

/// Insert 10k timers, then cancel them all: a lease granted and released before it expires.
fn insert_cancel(c: &mut Criterion) {
    let offsets = offsets(HORIZON_TICKS);
    let mut wheel = Wheel::with_horizon(0, HORIZON_TICKS);
    let mut handles: Vec<TimerHandle> = Vec::with_capacity(TIMERS);
    let mut group = c.benchmark_group("wheel");
    group.throughput(Throughput::Elements(TIMERS as u64));
    group.bench_function("insert_cancel_10k", |b| {
        b.iter(|| {
            let now_tick = wheel.now();
            for (i, &offset) in offsets.iter().enumerate() {
                handles.push(wheel.insert(now_tick + offset, i as u32));
            }
            for handle in handles.drain(..) {
                black_box(wheel.cancel(handle));
            }
        })
    });
    group.finish();
}

/// Insert 10k timers and advance in one jump past the horizon: every timer cascades and fires.
fn insert_advance_jump(c: &mut Criterion) {
    let offsets = offsets(HORIZON_TICKS);
    let mut wheel = Wheel::with_horizon(0, HORIZON_TICKS);
    let mut expired = Vec::with_capacity(TIMERS);
    let mut group = c.benchmark_group("wheel");
    group.throughput(Throughput::Elements(TIMERS as u64));
    group.bench_function("insert_advance_jump_10k", |b| {
        b.iter(|| {
            let now_tick = wheel.now();
            for (i, &offset) in offsets.iter().enumerate() {
                wheel.insert(now_tick + offset, i as u32);
            }
            expired.clear();
            wheel.advance(now_tick + HORIZON_TICKS, &mut expired);
            assert_eq!(expired.len(), TIMERS);
        })
    });
    group.finish();
}

/// Insert 10k timers within 10 s and advance one 1 ms tick at a time until all have fired:
/// the reactor's steady state, including ticks where nothing is due.
fn insert_advance_ticks(c: &mut Criterion) {
    let horizon_ticks = 10_000;
    let offsets = offsets(horizon_ticks);
    let mut wheel = Wheel::with_horizon(0, HORIZON_TICKS);
    let mut expired = Vec::with_capacity(TIMERS);
    let mut group = c.benchmark_group("wheel");
    group.throughput(Throughput::Elements(TIMERS as u64));
    group.bench_function("insert_advance_each_tick_10k", |b| {
        b.iter(|| {
            let now_tick = wheel.now();
            for (i, &offset) in offsets.iter().enumerate() {
                wheel.insert(now_tick + offset, i as u32);
            }
            let mut fired = 0;
            for tick in now_tick + 1..=now_tick + horizon_ticks {
                expired.clear();
                wheel.advance(tick, &mut expired);
                fired += expired.len();
            }
            assert_eq!(fired, TIMERS);
        })
    });
    group.finish();
}

/// Holds already indexed while the deadline-index benchmarks run (a loaded member's shard).
const BACKGROUND: u64 = 1_000_000;

/// What a cluster member pays per hold for its lease deadline, grant then release, with a
/// million other holds indexed: the shard machine's ordered index, a `BTreeSet` of
/// `(deadline, token)` (insert at the grant, remove at the release), against the wheel's insert
/// and cancel (docs/cluster-design.md, "Timers", quotes both).
fn deadline_index(c: &mut Criterion) {
    let offsets = offsets(HORIZON_TICKS);
    let mut group = c.benchmark_group("deadline_index");
    group.throughput(Throughput::Elements(TIMERS as u64));
    let mut tree: std::collections::BTreeSet<(u64, u64)> = (0..BACKGROUND)
        .map(|i| {
            (
                1 + i.wrapping_mul(2_654_435_761) % HORIZON_TICKS,
                u64::MAX - i,
            )
        })
        .collect();
    group.bench_function("btreeset_insert_remove_10k_of_1m", |b| {
        b.iter(|| {
            for (i, &offset) in offsets.iter().enumerate() {
                tree.insert((offset, i as u64));
            }
            for (i, &offset) in offsets.iter().enumerate() {
                black_box(tree.remove(&(offset, i as u64)));
            }
        })
    });
    let mut wheel = Wheel::with_horizon(0, HORIZON_TICKS);
    for i in 0..BACKGROUND {
        wheel.insert(1 + i.wrapping_mul(2_654_435_761) % HORIZON_TICKS, u32::MAX);
    }
    let mut handles: Vec<TimerHandle> = Vec::with_capacity(TIMERS);
    group.bench_function("wheel_insert_cancel_10k_of_1m", |b| {
        b.iter(|| {
            for (i, &offset) in offsets.iter().enumerate() {
                handles.push(wheel.insert(offset, i as u32));
            }
            for handle in handles.drain(..) {
                black_box(wheel.cancel(handle));
            }
        })
    });
    group.finish();
}

criterion_group!(
    benches,
    insert_cancel,
    insert_advance_jump,
    insert_advance_ticks,
    deadline_index
);
criterion_main!(benches);
