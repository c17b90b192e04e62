//! The requests of one session, without I/O: which are queued, which are on the wire, which
//! are answered, and what each deadline does to them (docs/protocol.md §4.2–§4.4).
//!
//! [`Pipeline`] is a state machine driven by [`super::session`], which owns the socket. Time
//! is an input. Call order, once per loop iteration of the driver:
//!
//! 1. [`handle_read`](Pipeline::handle_read) with the bytes read (answers are correlated);
//! 2. [`submit`](Pipeline::submit) for every new call;
//! 3. [`handle_deadlines`](Pipeline::handle_deadlines);
//! 4. for every socket write: [`output`](Pipeline::output) with the instant read just before
//!    it, which encodes queued frames *now* (so the wire wait is the time left just before the
//!    bytes go out) and returns an [`Output`](output::Output) guard; the driver writes
//!    [`Output::bytes`](output::Output::bytes), tells the guard how many the socket took
//!    ([`Output::handed`](output::Output::handed)), and drops it;
//! 5. [`next_deadline`](Pipeline::next_deadline) feeds the poll timeout.
//!
//! Once [`close_reason`](Pipeline::close_reason) is set, the driver stops using the socket
//! and calls [`finish`](Pipeline::finish), which resolves every call still open.
//!
//! Before any of that, the link must come up (`link.rs`): once TCP (and TLS) is connected,
//! the driver calls [`start_handshake`](Pipeline::start_handshake), the pipeline offers a
//! `P` with a nonce of its own and nothing else, and only the `P` that answers it makes the
//! session established. Calls submitted meanwhile wait in the queue, unsent. After that,
//! the pipeline watches for silence: see [`is_stalled`](Pipeline::is_stalled).
//!
//! Invariants:
//! * A request is *unsent* (stage `Queued` or `Encoded`) exactly while no byte of it has been
//!   handed to the socket. A frame is `Encoded` only while an [`Output`](output::Output)
//!   guard lives: the guard borrows the whole pipeline, so no answer, deadline or call can be
//!   handled meanwhile, and when it ends, frames of which no byte was handed go back to the
//!   queue, to be encoded again, with a fresh wire wait, when they really go out. So no frame
//!   can reach the socket after its caller was told it expired: outside a write attempt, the
//!   output buffer holds at most the rest of one frame already partly on the wire.
//! * Nothing here ever encodes a request again once a byte of it was handed to the socket.
//! * Every call with a reply channel gets exactly one [`Outcome`].
//! * An entry whose deadline still matters has exactly one live timer on the timing wheel
//!   (whole milliseconds since the pipeline's epoch, checked against the exact `Instant` when
//!   it fires); removing or re-arming an entry cancels its timer, so answered calls leave
//!   nothing behind to wake the driver.
//! * An `X` whose code closes the session (1, 2, 6) ends the session at once, and the answer
//!   it carries is held back until [`finish`](Pipeline::finish): the driver retires the
//!   session (no new call can be submitted to it) before calling `finish`, so a caller who
//!   sees that `Rejected` never hands its next call to the dying session.
//! * Answers to Release and Extend carry only the token, so requests naming one token are
//!   matched first-in first-out, in the order their first byte was handed to the socket
//!   (the server answers same-key requests of a session in the order sent).
//! * No request is encoded before the handshake ping's pong was read, and the pong is never
//!   delivered to a caller (its nonce is the pipeline's own, in no correlation map).
//! * A stalled pipeline holds no queued request of a caller: stalling hands them back unsent,
//!   and [`submit`](Pipeline::submit) hands back every new one; the driver resolves them
//!   (`NotSent`) with [`resolve_returned`](Pipeline::resolve_returned) once it has published
//!   the stall.
//!
//! Deliberately not here: sockets, threads, and retrying on another session (the client does
//! that with the [`Outcome::NotSent`] it gets back).

