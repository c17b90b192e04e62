//! The reference model of one partition and the observer that checks answers alone; the
//! simulation in `sim` drives the table and the model with the same random operations.

use super::*;

mod sim;

// ---------------------------------------------------------------------------------------------
// Random operation sequences against a reference model

/// The model's queued acquire.
#[derive(Clone, Debug)]
struct ModelWaiter {
    session: SessionId,
    owner: u64,
    lease_s: u8,
    wait_end_us: u64,
}

/// The model's held key.
#[derive(Debug)]
struct ModelHold {
    token: u64,
    lease_end_us: u64,
    queue: VecDeque<ModelWaiter>,
}

/// PROTOCOL.md §3 for one partition, written plainly: a map of held keys with FIFO queues.
/// Timers fire at the first tick at or after their end, in the order of their ends.
struct Model {
    config: TableConfig,
    holds: BTreeMap<Vec<u8>, ModelHold>,
    next_token: u64,
    token_step: u64,
    token_limit: u64,
    shutting_down: bool,
}

impl Model {
    fn issue(&mut self) -> Option<u64> {
        let token = self.next_token;
        (token <= self.token_limit).then(|| {
            self.next_token += self.token_step;
            token
        })
    }

    fn acquire(
        &mut self,
        now_us: u64,
        session: SessionId,
        acquire: Acquire,
        key: &[u8],
        at_limit: bool,
    ) -> Vec<Seen> {
        let Acquire {
            wait_s,
            lease_s,
            owner,
        } = acquire;
        let waits = wait_s > 0;
        if self.shutting_down {
            return vec![busy(session, owner, waits)];
        }
        let room = self.holds.len() < self.config.max_keys;
        let Some(hold) = self.holds.get_mut(key) else {
            let Some(token) = room.then(|| self.issue()).flatten() else {
                return vec![busy(session, owner, waits)];
            };
            let lease_end_us = now_us + u64::from(lease_s) * SECOND_US;
            let queue = VecDeque::new();
            let hold = ModelHold {
                token,
                lease_end_us,
                queue,
            };
            self.holds.insert(key.to_vec(), hold);
            return vec![granted(session, owner, token, waits, key)];
        };
        if !waits {
            return vec![timeout(session, owner, false)];
        }
        if hold.queue.len() >= self.config.max_waiters_per_key as usize || at_limit {
            return vec![busy(session, owner, true)];
        }
        let wait_end_us = now_us + u64::from(wait_s) * SECOND_US;
        hold.queue.push_back(ModelWaiter {
            session,
            owner,
            lease_s,
            wait_end_us,
        });
        vec![]
    }

    fn holds_with(&self, key: &[u8], token: u64) -> bool {
        self.holds.get(key).is_some_and(|hold| hold.token == token)
    }

    fn release(&mut self, now_us: u64, session: SessionId, token: u64, key: &[u8]) -> Vec<Seen> {
        if !self.holds_with(key, token) {
            return vec![said(session, Response::NotHeld { token }, false)];
        }
        let mut out = vec![said(session, Response::Released { token }, false)];
        self.end_hold(now_us, key, &mut out);
        out
    }

    fn extend(
        &mut self,
        now_us: u64,
        session: SessionId,
        lease_s: u8,
        token: u64,
        key: &[u8],
    ) -> Vec<Seen> {
        if !self.holds_with(key, token) {
            return vec![said(session, Response::NotHeld { token }, false)];
        }
        let hold = self.holds.get_mut(key).expect("held");
        hold.lease_end_us = now_us + u64::from(lease_s) * SECOND_US;
        vec![said(session, Response::Extended { token }, false)]
    }

    fn cancel(&mut self, session: SessionId, owner: u64, key: &[u8]) -> Vec<Seen> {
        let mut out = Vec::new();
        if let Some(hold) = self.holds.get_mut(key) {
            hold.queue.retain(|waiter| {
                let hit = waiter.session == session && waiter.owner == owner;
                if hit {
                    out.push(timeout(session, owner, true));
                }
                !hit
            });
        }
        out
    }

    fn state(&self, now_us: u64, key: &[u8]) -> (bool, u32, u32) {
        match self.holds.get(key) {
            None => (false, 0, 0),
            Some(hold) => {
                let lease_ms = hold.lease_end_us.saturating_sub(now_us) / 1000;
                (true, lease_ms as u32, hold.queue.len() as u32)
            }
        }
    }

    fn close(&mut self, session: SessionId) {
        for hold in self.holds.values_mut() {
            hold.queue.retain(|waiter| waiter.session != session);
        }
    }

