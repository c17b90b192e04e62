//! `latchkey cluster status` and `latchkey cluster leader KEY`: the cluster as its members
//! see it, from every member's `GET /stats`, asked all at once (`latchkey cluster backup FILE`
//! is in `cluster_backup.rs`).
//!
//! `status`: for each `--server` item, reachable or why not, the member's id, the shards it
//! leads (and serves), the range of its shards' terms, the sum of their commit and applied
//! indices, and its lag (over the shards, the most any member's commit index is ahead of what
//! this member applied). Under a member's line, each peer it does not reach (refused and why,
//! down and why, silent), its quorum when it has none, and its cluster version when that is
//! below its own peer wire version (a rolling upgrade under way), naming the peers last heard
//! in an older one. Then which member leads which shards, the shards nobody serves, and the
//! *problems* ([`problems`]). Exit 0 when every member answered and there is no problem, 83
//! when a listed member did not answer or a known one is reached by no member, else 86 when
//! there is a problem.
//!
//! `leader KEY`: the key's shard (the fixed hash of docs/cluster-design.md, over the shard
//! count the members report), the member that serves it (and its client address), and what
//! every other member believes. Exit 0 when a member serves it, 83 when none of those that
//! answered does (an election, or no quorum).
//!
//! `--json` prints one object with everything. Deliberately not here: changing anything (these
//! commands only read).

use super::admin::connector;
use super::admin::gather::gather;
use super::admin::merge::MemberAnswer;
use super::{
    parse_server_items, shown_key, ConnectArgs, OutputArgs, EXIT_UNAVAILABLE, EXIT_UNHEALTHY,
};
use crate::cluster::partition::{shard_list, shard_of};
use serde_json::{json, Value};
use std::collections::{BTreeMap, HashMap};
use std::process::ExitCode;

/// `latchkey cluster ...`.
#[derive(clap::Subcommand, Debug, Clone)]
pub enum ClusterCommand {
    /// Members, reachable or not, shards led, terms, commit and applied indices, lag, which
    /// member leads which shards, and the problems. Exit 0: whole; 83: a member did not answer
    /// or is reached by none; 86: a member refuses or is refused, is of another members list or
    /// none, has no quorum, or lags more than --max-lag.
    Status(ClusterStatusArgs),
    /// Which member leads KEY's shard, and what every member believes.
    Leader(ClusterLeaderArgs),
    /// Writes every shard's locks and token floor, each from its leader, to FILE (atomically):
    /// what a new cluster can start from (`[cluster] restore_from`). Exit 0: every shard
    /// captured; 83: some shard not (named, FILE left as it was); 1: FILE cannot be written.
    Backup(super::ClusterBackupArgs),
}

/// Arguments of `latchkey cluster status`.
#[derive(clap::Args, Debug, Clone)]
pub struct ClusterStatusArgs {
    /// The members (`--server a,b,c`) and the transport timeout.
    #[command(flatten)]
    pub connect: ConnectArgs,
    /// Text or JSON.
    #[command(flatten)]
    pub output: OutputArgs,
    /// A member whose applied index is more than this many entries behind the highest commit
    /// index of a shard (as any member of its cluster reports it) is a problem (exit 86).
    #[arg(long, value_name = "ENTRIES", default_value_t = 1000)]
    pub max_lag: u64,
}

/// Arguments of `latchkey cluster leader`.
#[derive(clap::Args, Debug, Clone)]
pub struct ClusterLeaderArgs {
    /// The key.
    #[arg(value_name = "KEY")]
    pub key: String,
    /// The members (`--server a,b,c`) and the transport timeout.
    #[command(flatten)]
    pub connect: ConnectArgs,
    /// Text or JSON.
    #[command(flatten)]
    pub output: OutputArgs,
}

/// One member as seen from its `/stats`: its `cluster` object, or why there is none.
pub(super) struct Seen {
    /// The `--server` item.
    pub(super) item: String,
    /// Its `cluster` object, or why there is none.
    pub(super) cluster: Result<Value, String>,
}

