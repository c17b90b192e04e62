//! Deterministic simulation of one partition — the lock table and its timing wheel — on virtual
//! time, checked after every step against the reference model, `latchkey::partition::model`.
//!
//! Each seed picks its own limits (keys, waiters per key, pending per session, tick length,
//! token reservation) and runs loop iterations the way the reactor does: time moves (by a
//! tick, to the wheel's next deadline, to a model deadline or just before it, by seconds or
//! minutes), a few requests run at that instant, then `handle_timers`. Requests are random
//! acquires (wait 0 and > 0), releases and extends (right and wrong tokens), cancels, queries,
//! pings (which the table must ignore), session closes and opens, token-limit raises, and
//! sometimes a shutdown. Those random choices are in `simulation/generator.rs`.
//!
//! After every step: the answers equal the model's (in order for a request; as a multiset for
//! a timer batch, whose order the wheel leaves unspecified), and
//! * at most one holder per key, and the table agrees with the model on keys and waiters;
//! * tokens strictly increase per key, never repeat, and are the partition's next ones;
//! * grants go to the head of the queue (FIFO), never to a withdrawn waiter;
//! * every acquire is answered at most once, and by the end exactly once unless withdrawn;
//! * nothing fires before its deadline, nothing is left due after `handle_timers`, and
//!   `next_deadline_us` is never after the earliest deadline;
//! * `Query` of every key matches the model (a free key has no waiters);
//! * `LockTable::check_invariants()` holds.
//!
//! On failure it prints the seed, the step and the last operations. Environment:
//! `LATCHKEY_SIM_SEED=N` replays one seed; `LATCHKEY_SIM_SEEDS` (default 200) and
//! `LATCHKEY_SIM_STEPS` (default 2 500: the table checks its whole wheel after every step, which
//! dominates a debug build) set the budget; `LATCHKEY_SIM_SEED_BASE` (default 0) shifts the
//! seeds, for long runs that explore new ones.

// Not `tests/generator.rs`: Cargo would build that as a test of its own.
#[path = "simulation/generator.rs"]
mod generator;

use generator::key_name;
use latchkey::lock_table::{LockTable, TableConfig};
use latchkey::partition::model::{Expect, Model};
use latchkey::partition::{Answer, SessionId};
use latchkey::rng::Rng;
use latchkey::tokens::TokenRange;
use latchkey_client::protocol::{Request, Response};
use std::collections::{BTreeMap, HashMap, HashSet, VecDeque};
use std::fmt::Write as _;
use std::panic::{self, AssertUnwindSafe};
use std::time::Instant;

const MICROS_PER_SECOND: u64 = 1_000_000;
/// The session that queries every key after every step.
const OBSERVER: SessionId = u64::MAX - 1;
/// Operations kept for the failure report.
const TRACE_KEPT: usize = 40;

/// One step, as kept for the failure report (its fields are read through `Debug`).
#[allow(dead_code)]
#[derive(Clone, Copy, Debug)]
enum Op {
    Timers {
        now_us: u64,
    },
    Acquire {
        session: SessionId,
        key: usize,
        wait_s: u8,
        lease_s: u8,
        owner: u64,
    },
    Release {
        session: SessionId,
        key: usize,
        token: u64,
    },
    Extend {
        session: SessionId,
        key: usize,
        lease_s: u8,
        token: u64,
    },
    Cancel {
        session: SessionId,
        key: usize,
        owner: u64,
    },
    Query {
        session: SessionId,
        key: usize,
    },
    Ping {
        session: SessionId,
    },
    Close {
        session: SessionId,
    },
    Open {
        session: SessionId,
    },
    RaiseLimit {
        limit: u64,
    },
    Shutdown,
}

impl Op {
    fn name(&self) -> &'static str {
        match self {
            Op::Timers { .. } => "timers",
            Op::Acquire { .. } => "acquire",
            Op::Release { .. } => "release",
            Op::Extend { .. } => "extend",
            Op::Cancel { .. } => "cancel",
            Op::Query { .. } => "query",
            Op::Ping { .. } => "ping",
            Op::Close { .. } => "close",
            Op::Open { .. } => "open",
            Op::RaiseLimit { .. } => "raise_limit",
            Op::Shutdown => "shutdown",
        }
    }
}

