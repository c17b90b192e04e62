//! Starting CMD for `latchkey lock` so that it never outlives `latchkey lock`: without the
//! lock, nothing may keep running the work the lock guards.
//!
//! * CMD gets `PR_SET_PDEATHSIG` = SIGKILL (Linux), set in the child between fork and exec: the
//!   kernel kills CMD as soon as the thread that started it ends, however `latchkey lock`
//!   dies (SIGKILL, a crash). The child then compares `getppid()` with the pid recorded before
//!   the fork: if `latchkey lock` died before the signal was armed, the child exits at once
//!   instead of running CMD.
//! * A death signal reaches CMD alone, not the processes CMD started. So when `latchkey lock`
//!   has no controlling terminal (cron, systemd, a CI runner, `setsid`), CMD runs in a process
//!   group of its own, every signal for CMD goes to that whole group, and a *guard* — a second
//!   `latchkey` process (the hidden `lock-guard` command) whose stdin is a pipe from `latchkey
//!   lock` — kills the group with SIGKILL when that pipe reaches its end without the word
//!   that all is well: the kernel closes it however `latchkey lock` ends (the binary only: a
//!   test that runs `latchkey lock` in its own process starts no guard). With a controlling
//!   terminal CMD stays in `latchkey lock`'s process group, as under `flock(1)`, so that it
//!   keeps the terminal (reads it, gets Ctrl-C and Ctrl-Z): there only CMD itself is killed
//!   with `latchkey lock`.
//!
//! Invariant: CMD's pid (its group's id) stays reserved until `supervise` reaps CMD, after the
//! guard stood down, so neither a signal nor the guard can reach a recycled pid or group.
//! Deliberately not here: supervising CMD once it runs (`supervise.rs`).

use std::ffi::OsString;
use std::io::{self, Read, Write};
use std::os::unix::process::CommandExt;
use std::process::{Child, ChildStdin, Command, ExitCode, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};

/// Whether this process's executable is the `latchkey` binary, which `latchkey lock` may start
/// again as the guard (set by the binary's `main`; a test that runs `latchkey lock` in its
/// own process has no guard to start).
static GUARD_AVAILABLE: AtomicBool = AtomicBool::new(false);

/// Says that this process's executable is the `latchkey` binary: `latchkey lock` may start it
/// again (`/proc/self/exe lock-guard PGID`) as the guard of its command's process group.
pub fn enable_lock_guard() {
    GUARD_AVAILABLE.store(true, Ordering::Relaxed);
}

/// What `latchkey lock` started: CMD, where its signals go, and its guard.
pub(super) struct Started {
    /// CMD.
    pub child: Child,
    /// Where a signal for CMD goes: its pid, or its process group as `-pgid` (see `kill(2)`).
    pub target: libc::pid_t,
    /// The guard of CMD's process group, when CMD has one.
    pub guard: Option<Guard>,
}

/// The guard process of CMD's process group (see the module docs).
pub(super) struct Guard {
    process: Child,
    stdin: ChildStdin,
}

impl Guard {
    /// Tells the guard that CMD ended under supervision, and waits for it to exit. Called
    /// before CMD is reaped.
    pub(super) fn stand_down(mut self) {
        // A guard that is gone already (killed by hand) reads nothing: nothing to do then.
        let _ = self.stdin.write_all(b"x");
        drop(self.stdin);
        let _ = self.process.wait();
    }
}

/// Whether this process has a controlling terminal (`/dev/tty` opens only then).
pub(super) fn has_terminal() -> bool {
    std::fs::File::open("/dev/tty").is_ok()
}

