//! Admin HTTP on the lock port: `GET /metrics`, `/stats`, `/keys`, `/health` and
//! `/cluster/backup?shard=N` (and `HEAD` of each: the same answer without its body).
//!
//! `/cluster/backup` is answered by the core that hosts the shard (`shard % cores`): the serving
//! core asks it ([`AdminMsg::BackupRequest`]) and writes its whole answer as it comes.
//!
//! `/health` of a single node is answered at once (`200 serving`, `503` while shutting down);
//! a cluster member's gathers every core's figures like `/stats`, and is `503` without a
//! quorum or with a shard that has no leader ([`health`]).
//!
//! A session whose first bytes are `GET ` or `HEAD ` (no op is `G` or `H`, docs/protocol.md §5)
//! is one HTTP/1.1 request: its head is read (at most [`http::HEAD_BYTES_MAX`], within
//! [`READ_DEADLINE_US`]), answered, and the session closed like any other (its answer written
//! first). It counts
//! against `max_connections`; a core serves at most [`ADMIN_JOBS_MAX`] at once and answers
//! `503` past that, so a flood of them costs a bounded amount and never holds the lock traffic.
//!
//! # Gathering
//!
//! Each core counts for itself ([`CoreStats`], the partition's [`TableStats`]); nothing is
//! shared or locked per request. The serving core asks every other core for a copy over the
//! cross-core channels ([`AdminMsg`]) and renders once all have answered (or answers `503`
//! when they did not within [`GATHER_DEADLINE_US`]: a core stopping). `/keys` scans each
//! partition in steps of [`SCAN_SLOTS_PER_STEP`] entries per loop iteration (a partition of
//! millions of keys is never scanned in one go), keeping the first `limit` keys in key order;
//! the serving core then merges them and asks the cores that own the holders' sessions for
//! their addresses.
//!
//! [`TableStats`]: crate::partition::TableStats

pub mod health;
pub mod health_port;
pub mod http;
pub mod render;

use super::close::CloseReason;
use super::core::{core_of, slot_of, Core};
use super::net::Net;
use super::route::Msg;
use super::session::Phase;
use crate::auth::Grant;
use crate::partition::Partition;
use crate::partition::{HeldKey, SessionId};
use health::HealthFigures;
use http::{Head, Refusal, Route};
use render::{CoreStats, ServerStats};
use std::collections::{BinaryHeap, HashMap};
use std::net::SocketAddr;
use std::sync::Arc;

/// Admin requests one core serves at once (reading, gathering or answering); one more is
/// answered `503`.
pub const ADMIN_JOBS_MAX: usize = 8;
/// Time an admin session has to send its whole head, from its first byte read.
pub const READ_DEADLINE_US: u64 = 5_000_000;
/// Time the other cores have to send their figures.
pub const GATHER_DEADLINE_US: u64 = 2_000_000;
/// Entry slots one `/keys` scan looks at per loop iteration in a partition.
pub const SCAN_SLOTS_PER_STEP: u32 = 4096;

/// Cross-core messages of admin requests. `session` is the admin session (its core is the
/// one that asked and gets the answer).
#[derive(Debug)]
pub enum AdminMsg {
    /// Send your [`CoreStats`].
    StatsRequest {
        /// The asking admin session.
        session: SessionId,
    },
    /// A core's figures.
    Stats {
        /// The asking admin session.
        session: SessionId,
        /// The sender's index.
        core: usize,
        /// Its figures.
        stats: Box<CoreStats>,
    },
    /// Scan your partition for held keys starting with `prefix`.
    KeysRequest {
        /// The asking admin session.
        session: SessionId,
        /// Keys listed start with it.
        prefix: Vec<u8>,
        /// The first `limit` keys in key order are enough.
        limit: usize,
        /// With authorization rules: only keys this grant permits are listed.
        grant: Option<Arc<Grant>>,
    },
    /// A partition's first held keys with the prefix, in key order.
    Keys {
        /// The asking admin session.
        session: SessionId,
        /// At most the limit asked for.
        keys: Vec<HeldKey>,
    },
    /// Send the addresses of these sessions of yours.
    PeersRequest {
        /// The asking admin session.
        session: SessionId,
        /// Holder sessions owned by the destination.
        holders: Vec<SessionId>,
    },
    /// The addresses of the sessions still open.
    Peers {
        /// The asking admin session.
        session: SessionId,
        /// Each open session with its address.
        peers: Vec<(SessionId, SocketAddr)>,
    },
    /// Send a copy of this shard, which your partition hosts.
    BackupRequest {
        /// The asking admin session.
        session: SessionId,
        /// The shard.
        shard: u32,
    },
    /// The whole answer to a `/cluster/backup` request.
    Backup {
        /// The asking admin session.
        session: SessionId,
        /// The HTTP answer: the copy, or the refusal.
        answer: Vec<u8>,
    },
}

