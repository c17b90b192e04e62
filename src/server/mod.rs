//! The server: a synchronous thread-per-core runtime on `mio`.
//!
//! [`start_with_notify`] takes the address for this process and binds one `SO_REUSEPORT` listener per core
//! ([`bind`]: the kernel spreads new connections over them, so no acceptor thread hands sockets
//! around and each core owns the sessions it accepted), computes where tokens start, and spawns
//! one thread per core running a [`reactor::Reactor`] around a [`core::Core`]. Each core owns
//! one partition of the key space ([`crate::partition::partition_of`]); requests for another
//! core's keys travel over bounded `crossbeam-channel`s. A core's partition is a single node's
//! lock table, or whatever a [`Backend`] starts (a cluster member's, started by
//! [`crate::node`]): the server only knows the [`crate::partition::Partition`] trait.
//!
//! Shared between cores, and only for admission, shutdown, failure and statistics: the
//! connection count (one atomic add per accepted connection, so `max_connections` holds
//! server-wide), the shutdown and failure flags, the shutdown quiescence marks (a `parking_lot`
//! mutex touched only while stopping), the queued-acquire counts of sessions (touched only when
//! an acquire queues or a waiter leaves), the long-key buffer pool, and one stall gauge per
//! core. Nothing on the request path of a short key is shared.
//!
//! A core that panics marks the server failed and stops the others; [`ServerHandle::join`]
//! reports it and the binary exits non-zero, so a half-alive server never lingers.
//!
//! Where each part lives, file by file: `docs/architecture.md`.

pub mod admin;
pub mod admission;
pub mod alarm;
pub mod bind;
pub mod buffers;
pub mod clients;
pub mod close;
pub mod core;
pub mod handshake;
pub mod logs;
pub mod net;

pub mod queued;
pub mod reactor;
mod resume;
pub mod route;
pub mod session;
pub mod tls;

#[cfg(test)]
pub(crate) mod harness;

use crate::config::{Config, CORES_MAX};
use crate::lock_table::{LockTable, TableConfig};
use crate::partition::Partition;
use crate::partition::QueueCounts;
use crate::tokens::{self, StateDir, TokenRange};
use crate::tokens::{Persister, TokenKeeper};
use bind::AddressGuard;
use mio::net::TcpStream;
use mio::{Poll, Registry, Waker};
use net::MioStream;
pub use net::PARTITION_TOKEN_BASE;
use parking_lot::Mutex;
use reactor::{CoreSettings, Links, Reactor, ReactorParts, WAKER};
use route::{KeyPool, Msg, Outbox, CHANNEL_DEPTH};
use std::fmt;
use std::io;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Instant, SystemTime};

/// State the cores share (see the module docs for why each piece is shared).
pub struct Shared {
    shutdown: AtomicBool,
    failed: AtomicBool,
    connections: AtomicUsize,
    quiescent: Mutex<Vec<bool>>,
    wakers: Vec<Arc<Waker>>,
    notify: Option<Arc<Waker>>,
    /// Queued acquires per session across partitions (with more than one core).
    pub(crate) queues: Option<Arc<queued::SessionQueues>>,
    /// Per core, its loop iterations (poll excluded): the worst since the last
    /// [`ServerHandle::take_worst_loop_us`] and a histogram. The stall detector.
    loop_gauges: Box<[StallGauge]>,
    /// The limits in force (for `GET /stats`).
    limits: crate::config::LimitsConfig,
    /// The identified clients (docs/protocol.md §5, resumable calls).
    pub(crate) clients: clients::ClientRegistry,
    /// What the cores published for the health port, when `server.health_listen` has one.
    pub(crate) health: Option<admin::health_port::HealthBoard>,
    /// The server's card, as `GET /cluster` answers it (see [`admin::render::card_text`]).
    pub(crate) card: String,
}

/// Upper bounds of the loop-iteration histogram's buckets, in microseconds; one more bucket
/// counts the iterations above the last bound.
pub const LOOP_BUCKETS_US: [u64; 9] = [64, 128, 256, 512, 1_000, 2_000, 4_000, 8_000, 16_000];

