//! What cluster mode asks of the other sections: an explicit core count, a `max_keys` its
//! shards can hold, and no setting only a single node uses; and the role in the startup line.

use crate::config::{Config, ConfigError};

const CLUSTER: &str = r#"
[cluster]
node_id = 2
data_dir = "/tmp/latchkey-2"
members = [
  { id = 1, client = "127.0.0.1:7420", peer = "127.0.0.1:7520" },
  { id = 2, client = "127.0.0.1:7421", peer = "127.0.0.1:7521" },
  { id = 3, client = "127.0.0.1:7422", peer = "127.0.0.1:7522" },
]
"#;

/// `[server] cores = 2`, `sections` (TOML text before `[cluster]`), then the cluster; what the
/// binary makes of it (the file, then the command line's overrides: none).
fn member(sections: &str, cluster_extra: &str) -> Result<Config, ConfigError> {
    let text = format!("[server]\ncores = 2\n{sections}{CLUSTER}{cluster_extra}");
    Config::from_toml_str(&text)?.with_overrides(None, None)
}

fn assert_refused(result: Result<Config, ConfigError>, key: &str, says: &str) {
    let error = result.expect_err("refused");
    let message = error.to_string();
    assert_eq!(error.key(), Some(key), "{message}");
    assert!(message.contains(says), "{message:?} does not say {says:?}");
    assert!(!message.contains('\n'), "{message:?} is not one line");
}

#[test]
fn a_cluster_member_needs_an_explicit_core_count_from_the_file_or_the_command_line() {
    let says = "a cluster member needs an explicit core count";
    // The file alone may leave it to the command line; the command line must then give it.
    let file = Config::from_toml_str(CLUSTER).expect("the file parses");
    assert!(!file.server.cores_explicit);
    assert_refused(
        file.clone().with_overrides(None, None),
        "server.cores",
        says,
    );
    assert_refused(
        file.clone().with_overrides(None, Some(0)),
        "server.cores",
        says,
    );
    assert_eq!(
        file.check_cluster_mode().unwrap_err().key(),
        Some("server.cores")
    );
    let given = file.with_overrides(None, Some(3)).expect("--cores 3");
    assert_eq!((given.server.cores, given.server.cores_explicit), (3, true));
    // `cores = 0` in the file is one per CPU: refused, and `--cores 0` undoes a file's count.
    let zero = format!("[server]\ncores = 0\n{CLUSTER}");
    let zero = Config::from_toml_str(&zero).unwrap();
    assert_refused(
        zero.with_overrides(None, None),
        "server.cores",
        "0 or left out",
    );
    let two = member("", "").expect("cores = 2");
    assert_eq!(two.server.cores, 2);
    assert_refused(two.with_overrides(None, Some(0)), "server.cores", says);
    // More cores than this machine has CPUs still starts (a member moved to a smaller one).
    let many = format!("[server]\ncores = 1024\n{CLUSTER}");
    let many = Config::from_toml_str(&many)
        .unwrap()
        .with_overrides(None, None);
    assert_eq!(many.expect("1024 cores").server.cores, 1024);
    // A single node keeps one per CPU by default.
    assert!(Config::default().with_overrides(None, None).is_ok());
}

#[test]
fn max_keys_is_split_over_the_shards_within_what_they_can_hold() {
    // Left out: the default, or what the shards can hold when that is less.
    assert_eq!(member("", "").unwrap().limits.max_keys, 4_000_000);
    let one = member("", "shards = 1\n").unwrap();
    assert_eq!(one.limits.max_keys, 1_000_000);
    // Set: refused beyond what the shards hold, or below one key per shard.
    let limits = |max_keys: &str| format!("[limits]\nmax_keys = {max_keys}\n");
    assert_refused(
        member(&limits("1_000_001"), "shards = 1\n"),
        "limits.max_keys",
        "a cluster of 1 shards holds at most 1000000 keys (1000000 per shard",
    );
    assert_refused(
        member(&limits("3"), "shards = 4\n"),
        "limits.max_keys",
        "must be at least cluster.shards (4)",
    );
    // A single node's rule (at least one per core) is not a member's: shards decide.
    let config = member(&limits("4"), "shards = 4\n").expect("one key per shard");
    assert_eq!(config.limits.max_keys, 4);
    let text = format!("[server]\ncores = 8\n{}{CLUSTER}shards = 4\n", limits("4"));
    assert!(Config::from_toml_str(&text).is_ok());
}

