//! A toy log-structured volume used to prove the simulator itself: a correct variant must
//! pass every seed, and each deliberately broken variant must be caught.
//!
//! Layout (4 KiB blocks, one device): `[0] [1]` superblock copies (epoch, crc32c);
//! `[2, 2+n)` record headers; `[2+n, 2+2n)` data blocks. Record `p`'s header names its
//! logical block, its kind (zero/data), the data's crc32c and the epoch that wrote it.
//!
//! Invariants (correct variant):
//! - Records are appended; a header is written only after its data block is synced, and
//!   only at a flush (or FUA / sync policy), so a durable header never points at lost data.
//! - Recovery accepts headers `0..k` with valid checksums, positions and non-decreasing
//!   epochs below the new epoch, and stops at the first other one; stale headers of an
//!   older epoch past a gap can therefore never be replayed.
//! - The new epoch is made durable (superblock slot `epoch % 2`) before any new record.

use crate::engine::SimEngine;
use dedupvol_core::{CheckReport, Error, FormatOptions, OpenOptions, Result, Storage, WritePolicy};
use parking_lot::Mutex;
use std::collections::HashMap;
use std::ops::Range;
use std::sync::Arc;

const B: u64 = 4096;
const SB_MAGIC: &[u8; 8] = b"TOYVOLSB";
const REC_MAGIC: &[u8; 8] = b"TOYVOLRC";
/// Record headers read per I/O during recovery.
const SCAN_HEADERS_PER_IO: u64 = 64;

/// Deliberate bugs the simulator must catch.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ToyBug {
    /// Correct engine.
    None,
    /// Flush does not call `sync` (nothing is ever durable on purpose).
    FlushWithoutSync,
    /// Headers are written with the data, before the data is synced.
    HeaderBeforeDataSync,
    /// Reads do not check the data checksum (corruption returned as data).
    NoReadChecksum,
}

static TOY_BUG: Mutex<ToyBug> = Mutex::new(ToyBug::None);

/// Selects the bug of toy volumes opened from now on (tests run one seed at a time).
pub fn set_toy_bug(b: ToyBug) {
    *TOY_BUG.lock() = b;
}

#[derive(Clone, Copy)]
struct Rec {
    pos: u64,
    data: bool,
    crc: u32,
}

struct Inner {
    map: HashMap<u64, Rec>,
    next_pos: u64,
    epoch: u64,
    unsaved: Vec<(u64, Vec<u8>)>,
    failed: bool,
}

/// The toy volume.
pub struct ToyVolume {
    dev: Arc<dyn Storage>,
    n: u64,
    logical_blocks: u64,
    policy: WritePolicy,
    read_only: bool,
    bug: ToyBug,
    inner: Mutex<Inner>,
}

fn io(ctx: &str, e: std::io::Error) -> Error {
    Error::io(ctx.to_string(), e)
}

fn records(dev: &dyn Storage) -> u64 {
    (dev.len() / B - 2) / 2
}

fn sb_block(epoch: u64, logical_blocks: u64, sync: bool) -> Vec<u8> {
    let mut b = vec![0u8; B as usize];
    b[..8].copy_from_slice(SB_MAGIC);
    b[12..20].copy_from_slice(&epoch.to_le_bytes());
    b[20..28].copy_from_slice(&logical_blocks.to_le_bytes());
    b[28] = u8::from(sync);
    let c = crc32c::crc32c(&b[12..]);
    b[8..12].copy_from_slice(&c.to_le_bytes());
    b
}

fn header(epoch: u64, pos: u64, lba: u64, rec: Rec) -> Vec<u8> {
    let mut b = vec![0u8; B as usize];
    b[..8].copy_from_slice(REC_MAGIC);
    b[12..20].copy_from_slice(&epoch.to_le_bytes());
    b[20..28].copy_from_slice(&pos.to_le_bytes());
    b[28..36].copy_from_slice(&lba.to_le_bytes());
    b[36] = u8::from(rec.data);
    b[37..41].copy_from_slice(&rec.crc.to_le_bytes());
    let c = crc32c::crc32c(&b[12..]);
    b[8..12].copy_from_slice(&c.to_le_bytes());
    b
}

fn u64_at(b: &[u8], o: usize) -> u64 {
    let mut x = [0u8; 8];
    x.copy_from_slice(&b[o..o + 8]);
    u64::from_le_bytes(x)
}

fn u32_at(b: &[u8], o: usize) -> u32 {
    let mut x = [0u8; 4];
    x.copy_from_slice(&b[o..o + 4]);
    u32::from_le_bytes(x)
}

fn valid(b: &[u8], magic: &[u8; 8]) -> bool {
    &b[..8] == magic && u32_at(b, 8) == crc32c::crc32c(&b[12..])
}

impl ToyVolume {
    fn data_off(&self, pos: u64) -> u64 {
        (2 + self.n + pos) * B
    }

