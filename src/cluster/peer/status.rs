//! What the peer thread knows of each peer — its link, whether it is reachable — and whether
//! this member has a quorum: kept by the thread, published for `GET /stats` and `/health`,
//! and logged at info when it changes. No I/O but the log.
//!
//! # Reachable
//!
//! A peer is *reachable* when this member's connection to it was accepted (its hello reply) and
//! something arrived from it (a raft message, a keepalive, its hello) within
//! [`REACHABLE_WINDOW`]: both ways work. Every connected peer writes at least a keepalive every
//! [`super::frame::KEEPALIVE_INTERVAL`], so a live peer is never missed for lack of raft
//! traffic; a paused one (SIGSTOP) is unreachable a window after its last bytes, although its
//! kernel still accepts connections. This member has a *quorum* when it and its reachable peers
//! are a majority of the members: what a shard needs to elect a leader and commit.
//!
//! # Logs
//!
//! Changes are logged at info: a peer unreachable (and why) or reachable again, quorum lost or
//! regained. At most [`LINES_PER_PERIOD`] lines per peer (and for the quorum) per
//! [`crate::logging::LOG_PERIOD_US`]; a change that must wait is logged when the period
//! allows, saying how many changes there were since the last line, so the last line always
//! tells the current state. Nothing is logged in the first [`REACHABLE_WINDOW`] after start
//! (peers are still connecting); then what is true is logged once (peers unreachable, the
//! quorum), a line that does not count against the limit.
//!
//! Deliberately not here: the sockets (`link.rs`, `inbound.rs`), and what raft makes of it.

use super::frame;
use super::versions::{cluster_version, Versions};
use super::PeerStats;
use crate::partition::cluster_stats::{
    is_majority, LinkState, PeerCounters, PeerReport, PeerStatus,
};
use std::net::SocketAddr;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

/// How recently something must have arrived from a peer for it to count as reachable: five of
/// the longest election timeouts (200 ms), so that a busy machine's scheduling hiccup is not a
/// lost peer, and a paused one is noticed within about a second.
pub const REACHABLE_WINDOW: Duration = Duration::from_secs(1);
/// Lines per peer (and for the quorum) per log period, at most: a loss and a recovery.
pub const LINES_PER_PERIOD: usize = 2;
/// How often the thread publishes the heard-from times when nothing else changed.
pub(crate) const PUBLISH_EVERY: Duration = Duration::from_millis(100);

/// A link's state, why (empty when connected), and since when.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct LinkStatus {
    pub(crate) state: LinkState,
    pub(crate) reason: String,
    pub(crate) since: Instant,
}

impl LinkStatus {
    /// Moves to `state` for `reason`; `since` changes only when one of them does.
    pub(crate) fn set(&mut self, state: LinkState, reason: String, now: Instant) {
        if self.state != state || self.reason != reason {
            *self = LinkStatus {
                state,
                reason,
                since: now,
            };
        }
    }
}

/// One peer as the thread last saw it.
#[derive(Clone, Debug)]
struct Seen {
    node_id: u64,
    addr: SocketAddr,
    link: LinkStatus,
    heard: Option<Instant>,
    refused_inbound: Option<String>,
    reachable: bool,
    /// The data-directory incarnation this member remembers for it, if any.
    incarnation: Option<u64>,
}

/// What the thread last published: read by the cores when they copy their figures.
#[derive(Debug, Default)]
pub(crate) struct Board {
    seen: Vec<Seen>,
    members: u64,
    incarnation: u64,
}

impl Board {
    /// The report at `now`, with the counters of `stats` and the peers' last known wire
    /// versions of `versions` (read now, in the links' order as `seen` is).
    pub(crate) fn report(
        &self,
        now: Instant,
        stats: &PeerStats,
        versions: &Versions,
    ) -> PeerReport {
        let ago = |at: Instant| now.saturating_duration_since(at).as_millis() as u64;
        let peers: Vec<PeerStatus> = (self.seen.iter().enumerate())
            .map(|(index, seen)| PeerStatus {
                node_id: seen.node_id,
                addr: seen.addr,
                link: seen.link.state,
                reason: seen.link.reason.clone(),
                for_ms: ago(seen.link.since),
                reachable: seen.reachable,
                heard_ms_ago: seen.heard.map(ago),
                refused_inbound: seen.refused_inbound.clone(),
                version: versions.of(index),
                incarnation: seen.incarnation,
            })
            .collect();
        let members = self.members.max(1);
        let reachable = 1 + peers.iter().filter(|peer| peer.reachable).count() as u64;
        let load = |counter: &std::sync::atomic::AtomicU64| counter.load(Ordering::Relaxed);
        PeerReport {
            members,
            reachable,
            quorum: is_majority(reachable, members),
            version: frame::VERSION,
            incarnation: self.incarnation,
            // From the versions shown, so that the report agrees with itself.
            cluster_version: cluster_version(peers.iter().map(|peer| peer.version)),
            peers,
            counters: PeerCounters {
                refusals: load(&stats.refusals),
                refused_by_peers: load(&stats.refused_by_peers),
                tls_refusals: load(&stats.tls_refusals),
                invalid_dropped: load(&stats.drops_invalid),
                messages_received: load(&stats.messages_received),
                messages_sent: load(&stats.messages_sent),
            },
        }
    }
}

