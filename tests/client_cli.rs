//! `latchkey lock`, `query` and `ping`: in-process through their `run_*` functions (against
//! the real server, or a scripted one to force a lost lease), as the `latchkey` binary, and
//! their argument parsing through clap.

use std::ffi::OsString;
use std::path::PathBuf;
use std::process::{Command, ExitCode};
use std::thread;
use std::time::{Duration, Instant};

use clap::Parser;
use common::proxy::Proxy;
use common::server::TempDir;
use common::{client, dead_addr, start_server, FakeServer, Frame, Got};
use latchkey::cli::{self, ConnectArgs, LockArgs, PingArgs, QueryArgs};
use latchkey_client::protocol::{ErrorCode, Response};

fn ms(millis: u64) -> Duration {
    Duration::from_millis(millis)
}

fn same(code: ExitCode, expected: u8) -> bool {
    format!("{code:?}") == format!("{:?}", ExitCode::from(expected))
}

#[track_caller]
fn assert_exit(code: ExitCode, expected: u8) {
    assert!(same(code, expected), "exit {code:?}, expected {expected}");
}

fn lock_args(server: String, key: &str, wait: Duration, lease: Duration, script: &str) -> LockArgs {
    LockArgs {
        connect: ConnectArgs::new(server),
        wait,
        lease,
        grace: ms(500),
        conflict_exit_code: None,
        failure_exit_code: None,
        quiet: false,
        key: key.to_owned(),
        command: ["sh", "-c", script].iter().map(OsString::from).collect(),
    }
}

/// The real server with `key` held for 30 s by another client (the ticket).
fn server_holding(key: &str) -> (latchkey::server::ServerHandle, latchkey_client::Ticket) {
    let server = start_server(|_| {});
    let observer = client(&[server.local_addr()], 1, Duration::from_secs(2));
    let holder = observer
        .acquire(key, ms(100), Duration::from_secs(30))
        .unwrap();
    (server, holder)
}

/// A path for one test's file `name`, in a directory removed when the test ends.
fn scratch(name: &str) -> (TempDir, PathBuf) {
    let dir = TempDir::new("client-cli");
    let path = dir.path().join(name);
    (dir, path)
}

#[test]
fn lock_runs_the_command_with_key_and_token_and_exits_with_its_status() {
    let server = start_server(|_| {});
    let (_dir, out) = scratch("env");
    let script = format!(
        "echo \"$LATCHKEY_KEY $LATCHKEY_TOKEN\" > {}; exit 3",
        out.display()
    );
    let args = lock_args(
        server.local_addr().to_string(),
        "jobs/x",
        ms(500),
        ms(5000),
        &script,
    );
    assert_exit(cli::run_lock(args), 3);
    let written = std::fs::read_to_string(&out).unwrap();
    let (key, token) = written.trim().split_once(' ').unwrap();
    assert_eq!(key, "jobs/x");
    assert!(token.parse::<u64>().unwrap() > 0);
    let observer = client(&[server.local_addr()], 1, Duration::from_secs(2));
    assert!(
        !observer.query("jobs/x").unwrap().held,
        "released when the command exited"
    );
}

#[test]
fn lock_extends_the_lease_while_the_command_runs() {
    let server = start_server(|_| {});
    let args = lock_args(
        server.local_addr().to_string(),
        "long",
        ms(500),
        ms(1000),
        "sleep 2.5",
    );
    let observer = client(&[server.local_addr()], 1, Duration::from_secs(2));
    let running = thread::spawn(move || cli::run_lock(args));
    thread::sleep(ms(1800));
    assert!(
        observer.query("long").unwrap().held,
        "still held past the first lease"
    );
    assert_exit(running.join().unwrap(), 0);
}

