//! The superblock: identity, geometry and settings of a volume, written twice.
//!
//! Invariants:
//! - Both copies (blocks 0 and 1 of each device) carry a crc32c over the whole 4 KiB block;
//!   a copy with a bad checksum is ignored and the other copy is used.
//! - Copies are updated one at a time with a sync between them, so a crash can tear at most
//!   one copy; the valid copy with the highest `generation` wins.
//! - The metadata device, when present, carries the same superblock with `role = 1`; the
//!   UUIDs must match or the open is refused.
//! - The lifetime counters record sits in the block's tail, covered by the same crc. A
//!   block without its magic (a volume formatted before the record existed) has zero
//!   lifetime counters; a record is written by every superblock write of a read-write open.
//! - A volume striped over several data devices has version `FORMAT_VERSION_STRIPED` and a
//!   stripe record (`metadata::stripe`) in the block's tail; a single-device volume keeps
//!   version `FORMAT_VERSION` and no record, so it reads exactly as before, and a build
//!   that knows only version 2 refuses a striped volume instead of reading its first
//!   device as the whole data region.
//! - A volume with a rest level (data at rest recompressed harder while idle, marked
//!   `block_map::FRAG_SETTLED` in its fragments) has version `FORMAT_VERSION_REST`, or
//!   `FORMAT_VERSION_REST_STRIPED` when striped, and its level in byte 211: a build that
//!   does not know the mark refuses the volume by its version instead of failing on the
//!   first marked entry. A volume without one keeps version 2 or 3 and byte 211 zero.
//! - A volume formatted with a dictionary area carries a dictionary record at
//!   `DICT_RECORD_OFFSET` (the area's place; without the record, or with an area of zero
//!   blocks, the volume has none). Once a dictionary is installed (`data::dictionary`) the
//!   record names it and the version is `FORMAT_VERSION_DICT` (`FORMAT_VERSION_DICT_STRIPED`
//!   when striped): fragments may then need the dictionary to decode, and a build that
//!   does not know dictionaries refuses the volume by its version. Dictionaries are only
//!   trained in volumes with a rest level, so versions 6 and 7 carry one too.

use crate::config::{Compression, DedupVerify, IndexMode, WritePolicy, BLOCK_SIZE, BLOCK_SIZE_U64};
use crate::error::{Corruption, Error, Result};
use crate::io::{Dev, IoKind};
use crate::metadata::layout::Geometry;
use crate::metadata::stripe::{MemberHeader, StripeLayout, MEMBER_ROLE};
use crate::obs::stats::LifetimeCounters;
use zerocopy::little_endian::{U16, U32, U64};
use zerocopy::{FromBytes, Immutable, IntoBytes, KnownLayout, Unaligned};

/// Magic at offset 0 of each superblock copy.
pub const SUPERBLOCK_MAGIC: [u8; 8] = *b"DEDUPVOL";
/// On-disk format version.
pub const FORMAT_VERSION: u32 = 2;
/// The version of a volume striped over several data devices: version 2 plus the stripe
/// record.
pub const FORMAT_VERSION_STRIPED: u32 = 3;
/// Version 2 plus a rest level (byte 211) and fragments marked settled.
pub const FORMAT_VERSION_REST: u32 = 4;
/// Version 3 (striped) plus a rest level and fragments marked settled.
pub const FORMAT_VERSION_REST_STRIPED: u32 = 5;
/// Version 4 (rest level) plus an installed zstd dictionary (the dictionary record).
pub const FORMAT_VERSION_DICT: u32 = 6;
/// Version 5 (rest level, striped) plus an installed zstd dictionary.
pub const FORMAT_VERSION_DICT_STRIPED: u32 = 7;
/// Offset of the checksum field.
pub const SUPERBLOCK_CRC_OFFSET: usize = 8;
/// Longest metadata-device path remembered in the superblock.
pub const META_PATH_BYTES_MAX: usize = 256;

