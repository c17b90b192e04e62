//! One partition of the key space: keys, holders, FIFO queues, tokens and their timers.
//!
//! This is the request × key-state matrix of docs/protocol.md §3 as a sans-IO state machine. The
//! reactor feeds it requests and the time (`now_us`, microseconds on a monotonic clock it
//! reads once per loop iteration) and drains the [`Answer`]s it produced; it never touches a
//! socket or the system clock.
//!
//! # Call order
//!
//! For every loop iteration: `handle_*` for each request or event (in arrival order), then
//! [`LockTable::handle_timers`] with the iteration's `now_us`, then drain
//! [`LockTable::take_answers`] (and give the vector back with [`LockTable::return_answers`]).
//! [`LockTable::next_deadline_us`] gives the poll timeout. Keep the token reservation topped
//! up: when [`LockTable::token_headroom`] runs low, persist a new mark and call
//! [`LockTable::raise_token_limit`].
//!
//! # Invariants (checked by `LockTable::check_invariants`, in tests)
//!
//! * A key entry exists only while the key is held; it has exactly one live lease timer.
//! * A key's waiters form a FIFO list; a free key has no waiters (it has no entry at all).
//! * Every waiter has exactly one live wait timer and is linked in exactly one key queue and
//!   one session list.
//! * Tokens issued by this partition strictly increase, so they strictly increase per key.
//! * Nothing fires early: a lease or wait timer fires at the first tick at or after its end.
//! * No session has more than `max_pending_per_session` acquires queued here (nor, with shared
//!   [`QueueCounts`], in all partitions together).
//!
//! # Not here
//!
//! Sessions, sockets and cross-core routing (the reactor owns those; a session is an opaque
//! [`SessionId`] here), and token persistence ([`crate::tokens`]).

use crate::partition::clients::ClientStates;
use crate::partition::rules::{self, AcquireView, Admit};
use crate::partition::{
    is_detached, Answer, BusyReason, ClientRef, Fate, GrantRef, HeldKey, Op, Places, QueueCounts,
    SessionId, TableStats,
};
use crate::tokens::TokenRange;
use hashbrown::DefaultHashBuilder;
use index::SegmentedTable;
pub use keys::{KeyBytes, KeyStore, INLINE_KEY_BYTES};
#[cfg(any(test, feature = "testing"))]
use latchkey_client::protocol::Request;
use latchkey_client::protocol::Response;
use latchkey_wheel::chunked::ChunkedSlab;
use latchkey_wheel::{TimerHandle, Wheel};
use std::hash::BuildHasher;
use std::sync::Arc;

/// Marks "no index" in the intrusive lists.
const NIL: u32 = u32::MAX;
/// Microseconds in one second of wait or lease.
const MICROS_PER_SECOND: u64 = 1_000_000;
/// The longest wait or lease the wire can carry, in microseconds.
const TIMER_US_MAX: u64 = 255 * MICROS_PER_SECOND;
/// Timers one [`LockTable::handle_timers`] call takes from the wheel at most (whole ticks
/// past it): under a millisecond of expiries even when the table is too large for the caches
/// (about 1 µs each then), so that a burst of them never holds a loop iteration for long. The
/// rest, already late, follow in the next iterations.
const TIMERS_PER_STEP_MAX: usize = 512;

/// Static parameters of one partition.
#[derive(Clone, Copy, Debug)]
pub struct TableConfig {
    /// Key entries (held keys) this partition may have at once.
    pub max_keys: usize,
    /// Waiters one key may have queued; at least 1.
    pub max_waiters_per_key: u32,
    /// Acquires one session may have queued: in this partition, or across every partition
    /// sharing a [`QueueCounts`] (see [`LockTable::share_queue_counts`]).
    pub max_pending_per_session: u32,
    /// Length of one timer tick in microseconds; at least 1.
    pub tick_us: u64,
}

/// The fields of an Acquire the table needs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Acquire {
    /// Seconds the acquire may queue.
    pub wait_s: u8,
    /// Seconds of lease on grant (1..=255).
    pub lease_s: u8,
    /// The correlation id.
    pub owner: u64,
}

