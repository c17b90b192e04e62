//! Authorization by key prefix (`[[auth.rule]]`) over TLS with client certificates: every keyed
//! request outside the identity's prefixes gets `X` 8 and has no effect, on every partition; the
//! session goes on; identities come from the certificate's CN and DNS SANs; admin requests need
//! a named identity and `/keys` lists only what it may use. Certificates are made at test time;
//! one in-process server per test on 127.0.0.1:0.

use common::pki::{https_get, raw_client_config, raw_connect, Pki};
use common::server::{keys_on_partition, start_with, Conn, RawStream};
use latchkey::config::{AuthRule, Config};
use latchkey::server::ServerHandle;
use latchkey_client::protocol::{ErrorCode, Response};
use std::net::SocketAddr;
use std::path::PathBuf;

const CORES: usize = 2;

fn rule(identity: &str, prefixes: &[&str]) -> AuthRule {
    AuthRule {
        identity: identity.to_string(),
        prefixes: prefixes.iter().map(|p| p.to_string()).collect(),
    }
}

/// A TLS server requiring client certificates, with the rules of these tests.
fn server(pki: &Pki) -> ServerHandle {
    let mut config: Config = pki.server_config(true);
    config.server.cores = CORES;
    config.limits.max_keys = 1024;
    config.auth_rules = vec![
        rule("billing", &["billing/", "shared/"]),
        rule("ops", &[""]),
        rule("monitor", &[]),
        rule("billing", &["invoices/"]),
    ];
    start_with(config)
}

/// A certificate with common name `cn` and these DNS SANs.
fn identity(pki: &Pki, cn: &str, dns_names: &[&str]) -> (PathBuf, PathBuf) {
    pki.leaf(&format!("client-{cn}"), cn, dns_names)
}

/// A raw protocol connection presenting `cert`.
fn connect(addr: SocketAddr, pki: &Pki, cert: &(PathBuf, PathBuf)) -> Conn<impl RawStream> {
    let config = raw_client_config(&pki.ca_file(), Some((&cert.0, &cert.1)));
    Conn::over(raw_connect(addr, config))
}

fn forbidden(id: u64) -> Response {
    Response::Error {
        code: ErrorCode::Forbidden,
        id,
    }
}

/// Every keyed request on `key` gets `X` 8 with its correlation id; the session goes on.
fn assert_every_keyed_request_forbidden<S: RawStream>(conn: &mut Conn<S>, key: &str) {
    assert_eq!(conn.acquire(key, 0, 30, 11), forbidden(11), "acquire {key}");
    assert_eq!(
        conn.acquire(key, 5, 30, 12),
        forbidden(12),
        "waiting acquire {key}"
    );
    assert_eq!(conn.release(key, 13), forbidden(13), "release {key}");
    assert_eq!(conn.extend(key, 30, 14), forbidden(14), "extend {key}");
    assert_eq!(conn.query(key, 15), forbidden(15), "query {key}");
    conn.cancel(key, 16);
    assert_eq!(conn.recv(), forbidden(16), "cancel {key}");
    assert_eq!(conn.ping(17), Response::Pong { nonce: 17 });
}

