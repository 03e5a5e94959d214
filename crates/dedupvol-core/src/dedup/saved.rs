//! The saved fingerprint index: written at a clean close into the index area of the
//! metadata device, loaded at the next open (docs/format.md, "Saved index").
//!
//! Layout: a header block (magic "DVIX", crc32c of the entries, entry count, bytes per
//! entry, low 64 bits of the volume uuid), then the entries back to back.
//!
//! Invariants:
//! - Only entries valid at close are saved (block in use, stamp current), with their
//!   stamps reset to zero: stamps restart at zero on the next open.
//! - A saved index that does not match the volume (uuid, count, entry size, checksum) is
//!   ignored: the index is advisory, so the cost is dedup, never data.

use super::Deduper;
use crate::codec::{get_u32, get_u64, put_u32, put_u64};
use crate::config::{BLOCK_SIZE, BLOCK_SIZE_U64};
use crate::dedup::index::Location;
use crate::error::{Error, Result};
use crate::io::{Dev, IoKind};
use crate::metadata::layout::Geometry;
use crate::metadata::refcount::Refcounts;

/// Magic of the index save area's header block ("DVIX").
const INDEX_MAGIC: u32 = u32::from_le_bytes(*b"DVIX");

impl Deduper {
    /// Saves the index into its area (clean close); returns the entries saved.
    pub(crate) fn save(&self, meta: &Dev, geo: &Geometry, uuid_lo: u64, rc: &Refcounts) -> Result<u64> {
        if geo.index_blocks < 2 {
            return Ok(0);
        }
        let per = self.index.bytes_per_entry();
        let room = (geo.index_blocks - 1) * BLOCK_SIZE_U64 / per;
        let (n, mut bytes) = self.index.export(|l| {
            let valid = rc.get(l.pbn) > 0 && self.stamp_matches(&l);
            valid.then_some(Location { stamp: 0, ..l })
        });
        let n = n.min(room);
        bytes.truncate((n * per) as usize);
        let mut head = vec![0u8; BLOCK_SIZE];
        put_u32(&mut head, 0, INDEX_MAGIC);
        put_u32(&mut head, 4, crc32c::crc32c(&bytes));
        put_u64(&mut head, 8, n);
        put_u32(&mut head, 16, per as u32);
        put_u64(&mut head, 24, uuid_lo);
        bytes.resize(bytes.len().div_ceil(BLOCK_SIZE) * BLOCK_SIZE, 0);
        meta.write(IoKind::Index, &bytes, (geo.index_start + 1) * BLOCK_SIZE_U64)?;
        meta.write(IoKind::Index, &head, geo.index_start * BLOCK_SIZE_U64)?;
        meta.sync()?;
        Ok(n)
    }

    /// Loads `count` saved entries into the index; returns how many were taken.
    pub(crate) fn load(&mut self, meta: &Dev, geo: &Geometry, uuid_lo: u64, count: u64) -> Result<u64> {
        let bytes = read_saved(meta, geo, uuid_lo, count, self.index.bytes_per_entry())?;
        Ok(self.index.import(&bytes))
    }
}

/// Reads and checks the saved entries.
fn read_saved(meta: &Dev, geo: &Geometry, uuid_lo: u64, count: u64, per: u64) -> Result<Vec<u8>> {
    let mut head = vec![0u8; BLOCK_SIZE];
    meta.read(IoKind::Index, &mut head, geo.index_start * BLOCK_SIZE_U64)?;
    let (magic, uuid, saved_count, saved_per) =
        (get_u32(&head, 0), get_u64(&head, 24), get_u64(&head, 8), u64::from(get_u32(&head, 16)));
    if magic != INDEX_MAGIC || uuid != uuid_lo || saved_count != count || saved_per != per {
        return Err(Error::corruption(
            "saved index header block",
            geo.index_start,
            format!(
                "magic {INDEX_MAGIC:#010x}, volume {uuid_lo:#018x}, {count} entries of {per} bytes (as the superblock says)"
            ),
            format!("magic {magic:#010x}, volume {uuid:#018x}, {saved_count} entries of {saved_per} bytes"),
        ));
    }
    let len = count * per;
    let area_bytes = geo.index_blocks.saturating_sub(1) * BLOCK_SIZE_U64;
    if len > area_bytes {
        return Err(Error::corruption(
            "saved index header block",
            geo.index_start,
            format!("at most {area_bytes} bytes of entries (the save area)"),
            format!("{len} bytes of entries"),
        ));
    }
    let mut bytes = vec![0u8; len as usize];
    meta.read(IoKind::Index, &mut bytes, (geo.index_start + 1) * BLOCK_SIZE_U64)?;
    let (crc, saved_crc) = (crc32c::crc32c(&bytes), get_u32(&head, 4));
    if crc != saved_crc {
        return Err(Error::corruption(
            "saved index header block",
            geo.index_start,
            format!("checksum {saved_crc:#010x} over the entries"),
            format!("{crc:#010x} (checksum mismatch)"),
        ));
    }
    Ok(bytes)
}
