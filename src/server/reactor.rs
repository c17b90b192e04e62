//! One core's event loop on mio: poll, accept, the timer alarm, and readiness into its [`Core`].
//!
//! Each iteration: arm the alarm for the core's next wake-up → poll → read the clock once →
//! accept new connections → hand every session's readiness to the core → [`Core::step`] does
//! the rest → record how long the iteration worked (the stall gauge). `Instant::now()` is read
//! once per iteration for the core (and once more for the gauge); the core and its lock table
//! only ever see that `now_us`.
//!
//! The stall gauge measures wall-clock time, which is what a client waits for. On a shared or
//! virtual machine that includes time the thread was not running at all (another process, or
//! the hypervisor taking the vCPU: measured here, a spinning thread alone on its CPU saw gaps
//! of 7.7 ms). With `LATCHKEY_STALL_CLOCK=cpu` in the environment at start, the gauge measures
//! the thread's CPU time per iteration instead (two `clock_gettime` calls per iteration, for
//! benchmarks): the work an iteration did, whatever the machine did meanwhile.
//!
//! Not here: what the core does with its sessions ([`super::core`], [`super::close`]).

use super::alarm::Alarm;
use super::core::Core;
pub use super::core::{core_of, slot_of, CoreSettings, Links};
use super::net::{MioNet, MioStream, PARTITION_TOKEN_BASE, SESSION_TOKEN_BASE};
use super::Shared;
use crate::lock_table::LockTable;
use crate::partition::Partition;
use mio::net::{TcpListener, TcpStream};
use mio::{Events, Interest, Poll, Token};
use std::io;
use std::sync::Arc;
use std::time::Instant;

/// Token of the listener.
const LISTENER: Token = Token(0);
/// Token of the waker other cores (and shutdown) use.
pub const WAKER: Token = Token(1);
/// Token of the timer alarm.
const ALARM: Token = Token(2);
/// Readiness events taken per poll.
const EVENTS_MAX: usize = 1024;

const _: () = assert!(PARTITION_TOKEN_BASE > ALARM.0 && PARTITION_TOKEN_BASE > LISTENER.0);
const _: () = assert!(SESSION_TOKEN_BASE > PARTITION_TOKEN_BASE);

/// One core's loop: its poll, its listener, its alarm and its [`Core`], over streams `S` (plain
/// TCP, or TLS: one type per server, so the plain path carries nothing of TLS).
pub struct Reactor<S: MioStream = TcpStream, P: Partition = LockTable> {
    poll: Poll,
    alarm: Alarm,
    listener: Option<TcpListener>,
    /// What turns an accepted connection into a session's stream.
    acceptor: S::Acceptor,
    core: Core<MioNet<S>, P>,
    epoch: Instant,
    shared: Arc<Shared>,
    /// Whether the stall gauge counts the thread's CPU time instead of wall time.
    cpu_clock: bool,
}

/// The calling thread's CPU time in microseconds.
fn thread_cpu_us() -> u64 {
    // SAFETY: timespec is plain data; clock_gettime only writes it.
    let mut spec: libc::timespec = unsafe { std::mem::zeroed() };
    // SAFETY: a valid clock id and a valid, writable timespec.
    unsafe { libc::clock_gettime(libc::CLOCK_THREAD_CPUTIME_ID, &mut spec) };
    spec.tv_sec as u64 * 1_000_000 + spec.tv_nsec as u64 / 1000
}

/// What a core's loop is made of, besides its streams' acceptor.
pub struct ReactorParts<P: Partition = LockTable> {
    /// The core's limits and identity.
    pub settings: CoreSettings,
    /// The core's poll.
    pub poll: Poll,
    /// The core's listener.
    pub listener: TcpListener,
    /// The core's partition: a lock table, or a cluster member's shards.
    pub table: P,
    /// The core's ways to the others.
    pub links: Links,
    /// The server's shared clock origin.
    pub epoch: Instant,
}

