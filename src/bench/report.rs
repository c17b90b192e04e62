//! The result of a run: merged figures, the human table, and the `--json` object.
//!
//! The JSON is written by hand (one object, one line) with a fixed set of fields, so that a
//! script can pick fields out with `jq` or `grep`. Fields that do not apply to a workload are
//! `null`. Latencies are microseconds with one decimal; rates are per second.
//!
//! Redis answers are reported in the latchkey letters: `A` = `SET NX` granted, `T` = gave up
//! (held key and no wait left), `R` = the release script deleted the key, `N` = it did not,
//! `X` = an error reply. `retries` counts Redis `SET NX` attempts that found the key held.
//! Against a cluster, `M` counts the requests a member redirected (followed, not unexpected)
//! and `no_leader` the cycles given up after too many redirects (unexpected).
//!
//! Deliberately not here: measuring anything.

use std::fmt::Write as _;
use std::time::Duration;

use hdrhistogram::Histogram;
use serde::Serialize;

use super::stats::{merged, Stats};
use super::worker::WorkerOutcome;
use super::{BenchConfig, Dialect, Workload, REDIS_RETRY};

/// `hold` figures the driver measures outside the workers.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct HoldFigures {
    /// Server RSS before the grants, when `--server-pid` was given.
    pub rss_before_bytes: Option<u64>,
    /// Server RSS with every lease granted, when `--server-pid` was given.
    pub rss_after_bytes: Option<u64>,
    /// Sampled keys that got a waiter.
    pub samples: usize,
}

/// Percentiles of a latency histogram, in microseconds.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Percentiles {
    /// Median.
    pub p50: f64,
    /// 90th percentile.
    pub p90: f64,
    /// 99th percentile.
    pub p99: f64,
    /// 99.9th percentile.
    pub p999: f64,
    /// Largest value.
    pub max: f64,
    /// Values recorded.
    pub count: u64,
}

impl Percentiles {
    /// The percentiles of a nanosecond histogram, or `None` when it is empty.
    pub fn of(histogram: &Histogram<u64>) -> Option<Percentiles> {
        if histogram.is_empty() {
            return None;
        }
        let micros = |nanos: u64| nanos as f64 / 1000.0;
        Some(Percentiles {
            p50: micros(histogram.value_at_quantile(0.50)),
            p90: micros(histogram.value_at_quantile(0.90)),
            p99: micros(histogram.value_at_quantile(0.99)),
            p999: micros(histogram.value_at_quantile(0.999)),
            max: micros(histogram.max()),
            count: histogram.len(),
        })
    }
}

/// Everything a run measured.
#[derive(Debug)]
pub struct Report {
    /// What was run.
    pub config: BenchConfig,
    /// The measured window (for `hold`: the grant phase).
    pub elapsed: Duration,
    /// All workers' stats, merged.
    pub stats: Stats,
    /// `hold` only.
    pub hold: Option<HoldFigures>,
}

impl Report {
    /// Merges the workers' outcomes.
    pub fn merge(
        config: &BenchConfig,
        outcomes: Vec<WorkerOutcome>,
        hold: Option<HoldFigures>,
    ) -> Report {
        let stats = merged(outcomes.iter().map(|outcome| &outcome.stats));
        let elapsed = outcomes
            .iter()
            .map(|outcome| outcome.window)
            .max()
            .unwrap_or_default();
        Report {
            config: config.clone(),
            elapsed,
            stats,
            hold,
        }
    }

    fn per_second(&self, count: u64) -> f64 {
        let seconds = self.elapsed.as_secs_f64();
        if seconds > 0.0 {
            count as f64 / seconds
        } else {
            0.0
        }
    }

    /// Completed cycles per second (`hold`: leases granted per second).
    pub fn cycles_per_sec(&self) -> f64 {
        self.per_second(self.stats.cycles)
    }

    /// Requests answered per second.
    pub fn requests_per_sec(&self) -> f64 {
        self.per_second(self.stats.requests)
    }

