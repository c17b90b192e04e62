//! A `timerfd` a core's poll waits on, so timers wake the loop with microsecond precision.
//!
//! `epoll_wait` takes its timeout in whole milliseconds and mio rounds up, which alone would
//! make a lease fire up to a millisecond later than the wheel's tick allows. The alarm is armed
//! for the wheel's next deadline (relative, in nanoseconds) and registered in the poll like a
//! socket; it is re-armed only when that deadline changes, so the request path pays no syscall.
//!
//! Never early is still the lock table's job (a timer fires only at a tick whose start is at or
//! after its end); an alarm that rings early only costs an idle iteration.

use mio::unix::SourceFd;
use mio::{Interest, Registry, Token};
use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};

/// A monotonic one-shot timer file descriptor.
pub struct Alarm {
    fd: OwnedFd,
    armed_us: Option<u64>,
}

impl Alarm {
    /// A disarmed alarm registered in `registry` under `token`.
    pub fn new(registry: &Registry, token: Token) -> io::Result<Alarm> {
        let flags = libc::TFD_NONBLOCK | libc::TFD_CLOEXEC;
        // SAFETY: timerfd_create has no memory effects; a negative result is an error.
        let raw = unsafe { libc::timerfd_create(libc::CLOCK_MONOTONIC, flags) };
        if raw < 0 {
            return Err(io::Error::last_os_error());
        }
        // SAFETY: `raw` is a fresh descriptor that nothing else owns.
        let fd = unsafe { OwnedFd::from_raw_fd(raw) };
        registry.register(&mut SourceFd(&fd.as_raw_fd()), token, Interest::READABLE)?;
        Ok(Alarm { fd, armed_us: None })
    }

    /// Rings at `at_us` on the caller's clock (`now_us` reads it), or never for `None`. Does
    /// nothing, and reads no clock, when already armed for that instant.
    pub fn arm(&mut self, at_us: Option<u64>, now_us: impl FnOnce() -> u64) -> io::Result<()> {
        if at_us == self.armed_us {
            return Ok(());
        }
        let now_us = now_us();
        // SAFETY: itimerspec is plain integers; all-zero is a valid (disarmed) value.
        let mut spec: libc::itimerspec = unsafe { std::mem::zeroed() };
        if let Some(at_us) = at_us {
            // A zero it_value disarms, so a deadline already due rings after 1 ns.
            let in_ns = at_us.saturating_sub(now_us).saturating_mul(1000).max(1);
            spec.it_value.tv_sec = (in_ns / 1_000_000_000) as libc::time_t;
            spec.it_value.tv_nsec = (in_ns % 1_000_000_000) as libc::c_long;
        }
        // SAFETY: `spec` is a valid itimerspec and the old-value pointer may be null.
        let result =
            unsafe { libc::timerfd_settime(self.fd.as_raw_fd(), 0, &spec, std::ptr::null_mut()) };
        if result < 0 {
            self.armed_us = None;
            return Err(io::Error::last_os_error());
        }
        self.armed_us = at_us;
        Ok(())
    }

    /// Acknowledges a ring (the poll reported the descriptor readable).
    pub fn acknowledge(&mut self) {
        let mut expirations = [0u8; 8];
        // SAFETY: reads at most 8 bytes into an 8-byte buffer; EAGAIN (not rung) is harmless.
        unsafe { libc::read(self.fd.as_raw_fd(), expirations.as_mut_ptr().cast(), 8) };
        self.armed_us = None;
    }
}