/// The superblock's fixed-size prefix (the rest of the 4 KiB block is zero).
#[derive(Debug, Clone, FromBytes, IntoBytes, KnownLayout, Immutable, Unaligned)]
#[repr(C)]
pub struct SuperblockRaw {
    /// `SUPERBLOCK_MAGIC`.
    pub magic: [u8; 8],
    /// crc32c of the 4 KiB block with this field zeroed.
    pub checksum: U32,
    /// `FORMAT_VERSION`.
    pub version: U32,
    /// Volume identity; stamped into every metadata block.
    pub uuid: [u8; 16],
    /// Incremented on every superblock write.
    pub generation: U64,
    /// 0 = data device, 1 = metadata device.
    pub role: u8,
    /// `Compression::code`.
    pub compression: u8,
    /// 1 = dedup on.
    pub dedup: u8,
    /// 0 = bytes, 1 = hash.
    pub verify: u8,
    /// 0 = sync, 1 = async.
    pub write_policy: u8,
    /// 1 = closed cleanly (journal need not be replayed).
    pub clean: u8,
    /// 1 = a separate metadata device holds journal, refcounts and block map.
    pub has_meta_dev: u8,
    /// `IndexMode::code`: 0 = dense, 1 = sparse (a volume formatted before the mode
    /// existed holds 0 here, a dense index).
    pub index_mode: u8,
    /// Geometry: logical blocks.
    pub logical_blocks: U64,
    /// Geometry: data device blocks.
    pub data_dev_blocks: U64,
    /// Geometry: metadata device blocks (0 when none).
    pub meta_dev_blocks: U64,
    /// Geometry: first journal block.
    pub journal_start: U64,
    /// Geometry: journal blocks.
    pub journal_blocks: U64,
    /// Geometry: first refcount block.
    pub refcount_start: U64,
    /// Geometry: refcount pages.
    pub refcount_pages: U64,
    /// Geometry: first block map block.
    pub block_map_start: U64,
    /// Geometry: block map pages.
    pub block_map_pages: U64,
    /// Geometry: first index-save block.
    pub index_start: U64,
    /// Geometry: index-save blocks.
    pub index_blocks: U64,
    /// Geometry: first data block.
    pub data_start: U64,
    /// Geometry: data blocks.
    pub data_blocks: U64,
    /// Geometry: blocks per slab.
    pub slab_blocks: U64,
    /// Fingerprint index memory chosen at format.
    pub index_memory_bytes: U64,
    /// Next journal entry sequence (valid when clean).
    pub next_entry_seq: U64,
    /// Next journal block sequence (valid when clean).
    pub next_block_seq: U64,
    /// Logical blocks mapped to data (valid when clean).
    pub mapped_blocks: U64,
    /// Logical blocks mapped as written zeros (valid when clean).
    pub zero_blocks: U64,
    /// Entries in the saved fingerprint index (valid when clean; 0 = none saved).
    pub index_saved_entries: U64,
    /// Length of `meta_path`.
    pub meta_path_len: U16,
    /// zstd level as an i8 (0: `ZSTD_LEVEL_DEFAULT`, what volumes formatted before the
    /// field existed compressed with); 0 for other codecs.
    pub compression_level: u8,
    /// zstd level data at rest is recompressed to, as an i8 (versions 4 and 5; 0: off).
    pub rest_level: u8,
    /// Byte 212: 1 when the chapter ring keeps name pages, 0 for a ring of record pages
    /// only (volumes made before name pages existed); byte 213: the extent cap in blocks
    /// (0: none set, the largest unit); bytes 214..216 reserved, zero.
    pub reserved1: [u8; 4],
    /// Path of the metadata device at format time (a hint for `open_path`).
    pub meta_path: [u8; META_PATH_BYTES_MAX],
}

const _: () = assert!(std::mem::size_of::<SuperblockRaw>() == 472);
const _: () = assert!(std::mem::size_of::<SuperblockRaw>() <= BLOCK_SIZE);

/// Offset of the lifetime counters record in each superblock copy.
pub const LIFETIME_RECORD_OFFSET: usize = 512;
/// Magic of the lifetime counters record.
pub const LIFETIME_MAGIC: [u8; 4] = *b"DVLC";

/// The lifetime counters record (`LifetimeCounters` in on-disk order).
#[derive(Debug, Clone, FromBytes, IntoBytes, KnownLayout, Immutable, Unaligned)]
#[repr(C)]
pub struct LifetimeRaw {
    /// `LIFETIME_MAGIC`.
    pub magic: [u8; 4],
    /// Counters that follow. A reader takes missing ones as zero and ignores extra ones,
    /// so counters can be appended without a format version change.
    pub words_count: U32,
    /// The counters.
    pub words: [U64; LifetimeCounters::WORDS],
}

const _: () = assert!(std::mem::size_of::<LifetimeRaw>() == 152);
const _: () = assert!(LIFETIME_RECORD_OFFSET >= std::mem::size_of::<SuperblockRaw>());
const _: () = assert!(LIFETIME_RECORD_OFFSET + std::mem::size_of::<LifetimeRaw>() <= BLOCK_SIZE);

/// Offset of the dictionary record in each superblock copy (after the stripe record).
pub const DICT_RECORD_OFFSET: usize = 3072;
/// Magic of the dictionary record.
pub const DICT_MAGIC: [u8; 4] = *b"DVDI";

/// The dictionary record: where the dictionary area is, and the dictionary installed in
/// it (id 0: none yet).
#[derive(Debug, Clone, FromBytes, IntoBytes, KnownLayout, Immutable, Unaligned)]
#[repr(C)]
pub struct DictRaw {
    /// `DICT_MAGIC`.
    pub magic: [u8; 4],
    /// Blocks of the area (two copies of the dictionary, each in the first or the second
    /// half).
    pub area_blocks: U32,
    /// First block of the area (metadata device).
    pub area_start: U64,
    /// The installed dictionary's zstd id (0: none installed).
    pub id: U32,
    /// Its length in bytes.
    pub len: U32,
    /// crc32c of its bytes.
    pub crc: U32,
    /// Zero.
    pub reserved: U32,
}

const _: () = assert!(std::mem::size_of::<DictRaw>() == 32);
const _: () = assert!(
    crate::metadata::stripe::STRIPE_RECORD_OFFSET + std::mem::size_of::<crate::metadata::stripe::StripeRaw>()
        <= DICT_RECORD_OFFSET
);
const _: () = assert!(DICT_RECORD_OFFSET + std::mem::size_of::<DictRaw>() <= BLOCK_SIZE);

/// The dictionary a volume has installed (`data::dictionary`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DictInfo {
    /// zstd dictionary id, as frames compressed with it carry it (never 0).
    pub id: u32,
    /// Bytes.
    pub len: u32,
    /// crc32c of the bytes.
    pub crc: u32,
}

