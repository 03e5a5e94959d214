//! Striping: how a volume's data region is spread over several data devices, as the
//! superblock records it (the stripe record) and as each extra device records its own
//! place in it (the member header).
//!
//! ```text
//! first data device (the volume's PATH):
//!   [superblocks, metadata unless on a metadata device] [units 0, N, 2N, ...]
//! extra data device i (1 <= i < N):
//!   [0] member header  [1] zero  [units i, N + i, 2N + i, ...]
//! ```
//!
//! Physical block `pbn` lies in unit `u = pbn / unit_blocks`, on device `u % N`, in that
//! device's row `u / N`. The block map, reference counts, journal and fingerprint index
//! stay on the first device (or the metadata device): they address pbns, so a duplicate
//! is found and shared whichever device holds its copy.
//!
//! Invariants:
//! - `2 <= device_count <= DATA_DEVICES_MAX`; `unit_blocks` is a non-zero multiple of
//!   `RUN_BLOCKS_MAX`; every device holds exactly `rows >= 1` units, so the data region is
//!   `device_count * rows * unit_blocks` blocks (`StripeLayout::validate`).
//! - An extra device's header carries the volume's uuid, its index and the stripe's
//!   shape; an open refuses a device whose header disagrees with the superblock
//!   (`MemberHeader::check`), so a missing, swapped or foreign device is never read as data.
//! - The member header is written once, at format, before the first device's superblock:
//!   a crash mid-format leaves the first device unformatted.

use crate::config::BLOCK_SIZE;
use crate::data::packer::RUN_BLOCKS_MAX;
use crate::error::{Error, Result};
use crate::metadata::layout::Geometry;
use crate::metadata::superblock::{SUPERBLOCK_CRC_OFFSET, SUPERBLOCK_MAGIC};
use zerocopy::little_endian::{U16, U32, U64};
use zerocopy::{FromBytes, Immutable, IntoBytes, KnownLayout, Unaligned};

/// Data devices a volume may stripe over, the first included. Bounds the stripe record
/// (one path slot per extra device) to a fixed part of the superblock block.
pub const DATA_DEVICES_MAX: usize = 8;
/// The stripe unit chosen at format: 1 MiB. A multiple of the packer's 128 KiB run, so a
/// unit holds whole 32-block-aligned run spans; large enough that the allocator's
/// front-to-back filling turns into 1 MiB sequential writes per device and that at most
/// 31 of 256 run start positions make a run cross into the next device (which
/// `StripedStorage` splits into two requests); small enough that the devices fill evenly
/// even for a volume of a few MiB.
pub const STRIPE_UNIT_BLOCKS: u64 = 256;
/// First data block on an extra device: after its header block and one zero block (kept
/// zero so the device never looks like a volume's first device).
pub const MEMBER_DATA_START_BLOCKS: u64 = 2;
/// Offset of the stripe record in each superblock copy.
pub const STRIPE_RECORD_OFFSET: usize = 1024;
/// Magic of the stripe record.
pub const STRIPE_MAGIC: [u8; 4] = *b"DVST";
/// Longest extra-device path the stripe record holds.
pub const STRIPE_PATH_BYTES_MAX: usize = 254;
/// The `role` byte of a member header (0 and 1 are the superblocks' data and metadata roles).
pub const MEMBER_ROLE: u8 = 2;

/// One extra device's path in the stripe record.
#[derive(Debug, Clone, FromBytes, IntoBytes, KnownLayout, Immutable, Unaligned)]
#[repr(C)]
pub struct StripePathRaw {
    /// Bytes of `path` used.
    pub len: U16,
    /// The device's path as given at format (absolute for a file).
    pub path: [u8; STRIPE_PATH_BYTES_MAX],
}

