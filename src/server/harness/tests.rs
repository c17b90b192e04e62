//! The session-level invariants of the cores, driven deterministically (see the harness docs):
//! every grant is delivered or released, every close is acknowledged and frees its slot, every
//! queue stays bounded, every acquire of a session still open is answered exactly once.

use super::*;
use crate::partition::partition_of;
use crate::rng::Rng;
use crate::server::route::OUTBOX_REQUESTS_MAX;
use std::collections::{HashMap, HashSet};

const LIMITS: Limits = Limits {
    cores: 2,
    max_keys: 64,
    max_waiters_per_key: 4,
    max_pending_per_session: 8,
};
/// Unread bytes a reading client lets the server write.
const OPEN: usize = 1 << 20;

/// A key of `partition` (of two).
fn key_of(partition: usize, n: usize) -> Vec<u8> {
    (0..)
        .map(|i| format!("key/{n}/{i}").into_bytes())
        .find(|key| partition_of(key, 2) == partition)
        .expect("some key")
}

fn acquire(key: &[u8], wait_s: u8, lease_s: u8, owner: u64) -> Request<'_> {
    Request::Acquire {
        wait_s,
        lease_s,
        owner,
        key,
    }
}

/// A session that stops reading, with acquires of `key` (one per owner) queued behind the
/// holder and its output backed up past its bound by pings.
fn stalled_waiter(harness: &mut Harness, core: usize, key: &[u8], owners: &[u64]) -> Client {
    let victim = harness.connect(core, 0);
    let acquires: Vec<Request<'_>> = owners.iter().map(|&o| acquire(key, 60, 30, o)).collect();
    harness.send(&victim, &acquires);
    harness.step_all(2);
    let pings: Vec<Request<'_>> = (0..4000).map(|nonce| Request::Ping { nonce }).collect();
    for _ in 0..2 {
        harness.send(&victim, &pings);
        harness.step_all(2);
    }
    let session = &harness.cores[core].sessions[victim.slot];
    assert!(session.unsent() >= crate::server::session::OUTPUT_BOUND_BYTES);
    victim
}

/// The victim's first acquire is granted into its unsent output, then it resets: the key goes
/// to the next waiter of another session, also when the victim had a second acquire queued
/// on the key (releasing the first grant must not hand the key to the dying session).
fn unsent_grant_goes_to_the_next_waiter_on_reset(
    victim_core: usize,
    key_partition: usize,
    victim_owners: &[u64],
) {
    let mut harness = Harness::new(LIMITS);
    let key = key_of(key_partition, 0);
    let mut holder = harness.connect(0, OPEN);
    harness.send(&holder, &[acquire(&key, 0, 30, 1)]);
    harness.step_all(3);
    let Response::Acquired { token, .. } = harness.receive(&mut holder)[0] else {
        panic!("granted")
    };
    let victim = stalled_waiter(&mut harness, victim_core, &key, victim_owners);
    let mut next = harness.connect(1, OPEN);
    harness.send(&next, &[acquire(&key, 60, 30, 3)]);
    harness.step_all(3);
    let release = Request::Release { token, key: &key };
    harness.send(&holder, &[release]);
    harness.step_all(3);
    assert!(
        harness.receive(&mut next).is_empty(),
        "the victim is granted first"
    );
    harness.reset(&victim);
    harness.step_all(3);
    let answers = harness.receive(&mut next);
    assert!(
        matches!(answers[..], [Response::Acquired { owner: 3, token: t }] if t > token),
        "the next waiter gets the key at once: {answers:?}"
    );
    harness.step_all(3);
    assert!(!harness.is_open(&victim), "the dead session was freed");
}

#[test]
fn an_unsent_grant_is_released_when_its_session_resets_on_every_path() {
    // The session and the key on the same core, and on different cores, both ways.
    for (victim_core, key_partition) in [(0, 0), (1, 1), (0, 1), (1, 0)] {
        for victim_owners in [&[2][..], &[2, 4]] {
            unsent_grant_goes_to_the_next_waiter_on_reset(
                victim_core,
                key_partition,
                victim_owners,
            );
        }
    }
}

