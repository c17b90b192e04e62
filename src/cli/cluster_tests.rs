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

/// Member `node` of a whole cluster of three: it reaches both others, has quorum, and every
/// shard's commit and applied index is `applied`.
fn whole(node: u64, applied: u64) -> Seen {
    let mut seen = member(node, Some(1), &[]);
    if let Ok(cluster) = &mut seen.cluster {
        let peers: Vec<Value> = (1..=3u64)
            .filter(|&peer| peer != node)
            .map(|peer| {
                json!({"node_id": peer, "link": "connected", "reachable": true,
                       "address": format!("127.0.0.1:{}", 7429 + peer)})
            })
            .collect();
        cluster["peers"] = json!(peers);
        cluster["quorum"] = json!(true);
        for shard in cluster["shards"].as_array_mut().into_iter().flatten() {
            shard["commit"] = json!(applied);
            shard["applied"] = json!(applied);
        }
    }
    seen
}

fn problems_of(seen: &[Seen], max_lag: u64) -> Vec<(Problem, String)> {
    problems(&rows(seen), max_lag)
}

#[test]
fn a_whole_cluster_has_no_problem() {
    let seen = [whole(1, 50), whole(2, 50), whole(3, 40)];
    assert_eq!(problems_of(&seen, 1000), []);
    assert_eq!(render_problems(&[]), "");
}

#[test]
fn a_refused_peer_a_lost_quorum_a_lag_and_a_twin_are_problems_86() {
    let mut seen = [whole(1, 5000), whole(2, 5000), whole(3, 100)];
    if let Ok(cluster) = &mut seen[0].cluster {
        cluster["peers"][0]["link"] = json!("refused");
        cluster["peers"][0]["reason"] = json!("cluster identity differs");
        cluster["quorum"] = json!(false);
        cluster["members_reachable"] = json!(1);
        cluster["member_count"] = json!(3);
    }
    let found = problems_of(&seen, 1000);
    let texts: Vec<&str> = found.iter().map(|(_, text)| text.as_str()).collect();
    assert_eq!(
        texts,
        [
            "member 1 at 127.0.0.1:7420: peer 2 refused: cluster identity differs",
            "member 1 at 127.0.0.1:7420: no quorum (1 of 3 members reachable)",
            "member 3 at 127.0.0.1:7422: 4900 entries behind (--max-lag 1000)",
        ]
    );
    assert!(found.iter().all(|(kind, _)| *kind == Problem::Unhealthy));
    assert_eq!(problems_of(&seen[1..], 5000), [], "within --max-lag");
    // Two addresses answering as one member.
    let twin = Seen {
        item: "127.0.0.1:9999".into(),
        ..whole(2, 1)
    };
    let found = problems_of(&[whole(1, 1), whole(2, 1), twin], 1000);
    assert_eq!(
        found,
        [(
            Problem::Unhealthy,
            "127.0.0.1:7421 and 127.0.0.1:9999 both answer as member 2".to_string()
        )]
    );
    let text = render_problems(&found);
    assert!(
        text.starts_with("\nPROBLEMS\n  127.0.0.1:7421 and"),
        "{text}"
    );
}

#[test]
fn a_member_of_another_members_list_or_no_cluster_is_a_problem_and_its_indices_are_its_own() {
    // Member 3 was started with another members list: it never joined, and its log, far
    // ahead, is of another cluster (it counts in nobody's lag).
    let mut stranger = whole(3, 90_000);
    if let Ok(cluster) = &mut stranger.cluster {
        cluster["members"][0]["client"] = json!("127.0.0.1:1");
    }
    let standalone = Seen {
        item: "127.0.0.1:7425".into(),
        cluster: Err(NOT_A_MEMBER.to_string()),
    };
    let seen = [whole(1, 50), whole(2, 50), stranger, standalone];
    let found = problems_of(&seen, 1000);
    assert_eq!(found.len(), 2, "{found:?}");
    assert_eq!(found[0].0, Problem::Unhealthy);
    assert!(
        found[0]
            .1
            .starts_with("127.0.0.1:7425: not a cluster member"),
        "{found:?}"
    );
    assert_eq!(found[1].0, Problem::Unhealthy);
    assert!(
        found[1]
            .1
            .starts_with("member 3 at 127.0.0.1:7422: its members list or shard count"),
        "{found:?}"
    );
    assert_eq!(
        rows(&seen)[0]["lag"],
        json!(0),
        "the stranger's indices are not the cluster's"
    );
}

#[test]
fn a_listed_member_that_does_not_answer_or_a_known_one_nobody_reaches_is_unavailable_83() {
    let seen = [whole(1, 5), whole(2, 5), down(7422)];
    let found = problems_of(&seen, 1000);
    assert_eq!(found.len(), 1, "its own row says it, once: {found:?}");
    assert_eq!(found[0].0, Problem::Unavailable);
    // Member 3 not listed, and neither member reaches it.
    let mut seen = [whole(1, 5), whole(2, 5)];
    for member in &mut seen {
        if let Ok(cluster) = &mut member.cluster {
            for peer in cluster["peers"].as_array_mut().into_iter().flatten() {
                if peer["node_id"] == json!(3) {
                    peer["reachable"] = json!(false);
                    peer["link"] = json!("unreachable");
                }
            }
        }
    }
    let found = problems_of(&seen, 1000);
    assert_eq!(
        found,
        [(
            Problem::Unavailable,
            "member 3 at 127.0.0.1:7422: reached by no member that answered".to_string()
        )]
    );
    // Reached by one of them: not a problem of its own (it was not asked).
    if let Ok(cluster) = &mut seen[0].cluster {
        cluster["peers"][1]["reachable"] = json!(true);
    }
    assert_eq!(problems_of(&seen, 1000), []);
}
