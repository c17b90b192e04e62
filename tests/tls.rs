//! TLS on the lock port: certificates made at test time (rcgen), an in-process server per test
//! on 127.0.0.1:0, every wait bounded.

use common::pki::{https_get, raw_client_config, raw_connect, tls_client, Pki};
use common::server::start_with;
use latchkey::config::TlsConfig;
use latchkey_client::{AcquireError, ReleaseOutcome};
use std::io::{Read, Write};
use std::net::TcpStream;
use std::time::{Duration, Instant};

const PING: [u8; 10] = [b'P', 0, 0, 0, 0, 0, 0, 0, 9, b'\n'];

#[test]
fn ping_over_tls_with_a_raw_rustls_client() {
    let pki = Pki::new("raw");
    let server = start_with(pki.server_config(false));
    let mut stream = raw_connect(server.local_addr(), raw_client_config(&pki.ca_file(), None));
    for _ in 0..3 {
        stream.write_all(&PING).unwrap();
        let mut pong = [0u8; 10];
        stream.read_exact(&mut pong).unwrap();
        assert_eq!(pong, PING);
    }
    // Many pipelined pings: more output than one TLS record and one socket write.
    let batch: Vec<u8> = PING.repeat(5_000);
    stream.write_all(&batch).unwrap();
    let mut answers = vec![0u8; batch.len()];
    stream.read_exact(&mut answers).unwrap();
    assert_eq!(answers, batch);
    drop(stream);
    server.shutdown();
    server.join().unwrap();
}

#[test]
fn a_plaintext_client_gets_nothing_useful_and_is_closed() {
    let pki = Pki::new("plain");
    let server = start_with(pki.server_config(false));
    let mut tcp = TcpStream::connect(server.local_addr()).unwrap();
    tcp.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    tcp.write_all(&PING).unwrap();
    let mut received = Vec::new();
    let started = Instant::now();
    // Whatever comes back (a TLS alert at most) is no Pong, and the connection ends.
    let _ = tcp.read_to_end(&mut received);
    assert!(
        started.elapsed() < Duration::from_secs(9),
        "closed, not timed out"
    );
    assert!(!received.windows(10).any(|w| w == PING), "{received:?}");
    assert!(received.len() < 64, "{received:?}");
    server.shutdown();
    server.join().unwrap();
}

#[test]
fn a_client_without_a_certificate_is_refused_when_client_ca_is_set() {
    let pki = Pki::new("mtls");
    let server = start_with(pki.server_config(true));
    let mut stream = raw_connect(server.local_addr(), raw_client_config(&pki.ca_file(), None));
    let mut pong = [0u8; 10];
    let outcome = stream
        .write_all(&PING)
        .and_then(|()| stream.read_exact(&mut pong));
    assert!(outcome.is_err(), "refused");
    // With a certificate of the CA it works.
    let (cert, key) = pki.leaf("client", "billing", &["billing.example"]);
    let config = raw_client_config(&pki.ca_file(), Some((&cert, &key)));
    let mut stream = raw_connect(server.local_addr(), config);
    stream.write_all(&PING).unwrap();
    stream.read_exact(&mut pong).unwrap();
    assert_eq!(pong, PING);
    server.shutdown();
    server.join().unwrap();
}

#[test]
fn a_slow_handshake_is_closed_at_the_deadline_never_before() {
    let pki = Pki::new("slow");
    let server = start_with(pki.server_config(false));
    let mut tcp = TcpStream::connect(server.local_addr()).unwrap();
    let deadline = latchkey::server::tls::HANDSHAKE_DEADLINE;
    tcp.set_read_timeout(Some(deadline * 3)).unwrap();
    let started = Instant::now();
    // One byte of a TLS record header, then nothing.
    tcp.write_all(&[0x16]).unwrap();
    let mut sink = Vec::new();
    let _ = tcp.read_to_end(&mut sink);
    let waited = started.elapsed();
    assert!(waited >= deadline, "closed early, after {waited:?}");
    assert!(waited < deadline * 2, "closed late, after {waited:?}");
    server.shutdown();
    server.join().unwrap();
}

