//! The operator's side of the `latchkey` binary: `--version` with the commit, shell
//! completions, `query --json` and `ping --json --count`, the error paths of `stats` and
//! `keys`, the JSON log format, and the open-files limit at startup (raised, or warned about
//! while the server still serves).

use std::os::unix::process::CommandExt;
use std::process::{Child, Command, Output};
use std::sync::{Arc, Mutex};
use std::thread;
use std::time::{Duration, Instant};

use common::server::{wait_for_line, ServerProcess, TempDir};
use common::{dead_addr, not_latchkey_server, start_server};
use serde_json::Value;

/// Exit code when the server cannot be reached.
const EXIT_UNAVAILABLE: i32 = 83;
/// Exit code when the answer is not what was asked for.
const EXIT_REJECTED: i32 = 84;
/// The server's margin of open files besides one per session.
const FILES_MARGIN: u64 = 64;
/// The longest any step here waits.
const PATIENCE: Duration = Duration::from_secs(10);

fn latchkey(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_latchkey"))
        .args(args)
        .env_remove("LATCHKEY_SERVER")
        .output()
        .expect("run latchkey")
}

fn stdout(output: &Output) -> String {
    String::from_utf8(output.stdout.clone()).expect("utf-8 stdout")
}

fn stderr(output: &Output) -> String {
    String::from_utf8(output.stderr.clone()).expect("utf-8 stderr")
}

#[test]
fn version_names_the_commit() {
    let output = latchkey(&["--version"]);
    assert!(output.status.success(), "{output:?}");
    let expected = format!(
        "latchkey {} (commit {})\n",
        latchkey::VERSION,
        latchkey::COMMIT
    );
    assert_eq!(stdout(&output), expected);
    let commit = latchkey::COMMIT;
    let hex = commit.len() == 12 && commit.bytes().all(|byte| byte.is_ascii_hexdigit());
    assert!(hex || commit == "unknown", "{commit:?}");
}

#[test]
fn completions_are_printed_for_each_shell() {
    for shell in ["bash", "zsh", "fish"] {
        let output = latchkey(&["completions", shell]);
        assert!(output.status.success(), "{shell}: {output:?}");
        let script = stdout(&output);
        assert!(script.contains("latchkey"), "{shell}");
        assert!(
            script.contains("stats") && script.contains("keys"),
            "{shell}"
        );
    }
    let output = latchkey(&["completions", "tcsh"]);
    assert_eq!(output.status.code(), Some(2));
}

#[test]
fn query_json_has_the_documented_fields() {
    let server = start_server(|_| {});
    let addr = server.local_addr().to_string();
    let output = latchkey(&["query", "--server", &addr, "--json", "jobs/json"]);
    assert!(output.status.success(), "{output:?}");
    let text = stdout(&output);
    assert_eq!(text.lines().count(), 1, "{text}");
    let value: Value = serde_json::from_str(&text).unwrap();
    let expected = serde_json::json!({
        "key": "jobs/json", "held": false, "lease_ms": 0, "waiters": 0
    });
    assert_eq!(value, expected);
    assert!(text.starts_with("{\"key\":"), "the key comes first: {text}");
}

#[test]
fn ping_json_counts_and_times_the_pongs() {
    let server = start_server(|_| {});
    let addr = server.local_addr().to_string();
    let start = Instant::now();
    let args = [
        "ping",
        "--server",
        &addr,
        "--json",
        "--count",
        "2",
        "--interval",
        "100ms",
    ];
    let output = latchkey(&args);
    assert!(output.status.success(), "{output:?}");
    assert!(
        start.elapsed() >= Duration::from_millis(100),
        "the interval was kept"
    );
    let text = stdout(&output);
    assert_eq!(text.lines().count(), 1, "only the object: {text}");
    let value: Value = serde_json::from_str(&text).unwrap();
    assert_eq!(value["server"], addr.as_str());
    assert_eq!(value["count"], 2);
    assert_eq!(value["received"], 2);
    let rtt = |name: &str| value["rtt_ms"][name].as_f64().unwrap();
    assert!(0.0 < rtt("min") && rtt("min") <= rtt("avg") && rtt("avg") <= rtt("max"));
    assert!(rtt("max") < PATIENCE.as_secs_f64() * 1000.0);
}

