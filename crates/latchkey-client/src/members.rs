//! The members a client talks to: one session [`Pool`] per member address, and the leader
//! cache that cluster redirects (`M`, docs/protocol.md §5) fill.
//!
//! A keyed call goes to the cached leader of its key, else to the last leader any `M` named,
//! else to the configured members in turn. The configured addresses get their pools when the
//! client is built (the first one connects at once, the others on first use); a leader an `M`
//! names that is not among them gets a pool on first use too, over the same TLS connector.
//!
//! Bounds: at most [`MEMBERS_MAX`] addresses (configured and learned); at most
//! [`LEADER_CACHE_MAX`] cached keys — when full, a new key clears the whole cache (a stale or
//! missing entry costs one redirect, never correctness: an `M` executed nothing).
//!
//! Single node: with one configured address and no `M` ever received, routing is one relaxed
//! atomic load and the first pool; the cache is never touched.
//!
//! Several addresses: each is asked for its card (`GET /cluster`, `card.rs`) when the client
//! is built, one thread per address, and a call uses an address only once `check.rs` accepted
//! the list and it (a call that finds answers still due waits for them, within its deadline).
//!
//! Invariants: a pool's address appears once; the cache names only addresses some `M` named.
//! Deliberately not here: what a call does with an `M` (see `exchange.rs`).

use std::collections::HashMap;
use std::io;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use parking_lot::{Condvar, Mutex, RwLock};

use super::call::Call;
use super::card;
use super::check::{Check, Verdict};
use super::error::SessionFailure;
use super::pool::Pool;
use super::report::UnavailableReport;
use super::session::{FailureLog, SessionConfig};

/// The most member addresses a client keeps sessions to, configured and learned from `M`.
pub const MEMBERS_MAX: usize = 16;
/// The most keys whose leader a client remembers; a new key past it clears the cache.
pub const LEADER_CACHE_MAX: usize = 65_536;

/// Where a keyed request goes, and the pools that reach each member.
pub(crate) struct Members {
    /// The configured addresses, in order, without duplicates (at least one).
    configured: Vec<SocketAddr>,
    /// The pool of `configured[0]`, outside the lock for the single-node path.
    first: Arc<Pool>,
    /// Every member's pool, configured first; at most [`MEMBERS_MAX`].
    pools: RwLock<Vec<(SocketAddr, Arc<Pool>)>>,
    /// Whether routing needs the cache: more than one configured member, or an `M` was seen.
    routed: AtomicBool,
    leaders: Mutex<Leaders>,
    next_member: AtomicUsize,
    sessions: usize,
    session_config: SessionConfig,
    session_ids: Arc<AtomicU64>,
    failures: FailureLog,
    /// What the members did for the latest call that ended unavailable.
    unavailable: Mutex<Option<UnavailableReport>>,
    /// With more than one configured address: which addresses are members of one cluster.
    check: Option<Arc<Asker>>,
}

/// Why a call may not send to an address (see [`Members::usable`]).
#[derive(Debug)]
pub(crate) struct Unusable {
    /// In words.
    pub cause: String,
    /// Nothing listens there (its connection was refused).
    pub refused: bool,
}

/// The check of a client's addresses, and the threads that ask for their cards.
struct Asker {
    check: Mutex<Check>,
    /// Signalled when an ask ends.
    answered: Condvar,
    tls: Option<crate::tls::Connector>,
    /// How long one ask may take.
    timeout: Duration,
    /// Bit `i` set: the `i`-th configured address is accepted now ([`Check::accepted_mask`]),
    /// so that a call to it takes no lock.
    accepted: AtomicU32,
}

impl Asker {
    /// A check of `configured` (distinct, more than one), each asked for its card now.
    fn start(
        configured: &[SocketAddr],
        tls: Option<crate::tls::Connector>,
        timeout: Duration,
    ) -> Arc<Asker> {
        let asker = Arc::new(Asker {
            check: Mutex::new(Check::new(configured)),
            answered: Condvar::new(),
            tls,
            timeout,
            accepted: AtomicU32::new(0),
        });
        let mut check = asker.check.lock();
        for &addr in configured {
            asker.ask(&mut check, addr);
        }
        drop(check);
        asker
    }

