//! The `latchkey` binary as a process: SIGTERM and SIGINT (queued waiters get `B`, exit 0
//! within 5 s), SIGHUP (ignored), the token floor across restarts (wall clock and persisted
//! high-water mark), startup errors naming the key, the address or the directory (a second
//! server on an address in use exits 70), and plain `latchkey` serving on 127.0.0.1:7420.

use common::server::{fresh_id, keys_on_partition, Conn, ServerProcess, TempDir};
use latchkey::tokens::wall_clock_floor;
use latchkey_client::protocol::Response;
use std::io::{BufRead, BufReader, Read};
use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime};

const CORES: usize = 2;
/// The contract's shutdown bound.
const STOP_BOUND: Duration = Duration::from_secs(5);
/// Slack on top of it for a noisy machine.
const STOP_SLACK: Duration = Duration::from_millis(500);

fn keys(prefix: &str) -> Vec<String> {
    (0..CORES)
        .map(|partition| keys_on_partition(prefix, partition, CORES, 1).remove(0))
        .collect()
}

fn spawn(extra: &[&str]) -> ServerProcess {
    let mut args = vec!["--cores", "2"];
    args.extend_from_slice(extra);
    ServerProcess::spawn(&args)
}

/// Sends `signal` and asserts a clean exit within the bound.
fn stop(mut server: ServerProcess, signal: i32) {
    let sent = Instant::now();
    server.signal(signal);
    let status = server
        .wait_timeout(STOP_BOUND + STOP_SLACK)
        .expect("the server did not exit within 5 s");
    assert!(status.success(), "exit status {status}");
    assert!(sent.elapsed() < STOP_BOUND + STOP_SLACK);
}

fn signal_answers_waiters_busy_and_exits_zero(signal: i32) {
    let mut server = spawn(&[]);
    let mut holder = Conn::connect(server.addr);
    let mut waiter = Conn::connect(server.addr);
    let keys = keys("signal");
    let mut owners = Vec::new();
    for key in &keys {
        holder.acquire_ok(key, 60, fresh_id());
        let owner = fresh_id();
        waiter.send_acquire(key, 60, 60, owner);
        assert_eq!(waiter.state(key).waiters, 1);
        owners.push(owner);
    }
    let sent = Instant::now();
    server.signal(signal);
    let mut busy: Vec<u64> = waiter
        .recv_n(owners.len())
        .into_iter()
        .map(|answer| match answer {
            Response::Busy { owner } => owner,
            other => panic!("expected B, got {other:?}"),
        })
        .collect();
    busy.sort_unstable();
    owners.sort_unstable();
    assert_eq!(busy, owners);
    let status = server
        .wait_timeout(STOP_BOUND + STOP_SLACK)
        .expect("the server did not exit within 5 s");
    assert!(status.success(), "exit status {status}");
    assert!(sent.elapsed() < STOP_BOUND + STOP_SLACK);
    // The sessions end with the process.
    assert!(waiter.recv_until_closed().is_empty());
    assert!(holder.recv_until_closed().is_empty());
}

#[test]
fn sigterm_answers_queued_waiters_busy_and_exits_0_within_5_s() {
    signal_answers_waiters_busy_and_exits_zero(libc::SIGTERM);
}

#[test]
fn sigint_answers_queued_waiters_busy_and_exits_0_within_5_s() {
    signal_answers_waiters_busy_and_exits_zero(libc::SIGINT);
}

/// Takes one token on each partition.
fn take_tokens(server: &ServerProcess, prefix: &str) -> Vec<u64> {
    let mut conn = Conn::connect(server.addr);
    keys(prefix)
        .iter()
        .map(|key| conn.acquire_ok(key, 60, fresh_id()))
        .collect()
}

/// A config file in `dir` that sets `[tokens] state_dir` to `state`.
fn config_with_state_dir(dir: &TempDir, state: &Path) -> PathBuf {
    let path = dir.path().join("latchkey.toml");
    let text = format!("[tokens]\nstate_dir = {:?}\n", state.to_str().unwrap());
    std::fs::write(&path, text).unwrap();
    path
}