/// Starts `command` (CMD and its arguments) with `environment`, tied to this process's life
/// (see the module docs); `own_group`: in a process group of its own, with a guard.
pub(super) fn start(
    command: &[OsString],
    environment: &[(&str, String)],
    own_group: bool,
) -> io::Result<Started> {
    let mut builder = Command::new(&command[0]);
    builder.args(&command[1..]);
    for (name, value) in environment {
        builder.env(name, value);
    }
    die_with_parent(&mut builder);
    if own_group {
        builder.process_group(0);
    }
    let child = builder.spawn()?;
    let pid = child.id() as libc::pid_t;
    if !own_group || !GUARD_AVAILABLE.load(Ordering::Relaxed) {
        let target = if own_group { -pid } else { pid };
        return Ok(Started {
            child,
            target,
            guard: None,
        });
    }
    let guard = match start_guard(pid) {
        Ok(guard) => Some(guard),
        Err(error) => {
            // CMD still dies with us (the death signal); only its children might not.
            eprintln!("latchkey lock: cannot start the guard of the command's group: {error}");
            None
        }
    };
    Ok(Started {
        child,
        target: -pid,
        guard,
    })
}

/// Arms SIGKILL for the child when this thread ends, in the child before exec.
fn die_with_parent(builder: &mut Command) {
    let parent = std::process::id() as libc::pid_t;
    // SAFETY: the closure runs in the forked child before exec and only makes
    // async-signal-safe system calls (prctl, getppid, _exit); it touches no memory of ours.
    unsafe {
        builder.pre_exec(move || {
            let signal = libc::SIGKILL as libc::c_ulong;
            if libc::prctl(libc::PR_SET_PDEATHSIG, signal, 0, 0, 0) != 0 {
                return Err(io::Error::last_os_error());
            }
            // The parent died between the fork and the prctl: the signal will never come,
            // and nobody holds the lock for CMD.
            if libc::getppid() != parent {
                libc::_exit(1);
            }
            Ok(())
        });
    }
}

/// Starts `latchkey lock-guard PGID` on this very binary, its stdin a pipe from us.
fn start_guard(pgid: libc::pid_t) -> io::Result<Guard> {
    let mut process = Command::new("/proc/self/exe")
        .arg("lock-guard")
        .arg(pgid.to_string())
        .stdin(Stdio::piped())
        .stdout(Stdio::null())
        // Its own group: a signal to our group (the shell's Ctrl-C, `kill -- -PGID`) is not
        // for it; it ends when its pipe tells it to.
        .process_group(0)
        .spawn()?;
    let stdin = process.stdin.take().expect("stdin was piped");
    Ok(Guard { process, stdin })
}

/// Arguments of the hidden `latchkey lock-guard`.
#[derive(clap::Args, Debug, Clone)]
pub struct GuardArgs {
    /// The process group of the command `latchkey lock` runs.
    #[arg(value_parser = clap::value_parser!(i32).range(2..))]
    pub pgid: i32,
}

/// `latchkey lock-guard PGID` (started by `latchkey lock`, not by people): waits for its stdin
/// to say that `latchkey lock` stood it down; when stdin ends without that, `latchkey lock`
/// died, and the process group PGID gets SIGKILL.
pub fn run_lock_guard(args: GuardArgs) -> ExitCode {
    for signal in [libc::SIGINT, libc::SIGTERM, libc::SIGHUP] {
        // SAFETY: setting a signal's disposition to "ignore" has no memory effects.
        unsafe { libc::signal(signal, libc::SIG_IGN) };
    }
    let mut byte = [0u8; 1];
    let mut stdin = io::stdin().lock();
    // Bounded: every pass but an interrupted read returns.
    loop {
        match stdin.read(&mut byte) {
            Ok(1..) => return ExitCode::SUCCESS,
            Err(error) if error.kind() == io::ErrorKind::Interrupted => continue,
            Ok(0) | Err(_) => break,
        }
    }
    // The range check keeps 0, 1 and negatives out: kill(-1) would reach every process.
    // SAFETY: kill has no memory effects.
    unsafe { libc::kill(-args.pgid, libc::SIGKILL) };
    eprintln!(
        "latchkey lock: it died while its command ran: SIGKILL to the command's process group {}",
        args.pgid
    );
    ExitCode::SUCCESS
}
