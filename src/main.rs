//! The `latchkey` binary: command line → config → server (or a client command).
//!
//! `latchkey` with no arguments serves on the embedded defaults; `latchkey serve` takes a
//! config file and overrides. SIGTERM/SIGINT start a graceful shutdown; SIGHUP is logged and
//! ignored (a closed terminal or a log rotation must not take the lock space down); a failed
//! core makes the process exit non-zero at once. At startup the server raises its soft limit
//! of open files towards `max_connections` + a margin, and warns when it cannot.
//!
//! The client commands (`lock`, `query`, `ping`, `stats`, `keys`) live in
//! `latchkey::cli`, `bench` in `latchkey::bench`; `completions` prints a shell's
//! completion script; `--version` names the commit the binary was built from.

use clap::{CommandFactory, Parser, Subcommand};
use latchkey::cli;
use latchkey::config::Config;
use mio::{Events, Interest, Poll, Token, Waker};
use signal_hook::consts::{SIGHUP, SIGINT, SIGTERM};
use signal_hook_mio::v1_0::Signals;
use std::io::Write;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::Arc;

/// The allocator of the binary: jemalloc, with per-thread caches. With glibc's malloc a
/// 64-shard cluster spent about a third of its CPU at pipeline 16 in the allocator (`perf`:
/// frees of memory another thread allocated, an entry's data freed by the log writer, take the
/// owning arena's lock; an allocation of 1 KiB or more first merges every small free chunk),
/// 7% with jemalloc. Measured in `docs/cluster-design.md`, "Many shards".
#[global_allocator]
static ALLOCATOR: tikv_jemallocator::Jemalloc = tikv_jemallocator::Jemalloc;

/// Exit code when the configuration is refused.
const EXIT_CONFIG: u8 = 78;
/// Exit code when the server cannot start or a core failed.
const EXIT_SOFTWARE: u8 = 70;

/// Files a server keeps open besides one socket per session: its listeners, the cores' wakers
/// and pipes, the signal pipe, the token state directory, stdio and the rest.
const FILES_MARGIN: u64 = 64;

/// What `--version` prints after the name: `0.1.0 (commit 6c97a315b5de)`.
const VERSION_TEXT: &str = concat!(
    env!("CARGO_PKG_VERSION"),
    " (commit ",
    env!("LATCHKEY_COMMIT"),
    ")"
);

#[derive(Parser, Debug)]
#[command(
    name = "latchkey",
    version = VERSION_TEXT,
    about = "A low-latency lock server with fencing tokens"
)]
struct Cli {
    #[command(subcommand)]
    command: Option<Command>,
}

#[derive(Subcommand, Debug)]
enum Command {
    /// Serve the lock protocol (the default with no subcommand).
    #[command(after_help = SERVE_HELP)]
    Serve(ServeArgs),
    /// Run a command while holding a lock.
    #[command(after_help = cli::LOCK_HELP)]
    Lock(cli::LockArgs),
    /// Print the state of a key.
    Query(cli::QueryCommand),
    /// Check that a server answers, and how fast.
    Ping(cli::PingCommand),
    /// Print a server's figures: sessions, locks, rates, latency, busy answers, loop stalls.
    Stats(cli::StatsArgs),
    /// List held keys: owner, peer, time held, lease left, waiters.
    Keys(cli::KeysArgs),
    /// A cluster's members: reachable or not, shards led, terms, indices, lag.
    #[command(subcommand)]
    Cluster(cli::ClusterCommand),
    /// Drive load against latchkey or Redis and report throughput and latency.
    Bench(latchkey::bench::BenchArgs),
    /// Print the completion script of a shell (bash, zsh, fish, elvish, powershell).
    #[command(after_help = COMPLETIONS_HELP)]
    Completions {
        /// The shell.
        shell: clap_complete::Shell,
    },
}

/// Where the completion scripts go, shown by `completions --help`.
const COMPLETIONS_HELP: &str = "\
Examples:
  latchkey completions bash > /etc/bash_completion.d/latchkey
  latchkey completions zsh > \"${fpath[1]}/_latchkey\"
  latchkey completions fish > ~/.config/fish/completions/latchkey.fish";

/// Signals and exit codes of `latchkey serve`, shown by `serve --help`.
const SERVE_HELP: &str = "\
Signals:
  SIGTERM, SIGINT  graceful shutdown: stop accepting, answer every queued waiter B, flush,
                   exit 0 within 5 s
  SIGHUP           logged and ignored: the server keeps serving (nothing is reloaded;
                   restart to apply a changed config file)

