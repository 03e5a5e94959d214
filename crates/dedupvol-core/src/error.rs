//! Typed errors for every engine operation.
//!
//! Invariants:
//! - Every error carries enough context (which device, which block, what was expected) for an
//!   operator to act on it without a debugger.
//! - `Error::errno` maps each error to the POSIX code a block-device frontend should report
//!   (EIO for I/O and corruption, ENOSPC for a full volume, EINVAL for bad arguments).

use std::io;

/// Result alias used across the engine.
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// An engine error.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The underlying device failed.
    #[error("I/O error: {context}: {source}")]
    Io {
        /// What the engine was doing.
        context: String,
        /// The device error.
        #[source]
        source: io::Error,
    },
    /// A structure read from a device is not what it must be: which structure, where,
    /// what it should have held and what it held. The affected data cannot be trusted.
    #[error("corruption detected: {0}")]
    Corruption(Corruption),
    /// The engine broke one of its own invariants (a bug, not bad input or a bad device).
    #[error("internal error: {what}: {detail}")]
    Internal {
        /// The invariant that broke.
        what: &'static str,
        /// The values involved.
        detail: String,
    },
    /// No free physical block is left.
    #[error("no space left on volume: {0}")]
    NoSpace(String),
    /// An offset/length outside the volume.
    #[error("out of range: offset {offset} length {len} exceeds volume size {size}")]
    OutOfRange {
        /// Requested byte offset.
        offset: u64,
        /// Requested length in bytes.
        len: u64,
        /// The volume's logical size in bytes.
        size: u64,
    },
    /// The device does not hold a dedupvol volume (or not one we can read).
    #[error("not a dedupvol volume: {0}")]
    NotAVolume(String),
    /// An extra data device of a striped volume is missing, unreadable, too small, or
    /// holds another device's or another volume's header (swapped, renamed, reused).
    #[error("data device {index} of {count} ({path}) of volume {volume}: {reason}; the volume needs all of its data devices")]
    DataDevice {
        /// The device's place in the stripe (1..count).
        index: u32,
        /// Data devices of the volume.
        count: u32,
        /// The path the superblock records for it.
        path: String,
        /// The volume's uuid (hex).
        volume: String,
        /// What is wrong.
        reason: String,
    },
    /// The device already holds a volume and `force` was not given.
    #[error("{0} already holds a dedupvol volume; pass --force to overwrite it")]
    AlreadyFormatted(String),
    /// Memory the volume needs (its fingerprint index) cannot be had on this machine.
    #[error("not enough memory: {0}")]
    OutOfMemory(String),
    /// A caller passed an invalid argument.
    #[error("invalid argument: {0}")]
    InvalidArgument(String),
    /// Another process holds the device (its lock); the message names the holder if known.
    #[error("{0}")]
    InUse(String),
    /// The volume was opened read-only.
    #[error("volume is read-only")]
    ReadOnly,
    /// An earlier metadata write failed; the volume refuses further writes to stay consistent.
    #[error("volume is failed after an earlier metadata error; reopen it to recover: {0}")]
    Failed(String),
}

/// Corruption found in one structure at one address.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Corruption {
    /// The structure that is damaged (or that pointed at the damage).
    pub structure: &'static str,
    /// Its address: a logical block, a physical block, a page or a journal sequence,
    /// as `structure` says.
    pub address: u64,
    /// What it should have held.
    pub expected: String,
    /// What it held.
    pub found: String,
}

impl std::fmt::Display for Corruption {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{} {}: expected {}, found {}", self.structure, self.address, self.expected, self.found)
    }
}

impl Error {
    /// Corruption of `structure` at `address`: it should have held `expected` but held `found`.
    pub fn corruption(
        structure: &'static str,
        address: u64,
        expected: impl Into<String>,
        found: impl Into<String>,
    ) -> Self {
        Error::Corruption(Corruption { structure, address, expected: expected.into(), found: found.into() })
    }

    /// A broken internal invariant: `what` names it, `detail` gives the values.
    pub fn internal(what: &'static str, detail: impl Into<String>) -> Self {
        Error::Internal { what, detail: detail.into() }
    }

    /// Wraps an `io::Error` with context.
    pub fn io(context: impl Into<String>, source: io::Error) -> Self {
        Error::Io { context: context.into(), source }
    }

    /// True for a device that gave no answer in time (`io::ErrorKind::TimedOut`, as a RADOS
    /// device with an operation timeout reports): the same request again would most likely
    /// wait as long and fail the same way.
    pub fn is_timeout(&self) -> bool {
        matches!(self, Error::Io { source, .. } if source.kind() == io::ErrorKind::TimedOut)
    }

    /// The POSIX errno a block frontend should report for this error.
    pub fn errno(&self) -> i32 {
        match self {
            Error::Io { .. } | Error::Corruption(_) | Error::Internal { .. } | Error::Failed(_) => libc::EIO,
            Error::NoSpace(_) => libc::ENOSPC,
            Error::OutOfRange { .. } | Error::InvalidArgument(_) => libc::EINVAL,
            Error::ReadOnly => libc::EROFS,
            Error::InUse(_) => libc::EBUSY,
            Error::NotAVolume(_) | Error::AlreadyFormatted(_) => libc::EINVAL,
            Error::DataDevice { .. } => libc::ENODEV,
            Error::OutOfMemory(_) => libc::ENOMEM,
        }
    }
}