fn mark(state: &Path, partition: usize) -> u64 {
    let path = state.join(format!("tokens-{partition}.hwm"));
    let text = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    text.trim().parse().expect("a number")
}

#[test]
fn tokens_after_a_restart_exceed_the_previous_run_with_a_state_dir() {
    let dir = TempDir::new("restart-state");
    let state = dir.path().join("state");
    let config = config_with_state_dir(&dir, &state);
    let config = config.to_str().unwrap();
    let first = spawn(&["--config", config]);
    let before = take_tokens(&first, "restart");
    stop(first, libc::SIGTERM);
    // Every partition persisted a mark at or above what it issued.
    for partition in 0..CORES {
        assert!(mark(&state, partition) >= *before.iter().max().unwrap());
    }
    let second = spawn(&["--config", config]);
    let after = take_tokens(&second, "restart");
    let highest = before.iter().max().unwrap();
    assert!(
        after.iter().all(|token| token > highest),
        "{before:?} then {after:?}"
    );
    stop(second, libc::SIGTERM);
}

#[test]
fn a_persisted_mark_far_above_the_wall_clock_raises_the_tokens() {
    let dir = TempDir::new("restart-mark");
    let state = dir.path().join("state");
    std::fs::create_dir_all(&state).unwrap();
    let far = wall_clock_floor(SystemTime::now()) * 2;
    std::fs::write(state.join("tokens-0.hwm"), format!("{far}\n")).unwrap();
    let config = config_with_state_dir(&dir, &state);
    let server = spawn(&["--config", config.to_str().unwrap()]);
    let tokens = take_tokens(&server, "far-mark");
    assert!(
        tokens.iter().all(|&token| token > far),
        "{tokens:?} not above {far}"
    );
    stop(server, libc::SIGTERM);
}

#[test]
fn tokens_after_a_restart_exceed_the_previous_run_without_a_state_dir() {
    let first = spawn(&[]);
    let before = take_tokens(&first, "restart-clock");
    stop(first, libc::SIGTERM);
    let second = spawn(&[]);
    let after = take_tokens(&second, "restart-clock");
    let highest = before.iter().max().unwrap();
    assert!(
        after.iter().all(|token| token > highest),
        "{before:?} then {after:?}"
    );
    stop(second, libc::SIGTERM);
}

/// Runs `latchkey serve ARGS` until it exits by itself (at most 5 s); returns its exit code
/// and stderr.
fn serve_until_exit(args: &[&str]) -> (Option<i32>, String) {
    let mut child = Command::new(env!("CARGO_BIN_EXE_latchkey"))
        .arg("serve")
        .args(args)
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .expect("spawn latchkey");
    let started = Instant::now();
    let status = loop {
        if let Some(status) = child.try_wait().unwrap() {
            break status;
        }
        if started.elapsed() > Duration::from_secs(5) {
            let _ = child.kill();
            let _ = child.wait();
            panic!("latchkey {args:?} kept running");
        }
        std::thread::sleep(Duration::from_millis(10));
    };
    let mut stderr = String::new();
    child
        .stderr
        .take()
        .unwrap()
        .read_to_string(&mut stderr)
        .unwrap();
    (status.code(), stderr)
}

/// Runs `latchkey serve --config FILE` with `text` in FILE; returns (success, stderr).
fn serve_with_config_text(text: &str) -> (bool, String) {
    let dir = TempDir::new("bad-config");
    let path = dir.path().join("latchkey.toml");
    std::fs::write(&path, text).unwrap();
    let path = path.to_str().unwrap();
    let (code, stderr) = serve_until_exit(&["--listen", "127.0.0.1:0", "--config", path]);
    (code == Some(0), stderr)
}

