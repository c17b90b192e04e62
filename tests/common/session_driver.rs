//! One partition's session pipeline without sockets: bytes → `parse_request` → execute against a
//! [`LockTable`] on virtual time → answers, the way the reactor does it, with every answer
//! checked as it is produced.
//!
//! Shared by `tests/arbitrary_bytes.rs` (a property test over arbitrary byte streams, in CI)
//! and the `session` fuzz target (`fuzz/`, which includes this file by path), so both exercise
//! the same pipeline. [`Driver::run_script`] turns any byte string into a run: which session
//! gets the next chunk, how long the chunk is, when time jumps, when a session ends.
//!
//! Checked (a violation panics, which is what a fuzzer looks for):
//! * the table's invariants after every frame and every timer pass;
//! * every answer goes to a live session; an acquire's answer (`A`/`T`/`B`) matches one of that
//!   session's unanswered acquires; `R`/`E`/`N`/`Q`/`P` answer the frame just executed, with its
//!   correlation id, before any grant it causes; a refused frame gets `X` with its code and id;
//! * after a closing error the session reads nothing more and gets no further answer;
//! * [`Driver::finish`]: once time runs past every deadline, every acquire of a session that is
//!   still open has been answered, and no key or timer is left.
//!
//! Not here: sockets, cross-core routing, output bounds (the real server tests cover those).

use latchkey::partition::{Answer, SessionId};

use latchkey::lock_table::{LockTable, TableConfig};
use latchkey::tokens::TokenRange;
use latchkey_client::protocol::{parse_request, ErrorCode, Request, Response};
use std::collections::HashMap;

/// Sessions a script drives at once.
const SESSIONS: usize = 4;
const MICROS_PER_SECOND: u64 = 1_000_000;

/// How a session ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Ended {
    /// End of input.
    Eof,
    /// A closing error (`X` code 1, 2 or 6).
    Closed(ErrorCode),
}

/// What a session saw.
#[derive(Default)]
pub struct SessionLog {
    /// Its identity in the table.
    pub id: SessionId,
    /// Bytes received and not yet parsed.
    pub input: Vec<u8>,
    /// Every answer, in order.
    pub answers: Vec<Response>,
    /// Frames executed (requests the parser returned), in order.
    pub frames: usize,
    /// Frames refused with an error that let the session continue.
    pub refused: usize,
    /// How it ended, if it did.
    pub ended: Option<Ended>,
    /// Acquires with wait > 0 not yet answered (what the reactor limits).
    pending: u32,
    /// Unanswered acquires by owner.
    unanswered: HashMap<u64, u32>,
}

impl SessionLog {
    /// Unanswered acquires of this session.
    pub fn unanswered(&self) -> u32 {
        self.unanswered.values().sum()
    }
}

/// A lock table and the sessions that talk to it.
pub struct Driver {
    /// The partition.
    pub table: LockTable,
    /// Virtual time.
    pub now_us: u64,
    /// The longest key accepted.
    pub key_bytes_max: usize,
    /// The live sessions (an ended one is replaced by a new one at the next chunk).
    pub sessions: Vec<SessionLog>,
    /// Sessions that ended, in order.
    pub ended: Vec<SessionLog>,
    next_id: SessionId,
}

impl Driver {
    /// A partition with small limits, so that capacity answers happen.
    pub fn new(key_bytes_max: usize, max_keys: usize, max_waiters: u32, max_pending: u32) -> Self {
        let config = TableConfig {
            max_keys,
            max_waiters_per_key: max_waiters,
            tick_us: 1000,
            max_pending_per_session: max_pending,
        };
        let now_us = 1_000_000_007;
        let tokens = TokenRange {
            next: 1 << 40,
            step: 2,
            limit: u64::MAX,
        };
        let mut driver = Driver {
            table: LockTable::new(config, now_us, tokens),
            now_us,
            key_bytes_max,
            sessions: Vec::new(),
            ended: Vec::new(),
            next_id: 1,
        };
        for _ in 0..SESSIONS {
            let session = driver.new_session();
            driver.sessions.push(session);
        }
        driver
    }

    /// Limits from the first bytes of a script, so a fuzzer explores them too.
    fn from_script_header(header: [u8; 2]) -> Self {
        let key_bytes_max = match header[0] & 3 {
            0 => 1024,
            _ => 1 + usize::from(header[0] >> 2),
        };
        let max_keys = 1 + usize::from(header[1] & 7);
        let max_waiters = 1 + u32::from((header[1] >> 3) & 3);
        let max_pending = 1 + u32::from(header[1] >> 5);
        Driver::new(key_bytes_max, max_keys, max_waiters, max_pending)
    }

    fn new_session(&mut self) -> SessionLog {
        self.next_id += 1;
        SessionLog {
            id: self.next_id,
            ..SessionLog::default()
        }
    }