    /// Everything a healthy server and network never produce in this workload.
    pub fn unexpected(&self) -> u64 {
        let stats = &self.stats;
        stats.counts.unexpected(self.config.workload)
            + stats.unexpected_outside_window
            + stats.errors.io
            + stats.errors.protocol
    }

    /// Whether the run measured something and saw nothing unexpected. A run that completed no
    /// cycle in its window measured nothing (e.g. the target never answered, or is not the
    /// server its scheme names), so it is not ok even when nothing unexpected was counted.
    pub fn ok(&self) -> bool {
        self.unexpected() == 0 && self.stats.cycles > 0
    }

    /// Why the run is not [`ok`](Self::ok), for the loud line on stderr; `None` when it is.
    pub fn failure(&self) -> Option<String> {
        if self.unexpected() > 0 {
            return Some(self.alarm());
        }
        if self.stats.cycles > 0 {
            return None;
        }
        let server = match self.config.target.dialect {
            Dialect::Latchkey => "latchkey",
            Dialect::Redis => "Redis",
        };
        Some(format!(
            "NOTHING MEASURED: no {} cycle completed in the measured window against {} \
             ({} requests answered in all): is it a {server} server, and does it answer?",
            self.config.workload.name(),
            self.config.target,
            self.stats.requests_total,
        ))
    }

    /// The loud message for a run with unexpected answers or errors.
    pub fn alarm(&self) -> String {
        let stats = &self.stats;
        let counts = &stats.counts;
        let mut text = format!(
            "UNEXPECTED: {} unexpected answers or errors in the {} run against {} \
             (T {}, B {}, N {}, X {}, no leader {} in the window; {} outside it; \
             I/O errors {}, protocol errors {})",
            self.unexpected(),
            self.config.workload.name(),
            self.config.target,
            counts.timeout,
            counts.busy,
            counts.not_held,
            counts.refused,
            counts.no_leader,
            stats.unexpected_outside_window,
            stats.errors.io,
            stats.errors.protocol,
        );
        if self.config.workload == Workload::Contended {
            text.push_str(" (T and B are expected in a contended run and not counted here)");
        }
        if let Some(first) = &stats.errors.first {
            let _ = write!(text, "; first error: {first}");
        }
        if stats.cycles == 0 {
            text.push_str("; no cycle completed in the measured window");
        }
        text
    }

    /// Grants per connection (min, max) for `contended`.
    pub fn fairness(&self) -> Option<(u64, u64)> {
        if self.config.workload != Workload::Contended {
            return None;
        }
        let grants = &self.stats.grants_per_connection;
        Some((*grants.iter().min()?, *grants.iter().max()?))
    }

    /// Server RSS growth per lease granted, when both readings exist and every lease was
    /// still held at the second one (the grant phase ended before the first lease could).
    pub fn rss_bytes_per_lock(&self) -> Option<f64> {
        let hold = self.hold?;
        let (before, after) = (hold.rss_before_bytes?, hold.rss_after_bytes?);
        let locks = self.stats.counts.granted;
        let all_held = self.elapsed < self.config.lease;
        (locks > 0 && all_held).then(|| (after as f64 - before as f64) / locks as f64)
    }

    fn retries_note(&self) -> Option<String> {
        let retrying = self.config.target.dialect == Dialect::Redis
            && self.config.workload != Workload::Uncontended;
        retrying.then(|| {
            format!(
                "Redis has no wait queue: a failed SET NX is retried every {} ms, as typical \
                 clients do",
                REDIS_RETRY.as_millis()
            )
        })
    }
}

/// A figure as the JSON shows it: rounded to `decimals` places, `None` (null) when not finite
/// (JSON has no NaN or infinity).
fn figure(value: f64, decimals: usize) -> Option<f64> {
    if !value.is_finite() {
        return None;
    }
    format!("{value:.decimals$}").parse().ok()
}

