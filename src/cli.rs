//! The client on the command line: `latchkey lock`, `query` and `ping` (here and in
//! `cli/ping.rs`), and `latchkey stats` and `keys`, the admin requests (`cli/admin.rs`).
//!
//! `latchkey lock [--server ADDR] [--transport-timeout 5s] [--retry-refused] [--wait 10s]
//! [--lease 30s] [--grace 5s] [--conflict-exit-code N] [--failure-exit-code N] [--quiet] KEY --
//! CMD [ARGS..]`
//! takes the lock, runs CMD with `LATCHKEY_KEY` and `LATCHKEY_TOKEN` in its environment,
//! extends the lease every lease/3 while CMD runs, releases the lock when CMD exits and exits
//! with CMD's status. If the lease is lost (the server says the token no longer holds the key,
//! or the ticket's validity bound passes without a confirmed extend), CMD gets SIGTERM, then
//! SIGKILL after the grace, and `latchkey lock` exits [`EXIT_LEASE_LOST`]. SIGINT, SIGTERM and
//! SIGHUP received by `latchkey lock` are forwarded to CMD (caught from the start: before CMD
//! runs, one withdraws the acquire, or releases the lock, and ends `latchkey lock` with
//! 128 + N: CMD never runs). CMD never outlives `latchkey lock`:
//! however it dies, the kernel kills CMD, and without a controlling terminal CMD's whole
//! process group (`cli/child.rs`); [`LOCK_HELP`] says what each signal does.
//!
//! `latchkey query [--json] KEY` prints `held=0|1 lease_ms=N waiters=N`, or with `--json`
//! `{"key":...,"held":bool,"lease_ms":N,"waiters":N}`. `latchkey ping [--count N]
//! [--interval 1s] [--json]` sends N pings `--interval` apart, prints a line per pong and, for
//! more than one, a summary like ping(8) (see [`run_ping_command`]). `latchkey stats` and
//! `latchkey keys` are described in [`run_stats`] and [`run_keys`].
//!
//! Every command's `--server` (a server, or a cluster's members as `a,b,c`; see
//! [`parse_servers`]) defaults to `LATCHKEY_SERVER`, then `127.0.0.1:7420`; its
//! `--transport-timeout` (5 s) is the transport allowance of docs/protocol.md §4 (with N members,
//! each member's connect — TCP, TLS and a ping round trip — gets 1/N of it: see
//! [`connect_timeout`]). Every command fails at once when every member refused the connection
//! (nothing listens there), like `flock -n`; `--retry-refused` keeps trying until the
//! allowance runs out (`ClientConfig::retry_refused`). Durations are one syntax everywhere
//! ([`parse_duration`]). Messages name the server's address and why its session failed when
//! the client knows ([`Client::last_session_failure`]), how long the call tried, and show at
//! most the first 64 characters of a key ([`shown_key`]); `cli/messages.rs` builds them.
//!
//! Exit codes (the same for `query`, `ping`, `stats` and `keys` where they apply):
//!
//! | code | meaning |
//! |---|---|
//! | CMD's | CMD ran under the lock and exited with this status |
//! | 128 + N | CMD was killed by signal N |
//! | 2 | usage: bad arguments (as for every command-line error) |
//! | 80 | held by someone else: not acquired within `--wait` (`--conflict-exit-code N`: N) |
//! | 81 | busy: the server refused for capacity or shutdown |
//! | 82 | indeterminate: the request may have reached the server, no definitive answer |
//! | 83 | unavailable: nothing executed; no server answers, or none leads the key (says which) |
//! | 84 | rejected: the server refused the request (`stats`, `keys`: not a 200 with JSON) |
//! | 85 | lease lost while CMD ran; CMD was signalled |
//! | 126, 127 | CMD could not be run / was not found (the lock was released) |
//!
//! `latchkey lock --failure-exit-code N` exits N in place of each code of its own (all but
//! CMD's status and a conflict's `--conflict-exit-code`; usage errors included, see
//! [`lock_failure_exit_code`]), so that a script can tell CMD's exit 2 from a usage error.
//!
//! A key the server refuses to this client's identity (`X` 8, where the server has
//! authorization rules) is such a refusal: exit 84, and the message names the key and says it
//! is forbidden for this identity ([`FORBIDDEN_TEXT`]).
//!
//! Deliberately not here: retrying the whole command (a caller decides, from the exit code).

use std::ffi::OsString;
use std::io;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::ExitCode;
use std::thread;
use std::time::{Duration, Instant};

use crossbeam_channel::RecvTimeoutError;

use latchkey_client::tls::ClientFiles;
use latchkey_client::{
    AcquireError, Client, ClientConfig, ClientTls, KeyState, RequestError, SessionFailure, Ticket,
    DEFAULT_ADDR,
};

mod admin;
mod child;
mod cluster;
mod cluster_backup;
mod duration;
mod messages;
mod ping;
mod servers;
mod supervise;

pub use servers::{parse_server_items, parse_servers, ServerListError};

