//! The compactor of a core: encodes frozen shard machines into snapshot bytes, decodes received
//! snapshots into machines, and drops machines the core replaced, off the core's event loop.
//!
//! All three are O(holds) (a shard keeps up to [`crate::config::HOLDS_MAX`] holds), too long for
//! one loop iteration. The core freezes a machine right after applying the index to compact
//! ([`ShardMachine::freeze`]: O(1), the maps are persistent and shared with the live machine),
//! hands the [`Frozen`] image to its compactor ([`Compactor::submit`], never blocks), and goes
//! on applying. The compactor encodes it ([`Frozen::encode`]) and hands back a [`Compacted`]
//! `(shard, index, data)`; the core picks it up in a later iteration
//! ([`Compactor::take_done`]) and calls `Member::compact` with it, which records it in the
//! write-ahead log exactly as before. The snapshot is therefore exactly the state after applying
//! its index, whatever was applied meanwhile; a result that arrives after a received snapshot
//! was restored past its index is refused by `Member::compact` and dropped.
//!
//! A snapshot raft hands out to restore goes the other way ([`Compactor::submit_restore`]):
//! decoded into a machine whose deadlines count from the hand-over ([`RestoreJob`]), handed
//! back ([`Compactor::take_restored`]); the partition holds that shard's committed entries
//! until it installs the machine, then applies them in order.
//!
//! In a server the compactor is [`SnapWorker`]: a thread per core (`latchkey-snap-N`, at a lower
//! priority: [`WORKER_NICE`]), fed
//! over a bounded channel, that wakes the core after each result, like the write-ahead log's
//! writer (`super::writer`). If it dies (a panic), [`Compactor::take_done`] returns an error
//! and the member stops (the process exits 70), as after a writer error: a member that silently
//! stopped compacting would grow its log without bound. The simulations and tests use
//! `MemCompactor`, which runs in the caller's thread, at once or a few iterations late.
//!
//! Deliberately not here: when to compact (the partition: every `compact_every` entries, one
//! compaction in flight per shard), and what the bytes mean (`super::machine::codec`).

use super::machine::{Frozen, ShardMachine};
use super::writer::PanicReport;
#[cfg(any(test, feature = "testing"))]
use crate::rng::Rng;
use crossbeam_channel::{Receiver, Sender, TryRecvError, TrySendError};
#[cfg(any(test, feature = "testing"))]
use std::collections::VecDeque;
use std::io;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, OnceLock};
use std::thread::JoinHandle;

/// Jobs (images to encode, machines to drop) queued to a [`SnapWorker`] at most; a core has at
/// most one image per hosted shard in flight.
pub const JOBS_IN_FLIGHT_MAX: usize = 64;

/// The worker's nice value (Linux: per thread). A worker shares the CPUs with the cores; at a
/// lower priority its O(holds) encodes yield to a core that has work, rather than stretch the
/// core's iterations by a scheduler slice at a time. It still runs whenever a CPU is idle, and
/// gets about a tenth of a contended one.
pub const WORKER_NICE: i32 = 10;

/// A snapshot encoded off the loop: `data` is shard `shard`'s state right after applying
/// `index`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Compacted {
    /// The shard.
    pub shard: u32,
    /// The index the image was frozen at.
    pub index: u64,
    /// The snapshot bytes ([`Frozen::encode`]).
    pub data: Vec<u8>,
}

/// Where a core hands its frozen images and its replaced machines.
pub trait Compactor: Send {
    /// Hands `frozen` over to be encoded; never blocks. Gives it back when the compactor cannot
    /// take it now (full, or failed): the caller freezes again later.
    fn submit(&mut self, frozen: Frozen) -> Result<(), Frozen>;
    /// Drops `machine` (a replaced shard machine) off the loop if it can.
    fn retire(&mut self, machine: ShardMachine);
    /// The snapshots encoded since the last call; an error once the compactor failed (the
    /// member must stop).
    fn take_done(&mut self) -> io::Result<Vec<Compacted>>;
    /// Whether [`take_done`](Self::take_done) (or [`take_restored`](Self::take_restored)) has
    /// something now (a result or a failure).
    fn has_done(&self) -> bool;
    /// Hands a received snapshot over to be decoded into a machine; never blocks. Gives it back
    /// when the compactor cannot take it now (the caller decodes it itself).
    fn submit_restore(&mut self, job: RestoreJob) -> Result<(), RestoreJob> {
        Err(job)
    }
    /// The machines decoded since the last call (a failure of the compactor itself is
    /// [`take_done`](Self::take_done)'s to report).
    fn take_restored(&mut self) -> Vec<Restored> {
        Vec::new()
    }
}

