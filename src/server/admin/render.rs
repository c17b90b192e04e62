//! The server's figures, gathered from every core, as Prometheus text and as JSON. No I/O.

use crate::config::LimitsConfig;
use crate::metrics::Histogram;
use crate::partition::cluster_stats::{PeerReport, PeerStatus};
use crate::partition::ClusterStats;
use crate::partition::{BusyReason, HeldKey, TableStats};
use latchkey_client::card::Card;
use prometheus_client::encoding::{DescriptorEncoder, NoLabelSet};
use prometheus_client::metrics::MetricType;
use serde_json::{json, Value};
use std::net::SocketAddr;

/// One core's figures, copied at one instant by that core.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CoreStats {
    /// Its partition's counters and histograms.
    pub table: TableStats,
    /// Sessions it holds now (open or closing).
    pub sessions: u64,
    /// Sessions it refused at `max_connections`.
    pub sessions_refused: u64,
    /// Acquires it answered `X` (bad key or lease, or forbidden).
    pub acquires_rejected: u64,
    /// Keyed requests it answered `X` code 8 (authorization rules).
    pub requests_forbidden: u64,
    /// TLS sessions it closed for a TLS error or a late handshake.
    pub tls_failures: u64,
    /// Keys its partition holds now.
    pub locks_held: u64,
    /// Acquires queued in its partition now.
    pub waiters: u64,
    /// A cluster member's figures of this core's shards.
    pub cluster: Option<ClusterStats>,
}

/// Everything `GET /metrics` and `GET /stats` show.
#[derive(Clone, Debug)]
pub struct ServerStats {
    /// Per core, in core order.
    pub cores: Vec<CoreStats>,
    /// Per core, its loop iterations (busy time, poll excluded).
    pub loops: Vec<Histogram>,
    /// Since the server started, in microseconds.
    pub uptime_us: u64,
    /// The limits in force.
    pub limits: LimitsConfig,
    /// Whether the server is shutting down.
    pub shutting_down: bool,
    /// Identified clients with a record now, and Identifies refused for room so far
    /// (docs/protocol.md §5, resumable calls).
    pub clients: (usize, u64),
}

impl ServerStats {
    /// The cores' figures added up.
    pub fn total(&self) -> CoreStats {
        let mut cores = self.cores.iter();
        let mut total = cores.next().expect("at least one core").clone();
        for core in cores {
            total.table.merge(&core.table);
            total.sessions += core.sessions;
            total.sessions_refused += core.sessions_refused;
            total.acquires_rejected += core.acquires_rejected;
            total.requests_forbidden += core.requests_forbidden;
            total.tls_failures += core.tls_failures;
            total.locks_held += core.locks_held;
            total.waiters += core.waiters;
            if let (Some(sum), Some(cluster)) = (total.cluster.as_mut(), core.cluster.as_ref()) {
                sum.shards.extend(cluster.shards.iter().cloned());
                sum.leader_changes += cluster.leader_changes;
                sum.proposals += cluster.proposals;
                sum.restores += cluster.restores;
                sum.commit_latency.merge(&cluster.commit_latency);
                sum.sync_latency.merge(&cluster.sync_latency);
            }
        }
        if let Some(cluster) = total.cluster.as_mut() {
            cluster.shards.sort_by_key(|status| status.shard);
        }
        total
    }
}

/// The build's version and commit.
pub fn build_info() -> (&'static str, &'static str) {
    (crate::VERSION, crate::COMMIT)
}

/// Prometheus (OpenMetrics) text of `stats`.
pub fn metrics_text(stats: &ServerStats) -> String {
    let mut registry = prometheus_client::registry::Registry::default();
    registry.register_collector(Box::new(Snapshot(stats.clone())));
    let mut text = String::new();
    prometheus_client::encoding::text::encode(&mut text, &registry)
        .expect("writing to a String cannot fail");
    text
}

/// The figures as one collector, encoded once per scrape.
#[derive(Debug)]
struct Snapshot(ServerStats);

