//! Starting cluster members safely, as processes on loopback: a member's data directory is
//! locked for its life (a second process on it exits 70 naming it and the holder) and records
//! whose data it holds (a restart with another node id, member list, shard or core count exits
//! 70 naming the key; the same config starts); the single node's limits hold on a member with
//! two cores; the startup line says TLS, rules and the role; a forbidden key is logged with
//! its identity and key, escaped; a start error is printed once.
//!
//! Every wait is bounded; nothing is timed but "within" bounds of seconds.

use common::cluster::{serve_to_exit, Cluster};
use common::pki::{raw_client_config, raw_connect, Pki};
use common::server::{fresh_id, wait_for_line, Conn, ServerProcess, TempDir};
use latchkey::cluster::partition::shard_of;
use latchkey_client::protocol::{ErrorCode, Request, Response};
use std::net::TcpListener;
use std::time::Duration;

const LIMIT: Duration = Duration::from_secs(10);

fn acquire(key: &'static str, wait_s: u8, lease_s: u8) -> impl Fn() -> Request<'static> {
    let owner = fresh_id();
    move || Request::Acquire {
        wait_s,
        lease_s,
        owner,
        key: key.as_bytes(),
    }
}

/// A key that lives as long as the test process (requests borrow their key).
fn leak(key: String) -> &'static str {
    Box::leak(key.into_boxed_str())
}

/// `count` keys of shard `shard` of `shards`, named after `label`.
fn keys_of_shard(label: &str, shard: u32, shards: u32, count: usize) -> Vec<&'static str> {
    (0..)
        .map(|n| format!("{label}/{n}"))
        .filter(|key| shard_of(key.as_bytes(), shards) == shard)
        .take(count)
        .map(leak)
        .collect()
}

fn free_port() -> u16 {
    let listener = TcpListener::bind("127.0.0.1:0").expect("bind");
    listener.local_addr().expect("addr").port()
}

/// Runs the config `text` (written as `name` in the cluster's directory) with `args` until it
/// exits: it must exit 70 and say `says` exactly once on stderr.
fn assert_refused(cluster: &Cluster, name: &str, text: &str, args: &[&str], says: &str) {
    let path = cluster.file(name);
    std::fs::write(&path, text).expect("write config");
    let (code, stderr) = serve_to_exit(&path, args);
    assert_eq!(code, Some(70), "{name}: stderr: {stderr}");
    assert_eq!(
        stderr.matches(says).count(),
        1,
        "{name}: {says:?} said once on stderr: {stderr}"
    );
}

#[test]
fn a_second_process_on_a_running_members_data_dir_exits_70_naming_it_and_its_holder() {
    let cluster = Cluster::start("startup-lock", 1, 4, true);
    let first = &cluster.members[0];
    let pid = first.process.as_ref().expect("running").child.id();
    let role = format!(
        "; cluster member 1 of 1, 4 shards, peers on {}, fsync on",
        first.peer
    );
    wait_for_line(&first.log, &["latchkey listening on", &role], LIMIT);
    // Member 2 of a cluster that lists both, configured with member 1's data_dir by mistake.
    let text = format!(
        "[server]\ncores = 1\n[cluster]\nnode_id = 2\ndata_dir = {:?}\nshards = 4\n\
         members = [\n  {{ id = 1, client = \"{}\", peer = \"{}\" }},\n  \
         {{ id = 2, client = \"127.0.0.1:{}\", peer = \"127.0.0.1:{}\" }},\n]\n",
        first.data,
        first.client,
        first.peer,
        free_port(),
        free_port()
    );
    let says = format!(
        "cluster.data_dir {} is in use by another latchkey process: pid {pid}, node 1, since ",
        first.data.display()
    );
    assert_refused(&cluster, "member-2-wrong-dir.toml", &text, &[], &says);
    // The first member serves on.
    let key = "startup/lock";
    let (_, answer) = cluster.call(key, &[], LIMIT, acquire(key, 0, 30));
    assert!(matches!(answer, Response::Acquired { .. }), "{answer:?}");
}

#[test]
fn a_restart_that_disagrees_with_its_data_dir_is_refused_naming_the_key_and_the_same_starts() {
    let mut cluster = Cluster::start("startup-record", 3, 4, true);
    let key = "startup/record";
    let (_, held) = cluster.call(key, &[], LIMIT, acquire(key, 0, 120));
    assert!(matches!(held, Response::Acquired { .. }), "{held:?}");
    cluster.stop(2);
    let config = cluster.config_text(2);
    let dir = cluster.members[2].data.display().to_string();
    let at = |key: &str| format!("{key}: cluster.data_dir {dir} ");
    // Member 1's id (its addresses are in use: the data_dir is checked before anything else).
    let says = at("cluster.node_id") + "holds the data of member 3, this config says 1";
    let other_node = config.replace("node_id = 3", "node_id = 1");
    assert_refused(&cluster, "node.toml", &other_node, &[], &says);
    // Five members where the directory was written for three.
    let five = config.replace(
        "\n]\n",
        "\n  { id = 4, client = \"127.0.0.1:1\", peer = \"127.0.0.1:2\" },\
         \n  { id = 5, client = \"127.0.0.1:3\", peer = \"127.0.0.1:4\" },\n]\n",
    );
    assert_refused(&cluster, "five.toml", &five, &[], &at("cluster.members"));
    let says = "4@127.0.0.1:1,5@127.0.0.1:3` (members and their client addresses do not change";
    assert_refused(&cluster, "five.toml", &five, &[], says);
    let says = at("cluster.shards") + "was written with cluster.shards = 4, this config has 8";
    let resharded = config.replace("shards = 4", "shards = 8");
    assert_refused(&cluster, "shards.toml", &resharded, &[], &says);
    let says = at("server.cores") + "was written with server.cores = 1, this start has 2";
    assert_refused(&cluster, "cores.toml", &config, &["--cores", "2"], &says);
    // Said once without a logger for errors too.
    let quiet = format!("[log]\nlevel = \"off\"\n{config}");
    assert_refused(&cluster, "quiet.toml", &quiet, &["--cores", "2"], &says);
    // The same config starts, and the cluster still holds the key.
    cluster.launch(2);
    match cluster.serving(key, &[], LIMIT) {
        Some((_, Response::State { held: true, .. })) => {}
        other => panic!("{key} after the refused restarts: {other:?}"),
    }
}