/// The stripe record at `STRIPE_RECORD_OFFSET` of a striped volume's superblock copies.
#[derive(Debug, Clone, FromBytes, IntoBytes, KnownLayout, Immutable, Unaligned)]
#[repr(C)]
pub struct StripeRaw {
    /// `STRIPE_MAGIC`.
    pub magic: [u8; 4],
    /// Data devices, the first included.
    pub device_count: U16,
    /// Zero.
    pub reserved: U16,
    /// Blocks per stripe unit.
    pub unit_blocks: U32,
    /// First data block on each extra device (`MEMBER_DATA_START_BLOCKS`).
    pub member_data_start: U32,
    /// Units each device holds.
    pub rows: U64,
    /// Extra devices 1..device_count (unused slots zero).
    pub paths: [StripePathRaw; DATA_DEVICES_MAX - 1],
}

const _: () = assert!(std::mem::size_of::<StripePathRaw>() == 256);
const _: () = assert!(std::mem::size_of::<StripeRaw>() == 1816);
const _: () = assert!(STRIPE_RECORD_OFFSET + std::mem::size_of::<StripeRaw>() <= BLOCK_SIZE);
const _: () = assert!(STRIPE_UNIT_BLOCKS.is_multiple_of(RUN_BLOCKS_MAX));

/// The stripe as the superblock records it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StripeLayout {
    /// Blocks per unit.
    pub unit_blocks: u64,
    /// Units on each device.
    pub rows: u64,
    /// First data block on each extra device.
    pub member_data_start: u64,
    /// Paths of the extra devices, in device order (device 1 first).
    pub paths: Vec<String>,
}

impl StripeLayout {
    /// Data devices, the first included.
    pub fn device_count(&self) -> usize {
        self.paths.len() + 1
    }

    /// Blocks an extra device must have.
    pub fn member_blocks(&self) -> u64 {
        self.member_data_start + self.rows * self.unit_blocks
    }

    /// Checks the invariants against the geometry (a broken one is a damaged superblock).
    pub fn validate(&self, geo: &Geometry) -> Result<()> {
        let n = self.device_count() as u64;
        let ok = (2..=DATA_DEVICES_MAX).contains(&self.device_count())
            && self.unit_blocks > 0
            && self.unit_blocks.is_multiple_of(RUN_BLOCKS_MAX)
            && self.rows > 0
            && self.member_data_start >= 1
            && n.checked_mul(self.rows).and_then(|u| u.checked_mul(self.unit_blocks)) == Some(geo.data_blocks)
            && self.paths.iter().all(|p| !p.is_empty() && p.len() <= STRIPE_PATH_BYTES_MAX);
        if ok {
            Ok(())
        } else {
            Err(Error::corruption(
                "superblock copy",
                0,
                format!("a stripe of 2 to {DATA_DEVICES_MAX} devices whose units add up to the data region"),
                format!("stripe {self:?} over a data region of {} blocks", geo.data_blocks),
            ))
        }
    }

    /// Writes the record into a superblock block (its crc is sealed afterwards).
    pub fn encode_into(&self, block: &mut [u8]) {
        let mut paths: [StripePathRaw; DATA_DEVICES_MAX - 1] =
            std::array::from_fn(|_| StripePathRaw { len: U16::new(0), path: [0; STRIPE_PATH_BYTES_MAX] });
        for (slot, p) in paths.iter_mut().zip(&self.paths) {
            let b = p.as_bytes();
            let n = b.len().min(STRIPE_PATH_BYTES_MAX);
            if let (Some(dst), Some(src)) = (slot.path.get_mut(..n), b.get(..n)) {
                dst.copy_from_slice(src);
            }
            slot.len = U16::new(n as u16);
        }
        let raw = StripeRaw {
            magic: STRIPE_MAGIC,
            device_count: U16::new(self.device_count() as u16),
            reserved: U16::new(0),
            unit_blocks: U32::new(self.unit_blocks as u32),
            member_data_start: U32::new(self.member_data_start as u32),
            rows: U64::new(self.rows),
            paths,
        };
        if let Some(tail) = block.get_mut(STRIPE_RECORD_OFFSET..) {
            let _ = raw.write_to_prefix(tail);
        }
    }

