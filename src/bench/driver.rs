//! Runs a benchmark: resolves the target, loads the Redis script, starts the worker threads
//! behind a start gate, shows progress, steps `hold` through its phases, reads the server's
//! RSS, and merges what the workers measured into a [`Report`].
//!
//! The start gate: every worker connects all its connections first; only when all have, the
//! driver reads the RSS "before" figure and publishes one start instant, so that warm-up and
//! window are the same for every thread. If any worker fails to connect, the others are told
//! to give up and the first error is returned.
//!
//! Deliberately not here: the event loop (`worker.rs`) and what the numbers mean
//! (`report.rs`).

use std::fmt;
use std::io::{self, IsTerminal, Read, Write};
use std::net::{SocketAddr, TcpStream, ToSocketAddrs};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use std::thread::{self, JoinHandle};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use super::redis::{encode_command, parse_reply, RedisWire, RespValue, RELEASE_SCRIPT, SHA_BYTES};
use super::report::{HoldFigures, Report};
use super::stream::{connect_plain, connect_tls, BenchStream};
use super::wire::LatchkeyWire;
use super::worker::{Worker, WorkerOutcome, WorkerSpec};
use super::workload::{HandoffClock, HoldKeys, KeySource, Plan, LATENESS_SAMPLES_MAX};
use super::{BenchConfig, Dialect, Workload};
use crate::rng::Rng;
use latchkey_client::tls::Connector;

/// How long connecting (and the Redis script load) may take.
pub const CONNECT_TIMEOUT: Duration = Duration::from_secs(2);
/// How often the driver wakes to look at the workers.
const MONITOR_TICK: Duration = Duration::from_millis(50);
/// How often the progress line is redrawn on a terminal, and printed elsewhere.
const PROGRESS_TERMINAL: Duration = Duration::from_millis(250);
const PROGRESS_PLAIN: Duration = Duration::from_secs(1);
/// `start_at` value that tells waiting workers to give up.
const ABORT: u64 = u64::MAX;

/// Why a run could not be made (as opposed to errors it measured, which are in the report).
#[derive(Debug)]
pub enum BenchError {
    /// The target address does not resolve.
    Resolve(String),
    /// A connection could not be opened.
    Connect {
        /// The server.
        address: SocketAddr,
        /// Why.
        error: io::Error,
    },
    /// The Redis script could not be loaded.
    Redis(String),
    /// The poller failed.
    Poll(io::Error),
    /// A thread could not be started, or panicked.
    Thread(String),
    /// `--server-pid` was given but its RSS cannot be read.
    Rss(String),
    /// The target lists servers that are not members of one cluster.
    Mixed(String),
}

impl fmt::Display for BenchError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            BenchError::Resolve(text) => write!(f, "cannot resolve the target: {text}"),
            BenchError::Connect { address, error } => {
                write!(f, "cannot connect to {address}: {error}")
            }
            BenchError::Redis(text) => write!(f, "redis: {text}"),
            BenchError::Poll(error) => write!(f, "poll: {error}"),
            BenchError::Thread(text) => write!(f, "load thread: {text}"),
            BenchError::Rss(text) => write!(f, "server RSS: {text}"),
            BenchError::Mixed(text) => write!(
                f,
                "the target's servers are not members of one cluster: {text}"
            ),
        }
    }
}

impl std::error::Error for BenchError {}

/// What one worker publishes while it runs.
#[derive(Debug, Default)]
pub struct Progress {
    /// Requests answered so far.
    pub requests: AtomicU64,
    /// Cycles completed so far.
    pub cycles: AtomicU64,
    /// Connection errors so far.
    pub errors: AtomicU64,
    /// `hold`: the worker has granted its keys and waits for the signal to start its waiters.
    pub granted: AtomicBool,
    /// The worker has returned.
    pub done: AtomicBool,
}

/// State shared by the driver and its workers.
#[derive(Debug)]
pub struct Shared {
    epoch: Instant,
    ready: AtomicUsize,
    failed: AtomicUsize,
    /// Nanoseconds after `epoch`, plus one, of the start; 0 until then; [`ABORT`] to give up.
    start_at: AtomicU64,
    /// `hold`: start the waiters.
    pub waiters_go: AtomicBool,
    /// One per worker.
    pub progress: Box<[Progress]>,
    /// Last release of each hot key.
    pub clock: HandoffClock,
}