#[test]
fn lock_exit_codes_for_timeout_busy_unavailable_and_missing_command() {
    let server = start_server(|config| config.limits.max_waiters_per_key = 1);
    let addr = server.local_addr().to_string();
    let observer = client(&[server.local_addr()], 1, Duration::from_secs(2));
    let holder = observer
        .acquire("taken", ms(100), Duration::from_secs(30))
        .unwrap();
    let (_dir, ran) = scratch("ran");
    let script = format!("touch {}", ran.display());
    let args = lock_args(addr.clone(), "taken", ms(300), ms(5000), &script);
    assert_exit(cli::run_lock(args), cli::EXIT_TIMEOUT);
    assert!(!ran.exists(), "the command never ran");

    let queued = {
        let observer = observer.clone();
        thread::spawn(move || observer.acquire("taken", Duration::from_secs(3), ms(1000)))
    };
    thread::sleep(ms(200));
    let args = lock_args(addr.clone(), "taken", ms(300), ms(5000), "true");
    assert_exit(cli::run_lock(args), cli::EXIT_BUSY);
    drop(holder);
    drop(queued.join().unwrap());

    let args = lock_args(dead_addr().to_string(), "k", ms(300), ms(5000), "true");
    assert_exit(cli::run_lock(args), cli::EXIT_UNAVAILABLE);

    let mut args = lock_args(addr, "missing", ms(300), ms(5000), "true");
    args.command = vec![OsString::from("/nonexistent/latchkey-test-command")];
    assert_exit(cli::run_lock(args), cli::EXIT_NOT_FOUND);
    assert!(
        !observer.query("missing").unwrap().held,
        "released after the failed spawn"
    );
}

/// Serves one lock call: grants, then answers the first Extend with `extend_answer` (or
/// never, when `None`). Returns the frames read after that.
fn grant_then(server: FakeServer, extend_answer: Option<fn(u64) -> Response>) -> Vec<Frame> {
    let mut conn = server.accept();
    let (owner, _, _, _) = conn.acquire();
    conn.send(Response::Acquired { owner, token: 501 });
    let Frame::Extend { token, .. } = conn.frame() else {
        panic!("expected an extend")
    };
    if let Some(answer) = extend_answer {
        conn.send(answer(token));
    }
    let mut rest = Vec::new();
    while let Got::Frame(frame) = conn.read_frame(ms(2500)) {
        rest.push(frame);
    }
    rest
}

#[test]
fn a_lost_lease_terminates_the_command_and_exits_85() {
    let server = FakeServer::start();
    let addr = server.addr().to_string();
    let serving =
        thread::spawn(move || grant_then(server, Some(|token| Response::NotHeld { token })));
    let start = Instant::now();
    let args = lock_args(addr, "lost", ms(500), ms(1000), "exec sleep 30");
    assert_exit(cli::run_lock(args), cli::EXIT_LEASE_LOST);
    assert!(
        start.elapsed() < Duration::from_secs(10),
        "SIGTERM ended the command"
    );
    serving.join().unwrap();
}

#[test]
fn no_confirmed_extend_before_the_validity_bound_counts_as_lost() {
    let server = FakeServer::start();
    let addr = server.addr().to_string();
    let serving = thread::spawn(move || grant_then(server, None));
    let start = Instant::now();
    let args = lock_args(addr, "silent", ms(500), ms(1000), "exec sleep 30");
    assert_exit(cli::run_lock(args), cli::EXIT_LEASE_LOST);
    // Bound: the A's read + 1 s - 100 ms; the command is signalled then, not before.
    assert!(start.elapsed() >= ms(900));
    assert!(start.elapsed() < Duration::from_secs(10));
    serving.join().unwrap();
}

#[test]
fn an_extend_refused_as_forbidden_is_not_retried_and_the_lease_runs_out() {
    let server = FakeServer::start();
    let addr = server.addr().to_string();
    let forbidden = |token| Response::Error {
        code: ErrorCode::Forbidden,
        id: token,
    };
    let serving = thread::spawn(move || grant_then(server, Some(forbidden)));
    let start = Instant::now();
    let args = lock_args(addr, "revoked", ms(500), ms(1000), "exec sleep 30");
    assert_exit(cli::run_lock(args), cli::EXIT_LEASE_LOST);
    // Lost at the validity bound (the A's read + 1 s - 100 ms), not at the refusal (lease/3).
    assert!(start.elapsed() >= ms(900));
    assert!(start.elapsed() < Duration::from_secs(10));
    let rest = serving.join().unwrap();
    assert!(
        !rest
            .iter()
            .any(|frame| matches!(frame, Frame::Extend { .. })),
        "no extend after the refusal: {rest:?}"
    );
}

