//! A TCP fault proxy between a client and a server.
//!
//! It forwards bytes both ways and can, on command: delay each chunk (either direction), hold
//! the server's bytes back until released, cut a connection once N client bytes have been
//! forwarded on it, and refuse the next connections with `X` 7 as a full server would (or,
//! artificially, only after answering the client's handshake ping, so that requests reach
//! the refused session). It parses what the client sends and counts Acquire and Cancel frames
//! per owner and Ping frames, so a test can prove that an acquire was sent exactly once.
//!
//! Every client session starts with its handshake — an Identify (27 bytes) when the client
//! resumes calls, then a ping (10 bytes) — and sends nothing else before the pong: byte counts
//! (`cut_after`, `cut_next`) include it. A refused session answers an Identify `X` 9 (it does
//! not identify anybody).

use std::collections::HashMap;
use std::io::{self, Read, Write};
use std::net::{Shutdown, SocketAddr, TcpListener, TcpStream};
use std::sync::{Arc, Condvar, Mutex};
use std::thread;
use std::time::{Duration, Instant};

use latchkey_client::protocol::{parse_request, ErrorCode, Request, Response, KEY_BYTES_MAX};

/// A running proxy; stops accepting when dropped.
pub struct Proxy {
    addr: SocketAddr,
    shared: Arc<Shared>,
}

struct Shared {
    upstream: SocketAddr,
    state: Mutex<State>,
    changed: Condvar,
}

#[derive(Default)]
struct State {
    hold_down: bool,
    delay_up: Duration,
    delay_down: Duration,
    cut_after: Option<usize>,
    /// A cut of the next connection only (taken by it when accepted).
    cut_next: Option<usize>,
    refuse_next: usize,
    refuse_after: Duration,
    /// Refused sessions get a pong to every ping before their `X` 7.
    refuse_pong: bool,
    pings: usize,
    connections: usize,
    acquires: Vec<(u64, u8)>,
    cancels: HashMap<u64, usize>,
    stopped: bool,
}

impl Proxy {
    /// Listens on an ephemeral port of 127.0.0.1 and forwards to `upstream`.
    pub fn start(upstream: SocketAddr) -> Proxy {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        listener.set_nonblocking(true).unwrap();
        let addr = listener.local_addr().unwrap();
        let state = Mutex::new(State::default());
        let shared = Arc::new(Shared {
            upstream,
            state,
            changed: Condvar::new(),
        });
        let accepting = Arc::clone(&shared);
        thread::spawn(move || accept_loop(listener, accepting));
        Proxy { addr, shared }
    }

    /// Where clients connect.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    fn with<T>(&self, f: impl FnOnce(&mut State) -> T) -> T {
        let result = f(&mut self.shared.state.lock().unwrap());
        self.shared.changed.notify_all();
        result
    }

    /// Holds every byte from the server back until [`release`](Self::release).
    pub fn hold(&self) {
        self.with(|s| s.hold_down = true);
    }

    /// Forwards the held bytes and everything after them.
    pub fn release(&self) {
        self.with(|s| s.hold_down = false);
    }

    /// Delays each chunk from the client by `delay`.
    pub fn delay_up(&self, delay: Duration) {
        self.with(|s| s.delay_up = delay);
    }

    /// Delays each chunk from the server by `delay`.
    pub fn delay_down(&self, delay: Duration) {
        self.with(|s| s.delay_down = delay);
    }

    /// Cuts every connection (both sides) once `bytes` client bytes were forwarded on it.
    pub fn cut_after(&self, bytes: usize) {
        self.with(|s| s.cut_after = Some(bytes));
    }

    /// Cuts the next connection (both sides) once `bytes` client bytes were forwarded on it;
    /// later ones are left alone.
    pub fn cut_next(&self, bytes: usize) {
        self.with(|s| s.cut_next = Some(bytes));
    }

    /// Refuses the next `count` connections with `X` 7, sent `after` the connection was
    /// accepted, instead of forwarding them.
    pub fn refuse_next(&self, count: usize, after: Duration) {
        self.with(|s| {
            s.refuse_next = count;
            s.refuse_after = after;
        });
    }

    /// As [`refuse_next`](Self::refuse_next), but a refused session first gets the pong of
    /// its handshake ping, so the client sends its requests before the `X` 7 (which no real
    /// server sends after answering: the client's rule for `X` 7 must hold all the same).
    pub fn refuse_next_after_pong(&self, count: usize, after: Duration) {
        self.with(|s| {
            s.refuse_next = count;
            s.refuse_after = after;
            s.refuse_pong = true;
        });
    }

    /// Ping frames the client sent through the proxy (handshakes included).
    pub fn pings(&self) -> usize {
        self.with(|s| s.pings)
    }

    /// Connections accepted so far (forwarded or refused).
    pub fn connections(&self) -> usize {
        self.with(|s| s.connections)
    }

    /// Acquire frames the client sent through the proxy, per owner (refused sessions
    /// included: the client cannot tell the difference before the `X` 7 arrives).
    pub fn acquires(&self) -> HashMap<u64, usize> {
        let mut counts = HashMap::new();
        for (owner, _) in self.acquire_frames() {
            *counts.entry(owner).or_default() += 1;
        }
        counts
    }

    /// Every Acquire frame the client sent through the proxy, in order: (owner, wire wait).
    pub fn acquire_frames(&self) -> Vec<(u64, u8)> {
        self.with(|s| s.acquires.clone())
    }

    /// Cancel frames the client sent through the proxy, per owner.
    pub fn cancels(&self) -> HashMap<u64, usize> {
        self.with(|s| s.cancels.clone())
    }
}

