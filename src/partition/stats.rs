//! What one partition counts: answers by kind, refusals by reason, expiries, and how long
//! acquires waited and locks were held. Plain integers written by the partition's core alone;
//! the server adds up the partitions' copies for `GET /metrics` and `GET /stats`.

use crate::metrics::{Histogram, HOLD_BOUNDS_US, WAIT_BOUNDS_US};

/// Why an Acquire was answered `B`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum BusyReason {
    /// The key's queue is at `max_waiters_per_key`.
    WaitersPerKey,
    /// The partition holds its share of `max_keys`.
    Keys,
    /// The session has `max_pending_per_session` acquires queued.
    PendingPerSession,
    /// The server is shutting down.
    Shutdown,
    /// No token could be issued (the persisted reservation is used up).
    Tokens,
    /// A Resolve already answered this client's owner "never seen": the acquire arrived after
    /// that and is not executed (docs/protocol.md §5).
    Resolved,
}

impl BusyReason {
    /// Every reason, in the order of [`BusyCounts::get`]'s label names.
    pub const ALL: [BusyReason; 6] = [
        BusyReason::WaitersPerKey,
        BusyReason::Keys,
        BusyReason::PendingPerSession,
        BusyReason::Shutdown,
        BusyReason::Tokens,
        BusyReason::Resolved,
    ];

    /// The reason's label in metrics, stats and logs.
    pub fn label(self) -> &'static str {
        match self {
            BusyReason::WaitersPerKey => "waiters_per_key",
            BusyReason::Keys => "keys",
            BusyReason::PendingPerSession => "pending_per_session",
            BusyReason::Shutdown => "shutdown",
            BusyReason::Tokens => "tokens",
            BusyReason::Resolved => "resolved",
        }
    }
}

/// `B` answers to Acquires, by reason.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct BusyCounts([u64; BusyReason::ALL.len()]);

impl BusyCounts {
    /// `B` answers for `reason`.
    pub fn get(&self, reason: BusyReason) -> u64 {
        self.0[reason as usize]
    }

    /// Every `B` answer.
    pub fn total(&self) -> u64 {
        self.0.iter().sum()
    }

    pub(crate) fn count(&mut self, reason: BusyReason) {
        self.0[reason as usize] += 1;
    }

    /// Adds `other`'s counts.
    pub fn merge(&mut self, other: &BusyCounts) {
        for (mine, theirs) in self.0.iter_mut().zip(other.0) {
            *mine += theirs;
        }
    }
}

/// One partition's counters since it started.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TableStats {
    /// Acquires answered `A`.
    pub acquired: u64,
    /// Acquires answered `T` (wait ran out, `wait = 0` on a held key, or cancelled).
    pub timed_out: u64,
    /// Acquires answered `B`, by reason.
    pub busy: BusyCounts,
    /// Releases answered `R`.
    pub released: u64,
    /// Releases answered `N`.
    pub release_not_held: u64,
    /// Extends answered `E`.
    pub extended: u64,
    /// Extends answered `N`.
    pub extend_not_held: u64,
    /// Cancel requests.
    pub cancels: u64,
    /// Leases that ran out.
    pub lease_expirations: u64,
    /// Resolves answered, by fate (indexed by the fate's wire byte, docs/protocol.md §5).
    pub resolves: [u64; 5],
    /// Grants to an identified client that never reached it and were released when its grace
    /// ended.
    pub grace_releases: u64,
    /// Answers to identified clients (`T`, `B`) forgotten before their retention ended, for
    /// room (a Resolve of one then says "never seen").
    pub fates_dropped: u64,
    /// Queued acquires a new leader took over from the replicated state (cluster members).
    pub adopted: u64,
    /// From a queued acquire's arrival to its answer (`A`, `T` or `B`), in microseconds.
    pub acquire_wait: Histogram,
    /// From a grant to its release or expiry, in microseconds.
    pub lock_hold: Histogram,
}

impl Default for TableStats {
    fn default() -> TableStats {
        TableStats {
            acquired: 0,
            timed_out: 0,
            busy: BusyCounts::default(),
            released: 0,
            release_not_held: 0,
            extended: 0,
            extend_not_held: 0,
            cancels: 0,
            lease_expirations: 0,
            resolves: [0; 5],
            grace_releases: 0,
            fates_dropped: 0,
            adopted: 0,
            acquire_wait: Histogram::new(WAIT_BOUNDS_US),
            lock_hold: Histogram::new(HOLD_BOUNDS_US),
        }
    }
}

impl TableStats {
    /// Counts a `B` answer to an Acquire.
    pub(crate) fn busy(&mut self, reason: BusyReason) {
        self.busy.count(reason);
    }

    /// Adds `other`'s figures (another partition's).
    pub fn merge(&mut self, other: &TableStats) {
        self.acquired += other.acquired;
        self.timed_out += other.timed_out;
        self.busy.merge(&other.busy);
        self.released += other.released;
        self.release_not_held += other.release_not_held;
        self.extended += other.extended;
        self.extend_not_held += other.extend_not_held;
        self.cancels += other.cancels;
        self.lease_expirations += other.lease_expirations;
        for (mine, theirs) in self.resolves.iter_mut().zip(other.resolves) {
            *mine += theirs;
        }
        self.grace_releases += other.grace_releases;
        self.fates_dropped += other.fates_dropped;
        self.adopted += other.adopted;
        self.acquire_wait.merge(&other.acquire_wait);
        self.lock_hold.merge(&other.lock_hold);
    }
}

/// One held key as `GET /keys` lists it. Never the token.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct HeldKey {
    /// The key.
    pub key: Box<[u8]>,
    /// The holder's owner id (the Acquire's correlation id).
    pub owner: u64,
    /// The session the grant went to.
    pub holder: u64,
    /// Since the grant, in microseconds; `None` where the server does not know (a cluster
    /// member lists a hold it did not grant itself: another leader granted it).
    pub held_us: Option<u64>,
    /// Lease left, in microseconds.
    pub lease_left_us: u64,
    /// Queued acquires.
    pub waiters: u32,
}
