//! A latchkey process: a single node, or a cluster member. The one module that knows both the
//! server (the cores, the `server` module) and the cluster (`cluster`): it starts the server,
//! with a member's partitions behind the server's `Backend` trait when `[cluster]` is
//! configured. The server and the cluster do not import each other; they share only the
//! vocabulary of the `partition` module.

mod idle;
mod member;

#[cfg(test)]
mod harness_tests;

use crate::config::Config;
use crate::server;
/// What [`start`] returns (the running server: its address, shutdown, join) and why a server
/// stopped badly: named here, the `server` module being internal.
pub use crate::server::{ServerError, ServerHandle};
use member::MemberBackend;
use mio::Waker;
use std::io;
use std::sync::Arc;

/// Starts a single node or a cluster member with `config`.
pub fn start(config: Config) -> io::Result<ServerHandle> {
    start_with_notify(config, None)
}

/// Starts a single node or a cluster member; `notify` is woken when a core stops (normally or
/// not) or on shutdown.
///
/// A member's data directory is locked and checked first: a second process on it, or a start
/// that disagrees with what it holds, stops here before anything else is touched. Idle CPUs
/// that would slow every request's wake-ups are logged at info (`docs/operations.md`, Latency
/// tuning).
pub fn start_with_notify(config: Config, notify: Option<Arc<Waker>>) -> io::Result<ServerHandle> {
    idle::log_advice();
    match config.cluster.clone() {
        None => server::start_with_notify(config, notify),
        Some(cluster) => {
            let backend = MemberBackend::open(&config, &cluster)?;
            server::start_backend(config, notify, backend)
        }
    }
}