use std::collections::{HashMap, VecDeque};
use std::sync::Arc;
use std::time::{Duration, Instant};

use crossbeam_channel::Sender;
use slab::Slab;

pub(crate) use super::call::{Call, CloseReason, Op, Outcome};
use crate::protocol::{parse_response, ErrorCode, Fate, Response};
use latchkey_wheel::TimerHandle;

mod deadlines;
mod link;
pub(crate) mod output;

use deadlines::Deadlines;
pub(crate) use link::Identity;
use link::{Link, HELLO_BYTES_MAX};

/// Bytes of frames encoded ahead of the socket at most; the rest stay queued, so their wire
/// wait is computed later.
const OUTPUT_BYTES_MAX: usize = 64 * 1024;

/// A slab slot with the sequence number of its occupant, so a stale queue or timer entry is
/// never confused with a later occupant of the same slot.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
struct Handle {
    slot: usize,
    seq: u64,
}

/// Where a request's frame lies in the output buffer.
#[derive(Clone, Copy, Debug)]
struct Span {
    handle: Handle,
    start: usize,
    end: usize,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Stage {
    /// Waiting in the queue; no byte handed to the socket.
    Queued,
    /// Encoded in the output buffer; no byte handed to the socket yet.
    Encoded,
    /// Some but not all bytes handed to the socket.
    Partial,
    /// All bytes handed to the socket; waiting for the answer.
    Sent,
    /// An acquire past its deadline, or withdrawn (`withdraw_acquires`), whose Cancel is
    /// queued or sent.
    Cancelling,
}

/// What a passed deadline does to a request, by stage.
enum OnDeadline {
    Expire,
    Close(CloseReason),
    Cancel(Op),
    GiveUpKeep,
    GiveUp,
}

#[derive(Debug)]
struct Entry {
    seq: u64,
    call: Call,
    stage: Stage,
    sent_at: Option<Instant>,
    /// The live timer of this entry and the exact instant it stands for.
    timer: Option<(TimerHandle, Instant)>,
}

/// The requests of one session. See the module docs for the call order.
#[derive(Debug)]
pub(crate) struct Pipeline {
    transport_timeout: Duration,
    /// How long an answer may be overdue before the session stops taking calls.
    silence_limit: Duration,
    link: Link,
    /// The handshake's frames (an Identify, then the ping).
    hello: [u8; HELLO_BYTES_MAX],
    /// The server identified the session (docs/protocol.md §5).
    identified: bool,
    /// The earliest instant a request the server answers at once was handed to the socket
    /// since the last read; `None` when nothing is overdue-able.
    awaiting_since: Option<Instant>,
    /// Answers are overdue and nothing was read since: no new call is taken.
    stalled: bool,
    /// While a waiting acquire may be on the wire of an identified session: the instant from
    /// which its quiet time counts (its hand-off, the last read, or the last probe); `None`
    /// when no probe is armed (`link.rs`).
    probe_from: Option<Instant>,
    /// The nonce of the next probe ping (the client uses it for nothing else).
    probe_nonce: u64,
    /// When the probe ping now awaited was queued; `None` when none is.
    probe_out: Option<Instant>,
    /// Calls handed back unsent while stalled, not resolved yet.
    returned: Vec<Call>,
    close: Option<CloseReason>,
    entries: Slab<Entry>,
    next_seq: u64,
    queue: VecDeque<Handle>,
    spans: VecDeque<Span>,
    out: Vec<u8>,
    out_written: usize,
    owners: HashMap<u64, Handle>,
    nonces: HashMap<u64, Handle>,
    tokens: HashMap<u64, VecDeque<Handle>>,
    /// One live timer per armed entry, cancelled whenever the entry is removed or re-armed.
    timers: Deadlines<Handle>,
    /// What one `advance` of `timers` fired; kept to reuse its allocation.
    fired: Vec<Handle>,
    /// Answers correlated with an `X` that closed the session; delivered by `finish`.
    held: Vec<(Sender<Outcome>, Outcome)>,
}

fn reply(tx: Option<Sender<Outcome>>, outcome: Outcome) -> bool {
    tx.is_some_and(|tx| tx.try_send(outcome).is_ok())
}

impl Pipeline {
    /// An empty pipeline for a session that is not connected yet; `silence_limit` is how long
    /// answers may be overdue before it stops taking calls (the client's connect timeout).
    /// Instants before `epoch` count as `epoch` on the timer wheel (they are still compared
    /// exactly).
    pub(crate) fn new(
        transport_timeout: Duration,
        silence_limit: Duration,
        epoch: Instant,
    ) -> Pipeline {
        Pipeline {
            transport_timeout,
            silence_limit,
            link: Link::Connecting,
            hello: [0; HELLO_BYTES_MAX],
            identified: false,
            awaiting_since: None,
            stalled: false,
            probe_from: None,
            probe_nonce: 0,
            probe_out: None,
            returned: Vec::new(),
            close: None,
            entries: Slab::new(),
            next_seq: 0,
            queue: VecDeque::new(),
            spans: VecDeque::new(),
            out: Vec::new(),
            out_written: 0,
            owners: HashMap::new(),
            nonces: HashMap::new(),
            tokens: HashMap::new(),
            timers: Deadlines::new(epoch),
            fired: Vec::new(),
            held: Vec::new(),
        }
    }

