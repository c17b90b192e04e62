//! Benchmarks of one lock-table partition: the work a core does per request, without I/O.
//!
//! Every benchmark keeps one table across iterations and leaves it as it found it, so its slabs,
//! index and answer vector are warm and the measured work allocates nothing (the steady state
//! of a running server). Time does not move: no lease or wait runs out during a measurement.

use criterion::{black_box, criterion_group, criterion_main, Criterion, Throughput};
use latchkey::lock_table::{Acquire, LockTable, TableConfig};
use latchkey::partition::Answer;
use latchkey::tokens::TokenRange;
use latchkey_client::protocol::Response;

/// Distinct keys per iteration.
const KEYS: usize = 10_000;
/// Keys per iteration of the handoff benchmark, and waiters queued on each.
const HANDOFF_KEYS: usize = 1_000;
const WAITERS_PER_KEY: usize = 4;
/// A fixed virtual time: nothing expires while measuring.
const NOW_US: u64 = 1_000_000;
/// The longest lease and wait, so no timer comes due.
const LEASE_S: u8 = 255;

fn table() -> LockTable {
    let config = TableConfig {
        max_keys: KEYS,
        max_waiters_per_key: WAITERS_PER_KEY as u32,
        tick_us: 1000,
        max_pending_per_session: u32::MAX,
    };
    let tokens = TokenRange {
        next: 1,
        step: 1,
        limit: u64::MAX / 2,
    };
    LockTable::new(config, NOW_US, tokens)
}

/// Keys of a typical length (21 bytes, short enough to be stored inline in their entry).
fn keys(count: usize) -> Vec<Vec<u8>> {
    (0..count)
        .map(|i| format!("bench/resource/{i:06}").into_bytes())
        .collect()
}

fn acquire(wait_s: u8, owner: u64) -> Acquire {
    Acquire {
        wait_s,
        lease_s: LEASE_S,
        owner,
    }
}

/// Drains the answers, appending the token of every grant to `tokens`.
fn take_tokens(table: &mut LockTable, tokens: &mut Vec<u64>) -> usize {
    let answers: Vec<Answer> = table.take_answers();
    let count = answers.len();
    for answer in &answers {
        if let Response::Acquired { token, .. } = answer.response {
            tokens.push(token);
        }
    }
    table.return_answers(answers);
    count
}

/// Acquire 10k free keys (each granted at once), then release them all.
fn acquire_release_distinct(c: &mut Criterion) {
    let keys = keys(KEYS);
    let mut table = table();
    let mut tokens = Vec::with_capacity(KEYS);
    let mut group = c.benchmark_group("lock_table");
    group.throughput(Throughput::Elements(KEYS as u64));
    group.bench_function("acquire_release_distinct_10k", |b| {
        b.iter(|| {
            for (owner, key) in keys.iter().enumerate() {
                table.handle_acquire(NOW_US, 1, acquire(0, owner as u64), key);
            }
            tokens.clear();
            take_tokens(&mut table, &mut tokens);
            assert_eq!(tokens.len(), KEYS);
            for (key, &token) in keys.iter().zip(&tokens) {
                table.handle_release(NOW_US, 1, token, key);
            }
            black_box(take_tokens(&mut table, &mut tokens));
            assert_eq!(table.key_count(), 0);
        })
    });
    group.finish();
}

/// 1k held keys with 4 waiters each; release every holder in turn, so each release hands the
/// key to its queue head in the same step, until every key is free. Counts grants.
fn handoff_queue(c: &mut Criterion) {
    let keys = keys(HANDOFF_KEYS);
    let mut table = table();
    let mut tokens = Vec::with_capacity(HANDOFF_KEYS);
    let grants = HANDOFF_KEYS * (1 + WAITERS_PER_KEY);
    let mut group = c.benchmark_group("lock_table");
    group.throughput(Throughput::Elements(grants as u64));
    group.bench_function("acquire_queue_release_handoff_1k_x5", |b| {
        b.iter(|| {
            for (owner, key) in keys.iter().enumerate() {
                table.handle_acquire(NOW_US, 1, acquire(0, owner as u64), key);
            }
            for waiter in 0..WAITERS_PER_KEY as u64 {
                for key in &keys {
                    let session = 2 + waiter;
                    table.handle_acquire(NOW_US, session, acquire(LEASE_S, waiter), key);
                }
            }
            tokens.clear();
            take_tokens(&mut table, &mut tokens);
            assert_eq!(table.waiter_count(), HANDOFF_KEYS * WAITERS_PER_KEY);
            // Each round releases the current holder of every key; its grant names the next.
            for _ in 0..=WAITERS_PER_KEY {
                for (key, &token) in keys.iter().zip(&tokens) {
                    table.handle_release(NOW_US, 1, token, key);
                }
                tokens.clear();
                take_tokens(&mut table, &mut tokens);
            }
            assert_eq!(table.key_count(), 0);
        })
    });
    group.finish();
}

/// Query 10k held keys with two waiters each.
fn query(c: &mut Criterion) {
    let keys = keys(KEYS);
    let mut table = table();
    let mut tokens = Vec::new();
    for (owner, key) in keys.iter().enumerate() {
        table.handle_acquire(NOW_US, 1, acquire(0, owner as u64), key);
        table.handle_acquire(NOW_US, 2, acquire(LEASE_S, owner as u64), key);
        table.handle_acquire(NOW_US, 3, acquire(LEASE_S, owner as u64), key);
    }
    take_tokens(&mut table, &mut tokens);
    let mut group = c.benchmark_group("lock_table");
    group.throughput(Throughput::Elements(KEYS as u64));
    group.bench_function("query_held_10k", |b| {
        b.iter(|| {
            for (nonce, key) in keys.iter().enumerate() {
                table.handle_query(NOW_US + 1, 4, nonce as u64, key);
            }
            let answers = table.take_answers();
            assert_eq!(answers.len(), KEYS);
            black_box(&answers);
            table.return_answers(answers);
        })
    });
    group.finish();
}

criterion_group!(benches, acquire_release_distinct, handoff_queue, query);
criterion_main!(benches);
