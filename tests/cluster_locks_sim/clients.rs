//! The simulated clients: what each has in flight, its sessions, and where it thinks the
//! leaders are.
//!
//! A client has at most one request in flight (plus, for an acquire, an optional Cancel of
//! it). `M` means the request had no effect: the client resends it, with the same id, to the
//! member `M` names (or another member when none is named), after a short backoff, at most
//! [`RESENDS_MAX`] times. Every session identifies (its client's `ClientRef` is the client's
//! index), as the official clients' do. An acquire in flight on a session that dies (its
//! member crashed, or the connection was cut) is never resent: the client *resolves* it
//! (docs/protocol.md §5) on the key's leader, following `M`, and acts on the fate — granted
//! (it holds the token for the lease left from the Resolve's send), queued (its acquire waits
//! on that session), timed out, busy, never seen. A Resolve is safe to send again. A release or
//! an extend in flight on a dying session is indeterminate (the client stops counting on it).

use super::world::{MEMBERS, SHARDS};
use latchkey::partition::Op;
use latchkey::rng::Rng;
use std::collections::BTreeMap;

/// Resends of one request after `M`, at most.
pub const RESENDS_MAX: u32 = 200;

/// A client request without its session.
#[derive(Clone, Copy, Debug)]
pub enum Request {
    /// Acquire with a wait and a lease in seconds.
    Acquire {
        /// Correlation id, the same on every resend.
        owner: u64,
        /// Seconds it may queue.
        wait_s: u8,
        /// Seconds of lease.
        lease_s: u8,
    },
    /// Release of a held token.
    Release {
        /// The token.
        token: u64,
    },
    /// Extend of a held token.
    Extend {
        /// The token.
        token: u64,
        /// Seconds of lease.
        lease_s: u8,
    },
    /// Query of a key.
    Query {
        /// Correlation id.
        nonce: u64,
    },
    /// Resolve of an acquire whose session died after it may have been sent: its fields.
    Resolve {
        /// The acquire's owner.
        owner: u64,
        /// Its wait, in seconds.
        wait_s: u8,
        /// Its lease, in seconds.
        lease_s: u8,
    },
}

impl Request {
    /// The wire op.
    pub fn op(&self) -> Op {
        match *self {
            Request::Acquire {
                owner,
                wait_s,
                lease_s,
            } => Op::Acquire {
                wait_s,
                lease_s,
                owner,
            },
            Request::Release { token } => Op::Release { token },
            Request::Extend { token, lease_s } => Op::Extend { lease_s, token },
            Request::Query { nonce } => Op::Query { nonce },
            Request::Resolve { owner, .. } => Op::Resolve { owner },
        }
    }

    /// The id its answers carry.
    pub fn id(&self) -> u64 {
        match *self {
            Request::Acquire { owner, .. } | Request::Resolve { owner, .. } => owner,
            Request::Release { token } | Request::Extend { token, .. } => token,
            Request::Query { nonce } => nonce,
        }
    }
}

/// A request in flight (or waiting to be resent).
#[derive(Clone, Debug)]
pub struct Pending {
    /// What.
    pub request: Request,
    /// On which key.
    pub key: Vec<u8>,
    /// The member and session it was last sent on; `None` while waiting to be resent.
    pub sent: Option<(u64, u64)>,
    /// When it was last sent (global µs).
    pub sent_us: u64,
    /// Resends so far.
    pub resends: u32,
}

/// One simulated client.
#[derive(Clone, Debug)]
pub struct Client {
    /// Its live session per member: member → session.
    pub sessions: BTreeMap<u64, u64>,
    /// The request in flight.
    pub pending: Option<Pending>,
    /// The leader it last heard of, per shard.
    pub leaders: [Option<u64>; SHARDS as usize],
    /// When it acts next (global µs).
    pub next_us: u64,
    /// A liveness probe (acquires one key once, then releases it).
    pub probe: bool,
    /// The token a probe got.
    pub probe_token: Option<u64>,
    /// This client's own choices (so that the order in which a batch of answers is handled
    /// does not change what the others draw).
    pub rng: Rng,
    /// A probe's acquire was granted.
    pub probe_granted: bool,
    /// A probe's acquire ended without a grant (the answer).
    pub probe_failed: Option<char>,
}

impl Client {
    /// A client that first acts at `next_us` and draws from `seed`.
    pub fn new(next_us: u64, seed: u64) -> Client {
        Client {
            rng: Rng::new(seed),
            sessions: BTreeMap::new(),
            pending: None,
            leaders: [None; SHARDS as usize],
            next_us,
            probe: false,
            probe_token: None,
            probe_granted: false,
            probe_failed: None,
        }
    }

    /// Another member than `not`, by a rotating choice.
    pub fn other_member(not: u64, pick: u64) -> u64 {
        let others: Vec<u64> = (1..=MEMBERS).filter(|&m| m != not).collect();
        others[(pick % others.len() as u64) as usize]
    }
}
