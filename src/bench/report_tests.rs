//! The report's JSON shape and table, on hand-made stats.

use super::*;
use crate::bench::{parse_target, BenchConfig};

/// A strict little JSON checker with an explicit stack (no recursion).
struct Checker<'a> {
    text: &'a str,
    at: usize,
    /// Keys of the outermost object, in order.
    keys: Vec<String>,
}

impl Checker<'_> {
    fn peek(&mut self) -> u8 {
        let bytes = self.text.as_bytes();
        while bytes[self.at].is_ascii_whitespace() {
            self.at += 1;
        }
        bytes[self.at]
    }

    fn string(&mut self) -> &str {
        assert_eq!(
            self.peek(),
            b'"',
            "a string at {} in {}",
            self.at,
            self.text
        );
        let start = self.at + 1;
        let bytes = self.text.as_bytes();
        self.at = start;
        while bytes[self.at] != b'"' {
            assert!(bytes[self.at] >= 0x20, "raw control character in a string");
            self.at += if bytes[self.at] == b'\\' { 2 } else { 1 };
        }
        self.at += 1;
        &self.text[start..self.at - 1]
    }

    fn key(&mut self, depth: usize) {
        let key = self.string().to_string();
        if depth == 1 {
            self.keys.push(key);
        }
        assert_eq!(self.peek(), b':', "a colon at {} in {}", self.at, self.text);
        self.at += 1;
    }

    /// A scalar value, or `true` when a container opened (and was pushed).
    fn value(&mut self, stack: &mut Vec<u8>) -> bool {
        let rest = &self.text[self.at..];
        match self.peek() {
            open @ (b'{' | b'[') => {
                stack.push(if open == b'{' { b'}' } else { b']' });
                self.at += 1;
                return true;
            }
            b'"' => drop(self.string()),
            _ if rest.starts_with("true") || rest.starts_with("null") => self.at += 4,
            _ if rest.starts_with("false") => self.at += 5,
            _ => {
                let len = rest.find(|c: char| !(c.is_ascii_digit() || "+-.eE".contains(c)));
                let len = len.unwrap_or(rest.len());
                rest[..len]
                    .parse::<f64>()
                    .unwrap_or_else(|_| panic!("a value at {rest}"));
                self.at += len;
            }
        }
        false
    }

    fn check(text: &str) -> Vec<String> {
        let mut checker = Checker {
            text,
            at: 0,
            keys: Vec::new(),
        };
        let mut stack = Vec::new();
        let mut opened = checker.value(&mut stack);
        while let Some(&close) = stack.last() {
            let next = checker.peek();
            if next == close {
                checker.at += 1;
                stack.pop();
                opened = false;
                continue;
            }
            if !opened {
                assert_eq!(next, b',', "a comma at {} in {text}", checker.at);
                checker.at += 1;
            }
            if close == b'}' {
                checker.key(stack.len());
            }
            opened = checker.value(&mut stack);
        }
        assert_eq!(checker.at, text.len(), "trailing bytes in {text}");
        checker.keys
    }
}

fn check_json(text: &str) -> Vec<String> {
    Checker::check(text)
}