#[test]
fn keys_outside_the_identitys_prefixes_are_refused_on_every_partition_without_effect() {
    let pki = Pki::new("auth-refused");
    let server = server(&pki);
    let addr = server.local_addr();
    let billing = identity(&pki, "billing", &[]);
    let ops = identity(&pki, "ops", &[]);
    let mut conn = connect(addr, &pki, &billing);
    let mut admin = connect(addr, &pki, &ops);
    for partition in 0..CORES {
        for key in keys_on_partition("ops/p", partition, CORES, 2) {
            assert_every_keyed_request_forbidden(&mut conn, &key);
            // No effect: the key is free, and ops may take it.
            assert!(!admin.state(&key).held, "{key}");
            let token = admin.acquire_ok(&key, 30, 21);
            // The holder's lock is not touched by a forbidden release or extend.
            assert_eq!(conn.release(&key, token), forbidden(token));
            assert_eq!(conn.extend(&key, 1, token), forbidden(token));
            assert!(admin.state(&key).held);
            assert_eq!(admin.release(&key, token), Response::Released { token });
        }
        // The same session may use its own prefixes on every partition.
        for prefix in ["billing/p", "shared/p", "invoices/p"] {
            for key in keys_on_partition(prefix, partition, CORES, 2) {
                let token = conn.acquire_ok(&key, 30, 31);
                assert!(conn.state(&key).held);
                assert_eq!(conn.release(&key, token), Response::Released { token });
            }
        }
    }
    // Prefixes are byte prefixes: `billing` alone, or another case, is not `billing/`.
    for key in ["billing", "Billing/1", "xbilling/1", "shared"] {
        assert_every_keyed_request_forbidden(&mut conn, key);
    }
    // Counted: 6 per forbidden key, 2 more per key another identity held.
    let (status, body) = get(addr, &pki, &ops, "/stats");
    assert_eq!(status, 200, "{body}");
    let stats: serde_json::Value = serde_json::from_str(&body).unwrap();
    let keys = 2 * CORES as u64 + 4;
    let held = 2 * CORES as u64;
    assert_eq!(stats["requests_forbidden"], 6 * keys + 2 * held, "{stats}");
    assert_eq!(stats["acquires"]["rejected"], 2 * keys, "{stats}");
    drop((conn, admin));
    server.shutdown();
    server.join().unwrap();
}

#[test]
fn an_identity_no_rule_names_may_use_no_key_but_may_ping() {
    let pki = Pki::new("auth-unknown");
    let server = server(&pki);
    let addr = server.local_addr();
    for cert in [
        identity(&pki, "mallory", &["mallory.example"]),
        identity(&pki, "monitor", &[]),
    ] {
        let mut conn = connect(addr, &pki, &cert);
        for key in ["billing/1", "ops/1", "mallory/1"] {
            assert_every_keyed_request_forbidden(&mut conn, key);
        }
    }
    server.shutdown();
    server.join().unwrap();
}

#[test]
fn a_dns_san_is_an_identity_too_and_identities_add_up() {
    let pki = Pki::new("auth-san");
    let server = server(&pki);
    let addr = server.local_addr();
    // CN names no rule; the DNS SAN `billing` does.
    let by_san = identity(&pki, "batch-7", &["billing"]);
    let mut conn = connect(addr, &pki, &by_san);
    let token = conn.acquire_ok("billing/san", 30, 1);
    assert_eq!(
        conn.release("billing/san", token),
        Response::Released { token }
    );
    assert_every_keyed_request_forbidden(&mut conn, "ops/san");
    // CN `monitor` (no keys) and SAN `ops` (every key).
    let both = identity(&pki, "monitor", &["ops"]);
    let mut conn = connect(addr, &pki, &both);
    let token = conn.acquire_ok("anything/at/all", 30, 2);
    assert_eq!(
        conn.release("anything/at/all", token),
        Response::Released { token }
    );
    server.shutdown();
    server.join().unwrap();
}

/// One admin request over TLS with `cert`: status and body.
fn get(addr: SocketAddr, pki: &Pki, cert: &(PathBuf, PathBuf), path: &str) -> (u16, String) {
    let config = raw_client_config(&pki.ca_file(), Some((&cert.0, &cert.1)));
    let text = https_get(addr, config, path);
    let status = text
        .split(' ')
        .nth(1)
        .and_then(|code| code.parse().ok())
        .unwrap_or_else(|| panic!("no status in {text:?}"));
    let body = text.split_once("\r\n\r\n").map_or("", |(_, body)| body);
    (status, body.to_string())
}

fn listed_keys(body: &str) -> Vec<String> {
    let json: serde_json::Value = serde_json::from_str(body).expect("JSON");
    let keys = json.as_array().expect("a key list");
    keys.iter()
        .map(|entry| entry["key"].as_str().expect("a key").to_string())
        .collect()
}

