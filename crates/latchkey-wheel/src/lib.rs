//! Timing wheel over `u64` ticks: a flat ring for the near future, pages for the far future.
//!
//! The lock table arms one timer per lease and per queued waiter; the reactor asks the wheel for
//! [`Wheel::next_deadline`] to bound its poll timeout and calls [`Wheel::advance_bounded`] once
//! per loop iteration to collect what expired. Insert and cancel are O(1).
//!
//! # Shape, and why
//!
//! A hierarchical wheel moves ("cascades") a whole upper-level slot down when time reaches it:
//! with a million timers in random order that held a core for milliseconds every few seconds
//! (measured: 1.7 ms every 64 ms, ~4 ms every 4.1 s). This wheel has no cascades in its near
//! range. A **ring** of `R` slots (a power of two chosen from the caller's horizon) holds every
//! timer whose deadline is within `R` ticks of the wheel's time: slot `deadline mod R`, so one
//! slot holds exactly one tick's timers and firing a tick touches only timers that are due. The
//! lock table sizes the ring past its longest timer (255 s of 1 ms ticks → 2^18 slots, 1 MiB of
//! list heads per partition), so its timers never leave the ring.
//!
//! Timers further away wait in **pages** of `R` ticks (an ordered map from page to list); a
//! page moves into the ring, whole, when time reaches its first tick. Timers already due when
//! inserted wait on the **due** list, which the next advance fires first.
//!
//! Entries live in a [`ChunkedVec`] (it never copies them when it grows) with an intrusive
//! free list; every list is intrusive and doubly linked through `u32` indices. Occupied ring
//! slots are found through a two-level bitmap (a bit per slot, a bit per non-empty word), so
//! empty slots cost nothing to skip. A [`TimerHandle`] carries its entry's generation, so a
//! handle to a fired or cancelled timer never reaches the entry's next occupant.
//!
//! # Bounded work
//!
//! [`Wheel::advance_bounded`] stops after the tick with which it has fired at least the given
//! number of timers, leaving the wheel's time at that tick; the rest fire on the next call, in
//! tick order. A tick is never split, so timers of one tick come out of one call.
//!
//! # Invariants (checked by [`Wheel::check_invariants`])
//!
//! - Every live entry is linked in exactly one list: the due list when its deadline is `<= now`;
//!   else ring slot `deadline mod R` when `deadline <= now + R`; else the page
//!   `deadline / R`, and that page starts after `now`.
//! - A ring slot's bit is set exactly when its list is non-empty; a summary bit exactly when
//!   its bitmap word is non-zero.
//! - `len()` equals the number of live entries; the free list holds exactly the other entries.
//!
//! # What it does not do
//!
//! No `Instant`, no clock and no I/O: callers convert time to ticks (1 ms in the server) and
//! pass them in, so tests drive virtual time. It does not sort what one tick fires. Far pages
//! are for deadlines beyond the horizon the caller declared; moving a page costs O(its timers)
//! at once, so a caller that cares about stalls keeps its timers within the horizon.
//!
//! The crate also holds [`chunked`], the storage that grows by chunks and never moves what it
//! holds: the wheel's entries live in it, and so do the lock table's keys.
#![deny(missing_docs)]

pub mod chunked;

use crate::chunked::ChunkedVec;
use std::collections::BTreeMap;
use std::fmt;

/// "No entry" in the intrusive links, so the wheel holds at most `u32::MAX - 1` entries.
const NIL: u32 = u32::MAX;
/// List id of the due list.
const LIST_DUE: u32 = u32::MAX;
/// List id of the far pages (the page is the deadline divided by the ring size).
const LIST_FAR: u32 = u32::MAX - 1;
/// Smallest ring: one bitmap word.
const RING_BITS_MIN: u32 = 6;
/// Largest ring: 16 Mi slots (64 MiB of heads); list ids of slots stay below `LIST_FAR`.
const RING_BITS_MAX: u32 = 24;
/// Ring slots of [`Wheel::new`]: 4096 ticks.
const DEFAULT_HORIZON_TICKS: u64 = 4095;

const _: () = assert!((1u64 << RING_BITS_MAX) < LIST_FAR as u64);

