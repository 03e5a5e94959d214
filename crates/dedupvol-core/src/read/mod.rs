//! The read path, and the content cache it shares with verification.
//!
//! A read (docs/design.md, "A read"), per call of at most 4 MiB of whole blocks:
//! 1. `lookup` (state lock, one hold for the whole request): every mapping; blocks not on
//!    the device yet are answered from memory (`Staging`, open packed blocks) in constant
//!    time;
//! 2. `fetch` (no lock): raw blocks consecutive both logically and physically and missing
//!    from the cache and the hot-chunk tier are read with one request straight into the
//!    caller's buffer; other blocks go through the content cache, then the tier, then the
//!    data device: a compressed fragment's blocks (it may run on from one block into the
//!    next) are read with one request, merged with the neighbouring fragments' blocks, and
//!    an extent is decompressed once per request however many of its blocks it asks for; a
//!    block read alone (not in a run) is offered to the tier's recent-reads LRU once its
//!    crc matched;
//! 3. every block's crc32c is checked; a mismatch drops the cached and tier copies and
//!    retries from a fresh mapping (the block may have been freed and reused meanwhile),
//!    then reports corruption and takes the block out of deduplication.
//!
//! Invariants:
//! - No device read happens under the state lock.
//! - Runs read from the device are offered to the cache like lone blocks: its S3-FIFO
//!   admission keeps a long scan from evicting the blocks read again and again.
//! - The cache lock is taken once per request for every lookup, and once per run read.
//! - Whatever a read returns matched its map entry's crc, whether it came from the device,
//!   the content cache or the tier.
//! - Runs read sequentially from the device are never offered to the tier.
//! - Under `IoMode::ReadCached` the first pass reads data through the page cache (a lone
//!   raw block straight into the caller's buffer, not into the content cache); a retry
//!   reads the device directly, after dropping the page cache's copy of the block.

pub(crate) mod cache;

use crate::config::BLOCK_SIZE;
use crate::data::packer;
use crate::error::{Error, Result};
use crate::io::IoKind;
use crate::metadata::block_map::{Frag, MapEntry};
use crate::pipeline::segments;
use crate::volume::state::State;
use crate::volume::Volume;
use cache::{new_block, Block, PbnMap};
use std::sync::Arc;

/// Extents one read pass decoded, by first block: (offset, the decoded unit).
type DecodedUnits = PbnMap<Vec<(u16, Arc<Vec<u8>>)>>;

/// Raw blocks read with one device request at most (1 MiB).
const READ_RUN_BLOCKS_MAX: usize = 256;
/// Attempts to read a block whose content does not match its checksum (reuse races).
const READ_ATTEMPTS: usize = 2;
/// Blocks read per call to `read_blocks` (4 MiB): bounds how much of the block map cache
/// one huge read pins.
const READ_BLOCKS_PER_CALL: u64 = 1024;

/// A block's cached copy as step 2 found it.
#[derive(Clone, Default)]
struct Hit {
    block: Option<Block>,
    /// crc32c of `block` when the cache knew it.
    crc: Option<u32>,
    /// Taken from this request's prefetch of packed blocks.
    prefetched: bool,
    /// `block` is the decoded block the map entry names, not a physical block.
    fragment: bool,
}

/// A block's mapping as step 1 found it.
#[derive(Clone, Copy)]
struct Looked {
    /// Index of the block in the request.
    i: usize,
    e: MapEntry,
    /// Already answered (from memory, or zeros).
    done: bool,
    /// The block's reference count at lookup (with a tier only: its demotion hint).
    refs: u32,
    /// The tier's forget epoch of the block at lookup (with a tier only).
    epoch: u64,
}

impl Volume {
    /// Reads a checked byte range: partial blocks through a bounce block, whole blocks
    /// straight into `buf`.
    pub(crate) fn read_range(&self, offset: u64, buf: &mut [u8]) -> Result<()> {
        self.read_range_shared(offset, buf, None)
    }

