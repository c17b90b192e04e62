//! `latchkey stats` and `latchkey keys` over TLS: the binary against an in-process TLS server
//! (a test CA, an IP-SAN certificate for 127.0.0.1), with and without `tls.client_ca_file`;
//! and without `--tls-ca` against it, a clear failure within the timeout.

use std::path::Path;
use std::process::{Command, Output};
use std::time::{Duration, Instant};

use common::pki::{tls_client, Pki};
use common::server::start_with;
use latchkey::cli::EXIT_UNAVAILABLE;
use latchkey_client::Ticket;
use serde_json::Value;

/// `latchkey ARGS --server addr --transport-timeout 3s`, no setting from the environment.
fn latchkey(addr: &str, args: &[&str], tls: &[&Path]) -> Output {
    let mut command = Command::new(env!("CARGO_BIN_EXE_latchkey"));
    for name in ["LATCHKEY_SERVER", "LATCHKEY_TLS_CA", "LATCHKEY_TLS_CERT"] {
        command.env_remove(name);
    }
    command
        .env_remove("LATCHKEY_TLS_KEY")
        .args(args)
        .args(["--server", addr, "--transport-timeout", "3s"])
        .args(tls)
        .output()
        .unwrap()
}

/// Holds `key` through the official client over TLS (so that `keys` has something to list),
/// for as long as the ticket lives.
fn hold(addr: std::net::SocketAddr, ca: &Path, cert: Option<(&Path, &Path)>, key: &str) -> Ticket {
    let client = tls_client(addr, ca, cert);
    client
        .acquire(key, Duration::ZERO, Duration::from_secs(60))
        .expect("granted")
}

/// `stats --json` and `keys` work with these TLS flags; `keys` lists `held`.
fn stats_and_keys_work(addr: &str, tls: &[&Path], held: &str) {
    let stats = latchkey(addr, &["stats", "--json"], tls);
    let stderr = String::from_utf8_lossy(&stats.stderr);
    assert!(stats.status.success(), "{stats:?}\n{stderr}");
    let figures: Value = serde_json::from_slice(&stats.stdout).expect("the /stats JSON");
    assert!(figures["locks_held"].as_u64().unwrap() >= 1, "{figures}");
    let text = latchkey(addr, &["stats"], tls);
    assert!(text.status.success(), "{text:?}");
    assert!(String::from_utf8_lossy(&text.stdout).contains("# Locks"));
    let keys = latchkey(addr, &["keys"], tls);
    let stdout = String::from_utf8_lossy(&keys.stdout);
    assert!(keys.status.success(), "{keys:?}");
    assert!(stdout.contains(held), "{stdout}");
    let json = latchkey(addr, &["keys", "--json", "tls/"], tls);
    let listed: Value = serde_json::from_slice(&json.stdout).expect("the /keys JSON");
    assert_eq!(listed[0]["key"], held, "{listed}");
}

#[test]
fn stats_and_keys_over_tls() {
    let pki = Pki::new("admin-cli");
    let server = start_with(pki.server_config(false));
    let addr = server.local_addr().to_string();
    let ca = pki.ca_file();
    let _holder = hold(server.local_addr(), &ca, None, "tls/one");
    stats_and_keys_work(&addr, &[Path::new("--tls-ca"), &ca], "tls/one");
    server.shutdown();
    server.join().unwrap();
}

#[test]
fn stats_and_keys_over_tls_with_a_client_certificate() {
    let pki = Pki::new("admin-cli-mtls");
    let server = start_with(pki.server_config(true));
    let addr = server.local_addr().to_string();
    let ca = pki.ca_file();
    let (cert, key) = pki.leaf("ops", "ops", &["ops.example"]);
    let _holder = hold(server.local_addr(), &ca, Some((&cert, &key)), "tls/two");
    let flags = [
        Path::new("--tls-ca"),
        &ca,
        Path::new("--tls-cert"),
        &cert,
        Path::new("--tls-key"),
        &key,
    ];
    stats_and_keys_work(&addr, &flags, "tls/two");
    // Without a certificate the server refuses the session: unavailable, and said why.
    let refused = latchkey(&addr, &["stats", "--json"], &[Path::new("--tls-ca"), &ca]);
    let stderr = String::from_utf8_lossy(&refused.stderr);
    let unavailable = Some(i32::from(EXIT_UNAVAILABLE));
    assert_eq!(refused.status.code(), unavailable, "{stderr}");
    assert!(stderr.contains("--tls-cert"), "{stderr}");
    server.shutdown();
    server.join().unwrap();
}