#[test]
fn startup_errors_name_the_key_and_the_path() {
    let pki = Pki::new("errors");
    let good = pki.server_config(false);
    let tls = good.tls.clone().unwrap();
    let (_, other_key) = pki.leaf("other", "other", &["127.0.0.1"]);
    let (expired_cert, expired_key) = pki.leaf_with("expired", "old", &["127.0.0.1"], |p| {
        p.not_before = rcgen::date_time_ymd(2001, 1, 1);
        p.not_after = rcgen::date_time_ymd(2002, 1, 1);
    });
    let missing = pki.dir.join("missing.crt");
    let cases = [
        (
            TlsConfig {
                cert_file: missing.clone(),
                ..tls.clone()
            },
            "tls.cert_file",
            &missing,
        ),
        (
            TlsConfig {
                key_file: other_key.clone(),
                ..tls.clone()
            },
            "tls.key_file",
            &other_key,
        ),
        (
            TlsConfig {
                cert_file: expired_cert.clone(),
                key_file: expired_key,
                ..tls.clone()
            },
            "tls.cert_file",
            &expired_cert,
        ),
        (
            TlsConfig {
                client_ca_file: Some(missing.clone()),
                ..tls.clone()
            },
            "tls.client_ca_file",
            &missing,
        ),
    ];
    for (tls, key, path) in cases {
        let mut config = good.clone();
        config.tls = Some(tls);
        let error = latchkey::node::start(config).err().expect("refused");
        let text = error.to_string();
        assert!(text.contains(key), "{text}");
        assert!(text.contains(&path.display().to_string()), "{text}");
    }
    let text = latchkey::node::start(good.clone())
        .map(|_| ())
        .err()
        .map(|e| e.to_string());
    assert_eq!(text, None);
}

#[test]
fn acquire_and_release_over_tls_through_the_official_client() {
    let pki = Pki::new("client");
    let server = start_with(pki.server_config(false));
    let client = tls_client(server.local_addr(), &pki.ca_file(), None);
    for round in 0..20 {
        let key = format!("orders/{round}");
        let ticket = client
            .acquire(&key, Duration::ZERO, Duration::from_secs(30))
            .expect("granted");
        assert!(ticket.token() > 0);
        let state = client.query(&key).unwrap();
        assert!(state.held);
        assert_eq!(ticket.release().unwrap(), ReleaseOutcome::Released);
    }
    client.ping().unwrap();
    drop(client);
    server.shutdown();
    server.join().unwrap();
}

#[test]
fn with_client_ca_the_official_client_presents_its_certificate() {
    let pki = Pki::new("client-mtls");
    let server = start_with(pki.server_config(true));
    let (cert, key) = pki.leaf("billing", "billing", &["billing.example"]);
    let client = tls_client(server.local_addr(), &pki.ca_file(), Some((&cert, &key)));
    let ticket = client
        .acquire("billing/1", Duration::from_secs(1), Duration::from_secs(30))
        .expect("granted");
    assert_eq!(ticket.release().unwrap(), ReleaseOutcome::Released);
    // Without a certificate: refused, never granted.
    let bare = tls_client(server.local_addr(), &pki.ca_file(), None);
    let refused = bare.acquire("billing/2", Duration::ZERO, Duration::from_secs(30));
    assert!(refused.is_err(), "{refused:?}");
    drop((client, bare));
    server.shutdown();
    server.join().unwrap();
}

#[test]
fn a_client_without_the_servers_ca_cannot_connect() {
    let pki = Pki::new("server-ca");
    let other = Pki::new("other-ca");
    let server = start_with(pki.server_config(false));
    let client = tls_client(server.local_addr(), &other.ca_file(), None);
    // A refused certificate is not retried until the deadline: the call fails at once (the
    // bound is generous; retrying would take the whole 20 s wait).
    let started = Instant::now();
    let result = client.acquire("k", Duration::from_secs(20), Duration::from_secs(30));
    assert_eq!(result.err(), Some(AcquireError::Unavailable));
    assert!(
        started.elapsed() < Duration::from_secs(10),
        "{:?}",
        started.elapsed()
    );
    let failure = client
        .last_session_failure()
        .expect("a failed session")
        .to_string();
    assert!(failure.contains("UnknownIssuer"), "{failure}");
    drop(client);
    server.shutdown();
    server.join().unwrap();
}

