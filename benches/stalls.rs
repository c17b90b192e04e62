//! Loop stalls while a partition grows and while a million leases expire.
//!
//! A latchkey promise is low latency for every session, even while one core does bulk work.
//! This benchmark starts a one-core server in-process and runs two scenarios; in each, a probe
//! session pings the core every 250 µs and records how long each answer took, and the server
//! reports its worst event-loop iteration (the time one iteration held the core):
//!
//! * `grow`: the partition grows to `STALL_GROW_KEYS` held keys (default 4,000,000, the
//!   default `max_keys` of one core), taken by pipelined acquires as fast as the core goes.
//! * `expire`: `STALL_EXPIRE_KEYS` leases (default 1,000,000) of random length (1 s to
//!   `STALL_LEASE_MAX_S`, default 8 s) are taken in random order, then expire; the figures cover
//!   the expiry window, from the end of the fill until the last lease has run out.
//! * `cluster`: a one-member cluster (one core, one shard, `fsync` on, its own majority) takes
//!   `STALL_CLUSTER_KEYS` keys (default 100,000) by pipelined acquires, each a log entry the
//!   write-ahead log must sync: once with the disk as it is, once with every sync made
//!   `STALL_SYNC_DELAY_US` longer (default 20,000: a slow disk; the log's benchmark hook
//!   `BENCH_SYNC_DELAY_US`). Where the sync runs on the core's loop, every iteration that syncs
//!   holds the core that long, and the probe waits with it. The shard compacts its log every
//!   10,000 entries, so the fill also measures compactions of up to `STALL_CLUSTER_KEYS` holds
//!   (one shard keeps at most 1,000,000). With `STALL_CLUSTER_MORE_KEYS` (default 0), a second
//!   phase (`more`) then takes that many more keys: its compactions are of (nearly) a full
//!   shard, without the fill's one-off growth of the shard's tables (a hash table's resize is
//!   one long iteration at ~917,504 keys). E.g. `STALL_CLUSTER_KEYS=970000
//!   STALL_CLUSTER_MORE_KEYS=30000`: three compactions of 970,000 to 1,000,000 holds.
//!
//! `STALL_SCENARIOS` picks scenarios (comma-separated; default `grow,expire,cluster`).
//! Run with `cargo bench --bench stalls`. Randomness comes from a fixed, printed seed
//! (`STALL_SEED` changes it). With two CPUs or more, the server's core runs alone on CPU 0 and
//! the load and the probe on CPU 1, so that an iteration is not stretched by the load
//! generator taking the server's CPU (`STALL_PIN=0` turns that off). The figures are for
//! comparing two builds on one machine in one run, not absolute targets.
//!
//! The worst loop iteration is in wall-clock time by default: what a client waits, which
//! includes any time the machine did not run the server's thread. Run with
//! `LATCHKEY_STALL_CLOCK=cpu` to count the thread's CPU time per iteration instead: the work an
//! iteration did, whatever the machine did meanwhile. The machine's floor is reported first:
//! the worst gap a thread spinning alone on the server's CPU saw in two seconds.

use hdrhistogram::Histogram;
use latchkey::config::{ClusterConfig, Config, MemberConfig};
use latchkey::rng::Rng;
use latchkey::server::{ServerHandle, LOOP_BUCKETS_US};
use latchkey_client::protocol::{parse_response, Request, Response};
use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::thread;
use std::time::{Duration, Instant};

/// Requests each load connection keeps outstanding.
const WINDOW: usize = 256;
/// Load connections.
const CONNECTIONS: usize = 4;
/// Time between two probe pings.
const PROBE_PERIOD: Duration = Duration::from_micros(250);

fn env_u64(name: &str, default: u64) -> u64 {
    std::env::var(name)
        .ok()
        .and_then(|text| text.parse().ok())
        .unwrap_or(default)
}

/// Pins the calling thread (and the threads it spawns later) to `cpu`; false if it cannot.
fn pin(cpu: usize) -> bool {
    // SAFETY: cpu_set_t is plain data, zeroed is an empty set; the call only reads it.
    unsafe {
        let mut set: libc::cpu_set_t = std::mem::zeroed();
        libc::CPU_SET(cpu, &mut set);
        libc::sched_setaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &set) == 0
    }
}

/// A one-core server; when pinning, its core thread on CPU 0 and the caller then on CPU 1.
fn start_server(max_keys: usize) -> ServerHandle {
    let mut config = Config::default();
    config.server.listen = "127.0.0.1:0".parse().expect("address");
    config.server.cores = 1;
    config.limits.max_keys = max_keys;
    start_pinned(config)
}

