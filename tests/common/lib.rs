//! The helpers latchkey's integration tests share, a library of its own (the dev-dependency
//! `common`): each test links what it uses, and the dead-code lint sees this crate as a whole.
//!
//! * [`FakeServer`]: a scripted server. The test accepts each connection itself, reads the
//!   client's frames and writes whatever answer it wants, when it wants: the way to force an
//!   exact interleaving (an `A` just late, a `T` after a Cancel, an `X` 7, silence).
//! * [`start_server`]: the real server, in-process.
//! * [`proxy`]: a TCP fault proxy (delay, hold, cut after N bytes, frame counts).
//!
//! * [`server`]: raw-frame connections and the server binary as a child process.
//! * [`pki`]: a test CA and certificates, for TLS.
//!
//! Everything binds 127.0.0.1 ephemeral ports; every wait is bounded.

pub mod cluster;
pub mod fake_member;
pub mod pki;
pub mod probe;
pub mod proxy;
pub mod server;
pub mod session_driver;

use std::io::{self, Read, Write};
use std::net::{Shutdown, SocketAddr, TcpListener, TcpStream};
use std::path::PathBuf;
use std::thread;
use std::time::{Duration, Instant};

use latchkey::config::Config;
use latchkey::server::ServerHandle;
use latchkey_client::protocol::{parse_request, ErrorCode, Request, Response, KEY_BYTES_MAX};
use latchkey_client::{Client, ClientConfig};

/// The `latchkey` binary Cargo built for the running test: `CARGO_BIN_EXE_latchkey` when Cargo
/// sets it at run time, else beside the test's own executable (`target/<profile>/deps/..`),
/// where Cargo puts it before it runs an integration test. (A test's own `env!` of it is
/// compile-time only, which a library does not get.)
pub fn latchkey_bin() -> PathBuf {
    if let Some(path) = std::env::var_os("CARGO_BIN_EXE_latchkey") {
        return PathBuf::from(path);
    }
    let test = std::env::current_exe().expect("the test's executable");
    let profile = test.parent().and_then(|deps| deps.parent());
    let bin = profile.expect("target/<profile>/deps").join("latchkey");
    assert!(bin.exists(), "no latchkey binary at {}", bin.display());
    bin
}

/// The longest any helper waits for something that should happen.
pub const PATIENCE: Duration = Duration::from_secs(10);

/// A client of `addrs` with one session per address by default and a short transport timeout.
pub fn client(addrs: &[SocketAddr], sessions: usize, transport_timeout: Duration) -> Client {
    let config = ClientConfig {
        addrs: addrs.to_vec(),
        sessions,
        connect_timeout: Duration::from_secs(2),
        transport_timeout,
        ..ClientConfig::default()
    };
    Client::with_config(config).expect("client")
}

/// An address on which nothing listens (bound, then closed).
pub fn dead_addr() -> SocketAddr {
    TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
}

/// Asserts `elapsed` is not before `at_least` and not absurdly late.
#[track_caller]
pub fn assert_between(elapsed: Duration, at_least: Duration, at_most: Duration) {
    assert!(elapsed >= at_least, "too early: {elapsed:?} < {at_least:?}");
    assert!(elapsed <= at_most, "too late: {elapsed:?} > {at_most:?}");
}

/// An owned request frame as the server received it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Frame {
    /// `A`.
    Acquire {
        wait_s: u8,
        lease_s: u8,
        owner: u64,
        key: String,
    },
    /// `R`.
    Release { token: u64, key: String },
    /// `E`.
    Extend {
        lease_s: u8,
        token: u64,
        key: String,
    },
    /// `C`.
    Cancel { owner: u64, key: String },
    /// `Q`.
    Query { nonce: u64, key: String },
    /// `P`.
    Ping { nonce: u64 },
    /// `I`.
    Identify {
        grace_s: u8,
        client: u128,
        nonce: u64,
    },
    /// `W`.
    Resolve { owner: u64, key: String },
}

