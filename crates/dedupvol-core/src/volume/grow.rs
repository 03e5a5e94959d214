//! Growing (and shrinking) a volume: its logical size, and the data device under it.
//!
//! Two ways in:
//! - `Volume::grow`, on an open volume (a served one): the logical size grows into the
//!   room the block map region has, the data device into the room the refcount region
//!   has (`Geometry::grown_in_place`); nothing moves, no page is copied, and one
//!   superblock write makes the new geometry durable. Under the commit lock, the state
//!   lock and the superblock lock, so no write, commit or checkpoint sees half of it; the
//!   in-memory structures (block map bounds, reference counts, allocator, reuse stamps,
//!   the data region's bounds) grow after that write, and the size requests are checked
//!   against (`Volume::logical_size`) changes last: no client reaches a block, and no
//!   allocation hands out one, before the superblock names it.
//! - `resize_closed`, on a closed volume: it opens the volume (replaying its journal),
//!   refuses a logical shrink that would lose mapped blocks and unmaps blocks written
//!   with zeros beyond the new end, closes it cleanly, then changes the layout
//!   (`Geometry::plan_resize`): regions grow in place, or move (their pages copied to
//!   free blocks first), the fingerprint index's chapter ring moving or shrinking out of
//!   their way.
//!
//! Steps of `resize_closed` after the clean close (each step's writes are synced before
//! the next begins):
//! 1. copy each moving region's blocks to its new place (blocks the old geometry does not
//!    use, or uses only for the chapter ring, which is advisory);
//! 2. on a logical shrink, zero the journal (every entry is in the pages already: the
//!    volume is clean), so no entry for a block beyond the new end is ever replayed;
//! 3. write the superblock naming the new geometry: the metadata device's copies, then
//!    the data device's (`write_superblock`); the data device's superblock decides.
//!
//! Invariants:
//! - Until step 3 completes, the old geometry on the data device is whole: nothing it
//!   needs was written (a copy's destination never overlaps a source or the journal, and
//!   a page region only ever grows into blocks no copy of its pages was written to). A
//!   crash at any point opens with the old geometry or the new one, and loses nothing.
//! - A page count never decreases, and a logical shrink leaves only unmapped entries
//!   beyond the new end: growing again finds them unmapped.
//! - The data device never shrinks.

use super::lifecycle::{open_devices, write_superblock};
use super::Volume;
use crate::config::{OpenOptions, BLOCK_SIZE, BLOCK_SIZE_U64};
use crate::error::{Error, Result};
use crate::io::{IoCounters, IoKind, Storage};
use crate::metadata::layout::Geometry;
use serde::{Deserialize, Serialize};
use std::sync::atomic::Ordering;
use std::sync::Arc;

/// Blocks copied per request when a region moves (1 MiB).
const COPY_BLOCKS_PER_IO: u64 = 256;
/// Map entries looked at per hold of the state lock when a shrink checks what it drops.
const SHRINK_CHECK_BLOCKS_PER_LOCK: u64 = 16_384;

/// What a grow changed.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct GrowReport {
    /// Logical size before, in bytes.
    pub logical_size_before: u64,
    /// Logical size after, in bytes.
    pub logical_size_after: u64,
    /// Data device size recorded before, in bytes.
    pub physical_size_before: u64,
    /// Data device size recorded after, in bytes.
    pub physical_size_after: u64,
    /// Data region (slabs of data blocks) after, in blocks.
    pub data_blocks_after: u64,
    /// Largest logical size the block map has room for now without moving, in bytes
    /// (what a served volume can still grow to).
    pub logical_room_bytes: u64,
    /// Largest data device the reference counts have room for now without moving, in bytes.
    pub physical_room_bytes: u64,
    /// Metadata regions moved (their pages copied), by name.
    pub moved: Vec<String>,
    /// Blocks of the fingerprint index's chapter ring before and after (a ring that moved
    /// or shrank starts empty: duplicates of data stored before are found again once
    /// they are written again).
    pub index_blocks_before: u64,
    /// See `index_blocks_before`.
    pub index_blocks_after: u64,
    /// Blocks written with zeros beyond a shrunk logical end, unmapped by the shrink.
    pub zero_blocks_unmapped: u64,
    /// The volume was open (served) and took the new size at once.
    pub online: bool,
}