pub use admin::{run_keys, run_stats, KeysArgs, StatsArgs};
pub use child::{enable_lock_guard, run_lock_guard, GuardArgs};
pub use cluster::{run_cluster, ClusterCommand, ClusterLeaderArgs, ClusterStatusArgs};
pub use cluster_backup::ClusterBackupArgs;
pub use duration::{format_duration, parse_duration};
use messages::{acquire_message, allowance_text, request_message, Tried};
pub use ping::{run_ping, run_ping_command, PingCommand};
use supervise::{release, signal_name, supervise, Caught};

/// Exit code for bad arguments (the code clap uses for its own usage errors).
pub const EXIT_USAGE: u8 = 2;
/// Exit code when the lock was not acquired within `--wait`.
pub const EXIT_TIMEOUT: u8 = 80;
/// Exit code when the server answered busy (capacity or shutdown).
pub const EXIT_BUSY: u8 = 81;
/// Exit code when the request may have reached the server and no definitive answer came.
pub const EXIT_INDETERMINATE: u8 = 82;
/// Exit code when nothing was executed because no server could take the request: none could
/// be reached, or a cluster had no leader for the key.
pub const EXIT_UNAVAILABLE: u8 = 83;
/// Exit code when the server refused the request with an error code (`X`), among them 8: the
/// key is forbidden for this client's identity.
pub const EXIT_REJECTED: u8 = 84;
/// Exit code when the lease was lost while CMD ran (CMD was signalled).
pub const EXIT_LEASE_LOST: u8 = 85;
/// Exit code of `latchkey cluster status` when every member answered but the cluster is not
/// whole: a member refuses another or is refused, has no quorum, lags, is not a member of the
/// cluster the others form, or two answer as the same member.
pub const EXIT_UNHEALTHY: u8 = 86;
/// Exit code when CMD exists but could not be executed.
pub const EXIT_CANNOT_EXECUTE: u8 = 126;
/// Exit code when CMD was not found.
pub const EXIT_NOT_FOUND: u8 = 127;

/// What a keyed command says, after the key, when the server refuses the key to this client's
/// identity (`X` 8, [`latchkey_client::protocol::ErrorCode::Forbidden`]):
/// `latchkey lock: jobs/a: the key is forbidden ...`.
pub const FORBIDDEN_TEXT: &str = "the key is forbidden for this identity (X 8): the server's \
                                  rules do not let this client use it";

/// What `latchkey lock --help` says after the flags: what each signal does.
pub const LOCK_HELP: &str = "\
Signals:
  SIGINT, SIGTERM, SIGHUP  while CMD runs: forwarded to CMD; the lock is released when
                           CMD exits, and latchkey lock exits with CMD's status. Before:
                           CMD never runs, the waiting acquire is withdrawn (or the lock,
                           if granted, released), and latchkey lock exits 128 + N (at once
                           after 2 s without an answer, or on a second signal)
  SIGKILL, or any other    the kernel kills CMD at once (PR_SET_PDEATHSIG): CMD never runs
  death of latchkey lock   on without the lock. The lock is not released: its lease ends
                           it. Without a controlling terminal (cron, systemd, setsid) CMD
                           runs in a process group of its own and a guard process kills the
                           whole group, so nothing CMD started runs on either; with one, CMD
                           shares latchkey lock's group and terminal, as under flock(1), and
                           only CMD itself is killed
  SIGSTOP                  CMD runs on while latchkey lock is stopped and extends nothing;
                           after SIGCONT, a lease that ran out meanwhile counts as lost
  lease lost               CMD gets SIGTERM, then SIGKILL after --grace (its whole group
                           without a terminal); latchkey lock releases the lock (in case
                           the server still has it) and exits 85

Exit codes:
  CMD's status  CMD ran under the lock (128 + N: CMD was killed by signal N)
  2         usage: bad arguments
  80        held by someone else: not acquired within --wait (N with --conflict-exit-code N)
  81        busy: the server is at a capacity limit or shutting down
  82        indeterminate: the acquire may have reached the server, no definitive answer
  83        unavailable: nothing was executed (no server reachable, no leader for the key)
  84        rejected: the server refused the request (e.g. the key is forbidden)
  85        the lease was lost while CMD ran; CMD was signalled
  126, 127  CMD could not be executed / was not found (the lock was released)