    fn shutdown(&mut self) -> Vec<Seen> {
        self.shutting_down = true;
        let queues = self
            .holds
            .values_mut()
            .flat_map(|hold| hold.queue.drain(..));
        queues
            .map(|waiter| busy(waiter.session, waiter.owner, true))
            .collect()
    }

    /// Runs the timers. Per key, what ran out takes effect in the order of the ends (waits
    /// first on a tie): waits that ended before the lease answer `T`, then the lease hands
    /// off, then the later waits of those still queued answer `T`. The order in which leases
    /// ending in one batch are handled is the table's own (by their ends, then the wheel's);
    /// it decides which key gets which token and, when the tokens run out mid-batch, which
    /// keys still get a grant. `granted_first` are the keys the table granted, in its order:
    /// the model handles those leases first, in that order.
    fn timers(&mut self, now_us: u64, granted_first: &[Vec<u8>]) -> Vec<Seen> {
        let now_tick = now_us / self.config.tick_us;
        let tick_us = self.config.tick_us;
        let due = |end_us: u64| end_us.div_ceil(tick_us) <= now_tick;
        let mut out = Vec::new();
        for hold in self.holds.values_mut() {
            let lease_end_us = Some(hold.lease_end_us).filter(|&end_us| due(end_us));
            let first = |end_us: u64| due(end_us) && lease_end_us.is_none_or(|l| end_us <= l);
            expire_waits(hold, first, &mut out);
        }
        let mut expired: Vec<Vec<u8>> = (self.holds.iter())
            .filter(|(_, hold)| due(hold.lease_end_us))
            .map(|(key, _)| key.clone())
            .collect();
        let rank = |key: &Vec<u8>| granted_first.iter().position(|first| first == key);
        expired.sort_by_key(|key| rank(key).unwrap_or(usize::MAX));
        for key in expired {
            self.end_hold(now_us, &key, &mut out);
            if let Some(hold) = self.holds.get_mut(&key) {
                expire_waits(hold, due, &mut out);
            }
        }
        out
    }

    /// The holder is gone: grant the queue head in the same step, else free the key.
    fn end_hold(&mut self, now_us: u64, key: &[u8], out: &mut Vec<Seen>) {
        let mut hold = self.holds.remove(key).expect("held");
        while let Some(waiter) = hold.queue.pop_front() {
            let Some(token) = self.issue() else {
                out.push(busy(waiter.session, waiter.owner, true));
                continue;
            };
            hold.token = token;
            hold.lease_end_us = now_us + u64::from(waiter.lease_s) * SECOND_US;
            out.push(granted(waiter.session, waiter.owner, token, true, key));
            self.holds.insert(key.to_vec(), hold);
            return;
        }
    }

    /// The earliest tick boundary at which a timer is due, in µs.
    fn earliest_deadline_us(&self) -> Option<u64> {
        let tick_us = self.config.tick_us;
        let ends = self.holds.values().flat_map(|hold| {
            let waits = hold.queue.iter().map(|waiter| waiter.wait_end_us);
            waits.chain(std::iter::once(hold.lease_end_us))
        });
        ends.map(|end_us| end_us.div_ceil(tick_us) * tick_us).min()
    }
}

/// Answers `T` to the waiters of `hold` whose wait end passes `select`, and removes them.
fn expire_waits(hold: &mut ModelHold, select: impl Fn(u64) -> bool, out: &mut Vec<Seen>) {
    hold.queue.retain(|waiter| {
        if select(waiter.wait_end_us) {
            out.push(timeout(waiter.session, waiter.owner, true));
        }
        !select(waiter.wait_end_us)
    });
}

/// An acquire the observer saw queued: (session, owner, lease, end of the wait in µs).
type Queued = (SessionId, u64, u8, u64);

/// Checks that only use the answers, the requests and the clock: one holder at most, tokens
/// strictly increasing per key and never repeated, FIFO grants, every acquire answered once.
#[derive(Default)]
struct Observer {
    /// Per key, the last grant: token, lease end, and whether it was released since.
    holds: HashMap<Vec<u8>, (u64, u64, bool)>,
    /// Every token granted, in order.
    tokens: Vec<u64>,
    tokens_seen: HashSet<u64>,
    /// Per key, the acquires that got no answer yet, in order: (session, owner, lease, end of
    /// the wait in µs). A client may queue one owner twice (a resend): the wait end tells
    /// which of the two a timeout was for.
    queues: HashMap<Vec<u8>, VecDeque<Queued>>,
}

