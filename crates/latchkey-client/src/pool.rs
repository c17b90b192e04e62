//! The small, fixed set of session slots a client pipelines its calls over.
//!
//! A pool serves one member address (see `members.rs` for the pools of a cluster's members).
//! Each slot holds one [`Session`]; a slot whose session has ended gets a new session (a new
//! connection to that address) the next time it is picked. Calls are spread over the slots
//! round-robin. The pool of a client's first address starts a session for every slot when the
//! client is built, so the first call does not pay for the connection; the others start
//! their sessions on first use.
//!
//! Invariants: at most one live session per slot; a session id is never reused (the counter
//! is shared by every pool of a client).
//!
//! Deliberately not here: what a call does when its session could not take it (see
//! [`super::Client`]: back off and retry while the request is definitely unsent).

use std::io;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Weak};

use parking_lot::Mutex;

use super::call::Call;
use super::session::{FailureLog, Session, SessionConfig};

/// Session slots to one server address.
pub(crate) struct Pool {
    addr: SocketAddr,
    session_config: SessionConfig,
    slots: Vec<Mutex<Option<Arc<Session>>>>,
    next_slot: AtomicUsize,
    next_session_id: Arc<AtomicU64>,
    failures: FailureLog,
    this: Weak<Pool>,
}

impl Pool {
    /// A pool of `sessions` slots to `addr`, each already connecting when `eager`.
    pub(crate) fn start(
        addr: SocketAddr,
        sessions: usize,
        session_config: SessionConfig,
        next_session_id: Arc<AtomicU64>,
        failures: FailureLog,
        eager: bool,
    ) -> io::Result<Arc<Pool>> {
        if sessions == 0 {
            let message = "a client needs at least one address and one session";
            return Err(io::Error::new(io::ErrorKind::InvalidInput, message));
        }
        let pool = Arc::new_cyclic(|this| Pool {
            addr,
            session_config,
            slots: (0..sessions).map(|_| Mutex::new(None)).collect(),
            next_slot: AtomicUsize::new(0),
            next_session_id,
            failures,
            this: this.clone(),
        });
        for slot in (0..sessions).filter(|_| eager) {
            pool.slot_session(slot)?;
        }
        Ok(pool)
    }

    /// The live session of `slot`, starting a new one if the old one ended.
    fn slot_session(&self, slot: usize) -> io::Result<Arc<Session>> {
        let mut guard = self.slots[slot].lock();
        if let Some(session) = guard.as_ref().filter(|session| !session.is_failed()) {
            return Ok(Arc::clone(session));
        }
        let id = self.next_session_id.fetch_add(1, Ordering::Relaxed);
        let addr = self.addr;
        let pool = self.this.clone();
        let orphans = Box::new(move |call: Call| {
            if let Some(pool) = pool.upgrade() {
                pool.submit_background(call);
            }
        });
        let failures = Arc::clone(&self.failures);
        let session = Session::spawn(id, addr, self.session_config.clone(), orphans, failures)?;
        let session = Arc::new(session);
        *guard = Some(Arc::clone(&session));
        Ok(session)
    }

    /// A live session for the next call: one that is neither session `avoid` nor stalled
    /// when one exists, else one that is not stalled, else any (a stalled session refuses the
    /// call, which then goes to another member).
    pub(crate) fn pick(&self, avoid: Option<u64>) -> io::Result<Arc<Session>> {
        let count = self.slots.len();
        let start = self.next_slot.fetch_add(1, Ordering::Relaxed);
        let mut fallback: Option<Arc<Session>> = None;
        for offset in 0..count {
            let session = self.slot_session((start + offset) % count)?;
            if Some(session.id()) != avoid && !session.is_stalled() {
                return Ok(session);
            }
            if fallback.as_ref().map_or(true, |other| other.is_stalled()) {
                fallback = Some(session);
            }
        }
        Ok(fallback.expect("a pool has at least one slot"))
    }

    /// Wakes every live session of the pool.
    pub(crate) fn wake_all(&self) {
        for slot in &self.slots {
            if let Some(session) = slot.lock().as_ref() {
                session.wake();
            }
        }
    }

    /// Hands a fire-and-forget call (a background release) to some session; dropped if none
    /// takes it (the lease recovers the hold).
    pub(crate) fn submit_background(&self, mut call: Call) {
        let mut avoid = None;
        for _ in 0..self.slots.len() {
            let Ok(session) = self.pick(avoid) else { break };
            match session.submit(call) {
                Ok(()) => return,
                Err(refused) => {
                    call = refused;
                    avoid = Some(session.id());
                }
            }
        }
        log::debug!("background {:?} dropped: no session took it", call.op);
    }
}
