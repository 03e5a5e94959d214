//! Compression and packing: compressed units ("fragments") are appended back to back to
//! an open *run* of consecutive physical blocks, byte by byte, and may cross from one
//! block into the next; a map entry names its fragment by first block, offset and length
//! (docs/format.md, "Fragments"), so packed data carries no header of its own.
//!
//! A fragment is one logical block compressed alone, or an *extent*: up to
//! `UNIT_BLOCKS_MAX` logical blocks written together, compressed as one unit; each of its
//! blocks is mapped to the fragment and its index in the unit.
//!
//! Invariants:
//! - The open run's blocks are reserved, consecutive, and at most `RUN_BLOCKS_MAX`; its
//!   fragments lie back to back from byte 0 of its first block, and `buf` holds exactly
//!   the bytes used so far (asserted as it grows; the `verify` audit decodes them all).
//! - Sealing hands out every block the run filled, the last one zero-padded, and the
//!   reserved blocks it did not reach, to be unreserved: a run's blocks are staged
//!   together, so a fragment is never half on the device and half in memory.
//! - A fragment decodes to exactly its unit's blocks, or is reported corrupt.

use crate::config::{Compression, BLOCK_SIZE, BLOCK_SIZE_U64};
use crate::error::{Error, Result};
use crate::metadata::block_map::{Frag, UNIT_BLOCKS_MAX};

/// Blocks an open run holds at most (128 KiB): bounds its memory and how long its data
/// waits for the device; twice the largest extent, so an extent always fits a fresh run.
pub const RUN_BLOCKS_MAX: u64 = 32;

/// Largest compressed size worth storing for a unit of `blocks` logical blocks: it must
/// save at least 1/16 of the unit, else the unit is stored raw (a read would pay the
/// decompression for almost nothing).
pub fn fragment_limit(blocks: usize) -> usize {
    let raw = blocks * BLOCK_SIZE;
    raw - raw / 16
}

/// Blocks one fragment touches at most: 16 blocks compressed to at most 15/16 of 64 KiB,
/// from any offset of its first block.
pub const FRAGMENT_SPAN_MAX: u64 = 17;

/// The first blocks of the fragments that may run into block `pbn` from before it (those
/// starting in the `FRAGMENT_SPAN_MAX - 1` blocks before it).
pub fn fragments_reaching(pbn: u64) -> std::ops::Range<u64> {
    pbn.saturating_sub(FRAGMENT_SPAN_MAX - 1)..pbn
}

/// Largest fragment of a single block.
pub const FRAGMENT_BYTES_MAX: usize = BLOCK_SIZE - BLOCK_SIZE / 16;

const _: () = assert!(RUN_BLOCKS_MAX as usize * BLOCK_SIZE >= 2 * UNIT_BLOCKS_MAX as usize * BLOCK_SIZE);

/// Compresses `src` (one or more whole 4 KiB blocks) with `codec` at `level` (zstd; 0 is
/// `ZSTD_LEVEL_DEFAULT`); None when the result would not save enough
/// (`fragment_limit`), and the blocks are stored raw.
///
/// zstd first asks [`cannot_fit`] whether a single block is incompressible: on random
/// data that costs a byte histogram and an LZ4 attempt instead of a zstd attempt (LZ4 runs
/// at 5 GB/s on random data, zstd at 690 MB/s at level 1). Units of several blocks are
/// probed block by block by the caller before they are formed.
pub fn compress(codec: Compression, level: i8, src: &[u8]) -> Option<Vec<u8>> {
    compress_probed(codec, level, src, true)
}

