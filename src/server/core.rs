//! One core's logic: its sessions, its partition of the key space, its way to the other cores.
//!
//! [`Core`] is sans-IO in the sense that matters here: it reads and writes its sessions'
//! streams through the [`Net`] and [`Stream`](super::net::Stream) traits and is told the time,
//! so the mio reactor ([`super::reactor`]) drives it over real sockets and the test harness
//! drives several cores in one thread over in-memory streams on a virtual clock.
//!
//! # One iteration ([`Core::step`], after the driver fed it the readiness events)
//!
//! read and parse every ready session, executing local requests at once and queueing remote
//! ones → drain the inbox (bounded) → fire the timers (bounded) → route their answers → top up
//! the token reservation → flush the outboxes (one wake per destination) → resume sessions
//! that waited for room in an outbox → flush every session with output (one `write` pass each;
//! a session still waiting for prompt answers from other cores is held back, by at most
//! [`REMOTE_HOLD_US`], so that a pipelined batch leaves in one write) → end the sessions whose
//! close completed (see [`super::close`]) → shutdown bookkeeping.
//!
//! # Invariants
//!
//! * A session's requests for one key go to one partition, in order, through one path (the
//!   local table or one channel), so their answers come back in order.
//! * A session's slot is freed only after every partition acknowledged its close; after that
//!   no message can name it. Session ids carry a generation besides the slot anyway.
//! * Every grant is delivered or released: an `A` that reaches a session which can no longer
//!   write it, or that is still unsent when its session dies, is released at once by the
//!   partition that granted it.
//! * Nothing blocks and every queue is bounded: a full channel leaves messages in the outbox,
//!   an outbox with [`OUTBOX_REQUESTS_MAX`] requests takes no more (the session waits), a full
//!   socket leaves output in the session, and a session over its bounds is not read.
//!
//! Not here: frame syntax ([`latchkey_client::protocol`]), lock semantics ([`crate::lock_table`]), the
//! close protocol ([`super::close`]), sockets and polling ([`super::reactor`]).

use super::admin::{AdminJob, KeyScan};
use super::buffers::ReadBuffers;
use super::close::CloseReason;
use super::net::Net;
use super::route::{KeyPool, Msg, Outbox, OUTBOX_REQUESTS_MAX};
use super::session::{Phase, ReadOutcome, Session};
use super::Shared;
use crate::auth::AuthRules;
use crate::lock_table::LockTable;
use crate::partition::GrantRef;
use crate::partition::Partition;
use crate::partition::NOBODY;
use crate::partition::{Answer, Op, SessionId};
use crate::partition::{ClientRef, Fate};
use crate::tokens::TokenKeeper;
use crossbeam_channel::Receiver;
use latchkey_client::protocol::{parse_request, ErrorCode, FrameError, Request, Response};
use slab::Slab;
use std::sync::Arc;
use std::time::Duration;

/// Inbox messages handled per iteration before the loop polls again (the time budget below
/// usually ends the batch first).
const INBOX_BATCH_MAX: usize = 8192;
/// Time one iteration may spend executing frames and inbox messages before it leaves the rest
/// for the next iteration, so that a burst on some sessions (thousands of pipelined requests
/// into a table of millions of keys, cache-cold) never holds the others for milliseconds.
pub const ITERATION_BUDGET_US: u64 = 500;
/// Frames or messages between two looks at the clock while within the budget.
const BUDGET_CHECK_EVERY: u32 = 32;
/// Buffer fills read from one session per pass before others get their turn.
const READS_PER_PASS_MAX: usize = 4;
/// Bits of a session id: core, slot, generation.
const SLOT_BITS: u32 = 22;
const GENERATION_BITS: u32 = 32;
/// Sessions one core can hold (slot numbers).
pub const SLOTS_MAX: usize = 1 << SLOT_BITS;
/// Bits of a session id that name its core.
const CORE_BITS: u32 = 64 - SLOT_BITS - GENERATION_BITS;
/// Longest a session's answers wait for the prompt answers of its requests to other cores, so
/// that they leave in one `write` (see `flush_sessions`). Normally the wait ends sooner: when
/// those answers arrive, one cross-core round trip later.
pub const REMOTE_HOLD_US: u64 = 100;
/// Passes over the sessions with output per iteration (see `flush_sessions`).
const FLUSH_PASSES_MAX: usize = 2;
/// Idle read buffers a core keeps for its next readers.
const IDLE_BUFFERS_KEPT: usize = 1024;

