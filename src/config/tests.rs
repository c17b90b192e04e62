//! Tests of the config file: defaults, the example file, every refusal naming its key.
use super::*;

const EXAMPLE: &str = include_str!("../../config.example.toml");

fn parsed(text: &str) -> Config {
    Config::from_toml_str(text).unwrap_or_else(|error| panic!("{text:?}: {error}"))
}

fn refused(text: &str) -> ConfigError {
    match Config::from_toml_str(text) {
        Ok(config) => panic!("accepted {text:?} as {config:?}"),
        Err(error) => error,
    }
}

/// Asserts that `text` is refused by a one-line error about `key` that says `says`.
fn assert_refused(text: &str, key: &str, says: &str) {
    let error = refused(text);
    let message = error.to_string();
    assert_eq!(error.key(), Some(key), "{message}");
    assert!(message.contains(says), "{message:?} does not say {says:?}");
    assert!(!message.contains('\n'), "{message:?} is not one line");
}

/// Each case is `section.key = value | what the error says`; the value is written under
/// `[section]` and must be refused by an error naming `section.key`.
fn assert_each_refused(cases: &[&str]) {
    for case in cases {
        let (setting, says) = case.split_once(" | ").unwrap();
        let (path, value) = setting.split_once(" = ").unwrap();
        let (section, key) = path.split_once('.').unwrap();
        assert_refused(&format!("[{section}]\n{key} = {value}\n"), path, says);
    }
}

#[test]
fn defaults() {
    let config = Config::default();
    assert_eq!(config.server.listen, "127.0.0.1:7420".parse().unwrap());
    let cpus = std::thread::available_parallelism().map_or(1, NonZeroUsize::get);
    assert_eq!(config.server.cores, cpus.min(CORES_MAX));
    assert_eq!(config.limits.max_connections, 10_000);
    assert_eq!(config.limits.max_keys, 4_000_000);
    assert_eq!(config.limits.max_waiters_per_key, 1024);
    assert_eq!(config.limits.max_pending_per_session, 1024);
    assert_eq!(config.limits.max_key_bytes, 1024);
    assert_eq!(config.timer.tick_ms, 1);
    assert_eq!(config.tokens.state_dir, None);
    assert_eq!(config.log.level, LevelFilter::Info);
    assert_eq!(config.log.format, LogFormat::Text);
    assert_eq!(parsed(""), config);
    assert_eq!(parsed("[server]\n[limits]\n[log]\n"), config);
}

#[test]
fn summary_is_one_line() {
    let mut config = Config::default();
    config.server.cores = 2;
    let expected = "listen=127.0.0.1:7420 cores=2 max_connections=10000 max_keys=4000000 \
                    max_waiters_per_key=1024 max_pending_per_session=1024 \
                    max_key_bytes=1024 tick_ms=1 state_dir=none tls=off auth_rules=0; \
                    single node";
    assert_eq!(config.summary(), expected);
    config.tokens.state_dir = Some(PathBuf::from("/var/lib/latchkey"));
    assert!(config
        .summary()
        .contains(" state_dir=/var/lib/latchkey tls=off "));
}

#[test]
fn summary_says_tls_client_certificates_and_rules() {
    let mut config = Config {
        tls: Some(TlsConfig {
            cert_file: PathBuf::from("server.crt"),
            key_file: PathBuf::from("server.key"),
            client_ca_file: None,
        }),
        ..Config::default()
    };
    let summary = config.summary();
    assert!(summary.ends_with(" tls=on (no client certificates) auth_rules=0; single node"));
    config.tls.as_mut().unwrap().client_ca_file = Some(PathBuf::from("ca.crt"));
    config.auth_rules = vec![
        AuthRule {
            identity: "a".into(),
            prefixes: vec!["a/".into()],
        };
        2
    ];
    let summary = config.summary();
    let says = " tls=on (mTLS: client certificates required) auth_rules=2; single node";
    assert!(summary.ends_with(says), "{summary}");
}