#[test]
fn plaintext_against_a_tls_server_fails_clearly_within_the_timeout() {
    let pki = Pki::new("admin-cli-plain");
    let server = start_with(pki.server_config(false));
    let addr = server.local_addr().to_string();
    for command in ["stats", "keys"] {
        let started = Instant::now();
        let output = latchkey(&addr, &[command], &[]);
        let stderr = String::from_utf8_lossy(&output.stderr);
        assert!(started.elapsed() < Duration::from_secs(3), "{stderr}");
        // As `lock`, `query` and `ping` say it: nothing was served.
        assert_eq!(
            output.status.code(),
            Some(i32::from(EXIT_UNAVAILABLE)),
            "{stderr}"
        );
        assert!(stderr.contains("--tls-ca"), "{stderr}");
    }
    server.shutdown();
    server.join().unwrap();
}

#[test]
fn tls_to_a_plaintext_server_or_with_the_wrong_ca_is_unavailable() {
    let pki = Pki::new("admin-cli-wrong");
    let other = Pki::new("admin-cli-other");
    let plain = common::server::start(1);
    let ca = pki.ca_file();
    let output = latchkey(
        &plain.local_addr().to_string(),
        &["stats"],
        &[Path::new("--tls-ca"), &ca],
    );
    let stderr = String::from_utf8_lossy(&output.stderr);
    let unavailable = Some(i32::from(EXIT_UNAVAILABLE));
    assert_eq!(output.status.code(), unavailable, "{stderr}");
    assert!(stderr.contains("TLS handshake"), "{stderr}");
    plain.shutdown();
    plain.join().unwrap();

    let server = start_with(pki.server_config(false));
    let wrong = other.ca_file();
    let output = latchkey(
        &server.local_addr().to_string(),
        &["keys"],
        &[Path::new("--tls-ca"), &wrong],
    );
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert_eq!(output.status.code(), unavailable, "{stderr}");
    assert!(stderr.contains("TLS handshake"), "{stderr}");
    server.shutdown();
    server.join().unwrap();
}

/// `request` sent raw to `addr` in plaintext; the whole answer, read until the server closes.
fn plaintext(addr: std::net::SocketAddr, request: &[u8]) -> String {
    use std::io::{Read, Write};
    let mut stream = std::net::TcpStream::connect(addr).unwrap();
    stream
        .set_read_timeout(Some(Duration::from_secs(10)))
        .unwrap();
    stream.write_all(request).unwrap();
    let mut answer = Vec::new();
    let _ = stream.read_to_end(&mut answer);
    String::from_utf8_lossy(&answer).into_owned()
}

#[test]
fn a_probe_without_a_client_certificate_reads_health_on_the_health_port() {
    let pki = Pki::new("health-port");
    let mut config = pki.server_config(true);
    config.server.health_listen = Some("127.0.0.1:0".parse().unwrap());
    let server = start_with(config);
    let health = server.health_addr().expect("a health port");
    // On the lock port, a handshake without a client certificate gets nothing.
    let lock_port = plaintext(server.local_addr(), b"GET /health HTTP/1.1\r\n\r\n");
    assert!(!lock_port.starts_with("HTTP/1.1"), "{lock_port:?}");
    // On the health port, plaintext and no certificate: the lock port's answer.
    let answer = plaintext(health, b"GET /health HTTP/1.1\r\nHost: lb\r\n\r\n");
    assert!(answer.starts_with("HTTP/1.1 200 OK\r\n"), "{answer}");
    assert!(answer.ends_with("\r\n\r\nserving\n"), "{answer}");
    let head = plaintext(health, b"HEAD /health HTTP/1.1\r\n\r\n");
    assert!(head.starts_with("HTTP/1.1 200 OK\r\n"), "{head}");
    assert!(
        head.contains("Content-Length: 8\r\n") && head.ends_with("\r\n\r\n"),
        "{head}"
    );
    // Nothing else: no other page, no lock protocol.
    for (request, status) in [
        (&b"GET /metrics HTTP/1.1\r\n\r\n"[..], "404"),
        (b"GET /keys HTTP/1.1\r\n\r\n", "404"),
        (b"P\0\0\0\0\0\0\0\x01\n", "400"),
    ] {
        let answer = plaintext(health, request);
        assert!(
            answer.starts_with(&format!("HTTP/1.1 {status} ")),
            "{answer}"
        );
    }
    server.shutdown();
    server.join().unwrap();
    // The port closed with the server: nothing answers `/health` there any more. The port
    // alone proves nothing while other tests run: a connect may reach another test's socket
    // that was given the port since (or the connecting socket itself, by TCP's simultaneous
    // open), and a bind may fail on one (seen: 3 runs in 25 with the other tests beside it).
    if let Ok(mut stream) = std::net::TcpStream::connect(health) {
        use std::io::{Read, Write};
        let _ = stream.set_read_timeout(Some(Duration::from_secs(2)));
        let _ = stream.write_all(b"GET /health HTTP/1.1\r\n\r\n");
        let mut answer = Vec::new();
        let _ = stream.read_to_end(&mut answer);
        let answer = String::from_utf8_lossy(&answer);
        assert!(
            !answer.starts_with("HTTP/1.1 "),
            "the port closed with the server: {answer}"
        );
    }
}
