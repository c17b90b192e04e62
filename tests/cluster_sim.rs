//! The deterministic Raft simulation: three `Member`s in one thread on a simulated clock
//! (1 ms steps, ticks every 10 ms), a seeded network (delay 0–20 ms, loss, duplication,
//! reordering, partitions that heal), each member's log writer completing its batches some
//! simulated ms after they were handed over (in a seeded order with the deliveries),
//! crash-restarts that drop unsynced writes (sometimes right after a drain handed its batch
//! over), and a stream of proposals to whichever member claims leadership. The safety checks (`cluster_sim/check.rs`) run after every step; after
//! the faults end (the last 2 s) every member must converge.
//!
//! Env: `LATCHKEY_CLUSTER_SIM_SEED` (one seed), `LATCHKEY_CLUSTER_SIM_SEEDS` (how many,
//! default 300), `LATCHKEY_CLUSTER_SIM_STEPS` (simulated ms per seed, default 3000),
//! `LATCHKEY_CLUSTER_SIM_LIE=1` (syncs lie: the checks must then find violations).

#[path = "cluster_sim/check.rs"]
mod check;
#[path = "cluster_sim/world.rs"]
mod world;

use latchkey::cluster::mem_durable::SyncMode;
use world::{World, CALM, FAULTS, SHARDS};

/// Simulated ms at the end with no faults, for convergence.
const CALM_MS: u64 = 2000;
/// Simulated ms allowed after the last step for an election or transfer under way to end.
const SETTLE_MS: u64 = 500;
/// Proposal rate per simulated ms, per million.
const PROPOSE_RATE: u64 = 300_000;

fn env_u64(name: &str) -> Option<u64> {
    let value = std::env::var(name).ok()?;
    match value.parse() {
        Ok(v) => Some(v),
        Err(_) => panic!("{name}={value:?} is not a number"),
    }
}

fn seeds() -> Vec<u64> {
    if let Some(seed) = env_u64("LATCHKEY_CLUSTER_SIM_SEED") {
        return vec![seed];
    }
    let count = env_u64("LATCHKEY_CLUSTER_SIM_SEEDS").unwrap_or(300);
    (1..=count).collect()
}

fn replay(seed: u64, steps: u64) -> String {
    format!(
        "LATCHKEY_CLUSTER_SIM_SEED={seed} LATCHKEY_CLUSTER_SIM_STEPS={steps} \
         cargo test --test cluster_sim -- --nocapture"
    )
}

/// Runs one seed; returns the violations (convergence failures included).
fn run(seed: u64, steps: u64, sync_mode: SyncMode) -> (World, Vec<String>) {
    let mut world = World::new(seed, sync_mode);
    let calm_from = steps.saturating_sub(CALM_MS);
    let quiet_from = steps.saturating_sub(CALM_MS / 4);
    while world.now < steps {
        if world.now == calm_from {
            world.heal();
        }
        let faults = if world.now < calm_from { FAULTS } else { CALM };
        let rate = if world.now < quiet_from {
            PROPOSE_RATE
        } else {
            0
        };
        world.step(faults, rate);
        if !world.checker.violations.is_empty() {
            break;
        }
    }
    let mut violations = world.checker.violations.clone();
    if violations.is_empty() && steps >= CALM_MS {
        // Converged at the end, or within a little more calm time (a leader transfer or an
        // election may be under way at the last step).
        let mut outcome = world.converged();
        let deadline = world.now + SETTLE_MS;
        while outcome.is_err() && world.now < deadline && world.checker.violations.is_empty() {
            world.step(CALM, 0);
            outcome = world.converged();
        }
        violations.extend(world.checker.violations.iter().cloned());
        if let Err(why) = outcome {
            violations.push(format!("after healing: {why}"));
        }
    }
    (world, violations)
}