/// Runs `latchkey cluster ...`.
pub fn run_cluster(command: ClusterCommand) -> ExitCode {
    match command {
        ClusterCommand::Status(args) => run_status(&args),
        ClusterCommand::Leader(args) => run_leader(&args),
        ClusterCommand::Backup(args) => super::cluster_backup::run_backup(&args),
    }
}

/// Every member's `cluster` object (or why not), or the exit code after saying why nobody was
/// asked.
pub(super) fn seen(command: &str, connect: &ConnectArgs) -> Result<Vec<Seen>, ExitCode> {
    let items = parse_server_items(&connect.server)
        .map_err(|failure| super::fail_servers(command, &failure))?;
    let tls = connector(command, connect)?;
    let patience = super::admin::Patience::of(connect);
    let answers = gather(&items, &["/stats"], patience, tls.as_ref());
    Ok(answers.into_iter().flatten().map(seen_of).collect())
}

/// Why a listed server that answered has no `cluster` object.
const NOT_A_MEMBER: &str = "not a cluster member (no [cluster] in its configuration)";

fn seen_of(answer: MemberAnswer) -> Seen {
    let cluster = answer.result.and_then(|stats| {
        stats
            .get("cluster")
            .cloned()
            .ok_or_else(|| NOT_A_MEMBER.to_string())
    });
    Seen {
        item: answer.item,
        cluster,
    }
}

fn run_status(args: &ClusterStatusArgs) -> ExitCode {
    let seen = match seen("cluster status", &args.connect) {
        Ok(seen) => seen,
        Err(code) => return code,
    };
    let rows = rows(&seen);
    let leaders = shard_leaders(&seen);
    let found = problems(&rows, args.max_lag);
    if args.output.json {
        let listed: Vec<&String> = found.iter().map(|(_, text)| text).collect();
        println!(
            "{}",
            json!({ "members": rows, "shards": leaders, "problems": listed })
        );
    } else {
        print!("{}", render(&rows));
        print!("{}", render_leaders(&leaders, &seen));
        print!("{}", render_problems(&found));
    }
    match found.iter().map(|(kind, _)| *kind).max() {
        None => ExitCode::SUCCESS,
        Some(Problem::Unhealthy) => ExitCode::from(EXIT_UNHEALTHY),
        Some(Problem::Unavailable) => ExitCode::from(EXIT_UNAVAILABLE),
    }
}

/// What a problem makes the exit code: unavailable (83) wins over unhealthy (86), since what
/// could not be asked may hide more.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
enum Problem {
    /// Every member answered, and something is wrong: exit 86.
    Unhealthy,
    /// A listed member did not answer, or a known one is reached by no member: exit 83.
    Unavailable,
}