impl Drop for Proxy {
    fn drop(&mut self) {
        self.with(|s| s.stopped = true);
    }
}

fn accept_loop(listener: TcpListener, shared: Arc<Shared>) {
    loop {
        if shared.state.lock().unwrap().stopped {
            return;
        }
        match listener.accept() {
            Ok((client, _)) => {
                client.set_nonblocking(false).unwrap();
                client.set_nodelay(true).unwrap();
                let shared = Arc::clone(&shared);
                thread::spawn(move || connection(client, shared));
            }
            Err(error) if error.kind() == io::ErrorKind::WouldBlock => {
                thread::sleep(Duration::from_millis(2))
            }
            Err(error) => panic!("proxy accept: {error}"),
        }
    }
}

fn connection(client: TcpStream, shared: Arc<Shared>) {
    let (refuse, cut) = {
        let mut state = shared.state.lock().unwrap();
        state.connections += 1;
        let refuse = state.refuse_next > 0;
        state.refuse_next = state.refuse_next.saturating_sub(1);
        (refuse.then_some(state.refuse_after), state.cut_next.take())
    };
    if let Some(after) = refuse {
        return refuse_session(client, &shared, after);
    }
    let Ok(server) = TcpStream::connect(shared.upstream) else {
        let _ = client.shutdown(Shutdown::Both);
        return;
    };
    server.set_nodelay(true).unwrap();
    let (client2, server2) = (client.try_clone().unwrap(), server.try_clone().unwrap());
    let down_shared = Arc::clone(&shared);
    thread::spawn(move || pump_down(server2, client2, down_shared));
    pump_up(client, server, &shared, cut);
}

/// Counts what the client sends for `after`, then `X` 7, end of output, and counts what the
/// client sends until it closes.
fn refuse_session(mut client: TcpStream, shared: &Shared, after: Duration) {
    let mut counter = Counter::default();
    let mut chunk = [0u8; 4096];
    let until = Instant::now() + after;
    let pong = shared.state.lock().unwrap().refuse_pong;
    loop {
        let left = until.saturating_duration_since(Instant::now());
        if left.is_zero() {
            break;
        }
        client.set_read_timeout(Some(left)).unwrap();
        match client.read(&mut chunk) {
            Ok(0) => return,
            Ok(read) => {
                for answer in counter.feed(&chunk[..read], shared) {
                    if pong {
                        let mut bytes = Vec::new();
                        answer.encode(&mut bytes);
                        let _ = client.write_all(&bytes);
                    }
                }
            }
            Err(e)
                if matches!(
                    e.kind(),
                    io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut
                ) => {}
            Err(_) => return,
        }
    }
    let mut bytes = Vec::new();
    Response::Error {
        code: ErrorCode::SessionRefused,
        id: 0,
    }
    .encode(&mut bytes);
    let _ = client.write_all(&bytes);
    let _ = client.shutdown(Shutdown::Write);
    client.set_read_timeout(Some(super::PATIENCE)).unwrap();
    while let Ok(read @ 1..) = client.read(&mut chunk) {
        let _ = counter.feed(&chunk[..read], shared);
    }
}

