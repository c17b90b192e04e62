//! How a partition keeps its keys: inline when short, in recycled boxes when long.
//!
//! Most keys are short: up to [`INLINE_KEY_BYTES`] bytes live inside their entry. A longer key
//! lives in a box whose size is its length rounded up to a power of two (32 to 1024 bytes);
//! when the key is freed its box goes back to a [`KeyStore`] free list of that size, and the
//! next long key of that size takes it. So a steady stream of long-key acquires and releases
//! allocates nothing: only a growing number of held long keys does.
//!
//! Invariant: a boxed key's box is exactly its size class; each free list holds boxes of its
//! class only, at most [`KEPT_PER_CLASS`] of them.

use latchkey_client::protocol::KEY_BYTES_MAX;

/// Keys up to this many bytes are stored inline in their entry, without an allocation.
pub const INLINE_KEY_BYTES: usize = 22;
/// The smallest boxed size class, in bytes.
const CLASS_MIN_BYTES: usize = 32;
/// Size classes: 32, 64, ..., 1024 bytes.
const CLASSES: usize = 6;
/// Free boxes kept per size class; more are freed.
pub const KEPT_PER_CLASS: usize = 1024;

const _: () = assert!(CLASS_MIN_BYTES << (CLASSES - 1) == KEY_BYTES_MAX);
const _: () = assert!(INLINE_KEY_BYTES < CLASS_MIN_BYTES);

/// A key stored inline when short, in a size-class box when long.
#[derive(Debug)]
pub enum KeyBytes {
    /// A key of at most [`INLINE_KEY_BYTES`] bytes: `bytes[..len]`.
    Inline {
        /// Length of the key.
        len: u8,
        /// The key, then zeros.
        bytes: [u8; INLINE_KEY_BYTES],
    },
    /// A longer key: `bytes[..len]` of a box of its size class.
    Boxed {
        /// Length of the key.
        len: u16,
        /// The box.
        bytes: Box<[u8]>,
    },
}

/// The size class of a key longer than the inline limit.
fn class_of(len: usize) -> usize {
    debug_assert!(len > INLINE_KEY_BYTES && len <= KEY_BYTES_MAX);
    let size = len.next_power_of_two().max(CLASS_MIN_BYTES);
    (size / CLASS_MIN_BYTES).trailing_zeros() as usize
}

impl KeyBytes {
    /// A copy of `key` (at most [`KEY_BYTES_MAX`] bytes), allocating when it is long.
    #[cfg(any(test, feature = "testing"))]
    pub fn new(key: &[u8]) -> KeyBytes {
        KeyStore::default().store(key)
    }

    /// The key.
    pub fn as_slice(&self) -> &[u8] {
        match self {
            KeyBytes::Inline { len, bytes } => &bytes[..usize::from(*len)],
            KeyBytes::Boxed { len, bytes } => &bytes[..usize::from(*len)],
        }
    }
}

impl std::ops::Deref for KeyBytes {
    type Target = [u8];

    fn deref(&self) -> &[u8] {
        self.as_slice()
    }
}

/// Free boxes of each size class, for the long keys of one partition.
#[derive(Default)]
pub struct KeyStore {
    free: [Vec<Box<[u8]>>; CLASSES],
}

impl KeyStore {
    /// A copy of `key`, in a recycled box when one of its class is free.
    pub fn store(&mut self, key: &[u8]) -> KeyBytes {
        assert!(key.len() <= KEY_BYTES_MAX, "keys are checked by the parser");
        if key.len() <= INLINE_KEY_BYTES {
            let mut bytes = [0u8; INLINE_KEY_BYTES];
            bytes[..key.len()].copy_from_slice(key);
            return KeyBytes::Inline {
                len: key.len() as u8,
                bytes,
            };
        }
        let class = class_of(key.len());
        let mut bytes = self.free[class]
            .pop()
            .unwrap_or_else(|| vec![0u8; CLASS_MIN_BYTES << class].into_boxed_slice());
        bytes[..key.len()].copy_from_slice(key);
        KeyBytes::Boxed {
            len: key.len() as u16,
            bytes,
        }
    }

    /// Takes back a key's box, if it has one, for the next key of its class.
    pub fn recycle(&mut self, key: KeyBytes) {
        if let KeyBytes::Boxed { len, bytes } = key {
            let class = class_of(usize::from(len));
            debug_assert_eq!(bytes.len(), CLASS_MIN_BYTES << class);
            if self.free[class].len() < KEPT_PER_CLASS {
                self.free[class].push(bytes);
            }
        }
    }

    /// Free boxes kept now, over all classes.
    #[cfg(test)]
    pub fn kept(&self) -> usize {
        self.free.iter().map(Vec::len).sum()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn short_keys_are_inline_and_long_keys_reuse_boxes_of_their_class() {
        let mut store = KeyStore::default();
        let short = store.store(b"orders/42");
        assert!(matches!(short, KeyBytes::Inline { .. }));
        assert_eq!(short.as_slice(), b"orders/42");
        let long = vec![b'k'; 40];
        let first = store.store(&long);
        let KeyBytes::Boxed { ref bytes, .. } = first else {
            panic!("a 40-byte key is boxed")
        };
        assert_eq!(bytes.len(), 64, "rounded up to its class");
        let address = bytes.as_ptr();
        assert_eq!(first.as_slice(), &long[..]);
        store.recycle(first);
        assert_eq!(store.kept(), 1);
        let other = vec![b'z'; 63];
        let second = store.store(&other);
        let KeyBytes::Boxed { ref bytes, .. } = second else {
            panic!("boxed")
        };
        assert_eq!(
            bytes.as_ptr(),
            address,
            "the freed box of the class is reused"
        );
        assert_eq!(second.as_slice(), &other[..]);
        assert_eq!(store.kept(), 0);
        let longest = store.store(&[b'x'; KEY_BYTES_MAX]);
        assert_eq!(longest.len(), KEY_BYTES_MAX);
    }

    #[test]
    fn classes_cover_every_long_length() {
        assert_eq!(class_of(INLINE_KEY_BYTES + 1), 0);
        assert_eq!(class_of(32), 0);
        assert_eq!(class_of(33), 1);
        assert_eq!(class_of(KEY_BYTES_MAX), CLASSES - 1);
    }
}