    /// Why the session must end, once it must.
    pub(crate) fn close_reason(&self) -> Option<&CloseReason> {
        self.close.as_ref()
    }

    /// Ends the session; the first reason wins (an `X` 7 read before the end of input stays
    /// the reason).
    pub(crate) fn close(&mut self, reason: CloseReason) {
        if self.close.is_none() {
            self.close = Some(reason);
        }
    }

    /// Whether nothing waits to be written: the driver may shut the session down.
    pub(crate) fn output_idle(&self) -> bool {
        self.out_written == self.out.len() && self.queue.iter().all(|&h| self.entry(h).is_none())
    }

    /// The earliest instant at which [`handle_deadlines`](Self::handle_deadlines) may have
    /// work: never later than the earliest armed deadline, possibly earlier (the wheel's whole
    /// millisecond, or a cascade point of it; waking early is harmless). `None` when no
    /// deadline is armed.
    pub(crate) fn next_deadline(&self) -> Option<Instant> {
        let link = match (self.stall_at(), self.probe_at()) {
            (Some(stall), Some(probe)) => Some(stall.min(probe)),
            (stall, probe) => stall.or(probe),
        };
        match (self.timers.next_deadline(), link) {
            (Some(timer), Some(link)) => Some(timer.min(link)),
            (timer, link) => timer.or(link),
        }
    }

    /// Queues a call. Its deadline is armed; an unsent call is never sent after it. A closed
    /// or stalled pipeline hands it back unsent at once.
    pub(crate) fn submit(&mut self, call: Call) {
        if self.close.is_some() {
            reply(call.reply, Outcome::NotSent);
            return;
        }
        if self.stalled {
            self.hand_back(call);
            return;
        }
        let deadline = call.deadline;
        let correlation = match call.op {
            Op::Acquire { owner, .. } | Op::Resolve { owner, .. } => Some((true, owner)),
            Op::Query { nonce, .. } | Op::Ping { nonce } => Some((false, nonce)),
            _ => None,
        };
        let handle = self.insert(call);
        let previous = match correlation {
            Some((true, owner)) => self.owners.insert(owner, handle),
            Some((false, nonce)) => self.nonces.insert(nonce, handle),
            None => None,
        };
        debug_assert!(previous.is_none(), "correlation ids are unique per session");
        self.queue.push_back(handle);
        self.arm(handle, deadline);
        self.check_invariants();
    }