impl GrowReport {
    fn new(old: &Geometry, new: &Geometry, online: bool) -> Self {
        GrowReport {
            logical_size_before: old.logical_blocks * BLOCK_SIZE_U64,
            logical_size_after: new.logical_blocks * BLOCK_SIZE_U64,
            physical_size_before: old.data_dev_blocks * BLOCK_SIZE_U64,
            physical_size_after: new.data_dev_blocks * BLOCK_SIZE_U64,
            data_blocks_after: new.data_blocks,
            logical_room_bytes: new.max_logical_blocks() * BLOCK_SIZE_U64,
            physical_room_bytes: new.max_data_dev_blocks() * BLOCK_SIZE_U64,
            moved: Vec::new(),
            index_blocks_before: old.index_blocks,
            index_blocks_after: new.index_blocks,
            zero_blocks_unmapped: 0,
            online,
        }
    }
}

/// A size in bytes as blocks: a non-zero multiple of 4096.
fn blocks_of(what: &str, bytes: u64) -> Result<u64> {
    if bytes == 0 || !bytes.is_multiple_of(BLOCK_SIZE_U64) {
        return Err(Error::InvalidArgument(format!("{what} {bytes} must be a non-zero multiple of 4096")));
    }
    Ok(bytes / BLOCK_SIZE_U64)
}

impl Volume {
    /// Grows the open volume's logical size to `logical_size` bytes, into the room its
    /// block map has (see `GrowReport::logical_room_bytes`), and its data device to
    /// `physical_size` bytes (the device must hold them already: a file extended by the
    /// caller), into the room its reference counts have: the new slabs are allocatable at
    /// once. New NBD connections see the new size (`logical_size`). A shrink, or a size
    /// beyond the room, is refused here: those need `resize_closed`.
    pub fn grow(&self, logical_size: Option<u64>, physical_size: Option<u64>) -> Result<GrowReport> {
        self.check_writable()?;
        let _c = self.commit_lock.lock();
        let mut st = self.state.lock();
        let mut sb = self.sb.lock();
        let old = sb.geometry;
        let logical = logical_size.map_or(Ok(old.logical_blocks), |b| blocks_of("logical size", b))?;
        let data_dev = physical_size.map_or(Ok(old.data_dev_blocks), |b| blocks_of("physical size", b))?;
        refuse_striped_resize(sb.stripe.as_ref(), old.data_dev_blocks, data_dev)?;
        if logical < old.logical_blocks {
            return Err(Error::InvalidArgument(format!(
                "the logical size of an open volume only grows ({} bytes now, {} asked): stop the server and shrink the closed volume",
                old.logical_blocks * BLOCK_SIZE_U64,
                logical * BLOCK_SIZE_U64
            )));
        }
        if data_dev < old.data_dev_blocks {
            return Err(Error::InvalidArgument(format!(
                "the physical size cannot shrink ({} bytes recorded, {} asked): data may live anywhere in it",
                old.data_dev_blocks * BLOCK_SIZE_U64,
                data_dev * BLOCK_SIZE_U64
            )));
        }
        if data_dev > old.data_dev_blocks {
            let have = self.data.dev().refresh_len();
            if have < data_dev * BLOCK_SIZE_U64 {
                return Err(Error::InvalidArgument(format!(
                    "the data device {} holds {have} bytes, less than the {} asked: extend it first",
                    self.data.dev().name(),
                    data_dev * BLOCK_SIZE_U64
                )));
            }
        }
        let new = old.grown_in_place(logical, data_dev).map_err(|m| {
            Error::InvalidArgument(format!(
                "{m}; a closed volume can grow further (its metadata regions move, taking room from the fingerprint index)"
            ))
        })?;
        if new == old {
            return Ok(GrowReport::new(&old, &new, true));
        }
        sb.geometry = new;
        if let Err(e) = write_superblock(self.data.dev(), self.separate_meta(), &mut sb) {
            // What reached the device is unknown: the failed-volume rule. The next open
            // finds the old geometry or the new one, both whole.
            sb.geometry = old;
            return self.fail(e);
        }
        st.map.set_logical_blocks(new.logical_blocks, new.block_map_pages);
        if new.data_blocks > old.data_blocks {
            // After the superblock: no entry may name a new block before it is durable.
            st.rc.grow(new);
            st.alloc.grow(new.data_blocks);
            st.dedup.grow(new.data_blocks);
            self.data.grow(new.data_blocks);
        }
        self.logical_blocks.store(new.logical_blocks, Ordering::Release);
        Ok(GrowReport::new(&old, &new, true))
    }