    fn flush_locked(&self, inner: &mut Inner) -> Result<()> {
        if self.bug != ToyBug::FlushWithoutSync {
            self.dev.sync().map_err(|e| io("sync data", e))?;
        }
        for (pos, h) in std::mem::take(&mut inner.unsaved) {
            self.dev.write_at(&h, (2 + pos) * B).map_err(|e| io("write header", e))?;
        }
        if self.bug != ToyBug::FlushWithoutSync {
            self.dev.sync().map_err(|e| io("sync headers", e))?;
        }
        Ok(())
    }

    fn guard<T>(&self, f: impl FnOnce(&mut Inner) -> Result<T>) -> Result<T> {
        let mut inner = self.inner.lock();
        if inner.failed {
            return Err(Error::Failed("toy volume failed earlier".into()));
        }
        if self.read_only {
            return Err(Error::ReadOnly);
        }
        let r = f(&mut inner);
        // After an I/O error the in-memory state may be ahead of the device.
        if matches!(r, Err(Error::Io { .. } | Error::Corruption(_))) {
            inner.failed = true;
        }
        r
    }

    fn put(&self, inner: &mut Inner, lba: u64, data: Option<&[u8]>) -> Result<()> {
        let pos = inner.next_pos;
        if pos >= self.n {
            return Err(Error::NoSpace("toy log is full".into()));
        }
        inner.next_pos += 1;
        let rec = match data {
            Some(d) => {
                self.dev.write_at(d, self.data_off(pos)).map_err(|e| io("write data", e))?;
                Rec { pos, data: true, crc: crc32c::crc32c(d) }
            }
            None => Rec { pos, data: false, crc: 0 },
        };
        let h = header(inner.epoch, pos, lba, rec);
        if self.bug == ToyBug::HeaderBeforeDataSync {
            self.dev.write_at(&h, (2 + pos) * B).map_err(|e| io("write header", e))?;
        } else {
            inner.unsaved.push((pos, h));
        }
        inner.map.insert(lba, rec);
        Ok(())
    }

    fn zero_range(&self, offset: u64, len: u64, fua: bool) -> Result<()> {
        self.range_ok(offset, len)?;
        self.guard(|inner| {
            for lba in offset / B..(offset + len) / B {
                self.put(inner, lba, None)?;
            }
            if fua || self.policy == WritePolicy::Sync {
                self.flush_locked(inner)?;
            }
            Ok(())
        })
    }

    fn range_ok(&self, offset: u64, len: u64) -> Result<()> {
        let size = self.logical_blocks * B;
        if !offset.is_multiple_of(B) || !len.is_multiple_of(B) || offset + len > size {
            return Err(Error::OutOfRange { offset, len, size });
        }
        Ok(())
    }
}

impl SimEngine for ToyVolume {
    const NAME: &'static str = "toy";

    fn format(data: Arc<dyn Storage>, _meta: Option<Arc<dyn Storage>>, opts: &FormatOptions) -> Result<()> {
        let sync = opts.write_policy == WritePolicy::Sync;
        let lb = opts.logical_size_bytes / B;
        data.write_at(&vec![0u8; B as usize], 2 * B).map_err(|e| io("format", e))?;
        data.write_at(&sb_block(1, lb, sync), 0).map_err(|e| io("format", e))?;
        data.write_at(&sb_block(0, lb, sync), B).map_err(|e| io("format", e))?;
        data.sync().map_err(|e| io("format", e))
    }