    /// The addresses refused, and why, once every address being asked has answered or `wait`
    /// has passed.
    fn refused(&self, wait: Duration) -> Vec<(SocketAddr, String)> {
        let deadline = Instant::now() + wait;
        let mut check = self.check.lock();
        while !check.settled() && !self.answered.wait_until(&mut check, deadline).timed_out() {}
        let refused = check.refused().into_iter();
        refused.map(|(addr, why)| (addr, why.to_string())).collect()
    }

    /// Starts asking `addr` for its card (the caller holds `check`).
    fn ask(self: &Arc<Self>, check: &mut Check, addr: SocketAddr) {
        check.asking(addr);
        let asker = Arc::clone(self);
        let spawned = std::thread::Builder::new()
            .name("latchkey-card".to_string())
            .spawn(move || {
                let deadline = Instant::now() + asker.timeout;
                let answer = card::fetch(addr, asker.tls.as_ref(), deadline);
                let mut check = asker.check.lock();
                check.answered(addr, answer);
                asker
                    .accepted
                    .store(check.accepted_mask(), Ordering::Release);
                drop(check);
                asker.answered.notify_all();
            });
        if let Err(error) = spawned {
            let cause = format!("cannot start a thread to ask it: {error}");
            check.answered(addr, Err(card::FetchError::Unreachable(cause)));
            self.accepted
                .store(check.accepted_mask(), Ordering::Release);
        }
    }
}

/// The leader cache.
#[derive(Default)]
struct Leaders {
    /// Key → the leader the latest `M` for it named; at most [`LEADER_CACHE_MAX`] entries.
    by_key: HashMap<Arc<str>, SocketAddr>,
    /// The leader the latest `M` named, for keys not in `by_key`.
    last: Option<SocketAddr>,
}

/// `addrs` without repeats, in their order.
fn distinct(addrs: &[SocketAddr]) -> Vec<SocketAddr> {
    let mut distinct: Vec<SocketAddr> = Vec::with_capacity(addrs.len());
    for addr in addrs {
        if !distinct.contains(addr) {
            distinct.push(*addr);
        }
    }
    distinct
}

/// For a tool given a list of addresses that sends through no [`crate::Client`] (the bench):
/// the addresses a client with that list would never send to, and what each is (see
/// `check.rs`), once each was asked for its card or `wait` passed; empty for one address (or
/// one repeated) and for one cluster's members.
pub fn refused_list(
    addrs: &[SocketAddr],
    tls: Option<crate::tls::Connector>,
    wait: Duration,
) -> Vec<(SocketAddr, String)> {
    let configured = distinct(addrs);
    if configured.len() < 2 {
        return Vec::new();
    }
    Asker::start(&configured, tls, wait).refused(wait)
}

impl Members {
    /// Pools for `addrs` (deduplicated; 1..=[`MEMBERS_MAX`] of them), `sessions` each; the
    /// first address's sessions start connecting now. With `check` and more than one address,
    /// each is asked for its card now (see `check.rs`).
    pub(crate) fn start(
        addrs: &[SocketAddr],
        check: bool,
        sessions: usize,
        session_config: SessionConfig,
    ) -> io::Result<Members> {
        let configured = distinct(addrs);
        if configured.len() > MEMBERS_MAX {
            let message = format!("a client takes at most {MEMBERS_MAX} server addresses");
            return Err(io::Error::new(io::ErrorKind::InvalidInput, message));
        }
        let Some(&first_addr) = configured.first() else {
            let message = "a client needs at least one address and one session";
            return Err(io::Error::new(io::ErrorKind::InvalidInput, message));
        };
        let session_ids = Arc::new(AtomicU64::new(1));
        let failures = FailureLog::default();
        let new_pool = |addr, eager| {
            let (ids, failures) = (Arc::clone(&session_ids), Arc::clone(&failures));
            Pool::start(addr, sessions, session_config.clone(), ids, failures, eager)
        };
        let check = (check && configured.len() > 1).then(|| {
            let tls = session_config.tls.clone();
            Asker::start(&configured, tls, session_config.connect_timeout)
        });
        let first = new_pool(first_addr, true)?;
        let mut pools = vec![(first_addr, Arc::clone(&first))];
        for &addr in &configured[1..] {
            pools.push((addr, new_pool(addr, false)?));
        }
        Ok(Members {
            routed: AtomicBool::new(configured.len() > 1),
            configured,
            first,
            pools: RwLock::new(pools),
            leaders: Mutex::new(Leaders::default()),
            next_member: AtomicUsize::new(0),
            sessions,
            session_config,
            session_ids,
            failures,
            unavailable: Mutex::new(None),
            check,
        })
    }