#[test]
fn a_second_server_on_an_address_in_use_exits_70_and_says_so() {
    let first = spawn(&[]);
    let addr = first.addr.to_string();
    let (code, stderr) = serve_until_exit(&["--listen", &addr, "--cores", "2"]);
    assert_eq!(code, Some(70), "stderr: {stderr}");
    assert!(
        stderr.contains(&format!("address {addr} is already in use")),
        "stderr: {stderr}"
    );
    // The first one still serves the whole lock space alone.
    let mut conn = Conn::connect(first.addr);
    assert_eq!(conn.ping(1), Response::Pong { nonce: 1 });
    // Any other program on the address stops it too.
    let other = TcpListener::bind("127.0.0.1:0").unwrap();
    let taken = other.local_addr().unwrap().to_string();
    let (code, stderr) = serve_until_exit(&["--listen", &taken]);
    assert_eq!(code, Some(70), "stderr: {stderr}");
    assert!(
        stderr.contains(&format!("address {taken} is already in use")),
        "{stderr}"
    );
    stop(first, libc::SIGTERM);
}

#[test]
fn startup_errors_name_the_address_or_the_state_dir() {
    let (code, stderr) = serve_until_exit(&["--listen", "8.8.8.8:7604"]);
    assert_eq!(code, Some(70), "stderr: {stderr}");
    assert!(
        stderr.contains("cannot listen on 8.8.8.8:7604: "),
        "stderr: {stderr}"
    );
    let (success, stderr) = serve_with_config_text("[tokens]\nstate_dir = \"/proc/nope\"\n");
    assert!(!success);
    assert!(
        stderr.contains("tokens.state_dir /proc/nope: cannot create it: "),
        "stderr: {stderr}"
    );
}

#[test]
fn a_state_dir_whose_parent_is_missing_is_refused_not_created() {
    let dir = TempDir::new("state-typo");
    // A typo in the path: `lib` for `lib/latchkey`'s parent that does not exist.
    let state = dir.path().join("var/lbi/latchkey");
    let config = config_with_state_dir(&dir, &state);
    let (code, stderr) = serve_until_exit(&[
        "--listen",
        "127.0.0.1:0",
        "--config",
        config.to_str().unwrap(),
    ]);
    assert_eq!(code, Some(70), "stderr: {stderr}");
    let parent = state.parent().unwrap().display().to_string();
    assert!(
        stderr.contains(&format!("its parent directory {parent} does not exist")),
        "stderr: {stderr}"
    );
    assert!(!state.parent().unwrap().exists(), "nothing was created");
    // A missing state directory in a parent that exists is created, as before.
    let state = dir.path().join("state");
    let config = config_with_state_dir(&dir, &state);
    let server = spawn(&["--config", config.to_str().unwrap()]);
    assert!(state.is_dir());
    stop(server, libc::SIGTERM);
}

#[test]
fn a_cluster_member_refuses_a_data_dir_written_with_another_core_count() {
    let dir = TempDir::new("cluster-layout");
    let path = dir.path().join("latchkey.toml");
    let ports: Vec<u16> = (0..2)
        .map(|_| TcpListener::bind("127.0.0.1:0").unwrap())
        .collect::<Vec<_>>()
        .iter()
        .map(|l| l.local_addr().unwrap().port())
        .collect();
    let text = format!(
        "[cluster]\nnode_id = 1\nshards = 4\ndata_dir = {:?}\nmembers = [\n  \
         {{ id = 1, client = \"127.0.0.1:{}\", peer = \"127.0.0.1:{}\" }},\n]\n",
        dir.path().join("data"),
        ports[0],
        ports[1]
    );
    std::fs::write(&path, text).unwrap();
    let config = path.to_str().unwrap();
    // A one-member cluster serves (it is its own majority).
    let mut command = Command::new(env!("CARGO_BIN_EXE_latchkey"));
    command.args(["serve", "--cores", "1", "--config", config]);
    let (server, _log) = ServerProcess::spawn_collecting(command);
    let mut conn = Conn::connect(server.addr);
    // Until it has elected itself it redirects (M, no leader known yet).
    let started = Instant::now();
    let token = loop {
        match conn.acquire("jobs/layout", 0, 30, fresh_id()) {
            Response::Acquired { token, .. } => break token,
            Response::Moved { .. } if started.elapsed() < Duration::from_secs(10) => {
                std::thread::sleep(Duration::from_millis(10));
            }
            other => panic!("acquire answered {other:?}"),
        }
    };
    assert!(token > wall_clock_floor(SystemTime::now()) / 2);
    stop(server, libc::SIGTERM);
    let (code, stderr) = serve_until_exit(&["--cores", "2", "--config", config]);
    assert_eq!(code, Some(70), "stderr: {stderr}");
    assert!(
        stderr.contains("server.cores: cluster.data_dir ")
            && stderr.contains(" was written with server.cores = 1, this start has 2"),
        "stderr: {stderr}"
    );
}

