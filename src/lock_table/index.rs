//! A hash table that grows in bounded steps: extendible hashing over hashbrown tables.
//!
//! A single hash table doubles when it fills: it allocates twice the buckets and re-inserts
//! every item at once. At millions of keys that is hundreds of milliseconds on the event loop
//! (measured: 402 ms at 3.67 M keys). [`SegmentedTable`] keeps its items in *segments*, each a
//! hashbrown table of at most about [`SPLIT_AT`] items: a segment that reaches that size splits
//! in two, moving half its items, instead of growing further. So the worst single insert moves
//! a few thousand items, whatever the table's size; a small table is one segment, as compact
//! and cache-friendly as a plain hash table.
//!
//! Which segment holds an item is decided by the top bits of its *tag* (the low 32 bits of the
//! caller's 64-bit hash, kept beside the item): a directory of `2^depth` entries maps the top
//! `depth` bits to a segment; a segment of local depth `L` serves every directory entry that
//! shares its top `L` bits. Keeping the tag means a split or a growth never reads the item's
//! key or entry (no cache miss per item). Inside a segment, hashbrown is given the tag
//! multiplied by an odd constant: its top bits (the in-group filter) then mix every bit of the
//! tag, not only the bits all items of the segment share.
//!
//! Invariants: every segment of local depth `L <= depth` is named by exactly the `2^(depth -
//! L)` directory entries that share its top `L` bits, and holds only items whose tags begin
//! with those bits; `len()` is the sum of the segments' lengths.
//!
//! Not here: what the items mean (the lock table stores entry indices and session lists).

use hashbrown::HashTable;

/// Items a segment holds before it splits (about 0.1 ms of moving, in cache).
pub const SPLIT_AT: usize = 8192;
/// The deepest directory: 2^16 segments, so segments stop splitting past 2^29 items.
const DEPTH_MAX: u32 = 16;
/// Odd multiplier spreading a tag's bits into the hash a segment places it by.
const SPREAD: u64 = 0x9e37_79b9_7f4a_7c15;

struct Segment<V> {
    table: HashTable<(u32, V)>,
    depth: u32,
}

/// Items of type `V` found by a caller-computed 64-bit hash and a caller-supplied equality.
pub struct SegmentedTable<V> {
    directory: Vec<u32>,
    depth: u32,
    segments: Vec<Segment<V>>,
    len: usize,
}

impl<V: Copy> Default for SegmentedTable<V> {
    fn default() -> Self {
        SegmentedTable::new()
    }
}

/// The tag kept beside an item.
#[inline]
fn tag_of(hash: u64) -> u32 {
    hash as u32
}

/// The hash a segment places a tag by.
#[inline]
fn placed(tag: u32) -> u64 {
    u64::from(tag).wrapping_mul(SPREAD)
}

impl<V: Copy> SegmentedTable<V> {
    /// An empty table: one empty segment (it allocates on its first insert).
    pub fn new() -> Self {
        SegmentedTable {
            directory: vec![0],
            depth: 0,
            segments: vec![Segment {
                table: HashTable::new(),
                depth: 0,
            }],
            len: 0,
        }
    }

    /// Items held.
    #[cfg(any(test, feature = "testing"))]
    pub fn len(&self) -> usize {
        self.len
    }

    /// Segments.
    #[cfg(test)]
    pub fn segments(&self) -> usize {
        self.segments.len()
    }

    /// The segment serving `tag`.
    #[inline]
    fn segment_of(&self, tag: u32) -> usize {
        // `checked_shr` because a shift by 32 (depth 0) is out of range for u32.
        let index = tag.checked_shr(32 - self.depth).unwrap_or(0);
        self.directory[index as usize] as usize
    }

    /// The item with `hash` for which `eq` holds.
    #[inline]
    pub fn find(&self, hash: u64, mut eq: impl FnMut(&V) -> bool) -> Option<&V> {
        let tag = tag_of(hash);
        let segment = &self.segments[self.segment_of(tag)];
        let found = segment.table.find(placed(tag), |(t, v)| *t == tag && eq(v));
        found.map(|(_, value)| value)
    }