/// What a gathering of every core's figures answers.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Report {
    Metrics,
    Stats,
    Health,
}

/// One admin request a core serves.
pub(super) struct AdminJob {
    session: SessionId,
    deadline_us: u64,
    state: JobState,
    /// A `HEAD` request: its answer goes without the body.
    head_only: bool,
}

enum JobState {
    /// Waiting for the rest of the head.
    Reading,
    /// Waiting for the other cores' figures.
    Stats {
        report: Report,
        cores: Vec<Option<CoreStats>>,
        awaited: usize,
    },
    /// Waiting for the partitions' held keys.
    Keys {
        limit: usize,
        keys: Vec<HeldKey>,
        awaited: usize,
    },
    /// Waiting for the core that hosts a shard to send its copy (answered as it arrives).
    Backup,
    /// Waiting for the holders' addresses.
    Peers {
        keys: Vec<HeldKey>,
        peers: HashMap<SessionId, SocketAddr>,
        awaited: usize,
    },
}

/// A `/keys` scan of this core's partition, advanced a step per loop iteration.
pub(super) struct KeyScan {
    session: SessionId,
    prefix: Vec<u8>,
    limit: usize,
    grant: Option<Arc<Grant>>,
    cursor: u32,
    /// The first `limit` keys seen so far; the greatest on top.
    found: BinaryHeap<ByKey>,
}

impl KeyScan {
    fn new(
        session: SessionId,
        prefix: Vec<u8>,
        limit: usize,
        grant: Option<Arc<Grant>>,
    ) -> KeyScan {
        let found = BinaryHeap::new();
        KeyScan {
            session,
            prefix,
            limit,
            grant,
            cursor: 0,
            found,
        }
    }
}

/// A held key ordered by its key alone.
struct ByKey(HeldKey);

impl PartialEq for ByKey {
    fn eq(&self, other: &ByKey) -> bool {
        self.0.key == other.0.key
    }
}

impl Eq for ByKey {}

impl PartialOrd for ByKey {
    fn partial_cmp(&self, other: &ByKey) -> Option<std::cmp::Ordering> {
        Some(self.cmp(other))
    }
}

impl Ord for ByKey {
    fn cmp(&self, other: &ByKey) -> std::cmp::Ordering {
        self.0.key.cmp(&other.0.key)
    }
}

/// Keeps the first `limit` keys of `keys` in key order.
fn keep_first(keys: &mut Vec<HeldKey>, limit: usize) {
    keys.sort_unstable_by(|a, b| a.key.cmp(&b.key));
    keys.truncate(limit);
}

impl<N: Net, P: Partition> Core<N, P> {
    /// Serves the admin request of the session in `slot`, if it is one: `None` when the session
    /// speaks the lock protocol. `Some(true)` when it waits for more of its head.
    pub(super) fn admin_read(&mut self, slot: usize) -> Option<bool> {
        let session = &self.sessions[slot];
        if !session.is_admin() && !session.is_fresh() {
            return None;
        }
        let head = http::parse_head(session.unparsed(&self.buffers));
        match head {
            Head::NotHttp => return None,
            Head::Prefix => return Some(true),
            _ => {}
        }
        let id = session.id();
        // An admin session has its job until it is answered, and is not read after that.
        if !session.is_admin() {
            if self.admin_jobs.len() >= ADMIN_JOBS_MAX {
                self.refuse_admin(slot, Refusal::UNAVAILABLE);
                return Some(false);
            }
            let head_only = http::is_head_only(self.sessions[slot].unparsed(&self.buffers));
            self.sessions[slot].set_admin();
            self.admin_jobs.push(AdminJob {
                session: id,
                deadline_us: self.now_us + READ_DEADLINE_US,
                state: JobState::Reading,
                head_only,
            });
        }
        match head {
            Head::NotHttp | Head::Prefix => unreachable!("returned above"),
            Head::Incomplete => return Some(true),
            Head::Complete(Err(refusal)) => self.refuse_admin(slot, refusal),
            Head::Complete(Ok(route)) => {
                self.sessions[slot].discard_input(&mut self.buffers);
                match self.admin_grant(slot, &route) {
                    Ok(grant) => self.start_admin(id, route, grant),
                    Err(refusal) => self.refuse_admin(slot, refusal),
                }
            }
        }
        Some(false)
    }