With --failure-exit-code N, latchkey lock exits N instead of each of these but CMD's status
(and a conflict's --conflict-exit-code), so that a script can tell CMD's exit 2 from a usage
error.";

/// An acquire allowed at least this long says at once that it cannot connect (and retries).
const NOTICE_ALLOWANCE_MIN: Duration = Duration::from_secs(1);
/// How long `latchkey lock`, interrupted while it acquires, waits for the acquire to end (its
/// waiter withdrawn: one round trip to a live server) before it exits anyway.
const INTERRUPT_PATIENCE: Duration = Duration::from_secs(2);
/// How often `latchkey lock` looks for a failed connect while its acquire waits.
const NOTICE_POLL: Duration = Duration::from_millis(50);

/// Where the server is and how long its transport may take: shared by every client command.
#[derive(clap::Args, Debug, Clone)]
pub struct ConnectArgs {
    /// Server address (host:port), or a cluster's members as a comma-separated list
    /// (a:7420,b:7420,c:7420); defaults to LATCHKEY_SERVER when it is set, else
    /// 127.0.0.1:7420. `stats`, `keys` and `cluster` ask every member and merge what they
    /// answer.
    // The environment is read here, as the default, rather than with clap's `env`: an argument
    // taken from the environment shows in usage messages as if it were required.
    #[arg(long, default_value_t = default_server(), hide_default_value = true)]
    pub server: String,
    /// How long the transport may take: a connect (TCP, TLS and a ping round trip; with N
    /// members in --server, each gets 1/N of it), the answer to a release, extend, query or
    /// ping, a `--wait 0` acquire, and the answer to the Cancel sent when `--wait` runs out.
    #[arg(long, default_value = "5s", value_parser = parse_transport_timeout)]
    pub transport_timeout: Duration,
    /// Keep trying a refused connection (nothing listens: a server restarting) until --wait
    /// (or --transport-timeout) runs out. Without it a command fails at once, like `flock -n`,
    /// when every member in --server refused; other failures are retried either way.
    #[arg(long)]
    pub retry_refused: bool,
    /// TLS to the server.
    #[command(flatten)]
    pub tls: TlsArgs,
}

/// `--server`'s default: `LATCHKEY_SERVER` when it is set (and not empty), else
/// [`DEFAULT_ADDR`].
fn default_server() -> String {
    std::env::var("LATCHKEY_SERVER")
        .ok()
        .filter(|server| !server.trim().is_empty())
        .unwrap_or_else(|| DEFAULT_ADDR.to_owned())
}

/// The path in environment variable `name`, when it is set and not empty.
fn env_path(name: &str) -> Option<PathBuf> {
    std::env::var_os(name)
        .filter(|path| !path.is_empty())
        .map(PathBuf::from)
}

/// TLS to the server: shared by every client command and `latchkey bench`. Each flag defaults
/// to its environment variable, read by [`TlsArgs::client_tls`] (not by clap, whose usage
/// messages would show a flag taken from the environment as required).
#[derive(clap::Args, Debug, Clone, Default)]
pub struct TlsArgs {
    /// Speak TLS, trusting the CA certificates (PEM) in FILE for the server's certificate
    /// [env: LATCHKEY_TLS_CA].
    #[arg(long, value_name = "FILE")]
    pub tls_ca: Option<PathBuf>,
    /// With --tls-ca: present this certificate chain (PEM), for a server that requires one
    /// [env: LATCHKEY_TLS_CERT].
    #[arg(long, value_name = "FILE")]
    pub tls_cert: Option<PathBuf>,
    /// The private key (PEM) of --tls-cert [env: LATCHKEY_TLS_KEY].
    #[arg(long, value_name = "FILE")]
    pub tls_key: Option<PathBuf>,
    /// With --tls-ca: the name the server's certificate must carry, when the address (an IP
    /// SAN by default) is not in it.
    #[arg(long, value_name = "NAME")]
    pub tls_server_name: Option<String>,
}

impl ConnectArgs {
    /// `--server ADDR` with the default transport timeout.
    pub fn new(server: impl Into<String>) -> ConnectArgs {
        ConnectArgs {
            server: server.into(),
            transport_timeout: ClientConfig::default().transport_timeout,
            retry_refused: false,
            tls: TlsArgs::default(),
        }
    }

    /// The client's TLS settings (see [`TlsArgs::client_tls`]).
    pub fn tls(&self) -> Result<Option<ClientTls>, String> {
        self.tls.client_tls()
    }
}

impl TlsArgs {
    /// The client's TLS settings: `None` without `--tls-ca` (or `LATCHKEY_TLS_CA`); a usage
    /// error when a TLS flag is given without it, or a certificate without its key. A flag
    /// wins over its environment variable.
    pub fn client_tls(&self) -> Result<Option<ClientTls>, String> {
        let with_env = TlsArgs {
            tls_ca: self.tls_ca.clone().or_else(|| env_path("LATCHKEY_TLS_CA")),
            tls_cert: self
                .tls_cert
                .clone()
                .or_else(|| env_path("LATCHKEY_TLS_CERT")),
            tls_key: self
                .tls_key
                .clone()
                .or_else(|| env_path("LATCHKEY_TLS_KEY")),
            tls_server_name: self.tls_server_name.clone(),
        };
        with_env.client_tls_as_given()
    }

    /// [`client_tls`](Self::client_tls) of the flags alone.
    fn client_tls_as_given(&self) -> Result<Option<ClientTls>, String> {
        let Some(ca_file) = &self.tls_ca else {
            let flags = [
                (self.tls_cert.is_some(), "--tls-cert"),
                (self.tls_key.is_some(), "--tls-key"),
                (self.tls_server_name.is_some(), "--tls-server-name"),
            ];
            return match flags.into_iter().find(|(given, _)| *given) {
                Some((_, flag)) => Err(format!("{flag} needs --tls-ca (TLS is off without it)")),
                None => Ok(None),
            };
        };
        let cert_and_key = match (&self.tls_cert, &self.tls_key) {
            (Some(cert), Some(key)) => Some((cert.clone(), key.clone())),
            (None, None) => None,
            _ => return Err("--tls-cert and --tls-key go together".to_string()),
        };
        let files = ClientFiles {
            ca_file: ca_file.clone(),
            cert_and_key,
        };
        let server_name = self.tls_server_name.clone();
        Ok(Some(ClientTls { files, server_name }))
    }
}

/// Arguments of `latchkey lock`.
#[derive(clap::Args, Debug, Clone)]
pub struct LockArgs {
    /// The server and its transport timeout.
    #[command(flatten)]
    pub connect: ConnectArgs,
    /// How long to wait for the lock, e.g. 10s, 500ms, 2m; 0 is one immediate attempt.
    #[arg(long, default_value = "10s", value_parser = parse_wait)]
    pub wait: Duration,
    /// The lease, 1s to 255s; it is extended every lease/3 while CMD runs.
    #[arg(long, default_value = "30s", value_parser = parse_lease)]
    pub lease: Duration,
    /// How long CMD has between SIGTERM and SIGKILL once the lease is lost.
    #[arg(long, default_value = "5s", value_parser = parse_duration)]
    pub grace: Duration,
    /// Exit N, instead of 80, when the lock is held by someone else (like `flock -E N`).
    #[arg(long, value_name = "N")]
    pub conflict_exit_code: Option<u8>,
    /// Exit N whenever latchkey lock itself fails (2, 80-85, 126, 127: the lock not taken,
    /// the lease lost, CMD not run), so that every other status is CMD's own; pick an N that
    /// CMD never exits with. A conflict exits --conflict-exit-code when that is given.
    #[arg(long, value_name = "N")]
    pub failure_exit_code: Option<u8>,
    /// Say nothing when the lock is held by someone else, nor that the lease was rounded up
    /// (errors are still said).
    #[arg(long, short)]
    pub quiet: bool,
    /// The lock's name.
    #[arg(value_parser = KeyParser)]
    pub key: String,
    /// The command to run under the lock, after `--`.
    #[arg(last = true, required = true, value_name = "CMD")]
    pub command: Vec<OsString>,
}

/// Arguments of `latchkey query`.
#[derive(clap::Args, Debug, Clone)]
pub struct QueryArgs {
    /// The server and its transport timeout.
    #[command(flatten)]
    pub connect: ConnectArgs,
    /// The lock's name.
    #[arg(value_parser = KeyParser)]
    pub key: String,
}

/// `latchkey query` as the command line gives it: the query and how to print its answer.
#[derive(clap::Args, Debug, Clone)]
pub struct QueryCommand {
    /// The server and the key.
    #[command(flatten)]
    pub query: QueryArgs,
    /// Text or JSON.
    #[command(flatten)]
    pub output: OutputArgs,
}

/// How a client command prints its result: text for people, or JSON for programs.
#[derive(clap::Args, Debug, Clone, Copy, Default)]
pub struct OutputArgs {
    /// Print the result as JSON instead of text.
    #[arg(long)]
    pub json: bool,
}

/// Arguments of `latchkey ping`.
#[derive(clap::Args, Debug, Clone)]
pub struct PingArgs {
    /// The server and its transport timeout.
    #[command(flatten)]
    pub connect: ConnectArgs,
    /// How many pings to send, `--interval` apart.
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u32).range(1..=1000))]
    pub count: u32,
}