    fn insert(&mut self, call: Call) -> Handle {
        let seq = self.next_seq;
        self.next_seq += 1;
        let entry = Entry {
            seq,
            call,
            stage: Stage::Queued,
            sent_at: None,
            timer: None,
        };
        Handle {
            slot: self.entries.insert(entry),
            seq,
        }
    }

    /// Arms the entry's single timer for the exact instant `at`, replacing any armed one.
    fn arm(&mut self, handle: Handle, at: Instant) {
        let Some(entry) = self.entries.get_mut(handle.slot) else {
            return;
        };
        if entry.seq != handle.seq {
            return;
        }
        if let Some((old, _)) = entry.timer.take() {
            self.timers.cancel(old);
        }
        entry.timer = Some((self.timers.insert(at, handle), at));
    }

    fn entry(&self, handle: Handle) -> Option<&Entry> {
        self.entries
            .get(handle.slot)
            .filter(|entry| entry.seq == handle.seq)
    }

    fn entry_mut(&mut self, handle: Handle) -> Option<&mut Entry> {
        self.entries
            .get_mut(handle.slot)
            .filter(|entry| entry.seq == handle.seq)
    }

    /// Removes an entry and its owner or nonce correlation (token queues are the caller's).
    fn take(&mut self, handle: Handle) -> Entry {
        let entry = self.entries.remove(handle.slot);
        debug_assert_eq!(entry.seq, handle.seq);
        if let Some((timer, _)) = entry.timer {
            self.timers.cancel(timer);
        }
        match entry.call.op {
            Op::Acquire { owner, .. } | Op::Resolve { owner, .. }
                if self.owners.get(&owner) == Some(&handle) =>
            {
                self.owners.remove(&owner);
            }
            Op::Query { nonce, .. } | Op::Ping { nonce }
                if self.nonces.get(&nonce) == Some(&handle) =>
            {
                self.nonces.remove(&nonce);
            }
            _ => {}
        }
        entry
    }

    /// Correlates the answers at the start of `input`, read at `now`; returns the bytes used.
    /// The driver calls it after every read that returned bytes: any byte read ends a stall.
    pub(crate) fn handle_read(&mut self, input: &[u8], now: Instant) -> usize {
        self.note_read(now);
        let mut consumed = 0;
        while self.close.is_none() {
            match parse_response(&input[consumed..]) {
                Ok(Some((response, used))) => {
                    consumed += used;
                    if self.is_handshaking() {
                        self.handle_handshake_answer(response);
                    } else {
                        self.handle_response(response, now);
                    }
                }
                Ok(None) => break,
                Err(error) => self.close(CloseReason::Protocol(error)),
            }
        }
        self.check_invariants();
        consumed
    }

    fn handle_response(&mut self, response: Response, now: Instant) {
        match response {
            Response::Acquired { owner, token } => self.handle_acquired(owner, token, now),
            Response::Timeout { owner } | Response::Busy { owner } => {
                self.answer_owner(owner, response, now)
            }
            Response::Released { token }
            | Response::Extended { token }
            | Response::NotHeld { token } => self.answer_token(token, response, now),
            Response::State { nonce, .. } | Response::Pong { nonce } => {
                self.answer_nonce(nonce, response, now)
            }
            Response::Error {
                code: ErrorCode::SessionRefused,
                ..
            } => self.close(CloseReason::Refused),
            Response::Error { code, id } if code.closes_session() => {
                // The session ends first; the answer waits for `finish`, which the driver
                // calls only after no new call can reach this session any more.
                self.close(CloseReason::ServerError(code));
                let entry = match code {
                    ErrorCode::UnknownOp => None,
                    _ => self.take_error_target(id),
                };
                match entry {
                    Some(entry) => self.hold(entry, response, now),
                    None => log::debug!("X {code} for id {id:#x} closes the session"),
                }
            }
            Response::Error { id, .. } | Response::Moved { id, .. } => {
                match self.take_error_target(id) {
                    Some(entry) => {
                        Self::answer(entry, response, now);
                    }
                    None => log::debug!("error for unknown id {id:#x} ignored"),
                }
            }
            Response::Resolved { owner, fate, .. } => {
                self.handle_resolved(owner, fate, response, now)
            }
            Response::Identified { .. } => {
                log::debug!("an answer to a request this session did not send: {response:?}");
            }
        }
    }

