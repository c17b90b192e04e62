//! A non-blocking TLS stream: a mio TCP stream and a rustls connection, for the server's
//! sessions (a server connection) and the official client's and the bench's (a client
//! connection). The server sees it through its own `Stream` trait, as it sees plain TCP.
//!
//! rustls is sans-IO: it takes ciphertext (`read_tls`), decrypts it (`process_new_packets`),
//! hands out plaintext (`reader`), takes plaintext (`writer`) and gives ciphertext to send
//! (`write_tls`). This type moves bytes between it and the socket, for edge-triggered readiness:
//!
//! * `read` returns a short count (or `WouldBlock`) only after the socket itself said
//!   `WouldBlock` (or ended) in that call, so a reader that stops at a short read (the server's
//!   session does) never misses data with no edge left to announce it. A full count may leave
//!   ciphertext in the socket: the reader reads again.
//! * `write` takes plaintext into rustls and pushes records until the socket would block.
//!   Records rustls still holds then are reported by [`TlsStream::wants_write`]; the caller
//!   counts them as unsent output and calls `flush` on the next writable event.
//! * A TLS error (garbage, a refused certificate, an alert) is answered with rustls's alert
//!   (best effort) and returned as an error: the session closes.
//!
//! Limits: rustls buffers at most [`TLS_BUFFER_BYTES`] of outgoing data per stream (a full
//! buffer is `WouldBlock` to the caller, which stops reading it past its output bound), and
//! at most its own fixed limit of received plaintext; one `read` handles at most
//! [`READ_ROUNDS_MAX`] ciphertext reads. The server bounds a handshake in time
//! ([`TlsStream::handshaking`] says whether one is under way).
//!
//! Not here: reading certificates and building the configurations ([`crate::tls`]).

use mio::net::TcpStream;
use mio::{Interest, Registry, Token};
use rustls::{ClientConnection, Connection, ServerConfig, ServerConnection};
use std::io::{self, Read, Write};
use std::net::{Shutdown, SocketAddr};
use std::sync::Arc;

/// Outgoing bytes (plaintext and records) rustls may hold for one session.
pub const TLS_BUFFER_BYTES: usize = 64 * 1024;
/// Ciphertext reads in one `read` call before it gives up on a peer that sends only records
/// without data (each read takes at least one byte, at most rustls's record buffer).
pub const READ_ROUNDS_MAX: usize = 1024;

/// The error inside the `InvalidData` I/O error a [`TlsStream`] returns for a TLS failure, so
/// that a caller can tell it from a socket error (displayed as `TLS: …`).
#[derive(Debug)]
pub struct TlsError(pub rustls::Error);

impl std::fmt::Display for TlsError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "TLS: {}", self.0)
    }
}

impl std::error::Error for TlsError {}

/// A TLS session over a mio TCP stream (see the module docs).
pub struct TlsStream {
    tcp: TcpStream,
    tls: Connection,
    /// The socket ended its input.
    tcp_ended: bool,
    /// The TLS error that ended the session, if one did.
    error: Option<rustls::Error>,
}

impl TlsStream {
    /// A server-side TLS stream on an accepted connection.
    pub fn new(tcp: TcpStream, config: Arc<ServerConfig>) -> io::Result<TlsStream> {
        let tls = ServerConnection::new(config).map_err(io::Error::other)?;
        Ok(TlsStream::with(tcp, Connection::Server(tls)))
    }

    /// A client-side TLS stream on a (perhaps still connecting) connection.
    pub fn client(tcp: TcpStream, tls: ClientConnection) -> TlsStream {
        TlsStream::with(tcp, Connection::Client(tls))
    }

    fn with(tcp: TcpStream, mut tls: Connection) -> TlsStream {
        tls.set_buffer_limit(Some(TLS_BUFFER_BYTES));
        TlsStream {
            tcp,
            tls,
            tcp_ended: false,
            error: None,
        }
    }

    /// The TCP stream (to check a connect, set options).
    pub fn tcp(&self) -> &TcpStream {
        &self.tcp
    }

    /// Moves a handshake along without taking plaintext: writes what rustls holds, then reads
    /// and processes what the socket has until it would block (`UnexpectedEof` when the
    /// socket ended first, `InvalidData` for a TLS error). For the client's sessions.
    pub fn progress(&mut self) -> io::Result<()> {
        self.push_records_now()?;
        for _ in 0..READ_ROUNDS_MAX {
            match self.tls.read_tls(&mut self.tcp) {
                Ok(0) => return Err(io::ErrorKind::UnexpectedEof.into()),
                Ok(_) => {}
                Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => return Ok(()),
                Err(e) => return Err(e),
            }
            if let Err(error) = self.tls.process_new_packets() {
                return Err(self.failed(error));
            }
            self.push_records_now()?;
        }
        Ok(())
    }

    /// Ends the session for a TLS error: sends the alert rustls queued to tell the peer why
    /// (best effort), keeps the error (see [`TlsStream::tls_error`]) and returns it as an
    /// `InvalidData` error.
    fn failed(&mut self, error: rustls::Error) -> io::Error {
        let _ = self.push_records_now();
        self.error = Some(error.clone());
        io::Error::new(io::ErrorKind::InvalidData, TlsError(error))
    }

