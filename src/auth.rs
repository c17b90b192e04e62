//! Authorization by key prefix: which keys a client's identity may use.
//!
//! With `[tls] client_ca_file` set, a session's identities are the subject common name(s) and
//! the DNS subject alternative names of the certificate its client presented
//! ([`crate::server::tls::certificate_identities`]). `[[auth.rule]]` entries give an identity the key
//! prefixes it may use ([`crate::config::AuthRule`]). When at least one rule exists:
//!
//! * a session may use a key that starts with a prefix of any rule naming any of its
//!   identities (`""` allows every key); every other keyed request (A, R, E, C, Q) is answered
//!   `X` code 8 and has no effect, and the session continues;
//! * an identity no rule names may use no key;
//! * Ping is always allowed;
//! * the admin HTTP requests other than `/health` need an identity some rule names (a rule
//!   with `prefixes = []` makes a monitoring identity that may read `/metrics` and `/stats` but
//!   use no key), and `/keys` lists only keys that identity may use.
//!
//! Rules are checked where the request is parsed, before it is routed to another core: a
//! refused request never leaves the session's core. A session's [`Grant`] is worked out once,
//! from its certificate, the first time it needs one.
//!
//! Not here: reading the rules from the file ([`crate::config`]), reading the certificate
//! ([`crate::server::tls`]).

use crate::config::AuthRule;
use std::collections::HashMap;
use std::sync::Arc;

/// The rules in force, by identity.
#[derive(Debug, Default)]
pub struct AuthRules {
    by_identity: HashMap<String, Vec<Box<[u8]>>>,
}

/// What one session may use: the union of the prefixes of the rules naming its identities.
#[derive(Debug, PartialEq, Eq)]
pub struct Grant {
    /// Some rule names one of the session's identities (admin requests need one).
    known: bool,
    /// One of the prefixes is `""`: every key.
    all: bool,
    /// The prefixes, shortest first, without duplicates.
    prefixes: Box<[Box<[u8]>]>,
}

impl AuthRules {
    /// The rules of a configuration; `None` when it has none (every session may use every key).
    /// Rules naming the same identity add up.
    pub fn new(rules: &[AuthRule]) -> Option<Arc<AuthRules>> {
        if rules.is_empty() {
            return None;
        }
        let mut by_identity: HashMap<String, Vec<Box<[u8]>>> = HashMap::new();
        for rule in rules {
            let prefixes = by_identity.entry(rule.identity.clone()).or_default();
            prefixes.extend(rule.prefixes.iter().map(|p| p.as_bytes().into()));
        }
        Some(Arc::new(AuthRules { by_identity }))
    }

    /// What a session with these identities may use.
    pub fn grant<S: AsRef<str>>(&self, identities: &[S]) -> Grant {
        let mut known = false;
        let mut prefixes: Vec<Box<[u8]>> = Vec::new();
        for identity in identities {
            if let Some(granted) = self.by_identity.get(identity.as_ref()) {
                known = true;
                prefixes.extend(granted.iter().cloned());
            }
        }
        prefixes.sort_by(|a, b| a.len().cmp(&b.len()).then_with(|| a.cmp(b)));
        prefixes.dedup();
        Grant {
            known,
            all: prefixes.first().is_some_and(|p| p.is_empty()),
            prefixes: prefixes.into_boxed_slice(),
        }
    }
}

impl Grant {
    /// Whether the session may use `key`.
    pub fn permits(&self, key: &[u8]) -> bool {
        self.all || self.prefixes.iter().any(|prefix| key.starts_with(prefix))
    }

    /// Whether some rule names the session's identity (admin requests need one).
    pub fn is_known(&self) -> bool {
        self.known
    }

    /// Whether the session may use at least one key.
    #[cfg(test)]
    pub fn permits_any(&self) -> bool {
        !self.prefixes.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rule(identity: &str, prefixes: &[&str]) -> AuthRule {
        AuthRule {
            identity: identity.to_string(),
            prefixes: prefixes.iter().map(|p| p.to_string()).collect(),
        }
    }

    fn rules() -> Arc<AuthRules> {
        AuthRules::new(&[
            rule("billing", &["billing/", "shared/"]),
            rule("ops", &[""]),
            rule("monitor", &[]),
            rule("billing", &["invoices/"]),
        ])
        .expect("rules")
    }

    #[test]
    fn no_rules_means_no_authorization() {
        assert!(AuthRules::new(&[]).is_none());
    }

    #[test]
    fn a_key_is_permitted_when_it_starts_with_one_of_the_identitys_prefixes() {
        let grant = rules().grant(&["billing"]);
        assert!(grant.is_known());
        for key in ["billing/a", "billing/", "shared/x", "invoices/7"] {
            assert!(grant.permits(key.as_bytes()), "{key}");
        }
        for key in ["billing", "billin", "", "ops/x", "Billing/a", "xbilling/a"] {
            assert!(!grant.permits(key.as_bytes()), "{key}");
        }
    }

    #[test]
    fn the_empty_prefix_permits_every_key() {
        let grant = rules().grant(&["ops"]);
        for key in ["", "a", "billing/x", "\u{0}\u{ff}"] {
            assert!(grant.permits(key.as_bytes()), "{key:?}");
        }
    }

    #[test]
    fn an_identity_without_a_rule_may_use_no_key_and_is_not_known() {
        let grant = rules().grant(&["mallory", "billing.example"]);
        assert!(!grant.is_known());
        assert!(!grant.permits_any());
        assert!(!grant.permits(b"billing/a"));
        assert!(!grant.permits(b""));
        let none: [&str; 0] = [];
        assert!(!rules().grant(&none).is_known());
    }

    #[test]
    fn a_rule_without_prefixes_is_known_but_permits_nothing() {
        let grant = rules().grant(&["monitor"]);
        assert!(grant.is_known());
        assert!(!grant.permits_any());
        assert!(!grant.permits(b"billing/a"));
    }

    #[test]
    fn every_identity_of_a_certificate_adds_its_prefixes() {
        // A certificate whose CN is `monitor` and whose DNS SAN is `billing`.
        let grant = rules().grant(&["monitor", "billing"]);
        assert!(grant.permits(b"billing/1"));
        assert!(grant.permits(b"invoices/1"));
        assert!(!grant.permits(b"ops/1"));
    }
}
