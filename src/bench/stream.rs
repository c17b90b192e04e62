//! A bench connection's byte stream: plain TCP, or TLS over it (`latchkeys://`), and how each
//! is opened.
//!
//! Both are opened blocking, before the start gate, then made non-blocking for the worker's
//! mio loop. A TLS connection completes its handshake here, so no handshake is ever measured.
//!
//! The worker is generic over [`BenchStream`]: plain TCP's [`BenchStream::holds_output`] is a
//! constant `false`, so the plaintext request path does no TLS work at all.
//!
//! Deliberately not here: reading and writing requests (the worker), the TLS stream itself
//! ([`latchkey_client::tls`]).

use std::io::{self, Read, Write};
use std::net::{Shutdown, SocketAddr};
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Instant;

use mio::net::TcpStream;
use rustls::StreamOwned;

use super::driver::CONNECT_TIMEOUT;
use latchkey_client::protocol::{parse_response, Request, Response};
use latchkey_client::tls::Connector;
use latchkey_client::tls::TlsStream;

/// What a worker needs of a connection's stream.
pub trait BenchStream: Read + Write + mio::event::Source {
    /// Whether the stream holds output the socket has not taken yet (TLS records a full socket
    /// did not take), which `flush` writes once the socket is writable again.
    fn holds_output(&self) -> bool;

    /// Shuts the socket down in both directions.
    fn shutdown(&self) -> io::Result<()>;
}

impl BenchStream for TcpStream {
    #[inline]
    fn holds_output(&self) -> bool {
        false
    }

    fn shutdown(&self) -> io::Result<()> {
        TcpStream::shutdown(self, Shutdown::Both)
    }
}

impl BenchStream for TlsStream {
    #[inline]
    fn holds_output(&self) -> bool {
        TlsStream::wants_write(self)
    }

    fn shutdown(&self) -> io::Result<()> {
        self.tcp().shutdown(Shutdown::Both)
    }
}

/// A blocking connection to `address` within [`CONNECT_TIMEOUT`], without Nagle's delay.
fn connect_std(address: SocketAddr) -> io::Result<std::net::TcpStream> {
    let stream = std::net::TcpStream::connect_timeout(&address, CONNECT_TIMEOUT)?;
    stream.set_nodelay(true)?;
    Ok(stream)
}

/// A plain TCP connection to `address`, non-blocking.
pub fn connect_plain(address: SocketAddr, identify: bool) -> io::Result<TcpStream> {
    let mut stream = connect_std(address)?;
    if identify {
        identify_as_new_client(&mut stream, address)?;
    }
    stream.set_nonblocking(true)?;
    Ok(TcpStream::from_std(stream))
}

/// Identifies a blocking connection as a client of its own (docs/protocol.md §5) and reads
/// the server's `I`: what the official clients do before their first request.
fn identify_as_new_client(stream: &mut (impl Read + Write), address: SocketAddr) -> io::Result<()> {
    static CONNECTIONS: AtomicU64 = AtomicU64::new(0);
    let count = CONNECTIONS.fetch_add(1, Ordering::Relaxed);
    let seed = u64::from(std::process::id()) << 32 ^ count;
    let mut rng = crate::rng::Rng::new(seed ^ 0x1d3f_5eed);
    let client = (u128::from(rng.next_u64()) << 64 | u128::from(rng.next_u64())).max(1);
    let mut frame = Vec::new();
    let nonce = count + 1;
    Request::Identify {
        grace_s: 10,
        client,
        nonce,
    }
    .encode(&mut frame);
    stream.write_all(&frame)?;
    let mut answer = [0u8; 11];
    stream.read_exact(&mut answer)?;
    match parse_response(&answer) {
        Ok(Some((Response::Identified { nonce: echoed, .. }, _))) if echoed == nonce => Ok(()),
        other => Err(io::Error::other(format!(
            "{address} did not identify the connection: {other:?}"
        ))),
    }
}

/// A TLS connection to `address` with its handshake done within [`CONNECT_TIMEOUT`],
/// non-blocking.
pub fn connect_tls(
    address: SocketAddr,
    connector: &Connector,
    identify: bool,
) -> io::Result<TlsStream> {
    let deadline = Instant::now() + CONNECT_TIMEOUT;
    let stream = connect_std(address)?;
    let mut owned = connector
        .handshake(stream, address, deadline)
        .map_err(|error| io::Error::new(error.kind(), format!("TLS handshake: {error}")))?;
    if identify {
        identify_as_new_client(&mut owned, address)?;
    }
    let StreamOwned { conn, sock } = owned;
    sock.set_read_timeout(None)?;
    sock.set_write_timeout(None)?;
    sock.set_nonblocking(true)?;
    Ok(TlsStream::client(TcpStream::from_std(sock), conn))
}