#[test]
fn ping_text_ends_with_a_summary() {
    let server = start_server(|_| {});
    let addr = server.local_addr().to_string();
    let output = latchkey(&[
        "ping",
        "--server",
        &addr,
        "--count",
        "3",
        "--interval",
        "10ms",
    ]);
    assert!(output.status.success(), "{output:?}");
    let text = stdout(&output);
    let lines: Vec<&str> = text.lines().collect();
    assert_eq!(lines.len(), 4, "{text}");
    for (seq, line) in lines[..3].iter().enumerate() {
        let prefix = format!("pong from {addr}: seq={} time=", seq + 1);
        assert!(line.starts_with(&prefix) && line.ends_with(" ms"), "{line}");
    }
    let summary = "3 pings, 3 pongs, 0% lost; rtt min/avg/max = ";
    assert!(lines[3].starts_with(summary), "{text}");
}

#[test]
fn ping_of_several_members_pings_every_one() {
    let (one, two) = (start_server(|_| {}), start_server(|_| {}));
    let dead = dead_addr().to_string();
    let (one, two) = (one.local_addr().to_string(), two.local_addr().to_string());
    let list = format!("{one},{two}");
    let output = latchkey(&[
        "ping",
        "--server",
        &list,
        "--count",
        "2",
        "--interval",
        "10ms",
    ]);
    assert!(output.status.success(), "{output:?}");
    let text = stdout(&output);
    for addr in [&one, &two] {
        for seq in [1, 2] {
            let pong = format!("pong from {addr}: seq={seq} time=");
            assert!(text.contains(&pong), "{pong} in\n{text}");
        }
        let summary = format!("{addr}: 2 pings, 2 pongs, 0% lost; rtt");
        assert!(text.contains(&summary), "{summary} in\n{text}");
    }
    // JSON: an object per member, a line each; a member that does not answer is lost.
    let list = format!("{one},{dead}");
    let output = latchkey(&["ping", "--server", &list, "--json"]);
    assert_eq!(output.status.code(), Some(EXIT_UNAVAILABLE), "{output:?}");
    let objects: Vec<Value> = stdout(&output)
        .lines()
        .map(|line| serde_json::from_str(line).unwrap())
        .collect();
    assert_eq!(objects.len(), 2, "{objects:?}");
    assert_eq!(
        (
            objects[0]["server"].as_str(),
            objects[0]["received"].as_u64()
        ),
        (Some(one.as_str()), Some(1))
    );
    assert_eq!(
        (
            objects[1]["server"].as_str(),
            objects[1]["received"].as_u64()
        ),
        (Some(dead.as_str()), Some(0))
    );
    assert!(stderr(&output).contains(&dead), "{}", stderr(&output));
}

#[test]
fn ping_of_no_server_counts_losses_and_exits_83() {
    let dead = dead_addr().to_string();
    let args = [
        "ping",
        "--server",
        &dead,
        "--count",
        "2",
        "--interval",
        "10ms",
        "--transport-timeout",
        "300ms",
    ];
    let output = latchkey(&args);
    assert_eq!(output.status.code(), Some(EXIT_UNAVAILABLE), "{output:?}");
    assert_eq!(stdout(&output), "2 pings, 0 pongs, 100% lost\n");
    assert!(stderr(&output).contains(&dead), "{}", stderr(&output));
}

#[test]
fn stats_and_keys_of_no_server_exit_83_naming_the_address() {
    let dead = dead_addr().to_string();
    for command in [&["stats"][..], &["keys", "jobs/"], &["keys", "--json"]] {
        let mut args = command.to_vec();
        args.extend(["--server", &dead]);
        let output = latchkey(&args);
        assert_eq!(
            output.status.code(),
            Some(EXIT_UNAVAILABLE),
            "{args:?}: {output:?}"
        );
        let says = format!(
            "latchkey {}: cannot reach the server: {dead}: cannot connect: connection refused \
             (tried for ",
            command[0]
        );
        assert!(stderr(&output).starts_with(&says), "{}", stderr(&output));
        assert_eq!(stderr(&output).lines().count(), 1, "{}", stderr(&output));
        assert!(output.stdout.is_empty());
    }
    // LATCHKEY_SERVER is the default server for these too.
    let output = Command::new(env!("CARGO_BIN_EXE_latchkey"))
        .arg("stats")
        .env("LATCHKEY_SERVER", &dead)
        .output()
        .unwrap();
    assert_eq!(output.status.code(), Some(EXIT_UNAVAILABLE));
    assert!(stderr(&output).contains(&dead));
}