/// A held key: its holder's token and lease, and its queue of waiters.
#[derive(Debug)]
struct KeyEntry {
    key: KeyBytes,
    hash: u64,
    token: u64,
    /// The holder's owner id and session, and when it was granted (for `GET /keys` and the
    /// hold histogram).
    owner: u64,
    holder: SessionId,
    /// The identified client the holder speaks for ([`ClientRef::NONE`] if none).
    client: ClientRef,
    granted_us: u64,
    lease_end_us: u64,
    lease_timer: TimerHandle,
    queue_head: u32,
    queue_tail: u32,
    waiters: u32,
}

/// A queued Acquire.
#[derive(Debug)]
struct Waiter {
    owner: u64,
    session: SessionId,
    /// The identified client it speaks for ([`ClientRef::NONE`] if none).
    client: ClientRef,
    lease_s: u8,
    wait_s: u8,
    entry: u32,
    /// When the wait runs out (its timer fires at the first tick at or after it).
    wait_end_us: u64,
    timer: TimerHandle,
    queue_prev: u32,
    queue_next: u32,
    session_prev: u32,
    session_next: u32,
}

/// The head of one session's list of waiters in this partition.
#[derive(Clone, Copy, Debug)]
struct SessionWaiters {
    head: u32,
    count: u32,
}

/// What a wheel timer is for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Timer {
    Lease(u32),
    Wait(u32),
}

/// One partition's lock state. See the module docs for the call order.
pub struct LockTable {
    config: TableConfig,
    hasher: DefaultHashBuilder,
    /// Entry index by key hash.
    index: SegmentedTable<u32>,
    entries: ChunkedSlab<KeyEntry>,
    waiters: ChunkedSlab<Waiter>,
    /// Each session's list of waiters here, by session hash.
    sessions: SegmentedTable<(SessionId, SessionWaiters)>,
    wheel: Wheel<Timer>,
    tokens: TokenRange,
    shutting_down: bool,
    answers: Vec<Answer>,
    fired: Vec<Timer>,
    keys: KeyStore,
    /// Sessions' places in `max_pending_per_session`: every waiter here holds one.
    places: Places,
    /// What this partition remembers of identified clients (docs/protocol.md §5).
    clients: ClientStates,
    stats: TableStats,
    /// The latest time a call was given (for the figures of calls that take none).
    now_us: u64,
    /// Waiters the last Cancel looked at (tests check its bound).
    #[cfg(test)]
    cancel_steps: usize,
}

impl LockTable {
    /// An empty partition at time `now_us`, issuing tokens from `tokens`.
    pub fn new(config: TableConfig, now_us: u64, tokens: TokenRange) -> LockTable {
        assert!(
            config.max_waiters_per_key >= 1,
            "max_waiters_per_key must be at least 1"
        );
        assert!(config.tick_us >= 1 && config.max_keys >= 1 && config.max_pending_per_session >= 1);
        assert!(tokens.next > 0 && tokens.step > 0);
        LockTable {
            config,
            hasher: DefaultHashBuilder::default(),
            index: SegmentedTable::new(),
            entries: ChunkedSlab::new(),
            waiters: ChunkedSlab::new(),
            sessions: SegmentedTable::new(),
            // Every wait and lease fits the ring: timers never move once armed.
            wheel: Wheel::with_horizon(
                now_us / config.tick_us,
                TIMER_US_MAX.div_ceil(config.tick_us) + 1,
            ),
            tokens,
            shutting_down: false,
            answers: Vec::new(),
            fired: Vec::new(),
            keys: KeyStore::default(),
            places: Places::new(config.max_pending_per_session),
            clients: ClientStates::default(),
            stats: TableStats::default(),
            now_us,
            #[cfg(test)]
            cancel_steps: 0,
        }
    }

    /// Makes `max_pending_per_session` count this session's queued acquires in every partition
    /// sharing `counts`, not only here. Call before the table queues anything.
    pub fn share_queue_counts(&mut self, counts: Arc<dyn QueueCounts>) {
        assert!(self.waiters.is_empty(), "queue counts shared too late");
        self.places.share(counts);
    }

    /// Executes one keyed request from `session`, which did not identify.
    #[cfg(any(test, feature = "testing"))]
    pub fn handle(&mut self, now_us: u64, session: SessionId, op: Op, key: &[u8]) {
        self.handle_as(now_us, session, ClientRef::NONE, op, key);
    }

