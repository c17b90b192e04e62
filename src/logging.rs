//! The server's logger: `[log] level` and `[log] format` of the config, with `RUST_LOG`
//! overriding the level (env_logger's filter syntax, per module too).
//!
//! Two formats, both to stderr, one record a line:
//!
//! * `text` (the default): env_logger's own lines, `[2026-12-03T13:11:03Z INFO latchkey] ...`.
//! * `json`: one object a line for log shippers, in this key order:
//!   `{"ts":"2026-12-03T13:11:03.123456Z","level":"INFO","target":"latchkey::server","msg":"..."}`.
//!   `ts` is RFC 3339 in UTC with microseconds, from the wall clock ([`timestamp`]); strings
//!   are escaped by serde_json, so a message with quotes or newlines stays one valid line.
//!
//! [`Throttle`] rate-limits one kind of line: the server's cores and the cluster's peer thread
//! use it so that nothing a client or a peer does can flood the log.
//!
//! Deliberately not here: what is logged and at which level (the callers), log files and
//! rotation (stderr only: systemd's journal or the shipper owns that), and time zones (UTC
//! only, so lines from several hosts sort together).

use std::io::Write;
use std::time::{SystemTime, UNIX_EPOCH};

use crate::config::{LogConfig, LogFormat};

/// Installs the process's logger from `[log]`, with `RUST_LOG` (when set) overriding the level.
/// Only the first call in a process installs one; later calls change nothing.
pub fn init(config: &LogConfig) {
    let mut builder = env_logger::Builder::new();
    builder.filter_level(config.level);
    if let Ok(spec) = std::env::var("RUST_LOG") {
        builder.parse_filters(&spec);
    }
    if config.format == LogFormat::Json {
        builder.write_style(env_logger::WriteStyle::Never);
        builder.format(|out, record| {
            let message = record.args().to_string();
            let level = record.level().as_str();
            let line = json_line(SystemTime::now(), level, record.target(), &message);
            writeln!(out, "{line}")
        });
    }
    // Fails only when a logger is already installed (a second call): keep that one.
    let _ = builder.try_init();
}

/// One log record as a JSON object on one line (without the newline): `ts`, `level`, `target`
/// and `msg`, in that order.
///
/// ```
/// use std::time::{Duration, UNIX_EPOCH};
/// use latchkey::logging::json_line;
///
/// let at = UNIX_EPOCH + Duration::from_micros(1_796_303_463_123_456);
/// let line = json_line(at, "INFO", "latchkey", "say \"hi\"");
/// let expected = r#"{"ts":"2026-12-03T13:11:03.123456Z","level":"INFO","#.to_owned()
///     + r#""target":"latchkey","msg":"say \"hi\""}"#;
/// assert_eq!(line, expected);
/// ```
pub fn json_line(time: SystemTime, level: &str, target: &str, message: &str) -> String {
    let quoted = |text: &str| serde_json::to_string(text).expect("a string always serializes");
    format!(
        "{{\"ts\":\"{}\",\"level\":{},\"target\":{},\"msg\":{}}}",
        timestamp(time),
        quoted(level),
        quoted(target),
        quoted(message)
    )
}

/// Seconds in a day (no leap seconds: Unix time has none).
const DAY_SECONDS: u64 = 86_400;
/// Days in any 400 consecutive Gregorian years (97 of them leap years).
const DAYS_PER_400_YEARS: u64 = 146_097;
/// The last year written; a clock past it is written as its last microsecond.
const YEAR_MAX: u64 = 9999;

/// `time` in RFC 3339, UTC, with microseconds: `2026-12-03T13:11:03.123456Z`. A time before
/// 1970 is written as the epoch, one after 9999 as the end of 9999 (a clock that far off is
/// broken, and the field keeps its fixed width).
///
/// ```
/// use std::time::{Duration, UNIX_EPOCH};
/// use latchkey::logging::timestamp;
///
/// assert_eq!(timestamp(UNIX_EPOCH), "1970-01-01T00:00:00.000000Z");
/// let leap_day = UNIX_EPOCH + Duration::from_secs(951_868_799);
/// assert_eq!(timestamp(leap_day), "2000-02-29T23:59:59.000000Z");
/// ```
pub fn timestamp(time: SystemTime) -> String {
    let since_epoch = time.duration_since(UNIX_EPOCH).unwrap_or_default();
    let seconds = since_epoch.as_secs();
    let (year, month, day) = date_of(seconds / DAY_SECONDS);
    if year > YEAR_MAX {
        return format!("{YEAR_MAX}-12-31T23:59:59.999999Z");
    }
    let second_of_day = seconds % DAY_SECONDS;
    let (hour, minute, second) = (
        second_of_day / 3600,
        second_of_day / 60 % 60,
        second_of_day % 60,
    );
    let micros = since_epoch.subsec_micros();
    format!("{year:04}-{month:02}-{day:02}T{hour:02}:{minute:02}:{second:02}.{micros:06}Z")
}

