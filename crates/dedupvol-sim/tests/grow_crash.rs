//! Crashes in the middle of a grow: at every I/O call of `resize_closed` in turn, the
//! machine loses power (unsynced writes dropped, kept ones torn and reordered). The
//! volume must then open with either the old geometry or the new one, every flushed
//! block reading back exactly and the audit clean; a grow run again completes.
//!
//! Each case grows the logical size beyond the block map's room (the chapter ring gives
//! way) and the data device beyond the reference counts' room (their pages are copied to
//! a new place before the superblock switches), with metadata on the data device or on a
//! separate one.

use dedupvol_core::{check_volume, resize_closed, FormatOptions, OpenOptions, Problem, Storage, Volume};
use dedupvol_sim::{FaultConfig, SimDisk, SimMachine};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

const B: u64 = 4096;
const SMALL: u64 = 12 << 20;
const LARGE: u64 = 24 << 20;
const LOGICAL: u64 = 4 << 20;
const LOGICAL_GROWN: u64 = 16 << 20;

/// A disk whose visible size can be raised, as a file that is extended.
struct Window {
    disk: Arc<SimDisk>,
    len: AtomicU64,
}

impl Storage for Window {
    fn read_at(&self, buf: &mut [u8], offset: u64) -> std::io::Result<()> {
        if offset + buf.len() as u64 > self.len() {
            return Err(std::io::Error::new(std::io::ErrorKind::UnexpectedEof, "beyond the end"));
        }
        self.disk.read_at(buf, offset)
    }
    fn write_at(&self, buf: &[u8], offset: u64) -> std::io::Result<()> {
        if offset + buf.len() as u64 > self.len() {
            return Err(std::io::Error::new(std::io::ErrorKind::UnexpectedEof, "beyond the end"));
        }
        self.disk.write_at(buf, offset)
    }
    fn sync(&self) -> std::io::Result<()> {
        self.disk.sync()
    }
    fn len(&self) -> u64 {
        self.len.load(Ordering::Relaxed)
    }
}

fn content(lba: u64, version: u64) -> Vec<u8> {
    let mut x = (lba * 0x9E37_79B9 + version * 7919) | 1;
    (0..B)
        .map(|i| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            if i % 4 == 0 {
                x as u8
            } else {
                b"grow"[(i % 4) as usize]
            }
        })
        .collect()
}

struct Case {
    machine: Arc<SimMachine>,
    data: Arc<Window>,
    meta: Option<Arc<SimDisk>>,
}

impl Case {
    fn new(seed: u64, separate_meta: bool) -> Case {
        let cfg = FaultConfig { crash_loss: true, torn_writes: true, ..FaultConfig::none() };
        let machine = SimMachine::new(seed, cfg);
        let disk = machine.add_disk("data", LARGE);
        let meta = separate_meta.then(|| machine.add_disk("meta", 4 << 20));
        let data = Arc::new(Window { disk, len: AtomicU64::new(SMALL) });
        Case { machine, data, meta }
    }
    fn devices(&self) -> (Arc<dyn Storage>, Option<Arc<dyn Storage>>) {
        (self.data.clone(), self.meta.clone().map(|m| m as Arc<dyn Storage>))
    }
    fn open(&self) -> Volume {
        let (d, m) = self.devices();
        Volume::open(d, m, &OpenOptions::default()).expect("open after the crash")
    }
}

impl Case {
    /// Formats the case's devices with growth room up to `max_logical` and `max_physical`
    /// bytes, opens the volume and writes every block of `lbas()` once.
    fn format_and_fill(&self, max_logical: u64, max_physical: u64) -> Volume {
        let (d, m) = self.devices();
        let opts = FormatOptions {
            logical_size_bytes: LOGICAL,
            max_logical_size_bytes: Some(max_logical),
            max_physical_size_bytes: Some(max_physical),
            slab_size_bytes: 1 << 20,
            journal_size_bytes: Some(256 << 10),
            index_memory_bytes: 256 << 10,
            ..FormatOptions::default()
        };
        Volume::format(d, m, &opts, false).expect("format");
        let v = self.open();
        for l in lbas() {
            v.write(l * B, &content(l, l % 5), false).expect("write");
        }
        v
    }
}

fn lbas() -> impl Iterator<Item = u64> {
    (0..LOGICAL / B).step_by(3)
}

/// Every flushed block reads back exactly; the audit is clean; the geometry is the old
/// one or the new one, never a mix. Returns true for the new one.
fn verify(case: &Case, seed: u64) -> bool {
    let (d, m) = case.devices();
    let report = check_volume(d, m, false).unwrap_or_else(|e| panic!("seed {seed}: check: {e}"));
    // A superblock copy torn by the crash is the normal residue of an interrupted write
    // (the other copy is used; `check --repair` rewrites it); anything else is a failure.
    let problems: Vec<_> = report.problems.iter().filter(|p| !matches!(p, Problem::Open { .. })).collect();
    assert!(problems.is_empty() && report.problems_not_listed == 0, "seed {seed}: {problems:?}");
    let v = case.open();
    let (logical, data_blocks) = (v.logical_size(), v.stats().data_blocks_total);
    let grown = logical == LOGICAL_GROWN;
    assert!(grown || logical == LOGICAL, "seed {seed}: logical size {logical}");
    let g = v.geometry();
    assert_eq!(g.data_dev_blocks * B, if grown { LARGE } else { SMALL }, "seed {seed}: half a grow: {g:?}");
    assert_eq!(data_blocks, g.data_blocks);
    let mut buf = vec![0u8; B as usize];
    for l in lbas() {
        v.read(l * B, &mut buf).unwrap_or_else(|e| panic!("seed {seed}: block {l}: {e}"));
        assert!(buf == content(l, l % 5), "seed {seed}: block {l} changed");
    }
    v.close().expect("close");
    grown
}

