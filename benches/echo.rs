//! The frame echo baseline: the physical limit of request/response over loopback here.
//!
//! A single-threaded mio server that parses latchkey request frames with the crate's codec and
//! answers each at once with a response of the same size class, keeping no lock state at all:
//! Acquire → `A` (18 bytes, owner echoed, a counter as token), Release → `R`, Extend → `E`,
//! Cancel → `T`, Query → `Q` (free), Ping → `P`; a refused frame → `X`. So `latchkey bench
//! --target latchkey://ADDR --workload uncontended` drives it exactly as it drives the server,
//! and the difference between the two is the cost of the lock server itself.
//!
//! It does what a good server does per readiness and nothing more: one read until drained,
//! parse every frame, one write of all the answers. A session that does not read its answers
//! stops being read once `OUTPUT_BYTES_MAX` are pending, until they drain.
//!
//! Built as a `[[bench]]` target with `harness = false` (so it lives under `benches/` and shares
//! the release profile); `cargo bench` runs every bench target with `--bench`, so without
//! `--listen` it prints how to use it and exits.
//!
//! ```text
//! cargo build --release --bench echo   # or: cargo bench --bench echo --no-run
//! target/release/deps/echo-HASH --listen 127.0.0.1:0   # prints "listening on 127.0.0.1:PORT"
//! ```

use std::io::{self, Read, Write};
use std::net::SocketAddr;

use latchkey_client::protocol::{parse_request, Request, Response, KEY_BYTES_MAX};
use mio::net::{TcpListener, TcpStream};
use mio::{Events, Interest, Poll, Token};
use slab::Slab;

const LISTENER: Token = Token(usize::MAX);
const INPUT_BYTES: usize = 64 * 1024;
const OUTPUT_BYTES_MAX: usize = 256 * 1024;
const SESSIONS_MAX: usize = 10_000;
const EVENTS_MAX: usize = 1024;

struct Session {
    stream: TcpStream,
    token: Token,
    input: Box<[u8]>,
    input_len: usize,
    output: Vec<u8>,
    wants_write: bool,
    paused: bool,
}

struct Echo {
    poll: Poll,
    listener: TcpListener,
    sessions: Slab<Session>,
    generation: u32,
    next_token: u64,
    dirty: Vec<usize>,
}

fn token(index: usize, generation: u32) -> Token {
    Token((generation as usize) << 32 | index)
}

fn main() {
    let mut args = std::env::args().skip(1);
    let mut listen = None;
    while let Some(arg) = args.next() {
        if arg == "--listen" {
            listen = args.next();
        }
    }
    let Some(listen) = listen else {
        eprintln!("echo: the frame echo baseline for benches/compare.sh; run with --listen ADDR");
        return;
    };
    let address: SocketAddr = match listen.parse() {
        Ok(address) => address,
        Err(error) => {
            eprintln!("echo: --listen {listen}: {error}");
            std::process::exit(2);
        }
    };
    if let Err(error) = serve(address) {
        eprintln!("echo: {error}");
        std::process::exit(1);
    }
}

fn serve(address: SocketAddr) -> io::Result<()> {
    let poll = Poll::new()?;
    let mut listener = TcpListener::bind(address)?;
    poll.registry()
        .register(&mut listener, LISTENER, Interest::READABLE)?;
    println!("listening on {}", listener.local_addr()?);
    io::stdout().flush()?;
    let mut echo = Echo {
        poll,
        listener,
        sessions: Slab::with_capacity(64),
        generation: 0,
        next_token: 1,
        dirty: Vec::with_capacity(64),
    };
    let mut events = Events::with_capacity(EVENTS_MAX);
    loop {
        match echo.poll.poll(&mut events, None) {
            Ok(()) => {}
            Err(error) if error.kind() == io::ErrorKind::Interrupted => continue,
            Err(error) => return Err(error),
        }
        for event in events.iter() {
            if event.token() == LISTENER {
                echo.accept();
                continue;
            }
            // A token carries a generation, so an event for a closed session whose slab slot
            // was reused in the same batch is recognised and skipped.
            let index = event.token().0 & 0xFFFF_FFFF;
            let current = echo
                .sessions
                .get(index)
                .is_some_and(|s| s.token == event.token());
            if !current {
                continue;
            }
            if event.is_readable() || event.is_read_closed() || event.is_error() {
                echo.read(index);
            }
            if event.is_writable() {
                echo.dirty.push(index);
            }
        }
        echo.flush();
    }
}