    /// Adds an item the caller knows is not there yet. Splits at most one segment.
    #[inline]
    pub fn insert_unique(&mut self, hash: u64, value: V) {
        let tag = tag_of(hash);
        let segment = self.segment_for_insert(tag);
        let table = &mut self.segments[segment].table;
        table.insert_unique(placed(tag), (tag, value), |(t, _)| placed(*t));
        self.len += 1;
    }

    /// The item with `hash` for which `eq` holds, inserted from `make` when there is none.
    /// One probe of one segment either way (and a split, on insert, as for `insert_unique`).
    #[inline]
    pub fn find_or_insert(
        &mut self,
        hash: u64,
        mut eq: impl FnMut(&V) -> bool,
        make: impl FnOnce() -> V,
    ) -> &mut V {
        let tag = tag_of(hash);
        let segment = self.segment_for_insert(tag);
        let table = &mut self.segments[segment].table;
        let entry = table.entry(
            placed(tag),
            |(t, v)| *t == tag && eq(v),
            |(t, _)| placed(*t),
        );
        let inserted = matches!(entry, hashbrown::hash_table::Entry::Vacant(_));
        self.len += usize::from(inserted);
        &mut entry.or_insert_with(|| (tag, make())).into_mut().1
    }

    /// Applies `change` to the item with `hash` for which `eq` holds, and removes the item
    /// when `change` returns false. One probe of one segment. False when there is no item.
    #[inline]
    pub fn update_or_remove(
        &mut self,
        hash: u64,
        mut eq: impl FnMut(&V) -> bool,
        change: impl FnOnce(&mut V) -> bool,
    ) -> bool {
        let tag = tag_of(hash);
        let segment = self.segment_of(tag);
        let table = &mut self.segments[segment].table;
        let Ok(mut entry) = table.find_entry(placed(tag), |(t, v)| *t == tag && eq(v)) else {
            return false;
        };
        if !change(&mut entry.get_mut().1) {
            entry.remove();
            self.len -= 1;
        }
        true
    }

    /// Removes and returns the item with `hash` for which `eq` holds.
    #[inline]
    pub fn remove(&mut self, hash: u64, mut eq: impl FnMut(&V) -> bool) -> Option<V> {
        let tag = tag_of(hash);
        let segment = self.segment_of(tag);
        let table = &mut self.segments[segment].table;
        let entry = table.find_entry(placed(tag), |(t, v)| *t == tag && eq(v));
        let ((_, value), _) = entry.ok()?.remove();
        self.len -= 1;
        Some(value)
    }

    /// Every item, in no particular order.
    #[cfg(any(test, feature = "testing"))]
    pub fn iter(&self) -> impl Iterator<Item = &V> {
        let tables = self.segments.iter().map(|segment| &segment.table);
        tables.flat_map(|table| table.iter().map(|(_, value)| value))
    }

    /// The segment to insert `tag` into, after splitting it if it is full.
    #[inline]
    fn segment_for_insert(&mut self, tag: u32) -> usize {
        let segment = self.segment_of(tag);
        let full = self.segments[segment].table.len() >= SPLIT_AT;
        if full && self.segments[segment].depth < DEPTH_MAX {
            self.split(segment);
            return self.segment_of(tag);
        }
        segment
    }

    /// Splits `segment` on the next bit of its tags: the items whose bit is 1 move to a new
    /// segment, and the directory entries that share that bit name it. O(`SPLIT_AT`), plus
    /// O(directory) for the entries and, when the directory must double first, for that.
    #[cold]
    fn split(&mut self, segment: usize) {
        let local = self.segments[segment].depth;
        if local == self.depth {
            let doubled: Vec<u32> = (0..self.directory.len() * 2)
                .map(|index| self.directory[index / 2])
                .collect();
            self.directory = doubled;
            self.depth += 1;
        }
        let bit = 31 - local;
        let mut moved = HashTable::with_capacity(SPLIT_AT);
        self.segments[segment]
            .table
            .retain(|&mut (tag, value)| match tag >> bit & 1 {
                1 => {
                    moved.insert_unique(placed(tag), (tag, value), |(t, _)| placed(*t));
                    false
                }
                _ => true,
            });
        self.segments[segment].depth = local + 1;
        let new = self.segments.len() as u32;
        self.segments.push(Segment {
            table: moved,
            depth: local + 1,
        });
        let shift = self.depth - 1 - local;
        for (index, named) in self.directory.iter_mut().enumerate() {
            if *named as usize == segment && (index >> shift) & 1 == 1 {
                *named = new;
            }
        }
    }

