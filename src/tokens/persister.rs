//! Keeping each partition's token reservation topped up, with the disk work off the loops.
//!
//! With `tokens.state_dir`, a partition may issue tokens only up to a mark persisted before use
//! ([`crate::tokens`]). Persisting is a create, a write, an fsync, a rename and an fsync of the
//! directory: milliseconds, and unbounded when the disk is slow or failing. So no core does it:
//! one [`Persister`] thread per server does, at the request of a core's [`TokenKeeper`] when
//! the core's reservation is half used. The keeper asks once, goes on issuing from what is
//! left, and raises the table's limit when the thread reports the new mark as persisted.
//!
//! When persisting fails, the thread retries with a backoff (100 ms doubling to 5 s) and logs
//! the failure once, then at most once a minute, and once more when it recovers. Meanwhile the
//! partition issues what is left of its reservation; once that is used up, an Acquire that
//! needs a token gets `B` (docs/protocol.md §3) until a mark is persisted again.
//!
//! Invariant: a table's limit is only ever raised to a mark this thread wrote durably.

use super::StateDir;
use crossbeam_channel::{Receiver, Sender};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// First pause before persisting again after a failure; it doubles up to [`BACKOFF_MAX`].
const BACKOFF_MIN: Duration = Duration::from_millis(100);
const BACKOFF_MAX: Duration = Duration::from_secs(5);
/// A failure is logged at most this often while it lasts.
const FAILURE_LOG_PERIOD: Duration = Duration::from_secs(60);

/// What the keepers and the thread share: the marks persisted per partition.
struct Marks {
    persisted: Box<[AtomicU64]>,
}

/// The thread that writes the marks, and the way to ask it.
pub struct Persister {
    requests: Sender<(usize, u64)>,
    marks: Arc<Marks>,
    thread: JoinHandle<()>,
}

impl Persister {
    /// Starts the thread for `state` and `cores` partitions; it calls `persisted(p)` (which
    /// wakes partition `p`'s core) when `p`'s mark is persisted, stops retrying once
    /// `stopped()` (the server shuts down), and ends when every keeper is gone.
    pub fn start(
        state: StateDir,
        cores: usize,
        persisted: impl Fn(usize) + Send + 'static,
        stopped: impl Fn() -> bool + Send + 'static,
    ) -> std::io::Result<Persister> {
        let (requests, inbox) = crossbeam_channel::bounded(cores);
        let marks = Arc::new(Marks {
            persisted: (0..cores).map(|_| AtomicU64::new(0)).collect(),
        });
        let thread_marks = Arc::clone(&marks);
        let thread = std::thread::Builder::new()
            .name("latchkey-tokens".into())
            .spawn(move || run(&state, &inbox, &thread_marks, &persisted, &stopped))?;
        Ok(Persister {
            requests,
            marks,
            thread,
        })
    }

    /// The keeper of partition `partition`, which issues every `step`-th token and reserves
    /// `reservation` of them at a time.
    pub fn keeper(&self, partition: usize, step: u64, reservation: u64) -> TokenKeeper {
        TokenKeeper {
            partition,
            step,
            reservation,
            link: Some((self.requests.clone(), Arc::clone(&self.marks))),
            requested: None,
        }
    }

    /// Waits for the thread (after every keeper is gone, or `stop` was set).
    pub fn join(self) {
        drop(self.requests);
        let _ = self.thread.join();
    }
}

/// A partition that issues tokens up to a limit its keeper raises (a single node's lock
/// table, [`crate::lock_table::LockTable`]).
pub trait TokenLimit {
    /// Tokens left below the limit.
    fn token_headroom(&self) -> u64;
    /// The next token the partition would issue.
    fn next_token(&self) -> u64;
    /// Raises the limit to `limit` (a mark persisted durably).
    fn raise_token_limit(&mut self, limit: u64);
}

/// The way from a keeper to the thread: its request channel and the marks it reports.
type Link = (Sender<(usize, u64)>, Arc<Marks>);

/// One partition's side: asks for a new mark when the reservation runs low.
pub struct TokenKeeper {
    partition: usize,
    step: u64,
    reservation: u64,
    link: Option<Link>,
    requested: Option<u64>,
}

impl TokenKeeper {
    /// A keeper with nothing to keep (no `state_dir`: tokens are bounded by the clock only).
    pub fn none() -> TokenKeeper {
        TokenKeeper {
            partition: 0,
            step: 1,
            reservation: 0,
            link: None,
            requested: None,
        }
    }

    /// Once per loop iteration: raises the table's limit to a newly persisted mark, or asks
    /// for one when less than half the reservation is left. Never blocks; one atomic load
    /// while a request is out, nothing otherwise.
    pub fn top_up(&mut self, table: &mut impl TokenLimit) {
        let Some((requests, marks)) = &self.link else {
            return;
        };
        if let Some(wanted) = self.requested {
            let persisted = marks.persisted[self.partition].load(Ordering::Acquire);
            if persisted >= wanted {
                table.raise_token_limit(persisted);
                self.requested = None;
            }
            return;
        }
        if table.token_headroom() >= self.reservation / 2 {
            return;
        }
        // The start refused a floor without room for many reservations: this never saturates
        // in practice, and a saturated mark only stops new reservations.
        let mark = table
            .next_token()
            .saturating_add(self.reservation.saturating_mul(self.step));
        if requests.try_send((self.partition, mark)).is_ok() {
            self.requested = Some(mark);
        }
    }
}

fn run(
    state: &StateDir,
    inbox: &Receiver<(usize, u64)>,
    marks: &Marks,
    persisted: &dyn Fn(usize),
    stopped: &dyn Fn() -> bool,
) {
    while let Ok((partition, mark)) = inbox.recv() {
        if !persist_until_done(state, partition, mark, stopped) {
            return;
        }
        marks.persisted[partition].fetch_max(mark, Ordering::AcqRel);
        persisted(partition);
    }
}

/// Persists `mark` for `partition`, retrying with backoff; false when stopped first.
fn persist_until_done(
    state: &StateDir,
    partition: usize,
    mark: u64,
    stopped: &dyn Fn() -> bool,
) -> bool {
    let mut backoff = BACKOFF_MIN;
    let mut failures = 0u64;
    let mut logged_at: Option<Instant> = None;
    // Bounded by the stop flag: a shutdown ends the retries.
    loop {
        match state.persist(partition, mark) {
            Ok(()) => {
                if failures > 0 {
                    log::info!(
                        "core {partition}: token high-water mark persisted again in {} after \
                         {failures} failures",
                        state.path().display()
                    );
                }
                return true;
            }
            Err(error) => {
                failures += 1;
                if logged_at.map_or(true, |at| at.elapsed() >= FAILURE_LOG_PERIOD) {
                    logged_at = Some(Instant::now());
                    log::error!(
                        "core {partition}: cannot persist the token high-water mark in \
                         tokens.state_dir {}: {error} (failure {failures}; retrying; acquires \
                         get B once the current reservation is used up)",
                        state.path().display()
                    );
                }
            }
        }
        let until = Instant::now() + backoff;
        while Instant::now() < until {
            if stopped() {
                return false;
            }
            std::thread::sleep(Duration::from_millis(20).min(backoff));
        }
        backoff = (backoff * 2).min(BACKOFF_MAX);
    }
}
