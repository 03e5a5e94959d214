//! What the server counts while it runs: requests, bytes, failures and latency per command,
//! failures by kind, and connections. Shared by every connection of a server; read by the
//! admin socket and the metrics endpoint as a [`ServerMetricsSnapshot`].
//!
//! Invariants:
//! - Fixed memory: one set of atomics per command kind and error kind, and a latency
//!   histogram of [`LATENCY_BOUNDS_US`]`.len() + 1` buckets per command. Nothing grows with
//!   requests, connections or clients.
//! - Recording is a handful of relaxed atomic additions and never blocks: it sits on every
//!   request's path. A snapshot is therefore not one instant (counters are read one by one),
//!   but every counter only grows.
//! - A request is counted once, when its reply has been written (or given up on), with the
//!   time from after its header and payload were read.

use crate::backend::ErrorKind;
use crate::proto::Command;
use serde::{Deserialize, Serialize};
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

/// Upper bounds of the latency buckets, in microseconds; a last bucket takes the rest.
pub const LATENCY_BOUNDS_US: [u64; 15] =
    [50, 100, 250, 500, 1_000, 2_500, 5_000, 10_000, 25_000, 50_000, 100_000, 250_000, 500_000, 1_000_000, 2_500_000];
const BUCKETS: usize = LATENCY_BOUNDS_US.len() + 1;

/// The commands counted, in the order of [`ServerMetricsSnapshot::commands`].
pub const COMMAND_NAMES: [&str; 6] = ["read", "write", "flush", "trim", "write_zeroes", "block_status"];

fn command_index(c: &Command) -> usize {
    match c {
        Command::Read { .. } => 0,
        Command::Write { .. } => 1,
        Command::Flush => 2,
        Command::Trim { .. } => 3,
        Command::WriteZeroes { .. } => 4,
        Command::BlockStatus { .. } => 5,
    }
}

/// The error kinds counted, in the order of [`ServerMetricsSnapshot::errors`]; `rejected`
/// is a request the protocol refused before it reached the volume (out of range, bad flags,
/// a write to a read-only export, block status without a context).
pub const ERROR_NAMES: [&str; 7] = ["device", "checksum", "no_space", "read_only", "invalid", "other", "rejected"];

fn error_index(k: ErrorKind) -> usize {
    match k {
        ErrorKind::Device => 0,
        ErrorKind::Checksum => 1,
        ErrorKind::NoSpace => 2,
        ErrorKind::ReadOnly => 3,
        ErrorKind::Invalid => 4,
        ErrorKind::Other => 5,
    }
}
const REJECTED: usize = 6;

#[derive(Debug, Default)]
struct CommandCounters {
    requests: AtomicU64,
    fua: AtomicU64,
    bytes: AtomicU64,
    errors: AtomicU64,
    latency_sum_us: AtomicU64,
    latency: [AtomicU64; BUCKETS],
}

/// The live counters of one server.
#[derive(Debug, Default)]
pub struct ServerMetrics {
    commands: [CommandCounters; COMMAND_NAMES.len()],
    errors: [AtomicU64; ERROR_NAMES.len()],
    connections_accepted: AtomicU64,
    connections_refused: AtomicU64,
    connections_closed: AtomicU64,
}

impl ServerMetrics {
    /// Counts one executed request: its bytes (read, written, trimmed, zeroed, or asked
    /// about), whether it carried FUA, and its latency.
    pub fn request(&self, cmd: &Command, elapsed: Duration) {
        let (bytes, fua) = match *cmd {
            Command::Read { len, .. } | Command::BlockStatus { len, .. } => (u64::from(len), false),
            Command::Write { len, fua, .. }
            | Command::Trim { len, fua, .. }
            | Command::WriteZeroes { len, fua, .. } => (u64::from(len), fua),
            Command::Flush => (0, false),
        };
        let Some(c) = self.commands.get(command_index(cmd)) else { return };
        c.requests.fetch_add(1, Ordering::Relaxed);
        c.bytes.fetch_add(bytes, Ordering::Relaxed);
        if fua {
            c.fua.fetch_add(1, Ordering::Relaxed);
        }
        let us = u64::try_from(elapsed.as_micros()).unwrap_or(u64::MAX);
        c.latency_sum_us.fetch_add(us, Ordering::Relaxed);
        let b = LATENCY_BOUNDS_US.iter().position(|&bound| us <= bound).unwrap_or(LATENCY_BOUNDS_US.len());
        if let Some(slot) = c.latency.get(b) {
            slot.fetch_add(1, Ordering::Relaxed);
        }
    }