fn parse_wait(text: &str) -> Result<Duration, String> {
    let wait = parse_duration(text)?;
    latchkey_client::args::wait_ms(wait).map_err(|error| error.to_string())?;
    Ok(wait)
}

fn parse_lease(text: &str) -> Result<Duration, String> {
    let lease = parse_duration(text)?;
    latchkey_client::args::lease_s(lease).map_err(|error| error.to_string())?;
    Ok(lease)
}

fn parse_transport_timeout(text: &str) -> Result<Duration, String> {
    let timeout = parse_duration(text)?;
    if timeout.is_zero() {
        return Err("the transport timeout must be more than 0".into());
    }
    Ok(timeout)
}

/// Keys in messages: at most this many characters of them.
const KEY_SHOWN_CHARS_MAX: usize = 64;

/// A key as messages show it: control characters escaped, and a long key cut to its first
/// 64 characters followed by its length, so that an error about a
/// 2,000-byte key is one short line.
///
/// ```
/// use latchkey::cli::shown_key;
///
/// assert_eq!(shown_key("jobs/a"), "jobs/a");
/// assert_eq!(shown_key("a\nb"), "a\\nb");
/// let long = "k".repeat(2000);
/// assert_eq!(shown_key(&long), format!("{}… (2000 bytes)", "k".repeat(64)));
/// ```
pub fn shown_key(key: &str) -> String {
    let mut shown = String::new();
    for c in key.chars().take(KEY_SHOWN_CHARS_MAX) {
        if c.is_control() {
            shown.extend(c.escape_debug());
        } else {
            shown.push(c);
        }
    }
    if key.chars().nth(KEY_SHOWN_CHARS_MAX).is_some() {
        shown.push_str(&format!("… ({} bytes)", key.len()));
    }
    shown
}