#[test]
fn max_keys_and_max_pending_per_session_hold_on_a_member_with_two_cores() {
    let sections = "[server]\ncores = 2\n[limits]\nmax_keys = 4\nmax_pending_per_session = 1\n";
    let cluster = Cluster::start_sections("startup-limits", 1, 4, sections);
    // One key per shard; shards 0 and 2 are core 0's, 1 and 3 core 1's.
    let shard0 = keys_of_shard("limits", 0, 4, 2);
    let shard1 = keys_of_shard("limits", 1, 4, 1);
    let mut tokens = Vec::new();
    for key in [shard0[0], shard1[0]] {
        match cluster.call(key, &[], LIMIT, acquire(key, 0, 60)) {
            (_, Response::Acquired { token, .. }) => tokens.push(token),
            (_, other) => panic!("{key}: {other:?}"),
        }
    }
    // Shard 0 holds its share: a new key there is refused, a wait or not.
    for wait_s in [0, 5] {
        let (_, answer) = cluster.call(shard0[1], &[], LIMIT, acquire(shard0[1], wait_s, 60));
        assert!(matches!(answer, Response::Busy { .. }), "{answer:?}");
    }
    // One queued acquire per session, across the cores.
    let mut waiter = cluster.conn(0);
    let (first, second) = (fresh_id(), fresh_id());
    waiter.send_acquire(shard0[0], 30, 60, first);
    let mut probe = cluster.conn(0);
    assert!(common::server::wait_until(LIMIT, || probe
        .state(shard0[0])
        .waiters
        == 1));
    waiter.send_acquire(shard1[0], 30, 60, second);
    assert_eq!(waiter.recv(), Response::Busy { owner: second });
    // The holder releases: the queued acquire is granted and its place is free again.
    let mut holder = cluster.conn(0);
    assert_eq!(
        holder.release(shard0[0], tokens[0]),
        Response::Released { token: tokens[0] }
    );
    assert!(matches!(waiter.recv(), Response::Acquired { owner, .. } if owner == first));
    let third = fresh_id();
    waiter.send_acquire(shard1[0], 30, 60, third);
    assert!(common::server::wait_until(LIMIT, || probe
        .state(shard1[0])
        .waiters
        == 1));
    waiter.expect_silence(Duration::from_millis(100));
    // Closing the session withdraws it (a debug build checks its count is back to zero).
    drop(waiter);
    assert!(common::server::wait_until(LIMIT, || probe
        .state(shard1[0])
        .waiters
        == 0));
    assert_eq!(probe.ping(1), Response::Pong { nonce: 1 });
}

#[test]
fn the_startup_line_says_tls_and_rules_and_a_forbidden_key_is_logged_escaped() {
    let pki = Pki::new("startup-line");
    let (cert, key) = pki.leaf("server", "latchkey server", &["127.0.0.1"]);
    let dir = TempDir::new("startup-line");
    let config = dir.path().join("latchkey.toml");
    let text = format!(
        "[tls]\ncert_file = {cert:?}\nkey_file = {key:?}\nclient_ca_file = {:?}\n\
         [[auth.rule]]\nidentity = \"billing\"\nprefixes = [\"billing/\"]\n\
         [[auth.rule]]\nidentity = \"ops\"\nprefixes = [\"\"]\n",
        pki.ca_file()
    );
    std::fs::write(&config, text).unwrap();
    let args = ["--config", config.to_str().unwrap(), "--cores", "1"];
    let (server, log) = ServerProcess::spawn_logging(&args, "info");
    let summary = " tls=on (mTLS: client certificates required) auth_rules=2; single node";
    wait_for_line(&log, &["latchkey listening on", summary], LIMIT);
    let billing = pki.leaf("client-billing", "billing", &[]);
    let tls = raw_client_config(&pki.ca_file(), Some((&billing.0, &billing.1)));
    let mut conn = Conn::over(raw_connect(server.addr, tls));
    let key = format!("other/\r\u{1b}[2J\"{}", "x".repeat(100));
    let owner = fresh_id();
    conn.send(Request::Acquire {
        wait_s: 0,
        lease_s: 30,
        owner,
        key: key.as_bytes(),
    });
    let forbidden = Response::Error {
        code: ErrorCode::Forbidden,
        id: owner,
    };
    assert_eq!(conn.recv(), forbidden);
    // 12 characters before the x's: 52 of them are shown, 48 bytes left out.
    let shown = format!(
        "\"other/\\r\\u{{1b}}[2J\\\"{}\" (and 48 more bytes)",
        "x".repeat(52)
    );
    let line = wait_for_line(&log, &["X code 8 (Forbidden): identity \"billing\""], LIMIT);
    assert!(
        line.ends_with(&format!("may not use key {shown}")),
        "{line}"
    );
    assert!(
        !log.lock().unwrap().contains('\u{1b}'),
        "a raw control byte in the log"
    );
}
