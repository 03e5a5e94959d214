//! Compression and packing: several compressed 4 KiB blocks ("fragments") share one
//! physical block.
//!
//! Packed block layout (4096 bytes):
//! `magic "DVPK" (4) | crc32c of the block (4) | count (1) | codec (1) | reserved (2) |
//!  14 × (offset u16, length u16) (56) | reserved (4) | fragment bytes from offset 72`.
//!
//! Invariants:
//! - Fragments lie inside the data area (72..4096), do not overlap, and appear in slot order.
//! - A packed block is immutable once written; the open block lives only in memory and is
//!   written ("sealed") when full or when a commit needs its data durable.
//! - A fragment decompresses to exactly 4096 bytes, or the block is reported corrupt.
//! - At most `OPEN_BLOCKS_MAX` blocks are open, each at a distinct pbn, each holding at
//!   most `PACKED_SLOTS_MAX` fragments that end at or before its `used` mark (asserted as
//!   they change; the `verify` audit decodes every open block's header and fragments).

use crate::codec::{get_u16, put_u16, put_u32, seal_crc};
use crate::config::{Compression, BLOCK_SIZE};
use crate::error::{Error, Result};
use crate::metadata::block_map::PACKED_SLOTS_MAX;

/// Magic of a packed block.
pub const PACKED_MAGIC: u32 = u32::from_le_bytes(*b"DVPK");
/// Bytes before the fragment area.
pub const PACKED_HEADER_BYTES: usize = 72;
/// Largest fragment that can be packed.
pub const FRAGMENT_BYTES_MAX: usize = BLOCK_SIZE - PACKED_HEADER_BYTES;
const CRC_OFFSET: usize = 4;

const _: () = assert!(12 + 4 * PACKED_SLOTS_MAX as usize <= PACKED_HEADER_BYTES);