/// Starts `config`'s server; when pinning, its threads on CPU 0 and the caller then on CPU 1.
fn start_pinned(config: Config) -> ServerHandle {
    let pinning = env_u64("STALL_PIN", 1) == 1
        && std::thread::available_parallelism().map_or(1, |n| n.get()) >= 2;
    if pinning {
        pin(0);
    }
    let server = latchkey::node::start(config).expect("server starts");
    if pinning {
        pin(1);
    }
    server
}

/// What one probe saw: latencies of its pings in microseconds.
struct Probe {
    stop: Arc<AtomicBool>,
    thread: thread::JoinHandle<Histogram<u64>>,
}

impl Probe {
    fn start(addr: SocketAddr) -> Probe {
        let stop = Arc::new(AtomicBool::new(false));
        let flag = Arc::clone(&stop);
        let thread = thread::spawn(move || probe(addr, &flag));
        Probe { stop, thread }
    }

    fn finish(self) -> Histogram<u64> {
        self.stop.store(true, Ordering::Relaxed);
        self.thread.join().expect("probe thread")
    }
}

fn probe(addr: SocketAddr, stop: &AtomicBool) -> Histogram<u64> {
    let mut stream = TcpStream::connect(addr).expect("probe connects");
    stream.set_nodelay(true).expect("nodelay");
    let mut histogram = Histogram::<u64>::new(3).expect("histogram");
    let mut frame = Vec::new();
    let mut answer = [0u8; 10];
    let mut nonce = 0u64;
    while !stop.load(Ordering::Relaxed) {
        nonce += 1;
        frame.clear();
        Request::Ping { nonce }.encode(&mut frame);
        let sent = Instant::now();
        stream.write_all(&frame).expect("probe writes");
        stream.read_exact(&mut answer).expect("probe reads");
        let latency_us = sent.elapsed().as_micros() as u64;
        histogram.record(latency_us.max(1)).expect("record");
        let next = sent + PROBE_PERIOD;
        if let Some(left) = next.checked_duration_since(Instant::now()) {
            thread::sleep(left);
        }
    }
    histogram
}

/// Takes every key of `keys` with its lease (seconds) over `CONNECTIONS` pipelined
/// connections; returns how many were granted.
fn fill(addr: SocketAddr, keys: Vec<(String, u8)>) -> usize {
    let per = keys.len().div_ceil(CONNECTIONS);
    let chunks: Vec<Vec<(String, u8)>> = keys.chunks(per).map(<[_]>::to_vec).collect();
    let threads: Vec<_> = chunks
        .into_iter()
        .map(|chunk| thread::spawn(move || fill_one(addr, &chunk)))
        .collect();
    threads
        .into_iter()
        .map(|thread| thread.join().expect("load thread"))
        .sum()
}

fn fill_one(addr: SocketAddr, keys: &[(String, u8)]) -> usize {
    let mut stream = TcpStream::connect(addr).expect("load connects");
    stream.set_nodelay(true).expect("nodelay");
    let (mut granted, mut input, mut filled) = (0, vec![0u8; 64 * 1024], 0usize);
    let mut frame = Vec::new();
    for batch in keys.chunks(WINDOW) {
        frame.clear();
        for (index, (key, lease_s)) in batch.iter().enumerate() {
            let owner = index as u64 + 1;
            let request = Request::Acquire {
                wait_s: 0,
                lease_s: *lease_s,
                owner,
                key: key.as_bytes(),
            };
            request.encode(&mut frame);
        }
        stream.write_all(&frame).expect("load writes");
        let mut answered = 0;
        while answered < batch.len() {
            let read = stream.read(&mut input[filled..]).expect("load reads");
            assert!(read > 0, "server closed a load connection");
            filled += read;
            let mut used = 0;
            while let Some((response, len)) = parse_response(&input[used..filled]).expect("frame") {
                used += len;
                answered += 1;
                granted += usize::from(matches!(response, Response::Acquired { .. }));
            }
            input.copy_within(used..filled, 0);
            filled -= used;
        }
    }
    granted
}

/// The server's loop iterations over one phase: worst, how many, how many over 1 ms.
struct Loops {
    worst_us: u64,
    iterations: u64,
    over_1ms: u64,
}

