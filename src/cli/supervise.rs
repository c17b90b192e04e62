//! Running CMD under the lock for `latchkey lock`: waiting for it, extending the lease every
//! lease/3 while it runs, forwarding signals to it, and signalling it when the lease is lost
//! (SIGTERM, then SIGKILL after the grace).
//!
//! An extend the server refuses to this client's identity (`X` 8) is not retried: it is said
//! once, and the lease counts as lost when the ticket's validity bound passes unconfirmed.
//! An extend that fails for a transport reason (no session, no answer: e.g. a cluster's leader
//! changing) is tried again — an extend of the same token is safe to repeat — every
//! [`EXTEND_RETRY`] at most, and sooner as the validity bound nears (a quarter of what is left
//! of it), until the bound passes: then the lease counts as lost.
//!
//! Signals for CMD go to its process group when it has one (`child.rs`): a lost lease or a
//! forwarded signal then reaches what CMD started too.
//!
//! Invariant: CMD is reaped only by [`supervise`], after every thread that may signal it has
//! stopped and its guard stood down, so a signal never reaches a recycled pid. Deliberately
//! not here: starting CMD (`child.rs`), taking the lock and the exit codes of the other
//! outcomes (see [`super`]).

use std::io;
use std::os::unix::process::ExitStatusExt;
use std::process::ExitStatus;
use std::sync::Arc;
use std::thread;
use std::time::{Duration, Instant};

use crossbeam_channel::{Receiver, RecvTimeoutError, Sender};

use super::child::Started;
use super::format_duration;
use super::messages::{unavailable_text, Tried};
use super::{shown_key, LockArgs, LockExit, EXIT_INDETERMINATE, EXIT_LEASE_LOST, FORBIDDEN_TEXT};
use latchkey_client::protocol::ErrorCode;
use latchkey_client::{Client, ExtendOutcome, ReleaseOutcome, RequestError, Ticket};

/// How soon a failed extend is tried again (never later than lease/3).
const EXTEND_RETRY: Duration = Duration::from_millis(500);
/// The shortest pause between two failed extends (a leader election takes some time).
const EXTEND_RETRY_MIN: Duration = Duration::from_millis(20);

/// What the supervisor hears about.
enum Event {
    /// CMD has exited (not reaped yet, so its pid cannot be reused meanwhile).
    Exited,
    /// The extender learned the lease is lost.
    Lost(String),
    /// `latchkey lock` received this signal; forward it.
    Signal(i32),
}

/// SIGINT, SIGTERM and SIGHUP, caught from `latchkey lock`'s start: none of them ends it
/// between the grant and CMD's start (which would leave the lock held until its lease ends).
/// While the acquire is in flight one withdraws it ([`super::acquire_with_notice`]); caught
/// before CMD starts, CMD never runs (a lock granted is released); then it is forwarded to CMD
/// ([`supervise`]).
pub(super) struct Caught {
    signals: Receiver<i32>,
    /// Gives a signal back to [`Caught::pending`] (one caught as the acquire returned).
    requeue: Sender<i32>,
    handle: signal_hook::iterator::Handle,
}

impl Caught {
    /// Catches the three signals from now on; `None` (said) if they cannot be caught.
    pub(super) fn catch() -> Option<Caught> {
        use signal_hook::consts::{SIGHUP, SIGINT, SIGTERM};
        let mut signals = match signal_hook::iterator::Signals::new([SIGINT, SIGTERM, SIGHUP]) {
            Ok(signals) => signals,
            Err(error) => {
                eprintln!("latchkey lock: cannot catch signals: {error}");
                return None;
            }
        };
        let handle = signals.handle();
        let (requeue, caught) = crossbeam_channel::unbounded();
        let tx = requeue.clone();
        // Ends when the handle is closed (when `Caught` is dropped).
        thread::spawn(move || {
            for signal in signals.forever() {
                if tx.send(signal).is_err() {
                    return;
                }
            }
        });
        Some(Caught {
            signals: caught,
            requeue,
            handle,
        })
    }

    /// The signals as they are caught.
    pub(super) fn receiver(&self) -> &Receiver<i32> {
        &self.signals
    }

    /// Hands `signal` back, to be seen by the next [`Caught::pending`] or by [`supervise`].
    pub(super) fn requeue(&self, signal: i32) {
        let _ = self.requeue.send(signal);
    }

    /// A signal caught and not handled yet.
    pub(super) fn pending(&self) -> Option<i32> {
        self.signals.try_recv().ok()
    }
}

/// The name of a signal [`Caught`] catches.
pub(super) fn signal_name(signal: i32) -> String {
    match signal {
        libc::SIGINT => "SIGINT".into(),
        libc::SIGTERM => "SIGTERM".into(),
        libc::SIGHUP => "SIGHUP".into(),
        other => format!("signal {other}"),
    }
}