/// One core's loop iterations: the worst one since the last take, and a histogram of all, in
/// microseconds. Written only by its core (the worst only when beaten; one relaxed add per
/// iteration to a line no other core writes), read by anyone.
#[repr(align(64))]
#[derive(Default)]
pub struct StallGauge {
    worst_us: AtomicU64,
    max_us: AtomicU64,
    sum_us: AtomicU64,
    buckets: [AtomicU64; LOOP_BUCKETS_US.len() + 1],
}

impl StallGauge {
    /// Records an iteration of `busy_us`.
    pub fn record(&self, busy_us: u64) {
        if busy_us > self.worst_us.load(Ordering::Relaxed) {
            self.worst_us.fetch_max(busy_us, Ordering::Relaxed);
            self.max_us.fetch_max(busy_us, Ordering::Relaxed);
        }
        self.sum_us.fetch_add(busy_us, Ordering::Relaxed);
        let bucket = LOOP_BUCKETS_US.partition_point(|&bound| bound < busy_us);
        self.buckets[bucket].fetch_add(1, Ordering::Relaxed);
    }

    /// The worst iteration since the last take, and starts over.
    pub fn take(&self) -> u64 {
        self.worst_us.swap(0, Ordering::Relaxed)
    }

    /// Iterations so far per bucket of [`LOOP_BUCKETS_US`] (the last: above its last bound).
    pub fn histogram(&self) -> [u64; LOOP_BUCKETS_US.len() + 1] {
        std::array::from_fn(|bucket| self.buckets[bucket].load(Ordering::Relaxed))
    }

    /// Every iteration so far as a histogram (sum and largest included).
    pub fn snapshot(&self) -> crate::metrics::Histogram {
        let sum_us = self.sum_us.load(Ordering::Relaxed);
        let max_us = self.max_us.load(Ordering::Relaxed);
        crate::metrics::Histogram::from_counts(&LOOP_BUCKETS_US, &self.histogram(), sum_us, max_us)
    }
}

impl Shared {
    fn request_shutdown(&self) {
        self.shutdown.store(true, Ordering::Release);
        for waker in &self.wakers {
            let _ = waker.wake();
        }
        if let Some(notify) = &self.notify {
            let _ = notify.wake();
        }
    }

    /// Records whether core `index` has nothing left to do; true when every core is so.
    ///
    /// Once every core was quiescent at the same moment, the shutdown is complete for all of
    /// them: the answer stays true even if a core later sees new input (a client closing), which
    /// otherwise would wait for an acknowledgement from a core that has already stopped.
    fn mark_quiescent(&self, index: usize, quiescent: bool) -> bool {
        let mut marks = self.quiescent.lock();
        if marks.iter().all(|&mark| mark) {
            return true;
        }
        marks[index] = quiescent;
        let all = marks.iter().all(|&mark| mark);
        drop(marks);
        if all {
            for waker in &self.wakers {
                let _ = waker.wake();
            }
        }
        all
    }
}

/// Why a server stopped badly.
#[derive(Debug)]
pub enum ServerError {
    /// A core thread panicked (the panic message was logged).
    CorePanicked(usize),
    /// A core's event loop failed.
    Io(usize, io::Error),
}

impl fmt::Display for ServerError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            ServerError::CorePanicked(core) => write!(f, "core {core} panicked"),
            ServerError::Io(core, e) => write!(f, "core {core} failed: {e}"),
        }
    }
}

impl std::error::Error for ServerError {}

/// A running server. Dropping it shuts it down and waits for it.
pub struct ServerHandle {
    addr: SocketAddr,
    shared: Arc<Shared>,
    threads: Vec<JoinHandle<Result<(), ServerError>>>,
    persister: Option<Persister>,
    /// What a [`Backend`] started beside the cores (a cluster member's peer thread and data
    /// directory), stopped after the cores.
    beside: Option<Box<dyn Beside>>,
    /// The health port (`server.health_listen`), stopped after the cores: it answers `503
    /// shutting down` while they stop.
    health: Option<admin::health_port::HealthPort>,
    /// Keeps the address ours until the server is gone.
    _guard: AddressGuard,
}