/// Everything that makes the cluster less than whole, each in words, from the rows of
/// [`rows`]: a listed server that does not answer (83) or is not a cluster member; a member
/// whose members list or shard count differs from the others' (it never joined them: the
/// largest group that agrees is the cluster); two answering as the same member; a peer link
/// refused either way; a member without quorum; a member more than `max_lag` entries behind;
/// a member of the cluster's list that no answering member reaches (83).
fn problems(rows: &[Value], max_lag: u64) -> Vec<(Problem, String)> {
    let mut found = Vec::new();
    let answered: Vec<&Value> = rows
        .iter()
        .filter(|r| r["reachable"] == json!(true))
        .collect();
    for row in rows.iter().filter(|r| r["reachable"] != json!(true)) {
        let address = row["address"].as_str().unwrap_or("?");
        let error = row["error"].as_str().unwrap_or("unreachable");
        let kind = match error == NOT_A_MEMBER {
            true => Problem::Unhealthy,
            false => Problem::Unavailable,
        };
        found.push((kind, format!("{address}: {error}")));
    }
    let in_cluster = |row: &&&Value| row["in_cluster"] == json!(true);
    let silent: Vec<&str> = (rows.iter())
        .filter(|row| row["reachable"] != json!(true))
        .filter_map(|row| row["address"].as_str())
        .collect();
    let who = |row: &Value| {
        let address = row["address"].as_str().unwrap_or("?");
        format!("member {} at {address}", row["node_id"])
    };
    let mut ids: BTreeMap<u64, &str> = BTreeMap::new();
    for row in &answered {
        if !in_cluster(&row) {
            let text = "its members list or shard count differs from the other members': it is \
                        not a member of their cluster";
            found.push((Problem::Unhealthy, format!("{}: {text}", who(row))));
            continue;
        }
        let (id, address) = (
            row["node_id"].as_u64().unwrap_or(0),
            row["address"].as_str(),
        );
        if let Some(first) = ids.insert(id, address.unwrap_or("?")) {
            let text = format!(
                "{first} and {} both answer as member {id}",
                address.unwrap_or("?")
            );
            found.push((Problem::Unhealthy, text));
        }
        for peer in row["peers"].as_array().into_iter().flatten() {
            if peer["link"] == json!("refused") {
                let reason = peer["reason"].as_str().unwrap_or_default();
                let text = format!("{}: peer {} refused: {reason}", who(row), peer["node_id"]);
                found.push((Problem::Unhealthy, text));
            }
        }
        if row["quorum"] == json!(false) {
            let text = format!(
                "{}: no quorum ({} of {} members reachable)",
                who(row),
                row["members_reachable"],
                row["members_total"]
            );
            found.push((Problem::Unhealthy, text));
        }
        if let Some(lag) = row["lag"].as_u64().filter(|&lag| lag > max_lag) {
            let text = format!("{}: {lag} entries behind (--max-lag {max_lag})", who(row));
            found.push((Problem::Unhealthy, text));
        }
    }
    // A member of the cluster's list that no answering member of it reaches, and that did not
    // answer itself: down, or cut off (one that a member refused is up, and named above).
    let cluster = answered.iter().find(in_cluster);
    let members = cluster.and_then(|row| row["members"].as_array());
    for member in members.into_iter().flatten() {
        let Some(id) = member["id"].as_u64() else {
            continue;
        };
        let client = member["client"].as_str().unwrap_or("?");
        if ids.contains_key(&id) || silent.contains(&client) {
            continue; // it answered, or its own row says it did not
        }
        let peer_views: Vec<&Value> = (answered.iter().filter(in_cluster))
            .flat_map(|row| row["peers"].as_array().into_iter().flatten())
            .filter(|peer| peer["node_id"].as_u64() == Some(id))
            .collect();
        let lost = |p: &&Value| p["reachable"] != json!(true) && p["link"] != json!("refused");
        if !peer_views.is_empty() && peer_views.iter().all(lost) {
            let text = format!("member {id} at {client}: reached by no member that answered");
            found.push((Problem::Unavailable, text));
        }
    }
    found
}

/// A member's view of the cluster it belongs to, from its own `cluster` object: its members
/// list and its shard count (`None` for one that did not answer).
fn member_configuration(member: &Seen) -> Option<(Value, Value)> {
    let cluster = member.cluster.as_ref().ok()?;
    let count = cluster["shards"].as_array().map_or(0, Vec::len);
    Some((cluster["members"].clone(), json!(count)))
}

/// The configuration most members that answered share (the first of those in order on a tie):
/// the cluster's. `None` when nobody answered.
fn most_shared(views: &[Option<(Value, Value)>]) -> Option<(Value, Value)> {
    let count = |view: &Option<(Value, Value)>| views.iter().filter(|o| *o == view).count();
    let answered = views.iter().filter(|view| view.is_some());
    let most = answered.clone().map(count).max()?;
    answered
        .clone()
        .find(|view| count(view) == most)
        .cloned()
        .flatten()
}

/// `PROBLEMS`, one line each (nothing when there is none).
fn render_problems(found: &[(Problem, String)]) -> String {
    if found.is_empty() {
        return String::new();
    }
    let mut text = String::from("\nPROBLEMS\n");
    for (_, problem) in found {
        text += &format!("  {problem}\n");
    }
    text
}

