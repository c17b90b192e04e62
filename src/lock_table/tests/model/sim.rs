//! Random operation sequences run against the table and the reference model step by step:
//! every step's answers must match the model's, satisfy the observer, and leave the same state.

use super::*;

pub(super) const KEYS: [&[u8]; 3] = [b"a", b"b", b"a key longer than twenty-two bytes"];
const SESSIONS: usize = 3;

#[derive(Clone, Copy, Debug)]
enum TokenPick {
    /// The key's current holder, per the model.
    Current,
    /// Some token granted earlier (maybe of another key).
    Stale(usize),
    Other(u64),
}

#[derive(Clone, Debug)]
enum Op {
    Acquire {
        session: usize,
        key: usize,
        wait_s: u8,
        lease_s: u8,
    },
    /// The session's last acquire again: same owner, key and lease.
    Resend {
        session: usize,
        wait_s: u8,
    },
    Release {
        session: usize,
        key: usize,
        token: TokenPick,
    },
    Extend {
        session: usize,
        key: usize,
        lease_s: u8,
        token: TokenPick,
    },
    /// `None`: an owner the session has queued on the key, else its last owner.
    Cancel {
        session: usize,
        key: usize,
        owner: Option<u64>,
    },
    Query {
        session: usize,
        key: usize,
    },
    Close {
        session: usize,
    },
    Advance {
        by_us: u64,
        timers: bool,
    },
    /// To the table's next deadline (or 1 µs before it), then the timers.
    ToDeadline {
        before: bool,
    },
    RaiseTokens {
        by: u64,
    },
    Shutdown,
}

/// What the model expects of a step.
enum Want {
    /// These answers in this order.
    InOrder(Vec<Seen>),
    /// These answers in an order the table chooses (shutdown).
    AnyOrder(Vec<Seen>),
    /// Whatever the model's timers produce, in any order.
    Timers,
}

/// What a step was, for the observer.
enum Step {
    Acquire {
        session: SessionId,
        owner: u64,
        key: Vec<u8>,
        waits: bool,
        lease_s: u8,
        /// When the acquire's wait ends, in µs.
        wait_end_us: u64,
    },
    Holder {
        key: Vec<u8>,
        lease_s: Option<u8>,
    },
    Cancel {
        key: Vec<u8>,
    },
    Query {
        key: Vec<u8>,
    },
    Later {
        fifo: bool,
    },
}

/// The configuration of one simulated partition.
#[derive(Clone, Debug)]
struct SimConfig {
    max_keys: usize,
    max_waiters_per_key: u32,
    max_pending: u32,
    token_step: u64,
    token_budget: Option<u64>,
    start_offset_us: u64,
}

struct Sim {
    table: LockTable,
    model: Model,
    observer: Observer,
    now_us: u64,
    sessions: [SessionId; SESSIONS],
    next_session: SessionId,
    /// Acquires with wait > 0 not answered yet, per session, as the reactor counts them.
    pending: HashMap<SessionId, u32>,
    max_pending: u32,
    next_owner: u64,
    last_acquire: HashMap<SessionId, (u64, usize, u8)>,
}

impl Sim {
    fn new(config: &SimConfig) -> Sim {
        let tokens = TokenRange {
            next: FIRST_TOKEN,
            step: config.token_step,
            limit: config.token_budget.map_or(u64::MAX / 2, |budget| {
                FIRST_TOKEN + budget * config.token_step
            }),
        };
        let table_config = TableConfig {
            max_keys: config.max_keys,
            max_waiters_per_key: config.max_waiters_per_key,
            tick_us: TICK_US,
            max_pending_per_session: config.max_pending,
        };
        let now_us = START_US + config.start_offset_us;
        Sim {
            table: LockTable::new(table_config, now_us, tokens),
            model: Model::new(table_config, tokens, KEYS.len(), now_us),
            observer: Observer::default(),
            now_us,
            sessions: [1, 2, 3],
            next_session: 4,
            pending: HashMap::new(),
            max_pending: config.max_pending,
            next_owner: 1,
            last_acquire: HashMap::new(),
        }
    }

