//! Storage that grows in fixed-size chunks and never moves what it holds.
//!
//! A `Vec` that doubles copies everything it holds when it grows: at millions of elements that
//! is tens of milliseconds on the event loop, at one unlucky insert (measured: a lock table
//! growing to 4 M keys held its core for 525 ms). [`ChunkedVec`] grows by adding one chunk of
//! [`CHUNK_LEN`] elements, so a push costs at most one allocation of a chunk; the table of chunk
//! pointers doubles too, but it is 4096 times smaller than the data. [`ChunkedSlab`] adds a free
//! list on top: stable `u32` indices, reused after removal, as `slab::Slab` gives but without
//! its doubling.
//!
//! An index reaches its element through one more indirection than a `Vec` (the chunk table,
//! which stays in cache). Nothing is ever given back to the allocator before the whole
//! container is dropped: the high-water mark stays, like the `Vec`s it replaces.
//!
//! Invariants: every chunk but the last is full; a [`ChunkedSlab`]'s free list holds exactly
//! its vacant slots, and `len()` counts its occupied ones.

use std::ops::{Index, IndexMut};

/// Elements per chunk, as a power of two.
const CHUNK_BITS: u32 = 12;
/// Elements per chunk.
pub const CHUNK_LEN: usize = 1 << CHUNK_BITS;
const CHUNK_MASK: usize = CHUNK_LEN - 1;

/// A growable array in chunks of [`CHUNK_LEN`] elements; elements never move.
pub struct ChunkedVec<T> {
    chunks: Vec<Vec<T>>,
    len: usize,
}

impl<T> Default for ChunkedVec<T> {
    fn default() -> Self {
        ChunkedVec::new()
    }
}

impl<T> ChunkedVec<T> {
    /// An empty array; allocates nothing.
    pub fn new() -> Self {
        ChunkedVec {
            chunks: Vec::new(),
            len: 0,
        }
    }

    /// Elements held.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether no element is held.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Appends `value`; allocates only when the last chunk is full (one chunk, no copy).
    pub fn push(&mut self, value: T) {
        if self.len & CHUNK_MASK == 0 {
            self.chunks.push(Vec::with_capacity(CHUNK_LEN));
        }
        let chunk = self.chunks.last_mut().expect("a chunk with room");
        debug_assert!(chunk.len() < CHUNK_LEN);
        chunk.push(value);
        self.len += 1;
    }

    /// The element at `index`, if any.
    #[inline]
    pub fn get(&self, index: usize) -> Option<&T> {
        self.chunks
            .get(index >> CHUNK_BITS)?
            .get(index & CHUNK_MASK)
    }

    /// The element at `index`, if any, mutably.
    #[inline]
    pub fn get_mut(&mut self, index: usize) -> Option<&mut T> {
        self.chunks
            .get_mut(index >> CHUNK_BITS)?
            .get_mut(index & CHUNK_MASK)
    }

    /// Every element in index order.
    pub fn iter(&self) -> impl Iterator<Item = &T> {
        self.chunks.iter().flatten()
    }
}

impl<T> Index<usize> for ChunkedVec<T> {
    type Output = T;

    #[inline]
    fn index(&self, index: usize) -> &T {
        &self.chunks[index >> CHUNK_BITS][index & CHUNK_MASK]
    }
}

impl<T> IndexMut<usize> for ChunkedVec<T> {
    #[inline]
    fn index_mut(&mut self, index: usize) -> &mut T {
        &mut self.chunks[index >> CHUNK_BITS][index & CHUNK_MASK]
    }
}

/// "No slot" in the free list.
const NONE: u32 = u32::MAX;

enum Slot<T> {
    Occupied(T),
    Vacant { next_free: u32 },
}

/// Values at stable `u32` indices in a [`ChunkedVec`]; a removed value's index is reused.
pub struct ChunkedSlab<T> {
    slots: ChunkedVec<Slot<T>>,
    free_head: u32,
    len: usize,
}

impl<T> Default for ChunkedSlab<T> {
    fn default() -> Self {
        ChunkedSlab::new()
    }
}

impl<T> ChunkedSlab<T> {
    /// An empty slab; allocates nothing.
    pub fn new() -> Self {
        ChunkedSlab {
            slots: ChunkedVec::new(),
            free_head: NONE,
            len: 0,
        }
    }

    /// Values held.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether no value is held.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The index the next [`insert`](Self::insert) will use.
    pub fn vacant_key(&self) -> u32 {
        match self.free_head {
            NONE => self.slots.len() as u32,
            free => free,
        }
    }

    /// Stores `value` and returns its index ([`vacant_key`](Self::vacant_key) before the call).
    ///
    /// # Panics
    ///
    /// When `u32::MAX` values are held (callers bound their counts far below).
    pub fn insert(&mut self, value: T) -> u32 {
        let index = self.vacant_key();
        assert!(index < NONE, "chunked slab full");
        if index as usize == self.slots.len() {
            self.slots.push(Slot::Occupied(value));
        } else {
            let slot = &mut self.slots[index as usize];
            let Slot::Vacant { next_free } = *slot else {
                unreachable!("the free list holds vacant slots only")
            };
            self.free_head = next_free;
            *slot = Slot::Occupied(value);
        }
        self.len += 1;
        index
    }

