//! A hash table split into segments that grow one at a time, each growth bounded.
//!
//! A single hash table doubles when it fills: it allocates twice the buckets and re-inserts
//! every item at once. At millions of keys that is hundreds of milliseconds on the event loop
//! (measured: 402 ms at 3.67 M keys). [`SegmentedTable`] spreads its items over
//! [`SEGMENTS`] independent tables by hash, so a growth re-inserts one segment only (1/256 of
//! the items), and it keeps 32 bits of each item's hash beside it, so re-inserting never reads
//! the item's key or entry (no cache miss per item).
//!
//! The hash bits: the low 32 bits of a key's 64-bit hash are kept as its *tag*; hashbrown
//! places an item by the low bits of the hash it is given and filters by its top seven, so each
//! segment is given the tag twice over (`tag << 32 | tag`): placement and filter then come
//! from independent bits of the tag (for segments below 2^25 buckets). The segment is chosen by
//! bits 32..40 of the hash, independent of both.
//!
//! Not here: what the items mean (the lock table stores entry indices and session lists).

use hashbrown::HashTable;

/// Independent tables; a growth moves at most one of them.
pub const SEGMENTS: usize = 256;
const SEGMENT_SHIFT: u32 = 32;

/// Items of type `V` found by a caller-computed 64-bit hash and a caller-supplied equality.
pub struct SegmentedTable<V> {
    segments: Box<[HashTable<(u32, V)>]>,
    len: usize,
}

impl<V> Default for SegmentedTable<V> {
    fn default() -> Self {
        SegmentedTable::new()
    }
}

/// The tag kept beside an item, and the hash its segment places it by.
#[inline]
fn split(hash: u64) -> (usize, u32, u64) {
    let segment = (hash >> SEGMENT_SHIFT) as usize % SEGMENTS;
    let tag = hash as u32;
    (segment, tag, rehash(tag))
}

#[inline]
fn rehash(tag: u32) -> u64 {
    (u64::from(tag) << 32) | u64::from(tag)
}

impl<V> SegmentedTable<V> {
    /// An empty table (the segments allocate on their first insert).
    pub fn new() -> Self {
        SegmentedTable {
            segments: (0..SEGMENTS).map(|_| HashTable::new()).collect(),
            len: 0,
        }
    }

    /// Items held.
    pub fn len(&self) -> usize {
        self.len
    }

    /// The item with `hash` for which `eq` holds.
    #[inline]
    pub fn find(&self, hash: u64, mut eq: impl FnMut(&V) -> bool) -> Option<&V> {
        let (segment, tag, placed) = split(hash);
        let found = self.segments[segment].find(placed, |(t, v)| *t == tag && eq(v));
        found.map(|(_, value)| value)
    }

    /// The item with `hash` for which `eq` holds, mutably.
    #[inline]
    pub fn find_mut(&mut self, hash: u64, mut eq: impl FnMut(&V) -> bool) -> Option<&mut V> {
        let (segment, tag, placed) = split(hash);
        let found = self.segments[segment].find_mut(placed, |(t, v)| *t == tag && eq(v));
        found.map(|(_, value)| value)
    }

    /// Adds an item the caller knows is not there yet. Grows at most one segment.
    #[inline]
    pub fn insert_unique(&mut self, hash: u64, value: V) {
        let (segment, tag, placed) = split(hash);
        self.segments[segment].insert_unique(placed, (tag, value), |(t, _)| rehash(*t));
        self.len += 1;
    }

    /// Removes and returns the item with `hash` for which `eq` holds.
    #[inline]
    pub fn remove(&mut self, hash: u64, mut eq: impl FnMut(&V) -> bool) -> Option<V> {
        let (segment, tag, placed) = split(hash);
        let entry = self.segments[segment].find_entry(placed, |(t, v)| *t == tag && eq(v));
        let ((_, value), _) = entry.ok()?.remove();
        self.len -= 1;
        Some(value)
    }

    /// Every item, in no particular order.
    pub fn iter(&self) -> impl Iterator<Item = &V> {
        self.segments
            .iter()
            .flat_map(|segment| segment.iter().map(|(_, value)| value))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::hash::BuildHasher;

    #[test]
    fn finds_inserts_and_removes_like_a_map() {
        let hasher = hashbrown::DefaultHashBuilder::default();
        let mut table = SegmentedTable::new();
        let mut model = std::collections::HashMap::new();
        for i in 0..20_000u64 {
            let hash = hasher.hash_one(i);
            table.insert_unique(hash, (i, i * 3));
            model.insert(i, i * 3);
        }
        for i in (0..20_000u64).step_by(3) {
            let hash = hasher.hash_one(i);
            assert_eq!(table.remove(hash, |&(k, _)| k == i), Some((i, i * 3)));
            model.remove(&i);
        }
        assert_eq!(table.len(), model.len());
        for i in 0..20_000u64 {
            let hash = hasher.hash_one(i);
            let found = table.find(hash, |&(k, _)| k == i).map(|&(_, v)| v);
            assert_eq!(found, model.get(&i).copied());
        }
        if let Some(value) = table.find_mut(hasher.hash_one(1u64), |&(k, _)| k == 1) {
            value.1 = 7;
        }
        assert_eq!(
            table.find(hasher.hash_one(1u64), |&(k, _)| k == 1),
            Some(&(1, 7))
        );
        assert_eq!(table.iter().count(), model.len());
    }

    #[test]
    fn equal_tags_are_told_apart_by_equality() {
        let mut table = SegmentedTable::new();
        // The same hash for two items: the equality decides.
        table.insert_unique(42, 'a');
        table.insert_unique(42, 'b');
        assert_eq!(table.find(42, |&c| c == 'b'), Some(&'b'));
        assert_eq!(table.remove(42, |&c| c == 'a'), Some('a'));
        assert_eq!(table.find(42, |&c| c == 'a'), None);
        assert_eq!(table.len(), 1);
    }
}