    fn token(&self, key: usize, pick: TokenPick) -> u64 {
        let tokens = &self.observer.tokens;
        match pick {
            TokenPick::Current => self.model.held[key]
                .as_ref()
                .map_or(FIRST_TOKEN, |hold| hold.token),
            TokenPick::Stale(_) if tokens.is_empty() => 1,
            TokenPick::Stale(index) => tokens[index % tokens.len()],
            TokenPick::Other(token) => token,
        }
    }

    /// Sends an acquire from the session in `slot`. The model is told the session is at its
    /// pending limit when its unanswered waiting acquires reach it (in one partition those are
    /// exactly its queued ones, which is what the table counts itself).
    fn acquire(&mut self, slot: usize, key: usize, acquire: Acquire) -> (Want, Step) {
        let session = self.sessions[slot];
        let (index, key) = (key, KEYS[key]);
        let waits = acquire.wait_s > 0;
        let pending = self.pending.entry(session).or_default();
        let at_limit = waits && *pending >= self.max_pending;
        *pending += u32::from(waits);
        let request = Request::Acquire {
            wait_s: acquire.wait_s,
            lease_s: acquire.lease_s,
            owner: acquire.owner,
            key,
        };
        let now_us = self.now_us;
        self.table.handle_request(now_us, session, &request);
        let (owner, lease_s) = (acquire.owner, acquire.lease_s);
        let request = (acquire.wait_s, lease_s, owner);
        let want = self.model.acquire(session, index, request, at_limit);
        let want = want.into_iter().map(seen).collect();
        let key = key.to_vec();
        let step = Step::Acquire {
            session,
            owner,
            key,
            waits,
            lease_s,
            wait_end_us: now_us + u64::from(acquire.wait_s) * SECOND_US,
        };
        (Want::InOrder(want), step)
    }

    /// Release (`lease_s` None) or Extend.
    fn holder(
        &mut self,
        slot: usize,
        key: usize,
        pick: TokenPick,
        lease_s: Option<u8>,
    ) -> (Want, Step) {
        let (session, index, now_us) = (self.sessions[slot], key, self.now_us);
        let (key, token) = (KEYS[index], self.token(index, pick));
        let (request, want) = match lease_s {
            None => {
                let want = self.model.release(session, index, token);
                (Request::Release { token, key }, want)
            }
            Some(lease_s) => {
                let want = vec![self.model.extend(session, index, lease_s, token)];
                (
                    Request::Extend {
                        lease_s,
                        token,
                        key,
                    },
                    want,
                )
            }
        };
        self.table.handle_request(now_us, session, &request);
        let want = want.into_iter().map(seen).collect();
        let key = key.to_vec();
        (Want::InOrder(want), Step::Holder { key, lease_s })
    }

    fn cancel(&mut self, slot: usize, key: usize, owner: Option<u64>) -> (Want, Step) {
        let (session, index, key) = (self.sessions[slot], key, KEYS[key]);
        // Usually an owner this session has queued on the key, as a client's Cancel is.
        let mut queue = self.observer.queues.get(key).into_iter().flatten();
        let queued = queue.rfind(|entry| entry.0 == session).map(|entry| entry.1);
        let last = self.last_acquire.get(&session).map(|last| last.0);
        let guess = queued.or(last).unwrap_or(0);
        let owner = owner.map_or(guess, |owner| owner % self.next_owner);
        let request = Request::Cancel { owner, key };
        self.table.handle_request(self.now_us, session, &request);
        let want = self.model.cancel(session, index, owner);
        let want = want.into_iter().map(seen).collect();
        (Want::InOrder(want), Step::Cancel { key: key.to_vec() })
    }

    fn query(&mut self, slot: usize, key: usize) -> (Want, Step) {
        let (session, index, key) = (self.sessions[slot], key, KEYS[key]);
        let request = Request::Query { nonce: 3, key };
        self.table.handle_request(self.now_us, session, &request);
        let want = vec![seen(self.model.query(session, index, 3))];
        (Want::InOrder(want), Step::Query { key: key.to_vec() })
    }

    fn close(&mut self, slot: usize) {
        let session = self.sessions[slot];
        self.table.handle_session_closed(session);
        self.model.close_session(session);
        for queue in self.observer.queues.values_mut() {
            queue.retain(|entry| entry.0 != session);
        }
        self.pending.remove(&session);
        self.sessions[slot] = self.next_session;
        self.next_session += 1;
    }

