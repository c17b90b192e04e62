//! What a core needs of the network, as two small traits, so the core's logic can run over
//! real sockets (mio) or over in-memory streams in a single-threaded, seeded test harness.
//!
//! [`Stream`] is a connected byte stream: non-blocking `read` and `write` (`WouldBlock` when
//! nothing can be done now) and a half-close. [`Net`] registers and deregisters a session's
//! stream with the readiness source under its slot number. The mio implementation is
//! [`MioNet`]; the test harness brings its own.

use mio::net::TcpStream;
use mio::{Interest, Registry, Token};
use std::io::{self, Read, Write};
use std::net::{Shutdown, SocketAddr};
use std::time::Instant;

/// A connected, non-blocking byte stream.
pub trait Stream: Read + Write {
    /// Shuts the write half: the peer reads the end of input after what was written.
    fn shutdown_write(&self) -> io::Result<()>;
    /// The peer's address, for logs (`None` when unknown).
    fn peer(&self) -> Option<SocketAddr>;
}

impl Stream for TcpStream {
    fn shutdown_write(&self) -> io::Result<()> {
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

/// Session tokens in the poll are slab slots plus this (the lower tokens are the listener's,
/// the waker's and the alarm's).
pub const SESSION_TOKEN_BASE: usize = 3;

/// Sessions on mio TCP streams, registered in one core's poll.
pub struct MioNet {
    registry: Registry,
    epoch: Instant,
}

impl MioNet {
    /// Registers in the poll that `registry` belongs to; time counts from `epoch`.
    pub fn new(registry: Registry, epoch: Instant) -> MioNet {
        MioNet { registry, epoch }
    }
}

impl Net for MioNet {
    type Stream = TcpStream;

    fn register(&self, stream: &mut TcpStream, slot: usize) -> io::Result<()> {
        let token = Token(slot + SESSION_TOKEN_BASE);
        let interest = Interest::READABLE | Interest::WRITABLE;
        self.registry.register(stream, token, interest)
    }

    fn deregister(&self, stream: &mut TcpStream) {
        let _ = self.registry.deregister(stream);
    }

    fn now_us(&self) -> u64 {
        self.epoch.elapsed().as_micros() as u64
    }
}
