//! latchkey: a low-latency lock server with fencing tokens.
//!
//! Services take a named lock for a bounded time and get a *fencing token* their storage can
//! check, so that a paused or partitioned client can never corrupt what the lock protects. The
//! wire protocol (binary frames: Acquire, Release, Extend, Cancel, Query, Ping) is specified in
//! `docs/protocol.md` (the "docs/protocol.md §N" of these docs). This package is the server and
//! the `latchkey` command: [`node`] starts a server from a [`config`], [`cli`] holds the client
//! commands and [`bench`](mod@bench) the load generator. The official client and the protocol
//! codec are the crate `latchkey-client` ([`latchkey_client`]); the timing wheel is the crate
//! `latchkey-wheel` ([`latchkey_wheel`]).
//!
//! Where each part lives, crate by crate and file by file: `docs/architecture.md`.
#![deny(missing_docs)]

/// The crate's version, as Cargo.toml says it (`latchkey --version` prints it).
pub const VERSION: &str = env!("CARGO_PKG_VERSION");
/// The commit this binary was built from: 12 hex digits, or `unknown` when the build had no
/// git repository (set by `build.rs`).
pub const COMMIT: &str = env!("LATCHKEY_COMMIT");

// The public API: what `src/main.rs` runs, and what a program that embeds a server needs.
pub mod bench;
pub mod cli;
pub mod config;
pub mod logging;
pub mod node;

// Internal modules: crate-private, or public with the `testing` feature, which this
// repository's own tests, benches and simulations turn on to reach them (see `Cargo.toml`).
// Written out (not by a macro) so that `cargo fmt` reaches them.
#[cfg(feature = "testing")]
pub mod auth;
#[cfg(not(feature = "testing"))]
pub(crate) mod auth;
#[cfg(feature = "testing")]
pub mod cluster;
#[cfg(not(feature = "testing"))]
pub(crate) mod cluster;
#[cfg(feature = "testing")]
pub mod hash;
#[cfg(not(feature = "testing"))]
pub(crate) mod hash;
#[cfg(feature = "testing")]
pub mod lock_table;
#[cfg(not(feature = "testing"))]
pub(crate) mod lock_table;
#[cfg(feature = "testing")]
pub mod metrics;
#[cfg(not(feature = "testing"))]
pub(crate) mod metrics;
#[cfg(feature = "testing")]
pub mod partition;
#[cfg(not(feature = "testing"))]
pub(crate) mod partition;
#[cfg(feature = "testing")]
pub mod rng;
#[cfg(not(feature = "testing"))]
pub(crate) mod rng;
#[cfg(feature = "testing")]
pub mod server;
#[cfg(not(feature = "testing"))]
pub(crate) mod server;
#[cfg(feature = "testing")]
pub mod tokens;
#[cfg(not(feature = "testing"))]
pub(crate) mod tokens;