    /// Executes one keyed request from `session`, speaking for `client` if it identified
    /// (docs/protocol.md §5).
    pub fn handle_as(
        &mut self,
        now_us: u64,
        session: SessionId,
        client: ClientRef,
        op: Op,
        key: &[u8],
    ) {
        self.now_us = self.now_us.max(now_us);
        match op {
            Op::Acquire {
                wait_s,
                lease_s,
                owner,
            } => {
                let acquire = Acquire {
                    wait_s,
                    lease_s,
                    owner,
                };
                self.acquire_as(now_us, (session, client), acquire, key);
            }
            Op::Release { token } => self.handle_release(now_us, session, token, key),
            Op::Extend { lease_s, token } => {
                self.handle_extend(now_us, session, lease_s, token, key)
            }
            Op::Cancel { owner } => self.handle_cancel(session, owner, key),
            Op::Query { nonce } => self.handle_query(now_us, session, nonce, key),
            Op::Resolve { owner } => self.handle_resolve(now_us, session, client, owner, key),
        }
    }

    /// Executes one parsed request from `session`: [`handle`](Self::handle) for a keyed one.
    /// A Ping names no key and is not a partition's business (the reactor answers it): it
    /// changes nothing and produces no answer here.
    #[cfg(any(test, feature = "testing"))]
    pub fn handle_request(&mut self, now_us: u64, session: SessionId, request: &Request<'_>) {
        if let Some((op, key)) = Op::of(request) {
            self.handle(now_us, session, op, key);
        }
    }

    /// Acquire: grant a free key, queue on a held one (wait > 0), or answer `T`/`B` (`B` when
    /// the key's queue or the session's queued acquires are at their limit).
    #[cfg(any(test, feature = "testing"))]
    pub fn handle_acquire(
        &mut self,
        now_us: u64,
        session: SessionId,
        acquire: Acquire,
        key: &[u8],
    ) {
        self.acquire_as(now_us, (session, ClientRef::NONE), acquire, key);
    }

    /// An Acquire (as `handle_acquire`, tests only) from `session` speaking for `client`: an owner
    /// a Resolve answered "never seen" is refused `B`, and the `T` or `B` answers of an
    /// identified client's acquires are remembered for its Resolves.
    fn acquire_as(
        &mut self,
        now_us: u64,
        (session, client): (SessionId, ClientRef),
        acquire: Acquire,
        key: &[u8],
    ) {
        self.now_us = self.now_us.max(now_us);
        debug_assert!(acquire.lease_s > 0 && !key.is_empty());
        let ends_pending = acquire.wait_s > 0;
        let owner = acquire.owner;
        if client.is_some() && self.clients.is_forgotten(client, owner) {
            self.stats.busy(BusyReason::Resolved);
            return self.answer(session, Response::Busy { owner }, ends_pending);
        }
        let hash = self.hasher.hash_one(key);
        let entry = match self.shutting_down {
            true => None,
            false => self.find(hash, key),
        };
        let view = AcquireView {
            shutting_down: self.shutting_down,
            taken: entry.is_some(),
            room_for_key: self.entries.len() < self.config.max_keys,
            waiters: entry.map_or(0, |entry| self.entries[entry].waiters),
            max_waiters_per_key: self.config.max_waiters_per_key,
            wait_s: acquire.wait_s,
        };
        let caller = (session, client);
        match (rules::admit(&view, &mut self.places, session), entry) {
            (Admit::Grant, _) => self.grant_free(now_us, caller, acquire, key, hash),
            (Admit::Queue, Some(entry)) => {
                self.enqueue(now_us, caller, acquire, entry);
                self.debug_check_entry(entry);
            }
            (Admit::Timeout, _) => {
                self.stats.timed_out += 1;
                self.answer_acquire(caller, Response::Timeout { owner }, false);
            }
            (Admit::Busy(reason), _) => {
                self.stats.busy(reason);
                self.answer_acquire(caller, Response::Busy { owner }, ends_pending);
            }
            (Admit::Queue, None) => unreachable!("a free key is never queued on"),
        }
    }

    /// Grants the free `key` (hashed `hash`) to `acquire`, or answers `B` when no token can be
    /// issued.
    fn grant_free(
        &mut self,
        now_us: u64,
        (session, client): (SessionId, ClientRef),
        acquire: Acquire,
        key: &[u8],
        hash: u64,
    ) {
        let ends_pending = acquire.wait_s > 0;
        let Some(token) = self.tokens.issue() else {
            self.stats.busy(BusyReason::Tokens);
            let busy = Response::Busy {
                owner: acquire.owner,
            };
            return self.answer_acquire((session, client), busy, ends_pending);
        };
        self.stats.acquired += 1;
        let holder = (session, acquire.owner, client);
        let entry = self.insert_entry(now_us, key, hash, token, acquire.lease_s, holder);
        let granted = Response::Acquired {
            owner: acquire.owner,
            token,
        };
        self.answers.push(Answer {
            session,
            response: granted,
            ends_pending,
            grant: GrantRef(entry),
        });
        self.debug_check_entry(entry);
    }