impl LifetimeRaw {
    fn encode(c: &LifetimeCounters) -> Self {
        LifetimeRaw {
            magic: LIFETIME_MAGIC,
            words_count: U32::new(LifetimeCounters::WORDS as u32),
            words: c.to_words().map(U64::new),
        }
    }

    /// Zero counters when the record is absent.
    fn decode(block: &[u8]) -> LifetimeCounters {
        let raw = block.get(LIFETIME_RECORD_OFFSET..).and_then(|b| LifetimeRaw::read_from_prefix(b).ok());
        let Some((raw, _)) = raw.filter(|(r, _)| r.magic == LIFETIME_MAGIC) else {
            return LifetimeCounters::default();
        };
        let count = raw.words_count.get() as usize;
        LifetimeCounters::from_words(std::array::from_fn(|i| {
            raw.words.get(i).filter(|_| i < count).map_or(0, |w| w.get())
        }))
    }
}

/// The dictionary record of a superblock copy of `version`: (area start, area blocks,
/// the installed dictionary). No record: no area. Versions 6 and 7 must name a
/// dictionary that fits its area's halves; older ones must not name one.
fn decode_dict(buf: &[u8], version: u32) -> Result<(u64, u64, Option<DictInfo>)> {
    let bad = |expected: String, found: String| Err(Error::corruption("superblock copy", 0, expected, found));
    let raw = buf.get(DICT_RECORD_OFFSET..).and_then(|b| DictRaw::read_from_prefix(b).ok()).map(|(r, _)| r);
    let with_dict = version >= FORMAT_VERSION_DICT;
    let Some(raw) = raw.filter(|r| r.magic == DICT_MAGIC) else {
        if with_dict {
            return bad(format!("a dictionary record in a version {version} superblock"), "none".into());
        }
        return Ok((0, 0, None));
    };
    let (start, blocks) = (raw.area_start.get(), u64::from(raw.area_blocks.get()));
    let id = raw.id.get();
    if !with_dict {
        if id != 0 {
            return bad(format!("no dictionary in a version {version} volume"), format!("dictionary {id}"));
        }
        return Ok((start, blocks, None));
    }
    let len = raw.len.get();
    let half_bytes = blocks / 2 * BLOCK_SIZE_U64;
    if id == 0 || len == 0 || len as usize > crate::data::dictionary::DICT_BYTES_MAX || u64::from(len) > half_bytes {
        return bad(
            format!("an installed dictionary that fits half of a {blocks}-block area"),
            format!("dictionary {id} of {len} bytes"),
        );
    }
    Ok((start, blocks, Some(DictInfo { id, len, crc: raw.crc.get() })))
}

/// A decoded superblock.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Superblock {
    /// Volume identity.
    pub uuid: [u8; 16],
    /// Write counter.
    pub generation: u64,
    /// Compressor.
    pub compression: Compression,
    /// zstd level (0: the default); 0 for other codecs.
    pub compression_level: i8,
    /// zstd level of data at rest (0: off; see `FormatOptions::rest_level`).
    pub rest_level: i8,
    /// Dedup on/off.
    pub dedup: bool,
    /// Verification mode.
    pub verify: DedupVerify,
    /// Default write policy.
    pub write_policy: WritePolicy,
    /// Closed cleanly.
    pub clean: bool,
    /// Region placement.
    pub geometry: Geometry,
    /// Index memory chosen at format (an upper bound on the volume index).
    pub index_memory_bytes: u64,
    /// Dense or sparse fingerprint index.
    pub index_mode: IndexMode,
    /// The chapter ring keeps name pages (`dedup::chapter`); false in volumes made before
    /// they existed, whose ring is read as record pages only.
    pub index_names: bool,
    /// Largest extent the volume forms, in 4 KiB blocks (1..=`UNIT_BLOCKS_MAX`; 0 in
    /// volumes formatted before the setting existed, which means the largest). A write
    /// policy, not a layout: any build decodes extents of any size, and a build that
    /// predates the setting ignores it.
    pub extent_blocks_max: u8,
    /// Next journal entry sequence (when clean).
    pub next_entry_seq: u64,
    /// Next journal block sequence (when clean).
    pub next_block_seq: u64,
    /// Mapped data blocks (when clean).
    pub mapped_blocks: u64,
    /// Zero-mapped blocks (when clean).
    pub zero_blocks: u64,
    /// Saved index entries (when clean).
    pub index_saved_entries: u64,
    /// Metadata device path hint.
    pub meta_path: Option<String>,
    /// Counters over the volume's life, as of this superblock write.
    pub lifetime: LifetimeCounters,
    /// The data region's stripe over several devices (None: one data device).
    pub stripe: Option<StripeLayout>,
    /// The installed zstd dictionary (None: none yet, or no dictionary area).
    pub dictionary: Option<DictInfo>,
}

