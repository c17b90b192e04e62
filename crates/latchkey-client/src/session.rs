//! One session: a TCP connection driven by its own thread, fed through a bounded inbox.
//!
//! The thread owns the socket and the session's [`Pipeline`]; nothing else touches either, so
//! every decision about a request (sent or not, answered, past its deadline) is made in one
//! place, without locks. The socket is non-blocking (mio): a write reports exactly how many
//! bytes the kernel took, which is what makes "no byte of this request was handed to the
//! socket" an exact fact rather than a guess.
//!
//! Loop order: poll → connect check → read and correlate → take the inbox → deadlines →
//! write. `Instant::now()` is read again just before each write, because the wire wait of an
//! acquire must be computed just before its bytes go out.
//!
//! Invariants: once the session ends, its inbox is closed under the same lock that callers
//! submit under, so a call is either resolved by this thread or refused at submission, never
//! lost. The session is marked failed and its inbox closed before any of its calls is resolved
//! at the end, so a caller who hears back never hands its next call to this session; this is
//! also how an `X` that closes the session (codes 1, 2, 6) reaches its caller: the pipeline
//! ends the session at once and holds that answer back until [`Pipeline::finish`]. A session
//! never reconnects: the pool replaces a failed session by a new one.
//!
//! The session counts as established (and encodes its first request) only once its
//! handshake ping was answered (see `pipeline/link.rs`), after the TCP connect and, over TLS,
//! the TLS handshake, all within the connect timeout. So a server that accepts but does not
//! serve (paused: the kernel completes the connect from its backlog), a TLS handshake that
//! fails (wrong CA, refused certificate) and a peer that is not a latchkey server are failed
//! connects, and nothing was sent. Bytes handed to rustls count as handed to the socket:
//! "possibly sent" is the safe side of the line.
//!
//! An established session whose answers are overdue stalls (`pipeline/link.rs`): the driver
//! publishes that after every loop iteration, [`Session::submit`] refuses new calls meanwhile
//! (they were not sent), and the pool prefers other sessions.
//!
//! Deliberately not here: choosing a session and retrying elsewhere (see [`super::pool`]).

use std::collections::VecDeque;
use std::io::{self, Read, Write};
use std::net::{Shutdown, SocketAddr};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::thread;
use std::time::{Duration, Instant};

use mio::net::TcpStream;
use mio::{Events, Interest, Poll, Token, Waker};
use parking_lot::Mutex;

use super::call::{Call, CloseReason, Outcome};
use super::error::SessionFailure;
use super::pipeline::{Identity, Pipeline};
use crate::protocol::ErrorCode;
use crate::tls::Connector;
use crate::tls::TlsStream;

const STREAM: Token = Token(0);
const WAKER: Token = Token(1);
/// Read buffer size; answers are at most 19 bytes, so a partial one always leaves room.
const INPUT_BYTES: usize = 16 * 1024;
/// Readiness events handled per poll.
const EVENTS_MAX: usize = 8;

/// Timeouts and bounds of one session.
#[derive(Clone, Debug)]
pub(crate) struct SessionConfig {
    /// How long the TCP connect may take.
    pub connect_timeout: Duration,
    /// The transport allowance: how long a Cancel, a wait-0 acquire or a small request may
    /// stay unanswered, and how long a shutting-down session waits for its last answers.
    pub transport_timeout: Duration,
    /// Calls waiting in the inbox at most; a full inbox refuses new calls (not sent).
    pub inbox_calls_max: usize,
    /// TLS, or `None` for plaintext.
    pub tls: Option<Connector>,
    /// How the session identifies (docs/protocol.md §5), or `None`: it does not.
    pub identity: Option<Identity>,
    /// Shared by the client's sessions: false once a server answered an Identify `X` 1 (it
    /// does not know resumable calls), after which no session identifies.
    pub resumes: Arc<AtomicBool>,
    /// Shared by the client's sessions: set by `Client::interrupt`, after which every acquire
    /// on the session, waiting or new, is withdrawn.
    pub interrupted: Arc<AtomicBool>,
}

/// A session's connection: plain TCP or TLS.
enum Connection {
    Plain(TcpStream),
    Tls(Box<TlsStream>),
}

impl Connection {
    fn tcp(&self) -> &TcpStream {
        match self {
            Connection::Plain(tcp) => tcp,
            Connection::Tls(tls) => tls.tcp(),
        }
    }