/// One JSON object per member, with its lag against the highest commit index any member of
/// the cluster (the members that share the most common members list and shard count: one that
/// never joined them has indices of its own) reported for each shard, and whether it is one of
/// them (`in_cluster`).
fn rows(seen: &[Seen]) -> Vec<Value> {
    let views: Vec<Option<(Value, Value)>> = seen.iter().map(member_configuration).collect();
    let shared = most_shared(&views);
    let mut highest: HashMap<u64, u64> = HashMap::new();
    let in_cluster = seen.iter().zip(&views).filter(|(_, view)| **view == shared);
    for (member, _) in in_cluster {
        for shard in shards(member) {
            let commit = shard["commit"].as_u64().unwrap_or(0);
            let entry = highest
                .entry(shard["shard"].as_u64().unwrap_or(0))
                .or_default();
            *entry = (*entry).max(commit);
        }
    }
    seen.iter()
        .zip(&views)
        .map(|(member, view)| match &member.cluster {
            Err(error) => json!({
                "address": member.item,
                "reachable": false,
                "error": error,
            }),
            Ok(cluster) => {
                let shards = shards(member);
                let terms = shards.iter().filter_map(|s| s["term"].as_u64());
                let sum =
                    |field: &str| shards.iter().filter_map(|s| s[field].as_u64()).sum::<u64>();
                let lag = shards
                    .iter()
                    .map(|s| {
                        let id = s["shard"].as_u64().unwrap_or(0);
                        let applied = s["applied"].as_u64().unwrap_or(0);
                        highest
                            .get(&id)
                            .copied()
                            .unwrap_or(0)
                            .saturating_sub(applied)
                    })
                    .max()
                    .unwrap_or(0);
                json!({
                    "address": member.item,
                    "reachable": true,
                    "node_id": cluster["node_id"],
                    "shards": shards.len(),
                    "shards_led": cluster["shards_led"],
                    "term_min": terms.clone().min(),
                    "term_max": terms.max(),
                    "commit": sum("commit"),
                    "applied": sum("applied"),
                    "lag": lag,
                    "leader_changes": cluster["leader_changes"],
                    "proposals": cluster["proposals"],
                    "quorum": cluster["quorum"],
                    "wire_version": cluster["wire_version"],
                    "cluster_version": cluster["cluster_version"],
                    "members_reachable": cluster["members_reachable"],
                    "members_total": cluster["member_count"],
                    "shards_without_leader": cluster["shards_without_leader"],
                    "peers": cluster["peers"],
                    "shard_states": cluster["shards"],
                    "members": cluster["members"],
                    "in_cluster": *view == shared,
                })
            }
        })
        .collect()
}

fn shards(member: &Seen) -> Vec<Value> {
    match &member.cluster {
        Ok(cluster) => cluster["shards"].as_array().cloned().unwrap_or_default(),
        Err(_) => Vec::new(),
    }
}

/// Per shard, the member that serves it (the highest term if two claim it, as in the middle
/// of a leadership change), with its term; `leader` null when no member that answered serves
/// it.
pub(super) fn shard_leaders(seen: &[Seen]) -> Vec<Value> {
    let mut serving: BTreeMap<u64, (u64, u64)> = BTreeMap::new();
    let mut known: BTreeMap<u64, ()> = BTreeMap::new();
    for member in seen {
        let Ok(cluster) = &member.cluster else {
            continue;
        };
        let node = cluster["node_id"].as_u64().unwrap_or(0);
        for shard in shards(member) {
            let Some(id) = shard["shard"].as_u64() else {
                continue;
            };
            known.insert(id, ());
            if shard["serving"] != json!(true) {
                continue;
            }
            let term = shard["term"].as_u64().unwrap_or(0);
            let entry = serving.entry(id).or_insert((node, term));
            if term > entry.1 {
                *entry = (node, term);
            }
        }
    }
    known
        .keys()
        .map(|shard| match serving.get(shard) {
            Some((node, term)) => json!({"shard": shard, "leader": node, "term": term}),
            None => json!({"shard": shard, "leader": null}),
        })
        .collect()
}

/// `LEADERS`: one line per member that serves shards, and one for the shards nobody serves.
fn render_leaders(leaders: &[Value], seen: &[Seen]) -> String {
    let mut by_leader: BTreeMap<Option<u64>, Vec<u32>> = BTreeMap::new();
    for entry in leaders {
        let shard = entry["shard"].as_u64().unwrap_or(0) as u32;
        by_leader
            .entry(entry["leader"].as_u64())
            .or_default()
            .push(shard);
    }
    let mut text = String::from("\nLEADERS\n");
    for (leader, shards) in &by_leader {
        let who = match leader {
            Some(node) => format!("member {node} ({})", client_address(seen, *node)),
            None => "no leader among the members that answered".to_string(),
        };
        text += &format!("  {who}: {}\n", shard_list(shards));
    }
    text
}