const _: () = assert!(SLOTS_MAX > crate::config::CONNECTIONS_MAX);
const _: () = assert!(crate::config::CORES_MAX <= 1 << CORE_BITS);

/// The id of the session in `slot` of `core`, `generation`-th use of that slot.
pub fn session_id(core: usize, slot: usize, generation: u32) -> SessionId {
    ((core as u64) << (SLOT_BITS + GENERATION_BITS))
        | ((slot as u64) << GENERATION_BITS)
        | u64::from(generation)
}

/// The core that owns a session id.
pub fn core_of(session: SessionId) -> usize {
    (session >> (SLOT_BITS + GENERATION_BITS)) as usize
}

/// The slab slot of a session id within its core.
pub fn slot_of(session: SessionId) -> usize {
    ((session >> GENERATION_BITS) & ((1 << SLOT_BITS) - 1)) as usize
}

/// Per-core limits and identity.
#[derive(Clone, Copy, Debug)]
pub struct CoreSettings {
    /// This core's index.
    pub index: usize,
    /// Number of cores (= partitions).
    pub cores: usize,
    /// Sessions the whole server may have.
    pub max_connections: usize,
    /// Queued acquires per session at most (the lock tables enforce it; here it sizes the
    /// bound on requests in flight to other cores).
    pub max_pending_per_session: u32,
    /// Longest key accepted.
    pub max_key_bytes: usize,
}

/// The ways of one core to the rest of the server.
pub struct Links {
    /// This core's inbox.
    pub inbox: Receiver<Msg>,
    /// One outbox per other core; `None` at this core's own index.
    pub outboxes: Vec<Option<Outbox>>,
    /// What the cores share.
    pub shared: Arc<Shared>,
    /// Long-key buffers shared by the cores.
    pub key_pool: KeyPool,
    /// Keeps the token reservation topped up.
    pub tokens: TokenKeeper,
    /// The authorization rules, if any (see [`crate::auth`]).
    pub auth: Option<Arc<AuthRules>>,
}

/// One core: everything it owns.
pub struct Core<N: Net, P: Partition = LockTable> {
    pub(super) settings: CoreSettings,
    pub(super) net: N,
    pub(super) sessions: Slab<Session<N::Stream>>,
    pub(super) generation: u32,
    pub(super) buffers: ReadBuffers,
    pub(super) table: P,
    pub(super) links: Links,
    pub(super) now_us: u64,
    dirty: Vec<usize>,
    /// Scratch list of the sessions whose output `flush_sessions` holds back.
    held: Vec<usize>,
    scheduled: Vec<usize>,
    /// Sessions (slot, id) not read until the outbox of a partition has room again.
    blocked: Vec<(usize, SessionId, usize)>,
    pub(super) closing: Vec<usize>,
    more_inbox: bool,
    pub(super) lingering: usize,
    pub(super) stop_deadline: Option<u64>,
    pub(super) refusals_logged_us: u64,
    /// Earliest instant a held session's output must be written.
    hold_wake_us: Option<u64>,
    /// Sessions with output that the last flush left unwritten without holding them.
    unflushed: usize,
    /// This iteration's work budget.
    budget: Budget,
    /// Admin HTTP requests this core serves, and `/keys` scans of its partition.
    pub(super) admin_jobs: Vec<AdminJob>,
    pub(super) key_scans: Vec<KeyScan>,
    pub(super) counters: CoreCounters,
    pub(super) logs: super::logs::CoreLogs,
    /// Sessions in a handshake (TLS), with their deadlines.
    pub(super) handshakes: super::handshake::Handshakes,
    /// The graces of identified clients whose last session closed here: (end µs, client).
    pub(super) graces: std::collections::BinaryHeap<std::cmp::Reverse<(u64, u32)>>,
    /// When this core next publishes its figures for the health port, if there is one.
    pub(super) health_publish_us: u64,
}

/// What a core counts besides its partition (see [`super::admin::render::CoreStats`]).
#[derive(Clone, Copy, Debug, Default)]
pub struct CoreCounters {
    /// Sessions refused at `max_connections`.
    pub sessions_refused: u64,
    /// Acquire frames answered `X`.
    pub acquires_rejected: u64,
    /// Keyed requests answered `X` code 8.
    pub requests_forbidden: u64,
    /// TLS sessions closed for a TLS error or a handshake past its deadline.
    pub tls_failures: u64,
}

