//! [`Wheel::check_invariants`]: the module docs' invariants, walked. Test and debug use only.

use super::{Wheel, LIST_DUE, LIST_FAR, NIL};

impl<T: Copy> Wheel<T> {
    /// Panics if an invariant (see the module docs) is broken. O(timers + free entries +
    /// occupied bitmap words): it walks lists from the bitmaps, so empty ring slots cost
    /// nothing, and a list the bitmaps cannot reach shows up as a count mismatch.
    pub fn check_invariants(&self) {
        let live = self.entries.iter().filter(|e| e.payload.is_some()).count();
        assert_eq!(live, self.live_count, "live entries != len()");
        self.check_free_list();
        let due = self.check_list(self.due_head, LIST_DUE, |deadline| {
            assert!(deadline <= self.now_tick, "due entry not yet due");
            assert!(
                self.due_min_tick <= deadline,
                "due_min above a due deadline"
            );
        });
        assert_eq!(due, self.due_count, "due count");
        let ring = self.check_ring();
        let mut far = 0;
        for (&page, &head) in &self.far {
            assert!(head != NIL, "empty far page {page} kept");
            let page_start = page << self.ring_bits;
            assert!(
                page_start > self.now_tick,
                "far page {page} already started"
            );
            far += self.check_list(head, LIST_FAR, |deadline| {
                assert_eq!(deadline >> self.ring_bits, page, "entry in the wrong page");
            });
        }
        assert_eq!(far, self.far_count, "far count");
        assert_eq!(due + ring + far, self.live_count, "linked entries != len()");
    }

    /// Walks the ring through the bitmaps; returns the entries reached.
    fn check_ring(&self) -> usize {
        let ring_end = self.now_tick.saturating_add(self.ring_ticks());
        let mut reached = 0;
        for (summary_index, &summary) in self.summary.iter().enumerate() {
            for bit in set_bits(summary) {
                let word = summary_index * 64 + bit;
                let word_bits = self.occupied[word];
                assert!(word_bits != 0, "summary bit set for empty word {word}");
                for slot_bit in set_bits(word_bits) {
                    let slot = word * 64 + slot_bit;
                    let head = self.heads[slot].wrapping_sub(1);
                    assert!(head != NIL, "bit set for empty slot {slot}");
                    reached += self.check_list(head, slot as u32, |deadline| {
                        assert!(deadline > self.now_tick, "ring entry not after now");
                        assert!(deadline <= ring_end, "ring entry beyond the ring");
                        let in_slot = (deadline & self.ring_mask()) as usize;
                        assert_eq!(in_slot, slot, "entry in the wrong slot");
                    });
                }
            }
        }
        // A non-empty slot without its bits is unreachable above: the count tells.
        assert_eq!(
            reached,
            self.live_count - self.due_count - self.far_count,
            "ring entries unreachable through the bitmaps"
        );
        reached
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

    /// Walks one list from `head`, checking links, list ids and each deadline; returns its
    /// length.
    fn check_list(&self, head: u32, list: u32, check_deadline: impl Fn(u64)) -> usize {
        let mut previous = NIL;
        let mut cursor = head;
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
            check_deadline(entry.deadline_tick);
            previous = cursor;
            cursor = entry.next;
            length += 1;
        }
        length
    }
}

/// The positions of the set bits of `bits`, lowest first.
fn set_bits(mut bits: u64) -> impl Iterator<Item = usize> {
    std::iter::from_fn(move || {
        (bits != 0).then(|| {
            let bit = bits.trailing_zeros() as usize;
            bits &= bits - 1;
            bit
        })
    })
}