#[test]
fn example_file_is_the_defaults() {
    // `cores = 0` and the default both resolve to this machine's CPU count, so every field,
    // cores included, compares equal.
    assert_eq!(parsed(EXAMPLE), Config::default());
    assert!(EXAMPLE.contains("\ncores = 0\n"));
    // The example sets every key, each under a comment. (Parsing it proved it has no
    // unknown key.)
    let table: toml::Table = EXAMPLE.parse().unwrap();
    for (section, keys) in SECTIONS {
        if section == "tls" || section == "auth" || section == "cluster" {
            // Off by default: documented commented out.
            let keys: &[&str] = match section {
                "auth" => &["identity", "prefixes"],
                // `tls` is the section [cluster.tls], documented with its own keys.
                "cluster" => &keys[..keys.len() - 1],
                _ => keys,
            };
            if section == "cluster" {
                assert_eq!(keys.len() + 1, SECTIONS[7].1.len());
                let at = EXAMPLE
                    .find("\n# [cluster.tls]\n")
                    .expect("[cluster.tls] documented");
                for key in tls::PEER_TLS_KEYS {
                    let line = format!("\n# {key} = ");
                    assert!(EXAMPLE[at..].contains(&line), "cluster.tls.{key} missing");
                }
            }
            for key in keys {
                assert!(
                    EXAMPLE.contains(&format!("\n# {key} = ")),
                    "{section}.{key} missing"
                );
            }
            continue;
        }
        for key in keys {
            assert!(table[section].get(key).is_some(), "{section}.{key} missing");
            let at = EXAMPLE.find(&format!("\n{key} = ")).unwrap();
            let above = EXAMPLE[..at].lines().last().unwrap();
            assert!(above.starts_with("# "), "{section}.{key} undocumented");
        }
    }
}

#[test]
fn full_file() {
    let text = r#"
        [server]
        listen = "[::1]:9000"
        cores = 3
        health_listen = "127.0.0.1:7421"
        [limits]
        max_connections = 1_000_000
        max_keys = 30
        max_waiters_per_key = 7
        max_pending_per_session = 1_000_000
        max_key_bytes = 1
        [timer]
        tick_ms = 1000
        [tokens]
        state_dir = "/var/lib/latchkey"
        reservation = 4096
        [log]
        level = "DeBuG"
        format = "json"
    "#;
    let limits = LimitsConfig {
        max_connections: 1_000_000,
        max_keys: 30,
        max_waiters_per_key: 7,
        max_pending_per_session: 1_000_000,
        max_key_bytes: 1,
    };
    let expected = Config {
        server: ServerConfig {
            listen: "[::1]:9000".parse().unwrap(),
            cores: 3,
            cores_explicit: true,
            health_listen: Some("127.0.0.1:7421".parse().unwrap()),
        },
        limits,
        timer: TimerConfig { tick_ms: 1000 },
        tokens: TokensConfig {
            state_dir: Some(PathBuf::from("/var/lib/latchkey")),
            reservation: 4096,
        },
        log: LogConfig {
            level: LevelFilter::Debug,
            format: LogFormat::Json,
        },
        tls: None,
        auth_rules: Vec::new(),
        cluster: None,
    };
    let config = parsed(text);
    assert_eq!(config, expected);
    assert_eq!(config.max_keys_per_partition(), 10);
}

#[test]
fn other_spellings_of_tables() {
    let config = parsed("server.cores = 2\nlimits = { max_keys = 9 }");
    assert_eq!((config.server.cores, config.limits.max_keys), (2, 9));
}

#[test]
fn each_invalid_value_names_its_key() {
    assert_each_refused(&[
        r#"server.listen = "localhost:7420" | IP address and port"#,
        r#"server.listen = "127.0.0.1" | got "127.0.0.1""#,
        "server.cores = 1025 | server.cores: must be at most 1024, got 1025",
        "server.cores = -1 | server.cores: must be at least 0, got -1",
        "limits.max_connections = 0 | must be at least 1, got 0",
        "limits.max_connections = 1_000_001 | must be at most 1000000, got 1000001",
        "limits.max_keys = 0 | limits.max_keys: must be at least 1, got 0",
        "limits.max_waiters_per_key = 0 | max_waiters_per_key: must be at least 1, got 0",
        "limits.max_waiters_per_key = 1000001 | must be at most 1000000, got 1000001",
        "limits.max_pending_per_session = 0 | must be at least 1, got 0",
        "limits.max_pending_per_session = 1000001 | must be at most 1000000, got 1000001",
        "limits.max_key_bytes = 0 | must be at least 1, got 0",
        "limits.max_key_bytes = 1025 | must be at most 1024, got 1025",
        "timer.tick_ms = 0 | timer.tick_ms: must be at least 1, got 0",
        "timer.tick_ms = 1001 | must be at most 1000, got 1001",
        r#"log.level = "verbose" | one of off, error, warn, info, debug, trace, got "verbose""#,
        r#"log.format = "JSON" | log.format: must be "text" or "json", got "JSON""#,
        r#"log.format = "logfmt" | log.format: must be "text" or "json", got "logfmt""#,
    ]);
}

