//! One core's event loop: its listener, its sessions, its partition of the key space.
//!
//! # One iteration
//!
//! poll → read and parse every ready session, executing local requests at once and queueing
//! remote ones → drain the inbox (bounded) → advance the timers → flush the outboxes (one
//! wake per destination) → flush every session with output (one `write` pass each; a session
//! still waiting for prompt answers from other cores is held back, by at most
//! `REMOTE_HOLD_US`, so that a pipelined batch leaves in one write) → end the sessions whose
//! close completed → shutdown bookkeeping. `Instant::now()` is read once per
//! iteration; the lock table only ever sees that `now_us`.
//!
//! # Invariants
//!
//! * A session's requests for one key go to one partition, in order, through one path (the
//!   local table or one channel), so their answers come back in order.
//! * A session's slot is freed only after every partition acknowledged its close; after that
//!   no message can name it. Session ids carry a generation besides the slot anyway.
//! * A grant (`A`) that reaches a session which can no longer write it is released at once.
//! * Nothing blocks: a full channel leaves messages in the outbox, a full socket leaves output
//!   in the session; a session over its bounds is simply not read until it drains.
//!
//! Not here: frame syntax ([`crate::protocol`]), lock semantics ([`crate::lock_table`]).

use super::alarm::Alarm;
use super::route::{partition_of, Msg, Outbox, RemoteOp};
use super::session::{BufferPool, Phase, ReadOutcome, Session};
use super::Shared;
use crate::lock_table::{Answer, KeyBytes, LockTable, SessionId};
use crate::protocol::{parse_request, ErrorCode, Request, Response, KEY_BYTES_MAX};
use crate::tokens::{StateDir, RESERVATION_TOKENS};
use crossbeam_channel::Receiver;
use mio::net::{TcpListener, TcpStream};
use mio::{Events, Interest, Poll, Token};
use slab::Slab;
use std::io::{self, Write};
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Token of the listener.
const LISTENER: Token = Token(0);
/// Token of the waker other cores (and shutdown) use.
pub const WAKER: Token = Token(1);
/// Token of the timer alarm.
const ALARM: Token = Token(2);
/// Session tokens are slab slots plus this.
const SESSION_TOKEN_BASE: usize = 3;
/// Readiness events taken per poll.
const EVENTS_MAX: usize = 1024;
/// Inbox messages handled per iteration before the loop polls again.
const INBOX_BATCH_MAX: usize = 8192;
/// Buffer fills read from one session per pass before others get their turn.
const READS_PER_PASS_MAX: usize = 4;
/// Bits of a session id: core, slot, generation.
const SLOT_BITS: u32 = 22;
const GENERATION_BITS: u32 = 32;
/// Sessions one core can hold (slot numbers).
pub const SLOTS_MAX: usize = 1 << SLOT_BITS;
/// Cores a session id can name.
pub const CORES_MAX: usize = 1 << (64 - SLOT_BITS - GENERATION_BITS);
/// The session of answers nobody reads (releases of orphaned grants).
const NOBODY: SessionId = u64::MAX;
/// How long a shutdown may take before the core stops regardless (the contract says 5 s).
const SHUTDOWN_GRACE: Duration = Duration::from_millis(4500);
/// How long a closed session keeps dropping the peer's unread input before the socket closes.
const LINGER: Duration = Duration::from_secs(2);
/// Longest a session's answers wait for the prompt answers of its requests to other cores, so
/// that they leave in one `write` (see `flush_sessions`). Normally the wait ends sooner: when
/// those answers arrive, one cross-core round trip later.
const REMOTE_HOLD_US: u64 = 100;

const _: () = assert!(SLOTS_MAX > super::CONNECTIONS_MAX);

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
    /// Where token reservations are persisted, if anywhere.
    pub state_dir: Option<StateDir>,
}

/// One core: everything it owns.
pub struct Core {
    settings: CoreSettings,
    poll: Poll,
    alarm: Alarm,
    listener: Option<TcpListener>,
    sessions: Slab<Session>,
    generation: u32,
    pool: BufferPool,
    table: LockTable,
    inbox: Receiver<Msg>,
    outboxes: Vec<Option<Outbox>>,
    shared: Arc<Shared>,
    epoch: Instant,
    now_us: u64,
    dirty: Vec<usize>,
    /// Scratch list of the sessions whose output `flush_sessions` holds back.
    held: Vec<usize>,
    scheduled: Vec<usize>,
    closing: Vec<usize>,
    more_inbox: bool,
    lingering: usize,
    stop_deadline: Option<u64>,
    refusals_logged_us: u64,
    /// Earliest `hold_until_us` of the sessions whose output is held.
    hold_wake_us: Option<u64>,
}