#[test]
fn stats_of_several_members_counts_cores_per_member_and_names_each_failure_once() {
    let one = start_server(|config| config.server.cores = 1);
    let two = start_server(|config| config.server.cores = 1);
    let (one, two) = (one.local_addr().to_string(), two.local_addr().to_string());
    // Accepts (the kernel does, from the backlog) and never answers.
    let silent = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let silent_addr = silent.local_addr().unwrap().to_string();
    let dead = dead_addr().to_string();
    let list = format!("{one},{two},{silent_addr},{dead}");
    let output = latchkey(&["stats", "--server", &list, "--transport-timeout", "500ms"]);
    assert_eq!(output.status.code(), Some(EXIT_UNAVAILABLE), "{output:?}");
    let text = stdout(&output);
    let cores = text
        .lines()
        .find(|line| line.starts_with("cores:"))
        .unwrap();
    assert_eq!(
        cores.split_whitespace().collect::<Vec<_>>(),
        ["cores:", "1", "per", "member"]
    );
    let said = stderr(&output);
    assert_eq!(said.lines().count(), 2, "{said}");
    for (line, addr) in said.lines().zip([&silent_addr, &dead]) {
        assert!(
            line.starts_with(&format!("latchkey stats: {addr}: ")),
            "{line}"
        );
        assert_eq!(line.matches(addr.as_str()).count(), 1, "{line}");
    }
    assert!(said.contains("no complete answer"), "{said}");
    assert!(said.contains("connection refused"), "{said}");
    // The # Members section names each once too.
    for addr in [&silent_addr, &dead] {
        let row = text
            .lines()
            .find(|line| line.starts_with(addr.as_str()))
            .unwrap();
        assert_eq!(row.matches(addr.as_str()).count(), 1, "{row}");
    }
    drop(silent);
}

#[test]
fn stats_of_another_protocol_exit_84_and_usage_errors_exit_2() {
    let redis_like = not_latchkey_server(PATIENCE).to_string();
    let start = Instant::now();
    let output = latchkey(&["stats", "--server", &redis_like]);
    assert_eq!(output.status.code(), Some(EXIT_REJECTED), "{output:?}");
    assert!(
        stderr(&output).contains("not a latchkey server"),
        "{output:?}"
    );
    assert!(
        start.elapsed() < Duration::from_secs(4),
        "said before --transport-timeout"
    );
    let output = latchkey(&["stats", "--server", "not an address"]);
    assert_eq!(output.status.code(), Some(2), "{output:?}");
    let output = latchkey(&["keys", "--limit", "10001"]);
    assert_eq!(output.status.code(), Some(2), "{output:?}");
}

/// Waits for `child` to exit, at most `PATIENCE`.
fn wait_exit(child: &mut Child) -> std::process::ExitStatus {
    let until = Instant::now() + PATIENCE;
    while Instant::now() < until {
        if let Some(status) = child.try_wait().unwrap() {
            return status;
        }
        thread::sleep(Duration::from_millis(10));
    }
    panic!("latchkey did not exit within {PATIENCE:?}");
}

#[test]
fn json_log_lines_parse_one_object_each() {
    let dir = TempDir::new("cli-ops-json-log");
    let config = dir.path().join("latchkey.toml");
    std::fs::write(&config, "[log]\nformat = \"json\"\n").unwrap();
    let args = ["--config", config.to_str().unwrap(), "--cores", "1"];
    let (server, log) = ServerProcess::spawn_logging(&args, "debug");
    let addr = server.addr.to_string();
    let output = latchkey(&["ping", "--server", &addr]);
    assert!(output.status.success(), "{output:?}");
    stop(server);
    // The stderr reader thread ends at the pipe's end; give it a moment to collect.
    let complete = || log.lock().unwrap().contains("\"msg\":\"stopped\"");
    let until = Instant::now() + PATIENCE;
    while !complete() && Instant::now() < until {
        thread::sleep(Duration::from_millis(10));
    }
    let log = log.lock().unwrap().clone();
    let mut messages = Vec::new();
    for line in log.lines() {
        let value: Value = serde_json::from_str(line).unwrap_or_else(|e| panic!("{e}: {line}"));
        let object = value.as_object().expect("an object");
        let keys: Vec<&str> = object.keys().map(String::as_str).collect();
        assert_eq!(keys.len(), 4, "{line}");
        assert!(line.starts_with("{\"ts\":\""), "ts first: {line}");
        let ts = value["ts"].as_str().unwrap();
        assert!(
            ts.len() == 27 && ts.ends_with('Z') && &ts[10..11] == "T",
            "{ts}"
        );
        assert!(
            ["ERROR", "WARN", "INFO", "DEBUG", "TRACE"].contains(&value["level"].as_str().unwrap())
        );
        assert!(
            value["target"].as_str().unwrap().starts_with("latchkey"),
            "{line}"
        );
        messages.push(value["msg"].as_str().unwrap().to_owned());
    }
    assert!(
        messages
            .iter()
            .any(|msg| msg.starts_with("latchkey listening on")),
        "{log}"
    );
    assert!(messages.iter().any(|msg| msg == "stopped"), "{log}");
}