/// `compress`, with the incompressibility probe of a single block skipped when `probe`
/// is false (the caller ran it already: `incompressible`). For LZ4, a `level` above 1 is
/// the acceleration of LZ4's fast mode (`LZ4_ACCELERATION_MAX` at most): deferred
/// compression uses it, trading ratio for speed until recompression.
pub fn compress_probed(codec: Compression, level: i8, src: &[u8], probe: bool) -> Option<Vec<u8>> {
    // Compress into a per-thread scratch buffer (sized for lz4_flex's worst case) and copy
    // out only the fragment: no zeroed allocation per chunk. zstd keeps one context per
    // thread: making one per block cost more than compressing the block.
    thread_local! {
        static SCRATCH: std::cell::RefCell<Vec<u8>> = const { std::cell::RefCell::new(Vec::new()) };
        static ZSTD: std::cell::RefCell<Option<(i8, zstd::bulk::Compressor<'static>)>> =
            const { std::cell::RefCell::new(None) };
    }
    if codec == Compression::None || src.is_empty() || !src.len().is_multiple_of(BLOCK_SIZE) {
        return None;
    }
    let limit = fragment_limit(src.len() / BLOCK_SIZE);
    SCRATCH.with(|cell| {
        let mut out = cell.borrow_mut();
        let want = lz4_flex::block::get_maximum_output_size(src.len()).max(limit);
        if out.len() < want {
            out.resize(want, 0);
        }
        let n = match codec {
            Compression::None => return None,
            Compression::Lz4 if level > 1 => lz4_fast(src, level, out.get_mut(..limit)?)?,
            Compression::Lz4 => lz4_flex::block::compress_into(src, &mut out).ok()?,
            Compression::Zstd => {
                if probe && src.len() == BLOCK_SIZE && cannot_fit(src, &mut out, FRAGMENT_BYTES_MAX) {
                    return None;
                }
                let level = crate::config::effective_level(codec, level);
                ZSTD.with(|z| {
                    let mut z = z.borrow_mut();
                    if z.as_ref().is_none_or(|(l, _)| *l != level) {
                        let mut c = zstd::bulk::Compressor::new(i32::from(level)).ok()?;
                        // A frame decoded whole is checked end to end (docs/format.md,
                        // "Block map entry"): a fragment whose later blocks were reused
                        // since must fail to decode, not pass byte verification.
                        c.include_checksum(true).ok()?;
                        // Extents in zstd blocks of 16 KiB: a read of one block decodes
                        // the unit only up to the zstd block holding it
                        // (`zstd_prefix`). Frames stay standard zstd whatever the block
                        // size; single blocks are below it and unaffected.
                        c.set_parameter(zstd::zstd_safe::CParameter::MaxBlockSize(
                            super::zstd_prefix::EXTENT_ZSTD_BLOCK_BYTES,
                        ))
                        .ok()?;
                        *z = Some((level, c));
                    }
                    let (_, c) = z.as_mut()?;
                    // Output past the limit is an error here: the unit is stored raw.
                    c.compress_to_buffer(src, out.get_mut(..limit)?).ok()
                })?
            }
        };
        if n == 0 || n > limit {
            return None;
        }
        out.get(..n).map(<[u8]>::to_vec)
    })
}

/// `compress`, with the volume's dictionary `dict` for zstd units small enough to use it
/// (`dictionary::DICT_UNIT_BYTES_MAX`): how data at rest is compressed.
pub fn compress_with(
    codec: Compression,
    level: i8,
    src: &[u8],
    dict: Option<&super::dictionary::Dictionary>,
) -> Option<Vec<u8>> {
    match dict {
        Some(d)
            if codec == Compression::Zstd
                && !src.is_empty()
                && src.len() <= super::dictionary::DICT_UNIT_BYTES_MAX
                && src.len().is_multiple_of(BLOCK_SIZE) =>
        {
            if src.len() == BLOCK_SIZE && incompressible(src) {
                return None;
            }
            let level = crate::config::effective_level(codec, level);
            super::dictionary::compress(d, level, src, fragment_limit(src.len() / BLOCK_SIZE)).filter(|f| !f.is_empty())
        }
        _ => compress(codec, level, src),
    }
}

/// The largest acceleration `compress_probed` gives LZ4's fast mode (the reference
/// library's own bound is far higher; beyond this the ratio falls off with little speed
/// left to gain).
pub const LZ4_ACCELERATION_MAX: i8 = 64;

/// `src` as one LZ4 block (the format lz4_flex decodes) from the reference library's fast
/// mode at `acceleration`, into `out`; None when it does not fit there.
fn lz4_fast(src: &[u8], acceleration: i8, out: &mut [u8]) -> Option<usize> {
    let mode = lz4::block::CompressionMode::FAST(i32::from(acceleration.clamp(1, LZ4_ACCELERATION_MAX)));
    // No size prefix: a fragment's length is in its map entry. An output that does not fit
    // `out` is an error from the library: the unit is then stored raw.
    lz4::block::compress_to_buffer(src, Some(mode), false, out).ok()
}

/// True when a 4 KiB block is worth no compression attempt, alone or in an extent (see
/// [`cannot_fit`]): a cheap probe the write path runs before forming extents. (A higher
/// bar, near-random data only, stored a 1 GiB tar of /usr at the same 2.09x: the blocks
/// this one turns away do not shrink in a 64 KiB unit either.)
pub fn incompressible(src: &[u8]) -> bool {
    thread_local! {
        static SCRATCH: std::cell::RefCell<Vec<u8>> = const { std::cell::RefCell::new(Vec::new()) };
    }
    SCRATCH.with(|cell| {
        let mut out = cell.borrow_mut();
        let want = lz4_flex::block::get_maximum_output_size(src.len());
        if out.len() < want {
            out.resize(want, 0);
        }
        cannot_fit(src, &mut out, FRAGMENT_BYTES_MAX)
    })
}

/// True when `src` (a 4 KiB block) is not worth a zstd attempt: its bytes are too evenly
/// spread for an entropy coder to save enough (the order-0 entropy of the byte histogram
/// bounds any coding of the bytes one by one) *and* LZ4 finds too few repeats to save
/// enough. zstd is LZ matching plus entropy coding; a block that neither part can shrink
/// below `FRAGMENT_BYTES_MAX` alone is left to zstd only if its matcher finds repeats
/// LZ4's missed, which the measurement above puts at a few bytes a block. `scratch`
/// holds LZ4's output.
///
/// The histogram samples one byte in `PROBE_STRIDE` (819 of a 4 KiB block): building it
/// over every byte cost as much CPU as BLAKE3. The stride is odd and prime, so data with a
/// period of 2, 4, 8 or 16 bytes (arrays of integers, where some byte positions hold
/// little) is sampled at every position alike; and the estimate of a sample is biased
/// low (about 0.2 bit a byte on random data, 7.8 against the 7.5 the limit allows), so
/// sampling sends borderline blocks on to a compression attempt rather than refusing them.
fn cannot_fit(src: &[u8], scratch: &mut [u8], limit: usize) -> bool {
    if sampled_entropy_bytes(src) < limit as f64 {
        return false;
    }
    // LZ4 on data without repeats runs at several GB/s (it skips ahead faster the longer
    // it finds nothing).
    !matches!(lz4_flex::block::compress_into(src, scratch), Ok(k) if k <= limit)
}

/// The order-0 entropy of the byte histogram of one byte in `PROBE_STRIDE` of `src`,
/// over the whole of `src`, in bytes (0 when `src` is too short to sample).
fn sampled_entropy_bytes(src: &[u8]) -> f64 {
    // Four interleaved histograms (one table, a quarter each), so consecutive equal bytes
    // do not wait on each other.
    let mut h = [0u16; 4 * 256];
    let mut samples = 0u32;
    for q in src.chunks_exact(4 * PROBE_STRIDE) {
        let Ok(q) = <&[u8; 4 * PROBE_STRIDE]>::try_from(q) else { continue };
        #[expect(clippy::indexing_slicing, reason = "a u8 plus a multiple of 256 indexes a table of 1024")]
        {
            h[usize::from(q[0])] += 1;
            h[256 + usize::from(q[PROBE_STRIDE])] += 1;
            h[512 + usize::from(q[2 * PROBE_STRIDE])] += 1;
            h[768 + usize::from(q[3 * PROBE_STRIDE])] += 1;
        }
        samples += 4;
    }
    if samples == 0 {
        return 0.0;
    }
    let n = f64::from(samples);
    let table = c_log2_c();
    // Four sums, so the additions do not wait on each other (one chain of 256 dependent
    // additions cost as much as building the histogram); the table's entries for counts 0
    // and 1 are 0, so no branch is needed.
    let mut sums = [0.0f32; 4];
    let (a, rest) = h.split_at(256);
    let (b, rest) = rest.split_at(256);
    let (c, d) = rest.split_at(256);
    for (i, (((&w, &x), &y), &z)) in a.iter().zip(b).zip(c).zip(d).enumerate() {
        let count = usize::from(w) + usize::from(x) + usize::from(y) + usize::from(z);
        debug_assert!(count < table.len(), "a histogram count of {count} beyond its block");
        #[expect(clippy::indexing_slicing, reason = "i & 3 indexes four sums")]
        {
            sums[i & 3] += table.get(count).copied().unwrap_or(0.0);
        }
    }
    let sum_c_log_c = f64::from(sums[0]) + f64::from(sums[1]) + f64::from(sums[2]) + f64::from(sums[3]);
    // Bits a byte of the sample, over the whole block, in bytes.
    (n * n.log2() - sum_c_log_c) / n / 8.0 * src.len() as f64
}

/// One byte in this many enters the probe's histogram (see [`cannot_fit`]).
const PROBE_STRIDE: usize = 5;

/// c·log2(c) for every count a 4 KiB block's byte histogram can hold. Why a table: the
/// probe runs on every block written, and 256 calls of `log2` per block cost as much as
/// building the histogram (about a tenth of the write path's CPU on compressible data).
/// f32 is precise enough: the sum decides against a threshold hundreds of bytes away.
fn c_log2_c() -> &'static [f32] {
    static TABLE: std::sync::OnceLock<Vec<f32>> = std::sync::OnceLock::new();
    TABLE.get_or_init(|| {
        (0..=BLOCK_SIZE).map(|c| if c < 2 { 0.0 } else { (c as f64 * (c as f64).log2()) as f32 }).collect()
    })
}

