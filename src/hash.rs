//! FNV-1a, 64 bits: a hash that is stable across builds, platforms and runs, unlike `std`'s
//! hashers. For digests that members or files compare (a shard's state, a cluster's
//! identity), never for anything an adversary could aim at (it is not collision resistant).
//!
//! And the hasher of the in-memory maps keyed by what clients send (keys, sessions, tokens):
//! [`MapHasher`], hashbrown's default (foldhash, seeded at random per process, as the single
//! node's lock table uses), several times cheaper than `std`'s SipHash on short keys.

/// The hasher of the cluster's in-memory maps (see the module docs).
pub type MapHasher = hashbrown::DefaultHashBuilder;
/// A `std` hash map with [`MapHasher`] (make one with `Map::default()`).
pub type Map<K, V> = std::collections::HashMap<K, V, MapHasher>;
/// A `std` hash set with [`MapHasher`] (make one with `Set::default()`).
pub type Set<K> = std::collections::HashSet<K, MapHasher>;

/// An FNV-1a 64 hasher: feed bytes, read the digest.
#[derive(Clone, Debug)]
pub struct Fnv(u64);

impl Default for Fnv {
    fn default() -> Self {
        Fnv::new()
    }
}

impl Fnv {
    /// A hasher with FNV's offset basis.
    pub fn new() -> Self {
        Fnv(0xcbf2_9ce4_8422_2325)
    }

    /// Feeds `bytes`.
    pub fn bytes(&mut self, bytes: &[u8]) {
        for byte in bytes {
            self.0 ^= u64::from(*byte);
            self.0 = self.0.wrapping_mul(0x0100_0000_01b3);
        }
    }

    /// Feeds `value`, big-endian.
    #[cfg(any(test, feature = "testing"))]
    pub fn u64(&mut self, value: u64) {
        self.bytes(&value.to_be_bytes());
    }

    /// The digest of what was fed.
    pub fn finish(&self) -> u64 {
        self.0
    }
}

#[cfg(test)]
mod tests {
    use super::Fnv;

    #[test]
    fn matches_the_published_fnv1a_64_vectors() {
        let digest = |text: &str| {
            let mut fnv = Fnv::new();
            fnv.bytes(text.as_bytes());
            fnv.finish()
        };
        assert_eq!(digest(""), 0xcbf2_9ce4_8422_2325);
        assert_eq!(digest("a"), 0xaf63_dc4c_8601_ec8c);
        assert_eq!(digest("foobar"), 0x85944171f73967e8);
    }
}
