//! Merging several members' `/stats` and `/keys`.

use super::*;
use crate::metrics::Histogram;
use crate::server::admin::render::histogram_json;

const BOUNDS_US: &[u64] = &[10, 100, 1000];

fn filled(values: &[u64]) -> Histogram {
    let mut histogram = Histogram::new(BOUNDS_US);
    for &value in values {
        histogram.record(value);
    }
    histogram
}

#[test]
fn merged_histograms_match_the_histogram_of_all_samples() {
    let cases: [(&[u64], &[u64]); 4] = [
        (&[1, 5, 50], &[500, 5000]),
        (&[], &[20]),
        (&[9999, 10_000], &[1]),
        (&[], &[]),
    ];
    for (left, right) in cases {
        let mut all = filled(left);
        all.merge(&filled(right));
        let merged = merge_histograms(&[
            &histogram_json(&filled(left)),
            &histogram_json(&filled(right)),
        ]);
        let expected = histogram_json(&all);
        for field in ["count", "max", "p50", "p99", "buckets"] {
            assert_eq!(
                merged[field], expected[field],
                "{field} of {left:?} + {right:?}"
            );
        }
        let sum = merged["sum"].as_f64().unwrap();
        assert!((sum - expected["sum"].as_f64().unwrap()).abs() < 1e-9);
    }
    assert_eq!(merge_histograms(&[&Value::Null]), Value::Null);
}

fn member_stats(version: &str, uptime: f64, sessions: u64, locks_led: u64) -> Value {
    json!({
        "version": version,
        "commit": "abc",
        "uptime_seconds": uptime,
        "cores": 2,
        "shutting_down": false,
        "limits": {"max_keys": 100},
        "sessions": sessions,
        "waiters": 1,
        "locks_held": 40,
        "acquires": {"acquired": sessions * 10, "timeout": 1},
        "busy": {"keys": 1, "shutdown": 0},
        "cancels": 2,
        "acquire_wait_seconds": histogram_json(&filled(&[5, 50])),
        "loop_iteration_seconds": [histogram_json(&filled(&[1, 2])), histogram_json(&filled(&[3]))],
        "cluster": {"node_id": 1, "locks_led": locks_led, "shards_led": 2, "shard_count": 4},
    })
}

#[test]
fn stats_sum_counters_once_per_key_and_keep_what_is_per_member() {
    let members = [
        MemberAnswer {
            item: "a:1".into(),
            result: Ok(member_stats("0.1.0", 100.0, 3, 7)),
        },
        MemberAnswer {
            item: "b:2".into(),
            result: Ok(member_stats("0.1.0", 250.0, 4, 5)),
        },
        MemberAnswer {
            item: "c:3".into(),
            result: Err("no answer".into()),
        },
    ];
    let merged = merge_stats(&members);
    assert_eq!(merged["version"], json!("0.1.0"));
    assert_eq!(merged["uptime_seconds"], json!(250.0), "the longest uptime");
    assert_eq!(merged["sessions"], json!(7));
    assert_eq!(merged["waiters"], json!(2));
    assert_eq!(merged["cancels"], json!(4));
    assert_eq!(merged["cores"], json!(2), "each member's, not their sum");
    assert_eq!(
        merged["locks_held"],
        json!(12),
        "the holds of led shards, not replicas"
    );
    assert_eq!(merged["acquires"], json!({"acquired": 70, "timeout": 2}));
    assert_eq!(merged["busy"], json!({"keys": 2, "shutdown": 0}));
    assert_eq!(merged["acquire_wait_seconds"]["count"], json!(4));
    let loops = merged["loop_iteration_seconds"].as_array().unwrap();
    assert_eq!(loops.len(), 4);
    assert_eq!(loops[2]["member"], json!("b:2"));
    let rows = merged["members"].as_array().unwrap();
    assert_eq!(rows.len(), 3);
    assert_eq!(rows[0]["locks_held"], json!(7));
    assert_eq!(rows[0]["cores"], json!(2));
    assert_eq!(rows[1]["limits"], json!({"max_keys": 100}));
    assert_eq!(rows[2], json!({"member": "c:3", "error": "no answer"}));
    let mixed = [
        MemberAnswer {
            item: "a:1".into(),
            result: Ok(member_stats("0.1.0", 1.0, 1, 1)),
        },
        MemberAnswer {
            item: "b:2".into(),
            result: Ok(member_stats("0.2.0", 1.0, 1, 1)),
        },
    ];
    assert_eq!(merge_stats(&mixed)["version"], json!("mixed: 0.1.0, 0.2.0"));
}

