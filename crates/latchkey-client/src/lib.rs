//! The official Rust client of latchkey, a lock server with fencing tokens (docs/protocol.md §4),
//! and the wire protocol it speaks: [`protocol`], the request and response codec (the server
//! uses it too), and [`tls`], TLS files, the client's configuration and the non-blocking TLS
//! stream of both ends. The `latchkey` command's `lock`, `query` and `ping` are built on it
//! (the `latchkey` package's `cli` module).
//!
//! A [`Client`] is a cheap, cloneable handle (`Send + Sync`) over a small pool of sessions
//! (TCP connections). Many threads call it at once; their requests are pipelined over the
//! sessions and matched to their answers by owner (acquire), token (release, extend) or
//! nonce (query, ping).
//!
//! The client exists to keep one promise: **a caller never believes it holds a lock it may
//! not hold, and an acquire that may have been sent is never sent again.** Hence:
//!
//! * Every [`acquire`](Client::acquire) has one monotonic deadline, from the wait rounded up
//!   to whole milliseconds (a wait of 0 gets the transport timeout, 5 s by default, as its
//!   deadline, and is still a single immediate attempt on the wire). The deadline and the
//!   owner stay the same across retries.
//! * The wire wait is the time left until the deadline, rounded up to whole seconds, computed
//!   by the session's writer just before the bytes go out.
//! * A request counts as *definitely not sent* only while none of its bytes has been handed
//!   to the socket (or its session was refused with `X` code 7). Only such a request is tried
//!   again on another session, with backoff of at most 250 ms, until the deadline — except
//!   after a TLS error in the handshake (a certificate refused by either side), or an answer
//!   that is not latchkey's (a TLS server to a plaintext client), which another attempt would
//!   meet again, and once every listed address refused the TCP connection (nothing listens
//!   there; unless [`ClientConfig::retry_refused`]): the call ends
//!   [`Unavailable`](AcquireError::Unavailable) at once.
//! * At the deadline an unsent request ends [`Timeout`](AcquireError::Timeout) (it waited on
//!   an established session) or [`Unavailable`](AcquireError::Unavailable) (it did not); a
//!   sent, unanswered acquire
//!   gets a Cancel on its session and the single terminal answer decides; a grant found too
//!   late is released at once and the call ends [`Indeterminate`](AcquireError::Indeterminate).
//! * A session is established only after a round trip that carries no request: after the
//!   TCP connect (and TLS) it sends a `P` of its own and nothing else until that `P` comes
//!   back, within [`ClientConfig::connect_timeout`]. A server that accepts but does not
//!   answer (paused: its kernel completes connects from the backlog) is a failed connect:
//!   nothing was sent. An established session whose answers are overdue (a request the
//!   server answers at once — anything but an acquire with a wait — handed at least the
//!   connect timeout ago, and nothing read since) *stalls*: it takes no new call, hands back
//!   what it had not sent, and takes calls again once it reads (docs/protocol.md §4.3).
//! * Cluster members (docs/protocol.md §5): [`ClientConfig::addrs`] lists them, with a pool of
//!   sessions per member. A keyed request goes to its key's cached leader, else the last
//!   leader seen, else the members in turn. An `M` (Moved) is a definite answer that nothing
//!   executed, so the same request (same owner, token or nonce and deadline) goes to the
//!   leader it names, or, with none named, to the next member after a backoff; at most
//!   [`REDIRECTS_MAX`] per call. A call that ends unsent because nothing served it — only
//!   `M`s without a leader, a named leader that could not be reached, more than
//!   [`REDIRECTS_MAX`] `M`s, members unreachable or silent — is
//!   [`Unavailable`](AcquireError::Unavailable) (nothing was executed; not `Timeout`, which
//!   says "held by someone else"), and [`Client::last_unavailable`] says what each member
//!   did. A single node never sends `M`: with one address nothing of this costs more than
//!   one atomic load, and the report is built only when an attempt fails.
//!
//! # Example
//!
//! ```
//! use std::time::Duration;
//! use latchkey_client::{AcquireError, Client};
//!
//! # let mut config = latchkey::config::Config::default();
//! # config.server.listen = "127.0.0.1:0".parse().unwrap();
//! # config.server.cores = 1;
//! # let server = latchkey::node::start(config)?;
//! # let addr = server.local_addr();
//! // `addr` is where a latchkey server listens (here one started in-process).
//! let client = Client::connect(addr)?;
//! let lease = Duration::from_secs(30);
//! let ticket = client.acquire("jobs/nightly", Duration::from_secs(5), lease)?;
//! // The fencing token goes with every write to what the lock protects.
//! let token = ticket.token();
//!
//! // Meanwhile another caller cannot have it.
//! let other = client.acquire("jobs/nightly", Duration::ZERO, lease);
//! assert_eq!(other.unwrap_err(), AcquireError::Timeout);
//!
//! ticket.release()?;
//! # let _ = token;
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```
//!
//! A server that cannot be reached is reported, never guessed at:
//!
//! ```
//! use std::time::Duration;
//! use latchkey_client::{AcquireError, Client, ClientConfig};
//!
//! // Nothing listens on this port: nothing is ever sent, and the call says so.
//! let port = std::net::TcpListener::bind("127.0.0.1:0")?.local_addr()?.port();
//! let client = Client::with_config(ClientConfig {
//!     addrs: vec![([127, 0, 0, 1], port).into()],
//!     ..ClientConfig::default()
//! })?;
//! let wait = Duration::from_millis(300);
//! let result = client.acquire("jobs/nightly", wait, Duration::from_secs(30));
//! assert_eq!(result.unwrap_err(), AcquireError::Unavailable);
//! # Ok::<(), std::io::Error>(())
//! ```
//!
//! # Layout
//!
//! | file | responsibility |
//! |---|---|
//! | `lib.rs` | [`Client`], [`ClientConfig`]: calls, delivery gate |
//! | [`protocol`] | request and response frames: parse in place, encode; error codes. No I/O |
//! | [`tls`] | TLS files, the client's rustls configuration, [`tls::Connector`], [`tls::TlsStream`] |
//! | `ticket.rs` | [`Ticket`]: token, validity bound, extend, release, release on drop |
//! | `error.rs` | [`AcquireError`], [`RequestError`], [`ArgumentError`], [`SessionFailure`] |
//! | [`args`] | checking and rounding keys, waits and leases; the wire wait, margins, ids |
//! | `exchange.rs` | one request's attempts: retrying unsent requests, following `M` |
//! | `report.rs` | [`UnavailableReport`]: what each member did for a call that ended unavailable |
//! | `members.rs` | a pool per member address; the leader cache |
//! | `pool.rs` | the session slots to one address; replacing a failed session |
//! | `session.rs` | one connection: its thread, its inbox, the socket (mio) |
//! | `call.rs` | a call, its outcome, why a session ended |
//! | `pipeline.rs` | one session's requests without I/O: correlation, what deadlines do |
//! | `pipeline/output.rs` | encoding just before the write; the guard of one write attempt |
//! | `pipeline/deadlines.rs` | exact deadlines on the timing wheel, cancelled with their call |
//! | `pipeline/link.rs` | the handshake ping that establishes a session; stalls when silent |
//!
//! Deliberately not here: reconnecting a session in place (a failed session is replaced by a
//! new one), resending anything that may have been sent, and renewing leases on its own.
#![deny(missing_docs)]

