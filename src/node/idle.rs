//! How this machine's idle CPUs wake, read once at start from Linux's sysfs, so that a server
//! whose CPUs sleep deeply says so (at info): every wake-up on a request's path — the core's,
//! and in cluster mode the log writers' and the followers' — pays the time an idle CPU takes to
//! run again. `docs/operations.md` (Latency tuning) says what to set, with figures.
//!
//! Two cases are reported: a virtual machine whose `haltpoll` cpuidle driver halts at once
//! (`guest_halt_poll_ns` 0: each wake-up waits for the virtual CPU to come back, tens of
//! microseconds, though its idle state claims 1 µs), and an enabled idle state whose exit
//! latency is [`DEEP_EXIT_US`] or more. Nothing is reported where sysfs says nothing (another
//! OS, a container without it).

use std::fs;
use std::path::Path;

/// An idle state that takes this long to leave (its `latency` in sysfs, µs) is worth a line.
pub const DEEP_EXIT_US: u64 = 50;
/// Idle states read per CPU at most.
const STATES_MAX: usize = 16;

/// What sysfs says of CPU 0's idle states.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct IdleStates {
    /// The cpuidle driver (`haltpoll`, `intel_idle`, `acpi_idle`, ...).
    pub driver: Option<String>,
    /// The `haltpoll` driver's polling before a halt, in nanoseconds.
    pub guest_halt_poll_ns: Option<u64>,
    /// The enabled idle state with the longest exit latency: its name and latency (µs).
    pub deepest: Option<(String, u64)>,
}

fn read_trimmed(path: &Path) -> Option<String> {
    fs::read_to_string(path).ok().map(|s| s.trim().to_string())
}

/// Reads the idle states of CPU 0 under `sys` (`/sys` on a real machine). Missing files leave
/// their fields empty.
pub fn read(sys: &Path) -> IdleStates {
    let cpuidle = sys.join("devices/system/cpu/cpuidle/current_driver");
    let poll = sys.join("module/haltpoll/parameters/guest_halt_poll_ns");
    let mut deepest: Option<(String, u64)> = None;
    for index in 0..STATES_MAX {
        let state = sys.join(format!("devices/system/cpu/cpu0/cpuidle/state{index}"));
        let Some(latency) = read_trimmed(&state.join("latency")) else {
            break;
        };
        let enabled = read_trimmed(&state.join("disable")).map_or(true, |d| d == "0");
        let Ok(latency) = latency.parse::<u64>() else {
            continue;
        };
        if enabled && deepest.as_ref().map_or(true, |(_, us)| latency > *us) {
            let name = read_trimmed(&state.join("name")).unwrap_or_else(|| format!("state{index}"));
            deepest = Some((name, latency));
        }
    }
    IdleStates {
        driver: read_trimmed(&cpuidle),
        guest_halt_poll_ns: read_trimmed(&poll).and_then(|ns| ns.parse().ok()),
        deepest,
    }
}

/// The line to log about `states`, if they slow a request's wake-ups. No I/O.
pub fn advice(states: &IdleStates) -> Option<String> {
    const SEE: &str = "see docs/operations.md, Latency tuning";
    if states.driver.as_deref() == Some("haltpoll") && states.guest_halt_poll_ns == Some(0) {
        return Some(format!(
            "idle CPUs halt at once (cpuidle driver haltpoll, guest_halt_poll_ns 0): every \
             wake-up on a request's path waits for a virtual CPU to come back, tens of \
             microseconds; polling before a halt (guest_halt_poll_ns, e.g. 200000) takes that \
             away: {SEE}"
        ));
    }
    let (name, exit_us) = states.deepest.as_ref()?;
    (*exit_us >= DEEP_EXIT_US).then(|| {
        format!(
            "idle CPUs may enter the state {name} (cpuidle driver {}), which takes {exit_us} µs \
             to leave: a request's wake-ups may each wait that long; limiting the idle states \
             (e.g. cpupower idle-set -D 10) takes that away: {SEE}",
            states.driver.as_deref().unwrap_or("unknown")
        )
    })
}