#[test]
fn single_nodes_sum_their_own_locks() {
    let mut stats = member_stats("0.1.0", 1.0, 1, 1);
    stats.as_object_mut().unwrap().remove("cluster");
    let members = [
        MemberAnswer {
            item: "a:1".into(),
            result: Ok(stats.clone()),
        },
        MemberAnswer {
            item: "b:2".into(),
            result: Ok(stats),
        },
    ];
    assert_eq!(merge_stats(&members)["locks_held"], json!(80));
}

/// A member's `/stats` serving `serving` (shard, term) of 4 shards.
fn cluster_stats(serving: &[(u64, u64)]) -> Value {
    let shards: Vec<Value> = (0..4)
        .map(|shard| {
            let led = serving.iter().find(|(s, _)| *s == shard);
            json!({
                "shard": shard,
                "serving": led.is_some(),
                "term": led.map_or(1, |(_, term)| *term),
            })
        })
        .collect();
    json!({"cluster": {"shard_count": 4, "shards": shards}})
}

/// Keys whose shard among 4 is `shard`, from `key-0` on.
fn keys_of_shard(shard: u32, count: usize) -> Vec<String> {
    (0..)
        .map(|n| format!("key-{n}"))
        .filter(|key| shard_of(key.as_bytes(), 4) == shard)
        .take(count)
        .collect()
}

fn listed(keys: &[String], owner: u64) -> Vec<Value> {
    keys.iter()
        .map(|key| json!({"key": key, "owner": owner}))
        .collect()
}

#[test]
fn keys_come_once_from_the_leader_in_the_highest_term_and_uncovered_shards_are_named() {
    let zero = keys_of_shard(0, 2);
    let two = keys_of_shard(2, 1);
    let first_stats = cluster_stats(&[(0, 2), (1, 2)]);
    let second_stats = cluster_stats(&[(0, 5), (2, 3)]);
    // Shard 0 moved from the first member (term 2) to the second (term 5) between the scans.
    let first_keys = listed(&zero, 1);
    let mut second_keys = listed(&zero, 2);
    second_keys.extend(listed(&two, 2));
    let members = [
        MemberKeys {
            stats: &first_stats,
            keys: &first_keys,
        },
        MemberKeys {
            stats: &second_stats,
            keys: &second_keys,
        },
    ];
    let merged = merge_keys(&members, 100);
    assert_eq!(merged.shard_count, Some(4));
    assert_eq!(
        merged.uncovered,
        vec![3],
        "nobody that answered leads shard 3"
    );
    let mut expected: Vec<&String> = zero.iter().chain(&two).collect();
    expected.sort();
    let keys: Vec<&str> = merged
        .keys
        .iter()
        .map(|k| k["key"].as_str().unwrap())
        .collect();
    assert_eq!(keys, expected);
    for entry in &merged.keys {
        assert_eq!(entry["owner"], json!(2), "the higher term's entry: {entry}");
    }
    let cut = merge_keys(&members, 2);
    assert_eq!(cut.keys.len(), 2);
    assert_eq!(cut.keys[..], merged.keys[..2]);
}

#[test]
fn keys_of_single_nodes_are_all_listed() {
    let stats = json!({});
    let left = listed(&["b".to_owned(), "a".to_owned()], 1);
    let right = listed(&["c".to_owned()], 2);
    let members = [
        MemberKeys {
            stats: &stats,
            keys: &left,
        },
        MemberKeys {
            stats: &stats,
            keys: &right,
        },
    ];
    let merged = merge_keys(&members, 10);
    let keys: Vec<&str> = merged
        .keys
        .iter()
        .map(|k| k["key"].as_str().unwrap())
        .collect();
    assert_eq!(keys, ["a", "b", "c"]);
    assert!(merged.uncovered.is_empty());
    assert_eq!(merged.shard_count, None);
}