    /// `read_range`, handing cached raw blocks back in `parts` (one slot per block of `buf`,
    /// `offset` block-aligned) instead of copying them into `buf` (see `Volume::read_shared`).
    pub(crate) fn read_range_shared(
        &self,
        offset: u64,
        buf: &mut [u8],
        mut parts: Option<&mut [Option<Block>]>,
    ) -> Result<()> {
        for seg in segments(offset, buf.len() as u64, READ_BLOCKS_PER_CALL) {
            #[expect(clippy::indexing_slicing, reason = "`segments` cuts `buf.len()` bytes into segments inside it")]
            let dst = &mut buf[seg.pos as usize..(seg.pos + seg.len) as usize];
            if seg.whole {
                let n = dst.len() / BLOCK_SIZE;
                let first = seg.pos as usize / BLOCK_SIZE;
                let seg_parts = parts.as_deref_mut().and_then(|p| p.get_mut(first..first + n));
                self.read_blocks(seg.lba, n, dst, seg_parts)?;
            } else {
                let mut block = vec![0u8; BLOCK_SIZE];
                self.read_blocks(seg.lba, 1, &mut block, None)?;
                #[expect(clippy::indexing_slicing, reason = "a partial segment lies inside one block")]
                let src = &block[seg.within..seg.within + dst.len()];
                dst.copy_from_slice(src);
            }
        }
        Ok(())
    }

    /// Reads whole blocks into `out` (len = n * 4096).
    /// `parts`, when given, has one slot per block (see `read_range_shared`).
    pub(crate) fn read_blocks(
        &self,
        lba0: u64,
        n: usize,
        out: &mut [u8],
        mut parts: Option<&mut [Option<Block>]>,
    ) -> Result<()> {
        assert_eq!(out.len(), n * BLOCK_SIZE, "read_blocks: buffer of {} bytes for {n} blocks", out.len());
        let mut attempts = vec![0usize; n];
        let mut todo: Vec<usize> = (0..n).collect();
        // The first pass may read through the page cache; a retry reads the device itself
        // (a stale cached page is what a checksum mismatch after a cached read may be).
        let mut cached = self.data.reads_cached();
        while !todo.is_empty() {
            let looked = self.lookup(lba0, &todo, out)?;
            let mut retry = Vec::new();
            self.fetch(lba0, &looked, out, &mut attempts, &mut retry, cached, parts.as_deref_mut())?;
            todo = retry;
            cached = false;
        }
        Ok(())
    }

    /// Step 1 (one state-lock hold): the mappings of blocks `todo`; unwritten blocks are
    /// decoded into `out` here and zero or unmapped blocks filled.
    fn lookup(&self, lba0: u64, todo: &[usize], out: &mut [u8]) -> Result<Vec<Looked>> {
        let mut looked = Vec::with_capacity(todo.len());
        let mut st = self.state.lock();
        for &i in todo {
            let lba = lba0 + i as u64;
            let e = st.map.get(lba)?;
            let dst = block_mut(out, i)?;
            let done = if e.is_data() { decode_unwritten(&st, lba, &e, dst)? } else { true };
            if !e.is_data() {
                dst.fill(0);
            }
            let (refs, epoch) = match &self.tier {
                Some(t) if !done => (u32::from(st.rc.get(e.pbn)), t.epoch(e.pbn)),
                _ => (0, 0),
            };
            looked.push(Looked { i, e, done, refs, epoch });
        }
        let durable = st.journal.durable_seq();
        st.map.evict(durable)?;
        Ok(looked)
    }

