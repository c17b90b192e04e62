//! `cluster status` and `cluster leader` from members' `/stats` (no I/O).

use super::*;

const SHARDS: u32 = 4;

/// Member `node`'s `cluster` object: every shard with `leader` as it believes and `serving`
/// for the (shard, term) it serves.
fn member(node: u64, believed: Option<u64>, serving: &[(u64, u64)]) -> Seen {
    let shards: Vec<Value> = (0..u64::from(SHARDS))
        .map(|shard| {
            let led = serving.iter().find(|(s, _)| *s == shard);
            json!({
                "shard": shard,
                "leader": led.map_or(believed, |_| Some(node)),
                "serving": led.is_some(),
                "term": led.map_or(2, |(_, term)| *term),
                "commit": 10,
                "applied": 10,
            })
        })
        .collect();
    let members: Vec<Value> = (1..=3)
        .map(|id| json!({"id": id, "client": format!("127.0.0.1:{}", 7419 + id)}))
        .collect();
    Seen {
        item: format!("127.0.0.1:{}", 7419 + node),
        cluster: Ok(json!({
            "node_id": node,
            "members": members,
            "shard_count": SHARDS,
            "shards_led": serving.len(),
            "shards": shards,
        })),
    }
}

fn down(port: u16) -> Seen {
    Seen {
        item: format!("127.0.0.1:{port}"),
        cluster: Err("no complete answer within --transport-timeout".into()),
    }
}

/// A key of `shard` (of 4).
fn key_of(shard: u32) -> String {
    (0..)
        .map(|n| format!("k{n}"))
        .find(|key| shard_of(key.as_bytes(), SHARDS) == shard)
        .expect("some key")
}

#[test]
fn the_leader_of_a_key_is_the_member_serving_its_shard() {
    let seen = [
        member(1, Some(2), &[(0, 3)]),
        member(2, None, &[(1, 2), (2, 4)]),
        down(7422),
    ];
    let key = key_of(2);
    let found = leader_of(&key, &seen);
    assert_eq!(found["shard"], json!(2));
    assert_eq!(found["leader"], json!(2));
    assert_eq!(found["term"], json!(4));
    assert_eq!(found["leader_address"], json!("127.0.0.1:7421"));
    let text = render_leader(&key, &found);
    assert!(
        text.starts_with(&format!(
            "{key}: shard 2 of 4, led by member 2 at 127.0.0.1:7421 (term 4)\n"
        )),
        "{text}"
    );
    assert!(text.contains("127.0.0.1:7420: member 1: follower, believes the leader is member 2"));
    assert!(text.contains("127.0.0.1:7422: no answer: no complete answer"));
    // Shard 3: nobody serves it.
    let orphan = leader_of(&key_of(3), &seen);
    assert_eq!(orphan["leader"], Value::Null);
    assert!(render_leader("k", &orphan).contains("has no leader among the members that answered"));
    // Nobody answered.
    let none = leader_of("k", &[down(7420)]);
    assert_eq!(none["shard"], Value::Null);
    assert!(render_leader("k", &none).contains("no member answered as a cluster member"));
}

#[test]
fn two_members_serving_one_shard_resolve_to_the_higher_term() {
    let seen = [member(1, None, &[(0, 3)]), member(2, None, &[(0, 5)])];
    assert_eq!(leader_of(&key_of(0), &seen)["leader"], json!(2));
    let leaders = shard_leaders(&seen);
    assert_eq!(leaders[0], json!({"shard": 0, "leader": 2, "term": 5}));
}

#[test]
fn status_lists_which_member_leads_which_shards() {
    let seen = [
        member(1, None, &[(0, 3), (1, 3)]),
        member(2, None, &[(3, 2)]),
        down(7422),
    ];
    let leaders = shard_leaders(&seen);
    assert_eq!(leaders.len(), 4);
    assert_eq!(leaders[2], json!({"shard": 2, "leader": null}));
    let text = render_leaders(&leaders, &seen);
    assert_eq!(
        text,
        "\nLEADERS\n  no leader among the members that answered: shard 2\n  member 1 \
         (127.0.0.1:7420): shards 0-1\n  member 2 (127.0.0.1:7421): shard 3\n"
    );
    let rows = rows(&seen);
    assert_eq!(rows[2]["reachable"], json!(false));
    assert_eq!(rows[0]["shards_led"], json!(2));
}

#[test]
fn a_member_whose_cluster_version_is_older_than_its_own_names_the_older_peers() {
    let row = |cluster_version: u64, peer_version: u64| {
        json!({
            "quorum": true,
            "wire_version": 4,
            "cluster_version": cluster_version,
            "peers": [
                {"node_id": 2, "reachable": true, "wire_version": peer_version},
                {"node_id": 3, "reachable": true, "wire_version": 4},
            ],
        })
    };
    assert_eq!(
        member_notes(&row(3, 3)),
        "        cluster version 3 (this member speaks peer wire version 4): peer 2 at 3\n"
    );
    assert_eq!(
        member_notes(&row(4, 4)),
        "",
        "every member speaks 4: nothing to say"
    );
    // A member of a build that does not report versions: nothing either.
    assert_eq!(member_notes(&json!({"quorum": true, "peers": []})), "");
}