    /// Logical blocks in `range` mapped to data, and those written with zeros (as runs).
    fn mapped_beyond(&self, range: std::ops::Range<u64>) -> Result<(u64, Option<u64>, Vec<std::ops::Range<u64>>)> {
        let (mut data, mut first, mut zeros) = (0u64, None, Vec::<std::ops::Range<u64>>::new());
        let mut lba = range.start;
        while lba < range.end {
            let end = (lba + SHRINK_CHECK_BLOCKS_PER_LOCK).min(range.end);
            let mut st = self.state.lock();
            for l in lba..end {
                let e = st.map.get(l)?;
                if e.is_data() {
                    data += 1;
                    first = first.or(Some(l));
                } else if e != crate::metadata::block_map::MapEntry::UNMAPPED {
                    match zeros.last_mut() {
                        Some(r) if r.end == l => r.end += 1,
                        _ => zeros.push(l..l + 1),
                    }
                }
            }
            let d = st.journal.durable_seq();
            st.map.evict(d)?;
            drop(st);
            lba = end;
        }
        Ok((data, first, zeros))
    }
}

/// `resize_closed` of the volume at `path` (its metadata device: `meta_device`, else the
/// path recorded at format).
pub fn resize_path(
    path: &std::path::Path,
    meta_device: Option<&std::path::Path>,
    logical_size: Option<u64>,
    physical_size: Option<u64>,
    opts: &OpenOptions,
) -> Result<GrowReport> {
    let opts = OpenOptions { read_only: false, ..opts.clone() };
    let (data, meta) = Volume::devices_at(path, meta_device, &opts)?;
    resize_closed(data, meta, logical_size, physical_size, &opts)
}

