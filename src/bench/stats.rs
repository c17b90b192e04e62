//! What one worker thread counts and measures. No I/O, no clock reads.
//!
//! Answers and latencies are recorded only while `recording` is on (the measured window; for
//! `hold`, the grant phase). Expiry lateness is recorded whenever it is measured.
//! Connection-level errors (I/O, unparseable bytes, uncorrelated answers) are never reset: an
//! error during warm-up is still an error. So is an answer the workload never expects (an `N`
//! to our own release, say) outside the window: it goes to
//! [`Stats::unexpected_outside_window`].
//!
//! Histograms are in nanoseconds with 3 significant figures and are allocated once per worker;
//! values beyond the upper bound saturate rather than fail.

use std::time::Duration;

use hdrhistogram::Histogram;

use super::Workload;

/// The largest value a histogram tracks: longer latencies saturate at it.
pub const HISTOGRAM_NANOS_MAX: u64 = 600 * 1_000_000_000;

/// Answers by kind, in the latchkey letters (Redis answers are mapped onto them).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Counts {
    /// `A`: grants.
    pub granted: u64,
    /// `T`: acquires that ran out of wait (Redis: held key, no time left to retry).
    pub timeout: u64,
    /// `B`: acquires refused for capacity.
    pub busy: u64,
    /// `X`: refused requests (Redis: error replies).
    pub refused: u64,
    /// `N`: releases of a token that no longer held the key.
    pub not_held: u64,
    /// `R`: releases.
    pub released: u64,
    /// Redis only: `SET NX` attempts that found the key held and were retried.
    pub retries: u64,
    /// `M`: requests a cluster member redirected (sent again to the leader it named, or to
    /// another member when it named none).
    pub moved: u64,
    /// Requests given up after [`REDIRECTS_MAX`](super::cluster::REDIRECTS_MAX) `M`s in one
    /// cycle: no leader could be reached.
    pub no_leader: u64,
}

impl Counts {
    /// Adds `other` into `self`.
    pub fn add(&mut self, other: &Counts) {
        self.granted += other.granted;
        self.timeout += other.timeout;
        self.busy += other.busy;
        self.refused += other.refused;
        self.not_held += other.not_held;
        self.released += other.released;
        self.retries += other.retries;
        self.moved += other.moved;
        self.no_leader += other.no_leader;
    }

    /// Answers that a healthy server never gives in `workload`.
    pub fn unexpected(&self, workload: Workload) -> u64 {
        let waiting = match workload {
            Workload::Contended => 0,
            Workload::Uncontended | Workload::Hold => self.timeout + self.busy,
        };
        waiting + self.refused + self.not_held + self.no_leader
    }
}

/// Errors that end a connection. Never reset.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Errors {
    /// Connect, read or write failures, and the server closing a connection.
    pub io: u64,
    /// Bytes that do not parse, answers to nothing we asked.
    pub protocol: u64,
    /// The first error's description.
    pub first: Option<String>,
}

impl Errors {
    /// Counts an I/O error described by `what`.
    pub fn io(&mut self, what: impl FnOnce() -> String) {
        self.io += 1;
        self.first.get_or_insert_with(what);
    }

    /// Counts a protocol error described by `what`.
    pub fn protocol(&mut self, what: impl FnOnce() -> String) {
        self.protocol += 1;
        self.first.get_or_insert_with(what);
    }

    /// Adds `other` into `self`, keeping the first description seen.
    pub fn add(&mut self, other: &Errors) {
        self.io += other.io;
        self.protocol += other.protocol;
        if self.first.is_none() {
            self.first.clone_from(&other.first);
        }
    }
}