/// Compresses a 4 KiB block with `codec` at `level` (zstd; 0 is `ZSTD_LEVEL_DEFAULT`);
/// None when the result would not fit in a packed block, and the block is stored raw.
///
/// zstd first asks [`cannot_fit`] whether the block is incompressible: on random data
/// that costs a byte histogram and an LZ4 attempt instead of a zstd attempt (LZ4 runs at
/// 5 GB/s on random data, zstd at 690 MB/s at level 1). Of the 37,371 blocks of a 1 GiB
/// /usr tar it turned away, zstd would have fit 948, every one in 3.5–3.9 KiB: 0.01 % of
/// the input, and each would have filled a packed block alone.
pub fn compress(codec: Compression, level: i8, src: &[u8]) -> Option<Vec<u8>> {
    // Compress into a per-thread scratch buffer (sized for lz4_flex's worst case) and copy
    // out only the fragment: no zeroed 4 KiB allocation per chunk. zstd keeps one context
    // per thread: making one per block cost more than compressing the block.
    thread_local! {
        static SCRATCH: std::cell::RefCell<Vec<u8>> = const { std::cell::RefCell::new(Vec::new()) };
        static ZSTD: std::cell::RefCell<Option<(i8, zstd::bulk::Compressor<'static>)>> =
            const { std::cell::RefCell::new(None) };
    }
    if codec == Compression::None {
        return None;
    }
    SCRATCH.with(|cell| {
        let mut out = cell.borrow_mut();
        let want = lz4_flex::block::get_maximum_output_size(src.len()).max(FRAGMENT_BYTES_MAX);
        if out.len() < want {
            out.resize(want, 0);
        }
        let n = match codec {
            Compression::None => return None,
            Compression::Lz4 => lz4_flex::block::compress_into(src, &mut out).ok()?,
            Compression::Zstd => {
                if cannot_fit(src, &mut out) {
                    return None;
                }
                let level = crate::config::effective_level(codec, level);
                ZSTD.with(|z| {
                    let mut z = z.borrow_mut();
                    if z.as_ref().is_none_or(|(l, _)| *l != level) {
                        *z = Some((level, zstd::bulk::Compressor::new(i32::from(level)).ok()?));
                    }
                    let (_, c) = z.as_mut()?;
                    // A block that does not fit the fragment area is an error here: stored raw.
                    c.compress_to_buffer(src, out.get_mut(..FRAGMENT_BYTES_MAX)?).ok()
                })?
            }
        };
        if n == 0 || n > FRAGMENT_BYTES_MAX {
            return None;
        }
        out.get(..n).map(<[u8]>::to_vec)
    })
}

/// True when `src` (a 4 KiB block) is not worth a zstd attempt: its bytes are too evenly
/// spread for an entropy coder to save enough (the order-0 entropy of the byte histogram
/// bounds any coding of the bytes one by one) *and* LZ4 finds too few repeats to save
/// enough. zstd is LZ matching plus entropy coding; a block that neither part can shrink
/// below `FRAGMENT_BYTES_MAX` alone is left to zstd only if its matcher finds repeats
/// LZ4's missed, which the measurement above puts at a few bytes a block. `scratch`
/// holds LZ4's output.
fn cannot_fit(src: &[u8], scratch: &mut [u8]) -> bool {
    // Four interleaved histograms, so consecutive equal bytes do not wait on each other.
    let mut h = [[0u16; 256]; 4];
    let mut quads = src.chunks_exact(4);
    for q in &mut quads {
        if let [a, b, c, d] = *q {
            #[expect(clippy::indexing_slicing, reason = "a u8 indexes a table of 256")]
            {
                h[0][usize::from(a)] += 1;
                h[1][usize::from(b)] += 1;
                h[2][usize::from(c)] += 1;
                h[3][usize::from(d)] += 1;
            }
        }
    }
    for &x in quads.remainder() {
        #[expect(clippy::indexing_slicing, reason = "a u8 indexes a table of 256")]
        {
            h[0][usize::from(x)] += 1;
        }
    }
    let n = src.len() as f64;
    let mut sum_c_log_c = 0.0f64;
    for i in 0..256 {
        let c = h.iter().map(|t| u32::from(t.get(i).copied().unwrap_or(0))).sum::<u32>();
        if c > 1 {
            let c = f64::from(c);
            sum_c_log_c += c * c.log2();
        }
    }
    let entropy_bytes = (n * n.log2() - sum_c_log_c) / 8.0;
    if entropy_bytes < FRAGMENT_BYTES_MAX as f64 {
        return false;
    }
    // LZ4 on data without repeats runs at several GB/s (it skips ahead faster the longer
    // it finds nothing).
    !matches!(lz4_flex::block::compress_into(src, scratch), Ok(k) if k <= FRAGMENT_BYTES_MAX)
}

/// Packed block `pbn` is not what it must be (`pbn` only names it in the error).
fn damaged(pbn: u64, expected: impl Into<String>, found: impl Into<String>) -> Error {
    Error::corruption("packed block", pbn, expected, found)
}

/// Decompresses a fragment of packed block `pbn` into exactly 4096 bytes.
pub fn decompress(pbn: u64, slot: u8, codec: Compression, frag: &[u8], out: &mut [u8]) -> Result<()> {
    let decoded = match codec {
        Compression::None => return Err(damaged(pbn, "a compression codec", "codec none")),
        Compression::Lz4 => lz4_flex::block::decompress_into(frag, out).map_err(|e| e.to_string()),
        Compression::Zstd => {
            thread_local! {
                static ZSTD_D: std::cell::RefCell<Option<zstd::bulk::Decompressor<'static>>> =
                    const { std::cell::RefCell::new(None) };
            }
            ZSTD_D.with(|d| {
                let mut d = d.borrow_mut();
                if d.is_none() {
                    *d = Some(zstd::bulk::Decompressor::new().map_err(|e| e.to_string())?);
                }
                match d.as_mut() {
                    Some(d) => d.decompress_to_buffer(frag, out).map_err(|e| e.to_string()),
                    None => Err("no zstd context".to_string()),
                }
            })
        }
    };
    match decoded {
        Ok(BLOCK_SIZE) => Ok(()),
        Ok(n) => Err(damaged(pbn, format!("slot {slot} to decompress to {BLOCK_SIZE} bytes"), format!("{n} bytes"))),
        Err(e) => Err(damaged(pbn, format!("slot {slot} to decompress ({codec:?})"), e)),
    }
}

/// Returns the compressed bytes of `slot` and the codec, validating the header bounds. The
/// block crc is not checked: callers check the decoded slot against its own crc (format.md).
pub fn fragment(block: &[u8], pbn: u64, slot: u8) -> Result<(Compression, &[u8])> {
    let magic = crate::codec::get_u32(block, 0);
    if block.len() != BLOCK_SIZE || magic != PACKED_MAGIC {
        return Err(damaged(
            pbn,
            format!("a {BLOCK_SIZE}-byte block with magic {PACKED_MAGIC:#010x}"),
            format!("{} bytes with magic {magic:#010x} (not a packed block)", block.len()),
        ));
    }
    let count = block.get(8).copied().unwrap_or(0);
    let code = block.get(9).copied().unwrap_or(0xff);
    let codec = Compression::from_code(code).ok_or_else(|| damaged(pbn, "a known codec", format!("codec {code}")))?;
    if slot >= count || count > PACKED_SLOTS_MAX {
        return Err(damaged(
            pbn,
            format!("slot {slot} among at most {PACKED_SLOTS_MAX} fragments"),
            format!("{count} fragments"),
        ));
    }
    let off = usize::from(get_u16(block, 12 + 4 * usize::from(slot)));
    let len = usize::from(get_u16(block, 14 + 4 * usize::from(slot)));
    match block.get(off..off + len) {
        Some(frag) if off >= PACKED_HEADER_BYTES && len > 0 => Ok((codec, frag)),
        _ => Err(damaged(
            pbn,
            format!("slot {slot} inside the fragment area {PACKED_HEADER_BYTES}..{BLOCK_SIZE}"),
            format!("{off}+{len} (out of bounds)"),
        )),
    }
}

/// Decodes the logical 4 KiB content of `slot` of packed block `pbn` (read into `block`).
pub fn unpack(block: &[u8], pbn: u64, slot: u8, out: &mut [u8]) -> Result<()> {
    let (codec, frag) = fragment(block, pbn, slot)?;
    decompress(pbn, slot, codec, frag, out)
}

/// Blocks open at once: fragments go to the best-fitting one, so a large fragment does not
/// close a block that a later small fragment could still fill (bin packing, as VDO's packer).
/// When a fragment fits none and all are open, the *oldest* is sealed: blocks are opened in
/// allocation (pbn) order, so sealing them in the same order keeps each staged batch one
/// contiguous run on the device. Measured on a kernel source tar (1.3 GB): sealing the
/// fullest of 4 stored 623 MB in 9,000 device writes; the oldest of 32 stores 577 MB in
/// 1,900 (the ideal packing of the same fragments is 504 MB).
pub const OPEN_BLOCKS_MAX: usize = 32;

/// A block being filled.
pub struct OpenBlock {
    /// Its physical block.
    pbn: u64,
    /// Unshared while open (written through `Arc::make_mut`, which then never copies), so sealing hands the block to
    /// the write path and the content cache without a copy.
    buf: crate::read::cache::Block,
    count: u8,
    used: usize,
}

impl OpenBlock {
    fn fits(&self, len: usize) -> bool {
        self.count < PACKED_SLOTS_MAX && self.used + len <= BLOCK_SIZE && len > 0
    }
}

/// The packer: up to `OPEN_BLOCKS_MAX` open blocks.
pub struct Packer {
    codec: Compression,
    open: Vec<OpenBlock>,
}

impl Packer {
    /// A packer writing fragments compressed with `codec`.
    pub fn new(codec: Compression) -> Self {
        Packer { codec, open: Vec::new() }
    }

    /// True when `pbn` is an open (unwritten) block.
    pub fn is_open(&self, pbn: u64) -> bool {
        self.open.iter().any(|o| o.pbn == pbn)
    }

    /// The open blocks' physical blocks.
    pub fn open_pbns(&self) -> Vec<u64> {
        self.open.iter().map(|o| o.pbn).collect()
    }

    /// True when some open block holds fragments.
    pub fn has_fragments(&self) -> bool {
        self.open.iter().any(|o| o.count > 0)
    }

    /// True when another block may be opened.
    pub fn can_open(&self) -> bool {
        self.open.len() < OPEN_BLOCKS_MAX
    }

    /// Adds a fragment to the open block it fits best (least room left) among those
    /// `accepts` allows; returns the block and slot, or None when it fits nowhere.
    ///
    /// `accepts` lets the caller rule out a block that can take no more references: the
    /// reference count covers every slot of a packed block, so an open block whose slots
    /// are already shared up to the cap must not receive a new fragment.
    pub fn try_add(&mut self, frag: &[u8], accepts: impl Fn(u64) -> bool) -> Option<(u64, u8)> {
        let o = self
            .open
            .iter_mut()
            .filter(|o| o.fits(frag.len()) && accepts(o.pbn))
            .min_by_key(|o| BLOCK_SIZE - o.used)?;
        let slot = o.count;
        let buf = std::sync::Arc::make_mut(&mut o.buf);
        buf.get_mut(o.used..o.used + frag.len())?.copy_from_slice(frag);
        put_u16(buf, 12 + 4 * usize::from(slot), o.used as u16);
        put_u16(buf, 14 + 4 * usize::from(slot), frag.len() as u16);
        o.used += frag.len();
        o.count += 1;
        assert!(o.count <= PACKED_SLOTS_MAX && o.used <= BLOCK_SIZE, "packer: block {} overfilled", o.pbn);
        Some((o.pbn, slot))
    }

    /// Opens a new block at `pbn` (the caller checks `can_open`).
    pub fn open(&mut self, pbn: u64) {
        // At most `OPEN_BLOCKS_MAX` compares, once per packed block: cheap enough for release.
        assert!(self.can_open() && !self.is_open(pbn), "packer: opening block {pbn} (open: {:?})", self.open_pbns());
        let mut buf: crate::read::cache::Block = std::iter::repeat_n(0u8, BLOCK_SIZE).collect();
        let b = std::sync::Arc::make_mut(&mut buf);
        put_u32(b, 0, PACKED_MAGIC);
        if let Some(c) = b.get_mut(9) {
            *c = self.codec.code();
        }
        self.open.push(OpenBlock { pbn, buf, count: 0, used: PACKED_HEADER_BYTES });
    }

    fn finish(mut o: OpenBlock) -> (u64, crate::read::cache::Block, u8) {
        // make_mut copies only if the block was shared, which the packer never does.
        let b = std::sync::Arc::make_mut(&mut o.buf);
        if let Some(c) = b.get_mut(8) {
            *c = o.count;
        }
        seal_crc(b, CRC_OFFSET);
        (o.pbn, o.buf, o.count)
    }

    /// Closes the oldest open block (the first opened, so the lowest-numbered of a
    /// sequential allocation) and returns it ready to write.
    pub fn seal_oldest(&mut self) -> Option<(u64, crate::read::cache::Block, u8)> {
        if self.open.is_empty() {
            return None;
        }
        Some(Self::finish(self.open.remove(0)))
    }

    /// Closes every open block (a commit needs their data durable). A block returned with
    /// `count == 0` was never used and its pbn can be unreserved.
    pub fn seal_all(&mut self) -> Vec<(u64, crate::read::cache::Block, u8)> {
        std::mem::take(&mut self.open).into_iter().map(Self::finish).collect()
    }

    /// Checks every open block (the `verify` audit): distinct pbns within the bound, a
    /// valid header, and fragments in slot order inside the filled area that decompress.
    #[cfg(any(test, feature = "verify"))]
    pub fn audit(&self) -> std::result::Result<(), String> {
        if self.open.len() > OPEN_BLOCKS_MAX {
            return Err(format!("{} packed blocks open, more than {OPEN_BLOCKS_MAX}", self.open.len()));
        }
        let mut out = vec![0u8; BLOCK_SIZE];
        for (i, o) in self.open.iter().enumerate() {
            let pbn = o.pbn;
            if self.open.iter().skip(i + 1).any(|x| x.pbn == pbn) {
                return Err(format!("packed block {pbn} is open twice"));
            }
            let header_ok = o.buf.len() == BLOCK_SIZE
                && crate::codec::get_u32(&o.buf, 0) == PACKED_MAGIC
                && o.buf.get(9).copied() == Some(self.codec.code());
            if !header_ok || o.count > PACKED_SLOTS_MAX || o.used > BLOCK_SIZE || o.used < PACKED_HEADER_BYTES {
                return Err(format!(
                    "open packed block {pbn}: bad header, {} fragments, {} bytes used",
                    o.count, o.used
                ));
            }
            let mut end = PACKED_HEADER_BYTES;
            for slot in 0..o.count {
                let off = usize::from(get_u16(&o.buf, 12 + 4 * usize::from(slot)));
                let len = usize::from(get_u16(&o.buf, 14 + 4 * usize::from(slot)));
                if off != end || len == 0 || off + len > o.used {
                    return Err(format!("open packed block {pbn}: slot {slot} at {off}+{len}, expected at {end}"));
                }
                end = off + len;
                match self.unpack_open(pbn, slot, &mut out) {
                    Some(Ok(())) => {}
                    _ => return Err(format!("open packed block {pbn}: slot {slot} does not decompress")),
                }
            }
            if end != o.used {
                return Err(format!("open packed block {pbn}: fragments end at {end}, used mark at {}", o.used));
            }
        }
        Ok(())
    }

    /// Decodes a fragment of an open block (reads and verification of data not yet written).
    pub fn unpack_open(&self, pbn: u64, slot: u8, out: &mut [u8]) -> Option<Result<()>> {
        let o = self.open.iter().find(|o| o.pbn == pbn)?;
        if slot >= o.count {
            // A mapping names a slot the open block has not filled yet: a stale or damaged
            // map entry, since slots are mapped only after they are added.
            return Some(Err(Error::corruption(
                "map entry to open packed block",
                pbn,
                format!("one of its {} filled slots", o.count),
                format!("slot {slot}"),
            )));
        }
        let off = usize::from(get_u16(&o.buf, 12 + 4 * usize::from(slot)));
        let len = usize::from(get_u16(&o.buf, 14 + 4 * usize::from(slot)));
        Some(match o.buf.get(off..off + len) {
            Some(f) => decompress(pbn, slot, self.codec, f, out),
            None => Err(Error::internal(
                "open packed block slot outside its buffer",
                format!("block {pbn} slot {slot}: {off}+{len}"),
            )),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pack_seal_unpack_round_trip() {
        let mut p = Packer::new(Compression::Lz4);
        p.open(9);
        let blocks: Vec<Vec<u8>> = (0..5u8).map(|i| vec![i; BLOCK_SIZE]).collect();
        for (i, b) in blocks.iter().enumerate() {
            let f = compress(Compression::Lz4, 0, b).expect("compressible");
            assert_eq!(p.try_add(&f, |_| true), Some((9, i as u8)));
        }
        let mut out = vec![0u8; BLOCK_SIZE];
        p.unpack_open(9, 3, &mut out).expect("open").expect("unpack");
        assert_eq!(out, blocks[3]);
        let (pbn, buf, count) = p.seal_all().pop().expect("sealed");
        assert_eq!((pbn, count), (9, 5));
        for (i, b) in blocks.iter().enumerate() {
            unpack(&buf, 9, i as u8, &mut out).expect("unpack");
            assert_eq!(&out, b);
        }
        assert!(unpack(&buf, 9, 5, &mut out).is_err());
        // A slot whose offset points outside the data area is refused, not decoded.
        let mut bad = buf.to_vec();
        put_u16(&mut bad, 12, 4090);
        assert!(unpack(&bad, 9, 0, &mut out).is_err());
        // Damage inside one fragment never decodes to its original content (the caller's
        // crc catches it) and leaves the other fragments readable.
        let mut bad = buf.to_vec();
        let off = usize::from(get_u16(&bad, 12 + 4));
        bad[off + 1] ^= 0x55;
        assert!(unpack(&bad, 9, 1, &mut out).map_or(true, |()| out != blocks[1]));
        for i in [0usize, 2, 3, 4] {
            unpack(&bad, 9, i as u8, &mut out).expect("undamaged slot");
            assert_eq!(out, blocks[i]);
        }
    }

    #[test]
    fn best_fit_fills_the_block_with_least_room() {
        let mut p = Packer::new(Compression::Lz4);
        p.open(1);
        p.open(2);
        assert_eq!(p.try_add(&[1u8; 3000], |_| true).map(|(b, _)| b), Some(1));
        // 1000 bytes fit both blocks; block 1 has less room left, so it takes them.
        assert_eq!(p.try_add(&[2u8; 1000], |_| true), Some((1, 1)));
        assert_eq!(p.try_add(&[3u8; 2000], |_| true), Some((2, 0)));
        // The oldest is sealed first, whichever is fuller.
        p.open(3);
        assert_eq!(p.try_add(&[4u8; 3900], |_| true), Some((3, 0)));
        assert_eq!(p.seal_oldest().map(|(b, _, c)| (b, c)), Some((1, 2)));
        assert_eq!(p.seal_oldest().map(|(b, _, c)| (b, c)), Some((2, 1)));
        assert!(p.is_open(3) && !p.is_open(1) && !p.is_open(2));
    }

    #[test]
    fn a_refused_block_gets_no_fragment() {
        let mut p = Packer::new(Compression::Lz4);
        p.open(1);
        p.open(2);
        assert_eq!(p.try_add(&[1u8; 100], |b| b != 1), Some((2, 0)));
        assert_eq!(p.try_add(&[1u8; 100], |_| false), None);
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
        let mut scratch = vec![0u8; lz4_flex::block::get_maximum_output_size(BLOCK_SIZE)];
        let mut refused = 0;
        for (i, b) in blocks.iter().enumerate() {
            if cannot_fit(b, &mut scratch) {
                refused += 1;
                for level in [1i32, 3, 19] {
                    let z = zstd::bulk::compress(b, level).expect("zstd");
                    assert!(z.len() > BLOCK_SIZE - 512, "block {i} refused, zstd:{level} shrinks it to {}", z.len());
                }
            }
        }
        assert!(refused >= 20, "the probe refused only {refused} incompressible blocks");
    }
}
