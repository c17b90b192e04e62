//! What several members answered to `GET /stats` and `GET /keys`, merged into one view: pure
//! functions of their JSON. No I/O.
//!
//! * Stats: counters and gauges are summed over the members that answered; histograms are
//!   merged bucket by bucket (every member uses the same bounds) and their quantile bounds
//!   computed again from the merged buckets; loop iterations stay per member and core; what
//!   only means something per member (version, uptime, cores, limits) goes to a `members`
//!   list, and `cores` at the top is the members' common count (`null` when they differ). In a
//!   cluster, `locks_held` counts each key once: the holds of the shards each member leads
//!   (every member keeps a replica of every shard, so its own `locks_held` counts replicas).
//!   The rate of a summed counter is taken over the longest uptime: a lower bound, never more.
//! * Keys: each member lists the keys of the shards it leads; the merged list has every key
//!   once (when two members both claim a shard in the middle of a leadership change, the one
//!   in the higher term), in key order, cut to the limit. A shard that no answering member
//!   leads is *not covered*: its keys may be missing, and the caller says so.
//!
//! Deliberately not here: fetching (see `gather.rs`) and the text (see `render.rs`).

use std::collections::{BTreeMap, HashMap};

use serde_json::{json, Map, Value};

use crate::cluster::partition::shard_of;
/// One member's answer: its `--server` item, and the parsed JSON or why there is none.
pub(crate) struct MemberAnswer {
    /// The `--server` item as written.
    pub item: String,
    /// The answer, or a message saying why there is none.
    pub result: Result<Value, String>,
}

/// Top-level counters summed over members.
const SUMMED: &[&str] = &[
    "sessions",
    "sessions_refused",
    "requests_forbidden",
    "tls_failures",
    "waiters",
    "cancels",
    "lease_expirations",
];
/// Top-level objects of counters summed field by field.
const SUMMED_OBJECTS: &[&str] = &["acquires", "releases", "extends", "busy"];
/// Top-level histograms merged.
const HISTOGRAMS: &[&str] = &["acquire_wait_seconds", "lock_hold_seconds"];

/// The merged `/stats` of `members` (see the module docs): the fields of one server's
/// `/stats`, plus `members`, one object per member: its item, and its figures or its error.
pub(crate) fn merge_stats(members: &[MemberAnswer]) -> Value {
    let answered: Vec<(&str, &Value)> = members
        .iter()
        .filter_map(|m| Some((m.item.as_str(), m.result.as_ref().ok()?)))
        .collect();
    let mut merged = Map::new();
    merged.insert("version".into(), common_text(&answered, "version"));
    merged.insert("commit".into(), common_text(&answered, "commit"));
    let uptime = answered
        .iter()
        .filter_map(|(_, stats)| stats["uptime_seconds"].as_f64())
        .fold(None, |max: Option<f64>, up| {
            Some(max.map_or(up, |max| max.max(up)))
        });
    merged.insert("uptime_seconds".into(), json!(uptime));
    // Per member, not summed: a sum would read as one server's cores.
    merged.insert("cores".into(), common_number(&answered, "cores"));
    let stopping = answered
        .iter()
        .any(|(_, stats)| stats["shutting_down"] == json!(true));
    merged.insert("shutting_down".into(), json!(stopping));
    for &name in SUMMED {
        merged.insert(name.into(), json!(sum(&answered, |s| &s[name])));
    }
    let locks = answered
        .iter()
        .map(|(_, stats)| match stats.get("cluster") {
            Some(cluster) => cluster["locks_led"].as_u64().unwrap_or(0),
            None => stats["locks_held"].as_u64().unwrap_or(0),
        })
        .sum::<u64>();
    merged.insert("locks_held".into(), json!(locks));
    for &name in SUMMED_OBJECTS {
        merged.insert(name.into(), sum_objects(&answered, name));
    }
    for &name in HISTOGRAMS {
        let histograms: Vec<&Value> = answered.iter().map(|(_, s)| &s[name]).collect();
        merged.insert(name.into(), merge_histograms(&histograms));
    }
    merged.insert("loop_iteration_seconds".into(), loops(&answered));
    merged.insert("members".into(), member_rows(members));
    Value::Object(merged)
}

