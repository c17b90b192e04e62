//! The load generator behind `latchkey bench`: drives a latchkey server, a Redis server or the
//! frame echo baseline with the same workloads and reports throughput, latency and every answer.
//!
//! # Layout
//!
//! | file | responsibility |
//! |---|---|
//! | `mod.rs` | command-line arguments, their validation into a [`BenchConfig`], [`run`] |
//! | `wire.rs` | the `Wire` interface and the latchkey dialect (uses [`latchkey_client::protocol`]) |
//! | `redis.rs` | a minimal RESP encoder/decoder and the Redis dialect (`SET NX PX`, `EVALSHA`) |
//! | `workload.rs` | the per-connection state machine: slots, cycles, timers, key choice. No I/O |
//! | `workload/redirect.rs` | a slot's answer to `M`: the same request to the leader, or later |
//! | `cluster.rs` | a cluster target: the per-key leader cache, the outbox that routes by it |
//! | `stats.rs` | counters and HDR histograms one worker thread fills |
//! | `report.rs` | merged results: the human table and the `--json` object |
//! | `worker.rs` | one load thread: the mio loop over its connections |
//! | `stream.rs` | a connection's stream, plain TCP or TLS, and opening it (TLS: with its handshake) |
//! | `driver.rs` | the threads, the start gate, progress, the `hold` phases, RSS, merging |
//!
//! # Workloads
//!
//! * `uncontended`: every cycle acquires (wait 0) a key nobody else uses, then releases it with
//!   the token. Each pipeline slot draws from its own disjoint slice of `--keys`, so a `T` here
//!   is a server bug, not bad luck. Redis: `SET k owner NX PX lease`, then `EVALSHA` of a
//!   compare-and-delete script.
//! * `contended`: every slot fights over `--hot-keys` keys with `--wait`, holds `--hold`, then
//!   releases. Reports handoff latency (the previous holder's release sent → this grant
//!   received) and fairness (grants per connection). Redis has no queue: a failed `SET NX` is
//!   retried every [`REDIS_RETRY`], as typical clients do.
//! * `hold`: grants `--keys` leases of `--lease` and keeps them, reads the server's RSS before
//!   and after (`--server-pid`), then queues one waiter on each of a sample of keys (at most
//!   1000, one per slot) and records when its grant arrives against the holder's lease end
//!   (expiry lateness). The lease end comes from the server: each waiter first asks what is
//!   left of the lease (`Q` `lease_ms`; Redis `PTTL`), on a quiet server, so the estimate is
//!   good to about ±(half that round trip + 0.5 ms of rounding) however loaded the grant phase
//!   was. A sampled key already free by then is reported as missed (the lease was too short
//!   for the grant phase). On Redis the waiters poll with `SET NX` every millisecond.
//!
//! # TLS
//!
//! `latchkeys://HOST:PORT` runs the same workloads over TLS, with the flags of the other
//! commands (`--tls-ca`, required; `--tls-cert`, `--tls-key`, `--tls-server-name`; and
//! `LATCHKEY_TLS_*`). Every connection completes its handshake before the start gate, so no
//! handshake is measured. The worker is generic over its stream: plain TCP carries nothing of
//! TLS.
//!
//! Invariants: each pipeline slot has at most one request outstanding, so per-connection
//! buffers are sized once at start; nothing on the request path allocates.
//!
//! # Clusters
//!
//! `--target a,b,c` (or `LATCHKEY_SERVER=a,b,c`) benches a latchkey cluster: every connection
//! has a socket to each member, requests go to their key's leader as a per-worker cache
//! learned from `M` answers names it, and an `M` sends the same request to the leader it
//! names (see `cluster.rs`). `M`s are counted (`M` in the report), not unexpected; a cycle
//! that meets more than 64 is given up, and that is unexpected (`no_leader`). With one
//! address nothing of this runs: one socket per connection, no cache.
//!
//! Deliberately not here: reconnecting (a failed connection is an error that the report
//! shows), TLS to Redis, or any address other than the ones given (an `M` naming a member
//! outside the target is an error of the run).

