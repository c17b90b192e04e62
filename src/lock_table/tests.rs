//! Lock-table tests (being written).