    /// Whether a call may send to `addr`: always with one configured address; else once
    /// `check.rs` accepts it, asking what it needs (again) and waiting for the answers until
    /// `deadline`. The error says why not.
    pub(crate) fn usable(&self, addr: SocketAddr, deadline: Instant) -> Result<(), Unusable> {
        let Some(asker) = &self.check else {
            return Ok(());
        };
        if self.accepted_now(asker, addr) {
            return Ok(());
        }
        let mut check = asker.check.lock();
        let mut asked = false;
        loop {
            match check.verdict(addr) {
                Verdict::Accepted => return Ok(()),
                Verdict::Refused(why) => {
                    let cause = format!("not used: {why}");
                    return Err(Unusable {
                        cause,
                        refused: false,
                    });
                }
                Verdict::Unsettled { ask, .. } if !asked && !ask.is_empty() => {
                    asked = true;
                    for addr in ask {
                        asker.ask(&mut check, addr);
                    }
                }
                Verdict::Unsettled {
                    waiting: true, why, ..
                } => {
                    if asker.answered.wait_until(&mut check, deadline).timed_out() {
                        let cause = why.to_string();
                        return Err(Unusable {
                            cause,
                            refused: false,
                        });
                    }
                }
                Verdict::Unsettled { why, refused, .. } => {
                    let cause = why.to_string();
                    return Err(Unusable { cause, refused });
                }
            }
        }
    }

    /// The addresses refused as not members of this client's cluster, and why, once every
    /// address being asked has answered or `wait` has passed; empty for one address.
    pub(crate) fn refused(&self, wait: Duration) -> Vec<(SocketAddr, String)> {
        match &self.check {
            Some(asker) => asker.refused(wait),
            None => Vec::new(),
        }
    }

    /// Whether this client has one member and never saw an `M`: routing skips the cache.
    pub(crate) fn single(&self) -> bool {
        !self.routed.load(Ordering::Relaxed)
    }

    /// Where a request on `key` goes first: its cached leader, else the last leader seen,
    /// else the next configured member in turn.
    pub(crate) fn route(&self, key: Option<&str>) -> SocketAddr {
        if self.single() {
            return self.configured[0];
        }
        {
            let leaders = self.leaders.lock();
            let cached = key.and_then(|key| leaders.by_key.get(key).copied());
            if let Some(addr) = cached.or(leaders.last) {
                return addr;
            }
        }
        self.next_member_except(None)
    }

    /// The next configured member in turn, other than `except` when another exists.
    pub(crate) fn next_member_except(&self, except: Option<SocketAddr>) -> SocketAddr {
        let count = self.configured.len();
        let mut addr = self.configured[0];
        for _ in 0..count {
            addr = self.configured[self.next_member.fetch_add(1, Ordering::Relaxed) % count];
            if Some(addr) != except {
                break;
            }
        }
        addr
    }