mod cluster;
mod driver;
mod redis;
mod report;
mod stats;
mod stream;
mod wire;
mod worker;
mod workload;

use std::fmt;
use std::io::IsTerminal;
use std::process::ExitCode;
use std::time::Duration;

pub use crate::cli::parse_duration;
use crate::cli::TlsArgs;
pub use driver::{execute, BenchError};
use latchkey_client::tls::Connector;
pub use report::Report;

/// How often a Redis client retries a failed `SET NX` while it still may wait.
pub const REDIS_RETRY: Duration = Duration::from_millis(1);
/// The largest `--pipeline`: slot numbers live in the low 12 bits of an owner.
pub const PIPELINE_MAX: u16 = 4096;
/// The largest `--connections`: connection numbers live in 20 bits of an owner.
pub const CONNECTIONS_MAX: u32 = 1 << 20;
/// The largest `--keys`: key names carry 12 decimal digits.
pub const KEYS_MAX: u64 = 1_000_000_000_000;
/// The largest wait or lease the latchkey wire can carry, in seconds.
pub const WIRE_SECONDS_MAX: u64 = 255;

/// Which server dialect a target speaks.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Dialect {
    /// The latchkey protocol (also spoken by the echo baseline).
    Latchkey,
    /// RESP, to a Redis server.
    Redis,
}

/// Where to send load: `latchkey://HOST:PORT`, `latchkeys://HOST:PORT` (over TLS) or
/// `redis://HOST:PORT`; for a latchkey cluster, its members as `HOST:PORT,HOST:PORT,...`
/// after the scheme.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Target {
    /// The dialect named by the scheme.
    pub dialect: Dialect,
    /// Over TLS (`latchkeys://`; latchkey only, see [`BenchConfig::validate`]).
    pub tls: bool,
    /// `HOST:PORT` as given, or the members of a cluster joined by commas.
    pub address: String,
}

impl Target {
    /// Each `HOST:PORT` of the target: one, or a cluster's members.
    pub fn addresses(&self) -> impl Iterator<Item = &str> {
        self.address.split(',')
    }
}

impl fmt::Display for Target {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let scheme = match (self.dialect, self.tls) {
            (Dialect::Latchkey, false) => "latchkey",
            (Dialect::Latchkey, true) => "latchkeys",
            (Dialect::Redis, false) => "redis",
            (Dialect::Redis, true) => "rediss",
        };
        write!(f, "{scheme}://{}", self.address)
    }
}

/// Parses `latchkey://HOST:PORT`, `latchkeys://HOST:PORT` or `redis://HOST:PORT`; a bare
/// `HOST:PORT` is latchkey without TLS (the form `LATCHKEY_SERVER` and `--server` take). A
/// latchkey target may list a cluster's members: `latchkey://a:7420,b:7420,c:7420` or
/// `a:7420,b:7420,c:7420` (at most [`latchkey_client::MEMBERS_MAX`]).
pub fn parse_target(text: &str) -> Result<Target, String> {
    let schemes = [
        ("latchkey://", Dialect::Latchkey, false),
        ("latchkeys://", Dialect::Latchkey, true),
        ("redis://", Dialect::Redis, false),
    ];
    let scheme = schemes
        .into_iter()
        .find_map(|(prefix, dialect, tls)| Some((dialect, tls, text.strip_prefix(prefix)?)));
    let (dialect, tls, rest) = match scheme {
        Some(found) => found,
        None if !text.contains("://") => (Dialect::Latchkey, false, text),
        None => {
            return Err(format!(
                "`{text}`: expected latchkey://HOST:PORT, latchkeys://HOST:PORT (TLS) or \
                 redis://HOST:PORT"
            ))
        }
    };
    let items: Vec<&str> = rest
        .trim_end_matches('/')
        .split(',')
        .map(str::trim)
        .collect();
    for item in &items {
        let port_ok = item
            .rsplit_once(':')
            .is_some_and(|(host, port)| !host.is_empty() && port.parse::<u16>().is_ok());
        if !port_ok {
            return Err(format!(
                "`{text}`: expected HOST:PORT after the scheme, not `{item}`"
            ));
        }
    }
    if items.len() > 1 && dialect == Dialect::Redis {
        return Err(format!(
            "`{text}`: a list of members is for a latchkey cluster"
        ));
    }
    if items.len() > cluster::MEMBERS_MAX {
        return Err(format!(
            "`{text}`: at most {} members",
            cluster::MEMBERS_MAX
        ));
    }
    Ok(Target {
        dialect,
        tls,
        address: items.join(","),
    })
}