/// Logs [`advice`] about this machine's idle CPUs at info, if any.
pub fn log_advice() {
    if let Some(line) = advice(&read(Path::new("/sys"))) {
        log::info!("{line}");
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::path::PathBuf;

    /// A fresh directory standing for `/sys`, removed when dropped.
    struct FakeSys(PathBuf);

    impl FakeSys {
        fn new(name: &str) -> FakeSys {
            let dir = std::env::temp_dir().join(format!(
                "latchkey-idle-{name}-{}-{:?}",
                std::process::id(),
                std::thread::current().id()
            ));
            let _ = fs::remove_dir_all(&dir);
            fs::create_dir_all(&dir).expect("temp dir");
            FakeSys(dir)
        }

        fn write(&self, path: &str, text: &str) {
            let path = self.0.join(path);
            fs::create_dir_all(path.parent().expect("a parent")).expect("dirs");
            fs::write(path, format!("{text}\n")).expect("write");
        }

        fn state(&self, index: usize, name: &str, latency: u64, disabled: bool) {
            let dir = format!("devices/system/cpu/cpu0/cpuidle/state{index}");
            self.write(&format!("{dir}/name"), name);
            self.write(&format!("{dir}/latency"), &latency.to_string());
            self.write(&format!("{dir}/disable"), if disabled { "1" } else { "0" });
        }
    }

    impl Drop for FakeSys {
        fn drop(&mut self) {
            let _ = fs::remove_dir_all(&self.0);
        }
    }

    #[test]
    fn a_vm_that_halts_at_once_is_reported_and_one_that_polls_is_not() {
        let sys = FakeSys::new("haltpoll");
        sys.write("devices/system/cpu/cpuidle/current_driver", "haltpoll");
        sys.write("module/haltpoll/parameters/guest_halt_poll_ns", "0");
        sys.state(0, "POLL", 0, false);
        sys.state(1, "haltpoll idle", 1, false);
        let states = read(&sys.0);
        assert_eq!(states.driver.as_deref(), Some("haltpoll"));
        assert_eq!(states.guest_halt_poll_ns, Some(0));
        assert_eq!(states.deepest, Some(("haltpoll idle".to_string(), 1)));
        let line = advice(&states).expect("a halt at once is reported");
        assert!(line.contains("guest_halt_poll_ns 0"), "{line}");
        sys.write("module/haltpoll/parameters/guest_halt_poll_ns", "200000");
        assert_eq!(advice(&read(&sys.0)), None);
    }

    #[test]
    fn a_deep_enabled_state_is_reported_and_a_disabled_one_is_not() {
        let sys = FakeSys::new("cstates");
        sys.write("devices/system/cpu/cpuidle/current_driver", "intel_idle");
        sys.state(0, "POLL", 0, false);
        sys.state(1, "C1", 2, false);
        sys.state(2, "C6", 133, false);
        sys.state(3, "C1E", 10, false);
        let states = read(&sys.0);
        assert_eq!(states.deepest, Some(("C6".to_string(), 133)));
        let line = advice(&states).expect("C6 is deep");
        assert!(line.contains("C6") && line.contains("133 µs"), "{line}");
        sys.state(2, "C6", 133, true);
        assert_eq!(read(&sys.0).deepest, Some(("C1E".to_string(), 10)));
        assert_eq!(advice(&read(&sys.0)), None);
    }

    #[test]
    fn nothing_in_sysfs_says_nothing() {
        let sys = FakeSys::new("empty");
        assert_eq!(read(&sys.0), IdleStates::default());
        assert_eq!(advice(&IdleStates::default()), None);
        // A state whose latency does not parse is skipped, not taken for 0.
        sys.state(0, "odd", 0, false);
        sys.write("devices/system/cpu/cpu0/cpuidle/state0/latency", "many");
        assert_eq!(read(&sys.0).deepest, None);
    }
}
