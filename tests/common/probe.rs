//! A well-behaved client to run beside hostile ones: it must keep its locks and a low latency.

use super::server::{keys_on_partition, Conn, RawStream};
use latchkey_client::protocol::{Request, Response};
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::thread::{self, JoinHandle};
use std::time::{Duration, Instant};

/// The probe's p99 latency must stay under this (generous: debug build, shared cores).
pub const P99_BOUND: Duration = Duration::from_millis(200);
/// The probe's holds: longer than any scenario.
const PROBE_LEASE_S: u8 = 60;

static SERIAL: Mutex<()> = Mutex::new(());

/// Held while a scenario runs: the scenarios of one test binary run one at a time, so that
/// one's load does not count against another's probe latency (a poisoned lock is taken anyway).
pub fn serial() -> MutexGuard<'static, ()> {
    SERIAL
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner())
}

/// One key per partition of `cores`, named `prefix-N`.
pub fn key_per_partition(prefix: &str, cores: usize) -> Vec<String> {
    (0..cores)
        .map(|partition| keys_on_partition(prefix, partition, cores, 1).remove(0))
        .collect()
}

/// A well-behaved session: holds one lock per partition, and until stopped pings, queries both
/// partitions and extends its holds, timing every request.
pub struct Probe {
    stop: Arc<AtomicBool>,
    thread: JoinHandle<Vec<Duration>>,
}

impl Probe {
    /// Starts the probe on a server of `cores` cores; returns once it holds its locks.
    pub fn start(addr: SocketAddr, cores: usize) -> Probe {
        Probe::start_over(cores, move || Conn::connect(addr))
    }

    /// Like [`start`](Self::start), on the connection `connect` makes (in the probe's thread):
    /// over TLS, say.
    pub fn start_over<S, F>(cores: usize, connect: F) -> Probe
    where
        S: RawStream + 'static,
        F: FnOnce() -> Conn<S> + Send + 'static,
    {
        let stop = Arc::new(AtomicBool::new(false));
        let stopping = Arc::clone(&stop);
        let (ready_tx, ready_rx) = std::sync::mpsc::channel();
        let thread = thread::spawn(move || {
            let mut conn = connect();
            let keys = key_per_partition("probe-held", cores);
            let tokens: Vec<u64> = (0..cores)
                .map(|p| conn.acquire_ok(&keys[p], PROBE_LEASE_S, 900 + p as u64))
                .collect();
            ready_tx.send(()).unwrap();
            let mut latencies = Vec::new();
            let mut nonce = 0u64;
            while !stopping.load(Ordering::Relaxed) {
                for (key, &token) in keys.iter().zip(&tokens) {
                    nonce += 1;
                    let requests = [
                        Request::Ping { nonce },
                        Request::Query {
                            nonce,
                            key: key.as_bytes(),
                        },
                        Request::Extend {
                            lease_s: PROBE_LEASE_S,
                            token,
                            key: key.as_bytes(),
                        },
                    ];
                    for request in requests {
                        let sent = Instant::now();
                        conn.send(request);
                        let response = conn.recv();
                        latencies.push(sent.elapsed());
                        assert_eq!(response.correlation_id(), request.correlation_id());
                        assert_ne!(response.op(), b'N', "the probe lost its hold: {response:?}");
                    }
                }
                thread::sleep(Duration::from_millis(5));
            }
            for (key, token) in keys.iter().zip(tokens) {
                assert_eq!(conn.release(key, token), Response::Released { token });
            }
            latencies
        });
        ready_rx
            .recv_timeout(Duration::from_secs(10))
            .expect("the probe holds its locks");
        Probe { stop, thread }
    }

    /// Stops the probe, releases its holds (each must answer `R`) and checks its p99.
    pub fn finish(self, scenario: &str) {
        self.stop.store(true, Ordering::Relaxed);
        let mut latencies = self.thread.join().expect("the probe kept working");
        latencies.sort();
        assert!(
            !latencies.is_empty(),
            "{scenario}: the probe made no request"
        );
        let p99 = latencies[(latencies.len() * 99).div_ceil(100) - 1];
        let max = latencies[latencies.len() - 1];
        eprintln!(
            "{scenario}: probe {} requests, p99 {p99:.1?}, max {max:.1?}, holds released",
            latencies.len()
        );
        assert!(
            p99 < P99_BOUND,
            "{scenario}: probe p99 {p99:?} over {P99_BOUND:?}"
        );
    }
}
