//! The small, fixed set of session slots a client pipelines its calls over.
//!
//! Each slot holds one [`Session`]; a slot whose session has ended gets a new session (a new
//! connection, to the next address in turn) the next time it is picked. Calls are spread over
//! the slots round-robin. A session is started eagerly for every slot when the client is
//! built, so the first call does not pay for the connection.
//!
//! Invariants: at most one live session per slot; a session id is never reused.
//!
//! Deliberately not here: what a call does when its session could not take it (see
//! [`super::Client`]: back off and retry while the request is definitely unsent).

use std::io;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Weak};

use parking_lot::Mutex;

use super::call::Call;
use super::error::SessionFailure;
use super::session::{FailureLog, Session, SessionConfig};

/// Session slots over a list of server addresses.
pub(crate) struct Pool {
    addrs: Vec<SocketAddr>,
    session_config: SessionConfig,
    slots: Vec<Mutex<Option<Arc<Session>>>>,
    next_slot: AtomicUsize,
    next_addr: AtomicUsize,
    next_session_id: AtomicU64,
    failures: FailureLog,
    this: Weak<Pool>,
}

impl Pool {
    /// A pool of `sessions` slots, each already connecting.
    pub(crate) fn start(
        addrs: Vec<SocketAddr>,
        sessions: usize,
        session_config: SessionConfig,
    ) -> io::Result<Arc<Pool>> {
        if addrs.is_empty() || sessions == 0 {
            let message = "a client needs at least one address and one session";
            return Err(io::Error::new(io::ErrorKind::InvalidInput, message));
        }
        let pool = Arc::new_cyclic(|this| Pool {
            addrs,
            session_config,
            slots: (0..sessions).map(|_| Mutex::new(None)).collect(),
            next_slot: AtomicUsize::new(0),
            next_addr: AtomicUsize::new(0),
            next_session_id: AtomicU64::new(1),
            failures: FailureLog::default(),
            this: this.clone(),
        });
        for slot in 0..sessions {
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
        let addr = self.addrs[self.next_addr.fetch_add(1, Ordering::Relaxed) % self.addrs.len()];
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

    /// A live session for the next call, other than session `avoid` when another exists.
    pub(crate) fn pick(&self, avoid: Option<u64>) -> io::Result<Arc<Session>> {
        let count = self.slots.len();
        let start = self.next_slot.fetch_add(1, Ordering::Relaxed);
        let mut fallback = None;
        for offset in 0..count {
            let session = self.slot_session((start + offset) % count)?;
            if Some(session.id()) != avoid {
                return Ok(session);
            }
            fallback = Some(session);
        }
        Ok(fallback.expect("a pool has at least one slot"))
    }

    /// Why the latest session that failed did, if one did.
    pub(crate) fn last_failure(&self) -> Option<SessionFailure> {
        self.failures.lock().clone()
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