#[test]
fn settings_only_a_single_node_uses_are_refused_in_cluster_mode() {
    assert_refused(
        member("[tokens]\nstate_dir = \"/var/lib/latchkey\"\n", ""),
        "tokens.state_dir",
        "tokens come from the replicated log",
    );
    assert_refused(
        member("[tokens]\nreservation = 4096\n", ""),
        "tokens.reservation",
        "which cluster mode does not use",
    );
    assert_refused(
        member("[timer]\ntick_ms = 10\n", ""),
        "timer.tick_ms",
        "timers of its own",
    );
    // Their defaults, as config.example.toml writes them, are what a member does anyway.
    let defaults = "[timer]\ntick_ms = 1\n[tokens]\nstate_dir = \"\"\nreservation = 16_777_216\n";
    assert!(member(defaults, "").is_ok());
    let example = include_str!("../../../config.example.toml");
    // (Member 1: the example listens on member 1's client address.)
    let first = CLUSTER.replace("node_id = 2", "node_id = 1");
    let file = Config::from_toml_str(&format!("{example}{first}")).expect("example + cluster");
    assert!(file.with_overrides(None, Some(2)).is_ok());
    // A configuration built in code is checked the same way (the server does when it starts).
    let mut built = member("", "").unwrap();
    built.timer.tick_ms = 5;
    assert_eq!(
        built.check_cluster_mode().unwrap_err().key(),
        Some("timer.tick_ms")
    );
}

#[test]
fn the_summary_says_which_member_of_which_cluster() {
    let config = member("", "fsync = false\n").unwrap();
    let summary = config.summary();
    let role = "; cluster member 2 of 3, 64 shards, peers on 127.0.0.1:7521, fsync off";
    assert!(summary.ends_with(role), "{summary}");
    assert!(
        summary.starts_with("listen=127.0.0.1:7421 cores=2 "),
        "{summary}"
    );
}

#[test]
fn peer_tls_names_its_three_files_and_refuses_anything_else_naming_the_key() {
    let tls = "[cluster.tls]\ncert_file = \"m.crt\"\nkey_file = \"m.key\"\nca_file = \"ca.crt\"\n";
    let config = member("", tls).expect("[cluster.tls]");
    let files = config
        .cluster
        .as_ref()
        .and_then(|c| c.tls.clone())
        .expect("tls");
    assert_eq!(files.cert_file.to_str(), Some("m.crt"));
    assert_eq!(files.key_file.to_str(), Some("m.key"));
    assert_eq!(files.ca_file.to_str(), Some("ca.crt"));
    assert!(
        config.summary().ends_with(", fsync on, peer TLS on"),
        "{}",
        config.summary()
    );
    assert_eq!(member("", "").unwrap().cluster.unwrap().tls, None);
    let without_ca = tls.replace("ca_file = \"ca.crt\"\n", "");
    assert_refused(
        member("", &without_ca),
        "cluster.tls.ca_file",
        "required with [cluster.tls]",
    );
    let empty = tls.replace("\"m.key\"", "\"\"");
    assert_refused(
        member("", &empty),
        "cluster.tls.key_file",
        "expected a file path",
    );
    let number = tls.replace("\"m.crt\"", "7");
    assert_refused(
        member("", &number),
        "cluster.tls.cert_file",
        "expected a string",
    );
    let unknown = format!("{tls}client_ca_file = \"ca.crt\"\n");
    assert_refused(
        member("", &unknown),
        "cluster.tls.client_ca_file",
        "unknown key",
    );
    assert_refused(member("", "tls = 1\n"), "cluster.tls", "expected a section");
}