/// Starts `latchkey serve` on an ephemeral port with `config_text`, its open-files limit set
/// to `soft` and `hard` before it runs; returns the server (killed on drop) and its stderr,
/// collected in the background.
fn spawn_with_files_limit(
    dir: &TempDir,
    config_text: &str,
    soft: u64,
    hard: u64,
) -> (ServerProcess, Arc<Mutex<String>>) {
    let config = dir.path().join("latchkey.toml");
    std::fs::write(&config, config_text).unwrap();
    let mut command = Command::new(env!("CARGO_BIN_EXE_latchkey"));
    command
        .args([
            "serve",
            "--listen",
            "127.0.0.1:0",
            "--cores",
            "1",
            "--config",
        ])
        .arg(&config)
        .env_remove("RUST_LOG");
    let limit = libc::rlimit {
        rlim_cur: soft,
        rlim_max: hard,
    };
    // SAFETY: between fork and exec the closure only calls setrlimit, which is
    // async-signal-safe, on a struct it owns by value.
    unsafe {
        command.pre_exec(move || {
            if libc::setrlimit(libc::RLIMIT_NOFILE, &limit) != 0 {
                return Err(std::io::Error::last_os_error());
            }
            Ok(())
        });
    }
    ServerProcess::spawn_collecting(command)
}

/// The first line of `log` with every one of `parts`, waiting for it at most `PATIENCE`.
fn line_with(log: &Arc<Mutex<String>>, parts: &[&str]) -> String {
    wait_for_line(log, parts, PATIENCE)
}

/// Stops `server` with SIGTERM and checks it exits 0.
fn stop(mut server: ServerProcess) {
    server.signal(libc::SIGTERM);
    assert!(wait_exit(&mut server.child).success());
}

/// This process's hard limit of open files.
fn hard_files_limit() -> u64 {
    let mut limit = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: getrlimit writes into the struct we own.
    assert_eq!(
        unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut limit) },
        0
    );
    limit.rlim_max
}

#[test]
fn a_low_files_limit_is_warned_about_and_the_server_still_serves() {
    let dir = TempDir::new("cli-ops-nofile-low");
    let config = "[limits]\nmax_connections = 10000\n";
    let (server, log) = spawn_with_files_limit(&dir, config, 64, 64);
    let needed = 10_000 + FILES_MARGIN;
    let warning = line_with(&log, &["WARN", "RLIMIT_NOFILE"]);
    for part in [
        " is 64 ",
        &format!("= {needed}"),
        "ulimit -n",
        "LimitNOFILE=",
    ] {
        assert!(warning.contains(part), "{part:?} not in {warning}");
    }
    let output = latchkey(&["ping", "--server", &server.addr.to_string()]);
    assert!(output.status.success(), "still serves: {output:?}");
    stop(server);
}

#[test]
fn a_soft_files_limit_below_the_hard_one_is_raised() {
    let needed = 10_000 + FILES_MARGIN;
    let hard = hard_files_limit();
    if hard < needed {
        eprintln!("skipped: the hard open-files limit {hard} is below {needed}");
        return;
    }
    let dir = TempDir::new("cli-ops-nofile-raise");
    let config = "[limits]\nmax_connections = 10000\n";
    let (server, log) = spawn_with_files_limit(&dir, config, 64, hard);
    line_with(
        &log,
        &["INFO", "RLIMIT_NOFILE", &format!("from 64 to {needed}")],
    );
    let output = latchkey(&["ping", "--server", &server.addr.to_string()]);
    assert!(output.status.success(), "{output:?}");
    stop(server);
    assert!(
        !log.lock().unwrap().contains("WARN"),
        "{}",
        log.lock().unwrap()
    );
}

#[test]
fn a_usage_message_does_not_show_what_the_environment_gives_as_required() {
    for command in [&["lock"][..], &["query"], &["cluster", "leader"]] {
        let output = Command::new(env!("CARGO_BIN_EXE_latchkey"))
            .args(command)
            .env("LATCHKEY_SERVER", "127.0.0.1:7420")
            .env("LATCHKEY_TLS_CA", "/etc/latchkey/ca.crt")
            .output()
            .unwrap();
        assert_eq!(output.status.code(), Some(2), "{output:?}");
        let said = stderr(&output);
        let usage = said
            .lines()
            .find(|line| line.starts_with("Usage:"))
            .unwrap();
        assert!(!usage.contains("--server"), "{usage}");
        assert!(!usage.contains("--tls-ca"), "{usage}");
    }
}