    /// Release: `R` and hand the key to the queue head (or free it) when `token` holds `key`.
    pub fn handle_release(&mut self, now_us: u64, session: SessionId, token: u64, key: &[u8]) {
        self.now_us = self.now_us.max(now_us);
        match self.find_holder(key, token) {
            Some(entry) => {
                self.stats.released += 1;
                self.answer(session, Response::Released { token }, false);
                self.end_hold(now_us, entry, None);
                self.debug_check_entry(entry);
            }
            None => {
                self.stats.release_not_held += 1;
                self.answer(session, Response::NotHeld { token }, false);
            }
        }
    }

    /// Releases the grant of `token` on `entry` if it still holds it, answering nobody: the
    /// grant's `A` never reached its session (docs/protocol.md §3). Returns whether it was held.
    /// Tokens are unique server-wide, so entry and token name that one grant exactly.
    pub fn release_granted(&mut self, now_us: u64, entry: u32, token: u64) -> bool {
        self.now_us = self.now_us.max(now_us);
        if self
            .entries
            .get(entry)
            .map_or(true, |held| held.token != token)
        {
            return false;
        }
        self.end_hold(now_us, entry, None);
        self.debug_check_entry(entry);
        true
    }

    /// Extend: `E` and a new lease of `lease_s` from now when `token` holds `key`.
    pub fn handle_extend(
        &mut self,
        now_us: u64,
        session: SessionId,
        lease_s: u8,
        token: u64,
        key: &[u8],
    ) {
        self.now_us = self.now_us.max(now_us);
        debug_assert!(lease_s > 0);
        let Some(entry) = self.find_holder(key, token) else {
            self.stats.extend_not_held += 1;
            return self.answer(session, Response::NotHeld { token }, false);
        };
        self.stats.extended += 1;
        let lease_end_us = now_us + u64::from(lease_s) * MICROS_PER_SECOND;
        let old_timer = self.entries[entry].lease_timer;
        let cancelled = self.wheel.cancel(old_timer);
        debug_assert_eq!(cancelled, Some(Timer::Lease(entry)));
        let timer = self
            .wheel
            .insert(self.tick_at_or_after(lease_end_us), Timer::Lease(entry));
        let held = &mut self.entries[entry];
        held.lease_end_us = lease_end_us;
        held.lease_timer = timer;
        self.answer(session, Response::Extended { token }, false);
        self.debug_check_entry(entry);
    }

    /// Cancel: withdraw this session's acquires of `key` with `owner`, each answered `T`.
    ///
    /// Walks the shorter of the key's queue and the session's waiters in this partition, so a
    /// Cancel costs at most the session's own queued acquires, whatever the queue's length.
    pub fn handle_cancel(&mut self, session: SessionId, owner: u64, key: &[u8]) {
        #[cfg(test)]
        {
            self.cancel_steps = 0;
        }
        self.stats.cancels += 1;
        let hash = self.hasher.hash_one(key);
        let Some(entry) = self.find(hash, key) else {
            return;
        };
        let Some(list) = self.session_list(session) else {
            return;
        };
        let by_session = list.count <= self.entries[entry].waiters;
        let mut cursor = match by_session {
            true => list.head,
            false => self.entries[entry].queue_head,
        };
        // Bounded: the shorter list is at most max_pending_per_session long.
        while cursor != NIL {
            #[cfg(test)]
            {
                self.cancel_steps += 1;
            }
            let waiter = &self.waiters[cursor];
            let next = match by_session {
                true => waiter.session_next,
                false => waiter.queue_next,
            };
            let queued = (waiter.session, waiter.owner);
            if waiter.entry == entry && rules::withdraws(queued, (session, owner)) {
                self.time_out(cursor);
            }
            cursor = next;
        }
        self.debug_check_entry(entry);
    }

