//! The reference model of one partition: the rules of docs/protocol.md §3 written plainly
//! (vectors and deques, no wheel, no intrusive lists, time as deadlines), against which the
//! lock table's tests (`lock_table/tests/model/`, `tests/simulation.rs`) and the waiting rules
//! of both partitions (`tests/queue_rules.rs`) are checked. Built for tests only
//! (`cfg(test)` or the `testing` feature).
//!
//! It predicts the answers of each request and of each `handle_timers` call. Keys are indices
//! into the driver's key list. A grant's token is the partition's next one, issued from the
//! model's own [`TokenRange`] as the table issues from its; a driver whose subject numbers its
//! tokens otherwise (the cluster's come from log indices) records the subject's token with
//! [`Model::set_token`], so that later releases and extends are judged by it.
//!
//! Time follows the table's rules: a deadline fires at the first tick that starts at or after
//! it (never early, at most one tick late), and the partition sees time once per loop
//! iteration, so everything due at that instant is due together: waits first (a waiter whose
//! wait ran out is not granted), then leases.

use crate::lock_table::TableConfig;
use crate::partition::SessionId;
use crate::tokens::TokenRange;
use latchkey_client::protocol::Response;
use std::collections::VecDeque;

const MICROS_PER_SECOND: u64 = 1_000_000;

/// A queued acquire.
#[derive(Clone, Copy, Debug)]
pub struct Waiter {
    /// The acquire's owner.
    pub owner: u64,
    /// The session that sent it.
    pub session: SessionId,
    /// Lease on grant.
    pub lease_s: u8,
    /// When its wait runs out.
    pub wait_end_us: u64,
    /// Enqueue order across the whole run, to check FIFO.
    pub seq: u64,
}

/// A held key.
#[derive(Debug)]
pub struct Held {
    /// The holder's token.
    pub token: u64,
    /// When the lease runs out.
    pub lease_end_us: u64,
    /// Waiters, oldest first.
    pub queue: VecDeque<Waiter>,
}

/// One answer the model predicts.
#[derive(Clone, Copy, Debug)]
pub struct Expect {
    /// Who gets it.
    pub session: SessionId,
    /// The frame.
    pub response: Response,
    /// Whether it answers an acquire with wait > 0.
    pub ends_pending: bool,
    /// For a grant: the key granted.
    pub key: Option<usize>,
}

/// One partition's state as the contract describes it.
pub struct Model {
    /// The clock, moved by the simulation.
    pub now_us: u64,
    /// Tick length in microseconds.
    pub tick_us: u64,
    max_keys: usize,
    max_waiters: usize,
    /// Held keys by key index.
    pub held: Vec<Option<Held>>,
    /// The tokens the partition may still issue.
    pub tokens: TokenRange,
    shutting_down: bool,
    next_seq: u64,
}

fn expect(session: SessionId, response: Response, ends_pending: bool) -> Expect {
    Expect {
        session,
        response,
        ends_pending,
        key: None,
    }
}

fn seconds(s: u8) -> u64 {
    u64::from(s) * MICROS_PER_SECOND
}

impl Model {
    /// An empty partition of `keys` keys.
    pub fn new(config: TableConfig, tokens: TokenRange, keys: usize, now_us: u64) -> Model {
        Model {
            now_us,
            tick_us: config.tick_us,
            max_keys: config.max_keys,
            max_waiters: config.max_waiters_per_key as usize,
            held: (0..keys).map(|_| None).collect(),
            tokens,
            shutting_down: false,
            next_seq: 0,
        }
    }

    /// The first instant a timer for `deadline_us` may fire: the start of its tick.
    pub fn fire_at(&self, deadline_us: u64) -> u64 {
        deadline_us.div_ceil(self.tick_us) * self.tick_us
    }

    /// Whether a timer for `deadline_us` fires at the current time.
    pub fn due(&self, deadline_us: u64) -> bool {
        self.fire_at(deadline_us) <= self.now_us / self.tick_us * self.tick_us
    }

