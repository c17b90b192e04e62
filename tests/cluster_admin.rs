//! Seeing a cluster from the command line, with real processes on loopback: `latchkey keys`
//! and `latchkey stats` given every member ask them all and merge (each held key once, with
//! the PEER and HELD its leader knows), `latchkey cluster leader KEY` names the member that
//! serves the key, and a killed member is named while the others' answers still count.
//!
//! Every wait is bounded and polled; no timing is asserted beyond "eventually, within 10 s".

use common::cluster::Cluster;
use common::server::{fresh_id, Conn};
use latchkey_client::protocol::Response;
use serde_json::Value;
use std::collections::BTreeSet;
use std::time::{Duration, Instant};

const SETTLE_LIMIT: Duration = Duration::from_secs(10);
const KEYS: usize = 8;

/// `latchkey ARGS --server <every member>`: exit code, stdout, stderr.
fn latchkey(cluster: &Cluster, args: &[&str]) -> (Option<i32>, String, String) {
    common::run_cli(env!("CARGO_BIN_EXE_latchkey"), &cluster.servers(), args)
}

/// Acquires `key` on the member that serves it, over a connection the caller keeps open (so
/// that the leader knows the holder's session): the member's index, the connection, the
/// connection's local address.
fn hold(cluster: &Cluster, key: &str) -> (usize, Conn, String) {
    let until = Instant::now() + SETTLE_LIMIT;
    loop {
        let left = until.saturating_duration_since(Instant::now());
        let (index, _) = cluster
            .serving(key, &[], left)
            .expect("a member serves the key");
        let mut conn = cluster.conn(index);
        match conn.acquire(key, 0, 60, fresh_id()) {
            Response::Acquired { .. } => {
                let local = conn.stream.local_addr().expect("local address").to_string();
                return (index, conn, local);
            }
            Response::Moved { .. } if Instant::now() < until => {
                std::thread::sleep(Duration::from_millis(5));
            }
            other => panic!("acquire of {key} answered {other:?}"),
        }
    }
}

/// Polls `latchkey keys --json` until it exits `code` listing every key of `wanted`.
fn keys_until(cluster: &Cluster, code: i32, wanted: &BTreeSet<String>) -> (Vec<Value>, String) {
    let started = Instant::now();
    loop {
        let (exit, stdout, stderr) = latchkey(cluster, &["keys", "--json"]);
        let listed: Vec<Value> = serde_json::from_str(&stdout).unwrap_or_default();
        let names: BTreeSet<String> = listed
            .iter()
            .filter_map(|k| k["key"].as_str().map(str::to_owned))
            .collect();
        if exit == Some(code) && &names == wanted && names.len() == listed.len() {
            return (listed, stderr);
        }
        assert!(
            started.elapsed() < SETTLE_LIMIT,
            "keys: exit {exit:?}, {stdout}\n{stderr}"
        );
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// Polls `latchkey stats --json` until it exits `code` counting every key once (leadership
/// may be moving: a shard between leaders is counted by nobody for a moment).
fn stats_until(cluster: &Cluster, code: i32) -> Value {
    let started = Instant::now();
    loop {
        let (exit, stdout, stderr) = latchkey(cluster, &["stats", "--json"]);
        assert_eq!(exit, Some(code), "{stdout}\n{stderr}");
        let stats: Value = serde_json::from_str(&stdout).expect("JSON");
        if stats["locks_held"] == KEYS {
            return stats;
        }
        assert!(started.elapsed() < SETTLE_LIMIT, "{stdout}");
        std::thread::sleep(Duration::from_millis(100));
    }
}

#[test]
fn keys_stats_and_leader_ask_every_member_and_merge() {
    let mut cluster = Cluster::start("cluster-admin", 3, 4, false);
    let names: Vec<String> = (0..KEYS).map(|n| format!("admin/{n}")).collect();
    let held: Vec<(usize, Conn, String)> = names.iter().map(|k| hold(&cluster, k)).collect();
    let wanted: BTreeSet<String> = names.iter().cloned().collect();
    let leaders: BTreeSet<usize> = held.iter().map(|(index, _, _)| *index).collect();
    println!("keys held on members {leaders:?}");

    // Every key once, from its leader, with the holder's address and a hold time.
    let (listed, _) = keys_until(&cluster, 0, &wanted);
    for entry in &listed {
        let key = entry["key"].as_str().unwrap();
        let (_, _, local) = &held[names.iter().position(|n| n == key).unwrap()];
        assert_eq!(entry["peer"], Value::from(local.as_str()), "{entry}");
        assert!(entry["held_ms"].is_u64(), "{entry}");
        assert!(entry["lease_ms"].as_u64().unwrap() <= 60_000, "{entry}");
    }
    let (code, table, _) = latchkey(&cluster, &["keys"]);
    assert_eq!(code, Some(0), "{table}");
    assert_eq!(table.lines().count(), KEYS + 1, "{table}");

    // Stats merged: each key counted once, every member listed.
    let stats = stats_until(&cluster, 0);
    assert_eq!(stats["members"].as_array().map(Vec::len), Some(3));
    assert!(stats["acquires"]["acquired"].as_u64().unwrap() >= KEYS as u64);
    let (code, text, _) = latchkey(&cluster, &["stats"]);
    assert_eq!(code, Some(0), "{text}");
    assert!(text.starts_with("# Members\n"), "{text}");

    // The leader of a key is the member that answers its queries.
    let (serving, _) = cluster
        .serving(&names[0], &[], SETTLE_LIMIT)
        .expect("a member serves the key");
    let (code, stdout, _) = latchkey(&cluster, &["cluster", "leader", &names[0], "--json"]);
    assert_eq!(code, Some(0), "{stdout}");
    let found: Value = serde_json::from_str(&stdout).expect("JSON");
    assert_eq!(found["leader"], Value::from(serving + 1), "{stdout}");
    let address = cluster.members[serving].client.to_string();
    assert_eq!(found["leader_address"], Value::from(address.as_str()));
    let (code, text, _) = latchkey(&cluster, &["cluster", "leader", &names[0]]);
    assert_eq!(code, Some(0), "{text}");
    assert!(
        text.contains(&format!("led by member {} at {address}", serving + 1)),
        "{text}"
    );
    let (code, text, _) = latchkey(&cluster, &["cluster", "status"]);
    assert_eq!(code, Some(0), "{text}");
    assert!(text.contains("\nLEADERS\n"), "{text}");

    // A killed member is named; once the others lead its shards the key list is whole again
    // (exit 0), while stats, missing a member, exits 83.
    let killed = *leaders.iter().next().unwrap();
    cluster.kill(killed);
    let (listed, stderr) = keys_until(&cluster, 0, &wanted);
    let dead = cluster.members[killed].client.to_string();
    assert!(stderr.contains(&dead), "{stderr}");
    for entry in &listed {
        let key = entry["key"].as_str().unwrap();
        let (index, _, local) = &held[names.iter().position(|n| n == key).unwrap()];
        if *index == killed {
            // Granted by the killed leader: the new one does not know the holder.
            assert_eq!(entry["peer"], Value::Null, "{entry}");
            assert_eq!(entry["held_ms"], Value::Null, "{entry}");
        } else {
            assert!(
                entry["peer"].is_null() || entry["peer"] == local.as_str(),
                "{entry}"
            );
        }
    }
    let stats = stats_until(&cluster, 83);
    let rows = stats["members"].as_array().expect("members");
    assert!(rows
        .iter()
        .any(|row| row["member"] == dead.as_str() && row["error"].is_string()));
    drop(held);
}