/// A fragment starting in physical block `pbn` is not what it must be (`pbn` only names
/// it in the error).
fn damaged(pbn: u64, expected: impl Into<String>, found: impl Into<String>) -> Error {
    Error::corruption("compressed fragment in physical block", pbn, expected, found)
}

/// Decompresses fragment `f` (its bytes `frag`, first block `pbn`) into `out`, which must
/// be exactly its unit's blocks long. A zstd frame's content checksum is not computed:
/// every caller checks the blocks it uses against their map entries' crc32c, and the
/// checksum cost a third of zstd's decoding speed (2.45 GB/s without it, 1.3–1.7 with it,
/// 64 KiB units of a /usr tar on this machine). `decompress_checked` checks it.
pub fn decompress(pbn: u64, f: &Frag, frag: &[u8], out: &mut [u8]) -> Result<()> {
    decompress_with(pbn, f, frag, out, false)
}

/// `decompress`, with a zstd frame's content checksum checked when it has one: for a
/// caller that takes a decoded block for the fragment's without a crc32c of its own to
/// compare (byte verification of an index record, whose fragment may run into blocks
/// reused since: docs/format.md, "Block map entry").
pub fn decompress_checked(pbn: u64, f: &Frag, frag: &[u8], out: &mut [u8]) -> Result<()> {
    decompress_with(pbn, f, frag, out, true)
}

