//! The volume's zstd dictionary: trained once from the volume's own data, kept in the
//! dictionary area of the metadata device, and used to compress small units at rest.
//!
//! Why: zstd finds its matches in the unit it compresses. A 16 KiB unit has little to
//! match against, a 64 KiB one four times as much, so large units store less; but a
//! random 4 KiB read of an extent decodes its unit up to the block it wants, so large
//! units read slower. A dictionary gives every small unit the common strings of the
//! volume's data to match against from its first byte. Measured at zstd level 6 (the
//! rest level) with a 112 KiB dictionary, 16 KiB units: a /usr tar 1.81× → 1.87× (64 KiB
//! units without one: 1.86×), the linux-source tar 4.22× → 4.86× (64 KiB: 4.94×). Level 1
//! gains under 1 %: zstd's fastest strategy barely looks into a dictionary, so only data
//! at rest is compressed with it.
//!
//! Life of a dictionary: the recompressor's first settling pass that finds at least
//! `TRAIN_MIN_BYTES` of data samples it (`TRAIN_SAMPLE_BYTES` at most), trains one, and
//! installs it (`Volume::install_dictionary`): both copies written to the area and
//! synced, then the superblock names it (format version 6, or 7 striped). Only then is
//! anything compressed with it, so every fragment that needs it finds it named by a
//! durable superblock. A volume keeps its dictionary for life.
//!
//! Frames carry the dictionary's id in their header (zstd's own field), so a decoder
//! knows from the fragment alone whether it needs one. Decoders find the dictionary by
//! that id in a process-wide registry that open volumes fill (`register`): the decode
//! paths (reads, the cleaner, scrub, verification, the audit) take a fragment and no
//! volume, and a dictionary id is drawn at random from 2^31 values per volume, so two
//! volumes open in one process collide with negligible odds; a collision is refused at
//! registration, never decoded with the wrong dictionary (and a wrong decode would fail
//! the block's crc32c anyway).
//!
//! Invariants:
//! - A dictionary is at most `DICT_BYTES_MAX` bytes, its id is nonzero and equals the id
//!   in its header (`with_id`), and its crc32c is the one the superblock records.
//! - Only units of at most `DICT_UNIT_BYTES_MAX` are compressed with it: they decode in
//!   one call (`packer::decompress`), never through the zstd-block-by-block prefix decoder.
//! - The registry holds weak references: a dictionary lives while a volume uses it.

use crate::config::{BLOCK_SIZE, BLOCK_SIZE_U64};
use crate::error::{Error, Result};
use crate::io::{Dev, IoKind};
use crate::metadata::superblock::DictInfo;
use parking_lot::Mutex;
use std::collections::HashMap;
use std::sync::{Arc, Weak};

/// Largest dictionary: zstd's own default size for trained dictionaries (about 110 KB),
/// rounded to whole blocks. Measured on 16 KiB units of a /usr tar at level 6: 32 KiB
/// gains 2.4 %, 64 KiB 2.8 %, 112 KiB 3.2 % (the kernel tar: 11.5, 13.7, 15.2 %).
pub const DICT_BYTES_MAX: usize = 112 << 10;

/// Largest unit compressed with the dictionary: units up to one zstd block of an extent
/// (`zstd_prefix::EXTENT_ZSTD_BLOCK_BYTES`), which decode whole in one call.
pub const DICT_UNIT_BYTES_MAX: usize = super::zstd_prefix::EXTENT_ZSTD_BLOCK_BYTES as usize;

/// Data a settling pass must find before it trains: less gives the trainer too few
/// samples to find what is common (and a small volume gains little anyway).
pub const TRAIN_MIN_BYTES: usize = 4 << 20;

/// Data sampled for training at most (spread over the pass's groups): the trainer's time
/// grows with it, and past a few MiB the dictionary barely improves.
pub const TRAIN_SAMPLE_BYTES: usize = 8 << 20;

/// Sample bytes per dictionary byte at least (the trainer's own advice is about 100;
/// fewer still helps, and a volume that small has little data to settle anyway).
const TRAIN_DATA_PER_DICT_BYTE: usize = 16;

/// zstd's dictionary magic (little-endian, first four bytes of a dictionary).
const ZSTD_DICT_MAGIC: u32 = 0xEC30_A437;