/// A good-or-bad state, what was last logged of it, and when the last lines were written.
#[derive(Debug, Default)]
struct ChangeLog {
    current: Option<bool>,
    logged: Option<bool>,
    /// Changes since the last line.
    changes: u64,
    /// When the last lines were written; `next` is the oldest.
    lines: [Option<Instant>; LINES_PER_PERIOD],
    next: usize,
}

impl ChangeLog {
    fn observe(&mut self, good: bool) {
        if self.current != Some(good) {
            if self.current.is_some() {
                self.changes += 1;
            }
            self.current = Some(good);
        }
    }

    /// Takes the line due now, if the state differs from the last one logged and the period
    /// allows it: the state logged before (if any), and the changes since then. The first line
    /// (what is true after the start) does not count against the period.
    fn take_line(&mut self, now: Instant, period: Duration) -> Option<(Option<bool>, u64)> {
        let current = self.current?;
        if self.logged == Some(current) {
            return None;
        }
        if self.logged.is_some() {
            if self.lines[self.next].is_some_and(|at| now < at + period) {
                return None;
            }
            self.lines[self.next] = Some(now);
            self.next = (self.next + 1) % LINES_PER_PERIOD;
        }
        let before = self.logged.replace(current);
        let changes = std::mem::take(&mut self.changes);
        // Changes before the first line are the start settling, not news.
        Some((before, if before.is_some() { changes } else { 0 }))
    }

    /// Takes the current state as logged without a line.
    fn settle(&mut self) {
        self.logged = self.current;
        self.changes = 0;
    }
}

/// " (N more changes since the last such line)" when a line stands for several changes.
fn more(changes: u64) -> String {
    match changes {
        0 | 1 => String::new(),
        n => format!(" ({} more changes since the last such line)", n - 1),
    }
}

/// One peer as the thread watches it.
#[derive(Debug)]
struct Watched {
    seen: Seen,
    log: ChangeLog,
}

/// The thread's view of its peers and the quorum; see the module docs.
#[derive(Debug)]
pub(crate) struct Watch {
    started: Instant,
    period: Duration,
    peers: Vec<Watched>,
    quorum: ChangeLog,
    /// Whether this member ever had a quorum (so that a loss is "lost", not "not yet").
    had_quorum: bool,
    /// Whether the last quorum line said it was lost (so that a gain is "regained").
    said_lost: bool,
    published_at: Option<Instant>,
    /// Something changed since the last publication.
    dirty: bool,
    /// This member's data-directory incarnation.
    incarnation: u64,
}

impl Watch {
    /// Watches `peers` (in the links' order), started at `now`; lines at most
    /// [`LINES_PER_PERIOD`] per `period`.
    pub(crate) fn new(peers: &[(u64, SocketAddr)], now: Instant, period: Duration) -> Watch {
        let peers = (peers.iter())
            .map(|&(node_id, addr)| Watched {
                seen: Seen {
                    node_id,
                    addr,
                    link: LinkStatus {
                        state: LinkState::Connecting,
                        reason: String::new(),
                        since: now,
                    },
                    heard: None,
                    refused_inbound: None,
                    reachable: false,
                    incarnation: None,
                },
                log: ChangeLog::default(),
            })
            .collect();
        Watch {
            started: now,
            period,
            peers,
            quorum: ChangeLog::default(),
            had_quorum: false,
            said_lost: false,
            published_at: None,
            dirty: false,
            incarnation: 0,
        }
    }