fn decompress_with(pbn: u64, f: &Frag, frag: &[u8], out: &mut [u8], checked: bool) -> Result<()> {
    let want = f.unit_blocks() * BLOCK_SIZE;
    if out.len() != want {
        return Err(Error::internal(
            "decompression buffer of the wrong size",
            format!("{} for {want} bytes", out.len()),
        ));
    }
    let codec = f.compression().unwrap_or(Compression::None);
    // A zstd frame compressed with the volume's dictionary names it (`data::dictionary`).
    let dict_id = if codec == Compression::Zstd { super::dictionary::frame_id(frag) } else { None };
    let decoded = match (codec, dict_id) {
        (Compression::None, _) => return Err(damaged(pbn, "a compression codec", format!("codec {}", f.codec))),
        (Compression::Lz4, _) => lz4_flex::block::decompress_into(frag, out).map_err(|e| e.to_string()),
        (Compression::Zstd, Some(id)) => super::dictionary::decompress(id, frag, out, checked),
        (Compression::Zstd, None) => {
            thread_local! {
                // One context per thread and mode: [checksum ignored, checked].
                static ZSTD_D: std::cell::RefCell<[Option<zstd::bulk::Decompressor<'static>>; 2]> =
                    const { std::cell::RefCell::new([None, None]) };
            }
            ZSTD_D.with(|d| {
                let mut d = d.borrow_mut();
                let Some(slot) = d.get_mut(usize::from(checked)) else { return Err("no zstd context".to_string()) };
                if slot.is_none() {
                    let mut dec = zstd::bulk::Decompressor::new().map_err(|e| e.to_string())?;
                    dec.set_parameter(zstd::zstd_safe::DParameter::ForceIgnoreChecksum(!checked))
                        .map_err(|e| e.to_string())?;
                    *slot = Some(dec);
                }
                match slot.as_mut() {
                    Some(d) => d.decompress_to_buffer(frag, out).map_err(|e| e.to_string()),
                    None => Err("no zstd context".to_string()),
                }
            })
        }
    };
    match decoded {
        Ok(n) if n == want => Ok(()),
        Ok(n) => {
            Err(damaged(pbn, format!("a fragment at offset {} decoding to {want} bytes", f.off), format!("{n} bytes")))
        }
        Err(e) => Err(damaged(pbn, format!("a fragment at offset {} that decodes ({codec:?})", f.off), e)),
    }
}

/// Decodes the first `blocks` blocks of fragment `f`'s unit (at least; the decoded
/// prefix is returned, a whole number of blocks): a read of block k of an extent needs
/// only its first k + 1 blocks. A zstd unit is decoded zstd block by zstd block straight
/// into the result and stops at the zstd block holding block k (`zstd_prefix`; extents
/// are written in zstd blocks of 16 KiB, so a random 4 KiB read of 64 KiB extents
/// decodes 40 KiB of a unit on average). LZ4 units, and units of one zstd block, decode
/// whole. The frame's checksum is not computed (see `decompress`).
pub fn decompress_prefix(pbn: u64, f: &Frag, frag: &[u8], blocks: usize) -> Result<Vec<u8>> {
    let unit = f.unit_blocks() * BLOCK_SIZE;
    let want = blocks.clamp(1, f.unit_blocks()) * BLOCK_SIZE;
    // A unit no larger than one zstd block decodes whole either way, and the one-shot
    // decoder is the faster one for it.
    if f.compression() != Some(Compression::Zstd) || unit <= super::zstd_prefix::EXTENT_ZSTD_BLOCK_BYTES as usize {
        let mut whole = vec![0u8; unit];
        decompress(pbn, f, frag, &mut whole)?;
        return Ok(whole);
    }
    match super::zstd_prefix::decode_prefix_vec(frag, unit, want) {
        Ok(mut v) if v.len() >= want => {
            // Whole blocks only: a zstd block need not end on one.
            v.truncate(v.len() / BLOCK_SIZE * BLOCK_SIZE);
            Ok(v)
        }
        Ok(v) => Err(damaged(
            pbn,
            format!("a fragment at offset {} decoding to at least {want} bytes", f.off),
            format!("{} bytes", v.len()),
        )),
        Err(e) => Err(damaged(pbn, format!("a fragment at offset {} that decodes (Zstd)", f.off), e)),
    }
}

/// The bytes of fragment `f` within `span`, the contents of its blocks back to back.
pub fn fragment_bytes<'a>(pbn: u64, f: &Frag, span: &'a [u8]) -> Result<&'a [u8]> {
    let off = usize::from(f.off);
    span.get(off..off + usize::from(f.len)).ok_or_else(|| {
        damaged(
            pbn,
            format!("{} bytes at offset {off} inside its blocks", f.len),
            format!("{} bytes of blocks", span.len()),
        )
    })
}

