//! One load thread: a mio loop driving many nonblocking connections.
//!
//! Each iteration: poll (until the next timer or phase deadline) → for every readable
//! connection: read, apply its answers (which queue the next requests) and write what they
//! queued in one `write` → fire due timers → flush every connection still holding queued bytes
//! (timer output, or what a full socket did not take) in one `write` each.
//!
//! Time: `Instant::now()` is read once per readable connection, right after its socket is
//! read, and handed to its session. So an answer is stamped when it was received and the
//! requests it triggers are stamped (sent-at, and a release's handoff stamp) within
//! microseconds of their `write`, not when the iteration began: with 50 connections an
//! iteration lasts tens of microseconds, which would otherwise be added to every latency.
//!
//! Reads: mio is edge-triggered, so a connection is read until `WouldBlock` or a short read
//! (which means the socket was drained). That loop is bounded: answers only come for requests
//! already sent, at most `pipeline` per connection, and the requests they trigger are not sent
//! until the read loop has ended.
//!
//! Streams: the worker is generic over its connections' [`BenchStream`] (plain TCP or TLS).
//! Over TLS a `write` may leave records in rustls when the socket is full; the connection then
//! asks for writability like for unsent requests, and `send` flushes them.
//!
//! Clusters: with several members in the target, a connection has one socket (a *lane*) per
//! member; its session's requests go to the lane of their key's leader (`cluster.rs`), and
//! answers are read from every lane. A single node has one lane per connection.
//!
//! Invariants: a lane's unsent bytes never exceed `pipeline` requests (one per slot), so
//! the buffers sized at connect time never grow; a `Token` is the worker's connection number
//! times the lanes per connection plus the lane, never reused (connections are not replaced),
//! so no generation is needed.
//!
//! Deliberately not here: the start gate, progress and RSS (the driver), what an answer means
//! (the session).

use std::io;
use std::net::SocketAddr;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

use mio::{Events, Interest, Poll, Token};

use super::cluster::{Leaders, Outbox, ShardMap};
use super::driver::{BenchError, Shared};
use super::stats::Stats;
use super::stream::BenchStream;
use super::wire::{Answer, Wire};
use super::workload::{Context, KeySource, Plan, ReplyError, Session, Timers};
use latchkey_client::protocol::ErrorCode;

/// Events handled per poll.
const EVENTS_MAX: usize = 1024;
/// Bytes of request buffer per slot: the longest request (Redis `EVALSHA`) is under 128.
const REQUEST_BYTES_PER_SLOT: usize = 128;
/// The smallest read buffer; a Redis error line may be up to 16 KiB.
const INPUT_BYTES_MIN: usize = 64 * 1024;
/// The longest a stopped run waits for cycles in flight to finish.
const DRAIN_MAX: Duration = Duration::from_secs(2);
/// How often a paused `hold` worker looks for the signal to start its waiters.
const PAUSE_POLL: Duration = Duration::from_millis(2);

const _: () = assert!(INPUT_BYTES_MIN >= super::redis::REPLY_BYTES_MAX + 64);

/// What a worker needs to know about its share of the run.
#[derive(Debug)]
pub struct WorkerSpec {
    /// Worker number.
    pub index: usize,
    /// Run-wide numbers of this worker's connections.
    pub connections: std::ops::Range<u32>,
    /// Requests outstanding per connection.
    pub pipeline: u16,
    /// The server, or the members of a cluster (a lane per member in every connection).
    pub members: Vec<SocketAddr>,
    /// Key numbers are below this (sizes the leader cache of a cluster).
    pub key_space: u64,
    /// A cluster's shard count: the leader cache is per shard.
    pub shards: Option<u32>,
    /// The run's plan.
    pub plan: Plan,
    /// This worker's keys.
    pub keys: KeySource,
    /// Unmeasured time.
    pub warmup: Duration,
    /// Measured time.
    pub duration: Duration,
}

/// What a worker hands back.
#[derive(Debug)]
pub struct WorkerOutcome {
    /// Its counters and histograms.
    pub stats: Stats,
    /// Its measured window (for `hold`: its grant phase).
    pub window: Duration,
    /// `hold`: sampled keys that got a waiter.
    pub samples: usize,
}

/// Why a connection was closed.
enum Failure {
    Io(String),
    Protocol(String),
}

/// One member's socket of a connection, with its read buffer.
struct Lane<S: BenchStream> {
    stream: S,
    input: Box<[u8]>,
    input_len: usize,
    wants_write: bool,
}

