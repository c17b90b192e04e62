//! Starting a real server for a test (in-process or as the binary) and talking raw frames to it.

use latchkey::config::Config;
use latchkey::server::ServerHandle;
use latchkey_client::protocol::{parse_response, Request, Response};
use std::io::{BufRead, BufReader, Read, Write};
use std::net::{Shutdown, SocketAddr, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// How long a test waits for an answer that must come (generous: shared 2-core machines).
pub const ANSWER_TIMEOUT: Duration = Duration::from_secs(10);

/// A config for tests: loopback, ephemeral port, `cores` cores.
pub fn test_config(cores: usize) -> Config {
    let mut config = Config::default();
    config.server.listen = "127.0.0.1:0".parse().unwrap();
    config.server.cores = cores;
    config
}

/// Starts an in-process server with `cores` cores and default limits.
pub fn start(cores: usize) -> ServerHandle {
    start_with(test_config(cores))
}

/// Starts an in-process server with `config`.
pub fn start_with(config: Config) -> ServerHandle {
    latchkey::node::start(config).expect("server starts")
}

/// The `latchkey` binary running as a child process.
pub struct ServerProcess {
    /// The child; killed on drop if still running.
    pub child: Child,
    /// Where it listens.
    pub addr: SocketAddr,
}

/// `latchkey serve --listen 127.0.0.1:0 ARGS...`, not yet spawned.
fn serve_command(args: &[&str]) -> Command {
    let mut command = Command::new(crate::latchkey_bin());
    command
        .arg("serve")
        .args(["--listen", "127.0.0.1:0"])
        .args(args);
    command
}

/// Reads the server's first stdout line, `listening on ADDR`; `log` says what it logged when
/// that line is missing.
fn read_address(child: &mut Child, log: impl Fn() -> String) -> SocketAddr {
    let mut line = String::new();
    BufReader::new(child.stdout.take().expect("stdout piped"))
        .read_line(&mut line)
        .expect("read the address line");
    let addr = line.trim().strip_prefix("listening on ");
    let addr = addr.unwrap_or_else(|| panic!("unexpected first line {line:?}; log:\n{}", log()));
    addr.parse().expect("an address")
}

/// The first line of `log` that contains every one of `parts`, waiting for it at most `within`.
pub fn wait_for_line(log: &Arc<Mutex<String>>, parts: &[&str], within: Duration) -> String {
    let until = Instant::now() + within;
    loop {
        let found = log
            .lock()
            .unwrap()
            .lines()
            .find(|line| parts.iter().all(|part| line.contains(part)))
            .map(str::to_owned);
        if let Some(line) = found {
            return line;
        }
        assert!(
            Instant::now() < until,
            "no line with {parts:?} in:\n{}",
            log.lock().unwrap()
        );
        std::thread::sleep(Duration::from_millis(10));
    }
}

impl ServerProcess {
    /// Runs `latchkey serve --listen 127.0.0.1:0 ARGS...` and waits for its address line.
    pub fn spawn(args: &[&str]) -> ServerProcess {
        let mut child = serve_command(args)
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()
            .expect("spawn latchkey");
        let addr = read_address(&mut child, String::new);
        ServerProcess { child, addr }
    }

    /// Runs `latchkey serve --listen 127.0.0.1:0 ARGS...` with `RUST_LOG=rust_log`, collecting
    /// its stderr in the background; waits for its address line.
    pub fn spawn_logging(args: &[&str], rust_log: &str) -> (ServerProcess, Arc<Mutex<String>>) {
        let mut command = serve_command(args);
        command.env("RUST_LOG", rust_log);
        ServerProcess::spawn_collecting(command)
    }

    /// Spawns `command` (a `latchkey serve` that prints its address line first) with its
    /// stdout and stderr piped, collecting stderr in the background; waits for the address.
    pub fn spawn_collecting(mut command: Command) -> (ServerProcess, Arc<Mutex<String>>) {
        let mut child = command
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .expect("spawn latchkey");
        let log = Arc::new(Mutex::new(String::new()));
        let sink = Arc::clone(&log);
        let stderr = child.stderr.take().unwrap();
        std::thread::spawn(move || {
            for line in BufReader::new(stderr).lines().map_while(Result::ok) {
                let mut log = sink.lock().unwrap();
                log.push_str(&line);
                log.push('\n');
            }
        });
        let addr = read_address(&mut child, || log.lock().unwrap().clone());
        (ServerProcess { child, addr }, log)
    }

    /// Sends a signal (e.g. `libc::SIGTERM`).
    pub fn signal(&self, signal: i32) {
        let pid = self.child.id() as i32;
        // SAFETY: kill(2) with a pid we spawned and a valid signal number has no memory effects.
        assert_eq!(unsafe { libc::kill(pid, signal) }, 0);
    }

    /// Waits up to `limit` for the exit status.
    pub fn wait_timeout(&mut self, limit: Duration) -> Option<std::process::ExitStatus> {
        let start = Instant::now();
        while start.elapsed() < limit {
            if let Some(status) = self.child.try_wait().unwrap() {
                return Some(status);
            }
            std::thread::sleep(Duration::from_millis(10));
        }
        None
    }
}

impl Drop for ServerProcess {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// A raw protocol connection: write frames, read parsed responses. Over TCP by default, or any
/// blocking stream over a TCP socket (a TLS stream).
pub struct Conn<S: RawStream = TcpStream> {
    /// The socket.
    pub stream: S,
    buffer: Vec<u8>,
}

/// A blocking byte stream over a TCP socket (whose read timeout the connection sets).
pub trait RawStream: Read + Write {
    /// The TCP socket underneath.
    fn tcp(&self) -> &TcpStream;
}

impl RawStream for TcpStream {
    fn tcp(&self) -> &TcpStream {
        self
    }
}

impl<C, D> RawStream for rustls::StreamOwned<C, TcpStream>
where
    C: std::ops::DerefMut + std::ops::Deref<Target = rustls::ConnectionCommon<D>>,
    D: rustls::SideData,
{
    fn tcp(&self) -> &TcpStream {
        &self.sock
    }
}

impl<S: RawStream> Conn<S> {
    /// A connection over `stream`.
    pub fn over(stream: S) -> Conn<S> {
        Conn {
            stream,
            buffer: Vec::new(),
        }
    }
}

impl Conn {
    /// Connects to `addr`.
    pub fn connect(addr: SocketAddr) -> Conn {
        let stream = TcpStream::connect(addr).expect("connect");
        stream.set_nodelay(true).unwrap();
        Conn {
            stream,
            buffer: Vec::new(),
        }
    }

    /// Connects to `addr` with a small, fixed receive buffer, so that the server's answers
    /// back up soon while the test does not read (a slow reader).
    pub fn connect_small_buffer(addr: SocketAddr) -> Conn {
        let socket = socket2::Socket::new(socket2::Domain::IPV4, socket2::Type::STREAM, None)
            .expect("socket");
        socket.set_recv_buffer_size(4096).expect("SO_RCVBUF");
        socket.connect(&addr.into()).expect("connect");
        let stream: TcpStream = socket.into();
        stream.set_nodelay(true).unwrap();
        Conn {
            stream,
            buffer: Vec::new(),
        }
    }
}

impl<S: RawStream> Conn<S> {
    /// Writes raw bytes.
    pub fn send_raw(&mut self, bytes: &[u8]) {
        self.stream.write_all(bytes).expect("write");
    }

    /// Writes one request frame.
    pub fn send(&mut self, request: Request<'_>) {
        let mut frame = Vec::new();
        request.encode(&mut frame);
        self.send_raw(&frame);
    }

    /// Reads the next response, waiting up to `limit`; `None` on timeout.
    pub fn recv_within(&mut self, limit: Duration) -> Option<Response> {
        let deadline = Instant::now() + limit;
        loop {
            if let Some((response, used)) = parse_response(&self.buffer).expect("valid response") {
                self.buffer.drain(..used);
                return Some(response);
            }
            let left = deadline.checked_duration_since(Instant::now())?;
            self.stream
                .tcp()
                .set_read_timeout(Some(left.max(Duration::from_millis(1))))
                .unwrap();
            let mut chunk = [0u8; 4096];
            match self.stream.read(&mut chunk) {
                Ok(0) => panic!("connection closed while waiting for a response"),
                Ok(n) => self.buffer.extend_from_slice(&chunk[..n]),
                Err(e)
                    if e.kind() == std::io::ErrorKind::WouldBlock
                        || e.kind() == std::io::ErrorKind::TimedOut =>
                {
                    return None
                }
                Err(e) => panic!("read failed: {e}"),
            }
        }
    }

    /// Reads the next response, which must come within [`ANSWER_TIMEOUT`].
    pub fn recv(&mut self) -> Response {
        self.recv_within(ANSWER_TIMEOUT)
            .expect("a response within the timeout")
    }

    /// Asserts nothing arrives for `quiet`.
    pub fn expect_silence(&mut self, quiet: Duration) {
        if let Some(response) = self.recv_within(quiet) {
            panic!("unexpected response {response:?}");
        }
    }

    /// Waits until the server closes the connection (after reading any remaining responses,
    /// which are returned).
    pub fn recv_until_closed(&mut self) -> Vec<Response> {
        let mut responses = Vec::new();
        self.stream
            .tcp()
            .set_read_timeout(Some(ANSWER_TIMEOUT))
            .unwrap();
        loop {
            while let Some((response, used)) = parse_response(&self.buffer).expect("valid") {
                self.buffer.drain(..used);
                responses.push(response);
            }
            let mut chunk = [0u8; 4096];
            match self.stream.read(&mut chunk) {
                Ok(0) => return responses,
                Ok(n) => self.buffer.extend_from_slice(&chunk[..n]),
                Err(e) if e.kind() == std::io::ErrorKind::ConnectionReset => return responses,
                Err(e) => panic!("waiting for close: {e}"),
            }
        }
    }

    /// Acquire and wait for its answer.
    pub fn acquire(&mut self, key: &str, wait_s: u8, lease_s: u8, owner: u64) -> Response {
        self.send(Request::Acquire {
            wait_s,
            lease_s,
            owner,
            key: key.as_bytes(),
        });
        self.recv()
    }

    /// Acquire that must be granted; returns the token.
    pub fn acquire_ok(&mut self, key: &str, lease_s: u8, owner: u64) -> u64 {
        match self.acquire(key, 0, lease_s, owner) {
            Response::Acquired {
                owner: echoed,
                token,
            } if echoed == owner => token,
            other => panic!("expected A for owner {owner}, got {other:?}"),
        }
    }

    /// Reads the next response, which must be an `A` for `owner`; returns its token.
    #[track_caller]
    pub fn recv_granted(&mut self, owner: u64) -> u64 {
        match self.recv() {
            Response::Acquired {
                owner: echoed,
                token,
            } if echoed == owner && token != 0 => token,
            other => panic!("expected A for owner {owner}, got {other:?}"),
        }
    }

    /// Release and wait for its answer.
    pub fn release(&mut self, key: &str, token: u64) -> Response {
        self.send(Request::Release {
            token,
            key: key.as_bytes(),
        });
        self.recv()
    }

    /// Query and wait for its answer.
    pub fn query(&mut self, key: &str, nonce: u64) -> Response {
        self.send(Request::Query {
            nonce,
            key: key.as_bytes(),
        });
        self.recv()
    }

    /// Sends an Acquire without waiting for its answer.
    pub fn send_acquire(&mut self, key: &str, wait_s: u8, lease_s: u8, owner: u64) {
        self.send(Request::Acquire {
            wait_s,
            lease_s,
            owner,
            key: key.as_bytes(),
        });
    }

    /// Extend and wait for its answer.
    pub fn extend(&mut self, key: &str, lease_s: u8, token: u64) -> Response {
        self.send(Request::Extend {
            lease_s,
            token,
            key: key.as_bytes(),
        });
        self.recv()
    }

    /// Sends a Cancel (an executed Cancel has no answer of its own).
    pub fn cancel(&mut self, key: &str, owner: u64) {
        self.send(Request::Cancel {
            owner,
            key: key.as_bytes(),
        });
    }

    /// Ping and wait for its answer.
    pub fn ping(&mut self, nonce: u64) -> Response {
        self.send(Request::Ping { nonce });
        self.recv()
    }

    /// Queries `key` with a fresh nonce and returns its state. Because requests of one session
    /// for one key are executed in order, this also confirms that every earlier request of
    /// this session for `key` has been executed.
    #[track_caller]
    pub fn state(&mut self, key: &str) -> KeyState {
        let nonce = fresh_id();
        match self.query(key, nonce) {
            Response::State {
                nonce: echoed,
                held,
                lease_ms,
                waiters,
            } if echoed == nonce => KeyState {
                held,
                lease_ms,
                waiters,
            },
            other => panic!("expected Q for nonce {nonce}, got {other:?}"),
        }
    }

    /// Reads `count` responses, each within [`ANSWER_TIMEOUT`].
    pub fn recv_n(&mut self, count: usize) -> Vec<Response> {
        (0..count).map(|_| self.recv()).collect()
    }

    /// Writes `bytes` and ends this side's output so that the end of input travels with the
    /// data (TCP_CORK holds the bytes until the FIN): the server sees both in one read.
    pub fn send_raw_then_half_close(&mut self, bytes: &[u8]) {
        let socket = socket2::SockRef::from(self.stream.tcp());
        socket.set_cork(true).expect("TCP_CORK");
        self.send_raw(bytes);
        self.shutdown_write();
    }

    /// Ends this side's output (half-close); reading still works.
    fn shutdown_write(&self) {
        self.stream
            .tcp()
            .shutdown(Shutdown::Write)
            .expect("shutdown write");
    }
}

/// What a Query reported.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct KeyState {
    /// Whether the key is held.
    pub held: bool,
    /// Milliseconds left on the lease.
    pub lease_ms: u32,
    /// Queued acquires.
    pub waiters: u32,
}

impl KeyState {
    /// A free key.
    pub const FREE: KeyState = KeyState {
        held: false,
        lease_ms: 0,
        waiters: 0,
    };
}

/// A process-wide unique id for owners and nonces (never 0), so answers are never confused.
pub fn fresh_id() -> u64 {
    static NEXT: AtomicU64 = AtomicU64::new(1_000_000);
    NEXT.fetch_add(1, Ordering::Relaxed)
}

/// The frames of `requests`, back to back.
pub fn encode_all(requests: &[Request<'_>]) -> Vec<u8> {
    let mut bytes = Vec::new();
    for request in requests {
        request.encode(&mut bytes);
    }
    bytes
}

/// Polls `condition` every few milliseconds until it holds or `limit` passes; whether it held.
pub fn wait_until(limit: Duration, mut condition: impl FnMut() -> bool) -> bool {
    let until = Instant::now() + limit;
    loop {
        if condition() {
            return true;
        }
        if Instant::now() >= until {
            return false;
        }
        std::thread::sleep(Duration::from_millis(5));
    }
}

/// A fresh directory under the system temp dir, removed (with its contents) on drop.
pub struct TempDir {
    path: PathBuf,
}

impl TempDir {
    /// Creates `latchkey-<label>-<pid>-<n>`.
    pub fn new(label: &str) -> TempDir {
        static COUNT: AtomicU64 = AtomicU64::new(0);
        let n = COUNT.fetch_add(1, Ordering::Relaxed);
        let name = format!("latchkey-{label}-{}-{n}", std::process::id());
        let path = std::env::temp_dir().join(name);
        let _ = std::fs::remove_dir_all(&path);
        std::fs::create_dir_all(&path).expect("create temp dir");
        TempDir { path }
    }

    /// Where it is.
    pub fn path(&self) -> &Path {
        &self.path
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.path);
    }
}

/// Keys that `partition_of` puts on partition `partition` of `cores`, named `prefix-N`.
pub fn keys_on_partition(
    prefix: &str,
    partition: usize,
    cores: usize,
    count: usize,
) -> Vec<String> {
    (0..)
        .map(|i| format!("{prefix}-{i}"))
        .filter(|key| latchkey::partition::partition_of(key.as_bytes(), cores) == partition)
        .take(count)
        .collect()
}

/// One answer a [`Script`] expects.
#[derive(Clone, Copy, Debug)]
pub enum Expect {
    /// Exactly this response.
    Exact(Response),
    /// An `A` for this owner (its token is not known in advance).
    Granted(u64),
    /// A `Q` for this nonce with these fields (`lease_ms` is not checked).
    State {
        /// The query's nonce.
        nonce: u64,
        /// Whether the key is held.
        held: bool,
        /// Queued acquires.
        waiters: u32,
    },
}

impl Expect {
    /// The correlation id of the expected answer.
    pub fn id(&self) -> u64 {
        match *self {
            Expect::Exact(response) => response.correlation_id(),
            Expect::Granted(id) | Expect::State { nonce: id, .. } => id,
        }
    }

    /// Whether `answer` is the expected one.
    pub fn matches(&self, answer: &Response) -> bool {
        match (*self, *answer) {
            (Expect::Exact(expected), answer) => expected == answer,
            (Expect::Granted(owner), Response::Acquired { owner: o, token }) => {
                o == owner && token != 0
            }
            (
                Expect::State {
                    nonce,
                    held,
                    waiters,
                },
                Response::State {
                    nonce: n,
                    held: h,
                    lease_ms,
                    waiters: w,
                },
            ) => n == nonce && h == held && w == waiters && (held || lease_ms == 0),
            _ => false,
        }
    }
}

/// Pipelined requests and the answers they must produce: in order per stream (a key),
/// Pongs and other unkeyed answers in any order. Every correlation id must be unique.
#[derive(Default)]
pub struct Script {
    /// The frames, back to back.
    pub bytes: Vec<u8>,
    per_stream: Vec<Vec<Expect>>,
    unordered: Vec<Response>,
}

impl Script {
    /// Appends a request frame.
    pub fn request(&mut self, request: Request<'_>) {
        request.encode(&mut self.bytes);
    }

    /// Expects `expect` as the next answer of `stream` (e.g. a key's index).
    pub fn expect(&mut self, stream: usize, expect: Expect) {
        if self.per_stream.len() <= stream {
            self.per_stream.resize_with(stream + 1, Vec::new);
        }
        self.per_stream[stream].push(expect);
    }

    /// Expects `response` at any point.
    pub fn expect_any_order(&mut self, response: Response) {
        self.unordered.push(response);
    }

    /// The number of answers expected.
    pub fn answers(&self) -> usize {
        self.per_stream.iter().map(Vec::len).sum::<usize>() + self.unordered.len()
    }

    /// Reads exactly [`answers`](Self::answers) answers from `conn` and checks each is the next
    /// one of its stream (or an expected unordered one). Returns the tokens of the grants by
    /// owner.
    #[track_caller]
    pub fn check(&self, conn: &mut Conn) -> std::collections::HashMap<u64, u64> {
        let mut stream_of = std::collections::HashMap::new();
        for (stream, expects) in self.per_stream.iter().enumerate() {
            for expect in expects {
                let earlier = stream_of.insert(expect.id(), stream);
                assert!(earlier.is_none(), "id {} used twice", expect.id());
            }
        }
        let mut unordered = self.unordered.clone();
        let mut cursors = vec![0; self.per_stream.len()];
        let mut grants = std::collections::HashMap::new();
        for _ in 0..self.answers() {
            let answer = conn.recv();
            if let Some(at) = unordered.iter().position(|u| *u == answer) {
                unordered.swap_remove(at);
                continue;
            }
            let stream = *stream_of
                .get(&answer.correlation_id())
                .unwrap_or_else(|| panic!("unexpected answer {answer:?}"));
            let expect = self.per_stream[stream]
                .get(cursors[stream])
                .unwrap_or_else(|| panic!("answer {answer:?} after its stream ended"));
            assert!(
                expect.matches(&answer),
                "stream {stream}: expected {expect:?}, got {answer:?}"
            );
            if let Response::Acquired { owner, token } = answer {
                grants.insert(owner, token);
            }
            cursors[stream] += 1;
        }
        grants
    }
}

/// This process's resident memory (VmRSS), in bytes: the test and the in-process server.
pub fn rss_bytes() -> u64 {
    let status = std::fs::read_to_string("/proc/self/status").expect("/proc/self/status");
    let line = status
        .lines()
        .find(|line| line.starts_with("VmRSS:"))
        .expect("VmRSS");
    let kib: u64 = line.split_whitespace().nth(1).unwrap().parse().unwrap();
    kib * 1024
}
