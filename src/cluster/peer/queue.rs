//! One peer's outbound queue of encoded envelopes, and the reconnect backoff. No I/O.
//!
//! The queue is one contiguous buffer of envelopes, so a single `write` sends as many as the
//! socket takes (coalescing). Three offsets into it, in order:
//!
//! ```text
//! 0 ..= boundary ..= sent ..= bytes.len()
//!       └ the first envelope not wholly written
//!                   └ what the current connection has been given
//! ```
//!
//! Invariants: `boundary` is always the start of an envelope; `sent - boundary` is less than that
//! envelope's size; `messages` counts the envelopes from `boundary` on. When a connection fails,
//! [`Queue::rewind`] sends the partly written envelope again whole on the next connection (the
//! reader of the old one drops its incomplete tail). Envelopes wholly written to a connection
//! that then fails are lost: raft tolerates loss, and the kernel cannot tell us which arrived.
//!
//! Bounds: at most `messages_max` envelopes and `bytes_max` bytes waiting; a push beyond either
//! is refused (the caller counts the drop) — the newest is dropped, the oldest kept.

use super::frame::{self, EncodeError, LEN_BYTES};
use crate::rng::Rng;
use raft::eraftpb::Message;
use std::time::Duration;

/// Compact once this many bytes before `boundary` are dead (and they are half the buffer).
const COMPACT_BYTES_MIN: usize = 64 << 10;
/// An empty queue's buffer keeps at most this capacity; beyond it, memory goes back.
const IDLE_CAPACITY_MAX: usize = 1 << 20;

/// Why a message was not queued.
#[derive(Debug)]
pub(crate) enum Refused {
    /// The queue holds its maximum of messages or bytes.
    Full,
    /// The message cannot be encoded (too large for an envelope, or protobuf refused it).
    Encode(EncodeError),
}

/// Envelopes waiting for one peer; see the module docs.
pub(crate) struct Queue {
    bytes: Vec<u8>,
    boundary: usize,
    sent: usize,
    messages: usize,
    messages_max: usize,
    bytes_max: usize,
}

impl Queue {
    /// An empty queue holding at most `messages_max` envelopes and `bytes_max` bytes.
    pub(crate) fn new(messages_max: usize, bytes_max: usize) -> Queue {
        Queue {
            bytes: Vec::new(),
            boundary: 0,
            sent: 0,
            messages: 0,
            messages_max,
            bytes_max,
        }
    }

    /// Envelopes waiting (the partly written one included).
    pub(crate) fn messages(&self) -> usize {
        self.messages
    }

    /// Bytes waiting (the partly written envelope whole).
    pub(crate) fn bytes(&self) -> usize {
        self.bytes.len() - self.boundary
    }

    /// Appends the envelope of `message`; on error nothing changed.
    pub(crate) fn push(&mut self, shard: u32, message: &Message) -> Result<(), Refused> {
        let len = frame::encoded_len(message).map_err(Refused::Encode)?;
        if self.messages >= self.messages_max || self.bytes() + len > self.bytes_max {
            return Err(Refused::Full);
        }
        frame::encode(shard, message, &mut self.bytes).map_err(Refused::Encode)?;
        self.messages += 1;
        self.check_invariants();
        Ok(())
    }

    /// What the current connection has not been given yet.
    pub(crate) fn unsent(&self) -> &[u8] {
        &self.bytes[self.sent..]
    }

    /// Records that `written` more bytes were written; returns the envelopes and their bytes
    /// now wholly written.
    pub(crate) fn advance(&mut self, written: usize) -> (u64, u64) {
        assert!(
            written <= self.bytes.len() - self.sent,
            "wrote more than was given"
        );
        self.sent += written;
        let (mut envelopes, start) = (0u64, self.boundary);
        // Bounded: each pass moves `boundary` past one envelope below `sent`.
        while let Some(header) = self.bytes.get(self.boundary..self.boundary + LEN_BYTES) {
            let len = u32::from_be_bytes([header[0], header[1], header[2], header[3]]) as usize;
            let end = self.boundary + LEN_BYTES + len;
            if end > self.sent {
                break;
            }
            self.boundary = end;
            self.messages -= 1;
            envelopes += 1;
        }
        let written_bytes = (self.boundary - start) as u64;
        self.compact();
        self.check_invariants();
        (envelopes, written_bytes)
    }

    /// The connection failed: the partly written envelope goes again whole on the next one.
    pub(crate) fn rewind(&mut self) {
        self.sent = self.boundary;
        self.check_invariants();
    }

    fn compact(&mut self) {
        if self.boundary == self.bytes.len() {
            self.bytes.clear();
            (self.boundary, self.sent) = (0, 0);
            if self.bytes.capacity() > IDLE_CAPACITY_MAX {
                self.bytes.shrink_to(IDLE_CAPACITY_MAX);
            }
        } else if self.boundary >= COMPACT_BYTES_MIN && self.boundary * 2 >= self.bytes.len() {
            self.bytes.drain(..self.boundary);
            self.sent -= self.boundary;
            self.boundary = 0;
        }
    }

