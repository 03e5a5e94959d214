//! The tier device's on-disk layout (docs/format.md, "Tier device"): a header block, a
//! slot table of fixed-size records (128 per 4 KiB page), then the 4 KiB slots.
//!
//! Invariants:
//! - A header is accepted only with its magic, version, crc, the volume's UUID, the slot
//!   size and the slot count this device's size gives: anything else re-initialises the
//!   tier (it is a cache, never the only copy of anything).
//! - A record is accepted only when its own crc matches; the crc covers the record's slot
//!   index, so a record written to the wrong place (or a zeroed table) reads as empty.
//! - `slots_start + slot_count` blocks fit on the device (`TierGeometry::for_device`).

use crate::config::{BLOCK_SIZE, BLOCK_SIZE_U64};
use zerocopy::little_endian::{U32, U64};
use zerocopy::{FromBytes, Immutable, IntoBytes, KnownLayout, Unaligned};

/// Magic at offset 0 of the tier header block.
pub const TIER_MAGIC: [u8; 8] = *b"DVTIERHD";
/// Tier layout version.
pub const TIER_FORMAT_VERSION: u32 = 1;
/// Bytes in a slot (one physical block of the data device).
pub const TIER_SLOT_BYTES: usize = BLOCK_SIZE;
/// Offset of the header's crc field.
const HEADER_CRC_OFFSET: usize = 8;
/// Most slots a tier uses, whatever its size (bounds the in-memory slot table and map to a
/// few hundred MiB; a larger device uses its first 32 GiB of slots).
pub const TIER_SLOTS_MAX: u64 = 1 << 23;

/// The header block's used prefix (the rest of the 4 KiB block is zero).
#[derive(Debug, Clone, FromBytes, IntoBytes, KnownLayout, Immutable, Unaligned)]
#[repr(C)]
pub struct TierHeaderRaw {
    /// `TIER_MAGIC`.
    pub magic: [u8; 8],
    /// crc32c of the 4 KiB block with this field zeroed.
    pub checksum: U32,
    /// `TIER_FORMAT_VERSION`.
    pub version: U32,
    /// UUID of the volume the tier caches.
    pub uuid: [u8; 16],
    /// `TIER_SLOT_BYTES`.
    pub slot_bytes: U32,
    /// `TIER_RECORDS_PER_PAGE`.
    pub records_per_page: U32,
    /// Slots on the device.
    pub slot_count: U64,
    /// First block of the slot table.
    pub table_start: U64,
    /// Blocks of the slot table.
    pub table_pages: U64,
    /// First slot's block.
    pub slots_start: U64,
}

/// Bytes of the header's used prefix.
pub const TIER_HEADER_BYTES: usize = std::mem::size_of::<TierHeaderRaw>();
const _: () = assert!(TIER_HEADER_BYTES == 72);

/// One slot table record: which physical block the slot holds a copy of.
#[derive(Debug, Clone, Default, FromBytes, IntoBytes, KnownLayout, Immutable, Unaligned)]
#[repr(C)]
pub struct SlotRecordRaw {
    /// Physical block number (data region) the slot holds a copy of.
    pub pbn: U64,
    /// Tier-wide write sequence: the newest record for a pbn wins.
    pub generation: U64,
    /// crc32c of the slot's 4 KiB content.
    pub content_crc: U32,
    /// Bit 0: record in use; bit 1: a packed block.
    pub flags: u8,
    /// Reserved, zero.
    pub reserved: [u8; 3],
    /// Reference count when promoted (a demotion hint).
    pub refs: U32,
    /// crc32c of the slot index (u64) followed by the 28 bytes above.
    pub record_crc: U32,
}

/// Bytes of a slot record.
pub const TIER_RECORD_BYTES: usize = std::mem::size_of::<SlotRecordRaw>();
const _: () = assert!(TIER_RECORD_BYTES == 32);
/// Records per slot table page.
pub const TIER_RECORDS_PER_PAGE: usize = BLOCK_SIZE / TIER_RECORD_BYTES;
const _: () = assert!(TIER_RECORDS_PER_PAGE * TIER_RECORD_BYTES == BLOCK_SIZE);
const RECORD_FLAG_USED: u8 = 1;
const RECORD_FLAG_PACKED: u8 = 2;