/// A dictionary, as stored and as used.
pub struct Dictionary {
    /// What the superblock records of it.
    pub info: DictInfo,
    /// Its bytes.
    pub bytes: Vec<u8>,
}

impl std::fmt::Debug for Dictionary {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Dictionary {{ id: {}, len: {} }}", self.info.id, self.bytes.len())
    }
}

impl Dictionary {
    /// A dictionary of `bytes` (id from its header), checked.
    pub fn new(bytes: Vec<u8>) -> Result<Dictionary> {
        let id = header_id(&bytes).ok_or_else(|| {
            Error::internal("a zstd dictionary without a dictionary header", format!("{} bytes", bytes.len()))
        })?;
        if bytes.len() > DICT_BYTES_MAX {
            return Err(Error::internal(
                "a dictionary over the size limit",
                format!("{} bytes, at most {DICT_BYTES_MAX}", bytes.len()),
            ));
        }
        let crc = crc32c::crc32c(&bytes);
        Ok(Dictionary { info: DictInfo { id, len: bytes.len() as u32, crc }, bytes })
    }
}

/// The id in a zstd dictionary's header (None: not a zstd dictionary, or id 0).
fn header_id(bytes: &[u8]) -> Option<u32> {
    let magic = u32::from_le_bytes(bytes.get(0..4)?.try_into().ok()?);
    let id = u32::from_le_bytes(bytes.get(4..8)?.try_into().ok()?);
    (magic == ZSTD_DICT_MAGIC && id != 0).then_some(id)
}

/// `bytes` (a zstd dictionary) with `id` written into its header.
fn with_id(mut bytes: Vec<u8>, id: u32) -> Option<Vec<u8>> {
    header_id(&bytes)?;
    bytes.get_mut(4..8)?.copy_from_slice(&id.to_le_bytes());
    Some(bytes)
}

/// A dictionary id for volume `uuid`, from a hash of it and `salt` (some of the training
/// data): in [2^16, 2^31), inside the range zstd leaves to private dictionaries and
/// always 4 bytes in a frame header, so a fragment's length never depends on the draw.
/// Deterministic, so that a simulator seed replays the same bytes.
pub fn fresh_id(uuid: &[u8; 16], salt: &[u8]) -> u32 {
    let mut h = blake3::Hasher::new();
    h.update(uuid);
    h.update(salt);
    let word = h.finalize().as_bytes().get(0..4).and_then(|b| b.try_into().ok()).map_or(1, u32::from_le_bytes);
    (1 << 16) + word % ((1 << 31) - (1 << 16))
}

/// Trains a dictionary on `samples` (units of the volume's data), with id `id`. None
/// when the trainer finds nothing to keep (too few samples, or data without common
/// strings).
pub fn train(samples: &[&[u8]], id: u32) -> Option<Dictionary> {
    let total: usize = samples.iter().map(|s| s.len()).sum();
    // The trainer wants several samples and many times more data than the dictionary it
    // makes: a small volume gets a smaller one.
    let size = (total / TRAIN_DATA_PER_DICT_BYTE).min(DICT_BYTES_MAX) / BLOCK_SIZE * BLOCK_SIZE;
    if samples.len() < 16 || size < BLOCK_SIZE {
        return None;
    }
    let bytes = zstd::dict::from_samples(samples, size).ok()?;
    Dictionary::new(with_id(bytes, id)?).ok()
}

/// The two copies' byte offsets on the metadata device: the area's halves.
fn copy_offsets(area: &std::ops::Range<u64>) -> [u64; 2] {
    let half = (area.end - area.start) / 2;
    [area.start * BLOCK_SIZE_U64, (area.start + half) * BLOCK_SIZE_U64]
}

/// `bytes` padded with zeros to whole blocks.
fn padded(bytes: &[u8]) -> Vec<u8> {
    let mut buf = bytes.to_vec();
    buf.resize(bytes.len().div_ceil(BLOCK_SIZE) * BLOCK_SIZE, 0);
    buf
}