/// Member `node`'s client address, from any member's list of members.
fn client_address(seen: &[Seen], node: u64) -> String {
    let found = seen.iter().find_map(|member| {
        let members = member.cluster.as_ref().ok()?["members"].as_array()?.clone();
        let entry = members.iter().find(|m| m["id"].as_u64() == Some(node))?;
        entry["client"].as_str().map(str::to_owned)
    });
    found.unwrap_or_else(|| "address unknown".to_string())
}

/// The table: one line per member.
fn render(rows: &[Value]) -> String {
    let mut text = format!(
        "{:<7} {:<22} {:<10} {:>10} {:>9} {:>12} {:>12} {:>8}\n",
        "MEMBER", "ADDRESS", "STATE", "SHARDS LED", "TERMS", "COMMIT", "APPLIED", "LAG"
    );
    for row in rows {
        let address = row["address"].as_str().unwrap_or("?");
        if row["reachable"] != json!(true) {
            let error = row["error"].as_str().unwrap_or("unreachable");
            text += &format!("{:<7} {address:<22} unreachable: {error}\n", "-");
            continue;
        }
        let terms = match (row["term_min"].as_u64(), row["term_max"].as_u64()) {
            (Some(low), Some(high)) if low == high => low.to_string(),
            (Some(low), Some(high)) => format!("{low}-{high}"),
            _ => "-".to_string(),
        };
        let field = |name: &str| row[name].to_string();
        text += &format!(
            "{:<7} {address:<22} {:<10} {:>5} of {:<3} {terms:>9} {:>12} {:>12} {:>8}\n",
            field("node_id"),
            "reachable",
            field("shards_led"),
            field("shards"),
            field("commit"),
            field("applied"),
            field("lag"),
        );
        text += &member_notes(row);
    }
    text
}

/// Lines under a member: each peer it does not reach and why, its quorum if it has none, and
/// its cluster version if older than its own wire version.
fn member_notes(row: &Value) -> String {
    let mut text = String::new();
    for peer in row["peers"].as_array().into_iter().flatten() {
        if peer["reachable"] == json!(true) {
            continue;
        }
        let reason = peer["reason"].as_str().unwrap_or_default();
        let state = match peer["link"].as_str().unwrap_or_default() {
            "refused" => format!("refused: {reason}"),
            "unreachable" => format!("down: {reason}"),
            "connected" => match peer["heard_seconds_ago"].as_f64() {
                Some(ago) => format!("silent: nothing received for {ago:.1} s"),
                None => "silent: nothing received yet".to_string(),
            },
            other => other.to_string(),
        };
        let since = peer["for_seconds"].as_f64().unwrap_or(0.0);
        text += &format!(
            "{:<7} peer {} at {} {state} (for {since:.1} s)\n",
            "",
            peer["node_id"],
            peer["address"].as_str().unwrap_or("?")
        );
    }
    if row["quorum"] == json!(false) {
        text += &format!(
            "{:<7} no quorum: {} of {} members reachable\n",
            "", row["members_reachable"], row["members_total"]
        );
    }
    text + &version_note(row)
}

/// "cluster version 3 (this member speaks peer wire version 4): peer 2 at 3" while a member's
/// cluster version is below its own wire version; nothing otherwise (or from a member of a
/// build that does not say).
fn version_note(row: &Value) -> String {
    let (Some(own), Some(cluster)) = (
        row["wire_version"].as_u64(),
        row["cluster_version"].as_u64(),
    ) else {
        return String::new();
    };
    if cluster >= own {
        return String::new();
    }
    let older: Vec<String> = (row["peers"].as_array().into_iter().flatten())
        .filter_map(|peer| {
            let version = peer["wire_version"].as_u64().filter(|&v| v < own)?;
            Some(format!("peer {} at {version}", peer["node_id"]))
        })
        .collect();
    format!(
        "{:<7} cluster version {cluster} (this member speaks peer wire version {own}): {}\n",
        "",
        older.join(", ")
    )
}