    /// With authorization rules, what the admin session in `slot` may see: every request but
    /// `/health` and `/cluster` needs an identity some rule names (403 otherwise), and `/keys`
    /// lists only the keys its grant permits. `None`: no rules, `/health` or `/cluster`.
    fn admin_grant(&mut self, slot: usize, route: &Route) -> Result<Option<Arc<Grant>>, Refusal> {
        let Some(rules) = &self.links.auth else {
            return Ok(None);
        };
        if matches!(route, Route::Health | Route::Cluster) {
            return Ok(None);
        }
        let grant = self.sessions[slot].grant(rules);
        match grant.is_known() {
            true => Ok(Some(Arc::clone(grant))),
            false => Err(Refusal::FORBIDDEN),
        }
    }

    /// Answers an admin session's request with `refusal` and ends the session.
    fn refuse_admin(&mut self, slot: usize, refusal: Refusal) {
        let peer = self.sessions[slot].peer();
        log::debug!(
            "admin request from {peer:?} refused: {} {}",
            refusal.status,
            refusal.reason
        );
        let id = self.sessions[slot].id();
        self.answer_admin(id, http::refusal_response(refusal));
    }

    /// Writes `answer` to admin session `id` (if still open) and ends its job and session.
    fn answer_admin(&mut self, id: SessionId, answer: Vec<u8>) {
        let job = self.admin_jobs.iter().find(|job| job.session == id);
        let job_head_only = job.map(|job| job.head_only);
        self.admin_jobs.retain(|job| job.session != id);
        let slot = slot_of(id);
        let Some(session) = self.sessions.get_mut(slot).filter(|s| s.id() == id) else {
            return;
        };
        if session.phase() != Phase::Open {
            return;
        }
        // A request refused before it had a job (too many at once) is still unread.
        let head_only =
            job_head_only.unwrap_or_else(|| http::is_head_only(session.unparsed(&self.buffers)));
        let answer = match head_only {
            true => http::without_body(answer),
            false => answer,
        };
        session.discard_input(&mut self.buffers);
        session.push_raw(&answer);
        self.mark_dirty(slot);
        self.begin_close(slot, Phase::Draining, CloseReason::Admin);
    }

    fn start_admin(&mut self, id: SessionId, route: Route, grant: Option<Arc<Grant>>) {
        let cores = self.settings.cores;
        let others: Vec<usize> = (0..cores).filter(|&c| c != self.settings.index).collect();
        let state = match route {
            Route::Health if self.table.cluster_stats().is_none() => {
                let health = health::decide(self.stop_deadline.is_some(), None);
                return self.answer_health(id, &health);
            }
            Route::Health => self.gather_stats(id, Report::Health, &others),
            Route::Cluster => {
                let text = "text/plain; charset=utf-8";
                let answer = http::response(200, text, self.links.shared.card.as_bytes());
                return self.answer_admin(id, answer);
            }
            Route::Metrics => self.gather_stats(id, Report::Metrics, &others),
            Route::Stats => self.gather_stats(id, Report::Stats, &others),
            Route::ClusterBackup { shard } => {
                let core = shard as usize % cores;
                if core == self.settings.index {
                    return self.answer_admin(id, self.backup_answer(shard));
                }
                self.send_admin(core, AdminMsg::BackupRequest { session: id, shard });
                JobState::Backup
            }
            Route::Keys { prefix, limit } => {
                for &core in &others {
                    let request = AdminMsg::KeysRequest {
                        session: id,
                        prefix: prefix.clone(),
                        limit,
                        grant: grant.clone(),
                    };
                    self.send_admin(core, request);
                }
                self.key_scans.push(KeyScan::new(id, prefix, limit, grant));
                JobState::Keys {
                    limit,
                    keys: Vec::new(),
                    awaited: cores,
                }
            }
        };
        if let Some(job) = self.admin_jobs.iter_mut().find(|job| job.session == id) {
            job.state = state;
            job.deadline_us = self.now_us + GATHER_DEADLINE_US;
        }
        self.finish_admin(id);
    }