/// Parses KEY without echoing it whole: clap's own message for a refused value repeats the
/// value, which for a long key is a wall of text.
#[derive(Clone, Copy, Debug)]
struct KeyParser;

impl clap::builder::TypedValueParser for KeyParser {
    type Value = String;

    fn parse_ref(
        &self,
        command: &clap::Command,
        _arg: Option<&clap::Arg>,
        value: &std::ffi::OsStr,
    ) -> Result<String, clap::Error> {
        let refuse = |message: String| {
            let kind = clap::error::ErrorKind::ValueValidation;
            clap::Error::raw(kind, format!("invalid KEY {message}\n")).with_cmd(command)
        };
        let Some(text) = value.to_str() else {
            return Err(refuse("(not valid UTF-8)".into()));
        };
        match latchkey_client::args::check_key(text) {
            Ok(()) => Ok(text.to_owned()),
            Err(error) => Err(refuse(format!("`{}`: {error}", shown_key(text)))),
        }
    }
}

/// The exit code for an acquire that did not return a ticket.
pub fn acquire_exit_code(error: &AcquireError) -> u8 {
    match error {
        AcquireError::Timeout => EXIT_TIMEOUT,
        AcquireError::Busy => EXIT_BUSY,
        AcquireError::Rejected(_) => EXIT_REJECTED,
        AcquireError::Unavailable => EXIT_UNAVAILABLE,
        AcquireError::Indeterminate => EXIT_INDETERMINATE,
        AcquireError::InvalidArgument(_) => EXIT_USAGE,
    }
}

/// The exit code for a query or ping that got no answer.
pub fn request_exit_code(error: &RequestError) -> u8 {
    match error {
        RequestError::Unavailable => EXIT_UNAVAILABLE,
        RequestError::NoAnswer => EXIT_INDETERMINATE,
        RequestError::Rejected(_) => EXIT_REJECTED,
        RequestError::InvalidArgument(_) => EXIT_USAGE,
    }
}

/// The addresses `--server` names (every item of its list; at least one), or the exit code
/// after saying why there are none: a malformed item is a usage error, a name that does not
/// resolve is unavailable.
fn server_addrs(command: &str, connect: &ConnectArgs) -> Result<Vec<SocketAddr>, u8> {
    parse_servers(&connect.server).map_err(|failure| say_servers_failure(command, &failure))
}

/// Says which `--server` item is wrong; the exit code: usage for a malformed one.
fn fail_servers(command: &str, failure: &ServerListError) -> ExitCode {
    ExitCode::from(say_servers_failure(command, failure))
}

/// Says which `--server` item is wrong; the exit code as a number.
fn say_servers_failure(command: &str, failure: &ServerListError) -> u8 {
    eprintln!("latchkey {command}: --server {failure}");
    let usage = failure.error.kind() == io::ErrorKind::InvalidInput;
    if usage {
        EXIT_USAGE
    } else {
        EXIT_UNAVAILABLE
    }
}

/// How long one member may take to connect (TCP, TLS and the handshake ping) for a client of
/// `members` distinct addresses: an equal share of the transport timeout, so that a paused
/// member (its kernel accepts connections, nothing answers) costs a call only its share and
/// the others are tried within the transport timeout. One server gets all of it.
pub fn connect_timeout(transport_timeout: Duration, members: usize) -> Duration {
    transport_timeout / u32::try_from(members.max(1)).unwrap_or(u32::MAX)
}

/// The client of the command-line tools: one session per member; the connect timeout is the
/// member's share of the transport timeout ([`connect_timeout`]).
fn cli_client(command: &str, connect: &ConnectArgs) -> Result<(Client, SocketAddr), u8> {
    let addrs = server_addrs(command, connect)?;
    let tls = connect.tls().map_err(|message| {
        eprintln!("latchkey {command}: {message}");
        EXIT_USAGE
    })?;
    let mut distinct = addrs.clone();
    distinct.sort_unstable();
    distinct.dedup();
    // One item of the list (a name that may resolve to several addresses) is one server.
    let items = parse_server_items(&connect.server).map_or(0, |items| items.len());
    let config = ClientConfig {
        addrs: addrs.clone(),
        one_server: items == 1,
        sessions: 1,
        connect_timeout: connect_timeout(connect.transport_timeout, distinct.len()),
        transport_timeout: connect.transport_timeout,
        tls,
        retry_refused: connect.retry_refused,
        ..ClientConfig::default()
    };
    match Client::with_config(config) {
        Ok(client) => Ok((client, addrs[0])),
        Err(error) => {
            eprintln!("latchkey {command}: {error}");
            Err(EXIT_UNAVAILABLE)
        }
    }
}