    /// Panics if an invariant of the module docs is broken (debug builds and tests).
    pub(crate) fn check_invariants(&self) {
        if !cfg!(debug_assertions) {
            return;
        }
        assert!(self.boundary <= self.sent && self.sent <= self.bytes.len());
        assert!(self.messages <= self.messages_max && self.bytes() <= self.bytes_max);
        assert_eq!(self.messages == 0, self.boundary == self.bytes.len());
        if let Some(header) = self.bytes.get(self.boundary..self.boundary + LEN_BYTES) {
            let len = u32::from_be_bytes([header[0], header[1], header[2], header[3]]) as usize;
            assert!(self.sent < self.boundary + LEN_BYTES + len, "boundary lags");
        }
    }
}

/// Reconnect delays: from `min` doubling to `max`, each one jittered into its upper half by a
/// seeded [`Rng`] (so members that lost each other do not retry in lockstep).
pub(crate) struct Backoff {
    next: Duration,
    min: Duration,
    max: Duration,
    rng: Rng,
}

impl Backoff {
    /// A backoff from `min` to `max`, jittered from `seed`.
    pub(crate) fn new(min: Duration, max: Duration, seed: u64) -> Backoff {
        assert!(min <= max, "backoff min above max");
        Backoff {
            next: min,
            min,
            max,
            rng: Rng::new(seed),
        }
    }

    /// The delay before the next attempt: in `[d/2, d]` for the current step `d`, which then
    /// doubles (up to `max`).
    pub(crate) fn next_delay(&mut self) -> Duration {
        let step = self.next;
        self.next = (step * 2).min(self.max);
        let half = step / 2;
        let spread = (step - half).as_micros() as u64 + 1;
        half + Duration::from_micros(self.rng.next_u64() % spread)
    }

    /// A connection succeeded for long enough: start again from `min`.
    pub(crate) fn reset(&mut self) {
        self.next = self.min;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn message(size: usize) -> Message {
        let mut message = Message::default();
        message.set_context(vec![7u8; size].into());
        message
    }

    #[test]
    fn partial_writes_complete_envelopes_and_rewind_resends_the_partial_one() {
        let mut queue = Queue::new(10, 1 << 20);
        for _ in 0..3 {
            queue.push(0, &message(100)).expect("room");
        }
        let each = queue.bytes() / 3;
        assert_eq!(queue.advance(each - 1), (0, 0));
        assert_eq!(queue.advance(1), (1, each as u64));
        assert_eq!(queue.advance(10), (0, 0));
        queue.rewind();
        assert_eq!((queue.messages(), queue.unsent().len()), (2, 2 * each));
        assert_eq!(queue.advance(2 * each), (2, 2 * each as u64));
        assert_eq!(
            (queue.messages(), queue.bytes(), queue.unsent().len()),
            (0, 0, 0)
        );
    }

    #[test]
    fn a_full_queue_refuses_the_newest_by_count_and_by_bytes() {
        let mut queue = Queue::new(2, 1 << 20);
        queue.push(0, &message(1)).expect("room");
        queue.push(0, &message(1)).expect("room");
        assert!(matches!(queue.push(0, &message(1)), Err(Refused::Full)));
        let mut queue = Queue::new(100, 300);
        queue.push(0, &message(200)).expect("room");
        assert!(matches!(queue.push(0, &message(200)), Err(Refused::Full)));
        queue.push(0, &message(10)).expect("room for a small one");
        assert!(queue.bytes() <= 300);
    }

    #[test]
    fn the_buffer_compacts_and_gives_memory_back() {
        let mut queue = Queue::new(100_000, 64 << 20);
        for _ in 0..1000 {
            queue.push(0, &message(4000)).expect("room");
        }
        let total = queue.bytes();
        assert_eq!(queue.advance(total - 1).0, 999);
        assert!(queue.bytes.len() < total / 2, "compacted");
        queue.advance(1);
        assert_eq!(queue.bytes.len(), 0);
        assert!(queue.bytes.capacity() <= IDLE_CAPACITY_MAX);
    }

    #[test]
    fn backoff_doubles_to_its_max_within_jitter() {
        let (min, max) = (Duration::from_millis(50), Duration::from_secs(1));
        let mut backoff = Backoff::new(min, max, 42);
        let mut step = min;
        for _ in 0..10 {
            let delay = backoff.next_delay();
            assert!(
                delay >= step / 2 && delay <= step,
                "{delay:?} for step {step:?}"
            );
            step = (step * 2).min(max);
        }
        backoff.reset();
        assert!(backoff.next_delay() <= min);
    }
}