impl Shared {
    fn wait_for_start(&self) -> Option<Instant> {
        loop {
            match self.start_at.load(Ordering::Acquire) {
                0 => thread::sleep(Duration::from_micros(200)),
                ABORT => return None,
                at => return Some(self.epoch + Duration::from_nanos(at - 1)),
            }
        }
    }
}

/// Resolves `HOST:PORT` to its first address.
fn resolve(address: &str) -> Result<SocketAddr, BenchError> {
    let mut addresses = address
        .to_socket_addrs()
        .map_err(|error| BenchError::Resolve(format!("{address}: {error}")))?;
    addresses
        .next()
        .ok_or_else(|| BenchError::Resolve(format!("{address}: no address")))
}

/// Resolves every member of the target (each `HOST:PORT` to its first address), without
/// duplicates.
fn resolve_members(target: &super::Target) -> Result<Vec<SocketAddr>, BenchError> {
    let mut members = Vec::new();
    for address in target.addresses() {
        let resolved = resolve(address)?;
        if !members.contains(&resolved) {
            members.push(resolved);
        }
    }
    Ok(members)
}

/// Refuses a target of several latchkey servers that are not members of one cluster, by the
/// rules a client given that list applies (`latchkey_client::refused_list`): a standalone
/// server, another cluster's member or a server without a card is named. A member that
/// cannot be asked in time is left to the load to find.
fn one_cluster(members: &[SocketAddr], tls: Option<&Connector>) -> Result<(), BenchError> {
    let refused = latchkey_client::refused_list(members, tls.cloned(), CONNECT_TIMEOUT);
    if refused.is_empty() {
        return Ok(());
    }
    let named: Vec<String> = refused
        .iter()
        .map(|(addr, why)| format!("{addr}: {why}"))
        .collect();
    Err(BenchError::Mixed(named.join("; ")))
}

/// Loads the release script into Redis and returns its SHA-1.
fn load_script(address: SocketAddr) -> Result<[u8; SHA_BYTES], BenchError> {
    let failed = |error: io::Error| BenchError::Redis(format!("{address}: {error}"));
    let mut stream = TcpStream::connect_timeout(&address, CONNECT_TIMEOUT).map_err(failed)?;
    stream
        .set_read_timeout(Some(CONNECT_TIMEOUT))
        .map_err(failed)?;
    let mut request = Vec::new();
    encode_command(&mut request, &[b"SCRIPT", b"LOAD", RELEASE_SCRIPT]);
    stream.write_all(&request).map_err(failed)?;
    let mut reply = [0u8; 1024];
    let mut len = 0;
    while len < reply.len() {
        let read = stream.read(&mut reply[len..]).map_err(failed)?;
        if read == 0 {
            return Err(BenchError::Redis(format!(
                "{address} closed the connection"
            )));
        }
        len += read;
        match parse_reply(&reply[..len]) {
            Ok(None) => continue,
            Ok(Some((RespValue::Bulk(Some(sha)), _))) if sha.len() == SHA_BYTES => {
                let mut digest = [0u8; SHA_BYTES];
                digest.copy_from_slice(sha);
                return Ok(digest);
            }
            Ok(Some((RespValue::Error(text), _))) => {
                return Err(BenchError::Redis(
                    String::from_utf8_lossy(text).into_owned(),
                ));
            }
            Ok(Some((other, _))) => {
                return Err(BenchError::Redis(format!("SCRIPT LOAD answered {other:?}")))
            }
            Err(error) => return Err(BenchError::Redis(format!("SCRIPT LOAD: {error}"))),
        }
    }
    Err(BenchError::Redis("SCRIPT LOAD answer too long".into()))
}

/// The resident set size of process `pid`, from `/proc/PID/status` (`VmRSS`).
pub fn read_rss_bytes(pid: u32) -> Result<u64, BenchError> {
    let path = format!("/proc/{pid}/status");
    let status = std::fs::read_to_string(&path)
        .map_err(|error| BenchError::Rss(format!("{path}: {error}")))?;
    parse_vm_rss(&status).ok_or_else(|| BenchError::Rss(format!("{path}: no VmRSS line")))
}

/// The `VmRSS` of a `/proc/PID/status` text, in bytes.
pub fn parse_vm_rss(status: &str) -> Option<u64> {
    let line = status.lines().find(|line| line.starts_with("VmRSS:"))?;
    let mut fields = line["VmRSS:".len()..].split_whitespace();
    let kilobytes: u64 = fields.next()?.parse().ok()?;
    (fields.next() == Some("kB")).then_some(kilobytes * 1024)
}