impl Echo {
    fn accept(&mut self) {
        loop {
            let (mut stream, _) = match self.listener.accept() {
                Ok(accepted) => accepted,
                Err(error) if error.kind() == io::ErrorKind::WouldBlock => return,
                Err(error) if error.kind() == io::ErrorKind::Interrupted => continue,
                Err(error) => {
                    eprintln!("echo: accept: {error}");
                    return;
                }
            };
            if self.sessions.len() >= SESSIONS_MAX {
                continue;
            }
            let _ = stream.set_nodelay(true);
            self.generation = self.generation.wrapping_add(1);
            let entry = self.sessions.vacant_entry();
            let token = token(entry.key(), self.generation);
            let registered = self
                .poll
                .registry()
                .register(&mut stream, token, Interest::READABLE);
            if registered.is_ok() {
                entry.insert(Session {
                    stream,
                    token,
                    input: vec![0; INPUT_BYTES].into_boxed_slice(),
                    input_len: 0,
                    output: Vec::with_capacity(INPUT_BYTES),
                    wants_write: false,
                    paused: false,
                });
            }
        }
    }

    /// Reads until drained (or the output bound), answering every complete frame.
    fn read(&mut self, index: usize) {
        let session = &mut self.sessions[index];
        let keep = loop {
            if session.output.len() >= OUTPUT_BYTES_MAX {
                session.paused = true;
                break true;
            }
            let space = session.input.len() - session.input_len;
            match session.stream.read(&mut session.input[session.input_len..]) {
                Ok(0) => break false,
                Ok(read) => {
                    session.input_len += read;
                    if !answer(session, &mut self.next_token) {
                        break false;
                    }
                    if read < space {
                        break true;
                    }
                }
                Err(error) if error.kind() == io::ErrorKind::WouldBlock => break true,
                Err(error) if error.kind() == io::ErrorKind::Interrupted => {}
                Err(_) => break false,
            }
        };
        if keep {
            self.dirty.push(index);
        } else {
            self.close(index);
        }
    }

    /// Writes every session with pending answers. A paused session whose answers drained is
    /// read again here (mio is edge-triggered: no new event would come for bytes already
    /// waiting), which may queue it again; that ends when its input or the socket runs dry.
    fn flush(&mut self) {
        while let Some(index) = self.dirty.pop() {
            let Some(session) = self.sessions.get_mut(index) else {
                continue;
            };
            match write_out(session, &self.poll) {
                Ok(()) if session.paused && session.output.len() < OUTPUT_BYTES_MAX => {
                    session.paused = false;
                    self.read(index);
                }
                Ok(()) => {}
                Err(_) => self.close(index),
            }
        }
    }

    fn close(&mut self, index: usize) {
        if let Some(mut session) = self.sessions.try_remove(index) {
            let _ = self.poll.registry().deregister(&mut session.stream);
        }
    }
}

/// Answers every complete frame in the input buffer; `false` when the session must close.
fn answer(session: &mut Session, next_token: &mut u64) -> bool {
    let mut offset = 0;
    let keep = loop {
        match parse_request(&session.input[offset..session.input_len], KEY_BYTES_MAX) {
            Ok(Some((request, used))) => {
                offset += used;
                response(request, next_token).encode(&mut session.output);
            }
            Ok(None) => break true,
            Err(error) => {
                error.response().encode(&mut session.output);
                if error.code.closes_session() {
                    break false;
                }
                offset += error.consumed;
            }
        }
    };
    session.input.copy_within(offset..session.input_len, 0);
    session.input_len -= offset;
    keep
}

fn response(request: Request<'_>, next_token: &mut u64) -> Response {
    match request {
        Request::Acquire { owner, .. } => {
            *next_token += 1;
            Response::Acquired {
                owner,
                token: *next_token,
            }
        }
        Request::Release { token, .. } => Response::Released { token },
        Request::Extend { token, .. } => Response::Extended { token },
        Request::Cancel { owner, .. } => Response::Timeout { owner },
        Request::Query { nonce, .. } => Response::State {
            nonce,
            held: false,
            lease_ms: 0,
            waiters: 0,
        },
        Request::Ping { nonce } => Response::Pong { nonce },
        Request::Identify { nonce, grace_s, .. } => Response::Identified { nonce, grace_s },
        Request::Resolve { owner, .. } => Response::Resolved {
            owner,
            fate: latchkey_client::protocol::Fate::NeverSeen,
            token: 0,
            lease_ms: 0,
        },
    }
}

/// One write of everything pending (more only if the socket takes less at first).
fn write_out(session: &mut Session, poll: &Poll) -> io::Result<()> {
    let mut sent = 0;
    while sent < session.output.len() {
        match session.stream.write(&session.output[sent..]) {
            Ok(0) => return Err(io::ErrorKind::WriteZero.into()),
            Ok(written) => sent += written,
            Err(error) if error.kind() == io::ErrorKind::WouldBlock => break,
            Err(error) if error.kind() == io::ErrorKind::Interrupted => {}
            Err(error) => return Err(error),
        }
    }
    session.output.drain(..sent);
    let wants_write = !session.output.is_empty();
    if wants_write != session.wants_write {
        let interest = if wants_write {
            Interest::READABLE | Interest::WRITABLE
        } else {
            Interest::READABLE
        };
        poll.registry()
            .reregister(&mut session.stream, session.token, interest)?;
        session.wants_write = wants_write;
    }
    Ok(())
}