Exit codes:
  0   stopped after SIGTERM or SIGINT
  70  could not start (address in use, cannot listen, TLS files unreadable or invalid,
      tokens.state_dir unusable; a cluster member's peer address that cannot be bound, its
      data_dir in use by another process, written for another node_id, cluster or core count,
      or holding a log that cannot be read; a cluster.restore_from file unreadable, damaged or
      of another shard count) or a core failed while serving (a cluster member
      stops itself when its log cannot be written or synced)
  78  the configuration was refused (the message names the key)";

#[derive(clap::Args, Debug, Default)]
struct ServeArgs {
    /// TOML config file (see config.example.toml); defaults apply to anything it omits.
    #[arg(long, value_name = "FILE")]
    config: Option<PathBuf>,
    /// Address to listen on, overriding [server] listen.
    #[arg(long, value_name = "ADDR")]
    listen: Option<SocketAddr>,
    /// Cores (event loops and partitions), overriding [server] cores; 0 = one per CPU (a
    /// cluster member needs a count).
    #[arg(long, value_name = "N")]
    cores: Option<usize>,
}

/// `latchkey lock-guard PGID`: the guard `latchkey lock` starts beside its command (see
/// `latchkey::cli::run_lock_guard`). Not a subcommand of [`Cli`], so that neither the help nor
/// the completion scripts offer it to people.
#[derive(Parser, Debug)]
#[command(name = "latchkey lock-guard")]
struct GuardCli {
    #[command(flatten)]
    args: cli::GuardArgs,
}

/// The first argument that starts the guard instead of a command.
const GUARD_COMMAND: &str = "lock-guard";

fn main() -> ExitCode {
    let mut args = std::env::args_os();
    if args.nth(1).is_some_and(|first| first == GUARD_COMMAND) {
        let guard = GuardCli::parse_from(std::env::args_os().skip(1));
        return cli::run_lock_guard(guard.args);
    }
    cli::enable_lock_guard();
    let cli = match Cli::try_parse() {
        Ok(cli) => cli,
        Err(error) => return usage_error(&error),
    };
    match cli.command.unwrap_or(Command::Serve(ServeArgs::default())) {
        Command::Serve(args) => serve(args),
        Command::Lock(args) => cli::run_lock(args),
        Command::Query(command) => cli::run_query_command(command),
        Command::Ping(command) => cli::run_ping_command(command),
        Command::Stats(args) => cli::run_stats(args),
        Command::Keys(args) => cli::run_keys(args),
        Command::Cluster(command) => cli::run_cluster(command),
        Command::Bench(args) => latchkey::bench::run(args),
        Command::Completions { shell } => {
            let mut stdout = std::io::stdout();
            clap_complete::generate(shell, &mut Cli::command(), "latchkey", &mut stdout);
            ExitCode::SUCCESS
        }
    }
}

/// Says a command line's error (or prints the help or version it asked for) and exits:
/// with 2 for a usage error, or with `latchkey lock --failure-exit-code N`'s N.
fn usage_error(error: &clap::Error) -> ExitCode {
    let failure = cli::lock_failure_exit_code(std::env::args_os());
    match failure.filter(|_| error.use_stderr()) {
        Some(code) => {
            let _ = error.print();
            ExitCode::from(code)
        }
        None => error.exit(),
    }
}

fn load_config(args: &ServeArgs) -> Result<Config, String> {
    let config = match &args.config {
        Some(path) => Config::load(path).map_err(|e| e.to_string())?,
        None => Config::default(),
    };
    config
        .with_overrides(args.listen, args.cores)
        .map_err(|e| e.to_string())
}

/// The soft limit of open files to ask for: `needed`, as far as the hard limit allows, or
/// `None` when the soft limit is already enough or cannot grow. No I/O.
fn files_limit_target(soft: u64, hard: u64, needed: u64) -> Option<u64> {
    let target = needed.min(hard);
    (soft < needed && target > soft).then_some(target)
}