/// Handle to a scheduled timer, returned by [`Wheel::insert`].
///
/// Stays valid until the timer fires or is cancelled; after that, [`Wheel::cancel`] and
/// [`Wheel::deadline`] return `None` for it even once its entry holds another timer. (The
/// generation is 32 bits: a handle kept across 2^32 reuses of one entry could alias.)
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct TimerHandle {
    index: u32,
    generation: u32,
}

/// One entry: a live timer, or a free entry on the free list.
struct Entry<T> {
    deadline_tick: u64,
    /// `Some` while the timer is live.
    payload: Option<T>,
    prev: u32,
    /// Next in the same list, or in the free list.
    next: u32,
    /// Bumped every time the entry is freed, to invalidate outstanding handles.
    generation: u32,
    /// A ring slot, [`LIST_DUE`] or [`LIST_FAR`].
    list: u32,
}

/// A timing wheel holding payloads of type `T` keyed by `u64` deadline ticks.
///
/// Call order: [`insert`](Wheel::insert) and [`cancel`](Wheel::cancel) at any time; once per
/// loop iteration, read [`next_deadline`](Wheel::next_deadline) to bound the poll timeout and
/// after polling call [`advance_bounded`](Wheel::advance_bounded) (or
/// [`advance`](Wheel::advance)) with the current tick to drain expired payloads into a
/// caller-owned `Vec` (reuse it so the hot path does not allocate).
pub struct Wheel<T> {
    /// The last tick advanced to.
    now_tick: u64,
    entries: ChunkedVec<Entry<T>>,
    free_head: u32,
    live_count: usize,
    ring_bits: u32,
    /// Head of each ring slot's list, stored as index + 1 so that the zeroed allocation (which
    /// the kernel maps lazily) means "empty".
    heads: Box<[u32]>,
    /// A bit per ring slot: its list is non-empty.
    occupied: Box<[u64]>,
    /// A bit per word of `occupied`: the word is non-zero.
    summary: Box<[u64]>,
    due_head: u32,
    /// Lower bound on the due list's deadlines; meaningful only while it is non-empty.
    due_min_tick: u64,
    due_count: usize,
    /// Page (deadline / ring size) → head of its list.
    far: BTreeMap<u64, u32>,
    far_count: usize,
}

impl<T: Copy> Wheel<T> {
    /// An empty wheel whose current tick is `now_tick`, with a ring of 4096 ticks.
    pub fn new(now_tick: u64) -> Self {
        Self::with_horizon(now_tick, DEFAULT_HORIZON_TICKS)
    }

    /// An empty wheel whose ring covers at least `horizon_ticks` ticks past its time (rounded
    /// up to a power of two, at least 64, at most 2^24): timers within that horizon never move
    /// once inserted. The ring's list heads take 4 bytes per tick.
    pub fn with_horizon(now_tick: u64, horizon_ticks: u64) -> Self {
        let wanted = horizon_ticks.saturating_add(1).next_power_of_two();
        let ring_bits = wanted.trailing_zeros().clamp(RING_BITS_MIN, RING_BITS_MAX);
        let slots = 1usize << ring_bits;
        let words = slots / 64;
        Wheel {
            now_tick,
            entries: ChunkedVec::new(),
            free_head: NIL,
            live_count: 0,
            ring_bits,
            heads: vec![0u32; slots].into_boxed_slice(),
            occupied: vec![0u64; words].into_boxed_slice(),
            summary: vec![0u64; words.div_ceil(64)].into_boxed_slice(),
            due_head: NIL,
            due_min_tick: u64::MAX,
            due_count: 0,
            far: BTreeMap::new(),
            far_count: 0,
        }
    }

    /// The last tick advanced to.
    pub fn now(&self) -> u64 {
        self.now_tick
    }

    /// Number of live timers.
    pub fn len(&self) -> usize {
        self.live_count
    }

    /// Whether no timer is live.
    pub fn is_empty(&self) -> bool {
        self.live_count == 0
    }

    /// Ticks the ring covers (its slot count).
    pub fn ring_ticks(&self) -> u64 {
        1 << self.ring_bits
    }