    /// Every live deadline: leases and waits.
    pub fn deadlines(&self) -> impl Iterator<Item = u64> + '_ {
        self.held.iter().flatten().flat_map(|held| {
            let waits = held.queue.iter().map(|waiter| waiter.wait_end_us);
            std::iter::once(held.lease_end_us).chain(waits)
        })
    }

    /// Held keys.
    pub fn key_count(&self) -> usize {
        self.held.iter().flatten().count()
    }

    /// Queued acquires.
    pub fn waiter_count(&self) -> usize {
        self.held
            .iter()
            .flatten()
            .map(|held| held.queue.len())
            .sum()
    }

    /// Owners `session` has queued on `key`.
    pub fn queued_owners(&self, session: SessionId, key: usize) -> Vec<u64> {
        let queue = self.held[key].iter().flat_map(|held| held.queue.iter());
        let mine = queue.filter(|waiter| waiter.session == session);
        mine.map(|waiter| waiter.owner).collect()
    }

    /// Records the token the subject chose for the grant of `key` (when it numbers its
    /// tokens otherwise than the model).
    pub fn set_token(&mut self, key: usize, token: u64) -> Result<(), String> {
        let held = self.held[key]
            .as_mut()
            .ok_or("a grant of a key the model frees")?;
        held.token = token;
        Ok(())
    }

    /// Acquire (matrix row 1 and 2, and the capacity rules).
    pub fn acquire(
        &mut self,
        session: SessionId,
        key: usize,
        (wait_s, lease_s, owner): (u8, u8, u64),
        pending_at_limit: bool,
    ) -> Vec<Expect> {
        let waits = wait_s > 0;
        let answer = |response| vec![expect(session, response, waits)];
        if self.shutting_down {
            return answer(Response::Busy { owner });
        }
        let key_count = self.key_count();
        let now_us = self.now_us;
        let Some(held) = self.held[key].as_mut() else {
            let token = (key_count < self.max_keys).then(|| self.tokens.issue());
            let Some(token) = token.flatten() else {
                return answer(Response::Busy { owner });
            };
            self.held[key] = Some(Held {
                token,
                lease_end_us: now_us + seconds(lease_s),
                queue: VecDeque::new(),
            });
            let mut grant = expect(session, Response::Acquired { owner, token }, waits);
            grant.key = Some(key);
            return vec![grant];
        };
        if !waits {
            return answer(Response::Timeout { owner });
        }
        if held.queue.len() >= self.max_waiters || pending_at_limit {
            return answer(Response::Busy { owner });
        }
        self.next_seq += 1;
        held.queue.push_back(Waiter {
            owner,
            session,
            lease_s,
            wait_end_us: now_us + seconds(wait_s),
            seq: self.next_seq,
        });
        Vec::new()
    }

    /// Release: `R` and the handoff when `token` holds `key`, else `N`.
    pub fn release(&mut self, session: SessionId, key: usize, token: u64) -> Vec<Expect> {
        if !self.held[key]
            .as_ref()
            .is_some_and(|held| held.token == token)
        {
            return vec![expect(session, Response::NotHeld { token }, false)];
        }
        let mut expected = vec![expect(session, Response::Released { token }, false)];
        self.hand_off(key, &mut expected);
        expected
    }

    /// The holder of `key` is gone: grant the queue head (`B` to heads while no token is
    /// left), or free the key.
    fn hand_off(&mut self, key: usize, expected: &mut Vec<Expect>) {
        let now_us = self.now_us;
        let held = self.held[key].as_mut().expect("handing off a held key");
        while let Some(head) = held.queue.pop_front() {
            let Some(token) = self.tokens.issue() else {
                let busy = Response::Busy { owner: head.owner };
                expected.push(expect(head.session, busy, true));
                continue;
            };
            held.token = token;
            held.lease_end_us = now_us + seconds(head.lease_s);
            let granted = Response::Acquired {
                owner: head.owner,
                token,
            };
            let mut grant = expect(head.session, granted, true);
            grant.key = Some(key);
            expected.push(grant);
            return;
        }
        self.held[key] = None;
    }

    /// Extend: `E` and a new lease from now when `token` holds `key`, else `N`.
    pub fn extend(&mut self, session: SessionId, key: usize, lease_s: u8, token: u64) -> Expect {
        let now_us = self.now_us;
        match self.held[key].as_mut() {
            Some(held) if held.token == token => {
                held.lease_end_us = now_us + seconds(lease_s);
                expect(session, Response::Extended { token }, false)
            }
            _ => expect(session, Response::NotHeld { token }, false),
        }
    }

    /// Cancel: every acquire of `session` queued on `key` with `owner` leaves with `T`.
    pub fn cancel(&mut self, session: SessionId, key: usize, owner: u64) -> Vec<Expect> {
        let mut expected = Vec::new();
        if let Some(held) = self.held[key].as_mut() {
            held.queue.retain(|waiter| {
                let withdrawn = waiter.session == session && waiter.owner == owner;
                if withdrawn {
                    expected.push(expect(session, Response::Timeout { owner }, true));
                }
                !withdrawn
            });
        }
        expected
    }

    /// Query: held, lease left in whole milliseconds, waiters. A free key has no waiters.
    pub fn query(&self, session: SessionId, key: usize, nonce: u64) -> Expect {
        let response = match self.held[key].as_ref() {
            None => Response::State {
                nonce,
                held: false,
                lease_ms: 0,
                waiters: 0,
            },
            Some(held) => {
                let left_ms = held.lease_end_us.saturating_sub(self.now_us) / 1000;
                Response::State {
                    nonce,
                    held: true,
                    lease_ms: u32::try_from(left_ms).unwrap_or(u32::MAX),
                    waiters: held.queue.len() as u32,
                }
            }
        };
        expect(session, response, false)
    }

    /// A session closed: its waiters leave silently (their owners are returned); its holds
    /// stay.
    pub fn close_session(&mut self, session: SessionId) -> Vec<u64> {
        let mut withdrawn = Vec::new();
        for held in self.held.iter_mut().flatten() {
            held.queue.retain(|waiter| {
                if waiter.session == session {
                    withdrawn.push(waiter.owner);
                }
                waiter.session != session
            });
        }
        withdrawn
    }

    /// Shutdown: every waiter gets `B`, and so will every later acquire.
    pub fn shutdown(&mut self) -> Vec<Expect> {
        self.shutting_down = true;
        let mut expected = Vec::new();
        for held in self.held.iter_mut().flatten() {
            for waiter in held.queue.drain(..) {
                let busy = Response::Busy {
                    owner: waiter.owner,
                };
                expected.push(expect(waiter.session, busy, true));
            }
        }
        expected
    }

    /// `handle_timers` at the current time. Per key, what ran out takes effect in the order of
    /// the ends: a wait that ended before the holder's lease (or at the same instant) answers
    /// `T`; then the lease hands the key off; then the waits that ended after it answer `T`
    /// unless their waiter was just granted the key.
    ///
    /// The order in which the leases ending in one batch are handled is the table's own (the
    /// wheel's, unspecified): it decides which key gets which token and, when fewer tokens are
    /// left than contended keys, which keys still get one. `granted_keys` (the keys of the
    /// `A`s the table produced, in its order) says so: the model hands those keys off first,
    /// in that order, and they must be exactly as many as the tokens left allow.
    pub fn timers(&mut self, granted_keys: &[usize]) -> Result<Vec<Expect>, String> {
        let mut expected = Vec::new();
        let mut expiring: Vec<usize> = (0..self.held.len())
            .filter(|&key| {
                self.held[key]
                    .as_ref()
                    .is_some_and(|h| self.due(h.lease_end_us))
            })
            .collect();
        for key in 0..self.held.len() {
            let lease_end_us = self.held[key].as_ref().map(|h| h.lease_end_us);
            let ends_first = |wait_end_us: u64| match lease_end_us {
                Some(lease_end_us) if expiring.contains(&key) => wait_end_us <= lease_end_us,
                _ => true,
            };
            self.expire_waits(key, ends_first, &mut expected)?;
        }
        self.check_starved(&expiring, granted_keys)?;
        let rank = |key: &usize| granted_keys.iter().position(|granted| granted == key);
        expiring.sort_by_key(|key| rank(key).unwrap_or(usize::MAX));
        for key in expiring {
            if self.held[key].as_ref().unwrap().lease_end_us > self.now_us {
                return Err("a lease would fire early".into());
            }
            self.hand_off(key, &mut expected);
            self.expire_waits(key, |_| true, &mut expected)?;
        }
        Ok(expected)
    }

    /// Answers `T` to the waiters of `key` whose wait timer is due now and whose end passes
    /// `select`, and removes them.
    fn expire_waits(
        &mut self,
        key: usize,
        select: impl Fn(u64) -> bool,
        expected: &mut Vec<Expect>,
    ) -> Result<(), String> {
        let (now_us, tick_us) = (self.now_us, self.tick_us);
        let Some(held) = self.held[key].as_mut() else {
            return Ok(());
        };
        let due = |waiter: &Waiter| {
            waiter.wait_end_us.div_ceil(tick_us) <= now_us / tick_us && select(waiter.wait_end_us)
        };
        for waiter in held.queue.iter().filter(|waiter| due(waiter)) {
            if waiter.wait_end_us > now_us {
                return Err("a wait would fire early".into());
            }
            let timeout = Response::Timeout {
                owner: waiter.owner,
            };
            expected.push(expect(waiter.session, timeout, true));
        }
        held.queue.retain(|waiter| !due(waiter));
        Ok(())
    }

    /// When fewer tokens are left than keys among `expiring` with a waiter, the table must
    /// have granted exactly as many of those keys as tokens are left.
    fn check_starved(&self, expiring: &[usize], granted_keys: &[usize]) -> Result<(), String> {
        let contended: Vec<usize> = (expiring.iter().copied())
            .filter(|&key| self.held[key].as_ref().is_some_and(|h| !h.queue.is_empty()))
            .collect();
        let headroom = self.tokens.headroom();
        if headroom >= contended.len() as u64 {
            return Ok(());
        }
        let granted = contended.iter().filter(|key| granted_keys.contains(key));
        let granted = granted.count();
        if granted as u64 != headroom {
            return Err(format!(
                "{headroom} tokens left for {} handoffs, but {granted} granted",
                contended.len(),
            ));
        }
        Ok(())
    }

    /// More tokens may be issued (the reactor persisted a new mark).
    pub fn raise_token_limit(&mut self, limit: u64) {
        self.tokens.limit = self.tokens.limit.max(limit);
    }
}