    /// Writes the records rustls holds until none is left (`Ok`) or the socket is full
    /// (`WouldBlock`). Bounded: every pass writes bytes out of a bounded buffer.
    fn push_records(&mut self) -> io::Result<()> {
        while self.tls.wants_write() {
            match self.tls.write_tls(&mut self.tcp) {
                Ok(0) => return Err(io::ErrorKind::WriteZero.into()),
                Ok(_) => {}
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => return Err(e),
            }
        }
        Ok(())
    }

    /// Like [`push_records`](Self::push_records), a full socket not being an error.
    fn push_records_now(&mut self) -> io::Result<()> {
        match self.push_records() {
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => Ok(()),
            other => other,
        }
    }

    /// Takes decrypted plaintext into `buffer`: `Some(n)` when the caller should return `n`
    /// (the buffer is full, or the stream ended), `None` to read more ciphertext.
    fn take_plaintext(&mut self, buffer: &mut [u8], filled: &mut usize) -> Option<usize> {
        match self.tls.reader().read(&mut buffer[*filled..]) {
            // A clean end (close_notify), or an empty buffer.
            Ok(0) => Some(*filled),
            Ok(n) => {
                *filled += n;
                (*filled == buffer.len()).then_some(*filled)
            }
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => None,
            // The peer ended without close_notify: an end of input like any other (requests
            // are framed; a truncated frame is never executed).
            Err(_) => Some(*filled),
        }
    }

    /// One ciphertext read and its processing: `Some` when `read` must return that.
    fn read_records(&mut self, filled: usize) -> Option<io::Result<usize>> {
        match self.tls.read_tls(&mut self.tcp) {
            Ok(0) => self.tcp_ended = true,
            Ok(_) => {}
            Err(e) if e.kind() == io::ErrorKind::Interrupted => return None,
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                return Some(if filled > 0 { Ok(filled) } else { Err(e) });
            }
            Err(e) => return Some(Err(e)),
        }
        if let Err(error) = self.tls.process_new_packets() {
            return Some(Err(self.failed(error)));
        }
        // The handshake, a key update or a ticket may have something to send.
        self.push_records_now().err().map(Err)
    }
}

impl Read for TlsStream {
    fn read(&mut self, buffer: &mut [u8]) -> io::Result<usize> {
        if buffer.is_empty() {
            return Ok(0);
        }
        let mut filled = 0;
        for _ in 0..READ_ROUNDS_MAX {
            if let Some(n) = self.take_plaintext(buffer, &mut filled) {
                return Ok(n);
            }
            if self.tcp_ended {
                return Ok(filled);
            }
            if let Some(result) = self.read_records(filled) {
                return result;
            }
        }
        let message = "TLS: too many records without data in one read";
        Err(io::Error::new(io::ErrorKind::InvalidData, message))
    }
}

impl Write for TlsStream {
    fn write(&mut self, plaintext: &[u8]) -> io::Result<usize> {
        self.push_records()?;
        let taken = self.tls.writer().write(plaintext)?;
        self.push_records_now()?;
        if taken == 0 && !plaintext.is_empty() {
            // rustls's buffer is full of records the socket did not take.
            return Err(io::ErrorKind::WouldBlock.into());
        }
        Ok(taken)
    }

    fn flush(&mut self) -> io::Result<()> {
        self.push_records()
    }
}

impl TlsStream {
    /// Shuts the write half: sends `close_notify` (best effort), then shuts the socket's write
    /// half; the peer reads the end of input after what was written.
    pub fn shutdown_write(&mut self) -> io::Result<()> {
        self.tls.send_close_notify();
        let _ = self.push_records_now();
        self.tcp.shutdown(Shutdown::Write)
    }

    /// The peer's address (`None` when unknown).
    pub fn peer(&self) -> Option<SocketAddr> {
        self.tcp.peer_addr().ok()
    }

    /// Whether rustls holds records that `flush` must still write. `flush` then returns
    /// `WouldBlock` until they are written.
    #[inline]
    pub fn wants_write(&self) -> bool {
        self.tls.wants_write()
    }

    /// Whether the handshake is still under way.
    pub fn handshaking(&self) -> bool {
        self.tls.is_handshaking()
    }

    /// The TLS error that made `read` fail, if one did (a plaintext peer, garbage, a refused
    /// certificate, an alert).
    pub fn tls_error(&self) -> Option<String> {
        self.error.as_ref().map(ToString::to_string)
    }

    /// The certificate a client presented to this server-side stream (the end entity, DER),
    /// once the handshake verified it; `None` for a client-side stream or a client without one.
    pub fn peer_certificate(&self) -> Option<&[u8]> {
        let Connection::Server(server) = &self.tls else {
            return None;
        };
        let end_entity = server.peer_certificates().and_then(|chain| chain.first());
        end_entity.map(|cert| cert.as_ref())
    }
}

impl mio::event::Source for TlsStream {
    fn register(
        &mut self,
        registry: &Registry,
        token: Token,
        interest: Interest,
    ) -> io::Result<()> {
        self.tcp.register(registry, token, interest)
    }

    fn reregister(
        &mut self,
        registry: &Registry,
        token: Token,
        interest: Interest,
    ) -> io::Result<()> {
        self.tcp.reregister(registry, token, interest)
    }

    fn deregister(&mut self, registry: &Registry) -> io::Result<()> {
        self.tcp.deregister(registry)
    }
}