#[test]
fn a_command_ignoring_sigterm_is_killed_after_the_grace() {
    let server = FakeServer::start();
    let addr = server.addr().to_string();
    let serving =
        thread::spawn(move || grant_then(server, Some(|token| Response::NotHeld { token })));
    let start = Instant::now();
    let args = lock_args(
        addr,
        "stubborn",
        ms(500),
        ms(1000),
        "trap '' TERM; exec sleep 30",
    );
    assert_exit(cli::run_lock(args), cli::EXIT_LEASE_LOST);
    // Lost at the first extend (lease/3), then the 500 ms grace before SIGKILL.
    assert!(start.elapsed() >= ms(333 + 500));
    assert!(start.elapsed() < Duration::from_secs(10));
    serving.join().unwrap();
}

#[test]
fn query_and_ping_exit_codes() {
    let server = start_server(|_| {});
    let addr = server.local_addr().to_string();
    let query = QueryArgs {
        connect: ConnectArgs::new(addr.clone()),
        key: "q".into(),
    };
    assert_exit(cli::run_query(query), 0);
    assert_exit(
        cli::run_ping(PingArgs {
            connect: ConnectArgs::new(addr),
            count: 2,
        }),
        0,
    );
    let dead = dead_addr().to_string();
    let query = QueryArgs {
        connect: ConnectArgs::new(dead.clone()),
        key: "q".into(),
    };
    assert_exit(cli::run_query(query), cli::EXIT_UNAVAILABLE);
    assert_exit(
        cli::run_ping(PingArgs {
            connect: ConnectArgs::new(dead),
            count: 1,
        }),
        cli::EXIT_UNAVAILABLE,
    );
    let bad = QueryArgs {
        connect: ConnectArgs::new("not an address"),
        key: "q".into(),
    };
    assert_exit(cli::run_query(bad), cli::EXIT_USAGE);
}

#[derive(Parser, Debug)]
struct Lock {
    #[command(flatten)]
    args: LockArgs,
}

#[test]
fn lock_arguments_parse_as_documented() {
    let parsed = Lock::try_parse_from(["lock", "--wait", "500ms", "k", "--", "echo", "-n", "hi"])
        .unwrap()
        .args;
    let server = std::env::var("LATCHKEY_SERVER").unwrap_or("127.0.0.1:7420".into());
    assert_eq!(parsed.connect.server, server);
    assert_eq!(parsed.connect.transport_timeout, Duration::from_secs(5));
    assert_eq!(parsed.wait, ms(500));
    assert_eq!(parsed.lease, Duration::from_secs(30));
    assert_eq!(parsed.key, "k");
    assert_eq!(parsed.command, ["echo", "-n", "hi"].map(OsString::from));
    let defaults = Lock::try_parse_from(["lock", "k", "--", "true"])
        .unwrap()
        .args;
    assert_eq!(defaults.wait, Duration::from_secs(10));
    let bare = Lock::try_parse_from([
        "lock", "--wait", "10", "--grace", "500us", "k", "--", "true",
    ])
    .unwrap()
    .args;
    assert_eq!(
        (bare.wait, bare.grace),
        (Duration::from_secs(10), Duration::from_micros(500))
    );

    let refused = [
        vec!["lock", "k"],
        vec!["lock", "k", "true"],
        vec!["lock", "--wait", "1.5s", "k", "--", "true"],
        vec!["lock", "--wait", "256s", "k", "--", "true"],
        vec!["lock", "--lease", "0s", "k", "--", "true"],
        vec!["lock", "--lease", "5m", "k", "--", "true"],
        vec!["lock", "", "--", "true"],
    ];
    for argv in refused {
        let error = Lock::try_parse_from(&argv).unwrap_err();
        assert_eq!(error.exit_code(), i32::from(cli::EXIT_USAGE), "{argv:?}");
    }
}

