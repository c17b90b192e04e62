//! Lock-table tests on virtual time: every cell of the docs/protocol.md §3 matrix and every event,
//! then random operation sequences checked step by step against a small reference model and an
//! observer that only sees the answers.
//!
//! This module holds the shared fixtures (virtual time, the answers as a test sees them, a
//! table on virtual time); the tests are in one file per theme.

mod answers;
mod limits;
mod matrix;
mod model;
mod resume;
mod timers;

use super::*;
use proptest::prelude::*;
use std::collections::{HashMap, HashSet, VecDeque};

const TICK_US: u64 = 1000;
const SECOND_US: u64 = 1_000_000;
/// Virtual time at which every fixture starts (on a tick boundary).
const START_US: u64 = 7_000_000;
const FIRST_TOKEN: u64 = 1_000;
/// A session that only queries, so its answers never mix with the others'.
const SPECTATOR: SessionId = u64::MAX;
/// The key most tests use.
const KEY: &[u8] = b"matrix-key";

/// One answer as a test sees it: for a grant, the key its entry names instead of the index.
#[derive(Clone, Debug, PartialEq, Eq)]
struct Seen {
    session: SessionId,
    response: Response,
    ends_pending: bool,
    key: Option<Vec<u8>>,
}

fn said(session: SessionId, response: Response, ends_pending: bool) -> Seen {
    Seen {
        session,
        response,
        ends_pending,
        key: None,
    }
}

fn granted(session: SessionId, owner: u64, token: u64, ends_pending: bool, key: &[u8]) -> Seen {
    let response = Response::Acquired { owner, token };
    Seen {
        key: Some(key.to_vec()),
        ..said(session, response, ends_pending)
    }
}

fn timeout(session: SessionId, owner: u64, ends_pending: bool) -> Seen {
    said(session, Response::Timeout { owner }, ends_pending)
}

fn busy(session: SessionId, owner: u64, ends_pending: bool) -> Seen {
    said(session, Response::Busy { owner }, ends_pending)
}

/// Drains the table's answers, checking the invariants and what `entry` names.
fn drain(table: &mut LockTable) -> Vec<Seen> {
    table.check_invariants();
    let answers = table.take_answers();
    let seen = answers
        .iter()
        .map(|answer| {
            let key = match answer.response {
                Response::Acquired { .. } => {
                    let key = table
                        .entry_key(answer.grant.0)
                        .expect("a grant names a live entry");
                    Some(key.to_vec())
                }
                _ => {
                    assert_eq!(answer.grant, GrantRef::NONE, "only grants name an entry");
                    None
                }
            };
            Seen {
                session: answer.session,
                response: answer.response,
                ends_pending: answer.ends_pending,
                key,
            }
        })
        .collect();
    table.return_answers(answers);
    seen
}

/// A table on virtual time.
struct Fixture {
    table: LockTable,
    now_us: u64,
}

impl Fixture {
    fn new(max_keys: usize, max_waiters_per_key: u32) -> Fixture {
        let tokens = TokenRange {
            next: FIRST_TOKEN,
            step: 1,
            limit: u64::MAX / 2,
        };
        Fixture::with_tokens(max_keys, max_waiters_per_key, START_US, tokens)
    }

    fn with_tokens(max_keys: usize, waiters: u32, now_us: u64, tokens: TokenRange) -> Fixture {
        let config = TableConfig {
            max_keys,
            max_waiters_per_key: waiters,
            tick_us: TICK_US,
            max_pending_per_session: u32::MAX,
        };
        Fixture {
            table: LockTable::new(config, now_us, tokens),
            now_us,
        }
    }

    fn request(&mut self, session: SessionId, request: Request<'_>) -> Vec<Seen> {
        self.table.handle_request(self.now_us, session, &request);
        drain(&mut self.table)
    }

    fn acquire(
        &mut self,
        session: SessionId,
        wait_s: u8,
        lease_s: u8,
        owner: u64,
        key: &[u8],
    ) -> Vec<Seen> {
        let request = Request::Acquire {
            wait_s,
            lease_s,
            owner,
            key,
        };
        self.request(session, request)
    }

    /// Acquires a key that must be granted at once; returns the token.
    fn grant(&mut self, session: SessionId, lease_s: u8, owner: u64, key: &[u8]) -> u64 {
        let answers = self.acquire(session, 0, lease_s, owner, key);
        match answers[..] {
            [Seen {
                response: Response::Acquired { owner: got, token },
                ..
            }] if got == owner => token,
            _ => panic!("expected a grant, got {answers:?}"),
        }
    }

    /// Queues an acquire that must get no answer yet.
    fn enqueue(&mut self, session: SessionId, wait_s: u8, lease_s: u8, owner: u64, key: &[u8]) {
        assert_eq!(self.acquire(session, wait_s, lease_s, owner, key), vec![]);
    }

    fn release(&mut self, session: SessionId, token: u64, key: &[u8]) -> Vec<Seen> {
        self.request(session, Request::Release { token, key })
    }

    fn extend(&mut self, session: SessionId, lease_s: u8, token: u64, key: &[u8]) -> Vec<Seen> {
        let request = Request::Extend {
            lease_s,
            token,
            key,
        };
        self.request(session, request)
    }

    fn cancel(&mut self, session: SessionId, owner: u64, key: &[u8]) -> Vec<Seen> {
        self.request(session, Request::Cancel { owner, key })
    }

    /// `(held, lease_ms, waiters)` of `key`.
    fn query(&mut self, key: &[u8]) -> (bool, u32, u32) {
        let answers = self.request(SPECTATOR, Request::Query { nonce: 5, key });
        match answers[..] {
            [Seen {
                response:
                    Response::State {
                        nonce: 5,
                        held,
                        lease_ms,
                        waiters,
                    },
                ends_pending: false,
                ..
            }] => (held, lease_ms, waiters),
            _ => panic!("expected one State, got {answers:?}"),
        }
    }

    /// Moves time to `now_us` and runs the timers, as one reactor iteration does.
    fn run_timers_at(&mut self, now_us: u64) -> Vec<Seen> {
        assert!(now_us >= self.now_us, "time goes forward");
        self.now_us = now_us;
        self.table.handle_timers(now_us);
        drain(&mut self.table)
    }

    fn advance(&mut self, by_us: u64) -> Vec<Seen> {
        self.run_timers_at(self.now_us + by_us)
    }
}
