//! What the client commands say when a call does not succeed: what the client saw (the
//! address and why its session failed, or what each cluster member did), how long it tried
//! and within which allowance, and, when it gave up at once because nothing listens, how to
//! make it keep trying (`--retry-refused`).
//!
//! Every message is built from what the client remembers ([`Client::last_session_failure`],
//! [`Client::last_unavailable`]); nothing here guesses a cause it was not told. Deliberately
//! not here: exit codes (see [`super`]) and printing.

use std::net::SocketAddr;
use std::time::Duration;

use latchkey_client::protocol::ErrorCode;
use latchkey_client::{AcquireError, Client, RequestError, SessionFailure, SPEAKS_TLS};

use super::{format_duration, ConnectArgs, LockArgs, FORBIDDEN_TEXT};

/// What a command adds when a TLS server answered a plaintext request ([`SPEAKS_TLS`]): how to
/// give the client the server's CA on the command line.
pub(super) const TLS_HINT: &str = "(--tls-ca FILE, or LATCHKEY_TLS_CA)";

/// How a call went: how long it tried, what it was allowed, whether refused connections were
/// tried again.
#[derive(Clone, Debug)]
pub(super) struct Tried {
    /// From the call to its end.
    pub elapsed: Duration,
    /// The flag that bounded it, as the user would write it: `--wait 10s`.
    pub allowance: String,
    /// Whether a refused connection was tried again until the allowance ran out.
    pub retry_refused: bool,
}

impl Tried {
    /// A call of a small request (query, ping, extend, release): bounded by
    /// `--transport-timeout`.
    pub(super) fn request(connect: &ConnectArgs, elapsed: Duration) -> Tried {
        let timeout = format_duration(connect.transport_timeout);
        Tried {
            elapsed,
            allowance: format!("--transport-timeout {timeout}"),
            retry_refused: connect.retry_refused,
        }
    }

    /// The acquire of `latchkey lock`: bounded by `--wait` (by `--transport-timeout` for
    /// `--wait 0`).
    pub(super) fn acquire(args: &LockArgs, elapsed: Duration) -> Tried {
        Tried {
            elapsed,
            allowance: allowance_text(args),
            retry_refused: args.connect.retry_refused,
        }
    }
}

/// How long an acquire of `latchkey lock` may take, as its flags say it.
pub(super) fn allowance_text(args: &LockArgs) -> String {
    if args.wait.is_zero() {
        let timeout = format_duration(args.connect.transport_timeout);
        format!("--transport-timeout {timeout} (--wait 0)")
    } else {
        format!("--wait {}", format_duration(args.wait))
    }
}

/// `elapsed` for a person: whole milliseconds under a second (at least 1), else seconds with a
/// decimal.
pub(super) fn elapsed_text(elapsed: Duration) -> String {
    if elapsed < Duration::from_secs(1) {
        let millis = elapsed.as_micros().div_ceil(1000).max(1);
        return format!("{millis} ms");
    }
    format!("{:.1} s", elapsed.as_secs_f64())
}

/// Whether `failure` is a plaintext session that a TLS server answered.
fn speaks_tls(failure: &SessionFailure) -> bool {
    failure.cause().starts_with(SPEAKS_TLS)
}

/// Why the server could not be reached or talked to: the failure the client remembers (address
/// and cause, and how to give the CA when the server speaks TLS), else the address and
/// `fallback`.
pub(super) fn failure_text(client: &Client, addr: SocketAddr, fallback: &str) -> String {
    match client.last_session_failure() {
        Some(failure) if speaks_tls(&failure) => format!("{failure} {TLS_HINT}"),
        Some(failure) => failure.to_string(),
        None => format!("{addr}: {fallback}"),
    }
}

/// How long the call tried, and within what; when it gave up at once on a refused connection,
/// how to make it keep trying.
fn tried_text(client: &Client, tried: &Tried) -> String {
    let refused = client
        .last_unavailable()
        .is_some_and(|report| report.all_refused());
    tried_suffix(refused, tried)
}

/// `(tried for 2 ms of --wait 10s)`; when the call gave up at once because the connection was
/// `refused` everywhere, how to make it keep trying instead.
pub(super) fn tried_suffix(refused: bool, tried: &Tried) -> String {
    let elapsed = elapsed_text(tried.elapsed);
    let allowance = &tried.allowance;
    if refused && !tried.retry_refused {
        return format!(
            "(tried for {elapsed}: nothing listens there; --retry-refused keeps trying until \
             {allowance} runs out)"
        );
    }
    format!("(tried for {elapsed} of {allowance})")
}

/// What to say about a call that ended unavailable: what the members did (no leader, no
/// quorum, a leader that cannot be reached...), else why the server could not be reached; and
/// how long it tried.
pub(super) fn unavailable_text(client: &Client, addr: SocketAddr, tried: &Tried) -> String {
    let what = match client.last_unavailable() {
        // A member answered: it is not a matter of reaching "the server".
        Some(report) if report.reachable() > 0 || report.listed() > 1 => {
            format!("{report}; nothing was executed")
        }
        Some(report) if !report.members().is_empty() => {
            let tls = client
                .last_session_failure()
                .is_some_and(|f| speaks_tls(&f));
            let hint = if tls {
                format!(" {TLS_HINT}")
            } else {
                String::new()
            };
            format!("cannot reach the server: {report}{hint}")
        }
        _ => {
            let cause = failure_text(client, addr, "no connection was established");
            format!("cannot reach the server: {cause}")
        }
    };
    format!("{what} {}", tried_text(client, tried))
}

/// What to say about a query or ping that got no answer after `tried`.
pub(super) fn request_message(
    client: &Client,
    addr: SocketAddr,
    error: &RequestError,
    tried: &Tried,
) -> String {
    match error {
        RequestError::Unavailable => unavailable_text(client, addr, tried),
        RequestError::NoAnswer => {
            failure_text(client, addr, "no answer within --transport-timeout")
        }
        // Only keyed requests are refused so; the caller names the key.
        RequestError::Rejected(ErrorCode::Forbidden) => format!("{addr}: {FORBIDDEN_TEXT}"),
        other => format!("{addr}: {other}"),
    }
}

/// What to say about an acquire of `latchkey lock` that did not return a ticket after
/// `tried`.
pub(super) fn acquire_message(
    client: &Client,
    addr: SocketAddr,
    args: &LockArgs,
    error: &AcquireError,
    tried: &Tried,
) -> String {
    match error {
        AcquireError::Timeout if args.wait.is_zero() => {
            "the lock is held by someone else (--wait 0 tries once)".to_owned()
        }
        AcquireError::Timeout => format!(
            "the lock is held by someone else: not acquired within --wait {}",
            format_duration(args.wait)
        ),
        AcquireError::Unavailable => unavailable_text(client, addr, tried),
        AcquireError::Indeterminate => match client.last_session_failure() {
            Some(failure) => format!("{error}; the session failed: {failure}"),
            None => error.to_string(),
        },
        AcquireError::Rejected(ErrorCode::Forbidden) => FORBIDDEN_TEXT.to_owned(),
        other => other.to_string(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn elapsed_times_read_in_milliseconds_then_seconds() {
        assert_eq!(elapsed_text(Duration::ZERO), "1 ms");
        assert_eq!(elapsed_text(Duration::from_micros(300)), "1 ms");
        assert_eq!(elapsed_text(Duration::from_micros(1_001)), "2 ms");
        assert_eq!(elapsed_text(Duration::from_millis(999)), "999 ms");
        assert_eq!(elapsed_text(Duration::from_millis(2_040)), "2.0 s");
    }
}
