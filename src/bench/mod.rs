//! The load generator behind `latchkey bench` (being written).
#![allow(missing_docs)]
use std::process::ExitCode;

#[derive(clap::Args, Debug)]
pub struct BenchArgs {}

pub fn run(_args: BenchArgs) -> ExitCode {
    ExitCode::FAILURE
}
