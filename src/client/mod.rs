//! The official client (being written).
pub mod cli;