#[test]
fn cancels_streamed_at_a_lagging_core_stay_bounded() {
    let mut harness = Harness::new(LIMITS);
    let remote = key_of(1, 0);
    let client = harness.connect(0, OPEN);
    let cancels: Vec<Request<'_>> = (0..20_000)
        .map(|owner| Request::Cancel {
            owner,
            key: &remote,
        })
        .collect();
    // Core 1 never runs: its channel fills, then core 0's outbox to it, then core 0 stops
    // reading the session instead of queueing more.
    for _ in 0..6 {
        harness.send(&client, &cancels);
        for _ in 0..50 {
            harness.ready(&client, true, false, false);
            harness.step(0);
            harness.check_bounds();
        }
    }
    let queued = harness.cores[0].outbox_len(1);
    assert!(queued <= OUTBOX_REQUESTS_MAX, "outbox {queued}");
    let unread = client.pipe.borrow().to_server.len();
    assert!(
        unread > 0,
        "the session is paused, not buffered in the outbox"
    );
    // Core 1 catches up: everything drains and the session is read to the end.
    for _ in 0..400 {
        harness.step_all(1);
        harness.check_bounds();
        if client.pipe.borrow().to_server.is_empty() && harness.cores[0].outbox_len(1) == 0 {
            break;
        }
    }
    assert!(
        client.pipe.borrow().to_server.is_empty(),
        "the session was resumed"
    );
    assert_eq!(harness.cores[0].outbox_len(1), 0);
}

#[test]
fn a_burst_on_some_sessions_does_not_hold_a_ping_behind_it() {
    let mut harness = Harness::new(LIMITS);
    // Every reading of the clock takes 20 µs: about 800 frames spend an iteration's budget.
    harness.drift_us.set(20);
    let key = key_of(0, 0);
    let busy: Vec<Client> = (0..3).map(|_| harness.connect(0, OPEN)).collect();
    let queries: Vec<Request<'_>> = (0..3000)
        .map(|nonce| Request::Query { nonce, key: &key })
        .collect();
    for client in &busy {
        harness.send(client, &queries);
    }
    let probe = harness.connect(0, OPEN);
    harness.send(&probe, &[Request::Ping { nonce: 7 }]);
    // Bytes of answers produced so far: written to a client or waiting in its output.
    let produced = |harness: &Harness, client: &Client| {
        let unsent = harness.cores[0].sessions[client.slot].unsent();
        client.pipe.borrow().to_client.len() + unsent
    };
    let mut iterations = 0;
    while produced(&harness, &probe) == 0 {
        harness.step(0);
        iterations += 1;
        assert!(iterations < 10, "no pong");
    }
    // Every answer to a query is a 19-byte `Q`.
    let before_pong: usize = busy.iter().map(|c| produced(&harness, c) / 19).sum();
    // Without the budget the ping waited for all 9,000 queries before it.
    assert!(
        before_pong < 4000,
        "{before_pong} answers were produced before the pong"
    );
    let mut busy = busy;
    // Nobody starves: every query is answered in the end.
    let mut answered = 0;
    for _ in 0..100 {
        harness.step(0);
        answered += busy
            .iter_mut()
            .map(|c| harness.receive(c).len())
            .sum::<usize>();
    }
    assert_eq!(answered, 9000);
}

/// What the test knows of one client.
struct Model {
    client: Client,
    /// Not reset and not half-closed: it may send and its acquires must all be answered.
    open: bool,
    reset: bool,
    /// Owners of acquires sent and not answered.
    outstanding: HashSet<u64>,
    holds: Vec<(usize, u64)>,
}