    /// Runs a script: two header bytes (limits), then commands. A command byte's low two bits
    /// pick a session; the rest say what to do: feed it the next `n` bytes (`n` from the next
    /// byte), end its input, or move time (by milliseconds up to minutes).
    pub fn run_script(data: &[u8]) -> Driver {
        let (header, mut rest) = match data {
            [a, b, rest @ ..] => ([*a, *b], rest),
            _ => ([0, 0xff], data),
        };
        let mut driver = Driver::from_script_header(header);
        // Bounded: every command consumes at least one byte.
        while let [command, tail @ ..] = rest {
            let session = usize::from(command & 3);
            let (length, tail) = match tail {
                [length, tail @ ..] => (usize::from(*length), tail),
                [] => (0, tail),
            };
            rest = tail;
            match command >> 2 {
                0..=39 => {
                    let (chunk, tail) = rest.split_at(length.min(rest.len()));
                    rest = tail;
                    driver.feed(session, chunk);
                }
                40..=47 => driver.end(session),
                48..=55 => driver.advance(length as u64 * 1000),
                56..=61 => driver.advance(length as u64 * 20_000),
                _ => driver.advance(length as u64 * MICROS_PER_SECOND),
            }
        }
        driver.finish();
        driver
    }

    /// Delivers `bytes` to session `index` and executes every complete frame.
    pub fn feed(&mut self, index: usize, bytes: &[u8]) {
        if self.sessions[index].ended.is_some() {
            let fresh = self.new_session();
            let old = std::mem::replace(&mut self.sessions[index], fresh);
            self.ended.push(old);
        }
        self.sessions[index].input.extend_from_slice(bytes);
        // Bounded: every pass consumes a frame or ends the session.
        while self.sessions[index].ended.is_none() {
            let session = &self.sessions[index];
            let parsed = parse_request(&session.input, self.key_bytes_max);
            match parsed {
                Ok(None) => break,
                Ok(Some((_, used))) => {
                    let frame = session.input[..used].to_vec();
                    self.execute(index, &frame);
                    self.sessions[index].input.drain(..used);
                }
                Err(error) => self.refuse(index, error.code, error.id, error.consumed),
            }
        }
    }

    fn refuse(&mut self, index: usize, code: ErrorCode, id: u64, consumed: usize) {
        let session = &mut self.sessions[index];
        session.answers.push(Response::Error { code, id });
        assert!(
            consumed > 0 && consumed <= session.input.len(),
            "error consumed {consumed}"
        );
        if code.closes_session() {
            assert_eq!(
                consumed,
                session.input.len(),
                "a closing error consumes everything"
            );
            session.input.clear();
            session.ended = Some(Ended::Closed(code));
            let id = session.id;
            self.table.handle_session_closed(id);
            self.route(None);
        } else {
            assert_eq!(
                session.input[consumed - 1],
                b'\n',
                "a refused frame ends at its newline"
            );
            session.input.drain(..consumed);
            session.refused += 1;
        }
    }

    /// Executes one complete frame of session `index` (re-parsed from a copy, so the table
    /// never sees the session's buffer while it changes).
    fn execute(&mut self, index: usize, frame: &[u8]) {
        let (request, used) = parse_request(frame, self.key_bytes_max)
            .expect("a frame that parsed once parses again")
            .expect("complete");
        assert_eq!(used, frame.len(), "the parser reports the whole frame");
        check_request(&request, self.key_bytes_max);
        let session = &mut self.sessions[index];
        session.frames += 1;
        let id = session.id;
        let waits = matches!(request, Request::Acquire { wait_s: 1.., .. });
        session.pending += u32::from(waits);
        if let Request::Acquire { owner, .. } = request {
            *session.unanswered.entry(owner).or_insert(0) += 1;
        }
        if let Request::Ping { nonce } = request {
            // The reactor answers a ping itself; the table would too.
            session.answers.push(Response::Pong { nonce });
            return;
        }
        if let Request::Identify { nonce, .. } | Request::Resolve { owner: nonce, .. } = request {
            // The core refuses both here: a session of this driver never identifies (the
            // resumable calls have their own tests), and a Resolve needs an identified session.
            let code = latchkey_client::protocol::ErrorCode::NotIdentified;
            session.answers.push(Response::Error { code, id: nonce });
            return;
        }
        self.table.handle_request(self.now_us, id, &request);
        self.table.check_invariants();
        self.route(Some((index, request)));
    }