type Labels = [(&'static str, String); 1];

impl Snapshot {
    /// The figures of resumable calls (docs/protocol.md §5).
    fn encode_resumable(
        &self,
        encoder: &mut DescriptorEncoder,
        table: &TableStats,
    ) -> Result<(), std::fmt::Error> {
        let fates = ["never_seen", "granted", "queued", "timed_out", "busy"];
        let resolves: Vec<(&str, u64)> = fates.into_iter().zip(table.resolves).collect();
        counters(
            encoder,
            "latchkey_resolves",
            "Resolves answered, by the fate they reported",
            "fate",
            &resolves,
        )?;
        counter(
            encoder,
            "latchkey_grace_releases",
            "Grants to identified clients released when their grace ended unresolved",
            table.grace_releases,
        )?;
        counter(
            encoder,
            "latchkey_adopted_waiters",
            "Queued acquires taken over from the replicated state by a new leader",
            table.adopted,
        )?;
        counter(
            encoder,
            "latchkey_client_answers_dropped",
            "T and B answers to identified clients forgotten early for room",
            table.fates_dropped,
        )?;
        let (clients, refused) = self.0.clients;
        gauge(
            encoder,
            "latchkey_identified_clients",
            "Identified clients the server keeps now",
            clients as u64,
        )?;
        counter(
            encoder,
            "latchkey_identify_refused_full",
            "Identifies refused because the server kept as many clients as it may",
            refused,
        )
    }
}

impl prometheus_client::collector::Collector for Snapshot {
    fn encode(&self, mut encoder: DescriptorEncoder) -> Result<(), std::fmt::Error> {
        let stats = &self.0;
        let total = stats.total();
        let table = &total.table;
        let acquires = [
            ("acquired", table.acquired),
            ("timeout", table.timed_out),
            ("busy", table.busy.total()),
            ("rejected", total.acquires_rejected),
        ];
        let busy = BusyReason::ALL.map(|reason| (reason.label(), table.busy.get(reason)));
        let releases = [
            ("released", table.released),
            ("not_held", table.release_not_held),
        ];
        let extends = [
            ("extended", table.extended),
            ("not_held", table.extend_not_held),
        ];
        counters(
            &mut encoder,
            "latchkey_acquires",
            "Acquires answered, by result",
            "result",
            &acquires,
        )?;
        counters(
            &mut encoder,
            "latchkey_releases",
            "Releases answered, by result",
            "result",
            &releases,
        )?;
        counters(
            &mut encoder,
            "latchkey_extends",
            "Extends answered, by result",
            "result",
            &extends,
        )?;
        counter(
            &mut encoder,
            "latchkey_cancels",
            "Cancel requests",
            table.cancels,
        )?;
        counter(
            &mut encoder,
            "latchkey_lease_expirations",
            "Leases that ran out",
            table.lease_expirations,
        )?;
        counters(
            &mut encoder,
            "latchkey_busy",
            "Acquires answered B, by reason",
            "reason",
            &busy,
        )?;
        counter(
            &mut encoder,
            "latchkey_sessions_refused",
            "Sessions refused at max_connections",
            total.sessions_refused,
        )?;
        counter(
            &mut encoder,
            "latchkey_requests_forbidden",
            "Keyed requests answered X code 8 by the authorization rules",
            total.requests_forbidden,
        )?;
        counter(
            &mut encoder,
            "latchkey_tls_failures",
            "TLS sessions closed for a TLS error or a handshake past its deadline",
            total.tls_failures,
        )?;
        gauge(
            &mut encoder,
            "latchkey_locks_held",
            "Keys held now",
            total.locks_held,
        )?;
        self.encode_resumable(&mut encoder, table)?;
        gauge(
            &mut encoder,
            "latchkey_waiters",
            "Acquires queued now",
            total.waiters,
        )?;
        gauge(
            &mut encoder,
            "latchkey_sessions",
            "Sessions open now (admin requests included)",
            total.sessions,
        )?;
        let wait_help = "From a queued acquire's arrival to its answer";
        histogram(
            &mut encoder,
            "latchkey_acquire_wait_seconds",
            wait_help,
            &[(None, &table.acquire_wait)],
        )?;
        let hold_help = "From a grant to its release or expiry";
        histogram(
            &mut encoder,
            "latchkey_lock_hold_seconds",
            hold_help,
            &[(None, &table.lock_hold)],
        )?;
        let loops: Vec<(Option<Labels>, &Histogram)> = stats
            .loops
            .iter()
            .enumerate()
            .map(|(core, loops)| (Some([("core", core.to_string())]), loops))
            .collect();
        let loop_help =
            "Event-loop iterations per core, busy time (poll excluded): the stall detector";
        histogram(
            &mut encoder,
            "latchkey_loop_iteration_seconds",
            loop_help,
            &loops,
        )?;
        if let Some(cluster) = &total.cluster {
            cluster_metrics(&mut encoder, cluster)?;
        }
        let (version, commit) = build_info();
        let mut info =
            encoder.encode_descriptor("latchkey_build", "The build", None, MetricType::Info)?;
        info.encode_info(&[("version", version), ("commit", commit)])
    }
}

/// A member's replication metrics (cluster mode only).
fn cluster_metrics(
    encoder: &mut DescriptorEncoder,
    cluster: &ClusterStats,
) -> Result<(), std::fmt::Error> {
    let led = cluster.shards.iter().filter(|s| s.serving).count() as u64;
    gauge(
        encoder,
        "latchkey_cluster_shards_led",
        "Shards this member leads and serves",
        led,
    )?;
    gauge(
        encoder,
        "latchkey_cluster_shards_without_leader",
        "Shards of this member whose leader it does not know: their keys cannot be served",
        super::health::shards_without_leader(cluster) as u64,
    )?;
    if let Some(peers) = &cluster.peers {
        peer_metrics(encoder, peers)?;
    }
    counter(
        encoder,
        "latchkey_cluster_leader_changes",
        "Leader changes seen by this member's shards",
        cluster.leader_changes,
    )?;
    counter(
        encoder,
        "latchkey_cluster_proposals",
        "Entries this member proposed",
        cluster.proposals,
    )?;
    counter(
        encoder,
        "latchkey_cluster_snapshot_restores",
        "Snapshots this member's shards restored (sent by a leader to a lagging member, or read at start)",
        cluster.restores,
    )?;
    histogram(
        encoder,
        "latchkey_cluster_commit_latency_seconds",
        "From a client request's proposal to its entry's apply",
        &[(None, &cluster.commit_latency)],
    )?;
    histogram(
        encoder,
        "latchkey_cluster_sync_latency_seconds",
        "One write-ahead log sync (write and fdatasync)",
        &[(None, &cluster.sync_latency)],
    )
}

/// A member's links to its peers and its quorum (cluster mode only).
fn peer_metrics(
    encoder: &mut DescriptorEncoder,
    peers: &PeerReport,
) -> Result<(), std::fmt::Error> {
    gauge(
        encoder,
        "latchkey_cluster_members",
        "Members of the cluster, this one included",
        peers.members,
    )?;
    gauge(
        encoder,
        "latchkey_cluster_members_reachable",
        "Members this one reaches both ways within 1 s, itself included",
        peers.reachable,
    )?;
    gauge(
        encoder,
        "latchkey_cluster_quorum",
        "1 when the members reachable are a majority of the members, else 0",
        u64::from(peers.quorum),
    )?;
    gauge(
        encoder,
        "latchkey_cluster_version",
        "The lowest peer wire version any member speaks, as this member last heard",
        u64::from(peers.cluster_version),
    )?;
    per_peer(
        encoder,
        "latchkey_cluster_peer_reachable",
        "1 when this member reaches the peer both ways within 1 s, else 0",
        (peers, |peer| u64::from(peer.reachable)),
    )?;
    per_peer(
        encoder,
        "latchkey_cluster_peer_wire_version",
        "The peer wire version this member last heard the peer speak",
        (peers, |peer| u64::from(peer.version)),
    )?;
    let counters = &peers.counters;
    counter(
        encoder,
        "latchkey_cluster_peer_connections_refused",
        "Connections to this member's peer port it refused (a misconfigured hello, a bad frame)",
        counters.refusals,
    )?;
    counter(
        encoder,
        "latchkey_cluster_peer_connections_refused_by_peers",
        "Connections of this member a peer refused (their configurations differ)",
        counters.refused_by_peers,
    )?;
    counter(
        encoder,
        "latchkey_cluster_peer_connections_refused_tls",
        "Peer connections this member refused for TLS (plaintext against [cluster.tls] or TLS \
         without it, a certificate not signed by its CA or not naming the member it should)",
        counters.tls_refusals,
    )?;
    counter(
        encoder,
        "latchkey_cluster_peer_invalid_messages",
        "Peer messages dropped because their entries or snapshot do not decode",
        counters.invalid_dropped,
    )
}

/// A gauge with one sample per peer (label `peer`, its node id): `value` of each.
fn per_peer(
    encoder: &mut DescriptorEncoder,
    name: &str,
    help: &str,
    (peers, value): (&PeerReport, fn(&PeerStatus) -> u64),
) -> Result<(), std::fmt::Error> {
    let mut metric = encoder.encode_descriptor(name, help, None, MetricType::Gauge)?;
    for peer in &peers.peers {
        let labels = [("peer", peer.node_id.to_string())];
        let mut family = metric.encode_family(&labels)?;
        family.encode_gauge(&value(peer))?;
    }
    Ok(())
}

fn counter(
    encoder: &mut DescriptorEncoder,
    name: &str,
    help: &str,
    value: u64,
) -> Result<(), std::fmt::Error> {
    let mut metric = encoder.encode_descriptor(name, help, None, MetricType::Counter)?;
    metric.encode_counter::<NoLabelSet, u64, f64>(&value, None)
}

fn counters(
    encoder: &mut DescriptorEncoder,
    name: &str,
    help: &str,
    label: &'static str,
    values: &[(&'static str, u64)],
) -> Result<(), std::fmt::Error> {
    let mut metric = encoder.encode_descriptor(name, help, None, MetricType::Counter)?;
    for &(value_label, value) in values {
        let labels = [(label, value_label)];
        let mut family = metric.encode_family(&labels)?;
        family.encode_counter::<NoLabelSet, u64, f64>(&value, None)?;
    }
    Ok(())
}

fn gauge(
    encoder: &mut DescriptorEncoder,
    name: &str,
    help: &str,
    value: u64,
) -> Result<(), std::fmt::Error> {
    let mut metric = encoder.encode_descriptor(name, help, None, MetricType::Gauge)?;
    metric.encode_gauge(&value)
}

fn histogram(
    encoder: &mut DescriptorEncoder,
    name: &str,
    help: &str,
    series: &[(Option<Labels>, &Histogram)],
) -> Result<(), std::fmt::Error> {
    let mut metric = encoder.encode_descriptor(name, help, None, MetricType::Histogram)?;
    for (labels, histogram) in series {
        let bounds = histogram.bounds_us().iter().map(|&bound| seconds(bound));
        let bounds = bounds.chain([f64::INFINITY]);
        let counts = histogram.bucket_counts().iter().copied();
        let buckets: Vec<(f64, u64)> = bounds.zip(counts).collect();
        let sum = seconds(histogram.sum_us());
        match labels {
            Some(labels) => {
                let mut family = metric.encode_family(labels)?;
                family.encode_histogram::<NoLabelSet>(sum, histogram.count(), &buckets, None)?;
            }
            None => {
                metric.encode_histogram::<NoLabelSet>(sum, histogram.count(), &buckets, None)?
            }
        }
    }
    Ok(())
}

fn seconds(micros: u64) -> f64 {
    micros as f64 / 1e6
}

/// The server's card (`GET /cluster`, `latchkey_client::card`): the cluster's identity, this
/// member and every member's client address; or, without `[cluster]`, a number drawn now that
/// tells this server run from any other.
pub fn card_text(cluster: Option<&crate::config::ClusterConfig>) -> String {
    let card = match cluster {
        None => Card::Standalone {
            instance: instance_number(),
        },
        Some(cluster) => Card::Member {
            cluster: cluster.identity().digest,
            member: cluster.node_id,
            shards: cluster.shards,
            clients: cluster.members.iter().map(|m| (m.id, m.client)).collect(),
        },
    };
    card.render()
}

/// A number that differs from one server run to the next (not a secret).
fn instance_number() -> u64 {
    use std::hash::{BuildHasher, Hasher};
    let mut hasher = std::collections::hash_map::RandomState::new().build_hasher();
    hasher.write_u32(std::process::id());
    hasher.write_u128(
        std::time::SystemTime::UNIX_EPOCH
            .elapsed()
            .map_or(0, |d| d.as_nanos()),
    );
    hasher.finish()
}

/// A member's shards and replication figures, for `/stats` (`latchkey cluster status`).
fn cluster_json(cluster: &ClusterStats) -> Value {
    let shards: Vec<Value> = cluster
        .shards
        .iter()
        .map(|status| {
            json!({
                "shard": status.shard,
                "leader": status.leader,
                "serving": status.serving,
                "term": status.term,
                "commit": status.commit,
                "applied": status.applied,
                "holds": status.holds,
            })
        })
        .collect();
    let members: Vec<Value> = cluster
        .members
        .iter()
        .map(|(id, client)| json!({"id": id, "client": client.to_string()}))
        .collect();
    let serving = cluster.shards.iter().filter(|s| s.serving);
    let peers = cluster.peers.as_ref();
    json!({
        "node_id": cluster.node_id,
        "members": members,
        "shard_count": cluster.shards.len(),
        "locks_led": serving.clone().map(|s| s.holds).sum::<usize>(),
        "member_count": peers.map(|peers| peers.members),
        "members_reachable": peers.map(|peers| peers.reachable),
        "quorum": peers.map(|peers| peers.quorum),
        "wire_version": peers.map(|peers| peers.version),
        "incarnation": peers.map(|peers| format!("{:016x}", peers.incarnation)),
        "cluster_version": peers.map(|peers| peers.cluster_version),
        "peers": peers.map_or(Vec::new(), |peers| peers.peers.iter().map(peer_json).collect()),
        "peer_counters": peers.map(|peers| {
            let counters = &peers.counters;
            json!({
                "refusals": counters.refusals,
                "refused_by_peers": counters.refused_by_peers,
                "tls_refusals": counters.tls_refusals,
                "invalid_messages": counters.invalid_dropped,
                "messages_sent": counters.messages_sent,
                "messages_received": counters.messages_received,
            })
        }),
        "shards_without_leader": super::health::shards_without_leader(cluster),
        "shards_led": serving.count(),
        "leader_changes": cluster.leader_changes,
        "proposals": cluster.proposals,
        "restores": cluster.restores,
        "commit_latency_seconds": histogram_json(&cluster.commit_latency),
        "sync_latency_seconds": histogram_json(&cluster.sync_latency),
        "shards": shards,
    })
}

/// One peer as `/stats` shows it: its link (`connected`, `refused`, `unreachable`,
/// `connecting`), why, for how long, whether it is reachable, when it was last heard from, and
/// the peer wire version it was last heard in.
fn peer_json(peer: &PeerStatus) -> Value {
    json!({
        "node_id": peer.node_id,
        "address": peer.addr.to_string(),
        "link": peer.link.label(),
        "reason": peer.reason,
        "for_seconds": peer.for_ms as f64 / 1e3,
        "reachable": peer.reachable,
        "heard_seconds_ago": peer.heard_ms_ago.map(|ms| ms as f64 / 1e3),
        "refused_inbound": peer.refused_inbound,
        "wire_version": peer.version,
        "incarnation": peer.incarnation.map(|incarnation| format!("{incarnation:016x}")),
    })
}

/// `GET /stats`: one JSON object.
pub fn stats_json(stats: &ServerStats) -> String {
    let total = stats.total();
    let table = &total.table;
    let (version, commit) = build_info();
    let limits = &stats.limits;
    let busy: serde_json::Map<String, Value> = BusyReason::ALL
        .iter()
        .map(|&reason| (reason.label().to_string(), json!(table.busy.get(reason))))
        .collect();
    let loops: Vec<Value> = stats
        .loops
        .iter()
        .enumerate()
        .map(|(core, loops)| {
            let mut value = histogram_json(loops);
            value["core"] = json!(core);
            value
        })
        .collect();
    let value = json!({
        "version": version,
        "commit": commit,
        "uptime_seconds": seconds(stats.uptime_us),
        "cores": stats.cores.len(),
        "shutting_down": stats.shutting_down,
        "limits": {
            "max_connections": limits.max_connections,
            "max_keys": limits.max_keys,
            "max_waiters_per_key": limits.max_waiters_per_key,
            "max_pending_per_session": limits.max_pending_per_session,
            "max_key_bytes": limits.max_key_bytes,
        },
        "sessions": total.sessions,
        "sessions_refused": total.sessions_refused,
        "requests_forbidden": total.requests_forbidden,
        "tls_failures": total.tls_failures,
        "locks_held": total.locks_held,
        "waiters": total.waiters,
        "acquires": {
            "acquired": table.acquired,
            "timeout": table.timed_out,
            "busy": table.busy.total(),
            "rejected": total.acquires_rejected,
        },
        "releases": {"released": table.released, "not_held": table.release_not_held},
        "extends": {"extended": table.extended, "not_held": table.extend_not_held},
        "cancels": table.cancels,
        "lease_expirations": table.lease_expirations,
        "busy": busy,
        "resumable": {
            "identified_clients": stats.clients.0,
            "identify_refused_full": stats.clients.1,
            "resolves": {
                "never_seen": table.resolves[0],
                "granted": table.resolves[1],
                "queued": table.resolves[2],
                "timed_out": table.resolves[3],
                "busy": table.resolves[4],
            },
            "grace_releases": table.grace_releases,
            "client_answers_dropped": table.fates_dropped,
            "adopted_waiters": table.adopted,
        },
        "acquire_wait_seconds": histogram_json(&table.acquire_wait),
        "lock_hold_seconds": histogram_json(&table.lock_hold),
        "loop_iteration_seconds": loops,
    });
    let mut value = value;
    if let Some(cluster) = &total.cluster {
        value["cluster"] = cluster_json(cluster);
    }
    let mut text = value.to_string();
    text.push('\n');
    text
}

/// A histogram in the `/stats` form: count, sum, max, p50, p99 and cumulative buckets.
pub(crate) fn histogram_json(histogram: &Histogram) -> Value {
    let quantile = |q| histogram.quantile_bound_us(q).map(seconds);
    let buckets: Vec<Value> = histogram
        .cumulative()
        .map(|(bound, total)| json!([seconds(bound), total]))
        .collect();
    json!({
        "count": histogram.count(),
        "sum": seconds(histogram.sum_us()),
        "max": seconds(histogram.max_us()),
        "p50": quantile(0.5),
        "p99": quantile(0.99),
        "buckets": buckets,
    })
}

/// `GET /keys`: a JSON array of held keys, each with its holder session's address if known.
/// The owner id is a decimal string: as a JSON number, an id above 2^53 (most of them: clients
/// draw them at random) would not read back exactly in JavaScript or `jq`.
pub fn keys_json(keys: &[(HeldKey, Option<SocketAddr>)]) -> String {
    let listed: Vec<Value> = keys
        .iter()
        .map(|(held, peer)| {
            json!({
                "key": String::from_utf8_lossy(&held.key),
                "owner": held.owner.to_string(),
                "peer": peer.map(|peer| peer.to_string()),
                "held_ms": held.held_us.map(|us| us / 1000),
                "lease_ms": held.lease_left_us / 1000,
                "waiters": held.waiters,
            })
        })
        .collect();
    let mut text = Value::Array(listed).to_string();
    text.push('\n');
    text
}
