//! Hierarchical timing wheel over `u64` ticks.
//!
//! The lock table arms one timer per lease and per queued waiter; the reactor asks the wheel for
//! [`Wheel::next_deadline`] to bound its poll timeout and calls [`Wheel::advance`] once per loop
//! iteration to collect what expired. Insert and cancel are O(1); advancing costs O(levels) per
//! non-empty slot it crosses plus O(1) per timer it fires or moves down a level, however many
//! ticks it jumps.
//!
//! # Shape
//!
//! [`LEVELS`] levels of 64 slots each. A slot at level `L` spans `64^L` ticks, so eleven levels
//! cover every `u64` deadline. A live timer whose deadline is after `now` lives at the lowest level
//! whose digit (six bits) differs between its deadline and `now`, in the slot named by its
//! deadline's digit at that level. When time reaches the start of a slot above level 0, that
//! slot's timers are fired if due or re-placed at a lower level ("cascading"). Timers whose
//! deadline is already at or behind `now` when they are inserted wait on a separate *due* list
//! that the next [`Wheel::advance`] fires first.
//!
//! Entries live in a slab (a `Vec` with an intrusive free list). Every slot and the due list is
//! an intrusive doubly-linked list of `u32` indices into that slab, and every level has a `u64`
//! occupancy bitmap, so empty slots are skipped without being visited. Once the slab has grown to
//! the high-water mark of live timers, nothing allocates. A [`TimerHandle`] carries the slot's
//! generation, so a handle to a fired or cancelled timer never reaches the slot's next occupant.
//!
//! # Invariants (checked by [`Wheel::check_invariants`])
//!
//! - Every live entry is linked in exactly one list: the due list if its deadline is `<= now`,
//!   otherwise the slot that `(now, deadline)` maps to. No live deadline in a slot is `<= now`.
//! - At level `L`, only slots whose index is greater than `now`'s digit at level `L` can be
//!   occupied, and a level's bitmap has a bit set exactly for its non-empty slots. Hence the
//!   lowest occupied level's first occupied slot is the earliest pending slot.
//! - `len()` equals the number of live entries; the free list holds exactly the other entries.
//!
//! # What it does not do
//!
//! No `Instant`, no clock and no I/O: the reactor converts `Instant` to ticks (1 ms in practice)
//! and passes them in, so tests drive virtual time. It does not sort what one `advance` fires,
//! and it does not reject far-away deadlines (they are simply placed at a high level); bounding
//! how many timers exist and how far ahead they are is the caller's job.

use std::fmt;

/// Bits of a tick consumed by one level.
const SLOT_BITS: u32 = 6;
/// Slots per level: one per value of a six-bit digit.
const SLOTS_PER_LEVEL: usize = 1 << SLOT_BITS;
/// Mask of one six-bit digit.
const SLOT_MASK: u64 = (SLOTS_PER_LEVEL as u64) - 1;
/// Levels needed so that every `u64` deadline has a slot.
pub const LEVELS: usize = 11;
/// Slot lists across all levels.
const SLOTS: usize = LEVELS * SLOTS_PER_LEVEL;
/// List id of the due list (deadline already `<= now` when inserted); slot lists are `0..SLOTS`.
const LIST_DUE: u16 = SLOTS as u16;
/// Number of list heads: every slot plus the due list.
const LISTS: usize = SLOTS + 1;
/// "No entry" in the intrusive links, so the slab holds at most `u32::MAX` entries.
const NIL: u32 = u32::MAX;
/// Most entries the slab can index (indices `0..ENTRIES_MAX`).
const ENTRIES_MAX: usize = NIL as usize;

const _: () = assert!(
    LEVELS as u32 * SLOT_BITS >= u64::BITS,
    "levels must cover all u64"
);
const _: () = assert!(
    (LEVELS as u32 - 1) * SLOT_BITS < u64::BITS,
    "no level beyond u64"
);
const _: () = assert!(
    SLOTS_PER_LEVEL <= u64::BITS as usize,
    "a level's bitmap is one u64"
);
const _: () = assert!(LISTS <= u16::MAX as usize, "list ids fit in u16");

/// Handle to a scheduled timer, returned by [`Wheel::insert`].
///
/// Stays valid until the timer fires or is cancelled; after that, [`Wheel::cancel`] and
/// [`Wheel::deadline`] return `None` for it even once its slab slot holds another timer. (The
/// generation is 32 bits: a handle kept across 2^32 reuses of one slot could alias.)
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct TimerHandle {
    /// Slab index of the entry.
    index: u32,
    /// Generation of the entry when the handle was issued.
    generation: u32,
}

