//! Argument normalization (docs/protocol.md §4.2, §4.5) and correlation ids. No I/O.
//!
//! [`check_key`], [`wait_ms`] and [`lease_s`] are public so that a caller (the `latchkey` CLI)
//! can refuse an argument the way a call would, before making one.
//!
//! A wait is rounded *up* to whole milliseconds and a lease *up* to whole seconds, so the
//! client never asks for less than the caller did; anything that does not fit the wire is
//! refused here, before a session sees it. Owners and nonces come from one process-wide
//! source: a random base mixed with a counter through a bijection, so two ids drawn in one
//! process are never equal and never 0.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::OnceLock;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use super::error::ArgumentError;
use crate::protocol::KEY_BYTES_MAX;

/// The longest wait the wire can carry, in milliseconds.
pub(crate) const WAIT_MS_MAX: u64 = 255_000;
/// The longest lease the wire can carry, in seconds.
pub(crate) const LEASE_S_MAX: u64 = 255;
/// The smallest safety margin subtracted from a ticket's validity bound.
pub(crate) const MARGIN_MIN: Duration = Duration::from_millis(100);

/// Checks a key: 1..=1024 bytes, no newline (UTF-8 is guaranteed by `&str`).
pub fn check_key(key: &str) -> Result<(), ArgumentError> {
    if key.is_empty() {
        return Err(ArgumentError::KeyEmpty);
    }
    if key.len() > KEY_BYTES_MAX {
        return Err(ArgumentError::KeyTooLong);
    }
    if key.as_bytes().contains(&b'\n') {
        return Err(ArgumentError::KeyContainsNewline);
    }
    Ok(())
}

/// The wait rounded up to whole milliseconds; more than 255 s is refused.
pub fn wait_ms(wait: Duration) -> Result<u64, ArgumentError> {
    let whole_ms = wait.as_millis();
    let ms = whole_ms + u128::from(wait.subsec_nanos() % 1_000_000 != 0);
    if ms > u128::from(WAIT_MS_MAX) {
        return Err(ArgumentError::WaitTooLong);
    }
    Ok(ms as u64)
}

/// The lease rounded up to whole seconds: 1..=255.
pub fn lease_s(lease: Duration) -> Result<u8, ArgumentError> {
    if lease.is_zero() {
        return Err(ArgumentError::LeaseZero);
    }
    let seconds = lease.as_secs() + u64::from(lease.subsec_nanos() != 0);
    if seconds > LEASE_S_MAX {
        return Err(ArgumentError::LeaseTooLong);
    }
    Ok(seconds as u8)
}

/// The wire wait for the time left before `deadline`, rounded up to whole seconds, or `None`
/// when no time is left (the request must not be sent).
pub(crate) fn wire_wait_s(deadline: Instant, now: Instant) -> Option<u8> {
    let left = deadline
        .checked_duration_since(now)
        .filter(|left| !left.is_zero())?;
    let seconds = left.as_secs() + u64::from(left.subsec_nanos() != 0);
    Some(seconds.min(LEASE_S_MAX) as u8)
}

/// The safety margin of docs/protocol.md §4.5: at least max(100 ms, lease / 10).
pub(crate) fn margin(lease: Duration) -> Duration {
    MARGIN_MIN.max(lease / 10)
}

/// The local validity bound of a hold whose lease clock started no earlier than `start`.
pub(crate) fn valid_until(start: Instant, lease_s: u8) -> Instant {
    let lease = Duration::from_secs(u64::from(lease_s));
    start + lease - margin(lease)
}

/// A fresh correlation id (owner or nonce): unique within the process, never 0.
pub(crate) fn next_id() -> u64 {
    static COUNTER: AtomicU64 = AtomicU64::new(0);
    static BASE: OnceLock<u64> = OnceLock::new();
    let base = *BASE.get_or_init(random_base);
    // `mix` is a bijection, so distinct counter values give distinct ids; at most one of
    // them maps to 0, which is skipped.
    loop {
        let count = COUNTER.fetch_add(1, Ordering::Relaxed);
        let id = mix(base.wrapping_add(count));
        if id != 0 {
            return id;
        }
    }
}