use std::io;
use std::net::{SocketAddr, ToSocketAddrs};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::protocol::Response;

pub mod args;
pub mod card;
pub mod protocol;
pub mod tls;

mod call;
mod check;
mod error;
mod exchange;
mod members;
mod pipeline;
mod pool;
mod report;
mod session;
mod ticket;

pub use error::{AcquireError, ArgumentError, RequestError, SessionFailure, SPEAKS_TLS};
pub use exchange::REDIRECTS_MAX;
pub use members::{refused_list, LEADER_CACHE_MAX, MEMBERS_MAX};
pub use report::{MemberState, UnavailableReport};
pub use ticket::{ExtendOutcome, ReleaseOutcome, Ticket};

use args::grace_s;
use call::{Call, Op};
use members::Members;
use pipeline::Identity;
use session::SessionConfig;

/// The server address a client uses when none is given.
pub const DEFAULT_ADDR: &str = "127.0.0.1:7420";
/// The longest pause between two attempts of a request that was definitely not sent.
pub const BACKOFF_MAX: Duration = Duration::from_millis(250);

/// How a [`Client`] connects and how long it waits for the transport.
#[derive(Clone, Debug)]
pub struct ClientConfig {
    /// Server addresses: one server, or the members of a cluster (1..=[`MEMBERS_MAX`],
    /// duplicates ignored). Each gets its own sessions; the first connects when the client
    /// is built, the others on first use. Leaders learned from `M` count against the bound.
    pub addrs: Vec<SocketAddr>,
    /// Whether `addrs` are one server's (one name that resolved to several addresses, as
    /// [`Client::connect`] takes it). Otherwise, with more than one address, each is asked for
    /// its card (`GET /cluster`) and a call sends only to addresses that are members of one
    /// cluster ([`Client::refused_members`] names the others). Default `false`.
    pub one_server: bool,
    /// Sessions (connections) to pipeline calls over, per member address. Default 2.
    pub sessions: usize,
    /// How long a session may take to be established: the TCP connect, the TLS handshake
    /// and the round trip of its handshake ping. Also how long an answer may be overdue
    /// before the session stalls (takes no new call until it reads). Default 2 s.
    pub connect_timeout: Duration,
    /// The transport allowance: the deadline of a wait-0 acquire and of release, extend,
    /// query and ping, and how long a Cancel may stay unanswered. Default 5 s.
    pub transport_timeout: Duration,
    /// Calls waiting to be taken by one session's thread at most. Default 4096.
    pub session_calls_max: usize,
    /// TLS to the server, or `None` (the default) for plaintext.
    pub tls: Option<ClientTls>,
    /// Resumable calls (docs/protocol.md §5): every session identifies as this client, with
    /// this grace (1..=60 s, rounded up to whole seconds), so that a call whose session fails
    /// after its request may have been sent asks another session what became of it instead of
    /// ending `Indeterminate`. `None` turns it off. Default 10 s. A server that does not
    /// resume calls refuses the Identify, and the client keeps to §1–§4 alone with it.
    pub resume: Option<Duration>,
    /// Whether a refused connection (nothing listens at the address: a server down or
    /// restarting) is tried again until the call's deadline, like any other unsent attempt.
    /// Default `false`: a call ends [`Unavailable`](AcquireError::Unavailable) at once when
    /// every listed address refused it (as `flock -n` fails at once); other failures (a
    /// connect that times out, a silent server, `X` 7) are retried either way.
    pub retry_refused: bool,
}

