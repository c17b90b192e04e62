//! The `latchkey` binary: command line → config → server (or a client command).
//!
//! `latchkey` with no arguments serves on the embedded defaults; `latchkey serve` takes a
//! config file and overrides. SIGTERM/SIGINT start a graceful shutdown; SIGHUP is logged and
//! ignored (a closed terminal or a log rotation must not take the lock space down); a failed
//! core makes the process exit non-zero at once.

use clap::{Parser, Subcommand};
use latchkey::config::Config;
use mio::{Events, Interest, Poll, Token, Waker};
use signal_hook::consts::{SIGHUP, SIGINT, SIGTERM};
use signal_hook_mio::v1_0::Signals;
use std::io::Write;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::Arc;

/// Exit code when the configuration is refused.
const EXIT_CONFIG: u8 = 78;
/// Exit code when the server cannot start or a core failed.
const EXIT_SOFTWARE: u8 = 70;

#[derive(Parser, Debug)]
#[command(
    name = "latchkey",
    version,
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
    Lock(latchkey::client::cli::LockArgs),
    /// Print the state of a key.
    Query(latchkey::client::cli::QueryArgs),
    /// Check that a server answers.
    Ping(latchkey::client::cli::PingArgs),
    /// Drive load against latchkey or Redis and report throughput and latency.
    Bench(latchkey::bench::BenchArgs),
}

/// Signals and exit codes of `latchkey serve`, shown by `serve --help`.
const SERVE_HELP: &str = "\
Signals:
  SIGTERM, SIGINT  graceful shutdown: stop accepting, answer every queued waiter B, flush,
                   exit 0 within 5 s
  SIGHUP           logged and ignored: the server keeps serving (nothing is reloaded;
                   restart to apply a changed config file)

Exit codes:
  0   stopped after SIGTERM or SIGINT
  70  could not start (address in use, cannot listen, tokens.state_dir unusable) or a core
      failed while serving
  78  the configuration was refused (the message names the key)";

#[derive(clap::Args, Debug, Default)]
struct ServeArgs {
    /// TOML config file (see config.example.toml); defaults apply to anything it omits.
    #[arg(long, value_name = "FILE")]
    config: Option<PathBuf>,
    /// Address to listen on, overriding [server] listen.
    #[arg(long, value_name = "ADDR")]
    listen: Option<SocketAddr>,
    /// Cores (event loops and partitions), overriding [server] cores; 0 = one per CPU.
    #[arg(long, value_name = "N")]
    cores: Option<usize>,
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    match cli.command.unwrap_or(Command::Serve(ServeArgs::default())) {
        Command::Serve(args) => serve(args),
        Command::Lock(args) => latchkey::client::cli::run_lock(args),
        Command::Query(args) => latchkey::client::cli::run_query(args),
        Command::Ping(args) => latchkey::client::cli::run_ping(args),
        Command::Bench(args) => latchkey::bench::run(args),
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

fn init_logging(config: &Config) {
    let mut builder = env_logger::Builder::new();
    builder.filter_level(config.log.level);
    if let Ok(spec) = std::env::var("RUST_LOG") {
        builder.parse_filters(&spec);
    }
    builder.init();
}

fn serve(args: ServeArgs) -> ExitCode {
    let config = match load_config(&args) {
        Ok(config) => config,
        Err(e) => {
            eprintln!("latchkey: config: {e}");
            return ExitCode::from(EXIT_CONFIG);
        }
    };
    init_logging(&config);
    match run_server(config) {
        Ok(code) => code,
        Err(e) => {
            log::error!("cannot serve: {e}");
            eprintln!("latchkey: {e}");
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
    let server = latchkey::server::start_with_notify(config, Some(notify))?;
    let addr = server.local_addr();
    log::info!("latchkey listening on {addr}: {summary}");
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