    /// Query: the key's state; never reveals the token.
    pub fn handle_query(&mut self, now_us: u64, session: SessionId, nonce: u64, key: &[u8]) {
        self.now_us = self.now_us.max(now_us);
        let hash = self.hasher.hash_one(key);
        let response = match self.find(hash, key) {
            None => Response::State {
                nonce,
                held: false,
                lease_ms: 0,
                waiters: 0,
            },
            Some(entry) => {
                let held = &self.entries[entry];
                let left_ms = held.lease_end_us.saturating_sub(now_us) / 1000;
                let lease_ms = u32::try_from(left_ms).unwrap_or(u32::MAX);
                Response::State {
                    nonce,
                    held: true,
                    lease_ms,
                    waiters: held.waiters,
                }
            }
        };
        self.answer(session, response, false);
    }

    /// A session ended: its waiters leave silently; its holds stay.
    pub fn handle_session_closed(&mut self, session: SessionId) {
        let Some(list) = self.session_list(session) else {
            return;
        };
        let mut cursor = list.head;
        // Bounded by the session's waiter count in this partition.
        for _ in 0..list.count {
            cursor = self.remove_waiter(cursor).session_next;
        }
        debug_assert!(self.session_list(session).is_none());
    }

    /// Shutdown: every queued waiter is answered `B`, and so is every later Acquire.
    pub fn handle_shutdown(&mut self) {
        self.shutting_down = true;
        let queued: Vec<u32> = self.waiters.iter().map(|(index, _)| index).collect();
        for waiter in queued {
            self.refuse_waiter(waiter, BusyReason::Shutdown);
        }
    }

    /// Fires the lease and wait timers that have run out by `now_us`, in deadline order.
    ///
    /// At most about `TIMERS_PER_STEP_MAX` (512) per call (whole ticks): when more are due,
    /// [`next_deadline_us`](Self::next_deadline_us) stays at or before `now_us` and the next
    /// call continues with the earliest left. Within a call, timers take effect as if in the
    /// order of their exact ends (docs/protocol.md §3), without sorting them: each expired lease
    /// first answers `T` to the queue heads whose wait ended at or before the lease (on equal
    /// ends the wait goes first) and gives the key to the first head whose wait ended after it;
    /// the wait timers then answer `T` to the waiters still queued. A waiter that a lease
    /// answered or granted is gone by then, and its slot is still vacant (nothing is queued
    /// while timers fire), so its wait timer is skipped. Only the waiters' own slots are read,
    /// in the order the wheel fired them: no sort, no random access to other timers.
    pub fn handle_timers(&mut self, now_us: u64) {
        self.now_us = self.now_us.max(now_us);
        let mut fired = std::mem::take(&mut self.fired);
        let tick = now_us / self.config.tick_us;
        self.wheel
            .advance_bounded(tick, &mut fired, TIMERS_PER_STEP_MAX);
        for &timer in &fired {
            if let Timer::Lease(entry) = timer {
                let lease_end_us = self.entries[entry].lease_end_us;
                debug_assert!(lease_end_us <= now_us);
                self.stats.lease_expirations += 1;
                self.end_hold(now_us, entry, Some(lease_end_us));
            }
        }
        for &timer in &fired {
            if let Timer::Wait(waiter) = timer {
                if self.waiters.contains(waiter) {
                    debug_assert!(self.waiters[waiter].wait_end_us <= now_us);
                    self.time_out(waiter);
                }
            }
        }
        // Checked once the batch is done: between the two passes, a waiter whose wait timer
        // fired may still sit in a queue without a live timer.
        for &timer in &fired {
            if let Timer::Lease(entry) = timer {
                self.debug_check_entry(entry);
            }
        }
        fired.clear();
        self.fired = fired;
    }

    /// Answers `T` to a queued waiter (its wait ran out, or it was cancelled), and removes it.
    fn time_out(&mut self, waiter: u32) {
        let removed = self.remove_waiter(waiter);
        self.stats.timed_out += 1;
        self.record_wait(&removed);
        let timeout = Response::Timeout {
            owner: removed.owner,
        };
        self.answer_acquire((removed.session, removed.client), timeout, true);
    }

    /// Answers `B` to a queued waiter, and removes it.
    fn refuse_waiter(&mut self, waiter: u32, reason: BusyReason) {
        let removed = self.remove_waiter(waiter);
        self.stats.busy(reason);
        self.record_wait(&removed);
        let busy = Response::Busy {
            owner: removed.owner,
        };
        self.answer_acquire((removed.session, removed.client), busy, true);
    }