/// The three workloads; see the module docs.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum Workload {
    /// Acquire (wait 0) and release random keys that no other slot uses.
    Uncontended,
    /// Every connection fights over `--hot-keys` keys.
    Contended,
    /// Grant `--keys` leases, keep them, measure RSS and expiry lateness.
    Hold,
}

impl Workload {
    /// The name used on the command line and in reports.
    pub fn name(self) -> &'static str {
        match self {
            Workload::Uncontended => "uncontended",
            Workload::Contended => "contended",
            Workload::Hold => "hold",
        }
    }
}

/// `latchkey bench` arguments.
#[derive(clap::Args, Debug, Clone)]
pub struct BenchArgs {
    /// latchkey://HOST:PORT (also the echo baseline), latchkeys://HOST:PORT (latchkey over TLS:
    /// needs --tls-ca) or redis://HOST:PORT; a bare HOST:PORT is latchkey. A cluster: its
    /// members, latchkey://A:PORT,B:PORT,C:PORT (requests follow M to each key's leader).
    /// Defaults to the latchkey server(s) in LATCHKEY_SERVER.
    #[arg(long, env = "LATCHKEY_SERVER", value_parser = parse_target)]
    pub target: Target,
    /// TLS to a latchkeys:// target.
    #[command(flatten)]
    pub tls: TlsArgs,
    /// What each connection does.
    #[arg(long, value_enum)]
    pub workload: Workload,
    /// TCP connections, spread over the threads.
    #[arg(long, default_value_t = 50)]
    pub connections: u32,
    /// Requests each connection keeps outstanding.
    #[arg(long, default_value_t = 16)]
    pub pipeline: u16,
    /// Measured time (not used by `hold`).
    #[arg(long, default_value = "5s", value_parser = parse_duration)]
    pub duration: Duration,
    /// Unmeasured time before it (not used by `hold`).
    #[arg(long, default_value = "1s", value_parser = parse_duration)]
    pub warmup: Duration,
    /// Key space of `uncontended`; number of leases of `hold`.
    #[arg(long, default_value_t = 100_000)]
    pub keys: u64,
    /// Keys `contended` fights over.
    #[arg(long, default_value_t = 8)]
    pub hot_keys: u64,
    /// How long `contended` holds a grant before releasing it.
    #[arg(long, default_value = "0ms", value_parser = parse_duration)]
    pub hold: Duration,
    /// How long a `contended` acquire may queue (rounded up to seconds on the latchkey wire).
    #[arg(long, default_value = "5s", value_parser = parse_duration)]
    pub wait: Duration,
    /// Lease of every grant (whole seconds, 1..=255, on the latchkey wire).
    #[arg(long, default_value = "30s", value_parser = parse_duration)]
    pub lease: Duration,
    /// Load threads [default: the CPUs this process may run on, at most --connections].
    #[arg(long)]
    pub threads: Option<usize>,
    /// Print one JSON object instead of the table.
    #[arg(long)]
    pub json: bool,
    /// PID of a local server, to read its RSS (`hold`).
    #[arg(long)]
    pub server_pid: Option<u32>,
    /// A cluster's shard count (`cluster.shards`): keeps the leader cache per shard, as a
    /// client that knows the shard map does, instead of per key (a key never used before then
    /// costs no redirect once its shard's leader is known).
    #[arg(long)]
    pub shards: Option<u32>,
    /// Identify each connection (latchkey only) as a client of its own before its first
    /// request, as the official clients do (resumable calls, docs/protocol.md §5), so that
    /// their cost is measured.
    #[arg(long)]
    pub identify: bool,
}