/// Refuses a server list that mixes clusters (`Client::refused_members`): the error names each
/// address refused and what it is, with [`EXIT_USAGE`]. Asked after the command's call, which
/// sent nothing before the list was decided, so it waits for nothing (a paused member's card
/// never comes): a refused list made the call `Unavailable` with nothing sent. An address a
/// redirect named is refused alone, and a command that got its answer from the others still
/// fails then: a member hands out a wrong address.
fn refuse_mixed_list(command: &str, client: &Client) -> Result<(), u8> {
    let refused = client.refused_members(Duration::ZERO);
    if refused.is_empty() {
        return Ok(());
    }
    for (addr, why) in &refused {
        eprintln!("latchkey {command}: {addr}: {why}");
    }
    eprintln!(
        "latchkey {command}: nothing was sent: a list of servers must name the members of one \
         cluster (or one server), as their cards (GET /cluster) say"
    );
    Err(EXIT_USAGE)
}

/// Acquires for `latchkey lock`. When the acquire may take a while, the first failed connect is
/// said at once (the client keeps retrying until the deadline, docs/protocol.md §4.2), rather than
/// only when the whole wait has run out. A `caught` signal while the acquire is in flight
/// interrupts the client (`Client::interrupt`: a waiter is withdrawn, so it is not left queued
/// on the server) and is handed back to `caught`, for the caller to see once the acquire
/// returns; should that take longer than [`INTERRUPT_PATIENCE`], or a second signal come,
/// `latchkey lock` ends at once with 128 + the signal's number.
fn acquire_with_notice(
    client: &Client,
    args: &LockArgs,
    caught: Option<&Caught>,
) -> Result<Ticket, AcquireError> {
    let allowance = if args.wait.is_zero() {
        args.connect.transport_timeout
    } else {
        args.wait
    };
    let (done_tx, done) = crossbeam_channel::bounded::<()>(0);
    let acquiring = parking_lot::Mutex::new(true);
    thread::scope(|scope| {
        if let Some(caught) = caught {
            let (done, acquiring) = (done.clone(), &acquiring);
            scope.spawn(move || {
                let signal = crossbeam_channel::select! {
                    recv(caught.receiver()) -> signal => match signal {
                        Ok(signal) => signal,
                        Err(_) => return,
                    },
                    recv(done) -> _ => return,
                };
                // Handed back once this thread is done with it (the caller looks after the
                // scope has joined this thread): not before, or it would read as a second one.
                if !*acquiring.lock() {
                    return caught.requeue(signal);
                }
                client.interrupt();
                let again = crossbeam_channel::select! {
                    recv(caught.receiver()) -> again => again.ok(),
                    recv(done) -> _ => return caught.requeue(signal),
                    default(INTERRUPT_PATIENCE) => None,
                };
                let still = acquiring.lock();
                if !*still {
                    return caught.requeue(again.unwrap_or(signal));
                }
                eprintln!(
                    "latchkey lock: {}: interrupted by {} while acquiring, and the acquire did \
                     not end within {}: nothing ran",
                    shown_key(&args.key),
                    signal_name(again.unwrap_or(signal)),
                    format_duration(INTERRUPT_PATIENCE)
                );
                std::process::exit(128 + again.unwrap_or(signal));
            });
        }
        if allowance >= NOTICE_ALLOWANCE_MIN {
            let done = done.clone();
            scope.spawn(move || {
                while done.recv_timeout(NOTICE_POLL) == Err(RecvTimeoutError::Timeout) {
                    // Only a session that never connected: nothing was sent, a retry follows (not
                    // after a refusal without --retry-refused: the call ends at once then).
                    let retried = |f: &SessionFailure| args.connect.retry_refused || !f.refused();
                    let failure = client.last_session_failure();
                    if let Some(failure) = failure.filter(|f| !f.connected() && retried(f)) {
                        let until = allowance_text(args);
                        eprintln!("latchkey lock: {failure}; retrying until {until} runs out");
                        return;
                    }
                }
            });
        }
        let result = client.acquire(&args.key, args.wait, args.lease);
        *acquiring.lock() = false;
        drop(done_tx);
        result
    })
}

/// `latchkey query KEY`: prints `held=0|1 lease_ms=N waiters=N` and exits 0.
pub fn run_query(args: QueryArgs) -> ExitCode {
    run_query_command(QueryCommand {
        query: args,
        output: OutputArgs::default(),
    })
}

