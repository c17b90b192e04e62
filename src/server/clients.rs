//! The server's registry of identified clients (docs/protocol.md §5, resumable calls): each
//! client id a session identified with, the small index partitions know it by
//! ([`ClientRef`]), the identity it is bound to, its grace, and how many sessions speak for it
//! now. Shared by the cores, locked only when a session identifies or closes and when a grace
//! ends (never per request: a session carries its [`ClientRef`]).
//!
//! # Life of a client
//!
//! An Identify creates the record (or finds it) and counts the session; a close of its last
//! session starts its grace. A later Identify within the grace picks the record up again (the
//! partitions kept its waiters and grants); once the grace ends with no session, the core that
//! closed the last session ([`ClientRegistry::expire`]) has every partition let the client go
//! and its index is freed for reuse. A client id is bound to the identities (client certificate
//! names) of the session that created it: another identity's Identify with it is refused.
//!
//! Bounded: at most `max_clients` records ([`ClientRegistry::new`], at most [`CLIENTS_MAX`]);
//! an Identify past them is refused (`X` 10) and counted. A [`ClientRef`] is a slot and the
//! slot's generation: a slot freed when a grace ends is reused under a new generation, so the
//! partitions that have not yet dropped the old client never mistake the new one for it.

/// Identified clients a registry may be sized for (the slot part of a [`ClientRef`]).
pub const CLIENTS_MAX: usize = 1 << SLOT_BITS;
/// Identified clients a server keeps at most: with each partition's bounds per client
/// (`crate::lock_table` keeps at most 1,024 answers of 24 bytes per client), at most about
/// 400 MiB per partition if every one of them filled its records at once.
pub const SERVER_CLIENTS_MAX: usize = 16_384;
const SLOT_BITS: u32 = 16;

use crate::hash::Map as HashMap;
use crate::partition::ClientRef;
use parking_lot::Mutex;

/// Why an Identify was refused.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Refused {
    /// Another identity created this client id.
    Forbidden,
    /// The registry holds `max_clients` records.
    Full,
}

/// One identified client.
#[derive(Debug)]
struct Record {
    client: ClientRef,
    /// The client-certificate identities of the session that created it (sorted).
    identities: Vec<String>,
    grace_s: u8,
    /// Sessions identified with it and not closed.
    sessions: u32,
    /// When its last session closed (server clock, µs), while it has none.
    detached_at_us: Option<u64>,
}

#[derive(Debug, Default)]
struct Inner {
    by_id: HashMap<u128, Record>,
    /// Per slot: the client id using it, and the slot's generation (bumped at each reuse).
    slots: Vec<(Option<u128>, u32)>,
    free: Vec<u32>,
}

impl Inner {
    /// The client id `client` names, if it still does.
    fn id_of(&self, client: ClientRef) -> Option<u128> {
        let slot = (client.0 & ((1 << SLOT_BITS) - 1)) as usize;
        let (id, generation) = *self.slots.get(slot)?;
        (generation == client.0 >> SLOT_BITS)
            .then_some(id)
            .flatten()
    }
}

/// The registry. See the module docs.
#[derive(Debug)]
pub struct ClientRegistry {
    inner: Mutex<Inner>,
    max_clients: usize,
    /// Identifies refused because the registry was full.
    refused_full: std::sync::atomic::AtomicU64,
}

impl ClientRegistry {
    /// An empty registry of at most `max_clients` (at least 1) clients.
    pub fn new(max_clients: usize) -> ClientRegistry {
        assert!((1..=CLIENTS_MAX).contains(&max_clients));
        ClientRegistry {
            inner: Mutex::new(Inner::default()),
            max_clients,
            refused_full: Default::default(),
        }
    }

    /// A session with `identities` identifies as `client` asking `grace_s` (checked by the
    /// caller: 1..=60, client not 0): the client's index and the grace granted (the first
    /// session's; a later Identify does not change it).
    pub fn identify(
        &self,
        client: u128,
        grace_s: u8,
        identities: &[String],
    ) -> Result<(ClientRef, u8), Refused> {
        let mut sorted = identities.to_vec();
        sorted.sort();
        let mut inner = self.inner.lock();
        if let Some(record) = inner.by_id.get_mut(&client) {
            if record.identities != sorted {
                return Err(Refused::Forbidden);
            }
            record.sessions += 1;
            record.detached_at_us = None;
            return Ok((record.client, record.grace_s));
        }
        if inner.by_id.len() >= self.max_clients {
            self.refused_full
                .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            return Err(Refused::Full);
        }
        let slot = match inner.free.pop() {
            Some(slot) => slot,
            None => {
                inner.slots.push((None, 0));
                (inner.slots.len() - 1) as u32
            }
        };
        let occupied = &mut inner.slots[slot as usize];
        occupied.0 = Some(client);
        let client_ref = ClientRef((occupied.1 << SLOT_BITS) | slot);
        let record = Record {
            client: client_ref,
            identities: sorted,
            grace_s,
            sessions: 1,
            detached_at_us: None,
        };
        inner.by_id.insert(client, record);
        Ok((client_ref, grace_s))
    }