/// How a client speaks TLS to the server.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ClientTls {
    /// The CA that signed the server's certificate, and the client's own certificate and key
    /// (needed when the server sets `tls.client_ca_file`).
    pub files: crate::tls::ClientFiles,
    /// The name the server's certificate must carry; `None`: the address's IP (an IP SAN).
    pub server_name: Option<String>,
}

impl ClientTls {
    /// Reads the files and checks the name: what starts each TLS connection (errors name the
    /// flag and the path or the name).
    pub fn connector(&self) -> io::Result<crate::tls::Connector> {
        crate::tls::Connector::new(&self.files, self.server_name.as_deref())
    }
}

impl Default for ClientConfig {
    fn default() -> Self {
        ClientConfig {
            addrs: vec![DEFAULT_ADDR.parse().expect("a valid socket address")],
            one_server: false,
            sessions: 2,
            connect_timeout: Duration::from_secs(2),
            transport_timeout: Duration::from_secs(5),
            session_calls_max: 4096,
            tls: None,
            resume: Some(Duration::from_secs(10)),
            retry_refused: false,
        }
    }
}

/// The state of a key, as [`Client::query`] reports it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct KeyState {
    /// Whether the key is held.
    pub held: bool,
    /// Time left on the holder's lease (zero when free), rounded down to whole milliseconds.
    pub lease_left: Duration,
    /// Acquires queued on the key.
    pub waiters: u32,
}

/// A handle to a latchkey server: cheap to clone, shared by many threads.
///
/// See the [module docs](self) for what every call promises.
#[derive(Clone)]
pub struct Client {
    shared: Arc<Shared>,
}

struct Shared {
    config: ClientConfig,
    members: Members,
    /// Set by [`Client::interrupt`]; shared with every session.
    interrupted: Arc<AtomicBool>,
}

/// How one request ended on the sessions it was handed to.
#[derive(Clone, Copy, Debug)]
pub(crate) enum Exchange {
    /// A correlated answer.
    Answer {
        response: Response,
        sent_at: Instant,
        read_at: Instant,
    },
    /// The request ended definitely unsent; `serving` says whether it was waiting on an
    /// established session when the deadline passed (else nothing served it: only `M`s,
    /// failed sessions or silence; see `exchange.rs`).
    Unsent { serving: bool },
    /// The request may have reached the server and no answer was delivered.
    Indeterminate,
    /// An acquire that may have been sent, which a Resolve found in no effect and recorded so
    /// that it never will be (docs/protocol.md §5): as if definitely not sent.
    NeverSeen,
}