    /// Steps 2 and 3 (no lock): reads what `lookup` left, in runs or through the cache,
    /// and checks every block; blocks to retry are pushed to `retry`.
    #[expect(clippy::too_many_arguments, reason = "one pass's inputs and outputs, each used on the hot loop")]
    fn fetch(
        &self,
        lba0: u64,
        looked: &[Looked],
        out: &mut [u8],
        attempts: &mut [usize],
        retry: &mut Vec<usize>,
        cached: bool,
        mut parts: Option<&mut [Option<Block>]>,
    ) -> Result<()> {
        let packed = self.prefetch_packed(looked, cached);
        // Every block's cached copy, under one hold of the cache lock. A block this request
        // just prefetched is taken from the prefetch, not looked up again: a second touch
        // would count it as re-read and promote a one-pass scan's blocks past the cache's
        // probation queue.
        let keys: Vec<Option<(u64, Option<u16>)>> = looked
            .iter()
            .map(|l| (!l.done && !packed.contains_key(&l.e.pbn)).then(|| (l.e.pbn, l.e.fragment_of().map(|f| f.key()))))
            .collect();
        // Whether decoded blocks other than those asked for are worth offering to the cache
        // (`admits_decoded`), looked at under the same hold.
        let (found, admit) = {
            let mut c = self.cache.lock();
            (c.get_many(&keys), c.admits_decoded())
        };
        let hits: Vec<Hit> = looked
            .iter()
            .zip(found)
            .map(|(l, f)| match (f, packed.get(&l.e.pbn)) {
                _ if l.done => Hit::default(),
                (Some(f), _) => Hit { block: Some(f.block), crc: Some(f.crc), prefetched: false, fragment: f.fragment },
                (None, Some(b)) => Hit { block: Some(b.clone()), crc: None, prefetched: true, fragment: false },
                (None, None) => Hit::default(),
            })
            .collect();
        // Blocks decompressed by this pass, offered to the cache at its end (one lock), and
        // the extents decoded, by first block and offset: each is decompressed once.
        let mut decoded: Vec<(u64, u16, Block, u32)> = Vec::new();
        let mut units = DecodedUnits::default();
        // How far into each extent this request reads: an extent is decoded that far, once.
        let mut reach: PbnMap<Vec<(u16, usize)>> = PbnMap::default();
        for l in looked.iter().filter(|l| !l.done) {
            if let Some(f) = l.e.fragment_of().filter(|f| f.unit_blocks() > 1) {
                let v = reach.entry(l.e.pbn).or_default();
                match v.iter_mut().find(|(off, _)| *off == f.off) {
                    Some((_, r)) => *r = (*r).max(f.sub() + 1),
                    None => v.push((f.off, f.sub() + 1)),
                }
            }
        }
        let mut k = 0;
        while let Some(&Looked { i, e, done, refs, epoch }) = looked.get(k) {
            if done {
                k += 1;
                continue;
            }
            if !self.data.contains(e.pbn) {
                return Err(Error::corruption(
                    "block map entry of logical block",
                    lba0 + i as u64,
                    format!("a physical block below {}", self.data.blocks()),
                    format!("physical block {}", e.pbn),
                ));
            }
            let Hit { block: cached_block, crc: cached_crc, prefetched: from_prefetch, fragment } =
                hits.get(k).cloned().unwrap_or_default();
            if let (true, Some(block)) = (fragment, &cached_block) {
                // Already decompressed: shared or copied like a cached raw block.
                let matched = cached_crc == Some(e.crc);
                deliver(parts.as_deref_mut(), i, block, matched, block_mut(out, i)?);
                if !matched {
                    self.read_mismatch(lba0, i, e, attempts, retry)?;
                }
                k += 1;
                continue;
            }
            let in_tier = self.tier_holds(e.pbn);
            let run = if cached_block.is_none() && e.fragment_of().is_none() && !in_tier {
                self.raw_run(looked, &hits, k)
            } else {
                0
            };
            // A lone block goes through the cache (random re-reads hit it).
            if run >= 2 {
                let blocks = out.len() / BLOCK_SIZE;
                let dst = out.get_mut(i * BLOCK_SIZE..(i + run) * BLOCK_SIZE).ok_or_else(|| {
                    Error::internal(
                        "read run outside the caller's buffer",
                        format!("blocks {i}..{} of {blocks}", i + run),
                    )
                })?;
                self.read_data(cached, e.pbn, dst)?;
                if let Some(t) = &self.tier {
                    t.note_misses(run as u64);
                }
                let mut good = Vec::with_capacity(run);
                for (j, l) in looked.iter().skip(k).take(run).enumerate() {
                    #[expect(clippy::indexing_slicing, reason = "`j < run` and `dst` holds `run` blocks")]
                    let got = &dst[j * BLOCK_SIZE..(j + 1) * BLOCK_SIZE];
                    if crc32c::crc32c(got) != l.e.crc {
                        self.read_mismatch(lba0, l.i, l.e, attempts, retry)?;
                    } else if !cached {
                        good.push((l.e.pbn, Block::from(got), l.e.crc));
                    }
                }
                // Offered to the cache (the page cache keeps them under read-cached I/O):
                // S3-FIFO admits them to its probationary queue, so a one-pass scan cannot
                // flush the blocks read again and again, and a working set that fits the
                // cache is served from memory from its second pass on.
                if !good.is_empty() {
                    let mut cache = self.cache.lock();
                    for (pbn, b, crc) in good {
                        cache.fill(pbn, b, crc);
                    }
                }
                k += run;
                continue;
            }
            let dst = block_mut(out, i)?;
            if cached_block.is_none() && e.fragment_of().is_none() && cached && !in_tier {
                // The page cache keeps raw blocks: straight into the reply, no copy kept.
                self.read_data(true, e.pbn, dst)?;
                if crc32c::crc32c(dst) != e.crc {
                    self.read_mismatch(lba0, i, e, attempts, retry)?;
                }
                k += 1;
                continue;
            }
            let (block, crc, from_tier) = match cached_block {
                Some(b) => (b, cached_crc, false),
                None => self.physical_block(e.pbn, cached)?,
            };
            let ok = match e.fragment_of() {
                // A raw block's crc is its content's: the cache's, computed when the block
                // entered it, stands for hashing the copy again.
                // A caller taking shared blocks gets the block itself, not a copy.
                None => {
                    let matched = crc.unwrap_or_else(|| crc32c::crc32c(&block)) == e.crc;
                    deliver(parts.as_deref_mut(), i, &block, matched, dst);
                    matched
                }
                Some(f) => {
                    let upto = reach
                        .get(&e.pbn)
                        .and_then(|v| v.iter().find(|(off, _)| *off == f.off))
                        .map_or(f.sub() + 1, |&(_, r)| r);
                    let ok = self.decode_fragment(
                        e.pbn,
                        &f,
                        upto,
                        &block,
                        cached,
                        &packed,
                        &mut units,
                        admit.then_some(&mut decoded),
                        dst,
                    ) && crc32c::crc32c(dst) == e.crc;
                    // Offered to the cache only when it keeps decoded blocks now (it drops
                    // them otherwise): no copy made for nothing.
                    if ok && admit {
                        decoded.push((e.pbn, f.key(), Block::from(&*dst), e.crc));
                    }
                    ok
                }
            };
            if !ok {
                self.read_mismatch(lba0, i, e, attempts, retry)?;
            } else if let Some(t) = self.tier.as_ref().filter(|_| !from_tier && !from_prefetch) {
                // A block of a prefetched run came in a sequential read: not noted.
                t.note_read(e.pbn, e.fragment_of(), &block, refs, epoch);
            }
            k += 1;
        }
        if !decoded.is_empty() {
            let mut cache = self.cache.lock();
            for (pbn, key, b, crc) in decoded {
                cache.fill_fragment(pbn, key, b, crc);
            }
        }
        Ok(())
    }