    /// Applies `op` to the table and the model; returns what the model expects and what the
    /// observer needs to know.
    fn apply(&mut self, op: &Op) -> (Want, Step) {
        let nothing = (Want::InOrder(vec![]), Step::Later { fifo: true });
        match *op {
            Op::Acquire {
                session,
                key,
                wait_s,
                lease_s,
            } => self.fresh_acquire(session, key, wait_s, lease_s),
            Op::Resend { session, wait_s } => self.resend(session, wait_s).unwrap_or(nothing),
            Op::Release {
                session,
                key,
                token,
            } => self.holder(session, key, token, None),
            Op::Extend {
                session,
                key,
                lease_s,
                token,
            } => self.holder(session, key, token, Some(lease_s)),
            Op::Cancel {
                session,
                key,
                owner,
            } => self.cancel(session, key, owner),
            Op::Query { session, key } => self.query(session, key),
            Op::Close { session } => {
                self.close(session);
                nothing
            }
            Op::Advance { .. } | Op::ToDeadline { .. } | Op::RaiseTokens { .. } | Op::Shutdown => {
                self.apply_partition_op(op)
            }
        }
    }

    /// An acquire with a new owner from the session in `slot`, remembered for `Resend`.
    fn fresh_acquire(&mut self, slot: usize, key: usize, wait_s: u8, lease_s: u8) -> (Want, Step) {
        let owner = self.next_owner;
        self.next_owner += 1;
        self.last_acquire
            .insert(self.sessions[slot], (owner, key, lease_s));
        self.acquire(
            slot,
            key,
            Acquire {
                wait_s,
                lease_s,
                owner,
            },
        )
    }

    /// The last acquire of the session in `slot` again (same owner, key and lease), if any.
    fn resend(&mut self, slot: usize, wait_s: u8) -> Option<(Want, Step)> {
        let last = self.last_acquire.get(&self.sessions[slot]);
        let &(owner, key, lease_s) = last?;
        let acquire = Acquire {
            wait_s,
            lease_s,
            owner,
        };
        Some(self.acquire(slot, key, acquire))
    }

    /// The ops that are no session's request: time passing, timers, tokens and shutdown.
    fn apply_partition_op(&mut self, op: &Op) -> (Want, Step) {
        let nothing = (Want::InOrder(vec![]), Step::Later { fifo: true });
        let timers = (Want::Timers, Step::Later { fifo: true });
        match *op {
            Op::Advance {
                by_us,
                timers: false,
            } => {
                self.now_us += by_us;
                self.model.now_us = self.now_us;
                nothing
            }
            Op::Advance {
                by_us,
                timers: true,
            } => {
                self.now_us += by_us;
                self.model.now_us = self.now_us;
                self.table.handle_timers(self.now_us);
                timers
            }
            Op::ToDeadline { before } => {
                if let Some(deadline_us) = self.table.next_deadline_us() {
                    let target_us = deadline_us.saturating_sub(u64::from(before));
                    self.now_us = self.now_us.max(target_us);
                    self.model.now_us = self.now_us;
                }
                self.table.handle_timers(self.now_us);
                timers
            }
            Op::RaiseTokens { by } => {
                let limit = self.model.tokens.limit + by * self.model.tokens.step;
                self.table.raise_token_limit(limit);
                self.model.raise_token_limit(limit);
                nothing
            }
            Op::Shutdown => {
                self.table.handle_shutdown();
                (
                    Want::AnyOrder(self.model.shutdown().into_iter().map(seen).collect()),
                    Step::Later { fifo: false },
                )
            }
            _ => unreachable!("a session's request: {op:?}"),
        }
    }