    /// Reads the record from a superblock block whose crc was checked; an absent or
    /// malformed record is a damaged copy (only a striped volume's version says one is there).
    pub fn decode(block: &[u8]) -> Result<StripeLayout> {
        let raw = block.get(STRIPE_RECORD_OFFSET..).and_then(|b| StripeRaw::read_from_prefix(b).ok());
        let bad = |found: String| Error::corruption("superblock copy", 0, "a stripe record", found);
        let Some((raw, _)) = raw else {
            return Err(bad("a block too short for the stripe record".into()));
        };
        if raw.magic != STRIPE_MAGIC {
            return Err(bad(format!("stripe record magic {:?}", raw.magic)));
        }
        let count = usize::from(raw.device_count.get());
        if !(2..=DATA_DEVICES_MAX).contains(&count) {
            return Err(bad(format!("{count} data devices")));
        }
        let paths = raw
            .paths
            .iter()
            .take(count - 1)
            .map(|p| {
                let n = usize::from(p.len.get()).min(STRIPE_PATH_BYTES_MAX);
                p.path.get(..n).map(|s| String::from_utf8_lossy(s).into_owned()).unwrap_or_default()
            })
            .collect();
        Ok(StripeLayout {
            unit_blocks: u64::from(raw.unit_blocks.get()),
            rows: raw.rows.get(),
            member_data_start: u64::from(raw.member_data_start.get()),
            paths,
        })
    }
}

/// The header in block 0 of an extra data device. Its first 41 bytes have the
/// superblock's shape (magic, crc, version, uuid, generation, role), so a tool that probes
/// for a volume finds one there and `format` refuses to overwrite it without `--force`.
#[derive(Debug, Clone, FromBytes, IntoBytes, KnownLayout, Immutable, Unaligned)]
#[repr(C)]
pub struct MemberHeaderRaw {
    /// `SUPERBLOCK_MAGIC`.
    pub magic: [u8; 8],
    /// crc32c of the 4 KiB block with this field zeroed.
    pub checksum: U32,
    /// The volume's format version (`FORMAT_VERSION_STRIPED`).
    pub version: U32,
    /// The volume's uuid.
    pub uuid: [u8; 16],
    /// Zero (the header is written once).
    pub generation: U64,
    /// `MEMBER_ROLE`.
    pub role: u8,
    /// Zero.
    pub reserved: [u8; 3],
    /// This device's place in the stripe (1..device_count).
    pub device_index: U32,
    /// Data devices, the first included.
    pub device_count: U32,
    /// Blocks per stripe unit.
    pub unit_blocks: U32,
    /// First data block on this device.
    pub data_start: U64,
    /// Units this device holds.
    pub rows: U64,
}

const _: () = assert!(std::mem::size_of::<MemberHeaderRaw>() == 72);

/// A decoded member header.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MemberHeader {
    /// The volume's uuid.
    pub uuid: [u8; 16],
    /// This device's index (1..device_count).
    pub device_index: u32,
    /// Data devices, the first included.
    pub device_count: u32,
    /// Blocks per unit.
    pub unit_blocks: u64,
    /// First data block on this device.
    pub data_start: u64,
    /// Units on this device.
    pub rows: u64,
}

impl MemberHeader {
    /// The header of extra device `device_index` of a volume.
    pub fn for_device(uuid: [u8; 16], device_index: u32, stripe: &StripeLayout) -> MemberHeader {
        MemberHeader {
            uuid,
            device_index,
            device_count: stripe.device_count() as u32,
            unit_blocks: stripe.unit_blocks,
            data_start: stripe.member_data_start,
            rows: stripe.rows,
        }
    }