#[test]
fn wrong_types_name_their_key() {
    assert_each_refused(&[
        "server.listen = 7420 | server.listen: expected a string, got integer 7420",
        r#"server.cores = "4" | server.cores: expected an integer, got string "4""#,
        "limits.max_keys = 1.5 | expected an integer, got float 1.5",
        "timer.tick_ms = true | expected an integer, got boolean true",
        r#"tokens.state_dir = ["a"] | expected a string, got an array"#,
        r#"log.level = { name = "info" } | expected a string, got a table"#,
        "log.format = 1 | log.format: expected a string, got integer 1",
        "server.listen = 1979-05-27 | expected a string, got datetime 1979-05-27",
    ]);
    assert_refused(
        "server = 1",
        "server",
        "`server` must be a section ([server]), got",
    );
}

#[test]
fn unknown_keys_and_sections_are_named() {
    let text = "[server]\nlisten = \"127.0.0.1:1\"\nlisen = \"127.0.0.1:2\"\n";
    let says =
        "line 3: unknown key `server.lisen` (known keys in [server]: listen, cores, health_listen)";
    assert_refused(text, "server.lisen", says);
    assert_refused(
        "[limit]\nmax_keys = 1",
        "limit",
        "unknown section `[limit]`",
    );
    assert_refused(
        "[server.tls]\ncert = 1",
        "server.tls",
        "unknown key `server.tls`",
    );
    assert_refused("listen = \"::1\"", "listen", "unknown key `listen` outside");
}

#[test]
fn errors_carry_the_line() {
    let error = refused("# comment\n[server]\ncores = 1\n\n[limits]\nmax_waiters_per_key = 0");
    assert_eq!(error.line(), Some(6));
    let expected = "line 6: limits.max_waiters_per_key: must be at least 1, got 0";
    assert_eq!(error.to_string(), expected);
    // The first offence in the file is the one reported.
    let error = refused("[timer]\ntick_ms = 0\n[server]\ncores = 5000\n");
    assert_eq!(error.key(), Some("timer.tick_ms"));
    assert_eq!(refused("[log]\n[limit]\n").line(), Some(2));
}

#[test]
fn syntax_errors_are_one_line_with_position() {
    for text in [
        "[server\n",
        "[server]\ncores = \n",
        "[server]\ncores = 1\ncores = 2\n",
    ] {
        let message = refused(text).to_string();
        assert!(message.starts_with("line "), "{message:?}");
        assert!(message.contains(", column "), "{message:?}");
        assert!(message.contains(": invalid TOML: "), "{message:?}");
        assert!(!message.contains('\n'), "{message:?}");
    }
}

#[test]
fn state_dir_empty_is_none() {
    let config = parsed("[tokens]\nstate_dir = \"\"");
    assert_eq!(config.tokens.state_dir, None);
    assert!(config.summary().contains(" state_dir=none "));
    let config = parsed("[tokens]\nstate_dir = \"state\"");
    assert_eq!(config.tokens.state_dir, Some(PathBuf::from("state")));
}

#[test]
fn cores_zero_is_one_per_cpu() {
    assert_eq!(
        parsed("[server]\ncores = 0").server.cores,
        Config::default().server.cores
    );
    assert_eq!(parsed("[server]\ncores = 1024").server.cores, 1024);
}

#[test]
fn max_keys_must_cover_every_core() {
    let text = "[server]\ncores = 4\n[limits]\nmax_keys = 3";
    assert_refused(text, "limits.max_keys", "must be at least server.cores (4)");
    let config = parsed("[server]\ncores = 4\n[limits]\nmax_keys = 4");
    assert_eq!(config.max_keys_per_partition(), 1);
}

#[test]
fn log_level_any_case() {
    assert_eq!(parsed("[log]\nlevel = \"OFF\"").log.level, LevelFilter::Off);
    assert_eq!(
        parsed("[log]\nlevel = \"Warn\"").log.level,
        LevelFilter::Warn
    );
}

