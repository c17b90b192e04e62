//! One seed's run: the random operations, the model's prediction of each, and the comparison of
//! both subjects with it (see `tests/queue_rules.rs`).

use crate::step::{said_of, Pick, Said, Step};
use crate::subject::{Limits, Shown, Subject};
use latchkey::lock_table::TableConfig;
use latchkey::partition::model::{Expect, Model};
use latchkey::partition::{Answer, Op as TableOp, SessionId};
use latchkey::rng::Rng;
use latchkey::tokens::TokenRange;
use latchkey_client::protocol::Response;
use std::collections::{BTreeMap, HashMap, VecDeque};
use std::fmt::Write as _;

const MS: u64 = 1000;
/// Operations kept for the failure report.
const TRACE_KEPT: usize = 60;
/// A token no subject issues and the model never holds: a release or extend with it is `N`.
const NEVER_ISSUED: u64 = u64::MAX - 7;

type Checked = Result<(), String>;

/// One seed's run.
pub struct Run {
    seed: u64,
    rng: Rng,
    keys: Vec<Vec<u8>>,
    limits: Limits,
    shards: u32,
    model: Model,
    /// Per key, the owner holding it in the model.
    model_holder: Vec<Option<u64>>,
    /// The model's tokens are its own ("logical"): per key, the last one granted and the one
    /// before it.
    last_logical: Vec<Option<u64>>,
    previous_logical: Vec<Option<u64>>,
    next_logical_token: u64,
    /// The model's grants since the last settle: key, owner, logical token, session.
    window_grants: Vec<(usize, u64, u64, SessionId)>,
    /// Keys a burst leaves alone from now on (see [`Run::unwritten_grants`]).
    frozen: Vec<bool>,
    subjects: Vec<Subject>,
    open: Vec<SessionId>,
    next_session: SessionId,
    next_owner: u64,
    /// The key each owner asked for.
    owner_key: HashMap<u64, usize>,
    shutdown_at: Option<u64>,
    trace: VecDeque<(u64, Step)>,
    step: u64,
    /// The model's answers to the steps fed since the last [`Run::finish`].
    expected: Vec<Expect>,
    /// How often each kind of step got each kind of answer: what a budget covered.
    pub stats: Stats,
}