    /// The answer to `/cluster/backup?shard=N` from this core's partition: the copy, or why
    /// not (`crate::cluster::backup::BackupRefusal`).
    fn backup_answer(&self, shard: u32) -> Vec<u8> {
        match self.table.backup_shard(shard) {
            Ok(copy) => http::response(200, "application/octet-stream", &copy),
            Err(refusal) => {
                let body = format!("{refusal}\n");
                http::response(
                    refusal.status(),
                    "text/plain; charset=utf-8",
                    body.as_bytes(),
                )
            }
        }
    }

    /// Asks the `others` cores for their figures, for `report`.
    fn gather_stats(&mut self, id: SessionId, report: Report, others: &[usize]) -> JobState {
        let mut cores = vec![None; self.settings.cores];
        cores[self.settings.index] = Some(self.core_stats());
        for &core in others {
            self.send_admin(core, AdminMsg::StatsRequest { session: id });
        }
        JobState::Stats {
            report,
            cores,
            awaited: others.len(),
        }
    }

    fn answer_health(&mut self, id: SessionId, health: &health::Health) {
        let text = "text/plain; charset=utf-8";
        let answer = http::response(health.status, text, health.body.as_bytes());
        self.answer_admin(id, answer);
    }

    fn send_admin(&mut self, core: usize, msg: AdminMsg) {
        if let Some(outbox) = self.links.outboxes[core].as_mut() {
            outbox.push(Msg::Admin(Box::new(msg)));
        }
    }

    /// This core's figures now.
    pub(super) fn core_stats(&self) -> CoreStats {
        CoreStats {
            table: self.table.stats().clone(),
            sessions: self.sessions.len() as u64,
            sessions_refused: self.counters.sessions_refused,
            acquires_rejected: self.counters.acquires_rejected,
            requests_forbidden: self.counters.requests_forbidden,
            tls_failures: self.counters.tls_failures,
            locks_held: self.table.key_count() as u64,
            waiters: self.table.waiter_count() as u64,
            cluster: self.table.cluster_stats(),
        }
    }

    /// A message of another core's admin request, or an answer to one of ours.
    pub(super) fn handle_admin_msg(&mut self, msg: AdminMsg) {
        match msg {
            AdminMsg::StatsRequest { session } => {
                let stats = Box::new(self.core_stats());
                let core = self.settings.index;
                self.send_admin(
                    core_of(session),
                    AdminMsg::Stats {
                        session,
                        core,
                        stats,
                    },
                );
            }
            AdminMsg::KeysRequest {
                session,
                prefix,
                limit,
                grant,
            } => {
                let scan = KeyScan::new(session, prefix, limit, grant);
                self.key_scans.push(scan);
            }
            AdminMsg::PeersRequest { session, holders } => {
                let peers = holders
                    .into_iter()
                    .filter_map(|holder| {
                        let open = self
                            .sessions
                            .get(slot_of(holder))
                            .filter(|s| s.id() == holder && s.phase() == Phase::Open)?;
                        Some((holder, open.peer()?))
                    })
                    .collect();
                self.send_admin(core_of(session), AdminMsg::Peers { session, peers });
            }
            AdminMsg::Stats {
                session,
                core,
                stats,
            } => self.gathered_stats(session, core, *stats),
            AdminMsg::BackupRequest { session, shard } => {
                let answer = self.backup_answer(shard);
                self.send_admin(core_of(session), AdminMsg::Backup { session, answer });
            }
            AdminMsg::Backup { session, answer } => {
                if let Some(JobState::Backup) = self.job_state(session) {
                    self.answer_admin(session, answer);
                }
            }
            AdminMsg::Keys { session, keys } => self.gathered_keys(session, keys),
            AdminMsg::Peers { session, peers } => self.gathered_peers(session, peers),
        }
    }

    fn job_state(&mut self, id: SessionId) -> Option<&mut JobState> {
        let job = self.admin_jobs.iter_mut().find(|job| job.session == id)?;
        Some(&mut job.state)
    }

