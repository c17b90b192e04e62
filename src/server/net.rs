//! What a core needs of the network, as two small traits, so the core's logic can run over
//! real sockets (mio) or over in-memory streams in a single-threaded, seeded test harness.
//!
//! [`Stream`] is a connected byte stream: non-blocking `read` and `write` (`WouldBlock` when
//! nothing can be done now) and a half-close. [`Net`] registers and deregisters a session's
//! stream with the readiness source under its slot number. The mio implementation is
//! [`MioNet`], over plain TCP or TLS ([`MioStream`]); the test harness brings its own.
//!
//! A stream that keeps output of its own (TLS records rustls holds when the socket is full)
//! says so with [`Stream::wants_write`]; the session then counts it as unsent output and writes
//! it with `flush` on the next writable event. The defaults (no such output, no handshake) are
//! constants, so the plain TCP path compiles to what it was.

use crate::partition::PARTITION_SOURCES;
use mio::net::TcpStream;
use mio::{Interest, Registry, Token};
use std::io::{self, Read, Write};
use std::marker::PhantomData;
use std::net::{Shutdown, SocketAddr};
use std::time::Instant;

/// A connected, non-blocking byte stream.
pub trait Stream: Read + Write {
    /// Shuts the write half: the peer reads the end of input after what was written.
    fn shutdown_write(&mut self) -> io::Result<()>;
    /// The peer's address, for logs (`None` when unknown).
    fn peer(&self) -> Option<SocketAddr>;
    /// Whether the stream holds output of its own that `flush` must still write (TLS records
    /// the socket did not take). `flush` then returns `WouldBlock` until it is written.
    fn wants_write(&self) -> bool {
        false
    }
    /// Whether the stream is still in a handshake, which the core bounds in time.
    fn handshaking(&self) -> bool {
        false
    }
    /// The TLS error that made `read` fail, if one did (a plaintext client, garbage, a refused
    /// certificate, an alert); `None` for plain TCP.
    fn tls_error(&self) -> Option<String> {
        None
    }
    /// The identities the peer proved (a TLS client certificate's names, see [`crate::auth`]);
    /// none for plain TCP.
    fn identities(&self) -> Vec<String> {
        Vec::new()
    }
}

/// A stream the mio loop accepts: made from an accepted TCP connection, registered as it.
pub trait MioStream: Stream + mio::event::Source + Sized {
    /// What turns an accepted connection into a stream (nothing for TCP; the TLS settings).
    type Acceptor: Clone + Send + 'static;
    /// The stream of an accepted connection.
    fn accept(tcp: TcpStream, acceptor: &Self::Acceptor) -> io::Result<Self>;
}

impl MioStream for TcpStream {
    type Acceptor = ();

    fn accept(tcp: TcpStream, _: &()) -> io::Result<TcpStream> {
        Ok(tcp)
    }
}

impl Stream for TcpStream {
    fn shutdown_write(&mut self) -> io::Result<()> {
        self.shutdown(Shutdown::Write)
    }

    fn peer(&self) -> Option<SocketAddr> {
        self.peer_addr().ok()
    }
}

/// Where a core registers the streams of its sessions for readiness.
pub trait Net {
    /// The sessions' stream type.
    type Stream: Stream;
    /// Starts reporting readiness of `stream` under `slot`.
    fn register(&self, stream: &mut Self::Stream, slot: usize) -> io::Result<()>;
    /// Stops reporting readiness of `stream` (it is about to be closed).
    fn deregister(&self, stream: &mut Self::Stream);
    /// The server's clock in microseconds (the clock of the core's `now_us`), read to keep an
    /// iteration within its work budget.
    fn now_us(&self) -> u64;
}

/// The first of the [`PARTITION_SOURCES`] tokens a core reserves for its partition's sources
/// (the lower tokens are the listener's, the waker's and the alarm's).
pub const PARTITION_TOKEN_BASE: usize = 3;

/// Session tokens in the poll are slab slots plus this (above the partition's sources).
pub const SESSION_TOKEN_BASE: usize = PARTITION_TOKEN_BASE + PARTITION_SOURCES;

/// Sessions on mio streams (TCP or TLS over TCP), registered in one core's poll.
pub struct MioNet<S = TcpStream> {
    registry: Registry,
    epoch: Instant,
    _stream: PhantomData<fn() -> S>,
}

impl<S> MioNet<S> {
    /// Registers in the poll that `registry` belongs to; time counts from `epoch`.
    pub fn new(registry: Registry, epoch: Instant) -> MioNet<S> {
        MioNet {
            registry,
            epoch,
            _stream: PhantomData,
        }
    }
}

impl<S: MioStream> Net for MioNet<S> {
    type Stream = S;

    fn register(&self, stream: &mut S, slot: usize) -> io::Result<()> {
        let token = Token(slot + SESSION_TOKEN_BASE);
        let interest = Interest::READABLE | Interest::WRITABLE;
        self.registry.register(stream, token, interest)
    }

    fn deregister(&self, stream: &mut S) {
        let _ = self.registry.deregister(stream);
    }

    fn now_us(&self) -> u64 {
        self.epoch.elapsed().as_micros() as u64
    }
}
