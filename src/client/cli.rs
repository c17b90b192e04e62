//! `latchkey lock`, `latchkey query`, `latchkey ping` (being written).
#![allow(missing_docs)]
use std::process::ExitCode;

#[derive(clap::Args, Debug)]
pub struct LockArgs {}
#[derive(clap::Args, Debug)]
pub struct QueryArgs {}
#[derive(clap::Args, Debug)]
pub struct PingArgs {}

pub fn run_lock(_args: LockArgs) -> ExitCode {
    ExitCode::FAILURE
}
pub fn run_query(_args: QueryArgs) -> ExitCode {
    ExitCode::FAILURE
}
pub fn run_ping(_args: PingArgs) -> ExitCode {
    ExitCode::FAILURE
}