    fn read(&mut self, buffer: &mut [u8]) -> io::Result<usize> {
        match self {
            Connection::Plain(tcp) => tcp.read(buffer),
            Connection::Tls(tls) => tls.read(buffer),
        }
    }

    fn write(&mut self, bytes: &[u8]) -> io::Result<usize> {
        match self {
            Connection::Plain(tcp) => tcp.write(bytes),
            Connection::Tls(tls) => tls.write(bytes),
        }
    }

    /// Writes the TLS records waiting in rustls, if any (`WouldBlock` when some remain).
    fn flush_records(&mut self) -> io::Result<()> {
        match self {
            Connection::Tls(tls) if tls.wants_write() => tls.flush(),
            _ => Ok(()),
        }
    }

    fn shutdown_write(&mut self) -> io::Result<()> {
        match self {
            Connection::Plain(tcp) => tcp.shutdown(Shutdown::Write),
            Connection::Tls(tls) => tls.shutdown_write(),
        }
    }
}

/// Where a session hands the background releases it could not send.
pub(crate) type Orphans = Box<dyn Fn(Call) + Send>;

/// Where sessions record why they failed (shared by every session of a client).
pub(crate) type FailureLog = Arc<Mutex<Failures>>;

/// Why sessions failed: the latest of all, and the latest per address.
#[derive(Debug, Default)]
pub(crate) struct Failures {
    latest: Option<SessionFailure>,
    /// One per address, at most [`FAILED_ADDRS_MAX`] (a client has at most
    /// [`super::MEMBERS_MAX`] pools, so this only bounds a bug).
    by_addr: Vec<SessionFailure>,
}

/// The most addresses whose latest failure is kept.
const FAILED_ADDRS_MAX: usize = 2 * super::MEMBERS_MAX;

impl Failures {
    fn record(&mut self, failure: SessionFailure) {
        match self.by_addr.iter_mut().find(|f| f.addr() == failure.addr()) {
            Some(old) => *old = failure.clone(),
            None => {
                if self.by_addr.len() >= FAILED_ADDRS_MAX {
                    self.by_addr.remove(0);
                }
                self.by_addr.push(failure.clone());
            }
        }
        self.latest = Some(failure);
    }

    /// Why the latest session that failed did.
    pub(crate) fn latest(&self) -> Option<&SessionFailure> {
        self.latest.as_ref()
    }

    /// Why the latest session to `addr` that failed did.
    pub(crate) fn of(&self, addr: SocketAddr) -> Option<&SessionFailure> {
        self.by_addr.iter().find(|failure| failure.addr() == addr)
    }
}

/// The caller's side of a session: submit calls; dropping it shuts the session down after
/// its queued writes (background releases) went out.
pub(crate) struct Session {
    id: u64,
    shared: Arc<Shared>,
}

struct Shared {
    inbox: Mutex<Inbox>,
    waker: Waker,
    inbox_calls_max: usize,
    failed: AtomicBool,
    /// Answers are overdue and nothing was read since: no new call is taken.
    stalled: AtomicBool,
    shutdown: AtomicBool,
    /// The server identified the session (docs/protocol.md §5).
    identified: AtomicBool,
}

struct Inbox {
    calls: VecDeque<Call>,
    closed: bool,
}

impl Session {
    /// Starts a session thread connecting to `addr`.
    pub(crate) fn spawn(
        id: u64,
        addr: SocketAddr,
        config: SessionConfig,
        orphans: Orphans,
        failures: FailureLog,
    ) -> io::Result<Session> {
        let poll = Poll::new()?;
        let waker = Waker::new(poll.registry(), WAKER)?;
        let shared = Arc::new(Shared {
            inbox: Mutex::new(Inbox {
                calls: VecDeque::new(),
                closed: false,
            }),
            waker,
            inbox_calls_max: config.inbox_calls_max,
            failed: AtomicBool::new(false),
            stalled: AtomicBool::new(false),
            shutdown: AtomicBool::new(false),
            identified: AtomicBool::new(false),
        });
        let pipeline = Pipeline::new(
            config.transport_timeout,
            config.connect_timeout,
            Instant::now(),
        );
        let driver = Driver {
            id,
            addr,
            config,
            shared: Arc::clone(&shared),
            poll,
            events: Events::with_capacity(EVENTS_MAX),
            stream: None,
            tcp_connected: false,
            pipeline,
            input: vec![0; INPUT_BYTES],
            input_len: 0,
            orphans,
            failures,
        };
        thread::Builder::new()
            .name(format!("latchkey-session-{id}"))
            .spawn(move || driver.run())?;
        Ok(Session { id, shared })
    }