struct Connection<W: Wire, S: BenchStream> {
    lanes: Vec<Lane<S>>,
    /// Each lane's dialect and unsent bytes, beside `lanes` so that a session's outbox can
    /// borrow them all while one lane's input is parsed.
    wires: Vec<W>,
    outputs: Vec<Vec<u8>>,
    session: Session,
    dirty: bool,
    open: bool,
}

/// The worker's state apart from the poller, so that events can be iterated while it changes.
struct Core<W: Wire, S: BenchStream> {
    connections: Vec<Connection<W, S>>,
    plan: Plan,
    keys: KeySource,
    stats: Stats,
    timers: Timers,
    dirty: Vec<u32>,
    open: usize,
    pipeline: u16,
    shared: Arc<Shared>,
    /// The members and each key's leader, for every connection of this worker.
    leaders: Leaders,
}

/// A load thread.
pub struct Worker<W: Wire, S: BenchStream> {
    poll: Poll,
    events: Events,
    core: Core<W, S>,
    index: usize,
    warmup: Duration,
    duration: Duration,
}

impl<W: Wire, S: BenchStream> Worker<W, S> {
    /// Opens the worker's connections with `dial` (blocking, before the start gate: a TLS
    /// connection has done its handshake).
    pub fn connect(
        spec: WorkerSpec,
        shared: Arc<Shared>,
        mut dial: impl FnMut(SocketAddr) -> io::Result<S>,
        mut make_wire: impl FnMut() -> W,
    ) -> Result<Worker<W, S>, BenchError> {
        let poll = Poll::new().map_err(BenchError::Poll)?;
        let now = Instant::now();
        let pipeline = usize::from(spec.pipeline);
        let count = spec.connections.len();
        let members = spec.members.len();
        let mut connections = Vec::with_capacity(count);
        for (local, global) in spec.connections.clone().enumerate() {
            let mut lanes = Vec::with_capacity(members);
            for (lane, &address) in spec.members.iter().enumerate() {
                let failed = |error| BenchError::Connect { address, error };
                let mut stream = dial(address).map_err(failed)?;
                let token = Token(local * members + lane);
                poll.registry()
                    .register(&mut stream, token, Interest::READABLE)
                    .map_err(failed)?;
                lanes.push(Lane {
                    stream,
                    input: vec![0; INPUT_BYTES_MIN.max(pipeline * 32)].into_boxed_slice(),
                    input_len: 0,
                    wants_write: false,
                });
            }
            connections.push(Connection {
                lanes,
                wires: (0..members).map(|_| make_wire()).collect(),
                outputs: (0..members)
                    .map(|_| Vec::with_capacity(pipeline * REQUEST_BYTES_PER_SLOT))
                    .collect(),
                session: Session::new(local as u32, global, spec.pipeline, now),
                dirty: false,
                open: true,
            });
        }
        let shard_map = spec.shards.map(|shards| ShardMap {
            shards,
            prefix: spec.plan.prefix,
            tag: spec.plan.tag,
        });
        let core = Core {
            timers: Timers::new(&spec.plan, count * pipeline),
            plan: spec.plan,
            keys: spec.keys,
            stats: Stats::new(count),
            connections,
            dirty: Vec::with_capacity(count),
            open: count,
            pipeline: spec.pipeline,
            shared,
            leaders: Leaders::new(spec.members, spec.key_space, shard_map),
        };
        Ok(Worker {
            poll,
            events: Events::with_capacity(EVENTS_MAX),
            core,
            index: spec.index,
            warmup: spec.warmup,
            duration: spec.duration,
        })
    }

    /// One iteration: poll until `wake` (or the next timer), apply answers, fire timers,
    /// flush. Returns the time read after the poll.
    fn turn(&mut self, wake: Option<Instant>) -> Result<Instant, BenchError> {
        let deadline = match (wake, self.core.timers.next_deadline()) {
            (Some(a), Some(b)) => Some(a.min(b)),
            (a, b) => a.or(b),
        };
        let timeout = deadline.map(|at| at.saturating_duration_since(Instant::now()));
        match self.poll.poll(&mut self.events, timeout) {
            Ok(()) => {}
            Err(error) if error.kind() == io::ErrorKind::Interrupted => self.events.clear(),
            Err(error) => return Err(BenchError::Poll(error)),
        }
        let now = Instant::now();
        let lanes = self.core.leaders.members();
        for event in self.events.iter() {
            let (index, lane) = (event.token().0 / lanes, event.token().0 % lanes);
            if event.is_readable() || event.is_read_closed() || event.is_error() {
                self.core.read(index, lane, Instant::now(), &self.poll);
            }
            if event.is_writable() {
                self.core.mark_dirty(index);
            }
        }
        self.core.fire_timers(now);
        self.core.flush(&self.poll);
        self.publish();
        Ok(now)
    }