    /// The request an `X` carrying `id` answers: the acquire of that owner, the query or
    /// ping of that nonce, else the oldest release or extend of that token.
    fn take_error_target(&mut self, id: u64) -> Option<Entry> {
        if let Some(&handle) = self.owners.get(&id) {
            Some(self.take(handle))
        } else if let Some(&handle) = self.nonces.get(&id) {
            Some(self.take(handle))
        } else {
            self.take_token(id)
        }
    }

    /// Keeps the answer for [`finish`](Self::finish) instead of delivering it now.
    fn hold(&mut self, entry: Entry, response: Response, now: Instant) {
        if let Some(tx) = entry.call.reply {
            let sent_at = entry.sent_at.unwrap_or(now);
            let outcome = Outcome::Answer {
                response,
                sent_at,
                read_at: now,
            };
            self.held.push((tx, outcome));
        }
    }

    fn answer(entry: Entry, response: Response, now: Instant) -> bool {
        let sent_at = entry.sent_at.unwrap_or(now);
        reply(
            entry.call.reply,
            Outcome::Answer {
                response,
                sent_at,
                read_at: now,
            },
        )
    }

    fn answer_owner(&mut self, owner: u64, response: Response, now: Instant) {
        match self.owners.get(&owner) {
            Some(&handle) => {
                let entry = self.take(handle);
                Self::answer(entry, response, now);
            }
            None => log::debug!("answer for unknown owner {owner:#x} ignored"),
        }
    }

    fn answer_nonce(&mut self, nonce: u64, response: Response, now: Instant) {
        match self.nonces.get(&nonce) {
            Some(&handle) => {
                let entry = self.take(handle);
                Self::answer(entry, response, now);
            }
            None => log::debug!("answer for unknown nonce {nonce:#x} ignored"),
        }
    }

    fn answer_token(&mut self, token: u64, response: Response, now: Instant) {
        match self.take_token(token) {
            Some(entry) => {
                Self::answer(entry, response, now);
            }
            None => log::debug!("answer for unknown token {token} ignored"),
        }
    }

    /// Removes the oldest handed release or extend of `token`, which its next answer is for.
    fn take_token(&mut self, token: u64) -> Option<Entry> {
        let fifo = self.tokens.get_mut(&token)?;
        let handle = fifo.pop_front().expect("token queues are never left empty");
        if fifo.is_empty() {
            self.tokens.remove(&token);
        }
        Some(self.take(handle))
    }

    /// An `A`: delivered when in time; else (found at or after the deadline, or after the
    /// Cancel, or with nobody left to take it) a compensating release of exactly that token
    /// goes out and the call ends `Indeterminate`.
    fn handle_acquired(&mut self, owner: u64, token: u64, now: Instant) {
        let Some(&handle) = self.owners.get(&owner) else {
            log::warn!("grant of token {token} to unknown owner {owner:#x}: cannot release it");
            return;
        };
        let mut entry = self.take(handle);
        let (Op::Acquire { key, .. } | Op::Resolve { key, .. }) = entry.call.op.clone() else {
            unreachable!("owners only maps acquires and resolves")
        };
        // A Cancel sent at the deadline makes a grant that crossed it late; one sent by
        // `withdraw_acquires` before the deadline does not: the caller, still there, gets the
        // grant and releases it.
        let late = now >= entry.call.deadline;
        let response = Response::Acquired { owner, token };
        let delivered = !late && Self::answer_keep(&mut entry, response, now);
        if !delivered {
            log::debug!("grant of token {token} found late: releasing it");
            reply(entry.call.reply.take(), Outcome::Compensated);
            self.release_in_background(key, token, now);
        }
    }