fn is_leap_year(year: u64) -> bool {
    year % 4 == 0 && (year % 100 != 0 || year % 400 == 0)
}

/// The Gregorian (year, month 1..=12, day 1..=31) of the day `days` after 1970-01-01.
fn date_of(days: u64) -> (u64, u64, u64) {
    // Whole 400-year spans first, so the year loop below runs at most 400 times.
    let mut year = 1970 + 400 * (days / DAYS_PER_400_YEARS);
    let mut day_of_span = days % DAYS_PER_400_YEARS;
    loop {
        let year_days = if is_leap_year(year) { 366 } else { 365 };
        if day_of_span < year_days {
            break;
        }
        day_of_span -= year_days;
        year += 1;
    }
    let february = if is_leap_year(year) { 29 } else { 28 };
    let month_days = [31, february, 31, 30, 31, 30, 31, 31, 30, 31, 30, 31];
    let mut day_of_year = day_of_span;
    for (index, length) in month_days.into_iter().enumerate() {
        if day_of_year < length {
            return (year, index as u64 + 1, day_of_year + 1);
        }
        day_of_year -= length;
    }
    unreachable!("a day of the year falls in one of its months")
}

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

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    fn at(seconds: u64, micros: u64) -> SystemTime {
        UNIX_EPOCH + Duration::from_secs(seconds) + Duration::from_micros(micros)
    }

    #[test]
    fn timestamps_are_rfc3339_utc_with_microseconds() {
        let cases = [
            (0, 0, "1970-01-01T00:00:00.000000Z"),
            (1_796_303_463, 123_456, "2026-12-03T13:11:03.123456Z"),
            (951_868_799, 999_999, "2000-02-29T23:59:59.999999Z"),
            (946_598_400, 0, "1999-12-31T00:00:00.000000Z"),
            // 2100 is not a leap year: the day after February 28 is March 1.
            (4_107_542_400, 0, "2100-03-01T00:00:00.000000Z"),
            (13_601_044_800, 0, "2400-12-31T12:00:00.000000Z"),
        ];
        for (seconds, micros, expected) in cases {
            assert_eq!(timestamp(at(seconds, micros)), expected);
        }
        let before_epoch = UNIX_EPOCH - Duration::from_secs(1);
        assert_eq!(timestamp(before_epoch), "1970-01-01T00:00:00.000000Z");
        let far = at(400_000_000_000, 0);
        assert_eq!(timestamp(far), "9999-12-31T23:59:59.999999Z");
    }

    #[test]
    fn every_day_of_a_leap_cycle_follows_the_previous_one() {
        let mut previous = date_of(0);
        assert_eq!(previous, (1970, 1, 1));
        for days in 1..DAYS_PER_400_YEARS + 366 {
            let (year, month, day) = date_of(days);
            let next_day = (previous.0, previous.1, previous.2 + 1);
            let next_month = (previous.0, previous.1 + 1, 1);
            let next_year = (previous.0 + 1, 1, 1);
            let candidates = [next_day, next_month, next_year];
            assert!(
                candidates.contains(&(year, month, day)),
                "{previous:?} → {days}"
            );
            assert!((1..=31).contains(&day) && (1..=12).contains(&month));
            previous = (year, month, day);
        }
    }

    #[test]
    fn json_lines_escape_and_parse_back() {
        let message = "a \"quoted\" word,\na newline, a tab\t and é";
        let line = json_line(at(0, 1), "WARN", "latchkey::server", message);
        assert!(!line.contains('\n'));
        let value: serde_json::Value = serde_json::from_str(&line).unwrap();
        assert_eq!(value["ts"], "1970-01-01T00:00:00.000001Z");
        assert_eq!(value["level"], "WARN");
        assert_eq!(value["target"], "latchkey::server");
        assert_eq!(value["msg"], message);
        assert!(line.starts_with("{\"ts\":"));
    }
}