/// Latency percentiles in the JSON, in µs to one decimal.
#[derive(Serialize)]
struct JsonPercentiles {
    p50: Option<f64>,
    p90: Option<f64>,
    p99: Option<f64>,
    p999: Option<f64>,
    max: Option<f64>,
    count: u64,
}

impl JsonPercentiles {
    fn of(percentiles: Option<Percentiles>) -> Option<JsonPercentiles> {
        percentiles.map(|p| JsonPercentiles {
            p50: figure(p.p50, 1),
            p90: figure(p.p90, 1),
            p99: figure(p.p99, 1),
            p999: figure(p.p999, 1),
            max: figure(p.max, 1),
            count: p.count,
        })
    }
}

/// The `--json` object, its fields in the order they are written.
#[derive(Serialize)]
struct JsonReport<'a> {
    target: String,
    workload: &'static str,
    parameters: JsonParameters,
    elapsed_ms: Option<f64>,
    cycles: u64,
    cycles_per_sec: Option<f64>,
    requests: u64,
    requests_per_sec: Option<f64>,
    latency_us: Option<JsonPercentiles>,
    counts: JsonCounts,
    errors: JsonErrors<'a>,
    unexpected: u64,
    ok: bool,
    redis_retry_ms: Option<u64>,
    acquire_latency_us: Option<JsonPercentiles>,
    handoff_latency_us: Option<JsonPercentiles>,
    fairness: Option<JsonFairness>,
    rss_before_bytes: Option<u64>,
    rss_after_bytes: Option<u64>,
    rss_bytes_per_lock: Option<f64>,
    expiry_waiters: Option<usize>,
    expiry_lateness_us: Option<JsonLateness>,
}

#[derive(Serialize)]
struct JsonParameters {
    connections: u32,
    pipeline: u16,
    threads: usize,
    duration_ms: u64,
    warmup_ms: u64,
    keys: u64,
    hot_keys: u64,
    hold_ms: u64,
    wait_ms: u64,
    lease_ms: u64,
    server_pid: Option<u32>,
    shards: Option<u32>,
}

#[derive(Serialize)]
struct JsonCounts {
    #[serde(rename = "A")]
    granted: u64,
    #[serde(rename = "T")]
    timeout: u64,
    #[serde(rename = "B")]
    busy: u64,
    #[serde(rename = "X")]
    refused: u64,
    #[serde(rename = "N")]
    not_held: u64,
    #[serde(rename = "R")]
    released: u64,
    retries: u64,
    #[serde(rename = "M")]
    moved: u64,
    no_leader: u64,
}

#[derive(Serialize)]
struct JsonErrors<'a> {
    io: u64,
    protocol: u64,
    unexpected_outside_window: u64,
    first: Option<&'a str>,
}

#[derive(Serialize)]
struct JsonFairness {
    connections: usize,
    min_grants: u64,
    max_grants: u64,
    max_over_min: Option<f64>,
}

#[derive(Serialize)]
struct JsonLateness {
    p50: Option<f64>,
    p99: Option<f64>,
    max: Option<f64>,
    samples: u64,
    early: u64,
    missed: u64,
}

/// Whole milliseconds (a bench's durations are far below `u64::MAX` ms).
fn millis(duration: Duration) -> u64 {
    u64::try_from(duration.as_millis()).unwrap_or(u64::MAX)
}