/// How much of its time budget an iteration has used (see [`ITERATION_BUDGET_US`]).
#[derive(Clone, Copy, Debug, Default)]
struct Budget {
    start_us: u64,
    units: u32,
    spent: bool,
}

/// What executing one frame did.
pub(super) enum Step {
    Incomplete,
    Executed,
    /// The frame's partition has no room in its outbox: not executed, try again later.
    Blocked(usize),
    Closed,
}

impl<N: Net, P: Partition> Core<N, P> {
    /// Assembles a core. `links.outboxes[settings.index]` must be `None`.
    pub fn new(settings: CoreSettings, net: N, table: P, links: Links) -> Core<N, P> {
        assert!(links.outboxes[settings.index].is_none());
        assert_eq!(links.outboxes.len(), settings.cores);
        Core {
            settings,
            net,
            sessions: Slab::new(),
            generation: 0,
            buffers: ReadBuffers::new(IDLE_BUFFERS_KEPT),
            table,
            links,
            now_us: 0,
            dirty: Vec::new(),
            held: Vec::new(),
            scheduled: Vec::new(),
            blocked: Vec::new(),
            closing: Vec::new(),
            more_inbox: false,
            lingering: 0,
            stop_deadline: None,
            refusals_logged_us: 0,
            hold_wake_us: None,
            unflushed: 0,
            budget: Budget::default(),
            admin_jobs: Vec::new(),
            key_scans: Vec::new(),
            counters: CoreCounters::default(),
            logs: super::logs::CoreLogs::default(),
            handshakes: Default::default(),
            graces: Default::default(),
            health_publish_us: 0,
        }
    }

    /// This core's index.
    pub fn index(&self) -> usize {
        self.settings.index
    }

    /// Sets the time of this iteration (microseconds on the server's monotonic clock, which
    /// [`Net::now_us`] reads too) and starts its work budget.
    pub fn set_now(&mut self, now_us: u64) {
        self.now_us = now_us;
        self.budget = Budget {
            start_us: now_us,
            ..Budget::default()
        };
    }

    /// Counts one unit of work; true once this iteration's budget is spent (then it stays so).
    fn over_budget(&mut self) -> bool {
        let budget = &mut self.budget;
        if !budget.spent {
            budget.units += 1;
            if budget.units % BUDGET_CHECK_EVERY == 0 {
                budget.spent = self.net.now_us() >= budget.start_us + ITERATION_BUDGET_US;
            }
        }
        budget.spent
    }

    /// Whether the core still accepts sessions (false once shutting down).
    pub fn is_accepting(&self) -> bool {
        self.stop_deadline.is_none()
    }

    /// Sessions this core holds (open or closing).
    #[cfg(any(test, feature = "testing"))]
    pub fn session_count(&self) -> usize {
        self.sessions.len()
    }

    /// The partition: the lock table of a single node (for checks and statistics).
    #[cfg(any(test, feature = "testing"))]
    pub fn table(&self) -> &P {
        &self.table
    }

    /// Read buffers in existence and lent now.
    #[cfg(any(test, feature = "testing"))]
    pub fn read_buffers(&self) -> (usize, usize) {
        (self.buffers.allocated(), self.buffers.lent())
    }

    /// Messages waiting in the outbox towards `core`.
    #[cfg(any(test, feature = "testing"))]
    pub fn outbox_len(&self, core: usize) -> usize {
        self.links.outboxes[core].as_ref().map_or(0, Outbox::len)
    }

    /// The poll timeout: zero when work is left, else until `wake_at_us` (a millisecond-rounded
    /// backstop: the alarm rings on time).
    pub fn poll_timeout(&self, wake_at_us: Option<u64>) -> Option<Duration> {
        let busy = !self.scheduled.is_empty()
            || self.unflushed > 0
            || self.more_inbox
            || self.links.outboxes.iter().flatten().any(|o| !o.is_empty());
        if busy {
            return Some(Duration::ZERO);
        }
        let timer = wake_at_us.map(|at| Duration::from_micros(at.saturating_sub(self.now_us)));
        // Stopping and lingering sessions are checked every few milliseconds.
        match (timer, self.stop_deadline.is_some() || self.lingering > 0) {
            (Some(timer), true) => Some(timer.min(Duration::from_millis(10))),
            (None, true) => Some(Duration::from_millis(10)),
            (timer, false) => timer,
        }
    }