/// The members' shared value of the text field `name`, or `mixed: a, b` when they differ.
fn common_text(answered: &[(&str, &Value)], name: &str) -> Value {
    let mut values: Vec<&str> = answered
        .iter()
        .filter_map(|(_, stats)| stats[name].as_str())
        .collect();
    values.sort_unstable();
    values.dedup();
    match values[..] {
        [] => Value::Null,
        [one] => json!(one),
        _ => json!(format!("mixed: {}", values.join(", "))),
    }
}

/// The members' shared value of the number field `name`, or `null` when they differ (each
/// member's is in its row of `members`).
fn common_number(answered: &[(&str, &Value)], name: &str) -> Value {
    let mut values: Vec<u64> = answered
        .iter()
        .filter_map(|(_, stats)| stats[name].as_u64())
        .collect();
    values.sort_unstable();
    values.dedup();
    match values[..] {
        [one] => json!(one),
        _ => Value::Null,
    }
}

fn sum(answered: &[(&str, &Value)], field: impl Fn(&Value) -> &Value) -> u64 {
    answered
        .iter()
        .filter_map(|(_, stats)| field(stats).as_u64())
        .sum()
}

/// An object of counters (`acquires`, `busy`...) summed field by field, in the first
/// member's field order.
fn sum_objects(answered: &[(&str, &Value)], name: &str) -> Value {
    let mut merged = Map::new();
    for (_, stats) in answered {
        let Some(object) = stats[name].as_object() else {
            continue;
        };
        for (field, value) in object {
            let Some(count) = value.as_u64() else {
                continue;
            };
            let total = merged.entry(field.clone()).or_insert(json!(0));
            *total = json!(total.as_u64().unwrap_or(0) + count);
        }
    }
    Value::Object(merged)
}

/// Histograms of the `/stats` form (`count`, `sum`, `max`, `p50`, `p99`, cumulative
/// `buckets` of `[bound, total]`) merged: counts and sums added, the largest max, the buckets
/// added by bound, and `p50`/`p99` found again in the merged buckets as the server finds them.
pub(crate) fn merge_histograms(histograms: &[&Value]) -> Value {
    let present: Vec<&Value> = histograms
        .iter()
        .copied()
        .filter(|h| h.is_object())
        .collect();
    if present.is_empty() {
        return Value::Null;
    }
    let count: u64 = present.iter().filter_map(|h| h["count"].as_u64()).sum();
    let total: f64 = present.iter().filter_map(|h| h["sum"].as_f64()).sum();
    let max = present
        .iter()
        .filter_map(|h| h["max"].as_f64())
        .fold(0.0, f64::max);
    // Bounds travel as decimal seconds: keyed by whole nanoseconds, so equal bounds meet.
    let mut buckets: BTreeMap<u64, (f64, u64)> = BTreeMap::new();
    for histogram in &present {
        for bucket in histogram["buckets"]
            .as_array()
            .map_or(&[][..], Vec::as_slice)
        {
            let (Some(bound), Some(cumulative)) = (bucket[0].as_f64(), bucket[1].as_u64()) else {
                continue;
            };
            let entry = buckets
                .entry((bound * 1e9).round() as u64)
                .or_insert((bound, 0));
            entry.1 += cumulative;
        }
    }
    let quantile = |q: f64| {
        if count == 0 {
            return Value::Null;
        }
        let rank = ((q * count as f64).ceil() as u64).max(1);
        let found = buckets.values().find(|(_, cumulative)| *cumulative >= rank);
        json!(found.map_or(max, |(bound, _)| bound.min(max)))
    };
    let listed: Vec<Value> = buckets.values().map(|(b, c)| json!([b, c])).collect();
    json!({
        "count": count,
        "sum": total,
        "max": max,
        "p50": quantile(0.5),
        "p99": quantile(0.99),
        "buckets": listed,
    })
}

/// Every member's loop histograms, each marked with its member's item.
fn loops(answered: &[(&str, &Value)]) -> Value {
    let mut all = Vec::new();
    for (item, stats) in answered {
        for core in stats["loop_iteration_seconds"]
            .as_array()
            .map_or(&[][..], Vec::as_slice)
        {
            let mut core = core.clone();
            core["member"] = json!(item);
            all.push(core);
        }
    }
    Value::Array(all)
}

