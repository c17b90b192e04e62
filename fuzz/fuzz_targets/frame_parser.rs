//! Fuzzes `protocol::parse_request` with arbitrary bytes and key limits.
//!
//! Input: one byte that picks the key limit (0 → 1024, else 1..=255), then the bytes a session
//! would have buffered. The target walks them frame by frame as the reactor does and checks
//! what the parser promises: it never panics, never reads past the frame it reports, is
//! consistent on prefixes (a frame is incomplete until its last byte), re-encodes exactly,
//! and a refused frame ends at its newline unless its error closes the session.
#![no_main]

// The checks live in their own file, which `tests/fuzz_corpus.rs` also runs on the corpus.
#[path = "frame_parser_check.rs"]
mod frame_parser_check;

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| frame_parser_check::check(data));