    /// A session of `client` closed at `now_us`: when it was the last, the client's grace
    /// starts, and this returns when it ends (µs) for the caller to call
    /// [`expire`](Self::expire) then.
    pub fn session_closed(&self, client: ClientRef, now_us: u64) -> Option<u64> {
        let mut inner = self.inner.lock();
        let id = inner.id_of(client)?;
        let record = inner.by_id.get_mut(&id)?;
        record.sessions = record.sessions.saturating_sub(1);
        if record.sessions > 0 {
            return None;
        }
        record.detached_at_us = Some(now_us);
        Some(now_us + u64::from(record.grace_s) * 1_000_000)
    }

    /// At `now_us`, lets `client` go if its grace ended with no session (true: the caller has
    /// every partition drop it; its index may be reused from now on).
    pub fn expire(&self, client: ClientRef, now_us: u64) -> bool {
        let mut inner = self.inner.lock();
        let Some(id) = inner.id_of(client) else {
            return false;
        };
        let Some(record) = inner.by_id.get(&id) else {
            return false;
        };
        let grace_us = u64::from(record.grace_s) * 1_000_000;
        let over = record
            .detached_at_us
            .is_some_and(|at| record.sessions == 0 && now_us >= at + grace_us);
        if over {
            inner.by_id.remove(&id);
            let slot = client.0 & ((1 << SLOT_BITS) - 1);
            let freed = &mut inner.slots[slot as usize];
            freed.0 = None;
            // The next occupant's generation: wraps within the bits a ClientRef leaves it,
            // skipping the top one so that no ClientRef is ever NONE.
            freed.1 = (freed.1 + 1) % ((1 << (32 - SLOT_BITS)) - 1);
            inner.free.push(slot);
        }
        over
    }

    /// Clients with a record now, and Identifies refused for room so far.
    pub fn counts(&self) -> (usize, u64) {
        let clients = self.inner.lock().by_id.len();
        let refused = self.refused_full.load(std::sync::atomic::Ordering::Relaxed);
        (clients, refused)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_client_lives_while_it_has_sessions_and_for_its_grace_after() {
        let registry = ClientRegistry::new(2);
        let (a, grace) = registry.identify(7, 5, &[]).expect("room");
        assert_eq!(grace, 5);
        let (again, grace) = registry.identify(7, 30, &[]).expect("the same client");
        assert_eq!((again, grace), (a, 5), "the first grace stands");
        assert_eq!(registry.session_closed(a, 1_000), None, "one session left");
        assert_eq!(registry.session_closed(a, 2_000), Some(5_002_000));
        assert!(!registry.expire(a, 5_001_999), "never early");
        // Back within the grace: the expiry armed before finds it alive.
        assert_eq!(registry.identify(7, 5, &[]).expect("back").0, a);
        assert!(!registry.expire(a, 6_000_000));
        assert_eq!(registry.session_closed(a, 7_000_000), Some(12_000_000));
        assert!(registry.expire(a, 12_000_000));
        assert_eq!(registry.counts().0, 0);
        // Its slot is free again, under a new generation.
        let (b, _) = registry.identify(8, 1, &[]).expect("room");
        assert_ne!(b, a);
        assert_eq!(b.0 & 0xffff, a.0 & 0xffff);
        assert_eq!(
            registry.session_closed(a, 13_000_000),
            None,
            "the old ref names nobody"
        );
    }

    #[test]
    fn a_client_id_is_bound_to_its_identity_and_the_registry_is_bounded() {
        let registry = ClientRegistry::new(1);
        let alice = vec!["alice".to_string()];
        registry.identify(7, 5, &alice).expect("room");
        let bob = vec!["bob".to_string()];
        assert_eq!(registry.identify(7, 5, &bob), Err(Refused::Forbidden));
        assert_eq!(registry.identify(7, 5, &[]), Err(Refused::Forbidden));
        assert_eq!(registry.identify(8, 5, &alice), Err(Refused::Full));
        assert_eq!(registry.counts(), (1, 1));
    }
}