/// Resizes a closed volume (see the module header): the logical size to `logical_size`
/// bytes (a shrink is refused when a mapped block would be lost), the data device to
/// `physical_size` bytes (at most what `data` holds now; never smaller than recorded).
/// A separate metadata device that grew gives its new blocks to the metadata regions.
pub fn resize_closed(
    data: Arc<dyn Storage>,
    meta: Option<Arc<dyn Storage>>,
    logical_size: Option<u64>,
    physical_size: Option<u64>,
    opts: &OpenOptions,
) -> Result<GrowReport> {
    let open_opts = OpenOptions { read_only: false, ..opts.clone() };
    let vol = Volume::open(data.clone(), meta.clone(), &open_opts)?;
    let old = vol.geometry();
    let logical = logical_size.map_or(Ok(old.logical_blocks), |b| blocks_of("logical size", b))?;
    let data_dev = physical_size.map_or(Ok(old.data_dev_blocks), |b| blocks_of("physical size", b))?;
    refuse_striped_resize(vol.sb.lock().stripe.as_ref(), old.data_dev_blocks, data_dev)?;
    if data_dev < old.data_dev_blocks {
        return Err(Error::InvalidArgument(format!(
            "the physical size cannot shrink ({} bytes recorded, {} asked): data may live anywhere in it",
            old.data_dev_blocks * BLOCK_SIZE_U64,
            data_dev * BLOCK_SIZE_U64
        )));
    }
    if data_dev * BLOCK_SIZE_U64 > data.len() {
        return Err(Error::InvalidArgument(format!(
            "the data device {} holds {} bytes, less than the {} asked: extend it first",
            data.name(),
            data.len(),
            data_dev * BLOCK_SIZE_U64
        )));
    }
    let meta_blocks = meta.as_ref().map_or(0, |m| m.len() / BLOCK_SIZE_U64);
    let (new, copies) = old.plan_resize(logical, data_dev, meta_blocks).map_err(Error::InvalidArgument)?;
    let mut report = GrowReport::new(&old, &new, false);
    if logical < old.logical_blocks {
        let (data_mapped, first, zeros) = vol.mapped_beyond(logical..old.logical_blocks)?;
        if let Some(f) = first {
            return Err(Error::InvalidArgument(format!(
                "shrinking to {} bytes would lose {data_mapped} mapped blocks (the first at byte {}); discard them first",
                logical * BLOCK_SIZE_U64,
                f * BLOCK_SIZE_U64
            )));
        }
        for r in &zeros {
            vol.discard(r.start * BLOCK_SIZE_U64, (r.end - r.start) * BLOCK_SIZE_U64)?;
            report.zero_blocks_unmapped += r.end - r.start;
        }
    }
    vol.close()?;
    if new == old {
        return Ok(report);
    }
    let io = Arc::new(IoCounters::default());
    let (data_dev_h, meta_dev, mut sb, _) = open_devices(data, meta, &io)?;
    if !sb.clean || sb.geometry != old {
        return Err(Error::internal("volume changed between its close and its resize", format!("{:?}", sb.geometry)));
    }
    // 1. Copies, synced.
    let mut buf = vec![0u8; COPY_BLOCKS_PER_IO as usize * BLOCK_SIZE];
    for c in &copies {
        let kind = if c.from == old.refcount_start { IoKind::Refcount } else { IoKind::BlockMap };
        let mut done = 0;
        while done < c.blocks {
            let n = (c.blocks - done).min(COPY_BLOCKS_PER_IO);
            #[expect(clippy::indexing_slicing, reason = "n <= COPY_BLOCKS_PER_IO, the buffer's size in blocks")]
            let b = &mut buf[..n as usize * BLOCK_SIZE];
            meta_dev.read(kind, b, (c.from + done) * BLOCK_SIZE_U64)?;
            meta_dev.write(kind, b, (c.to + done) * BLOCK_SIZE_U64)?;
            done += n;
        }
        report.moved.push(if c.from == old.refcount_start { "reference counts".into() } else { "block map".into() });
    }
    if !copies.is_empty() {
        meta_dev.sync()?;
    }
    // 2. A shrink empties the journal (the volume is clean: the pages hold everything).
    if logical < old.logical_blocks {
        buf.fill(0);
        let mut done = 0;
        while done < old.journal_blocks {
            let n = (old.journal_blocks - done).min(COPY_BLOCKS_PER_IO);
            #[expect(clippy::indexing_slicing, reason = "n <= COPY_BLOCKS_PER_IO, the buffer's size in blocks")]
            let b = &buf[..n as usize * BLOCK_SIZE];
            meta_dev.write(IoKind::Journal, b, (old.journal_start + done) * BLOCK_SIZE_U64)?;
            done += n;
        }
        meta_dev.sync()?;
    }
    // 3. The switch.
    sb.geometry = new;
    let separate = (new.meta_dev_blocks > 0).then_some(&meta_dev);
    write_superblock(&data_dev_h, separate, &mut sb)?;
    Ok(report)
}

/// A striped volume's data region is fixed at format: its units are spread over every
/// device, and growing it would need every device to grow by the same number of units.
fn refuse_striped_resize(
    stripe: Option<&crate::metadata::stripe::StripeLayout>,
    old_blocks: u64,
    new_blocks: u64,
) -> Result<()> {
    match stripe {
        Some(s) if new_blocks != old_blocks => Err(Error::InvalidArgument(format!(
            "the physical size of a volume striped over {} data devices is fixed at format",
            s.device_count()
        ))),
        _ => Ok(()),
    }
}