    /// Reads the blocks of the compressed fragments the request needs and the cache
    /// lacks, merging blocks that are consecutive on the device into one request
    /// (compressed data is packed in placement order, so a large read of it meets runs of
    /// packed blocks). They are also offered to the cache. A run that fails to read is left
    /// out: its blocks are then read one by one, and an error names the block it belongs to.
    fn prefetch_packed(&self, looked: &[Looked], cached: bool) -> PbnMap<Block> {
        let mut got = PbnMap::default();
        let mut pbns: Vec<u64> = {
            let cache = self.cache.lock();
            looked
                .iter()
                .filter(|l| {
                    !l.done
                        && l.e.fragment_of().is_some_and(|f| !cache.contains(cache::fragment_key(l.e.pbn, f.key())))
                        && self.data.contains(l.e.pbn)
                        && self.data.contains(l.e.pbn + l.e.span() - 1)
                })
                .flat_map(|l| l.e.blocks())
                .filter(|&p| !cache.contains(p) && !self.tier_holds(p))
                .collect()
        };
        pbns.sort_unstable();
        pbns.dedup();
        let mut rest = pbns.as_slice();
        while let Some((&start, _)) = rest.split_first() {
            let run =
                rest.iter().zip(start..).take(READ_RUN_BLOCKS_MAX).take_while(|(&p, want)| p == *want).count().max(1);
            let (_, tail) = rest.split_at(run.min(rest.len()));
            rest = tail;
            // A lone block goes through the cache and the tier one by one (where a re-read
            // of it is noticed).
            if run < 2 {
                continue;
            }
            let mut buf = vec![0u8; run * BLOCK_SIZE];
            if self.read_data(cached, start, &mut buf).is_err() {
                continue;
            }
            if let Some(t) = &self.tier {
                t.note_misses(run as u64);
            }
            let blocks: Vec<(u64, Block, u32)> = (start..)
                .zip(buf.chunks_exact(BLOCK_SIZE))
                .map(|(pbn, bytes)| (pbn, Block::from(bytes), cache::block_crc(bytes)))
                .collect();
            let mut cache = self.cache.lock();
            for (pbn, b, crc) in blocks {
                cache.fill(pbn, b.clone(), crc);
                got.insert(pbn, b);
            }
        }
        got
    }