impl ServerHandle {
    /// The address the server listens on (with the real port when 0 was configured).
    pub fn local_addr(&self) -> SocketAddr {
        self.addr
    }

    /// The address of the health port (`server.health_listen`), if there is one (with the
    /// real port when 0 was configured).
    pub fn health_addr(&self) -> Option<SocketAddr> {
        self.health.as_ref().map(|port| port.local_addr())
    }

    /// Begins a graceful shutdown: stop accepting, answer queued waiters `B`, flush, stop.
    /// Idempotent.
    pub fn shutdown(&self) {
        self.shared.request_shutdown();
    }

    /// Whether a core failed (panicked or its loop errored).
    pub fn failed(&self) -> bool {
        self.shared.failed.load(Ordering::Acquire)
    }

    /// Whether a shutdown was requested (by [`shutdown`](Self::shutdown) or a failure).
    pub fn is_stopping(&self) -> bool {
        self.shared.shutdown.load(Ordering::Acquire)
    }

    /// Whether every core has stopped.
    pub fn is_finished(&self) -> bool {
        self.threads.iter().all(JoinHandle::is_finished)
    }

    /// Sessions open right now, server-wide.
    pub fn connections(&self) -> usize {
        self.shared.connections.load(Ordering::Relaxed)
    }

    /// The longest event-loop iteration of any core (time spent working between two polls,
    /// in microseconds) since the previous call; resets it. For stall benchmarks and tests.
    pub fn take_worst_loop_us(&self) -> u64 {
        let gauges = self.shared.loop_gauges.iter();
        gauges.map(StallGauge::take).max().unwrap_or(0)
    }

    /// Loop iterations of all cores so far, per bucket of `LOOP_BUCKETS_US` (the last
    /// bucket: longer than its last bound).
    pub fn loop_histogram(&self) -> [u64; LOOP_BUCKETS_US.len() + 1] {
        let mut total = [0; LOOP_BUCKETS_US.len() + 1];
        for gauge in self.shared.loop_gauges.iter() {
            for (sum, count) in total.iter_mut().zip(gauge.histogram()) {
                *sum += count;
            }
        }
        total
    }

    /// Waits for every core to stop; the first failure, if any.
    pub fn join(mut self) -> Result<(), ServerError> {
        self.join_threads()
    }

    fn join_threads(&mut self) -> Result<(), ServerError> {
        let mut outcome = Ok(());
        for (index, thread) in self.threads.drain(..).enumerate() {
            let result = thread
                .join()
                .unwrap_or(Err(ServerError::CorePanicked(index)));
            if outcome.is_ok() {
                outcome = result;
            }
        }
        if let Some(persister) = self.persister.take() {
            persister.join();
        }
        if let Some(beside) = self.beside.take() {
            beside.stop();
        }
        if let Some(health) = self.health.take() {
            health.stop();
        }
        outcome
    }
}

impl Drop for ServerHandle {
    fn drop(&mut self) {
        if !self.threads.is_empty() || self.beside.is_some() || self.health.is_some() {
            self.shutdown();
            let _ = self.join_threads();
        }
    }
}

/// What a server's cores serve when they are not a single node's lock tables: the partitions
/// of a cluster member (`crate::node` starts one with the member's backend). The server knows
/// nothing of what is behind the [`Partition`] trait.
pub trait Backend {
    /// A core's partition.
    type Partition: Partition + Send + 'static;
    /// One partition per core (`wakers[c]` wakes core `c`; `registries[c]` is core `c`'s poll,
    /// where the partition may register sources with the
    /// [`PARTITION_SOURCES`](crate::partition::PARTITION_SOURCES) tokens from
    /// [`PARTITION_TOKEN_BASE`]; `queues`: the per-session counts of queued acquires shared by
    /// the cores, when there are several), and what must stop after the cores.
    fn start(
        self,
        config: &Config,
        cores: (&[Arc<Waker>], Vec<Registry>),
        queues: Option<Arc<dyn QueueCounts>>,
    ) -> io::Result<Started<Self::Partition>>;
}