/// What `cluster leader KEY` found.
fn run_leader(args: &ClusterLeaderArgs) -> ExitCode {
    let seen = match seen("cluster leader", &args.connect) {
        Ok(seen) => seen,
        Err(code) => return code,
    };
    let found = leader_of(&args.key, &seen);
    if args.output.json {
        println!("{found}");
    } else {
        print!("{}", render_leader(&args.key, &found));
    }
    match found["leader"].is_null() {
        false => ExitCode::SUCCESS,
        true => ExitCode::from(EXIT_UNAVAILABLE),
    }
}

/// `key`'s shard and who serves it, with every member's view (JSON).
fn leader_of(key: &str, seen: &[Seen]) -> Value {
    let count = seen.iter().find_map(|member| {
        let cluster = member.cluster.as_ref().ok()?;
        cluster["shard_count"]
            .as_u64()
            .filter(|&n| n > 0 && n <= u64::from(u32::MAX))
    });
    let Some(count) = count else {
        let views: Vec<Value> = seen
            .iter()
            .map(|m| json!({"member": m.item, "error": error_of(m)}))
            .collect();
        return json!({"key": key, "shard": null, "leader": null, "members": views});
    };
    let shard = u64::from(shard_of(key.as_bytes(), count as u32));
    let mut leader: Option<(u64, u64)> = None;
    let views: Vec<Value> = seen
        .iter()
        .map(|member| {
            let Ok(cluster) = &member.cluster else {
                return json!({"member": member.item, "error": error_of(member)});
            };
            let node = cluster["node_id"].as_u64().unwrap_or(0);
            let status = shards(member)
                .into_iter()
                .find(|s| s["shard"].as_u64() == Some(shard))
                .unwrap_or(Value::Null);
            let term = status["term"].as_u64().unwrap_or(0);
            if status["serving"] == json!(true) && leader.map_or(true, |(_, t)| term > t) {
                leader = Some((node, term));
            }
            json!({
                "member": member.item,
                "node_id": node,
                "serving": status["serving"],
                "believed_leader": status["leader"],
                "term": status["term"],
            })
        })
        .collect();
    let (node, term) = leader.map_or((Value::Null, Value::Null), |(n, t)| (json!(n), json!(t)));
    let address = leader.map(|(node, _)| client_address(seen, node));
    json!({
        "key": key,
        "shard": shard,
        "shard_count": count,
        "leader": node,
        "term": term,
        "leader_address": address,
        "members": views,
    })
}

fn error_of(member: &Seen) -> String {
    member.cluster.as_ref().err().cloned().unwrap_or_default()
}

/// `cluster leader` as text: the answer on the first line, every member's view after it.
fn render_leader(key: &str, found: &Value) -> String {
    let key = shown_key(key);
    let mut text = match (found["shard"].as_u64(), found["leader"].as_u64()) {
        (None, _) => format!("{key}: no member answered as a cluster member\n"),
        (Some(shard), Some(node)) => format!(
            "{key}: shard {shard} of {}, led by member {node} at {} (term {})\n",
            found["shard_count"],
            found["leader_address"].as_str().unwrap_or("?"),
            found["term"],
        ),
        (Some(shard), None) => format!(
            "{key}: shard {shard} of {} has no leader among the members that answered \
             (an election under way, or no quorum)\n",
            found["shard_count"],
        ),
    };
    for view in found["members"].as_array().map_or(&[][..], Vec::as_slice) {
        let member = view["member"].as_str().unwrap_or("?");
        let line = if let Some(error) = view["error"].as_str() {
            format!("no answer: {error}")
        } else if view["serving"] == json!(true) {
            format!(
                "member {}: leader, serving (term {})",
                view["node_id"], view["term"]
            )
        } else {
            let believed = match view["believed_leader"].as_u64() {
                Some(node) => format!("member {node}"),
                None => "none".to_string(),
            };
            format!(
                "member {}: follower, believes the leader is {believed} (term {})",
                view["node_id"], view["term"]
            )
        };
        text += &format!("  {member}: {line}\n");
    }
    text
}

#[cfg(test)]
#[path = "cluster_tests.rs"]
mod tests;