impl Frame {
    /// Copies a parsed request.
    fn from_request(request: &Request<'_>) -> Frame {
        let text = |key: &[u8]| String::from_utf8(key.to_vec()).unwrap();
        match *request {
            Request::Acquire {
                wait_s,
                lease_s,
                owner,
                key,
            } => Frame::Acquire {
                wait_s,
                lease_s,
                owner,
                key: text(key),
            },
            Request::Release { token, key } => Frame::Release {
                token,
                key: text(key),
            },
            Request::Extend {
                lease_s,
                token,
                key,
            } => Frame::Extend {
                lease_s,
                token,
                key: text(key),
            },
            Request::Cancel { owner, key } => Frame::Cancel {
                owner,
                key: text(key),
            },
            Request::Identify {
                grace_s,
                client,
                nonce,
            } => Frame::Identify {
                grace_s,
                client,
                nonce,
            },
            Request::Resolve { owner, key } => Frame::Resolve {
                owner,
                key: text(key),
            },
            Request::Query { nonce, key } => Frame::Query {
                nonce,
                key: text(key),
            },
            Request::Ping { nonce } => Frame::Ping { nonce },
        }
    }
}

/// What [`FakeConn::read_frame`] found.
#[derive(Debug, PartialEq, Eq)]
pub enum Got {
    /// A complete frame.
    Frame(Frame),
    /// The client closed the connection.
    Eof,
    /// Nothing within the time given.
    Quiet,
}

/// Runs the `latchkey` binary at `binary` with `args`, then `--server SERVERS
/// --transport-timeout 2s`: its exit code, stdout and stderr.
pub fn run_cli(binary: &str, servers: &str, args: &[&str]) -> (Option<i32>, String, String) {
    let output = std::process::Command::new(binary)
        .args(args)
        .args(["--server", servers, "--transport-timeout", "2s"])
        .output()
        .expect("run latchkey");
    let text = |bytes: &[u8]| String::from_utf8_lossy(bytes).into_owned();
    (
        output.status.code(),
        text(&output.stdout),
        text(&output.stderr),
    )
}

/// A scripted server: the test accepts and answers by hand. A connection that asks for the
/// server's card (`GET /cluster`, what a client given several addresses asks each) is answered
/// by [`FakeServer::accept`] and its kin on the way to the next one: by default a member of
/// [`fake_member::FAKE_CLUSTER`] whose card lists itself ([`FakeServer::one_cluster`]).
pub struct FakeServer {
    listener: TcpListener,
    card: std::sync::Mutex<latchkey_client::card::Card>,
}

impl FakeServer {
    /// Listens on an ephemeral port of 127.0.0.1.
    pub fn start() -> FakeServer {
        FakeServer::start_on("127.0.0.1:0".parse().unwrap())
    }

    /// Listens on `addr` (e.g. one that was dead until now).
    pub fn start_on(addr: SocketAddr) -> FakeServer {
        let listener = TcpListener::bind(addr).unwrap();
        listener.set_nonblocking(true).unwrap();
        FakeServer::of(listener)
    }

    fn of(listener: TcpListener) -> FakeServer {
        let addr = listener.local_addr().unwrap();
        let card = fake_member::card_listing(addr.port(), &[addr]);
        FakeServer {
            listener,
            card: std::sync::Mutex::new(card),
        }
    }

    /// Makes `servers` one cluster's as their cards say: each lists every one of them (so a
    /// client's list of them is accepted once any one's card is answered).
    pub fn one_cluster(servers: &[&FakeServer]) {
        let addrs: Vec<SocketAddr> = servers.iter().map(|server| server.addr()).collect();
        for server in servers {
            let card = fake_member::card_listing(server.addr().port(), &addrs);
            *server.card.lock().unwrap() = card;
        }
    }

    /// Listens on an ephemeral port with a small, fixed receive buffer on accepted
    /// connections, so a client's writes back up soon once the test stops reading.
    pub fn start_small_buffer() -> FakeServer {
        let socket =
            socket2::Socket::new(socket2::Domain::IPV4, socket2::Type::STREAM, None).unwrap();
        socket.set_recv_buffer_size(4096).unwrap();
        let addr: SocketAddr = "127.0.0.1:0".parse().unwrap();
        socket.bind(&addr.into()).unwrap();
        socket.listen(16).unwrap();
        let listener: TcpListener = socket.into();
        listener.set_nonblocking(true).unwrap();
        FakeServer::of(listener)
    }

    /// Where it listens.
    pub fn addr(&self) -> SocketAddr {
        self.listener.local_addr().unwrap()
    }

    /// The next connection, with its handshake answered (see [`FakeConn::handshake`]);
    /// panics if none comes within [`PATIENCE`].
    pub fn accept(&self) -> FakeConn {
        self.try_accept(PATIENCE).expect("no connection came")
    }