    /// Panics unless the directory and the segments agree (see the module docs).
    #[cfg(any(test, feature = "testing"))]
    pub fn check_invariants(&self) {
        assert_eq!(self.directory.len(), 1 << self.depth);
        let mut named = vec![0usize; self.segments.len()];
        for (index, &segment) in self.directory.iter().enumerate() {
            let local = self.segments[segment as usize].depth;
            assert!(local <= self.depth);
            named[segment as usize] += 1;
            // Every entry naming a segment shares its top `local` bits with the others.
            let first = self
                .directory
                .iter()
                .position(|&s| s == segment)
                .expect("named");
            let shift = self.depth - local;
            assert_eq!(
                index >> shift,
                first >> shift,
                "segment {segment} named apart"
            );
        }
        let mut total = 0;
        for (number, segment) in self.segments.iter().enumerate() {
            assert_eq!(named[number], 1 << (self.depth - segment.depth));
            for &(tag, _) in segment.table.iter() {
                assert_eq!(
                    self.segment_of(tag),
                    number,
                    "tag {tag:#x} in the wrong segment"
                );
            }
            total += segment.table.len();
        }
        assert_eq!(total, self.len);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::hash::BuildHasher;

    #[test]
    fn finds_inserts_and_removes_like_a_map_across_splits() {
        let hasher = hashbrown::DefaultHashBuilder::default();
        let mut table = SegmentedTable::new();
        let mut model = std::collections::HashMap::new();
        for i in 0..50_000u64 {
            let hash = hasher.hash_one(i);
            table.insert_unique(hash, (i, i * 3));
            model.insert(i, i * 3);
        }
        assert!(table.segments() >= 50_000 / SPLIT_AT, "it split as it grew");
        table.check_invariants();
        for i in (0..50_000u64).step_by(3) {
            let hash = hasher.hash_one(i);
            assert_eq!(table.remove(hash, |&(k, _)| k == i), Some((i, i * 3)));
            model.remove(&i);
        }
        assert_eq!(table.len(), model.len());
        for i in 0..50_000u64 {
            let hash = hasher.hash_one(i);
            let found = table.find(hash, |&(k, _)| k == i).map(|&(_, v)| v);
            assert_eq!(found, model.get(&i).copied());
        }
        let one = hasher.hash_one(1u64);
        assert!(table.update_or_remove(
            one,
            |&(k, _)| k == 1,
            |value| {
                value.1 = 7;
                true
            }
        ));
        assert_eq!(table.find(one, |&(k, _)| k == 1), Some(&(1, 7)));
        let (_, value) = table.find_or_insert(one, |&(k, _)| k == 1, || (1, 0));
        assert_eq!(*value, 7, "found, not inserted");
        let three = hasher.hash_one(3u64);
        assert_eq!(
            table.find_or_insert(three, |&(k, _)| k == 3, || (3, 9)).1,
            9
        );
        assert_eq!(
            table.len(),
            model.len() + 1,
            "3 was removed before: inserted again"
        );
        assert!(table.update_or_remove(three, |&(k, _)| k == 3, |_| false));
        assert!(
            !table.update_or_remove(three, |&(k, _)| k == 3, |_| false),
            "removed"
        );
        assert_eq!(table.len(), model.len());
        assert_eq!(table.iter().count(), model.len());
        table.check_invariants();
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

    #[test]
    fn no_insert_moves_more_than_a_segment() {
        // Tags from a counter spread over the top bits: splits happen all along the growth,
        // and each moves at most SPLIT_AT items.
        let mut table = SegmentedTable::new();
        let mut largest = 0;
        for i in 0..200_000u64 {
            let hash = i.wrapping_mul(0x9e37_79b9_7f4a_7c15);
            table.insert_unique(hash, i);
            largest = table
                .segments
                .iter()
                .map(|s| s.table.len())
                .max()
                .unwrap()
                .max(largest);
        }
        assert!(largest <= SPLIT_AT, "a segment grew to {largest} items");
        table.check_invariants();
    }
}