    /// Records how long a queued acquire waited, at its answer (the table's current time).
    fn record_wait(&mut self, waiter: &Waiter) {
        let arrived_us = waiter.wait_end_us - u64::from(waiter.wait_s) * MICROS_PER_SECOND;
        self.stats
            .acquire_wait
            .record(self.now_us.saturating_sub(arrived_us));
    }

    /// The earliest time at which [`handle_timers`](Self::handle_timers) may have work.
    pub fn next_deadline_us(&self) -> Option<u64> {
        self.wheel
            .next_deadline()
            .map(|tick| tick.saturating_mul(self.config.tick_us))
    }

    /// Takes the answers produced so far, in the order they were produced.
    pub fn take_answers(&mut self) -> Vec<Answer> {
        std::mem::take(&mut self.answers)
    }

    /// Gives back an emptied answer vector so its allocation is reused.
    pub fn return_answers(&mut self, mut answers: Vec<Answer>) {
        answers.clear();
        if self.answers.is_empty() && answers.capacity() > self.answers.capacity() {
            self.answers = answers;
        }
    }

    /// The key of a live entry (as an `A` answer's [`GrantRef`] names it).
    #[cfg(any(test, feature = "testing"))]
    pub fn entry_key(&self, entry: u32) -> Option<&[u8]> {
        self.entries.get(entry).map(|held| held.key.as_slice())
    }

    /// Tokens left in the current reservation.
    pub fn token_headroom(&self) -> u64 {
        self.tokens.headroom()
    }

    /// The next token this partition would issue.
    pub fn next_token(&self) -> u64 {
        self.tokens.next
    }

    /// Allows tokens up to `limit` (after the reactor persisted it).
    pub fn raise_token_limit(&mut self, limit: u64) {
        self.tokens.limit = self.tokens.limit.max(limit);
    }

    /// Every held key with its holder's token and the end of its lease (µs), in no
    /// particular order. O(held keys).
    #[cfg(any(test, feature = "testing"))]
    pub fn holds(&self) -> impl Iterator<Item = (&[u8], u64, u64)> {
        let entries = self.entries.iter();
        entries.map(|(_, held)| (held.key.as_slice(), held.token, held.lease_end_us))
    }

    /// This partition's counters and histograms since it started.
    pub fn stats(&self) -> &TableStats {
        &self.stats
    }

    /// Scans at most `slots` entry slots from `cursor` for held keys starting with `prefix`,
    /// giving each to `found` as of `now_us`; returns where the next scan continues, or `None`
    /// when the scan reached the end. Keys held throughout a scan are listed exactly once;
    /// keys granted or freed meanwhile may or may not be. Bounded work per call.
    pub fn scan_held(
        &self,
        now_us: u64,
        cursor: u32,
        slots: u32,
        prefix: &[u8],
        found: &mut impl FnMut(HeldKey),
    ) -> Option<u32> {
        let end = self.entries.slots().min(cursor.saturating_add(slots));
        for index in cursor..end {
            let Some(held) = self.entries.get(index) else {
                continue;
            };
            if !held.key.as_slice().starts_with(prefix) {
                continue;
            }
            found(HeldKey {
                key: held.key.as_slice().into(),
                owner: held.owner,
                holder: held.holder,
                held_us: Some(now_us.saturating_sub(held.granted_us)),
                lease_left_us: held.lease_end_us.saturating_sub(now_us),
                waiters: held.waiters,
            });
        }
        (end < self.entries.slots()).then_some(end)
    }

    /// Held keys in this partition.
    pub fn key_count(&self) -> usize {
        self.entries.len()
    }

    /// Queued acquires in this partition.
    pub fn waiter_count(&self) -> usize {
        self.waiters.len()
    }

    /// Whether [`handle_shutdown`](Self::handle_shutdown) was called.
    #[cfg(any(test, feature = "testing"))]
    pub fn is_shutting_down(&self) -> bool {
        self.shutting_down
    }

    /// Answers an acquire `T` or `B`: remembered for an identified client's Resolves, and
    /// written nowhere for a detached one.
    fn answer_acquire(
        &mut self,
        (session, client): (SessionId, ClientRef),
        response: Response,
        ends_pending: bool,
    ) {
        if client.is_some() {
            let fate = match response {
                Response::Timeout { .. } => Fate::TimedOut,
                _ => Fate::Busy,
            };
            let owner = response.correlation_id();
            if self.clients.answered(client, owner, fate, self.now_us) {
                self.stats.fates_dropped += 1;
            }
        }
        if !is_detached(session) {
            self.answer(session, response, ends_pending);
        }
    }

