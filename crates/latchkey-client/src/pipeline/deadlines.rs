//! Exact `Instant` deadlines on the crate's timing wheel, for one session's pipeline.
//!
//! The wheel counts whole milliseconds (ticks) since an epoch; a deadline is placed at the
//! tick of its millisecond, rounded down, and keeps its exact instant beside it. So the wheel
//! fires it no later than the first [`advance`](Deadlines::advance) that has reached its
//! instant, and possibly a little before: the caller compares the exact instant and, if it is
//! not yet due, inserts it again. Timers are cancelled, not left to go stale.
//!
//! Invariant: `soon` is at or before the exact instant of every timer the wheel holds as due
//! (inserted at or behind its current tick), so [`next_deadline`](Deadlines::next_deadline)
//! never names a time after a pending deadline, nor "at once" for one later in the current
//! millisecond. Deliberately not here: what a deadline means (see [`super::Pipeline`]).

use std::time::{Duration, Instant};

use latchkey_wheel::{TimerHandle, Wheel};

/// Deadlines carrying payloads of type `T`.
#[derive(Debug)]
pub(super) struct Deadlines<T> {
    /// Tick 0 of `wheel`; instants before it count as tick 0 (they are still compared exactly).
    epoch: Instant,
    wheel: Wheel<T>,
    /// The tick `wheel` was last advanced to.
    wheel_tick: u64,
    /// The earliest exact instant of the timers inserted at or behind `wheel_tick` since that
    /// advance: the wheel holds them as due, so without this the next wake-up would be at
    /// once rather than at their instant (possibly stale-early after a cancel, which costs
    /// one early wake-up).
    soon: Option<Instant>,
}

impl<T: Copy> Deadlines<T> {
    /// No deadlines; ticks count from `epoch`.
    pub(super) fn new(epoch: Instant) -> Deadlines<T> {
        Deadlines {
            epoch,
            wheel: Wheel::new(0),
            wheel_tick: 0,
            soon: None,
        }
    }

    /// The tick of `at`: whole milliseconds since the epoch, rounded down.
    fn tick_of(&self, at: Instant) -> u64 {
        let since = at.saturating_duration_since(self.epoch).as_millis();
        u64::try_from(since).unwrap_or(u64::MAX)
    }

    /// Arms a deadline at the exact instant `at`.
    pub(super) fn insert(&mut self, at: Instant, payload: T) -> TimerHandle {
        let tick = self.tick_of(at);
        if tick <= self.wheel_tick {
            self.soon = Some(self.soon.map_or(at, |soon| soon.min(at)));
        }
        self.wheel.insert(tick, payload)
    }

    /// Disarms a deadline (nothing if it already fired).
    pub(super) fn cancel(&mut self, handle: TimerHandle) {
        self.wheel.cancel(handle);
    }

    /// Whether the deadline is armed.
    pub(super) fn is_armed(&self, handle: TimerHandle) -> bool {
        self.wheel.deadline(handle).is_some()
    }

    /// Deadlines armed.
    pub(super) fn len(&self) -> usize {
        self.wheel.len()
    }

    /// No instant later than the earliest armed deadline, possibly earlier (its whole
    /// millisecond, or a cascade point of the wheel: waking early is harmless); `None` when
    /// none is armed.
    pub(super) fn next_deadline(&self) -> Option<Instant> {
        let tick = self.wheel.next_deadline()?;
        let at = self.epoch + Duration::from_millis(tick);
        if tick <= self.wheel_tick {
            // Only timers inserted at or behind the wheel's tick are due there.
            return Some(self.soon.unwrap_or(at));
        }
        Some(at)
    }

    /// Appends to `fired` the payload of every deadline whose millisecond `now` has reached,
    /// in no particular order; the caller checks the exact instants.
    pub(super) fn advance(&mut self, now: Instant, fired: &mut Vec<T>) {
        // Never behind the last tick: that would not even fire the timers held as due.
        self.wheel_tick = self.wheel_tick.max(self.tick_of(now));
        self.soon = None;
        self.wheel.advance(self.wheel_tick, fired);
    }

    /// Disarms everything.
    pub(super) fn clear(&mut self) {
        self.wheel = Wheel::new(self.wheel_tick);
        self.soon = None;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn us(micros: u64) -> Duration {
        Duration::from_micros(micros)
    }

    #[test]
    fn a_deadline_fires_with_its_millisecond_and_the_next_wake_up_is_exact() {
        let epoch = Instant::now();
        let mut deadlines = Deadlines::new(epoch);
        let at = epoch + us(100_500);
        deadlines.insert(at, 7u32);
        assert!(deadlines.next_deadline().unwrap() <= at);
        let mut fired = Vec::new();
        deadlines.advance(epoch + us(99_999), &mut fired);
        assert!(fired.is_empty(), "an earlier millisecond fires nothing");
        deadlines.advance(epoch + us(100_200), &mut fired);
        assert_eq!(fired, [7], "fired with its millisecond, before its instant");
        // The caller inserts it again: held as due, and the wake-up is its exact instant.
        deadlines.insert(at, 7);
        assert_eq!(deadlines.next_deadline(), Some(at));
        fired.clear();
        deadlines.advance(at, &mut fired);
        assert_eq!(fired, [7]);
        assert_eq!((deadlines.len(), deadlines.next_deadline()), (0, None));
    }

    #[test]
    fn a_cancelled_deadline_is_gone() {
        let epoch = Instant::now();
        let mut deadlines = Deadlines::new(epoch);
        let handle = deadlines.insert(epoch + us(5_000_000), 1u32);
        assert!(deadlines.is_armed(handle));
        deadlines.cancel(handle);
        assert!(!deadlines.is_armed(handle));
        assert_eq!((deadlines.len(), deadlines.next_deadline()), (0, None));
        let mut fired = Vec::new();
        deadlines.advance(epoch + us(10_000_000), &mut fired);
        assert!(fired.is_empty());
    }
}