    /// Schedules `payload` to fire on the first advance whose tick is `>= deadline_tick`. A
    /// deadline `<= now()` fires on the next advance, even `advance(now())`. O(1) within the
    /// ring's horizon; O(log pages) beyond it.
    ///
    /// # Panics
    ///
    /// If `u32::MAX - 1` timers are already live (the caller bounds timers far below that).
    pub fn insert(&mut self, deadline_tick: u64, payload: T) -> TimerHandle {
        let index = self.allocate(deadline_tick, payload);
        self.place(index);
        TimerHandle {
            index,
            generation: self.entries[index as usize].generation,
        }
    }

    /// Cancels a live timer and returns its payload; `None` if the handle's timer already fired
    /// or was cancelled (whatever now occupies its entry is left alone). O(1) within the ring.
    pub fn cancel(&mut self, handle: TimerHandle) -> Option<T> {
        let index = self.live_index(handle)?;
        self.unlink(index);
        Some(self.release(index))
    }

    /// The deadline of a live timer; `None` if it already fired or was cancelled.
    pub fn deadline(&self, handle: TimerHandle) -> Option<u64> {
        let index = self.live_index(handle)?;
        Some(self.entries[index as usize].deadline_tick)
    }

    /// Moves time forward to `now_tick` and appends to `expired` the payload of every timer whose
    /// deadline is `<= now_tick`, each exactly once. A `now_tick` before `now()` does nothing.
    ///
    /// Order: timers that were already due at insert come first, then tick by tick; within a
    /// tick the order is unspecified.
    pub fn advance(&mut self, now_tick: u64, expired: &mut Vec<T>) {
        let caught_up = self.advance_bounded(now_tick, expired, usize::MAX);
        debug_assert!(caught_up);
    }

    /// Like [`advance`](Self::advance), but stops after the tick with which this call has fired
    /// at least `fired_max` timers (the due list always fires whole, and a tick is never
    /// split). Returns true when time reached `now_tick`; false when timers due by then are
    /// left for the next call (then [`now`](Self::now) is the last tick fired, and
    /// [`next_deadline`](Self::next_deadline) is at most `now_tick`).
    pub fn advance_bounded(
        &mut self,
        now_tick: u64,
        expired: &mut Vec<T>,
        fired_max: usize,
    ) -> bool {
        if now_tick < self.now_tick {
            return true;
        }
        let start = expired.len();
        self.fire_due(expired);
        // Bounded: each pass fires a non-empty slot, moves a page into the ring, or moves time
        // to `now_tick`, to a page's start or by a whole ring; the last happens only while the
        // ring is non-empty, and a ring's worth of time fires every timer it held.
        while self.now_tick < now_tick {
            // The tick before the first page still waiting: time must not pass it unmoved.
            let before_page = self.migrate_due_page().map_or(u64::MAX, |start| start - 1);
            let ring_end = self.now_tick.saturating_add(self.ring_ticks());
            let limit = now_tick.min(ring_end).min(before_page);
            match self.next_ring_slot(limit) {
                Some((slot, tick)) => {
                    self.fire_slot(slot, tick, expired);
                    self.now_tick = tick;
                    if expired.len() - start >= fired_max && tick < now_tick {
                        return false;
                    }
                }
                None if self.ring_is_empty() => self.now_tick = now_tick.min(before_page),
                None => self.now_tick = limit,
            }
        }
        true
    }

    /// The earliest tick at which an advance may have work; `None` when empty.
    ///
    /// Never later than the earliest live deadline; earlier only for a far page, whose start is
    /// returned (an advance there moves the page into the ring). While timers inserted behind
    /// `now()` wait, or a bounded advance left due timers behind, it is `<= now()` + 1.
    pub fn next_deadline(&self) -> Option<u64> {
        let due = (self.due_head != NIL).then_some(self.due_min_tick);
        let ring_end = self.now_tick.saturating_add(self.ring_ticks());
        let ring = self.next_ring_slot(ring_end).map(|(_, tick)| tick);
        let far = self.far.keys().next().map(|&page| page << self.ring_bits);
        [due, ring, far].into_iter().flatten().min()
    }

    fn ring_mask(&self) -> u64 {
        self.ring_ticks() - 1
    }

    fn ring_is_empty(&self) -> bool {
        self.live_count == self.due_count + self.far_count
    }