/// Writes both copies of `d` into `area` of `dev` and syncs: the caller names it in the
/// superblock only after this returns.
pub fn write_copies(dev: &Dev, area: &std::ops::Range<u64>, d: &Dictionary) -> Result<()> {
    let half_bytes = (area.end - area.start) / 2 * BLOCK_SIZE_U64;
    if d.bytes.len() as u64 > half_bytes {
        return Err(Error::internal(
            "a dictionary larger than half its area",
            format!("{} bytes, {half_bytes} per copy", d.bytes.len()),
        ));
    }
    let buf = padded(&d.bytes);
    for off in copy_offsets(area) {
        dev.write(IoKind::Superblock, &buf, off)?;
    }
    dev.sync()
}

/// Copy `copy` (0: A, 1: B) of the installed dictionary `info` in `area` of `dev`, read
/// with I/O kind `kind`: its bytes when length, crc32c and header id match, else what was
/// found.
fn read_copy(
    dev: &Dev,
    area: &std::ops::Range<u64>,
    copy: usize,
    info: &DictInfo,
    kind: IoKind,
) -> std::result::Result<Vec<u8>, String> {
    let len = info.len as usize;
    let off = copy_offsets(area).get(copy).copied().ok_or("no such copy")?;
    let mut buf = vec![0u8; len.div_ceil(BLOCK_SIZE) * BLOCK_SIZE];
    dev.read(kind, &mut buf, off).map_err(|e| format!("copy at byte {off}: {e}"))?;
    buf.truncate(len);
    let crc = crc32c::crc32c(&buf);
    if crc == info.crc && header_id(&buf) == Some(info.id) {
        Ok(buf)
    } else {
        Err(format!("copy at byte {off}: crc {crc:#010x}"))
    }
}

/// Reads the installed dictionary `info` from `area` of `dev`: the first copy whose
/// header id, length and crc32c match. Both damaged: corruption (fragments compressed
/// with it cannot be decoded).
pub fn read(dev: &Dev, area: &std::ops::Range<u64>, info: &DictInfo) -> Result<Dictionary> {
    let mut found = Vec::new();
    for copy in 0..2 {
        match read_copy(dev, area, copy, info, IoKind::Superblock) {
            Ok(bytes) => return Dictionary::new(bytes),
            Err(e) => found.push(e),
        }
    }
    Err(Error::corruption(
        "dictionary area",
        area.start,
        format!("dictionary {} of {} bytes with crc {:#010x}", info.id, info.len, info.crc),
        found.join("; "),
    ))
}

/// For a scrub: whether each copy (A, B) of `info` in `area` is intact, or what is wrong
/// with it.
pub fn check_copies(dev: &Dev, area: &std::ops::Range<u64>, info: &DictInfo) -> [std::result::Result<(), String>; 2] {
    [0, 1].map(|copy| read_copy(dev, area, copy, info, IoKind::Scrub).map(|_| ()))
}

/// Writes copy `copy` (0: A, 1: B) of `d` into `area` of `dev` and syncs: a scrub's
/// repair of a damaged copy from the dictionary in use (which matched the superblock's
/// crc when it was read at open).
pub fn rewrite_copy(dev: &Dev, area: &std::ops::Range<u64>, copy: usize, d: &Dictionary) -> Result<()> {
    let off = copy_offsets(area)
        .get(copy)
        .copied()
        .ok_or_else(|| Error::internal("a dictionary copy that does not exist", format!("copy {copy}")))?;
    dev.write(IoKind::Scrub, &padded(&d.bytes), off)?;
    dev.sync()
}

/// Dictionaries of the open volumes, by id.
fn registry() -> &'static Mutex<HashMap<u32, Weak<Dictionary>>> {
    static REGISTRY: std::sync::OnceLock<Mutex<HashMap<u32, Weak<Dictionary>>>> = std::sync::OnceLock::new();
    REGISTRY.get_or_init(|| Mutex::new(HashMap::new()))
}

/// Makes `d` findable by decoders while it lives. An id already held by another live
/// dictionary with other bytes is refused (another open volume drew the same id).
pub fn register(d: &Arc<Dictionary>) -> Result<()> {
    let mut reg = registry().lock();
    reg.retain(|_, w| w.strong_count() > 0);
    if let Some(other) = reg.get(&d.info.id).and_then(Weak::upgrade) {
        if other.bytes != d.bytes {
            return Err(Error::InvalidArgument(format!(
                "dictionary id {} is already used by another open volume's dictionary; close that volume first",
                d.info.id
            )));
        }
    }
    reg.insert(d.info.id, Arc::downgrade(d));
    Ok(())
}

