//! `latchkey cluster status`: every member's view of the cluster, from its `GET /stats`.
//!
//! For each address of `--server a,b,c`: reachable or why not, the member's id, the shards it
//! leads (and serves), the range of its shards' terms, the sum of their commit and applied
//! indices, and its lag: over the shards, the most any member's commit index is ahead of what
//! this member applied. Under a member's line, each peer it does not reach (refused and why,
//! down and why, silent), and its quorum when it has none. `--json` prints one object with
//! every member, every shard and every peer.

use super::admin::{connector, fetch};
use super::{parse_servers, ConnectArgs, OutputArgs, EXIT_UNAVAILABLE, EXIT_USAGE};
use serde_json::{json, Value};
use std::collections::HashMap;
use std::net::SocketAddr;
use std::process::ExitCode;

/// `latchkey cluster ...`.
#[derive(clap::Subcommand, Debug, Clone)]
pub enum ClusterCommand {
    /// Members, reachable or not, shards led, terms, commit and applied indices, lag.
    Status(ClusterStatusArgs),
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
}

/// One member as seen from its `/stats`.
struct Seen {
    addr: SocketAddr,
    cluster: Result<Value, String>,
}

/// Runs `latchkey cluster ...`. Exit 0 when every member answered, 83 when some did not.
pub fn run_cluster(command: ClusterCommand) -> ExitCode {
    let ClusterCommand::Status(args) = command;
    let addrs = match parse_servers(&args.connect.server) {
        Ok(addrs) => addrs,
        Err(error) => {
            eprintln!(
                "latchkey cluster status: --server {}: {error}",
                args.connect.server
            );
            return ExitCode::from(EXIT_USAGE);
        }
    };
    let tls = match connector("cluster status", &args.connect) {
        Ok(tls) => tls,
        Err(code) => return code,
    };
    let timeout = args.connect.transport_timeout;
    let seen: Vec<Seen> = addrs
        .iter()
        .map(|&addr| {
            let cluster = fetch(&[addr], "/stats", timeout, tls.as_ref())
                .map_err(|failure| failure.message)
                .and_then(|body: Vec<u8>| {
                    let stats: Value = serde_json::from_slice(&body)
                        .map_err(|e| format!("the answer to GET /stats is not JSON: {e}"))?;
                    stats.get("cluster").cloned().ok_or_else(|| {
                        "not a cluster member (no [cluster] in its configuration)".to_string()
                    })
                });
            Seen { addr, cluster }
        })
        .collect();
    let rows = rows(&seen);
    if args.output.json {
        println!("{}", json!({ "members": rows }));
    } else {
        print!("{}", render(&rows));
    }
    if rows.iter().all(|row| row["reachable"] == json!(true)) {
        ExitCode::SUCCESS
    } else {
        ExitCode::from(EXIT_UNAVAILABLE)
    }
}

/// One JSON object per member, with its lag against the highest commit index any member
/// reported for each shard.
fn rows(seen: &[Seen]) -> Vec<Value> {
    let mut highest: HashMap<u64, u64> = HashMap::new();
    for member in seen {
        for shard in shards(member) {
            let commit = shard["commit"].as_u64().unwrap_or(0);
            let entry = highest
                .entry(shard["shard"].as_u64().unwrap_or(0))
                .or_default();
            *entry = (*entry).max(commit);
        }
    }
    seen.iter()
        .map(|member| match &member.cluster {
            Err(error) => json!({
                "address": member.addr.to_string(),
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
                    "address": member.addr.to_string(),
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
                    "members_reachable": cluster["members_reachable"],
                    "members_total": cluster["members"],
                    "shards_without_leader": cluster["shards_without_leader"],
                    "peers": cluster["peers"],
                    "shard_states": cluster["shards"],
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

/// Lines under a member: each peer it does not reach and why, and its quorum if it has none.
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
    text
}