/// A validated run description: what [`execute`] needs.
#[derive(Clone, Debug)]
pub struct BenchConfig {
    /// Where to send load.
    pub target: Target,
    /// TLS to a `latchkeys://` target (present exactly when `target.tls` is).
    pub tls: Option<Connector>,
    /// What to do.
    pub workload: Workload,
    /// TCP connections.
    pub connections: u32,
    /// Outstanding requests per connection.
    pub pipeline: u16,
    /// Measured time.
    pub duration: Duration,
    /// Unmeasured time before it.
    pub warmup: Duration,
    /// Key space (`uncontended`) or leases (`hold`).
    pub keys: u64,
    /// Keys of `contended`.
    pub hot_keys: u64,
    /// Time a `contended` grant is held.
    pub hold: Duration,
    /// Acquire wait of `contended`.
    pub wait: Duration,
    /// Lease of every grant, as sent (whole seconds for latchkey).
    pub lease: Duration,
    /// Load threads.
    pub threads: usize,
    /// Server PID for RSS readings.
    pub server_pid: Option<u32>,
    /// A cluster's shard count: the leader cache is per shard.
    pub shards: Option<u32>,
    /// Whether to print a progress line on stderr while running.
    pub progress: bool,
    /// Whether each latchkey connection identifies before its first request.
    pub identify: bool,
}

impl BenchConfig {
    /// The defaults of the command line for `target` and `workload`, one thread, no progress.
    pub fn new(target: Target, workload: Workload) -> BenchConfig {
        BenchConfig {
            target,
            tls: None,
            workload,
            connections: 50,
            pipeline: 16,
            duration: Duration::from_secs(5),
            warmup: Duration::from_secs(1),
            keys: 100_000,
            hot_keys: 8,
            hold: Duration::ZERO,
            wait: Duration::from_secs(5),
            lease: Duration::from_secs(30),
            threads: 1,
            server_pid: None,
            shards: None,
            progress: false,
            identify: false,
        }
    }

    /// Checks the limits and rounds the lease as the wire will carry it.
    pub fn validate(mut self) -> Result<BenchConfig, String> {
        let slots = u64::from(self.connections) * u64::from(self.pipeline);
        let shards_max = crate::config::SHARDS_MAX;
        let checks: [(bool, String); 9] = [
            (
                self.shards
                    .is_some_and(|shards| !(1..=shards_max).contains(&shards)),
                format!("--shards is 1..={shards_max}"),
            ),
            (
                self.connections == 0,
                "--connections must be at least 1".into(),
            ),
            (
                self.connections > CONNECTIONS_MAX,
                format!("--connections is at most {CONNECTIONS_MAX}"),
            ),
            (
                !(1..=PIPELINE_MAX).contains(&self.pipeline),
                format!("--pipeline is 1..={PIPELINE_MAX}"),
            ),
            (
                !(1..=KEYS_MAX).contains(&self.keys),
                format!("--keys is 1..={KEYS_MAX}"),
            ),
            (self.hot_keys == 0, "--hot-keys must be at least 1".into()),
            (self.threads == 0, "--threads must be at least 1".into()),
            (
                self.workload != Workload::Hold && self.duration.is_zero(),
                "--duration must be > 0".into(),
            ),
            (
                self.workload == Workload::Uncontended && self.keys < slots,
                format!(
                    "--keys ({}) must be at least --connections x --pipeline ({slots}): every slot \
                     draws from its own keys",
                    self.keys
                ),
            ),
        ];
        if let Some((_, message)) = checks.into_iter().find(|(failed, _)| *failed) {
            return Err(message);
        }
        if let Some(message) = tls_mismatch(&self.target, self.tls.is_some()) {
            return Err(message);
        }
        if self.identify && self.target.dialect != Dialect::Latchkey {
            return Err("--identify is for a latchkey target".into());
        }
        self.threads = self.threads.min(self.connections as usize);
        self.lease = self.wire_lease()?;
        if self.target.dialect == Dialect::Latchkey && self.wait.as_secs() > WIRE_SECONDS_MAX {
            return Err(format!(
                "--wait is at most {WIRE_SECONDS_MAX}s on the latchkey wire"
            ));
        }
        Ok(self)
    }