    /// Moves the first far page into the ring once time is just before its start; returns the
    /// start of the first page still waiting, which is after `now() + 1`.
    fn migrate_due_page(&mut self) -> Option<u64> {
        let (&page, _) = self.far.first_key_value()?;
        let page_start = page << self.ring_bits;
        if page_start > self.now_tick.saturating_add(1) {
            return Some(page_start);
        }
        let mut cursor = self.far.remove(&page).expect("first page");
        // Bounded: the page's list is finite and each step moves one entry.
        while cursor != NIL {
            let next = self.entries[cursor as usize].next;
            self.far_count -= 1;
            self.place(cursor);
            cursor = next;
        }
        self.far.keys().next().map(|&page| page << self.ring_bits)
    }

    /// The first occupied ring slot whose tick is after `now` and at most `limit`.
    fn next_ring_slot(&self, limit: u64) -> Option<(usize, u64)> {
        if limit <= self.now_tick || self.ring_is_empty() {
            return None;
        }
        let first = self.now_tick.wrapping_add(1);
        let start = (first & self.ring_mask()) as usize;
        let slot = self
            .find_occupied(start, self.heads.len())
            .or_else(|| self.find_occupied(0, start))?;
        let offset = (slot as u64).wrapping_sub(first) & self.ring_mask();
        let tick = first + offset;
        (tick <= limit).then_some((slot, tick))
    }

    /// The first occupied slot in `from..to`.
    fn find_occupied(&self, from: usize, to: usize) -> Option<usize> {
        if from >= to {
            return None;
        }
        let word = from / 64;
        let bits = self.occupied[word] & (u64::MAX << (from % 64));
        let found = if bits != 0 {
            Some(word * 64 + bits.trailing_zeros() as usize)
        } else {
            self.find_word_after(word)
                .map(|next| next * 64 + self.occupied[next].trailing_zeros() as usize)
        };
        found.filter(|&slot| slot < to)
    }

    /// The first non-zero bitmap word after `word`, through the summary.
    fn find_word_after(&self, word: usize) -> Option<usize> {
        let from = word + 1;
        let mut index = from / 64;
        if index >= self.summary.len() {
            return None;
        }
        let mut bits = self.summary[index] & (u64::MAX << (from % 64));
        // Bounded by the summary's length (64 words for the largest common ring).
        loop {
            if bits != 0 {
                return Some(index * 64 + bits.trailing_zeros() as usize);
            }
            index += 1;
            bits = *self.summary.get(index)?;
        }
    }

    /// Fires every timer on the due list.
    fn fire_due(&mut self, expired: &mut Vec<T>) {
        let mut cursor = self.due_head;
        self.due_head = NIL;
        self.due_min_tick = u64::MAX;
        self.due_count = 0;
        // Bounded: each step frees one entry of a finite list.
        while cursor != NIL {
            let index = cursor;
            cursor = self.entries[index as usize].next;
            expired.push(self.release(index));
        }
    }

    /// Fires every timer of one ring slot, all due at `tick`.
    fn fire_slot(&mut self, slot: usize, tick: u64, expired: &mut Vec<T>) {
        let mut cursor = self.heads[slot].wrapping_sub(1);
        self.heads[slot] = 0;
        self.clear_bit(slot);
        // Bounded: each step frees one entry of a finite list.
        while cursor != NIL {
            let index = cursor;
            let entry = &self.entries[index as usize];
            debug_assert_eq!(entry.deadline_tick, tick, "a ring slot holds one tick");
            cursor = entry.next;
            expired.push(self.release(index));
        }
    }

    /// Links an unlinked live entry where its deadline belongs now.
    fn place(&mut self, index: u32) {
        let deadline_tick = self.entries[index as usize].deadline_tick;
        if deadline_tick <= self.now_tick {
            self.due_min_tick = self.due_min_tick.min(deadline_tick);
            self.due_count += 1;
            let head = self.due_head;
            self.due_head = index;
            return self.link_before(index, head, LIST_DUE);
        }
        if deadline_tick <= self.now_tick.saturating_add(self.ring_ticks()) {
            let slot = (deadline_tick & self.ring_mask()) as usize;
            let head = self.heads[slot].wrapping_sub(1);
            self.heads[slot] = index + 1;
            self.set_bit(slot);
            return self.link_before(index, head, slot as u32);
        }
        self.far_count += 1;
        let page = deadline_tick >> self.ring_bits;
        let head = self.far.insert(page, index).unwrap_or(NIL);
        self.link_before(index, head, LIST_FAR);
    }

