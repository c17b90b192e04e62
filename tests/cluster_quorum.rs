//! Members that disagree, a lost quorum, and a member that must stop, with real `latchkey
//! serve` processes on loopback (issue 17 items 2, 5, 6):
//!
//! * a member whose members list differs is refused by the others, and every side logs it;
//!   fixing its config and restarting it heals the cluster without touching the others;
//! * a peer address that leads to another member is refused as "dialed ... but reached";
//! * a member started again on an empty `data_dir` (a lost disk) is refused by the peers that
//!   knew its old one, every side says so, and the others serve on;
//! * with two of three members killed (kill -9), the survivor's `/health` is 503 and says why,
//!   its gauges show the leaderless shards and the lost quorum, and it logs "quorum lost";
//!   restarted, they make it healthy again and it logs "quorum regained";
//! * a committed entry that does not decode stops a member: exit 70, a line naming shard and
//!   index.
//!
//! Every wait polls until true with a generous bound; nothing asserts on speed.

use common::cluster::{http_get, metric, Cluster, DEFAULT_SECTIONS};
use common::server::{wait_for_line, TempDir};
use std::time::{Duration, Instant};

/// How long anything that must happen may take (generous: a shared 2-core machine).
const PATIENCE: Duration = Duration::from_secs(15);

/// Polls `condition` every 50 ms until it holds; panics with `what` after [`PATIENCE`].
fn wait_until(what: &str, mut condition: impl FnMut() -> bool) {
    let until = Instant::now() + PATIENCE;
    while !condition() {
        assert!(Instant::now() < until, "gave up waiting for {what}");
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// Member `index`'s log so far.
fn log_of(cluster: &Cluster, index: usize) -> std::sync::Arc<std::sync::Mutex<String>> {
    std::sync::Arc::clone(&cluster.members[index].log)
}

/// Member `index`'s `/stats` `cluster` object.
fn cluster_stats(cluster: &Cluster, index: usize) -> serde_json::Value {
    let (status, body) = http_get(cluster.members[index].client, "/stats").expect("an answer");
    assert_eq!(status, 200, "{body}");
    let stats: serde_json::Value = serde_json::from_str(&body).expect("JSON");
    stats["cluster"].clone()
}

/// What member `index` says of peer `peer` in its `/stats`.
fn peer_view(cluster: &Cluster, index: usize, peer: u64) -> serde_json::Value {
    let stats = cluster_stats(cluster, index);
    let peers = stats["peers"].as_array().expect("peers").clone();
    let found = peers
        .into_iter()
        .find(|p| p["node_id"] == serde_json::json!(peer));
    found.expect("the peer is listed")
}

#[test]
fn a_member_whose_members_list_differs_is_refused_and_every_side_logs_it() {
    let mut cluster = Cluster::configure("quorum-identity", 3, 4, false, false, DEFAULT_SECTIONS);
    // Member 3 lists another client address for member 1: its cluster identity differs.
    let wrong = common::cluster::free_address();
    let right = cluster.members[0].client.to_string();
    cluster.edit_config(2, |text| text.replace(&right, &wrong.to_string()));
    for index in 0..3 {
        cluster.launch(index);
    }
    let identity = "cluster identity differs";
    for (index, other) in [(0, 3), (1, 3), (2, 1), (2, 2)] {
        let log = log_of(&cluster, index);
        // It refuses the other's connection, and is told the other refused its own.
        let refused = format!("(node {other}) refused: {identity}");
        wait_for_line(&log, &[&refused], PATIENCE);
        let told = format!("peer {other} at ");
        wait_for_line(
            &log,
            &[&told, "refused this member's connection", identity],
            PATIENCE,
        );
    }
    // Members 1 and 2 serve together; member 1 shows member 3 refused, in /stats and in
    // `latchkey cluster status`.
    wait_until("members 1 and 2 to reach each other", || {
        peer_view(&cluster, 0, 2)["reachable"] == serde_json::json!(true)
    });
    let three = peer_view(&cluster, 0, 3);
    assert_eq!(three["link"], serde_json::json!("refused"), "{three}");
    assert!(three["reason"]
        .as_str()
        .unwrap_or_default()
        .contains(identity));
    let output = std::process::Command::new(env!("CARGO_BIN_EXE_latchkey"))
        .args(["cluster", "status", "--server", &right])
        .output()
        .expect("run latchkey cluster status");
    let table = String::from_utf8_lossy(&output.stdout);
    let peer = cluster.members[2].peer.to_string();
    assert!(
        table
            .lines()
            .any(|line| line.contains(&format!("peer 3 at {peer} refused: {identity}"))),
        "{table}"
    );
    // It is a problem, and the exit code says so (86: every listed member answered).
    assert_eq!(output.status.code(), Some(86), "{table}");
    assert!(table.contains("\nPROBLEMS\n"), "{table}");
    // Asked with every member listed, member 3 is named as not a member of the others'
    // cluster (its members list differs), whatever it says of its own peers.
    let all: Vec<String> = cluster
        .members
        .iter()
        .map(|m| m.client.to_string())
        .collect();
    let output = std::process::Command::new(env!("CARGO_BIN_EXE_latchkey"))
        .args(["cluster", "status", "--server", &all.join(",")])
        .output()
        .expect("run latchkey cluster status");
    let table = String::from_utf8_lossy(&output.stdout);
    let three = &all[2];
    let line = format!("member 3 at {three}: its members list or shard count differs");
    assert!(table.contains(&line), "{table}");
    assert_eq!(output.status.code(), Some(86), "{table}");
    // Member 3 has no quorum: its /health says so.
    wait_until("member 3's health to say no quorum", || {
        http_get(cluster.members[2].client, "/health")
            .is_some_and(|(status, body)| status == 503 && body.contains("no quorum: 1 of 3"))
    });
    // Fixed and restarted, member 3 is taken back by the others, which were never restarted.
    // Its data_dir recorded the identity it first started with, so a fixed config alone is
    // refused (naming cluster.members); it never joined, so its directory is emptied, as an
    // operator would.
    cluster.kill(2);
    cluster.edit_config(2, |text| text.replace(&wrong.to_string(), &right));
    std::fs::remove_dir_all(&cluster.members[2].data).expect("empty member 3's data_dir");
    cluster.launch(2);
    wait_until("member 1 to reach member 3", || {
        peer_view(&cluster, 0, 3)["reachable"] == serde_json::json!(true)
    });
    assert_eq!(
        peer_view(&cluster, 0, 3)["link"],
        serde_json::json!("connected")
    );
}

#[test]
fn a_peer_address_that_leads_to_another_member_is_refused_as_dialed_but_reached() {
    let mut cluster = Cluster::configure("quorum-address", 3, 4, false, false, DEFAULT_SECTIONS);
    // Member 1 has the peer addresses of members 2 and 3 swapped.
    let (two, three) = (cluster.members[1].peer, cluster.members[2].peer);
    cluster.edit_config(0, |text| {
        let swapped = text.replace(&two.to_string(), "SWAP");
        let swapped = swapped.replace(&three.to_string(), &two.to_string());
        swapped.replace("SWAP", &three.to_string())
    });
    for index in 0..3 {
        cluster.launch(index);
    }
    let why = "node 1 dialed node 2 but reached node 3: member 1's peer address for 2 is wrong";
    wait_for_line(
        &log_of(&cluster, 0),
        &["peer 2 at ", "refused", why],
        PATIENCE,
    );
    wait_for_line(&log_of(&cluster, 2), &["(node 1) refused: ", why], PATIENCE);
    let view = peer_view(&cluster, 0, 2);
    assert_eq!(view["link"], serde_json::json!("refused"), "{view}");
    assert!(
        view["reason"].as_str().unwrap_or_default().contains(why),
        "{view}"
    );
}

#[test]
fn a_member_started_again_on_an_empty_data_dir_is_refused_by_the_others() {
    let mut cluster = Cluster::start("quorum-disk", 3, 4, false);
    let one = cluster.members[0].client;
    wait_until("members 1 and 2 to have heard from member 3", || {
        (0..2).all(|index| {
            let view = peer_view(&cluster, index, 3);
            view["heard_seconds_ago"].is_f64() && view["incarnation"].is_string()
        })
    });
    let known = peer_view(&cluster, 0, 3)["incarnation"].clone();
    let own = cluster_stats(&cluster, 2)["incarnation"].clone();
    assert!(known.is_string() && known == own, "{known} {own}");
    // Its disk is lost: kill -9, the data_dir emptied, started again.
    cluster.kill(2);
    std::fs::remove_dir_all(&cluster.members[2].data).expect("empty member 3's data_dir");
    cluster.launch(2);
    let why = "its data_dir was lost or replaced, and with it the votes it gave";
    for index in 0..2 {
        wait_for_line(
            &log_of(&cluster, index),
            &[
                "(node 3) refused: node 3 says hello from data-directory incarnation",
                why,
            ],
            PATIENCE,
        );
        wait_until("the refusal in /stats", || {
            let view = peer_view(&cluster, index, 3);
            view["refused_inbound"]
                .as_str()
                .is_some_and(|r| r.contains(why))
        });
    }
    wait_for_line(
        &log_of(&cluster, 2),
        &[
            "refused",
            "knew this member by another data directory than this one",
        ],
        PATIENCE,
    );
    assert_ne!(
        cluster_stats(&cluster, 2)["incarnation"],
        own,
        "a new incarnation"
    );
    assert_eq!(
        peer_view(&cluster, 0, 3)["incarnation"],
        known,
        "the old one is kept"
    );
    wait_until("member 3 to show both peers refusing it", || {
        (1..=2).all(|peer| peer_view(&cluster, 2, peer)["link"] == serde_json::json!("refused"))
    });
    // `cluster status` names it, and exits 86 (a member is refused).
    let output = std::process::Command::new(env!("CARGO_BIN_EXE_latchkey"))
        .args(["cluster", "status", "--server", &cluster.servers()])
        .output()
        .expect("run latchkey cluster status");
    let table = String::from_utf8_lossy(&output.stdout);
    assert!(
        table.contains("peer 1 refused: node 1 knew this member by another data directory"),
        "{table}"
    );
    assert_eq!(output.status.code(), Some(86), "{table}");
    // The two others still make a quorum and serve.
    wait_until("member 1 to be healthy", || {
        http_get(one, "/health").is_some_and(|(status, _)| status == 200)
    });
}

#[test]
fn a_member_that_lost_its_quorum_says_so_and_recovers_when_the_others_return() {
    let mut cluster = Cluster::start("quorum-lost", 3, 4, false);
    let survivor = cluster.members[0].client;
    wait_until("the cluster to be healthy", || {
        http_get(survivor, "/health").is_some_and(|(status, _)| status == 200)
    });
    cluster.kill(1);
    cluster.kill(2);
    wait_until("/health 503 without a quorum nor leaders", || {
        http_get(survivor, "/health").is_some_and(|(status, body)| {
            status == 503
                && body.contains("no quorum: 1 of 3 members reachable")
                && body.contains("4 of 4 shards without a leader")
        })
    });
    let (_, metrics) = http_get(survivor, "/metrics").expect("metrics");
    let gauge = |series: &str| metric(&metrics, series).unwrap_or(-1.0);
    assert_eq!(
        gauge("latchkey_cluster_shards_without_leader"),
        4.0,
        "{metrics}"
    );
    assert_eq!(
        gauge("latchkey_cluster_members_reachable"),
        1.0,
        "{metrics}"
    );
    assert_eq!(gauge("latchkey_cluster_quorum"), 0.0, "{metrics}");
    assert_eq!(
        gauge("latchkey_cluster_peer_reachable{peer=\"2\"}"),
        0.0,
        "{metrics}"
    );
    let log = log_of(&cluster, 0);
    wait_for_line(
        &log,
        &["INFO", "quorum lost: 1 of 3 members reachable"],
        PATIENCE,
    );
    wait_for_line(&log, &["INFO", "peer 2 (", "unreachable"], PATIENCE);
    cluster.launch(1);
    cluster.launch(2);
    wait_until("/health 200 again", || {
        http_get(survivor, "/health")
            .is_some_and(|(status, body)| status == 200 && body == "serving\n")
    });
    wait_for_line(&log, &["INFO", "quorum regained"], PATIENCE);
    wait_for_line(&log, &["INFO", "peer 2 (", "reachable again"], PATIENCE);
}

#[test]
fn a_committed_entry_that_does_not_decode_stops_the_member_with_exit_70() {
    use latchkey::cluster::wal::Wal;
    use latchkey::cluster::Durable;
    use raft::eraftpb::{Entry, HardState};
    let dir = TempDir::new("quorum-undecodable");
    let data = dir.path().join("data");
    let client = common::cluster::free_address();
    let peer = common::cluster::free_address();
    let config = dir.path().join("member.toml");
    let text = format!(
        "[server]\ncores = 1\n[cluster]\nnode_id = 1\nshards = 1\ndata_dir = {data:?}\n\
         members = [\n  {{ id = 1, client = \"{client}\", peer = \"{peer}\" }},\n]\n"
    );
    // The data directory is this member's (its record written as at a first start), and its
    // one-member cluster's log holds a committed entry that no member could have proposed
    // (damage the CRC did not catch, or a bug).
    {
        let parsed = latchkey::config::Config::from_toml_str(&text).expect("a config");
        let cluster = parsed.cluster.as_ref().expect("[cluster]");
        let expected = latchkey::cluster::data_dir::Expected::of(cluster, 1);
        let _record = latchkey::cluster::data_dir::DataDir::open(&data, &expected).expect("dir");
        let (mut wal, _) = Wal::open(&data.join("core-0"), true).expect("a log");
        let entry = Entry {
            index: 1,
            term: 1,
            data: vec![0xee; 7].into(),
            ..Default::default()
        };
        wal.append(0, &[entry]).expect("append");
        let hard_state = HardState {
            term: 1,
            vote: 1,
            commit: 1,
            ..Default::default()
        };
        wal.set_hard_state(0, &hard_state).expect("hard state");
        wal.sync().expect("sync");
    }
    std::fs::write(&config, text).expect("write config");
    let mut child = std::process::Command::new(env!("CARGO_BIN_EXE_latchkey"))
        .args(["serve", "--config"])
        .arg(&config)
        .env("RUST_LOG", "info")
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("spawn latchkey");
    let until = Instant::now() + PATIENCE;
    let status = loop {
        if let Some(status) = child.try_wait().expect("wait") {
            break status;
        }
        if Instant::now() > until {
            let _ = child.kill();
            panic!("the member did not stop");
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    let mut stderr = String::new();
    std::io::Read::read_to_string(&mut child.stderr.take().expect("stderr"), &mut stderr)
        .expect("read stderr");
    assert_eq!(status.code(), Some(70), "{stderr}");
    assert!(
        stderr.lines().any(|line| line.contains("ERROR")
            && line.contains("shard 0: committed entry 1 (term 1) does not decode")),
        "{stderr}"
    );
}
