//! `dist/latchkey.service` and `dist/latchkey.toml`: the unit passes `systemd-analyze verify`
//! (when the tool is on PATH; skipped otherwise) with its `ExecStart` pointed at the built
//! binary, and the example config loads, uses the unit's state directory and fits the unit's
//! `LimitNOFILE`; with their TLS lines uncommented, the unit hands the TLS files over as
//! credentials (`LoadCredential=`) and the config names exactly those copies.
//!
//! `systemd-analyze verify` also reports on units of the host it loads along the way; only its
//! lines that name our unit are judged.

use std::path::Path;
use std::process::{Command, Stdio};
use std::thread;
use std::time::{Duration, Instant};

use common::server::TempDir;
use latchkey::config::Config;

const UNIT: &str = include_str!("../dist/latchkey.service");
/// The server's margin of open files besides one per session.
const FILES_MARGIN: usize = 64;
/// How long `systemd-analyze verify` may take before the check is given up (it takes well
/// under a second; a hung tool says nothing about the unit).
const VERIFY_PATIENCE: Duration = Duration::from_secs(60);
/// What systemd says about a directive it did not take.
const COMPLAINTS: [&str; 4] = ["Unknown", "Invalid", "Failed to parse", "ignoring"];

fn on_path(program: &str) -> bool {
    let Some(path) = std::env::var_os("PATH") else {
        return false;
    };
    std::env::split_paths(&path).any(|dir| dir.join(program).is_file())
}

/// The unit's value of `key` (its last assignment).
fn setting<'a>(unit: &'a str, key: &str) -> Option<&'a str> {
    let prefix = format!("{key}=");
    unit.lines()
        .rev()
        .find_map(|line| line.strip_prefix(&prefix))
}

/// `text` with the '#' removed from the lines that start with one of `starts` (after it).
fn uncommented(text: &str, starts: &[&str]) -> String {
    let lines = text.lines().map(|line| match line.strip_prefix('#') {
        Some(rest) if starts.iter().any(|start| rest.starts_with(start)) => rest,
        _ => line,
    });
    lines.map(|line| format!("{line}\n")).collect()
}

/// The example config with its `[tls]` lines uncommented.
fn config_with_tls() -> String {
    let config = std::fs::read_to_string("dist/latchkey.toml").unwrap();
    let tls_lines = ["[tls]", "cert_file =", "key_file =", "client_ca_file ="];
    uncommented(&config, &tls_lines)
}

#[test]
fn the_unit_passes_systemd_analyze_verify() {
    check_verify(UNIT, "service-unit");
}

#[test]
fn the_unit_and_config_show_how_the_dynamic_user_reads_the_tls_files() {
    let unit = uncommented(UNIT, &["LoadCredential="]);
    let credentials: Vec<(&str, &str)> = unit
        .lines()
        .filter_map(|line| line.strip_prefix("LoadCredential="))
        .filter_map(|value| value.split_once(':'))
        .collect();
    let names: Vec<&str> = credentials.iter().map(|(name, _)| *name).collect();
    assert_eq!(names, ["tls.crt", "tls.key", "client-ca.crt"], "{unit}");
    let dir = TempDir::new("service-unit-tls");
    let path = dir.path().join("latchkey.toml");
    std::fs::write(&path, config_with_tls()).unwrap();
    let config = Config::load(&path).expect("the example config with [tls] loads");
    let tls = config.tls.expect("a [tls] section");
    let copy = |name: &str| Path::new("/run/credentials/latchkey.service").join(name);
    assert_eq!(tls.cert_file, copy("tls.crt"));
    assert_eq!(tls.key_file, copy("tls.key"));
    assert_eq!(tls.client_ca_file, Some(copy("client-ca.crt")));
    check_verify(&unit, "service-unit-credentials");
}

/// `unit` (its `ExecStart` pointed at the built binary and a copy of the example config)
/// passes `systemd-analyze verify`, when the tool is there.
fn check_verify(unit: &str, label: &str) {
    if !on_path("systemd-analyze") {
        eprintln!("skipped: systemd-analyze is not on PATH");
        return;
    }
    let dir = TempDir::new(label);
    let config = dir.path().join("latchkey.toml");
    std::fs::copy("dist/latchkey.toml", &config).unwrap();
    let exec_start = format!(
        "ExecStart={} serve --config {}",
        env!("CARGO_BIN_EXE_latchkey"),
        config.display()
    );
    let original = setting(unit, "ExecStart").expect("an ExecStart");
    let unit_text = unit.replace(&format!("ExecStart={original}"), &exec_start);
    let unit = dir.path().join("latchkey.service");
    std::fs::write(&unit, unit_text).unwrap();
    let Some((success, stderr)) = verify(&unit) else {
        eprintln!("skipped: systemd-analyze verify ran longer than {VERIFY_PATIENCE:?}");
        return;
    };
    let complaints: Vec<&str> = stderr
        .lines()
        .filter(|line| line.contains("latchkey.service"))
        .filter(|line| COMPLAINTS.iter().any(|word| line.contains(word)))
        .collect();
    assert!(
        complaints.is_empty(),
        "about the unit:\n{}",
        complaints.join("\n")
    );
    assert!(success, "systemd-analyze verify failed:\n{stderr}");
}

/// Runs `systemd-analyze verify` on `unit`: whether it succeeded, and its stderr; `None` when
/// it did not finish in time.
fn verify(unit: &Path) -> Option<(bool, String)> {
    let mut child = Command::new("systemd-analyze")
        .args(["verify", "--man=no"])
        .arg(unit)
        .env("SYSTEMD_LOG_COLOR", "0")
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .expect("run systemd-analyze");
    let stderr = child.stderr.take().unwrap();
    let reader = thread::spawn(move || std::io::read_to_string(stderr).unwrap_or_default());
    let until = Instant::now() + VERIFY_PATIENCE;
    let status = loop {
        if let Some(status) = child.try_wait().unwrap() {
            break status;
        }
        if Instant::now() >= until {
            let _ = child.kill();
            let _ = child.wait();
            return None;
        }
        thread::sleep(Duration::from_millis(10));
    };
    Some((status.success(), reader.join().unwrap()))
}

#[test]
fn the_example_config_fits_the_unit() {
    let config = Config::load(Path::new("dist/latchkey.toml")).expect("dist/latchkey.toml loads");
    let state_directory = setting(UNIT, "StateDirectory").expect("a StateDirectory");
    let state_dir = Path::new("/var/lib").join(state_directory);
    assert_eq!(
        config.tokens.state_dir.as_deref(),
        Some(state_dir.as_path())
    );
    let files: usize = setting(UNIT, "LimitNOFILE").unwrap().parse().unwrap();
    assert!(files >= config.limits.max_connections + FILES_MARGIN);
    assert!(files >= Config::default().limits.max_connections + FILES_MARGIN);
    let stop_s: u64 = setting(UNIT, "TimeoutStopSec").unwrap().parse().unwrap();
    assert!(stop_s > 5, "beyond the 5 s graceful shutdown");
    assert_eq!(setting(UNIT, "RestartPreventExitStatus"), Some("78"));
    let families = setting(UNIT, "RestrictAddressFamilies").unwrap();
    assert!(
        families.contains("AF_UNIX"),
        "the address lock is a Unix socket"
    );
}
