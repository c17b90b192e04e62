//! The simulation's random choices: how far the clock moves before each loop iteration, which
//! request comes next, and its key, lease, wait, token and owner; and the keys' names. They
//! extend `Sim`, whose other half (running the requests on the table and the model, and
//! checking) is in `simulation.rs`.

use super::{Checked, Sim, MICROS_PER_SECOND};
use latchkey::partition::SessionId;
use latchkey::rng::Rng;
/// Short keys live inline in the table, long ones on the heap: use both.
pub(super) fn key_name(rng: &mut Rng, index: usize) -> Vec<u8> {
    match rng.below(4) {
        0 => format!("k{index}").into_bytes(),
        1 => format!("orders/{index}/ünïcödé").into_bytes(),
        2 => format!("{index}:{}", "x".repeat(rng.between(20, 300) as usize)).into_bytes(),
        _ => vec![b'a' + index as u8],
    }
}

impl Sim {
    /// How far the next loop iteration moves the clock.
    pub(super) fn time_step(&mut self) -> u64 {
        let (now_us, tick_us) = (self.now_us(), self.model.tick_us);
        let earliest = self.model.deadlines().min();
        match self.rng.below(20) {
            0..=5 => self.rng.between(0, 2 * tick_us),
            6..=9 => self.rng.between(0, 300_000),
            10..=12 => match self.table.next_deadline_us() {
                Some(deadline) => deadline.saturating_sub(now_us),
                None => 0,
            },
            // Exactly at, just before, and at either end of the tick of a model deadline.
            13..=15 => match earliest {
                Some(deadline) => {
                    let at = self.model.fire_at(deadline);
                    let just_before = deadline.saturating_sub(1);
                    let target = self
                        .rng
                        .pick(&[deadline, just_before, at, at + tick_us - 1]);
                    target.saturating_sub(now_us)
                }
                None => 0,
            },
            16..=18 => self.rng.between(0, 3 * MICROS_PER_SECOND),
            _ => self.rng.between(0, 300 * MICROS_PER_SECOND),
        }
    }

    pub(super) fn random_request(&mut self) -> Checked {
        let session = self.rng.pick(&self.open);
        match self.rng.below(100) {
            0..=39 => self.acquire(session),
            40..=54 => self.release(session),
            55..=64 => self.extend(session),
            65..=76 => self.cancel(session),
            77..=81 => {
                let key = self.rng.below(self.params.keys.len() as u64) as usize;
                self.query(session, key)
            }
            82..=84 => self.ping(session),
            85..=91 => self.close_and_open(session),
            92..=93 if self.params.tight_tokens => self.raise_limit(),
            _ if self.open.len() < self.params.sessions_max => self.open_session(),
            _ => self.ping(session),
        }
    }

    pub(super) fn random_key(&mut self) -> usize {
        // Skewed towards the first keys, so that queues form.
        let count = self.params.keys.len() as u64;
        match self.rng.percent(60) {
            true => self.rng.below(count.min(2)) as usize,
            false => self.rng.below(count) as usize,
        }
    }

    pub(super) fn random_lease(&mut self) -> u8 {
        match self.rng.below(20) {
            0 => self.rng.between(4, 255) as u8,
            _ => self.rng.between(1, 3) as u8,
        }
    }

    pub(super) fn random_wait(&mut self) -> u8 {
        match self.rng.below(20) {
            0..=5 => 0,
            6 => self.rng.between(4, 255) as u8,
            _ => self.rng.between(1, 3) as u8,
        }
    }

    /// A token for a release or extend of `key`: usually the holder's, else a wrong one.
    pub(super) fn random_token(&mut self, key: usize) -> u64 {
        let holder = self.model.held[key].as_ref().map(|held| held.token);
        match (self.rng.below(10), holder) {
            (0..=5, Some(token)) => token,
            (6, Some(token)) => token + self.model.tokens.step,
            (7, _) if !self.recent_tokens.is_empty() => self.rng.pick(&self.recent_tokens),
            (8, _) => self.last_token[key],
            _ => self.rng.next_u64() | 1,
        }
    }

    /// A new owner, or now and then the owner of this session's waiter on this key, so that a
    /// Cancel has several acquires to withdraw.
    pub(super) fn acquire_owner(&mut self, session: SessionId, key: usize) -> u64 {
        let mine = self.model.queued_owners(session, key);
        if !mine.is_empty() && self.rng.percent(10) {
            return self.rng.pick(&mine);
        }
        self.next_owner += 1;
        self.next_owner
    }
}
