//! The real engine on a striped volume: the simulated data disk is cut into equal parts,
//! one per data device (the first part is the volume's first device, with the superblocks
//! and, without a metadata disk, the metadata), and the volume stripes its data region
//! over them. Crashes, torn and lost unsynced writes, destaging, transient read and write
//! errors and superblock copy damage then hit the striped layout: the translation, the
//! split of requests at unit boundaries, the member headers checked at every reopen.
//!
//! What it does not model: devices that fail independently. The parts share one disk's
//! cache, so a sync of one part makes every part durable (a striped sync syncs every
//! device anyway; only a crash between two devices' syncs is milder here). Persistent
//! data faults (lost, misdirected, bit-flipped writes) are not injected: the driver maps
//! a damaged block to a pbn as `data_start + pbn`, which a stripe does not follow, so
//! `data_region` reports none and the driver injects no data faults.
//!
//! Invariants:
//! - A part never reaches outside its own byte range of the disk (checked per access).

use crate::engine::{Coverage, SimEngine};
use dedupvol_core::{CheckReport, FormatOptions, OpenOptions, Problem, Result, Storage, Volume};
use std::io;
use std::ops::Range;
use std::sync::Arc;

/// Bytes of the disk per part at least: the first part holds the metadata and one 1 MiB
/// stripe unit, the others one unit after their header.
const PART_BYTES_MIN: u64 = 4 << 20;
/// Data devices at most.
const PARTS_MAX: u64 = 4;

/// A byte range of a disk, as a device.
struct Part {
    disk: Arc<dyn Storage>,
    start: u64,
    len: u64,
    index: usize,
}

impl Part {
    fn at(&self, offset: u64, len: usize) -> io::Result<u64> {
        match offset.checked_add(len as u64) {
            Some(end) if end <= self.len => Ok(self.start + offset),
            _ => Err(io::Error::new(
                io::ErrorKind::UnexpectedEof,
                format!("part {}: access at {offset}+{len} beyond its {} bytes", self.index, self.len),
            )),
        }
    }
}

impl Storage for Part {
    fn read_at(&self, buf: &mut [u8], offset: u64) -> io::Result<()> {
        let at = self.at(offset, buf.len())?;
        self.disk.read_at(buf, at)
    }
    fn write_at(&self, buf: &[u8], offset: u64) -> io::Result<()> {
        let at = self.at(offset, buf.len())?;
        self.disk.write_at(buf, at)
    }
    fn sync(&self) -> io::Result<()> {
        self.disk.sync()
    }
    fn len(&self) -> u64 {
        self.len
    }
    fn name(&self) -> String {
        format!("{} part {}", self.disk.name(), self.index)
    }
}

/// The disk cut into 2 to 4 equal parts of at least `PART_BYTES_MIN`, in 4 KiB blocks.
fn parts(disk: &Arc<dyn Storage>) -> Vec<Arc<dyn Storage>> {
    let n = (disk.len() / PART_BYTES_MIN).clamp(2, PARTS_MAX);
    let each = disk.len() / n / 4096 * 4096;
    (0..n)
        .map(|i| {
            Arc::new(Part { disk: disk.clone(), start: i * each, len: each, index: i as usize }) as Arc<dyn Storage>
        })
        .collect()
}

fn stripe(data: &Arc<dyn Storage>) -> Result<Arc<dyn Storage>> {
    let mut p = parts(data);
    let first = p.remove(0);
    Volume::stripe_devices(first, p)
}

/// A volume striped over parts of the simulated data disk.
pub struct StripedVolume(Volume);

impl SimEngine for StripedVolume {
    const NAME: &'static str = "dedupvol-striped";
    fn format(data: Arc<dyn Storage>, meta: Option<Arc<dyn Storage>>, opts: &FormatOptions) -> Result<()> {
        let mut p = parts(&data);
        let first = p.remove(0);
        let extra = p.into_iter().enumerate().map(|(i, d)| (d, format!("sim-data-part{}", i + 1))).collect();
        Volume::format_striped(first, extra, meta, opts, false)
    }
    fn open(data: Arc<dyn Storage>, meta: Option<Arc<dyn Storage>>, opts: &OpenOptions) -> Result<Self> {
        Volume::open(stripe(&data)?, meta, opts).map(StripedVolume)
    }
    const EXTENT_CAPS: bool = true;
    fn set_extent_blocks_max(&self, blocks: u8) -> Result<u8> {
        self.0.set_extent_blocks_max(blocks)
    }
    fn extent_blocks_max(&self) -> u8 {
        self.0.extent_max()
    }
    fn read(&self, offset: u64, buf: &mut [u8]) -> Result<()> {
        self.0.read(offset, buf)
    }
    fn write(&self, offset: u64, data: &[u8], fua: bool) -> Result<()> {
        self.0.write(offset, data, fua)
    }
    fn write_many(&self, reqs: &[(u64, &[u8])], fua: bool) -> Result<()> {
        self.0.write_many(reqs, fua)
    }
    fn flush(&self) -> Result<()> {
        self.0.flush()
    }
    fn discard(&self, offset: u64, len: u64) -> Result<()> {
        self.0.discard(offset, len)
    }
    fn write_zeroes(&self, offset: u64, len: u64, fua: bool) -> Result<()> {
        self.0.write_zeroes(offset, len, fua)
    }
    fn close(self) -> Result<()> {
        self.0.close()
    }
    fn audit(&self) -> std::result::Result<(), String> {
        <Volume as SimEngine>::audit(&self.0)
    }
    fn coverage(&self) -> Coverage {
        <Volume as SimEngine>::coverage(&self.0)
    }
    fn background_step(&self) -> bool {
        <Volume as SimEngine>::background_step(&self.0)
    }
    fn clean(&self, budget_bytes: u64, live_max: u32) -> Result<u64> {
        <Volume as SimEngine>::clean(&self.0, budget_bytes, live_max)
    }
    fn recompress(&self, budget_bytes: u64) -> Result<u64> {
        <Volume as SimEngine>::recompress(&self.0, budget_bytes)
    }
    fn dictionary(&self) -> Option<u32> {
        <Volume as SimEngine>::dictionary(&self.0)
    }
    const REST_LEVELS: bool = true;
    fn set_rest_level(&self, level: i8) -> Result<i8> {
        self.0.set_rest_level(level)
    }
    fn rest_level(&self) -> i8 {
        self.0.rest_level()
    }
    fn check(data: Arc<dyn Storage>, meta: Option<Arc<dyn Storage>>) -> Result<CheckReport> {
        dedupvol_core::check_volume(stripe(&data)?, meta, false)
    }
    fn data_region(_data: &dyn Storage, _has_meta: bool) -> Option<Range<u64>> {
        None
    }
    fn corruptible_superblock_copy(copies: [&[u8]; 2], role: u8) -> Option<usize> {
        <Volume as SimEngine>::corruptible_superblock_copy(copies, role)
    }
    fn corrupt_data_block(_problem: &Problem) -> Option<Range<u64>> {
        None
    }
}