impl Core {
    /// Assembles a core. `outboxes[index]` must be `None` (a core never messages itself).
    #[allow(clippy::too_many_arguments)]
    pub fn new(
        settings: CoreSettings,
        poll: Poll,
        listener: TcpListener,
        table: LockTable,
        inbox: Receiver<Msg>,
        outboxes: Vec<Option<Outbox>>,
        shared: Arc<Shared>,
        epoch: Instant,
    ) -> io::Result<Core> {
        assert!(outboxes[settings.index].is_none() && outboxes.len() == settings.cores);
        let mut listener = listener;
        poll.registry()
            .register(&mut listener, LISTENER, Interest::READABLE)?;
        let alarm = Alarm::new(poll.registry(), ALARM)?;
        Ok(Core {
            settings,
            poll,
            alarm,
            listener: Some(listener),
            sessions: Slab::new(),
            generation: 0,
            pool: BufferPool::new(1024),
            table,
            inbox,
            outboxes,
            shared,
            epoch,
            now_us: 0,
            dirty: Vec::new(),
            held: Vec::new(),
            scheduled: Vec::new(),
            closing: Vec::new(),
            more_inbox: false,
            lingering: 0,
            stop_deadline: None,
            refusals_logged_us: 0,
            hold_wake_us: None,
        })
    }

    /// Runs the loop until shutdown completes.
    pub fn run(mut self) -> io::Result<()> {
        let mut events = Events::with_capacity(EVENTS_MAX);
        loop {
            let deadline = self.wake_at_us();
            let timeout = self.poll_timeout(deadline);
            if let Err(e) = self
                .alarm
                .arm(deadline, || self.epoch.elapsed().as_micros() as u64)
            {
                // The poll timeout still wakes the loop, only up to a millisecond later.
                log::warn!(
                    "core {}: cannot arm the timer alarm: {e}",
                    self.settings.index
                );
            }
            match self.poll.poll(&mut events, timeout) {
                Ok(()) => {}
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => return Err(e),
            }
            self.now_us = self.epoch.elapsed().as_micros() as u64;
            for event in events.iter() {
                match event.token() {
                    LISTENER => self.accept_all(),
                    WAKER => {}
                    ALARM => self.alarm.acknowledge(),
                    Token(token) => self.on_session_event(token - SESSION_TOKEN_BASE, event),
                }
            }
            self.run_scheduled();
            self.drain_inbox();
            self.table.handle_timers(self.now_us);
            self.route_answers();
            self.top_up_tokens();
            self.flush_outboxes();
            self.flush_sessions();
            self.end_closed_sessions();
            if self.shutdown_step() {
                return Ok(());
            }
            let busy_us = (self.epoch.elapsed().as_micros() as u64).saturating_sub(self.now_us);
            self.shared.worst_loop_us[self.settings.index].record(busy_us);
        }
    }

    /// The poll timeout: zero when work is left, else until `wake_at_us` (a millisecond-rounded
    /// backstop: the alarm rings on time).
    fn poll_timeout(&self, wake_at_us: Option<u64>) -> Option<Duration> {
        let busy = !self.scheduled.is_empty()
            || self.more_inbox
            || self
                .outboxes
                .iter()
                .flatten()
                .any(|outbox| !outbox.is_empty());
        if busy {
            return Some(Duration::ZERO);
        }
        let timer =
            wake_at_us.map(|deadline| Duration::from_micros(deadline.saturating_sub(self.now_us)));
        // Stopping and lingering sessions are checked every few milliseconds.
        match (timer, self.stop_deadline.is_some() || self.lingering > 0) {
            (Some(timer), true) => Some(timer.min(Duration::from_millis(10))),
            (None, true) => Some(Duration::from_millis(10)),
            (timer, false) => timer,
        }
    }

