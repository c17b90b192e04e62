//! Asking every member at once: one thread per `--server` item, each making its admin `GET`s
//! with its own `--transport-timeout` (and `--retry-refused`), so that a member that does not answer (stopped,
//! partitioned) costs the command one timeout, not one per member, and the others' answers
//! still count.
//!
//! Deliberately not here: the HTTP of one request (`fetch`), merging (`merge.rs`).

use std::net::SocketAddr;

use serde_json::Value;

use super::merge::MemberAnswer;
use super::{fetch, Failure, Patience};
use latchkey_client::tls::Connector;

/// `GET` each of `targets` in turn from every member of `items` (one thread per member, all at
/// once): per member, in `items`' order, one answer per target, parsed as JSON. A member whose
/// first request fails is not asked the next ones (they get the same failure).
pub(crate) fn gather(
    items: &[(String, Vec<SocketAddr>)],
    targets: &[&str],
    patience: Patience,
    tls: Option<&Connector>,
) -> Vec<Vec<MemberAnswer>> {
    std::thread::scope(|scope| {
        let threads: Vec<_> = items
            .iter()
            .map(|(item, addrs)| scope.spawn(move || ask(item, addrs, targets, patience, tls)))
            .collect();
        threads
            .into_iter()
            .zip(items)
            .map(|(thread, (item, _))| {
                thread.join().unwrap_or_else(|_| {
                    let failed = || MemberAnswer {
                        item: item.clone(),
                        result: Err("the request's thread panicked".into()),
                    };
                    targets.iter().map(|_| failed()).collect()
                })
            })
            .collect()
    })
}

fn ask(
    item: &str,
    addrs: &[SocketAddr],
    targets: &[&str],
    patience: Patience,
    tls: Option<&Connector>,
) -> Vec<MemberAnswer> {
    let mut answers: Vec<MemberAnswer> = Vec::with_capacity(targets.len());
    for target in targets {
        let failed_before = answers
            .iter()
            .find_map(|a| a.result.as_ref().err().cloned());
        let result = match failed_before {
            Some(error) => Err(error),
            None => fetch(addrs, target, patience, tls)
                .map_err(|failure: Failure| without_address(&failure.message, addrs))
                .and_then(|body| {
                    serde_json::from_slice(&body)
                        .map_err(|e| format!("the answer to GET {target} is not JSON: {e}"))
                }),
        };
        answers.push(MemberAnswer {
            item: item.to_owned(),
            result: result.map(|value: Value| value),
        });
    }
    answers
}

/// A failure's message without the address it names: every place that shows a member's
/// failure puts the member (its `--server` item) before it, so it would say the address twice
/// (`127.0.0.1:7421: 127.0.0.1:7421: no complete answer`).
fn without_address(message: &str, addrs: &[SocketAddr]) -> String {
    for addr in addrs {
        let named = format!("{addr}: ");
        if let Some(at) = message.find(&named) {
            return format!("{}{}", &message[..at], &message[at + named.len()..]);
        }
    }
    message.to_owned()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_members_failure_names_no_address_of_its_own() {
        let addrs: Vec<SocketAddr> = vec!["127.0.0.1:7421".parse().unwrap()];
        let said = |message: &str| without_address(message, &addrs);
        assert_eq!(
            said("127.0.0.1:7421: no complete answer"),
            "no complete answer"
        );
        assert_eq!(
            said("cannot reach the server: 127.0.0.1:7421: cannot connect: refused"),
            "cannot reach the server: cannot connect: refused"
        );
        assert_eq!(said("10.0.0.1:7421: other"), "10.0.0.1:7421: other");
    }
}