// ---------------------------------------------------------------------------------------------
// The binary.

fn latchkey(args: &[&str]) -> Command {
    let mut command = Command::new(env!("CARGO_BIN_EXE_latchkey"));
    // Whatever the environment of the test run says, the tests name their servers.
    command.env_remove("LATCHKEY_SERVER").args(args);
    command
}

#[test]
fn the_binary_runs_a_command_under_a_lock_and_reports_state() {
    let server = start_server(|_| {});
    let addr = server.local_addr().to_string();
    let script = "echo \"$LATCHKEY_KEY:$LATCHKEY_TOKEN\"; exit 7";
    let output = latchkey(&["lock", "--server", &addr, "--wait", "2s", "--lease", "5s"])
        .args(["jobs/bin", "--", "sh", "-c", script])
        .output()
        .unwrap();
    assert_eq!(output.status.code(), Some(7));
    let stdout = String::from_utf8(output.stdout).unwrap();
    let (key, token) = stdout.trim().split_once(':').unwrap();
    assert_eq!(key, "jobs/bin");
    assert!(token.parse::<u64>().unwrap() > 0);

    let output = latchkey(&["query", "--server", &addr, "jobs/bin"])
        .output()
        .unwrap();
    assert!(output.status.success());
    assert_eq!(
        String::from_utf8(output.stdout).unwrap(),
        "held=0 lease_ms=0 waiters=0\n"
    );
    let output = latchkey(&["ping", "--server", &addr]).output().unwrap();
    assert!(output.status.success());
    assert!(String::from_utf8(output.stdout)
        .unwrap()
        .starts_with("pong from "));
}

/// A scripted server that answers the first request of one session, which must be for `key`,
/// with `X` 8 (as a server whose rules refuse the key to this identity), then waits for the
/// client to close.
fn forbid_first(key: &'static str) -> (String, thread::JoinHandle<()>) {
    let server = FakeServer::start();
    let addr = server.addr().to_string();
    let serving = thread::spawn(move || {
        let mut conn = server.accept();
        let id = match conn.frame() {
            Frame::Acquire { owner, key: k, .. } if k == key => owner,
            Frame::Query { nonce, key: k } if k == key => nonce,
            other => panic!("expected a request for {key}, got {other:?}"),
        };
        let code = ErrorCode::Forbidden;
        conn.send(Response::Error { code, id });
        conn.expect_eof(Duration::from_secs(10));
    });
    (addr, serving)
}

#[test]
fn a_forbidden_key_exits_84_and_names_the_key() {
    let (addr, serving) = forbid_first("secret/payroll");
    let (_dir, ran) = scratch("forbidden-ran");
    let output = latchkey(&["lock", "--server", &addr, "--wait", "0", "secret/payroll"])
        .args(["--", "touch"])
        .arg(&ran)
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert_eq!(output.status.code(), Some(84), "{stderr}");
    assert!(
        stderr.contains("latchkey lock: secret/payroll: "),
        "{stderr}"
    );
    assert!(stderr.contains("forbidden for this identity"), "{stderr}");
    assert!(!ran.exists(), "the command never ran");
    serving.join().unwrap();

    let (addr, serving) = forbid_first("secret/payroll");
    let output = latchkey(&["query", "--server", &addr, "secret/payroll"])
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert_eq!(output.status.code(), Some(84), "{stderr}");
    assert!(
        stderr.contains("latchkey query: secret/payroll: "),
        "{stderr}"
    );
    assert!(stderr.contains("forbidden for this identity"), "{stderr}");
    serving.join().unwrap();
}