/// One slab entry: a live timer, or a free slot on the free list.
#[derive(Clone, Copy)]
struct Entry<T> {
    /// Tick at or after which the timer fires.
    deadline_tick: u64,
    /// `Some` while the timer is live; `None` while the entry is on the free list.
    payload: Option<T>,
    /// Previous entry in the same list (`NIL` at the head; unused when free).
    prev: u32,
    /// Next entry in the same list or the free list (`NIL` at the tail).
    next: u32,
    /// Bumped every time the entry is freed, to invalidate outstanding handles.
    generation: u32,
    /// Which list a live entry is linked in: a slot id `level * 64 + slot`, or `LIST_DUE`.
    list: u16,
}

/// A hierarchical timing wheel holding payloads of type `T` keyed by `u64` deadline ticks.
///
/// Call order: [`insert`](Wheel::insert) and [`cancel`](Wheel::cancel) at any time; once per
/// loop iteration, read [`next_deadline`](Wheel::next_deadline) to bound the poll timeout and
/// after polling call [`advance`](Wheel::advance) with the current tick to drain expired
/// payloads into a caller-owned `Vec` (reuse it so the hot path does not allocate).
pub struct Wheel<T> {
    /// The last tick advanced to (or the tick given to `new`).
    now_tick: u64,
    /// The slab of entries, live and free.
    entries: Vec<Entry<T>>,
    /// Head of the free list threaded through `Entry::next`.
    free_head: u32,
    /// Number of live timers.
    live_count: usize,
    /// Head of each slot list and, at `LIST_DUE`, of the due list.
    heads: [u32; LISTS],
    /// Per level, bit `s` set iff slot `s` of that level is non-empty.
    occupied: [u64; LEVELS],
    /// Lower bound on the deadlines in the due list; meaningful only while it is non-empty.
    due_min_tick: u64,
}

/// The six-bit digit of `tick` that indexes a slot at `level`.
fn digit(tick: u64, level: usize) -> usize {
    ((tick >> (level as u32 * SLOT_BITS)) & SLOT_MASK) as usize
}

/// The level at which a deadline strictly after `now` is stored: the level of the highest digit
/// in which the two differ.
fn level_for(now_tick: u64, deadline_tick: u64) -> usize {
    debug_assert!(deadline_tick > now_tick);
    let highest_bit = u64::BITS - 1 - (now_tick ^ deadline_tick).leading_zeros();
    (highest_bit / SLOT_BITS) as usize
}

/// First tick covered by `slot` at `level` while the wheel's time is `now`: `now`'s digits above
/// `level`, then `slot`, then zeros.
fn slot_start(now_tick: u64, level: usize, slot: usize) -> u64 {
    let shift = level as u32 * SLOT_BITS;
    let upper_shift = shift + SLOT_BITS;
    let upper = if upper_shift >= u64::BITS {
        0
    } else {
        (now_tick >> upper_shift) << upper_shift
    };
    upper | ((slot as u64) << shift)
}

/// The list (slot id or `LIST_DUE`) that a deadline belongs in while the wheel's time is `now`.
fn list_for(now_tick: u64, deadline_tick: u64) -> u16 {
    if deadline_tick <= now_tick {
        return LIST_DUE;
    }
    let level = level_for(now_tick, deadline_tick);
    (level * SLOTS_PER_LEVEL + digit(deadline_tick, level)) as u16
}

impl<T: Copy> Wheel<T> {
    /// An empty wheel whose current tick is `now_tick`.
    pub fn new(now_tick: u64) -> Self {
        Self::with_capacity(now_tick, 0)
    }