    /// The pool of `addr`, starting one (lazily connecting) for a learned member; `None` when
    /// [`MEMBERS_MAX`] members already have pools.
    pub(crate) fn pool(&self, addr: SocketAddr) -> io::Result<Option<Arc<Pool>>> {
        if addr == self.configured[0] {
            return Ok(Some(Arc::clone(&self.first)));
        }
        if let Some((_, pool)) = self.pools.read().iter().find(|(a, _)| *a == addr) {
            return Ok(Some(Arc::clone(pool)));
        }
        let mut pools = self.pools.write();
        if let Some((_, pool)) = pools.iter().find(|(a, _)| *a == addr) {
            return Ok(Some(Arc::clone(pool)));
        }
        if pools.len() >= MEMBERS_MAX {
            log::warn!("{addr} named as a leader, but {MEMBERS_MAX} members are known already");
            return Ok(None);
        }
        let (ids, failures) = (Arc::clone(&self.session_ids), Arc::clone(&self.failures));
        let config = self.session_config.clone();
        let pool = Pool::start(addr, self.sessions, config, ids, failures, false)?;
        pools.push((addr, Arc::clone(&pool)));
        Ok(Some(pool))
    }

    /// An `M` named `leader` for `key`: remember it for the key and as the last leader.
    pub(crate) fn learn(&self, key: Option<&Arc<str>>, leader: SocketAddr) {
        self.routed.store(true, Ordering::Relaxed);
        let mut leaders = self.leaders.lock();
        leaders.last = Some(leader);
        let Some(key) = key else { return };
        if leaders.by_key.len() >= LEADER_CACHE_MAX && !leaders.by_key.contains_key(&**key) {
            log::debug!("leader cache full ({LEADER_CACHE_MAX} keys): cleared");
            leaders.by_key.clear();
        }
        leaders.by_key.insert(Arc::clone(key), leader);
        debug_assert!(leaders.by_key.len() <= LEADER_CACHE_MAX);
    }

    /// `addr` executed a request on `key` (an answer other than `M` or `X`): it leads the key.
    /// Nothing to do for a client of one member, or when `addr` is already its route.
    pub(crate) fn confirm(&self, key: Option<&Arc<str>>, addr: SocketAddr) {
        if self.single() {
            return;
        }
        let Some(key) = key else { return };
        if self.leaders.lock().by_key.get(&**key) == Some(&addr) {
            return;
        }
        self.learn(Some(key), addr);
    }

    /// A session to `addr` failed before sending a request on `key`: stop sending that key,
    /// and keys without their own entry, there first.
    pub(crate) fn forget(&self, key: Option<&str>, addr: SocketAddr) {
        if self.single() {
            return;
        }
        let mut leaders = self.leaders.lock();
        if let Some(key) = key {
            if leaders.by_key.get(key) == Some(&addr) {
                leaders.by_key.remove(key);
            }
        }
        if leaders.last == Some(addr) {
            leaders.last = None;
        }
    }

    /// Wakes every session of every member (to see `SessionConfig::interrupted`).
    pub(crate) fn wake_all(&self) {
        for (_, pool) in self.pools.read().iter() {
            pool.wake_all();
        }
    }

    /// Hands a fire-and-forget call (a background release) to its key's route.
    /// Dropped when its route is an address not accepted (yet): the lease recovers the hold.
    pub(crate) fn submit_background(&self, call: Call) {
        let addr = self.route(call.op.key().map(|key| &**key));
        if !self.accepted(addr) {
            log::debug!("background {:?} dropped: {addr} is not accepted", call.op);
            return;
        }
        match self.pool(addr) {
            Ok(Some(pool)) => pool.submit_background(call),
            _ if self.accepted(self.configured[0]) => self.first.submit_background(call),
            _ => log::debug!("background {:?} dropped: no accepted member", call.op),
        }
    }

    /// Whether `addr` is a configured address accepted now: one atomic load, no lock.
    fn accepted_now(&self, asker: &Asker, addr: SocketAddr) -> bool {
        let mask = asker.accepted.load(Ordering::Acquire);
        (self.configured.iter().position(|&a| a == addr)).is_some_and(|i| mask & (1 << i) != 0)
    }