impl Client {
    /// A client of the server at `addr` with the default configuration. The addresses `addr`
    /// resolves to are taken as one server's ([`ClientConfig::one_server`]).
    ///
    /// Sessions connect in the background: a server that cannot be reached shows up as
    /// [`AcquireError::Unavailable`] (or [`RequestError::Unavailable`]) from the calls.
    pub fn connect(addr: impl ToSocketAddrs) -> io::Result<Client> {
        let addrs: Vec<SocketAddr> = addr.to_socket_addrs()?.collect();
        Client::with_config(ClientConfig {
            addrs,
            one_server: true,
            ..ClientConfig::default()
        })
    }

    /// A client with an explicit configuration. Fails when `addrs` is empty or has more than
    /// [`MEMBERS_MAX`] distinct addresses, `sessions` is 0,
    /// a TLS file cannot be read or used (the error names the flag and the path), or a session
    /// thread cannot be started.
    pub fn with_config(config: ClientConfig) -> io::Result<Client> {
        let interrupted = Arc::new(AtomicBool::new(false));
        let tls = config.tls.as_ref().map(ClientTls::connector).transpose()?;
        let session_config = SessionConfig {
            connect_timeout: config.connect_timeout,
            transport_timeout: config.transport_timeout,
            inbox_calls_max: config.session_calls_max.max(1),
            tls,
            identity: config.resume.map(|grace| Identity {
                client: args::client_id(),
                grace_s: grace_s(grace),
            }),
            resumes: Arc::new(AtomicBool::new(true)),
            interrupted: Arc::clone(&interrupted),
        };
        let members = Members::start(
            &config.addrs,
            !config.one_server,
            config.sessions,
            session_config,
        )?;
        Ok(Client {
            shared: Arc::new(Shared {
                config,
                members,
                interrupted,
            }),
        })
    }

    /// For a client given several addresses: the addresses it will never send to, and what
    /// each is, once every listed address has been asked for its card or `wait` has passed.
    /// When the listed servers are not the members of one cluster (two clusters, a member and
    /// a standalone server, a server without a card), that is every listed address: the client
    /// sends nothing to any of them. Also a leader an `M` named that is not the cluster's.
    /// Empty for one address, and when the list is one cluster's (or is not decided yet). A
    /// program that was given a list should refuse to go on when this is not empty.
    pub fn refused_members(&self, wait: Duration) -> Vec<(SocketAddr, String)> {
        self.shared.members.refused(wait)
    }

    /// Ends every acquire of this client, waiting or to come, as soon as its server lets it:
    /// for a program that was told to stop while it waits for a lock (a signal, a shutdown).
    /// An acquire queued on a server is withdrawn (Cancel) and ends
    /// [`Timeout`](AcquireError::Timeout) — or, when the grant came first, `Ok` with its
    /// ticket, which the caller releases (or drops); one not sent yet is not sent. Every
    /// acquire after this ends `Timeout` without being sent. Releases, extends, queries and
    /// pings go on as before. Without it, a waiter whose program exits stays queued on the
    /// server for the client's grace ([`ClientConfig::resume`]), as if its connection had been
    /// cut, and may be granted meanwhile.
    ///
    /// ```
    /// use std::time::Duration;
    /// use latchkey_client::{AcquireError, Client};
    /// # let mut config = latchkey::config::Config::default();
    /// # config.server.listen = "127.0.0.1:0".parse().unwrap();
    /// # config.server.cores = 1;
    /// # let server = latchkey::node::start(config)?;
    /// # let client = Client::connect(server.local_addr())?;
    /// let waiter = client.clone();
    /// let held = client.acquire("k", Duration::ZERO, Duration::from_secs(30))?;
    /// let wait = std::thread::spawn(move || {
    ///     waiter.acquire("k", Duration::from_secs(60), Duration::from_secs(30))
    /// });
    /// # while client.query("k")?.waiters == 0 { std::thread::sleep(Duration::from_millis(5)); }
    /// client.interrupt(); // e.g. on SIGTERM
    /// assert_eq!(wait.join().unwrap().unwrap_err(), AcquireError::Timeout);
    /// assert_eq!(client.query("k")?.waiters, 0);
    /// drop(held);
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn interrupt(&self) {
        self.shared.interrupted.store(true, Ordering::Relaxed);
        self.shared.members.wake_all();
    }