    /// Counts a request the volume failed.
    pub fn failed(&self, cmd: &Command, kind: ErrorKind) {
        if let Some(c) = self.commands.get(command_index(cmd)) {
            c.errors.fetch_add(1, Ordering::Relaxed);
        }
        if let Some(e) = self.errors.get(error_index(kind)) {
            e.fetch_add(1, Ordering::Relaxed);
        }
    }

    /// Counts a request refused by the protocol checks.
    pub fn rejected(&self) {
        if let Some(e) = self.errors.get(REJECTED) {
            e.fetch_add(1, Ordering::Relaxed);
        }
    }

    /// Counts a connection taken into service.
    pub fn connection_accepted(&self) {
        self.connections_accepted.fetch_add(1, Ordering::Relaxed);
    }

    /// Counts a connection turned away at the connection limit.
    pub fn connection_refused(&self) {
        self.connections_refused.fetch_add(1, Ordering::Relaxed);
    }

    /// Counts a served connection that ended.
    pub fn connection_closed(&self) {
        self.connections_closed.fetch_add(1, Ordering::Relaxed);
    }

    /// The counters now.
    pub fn snapshot(&self) -> ServerMetricsSnapshot {
        let get = |a: &AtomicU64| a.load(Ordering::Relaxed);
        let commands = COMMAND_NAMES
            .iter()
            .zip(&self.commands)
            .map(|(name, c)| CommandFigures {
                command: (*name).to_string(),
                requests: get(&c.requests),
                fua: get(&c.fua),
                bytes: get(&c.bytes),
                errors: get(&c.errors),
                latency: Latency {
                    bounds_us: LATENCY_BOUNDS_US.to_vec(),
                    counts: c.latency.iter().map(get).collect(),
                    sum_us: get(&c.latency_sum_us),
                },
            })
            .collect();
        let errors = ERROR_NAMES.iter().zip(&self.errors).map(|(n, e)| ((*n).to_string(), get(e))).collect();
        let accepted = get(&self.connections_accepted);
        ServerMetricsSnapshot {
            commands,
            errors,
            connections_accepted: accepted,
            connections_refused: get(&self.connections_refused),
            connections_open: accepted.saturating_sub(get(&self.connections_closed)),
        }
    }
}

/// A latency histogram: `counts[i]` requests took at most `bounds_us[i]` µs (and more than
/// the bound before); the last count has no bound.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Latency {
    /// Upper bounds in µs.
    pub bounds_us: Vec<u64>,
    /// Requests per bucket (one more than bounds).
    pub counts: Vec<u64>,
    /// Sum of all latencies in µs.
    pub sum_us: u64,
}

/// One command's figures.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct CommandFigures {
    /// `read`, `write`, `flush`, `trim`, `write_zeroes` or `block_status`.
    pub command: String,
    /// Requests executed (failed ones included).
    pub requests: u64,
    /// Of those, with the FUA flag.
    pub fua: u64,
    /// Bytes they covered.
    pub bytes: u64,
    /// Of those, failed by the volume.
    pub errors: u64,
    /// Time from request read to reply written.
    pub latency: Latency,
}

/// The server's counters at one moment, as the admin socket and metrics endpoint report.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct ServerMetricsSnapshot {
    /// Per command, in [`COMMAND_NAMES`] order.
    pub commands: Vec<CommandFigures>,
    /// Failed or refused requests by kind, in [`ERROR_NAMES`] order.
    pub errors: Vec<(String, u64)>,
    /// Connections served since start.
    pub connections_accepted: u64,
    /// Connections turned away at the limit.
    pub connections_refused: u64,
    /// Connections open now.
    pub connections_open: u64,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn requests_land_in_their_command_and_bucket() {
        let m = ServerMetrics::default();
        m.request(&Command::Write { offset: 0, len: 4096, fua: true }, Duration::from_micros(70));
        m.request(&Command::Read { offset: 0, len: 512 }, Duration::from_secs(10));
        m.failed(&Command::Read { offset: 0, len: 512 }, ErrorKind::Checksum);
        m.rejected();
        let s = m.snapshot();
        let w = &s.commands[1];
        assert_eq!((w.command.as_str(), w.requests, w.fua, w.bytes), ("write", 1, 1, 4096));
        assert_eq!(w.latency.counts[1], 1, "70 µs falls in the 100 µs bucket");
        let r = &s.commands[0];
        assert_eq!((r.requests, r.errors, *r.latency.counts.last().unwrap()), (1, 1, 1));
        assert_eq!(s.errors[1], ("checksum".to_string(), 1));
        assert_eq!(s.errors[6], ("rejected".to_string(), 1));
    }
}