impl Observer {
    fn grant(
        &mut self,
        now_us: u64,
        key: &[u8],
        token: u64,
        lease_s: u8,
    ) -> Result<(), TestCaseError> {
        prop_assert!(
            token != 0 && self.tokens_seen.insert(token),
            "token {} reissued",
            token
        );
        if let Some(&(last, lease_end_us, released)) = self.holds.get(key) {
            prop_assert!(token > last, "token {} after {} on {:?}", token, last, key);
            prop_assert!(
                released || lease_end_us <= now_us,
                "two holders of {:?}",
                key
            );
        }
        let lease_end_us = now_us + u64::from(lease_s) * SECOND_US;
        self.holds
            .insert(key.to_vec(), (token, lease_end_us, false));
        self.tokens.push(token);
        Ok(())
    }

    /// The live holder of `key` with a lease that has not run out.
    fn valid_holder(&self, now_us: u64, key: &[u8]) -> Option<u64> {
        let &(token, lease_end_us, released) = self.holds.get(key)?;
        (!released && lease_end_us > now_us).then_some(token)
    }

    /// Removes a queued acquire answered later; `fifo` demands it was its queue's head.
    /// Removes the queued acquire an answer was for and returns its lease. `expired_at`: the
    /// answer is a wait that ran out by then, so among duplicates of the same owner it is the
    /// one whose wait ended first; otherwise the first queued.
    fn unqueue(
        &mut self,
        seen: &Seen,
        key: Option<&[u8]>,
        fifo: bool,
        expired_at: Option<u64>,
    ) -> Result<u8, TestCaseError> {
        let owner = seen.response.correlation_id();
        let wanted = |&(session, queued_owner, _, wait_end_us): &Queued| {
            session == seen.session
                && queued_owner == owner
                && expired_at.is_none_or(|now_us| wait_end_us <= now_us)
        };
        let found = self.queues.iter_mut().find_map(|(queued_key, queue)| {
            if key.is_some_and(|key| key != &queued_key[..]) {
                return None;
            }
            let position = match expired_at {
                Some(_) => queue
                    .iter()
                    .enumerate()
                    .filter(|(_, entry)| wanted(entry))
                    .min_by_key(|(position, entry)| (entry.3, *position))
                    .map(|(position, _)| position),
                None => queue.iter().position(wanted),
            }?;
            Some((queue, position))
        });
        let Some((queue, position)) = found else {
            return Err(TestCaseError::fail(format!(
                "answer to no queued acquire: {seen:?}"
            )));
        };
        prop_assert!(
            !fifo || position == 0,
            "not FIFO: {:?} at {}",
            seen,
            position
        );
        Ok(queue.remove(position).expect("found").2)
    }

    /// Answers to queued acquires (and the holder change they cause).
    fn later(&mut self, now_us: u64, seen: &Seen, fifo: bool) -> Result<(), TestCaseError> {
        match seen.response {
            Response::Acquired { token, .. } => {
                let key = seen.key.as_deref().expect("grants name a key");
                let lease_s = self.unqueue(seen, Some(key), fifo, None)?;
                self.grant(now_us, key, token, lease_s)
            }
            Response::Busy { .. } => self.unqueue(seen, None, fifo, None).map(drop),
            Response::Timeout { .. } => self.unqueue(seen, None, false, Some(now_us)).map(drop),
            _ => Err(TestCaseError::fail(format!("unexpected answer {seen:?}"))),
        }
    }

    fn holder_answer(
        &mut self,
        now_us: u64,
        key: &[u8],
        seen: &Seen,
        lease_s: Option<u8>,
    ) -> Result<(), TestCaseError> {
        let hold = self.holds.get_mut(key);
        match (seen.response, hold) {
            (Response::Released { token }, Some(hold)) if hold.0 == token && !hold.2 => {
                hold.2 = true;
            }
            (Response::Extended { token }, Some(hold)) if hold.0 == token && !hold.2 => {
                hold.1 = now_us + u64::from(lease_s.expect("extend")) * SECOND_US;
            }
            (Response::NotHeld { token }, _) => {
                let holder = self.valid_holder(now_us, key);
                prop_assert!(holder != Some(token), "valid holder {} told N", token);
            }
            _ => prop_assert!(false, "unexpected {:?} on {:?}", seen, key),
        }
        Ok(())
    }

    fn queued_count(&self, session: SessionId) -> usize {
        let queued = self.queues.values().flatten();
        queued.filter(|entry| entry.0 == session).count()
    }
}