impl Superblock {
    /// Encodes one copy for `role` (0 data, 1 metadata).
    pub fn encode(&self, role: u8) -> Vec<u8> {
        let g = &self.geometry;
        let mut meta_path = [0u8; META_PATH_BYTES_MAX];
        let path_bytes = self.meta_path.as_deref().unwrap_or("").as_bytes();
        let n = path_bytes.len().min(META_PATH_BYTES_MAX);
        if let (Some(dst), Some(src)) = (meta_path.get_mut(..n), path_bytes.get(..n)) {
            dst.copy_from_slice(src);
        }
        let raw = SuperblockRaw {
            magic: SUPERBLOCK_MAGIC,
            checksum: U32::new(0),
            version: U32::new(match (self.stripe.is_some(), self.rest_level != 0, self.dictionary.is_some()) {
                (false, _, true) => FORMAT_VERSION_DICT,
                (true, _, true) => FORMAT_VERSION_DICT_STRIPED,
                (false, false, false) => FORMAT_VERSION,
                (true, false, false) => FORMAT_VERSION_STRIPED,
                (false, true, false) => FORMAT_VERSION_REST,
                (true, true, false) => FORMAT_VERSION_REST_STRIPED,
            }),
            uuid: self.uuid,
            generation: U64::new(self.generation),
            role,
            compression: self.compression.code(),
            dedup: u8::from(self.dedup),
            verify: u8::from(self.verify == DedupVerify::Hash),
            write_policy: u8::from(self.write_policy == WritePolicy::Async),
            clean: u8::from(self.clean),
            has_meta_dev: u8::from(g.meta_dev_blocks > 0),
            index_mode: self.index_mode.code(),
            logical_blocks: U64::new(g.logical_blocks),
            data_dev_blocks: U64::new(g.data_dev_blocks),
            meta_dev_blocks: U64::new(g.meta_dev_blocks),
            journal_start: U64::new(g.journal_start),
            journal_blocks: U64::new(g.journal_blocks),
            refcount_start: U64::new(g.refcount_start),
            refcount_pages: U64::new(g.refcount_pages),
            block_map_start: U64::new(g.block_map_start),
            block_map_pages: U64::new(g.block_map_pages),
            index_start: U64::new(g.index_start),
            index_blocks: U64::new(g.index_blocks),
            data_start: U64::new(g.data_start),
            data_blocks: U64::new(g.data_blocks),
            slab_blocks: U64::new(g.slab_blocks),
            index_memory_bytes: U64::new(self.index_memory_bytes),
            next_entry_seq: U64::new(self.next_entry_seq),
            next_block_seq: U64::new(self.next_block_seq),
            mapped_blocks: U64::new(self.mapped_blocks),
            zero_blocks: U64::new(self.zero_blocks),
            index_saved_entries: U64::new(self.index_saved_entries),
            meta_path_len: U16::new(n as u16),
            compression_level: self.compression_level.to_le_bytes()[0],
            rest_level: self.rest_level.to_le_bytes()[0],
            reserved1: [u8::from(self.index_names), self.extent_blocks_max, 0, 0],
            meta_path,
        };
        let mut buf = vec![0u8; BLOCK_SIZE];
        let _ = raw.write_to_prefix(&mut buf);
        if let Some(tail) = buf.get_mut(LIFETIME_RECORD_OFFSET..) {
            let _ = LifetimeRaw::encode(&self.lifetime).write_to_prefix(tail);
        }
        if let Some(stripe) = &self.stripe {
            stripe.encode_into(&mut buf);
        }
        if g.dict_blocks > 0 {
            let d = self.dictionary.unwrap_or(DictInfo { id: 0, len: 0, crc: 0 });
            let raw = DictRaw {
                magic: DICT_MAGIC,
                area_blocks: U32::new(u32::try_from(g.dict_blocks).unwrap_or(0)),
                area_start: U64::new(g.dict_start),
                id: U32::new(d.id),
                len: U32::new(d.len),
                crc: U32::new(d.crc),
                reserved: U32::new(0),
            };
            if let Some(tail) = buf.get_mut(DICT_RECORD_OFFSET..) {
                let _ = raw.write_to_prefix(tail);
            }
        }
        crate::codec::seal_crc(&mut buf, SUPERBLOCK_CRC_OFFSET);
        buf
    }