/// A random client id for resumable calls (docs/protocol.md §5), never 0: from the hashers'
/// random keys (the operating system's randomness), mixed with the process's id base.
pub(crate) fn client_id() -> u128 {
    use std::hash::{BuildHasher, Hasher};
    loop {
        let keys = std::collections::hash_map::RandomState::new();
        let half = |salt: u64| {
            let mut hasher = keys.build_hasher();
            hasher.write_u64(salt);
            hasher.write_u64(next_id());
            hasher.finish()
        };
        let id = (u128::from(half(1)) << 64) | u128::from(half(2));
        if id != 0 {
            return id;
        }
    }
}

/// The grace a client asks for: `grace` rounded up to whole seconds, within 1..=60.
pub(crate) fn grace_s(grace: Duration) -> u8 {
    let seconds = grace.as_secs() + u64::from(grace.subsec_nanos() > 0);
    seconds.clamp(1, u64::from(crate::protocol::GRACE_S_MAX)) as u8
}

/// A per-process base from the clock, the pid and a stack address, so that two processes
/// (or two runs) are unlikely to draw the same ids.
fn random_base() -> u64 {
    let nanos = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos() as u64);
    let pid = u64::from(std::process::id());
    let stack = &nanos as *const u64 as u64;
    mix(nanos ^ pid.rotate_left(32) ^ stack.rotate_left(17))
}

/// The splitmix64 finalizer: a bijection on `u64` that scatters nearby inputs.
fn mix(mut x: u64) -> u64 {
    x = (x ^ (x >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    x = (x ^ (x >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    x ^ (x >> 31)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn wait_rounds_up_to_milliseconds_and_refuses_past_255_s() {
        assert_eq!(wait_ms(Duration::ZERO), Ok(0));
        assert_eq!(wait_ms(Duration::from_nanos(1)), Ok(1));
        assert_eq!(wait_ms(Duration::from_micros(1500)), Ok(2));
        assert_eq!(wait_ms(Duration::from_secs(255)), Ok(255_000));
        let just_over = Duration::from_secs(255) + Duration::from_nanos(1);
        assert_eq!(wait_ms(just_over), Err(ArgumentError::WaitTooLong));
        assert_eq!(wait_ms(Duration::MAX), Err(ArgumentError::WaitTooLong));
    }

    #[test]
    fn lease_rounds_up_to_seconds() {
        assert_eq!(lease_s(Duration::ZERO), Err(ArgumentError::LeaseZero));
        assert_eq!(lease_s(Duration::from_millis(1)), Ok(1));
        assert_eq!(lease_s(Duration::from_millis(1001)), Ok(2));
        assert_eq!(lease_s(Duration::from_secs(255)), Ok(255));
        assert_eq!(
            lease_s(Duration::from_millis(255_001)),
            Err(ArgumentError::LeaseTooLong)
        );
    }

    #[test]
    fn keys_are_checked() {
        assert_eq!(check_key(""), Err(ArgumentError::KeyEmpty));
        assert_eq!(check_key("a\nb"), Err(ArgumentError::KeyContainsNewline));
        assert_eq!(check_key(&"k".repeat(KEY_BYTES_MAX)), Ok(()));
        assert_eq!(
            check_key(&"k".repeat(KEY_BYTES_MAX + 1)),
            Err(ArgumentError::KeyTooLong)
        );
    }

    #[test]
    fn wire_wait_rounds_remaining_time_up() {
        let now = Instant::now();
        assert_eq!(wire_wait_s(now, now), None);
        assert_eq!(wire_wait_s(now, now + Duration::from_millis(1)), None);
        assert_eq!(wire_wait_s(now + Duration::from_nanos(1), now), Some(1));
        assert_eq!(wire_wait_s(now + Duration::from_millis(1500), now), Some(2));
        assert_eq!(wire_wait_s(now + Duration::from_secs(3), now), Some(3));
    }

    #[test]
    fn margin_is_at_least_100_ms_or_a_tenth() {
        assert_eq!(margin(Duration::from_secs(1)), Duration::from_millis(100));
        assert_eq!(margin(Duration::from_secs(30)), Duration::from_secs(3));
        let now = Instant::now();
        assert_eq!(valid_until(now, 1), now + Duration::from_millis(900));
        assert_eq!(valid_until(now, 30), now + Duration::from_secs(27));
    }

    #[test]
    fn ids_are_distinct_and_never_zero() {
        let mut seen = std::collections::HashSet::new();
        for _ in 0..10_000 {
            let id = next_id();
            assert_ne!(id, 0);
            assert!(seen.insert(id));
        }
    }
}