#[test]
fn the_binary_exit_codes_for_usage_and_timeout() {
    let server = start_server(|_| {});
    let addr = server.local_addr().to_string();
    let status = latchkey(&["lock", "--server", &addr, "k"])
        .status()
        .unwrap();
    assert_eq!(
        status.code(),
        Some(i32::from(cli::EXIT_USAGE)),
        "no command"
    );
    let status = latchkey(&["lock", "--wait", "1.5s", "k", "--", "true"])
        .status()
        .unwrap();
    assert_eq!(
        status.code(),
        Some(i32::from(cli::EXIT_USAGE)),
        "bad duration"
    );
    let observer = client(&[server.local_addr()], 1, Duration::from_secs(2));
    let _holder = observer
        .acquire("k", ms(100), Duration::from_secs(30))
        .unwrap();
    let status = latchkey(&[
        "lock", "--server", &addr, "--wait", "300ms", "k", "--", "true",
    ])
    .status()
    .unwrap();
    assert_eq!(status.code(), Some(i32::from(cli::EXIT_TIMEOUT)));
}

#[test]
fn the_binary_forwards_sigterm_to_the_command_then_releases() {
    let server = start_server(|_| {});
    let addr = server.local_addr().to_string();
    let script = "trap 'exit 9' TERM; while :; do sleep 0.05; done";
    let mut lock = latchkey(&["lock", "--server", &addr, "--lease", "5s", "sig"])
        .args(["--", "sh", "-c", script])
        .spawn()
        .unwrap();
    let observer = client(&[server.local_addr()], 1, Duration::from_secs(2));
    let until = Instant::now() + Duration::from_secs(10);
    while !observer.query("sig").unwrap().held {
        assert!(Instant::now() < until, "the lock was never taken");
        thread::sleep(ms(20));
    }
    thread::sleep(ms(200));
    // SAFETY: kill has no memory effects; the pid is our own unreaped child.
    unsafe { libc::kill(lock.id() as libc::pid_t, libc::SIGTERM) };
    let status = lock.wait().unwrap();
    assert_eq!(status.code(), Some(9), "the command's own status");
    assert!(
        !observer.query("sig").unwrap().held,
        "released after the command exited"
    );
}

/// Every answer comes `delay` late. A session's first round trip is its handshake ping, so
/// its first request goes out one `delay` after the connect and is answered after two.
fn slow_link(server: &latchkey::server::ServerHandle, delay: Duration) -> Proxy {
    let proxy = Proxy::start(server.local_addr());
    proxy.delay_down(delay);
    proxy
}

#[test]
fn over_a_slow_link_wait_zero_gets_its_five_second_transport_deadline() {
    // Handshake pong at 1.5 s, the A at 3 s: within the 5 s transport timeout of §4.2.
    let server = start_server(|_| {});
    let proxy = slow_link(&server, ms(1500));
    let addr = proxy.addr().to_string();
    let output = latchkey(&["lock", "--server", &addr, "--wait", "0", "free"])
        .args(["--", "sh", "-c", "echo ran"])
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert_eq!(output.status.code(), Some(0), "{stderr}");
    assert_eq!(String::from_utf8_lossy(&output.stdout), "ran\n");
    // A shorter transport timeout than the link needs: the session is up (1.5 s) and the
    // acquire goes out, but its grant is not seen in time (3 s > 2.5 s).
    let output = latchkey(&["lock", "--server", &addr, "--wait", "0"])
        .args(["--transport-timeout", "2500ms", "free2", "--", "true"])
        .output()
        .unwrap();
    assert_eq!(
        output.status.code(),
        Some(i32::from(cli::EXIT_INDETERMINATE)),
        "{}",
        String::from_utf8_lossy(&output.stderr)
    );
}

#[test]
fn over_a_slow_link_a_timeout_read_after_the_cancel_is_definitive() {
    // Handshake pong at 1 s; the acquire queues until the deadline (2.5 s), then the Cancel's
    // T leaves the server and is read 1 s later, within its 5 s allowance.
    let (server, _holder) = server_holding("held");
    let proxy = slow_link(&server, ms(1000));
    let addr = proxy.addr().to_string();
    let start = Instant::now();
    let output = latchkey(&["lock", "--server", &addr, "--wait", "2500ms", "held"])
        .args(["--", "true"])
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert_eq!(
        output.status.code(),
        Some(i32::from(cli::EXIT_TIMEOUT)),
        "{stderr}"
    );
    // The T is read about 1 s after the deadline.
    assert!(start.elapsed() >= ms(3500), "{:?}", start.elapsed());
}

