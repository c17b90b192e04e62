//! `latchkey stats` and `latchkey keys`: the admin requests of docs/protocol.md §5 (`GET
//! /stats`, `GET /keys`) on the command line, rendered for people or passed through as JSON.
//!
//! With one `--server` item, a run makes one HTTP/1.1 request on the lock port. With several
//! (a cluster's members), it makes the same requests of every member at once (`gather.rs`)
//! and merges the answers (`merge.rs`): a member that does not answer is named on stderr and
//! costs one timeout; the exit code is 83 when the merged view may be incomplete. One request
//! connects within
//! `--transport-timeout`, writes `GET ... HTTP/1.1` with `Connection: close`, reads the answer
//! to its end within `--transport-timeout` more (at most 16 MiB of body), checks for
//! `HTTP/1.1 200` and parses the body with serde_json. `--json` prints the body as received.
//! With `--tls-ca` the request goes over TLS (blocking rustls on the same socket;
//! `--tls-cert`, `--tls-key` and `--tls-server-name` as for every command), the handshake
//! within that second `--transport-timeout` too. The text renderings are pure functions of the
//! parsed JSON: fields they do not know are ignored, fields that are missing show as `-`.
//!
//! Exit codes: 0; 2 for a malformed `--server` or TLS flags; 81 when the server refused the
//! session (too many sessions: `X` 7); 82 when the answer did not arrive whole within the
//! timeout (or the connection failed mid-answer); 83 when the server cannot be reached (or a
//! TLS file cannot be used, or the TLS handshake fails, as for the other commands); 84 when the
//! answer is not a 200 with the expected JSON (including "not a latchkey server" when it is not
//! HTTP); 83 too, with the words of `lock`, `query` and `ping`, when a TLS server answers a
//! plaintext request ("the server speaks TLS").
//!
//! Deliberately not here: HTTP beyond one `GET` answered with a length or by closing (no
//! keep-alive, chunked encoding or redirects), and retries (the caller decides).

use std::io::{self, Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::process::ExitCode;
use std::time::{Duration, Instant};

use rustls::{AlertDescription, ClientConnection, StreamOwned};
use serde_json::Value;

use super::messages::{tried_suffix, Tried, TLS_HINT};
use super::{
    fail_servers, format_duration, parse_server_items, shown_key, ConnectArgs, OutputArgs,
    EXIT_BUSY, EXIT_INDETERMINATE, EXIT_REJECTED, EXIT_UNAVAILABLE, EXIT_USAGE,
};
use latchkey_client::protocol::{parse_response, ErrorCode, Response};
use latchkey_client::tls::Connector;
use latchkey_client::SPEAKS_TLS;

pub(super) mod gather;
pub(super) mod merge;
mod render;

use gather::gather;
use merge::{merge_keys, merge_stats, MemberAnswer, MemberKeys};
use render::{render_keys, render_stats};

/// The largest answer body read (10,000 keys of 1 KiB are about 11 MiB of `/keys`).
const BODY_BYTES_MAX: usize = 16 << 20;
// A shard's copy for `latchkey cluster backup` fits an answer.
const _: () = assert!(crate::cluster::backup::SHARD_BACKUP_BYTES_MAX < BODY_BYTES_MAX);
/// The largest answer head read before its body.
const HEAD_BYTES_MAX: usize = 64 << 10;
/// Bytes read from the socket at a time.
const READ_CHUNK_BYTES: usize = 64 << 10;
/// The most keys one `GET /keys` lists (the server's bound on `limit`).
const KEYS_LIMIT_MAX: u32 = 10_000;
/// Characters of a refusal's body quoted in the message.
const REFUSAL_SHOWN_CHARS_MAX: usize = 200;
/// The first pause before a refused connection is tried again (`--retry-refused`).
const CONNECT_BACKOFF_MIN: Duration = Duration::from_millis(10);
/// The longest pause between two tries of a refused connection.
const CONNECT_BACKOFF_MAX: Duration = Duration::from_millis(250);
/// Loop iterations longer than this count as stalls in the `# Loop` section, in seconds.
const STALL_SECONDS: f64 = 0.001;

/// Arguments of `latchkey stats`.
#[derive(clap::Args, Debug, Clone)]
pub struct StatsArgs {
    /// The server and its transport timeout.
    #[command(flatten)]
    pub connect: ConnectArgs,
    /// Text or JSON.
    #[command(flatten)]
    pub output: OutputArgs,
}

/// Arguments of `latchkey keys`.
#[derive(clap::Args, Debug, Clone)]
pub struct KeysArgs {
    /// The server and its transport timeout.
    #[command(flatten)]
    pub connect: ConnectArgs,
    /// List only the held keys that start with PREFIX (all when left out).
    #[arg(value_name = "PREFIX", default_value = "", hide_default_value = true)]
    pub prefix: String,
    /// List at most N keys, 1 to 10000 (the first N in key order).
    #[arg(long, value_name = "N", default_value_t = 100,
          value_parser = clap::value_parser!(u32).range(1..=i64::from(KEYS_LIMIT_MAX)))]
    pub limit: u32,
    /// Text or JSON.
    #[command(flatten)]
    pub output: OutputArgs,
}