/// What a seed configures besides the table's limits.
struct Params {
    keys: Vec<Vec<u8>>,
    max_pending: u32,
    sessions_max: usize,
    shutdown_at: Option<u64>,
    tight_tokens: bool,
}

/// An acquire's owner as submitted (an owner is reused only on its session and key).
struct Submitted {
    session: SessionId,
    count: u32,
    answered: u32,
    withdrawn: u32,
}

/// How often each kind of step produced each kind of answer: shows what a budget covered.
type Stats = BTreeMap<(&'static str, char), u64>;

type Checked = Result<(), String>;

struct Sim {
    rng: Rng,
    params: Params,
    table: LockTable,
    model: Model,
    last_token: Vec<u64>,
    recent_tokens: Vec<u64>,
    issued: HashSet<u64>,
    open: Vec<SessionId>,
    closed: HashSet<SessionId>,
    next_session: SessionId,
    pending: HashMap<SessionId, u32>,
    acquires: HashMap<u64, Submitted>,
    next_owner: u64,
    trace: VecDeque<Op>,
    step: u64,
    stats: Stats,
}

impl Sim {
    fn new(seed: u64, steps: u64) -> Sim {
        let mut rng = Rng::new(seed);
        let key_count = rng.between(2, 9) as usize;
        let config = TableConfig {
            max_keys: rng.between(1, key_count as u64 + 1) as usize,
            max_waiters_per_key: rng.between(1, 6) as u32,
            tick_us: rng.pick(&[1000, 1000, 1000, 1, 250, 10_000, 1_000_000]),
            // Set from `params` below, once drawn.
            max_pending_per_session: 1,
        };
        let params = Params {
            keys: (0..key_count)
                .map(|index| key_name(&mut rng, index))
                .collect(),
            max_pending: rng.between(1, 8) as u32,
            sessions_max: rng.between(1, 5) as usize,
            shutdown_at: rng.percent(20).then(|| steps - rng.below(steps / 10 + 1)),
            tight_tokens: rng.percent(20),
        };
        let now_us = rng.below(1 << 45);
        let (next, step) = (rng.between(1, 1 << 50), rng.between(1, 4));
        let limit = match params.tight_tokens {
            true => next + step * rng.between(0, 60),
            false => u64::MAX,
        };
        let tokens = TokenRange { next, step, limit };
        Sim {
            rng,
            table: LockTable::new(
                TableConfig {
                    max_pending_per_session: params.max_pending,
                    ..config
                },
                now_us,
                tokens,
            ),
            model: Model::new(config, tokens, key_count, now_us),
            last_token: vec![0; key_count],
            params,
            recent_tokens: Vec::new(),
            issued: HashSet::new(),
            open: vec![1],
            closed: HashSet::new(),
            next_session: 2,
            pending: HashMap::new(),
            acquires: HashMap::new(),
            next_owner: 1,
            trace: VecDeque::new(),
            step: 0,
            stats: Stats::new(),
        }
    }

    fn now_us(&self) -> u64 {
        self.model.now_us
    }

    fn key(&self, key: usize) -> &[u8] {
        &self.params.keys[key]
    }

    fn record(&mut self, op: Op) {
        if self.trace.len() == TRACE_KEPT {
            self.trace.pop_front();
        }
        self.trace.push_back(op);
        self.step += 1;
    }

    // ----- one loop iteration ----------------------------------------------------------------

    fn iteration(&mut self) -> Checked {
        self.model.now_us += self.time_step();
        if let Some(shutdown_at) = self.params.shutdown_at {
            if self.step >= shutdown_at {
                self.params.shutdown_at = None;
                self.shutdown()?;
                self.after_step()?;
            }
        }
        let requests = match self.rng.below(4) {
            0 => 0,
            1 | 2 => 1,
            _ => self.rng.between(2, 6),
        };
        for _ in 0..requests {
            self.random_request()?;
            self.after_step()?;
        }
        self.timers()?;
        self.after_step()
    }

    // ----- requests --------------------------------------------------------------------------

    fn acquire(&mut self, session: SessionId) -> Checked {
        let key = self.random_key();
        let (wait_s, lease_s) = (self.random_wait(), self.random_lease());
        let owner = self.acquire_owner(session, key);
        self.record(Op::Acquire {
            session,
            key,
            wait_s,
            lease_s,
            owner,
        });
        let submitted = self.acquires.entry(owner).or_insert(Submitted {
            session,
            count: 0,
            answered: 0,
            withdrawn: 0,
        });
        submitted.count += 1;
        // What the reactor tracks per session: acquires with wait > 0 not yet answered.
        let waits = wait_s > 0;
        let pending = self.pending.entry(session).or_insert(0);
        let at_limit = waits && *pending >= self.params.max_pending;
        *pending += u32::from(waits);
        let expected = self
            .model
            .acquire(session, key, (wait_s, lease_s, owner), at_limit);
        let request = Request::Acquire {
            wait_s,
            lease_s,
            owner,
            key: &self.params.keys[key],
        };
        self.table
            .handle_request(self.model.now_us, session, &request);
        self.compare(expected, true)
    }

    fn release(&mut self, session: SessionId) -> Checked {
        let key = self.random_key();
        let token = self.random_token(key);
        self.record(Op::Release {
            session,
            key,
            token,
        });
        let expected = self.model.release(session, key, token);
        let request = Request::Release {
            token,
            key: &self.params.keys[key],
        };
        self.table
            .handle_request(self.model.now_us, session, &request);
        self.compare(expected, true)
    }

    fn extend(&mut self, session: SessionId) -> Checked {
        let key = self.random_key();
        let token = self.random_token(key);
        let lease_s = self.random_lease();
        self.record(Op::Extend {
            session,
            key,
            lease_s,
            token,
        });
        let expected = self.model.extend(session, key, lease_s, token);
        let request = Request::Extend {
            lease_s,
            token,
            key: &self.params.keys[key],
        };
        self.table
            .handle_request(self.model.now_us, session, &request);
        self.compare(vec![expected], true)
    }

    fn cancel(&mut self, session: SessionId) -> Checked {
        let key = self.random_key();
        // Usually an owner this session has queued on the key; else any owner.
        let queued = self.model.queued_owners(session, key);
        let owner = match queued.is_empty() || self.rng.percent(20) {
            true => self.rng.between(1, self.next_owner),
            false => self.rng.pick(&queued),
        };
        self.record(Op::Cancel {
            session,
            key,
            owner,
        });
        let expected = self.model.cancel(session, key, owner);
        let request = Request::Cancel {
            owner,
            key: &self.params.keys[key],
        };
        self.table
            .handle_request(self.model.now_us, session, &request);
        self.compare(expected, true)
    }

    fn query(&mut self, session: SessionId, key: usize) -> Checked {
        if session != OBSERVER {
            self.record(Op::Query { session, key });
        }
        let nonce = self.rng.next_u64();
        let expected = self.model.query(session, key, nonce);
        let request = Request::Query {
            nonce,
            key: &self.params.keys[key],
        };
        self.table
            .handle_request(self.model.now_us, session, &request);
        self.compare(vec![expected], true)
    }

    fn ping(&mut self, session: SessionId) -> Checked {
        self.record(Op::Ping { session });
        let nonce = self.rng.next_u64();
        // The reactor answers pings; handed to the table, one changes nothing.
        let ping = Request::Ping { nonce };
        self.table.handle_request(self.model.now_us, session, &ping);
        self.compare(Vec::new(), true)
    }

    fn close_and_open(&mut self, session: SessionId) -> Checked {
        self.record(Op::Close { session });
        for owner in self.model.close_session(session) {
            self.acquires.get_mut(&owner).expect("submitted").withdrawn += 1;
        }
        self.open.retain(|&open| open != session);
        self.closed.insert(session);
        self.pending.remove(&session);
        self.table.handle_session_closed(session);
        self.compare(Vec::new(), true)?;
        if self.open.is_empty() {
            self.open_session()?;
        }
        Ok(())
    }

    fn open_session(&mut self) -> Checked {
        let session = self.next_session;
        self.record(Op::Open { session });
        self.open.push(session);
        self.next_session += 1;
        Ok(())
    }

    fn raise_limit(&mut self) -> Checked {
        let tokens = self.model.tokens;
        let limit = tokens.limit.max(tokens.next) + tokens.step * self.rng.below(40);
        self.record(Op::RaiseLimit { limit });
        self.model.raise_token_limit(limit);
        self.table.raise_token_limit(limit);
        self.compare(Vec::new(), true)
    }

    fn shutdown(&mut self) -> Checked {
        self.record(Op::Shutdown);
        let expected = self.model.shutdown();
        self.table.handle_shutdown();
        self.compare(expected, false)
    }

    fn timers(&mut self) -> Checked {
        let now_us = self.now_us();
        self.record(Op::Timers { now_us });
        // The reactor sleeps until next_deadline_us: it must never be after a deadline.
        let earliest = self.model.deadlines().map(|d| self.model.fire_at(d)).min();
        match (self.table.next_deadline_us(), earliest) {
            (None, None) => {}
            (Some(next), Some(earliest)) if next <= earliest => {}
            (next, earliest) => {
                return Err(format!(
                    "next_deadline_us {next:?}, earliest model deadline {earliest:?}"
                ))
            }
        }
        self.table.handle_timers(now_us);
        let actual = self.table.take_answers();
        let keys = &self.params.keys;
        let granted_keys: Vec<usize> = (actual.iter())
            .filter(|answer| matches!(answer.response, Response::Acquired { .. }))
            .map(|answer| {
                let key = self.table.entry_key(answer.grant.0);
                key.and_then(|key| keys.iter().position(|k| k[..] == key[..]))
                    .ok_or("a grant of no known key")
            })
            .collect::<Result<_, _>>()?;
        let expected = self.model.timers(&granted_keys)?;
        self.compare_answers(expected, actual, false)
    }

    // ----- checking --------------------------------------------------------------------------

    fn compare(&mut self, expected: Vec<Expect>, ordered: bool) -> Checked {
        let actual = self.table.take_answers();
        self.compare_answers(expected, actual, ordered)
    }

    /// The table's answers are the model's: in order, or as a multiset for a batch whose
    /// order is unspecified.
    fn compare_answers(
        &mut self,
        expected: Vec<Expect>,
        actual: Vec<Answer>,
        ordered: bool,
    ) -> Checked {
        let mismatch = || format!("expected {expected:#?}\nactual {actual:#?}");
        if expected.len() != actual.len() {
            return Err(format!("answer count differs: {}", mismatch()));
        }
        let mut used = vec![false; expected.len()];
        let mut grants = Vec::new();
        for (position, answer) in actual.iter().enumerate() {
            let fits = |p: usize| !used[p] && self.matches(&expected[p], answer);
            let found = match ordered {
                true => Some(position).filter(|&p| fits(p)),
                false => (0..expected.len()).find(|&p| fits(p)),
            };
            let Some(found) = found else {
                return Err(format!("answer {answer:?} not expected: {}", mismatch()));
            };
            used[found] = true;
            if let Response::Acquired { token, .. } = answer.response {
                grants.push((expected[found].key.expect("a grant names its key"), token));
            }
            self.account(answer)?;
        }
        self.check_tokens(grants)?;
        self.table.return_answers(actual);
        Ok(())
    }

    fn matches(&self, expected: &Expect, actual: &Answer) -> bool {
        let same_response = match (expected.response, actual.response) {
            (Response::Acquired { owner, .. }, Response::Acquired { owner: got, .. }) => {
                let key = self.key(expected.key.expect("a grant names its key"));
                owner == got && self.table.entry_key(actual.grant.0) == Some(key)
            }
            (want, got) => want == got,
        };
        same_response
            && expected.session == actual.session
            && expected.ends_pending == actual.ends_pending
    }

    /// Per answer: it goes to an open session; an acquire's answer is its first and only one.
    fn account(&mut self, answer: &Answer) -> Checked {
        if answer.session == OBSERVER {
            return Ok(());
        }
        let kind = self.trace.back().map_or("start", Op::name);
        *self
            .stats
            .entry((kind, answer.response.op() as char))
            .or_insert(0) += 1;
        check(
            !self.closed.contains(&answer.session),
            "answer to a closed session",
        )?;
        if answer.ends_pending {
            let pending = self
                .pending
                .get_mut(&answer.session)
                .ok_or("no pending count")?;
            check(*pending > 0, "pending count below zero")?;
            *pending -= 1;
        }
        let owner = match answer.response {
            Response::Acquired { owner, .. }
            | Response::Timeout { owner }
            | Response::Busy { owner } => owner,
            _ => return Ok(()),
        };
        let submitted = self
            .acquires
            .get_mut(&owner)
            .ok_or("answer to an unknown owner")?;
        check(
            submitted.session == answer.session,
            "answer to the wrong session",
        )?;
        submitted.answered += 1;
        check(
            submitted.answered + submitted.withdrawn <= submitted.count,
            "an acquire answered twice, or a withdrawn one answered",
        )
    }

    /// The grants of one step use exactly the partition's next tokens, each above every
    /// earlier token of its key and never seen before.
    fn check_tokens(&mut self, grants: Vec<(usize, u64)>) -> Checked {
        let mut tokens: Vec<u64> = grants.iter().map(|&(_, token)| token).collect();
        tokens.sort_unstable();
        let step = self.model.tokens.step;
        let mut next = self.model.tokens.next - step * tokens.len() as u64;
        for token in tokens {
            check(token == next, "tokens are not the partition's next ones")?;
            next += step;
        }
        for (key, token) in grants {
            check(
                token > self.last_token[key],
                "token not increasing for its key",
            )?;
            check(self.issued.insert(token), "token issued twice")?;
            self.last_token[key] = token;
            if self.recent_tokens.len() < 64 {
                self.recent_tokens.push(token);
            } else {
                let slot = self.rng.below(64) as usize;
                self.recent_tokens[slot] = token;
            }
            self.model.set_token(key, token)?;
        }
        Ok(())
    }

    /// After every step: the table's own invariants, its counts, every key's Query, FIFO
    /// order of the queues, and nothing left due after the timers ran.
    fn after_step(&mut self) -> Checked {
        self.table.check_invariants();
        let model = &self.model;
        check(
            self.table.key_count() == model.key_count(),
            "key count differs",
        )?;
        check(
            self.table.waiter_count() == model.waiter_count(),
            "waiter count differs",
        )?;
        for held in model.held.iter().flatten() {
            check(held.token != 0, "a held key without a known token")?;
            let seqs = held.queue.iter().map(|waiter| waiter.seq);
            check(
                seqs.clone().zip(seqs.skip(1)).all(|(a, b)| a < b),
                "queue not FIFO",
            )?;
        }
        if matches!(self.trace.back(), Some(Op::Timers { .. })) {
            if let Some(left) = model.deadlines().find(|&deadline| model.due(deadline)) {
                return Err(format!("deadline {left} left due after handle_timers"));
            }
        }
        for key in 0..self.params.keys.len() {
            self.query(OBSERVER, key)?;
        }
        Ok(())
    }

    /// Runs the clock past every deadline; then every acquire not withdrawn has its answer.
    fn finish(&mut self) -> Checked {
        // Bounded: every round fires every current deadline, and a key's chain of handoffs is
        // at most its queue.
        for _ in 0..10_000 {
            let Some(latest) = self.model.deadlines().max() else {
                break;
            };
            self.model.now_us = self.model.fire_at(latest).max(self.now_us());
            self.timers()?;
            self.after_step()?;
        }
        check(
            self.table.key_count() == 0,
            "keys left after every lease ran out",
        )?;
        check(self.table.next_deadline_us().is_none(), "timers left")?;
        for (owner, submitted) in &self.acquires {
            if submitted.answered + submitted.withdrawn != submitted.count {
                return Err(format!("acquire of owner {owner} was never answered"));
            }
        }
        Ok(())
    }

    fn report(&self, seed: u64, steps: u64, error: &str) -> String {
        let mut text = format!(
            "simulation failed: seed {seed}, step {}: {error}\n\
             replay: LATCHKEY_SIM_SEED={seed} LATCHKEY_SIM_STEPS={steps} \
             cargo test --test simulation\nlast operations (oldest first):\n",
            self.step
        );
        for op in &self.trace {
            let _ = writeln!(text, "  {op:?}");
        }
        text
    }
}

fn check(condition: bool, what: &str) -> Checked {
    match condition {
        true => Ok(()),
        false => Err(what.to_string()),
    }
}

/// Runs one seed; its answer statistics, or the failure report (seed, step, last operations).
fn run_seed(seed: u64, steps: u64) -> Result<Stats, String> {
    let mut sim = Sim::new(seed, steps);
    let outcome = panic::catch_unwind(AssertUnwindSafe(|| {
        while sim.step < steps {
            sim.iteration()?;
        }
        sim.finish()
    }));
    match outcome {
        Ok(Ok(())) => Ok(std::mem::take(&mut sim.stats)),
        Ok(Err(error)) => Err(sim.report(seed, steps, &error)),
        Err(panic) => {
            let message = panic
                .downcast_ref::<String>()
                .cloned()
                .or_else(|| panic.downcast_ref::<&str>().map(|s| s.to_string()))
                .unwrap_or_default();
            Err(sim.report(seed, steps, &format!("panicked: {message}")))
        }
    }
}

fn env_u64(name: &str) -> Option<u64> {
    let value = std::env::var(name).ok()?;
    Some(
        value
            .parse()
            .unwrap_or_else(|_| panic!("{name}={value} is not a number")),
    )
}

#[test]
fn partition_matches_the_reference_model() {
    let steps = env_u64("LATCHKEY_SIM_STEPS").unwrap_or(2_500);
    let seeds: Vec<u64> = match env_u64("LATCHKEY_SIM_SEED") {
        Some(seed) => vec![seed],
        None => {
            let base = env_u64("LATCHKEY_SIM_SEED_BASE").unwrap_or(0);
            let count = env_u64("LATCHKEY_SIM_SEEDS").unwrap_or(200);
            (base..base + count).collect()
        }
    };
    let started = Instant::now();
    let threads = std::thread::available_parallelism()
        .map_or(1, usize::from)
        .min(8);
    let outcomes: Vec<Result<Stats, String>> = std::thread::scope(|scope| {
        let workers: Vec<_> = (0..threads)
            .map(|worker| {
                let seeds = &seeds;
                scope.spawn(move || {
                    let mine = seeds.iter().skip(worker).step_by(threads);
                    mine.map(|&seed| run_seed(seed, steps)).collect::<Vec<_>>()
                })
            })
            .collect();
        workers
            .into_iter()
            .flat_map(|worker| worker.join().unwrap())
            .collect()
    });
    let mut total = Stats::new();
    let mut failures = Vec::new();
    for outcome in outcomes {
        match outcome {
            Ok(stats) => stats
                .into_iter()
                .for_each(|(k, n)| *total.entry(k).or_insert(0) += n),
            Err(report) => failures.push(report),
        }
    }
    eprintln!(
        "simulation: {} seeds x {steps} steps in {:.1?}; answers by step kind: {total:?}",
        seeds.len(),
        started.elapsed()
    );
    if let Some(first) = failures.first() {
        panic!(
            "{} of {} seeds failed; first:\n{first}",
            failures.len(),
            seeds.len()
        );
    }
}