/// A received snapshot to decode off the loop: shard `shard` of `shards` as of `index`, its
/// deadlines counted from `now_ms`, the core's clock when it handed the job over (before the
/// core installs the machine, so every deadline is earlier than the core's own count would
/// make it, but still later than the sender's: the snapshot's remaining times were measured
/// when it was taken, before it was received).
#[derive(Clone, Debug)]
pub struct RestoreJob {
    /// The shard.
    pub shard: u32,
    /// The shard count.
    pub shards: u32,
    /// The last index the snapshot covers.
    pub index: u64,
    /// The snapshot's data, as a shard machine encoded it.
    pub data: bytes::Bytes,
    /// The core's clock when it handed the job over, in ms.
    pub now_ms: u64,
}

impl RestoreJob {
    /// Decodes it: the machine, or why the bytes do not restore.
    pub fn decode(&self) -> Restored {
        let machine = ShardMachine::restore(self.shard, self.shards, &self.data, self.now_ms)
            .map(Box::new)
            .map_err(|error| error.to_string());
        Restored {
            shard: self.shard,
            index: self.index,
            machine,
        }
    }
}

/// A [`RestoreJob`] decoded.
#[derive(Debug)]
pub struct Restored {
    /// The shard.
    pub shard: u32,
    /// The last index the snapshot covers.
    pub index: u64,
    /// The machine, or why the snapshot does not restore.
    pub machine: Result<Box<ShardMachine>, String>,
}

/// What the worker thread tells its core.
struct Shared {
    /// Set once, when the worker died.
    failed: OnceLock<String>,
    /// Set when the core drops its side: queued images are not encoded any more.
    stopping: AtomicBool,
}

enum Job {
    Encode(Frozen),
    Restore(RestoreJob),
    Retire(Box<ShardMachine>),
}

/// A core's compactor thread, from the core's side. Dropping it lets the thread drop what is
/// queued (without encoding it), and waits for it.
pub struct SnapWorker {
    jobs: Option<Sender<Job>>,
    done: Receiver<Compacted>,
    restored: Receiver<Restored>,
    shared: Arc<Shared>,
    thread: Option<JoinHandle<()>>,
}

impl SnapWorker {
    /// Starts the thread `name`; `wake` is called after every result (and on failure), from
    /// the worker's thread.
    pub fn spawn<F>(name: String, wake: F) -> io::Result<SnapWorker>
    where
        F: Fn() + Send + 'static,
    {
        SnapWorker::spawn_with(name, wake, Frozen::encode)
    }

    /// As [`spawn`](Self::spawn), encoding with `encode` (tests make it fail).
    pub fn spawn_with<F, E>(name: String, wake: F, encode: E) -> io::Result<SnapWorker>
    where
        F: Fn() + Send + 'static,
        E: Fn(&Frozen) -> Vec<u8> + Send + 'static,
    {
        let (jobs, job_receiver) = crossbeam_channel::bounded(JOBS_IN_FLIGHT_MAX);
        // Never waits (the core may be dropping its side): bounded by the core, which has one
        // image per hosted shard in flight at most.
        let (done_sender, done) = crossbeam_channel::unbounded();
        // Bounded the same way: one job per restore the core handed over.
        let (restored_sender, restored) = crossbeam_channel::unbounded();
        let shared = Arc::new(Shared {
            failed: OnceLock::new(),
            stopping: AtomicBool::new(false),
        });
        let worker_shared = Arc::clone(&shared);
        let thread = std::thread::Builder::new().name(name).spawn(move || {
            let done = (&done_sender, &restored_sender);
            run(&job_receiver, done, &worker_shared, &wake, &encode);
        })?;
        Ok(SnapWorker {
            jobs: Some(jobs),
            done,
            restored,
            shared,
            thread: Some(thread),
        })
    }

    /// Queues `job` for the thread; gives it back when the queue is full or the thread gone.
    fn send(&self, job: Job) -> Result<(), Job> {
        let Some(jobs) = &self.jobs else {
            return Err(job);
        };
        jobs.try_send(job).map_err(|error| match error {
            TrySendError::Full(job) | TrySendError::Disconnected(job) => job,
        })
    }

    fn failure(&self) -> Option<io::Error> {
        let failed = self.shared.failed.get()?;
        Some(io::Error::other(failed.clone()))
    }
}