    /// A Resolve's answer: `Queued` turns the call into the acquire it resolved, waiting on
    /// this session for its `A`, `T` or `B` until its own deadline (docs/protocol.md §5); any
    /// other fate is the call's answer.
    fn handle_resolved(&mut self, owner: u64, fate: Fate, response: Response, now: Instant) {
        let Some(&handle) = self.owners.get(&owner) else {
            return log::debug!("answer for unknown owner {owner:#x} ignored");
        };
        let entry = &mut self.entries[handle.slot];
        let Op::Resolve {
            key,
            wait_zero,
            lease_s,
            wait_deadline,
            ..
        } = entry.call.op.clone()
        else {
            return log::warn!("a Resolve answer for an acquire of owner {owner:#x} ignored");
        };
        if fate != Fate::Queued {
            let entry = self.take(handle);
            Self::answer(entry, response, now);
            return;
        }
        entry.call.op = Op::Acquire {
            key,
            wait_zero,
            lease_s,
            owner,
        };
        entry.call.deadline = wait_deadline;
        self.arm(handle, wait_deadline);
    }

    fn answer_keep(entry: &mut Entry, response: Response, now: Instant) -> bool {
        let sent_at = entry.sent_at.unwrap_or(now);
        reply(
            entry.call.reply.take(),
            Outcome::Answer {
                response,
                sent_at,
                read_at: now,
            },
        )
    }

    /// Queues a fire-and-forget Release of `token` on this session.
    pub(crate) fn release_in_background(&mut self, key: Arc<str>, token: u64, now: Instant) {
        let op = Op::Release { key, token };
        let deadline = now + self.transport_timeout;
        self.submit(Call {
            op,
            deadline,
            reply: None,
            attempts: 0,
        });
    }

    /// Applies every deadline that has passed at `now` (see the module docs and §4.2–§4.4),
    /// earliest first. A timer fired in the millisecond of its deadline but before the exact
    /// instant is armed again for that instant: never early, and the first call at or after
    /// the instant applies it.
    pub(crate) fn handle_deadlines(&mut self, now: Instant) {
        let mut fired = std::mem::take(&mut self.fired);
        self.timers.advance(now, &mut fired);
        // Every fired handle names a live entry: removing an entry cancels its timer.
        let instant = |entry: Option<&Entry>| entry.and_then(|e| e.timer).map(|(_, at)| at);
        fired.sort_unstable_by_key(|&handle| (instant(self.entry(handle)), handle));
        for &handle in &fired {
            // An earlier deadline of this batch may have removed the entry or ended the session
            // (then `finish` resolves everything left).
            let Some(entry) = self.entry_mut(handle) else {
                continue;
            };
            let Some((_, at)) = entry.timer.take() else {
                continue;
            };
            if self.close.is_some() {
                continue;
            }
            if at > now {
                self.arm(handle, at);
                continue;
            }
            self.handle_deadline(handle, now);
        }
        fired.clear();
        self.fired = fired;
        self.handle_silence(now);
        self.check_invariants();
    }