    fn observe(&mut self, seen: &[Seen], step: Step) -> Result<(), TestCaseError> {
        let now_us = self.now_us;
        let observer = &mut self.observer;
        match step {
            Step::Acquire {
                session,
                owner,
                key,
                waits,
                lease_s,
                wait_end_us,
            } => {
                prop_assert!(seen.len() <= 1, "one answer at most: {:?}", seen);
                let Some(answer) = seen.first() else {
                    prop_assert!(waits, "an acquire with wait 0 always gets an answer");
                    prop_assert!(observer.holds.get(&key).is_some_and(|hold| !hold.2));
                    let queue = observer.queues.entry(key).or_default();
                    queue.push_back((session, owner, lease_s, wait_end_us));
                    return Ok(());
                };
                prop_assert_eq!(
                    (answer.session, answer.response.correlation_id()),
                    (session, owner)
                );
                prop_assert_eq!(answer.ends_pending, waits);
                match answer.response {
                    Response::Acquired { token, .. } => {
                        observer.grant(now_us, &key, token, lease_s)?
                    }
                    Response::Timeout { .. } | Response::Busy { .. } => {}
                    _ => prop_assert!(false, "acquire answered {:?}", answer),
                }
            }
            Step::Holder { key, lease_s } => {
                let (first, handoff) = seen.split_first().expect("release and extend answer");
                observer.holder_answer(now_us, &key, first, lease_s)?;
                for answer in handoff {
                    observer.later(now_us, answer, true)?;
                }
            }
            Step::Cancel { key } => {
                for answer in seen {
                    let is_timeout = matches!(answer.response, Response::Timeout { .. });
                    prop_assert!(is_timeout, "cancel answered {:?}", answer);
                    observer.unqueue(answer, Some(&key), false, None)?;
                }
            }
            Step::Query { key } => {
                let Response::State { held, waiters, .. } = seen[0].response else {
                    return Err(TestCaseError::fail("query not answered with Q"));
                };
                let queued = observer.queues.get(&key).map_or(0, VecDeque::len);
                prop_assert_eq!(waiters as usize, queued);
                let valid = observer.valid_holder(now_us, &key).is_some();
                prop_assert!(held || !valid, "a valid hold reported free");
            }
            Step::Later { fifo } => {
                for answer in seen {
                    observer.later(now_us, answer, fifo)?;
                }
            }
        }
        Ok(())
    }

    /// Checks after every step that do not depend on what the step was.
    /// (`drain` already ran `check_invariants` after the step; queries change nothing.)
    fn check_state(&mut self) -> Result<(), TestCaseError> {
        let model = &self.model;
        prop_assert_eq!(self.table.key_count(), model.key_count());
        prop_assert_eq!(self.table.waiter_count(), model.waiter_count());
        prop_assert_eq!(self.table.next_token(), model.tokens.next);
        let deadline_us = self.table.next_deadline_us();
        let earliest_us = model.deadlines().map(|end_us| model.fire_at(end_us)).min();
        prop_assert_eq!(deadline_us.is_some(), earliest_us.is_some());
        prop_assert!(
            deadline_us <= earliest_us,
            "poll timeout after the earliest timer"
        );
        for (index, key) in KEYS.into_iter().enumerate() {
            self.table.handle_query(self.now_us, SPECTATOR, 0, key);
            let answers = self.table.take_answers();
            prop_assert_eq!(answers.len(), 1);
            let Response::State { held, waiters, .. } = answers[0].response else {
                return Err(TestCaseError::fail("query not answered with Q"));
            };
            let modelled = model.query(SPECTATOR, index, 0).response;
            prop_assert_eq!(answers[0].response, modelled, "{:?}", key);
            let observed = self.observer.queues.get(key).map_or(0, VecDeque::len);
            prop_assert_eq!(waiters as usize, observed, "observer's queue of {:?}", key);
            // A free key has no waiters.
            prop_assert!(held || waiters == 0);
        }
        for &session in &self.sessions {
            let pending = self.pending.get(&session).copied().unwrap_or(0) as usize;
            prop_assert_eq!(
                pending,
                self.observer.queued_count(session),
                "pending of {}",
                session
            );
        }
        Ok(())
    }

    fn step(&mut self, op: &Op) -> Result<(), TestCaseError> {
        let (want, step) = self.apply(op);
        let mut got = drain(&mut self.table);
        for answer in &got {
            let live = self.sessions.contains(&answer.session);
            prop_assert!(live, "answer to a closed session: {:?}", answer);
            if answer.ends_pending {
                let pending = self.pending.get_mut(&answer.session);
                let Some(pending) = pending.filter(|count| **count > 0) else {
                    return Err(TestCaseError::fail(format!("ends no pending: {answer:?}")));
                };
                *pending -= 1;
            }
        }
        // The observer reads the answers in the order the table produced them.
        self.observe(&got, step)?;
        let (mut want, ordered) = match want {
            Want::InOrder(want) => (want, true),
            Want::AnyOrder(want) => (want, false),
            Want::Timers => {
                let index = |key: &[u8]| KEYS.iter().position(|&k| k == key);
                let granted: Vec<usize> = (got.iter())
                    .filter_map(|seen| index(seen.key.as_deref()?))
                    .collect();
                let want = self.model.timers(&granted).map_err(TestCaseError::fail)?;
                (want.into_iter().map(seen).collect(), false)
            }
        };
        if !ordered {
            got.sort_by_key(|seen| format!("{seen:?}"));
            want.sort_by_key(|seen| format!("{seen:?}"));
        }
        prop_assert_eq!(&got, &want, "at {} µs after {:?}", self.now_us, op);
        self.check_state()
    }
}