    /// This session's id (unique within its pool).
    pub(crate) fn id(&self) -> u64 {
        self.id
    }

    /// Whether the session has ended; the pool then replaces it.
    pub(crate) fn is_failed(&self) -> bool {
        self.shared.failed.load(Ordering::Acquire)
    }

    /// Whether the server identified the session (docs/protocol.md §5): a Resolve may ask
    /// another session of this client what became of an acquire it may have sent.
    pub(crate) fn is_identified(&self) -> bool {
        self.shared.identified.load(Ordering::Acquire)
    }

    /// Whether the session's answers are overdue (see the module docs): it takes no new call
    /// until it reads again.
    pub(crate) fn is_stalled(&self) -> bool {
        self.shared.stalled.load(Ordering::Acquire)
    }

    /// Wakes the session thread (to see `SessionConfig::interrupted`).
    pub(crate) fn wake(&self) {
        if let Err(error) = self.shared.waker.wake() {
            log::error!("session {}: cannot wake its thread: {error}", self.id);
        }
    }

    /// Hands a call to the session thread, or gives it back when the session has ended, is
    /// stalled or its inbox is full (the call was not sent).
    #[allow(clippy::result_large_err)]
    pub(crate) fn submit(&self, call: Call) -> Result<(), Call> {
        if self.is_stalled() {
            return Err(call);
        }
        {
            let mut inbox = self.shared.inbox.lock();
            if inbox.closed || inbox.calls.len() >= self.shared.inbox_calls_max {
                return Err(call);
            }
            inbox.calls.push_back(call);
        }
        if let Err(error) = self.shared.waker.wake() {
            log::error!("session {}: cannot wake its thread: {error}", self.id);
        }
        Ok(())
    }
}

impl Drop for Session {
    fn drop(&mut self) {
        self.shared.shutdown.store(true, Ordering::Release);
        let _ = self.shared.waker.wake();
    }
}

struct Driver {
    id: u64,
    addr: SocketAddr,
    config: SessionConfig,
    shared: Arc<Shared>,
    poll: Poll,
    events: Events,
    stream: Option<Connection>,
    /// The TCP connect completed (over TLS, the handshake may still be under way).
    tcp_connected: bool,
    pipeline: Pipeline,
    input: Vec<u8>,
    input_len: usize,
    orphans: Orphans,
    failures: FailureLog,
}

impl Driver {
    fn run(mut self) {
        let reason = match self.connect() {
            Ok(()) => self.run_loop(),
            Err(reason) => reason,
        };
        if reason == CloseReason::Shutdown {
            self.drain_after_shutdown();
        }
        self.finish(reason);
    }

    fn connect(&mut self) -> Result<(), CloseReason> {
        let fail = |error: io::Error| CloseReason::ConnectFailed(error.kind());
        let mut stream = TcpStream::connect(self.addr).map_err(fail)?;
        let interest = Interest::READABLE | Interest::WRITABLE;
        self.poll
            .registry()
            .register(&mut stream, STREAM, interest)
            .map_err(fail)?;
        self.stream = Some(match &self.config.tls {
            Some(tls) => {
                let connection = tls.connection(self.addr).map_err(fail)?;
                Connection::Tls(Box::new(TlsStream::client(stream, connection)))
            }
            None => Connection::Plain(stream),
        });
        Ok(())
    }

    fn run_loop(&mut self) -> CloseReason {
        let connect_deadline = Instant::now() + self.config.connect_timeout;
        loop {
            let timeout = self.poll_timeout(Instant::now(), connect_deadline);
            if let Err(error) = self.poll.poll(&mut self.events, timeout) {
                if error.kind() == io::ErrorKind::Interrupted {
                    continue;
                }
                return CloseReason::Io(error.kind());
            }
            let now = Instant::now();
            let readable = self
                .events
                .iter()
                .any(|e| e.token() == STREAM && e.is_readable());
            let writable = self
                .events
                .iter()
                .any(|e| e.token() == STREAM && e.is_writable());
            if self.pipeline.is_connecting() && (readable || writable) {
                if !self.tcp_connected {
                    self.check_connected();
                }
                if self.tcp_connected {
                    self.handshake();
                }
            }
            if !self.pipeline.is_established() && now >= connect_deadline {
                let reason = match self.pipeline.is_handshaking() {
                    true => CloseReason::HandshakeTimeout,
                    false => CloseReason::ConnectTimeout,
                };
                self.pipeline.close(reason);
            }
            if !self.pipeline.is_connecting() && readable {
                self.read(now);
            }
            self.take_inbox();
            if self.config.interrupted.load(Ordering::Relaxed) {
                self.pipeline.withdraw_acquires(now);
            }
            self.pipeline.handle_deadlines(now);
            self.flush();
            self.publish_stall();
            if self.pipeline.is_identified() {
                self.shared.identified.store(true, Ordering::Release);
            }
            if let Some(reason) = self.pipeline.close_reason() {
                return reason.clone();
            }
            if self.shared.shutdown.load(Ordering::Acquire) && self.idle() {
                return CloseReason::Shutdown;
            }
        }
    }