    fn handle_deadline(&mut self, handle: Handle, now: Instant) {
        let entry = &self.entries[handle.slot];
        let action = match (entry.stage, &entry.call.op) {
            (Stage::Queued | Stage::Encoded, _) => OnDeadline::Expire,
            // Part of the frame is on the wire: only closing the session ends it.
            (Stage::Partial, _) => OnDeadline::Close(CloseReason::DeadlineMidFrame),
            (
                Stage::Sent,
                Op::Acquire {
                    wait_zero: false,
                    key,
                    owner,
                    ..
                },
            ) => OnDeadline::Cancel(Op::Cancel {
                key: key.clone(),
                owner: *owner,
            }),
            (
                Stage::Sent,
                Op::Acquire {
                    wait_zero: true, ..
                },
            )
            | (Stage::Cancelling, _) => OnDeadline::Close(CloseReason::Unanswered),
            // The answer, if it comes, must still be matched in token order: keep the entry.
            (Stage::Sent, Op::Release { .. } | Op::Extend { .. }) => OnDeadline::GiveUpKeep,
            (Stage::Sent, _) => OnDeadline::GiveUp,
        };
        match action {
            OnDeadline::Expire => self.expire(handle),
            OnDeadline::Close(reason) => self.close(reason),
            OnDeadline::Cancel(cancel) => {
                // Same session, same key, same owner: per-key ordering means exactly one
                // terminal answer for the owner follows.
                let until = now + self.transport_timeout;
                self.entries[handle.slot].stage = Stage::Cancelling;
                self.arm(handle, until);
                let call = Call {
                    op: cancel,
                    deadline: until,
                    reply: None,
                    attempts: 0,
                };
                let cancel = self.insert(call);
                self.queue.push_back(cancel);
            }
            OnDeadline::GiveUpKeep => {
                reply(
                    self.entries[handle.slot].call.reply.take(),
                    Outcome::Indeterminate,
                );
            }
            OnDeadline::GiveUp => {
                let entry = self.take(handle);
                reply(entry.call.reply, Outcome::Indeterminate);
            }
        }
    }

    /// The client was interrupted (`Client::interrupt`): every acquire that waits or would
    /// wait ends now, before its deadline, as its deadline would end it (`handle_deadline`) —
    /// one not sent yet expires unsent, one sent is withdrawn with a Cancel (its `T`, or the
    /// grant that came first, is its answer: its deadline has not passed, so the grant is
    /// delivered). A wait-0 acquire is answered at once anyway, and one partly written is
    /// withdrawn at the next call of this (the session's next loop iteration).
    pub(crate) fn withdraw_acquires(&mut self, now: Instant) {
        if self.close.is_some() {
            return;
        }
        let waiting = |entry: &Entry| {
            let waits = matches!(
                entry.call.op,
                Op::Acquire {
                    wait_zero: false,
                    ..
                }
            );
            waits && matches!(entry.stage, Stage::Queued | Stage::Encoded | Stage::Sent)
        };
        if !self.entries.iter().any(|(_, entry)| waiting(entry)) {
            return;
        }
        let handles: Vec<Handle> = self
            .entries
            .iter()
            .filter(|(_, entry)| waiting(entry))
            .map(|(slot, entry)| Handle {
                slot,
                seq: entry.seq,
            })
            .collect();
        // Bounded by the session's open calls.
        for handle in handles {
            self.handle_deadline(handle, now);
        }
        self.check_invariants();
    }

    /// Ends an unsent call at its deadline: it was never sent.
    fn expire(&mut self, handle: Handle) {
        let entry = self.take(handle);
        debug_assert!(matches!(entry.stage, Stage::Queued | Stage::Encoded));
        reply(
            entry.call.reply,
            Outcome::Expired {
                established: self.is_established(),
            },
        );
    }