    /// Length of the run of raw blocks starting at `looked[k]` that are consecutive both
    /// in the request and on the device, in the data region, not cached (`hits`) and not
    /// in the tier.
    fn raw_run(&self, looked: &[Looked], hits: &[Hit], k: usize) -> usize {
        let Some(first) = looked.get(k) else { return 0 };
        let mut run = 1usize;
        while run < READ_RUN_BLOCKS_MAX {
            match looked.get(k + run) {
                Some(l)
                    if !l.done
                        && l.i == first.i + run
                        && l.e.is_data()
                        && l.e.fragment_of().is_none()
                        && l.e.pbn == first.e.pbn + run as u64
                        && self.data.contains(l.e.pbn)
                        && hits.get(k + run).is_some_and(|h| h.block.is_none())
                        && !self.tier_holds(l.e.pbn) =>
                {
                    run += 1
                }
                _ => break,
            }
        }
        run
    }

    /// A block read back with the wrong checksum: drops any cached copy and queues a retry
    /// from a fresh mapping (the block may have been freed and reused meanwhile), or
    /// reports corruption once the attempts are spent.
    fn read_mismatch(
        &self,
        lba0: u64,
        i: usize,
        e: MapEntry,
        attempts: &mut [usize],
        retry: &mut Vec<usize>,
    ) -> Result<()> {
        {
            let mut cache = self.cache.lock();
            for p in e.blocks() {
                cache.remove(p);
            }
        }
        self.data.drop_cached(e.pbn, e.span().max(1));
        // The copy may be the tier's (of any block the fragment touches): the retry then
        // reads the data device.
        if let Some(t) = &self.tier {
            for p in e.blocks() {
                t.forget(p);
            }
        }
        let spent = attempts.get_mut(i).map(|a| {
            *a += 1;
            *a >= READ_ATTEMPTS
        });
        if spent != Some(false) {
            self.forget_damaged(&mut self.state.lock(), e.pbn);
            return Err(Error::corruption(
                "stored data of logical block",
                lba0 + i as u64,
                format!("content matching its checksum (crc32c {:#010x})", e.crc),
                format!(
                    "other content in physical block {}{}",
                    e.pbn,
                    e.fragment_of()
                        .map(|f| format!(
                            " (fragment of {} bytes at offset {}, block {} of {})",
                            f.len,
                            f.off,
                            f.sub(),
                            f.unit_blocks()
                        ))
                        .unwrap_or_default()
                ),
            ));
        }
        retry.push(i);
        Ok(())
    }

    /// Takes a block whose stored content failed its checksum out of deduplication (and
    /// the cache): a write of the same content then stores a fresh copy, and a rewrite of
    /// the damaged logical block heals it. State lock held.
    pub(crate) fn forget_damaged(&self, st: &mut State, pbn: u64) {
        self.cache.lock().remove(pbn);
        if let Some(t) = &self.tier {
            t.forget(pbn);
        }
        st.dedup.forget_damaged(pbn);
    }

    /// Reads data blocks from `pbn` into `buf`, through the page cache when `cached`.
    fn read_data(&self, cached: bool, pbn: u64, buf: &mut [u8]) -> Result<()> {
        if cached {
            self.data.read_cached(IoKind::Data, pbn, buf, "block map entry")
        } else {
            self.data.read(IoKind::Data, pbn, buf, "block map entry")
        }
    }

