//! Observability: statistics snapshots, lifetime counters and live I/O counters.

pub(crate) mod io;
pub(crate) mod stats;