/// What [`Backend::start`] gives: a partition per core, and what runs beside the cores.
pub type Started<P> = (Vec<P>, Box<dyn Beside>);

/// What a [`Backend`] runs beside the cores (threads, locked directories): stopped and dropped
/// after every core has stopped.
pub trait Beside: Send {
    /// Stops it and waits for it.
    fn stop(self: Box<Self>);
}

/// What [`start_with_notify`] prepares before it spawns the cores.
struct Plan {
    table_config: TableConfig,
    state_dir: Option<StateDir>,
    floor: u64,
    polls: Vec<Poll>,
    shared: Arc<Shared>,
}

/// Starts a single node; `notify` is woken when a core stops (normally or not) or on
/// shutdown.
pub fn start_with_notify(config: Config, notify: Option<Arc<Waker>>) -> io::Result<ServerHandle> {
    if config.cluster.is_some() {
        let message = "a cluster member is started by latchkey::node::start, not as a single node";
        return Err(io::Error::new(io::ErrorKind::InvalidInput, message));
    }
    start_inner(config, notify, None::<NoBackend>)
}

/// Starts a server whose cores serve `backend`'s partitions; `notify` as in
/// [`start_with_notify`].
pub fn start_backend<B: Backend>(
    config: Config,
    notify: Option<Arc<Waker>>,
    backend: B,
) -> io::Result<ServerHandle> {
    start_inner(config, notify, Some(backend))
}

/// The type of "no backend" (a single node).
enum NoBackend {}

impl Backend for NoBackend {
    type Partition = LockTable;

    fn start(
        self,
        _: &Config,
        _: (&[Arc<Waker>], Vec<Registry>),
        _: Option<Arc<dyn QueueCounts>>,
    ) -> io::Result<Started<LockTable>> {
        match self {}
    }
}

fn start_inner<B: Backend>(
    config: Config,
    notify: Option<Arc<Waker>>,
    backend: Option<B>,
) -> io::Result<ServerHandle> {
    let cores = config.server.cores;
    if cores == 0 || cores > CORES_MAX {
        let message = format!("server.cores must be in 1..={CORES_MAX}, got {cores}");
        return Err(io::Error::new(io::ErrorKind::InvalidInput, message));
    }
    // Checked before binding: a bad certificate or key stops the start, naming key and path.
    let tls = config
        .tls
        .as_ref()
        .map(crate::server::tls::server_config)
        .transpose()?;
    let bound = bind::bind(config.server.listen, cores)?;
    let health = (config.server.health_listen)
        .map(admin::health_port::bind)
        .transpose()?;
    let mut plan = plan(&config, notify)?;
    let mut handle = ServerHandle {
        addr: bound.addr,
        shared: Arc::clone(&plan.shared),
        threads: Vec::with_capacity(cores),
        persister: None,
        beside: None,
        health: None,
        _guard: bound.guard,
    };
    let listeners = bound.listeners;
    match backend {
        None => {
            if let Some(state) = &plan.state_dir {
                let (waking, stopping) = (Arc::clone(&plan.shared), Arc::clone(&plan.shared));
                handle.persister = Some(Persister::start(
                    state.clone(),
                    cores,
                    move |core| drop(waking.wakers[core].wake()),
                    move || stopping.shutdown.load(Ordering::Acquire),
                )?);
            }
            let mut tables = Vec::with_capacity(cores);
            for index in 0..cores {
                let persister = handle.persister.as_ref();
                let (range, keeper) = token_range(&config, &plan, persister, index)?;
                let mut table = LockTable::new(plan.table_config, 0, range);
                if let Some(queues) = &plan.shared.queues {
                    table.share_queue_counts(Arc::clone(queues) as Arc<dyn QueueCounts>);
                }
                tables.push((table, keeper));
            }
            spawn_cores(
                &config,
                &mut plan,
                listeners,
                tables,
                tls.as_ref(),
                &mut handle,
            )?;
        }
        Some(backend) => {
            let queues = (plan.shared.queues.clone()).map(|queues| queues as Arc<dyn QueueCounts>);
            let registries = (plan.polls.iter())
                .map(|poll| poll.registry().try_clone())
                .collect::<io::Result<Vec<_>>>()?;
            let cores = (&plan.shared.wakers[..], registries);
            let (partitions, beside) = backend.start(&config, cores, queues)?;
            handle.beside = Some(beside);
            let partitions = partitions
                .into_iter()
                .map(|partition| (partition, TokenKeeper::none()))
                .collect();
            spawn_cores(
                &config,
                &mut plan,
                listeners,
                partitions,
                tls.as_ref(),
                &mut handle,
            )?;
        }
    }
    if let Some(listener) = health {
        let shared = Arc::clone(&plan.shared);
        handle.health = Some(admin::health_port::HealthPort::start(listener, shared)?);
    }
    Ok(handle)
}

