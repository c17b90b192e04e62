//! `[[auth.rule]]`: the key prefixes each client identity may use (see [`crate::auth`]).
//!
//! ```toml
//! [[auth.rule]]
//! identity = "billing"                 # a client certificate's CN or DNS SAN
//! prefixes = ["billing/", "shared/"]   # "" allows every key; [] allows none
//! ```
//!
//! Each rule needs both keys; nothing else is allowed in a rule. Identities come from client
//! certificates, so rules need `[tls] client_ca_file` (checked with the other relations).

use super::{described, ConfigError};
use latchkey_client::protocol::KEY_BYTES_MAX;
use toml::Value;

/// Rules at most, and prefixes per rule at most: a rule set is read once, but every keyed
/// request of a session is checked against its prefixes.
pub const RULES_MAX: usize = 10_000;
/// Prefixes one rule may list at most.
pub const PREFIXES_PER_RULE_MAX: usize = 256;

/// One `[[auth.rule]]`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct AuthRule {
    /// `identity`: a client certificate's subject CN or DNS SAN, compared exactly. Not empty.
    pub identity: String,
    /// `prefixes`: the key prefixes the identity may use (`""`: every key), each at most
    /// [`KEY_BYTES_MAX`] bytes.
    pub prefixes: Vec<String>,
}

/// Reads the array of `[[auth.rule]]` tables (`value` is `auth.rule`, on line `line`).
pub(super) fn read_rules(value: &Value, line: usize) -> Result<Vec<AuthRule>, ConfigError> {
    let error = |path: &str, problem: String| {
        ConfigError::new(path, Some(line), format!("{path}: {problem}"))
    };
    let Value::Array(tables) = value else {
        let problem = format!("expected [[auth.rule]] tables, got {}", described(value));
        return Err(error("auth.rule", problem));
    };
    if tables.len() > RULES_MAX {
        let problem = format!("at most {RULES_MAX} rules, got {}", tables.len());
        return Err(error("auth.rule", problem));
    }
    let mut rules = Vec::with_capacity(tables.len());
    for (index, table) in tables.iter().enumerate() {
        let at = |key: &str| format!("auth.rule[{index}].{key}");
        let Value::Table(table) = table else {
            let problem = format!("expected a table, got {}", described(table));
            return Err(error(&format!("auth.rule[{index}]"), problem));
        };
        if let Some(key) = table
            .keys()
            .find(|key| !["identity", "prefixes"].contains(&key.as_str()))
        {
            let problem = "unknown key (a rule has `identity` and `prefixes`)".to_string();
            return Err(error(&at(key), problem));
        }
        let identity = match table.get("identity") {
            Some(Value::String(identity)) if !identity.is_empty() => identity.clone(),
            Some(Value::String(_)) => return Err(error(&at("identity"), "is empty".into())),
            Some(other) => {
                let problem = format!("expected a string, got {}", described(other));
                return Err(error(&at("identity"), problem));
            }
            None => return Err(error(&at("identity"), "required".into())),
        };
        let prefixes = match table.get("prefixes") {
            Some(Value::Array(prefixes)) => read_prefixes(prefixes, &at("prefixes"), line)?,
            Some(other) => {
                let problem = format!("expected an array of strings, got {}", described(other));
                return Err(error(&at("prefixes"), problem));
            }
            None => {
                let problem = "required (\"\" allows every key, [] none)".to_string();
                return Err(error(&at("prefixes"), problem));
            }
        };
        rules.push(AuthRule { identity, prefixes });
    }
    Ok(rules)
}

fn read_prefixes(values: &[Value], path: &str, line: usize) -> Result<Vec<String>, ConfigError> {
    let error = |problem: String| ConfigError::new(path, Some(line), format!("{path}: {problem}"));
    if values.len() > PREFIXES_PER_RULE_MAX {
        let problem = format!(
            "at most {PREFIXES_PER_RULE_MAX} prefixes, got {}",
            values.len()
        );
        return Err(error(problem));
    }
    values
        .iter()
        .map(|value| match value {
            Value::String(prefix) if prefix.len() <= KEY_BYTES_MAX => Ok(prefix.clone()),
            Value::String(prefix) => Err(error(format!(
                "a prefix is at most {KEY_BYTES_MAX} bytes, got {}",
                prefix.len()
            ))),
            other => Err(error(format!(
                "expected a string, got {}",
                described(other)
            ))),
        })
        .collect()
}
