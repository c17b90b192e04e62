//! The listening address: one `SO_REUSEPORT` listener per core, and a guard that no other
//! process serves the same address.
//!
//! Per-core `SO_REUSEPORT` listeners let the kernel spread new connections over the cores with
//! no acceptor thread. But `SO_REUSEPORT` also lets a *second* server (same user) join the
//! group: the kernel would then spread sessions over two independent lock tables, and two
//! clients could hold one key at once. So before the group is built:
//!
//! 1. the server takes an abstract Unix socket named after the address
//!    (`latchkey:<ip>:<port>`), which exactly one process per network namespace can hold and
//!    which the kernel releases when the process dies, however it dies; a second latchkey on
//!    the same address fails here;
//! 2. it binds one socket to the address *without* `SO_REUSEPORT` and closes it: this fails
//!    while anything else is bound there (another program, or a latchkey on the wildcard
//!    address), whatever its options.
//!
//! Only then does it bind the group. The race that remains: a process that is not latchkey,
//! runs as the same user and sets `SO_REUSEPORT` could bind the address between step 2's
//! close and the group's bind (microseconds); and two latchkeys started at the same instant,
//! one on a specific address and one on the wildcard address of the same port, could both
//! pass step 2. The guard lives as long as the listeners.

use std::io;
use std::net::SocketAddr;
use std::os::linux::net::SocketAddrExt;
use std::os::unix::net::{SocketAddr as UnixAddr, UnixListener};

/// Pending connections the kernel queues per listener.
const LISTEN_BACKLOG: i32 = 1024;

/// Holds the address for this process while it lives.
pub struct AddressGuard {
    _lock: UnixListener,
}

/// The listeners of one server: one per core, and the guard that keeps the address ours.
pub struct Listeners {
    /// One per core.
    pub listeners: Vec<mio::net::TcpListener>,
    /// The address they listen on (with the real port when 0 was asked for).
    pub addr: SocketAddr,
    /// Released when the server stops.
    pub guard: AddressGuard,
}

/// `address ... is already in use`, naming what is in the way when known.
fn in_use(addr: SocketAddr, what: &str) -> io::Error {
    let message = format!("address {addr} is already in use ({what})");
    io::Error::new(io::ErrorKind::AddrInUse, message)
}

/// `cannot listen on ...: cause`.
fn cannot_listen(addr: SocketAddr, error: io::Error) -> io::Error {
    if error.kind() == io::ErrorKind::AddrInUse {
        return in_use(addr, "another process is bound to it");
    }
    io::Error::new(error.kind(), format!("cannot listen on {addr}: {error}"))
}

/// Takes the address for this process (see the module docs), then binds `cores` listeners.
pub fn bind(listen: SocketAddr, cores: usize) -> io::Result<Listeners> {
    // Port 0: the kernel picks a port no socket uses; then it is locked like any other.
    let addr = match listen.port() {
        0 => probe(listen).map_err(|e| cannot_listen(listen, e))?,
        _ => listen,
    };
    let guard = lock(addr)?;
    if listen.port() != 0 {
        probe(addr).map_err(|e| cannot_listen(addr, e))?;
    }
    let mut listeners = Vec::with_capacity(cores);
    for _ in 0..cores {
        let listener = reuse_port_listener(addr).map_err(|e| cannot_listen(addr, e))?;
        listeners.push(mio::net::TcpListener::from_std(listener));
    }
    Ok(Listeners {
        listeners,
        addr,
        guard,
    })
}

/// Binds `addr` without `SO_REUSEPORT` and closes the socket at once; returns the address
/// bound (the kernel's port when `addr` asks for port 0).
fn probe(addr: SocketAddr) -> io::Result<SocketAddr> {
    let socket = tcp_socket(addr)?;
    socket.bind(&addr.into())?;
    socket
        .local_addr()?
        .as_socket()
        .ok_or_else(|| io::Error::other("not an IP socket"))
}

/// The abstract Unix socket that only one process can hold per address.
fn lock(addr: SocketAddr) -> io::Result<AddressGuard> {
    let name = format!("latchkey:{addr}");
    let unix = UnixAddr::from_abstract_name(name.as_bytes())?;
    match UnixListener::bind_addr(&unix) {
        Ok(lock) => Ok(AddressGuard { _lock: lock }),
        Err(e) if e.kind() == io::ErrorKind::AddrInUse => {
            Err(in_use(addr, "another latchkey serves it"))
        }
        Err(e) => Err(io::Error::new(
            e.kind(),
            format!("cannot lock the address {addr}: {e}"),
        )),
    }
}

/// A TCP socket for `addr` with `SO_REUSEADDR`, which only lets a restart bind over
/// connections in TIME_WAIT: a bound or listening socket still conflicts.
fn tcp_socket(addr: SocketAddr) -> io::Result<socket2::Socket> {
    let domain = socket2::Domain::for_address(addr);
    let socket = socket2::Socket::new(domain, socket2::Type::STREAM, None)?;
    socket.set_reuse_address(true)?;
    Ok(socket)
}

fn reuse_port_listener(addr: SocketAddr) -> io::Result<std::net::TcpListener> {
    let socket = tcp_socket(addr)?;
    socket.set_reuse_port(true)?;
    socket.set_nonblocking(true)?;
    socket.bind(&addr.into())?;
    socket.listen(LISTEN_BACKLOG)?;
    Ok(socket.into())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_second_server_on_the_address_is_refused() {
        let first = bind("127.0.0.1:0".parse().unwrap(), 2).unwrap();
        assert_eq!(first.listeners.len(), 2);
        let error = bind(first.addr, 1).err().expect("refused");
        assert_eq!(error.kind(), io::ErrorKind::AddrInUse);
        let message = error.to_string();
        assert!(
            message.starts_with(&format!("address {} is already in use", first.addr)),
            "{message}"
        );
    }

    #[test]
    fn any_other_listener_on_the_address_is_refused() {
        let other = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = other.local_addr().unwrap();
        let error = bind(addr, 1).err().expect("refused");
        assert!(error
            .to_string()
            .starts_with(&format!("address {addr} is already in use")));
    }

    #[test]
    fn the_address_is_free_again_once_the_server_is_gone() {
        let first = bind("127.0.0.1:0".parse().unwrap(), 1).unwrap();
        let addr = first.addr;
        drop(first);
        let again = bind(addr, 1).expect("the address is free");
        assert_eq!(again.addr, addr);
    }

    #[test]
    fn an_address_that_cannot_be_bound_is_named() {
        let error = bind("8.8.8.8:7604".parse().unwrap(), 1)
            .err()
            .expect("not local");
        assert!(
            error
                .to_string()
                .starts_with("cannot listen on 8.8.8.8:7604: "),
            "{error}"
        );
    }
}
