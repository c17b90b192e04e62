//! The `latchkey` binary (being written).
fn main() {}
