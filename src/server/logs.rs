//! What a core logs beyond opens and closes: refused frames (`X`) and `B` answers, each at
//! info and rate-limited, so that a hostile or overloaded client never floods the log. At most
//! one line per [`LOG_PERIOD_US`] per kind (per error code; all `B` together), saying how many
//! more happened since the last line. No line per request.

use super::core::Core;
use super::net::Net;
use crate::lock_table::{BusyCounts, BusyReason};
use crate::protocol::ErrorCode;
use crate::server::partition::Partition;

/// At most one line per kind per this period.
pub const LOG_PERIOD_US: u64 = 10_000_000;

/// One kind of line: when it was last written, and how many were left out since.
#[derive(Clone, Copy, Debug, Default)]
pub struct Throttle {
    logged_at_us: Option<u64>,
    suppressed: u64,
}

impl Throttle {
    /// Whether a line may be written at `now_us`; if so, how many were left out before it.
    pub fn allow(&mut self, now_us: u64) -> Option<u64> {
        if self
            .logged_at_us
            .is_some_and(|at| now_us < at + LOG_PERIOD_US)
        {
            self.suppressed += 1;
            return None;
        }
        self.logged_at_us = Some(now_us);
        Some(std::mem::take(&mut self.suppressed))
    }
}

/// A core's throttles, and the `B` counts of its partition at the last busy line.
#[derive(Debug, Default)]
pub struct CoreLogs {
    errors: [Throttle; 9],
    busy: Throttle,
    busy_seen: BusyCounts,
}

impl<N: Net, P: Partition> Core<N, P> {
    /// Logs a refused frame of the session in `slot` (rate-limited per code).
    pub(super) fn log_refused_frame(&mut self, slot: usize, code: ErrorCode) {
        let throttle = &mut self.logs.errors[code as usize % 9];
        let Some(left_out) = throttle.allow(self.now_us) else {
            return;
        };
        let session = &self.sessions[slot];
        let peer = session
            .peer()
            .map_or("unknown peer".to_string(), |p| p.to_string());
        log::info!(
            "session {:#x} from {peer}: X code {} ({code:?}){}",
            session.id(),
            code as u8,
            more(left_out, "with this code")
        );
    }

    /// Logs the partition's new `B` answers by reason, at most once per period.
    pub(super) fn log_busy(&mut self) {
        let busy = self.table.stats().busy;
        if busy.total() == self.logs.busy_seen.total() {
            return;
        }
        if self.logs.busy.allow(self.now_us).is_none() {
            return;
        }
        let reasons: Vec<String> = BusyReason::ALL
            .iter()
            .filter_map(|&reason| {
                let new = busy.get(reason) - self.logs.busy_seen.get(reason);
                (new > 0).then(|| format!("{} {new}", reason.label()))
            })
            .collect();
        log::info!(
            "core {}: {} acquires answered B since the last report ({})",
            self.settings.index,
            busy.total() - self.logs.busy_seen.total(),
            reasons.join(", ")
        );
        self.logs.busy_seen = busy;
    }
}

fn more(left_out: u64, what: &str) -> String {
    match left_out {
        0 => String::new(),
        n => format!("; {n} more {what} since the last such line"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_throttle_lets_one_line_through_per_period_and_counts_the_rest() {
        let mut throttle = Throttle::default();
        assert_eq!(throttle.allow(5), Some(0));
        assert_eq!(throttle.allow(6), None);
        assert_eq!(throttle.allow(LOG_PERIOD_US + 4), None);
        assert_eq!(throttle.allow(LOG_PERIOD_US + 5), Some(2));
        assert_eq!(throttle.allow(LOG_PERIOD_US + 6), None);
    }
}