    fn gathered_stats(&mut self, id: SessionId, core: usize, stats: CoreStats) {
        if let Some(JobState::Stats { cores, awaited, .. }) = self.job_state(id) {
            cores[core] = Some(stats);
            *awaited = awaited.saturating_sub(1);
        }
        self.finish_admin(id);
    }

    fn gathered_keys(&mut self, id: SessionId, mut found: Vec<HeldKey>) {
        if let Some(JobState::Keys {
            keys,
            awaited,
            limit,
        }) = self.job_state(id)
        {
            keys.append(&mut found);
            keep_first(keys, *limit);
            *awaited = awaited.saturating_sub(1);
        }
        self.finish_admin(id);
    }

    fn gathered_peers(&mut self, id: SessionId, found: Vec<(SessionId, SocketAddr)>) {
        if let Some(JobState::Peers { peers, awaited, .. }) = self.job_state(id) {
            peers.extend(found);
            *awaited = awaited.saturating_sub(1);
        }
        self.finish_admin(id);
    }

    /// Moves admin job `id` on once nothing is awaited: asks for peers, or answers.
    fn finish_admin(&mut self, id: SessionId) {
        let Some(position) = self.admin_jobs.iter().position(|job| job.session == id) else {
            return;
        };
        let done = match &self.admin_jobs[position].state {
            JobState::Reading | JobState::Backup => false,
            JobState::Stats { awaited, .. }
            | JobState::Keys { awaited, .. }
            | JobState::Peers { awaited, .. } => *awaited == 0,
        };
        if !done {
            return;
        }
        let state = std::mem::replace(&mut self.admin_jobs[position].state, JobState::Reading);
        match state {
            JobState::Reading | JobState::Backup => {}
            JobState::Stats { report, cores, .. } => {
                // Every core answered once `awaited` is 0; should one be missing, say so.
                let Some(cores) = cores.into_iter().collect::<Option<Vec<CoreStats>>>() else {
                    let missing = Refusal {
                        status: 503,
                        reason: "a core's figures are missing",
                    };
                    return self.answer_admin(id, http::refusal_response(missing));
                };
                let stats = self.server_stats(cores);
                let answer = match report {
                    Report::Metrics => http::response(
                        200,
                        "application/openmetrics-text; version=1.0.0; charset=utf-8",
                        render::metrics_text(&stats).as_bytes(),
                    ),
                    Report::Stats => http::response(
                        200,
                        "application/json",
                        render::stats_json(&stats).as_bytes(),
                    ),
                    Report::Health => {
                        let total = stats.total();
                        let health = health::decide(stats.shutting_down, total.cluster.as_ref());
                        return self.answer_health(id, &health);
                    }
                };
                self.answer_admin(id, answer);
            }
            JobState::Keys { keys, .. } => self.ask_peers(position, id, keys),
            JobState::Peers { keys, peers, .. } => {
                let listed: Vec<(HeldKey, Option<SocketAddr>)> = keys
                    .into_iter()
                    .map(|held| {
                        let peer = peers.get(&held.holder).copied();
                        (held, peer)
                    })
                    .collect();
                let body = render::keys_json(&listed);
                self.answer_admin(id, http::response(200, "application/json", body.as_bytes()));
            }
        }
    }

    /// Resolves the holders' addresses: this core's sessions here, others' by message.
    fn ask_peers(&mut self, position: usize, id: SessionId, keys: Vec<HeldKey>) {
        let mut peers = HashMap::new();
        let mut asks: Vec<Vec<SessionId>> = vec![Vec::new(); self.settings.cores];
        for held in &keys {
            let core = core_of(held.holder);
            if core == self.settings.index {
                let open = self
                    .sessions
                    .get(slot_of(held.holder))
                    .filter(|s| s.id() == held.holder && s.phase() == Phase::Open);
                if let Some(peer) = open.and_then(|session| session.peer()) {
                    peers.insert(held.holder, peer);
                }
            } else if core < asks.len() && !asks[core].contains(&held.holder) {
                asks[core].push(held.holder);
            }
        }
        let mut awaited = 0;
        for (core, holders) in asks.into_iter().enumerate() {
            if !holders.is_empty() {
                awaited += 1;
                self.send_admin(
                    core,
                    AdminMsg::PeersRequest {
                        session: id,
                        holders,
                    },
                );
            }
        }
        self.admin_jobs[position].state = JobState::Peers {
            keys,
            peers,
            awaited,
        };
        self.finish_admin(id);
    }