    fn publish(&self) {
        let progress = &self.core.shared.progress[self.index];
        let stats = &self.core.stats;
        progress
            .requests
            .store(stats.requests_total, Ordering::Relaxed);
        progress.cycles.store(stats.cycles_total, Ordering::Relaxed);
        let errors = stats.errors.io + stats.errors.protocol;
        progress.errors.store(errors, Ordering::Relaxed);
    }

    /// Runs `uncontended` or `contended` from `start`: warm-up, window, drain.
    pub fn run_timed(mut self, start: Instant) -> Result<WorkerOutcome, BenchError> {
        let window_start_at = start + self.warmup;
        let window_end_at = window_start_at + self.duration;
        let drain_end_at = window_end_at + DRAIN_MAX + self.core.plan.hold;
        self.core.kick(Instant::now(), &self.poll);
        let mut window: (Option<Instant>, Option<Instant>) = (None, None);
        loop {
            let wake = if window.0.is_none() {
                window_start_at
            } else if window.1.is_none() {
                window_end_at
            } else {
                drain_end_at
            };
            let now = self.turn(Some(wake))?;
            if window.0.is_none() && now >= window_start_at {
                self.core.stats.start_window();
                window.0 = Some(now);
            }
            if window.0.is_some()
                && window.1.is_none()
                && (now >= window_end_at || self.core.open == 0)
            {
                self.core.stats.recording = false;
                self.core.stop();
                window.1 = Some(now);
            }
            let drained = self.core.all_idle() || now >= drain_end_at;
            if window.1.is_some() && drained {
                break;
            }
        }
        let measured = match window {
            (Some(from), Some(to)) => to.saturating_duration_since(from),
            _ => Duration::ZERO,
        };
        Ok(WorkerOutcome {
            stats: self.core.stats,
            window: measured,
            samples: 0,
        })
    }

    /// Runs `hold` from `start`: grant every key of the worker's range and keep it, wait for
    /// the driver's signal (it reads the server's RSS meanwhile), then queue one waiter on each
    /// sampled key and record when the grants arrive.
    pub fn run_hold(mut self, start: Instant) -> Result<WorkerOutcome, BenchError> {
        self.core.stats.start_window();
        self.core.kick(Instant::now(), &self.poll);
        let mut now = start;
        while !(self.hold_keys_done() && self.core.all_idle()) && self.core.open > 0 {
            now = self.turn(None)?;
        }
        let grant_phase = now.saturating_duration_since(start);
        self.core.stats.recording = false;
        self.core.shared.progress[self.index]
            .granted
            .store(true, Ordering::Release);
        while !self.core.shared.waiters_go.load(Ordering::Acquire) {
            now = self.turn(Some(now + PAUSE_POLL))?;
        }
        let slots = self.core.connections.len() * usize::from(self.core.pipeline);
        let mut samples = 0;
        if let KeySource::Hold(keys) = &mut self.core.keys {
            keys.start_waiters(slots);
            samples = keys.samples();
        }
        self.core.kick(Instant::now(), &self.poll);
        let give_up_at = Instant::now() + self.core.plan.waiter_wait + DRAIN_MAX;
        while !self.core.all_idle() && now < give_up_at {
            now = self.turn(Some(give_up_at))?;
        }
        Ok(WorkerOutcome {
            stats: self.core.stats,
            window: grant_phase,
            samples,
        })
    }

    fn hold_keys_done(&self) -> bool {
        match &self.core.keys {
            KeySource::Hold(keys) => keys.granting_done(),
            _ => true,
        }
    }
}

/// A split borrow of a core: its connections, dirty list and leader cache, and a session
/// context over the rest.
struct Parts<'a, W: Wire, S: BenchStream> {
    connections: &'a mut [Connection<W, S>],
    dirty: &'a mut Vec<u32>,
    leaders: &'a mut Leaders,
    ctx: Context<'a>,
}

impl<W: Wire, S: BenchStream> Core<W, S> {
    fn parts(&mut self, now: Instant) -> Parts<'_, W, S> {
        let Core {
            connections,
            plan,
            keys,
            stats,
            timers,
            dirty,
            shared,
            leaders,
            ..
        } = self;
        let ctx = Context {
            now,
            plan,
            stats,
            timers,
            keys,
            clock: &shared.clock,
        };
        Parts {
            connections,
            dirty,
            leaders,
            ctx,
        }
    }

    fn all_idle(&self) -> bool {
        self.connections
            .iter()
            .all(|c| !c.open || c.session.is_idle())
    }

    fn stop(&mut self) {
        for connection in &mut self.connections {
            connection.session.stop();
        }
    }

    fn mark_dirty(&mut self, index: usize) {
        mark(&mut self.connections[index], &mut self.dirty, index);
    }
}