    /// Decodes block `f.sub()` of the fragment starting in `pbn`, whose first block is
    /// `first`, into `dst`: the following blocks it runs into come from this request's
    /// prefetch, the cache, the tier or the device; an extent is decoded once per pass, its
    /// first `upto` blocks (as far as the request reads into it), and its other decoded
    /// blocks are offered to the cache. False when
    /// a block cannot be read or the fragment does not decode (the caller's crc check
    /// then retries).
    #[expect(clippy::too_many_arguments, reason = "the pass's prefetch, memo and outputs")]
    fn decode_fragment(
        &self,
        pbn: u64,
        f: &Frag,
        upto: usize,
        first: &Block,
        cached: bool,
        prefetched: &PbnMap<Block>,
        units: &mut DecodedUnits,
        decoded: Option<&mut Vec<(u64, u16, Block, u32)>>,
        dst: &mut [u8],
    ) -> bool {
        let sub = f.sub() * BLOCK_SIZE;
        if f.unit_blocks() > 1 {
            if let Some((_, u)) = units.get(&pbn).and_then(|v| v.iter().find(|(off, _)| *off == f.off)) {
                return match u.get(sub..sub + BLOCK_SIZE) {
                    Some(b) => {
                        dst.copy_from_slice(b);
                        true
                    }
                    None => false,
                };
            }
        }
        let mut span: Vec<u8> = Vec::with_capacity(f.span() as usize * BLOCK_SIZE);
        span.extend_from_slice(first);
        for p in pbn + 1..pbn + f.span() {
            let b = match prefetched.get(&p) {
                Some(b) => b.clone(),
                None => match self.physical_block(p, cached) {
                    Ok((b, _, _)) => b,
                    Err(_) => return false,
                },
            };
            span.extend_from_slice(&b);
        }
        if f.unit_blocks() == 1 {
            return packer::decode_block(pbn, f, &span, dst).is_ok();
        }
        let Ok(bytes) = packer::fragment_bytes(pbn, f, &span) else { return false };
        // Decoded only as far as this request reads into it.
        let upto = upto.clamp(f.sub() + 1, f.unit_blocks());
        let Ok(unit) = packer::decompress_prefix(pbn, f, bytes, upto) else { return false };
        let Some(b) = unit.get(sub..sub + BLOCK_SIZE) else { return false };
        dst.copy_from_slice(b);
        // The unit's other blocks, for the cache when it has room for them: their own map
        // entries check them again when they are read.
        if let Some(decoded) = decoded {
            for (k, bytes) in unit.chunks_exact(BLOCK_SIZE).enumerate() {
                if k != f.sub() {
                    decoded.push((pbn, f.with_sub(k).key(), Block::from(bytes), cache::block_crc(bytes)));
                }
            }
        }
        units.entry(pbn).or_default().push((f.off, Arc::new(unit)));
        true
    }

    /// True when the hot-chunk tier serves `pbn`.
    fn tier_holds(&self, pbn: u64) -> bool {
        self.tier.as_ref().is_some_and(|t| t.holds(pbn))
    }

    /// A physical block, from the content cache, the hot-chunk tier or the device (then
    /// cached, through the page cache when `cached`), the crc32c of its content, and true
    /// when the tier served it.
    fn physical_block(&self, pbn: u64, cached: bool) -> Result<(Block, Option<u32>, bool)> {
        if let Some((b, crc)) = self.cache.lock().get_with_crc(pbn) {
            return Ok((b, Some(crc), false));
        }
        if let Some(b) = self.tier.as_ref().and_then(|t| t.read(pbn)) {
            let crc = cache::block_crc(&b);
            self.cache.lock().fill(pbn, b.clone(), crc);
            return Ok((b, Some(crc), true));
        }
        let mut b = new_block();
        let buf = b
            .get_mut()
            .ok_or_else(|| Error::internal("a freshly allocated block is shared", format!("physical block {pbn}")))?;
        self.read_data(cached, pbn, buf)?;
        let crc = cache::block_crc(&b);
        self.cache.lock().fill(pbn, b.clone(), crc);
        Ok((b, Some(crc), false))
    }
}

/// Hands a whole cached block (raw, or a decompressed fragment) as block `i` of a read:
/// in place through `parts` when the caller takes shared blocks and its crc `matched`,
/// else copied into `dst` (a mismatch is retried, which overwrites it).
fn deliver(parts: Option<&mut [Option<Block>]>, i: usize, block: &Block, matched: bool, dst: &mut [u8]) {
    match parts.and_then(|p| p.get_mut(i)) {
        Some(part) if matched => *part = Some(block.clone()),
        _ => dst.copy_from_slice(block),
    }
}

/// The `i`th block of `out`.
fn block_mut(out: &mut [u8], i: usize) -> Result<&mut [u8]> {
    let blocks = out.len() / BLOCK_SIZE;
    out.get_mut(i * BLOCK_SIZE..(i + 1) * BLOCK_SIZE)
        .ok_or_else(|| Error::internal("read of a block outside the caller's buffer", format!("block {i} of {blocks}")))
}

/// Decodes an unwritten block into `dst`: Ok(true) when it was unwritten (and matched),
/// Ok(false) when the device holds it.
fn decode_unwritten(st: &State, lba: u64, e: &MapEntry, dst: &mut [u8]) -> Result<bool> {
    match st.unwritten(e, dst) {
        None => Ok(false),
        Some(true) if crc32c::crc32c(dst) == e.crc => Ok(true),
        Some(_) => Err(Error::corruption(
            "unwritten data of logical block",
            lba,
            format!("content matching its checksum (crc32c {:#010x})", e.crc),
            format!("other content in unwritten physical block {}", e.pbn),
        )),
    }
}
