//! Command-line parsing and validation of `latchkey bench`.

use clap::Parser;

use super::*;

#[derive(Parser, Debug)]
struct Cli {
    #[command(flatten)]
    bench: BenchArgs,
}

fn parse(line: &str) -> Result<BenchArgs, clap::Error> {
    let words = std::iter::once("bench").chain(line.split_whitespace());
    Cli::try_parse_from(words).map(|cli| cli.bench)
}

#[test]
fn durations_parse_as_in_every_other_command() {
    let args = parse("--target latchkey://127.0.0.1:1 --workload contended --duration 5")
        .expect("a bare number is seconds");
    assert_eq!(args.duration, Duration::from_secs(5));
    let args = parse("--target latchkey://127.0.0.1:1 --workload contended --hold 250us")
        .expect("microseconds");
    assert_eq!(args.hold, Duration::from_micros(250));
    assert!(parse("--target latchkey://127.0.0.1:1 --workload contended --warmup 1.5s").is_err());
}

#[test]
fn targets_name_a_dialect_and_an_address() {
    let target = parse_target("latchkey://127.0.0.1:7420").unwrap();
    assert_eq!(
        (target.dialect, target.address.as_str()),
        (Dialect::Latchkey, "127.0.0.1:7420")
    );
    let target = parse_target("redis://localhost:6379/").unwrap();
    assert_eq!(
        (target.dialect, target.address.as_str()),
        (Dialect::Redis, "localhost:6379")
    );
    assert_eq!(target.to_string(), "redis://localhost:6379");
    let bare = parse_target("127.0.0.1:1").unwrap();
    assert_eq!(
        bare.to_string(),
        "latchkey://127.0.0.1:1",
        "as LATCHKEY_SERVER says it"
    );
    for bad in [
        "127.0.0.1",
        "http://a:1",
        "redis://",
        "redis://host",
        "redis://:1",
        "redis://a:x",
    ] {
        assert!(parse_target(bad).is_err(), "{bad:?} should not parse");
    }
}

#[test]
fn defaults_are_the_documented_ones() {
    let args = parse("--target latchkey://127.0.0.1:7420 --workload uncontended").unwrap();
    assert_eq!((args.connections, args.pipeline), (50, 16));
    assert_eq!(
        (args.duration, args.warmup),
        (Duration::from_secs(5), Duration::from_secs(1))
    );
    assert_eq!((args.keys, args.hot_keys), (100_000, 8));
    assert_eq!(
        (args.hold, args.wait, args.lease),
        (
            Duration::ZERO,
            Duration::from_secs(5),
            Duration::from_secs(30)
        )
    );
    assert_eq!(
        (args.threads, args.json, args.server_pid),
        (None, false, None)
    );
    let config = args.to_config().unwrap();
    assert!(config.progress);
    assert!((1..=50).contains(&config.threads));
}

#[test]
fn every_flag_parses() {
    let args = parse(
        "--target redis://127.0.0.1:6390 --workload hold --connections 4 --pipeline 2 \
         --duration 1500ms --warmup 0 --keys 1000 --hot-keys 3 --hold 2ms --wait 1s \
         --lease 1500ms --threads 2 --json --server-pid 42",
    )
    .unwrap();
    assert_eq!(args.workload, Workload::Hold);
    assert_eq!(
        (args.connections, args.pipeline, args.keys, args.hot_keys),
        (4, 2, 1000, 3)
    );
    assert_eq!(args.duration, Duration::from_millis(1500));
    assert_eq!(
        (args.threads, args.json, args.server_pid),
        (Some(2), true, Some(42))
    );
    let config = args.to_config().unwrap();
    assert_eq!(
        config.lease,
        Duration::from_millis(1500),
        "Redis keeps millisecond leases"
    );
    assert!(!config.progress, "quiet with --json");
    let contended = parse("--target latchkey://h:1 --workload contended").unwrap();
    assert_eq!(contended.workload, Workload::Contended);
    assert!(parse("--target latchkey://h:1 --workload sideways").is_err());
    assert!(parse("--workload hold").is_err(), "--target is required");
}

#[test]
fn latchkey_leases_round_up_to_whole_seconds() {
    let args = parse("--target latchkey://h:1 --workload hold --lease 1500ms").unwrap();
    assert_eq!(args.to_config().unwrap().lease, Duration::from_secs(2));
    let too_long = parse("--target latchkey://h:1 --workload hold --lease 256s").unwrap();
    assert!(too_long.to_config().is_err());
    let zero = parse("--target latchkey://h:1 --workload hold --lease 0").unwrap();
    assert!(zero.to_config().is_err());
    let wait = parse("--target latchkey://h:1 --workload contended --wait 300s").unwrap();
    assert!(wait.to_config().is_err());
}

#[test]
fn validation_names_the_bad_flag() {
    let cases = [
        ("--connections 0", "--connections"),
        ("--pipeline 0", "--pipeline"),
        ("--pipeline 4097", "--pipeline"),
        ("--keys 0", "--keys"),
        ("--hot-keys 0", "--hot-keys"),
        ("--threads 0", "--threads"),
        ("--duration 0", "--duration"),
        ("--connections 10 --pipeline 10 --keys 99", "--keys"),
    ];
    for (flags, named) in cases {
        let line = format!("--target latchkey://h:1 --workload uncontended {flags}");
        let error = parse(&line).unwrap().to_config().unwrap_err();
        assert!(error.contains(named), "{flags}: {error}");
    }
    let args = parse("--target latchkey://h:1 --workload contended --connections 3 --threads 8");
    assert_eq!(
        args.unwrap().to_config().unwrap().threads,
        3,
        "no more threads than connections"
    );
}

