//! Fuzzes a whole session pipeline: arbitrary bytes become a script of chunks for several
//! sessions, time jumps and ends of input; each chunk is parsed in place and executed against a
//! lock table on virtual time, and every answer is checked as it is produced (see
//! `tests/common/session_driver.rs`, shared with the `arbitrary_bytes` property test). No
//! panic, the table's invariants after every step, every acquire answered once, and leftover
//! input is an incomplete frame unless a closing `X` ended the session.
#![no_main]

// A file of the tests' support library (`tests/common`), where all of it is used; this target
// drives `Driver::run_script` only.
#[allow(dead_code)]
#[path = "../../tests/common/session_driver.rs"]
mod session_driver;

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let driver = session_driver::Driver::run_script(data);
    driver.check_consumed();
});