    fn answer(&mut self, session: SessionId, response: Response, ends_pending: bool) {
        self.answers.push(Answer {
            session,
            response,
            ends_pending,
            grant: GrantRef::NONE,
        });
    }

    fn find(&self, hash: u64, key: &[u8]) -> Option<u32> {
        let entries = &self.entries;
        self.index
            .find(hash, |&index| entries[index].key.as_slice() == key)
            .copied()
    }

    /// `session`'s list of waiters in this partition, if it has any.
    fn session_list(&self, session: SessionId) -> Option<SessionWaiters> {
        let hash = self.hasher.hash_one(session);
        let found = self.sessions.find(hash, |&(id, _)| id == session);
        found.map(|&(_, list)| list)
    }

    fn find_holder(&self, key: &[u8], token: u64) -> Option<u32> {
        let entry = self.find(self.hasher.hash_one(key), key)?;
        (self.entries[entry].token == token).then_some(entry)
    }

    /// The first tick whose start is at or after `at_us`: a timer there never fires early.
    fn tick_at_or_after(&self, at_us: u64) -> u64 {
        at_us.div_ceil(self.config.tick_us)
    }

    /// A new entry for `key`, held with `token` by `holder` (session, owner, client).
    fn insert_entry(
        &mut self,
        now_us: u64,
        key: &[u8],
        hash: u64,
        token: u64,
        lease_s: u8,
        holder: (SessionId, u64, ClientRef),
    ) -> u32 {
        let lease_end_us = now_us + u64::from(lease_s) * MICROS_PER_SECOND;
        let entry = self.entries.vacant_key();
        let deadline = self.tick_at_or_after(lease_end_us);
        let lease_timer = self.wheel.insert(deadline, Timer::Lease(entry));
        self.entries.insert(KeyEntry {
            key: self.keys.store(key),
            hash,
            token,
            owner: holder.1,
            holder: holder.0,
            client: holder.2,
            granted_us: now_us,
            lease_end_us,
            lease_timer,
            queue_head: NIL,
            queue_tail: NIL,
            waiters: 0,
        });
        self.index.insert_unique(hash, entry);
        entry
    }

    /// The holder of `entry` is gone (released or expired): grant the queue head in the same
    /// step, or remove the entry so the key is free. The caller checks the entry after.
    ///
    /// `expired_at_us` is the exact end of an expired lease: heads whose wait ended at or
    /// before it timed out first and are answered `T` (deadline order, docs/protocol.md §3).
    fn end_hold(&mut self, now_us: u64, entry: u32, expired_at_us: Option<u64>) {
        let ended = &self.entries[entry];
        let (old_timer, granted_us) = (ended.lease_timer, ended.granted_us);
        let hold_end_us = expired_at_us.unwrap_or(now_us);
        self.stats
            .lock_hold
            .record(hold_end_us.saturating_sub(granted_us));
        // Already fired when called from handle_timers; cancel is then a no-op.
        self.wheel.cancel(old_timer);
        // Bounded: each pass removes one waiter; a waiter is skipped only if its wait ended
        // before the lease or no token is left.
        loop {
            let head = self.entries[entry].queue_head;
            if head == NIL {
                return self.remove_entry(entry);
            }
            let wait_end_us = self.waiters[head].wait_end_us;
            if expired_at_us.is_some_and(|end| rules::wait_ends_first(wait_end_us, end)) {
                self.time_out(head);
                continue;
            }
            if !self.tokens.can_issue() {
                self.refuse_waiter(head, BusyReason::Tokens);
                continue;
            }
            let removed = self.remove_waiter(head);
            let (session, owner, lease_s) = (removed.session, removed.owner, removed.lease_s);
            let client = removed.client;
            let token = self.tokens.issue().expect("a token can be issued");
            self.stats.acquired += 1;
            self.record_wait(&removed);
            let lease_end_us = now_us + u64::from(lease_s) * MICROS_PER_SECOND;
            let deadline = self.tick_at_or_after(lease_end_us);
            let lease_timer = self.wheel.insert(deadline, Timer::Lease(entry));
            let held = &mut self.entries[entry];
            held.token = token;
            held.owner = owner;
            held.holder = session;
            held.client = client;
            held.granted_us = now_us;
            held.lease_end_us = lease_end_us;
            held.lease_timer = lease_timer;
            if is_detached(session) {
                // Its client has no session: the grant waits for a Resolve, or its grace.
                return self.clients.undelivered(client, entry, token);
            }
            let granted = Response::Acquired { owner, token };
            self.answers.push(Answer {
                session,
                response: granted,
                ends_pending: true,
                grant: GrantRef(entry),
            });
            return;
        }
    }