    /// This member's data-directory incarnation, as `GET /stats` shows it.
    pub(crate) fn own_incarnation(&mut self, own: u64) {
        self.incarnation = own;
        self.dirty = true;
    }

    /// The incarnation this member remembers for each peer (`known`, by node id), as
    /// `GET /stats` shows them.
    pub(crate) fn known_incarnations(&mut self, known: impl Fn(u64) -> Option<u64>) {
        for peer in &mut self.peers {
            let remembered = known(peer.seen.node_id);
            if peer.seen.incarnation != remembered {
                peer.seen.incarnation = remembered;
                self.dirty = true;
            }
        }
    }

    /// This member refused a connection from peer `index`, for `reason`.
    pub(crate) fn refused_inbound(&mut self, index: usize, reason: &str) {
        if let Some(peer) = self.peers.get_mut(index) {
            if peer.seen.refused_inbound.as_deref() != Some(reason) {
                peer.seen.refused_inbound = Some(reason.to_string());
                self.dirty = true;
            }
        }
    }

    /// Peer `index`'s connection to this member was accepted: a refusal of an earlier one is
    /// history.
    pub(crate) fn accepted_inbound(&mut self, index: usize) {
        if let Some(peer) = self.peers.get_mut(index) {
            if peer.seen.refused_inbound.take().is_some() {
                self.dirty = true;
            }
        }
    }

    /// Writes what is known now to `board`.
    pub(crate) fn publish(&self, board: &mut Board) {
        board.members = self.peers.len() as u64 + 1;
        board.incarnation = self.incarnation;
        board.seen.clear();
        let seen = self.peers.iter().map(|peer| peer.seen.clone());
        board.seen.extend(seen);
    }

    /// When [`Watch::update`] next has something to notice: a reachable peer's window ends.
    pub(crate) fn deadline(&self) -> Option<Instant> {
        let ends = self.peers.iter().filter(|peer| peer.seen.reachable);
        ends.filter_map(|peer| peer.seen.heard)
            .map(|at| at + REACHABLE_WINDOW)
            .min()
    }

    /// Takes each link's state (`(status, accepted)`) and when something last arrived from
    /// each peer (`heard`), both in the peers' order; decides who is reachable, logs what
    /// changed, and publishes to `board`.
    pub(crate) fn update<'a>(
        &mut self,
        links: impl Iterator<Item = (&'a LinkStatus, bool)>,
        heard: &[Option<Instant>],
        now: Instant,
        board: &parking_lot::Mutex<Board>,
    ) {
        let mut changed = std::mem::take(&mut self.dirty);
        let peers = self.peers.iter_mut().zip(links).zip(heard);
        for ((peer, (link, accepted)), &heard) in peers {
            if peer.seen.link != *link {
                peer.seen.link = link.clone();
                changed = true;
            }
            peer.seen.heard = heard;
            let reachable = accepted && heard.is_some_and(|at| now < at + REACHABLE_WINDOW);
            changed |= peer.seen.reachable != reachable;
            peer.seen.reachable = reachable;
            peer.log.observe(reachable);
        }
        let members = self.peers.len() as u64 + 1;
        let reachable = 1 + self.peers.iter().filter(|p| p.seen.reachable).count() as u64;
        let quorum = is_majority(reachable, members);
        self.quorum.observe(quorum);
        self.had_quorum |= quorum;
        if now >= self.started + REACHABLE_WINDOW {
            self.log_peers(now);
            self.log_quorum(reachable, members, now);
        }
        let stale = self
            .published_at
            .map_or(true, |at| now >= at + PUBLISH_EVERY);
        if changed || stale {
            self.publish(&mut board.lock());
            self.published_at = Some(now);
        }
    }

    fn log_peers(&mut self, now: Instant) {
        for peer in &mut self.peers {
            let seen = &peer.seen;
            if peer.log.logged.is_none() && peer.log.current == Some(true) {
                peer.log.settle(); // reachable from the start: nothing to say
                continue;
            }
            let Some((before, changes)) = peer.log.take_line(now, self.period) else {
                continue;
            };
            let (id, addr) = (seen.node_id, seen.addr);
            if seen.reachable {
                let again = if before.is_some() { " again" } else { "" };
                log::info!("peer {id} ({addr}) reachable{again}{}", more(changes));
            } else {
                let why = unreachable_why(seen, now);
                log::info!("peer {id} ({addr}) unreachable: {why}{}", more(changes));
            }
        }
    }