impl Compactor for SnapWorker {
    fn submit(&mut self, frozen: Frozen) -> Result<(), Frozen> {
        self.send(Job::Encode(frozen)).map_err(|job| match job {
            Job::Encode(frozen) => frozen,
            Job::Restore(_) | Job::Retire(_) => unreachable!("an encode job was sent"),
        })
    }

    fn retire(&mut self, machine: ShardMachine) {
        if let Err(job) = self.send(Job::Retire(Box::new(machine))) {
            // Dropped here, on the loop: rare (restores are), and bounded.
            log::debug!("the snapshot worker cannot take a replaced machine now");
            drop(job);
        }
    }

    fn take_done(&mut self) -> io::Result<Vec<Compacted>> {
        if let Some(error) = self.failure() {
            return Err(error);
        }
        let mut done = Vec::new();
        loop {
            match self.done.try_recv() {
                Ok(compacted) => done.push(compacted),
                Err(TryRecvError::Empty) => return Ok(done),
                Err(TryRecvError::Disconnected) => {
                    // The thread ended without a failure set: only a panic ends it early.
                    let error = self.failure();
                    return Err(
                        error.unwrap_or_else(|| io::Error::other("the snapshot worker ended"))
                    );
                }
            }
        }
    }

    fn has_done(&self) -> bool {
        self.shared.failed.get().is_some() || !self.done.is_empty() || !self.restored.is_empty()
    }

    fn submit_restore(&mut self, job: RestoreJob) -> Result<(), RestoreJob> {
        self.send(Job::Restore(job)).map_err(|job| match job {
            Job::Restore(job) => job,
            Job::Encode(_) | Job::Retire(_) => unreachable!("a restore job was sent"),
        })
    }

    fn take_restored(&mut self) -> Vec<Restored> {
        self.restored.try_iter().collect()
    }
}

impl Drop for SnapWorker {
    fn drop(&mut self) {
        self.shared.stopping.store(true, Ordering::Release);
        // Closing the channel ends the thread once it dropped what is queued.
        self.jobs = None;
        if let Some(thread) = self.thread.take() {
            if thread.join().is_err() {
                log::error!("a snapshot worker thread panicked");
            }
        }
    }
}

/// The worker thread: jobs until the core hangs up.
fn run(
    jobs: &Receiver<Job>,
    (done, restored): (&Sender<Compacted>, &Sender<Restored>),
    shared: &Shared,
    wake: &dyn Fn(),
    encode: &dyn Fn(&Frozen) -> Vec<u8>,
) {
    // A panic is reported to the core as a failure: otherwise it would wait forever for a
    // result that never comes (and never compact that shard again).
    let _report = PanicReport {
        failed: &shared.failed,
        what: "the snapshot worker thread panicked",
        wake,
    };
    lower_priority();
    while let Ok(job) = jobs.recv() {
        match job {
            Job::Encode(frozen) => {
                if shared.stopping.load(Ordering::Acquire) {
                    continue;
                }
                let compacted = Compacted {
                    shard: frozen.shard(),
                    index: frozen.applied(),
                    data: encode(&frozen),
                };
                // The image shares its maps with the live machine: let go of them first.
                drop(frozen);
                if done.send(compacted).is_err() {
                    return; // the core hung up
                }
                wake();
            }
            Job::Restore(job) => {
                if shared.stopping.load(Ordering::Acquire) {
                    continue;
                }
                if restored.send(job.decode()).is_err() {
                    return; // the core hung up
                }
                wake();
            }
            Job::Retire(machine) => drop(machine),
        }
    }
}

/// Gives the calling thread [`WORKER_NICE`]; failing that, it runs at the normal priority.
fn lower_priority() {
    // SAFETY: setpriority reads its integer arguments only; `who` 0 is the calling thread on
    // Linux (each thread is its own task).
    let result = unsafe { libc::setpriority(libc::PRIO_PROCESS, 0, WORKER_NICE) };
    if result != 0 {
        let error = std::io::Error::last_os_error();
        log::debug!("the snapshot worker keeps the normal priority: {error}");
    }
}

/// How a [`MemCompactor`] delivers.
#[cfg(any(test, feature = "testing"))]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Delivery {
    /// Encoded on submit, ready at the next [`Compactor::take_done`].
    Immediate,
    /// Each image is ready after a random number of later `take_done` calls (0 to `max`),
    /// drawn from a seeded generator: out of submission order, after more entries were
    /// applied or a snapshot restored meanwhile.
    Late { max: u64 },
}

