//! The read buffers of one core's sessions: a `slab` of fixed-size buffers, lent to a session
//! only while it has unparsed bytes, and reused across sessions.
//!
//! Frames are parsed in place from these buffers (see [`latchkey_client::protocol`]). A session borrows
//! a buffer when it reads and gives it back as soon as everything it read was parsed, so an idle
//! session holds none: the buffers in use are those of sessions caught mid-frame or mid-read,
//! not one per connection. Freed buffers stay in the slab for the next reader, up to
//! `kept_max` idle ones; past that they are freed.
//!
//! Invariants: a buffer is lent to at most one session; `idle` lists exactly the slab's
//! buffers not lent.

use slab::Slab;

/// Bytes of one read buffer. Holds many frames, and at least two of the longest.
pub const READ_BUFFER_BYTES: usize = 16 * 1024;

const _: () = assert!(READ_BUFFER_BYTES >= 2 * latchkey_client::protocol::REQUEST_BYTES_MAX);

/// Which buffer a session holds.
pub type BufferId = u32;

/// One core's read buffers.
pub struct ReadBuffers {
    slab: Slab<Box<[u8; READ_BUFFER_BYTES]>>,
    idle: Vec<BufferId>,
    kept_max: usize,
}

impl ReadBuffers {
    /// No buffers yet; at most `kept_max` idle ones are kept for reuse.
    pub fn new(kept_max: usize) -> ReadBuffers {
        ReadBuffers {
            slab: Slab::new(),
            idle: Vec::new(),
            kept_max,
        }
    }

    /// Lends a buffer (an idle one if any).
    pub fn take(&mut self) -> BufferId {
        match self.idle.pop() {
            Some(id) => id,
            None => self.slab.insert(Box::new([0u8; READ_BUFFER_BYTES])) as BufferId,
        }
    }

    /// Takes back a lent buffer.
    pub fn give(&mut self, id: BufferId) {
        if self.idle.len() < self.kept_max {
            self.idle.push(id);
        } else {
            self.slab.remove(id as usize);
        }
    }

    /// The bytes of a lent buffer.
    pub fn get(&self, id: BufferId) -> &[u8; READ_BUFFER_BYTES] {
        &self.slab[id as usize]
    }

    /// The bytes of a lent buffer, mutably.
    pub fn get_mut(&mut self, id: BufferId) -> &mut [u8; READ_BUFFER_BYTES] {
        &mut self.slab[id as usize]
    }

    /// Buffers that exist (lent and idle).
    #[cfg(any(test, feature = "testing"))]
    pub fn allocated(&self) -> usize {
        self.slab.len()
    }

    /// Buffers lent to sessions now.
    #[cfg(any(test, feature = "testing"))]
    pub fn lent(&self) -> usize {
        self.slab.len() - self.idle.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn buffers_are_reused_and_idle_ones_bounded() {
        let mut buffers = ReadBuffers::new(2);
        let ids: Vec<BufferId> = (0..4).map(|_| buffers.take()).collect();
        assert_eq!((buffers.allocated(), buffers.lent()), (4, 4));
        buffers.get_mut(ids[0])[0] = 7;
        for &id in &ids {
            buffers.give(id);
        }
        assert_eq!(buffers.allocated(), 2, "two idle buffers kept, two freed");
        assert_eq!(buffers.lent(), 0);
        let again = buffers.take();
        assert!(ids.contains(&again), "an idle buffer is lent again");
        assert_eq!(buffers.allocated(), 2);
    }
}