/// `latchkey query [--json] KEY`: prints the key's state as text
/// (`held=0|1 lease_ms=N waiters=N`) or as one JSON object
/// (`{"key":"jobs/a","held":true,"lease_ms":28873,"waiters":0}`) and exits 0.
pub fn run_query_command(command: QueryCommand) -> ExitCode {
    let args = command.query;
    let (client, addr) = match cli_client("query", &args.connect) {
        Ok(found) => found,
        Err(code) => return ExitCode::from(code),
    };
    let start = Instant::now();
    let queried = client.query(&args.key);
    if let Err(code) = refuse_mixed_list("query", &client) {
        return ExitCode::from(code);
    }
    match queried {
        Ok(state) => {
            println!("{}", query_text(&args.key, &state, command.output));
            ExitCode::SUCCESS
        }
        Err(error) => {
            let tried = Tried::request(&args.connect, start.elapsed());
            let message = request_message(&client, addr, &error, &tried);
            eprintln!("latchkey query: {}: {message}", shown_key(&args.key));
            ExitCode::from(request_exit_code(&error))
        }
    }
}

/// What `latchkey query` prints for `state` (without the newline).
fn query_text(key: &str, state: &KeyState, output: OutputArgs) -> String {
    let lease_ms = u64::try_from(state.lease_left.as_millis()).unwrap_or(u64::MAX);
    if output.json {
        /// The JSON object, its fields in this order.
        #[derive(serde::Serialize)]
        struct QueryJson<'a> {
            key: &'a str,
            held: bool,
            lease_ms: u64,
            waiters: u32,
        }
        let value = QueryJson {
            key,
            held: state.held,
            lease_ms,
            waiters: state.waiters,
        };
        return serde_json::to_string(&value).expect("plain fields always serialize");
    }
    let held = u8::from(state.held);
    format!("held={held} lease_ms={lease_ms} waiters={}", state.waiters)
}

/// Says that the lease goes out rounded up to whole seconds, unless it is whole or `--quiet`.
fn note_lease_rounding(args: &LockArgs) {
    let Ok(lease_s) = latchkey_client::args::lease_s(args.lease) else {
        return;
    };
    let sent = Duration::from_secs(u64::from(lease_s));
    if sent != args.lease && !args.quiet {
        let (asked, sent) = (format_duration(args.lease), format_duration(sent));
        eprintln!(
            "latchkey lock: --lease {asked} is rounded up to {sent}: leases are whole seconds"
        );
    }
}

/// How `latchkey lock` ends: with CMD's own status, with the code the caller chose for a
/// conflict, or with an outcome of its own (the lock not taken, the lease lost, CMD not run).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum LockExit {
    /// CMD ran under the lock and exited with this status (128 + N: killed by signal N).
    Command(u8),
    /// The key was held by someone else and `--conflict-exit-code` chose this code.
    Chosen(u8),
    /// `latchkey lock`'s own exit code (`--failure-exit-code` replaces it).
    Own(u8),
    /// A signal ended `latchkey lock` before CMD ran: 128 + its number, as if it had killed it.
    Signalled(i32),
}

impl LockExit {
    /// The exit code, with `--failure-exit-code` (`failure`) in place of an own one.
    fn code(self, failure: Option<u8>) -> u8 {
        match self {
            LockExit::Command(code) | LockExit::Chosen(code) => code,
            LockExit::Own(code) => failure.unwrap_or(code),
            LockExit::Signalled(signal) => 128u8.wrapping_add(signal as u8),
        }
    }
}

/// `latchkey lock KEY -- CMD [ARGS..]`: see the module docs.
pub fn run_lock(args: LockArgs) -> ExitCode {
    ExitCode::from(lock(&args).code(args.failure_exit_code))
}

/// The `--failure-exit-code N` of a `latchkey lock` command line (the whole of it, program
/// name first), found without parsing the rest: what a usage error of that command line exits
/// with. `None` for other commands, or when the flag is absent or malformed.
///
/// ```
/// use latchkey::cli::lock_failure_exit_code;
///
/// let line = |words: &[&str]| words.iter().map(Into::into).collect::<Vec<_>>();
/// let usage = line(&["latchkey", "lock", "--failure-exit-code", "99", "--wait", "1.5s"]);
/// assert_eq!(lock_failure_exit_code(usage), Some(99));
/// assert_eq!(lock_failure_exit_code(line(&["latchkey", "lock", "--failure-exit-code=7"])), Some(7));
/// let cmd_flag = line(&["latchkey", "lock", "k", "--", "cmd", "--failure-exit-code", "9"]);
/// assert_eq!(lock_failure_exit_code(cmd_flag), None);
/// assert_eq!(lock_failure_exit_code(line(&["latchkey", "query", "k"])), None);
/// ```
pub fn lock_failure_exit_code(line: impl IntoIterator<Item = OsString>) -> Option<u8> {
    const FLAG: &str = "--failure-exit-code";
    let mut words = line.into_iter().skip(1);
    if words.next()? != "lock" {
        return None;
    }
    let mut words = words.take_while(|word| word != "--");
    // Bounded by the command line.
    while let Some(word) = words.next() {
        let word = word.to_str()?.to_owned();
        if word == FLAG {
            return words.next()?.to_str()?.parse().ok();
        }
        if let Some(value) = word
            .strip_prefix(FLAG)
            .and_then(|rest| rest.strip_prefix('='))
        {
            return value.parse().ok();
        }
    }
    None
}

