//! dedupvol-workload: workload generation, reduction estimation and benchmarks.
//!
//! - [`content`]: deterministic 4 KiB blocks with a target duplicate fraction (spread over a
//!   working set), LZ4-calibrated compressibility and zero blocks;
//! - [`workload`]: access patterns and the papers' presets (write-low … sql, vdi), and the
//!   I/O stream a benchmark replays;
//! - [`estimate`]: the exact zero/dedup/compression estimate of files or devices, modelling
//!   the engine's fragment packing;
//! - [`model`]: the sizing model (throughput bound and cost of a server from per-core rates);
//! - [`primitives`]: the machine's limits (BLAKE3, LZ4, zstd, disk), measured in the run;
//! - [`bench`]: the in-process engine benchmark with its no-reduction baselines;
//! - [`trace`]: the FIU block trace format (streaming parser);
//! - [`trace_gen`]: FIU-format traces with the FIU traces' reference skew;
//! - [`trace_stats`]: the reference-skew statistics of a trace;
//! - [`table`]: text tables.
//!
//! Invariants (the crate's contract with benchmark readers):
//! - Every figure printed is measured in the same run; nothing is hard-coded.
//! - Every printout names its data: dedup %, compressibility, block size, pattern, seed.

pub mod bench;
pub mod content;
pub mod estimate;
pub mod model;
pub mod primitives;
pub mod rng;
pub mod table;
pub mod trace;
pub mod trace_gen;
pub mod trace_stats;
pub mod workload;

pub use content::{Content, ContentModel, DataSpec, BLOCK_BYTES};
pub use estimate::{EstimateOptions, EstimateReport, Estimator, PolicyFigure};
pub use workload::{IoKind, IoOp, IoStream, SizeMix, Workload, PRESET_NAMES};
