//! `latchkey lock` as a process, as a user meets it: its command never outlives it (a
//! `kill -9` of `latchkey lock` takes the command, and without a controlling terminal the
//! command's children, with it), and its own failures can be told from the command's status.

use std::os::unix::process::CommandExt;
use std::path::Path;
use std::process::{Command, Stdio};
use std::thread;
use std::time::{Duration, Instant};

use common::server::TempDir;
use common::{client, start_server, PATIENCE};

fn latchkey() -> Command {
    let mut command = Command::new(env!("CARGO_BIN_EXE_latchkey"));
    // Whatever the environment of the test run says, the tests name their servers.
    command.env_remove("LATCHKEY_SERVER");
    command
}

/// A fresh directory for one test's files, removed when the test ends.
fn scratch(name: &str) -> TempDir {
    TempDir::new(&format!("cli-lock-{name}"))
}

/// The pid written to `path`, once it is there.
fn read_pid(path: &Path) -> libc::pid_t {
    let until = Instant::now() + PATIENCE;
    loop {
        if let Some(pid) = std::fs::read_to_string(path)
            .ok()
            .and_then(|text| text.trim().parse().ok())
        {
            return pid;
        }
        assert!(Instant::now() < until, "{} never written", path.display());
        thread::sleep(Duration::from_millis(20));
    }
}

/// Whether `pid` is a live process (a zombie, dead but not reaped yet, is not).
fn alive(pid: libc::pid_t) -> bool {
    let Ok(stat) = std::fs::read_to_string(format!("/proc/{pid}/stat")) else {
        return false;
    };
    // `pid (comm) S ...`: the state follows the last `)`.
    let state = stat.rsplit_once(')').map(|(_, rest)| rest.trim_start());
    !matches!(
        state.and_then(|rest| rest.chars().next()),
        Some('Z' | 'X') | None
    )
}

/// Waits until none of `pids` is alive; panics naming those still alive after the patience.
fn assert_all_die(pids: &[libc::pid_t], what: &str) {
    let until = Instant::now() + PATIENCE;
    while pids.iter().any(|&pid| alive(pid)) {
        if Instant::now() >= until {
            let left: Vec<_> = pids.iter().filter(|&&pid| alive(pid)).collect();
            // Do not leave them running after the test.
            for &&pid in &left {
                // SAFETY: kill has no memory effects.
                unsafe { libc::kill(pid, libc::SIGKILL) };
            }
            panic!("{what}: still running after latchkey lock died: {left:?}");
        }
        thread::sleep(Duration::from_millis(20));
    }
}

#[test]
fn a_killed_lock_takes_its_command_and_the_commands_children_along() {
    let server = start_server(|_| {});
    let addr = server.local_addr().to_string();
    let dir = scratch("group");
    let script = "echo $$ > cmd.pid; sleep 300 & echo $! > child.pid; wait";
    let mut lock = latchkey();
    lock.args(["lock", "--server", &addr, "--lease", "1s", "jobs/orphan"])
        .args(["--", "sh", "-c", script])
        .current_dir(dir.path())
        .stdin(Stdio::null())
        .stderr(Stdio::null());
    // SAFETY: setsid is async-signal-safe and touches no memory of ours. Without a controlling
    // terminal, as under cron or systemd.
    unsafe {
        lock.pre_exec(|| {
            libc::setsid();
            Ok(())
        });
    }
    let mut lock = lock.spawn().unwrap();
    let command = read_pid(&dir.path().join("cmd.pid"));
    let child = read_pid(&dir.path().join("child.pid"));
    assert!(alive(command) && alive(child));
    lock.kill().unwrap();
    lock.wait().unwrap();
    assert_all_die(&[command, child], "the command and its child");

    // The lease runs out; the next holder is alone.
    let observer = client(&[server.local_addr()], 1, Duration::from_secs(2));
    let ticket = observer
        .acquire(
            "jobs/orphan",
            Duration::from_secs(5),
            Duration::from_secs(5),
        )
        .unwrap();
    assert!(!alive(command) && !alive(child));
    drop(ticket);
}

#[test]
fn a_killed_lock_takes_its_command_along_whatever_its_terminal() {
    let server = start_server(|_| {});
    let addr = server.local_addr().to_string();
    let dir = scratch("plain");
    // `exec`: the command's pid is the shell's, and the death signal survives the exec.
    let script = "echo $$ > cmd.pid; exec sleep 300";
    let mut lock = latchkey()
        .args([
            "lock",
            "--server",
            &addr,
            "jobs/plain",
            "--",
            "sh",
            "-c",
            script,
        ])
        .current_dir(dir.path())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let command = read_pid(&dir.path().join("cmd.pid"));
    assert!(alive(command));
    lock.kill().unwrap();
    lock.wait().unwrap();
    assert_all_die(&[command], "the command");
}

