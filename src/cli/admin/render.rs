//! The text of `latchkey stats` and `latchkey keys`: pure functions of the server's JSON. No
//! I/O.
//!
//! Fields these functions do not know are ignored; a missing or mistyped field shows as `-`,
//! so an older or newer server still renders. Times are upper bounds of histogram buckets
//! where the JSON says so (`p50`, `p99`), written `≤ N ms`.

use std::time::Duration;

use serde_json::Value;

use super::STALL_SECONDS;
use crate::cli::{format_duration, shown_key};

/// What a missing or mistyped field shows as.
const MISSING: &str = "-";
/// Two bounds this close count as equal (bounds travel as decimal seconds).
const BOUND_TOLERANCE: f64 = 1e-9;

/// A `# Title` block of `name: value` lines, the values aligned.
struct Section {
    title: &'static str,
    lines: Vec<(String, String)>,
}

impl Section {
    fn new(title: &'static str) -> Section {
        Section {
            title,
            lines: Vec::new(),
        }
    }

    fn line(&mut self, name: impl Into<String>, value: impl Into<String>) {
        self.lines.push((name.into(), value.into()));
    }

    fn write(&self, out: &mut String) {
        let width = self.lines.iter().map(|(name, _)| name.chars().count() + 1);
        let width = width.max().unwrap_or(0);
        out.push_str(&format!("# {}\n", self.title));
        for (name, value) in &self.lines {
            out.push_str(&format!("{:<width$} {value}\n", format!("{name}:")));
        }
    }
}

/// `latchkey stats` as text: `# Server`, `# Sessions`, `# Locks`, `# Latency`, `# Busy` and
/// `# Loop`, separated by blank lines; merged stats of several members (with a `members`
/// list) begin with `# Members`.
pub(super) fn render_stats(stats: &Value) -> String {
    let members = stats.get("members").and_then(Value::as_array);
    let sections = [
        members.map(|rows| members_section(rows)),
        Some(server_section(stats)),
        Some(sessions_section(stats)),
        Some(locks_section(stats)),
        Some(latency_section(stats)),
        Some(busy_section(stats)),
        Some(loop_section(stats)),
    ];
    let mut out = String::new();
    for (index, section) in sections.iter().flatten().enumerate() {
        if index > 0 {
            out.push('\n');
        }
        section.write(&mut out);
    }
    out
}

/// One line per member of merged stats: who it is and its own figures, or its error.
fn members_section(rows: &[Value]) -> Section {
    let mut section = Section::new("Members");
    for row in rows {
        let name = text(row.get("member"));
        if let Some(error) = row.get("error").and_then(Value::as_str) {
            section.line(name, format!("no answer: {error}"));
            continue;
        }
        let mut parts = Vec::new();
        if let Some(id) = row.get("node_id").and_then(Value::as_u64) {
            parts.push(format!("node {id}"));
        }
        let uptime = row.get("uptime_seconds").and_then(Value::as_f64);
        parts.push(format!(
            "up {}",
            uptime.map_or_else(|| MISSING.to_owned(), uptime_text)
        ));
        parts.push(format!("cores {}", count(row.get("cores"))));
        parts.push(format!("sessions {}", count(row.get("sessions"))));
        if let Some(led) = row.get("shards_led").and_then(Value::as_u64) {
            let shards = count(row.get("shard_count"));
            parts.push(format!("leads {led} of {shards} shards"));
        }
        parts.push(format!("locks {}", count(row.get("locks_held"))));
        let worst = row.get("worst_iteration_seconds").and_then(Value::as_f64);
        let worst = worst.map_or_else(|| MISSING.to_owned(), millis_text);
        parts.push(format!("worst iteration {worst} ms"));
        section.line(name, parts.join(", "));
    }
    section
}

fn text(value: Option<&Value>) -> String {
    value
        .and_then(Value::as_str)
        .map_or_else(|| MISSING.to_owned(), str::to_owned)
}

fn count(value: Option<&Value>) -> String {
    value
        .and_then(Value::as_u64)
        .map_or_else(|| MISSING.to_owned(), |count| count.to_string())
}

fn server_section(stats: &Value) -> Section {
    let mut section = Section::new("Server");
    section.line("version", text(stats.get("version")));
    section.line("commit", text(stats.get("commit")));
    let uptime = stats.get("uptime_seconds").and_then(Value::as_f64);
    section.line(
        "uptime",
        uptime.map_or_else(|| MISSING.to_owned(), uptime_text),
    );
    let cores = count(stats.get("cores"));
    match stats.get("members") {
        // Merged figures of several members: cores are each member's own.
        Some(_) if cores == MISSING => section.line("cores", "differ per member (# Members)"),
        Some(_) => section.line("cores", format!("{cores} per member")),
        None => section.line("cores", cores),
    }
    if let Some(stopping) = stats.get("shutting_down").and_then(Value::as_bool) {
        section.line("state", if stopping { "shutting down" } else { "serving" });
    }
    section
}

