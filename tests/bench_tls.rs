//! `latchkey bench --target latchkeys://HOST:PORT`: the workloads over TLS against an
//! in-process server with a test CA and an IP-SAN certificate for 127.0.0.1; the binary with
//! `--json` (and a client certificate when the server asks for one), the library for the other
//! workloads, `--tls-server-name` for a certificate without the address, and handshakes that
//! fail before anything is measured.

use std::path::Path;
use std::process::{Command, Output};
use std::time::Duration;

use common::pki::Pki;
use common::server::{start_with, test_config};
use latchkey::bench::{execute, parse_target, BenchConfig, Workload};
use latchkey::config::TlsConfig;
use latchkey_client::tls::{ClientFiles, Connector};
use serde_json::Value;

/// `latchkey bench` of `target`, uncontended at pipeline 16 for half a second, with `flags`;
/// no TLS setting from the environment.
fn bench_binary(target: &str, flags: &[&Path]) -> Output {
    let mut command = Command::new(env!("CARGO_BIN_EXE_latchkey"));
    for name in ["LATCHKEY_SERVER", "LATCHKEY_TLS_CA", "LATCHKEY_TLS_CERT"] {
        command.env_remove(name);
    }
    command
        .env_remove("LATCHKEY_TLS_KEY")
        .args(["bench", "--target", target, "--workload", "uncontended"])
        .args(["--pipeline", "16", "--connections", "2", "--threads", "1"])
        .args(["--duration", "500ms", "--warmup", "100ms", "--keys", "1000"])
        .arg("--json");
    for pair in flags.chunks(2) {
        command.arg(pair[0]).arg(pair[1]);
    }
    command.output().unwrap()
}

/// The JSON report of a run that must have succeeded, checked for requests and no errors.
fn checked_report(output: &Output, target: &str) -> Value {
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(output.status.success(), "{output:?}\n{stderr}");
    let report: Value = serde_json::from_slice(&output.stdout).expect("one JSON object");
    assert_eq!(report["target"], target, "{report}");
    assert!(report["requests"].as_u64().unwrap() > 0, "{report}");
    assert!(report["cycles"].as_u64().unwrap() > 0, "{report}");
    assert_eq!(report["errors"]["io"], 0, "{report}");
    assert_eq!(report["errors"]["protocol"], 0, "{report}");
    assert_eq!(report["unexpected"], 0, "{report}");
    assert_eq!(report["ok"], true, "{report}");
    report
}

#[test]
fn uncontended_over_tls_from_the_command_line() {
    let pki = Pki::new("bench");
    let server = start_with(pki.server_config(false));
    let target = format!("latchkeys://{}", server.local_addr());
    let ca = pki.ca_file();
    let output = bench_binary(&target, &[Path::new("--tls-ca"), &ca]);
    let report = checked_report(&output, &target);
    assert_eq!(report["parameters"]["pipeline"], 16, "{report}");
    server.shutdown();
    server.join().unwrap();
}

#[test]
fn uncontended_over_tls_with_a_client_certificate() {
    let pki = Pki::new("bench-mtls");
    let server = start_with(pki.server_config(true));
    let (cert, key) = pki.leaf("bench", "bench", &["bench.example"]);
    let target = format!("latchkeys://{}", server.local_addr());
    let ca = pki.ca_file();
    let flags = [
        Path::new("--tls-ca"),
        &ca,
        Path::new("--tls-cert"),
        &cert,
        Path::new("--tls-key"),
        &key,
    ];
    checked_report(&bench_binary(&target, &flags), &target);
    server.shutdown();
    server.join().unwrap();
}

#[test]
fn a_certificate_without_the_address_needs_the_server_name() {
    let pki = Pki::new("bench-name");
    let (cert_file, key_file) = pki.leaf("named", "latchkey server", &["latchkey.test"]);
    let mut config = test_config(1);
    config.tls = Some(TlsConfig {
        cert_file,
        key_file,
        client_ca_file: None,
    });
    let server = start_with(config);
    let target = format!("latchkeys://{}", server.local_addr());
    let ca = pki.ca_file();
    let by_address = bench_binary(&target, &[Path::new("--tls-ca"), &ca]);
    let stderr = String::from_utf8_lossy(&by_address.stderr);
    assert_eq!(by_address.status.code(), Some(2), "{stderr}");
    assert!(stderr.contains("TLS handshake"), "{stderr}");
    let flags = [
        Path::new("--tls-ca"),
        &ca,
        Path::new("--tls-server-name"),
        Path::new("latchkey.test"),
    ];
    checked_report(&bench_binary(&target, &flags), &target);
    server.shutdown();
    server.join().unwrap();
}

#[test]
fn contended_and_hold_over_tls() {
    let pki = Pki::new("bench-workloads");
    let server = start_with(pki.server_config(false));
    let target = parse_target(&format!("latchkeys://{}", server.local_addr())).unwrap();
    let files = ClientFiles {
        ca_file: pki.ca_file(),
        cert_and_key: None,
    };
    let connector = Connector::new(&files, None).unwrap();
    for workload in [Workload::Contended, Workload::Hold] {
        let mut config = BenchConfig::new(target.clone(), workload);
        config.tls = Some(connector.clone());
        (config.connections, config.pipeline, config.threads) = (4, 4, 2);
        config.warmup = Duration::from_millis(100);
        config.duration = Duration::from_millis(400);
        (config.hot_keys, config.keys) = (2, 200);
        config.lease = Duration::from_secs(1);
        let config = config.validate().unwrap();
        let report = execute(&config).expect("the run was made");
        assert!(report.ok(), "{}", report.to_table());
        assert!(report.stats.cycles > 0, "{}", report.to_table());
        assert!(report.to_json().contains("latchkeys://"));
    }
    server.shutdown();
    server.join().unwrap();
}

#[test]
fn a_failed_handshake_is_a_run_that_cannot_start() {
    let pki = Pki::new("bench-bad");
    let other = Pki::new("bench-other");
    let server = start_with(pki.server_config(false));
    let target = format!("latchkeys://{}", server.local_addr());
    let wrong_ca = other.ca_file();
    let output = bench_binary(&target, &[Path::new("--tls-ca"), &wrong_ca]);
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert_eq!(output.status.code(), Some(2), "{stderr}");
    assert!(stderr.contains("TLS handshake"), "{stderr}");
    server.shutdown();
    server.join().unwrap();

    // A plaintext server: the handshake fails, nothing is measured.
    let plain = common::server::start(1);
    let target = format!("latchkeys://{}", plain.local_addr());
    let ca = pki.ca_file();
    let output = bench_binary(&target, &[Path::new("--tls-ca"), &ca]);
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert_eq!(output.status.code(), Some(2), "{stderr}");
    assert!(stderr.contains("TLS handshake"), "{stderr}");
    plain.shutdown();
    plain.join().unwrap();
}

#[test]
fn the_scheme_and_the_tls_flags_must_agree() {
    let pki = Pki::new("bench-usage");
    let ca = pki.ca_file();
    let output = bench_binary("latchkeys://127.0.0.1:1", &[]);
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert_eq!(output.status.code(), Some(2), "{stderr}");
    assert!(stderr.contains("needs --tls-ca"), "{stderr}");
    for target in ["latchkey://127.0.0.1:1", "redis://127.0.0.1:1"] {
        let output = bench_binary(target, &[Path::new("--tls-ca"), &ca]);
        let stderr = String::from_utf8_lossy(&output.stderr);
        assert_eq!(output.status.code(), Some(2), "{stderr}");
        assert!(stderr.contains("latchkeys://"), "{stderr}");
    }
}
