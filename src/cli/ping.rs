//! `latchkey ping [--count N] [--interval 1s] [--json]`: N pings `--interval` apart over one
//! session per member, a line per pong, and a summary like ping(8).
//!
//! Pings go out on a schedule: the first at once, the k-th `k × --interval` after it, or right
//! after the previous one's answer when that came later. A ping without a pong (no connection,
//! no answer within `--transport-timeout`) counts as lost, is said on stderr, and the run goes
//! on, as ping(8) does. Text output: `pong from ADDR: seq=K time=0.081 ms` per pong, and for
//! more than one ping the summary `N pings, M pongs, L% lost; rtt min/avg/max = a/b/c ms`.
//! `--json` prints only one object at the end:
//! `{"server":ADDR,"count":N,"received":M,"rtt_ms":{"min":a,"avg":b,"max":c}}` (the times are
//! `null` when no pong came). With several members in `--server`, every member is pinged in
//! each round: the summary has a line per member (`ADDR: N pings, ...`), `--json` an object
//! per member, a line each.
//!
//! Exit code: 0 when every ping got its pong; else that of the last ping lost (83 unreachable,
//! 82 no answer, 84 refused).
//!
//! Deliberately not here: stopping early on a loss (a restart of the server is exactly what a
//! long ping should show) and pings faster than the client's one session answers them.

use std::net::SocketAddr;
use std::process::ExitCode;
use std::thread;
use std::time::{Duration, Instant};

use latchkey_client::Client;

use super::messages::{request_message, Tried};
use super::{
    cli_client, parse_duration, parse_server_items, request_exit_code, ConnectArgs, OutputArgs,
    PingArgs,
};

/// The longest `--interval`.
const INTERVAL_MAX: Duration = Duration::from_secs(3600);

/// `latchkey ping` as the command line gives it: the pings, their spacing and the output.
#[derive(clap::Args, Debug, Clone)]
pub struct PingCommand {
    /// The server and how many pings.
    #[command(flatten)]
    pub ping: PingArgs,
    /// Time from one ping to the next, e.g. 1s, 200ms; at most 1h.
    #[arg(long, default_value = "1s", value_parser = parse_interval)]
    pub interval: Duration,
    /// Text or JSON.
    #[command(flatten)]
    pub output: OutputArgs,
}

fn parse_interval(text: &str) -> Result<Duration, String> {
    let interval = parse_duration(text)?;
    if interval > INTERVAL_MAX {
        return Err("the interval must be at most 1h".into());
    }
    Ok(interval)
}

/// `latchkey ping`: `args.count` pings 1 s apart, printed as text.
pub fn run_ping(args: PingArgs) -> ExitCode {
    run_ping_command(PingCommand {
        ping: args,
        interval: Duration::from_secs(1),
        output: OutputArgs::default(),
    })
}

/// `latchkey ping [--count N] [--interval 1s] [--json]`: `--count` pings `--interval` apart
/// (a late answer delays only the next one), a line per pong (`pong from ADDR: seq=K
/// time=0.081 ms`) and for more than one ping a summary (`N pings, M pongs, L% lost; rtt
/// min/avg/max = a/b/c ms`); with `--json` one object instead,
/// `{"server":ADDR,"count":N,"received":M,"rtt_ms":{"min":a,"avg":b,"max":c}}`. A ping without
/// a pong is said on stderr and counted lost. Exits 0 when every ping got its pong, else with
/// the code of the last one lost.
///
/// Given several members (`--server a,b,c`), each round pings every member in turn, each over
/// its own session: the summary is one line per member, prefixed with its address, and
/// `--json` one object per member, a line each.
pub fn run_ping_command(command: PingCommand) -> ExitCode {
    let members = match ping_members(&command.ping.connect) {
        Ok(members) => members,
        Err(code) => return ExitCode::from(code),
    };
    let start = Instant::now();
    let mut tallies = vec![PingTally::default(); members.len()];
    let mut exit_code = ExitCode::SUCCESS;
    for seq in 1..=command.ping.count {
        let due = start + command.interval * (seq - 1);
        if let Some(wait) = due.checked_duration_since(Instant::now()) {
            thread::sleep(wait);
        }
        for ((client, addr), tally) in members.iter().zip(&mut tallies) {
            if let Err(code) = ping_once(&command, client, *addr, seq, tally) {
                exit_code = ExitCode::from(code);
            }
        }
    }
    let several = members.len() > 1;
    for ((_, addr), tally) in members.iter().zip(&tallies) {
        if command.output.json {
            println!("{}", tally.json(*addr));
        } else if several {
            println!("{addr}: {}", tally.summary());
        } else if command.ping.count > 1 {
            println!("{}", tally.summary());
        }
    }
    exit_code
}

/// A client of each `--server` item (a member), with the address its pongs are said from; or
/// the exit code after saying why not.
fn ping_members(connect: &ConnectArgs) -> Result<Vec<(Client, SocketAddr)>, u8> {
    let items = parse_server_items(&connect.server)
        .map_err(|failure| super::say_servers_failure("ping", &failure))?;
    let mut members = Vec::with_capacity(items.len());
    for (item, _) in items {
        let mut one = connect.clone();
        one.server = item;
        members.push(cli_client("ping", &one)?);
    }
    Ok(members)
}