    fn log_quorum(&mut self, reachable: u64, members: u64, now: Instant) {
        let Some((_, changes)) = self.quorum.take_line(now, self.period) else {
            return;
        };
        let need = members / 2 + 1;
        let count = format!("{reachable} of {members} members reachable");
        let more = more(changes);
        match (self.quorum.logged == Some(true), self.said_lost) {
            (true, true) => log::info!("quorum regained: {count}{more}"),
            (true, false) => log::info!("quorum reached: {count}{more}"),
            (false, _) if self.had_quorum => log::info!(
                "quorum lost: {count}, {need} needed: this member can neither lead a shard \
                 nor commit{more}"
            ),
            (false, _) => log::info!("no quorum yet: {count}, {need} needed{more}"),
        }
        self.said_lost = self.quorum.logged == Some(false) && self.had_quorum;
    }
}

/// Why a peer is not reachable, in words.
fn unreachable_why(seen: &Seen, now: Instant) -> String {
    let mut why = match seen.link.state {
        LinkState::Refused => format!("it refused this member's connection: {}", seen.link.reason),
        LinkState::Unreachable => seen.link.reason.clone(),
        LinkState::Connecting => "not connected yet".to_string(),
        LinkState::Connected => match seen.heard {
            Some(at) => format!(
                "nothing received from it for {:.1} s",
                now.saturating_duration_since(at).as_secs_f64()
            ),
            None => "nothing received from it since the start".to_string(),
        },
    };
    if let Some(reason) = &seen.refused_inbound {
        why += &format!("; this member refused its connection: {reason}");
    }
    why
}

#[cfg(test)]
mod tests {
    use super::*;

    fn status(state: LinkState, since: Instant) -> LinkStatus {
        LinkStatus {
            state,
            reason: String::new(),
            since,
        }
    }

    #[test]
    fn a_peer_is_reachable_with_an_accepted_link_and_bytes_within_the_window() {
        let start = Instant::now();
        let peers = [
            (2, "127.0.0.1:2".parse().unwrap()),
            (3, "127.0.0.1:3".parse().unwrap()),
        ];
        let mut watch = Watch::new(&peers, start, Duration::from_secs(10));
        let board = parking_lot::Mutex::new(Board::default());
        let stats = PeerStats::default();
        let versions = Versions::new(2);
        let connected = status(LinkState::Connected, start);
        let now = start + Duration::from_secs(5);
        let cases = [
            (true, Some(now - Duration::from_millis(999)), true),
            (true, Some(now - REACHABLE_WINDOW), false),
            (true, None, false),
            (false, Some(now), false),
        ];
        for (accepted, heard, reachable) in cases {
            let links = [(&connected, accepted), (&connected, false)];
            watch.update(links.into_iter(), &[heard, None], now, &board);
            let report = board.lock().report(now, &stats, &versions);
            assert_eq!(report.peers[0].reachable, reachable, "{accepted} {heard:?}");
            assert_eq!(report.reachable, 1 + u64::from(reachable));
            assert_eq!(report.quorum, reachable, "2 of 3 is a majority, 1 is not");
        }
        assert!(is_majority(2, 3) && is_majority(3, 5) && !is_majority(2, 4));
    }

    #[test]
    fn changes_are_logged_twice_a_period_at_most_and_the_last_line_is_the_current_state() {
        let period = Duration::from_secs(10);
        let base = Instant::now();
        let at = |seconds: u64| base + Duration::from_secs(seconds);
        let mut log = ChangeLog::default();
        log.observe(true);
        assert_eq!(
            log.take_line(at(1), period),
            Some((None, 0)),
            "what is true at start"
        );
        assert_eq!(log.take_line(at(1), period), None, "said once");
        log.observe(false);
        assert_eq!(log.take_line(at(2), period), Some((Some(true), 1)));
        log.observe(true);
        assert_eq!(log.take_line(at(3), period), Some((Some(false), 1)));
        log.observe(false);
        assert_eq!(
            log.take_line(at(4), period),
            None,
            "two lines in this period already"
        );
        log.observe(true);
        log.observe(false);
        assert_eq!(
            log.take_line(at(11), period),
            None,
            "the first of the two is not 10 s old"
        );
        let line = log.take_line(at(12), period);
        assert_eq!(
            line,
            Some((Some(true), 3)),
            "the current state, and the changes since"
        );
        assert_eq!(more(3), " (2 more changes since the last such line)");
        assert_eq!(more(1), "");
    }
}