    fn poll_timeout(&self, now: Instant, connect_deadline: Instant) -> Option<Duration> {
        let mut next = self.pipeline.next_deadline();
        if !self.pipeline.is_established() {
            next = Some(next.map_or(connect_deadline, |at| at.min(connect_deadline)));
        }
        next.map(|at| at.saturating_duration_since(now))
    }

    /// A non-blocking connect has finished (or failed) when the socket reports readiness.
    fn check_connected(&mut self) {
        let stream = self
            .stream
            .as_ref()
            .expect("connect() stored the stream")
            .tcp();
        match stream.take_error() {
            Ok(None) => {}
            Ok(Some(error)) | Err(error) => {
                return self
                    .pipeline
                    .close(CloseReason::ConnectFailed(error.kind()))
            }
        }
        match stream.peer_addr() {
            Ok(_) => {
                if let Err(error) = stream.set_nodelay(true) {
                    log::debug!("session {}: TCP_NODELAY: {error}", self.id);
                }
                log::debug!("session {} connected to {}", self.id, self.addr);
                self.tcp_connected = true;
            }
            Err(error) if error.kind() == io::ErrorKind::NotConnected => {}
            Err(error) => self
                .pipeline
                .close(CloseReason::ConnectFailed(error.kind())),
        }
    }

    /// Moves the TLS handshake along; once it is done (at once for plain TCP), the handshake
    /// ping goes out with a nonce of this session's own.
    fn handshake(&mut self) {
        let identity = match self.config.resumes.load(Ordering::Acquire) {
            true => self.config.identity,
            false => None,
        };
        let tls = match self.stream.as_mut().expect("connected") {
            Connection::Plain(_) => {
                return self
                    .pipeline
                    .start_handshake(super::args::next_id(), identity)
            }
            Connection::Tls(tls) => tls,
        };
        if let Err(error) = tls.progress() {
            log::debug!("session {}: TLS handshake: {error}", self.id);
            let reason = match CloseReason::of_io(&error) {
                CloseReason::Io(kind) => CloseReason::ConnectFailed(kind),
                tls => tls,
            };
            return self.pipeline.close(reason);
        }
        if !tls.handshaking() {
            log::debug!("session {}: TLS established with {}", self.id, self.addr);
            self.pipeline
                .start_handshake(super::args::next_id(), identity);
        }
    }

    /// Tells callers whether the session stalled, and hands the fire-and-forget calls it gave
    /// back to the pool.
    fn publish_stall(&mut self) {
        let stalled = self.pipeline.is_stalled();
        if self.shared.stalled.swap(stalled, Ordering::AcqRel) != stalled {
            log::debug!("session {} to {}: stalled {stalled}", self.id, self.addr);
        }
        let now = Instant::now();
        for mut call in self.pipeline.resolve_returned() {
            call.attempts += 1;
            if call.deadline > now && call.attempts < 3 {
                (self.orphans)(call);
            }
        }
    }

    /// Reads until the socket has no more (edge-triggered readiness), correlating as it goes.
    fn read(&mut self, now: Instant) {
        let stream = self.stream.as_mut().expect("connected");
        while self.pipeline.close_reason().is_none() {
            match stream.read(&mut self.input[self.input_len..]) {
                Ok(0) => self.pipeline.close(CloseReason::Eof),
                Ok(read) => {
                    self.input_len += read;
                    let used = self
                        .pipeline
                        .handle_read(&self.input[..self.input_len], now);
                    self.input.copy_within(used..self.input_len, 0);
                    self.input_len -= used;
                }
                Err(error) if error.kind() == io::ErrorKind::WouldBlock => return,
                Err(error) if error.kind() == io::ErrorKind::Interrupted => {}
                Err(error) => self.pipeline.close(CloseReason::of_io(&error)),
            }
        }
    }