    fn open(data: Arc<dyn Storage>, _meta: Option<Arc<dyn Storage>>, opts: &OpenOptions) -> Result<Self> {
        let mut best: Option<(u64, u64, bool)> = None;
        let mut b = vec![0u8; B as usize];
        for slot in 0..2 {
            data.read_at(&mut b, slot * B).map_err(|e| io("read superblock", e))?;
            if valid(&b, SB_MAGIC) {
                let e = u64_at(&b, 12);
                if best.is_none_or(|x| e > x.0) {
                    best = Some((e, u64_at(&b, 20), b[28] == 1));
                }
            }
        }
        let (epoch, logical_blocks, sync) = best.ok_or_else(|| Error::NotAVolume("no valid toy superblock".into()))?;
        let n = records(&*data);
        let policy = opts.write_policy.unwrap_or(if sync { WritePolicy::Sync } else { WritePolicy::Async });
        let vol = ToyVolume {
            dev: Arc::clone(&data),
            n,
            logical_blocks,
            policy,
            read_only: opts.read_only,
            bug: *TOY_BUG.lock(),
            inner: Mutex::new(Inner {
                map: HashMap::new(),
                next_pos: 0,
                epoch: epoch + 1,
                unsaved: Vec::new(),
                failed: false,
            }),
        };
        let mut last_epoch = 0;
        let mut pos = 0;
        {
            let mut inner = vol.inner.lock();
            // Headers are read 64 at a time: a scan of thousands of single-block reads would
            // almost never get through the simulator's transient read errors.
            let mut chunk = vec![0u8; (SCAN_HEADERS_PER_IO * B) as usize];
            'scan: while pos < n {
                let take = (n - pos).min(SCAN_HEADERS_PER_IO);
                let bytes = &mut chunk[..(take * B) as usize];
                data.read_at(bytes, (2 + pos) * B).map_err(|e| io("read headers", e))?;
                for b in bytes.chunks_exact(B as usize) {
                    let e = u64_at(b, 12);
                    if !valid(b, REC_MAGIC) || u64_at(b, 20) != pos || e > epoch || e < last_epoch {
                        break 'scan;
                    }
                    last_epoch = e;
                    inner.map.insert(u64_at(b, 28), Rec { pos, data: b[36] == 1, crc: u32_at(b, 37) });
                    pos += 1;
                }
            }
            inner.next_pos = pos;
        }
        if opts.read_only {
            return Ok(vol);
        }
        let new_epoch = epoch + 1;
        data.write_at(&sb_block(new_epoch, logical_blocks, sync), (new_epoch % 2) * B)
            .map_err(|e| io("write superblock", e))?;
        data.sync().map_err(|e| io("sync superblock", e))?;
        Ok(vol)
    }

    fn read(&self, offset: u64, buf: &mut [u8]) -> Result<()> {
        self.range_ok(offset, buf.len() as u64)?;
        let inner = self.inner.lock();
        for (i, chunk) in buf.chunks_mut(B as usize).enumerate() {
            let lba = offset / B + i as u64;
            match inner.map.get(&lba) {
                Some(r) if r.data => {
                    self.dev.read_at(chunk, self.data_off(r.pos)).map_err(|e| io("read data", e))?;
                    if self.bug != ToyBug::NoReadChecksum && crc32c::crc32c(chunk) != r.crc {
                        return Err(Error::corruption(
                            "toy logical block",
                            lba,
                            format!("checksum {:#010x}", r.crc),
                            format!("record {} fails its checksum", r.pos),
                        ));
                    }
                }
                _ => chunk.fill(0),
            }
        }
        Ok(())
    }

    fn write(&self, offset: u64, data: &[u8], fua: bool) -> Result<()> {
        let size = self.logical_blocks * B;
        let len = data.len() as u64;
        if !offset.is_multiple_of(512) || !len.is_multiple_of(512) || offset + len > size {
            return Err(Error::OutOfRange { offset, len, size });
        }
        self.guard(|inner| {
            let mut pos = offset;
            let mut block = vec![0u8; B as usize];
            while pos < offset + len {
                let lba = pos / B;
                let within = (pos % B) as usize;
                let take = ((offset + len - pos) as usize).min(B as usize - within);
                // Read-modify-write of a partially covered block.
                match inner.map.get(&lba) {
                    Some(r) if r.data && take < B as usize => {
                        self.dev.read_at(&mut block, self.data_off(r.pos)).map_err(|e| io("read for rmw", e))?;
                        if crc32c::crc32c(&block) != r.crc {
                            return Err(Error::corruption(
                                "toy logical block",
                                lba,
                                format!("checksum {:#010x}", r.crc),
                                format!("record {} fails its checksum", r.pos),
                            ));
                        }
                    }
                    _ => block.fill(0),
                }
                let at = (pos - offset) as usize;
                block[within..within + take].copy_from_slice(&data[at..at + take]);
                let zero = block.iter().all(|&x| x == 0);
                let copy = block.clone();
                self.put(inner, lba, if zero { None } else { Some(&copy) })?;
                pos += take as u64;
            }
            if fua || self.policy == WritePolicy::Sync {
                self.flush_locked(inner)?;
            }
            Ok(())
        })
    }

    fn flush(&self) -> Result<()> {
        self.guard(|inner| self.flush_locked(inner))
    }

    fn discard(&self, offset: u64, len: u64) -> Result<()> {
        self.zero_range(offset, len, false)
    }

    fn write_zeroes(&self, offset: u64, len: u64, fua: bool) -> Result<()> {
        self.zero_range(offset, len, fua)
    }

    fn close(self) -> Result<()> {
        self.flush()
    }

    fn check(data: Arc<dyn Storage>, _meta: Option<Arc<dyn Storage>>) -> Result<CheckReport> {
        let mut b = vec![0u8; B as usize];
        let mut report = CheckReport::default();
        let mut any = false;
        for slot in 0..2 {
            data.read_at(&mut b, slot * B).map_err(|e| io("check superblock", e))?;
            any |= valid(&b, SB_MAGIC);
        }
        if !any {
            report.problems.push(dedupvol_core::Problem::Open { message: "no valid superblock copy".into() });
        }
        Ok(report)
    }

    fn data_region(data: &dyn Storage, _has_meta: bool) -> Option<Range<u64>> {
        let n = records(data);
        Some((2 + n) * B..(2 + 2 * n) * B)
    }
}