impl<S: MioStream, P: Partition> Reactor<S, P> {
    /// Assembles a core's loop; accepted connections become streams with `acceptor`.
    pub fn new(parts: ReactorParts<P>, acceptor: S::Acceptor) -> io::Result<Reactor<S, P>> {
        let ReactorParts {
            settings,
            poll,
            mut listener,
            table,
            links,
            epoch,
        } = parts;
        poll.registry()
            .register(&mut listener, LISTENER, Interest::READABLE)?;
        let alarm = Alarm::new(poll.registry(), ALARM)?;
        let net = MioNet::new(poll.registry().try_clone()?, epoch);
        let shared = Arc::clone(&links.shared);
        Ok(Reactor {
            poll,
            alarm,
            listener: Some(listener),
            acceptor,
            core: Core::new(settings, net, table, links),
            epoch,
            shared,
            cpu_clock: std::env::var("LATCHKEY_STALL_CLOCK").is_ok_and(|clock| clock == "cpu"),
        })
    }

    fn now_us(&self) -> u64 {
        self.epoch.elapsed().as_micros() as u64
    }

    /// Runs the loop until shutdown completes.
    pub fn run(mut self) -> io::Result<()> {
        let mut events = Events::with_capacity(EVENTS_MAX);
        loop {
            let deadline = self.core.wake_at_us();
            let timeout = self.core.poll_timeout(deadline);
            let epoch = self.epoch;
            if let Err(e) = self
                .alarm
                .arm(deadline, || epoch.elapsed().as_micros() as u64)
            {
                // The poll timeout still wakes the loop, only up to a millisecond later.
                log::warn!(
                    "core {}: cannot arm the timer alarm: {e}",
                    self.core.index()
                );
            }
            match self.poll.poll(&mut events, timeout) {
                Ok(()) => {}
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => return Err(e),
            }
            let now_us = self.now_us();
            let cpu_start_us = if self.cpu_clock { thread_cpu_us() } else { 0 };
            self.core.set_now(now_us);
            self.dispatch(&events);
            if self.core.step() {
                return Ok(());
            }
            if !self.core.is_accepting() {
                self.stop_listening();
            }
            let busy_us = match self.cpu_clock {
                true => thread_cpu_us().saturating_sub(cpu_start_us),
                false => self.now_us().saturating_sub(now_us),
            };
            self.shared.loop_gauges[self.core.index()].record(busy_us);
        }
    }

    fn dispatch(&mut self, events: &Events) {
        for event in events.iter() {
            match event.token() {
                LISTENER => self.accept_all(),
                WAKER => {}
                ALARM => self.alarm.acknowledge(),
                Token(token) if token < SESSION_TOKEN_BASE => {
                    self.core.on_source_ready(token - PARTITION_TOKEN_BASE)
                }
                Token(token) => {
                    let closed = event.is_read_closed() || event.is_error();
                    let slot = token - SESSION_TOKEN_BASE;
                    let (readable, writable) = (event.is_readable(), event.is_writable());
                    self.core.on_ready(slot, readable, writable, closed);
                }
            }
        }
    }

    fn accept_all(&mut self) {
        // Bounded: the listen backlog is finite, and each pass takes one connection off it.
        loop {
            let Some(listener) = self.listener.as_ref() else {
                return;
            };
            match listener.accept() {
                Ok((stream, _)) => {
                    let _ = stream.set_nodelay(true);
                    match S::accept(stream, &self.acceptor) {
                        Ok(stream) => self.core.admit(stream),
                        Err(e) => {
                            log::warn!("core {}: cannot start a session: {e}", self.core.index())
                        }
                    }
                }
                Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => return,
                Err(e) => {
                    log::warn!("core {}: accept failed: {e}", self.core.index());
                    return;
                }
            }
        }
    }

    fn stop_listening(&mut self) {
        if let Some(mut listener) = self.listener.take() {
            let _ = self.poll.registry().deregister(&mut listener);
        }
    }
}