    fn server_stats(&self, cores: Vec<CoreStats>) -> ServerStats {
        let shared = &self.links.shared;
        ServerStats {
            cores,
            loops: shared
                .loop_gauges
                .iter()
                .map(|gauge| gauge.snapshot())
                .collect(),
            uptime_us: self.now_us,
            limits: shared.limits.clone(),
            shutting_down: self.stop_deadline.is_some(),
            clients: shared.clients.counts(),
        }
    }

    /// Advances the oldest `/keys` scan of this partition by one bounded step (the others
    /// wait their turn); a finished scan sends its keys to the asking core.
    pub(super) fn advance_scans(&mut self) {
        if self.key_scans.is_empty() {
            return;
        }
        let scan = &mut self.key_scans[0];
        let (found, limit, grant) = (&mut scan.found, scan.limit, &scan.grant);
        let mut keep = |held: HeldKey| {
            if grant
                .as_ref()
                .is_some_and(|grant| !grant.permits(&held.key))
            {
                return;
            }
            let full = found.len() >= limit;
            if full && found.peek().is_some_and(|last| last.0.key <= held.key) {
                return;
            }
            found.push(ByKey(held));
            if full {
                found.pop();
            }
        };
        let next = self.table.scan_held(
            self.now_us,
            scan.cursor,
            SCAN_SLOTS_PER_STEP,
            &scan.prefix,
            &mut keep,
        );
        match next {
            Some(cursor) => scan.cursor = cursor,
            None => {
                let scan = self.key_scans.remove(0);
                let keys: Vec<HeldKey> = scan
                    .found
                    .into_sorted_vec()
                    .into_iter()
                    .map(|k| k.0)
                    .collect();
                let session = scan.session;
                match core_of(session) == self.settings.index {
                    true => self.gathered_keys(session, keys),
                    false => self.send_admin(core_of(session), AdminMsg::Keys { session, keys }),
                }
            }
        }
    }

    /// Answers the admin jobs whose deadline passed: `408` while reading, `503` while
    /// gathering (a core did not answer in time).
    pub(super) fn expire_admin_jobs(&mut self) {
        if self.admin_jobs.is_empty() {
            return;
        }
        let sessions = &self.sessions;
        // A session that ended (reset, end of input) while its head was incomplete.
        self.admin_jobs.retain(|job| {
            let session = sessions
                .get(slot_of(job.session))
                .filter(|s| s.id() == job.session);
            session.is_some_and(|session| session.phase() == Phase::Open)
        });
        let now_us = self.now_us;
        let expired: Vec<(SessionId, bool)> = self
            .admin_jobs
            .iter()
            .filter(|job| job.deadline_us <= now_us)
            .map(|job| (job.session, matches!(job.state, JobState::Reading)))
            .collect();
        for (id, reading) in expired {
            let refusal = match reading {
                true => Refusal::TIMEOUT,
                false => Refusal {
                    status: 503,
                    reason: "the cores' figures did not come in time",
                },
            };
            self.answer_admin(id, http::refusal_response(refusal));
        }
    }

    /// The earliest admin deadline, for the poll timeout.
    pub(super) fn admin_wake_us(&self) -> Option<u64> {
        let health = self.links.shared.health.as_ref();
        let publish = health.map(|_| self.health_publish_us);
        let jobs = self.admin_jobs.iter().map(|job| job.deadline_us);
        jobs.chain(publish).min()
    }

    /// With a health port (`server.health_listen`), publishes this core's figures for it every
    /// [`HEALTH_PUBLISH_US`](health_port::HEALTH_PUBLISH_US) (the core wakes for it, see
    /// [`admin_wake_us`](Self::admin_wake_us)).
    pub(super) fn publish_health(&mut self) {
        let Some(board) = self.links.shared.health.as_ref() else {
            return;
        };
        if self.now_us < self.health_publish_us {
            return;
        }
        self.health_publish_us = self.now_us + health_port::HEALTH_PUBLISH_US;
        let cluster = self.table.cluster_stats();
        board.publish(self.settings.index, cluster.as_ref().map(HealthFigures::of));
    }

    /// Whether admin work is in progress (the core is not quiescent then).
    pub(super) fn admin_busy(&self) -> bool {
        !self.admin_jobs.is_empty() || !self.key_scans.is_empty()
    }
}

#[cfg(test)]
mod tests;