/// One seeded run: random clients on random cores, checked after every step.
struct Run {
    rng: Rng,
    harness: Harness,
    keys: Vec<Vec<u8>>,
    clients: Vec<Model>,
    /// Tokens of every `A` a client received whole.
    received: HashSet<u64>,
    /// The key of every acquire sent, by owner.
    owners: HashMap<u64, usize>,
    next_owner: u64,
    log: Vec<String>,
    /// Admin HTTP requests sent, each on its own session.
    admins: Vec<Client>,
}

impl Run {
    fn new(seed: u64) -> Run {
        let keys = (0..6).map(|n| key_of(n % 2, n)).collect();
        let harness = Harness::new(LIMITS);
        // A third of the seeds run with a clock that moves while a core works, so that its
        // work budget runs out and sessions are read over several iterations.
        harness.drift_us.set((seed % 3) * 8);
        Run {
            rng: Rng::new(seed),
            harness,
            keys,
            clients: Vec::new(),
            received: HashSet::new(),
            owners: HashMap::new(),
            next_owner: 1,
            log: Vec::new(),
            admins: Vec::new(),
        }
    }

    fn connect(&mut self) {
        let core = self.rng.below(LIMITS.cores as u64) as usize;
        let client = self.harness.connect(core, OPEN);
        self.log
            .push(format!("connect {} on core {core}", self.clients.len()));
        self.clients.push(Model {
            client,
            open: true,
            reset: false,
            outstanding: HashSet::new(),
            holds: Vec::new(),
        });
    }

    fn pick_open(&mut self) -> Option<usize> {
        let open: Vec<usize> = (0..self.clients.len())
            .filter(|&c| self.clients[c].open)
            .collect();
        (!open.is_empty()).then(|| open[self.rng.below(open.len() as u64) as usize])
    }

    fn step(&mut self) {
        let roll = self.rng.below(100);
        if self.clients.is_empty() || roll >= 95 {
            return self.connect();
        }
        match roll {
            0..=59 => self.request(),
            60..=69 => self.receive_one(),
            70..=79 => {
                let core = self.rng.below(LIMITS.cores as u64) as usize;
                self.harness.step(core);
            }
            80..=84 => {
                let by_us = self.rng.below(1_500_000);
                self.harness.advance(by_us);
            }
            85..=87 => self.throttle(),
            88 => self.end(true),
            89 => self.end(false),
            94 => self.admin(),
            _ => self.harness.step_all(1),
        }
    }

    fn request(&mut self) {
        let Some(c) = self.pick_open() else { return };
        let key_index = self.rng.below(self.keys.len() as u64) as usize;
        let roll = self.rng.below(100);
        let owner = self.next_owner;
        self.next_owner += 1;
        let key = self.keys[key_index].clone();
        let model = &mut self.clients[c];
        let request = match roll {
            0..=49 => {
                model.outstanding.insert(owner);
                self.owners.insert(owner, key_index);
                let wait_s = self.rng.below(3) as u8;
                let lease_s = 1 + self.rng.below(3) as u8;
                acquire(&key, wait_s, lease_s, owner)
            }
            50..=69 if !model.holds.is_empty() => {
                let (held, token) = model.holds.swap_remove(0);
                Request::Release {
                    token,
                    key: &self.keys[held],
                }
            }
            70..=79 if !model.holds.is_empty() => {
                let (held, token) = model.holds[0];
                Request::Extend {
                    lease_s: 1,
                    token,
                    key: &self.keys[held],
                }
            }
            80..=89 if !model.outstanding.is_empty() => {
                let owner = *model.outstanding.iter().next().expect("one");
                // Every key: the Cancel names one, and withdraws only on that one.
                Request::Cancel { owner, key: &key }
            }
            90..=94 => Request::Query {
                nonce: owner,
                key: &key,
            },
            _ => Request::Ping { nonce: owner },
        };
        self.log.push(format!("client {c}: {request:?}"));
        let client = &self.clients[c].client;
        self.harness.send(client, &[request]);
    }