    /// Whether `addr` may be sent to now, without asking or waiting (see [`Members::usable`]).
    fn accepted(&self, addr: SocketAddr) -> bool {
        let Some(asker) = &self.check else {
            return true;
        };
        if self.accepted_now(asker, addr) {
            return true;
        }
        let verdict = asker.check.lock().verdict(addr);
        matches!(verdict, Verdict::Accepted)
    }

    /// Why the latest session that failed did, if one did.
    pub(crate) fn last_failure(&self) -> Option<SessionFailure> {
        self.failures.lock().latest().cloned()
    }

    /// Why the latest session to `addr` that failed did, if one did.
    pub(crate) fn failure_of(&self, addr: SocketAddr) -> Option<SessionFailure> {
        self.failures.lock().of(addr).cloned()
    }

    /// The number of configured (distinct) addresses.
    pub(crate) fn listed(&self) -> usize {
        self.configured.len()
    }

    /// Whether `addr` is one of the configured addresses.
    pub(crate) fn is_listed(&self, addr: SocketAddr) -> bool {
        self.configured.contains(&addr)
    }

    /// Keeps `report` as the latest call's that ended unavailable.
    pub(crate) fn note_unavailable(&self, report: UnavailableReport) {
        *self.unavailable.lock() = Some(report);
    }

    /// The report of the latest call that ended unavailable.
    pub(crate) fn last_unavailable(&self) -> Option<UnavailableReport> {
        self.unavailable.lock().clone()
    }

    /// The number of cached keys (for tests).
    #[cfg(test)]
    pub(crate) fn cached_keys(&self) -> usize {
        self.leaders.lock().by_key.len()
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;

    fn members(addrs: &[SocketAddr]) -> Members {
        let config = SessionConfig {
            connect_timeout: Duration::from_millis(100),
            transport_timeout: Duration::from_millis(100),
            inbox_calls_max: 4,
            tls: None,
            identity: None,
            resumes: Default::default(),
            interrupted: Default::default(),
        };
        Members::start(addrs, true, 1, config).expect("members")
    }

    fn addr(port: u16) -> SocketAddr {
        SocketAddr::from(([127, 0, 0, 1], port))
    }

    #[test]
    fn one_address_routes_there_until_an_m_arrives() {
        let members = members(&[addr(1), addr(1)]);
        assert!(members.single());
        assert_eq!(members.route(Some("k")), addr(1));
        members.learn(Some(&Arc::from("k")), addr(2));
        assert!(!members.single());
        assert_eq!(members.route(Some("k")), addr(2));
        assert_eq!(
            members.route(Some("other")),
            addr(2),
            "the last leader seen"
        );
        members.forget(Some("k"), addr(2));
        assert_eq!(members.route(Some("k")), addr(1), "the members in turn");
    }

    #[test]
    fn the_leader_cache_is_cleared_when_full() {
        let members = members(&[addr(1), addr(2)]);
        for n in 0..LEADER_CACHE_MAX {
            members.learn(Some(&Arc::from(n.to_string())), addr(3));
        }
        assert_eq!(members.cached_keys(), LEADER_CACHE_MAX);
        members.learn(Some(&Arc::from("0")), addr(4));
        assert_eq!(
            members.cached_keys(),
            LEADER_CACHE_MAX,
            "a known key replaces"
        );
        members.learn(Some(&Arc::from("new")), addr(4));
        assert_eq!(members.cached_keys(), 1);
    }

    #[test]
    fn at_most_members_max_pools() {
        let members = members(&[addr(1)]);
        for port in 2..=MEMBERS_MAX as u16 {
            assert!(members.pool(addr(port)).unwrap().is_some());
        }
        assert!(members.pool(addr(100)).unwrap().is_none());
        assert!(
            members.pool(addr(2)).unwrap().is_some(),
            "a known member keeps its pool"
        );
        let too_many: Vec<SocketAddr> = (1..=17).map(addr).collect();
        let config = members.session_config.clone();
        assert!(Members::start(&too_many, true, 1, config).is_err());
    }
}