/// `12.5s` under a minute, else whole units from the largest: `3h 2m 5s`, `2d 0h 0m 1s`.
fn uptime_text(seconds: f64) -> String {
    if seconds < 60.0 {
        return format!("{seconds:.1}s");
    }
    let whole = seconds as u64;
    let units = [
        ("d", whole / 86_400),
        ("h", whole / 3600 % 24),
        ("m", whole / 60 % 60),
        ("s", whole % 60),
    ];
    let first = units.iter().position(|&(_, value)| value > 0).unwrap_or(3);
    let parts: Vec<String> = units[first..]
        .iter()
        .map(|(unit, value)| format!("{value}{unit}"))
        .collect();
    parts.join(" ")
}

fn sessions_section(stats: &Value) -> Section {
    let mut section = Section::new("Sessions");
    section.line("open", count(stats.get("sessions")));
    section.line("refused", count(stats.get("sessions_refused")));
    section
}

fn locks_section(stats: &Value) -> Section {
    let uptime = stats.get("uptime_seconds").and_then(Value::as_f64);
    let mut section = Section::new("Locks");
    section.line("held", count(stats.get("locks_held")));
    section.line("waiters", count(stats.get("waiters")));
    for name in [
        "acquires",
        "releases",
        "extends",
        "cancels",
        "lease_expirations",
    ] {
        section.line(name, outcomes_text(stats.get(name), uptime));
    }
    section
}

/// A counter, or an object of counters by outcome: the total, its rate per second since the
/// start, and the outcomes (`3 (0.25/s): acquired 2, busy 0, rejected 0, timeout 1`).
fn outcomes_text(value: Option<&Value>, uptime_seconds: Option<f64>) -> String {
    let (total, detail) = match value {
        Some(Value::Object(outcomes)) => {
            let counted: Vec<(&String, u64)> = outcomes
                .iter()
                .filter_map(|(name, count)| Some((name, count.as_u64()?)))
                .collect();
            let total = counted.iter().map(|(_, count)| count).sum::<u64>();
            let named: Vec<String> = counted
                .iter()
                .map(|(name, count)| format!("{name} {count}"))
                .collect();
            (total, Some(named.join(", ")))
        }
        Some(Value::Number(number)) if number.as_u64().is_some() => {
            (number.as_u64().unwrap_or(0), None)
        }
        _ => return MISSING.to_owned(),
    };
    let rate = match uptime_seconds {
        Some(uptime) if uptime > 0.0 => format!("{:.2}/s", total as f64 / uptime),
        _ => format!("{MISSING}/s"),
    };
    match detail {
        Some(detail) => format!("{total} ({rate}): {detail}"),
        None => format!("{total} ({rate})"),
    }
}

fn latency_section(stats: &Value) -> Section {
    let mut section = Section::new("Latency");
    let wait = stats.get("acquire_wait_seconds");
    section.line("acquire_wait", histogram_text(wait, "acquires that queued"));
    let hold = stats.get("lock_hold_seconds");
    section.line("lock_hold", histogram_text(hold, "holds that ended"));
    section
}

/// Seconds as milliseconds, to the microsecond, without trailing zeros: `10`, `0.25`, `1.1`.
fn millis_text(seconds: f64) -> String {
    let text = format!("{:.3}", seconds * 1000.0);
    let text = text.trim_end_matches('0').trim_end_matches('.');
    text.to_owned()
}

/// `p50 ≤ 10 ms, p99 ≤ 100 ms, max 120 ms (5 acquires that queued)`.
fn histogram_text(histogram: Option<&Value>, counted: &str) -> String {
    let Some(histogram) = histogram.filter(|histogram| histogram.is_object()) else {
        return MISSING.to_owned();
    };
    let samples = histogram.get("count").and_then(Value::as_u64);
    if samples == Some(0) {
        return format!("no samples yet (0 {counted})");
    }
    let bound = |name: &str| match histogram.get(name).and_then(Value::as_f64) {
        Some(seconds) => format!("≤ {} ms", millis_text(seconds)),
        None => MISSING.to_owned(),
    };
    let mut text = format!("p50 {}, p99 {}", bound("p50"), bound("p99"));
    if let Some(max) = histogram.get("max").and_then(Value::as_f64) {
        text.push_str(&format!(", max {} ms", millis_text(max)));
    }
    text.push_str(&format!(" ({} {counted})", count(histogram.get("count"))));
    text
}

