//! Smoke test of `latchkey bench` against an in-process server: about two seconds of each
//! lock workload with small parameters must complete cycles with no unexpected answer and no
//! connection error.

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
    let server = latchkey::server::start(config).expect("server starts");
    let address = server.local_addr();

    let uncontended = run(address, Workload::Uncontended, |config| {
        config.duration = Duration::from_millis(600);
    });
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
    let server = latchkey::server::start(config).expect("server starts");
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