    /// An admin request on a new session of a random core (gathered from every core).
    fn admin(&mut self) {
        let core = self.rng.below(LIMITS.cores as u64) as usize;
        let client = self.harness.connect(core, OPEN);
        let path = ["/stats", "/metrics", "/keys?limit=3"][self.rng.below(3) as usize];
        self.log.push(format!("admin {path} on core {core}"));
        let request = format!("GET {path} HTTP/1.1\r\n\r\n");
        client.pipe.borrow_mut().to_server.extend(request.bytes());
        self.harness.ready(&client, true, false, false);
        self.admins.push(client);
    }

    /// Every admin request was answered whole: `200` with its body, or `503` when a core did
    /// not send its figures within the deadline (the run advances time while cores idle).
    fn check_admins(&self) {
        for (a, client) in self.admins.iter().enumerate() {
            let bytes: Vec<u8> = client.pipe.borrow().to_client.iter().copied().collect();
            let text = String::from_utf8(bytes).expect("utf-8");
            let (head, body) = text
                .split_once("\r\n\r\n")
                .unwrap_or_else(|| panic!("admin {a}: no answer: {text:?}"));
            let length: usize = head
                .lines()
                .find_map(|line| line.strip_prefix("Content-Length: "))
                .and_then(|length| length.parse().ok())
                .expect("a length");
            assert_eq!(body.len(), length, "admin {a}: whole body");
            let ok = head.starts_with("HTTP/1.1 200 ");
            assert!(ok || head.starts_with("HTTP/1.1 503 "), "admin {a}: {head}");
            if ok && !body.starts_with('#') {
                serde_json::from_str::<serde_json::Value>(body).expect("JSON");
            }
        }
    }

    fn receive_one(&mut self) {
        let Some(c) = self.pick_open() else { return };
        self.receive(c);
    }

    fn receive(&mut self, c: usize) {
        let answers = self.harness.receive(&mut self.clients[c].client);
        for answer in answers {
            self.answered(c, answer);
        }
    }

    fn answered(&mut self, c: usize, answer: Response) {
        self.log.push(format!("client {c} got {answer:?}"));
        let model = &mut self.clients[c];
        match answer {
            Response::Acquired { owner, token } => {
                assert!(
                    model.outstanding.remove(&owner),
                    "A for {owner}: not outstanding"
                );
                assert!(self.received.insert(token), "token {token} granted twice");
                model.holds.push((self.owners[&owner], token));
            }
            Response::Timeout { owner } | Response::Busy { owner } => {
                assert!(
                    model.outstanding.remove(&owner),
                    "T/B for {owner}: not outstanding"
                );
            }
            Response::Error { code, id } => panic!("X {code} for {id}"),
            _ => {}
        }
    }

    fn throttle(&mut self) {
        let Some(c) = self.pick_open() else { return };
        let mut pipe = self.clients[c].client.pipe.borrow_mut();
        pipe.capacity_to_client = if pipe.capacity_to_client == 0 {
            OPEN
        } else {
            0
        };
    }

    /// A client goes away: reset (`reset`) or end of input.
    fn end(&mut self, reset: bool) {
        let Some(c) = self.pick_open() else { return };
        self.log.push(format!("client {c} ends (reset {reset})"));
        if reset {
            // What was written whole before the reset may have arrived: it counts as received.
            let bytes: Vec<u8> = self.clients[c]
                .client
                .pipe
                .borrow_mut()
                .to_client
                .drain(..)
                .collect();
            let mut used = 0;
            while let Ok(Some((answer, len))) = parse_response(&bytes[used..]) {
                used += len;
                self.answered(c, answer);
            }
            self.harness.reset(&self.clients[c].client);
        } else {
            self.harness.half_close(&self.clients[c].client);
        }
        let model = &mut self.clients[c];
        model.open = false;
        model.reset = reset;
    }