    /// Decodes one copy; `Ok(None)` when the block holds no dedupvol magic at all. A damaged
    /// copy is `Error::Corruption` of a "superblock copy" at address 0: the block alone does
    /// not say which copy it is, and [`Superblock::read`] names the copy it read.
    pub fn decode(buf: &[u8], expect_role: u8) -> Result<Option<Superblock>> {
        let Ok((raw, _)) = SuperblockRaw::read_from_prefix(buf) else {
            return Ok(None);
        };
        if raw.magic != SUPERBLOCK_MAGIC {
            return Ok(None);
        }
        if !crate::codec::crc_ok(buf, SUPERBLOCK_CRC_OFFSET) {
            return Err(Error::corruption(
                "superblock copy",
                0,
                format!("checksum {:#010x}", crate::codec::block_crc(buf, SUPERBLOCK_CRC_OFFSET)),
                format!("{:#010x} (checksum mismatch)", raw.checksum.get()),
            ));
        }
        if raw.version.get() == 1 {
            // Version 1 packed compressed blocks 14 to a physical block behind 10-byte map
            // entries; this build stores byte-granular fragments and extents behind 16-byte
            // entries, and does not read the old layout.
            return Err(Error::NotAVolume(
                "a format version 1 volume (10-byte map entries, packed blocks of 14 fragments); this build \
                 reads version 2 only: export it with a version 1 build (`dedupvol export`) and import it here"
                    .to_string(),
            ));
        }
        let version = raw.version.get();
        if !(FORMAT_VERSION..=FORMAT_VERSION_DICT_STRIPED).contains(&version) {
            return Err(Error::NotAVolume(format!(
                "unsupported format version {version} (this build reads versions {FORMAT_VERSION} to \
                 {FORMAT_VERSION_DICT_STRIPED})"
            )));
        }
        let striped =
            matches!(version, FORMAT_VERSION_STRIPED | FORMAT_VERSION_REST_STRIPED | FORMAT_VERSION_DICT_STRIPED);
        if raw.role == MEMBER_ROLE {
            // Block 0 of an extra data device: say which device it is.
            let what = match MemberHeader::decode(buf) {
                Ok(h) => format!(
                    "data device {} of {} of striped volume {}",
                    h.device_index,
                    h.device_count,
                    crate::volume::uuid_hex(&h.uuid)
                ),
                Err(e) => e,
            };
            return Err(Error::NotAVolume(format!(
                "this is {what}, not a volume's first data device (open the volume by its first device)"
            )));
        }
        if raw.role != expect_role {
            return Err(Error::NotAVolume(format!(
                "superblock role {} but expected {} ({})",
                raw.role,
                expect_role,
                if expect_role == 0 {
                    "a data device was given a metadata device"
                } else {
                    "the metadata device is a data device"
                }
            )));
        }
        let compression = Compression::from_code(raw.compression).ok_or_else(|| {
            Error::corruption(
                "superblock copy",
                0,
                "a known compression code",
                format!("compression code {}", raw.compression),
            )
        })?;
        let compression_level = i8::from_le_bytes([raw.compression_level]);
        let level_ok = match compression {
            Compression::Zstd => {
                compression_level == 0
                    || (crate::config::ZSTD_LEVEL_MIN..=crate::config::ZSTD_LEVEL_MAX).contains(&compression_level)
            }
            Compression::Lz4 | Compression::None => compression_level == 0,
        };
        if !level_ok {
            return Err(Error::corruption(
                "superblock copy",
                0,
                format!("a {compression} level the codec accepts"),
                format!("compression level {compression_level}"),
            ));
        }
        // Byte 211 was reserved (zero) in versions 2 and 3.
        let rest_level = i8::from_le_bytes([raw.rest_level]);
        let rest_ok = if version >= FORMAT_VERSION_REST {
            compression == Compression::Zstd && (1..=crate::config::ZSTD_LEVEL_MAX).contains(&rest_level)
        } else {
            rest_level == 0
        };
        if !rest_ok {
            return Err(Error::corruption(
                "superblock copy",
                0,
                format!("a rest level a version {version} {compression} volume can have"),
                format!("rest level {rest_level}"),
            ));
        }
        let index_mode = IndexMode::from_code(raw.index_mode).ok_or_else(|| {
            Error::corruption("superblock copy", 0, "index mode 0 or 1", format!("index mode {}", raw.index_mode))
        })?;
        // Byte 212 was reserved (zero) before name pages existed.
        let index_names = match raw.reserved1[0] {
            0 => false,
            1 => true,
            b => {
                return Err(Error::corruption(
                    "superblock copy",
                    0,
                    "index ring layout 0 or 1 (byte 212)",
                    format!("index ring layout {b}"),
                ))
            }
        };
        // Byte 213 was reserved (zero) before the extent cap existed: zero still means
        // none set.
        let extent_blocks_max = raw.reserved1[1];
        if extent_blocks_max > crate::metadata::block_map::UNIT_BLOCKS_MAX {
            return Err(Error::corruption(
                "superblock copy",
                0,
                format!("an extent cap of at most {} blocks (byte 213)", crate::metadata::block_map::UNIT_BLOCKS_MAX),
                format!("{extent_blocks_max} blocks"),
            ));
        }
        let (dict_start, dict_blocks, dictionary) = decode_dict(buf, version)?;
        let geometry = Geometry {
            logical_blocks: raw.logical_blocks.get(),
            data_dev_blocks: raw.data_dev_blocks.get(),
            meta_dev_blocks: raw.meta_dev_blocks.get(),
            journal_start: raw.journal_start.get(),
            journal_blocks: raw.journal_blocks.get(),
            refcount_start: raw.refcount_start.get(),
            refcount_pages: raw.refcount_pages.get(),
            block_map_start: raw.block_map_start.get(),
            block_map_pages: raw.block_map_pages.get(),
            index_start: raw.index_start.get(),
            index_blocks: raw.index_blocks.get(),
            dict_start,
            dict_blocks,
            data_start: raw.data_start.get(),
            data_blocks: raw.data_blocks.get(),
            slab_blocks: raw.slab_blocks.get(),
        };
        geometry.validate()?;
        let stripe = if striped {
            let s = StripeLayout::decode(buf)?;
            s.validate(&geometry)?;
            Some(s)
        } else {
            None
        };
        let n = usize::from(raw.meta_path_len.get()).min(META_PATH_BYTES_MAX);
        let meta_path =
            raw.meta_path.get(..n).filter(|s| !s.is_empty()).map(|s| String::from_utf8_lossy(s).into_owned());
        Ok(Some(Superblock {
            uuid: raw.uuid,
            generation: raw.generation.get(),
            compression,
            compression_level,
            rest_level,
            dedup: raw.dedup != 0,
            verify: if raw.verify != 0 { DedupVerify::Hash } else { DedupVerify::Bytes },
            write_policy: if raw.write_policy != 0 { WritePolicy::Async } else { WritePolicy::Sync },
            clean: raw.clean != 0,
            geometry,
            index_memory_bytes: raw.index_memory_bytes.get(),
            index_mode,
            index_names,
            extent_blocks_max,
            next_entry_seq: raw.next_entry_seq.get(),
            next_block_seq: raw.next_block_seq.get(),
            mapped_blocks: raw.mapped_blocks.get(),
            zero_blocks: raw.zero_blocks.get(),
            index_saved_entries: raw.index_saved_entries.get(),
            meta_path,
            lifetime: LifetimeRaw::decode(buf),
            stripe,
            dictionary,
        }))
    }