#[test]
fn lock_retrying_a_stopped_server_says_where_and_why_at_once_and_at_the_end() {
    use std::io::{BufRead, BufReader};
    let dead = dead_addr().to_string();
    let start = Instant::now();
    let mut lock = latchkey(&["lock", "--server", &dead, "--wait", "2s", "--retry-refused"])
        .args(["k", "--", "true"])
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let mut lines = BufReader::new(lock.stderr.take().unwrap()).lines();
    let notice = lines.next().unwrap().unwrap();
    let noticed_after = start.elapsed();
    assert_eq!(
        notice,
        format!(
            "latchkey lock: {dead}: cannot connect: connection refused; \
             retrying until --wait 2s runs out"
        )
    );
    assert!(noticed_after < ms(1500), "said at once: {noticed_after:?}");
    let last: Vec<String> = lines.map(Result::unwrap).collect();
    assert_eq!(last.len(), 1, "{last:?}");
    let said = format!(
        "latchkey lock: k: cannot reach the server: {dead}: cannot connect: connection refused \
         (tried for "
    );
    assert!(last[0].starts_with(&said), "{last:?}");
    assert!(last[0].ends_with(" s of --wait 2s)"), "{last:?}");
    let status = lock.wait().unwrap();
    assert_eq!(status.code(), Some(i32::from(cli::EXIT_UNAVAILABLE)));
    assert!(
        start.elapsed() >= ms(2000),
        "§4.2: retried until the deadline"
    );
}

#[test]
fn ping_and_query_against_something_else_say_it_is_not_a_latchkey_server() {
    // The handshake ping meets the foreign answer, so nothing else was sent: unavailable (83),
    // at once (another attempt would meet the same answer).
    let addr = common::not_latchkey_server(Duration::from_secs(5)).to_string();
    let cause = "not a latchkey server: it answered bytes that are not latchkey frames";
    let start = Instant::now();
    let output = latchkey(&["ping", "--server", &addr]).output().unwrap();
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(
        stderr.starts_with(&format!(
            "latchkey ping: cannot reach the server: {addr}: {cause}"
        )),
        "{stderr}"
    );
    assert_eq!(output.status.code(), Some(i32::from(cli::EXIT_UNAVAILABLE)));
    assert!(start.elapsed() < ms(4000), "not retried until the deadline");
    let output = latchkey(&["query", "--server", &addr, "k"])
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(
        stderr.starts_with(&format!(
            "latchkey query: k: cannot reach the server: {addr}: {cause}"
        )),
        "{stderr}"
    );
    assert_eq!(output.status.code(), Some(i32::from(cli::EXIT_UNAVAILABLE)));
    let output = latchkey(&["query", "--server", &dead_addr().to_string(), "k"])
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(
        stderr.contains("cannot reach the server: 127.0.0.1:"),
        "{stderr}"
    );
    assert!(stderr.contains("connection refused"), "{stderr}");
}

