//! Shared helpers of the client tests.
//!
//! * [`FakeServer`]: a scripted server. The test accepts each connection itself, reads the
//!   client's frames and writes whatever answer it wants, when it wants: the way to force an
//!   exact interleaving (an `A` just late, a `T` after a Cancel, an `X` 7, silence).
//! * [`AutoServer`]: a small in-memory lock server (FIFO queues, waits, leases, Cancel) that
//!   answers by itself, for tests about many calls rather than one interleaving.
//! * [`proxy`]: a TCP fault proxy (delay, hold, cut after N bytes, frame counts).
//!
//! Everything binds 127.0.0.1 ephemeral ports; every wait is bounded.
#![allow(dead_code)]

pub mod proxy;

use std::collections::{HashMap, VecDeque};
use std::io::{self, Read, Write};
use std::net::{Shutdown, SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::thread;
use std::time::{Duration, Instant};

use latchkey::client::{Client, ClientConfig};
use latchkey::protocol::{parse_request, ErrorCode, Request, Response, KEY_BYTES_MAX};

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
}

impl Frame {
    /// Copies a parsed request.
    pub fn from_request(request: &Request<'_>) -> Frame {
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

/// A scripted server: the test accepts and answers by hand.
pub struct FakeServer {
    listener: TcpListener,
}

impl FakeServer {
    /// Listens on an ephemeral port of 127.0.0.1.
    pub fn start() -> FakeServer {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        listener.set_nonblocking(true).unwrap();
        FakeServer { listener }
    }

    /// Where it listens.
    pub fn addr(&self) -> SocketAddr {
        self.listener.local_addr().unwrap()
    }

    /// The next connection; panics if none comes within [`PATIENCE`].
    pub fn accept(&self) -> FakeConn {
        self.try_accept(PATIENCE).expect("no connection came")
    }

    /// The next connection within `within`, if any.
    pub fn try_accept(&self, within: Duration) -> Option<FakeConn> {
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
    /// The next frame, end of input, or nothing within `within`.
    pub fn read_frame(&mut self, within: Duration) -> Got {
        let until = Instant::now() + within;
        loop {
            if let Some((request, used)) = parse_request(&self.input, KEY_BYTES_MAX).unwrap() {
                let frame = Frame::from_request(&request);
                self.input.drain(..used);
                return Got::Frame(frame);
            }
            let left = until.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return Got::Quiet;
            }
            self.stream.set_read_timeout(Some(left)).unwrap();
            let mut chunk = [0u8; 4096];
            match self.stream.read(&mut chunk) {
                Ok(0) => return Got::Eof,
                Ok(read) => self.input.extend_from_slice(&chunk[..read]),
                Err(e)
                    if matches!(
                        e.kind(),
                        io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut
                    ) => {}
                Err(e) if e.kind() == io::ErrorKind::ConnectionReset => return Got::Eof,
                Err(e) => panic!("read: {e}"),
            }
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

/// A small lock server answering by itself: FIFO waiters, waits, leases, Cancel, Query, Ping.
/// Tokens start at 1000 and grow by one. It counts the Acquire frames it receives per owner.
pub struct AutoServer {
    addr: SocketAddr,
    table: Arc<Mutex<Table>>,
    stop: Arc<AtomicBool>,
}

type Out = Arc<Mutex<TcpStream>>;

struct Waiter {
    conn: u64,
    out: Out,
    owner: u64,
    lease_s: u8,
    deadline: Instant,
}

#[derive(Default)]
struct Key {
    holder: Option<(u64, Instant)>,
    waiters: VecDeque<Waiter>,
}

#[derive(Default)]
struct Table {
    keys: HashMap<Vec<u8>, Key>,
    next_token: u64,
    acquires: HashMap<u64, usize>,
    busy: bool,
}

fn write(out: &Out, response: Response) {
    let mut bytes = Vec::new();
    response.encode(&mut bytes);
    let _ = out.lock().unwrap().write_all(&bytes);
}

impl Table {
    fn grant(&mut self, key: &[u8], out: &Out, owner: u64, lease_s: u8, now: Instant) {
        self.next_token += 1;
        let token = 1000 + self.next_token;
        let lease = Duration::from_secs(u64::from(lease_s));
        self.keys.entry(key.to_vec()).or_default().holder = Some((token, now + lease));
        write(out, Response::Acquired { owner, token });
    }

    /// The key is free: grant the queue head, or forget the key.
    fn pass_on(&mut self, key: &[u8], now: Instant) {
        let entry = self.keys.get_mut(key).unwrap();
        entry.holder = None;
        match entry.waiters.pop_front() {
            Some(w) => self.grant(key, &w.out, w.owner, w.lease_s, now),
            None => {
                self.keys.remove(key);
            }
        }
    }

    fn handle(&mut self, conn: u64, out: &Out, request: Request<'_>, now: Instant) {
        match request {
            Request::Acquire {
                wait_s,
                lease_s,
                owner,
                key,
            } => {
                *self.acquires.entry(owner).or_default() += 1;
                let held = self.keys.get(key).is_some_and(|k| k.holder.is_some());
                if self.busy {
                    write(out, Response::Busy { owner });
                } else if !held {
                    self.grant(key, out, owner, lease_s, now);
                } else if wait_s == 0 {
                    write(out, Response::Timeout { owner });
                } else {
                    let deadline = now + Duration::from_secs(u64::from(wait_s));
                    let waiter = Waiter {
                        conn,
                        out: Arc::clone(out),
                        owner,
                        lease_s,
                        deadline,
                    };
                    self.keys.get_mut(key).unwrap().waiters.push_back(waiter);
                }
            }
            Request::Release { token, key } => {
                if self.holds(key, token) {
                    write(out, Response::Released { token });
                    self.pass_on(key, now);
                } else {
                    write(out, Response::NotHeld { token });
                }
            }
            Request::Extend {
                lease_s,
                token,
                key,
            } => {
                if self.holds(key, token) {
                    let lease = Duration::from_secs(u64::from(lease_s));
                    self.keys.get_mut(key).unwrap().holder = Some((token, now + lease));
                    write(out, Response::Extended { token });
                } else {
                    write(out, Response::NotHeld { token });
                }
            }
            Request::Cancel { owner, key } => {
                if let Some(entry) = self.keys.get_mut(key) {
                    entry.waiters.retain(|w| {
                        let withdraw = w.conn == conn && w.owner == owner;
                        if withdraw {
                            write(&w.out, Response::Timeout { owner });
                        }
                        !withdraw
                    });
                }
            }
            Request::Query { nonce, key } => {
                let (held, lease_ms, waiters) = match self.keys.get(key) {
                    Some(Key {
                        holder: Some((_, expiry)),
                        waiters,
                    }) => {
                        let left = expiry.saturating_duration_since(now).as_millis() as u32;
                        (true, left, waiters.len() as u32)
                    }
                    _ => (false, 0, 0),
                };
                write(
                    out,
                    Response::State {
                        nonce,
                        held,
                        lease_ms,
                        waiters,
                    },
                );
            }
            Request::Ping { nonce } => write(out, Response::Pong { nonce }),
        }
    }

    fn holds(&self, key: &[u8], token: u64) -> bool {
        self.keys
            .get(key)
            .and_then(|k| k.holder)
            .is_some_and(|(t, _)| t == token)
    }

    fn tick(&mut self, now: Instant) {
        let expired: Vec<Vec<u8>> = self
            .keys
            .iter()
            .filter(|(_, k)| k.holder.is_some_and(|(_, expiry)| expiry <= now))
            .map(|(key, _)| key.clone())
            .collect();
        for key in expired {
            self.pass_on(&key, now);
        }
        for entry in self.keys.values_mut() {
            entry.waiters.retain(|w| {
                let expired = w.deadline <= now;
                if expired {
                    write(&w.out, Response::Timeout { owner: w.owner });
                }
                !expired
            });
        }
    }

    fn withdraw(&mut self, conn: u64) {
        for entry in self.keys.values_mut() {
            entry.waiters.retain(|w| w.conn != conn);
        }
    }
}

impl AutoServer {
    /// Starts listening on an ephemeral port of 127.0.0.1.
    pub fn start() -> AutoServer {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        listener.set_nonblocking(true).unwrap();
        let addr = listener.local_addr().unwrap();
        let table = Arc::new(Mutex::new(Table::default()));
        let stop = Arc::new(AtomicBool::new(false));
        let (table2, stop2) = (Arc::clone(&table), Arc::clone(&stop));
        thread::spawn(move || accept_loop(listener, table2, stop2));
        let (table3, stop3) = (Arc::clone(&table), Arc::clone(&stop));
        thread::spawn(move || {
            while !stop3.load(Ordering::Relaxed) {
                table3.lock().unwrap().tick(Instant::now());
                thread::sleep(Duration::from_millis(2));
            }
        });
        AutoServer { addr, table, stop }
    }

    /// Where it listens.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// Acquire frames received per owner.
    pub fn acquires(&self) -> HashMap<u64, usize> {
        self.table.lock().unwrap().acquires.clone()
    }

    /// Answers every further acquire `B`.
    pub fn set_busy(&self, busy: bool) {
        self.table.lock().unwrap().busy = busy;
    }
}

impl Drop for AutoServer {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
    }
}

fn accept_loop(listener: TcpListener, table: Arc<Mutex<Table>>, stop: Arc<AtomicBool>) {
    let mut next_conn = 0;
    while !stop.load(Ordering::Relaxed) {
        match listener.accept() {
            Ok((stream, _)) => {
                next_conn += 1;
                let (conn, table) = (next_conn, Arc::clone(&table));
                thread::spawn(move || serve(conn, stream, table));
            }
            Err(error) if error.kind() == io::ErrorKind::WouldBlock => {
                thread::sleep(Duration::from_millis(2))
            }
            Err(error) => panic!("accept: {error}"),
        }
    }
}

fn serve(conn: u64, mut stream: TcpStream, table: Arc<Mutex<Table>>) {
    stream.set_nonblocking(false).unwrap();
    stream.set_nodelay(true).unwrap();
    let out: Out = Arc::new(Mutex::new(stream.try_clone().unwrap()));
    let mut input = Vec::new();
    let mut chunk = [0u8; 4096];
    loop {
        let read = match stream.read(&mut chunk) {
            Ok(0) | Err(_) => break,
            Ok(read) => read,
        };
        input.extend_from_slice(&chunk[..read]);
        let mut table = table.lock().unwrap();
        let now = Instant::now();
        loop {
            match parse_request(&input, KEY_BYTES_MAX) {
                Ok(Some((request, used))) => {
                    table.handle(conn, &out, request, now);
                    input.drain(..used);
                }
                Ok(None) => break,
                Err(error) => {
                    write(&out, error.response());
                    if error.code.closes_session() {
                        table.withdraw(conn);
                        return;
                    }
                    input.drain(..error.consumed);
                }
            }
        }
    }
    table.lock().unwrap().withdraw(conn);
}