/// Why an admin request failed: the exit code and what to say.
#[derive(Debug, PartialEq, Eq)]
pub(super) struct Failure {
    pub(super) exit_code: u8,
    pub(super) message: String,
}

impl Failure {
    fn new(exit_code: u8, message: impl Into<String>) -> Failure {
        Failure {
            exit_code,
            message: message.into(),
        }
    }
}

/// `latchkey stats [--json]`: the server's figures (`GET /stats`), as sections like
/// `redis-cli INFO` (`# Server`, `# Sessions`, `# Locks`, `# Latency`, `# Busy`, `# Loop`) or,
/// with `--json`, the server's JSON object as received. With several `--server` items, every
/// member is asked and the figures merged (see `merge.rs`); exit 83 when one did not answer.
pub fn run_stats(args: StatsArgs) -> ExitCode {
    let items = match server_items("stats", &args.connect) {
        Ok(items) => items,
        Err(code) => return code,
    };
    if items.len() > 1 {
        return run_stats_of_members(&args, &items);
    }
    let (body, stats) = match get_json("stats", &args.connect, &items[0].1, "/stats") {
        Ok(found) => found,
        Err(code) => return code,
    };
    if !stats.is_object() {
        let message = "the answer to GET /stats is not a JSON object";
        return fail("stats", &Failure::new(EXIT_REJECTED, message));
    }
    if args.output.json {
        print_body(&body);
    } else {
        print!("{}", render_stats(&stats));
    }
    ExitCode::SUCCESS
}

/// `latchkey keys [PREFIX] [--limit N] [--json]`: who holds what (`GET /keys`), as a table
/// `KEY OWNER PEER HELD LEASE WAITERS` or, with `--json`, the server's JSON array as received.
/// With several `--server` items, every member is asked and the lists merged (each key once,
/// from its shard's leader); exit 83 when some shard has no leader among the members that
/// answered (its keys may be missing).
pub fn run_keys(args: KeysArgs) -> ExitCode {
    let items = match server_items("keys", &args.connect) {
        Ok(items) => items,
        Err(code) => return code,
    };
    let target = keys_target(&args.prefix, args.limit);
    if items.len() > 1 {
        return run_keys_of_members(&args, &items, &target);
    }
    let (body, keys) = match get_json("keys", &args.connect, &items[0].1, &target) {
        Ok(found) => found,
        Err(code) => return code,
    };
    let Some(keys) = keys.as_array() else {
        let message = "the answer to GET /keys is not a JSON array";
        return fail("keys", &Failure::new(EXIT_REJECTED, message));
    };
    if args.output.json {
        print_body(&body);
        return ExitCode::SUCCESS;
    }
    print_keys(&args, keys);
    ExitCode::SUCCESS
}

/// The table of `keys` (or why it is empty), and a note when the limit may have cut it.
fn print_keys(args: &KeysArgs, keys: &[Value]) {
    if keys.is_empty() {
        let prefix = &args.prefix;
        let starting = if prefix.is_empty() {
            String::new()
        } else {
            format!(" starting with `{}`", shown_key(prefix))
        };
        eprintln!("latchkey keys: no held keys{starting}");
        return;
    }
    print!("{}", render_keys(keys));
    if keys.len() >= args.limit as usize {
        let shown = keys.len();
        eprintln!(
            "latchkey keys: the first {shown} keys; more may be held \
             (--limit, at most {KEYS_LIMIT_MAX})"
        );
    }
}