/// Decodes block `f.sub()` of fragment `f` from its blocks' contents `span` into `out`
/// (4 KiB). Allocates the unit's buffer only for an extent.
pub fn decode_block(pbn: u64, f: &Frag, span: &[u8], out: &mut [u8]) -> Result<()> {
    let bytes = fragment_bytes(pbn, f, span)?;
    if f.unit_blocks() == 1 {
        return decompress(pbn, f, bytes, out);
    }
    let unit = decompress_prefix(pbn, f, bytes, f.sub() + 1)?;
    let at = f.sub() * BLOCK_SIZE;
    match unit.get(at..at + BLOCK_SIZE) {
        Some(b) if out.len() == BLOCK_SIZE => {
            out.copy_from_slice(b);
            Ok(())
        }
        _ => Err(Error::internal("extent block outside its unit", format!("block {} of {}", f.sub(), f.unit_blocks()))),
    }
}

/// The open run: consecutive reserved blocks being filled with fragments.
struct Run {
    /// Its first block.
    first: u64,
    /// Blocks reserved, from `first` on.
    reserved: u64,
    /// The bytes used so far, from byte 0 of `first`.
    buf: Vec<u8>,
}

/// A sealed run, ready to write: its filled blocks (the last zero-padded) and the
/// reserved blocks it never reached.
pub struct Sealed {
    /// Filled blocks, consecutive from the run's first.
    pub blocks: Vec<(u64, crate::read::cache::Block)>,
    /// Reserved blocks left empty.
    pub unused: Vec<u64>,
}

/// The packer: at most one open run.
pub struct Packer {
    run: Option<Run>,
}

impl Packer {
    /// A packer with no open run.
    pub fn new() -> Self {
        Packer { run: None }
    }

    /// True when `pbn` is a block of the open run (filled or only reserved).
    pub fn is_open(&self, pbn: u64) -> bool {
        self.run.as_ref().is_some_and(|r| (r.first..r.first + r.reserved).contains(&pbn))
    }

    /// The open run's blocks.
    pub fn open_pbns(&self) -> Vec<u64> {
        self.run.as_ref().map(|r| (r.first..r.first + r.reserved).collect()).unwrap_or_default()
    }

    /// True when the open run holds fragments.
    pub fn has_fragments(&self) -> bool {
        self.run.as_ref().is_some_and(|r| !r.buf.is_empty())
    }

    /// Where the next fragment would start, and the room left in the reserved blocks;
    /// None without an open run.
    pub fn tail(&self) -> Option<(u64, u64)> {
        self.run.as_ref().map(|r| {
            let used = r.buf.len() as u64;
            (r.first + used / BLOCK_SIZE_U64, r.reserved * BLOCK_SIZE_U64 - used)
        })
    }

    /// The block after the open run's last reserved one, while the run may grow.
    pub fn next_block(&self) -> Option<u64> {
        self.run.as_ref().filter(|r| r.reserved < RUN_BLOCKS_MAX).map(|r| r.first + r.reserved)
    }

    /// Opens a run at reserved block `pbn` (the caller seals the previous one first).
    pub fn open(&mut self, pbn: u64) {
        assert!(self.run.is_none(), "packer: opening a run at {pbn} while one is open at {:?}", self.open_pbns());
        self.run = Some(Run { first: pbn, reserved: 1, buf: Vec::with_capacity(RUN_BLOCKS_MAX as usize * BLOCK_SIZE) });
    }

    /// Adds reserved block `pbn`, the one right after the run (`next_block`).
    pub fn extend(&mut self, pbn: u64) {
        let next = self.next_block();
        assert_eq!(next, Some(pbn), "packer: extending the run with block {pbn}");
        if let Some(r) = self.run.as_mut() {
            r.reserved += 1;
        }
    }

    /// Appends a fragment when the reserved room takes it; returns its first block and its
    /// offset there.
    pub fn try_add(&mut self, frag: &[u8]) -> Option<(u64, u16)> {
        let r = self.run.as_mut()?;
        let used = r.buf.len();
        if frag.is_empty() || (used + frag.len()) as u64 > r.reserved * BLOCK_SIZE_U64 {
            return None;
        }
        r.buf.extend_from_slice(frag);
        assert!(r.reserved <= RUN_BLOCKS_MAX, "packer: run at {} holds {} blocks", r.first, r.reserved);
        Some((r.first + (used / BLOCK_SIZE) as u64, (used % BLOCK_SIZE) as u16))
    }

    /// Closes the open run (a commit needs its data durable, or it is full).
    pub fn seal(&mut self) -> Sealed {
        let Some(r) = self.run.take() else { return Sealed { blocks: Vec::new(), unused: Vec::new() } };
        let filled = (r.buf.len() as u64).div_ceil(BLOCK_SIZE_U64);
        let blocks = r
            .buf
            .chunks(BLOCK_SIZE)
            .zip(r.first..)
            .map(|(bytes, pbn)| {
                let mut b = crate::read::cache::new_block();
                if let Some(dst) = b.get_mut().and_then(|d| d.get_mut(..bytes.len())) {
                    dst.copy_from_slice(bytes);
                }
                (pbn, b)
            })
            .collect();
        Sealed { blocks, unused: (r.first + filled..r.first + r.reserved).collect() }
    }

