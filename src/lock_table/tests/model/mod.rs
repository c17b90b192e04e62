//! The observer that checks answers alone; the simulation in `sim` drives the table and the
//! reference model ([`crate::partition::model`]) with the same random operations.

use super::*;
use crate::partition::model::{Expect, Model};

mod sim;

/// The model's prediction as a test sees answers: a grant names its key's bytes.
fn seen(expect: Expect) -> Seen {
    Seen {
        session: expect.session,
        response: expect.response,
        ends_pending: expect.ends_pending,
        key: expect.key.map(|key| sim::KEYS[key].to_vec()),
    }
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

    /// Removes the queued acquire an answer was for and returns its lease; `fifo` demands it
    /// was its queue's head. `expired_at`: the answer is a wait that ran out by then, so among
    /// duplicates of the same owner (a resend) it is one whose wait had ended by then, the
    /// first queued of those: timers that fire together answer in the table's order, which
    /// may time out a head whose wait ended later before one queued behind it (seed-found: a
    /// `T`, a grant to the next waiter, then the other `T`); otherwise the first queued.
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
            let position = queue.iter().position(wanted)?;
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