    /// The next connection within `within`, if any, with its handshake answered (card requests
    /// on the way answered and passed over).
    pub fn try_accept(&self, within: Duration) -> Option<FakeConn> {
        let until = Instant::now() + within;
        loop {
            let mut conn = self.try_accept_raw(until.saturating_duration_since(Instant::now()))?;
            let card = self.card.lock().unwrap().clone();
            if conn.answer_card_request(&card) {
                continue;
            }
            conn.handshake();
            return Some(conn);
        }
    }

    /// Closes every connection that comes within `within` as soon as it comes: a server
    /// whose sessions all fail (a call's retries there send nothing and hear nothing).
    pub fn refuse_for(&self, within: Duration) {
        let until = Instant::now() + within;
        while let Some(conn) = self.try_accept_raw(until.saturating_duration_since(Instant::now()))
        {
            conn.close();
        }
    }

    /// The next connection within `within`, if any, as accepted.
    fn try_accept_raw(&self, within: Duration) -> Option<FakeConn> {
        let until = Instant::now() + within;
        loop {
            match self.listener.accept() {
                Ok((stream, _)) => {
                    stream.set_nonblocking(false).unwrap();
                    stream.set_nodelay(true).unwrap();
                    return Some(FakeConn {
                        stream,
                        input: Vec::new(),
                    });
                }
                Err(error) if error.kind() == io::ErrorKind::WouldBlock => {}
                Err(error) => panic!("accept: {error}"),
            }
            if Instant::now() >= until {
                return None;
            }
            thread::sleep(Duration::from_millis(2));
        }
    }
}

/// One accepted connection of a [`FakeServer`].
pub struct FakeConn {
    stream: TcpStream,
    input: Vec<u8>,
}

impl FakeConn {
    /// If the connection opens with `GET ` (a client asking for the server's card), answers it
    /// with `card`, closes, and says so. Reads until it can tell (a session's first bytes, its
    /// handshake, come at once), at most [`PATIENCE`].
    fn answer_card_request(&mut self, card: &latchkey_client::card::Card) -> bool {
        let until = Instant::now() + PATIENCE;
        let done = |input: &[u8]| {
            !b"GET ".starts_with(&input[..input.len().min(4)])
                || input.windows(4).any(|w| w == b"\r\n\r\n")
        };
        while !done(&self.input) && Instant::now() < until {
            if !self.read_some(until) {
                break;
            }
        }
        if !self.input.starts_with(b"GET ") {
            return false;
        }
        let body = card.render();
        let answer = format!(
            "HTTP/1.1 200 OK\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
            body.len()
        );
        let _ = self.stream.write_all(answer.as_bytes());
        let _ = self.stream.shutdown(std::net::Shutdown::Both);
        true
    }

    /// The next frame, end of input, or nothing within `within`.
    pub fn read_frame(&mut self, within: Duration) -> Got {
        let until = Instant::now() + within;
        loop {
            if let Some((request, used)) = parse_request(&self.input, KEY_BYTES_MAX).unwrap() {
                let frame = Frame::from_request(&request);
                self.input.drain(..used);
                return Got::Frame(frame);
            }
            if Instant::now() >= until {
                return Got::Quiet;
            }
            if !self.read_some(until) {
                return Got::Eof;
            }
        }
    }

    /// Reads what comes into `input`, waiting until `until` at most; false at the end of the
    /// input (or a reset). Panics on any other read error.
    fn read_some(&mut self, until: Instant) -> bool {
        let left = until.saturating_duration_since(Instant::now());
        let timeout = left.max(Duration::from_millis(1));
        self.stream.set_read_timeout(Some(timeout)).unwrap();
        let mut chunk = [0u8; 4096];
        match self.stream.read(&mut chunk) {
            Ok(0) => false,
            Ok(read) => {
                self.input.extend_from_slice(&chunk[..read]);
                true
            }
            Err(e)
                if matches!(
                    e.kind(),
                    io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut
                ) =>
            {
                true
            }
            Err(e) if e.kind() == io::ErrorKind::ConnectionReset => false,
            Err(e) => panic!("read: {e}"),
        }
    }

    /// Reads the client's handshake ping, its first frame on every session, and answers it;
    /// returns its nonce. The client sends nothing else before that pong.
    #[track_caller]
    pub fn handshake(&mut self) -> u64 {
        let nonce = self.handshake_ping();
        self.send(Response::Pong { nonce });
        nonce
    }