    /// Moves new calls into the pipeline; none once the session must end: `finish` resolves
    /// them after the session is retired, so no caller hears back from a session that still
    /// looks alive.
    fn take_inbox(&mut self) {
        if self.pipeline.close_reason().is_some() {
            return;
        }
        let calls = std::mem::take(&mut self.shared.inbox.lock().calls);
        for call in calls {
            self.pipeline.submit(call);
        }
    }

    fn idle(&self) -> bool {
        self.shared.inbox.lock().calls.is_empty() && self.pipeline.output_idle()
    }

    /// Writes until the socket takes no more, one
    /// [`Output`](super::pipeline::output::Output) guard per write. The instant is read before
    /// every write: it is both the wire-wait reference for frames encoded now and the `sent_at`
    /// of their bytes. Frames the socket did not take
    /// go back to the pipeline's queue when the guard ends.
    fn flush(&mut self) {
        let Some(stream) = self.stream.as_mut() else {
            return;
        };
        match stream.flush_records() {
            Ok(()) => {}
            Err(error) if error.kind() == io::ErrorKind::WouldBlock => return,
            Err(error) => return self.pipeline.close(CloseReason::of_io(&error)),
        }
        loop {
            let mut output = self.pipeline.output(Instant::now());
            if output.bytes().is_empty() {
                return;
            }
            match stream.write(output.bytes()) {
                Ok(written) => output.handed(written),
                Err(error) if error.kind() == io::ErrorKind::WouldBlock => return,
                Err(error) if error.kind() == io::ErrorKind::Interrupted => {}
                Err(error) => {
                    drop(output);
                    return self.pipeline.close(CloseReason::of_io(&error));
                }
            }
        }
    }

    /// After the client was dropped and everything queued was written: half-close, so the
    /// server executes what it received, and read its last answers for a bounded time.
    fn drain_after_shutdown(&mut self) {
        let Some(stream) = self.stream.as_mut() else {
            return;
        };
        if !self.pipeline.is_established() || stream.shutdown_write().is_err() {
            return;
        }
        let until = Instant::now() + self.config.transport_timeout;
        while self.pipeline.close_reason().is_none() {
            let now = Instant::now();
            if now >= until {
                return;
            }
            match self.poll.poll(&mut self.events, Some(until - now)) {
                Ok(()) => self.read(Instant::now()),
                Err(error) if error.kind() == io::ErrorKind::Interrupted => {}
                Err(_) => return,
            }
        }
    }

    /// Ends the session: closes the inbox, resolves every open call, and hands unsent
    /// background releases to the pool.
    fn finish(mut self, reason: CloseReason) {
        let identifying = self.pipeline.is_handshaking() && self.config.identity.is_some();
        if identifying && reason == CloseReason::ServerError(ErrorCode::UnknownOp) {
            log::info!(
                "{} does not know resumable calls (it answered Identify with X 1): sessions \
                 no longer identify",
                self.addr
            );
            self.config.resumes.store(false, Ordering::Release);
        }
        match reason {
            CloseReason::Shutdown | CloseReason::Eof => {
                log::debug!("session {} to {}: {reason}", self.id, self.addr)
            }
            _ => log::warn!("session {} to {} ended: {reason}", self.id, self.addr),
        }
        if reason != CloseReason::Shutdown {
            // Recorded before any call hears back, so a caller that asks why sees this.
            let connected = self.pipeline.is_established();
            let refused = reason == CloseReason::ConnectFailed(io::ErrorKind::ConnectionRefused);
            let failure =
                SessionFailure::new(self.addr, reason.to_string(), connected).with_refused(refused);
            self.failures.lock().record(failure);
        }
        // Marked failed and closed before any call hears back (including the `Rejected` of an
        // `X` that closed the session, held by the pipeline until `finish`), so neither a
        // retry nor the caller's next call picks this session.
        self.shared.failed.store(true, Ordering::Release);
        let leftovers = {
            let mut inbox = self.shared.inbox.lock();
            inbox.closed = true;
            std::mem::take(&mut inbox.calls)
        };
        self.pipeline.close(reason);
        let mut orphans = self.pipeline.finish();
        for call in leftovers {
            match call.reply {
                Some(tx) => {
                    let _ = tx.try_send(Outcome::NotSent);
                }
                None => orphans.push(call),
            }
        }
        drop(self.stream.take());
        let now = Instant::now();
        for mut call in orphans {
            call.attempts += 1;
            if call.deadline > now && call.attempts < 3 {
                (self.orphans)(call);
            }
        }
    }
}

#[cfg(test)]
mod tests;