/// One row per member for the `members` list: what only means something per member.
fn member_rows(members: &[MemberAnswer]) -> Value {
    let rows = members.iter().map(|member| match &member.result {
        Err(error) => json!({"member": member.item, "error": error}),
        Ok(stats) => {
            let cluster = stats.get("cluster");
            let worst = stats["loop_iteration_seconds"]
                .as_array()
                .map_or(&[][..], Vec::as_slice)
                .iter()
                .filter_map(|core| core["max"].as_f64())
                .fold(None, |max: Option<f64>, x| {
                    Some(max.map_or(x, |m| m.max(x)))
                });
            json!({
                "member": member.item,
                "node_id": cluster.map(|c| c["node_id"].clone()),
                "version": stats["version"],
                "uptime_seconds": stats["uptime_seconds"],
                "cores": stats["cores"],
                "sessions": stats["sessions"],
                "locks_held": match cluster {
                    Some(cluster) => cluster["locks_led"].clone(),
                    None => stats["locks_held"].clone(),
                },
                "shards_led": cluster.map(|c| c["shards_led"].clone()),
                "shard_count": cluster.map(|c| c["shard_count"].clone()),
                "worst_iteration_seconds": worst,
                "limits": stats["limits"],
            })
        }
    });
    Value::Array(rows.collect())
}

/// The merged `/keys` of several members, with what it covers.
#[derive(Debug, PartialEq)]
pub(crate) struct MergedKeys {
    /// Every listed key once, in key order, at most the limit.
    pub keys: Vec<Value>,
    /// Shards no answering member leads (their keys may be missing); empty when every shard is
    /// covered, or when the members are not a cluster.
    pub uncovered: Vec<u64>,
    /// The cluster's shard count, when the members are a cluster.
    pub shard_count: Option<u64>,
}

/// One member's answers for `latchkey keys`: its `/stats` (for the shards it leads) and its
/// `/keys`.
pub(crate) struct MemberKeys<'a> {
    /// Its `/stats`.
    pub stats: &'a Value,
    /// Its `/keys` array.
    pub keys: &'a [Value],
}

/// Merges what the members that answered both requests listed (see the module docs).
pub(crate) fn merge_keys(members: &[MemberKeys<'_>], limit: usize) -> MergedKeys {
    let shard_count = members
        .iter()
        .find_map(|m| m.stats.get("cluster")?["shard_count"].as_u64())
        .filter(|&count| count > 0 && count <= u64::from(u32::MAX));
    // Per shard, the highest term a member serves it in (a cluster only).
    let mut served: HashMap<u64, u64> = HashMap::new();
    let serving_term = |member: &MemberKeys<'_>, shard: u64| -> Option<u64> {
        let shards = member.stats.get("cluster")?["shards"].as_array()?;
        let status = shards.iter().find(|s| s["shard"].as_u64() == Some(shard))?;
        (status["serving"] == json!(true)).then(|| status["term"].as_u64().unwrap_or(0))
    };
    if let Some(count) = shard_count {
        for member in members {
            for shard in 0..count {
                if let Some(term) = serving_term(member, shard) {
                    let best = served.entry(shard).or_insert(term);
                    *best = (*best).max(term);
                }
            }
        }
    }
    // key → (term of the member that listed it, its entry).
    let mut chosen: BTreeMap<String, (u64, &Value)> = BTreeMap::new();
    for member in members {
        for entry in member.keys {
            let Some(key) = entry["key"].as_str() else {
                continue;
            };
            let term = shard_count
                .and_then(|count| {
                    serving_term(member, u64::from(shard_of(key.as_bytes(), count as u32)))
                })
                .unwrap_or(0);
            match chosen.get(key) {
                Some((known, _)) if *known >= term => {}
                _ => {
                    chosen.insert(key.to_owned(), (term, entry));
                }
            }
        }
    }
    let keys = chosen
        .into_values()
        .take(limit)
        .map(|(_, entry)| entry.clone())
        .collect();
    let uncovered = match shard_count {
        Some(count) => (0..count).filter(|s| !served.contains_key(s)).collect(),
        None => Vec::new(),
    };
    MergedKeys {
        keys,
        uncovered,
        shard_count,
    }
}

#[cfg(test)]
#[path = "merge_tests.rs"]
mod tests;