/// Three alphanumeric characters that differ from run to run.
fn run_tag() -> [u8; 3] {
    const ALPHABET: &[u8; 36] = b"0123456789abcdefghijklmnopqrstuvwxyz";
    let nanos = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos() as u64);
    let mut rng = Rng::new(nanos ^ u64::from(std::process::id()));
    [0; 3].map(|_: u8| ALPHABET[rng.below(36) as usize])
}

/// The share of `total` that part `index` of `parts` gets: `[start, end)`.
fn share(total: u64, index: usize, parts: usize) -> std::ops::Range<u64> {
    let at = |i: usize| (u128::from(total) * i as u128 / parts as u128) as u64;
    at(index)..at(index + 1)
}

/// Each worker's connections and keys.
fn plan_workers(config: &BenchConfig, members: &[SocketAddr], plan: &Plan) -> Vec<WorkerSpec> {
    let slots = u64::from(config.connections) * u64::from(config.pipeline);
    let samples = LATENESS_SAMPLES_MAX.min(config.keys).min(slots);
    let sample_stride = (config.keys / samples.max(1)).max(1);
    let seed = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(7, |d| d.as_nanos() as u64);
    (0..config.threads)
        .map(|index| {
            let rng = Rng::new(seed.wrapping_add(index as u64));
            let keys = match config.workload {
                Workload::Uncontended => KeySource::Spread {
                    stride: slots,
                    per_slot: config.keys / slots,
                    rng,
                },
                Workload::Contended => KeySource::Hot {
                    count: config.hot_keys,
                    rng,
                },
                Workload::Hold => KeySource::Hold(HoldKeys::new(
                    share(config.keys, index, config.threads),
                    sample_stride,
                )),
            };
            let connections = share(u64::from(config.connections), index, config.threads);
            let key_space = match config.workload {
                Workload::Contended => config.hot_keys,
                Workload::Uncontended | Workload::Hold => config.keys,
            };
            WorkerSpec {
                index,
                connections: connections.start as u32..connections.end as u32,
                pipeline: config.pipeline,
                members: members.to_vec(),
                key_space,
                shards: config.shards,
                plan: plan.clone(),
                keys,
                warmup: config.warmup,
                duration: config.duration,
            }
        })
        .collect()
}

type WorkerResult = Result<WorkerOutcome, BenchError>;

fn work<W: super::wire::Wire, S: BenchStream>(
    spec: WorkerSpec,
    shared: &Arc<Shared>,
    dial: impl FnMut(SocketAddr) -> io::Result<S>,
    make_wire: impl FnMut() -> W,
) -> WorkerResult {
    let hold = spec.plan.workload == Workload::Hold;
    let worker = match Worker::connect(spec, Arc::clone(shared), dial, make_wire) {
        Ok(worker) => worker,
        Err(error) => {
            shared.failed.fetch_add(1, Ordering::AcqRel);
            return Err(error);
        }
    };
    shared.ready.fetch_add(1, Ordering::AcqRel);
    let Some(start) = shared.wait_for_start() else {
        return Err(BenchError::Thread("aborted before the start".into()));
    };
    if hold {
        worker.run_hold(start)
    } else {
        worker.run_timed(start)
    }
}

fn spawn(
    spec: WorkerSpec,
    shared: &Arc<Shared>,
    config: &BenchConfig,
    sha: [u8; SHA_BYTES],
) -> Result<JoinHandle<WorkerResult>, BenchError> {
    let shared = Arc::clone(shared);
    let dialect = config.target.dialect;
    let tls = config.tls.clone();
    let (pipeline, lease, identify) = (config.pipeline, config.lease, config.identify);
    let index = spec.index;
    thread::Builder::new()
        .name(format!("bench-{index}"))
        .spawn(move || {
            let lease_s = lease.as_secs() as u8;
            let lease_ms = lease.as_millis() as u64;
            // `validate` allows TLS only to latchkey.
            let result = match (dialect, tls) {
                (Dialect::Latchkey, None) => {
                    let dial = |address| connect_plain(address, identify);
                    work(spec, &shared, dial, || LatchkeyWire::new(lease_s))
                }
                (Dialect::Latchkey, Some(tls)) => {
                    let dial = |address| connect_tls(address, &tls, identify);
                    work(spec, &shared, dial, || LatchkeyWire::new(lease_s))
                }
                (Dialect::Redis, _) => {
                    let dial = |address| connect_plain(address, false);
                    work(spec, &shared, dial, || {
                        RedisWire::new(pipeline, sha, lease_ms)
                    })
                }
            };
            shared.progress[index].done.store(true, Ordering::Release);
            result
        })
        .map_err(|error| BenchError::Thread(error.to_string()))
}

