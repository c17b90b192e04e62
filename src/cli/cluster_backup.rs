//! `latchkey cluster backup FILE`: a consistent copy of every shard's locks and token floor,
//! each from the member that serves the shard (`GET /cluster/backup?shard=N`), written to FILE
//! atomically (the format: `crate::cluster::backup`).
//!
//! Every member's `/stats` says who serves which shard and the shard count; each shard is then
//! asked of its leader. A shard whose leader moved, that has none, or whose leader did not
//! answer is asked again after a new look at the members, at most [`ROUNDS`] looks in all. Exit
//! 0 only when every shard was captured and FILE written; 83 when some shard was not (each
//! named on stderr, with what to run next) and 1 when FILE cannot be written: in both cases
//! FILE is left as it was.

use super::admin::{connector, fetch, Patience};
use super::cluster::{seen, shard_leaders, Seen};
use super::{parse_server_items, ConnectArgs, EXIT_UNAVAILABLE};
use crate::cluster::backup::{BackupFile, ShardBackup};
use crate::cluster::data_dir::write_atomically;
use serde_json::json;
use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

/// Looks at the members (and asks each shard still missing of its leader) at most this often.
const ROUNDS: usize = 3;
/// The pause between two looks: an election or a leadership move settles meanwhile.
const ROUND_PAUSE: Duration = Duration::from_millis(500);

/// Arguments of `latchkey cluster backup`.
#[derive(clap::Args, Debug, Clone)]
pub struct ClusterBackupArgs {
    /// The file to write (replaced atomically; left as it was unless every shard is captured).
    #[arg(value_name = "FILE")]
    pub file: PathBuf,
    /// The members (`--server a,b,c`) and the transport timeout.
    #[command(flatten)]
    pub connect: ConnectArgs,
}

const COMMAND: &str = "cluster backup";

/// Runs `latchkey cluster backup FILE`.
pub fn run_backup(args: &ClusterBackupArgs) -> ExitCode {
    let items = match parse_server_items(&args.connect.server) {
        Ok(items) => items,
        Err(failure) => return super::fail_servers(COMMAND, &failure),
    };
    let tls = match connector(COMMAND, &args.connect) {
        Ok(tls) => tls,
        Err(code) => return code,
    };
    let patience = Patience::of(&args.connect);
    let mut shards: Option<u32> = None;
    let mut copies: BTreeMap<u32, ShardBackup> = BTreeMap::new();
    let mut missing: BTreeMap<u32, String> = BTreeMap::new();
    for round in 0..ROUNDS {
        if round > 0 {
            std::thread::sleep(ROUND_PAUSE);
        }
        let seen = match seen(COMMAND, &args.connect) {
            Ok(seen) => seen,
            Err(code) => return code,
        };
        let Some(count) = shards.or_else(|| shard_count(&seen)) else {
            say_unreached(&seen);
            continue;
        };
        shards = Some(count);
        let leaders = leader_items(&seen);
        // A member that did not answer one request is not asked again in this round.
        let mut silent: BTreeMap<u64, String> = BTreeMap::new();
        let wanted: Vec<u32> = (0..count).filter(|s| !copies.contains_key(s)).collect();
        for shard in wanted {
            let Some((node, item)) = leaders.get(&shard) else {
                let why = "no member that answered serves it (an election, or no quorum)";
                missing.insert(shard, why.to_string());
                continue;
            };
            if let Some(why) = silent.get(node) {
                missing.insert(shard, why.clone());
                continue;
            }
            let addrs = addresses(&items, item);
            let target = format!("/cluster/backup?shard={shard}");
            let copy = fetch(&addrs, &target, patience, tls.as_ref())
                .map_err(|failure| {
                    let why = format!("member {node} ({item}): {}", failure.message);
                    if failure.exit_code == EXIT_UNAVAILABLE {
                        silent.insert(*node, why.clone());
                    }
                    why
                })
                .and_then(|body| checked(&body, shard, count, *node));
            match copy {
                Ok(copy) => {
                    missing.remove(&shard);
                    copies.insert(shard, copy);
                }
                Err(why) => {
                    missing.insert(shard, why);
                }
            }
        }
        if missing.is_empty() {
            break;
        }
    }
    let Some(count) = shards else {
        eprintln!(
            "latchkey {COMMAND}: no member answered as a cluster member; no file written. Check \
             --server (every member's client address) and that the members run"
        );
        return ExitCode::from(EXIT_UNAVAILABLE);
    };
    if !missing.is_empty() || copies.len() != count as usize {
        say_missing(count, &missing);
        return ExitCode::from(EXIT_UNAVAILABLE);
    }
    let file = BackupFile {
        shards: copies.into_values().collect(),
    };
    let written = (file.encode())
        .map_err(|e| e.to_string())
        .and_then(|bytes| write_atomically(&args.file, &bytes).map_err(|e| e.to_string()));
    if let Err(error) = written {
        eprintln!(
            "latchkey {COMMAND}: cannot write {}: {error}; no file written",
            args.file.display()
        );
        return ExitCode::FAILURE;
    }
    let highest = file
        .highest_token()
        .map_or_else(|| "none".to_string(), |token| token.to_string());
    println!(
        "latchkey {COMMAND}: wrote {}: {count} shards, {} locks, highest token {highest}",
        args.file.display(),
        file.locks()
    );
    ExitCode::SUCCESS
}