fn busy_section(stats: &Value) -> Section {
    let mut section = Section::new("Busy");
    match stats.get("busy") {
        Some(Value::Object(reasons)) => {
            for (reason, answers) in reasons {
                section.line(reason.as_str(), count(Some(answers)));
            }
        }
        _ => section.line("reasons", MISSING),
    }
    section
}

fn loop_section(stats: &Value) -> Section {
    let cores = stats
        .get("loop_iteration_seconds")
        .and_then(Value::as_array);
    let cores = cores.map_or(&[][..], Vec::as_slice);
    let core_number = |index: usize, core: &Value| {
        let number = core.get("core").and_then(Value::as_u64);
        let number = number.unwrap_or(index as u64);
        match core.get("member").and_then(Value::as_str) {
            Some(member) => format!("{member} core {number}"),
            None => format!("core {number}"),
        }
    };
    let worst = cores
        .iter()
        .enumerate()
        .filter_map(|(index, core)| Some((core.get("max")?.as_f64()?, core_number(index, core))))
        .max_by(|a, b| a.0.total_cmp(&b.0));
    let mut section = Section::new("Loop");
    let worst_text = match worst {
        Some((max, core)) => format!("{} ms ({core})", millis_text(max)),
        None => MISSING.to_owned(),
    };
    section.line("worst_iteration", worst_text);
    for (index, core) in cores.iter().enumerate() {
        section.line(core_number(index, core), stalls_text(core));
    }
    section
}

/// `10 of 2000 iterations over 1 ms`, from the cumulative buckets: everything above the
/// largest bound of at most 1 ms.
fn stalls_text(core: &Value) -> String {
    let Some(iterations) = core.get("count").and_then(Value::as_u64) else {
        return MISSING.to_owned();
    };
    let buckets = core.get("buckets").and_then(Value::as_array);
    let within = buckets
        .map_or(&[][..], Vec::as_slice)
        .iter()
        .filter_map(|bucket| {
            let pair = bucket.as_array()?;
            Some((pair.first()?.as_f64()?, pair.get(1)?.as_u64()?))
        })
        .filter(|&(bound, _)| bound <= STALL_SECONDS + BOUND_TOLERANCE)
        .map(|(_, cumulative)| cumulative)
        .max()
        .unwrap_or(0);
    let over = iterations.saturating_sub(within);
    format!(
        "{over} of {iterations} iterations over {} ms",
        millis_text(STALL_SECONDS)
    )
}

/// `latchkey keys` as text: a table `KEY OWNER PEER HELD LEASE WAITERS`, one held key a row,
/// columns aligned, keys shortened as messages show them.
pub(super) fn render_keys(keys: &[Value]) -> String {
    let header = ["KEY", "OWNER", "PEER", "HELD", "LEASE", "WAITERS"].map(str::to_owned);
    let rows: Vec<[String; 6]> = std::iter::once(header)
        .chain(keys.iter().map(key_row))
        .collect();
    let mut widths = [0; 6];
    for row in &rows {
        for (width, cell) in widths.iter_mut().zip(row) {
            *width = (*width).max(cell.chars().count());
        }
    }
    let mut out = String::new();
    for row in &rows {
        let cells: Vec<String> = row
            .iter()
            .zip(widths)
            .map(|(cell, width)| format!("{cell:<width$}"))
            .collect();
        out.push_str(cells.join("  ").trim_end());
        out.push('\n');
    }
    out
}

/// An owner id: a decimal string (what servers send, exact beyond 2^53), or a number (older
/// servers).
fn owner_text(value: Option<&Value>) -> String {
    match value {
        Some(Value::String(owner)) if owner.bytes().all(|b| b.is_ascii_digit()) => owner.clone(),
        other => count(other),
    }
}

fn key_row(entry: &Value) -> [String; 6] {
    let duration = |name: &str| match entry.get(name).and_then(Value::as_u64) {
        Some(millis) => format_duration(Duration::from_millis(millis)),
        None => MISSING.to_owned(),
    };
    let key = entry.get("key").and_then(Value::as_str);
    [
        key.map_or_else(|| MISSING.to_owned(), shown_key),
        owner_text(entry.get("owner")),
        text(entry.get("peer")),
        duration("held_ms"),
        duration("lease_ms"),
        count(entry.get("waiters")),
    ]
}
