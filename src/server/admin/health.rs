//! `GET /health`: whether this server can serve, decided from its figures. No I/O.
//!
//! A single node is healthy unless it is shutting down. A cluster member also needs a quorum
//! (itself and the peers it reaches are a majority of the members: see
//! [`crate::cluster::peer::status`]) and a leader for every one of its shards: without them,
//! requests on some keys can only be redirected or time out, so a load balancer or an alert
//! must see `503`, with a body that says why.
//!
//! The decision is made from [`HealthFigures`], the few numbers it needs; they come from every
//! core's figures gathered for the request, or (the health port of `server.health_listen`, see
//! `health_port.rs`) from what each core published last.
//!
//! Deliberately not here: gathering the figures (the admin job does, from every core).

use crate::partition::ClusterStats;

/// The status and body of `/health`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Health {
    /// 200 or 503.
    pub status: u16,
    /// One line: `serving`, or why not.
    pub body: String,
}

/// Shards of `cluster` whose leader this member does not know.
pub fn shards_without_leader(cluster: &ClusterStats) -> usize {
    cluster
        .shards
        .iter()
        .filter(|shard| shard.leader.is_none())
        .count()
}

/// What `/health` decides from, for a cluster member: its shards, those without a known
/// leader, and its quorum (members reachable of members) when its peers are known.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct HealthFigures {
    /// Shards of this member (of the cores counted).
    pub shards: usize,
    /// Of them, those whose leader this member does not know.
    pub leaderless: usize,
    /// Members reachable, members, and whether those reachable are a majority.
    pub quorum: Option<(u64, u64, bool)>,
}

impl HealthFigures {
    /// The figures of one core's (or every core's merged) cluster stats.
    pub fn of(cluster: &ClusterStats) -> HealthFigures {
        HealthFigures {
            shards: cluster.shards.len(),
            leaderless: shards_without_leader(cluster),
            quorum: (cluster.peers.as_ref()).map(|p| (p.reachable, p.members, p.quorum)),
        }
    }

    /// Two cores' figures as one member's: their shards together, and the member's quorum
    /// (every core sees the same peers; read at different moments, the one that saw no quorum
    /// wins, or the one that saw any).
    pub fn merge(self, other: HealthFigures) -> HealthFigures {
        let quorum = match (self.quorum, other.quorum) {
            (Some(lost @ (_, _, false)), _) | (_, Some(lost @ (_, _, false))) => Some(lost),
            (seen, other) => seen.or(other),
        };
        HealthFigures {
            shards: self.shards + other.shards,
            leaderless: self.leaderless + other.leaderless,
            quorum,
        }
    }
}

/// The answer of a server that is `shutting_down` or not, with its members' figures if it is a
/// cluster member (every core's shards merged).
pub fn decide(shutting_down: bool, cluster: Option<&ClusterStats>) -> Health {
    decide_figures(shutting_down, cluster.map(HealthFigures::of))
}

