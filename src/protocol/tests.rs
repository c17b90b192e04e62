//! Codec tests (being written).