#[test]
fn the_help_lists_the_exit_codes_and_what_each_signal_does() {
    let output = latchkey().args(["lock", "--help"]).output().unwrap();
    assert!(output.status.success());
    let help = String::from_utf8_lossy(&output.stdout);
    for code in ["80", "81", "82", "83", "84", "85", "126, 127"] {
        let listed = help.lines().any(|line| line.trim_start().starts_with(code));
        assert!(listed, "exit code {code} in\n{help}");
    }
    for part in [
        "SIGINT, SIGTERM, SIGHUP",
        "SIGKILL",
        "SIGSTOP",
        "--failure-exit-code",
    ] {
        assert!(help.contains(part), "{part} in\n{help}");
    }
}

#[test]
fn a_failure_exit_code_tells_latchkeys_own_failures_from_the_commands_status() {
    let server = start_server(|_| {});
    let addr = server.local_addr().to_string();
    let observer = client(&[server.local_addr()], 1, Duration::from_secs(2));
    let _held = observer
        .acquire("jobs/held", Duration::from_secs(1), Duration::from_secs(30))
        .unwrap();
    let dead = common::dead_addr().to_string();
    let status = |words: &[&str]| {
        let output = latchkey().args(words).output().unwrap();
        output.status.code()
    };
    let failure = ["--failure-exit-code", "99"];
    // CMD's own 2 stays 2.
    let run = [
        "lock",
        "--server",
        &addr,
        failure[0],
        failure[1],
        "jobs/free",
    ];
    assert_eq!(
        status(&[&run[..], &["--", "sh", "-c", "exit 2"]].concat()),
        Some(2)
    );
    // A usage error, the lock not taken, CMD not found: 99.
    let usage = [
        "lock", failure[0], failure[1], "--wait", "1.5s", "k", "--", "true",
    ];
    assert_eq!(status(&usage), Some(99));
    let joined = [
        "lock",
        "--failure-exit-code=99",
        "--wait",
        "1.5s",
        "k",
        "--",
        "true",
    ];
    assert_eq!(status(&joined), Some(99));
    let unavailable = [
        "lock", "--server", &dead, failure[0], failure[1], "k", "--", "true",
    ];
    assert_eq!(status(&unavailable), Some(99));
    let held = [
        "lock",
        "--server",
        &addr,
        failure[0],
        failure[1],
        "--wait",
        "0",
        "jobs/held",
    ];
    assert_eq!(status(&[&held[..], &["--", "true"]].concat()), Some(99));
    let missing = [&run[..], &["--", "/nonexistent/latchkey-test-command"]].concat();
    assert_eq!(status(&missing), Some(99));
    // A conflict keeps the code chosen for it.
    let chosen = [&held[..], &["--conflict-exit-code", "0", "--", "true"]].concat();
    assert_eq!(status(&chosen), Some(0));
    // Without the flag, the codes of old.
    assert_eq!(
        status(&["lock", "--wait", "1.5s", "k", "--", "true"]),
        Some(2)
    );
}

/// Runs `latchkey` with `words`; its exit code, its stderr and how long it took.
fn run_timed(words: &[&str]) -> (Option<i32>, String, Duration) {
    let start = Instant::now();
    let output = latchkey().args(words).output().unwrap();
    let stderr = String::from_utf8_lossy(&output.stderr).into_owned();
    (output.status.code(), stderr, start.elapsed())
}

#[test]
fn against_a_refused_port_every_command_fails_at_once_and_says_so_in_one_line() {
    let dead = common::dead_addr().to_string();
    // A transport timeout far longer than the slack: retrying until it runs out would show.
    let patience = ["--server", &dead, "--transport-timeout", "60s"];
    let cron_guard = [
        "lock",
        "--wait",
        "0",
        "--conflict-exit-code",
        "0",
        "--quiet",
    ];
    let runs: [Vec<&str>; 5] = [
        [&cron_guard[..], &patience, &["jobs/report", "--", "true"]].concat(),
        [
            &["lock", "--wait", "60s"][..],
            &patience,
            &["k", "--", "true"],
        ]
        .concat(),
        [&["query"][..], &patience, &["k"]].concat(),
        [&["ping"][..], &patience].concat(),
        [&["stats"][..], &patience].concat(),
    ];
    for words in runs {
        let (code, stderr, took) = run_timed(&words);
        assert_eq!(code, Some(83), "{words:?}: {stderr}");
        assert_eq!(stderr.lines().count(), 1, "{words:?}: one line: {stderr}");
        assert!(stderr.contains("connection refused"), "{words:?}: {stderr}");
        let tried = "(tried for ";
        assert!(stderr.contains(tried), "{words:?}: how long: {stderr}");
        assert!(
            stderr.contains("--retry-refused keeps trying"),
            "{words:?}: {stderr}"
        );
        assert!(
            took < Duration::from_secs(30),
            "{words:?}: at once, not {took:?}"
        );
    }
}