    /// When the loop must run again without an event: the next timer, or the end of an
    /// output hold.
    pub fn wake_at_us(&self) -> Option<u64> {
        [
            self.table.next_deadline_us(),
            self.hold_wake_us,
            self.admin_wake_us(),
            self.handshakes.next_deadline_us(),
            self.grace_wake_us(),
        ]
        .into_iter()
        .flatten()
        .min()
    }

    /// A readiness event for the partition's source `source`.
    pub fn on_source_ready(&mut self, source: usize) {
        self.table.on_source_ready(source);
    }

    /// A readiness event for the session in `slot`.
    pub fn on_ready(&mut self, slot: usize, readable: bool, writable: bool, closed: bool) {
        let Some(session) = self.sessions.get(slot) else {
            return;
        };
        if (writable || closed) && session.has_output() {
            self.mark_dirty(slot);
        }
        if (readable || closed) && self.budget.spent {
            // Read next iteration, after the sessions that waited longer.
            return self.schedule(slot);
        }
        if closed {
            self.read_session(slot, true);
        } else if readable {
            self.read_session(slot, false);
        }
    }

    /// Everything of one iteration after the events (see the module docs). Returns true when
    /// this core should stop now.
    pub fn step(&mut self) -> bool {
        self.run_scheduled();
        self.drain_inbox();
        self.table.handle_timers(self.now_us);
        self.route_answers();
        self.advance_scans();
        self.expire_admin_jobs();
        self.publish_health();
        self.expire_handshakes();
        self.end_graces();
        self.log_busy();
        self.table.top_up_tokens(&mut self.links.tokens);
        self.flush_outboxes();
        self.resume_blocked();
        self.flush_sessions();
        self.end_closed_sessions();
        self.shutdown_step()
    }

    /// Reads the sessions scheduled for a read without an event. Those the budget leaves
    /// unread keep their place at the front of the next iteration's list (and their
    /// `scheduled` mark), so no session waits behind others forever.
    fn run_scheduled(&mut self) {
        // In place, so that the list keeps its capacity (no allocation per iteration): the
        // first `count` entries are this pass's; reads may append new ones after them.
        let count = self.scheduled.len();
        let mut kept = 0;
        for index in 0..count {
            let slot = self.scheduled[index];
            if !self.sessions.contains(slot) {
                continue;
            }
            if self.budget.spent {
                self.scheduled[kept] = slot;
                kept += 1;
                continue;
            }
            self.sessions[slot].clear_scheduled();
            self.read_session(slot, true);
        }
        self.scheduled.drain(kept..count);
    }

    pub(super) fn schedule(&mut self, slot: usize) {
        if self.sessions[slot].mark_scheduled() {
            self.scheduled.push(slot);
        }
    }

    pub(super) fn mark_dirty(&mut self, slot: usize) {
        if self.sessions[slot].mark_dirty() {
            self.dirty.push(slot);
        }
    }

    /// Parses what is buffered, then reads, a bounded number of buffer fills. `eager` reads
    /// until `WouldBlock` (see [`Session::read`]).
    fn read_session(&mut self, slot: usize, eager: bool) {
        for _ in 0..READS_PER_PASS_MAX {
            if !self.parse_session(slot) {
                return;
            }
            match self.sessions[slot].read(&mut self.buffers, eager) {
                ReadOutcome::Drained => {
                    self.parse_session(slot);
                    return;
                }
                ReadOutcome::Full => {}
                ReadOutcome::Eof => {
                    // The end of input may come with the last data. Close only once every
                    // complete frame was executed: a session paused over its bounds resumes
                    // later, and its next read sees the end of input again.
                    if self.parse_session(slot) {
                        self.begin_close(slot, Phase::Draining, CloseReason::EndOfInput);
                    }
                    return;
                }
                ReadOutcome::Failed => return self.read_failed(slot),
            }
        }
        self.schedule(slot);
    }