/// Runs the benchmark `config` describes and returns what it measured.
pub fn execute(config: &BenchConfig) -> Result<Report, BenchError> {
    let members = resolve_members(&config.target)?;
    if config.target.dialect == Dialect::Latchkey && members.len() > 1 {
        one_cluster(&members, config.tls.as_ref())?;
    }
    let sha = match config.target.dialect {
        Dialect::Redis => load_script(members[0])?,
        Dialect::Latchkey => [0; SHA_BYTES],
    };
    let plan = Plan::new(config, run_tag());
    let epoch = Instant::now();
    let hot_keys = if config.workload == Workload::Contended {
        config.hot_keys
    } else {
        0
    };
    let shared = Arc::new(Shared {
        epoch,
        ready: AtomicUsize::new(0),
        failed: AtomicUsize::new(0),
        start_at: AtomicU64::new(0),
        waiters_go: AtomicBool::new(false),
        progress: (0..config.threads).map(|_| Progress::default()).collect(),
        clock: HandoffClock::new(epoch, hot_keys),
    });
    let mut handles = Vec::with_capacity(config.threads);
    for spec in plan_workers(config, &members, &plan) {
        match spawn(spec, &shared, config, sha) {
            Ok(handle) => handles.push(handle),
            Err(error) => {
                shared.start_at.store(ABORT, Ordering::Release);
                join_all(handles);
                return Err(error);
            }
        }
    }
    let started = open_gate(config, &shared, handles.len());
    let rss_before = match started {
        Ok(()) => config.server_pid.map(read_rss_bytes).transpose(),
        Err(error) => Err(error),
    };
    let rss_before = match rss_before {
        Ok(rss) => rss,
        Err(error) => {
            shared.start_at.store(ABORT, Ordering::Release);
            let first = join_all(handles).into_iter().find_map(Result::err);
            return Err(first.unwrap_or(error));
        }
    };
    let start = Instant::now();
    let start_at = start.duration_since(epoch).as_nanos() as u64 + 1;
    shared.start_at.store(start_at, Ordering::Release);
    let rss_after = monitor(config, &shared, start)?;
    let mut outcomes = Vec::with_capacity(handles.len());
    for result in join_all(handles) {
        outcomes.push(result?);
    }
    let hold = (config.workload == Workload::Hold).then(|| HoldFigures {
        rss_before_bytes: rss_before,
        rss_after_bytes: rss_after,
        samples: outcomes.iter().map(|outcome| outcome.samples).sum(),
    });
    Ok(Report::merge(config, outcomes, hold))
}

/// Waits until every worker has connected (or one failed).
fn open_gate(config: &BenchConfig, shared: &Shared, workers: usize) -> Result<(), BenchError> {
    let members = config.target.addresses().count() as u32;
    let connect_all = CONNECT_TIMEOUT * (members * config.connections / config.threads as u32 + 1);
    let give_up_at = Instant::now() + connect_all;
    loop {
        if shared.failed.load(Ordering::Acquire) > 0 {
            return Err(BenchError::Thread("a load thread could not connect".into()));
        }
        if shared.ready.load(Ordering::Acquire) == workers {
            return Ok(());
        }
        if Instant::now() > give_up_at {
            return Err(BenchError::Thread("connecting took too long".into()));
        }
        thread::sleep(Duration::from_millis(1));
    }
}

fn join_all(handles: Vec<JoinHandle<WorkerResult>>) -> Vec<WorkerResult> {
    handles
        .into_iter()
        .map(|handle| {
            handle
                .join()
                .unwrap_or_else(|_| Err(BenchError::Thread("a load thread panicked".into())))
        })
        .collect()
}

/// Watches the workers until all are done: progress line, and for `hold` the RSS reading
/// between the grant and waiter phases (returned).
fn monitor(
    config: &BenchConfig,
    shared: &Shared,
    start: Instant,
) -> Result<Option<u64>, BenchError> {
    let mut line = ProgressLine::new(config, start);
    let mut rss_after = None;
    loop {
        thread::sleep(MONITOR_TICK);
        let progress = &shared.progress;
        let done = progress.iter().all(|p| p.done.load(Ordering::Acquire));
        let hold_paused = progress
            .iter()
            .all(|p| p.granted.load(Ordering::Acquire) || p.done.load(Ordering::Acquire));
        if config.workload == Workload::Hold
            && hold_paused
            && !shared.waiters_go.load(Ordering::Acquire)
        {
            rss_after = match config.server_pid.map(read_rss_bytes).transpose() {
                Ok(rss) => rss,
                Err(error) => {
                    line.note(&format!("{error}"));
                    None
                }
            };
            line.note("all leases granted; queueing waiters until they expire");
            shared.waiters_go.store(true, Ordering::Release);
        }
        if done {
            line.finish();
            return Ok(rss_after);
        }
        line.update(shared);
    }
}