#[test]
fn overrides() {
    let file = parsed("[server]\ncores = 2\n[limits]\nmax_keys = 8");
    assert_eq!(file.clone().with_overrides(None, None).unwrap(), file);

    let listen: SocketAddr = "0.0.0.0:9999".parse().unwrap();
    let config = file.clone().with_overrides(Some(listen), Some(8)).unwrap();
    assert_eq!((config.server.listen, config.server.cores), (listen, 8));
    assert_eq!(config.limits, file.limits);

    let config = file.clone().with_overrides(None, Some(0)).unwrap();
    assert_eq!(config.server.cores, Config::default().server.cores);

    let error = file.clone().with_overrides(None, Some(1025)).unwrap_err();
    assert_eq!(error.key(), Some("server.cores"));
    let expected = "server.cores (--cores): must be at most 1024, got 1025";
    assert_eq!(error.to_string(), expected);

    let error = file.with_overrides(None, Some(9)).unwrap_err();
    assert_eq!(error.key(), Some("limits.max_keys"));
}

#[test]
fn load_names_the_path() {
    let dir = std::env::temp_dir().join(format!("latchkey-config-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();

    let missing = dir.join("missing.toml");
    let error = Config::load(&missing).unwrap_err();
    assert_eq!(error.path(), Some(missing.as_path()));
    let expected = format!("{}: cannot read the config file: ", missing.display());
    assert!(error.to_string().starts_with(&expected), "{error}");

    let bad = dir.join("bad.toml");
    std::fs::write(&bad, "[limits]\nmax_keys = 0\n").unwrap();
    let error = Config::load(&bad).unwrap_err();
    let expected = format!(
        "{}:2: limits.max_keys: must be at least 1, got 0",
        bad.display()
    );
    assert_eq!(error.to_string(), expected);

    let good = dir.join("good.toml");
    std::fs::write(&good, EXAMPLE).unwrap();
    assert_eq!(Config::load(&good).unwrap(), Config::default());
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn tls_section() {
    let config = parsed("[tls]\ncert_file = \"a.crt\"\nkey_file = \"a.key\"\n");
    let tls = config.tls.expect("tls set");
    assert_eq!(tls.cert_file, PathBuf::from("a.crt"));
    assert_eq!(tls.key_file, PathBuf::from("a.key"));
    assert_eq!(tls.client_ca_file, None);
    let config = parsed("[tls]\ncert_file = \"a\"\nkey_file = \"b\"\nclient_ca_file = \"c\"\n");
    assert_eq!(config.tls.unwrap().client_ca_file, Some(PathBuf::from("c")));
    for (text, key) in [
        ("[tls]\n", "tls.cert_file"),
        ("[tls]\ncert_file = \"a\"\n", "tls.key_file"),
        (
            "[tls]\ncert_file = \"\"\nkey_file = \"b\"\n",
            "tls.cert_file",
        ),
    ] {
        let error = Config::from_toml_str(text).unwrap_err();
        assert_eq!(error.key(), Some(key), "{text:?}: {error}");
        assert!(error.to_string().contains(key), "{error}");
    }
}

const TLS_WITH_CLIENT_CA: &str =
    "[tls]\ncert_file = \"a\"\nkey_file = \"b\"\nclient_ca_file = \"c\"\n";

#[test]
fn auth_rules() {
    let text = format!(
        "{TLS_WITH_CLIENT_CA}\
         [[auth.rule]]\nidentity = \"billing\"\nprefixes = [\"billing/\", \"shared/\"]\n\
         [[auth.rule]]\nidentity = \"ops\"\nprefixes = [\"\"]\n\
         [[auth.rule]]\nidentity = \"monitor\"\nprefixes = []\n"
    );
    let config = parsed(&text);
    let rule = |identity: &str, prefixes: &[&str]| AuthRule {
        identity: identity.to_string(),
        prefixes: prefixes.iter().map(|p| p.to_string()).collect(),
    };
    assert_eq!(
        config.auth_rules,
        vec![
            rule("billing", &["billing/", "shared/"]),
            rule("ops", &[""]),
            rule("monitor", &[]),
        ]
    );
    assert_eq!(parsed(TLS_WITH_CLIENT_CA).auth_rules, Vec::new());
}

#[test]
fn each_invalid_auth_rule_names_its_key() {
    let long = "k".repeat(1025);
    for (rule, key, says) in [
        ("prefixes = [\"a/\"]", "auth.rule[0].identity", "required"),
        (
            "identity = \"\"\nprefixes = []",
            "auth.rule[0].identity",
            "is empty",
        ),
        (
            "identity = 7\nprefixes = []",
            "auth.rule[0].identity",
            "expected a string",
        ),
        ("identity = \"a\"", "auth.rule[0].prefixes", "required"),
        (
            "identity = \"a\"\nprefixes = \"a/\"",
            "auth.rule[0].prefixes",
            "array",
        ),
        (
            "identity = \"a\"\nprefixes = [1]",
            "auth.rule[0].prefixes",
            "expected a string",
        ),
        (
            &format!("identity = \"a\"\nprefixes = [\"{long}\"]"),
            "auth.rule[0].prefixes",
            "at most 1024 bytes",
        ),
        (
            "identity = \"a\"\nprefixes = []\nprefix = []",
            "auth.rule[0].prefix",
            "unknown key",
        ),
    ] {
        let text = format!("{TLS_WITH_CLIENT_CA}[[auth.rule]]\n{rule}\n");
        assert_refused(&text, key, says);
    }
    assert_refused(
        &format!("{TLS_WITH_CLIENT_CA}[auth]\nrule = 1\n"),
        "auth.rule",
        "expected [[auth.rule]] tables, got integer 1",
    );
    assert_refused(
        &format!("{TLS_WITH_CLIENT_CA}[auth]\nrules = []\n"),
        "auth.rules",
        "unknown key `auth.rules`",
    );
}

#[test]
fn auth_rules_need_client_certificates() {
    let rule = "[[auth.rule]]\nidentity = \"a\"\nprefixes = [\"\"]\n";
    let says = "auth.rule: rules need [tls] client_ca_file";
    assert_refused(rule, "auth.rule", says);
    let without_ca = "[tls]\ncert_file = \"a\"\nkey_file = \"b\"\n";
    assert_refused(&format!("{without_ca}{rule}"), "auth.rule", says);
}

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

#[test]
fn cluster_section() {
    assert_eq!(Config::default().cluster, None);
    let config = parsed(CLUSTER);
    let cluster = config.cluster.as_ref().expect("[cluster]");
    assert_eq!(cluster.node_id, 2);
    assert_eq!(cluster.data_dir, PathBuf::from("/tmp/latchkey-2"));
    assert_eq!(cluster.voters(), vec![1, 2, 3]);
    assert_eq!(cluster.shards, SHARDS_DEFAULT);
    assert!(cluster.fsync);
    assert_eq!(cluster.members[2].peer, "127.0.0.1:7522".parse().unwrap());
    // A member listens on its own client address, with or without a matching [server] listen.
    assert_eq!(config.server.listen, "127.0.0.1:7421".parse().unwrap());
    let same = format!("[server]\nlisten = \"127.0.0.1:7421\"\n{CLUSTER}");
    assert_eq!(parsed(&same), config);
    let tuned = parsed(&format!("{CLUSTER}shards = 8\nfsync = false\n"));
    let tuned = tuned.cluster.expect("[cluster]");
    assert_eq!((tuned.shards, tuned.fsync), (8, false));
    assert_eq!(cluster.restore_from, None);
    let restoring = parsed(&format!("{CLUSTER}restore_from = \"backup.lkb\"\n"));
    let restoring = restoring.cluster.expect("[cluster]").restore_from;
    assert_eq!(restoring, Some(PathBuf::from("backup.lkb")));
    assert_refused(
        &format!("{CLUSTER}restore_from = \"\"\n"),
        "cluster.restore_from",
        "expected a file path",
    );
    // The command line's --listen must agree too.
    let overridden = config.clone().with_overrides(None, Some(1)).expect("cores");
    assert_eq!(overridden.server.listen, config.server.listen);
    let error = config
        .with_overrides(Some("127.0.0.1:9999".parse().unwrap()), None)
        .expect_err("--listen elsewhere");
    assert_eq!(error.key(), Some("server.listen"));
}

#[test]
fn each_invalid_cluster_setting_names_its_key() {
    let members =
        |list: &str| format!("[cluster]\nnode_id = 1\ndata_dir = \"d\"\nmembers = [{list}]\n");
    let one = r#"{ id = 1, client = "127.0.0.1:1", peer = "127.0.0.1:2" }"#;
    let cases: &[(String, &str, &str)] = &[
        ("[cluster]\n".into(), "cluster.node_id", "required"),
        (
            "[cluster]\nnode_id = 1\n".into(),
            "cluster.data_dir",
            "required",
        ),
        (
            "[cluster]\nnode_id = 1\ndata_dir = \"d\"\n".into(),
            "cluster.members",
            "required",
        ),
        (
            "[cluster]\nnode_id = 0\n".into(),
            "cluster.node_id",
            "at least 1",
        ),
        (
            "[cluster]\ndata_dir = \"\"\n".into(),
            "cluster.data_dir",
            "file path",
        ),
        (
            "[cluster]\nshards = 0\n".into(),
            "cluster.shards",
            "at least 1",
        ),
        (
            "[cluster]\nshards = 5000\n".into(),
            "cluster.shards",
            "at most 4096",
        ),
        (
            "[cluster]\nfsync = 1\n".into(),
            "cluster.fsync",
            "true or false",
        ),
        (
            "[cluster]\nmembers = 3\n".into(),
            "cluster.members",
            "expected an array",
        ),
        (
            "[cluster]\nvoters = 3\n".into(),
            "cluster.voters",
            "unknown key",
        ),
        (members("3"), "cluster.members[0]", "expected a table"),
        (
            members(r#"{ id = 1, client = "127.0.0.1:1" }"#),
            "cluster.members[0].peer",
            "required",
        ),
        (
            members(r#"{ id = 0, client = "127.0.0.1:1", peer = "127.0.0.1:2" }"#),
            "cluster.members[0].id",
            "at least 1",
        ),
        (
            members(r#"{ id = 1, client = "localhost:1", peer = "127.0.0.1:2" }"#),
            "cluster.members[0].client",
            "not resolved",
        ),
        (
            members(r#"{ id = 1, client = "127.0.0.1:1", peer = "127.0.0.1:2", port = 3 }"#),
            "cluster.members[0].port",
            "unknown key",
        ),
        (
            members(&format!("{one}, {one}")),
            "cluster.members",
            "id 1 appears twice",
        ),
        (
            members(r#"{ id = 1, client = "127.0.0.1:1", peer = "127.0.0.1:1" }"#),
            "cluster.members",
            "127.0.0.1:1 appears twice",
        ),
        (
            members(r#"{ id = 2, client = "127.0.0.1:1", peer = "127.0.0.1:2" }"#),
            "cluster.node_id",
            "not the id of any",
        ),
        (
            format!("[server]\nlisten = \"127.0.0.1:3\"\n{}", members(one)),
            "server.listen",
            "remove server.listen",
        ),
        (
            members(&[one; 10].join(", ")),
            "cluster.members",
            "at most 9 members",
        ),
    ];
    for (text, key, says) in cases {
        assert_refused(text, key, says);
    }
}

#[test]
fn a_cluster_identity_ignores_order_and_peer_addresses_but_not_client_addresses() {
    let cluster = parsed(CLUSTER).cluster.expect("[cluster]");
    let identity = cluster.identity();
    assert_eq!(
        identity.text,
        "shards=64 members=1@127.0.0.1:7420,2@127.0.0.1:7421,3@127.0.0.1:7422"
    );
    // Pinned: members compare it across builds and versions.
    assert_eq!(
        identity.digest, 0xe7b1_b8d6_e58d_c80a,
        "{:#x}",
        identity.digest
    );
    let mut reordered = cluster.clone();
    reordered.members.reverse();
    reordered.members[0].peer = "10.0.0.9:7000".parse().unwrap();
    assert_eq!(reordered.identity(), identity);
    let mut moved = cluster.clone();
    moved.members[1].client = "127.0.0.1:9421".parse().unwrap();
    assert_ne!(moved.identity().digest, identity.digest);
    let mut resharded = cluster.clone();
    resharded.shards = 8;
    assert_ne!(resharded.identity().digest, identity.digest);
    let mut grown = cluster;
    grown.members.push(MemberConfig {
        id: 4,
        client: "127.0.0.1:7423".parse().unwrap(),
        peer: "127.0.0.1:7523".parse().unwrap(),
    });
    assert_ne!(grown.identity().digest, identity.digest);
}

#[test]
fn health_listen_is_an_address_or_empty() {
    let config = Config::from_toml_str("[server]\nhealth_listen = \"\"\n").unwrap();
    assert_eq!(config.server.health_listen, None);
    let error =
        Config::from_toml_str("[server]\nhealth_listen = \"localhost:7421\"\n").unwrap_err();
    assert!(
        error.to_string().contains("server.health_listen"),
        "{error}"
    );
}