/// `latchkey stats` of several members: every member's `/stats` at once, merged.
fn run_stats_of_members(args: &StatsArgs, items: &[(String, Vec<SocketAddr>)]) -> ExitCode {
    let tls = match connector("stats", &args.connect) {
        Ok(tls) => tls,
        Err(code) => return code,
    };
    let patience = Patience::of(&args.connect);
    let answers: Vec<MemberAnswer> = gather(items, &["/stats"], patience, tls.as_ref())
        .into_iter()
        .flatten()
        .collect();
    let failed = say_failed_members("stats", &answers);
    if failed == answers.len() {
        return ExitCode::from(EXIT_UNAVAILABLE);
    }
    let merged = merge_stats(&answers);
    if args.output.json {
        println!("{merged}");
    } else {
        print!("{}", render_stats(&merged));
    }
    match failed {
        0 => ExitCode::SUCCESS,
        _ => ExitCode::from(EXIT_UNAVAILABLE),
    }
}

/// `latchkey keys` of several members: every member's `/stats` (which shards it leads) and
/// `/keys` at once, merged.
fn run_keys_of_members(
    args: &KeysArgs,
    items: &[(String, Vec<SocketAddr>)],
    target: &str,
) -> ExitCode {
    let tls = match connector("keys", &args.connect) {
        Ok(tls) => tls,
        Err(code) => return code,
    };
    let patience = Patience::of(&args.connect);
    let answers = gather(items, &["/stats", target], patience, tls.as_ref());
    let lasts: Vec<MemberAnswer> = answers
        .iter()
        .map(|pair| MemberAnswer {
            item: pair[1].item.clone(),
            result: pair[1].result.clone(),
        })
        .collect();
    let failed = say_failed_members("keys", &lasts);
    let members: Vec<MemberKeys<'_>> = answers
        .iter()
        .filter_map(|pair| {
            let stats = pair[0].result.as_ref().ok()?;
            let keys = pair[1].result.as_ref().ok()?.as_array()?;
            Some(MemberKeys { stats, keys })
        })
        .collect();
    if members.is_empty() {
        if failed < answers.len() {
            let message = "no member answered GET /keys with a JSON array";
            return fail("keys", &Failure::new(EXIT_REJECTED, message));
        }
        return ExitCode::from(EXIT_UNAVAILABLE);
    }
    let merged = merge_keys(&members, args.limit as usize);
    if args.output.json {
        println!("{}", Value::Array(merged.keys.clone()));
    } else {
        print_keys(args, &merged.keys);
    }
    if merged.uncovered.is_empty() {
        return ExitCode::SUCCESS;
    }
    let count = merged.shard_count.unwrap_or(0);
    let shards: Vec<u32> = merged.uncovered.iter().map(|&s| s as u32).collect();
    eprintln!(
        "latchkey keys: {} of {count} shards have no leader among the members that answered \
         ({}): keys held there are not listed",
        shards.len(),
        crate::cluster::partition::shard_list(&shards)
    );
    ExitCode::from(EXIT_UNAVAILABLE)
}

/// Says which members did not answer; returns how many.
fn say_failed_members(command: &str, answers: &[MemberAnswer]) -> usize {
    let mut failed = 0;
    for answer in answers {
        if let Err(error) = &answer.result {
            eprintln!("latchkey {command}: {}: {error}", answer.item);
            failed += 1;
        }
    }
    failed
}

/// The `--server` items, one per member, or the exit code after saying why not.
fn server_items(
    command: &str,
    connect: &ConnectArgs,
) -> Result<Vec<(String, Vec<SocketAddr>)>, ExitCode> {
    parse_server_items(&connect.server).map_err(|failure| fail_servers(command, &failure))
}

/// Says `failure` and returns its exit code.
fn fail(command: &str, failure: &Failure) -> ExitCode {
    eprintln!("latchkey {command}: {}", failure.message);
    ExitCode::from(failure.exit_code)
}