/// A decoded, valid slot record.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct SlotRecord {
    pub(crate) pbn: u64,
    pub(crate) generation: u64,
    pub(crate) content_crc: u32,
    pub(crate) packed: bool,
    pub(crate) refs: u32,
}

/// Where the header, table and slots live on a tier device.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct TierGeometry {
    pub(crate) slot_count: u64,
    pub(crate) table_start: u64,
    pub(crate) table_pages: u64,
    pub(crate) slots_start: u64,
}

impl TierGeometry {
    /// The largest layout that fits `bytes` (None: too small for one slot).
    pub(crate) fn for_device(bytes: u64) -> Option<Self> {
        let blocks = bytes / BLOCK_SIZE_U64;
        let per_page = TIER_RECORDS_PER_PAGE as u64;
        // 1 header block, then ceil(n / 128) table pages and n slots.
        let mut n = (blocks.saturating_sub(1) * per_page / (per_page + 1)).min(TIER_SLOTS_MAX);
        while n > 0 && 1 + n.div_ceil(per_page) + n > blocks {
            n -= 1;
        }
        (n > 0).then(|| TierGeometry {
            slot_count: n,
            table_start: 1,
            table_pages: n.div_ceil(per_page),
            slots_start: 1 + n.div_ceil(per_page),
        })
    }

    /// Byte offset of slot `slot`.
    pub(crate) fn slot_offset(&self, slot: u64) -> u64 {
        (self.slots_start + slot) * BLOCK_SIZE_U64
    }

    /// Byte offset of table page `page`.
    pub(crate) fn page_offset(&self, page: u64) -> u64 {
        (self.table_start + page) * BLOCK_SIZE_U64
    }
}

/// The header block for a tier of `geo` caching volume `uuid`.
pub(crate) fn encode_header(uuid: &[u8; 16], geo: &TierGeometry) -> Vec<u8> {
    let raw = TierHeaderRaw {
        magic: TIER_MAGIC,
        checksum: U32::new(0),
        version: U32::new(TIER_FORMAT_VERSION),
        uuid: *uuid,
        slot_bytes: U32::new(TIER_SLOT_BYTES as u32),
        records_per_page: U32::new(TIER_RECORDS_PER_PAGE as u32),
        slot_count: U64::new(geo.slot_count),
        table_start: U64::new(geo.table_start),
        table_pages: U64::new(geo.table_pages),
        slots_start: U64::new(geo.slots_start),
    };
    let mut buf = vec![0u8; BLOCK_SIZE];
    if let Some(dst) = buf.get_mut(..TIER_HEADER_BYTES) {
        dst.copy_from_slice(raw.as_bytes());
    }
    let crc = crc32c::crc32c(&buf);
    if let Some(dst) = buf.get_mut(HEADER_CRC_OFFSET..HEADER_CRC_OFFSET + 4) {
        dst.copy_from_slice(&crc.to_le_bytes());
    }
    buf
}

/// Checks a header block against the volume and the device's layout: Err names why the
/// tier must be re-initialised.
pub(crate) fn check_header(buf: &[u8], uuid: &[u8; 16], geo: &TierGeometry) -> Result<(), String> {
    let Some((raw, _)) = buf.get(..TIER_HEADER_BYTES).and_then(|b| TierHeaderRaw::read_from_prefix(b).ok()) else {
        return Err("header block too short".into());
    };
    if raw.magic != TIER_MAGIC {
        return Err("no tier header (new or foreign device)".into());
    }
    let mut copy = buf.to_vec();
    if let Some(c) = copy.get_mut(HEADER_CRC_OFFSET..HEADER_CRC_OFFSET + 4) {
        c.fill(0);
    }
    if crc32c::crc32c(&copy) != raw.checksum.get() || buf.len() != BLOCK_SIZE {
        return Err("tier header checksum mismatch".into());
    }
    if raw.version.get() != TIER_FORMAT_VERSION {
        return Err(format!("tier layout version {} (this build writes {TIER_FORMAT_VERSION})", raw.version.get()));
    }
    if raw.uuid != *uuid {
        return Err("the tier belongs to another volume".into());
    }
    let same = raw.slot_bytes.get() as usize == TIER_SLOT_BYTES
        && raw.records_per_page.get() as usize == TIER_RECORDS_PER_PAGE
        && raw.slot_count.get() == geo.slot_count
        && raw.table_start.get() == geo.table_start
        && raw.table_pages.get() == geo.table_pages
        && raw.slots_start.get() == geo.slots_start;
    if !same {
        return Err(format!(
            "tier layout of {} slots does not match the device's {} slots (resized?)",
            raw.slot_count.get(),
            geo.slot_count
        ));
    }
    Ok(())
}