fn mark<W: Wire, S: BenchStream>(
    connection: &mut Connection<W, S>,
    dirty: &mut Vec<u32>,
    index: usize,
) {
    if !connection.dirty && connection.open {
        connection.dirty = true;
        dirty.push(index as u32);
    }
}

impl<W: Wire, S: BenchStream> Core<W, S> {
    fn kick(&mut self, now: Instant, poll: &Poll) {
        let Parts {
            connections,
            dirty,
            leaders,
            mut ctx,
        } = self.parts(now);
        for (index, connection) in connections.iter_mut().enumerate() {
            if connection.open {
                let mut outbox = Outbox {
                    wires: &mut connection.wires,
                    outs: &mut connection.outputs,
                    leaders: &mut *leaders,
                };
                connection.session.kick(&mut ctx, &mut outbox);
                mark(connection, dirty, index);
            }
        }
        self.flush(poll);
    }

    fn read(&mut self, index: usize, lane: usize, now: Instant, poll: &Poll) {
        let Parts {
            connections,
            dirty,
            leaders,
            mut ctx,
        } = self.parts(now);
        let connection = &mut connections[index];
        if !connection.open {
            return;
        }
        // Answers only queue requests on their own connection: write them now, so they leave
        // when they were stamped (one `write` per lane, as the end-of-iteration flush would).
        let result =
            receive(connection, lane, &mut ctx, leaders).and_then(|()| send(connection, poll));
        if connection.outputs.iter().any(|output| !output.is_empty()) {
            mark(connection, dirty, index);
        }
        if let Err(failure) = result {
            self.close(index, failure, poll);
        }
    }

    fn fire_timers(&mut self, now: Instant) {
        // Bounded: firing a timer never sets another, and each slot has at most one.
        while let Some((local, slot)) = self.timers.pop_due(now) {
            let Parts {
                connections,
                dirty,
                leaders,
                mut ctx,
            } = self.parts(now);
            let connection = &mut connections[local as usize];
            if connection.open {
                let mut outbox = Outbox {
                    wires: &mut connection.wires,
                    outs: &mut connection.outputs,
                    leaders,
                };
                connection.session.handle_timer(slot, &mut ctx, &mut outbox);
                mark(connection, dirty, local as usize);
            }
        }
    }

    fn flush(&mut self, poll: &Poll) {
        let mut dirty = std::mem::take(&mut self.dirty);
        for &index in &dirty {
            let connection = &mut self.connections[index as usize];
            connection.dirty = false;
            if !connection.open {
                continue;
            }
            if let Err(failure) = send(connection, poll) {
                self.close(index as usize, failure, poll);
            }
        }
        dirty.clear();
        self.dirty = dirty;
    }

    fn close(&mut self, index: usize, failure: Failure, poll: &Poll) {
        let connection = &mut self.connections[index];
        if !connection.open {
            return;
        }
        connection.open = false;
        // The sockets are dropped with the worker; errors here change nothing.
        for lane in &mut connection.lanes {
            let _ = poll.registry().deregister(&mut lane.stream);
            let _ = lane.stream.shutdown();
        }
        connection.session.abandon();
        self.open -= 1;
        let number = connection.session.connection();
        match failure {
            Failure::Io(text) => self
                .stats
                .errors
                .io(|| format!("connection {number}: {text}")),
            Failure::Protocol(text) => self
                .stats
                .errors
                .protocol(|| format!("connection {number}: {text}")),
        }
    }
}

/// Reads `lane` until its socket is drained and applies every complete answer.
fn receive<W: Wire, S: BenchStream>(
    connection: &mut Connection<W, S>,
    lane: usize,
    ctx: &mut Context<'_>,
    leaders: &mut Leaders,
) -> Result<(), Failure> {
    loop {
        let Lane {
            stream,
            input,
            input_len,
            ..
        } = &mut connection.lanes[lane];
        let space = input.len() - *input_len;
        if space == 0 {
            return Err(Failure::Protocol(
                "an answer longer than the read buffer".into(),
            ));
        }
        match stream.read(&mut input[*input_len..]) {
            Ok(0) => return Err(Failure::Io("the server closed the connection".into())),
            Ok(read) => {
                *input_len += read;
                apply(connection, lane, ctx, leaders)?;
                if read < space {
                    return Ok(());
                }
            }
            Err(error) if error.kind() == io::ErrorKind::WouldBlock => return Ok(()),
            Err(error) if error.kind() == io::ErrorKind::Interrupted => {}
            Err(error) => return Err(Failure::Io(format!("read: {error}"))),
        }
    }
}

