//! A deterministic harness for the cores' logic: several [`Core`]s in one thread, over
//! in-memory streams, on a virtual clock, with the test deciding every interleaving.
//!
//! What runs is the real [`Core`] (and its close protocol, routing, outboxes, lock table and
//! wheel); what is replaced is only what [`Net`] and [`Stream`] abstract: sockets become
//! [`Pipe`]s whose capacity towards the client the test sets (so a client can "stop reading"),
//! and which the test can end with an end of input or a reset. Cross-core messages travel over
//! the real bounded channels; a message is handled when the test steps its destination core, so
//! a core that is not stepped is a core that lags. Models: quinn-proto's test `Pair`, and this
//! project's own lock-table simulation.
//!
//! Not here: the mio reactor (poll, accept, alarm), which the socket tests cover.

use super::core::{Core, CoreSettings, Links};
use super::net::{Net, Stream};
use super::route::{KeyPool, Msg, Outbox, CHANNEL_DEPTH};
use super::{queued, Shared, StallGauge};
use crate::lock_table::{LockTable, TableConfig};
use crate::partition::Partition;
use crate::partition::{QueueCounts, SessionId};
use crate::tokens::TokenKeeper;
use crate::tokens::{first_token, TokenRange};
use latchkey_client::protocol::{parse_response, Request, Response};
use mio::{Poll, Waker};
use parking_lot::Mutex;
use std::cell::{Cell, RefCell};
use std::collections::VecDeque;
use std::io::{self, Read, Write};
use std::net::SocketAddr;
use std::rc::Rc;
use std::sync::atomic::{AtomicBool, AtomicUsize};
use std::sync::Arc;

/// One connection's two directions, shared by the server's [`PipeStream`] and the test.
#[derive(Default)]
pub struct Pipe {
    /// Bytes the client wrote and the server has not read.
    pub to_server: VecDeque<u8>,
    /// Bytes the server wrote and the client has not read.
    pub to_client: VecDeque<u8>,
    /// How many unread bytes towards the client the "kernel" buffers before writes block.
    pub capacity_to_client: usize,
    /// The client ended its side: the server reads an end of input after `to_server`.
    pub client_eof: bool,
    /// The connection was reset: every read and write fails.
    pub reset: bool,
    /// The server shut its side.
    pub server_eof: bool,
}

/// The server's end of a [`Pipe`].
pub struct PipeStream(pub Rc<RefCell<Pipe>>);

impl Read for PipeStream {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        let mut pipe = self.0.borrow_mut();
        if pipe.reset {
            return Err(io::ErrorKind::ConnectionReset.into());
        }
        if pipe.to_server.is_empty() {
            return match pipe.client_eof {
                true => Ok(0),
                false => Err(io::ErrorKind::WouldBlock.into()),
            };
        }
        let n = buf.len().min(pipe.to_server.len());
        for (slot, byte) in buf.iter_mut().zip(pipe.to_server.drain(..n)) {
            *slot = byte;
        }
        Ok(n)
    }
}

impl Write for PipeStream {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        let mut pipe = self.0.borrow_mut();
        if pipe.reset {
            return Err(io::ErrorKind::ConnectionReset.into());
        }
        assert!(!pipe.server_eof, "the server wrote after shutting its side");
        let room = pipe.capacity_to_client.saturating_sub(pipe.to_client.len());
        if room == 0 {
            return Err(io::ErrorKind::WouldBlock.into());
        }
        let n = room.min(buf.len());
        pipe.to_client.extend(&buf[..n]);
        Ok(n)
    }

    fn flush(&mut self) -> io::Result<()> {
        Ok(())
    }
}

impl Stream for PipeStream {
    fn shutdown_write(&mut self) -> io::Result<()> {
        self.0.borrow_mut().server_eof = true;
        Ok(())
    }

    fn peer(&self) -> Option<SocketAddr> {
        None
    }
}

/// Registration is a no-op: the test delivers readiness itself. The clock is the harness's,
/// plus `drift_us` more at every reading (0 by default: an iteration takes no time).
pub struct PipeNet {
    clock: Rc<Cell<u64>>,
    drift_us: Rc<Cell<u64>>,
}

impl Net for PipeNet {
    type Stream = PipeStream;

    fn register(&self, _stream: &mut PipeStream, _slot: usize) -> io::Result<()> {
        Ok(())
    }

    fn deregister(&self, _stream: &mut PipeStream) {}

    fn now_us(&self) -> u64 {
        self.clock.set(self.clock.get() + self.drift_us.get());
        self.clock.get()
    }
}

/// Limits of the harness's server.
#[derive(Clone, Copy, Debug)]
pub struct Limits {
    /// Cores.
    pub cores: usize,
    /// Key entries per partition.
    pub max_keys: usize,
    /// Waiters per key.
    pub max_waiters_per_key: u32,
    /// Queued acquires per session.
    pub max_pending_per_session: u32,
}

