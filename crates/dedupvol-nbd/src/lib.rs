//! dedupvol-nbd: an NBD (Network Block Device) server for dedupvol volumes.
//!
//! Written from the protocol specification (NetworkBlockDevice/nbd `doc/proto.md`). It
//! speaks the fixed-newstyle handshake (options GO, INFO, LIST, ABORT, STRUCTURED_REPLY,
//! LIST/SET_META_CONTEXT, STARTTLS and the EXPORT_NAME fallback; NO_ZEROES honoured), simple or
//! structured replies, and serves READ, WRITE (+FUA), FLUSH, TRIM, WRITE_ZEROES (+FUA,
//! NO_HOLE), BLOCK_STATUS (`base:allocation`) and DISC over TCP or a Unix-domain socket.
//!
//! Layout: [`proto`] holds the wire format as pure functions over byte slices (fuzzed);
//! [`connection`] runs one client (handshake, then a reader thread and a bounded worker
//! pool); [`server`] accepts clients and shuts down cleanly; [`backend`] is the disk
//! being served — a [`dedupvol_core::Volume`], or a RAM disk for tests; [`client`] is a
//! small synchronous client (the trace replayer's); [`block_status`] holds metadata
//! context negotiation and block status replies; [`metrics`] counts what the server does.
//!
//! One server serves one or more exports, chosen by name; each is backed by one volume
//! shared by every connection that selects it, which is what makes
//! `NBD_FLAG_CAN_MULTI_CONN` truthful (a flush on any connection covers the writes
//! completed on all of them). [`tls`] adds `NBD_OPT_STARTTLS` with rustls.

/// Logs a warning through `tracing` (the binary installs the subscriber that writes it,
/// with a timestamp and level, on stderr). Never panics: tracing's writer drops a line
/// it cannot write, so a server whose stderr is a pipe nobody reads any more keeps serving.
macro_rules! log {
    ($($t:tt)*) => {{
        tracing::warn!("{}", format_args!($($t)*));
    }};
}

pub mod backend;
pub mod block_status;
pub mod client;
pub mod connection;
pub mod metrics;
pub mod proto;
pub mod server;
pub mod stream;
pub mod tls;

pub use backend::{Backend, BackendError, ErrorKind, MemBackend};
pub use client::{ClientError, NbdClient, NbdUri};
pub use connection::{ConnectionLimits, Export, ExportConfig};
pub use metrics::{ServerMetrics, ServerMetricsSnapshot};
pub use server::{validate_exports, RunSummary, Server, ServerConfig, StopHandle, EXPORTS_MAX};
pub use stream::{ListenAddr, Listener};
pub use tls::{TlsFiles, TlsPolicy};