#[test]
fn sighup_is_logged_and_the_server_keeps_serving() {
    let server = spawn(&[]);
    let mut holder = Conn::connect(server.addr);
    let mut waiter = Conn::connect(server.addr);
    let key = &keys("hup")[0];
    holder.acquire_ok(key, 60, fresh_id());
    let owner = fresh_id();
    waiter.send_acquire(key, 30, 60, owner);
    assert_eq!(waiter.state(key).waiters, 1);
    server.signal(libc::SIGHUP);
    std::thread::sleep(Duration::from_millis(300));
    // Still serving, the waiter still queued and the hold still there.
    assert_eq!(holder.ping(2), Response::Pong { nonce: 2 });
    let state = holder.state(key);
    assert!(state.held && state.waiters == 1, "{state:?}");
    // A graceful stop still answers the waiter B.
    let mut server = server;
    server.signal(libc::SIGTERM);
    assert_eq!(waiter.recv(), Response::Busy { owner });
    let status = server.wait_timeout(STOP_BOUND + STOP_SLACK).expect("exits");
    assert!(status.success(), "exit status {status}");
}

#[test]
fn an_unknown_config_key_is_a_startup_error_that_names_it() {
    let (success, stderr) = serve_with_config_text("[limits]\nmax_lockz = 5\n");
    assert!(!success);
    assert!(stderr.contains("max_lockz"), "stderr: {stderr}");
    let (success, stderr) = serve_with_config_text("[limits]\nmax_waiters_per_key = 0\n");
    assert!(!success);
    assert!(stderr.contains("max_waiters_per_key"), "stderr: {stderr}");
}

#[test]
fn latchkey_without_arguments_serves_on_127_0_0_1_7420() {
    const DEFAULT: &str = "127.0.0.1:7420";
    match TcpListener::bind(DEFAULT) {
        Ok(probe) => drop(probe),
        Err(e) => {
            eprintln!("skipped: {DEFAULT} is busy ({e})");
            return;
        }
    }
    let mut child = Command::new(env!("CARGO_BIN_EXE_latchkey"))
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .expect("spawn latchkey");
    let mut line = String::new();
    BufReader::new(child.stdout.take().unwrap())
        .read_line(&mut line)
        .expect("read the address line");
    let server = ServerProcess {
        child,
        addr: DEFAULT.parse().unwrap(),
    };
    assert_eq!(line.trim(), format!("listening on {DEFAULT}"));
    let mut conn = Conn::connect(server.addr);
    assert_eq!(conn.ping(7), Response::Pong { nonce: 7 });
    stop(server, libc::SIGTERM);
}

/// `latchkey serve ARGS` with its stderr collected in the background, logging at info.
fn spawn_collecting_stderr(args: &[&str]) -> (ServerProcess, Arc<Mutex<String>>) {
    ServerProcess::spawn_logging(args, "info")
}

/// Acquires `key` (wait 0) and releases it at once; the acquire's answer.
fn take_and_give_back(conn: &mut Conn, key: &str) -> Response {
    let owner = fresh_id();
    let answer = conn.acquire(key, 0, 60, owner);
    if let Response::Acquired { token, .. } = answer {
        assert_eq!(conn.release(key, token), Response::Released { token });
    }
    answer
}