    /// Whether [`Client::interrupt`] was called.
    pub fn is_interrupted(&self) -> bool {
        self.shared.interrupted.load(Ordering::Relaxed)
    }

    /// The configuration this client was built with.
    pub fn config(&self) -> &ClientConfig {
        &self.shared.config
    }

    /// Why the latest of this client's sessions that ended without the client ending it did:
    /// the address and the cause (connect refused, not a latchkey server, closed by the
    /// server...). `None` while none has. For messages to a person: with many threads it may
    /// belong to another thread's call, and it stays after later sessions succeed. The
    /// results of the calls themselves are unchanged (docs/protocol.md §4.1).
    pub fn last_session_failure(&self) -> Option<SessionFailure> {
        self.shared.members.last_failure()
    }

    /// What each member did for the latest of this client's calls that ended unavailable
    /// ([`AcquireError::Unavailable`], [`RequestError::Unavailable`]): answered that it knows
    /// no leader, named a leader, could not be reached (and why), or was silent. Its `Display`
    /// says it in one line, e.g. `no leader for this key: 1 of 3 members reachable, no quorum
    /// (...)`. `None` while no call ended so. For messages to a person, like
    /// [`last_session_failure`](Self::last_session_failure): with many threads it may belong
    /// to another thread's call, and it stays after later calls succeed.
    pub fn last_unavailable(&self) -> Option<UnavailableReport> {
        self.shared.members.last_unavailable()
    }

    /// Takes the lock on `key`, waiting at most `wait` for it, holding it at most `lease`.
    ///
    /// `wait` is rounded up to whole milliseconds (at most 255 s); `lease` up to whole seconds
    /// (1..=255 s). A `wait` of zero is a single immediate attempt. The results are exactly
    /// those of docs/protocol.md §4.1; see [`AcquireError`].
    ///
    /// ```
    /// use std::time::Duration;
    /// use latchkey_client::{AcquireError, Client};
    /// # let mut config = latchkey::config::Config::default();
    /// # config.server.listen = "127.0.0.1:0".parse().unwrap();
    /// # config.server.cores = 1;
    /// # let server = latchkey::node::start(config)?;
    /// # let client = Client::connect(server.local_addr())?;
    ///
    /// match client.acquire("reports/daily", Duration::from_millis(200), Duration::from_secs(10)) {
    ///     Ok(ticket) => println!("token {}", ticket.token()), // dropped: released
    ///     Err(AcquireError::Timeout | AcquireError::Busy) => println!("someone else has it"),
    ///     Err(AcquireError::Indeterminate) => println!("unknown: do not enter; retry later"),
    ///     Err(other) => println!("no lock: {other}"),
    /// }
    /// # Ok::<(), std::io::Error>(())
    /// ```
    pub fn acquire(
        &self,
        key: &str,
        wait: Duration,
        lease: Duration,
    ) -> Result<Ticket, AcquireError> {
        args::check_key(key)?;
        let wait_ms = args::wait_ms(wait)?;
        let lease_s = args::lease_s(lease)?;
        let wait_zero = wait_ms == 0;
        let allowance = if wait_zero {
            self.config().transport_timeout
        } else {
            Duration::from_millis(wait_ms)
        };
        let deadline = Instant::now() + allowance;
        let key: Arc<str> = Arc::from(key);
        // Bounded by the deadline: only a "never seen" (nothing executed, and nothing will be)
        // sends the acquire again, under a new owner, and only while time is left.
        loop {
            let op = Op::Acquire {
                key: Arc::clone(&key),
                wait_zero,
                lease_s,
                owner: args::next_id(),
            };
            let exchange = self.exchange(op, deadline);
            let interrupted = self.is_interrupted();
            if matches!(exchange, Exchange::NeverSeen) && Instant::now() < deadline && !interrupted
            {
                log::debug!("an acquire of {key} was never seen: sent again, as a new one");
                continue;
            }
            return self.settle_acquire(exchange, key, lease_s, deadline, Instant::now());
        }
    }