fn print_body(body: &[u8]) {
    let mut stdout = io::stdout().lock();
    let _ = stdout.write_all(body);
    if !body.ends_with(b"\n") {
        let _ = stdout.write_all(b"\n");
    }
    let _ = stdout.flush();
}

/// `GET target` from the server at `addrs` (the first that accepts): the body and its JSON,
/// or the exit code after saying why not.
fn get_json(
    command: &str,
    connect: &ConnectArgs,
    addrs: &[SocketAddr],
    target: &str,
) -> Result<(Vec<u8>, Value), ExitCode> {
    let connector = connector(command, connect)?;
    let patience = Patience::of(connect);
    let body = fetch(addrs, target, patience, connector.as_ref()).map_err(|f| fail(command, &f))?;
    match serde_json::from_slice(&body) {
        Ok(value) => Ok((body, value)),
        Err(error) => {
            let message = format!("the answer to GET {target} is not JSON: {error}");
            Err(fail(command, &Failure::new(EXIT_REJECTED, message)))
        }
    }
}

/// The TLS of `--tls-ca` and the flags that go with it, or `None`; else the exit code after
/// saying why not (2 for flags that do not go together, 83 for a file that cannot be used, as
/// for the other commands).
pub(super) fn connector(
    command: &str,
    connect: &ConnectArgs,
) -> Result<Option<Connector>, ExitCode> {
    let tls = connect.tls().map_err(|message| {
        eprintln!("latchkey {command}: {message}");
        ExitCode::from(EXIT_USAGE)
    })?;
    tls.map(|tls| tls.connector())
        .transpose()
        .map_err(|error| fail(command, &Failure::new(EXIT_UNAVAILABLE, error.to_string())))
}

/// The connection of one request: plain TCP, or TLS over it.
enum AdminStream {
    Plain(TcpStream),
    Tls(Box<StreamOwned<ClientConnection, TcpStream>>),
}

impl AdminStream {
    /// The socket, for its timeouts.
    fn tcp(&self) -> &TcpStream {
        match self {
            AdminStream::Plain(tcp) => tcp,
            AdminStream::Tls(tls) => &tls.sock,
        }
    }
}

impl Read for AdminStream {
    fn read(&mut self, buffer: &mut [u8]) -> io::Result<usize> {
        match self {
            AdminStream::Plain(tcp) => tcp.read(buffer),
            AdminStream::Tls(tls) => tls.read(buffer),
        }
    }
}

impl Write for AdminStream {
    fn write(&mut self, bytes: &[u8]) -> io::Result<usize> {
        match self {
            AdminStream::Plain(tcp) => tcp.write(bytes),
            AdminStream::Tls(tls) => tls.write(bytes),
        }
    }

    fn flush(&mut self) -> io::Result<()> {
        match self {
            AdminStream::Plain(tcp) => tcp.flush(),
            AdminStream::Tls(tls) => tls.flush(),
        }
    }
}

/// How long one admin request may take (its connect, then its answer), and whether a refused
/// connection is tried again within that (`--retry-refused`).
#[derive(Clone, Copy, Debug)]
pub(super) struct Patience {
    /// `--transport-timeout`.
    pub timeout: Duration,
    /// `--retry-refused`.
    pub retry_refused: bool,
}

impl Patience {
    /// What `connect`'s flags allow.
    pub(super) fn of(connect: &ConnectArgs) -> Patience {
        Patience {
            timeout: connect.transport_timeout,
            retry_refused: connect.retry_refused,
        }
    }
}

impl From<Duration> for Patience {
    /// `timeout`, a refused connection not tried again.
    fn from(timeout: Duration) -> Patience {
        Patience {
            timeout,
            retry_refused: false,
        }
    }
}