/// Takes the lock and runs CMD under it; how `latchkey lock` ends.
fn lock(args: &LockArgs) -> LockExit {
    let (client, addr) = match cli_client("lock", &args.connect) {
        Ok(found) => found,
        Err(code) => return LockExit::Own(code),
    };
    note_lease_rounding(args);
    let caught = Caught::catch();
    let start = Instant::now();
    let acquired = acquire_with_notice(&client, args, caught.as_ref());
    if let Some(signal) = caught.as_ref().and_then(Caught::pending) {
        let (key, name) = (shown_key(&args.key), signal_name(signal));
        match acquired {
            Ok(ticket) => {
                eprintln!(
                    "latchkey lock: {key}: {name} as the lock was granted: released, nothing ran"
                );
                release(ticket);
            }
            Err(_) => eprintln!(
                "latchkey lock: {key}: interrupted by {name} while acquiring: withdrawn, \
                 nothing ran"
            ),
        }
        return LockExit::Signalled(signal);
    }
    if let Err(code) = refuse_mixed_list("lock", &client) {
        if let Ok(ticket) = acquired {
            release(ticket);
        }
        return LockExit::Own(code);
    }
    let ticket = match acquired {
        Ok(ticket) => ticket,
        Err(error) => {
            if error != AcquireError::Timeout || !args.quiet {
                let tried = Tried::acquire(args, start.elapsed());
                let message = acquire_message(&client, addr, args, &error, &tried);
                eprintln!("latchkey lock: {}: {message}", shown_key(&args.key));
            }
            return match args.conflict_exit_code {
                Some(code) if error == AcquireError::Timeout => LockExit::Chosen(code),
                _ => LockExit::Own(acquire_exit_code(&error)),
            };
        }
    };
    let environment = [
        ("LATCHKEY_KEY", args.key.clone()),
        ("LATCHKEY_TOKEN", ticket.token().to_string()),
    ];
    match child::start(&args.command, &environment, !child::has_terminal()) {
        Ok(started) => supervise(started, ticket, args, caught),
        Err(error) => {
            let name = args.command[0].to_string_lossy();
            eprintln!("latchkey lock: {name}: {error}");
            release(ticket);
            let missing = error.kind() == io::ErrorKind::NotFound;
            LockExit::Own(if missing {
                EXIT_NOT_FOUND
            } else {
                EXIT_CANNOT_EXECUTE
            })
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use latchkey_client::protocol::ErrorCode;

    #[test]
    fn each_member_gets_an_equal_share_of_the_transport_timeout_to_connect() {
        let transport = Duration::from_secs(5);
        assert_eq!(
            connect_timeout(transport, 1),
            transport,
            "one server: all of it"
        );
        assert_eq!(connect_timeout(transport, 0), transport);
        assert_eq!(connect_timeout(transport, 2), Duration::from_millis(2500));
        let share = connect_timeout(transport, 3);
        assert!(share * 3 <= transport && share * 3 > transport - Duration::from_millis(1));
    }

    #[test]
    fn a_forbidden_key_is_a_rejection_exit_84_said_as_such() {
        let forbidden = ErrorCode::Forbidden;
        assert_eq!(EXIT_REJECTED, 84);
        assert_eq!(acquire_exit_code(&AcquireError::Rejected(forbidden)), 84);
        assert_eq!(request_exit_code(&RequestError::Rejected(forbidden)), 84);
        // The messages; the client is never used for them (its session fails to connect).
        let addr: SocketAddr = "127.0.0.1:1".parse().unwrap();
        let config = ClientConfig {
            addrs: vec![addr],
            sessions: 1,
            ..ClientConfig::default()
        };
        let client = Client::with_config(config).unwrap();
        let args = LockArgs {
            connect: ConnectArgs::new(addr.to_string()),
            wait: Duration::ZERO,
            lease: Duration::from_secs(30),
            grace: Duration::from_secs(5),
            conflict_exit_code: Some(0),
            failure_exit_code: None,
            quiet: true,
            key: "jobs/a".into(),
            command: vec!["true".into()],
        };
        let tried = Tried::acquire(&args, Duration::from_millis(1));
        let rejected = AcquireError::Rejected(forbidden);
        assert_eq!(
            acquire_message(&client, addr, &args, &rejected, &tried),
            FORBIDDEN_TEXT
        );
        let rejected = RequestError::Rejected(forbidden);
        let refused = request_message(&client, addr, &rejected, &tried);
        assert_eq!(refused, format!("127.0.0.1:1: {FORBIDDEN_TEXT}"));
        assert!(FORBIDDEN_TEXT.starts_with("the key is forbidden for this identity (X 8)"));
        // Other rejections keep the server's words.
        let other = AcquireError::Rejected(ErrorCode::LeaseZero);
        assert_eq!(
            acquire_message(&client, addr, &args, &other, &tried),
            other.to_string()
        );
        assert_eq!(acquire_exit_code(&other), EXIT_REJECTED);
    }
}