/// Loop statistics since `before` (a histogram taken at the phase's start).
/// Grants every key of `wanted` (each a new key) with a probe session pinging meanwhile, and
/// reports the fill as `scenario phase`; returns when the fill started.
fn measured_fill(
    server: &ServerHandle,
    (scenario, phase): (&str, &str),
    wanted: Vec<(String, u8)>,
) -> Instant {
    let (addr, keys) = (server.local_addr(), wanted.len());
    server.take_worst_loop_us();
    let before = server.loop_histogram();
    let probe = Probe::start(addr);
    let start = Instant::now();
    let granted = fill(addr, wanted);
    let elapsed = start.elapsed();
    let loops = loops_since(server, &before);
    let histogram = probe.finish();
    assert_eq!(granted, keys, "every acquire of a new key is granted");
    report(scenario, phase, elapsed, &loops, &histogram);
    start
}

fn loops_since(server: &ServerHandle, before: &[u64]) -> Loops {
    let now = server.loop_histogram();
    let delta: Vec<u64> = now.iter().zip(before).map(|(n, b)| n - b).collect();
    let over = LOOP_BUCKETS_US
        .iter()
        .position(|&bound| bound == 1_000)
        .expect("1 ms")
        + 1;
    Loops {
        worst_us: server.take_worst_loop_us(),
        iterations: delta.iter().sum(),
        over_1ms: delta[over..].iter().sum(),
    }
}

/// One line of the report.
fn report(scenario: &str, phase: &str, elapsed: Duration, loops: &Loops, probe: &Histogram<u64>) {
    println!(
        "{scenario:<7} {phase:<7} {:>6.2} s  loop: worst {:>7} us, {:>4} of {:>7} over 1 ms  \
         probe: {:>6} pings, p50 {:>5} us, p99 {:>5} us, p99.9 {:>6} us, max {:>7} us",
        elapsed.as_secs_f64(),
        loops.worst_us,
        loops.over_1ms,
        loops.iterations,
        probe.len(),
        probe.value_at_quantile(0.5),
        probe.value_at_quantile(0.99),
        probe.value_at_quantile(0.999),
        probe.max(),
    );
}

fn grow(keys: usize) {
    let server = start_server(keys);
    let wanted: Vec<(String, u8)> = (0..keys).map(|i| (format!("grow/{i:09}"), 255)).collect();
    measured_fill(&server, ("grow", "fill"), wanted);
}

fn expire(keys: usize, lease_max_s: u64, seed: u64) {
    let server = start_server(keys.max(1));
    let addr = server.local_addr();
    let mut rng = Rng::new(seed);
    let mut wanted: Vec<(String, u8)> = (0..keys)
        .map(|i| (format!("expire/{i:09}"), 1 + rng.below(lease_max_s) as u8))
        .collect();
    // Random insertion order, so deadlines arrive at the wheel out of order.
    for i in (1..wanted.len()).rev() {
        wanted.swap(i, rng.below(i as u64 + 1) as usize);
    }
    let start = measured_fill(&server, ("expire", "fill"), wanted);
    let before = server.loop_histogram();
    let probe = Probe::start(addr);
    let window_start = Instant::now();
    // Every lease ends by the fill's start + the longest lease; then one more second.
    let window_end = start + Duration::from_secs(lease_max_s + 1);
    thread::sleep(window_end.saturating_duration_since(window_start));
    let loops = loops_since(&server, &before);
    let histogram = probe.finish();
    report(
        "expire",
        "expiry",
        window_start.elapsed(),
        &loops,
        &histogram,
    );
}

/// A free local address (bound, then let go).
fn free_addr() -> SocketAddr {
    let listener = TcpListener::bind("127.0.0.1:0").expect("a free port");
    listener.local_addr().expect("its address")
}

/// A one-member cluster of one core and one shard, `fsync` on, its data under `dir`.
fn start_member(dir: &Path) -> ServerHandle {
    let (client, peer) = (free_addr(), free_addr());
    let mut config = Config::default();
    config.server.listen = client;
    config.server.cores = 1;
    config.server.cores_explicit = true;
    // One shard holds at most a million keys.
    config.limits.max_keys = 1_000_000;
    config.cluster = Some(ClusterConfig {
        node_id: 1,
        data_dir: dir.to_path_buf(),
        members: vec![MemberConfig {
            id: 1,
            client,
            peer,
        }],
        shards: 1,
        fsync: true,
        tls: None,
        restore_from: None,
    });
    start_pinned(config)
}

/// Waits (10 s at most) until the member grants an acquire: it elected itself and serves.
fn wait_serving(addr: SocketAddr) {
    let deadline = Instant::now() + Duration::from_secs(10);
    while Instant::now() < deadline {
        let mut stream = TcpStream::connect(addr).expect("connects");
        let mut frame = Vec::new();
        let request = Request::Acquire {
            wait_s: 0,
            lease_s: 1,
            owner: 1,
            key: b"stalls/ready",
        };
        request.encode(&mut frame);
        stream.write_all(&frame).expect("writes");
        let (mut input, mut filled) = (vec![0u8; 4096], 0);
        let response = loop {
            filled += stream.read(&mut input[filled..]).expect("reads");
            if let Some((response, _)) = parse_response(&input[..filled]).expect("a frame") {
                break response;
            }
        };
        if matches!(response, Response::Acquired { .. }) {
            return;
        }
        thread::sleep(Duration::from_millis(20));
    }
    panic!("the one-member cluster does not serve within 10 s");
}