impl Drop for Caught {
    fn drop(&mut self) {
        self.handle.close();
    }
}

/// Runs CMD to its end under the lock, forwarding `caught` signals to it; returns how
/// `latchkey lock` exits.
pub(super) fn supervise(
    started: Started,
    ticket: Ticket,
    args: &LockArgs,
    caught: Option<Caught>,
) -> LockExit {
    let Started {
        mut child,
        target,
        guard,
    } = started;
    let pid = child.id() as libc::pid_t;
    let ticket = Arc::new(ticket);
    let (events_tx, events) = crossbeam_channel::unbounded();
    let (stop_tx, stop) = crossbeam_channel::bounded::<()>(0);
    let waiter_tx = events_tx.clone();
    thread::spawn(move || {
        wait_for_exit(pid);
        let _ = waiter_tx.send(Event::Exited);
    });
    let extender = {
        let (ticket, lease, events_tx) = (Arc::clone(&ticket), args.lease, events_tx.clone());
        thread::spawn(move || extend_until_stopped(&ticket, lease, &stop, &events_tx))
    };
    // Ends when `caught` is dropped below (its senders are gone then); a signal caught before
    // CMD started is forwarded as soon as it runs.
    let forwarder = caught.as_ref().map(|caught| {
        let signals = caught.receiver().clone();
        thread::spawn(move || {
            for signal in signals {
                if events_tx.send(Event::Signal(signal)).is_err() {
                    return;
                }
            }
        })
    });
    let lost = watch(&events, &ticket, target, args.grace);
    drop(stop_tx);
    let _ = extender.join();
    drop(caught);
    if let Some(forwarder) = forwarder {
        let _ = forwarder.join();
    }
    // Before the reap: until then CMD's pid, and so its group's id, cannot be reused.
    if let Some(guard) = guard {
        guard.stand_down();
    }
    let status = child.wait();
    let ticket = Arc::into_inner(ticket).expect("the extender has ended");
    if lost {
        release_after_loss(ticket);
        return LockExit::Own(EXIT_LEASE_LOST);
    }
    release(ticket);
    match status {
        Ok(status) => LockExit::Command(status_code(status)),
        Err(error) => {
            eprintln!("latchkey lock: waiting for the command: {error}");
            LockExit::Own(EXIT_INDETERMINATE)
        }
    }
}

/// Waits for events until CMD exits; on a lost lease sends SIGTERM, then SIGKILL after
/// `grace`, to `target` (CMD's pid, or its group as `-pgid`). Returns whether the lease was
/// lost.
fn watch(events: &Receiver<Event>, ticket: &Ticket, target: libc::pid_t, grace: Duration) -> bool {
    let mut lost = false;
    let mut kill_at: Option<Instant> = None;
    loop {
        let wake_at = kill_at.or((!lost).then(|| ticket.valid_until()));
        let event = match wake_at {
            Some(at) => events.recv_deadline(at),
            None => events.recv().map_err(|_| RecvTimeoutError::Disconnected),
        };
        let why = match event {
            Ok(Event::Exited) | Err(RecvTimeoutError::Disconnected) => return lost,
            Ok(Event::Signal(signal)) => {
                send_signal(target, signal);
                continue;
            }
            Ok(Event::Lost(why)) => why,
            Err(RecvTimeoutError::Timeout) if kill_at.is_some() => {
                eprintln!("latchkey lock: the command outlived its grace: SIGKILL");
                send_signal(target, libc::SIGKILL);
                kill_at = None;
                continue;
            }
            Err(RecvTimeoutError::Timeout) if ticket.is_valid() => continue,
            Err(RecvTimeoutError::Timeout) => "no extend was confirmed in time".to_owned(),
        };
        if !lost {
            eprintln!("latchkey lock: lease lost ({why}): SIGTERM to the command");
            send_signal(target, libc::SIGTERM);
            kill_at = Some(Instant::now() + grace);
            lost = true;
        }
    }
}