/// Connects to the first of `addrs` that accepts (over TLS with `tls`), sends `GET target` and
/// returns the body of a 200 answer. Each failure names the address.
pub(super) fn fetch(
    addrs: &[SocketAddr],
    target: &str,
    patience: impl Into<Patience>,
    tls: Option<&Connector>,
) -> Result<Vec<u8>, Failure> {
    let patience = patience.into();
    let timeout = patience.timeout;
    let (tcp, addr) = connect(addrs, patience)?;
    // Said as the other commands say it: a failure to reach the server (nothing was served),
    // or what the server did.
    let named = |failure: Failure| {
        let message = match failure.exit_code {
            EXIT_UNAVAILABLE => format!("cannot reach the server: {addr}: {}", failure.message),
            _ => format!("{addr}: {}", failure.message),
        };
        Failure::new(failure.exit_code, message)
    };
    let deadline = Instant::now() + timeout;
    let mut stream = match tls {
        None => AdminStream::Plain(tcp),
        Some(tls) => match tls.handshake(tcp, addr, deadline) {
            Ok(tls) => AdminStream::Tls(Box::new(tls)),
            Err(error) => {
                let message = format!("cannot reach the server: {addr}: TLS handshake: {error}");
                return Err(Failure::new(EXIT_UNAVAILABLE, message));
            }
        },
    };
    let request = format!("GET {target} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\r\n");
    let sent = stream
        .tcp()
        .set_write_timeout(Some(timeout))
        .and_then(|()| stream.write_all(request.as_bytes()))
        .and_then(|()| stream.flush());
    if let Err(error) = sent {
        let message = format!("cannot send the request: {}", io_cause(&error));
        return Err(named(Failure::new(EXIT_INDETERMINATE, message)));
    }
    let answer = read_answer(&mut stream, deadline).map_err(named)?;
    answer_body(&answer).map(<[u8]>::to_vec).map_err(named)
}

/// A connection to the first of `addrs` that accepts, all tried within the timeout together;
/// with `retry_refused`, again after a refusal (backing off 10 ms doubling, at most 250 ms)
/// until the timeout has run out.
fn connect(addrs: &[SocketAddr], patience: Patience) -> Result<(TcpStream, SocketAddr), Failure> {
    let start = Instant::now();
    let deadline = start + patience.timeout;
    let mut backoff = CONNECT_BACKOFF_MIN;
    // Bounded: a pass tries each address once; another pass follows only a refusal, with
    // `retry_refused`, and only before the deadline.
    loop {
        let (addr, error) = match connect_once(addrs, deadline) {
            Ok(found) => return Ok(found),
            Err(failed) => failed,
        };
        let refused = error.kind() == io::ErrorKind::ConnectionRefused;
        let left = deadline.saturating_duration_since(Instant::now());
        let again = patience.retry_refused && refused && !left.is_zero();
        if !again {
            let cause = match error.kind() {
                io::ErrorKind::TimedOut | io::ErrorKind::WouldBlock => "timed out".to_owned(),
                kind => kind.to_string(),
            };
            let timeout = format_duration(patience.timeout);
            let tried = Tried {
                elapsed: start.elapsed(),
                allowance: format!("--transport-timeout {timeout}"),
                retry_refused: patience.retry_refused,
            };
            let tried = tried_suffix(refused, &tried);
            let message =
                format!("cannot reach the server: {addr}: cannot connect: {cause} {tried}");
            return Err(Failure::new(EXIT_UNAVAILABLE, message));
        }
        std::thread::sleep(backoff.min(left));
        backoff = (backoff * 2).min(CONNECT_BACKOFF_MAX);
    }
}

/// One pass over `addrs` before `deadline`: a connection, or the last address's error.
fn connect_once(
    addrs: &[SocketAddr],
    deadline: Instant,
) -> Result<(TcpStream, SocketAddr), (SocketAddr, io::Error)> {
    let mut failure = None;
    for &addr in addrs {
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() && failure.is_some() {
            break;
        }
        // `connect_timeout` refuses a zero timeout: the first address always gets a try.
        let left = left.max(Duration::from_millis(1));
        match TcpStream::connect_timeout(&addr, left) {
            Ok(stream) => return Ok((stream, addr)),
            Err(error) => failure = Some((addr, error)),
        }
    }
    Err(failure.expect("server_addrs gives at least one address"))
}