impl Report {
    /// The run as one JSON object on one line.
    pub fn to_json(&self) -> String {
        let config = &self.config;
        let stats = &self.stats;
        let counts = &stats.counts;
        let contended = config.workload == Workload::Contended;
        let hold = self.hold.unwrap_or(HoldFigures {
            rss_before_bytes: None,
            rss_after_bytes: None,
            samples: 0,
        });
        let report = JsonReport {
            target: config.target.to_string(),
            workload: config.workload.name(),
            parameters: JsonParameters {
                connections: config.connections,
                pipeline: config.pipeline,
                threads: config.threads,
                duration_ms: millis(config.duration),
                warmup_ms: millis(config.warmup),
                keys: config.keys,
                hot_keys: config.hot_keys,
                hold_ms: millis(config.hold),
                wait_ms: millis(config.wait),
                lease_ms: millis(config.lease),
                server_pid: config.server_pid,
                shards: config.shards,
            },
            elapsed_ms: figure(self.elapsed.as_secs_f64() * 1000.0, 1),
            cycles: stats.cycles,
            cycles_per_sec: figure(self.cycles_per_sec(), 1),
            requests: stats.requests,
            requests_per_sec: figure(self.requests_per_sec(), 1),
            latency_us: JsonPercentiles::of(Percentiles::of(&stats.latency)),
            counts: JsonCounts {
                granted: counts.granted,
                timeout: counts.timeout,
                busy: counts.busy,
                refused: counts.refused,
                not_held: counts.not_held,
                released: counts.released,
                retries: counts.retries,
                moved: counts.moved,
                no_leader: counts.no_leader,
            },
            errors: JsonErrors {
                io: stats.errors.io,
                protocol: stats.errors.protocol,
                unexpected_outside_window: stats.unexpected_outside_window,
                first: stats.errors.first.as_deref(),
            },
            unexpected: self.unexpected(),
            ok: self.ok(),
            redis_retry_ms: self.retries_note().map(|_| millis(REDIS_RETRY)),
            acquire_latency_us: contended
                .then(|| JsonPercentiles::of(Percentiles::of(&stats.acquire_latency)))
                .flatten(),
            handoff_latency_us: contended
                .then(|| JsonPercentiles::of(Percentiles::of(&stats.handoff)))
                .flatten(),
            fairness: self.fairness().map(|(min, max)| JsonFairness {
                connections: stats.grants_per_connection.len(),
                min_grants: min,
                max_grants: max,
                max_over_min: (min > 0)
                    .then(|| figure(max as f64 / min as f64, 3))
                    .flatten(),
            }),
            rss_before_bytes: hold.rss_before_bytes,
            rss_after_bytes: hold.rss_after_bytes,
            rss_bytes_per_lock: self.rss_bytes_per_lock().and_then(|v| figure(v, 1)),
            expiry_waiters: self.hold.map(|hold| hold.samples),
            expiry_lateness_us: self.hold.map(|_| {
                let p = Percentiles::of(&stats.lateness);
                let field =
                    |pick: fn(&Percentiles) -> f64| p.as_ref().and_then(|p| figure(pick(p), 1));
                JsonLateness {
                    p50: field(|p| p.p50),
                    p99: field(|p| p.p99),
                    max: field(|p| p.max),
                    samples: stats.lateness.len(),
                    early: stats.lateness_early,
                    missed: stats.expiry_missed,
                }
            }),
        };
        serde_json::to_string(&report).expect("a report serializes")
    }
}

/// `1234567.8` → `1,234,568`.
fn grouped(value: f64) -> String {
    let digits = format!("{:.0}", value.max(0.0));
    let mut out = String::with_capacity(digits.len() + digits.len() / 3);
    for (index, digit) in digits.chars().enumerate() {
        if index > 0 && (digits.len() - index) % 3 == 0 {
            out.push(',');
        }
        out.push(digit);
    }
    out
}

fn percentiles_row(p: Option<Percentiles>) -> String {
    match p {
        None => "(none)".into(),
        Some(p) => format!(
            "p50 {:.1}  p90 {:.1}  p99 {:.1}  p99.9 {:.1}  max {:.1}",
            p.p50, p.p90, p.p99, p.p999, p.max
        ),
    }
}