/// Parses and applies every complete answer in `lane`'s input buffer, then compacts it.
fn apply<W: Wire, S: BenchStream>(
    connection: &mut Connection<W, S>,
    lane: usize,
    ctx: &mut Context<'_>,
    leaders: &mut Leaders,
) -> Result<(), Failure> {
    let Connection {
        lanes,
        wires,
        outputs,
        session,
        ..
    } = connection;
    let Lane {
        input, input_len, ..
    } = &mut lanes[lane];
    let mut offset = 0;
    let result = loop {
        match wires[lane].parse(&input[offset..*input_len]) {
            Ok(Some((reply, used))) => {
                offset += used;
                let mut outbox = Outbox {
                    wires: &mut wires[..],
                    outs: &mut outputs[..],
                    leaders: &mut *leaders,
                };
                if let Err(error) = session.handle_reply(reply, ctx, &mut outbox) {
                    break Err(Failure::Protocol(describe(error)));
                }
            }
            Ok(None) => break Ok(()),
            Err(error) => break Err(Failure::Protocol(error.to_string())),
        }
    };
    input.copy_within(offset..*input_len, 0);
    *input_len -= offset;
    if let (Err(Failure::Protocol(text)), Some(redis)) = (&result, wires[lane].first_error_text()) {
        return Err(Failure::Protocol(format!("{text} (server said: {redis})")));
    }
    result
}

fn describe(error: ReplyError) -> String {
    match error {
        ReplyError::Uncorrelated(Answer::Refused { id: 0, code }) => {
            match ErrorCode::from_u8(code) {
                Some(code) => format!("the server refused the session: {code}"),
                None => format!("X with unknown code {code} and no correlation id"),
            }
        }
        other => other.to_string(),
    }
}

/// Writes every lane's queued bytes (one `write` each unless the socket takes less), keeps
/// the rest, and asks for writability only while something is left (queued bytes, or output
/// the stream holds: TLS records).
fn send<W: Wire, S: BenchStream>(
    connection: &mut Connection<W, S>,
    poll: &Poll,
) -> Result<(), Failure> {
    let lanes = connection.lanes.len();
    let first_token = connection.session.local() as usize * lanes;
    for (index, (lane, output)) in connection
        .lanes
        .iter_mut()
        .zip(connection.outputs.iter_mut())
        .enumerate()
    {
        send_lane(lane, output, poll, Token(first_token + index))?;
    }
    Ok(())
}

fn send_lane<S: BenchStream>(
    lane: &mut Lane<S>,
    output: &mut Vec<u8>,
    poll: &Poll,
    token: Token,
) -> Result<(), Failure> {
    let mut sent = 0;
    let result = loop {
        if sent == output.len() {
            break Ok(());
        }
        match lane.stream.write(&output[sent..]) {
            Ok(0) => break Err(Failure::Io("write accepted no bytes".into())),
            Ok(written) => sent += written,
            Err(error) if error.kind() == io::ErrorKind::WouldBlock => break Ok(()),
            Err(error) if error.kind() == io::ErrorKind::Interrupted => {}
            Err(error) => break Err(Failure::Io(format!("write: {error}"))),
        }
    };
    output.drain(..sent);
    let result = result.and_then(|()| flush_held(&mut lane.stream));
    let wants_write = !output.is_empty() || lane.stream.holds_output();
    if result.is_ok() && wants_write != lane.wants_write {
        let interest = if wants_write {
            Interest::READABLE | Interest::WRITABLE
        } else {
            Interest::READABLE
        };
        poll.registry()
            .reregister(&mut lane.stream, token, interest)
            .map_err(|error| Failure::Io(format!("reregister: {error}")))?;
        lane.wants_write = wants_write;
    }
    result
}

/// Writes what the stream holds (TLS records a full socket did not take) as far as the socket
/// takes it; plain TCP holds nothing and does nothing here.
fn flush_held<S: BenchStream>(stream: &mut S) -> Result<(), Failure> {
    if !stream.holds_output() {
        return Ok(());
    }
    match stream.flush() {
        Err(error) if error.kind() != io::ErrorKind::WouldBlock => {
            Err(Failure::Io(format!("write: {error}")))
        }
        _ => Ok(()),
    }
}
