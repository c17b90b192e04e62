//! Which core owns a key, and the messages cores send each other.
//!
//! [`partition_of`](crate::partition::partition_of) is a pure function of the key bytes and the core count, so every core
//! agrees on the owner without sharing anything. A request whose key belongs to another core
//! travels as a [`Msg`] (its key copied once into the message: inline when short, in a buffer
//! of the shared [`KeyPool`] when long, so nothing allocates per request); the answer travels
//! back the same way. Each destination has an [`Outbox`]: messages are queued during a loop
//! iteration and flushed at its end with one `Waker::wake` per destination at most. A bounded
//! channel that is full never blocks a core: the rest of the outbox waits for the next
//! iteration, in order, and an outbox holding [`OUTBOX_REQUESTS_MAX`] requests takes no more
//! until it drains.
//!
//! Ordering: one channel per (source, destination) pair in effect (crossbeam keeps each
//! sender's messages in order), so requests of one session for one key reach the partition in
//! the order sent, and the answers come back in the order produced.

use crate::partition::GrantRef;
use crate::partition::{Answer, ClientRef, Op, SessionId};

use crate::lock_table::INLINE_KEY_BYTES;
use crossbeam_channel::{Receiver, Sender, TrySendError};
use latchkey_client::protocol::KEY_BYTES_MAX;
use mio::Waker;
use std::collections::VecDeque;
use std::sync::Arc;

/// Messages a core's inbox holds at most; past that, senders keep messages in their outbox.
pub const CHANNEL_DEPTH: usize = 65_536;

/// A key as a message carries it: inline when short, in a pooled buffer when long.
#[derive(Debug)]
pub enum MsgKey {
    /// A key of at most [`INLINE_KEY_BYTES`] bytes: `bytes[..len]`.
    Inline {
        /// Length of the key.
        len: u8,
        /// The key, then zeros.
        bytes: [u8; INLINE_KEY_BYTES],
    },
    /// A longer key: `buffer[..len]`, from a [`KeyPool`].
    Pooled {
        /// Length of the key.
        len: u16,
        /// A buffer of the longest key's size.
        buffer: Box<[u8; KEY_BYTES_MAX]>,
    },
}

impl std::ops::Deref for MsgKey {
    type Target = [u8];

    fn deref(&self) -> &[u8] {
        match self {
            MsgKey::Inline { len, bytes } => &bytes[..usize::from(*len)],
            MsgKey::Pooled { len, buffer } => &buffer[..usize::from(*len)],
        }
    }
}

/// Key buffers shared by every core, so that a request with a long key crosses cores without
/// an allocation: any core takes a buffer, any core gives it back after handling the request.
/// A bounded channel (lock-free for these uses): when it is empty a buffer is allocated, when
/// full a returned buffer is freed, so it holds at most [`KEY_POOL_BUFFERS`] idle ones.
#[derive(Clone)]
pub struct KeyPool {
    give: Sender<Box<[u8; KEY_BYTES_MAX]>>,
    take: Receiver<Box<[u8; KEY_BYTES_MAX]>>,
}

/// Idle long-key buffers kept server-wide (4 MiB).
pub const KEY_POOL_BUFFERS: usize = 4096;

impl Default for KeyPool {
    fn default() -> KeyPool {
        let (give, take) = crossbeam_channel::bounded(KEY_POOL_BUFFERS);
        KeyPool { give, take }
    }
}

impl KeyPool {
    /// A copy of `key` for a message.
    pub fn copy(&self, key: &[u8]) -> MsgKey {
        if key.len() <= INLINE_KEY_BYTES {
            let mut bytes = [0u8; INLINE_KEY_BYTES];
            bytes[..key.len()].copy_from_slice(key);
            return MsgKey::Inline {
                len: key.len() as u8,
                bytes,
            };
        }
        let mut buffer = self
            .take
            .try_recv()
            .unwrap_or_else(|_| Box::new([0u8; KEY_BYTES_MAX]));
        buffer[..key.len()].copy_from_slice(key);
        MsgKey::Pooled {
            len: key.len() as u16,
            buffer,
        }
    }

    /// Takes back a message's key buffer, if it has one.
    pub fn give(&self, key: MsgKey) {
        if let MsgKey::Pooled { buffer, .. } = key {
            let _ = self.give.try_send(buffer);
        }
    }

    /// Idle buffers in the pool.
    #[cfg(test)]
    pub fn idle(&self) -> usize {
        self.take.len()
    }
}