/// Spawns one core per partition, each with its poll, listener and links.
fn spawn_cores<P: Partition + Send + 'static>(
    config: &Config,
    plan: &mut Plan,
    listeners: Vec<mio::net::TcpListener>,
    partitions: Vec<(P, TokenKeeper)>,
    tls: Option<&Arc<rustls::ServerConfig>>,
    handle: &mut ServerHandle,
) -> io::Result<()> {
    let cores = config.server.cores;
    let channels: Vec<_> = (0..cores)
        .map(|_| crossbeam_channel::bounded(CHANNEL_DEPTH))
        .collect();
    let key_pool = KeyPool::default();
    let auth = crate::auth::AuthRules::new(&config.auth_rules);
    let epoch = Instant::now();
    let polls = std::mem::take(&mut plan.polls);
    let cores_parts = polls.into_iter().zip(listeners).zip(partitions);
    for (index, ((poll, listener), (table, keeper))) in cores_parts.enumerate() {
        let links = Links {
            inbox: channels[index].1.clone(),
            outboxes: outboxes(index, &channels, &plan.shared.wakers),
            shared: Arc::clone(&plan.shared),
            key_pool: key_pool.clone(),
            tokens: keeper,
            auth: auth.clone(),
        };
        let settings = CoreSettings {
            index,
            cores,
            max_connections: config.limits.max_connections,
            max_pending_per_session: config.limits.max_pending_per_session,
            max_key_bytes: config.limits.max_key_bytes,
        };
        let parts = ReactorParts {
            settings,
            poll,
            listener,
            table,
            links,
            epoch,
        };
        let shared = Arc::clone(&plan.shared);
        handle.threads.push(spawn_reactor(parts, tls, shared)?);
    }
    Ok(())
}

/// Core `index`'s first tokens and what keeps its reservation persisted (with a state dir).
fn token_range(
    config: &Config,
    plan: &Plan,
    persister: Option<&Persister>,
    index: usize,
) -> io::Result<(TokenRange, TokenKeeper)> {
    let cores = config.server.cores;
    let step = cores as u64;
    let first = tokens::first_token(plan.floor, index, cores);
    let (limit, keeper) = match (&plan.state_dir, persister) {
        (Some(state), Some(persister)) => {
            let reservation = config.tokens.reservation;
            let limit = first.saturating_add(reservation.saturating_mul(step));
            state
                .persist(index, limit)
                .map_err(|e| state_error(state, e))?;
            (limit, persister.keeper(index, step, reservation))
        }
        _ => (u64::MAX, TokenKeeper::none()),
    };
    let range = TokenRange {
        next: first,
        step,
        limit,
    };
    Ok((range, keeper))
}