    /// Makes `index` the new head of a list whose old head was `head`.
    fn link_before(&mut self, index: u32, head: u32, list: u32) {
        if head != NIL {
            self.entries[head as usize].prev = index;
        }
        let entry = &mut self.entries[index as usize];
        entry.prev = NIL;
        entry.next = head;
        entry.list = list;
    }

    /// Removes a live entry from its list.
    fn unlink(&mut self, index: u32) {
        let entry = &self.entries[index as usize];
        let (prev, next, list, deadline_tick) =
            (entry.prev, entry.next, entry.list, entry.deadline_tick);
        if next != NIL {
            self.entries[next as usize].prev = prev;
        }
        if prev != NIL {
            self.entries[prev as usize].next = next;
            self.uncount(list);
            return;
        }
        // The entry was its list's head.
        match list {
            LIST_DUE => self.due_head = next,
            LIST_FAR => {
                let page = deadline_tick >> self.ring_bits;
                match next {
                    NIL => self.far.remove(&page),
                    next => self.far.insert(page, next),
                };
            }
            slot => {
                let slot = slot as usize;
                self.heads[slot] = next.wrapping_add(1);
                if next == NIL {
                    self.clear_bit(slot);
                }
            }
        }
        self.uncount(list);
    }

    fn uncount(&mut self, list: u32) {
        match list {
            LIST_DUE => self.due_count -= 1,
            LIST_FAR => self.far_count -= 1,
            _ => {}
        }
    }

    fn set_bit(&mut self, slot: usize) {
        let word = slot / 64;
        if self.occupied[word] == 0 {
            self.summary[word / 64] |= 1 << (word % 64);
        }
        self.occupied[word] |= 1 << (slot % 64);
    }

    fn clear_bit(&mut self, slot: usize) {
        let word = slot / 64;
        self.occupied[word] &= !(1 << (slot % 64));
        if self.occupied[word] == 0 {
            self.summary[word / 64] &= !(1 << (word % 64));
        }
    }

    /// The entry index of a handle's timer if it is still live.
    fn live_index(&self, handle: TimerHandle) -> Option<u32> {
        let entry = self.entries.get(handle.index as usize)?;
        let live = entry.payload.is_some() && entry.generation == handle.generation;
        live.then_some(handle.index)
    }

    /// Takes a free entry (or a new one) and fills it; the entry is not linked yet.
    fn allocate(&mut self, deadline_tick: u64, payload: T) -> u32 {
        let index = if self.free_head != NIL {
            let index = self.free_head;
            self.free_head = self.entries[index as usize].next;
            index
        } else {
            assert!(
                self.entries.len() < NIL as usize - 1,
                "wheel: more than u32::MAX - 1 timers"
            );
            self.entries.push(Entry {
                deadline_tick: 0,
                payload: None,
                prev: NIL,
                next: NIL,
                generation: 0,
                list: LIST_DUE,
            });
            (self.entries.len() - 1) as u32
        };
        let entry = &mut self.entries[index as usize];
        debug_assert!(entry.payload.is_none());
        entry.deadline_tick = deadline_tick;
        entry.payload = Some(payload);
        self.live_count += 1;
        index
    }

    /// Frees an entry that is no longer linked in any list and returns its payload.
    fn release(&mut self, index: u32) -> T {
        let entry = &mut self.entries[index as usize];
        let payload = entry.payload.take().expect("wheel: releasing a free entry");
        entry.generation = entry.generation.wrapping_add(1);
        entry.prev = NIL;
        entry.next = self.free_head;
        self.free_head = index;
        self.live_count -= 1;
        payload
    }
}

mod check;

impl<T> fmt::Debug for Wheel<T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Wheel")
            .field("now_tick", &self.now_tick)
            .field("len", &self.live_count)
            .field("ring_ticks", &(1u64 << self.ring_bits))
            .field("due", &self.due_count)
            .field("far", &self.far_count)
            .finish()
    }
}

#[cfg(test)]
mod tests;
