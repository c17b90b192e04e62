//! The one duration syntax of every command (`lock`, `query`, `ping`, `bench`): a whole number
//! followed by `us`, `ms`, `s`, `m` or `h`; a bare number is seconds. And the way messages
//! write a duration back, in the same syntax.
//!
//! Deliberately not here: what range a flag accepts (each flag checks its own, e.g. the wire's
//! 255 s), and fractions (`1.5s` is refused rather than guessed at).

use std::time::Duration;

/// The units, longest name first where one is a prefix of another, in microseconds.
const UNITS: [(&str, u64); 5] = [
    ("us", 1),
    ("ms", 1_000),
    ("s", 1_000_000),
    ("m", 60_000_000),
    ("h", 3_600_000_000),
];

/// Parses a duration: a whole number followed by `us`, `ms`, `s`, `m` or `h` (`10s`, `500ms`,
/// `250us`, `2m`); a bare number is seconds.
///
/// ```
/// use std::time::Duration;
/// use latchkey::cli::parse_duration;
///
/// assert_eq!(parse_duration("500ms"), Ok(Duration::from_millis(500)));
/// assert_eq!(parse_duration("250us"), Ok(Duration::from_micros(250)));
/// assert_eq!(parse_duration("2m"), Ok(Duration::from_secs(120)));
/// assert_eq!(parse_duration("7"), Ok(Duration::from_secs(7)));
/// assert!(parse_duration("1.5s").is_err());
/// ```
pub fn parse_duration(text: &str) -> Result<Duration, String> {
    let digits = text
        .find(|c: char| !c.is_ascii_digit())
        .unwrap_or(text.len());
    let (number, unit) = text.split_at(digits);
    let bad =
        || format!("`{text}` is not a duration: a whole number and us, ms, s, m or h (10s, 500ms)");
    let value: u64 = number.parse().map_err(|_| bad())?;
    let unit = if unit.is_empty() { "s" } else { unit };
    let (_, unit_us) = UNITS
        .iter()
        .find(|(name, _)| *name == unit)
        .ok_or_else(bad)?;
    let micros = value.checked_mul(*unit_us).ok_or_else(bad)?;
    Ok(Duration::from_micros(micros))
}

/// Writes a duration the way [`parse_duration`] reads it, in the largest unit that divides it
/// (below a microsecond, rounded up to one).
///
/// ```
/// use std::time::Duration;
/// use latchkey::cli::format_duration;
///
/// assert_eq!(format_duration(Duration::from_millis(1500)), "1500ms");
/// assert_eq!(format_duration(Duration::from_secs(120)), "2m");
/// assert_eq!(format_duration(Duration::ZERO), "0s");
/// ```
pub fn format_duration(duration: Duration) -> String {
    let nanos = duration.as_nanos();
    let micros = nanos.div_ceil(1_000);
    if micros == 0 {
        return "0s".to_owned();
    }
    let (name, unit_us) = UNITS
        .iter()
        .rev()
        .find(|(_, unit_us)| micros % u128::from(*unit_us) == 0)
        .expect("every whole number of microseconds is whole in us");
    format!("{}{name}", micros / u128::from(*unit_us))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn durations_parse_in_every_unit_and_bare_seconds() {
        let cases = [
            ("250us", Duration::from_micros(250)),
            ("500ms", Duration::from_millis(500)),
            ("10s", Duration::from_secs(10)),
            ("10", Duration::from_secs(10)),
            ("2m", Duration::from_secs(120)),
            ("1h", Duration::from_secs(3600)),
            ("0", Duration::ZERO),
            ("0ms", Duration::ZERO),
        ];
        for (text, expected) in cases {
            assert_eq!(parse_duration(text), Ok(expected), "{text}");
        }
        for bad in [
            "",
            "s",
            "-1s",
            "1.5s",
            "10 s",
            " 10s",
            "5sec",
            "1d",
            "99999999999999h",
        ] {
            assert!(parse_duration(bad).is_err(), "{bad:?}");
        }
    }

    #[test]
    fn durations_are_written_back_in_the_same_syntax() {
        for text in ["250us", "1500ms", "10s", "2m", "1h", "0s", "61s"] {
            assert_eq!(format_duration(parse_duration(text).unwrap()), text);
        }
        assert_eq!(format_duration(Duration::from_nanos(1)), "1us");
    }
}