#[test]
fn a_failing_state_dir_is_retried_off_the_loop_and_acquires_get_busy_until_it_recovers() {
    let dir = TempDir::new("failing-state");
    let state = dir.path().join("state");
    let path = dir.path().join("latchkey.toml");
    let text = format!(
        "[tokens]\nstate_dir = {:?}\nreservation = 64\n",
        state.to_str().unwrap()
    );
    std::fs::write(&path, text).unwrap();
    let args = ["--cores", "1", "--config", path.to_str().unwrap()];
    let (server, _) = spawn_collecting_stderr(&args);
    let mut conn = Conn::connect(server.addr);
    let first_mark = mark(&state, 0);
    // Half a reservation used: a new mark is persisted (off the loop) and seen on disk.
    for _ in 0..40 {
        assert!(matches!(
            take_and_give_back(&mut conn, "tokens/fail"),
            Response::Acquired { .. }
        ));
    }
    // Generous: persisting syncs twice, and a busy disk may hold a sync for many seconds.
    assert!(common::server::wait_until(
        Duration::from_secs(60),
        || mark(&state, 0) > first_mark
    ));
    // The file is in place before the thread's last step (syncing the directory), which a busy
    // disk can hold for many seconds: breaking the directory now would race with it. A fresh
    // start persists its first mark before it serves, so its thread is idle until the table
    // asks for the next mark, half a reservation later: the directory breaks before that.
    drop(server); // kill -9, and wait for it
    let (server, log) = spawn_collecting_stderr(&args);
    let mut conn = Conn::connect(server.addr);
    assert!(
        mark(&state, 0) > first_mark,
        "the restart persisted a mark above the last"
    );
    // The directory becomes unusable: a file where it was.
    let moved = dir.path().join("state.moved");
    std::fs::rename(&state, &moved).unwrap();
    std::fs::write(&state, "not a directory").unwrap();
    let mut granted = 0;
    let busy = loop {
        match take_and_give_back(&mut conn, "tokens/fail") {
            Response::Acquired { .. } => granted += 1,
            Response::Busy { .. } => break true,
            other => panic!("unexpected {other:?}"),
        }
        if granted > 200 {
            break false;
        }
    };
    assert!(
        busy,
        "tokens were issued past the persisted mark: {granted} grants"
    );
    // The loop is not blocked by the retries: pings answer, and the failure is logged once
    // (it used to be retried and logged on every loop iteration). The thread's first attempt
    // fails at once (no file can be made in a file); wait for its line with a generous bound,
    // pinging for a second at least.
    let failures = || {
        log.lock()
            .unwrap()
            .matches("cannot persist the token high-water mark")
            .count()
    };
    let started = Instant::now();
    let mut nonce = 0;
    while started.elapsed() < Duration::from_secs(1)
        || (failures() == 0 && started.elapsed() < Duration::from_secs(30))
    {
        assert_eq!(conn.ping(nonce), Response::Pong { nonce });
        nonce += 1;
        std::thread::sleep(Duration::from_millis(10));
    }
    assert_eq!(failures(), 1, "log:\n{}", log.lock().unwrap());
    // Repaired: grants resume once the thread's next retry persists the mark.
    std::fs::remove_file(&state).unwrap();
    std::fs::rename(&moved, &state).unwrap();
    // Generous: persisting syncs twice, and a busy disk may hold a sync for many seconds.
    assert!(common::server::wait_until(Duration::from_secs(60), || {
        matches!(
            take_and_give_back(&mut conn, "tokens/fail"),
            Response::Acquired { .. }
        )
    }));
    assert!(log.lock().unwrap().contains("persisted again"));
    stop(server, libc::SIGTERM);
}

#[test]
fn a_health_port_serves_health_in_plaintext_and_a_taken_one_exits_70_naming_it() {
    let dir = TempDir::new("health-port");
    let port = TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap();
    let path = dir.path().join("latchkey.toml");
    std::fs::write(&path, format!("[server]\nhealth_listen = \"{port}\"\n")).unwrap();
    let server = spawn(&["--config", path.to_str().unwrap()]);
    let (status, body) = common::cluster::http_get(port, "/health").expect("an answer");
    assert_eq!((status, body.as_str()), (200, "serving\n"));
    // A health port already taken stops the start, naming the key.
    let (code, stderr) = serve_until_exit(&[
        "--config",
        path.to_str().unwrap(),
        "--listen",
        "127.0.0.1:0",
    ]);
    assert_eq!(code, Some(70), "stderr: {stderr}");
    assert!(
        stderr.contains(&format!("server.health_listen {port}: cannot listen")),
        "{stderr}"
    );
    stop(server, libc::SIGTERM);
}