    /// Every core runs and every client still connected reads, until nothing moves.
    fn settle(&mut self) {
        for c in 0..self.clients.len() {
            if !self.clients[c].reset {
                self.clients[c].client.pipe.borrow_mut().capacity_to_client = OPEN;
            }
        }
        for _ in 0..8 {
            self.harness.step_all(2);
            for c in 0..self.clients.len() {
                if !self.clients[c].reset {
                    self.receive(c);
                }
            }
        }
    }

    /// Every key held anywhere is held by a grant some client received whole.
    fn check_grants(&self) {
        for (key, token) in self.harness.holds() {
            assert!(
                self.received.contains(&token),
                "{:?} held by token {token}, which no client received",
                String::from_utf8_lossy(&key)
            );
        }
    }

    fn finish(&mut self) {
        self.settle();
        self.check_grants();
        self.check_admins();
        // Every wait and lease runs out; every acquire of a connected client is answered.
        for _ in 0..60 {
            self.harness.advance(5_000_000);
            self.settle();
        }
        for (c, model) in self.clients.iter().enumerate() {
            if model.open {
                assert!(
                    model.outstanding.is_empty(),
                    "client {c}: {:?}",
                    model.outstanding
                );
            }
        }
        assert!(self.harness.holds().is_empty(), "every lease ran out");
        // Every session closes, every close is acknowledged, every slot is freed.
        for c in 0..self.clients.len() {
            if self.clients[c].open {
                self.harness.half_close(&self.clients[c].client);
            }
        }
        self.settle();
        self.harness.advance(3_000_000);
        self.settle();
        for core in &self.harness.cores {
            assert_eq!(
                core.session_count(),
                0,
                "core {}: sessions left",
                core.index()
            );
            assert_eq!(core.read_buffers().1, 0, "read buffers still lent");
        }
        let connections = self
            .harness
            .shared
            .connections
            .load(std::sync::atomic::Ordering::Relaxed);
        assert_eq!(connections, 0);
    }
}

fn run_seed(seed: u64, steps: usize) {
    let mut run = Run::new(seed);
    let result = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        for step in 0..steps {
            run.step();
            run.harness.check_bounds();
            if step % 50 == 49 {
                run.settle();
                run.check_grants();
            }
        }
        run.finish();
    }));
    if let Err(panic) = result {
        let tail: Vec<&String> = run.log.iter().rev().take(40).collect();
        eprintln!("harness seed {seed:#x} failed; last steps, newest first: {tail:#?}");
        eprintln!("replay with LATCHKEY_HARNESS_SEED={seed:#x}");
        std::panic::resume_unwind(panic);
    }
}

#[test]
fn random_sessions_keep_the_session_invariants() {
    let seeds: Vec<u64> = match std::env::var("LATCHKEY_HARNESS_SEED") {
        Ok(text) => {
            let text = text.trim_start_matches("0x");
            vec![u64::from_str_radix(text, 16).expect("a hex seed")]
        }
        Err(_) => (0..24u64).map(|i| 0x5eed_0000 + i).collect(),
    };
    let steps = std::env::var("LATCHKEY_HARNESS_STEPS")
        .ok()
        .and_then(|text| text.parse().ok())
        .unwrap_or(400);
    eprintln!(
        "harness: seeds {:#x}..={:#x}, {steps} steps each",
        seeds[0],
        seeds[seeds.len() - 1]
    );
    for seed in seeds {
        run_seed(seed, steps);
    }
}

/// Seeds that once failed, replayed for as many steps as they needed.
#[test]
fn seeds_that_found_bugs_stay_fixed() {
    // Releasing a dying session's unsent grant handed the key to the same session's next
    // queued acquire, and that grant was lost with the session: found at 0x3af01477 (3000
    // steps) with the generator the harness had then; with `crate::rng`'s, 0x18 finds it
    // within 100 steps, the CI run's 400 with margin (checked with the bug put back).
    let found: &[(u64, usize)] = &[(0x18, 400)];
    for &(seed, steps) in found {
        eprintln!("harness: replaying seed {seed:#x}, {steps} steps");
        run_seed(seed, steps);
    }
}