    /// Delivers the table's answers. `own` is the frame just executed: its own answer (if it
    /// has one) must come first among this session's, with its correlation id.
    fn route(&mut self, own: Option<(usize, Request<'_>)>) {
        let answers = self.table.take_answers();
        let mut own = own;
        for answer in &answers {
            let Some(index) = self.sessions.iter().position(|s| s.id == answer.session) else {
                panic!("answer {answer:?} to a session that is not live");
            };
            if let Some((own_index, request)) = own {
                if own_index == index {
                    check_own_answer(&request, answer.response);
                    own = None;
                }
            }
            self.deliver(index, answer);
        }
        if let Some((_, request)) = own {
            let silent = matches!(
                request,
                Request::Cancel { .. } | Request::Acquire { wait_s: 1.., .. }
            );
            assert!(silent, "{request:?} got no answer");
        }
        self.table.return_answers(answers);
    }

    fn deliver(&mut self, index: usize, answer: &Answer) {
        let session = &mut self.sessions[index];
        assert!(
            session.ended.is_none(),
            "answer {answer:?} after the session ended"
        );
        if answer.ends_pending {
            assert!(session.pending > 0, "pending count below zero");
            session.pending -= 1;
        }
        if let Response::Acquired { owner, .. }
        | Response::Timeout { owner }
        | Response::Busy { owner } = answer.response
        {
            let unanswered = session.unanswered.get_mut(&owner);
            let count = unanswered.unwrap_or_else(|| panic!("{answer:?} answers no acquire"));
            assert!(*count > 0, "{answer:?} answers an acquire twice");
            *count -= 1;
        }
        session.answers.push(answer.response);
    }

    /// Ends session `index`'s input: its waiters leave, its holds stay.
    pub fn end(&mut self, index: usize) {
        let session = &mut self.sessions[index];
        if session.ended.is_some() {
            return;
        }
        session.ended = Some(Ended::Eof);
        let id = session.id;
        self.table.handle_session_closed(id);
        self.table.check_invariants();
        self.route(None);
    }

    /// Moves time by `micros` and fires what is due.
    pub fn advance(&mut self, micros: u64) {
        self.now_us += micros;
        self.table.handle_timers(self.now_us);
        self.table.check_invariants();
        self.route(None);
        if let Some(deadline) = self.table.next_deadline_us() {
            assert!(deadline > self.now_us / 1000 * 1000, "a deadline left due");
        }
    }

    /// Runs time past every deadline: then every open session's acquires are all answered,
    /// and nothing is held.
    pub fn finish(&mut self) {
        // Bounded: each pass fires every deadline that exists; a key's handoff chain is at
        // most its queue, and nothing new is submitted.
        for _ in 0..10_000 {
            if self.table.next_deadline_us().is_none() {
                break;
            }
            self.advance(256 * MICROS_PER_SECOND);
        }
        assert_eq!(
            self.table.key_count(),
            0,
            "keys left after every lease ran out"
        );
        assert_eq!(self.table.waiter_count(), 0, "waiters left");
        for session in &self.sessions {
            if session.ended.is_none() {
                assert_eq!(session.unanswered(), 0, "an acquire was never answered");
                assert_eq!(session.pending, 0, "pending acquires left");
            }
        }
    }

    /// What is left of each session's input is an incomplete frame, unless a closing error
    /// ended it, and then that `X` was its last answer.
    pub fn check_consumed(&self) {
        for session in self.sessions.iter().chain(&self.ended) {
            match session.ended {
                Some(Ended::Closed(code)) => {
                    assert!(code.closes_session());
                    let last = session.answers.last().map(Response::op);
                    assert_eq!(last, Some(b'X'), "a closing error is answered last");
                    assert!(session.input.is_empty(), "input kept after a closing error");
                }
                _ => {
                    let rest = parse_request(&session.input, self.key_bytes_max);
                    assert_eq!(rest, Ok(None), "input left that is not an incomplete frame");
                }
            }
        }
    }
}

/// What the parser promises about every request it returns.
fn check_request(request: &Request<'_>, key_bytes_max: usize) {
    if let Some(key) = request.key() {
        assert!(
            !key.is_empty() && key.len() <= key_bytes_max,
            "key length {}",
            key.len()
        );
        assert!(std::str::from_utf8(key).is_ok(), "key not UTF-8");
        assert!(!key.contains(&b'\n'), "key contains a newline");
    }
    if let Request::Acquire { lease_s, .. } | Request::Extend { lease_s, .. } = *request {
        assert!(lease_s > 0, "lease 0 accepted");
    }
}

/// The first answer a frame produces for its own session must be its own, when it has one.
fn check_own_answer(request: &Request<'_>, response: Response) {
    let id = request.correlation_id();
    let fits = match (request, response) {
        (Request::Acquire { .. }, Response::Acquired { owner, .. })
        | (Request::Acquire { .. }, Response::Timeout { owner })
        | (Request::Acquire { .. }, Response::Busy { owner }) => owner == id,
        (Request::Release { .. }, Response::Released { token })
        | (Request::Release { .. }, Response::NotHeld { token })
        | (Request::Extend { .. }, Response::Extended { token })
        | (Request::Extend { .. }, Response::NotHeld { token }) => token == id,
        (Request::Query { .. }, Response::State { nonce, .. }) => nonce == id,
        // A Cancel's `T`s answer the acquires it withdrew.
        (Request::Cancel { owner, .. }, Response::Timeout { owner: got }) => *owner == got,
        // A queued acquire says nothing now; what this session gets is another frame's grant
        // (possible only through a release, which has its own answer), so never this.
        _ => false,
    };
    assert!(fits, "{request:?} answered {response:?}");
}