/// Makes sure the process may open a file per session plus [`FILES_MARGIN`]: raises the soft
/// `RLIMIT_NOFILE` as far as needed and the hard limit allows (logged at info), and warns when
/// that is still short, since accepts past the limit would fail while serving.
fn check_files_limit(max_connections: usize) {
    let needed = u64::try_from(max_connections)
        .unwrap_or(u64::MAX)
        .saturating_add(FILES_MARGIN);
    let mut limit = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: getrlimit writes the limit into the struct we own and touches nothing else.
    if unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut limit) } != 0 {
        let error = std::io::Error::last_os_error();
        log::warn!("cannot read the open files limit (RLIMIT_NOFILE): {error}");
        return;
    }
    let (soft, hard) = (limit.rlim_cur, limit.rlim_max);
    let mut now = soft;
    if let Some(target) = files_limit_target(soft, hard, needed) {
        let raised = libc::rlimit {
            rlim_cur: target,
            rlim_max: hard,
        };
        // SAFETY: setrlimit reads the struct we own; raising the soft limit up to the hard
        // limit needs no privilege.
        if unsafe { libc::setrlimit(libc::RLIMIT_NOFILE, &raised) } == 0 {
            log::info!(
                "raised the open files limit (soft RLIMIT_NOFILE) from {soft} to {target} for \
                 limits.max_connections ({max_connections}) + {FILES_MARGIN}"
            );
            now = target;
        }
    }
    if now < needed {
        log::warn!(
            "the open files limit (RLIMIT_NOFILE) is {now} (hard limit {hard}), below \
             limits.max_connections ({max_connections}) + {FILES_MARGIN} = {needed}: accepts \
             will fail before max_connections sessions are open; raise it with \
             `ulimit -n {needed}` before starting, or `LimitNOFILE={needed}` in the systemd \
             unit, or lower limits.max_connections"
        );
    }
}

fn serve(args: ServeArgs) -> ExitCode {
    let config = match load_config(&args) {
        Ok(config) => config,
        Err(e) => {
            eprintln!("latchkey: config: {e}");
            return ExitCode::from(EXIT_CONFIG);
        }
    };
    latchkey::logging::init(&config.log);
    check_files_limit(config.limits.max_connections);
    match run_server(config) {
        Ok(code) => code,
        Err(e) => {
            // Said once: the logger writes to stderr too. Without one for errors (`[log] level
            // = "off"`), straight to stderr.
            if log::log_enabled!(log::Level::Error) {
                log::error!("cannot serve: {e}");
            } else {
                eprintln!("latchkey: cannot serve: {e}");
            }
            ExitCode::from(EXIT_SOFTWARE)
        }
    }
}

fn run_server(config: Config) -> std::io::Result<ExitCode> {
    const SIGNALS: Token = Token(0);
    const NOTIFY: Token = Token(1);
    let mut poll = Poll::new()?;
    let mut signals = Signals::new([SIGTERM, SIGINT, SIGHUP])?;
    poll.registry()
        .register(&mut signals, SIGNALS, Interest::READABLE)?;
    let notify = Arc::new(Waker::new(poll.registry(), NOTIFY)?);
    let summary = config.summary();
    let server = latchkey::node::start_with_notify(config, Some(notify))?;
    let addr = server.local_addr();
    log::info!("latchkey listening on {addr}: {summary}");
    if let Some(health) = server.health_addr() {
        log::info!("health port (plaintext, GET and HEAD /health only) on {health}");
    }
    let mut stdout = std::io::stdout();
    let _ = writeln!(stdout, "listening on {addr}");
    let _ = stdout.flush();
    let mut events = Events::with_capacity(8);
    let mut stopping = false;
    // Bounded: the cores stop within 5 s of a shutdown. A core wakes us just before its thread
    // ends, so while stopping, look again every few milliseconds.
    loop {
        let timeout = stopping.then_some(std::time::Duration::from_millis(20));
        match poll.poll(&mut events, timeout) {
            Ok(()) => {}
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
            Err(e) => return Err(e),
        }
        for event in events.iter() {
            if event.token() == SIGNALS {
                for signal in signals.pending() {
                    if signal == SIGHUP {
                        log::info!(
                            "SIGHUP: ignored, still serving (restart to apply a changed config)"
                        );
                        continue;
                    }
                    log::info!("signal {signal}: shutting down");
                    server.shutdown();
                    stopping = true;
                }
            }
        }
        if server.failed() {
            log::error!("a core failed: exiting");
            return Ok(ExitCode::from(EXIT_SOFTWARE));
        }
        stopping |= server.is_stopping();
        if server.is_finished() {
            break;
        }
    }
    match server.join() {
        Ok(()) => {
            log::info!("stopped");
            Ok(ExitCode::SUCCESS)
        }
        Err(e) => {
            log::error!("{e}");
            Ok(ExitCode::from(EXIT_SOFTWARE))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_soft_files_limit_grows_as_needed_within_the_hard_limit() {
        assert_eq!(files_limit_target(1024, 1_048_576, 10_064), Some(10_064));
        assert_eq!(files_limit_target(64, 4096, 10_064), Some(4096));
        assert_eq!(files_limit_target(20_000, 20_000, 10_064), None);
        assert_eq!(files_limit_target(10_064, 20_000, 10_064), None);
        assert_eq!(files_limit_target(64, 64, 10_064), None);
        assert_eq!(files_limit_target(1024, u64::MAX, u64::MAX), Some(u64::MAX));
    }

    #[test]
    fn the_command_line_is_well_formed() {
        Cli::command().debug_assert();
    }
}