#[test]
fn with_retry_refused_a_command_keeps_trying_until_its_allowance_runs_out() {
    let dead = common::dead_addr().to_string();
    let retry = [
        "--server",
        &dead,
        "--retry-refused",
        "--transport-timeout",
        "1s",
    ];
    let runs: [(Vec<&str>, &str); 4] = [
        (
            [&["lock", "--wait", "0"][..], &retry, &["k", "--", "true"]].concat(),
            "of --transport-timeout 1s (--wait 0))",
        ),
        (
            [&["query"][..], &retry, &["k"]].concat(),
            "of --transport-timeout 1s)",
        ),
        (
            [&["ping"][..], &retry].concat(),
            "of --transport-timeout 1s) (seq=1)",
        ),
        (
            [&["stats"][..], &retry].concat(),
            "of --transport-timeout 1s)",
        ),
    ];
    for (words, end) in runs {
        let (code, stderr, took) = run_timed(&words);
        assert_eq!(code, Some(83), "{words:?}: {stderr}");
        assert!(
            took >= Duration::from_secs(1),
            "{words:?}: never early: {took:?}"
        );
        let last = stderr.lines().last().unwrap_or_default();
        assert!(last.ends_with(end), "{words:?}: {stderr}");
        assert!(last.contains("connection refused"), "{words:?}: {stderr}");
    }
}

/// Sends `signal` to `pid`.
fn signal(pid: u32, signal: i32) {
    // SAFETY: kill has no memory effects; the child is not reaped until the test waits for it.
    unsafe { libc::kill(pid as libc::pid_t, signal) };
}

/// A signal while `latchkey lock` waits for the key withdraws its acquire (Cancel) and ends it
/// with 128 + N, as the signal would have, saying so; the command never runs. Before, SIGTERM
/// killed it outright (no exit code, no word) and its waiter stayed queued on the server.
#[test]
fn a_signal_while_waiting_ends_the_lock_at_once_and_runs_nothing() {
    let server = start_server(|_| {});
    let addr = server.local_addr().to_string();
    let observer = client(&[server.local_addr()], 1, Duration::from_secs(2));
    let _held = observer
        .acquire("jobs/waited", Duration::ZERO, Duration::from_secs(60))
        .unwrap();
    let dir = scratch("waiting");
    let waiter = latchkey()
        .args(["lock", "--server", &addr, "--wait", "60s", "jobs/waited"])
        .args(["--", "touch", "ran"])
        .current_dir(dir.path())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let queued = common::server::wait_until(PATIENCE, || {
        observer
            .query("jobs/waited")
            .is_ok_and(|state| state.waiters == 1)
    });
    assert!(queued, "the waiter queued");
    signal(waiter.id(), libc::SIGTERM);
    let output = waiter.wait_with_output().unwrap();
    let err = String::from_utf8_lossy(&output.stderr);
    assert_eq!(output.status.code(), Some(128 + libc::SIGTERM), "{err}");
    assert!(err.contains("jobs/waited: interrupted by SIGTERM"), "{err}");
    assert!(!dir.path().join("ran").exists(), "the command never ran");
    // Withdrawn before it exited: not left queued (identified, it would have stayed there for
    // the client's grace, and been granted to nobody once the holder let go).
    let state = observer.query("jobs/waited").unwrap();
    assert_eq!(state.waiters, 0, "{err}");
}

/// A signal that reaches `latchkey lock` as its command starts is never lost: it is
/// forwarded to the command (here at once: CMD says it runs, and the test signals), and the
/// lock is released when the command exits. Before, signals were caught only some time after
/// CMD started: one sent at once killed `latchkey lock` outright, its guard killed CMD, and the
/// key stayed held until its lease ran out (60 s here).
#[test]
fn a_signal_as_the_command_starts_is_forwarded_and_the_lock_released() {
    let server = start_server(|_| {});
    let addr = server.local_addr().to_string();
    let observer = client(&[server.local_addr()], 1, Duration::from_secs(2));
    for round in 0..5 {
        let mut holder = latchkey()
            .args(["lock", "--server", &addr, "--lease", "60s", "jobs/started"])
            .args(["--", "sh", "-c", "echo running; exec sleep 60"])
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        let mut line = String::new();
        let stdout = holder.stdout.take().unwrap();
        std::io::BufRead::read_line(&mut std::io::BufReader::new(stdout), &mut line).unwrap();
        assert_eq!(line, "running\n", "round {round}: CMD runs under the lock");
        signal(holder.id(), libc::SIGTERM);
        let output = holder.wait_with_output().unwrap();
        let err = String::from_utf8_lossy(&output.stderr);
        assert_eq!(
            output.status.code(),
            Some(128 + libc::SIGTERM),
            "round {round}: CMD's status: {err}"
        );
        let state = observer.query("jobs/started").unwrap();
        assert!(!state.held, "round {round}: released: {err}");
    }
}
