//! dedupvol-sim: a deterministic crash and fault simulator for the dedupvol engine, in the
//! manner of TigerBeetle's VOPR and FoundationDB's simulation.
//!
//! One seed drives everything: a simulated machine whose disks ([`disk::SimDisk`]) have a
//! volatile write cache, tear and lose unsynced writes at power failure, and inject lost,
//! misdirected and bit-flipped data writes and transient read errors; a workload of several
//! logical writers ([`driver`]) that writes duplicate-heavy, compressible, unique and zero
//! data, overwrites, discards, writes zeroes, flushes and issues FUA writes; crashes at random
//! I/O calls, including inside recovery; and a checker ([`model::Model`]) that knows, for
//! every logical block, which contents the durability contract (docs/design.md) allows.
//! `docs/simulator.md` states the fault model.
//!
//! Invariants:
//! - Same seed and options ⇒ same run (the machine's trace hash of every I/O call is equal),
//!   provided the engine itself is deterministic.
//! - A failure always carries its seed and a one-line replay command.

pub mod content;
pub mod disk;
pub mod driver;
pub mod engine;
pub mod kill9;
pub mod model;
pub mod striped;
pub mod toy;

pub use disk::{FaultConfig, FaultCounts, SimDisk, SimMachine};
pub use driver::{replay_command, run_seed, Failure, FaultKinds, RunConfig, RunStats, SimOptions};
pub use engine::SimEngine;
pub use striped::StripedVolume;
pub use toy::{set_toy_bug, ToyBug, ToyVolume};