/// [`decide`] from the figures alone (`None`: a single node).
pub fn decide_figures(shutting_down: bool, figures: Option<HealthFigures>) -> Health {
    let unhealthy = |why: String| Health {
        status: 503,
        body: why + "\n",
    };
    if shutting_down {
        return unhealthy("shutting down".to_string());
    }
    let Some(figures) = figures else {
        return Health {
            status: 200,
            body: "serving\n".to_string(),
        };
    };
    let mut why = Vec::new();
    if let Some((reachable, members, false)) = figures.quorum {
        why.push(format!(
            "no quorum: {reachable} of {members} members reachable"
        ));
    }
    if figures.leaderless > 0 {
        let (leaderless, shards) = (figures.leaderless, figures.shards);
        why.push(format!("{leaderless} of {shards} shards without a leader"));
    }
    match why.is_empty() {
        true => Health {
            status: 200,
            body: "serving\n".to_string(),
        },
        false => unhealthy(why.join("; ")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::metrics::Histogram;
    use crate::partition::cluster_stats::{PeerCounters, PeerReport};
    use crate::partition::cluster_stats::{ShardStatus, LATENCY_BOUNDS_US};

    /// A member's figures: `shards` shards, the first `leaderless` without a leader, and
    /// `reachable` of 3 members reachable.
    fn member(shards: u32, leaderless: u32, reachable: u64) -> ClusterStats {
        let shards = (0..shards)
            .map(|shard| ShardStatus {
                shard,
                leader: (shard >= leaderless).then_some(2),
                serving: false,
                term: 3,
                commit: 9,
                applied: 9,
                holds: 0,
            })
            .collect();
        ClusterStats {
            node_id: 1,
            members: Vec::new(),
            shards,
            leader_changes: 0,
            proposals: 0,
            restores: 0,
            commit_latency: Histogram::new(LATENCY_BOUNDS_US),
            sync_latency: Histogram::new(LATENCY_BOUNDS_US),
            peers: Some(PeerReport {
                members: 3,
                reachable,
                quorum: reachable >= 2,
                version: 4,
                incarnation: 0xabc,
                cluster_version: 3,
                peers: Vec::new(),
                counters: PeerCounters::default(),
            }),
        }
    }

    #[test]
    fn stats_and_metrics_show_the_figures_the_decision_uses() {
        use crate::partition::cluster_stats::{LinkState, PeerStatus};
        use crate::server::admin::render::{metrics_text, stats_json, CoreStats, ServerStats};
        let mut cluster = member(4, 3, 1);
        let peers = cluster.peers.as_mut().expect("peers");
        peers.peers.push(PeerStatus {
            node_id: 2,
            addr: "127.0.0.1:7521".parse().expect("an address"),
            link: LinkState::Refused,
            reason: "cluster identity differs".to_string(),
            for_ms: 1500,
            reachable: false,
            heard_ms_ago: None,
            refused_inbound: None,
            version: 3,
            incarnation: Some(0x1ca2),
        });
        peers.counters.invalid_dropped = 7;
        let core = CoreStats {
            table: crate::partition::TableStats::default(),
            sessions: 0,
            sessions_refused: 0,
            acquires_rejected: 0,
            requests_forbidden: 0,
            tls_failures: 0,
            locks_held: 0,
            waiters: 0,
            cluster: Some(cluster),
        };
        let stats = ServerStats {
            cores: vec![core],
            loops: vec![Histogram::new(&[1])],
            uptime_us: 1,
            limits: crate::config::LimitsConfig::default(),
            shutting_down: false,
            clients: (0, 0),
        };
        let metrics = metrics_text(&stats);
        for sample in [
            "latchkey_cluster_shards_without_leader 3",
            "latchkey_cluster_members 3",
            "latchkey_cluster_members_reachable 1",
            "latchkey_cluster_quorum 0",
            "latchkey_cluster_peer_reachable{peer=\"2\"} 0",
            "latchkey_cluster_version 3",
            "latchkey_cluster_peer_wire_version{peer=\"2\"} 3",
            "latchkey_cluster_peer_invalid_messages_total 7",
        ] {
            assert!(
                metrics.lines().any(|line| line == sample),
                "{sample} in\n{metrics}"
            );
        }
        let json: serde_json::Value = serde_json::from_str(&stats_json(&stats)).expect("JSON");
        let cluster = &json["cluster"];
        assert_eq!(cluster["shards_without_leader"], 3);
        assert_eq!(
            (cluster["member_count"].clone(), cluster["quorum"].clone()),
            (3.into(), false.into())
        );
        assert_eq!(cluster["peers"][0]["link"], "refused");
        assert_eq!(cluster["peers"][0]["reason"], "cluster identity differs");
        assert_eq!(cluster["peers"][0]["for_seconds"], 1.5);
        assert_eq!(cluster["peers"][0]["wire_version"], 3);
        assert_eq!(cluster["peers"][0]["incarnation"], "0000000000001ca2");
        assert_eq!(cluster["incarnation"], "0000000000000abc");
        assert_eq!(
            (
                cluster["wire_version"].clone(),
                cluster["cluster_version"].clone()
            ),
            (4.into(), 3.into())
        );
        assert_eq!(cluster["peer_counters"]["invalid_messages"], 7);
    }

    fn health(status: u16, body: &str) -> Health {
        Health {
            status,
            body: format!("{body}\n"),
        }
    }

    #[test]
    fn a_single_node_serves_until_it_shuts_down() {
        assert_eq!(decide(false, None), health(200, "serving"));
        assert_eq!(decide(true, None), health(503, "shutting down"));
    }

    #[test]
    fn a_member_serves_with_a_quorum_and_a_leader_for_every_shard() {
        assert_eq!(
            decide(false, Some(&member(64, 0, 3))),
            health(200, "serving")
        );
        assert_eq!(
            decide(false, Some(&member(64, 0, 2))),
            health(200, "serving")
        );
        let shutting = decide(true, Some(&member(64, 0, 3)));
        assert_eq!(shutting, health(503, "shutting down"));
    }

    #[test]
    fn a_member_without_a_quorum_or_with_leaderless_shards_says_why() {
        let alone = decide(false, Some(&member(64, 64, 1)));
        let both = "no quorum: 1 of 3 members reachable; 64 of 64 shards without a leader";
        assert_eq!(alone, health(503, both));
        let leaderless = decide(false, Some(&member(64, 12, 3)));
        assert_eq!(leaderless, health(503, "12 of 64 shards without a leader"));
        // A quorum lost a moment ago, while the shards still name their old leaders.
        let lost = decide(false, Some(&member(64, 0, 1)));
        assert_eq!(lost, health(503, "no quorum: 1 of 3 members reachable"));
        // Figures without a peer report (a member whose peers are not known): shards decide.
        let mut unknown = member(8, 0, 3);
        unknown.peers = None;
        assert_eq!(decide(false, Some(&unknown)), health(200, "serving"));
        assert_eq!(shards_without_leader(&member(8, 3, 3)), 3);
    }

    #[test]
    fn figures_of_several_cores_merge_into_the_members_and_decide_alike() {
        let cores = [member(32, 12, 1), member(32, 0, 1)];
        let merged = HealthFigures::of(&cores[0]).merge(HealthFigures::of(&cores[1]));
        assert_eq!(
            merged,
            HealthFigures {
                shards: 64,
                leaderless: 12,
                quorum: Some((1, 3, false))
            }
        );
        let both = "no quorum: 1 of 3 members reachable; 12 of 64 shards without a leader";
        assert_eq!(decide_figures(false, Some(merged)), health(503, both));
        assert_eq!(decide_figures(false, None), health(200, "serving"));
        assert_eq!(
            decide_figures(true, Some(merged)),
            health(503, "shutting down")
        );
    }
}