/// Reads until the server closes the connection, the deadline passes or the answer is too
/// large, or as soon as it cannot be HTTP (a server of another protocol may keep the
/// connection open). What came before a reset still counts: a server that refuses may reset
/// right after its answer.
fn read_answer(stream: &mut AdminStream, deadline: Instant) -> Result<Vec<u8>, Failure> {
    let mut answer = Vec::new();
    let mut chunk = vec![0; READ_CHUNK_BYTES];
    loop {
        let Some(left) = deadline
            .checked_duration_since(Instant::now())
            .filter(|left| !left.is_zero())
        else {
            return Err(unanswered());
        };
        stream
            .tcp()
            .set_read_timeout(Some(left))
            .map_err(|_| unanswered())?;
        match stream.read(&mut chunk) {
            Ok(0) => return Ok(answer),
            Ok(read) if surely_not_http(&answer, &chunk[..read]) => {
                answer.extend_from_slice(&chunk[..read]);
                return Ok(answer);
            }
            Ok(read) => answer.extend_from_slice(&chunk[..read]),
            Err(error) if error.kind() == io::ErrorKind::Interrupted => {}
            Err(error)
                if matches!(
                    error.kind(),
                    io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut
                ) =>
            {
                return Err(unanswered());
            }
            Err(_) if !answer.is_empty() => return Ok(answer),
            Err(error) => {
                if let Some(failure) = tls_failure(&error) {
                    return Err(failure);
                }
                let message = format!(
                    "the connection failed before an answer: {}",
                    io_cause(&error)
                );
                return Err(Failure::new(EXIT_INDETERMINATE, message));
            }
        }
        if answer.len() > HEAD_BYTES_MAX + BODY_BYTES_MAX {
            let message = format!("the answer is larger than {} MiB", BODY_BYTES_MAX >> 20);
            return Err(Failure::new(EXIT_REJECTED, message));
        }
    }
}

/// Whether `answer` followed by `more` cannot begin an HTTP answer, and is not the start of a
/// latchkey `X` frame still coming (whose code the message names) or of a TLS record's
/// header.
fn surely_not_http(answer: &[u8], more: &[u8]) -> bool {
    const HTTP: &[u8] = b"HTTP/1.";
    let start: Vec<u8> = answer
        .iter()
        .chain(more)
        .take(HTTP.len())
        .copied()
        .collect();
    // `X`, code, id (8 bytes), `\n` (docs/protocol.md §2.2).
    const ERROR_FRAME_BYTES: usize = 11;
    let received = answer.len() + more.len();
    let error_frame_coming = start.first() == Some(&b'X') && received < ERROR_FRAME_BYTES;
    // A TLS record's type and version (what `not_http` recognizes).
    let tls_record_coming = matches!(start.first(), Some(21 | 22)) && received < 3;
    !HTTP.starts_with(&start) && !error_frame_coming && !tls_record_coming
}

/// An I/O error's cause in words: its kind, or for a TLS error what rustls said.
fn io_cause(error: &io::Error) -> String {
    match error.kind() {
        io::ErrorKind::InvalidData => format!("TLS: {error}"),
        kind => kind.to_string(),
    }
}

/// A TLS error of the session before any answer, as a failure to reach the server: over TLS
/// 1.3 the server checks the client's certificate after the client's side of the handshake,
/// so a refused or missing certificate shows here.
fn tls_failure(error: &io::Error) -> Option<Failure> {
    let tls = error.get_ref()?.downcast_ref::<rustls::Error>()?;
    let hint = match tls {
        rustls::Error::AlertReceived(AlertDescription::CertificateRequired) => {
            " (it wants a client certificate: --tls-cert and --tls-key)"
        }
        rustls::Error::AlertReceived(_) => " (did it refuse the client certificate?)",
        _ => "",
    };
    let message = format!("the TLS session failed before an answer: {tls}{hint}");
    Some(Failure::new(EXIT_UNAVAILABLE, message))
}

fn unanswered() -> Failure {
    let message = "no complete answer within --transport-timeout";
    Failure::new(EXIT_INDETERMINATE, message)
}