#[test]
fn a_target_may_list_a_clusters_members() {
    // As LATCHKEY_SERVER and --server take them.
    let target = parse_target("127.0.0.1:1, 127.0.0.1:2,127.0.0.1:3").unwrap();
    assert_eq!(target.dialect, Dialect::Latchkey);
    assert_eq!(
        target.addresses().collect::<Vec<_>>(),
        ["127.0.0.1:1", "127.0.0.1:2", "127.0.0.1:3"]
    );
    assert_eq!(
        target.to_string(),
        "latchkey://127.0.0.1:1,127.0.0.1:2,127.0.0.1:3"
    );
    let target = parse_target("latchkeys://a:1,b:2/").unwrap();
    assert!(target.tls);
    assert_eq!(target.addresses().count(), 2);
    let args = parse("--target a:1,b:2,c:3 --workload uncontended").unwrap();
    assert_eq!(args.target.addresses().count(), 3);
    assert_eq!(parse_target("a:1").unwrap().addresses().count(), 1);
    let seventeen: Vec<String> = (1..=17).map(|port| format!("h:{port}")).collect();
    for bad in [
        "a:1,".to_string(),
        "a:1,,b:2".to_string(),
        "a:1,b".to_string(),
        "redis://a:1,b:2".to_string(),
        seventeen.join(","),
    ] {
        assert!(parse_target(&bad).is_err(), "{bad:?} should not parse");
    }
}

#[test]
fn latchkeys_is_latchkey_over_tls() {
    let target = parse_target("latchkeys://127.0.0.1:7420/").unwrap();
    assert_eq!(
        (target.dialect, target.tls, target.address.as_str()),
        (Dialect::Latchkey, true, "127.0.0.1:7420")
    );
    assert_eq!(target.to_string(), "latchkeys://127.0.0.1:7420");
    let plain = parse_target("latchkey://127.0.0.1:7420").unwrap();
    assert!(!plain.tls);
    assert!(!parse_target("redis://h:1").unwrap().tls);
    assert!(
        !parse_target("h:1").unwrap().tls,
        "a bare address is plain TCP"
    );
    for bad in ["latchkeys://", "latchkeys://h", "rediss://h:1"] {
        assert!(parse_target(bad).is_err(), "{bad:?} should not parse");
    }
    let error = parse_target("https://h:1").unwrap_err();
    assert!(error.contains("latchkeys://HOST:PORT"), "{error}");
}

/// A self-signed CA certificate in a file of its own (removed on drop).
struct CaFile(std::path::PathBuf);

impl CaFile {
    fn new(name: &str) -> CaFile {
        let key = rcgen::KeyPair::generate().unwrap();
        let mut params = rcgen::CertificateParams::new(Vec::<String>::new()).unwrap();
        params.is_ca = rcgen::IsCa::Ca(rcgen::BasicConstraints::Unconstrained);
        let cert = params.self_signed(&key).unwrap();
        let file = format!("latchkey-bench-{}-{name}.crt", std::process::id());
        let path = std::env::temp_dir().join(file);
        std::fs::write(&path, cert.pem()).unwrap();
        CaFile(path)
    }
}

impl Drop for CaFile {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.0);
    }
}

#[test]
fn latchkeys_reads_the_tls_flags() {
    let ca = CaFile::new("flags");
    let line = format!(
        "--target latchkeys://127.0.0.1:1 --workload uncontended --tls-ca {}",
        ca.0.display()
    );
    let config = parse(&line).unwrap().to_config().unwrap();
    assert!(config.tls.is_some());
    assert_eq!(config.target.to_string(), "latchkeys://127.0.0.1:1");
    let named = format!("{line} --tls-server-name latchkey.example");
    assert!(parse(&named).unwrap().to_config().is_ok());
    let plain = parse("--target latchkey://127.0.0.1:1 --workload uncontended").unwrap();
    assert!(plain.to_config().unwrap().tls.is_none());
}

#[test]
fn tls_flags_and_the_scheme_must_agree() {
    let ca = CaFile::new("agree");
    let ca = ca.0.display();
    let cases = [
        // latchkeys:// without a CA.
        ("latchkeys://h:1", String::new(), "needs --tls-ca"),
        // A CA for a plaintext target.
        ("latchkey://h:1", format!("--tls-ca {ca}"), "latchkeys://"),
        ("h:1", format!("--tls-ca {ca}"), "latchkeys://"),
        ("redis://h:1", format!("--tls-ca {ca}"), "latchkeys://"),
        // The other TLS flags need the CA.
        (
            "latchkeys://h:1",
            "--tls-server-name x".into(),
            "needs --tls-ca",
        ),
        // The CA must be readable; the error names the flag and the path.
        (
            "latchkeys://h:1",
            "--tls-ca /nonexistent/ca.crt".into(),
            "/nonexistent/ca.crt",
        ),
    ];
    for (target, flags, expected) in cases {
        let line = format!("--target {target} --workload uncontended {flags}");
        let error = parse(&line).unwrap().to_config().unwrap_err();
        assert!(error.contains(expected), "{line}: {error}");
    }
    // A certificate without its key (the flags' environment variables count too, so the pair
    // is checked past the command line).
    let lone = format!("--target latchkeys://h:1 --workload hold --tls-ca {ca} --tls-cert c");
    let error = parse(&lone).unwrap().to_config().unwrap_err();
    assert!(
        error.contains("--tls-cert and --tls-key go together"),
        "{error}"
    );
    // A library caller's config is checked the same way.
    let target = parse_target("latchkeys://h:1").unwrap();
    let error = BenchConfig::new(target, Workload::Hold)
        .validate()
        .unwrap_err();
    assert!(error.contains("needs --tls-ca"), "{error}");
}