    /// Executes every complete buffered frame. Returns false when the session must not be
    /// read now (closing, or over its bounds: it is resumed when they drain).
    fn parse_session(&mut self, slot: usize) -> bool {
        let pending_max = self.settings.max_pending_per_session;
        // Bounded: every pass consumes a frame, and the buffer is finite.
        loop {
            let session = &mut self.sessions[slot];
            if session.phase() != Phase::Open {
                return false;
            }
            if session.over_bounds(pending_max) {
                session.pause();
                return false;
            }
            if self.over_budget() {
                self.schedule(slot);
                return false;
            }
            match self.execute_next_frame(slot) {
                Step::Incomplete => return true,
                Step::Executed => self.route_answers(),
                Step::Blocked(partition) => {
                    let session = &mut self.sessions[slot];
                    session.pause();
                    self.blocked.push((slot, session.id(), partition));
                    return false;
                }
                Step::Closed => return false,
            }
        }
    }

    /// Parses and executes the session's next frame (or answers its error).
    fn execute_next_frame(&mut self, slot: usize) -> Step {
        if let Some(waiting) = self.admin_read(slot) {
            return if waiting {
                Step::Incomplete
            } else {
                Step::Closed
            };
        }
        let session = &self.sessions[slot];
        let unparsed = session.unparsed(&self.buffers);
        let (request, used) = match parse_request(unparsed, self.settings.max_key_bytes) {
            Ok(None) => return Step::Incomplete,
            Ok(Some(frame)) => frame,
            Err(error) => return self.refuse_frame(slot, error),
        };
        let id = session.id();
        if let Request::Identify {
            grace_s,
            client,
            nonce,
        } = request
        {
            return self.identify(slot, (grace_s, client, nonce), used);
        }
        let client = session.client();
        if matches!(request, Request::Resolve { .. }) && !client.is_some() {
            let (code, id) = (ErrorCode::NotIdentified, request.correlation_id());
            return self.answer_refused(
                slot,
                FrameError {
                    code,
                    id,
                    consumed: used,
                },
            );
        }
        let Some((op, key)) = Op::of(&request) else {
            // Ping: answered here, unordered with keyed answers (docs/protocol.md §3).
            let pong = Response::Pong {
                nonce: request.correlation_id(),
            };
            let session = &mut self.sessions[slot];
            session.push_answer(&pong);
            session.consume(used, &mut self.buffers);
            self.mark_dirty(slot);
            return Step::Executed;
        };
        if let Some(rules) = &self.links.auth {
            if !self.sessions[slot].grant(rules).permits(key) {
                self.counters.requests_forbidden += 1;
                let id = request.correlation_id();
                let session = &self.sessions[slot];
                super::logs::log_forbidden(&mut self.logs, self.now_us, session, key);
                let (code, consumed) = (ErrorCode::Forbidden, used);
                return self.answer_refused(slot, FrameError { code, id, consumed });
            }
        }
        let partition = self.table.core_of_key(key, self.settings.cores);
        let remote = partition != self.settings.index;
        if remote {
            let outbox = self.links.outboxes[partition]
                .as_mut()
                .expect("another core");
            if outbox.is_full() {
                return Step::Blocked(partition);
            }
            let key = self.links.key_pool.copy(key);
            outbox.push(Msg::Request {
                session: id,
                client,
                op,
                key,
            });
        } else {
            self.table.handle(self.now_us, id, client, op, key);
        }
        let session = &mut self.sessions[slot];
        session.consume(used, &mut self.buffers);
        session.note_request(op.may_wait(), remote && op.expects_answer());
        Step::Executed
    }

    /// Logs a refused frame and answers it with its `X`; a closing error ends the session.
    fn refuse_frame(&mut self, slot: usize, error: FrameError) -> Step {
        self.log_refused_frame(slot, error.code);
        self.answer_refused(slot, error)
    }

    /// Answers a refused frame (logged already) with its `X`; a closing error ends the session.
    fn answer_refused(&mut self, slot: usize, error: FrameError) -> Step {
        let session = &mut self.sessions[slot];
        if session.unparsed(&self.buffers).first() == Some(&b'A') {
            self.counters.acquires_rejected += 1;
        }
        let session = &mut self.sessions[slot];
        session.push_answer(&error.response());
        self.mark_dirty(slot);
        if error.code.closes_session() {
            self.sessions[slot].discard_input(&mut self.buffers);
            let reason = CloseReason::Error(error.code as u8);
            self.begin_close(slot, Phase::Draining, reason);
            return Step::Closed;
        }
        self.sessions[slot].consume(error.consumed, &mut self.buffers);
        Step::Executed
    }