/// Pings `addr` once as the `seq`-th ping, says the pong or the loss, and counts it in
/// `tally`; the exit code of a loss.
fn ping_once(
    command: &PingCommand,
    client: &Client,
    addr: SocketAddr,
    seq: u32,
    tally: &mut PingTally,
) -> Result<(), u8> {
    let sent = Instant::now();
    match client.ping() {
        Ok(rtt) => {
            tally.pong(rtt);
            if !command.output.json {
                println!("pong from {addr}: seq={seq} time={} ms", millis_text(rtt));
            }
            Ok(())
        }
        Err(error) => {
            tally.lost();
            let tried = Tried::request(&command.ping.connect, sent.elapsed());
            let message = request_message(client, addr, &error, &tried);
            eprintln!("latchkey ping: {message} (seq={seq})");
            Err(request_exit_code(&error))
        }
    }
}

/// What a run saw: pings sent, pongs received and their round-trip times. No I/O.
#[derive(Debug, Default, Clone, PartialEq)]
struct PingTally {
    sent: u32,
    received: u32,
    rtt_min: Option<Duration>,
    rtt_max: Duration,
    rtt_total: Duration,
}

/// Round-trip times in the JSON object, in milliseconds.
#[derive(serde::Serialize)]
struct RttJson {
    min: Option<f64>,
    avg: Option<f64>,
    max: Option<f64>,
}

/// The JSON object of `--json`, its fields in this order.
#[derive(serde::Serialize)]
struct PingJson {
    server: String,
    count: u32,
    received: u32,
    rtt_ms: RttJson,
}

impl PingTally {
    fn pong(&mut self, rtt: Duration) {
        self.sent += 1;
        self.received += 1;
        self.rtt_min = Some(self.rtt_min.map_or(rtt, |min| min.min(rtt)));
        self.rtt_max = self.rtt_max.max(rtt);
        self.rtt_total += rtt;
    }

    fn lost(&mut self) {
        self.sent += 1;
    }

    /// (min, avg, max), or `None` before the first pong.
    fn rtts(&self) -> Option<(Duration, Duration, Duration)> {
        let min = self.rtt_min?;
        Some((min, self.rtt_total / self.received, self.rtt_max))
    }

    /// Lost pings as a whole percentage, rounded down as ping(8) does.
    fn lost_percent(&self) -> u64 {
        let lost = u64::from(self.sent - self.received);
        (lost * 100).checked_div(u64::from(self.sent)).unwrap_or(0)
    }

    /// `N pings, M pongs, L% lost; rtt min/avg/max = a/b/c ms`.
    fn summary(&self) -> String {
        let counts = format!(
            "{} pings, {} pongs, {}% lost",
            self.sent,
            self.received,
            self.lost_percent()
        );
        match self.rtts() {
            Some((min, avg, max)) => format!(
                "{counts}; rtt min/avg/max = {}/{}/{} ms",
                millis_text(min),
                millis_text(avg),
                millis_text(max)
            ),
            None => counts,
        }
    }

    /// The one JSON object of `--json`.
    fn json(&self, server: SocketAddr) -> String {
        let rtts = self.rtts();
        let value = PingJson {
            server: server.to_string(),
            count: self.sent,
            received: self.received,
            rtt_ms: RttJson {
                min: rtts.map(|(min, _, _)| millis(min)),
                avg: rtts.map(|(_, avg, _)| millis(avg)),
                max: rtts.map(|(_, _, max)| millis(max)),
            },
        };
        serde_json::to_string(&value).expect("plain fields always serialize")
    }
}

/// `duration` in milliseconds, to the microsecond.
fn millis(duration: Duration) -> f64 {
    duration.as_micros() as f64 / 1000.0
}

/// `duration` in milliseconds with three decimals, as ping(8) writes times.
fn millis_text(duration: Duration) -> String {
    format!("{:.3}", millis(duration))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn micros(micros: u64) -> Duration {
        Duration::from_micros(micros)
    }

    #[test]
    fn summary_counts_losses_and_times() {
        let mut tally = PingTally::default();
        tally.pong(micros(81));
        tally.pong(micros(120));
        tally.pong(micros(69));
        assert_eq!(
            tally.summary(),
            "3 pings, 3 pongs, 0% lost; rtt min/avg/max = 0.069/0.090/0.120 ms"
        );
        tally.lost();
        assert_eq!(tally.lost_percent(), 25);
        assert!(tally
            .summary()
            .starts_with("4 pings, 3 pongs, 25% lost; rtt"));
        let mut silent = PingTally::default();
        silent.lost();
        silent.lost();
        silent.lost();
        assert_eq!(silent.summary(), "3 pings, 0 pongs, 100% lost");
        assert_eq!(PingTally::default().lost_percent(), 0);
    }

    #[test]
    fn json_has_the_documented_fields_in_order() {
        let server: SocketAddr = "127.0.0.1:7420".parse().unwrap();
        let mut tally = PingTally::default();
        tally.pong(micros(81));
        tally.pong(micros(99));
        let expected = r#"{"server":"127.0.0.1:7420","count":2,"received":2,"#.to_owned()
            + r#""rtt_ms":{"min":0.081,"avg":0.09,"max":0.099}}"#;
        assert_eq!(tally.json(server), expected);
        let mut silent = PingTally::default();
        silent.lost();
        let value: serde_json::Value = serde_json::from_str(&silent.json(server)).unwrap();
        assert_eq!(value["received"], 0);
        assert!(value["rtt_ms"]["min"].is_null() && value["rtt_ms"]["avg"].is_null());
    }

    #[test]
    fn intervals_parse_in_the_shared_syntax_up_to_an_hour() {
        assert_eq!(parse_interval("100ms"), Ok(Duration::from_millis(100)));
        assert_eq!(parse_interval("0"), Ok(Duration::ZERO));
        assert_eq!(parse_interval("1h"), Ok(INTERVAL_MAX));
        assert!(parse_interval("61m").is_err());
        assert!(parse_interval("1.5s").is_err());
    }
}