/// The body of a whole `HTTP/1.x 200` answer (cut to its `Content-Length`), or why there is
/// none.
fn answer_body(answer: &[u8]) -> Result<&[u8], Failure> {
    if !answer.starts_with(b"HTTP/1.") {
        return Err(not_http(answer));
    }
    let Some(head_end) = answer.windows(4).position(|window| window == b"\r\n\r\n") else {
        return Err(Failure::new(
            EXIT_REJECTED,
            "the HTTP answer has no end of head",
        ));
    };
    let head = String::from_utf8_lossy(&answer[..head_end]);
    let body = &answer[head_end + 4..];
    let status_line = head.lines().next().unwrap_or_default();
    let status = status_line.split(' ').nth(1).unwrap_or_default();
    if status != "200" {
        let shown = status_line.split_once(' ').map_or("", |(_, rest)| rest);
        let reason: String = String::from_utf8_lossy(body)
            .lines()
            .next()
            .unwrap_or_default()
            .chars()
            .take(REFUSAL_SHOWN_CHARS_MAX)
            .collect();
        let message = format!("the server answered `{shown}`: {}", reason.trim());
        return Err(Failure::new(EXIT_REJECTED, message));
    }
    match content_length(&head)? {
        Some(length) if body.len() < length => {
            let message = format!("the answer was cut short: {} of {length} bytes", body.len());
            Err(Failure::new(EXIT_INDETERMINATE, message))
        }
        Some(length) => Ok(&body[..length]),
        None => Ok(body),
    }
}

/// The `Content-Length` of an answer's head, if it has one.
fn content_length(head: &str) -> Result<Option<usize>, Failure> {
    for line in head.lines().skip(1) {
        let Some((name, value)) = line.split_once(':') else {
            continue;
        };
        if name.trim().eq_ignore_ascii_case("content-length") {
            let malformed = || Failure::new(EXIT_REJECTED, "the HTTP answer's length is malformed");
            return value.trim().parse().map(Some).map_err(|_| malformed());
        }
    }
    Ok(None)
}

/// Why an answer that is not HTTP is not what was asked for.
fn not_http(answer: &[u8]) -> Failure {
    if answer.is_empty() {
        return Failure::new(
            EXIT_INDETERMINATE,
            "the server closed the connection without an answer",
        );
    }
    if is_tls_record(answer) {
        // The words of every client (latchkey_client::SPEAKS_TLS), and the same exit code as
        // `lock`, `query` and `ping`: nothing was served.
        let message = format!("{SPEAKS_TLS}: connect with TLS, trusting its CA {TLS_HINT}");
        return Failure::new(EXIT_UNAVAILABLE, message);
    }
    match parse_response(answer) {
        Ok(Some((
            Response::Error {
                code: ErrorCode::SessionRefused,
                ..
            },
            _,
        ))) => Failure::new(
            EXIT_BUSY,
            "the server refused the session: it has too many (X 7)",
        ),
        Ok(Some((Response::Error { code, .. }, _))) => Failure::new(
            EXIT_REJECTED,
            format!(
                "a latchkey server without the admin requests (older than this client?): \
                 it answered error {code}"
            ),
        ),
        _ => {
            let start: String = String::from_utf8_lossy(&answer[..answer.len().min(16)])
                .escape_debug()
                .collect();
            let message = format!("not a latchkey server: the answer is not HTTP (`{start}`)");
            Failure::new(EXIT_REJECTED, message)
        }
    }
}

/// Whether `answer` starts like a TLS record: an alert (21) or a handshake (22), then version
/// 3.x (what a TLS server sends a client that does not speak TLS, before it closes).
fn is_tls_record(answer: &[u8]) -> bool {
    matches!(answer, [21 | 22, 3, minor, ..] if *minor <= 4)
}

/// `/keys?prefix=P&limit=N` with `prefix` percent-encoded (every byte but letters, digits,
/// `-._~` and `/`).
fn keys_target(prefix: &str, limit: u32) -> String {
    let mut target = String::from("/keys?prefix=");
    for &byte in prefix.as_bytes() {
        if byte.is_ascii_alphanumeric() || b"-._~/".contains(&byte) {
            target.push(char::from(byte));
        } else {
            target.push_str(&format!("%{byte:02X}"));
        }
    }
    target.push_str(&format!("&limit={limit}"));
    target
}

#[cfg(test)]
mod tests;