#[test]
fn admin_requests_need_a_named_identity_and_keys_lists_only_permitted_keys() {
    let pki = Pki::new("auth-admin");
    let server = server(&pki);
    let addr = server.local_addr();
    let ops = identity(&pki, "ops", &[]);
    let billing = identity(&pki, "billing", &[]);
    let monitor = identity(&pki, "monitor", &[]);
    let mallory = identity(&pki, "mallory", &[]);
    let mut holder = connect(addr, &pki, &ops);
    let held = ["billing/a", "invoices/b", "ops/c", "shared/d", "zeta/e"];
    for (owner, key) in held.iter().enumerate() {
        holder.acquire_ok(key, 60, owner as u64 + 1);
    }
    let (status, body) = get(addr, &pki, &ops, "/keys");
    assert_eq!(status, 200, "{body}");
    assert_eq!(listed_keys(&body), held);
    let (status, body) = get(addr, &pki, &billing, "/keys");
    assert_eq!(status, 200, "{body}");
    assert_eq!(listed_keys(&body), ["billing/a", "invoices/b", "shared/d"]);
    let (status, body) = get(addr, &pki, &billing, "/keys?prefix=s");
    assert_eq!(
        (status, listed_keys(&body)),
        (200, vec!["shared/d".to_string()])
    );
    let (status, body) = get(addr, &pki, &monitor, "/keys");
    assert_eq!((status, listed_keys(&body)), (200, Vec::<String>::new()));
    for path in ["/metrics", "/stats"] {
        for cert in [&ops, &billing, &monitor] {
            assert_eq!(get(addr, &pki, cert, path).0, 200, "{path}");
        }
    }
    for path in ["/metrics", "/stats", "/keys", "/keys?prefix=billing/"] {
        let (status, body) = get(addr, &pki, &mallory, path);
        assert_eq!(status, 403, "{path}: {body}");
        assert!(body.contains("auth.rule"), "{body}");
    }
    // Health says nothing about keys: any client that passed the handshake may ask.
    let (status, body) = get(addr, &pki, &mallory, "/health");
    assert_eq!((status, body.as_str()), (200, "serving\n"));
    // Nor does the card (which cluster the server is in), which clients ask for every address
    // of a list before they use it.
    let (status, body) = get(addr, &pki, &mallory, "/cluster");
    assert_eq!(status, 200, "{body}");
    let card = latchkey_client::card::Card::parse(&body).expect("a card");
    assert!(
        matches!(card, latchkey_client::card::Card::Standalone { .. }),
        "{card:?}"
    );
    drop(holder);
    server.shutdown();
    server.join().unwrap();
}

#[test]
fn the_cli_exits_84_for_a_forbidden_key_and_runs_under_a_permitted_one() {
    let pki = Pki::new("auth-cli");
    let server = server(&pki);
    let addr = server.local_addr().to_string();
    let (cert, key) = identity(&pki, "billing", &[]);
    let lock = |name: &str| {
        std::process::Command::new(env!("CARGO_BIN_EXE_latchkey"))
            .args(["lock", "--server", &addr, "--wait", "0", "--tls-ca"])
            .arg(pki.ca_file())
            .env("LATCHKEY_TLS_CERT", &cert)
            .env("LATCHKEY_TLS_KEY", &key)
            .args([name, "--", "echo", "ran"])
            .output()
            .expect("latchkey lock runs")
    };
    let refused = lock("ops/deploy");
    let stderr = String::from_utf8_lossy(&refused.stderr);
    assert_eq!(refused.status.code(), Some(84), "{stderr}");
    assert!(stderr.contains("ops/deploy"), "{stderr}");
    assert!(stderr.contains("forbidden for this identity"), "{stderr}");
    assert!(refused.stdout.is_empty(), "the command must not run");
    let permitted = lock("billing/nightly");
    let stderr = String::from_utf8_lossy(&permitted.stderr);
    assert_eq!(permitted.status.code(), Some(0), "{stderr}");
    assert_eq!(String::from_utf8_lossy(&permitted.stdout), "ran\n");
    server.shutdown();
    server.join().unwrap();
}
