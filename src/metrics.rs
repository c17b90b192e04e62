//! Counters and fixed-bucket histograms that one core keeps for itself, and their sums.
//!
//! Every core (and its partition) counts what it does in plain integers it alone writes: no
//! atomics, no shared cache line per request. The core serving `GET /metrics` or `GET /stats`
//! gathers a copy of each core's figures over the cross-core channels and adds them up
//! ([`Histogram::merge`]). Histograms have fixed bucket bounds in microseconds, so merging is
//! adding arrays, and recording is a search over at most [`BUCKETS_MAX`] bounds.

/// Buckets a histogram may have (besides the one above its last bound).
pub const BUCKETS_MAX: usize = 24;

/// Bounds of the acquire-wait histogram, in microseconds: 100 µs to the longest wait (255 s).
pub const WAIT_BOUNDS_US: &[u64] = &[
    100,
    250,
    500,
    1_000,
    2_500,
    5_000,
    10_000,
    25_000,
    50_000,
    100_000,
    250_000,
    500_000,
    1_000_000,
    2_500_000,
    5_000_000,
    10_000_000,
    30_000_000,
    60_000_000,
    120_000_000,
    255_000_000,
];

/// Bounds of the lock-hold histogram, in microseconds: 100 µs to an hour (extends keep a lock
/// held past the longest lease).
pub const HOLD_BOUNDS_US: &[u64] = &[
    100,
    1_000,
    10_000,
    100_000,
    250_000,
    500_000,
    1_000_000,
    2_500_000,
    5_000_000,
    10_000_000,
    30_000_000,
    60_000_000,
    120_000_000,
    255_000_000,
    600_000_000,
    1_800_000_000,
    3_600_000_000,
];

const _: () = assert!(WAIT_BOUNDS_US.len() <= BUCKETS_MAX && HOLD_BOUNDS_US.len() <= BUCKETS_MAX);

/// Observations in fixed buckets of microseconds; the last bucket counts those above the last
/// bound. Counts per bucket, not cumulative.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Histogram {
    bounds_us: &'static [u64],
    counts: [u64; BUCKETS_MAX + 1],
    sum_us: u64,
    count: u64,
    max_us: u64,
}

impl Histogram {
    /// An empty histogram over ascending `bounds_us` (at most [`BUCKETS_MAX`]).
    pub fn new(bounds_us: &'static [u64]) -> Histogram {
        assert!(bounds_us.len() <= BUCKETS_MAX);
        assert!(bounds_us.windows(2).all(|pair| pair[0] < pair[1]));
        Histogram {
            bounds_us,
            counts: [0; BUCKETS_MAX + 1],
            sum_us: 0,
            count: 0,
            max_us: 0,
        }
    }

    /// Records one observation of `value_us` (a bucket's bound is inclusive: `le`).
    ///
    /// A linear scan from the smallest bound: short values (the common case on the request
    /// path) cost one or two well-predicted comparisons, where a binary search costs about
    /// five unpredictable ones.
    #[inline]
    pub fn record(&mut self, value_us: u64) {
        let bounds = self.bounds_us;
        let bucket = bounds
            .iter()
            .position(|&bound| value_us <= bound)
            .unwrap_or(bounds.len());
        self.counts[bucket] += 1;
        self.sum_us = self.sum_us.saturating_add(value_us);
        self.count += 1;
        self.max_us = self.max_us.max(value_us);
    }

    /// Adds `other`'s observations (same bounds) to this one.
    pub fn merge(&mut self, other: &Histogram) {
        assert_eq!(self.bounds_us, other.bounds_us, "merging unlike histograms");
        for (mine, theirs) in self.counts.iter_mut().zip(other.counts.iter()) {
            *mine += theirs;
        }
        self.sum_us = self.sum_us.saturating_add(other.sum_us);
        self.count += other.count;
        self.max_us = self.max_us.max(other.max_us);
    }

    /// Builds a histogram from per-bucket counts (the last: above the last bound), with `sum_us`
    /// and `max_us` of what they counted.
    pub fn from_counts(
        bounds_us: &'static [u64],
        counts: &[u64],
        sum_us: u64,
        max_us: u64,
    ) -> Histogram {
        assert_eq!(counts.len(), bounds_us.len() + 1);
        let mut histogram = Histogram::new(bounds_us);
        histogram.counts[..counts.len()].copy_from_slice(counts);
        histogram.count = counts.iter().sum();
        histogram.sum_us = sum_us;
        histogram.max_us = max_us;
        histogram
    }

    /// Observations so far.
    pub fn count(&self) -> u64 {
        self.count
    }

    /// Sum of the observations, in microseconds.
    pub fn sum_us(&self) -> u64 {
        self.sum_us
    }

    /// The largest observation, in microseconds (0 when empty).
    pub fn max_us(&self) -> u64 {
        self.max_us
    }

    /// Observations per bucket (not cumulative): one per bound, then the one above the last.
    pub fn bucket_counts(&self) -> &[u64] {
        &self.counts[..=self.bounds_us.len()]
    }

    /// The bucket bounds, in microseconds.
    pub fn bounds_us(&self) -> &'static [u64] {
        self.bounds_us
    }

    /// `(bound_us, cumulative count)` for each bound, as Prometheus's `le` buckets (the `+Inf`
    /// bucket, equal to [`count`](Self::count), is not included).
    pub fn cumulative(&self) -> impl Iterator<Item = (u64, u64)> + '_ {
        let mut total = 0;
        self.bounds_us
            .iter()
            .zip(self.counts.iter())
            .map(move |(&bound, &count)| {
                total += count;
                (bound, total)
            })
    }

    /// The bound of the bucket that holds the `quantile` (0..=1) observation: an upper bound on
    /// it. `None` when empty; the largest observation when it lies above the last bound.
    pub fn quantile_bound_us(&self, quantile: f64) -> Option<u64> {
        if self.count == 0 {
            return None;
        }
        let rank = ((quantile.clamp(0.0, 1.0) * self.count as f64).ceil() as u64).max(1);
        let found = self.cumulative().find(|&(_, total)| total >= rank);
        Some(found.map_or(self.max_us, |(bound, _)| bound.min(self.max_us)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn records_into_inclusive_buckets_and_merges() {
        let mut histogram = Histogram::new(&[10, 100]);
        for value in [0, 10, 11, 100, 101, 5000] {
            histogram.record(value);
        }
        assert_eq!(histogram.count(), 6);
        assert_eq!(histogram.sum_us(), 5222);
        assert_eq!(histogram.max_us(), 5000);
        assert_eq!(
            histogram.cumulative().collect::<Vec<_>>(),
            [(10, 2), (100, 4)]
        );
        let mut total = Histogram::new(&[10, 100]);
        total.merge(&histogram);
        total.merge(&histogram);
        assert_eq!(total.count(), 12);
        assert_eq!(total.cumulative().collect::<Vec<_>>(), [(10, 4), (100, 8)]);
        let rebuilt = Histogram::from_counts(&[10, 100], &[2, 2, 2], 5222, 5000);
        assert_eq!(rebuilt, histogram);
    }

    #[test]
    fn quantile_bounds() {
        let mut histogram = Histogram::new(&[10, 100]);
        assert_eq!(histogram.quantile_bound_us(0.5), None);
        for value in [1, 2, 3, 50] {
            histogram.record(value);
        }
        assert_eq!(histogram.quantile_bound_us(0.5), Some(10));
        assert_eq!(histogram.quantile_bound_us(0.99), Some(50));
        histogram.record(7000);
        assert_eq!(histogram.quantile_bound_us(1.0), Some(7000));
    }
}