/// A worker's counters and histograms.
#[derive(Debug)]
pub struct Stats {
    /// Whether answers are being recorded (the measured window).
    pub recording: bool,
    /// Answers by kind.
    pub counts: Counts,
    /// Requests answered.
    pub requests: u64,
    /// Requests answered since the start, window or not (for the progress line).
    pub requests_total: u64,
    /// Cycles completed since the start, window or not (for the progress line).
    pub cycles_total: u64,
    /// Completed cycles (release answered `R`; for `hold`, grants kept).
    pub cycles: u64,
    /// Every request: sent → answered.
    pub latency: Histogram<u64>,
    /// Every successful acquire: first attempt sent → grant received (includes queueing and,
    /// on Redis, retries).
    pub acquire_latency: Histogram<u64>,
    /// `contended`: previous holder's release sent → this grant received, for acquires that
    /// were waiting when that release was sent.
    pub handoff: Histogram<u64>,
    /// `hold`: waiter grant received − the holder's lease end (as the server reported it to the
    /// waiter's query), when not negative. Recorded in and out of the window.
    pub lateness: Histogram<u64>,
    /// `hold`: waiter grants that arrived before the estimated lease end.
    pub lateness_early: u64,
    /// `hold`: sampled keys already free when their waiter asked (the grant phase outlasted
    /// the lease). Recorded in and out of the window.
    pub expiry_missed: u64,
    /// Grants per connection of this worker (index: the worker's connection number).
    pub grants_per_connection: Vec<u64>,
    /// Unexpected answers received outside the measured window.
    pub unexpected_outside_window: u64,
    /// Connection-level errors.
    pub errors: Errors,
}

fn histogram() -> Histogram<u64> {
    Histogram::new_with_bounds(1, HISTOGRAM_NANOS_MAX, 3).expect("static histogram bounds")
}

fn nanos(duration: Duration) -> u64 {
    u64::try_from(duration.as_nanos())
        .unwrap_or(u64::MAX)
        .max(1)
}

impl Stats {
    /// Empty stats for a worker with `connections` connections, not recording.
    pub fn new(connections: usize) -> Stats {
        Stats {
            recording: false,
            counts: Counts::default(),
            requests: 0,
            requests_total: 0,
            cycles_total: 0,
            cycles: 0,
            latency: histogram(),
            acquire_latency: histogram(),
            handoff: histogram(),
            lateness: histogram(),
            lateness_early: 0,
            expiry_missed: 0,
            grants_per_connection: vec![0; connections],
            unexpected_outside_window: 0,
            errors: Errors::default(),
        }
    }

    /// Clears everything the window measures (not the errors) and starts recording.
    pub fn start_window(&mut self) {
        self.counts = Counts::default();
        self.requests = 0;
        self.cycles = 0;
        self.latency.reset();
        self.acquire_latency.reset();
        self.handoff.reset();
        self.lateness.reset();
        self.lateness_early = 0;
        self.expiry_missed = 0;
        self.grants_per_connection.fill(0);
        self.recording = true;
    }

    /// Records one answered request that took `latency`.
    pub fn request(&mut self, latency: Duration) {
        self.requests_total += 1;
        if self.recording {
            self.requests += 1;
            self.latency.saturating_record(nanos(latency));
        }
    }

    /// Records a grant on connection `connection` after `waited` since the first attempt.
    pub fn granted(&mut self, connection: usize, waited: Duration) {
        if self.recording {
            self.counts.granted += 1;
            self.grants_per_connection[connection] += 1;
            self.acquire_latency.saturating_record(nanos(waited));
        }
    }

    /// Records a handoff that took `handoff`.
    pub fn handoff(&mut self, handoff: Duration) {
        if self.recording {
            self.handoff.saturating_record(nanos(handoff));
        }
    }

    /// Records an expiry lateness sample: `Some(late)`, or `None` when the grant arrived before
    /// the estimated lease end. Recorded whatever the window: `hold` closes its window (the grant
    /// phase) before its waiters are granted.
    pub fn lateness(&mut self, late: Option<Duration>) {
        match late {
            Some(late) => self.lateness.saturating_record(nanos(late)),
            None => self.lateness_early += 1,
        }
    }

    /// Counts an answer with `bump`; if it is one `workload` never expects and the window is
    /// closed, counts it as unexpected outside the window instead.
    pub fn answer(&mut self, workload: Workload, bump: impl FnOnce(&mut Counts)) {
        if self.recording {
            bump(&mut self.counts);
            return;
        }
        let mut alone = Counts::default();
        bump(&mut alone);
        self.unexpected_outside_window += alone.unexpected(workload);
    }

    /// Counts a completed cycle.
    pub fn cycle(&mut self) {
        self.cycles_total += 1;
        if self.recording {
            self.cycles += 1;
        }
    }
}