/// The live dictionary of id `id`.
fn lookup(id: u32) -> Option<Arc<Dictionary>> {
    registry().lock().get(&id).and_then(Weak::upgrade)
}

/// The dictionary id a zstd frame's header names (None: compressed without one).
pub fn frame_id(frame: &[u8]) -> Option<u32> {
    zstd::zstd_safe::get_dict_id_from_frame(frame).map(std::num::NonZeroU32::get)
}

/// Compresses `src` (at most `DICT_UNIT_BYTES_MAX`) with `d` at zstd `level` into at most
/// `limit` bytes, with the frame's content checksum (as every zstd fragment); None when
/// it does not fit.
pub fn compress(d: &Dictionary, level: i8, src: &[u8], limit: usize) -> Option<Vec<u8>> {
    thread_local! {
        // Keyed by the dictionary's bytes' address and crc as well as its id: a context is
        // never reused for another dictionary that drew the same id.
        #[allow(clippy::type_complexity)]
        static CTX: std::cell::RefCell<Option<((u32, u32, usize), i8, zstd::bulk::Compressor<'static>)>> =
            const { std::cell::RefCell::new(None) };
        static OUT: std::cell::RefCell<Vec<u8>> = const { std::cell::RefCell::new(Vec::new()) };
    }
    if src.len() > DICT_UNIT_BYTES_MAX {
        return None;
    }
    CTX.with(|c| {
        let mut c = c.borrow_mut();
        let key = (d.info.id, d.info.crc, d.bytes.as_ptr() as usize);
        if c.as_ref().is_none_or(|(k, l, _)| *k != key || *l != level) {
            let mut z = zstd::bulk::Compressor::with_dictionary(i32::from(level), &d.bytes).ok()?;
            z.include_checksum(true).ok()?;
            *c = Some((key, level, z));
        }
        let (_, _, z) = c.as_mut()?;
        OUT.with(|o| {
            let mut out = o.borrow_mut();
            out.resize(limit, 0);
            let n = z.compress_to_buffer(src, &mut out[..]).ok()?;
            out.get(..n).map(<[u8]>::to_vec)
        })
    })
}

/// Decodes `frame`, which names dictionary `id`, into `out`; the frame's checksum is
/// checked only when `checked` (see `packer::decompress`). An error names a dictionary
/// no open volume has.
pub fn decompress(id: u32, frame: &[u8], out: &mut [u8], checked: bool) -> std::result::Result<usize, String> {
    thread_local! {
        // A few dictionaries at most per thread (one per open volume), each context with
        // the dictionary it was made from: a context whose dictionary died (its volume
        // closed) is made again, since another volume may have registered the id since.
        #[allow(clippy::type_complexity)]
        static CTX: std::cell::RefCell<Vec<(u32, bool, Weak<Dictionary>, zstd::bulk::Decompressor<'static>)>> =
            const { std::cell::RefCell::new(Vec::new()) };
    }
    CTX.with(|c| {
        let mut c = c.borrow_mut();
        c.retain(|(_, _, d, _)| d.strong_count() > 0);
        let at = match c.iter().position(|(i, k, _, _)| *i == id && *k == checked) {
            Some(at) => at,
            None => {
                let d = lookup(id).ok_or_else(|| format!("needs dictionary {id}, which no open volume has"))?;
                let mut z = zstd::bulk::Decompressor::with_dictionary(&d.bytes).map_err(|e| e.to_string())?;
                z.set_parameter(zstd::zstd_safe::DParameter::ForceIgnoreChecksum(!checked))
                    .map_err(|e| e.to_string())?;
                // Bounded: a thread that met many volumes' dictionaries keeps the latest.
                if c.len() >= 8 {
                    c.remove(0);
                }
                c.push((id, checked, Arc::downgrade(&d), z));
                c.len() - 1
            }
        };
        let (_, _, _, z) = c.get_mut(at).ok_or("no zstd context")?;
        z.decompress_to_buffer(frame, out).map_err(|e| e.to_string())
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn text_units() -> Vec<Vec<u8>> {
        // Units of source-like text sharing a vocabulary, each different.
        let words =
            ["fn ", "let ", "mut ", "self", ".map(", "|x| ", "Result<", "Option<", "impl ", "pub ", "{\n", "}\n"];
        (0..600u64)
            .map(|u| {
                let mut x = u.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
                let mut v = Vec::with_capacity(BLOCK_SIZE * 4);
                while v.len() < BLOCK_SIZE * 4 {
                    x ^= x << 13;
                    x ^= x >> 7;
                    x ^= x << 17;
                    v.extend_from_slice(words[(x % words.len() as u64) as usize].as_bytes());
                    v.extend_from_slice(format!("{}", x % 1000).as_bytes());
                }
                v.truncate(BLOCK_SIZE * 4);
                v
            })
            .collect()
    }

    #[test]
    fn a_trained_dictionary_shrinks_small_units_and_round_trips() {
        let units = text_units();
        let samples: Vec<&[u8]> = units.iter().map(Vec::as_slice).collect();
        let d = Arc::new(train(&samples, 1_234_567).expect("trained"));
        assert_eq!(d.info.id, 1_234_567);
        assert_eq!(header_id(&d.bytes), Some(1_234_567));
        register(&d).expect("registered");
        let (mut plain, mut with) = (0, 0);
        for u in units.iter().take(50) {
            plain += crate::data::packer::compress(crate::config::Compression::Zstd, 6, u).map_or(u.len(), |f| f.len());
            let f = compress(&d, 6, u, u.len()).expect("fits");
            assert_eq!(frame_id(&f), Some(1_234_567));
            let mut out = vec![0u8; u.len()];
            assert_eq!(decompress(1_234_567, &f, &mut out, true), Ok(u.len()));
            assert_eq!(&out, u);
            with += f.len();
        }
        assert!(with < plain, "the dictionary must help shared-vocabulary units: {with} against {plain}");
    }

    #[test]
    fn a_frame_needing_an_unknown_dictionary_is_an_error_not_data() {
        let units = text_units();
        let samples: Vec<&[u8]> = units.iter().map(Vec::as_slice).collect();
        let d = train(&samples, 7_777_777).expect("trained");
        let f = compress(&d, 3, &units[0], units[0].len()).expect("fits");
        // Never registered: no decoder can find it.
        let mut out = vec![0u8; units[0].len()];
        assert!(decompress(7_777_777, &f, &mut out, false).unwrap_err().contains("777777"));
    }

    #[test]
    fn a_colliding_id_with_other_bytes_is_refused() {
        let units = text_units();
        let samples: Vec<&[u8]> = units.iter().map(Vec::as_slice).collect();
        let a = Arc::new(train(&samples, 4_242_424).expect("trained"));
        let b = Arc::new(train(&samples[100..], 4_242_424).expect("trained"));
        assert_ne!(a.bytes, b.bytes, "two trainings on different samples");
        register(&a).expect("first");
        assert!(register(&b).is_err());
        // This thread decodes with `a`, which then goes (its volume closed) and `b` takes
        // the id: frames of `b` must decode with `b`, not with a context kept for `a`.
        let unit = &units[0];
        let mut out = vec![0u8; unit.len()];
        let fa = compress(&a, 6, unit, unit.len()).expect("fits");
        assert_eq!(decompress(4_242_424, &fa, &mut out, true), Ok(unit.len()));
        drop(a);
        register(&b).expect("the first one is gone");
        let fb = compress(&b, 6, unit, unit.len()).expect("fits");
        out.fill(0);
        assert_eq!(decompress(4_242_424, &fb, &mut out, true), Ok(unit.len()));
        assert_eq!(&out, unit);
    }

    #[test]
    fn too_few_samples_train_nothing() {
        let units = text_units();
        let samples: Vec<&[u8]> = units.iter().take(5).map(Vec::as_slice).collect();
        assert!(train(&samples, 70_000).is_none());
        assert_eq!(fresh_id(&[1; 16], b"x"), fresh_id(&[1; 16], b"x"));
        assert!((1 << 16..1 << 31).contains(&fresh_id(&[2; 16], b"y")));
    }
}
