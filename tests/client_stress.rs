//! Many threads share one `Client` over a fault proxy (small delays, connections cut now and
//! then) and hold locks the way an application would: each key guards a fenced register, and
//! a holder writes to it only while `Instant::now() < ticket.valid_until()`, checked just before
//! the write. Holders acquire, write, sleep, extend (often to a *shorter* lease than what is
//! left, docs/protocol.md §4.5), extend from a second thread at the same time, release or drop.
//!
//! The register accepts a write with token `t` iff `t` is at least the largest token it has
//! seen. An honest write is rejected only if a newer holder already wrote, i.e. the validity
//! bound claimed a hold the server had already ended: that must never happen.
//!
//! The seed is printed; `LATCHKEY_STRESS_SEED=<n>` replays its choices (thread interleavings
//! still vary). About eight seconds.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;
use std::thread;
use std::time::{Duration, Instant};

use common::proxy::Proxy;
use common::{client, start_server};
use latchkey::rng::Rng;
use latchkey_client::{AcquireError, Client, ExtendOutcome, RequestError, Ticket};

const THREADS: usize = 20;
const KEYS: usize = 4;
const RUN: Duration = Duration::from_secs(6);
const SEED: u64 = 0x5eed_1a7c_4e11;

fn ms(millis: u64) -> Duration {
    Duration::from_millis(millis)
}

/// What the run did, summed over the threads.
#[derive(Default, Debug)]
struct Tally {
    acquired: AtomicU64,
    not_acquired: AtomicU64,
    indeterminate: AtomicU64,
    writes: AtomicU64,
    rejected: AtomicU64,
    skipped: AtomicU64,
    extended: AtomicU64,
    shortening: AtomicU64,
    lost: AtomicU64,
    unknown: AtomicU64,
    unsent: AtomicU64,
}

fn add(counter: &AtomicU64) {
    counter.fetch_add(1, Ordering::Relaxed);
}

fn get(counter: &AtomicU64) -> u64 {
    counter.load(Ordering::Relaxed)
}

/// A resource fenced by tokens: the largest token seen so far.
#[derive(Default)]
struct Register {
    max_token: Mutex<u64>,
}

impl Register {
    /// Writes as an honest holder does: only while the ticket's bound has not passed, checked
    /// under the register's lock just before the write, so the check and the write are one step
    /// for every other writer of this register.
    fn write(&self, ticket: &Ticket, tally: &Tally) {
        let mut max_token = self.max_token.lock().unwrap();
        if Instant::now() >= ticket.valid_until() {
            add(&tally.skipped);
            return;
        }
        if ticket.token() >= *max_token {
            *max_token = ticket.token();
            add(&tally.writes);
        } else {
            add(&tally.rejected);
            eprintln!(
                "REJECTED: {} token {} < {} while valid for {:?} more",
                ticket.key(),
                ticket.token(),
                *max_token,
                ticket
                    .valid_until()
                    .saturating_duration_since(Instant::now())
            );
        }
    }
}

struct World {
    client: Client,
    keys: Vec<String>,
    registers: Vec<Register>,
    tally: Tally,
    end: Instant,
}

/// Extends and counts the outcome; a confirmed Extend that asked for less than was left
/// counts as shortening.
fn extend(ticket: &Ticket, lease: Duration, tally: &Tally) -> bool {
    let shortening = Instant::now() + lease < ticket.valid_until();
    match ticket.extend(lease) {
        Ok(ExtendOutcome::Extended) => {
            add(&tally.extended);
            if shortening {
                add(&tally.shortening);
            }
            true
        }
        Ok(ExtendOutcome::NotHeld) => {
            add(&tally.lost);
            false
        }
        Err(RequestError::NoAnswer) => {
            add(&tally.unknown);
            true
        }
        Err(RequestError::Unavailable) => {
            add(&tally.unsent);
            true
        }
        Err(other) => panic!("extend: {other:?}"),
    }
}