    /// Decodes block `f.sub()` of a fragment of the open run starting in block `pbn`.
    /// None when the run does not hold it.
    pub fn decode_open(&self, pbn: u64, f: &Frag, out: &mut [u8]) -> Option<Result<()>> {
        let r = self.run.as_ref()?;
        if !(r.first..r.first + r.reserved).contains(&pbn) {
            return None;
        }
        let start = ((pbn - r.first) * BLOCK_SIZE_U64) as usize;
        Some(match r.buf.get(start..) {
            Some(span) => decode_block(pbn, f, span, out),
            None => Err(damaged(pbn, "a fragment inside the open run's filled bytes", "offset beyond them")),
        })
    }

    /// Checks the open run (the `verify` audit): within its bounds, its bytes inside the
    /// reserved blocks.
    #[cfg(any(test, feature = "verify"))]
    pub fn audit(&self) -> std::result::Result<(), String> {
        if let Some(r) = &self.run {
            if r.reserved == 0 || r.reserved > RUN_BLOCKS_MAX || r.buf.len() as u64 > r.reserved * BLOCK_SIZE_U64 {
                return Err(format!("open run at {}: {} blocks, {} bytes", r.first, r.reserved, r.buf.len()));
            }
        }
        Ok(())
    }
}

impl Default for Packer {
    fn default() -> Self {
        Self::new()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn span_of(sealed: &Sealed) -> Vec<u8> {
        sealed.blocks.iter().flat_map(|(_, b)| b.iter().copied()).collect()
    }

    #[test]
    fn fragments_cross_blocks_and_decode_from_the_open_run_and_the_sealed_blocks() {
        let mut p = Packer::new();
        p.open(9);
        for pbn in 10..14 {
            p.extend(pbn);
        }
        let blocks: Vec<Vec<u8>> =
            (0..6u8).map(|i| (0..BLOCK_SIZE).map(|k| (k % (17 + usize::from(i))) as u8 ^ i).collect()).collect();
        let mut placed = Vec::new();
        for b in &blocks {
            let f = compress(Compression::Zstd, 1, b).expect("compressible");
            let (pbn, off) = p.try_add(&f).expect("room");
            placed.push(Frag::new(Compression::Zstd.code(), off, f.len() as u16, 1, 0).with_sub(0));
            let first = placed.len() - 1;
            placed[first] = Frag { off, ..placed[first] };
            assert!((9..14).contains(&pbn));
        }
        // An extent of four blocks, compressed as one unit, after them.
        let extent: Vec<u8> = blocks[..4].concat();
        let ef = compress(Compression::Zstd, 1, &extent).expect("compressible");
        let (epbn, eoff) = p.try_add(&ef).expect("room");
        let mut out = vec![0u8; BLOCK_SIZE];
        let starts: Vec<u64> = {
            let mut at = 0u64;
            placed
                .iter()
                .map(|f| {
                    let s = 9 + at / BLOCK_SIZE_U64;
                    at += u64::from(f.len);
                    s
                })
                .collect()
        };
        for (i, f) in placed.iter().enumerate() {
            p.decode_open(starts[i], f, &mut out).expect("open run").expect("decodes");
            assert_eq!(out, blocks[i]);
        }
        let sealed = p.seal();
        assert_eq!(sealed.blocks.first().map(|(b, _)| *b), Some(9));
        let span = span_of(&sealed);
        for (i, f) in placed.iter().enumerate() {
            let from = ((starts[i] - 9) * BLOCK_SIZE_U64) as usize;
            decode_block(starts[i], f, &span[from..], &mut out).expect("decodes");
            assert_eq!(out, blocks[i]);
        }
        for sub in 0..4 {
            let f = Frag::new(Compression::Zstd.code(), eoff, ef.len() as u16, 4, sub);
            let from = ((epbn - 9) * BLOCK_SIZE_U64) as usize;
            decode_block(epbn, &f, &span[from..], &mut out).expect("extent block decodes");
            assert_eq!(out, blocks[usize::from(sub)]);
        }
        // Reserved blocks the run never reached are handed back.
        let filled = sealed.blocks.len() as u64;
        assert_eq!(sealed.unused, (9 + filled..14).collect::<Vec<_>>());
        // A fragment whose bytes would run past its blocks is refused, not decoded.
        let bad = Frag { len: ef.len() as u16 + 9000, ..Frag::new(Compression::Zstd.code(), eoff, 1, 4, 0) };
        assert!(decode_block(epbn, &bad, &span[((epbn - 9) * BLOCK_SIZE_U64) as usize..], &mut out).is_err());
        // Damage inside one fragment never decodes to its original content.
        let mut bad_span = span.clone();
        bad_span[usize::from(placed[1].off) + BLOCK_SIZE * ((starts[1] - 9) as usize) + 2] ^= 0x55;
        let from = ((starts[1] - 9) * BLOCK_SIZE_U64) as usize;
        assert!(decode_block(starts[1], &placed[1], &bad_span[from..], &mut out).map_or(true, |()| out != blocks[1]));
    }

    #[test]
    fn a_run_takes_fragments_only_within_its_reserved_blocks() {
        let mut p = Packer::new();
        assert!(p.try_add(&[1u8; 10]).is_none(), "no run open");
        p.open(1);
        assert_eq!(p.try_add(&[1u8; 3000]), Some((1, 0)));
        assert_eq!(p.try_add(&[2u8; 2000]), None, "past the one reserved block");
        assert_eq!(p.next_block(), Some(2));
        p.extend(2);
        assert_eq!(p.try_add(&[2u8; 2000]), Some((1, 3000)));
        assert_eq!(p.tail(), Some((2, 2 * BLOCK_SIZE_U64 - 5000)));
        assert!(p.is_open(2) && !p.is_open(3));
        let sealed = p.seal();
        assert_eq!(sealed.blocks.len(), 2);
        assert!(sealed.unused.is_empty());
        assert!(!p.is_open(1) && p.tail().is_none());
    }

    /// The probe's entropy estimate (four histograms, four partial sums in f32, a table
    /// of c·log2(c)) equals the textbook formula on the same samples, on blocks from
    /// random to constant: the speed-ups must not move the estimate.
    #[test]
    fn the_sampled_entropy_is_the_textbook_entropy_of_the_sample() {
        let reference = |src: &[u8]| -> f64 {
            let mut h = [0u32; 256];
            let mut n = 0u32;
            for q in src.chunks_exact(4 * PROBE_STRIDE) {
                for k in 0..4 {
                    if let Some(&b) = q.get(k * PROBE_STRIDE) {
                        h[usize::from(b)] += 1;
                        n += 1;
                    }
                }
            }
            let n = f64::from(n);
            let bits: f64 =
                h.iter().filter(|&&c| c > 0).map(|&c| -(f64::from(c) / n) * (f64::from(c) / n).log2()).sum();
            bits / 8.0 * src.len() as f64
        };
        let rnd = |seed: u64, n: usize| crate::codec::test_random_bytes(seed, n);
        let mut blocks: Vec<Vec<u8>> = vec![vec![0u8; BLOCK_SIZE], rnd(1, BLOCK_SIZE)];
        for seed in 2..40u64 {
            // Random bytes squeezed into 2^k symbols, and a random head over a constant tail.
            let k = (seed % 8) as u32 + 1;
            blocks.push(rnd(seed, BLOCK_SIZE).iter().map(|b| b >> (8 - k)).collect());
            let mut b = rnd(seed, BLOCK_SIZE);
            b.iter_mut().skip((seed as usize * 97) % BLOCK_SIZE).for_each(|x| *x = 7);
            blocks.push(b);
        }
        blocks.push(b"the quick brown fox jumps over the lazy dog ".iter().copied().cycle().take(BLOCK_SIZE).collect());
        for (i, b) in blocks.iter().enumerate() {
            let (got, want) = (sampled_entropy_bytes(b), reference(b));
            assert!((got - want).abs() < 1.0, "block {i}: estimate {got}, textbook {want}");
        }
        assert!(sampled_entropy_bytes(&blocks[1]) > 3800.0, "random bytes estimated low");
        assert!(sampled_entropy_bytes(&blocks[0]).abs() < 0.01, "a constant block has entropy");
        assert_eq!(sampled_entropy_bytes(&[1, 2, 3]), 0.0, "too short to sample");
    }

    #[test]
    fn random_data_does_not_compress() {
        let data = crate::codec::test_random_bytes(0x1234_5678_9abc_def0, BLOCK_SIZE);
        assert!(compress(Compression::Lz4, 0, &data).is_none());
        assert!(compress(Compression::Zstd, 1, &data).is_none());
    }

    /// The incompressible probe may turn away only blocks zstd shrinks by less than one
    /// 512-byte sector (a fragment that large saves nothing once space is counted in
    /// sectors): blocks near the boundary of every kind the probe's two halves judge
    /// (byte spread, repeats).
    #[test]
    fn the_incompressible_probe_refuses_no_block_zstd_shrinks_by_a_sector() {
        let rnd = |seed: u64, n: usize| crate::codec::test_random_bytes(seed, n);
        let mut blocks: Vec<Vec<u8>> = Vec::new();
        // A random prefix, then a constant run: fits once the run is long enough.
        for k in (3900..=4096).step_by(4) {
            let mut b = rnd(k as u64, BLOCK_SIZE);
            b[k..].fill(7);
            blocks.push(b);
        }
        // Random data repeated: high byte spread, many repeats.
        for half in [1024usize, 2048, 3072, 4000, 4040] {
            let r = rnd(half as u64, half);
            blocks.push((0..BLOCK_SIZE).map(|i| r[i % half]).collect());
        }
        // Bytes from a smaller alphabet: no repeats, but an entropy coder saves.
        for alphabet in [64u32, 128, 200, 230, 240, 250, 256] {
            let r = rnd(u64::from(alphabet), BLOCK_SIZE);
            blocks.push(r.iter().map(|&x| (u32::from(x) % alphabet) as u8).collect());
        }
        // Arrays of small integers: random low bytes, the others constant, at periods of
        // 2 to 16 bytes (the histogram samples every fifth byte: each position must count).
        for (k, period) in [2usize, 3, 4, 8, 16].into_iter().enumerate() {
            let r = rnd(100 + k as u64, BLOCK_SIZE);
            blocks.push((0..BLOCK_SIZE).map(|i| if i % period == 0 { r[i] } else { 0 }).collect());
        }
        // Random data with one constant byte in every 5 (the stride itself): the sample
        // may see only random bytes, but 1/5 of constant bytes saves less than the limit.
        let r = rnd(200, BLOCK_SIZE);
        blocks.push((0..BLOCK_SIZE).map(|i| if i % 5 == 1 { 0 } else { r[i] }).collect());
        let mut scratch = vec![0u8; lz4_flex::block::get_maximum_output_size(BLOCK_SIZE)];
        let mut refused = 0;
        for (i, b) in blocks.iter().enumerate() {
            if cannot_fit(b, &mut scratch, FRAGMENT_BYTES_MAX) {
                refused += 1;
                for level in [1i32, 3, 19] {
                    let z = zstd::bulk::compress(b, level).expect("zstd");
                    assert!(z.len() > BLOCK_SIZE - 512, "block {i} refused, zstd:{level} shrinks it to {}", z.len());
                }
            }
        }
        assert!(refused >= 20, "the probe refused only {refused} incompressible blocks");
    }

    /// zstd fragments carry the frame's content checksum; reads skip it (they check each
    /// block's crc32c), byte verification checks it.
    #[test]
    fn the_frame_checksum_is_written_and_checked_only_where_asked() {
        let data: Vec<u8> = (0..4 * BLOCK_SIZE).map(|i| (i / 13 % 97) as u8).collect();
        let mut frag = compress(Compression::Zstd, 1, &data).expect("compressible");
        // Frame header descriptor: bit 2 is Content_Checksum_flag.
        assert_ne!(frag.get(4).copied().unwrap_or(0) & 0x04, 0, "no content checksum in the frame");
        let f = Frag::new(Compression::Zstd.code(), 0, frag.len() as u16, 4, 0);
        let mut out = vec![0u8; 4 * BLOCK_SIZE];
        decompress_checked(7, &f, &frag, &mut out).expect("an intact frame decodes");
        assert_eq!(out, data);
        // The checksum (the frame's last 4 bytes) made wrong: the content is intact, so only
        // the checked decode can tell.
        let n = frag.len();
        if let Some(b) = frag.get_mut(n - 1) {
            *b ^= 0xff;
        }
        assert!(decompress_checked(7, &f, &frag, &mut out).is_err(), "a wrong checksum passed");
        decompress(7, &f, &frag, &mut out).expect("reads do not compute the checksum");
        assert_eq!(out, data);
        let prefix = decompress_prefix(7, &f, &frag, 1).expect("nor do prefix reads");
        assert!(prefix.len() >= BLOCK_SIZE && prefix.len().is_multiple_of(BLOCK_SIZE));
        assert_eq!(prefix.as_slice(), data.get(..prefix.len()).expect("a prefix of the unit"));
    }

    /// LZ4's accelerated mode (deferred units) writes blocks the read path's decoder takes;
    /// it never writes past the fragment limit, and what does not fit is stored raw.
    #[test]
    fn accelerated_lz4_fragments_decode_like_any_lz4_fragment() {
        let text: Vec<u8> =
            (0..16 * BLOCK_SIZE).map(|i| b"deferred units, accelerated "[i % 28] ^ (i / 4096) as u8).collect();
        for level in [2, crate::pipeline::defer::DEFER_LZ4_ACCELERATION, LZ4_ACCELERATION_MAX, i8::MAX] {
            for blocks in [1usize, 4, 16] {
                let data = text.get(..blocks * BLOCK_SIZE).expect("in range");
                let frag = compress_probed(Compression::Lz4, level, data, false).expect("compressible");
                assert!(frag.len() <= fragment_limit(blocks), "level {level}, {blocks} blocks");
                let f = Frag::new(Compression::Lz4.code(), 0, frag.len() as u16, blocks as u8, 0);
                let mut out = vec![0u8; data.len()];
                decompress(3, &f, &frag, &mut out).expect("decodes");
                assert_eq!(out, data, "level {level}, {blocks} blocks");
            }
        }
        let random = crate::codec::test_random_bytes(7, 4 * BLOCK_SIZE);
        assert_eq!(compress_probed(Compression::Lz4, 8, &random, false), None, "random data is stored raw");
    }
}
