//! Where a physical block lives: the placement layer between physical block numbers and
//! devices. Every data access goes through `DataDevice`, which turns a pbn into
//! (device, byte offset); a fast tier, a second device or a stripe plugs in here.
//!
//! Invariants:
//! - A pbn outside `0..data_blocks` is never turned into an offset: the request is refused
//!   with `Error::Corruption` naming the structure that pointed there (a map entry or an
//!   index entry read from disk), so a damaged pointer cannot reach the superblock,
//!   the journal or another device's bytes.
//! - A run of blocks is contiguous on one device: a request never spans two devices. (A
//!   striped volume's device is one `StripedStorage`, which splits a request crossing a
//!   stripe unit below this layer.)

use crate::config::BLOCK_SIZE_U64;
use crate::error::{Error, Result};
use crate::io::{Dev, IoKind};
use crate::metadata::layout::Geometry;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

/// The data region: one device today, addressed by pbn.
#[derive(Clone)]
pub(crate) struct DataDevice {
    dev: Dev,
    /// First block of the data region on `dev`.
    start: u64,
    /// Physical blocks in the data region (shared by every clone; only grows).
    blocks: Arc<AtomicU64>,
}

impl DataDevice {
    pub(crate) fn new(dev: Dev, geo: &Geometry) -> Self {
        DataDevice { dev, start: geo.data_start, blocks: Arc::new(AtomicU64::new(geo.data_blocks)) }
    }

    /// Physical blocks in the data region now.
    pub(crate) fn blocks(&self) -> u64 {
        self.blocks.load(Ordering::Acquire)
    }

    /// A grow: the data region now holds `blocks` blocks (never fewer).
    pub(crate) fn grow(&self, blocks: u64) {
        let before = self.blocks.fetch_max(blocks, Ordering::AcqRel);
        assert!(before <= blocks, "the data region never shrinks ({before} -> {blocks})");
    }

    /// Byte offset of the run `pbn..pbn + n` on its device, after checking that the
    /// whole run lies in the data region.
    fn locate(&self, pbn: u64, n: u64, what: &'static str) -> Result<u64> {
        let blocks = self.blocks();
        match pbn.checked_add(n) {
            Some(end) if end <= blocks => Ok((self.start + pbn) * BLOCK_SIZE_U64),
            _ => Err(Error::corruption(
                what,
                pbn,
                format!("a physical block below {blocks}"),
                format!("blocks {pbn}..{}", pbn.saturating_add(n)),
            )),
        }
    }

    /// True when `pbn` is a data block.
    pub(crate) fn contains(&self, pbn: u64) -> bool {
        pbn < self.blocks()
    }

    /// Reads whole blocks starting at `pbn` into `buf` (a multiple of the block size).
    pub(crate) fn read(&self, kind: IoKind, pbn: u64, buf: &mut [u8], what: &'static str) -> Result<()> {
        let off = self.locate(pbn, buf.len() as u64 / BLOCK_SIZE_U64, what)?;
        self.dev.read(kind, buf, off)
    }

    /// Reads whole blocks like `read`, through the page cache where the device keeps one
    /// for reads (`IoMode::ReadCached`). A block read this way that fails its checksum is
    /// dropped from the page cache (`drop_cached`) and re-read with `read`.
    pub(crate) fn read_cached(&self, kind: IoKind, pbn: u64, buf: &mut [u8], what: &'static str) -> Result<()> {
        let off = self.locate(pbn, buf.len() as u64 / BLOCK_SIZE_U64, what)?;
        self.dev.read_cached(kind, buf, off)
    }

    /// True when `read_cached` goes through the page cache.
    pub(crate) fn reads_cached(&self) -> bool {
        self.dev.reads_cached()
    }

    /// Drops the page cache's copy of `n` blocks from `pbn` (a hint).
    pub(crate) fn drop_cached(&self, pbn: u64, n: u64) {
        if let Ok(off) = self.locate(pbn, n, "data block placement") {
            self.dev.drop_cached(off, n * BLOCK_SIZE_U64);
        }
    }

    /// Writes consecutive blocks starting at `pbn`, gathered from `bufs`.
    pub(crate) fn write_run(&self, pbn: u64, bufs: &[&[u8]]) -> Result<()> {
        let len: u64 = bufs.iter().map(|b| b.len() as u64).sum();
        let off = self.locate(pbn, len / BLOCK_SIZE_U64, "data block placement")?;
        match bufs {
            [one] => self.dev.write(IoKind::Data, one, off),
            _ => self.dev.write_vectored(IoKind::Data, bufs, off),
        }
    }

    /// Starts writeback of a run just written (a hint; errors surface at `sync`).
    pub(crate) fn start_writeback(&self, pbn: u64, n: u64) {
        if let Ok(off) = self.locate(pbn, n, "data block placement") {
            self.dev.start_writeback(off, n * BLOCK_SIZE_U64);
        }
    }

    /// Makes every completed data write durable.
    pub(crate) fn sync(&self) -> Result<()> {
        self.dev.sync()
    }

    /// The device under the data region (superblock copies live on it too).
    pub(crate) fn dev(&self) -> &Dev {
        &self.dev
    }
}