#[test]
fn safety_under_faults_and_convergence_after() {
    let steps = env_u64("LATCHKEY_CLUSTER_SIM_STEPS").unwrap_or(3000);
    let sync_mode = match env_u64("LATCHKEY_CLUSTER_SIM_LIE") {
        Some(1) => SyncMode::Lie,
        _ => SyncMode::Normal,
    };
    let mut failed = Vec::new();
    let mut total = world::Stats::default();
    let (mut acked, mut lost) = (0, 0);
    for seed in seeds() {
        let (world, violations) = run(seed, steps, sync_mode);
        let s = world.stats;
        println!(
            "seed {seed}: {} ms, {} fault steps, {} crashes ({} with writes in flight), {} partitions, \
             {} lost, {} duplicated, {} restores, {} proposals, {} acked, {} lost proposals, log {:?}, \
             {} violations",
            world.now,
            s.fault_steps,
            s.crashes,
            s.in_flight_crashes,
            s.partitions,
            s.lost,
            s.duplicated,
            s.restores,
            s.proposals,
            world.checker.acked,
            world.checker.lost,
            (0..SHARDS)
                .map(|shard| world.checker.log_len(shard))
                .collect::<Vec<_>>(),
            violations.len()
        );
        total.fault_steps += s.fault_steps;
        total.crashes += s.crashes;
        total.in_flight_crashes += s.in_flight_crashes;
        total.partitions += s.partitions;
        acked += world.checker.acked;
        lost += world.checker.lost;
        if !violations.is_empty() {
            println!("seed {seed} FAILED; replay: {}", replay(seed, steps));
            for violation in &violations {
                println!("  {violation}");
            }
            failed.push(seed);
        }
    }
    println!(
        "total: {} fault steps, {} crashes ({} with writes in flight), {} partitions, {acked} acked, \
         {lost} lost proposals, {} seeds failed {failed:?}",
        total.fault_steps,
        total.crashes,
        total.in_flight_crashes,
        total.partitions,
        failed.len()
    );
    assert!(
        failed.is_empty(),
        "violations for seeds {failed:?} (replay commands above)"
    );
}

/// Leader crash → a new leader elected and a proposal committed, in simulated ms.
fn failover(seed: u64) -> Option<u64> {
    let mut world = World::new(seed, SyncMode::Normal);
    while world.now < 1000 {
        world.step(CALM, PROPOSE_RATE);
    }
    let leader = world.nodes[0].member.as_ref()?.leader(0)?;
    let crashed_at = world.now;
    world.only_shard = Some(0);
    world.crash((leader - 1) as usize, u64::MAX / 2);
    let first_after = world
        .checker
        .proposed_at
        .keys()
        .last()
        .copied()
        .unwrap_or(0);
    while world.now < crashed_at + 5000 {
        world.step(CALM, PROPOSE_RATE);
        let done = world
            .checker
            .acked_at
            .range(first_after + 1..)
            .find(|(id, _)| {
                world
                    .checker
                    .proposed_at
                    .get(id)
                    .is_some_and(|at| *at > crashed_at)
            })
            .map(|(_, at)| *at);
        if let Some(at) = done {
            assert!(
                world.checker.violations.is_empty(),
                "{:?}",
                world.checker.violations
            );
            return Some(at - crashed_at);
        }
    }
    None
}

#[test]
fn failover_time_after_a_leader_crash() {
    // 20 seeds unless a count or a seed is given, to keep the default run short.
    let explicit = env_u64("LATCHKEY_CLUSTER_SIM_SEEDS").is_some();
    let count = if explicit { usize::MAX } else { 20 };
    let seeds: Vec<u64> = seeds().into_iter().take(count).collect();
    let mut times = Vec::new();
    for seed in &seeds {
        match failover(*seed) {
            Some(ms) => times.push(ms),
            None => panic!(
                "seed {seed}: no failover within 5 s; replay with LATCHKEY_CLUSTER_SIM_SEED={seed}"
            ),
        }
    }
    times.sort_unstable();
    let p50 = times[times.len() / 2];
    let max = times[times.len() - 1];
    println!(
        "failover over {} seeds (simulated ms): p50 {p50}, max {max}, all {times:?}",
        times.len()
    );
}

/// What a run did, to compare two runs of one seed.
fn fingerprint(world: &World) -> String {
    let machines: Vec<_> = world.nodes.iter().map(|n| n.machines.clone()).collect();
    format!(
        "{:?} {} {} {machines:?}",
        world.stats, world.checker.acked, world.now
    )
}

#[test]
fn one_seed_replays_identically() {
    let seed = seeds()[0];
    let (first, _) = run(seed, 1500, SyncMode::Normal);
    let (second, _) = run(seed, 1500, SyncMode::Normal);
    assert_eq!(
        fingerprint(&first),
        fingerprint(&second),
        "seed {seed} is not deterministic"
    );
}