fn crash_in_grow(separate_meta: bool) {
    let mut crashed_at = Vec::new();
    for k in 0.. {
        let seed = k + if separate_meta { 1 << 20 } else { 0 };
        let case = Case::new(seed, separate_meta);
        let (d, m) = case.devices();
        let v = case.format_and_fill(LOGICAL, SMALL);
        v.close().expect("close");
        case.data.len.store(LARGE, Ordering::Relaxed);
        case.machine.set_faults_enabled(true);
        case.machine.arm_crash(k);
        let r = resize_closed(d.clone(), m.clone(), Some(LOGICAL_GROWN), Some(LARGE), &OpenOptions::default());
        if !case.machine.is_crashed() {
            case.machine.disarm_crash();
            case.machine.set_faults_enabled(false);
            let r = r.unwrap_or_else(|e| panic!("seed {seed}: grow without a crash: {e}"));
            assert_eq!(r.moved, vec!["reference counts".to_string()], "seed {seed}: only the counts move: {r:?}");
            assert!(verify(&case, seed), "seed {seed}: the grow completed");
            break;
        }
        case.machine.power_cycle(true);
        case.machine.set_faults_enabled(false);
        crashed_at.push(k);
        if !verify(&case, seed) {
            resize_closed(d, m, Some(LOGICAL_GROWN), Some(LARGE), &OpenOptions::default())
                .unwrap_or_else(|e| panic!("seed {seed}: grow again after the crash: {e}"));
            assert!(verify(&case, seed), "seed {seed}: the grow run again completed");
        }
        assert!(k < 10_000, "the grow never completed");
    }
    assert!(crashed_at.len() > 20, "crashed at {} I/O calls only", crashed_at.len());
}

#[test]
fn a_crash_anywhere_in_a_grow_leaves_the_old_or_the_new_geometry() {
    crash_in_grow(false);
}

#[test]
fn a_crash_anywhere_in_a_grow_with_a_metadata_device_leaves_the_old_or_the_new_geometry() {
    crash_in_grow(true);
}

/// The same for a grow of an open volume (`Volume::grow`, as a server does): writes go on
/// in the new space right after it, flushed; a crash at any I/O call from the grow on
/// leaves the old geometry (nothing written in the new space was acknowledged as
/// durable) or the new one with every flushed block.
#[test]
fn a_crash_anywhere_in_an_online_grow_leaves_the_old_or_the_new_geometry() {
    for separate_meta in [false, true] {
        let mut crashes = 0;
        for k in 0.. {
            let seed = k + if separate_meta { 1 << 21 } else { 1 << 22 };
            let case = Case::new(seed, separate_meta);
            let v = case.format_and_fill(LOGICAL_GROWN, LARGE);
            v.flush().expect("flush");
            case.data.len.store(LARGE, Ordering::Relaxed);
            case.machine.set_faults_enabled(true);
            case.machine.arm_crash(k);
            let grown = v.grow(Some(LOGICAL_GROWN), Some(LARGE));
            // New space used at once: past the old logical end, and new slabs.
            let mut acked = Vec::new();
            if grown.is_ok() {
                for round in 0..3u64 {
                    let batch: Vec<u64> = (0..5).map(|i| LOGICAL / B + 7 * (5 * round + i)).collect();
                    if batch.iter().any(|&l| v.write(l * B, &content(l, 9), false).is_err()) || v.flush().is_err() {
                        break;
                    }
                    acked.extend(batch);
                }
            }
            if !case.machine.is_crashed() {
                case.machine.disarm_crash();
                case.machine.set_faults_enabled(false);
                grown.unwrap_or_else(|e| panic!("seed {seed}: grow without a crash: {e}"));
                v.close().expect("close");
                assert!(verify(&case, seed), "seed {seed}: the grow completed");
                break;
            }
            drop(v);
            case.machine.power_cycle(true);
            case.machine.set_faults_enabled(false);
            crashes += 1;
            let new = verify(&case, seed);
            assert!(new || acked.is_empty(), "seed {seed}: writes in the new space were acknowledged durable");
            if new {
                let v = case.open();
                let mut buf = vec![0u8; B as usize];
                for &l in &acked {
                    v.read(l * B, &mut buf).unwrap_or_else(|e| panic!("seed {seed}: new block {l}: {e}"));
                    assert!(buf == content(l, 9), "seed {seed}: new block {l}");
                }
                v.close().expect("close");
            }
            assert!(k < 10_000, "the grow never completed");
        }
        assert!(crashes > 5, "crashed at {crashes} I/O calls only");
    }
}