/// Parses the client's byte stream to count frames.
#[derive(Default)]
struct Counter {
    input: Vec<u8>,
    broken: bool,
}

impl Counter {
    /// Counts the frames `bytes` complete; returns what a refusing server that answers the
    /// handshake would answer: a pong to each ping, `X` 9 to each Identify.
    fn feed(&mut self, bytes: &[u8], shared: &Shared) -> Vec<Response> {
        let mut pings = Vec::new();
        if self.broken {
            return pings;
        }
        self.input.extend_from_slice(bytes);
        let mut state = shared.state.lock().unwrap();
        loop {
            match parse_request(&self.input, KEY_BYTES_MAX) {
                Ok(Some((request, used))) => {
                    match request {
                        Request::Acquire { owner, wait_s, .. } => {
                            state.acquires.push((owner, wait_s))
                        }
                        Request::Cancel { owner, .. } => {
                            *state.cancels.entry(owner).or_default() += 1
                        }
                        Request::Ping { nonce } => {
                            state.pings += 1;
                            pings.push(Response::Pong { nonce });
                        }
                        Request::Identify { nonce, .. } => pings.push(Response::Error {
                            code: ErrorCode::NotIdentified,
                            id: nonce,
                        }),
                        _ => {}
                    }
                    self.input.drain(..used);
                }
                Ok(None) => return pings,
                Err(_) => {
                    self.broken = true;
                    return pings;
                }
            }
        }
    }
}

fn pump_up(mut client: TcpStream, mut server: TcpStream, shared: &Shared, cut: Option<usize>) {
    let mut counter = Counter::default();
    let mut forwarded = 0usize;
    let mut chunk = [0u8; 16 * 1024];
    loop {
        let read = match client.read(&mut chunk) {
            Ok(0) | Err(_) => {
                let _ = server.shutdown(Shutdown::Write);
                return;
            }
            Ok(read) => read,
        };
        let _ = counter.feed(&chunk[..read], shared);
        let (delay, cut_after) = {
            let state = shared.state.lock().unwrap();
            (state.delay_up, state.cut_after.or(cut))
        };
        thread::sleep(delay);
        let allowed = cut_after.map_or(read, |cut| cut.saturating_sub(forwarded).min(read));
        let cut_now = allowed < read || cut_after == Some(forwarded + allowed);
        if cut_now {
            // The client loses the connection before the last bytes go up, so no answer they
            // cause can reach it (pump_down's write fails).
            let _ = client.shutdown(Shutdown::Both);
        }
        if server.write_all(&chunk[..allowed]).is_err() {
            let _ = client.shutdown(Shutdown::Both);
            return;
        }
        forwarded += allowed;
        if cut_now {
            // The cut: both sides lose the connection mid-stream.
            let _ = server.shutdown(Shutdown::Both);
            return;
        }
    }
}

fn pump_down(mut server: TcpStream, mut client: TcpStream, shared: Arc<Shared>) {
    let mut chunk = [0u8; 16 * 1024];
    loop {
        let read = match server.read(&mut chunk) {
            Ok(0) | Err(_) => {
                let _ = client.shutdown(Shutdown::Write);
                return;
            }
            Ok(read) => read,
        };
        let delay = {
            let mut state = shared.state.lock().unwrap();
            while state.hold_down && !state.stopped {
                state = shared.changed.wait(state).unwrap();
            }
            state.delay_down
        };
        thread::sleep(delay);
        if client.write_all(&chunk[..read]).is_err() {
            let _ = server.shutdown(Shutdown::Both);
            return;
        }
    }
}