/// Several cores and what they share, on a virtual clock. The cores' partitions are lock
/// tables (a single node) by default, or any other [`Partition`] (a cluster member's, see
/// [`Harness::with_partitions`]).
pub struct Harness<P: Partition = LockTable> {
    /// The cores.
    pub cores: Vec<Core<PipeNet, P>>,
    /// What they share.
    pub shared: Arc<Shared>,
    /// The virtual time in microseconds.
    pub now_us: u64,
    /// The clock the cores' [`PipeNet`]s read.
    clock: Rc<Cell<u64>>,
    /// How much each reading of that clock moves it (to spend the cores' work budgets).
    pub drift_us: Rc<Cell<u64>>,
    /// Kept alive for the wakers.
    _polls: Vec<Poll>,
}

/// A client's end of a session.
pub struct Client {
    /// The core that accepted it.
    pub core: usize,
    /// Its slot there.
    pub slot: usize,
    /// Its session id.
    pub id: SessionId,
    /// The connection.
    pub pipe: Rc<RefCell<Pipe>>,
    /// Received bytes not yet parsed into answers.
    input: Vec<u8>,
}

impl Harness {
    /// A single node of `limits.cores` cores at time 1 s.
    pub fn new(limits: Limits) -> Harness {
        Harness::with_partitions(limits, |index, shared| table(limits, index, shared))
    }

    /// Every key held in any partition, with its token.
    pub fn holds(&self) -> Vec<(Vec<u8>, u64)> {
        let tables = self.cores.iter().map(|core| core.table());
        let holds = tables.flat_map(|table| table.holds().map(|(k, t, _)| (k.to_vec(), t)));
        holds.collect()
    }

    /// Panics when a queue is over its bound or a table breaks an invariant.
    pub fn check_bounds(&self) {
        for core in &self.cores {
            core.table().check_invariants();
        }
        self.check_queues();
    }
}

impl<P: Partition> Harness<P> {
    /// A server of `limits.cores` cores at time 1 s whose core `index` serves the partition
    /// `partition(index, shared)` builds.
    pub fn with_partitions(
        limits: Limits,
        mut partition: impl FnMut(usize, &Shared) -> P,
    ) -> Harness<P> {
        let cores = limits.cores;
        let polls: Vec<Poll> = (0..cores).map(|_| Poll::new().expect("poll")).collect();
        let wakers: Vec<Arc<Waker>> = polls
            .iter()
            .map(|poll| Arc::new(Waker::new(poll.registry(), mio::Token(1)).expect("waker")))
            .collect();
        let queues = (cores > 1).then(|| Arc::new(queued::SessionQueues::new(cores, 1 << 16)));
        let shared = Arc::new(Shared {
            shutdown: AtomicBool::new(false),
            failed: AtomicBool::new(false),
            connections: AtomicUsize::new(0),
            quiescent: Mutex::new(vec![false; cores]),
            wakers: wakers.clone(),
            notify: None,
            queues,
            loop_gauges: (0..cores).map(|_| StallGauge::default()).collect(),
            limits: crate::config::Config::default().limits,
            clients: super::clients::ClientRegistry::new(super::clients::SERVER_CLIENTS_MAX),
            health: None,
            card: super::admin::render::card_text(None),
        });
        let channels: Vec<_> = (0..cores)
            .map(|_| crossbeam_channel::bounded::<Msg>(CHANNEL_DEPTH))
            .collect();
        let key_pool = KeyPool::default();
        let clock = Rc::new(Cell::new(0));
        let drift_us = Rc::new(Cell::new(0));
        let cores_built = (0..cores)
            .map(|index| {
                let outboxes = (0..cores)
                    .map(|peer| {
                        (peer != index).then(|| {
                            Outbox::new(channels[peer].0.clone(), Arc::clone(&wakers[peer]))
                        })
                    })
                    .collect();
                let links = Links {
                    inbox: channels[index].1.clone(),
                    outboxes,
                    shared: Arc::clone(&shared),
                    key_pool: key_pool.clone(),
                    tokens: TokenKeeper::none(),
                    auth: None,
                };
                let table = partition(index, &shared);
                let settings = CoreSettings {
                    index,
                    cores,
                    max_connections: 1 << 16,
                    max_pending_per_session: limits.max_pending_per_session,
                    max_key_bytes: latchkey_client::protocol::KEY_BYTES_MAX,
                };
                let net = PipeNet {
                    clock: Rc::clone(&clock),
                    drift_us: Rc::clone(&drift_us),
                };
                Core::new(settings, net, table, links)
            })
            .collect();
        let mut harness = Harness {
            cores: cores_built,
            shared,
            now_us: 1_000_000,
            clock,
            drift_us,
            _polls: polls,
        };
        harness.set_now(harness.now_us);
        harness
    }

    fn set_now(&mut self, now_us: u64) {
        self.now_us = now_us;
        self.clock.set(now_us);
        for core in &mut self.cores {
            core.set_now(now_us);
        }
    }