#[test]
fn the_cli_speaks_tls_with_its_flags_and_env() {
    let pki = Pki::new("cli");
    let server = start_with(pki.server_config(true));
    let (cert, key) = pki.leaf("cli", "ops", &["ops.example"]);
    let addr = server.local_addr().to_string();
    let latchkey = || {
        let mut command = std::process::Command::new(env!("CARGO_BIN_EXE_latchkey"));
        command.env_remove("LATCHKEY_TLS_CA");
        command.env_remove("LATCHKEY_TLS_CERT");
        command.env_remove("LATCHKEY_TLS_KEY");
        command.args(["ping", "--server", &addr, "--transport-timeout", "2s"]);
        command
    };
    let ok = latchkey()
        .arg("--tls-ca")
        .arg(pki.ca_file())
        .arg("--tls-cert")
        .arg(&cert)
        .arg("--tls-key")
        .arg(&key)
        .output()
        .unwrap();
    assert!(ok.status.success(), "{ok:?}");
    let by_env = latchkey()
        .env("LATCHKEY_TLS_CA", pki.ca_file())
        .env("LATCHKEY_TLS_CERT", &cert)
        .env("LATCHKEY_TLS_KEY", &key)
        .output()
        .unwrap();
    assert!(by_env.status.success(), "{by_env:?}");
    let plain = latchkey().output().unwrap();
    assert!(!plain.status.success(), "{plain:?}");
    let lone_cert = latchkey()
        .arg("--tls-cert")
        .arg(&cert)
        .arg("--tls-key")
        .arg(&key)
        .output()
        .unwrap();
    assert_eq!(lone_cert.status.code(), Some(2), "{lone_cert:?}");
    let missing = latchkey()
        .arg("--tls-ca")
        .arg(pki.dir.join("nope.crt"))
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&missing.stderr);
    assert!(!missing.status.success());
    assert!(
        stderr.contains("--tls-ca") && stderr.contains("nope.crt"),
        "{stderr}"
    );
    server.shutdown();
    server.join().unwrap();
}

/// A client pipelines far more pings than the socket buffers hold and stops reading for a
/// while: the server's output backs up (session buffer, rustls, socket) and its reading pauses;
/// then every Pong arrives, in order. (Whether the last write leaves records held in rustls
/// depends on the kernel's buffer sizes; the session's unit test covers that case exactly.)
#[test]
fn tls_output_backed_up_while_the_client_does_not_read_is_delivered() {
    let pki = Pki::new("held");
    let server = start_with(pki.server_config(false));
    let socket = socket2::Socket::new(socket2::Domain::IPV4, socket2::Type::STREAM, None).unwrap();
    socket.set_recv_buffer_size(4096).unwrap();
    socket.connect(&server.local_addr().into()).unwrap();
    let mut tcp: TcpStream = socket.into();
    tcp.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    let config = raw_client_config(&pki.ca_file(), None);
    let mut tls = rustls::ClientConnection::new(config, "127.0.0.1".try_into().unwrap()).unwrap();
    while tls.is_handshaking() {
        tls.complete_io(&mut tcp).unwrap();
    }
    tcp.set_nonblocking(true).unwrap();
    let pings = 30_000;
    let request = PING.repeat(pings);
    let (mut sent, mut received) = (0, 0);
    let mut answers = vec![0u8; 64 * 1024];
    let started = Instant::now();
    let mut reading = false;
    while received < request.len() {
        assert!(
            started.elapsed() < Duration::from_secs(30),
            "stalled at {received}"
        );
        if sent < request.len() {
            sent += tls.writer().write(&request[sent..]).unwrap();
        }
        while tls.wants_write() {
            match tls.write_tls(&mut tcp) {
                Ok(_) => {}
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => break,
                Err(e) => panic!("write: {e}"),
            }
        }
        // Not reading for the first second: the server's output backs up into rustls.
        reading = reading || started.elapsed() > Duration::from_secs(1);
        if !reading {
            std::thread::sleep(Duration::from_millis(5));
            continue;
        }
        match tls.read_tls(&mut tcp) {
            Ok(0) => panic!("server closed at {received}"),
            Ok(_) => {
                tls.process_new_packets().unwrap();
            }
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                std::thread::sleep(Duration::from_millis(1));
            }
            Err(e) => panic!("read: {e}"),
        }
        loop {
            match tls.reader().read(&mut answers) {
                Ok(0) => panic!("server ended at {received}"),
                Ok(n) => {
                    assert_eq!(answers[..n], request[received..received + n]);
                    received += n;
                }
                Err(_) => break,
            }
        }
    }
    drop(tcp);
    server.shutdown();
    server.join().unwrap();
}