/// Adds up the stats of several workers (histograms added, connections in worker order).
pub fn merged<'a>(all: impl Iterator<Item = &'a Stats> + Clone) -> Stats {
    let connections = all
        .clone()
        .map(|stats| stats.grants_per_connection.len())
        .sum();
    let mut merged = Stats::new(0);
    merged.grants_per_connection = Vec::with_capacity(connections);
    for stats in all {
        merged.counts.add(&stats.counts);
        merged.requests += stats.requests;
        merged.requests_total += stats.requests_total;
        merged.cycles += stats.cycles;
        merged.cycles_total += stats.cycles_total;
        for (into, from) in [
            (&mut merged.latency, &stats.latency),
            (&mut merged.acquire_latency, &stats.acquire_latency),
            (&mut merged.handoff, &stats.handoff),
            (&mut merged.lateness, &stats.lateness),
        ] {
            into.add(from).expect("histograms share their bounds");
        }
        merged.lateness_early += stats.lateness_early;
        merged.expiry_missed += stats.expiry_missed;
        merged
            .grants_per_connection
            .extend_from_slice(&stats.grants_per_connection);
        merged.unexpected_outside_window += stats.unexpected_outside_window;
        merged.errors.add(&stats.errors);
    }
    merged
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nothing_is_recorded_outside_the_window_but_surprises() {
        let mut stats = Stats::new(2);
        stats.request(Duration::from_micros(5));
        stats.granted(1, Duration::from_micros(5));
        stats.answer(Workload::Uncontended, |c| c.timeout += 1);
        stats.answer(Workload::Contended, |c| c.timeout += 1);
        stats.errors.io(|| "reset".into());
        assert_eq!(
            (stats.requests, stats.counts.granted, stats.latency.len()),
            (0, 0, 0)
        );
        assert_eq!(stats.unexpected_outside_window, 1);
        stats.start_window();
        stats.request(Duration::from_micros(5));
        stats.granted(1, Duration::from_micros(5));
        stats.answer(Workload::Uncontended, |c| c.released += 1);
        assert_eq!(
            (stats.requests, stats.counts.granted, stats.counts.released),
            (1, 1, 1)
        );
        assert_eq!(stats.grants_per_connection, vec![0, 1]);
        assert_eq!(stats.errors.io, 1, "errors survive the window start");
        assert_eq!(stats.errors.first.as_deref(), Some("reset"));
    }

    #[test]
    fn unexpected_answers_depend_on_the_workload() {
        let counts = Counts {
            timeout: 2,
            busy: 3,
            refused: 5,
            not_held: 7,
            moved: 100,
            no_leader: 11,
            ..Counts::default()
        };
        // A redirect is how a cluster is driven; giving up after too many is not.
        assert_eq!(counts.unexpected(Workload::Uncontended), 28);
        assert_eq!(counts.unexpected(Workload::Hold), 28);
        assert_eq!(counts.unexpected(Workload::Contended), 23);
    }

    #[test]
    fn merging_adds_everything_up() {
        let mut a = Stats::new(1);
        let mut b = Stats::new(2);
        for (stats, micros) in [(&mut a, 10), (&mut b, 30)] {
            stats.start_window();
            stats.request(Duration::from_micros(micros));
            stats.granted(0, Duration::from_micros(micros));
        }
        b.errors.protocol(|| "bad".into());
        let merged = merged([&a, &b].into_iter());
        assert_eq!(
            (merged.requests, merged.counts.granted, merged.latency.len()),
            (2, 2, 2)
        );
        assert_eq!(merged.grants_per_connection, vec![1, 1, 0]);
        assert_eq!(merged.errors.protocol, 1);
        assert!(merged.latency.max() >= 29_000);
    }

    #[test]
    fn huge_latencies_saturate() {
        let mut stats = Stats::new(1);
        stats.start_window();
        stats.request(Duration::from_secs(100_000));
        assert!(stats.latency.max() >= HISTOGRAM_NANOS_MAX / 2);
        stats.lateness(None);
        stats.lateness(Some(Duration::ZERO));
        assert_eq!((stats.lateness_early, stats.lateness.len()), (1, 1));
    }
}
