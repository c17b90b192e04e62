//! What a core logs beyond opens and closes: refused frames (`X`) and `B` answers, each at
//! info and rate-limited, so that a hostile or overloaded client never floods the log. At most
//! one line per [`LOG_PERIOD_US`](crate::logging::LOG_PERIOD_US) per kind (per error code; all `B` together), saying how many
//! more happened since the last line. No line per request.
//!
//! A forbidden key (`X` code 8) is logged with who asked and for what: the session's
//! identities and the key's first [`KEY_CHARS_LOGGED`] characters. Both come from the client
//! (a certificate's names, the request), so they are quoted with control characters escaped:
//! nothing a client sends can end the line or forge another.

use super::core::Core;
use super::net::{Net, Stream};
use super::session::Session;
use crate::logging::Throttle;
use crate::partition::Partition;
use crate::partition::{BusyCounts, BusyReason};
use latchkey_client::protocol::ErrorCode;
use std::net::SocketAddr;

/// Characters of a forbidden key that its line shows.
pub const KEY_CHARS_LOGGED: usize = 64;

/// A core's throttles, and the `B` counts of its partition at the last busy line.
#[derive(Debug, Default)]
pub struct CoreLogs {
    errors: [Throttle; 9],
    busy: Throttle,
    busy_seen: BusyCounts,
}

impl CoreLogs {
    /// Whether a line about refused frames of `code` may be written at `now_us`; if so, how
    /// many were left out before it.
    pub fn allow_refused(&mut self, code: ErrorCode, now_us: u64) -> Option<u64> {
        self.errors[code as usize % 9].allow(now_us)
    }
}

/// The line for a keyed request refused `X` code 8 (see the module docs).
pub fn forbidden_line(
    session: u64,
    peer: Option<SocketAddr>,
    identities: &[String],
    key: &[u8],
    left_out: u64,
) -> String {
    let peer = peer.map_or("unknown peer".to_string(), |p| p.to_string());
    let who = match identities {
        [] => "no identity".to_string(),
        [one] => format!("identity {}", quoted(one)),
        all => {
            let names: Vec<String> = all.iter().map(|name| quoted(name)).collect();
            format!("identities {}", names.join(", "))
        }
    };
    let key_text = String::from_utf8_lossy(key);
    let shown: String = key_text.chars().take(KEY_CHARS_LOGGED).collect();
    let rest = key.len() - shown.len().min(key.len());
    let rest = match rest {
        0 => String::new(),
        n => format!(" (and {n} more bytes)"),
    };
    format!(
        "session {session:#x} from {peer}: X code 8 (Forbidden): {who} may not use key {}{rest}{}",
        quoted(&shown),
        more(left_out, "with this code")
    )
}

/// `text` in double quotes, with quotes, backslashes and control characters escaped.
fn quoted(text: &str) -> String {
    format!("\"{}\"", text.escape_debug())
}

/// Logs a keyed request of `session` refused `X` code 8 for `key` (rate-limited with that
/// code's other refusals). A free function, so that `key` may borrow the core's read buffers.
pub(super) fn log_forbidden<S: Stream>(
    logs: &mut CoreLogs,
    now_us: u64,
    session: &Session<S>,
    key: &[u8],
) {
    let Some(left_out) = logs.allow_refused(ErrorCode::Forbidden, now_us) else {
        return;
    };
    let identities = session.socket().identities();
    let line = forbidden_line(session.id(), session.peer(), &identities, key, left_out);
    log::info!("{line}");
}

impl<N: Net, P: Partition> Core<N, P> {
    /// Logs a refused frame of the session in `slot` (rate-limited per code).
    pub(super) fn log_refused_frame(&mut self, slot: usize, code: ErrorCode) {
        let Some(left_out) = self.logs.allow_refused(code, self.now_us) else {
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
    use crate::logging::LOG_PERIOD_US;

    #[test]
    fn a_forbidden_line_names_identity_and_key_quoted_escaped_and_bounded() {
        let peer = Some("10.0.0.7:5555".parse().unwrap());
        let line = forbidden_line(0x2a, peer, &["billing".into()], b"other/x", 0);
        assert_eq!(
            line,
            "session 0x2a from 10.0.0.7:5555: X code 8 (Forbidden): identity \"billing\" may \
             not use key \"other/x\""
        );
        // Control characters, quotes and backslashes cannot end the line or forge another.
        let key = "a\r\u{1b}[2J\"\\ INFO forged";
        let names = ["cn\rx".to_string(), "san".to_string()];
        let line = forbidden_line(1, None, &names, key.as_bytes(), 3);
        assert!(!line.contains(['\r', '\n', '\u{1b}']), "{line:?}");
        let says = "from unknown peer: X code 8 (Forbidden): identities \"cn\\rx\", \"san\" \
                    may not use key \"a\\r\\u{1b}[2J\\\"\\\\ INFO forged\"; 3 more with this \
                    code since";
        assert!(line.contains(says), "{line}");
        // The first 64 characters, and how many bytes were left out.
        let long = format!("{}é{}", "k".repeat(63), "z".repeat(100));
        let line = forbidden_line(1, None, &[], long.as_bytes(), 0);
        let shown = format!(
            "no identity may not use key \"{}é\" (and 100 more bytes)",
            "k".repeat(63)
        );
        assert!(line.ends_with(&shown), "{line}");
    }

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