    /// Turns how an acquire's request ended into the call's result. `now` is the delivery
    /// gate: a grant delivered at or after the deadline is released and ends `Indeterminate`.
    fn settle_acquire(
        &self,
        exchange: Exchange,
        key: Arc<str>,
        lease_s: u8,
        deadline: Instant,
        now: Instant,
    ) -> Result<Ticket, AcquireError> {
        let response = match exchange {
            Exchange::Answer {
                response, read_at, ..
            } => (response, read_at),
            Exchange::Unsent { serving: true } => return Err(AcquireError::Timeout),
            Exchange::Unsent { serving: false } => return Err(AcquireError::Unavailable),
            Exchange::Indeterminate => return Err(AcquireError::Indeterminate),
            // Nothing of it stands, and the deadline passed: as a wait that ran out.
            Exchange::NeverSeen => return Err(AcquireError::Timeout),
        };
        if let (
            Response::Resolved {
                token, lease_ms, ..
            },
            _,
        ) = response
        {
            if now >= deadline {
                self.release_in_background(key, token);
                return Err(AcquireError::Indeterminate);
            }
            let (sent_at, left) = (
                resolved_at(exchange),
                Duration::from_millis(lease_ms.into()),
            );
            return Ok(Ticket::resumed(
                self.clone(),
                key,
                token,
                lease_s,
                sent_at,
                left,
            ));
        }
        match response {
            (Response::Acquired { token, .. }, _) if now >= deadline => {
                self.release_in_background(key, token);
                Err(AcquireError::Indeterminate)
            }
            (Response::Acquired { token, .. }, read_at) => {
                Ok(Ticket::new(self.clone(), key, token, lease_s, read_at))
            }
            (Response::Timeout { .. }, _) => Err(AcquireError::Timeout),
            (Response::Busy { .. }, _) => Err(AcquireError::Busy),
            (Response::Error { code, .. }, _) => Err(AcquireError::Rejected(code)),
            (other, _) => {
                log::warn!("unexpected answer {other:?} to an acquire");
                Err(AcquireError::Indeterminate)
            }
        }
    }

    /// Reports whether `key` is held, the time left on its lease and how many wait for it.
    ///
    /// ```
    /// use std::time::Duration;
    /// # let mut config = latchkey::config::Config::default();
    /// # config.server.listen = "127.0.0.1:0".parse().unwrap();
    /// # config.server.cores = 1;
    /// # let server = latchkey::node::start(config)?;
    /// # let client = latchkey_client::Client::connect(server.local_addr())?;
    /// let ticket = client.acquire("k", Duration::ZERO, Duration::from_secs(10))?;
    /// let state = client.query("k")?;
    /// assert!(state.held && state.lease_left <= Duration::from_secs(10));
    /// drop(ticket);
    /// assert!(client.ping()? < Duration::from_secs(5));
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn query(&self, key: &str) -> Result<KeyState, RequestError> {
        args::check_key(key)?;
        let op = Op::Query {
            key: Arc::from(key),
            nonce: args::next_id(),
        };
        match self.exchange_small(op)? {
            (
                Response::State {
                    held,
                    lease_ms,
                    waiters,
                    ..
                },
                _,
            ) => {
                let lease_left = Duration::from_millis(u64::from(lease_ms));
                Ok(KeyState {
                    held,
                    lease_left,
                    waiters,
                })
            }
            (other, _) => {
                log::warn!("unexpected answer {other:?} to a query");
                Err(RequestError::NoAnswer)
            }
        }
    }

    /// Checks that a server answers; returns the time until its answer was read.
    pub fn ping(&self) -> Result<Duration, RequestError> {
        let start = Instant::now();
        match self.exchange_small(Op::Ping {
            nonce: args::next_id(),
        })? {
            (Response::Pong { .. }, _) => Ok(start.elapsed()),
            (other, _) => {
                log::warn!("unexpected answer {other:?} to a ping");
                Err(RequestError::NoAnswer)
            }
        }
    }

    /// Releases `token` without waiting, on a session to the key's route (compensation and
    /// dropped tickets). It does not follow an `M`: the lease recovers such a hold.
    pub(crate) fn release_in_background(&self, key: Arc<str>, token: u64) {
        let deadline = Instant::now() + self.config().transport_timeout;
        let call = Call {
            op: Op::Release { key, token },
            deadline,
            reply: None,
            attempts: 0,
        };
        self.shared.members.submit_background(call);
    }
}

/// When the request of an answered exchange was sent.
fn resolved_at(exchange: Exchange) -> Instant {
    match exchange {
        Exchange::Answer { sent_at, .. } => sent_at,
        _ => Instant::now(),
    }
}

impl std::fmt::Debug for Client {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Client")
            .field("addrs", &self.config().addrs)
            .finish_non_exhaustive()
    }
}

#[cfg(test)]
mod tests;