/// A core's compactor in the caller's thread: the simulations' and tests'.
#[cfg(any(test, feature = "testing"))]
#[derive(Debug)]
pub struct MemCompactor {
    delivery: Delivery,
    rng: Rng,
    /// Calls to `take_done` so far.
    polls: u64,
    /// (the poll it is ready at, the image), in submission order.
    queued: VecDeque<(u64, Frozen)>,
    /// (the poll it is ready at, the job), in submission order.
    restores: VecDeque<(u64, RestoreJob)>,
    failed: Option<String>,
    encoded: u64,
    retired: u64,
}

#[cfg(any(test, feature = "testing"))]
impl MemCompactor {
    /// A compactor that encodes at once.
    pub fn immediate() -> MemCompactor {
        MemCompactor {
            delivery: Delivery::Immediate,
            rng: Rng::new(0),
            polls: 0,
            queued: VecDeque::new(),
            restores: VecDeque::new(),
            failed: None,
            encoded: 0,
            retired: 0,
        }
    }

    /// A compactor that delivers each image after 0 to `max` later polls, drawn from `seed`.
    pub fn late(seed: u64, max: u64) -> MemCompactor {
        let mut compactor = MemCompactor::immediate();
        compactor.delivery = Delivery::Late { max };
        compactor.rng = Rng::new(seed);
        compactor
    }

    /// Makes every later [`Compactor::take_done`] fail, as a worker that died.
    pub fn fail(&mut self, why: &str) {
        self.failed = Some(why.to_string());
    }

    /// Images encoded so far.
    pub fn encoded(&self) -> u64 {
        self.encoded
    }

    /// Machines retired so far.
    pub fn retired(&self) -> u64 {
        self.retired
    }

    /// Images handed over and not yet delivered.
    pub fn queued(&self) -> usize {
        self.queued.len()
    }
}

#[cfg(any(test, feature = "testing"))]
impl Compactor for MemCompactor {
    fn submit(&mut self, frozen: Frozen) -> Result<(), Frozen> {
        if self.failed.is_some() {
            return Err(frozen);
        }
        let delay = match self.delivery {
            Delivery::Immediate => 0,
            Delivery::Late { max } => self.rng.between(0, max),
        };
        self.queued.push_back((self.polls + 1 + delay, frozen));
        Ok(())
    }

    fn retire(&mut self, machine: ShardMachine) {
        self.retired += 1;
        drop(machine);
    }

    fn take_done(&mut self) -> io::Result<Vec<Compacted>> {
        if let Some(why) = &self.failed {
            return Err(io::Error::other(why.clone()));
        }
        self.polls += 1;
        let polls = self.polls;
        let mut done = Vec::new();
        let mut waiting = VecDeque::new();
        while let Some((ready_at, frozen)) = self.queued.pop_front() {
            if ready_at <= polls {
                self.encoded += 1;
                done.push(Compacted {
                    shard: frozen.shard(),
                    index: frozen.applied(),
                    data: frozen.encode(),
                });
            } else {
                waiting.push_back((ready_at, frozen));
            }
        }
        self.queued = waiting;
        Ok(done)
    }

    fn has_done(&self) -> bool {
        let next = self.polls + 1;
        self.failed.is_some()
            || self.queued.iter().any(|(ready_at, _)| *ready_at <= next)
            || self.restores.iter().any(|(ready_at, _)| *ready_at <= next)
    }

    /// Immediate: gives the job back (the caller decodes it at once, as before restores went
    /// off the loop); late: delivered after 0 to `max` later polls.
    fn submit_restore(&mut self, job: RestoreJob) -> Result<(), RestoreJob> {
        let delay = match (self.delivery, &self.failed) {
            (Delivery::Immediate, _) | (_, Some(_)) => return Err(job),
            (Delivery::Late { max }, None) => self.rng.between(0, max),
        };
        self.restores.push_back((self.polls + 1 + delay, job));
        Ok(())
    }

    /// Delivers the jobs ready by the last [`Compactor::take_done`] poll, out of submission
    /// order when late.
    fn take_restored(&mut self) -> Vec<Restored> {
        let polls = self.polls;
        let mut done = Vec::new();
        let mut waiting = VecDeque::new();
        while let Some((ready_at, job)) = self.restores.pop_front() {
            if ready_at <= polls {
                done.push(job.decode());
            } else {
                waiting.push_back((ready_at, job));
            }
        }
        self.restores = waiting;
        done
    }
}

#[cfg(test)]
#[path = "compactor_tests.rs"]
mod tests;