    /// Moves the clock forward.
    pub fn advance(&mut self, by_us: u64) {
        self.set_now(self.now_us + by_us);
    }

    /// Opens a session on `core`, whose client end reads up to `capacity_to_client` unread
    /// bytes before the server's writes block.
    pub fn connect(&mut self, core: usize, capacity_to_client: usize) -> Client {
        let pipe = Rc::new(RefCell::new(Pipe {
            capacity_to_client,
            ..Pipe::default()
        }));
        let server = &mut self.cores[core];
        let slot = server.sessions.vacant_key();
        server.admit(PipeStream(Rc::clone(&pipe)));
        let id = server.sessions[slot].id();
        Client {
            core,
            slot,
            id,
            pipe,
            input: Vec::new(),
        }
    }

    /// One loop iteration of `core` (after whatever events the test delivered), with a
    /// fresh work budget.
    pub fn step(&mut self, core: usize) -> bool {
        self.clock.set(self.now_us);
        self.cores[core].set_now(self.now_us);
        self.cores[core].step()
    }

    /// Steps every core, in order, `rounds` times.
    pub fn step_all(&mut self, rounds: usize) {
        for _ in 0..rounds {
            for core in 0..self.cores.len() {
                self.step(core);
            }
        }
    }

    /// Whether `client`'s session still occupies its slot.
    pub fn is_open(&self, client: &Client) -> bool {
        let sessions = &self.cores[client.core].sessions;
        sessions
            .get(client.slot)
            .is_some_and(|s| s.id() == client.id)
    }

    /// Tells `client`'s core about readiness of its session (ignored once the session is gone).
    pub fn ready(&mut self, client: &Client, readable: bool, writable: bool, closed: bool) {
        if self.is_open(client) {
            self.cores[client.core].on_ready(client.slot, readable, writable, closed);
        }
    }

    /// The client writes `requests`; its core sees the session readable.
    pub fn send(&mut self, client: &Client, requests: &[Request<'_>]) {
        {
            let mut pipe = client.pipe.borrow_mut();
            let mut bytes = Vec::new();
            for request in requests {
                request.encode(&mut bytes);
            }
            pipe.to_server.extend(bytes);
        }
        self.ready(client, true, false, false);
    }

    /// The client reads everything available and parses its answers; its core sees the
    /// session writable.
    pub fn receive(&mut self, client: &mut Client) -> Vec<Response> {
        let bytes: Vec<u8> = client.pipe.borrow_mut().to_client.drain(..).collect();
        client.input.extend(bytes);
        let mut answers = Vec::new();
        let mut used = 0;
        while let Some((answer, len)) = parse_response(&client.input[used..]).expect("a frame") {
            answers.push(answer);
            used += len;
        }
        client.input.drain(..used);
        self.ready(client, false, true, false);
        answers
    }

    /// The client's connection is reset; its core sees the error.
    pub fn reset(&mut self, client: &Client) {
        client.pipe.borrow_mut().reset = true;
        self.ready(client, true, true, true);
    }

    /// The client ends its side; its core sees the end of input.
    pub fn half_close(&mut self, client: &Client) {
        client.pipe.borrow_mut().client_eof = true;
        self.ready(client, true, false, true);
    }

    /// Panics when an outbox or a session's output is over its bound.
    pub fn check_queues(&self) {
        for core in &self.cores {
            for peer in 0..self.cores.len() {
                let queued = core.outbox_len(peer);
                assert!(
                    queued <= OUTBOX_CHECK_MAX,
                    "outbox {}→{peer}: {queued}",
                    core.index()
                );
            }
            for (_, session) in &core.sessions {
                let unsent = session.unsent();
                assert!(unsent <= UNSENT_CHECK_MAX, "session output {unsent} bytes");
            }
        }
    }
}

/// An outbox holds at most its requests' bound plus the answers and acknowledgements that
/// the harness's small limits can produce at once.
const OUTBOX_CHECK_MAX: usize = super::route::OUTBOX_REQUESTS_MAX + 4096;
/// A session's output: its bound, plus the answers of one read buffer's frames beyond it.
const UNSENT_CHECK_MAX: usize = super::session::OUTPUT_BOUND_BYTES + 32 * 1024;

fn table(limits: Limits, index: usize, shared: &Shared) -> LockTable {
    let config = TableConfig {
        max_keys: limits.max_keys,
        max_waiters_per_key: limits.max_waiters_per_key,
        tick_us: 1000,
        max_pending_per_session: limits.max_pending_per_session,
    };
    let step = limits.cores as u64;
    let tokens = TokenRange {
        next: first_token(1_000_000, index, limits.cores),
        step,
        limit: u64::MAX / 2,
    };
    let mut table = LockTable::new(config, 1_000_000, tokens);
    if let Some(queues) = &shared.queues {
        table.share_queue_counts(Arc::clone(queues) as Arc<dyn QueueCounts>);
    }
    table
}

#[cfg(test)]
mod tests;