/// The admin requests share the port, so over TLS they go through TLS too (no identity check
/// yet: any client the TLS settings admit may ask).
#[test]
fn admin_requests_are_served_over_tls() {
    let pki = Pki::new("admin");
    let server = start_with(pki.server_config(false));
    let config = raw_client_config(&pki.ca_file(), None);
    let text = https_get(server.local_addr(), config, "/health");
    assert!(text.starts_with("HTTP/1.1 200"), "{text}");
    assert!(text.contains("serving"), "{text}");
    server.shutdown();
    server.join().unwrap();
}

/// A client given two TLS servers asks each for its card over TLS: two standalone servers are
/// not one cluster, so neither is used.
#[test]
fn a_client_asks_for_cards_over_tls_and_refuses_two_standalone_servers() {
    let pki = Pki::new("cards");
    let (one, two) = (
        start_with(pki.server_config(false)),
        start_with(pki.server_config(false)),
    );
    let files = common::pki::client_files(&pki.ca_file(), None);
    let tls = latchkey_client::ClientTls {
        files,
        server_name: None,
    };
    let card = latchkey_client::card::fetch(
        one.local_addr(),
        Some(&tls.connector().unwrap()),
        Instant::now() + Duration::from_secs(5),
    );
    assert!(
        matches!(card, Ok(latchkey_client::card::Card::Standalone { .. })),
        "{card:?}"
    );
    let config = latchkey_client::ClientConfig {
        addrs: vec![one.local_addr(), two.local_addr()],
        sessions: 1,
        tls: Some(tls),
        ..latchkey_client::ClientConfig::default()
    };
    let client = latchkey_client::Client::with_config(config).unwrap();
    let refused = client.refused_members(Duration::from_secs(5));
    assert_eq!(refused.len(), 2, "{refused:?}");
    assert!(
        refused
            .iter()
            .all(|(_, why)| why.contains("a standalone server")),
        "{refused:?}"
    );
    let result = client.acquire("k", Duration::from_millis(200), Duration::from_secs(5));
    assert_eq!(result.unwrap_err(), AcquireError::Unavailable);
    drop(client);
    for server in [one, two] {
        server.shutdown();
        server.join().unwrap();
    }
}

#[test]
fn every_command_says_the_same_words_to_a_plaintext_user_of_a_tls_port() {
    let pki = Pki::new("plain-cli");
    let server = start_with(pki.server_config(false));
    let addr = server.local_addr().to_string();
    let said = format!(
        "{addr}: {}: connect with TLS, trusting its CA (--tls-ca FILE, or LATCHKEY_TLS_CA)",
        latchkey_client::SPEAKS_TLS
    );
    let commands: [&[&str]; 5] = [
        &["lock", "--wait", "0", "k", "--", "true"],
        &["query", "k"],
        &["ping"],
        &["stats"],
        &["keys"],
    ];
    for words in commands {
        let output = std::process::Command::new(env!("CARGO_BIN_EXE_latchkey"))
            .env_remove("LATCHKEY_TLS_CA")
            .arg(words[0])
            .args(["--server", &addr])
            .args(&words[1..])
            .output()
            .unwrap();
        let stderr = String::from_utf8_lossy(&output.stderr);
        assert_eq!(output.status.code(), Some(83), "{words:?}: {stderr}");
        let line = format!("cannot reach the server: {said}");
        assert!(stderr.contains(&line), "{words:?}: {stderr}");
        assert!(
            !stderr.contains("unknown response op"),
            "{words:?}: {stderr}"
        );
    }
    // The client's own words, for programs that show them.
    let client = latchkey_client::Client::connect(server.local_addr()).unwrap();
    assert_eq!(
        client.ping(),
        Err(latchkey_client::RequestError::Unavailable)
    );
    let failure = client.last_session_failure().unwrap();
    assert!(
        failure.cause().starts_with(latchkey_client::SPEAKS_TLS),
        "{failure}"
    );
    server.shutdown();
    server.join().unwrap();
}