/// The token floor, the polls and wakers, and what the cores share.
fn plan(config: &Config, notify: Option<Arc<Waker>>) -> io::Result<Plan> {
    let cores = config.server.cores;
    let limits = &config.limits;
    let state_dir = config
        .tokens
        .state_dir
        .as_deref()
        .map(StateDir::open)
        .transpose()?;
    let floor = tokens::run_floor(state_dir.as_ref(), SystemTime::now())?;
    let mut polls = Vec::with_capacity(cores);
    let mut wakers = Vec::with_capacity(cores);
    for _ in 0..cores {
        let poll = Poll::new()?;
        wakers.push(Arc::new(Waker::new(poll.registry(), WAKER)?));
        polls.push(poll);
    }
    // One partition counts a session's queued acquires exactly by itself.
    let queues =
        (cores > 1).then(|| Arc::new(queued::SessionQueues::new(cores, limits.max_connections)));
    let shared = Arc::new(Shared {
        shutdown: AtomicBool::new(false),
        failed: AtomicBool::new(false),
        connections: AtomicUsize::new(0),
        quiescent: Mutex::new(vec![false; cores]),
        wakers,
        notify,
        queues,
        loop_gauges: (0..cores).map(|_| StallGauge::default()).collect(),
        limits: limits.clone(),
        clients: clients::ClientRegistry::new(clients::SERVER_CLIENTS_MAX),
        health: (config.server.health_listen)
            .map(|_| admin::health_port::HealthBoard::new(cores, config.cluster.is_some())),
        card: admin::render::card_text(config.cluster.as_ref()),
    });
    let table_config = TableConfig {
        max_keys: (limits.max_keys / cores).max(1),
        max_waiters_per_key: limits.max_waiters_per_key,
        tick_us: u64::from(config.timer.tick_ms) * 1000,
        max_pending_per_session: limits.max_pending_per_session,
    };
    Ok(Plan {
        table_config,
        state_dir,
        floor,
        polls,
        shared,
    })
}

/// `tokens.state_dir PATH: cause`.
fn state_error(state: &StateDir, error: io::Error) -> io::Error {
    let message = format!(
        "tokens.state_dir {}: cannot persist the token high-water mark: {error}",
        state.path().display()
    );
    io::Error::new(error.kind(), message)
}

/// Core `index`'s outboxes: one per other core.
fn outboxes(
    index: usize,
    channels: &[(
        crossbeam_channel::Sender<Msg>,
        crossbeam_channel::Receiver<Msg>,
    )],
    wakers: &[Arc<Waker>],
) -> Vec<Option<Outbox>> {
    let outbox = |peer: usize| Outbox::new(channels[peer].0.clone(), Arc::clone(&wakers[peer]));
    (0..channels.len())
        .map(|peer| (peer != index).then(|| outbox(peer)))
        .collect()
}

/// Runs a core's loop over plain TCP, or over TLS with `tls`.
fn spawn_reactor<P: Partition + Send + 'static>(
    parts: ReactorParts<P>,
    tls: Option<&Arc<rustls::ServerConfig>>,
    shared: Arc<Shared>,
) -> io::Result<JoinHandle<Result<(), ServerError>>> {
    let index = parts.settings.index;
    match tls {
        None => spawn_core(index, Reactor::<TcpStream, P>::new(parts, ())?, shared),
        Some(tls) => {
            let reactor =
                Reactor::<latchkey_client::tls::TlsStream, P>::new(parts, Arc::clone(tls))?;
            spawn_core(index, reactor, shared)
        }
    }
}

fn spawn_core<S: MioStream + Send + 'static, P: Partition + Send + 'static>(
    index: usize,
    reactor: Reactor<S, P>,
    shared: Arc<Shared>,
) -> io::Result<JoinHandle<Result<(), ServerError>>> {
    std::thread::Builder::new()
        .name(format!("latchkey-core-{index}"))
        .spawn(move || {
            let guard = FailureGuard { index, shared };
            let result = reactor.run().map_err(|e| {
                log::error!("core {index}: event loop failed: {e}");
                guard.shared.failed.store(true, Ordering::Release);
                ServerError::Io(index, e)
            });
            drop(guard);
            result
        })
}

/// Marks the server failed and stops the other cores if its core thread unwinds.
struct FailureGuard {
    index: usize,
    shared: Arc<Shared>,
}

impl Drop for FailureGuard {
    fn drop(&mut self) {
        if std::thread::panicking() {
            log::error!("core {} panicked; stopping the server", self.index);
            self.shared.failed.store(true, Ordering::Release);
        }
        if self.shared.failed.load(Ordering::Acquire) {
            self.shared.request_shutdown();
        } else if let Some(notify) = &self.shared.notify {
            let _ = notify.wake();
        }
    }
}