    /// The 4 KiB header block, crc sealed.
    pub fn encode(&self) -> Vec<u8> {
        let raw = MemberHeaderRaw {
            magic: SUPERBLOCK_MAGIC,
            checksum: U32::new(0),
            version: U32::new(crate::metadata::superblock::FORMAT_VERSION_STRIPED),
            uuid: self.uuid,
            generation: U64::new(0),
            role: MEMBER_ROLE,
            reserved: [0; 3],
            device_index: U32::new(self.device_index),
            device_count: U32::new(self.device_count),
            unit_blocks: U32::new(self.unit_blocks as u32),
            data_start: U64::new(self.data_start),
            rows: U64::new(self.rows),
        };
        let mut buf = vec![0u8; BLOCK_SIZE];
        let _ = raw.write_to_prefix(&mut buf);
        crate::codec::seal_crc(&mut buf, SUPERBLOCK_CRC_OFFSET);
        buf
    }

    /// Decodes a header block: `Err` with what the block holds instead when it is no
    /// intact member header.
    pub fn decode(buf: &[u8]) -> std::result::Result<MemberHeader, String> {
        let Ok((raw, _)) = MemberHeaderRaw::read_from_prefix(buf) else {
            return Err("a block too short for a header".into());
        };
        if raw.magic != SUPERBLOCK_MAGIC {
            return Err("no dedupvol header (blank or foreign data)".into());
        }
        if !crate::codec::crc_ok(buf, SUPERBLOCK_CRC_OFFSET) {
            return Err("a damaged header (checksum mismatch)".into());
        }
        if raw.role != MEMBER_ROLE {
            return Err(format!("a volume's superblock (role {}), not an extra data device's header", raw.role));
        }
        Ok(MemberHeader {
            uuid: raw.uuid,
            device_index: raw.device_index.get(),
            device_count: raw.device_count.get(),
            unit_blocks: u64::from(raw.unit_blocks.get()),
            data_start: raw.data_start.get(),
            rows: raw.rows.get(),
        })
    }

    /// Compares the header found on a device with the one the superblock expects there;
    /// `Err` says how they differ, in words for the user.
    pub fn check(&self, expected: &MemberHeader) -> std::result::Result<(), String> {
        if self.uuid != expected.uuid {
            return Err(format!(
                "it belongs to volume {} (device {} of {}), not to volume {}",
                crate::volume::uuid_hex(&self.uuid),
                self.device_index,
                self.device_count,
                crate::volume::uuid_hex(&expected.uuid)
            ));
        }
        if self.device_index != expected.device_index {
            return Err(format!(
                "it is data device {} of this volume, not device {} (devices swapped or renamed?)",
                self.device_index, expected.device_index
            ));
        }
        if self != expected {
            return Err(format!("its header records stripe {self:?}, the superblock {expected:?}"));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn header_round_trip_and_mismatches() {
        let s = StripeLayout { unit_blocks: 256, rows: 3, member_data_start: 2, paths: vec!["/a".into(), "/b".into()] };
        let h = MemberHeader::for_device([7; 16], 2, &s);
        let buf = h.encode();
        let back = MemberHeader::decode(&buf).expect("decode");
        assert_eq!(back, h);
        assert!(back.check(&h).is_ok());
        let other = MemberHeader::for_device([7; 16], 1, &s);
        assert!(back.check(&other).unwrap_err().contains("swapped"));
        let foreign = MemberHeader::for_device([8; 16], 2, &s);
        assert!(back.check(&foreign).unwrap_err().contains("belongs to volume"));
        let mut bad = buf.clone();
        bad[100] ^= 1;
        assert!(MemberHeader::decode(&bad).is_err());
        assert!(MemberHeader::decode(&[0u8; 4096]).is_err());
    }

    #[test]
    fn stripe_record_round_trip() {
        let s = StripeLayout {
            unit_blocks: 256,
            rows: 9,
            member_data_start: 2,
            paths: vec!["/dev/sdb".into(), "/x/y".into(), "/z".into()],
        };
        let mut block = vec![0u8; BLOCK_SIZE];
        s.encode_into(&mut block);
        assert_eq!(StripeLayout::decode(&block).expect("decode"), s);
        assert!(StripeLayout::decode(&[0u8; BLOCK_SIZE]).is_err());
    }
}