    /// When the loop must run again without an event: the next timer, or the end of an
    /// output hold. The alarm rings then, to the microsecond.
    fn wake_at_us(&self) -> Option<u64> {
        match (self.table.next_deadline_us(), self.hold_wake_us) {
            (Some(timer), Some(hold)) => Some(timer.min(hold)),
            (timer, hold) => timer.or(hold),
        }
    }

    fn accept_all(&mut self) {
        // Bounded: the listen backlog is finite, and each pass takes one connection off it.
        loop {
            let Some(listener) = self.listener.as_ref() else {
                return;
            };
            match listener.accept() {
                Ok((stream, _)) => self.admit(stream),
                Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => return,
                Err(e) => {
                    log::warn!("core {}: accept failed: {e}", self.settings.index);
                    return;
                }
            }
        }
    }

    fn admit(&mut self, mut stream: TcpStream) {
        let count = self.shared.connections.fetch_add(1, Ordering::Relaxed);
        if count >= self.settings.max_connections || self.sessions.len() + 1 >= SLOTS_MAX {
            self.shared.connections.fetch_sub(1, Ordering::Relaxed);
            self.refuse(stream);
            return;
        }
        let _ = stream.set_nodelay(true);
        let slot = self.sessions.vacant_entry();
        let token = Token(slot.key() + SESSION_TOKEN_BASE);
        let interest = Interest::READABLE | Interest::WRITABLE;
        if let Err(e) = self.poll.registry().register(&mut stream, token, interest) {
            log::warn!(
                "core {}: cannot register a session: {e}",
                self.settings.index
            );
            self.shared.connections.fetch_sub(1, Ordering::Relaxed);
            return;
        }
        self.generation = self.generation.wrapping_add(1);
        let id = session_id(self.settings.index, slot.key(), self.generation);
        log::debug!("session {id:#x}: opened");
        slot.insert(Session::new(id, stream, self.pool.take()));
    }

    /// Sends `X` code 7 (best effort, without reading anything) and closes.
    fn refuse(&mut self, mut stream: TcpStream) {
        let mut frame = Vec::with_capacity(11);
        Response::Error {
            code: ErrorCode::SessionRefused,
            id: 0,
        }
        .encode(&mut frame);
        let _ = stream.write(&frame);
        let _ = stream.shutdown(std::net::Shutdown::Write);
        if self.now_us >= self.refusals_logged_us + 1_000_000 || self.refusals_logged_us == 0 {
            self.refusals_logged_us = self.now_us.max(1);
            log::warn!(
                "core {}: refusing a session: max_connections ({}) reached",
                self.settings.index,
                self.settings.max_connections
            );
        }
    }

    fn on_session_event(&mut self, slot: usize, event: &mio::event::Event) {
        let Some(session) = self.sessions.get(slot) else {
            return;
        };
        if event.is_writable() && session.unsent() > 0 {
            self.mark_dirty(slot);
        }
        if event.is_read_closed() || event.is_error() {
            self.read_session(slot, true);
        } else if event.is_readable() {
            self.read_session(slot, false);
        }
    }

    fn run_scheduled(&mut self) {
        let scheduled = std::mem::take(&mut self.scheduled);
        for &slot in &scheduled {
            if let Some(session) = self.sessions.get_mut(slot) {
                session.scheduled = false;
                self.read_session(slot, true);
            }
        }
        let mut scheduled = scheduled;
        scheduled.clear();
        if self.scheduled.is_empty() {
            self.scheduled = scheduled;
        }
    }

    fn schedule(&mut self, slot: usize) {
        let session = &mut self.sessions[slot];
        if !session.scheduled {
            session.scheduled = true;
            self.scheduled.push(slot);
        }
    }