    /// Removes and returns the value at `index`.
    ///
    /// # Panics
    ///
    /// When `index` holds no value (a caller bug).
    pub fn remove(&mut self, index: u32) -> T {
        let slot = &mut self.slots[index as usize];
        let vacant = Slot::Vacant {
            next_free: self.free_head,
        };
        match std::mem::replace(slot, vacant) {
            Slot::Occupied(value) => {
                self.free_head = index;
                self.len -= 1;
                value
            }
            Slot::Vacant { next_free } => {
                *slot = Slot::Vacant { next_free };
                panic!("chunked slab: removing vacant slot {index}")
            }
        }
    }

    /// The value at `index`, if one is there.
    #[inline]
    pub fn get(&self, index: u32) -> Option<&T> {
        match self.slots.get(index as usize)? {
            Slot::Occupied(value) => Some(value),
            Slot::Vacant { .. } => None,
        }
    }

    /// The value at `index`, if one is there, mutably.
    #[inline]
    pub fn get_mut(&mut self, index: u32) -> Option<&mut T> {
        match self.slots.get_mut(index as usize)? {
            Slot::Occupied(value) => Some(value),
            Slot::Vacant { .. } => None,
        }
    }

    /// Slots in use or vacant: every index below it may hold a value (for resumable scans).
    pub fn slots(&self) -> u32 {
        self.slots.len() as u32
    }

    /// Whether `index` holds a value.
    pub fn contains(&self, index: u32) -> bool {
        self.get(index).is_some()
    }

    /// Every value with its index, in index order.
    pub fn iter(&self) -> impl Iterator<Item = (u32, &T)> {
        self.slots
            .iter()
            .enumerate()
            .filter_map(|(index, slot)| match slot {
                Slot::Occupied(value) => Some((index as u32, value)),
                Slot::Vacant { .. } => None,
            })
    }

    /// Panics unless the free list holds exactly the vacant slots. O(capacity).
    pub fn check_invariants(&self) {
        let vacant = self.slots.len() - self.len;
        let mut cursor = self.free_head;
        for _ in 0..vacant {
            assert!(
                matches!(self.slots.get(cursor as usize), Some(Slot::Vacant { .. })),
                "free list reaches a non-vacant slot"
            );
            let Slot::Vacant { next_free } = self.slots[cursor as usize] else {
                unreachable!()
            };
            cursor = next_free;
        }
        assert_eq!(cursor, NONE, "free list longer than the vacant slots");
        assert_eq!(self.iter().count(), self.len, "len() counts occupied slots");
    }
}

impl<T> Index<u32> for ChunkedSlab<T> {
    type Output = T;

    #[inline]
    fn index(&self, index: u32) -> &T {
        self.get(index).expect("chunked slab: no value at index")
    }
}

impl<T> IndexMut<u32> for ChunkedSlab<T> {
    #[inline]
    fn index_mut(&mut self, index: u32) -> &mut T {
        self.get_mut(index)
            .expect("chunked slab: no value at index")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn vec_grows_across_chunks_without_moving_elements() {
        let mut values = ChunkedVec::new();
        for i in 0..3 * CHUNK_LEN + 5 {
            values.push(i);
        }
        let first = &values[0] as *const usize;
        for i in 0..CHUNK_LEN {
            values.push(i);
        }
        assert_eq!(first, &values[0] as *const usize, "elements never move");
        assert_eq!(values.len(), 4 * CHUNK_LEN + 5);
        assert_eq!(values[CHUNK_LEN + 7], CHUNK_LEN + 7);
        assert_eq!(values.get(values.len()), None);
        assert_eq!(
            values.iter().take(3).copied().collect::<Vec<_>>(),
            [0, 1, 2]
        );
    }

    #[test]
    fn slab_reuses_removed_indices_last_in_first_out() {
        let mut slab = ChunkedSlab::new();
        let keys: Vec<u32> = (0..10).map(|i| slab.insert(i * 10)).collect();
        assert_eq!(keys, (0..10).collect::<Vec<u32>>());
        assert_eq!(slab.remove(3), 30);
        assert_eq!(slab.remove(7), 70);
        assert!(!slab.contains(3));
        assert_eq!(slab.vacant_key(), 7);
        assert_eq!(slab.insert(700), 7);
        assert_eq!(slab.insert(300), 3);
        assert_eq!(slab.vacant_key(), 10);
        assert_eq!(slab.len(), 10);
        assert_eq!(slab[3], 300);
        slab.check_invariants();
    }

    #[test]
    fn slab_matches_a_model_across_chunks() {
        let mut slab = ChunkedSlab::new();
        let mut model = std::collections::BTreeMap::new();
        let mut state = 0x9e37_79b9_7f4a_7c15u64;
        for step in 0..4 * CHUNK_LEN as u64 {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            if state % 3 == 0 && !model.is_empty() {
                let nth = (state as usize / 3) % model.len();
                let key = *model.keys().nth(nth).unwrap();
                assert_eq!(slab.remove(key), model.remove(&key).unwrap());
            } else {
                let key = slab.insert(step);
                assert!(
                    model.insert(key, step).is_none(),
                    "index {key} handed out twice"
                );
            }
        }
        slab.check_invariants();
        assert_eq!(slab.len(), model.len());
        for (key, value) in slab.iter() {
            assert_eq!(model.get(&key), Some(value));
        }
    }

    #[test]
    #[should_panic(expected = "removing vacant slot")]
    fn removing_a_vacant_slot_is_a_bug() {
        let mut slab = ChunkedSlab::new();
        let key = slab.insert(1);
        slab.remove(key);
        slab.remove(key);
    }
}