/// Holds `ticket` for a few random steps, with a second thread extending it meanwhile now
/// and then; releases or drops it at the end.
fn hold(world: &World, ticket: Ticket, register: &Register, rng: &mut Rng) {
    let tally = &world.tally;
    let helper_seed = rng.next_u64();
    let with_helper = rng.percent(30);
    thread::scope(|scope| {
        if with_helper {
            scope.spawn(|| {
                let mut rng = Rng::new(helper_seed);
                thread::sleep(ms(rng.between(0, 300)));
                extend(&ticket, Duration::from_secs(rng.between(1, 4)), tally);
                register.write(&ticket, tally);
            });
        }
        for _ in 0..rng.between(1, 6) {
            if Instant::now() >= world.end {
                break;
            }
            match rng.below(4) {
                0 => {}
                1 => thread::sleep(ms(rng.between(20, 1500))),
                2 => {
                    let lease = Duration::from_secs(rng.between(1, 4));
                    if !extend(&ticket, lease, tally) {
                        break;
                    }
                }
                _ => {
                    // Cut the lease short, then work past its new end: the writes that
                    // follow must see the shorter bound.
                    if !extend(&ticket, Duration::from_secs(1), tally) {
                        break;
                    }
                    thread::sleep(ms(rng.between(1000, 1500)));
                }
            }
            register.write(&ticket, tally);
        }
    });
    if rng.percent(50) {
        let _ = ticket.release();
    }
}

fn worker(world: &World, seed: u64) {
    let mut rng = Rng::new(seed);
    let tally = &world.tally;
    while Instant::now() < world.end {
        let index = rng.below(KEYS as u64) as usize;
        let wait = ms(rng.pick(&[0, 100, 500, 1500]));
        let lease = Duration::from_secs(rng.between(2, 4));
        match world.client.acquire(&world.keys[index], wait, lease) {
            Ok(ticket) => {
                add(&tally.acquired);
                hold(world, ticket, &world.registers[index], &mut rng);
            }
            Err(AcquireError::Timeout) => add(&tally.not_acquired),
            Err(AcquireError::Indeterminate) => add(&tally.indeterminate),
            // Nothing was sent: every session was cut or stalled and none could be set up
            // again within the connect timeout. Rare, but not wrong through a proxy that cuts
            // connections on a loaded machine (seen once under a load average of 6); what
            // this test checks is that no honest write is ever refused.
            Err(AcquireError::Unavailable) => add(&tally.unsent),
            Err(other) => panic!("acquire: {other:?}"),
        }
    }
}

fn seed() -> u64 {
    let Ok(text) = std::env::var("LATCHKEY_STRESS_SEED") else {
        return SEED;
    };
    let parsed = match text.strip_prefix("0x") {
        Some(hex) => u64::from_str_radix(hex, 16),
        None => text.parse(),
    };
    parsed.expect("LATCHKEY_STRESS_SEED is a number")
}

#[test]
fn many_threads_on_one_client_never_write_with_a_lapsed_hold() {
    let seed = seed();
    eprintln!("client_stress seed {seed:#x} (replay with LATCHKEY_STRESS_SEED={seed:#x})");
    let server = start_server(|_| {});
    let proxy = Proxy::start(server.local_addr());
    // Well below the 200 ms margin of the shortest acquired lease (2 s).
    proxy.delay_up(ms(1));
    proxy.delay_down(ms(2));
    // Every connection is cut once this many client bytes went through it.
    proxy.cut_after(2000);
    let world = World {
        client: client(&[proxy.addr()], 2, Duration::from_secs(2)),
        keys: (0..KEYS).map(|k| format!("stress/{k}")).collect(),
        registers: (0..KEYS).map(|_| Register::default()).collect(),
        tally: Tally::default(),
        end: Instant::now() + RUN,
    };
    thread::scope(|scope| {
        for index in 0..THREADS {
            let world = &world;
            let thread_seed = seed ^ (index as u64 + 1).wrapping_mul(0x9e37_79b9_7f4a_7c15);
            scope.spawn(move || worker(world, thread_seed));
        }
    });
    let tally = &world.tally;
    eprintln!("{tally:?}; connections {}", proxy.connections());
    assert_eq!(
        get(&tally.rejected),
        0,
        "honest writes rejected (seed {seed:#x})"
    );
    assert!(get(&tally.writes) > 0, "no write happened");
    assert!(
        get(&tally.shortening) > 0,
        "no confirmed extend shortened a lease"
    );
    assert!(proxy.connections() > 2, "no connection was cut");
}