    /// Resolves every open call once the session has ended: `NotSent` while no byte was handed
    /// to the socket (or always, after `X` code 7; `Unreachable` when a TLS error, or bytes
    /// that are not latchkey frames, ended it before it was established), else
    /// `Indeterminate`; and delivers the
    /// answer held back from an `X` that closed the session. Returns the fire-and-forget
    /// releases that were never sent, for another session.
    ///
    /// The driver calls this only after the session was retired (marked failed, inbox
    /// closed), so nobody who hears back from it can hand it another call.
    pub(crate) fn finish(&mut self) -> Vec<Call> {
        for (tx, outcome) in self.held.drain(..) {
            let _ = tx.try_send(outcome);
        }
        let refused = self.close == Some(CloseReason::Refused);
        let unreachable = !self.is_established()
            && matches!(
                self.close,
                Some(CloseReason::Tls(_) | CloseReason::Protocol(_))
            );
        let mut unsent_releases = self.resolve_returned();
        for entry in self.entries.drain() {
            let possibly_sent = !refused
                && matches!(
                    entry.stage,
                    Stage::Partial | Stage::Sent | Stage::Cancelling
                );
            let outcome = match (possibly_sent, unreachable) {
                (true, _) => Outcome::Indeterminate,
                (false, true) => Outcome::Unreachable,
                (false, false) => Outcome::NotSent,
            };
            match entry.call.reply {
                Some(tx) => {
                    let _ = tx.try_send(outcome);
                }
                // A release is safe to send again (a second one of the same token changes
                // nothing: `N`), so a background release goes to another session whether or
                // not this one may have sent it: no grant is left held by nobody for a cut.
                None if matches!(entry.call.op, Op::Release { .. }) => {
                    unsent_releases.push(entry.call);
                }
                None => {}
            }
        }
        self.queue.clear();
        self.spans.clear();
        self.out.clear();
        self.out_written = 0;
        self.owners.clear();
        self.nonces.clear();
        self.tokens.clear();
        self.timers.clear();
        unsent_releases
    }

    /// Timers armed on the wheel, for tests.
    #[cfg(test)]
    fn timers_len(&self) -> usize {
        self.timers.len()
    }

    /// Panics when a structural invariant is broken (debug builds and tests only).
    fn check_invariants(&self) {
        if !cfg!(debug_assertions) {
            return;
        }
        assert!(self.out_written <= self.out.len());
        assert!(self.is_established() || self.out.is_empty());
        assert!(
            !self.stalled || self.is_established(),
            "only a live link stalls"
        );
        if self.stalled {
            let caller_queued = |&h: &Handle| {
                self.entry(h).is_some_and(|e| {
                    e.stage == Stage::Queued && !matches!(e.call.op, Op::Cancel { .. })
                })
            };
            assert!(
                !self.queue.iter().any(caller_queued),
                "stalled: nothing queued"
            );
        }
        // The spans tile the part of the output not yet fully handed to the socket.
        let mut previous_end = self
            .spans
            .front()
            .map_or(self.out_written, |span| span.start);
        assert!(previous_end <= self.out_written);
        for (index, span) in self.spans.iter().enumerate() {
            assert_eq!(span.start, previous_end, "spans tile the output buffer");
            assert!(span.start < span.end && span.end <= self.out.len());
            previous_end = span.end;
            if let Some(entry) = self.entry(span.handle) {
                let partial_ok = index == 0 && entry.stage == Stage::Partial;
                assert!(
                    entry.stage == Stage::Encoded || partial_ok,
                    "span of a live frame"
                );
            }
        }
        assert_eq!(previous_end, self.out.len());
        // Exactly one live wheel timer per armed entry, and none for anything else.
        let mut armed = 0;
        for (_, entry) in &self.entries {
            if let Some((timer, _)) = entry.timer {
                assert!(self.timers.is_armed(timer), "an armed timer is live");
                armed += 1;
            }
        }
        assert_eq!(armed, self.timers.len(), "no timer outlives its entry");
        for (owner, &handle) in &self.owners {
            let entry = self.entry(handle).expect("owners map live entries");
            let matches = matches!(entry.call.op,
                Op::Acquire { owner: o, .. } | Op::Resolve { owner: o, .. } if o == *owner);
            assert!(matches);
        }
        for (token, fifo) in &self.tokens {
            assert!(!fifo.is_empty());
            for &handle in fifo {
                let entry = self.entry(handle).expect("token queues hold live entries");
                assert!(matches!(entry.stage, Stage::Partial | Stage::Sent));
                let matches = matches!(entry.call.op,
                    Op::Release { token: t, .. } | Op::Extend { token: t, .. } if t == *token);
                assert!(matches);
            }
        }
    }
}

#[cfg(test)]
mod tests;