/// A message between cores.
#[derive(Debug)]
pub enum Msg {
    /// A request for the destination's partition from a session of the source core.
    Request {
        /// The requesting session.
        session: SessionId,
        /// The client it speaks for, if it identified.
        client: ClientRef,
        /// The request's fixed fields.
        op: Op,
        /// The key, copied once out of the session's read buffer.
        key: MsgKey,
    },
    /// An answer from the source's partition for a session of the destination core.
    Answer {
        /// The answer (for `Acquired`, with the granted key's entry in the source).
        answer: Answer,
        /// The source core: where a grant that cannot be delivered is released.
        from: u32,
    },
    /// The session ended: withdraw its waiters, then acknowledge.
    SessionClosed {
        /// The session.
        session: SessionId,
        /// The client it spoke for, if it identified: its waiters stay, detached.
        client: ClientRef,
    },
    /// The partition has withdrawn the session's waiters; no answer for it follows.
    ClosedAck {
        /// The session.
        session: SessionId,
    },
    /// A grant never reached its session: release it at once (if it still holds the key).
    OrphanRelease {
        /// The grant, as the destination's partition named it.
        grant: GrantRef,
        /// The granted token.
        token: u64,
        /// The client the session spoke for, if it identified: the grant stays for it.
        client: ClientRef,
    },
    /// An identified client's grace ended without a session: let it go.
    ClientGone {
        /// The client.
        client: ClientRef,
    },
    /// A session identified: the client, its client id and its grace, for the partitions
    /// (`Partition::handle_client_known`; rare, boxed to keep the common messages small).
    ClientKnown(Box<(ClientRef, u128, u8)>),
    /// A message of an admin HTTP request (rare; boxed to keep the common ones small).
    Admin(Box<super::admin::AdminMsg>),
}

/// Requests an outbox takes at most while waiting for room in the channel: a session whose
/// next request would go to a full outbox stops being read until it drains (answers,
/// acknowledgements and releases are never held back; their number is bounded by the requests
/// and waiters that cause them).
pub const OUTBOX_REQUESTS_MAX: usize = 4096;

/// The way to one other core: its channel, its waker, and what waits to be sent.
pub struct Outbox {
    sender: Sender<Msg>,
    waker: Arc<Waker>,
    queued: VecDeque<Msg>,
    /// Requests among `queued`.
    requests: usize,
}

impl Outbox {
    /// An empty outbox towards a core.
    pub fn new(sender: Sender<Msg>, waker: Arc<Waker>) -> Outbox {
        Outbox {
            sender,
            waker,
            queued: VecDeque::new(),
            requests: 0,
        }
    }

    /// Queues a message; it is sent at the next [`flush`](Self::flush). A request only while
    /// the outbox is not [full](Self::is_full).
    pub fn push(&mut self, msg: Msg) {
        if matches!(msg, Msg::Request { .. }) {
            debug_assert!(!self.is_full(), "a request pushed to a full outbox");
            self.requests += 1;
        }
        self.queued.push_back(msg);
    }

    /// Whether no more requests may be queued until a flush makes room.
    pub fn is_full(&self) -> bool {
        self.requests >= OUTBOX_REQUESTS_MAX
    }

    /// Whether nothing waits to be sent.
    pub fn is_empty(&self) -> bool {
        self.queued.is_empty()
    }

    /// Messages waiting to be sent.
    #[cfg(any(test, feature = "testing"))]
    pub fn len(&self) -> usize {
        self.queued.len()
    }

    /// Sends what the channel takes, in order, and wakes the destination once if anything
    /// was sent. Returns false when the destination is gone (its core stopped).
    pub fn flush(&mut self) -> bool {
        let mut sent = false;
        while let Some(msg) = self.queued.pop_front() {
            let request = matches!(msg, Msg::Request { .. });
            match self.sender.try_send(msg) {
                Ok(()) => {
                    sent = true;
                    self.requests -= usize::from(request);
                }
                Err(TrySendError::Full(msg)) => {
                    self.queued.push_front(msg);
                    break;
                }
                Err(TrySendError::Disconnected(_)) => {
                    self.queued.clear();
                    self.requests = 0;
                    return false;
                }
            }
        }
        if sent {
            // A failed wake means the destination's poll is gone; its channel says so too.
            let _ = self.waker.wake();
        }
        true
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn long_keys_travel_in_pooled_buffers() {
        let pool = KeyPool::default();
        let short = pool.copy(b"orders/42");
        assert!(matches!(short, MsgKey::Inline { .. }));
        assert_eq!(&*short, b"orders/42");
        let long = vec![b'k'; 300];
        let first = pool.copy(&long);
        assert_eq!(&*first, &long[..]);
        let MsgKey::Pooled { ref buffer, .. } = first else {
            panic!("a long key is pooled")
        };
        let address = buffer.as_ptr();
        pool.give(first);
        assert_eq!(pool.idle(), 1);
        let second = pool.copy(&[b'z'; 1024]);
        let MsgKey::Pooled { ref buffer, .. } = second else {
            panic!("pooled")
        };
        assert_eq!(buffer.as_ptr(), address, "the returned buffer is reused");
        assert_eq!(pool.idle(), 0);
    }
}
