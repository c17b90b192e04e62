//! Cluster mode with real processes on loopback: three `latchkey serve` members, kill -9 of a
//! leader, a leader stopped with SIGSTOP, and a whole-cluster kill -9 and restart.
//!
//! Every wait is bounded; timing assertions are "never early" and "not too late" with slack.

use common::cluster::Cluster;
use common::server::fresh_id;
use latchkey_client::card::{self, Card};
use latchkey_client::protocol::{Request, Response};
use std::time::{Duration, Instant};

const FAILOVER_LIMIT: Duration = Duration::from_secs(10);

/// A key that lives as long as the test process (requests borrow their key).
fn leak(key: String) -> &'static str {
    Box::leak(key.into_boxed_str())
}

fn acquire(key: &'static str, wait_s: u8, lease_s: u8) -> impl Fn() -> Request<'static> {
    let owner = fresh_id();
    move || Request::Acquire {
        wait_s,
        lease_s,
        owner,
        key: key.as_bytes(),
    }
}

fn release(key: &'static str, token: u64) -> impl Fn() -> Request<'static> {
    move || Request::Release {
        token,
        key: key.as_bytes(),
    }
}

/// Acquires `key` (wait 0) on whichever member serves it; the member's index and the token.
fn acquire_on_leader(cluster: &Cluster, key: &'static str, lease_s: u8) -> (usize, u64) {
    match cluster.call(key, &[], FAILOVER_LIMIT, acquire(key, 0, lease_s)) {
        (leader, Response::Acquired { token, .. }) => (leader, token),
        (_, other) => panic!("acquire of {key} answered {other:?}"),
    }
}

fn held(state: &Response) -> (bool, u32) {
    match *state {
        Response::State { held, lease_ms, .. } => (held, lease_ms),
        ref other => panic!("not a state: {other:?}"),
    }
}

#[test]
fn kill_9_of_the_leader_keeps_the_key_held_and_its_token_releases_it_on_the_new_leader() {
    let mut cluster = Cluster::start("cluster-kill", 3, 4, true);
    let key = "jobs/failover";
    let (leader, token) = acquire_on_leader(&cluster, key, 30);
    let killed_at = Instant::now();
    cluster.kill(leader);
    let (new_leader, state) = cluster
        .serving(key, &[leader], FAILOVER_LIMIT)
        .expect("a new leader serves the key");
    let failover = killed_at.elapsed();
    assert_ne!(new_leader, leader);
    let (is_held, lease_ms) = held(&state);
    assert!(is_held, "the key must stay held through the failover");
    // Never shorter than what the holder was promised (30 s from before the kill), and at most
    // the lease plus the new leader's grace (and a second of slack).
    let promised = Duration::from_secs(30).saturating_sub(killed_at.elapsed());
    assert!(
        Duration::from_millis(u64::from(lease_ms)) + Duration::from_millis(50) >= promised,
        "lease {lease_ms} ms left, promised {promised:?}"
    );
    assert!(lease_ms <= 31_200, "lease {lease_ms} ms left");
    // Someone else cannot have it; the holder releases it with its token; then it is free.
    let (_, other) = cluster.call(key, &[leader], FAILOVER_LIMIT, acquire(key, 0, 30));
    assert!(matches!(other, Response::Timeout { .. }), "{other:?}");
    let (_, released) = cluster.call(key, &[leader], FAILOVER_LIMIT, release(key, token));
    assert_eq!(released, Response::Released { token });
    let (_, next) = acquire_on_leader(&cluster, key, 30);
    assert!(next > token, "token {next} after {token}");
    eprintln!("failover (kill -9 → a new leader answers Q): {failover:?}");
}

#[test]
fn a_stopped_leader_grants_and_answers_nothing_from_stale_state_after_sigcont() {
    let cluster = Cluster::start("cluster-stop", 3, 4, true);
    let key = "jobs/stopped";
    let (old, token) = acquire_on_leader(&cluster, key, 30);
    // A session opened on the old leader before it stops; its requests wait in the socket.
    let mut stale = cluster.conn(old);
    cluster.signal(old, libc::SIGSTOP);
    let (new, _) = cluster
        .serving(key, &[old], FAILOVER_LIMIT)
        .expect("a new leader while the old one is stopped");
    let _ = new;
    let (_, released) = cluster.call(key, &[old], FAILOVER_LIMIT, release(key, token));
    assert_eq!(released, Response::Released { token });
    let (_, second) = match cluster.call(key, &[old], FAILOVER_LIMIT, acquire(key, 0, 30)) {
        (index, Response::Acquired { token, .. }) => (index, token),
        (_, other) => panic!("{other:?}"),
    };
    // Sent while stopped: the old leader reads them only after SIGCONT, when it still believes
    // it leads. It must not grant (the key is held by `second`) nor report the key free.
    let (owner, nonce) = (fresh_id(), fresh_id());
    stale.send(Request::Acquire {
        wait_s: 0,
        lease_s: 30,
        owner,
        key: key.as_bytes(),
    });
    stale.send(Request::Query {
        nonce,
        key: key.as_bytes(),
    });
    std::thread::sleep(Duration::from_secs(3));
    cluster.signal(old, libc::SIGCONT);
    for _ in 0..2 {
        match stale.recv_within(Duration::from_secs(10)) {
            Some(Response::Acquired { .. }) => panic!("a stopped leader granted a held key"),
            Some(Response::State { held: false, .. }) => {
                panic!("a stopped leader said a held key is free")
            }
            Some(answer) => eprintln!("old leader answered {answer:?}"),
            None => panic!("no answer from the old leader after SIGCONT"),
        }
    }
    // The cluster still knows the truth.
    let (_, state) = cluster.serving(key, &[], FAILOVER_LIMIT).expect("served");
    assert!(held(&state).0);
    let mut conn = cluster.conn(cluster.serving(key, &[], FAILOVER_LIMIT).unwrap().0);
    assert_eq!(
        conn.release(key, second),
        Response::Released { token: second }
    );
}

#[test]
fn a_whole_cluster_kill_9_and_restart_keeps_holds_and_tokens() {
    let mut cluster = Cluster::start("cluster-restart", 3, 4, true);
    let keys: Vec<&'static str> = (0..8).map(|i| leak(format!("jobs/restart-{i}"))).collect();
    let tokens: Vec<u64> = keys
        .iter()
        .map(|key| acquire_on_leader(&cluster, key, 60).1)
        .collect();
    for index in 0..3 {
        cluster.kill(index);
    }
    for index in 0..3 {
        cluster.launch(index);
    }
    for (&key, &token) in keys.iter().zip(&tokens) {
        let (_, state) = cluster
            .serving(key, &[], FAILOVER_LIMIT)
            .expect("served after the restart");
        assert!(held(&state).0, "{key} lost its hold in the restart");
        let (_, other) = cluster.call(key, &[], FAILOVER_LIMIT, acquire(key, 0, 30));
        assert!(matches!(other, Response::Timeout { .. }), "{other:?}");
        let (_, released) = cluster.call(key, &[], FAILOVER_LIMIT, release(key, token));
        assert_eq!(released, Response::Released { token });
        let (_, next) = acquire_on_leader(&cluster, key, 30);
        assert!(next > token, "{key}: token {next} after {token}");
    }
}

#[test]
fn a_leader_cut_off_its_peers_grants_nothing_and_the_others_keep_the_hold() {
    let cluster = Cluster::start_with("cluster-cut", 3, 4, true, true);
    let key = "jobs/cut";
    let (leader, token) = acquire_on_leader(&cluster, key, 30);
    let fresh = leak(same_shard_key(key, 4, 0));
    // Clients still reach the cut member; its peers do not.
    let mut cut_off = cluster.conn(leader);
    cluster.isolate(leader, true);
    let cut_at = Instant::now();
    let (new_leader, state) = cluster
        .serving(key, &[leader], FAILOVER_LIMIT)
        .expect("the majority elects a new leader");
    assert_ne!(new_leader, leader);
    assert!(held(&state).0, "the hold survives on the majority side");
    // The cut member never grants: not the held key, not a free key of the same shard.
    for (round, target) in [key, fresh, key, fresh].into_iter().enumerate() {
        cut_off.send(Request::Acquire {
            wait_s: 0,
            lease_s: 30,
            owner: 7_000 + round as u64,
            key: target.as_bytes(),
        });
    }
    let quiet_until = Instant::now() + Duration::from_secs(2);
    while let Some(left) = quiet_until.checked_duration_since(Instant::now()) {
        match cut_off.recv_within(left) {
            Some(Response::Acquired { .. }) => panic!("a member cut off its peers granted"),
            Some(answer) => eprintln!("cut-off member answered {answer:?}"),
            None => break,
        }
    }
    // The majority serves: the holder releases, the free key is granted there.
    let (_, released) = cluster.call(key, &[leader], FAILOVER_LIMIT, release(key, token));
    assert_eq!(released, Response::Released { token });
    let (_, granted) = cluster.call(fresh, &[leader], FAILOVER_LIMIT, acquire(fresh, 0, 30));
    assert!(matches!(granted, Response::Acquired { .. }), "{granted:?}");
    // Healed, the member rejoins and agrees: the fresh key is held, the first key is free.
    cluster.isolate(leader, false);
    let rejoined = Instant::now();
    loop {
        assert!(
            rejoined.elapsed() < FAILOVER_LIMIT,
            "the healed member never caught up"
        );
        let fresh_state = common::cluster::query(cluster.members[leader].client, fresh, 1);
        let agreed = cluster
            .serving(fresh, &[], FAILOVER_LIMIT)
            .is_some_and(|(_, state)| held(&state).0);
        if agreed && (fresh_state.is_none() || fresh_state.is_some_and(|s| held(&s).0)) {
            break;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    eprintln!("cut at {cut_at:?}; new leader {}", new_leader + 1);
}

/// A key in the same shard as `key` (shards as the cluster's), not `key` itself.
fn same_shard_key(key: &str, shards: u32, round: usize) -> String {
    let shard = latchkey::cluster::partition::shard_of(key.as_bytes(), shards);
    (0..)
        .map(|i| format!("{key}/{round}/{i}"))
        .find(|k| latchkey::cluster::partition::shard_of(k.as_bytes(), shards) == shard)
        .expect("some key")
}

/// Failover time over 20 kills: kill -9 the leader of a key's shard, then time until a fresh
/// key of that shard is granted by a new leader; restart the killed member between rounds.
/// `cargo test --release --test cluster_process -- --ignored --nocapture failover_times`
#[test]
#[ignore]
fn failover_times() {
    let shards = 64;
    let mut cluster = Cluster::start("cluster-failover", 3, shards, true);
    let mut times = Vec::new();
    for round in 0..20 {
        let key = leak(format!("jobs/failover-{round}"));
        let (leader, _) = acquire_on_leader(&cluster, key, 30);
        let probe = same_shard_key(key, shards, round);
        let killed = Instant::now();
        cluster.kill(leader);
        let granted = loop {
            assert!(killed.elapsed() < FAILOVER_LIMIT, "no grant after the kill");
            let mut granted = None;
            for index in (0..3).filter(|&i| i != leader) {
                let Ok(stream) = std::net::TcpStream::connect(cluster.members[index].client) else {
                    continue;
                };
                let mut conn = common::server::Conn::over(stream);
                conn.send(Request::Acquire {
                    wait_s: 0,
                    lease_s: 5,
                    owner: fresh_id(),
                    key: probe.as_bytes(),
                });
                if let Some(Response::Acquired { .. }) = conn.recv_within(Duration::from_secs(2)) {
                    granted = Some(killed.elapsed());
                    break;
                }
            }
            if let Some(elapsed) = granted {
                break elapsed;
            }
            std::thread::sleep(Duration::from_millis(2));
        };
        eprintln!(
            "round {round}: killed member {} → first grant in {granted:?}",
            leader + 1
        );
        times.push(granted);
        cluster.launch(leader);
        std::thread::sleep(Duration::from_millis(500));
    }
    times.sort();
    eprintln!(
        "failover over {} kills: p50 {:?}, max {:?}",
        times.len(),
        times[times.len() / 2],
        times[times.len() - 1]
    );
}

/// `latchkey cluster status` against `cluster`'s members: (exit code, stdout).
fn cluster_status(cluster: &Cluster, json: bool) -> (Option<i32>, String) {
    let servers: Vec<String> = cluster
        .members
        .iter()
        .map(|m| m.client.to_string())
        .collect();
    let mut command = std::process::Command::new(env!("CARGO_BIN_EXE_latchkey"));
    command.args(["cluster", "status", "--server", &servers.join(",")]);
    if json {
        command.arg("--json");
    }
    let output = command.output().expect("run latchkey cluster status");
    let stdout = String::from_utf8_lossy(&output.stdout).into_owned();
    (output.status.code(), stdout)
}

#[test]
fn cluster_status_shows_every_member_its_shards_and_an_unreachable_one() {
    let mut cluster = Cluster::start("cluster-status", 3, 4, false);
    let _ = acquire_on_leader(&cluster, "jobs/status", 30);
    // Every shard gets a leader that serves it; together the members lead all four, and once
    // every member reaches the others (quorum, no refusal) the status is whole: exit 0 (86
    // until then, with the problems listed).
    let started = Instant::now();
    let members = loop {
        let (code, stdout) = cluster_status(&cluster, true);
        assert!(matches!(code, Some(0 | 86)), "{stdout}");
        let value: serde_json::Value = serde_json::from_str(&stdout).expect("JSON");
        let members = value["members"].as_array().expect("members").clone();
        let led: u64 = members
            .iter()
            .filter_map(|m| m["shards_led"].as_u64())
            .sum();
        if led == 4 && code == Some(0) {
            assert_eq!(value["problems"], serde_json::json!([]), "{stdout}");
            break members;
        }
        assert!(started.elapsed() < FAILOVER_LIMIT, "shards led: {stdout}");
        std::thread::sleep(Duration::from_millis(50));
    };
    assert_eq!(members.len(), 3);
    for (index, member) in members.iter().enumerate() {
        assert_eq!(member["reachable"], serde_json::json!(true));
        assert_eq!(member["node_id"], serde_json::json!(index + 1));
        assert_eq!(member["shards"], serde_json::json!(4));
        assert!(member["commit"].as_u64().unwrap() >= member["applied"].as_u64().unwrap() / 2);
    }
    // The text table names every member; a killed one is unreachable and the exit code says so.
    let (code, table) = cluster_status(&cluster, false);
    assert_eq!(code, Some(0), "{table}");
    assert!(table.starts_with("MEMBER"), "{table}");
    // Rows whose STATE is "reachable" (a member's own notes, such as a member that has not
    // heard its peers yet saying "no quorum: 1 of 3 members reachable", are not rows).
    let rows = table
        .lines()
        .filter(|line| line.split_whitespace().nth(2) == Some("reachable"))
        .count();
    assert_eq!(rows, 3, "{table}");
    // A standalone node listed beside the members (an old single node left running): named,
    // and the exit code says the list is not one cluster.
    let standalone = common::start_server(|_| {});
    let mut servers: Vec<String> = cluster
        .members
        .iter()
        .map(|m| m.client.to_string())
        .collect();
    servers.push(standalone.local_addr().to_string());
    let output = std::process::Command::new(env!("CARGO_BIN_EXE_latchkey"))
        .args(["cluster", "status", "--server", &servers.join(",")])
        .output()
        .expect("run latchkey cluster status");
    let table = String::from_utf8_lossy(&output.stdout);
    let named = format!("{}: not a cluster member", standalone.local_addr());
    assert!(table.contains(&named), "{table}");
    assert_eq!(output.status.code(), Some(86), "{table}");
    // Their cards (GET /cluster) say what each is, and a lock command given that list refuses
    // it, naming the standalone node, and takes nothing from it.
    let deadline = Instant::now() + Duration::from_secs(5);
    let card = card::fetch(cluster.members[1].client, None, deadline).expect("a member's card");
    let Card::Member {
        member, clients, ..
    } = &card
    else {
        panic!("not a member's card: {card:?}");
    };
    assert_eq!((*member, clients.len()), (2, 3), "{card:?}");
    let first = card::fetch(cluster.members[0].client, None, deadline).unwrap();
    assert_eq!(first.owner(), card.owner(), "one cluster");
    let alone = card::fetch(standalone.local_addr(), None, deadline).unwrap();
    assert!(matches!(alone, Card::Standalone { .. }), "{alone:?}");
    servers.rotate_right(1);
    let output = std::process::Command::new(env!("CARGO_BIN_EXE_latchkey"))
        .args([
            "lock",
            "--server",
            &servers.join(","),
            "--lease",
            "20s",
            "jobs/mixed",
        ])
        .args(["--", "true"])
        .output()
        .expect("run latchkey lock");
    assert_eq!(output.status.code(), Some(2), "{output:?}");
    let stderr = String::from_utf8_lossy(&output.stderr);
    let named = format!("{}: it is a standalone server", standalone.local_addr());
    assert!(stderr.contains(&named), "{stderr}");
    assert!(stderr.contains("nothing was sent"), "{stderr}");
    let direct = latchkey_client::Client::connect(standalone.local_addr()).unwrap();
    assert!(
        !direct.query("jobs/mixed").unwrap().held,
        "nothing taken from the standalone"
    );
    drop(standalone);
    cluster.kill(2);
    let (code, table) = cluster_status(&cluster, false);
    assert_eq!(code, Some(83), "{table}");
    let killed = cluster.members[2].client.to_string();
    assert!(
        table
            .lines()
            .any(|line| line.contains(&killed) && line.contains("unreachable")),
        "{table}"
    );
    // The replication figures are in /metrics too.
    let metrics = {
        use std::io::{Read, Write};
        let mut stream = std::net::TcpStream::connect(cluster.members[0].client).unwrap();
        stream
            .write_all(b"GET /metrics HTTP/1.1\r\nHost: t\r\n\r\n")
            .unwrap();
        let mut text = String::new();
        stream.read_to_string(&mut text).unwrap();
        text
    };
    for name in [
        "latchkey_cluster_shards_led",
        "latchkey_cluster_leader_changes_total",
        "latchkey_cluster_proposals_total",
        "latchkey_cluster_snapshot_restores_total",
        "latchkey_cluster_commit_latency_seconds_count",
        "latchkey_cluster_sync_latency_seconds_count",
    ] {
        assert!(metrics.contains(name), "{name} missing from:\n{metrics}");
    }
}

#[test]
fn a_member_stopping_says_the_cluster_keeps_its_held_locks() {
    let mut cluster = Cluster::start("cluster-stop-log", 3, 4, false);
    let key = "jobs/kept";
    let (leader, token) = acquire_on_leader(&cluster, key, 30);
    cluster.stop(leader);
    let log = cluster.members[leader].log.lock().unwrap().clone();
    let line = log
        .lines()
        .find(|line| line.contains("shutting down:"))
        .unwrap_or_else(|| panic!("no shutdown line in\n{log}"));
    assert!(line.contains("held locks kept by the cluster"), "{line}");
    assert!(!line.contains("dropped"), "{line}");
    // And so it does: another member serves the key, still held by that token.
    let (_, released) = cluster.call(key, &[leader], FAILOVER_LIMIT, release(key, token));
    assert_eq!(released, Response::Released { token });
}

#[test]
fn a_query_never_shows_more_lease_than_was_granted() {
    let cluster = Cluster::start("cluster-query-lease", 3, 4, false);
    let key = "jobs/lease";
    let (leader, token) = acquire_on_leader(&cluster, key, 30);
    let (_, released) = cluster.call(key, &[], FAILOVER_LIMIT, release(key, token));
    assert_eq!(released, Response::Released { token });
    // The query right behind the acquire, on one connection: read once the grant applied,
    // often within the same millisecond.
    let mut conn = cluster.conn(leader);
    let mut checked = 0;
    for round in 0..50u64 {
        conn.send(acquire(key, 0, 30)());
        conn.send(Request::Query {
            nonce: round + 1,
            key: key.as_bytes(),
        });
        // Two answers, in either order (the query may be read before the grant applies).
        let answers = [
            conn.recv_within(FAILOVER_LIMIT),
            conn.recv_within(FAILOVER_LIMIT),
        ];
        for answer in answers.iter().flatten() {
            match *answer {
                Response::State {
                    held: true,
                    lease_ms,
                    ..
                } => {
                    assert!(lease_ms <= 30_000, "round {round}: lease_ms {lease_ms}");
                    checked += 1;
                }
                Response::Acquired { token, .. } => {
                    conn.send(release(key, token)());
                    let _ = conn.recv_within(FAILOVER_LIMIT);
                }
                _ => {} // free when read, or leadership moved (M): nothing to check
            }
        }
    }
    assert!(checked > 0, "no query saw the key held");
}