    /// An empty wheel with room for `capacity` live timers before its slab has to grow.
    pub fn with_capacity(now_tick: u64, capacity: usize) -> Self {
        Wheel {
            now_tick,
            entries: Vec::with_capacity(capacity.min(ENTRIES_MAX)),
            free_head: NIL,
            live_count: 0,
            heads: [NIL; LISTS],
            occupied: [0; LEVELS],
            due_min_tick: u64::MAX,
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

    /// Schedules `payload` to fire on the first [`advance`](Wheel::advance) whose tick is
    /// `>= deadline_tick`. A deadline `<= now()` fires on the next `advance` call, even
    /// `advance(now())`. O(1); does not allocate unless the slab is full.
    ///
    /// # Panics
    ///
    /// If `u32::MAX` timers are already live (the caller bounds timers far below that).
    pub fn insert(&mut self, deadline_tick: u64, payload: T) -> TimerHandle {
        let index = self.allocate(deadline_tick, payload);
        let list = list_for(self.now_tick, deadline_tick);
        if list == LIST_DUE {
            self.due_min_tick = self.due_min_tick.min(deadline_tick);
        }
        self.link(index, list);
        TimerHandle {
            index,
            generation: self.entries[index as usize].generation,
        }
    }

    /// Cancels a live timer and returns its payload; `None` if the handle's timer already fired
    /// or was cancelled (whatever now occupies its slab slot is left alone). O(1).
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
    /// Order: timers that were already due at insert come first, then the rest grouped by the
    /// slot they were found in, earliest slot first; within a group the order is unspecified, so
    /// the output is *not* sorted by deadline. Empty slots are skipped via the bitmaps, so a jump
    /// of 2^40 ticks costs no more than a jump across the same non-empty slots.
    pub fn advance(&mut self, now_tick: u64, expired: &mut Vec<T>) {
        if now_tick < self.now_tick {
            return;
        }
        self.fire_due(expired);
        // Each round empties one slot and moves each of its timers down at least one level or
        // fires it, so there are at most `LEVELS` rounds per live timer.
        let mut rounds_left = self.live_count.saturating_mul(LEVELS).saturating_add(1);
        while let Some((level, slot, start_tick)) = self.next_expiration() {
            if start_tick > now_tick {
                break;
            }
            debug_assert!(
                start_tick > self.now_tick,
                "wheel: occupied slot in the past"
            );
            assert!(rounds_left > 0, "wheel: advance did not converge");
            rounds_left -= 1;
            // Stepping to the slot's start keeps every other slot's position valid (they all
            // start later) and puts this slot's not-yet-due timers at lower levels.
            self.now_tick = start_tick;
            self.drain_slot(level, slot, now_tick, expired);
        }
        self.now_tick = now_tick;
    }

    /// The earliest tick at which [`advance`](Wheel::advance) may have work; `None` when empty.
    ///
    /// Never later than the earliest live deadline, but possibly earlier: for a timer above
    /// level 0 it is the start of its slot (a cascade point), where `advance` moves the timer
    /// down without firing it; calling `advance(next_deadline())` repeatedly reaches the real
    /// deadline within [`LEVELS`] calls. While timers inserted behind `now()` are waiting, it
    /// is `<= now()`. O(levels).
    pub fn next_deadline(&self) -> Option<u64> {
        if self.heads[LIST_DUE as usize] != NIL {
            return Some(self.due_min_tick);
        }
        self.next_expiration().map(|(_, _, start_tick)| start_tick)
    }

    /// Panics if an invariant (see the module docs) is broken. O(slab size + slots).
    pub fn check_invariants(&self) {
        assert!(
            self.entries.len() <= ENTRIES_MAX,
            "slab larger than u32 indices allow"
        );
        let live = self.entries.iter().filter(|e| e.payload.is_some()).count();
        assert_eq!(live, self.live_count, "live entries != len()");
        self.check_free_list();
        let mut linked = 0;
        for list in 0..LISTS {
            linked += self.check_list(list as u16);
        }
        assert_eq!(linked, self.live_count, "linked entries != len()");
        for level in 0..LEVELS {
            let bits = self.occupied[level];
            for slot in 0..SLOTS_PER_LEVEL {
                let non_empty = self.heads[level * SLOTS_PER_LEVEL + slot] != NIL;
                assert_eq!(
                    bits >> slot & 1 == 1,
                    non_empty,
                    "bitmap bit {level}/{slot}"
                );
            }
            // Slots at or before now's digit would have been drained already.
            let passed = (1u128 << (digit(self.now_tick, level) + 1)) - 1;
            assert_eq!(
                u128::from(bits) & passed,
                0,
                "occupied passed slot at level {level}"
            );
        }
    }

    /// Walks the free list: every entry on it is free, and it holds every free entry once.
    fn check_free_list(&self) {
        let free_count = self.entries.len() - self.live_count;
        let mut cursor = self.free_head;
        for _ in 0..free_count {
            assert_ne!(cursor, NIL, "free list shorter than free entries");
            let entry = &self.entries[cursor as usize];
            assert!(
                entry.payload.is_none(),
                "live entry {cursor} on the free list"
            );
            cursor = entry.next;
        }
        assert_eq!(
            cursor, NIL,
            "free list longer than free entries (or a cycle)"
        );
    }

    /// Walks one list, checking links and placement; returns its length.
    fn check_list(&self, list: u16) -> usize {
        let mut previous = NIL;
        let mut cursor = self.heads[list as usize];
        let mut length = 0;
        while cursor != NIL {
            assert!(
                length < self.live_count,
                "list {list} longer than len() (or a cycle)"
            );
            let entry = &self.entries[cursor as usize];
            assert!(
                entry.payload.is_some(),
                "free entry {cursor} linked in list {list}"
            );
            assert_eq!(entry.list, list, "entry {cursor} records the wrong list");
            assert_eq!(
                entry.prev, previous,
                "entry {cursor} has a broken prev link"
            );
            let deadline_tick = entry.deadline_tick;
            if list == LIST_DUE {
                assert!(deadline_tick <= self.now_tick, "due entry not yet due");
                assert!(
                    self.due_min_tick <= deadline_tick,
                    "due_min above a due deadline"
                );
            } else {
                assert!(
                    deadline_tick > self.now_tick,
                    "slot holds a deadline <= now"
                );
                let expected = list_for(self.now_tick, deadline_tick);
                assert_eq!(list, expected, "entry {cursor} in the wrong slot");
            }
            previous = cursor;
            cursor = entry.next;
            length += 1;
        }
        length
    }

    /// The earliest non-empty slot as `(level, slot, start_tick)`: the first occupied slot of
    /// the lowest occupied level, since every lower level's slots end before a higher level's
    /// occupied slots begin.
    fn next_expiration(&self) -> Option<(usize, usize, u64)> {
        let level = self.occupied.iter().position(|&bits| bits != 0)?;
        let slot = self.occupied[level].trailing_zeros() as usize;
        Some((level, slot, slot_start(self.now_tick, level, slot)))
    }

    /// Fires every timer on the due list.
    fn fire_due(&mut self, expired: &mut Vec<T>) {
        let mut cursor = self.heads[LIST_DUE as usize];
        self.heads[LIST_DUE as usize] = NIL;
        self.due_min_tick = u64::MAX;
        let mut steps_left = self.live_count;
        while cursor != NIL {
            assert!(steps_left > 0, "wheel: cycle in the due list");
            steps_left -= 1;
            let index = cursor;
            cursor = self.entries[index as usize].next;
            expired.push(self.release(index));
        }
    }

    /// Empties one slot whose start is `now()`: fires its timers due by `target_tick` and
    /// re-places the others, which land at lower levels.
    fn drain_slot(&mut self, level: usize, slot: usize, target_tick: u64, out: &mut Vec<T>) {
        let list = level * SLOTS_PER_LEVEL + slot;
        let mut cursor = self.heads[list];
        self.heads[list] = NIL;
        self.occupied[level] &= !(1u64 << slot);
        let mut steps_left = self.live_count;
        while cursor != NIL {
            assert!(steps_left > 0, "wheel: cycle in slot {level}/{slot}");
            steps_left -= 1;
            let index = cursor;
            let entry = &self.entries[index as usize];
            cursor = entry.next;
            let deadline_tick = entry.deadline_tick;
            if deadline_tick <= target_tick {
                out.push(self.release(index));
            } else {
                let lower = list_for(self.now_tick, deadline_tick);
                debug_assert!(
                    (lower as usize) < list - slot,
                    "cascade must go down a level"
                );
                self.link(index, lower);
            }
        }
    }

    /// The slab index of a handle's timer if it is still live.
    fn live_index(&self, handle: TimerHandle) -> Option<u32> {
        let entry = self.entries.get(handle.index as usize)?;
        let live = entry.payload.is_some() && entry.generation == handle.generation;
        live.then_some(handle.index)
    }

    /// Takes a free entry (or grows the slab) and fills it; the entry is not linked yet.
    fn allocate(&mut self, deadline_tick: u64, payload: T) -> u32 {
        let index = if self.free_head != NIL {
            let index = self.free_head;
            self.free_head = self.entries[index as usize].next;
            index
        } else {
            assert!(
                self.entries.len() < ENTRIES_MAX,
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

    /// Pushes an entry at the head of `list`, setting the slot's occupancy bit.
    fn link(&mut self, index: u32, list: u16) {
        let head = self.heads[list as usize];
        if head != NIL {
            self.entries[head as usize].prev = index;
        }
        let entry = &mut self.entries[index as usize];
        entry.list = list;
        entry.prev = NIL;
        entry.next = head;
        self.heads[list as usize] = index;
        if list != LIST_DUE {
            let (level, slot) = (
                list as usize / SLOTS_PER_LEVEL,
                list as usize % SLOTS_PER_LEVEL,
            );
            self.occupied[level] |= 1u64 << slot;
        }
    }

    /// Removes an entry from its list, clearing the slot's occupancy bit if it empties.
    fn unlink(&mut self, index: u32) {
        let Entry {
            prev, next, list, ..
        } = self.entries[index as usize];
        if prev == NIL {
            self.heads[list as usize] = next;
        } else {
            self.entries[prev as usize].next = next;
        }
        if next != NIL {
            self.entries[next as usize].prev = prev;
        }
        if list != LIST_DUE && self.heads[list as usize] == NIL {
            let (level, slot) = (
                list as usize / SLOTS_PER_LEVEL,
                list as usize % SLOTS_PER_LEVEL,
            );
            self.occupied[level] &= !(1u64 << slot);
        }
    }
}

impl<T> fmt::Debug for Wheel<T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Wheel")
            .field("now_tick", &self.now_tick)
            .field("len", &self.live_count)
            .field("slab_len", &self.entries.len())
            .field("occupied", &format_args!("{:x?}", self.occupied))
            .finish()
    }
}

#[cfg(test)]
mod tests;