    fn mark_dirty(&mut self, slot: usize) {
        let session = &mut self.sessions[slot];
        if !session.dirty {
            session.dirty = true;
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
            match self.sessions[slot].read(eager) {
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
                        self.begin_close(slot, Phase::Draining);
                    }
                    return;
                }
                ReadOutcome::Failed => return self.begin_close(slot, Phase::Dead),
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
            if session.phase != Phase::Open {
                return false;
            }
            if session.over_bounds(pending_max) {
                session.paused = true;
                return false;
            }
            match self.execute_next_frame(slot) {
                Step::Incomplete => return true,
                Step::Executed => self.route_answers(),
                Step::Closed => return false,
            }
        }
    }

    /// Parses and executes the session's next frame (or answers its error).
    fn execute_next_frame(&mut self, slot: usize) -> Step {
        let session = &self.sessions[slot];
        let parsed = parse_request(session.unparsed(), self.settings.max_key_bytes);
        let (request, used) = match parsed {
            Ok(None) => return Step::Incomplete,
            Ok(Some(frame)) => frame,
            Err(error) => {
                let session = &mut self.sessions[slot];
                error.response().encode(session.output());
                self.mark_dirty(slot);
                if error.code.closes_session() {
                    self.sessions[slot].discard_input();
                    self.begin_close(slot, Phase::Draining);
                    return Step::Closed;
                }
                self.sessions[slot].consume(error.consumed);
                return Step::Executed;
            }
        };
        let waits = matches!(request, Request::Acquire { wait_s: 1.., .. });
        let id = session.id;
        let mut remote = false;
        match request.key() {
            None => {
                let pong = Response::Pong {
                    nonce: request.correlation_id(),
                };
                let session = &mut self.sessions[slot];
                pong.encode(session.output());
                session.consume(used);
                self.mark_dirty(slot);
                return Step::Executed;
            }
            Some(key) => {
                let partition = partition_of(key, self.settings.cores);
                if partition == self.settings.index {
                    self.table.handle_request(self.now_us, id, &request);
                } else {
                    let op = RemoteOp::of(&request).expect("keyed request");
                    remote = op.expects_answer();
                    let msg = Msg::Request {
                        session: id,
                        op,
                        key: KeyBytes::new(key),
                    };
                    self.outboxes[partition]
                        .as_mut()
                        .expect("another core")
                        .push(msg);
                }
            }
        }
        let session = &mut self.sessions[slot];
        session.consume(used);
        session.pending += u32::from(waits);
        session.remote_unanswered += u32::from(remote);
        session.remote_prompt += u32::from(remote && !waits);
        Step::Executed
    }

    /// Delivers every answer the local table produced.
    fn route_answers(&mut self) {
        // Bounded: answers to NOBODY produce no further answers.
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
        let core = core_of(answer.session);
        if core == self.settings.index {
            if !self.deliver(answer, false) {
                self.release_local_orphan(answer);
            }
            return;
        }
        let key = match answer.response {
            Response::Acquired { .. } => self.table.entry_key(answer.entry).map(KeyBytes::new),
            _ => None,
        };
        match self.outboxes.get_mut(core).and_then(Option::as_mut) {
            Some(outbox) => outbox.push(Msg::Answer {
                answer: *answer,
                key,
            }),
            None => log::error!("answer for a session of unknown core {core}"),
        }
    }

    /// Writes an answer to a local session. Returns false when the session cannot take it
    /// (gone or dead).
    fn deliver(&mut self, answer: &Answer, remote: bool) -> bool {
        let slot = slot_of(answer.session);
        let Some(session) = self.sessions.get_mut(slot) else {
            return false;
        };
        if session.id != answer.session {
            return false;
        }
        debug_assert!(session.pending >= u32::from(answer.ends_pending));
        debug_assert!(session.remote_unanswered >= u32::from(remote));
        session.pending = session
            .pending
            .saturating_sub(u32::from(answer.ends_pending));
        session.remote_unanswered = session.remote_unanswered.saturating_sub(u32::from(remote));
        // Only answers to acquires that may wait end a pending acquire; every other remote
        // answer is the answer of a prompt request.
        let prompt = remote && !answer.ends_pending;
        debug_assert!(session.remote_prompt >= u32::from(prompt));
        session.remote_prompt = session.remote_prompt.saturating_sub(u32::from(prompt));
        if matches!(session.phase, Phase::Dead | Phase::Lingering) {
            return false;
        }
        answer.response.encode(session.output());
        let resume = session.may_resume(self.settings.max_pending_per_session);
        self.mark_dirty(slot);
        if resume {
            self.sessions[slot].paused = false;
            self.schedule(slot);
        }
        true
    }

    /// A local grant whose session is gone: the server releases it at once.
    fn release_local_orphan(&mut self, answer: &Answer) {
        let Response::Acquired { token, .. } = answer.response else {
            return;
        };
        let mut key = [0u8; KEY_BYTES_MAX];
        let Some(held) = self.table.entry_key(answer.entry) else {
            return;
        };
        let len = held.len();
        key[..len].copy_from_slice(held);
        log::debug!("releasing token {token}: granted to a closed session");
        self.table
            .handle_release(self.now_us, NOBODY, token, &key[..len]);
    }

    fn drain_inbox(&mut self) {
        self.more_inbox = false;
        for _ in 0..INBOX_BATCH_MAX {
            let Ok(msg) = self.inbox.try_recv() else {
                return;
            };
            self.handle_msg(msg);
        }
        self.more_inbox = true;
    }

    fn handle_msg(&mut self, msg: Msg) {
        match msg {
            Msg::Request { session, op, key } => {
                let request = op.with_key(&key);
                self.table.handle_request(self.now_us, session, &request);
                self.route_answers();
            }
            Msg::Answer { answer, key } => {
                if !self.deliver(&answer, true) {
                    if let (Response::Acquired { token, .. }, Some(key)) = (answer.response, key) {
                        let partition = partition_of(&key, self.settings.cores);
                        log::debug!("releasing token {token}: granted to a closed session");
                        let outbox = self.outboxes[partition].as_mut().expect("remote partition");
                        outbox.push(Msg::OrphanRelease { token, key });
                    }
                }
            }
            Msg::SessionClosed { session } => {
                self.table.handle_session_closed(session);
                self.route_answers();
                if let Some(outbox) = self.outboxes[core_of(session)].as_mut() {
                    outbox.push(Msg::ClosedAck { session });
                }
            }
            Msg::ClosedAck { session } => {
                if let Some(open) = self.sessions.get_mut(slot_of(session)) {
                    if open.id == session {
                        open.acks_awaited -= 1;
                    }
                }
            }
            Msg::OrphanRelease { token, key } => {
                self.table.handle_release(self.now_us, NOBODY, token, &key);
                self.route_answers();
            }
        }
    }

    /// Stops reading a session and withdraws its waiters everywhere; it ends once every
    /// partition acknowledged and (unless dead) its output is flushed.
    fn begin_close(&mut self, slot: usize, phase: Phase) {
        let session = &mut self.sessions[slot];
        if phase == Phase::Dead {
            session.discard_output();
        }
        if session.phase != Phase::Open {
            if phase == Phase::Dead {
                session.phase = Phase::Dead;
            }
            return;
        }
        session.phase = phase;
        session.discard_input();
        let id = session.id;
        log::debug!("session {id:#x}: closing ({phase:?})");
        let mut acks = 0;
        for outbox in self.outboxes.iter_mut().flatten() {
            outbox.push(Msg::SessionClosed { session: id });
            acks += 1;
        }
        self.sessions[slot].acks_awaited = acks;
        self.table.handle_session_closed(id);
        self.route_answers();
        self.closing.push(slot);
    }

    /// Ends the closing sessions that are done: acknowledged everywhere, output flushed, and
    /// (unless dead) the peer's unread input drained or the linger deadline passed.
    fn end_closed_sessions(&mut self) {
        let mut index = 0;
        self.lingering = 0;
        while index < self.closing.len() {
            let slot = self.closing[index];
            let now_us = self.now_us;
            let session = &mut self.sessions[slot];
            let flushed = session.phase == Phase::Dead || session.unsent() == 0;
            if session.acks_awaited > 0 || !flushed {
                index += 1;
                continue;
            }
            if session.phase == Phase::Draining {
                session.linger(now_us + LINGER.as_micros() as u64);
            }
            let done = session.phase == Phase::Dead
                || session.drop_incoming()
                || now_us >= session.linger_until_us;
            if !done {
                self.lingering += 1;
                index += 1;
                continue;
            }
            self.closing.swap_remove(index);
            let mut session = self.sessions.remove(slot);
            // Every partition withdrew the session's waiters before acknowledging its close.
            debug_assert_eq!(
                self.shared
                    .queues
                    .as_ref()
                    .map_or(0, |q| q.queued(session.id)),
                0,
                "session {:#x} freed with acquires counted as queued",
                session.id
            );
            let _ = self.poll.registry().deregister(&mut session.socket);
            log::debug!("session {:#x}: closed", session.id);
            self.pool.give(session.into_read_buffer());
            self.shared.connections.fetch_sub(1, Ordering::Relaxed);
        }
    }

    fn flush_outboxes(&mut self) {
        for outbox in self.outboxes.iter_mut().flatten() {
            outbox.flush();
        }
    }

    /// Writes every session with output, once each, except an open session still waiting for
    /// prompt answers from other cores: its output is held until they arrive or for at most
    /// [`REMOTE_HOLD_US`]. Without the hold, a pipelined batch split over partitions would
    /// leave in one `write` per partition and per loop iteration, and the client would then
    /// send its next requests in as many pieces: measured on 2 cores, 4.5 requests per `write`
    /// instead of 16, which costs more than the cross-core hop saves.
    fn flush_sessions(&mut self) {
        let dirty = std::mem::take(&mut self.dirty);
        let mut held = std::mem::take(&mut self.held);
        self.hold_wake_us = None;
        for &slot in &dirty {
            let Some(session) = self.sessions.get_mut(slot) else {
                continue;
            };
            if session.remote_prompt > 0 && session.phase == Phase::Open {
                let until = *session
                    .hold_until_us
                    .get_or_insert(self.now_us + REMOTE_HOLD_US);
                if self.now_us < until {
                    held.push(slot);
                    self.hold_wake_us = Some(self.hold_wake_us.map_or(until, |t| t.min(until)));
                    continue;
                }
            }
            session.hold_until_us = None;
            session.dirty = false;
            if session.phase == Phase::Dead {
                continue;
            }
            match session.flush() {
                Ok(_) => {
                    if session.may_resume(self.settings.max_pending_per_session) {
                        session.paused = false;
                        self.schedule(slot);
                    }
                }
                Err(e) => {
                    log::debug!("session {:#x}: write failed: {e}", session.id);
                    self.begin_close(slot, Phase::Dead);
                }
            }
        }
        // Held sessions stay dirty and are looked at again next iteration.
        let mut dirty = dirty;
        dirty.clear();
        dirty.append(&mut held);
        dirty.append(&mut self.dirty);
        self.dirty = dirty;
        self.held = held;
    }

    fn top_up_tokens(&mut self) {
        let Some(state) = self.settings.state_dir.as_ref() else {
            return;
        };
        if self.table.token_headroom() >= RESERVATION_TOKENS / 2 {
            return;
        }
        let step = self.settings.cores as u64;
        let limit = self
            .table
            .next_token()
            .saturating_add(RESERVATION_TOKENS * step);
        match state.persist(self.settings.index, limit) {
            Ok(()) => self.table.raise_token_limit(limit),
            Err(e) => log::error!(
                "core {}: cannot persist the token high-water mark: {e}",
                self.settings.index
            ),
        }
    }

    /// Shutdown bookkeeping. Returns true when this core should stop now.
    fn shutdown_step(&mut self) -> bool {
        if self.stop_deadline.is_none() {
            if !self.shared.shutdown.load(Ordering::Acquire) {
                return false;
            }
            self.begin_shutdown();
        }
        let quiescent = self.is_quiescent();
        let all = self.shared.mark_quiescent(self.settings.index, quiescent);
        let late = self
            .stop_deadline
            .is_some_and(|deadline| self.now_us >= deadline);
        if late && !all {
            log::warn!("core {}: shutdown grace ran out", self.settings.index);
        }
        all || late
    }

    fn begin_shutdown(&mut self) {
        log::debug!("core {}: shutting down", self.settings.index);
        if let Some(mut listener) = self.listener.take() {
            let _ = self.poll.registry().deregister(&mut listener);
        }
        self.stop_deadline = Some(self.now_us + SHUTDOWN_GRACE.as_micros() as u64);
        self.table.handle_shutdown();
        self.route_answers();
        self.flush_outboxes();
        self.flush_sessions();
    }

    /// Nothing left to do here unless someone sends something.
    fn is_quiescent(&self) -> bool {
        self.scheduled.is_empty()
            && !self.more_inbox
            && self.inbox.is_empty()
            && self.outboxes.iter().flatten().all(Outbox::is_empty)
            && self.sessions.iter().all(|(_, session)| {
                session.acks_awaited == 0
                    && match session.phase {
                        Phase::Open => session.remote_unanswered == 0 && session.unsent() == 0,
                        Phase::Draining => session.unsent() == 0,
                        Phase::Lingering | Phase::Dead => true,
                    }
            })
    }
}

/// What executing one frame did.
enum Step {
    Incomplete,
    Executed,
    Closed,
}