    fn wire_lease(&self) -> Result<Duration, String> {
        match self.target.dialect {
            Dialect::Latchkey => {
                let seconds = seconds_rounded_up(self.lease);
                if !(1..=WIRE_SECONDS_MAX).contains(&seconds) {
                    return Err(format!(
                        "--lease is 1s..={WIRE_SECONDS_MAX}s on the latchkey wire"
                    ));
                }
                Ok(Duration::from_secs(seconds))
            }
            Dialect::Redis if self.lease.as_millis() == 0 => {
                Err("--lease must be at least 1ms".into())
            }
            Dialect::Redis => Ok(Duration::from_millis(self.lease.as_millis() as u64)),
        }
    }
}

/// Why TLS settings (`tls_given`) do not fit `target`, if they do not: `latchkeys://` needs
/// them, every other target refuses them.
fn tls_mismatch(target: &Target, tls_given: bool) -> Option<String> {
    match (target.dialect, target.tls, tls_given) {
        (Dialect::Redis, true, _) => Some(format!("{target}: TLS to Redis is not supported")),
        (_, true, false) => Some(format!(
            "{target} needs --tls-ca FILE (or LATCHKEY_TLS_CA): the CA certificates that \
             signed the server's certificate"
        )),
        (_, false, true) => Some(format!(
            "--tls-ca (or LATCHKEY_TLS_CA) is for a latchkeys://HOST:PORT target; {target} is \
             plain TCP"
        )),
        _ => None,
    }
}

/// Whole seconds, rounded up (the wire carries seconds; a bound is never shortened).
pub(crate) fn seconds_rounded_up(duration: Duration) -> u64 {
    duration.as_secs() + u64::from(duration.subsec_nanos() > 0)
}

impl BenchArgs {
    /// Validates the arguments into a [`BenchConfig`], reading the TLS files (errors name the
    /// flag and the path).
    pub fn to_config(&self) -> Result<BenchConfig, String> {
        let cpus = std::thread::available_parallelism().map_or(1, usize::from);
        let tls = self.tls.client_tls()?;
        if let Some(message) = tls_mismatch(&self.target, tls.is_some()) {
            return Err(message);
        }
        let tls = match tls {
            Some(tls) => Some(tls.connector().map_err(|error| error.to_string())?),
            None => None,
        };
        let config = BenchConfig {
            tls,
            connections: self.connections,
            pipeline: self.pipeline,
            duration: self.duration,
            warmup: self.warmup,
            keys: self.keys,
            hot_keys: self.hot_keys,
            hold: self.hold,
            wait: self.wait,
            lease: self.lease,
            threads: self.threads.unwrap_or(cpus),
            server_pid: self.server_pid,
            shards: self.shards,
            progress: !self.json,
            identify: self.identify,
            ..BenchConfig::new(self.target.clone(), self.workload)
        };
        config.validate()
    }
}

/// Runs `latchkey bench`: exit 0 on a clean run, 1 when anything unexpected was counted or no
/// cycle completed in the measured window, 2 when the run could not be made.
pub fn run(args: BenchArgs) -> ExitCode {
    let config = match args.to_config() {
        Ok(config) => config,
        Err(message) => {
            eprintln!("latchkey bench: {message}");
            return ExitCode::from(2);
        }
    };
    let report = match execute(&config) {
        Ok(report) => report,
        Err(error) => {
            eprintln!("latchkey bench: {error}");
            return ExitCode::from(2);
        }
    };
    if args.json {
        println!("{}", report.to_json());
    } else {
        print!("{}", report.to_table());
    }
    let Some(alarm) = report.failure() else {
        return ExitCode::SUCCESS;
    };
    if std::io::stderr().is_terminal() {
        eprintln!("\x1b[1;31m{alarm}\x1b[0m");
    } else {
        eprintln!("{alarm}");
    }
    ExitCode::FAILURE
}

#[cfg(test)]
mod tests;