impl Report {
    /// The run as a short table for people.
    pub fn to_table(&self) -> String {
        let config = &self.config;
        let stats = &self.stats;
        let counts = &stats.counts;
        let mut out = String::new();
        let what = if config.workload == Workload::Hold {
            "grant phase"
        } else {
            "measured"
        };
        let _ = writeln!(
            out,
            "{} {}: {} connections x pipeline {}, {} threads, {:.2} s {what}",
            config.target,
            config.workload.name(),
            config.connections,
            config.pipeline,
            config.threads,
            self.elapsed.as_secs_f64(),
        );
        let rows = [
            ("cycles/s", grouped(self.cycles_per_sec())),
            ("requests/s", grouped(self.requests_per_sec())),
            (
                "latency us",
                percentiles_row(Percentiles::of(&stats.latency)),
            ),
            (
                "answers",
                format!(
                    "A {}  R {}  T {}  B {}  N {}  X {}  M {}",
                    counts.granted,
                    counts.released,
                    counts.timeout,
                    counts.busy,
                    counts.not_held,
                    counts.refused,
                    counts.moved
                ),
            ),
            (
                "errors",
                format!("io {}  protocol {}", stats.errors.io, stats.errors.protocol),
            ),
        ];
        for (label, value) in rows {
            let _ = writeln!(out, "  {label:<16} {value}");
        }
        self.write_workload_rows(&mut out);
        out
    }

    fn write_workload_rows(&self, out: &mut String) {
        let stats = &self.stats;
        if let Some(note) = self.retries_note() {
            // The retries of `hold` waiters happen after its window (the grant phase).
            let retries = match self.config.workload {
                Workload::Hold => String::new(),
                _ => format!("; retries {}", stats.counts.retries),
            };
            let _ = writeln!(out, "  {:<16} {note}{retries}", "redis");
        }
        if let Some((min, max)) = self.fairness() {
            let acquire = Percentiles::of(&stats.acquire_latency);
            let _ = writeln!(
                out,
                "  {:<16} {}",
                "acquire wait us",
                percentiles_row(acquire)
            );
            let handoff = Percentiles::of(&stats.handoff);
            let _ = writeln!(out, "  {:<16} {}", "handoff us", percentiles_row(handoff));
            let ratio = if min > 0 {
                format!("{:.2}x", max as f64 / min as f64)
            } else {
                "-".into()
            };
            let _ = writeln!(
                out,
                "  {:<16} grants per connection: min {min}, max {max} ({ratio})",
                "fairness"
            );
        }
        self.write_hold_rows(out);
    }

    fn write_hold_rows(&self, out: &mut String) {
        let stats = &self.stats;
        let Some(hold) = self.hold else { return };
        let _ = writeln!(
            out,
            "  {:<16} {}",
            "leases held",
            grouped(stats.counts.granted as f64)
        );
        let rss = match (
            hold.rss_before_bytes,
            hold.rss_after_bytes,
            self.rss_bytes_per_lock(),
        ) {
            (Some(before), Some(after), Some(per_lock)) => format!(
                "{:.1} MiB before, {:.1} MiB after: {per_lock:.1} bytes per lock",
                before as f64 / 1048576.0,
                after as f64 / 1048576.0
            ),
            (Some(_), Some(_), None) => "not measured: leases began to expire before the grant \
                                         phase ended (use a longer --lease)"
                .into(),
            _ => "not measured (give --server-pid)".into(),
        };
        let _ = writeln!(out, "  {:<16} {rss}", "server RSS");
        let lateness = match Percentiles::of(&stats.lateness) {
            Some(p) => format!(
                "p50 {:.1}  p99 {:.1}  max {:.1} us ({} waiters; {} granted before the \
                 estimated lease end)",
                p.p50, p.p99, p.max, hold.samples, stats.lateness_early
            ),
            None => format!("no samples ({} waiters)", hold.samples),
        };
        let _ = writeln!(out, "  {:<16} {lateness}", "expiry lateness");
        if stats.expiry_missed > 0 {
            let _ = writeln!(
                out,
                "  {:<16} {} sampled keys were already free when their waiter asked: the grant \
                 phase outlasted --lease; use a longer one",
                "WARNING", stats.expiry_missed
            );
        }
    }
}

#[cfg(test)]
#[path = "report_tests.rs"]
mod tests;