#[test]
fn the_checker_refuses_bad_json() {
    assert_eq!(check_json(r#"{"a":[1,{"b":null}],"c":"x\"y"}"#), ["a", "c"]);
    for bad in [
        r#"{"a":1,}"#,
        r#"{"a" 1}"#,
        r#"[1 2]"#,
        r#"{"a":tru}"#,
        r#"{"a":1}}"#,
    ] {
        let outcome = std::panic::catch_unwind(|| check_json(bad));
        assert!(outcome.is_err(), "{bad} passed");
    }
}

fn report(target: &str, workload: Workload) -> Report {
    let mut config = BenchConfig::new(parse_target(target).unwrap(), workload);
    config.connections = 2;
    let mut stats = Stats::new(2);
    stats.start_window();
    for micros in [10, 20, 30, 40] {
        stats.request(Duration::from_micros(micros));
        stats.granted(0, Duration::from_micros(micros));
    }
    stats.granted(1, Duration::from_micros(5));
    stats.handoff(Duration::from_micros(12));
    stats.cycles = 4;
    stats.counts.released = 4;
    let hold = (workload == Workload::Hold).then_some(HoldFigures {
        rss_before_bytes: Some(1000),
        rss_after_bytes: Some(1000 + 5 * 200),
        samples: 3,
    });
    if hold.is_some() {
        stats.lateness(Some(Duration::from_micros(900)));
        stats.lateness(None);
    }
    Report {
        config,
        elapsed: Duration::from_secs(2),
        stats,
        hold,
    }
}

const KEYS: [&str; 22] = [
    "target",
    "workload",
    "parameters",
    "elapsed_ms",
    "cycles",
    "cycles_per_sec",
    "requests",
    "requests_per_sec",
    "latency_us",
    "counts",
    "errors",
    "unexpected",
    "ok",
    "redis_retry_ms",
    "acquire_latency_us",
    "handoff_latency_us",
    "fairness",
    "rss_before_bytes",
    "rss_after_bytes",
    "rss_bytes_per_lock",
    "expiry_waiters",
    "expiry_lateness_us",
];

#[test]
fn json_is_one_valid_object_with_every_field() {
    for workload in [Workload::Uncontended, Workload::Contended, Workload::Hold] {
        for target in ["latchkey://127.0.0.1:1", "redis://127.0.0.1:2"] {
            let json = report(target, workload).to_json();
            assert!(!json.contains('\n'), "one line");
            assert_eq!(check_json(&json), KEYS, "{json}");
        }
    }
}

#[test]
fn json_carries_the_figures() {
    let json = report("latchkey://127.0.0.1:1", Workload::Uncontended).to_json();
    for part in [
        "\"target\":\"latchkey://127.0.0.1:1\"",
        "\"workload\":\"uncontended\"",
        "\"connections\":2,\"pipeline\":16",
        "\"duration_ms\":5000,\"warmup_ms\":1000",
        "\"cycles\":4,\"cycles_per_sec\":2.0",
        "\"requests\":4,\"requests_per_sec\":2.0",
        "\"counts\":{\"A\":5,\"T\":0,\"B\":0,\"X\":0,\"N\":0,\"R\":4,\"retries\":0,",
        ",\"retries\":0,\"M\":0,\"no_leader\":0},\"errors\"",
        "\"ok\":true",
        "\"redis_retry_ms\":null",
        "\"fairness\":null",
        "\"rss_bytes_per_lock\":null",
    ] {
        assert!(json.contains(part), "{part} not in {json}");
    }
    assert!(json.contains("\"latency_us\":{\"p50\":20.0,"), "{json}");
    assert!(json.contains("\"max\":40.0,\"count\":4}"), "{json}");
}

#[test]
fn contended_and_hold_add_their_figures() {
    let contended = report("redis://127.0.0.1:2", Workload::Contended).to_json();
    assert!(contended.contains("\"redis_retry_ms\":1"), "{contended}");
    assert!(contended.contains("\"min_grants\":1,\"max_grants\":4,\"max_over_min\":4.0"));
    assert!(
        contended.contains("\"handoff_latency_us\":{\"p50\":12.0"),
        "{contended}"
    );
    let hold = report("latchkey://127.0.0.1:1", Workload::Hold).to_json();
    assert!(hold.contains("\"rss_bytes_per_lock\":200.0"), "{hold}");
    assert!(hold.contains("\"expiry_waiters\":3"), "{hold}");
    assert!(
        hold.contains("\"expiry_lateness_us\":{\"p50\":900."),
        "{hold}"
    );
    assert!(
        hold.contains("\"samples\":1,\"early\":1,\"missed\":0}"),
        "{hold}"
    );
}

#[test]
fn rss_per_lock_needs_every_lease_still_held() {
    let mut report = report("latchkey://127.0.0.1:1", Workload::Hold);
    assert_eq!(report.rss_bytes_per_lock(), Some(200.0));
    report.elapsed = report.config.lease;
    assert_eq!(
        report.rss_bytes_per_lock(),
        None,
        "some leases may have expired already"
    );
    assert!(report.to_json().contains("\"rss_bytes_per_lock\":null"));
    assert!(
        report.to_table().contains("leases began to expire"),
        "{}",
        report.to_table()
    );
}

#[test]
fn unexpected_answers_make_the_run_not_ok() {
    let mut report = report("latchkey://127.0.0.1:1", Workload::Uncontended);
    report.stats.counts.not_held = 2;
    report
        .stats
        .errors
        .io(|| "connection 3: reset \"by\" peer".into());
    assert_eq!(report.unexpected(), 3);
    let json = report.to_json();
    assert!(json.contains("\"unexpected\":3,\"ok\":false"), "{json}");
    assert!(
        json.contains("\"first\":\"connection 3: reset \\\"by\\\" peer\""),
        "{json}"
    );
    check_json(&json);
    let alarm = report.alarm();
    assert!(alarm.starts_with("UNEXPECTED: 3"), "{alarm}");
    assert!(alarm.contains("N 2") && alarm.contains("reset"), "{alarm}");
}

#[test]
fn the_table_is_short_and_complete() {
    let table = report("redis://127.0.0.1:2", Workload::Contended).to_table();
    for part in [
        "redis://127.0.0.1:2 contended",
        "cycles/s",
        "requests/s",
        "p99.9",
        "handoff us",
    ] {
        assert!(table.contains(part), "{part} not in\n{table}");
    }
    assert!(table.contains("retried every 1 ms"), "{table}");
    assert!(table.lines().count() <= 12, "{table}");
    let hold = report("latchkey://127.0.0.1:1", Workload::Hold).to_table();
    assert!(hold.contains("200.0 bytes per lock"), "{hold}");
    assert_eq!(grouped(1_234_567.8), "1,234,568");
    assert_eq!(grouped(999.0), "999");
}

#[test]
fn a_run_that_completed_no_cycle_is_not_ok() {
    let mut report = report("latchkey://127.0.0.1:1", Workload::Uncontended);
    assert!(report.ok() && report.failure().is_none());
    report.stats.cycles = 0;
    assert_eq!(report.unexpected(), 0);
    assert!(!report.ok());
    let failure = report.failure().expect("nothing measured is a failure");
    assert!(
        failure.starts_with("NOTHING MEASURED: no uncontended cycle completed"),
        "{failure}"
    );
    assert!(failure.contains("is it a latchkey server"), "{failure}");
    let json = report.to_json();
    assert!(json.contains("\"unexpected\":0,\"ok\":false"), "{json}");
    report
        .stats
        .errors
        .protocol(|| "connection 0: bad frame".into());
    let alarm = report.failure().unwrap();
    assert!(alarm.starts_with("UNEXPECTED: 1"), "{alarm}");
    assert!(
        alarm.ends_with("no cycle completed in the measured window"),
        "{alarm}"
    );
}