fn record_crc(slot: u64, body: &[u8]) -> u32 {
    crc32c::crc32c_append(crc32c::crc32c(&slot.to_le_bytes()), body)
}

/// Encodes slot `slot`'s record (None: an empty record, all zeros) into `dst` (32 bytes).
pub(crate) fn encode_record(slot: u64, rec: Option<&SlotRecord>, dst: &mut [u8]) {
    let Some(r) = rec else {
        dst.fill(0);
        return;
    };
    let mut raw = SlotRecordRaw {
        pbn: U64::new(r.pbn),
        generation: U64::new(r.generation),
        content_crc: U32::new(r.content_crc),
        flags: RECORD_FLAG_USED | if r.packed { RECORD_FLAG_PACKED } else { 0 },
        reserved: [0; 3],
        refs: U32::new(r.refs),
        record_crc: U32::new(0),
    };
    let crc = record_crc(slot, raw.as_bytes().get(..TIER_RECORD_BYTES - 4).unwrap_or(&[]));
    raw.record_crc = U32::new(crc);
    if dst.len() == TIER_RECORD_BYTES {
        dst.copy_from_slice(raw.as_bytes());
    }
}

/// Decodes slot `slot`'s record: None when empty, torn or misplaced.
pub(crate) fn decode_record(slot: u64, src: &[u8]) -> Option<SlotRecord> {
    let raw = SlotRecordRaw::read_from_bytes(src).ok()?;
    let body = src.get(..TIER_RECORD_BYTES - 4)?;
    if raw.record_crc.get() != record_crc(slot, body) || raw.flags & RECORD_FLAG_USED == 0 {
        return None;
    }
    Some(SlotRecord {
        pbn: raw.pbn.get(),
        generation: raw.generation.get(),
        content_crc: raw.content_crc.get(),
        packed: raw.flags & RECORD_FLAG_PACKED != 0,
        refs: raw.refs.get(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn geometry_fits_the_device() {
        assert_eq!(TierGeometry::for_device(2 * 4096), None);
        for blocks in [3u64, 4, 129, 130, 131, 1000, 1 << 16] {
            let g = TierGeometry::for_device(blocks * 4096).expect("fits");
            assert!(g.slots_start + g.slot_count <= blocks, "{blocks}: {g:?}");
            assert!(g.table_pages * TIER_RECORDS_PER_PAGE as u64 >= g.slot_count);
        }
    }

    #[test]
    fn records_round_trip_and_reject_misplacement() {
        let r = SlotRecord { pbn: 77, generation: 9, content_crc: 0xdead_beef, packed: true, refs: 5 };
        let mut b = [0u8; TIER_RECORD_BYTES];
        encode_record(3, Some(&r), &mut b);
        assert_eq!(decode_record(3, &b), Some(r));
        assert_eq!(decode_record(4, &b), None, "a record at the wrong slot is ignored");
        b[0] ^= 1;
        assert_eq!(decode_record(3, &b), None);
        assert_eq!(decode_record(0, &[0u8; TIER_RECORD_BYTES]), None, "a zeroed record is empty");
    }

    #[test]
    fn header_checks_volume_and_layout() {
        let g = TierGeometry::for_device(1 << 20).expect("fits");
        let h = encode_header(&[1; 16], &g);
        assert!(check_header(&h, &[1; 16], &g).is_ok());
        assert!(check_header(&h, &[2; 16], &g).is_err());
        let other = TierGeometry::for_device(2 << 20).expect("fits");
        assert!(check_header(&h, &[1; 16], &other).is_err());
        let mut bad = h.clone();
        bad[100] ^= 1;
        assert!(check_header(&bad, &[1; 16], &g).is_err());
    }
}