    fn remove_entry(&mut self, entry: u32) {
        let removed = self.entries.remove(entry);
        debug_assert_eq!(removed.waiters, 0);
        let found = self.index.remove(removed.hash, |&index| index == entry);
        found.expect("a live entry is indexed");
        self.keys.recycle(removed.key);
    }

    fn enqueue(
        &mut self,
        now_us: u64,
        (session, client): (SessionId, ClientRef),
        acquire: Acquire,
        entry: u32,
    ) {
        let wait_end_us = now_us + u64::from(acquire.wait_s) * MICROS_PER_SECOND;
        let deadline = self.tick_at_or_after(wait_end_us);
        let waiter = self.waiters.vacant_key();
        let timer = self.wheel.insert(deadline, Timer::Wait(waiter));
        let queue_prev = self.entries[entry].queue_tail;
        self.waiters.insert(Waiter {
            owner: acquire.owner,
            session,
            client,
            lease_s: acquire.lease_s,
            wait_s: acquire.wait_s,
            entry,
            wait_end_us,
            timer,
            queue_prev,
            queue_next: NIL,
            session_prev: NIL,
            session_next: NIL,
        });
        self.link_session(waiter, session);
        let held = &mut self.entries[entry];
        if queue_prev == NIL {
            held.queue_head = waiter;
        } else {
            self.waiters[queue_prev].queue_next = waiter;
        }
        held.queue_tail = waiter;
        held.waiters += 1;
    }

    /// Links `waiter` at the head of `session`'s list (its place is the caller's business).
    fn link_session(&mut self, waiter: u32, session: SessionId) {
        let hash = self.hasher.hash_one(session);
        let empty = || {
            (
                session,
                SessionWaiters {
                    head: NIL,
                    count: 0,
                },
            )
        };
        let (_, list) = self
            .sessions
            .find_or_insert(hash, |&(id, _)| id == session, empty);
        let session_next = list.head;
        list.head = waiter;
        list.count += 1;
        let linked = &mut self.waiters[waiter];
        linked.session = session;
        linked.session_prev = NIL;
        linked.session_next = session_next;
        if session_next != NIL {
            self.waiters[session_next].session_prev = waiter;
        }
    }

    /// Unlinks `waiter` from its session's list (its place is the caller's business).
    fn unlink_session(&mut self, waiter: u32) {
        let (session, prev, next) = {
            let unlinked = &self.waiters[waiter];
            (
                unlinked.session,
                unlinked.session_prev,
                unlinked.session_next,
            )
        };
        if next != NIL {
            self.waiters[next].session_prev = prev;
        }
        if prev != NIL {
            self.waiters[prev].session_next = next;
        }
        let hash = self.hasher.hash_one(session);
        let listed = self.sessions.update_or_remove(
            hash,
            |&(id, _)| id == session,
            |(_, list)| {
                if list.head == waiter {
                    list.head = next;
                }
                list.count -= 1;
                list.count > 0
            },
        );
        debug_assert!(listed, "a waiter's session is listed");
    }

    /// Unlinks a waiter from its key queue and session list, cancels its timer, and returns it.
    fn remove_waiter(&mut self, waiter: u32) -> Waiter {
        self.unlink_session(waiter);
        let removed = self.waiters.remove(waiter);
        // Already fired when called from handle_timers; cancel is then a no-op.
        self.wheel.cancel(removed.timer);
        let held = &mut self.entries[removed.entry];
        match removed.queue_prev {
            NIL => held.queue_head = removed.queue_next,
            prev => self.waiters[prev].queue_next = removed.queue_next,
        }
        match removed.queue_next {
            NIL => held.queue_tail = removed.queue_prev,
            next => self.waiters[next].queue_prev = removed.queue_prev,
        }
        held.waiters -= 1;
        self.places.give_back(removed.session);
        removed
    }
}

mod check;
mod index;
mod keys;
mod partition;
mod resume;

#[cfg(test)]
mod tests;