/// A directory under the temp dir for one member's data, removed when dropped.
struct DataDir(PathBuf);

impl Drop for DataDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

fn cluster(keys: usize, compact_keys: usize, delay_us: u64) {
    let pid = std::process::id();
    let dir = DataDir(std::env::temp_dir().join(format!("latchkey-stalls-{pid}-{delay_us}")));
    latchkey::cluster::wal::BENCH_SYNC_DELAY_US.store(delay_us, Ordering::Relaxed);
    let server = start_member(&dir.0);
    wait_serving(server.local_addr());
    let wanted: Vec<(String, u8)> = (0..keys).map(|i| (format!("sync/{i:09}"), 255)).collect();
    let phase = format!("+{}ms", delay_us / 1000);
    measured_fill(&server, ("cluster", &phase), wanted);
    if compact_keys > 0 {
        // The shard's tables have grown already: what this phase adds to the fill's stalls is
        // the compactions of (nearly) `keys` holds, one every 10,000 entries.
        let more: Vec<(String, u8)> = (keys..keys + compact_keys)
            .map(|i| (format!("sync/{i:09}"), 255))
            .collect();
        measured_fill(&server, ("cluster", &format!("{phase} more")), more);
    }
    drop(server);
    latchkey::cluster::wal::BENCH_SYNC_DELAY_US.store(0, Ordering::Relaxed);
}

/// What a thread spinning for `span` alone on CPU 0 sees: the worst gap between two clock
/// readings, and how many gaps were over 1 ms. Nothing of the server runs then.
fn jitter_floor(span: Duration) -> (u64, u64) {
    thread::spawn(move || {
        pin(0);
        let start = Instant::now();
        let (mut last, mut worst, mut over) = (start, Duration::ZERO, 0);
        while last - start < span {
            let now = Instant::now();
            worst = worst.max(now - last);
            over += u64::from(now - last > Duration::from_millis(1));
            last = now;
        }
        (worst.as_micros() as u64, over)
    })
    .join()
    .expect("spinner")
}

fn main() {
    // `cargo bench` passes `--bench`; `cargo test --benches` runs it with no such flag: then
    // do nothing, the build is the test.
    if !std::env::args().any(|arg| arg == "--bench") {
        return;
    }
    let seed = env_u64("STALL_SEED", 0x5eed_2026);
    let grow_keys = env_u64("STALL_GROW_KEYS", 4_000_000) as usize;
    let expire_keys = env_u64("STALL_EXPIRE_KEYS", 1_000_000) as usize;
    let lease_max_s = env_u64("STALL_LEASE_MAX_S", 8).clamp(1, 255);
    println!(
        "stalls: seed {seed:#x}, grow {grow_keys} keys, expire {expire_keys} leases of 1..={lease_max_s} s, \
         probe every {} us",
        PROBE_PERIOD.as_micros()
    );
    let clock = std::env::var("LATCHKEY_STALL_CLOCK").unwrap_or_else(|_| "wall".into());
    let (floor_us, floor_over) = jitter_floor(Duration::from_secs(5));
    println!(
        "loop iterations in {clock} time; machine floor: a thread spinning alone on CPU 0 for \
         5 s saw a worst gap of {floor_us} us and {floor_over} gaps over 1 ms"
    );
    let scenarios =
        std::env::var("STALL_SCENARIOS").unwrap_or_else(|_| "grow,expire,cluster".into());
    let scenarios: Vec<&str> = scenarios.split(',').map(str::trim).collect();
    if scenarios.contains(&"grow") {
        grow(grow_keys);
    }
    if scenarios.contains(&"expire") {
        expire(expire_keys, lease_max_s, seed);
    }
    if scenarios.contains(&"cluster") {
        let keys = env_u64("STALL_CLUSTER_KEYS", 100_000) as usize;
        let more = env_u64("STALL_CLUSTER_MORE_KEYS", 0) as usize;
        let delay_us = env_u64("STALL_SYNC_DELAY_US", 20_000);
        println!(
            "cluster: {keys} keys then {more} more, each sync as it is, then {delay_us} us longer"
        );
        cluster(keys, more, 0);
        cluster(keys, more, delay_us);
    }
}