#[test]
fn a_held_key_is_said_to_be_held() {
    let (server, _holder) = server_holding("held");
    let addr = server.local_addr().to_string();
    let cases = [
        (
            "0",
            "the lock is held by someone else (--wait 0 tries once)",
        ),
        (
            "300ms",
            "the lock is held by someone else: not acquired within --wait 300ms",
        ),
    ];
    for (wait, message) in cases {
        let output = latchkey(&["lock", "--server", &addr, "--wait", wait, "held"])
            .args(["--", "true"])
            .output()
            .unwrap();
        assert_eq!(output.status.code(), Some(i32::from(cli::EXIT_TIMEOUT)));
        let stderr = String::from_utf8_lossy(&output.stderr);
        assert_eq!(stderr, format!("latchkey lock: held: {message}\n"));
    }
}
#[test]
fn latchkey_server_in_the_environment_is_the_default_server() {
    let server = start_server(|_| {});
    let addr = server.local_addr().to_string();
    let output = latchkey(&["ping"])
        .env("LATCHKEY_SERVER", &addr)
        .output()
        .unwrap();
    assert!(output.status.success(), "{output:?}");
    let pong = format!("pong from {addr}:");
    assert!(String::from_utf8_lossy(&output.stdout).starts_with(&pong));
    let output = latchkey(&["lock", "envkey", "--", "true"])
        .env("LATCHKEY_SERVER", &addr)
        .output()
        .unwrap();
    assert!(output.status.success(), "{output:?}");
    // --server wins over the environment.
    let output = latchkey(&["query", "--server", &addr, "envkey"])
        .env("LATCHKEY_SERVER", dead_addr().to_string())
        .output()
        .unwrap();
    assert!(output.status.success(), "{output:?}");
}

#[test]
fn a_cron_guard_picks_the_conflict_exit_code_and_can_be_quiet() {
    let (server, _holder) = server_holding("cron");
    let addr = server.local_addr().to_string();
    let guard = |extra: &[&str]| {
        latchkey(&["lock", "--server", &addr, "--wait", "0"])
            .args(extra)
            .args(["cron", "--", "true"])
            .output()
            .unwrap()
    };
    let output = guard(&["--conflict-exit-code", "0", "--quiet"]);
    assert_eq!(output.status.code(), Some(0));
    assert!(output.stderr.is_empty(), "{output:?}");
    let output = guard(&["--conflict-exit-code", "3"]);
    assert_eq!(output.status.code(), Some(3));
    assert!(String::from_utf8_lossy(&output.stderr).contains("held by someone else"));
    let output = guard(&["-q"]);
    assert_eq!(output.status.code(), Some(i32::from(cli::EXIT_TIMEOUT)));
    assert!(output.stderr.is_empty(), "{output:?}");
    // Errors other than the conflict keep their code and are still said.
    let dead = dead_addr().to_string();
    let output = latchkey(&["lock", "--server", &dead, "--wait", "200ms", "--quiet"])
        .args(["--conflict-exit-code", "3", "cron", "--", "true"])
        .output()
        .unwrap();
    assert_eq!(output.status.code(), Some(i32::from(cli::EXIT_UNAVAILABLE)));
    assert!(String::from_utf8_lossy(&output.stderr).contains("connection refused"));
}

#[test]
fn a_lease_rounded_up_to_whole_seconds_is_said() {
    let server = start_server(|_| {});
    let addr = server.local_addr().to_string();
    let run = |quiet: &[&str]| {
        latchkey(&["lock", "--server", &addr, "--lease", "500ms"])
            .args(quiet)
            .args(["round", "--", "true"])
            .output()
            .unwrap()
    };
    let output = run(&[]);
    assert_eq!(output.status.code(), Some(0));
    assert_eq!(
        String::from_utf8_lossy(&output.stderr),
        "latchkey lock: --lease 500ms is rounded up to 1s: leases are whole seconds\n"
    );
    let output = run(&["--quiet"]);
    assert_eq!(output.status.code(), Some(0));
    assert!(output.stderr.is_empty(), "{output:?}");
}

#[test]
fn a_long_key_is_not_echoed_whole() {
    let long = "k".repeat(2000);
    for command in ["lock", "query"] {
        let mut args = vec![command, long.as_str()];
        if command == "lock" {
            args.extend(["--", "true"]);
        }
        let output = latchkey(&args).output().unwrap();
        assert_eq!(output.status.code(), Some(i32::from(cli::EXIT_USAGE)));
        let stderr = String::from_utf8_lossy(&output.stderr);
        let shown = format!("{}… (2000 bytes)", "k".repeat(64));
        assert!(stderr.contains(&shown), "{stderr}");
        assert!(stderr.contains("longer than 1024 bytes"), "{stderr}");
        assert!(stderr.len() < 400, "{} bytes: {stderr}", stderr.len());
    }
}
