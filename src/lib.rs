//! latchkey: a low-latency lock server with fencing tokens.
//!
//! Services take a named lock for a bounded time and get a *fencing token* their storage can
//! check, so that a paused or partitioned client can never corrupt what the lock protects. The
//! wire protocol (binary frames: Acquire, Release, Extend, Cancel, Query, Ping) is specified in
//! `docs/protocol.md`, which restates the contract `PROTOCOL.md` with the same section numbers
//! (the "PROTOCOL.md §N" of these docs); this crate is the server, the official client and the
//! benchmark harness.
//!
//! # Layout
//!
//! | file | responsibility |
//! |---|---|
//! | `src/main.rs` | command line → config → start the server (or run a client command) |
//! | [`config`] | the TOML config file, defaults, validation (errors name the key) |
//! | [`logging`] | the logger: `[log] format` text or one JSON object a line, `RUST_LOG` |
//! | [`partition`] | what a core serves: the `Partition` trait, `Op`, `Answer`, sessions, stats, the key hash |
//! | [`lock_table`] | one partition: keys, holders, FIFO queues, tokens, timers. No I/O |
//! | [`latchkey_wheel`] | timing wheel over `u64` ticks: a flat ring, pages beyond it. No I/O; also the chunked arrays and slabs that never move what they hold |
//! | [`hash`] | FNV-1a: digests stable across builds (shard state, cluster identity) |
//! | [`metrics`] | per-core counters and fixed-bucket histograms, merged for `GET /metrics` |
//! | [`auth`] | authorization by key prefix: which keys a client certificate's identity may use |
//! | [`tokens`] | the token floor: wall clock and the persisted high-water mark |
//! | [`node`] | a latchkey process: starts the server as a single node or a cluster member |
//! | [`server`] | the thread-per-core mio runtime: reactor, sessions, cross-core routing |
//! | [`cluster`] | cluster mode: shards replicated over members with raft-rs (issue 12) |
//! | [`cli`] | the client commands: `lock`, `query`, `ping`, `stats`, `keys`, `cluster` |
//! | [`latchkey_client`] | the official client (PROTOCOL.md §4), the protocol codec, TLS files and streams |
//! | [`bench`](mod@bench) | the load generator behind `latchkey bench` |
#![deny(missing_docs)]

/// The crate's version, as Cargo.toml says it (`latchkey --version` prints it).
pub const VERSION: &str = env!("CARGO_PKG_VERSION");
/// The commit this binary was built from: 12 hex digits, or `unknown` when the build had no
/// git repository (set by `build.rs`).
pub const COMMIT: &str = env!("LATCHKEY_COMMIT");

pub mod auth;
pub mod bench;
pub mod cli;
pub mod cluster;
pub mod config;
pub mod hash;
pub mod lock_table;
pub mod logging;
pub mod metrics;
pub mod node;
pub mod partition;
pub mod server;
pub mod tokens;