fn run_sim(
    config: &SimConfig,
    ops: &[Op],
    shutdown_at: Option<usize>,
) -> Result<(), TestCaseError> {
    let mut sim = Sim::new(config);
    for (index, op) in ops.iter().enumerate() {
        if shutdown_at == Some(index) {
            sim.step(&Op::Shutdown)?;
        }
        sim.step(op)?;
    }
    // Long enough for every wait (3 s) and every lease granted meanwhile (3 s) to run out.
    for _ in 0..16 {
        sim.step(&Op::Advance {
            by_us: 500_000,
            timers: true,
        })?;
    }
    prop_assert_eq!((sim.table.key_count(), sim.table.waiter_count()), (0, 0));
    prop_assert!(
        sim.observer.queues.values().all(VecDeque::is_empty),
        "unanswered acquires"
    );
    prop_assert!(sim.pending.values().all(|&count| count == 0));
    Ok(())
}

fn op_strategy() -> impl Strategy<Value = Op> {
    let session = 0..SESSIONS;
    let key = 0..KEYS.len();
    let seconds = 1u8..=3;
    let token = prop_oneof![
        6 => Just(TokenPick::Current),
        2 => any::<usize>().prop_map(TokenPick::Stale),
        1 => any::<u64>().prop_map(TokenPick::Other),
    ];
    let wait = prop_oneof![Just(0u8), 1u8..=3];
    let by_us = prop_oneof![0u64..2_000, 0u64..1_200_000, 1_000_000u64..4_000_000];
    prop_oneof![
        30 => (session.clone(), key.clone(), wait.clone(), seconds.clone())
            .prop_map(|(session, key, wait_s, lease_s)| Op::Acquire { session, key, wait_s, lease_s }),
        8 => (session.clone(), wait).prop_map(|(session, wait_s)| Op::Resend { session, wait_s }),
        12 => (session.clone(), key.clone(), token.clone())
            .prop_map(|(session, key, token)| Op::Release { session, key, token }),
        5 => (session.clone(), key.clone(), seconds, token)
            .prop_map(|(session, key, lease_s, token)| Op::Extend { session, key, lease_s, token }),
        8 => (session.clone(), key.clone(), prop::option::of(any::<u64>()))
            .prop_map(|(session, key, owner)| Op::Cancel { session, key, owner }),
        3 => (session.clone(), key).prop_map(|(session, key)| Op::Query { session, key }),
        3 => session.prop_map(|session| Op::Close { session }),
        25 => (by_us, prop::bool::weighted(0.85)).prop_map(|(by_us, timers)| Op::Advance { by_us, timers }),
        5 => any::<bool>().prop_map(|before| Op::ToDeadline { before }),
        2 => (1u64..20).prop_map(|by| Op::RaiseTokens { by }),
    ]
}

fn config_strategy() -> impl Strategy<Value = SimConfig> {
    let budget = prop::option::weighted(0.3, 0u64..16);
    (
        1usize..=3,
        1u32..=3,
        1u32..=3,
        1u64..=3,
        budget,
        0u64..3_000,
    )
        .prop_map(
            |(
                max_keys,
                max_waiters_per_key,
                max_pending,
                token_step,
                token_budget,
                start_offset_us,
            )| {
                SimConfig {
                    max_keys,
                    max_waiters_per_key,
                    max_pending,
                    token_step,
                    token_budget,
                    start_offset_us,
                }
            },
        )
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]

    #[test]
    fn matches_reference_model(
        config in config_strategy(),
        ops in prop::collection::vec(op_strategy(), 1..150),
        shutdown_at in prop::option::weighted(0.25, 0usize..150),
    ) {
        run_sim(&config, &ops, shutdown_at)?;
    }
}