    /// Delivers every answer the local table produced.
    pub(super) fn route_answers(&mut self) {
        // Bounded: an answer produces further answers only through a release of a grant that
        // was never delivered, which hands the key to the next waiter at most once per waiter.
        loop {
            let answers = self.table.take_answers();
            if answers.is_empty() {
                return self.table.return_answers(answers);
            }
            for answer in &answers {
                self.route_answer(answer);
            }
            self.table.return_answers(answers);
        }
    }

    fn route_answer(&mut self, answer: &Answer) {
        if answer.session == NOBODY {
            return;
        }
        let index = self.settings.index;
        let core = core_of(answer.session);
        if core == index {
            if let Err(client) = self.deliver(answer, index, false) {
                self.release_undelivered(index, answer, client);
            }
            return;
        }
        match self.links.outboxes.get_mut(core).and_then(Option::as_mut) {
            Some(outbox) => outbox.push(Msg::Answer {
                answer: *answer,
                from: index as u32,
            }),
            None => log::error!("answer for a session of unknown core {core}"),
        }
    }

    /// Writes an answer from `partition` to a local session. `Err` with the client the session
    /// spoke for when the session cannot take it (gone or dead): then a grant in it must be
    /// released by the caller (or kept for that client).
    fn deliver(
        &mut self,
        answer: &Answer,
        partition: usize,
        remote: bool,
    ) -> Result<(), ClientRef> {
        let slot = slot_of(answer.session);
        let Some(session) = self.sessions.get_mut(slot) else {
            return Err(ClientRef::NONE);
        };
        if session.id() != answer.session {
            return Err(ClientRef::NONE);
        }
        session.note_answer(answer.ends_pending, remote);
        if matches!(session.phase(), Phase::Dead | Phase::Lingering) {
            return Err(session.client());
        }
        if let Response::Resolved {
            fate: Fate::Queued, ..
        } = answer.response
        {
            // The acquire resolved is now this session's, pending as if it had sent it.
            session.note_request(true, remote);
        }
        session.push_grant(&answer.response, partition, answer.grant);
        let resume = session.resume(self.settings.max_pending_per_session);
        self.mark_dirty(slot);
        if resume {
            self.schedule(slot);
        }
        Ok(())
    }

    /// A grant that will never be written: the partition that made it releases it at once
    /// (or keeps it for `client`, the identified client its session spoke for).
    fn release_undelivered(&mut self, partition: usize, answer: &Answer, client: ClientRef) {
        if let Response::Acquired { token, .. } = answer.response {
            self.release_grant(partition, answer.grant, token, client);
        }
    }

    /// Releases `token`'s grant `grant` in `partition` (here, or by a message), or has it kept
    /// for `client`.
    pub(super) fn release_grant(
        &mut self,
        partition: usize,
        grant: GrantRef,
        token: u64,
        client: ClientRef,
    ) {
        log::debug!("token {token}: its grant never reached its session");
        if partition == self.settings.index {
            self.table
                .release_granted(self.now_us, grant, token, client);
            return;
        }
        match self.links.outboxes[partition].as_mut() {
            Some(outbox) => outbox.push(Msg::OrphanRelease {
                grant,
                token,
                client,
            }),
            None => log::error!("grant of unknown partition {partition}"),
        }
    }

    fn drain_inbox(&mut self) {
        self.more_inbox = false;
        for _ in 0..INBOX_BATCH_MAX {
            if self.over_budget() {
                break;
            }
            let Ok(msg) = self.links.inbox.try_recv() else {
                return;
            };
            self.handle_msg(msg);
        }
        self.more_inbox = true;
    }

    fn handle_msg(&mut self, msg: Msg) {
        match msg {
            Msg::Request {
                session,
                client,
                op,
                key,
            } => {
                self.table.handle(self.now_us, session, client, op, &key);
                self.links.key_pool.give(key);
            }
            Msg::Answer { answer, from } => {
                if let Err(client) = self.deliver(&answer, from as usize, true) {
                    self.release_undelivered(from as usize, &answer, client);
                }
            }
            Msg::SessionClosed { session, client } => {
                self.table.handle_session_closed(session, client);
                if let Some(outbox) = self.links.outboxes[core_of(session)].as_mut() {
                    outbox.push(Msg::ClosedAck { session });
                }
            }
            Msg::ClosedAck { session } => {
                if let Some(open) = self.sessions.get_mut(slot_of(session)) {
                    if open.id() == session {
                        open.ack();
                    }
                }
            }
            Msg::OrphanRelease {
                grant,
                token,
                client,
            } => {
                self.table
                    .release_granted(self.now_us, grant, token, client);
            }
            Msg::ClientGone { client } => self.table.handle_client_gone(self.now_us, client),
            Msg::ClientKnown(known) => {
                let (client, id, grace_s) = *known;
                self.table.handle_client_known(client, id, grace_s);
            }
            Msg::Admin(msg) => self.handle_admin_msg(*msg),
        }
        self.route_answers();
    }