/// The shard count the members report.
fn shard_count(seen: &[Seen]) -> Option<u32> {
    seen.iter().find_map(|member| {
        let cluster = member.cluster.as_ref().ok()?;
        let count = cluster["shard_count"].as_u64()?;
        u32::try_from(count).ok().filter(|&count| count > 0)
    })
}

/// Per shard, the member that serves it and the `--server` item that answered as it.
fn leader_items(seen: &[Seen]) -> BTreeMap<u32, (u64, String)> {
    let item_of = |node: u64| {
        seen.iter().find_map(|member| {
            let cluster = member.cluster.as_ref().ok()?;
            (cluster["node_id"].as_u64() == Some(node)).then(|| member.item.clone())
        })
    };
    let mut leaders = BTreeMap::new();
    for entry in shard_leaders(seen) {
        let (Some(shard), Some(node)) = (entry["shard"].as_u64(), entry["leader"].as_u64()) else {
            continue;
        };
        let (Ok(shard), Some(item)) = (u32::try_from(shard), item_of(node)) else {
            continue;
        };
        leaders.insert(shard, (node, item));
    }
    leaders
}

/// The addresses of `--server` item `item`.
fn addresses(items: &[(String, Vec<SocketAddr>)], item: &str) -> Vec<SocketAddr> {
    let found = items.iter().find(|(name, _)| name == item);
    found.map(|(_, addrs)| addrs.clone()).unwrap_or_default()
}

/// `body` as the copy of `shard` of `count`, decoded and checked.
fn checked(body: &[u8], shard: u32, count: u32, node: u64) -> Result<ShardBackup, String> {
    let copy = ShardBackup::decode(body)
        .map_err(|e| format!("member {node} sent a copy that does not decode: {e}"))?;
    if (copy.shard, copy.shards) != (shard, count) {
        let sent = json!({"shard": copy.shard, "shards": copy.shards});
        return Err(format!("member {node} sent another shard's copy: {sent}"));
    }
    Ok(copy)
}

/// Which members did not answer as cluster members, on stderr.
fn say_unreached(seen: &[Seen]) {
    for member in seen {
        if let Err(error) = &member.cluster {
            eprintln!("latchkey {COMMAND}: {}: {error}", member.item);
        }
    }
}

/// What is missing and what to run next, on stderr.
fn say_missing(count: u32, missing: &BTreeMap<u32, String>) {
    eprintln!(
        "latchkey {COMMAND}: {} of {count} shards not captured; no file written:",
        missing.len()
    );
    for (shard, why) in missing {
        eprintln!("  shard {shard}: {why}");
    }
    eprintln!(
        "run `latchkey cluster status` to see which members serve which shards, then run the \
         backup again"
    );
}
