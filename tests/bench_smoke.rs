//! Smoke test of `latchkey bench` against an in-process server: about two seconds of each
//! lock workload with small parameters must complete cycles with no unexpected answer and no
//! connection error. And the binary: its target from `LATCHKEY_SERVER`, and a run against
//! something that never completes a cycle fails.

use std::time::Duration;

use latchkey::bench::{execute, parse_target, BenchConfig, Report, Workload};
use latchkey::config::Config;

fn run(
    address: std::net::SocketAddr,
    workload: Workload,
    tune: impl FnOnce(&mut BenchConfig),
) -> Report {
    let target = parse_target(&format!("latchkey://{address}")).expect("target");
    let mut config = BenchConfig::new(target, workload);
    config.connections = 4;
    config.pipeline = 4;
    config.threads = 2;
    config.warmup = Duration::from_millis(100);
    config.keys = 1000;
    config.lease = Duration::from_secs(5);
    tune(&mut config);
    let config = config.validate().expect("valid bench config");
    let report = execute(&config).expect("the run was made");
    let json = report.to_json();
    assert_eq!(report.unexpected(), 0, "{}\n{json}", report.alarm());
    assert!(json.contains("\"ok\":true"), "{json}");
    report
}

#[test]
fn bench_drives_a_server_without_errors() {
    let mut config = Config::default();
    config.server.listen = "127.0.0.1:0".parse().unwrap();
    config.server.cores = 1;
    let server = latchkey::node::start(config).expect("server starts");
    let address = server.local_addr();

    let uncontended = run(address, Workload::Uncontended, |config| {
        config.duration = Duration::from_millis(600);
    });
    // Identified connections (resumable calls) run the same way.
    let identified = run(address, Workload::Uncontended, |config| {
        config.duration = Duration::from_millis(300);
        config.identify = true;
    });
    assert!(identified.stats.cycles > 0, "{}", identified.to_table());
    let counts = uncontended.stats.counts;
    assert!(uncontended.stats.cycles > 0, "{}", uncontended.to_table());
    assert!(
        counts.granted > 0 && counts.released > 0,
        "{}",
        uncontended.to_table()
    );

    let contended = run(address, Workload::Contended, |config| {
        config.duration = Duration::from_millis(500);
        config.hot_keys = 2;
        config.hold = Duration::from_micros(200);
    });
    assert!(contended.stats.cycles > 0, "{}", contended.to_table());
    assert!(
        !contended.stats.handoff.is_empty(),
        "{}",
        contended.to_table()
    );

    let hold = run(address, Workload::Hold, |config| {
        config.keys = 200;
        config.lease = Duration::from_secs(1);
    });
    assert_eq!(hold.stats.counts.granted, 200, "{}", hold.to_table());
    assert!(
        !hold.stats.lateness.is_empty() || hold.stats.lateness_early > 0,
        "{}",
        hold.to_table()
    );

    server.shutdown();
    server.join().expect("the server stops cleanly");
}

#[test]
fn bench_takes_its_target_from_latchkey_server() {
    let mut config = Config::default();
    config.server.listen = "127.0.0.1:0".parse().unwrap();
    config.server.cores = 1;
    let server = latchkey::node::start(config).expect("server starts");
    let output = std::process::Command::new(env!("CARGO_BIN_EXE_latchkey"))
        .args(["bench", "--workload", "uncontended", "--duration", "200ms"])
        .args(["--warmup", "0", "--connections", "1", "--pipeline", "1"])
        .args(["--keys", "10", "--threads", "1", "--json"])
        .env("LATCHKEY_SERVER", server.local_addr().to_string())
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&output.stdout);
    assert!(output.status.success(), "{output:?}");
    let target = format!("\"target\":\"latchkey://{}\"", server.local_addr());
    assert!(stdout.contains(&target), "{stdout}");
}

/// `latchkey bench` with small, fast parameters against `target`.
fn bench_binary(target: &str) -> std::process::Output {
    std::process::Command::new(env!("CARGO_BIN_EXE_latchkey"))
        .args(["bench", "--target", target, "--workload", "uncontended"])
        .args(["--duration", "300ms", "--warmup", "0", "--connections", "1"])
        .args(["--pipeline", "1", "--keys", "10", "--threads", "1"])
        .env_remove("LATCHKEY_SERVER")
        .output()
        .unwrap()
}

#[test]
fn a_run_that_completed_no_cycle_fails() {
    // Accepts (the kernel's backlog does) and never answers.
    let silent = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let target = format!("latchkey://{}", silent.local_addr().unwrap());
    let output = bench_binary(&target);
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert_eq!(output.status.code(), Some(1), "{stderr}");
    assert!(
        stderr.contains("NOTHING MEASURED: no uncontended cycle completed"),
        "{stderr}"
    );
    assert!(stderr.contains("is it a latchkey server"), "{stderr}");

    // Answers, but like Redis, not in latchkey frames.
    let resp = common::not_latchkey_server(Duration::from_secs(10));
    let output = bench_binary(&format!("latchkey://{resp}"));
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert_eq!(output.status.code(), Some(1), "{stderr}");
    assert!(stderr.contains("no cycle completed"), "{stderr}");
}

#[test]
fn a_target_of_servers_that_are_not_one_cluster_is_refused() {
    let start = || {
        let mut config = Config::default();
        config.server.listen = "127.0.0.1:0".parse().unwrap();
        config.server.cores = 1;
        latchkey::node::start(config).expect("server starts")
    };
    let (one, two) = (start(), start());
    let output = bench_binary(&format!(
        "latchkey://{},{}",
        one.local_addr(),
        two.local_addr()
    ));
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert_ne!(output.status.code(), Some(0), "{stderr}");
    // Each named, as a client given that list names them (the rules are one: check.rs).
    assert!(stderr.contains("not members of one cluster"), "{stderr}");
    for server in [&one, &two] {
        let named = format!("{}: it is a standalone server", server.local_addr());
        assert!(stderr.contains(&named), "{stderr}");
    }
    for server in [one, two] {
        server.shutdown();
        server.join().unwrap();
    }
}