    /// True when either superblock copy on `dev` carries the dedupvol magic, whatever its
    /// role, version or checksum: `format` refuses to overwrite such a device without
    /// `force`. A copy that cannot be read may hold a volume, so an unreadable device with
    /// no magic seen is an error, never "no volume".
    pub fn probe(dev: &Dev) -> Result<bool> {
        if dev.len() < 2 * BLOCK_SIZE_U64 {
            return Ok(false);
        }
        let mut io_error = None;
        for copy in 0..2u64 {
            let mut buf = vec![0u8; BLOCK_SIZE];
            match dev.read(IoKind::Superblock, &mut buf, copy * BLOCK_SIZE_U64) {
                Ok(()) if buf.starts_with(&SUPERBLOCK_MAGIC) => return Ok(true),
                Ok(()) => {}
                Err(e) => io_error = Some(e),
            }
        }
        io_error.map_or(Ok(false), Err)
    }

    /// Reads both copies from `dev` and returns the newest valid one, plus a note for each
    /// copy that was unreadable or corrupt (for `check`).
    pub fn read(dev: &Dev, role: u8) -> Result<(Superblock, Vec<String>)> {
        Self::read_copy(dev, role).map(|(sb, _, notes)| (sb, notes))
    }

    /// `read`, also saying which copy (0 or 1) the superblock came from.
    pub fn read_copy(dev: &Dev, role: u8) -> Result<(Superblock, u64, Vec<String>)> {
        let mut best: Option<(Superblock, u64)> = None;
        let mut notes = Vec::new();
        let mut saw_magic = false;
        let mut io_error: Option<Error> = None;
        // What is wrong with each copy, without the device name (the error names it once).
        let mut faults: Vec<String> = Vec::new();
        if dev.len() < 2 * BLOCK_SIZE_U64 {
            return Err(Error::NotAVolume(format!("{} is too small to hold a volume", dev.name())));
        }
        for copy in 0..2u64 {
            let mut buf = vec![0u8; BLOCK_SIZE];
            if let Err(e) = dev.read(IoKind::Superblock, &mut buf, copy * BLOCK_SIZE_U64) {
                notes.push(format!("superblock copy {copy} of {} unreadable: {e}", dev.name()));
                faults.push(format!("copy {copy} unreadable: {e}"));
                io_error = Some(e);
                continue;
            }
            match Superblock::decode(&buf, role) {
                Ok(Some(sb)) => {
                    saw_magic = true;
                    if best.as_ref().is_none_or(|(b, _)| sb.generation > b.generation) {
                        best = Some((sb, copy));
                    }
                }
                Ok(None) => {
                    notes.push(format!("superblock copy {copy} of {} has no dedupvol magic", dev.name()));
                    faults.push(format!("copy {copy} has no dedupvol magic"));
                }
                Err(e @ Error::NotAVolume(_)) => return Err(e),
                Err(Error::Corruption(c)) => {
                    saw_magic = true;
                    let c = Corruption { address: copy, ..c };
                    notes.push(format!("corruption detected on {}: {c}", dev.name()));
                    faults.push(format!("copy {copy} holds {}", c.found));
                }
                Err(e) => {
                    saw_magic = true;
                    notes.push(format!("superblock copy {copy} of {}: {e}", dev.name()));
                    faults.push(format!("copy {copy}: {e}"));
                }
            }
        }
        match (best, io_error) {
            (Some((sb, copy)), _) => Ok((sb, copy, notes)),
            // A copy we could not read may hold a volume: never report "no volume" then,
            // or a format without --force would destroy it.
            (None, Some(e)) if !saw_magic => Err(e),
            (None, _) if saw_magic => Err(Error::corruption(
                "superblock copy",
                1,
                format!("a valid copy 0 or 1 on {}", dev.name()),
                format!("both copies corrupt: {}", faults.join("; ")),
            )),
            (None, _) => Err(Error::NotAVolume(format!("{} does not hold a dedupvol volume", dev.name()))),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample() -> Superblock {
        Superblock {
            uuid: [9; 16],
            generation: 3,
            compression: Compression::Zstd,
            compression_level: -3,
            rest_level: 0,
            dedup: true,
            verify: DedupVerify::Bytes,
            write_policy: WritePolicy::Async,
            clean: true,
            geometry: Geometry::compute(1 << 16, 64 << 20, None, 256, None, 256).expect("geometry"),
            index_memory_bytes: 1 << 20,
            index_mode: IndexMode::Sparse,
            index_names: true,
            extent_blocks_max: 4,
            next_entry_seq: 77,
            next_block_seq: 5,
            mapped_blocks: 10,
            zero_blocks: 2,
            index_saved_entries: 0,
            meta_path: Some("/dev/fast".into()),
            lifetime: LifetimeCounters { read_write_opens: 3, blocks_written: 1 << 40, syncs: 9, ..Default::default() },
            stripe: None,
            dictionary: None,
        }
    }

    /// A dictionary area is recorded at byte 3072 without a version change; an installed
    /// dictionary makes the volume version 6 (7 striped), and every inconsistency between
    /// version and record is refused.
    #[test]
    fn a_dictionary_is_version_6_and_its_record_checked() {
        let mut sb = sample();
        assert_eq!(sb.geometry.dict_blocks, crate::metadata::layout::DICT_AREA_BLOCKS);
        sb.rest_level = 6;
        let buf = sb.encode(0);
        assert_eq!(u32::from_le_bytes(buf[12..16].try_into().expect("4")), FORMAT_VERSION_REST);
        assert_eq!(Superblock::decode(&buf, 0).expect("decode"), Some(sb.clone()));
        sb.dictionary = Some(DictInfo { id: 70_000, len: 100 << 10, crc: 0xdead_beef });
        let buf = sb.encode(0);
        assert_eq!(u32::from_le_bytes(buf[12..16].try_into().expect("4")), FORMAT_VERSION_DICT);
        assert_eq!(Superblock::decode(&buf, 0).expect("decode"), Some(sb.clone()));
        // A version 6 block whose record names no dictionary, or one larger than half the
        // area, or without the record at all.
        for (at, bytes) in [(3072 + 16, 0u32), (3072 + 20, 200 << 10)] {
            let mut bad = buf.clone();
            bad[at..at + 4].copy_from_slice(&bytes.to_le_bytes());
            crate::codec::seal_crc(&mut bad, SUPERBLOCK_CRC_OFFSET);
            assert!(matches!(Superblock::decode(&bad, 0), Err(Error::Corruption(_))), "byte {at} = {bytes} accepted");
        }
        let mut bad = buf.clone();
        bad[3072..3076].fill(0);
        crate::codec::seal_crc(&mut bad, SUPERBLOCK_CRC_OFFSET);
        assert!(matches!(Superblock::decode(&bad, 0), Err(Error::Corruption(_))));
        // A version 4 block naming a dictionary.
        let mut bad = buf.clone();
        bad[12..16].copy_from_slice(&FORMAT_VERSION_REST.to_le_bytes());
        crate::codec::seal_crc(&mut bad, SUPERBLOCK_CRC_OFFSET);
        assert!(matches!(Superblock::decode(&bad, 0), Err(Error::Corruption(_))));
        // A block without the record (a volume formatted before dictionaries): no area.
        let mut old = sample();
        old.rest_level = 6;
        let mut buf = old.encode(0);
        buf[3072..3104].fill(0);
        crate::codec::seal_crc(&mut buf, SUPERBLOCK_CRC_OFFSET);
        let got = Superblock::decode(&buf, 0).expect("decode").expect("a volume");
        assert_eq!((got.geometry.dict_blocks, got.dictionary), (0, None));
    }

    #[test]
    fn round_trip_and_corruption() {
        let sb = sample();
        let mut buf = sb.encode(0);
        assert_eq!(Superblock::decode(&buf, 0).expect("decode"), Some(sb.clone()));
        assert!(Superblock::decode(&buf, 1).is_err(), "role mismatch must be refused");
        buf[300] ^= 4;
        assert!(matches!(
            Superblock::decode(&buf, 0),
            Err(Error::Corruption(Corruption { structure: "superblock copy", .. }))
        ));
        assert_eq!(Superblock::decode(&[0u8; 4096], 0).expect("blank"), None);
    }

    /// A rest level makes version 4 (a build that does not know settled fragments refuses
    /// the volume by its version); byte 211 must agree with the version and the codec.
    #[test]
    fn a_rest_level_is_version_4_and_checked() {
        let mut sb = sample();
        sb.rest_level = 9;
        let mut buf = sb.encode(0);
        assert_eq!(buf[12..16], FORMAT_VERSION_REST.to_le_bytes());
        assert_eq!(buf[211], 9);
        assert_eq!(Superblock::decode(&buf, 0).expect("decode"), Some(sb.clone()));
        // A version 2 block with the byte set, and version 4 blocks with it out of range.
        let mut cases: Vec<(u32, u8)> = vec![(FORMAT_VERSION, 9), (FORMAT_VERSION_REST, 0), (FORMAT_VERSION_REST, 20)];
        cases.push((FORMAT_VERSION_REST, (-1i8).to_le_bytes()[0]));
        for (version, level) in cases {
            buf[12..16].copy_from_slice(&version.to_le_bytes());
            buf[211] = level;
            crate::codec::seal_crc(&mut buf, SUPERBLOCK_CRC_OFFSET);
            assert!(
                matches!(Superblock::decode(&buf, 0), Err(Error::Corruption(_))),
                "version {version} with rest level {level} accepted"
            );
        }
        // A rest level on an LZ4 volume.
        let mut lz4 = sample();
        lz4.compression = Compression::Lz4;
        lz4.compression_level = 0;
        lz4.rest_level = 6;
        assert!(Superblock::decode(&lz4.encode(0), 0).is_err());
        // Unknown versions are refused by name.
        buf[12..16].copy_from_slice(&8u32.to_le_bytes());
        crate::codec::seal_crc(&mut buf, SUPERBLOCK_CRC_OFFSET);
        assert!(matches!(Superblock::decode(&buf, 0), Err(Error::NotAVolume(m)) if m.contains("version 8")));
    }

    /// The extent cap lives in byte 213 without a version change: zero (every volume
    /// formatted before it existed) and 1..=16 decode, anything larger is refused.
    #[test]
    fn the_extent_cap_is_byte_213_and_checked() {
        let sb = sample();
        let mut buf = sb.encode(0);
        assert_eq!(buf[12..16], FORMAT_VERSION.to_le_bytes());
        assert_eq!(buf[213], 4);
        assert_eq!(Superblock::decode(&buf, 0).expect("decode"), Some(sb.clone()));
        for (byte, ok) in [(0u8, true), (1, true), (16, true), (17, false), (255, false)] {
            buf[213] = byte;
            crate::codec::seal_crc(&mut buf, SUPERBLOCK_CRC_OFFSET);
            let got = Superblock::decode(&buf, 0);
            match got {
                Ok(Some(d)) => assert!(ok && d.extent_blocks_max == byte, "extent cap {byte} decoded as {d:?}"),
                Err(Error::Corruption(_)) => assert!(!ok, "extent cap {byte} refused"),
                other => panic!("extent cap {byte}: {other:?}"),
            }
        }
    }

    /// Volumes formatted before the lifetime record existed hold zeros in the block's
    /// tail: they must open, with zero lifetime counters.
    #[test]
    fn a_superblock_without_the_lifetime_record_has_zero_counters() {
        let mut buf = sample().encode(0);
        buf[LIFETIME_RECORD_OFFSET..LIFETIME_RECORD_OFFSET + std::mem::size_of::<LifetimeRaw>()].fill(0);
        crate::codec::seal_crc(&mut buf, SUPERBLOCK_CRC_OFFSET);
        let sb = Superblock::decode(&buf, 0).expect("decode").expect("a volume");
        assert_eq!(sb.lifetime, LifetimeCounters::default());
        assert_eq!(sb.uuid, sample().uuid);
    }

    /// A record written by a version that kept fewer counters: the missing ones are zero.
    #[test]
    fn a_shorter_lifetime_record_reads_missing_counters_as_zero() {
        let mut buf = sample().encode(0);
        buf[LIFETIME_RECORD_OFFSET + 4..LIFETIME_RECORD_OFFSET + 8].copy_from_slice(&3u32.to_le_bytes());
        crate::codec::seal_crc(&mut buf, SUPERBLOCK_CRC_OFFSET);
        let sb = Superblock::decode(&buf, 0).expect("decode").expect("a volume");
        let want = LifetimeCounters { read_write_opens: 3, blocks_written: 1 << 40, ..Default::default() };
        assert_eq!(sb.lifetime, want, "counters 0..3 kept, the rest (syncs) read as zero");
    }

    /// A striped volume's superblock carries version 3 and its stripe record; an extra
    /// device's header, read as a superblock, is refused with a message naming it.
    #[test]
    fn a_striped_superblock_round_trips_and_a_member_header_is_named() {
        use crate::metadata::stripe::{MemberHeader, StripeLayout};
        let mut sb = sample();
        let per_device = sb.geometry.data_blocks / 2 / 256;
        sb.geometry.data_blocks = 2 * per_device * 256;
        sb.geometry.data_dev_blocks = sb.geometry.data_start + sb.geometry.data_blocks;
        sb.stripe =
            Some(StripeLayout { unit_blocks: 256, rows: per_device, member_data_start: 2, paths: vec!["/x".into()] });
        let buf = sb.encode(0);
        assert_eq!(buf[12..16], FORMAT_VERSION_STRIPED.to_le_bytes());
        assert_eq!(Superblock::decode(&buf, 0).expect("decode"), Some(sb.clone()));
        // A stripe that does not add up to the data region is a damaged copy.
        let mut bad = sb.clone();
        if let Some(s) = bad.stripe.as_mut() {
            s.rows += 1;
        }
        assert!(matches!(Superblock::decode(&bad.encode(0), 0), Err(Error::Corruption(_))));
        let stripe = sb.stripe.as_ref().expect("stripe");
        let header = MemberHeader::for_device(sb.uuid, 1, stripe).encode();
        match Superblock::decode(&header, 0) {
            Err(Error::NotAVolume(m)) => assert!(m.contains("data device 1 of 2"), "{m}"),
            other => panic!("a member header decoded as {other:?}"),
        }
    }

    /// Volumes formatted before the level existed hold 0 in its byte: zstd at the
    /// default level, which is what they compressed with. A level no codec accepts is a
    /// damaged copy, not a setting.
    #[test]
    fn a_zero_compression_level_is_the_default_and_a_bad_one_is_refused() {
        let mut buf = sample().encode(0);
        assert_eq!(buf[210], (-3i8).to_le_bytes()[0]);
        buf[210] = 0;
        crate::codec::seal_crc(&mut buf, SUPERBLOCK_CRC_OFFSET);
        let sb = Superblock::decode(&buf, 0).expect("decode").expect("a volume");
        assert_eq!(crate::config::effective_level(sb.compression, sb.compression_level), 1);
        buf[210] = 100;
        crate::codec::seal_crc(&mut buf, SUPERBLOCK_CRC_OFFSET);
        assert!(Superblock::decode(&buf, 0).is_err());
    }
}
