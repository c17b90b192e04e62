//! One specification of the waiting rules of docs/protocol.md §3, checked against both
//! partitions: the reference model `latchkey::partition::model` (the one the lock table's own
//! tests and `tests/simulation.rs` check it against) is driven by a seeded random sequence of
//! operations, and the same sequence goes to the single node's `LockTable` and to a one-member
//! cluster partition on `MemDurable` (`queue_rules/subject.rs`), all on one virtual clock.
//!
//! The model issues the table's tokens; the cluster's come from log indices, so the driver
//! numbers each grant with a logical token of its own (`Model::set_token`) and maps each
//! subject's tokens to it.
//!
//! Operations: acquires (wait 0 and > 0, now and then a resend of a queued owner), releases
//! and extends (the holder's token or a wrong one), cancels, queries, session closes, time
//! moving (to a deadline, just before or after it, by milliseconds or seconds) so that waits
//! run out and leases expire and hand off, and, in some seeds, shutdown. Limits:
//! `max_waiters_per_key`, `max_pending_per_session` and (one shard) `max_keys`, drawn small.
//!
//! After every step, per subject: its answers equal the model's as a multiset of (session,
//! kind, owner, ends-pending; for `Q` held, waiters, lease) — tokens are each subject's own,
//! checked to increase strictly per key and to be echoed by `R`/`E`/`N`; every held key has
//! the model's holder (owner) and queue length, the lease left is the model's (the cluster's
//! may read up to a millisecond more, never less: it counts in milliseconds), and the key and
//! waiter counts agree.
//!
//! Bursts: now and then a few requests run at one instant without settling in between, so
//! that the cluster decides each while the entries of the ones before are in flight (a grant
//! of a free key, a release carrying the queue head's grant); the model takes them in arrival
//! order, as the single node does. Their answers are compared together, once settled.
//!
//! Documented differences allowed: the cluster answers once its entry applied (a step or burst
//! settles before it is compared: `Subject::settle`); a one-member cluster never says `M`;
//! the cluster decides an acquire from its applied state (docs/cluster-design.md), so a burst
//! never acquires a key that a release or expiry in flight frees (the cluster answers `T`
//! or queues where the single node grants) nor, with `max_keys` binding, a free key once one
//! was freed (the cluster counts that hold until its end applies), and never shuts down (an
//! acquire in flight is not granted yet: the cluster answers it `B` and releases its grant,
//! where the single node granted it). A session that closes in a burst with grants not yet
//! delivered (in flight in the cluster; answered but unwritten on the single node) has them
//! released by the server, as docs/protocol.md §3.2 says (`Subject::close` uses
//! `release_granted` as a core does); the model releases them too and the burst ends there
//! (the next grants of those keys are in flight in the cluster behind the releases).
//!
//! Time: half the seeds run on the millisecond grid, where the cluster's millisecond leases
//! and the table's 1 ms tick land on the model's instants exactly; the other half run a fixed
//! fraction of a millisecond off it, where the cluster rounds a lease up (never early): its
//! lease may read up to a millisecond more (`Q`'s `lease_ms` one more), never less, and time
//! never moves exactly onto a deadline (the table fires it at the next whole millisecond,
//! the cluster's wait timer at once: both within docs/protocol.md §3.5).
//!
//! On failure it prints the seed, the step and the last operations. Environment:
//! `LATCHKEY_QUEUE_RULES_SEED=N` replays one seed; `LATCHKEY_QUEUE_RULES_SEEDS` (default 32)
//! and `LATCHKEY_QUEUE_RULES_STEPS` (default 500) set the budget;
//! `LATCHKEY_QUEUE_RULES_SEED_BASE` (default 0) shifts the seeds, for long runs.

#[path = "queue_rules/driver.rs"]
mod driver;
#[path = "queue_rules/step.rs"]
mod step;
#[path = "queue_rules/subject.rs"]
mod subject;

use driver::{Run, Stats};
use std::panic::{self, AssertUnwindSafe};
use std::time::Instant;

fn env_u64(name: &str) -> Option<u64> {
    let value = std::env::var(name).ok()?;
    Some(
        value
            .parse()
            .unwrap_or_else(|_| panic!("{name}={value}: not a number")),
    )
}

/// Runs one seed; the failure report on error.
fn run_seed(seed: u64, steps: u64, stats: &mut Stats) -> Result<(), String> {
    let mut run = None;
    let outcome = panic::catch_unwind(AssertUnwindSafe(|| {
        let run = run.insert(Run::new(seed, steps));
        run.steps(steps)
    }));
    for (&kind, &count) in run.iter().flat_map(|run| &run.stats) {
        *stats.entry(kind).or_default() += count;
    }
    let error = match outcome {
        Ok(Ok(())) => return Ok(()),
        Ok(Err(error)) => error,
        Err(panic) => {
            let message = panic
                .downcast_ref::<String>()
                .cloned()
                .or_else(|| panic.downcast_ref::<&str>().map(|s| s.to_string()));
            format!("panicked: {}", message.unwrap_or_default())
        }
    };
    let report = run.map(|run| run.report()).unwrap_or_default();
    Err(format!(
        "queue rules seed {seed} failed: {error}\n{report}\
         replay: LATCHKEY_QUEUE_RULES_SEED={seed} LATCHKEY_QUEUE_RULES_STEPS={steps} \
         cargo test --test queue_rules -- --nocapture"
    ))
}

#[test]
fn both_partitions_follow_one_model_of_the_queue_rules() {
    let steps = env_u64("LATCHKEY_QUEUE_RULES_STEPS").unwrap_or(500);
    let seeds: Vec<u64> = match env_u64("LATCHKEY_QUEUE_RULES_SEED") {
        Some(seed) => vec![seed],
        None => {
            let base = env_u64("LATCHKEY_QUEUE_RULES_SEED_BASE").unwrap_or(0);
            let count = env_u64("LATCHKEY_QUEUE_RULES_SEEDS").unwrap_or(32);
            (base..base + count).collect()
        }
    };
    let started = Instant::now();
    let mut failed = Vec::new();
    let mut stats = Stats::new();
    for &seed in &seeds {
        if let Err(report) = run_seed(seed, steps, &mut stats) {
            eprintln!("{report}");
            failed.push(seed);
        }
    }
    eprintln!(
        "queue rules: {} seeds × {steps} steps in {:.1} s, failed: {failed:?}",
        seeds.len(),
        started.elapsed().as_secs_f64()
    );
    eprintln!("answers by step and kind: {stats:?}");
    assert!(failed.is_empty(), "queue rules seeds failed: {failed:?}");
}
