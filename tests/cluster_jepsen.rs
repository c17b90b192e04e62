//! A Jepsen-style run against real processes: threads using the official Rust client (its
//! sessions identify, so a call whose member fails is resolved elsewhere: docs/protocol.md §5)
//! take locks on two contended keys and write a fenced register under them, while a nemesis
//! pauses (SIGSTOP), cuts off from its peers, kills -9 and restarts each member of a
//! three-member cluster (fsync on) in turn.
//!
//! Checked, for every grant the clients saw: no grant while another client's unreleased grant
//! of the same key is still within its validity bound (`Ticket::valid_until`: the lease as the
//! client counts it, never later than the server's); tokens strictly increasing per key in the
//! order the grants came; every write under a valid grant accepted by the fenced register
//! (which refuses a token lower than the last it took). The outcomes of the calls are printed,
//! not asserted: how long a failover takes on a loaded CI machine decides between a grant and a
//! `Timeout`, never safety. The simulation (`tests/cluster_locks_sim.rs`) checks the same
//! properties, and that no acquire executes twice, over many seeds.
//!
//! Bounded: about 30 s of faults; loopback only; the workers' pauses come from a fixed,
//! printed seed (`LATCHKEY_JEPSEN_SEED` to explore others).

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::thread;
use std::time::{Duration, Instant};

use common::cluster::Cluster;
use latchkey::rng::Rng;
use latchkey_client::{AcquireError, Client, ClientConfig};

const KEYS: usize = 2;
const WORKERS: usize = 6;
const WAIT: Duration = Duration::from_secs(4);
const LEASE: Duration = Duration::from_secs(3);
const PAUSE: Duration = Duration::from_secs(3);
const SETTLE: Duration = Duration::from_millis(1500);
const DEFAULT_SEED: u64 = 0x1a7c_5eed;

/// One key's state as the clients see it.
#[derive(Default)]
struct KeyLog {
    /// The grant inside its critical section now: its token and validity bound.
    inside: Option<(u64, Instant)>,
    /// The last token granted, in the order grants came.
    last_granted: u64,
    /// The fenced register: the highest token it accepted a write from.
    register: u64,
}

#[derive(Default)]
struct Record {
    keys: [KeyLog; KEYS],
    /// Every broken property, said.
    violations: Vec<String>,
    outcomes: BTreeMap<String, usize>,
    grants: usize,
}

impl Record {
    fn count(&mut self, outcome: &str) {
        *self.outcomes.entry(outcome.to_string()).or_default() += 1;
    }
}

fn worker(client: Client, seed: u64, stop: Arc<AtomicBool>, record: Arc<Mutex<Record>>) {
    let mut rng = Rng::new(seed);
    while !stop.load(Ordering::Relaxed) {
        let index = rng.below(KEYS as u64) as usize;
        let key = format!("jepsen/{index}");
        let ticket = match client.acquire(&key, WAIT, LEASE) {
            Ok(ticket) => ticket,
            Err(error) => {
                let outcome = match error {
                    AcquireError::Timeout => "timeout",
                    AcquireError::Busy => "busy",
                    AcquireError::Indeterminate => "indeterminate",
                    AcquireError::Unavailable => "unavailable",
                    _ => "other error",
                };
                record.lock().unwrap().count(outcome);
                continue;
            }
        };
        let (token, valid_until) = (ticket.token(), ticket.valid_until());
        {
            let now = Instant::now();
            let mut record = record.lock().unwrap();
            record.grants += 1;
            record.count("granted");
            let log = &mut record.keys[index];
            let mut broken = Vec::new();
            if let Some((other, until)) = log.inside {
                if now < until {
                    broken.push(format!(
                        "{key}: token {token} granted while token {other} was still valid for \
                         {:?}",
                        until - now
                    ));
                }
            }
            if token <= log.last_granted {
                broken.push(format!(
                    "{key}: token {token} granted after token {}",
                    log.last_granted
                ));
            }
            log.last_granted = log.last_granted.max(token);
            log.inside = Some((token, valid_until));
            record.violations.extend(broken);
        }
        thread::sleep(Duration::from_millis(rng.below(20)));
        {
            let mut record = record.lock().unwrap();
            let log = &mut record.keys[index];
            if Instant::now() < valid_until {
                // A write under a valid grant: the register must take it.
                if token < log.register {
                    let last = log.register;
                    record.violations.push(format!(
                        "{key}: a valid write of token {token} after {last}"
                    ));
                } else {
                    log.register = token;
                }
            }
            let log = &mut record.keys[index];
            if log.inside.is_some_and(|(inside, _)| inside == token) {
                log.inside = None;
            }
        }
        match ticket.release() {
            Ok(_) => {}
            Err(_) => record.lock().unwrap().count("release unanswered"),
        }
    }
}

#[test]
fn a_fenced_register_stays_exclusive_through_pauses_cuts_kills_and_restarts() {
    let seed = std::env::var("LATCHKEY_JEPSEN_SEED")
        .ok()
        .and_then(|seed| seed.parse().ok())
        .unwrap_or(DEFAULT_SEED);
    println!("seed {seed} (LATCHKEY_JEPSEN_SEED)");
    let mut cluster = Cluster::start_with("jepsen", 3, 4, true, true);
    let addrs: Vec<_> = cluster.members.iter().map(|m| m.client).collect();
    let stop = Arc::new(AtomicBool::new(false));
    let record = Arc::new(Mutex::new(Record::default()));
    let workers: Vec<_> = (0..WORKERS)
        .map(|n| {
            let config = ClientConfig {
                addrs: addrs.clone(),
                sessions: 1,
                ..ClientConfig::default()
            };
            let client = Client::with_config(config).expect("client");
            let (stop, record) = (Arc::clone(&stop), Arc::clone(&record));
            let seed = seed.wrapping_add(n as u64);
            thread::spawn(move || worker(client, seed, stop, record))
        })
        .collect();
    thread::sleep(SETTLE);
    for member in 0..3 {
        cluster.signal(member, libc::SIGSTOP);
        thread::sleep(PAUSE);
        cluster.signal(member, libc::SIGCONT);
        thread::sleep(SETTLE);
        cluster.isolate(member, true);
        thread::sleep(PAUSE);
        cluster.isolate(member, false);
        thread::sleep(SETTLE);
        cluster.kill(member);
        thread::sleep(Duration::from_secs(1));
        cluster.launch(member);
        thread::sleep(SETTLE);
    }
    stop.store(true, Ordering::Relaxed);
    for worker in workers {
        worker.join().expect("a worker ran to its end");
    }
    let record = record.lock().unwrap();
    println!(
        "grants {}, outcomes {:?}, last tokens {:?}",
        record.grants,
        record.outcomes,
        record
            .keys
            .iter()
            .map(|k| k.last_granted)
            .collect::<Vec<_>>()
    );
    assert!(
        record.violations.is_empty(),
        "seed {seed}: {:#?}",
        record.violations
    );
    assert!(record.grants > 0, "no grant at all: {:?}", record.outcomes);
}