    /// Reads the client's handshake ping without answering it; returns its nonce.
    #[track_caller]
    fn handshake_ping(&mut self) -> u64 {
        let mut frame = self.frame();
        if let Frame::Identify { nonce, .. } = frame {
            // A fake server does not resume calls (docs/protocol.md §5): the client's Identify
            // is refused, and its handshake ping follows.
            self.send(Response::Error {
                code: ErrorCode::NotIdentified,
                id: nonce,
            });
            frame = self.frame();
        }
        match frame {
            Frame::Ping { nonce } => nonce,
            other => panic!("a session starts with its handshake ping, not {other:?}"),
        }
    }

    /// The next frame; panics on end of input or silence.
    #[track_caller]
    pub fn frame(&mut self) -> Frame {
        match self.read_frame(PATIENCE) {
            Got::Frame(frame) => frame,
            other => panic!("expected a frame, got {other:?}"),
        }
    }

    /// The next frame, which must be an Acquire: (owner, wait_s, lease_s, key).
    #[track_caller]
    pub fn acquire(&mut self) -> (u64, u8, u8, String) {
        match self.frame() {
            Frame::Acquire {
                wait_s,
                lease_s,
                owner,
                key,
            } => (owner, wait_s, lease_s, key),
            other => panic!("expected an acquire, got {other:?}"),
        }
    }

    /// Writes one response.
    pub fn send(&mut self, response: Response) {
        let mut bytes = Vec::new();
        response.encode(&mut bytes);
        self.stream.write_all(&bytes).unwrap();
    }

    /// Reads frames until the client closes the connection; panics if it does not within
    /// `within`. Returns the frames read meanwhile.
    #[track_caller]
    pub fn expect_eof(&mut self, within: Duration) -> Vec<Frame> {
        let until = Instant::now() + within;
        let mut frames = Vec::new();
        loop {
            match self.read_frame(until.saturating_duration_since(Instant::now())) {
                Got::Frame(frame) => frames.push(frame),
                Got::Eof => return frames,
                Got::Quiet => panic!("the client did not close the session; read {frames:?}"),
            }
        }
    }

    /// Refuses the session like a server at `max_connections`: `X` 7, then end of output,
    /// then drains the client's bytes until it closes (so the close is clean, not a reset).
    pub fn refuse(mut self) -> Vec<Frame> {
        self.send(Response::Error {
            code: ErrorCode::SessionRefused,
            id: 0,
        });
        self.stream.shutdown(Shutdown::Write).unwrap();
        self.expect_eof(PATIENCE)
    }

    /// Closes the connection at once.
    pub fn close(self) {
        let _ = self.stream.shutdown(Shutdown::Both);
    }
}

// ---------------------------------------------------------------------------------------------

/// Starts the real server in-process on an ephemeral port of 127.0.0.1 with two cores, after
/// `configure` adjusted the limits. Dropping the handle shuts it down.
pub fn start_server(configure: impl FnOnce(&mut Config)) -> ServerHandle {
    let mut config = Config::default();
    config.server.listen = "127.0.0.1:0".parse().unwrap();
    config.server.cores = 2;
    configure(&mut config);
    latchkey::node::start(config).expect("server starts")
}

/// A server that is not latchkey: for `within`, it answers every chunk any client sends with
/// a Redis-style error line, as Redis does to bytes it cannot parse. Returns its address.
pub fn not_latchkey_server(within: Duration) -> SocketAddr {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    listener.set_nonblocking(true).unwrap();
    let addr = listener.local_addr().unwrap();
    thread::spawn(move || {
        let until = Instant::now() + within;
        while Instant::now() < until {
            match listener.accept() {
                Ok((stream, _)) => {
                    thread::spawn(move || answer_like_redis(stream, until));
                }
                Err(error) if error.kind() == io::ErrorKind::WouldBlock => {
                    thread::sleep(Duration::from_millis(2));
                }
                Err(error) => panic!("accept: {error}"),
            }
        }
    });
    addr
}

fn answer_like_redis(mut stream: TcpStream, until: Instant) {
    let mut chunk = [0u8; 4096];
    while let Some(left) = until.checked_duration_since(Instant::now()) {
        if left.is_zero() || stream.set_read_timeout(Some(left)).is_err() {
            return;
        }
        match stream.read(&mut chunk) {
            Ok(1..) => {
                if stream.write_all(b"-ERR unknown command\r\n").is_err() {
                    return;
                }
            }
            _ => return,
        }
    }
}