/// Answers by kind of step and kind of answer.
pub type Stats = BTreeMap<(&'static str, char), u64>;

impl Run {
    /// Seed `seed`'s run of `steps` steps.
    pub fn new(seed: u64, steps: u64) -> Run {
        let mut rng = Rng::new(seed ^ 0x5157_5155_4555_4553);
        let key_count = rng.between(2, 5) as usize;
        let shards = rng.pick(&[1, 1, 2, 3]);
        let max_keys = match shards == 1 && rng.percent(30) {
            true => rng.between(1, key_count as u64) as usize,
            false => key_count,
        };
        let limits = Limits {
            max_keys,
            max_waiters_per_key: rng.between(1, 4) as u32,
            max_pending_per_session: rng.between(1, 4) as u32,
        };
        let keys = (0..key_count)
            .map(|k| format!("k{k}").into_bytes())
            .collect();
        // Half the seeds run off the millisecond grid: every instant and deadline is then
        // `offset_us` past a whole millisecond, where the cluster's millisecond leases round up.
        let offset_us = match rng.percent(50) {
            true => 0,
            false => rng.between(1, 999),
        };
        let start_us = 1_000_000 + offset_us;
        let (cluster, now_us) = Subject::cluster(limits, shards, key_count, start_us, seed);
        let table = Subject::table(limits, key_count, now_us);
        let config = TableConfig {
            max_keys: limits.max_keys,
            max_waiters_per_key: limits.max_waiters_per_key,
            max_pending_per_session: limits.max_pending_per_session,
            tick_us: MS,
        };
        let tokens = TokenRange {
            next: 1,
            step: 1,
            limit: u64::MAX,
        };
        let sessions = rng.between(1, 3);
        Run {
            seed,
            keys,
            limits,
            shards,
            model: Model::new(config, tokens, key_count, now_us),
            model_holder: vec![None; key_count],
            last_logical: vec![None; key_count],
            previous_logical: vec![None; key_count],
            next_logical_token: 1,
            window_grants: Vec::new(),
            frozen: vec![false; key_count],
            subjects: vec![table, cluster],
            open: (1..=sessions).collect(),
            next_session: sessions + 1,
            next_owner: 1,
            owner_key: HashMap::new(),
            shutdown_at: rng.percent(25).then(|| steps - rng.below(steps / 8 + 1)),
            rng,
            trace: VecDeque::new(),
            step: 0,
            expected: Vec::new(),
            stats: Stats::new(),
        }
    }

    /// Runs `steps` random steps, each checked.
    pub fn steps(&mut self, steps: u64) -> Checked {
        for _ in 0..steps {
            self.step += 1;
            if self.shutdown_at != Some(self.step) && self.rng.percent(15) {
                self.burst()?;
            } else {
                let step = self.random_step();
                self.run_step(step)?;
            }
        }
        Ok(())
    }

    /// The seed's parameters and its last steps.
    pub fn report(&self) -> String {
        let mut out = format!(
            "seed {}: {} keys, {} shard(s), {:?}; failed at step {}; last steps (time µs):\n",
            self.seed,
            self.keys.len(),
            self.shards,
            self.limits,
            self.step
        );
        for (now_us, step) in &self.trace {
            let _ = writeln!(out, "  {now_us} {step:?}");
        }
        let _ = writeln!(out, "model holders {:?}, holds:", self.model_holder);
        for (key, held) in self.model.held.iter().enumerate() {
            let _ = writeln!(out, "  key {key}: {held:?}");
        }
        out
    }

    // ----- random steps ----------------------------------------------------------------------

    fn random_step(&mut self) -> Step {
        if self.shutdown_at == Some(self.step) {
            return Step::Shutdown;
        }
        let session = self.open[self.rng.below(self.open.len() as u64) as usize];
        let key = self.rng.below(self.keys.len() as u64) as usize;
        match self.rng.below(100) {
            0..=21 => self.random_advance(),
            22..=61 => self.random_acquire(session, key),
            62..=74 => Step::Release {
                session,
                key,
                token: self.random_pick(80),
            },
            75..=81 => Step::Extend {
                session,
                key,
                lease_s: self.rng.between(1, 3) as u8,
                token: self.random_pick(75),
            },
            82..=90 => self.random_cancel(session, key),
            91..=95 => Step::Query {
                session,
                key,
                nonce: self.rng.next_u64() >> 8,
            },
            _ => Step::Close { session },
        }
    }

    fn random_pick(&mut self, holder_percent: u64) -> Pick {
        match (self.rng.percent(holder_percent), self.rng.percent(70)) {
            (true, _) => Pick::Holder,
            (false, true) => Pick::Old,
            (false, false) => Pick::Never,
        }
    }

    fn random_cancel(&mut self, session: SessionId, key: usize) -> Step {
        let queued = self.model.queued_owners(session, key);
        let owner = match queued.is_empty() || self.rng.percent(20) {
            true => self.rng.between(1, self.next_owner),
            false => self.rng.pick(&queued),
        };
        Step::Cancel {
            session,
            key,
            owner,
        }
    }

    fn random_acquire(&mut self, session: SessionId, key: usize) -> Step {
        let wait_s = match self.rng.percent(35) {
            true => 0,
            false => self.rng.between(1, 3) as u8,
        };
        let queued = self.model.queued_owners(session, key);
        // A resend: the same owner queued twice on one key of one session.
        let owner = match !queued.is_empty() && self.rng.percent(8) {
            true => self.rng.pick(&queued),
            false => {
                self.next_owner += 1;
                self.next_owner
            }
        };
        Step::Acquire {
            session,
            key,
            wait_s,
            lease_s: self.rng.between(1, 3) as u8,
            owner,
        }
    }

    /// Time moves by whole milliseconds: to the next deadline, just before or after it, or by
    /// a random span. Off the millisecond grid, never exactly to a deadline: the table's 1 ms
    /// tick fires it at the next whole millisecond, the cluster's wait timers at once (both
    /// within docs/protocol.md §3.5: never early, at most a tick late).
    fn random_advance(&mut self) -> Step {
        let now_us = self.model.now_us;
        let next = self.model.deadlines().filter(|&d| d > now_us).min();
        let on_grid = now_us % MS == 0;
        let to_us = match (next, self.rng.below(8)) {
            (Some(next), 0 | 1) if on_grid => next,
            (Some(next), 0 | 1) => next + MS,
            (Some(next), 2) => next - MS,
            (Some(next), 3) => next + MS,
            (_, 4) => now_us + self.rng.between(200, 2_500) * MS,
            (_, 5) if self.rng.percent(20) => now_us + self.rng.between(3_000, 9_000) * MS,
            _ => now_us + self.rng.between(1, 40) * MS,
        };
        let mut to_us = to_us.max(now_us + MS);
        while !on_grid && self.model.deadlines().any(|deadline| deadline == to_us) {
            to_us += MS;
        }
        Step::Advance { to_us }
    }

    /// A burst: a few requests at one instant (after time moved, sometimes), fed without
    /// settling in between, so that the cluster decides each with entries of the ones before
    /// it in flight; the answers are compared together. Left out are the requests whose
    /// outcome the docs let differ while an entry is in flight: an acquire of a key a release
    /// or expiry in flight frees (the cluster answers from its applied state: `T`, or a queued
    /// wait, where the model frees the key at once — docs/cluster-design.md), with `max_keys`
    /// binding an acquire of a free key once a key was freed, a release or extend naming a
    /// token granted within the burst (not known before its `A`), queries (served at a later
    /// read index), shutdown (an acquire in flight is not yet granted: the cluster answers `B`
    /// and releases its grant, where the model granted at once), and anything after a session
    /// closed with grants not yet delivered (see [`Run::unwritten_grants`]).
    fn burst(&mut self) -> Checked {
        let keys = self.keys.len();
        let mut acquirable = vec![true; keys];
        // With `max_keys` binding, the cluster counts a hold until its end applies, where the
        // model has room at once: no new key after a key was freed in the burst.
        let capped = self.limits.max_keys < keys;
        if self.rng.percent(40) {
            let token = |model: &Model, key: usize| model.held[key].as_ref().map(|h| h.token);
            let before: Vec<Option<u64>> = (0..keys).map(|k| token(&self.model, k)).collect();
            let step = self.random_advance();
            self.feed(step)?;
            for key in 0..keys {
                acquirable[key] = before[key].is_none() || self.model.held[key].is_some();
            }
        }
        let mut new_keys = !capped || acquirable.iter().all(|&ok| ok);
        for _ in 0..self.rng.between(2, 6) {
            let held = |key: usize| self.model.held[key].is_some();
            let allowed: Vec<bool> = (0..keys)
                .map(|key| acquirable[key] && (new_keys || held(key)))
                .collect();
            let Some(step) = self.burst_step(&allowed) else {
                continue;
            };
            if let Step::Release { key, token, .. } = step {
                let queue = self.model.held[key].as_ref().map(|h| h.queue.len());
                let frees = token == Pick::Holder && queue == Some(0);
                acquirable[key] &= !frees;
                new_keys &= !(capped && frees);
            }
            self.feed(step)?;
            // A close released grants not yet delivered: the next grants of their keys are
            // in flight in the cluster behind those releases (with their waiters' places
            // still counted, and the released holds too): the burst ends there.
            if self.frozen.contains(&true) {
                break;
            }
        }
        self.finish()
    }

    /// A request for a burst that keeps to the burst's rules (see [`Run::burst`]).
    fn burst_step(&mut self, acquirable: &[bool]) -> Option<Step> {
        for _ in 0..10 {
            let session = self.open[self.rng.below(self.open.len() as u64) as usize];
            let key = self.rng.below(self.keys.len() as u64) as usize;
            let token = self.random_pick(70);
            if self.frozen[key] {
                continue;
            }
            let step = match self.rng.below(100) {
                0..=4 => Step::Close { session },
                5..=54 if acquirable[key] => self.random_acquire(session, key),
                55..=69 if self.known(key, token) => Step::Release {
                    session,
                    key,
                    token,
                },
                70..=79 if self.known(key, token) => Step::Extend {
                    session,
                    key,
                    lease_s: self.rng.between(1, 3) as u8,
                    token,
                },
                // A cancel of an acquire whose grant is in flight (the entry decides it).
                80..=87 if !self.window_grants.is_empty() => {
                    let grants = &self.window_grants;
                    let (key, owner, _, session) =
                        grants[self.rng.below(grants.len() as u64) as usize];
                    if self.frozen[key] {
                        continue;
                    }
                    Step::Cancel {
                        session,
                        key,
                        owner,
                    }
                }
                88.. => self.random_cancel(session, key),
                _ => continue,
            };
            return Some(step);
        }
        None
    }

    /// Whether every subject knows the token `pick` names for `key` (its grant was answered):
    /// a token granted within a burst is not known before the burst settles.
    fn known(&self, key: usize, pick: Pick) -> bool {
        self.logical_token(key, pick).map_or(true, |logical| {
            let subjects = self.subjects.iter();
            subjects
                .clone()
                .all(|s| s.by_logical.contains_key(&logical))
        })
    }

    // ----- one step --------------------------------------------------------------------------

    /// One step: fed to the model and the subjects, then settled and compared.
    fn run_step(&mut self, step: Step) -> Checked {
        self.feed(step)?;
        self.finish()
    }

    /// Feeds `step` to the model and to every subject, without settling: its answers are
    /// compared by [`Run::finish`], with those of the other steps of its burst.
    fn feed(&mut self, step: Step) -> Checked {
        if self.trace.len() == TRACE_KEPT {
            self.trace.pop_front();
        }
        self.trace.push_back((self.model.now_us, step));
        if let Step::Acquire { owner, key, .. } = step {
            self.owner_key.insert(owner, key);
        }
        // Tokens are picked from the model's state before the step changes it.
        let tokens: Vec<Option<u64>> = match step {
            Step::Release { key, token, .. } | Step::Extend { key, token, .. } => {
                let subjects = self.subjects.iter();
                subjects
                    .map(|s| Some(self.subject_token(s, key, token)))
                    .collect()
            }
            _ => vec![None; self.subjects.len()],
        };
        let expected = self.predict(step)?;
        for said in &expected {
            let kind = said_of(said.session, &said.response, said.ends_pending)?.1;
            *self.stats.entry((step.name(), kind)).or_default() += 1;
        }
        let now_us = self.model.now_us;
        let mut subjects = std::mem::take(&mut self.subjects);
        for (subject, token) in subjects.iter_mut().zip(tokens) {
            self.send(subject, step, now_us, token);
            subject.sent.extend(token);
        }
        self.subjects = subjects;
        for grant in expected.iter().filter(|e| e.key.is_some()) {
            let key = grant.key.expect("a grant names its key");
            if let Response::Acquired { owner, .. } = grant.response {
                let logical = self.next_logical_token;
                self.next_logical_token += 1;
                self.model.set_token(key, logical)?;
                self.model_holder[key] = Some(owner);
                self.previous_logical[key] = self.last_logical[key].replace(logical);
                self.window_grants
                    .push((key, owner, logical, grant.session));
            }
        }
        for (key, held) in self.model.held.iter().enumerate() {
            if held.is_none() {
                self.model_holder[key] = None;
            }
        }
        self.expected.extend(expected);
        Ok(())
    }

    /// Settles every subject, compares its answers since the last call with the model's, and
    /// then every subject's state.
    fn finish(&mut self) -> Checked {
        let now_us = self.model.now_us;
        let expected = std::mem::take(&mut self.expected);
        let mut subjects = std::mem::take(&mut self.subjects);
        let checked = subjects
            .iter_mut()
            .try_for_each(|subject| self.check_subject(subject, now_us, &expected));
        self.subjects = subjects;
        checked?;
        self.window_grants.clear();
        self.frozen.fill(false);
        self.check_states()
    }

    /// The model's answers to `step` (it moves the model's clock for `Advance`).
    fn predict(&mut self, step: Step) -> Result<Vec<Expect>, String> {
        let model = &mut self.model;
        Ok(match step {
            Step::Advance { to_us } => {
                model.now_us = to_us;
                // Tokens never run out here: which keys get one is never in question.
                model.timers(&[])?
            }
            Step::Acquire {
                session,
                key,
                wait_s,
                lease_s,
                owner,
            } => {
                let queued: usize = (0..self.keys.len())
                    .map(|k| model.queued_owners(session, k).len())
                    .sum();
                let at_limit = queued >= self.limits.max_pending_per_session as usize;
                model.acquire(session, key, (wait_s, lease_s, owner), at_limit)
            }
            Step::Release {
                session,
                key,
                token,
            } => {
                let token = self.model_token(key, token);
                self.model.release(session, key, token)
            }
            Step::Extend {
                session,
                key,
                lease_s,
                token,
            } => {
                let token = self.model_token(key, token);
                vec![self.model.extend(session, key, lease_s, token)]
            }
            Step::Cancel {
                session,
                key,
                owner,
            } => model.cancel(session, key, owner),
            Step::Query {
                session,
                key,
                nonce,
            } => vec![model.query(session, key, nonce)],
            Step::Close { session } => {
                self.model.close_session(session);
                let expected = self.unwritten_grants(session)?;
                self.open.retain(|&open| open != session);
                self.open.push(self.next_session);
                self.next_session += 1;
                expected
            }
            Step::Shutdown => model.shutdown(),
        })
    }

    /// `session` closes with grants of this window not answered yet (a burst's, in flight in
    /// the cluster): as docs/protocol.md §3.2 says for a grant whose session is known closed
    /// before its `A` is written, the server releases it itself (the subjects do it in
    /// `Subject::close`, with `release_granted`), and the `A` is never seen. The key's next
    /// grant is then in flight in the cluster behind that release, so the key is marked
    /// `frozen` and the burst ends. Returns the answers of those releases (the handoffs).
    fn unwritten_grants(&mut self, session: SessionId) -> Result<Vec<Expect>, String> {
        let mut expected = Vec::new();
        let grants = std::mem::take(&mut self.window_grants);
        let (unwritten, kept) = grants.into_iter().partition(|grant| grant.3 == session);
        self.window_grants = kept;
        for (key, owner, logical, _) in unwritten {
            let answer = self.expected.iter().position(|e| {
                e.session == session
                    && e.key == Some(key)
                    && matches!(e.response, Response::Acquired { owner: o, .. } if o == owner)
            });
            self.expected
                .remove(answer.ok_or("an unwritten grant the model never made")?);
            self.frozen[key] = true;
            let released = self.model.release(session, key, logical);
            let handoffs = released.into_iter();
            expected.extend(handoffs.filter(|e| !matches!(e.response, Response::Released { .. })));
        }
        Ok(expected)
    }

    /// The model's token `pick` names for `key`, if any.
    fn logical_token(&self, key: usize, pick: Pick) -> Option<u64> {
        let holder = self.model.held[key].as_ref().map(|held| held.token);
        match pick {
            Pick::Holder => holder,
            Pick::Old if holder.is_some() => self.previous_logical[key],
            Pick::Old => self.last_logical[key],
            Pick::Never => None,
        }
    }

    /// The token the model is given.
    fn model_token(&self, key: usize, pick: Pick) -> u64 {
        self.logical_token(key, pick).unwrap_or(NEVER_ISSUED)
    }

    /// The token `subject` is given: its own for the grant the model's token stands for.
    fn subject_token(&self, subject: &Subject, key: usize, pick: Pick) -> u64 {
        let logical = self.logical_token(key, pick);
        let token = logical.and_then(|logical| subject.by_logical.get(&logical).copied());
        token.unwrap_or(NEVER_ISSUED)
    }

    /// Hands `step` to `subject` (`token`: for a release or extend).
    fn send(&self, subject: &mut Subject, step: Step, now_us: u64, token: Option<u64>) {
        let key_of = |key: usize| self.keys[key].as_slice();
        let token = token.unwrap_or(NEVER_ISSUED);
        match step {
            Step::Advance { to_us } => subject.partition().handle_timers(to_us),
            Step::Acquire {
                session,
                key,
                wait_s,
                lease_s,
                owner,
            } => {
                let op = TableOp::Acquire {
                    wait_s,
                    lease_s,
                    owner,
                };
                subject.send(now_us, session, op, key_of(key))
            }
            Step::Release { session, key, .. } => {
                subject.send(now_us, session, TableOp::Release { token }, key_of(key))
            }
            Step::Extend {
                session,
                key,
                lease_s,
                ..
            } => {
                let op = TableOp::Extend { lease_s, token };
                subject.send(now_us, session, op, key_of(key))
            }
            Step::Cancel {
                session,
                key,
                owner,
            } => subject.send(now_us, session, TableOp::Cancel { owner }, key_of(key)),
            Step::Query {
                session,
                key,
                nonce,
            } => subject.send(now_us, session, TableOp::Query { nonce }, key_of(key)),
            Step::Close { session } => subject.close(now_us, session),
            Step::Shutdown => subject.partition().handle_shutdown(),
        }
    }

    /// Settles `subject` at `now_us` and compares its answers with `expected`; records its
    /// grants.
    fn check_subject(&self, subject: &mut Subject, now_us: u64, expected: &[Expect]) -> Checked {
        let answers = subject.settle(now_us)?;
        let name = subject.name;
        let mut said: Vec<Said> = answers
            .iter()
            .map(|answer| said_of(answer.session, &answer.response, answer.ends_pending))
            .collect::<Result<_, _>>()
            .map_err(|e| format!("{name}: {e}"))?;
        let mut predicted: Vec<Said> = expected
            .iter()
            .map(|e| said_of(e.session, &e.response, e.ends_pending))
            .collect::<Result<_, _>>()?;
        // `Q` of a cluster off the millisecond grid: its lease, rounded up to whole
        // milliseconds, reads one more than the model's (never less).
        for (_, kind, nonce, _, state) in said.iter_mut() {
            let Some((_, lease_ms, _)) = state else {
                continue;
            };
            let same = |p: &&Said| p.1 == *kind && p.2 == *nonce;
            let model_ms = predicted.iter().find(same).and_then(|p| p.4).map(|q| q.1);
            if subject.lease_slack_us > 0 && *lease_ms > 0 && model_ms == Some(*lease_ms - 1) {
                *lease_ms -= 1;
            }
        }
        said.sort_unstable();
        predicted.sort_unstable();
        if said != predicted {
            return Err(format!(
                "{name} answered {said:?}, the model {predicted:?}\n  {name}'s answers: \
                 {answers:?}"
            ));
        }
        let mut sent = std::mem::take(&mut subject.sent);
        for answer in &answers {
            self.record_answer(subject, answer, &mut sent)?;
        }
        Ok(())
    }

    /// Checks the tokens of one answer and records a grant.
    fn record_answer(
        &self,
        subject: &mut Subject,
        answer: &Answer,
        sent: &mut Vec<u64>,
    ) -> Checked {
        let name = subject.name;
        match answer.response {
            Response::Released { token }
            | Response::Extended { token }
            | Response::NotHeld { token } => {
                let Some(at) = sent.iter().position(|&sent| sent == token) else {
                    return Err(format!("{name}: {answer:?}, tokens sent {sent:?}"));
                };
                sent.swap_remove(at);
            }
            Response::Acquired { owner, token } => {
                let key = self.key_of_grant(owner)?;
                if token <= subject.last[key] {
                    return Err(format!(
                        "{name}: token {token} of key {key} after {}",
                        subject.last[key]
                    ));
                }
                subject.last[key] = token;
                let grants = self.window_grants.iter();
                let mut logical = grants.filter(|g| g.0 == key && g.1 == owner).map(|g| g.2);
                let logical = logical.next().ok_or("an `A` the model did not grant")?;
                subject.by_logical.insert(logical, token);
            }
            _ => {}
        }
        Ok(())
    }

    /// The key an `A` for `owner` granted: owners are unique but for resends on one key.
    fn key_of_grant(&self, owner: u64) -> Result<usize, String> {
        let key = self.owner_key.get(&owner).copied();
        key.ok_or_else(|| format!("a grant to owner {owner}, who never asked"))
    }

    /// Every subject holds what the model holds, with the same queues and leases.
    fn check_states(&mut self) -> Checked {
        let now_us = self.model.now_us;
        let model: Vec<Option<Shown>> = (0..self.keys.len())
            .map(|key| {
                let held = self.model.held[key].as_ref()?;
                Some(Shown {
                    owner: self.model_holder[key].expect("a holder for every held key"),
                    waiters: held.queue.len() as u32,
                    lease_left_us: held.lease_end_us.saturating_sub(now_us),
                })
            })
            .collect();
        let waiters = self.model.waiter_count();
        for subject in &self.subjects {
            let (shown, subject_waiters) = subject.shown(now_us, &self.keys);
            let name = subject.name;
            if subject_waiters != waiters {
                return Err(format!(
                    "{name} has {subject_waiters} waiters, the model {waiters}"
                ));
            }
            for (key, (shown, model)) in shown.iter().zip(&model).enumerate() {
                let agree = match (shown, model) {
                    (None, None) => true,
                    (Some(shown), Some(model)) => {
                        let lease = shown.lease_left_us.checked_sub(model.lease_left_us);
                        shown.owner == model.owner
                            && shown.waiters == model.waiters
                            && lease.is_some_and(|more| more <= subject.lease_slack_us)
                    }
                    _ => false,
                };
                if !agree {
                    return Err(format!(
                        "key {key}: {name} shows {shown:?}, the model {model:?}"
                    ));
                }
            }
        }
        Ok(())
    }
}