/// Extends the lease every lease/3 (sooner after a failure) until stopped or lost.
fn extend_until_stopped(
    ticket: &Ticket,
    lease: Duration,
    stop: &Receiver<()>,
    events: &Sender<Event>,
) {
    let period = (Duration::from_secs(lease.as_secs_f64().ceil() as u64) / 3)
        .max(Duration::from_millis(100));
    let mut next = Instant::now() + period;
    loop {
        if stop.recv_deadline(next) != Err(RecvTimeoutError::Timeout) {
            return;
        }
        let start = Instant::now();
        match ticket.extend(lease) {
            Ok(ExtendOutcome::Extended) => next = Instant::now() + period,
            Ok(ExtendOutcome::NotHeld) => {
                let _ = events.send(Event::Lost(
                    "the server no longer holds it for this token".into(),
                ));
                return;
            }
            Err(RequestError::Rejected(ErrorCode::Forbidden)) => {
                let key = shown_key(ticket.key());
                eprintln!(
                    "latchkey lock: {key}: extend refused: {FORBIDDEN_TEXT}; the lease is not \
                     extended any more"
                );
                return;
            }
            Err(error) => {
                let now = Instant::now();
                let left = ticket.valid_until().saturating_duration_since(now);
                let why = failure(ticket.client(), &error, now - start);
                if left.is_zero() {
                    // The watcher reports the lease lost at the bound; nothing left to keep.
                    eprintln!("latchkey lock: extend failed: {why}");
                    return;
                }
                eprintln!("latchkey lock: extend failed: {why}; retrying");
                let retry = period.min(EXTEND_RETRY).min(left / 4);
                next = now + retry.max(EXTEND_RETRY_MIN);
            }
        }
    }
}

/// Blocks until process `pid` has exited, without reaping it: until the supervisor reaps
/// it, the pid stays reserved, so a signal can never reach an unrelated process.
fn wait_for_exit(pid: libc::pid_t) {
    loop {
        // SAFETY: `siginfo_t` is plain data for which all-zero bytes are a valid value.
        let mut info: libc::siginfo_t = unsafe { std::mem::zeroed() };
        let options = libc::WEXITED | libc::WNOWAIT;
        // SAFETY: `info` is a valid, writable `siginfo_t`; waitid does not retain it.
        let result = unsafe { libc::waitid(libc::P_PID, pid as libc::id_t, &mut info, options) };
        if result == 0 || io::Error::last_os_error().kind() != io::ErrorKind::Interrupted {
            return;
        }
    }
}

/// Sends `signal` to `target`: CMD's pid, or its process group as `-pgid`.
fn send_signal(target: libc::pid_t, signal: i32) {
    // SAFETY: kill has no memory effects; `target` is our unreaped child or its group (see
    // wait_for_exit).
    unsafe {
        libc::kill(target, signal);
    }
}

/// CMD's exit status as an exit code: its code, or 128 + the signal that killed it.
fn status_code(status: ExitStatus) -> u8 {
    match (status.code(), status.signal()) {
        (Some(code), _) => code as u8,
        (None, Some(signal)) => 128u8.wrapping_add(signal as u8),
        (None, None) => EXIT_INDETERMINATE,
    }
}

/// Releases the lock after CMD; a failure only means the lease will recover it.
pub(super) fn release(ticket: Ticket) {
    let key = shown_key(ticket.key());
    let client = ticket.client().clone();
    let start = Instant::now();
    match ticket.release() {
        Ok(ReleaseOutcome::Released) => {}
        Ok(ReleaseOutcome::NotHeld) => {
            eprintln!("latchkey lock: the lock was no longer held when released")
        }
        Err(RequestError::Rejected(ErrorCode::Forbidden)) => {
            eprintln!(
                "latchkey lock: {key}: release refused: {FORBIDDEN_TEXT}; the lease recovers it"
            )
        }
        Err(error) => {
            let why = failure(&client, &error, start.elapsed());
            eprintln!("latchkey lock: release failed ({why}); the lease recovers it")
        }
    }
}

/// Releases the lock after its lease was lost, before `latchkey lock` exits 85: usually the
/// server no longer has it (`N`, said nothing of), but an extend may have executed unanswered,
/// and the key would stay held by nobody for up to one more lease. Sent like any release
/// (hedged to the other members of a cluster), and waited for: a background release would die
/// with the process.
fn release_after_loss(ticket: Ticket) {
    let key = shown_key(ticket.key());
    let client = ticket.client().clone();
    let start = Instant::now();
    match ticket.release() {
        Ok(ReleaseOutcome::Released) => {
            eprintln!("latchkey lock: {key}: released (the server still had it)")
        }
        Ok(ReleaseOutcome::NotHeld) | Err(RequestError::Rejected(_)) => {}
        Err(error) => {
            let why = failure(&client, &error, start.elapsed());
            eprintln!("latchkey lock: {key}: release failed ({why}); its lease ends it")
        }
    }
}

/// Why an extend or release got no answer, as true as the client knows it: when nothing was
/// sent, what the cluster's members did (no leader, no quorum...) or why the server could not
/// be reached.
fn failure(client: &Client, error: &RequestError, elapsed: Duration) -> String {
    match error {
        RequestError::Unavailable => {
            let addr = client.config().addrs[0];
            let timeout = format_duration(client.config().transport_timeout);
            let tried = Tried {
                elapsed,
                allowance: format!("--transport-timeout {timeout}"),
                // Not a word of --retry-refused: the supervisor tries again on its own.
                retry_refused: true,
            };
            unavailable_text(client, addr, &tried)
        }
        other => other.to_string(),
    }
}