    pub(super) fn flush_outboxes(&mut self) {
        for outbox in self.links.outboxes.iter_mut().flatten() {
            outbox.flush();
        }
    }

    /// Reads again the sessions that waited for an outbox that now has room.
    fn resume_blocked(&mut self) {
        if self.blocked.is_empty() {
            return;
        }
        let pending_max = self.settings.max_pending_per_session;
        let mut waiting = Vec::new();
        for (slot, id, partition) in std::mem::take(&mut self.blocked) {
            let full = self.links.outboxes[partition]
                .as_ref()
                .is_some_and(Outbox::is_full);
            if full {
                waiting.push((slot, id, partition));
                continue;
            }
            let session = self.sessions.get_mut(slot).filter(|s| s.id() == id);
            if session.is_some_and(|session| session.resume(pending_max)) {
                self.schedule(slot);
            }
        }
        self.blocked = waiting;
    }

    /// Writes every session with output, once each, except an open session still waiting for
    /// prompt answers from other cores: its output is held until they arrive or for at most
    /// [`REMOTE_HOLD_US`]. Without the hold, a pipelined batch split over partitions would
    /// leave in one `write` per partition and per loop iteration, and the client would then
    /// send its next requests in as many pieces: measured on 2 cores, 4.5 requests per `write`
    /// instead of 16, which costs more than the cross-core hop saves.
    pub(super) fn flush_sessions(&mut self) {
        let mut held = std::mem::take(&mut self.held);
        self.hold_wake_us = None;
        // A failed write kills its session, whose unsent grants are released: that may hand
        // keys to other sessions, which then have output too; they are written in a second
        // pass. Bounded: sessions left dirty after the last pass make the next poll return at
        // once (see `poll_timeout`).
        for _ in 0..FLUSH_PASSES_MAX {
            let mut dirty = std::mem::take(&mut self.dirty);
            if dirty.is_empty() {
                self.dirty = dirty;
                break;
            }
            for &slot in &dirty {
                let Some(session) = self.sessions.get_mut(slot) else {
                    continue;
                };
                if let Some(until) = session.hold_output(self.now_us, REMOTE_HOLD_US) {
                    held.push(slot);
                    self.hold_wake_us = Some(self.hold_wake_us.map_or(until, |t| t.min(until)));
                    continue;
                }
                self.flush_session(slot);
            }
            dirty.clear();
            if self.dirty.is_empty() {
                self.dirty = dirty;
            }
        }
        // Held sessions stay dirty and are looked at again when their hold ends.
        self.unflushed = self.dirty.len();
        self.dirty.append(&mut held);
        self.held = held;
    }

    fn flush_session(&mut self, slot: usize) {
        let session = &mut self.sessions[slot];
        session.clear_dirty();
        if session.phase() == Phase::Dead {
            return;
        }
        match session.flush() {
            Ok(_) => {
                if session.resume(self.settings.max_pending_per_session) {
                    self.schedule(slot);
                }
            }
            Err(e) => {
                log::debug!("session {:#x}: write failed: {e}", session.id());
                self.begin_close(slot, Phase::Dead, CloseReason::WriteFailed);
            }
        }
    }

    /// Nothing left to do here unless someone sends something.
    pub(super) fn is_quiescent(&self) -> bool {
        self.table.is_quiescent()
            && !self.admin_busy()
            && self.scheduled.is_empty()
            && !self.more_inbox
            && self.links.inbox.is_empty()
            && self.links.outboxes.iter().flatten().all(Outbox::is_empty)
            && self
                .sessions
                .iter()
                .all(|(_, session)| session.is_settled())
    }
}

const _: () = assert!(OUTBOX_REQUESTS_MAX >= 1);