/// The progress line on stderr: redrawn in place on a terminal, one line a second elsewhere,
/// nothing at all when disabled (`--json`).
struct ProgressLine {
    enabled: bool,
    terminal: bool,
    start: Instant,
    warmup: Duration,
    measured: Duration,
    hold: bool,
    last_at: Instant,
    last_requests: u64,
    last_cycles: u64,
}

impl ProgressLine {
    fn new(config: &BenchConfig, start: Instant) -> ProgressLine {
        ProgressLine {
            enabled: config.progress,
            terminal: io::stderr().is_terminal(),
            start,
            warmup: config.warmup,
            measured: config.duration,
            hold: config.workload == Workload::Hold,
            last_at: start,
            last_requests: 0,
            last_cycles: 0,
        }
    }

    fn phase(&self, elapsed: Duration) -> &'static str {
        if self.hold {
            "hold"
        } else if elapsed < self.warmup {
            "warm-up"
        } else if elapsed < self.warmup + self.measured {
            "measuring"
        } else {
            "draining"
        }
    }

    fn update(&mut self, shared: &Shared) {
        let now = Instant::now();
        let every = if self.terminal {
            PROGRESS_TERMINAL
        } else {
            PROGRESS_PLAIN
        };
        if !self.enabled || now.duration_since(self.last_at) < every {
            return;
        }
        let sum = |field: fn(&Progress) -> &AtomicU64| {
            shared
                .progress
                .iter()
                .map(|p| field(p).load(Ordering::Relaxed))
                .sum::<u64>()
        };
        let requests = sum(|p| &p.requests);
        let cycles = sum(|p| &p.cycles);
        let errors = sum(|p| &p.errors);
        let seconds = now.duration_since(self.last_at).as_secs_f64();
        let elapsed = now.duration_since(self.start);
        let text = format!(
            "{:>6.1}s {:<9} requests/s {:>10.0}  cycles/s {:>10.0}  errors {}",
            elapsed.as_secs_f64(),
            self.phase(elapsed),
            requests.saturating_sub(self.last_requests) as f64 / seconds,
            cycles.saturating_sub(self.last_cycles) as f64 / seconds,
            errors,
        );
        self.print(&text);
        (self.last_at, self.last_requests, self.last_cycles) = (now, requests, cycles);
    }

    fn print(&self, text: &str) {
        if self.terminal {
            eprint!("\r\x1b[K{text}");
        } else {
            eprintln!("{text}");
        }
    }

    fn note(&self, text: &str) {
        if self.enabled {
            self.print(text);
            if self.terminal {
                eprintln!();
            }
        }
    }

    fn finish(&self) {
        if self.enabled && self.terminal {
            eprint!("\r\x1b[K");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn vm_rss_is_read_in_bytes() {
        let status = "Name:\tlatchkey\nVmPeak:\t  9000 kB\nVmRSS:\t    1234 kB\nThreads:\t3\n";
        assert_eq!(parse_vm_rss(status), Some(1234 * 1024));
        assert_eq!(parse_vm_rss("Name: x\n"), None);
        assert_eq!(parse_vm_rss("VmRSS: 12 MB\n"), None);
    }

    #[test]
    fn own_rss_is_readable() {
        let rss = read_rss_bytes(std::process::id()).unwrap();
        assert!(rss > 0);
        assert!(read_rss_bytes(u32::MAX).is_err());
    }

    #[test]
    fn shares_cover_the_range_without_overlap() {
        let parts: Vec<_> = (0..3).map(|i| share(10, i, 3)).collect();
        assert_eq!(parts, vec![0..3, 3..6, 6..10]);
        assert_eq!(share(5, 0, 1), 0..5);
    }

    #[test]
    fn run_tags_are_alphanumeric() {
        let tag = run_tag();
        assert!(tag.iter().all(u8::is_ascii_alphanumeric), "{tag:?}");
    }
}
